//! The bodies of the fuzz targets whose code lives in the hub (see `flotilla_proto::fuzzing`
//! for how the targets are run and replayed): the documents `flotilla apply -f` reads and the
//! operator API checks, the proxy front's request heads and access rules, certificate signing
//! requests, and bootstrap tokens.
//!
//! Not for: anything but fuzzing and its replay; nothing in flotilla calls these.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::OnceLock;
use std::time::Duration;

use flotilla_cli::cli;
use flotilla_proto::api::{Kind, ManifestWork, validate_manifest_work};
use flotilla_proto::contract::{self, CLUSTER_GROUP};
use flotilla_proto::fuzzing::FuzzInput;
use flotilla_proto::tunnel;
use flotilla_proto::wire::JoinRequest;
use flotilla_transport::identity::{Peer, public_key_sha256};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use jiff::{SignedDuration, Timestamp};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use serde_json::Value;

use crate::ca::{Ca, CaError};
use crate::operator_api;
use crate::proxy::access::{self, AccessRules, Decision};
use crate::proxy::authn::{ProxyTokens, ProxyUser};
use crate::proxy::{RequestHead, cluster_uri, forwarded_headers};
use crate::tokens::{self, ID_LEN, TokenError, Use};

/// `manifestwork`: a file as `flotilla apply -f` reads it (YAML or JSON documents), each
/// document's kind as the CLI finds it, and the operator API's checks of it as a body; the
/// same bytes also as one JSON body.
///
/// Properties: nothing panics; every document is an object that travels as JSON unchanged; a
/// refusal names the object (its `namespace/name`, or `<unnamed>`); a ManifestWork the API
/// accepts is a valid typed work that serializes and reads back to itself.
pub fn manifest_documents(data: &[u8]) {
    if let Ok(value) = serde_json::from_slice::<Value>(data)
        && value.is_object()
        && let Ok(kind) = cli::kind_of_document(&value)
    {
        check_document(kind, &value);
    }
    // The CLI reads files as UTF-8 text.
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let docs = match cli::parse_documents(text, "input.yaml") {
        Ok(docs) => docs,
        Err(e) => {
            let message = format!("{e:#}");
            assert!(message.starts_with("input.yaml: document "), "{message}");
            return;
        }
    };
    for doc in docs {
        assert!(doc.is_object(), "a document that is not an object: {doc}");
        let json = serde_json::to_vec(&doc).expect("a document serializes as JSON");
        let sent: Value = serde_json::from_slice(&json).expect("its JSON reads back");
        assert_eq!(
            sent, doc,
            "a document changes on its way to the operator API"
        );
        match cli::kind_of_document(&doc) {
            Ok(kind) => check_document(kind, &doc),
            Err(e) => assert!(e.to_string().contains("the hub serves only"), "{e}"),
        }
    }
}

fn check_document(kind: Kind, doc: &Value) {
    match operator_api::check_object(kind, doc) {
        Ok(()) => {
            if kind == Kind::ManifestWork {
                let work: ManifestWork =
                    serde_json::from_value(doc.clone()).expect("an accepted work parses");
                assert_eq!(validate_manifest_work(&work), Ok(()));
                let value = serde_json::to_value(&work).expect("a work serializes");
                let again: ManifestWork =
                    serde_json::from_value(value).expect("a serialized work parses");
                assert_eq!(again, work, "a work changes through its JSON");
            }
        }
        Err(message) => {
            let name = doc["metadata"]["name"]
                .as_str()
                .filter(|n| !n.is_empty())
                .unwrap_or("<unnamed>");
            assert!(
                message.contains(name),
                "{kind}: the refusal {message:?} does not name {name:?}"
            );
        }
    }
}

/// Bearer tokens of the fuzzed proxy front.
const PROXY_TOKENS: &str = "0123456789abcdef0123,carol,1001,\"ops,dev\"\n";

/// `proxy_head`: an HTTP/1.1 request head (parsed as hyper parses it) through the proxy
/// front's reading of it (cluster, path, verb, upgrade), its authentication from the headers,
/// and what is forwarded to the agent (headers, URI), then read by the agent.
///
/// Properties: a path that is not `/clusters/NAME[/...]` with NAME a valid cluster name is
/// refused naming the path; the path forwarded is what follows `/clusters/NAME`, and has no
/// `.` or `..` segment (plain or percent-encoded) that would take it out of the cluster's API
/// once normalized; read-only access never lets an upgrade or a write through; no credential
/// or impersonation header of the user reaches the agent, and the agent reads back exactly
/// the hub user the front set; hop-by-hop headers go, an upgrade's stay; the URI the agent
/// gets has the path and the query the user sent and no authority.
pub fn proxy_head(data: &[u8]) {
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut request = httparse::Request::new(&mut headers);
    let Ok(httparse::Status::Complete(_)) = request.parse(data) else {
        return;
    };
    let (Some(method), Some(target)) = (request.method, request.path) else {
        return;
    };
    let Ok(method) = http::Method::from_bytes(method.as_bytes()) else {
        return;
    };
    let Ok(uri) = target.parse::<http::Uri>() else {
        return;
    };
    let mut map = HeaderMap::new();
    for h in request.headers.iter() {
        let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(h.name.as_bytes()),
            HeaderValue::from_bytes(h.value),
        ) else {
            return;
        };
        map.append(name, value);
    }

    let head = match RequestHead::read(&method, &uri, &map) {
        Ok(head) => head,
        Err(refusal) => {
            assert!(refusal.message.contains(uri.path()), "{refusal:?}");
            return;
        }
    };
    assert!(contract::is_dns1123_label(&head.cluster), "{head:?}");
    let prefix = format!("/clusters/{}", head.cluster);
    assert!(
        uri.path() == format!("{prefix}{}", head.path)
            || (uri.path() == prefix && head.path == "/"),
        "{} read as {head:?}",
        uri.path()
    );
    assert!(head.path.starts_with('/'), "{head:?}");
    assert!(
        head.path.split('/').all(|s| !matches!(
            s.to_ascii_lowercase().replace("%2e", ".").as_str(),
            "." | ".."
        )),
        "{} leaves cluster {} once normalized",
        uri.path(),
        head.cluster
    );
    assert_eq!(head.upgrade, tunnel::is_upgrade(&map));
    if access::is_read_only(&method, &head.path, head.upgrade) {
        assert!(!head.upgrade, "read-only access let an upgrade through");
        let resource = head.path.trim_end_matches('/').rsplit('/').next();
        let self_review = matches!(
            resource,
            Some("selfsubjectaccessreviews" | "selfsubjectrulesreviews" | "selfsubjectreviews")
        );
        assert!(
            matches!(method, http::Method::GET | http::Method::HEAD)
                || (method == http::Method::POST && self_review),
            "read-only access let {method} {} through as {}",
            head.path,
            head.verb
        );
    }

    static TOKENS: OnceLock<ProxyTokens> = OnceLock::new();
    let tokens = TOKENS.get_or_init(|| ProxyTokens::parse(PROXY_TOKENS).expect("valid tokens"));
    let user = tokens
        .authenticate(&Peer::Anonymous, &map)
        .unwrap_or_else(|_| ProxyUser {
            user: "alice".into(),
            groups: vec!["ops".into()],
        });
    let mut forwarded = map.clone();
    forwarded_headers(&mut forwarded, &user, "t-1").expect("hub users travel in headers");
    for name in [
        header::AUTHORIZATION,
        header::PROXY_AUTHORIZATION,
        header::COOKIE,
        header::TRANSFER_ENCODING,
        header::TE,
        header::TRAILER,
    ] {
        assert!(forwarded.get(&name).is_none(), "{name} reached the agent");
    }
    for name in forwarded.keys() {
        if name.as_str().starts_with("impersonate-") {
            assert!(
                *name == tunnel::IMPERSONATE_USER || *name == tunnel::IMPERSONATE_GROUP,
                "the user's {name} reached the agent"
            );
        }
    }
    assert_eq!(
        tunnel::identity(&forwarded),
        Ok((user.user.clone(), user.groups.clone())),
        "the agent reads another identity than the hub set"
    );
    assert_eq!(tunnel::is_upgrade(&forwarded), head.upgrade);
    // The agent removes hop-by-hop headers again: nothing changes the second time.
    let mut at_agent = forwarded.clone();
    tunnel::remove_hop_by_hop(&mut at_agent);
    assert_eq!(at_agent, forwarded);

    if let Ok(on_cluster) = cluster_uri(&head.path, uri.query()) {
        assert_eq!(on_cluster.path(), head.path);
        assert_eq!(on_cluster.query(), uri.query());
        assert!(on_cluster.authority().is_none() && on_cluster.scheme().is_none());
    }
}

/// `access_rules`: an access rules file (the input up to its first NUL byte) and, from the
/// rest, who asks for which cluster with which labels.
///
/// Properties: a file that parses decides like the rules say (the widest access among the
/// rules that cover the user or a group and match the cluster by name or selector, by
/// Kubernetes label-selector semantics), naming a rule that gives it; when the rules say the
/// cluster's labels are not needed, they make no difference.
pub fn access_rules(data: &[u8]) {
    let split = data.iter().position(|&b| b == 0).unwrap_or(data.len());
    let Ok(text) = std::str::from_utf8(&data[..split]) else {
        return;
    };
    let Ok(rules) = AccessRules::parse(text) else {
        return;
    };
    let mut input = FuzzInput::new(data.get(split + 1..).unwrap_or_default());
    // Names the rules mention, and some they do not.
    let mut users: BTreeSet<String> = ["nobody".to_string()].into();
    let mut groups: BTreeSet<String> = ["nogroup".to_string()].into();
    let mut clusters: BTreeSet<String> = ["c0".to_string()].into();
    let mut labels: BTreeSet<(String, String)> = BTreeSet::new();
    for rule in &rules.rules {
        users.extend(rule.users.iter().cloned());
        groups.extend(rule.groups.iter().cloned());
        clusters.extend(rule.clusters.names.iter().cloned());
        if let Some(selector) = &rule.clusters.selector {
            for (k, v) in selector.match_labels.iter().flatten() {
                labels.insert((k.clone(), v.clone()));
            }
            for req in selector.match_expressions.iter().flatten() {
                for v in req.values.iter().flatten() {
                    labels.insert((req.key.clone(), v.clone()));
                }
                labels.insert((req.key.clone(), "other".into()));
            }
        }
    }
    let users: Vec<String> = users.into_iter().collect();
    let groups: Vec<String> = groups.into_iter().collect();
    let clusters: Vec<String> = clusters.into_iter().collect();
    let labels: Vec<(String, String)> = labels.into_iter().collect();
    for _ in 0..16 {
        let user = &users[usize::from(input.byte()) % users.len()];
        let asking: Vec<String> = (0..input.byte() % 3)
            .map(|_| groups[usize::from(input.byte()) % groups.len()].clone())
            .collect();
        let cluster = &clusters[usize::from(input.byte()) % clusters.len()];
        let cluster_labels: BTreeMap<String, String> = if labels.is_empty() {
            BTreeMap::new()
        } else {
            (0..input.byte() % 4)
                .map(|_| labels[usize::from(input.byte()) % labels.len()].clone())
                .collect()
        };
        let decision = rules.decide(user, &asking, cluster, &cluster_labels);
        let widest = rules
            .rules
            .iter()
            .filter(|r| {
                (r.users.contains(user) || r.groups.iter().any(|g| asking.contains(g)))
                    && (r.clusters.names.contains(cluster)
                        || r.clusters
                            .selector
                            .as_ref()
                            .is_some_and(|s| label_selector_matches(s, &cluster_labels)))
            })
            .map(|r| r.access)
            .max();
        match &decision {
            Decision::Allowed { access, rule } => {
                assert_eq!(Some(*access), widest, "{user} {asking:?} -> {cluster}");
                assert!(
                    rules
                        .rules
                        .iter()
                        .any(|r| r.name == *rule && r.access == *access),
                    "the decision names rule {rule:?}, which does not give {access:?}"
                );
            }
            Decision::Denied => assert_eq!(widest, None, "{user} {asking:?} -> {cluster}"),
        }
        if !rules.needs_labels(user, &asking) {
            assert_eq!(
                rules.decide(user, &asking, cluster, &BTreeMap::new()),
                decision,
                "labels made a difference the rules said they would not"
            );
        }
    }
}

/// Kubernetes label-selector semantics, written out for the check: every matchLabels pair is
/// on the cluster, and every requirement holds.
fn label_selector_matches(selector: &LabelSelector, labels: &BTreeMap<String, String>) -> bool {
    let pairs_hold = selector
        .match_labels
        .iter()
        .flatten()
        .all(|(k, v)| labels.get(k) == Some(v));
    let requirements_hold = selector.match_expressions.iter().flatten().all(|req| {
        let values: &[String] = req.values.as_deref().unwrap_or(&[]);
        let value = labels.get(&req.key);
        match req.operator.as_str() {
            "In" => value.is_some_and(|v| values.contains(v)),
            "NotIn" => !value.is_some_and(|v| values.contains(v)),
            "Exists" => value.is_some(),
            "DoesNotExist" => value.is_none(),
            other => panic!("rules with operator {other:?} were accepted"),
        }
    });
    pairs_hold && requirements_hold
}

/// `csr`: a certificate signing request as a joining or renewing agent sends it: PEM text, or
/// (to reach the DER parser with most inputs) DER the target wraps in PEM itself.
///
/// Properties: nothing panics; a request is either refused with a `BadRequest` that says what
/// the agent must send, or signed: the certificate is the hub's (its cluster and group only,
/// whatever the request asked for) for the request's key, whose pin is what the gateway
/// computes from the certificate.
pub fn csr(data: &[u8]) {
    static CA: OnceLock<Ca> = OnceLock::new();
    let ca = CA.get_or_init(|| Ca::generate().expect("a CA is made").0);
    let mut input = FuzzInput::new(data);
    let pem = if input.byte().is_multiple_of(2) {
        String::from_utf8_lossy(input.rest()).into_owned()
    } else {
        pem("CERTIFICATE REQUEST", input.rest())
    };
    let pin = match crate::ca::csr_key_sha256(&pem) {
        Ok(pin) => pin,
        Err(e) => {
            assert!(matches!(e, CaError::BadRequest(_)), "{e}");
            assert!(e.to_string().contains("PKCS#10"), "{e}");
            assert!(
                ca.sign_cluster_csr("store-1", &pem, Duration::from_secs(3600))
                    .is_err(),
                "a request whose key cannot be read is signed"
            );
            return;
        }
    };
    let (certificate, signed_pin) = ca
        .sign_cluster_csr("store-1", &pem, Duration::from_secs(3600))
        .expect("a request that reads is signed");
    assert_eq!(signed_pin, pin);
    let der = x509_parser::pem::parse_x509_pem(certificate.as_bytes())
        .expect("the hub writes PEM")
        .1
        .contents;
    assert_eq!(
        Peer::from_der(&der),
        Ok(Peer::Cluster("store-1".into())),
        "the certificate is not the cluster's alone"
    );
    assert_eq!(
        public_key_sha256(&der).as_deref(),
        Ok(pin.as_str()),
        "the gateway computes another pin from the certificate"
    );
    let (_, cert) = x509_parser::parse_x509_certificate(&der).expect("it parses");
    let groups: Vec<&str> = cert
        .subject()
        .iter_organization()
        .filter_map(|o| o.as_str().ok())
        .collect();
    assert_eq!(groups, [CLUSTER_GROUP]);
    assert!(ca.issued(&certificate));
}

/// PEM text of `der` under `label`.
fn pem(label: &str, der: &[u8]) -> String {
    let body = flotilla_proto::api::base64::encode(der);
    let mut out = format!("-----BEGIN {label}-----\n");
    for line in body.as_bytes().chunks(64) {
        out.push_str(std::str::from_utf8(line).expect("ASCII"));
        out.push('\n');
    }
    out.push_str(&format!("-----END {label}-----\n"));
    out
}

/// `bootstrap_token`: a token string as a joining agent sends it, against the hub's records
/// (valid, expired, revoked and used-up ones), spent or re-attached; and the join request
/// carrying it as it would be logged.
///
/// Properties: a token admits a join only if it is exactly `<id>.<secret>` of a record that
/// is valid now (and has a use left, to spend one); a refusal names the token only by the id
/// it was given, never by anything after the dot; a join request's `Debug` never shows the
/// secret.
pub fn bootstrap_token(data: &[u8]) {
    const SECRET: &str = "0123456789abcdefghijklmno";
    let now = Timestamp::from_second(1_800_000_000).expect("a valid time");
    let hour = SignedDuration::from_hours(1);
    let valid = tokens::record_of("abcdef", SECRET, now - hour, now + hour);
    let expired = tokens::record_of("expird", SECRET, now - hour * 2, now - hour);
    let mut revoked = tokens::record_of("revokd", SECRET, now - hour, now + hour);
    revoked.revoked = Some(now - hour);
    let mut used_up = tokens::record_of("usedup", SECRET, now - hour, now + hour);
    used_up.max_uses = Some(1);
    used_up.uses = 1;
    let records = [valid, expired, revoked, used_up];

    let mut input = FuzzInput::new(data);
    let how = if input.byte().is_multiple_of(2) {
        Use::Spend
    } else {
        Use::Reattach
    };
    let token = String::from_utf8_lossy(input.rest()).into_owned();
    match tokens::admitting(&records, &token, now, how) {
        Ok(index) => {
            let record = &records[index];
            assert_eq!(
                token,
                format!("{}.{SECRET}", record.id),
                "admitted {token:?}"
            );
            assert_eq!(
                record.state(now),
                if index == 3 { "used up" } else { "valid" }
            );
            assert!(index == 0 || (index == 3 && how == Use::Reattach));
        }
        Err(e) => {
            let id = match &e {
                TokenError::Malformed => None,
                TokenError::Unknown { id }
                | TokenError::Expired { id, .. }
                | TokenError::Revoked { id, .. }
                | TokenError::UsedUp { id, .. } => Some(id.as_str()),
                TokenError::Storage { .. } => panic!("storage error without storage: {e}"),
            };
            if let Some(id) = id {
                assert_eq!(Some(id), token.split_once('.').map(|(id, _)| id));
                assert_eq!(id.len(), ID_LEN);
            }
            if token.split_once('.') == Some((&records[0].id, SECRET)) {
                panic!("the valid token was refused: {e}");
            }
        }
    }
    let request = JoinRequest {
        cluster_name: "store-1".into(),
        token: token.clone(),
        csr_pem: String::new(),
        labels: Default::default(),
    };
    // Only the id before the dot is shown; without a dot nothing tells the id from the
    // secret, and none of it is.
    let shown = format!("{request:?}");
    let expected = match token.split_once('.') {
        Some((id, _)) => format!("token: {id}.<redacted>"),
        None => "token: <malformed>".to_string(),
    };
    assert!(
        shown.contains(&expected),
        "{shown} does not show {expected}"
    );
}
