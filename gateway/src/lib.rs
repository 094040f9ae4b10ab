//! flotilla's session tier: accepts agent sessions (gRPC over HTTP/2 with mTLS), drives each one
//! with the shared sans-IO protocol from `flotilla-proto`, keeps cluster health from the
//! sessions, and (later) fans desired state out and tunnels kubectl requests.
//!
//! Not for: deciding anything about the fleet (placement, acceptance, rollouts: the hub), or
//! talking to spoke apiservers (agents). Gateways hold no state beyond caches: kill one and its
//! agents reconnect elsewhere.
#![forbid(unsafe_code)]

pub mod desired;
pub mod health;
pub mod identity;
pub mod mailbox;
pub mod registry;
mod server;
pub mod statuses;
pub mod tls;

pub use server::{Gateway, GatewayConfig, GatewayError};
