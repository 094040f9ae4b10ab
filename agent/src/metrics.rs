//! What the agent counts, for `/metrics` on `--metrics-addr`: how long applying a work takes,
//! drift it repaired, the status outbox's depth, and whether (and over which carrier) it holds
//! a session with the hub. One agent is one cluster, so no label names a work or an object; an
//! agent serving several hubs ([`crate::hubs`]) labels each series with its `hub`, bounded by
//! [`crate::hubs::MAX_HUBS`] ([`HubMetricFamilies`]).
//!
//! Every metric is an atomic behind an `Arc`: the session driver and the reconciler hold
//! handles and never look a series up by label as they go.

use std::collections::HashMap;
use std::time::Duration;

use flotilla_transport::Carrier;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Metric, Registry, Unit};

use crate::cache::AppliedResource;

/// `hub`, on the series of an agent serving several hubs.
type HubLabel = [(&'static str, String); 1];
/// `transport`, after `hub` where there is one.
type TransportLabels = Vec<(&'static str, String)>;

/// 5 ms to ~80 s: one small object on a near spoke to hundreds on a slow one.
fn apply_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.005, 2.0, 15))
}

/// The agent's metrics. Cheap to clone: clones count into the same series.
#[derive(Clone, Debug)]
pub struct AgentMetrics {
    apply_duration: Histogram,
    drift_repairs: Counter,
    /// Set at each scrape from the cache.
    pub(crate) outbox_depth: Gauge,
    connected: Gauge,
    by_transport: Family<TransportLabels, Gauge>,
    /// The hub these series are labelled with, for an agent serving several.
    hub: Option<String>,
    /// Bytes of large works' chunks received from the hub by this process.
    pub(crate) chunk_bytes_received: Counter,
    /// Chunks received that the cache held already: resent although they had arrived.
    pub(crate) chunks_received_again: Counter,
    /// Chunks held in the cache, and their bytes: once per content, however many works. Set
    /// at each scrape from the cache, and as chunks are stored.
    pub(crate) chunks_held: Gauge,
    pub(crate) chunk_bytes_held: Gauge,
}

impl AgentMetrics {
    /// Whether a session with the hub is established now (`hub_connected` is 1).
    pub(crate) fn is_connected(&self) -> bool {
        self.connected.get() == 1
    }
}

impl Default for AgentMetrics {
    fn default() -> AgentMetrics {
        let metrics = AgentMetrics {
            apply_duration: apply_histogram(),
            drift_repairs: Counter::default(),
            outbox_depth: Gauge::default(),
            connected: Gauge::default(),
            by_transport: Family::default(),
            hub: None,
            chunk_bytes_received: Counter::default(),
            chunks_received_again: Counter::default(),
            chunks_held: Gauge::default(),
            chunk_bytes_held: Gauge::default(),
        };
        for carrier in [Carrier::Grpc, Carrier::Quic] {
            let _ = metrics.transport(carrier);
        }
        metrics
    }
}

impl AgentMetrics {
    /// Registers every metric under `flotilla_agent_`.
    pub fn register(&self, registry: &mut Registry) {
        register_each(
            registry,
            self.apply_duration.clone(),
            self.drift_repairs.clone(),
            self.outbox_depth.clone(),
            [
                self.chunk_bytes_received.clone(),
                self.chunks_received_again.clone(),
            ],
            [self.chunks_held.clone(), self.chunk_bytes_held.clone()],
            self.connected.clone(),
            self.by_transport.clone(),
        );
    }

    pub(crate) fn observe_apply(&self, took: Duration) {
        self.apply_duration.observe(took.as_secs_f64());
    }

    pub(crate) fn drift_repaired(&self, objects: u64) {
        self.drift_repairs.inc_by(objects);
    }

    /// The session is established on `carrier` until the returned guard is dropped.
    pub(crate) fn connected(&self, carrier: Carrier) -> Connected {
        let transport = self.transport(carrier);
        self.connected.set(1);
        transport.set(1);
        Connected {
            connected: self.connected.clone(),
            transport,
        }
    }

    fn transport(&self, carrier: Carrier) -> Gauge {
        let name = match carrier {
            Carrier::Grpc => "grpc",
            Carrier::Quic => "quic",
        };
        let mut labels: TransportLabels = self.hub.iter().map(|h| ("hub", h.clone())).collect();
        labels.push(("transport", name.to_owned()));
        self.by_transport.get_or_create_owned(&labels)
    }
}

/// The agent's series for every hub it serves, each labelled `hub`: registered once; each
/// hub's [`AgentMetrics`] ([`HubMetricFamilies::for_hub`]) counts into its own.
#[derive(Clone, Debug)]
pub struct HubMetricFamilies {
    apply_duration: Family<HubLabel, Histogram, fn() -> Histogram>,
    drift_repairs: Family<HubLabel, Counter>,
    outbox_depth: Family<HubLabel, Gauge>,
    connected: Family<HubLabel, Gauge>,
    by_transport: Family<TransportLabels, Gauge>,
    chunk_bytes_received: Family<HubLabel, Counter>,
    chunks_received_again: Family<HubLabel, Counter>,
    chunks_held: Family<HubLabel, Gauge>,
    chunk_bytes_held: Family<HubLabel, Gauge>,
}

impl Default for HubMetricFamilies {
    fn default() -> HubMetricFamilies {
        HubMetricFamilies {
            apply_duration: Family::new_with_constructor(apply_histogram as fn() -> Histogram),
            drift_repairs: Family::default(),
            outbox_depth: Family::default(),
            connected: Family::default(),
            by_transport: Family::default(),
            chunk_bytes_received: Family::default(),
            chunks_received_again: Family::default(),
            chunks_held: Family::default(),
            chunk_bytes_held: Family::default(),
        }
    }
}

impl HubMetricFamilies {
    /// Registers every family under `flotilla_agent_`, by the names of [`AgentMetrics`].
    pub fn register(&self, registry: &mut Registry) {
        register_each(
            registry,
            self.apply_duration.clone(),
            self.drift_repairs.clone(),
            self.outbox_depth.clone(),
            [
                self.chunk_bytes_received.clone(),
                self.chunks_received_again.clone(),
            ],
            [self.chunks_held.clone(), self.chunk_bytes_held.clone()],
            self.connected.clone(),
            self.by_transport.clone(),
        );
    }

    /// The metrics of the session with hub `hub`, counting into its series.
    pub fn for_hub(&self, hub: &str) -> AgentMetrics {
        let label = [("hub", hub.to_owned())];
        let metrics = AgentMetrics {
            apply_duration: self.apply_duration.get_or_create_owned(&label),
            drift_repairs: self.drift_repairs.get_or_create_owned(&label),
            outbox_depth: self.outbox_depth.get_or_create_owned(&label),
            connected: self.connected.get_or_create_owned(&label),
            by_transport: self.by_transport.clone(),
            hub: Some(hub.to_owned()),
            chunk_bytes_received: self.chunk_bytes_received.get_or_create_owned(&label),
            chunks_received_again: self.chunks_received_again.get_or_create_owned(&label),
            chunks_held: self.chunks_held.get_or_create_owned(&label),
            chunk_bytes_held: self.chunk_bytes_held.get_or_create_owned(&label),
        };
        for carrier in [Carrier::Grpc, Carrier::Quic] {
            let _ = metrics.transport(carrier);
        }
        metrics
    }
}

/// Registers the agent's metrics, one hub's or every hub's families, under their names and
/// help.
#[allow(clippy::too_many_arguments)]
fn register_each(
    registry: &mut Registry,
    apply_duration: impl Metric,
    drift_repairs: impl Metric,
    outbox_depth: impl Metric,
    [chunk_bytes_received, chunks_received_again]: [impl Metric; 2],
    [chunks_held, chunk_bytes_held]: [impl Metric; 2],
    connected: impl Metric,
    by_transport: impl Metric,
) {
    let r = registry.sub_registry_with_prefix("agent");
    r.register_with_unit(
        "work_apply_duration",
        "Time to reconcile one ManifestWork on the spoke: apply its manifests by their \
         update strategy and record its status",
        Unit::Seconds,
        apply_duration,
    );
    r.register(
        "drift_repairs",
        "Objects a work owns that had changed on the spoke since the agent last applied \
         them, written back to the work's content by a later reconcile of the same generation",
        drift_repairs,
    );
    r.register(
        "status_outbox_depth",
        "Work statuses waiting in the durable outbox for the hub's acknowledgement",
        outbox_depth,
    );
    r.register(
        "chunk_bytes_received",
        "Bytes of large ManifestWorks' content chunks received from the hub by this process \
         (only chunks the cache did not hold are asked for)",
        chunk_bytes_received,
    );
    r.register(
        "chunks_received_again",
        "Content chunks received from the hub that the cache held already, durably: a \
         transfer (resumed after a disconnect, say) that sent again what had arrived; 0 \
         when resumes ask only for what is missing",
        chunks_received_again,
    );
    r.register(
        "chunks_held",
        "Content chunks of large ManifestWorks in the cache, each once however many works \
         share it; a chunk no held work or transfer under way names is released at once",
        chunks_held,
    );
    r.register(
        "chunk_bytes_held",
        "Bytes of the content chunks in the cache",
        chunk_bytes_held,
    );
    r.register(
        "hub_connected",
        "1 while a session with the hub is established, else 0",
        connected,
    );
    r.register(
        "hub_connected_transport",
        "1 for the carrier the established session rides (grpc or quic), 0 for the other",
        by_transport,
    );
}

/// An established session, as the gauges show it: dropping it shows the agent disconnected.
pub(crate) struct Connected {
    connected: Gauge,
    transport: Gauge,
}

impl Drop for Connected {
    fn drop(&mut self) {
        self.connected.set(0);
        self.transport.set(0);
    }
}

/// What the agent last saw of each object it applied, per work: the objects' resourceVersions
/// after its own write. An object whose version has moved by the next reconcile of the same
/// generation was changed on the spoke meanwhile, and that reconcile wrote it back: a drift
/// repair. Bounded by the works in the cache and the objects each applies (a forgotten work's
/// entry goes with it).
#[derive(Debug, Default)]
pub(crate) struct AppliedVersions {
    works: HashMap<String, (i64, HashMap<AppliedResource, String>)>,
}

impl AppliedVersions {
    /// Records what reconciling `uid` at `generation` left, and returns how many objects had
    /// drifted since the last reconcile of that generation.
    pub(crate) fn record(
        &mut self,
        uid: &str,
        generation: i64,
        versions: Vec<(AppliedResource, String)>,
    ) -> u64 {
        let now: HashMap<AppliedResource, String> = versions.into_iter().collect();
        let drifted = match self.works.get(uid) {
            Some((before, seen)) if *before == generation => now
                .iter()
                .filter(|(r, v)| seen.get(*r).is_some_and(|old| old != *v))
                .count() as u64,
            _ => 0,
        };
        self.works.insert(uid.to_string(), (generation, now));
        drifted
    }

    pub(crate) fn forget(&mut self, uid: &str) {
        self.works.remove(uid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cm(name: &str) -> AppliedResource {
        let id = serde_json::json!({"group": "", "version": "v1", "kind": "ConfigMap",
            "resource": "configmaps", "namespace": "default", "name": name});
        serde_json::from_value(id).unwrap()
    }

    #[test]
    fn drift_is_an_object_whose_version_moved_between_reconciles_of_one_generation() {
        let mut seen = AppliedVersions::default();
        assert_eq!(
            seen.record("w", 1, vec![(cm("a"), "10".into()), (cm("b"), "11".into())]),
            0
        );
        // Unchanged: an apply that changed nothing leaves the version as it was.
        assert_eq!(
            seen.record("w", 1, vec![(cm("a"), "10".into()), (cm("b"), "11".into())]),
            0
        );
        // Someone edited b on the spoke; the reconcile wrote it back at a new version.
        assert_eq!(
            seen.record("w", 1, vec![(cm("a"), "10".into()), (cm("b"), "15".into())]),
            1
        );
        // A new generation changes objects on purpose: not drift.
        assert_eq!(
            seen.record("w", 2, vec![(cm("a"), "20".into()), (cm("b"), "21".into())]),
            0
        );
        seen.forget("w");
        assert_eq!(seen.record("w", 2, vec![(cm("a"), "30".into())]), 0);
    }
}
