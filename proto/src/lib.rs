//! flotilla's contract between hub, gateways and agents.
//!
//! * [`wire`]: the gRPC services and frames generated from `proto/flotilla/v1/*.proto`.
//! * [`api`]: Open Cluster Management's resource kinds as Rust types, with OCM's exact group,
//!   version, kind and field names, and the CRDs generated from them.
//! * [`session`]: the session protocol (hello/resume, heartbeats, drain, delivery queues) as a
//!   sans-IO state machine shared by the gateway and the agent.
//!
//! Not for: IO of any kind. Nothing here opens a socket, reads a file or a clock: callers pass
//! frames and `now` in and take frames, events and deadlines out.
#![forbid(unsafe_code)]

pub mod api;
pub mod session;

/// Generated wire types and service stubs (package `flotilla.v1`).
pub mod wire {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("flotilla.v1");
}

/// The session protocol version this build speaks (`Hello.protocol_version`).
pub const PROTOCOL_VERSION: u32 = 1;
