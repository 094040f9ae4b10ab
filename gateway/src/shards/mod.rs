//! Shards and their ownership across gateway processes.
//!
//! Clusters map to a fixed number of virtual shards (`flotilla_proto::contract::shard_of`, a
//! stable hash). In scale-out mode each shard has a coordination.k8s.io Lease on the hub
//! apiserver (`flotilla-shard-NN`) and a gateway acts for a shard (admits its sessions, writes
//! its clusters' health and their works' status) only while it holds that lease, fenced by
//! the lease's epoch (`leaseTransitions`) and by a validity that ends before anyone else may
//! claim it. `owner` decides (sans-IO), `leasing` is the driver that reads and writes the
//! leases and hands shards over, `view` is what the rest of the gateway reads: its fences and
//! the directory of who holds the rest. The single-node hub's gateway holds every shard
//! without leases.

pub mod cache;
pub mod leasing;
pub mod owner;
pub mod view;

pub use leasing::ShardLeasing;
pub use owner::{OwnerConfig, ShardOwner};
pub use view::{DirectoryEntry, Fence, Held, Route, ShardDirectory, ShardView, ShardViews};
