//! flotilla's session tier: accepts agent sessions (gRPC over HTTP/2 with mTLS), drives each one
//! with the shared sans-IO protocol from `flotilla-proto`, keeps cluster health from the
//! sessions, fans desired state out, admits only accepted clusters with registered keys (and
//! closes the sessions of revoked ones), and relays certificate renewals to the hub's CA.
//!
//! Not for: deciding anything about the fleet (placement, acceptance, rollouts: the hub), or
//! talking to spoke apiservers (agents). Gateways hold no state beyond caches: kill one and its
//! agents reconnect elsewhere.
#![forbid(unsafe_code)]

pub mod admission;
pub mod certificates;
pub mod desired;
pub mod health;
pub mod mailbox;
pub mod registry;
mod server;
pub mod statuses;
pub mod supervise;

pub use server::{Gateway, GatewayConfig, GatewayError};

#[cfg(test)]
mod test_support {
    //! What the crate's unit tests share.

    use std::time::Duration;

    /// Polls `check` until it holds, for at most 10 s; panics naming `what` otherwise.
    pub async fn eventually<F: Future<Output = bool>>(what: &str, mut check: impl FnMut() -> F) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while !check().await {
            assert!(tokio::time::Instant::now() < deadline, "never: {what}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}
