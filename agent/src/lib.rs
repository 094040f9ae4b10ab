//! flotilla's spoke agent: dials out to the hub, keeps one session (reconnecting with jittered
//! backoff), speaks the shared sans-IO protocol from `flotilla-proto`, and applies the
//! ManifestWorks it receives to its own cluster, from a durable cache that lets it keep working
//! while the hub is away.
//!
//! * [`run`] and [`run_with`]: the agent's parts and every long-lived task of it under one
//!   owner (`flotilla_ops::supervise`): the reconciler, the tunnel server, the claims watcher,
//!   the metrics endpoint; one that ends is said at once and stops the agent.
//! * `session`: the reconnect loop, on the protocol's `Reconnect` machine; `driver`: the thin
//!   driver of one session's protocol machine, on either carrier, its cache work in `delivery`
//!   and what it works on in `spoke`; [`connect`]: dialling gRPC, QUIC, or QUIC with a
//!   fallback; [`refusal`]: every way a session fails, in words for the spoke's operator.
//! * [`cache`]: the durable state behind [`WorkCache`] (redb): works, ledger, status outbox.
//! * [`reconcile`]: the task that makes the spoke match the cache (start, changes, resync).
//! * [`apply`]: the apply engine behind [`ApplyTarget`] (kube-rs server-side apply, or an
//!   in-memory cluster).
//! * [`status`]: ManifestWork status as OCM shapes it, with [`feedback`] values and
//!   [`condition_rules`] (CEL through [`cel`]); [`watch`] keeps it current as the applied
//!   objects change; [`executor`] bounds a work by a ServiceAccount's rights.
//! * [`governance`]: the Policies delivered to this cluster, evaluated against the spoke
//!   (inform) and enforced, with a compliance report per policy when it changes.
//! * [`claims`]: what the agent reports about its spoke (OCM's ClusterClaims, version, node
//!   resources), from watches of Nodes and ClusterClaims, sent when it changes.
//! * [`tunnel`]: the tunnel end: kubectl requests from the hub's proxy front, forwarded to the
//!   spoke's apiserver ([`spoke_api`]) with the hub user's impersonation, responses streamed
//!   back, upgrades relayed.
//! * [`join`], [`identity`]: joining with a bootstrap token (key made here, CSR sent, CA pinned)
//!   and the identity on disk, renewed over the session; [`hubs`]: the hubs one agent serves,
//!   joined one by one into its data directory, each with its own identity and cache partition,
//!   and [`leave`], which takes one hub's works off the spoke and drops what the agent held of it.
//! * `fuzzing` (hidden): the fuzz targets of the CEL rules and JSONPaths works carry.
//!
//! Not for: anything the hub decides, and it links no hub code: what both ends agree on lives in
//! `flotilla-proto`. The agent opens outbound connections only; it listens only where an
//! operator asks it to serve its metrics and probes (`--metrics-addr`, [`metrics`]).
#![forbid(unsafe_code)]

pub mod apply;
pub mod cache;
pub mod cel;
pub mod claims;
pub mod condition_rules;
pub mod config;
pub mod connect;
mod delivery;
mod driver;
pub mod executor;
pub mod failover;
pub mod feedback;
#[doc(hidden)]
pub mod fuzzing;
pub mod governance;
pub mod hubs;
pub mod identity;
pub mod join;
pub mod jsonpath;
pub mod leave;
pub mod metrics;
pub mod policies;
pub mod reconcile;
pub mod refusal;
mod run;
mod session;
mod spoke;
pub mod spoke_api;
pub mod status;
pub mod tunnel;
pub mod watch;

pub use apply::{ApplyTarget, KubeApplyTarget, MemoryCluster};
pub use cache::{CacheDb, ClusterCache, WorkCache};
pub use config::AgentConfig;
pub use reconcile::{ReconcileHandle, Reconciler, ReconcilerConfig};
pub use run::{Parts, RunError, run, run_with};
pub use spoke::{Observer, Unobserved};
pub use spoke_api::{KubeSpoke, SimulatedApi, SpokeApi};
