//! What the session tier counts, for `/metrics`: sessions open by carrier, reconnects,
//! admissions refused by reason, the gateway's store requests by verb, the status write queue
//! and the shards held. No label names a cluster: a gateway holds tens of thousands, and each
//! label value is a series Prometheus keeps.
//!
//! Every metric is an atomic behind an `Arc`: the driver holds its own handles (resolved once,
//! never looked up by label on the session path), so counting costs a session no lock.

use std::sync::Arc;

use async_trait::async_trait;
use flotilla_proto::api::Kind;
use flotilla_proto::wire::Refusal;
use flotilla_store::{
    Basis, Object, ObjectList, Revision, Selection, Store, StoreError, WatchStream, WriteFence,
};
use flotilla_transport::Carrier;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

type Labels = [(&'static str, &'static str); 1];

/// The gateway's metrics. Cheap to clone: clones count into the same series.
#[derive(Clone, Debug)]
pub struct GatewayMetrics {
    sessions: Family<Labels, Gauge>,
    /// `sessions`' series in [`CARRIERS`] order, resolved once.
    sessions_by: [Gauge; CARRIERS.len()],
    reconnects: Counter,
    refused: Family<Labels, Counter>,
    /// `refused`'s series in [`REFUSALS`] order, resolved once.
    refused_by: [Counter; REFUSALS.len()],
    store_requests: Family<Labels, Counter>,
    store_errors: Family<Labels, Counter>,
    /// Set at each scrape from the status writer.
    pub(crate) status_queue: Gauge,
    /// Set at each scrape from the shard view.
    pub(crate) shards_owned: Gauge,
    /// `cached_objects`, by kind: set at each scrape from the watch caches.
    cached_objects: Family<Labels, Gauge>,
    pub(crate) cached_works: Gauge,
    pub(crate) cached_clusters: Gauge,
    /// Bytes of large works' chunks handed to sessions.
    pub(crate) chunk_bytes_sent: Counter,
    /// New connections on the agents' listener, by what the session rate said and carrier.
    new_connections: Family<[(&'static str, &'static str); 2], Counter>,
    /// Fenced writes dropped, by reason: refused by the store, or by this gateway's own check.
    fenced_writes: Family<Labels, Counter>,
}

/// The reasons a fenced write is dropped, as `flotilla_gateway_fenced_writes_total` labels
/// them: the store refused it (`stale_epoch`, `stale_report`, see
/// `flotilla_proto::contract::fence`), or this gateway's own check before the write found it no
/// longer holds the cluster's shard (`not_held`).
pub const FENCED_WRITE_REASONS: [&str; 3] = ["stale_epoch", "stale_report", "not_held"];

/// The series of `flotilla_gateway_fenced_writes_total`, one per [`FENCED_WRITE_REASONS`]
/// entry, resolved once. Cheap to clone.
#[derive(Clone, Debug)]
pub struct FencedWriteCounters([Counter; FENCED_WRITE_REASONS.len()]);

impl FencedWriteCounters {
    /// Counts one write dropped for `reason` (one of [`FENCED_WRITE_REASONS`]).
    pub(crate) fn dropped(&self, reason: &str) {
        if let Some(i) = FENCED_WRITE_REASONS.iter().position(|r| *r == reason) {
            self.0[i].inc();
        }
    }

    /// How many were dropped for `reason`.
    pub fn count(&self, reason: &str) -> u64 {
        FENCED_WRITE_REASONS
            .iter()
            .position(|r| *r == reason)
            .map_or(0, |i| self.0[i].get())
    }
}

impl Default for FencedWriteCounters {
    /// Counters of no registry, for writers built outside a gateway (tests).
    fn default() -> Self {
        FencedWriteCounters(std::array::from_fn(|_| Counter::default()))
    }
}

/// Registers `flotilla_gateway_tls_resumptions_total`, counted by the agents' listener's
/// session tickets ([`flotilla_transport::tickets`]).
pub fn register_tls_resumptions(registry: &mut Registry, opened: Counter) {
    registry.sub_registry_with_prefix("gateway").register(
        "tls_resumptions",
        "Agents' TLS handshakes (either carrier) that resumed with a session ticket this \
         listener, or an earlier run of it under the same key, issued: no certificate was \
         signed or verified. The rest of new_connections{outcome=\"admitted\"} ran in full",
        opened,
    );
}

impl GatewayMetrics {
    pub fn new() -> GatewayMetrics {
        let refused = Family::<Labels, Counter>::default();
        let sessions = Family::<Labels, Gauge>::default();
        let cached_objects = Family::<Labels, Gauge>::default();
        let metrics = GatewayMetrics {
            sessions_by: CARRIERS
                .map(|c| sessions.get_or_create_owned(&[("transport", transport(c))])),
            sessions,
            reconnects: Counter::default(),
            refused_by: REFUSALS.map(|r| refused.get_or_create_owned(&[("reason", reason(r))])),
            refused,
            store_requests: Family::default(),
            store_errors: Family::default(),
            status_queue: Gauge::default(),
            shards_owned: Gauge::default(),
            cached_works: cached_objects.get_or_create_owned(&[("kind", "ManifestWork")]),
            cached_clusters: cached_objects.get_or_create_owned(&[("kind", "ManagedCluster")]),
            cached_objects,
            chunk_bytes_sent: Counter::default(),
            new_connections: Family::default(),
            fenced_writes: Family::default(),
        };
        let _ = metrics.fenced_write_counters();
        let _ = metrics.new_connection_counters();
        // Every series from the start: a rate() over a series that appears late misses its
        // first increase, and a dashboard shows 0 rather than nothing.
        for verb in Verb::ALL {
            let _ = metrics
                .store_requests
                .get_or_create_owned(&[("verb", verb.name())]);
            let _ = metrics
                .store_errors
                .get_or_create_owned(&[("verb", verb.name())]);
        }
        metrics
    }

    /// Registers every metric under `flotilla_gateway_`.
    pub fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("gateway");
        r.register(
            "sessions",
            "Agent sessions open on this gateway (admitted and synced), by carrier",
            self.sessions.clone(),
        );
        r.register(
            "session_reconnects",
            "Sessions established for a cluster that had held one on this gateway before (a \
             reconnect, or a new session replacing a live one)",
            self.reconnects.clone(),
        );
        r.register(
            "admissions_refused",
            "Sessions refused or closed because the cluster may not hold one, by reason",
            self.refused.clone(),
        );
        r.register(
            "store_requests",
            "Requests this gateway made to the hub's store, by verb",
            self.store_requests.clone(),
        );
        r.register(
            "store_request_errors",
            "Requests to the hub's store that failed (unreachable, refused, conflicts), by verb: \
             a gateway keeps serving sessions from its caches while the store is away",
            self.store_errors.clone(),
        );
        r.register(
            "status_write_queue_depth",
            "Work statuses reported by agents and not yet written to the store (one per work)",
            self.status_queue.clone(),
        );
        r.register(
            "chunk_bytes_sent",
            "Bytes of large ManifestWorks' content chunks sent to agents, as they ask for the \
             chunks they do not hold",
            self.chunk_bytes_sent.clone(),
        );
        r.register(
            "new_connections",
            "New connections on the agents' listener, counted before their TLS handshake, by \
             what the new-session rate (--session-rate, --session-burst) said: admitted, or \
             over_rate (told a retry-after before TLS: over TCP in a line, over QUIC in the \
             gateway's first answer); or not_ready (closed before TLS: \
             the gateway has not read the shard leases, or loaded none of its shards yet); \
             and by carrier",
            self.new_connections.clone(),
        );
        r.register(
            "cached_objects",
            "Objects in this gateway's watch caches, by kind: the works and clusters of the \
             shards it holds (of every cluster without leases)",
            self.cached_objects.clone(),
        );
        r.register(
            "fenced_writes",
            "Fenced writes (cluster health, work statuses, cleanup finalizers, the unreachable \
             taint) dropped, by reason: the store refused them because another gateway wrote \
             the object under a newer epoch of its shard (stale_epoch) or a newer report of the \
             agent is stored (stale_report), or this gateway's own check before the write found \
             it no longer holds the cluster's shard (not_held). None is retried",
            self.fenced_writes.clone(),
        );
        r.register(
            "shards_owned",
            "Virtual shards this gateway acts for (all of them without leases)",
            self.shards_owned.clone(),
        );
    }

    /// The gauge of sessions open on `carrier`.
    pub(crate) fn sessions_on(&self, carrier: Carrier) -> Gauge {
        match carrier {
            Carrier::Grpc => self.sessions_by[0].clone(),
            Carrier::Quic => self.sessions_by[1].clone(),
        }
    }

    /// The series of `new_connections`, by outcome (admitted, over_rate, not_ready) then
    /// carrier (grpc, quic), for the session gate to count into without a lookup.
    pub(crate) fn new_connection_counters(&self) -> [[Counter; 2]; 3] {
        ["admitted", "over_rate", "not_ready"].map(|outcome| {
            CARRIERS.map(|c| {
                self.new_connections
                    .get_or_create_owned(&[("outcome", outcome), ("transport", transport(c))])
            })
        })
    }

    /// The series of `fenced_writes`, for the gateway's writers to count into.
    pub fn fenced_write_counters(&self) -> FencedWriteCounters {
        FencedWriteCounters(
            FENCED_WRITE_REASONS.map(|r| self.fenced_writes.get_or_create_owned(&[("reason", r)])),
        )
    }

    pub(crate) fn reconnected(&self) {
        self.reconnects.inc();
    }

    pub(crate) fn refused(&self, refusal: Refusal) {
        let at = REFUSALS.iter().position(|r| *r == refusal);
        if let Some(counter) = at.and_then(|i| self.refused_by.get(i)) {
            counter.inc();
        }
    }

    /// How many store requests of `verb` (as its label says) were counted.
    #[cfg(test)]
    pub(crate) fn store_requests_of(&self, verb: &str) -> u64 {
        Verb::ALL
            .iter()
            .find(|v| v.name() == verb)
            .map(|v| {
                self.store_requests
                    .get_or_create_owned(&[("verb", v.name())])
                    .get()
            })
            .unwrap_or(0)
    }

    /// `store` with every request counted.
    pub(crate) fn metered(&self, store: Arc<dyn Store>) -> Arc<dyn Store> {
        let requests = Verb::ALL.map(|v| {
            self.store_requests
                .get_or_create_owned(&[("verb", v.name())])
        });
        let errors =
            Verb::ALL.map(|v| self.store_errors.get_or_create_owned(&[("verb", v.name())]));
        Arc::new(MeteredStore {
            inner: store,
            requests,
            errors,
        })
    }
}

impl Default for GatewayMetrics {
    fn default() -> GatewayMetrics {
        GatewayMetrics::new()
    }
}

/// The session, open: decrements its carrier's gauge when dropped, however the driver ends.
pub(crate) struct OpenSession(Gauge);

impl OpenSession {
    pub(crate) fn new(gauge: Gauge) -> OpenSession {
        gauge.inc();
        OpenSession(gauge)
    }
}

impl Drop for OpenSession {
    fn drop(&mut self) {
        self.0.dec();
    }
}

fn transport(carrier: Carrier) -> &'static str {
    match carrier {
        Carrier::Grpc => "grpc",
        Carrier::Quic => "quic",
    }
}

const CARRIERS: [Carrier; 2] = [Carrier::Grpc, Carrier::Quic];

const REFUSALS: [Refusal; 6] = [
    Refusal::ClusterNotRegistered,
    Refusal::ClusterDenied,
    Refusal::ClusterNotAccepted,
    Refusal::KeyNotRegistered,
    Refusal::NotAnAgent,
    Refusal::Unspecified,
];

/// The label value of a refusal: its protocol name in lower case.
fn reason(refusal: Refusal) -> &'static str {
    match refusal {
        Refusal::ClusterNotRegistered => "cluster_not_registered",
        Refusal::ClusterDenied => "cluster_denied",
        Refusal::ClusterNotAccepted => "cluster_not_accepted",
        Refusal::KeyNotRegistered => "key_not_registered",
        Refusal::NotAnAgent => "not_an_agent",
        Refusal::Unspecified => "unspecified",
    }
}

/// A store request, named as the apiserver names its verbs.
#[derive(Clone, Copy)]
enum Verb {
    Get,
    List,
    Watch,
    Create,
    Update,
    UpdateStatus,
    Delete,
}

impl Verb {
    const ALL: [Verb; 7] = [
        Verb::Get,
        Verb::List,
        Verb::Watch,
        Verb::Create,
        Verb::Update,
        Verb::UpdateStatus,
        Verb::Delete,
    ];

    fn name(self) -> &'static str {
        match self {
            Verb::Get => "get",
            Verb::List => "list",
            Verb::Watch => "watch",
            Verb::Create => "create",
            Verb::Update => "update",
            // A write of the status subresource, as the apiserver's `update` with
            // subresource `status`; kept apart because status writes are the gateway's bulk.
            Verb::UpdateStatus => "update_status",
            Verb::Delete => "delete",
        }
    }
}

/// A store that counts each request, and each failed one, by verb.
struct MeteredStore {
    inner: Arc<dyn Store>,
    requests: [Counter; Verb::ALL.len()],
    errors: [Counter; Verb::ALL.len()],
}

impl MeteredStore {
    async fn counted<T>(
        &self,
        verb: Verb,
        request: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        self.requests[verb as usize].inc();
        let result = request.await;
        if result.is_err() {
            self.errors[verb as usize].inc();
        }
        result
    }
}

#[async_trait]
impl Store for MeteredStore {
    async fn get(
        &self,
        kind: Kind,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<Option<Object>, StoreError> {
        self.counted(Verb::Get, self.inner.get(kind, namespace, name))
            .await
    }

    async fn get_json(
        &self,
        kind: Kind,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<Option<Vec<u8>>, StoreError> {
        self.counted(Verb::Get, self.inner.get_json(kind, namespace, name))
            .await
    }

    async fn list(&self, kind: Kind, namespace: Option<&str>) -> Result<ObjectList, StoreError> {
        self.counted(Verb::List, self.inner.list(kind, namespace))
            .await
    }

    async fn watch(
        &self,
        kind: Kind,
        namespace: Option<&str>,
        from: Option<Revision>,
    ) -> Result<WatchStream, StoreError> {
        self.counted(Verb::Watch, self.inner.watch(kind, namespace, from))
            .await
    }

    async fn list_selected(
        &self,
        kind: Kind,
        selection: &Selection,
    ) -> Result<ObjectList, StoreError> {
        self.counted(Verb::List, self.inner.list_selected(kind, selection))
            .await
    }

    async fn watch_selected(
        &self,
        kind: Kind,
        selection: &Selection,
        from: Option<Revision>,
    ) -> Result<WatchStream, StoreError> {
        self.counted(
            Verb::Watch,
            self.inner.watch_selected(kind, selection, from),
        )
        .await
    }

    async fn create(&self, object: Object) -> Result<Object, StoreError> {
        self.counted(Verb::Create, self.inner.create(object)).await
    }

    async fn update_spec(&self, object: Object) -> Result<Object, StoreError> {
        self.counted(Verb::Update, self.inner.update_spec(object))
            .await
    }

    async fn update_status(
        &self,
        kind: Kind,
        namespace: Option<&str>,
        name: &str,
        status: serde_json::Value,
        expected: Option<&Revision>,
    ) -> Result<Object, StoreError> {
        self.counted(
            Verb::UpdateStatus,
            self.inner
                .update_status(kind, namespace, name, status, expected),
        )
        .await
    }

    async fn update_status_fenced(
        &self,
        kind: Kind,
        namespace: Option<&str>,
        name: &str,
        status: serde_json::Value,
        fence: &WriteFence,
        basis: Option<&Basis>,
    ) -> Result<Object, StoreError> {
        // One request as counted here; on the kube backend a read before it when the basis was
        // missing or stale.
        self.counted(
            Verb::UpdateStatus,
            self.inner
                .update_status_fenced(kind, namespace, name, status, fence, basis),
        )
        .await
    }

    async fn update_spec_fenced(
        &self,
        object: Object,
        fence: &WriteFence,
    ) -> Result<Object, StoreError> {
        self.counted(Verb::Update, self.inner.update_spec_fenced(object, fence))
            .await
    }

    async fn delete(
        &self,
        kind: Kind,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<(), StoreError> {
        self.counted(Verb::Delete, self.inner.delete(kind, namespace, name))
            .await
    }

    async fn ensure_namespace(&self, name: &str) -> Result<(), StoreError> {
        // A get, then a create when missing, on the apiserver; counted as the get.
        self.counted(Verb::Get, self.inner.ensure_namespace(name))
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page(metrics: &GatewayMetrics) -> flotilla_ops::exposition::Exposition {
        let mut registry = flotilla_ops::registry();
        metrics.register(&mut registry);
        let endpoint = flotilla_ops::Endpoint::new(registry, flotilla_ops::Readiness::default());
        flotilla_ops::exposition::check(&endpoint.metrics_text()).expect("a valid page")
    }

    #[tokio::test]
    async fn requests_refusals_and_sessions_land_in_their_own_series() {
        let dir = tempfile::tempdir().unwrap();
        let metrics = GatewayMetrics::new();
        let store = metrics.metered(Arc::new(
            flotilla_store::SledStore::open(dir.path().join("store")).unwrap(),
        ));
        store.list(Kind::ManagedCluster, None).await.unwrap();
        store.list(Kind::ManifestWork, None).await.unwrap();
        store
            .get(Kind::ManagedCluster, None, "store-1")
            .await
            .unwrap();
        // A namespaced kind without its namespace: refused by the store, counted as failed.
        store.get(Kind::ManifestWork, None, "w").await.unwrap_err();
        metrics.refused(Refusal::ClusterDenied);
        let open = OpenSession::new(metrics.sessions_on(Carrier::Quic));

        let p = page(&metrics);
        let requests = |verb| p.value("flotilla_gateway_store_requests_total", &[("verb", verb)]);
        assert_eq!(requests("list"), Some(2.0));
        assert_eq!(requests("get"), Some(2.0));
        let errors = |verb| {
            p.value(
                "flotilla_gateway_store_request_errors_total",
                &[("verb", verb)],
            )
        };
        assert_eq!((errors("get"), errors("list")), (Some(1.0), Some(0.0)));
        assert_eq!(requests("update_status"), Some(0.0));
        let refused = |reason| {
            p.value(
                "flotilla_gateway_admissions_refused_total",
                &[("reason", reason)],
            )
        };
        assert_eq!(refused("cluster_denied"), Some(1.0));
        assert_eq!(refused("key_not_registered"), Some(0.0));
        assert_eq!(
            p.value("flotilla_gateway_sessions", &[("transport", "quic")]),
            Some(1.0)
        );
        assert_eq!(
            p.value("flotilla_gateway_sessions", &[("transport", "grpc")]),
            Some(0.0)
        );

        drop(open);
        let p = page(&metrics);
        assert_eq!(
            p.value("flotilla_gateway_sessions", &[("transport", "quic")]),
            Some(0.0)
        );
    }
}
