//! The isolation sweep: what cluster A's identities can do to cluster B. A's agent certificate,
//! kubectl users scoped to A (a certificate allowed by name, a bearer token allowed by A's
//! labels), a user no rule names, and certificates presented where they do not belong (a
//! gateway's, an operator's or a kubectl user's on the agents' listener; an agent's or a
//! gateway's on the proxy front and the operator API) go through every frame of the session
//! protocol, every call on the agents' listener, every kind of request the proxy front serves
//! (each verb, upgrades, path tricks, impersonation sent by the user) and every route of the
//! operator API, each aimed at B. After each case B's objects on the hub are as they were, B's
//! session and its tunnels saw nothing, nothing A received carries B's content, and A got the
//! refusal (or the silence) the protocol promises. Positive controls show each check can fail:
//! B's own agent writes B, a user allowed on B reaches B's tunnel, the operator reads B, a
//! gateway certificate opens the relay hop to B.
//!
//! One fleet per backend (sled; kube on a real apiserver) and carrier (gRPC, QUIC) runs every
//! table. The tables are checked against the code (the .proto's oneof and services, the
//! operator API's and status page's routes, the verbs the proxy front audits), so a frame, a
//! call, a route or a verb added without a row fails here.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, bail, ensure};
use flotilla_cli::cli::{collection_path, object_path};
use flotilla_e2e::https::{self, Answer, Request};
use flotilla_e2e::proxy::proxy_flags;
use flotilla_e2e::scripted::{Script, ScriptedAgent, anonymous_tls, dial, identity_tls};
use flotilla_e2e::{Carrier, Fleet, condition_status, current_carrier, on_both_carriers, wait_for};
use flotilla_proto::api::{Kind, Manifest, content};
use flotilla_proto::contract::{DENIED_ANNOTATION, KEY_PINS_ANNOTATION, WORK_CLEANUP_FINALIZER};
use flotilla_proto::wire::{self, AgentFrame, agent_frame, hub_frame};
use flotilla_testenv::workspace_root;
use flotilla_transport::identity::Peer;
use prost::Message as _;
use serde_json::{Value, json};
use tokio_rustls::rustls;

const A: &str = "store-a";
const B: &str = "store-b";
const AVAILABLE: &str = "ManagedClusterConditionAvailable";
/// In B's work; with the two below, what must never reach A.
const B_SECRET: &str = "only-for-store-b-5c1e";
/// In B's large work's chunk.
const B_CHUNK_SECRET: &str = "only-for-store-b-chunk-94d2";
/// In the status B's agent reported.
const B_STATUS_SECRET: &str = "only-for-store-b-status-0a7f";
/// What B's spoke answers through a tunnel.
const B_ANSWER: &str = r#"{"cluster":"store-b","secret":"only-for-store-b-tunnel-61b8"}"#;
/// What A's spoke answers through a tunnel.
const A_ANSWER: &str = r#"{"cluster":"store-a"}"#;
/// tom's bearer token for the proxy front (never to appear in a log).
const TOM_TOKEN: &str = "tom-3f9a0c1d2e4b5a6978c0ffee";
const WAIT: Duration = Duration::from_secs(30);

/// ann reaches A by name, tom (group team-a, a token) every cluster labelled team=a, bea B by
/// name (the positive control); nora is in no rule.
const RULES: &str = r#"
rules:
  - name: ann-store-a
    users: [ann]
    clusters: {names: [store-a]}
    access: full
  - name: team-a
    groups: [team-a]
    clusters: {selector: {matchLabels: {team: a}}}
    access: full
  - name: bea-store-b
    users: [bea]
    clusters: {names: [store-b]}
    access: full
"#;

/// Who presents themselves, and how.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Who {
    /// A's agent certificate.
    AgentA,
    /// ann: a kubectl user certificate allowed on A by name.
    UserA,
    /// tom: a bearer token allowed on A by A's labels.
    TokenA,
    /// nora: a kubectl user certificate no access rule names.
    NoRule,
    /// A gateway certificate (`flotilla-hub gateway-cert`).
    Gateway,
    /// The operator's certificate.
    Operator,
    /// No certificate and no token.
    Anonymous,
}

/// B's objects and A's own, as the sweep aims at them.
#[derive(Clone, Debug, Default)]
struct Targets {
    b_work_uid: String,
    b_work_generation: i64,
    /// B's work deleted on the hub, held by its cleanup finalizer until B's agent releases it.
    b_held_uid: String,
    b_chunked_uid: String,
    b_chunk_sha: String,
    a_work_uid: String,
    a_work_generation: i64,
}

impl Targets {
    /// Stand-ins of the right shape, for the completeness checks.
    fn example() -> Targets {
        Targets {
            b_work_uid: "b-uid".into(),
            b_work_generation: 1,
            b_held_uid: "b-held-uid".into(),
            b_chunked_uid: "b-chunked-uid".into(),
            b_chunk_sha: content::sha256_hex(b"chunk"),
            a_work_uid: "a-uid".into(),
            a_work_generation: 1,
        }
    }
}

// ---- the session protocol: a row per frame A can send ----

/// A frame of A's aimed at B; every field of `AgentFrame`'s oneof has a row (checked against
/// the .proto).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum FrameRow {
    /// A hello naming B: refused with a goodbye naming both.
    HelloNamingB,
    /// A's own hello claiming to hold B's work and to be releasing B's held one, with B's name
    /// as a claim: welcomed; the sync sends A its own works and a delete of the uid it named.
    HelloHoldingBsWorks,
    /// A heartbeat: echoed; it keeps only A alive.
    Heartbeat,
    /// An ack of B's work at its generation: nothing (no finalizer on B's work).
    AckOfBsWork,
    /// A status for B's work: ignored and logged, never acknowledged.
    StatusOfBsWork,
    /// A goodbye: ends A's session only.
    Goodbye,
    /// A renewal whose request names B: a certificate for A (the subject is the session's).
    RenewalNamingB,
    /// A report of claims and resources naming B: written into A's ManagedCluster only.
    ClusterInfo,
    /// A request for B's chunk of B's work: refused, no bytes.
    ChunkOfBsWork,
    /// A request for B's chunk under A's own work: refused, no bytes.
    BsChunkUnderAsWork,
    /// A release of B's deleted work: acknowledged (nothing of A's to release); B's work keeps
    /// its finalizer.
    ReleaseOfBsWork,
}

impl FrameRow {
    const ALL: [FrameRow; 11] = [
        FrameRow::HelloNamingB,
        FrameRow::HelloHoldingBsWorks,
        FrameRow::Heartbeat,
        FrameRow::AckOfBsWork,
        FrameRow::StatusOfBsWork,
        FrameRow::Goodbye,
        FrameRow::RenewalNamingB,
        FrameRow::ClusterInfo,
        FrameRow::ChunkOfBsWork,
        FrameRow::BsChunkUnderAsWork,
        FrameRow::ReleaseOfBsWork,
    ];

    /// The frame A sends.
    fn frame(self, t: &Targets) -> agent_frame::Frame {
        match self {
            FrameRow::HelloNamingB => agent_frame::Frame::Hello(hello(B)),
            FrameRow::HelloHoldingBsWorks => agent_frame::Frame::Hello(wire::Hello {
                held: vec![wire::HeldWork {
                    uid: t.b_work_uid.clone(),
                    generation: t.b_work_generation,
                    content_hash: "held-by-store-a".into(),
                }],
                releasing: vec![t.b_held_uid.clone()],
                claims: vec![wire::ClusterClaim {
                    name: "id.k8s.io".into(),
                    value: B.into(),
                }],
                ..hello(A)
            }),
            FrameRow::Heartbeat => agent_frame::Frame::Heartbeat(wire::Heartbeat { seq: 4242 }),
            FrameRow::AckOfBsWork => agent_frame::Frame::WorkAck(wire::WorkAck {
                uid: t.b_work_uid.clone(),
                generation: t.b_work_generation,
            }),
            FrameRow::StatusOfBsWork => agent_frame::Frame::WorkStatus(wire::WorkStatus {
                uid: t.b_work_uid.clone(),
                generation: t.b_work_generation,
                seq: 1_000_000,
                status_json: applied_status(t.b_work_generation, "written by store-a")
                    .to_string()
                    .into_bytes(),
            }),
            FrameRow::Goodbye => agent_frame::Frame::Goodbye(wire::Goodbye {
                reason: format!("{A} leaves, naming {B}"),
                refusal: wire::Refusal::ClusterDenied.into(),
            }),
            FrameRow::RenewalNamingB => {
                agent_frame::Frame::RenewCertificate(wire::RenewCertificate {
                    csr_pem: csr(B).expect("a CSR"),
                })
            }
            FrameRow::ClusterInfo => agent_frame::Frame::ClusterInfo(wire::ClusterInfo {
                claims: vec![wire::ClusterClaim {
                    name: "id.k8s.io".into(),
                    value: B.into(),
                }],
                kubernetes_version: "v1.99.0-reported-by-store-a".into(),
                capacity: [("cpu".to_string(), "999".to_string())].into(),
                allocatable: [("cpu".to_string(), "999".to_string())].into(),
            }),
            FrameRow::ChunkOfBsWork => agent_frame::Frame::ChunkRequest(wire::ChunkRequest {
                work_uid: t.b_chunked_uid.clone(),
                chunk_sha256: t.b_chunk_sha.clone(),
            }),
            FrameRow::BsChunkUnderAsWork => agent_frame::Frame::ChunkRequest(wire::ChunkRequest {
                work_uid: t.a_work_uid.clone(),
                chunk_sha256: t.b_chunk_sha.clone(),
            }),
            FrameRow::ReleaseOfBsWork => agent_frame::Frame::WorkReleased(wire::WorkReleased {
                uid: t.b_held_uid.clone(),
            }),
        }
    }
}

/// The oneof field a frame fills. No wildcard: a new field does not compile until it is named
/// here, and then fails [`every_agent_frame_field_has_a_row`] until it has a row.
fn oneof_field(frame: &agent_frame::Frame) -> &'static str {
    match frame {
        agent_frame::Frame::Hello(_) => "hello",
        agent_frame::Frame::Heartbeat(_) => "heartbeat",
        agent_frame::Frame::WorkAck(_) => "work_ack",
        agent_frame::Frame::WorkStatus(_) => "work_status",
        agent_frame::Frame::Goodbye(_) => "goodbye",
        agent_frame::Frame::RenewCertificate(_) => "renew_certificate",
        agent_frame::Frame::ClusterInfo(_) => "cluster_info",
        agent_frame::Frame::ChunkRequest(_) => "chunk_request",
        agent_frame::Frame::WorkReleased(_) => "work_released",
    }
}

// ---- the agents' listener: a row per call ----

/// A call on the agents' listener; every rpc of the .proto's services has one (checked).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Call {
    /// A session opened with a hello naming B by someone who is not an agent: refused as not
    /// an agent.
    FleetSession,
    /// The answer to one of B's tunnels (its id, guessable from A's own): refused, and B's
    /// tunnel still opens for B.
    FleetTunnel,
    /// The relay hop to B: refused to all but a gateway certificate (the positive control).
    RelayTunnel,
    /// Where B's session is: refused to all but a gateway certificate (the positive control).
    RelayPresence,
    /// A join under B's name: refused, the name is B's key's.
    RegistrationJoin,
}

impl Call {
    const ALL: [Call; 5] = [
        Call::FleetSession,
        Call::FleetTunnel,
        Call::RelayTunnel,
        Call::RelayPresence,
        Call::RegistrationJoin,
    ];

    fn rpc(self) -> &'static str {
        match self {
            Call::FleetSession => "Fleet.Session",
            Call::FleetTunnel => "Fleet.Tunnel",
            Call::RelayTunnel => "Relay.Tunnel",
            Call::RelayPresence => "Relay.Presence",
            Call::RegistrationJoin => "Registration.Join",
        }
    }

    /// Who tries it.
    fn identities(self) -> &'static [Who] {
        match self {
            Call::FleetSession => &[Who::Gateway, Who::UserA, Who::Operator, Who::Anonymous],
            Call::FleetTunnel => &[
                Who::AgentA,
                Who::Gateway,
                Who::UserA,
                Who::Operator,
                Who::Anonymous,
            ],
            Call::RelayTunnel | Call::RelayPresence => {
                &[Who::AgentA, Who::UserA, Who::Operator, Who::Anonymous]
            }
            Call::RegistrationJoin => &[Who::AgentA, Who::Anonymous],
        }
    }
}

// ---- the proxy front: a row per kind of request ----

/// Where a request of the proxy front leads, by its path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Leads {
    /// To B's tunnel.
    B,
    /// To A's tunnel (the path only looks like B's).
    A,
    /// Nowhere: not a cluster path (404 before anyone is asked who they are).
    Nowhere,
    /// Nowhere: a cluster path with a `.` or `..` segment, which normalized would leave the
    /// cluster's API (400 before anyone is asked who they are).
    Refused,
}

struct ProxyRow {
    name: &'static str,
    method: &'static str,
    target: &'static str,
    headers: &'static [(&'static str, &'static str)],
    body: &'static str,
    leads: Leads,
}

const CONFIG_MAP: &str =
    r#"{"apiVersion":"v1","kind":"ConfigMap","metadata":{"name":"settings"},"data":{"by":"a"}}"#;
const UPGRADE_WEBSOCKET: &[(&str, &str)] = &[
    ("Connection", "Upgrade"),
    ("Upgrade", "websocket"),
    ("Sec-WebSocket-Version", "13"),
    ("Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ=="),
    ("Sec-WebSocket-Protocol", "v5.channel.k8s.io"),
];
const UPGRADE_SPDY: &[(&str, &str)] = &[
    ("Connection", "Upgrade"),
    ("Upgrade", "SPDY/3.1"),
    ("X-Stream-Protocol-Version", "portforward.k8s.io"),
];
const IMPERSONATING: &[(&str, &str)] = &[
    ("Impersonate-User", "system:admin"),
    ("Impersonate-Group", "system:masters"),
    ("Impersonate-Extra-Scopes", "all"),
];

/// A row of the proxy table.
const fn request(
    name: &'static str,
    method: &'static str,
    target: &'static str,
    headers: &'static [(&'static str, &'static str)],
    body: &'static str,
    leads: Leads,
) -> ProxyRow {
    ProxyRow {
        name,
        method,
        target,
        headers,
        body,
        leads,
    }
}

/// A row of the proxy table that is a plain GET.
const fn get(name: &'static str, target: &'static str, leads: Leads) -> ProxyRow {
    request(name, "GET", target, &[], "", leads)
}

const PROXY_ROWS: &[ProxyRow] = &[
    get(
        "get",
        "/clusters/store-b/api/v1/namespaces/default/configmaps/settings",
        Leads::B,
    ),
    get(
        "list",
        "/clusters/store-b/api/v1/namespaces/default/configmaps",
        Leads::B,
    ),
    get(
        "watch (?watch=1)",
        "/clusters/store-b/api/v1/namespaces/default/configmaps?watch=1",
        Leads::B,
    ),
    get(
        "watch (?watch=true, all namespaces)",
        "/clusters/store-b/api/v1/configmaps?watch=true&resourceVersion=0",
        Leads::B,
    ),
    request(
        "create",
        "POST",
        "/clusters/store-b/api/v1/namespaces/default/configmaps",
        &[("Content-Type", "application/json")],
        CONFIG_MAP,
        Leads::B,
    ),
    request(
        "update",
        "PUT",
        "/clusters/store-b/api/v1/namespaces/default/configmaps/settings",
        &[("Content-Type", "application/json")],
        CONFIG_MAP,
        Leads::B,
    ),
    request(
        "patch",
        "PATCH",
        "/clusters/store-b/api/v1/namespaces/default/configmaps/settings",
        &[("Content-Type", "application/merge-patch+json")],
        r#"{"data":{"by":"a"}}"#,
        Leads::B,
    ),
    request(
        "delete",
        "DELETE",
        "/clusters/store-b/api/v1/namespaces/default/configmaps/settings",
        &[],
        "",
        Leads::B,
    ),
    request(
        "deletecollection",
        "DELETE",
        "/clusters/store-b/api/v1/namespaces/default/configmaps",
        &[],
        "",
        Leads::B,
    ),
    request(
        "another method (OPTIONS)",
        "OPTIONS",
        "/clusters/store-b/api",
        &[],
        "",
        Leads::B,
    ),
    request(
        "exec upgrade (WebSocket)",
        "GET",
        "/clusters/store-b/api/v1/namespaces/default/pods/web/exec?command=sh&stdin=true&stdout=true",
        UPGRADE_WEBSOCKET,
        "",
        Leads::B,
    ),
    request(
        "port-forward upgrade (SPDY)",
        "POST",
        "/clusters/store-b/api/v1/namespaces/default/pods/web/portforward",
        UPGRADE_SPDY,
        "",
        Leads::B,
    ),
    request(
        "impersonation sent by the user, to B",
        "GET",
        "/clusters/store-b/api/v1/secrets",
        IMPERSONATING,
        "",
        Leads::B,
    ),
    request(
        "impersonation sent by the user, to A",
        "GET",
        "/clusters/store-a/api/v1/secrets",
        IMPERSONATING,
        "",
        Leads::A,
    ),
    get(
        "B's path climbing to A (..)",
        "/clusters/store-b/../store-a/api/v1/namespaces",
        Leads::Refused,
    ),
    get(
        "A's path climbing to B (..)",
        "/clusters/store-a/../store-b/api/v1/namespaces",
        Leads::Refused,
    ),
    get(
        "A's path climbing to B (%2e%2e)",
        "/clusters/store-a/%2e%2e/store-b/api/v1/namespaces",
        Leads::Refused,
    ),
    get(
        "A's path naming B after //",
        "/clusters/store-a//clusters/store-b/api/v1/namespaces",
        Leads::A,
    ),
    get(
        "B in the query of A's path",
        "/clusters/store-a/api/v1/namespaces?cluster=store-b&clusters=/clusters/store-b",
        Leads::A,
    ),
    get(
        "an encoded slash in the cluster name",
        "/clusters/store-a%2F..%2Fstore-b/api/v1/namespaces",
        Leads::Nowhere,
    ),
    get(
        "an empty cluster name (//)",
        "/clusters//store-b/api/v1/namespaces",
        Leads::Nowhere,
    ),
    get(
        "a percent-encoded cluster name",
        "/clusters/%73tore-b/api/v1/namespaces",
        Leads::Nowhere,
    ),
    get(
        "B's name in capitals",
        "/clusters/STORE-B/api/v1/namespaces",
        Leads::Nowhere,
    ),
    get("no cluster at all", "/api/v1/namespaces", Leads::Nowhere),
    get(
        "a leading //",
        "//clusters/store-b/api/v1/namespaces",
        Leads::Nowhere,
    ),
];

/// Who the proxy sweep sends each row as (bea, allowed on B, is the positive control, apart).
const PROXY_IDENTITIES: &[Who] = &[
    Who::UserA,
    Who::TokenA,
    Who::NoRule,
    Who::AgentA,
    Who::Gateway,
    Who::Operator,
    Who::Anonymous,
];

// ---- the operator API: a row per route and method ----

struct OperatorRow {
    method: &'static str,
    /// The route as the router names it.
    route: &'static str,
    /// The route aimed at B (or at the fleet).
    target: String,
    body: Option<Value>,
}

fn operator_rows(t: &Targets, token_id: &str, csr: &str) -> Vec<OperatorRow> {
    let mc = |name: &str| object_path(Kind::ManagedCluster, None, name);
    let work = |name: &str| object_path(Kind::ManifestWork, Some(B), name);
    let row = |method, route, target: String, body: Option<Value>| OperatorRow {
        method,
        route,
        target,
        body,
    };
    let b_cluster = json!({
        "apiVersion": "cluster.open-cluster-management.io/v1", "kind": "ManagedCluster",
        "metadata": {"name": B}, "spec": {"hubAcceptsClient": false},
    });
    let a_work = json!({
        "apiVersion": "work.open-cluster-management.io/v1", "kind": "ManifestWork",
        "metadata": {"name": "b-work", "namespace": B},
        "spec": {"workload": {"manifests": [config_map("settings", json!({"by": "a"}))]}},
    });
    vec![
        row("GET", "/healthz", "/healthz".into(), None),
        row(
            "GET",
            "/registration/v1/tokens",
            "/registration/v1/tokens".into(),
            None,
        ),
        row(
            "POST",
            "/registration/v1/tokens",
            "/registration/v1/tokens".into(),
            Some(json!({"ttlSeconds": 600, "autoAccept": true, "labels": {"team": "b"}})),
        ),
        row(
            "DELETE",
            "/registration/v1/tokens/{id}",
            format!("/registration/v1/tokens/{token_id}"),
            None,
        ),
        row(
            "POST",
            "/registration/v1/clusters/{name}/accept",
            format!("/registration/v1/clusters/{B}/accept"),
            Some(json!({})),
        ),
        row(
            "POST",
            "/registration/v1/clusters/{name}/deny",
            format!("/registration/v1/clusters/{B}/deny"),
            Some(json!({"reason": "denied by store-a"})),
        ),
        row(
            "POST",
            "/registration/v1/clusters/{name}/dev-key",
            format!("/registration/v1/clusters/{B}/dev-key"),
            Some(json!({"keySha256": "ab".repeat(32)})),
        ),
        row(
            "GET",
            "/registration/v1/ca",
            "/registration/v1/ca".into(),
            None,
        ),
        row(
            "POST",
            "/registration/v1/users",
            "/registration/v1/users".into(),
            Some(json!({"user": "mallory", "groups": ["team-b"], "csr": csr})),
        ),
        row(
            "POST",
            "/registration/v1/ca/rotate",
            "/registration/v1/ca/rotate".into(),
            None,
        ),
        row(
            "POST",
            "/registration/v1/ca/finish-rotation",
            "/registration/v1/ca/finish-rotation".into(),
            None,
        ),
        row(
            "GET",
            "/apis/{group}/{version}/{plural}",
            collection_path(Kind::ManagedCluster, None),
            None,
        ),
        row(
            "POST",
            "/apis/{group}/{version}/{plural}",
            collection_path(Kind::ManagedCluster, None),
            Some(json!({
                "apiVersion": "cluster.open-cluster-management.io/v1", "kind": "ManagedCluster",
                "metadata": {"name": "store-c"}, "spec": {"hubAcceptsClient": true},
            })),
        ),
        row(
            "GET",
            "/apis/{group}/{version}/namespaces/{ns}/{plural}",
            collection_path(Kind::ManifestWork, Some(B)),
            None,
        ),
        row(
            "POST",
            "/apis/{group}/{version}/namespaces/{ns}/{plural}",
            collection_path(Kind::ManifestWork, Some(B)),
            Some(json!({
                "apiVersion": "work.open-cluster-management.io/v1", "kind": "ManifestWork",
                "metadata": {"name": "from-a", "namespace": B},
                "spec": {"workload": {"manifests": [config_map("planted", json!({"by": "a"}))]}},
            })),
        ),
        row(
            "GET",
            "/apis/{group}/{version}/{plural}/{name}",
            mc(B),
            None,
        ),
        row(
            "PUT",
            "/apis/{group}/{version}/{plural}/{name}",
            mc(B),
            Some(b_cluster.clone()),
        ),
        row(
            "DELETE",
            "/apis/{group}/{version}/{plural}/{name}",
            mc(B),
            None,
        ),
        row(
            "GET",
            "/apis/{group}/{version}/namespaces/{ns}/{plural}/{name}",
            work("b-work"),
            None,
        ),
        row(
            "PUT",
            "/apis/{group}/{version}/namespaces/{ns}/{plural}/{name}",
            work("b-work"),
            Some(a_work.clone()),
        ),
        row(
            "DELETE",
            "/apis/{group}/{version}/namespaces/{ns}/{plural}/{name}",
            work("b-work"),
            None,
        ),
        row(
            "PUT",
            "/apis/{group}/{version}/{plural}/{name}/status",
            format!("{}/status", mc(B)),
            Some(
                json!({"metadata": {"name": B}, "status": {"version": {"kubernetes": "v0.0.0-a"}}}),
            ),
        ),
        row(
            "PUT",
            "/apis/{group}/{version}/namespaces/{ns}/{plural}/{name}/status",
            format!("{}/status", work("b-work")),
            Some(
                json!({"metadata": {"name": "b-work"}, "status": applied_status(t.b_work_generation, "written by store-a")}),
            ),
        ),
        // The hub's ConfigMaps (the core group's paths).
        row(
            "GET",
            "/api/{version}/{plural}",
            collection_path(Kind::ConfigMap, None),
            None,
        ),
        row(
            "GET",
            "/api/{version}/namespaces/{ns}/{plural}",
            collection_path(Kind::ConfigMap, Some(B)),
            None,
        ),
        row(
            "POST",
            "/api/{version}/namespaces/{ns}/{plural}",
            collection_path(Kind::ConfigMap, Some(B)),
            Some(json!({"apiVersion": "v1", "kind": "ConfigMap",
                        "metadata": {"name": "from-a", "namespace": B},
                        "data": {"by": "a"}})),
        ),
        row(
            "GET",
            "/api/{version}/namespaces/{ns}/{plural}/{name}",
            object_path(Kind::ConfigMap, Some(B), "b-settings"),
            None,
        ),
        row(
            "PUT",
            "/api/{version}/namespaces/{ns}/{plural}/{name}",
            object_path(Kind::ConfigMap, Some(B), "b-settings"),
            Some(json!({"apiVersion": "v1", "kind": "ConfigMap",
                        "metadata": {"name": "b-settings", "namespace": B},
                        "data": {"by": "a"}})),
        ),
        row(
            "DELETE",
            "/api/{version}/namespaces/{ns}/{plural}/{name}",
            object_path(Kind::ConfigMap, Some(B), "b-settings"),
            None,
        ),
        row("GET", "/ui", "/ui".into(), None),
        row("GET", "/ui/", "/ui/".into(), None),
        row("GET", "/ui/clusters", "/ui/clusters".into(), None),
        row("GET", "/ui/works", format!("/ui/works?cluster={B}"), None),
        row("GET", "/ui/placements", "/ui/placements".into(), None),
        row("GET", "/ui/rollouts", "/ui/rollouts".into(), None),
        row("GET", "/ui/compliance", "/ui/compliance".into(), None),
        row("GET", "/ui/style.css", "/ui/style.css".into(), None),
        row("GET", "/ui/api/summary", "/ui/api/summary".into(), None),
        row("GET", "/ui/api/clusters", "/ui/api/clusters".into(), None),
        row(
            "GET",
            "/ui/api/works",
            format!("/ui/api/works?cluster={B}"),
            None,
        ),
        row(
            "GET",
            "/ui/api/placements",
            "/ui/api/placements".into(),
            None,
        ),
        row("GET", "/ui/api/rollouts", "/ui/api/rollouts".into(), None),
        row(
            "GET",
            "/ui/api/compliance",
            "/ui/api/compliance".into(),
            None,
        ),
    ]
}

/// Who the operator API sweep sends each row as (the operator, reading, is the control).
const OPERATOR_IDENTITIES: &[Who] = &[
    Who::AgentA,
    Who::UserA,
    Who::Gateway,
    Who::TokenA,
    Who::Anonymous,
];

// ---- helpers ----

fn hello(cluster: &str) -> wire::Hello {
    wire::Hello {
        protocol_version: flotilla_proto::PROTOCOL_VERSION,
        cluster_name: cluster.into(),
        agent_version: "isolation-sweep".into(),
        ..Default::default()
    }
}

fn agent_frame(frame: agent_frame::Frame) -> AgentFrame {
    AgentFrame { frame: Some(frame) }
}

fn config_map(name: &str, data: Value) -> Value {
    json!({"apiVersion": "v1", "kind": "ConfigMap",
           "metadata": {"name": name, "namespace": "default"}, "data": data})
}

fn manifest_work(cluster: &str, name: &str, manifests: Vec<Value>) -> Value {
    json!({"apiVersion": "work.open-cluster-management.io/v1", "kind": "ManifestWork",
           "metadata": {"name": name, "namespace": cluster},
           "spec": {"workload": {"manifests": manifests}}})
}

/// A ManifestWork status of one Applied condition whose message is `message`.
fn applied_status(generation: i64, message: &str) -> Value {
    json!({"conditions": [{
        "type": "Applied", "status": "True", "reason": "AppliedManifestWorkComplete",
        "message": message, "observedGeneration": generation,
        "lastTransitionTime": "2026-01-01T00:00:00Z",
    }]})
}

/// A PEM certificate signing request for a fresh key, its subject naming `cluster` as an
/// agent's would.
fn csr(cluster: &str) -> anyhow::Result<String> {
    let key = rcgen::KeyPair::generate()?;
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new())?;
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, cluster);
    params
        .distinguished_name
        .push(rcgen::DnType::OrganizationName, "flotilla:clusters");
    Ok(params.serialize_request(&key)?.pem()?)
}

/// Who a PEM certificate says its holder is, read as the hub reads it.
fn identity_of(pem: &str) -> anyhow::Result<Peer> {
    let certs = flotilla_transport::tls::parse_certs(pem.as_bytes(), "issued certificate")?;
    let first = certs.first().context("no certificate in the PEM")?;
    Ok(Peer::from_der(first)?)
}

/// Whether any of `frames`' bytes hold `needle`.
fn carries(frames: &[wire::HubFrame], needle: &str) -> bool {
    frames.iter().any(|f| {
        f.encode_to_vec()
            .windows(needle.len())
            .any(|w| w == needle.as_bytes())
    })
}

/// The hub's frames other than the liveness ones, as short words: what a session saw.
fn notable(frames: &[wire::HubFrame]) -> Vec<String> {
    frames
        .iter()
        .filter_map(|f| match f.frame.as_ref()? {
            hub_frame::Frame::Heartbeat(_) => None,
            hub_frame::Frame::Welcome(_) => Some("Welcome".to_string()),
            hub_frame::Frame::WorkUpdate(u) => {
                Some(format!("WorkUpdate {}/{}", u.namespace, u.name))
            }
            hub_frame::Frame::WorkDelete(d) => Some(format!("WorkDelete {}", d.uid)),
            hub_frame::Frame::SyncComplete(_) => Some("SyncComplete".to_string()),
            hub_frame::Frame::StatusAck(a) => Some(format!("StatusAck {} {}", a.uid, a.seq)),
            hub_frame::Frame::ReleaseAck(a) => Some(format!("ReleaseAck {}", a.uid)),
            hub_frame::Frame::OpenTunnel(o) => Some(format!("OpenTunnel {}", o.id)),
            hub_frame::Frame::TrustBundle(_) => Some("TrustBundle".to_string()),
            other => Some(format!("{other:?}")),
        })
        .collect()
}

/// The sweep's fleet: one hub (sled or kube) on one carrier, B's agent played by the test,
/// and the identities.
struct Sweep {
    _tmp: tempfile::TempDir,
    dir: PathBuf,
    fleet: Fleet,
    carrier: Carrier,
    b: ScriptedAgent,
    t: Targets,
    /// Every session of A's the sweep opened: what they received is checked for B's content.
    a_sessions: Vec<ScriptedAgent>,
    /// A bootstrap token the operator made (id, secret).
    bootstrap: (String, String),
    /// What B's session had seen once set up, and B's objects then.
    b_seen: Vec<String>,
    b_state: Value,
    /// Cases run, for the summary.
    cases: usize,
}

impl Sweep {
    async fn start(kube: bool) -> anyhow::Result<Sweep> {
        let tmp = tempfile::tempdir()?;
        let dir = tmp.path().to_path_buf();
        let carrier = current_carrier();
        let mut flags = proxy_flags(&dir, RULES, &format!("{TOM_TOKEN},tom,1001,\"team-a\"\n"))?;
        // Raw sessions beat at the hub's interval; a machine busy with other builds must not
        // turn B Unknown in the middle of the sweep for reasons of its own.
        flags.extend(
            [
                "--metrics-addr=127.0.0.1:0",
                "--heartbeat-timeout=5s",
                "--grace-period=20s",
            ]
            .map(String::from),
        );
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        let fleet = Fleet::start_with(&dir, kube, &flags).await?;
        let hub = &fleet.hub;
        hub.dev_cert(A, &dir.join(A))?;
        hub.dev_cert(B, &dir.join(B))?;
        hub.gateway_cert(&dir)?;
        for user in ["ann", "nora", "bea"] {
            hub.create_user(&dir, user, &[])?;
        }
        fleet.cli(&["cluster", "label", A, "team=a"])?;
        fleet.cli(&["cluster", "label", B, "team=b"])?;

        fleet.apply_value(
            &dir,
            &manifest_work(
                B,
                "b-work",
                vec![config_map("settings", json!({"secret": B_SECRET}))],
            ),
        )?;
        fleet.apply_value(
            &dir,
            &manifest_work(B, "b-held", vec![config_map("held", json!({"k": "v"}))]),
        )?;
        // A hub ConfigMap in B's namespace (what B's policies' hub templates read).
        fleet.apply_value(
            &dir,
            &json!({"apiVersion": "v1", "kind": "ConfigMap",
                    "metadata": {"name": "b-settings", "namespace": B},
                    "data": {"secret": B_SECRET}}),
        )?;
        let big = config_map("big", json!({"secret": B_CHUNK_SECRET}));
        let (reference, chunks) = content::split(&[Manifest(big)]);
        for chunk in &chunks {
            fleet.apply_value(&dir, &content::chunk_object(B, chunk))?;
        }
        fleet.apply_value(
            &dir,
            &manifest_work(B, "b-chunked", vec![reference.manifest().0]),
        )?;
        fleet.apply_value(
            &dir,
            &manifest_work(A, "a-work", vec![config_map("own", json!({"k": "a"}))]),
        )?;

        // B's agent: acks the work that will be held by its finalizer, nothing else.
        let b = ScriptedAgent::start(
            B,
            dial(
                &hub.agents_addr,
                carrier,
                identity_tls(&dir.join(B), &[])?,
                agent_frame(agent_frame::Frame::Hello(hello(B))),
            )
            .await?,
            Script {
                ack_works: vec!["b-held".into()],
                tunnel_answer: B_ANSWER.into(),
            },
        );
        b.wait_frame("B's sync", WAIT, |f| {
            matches!(f, hub_frame::Frame::SyncComplete(_)).then_some(())
        })
        .await?;
        let update = |name: &'static str| {
            let b = &b;
            async move {
                b.wait_frame(&format!("{name}'s update"), WAIT, |f| match f {
                    hub_frame::Frame::WorkUpdate(u) if u.name == name => {
                        Some((u.uid.clone(), u.generation))
                    }
                    _ => None,
                })
                .await
            }
        };
        let (b_work_uid, b_work_generation) = update("b-work").await?;
        let (b_held_uid, _) = update("b-held").await?;
        let (b_chunked_uid, _) = update("b-chunked").await?;
        let mut sweep = Sweep {
            _tmp: tmp,
            dir,
            fleet,
            carrier,
            b,
            t: Targets {
                b_work_uid,
                b_work_generation,
                b_held_uid,
                b_chunked_uid,
                b_chunk_sha: chunks[0].sha256.clone(),
                ..Targets::default()
            },
            a_sessions: Vec::new(),
            bootstrap: (String::new(), String::new()),
            b_seen: Vec::new(),
            b_state: Value::Null,
            cases: 0,
        };
        let a_work = sweep
            .operator_get(&object_path(Kind::ManifestWork, Some(A), "a-work"))
            .await?;
        sweep.t.a_work_uid = a_work["metadata"]["uid"]
            .as_str()
            .context("a-work's uid")?
            .into();
        sweep.t.a_work_generation = a_work["metadata"]["generation"].as_i64().unwrap_or(1);

        // What B's agent says of its own: a status with its secret, its claims and version.
        let status = applied_status(sweep.t.b_work_generation, B_STATUS_SECRET);
        sweep
            .b
            .send(agent_frame::Frame::WorkStatus(wire::WorkStatus {
                uid: sweep.t.b_work_uid.clone(),
                generation: sweep.t.b_work_generation,
                seq: 1,
                status_json: status.to_string().into_bytes(),
            }))
            .await?;
        let uid = sweep.t.b_work_uid.clone();
        sweep
            .b
            .wait_frame("the ack of B's status", WAIT, |f| match f {
                hub_frame::Frame::StatusAck(a) if a.uid == uid => Some(()),
                _ => None,
            })
            .await?;
        sweep
            .b
            .send(agent_frame::Frame::ClusterInfo(wire::ClusterInfo {
                claims: vec![wire::ClusterClaim {
                    name: "id.k8s.io".into(),
                    value: B.into(),
                }],
                kubernetes_version: "v1.33.0-store-b".into(),
                capacity: [("cpu".to_string(), "4".to_string())].into(),
                allocatable: [("cpu".to_string(), "4".to_string())].into(),
            }))
            .await?;
        let b_path = object_path(Kind::ManagedCluster, None, B);
        wait_for("B's report and Available on the hub", WAIT, || async {
            let mc = sweep.operator_get(&b_path).await?;
            Ok((mc["status"]["version"]["kubernetes"] == "v1.33.0-store-b"
                && condition_status(&mc, AVAILABLE).as_deref() == Some("True"))
            .then_some(()))
        })
        .await?;
        // b-held: acked, so held by its finalizer; then deleted, so it waits for B's release.
        let held_path = object_path(Kind::ManifestWork, Some(B), "b-held");
        wait_for("b-held's cleanup finalizer", WAIT, || async {
            let w = sweep.operator_get(&held_path).await?;
            Ok(has_cleanup_finalizer(&w).then_some(()))
        })
        .await?;
        let deleted = sweep
            .operator(Who::Operator, &Request::new("DELETE", &held_path))
            .await?;
        ensure!(deleted.status == 200, "deleting b-held: {deleted:?}");
        let held = sweep.t.b_held_uid.clone();
        sweep
            .b
            .wait_frame("b-held's delete", WAIT, |f| match f {
                hub_frame::Frame::WorkDelete(d) if d.uid == held => Some(()),
                _ => None,
            })
            .await?;
        let w = sweep.operator_get(&held_path).await?;
        ensure!(
            has_cleanup_finalizer(&w) && w["metadata"]["deletionTimestamp"].is_string(),
            "b-held is held for B's release: {w}"
        );
        // A bootstrap token, for the join under B's name and the operator API's rows.
        let made = sweep
            .operator(
                Who::Operator,
                &Request::new("POST", "/registration/v1/tokens").json(&json!({"ttlSeconds": 3600})),
            )
            .await?;
        ensure!(made.status == 201, "token create: {made:?}");
        let made: Value = serde_json::from_str(&made.body)?;
        sweep.bootstrap = (
            made["id"].as_str().context("token id")?.into(),
            made["token"].as_str().context("token")?.into(),
        );
        // The status page reads the whole fleet before it answers.
        wait_for("the status page to have read the fleet", WAIT, || async {
            let page = sweep
                .operator(Who::Operator, &Request::new("GET", "/ui/api/summary"))
                .await?;
            Ok((page.status == 200).then_some(()))
        })
        .await?;

        sweep.b_seen = notable(&sweep.b.received().await);
        sweep.b_state = sweep.b_state().await?;
        Ok(sweep)
    }

    fn identity_dir(&self, who: Who) -> Option<PathBuf> {
        let operator = self.fleet.hub.data_dir.join("operator");
        match who {
            Who::AgentA => Some(self.dir.join(A)),
            Who::UserA => Some(operator.join("users/ann")),
            Who::NoRule => Some(operator.join("users/nora")),
            Who::Gateway => Some(self.dir.join("gateway-cert")),
            Who::Operator => Some(operator),
            Who::TokenA | Who::Anonymous => None,
        }
    }

    /// `who`'s TLS client: its certificate, or none.
    fn tls(&self, who: Who, alpn: &[&[u8]]) -> anyhow::Result<Arc<rustls::ClientConfig>> {
        match self.identity_dir(who) {
            Some(dir) => identity_tls(&dir, alpn),
            None => anonymous_tls(&self.fleet.hub.data_dir.join("operator/ca.crt"), alpn),
        }
    }

    /// `request` to the operator API as `who` (tom's token in its header).
    async fn operator(&self, who: Who, request: &Request) -> anyhow::Result<Answer> {
        let mut request = request.clone();
        if who == Who::TokenA {
            request = request.header("Authorization", &format!("Bearer {TOM_TOKEN}"));
        }
        https::send(
            &self.fleet.hub.api_addr,
            self.tls(who, &[b"http/1.1"])?,
            &request,
        )
        .await
    }

    /// An object of the operator API, read as the operator.
    async fn operator_get(&self, path: &str) -> anyhow::Result<Value> {
        let answer = self
            .operator(Who::Operator, &Request::new("GET", path))
            .await?;
        ensure!(
            answer.status == 200,
            "GET {path}: {} {}",
            answer.status,
            answer.body
        );
        Ok(serde_json::from_str(&answer.body)?)
    }

    /// `request` to the proxy front as `who`.
    async fn proxy(&self, who: Who, request: &Request) -> anyhow::Result<Answer> {
        let mut request = request.clone();
        if who == Who::TokenA {
            request = request.header("Authorization", &format!("Bearer {TOM_TOKEN}"));
        }
        let url = self.fleet.hub.proxy_url()?;
        let address = url.trim_start_matches("https://");
        https::send(address, self.tls(who, &[b"http/1.1"])?, &request).await
    }

    /// What the hub holds of B that A must not change: its registered keys, acceptance,
    /// reported facts and availability; each of its works' spec, finalizers, deletion and
    /// status; its chunks.
    async fn b_state(&self) -> anyhow::Result<Value> {
        let mc = self
            .operator_get(&object_path(Kind::ManagedCluster, None, B))
            .await?;
        let works = self
            .operator_get(&collection_path(Kind::ManifestWork, Some(B)))
            .await?;
        let chunks = self
            .operator_get(&collection_path(Kind::ManifestChunk, Some(B)))
            .await?;
        let mut works: Vec<Value> = works["items"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|w| {
                json!({
                    "name": w["metadata"]["name"], "uid": w["metadata"]["uid"],
                    "generation": w["metadata"]["generation"], "spec": w["spec"],
                    "finalizers": w["metadata"]["finalizers"],
                    "deleting": w["metadata"]["deletionTimestamp"].is_string(),
                    "status": w["status"],
                })
            })
            .collect();
        works.sort_by_key(|w| w["name"].to_string());
        let mut chunks: Vec<Value> = chunks["items"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|c| json!({"name": c["metadata"]["name"], "data": c["spec"]["data"]}))
            .collect();
        chunks.sort_by_key(|c| c["name"].to_string());
        let config_maps = self
            .operator_get(&collection_path(Kind::ConfigMap, Some(B)))
            .await?;
        let mut config_maps: Vec<Value> = config_maps["items"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|c| json!({"name": c["metadata"]["name"], "data": c["data"]}))
            .collect();
        config_maps.sort_by_key(|c| c["name"].to_string());
        let annotation = |key: &str| mc["metadata"]["annotations"][key].clone();
        Ok(json!({
            "keys": annotation(KEY_PINS_ANNOTATION),
            "denied": annotation(DENIED_ANNOTATION),
            "accepted": mc["spec"]["hubAcceptsClient"],
            "taints": mc["spec"]["taints"],
            "claims": mc["status"]["clusterClaims"],
            "version": mc["status"]["version"],
            "capacity": mc["status"]["capacity"],
            "allocatable": mc["status"]["allocatable"],
            "available": condition_status(&mc, AVAILABLE),
            "works": works,
            "chunks": chunks,
            "configMaps": config_maps,
        }))
    }

    /// After case `case`: B's objects are as they were, B's session saw nothing new but
    /// heartbeat echoes, and it is still open.
    async fn b_untouched(&mut self, case: &str) -> anyhow::Result<()> {
        self.cases += 1;
        let now = self.b_state().await?;
        ensure!(
            now == self.b_state,
            "{case}: B's objects changed\nbefore: {:#}\nafter: {now:#}",
            self.b_state
        );
        let seen = notable(&self.b.received().await);
        ensure!(
            seen == self.b_seen,
            "{case}: B's session saw more than before\nbefore: {:?}\nafter: {seen:?}",
            self.b_seen
        );
        ensure!(self.b.is_open(), "{case}: B's session ended");
        Ok(())
    }

    /// Takes what B's session has seen since as the new normal (after a positive control that
    /// reached B on purpose).
    async fn b_moved_on(&mut self) -> anyhow::Result<()> {
        self.b_seen = notable(&self.b.received().await);
        self.b_state = self.b_state().await?;
        Ok(())
    }

    /// Waits until B's session hears one more heartbeat echo: it is alive now.
    async fn b_alive(&self) -> anyhow::Result<()> {
        let echoes = |frames: &[wire::HubFrame]| {
            frames
                .iter()
                .filter(|f| matches!(f.frame, Some(hub_frame::Frame::Heartbeat(_))))
                .count()
        };
        let before = echoes(&self.b.received().await);
        wait_for("B's next heartbeat echo", WAIT, || async {
            Ok((echoes(&self.b.received().await) > before).then_some(()))
        })
        .await
    }

    /// A session of A's on the sweep's carrier, opened with `first`.
    async fn dial_a(&self, first: agent_frame::Frame) -> anyhow::Result<ScriptedAgent> {
        Ok(ScriptedAgent::start(
            A,
            dial(
                &self.fleet.hub.agents_addr,
                self.carrier,
                identity_tls(&self.dir.join(A), &[])?,
                agent_frame(first),
            )
            .await?,
            Script {
                ack_works: Vec::new(),
                tunnel_answer: A_ANSWER.into(),
            },
        ))
    }

    /// A's session, welcomed and synced.
    async fn open_a(&self) -> anyhow::Result<ScriptedAgent> {
        let a = self.dial_a(agent_frame::Frame::Hello(hello(A))).await?;
        a.wait_frame("A's sync", WAIT, |f| {
            matches!(f, hub_frame::Frame::SyncComplete(_)).then_some(())
        })
        .await?;
        Ok(a)
    }

    fn hub_log(&self) -> String {
        self.fleet.hub.proc.log()
    }
}

fn has_cleanup_finalizer(work: &Value) -> bool {
    work["metadata"]["finalizers"]
        .as_array()
        .is_some_and(|f| f.iter().any(|f| f == WORK_CLEANUP_FINALIZER))
}

fn goodbye(f: &hub_frame::Frame) -> Option<wire::Goodbye> {
    match f {
        hub_frame::Frame::Goodbye(g) => Some(g.clone()),
        _ => None,
    }
}

// ---- the tables, run ----

async fn frame_rows(s: &mut Sweep) -> anyhow::Result<()> {
    for row in FrameRow::ALL {
        let frame = row.frame(&s.t);
        let case = format!("frame {} ({row:?})", oneof_field(&frame));
        let a = match row {
            FrameRow::HelloNamingB => {
                let a = s.dial_a(frame).await?;
                let said = a.wait_frame("a goodbye", WAIT, goodbye).await?;
                ensure!(
                    said.reason.contains(A) && said.reason.contains(B),
                    "{case}: the goodbye names both: {said:?}"
                );
                a.wait_ended(WAIT).await?;
                a
            }
            FrameRow::HelloHoldingBsWorks => {
                let a = s.dial_a(frame).await?;
                a.wait_frame("A's sync", WAIT, |f| {
                    matches!(f, hub_frame::Frame::SyncComplete(_)).then_some(())
                })
                .await?;
                let mut told_to_drop = false;
                for f in a.received().await.iter().filter_map(|f| f.frame.as_ref()) {
                    match f {
                        hub_frame::Frame::WorkUpdate(u) => ensure!(
                            u.namespace == A,
                            "{case}: A was sent {}/{}",
                            u.namespace,
                            u.name
                        ),
                        hub_frame::Frame::WorkDelete(d) => {
                            ensure!(
                                d.uid == s.t.b_work_uid
                                    && d.namespace.is_empty()
                                    && d.name.is_empty(),
                                "{case}: A was told to delete {d:?}"
                            );
                            told_to_drop = true;
                        }
                        _ => {}
                    }
                }
                ensure!(
                    told_to_drop,
                    "{case}: A holds a uid that is not its cluster's, and the sync must tell it to drop it"
                );
                a
            }
            FrameRow::Heartbeat => {
                let a = s.open_a().await?;
                a.send(frame).await?;
                a.wait_frame("the echo", WAIT, |f| match f {
                    hub_frame::Frame::Heartbeat(h) if h.seq == 4242 => Some(()),
                    _ => None,
                })
                .await?;
                a
            }
            FrameRow::AckOfBsWork => {
                // The hello claims B's work at its generation and the ack follows at once.
                // Until the sync's delete of that uid goes out, the session machine takes the
                // ack for one of a work it delivered, and the gateway's own check of whose
                // work it is decides (on the kube backend the sync reads the store first, so
                // the first ack gets there; on sled the delete may win the race, and the
                // machine drops the ack itself). The second ack, after the sync, is the
                // machine's to drop. The gateway's check alone is held by `desired`'s
                // `a_sessions_lookups_answer_for_its_own_cluster_only`.
                let held = wire::Hello {
                    held: vec![wire::HeldWork {
                        uid: s.t.b_work_uid.clone(),
                        generation: s.t.b_work_generation,
                        content_hash: "held-by-store-a".into(),
                    }],
                    ..hello(A)
                };
                let a = s.dial_a(agent_frame::Frame::Hello(held)).await?;
                a.send(frame.clone()).await?;
                a.wait_frame("A's sync", WAIT, |f| {
                    matches!(f, hub_frame::Frame::SyncComplete(_)).then_some(())
                })
                .await?;
                a.send(frame).await?;
                // A's ack of its own work goes the same way and shows on A's work.
                a.send(agent_frame::Frame::WorkAck(wire::WorkAck {
                    uid: s.t.a_work_uid.clone(),
                    generation: s.t.a_work_generation,
                }))
                .await?;
                let a_path = object_path(Kind::ManifestWork, Some(A), "a-work");
                wait_for("a-work's cleanup finalizer", WAIT, || async {
                    Ok(has_cleanup_finalizer(&s.operator_get(&a_path).await?).then_some(()))
                })
                .await?;
                let judged: Vec<&str> = s
                    .hub_log()
                    .lines()
                    .filter(|l| {
                        l.contains("work durable on the agent") && l.contains(&s.t.b_work_uid)
                    })
                    .map(|l| {
                        if l.contains("current=true") {
                            "current"
                        } else {
                            "not current"
                        }
                    })
                    .collect();
                eprintln!("{case}: the hub judged A's acks of B's work {judged:?}");
                a
            }
            FrameRow::StatusOfBsWork => {
                let ignored = |log: &str| {
                    log.lines()
                        .filter(|l| {
                            l.contains(
                                "status for neither a work nor a policy of this cluster; ignored",
                            ) && l.contains(&s.t.b_work_uid)
                        })
                        .count()
                };
                let before = ignored(&s.hub_log());
                let a = s.open_a().await?;
                a.send(frame).await?;
                wait_for("the hub to ignore A's status of B's work", WAIT, || async {
                    Ok((ignored(&s.hub_log()) > before).then_some(()))
                })
                .await?;
                // A's status of its own work goes the same way and is acknowledged.
                a.send(agent_frame::Frame::WorkStatus(wire::WorkStatus {
                    uid: s.t.a_work_uid.clone(),
                    generation: s.t.a_work_generation,
                    seq: 7,
                    status_json: applied_status(s.t.a_work_generation, "store-a's own")
                        .to_string()
                        .into_bytes(),
                }))
                .await?;
                let own = s.t.a_work_uid.clone();
                a.wait_frame("the ack of A's own status", WAIT, |f| match f {
                    hub_frame::Frame::StatusAck(ack) if ack.uid == own => Some(()),
                    _ => None,
                })
                .await?;
                let acked_b = a.received().await.iter().any(|f| {
                    matches!(&f.frame, Some(hub_frame::Frame::StatusAck(ack)) if ack.uid == s.t.b_work_uid)
                });
                ensure!(!acked_b, "{case}: A's status of B's work was acknowledged");
                a
            }
            FrameRow::Goodbye => {
                let a = s.open_a().await?;
                a.send(frame).await?;
                a.wait_ended(WAIT).await?;
                s.b_alive().await?;
                a
            }
            FrameRow::RenewalNamingB => {
                let a = s.open_a().await?;
                a.send(frame).await?;
                let issued = a
                    .wait_frame("a certificate", WAIT, |f| match f {
                        hub_frame::Frame::CertificateIssued(c) => {
                            Some(Ok(c.certificate_pem.clone()))
                        }
                        hub_frame::Frame::RenewalRefused(r) => Some(Err(r.reason.clone())),
                        _ => None,
                    })
                    .await?
                    .map_err(|reason| anyhow::anyhow!("{case}: renewal refused: {reason}"))?;
                let peer = identity_of(&issued)?;
                ensure!(
                    peer == Peer::Cluster(A.into()),
                    "{case}: the certificate is {peer:?}'s"
                );
                a
            }
            FrameRow::ClusterInfo => {
                let a = s.open_a().await?;
                a.send(frame).await?;
                let a_path = object_path(Kind::ManagedCluster, None, A);
                wait_for("A's report on A's ManagedCluster", WAIT, || async {
                    let mc = s.operator_get(&a_path).await?;
                    Ok(
                        (mc["status"]["version"]["kubernetes"] == "v1.99.0-reported-by-store-a")
                            .then_some(()),
                    )
                })
                .await?;
                a
            }
            FrameRow::ChunkOfBsWork | FrameRow::BsChunkUnderAsWork => {
                let a = s.open_a().await?;
                a.send(frame).await?;
                let sha = s.t.b_chunk_sha.clone();
                let reason = a
                    .wait_frame("the chunk's refusal", WAIT, |f| match f {
                        hub_frame::Frame::ChunkRefused(r) if r.chunk_sha256 == sha => {
                            Some(r.reason.clone())
                        }
                        _ => None,
                    })
                    .await?;
                ensure!(
                    reason.contains(&format!("no ManifestWork of cluster {A}")),
                    "{case}: {reason}"
                );
                let got_bytes = a
                    .received()
                    .await
                    .iter()
                    .any(|f| matches!(f.frame, Some(hub_frame::Frame::Chunk(_))));
                ensure!(!got_bytes, "{case}: A was sent a chunk");
                a
            }
            FrameRow::ReleaseOfBsWork => {
                let a = s.open_a().await?;
                a.send(frame).await?;
                let uid = s.t.b_held_uid.clone();
                a.wait_frame("the release's ack", WAIT, |f| match f {
                    hub_frame::Frame::ReleaseAck(r) if r.uid == uid => Some(()),
                    _ => None,
                })
                .await?;
                a
            }
        };
        s.a_sessions.push(a);
        s.b_untouched(&case).await?;
    }
    Ok(())
}

async fn calls(s: &mut Sweep) -> anyhow::Result<()> {
    for call in Call::ALL {
        match call {
            Call::FleetSession => {
                for &who in call.identities() {
                    let case = format!("{} as {who:?}", call.rpc());
                    let tls = s.tls(who, &[])?;
                    let session = ScriptedAgent::start(
                        B,
                        dial(
                            &s.fleet.hub.agents_addr,
                            s.carrier,
                            tls,
                            agent_frame(agent_frame::Frame::Hello(hello(B))),
                        )
                        .await
                        .with_context(|| format!("{case}: the dial"))?,
                        Script::default(),
                    );
                    let said = session
                        .wait_frame("a goodbye", WAIT, goodbye)
                        .await
                        .with_context(|| case.clone())?;
                    ensure!(
                        said.refusal == i32::from(wire::Refusal::NotAnAgent),
                        "{case}: {said:?}"
                    );
                    session.wait_ended(WAIT).await?;
                    s.b_alive().await?;
                    s.b_untouched(&case).await?;
                }
            }
            Call::FleetTunnel => fleet_tunnel(s).await?,
            Call::RelayTunnel => relay_tunnel(s).await?,
            Call::RelayPresence => relay_presence(s).await?,
            Call::RegistrationJoin => {
                for &who in call.identities() {
                    let case = format!("{} as {who:?}", call.rpc());
                    let name = rustls_pki_types::ServerName::try_from("localhost")?;
                    let channel = flotilla_transport::grpc::connect(
                        &s.fleet.hub.agents_addr,
                        name,
                        s.tls(who, &[])?,
                        None,
                        None,
                    )
                    .await?;
                    let mut updates = wire::registration_client::RegistrationClient::new(channel)
                        .join(wire::JoinRequest {
                            cluster_name: B.into(),
                            token: s.bootstrap.1.clone(),
                            csr_pem: csr(B)?,
                            labels: vec!["team=a".into()],
                        })
                        .await?
                        .into_inner();
                    let update = tokio::time::timeout(WAIT, updates.message())
                        .await
                        .context("the join's answer")??
                        .context("the join ended without an answer")?;
                    ensure!(
                        update.state == i32::from(wire::join_update::State::Denied)
                            && update
                                .message
                                .contains("already registered with a different key")
                            && update.certificate_pem.is_empty(),
                        "{case}: {update:?}"
                    );
                    s.b_untouched(&case).await?;
                }
            }
        }
    }
    Ok(())
}

/// B's tunnel waits (held by B's agent) while each identity answers it itself with its id;
/// then B answers, and the user allowed on B gets B's answer.
async fn fleet_tunnel(s: &mut Sweep) -> anyhow::Result<()> {
    s.b.hold_tunnels(true);
    let opened = s.b.tunnels_opened().await.len();
    let url = s.fleet.hub.proxy_url()?;
    let address = url.trim_start_matches("https://").to_string();
    let bea_tls = identity_tls(
        &s.fleet.hub.data_dir.join("operator/users/bea"),
        &[b"http/1.1"],
    )?;
    let request = Request::new(
        "GET",
        "/clusters/store-b/api/v1/namespaces/default/configmaps/settings",
    );
    let asked = tokio::spawn(async move { https::send(&address, bea_tls, &request).await });
    let id = wait_for("B's tunnel to be opened", WAIT, || async {
        Ok(s.b.tunnels_opened().await.get(opened).cloned())
    })
    .await?;
    // B's own tunnel, asked for by bea: B has seen it; nothing more may come.
    s.b_moved_on().await?;
    for (&who, bytes) in Call::FleetTunnel
        .identities()
        .iter()
        .flat_map(|who| [(who, true), (who, false)])
    {
        let case = match bytes {
            true => format!("TunnelBytes {id} as {who:?}"),
            false => format!("Fleet.Tunnel {id} as {who:?}"),
        };
        // Tunnel calls are gRPC's; a QUIC agent's tunnels are streams the gateway opens, so
        // on QUIC this shows no gRPC call can reach them either.
        let hello_as = if who == Who::AgentA { A } else { B };
        let (dialed, _) = dial(
            &s.fleet.hub.agents_addr,
            Carrier::Grpc,
            s.tls(who, &[])?,
            agent_frame(agent_frame::Frame::Hello(hello(hello_as))),
        )
        .await?;
        let refused = match dialed.tunnels.open_requested(&id, bytes).await {
            Some(Err(e)) => e.to_string(),
            Some(Ok(_)) => bail!("{case}: the call was given B's tunnel"),
            None => bail!("{case}: a gRPC connection has tunnel calls"),
        };
        let expected = if who == Who::AgentA {
            format!("no tunnel {id} is waiting for cluster {A}")
        } else {
            "only agents open tunnels".to_string()
        };
        ensure!(refused.contains(&expected), "{case}: {refused}");
        s.b_untouched(&case).await?;
    }
    s.b.hold_tunnels(false);
    let answer = tokio::time::timeout(WAIT, asked)
        .await
        .context("bea's request")???;
    ensure!(
        answer.status == 200 && answer.body == B_ANSWER,
        "B's tunnel, answered by B after every other call for it was refused: {answer:?}"
    );
    s.b_moved_on().await
}

/// The relay hop to B, refused to all but a gateway certificate.
async fn relay_tunnel(s: &mut Sweep) -> anyhow::Result<()> {
    let address = s.fleet.hub.agents_addr.clone();
    for &who in Call::RelayTunnel.identities() {
        let case = format!("Relay.Tunnel to {B} as {who:?}");
        let hop = flotilla_transport::hop::HopClient::new(s.tls(who, &[])?)
            .with_server_name(Some("localhost".into()));
        match hop.open(&address, B, &format!("relay-{who:?}"), WAIT).await {
            Ok(_) => bail!("{case}: the hop opened"),
            Err(e) => ensure!(
                e.to_string().contains("may not open the relay hop"),
                "{case}: {e}"
            ),
        }
        s.b_untouched(&case).await?;
    }
    // The control: a gateway certificate opens it, and B's agent answers.
    let hop = flotilla_transport::hop::HopClient::new(s.tls(Who::Gateway, &[])?)
        .with_server_name(Some("localhost".into()));
    let mut stream = hop
        .open(&address, B, "relay-gateway", WAIT)
        .await
        .context("a gateway certificate opens the relay hop")?;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    stream
        .write_all(b"GET /version HTTP/1.1\r\nHost: spoke\r\nImpersonate-User: gw\r\nConnection: close\r\n\r\n")
        .await?;
    let mut answer = Vec::new();
    tokio::time::timeout(WAIT, stream.read_to_end(&mut answer))
        .await
        .context("B's answer through the hop")??;
    ensure!(
        String::from_utf8_lossy(&answer).contains(B_ANSWER),
        "the hop's answer: {}",
        String::from_utf8_lossy(&answer)
    );
    s.b_moved_on().await
}

/// Where B's session is, told to a gateway certificate only.
async fn relay_presence(s: &mut Sweep) -> anyhow::Result<()> {
    use flotilla_transport::hop::OwnerPresence;
    let address = s.fleet.hub.agents_addr.clone();
    for &who in Call::RelayPresence.identities() {
        let case = format!("Relay.Presence of {B} as {who:?}");
        let hop = flotilla_transport::hop::HopClient::new(s.tls(who, &[])?)
            .with_server_name(Some("localhost".into()));
        match hop.presence(&address, &[B], WAIT).await {
            Ok(answer) => bail!("{case}: answered {answer:?}"),
            Err(e) => ensure!(
                e.to_string().contains("may not ask about sessions"),
                "{case}: {e}"
            ),
        }
        s.b_untouched(&case).await?;
    }
    // The control: a gateway certificate is told B's live session and its carrier.
    let hop = flotilla_transport::hop::HopClient::new(s.tls(Who::Gateway, &[])?)
        .with_server_name(Some("localhost".into()));
    let answer = hop
        .presence(&address, &[B], WAIT)
        .await
        .context("a gateway certificate asks where B's session is")?;
    ensure!(
        matches!(answer.get(B), Some(OwnerPresence::Connected { carrier, .. }) if *carrier == s.fleet.hub.carrier),
        "B's session as its gateway tells it: {answer:?}"
    );
    s.b_moved_on().await
}

/// One expected audit line: (user, cluster, status).
type AuditKey = (String, String, u16);

async fn proxy_rows(s: &mut Sweep) -> anyhow::Result<()> {
    // A's spoke, for the rows that lead there.
    let a = s.open_a().await?;
    let audited_before = s.fleet.hub.audit_lines()?.len();
    let mut expected: Vec<AuditKey> = Vec::new();
    let b_requests = s.b.tunnel_requests().await.len();
    for row in PROXY_ROWS {
        for &who in PROXY_IDENTITIES {
            let case = format!(
                "proxy {} ({} {}) as {who:?}",
                row.name, row.method, row.target
            );
            let mut request = Request::new(row.method, row.target);
            for (name, value) in row.headers {
                request = request.header(name, value);
            }
            request.body = row.body.as_bytes().to_vec();
            let a_requests = a.tunnel_requests().await.len();
            let answer = s.proxy(who, &request).await.with_context(|| case.clone())?;
            let user = match who {
                Who::UserA => "ann",
                Who::TokenA => "tom",
                Who::NoRule => "nora",
                _ => "",
            };
            let allowed_on_a = matches!(who, Who::UserA | Who::TokenA);
            let (status, user, cluster) = match row.leads {
                Leads::Nowhere => (404, "", ""),
                Leads::Refused => (400, "", ""),
                _ if user.is_empty() => (401, "", cluster_of(row.leads)),
                Leads::A if allowed_on_a => (200, user, A),
                _ => (403, user, cluster_of(row.leads)),
            };
            ensure!(
                answer.status == status,
                "{case}: expected {status}, got {} {}",
                answer.status,
                answer.body
            );
            ensure!(
                !answer.body.contains("only-for-store-b"),
                "{case}: B's content in the answer: {}",
                answer.body
            );
            if status == 200 {
                ensure!(answer.body == A_ANSWER, "{case}: {}", answer.body);
                let heads = a.tunnel_requests().await;
                ensure!(
                    heads.len() == a_requests + 1,
                    "{case}: A's tunnel saw {heads:?}"
                );
                let head = heads
                    .last()
                    .map(|h| h.to_ascii_lowercase())
                    .unwrap_or_default();
                ensure!(
                    head.contains(&format!("impersonate-user: {user}\r\n"))
                        && !head.contains("system:admin")
                        && !head.contains("system:masters")
                        && !head.contains("impersonate-extra")
                        && !head.contains("authorization"),
                    "{case}: A's spoke was asked {head}"
                );
            } else {
                ensure!(
                    a.tunnel_requests().await.len() == a_requests,
                    "{case}: a refused request reached A's tunnel"
                );
            }
            ensure!(
                s.b.tunnel_requests().await.len() == b_requests,
                "{case}: the request reached B's tunnel"
            );
            expected.push((user.to_string(), cluster.to_string(), status));
            s.b_untouched(&case).await?;
        }
    }
    // Every request is audited, once, with who it was, where to, and what it got.
    let lines = wait_for("an audit line per request", WAIT, || async {
        let lines = s.fleet.hub.audit_lines()?;
        Ok((lines.len() >= audited_before + expected.len()).then_some(lines))
    })
    .await?;
    let mut audited: Vec<AuditKey> = lines[audited_before..]
        .iter()
        .map(|l| {
            (
                l["user"].as_str().unwrap_or_default().to_string(),
                l["cluster"].as_str().unwrap_or_default().to_string(),
                l["status"].as_u64().unwrap_or_default() as u16,
            )
        })
        .collect();
    audited.sort();
    expected.sort();
    ensure!(
        audited == expected,
        "audit lines {audited:?}\nexpected {expected:?}"
    );
    let text = std::fs::read_to_string(s.fleet.hub.audit_path())?;
    ensure!(!text.contains(TOM_TOKEN), "the audit log holds tom's token");
    s.a_sessions.push(a);
    Ok(())
}

fn cluster_of(leads: Leads) -> &'static str {
    match leads {
        Leads::A => A,
        Leads::B => B,
        Leads::Nowhere | Leads::Refused => "",
    }
}

async fn operator_routes(s: &mut Sweep) -> anyhow::Result<()> {
    let ca_before = s.operator_get("/registration/v1/ca").await?;
    let tokens_before = s.operator_get("/registration/v1/tokens").await?;
    let rows = operator_rows(&s.t, &s.bootstrap.0, &csr("mallory")?);
    for row in &rows {
        let mut request = Request::new(row.method, &row.target);
        if let Some(body) = &row.body {
            request = request.json(body);
        }
        for &who in OPERATOR_IDENTITIES {
            let case = format!("operator API {} {} as {who:?}", row.method, row.target);
            match s.operator(who, &request).await {
                // No certificate: the handshake fails (the hub's alert, or the connection it
                // closed under the request), before any route and whatever the token says.
                Err(_) if matches!(who, Who::Anonymous | Who::TokenA) => {}
                Err(e) => return Err(e.context(case)),
                Ok(answer) => {
                    let says = match who {
                        Who::AgentA => format!("cluster {A} may not use the operator API"),
                        Who::UserA => {
                            "is a kubectl user of the proxy front, not an operator".into()
                        }
                        Who::Gateway => "may not use the operator API".into(),
                        _ => bail!("{case}: answered without a certificate: {answer:?}"),
                    };
                    ensure!(
                        answer.status == 403 && answer.body.contains(&says),
                        "{case}: {} {}",
                        answer.status,
                        answer.body
                    );
                    ensure!(
                        !answer.body.contains("only-for-store-b"),
                        "{case}: B's content in the refusal"
                    );
                }
            }
            s.b_untouched(&case).await?;
        }
        // The control: the operator reads every route that reads.
        if row.method == "GET" {
            let answer = s.operator(Who::Operator, &request).await?;
            ensure!(
                answer.status < 400,
                "operator GET {}: {} {}",
                row.target,
                answer.status,
                answer.body
            );
        }
    }
    ensure!(
        s.operator_get("/registration/v1/ca").await? == ca_before,
        "the CA changed"
    );
    ensure!(
        s.operator_get("/registration/v1/tokens").await? == tokens_before,
        "the bootstrap tokens changed"
    );
    Ok(())
}

/// The plain-HTTP metrics and health port answers nothing cluster-specific.
async fn ops_port(s: &mut Sweep) -> anyhow::Result<()> {
    let address = s
        .fleet
        .hub
        .metrics_addr
        .clone()
        .context("the hub serves --metrics-addr")?;
    for path in ["/metrics", "/healthz", "/livez", "/readyz"] {
        let (status, body) = flotilla_e2e::http_get(&address, path).await?;
        ensure!(status == 200, "GET {path}: {status} {body}");
        for name in [A, B, "b-work", "b-held", "only-for-store-b"] {
            ensure!(!body.contains(name), "GET {path} names {name}:\n{body}");
        }
        s.cases += 1;
    }
    Ok(())
}

/// What holds across the whole sweep: nothing A received carries B's content, B saw only its
/// own, the hub's log holds no token, key or content, and B's own agent can still release its
/// work (the positive control of the release row).
async fn afterwards(s: &mut Sweep) -> anyhow::Result<()> {
    let mut frames = Vec::new();
    for a in &s.a_sessions {
        frames.extend(a.received().await);
    }
    for secret in [
        B_SECRET,
        B_CHUNK_SECRET,
        B_STATUS_SECRET,
        B_ANSWER,
        "v1.33.0-store-b",
        "\"b-work\"",
        "b-chunked",
    ] {
        ensure!(!carries(&frames, secret), "A received {secret:?}");
    }
    for name in ["b-work", "b-held", "b-chunked"] {
        let named = frames.iter().any(|f| match &f.frame {
            Some(hub_frame::Frame::WorkUpdate(u)) => u.name == name,
            Some(hub_frame::Frame::WorkDelete(d)) => d.name == name,
            _ => false,
        });
        ensure!(!named, "A was sent B's work {name}");
    }
    let log = s.hub_log();
    for secret in [
        TOM_TOKEN,
        &s.bootstrap.1,
        "PRIVATE KEY",
        B_SECRET,
        B_CHUNK_SECRET,
        B_STATUS_SECRET,
    ] {
        ensure!(!log.contains(secret), "the hub's log holds {secret:?}");
    }
    // B's agent releases b-held: it goes, and B hears so.
    s.b.send(agent_frame::Frame::WorkReleased(wire::WorkReleased {
        uid: s.t.b_held_uid.clone(),
    }))
    .await?;
    let uid = s.t.b_held_uid.clone();
    s.b.wait_frame("B's release ack", WAIT, |f| match f {
        hub_frame::Frame::ReleaseAck(r) if r.uid == uid => Some(()),
        _ => None,
    })
    .await?;
    let held_path = object_path(Kind::ManifestWork, Some(B), "b-held");
    wait_for("b-held gone once B released it", WAIT, || async {
        let answer = s
            .operator(Who::Operator, &Request::new("GET", &held_path))
            .await?;
        Ok((answer.status == 404).then_some(()))
    })
    .await?;
    Ok(())
}

async fn sweep(kube: bool) -> anyhow::Result<()> {
    let mut s = Sweep::start(kube).await?;
    let backend = if kube { "kube" } else { "sled" };
    frame_rows(&mut s).await.context("frames")?;
    calls(&mut s)
        .await
        .context("calls on the agents' listener")?;
    proxy_rows(&mut s).await.context("the proxy front")?;
    operator_routes(&mut s).await.context("the operator API")?;
    ops_port(&mut s).await.context("the metrics port")?;
    afterwards(&mut s).await.context("afterwards")?;
    eprintln!(
        "isolation sweep on {backend}/{}: {} cases, B untouched after each",
        s.carrier, s.cases
    );
    Ok(())
}

on_both_carriers! {
    /// Every table on the single-node hub on its embedded store.
    async fn a_cluster_reaches_nothing_of_another_on_sled() -> anyhow::Result<()> {
        sweep(false).await
    }
}

on_both_carriers! {
    /// Every table on the hub on a real kube-apiserver.
    async fn a_cluster_reaches_nothing_of_another_on_kube() -> anyhow::Result<()> {
        sweep(true).await
    }
}

// ---- the tables are complete ----

/// The names inside `block_start { ... }` of a .proto file, by a line's leading words.
fn proto_block<'a>(text: &'a str, block_start: &str) -> Vec<&'a str> {
    let start = text
        .find(block_start)
        .unwrap_or_else(|| panic!("{block_start} in the .proto"));
    let body = &text[start + block_start.len()..];
    let end = body.find('}').expect("the block ends");
    body[..end]
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with("//"))
        .collect()
}

fn read_source(path: &str) -> String {
    let path = workspace_root().join(path);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn every_agent_frame_field_has_a_row() {
    let proto = read_source("proto/proto/flotilla/v1/session.proto");
    let message = &proto[proto.find("message AgentFrame {").expect("AgentFrame")..];
    let in_proto: BTreeSet<String> = proto_block(message, "oneof frame {")
        .into_iter()
        .map(|l| {
            l.split_whitespace()
                .nth(1)
                .expect("type name = n;")
                .to_string()
        })
        .collect();
    let t = Targets::example();
    let in_table: BTreeSet<String> = FrameRow::ALL
        .iter()
        .map(|row| oneof_field(&row.frame(&t)).to_string())
        .collect();
    assert_eq!(in_table, in_proto, "every AgentFrame field has a row");
}

#[test]
fn every_call_on_the_agents_listener_has_a_row() {
    let mut in_proto = BTreeSet::new();
    for file in ["session.proto", "registration.proto"] {
        let proto = read_source(&format!("proto/proto/flotilla/v1/{file}"));
        for (i, _) in proto.match_indices("\nservice ") {
            let rest = &proto[i + "\nservice ".len()..];
            let service = rest.split_whitespace().next().expect("a service name");
            for line in proto_block(rest, "{") {
                if let Some(rpc) = line.strip_prefix("rpc ") {
                    let name = rpc.split('(').next().expect("rpc Name(").trim();
                    in_proto.insert(format!("{service}.{name}"));
                }
            }
        }
    }
    let in_table: BTreeSet<String> = Call::ALL.iter().map(|c| c.rpc().to_string()).collect();
    assert_eq!(
        in_table, in_proto,
        "every rpc of the agents' listener has a row"
    );
}

/// `(METHOD, path)` of every `.route("path", ...)` of a router's source.
fn routes_in(source: &str) -> BTreeSet<(String, String)> {
    let mut routes = BTreeSet::new();
    for (i, _) in source.match_indices(".route(") {
        let rest = &source[i + ".route(".len()..];
        let path = rest
            .trim_start()
            .strip_prefix('"')
            .and_then(|r| r.split('"').next())
            .expect("a route's path is a literal");
        // The handlers: up to the parenthesis that closes `.route(`.
        let mut depth = 1;
        let end = rest
            .char_indices()
            .find(|&(_, c)| {
                depth += match c {
                    '(' => 1,
                    ')' => -1,
                    _ => 0,
                };
                depth == 0
            })
            .map(|(j, _)| j)
            .expect("the route's call closes");
        let handlers = &rest[..end];
        for (method, needle) in [
            ("GET", "get("),
            ("POST", "post("),
            ("PUT", "put("),
            ("DELETE", "delete("),
            ("DELETE", "delete_route("),
            ("PATCH", "patch("),
        ] {
            let called = handlers.match_indices(needle).any(|(j, _)| {
                handlers[..j]
                    .chars()
                    .next_back()
                    .is_none_or(|c| !c.is_alphanumeric() && c != '_')
            });
            if called {
                routes.insert((method.to_string(), path.to_string()));
            }
        }
    }
    routes
}

#[test]
fn every_operator_api_route_has_a_row() {
    let mut in_code = routes_in(&read_source("hub/src/operator_api.rs"));
    in_code.extend(routes_in(&read_source("hub/src/status_page/mod.rs")));
    assert!(in_code.len() > 20, "the routes were read: {in_code:?}");
    let rows = operator_rows(&Targets::example(), "token-id", "csr");
    let in_table: BTreeSet<(String, String)> = rows
        .iter()
        .map(|r| (r.method.to_string(), r.route.to_string()))
        .collect();
    assert_eq!(
        in_table, in_code,
        "every route of the operator API has a row"
    );
}

#[test]
fn every_verb_of_the_proxy_front_has_a_row() {
    // The verbs the audit names, from its source: each must be some row's.
    let source = read_source("hub/src/proxy/audit.rs");
    let body = &source[source.find("pub fn verb(").expect("audit::verb")..];
    let body = &body[..body.find("\n}\n").expect("verb's end")];
    let named: BTreeSet<String> = body
        .match_indices("=> \"")
        .map(|(i, _)| {
            body[i + 4..]
                .split('"')
                .next()
                .expect("a literal")
                .to_string()
        })
        .collect();
    assert!(named.len() >= 8, "the verbs were read: {named:?}");
    let verb_of = |row: &ProxyRow| {
        let (path, query) = match row.target.split_once('?') {
            Some((p, q)) => (p, Some(q)),
            None => (row.target, None),
        };
        let rest = path
            .strip_prefix("/clusters/")
            .and_then(|r| r.find('/').map(|i| &r[i..]))
            .unwrap_or(path);
        flotilla_hub::proxy::audit::verb(&row.method.parse().expect("a method"), rest, query)
    };
    let in_table: BTreeSet<String> = PROXY_ROWS.iter().map(verb_of).collect();
    let missing: Vec<&String> = named.difference(&in_table).collect();
    assert!(missing.is_empty(), "verbs without a row: {missing:?}");
    assert!(
        in_table.difference(&named).next().is_some(),
        "a row for a method the audit names by itself (its fallback): {in_table:?}"
    );
    for upgrade in ["websocket", "SPDY/3.1"] {
        assert!(
            PROXY_ROWS.iter().any(|r| r
                .headers
                .iter()
                .any(|(n, v)| *n == "Upgrade" && *v == upgrade)),
            "an upgrade row for {upgrade}"
        );
    }
    for leads in [Leads::A, Leads::B, Leads::Nowhere, Leads::Refused] {
        assert!(
            PROXY_ROWS.iter().any(|r| r.leads == leads),
            "a row leading to {leads:?}"
        );
    }
}
