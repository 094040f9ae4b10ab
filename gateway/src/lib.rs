//! flotilla's session tier: accepts agent sessions on either carrier (gRPC over HTTP/2, or
//! QUIC; both mTLS, both behind `flotilla-transport`'s seam), drives each one with the shared
//! sans-IO protocol from `flotilla-proto` (`driver`), keeps cluster health from the sessions
//! (`health`), fans desired state out (`desired`, `mailbox`, `registry`) and governance
//! policies with their hub templates rendered per cluster (`policies`, reading the hub's
//! ConfigMaps through `hub_config_maps`), admits only accepted
//! clusters with registered keys and closes the sessions of revoked ones (`admission`), lets
//! new sessions in at a bounded rate and turns the excess away with a retry-after (`rate`), writes
//! work statuses and cleanup finalizers to the store coalesced, fenced and within one write
//! budget (`statuses`, `finalizers`, both through `writes`), every write for a cluster under
//! the fence of its shard that the store enforces (`fencing`, with a test's hold point before
//! the store call in `fault`), relays
//! certificate renewals to the hub's CA (`certificates`), opens tunnels to agents for the hub's
//! proxy front (`route`: the one seam the front reaches clusters through), owns every one
//! of its tasks (`flotilla_ops::supervise`), and counts what it does for `/metrics` (`metrics`).
//!
//! Not for: deciding anything about the fleet (placement, acceptance, rollouts: the hub), or
//! talking to spoke apiservers (agents). Gateways hold no state beyond caches: kill one and its
//! agents reconnect elsewhere.
#![forbid(unsafe_code)]

pub mod admission;
pub mod certificates;
pub mod compliance;
mod config;
pub mod desired;
mod driver;
pub mod fault;
pub mod fencing;
pub mod finalizers;
pub mod health;
pub mod hub_config_maps;
mod locks;
pub mod mailbox;
pub mod metrics;
pub mod policies;
pub mod process;
pub mod rate;
pub mod recorded_health;
pub mod registry;
pub mod route;
mod serve;
pub mod shards;
mod shared;
pub mod statuses;
mod tunnel;
pub mod writes;

pub use config::{DEFAULT_CHUNK_BYTES_PER_SECOND, GatewayConfig, quic_congestion};
pub use fencing::DEFAULT_GATEWAY_NAME;
pub use route::{ShardRoute, TunnelRoute};
pub use serve::{Gateway, GatewayError, Listeners};
pub use tunnel::{Away, TunnelError};

#[cfg(test)]
mod test_support {
    //! What the crate's unit tests share.

    use std::time::Duration;

    /// Waits until `check` holds, for at most 10 s; panics naming `what` otherwise.
    pub async fn eventually<F: Future<Output = bool>>(what: &str, mut check: impl FnMut() -> F) {
        flotilla_testenv::wait_for(what, Duration::from_secs(10), || {
            let holds = check();
            async { anyhow::Ok(holds.await.then_some(())) }
        })
        .await
        .unwrap_or_else(|e| panic!("never: {e}"));
    }
}
