//! What the `flotilla` CLI does, kept out of the binary so it can be tested: reading manifests
//! from files, building ManifestWorks the way `clusteradm create work` does, the API paths, and
//! the read-modify-write of a ManagedCluster that label, taint and decommission share.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};

use crate::client::{ApiError, OperatorClient};
use flotilla_proto::api::Kind;
use flotilla_transport::files::{Access, write_atomic};
use http::{Method, StatusCode};
use serde::Deserialize;
use serde_json::{Value, json};

/// The API path of a kind's collection, in a namespace for namespaced kinds.
pub fn collection_path(kind: Kind, namespace: Option<&str>) -> String {
    match namespace {
        Some(ns) if kind.namespaced() => {
            format!("{}/namespaces/{ns}/{}", kind.api_root(), kind.plural())
        }
        _ => format!("{}/{}", kind.api_root(), kind.plural()),
    }
}

/// The API path of one object.
pub fn object_path(kind: Kind, namespace: Option<&str>, name: &str) -> String {
    format!("{}/{name}", collection_path(kind, namespace))
}

/// Every YAML or JSON document in `path` (a file, or the `*.yaml`, `*.yml` and `*.json` files
/// of a directory in name order), skipping empty documents. Errors name the file and document.
pub fn read_documents(path: &Path) -> anyhow::Result<Vec<Value>> {
    let files: Vec<PathBuf> = if path.is_dir() {
        let mut files: Vec<PathBuf> = std::fs::read_dir(path)
            .with_context(|| format!("reading directory {}", path.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.extension()
                    .and_then(|e| e.to_str())
                    .is_some_and(|e| matches!(e, "yaml" | "yml" | "json"))
            })
            .collect();
        files.sort();
        if files.is_empty() {
            bail!("{} has no .yaml, .yml or .json files", path.display());
        }
        files
    } else {
        vec![path.to_path_buf()]
    };
    let mut docs = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file)
            .with_context(|| format!("reading {}", file.display()))?;
        docs.extend(parse_documents(&text, &file.display().to_string())?);
    }
    Ok(docs)
}

/// Every YAML or JSON document in `text` (read from `source`, which errors name), skipping
/// empty documents.
pub fn parse_documents(text: &str, source: &str) -> anyhow::Result<Vec<Value>> {
    let mut docs = Vec::new();
    for (i, doc) in yaml_serde::Deserializer::from_str(text).enumerate() {
        let value = Value::deserialize(doc)
            .with_context(|| format!("{source}: document {} is not valid YAML", i + 1))?;
        match value {
            Value::Null => continue,
            Value::Object(_) => {
                check_sendable(&value).with_context(|| format!("{source}: document {}", i + 1))?;
                docs.push(value);
            }
            _ => bail!("{source}: document {} is not an object", i + 1),
        }
    }
    Ok(docs)
}

/// Refuses a document that would not reach the hub as it was read. serde_json gives keys of
/// its own (`$serde_json::private::RawValue`) a meaning when the hub reads a body, so a YAML
/// map using one would reach the operator API as a parse error naming no object; and its JSON
/// must read back to the same value.
fn check_sendable(doc: &Value) -> anyhow::Result<()> {
    if let Some(path) = reserved_key(doc, "") {
        bail!(
            "has the key {path}: keys starting with `{RESERVED_KEY_PREFIX}` are reserved by JSON \
             readers; rename it"
        );
    }
    let json = serde_json::to_vec(doc).context("cannot be written as JSON")?;
    match serde_json::from_slice::<Value>(&json) {
        Ok(read) if read == *doc => Ok(()),
        Ok(_) => bail!("changes when written as JSON and read back; check its keys and numbers"),
        Err(e) => bail!("cannot be sent as JSON: {e}"),
    }
}

const RESERVED_KEY_PREFIX: &str = "$serde_json::";

/// The path (`.a.b[2].c`) of the first key of `value` under `at` that JSON readers reserve.
fn reserved_key(value: &Value, at: &str) -> Option<String> {
    match value {
        Value::Object(map) => map.iter().find_map(|(key, v)| {
            let path = format!("{at}.{key}");
            if key.starts_with(RESERVED_KEY_PREFIX) {
                Some(path)
            } else {
                reserved_key(v, &path)
            }
        }),
        Value::Array(items) => items
            .iter()
            .enumerate()
            .find_map(|(i, v)| reserved_key(v, &format!("{at}[{i}]"))),
        _ => None,
    }
}

/// A ManifestWork named `name` in `cluster`'s namespace carrying `manifests` (what
/// `clusteradm create work NAME -f FILE --clusters CLUSTER` builds).
pub fn manifest_work(name: &str, cluster: &str, manifests: &[Value]) -> Value {
    json!({
        "apiVersion": Kind::ManifestWork.api_version(),
        "kind": "ManifestWork",
        "metadata": { "name": name, "namespace": cluster },
        "spec": { "workload": { "manifests": manifests } },
    })
}

/// The hub kind of a document, or an error that says which kinds the hub serves.
pub fn kind_of_document(doc: &Value) -> anyhow::Result<Kind> {
    let api_version = doc["apiVersion"].as_str().unwrap_or("");
    let kind = doc["kind"].as_str().unwrap_or("");
    Kind::ALL
        .into_iter()
        .find(|k| k.name() == kind && k.api_version() == api_version)
        .with_context(|| {
            let served: Vec<String> = Kind::ALL
                .iter()
                .map(|k| format!("{} {}", k.api_version(), k.name()))
                .collect();
            format!(
                "{api_version} {kind} {}: the hub serves only {}",
                doc["metadata"]["name"].as_str().unwrap_or("<unnamed>"),
                served.join(", ")
            )
        })
}

/// The hub kind a command line names, as kubectl takes it: the kind (`ConfigMap`), its
/// lower-case singular (`configmap`) or its plural (`configmaps`), in any case; an error lists
/// what the hub serves.
pub fn kind_of_resource(resource: &str) -> anyhow::Result<Kind> {
    Kind::ALL
        .into_iter()
        .find(|k| {
            k.name().eq_ignore_ascii_case(resource) || k.plural().eq_ignore_ascii_case(resource)
        })
        .with_context(|| {
            let served: Vec<&str> = Kind::ALL.iter().map(|k| k.plural()).collect();
            format!(
                "the hub serves no resource {resource:?}; it serves {}",
                served.join(", ")
            )
        })
}

/// The namespace `flotilla apply` puts a namespaced object in when its document names none
/// (`-n`, `default` unless given), as `kubectl apply` does: OCM's policy-collection YAML, like
/// most of OCM's examples, leaves it to the command. A ManifestWork's (and its chunks')
/// namespace is its cluster's, never a default: those still need it written.
pub fn default_namespace(doc: &mut Value, kind: Kind, namespace: &str) {
    if !kind.namespaced() || matches!(kind, Kind::ManifestWork | Kind::ManifestChunk) {
        return;
    }
    if doc["metadata"]["namespace"].as_str().is_none()
        && let Some(meta) = doc["metadata"].as_object_mut()
    {
        meta.insert("namespace".into(), Value::String(namespace.to_string()));
    }
}

/// Where `flotilla user create` keeps a user's credentials: `users/<user>/` beside the CLI
/// config (files `ca.crt`, `tls.crt`, `tls.key`, as everywhere else in flotilla).
pub fn user_dir(config: &Path, user: &str) -> PathBuf {
    config
        .parent()
        .unwrap_or(Path::new("."))
        .join("users")
        .join(user)
}

/// Writes a user's credentials into `dir` as every flotilla component lays them out:
/// `ca.crt`, `tls.crt`, and `tls.key` readable by its owner only.
pub fn write_credentials(
    dir: &Path,
    ca_pem: &str,
    cert_pem: &str,
    key_pem: &str,
) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    write_file(&dir.join("ca.crt"), ca_pem, Access::Public)?;
    write_file(&dir.join("tls.key"), key_pem, Access::Private)?;
    write_file(&dir.join("tls.crt"), cert_pem, Access::Public)
}

/// Writes `path` whole or not at all (a kubeconfig or a credential the operator relies on is
/// never left half-written).
pub fn write_file(path: &Path, contents: &str, access: Access) -> anyhow::Result<()> {
    write_atomic(path, contents.as_bytes(), access)
        .with_context(|| format!("writing {}", path.display()))
}

/// The user whose credentials a kubeconfig uses, and their directory (absolute): `user`, or
/// with none named the only one there is.
pub fn find_user(config: &Path, user: Option<&str>) -> anyhow::Result<(String, PathBuf)> {
    let user = match user {
        Some(u) => u.to_string(),
        None => {
            let dir = config.parent().unwrap_or(Path::new(".")).join("users");
            let mut users: Vec<String> = std::fs::read_dir(&dir)
                .map(|entries| {
                    entries
                        .filter_map(|e| e.ok()?.file_name().into_string().ok())
                        .collect()
                })
                .unwrap_or_default();
            users.sort();
            match users.as_slice() {
                [only] => only.clone(),
                [] => bail!(
                    "no kubectl users in {}: create one with `flotilla user create NAME --groups ...`",
                    dir.display()
                ),
                many => bail!("several kubectl users ({}): pass --user", many.join(", ")),
            }
        }
    };
    let dir = user_dir(config, &user);
    let dir = std::path::absolute(&dir).unwrap_or(dir);
    for file in ["ca.crt", "tls.crt", "tls.key"] {
        anyhow::ensure!(
            dir.join(file).exists(),
            "user {user}: {} is missing (create the user with `flotilla user create {user}`)",
            dir.join(file).display()
        );
    }
    Ok((user, dir))
}

/// A kubeconfig with one context per cluster (named after it), each reaching the cluster
/// through the proxy front at `proxy` (`https://HUB/clusters/NAME`) as `user`, whose
/// credentials are in `dir`; the first cluster's context is current.
pub fn kubeconfig(proxy: &str, user: &str, dir: &Path, clusters: &[String]) -> Value {
    let proxy = proxy.trim_end_matches('/');
    let file = |name: &str| dir.join(name).display().to_string();
    json!({
        "apiVersion": "v1",
        "kind": "Config",
        "preferences": {},
        "current-context": clusters.first().cloned().unwrap_or_default(),
        "clusters": clusters.iter().map(|c| json!({
            "name": c,
            "cluster": {
                "server": format!("{proxy}/clusters/{c}"),
                "certificate-authority": file("ca.crt"),
            },
        })).collect::<Vec<_>>(),
        "users": [{
            "name": user,
            "user": {
                "client-certificate": file("tls.crt"),
                "client-key": file("tls.key"),
            },
        }],
        "contexts": clusters.iter().map(|c| json!({
            "name": c,
            "context": {"cluster": c, "user": user},
        })).collect::<Vec<_>>(),
    })
}

/// Changes ManagedCluster `name` with `change` on a fresh read and writes it back with the
/// version read, again from a fresh read if someone else wrote in between.
pub async fn modify_cluster(
    client: &OperatorClient,
    name: &str,
    change: impl Fn(&mut Value) -> anyhow::Result<bool>,
) -> anyhow::Result<bool> {
    let path = object_path(Kind::ManagedCluster, None, name);
    modify_object(client, &path, &format!("cluster {name}"), change).await
}

/// Changes the object at `path` (`what` names it in errors) with `change` on a fresh read and
/// writes it back with the version read, again from a fresh read if someone else (a status
/// write, another operator) wrote in between. Says whether anything changed.
pub async fn modify_object(
    client: &OperatorClient,
    path: &str,
    what: &str,
    change: impl Fn(&mut Value) -> anyhow::Result<bool>,
) -> anyhow::Result<bool> {
    const ATTEMPTS: usize = 5;
    for attempt in 1..=ATTEMPTS {
        let mut obj = client
            .get_json(path)
            .await
            .with_context(|| what.to_string())?;
        if !change(&mut obj)? {
            return Ok(false);
        }
        match client.request(Method::PUT, path, Some(&obj)).await {
            Ok(_) => return Ok(true),
            Err(e)
                if attempt < ATTEMPTS
                    && e.downcast_ref::<ApiError>()
                        .is_some_and(|a| a.status == StatusCode::CONFLICT) => {}
            Err(e) => return Err(e.context(format!("writing {what}"))),
        }
    }
    Ok(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kubeconfigs_reach_each_cluster_through_the_proxy() {
        let kc = kubeconfig(
            "https://hub:9445/",
            "alice",
            Path::new("/data/users/alice"),
            &["store-1".into(), "store-2".into()],
        );
        assert_eq!(kc["current-context"], "store-1");
        assert_eq!(
            kc["clusters"][1]["cluster"]["server"],
            "https://hub:9445/clusters/store-2"
        );
        assert_eq!(kc["contexts"][1]["context"]["user"], "alice");
        assert_eq!(
            kc["users"][0]["user"]["client-key"],
            "/data/users/alice/tls.key"
        );
    }

    #[test]
    fn apply_puts_namespaced_objects_without_one_in_the_default_namespace() {
        let mut policy = json!({"kind": "Policy", "metadata": {"name": "p"}});
        default_namespace(&mut policy, Kind::Policy, "default");
        assert_eq!(policy["metadata"]["namespace"], "default");
        let mut placed =
            json!({"kind": "Placement", "metadata": {"name": "p", "namespace": "apps"}});
        default_namespace(&mut placed, Kind::Placement, "default");
        assert_eq!(
            placed["metadata"]["namespace"], "apps",
            "a written namespace stays"
        );
        let mut cluster = json!({"kind": "ManagedCluster", "metadata": {"name": "c"}});
        default_namespace(&mut cluster, Kind::ManagedCluster, "default");
        assert!(
            cluster["metadata"].get("namespace").is_none(),
            "cluster-scoped"
        );
        let mut work = json!({"kind": "ManifestWork", "metadata": {"name": "w"}});
        default_namespace(&mut work, Kind::ManifestWork, "default");
        assert!(
            work["metadata"].get("namespace").is_none(),
            "a work's namespace is its cluster's, never a default"
        );
    }

    #[test]
    fn paths_follow_the_kubernetes_api() {
        assert_eq!(
            object_path(Kind::ManifestWork, Some("store-1"), "web"),
            "/apis/work.open-cluster-management.io/v1/namespaces/store-1/manifestworks/web"
        );
        assert_eq!(
            collection_path(Kind::ManagedCluster, Some("ignored")),
            "/apis/cluster.open-cluster-management.io/v1/managedclusters"
        );
    }

    #[test]
    fn reads_multi_document_files_and_directories_in_order() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("b.yaml"), "kind: B\n---\n---\nkind: C\n").unwrap();
        std::fs::write(dir.path().join("a.yml"), "kind: A\n").unwrap();
        std::fs::write(dir.path().join("notes.txt"), "ignored").unwrap();
        let kinds: Vec<String> = read_documents(dir.path())
            .unwrap()
            .iter()
            .map(|d| d["kind"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(kinds, ["A", "B", "C"]);

        std::fs::write(dir.path().join("c.yaml"), "- a list\n").unwrap();
        let err = read_documents(dir.path()).unwrap_err().to_string();
        assert!(err.contains("c.yaml: document 1 is not an object"), "{err}");
    }

    #[test]
    fn unknown_kinds_are_named_with_what_is_served() {
        let err = kind_of_document(
            &json!({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web"}}),
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.starts_with("apps/v1 Deployment web: the hub serves only"),
            "{err}"
        );
        assert!(err.contains("work.open-cluster-management.io/v1 ManifestWork"));
        // Kubernetes' own ConfigMap is a hub kind, on the core group's paths.
        let cm = json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "settings"}});
        assert_eq!(kind_of_document(&cm).unwrap(), Kind::ConfigMap);
        assert_eq!(
            object_path(Kind::ConfigMap, Some("policies"), "settings"),
            "/api/v1/namespaces/policies/configmaps/settings"
        );
        assert_eq!(
            collection_path(Kind::Policy, Some("policies")),
            "/apis/policy.open-cluster-management.io/v1/namespaces/policies/policies"
        );
    }

    #[test]
    fn resources_are_named_as_kubectl_names_them() {
        for name in ["configmaps", "ConfigMap", "configmap", "CONFIGMAPS"] {
            assert_eq!(kind_of_resource(name).unwrap(), Kind::ConfigMap, "{name}");
        }
        assert_eq!(kind_of_resource("policies").unwrap(), Kind::Policy);
        let err = kind_of_resource("secrets").unwrap_err().to_string();
        assert!(
            err.starts_with("the hub serves no resource \"secrets\"; it serves managedclusters,"),
            "{err}"
        );
    }
}

/// A ManifestWorkReplicaSet named `name` in `namespace` that delivers `manifests` to the
/// clusters of placement `placement`, all at once: what `flotilla work create NAME -f FILE
/// --placement NS/PLACEMENT` creates, so that the work follows the placement's decisions.
pub fn replica_set(name: &str, namespace: &str, placement: &str, manifests: &[Value]) -> Value {
    json!({
        "apiVersion": Kind::ManifestWorkReplicaSet.api_version(),
        "kind": "ManifestWorkReplicaSet",
        "metadata": { "name": name, "namespace": namespace },
        "spec": {
            "manifestWorkTemplate": { "workload": { "manifests": manifests } },
            "placementRefs": [{ "name": placement, "rolloutStrategy": { "type": "All" } }],
        },
    })
}

/// Refuses manifests too large for a ManifestWorkReplicaSet's template: the template is one
/// object, within the store's limit, and is not chunked (the works the set makes are copies of
/// it in each cluster's namespace). Per-cluster works made with `work create -f --clusters`
/// are chunked. The error names the set, the size, the limit and what to do.
pub fn check_replica_set_size(
    name: &str,
    namespace: &str,
    manifests: &[Value],
) -> anyhow::Result<()> {
    use flotilla_proto::api::MAX_WORKLOAD_BYTES;
    let bytes: usize = manifests.iter().map(|m| m.to_string().len()).sum();
    anyhow::ensure!(
        bytes <= MAX_WORKLOAD_BYTES,
        "ManifestWorkReplicaSet {namespace}/{name}: manifests take {bytes} bytes, more than the \
         {MAX_WORKLOAD_BYTES} bytes a ManifestWorkReplicaSet's template may hold (it is one \
         object and is not chunked); nothing was stored. Create the work for each cluster with \
         `flotilla work create {name} -f FILE --clusters CLUSTER,...`, which stores large works \
         in chunks, or split the manifests over several works"
    );
    Ok(())
}

/// `NS/NAME` as (namespace, name); the error says what is expected.
pub fn namespaced_name(s: &str, what: &str) -> anyhow::Result<(String, String)> {
    match s.split_once('/') {
        Some((ns, name)) if !ns.is_empty() && !name.is_empty() && !name.contains('/') => {
            Ok((ns.to_string(), name.to_string()))
        }
        _ => bail!("{what} {s:?} must be NAMESPACE/NAME, e.g. default/placement1"),
    }
}

/// One change of `flotilla cluster label`: `key=value` sets, `key-` removes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LabelChange {
    Set(String, String),
    Remove(String),
}

/// Parses `key=value` and `key-` arguments as `kubectl label` does, checking Kubernetes' rules
/// for label keys and values.
pub fn parse_label_changes(args: &[String]) -> anyhow::Result<Vec<LabelChange>> {
    args.iter()
        .map(|a| {
            if let Some(key) = a.strip_suffix('-')
                && !a.contains('=')
            {
                check_label_key(key)?;
                return Ok(LabelChange::Remove(key.to_string()));
            }
            let (key, value) = a.split_once('=').with_context(|| {
                format!("{a:?} is neither key=value (set a label) nor key- (remove it)")
            })?;
            check_label_key(key)?;
            check_label_value(key, value)?;
            Ok(LabelChange::Set(key.to_string(), value.to_string()))
        })
        .collect()
}

/// Applies label changes to `metadata.labels` of `obj`. Changing a label that has another
/// value needs `overwrite`, as with `kubectl label`; says whether anything changed.
pub fn apply_label_changes(
    obj: &mut Value,
    changes: &[LabelChange],
    overwrite: bool,
) -> anyhow::Result<bool> {
    let name = obj["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let labels = obj["metadata"]
        .as_object_mut()
        .context("the object has no metadata")?
        .entry("labels")
        .or_insert_with(|| json!({}));
    if labels.is_null() {
        *labels = json!({});
    }
    let labels = labels
        .as_object_mut()
        .context("metadata.labels is not a map")?;
    let mut changed = false;
    for c in changes {
        match c {
            LabelChange::Set(k, v) => match labels.get(k).and_then(Value::as_str) {
                Some(old) if old == v => {}
                Some(old) if !overwrite => bail!(
                    "cluster {name} already has label {k}={old}; pass --overwrite to change it to {v}"
                ),
                _ => {
                    labels.insert(k.clone(), Value::String(v.clone()));
                    changed = true;
                }
            },
            LabelChange::Remove(k) => changed |= labels.remove(k).is_some(),
        }
    }
    Ok(changed)
}

fn check_label_key(key: &str) -> anyhow::Result<()> {
    let (prefix, name) = match key.rsplit_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, key),
    };
    if let Some(p) = prefix
        && (p.is_empty()
            || p.len() > 253
            || !p.split('.').all(flotilla_proto::contract::is_dns1123_label))
    {
        bail!("label key {key:?}: the prefix {p:?} must be a DNS subdomain (lower-case, dots)");
    }
    if !valid_label_name(name) || name.is_empty() {
        bail!(
            "label key {key:?}: the name must be 1-63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit"
        );
    }
    Ok(())
}

fn check_label_value(key: &str, value: &str) -> anyhow::Result<()> {
    if !value.is_empty() && !valid_label_name(value) {
        bail!(
            "label {key}: value {value:?} must be at most 63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit"
        );
    }
    Ok(())
}

fn valid_label_name(s: &str) -> bool {
    let b = s.as_bytes();
    let edge = |c: u8| c.is_ascii_alphanumeric();
    s.len() <= 63
        && (b.is_empty()
            || (edge(b[0])
                && edge(b[b.len() - 1])
                && b.iter()
                    .all(|&c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))))
}

/// One change of `flotilla cluster taint`: `key[=value]:Effect` adds, `key-` or
/// `key:Effect-` removes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TaintChange {
    Add {
        key: String,
        value: String,
        effect: String,
    },
    Remove {
        key: String,
        effect: Option<String>,
    },
}

const TAINT_EFFECTS: [&str; 3] = ["NoSelect", "PreferNoSelect", "NoSelectIfNew"];

/// Parses taint arguments as `kubectl taint` does, with OCM's effects.
pub fn parse_taint_changes(args: &[String]) -> anyhow::Result<Vec<TaintChange>> {
    let effect = |e: &str| -> anyhow::Result<String> {
        anyhow::ensure!(
            TAINT_EFFECTS.contains(&e),
            "taint effect {e:?} is not one of {}",
            TAINT_EFFECTS.join(", ")
        );
        Ok(e.to_string())
    };
    args.iter()
        .map(|a| {
            if let Some(rest) = a.strip_suffix('-') {
                let (key, e) = match rest.split_once(':') {
                    Some((k, e)) => (k, Some(effect(e)?)),
                    None => (rest, None),
                };
                check_label_key(key)?;
                return Ok(TaintChange::Remove {
                    key: key.to_string(),
                    effect: e,
                });
            }
            let (kv, e) = a.rsplit_once(':').with_context(|| {
                format!("{a:?} is neither key[=value]:Effect (add a taint) nor key- (remove it)")
            })?;
            let (key, value) = kv.split_once('=').unwrap_or((kv, ""));
            check_label_key(key)?;
            check_label_value(key, value)?;
            Ok(TaintChange::Add {
                key: key.to_string(),
                value: value.to_string(),
                effect: effect(e)?,
            })
        })
        .collect()
}

/// Applies taint changes to `spec.taints` of a ManagedCluster; added taints get `timeAdded`
/// `now`. Says whether anything changed.
pub fn apply_taint_changes(
    obj: &mut Value,
    changes: &[TaintChange],
    now: &str,
) -> anyhow::Result<bool> {
    let spec = obj
        .as_object_mut()
        .context("the object is not a map")?
        .entry("spec")
        .or_insert_with(|| json!({}));
    let taints = spec
        .as_object_mut()
        .context("spec is not a map")?
        .entry("taints")
        .or_insert_with(|| json!([]));
    if taints.is_null() {
        *taints = json!([]);
    }
    let taints = taints.as_array_mut().context("spec.taints is not a list")?;
    let mut changed = false;
    for c in changes {
        match c {
            TaintChange::Add { key, value, effect } => {
                let same = |t: &Value| t["key"] == key.as_str() && t["effect"] == effect.as_str();
                if let Some(t) = taints.iter_mut().find(|t| same(t)) {
                    if t["value"].as_str().unwrap_or("") != value {
                        t["value"] = value.clone().into();
                        changed = true;
                    }
                } else {
                    let mut t = json!({ "key": key, "effect": effect, "timeAdded": now });
                    if !value.is_empty() {
                        t["value"] = value.clone().into();
                    }
                    taints.push(t);
                    changed = true;
                }
            }
            TaintChange::Remove { key, effect } => {
                let before = taints.len();
                taints.retain(|t| {
                    !(t["key"] == key.as_str()
                        && effect.as_ref().is_none_or(|e| t["effect"] == e.as_str()))
                });
                anyhow::ensure!(taints.len() != before, "the cluster has no taint {key}");
                changed = true;
            }
        }
    }
    Ok(changed)
}

#[cfg(test)]
mod change_tests {
    use super::*;

    #[test]
    fn a_document_that_would_not_reach_the_hub_as_read_is_refused_naming_it() {
        let ok = "kind: ManifestChunk\nmetadata: {name: a}\n---\nkind: Placement\n";
        assert_eq!(parse_documents(ok, "f.yaml").unwrap().len(), 2);
        // A key serde_json reads as a raw value: its JSON does not read back.
        let reserved = "kind: Placement\n---\nkind: ManifestChunk\nmetadata: {name: a, $serde_json::private::RawValue}\n";
        let err = format!("{:#}", parse_documents(reserved, "f.yaml").unwrap_err());
        for part in [
            "f.yaml: document 2",
            "has the key .metadata.$serde_json::private::RawValue",
            "are reserved",
        ] {
            assert!(err.contains(part), "{part:?} missing from: {err}");
        }
    }

    #[test]
    fn a_replica_set_over_one_objects_limit_is_refused_saying_what_to_do() {
        let small =
            vec![json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "a"}})];
        check_replica_set_size("web", "default", &small).unwrap();
        let big: Vec<Value> = (0..3)
            .map(|i| json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": format!("b{i}")},
                "data": {"blob": "x".repeat(400 * 1024)}}))
            .collect();
        let err = check_replica_set_size("web", "default", &big)
            .unwrap_err()
            .to_string();
        for part in [
            "ManifestWorkReplicaSet default/web",
            "more than the 1048576 bytes",
            "nothing was stored",
            "flotilla work create web -f FILE --clusters",
        ] {
            assert!(err.contains(part), "{part:?} missing from: {err}");
        }
        let size: usize = big.iter().map(|m| m.to_string().len()).sum();
        assert!(err.contains(&format!("take {size} bytes")), "{err}");
    }

    fn args(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn labels_change_like_kubectl_label() {
        let mut mc = json!({"metadata": {"name": "cluster1", "labels": {"region": "eu"}}});
        let changes = parse_label_changes(&args(&["tier=gold", "region-"])).unwrap();
        assert!(apply_label_changes(&mut mc, &changes, false).unwrap());
        assert_eq!(mc["metadata"]["labels"], json!({"tier": "gold"}));
        let err = apply_label_changes(
            &mut mc,
            &parse_label_changes(&args(&["tier=silver"])).unwrap(),
            false,
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("already has label tier=gold; pass --overwrite"),
            "{err}"
        );
        assert!(
            !apply_label_changes(
                &mut mc,
                &parse_label_changes(&args(&["tier=gold"])).unwrap(),
                false
            )
            .unwrap()
        );
        for (bad, msg) in [
            ("tier", "neither key=value"),
            ("Bad_Prefix.io/x=1", "must be a DNS subdomain"),
            ("x=a b", "value \"a b\""),
            ("-=1", "label key \"-\""),
        ] {
            let err = parse_label_changes(&args(&[bad])).unwrap_err().to_string();
            assert!(err.contains(msg), "{bad}: {err}");
        }
    }

    #[test]
    fn taints_change_like_kubectl_taint() {
        let mut mc = json!({"metadata": {"name": "cluster2"}, "spec": {}});
        let now = "2026-01-01T00:00:00Z";
        let add = parse_taint_changes(&args(&["maintenance:NoSelect", "gpu=busy:PreferNoSelect"]))
            .unwrap();
        assert!(apply_taint_changes(&mut mc, &add, now).unwrap());
        assert_eq!(
            mc["spec"]["taints"],
            json!([
                {"key": "maintenance", "effect": "NoSelect", "timeAdded": now},
                {"key": "gpu", "value": "busy", "effect": "PreferNoSelect", "timeAdded": now},
            ])
        );
        let remove = parse_taint_changes(&args(&["maintenance-"])).unwrap();
        assert!(apply_taint_changes(&mut mc, &remove, now).unwrap());
        assert_eq!(mc["spec"]["taints"].as_array().unwrap().len(), 1);
        let err = apply_taint_changes(&mut mc, &remove, now)
            .unwrap_err()
            .to_string();
        assert!(err.contains("no taint maintenance"), "{err}");
        let err = parse_taint_changes(&args(&["x:NoSchedule"]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("not one of NoSelect"), "{err}");
    }

    #[test]
    fn placement_references_are_namespaced() {
        assert_eq!(
            namespaced_name("default/placement1", "--placement").unwrap(),
            ("default".to_string(), "placement1".to_string())
        );
        let err = namespaced_name("placement1", "--placement")
            .unwrap_err()
            .to_string();
        assert!(err.contains("must be NAMESPACE/NAME"), "{err}");
    }
}

/// A ManifestWork document too large for one stored object, made storable: its manifests
/// split into content-addressed chunks ([`flotilla_proto::api::content`]) and replaced by one
/// `ChunkedManifests` reference. `None` when the work fits as it is (or is not a work).
/// Refuses content over `cap` bytes, naming the work and the flag.
pub fn chunked_work(
    doc: &Value,
    cap: u64,
) -> anyhow::Result<
    Option<(
        Value,
        flotilla_proto::api::content::ContentRef,
        Vec<flotilla_proto::api::content::Chunk>,
    )>,
> {
    use flotilla_proto::api::{MAX_WORKLOAD_BYTES, ManifestWork, content};
    if doc["kind"] != Kind::ManifestWork.name() {
        return Ok(None);
    }
    let work: ManifestWork = serde_json::from_value(doc.clone())
        .with_context(|| format!("ManifestWork {}: does not parse", doc_name(doc)))?;
    let manifests = &work.spec.workload.manifests;
    let bytes: usize = manifests.iter().map(|m| m.0.to_string().len()).sum();
    if bytes <= MAX_WORKLOAD_BYTES || content::ContentRef::of(&work).is_some() {
        return Ok(None);
    }
    anyhow::ensure!(
        bytes as u64 <= cap,
        "ManifestWork {}: manifests take {bytes} bytes, more than the cap of {cap} (--max-work-bytes); split them over several ManifestWorks or raise the cap (at most {})",
        doc_name(doc),
        content::MAX_CONTENT_BYTES
    );
    // Every manifest is checked as the hub would check it inline, before anything is stored.
    if let Err(errors) = flotilla_proto::api::validate_manifest_work(&work) {
        let problems: Vec<String> = errors
            .iter()
            .filter(|e| !matches!(e, flotilla_proto::api::ManifestError::TooLarge { .. }))
            .map(ToString::to_string)
            .collect();
        anyhow::ensure!(problems.is_empty(), "{}", problems.join("; "));
    }
    let (reference, chunks) = content::split(manifests);
    let mut stored = doc.clone();
    stored["spec"]["workload"]["manifests"] = serde_json::json!([reference.manifest().0]);
    Ok(Some((stored, reference, chunks)))
}

fn doc_name(doc: &Value) -> String {
    format!(
        "{}/{}",
        doc["metadata"]["namespace"].as_str().unwrap_or(""),
        doc["metadata"]["name"].as_str().unwrap_or("<unnamed>")
    )
}
