//! Our CRDs' schemas against Open Cluster Management's own, kind by kind.
//!
//! `ocm_schemas/<plural>.txt` hold the facts of OCM's CRD schemas (one line per schema node:
//! type, format, enum, default, pattern, bounds, required properties, list and map types, CEL
//! rules; no descriptions), written by `scripts/ocm-schema-facts.py` from a checkout of
//! open-cluster-management-io/api (and, for the governance kinds, of
//! open-cluster-management-io/governance-policy-propagator). This test renders the same facts
//! from the CRDs our types generate and compares: every node OCM has must be in ours with the
//! same facts (or be one of [`OCM_FIELDS_LEFT_OUT`]), and every node we have that OCM lacks
//! must be one of [`FLOTILLA_ADDITIONS`], each documented in deploy/crds/README.md. So OCM YAML
//! that OCM's hub accepts is accepted here (but for the fields left out, refused by name), with
//! the same defaults filled in, and YAML OCM's hub refuses is refused here too.

use std::collections::{BTreeMap, BTreeSet};

use flotilla_proto::api;
use serde_json::{Map, Value};

/// Schema nodes we have and OCM does not: flotilla's additions, by kind and path (a path and
/// everything under it). Each is described in deploy/crds/README.md.
const FLOTILLA_ADDITIONS: &[(&str, &str)] = &[
    // The fencing record of the last gateway write of the status (the store's fencing).
    ("managedclusters", "status.fence"),
    ("manifestworks", "status.fence"),
];

/// Facts we render differently from OCM on purpose, by kind, path and fact name. Each is
/// described in deploy/crds/README.md.
const FLOTILLA_DIFFERENCES: &[(&str, &str, &str)] = &[
    // The object's `spec` is required: our types need one to read the object back (OCM's Go
    // types always write it). A ManagedClusterSet's spec is defaulted, so never missing.
    ("managedclusters", ".", "required"),
    ("managedclustersets", ".", "required"),
    ("managedclustersetbindings", ".", "required"),
    ("clusterclaims", ".", "required"),
    ("manifestworks", ".", "required"),
    ("manifestworkreplicasets", ".", "required"),
    // A PlacementDecision holds at most 100 decisions: OCM's controller splits them so, and we
    // make the bound part of the schema (every list has a bound).
    ("placementdecisions", "status.decisions", "maxItems"),
    // Governance's lists have bounds too (proto's MAX_POLICY_TEMPLATES, MAX_SUBJECTS,
    // MAX_SET_POLICIES).
    ("policies", "spec.policy-templates", "maxItems"),
    ("placementbindings", "subjects", "maxItems"),
    ("policysets", "spec.policies", "maxItems"),
    // Only a Placement binds: OCM's deprecated PlacementRule is refused.
    ("placementbindings", "placementRef.apiGroup", "enum"),
    ("placementbindings", "placementRef.kind", "enum"),
];

/// OCM's fields our schemas leave out on purpose, by kind and path (a path and everything
/// under it): spec fields flotilla refuses by name at apply (an unknown field to kubectl's
/// strict validation on the kube backend), and status fields only OCM's replication writes.
/// Each is described in deploy/crds/README.md.
const OCM_FIELDS_LEFT_OUT: &[(&str, &str)] = &[
    ("policies", "spec.dependencies"),
    ("policies", "spec.hubTemplateOptions"),
    ("policies", "spec.policy-templates[].extraDependencies"),
    ("policies", "status.placement[].decisions"),
    ("policies", "status.placement[].exclusions"),
    ("policies", "status.placement[].placementRule"),
    ("policies", "status.status[].remainingBindings"),
    ("placementbindings", "bindingOverrides"),
    ("placementbindings", "subFilter"),
    ("policysets", "spec.exclusions"),
    ("policysets", "status.exclusions"),
    ("policysets", "status.placement[].placementRule"),
];

/// `path` is `root` or lies under it.
fn under(path: &str, root: &str) -> bool {
    path == root
        || path
            .strip_prefix(root)
            .is_some_and(|rest| rest.starts_with(['.', '[', '{']))
}

/// The kinds compared: every kind both OCM and flotilla have, by plural.
const KINDS: &[&str] = &[
    "managedclusters",
    "managedclustersets",
    "managedclustersetbindings",
    "placements",
    "placementdecisions",
    "addonplacementscores",
    "clusterclaims",
    "manifestworks",
    "manifestworkreplicasets",
    "policies",
    "placementbindings",
    "policysets",
];

/// Where the package is: read when the test runs, so a test binary built in another checkout
/// still reads this one.
fn manifest_dir() -> std::path::PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .expect("run by cargo test, which sets CARGO_MANIFEST_DIR")
        .into()
}

fn facts_dir() -> std::path::PathBuf {
    manifest_dir().join("tests/ocm_schemas")
}

/// The facts of one schema node, by fact name (the names the script writes).
type Facts = BTreeMap<String, Value>;

/// OCM's facts of one kind: its served version and the facts of each node by path.
fn ocm_facts(plural: &str) -> (String, BTreeMap<String, Facts>) {
    let path = facts_dir().join(format!("{plural}.txt"));
    let text =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    let mut version = None;
    let mut nodes = BTreeMap::new();
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        if let Some(v) = line.strip_prefix("version ") {
            version = Some(v.to_owned());
            continue;
        }
        let (node, rest) = line.split_once(' ').unwrap_or((line, ""));
        nodes.insert(node.to_owned(), parse_facts(rest, plural, node));
    }
    (version.expect("a version line"), nodes)
}

/// Reads `key=<json> key=<json> ...`; a JSON value may contain spaces, so each value runs to
/// the next ` key=` that leaves the text before it valid JSON.
fn parse_facts(mut rest: &str, plural: &str, node: &str) -> Facts {
    let mut facts = Facts::new();
    while !rest.is_empty() {
        let (key, after) = rest
            .split_once('=')
            .unwrap_or_else(|| panic!("{plural} {node}: malformed facts {rest:?}"));
        let mut stream = serde_json::Deserializer::from_str(after).into_iter::<Value>();
        let value = stream
            .next()
            .and_then(Result::ok)
            .unwrap_or_else(|| panic!("{plural} {node}: {key} is not JSON"));
        let used = stream.byte_offset();
        if key == "rule" {
            // One `rule=` per CEL rule: gathered into one list, as our side renders them.
            let rules = facts
                .entry(key.to_owned())
                .or_insert_with(|| Value::Array(Vec::new()));
            if let Value::Array(rules) = rules {
                rules.push(value);
            }
        } else {
            facts.insert(key.to_owned(), value);
        }
        rest = after[used..].trim_start();
    }
    facts
}

/// Schema keywords and the fact names they are recorded under, as the script records them.
const KEYWORDS: &[(&str, &str)] = &[
    ("type", "type"),
    ("format", "format"),
    ("enum", "enum"),
    ("default", "default"),
    ("pattern", "pattern"),
    ("minimum", "minimum"),
    ("maximum", "maximum"),
    ("minLength", "minLength"),
    ("maxLength", "maxLength"),
    ("minItems", "minItems"),
    ("maxItems", "maxItems"),
    ("required", "required"),
    ("x-kubernetes-list-type", "listType"),
    ("x-kubernetes-list-map-keys", "listMapKeys"),
    ("x-kubernetes-map-type", "mapType"),
    ("x-kubernetes-int-or-string", "intOrString"),
    (
        "x-kubernetes-preserve-unknown-fields",
        "preserveUnknownFields",
    ),
    ("x-kubernetes-embedded-resource", "embeddedResource"),
];

/// Our facts of one kind, rendered from the generated CRD like the script renders OCM's.
fn our_facts(plural: &str) -> (String, BTreeMap<String, Facts>) {
    let crd = api::crds()
        .into_iter()
        .find(|c| c.spec.names.plural == plural)
        .unwrap_or_else(|| panic!("no CRD of ours for {plural}"));
    let [version] = crd.spec.versions.as_slice() else {
        panic!("{plural}: expected one version");
    };
    let schema = version
        .schema
        .as_ref()
        .and_then(|s| s.open_api_v3_schema.as_ref())
        .expect("a schema");
    let mut schema = serde_json::to_value(schema).expect("schema to JSON");
    // Like the script: metadata is the apiserver's, apiVersion and kind the same everywhere.
    if let Some(props) = schema.get_mut("properties").and_then(Value::as_object_mut) {
        props.retain(|k, _| !matches!(k.as_str(), "apiVersion" | "kind" | "metadata"));
    }
    let mut nodes = BTreeMap::new();
    walk(&schema, "", &mut nodes);
    (version.name.clone(), nodes)
}

fn walk(node: &Value, path: &str, out: &mut BTreeMap<String, Facts>) {
    let obj = node.as_object().cloned().unwrap_or_default();
    let mut facts = Facts::new();
    for (keyword, name) in KEYWORDS {
        if let Some(value) = obj.get(*keyword) {
            let mut value = value.clone();
            if *keyword == "required"
                && let Value::Array(items) = &mut value
            {
                items.sort_by_key(|v| v.to_string());
            }
            facts.insert((*name).to_owned(), value);
        }
    }
    if let Some(Value::Array(rules)) = obj.get("x-kubernetes-validations") {
        let rules: Vec<Value> = rules
            .iter()
            .filter_map(|r| r.get("rule").cloned())
            .collect();
        facts.insert("rule".to_owned(), Value::Array(rules));
    }
    out.insert(
        if path.is_empty() {
            ".".into()
        } else {
            path.into()
        },
        facts,
    );
    let empty = Map::new();
    let props = obj
        .get("properties")
        .and_then(Value::as_object)
        .unwrap_or(&empty);
    for (name, child) in props {
        let child_path = if path.is_empty() {
            name.clone()
        } else {
            format!("{path}.{name}")
        };
        walk(child, &child_path, out);
    }
    if let Some(items @ Value::Object(_)) = obj.get("items") {
        walk(items, &format!("{path}[]"), out);
    }
    if let Some(extra @ Value::Object(_)) = obj.get("additionalProperties") {
        walk(extra, &format!("{path}{{}}"), out);
    }
}

/// A default of Go's zero value for the field's type, which is what OCM's controllers read for
/// an absent field: ours comes from a serde default and changes nothing OCM's clients see.
fn is_zero_value(value: &Value) -> bool {
    match value {
        Value::Null => true,
        Value::Bool(b) => !b,
        Value::Number(n) => n.as_f64() == Some(0.0),
        Value::String(s) => s.is_empty(),
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.values().all(is_zero_value),
    }
}

/// Numbers compare by value: OCM writes `-100`, schemars `-100.0`.
fn same(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => x.as_f64() == y.as_f64(),
        _ => a == b,
    }
}

/// Every difference between OCM's facts and ours for one kind, as `path: problem`.
fn differences(plural: &str) -> Vec<String> {
    let (ocm_version, ocm) = ocm_facts(plural);
    let (our_version, ours) = our_facts(plural);
    let mut problems = Vec::new();
    if ocm_version != our_version {
        problems.push(format!(
            "served version: OCM serves {ocm_version}, we serve {our_version}"
        ));
        return problems;
    }
    for (path, want) in &ocm {
        let Some(have) = ours.get(path) else {
            let left_out = OCM_FIELDS_LEFT_OUT
                .iter()
                .any(|(kind, root)| *kind == plural && under(path, root));
            if !left_out {
                problems.push(format!("{path}: missing (OCM has {})", show(want)));
            }
            continue;
        };
        let keys: BTreeSet<&String> = want.keys().chain(have.keys()).collect();
        for key in keys {
            if FLOTILLA_DIFFERENCES.contains(&(plural, path.as_str(), key.as_str())) {
                continue;
            }
            match (want.get(key), have.get(key)) {
                (Some(w), Some(h)) if same(w, h) => {}
                // An integer's format is informational (int32 vs none); OCM's own CRDs leave it
                // out for some fields.
                (None, Some(_))
                    if key == "format" && have.get("type") == Some(&"integer".into()) => {}
                (None, Some(h)) if key == "default" && is_zero_value(h) => {}
                (w, h) => problems.push(format!(
                    "{path}: {key} is {} in OCM's schema, {} in ours",
                    w.map_or("absent".to_owned(), Value::to_string),
                    h.map_or("absent".to_owned(), Value::to_string),
                )),
            }
        }
    }
    for path in ours.keys().filter(|p| !ocm.contains_key(*p)) {
        let added = FLOTILLA_ADDITIONS
            .iter()
            .any(|(kind, root)| *kind == plural && under(path, root));
        if !added {
            problems.push(format!(
                "{path}: OCM has no such field (a flotilla addition must be listed in \
                 FLOTILLA_ADDITIONS and documented in deploy/crds/README.md)"
            ));
        }
    }
    problems
}

fn show(facts: &Facts) -> String {
    facts
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(" ")
}

#[test]
fn our_schemas_have_ocm_fields_defaults_and_validation() {
    let mut report = Vec::new();
    for plural in KINDS {
        for problem in differences(plural) {
            report.push(format!("{plural} {problem}"));
        }
    }
    assert!(
        report.is_empty(),
        "our CRDs differ from OCM's ({} differences):\n  {}",
        report.len(),
        report.join("\n  ")
    );
}

#[test]
fn every_addition_and_difference_is_documented_and_still_real() {
    let readme = std::fs::read_to_string(manifest_dir().join("../deploy/crds/README.md"))
        .expect("read deploy/crds/README.md");
    for (plural, path) in FLOTILLA_ADDITIONS {
        let (_, ours) = our_facts(plural);
        assert!(
            ours.contains_key(*path),
            "{plural} {path}: listed as a flotilla addition but not in our schema"
        );
        let (_, ocm) = ocm_facts(plural);
        assert!(
            !ocm.contains_key(*path),
            "{plural} {path}: listed as a flotilla addition but OCM has it too"
        );
        let field = path.rsplit('.').next().expect("a field name");
        assert!(
            readme.contains(&format!("`{field}`")) || readme.contains(&format!("`{path}`")),
            "{plural} {path}: not documented in deploy/crds/README.md"
        );
    }
    for (plural, path) in OCM_FIELDS_LEFT_OUT {
        let (_, ours) = our_facts(plural);
        let (_, ocm) = ocm_facts(plural);
        assert!(
            ocm.contains_key(*path) && !ours.contains_key(*path),
            "{plural} {path}: listed as left out but OCM lacks it or we have it"
        );
        let field = path.rsplit('.').next().expect("a field name");
        assert!(
            readme.contains(&format!("`{field}`")) || readme.contains(&format!("`{path}`")),
            "{plural} {path}: left out but not documented in deploy/crds/README.md"
        );
    }
    for (plural, path, key) in FLOTILLA_DIFFERENCES {
        let (_, ours) = our_facts(plural);
        let (_, ocm) = ocm_facts(plural);
        let have = ours.get(*path).and_then(|f| f.get(*key));
        let want = ocm.get(*path).and_then(|f| f.get(*key));
        assert!(
            have.is_some() && have != want,
            "{plural} {path} {key}: listed as a difference but the same as OCM's"
        );
        // The object's root is documented by naming the kinds whose spec is required.
        let named = if *path == "." {
            format!("`{plural}`")
        } else {
            format!("`{path}`")
        };
        assert!(
            readme.contains(&named),
            "{plural} {path}: difference not documented in deploy/crds/README.md"
        );
    }
}

#[test]
fn facts_files_cover_every_kind_we_share_with_ocm() {
    for plural in KINDS {
        let (_, nodes) = ocm_facts(plural);
        assert!(
            nodes.contains_key("spec") || nodes.contains_key("status"),
            "{plural}: OCM's facts have neither spec nor status"
        );
    }
}
