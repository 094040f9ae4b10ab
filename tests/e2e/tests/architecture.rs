//! The architecture invariants of ARCHITECTURE.md that the crate graph or the sources can
//! show: against `cargo metadata`, which flotilla crates may depend on which, which may open
//! sockets, and that proto, the contract, can do no IO; against the non-test sources, that
//! proto reads no clock and touches no file, the gateway takes no tokio lock, every kube
//! client takes its request budget, and controllers read the store only through `reflect`.

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

/// The workspace's crates that ship in the product (not the test environment, the end-to-end
/// tests or the load test, which are tools of development).
const PRODUCT: &[&str] = &[
    "flotilla-proto",
    "flotilla-store",
    "flotilla-transport",
    "flotilla-gateway",
    "flotilla-hub",
    "flotilla-agent",
    "flotilla-ops",
    "flotilla-cli",
];

#[test]
fn only_the_serving_crates_open_sockets() {
    let (deps, tokio) = graph();
    // Invariant: only gateway, hub, agent, transport, ops (the `--metrics-addr` listener) and
    // cli (the operator API's client, the dashboard's loopback listener) open sockets of their
    // own (tokio's `net`); the store's only connections are its kube client's, to the hub
    // apiserver; proto opens nothing.
    let mut with_net: Vec<&str> = PRODUCT
        .iter()
        .copied()
        .filter(|krate| {
            assert!(deps.contains_key(*krate), "{krate} is in the workspace");
            tokio
                .get(*krate)
                .is_some_and(|f| f.iter().any(|f| f == "net" || f == "full"))
        })
        .collect();
    with_net.sort_unstable();
    assert_eq!(
        with_net,
        [
            "flotilla-agent",
            "flotilla-cli",
            "flotilla-gateway",
            "flotilla-hub",
            "flotilla-ops",
            "flotilla-transport",
        ],
        "the crates that may open sockets of their own"
    );
    let kube_clients = kube_client_users();
    assert!(
        !kube_clients.contains("flotilla-proto") && !kube_clients.contains("flotilla-transport"),
        "proto and transport build no kube client: {kube_clients:?}"
    );
    assert!(
        kube_clients.contains("flotilla-store"),
        "the store's kube client is the one way it reaches the hub apiserver"
    );
}

/// The workspace crates that depend (not for their tests) on kube's client.
fn kube_client_users() -> BTreeSet<String> {
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
    let meta: Value = serde_json::from_slice(&out.stdout).unwrap();
    let mut users = BTreeSet::new();
    for p in meta["packages"].as_array().unwrap() {
        for d in p["dependencies"].as_array().unwrap() {
            if d["kind"].as_str() != Some("dev")
                && d["name"] == "kube"
                && d["features"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|f| f == "client")
            {
                users.insert(p["name"].as_str().unwrap().to_string());
            }
        }
    }
    users
}

/// The non-test Rust sources under `dir` (relative to the workspace root): each file's text
/// without its `#[cfg(test)]` items, and files of test modules (`tests.rs`, `test_support.rs`)
/// left out.
fn product_sources(dir: &str) -> Vec<(String, String)> {
    let mut found = Vec::new();
    let mut pending = vec![workspace_root().join(dir)];
    while let Some(at) = pending.pop() {
        for entry in std::fs::read_dir(&at).unwrap_or_else(|e| panic!("{}: {e}", at.display())) {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            if path.is_dir() {
                pending.push(path);
            } else if name.ends_with(".rs") && name != "tests.rs" && name != "test_support.rs" {
                let text = std::fs::read_to_string(&path).unwrap();
                found.push((path.display().to_string(), without_test_items(&text)));
            }
        }
    }
    assert!(!found.is_empty(), "no sources under {dir}");
    found
}

/// `text` without each item marked `#[cfg(test)]` (a module, a function, a `mod tests;`),
/// found by matching braces outside string literals and comments.
fn without_test_items(text: &str) -> String {
    let mut kept = String::new();
    let mut rest = text;
    while let Some(at) = rest.find("#[cfg(test)]") {
        kept.push_str(&rest[..at]);
        let item = &rest[at..];
        let bytes = item.as_bytes();
        let (mut depth, mut i, mut end) = (0usize, 0usize, item.len());
        while i < bytes.len() {
            match bytes[i] {
                b'"' => {
                    i += 1;
                    while i < bytes.len() && bytes[i] != b'"' {
                        i += if bytes[i] == b'\\' { 2 } else { 1 };
                    }
                }
                b'/' if bytes.get(i + 1) == Some(&b'/') => {
                    while i < bytes.len() && bytes[i] != b'\n' {
                        i += 1;
                    }
                }
                b';' if depth == 0 => {
                    end = i + 1;
                    break;
                }
                b'{' => depth += 1,
                b'}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = i + 1;
                        break;
                    }
                }
                _ => {}
            }
            i += 1;
        }
        rest = &item[end.min(item.len())..];
    }
    kept.push_str(rest);
    kept
}

/// Every line of the product sources under `dir` that contains one of `words`.
fn lines_with(dir: &str, words: &[&str]) -> Vec<String> {
    let mut hits = Vec::new();
    for (path, text) in product_sources(dir) {
        for line in text.lines() {
            let code = line.split("//").next().unwrap_or_default();
            if words.iter().any(|w| code.contains(w)) {
                hits.push(format!("{path}: {}", line.trim()));
            }
        }
    }
    hits
}

#[test]
fn proto_reads_no_clock_and_touches_no_file_or_socket() {
    // Invariant: proto does no IO: no sockets, files or clocks. Time is passed in.
    let hits = lines_with(
        "proto/src",
        &[
            "Instant::now(",
            "SystemTime::now(",
            "std::fs",
            "std::net::Tcp",
            "std::net::Udp",
            "tokio::net",
            "tokio::fs",
            "std::process",
        ],
    );
    assert!(hits.is_empty(), "proto does IO:\n{}", hits.join("\n"));
}

#[test]
fn the_gateway_never_takes_tokios_locks() {
    // Invariant: the gateway's shared maps are behind blocking locks held for a map operation,
    // never tokio's (a waiter its task stopped polling would keep an async lock for good).
    let hits = lines_with(
        "gateway/src",
        &[
            "tokio::sync::Mutex",
            "tokio::sync::RwLock",
            "tokio::sync::{Mutex",
            "tokio::sync::{RwLock",
        ],
    );
    let grouped: Vec<String> = lines_with("gateway/src", &["use tokio::sync::{"])
        .into_iter()
        .filter(|l| l.contains("Mutex") || l.contains("RwLock"))
        .collect();
    assert!(
        hits.is_empty() && grouped.is_empty(),
        "tokio's locks in the gateway:\n{}",
        [hits, grouped].concat().join("\n")
    );
}

#[test]
fn every_kube_client_takes_its_request_budget() {
    // Invariant: every `kube::Client` a process builds goes through its `ops::rate` budget:
    // built with `ClientBuilder` and the budget's layer, never `Client::try_from` or
    // `Client::try_default`, which take none.
    let mut unbudgeted = Vec::new();
    for krate in [
        "store/src",
        "gateway/src",
        "hub/src",
        "agent/src",
        "transport/src",
    ] {
        for (path, text) in product_sources(krate) {
            for call in ["Client::try_from(", "Client::try_default(", "Client::new("] {
                for (at, _) in text.match_indices(call) {
                    // `kube::Client::..` or a bare `Client::..`, not `HopClient::new(` and such.
                    let before = text[..at].chars().next_back();
                    if !before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
                        unbudgeted.push(format!("{path}: {call}"));
                    }
                }
            }
            for (at, _) in text.match_indices("ClientBuilder::try_from(") {
                let statement = &text[at..text[at..].find(';').map_or(text.len(), |e| at + e)];
                if !statement.contains(".with_layer(") {
                    unbudgeted.push(format!(
                        "{path}: a ClientBuilder without the budget's layer"
                    ));
                }
            }
        }
    }
    assert!(
        unbudgeted.is_empty(),
        "kube clients without a request budget:\n{}",
        unbudgeted.join("\n")
    );
}

#[test]
fn controllers_read_the_store_only_through_reflect() {
    // Invariant: controllers read the store only through `flotilla_store::reflect` (never a
    // relist per change): no list or watch call of their own.
    let hits = lines_with(
        "hub/src/controllers",
        &[".list(", ".watch(", ".list_selected("],
    );
    assert!(
        hits.is_empty(),
        "controllers reading the store around reflect:\n{}",
        hits.join("\n")
    );
}
