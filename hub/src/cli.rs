//! What the `flotilla` CLI does, kept out of the binary so it can be tested: reading manifests
//! from files, building ManifestWorks the way `clusteradm create work` does, and the API paths.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use flotilla_proto::api::Kind;
use serde::Deserialize;
use serde_json::{Value, json};

/// The API path of a kind's collection, in a namespace for namespaced kinds.
pub fn collection_path(kind: Kind, namespace: Option<&str>) -> String {
    match namespace {
        Some(ns) if kind.namespaced() => {
            format!(
                "/apis/{}/{}/namespaces/{ns}/{}",
                kind.group(),
                kind.version(),
                kind.plural()
            )
        }
        _ => format!(
            "/apis/{}/{}/{}",
            kind.group(),
            kind.version(),
            kind.plural()
        ),
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
        for (i, doc) in yaml_serde::Deserializer::from_str(&text).enumerate() {
            let value = Value::deserialize(doc).with_context(|| {
                format!("{}: document {} is not valid YAML", file.display(), i + 1)
            })?;
            match value {
                Value::Null => continue,
                Value::Object(_) => docs.push(value),
                _ => bail!("{}: document {} is not an object", file.display(), i + 1),
            }
        }
    }
    Ok(docs)
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

/// Where `flotilla user create` keeps a user's credentials: `users/<user>/` beside the CLI
/// config (files `ca.crt`, `tls.crt`, `tls.key`, as everywhere else in flotilla).
pub fn user_dir(config: &Path, user: &str) -> PathBuf {
    config
        .parent()
        .unwrap_or(Path::new("."))
        .join("users")
        .join(user)
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
    }
}
