//! The rules hub, gateways and agents must agree on, written once: what a cluster name may be,
//! which certificate groups mean what, how a CA bundle is fingerprinted in the hello, and the
//! annotation and taint keys the hub writes on a ManagedCluster, and the fencing record every
//! gateway write carries with the rule the store refuses stale writes by ([`fence`]).

use sha2::Digest;

pub mod fence;

/// Organization (O) of every agent certificate: `CN=<cluster>, O=flotilla:clusters`.
pub const CLUSTER_GROUP: &str = "flotilla:clusters";
/// Organization (O) of every operator certificate: `CN=<user>, O=flotilla:operators` (plus any
/// extra groups as further O values).
pub const OPERATOR_GROUP: &str = "flotilla:operators";

/// Organization (O) of every kubectl user certificate of the hub's proxy front: `CN=<user>,
/// O=flotilla:users, OU=<the user's groups, comma-separated>`. A user is not an operator:
/// the operator API refuses these certificates, and only the proxy front accepts them.
pub const USER_GROUP: &str = "flotilla:users";

/// Organization (O) of the certificates the hub CA issues for gateways (`flotilla-hub
/// gateway-cert`, and the hub's own when it routes in scale-out mode): `CN=<name>,
/// O=flotilla:gateways`. Only these may open the relay hop to a gateway holding a cluster's
/// session; agents, operators and kubectl users are refused there.
pub const GATEWAY_GROUP: &str = "flotilla:gateways";

/// Request metadata of a `Relay.Tunnel` call: the cluster whose agent the tunnel is for.
pub const RELAY_CLUSTER_METADATA: &str = "flotilla-cluster";
/// Request metadata of a `Relay.Tunnel` call: the tunnel's id (as in the audit line).
pub const RELAY_TUNNEL_ID_METADATA: &str = "flotilla-tunnel-id";

/// Prefix of the identities Kubernetes reserves for itself (`system:masters`,
/// `system:serviceaccount:...`, `system:nodes`). Hub users and groups never have it: the hub
/// refuses to create them, the proxy front refuses to forward them, and the agent refuses to
/// impersonate them, so no hub identity turns into a spoke's built-in superuser.
pub const RESERVED_IDENTITY_PREFIX: &str = "system:";

/// Checks a proxy user's or group's name, with the sentence a person needs when it is wrong:
/// printable ASCII without spaces or commas (it travels in HTTP headers and comma-separated
/// flags), at most 253 characters, and not a Kubernetes-reserved `system:` identity.
pub fn check_user_identity(what: &str, name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > 253 {
        return Err(format!("{what} {name:?} must be 1 to 253 characters long"));
    }
    if !name.bytes().all(|b| b.is_ascii_graphic() && b != b',') {
        return Err(format!(
            "{what} {name:?} may hold printable ASCII only, without spaces or commas"
        ));
    }
    if name.starts_with(RESERVED_IDENTITY_PREFIX) {
        return Err(format!(
            "{what} {name:?} is reserved: Kubernetes gives `{RESERVED_IDENTITY_PREFIX}` identities \
             built-in rights (system:masters is every spoke's superuser); choose another name"
        ));
    }
    Ok(())
}

/// Annotation on a ManagedCluster: comma-separated hex SHA-256 of the public keys whose
/// certificates may open its session (the newest first; at most the current and the previous
/// one, so an agent that crashed before storing a renewed certificate still gets in).
pub const KEY_PINS_ANNOTATION: &str = "registration.flotilla.dev/client-key-sha256";
/// Annotation on a ManagedCluster: set by `flotilla cluster deny` with the operator's reason.
/// A denied cluster's joins get DENIED and its certificates are refused.
pub const DENIED_ANNOTATION: &str = "registration.flotilla.dev/denied";
/// Annotation on a ManagedCluster: the id (never the secret) of the bootstrap token it joined
/// with, for audit.
pub const TOKEN_ANNOTATION: &str = "registration.flotilla.dev/bootstrap-token-id";
/// Annotation on a ManagedCluster: when the agent's join request was recorded (RFC 3339).
pub const REQUESTED_AT_ANNOTATION: &str = "registration.flotilla.dev/join-requested-at";

/// signerName of the certificates.k8s.io/v1 CertificateSigningRequests through which a
/// `flotilla-gateway` relays its agents' certificate renewals to the hub (scale-out mode): the
/// gateway creates one, the hub (which alone holds the CA key) approves and signs it, or denies
/// it with the reason.
pub const RENEWAL_SIGNER: &str = "flotilla.dev/agent-client";
/// Label on a renewal CertificateSigningRequest: the cluster whose session asked.
pub const RENEWAL_CLUSTER_LABEL: &str = "registration.flotilla.dev/cluster";
/// Annotation on a renewal CertificateSigningRequest: hex SHA-256 of the public key of the
/// session that asked (it must be one of the cluster's registered keys).
pub const RENEWAL_SESSION_KEY_ANNOTATION: &str = "registration.flotilla.dev/session-key-sha256";

/// OCM's taint for clusters whose agent stopped reporting (Available=Unknown).
pub const UNREACHABLE_TAINT: &str = "cluster.open-cluster-management.io/unreachable";

/// The finalizer the gateway puts on a ManifestWork once its agent has acknowledged it, and
/// removes when the agent reports the work released (`WorkReleased`): everything it applied is
/// gone from the spoke, or orphaned as its deleteOption says. OCM's work agent uses the same
/// name. Until then a deleted work stays on the hub with its `Deleting` condition. A work whose
/// cluster is gone for good is released by `flotilla cluster decommission --policy orphan`, or
/// by removing this finalizer by hand.
pub const WORK_CLEANUP_FINALIZER: &str = "cluster.open-cluster-management.io/manifest-work-cleanup";

/// Annotation on the ManagedCluster recording a decommission in progress (`flotilla cluster
/// decommission`): `policy=<orphan|clean>,step=<next step>`. On a ManifestWork, the policy the
/// decommission wrote into its deleteOption, which the hub's ManifestWorkReplicaSet controller
/// keeps when it rewrites the work.
pub const DECOMMISSION_ANNOTATION: &str = "flotilla.io/decommission";

/// Longest ManifestWork uid a session frame may carry (`WorkReleased`, `Hello.releasing`). An
/// apiserver uid is 36 characters; the bound leaves room for other stores and refuses garbage.
pub const MAX_UID_BYTES: usize = 128;

/// ClusterClaims the agent makes itself, named as OCM's registration agent names them (its
/// reserved claims), plus the spoke's node count. Custom claims come from the spoke's
/// ClusterClaim objects.
pub mod claims {
    /// The cluster's unique id: the uid of its `kube-system` namespace.
    pub const ID: &str = "id.k8s.io";
    /// The spoke apiserver's version (gitVersion), e.g. `v1.36.3`.
    pub const KUBE_VERSION: &str = "kubeversion.open-cluster-management.io";
    /// Where the cluster runs: `AWS`, `GCP`, `Azure`, `IBM`, `VSphere`, `OpenStack`, ... or
    /// `Other`, read from the nodes' provider ids.
    pub const PLATFORM: &str = "platform.open-cluster-management.io";
    /// Which Kubernetes distribution: `OpenShift`, `EKS`, `GKE`, `AKS`, `K3s`, ... or `Other`.
    pub const PRODUCT: &str = "product.open-cluster-management.io";
    /// How many nodes the spoke has. OCM reports no such claim; flotilla's name for it.
    pub const NODE_COUNT: &str = "nodecount.flotilla.dev";
    /// The claims above: reported first, and never displaced by custom claims.
    pub const RESERVED: [&str; 5] = [ID, KUBE_VERSION, PLATFORM, PRODUCT, NODE_COUNT];
    /// A ClusterClaim object with this label stays on the spoke (OCM's `spoke-only`).
    pub const SPOKE_ONLY_LABEL: &str = "open-cluster-management.io/spoke-only";
    /// Custom claims reported at most, by name order (OCM's `--max-custom-cluster-claims`
    /// default); the rest stay on the spoke, and the agent says so.
    pub const MAX_CUSTOM: usize = 20;
    /// Longest claim value (the ClusterClaim CRD's bound).
    pub const MAX_VALUE_BYTES: usize = 1024;
    /// Longest claim name (a Kubernetes object name).
    pub const MAX_NAME_BYTES: usize = 253;
    /// Most entries in a reported resource list (`cpu`, `memory`, `pods`, hugepages, ...).
    pub const MAX_RESOURCES: usize = 64;
}

/// Checks a cluster's report about itself before the hub stores it: the bounds of
/// [`claims`], so one agent cannot grow its ManagedCluster without limit. The message names
/// the offending claim or resource.
pub fn check_cluster_info(info: &crate::wire::ClusterInfo) -> Result<(), String> {
    let most = claims::RESERVED.len() + claims::MAX_CUSTOM;
    if info.claims.len() > most {
        return Err(format!(
            "{} cluster claims reported; at most {most} are kept ({} built-in, {} custom)",
            info.claims.len(),
            claims::RESERVED.len(),
            claims::MAX_CUSTOM
        ));
    }
    for c in &info.claims {
        if c.name.is_empty() || c.name.len() > claims::MAX_NAME_BYTES {
            return Err(format!(
                "cluster claim name {:?} must have 1 to {} characters",
                c.name,
                claims::MAX_NAME_BYTES
            ));
        }
        if c.value.len() > claims::MAX_VALUE_BYTES {
            return Err(format!(
                "cluster claim {}: value of {} bytes exceeds {}",
                c.name,
                c.value.len(),
                claims::MAX_VALUE_BYTES
            ));
        }
    }
    for (what, list) in [
        ("capacity", &info.capacity),
        ("allocatable", &info.allocatable),
    ] {
        if list.len() > claims::MAX_RESOURCES {
            return Err(format!(
                "{what}: {} resources reported, at most {}",
                list.len(),
                claims::MAX_RESOURCES
            ));
        }
        if let Some((name, q)) = list
            .iter()
            .find(|(n, q)| n.is_empty() || n.len() > 253 || q.is_empty() || q.len() > 64)
        {
            return Err(format!(
                "{what}: resource {name:?} has an invalid quantity {q:?}"
            ));
        }
    }
    if info.kubernetes_version.len() > 256 {
        return Err("kubernetes version longer than 256 characters".to_string());
    }
    Ok(())
}

/// Label on every ManifestWork and ManagedCluster the hub writes: the cluster's shard
/// ([`shard_label_value`]). Gateways list and watch with a selector on it, so each one caches
/// only its own shards' objects.
pub const SHARD_LABEL: &str = "flotilla.io/shard";
/// Label on flotilla's coordination.k8s.io Leases: [`LEASE_ROLE_SHARD`] or
/// [`LEASE_ROLE_GATEWAY`], so one list with a selector reads them all and nothing else.
pub const LEASE_ROLE_LABEL: &str = "flotilla.io/lease";
/// [`LEASE_ROLE_LABEL`] of a shard's lease (`flotilla-shard-NN`).
pub const LEASE_ROLE_SHARD: &str = "shard";
/// [`LEASE_ROLE_LABEL`] of a gateway's own lease (`flotilla-gateway-NAME`), its announcement.
pub const LEASE_ROLE_GATEWAY: &str = "gateway";
/// Annotation on a gateway's lease: the host:port agents dial to reach it (redirects use it).
pub const ADVERTISE_ADDRESS_ANNOTATION: &str = "flotilla.io/advertise-address";
/// Virtual shards of a fleet unless configured otherwise. Every hub and gateway of one fleet
/// must use the same number: it decides which shard, and so which gateway, a cluster belongs to.
pub const DEFAULT_SHARDS: u32 = 64;

/// The shard of `cluster` among `shards` (at least 1): FNV-1a (64-bit) of the name's UTF-8
/// bytes, modulo `shards`. Stable across processes, builds and versions (never Rust's
/// randomly seeded hasher): every hub and gateway computes the same shard for a cluster.
pub fn shard_of(cluster: &str, shards: u32) -> u32 {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let hash = cluster
        .bytes()
        .fold(OFFSET, |h, b| (h ^ u64::from(b)).wrapping_mul(PRIME));
    (hash % u64::from(shards.max(1))) as u32
}

/// The value of [`SHARD_LABEL`] for `shard`: decimal, at least two digits (`"07"`).
pub fn shard_label_value(shard: u32) -> String {
    format!("{shard:02}")
}

/// The name of `shard`'s Lease: `flotilla-shard-NN`.
pub fn shard_lease_name(shard: u32) -> String {
    format!("flotilla-shard-{shard:02}")
}

/// The shard a lease name is for, if it is a shard lease.
pub fn shard_of_lease(name: &str) -> Option<u32> {
    name.strip_prefix("flotilla-shard-")?.parse().ok()
}

/// The name of gateway `gateway`'s own Lease: `flotilla-gateway-NAME`.
pub fn gateway_lease_name(gateway: &str) -> String {
    format!("flotilla-gateway-{gateway}")
}

/// Kubernetes' DNS-1123 label: lower-case alphanumerics and '-', 1 to 63 characters, starting
/// and ending alphanumeric. Cluster names must be one, because each becomes a namespace.
pub fn is_dns1123_label(s: &str) -> bool {
    let bytes = s.as_bytes();
    let alnum = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit();
    !bytes.is_empty()
        && bytes.len() <= 63
        && alnum(bytes[0])
        && alnum(bytes[bytes.len() - 1])
        && bytes.iter().all(|&b| alnum(b) || b == b'-')
}

/// A name that cannot be a cluster's, and what a valid one is: the one sentence every refusal
/// of a cluster name says, whoever refuses it (the agent's and the hub's flags, a client
/// certificate, the operator API), each naming where the name came from before it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "{0:?} is not a valid cluster name: use lower-case letters, digits and '-', starting and \
     ending with a letter or digit, at most 63 characters (it becomes the cluster's namespace \
     on the hub)"
)]
pub struct InvalidClusterName(pub String);

/// Checks a cluster name, with the sentence a person needs when it is wrong.
pub fn check_cluster_name(name: &str) -> Result<(), InvalidClusterName> {
    if is_dns1123_label(name) {
        Ok(())
    } else {
        Err(InvalidClusterName(name.to_owned()))
    }
}

/// Hex SHA-256 of a CA bundle's PEM text, exactly as stored and sent: the agent reports it in
/// its hello and the hub sends `TrustBundle` when its own differs.
pub fn ca_bundle_sha256(ca_bundle_pem: impl AsRef<[u8]>) -> String {
    hex::encode(sha2::Sha256::digest(ca_bundle_pem.as_ref()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_are_fnv1a_of_the_name() {
        // Published FNV-1a 64 vectors: "a" = 0xaf63dc4c8601ec8c, "foobar" = 0x85944171f73967e8.
        // A change here moves every cluster to another gateway: it must never happen silently.
        assert_eq!(shard_of("a", 64), 0x8c % 64);
        assert_eq!(shard_of("foobar", 64), 0xe8 % 64);
        assert_eq!(
            shard_of("foobar", 1000),
            (0x8594_4171_f739_67e8_u64 % 1000) as u32
        );
        assert_eq!(shard_of("store-0042", 64), 39);
        assert_eq!(shard_of("anything", 0), 0, "zero shards is treated as one");
        // Names spread evenly: every shard within a third of the mean for 6,400 clusters.
        let mut counts = [0u32; 64];
        for n in 0..6400 {
            counts[shard_of(&format!("store-{n:05}"), 64) as usize] += 1;
        }
        assert!(
            counts.iter().all(|&c| (67..=133).contains(&c)),
            "{counts:?}"
        );
    }

    #[test]
    fn shard_names_round_trip() {
        assert_eq!(shard_label_value(7), "07");
        assert_eq!(shard_label_value(123), "123");
        assert_eq!(shard_lease_name(7), "flotilla-shard-07");
        assert_eq!(shard_of_lease(&shard_lease_name(63)), Some(63));
        assert_eq!(shard_of_lease("flotilla-gateway-a"), None);
        assert_eq!(gateway_lease_name("gw-1"), "flotilla-gateway-gw-1");
    }

    #[test]
    fn cluster_names_are_dns1123_labels() {
        for ok in ["store-0042", "a", "x1", &"a".repeat(63)] {
            assert!(is_dns1123_label(ok), "{ok}");
            assert!(check_cluster_name(ok).is_ok());
        }
        for bad in ["", "-a", "a-", "Store", "a.b", "a_b", &"a".repeat(64)] {
            assert!(!is_dns1123_label(bad), "{bad}");
            let msg = check_cluster_name(bad).unwrap_err().to_string();
            assert!(msg.contains("not a valid cluster name"), "{msg}");
        }
    }

    #[test]
    fn user_identities_are_header_safe_and_never_reserved() {
        for ok in ["alice", "ops", "team:platform", "a@example.com"] {
            assert!(check_user_identity("user", ok).is_ok(), "{ok}");
        }
        for (bad, why) in [
            ("", "1 to 253"),
            ("a b", "without spaces"),
            ("a,b", "without spaces or commas"),
            ("system:masters", "is reserved"),
            ("élan", "printable ASCII"),
        ] {
            let msg = check_user_identity("group", bad).unwrap_err();
            assert!(msg.contains(why), "{bad}: {msg}");
        }
    }

    #[test]
    fn bundle_hash_is_of_the_bytes_as_sent() {
        assert_eq!(
            ca_bundle_sha256("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_ne!(ca_bundle_sha256("abc\n"), ca_bundle_sha256("abc"));
    }
}
