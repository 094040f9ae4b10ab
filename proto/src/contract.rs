//! The rules hub, gateways and agents must agree on, written once: what a cluster name may be,
//! which certificate groups mean what, how a CA bundle is fingerprinted in the hello, and the
//! annotation and taint keys the hub writes on a ManagedCluster.

use sha2::Digest;

/// Organization (O) of every agent certificate: `CN=<cluster>, O=flotilla:clusters`.
pub const CLUSTER_GROUP: &str = "flotilla:clusters";
/// Organization (O) of every operator certificate: `CN=<user>, O=flotilla:operators` (plus any
/// extra groups as further O values).
pub const OPERATOR_GROUP: &str = "flotilla:operators";

/// Organization (O) of every kubectl user certificate of the hub's proxy front: `CN=<user>,
/// O=flotilla:users, OU=<the user's groups, comma-separated>`. A user is not an operator:
/// the operator API refuses these certificates, and only the proxy front accepts them.
pub const USER_GROUP: &str = "flotilla:users";

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

/// OCM's taint for clusters whose agent stopped reporting (Available=Unknown).
pub const UNREACHABLE_TAINT: &str = "cluster.open-cluster-management.io/unreachable";

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

/// Checks a cluster name, with the sentence a person needs when it is wrong.
pub fn check_cluster_name(name: &str) -> Result<(), String> {
    if is_dns1123_label(name) {
        Ok(())
    } else {
        Err(format!(
            "{name:?} is not a valid cluster name: use lower-case letters, digits and '-', \
             starting and ending with a letter or digit, at most 63 characters (it becomes the \
             cluster's namespace on the hub)"
        ))
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
    fn cluster_names_are_dns1123_labels() {
        for ok in ["store-0042", "a", "x1", &"a".repeat(63)] {
            assert!(is_dns1123_label(ok), "{ok}");
            assert!(check_cluster_name(ok).is_ok());
        }
        for bad in ["", "-a", "a-", "Store", "a.b", "a_b", &"a".repeat(64)] {
            assert!(!is_dns1123_label(bad), "{bad}");
            let msg = check_cluster_name(bad).unwrap_err();
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
