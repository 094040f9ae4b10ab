//! Objects as the store sees them (JSON with apiVersion/kind/metadata/spec/status), revisions,
//! watch events, and the validation every backend runs at its boundary.

use std::fmt;

use flotilla_proto::api::Kind;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::StoreError;

/// A stored object: a JSON map with `apiVersion`, `kind`, `metadata`, and usually `spec` and
/// `status`, exactly as `kubectl get -o json` shows it.
pub type Object = Value;

/// The largest object the store accepts, serialized as JSON: 1.5 MiB, etcd's default request
/// limit and so the largest object a kube-apiserver can store. Both backends refuse larger ones
/// with the same message, so an object that fits one fits the other.
pub const MAX_OBJECT_BYTES: usize = 1_572_864;

/// A point in the store's history, as found in `metadata.resourceVersion`. Opaque: compare for
/// equality only (the sled backend uses a decimal counter, the kube backend etcd's revision).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Revision(String);

impl Revision {
    pub fn new(revision: impl Into<String>) -> Self {
        Revision(revision.into())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The object's `metadata.resourceVersion`, if it has one.
    pub fn of(object: &Object) -> Option<Revision> {
        resource_version(object).map(Revision::new)
    }
}

impl fmt::Display for Revision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Objects of one kind (one namespace, or all) and the revision they were read at: a watch from
/// that revision sees every change after the list and none before it.
#[derive(Clone, Debug)]
pub struct ObjectList {
    pub items: Vec<Object>,
    pub revision: Revision,
}

/// A change to one object. `Deleted` carries the object as it was, stamped with the revision of
/// the deletion.
#[derive(Clone, Debug, PartialEq)]
pub enum WatchEvent {
    Added(Object),
    Modified(Object),
    Deleted(Object),
}

impl WatchEvent {
    pub fn object(&self) -> &Object {
        match self {
            WatchEvent::Added(o) | WatchEvent::Modified(o) | WatchEvent::Deleted(o) => o,
        }
    }

    pub fn into_object(self) -> Object {
        match self {
            WatchEvent::Added(o) | WatchEvent::Modified(o) | WatchEvent::Deleted(o) => o,
        }
    }

    /// The revision of this change (the object's `metadata.resourceVersion`): resume a watch from
    /// here to see only later changes.
    pub fn revision(&self) -> Option<Revision> {
        Revision::of(self.object())
    }
}

/// `metadata.name`, or "" when absent.
pub fn name_of(object: &Object) -> &str {
    meta_str(object, "name").unwrap_or("")
}

/// `metadata.namespace`, if set and not empty.
pub fn namespace_of(object: &Object) -> Option<&str> {
    meta_str(object, "namespace").filter(|ns| !ns.is_empty())
}

/// `metadata.resourceVersion`, if set and not empty.
pub fn resource_version(object: &Object) -> Option<&str> {
    meta_str(object, "resourceVersion").filter(|rv| !rv.is_empty())
}

/// `metadata.generation`, 0 when absent.
pub fn generation_of(object: &Object) -> i64 {
    object
        .pointer("/metadata/generation")
        .and_then(Value::as_i64)
        .unwrap_or(0)
}

fn meta_str<'a>(object: &'a Object, field: &str) -> Option<&'a str> {
    object.get("metadata")?.get(field)?.as_str()
}

/// Sets `metadata.<field>`, creating `metadata` if needed. Callers have validated `object` is a map.
pub(crate) fn set_meta(object: &mut Object, field: &str, value: Value) {
    if let Some(map) = object.as_object_mut() {
        let meta = map
            .entry("metadata")
            .or_insert_with(|| Value::Object(Map::new()));
        if let Some(meta) = meta.as_object_mut() {
            meta.insert(field.to_owned(), value);
        }
    }
}

pub(crate) fn remove_meta(object: &mut Object, field: &str) {
    if let Some(meta) = object.get_mut("metadata").and_then(Value::as_object_mut) {
        meta.remove(field);
    }
}

/// Where an object lives: the store's key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ObjectKey {
    pub kind: Kind,
    pub namespace: Option<String>,
    pub name: String,
}

impl ObjectKey {
    pub fn new(kind: Kind, namespace: Option<&str>, name: &str) -> Self {
        ObjectKey {
            kind,
            namespace: namespace.map(str::to_owned),
            name: name.to_owned(),
        }
    }

    pub fn namespace(&self) -> Option<&str> {
        self.namespace.as_deref()
    }

    pub fn not_found(&self) -> StoreError {
        StoreError::NotFound {
            kind: self.kind,
            namespace: self.namespace.clone(),
            name: self.name.clone(),
        }
    }

    pub fn already_exists(&self) -> StoreError {
        StoreError::AlreadyExists {
            kind: self.kind,
            namespace: self.namespace.clone(),
            name: self.name.clone(),
        }
    }

    pub fn conflict(&self, reason: impl Into<String>) -> StoreError {
        StoreError::Conflict {
            kind: self.kind,
            namespace: self.namespace.clone(),
            name: self.name.clone(),
            reason: reason.into(),
        }
    }

    pub fn invalid(&self, reason: impl Into<String>) -> StoreError {
        StoreError::invalid(self.kind.name(), self.namespace(), &self.name, reason)
    }
}

impl fmt::Display for ObjectKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.namespace {
            Some(ns) => write!(f, "{} {ns}/{}", self.kind, self.name),
            None => write!(f, "{} {}", self.kind, self.name),
        }
    }
}

/// Checks an object at the store boundary and returns its key: apiVersion and kind of a stored
/// kind, a DNS-1123 name, a namespace exactly when the kind is namespaced, a ConfigMap's rules
/// (`flotilla_proto::api::check_config_map`), and at most [`MAX_OBJECT_BYTES`].
pub(crate) fn validate(object: &Object) -> Result<ObjectKey, StoreError> {
    let name = name_of(object);
    let namespace = namespace_of(object);
    let Some(map) = object.as_object() else {
        return Err(StoreError::invalid(
            "object",
            None,
            "",
            "must be a JSON map with apiVersion, kind and metadata",
        ));
    };
    let kind_field = map.get("kind").and_then(Value::as_str).unwrap_or("");
    let Some(kind) = Kind::from_name(kind_field) else {
        let stored: Vec<&str> = Kind::ALL.iter().map(|k| k.name()).collect();
        let given = if kind_field.is_empty() {
            "object"
        } else {
            kind_field
        };
        let reason = if kind_field.is_empty() {
            "kind is required".to_owned()
        } else {
            format!("kind {kind_field} is not stored by flotilla")
        };
        return Err(StoreError::invalid(
            given,
            namespace,
            name,
            format!("{reason}; the stored kinds are {}", stored.join(", ")),
        ));
    };
    let invalid = |reason: String| StoreError::invalid(kind.name(), namespace, name, reason);

    let api_version = map.get("apiVersion").and_then(Value::as_str).unwrap_or("");
    if api_version != kind.api_version() {
        return Err(invalid(format!(
            "apiVersion {api_version:?} is not served for {kind}: use {}",
            kind.api_version()
        )));
    }
    if !map.get("metadata").is_some_and(Value::is_object) {
        return Err(invalid("metadata is required".into()));
    }
    if name.is_empty() {
        return Err(invalid(
            "metadata.name is required (generateName is not supported)".into(),
        ));
    }
    if !is_dns1123_subdomain(name) {
        return Err(invalid(format!(
            "metadata.name {name:?} is not a valid DNS-1123 subdomain: use at most 253 lower-case \
             letters, digits, '-' and '.', starting and ending with a letter or digit"
        )));
    }
    match (kind.namespaced(), namespace) {
        (true, None) => {
            return Err(invalid(format!(
                "metadata.namespace is required: {kind} is namespaced"
            )));
        }
        (false, Some(ns)) => {
            return Err(invalid(format!(
                "{kind} is cluster-scoped: remove metadata.namespace {ns:?}"
            )));
        }
        (true, Some(ns)) if !flotilla_proto::contract::is_dns1123_label(ns) => {
            return Err(invalid(format!(
                "metadata.namespace {ns:?} is not a valid DNS-1123 label: use at most 63 \
                 lower-case letters, digits and '-', starting and ending with a letter or digit"
            )));
        }
        _ => {}
    }
    if kind == Kind::ConfigMap {
        // No CRD schema behind it: the rules the apiserver applies to a ConfigMap, applied
        // here too, so both backends refuse the same ones with the same words.
        let problems = flotilla_proto::api::check_config_map(object);
        if !problems.is_empty() {
            return Err(invalid(problems.join("; ")));
        }
    }
    check_size(json_len(object), || ObjectKey::new(kind, namespace, name))?;
    Ok(ObjectKey::new(kind, namespace, name))
}

/// Refuses a status write to a kind that has no status (see [`Kind::has_status`]): the
/// apiserver serves no status subresource for it, and sled refuses the same.
pub(crate) fn check_has_status(key: &ObjectKey) -> Result<(), StoreError> {
    if key.kind.has_status() {
        return Ok(());
    }
    Err(key.invalid(format!(
        "a {} has no status to write (it has no status subresource)",
        key.kind
    )))
}

/// Refuses a replacement the stored object forbids: an immutable ConfigMap's data. The
/// apiserver applies the same rule itself.
pub(crate) fn check_replacement(
    key: &ObjectKey,
    stored: &Object,
    new: &Object,
) -> Result<(), StoreError> {
    if key.kind == Kind::ConfigMap
        && let Some(problem) = flotilla_proto::api::config_map::check_config_map_update(stored, new)
    {
        return Err(key.invalid(problem));
    }
    Ok(())
}

/// Checks that a namespace argument fits the kind: required for namespaced kinds when `required`
/// (get, update, delete), allowed to be absent for them otherwise (list and watch across all
/// namespaces), and never present for cluster-scoped kinds.
pub(crate) fn check_scope(
    kind: Kind,
    namespace: Option<&str>,
    name: &str,
    required: bool,
) -> Result<(), StoreError> {
    let namespace = namespace.filter(|ns| !ns.is_empty());
    match (kind.namespaced(), namespace) {
        (false, Some(ns)) => Err(StoreError::invalid(
            kind.name(),
            Some(ns),
            name,
            format!("{kind} is cluster-scoped: ask without a namespace"),
        )),
        (true, None) if required => Err(StoreError::invalid(
            kind.name(),
            None,
            name,
            format!("{kind} is namespaced: name the namespace"),
        )),
        _ => Ok(()),
    }
}

/// Refuses `len` bytes when over [`MAX_OBJECT_BYTES`]; `key` names the object in the error.
pub(crate) fn check_size(len: usize, key: impl FnOnce() -> ObjectKey) -> Result<(), StoreError> {
    if len > MAX_OBJECT_BYTES {
        return Err(key().invalid(format!(
            "is {len} bytes, the limit is {MAX_OBJECT_BYTES} bytes"
        )));
    }
    Ok(())
}

/// The length of `value` serialized as compact JSON, without building the string.
pub(crate) fn json_len(value: &Value) -> usize {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len();
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut count = Count(0);
    // Writing a Value to an infallible writer cannot fail.
    let _ = serde_json::to_writer(&mut count, value);
    count.0
}

/// Whether anything outside `metadata` and `status` differs: what the apiserver bumps
/// `metadata.generation` for.
pub(crate) fn spec_changed(old: &Object, new: &Object) -> bool {
    let desired = |o: &Object| -> Map<String, Value> {
        o.as_object()
            .map(|m| {
                m.iter()
                    .filter(|(k, _)| {
                        !matches!(k.as_str(), "metadata" | "status" | "apiVersion" | "kind")
                    })
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect()
            })
            .unwrap_or_default()
    };
    desired(old) != desired(new)
}

fn is_label_chars(s: &str) -> bool {
    let bytes = s.as_bytes();
    let alnum = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit();
    !bytes.is_empty()
        && alnum(bytes[0])
        && alnum(bytes[bytes.len() - 1])
        && bytes.iter().all(|&b| alnum(b) || b == b'-')
}

fn is_dns1123_subdomain(s: &str) -> bool {
    !s.is_empty() && s.len() <= 253 && s.split('.').all(is_label_chars)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn work(namespace: Option<&str>, name: &str) -> Object {
        let mut o = json!({
            "apiVersion": "work.open-cluster-management.io/v1",
            "kind": "ManifestWork",
            "metadata": {"name": name},
            "spec": {},
        });
        if let Some(ns) = namespace {
            o["metadata"]["namespace"] = json!(ns);
        }
        o
    }

    /// `Ok(())` when valid, else a piece the error message must contain.
    fn check(object: Object, expected: Result<(), &str>) {
        match (validate(&object), expected) {
            (Ok(_), Ok(())) => {}
            (Err(e), Err(want)) => assert!(
                e.to_string().contains(want),
                "{object}: error {e:?} does not mention {want:?}"
            ),
            (got, want) => panic!("{object}: got {got:?}, want {want:?}"),
        }
    }

    #[test]
    fn validation() {
        check(work(Some("store-7"), "baseline"), Ok(()));
        check(work(Some("store-7"), "a.b-c.d"), Ok(()));
        check(work(Some("store-7"), ""), Err("metadata.name is required"));
        check(work(Some("store-7"), "Baseline"), Err("DNS-1123 subdomain"));
        check(work(Some("store-7"), "a..b"), Err("DNS-1123 subdomain"));
        check(work(Some("store-7"), "-a"), Err("DNS-1123 subdomain"));
        check(
            work(Some("store-7"), &"a".repeat(254)),
            Err("DNS-1123 subdomain"),
        );
        check(
            work(None, "baseline"),
            Err("metadata.namespace is required"),
        );
        check(work(Some("store.7"), "baseline"), Err("DNS-1123 label"));
        check(
            json!({"apiVersion": "cluster.open-cluster-management.io/v1", "kind": "ManagedCluster",
                   "metadata": {"name": "store-7", "namespace": "x"}}),
            Err("cluster-scoped"),
        );
        check(
            json!({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"}}),
            Err("kind Deployment is not stored by flotilla"),
        );
        check(
            json!({"apiVersion": "work.open-cluster-management.io/v2", "kind": "ManifestWork",
                   "metadata": {"name": "x", "namespace": "y"}}),
            Err("use work.open-cluster-management.io/v1"),
        );
        check(json!([1, 2]), Err("JSON map"));
        let config_map = |data: Value| {
            json!({"apiVersion": "v1", "kind": "ConfigMap",
                   "metadata": {"name": "settings", "namespace": "policies"}, "data": data})
        };
        check(config_map(json!({"tier": "gold"})), Ok(()));
        check(
            config_map(json!({"replicas": 3})),
            Err(
                "ConfigMap policies/settings: data.replicas is a number; ConfigMap data values are strings",
            ),
        );
        check(
            json!({"apiVersion": "core/v1", "kind": "ConfigMap",
                   "metadata": {"name": "settings", "namespace": "policies"}}),
            Err("apiVersion \"core/v1\" is not served for ConfigMap: use v1"),
        );
        check(json!({"metadata": {"name": "x"}}), Err("kind is required"));
        let mut big = work(Some("store-7"), "big");
        big["spec"]["blob"] = json!("x".repeat(MAX_OBJECT_BYTES));
        let len = json_len(&big);
        check(
            big,
            Err(&format!("is {len} bytes, the limit is 1572864 bytes")),
        );
    }

    #[test]
    fn generation_follows_everything_but_metadata_and_status() {
        let a = work(Some("n"), "a");
        let mut labelled = a.clone();
        labelled["metadata"]["labels"] = json!({"x": "y"});
        labelled["status"] = json!({"conditions": []});
        assert!(!spec_changed(&a, &labelled));
        let mut respecced = a.clone();
        respecced["spec"]["deleteOption"] = json!({"propagationPolicy": "Orphan"});
        assert!(spec_changed(&a, &respecced));
    }

    #[test]
    fn json_len_matches_serialization() {
        let o = work(Some("n"), "a");
        assert_eq!(json_len(&o), serde_json::to_vec(&o).unwrap().len());
    }
}
