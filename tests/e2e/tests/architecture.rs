//! The architecture invariants of ARCHITECTURE.md that the crate graph can show, checked
//! against `cargo metadata`: which flotilla crates may depend on which, and that proto, the
//! contract, can do no IO.

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

use flotilla_testenv::workspace_root;
use serde_json::Value;

/// Each crate's dependencies (normal and build, not dev) among the workspace's crates, and the
/// features it asks of tokio.
fn graph() -> (
    BTreeMap<String, BTreeSet<String>>,
    BTreeMap<String, Vec<String>>,
) {
    let out = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .current_dir(workspace_root())
        .output()
        .expect("cargo metadata runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: Value = serde_json::from_slice(&out.stdout).unwrap();
    let mut deps = BTreeMap::new();
    let mut tokio = BTreeMap::new();
    for p in meta["packages"].as_array().unwrap() {
        let name = p["name"].as_str().unwrap().to_string();
        let mut own = BTreeSet::new();
        for d in p["dependencies"].as_array().unwrap() {
            if d["kind"].as_str() == Some("dev") {
                continue;
            }
            let dep = d["name"].as_str().unwrap();
            if dep.starts_with("flotilla-") {
                own.insert(dep.to_string());
            }
            if dep == "tokio" {
                let features = d["features"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|f| f.as_str().unwrap().to_string())
                    .collect();
                tokio.insert(name.clone(), features);
            }
        }
        deps.insert(name, own);
    }
    (deps, tokio)
}

fn set(names: &[&str]) -> BTreeSet<String> {
    names.iter().map(|s| s.to_string()).collect()
}

#[test]
fn dependencies_point_one_way() {
    let (deps, _) = graph();
    // Invariant: `hub → gateway → store → proto`, `gateway/agent → transport → proto`,
    // `agent → proto`, `hub → cli → transport → proto`, `hub/gateway/agent/store → ops` (which
    // links no other flotilla crate: the store's kube client takes its request budget from it);
    // the agent and the CLI link no hub, gateway or store code.
    let allowed: &[(&str, &[&str])] = &[
        ("flotilla-proto", &[]),
        ("flotilla-ops", &[]),
        ("flotilla-transport", &["flotilla-proto"]),
        ("flotilla-store", &["flotilla-proto", "flotilla-ops"]),
        (
            "flotilla-gateway",
            &[
                "flotilla-proto",
                "flotilla-store",
                "flotilla-transport",
                "flotilla-ops",
            ],
        ),
        (
            "flotilla-hub",
            &[
                "flotilla-proto",
                "flotilla-store",
                "flotilla-transport",
                "flotilla-gateway",
                "flotilla-ops",
                "flotilla-cli",
            ],
        ),
        ("flotilla-cli", &["flotilla-proto", "flotilla-transport"]),
        (
            "flotilla-agent",
            &["flotilla-proto", "flotilla-transport", "flotilla-ops"],
        ),
    ];
    for (krate, may) in allowed {
        let has = deps
            .get(*krate)
            .unwrap_or_else(|| panic!("{krate} is in the workspace"));
        let may = set(may);
        let extra: Vec<&String> = has.difference(&may).collect();
        assert!(
            extra.is_empty(),
            "{krate} depends on {extra:?}, which ARCHITECTURE.md does not allow"
        );
    }
}

#[test]
fn proto_does_no_io() {
    let (_, tokio) = graph();
    // Invariant: proto takes time in, it reads no clock and opens nothing: of tokio it uses
    // the Instant type only.
    let features = tokio.get("flotilla-proto").cloned().unwrap_or_default();
    assert_eq!(features, ["time"], "proto's tokio features: {features:?}");
}
