//! flotilla's contract between hub, gateways and agents.
//!
//! * [`wire`]: the gRPC services and frames generated from `proto/flotilla/v1/*.proto`.
//! * [`api`]: Open Cluster Management's resource kinds as Rust types, with OCM's exact group,
//!   version, kind and field names, and the CRDs generated from them.
//! * [`contract`]: the rules both ends must agree on (cluster names, certificate groups, the
//!   CA-bundle hash, ManagedCluster annotation keys), written once.
//! * [`session`]: the session protocol (hello/resume, heartbeats, drain, delivery queues) as a
//!   sans-IO state machine shared by the gateway and the agent.
//! * [`tunnel`]: what travels inside a tunnel stream (one HTTP/1.1 request with the hub
//!   user's impersonation headers) and the header rules both ends apply to it.
//! * `fuzzing` (hidden): the bodies of the fuzz targets of proto's parsers and machines, and
//!   the input reader the other crates' targets share (see `fuzz/` at the repository root).
//!
//! Not for: IO of any kind. Nothing here opens a socket, reads a file or a clock: callers pass
//! frames and `now` in and take frames, events and deadlines out.
#![forbid(unsafe_code)]

pub mod api;
pub mod contract;
#[doc(hidden)]
pub mod fuzzing;
pub mod session;
pub mod tunnel;

/// Generated wire types and service stubs (package `flotilla.v1`).
pub mod wire {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("flotilla.v1");

    impl std::fmt::Debug for JoinRequest {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            // `<id>.<secret>`: the id names the token in logs and `flotilla token list`.
            // Without a dot nothing tells the id from the secret, so none of it is shown.
            let token = match self.token.split_once('.') {
                Some((id, _)) => format!("{id}.<redacted>"),
                None => "<malformed>".to_string(),
            };
            f.debug_struct("JoinRequest")
                .field("cluster_name", &self.cluster_name)
                .field("token", &format_args!("{token}"))
                .field("csr_pem", &format_args!("<{} bytes>", self.csr_pem.len()))
                .field("labels", &self.labels)
                .finish()
        }
    }
}

/// The session protocol version this build speaks (`Hello.protocol_version`).
pub const PROTOCOL_VERSION: u32 = 1;
