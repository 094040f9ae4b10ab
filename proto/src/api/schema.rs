//! Schemas of shared Kubernetes types as OCM's CRDs validate them, for the fields whose
//! k8s-openapi schema is looser: metav1.Condition's patterns and bounds, LabelSelector's atomic
//! list and map types. Used through `#[schemars(schema_with = ...)]`; the facts are checked
//! against OCM's CRDs by proto/tests/ocm_schemas.rs.

use schemars::{Schema, SchemaGenerator, json_schema};
use serde_json::Value;

/// A qualified name as Kubernetes validates label keys and condition types: an optional DNS
/// subdomain prefix and `/`, then a name of at most 63 characters.
pub(crate) const QUALIFIED_NAME: &str = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$";
/// A DNS label: a namespace's name.
pub(crate) const DNS_LABEL: &str = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$";
/// A DNS subdomain: a service account's name and namespace.
pub(crate) const DNS_SUBDOMAIN: &str =
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*)$";

/// One metav1.Condition as the apiserver validates it (its kubebuilder markers).
fn condition() -> Value {
    serde_json::json!({
        "type": "object",
        "required": ["lastTransitionTime", "message", "reason", "status", "type"],
        "properties": {
            "lastTransitionTime": { "type": "string", "format": "date-time" },
            "message": { "type": "string", "maxLength": 32768 },
            "observedGeneration": { "type": "integer", "format": "int64", "minimum": 0 },
            "reason": {
                "type": "string",
                "maxLength": 1024,
                "minLength": 1,
                "pattern": "^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$",
            },
            "status": { "type": "string", "enum": ["True", "False", "Unknown"] },
            "type": { "type": "string", "maxLength": 316, "pattern": QUALIFIED_NAME },
        },
    })
}

/// A list of conditions keyed by type (`+listType=map`, `+listMapKeys=type`): server-side
/// apply merges them per condition.
pub(crate) fn condition_map(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "array",
        "items": condition(),
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["type"],
    })
}

/// A list of conditions without a list type, as OCM's cluster sets and bindings declare it.
pub(crate) fn condition_list(_: &mut SchemaGenerator) -> Schema {
    json_schema!({ "type": "array", "items": condition() })
}

/// Label-selector requirements (`key`, `operator`, `values`); `values` is an atomic list.
fn requirements() -> Value {
    serde_json::json!({
        "type": "array",
        "items": {
            "type": "object",
            "required": ["key", "operator"],
            "properties": {
                "key": { "type": "string" },
                "operator": { "type": "string" },
                "values": {
                    "type": "array",
                    "items": { "type": "string" },
                    "x-kubernetes-list-type": "atomic",
                },
            },
        },
    })
}

/// A metav1.LabelSelector: an atomic map whose `matchExpressions` is an atomic list.
pub(crate) fn label_selector(_: &mut SchemaGenerator) -> Schema {
    let mut expressions = requirements();
    expressions["x-kubernetes-list-type"] = "atomic".into();
    json_schema!({
        "type": "object",
        "properties": {
            "matchExpressions": expressions,
            "matchLabels": { "type": "object", "additionalProperties": { "type": "string" } },
        },
        "x-kubernetes-map-type": "atomic",
    })
}

/// A claim selector's `matchExpressions`: label-selector requirements over claim names.
pub(crate) fn claim_requirements(_: &mut SchemaGenerator) -> Schema {
    Schema::try_from(requirements()).expect("requirements are a schema object")
}

/// Drops `required` from an object's schema, for types whose fields OCM's schema leaves optional
/// though an object without them means nothing: our parse still refuses such an object, with a
/// message naming the field.
pub(crate) fn optional_fields(schema: &mut Schema) {
    schema.remove("required");
}
