//! The pattern flotilla replaces, as a load: one klusterlet-style client per managed cluster,
//! each talking to the hub's kube-apiserver itself the way OCM's registration and work agents
//! do. Each client has its own `kube::Client` (its own connections, as each real klusterlet
//! has), and:
//!
//! * lists and watches the ManifestWorks in its cluster's namespace, and its own ManagedCluster
//!   (field selector `metadata.name`): two informers, two watches held;
//! * once both have listed, writes its ManagedCluster's status (Joined and Available, as the
//!   registration agent does when it starts) and creates its `coordination.k8s.io/v1` Lease in
//!   its namespace, then renews it every `--lease-interval` (an update of `spec.renewTime`);
//! * for each work its watch delivers without Applied and Available for the work's generation,
//!   "applies" it to an in-memory cluster (the agent library's `MemoryCluster`: there is no
//!   spoke apiserver, nothing leaves the process) and writes the work's status (Applied and
//!   Available, with per-manifest conditions, shaped by the agent library as flotilla's agents
//!   shape theirs) with one merge patch on `/status`.
//!
//! What it leaves out makes this baseline cheaper than a real klusterlet, so ratios against it
//! are lower bounds: no finalizer added to each work, no AppliedManifestWork on the spoke, no
//! periodic resync of the ManagedCluster's status (claims, allocatable), no add-on leases, no
//! certificate rotation; and every client is an admin (`system:masters`), which API Priority and
//! Fairness exempts from queueing. kube-rs speaks HTTP/1.1, so each watch holds its own
//! connection where client-go would multiplex them over HTTP/2: that changes sockets, not
//! requests.
//!
//! A storm on this side ([`Klusterlets::restart_all`]) restarts every client at once, as a hub
//! apiserver restart or a network flap that drops every agent's connections does: each builds a
//! new `kube::Client` (new connections), lists and watches both kinds again, and renews its
//! Lease as a registration agent does when it starts. Works already Applied and Available are
//! not written again (their status is unchanged), so the storm's cost is the relists, the
//! rewatches and the renewals.
//!
//! Renewals are spread: each client's first renewal comes at a random point of its first
//! interval (seeded by `--seed`), as a real fleet's are spread by when each agent started.
//! Otherwise a ramp of a few seconds would bunch every renewal into the same seconds of each
//! interval, and an idle window shorter than the interval could miss them all or catch them all.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context;
use flotilla_agent::MemoryCluster;
use flotilla_agent::apply::{ApplyContext, apply_planned, plan_manifests};
use flotilla_agent::status::work_status;
use flotilla_proto::api::conditions::{
    ConditionStatus, MANAGED_CLUSTER_CONDITION_AVAILABLE, MANAGED_CLUSTER_JOINED, WORK_APPLIED,
    WORK_AVAILABLE, find_condition, is_condition_true, set_condition,
};
use flotilla_proto::api::{ManagedCluster, ManagedClusterSpec, ManifestWork};
use futures::StreamExt;
use futures::stream::BoxStream;
use indicatif::ProgressBar;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use rand::{Rng, SeedableRng};
use serde_json::json;
use tokio::sync::{Mutex, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;

/// The Lease OCM's registration agent renews in its cluster's namespace on the hub.
pub const LEASE_NAME: &str = "managed-cluster-lease";
/// Connections one client holds: one per watch (HTTP/1.1), one for its writes.
pub const CONNECTIONS_PER_CLIENT: u64 = 3;
/// Kubernetes version the clients report for their clusters.
pub const KUBERNETES_VERSION: &str = "v1.36.0-flotilla-loadtest-baseline";
/// Fan-out creates in flight against the apiserver.
pub const CREATES_IN_FLIGHT: usize = 8;
/// Setup writes (namespaces, ManagedClusters) in flight.
pub const SETUP_IN_FLIGHT: usize = 16;
/// Wait before a client retries a write that failed.
pub const RETRY_AFTER: Duration = Duration::from_secs(1);
/// How long the clients may take to stop.
pub const STOP_TIMEOUT: Duration = Duration::from_secs(60);
/// Client failures quoted in the report.
const ERROR_EXAMPLES: usize = 5;
/// Field manager of the harness's own (setup and fan-out) writes.
const FIELD_MANAGER: &str = "flotilla-loadtest";

/// What every client is given.
#[derive(Clone)]
pub struct KlusterletSpec {
    /// The apiserver and credentials; each client builds its own `kube::Client` from it.
    pub config: kube::Config,
    pub lease_interval: Duration,
    /// Clients started per second.
    pub connect_rate: f64,
    pub seed: u64,
}

/// Counters of all clients, for progress and for waiting.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KlusterletCounts {
    pub started: u64,
    /// Both informers listed.
    pub synced: u64,
    /// Both informers listed again after the last [`Klusterlets::restart_all`].
    pub resynced: u64,
    /// ManagedCluster status written and Lease created.
    pub registered: u64,
    pub statuses_written: u64,
    pub lease_renewals: u64,
    pub errors: u64,
}

#[derive(Default)]
struct Tally {
    started: AtomicU64,
    synced: AtomicU64,
    resynced: AtomicU64,
    registered: AtomicU64,
    statuses_written: AtomicU64,
    lease_renewals: AtomicU64,
    errors: AtomicU64,
    examples: Mutex<Vec<String>>,
}

impl Tally {
    fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    async fn failed(&self, rec: &mut ClientRecord, what: &str, error: impl std::fmt::Display) {
        rec.errors += 1;
        Tally::bump(&self.errors);
        tracing::debug!(cluster = %rec.name, %error, what, "klusterlet client request failed");
        let mut examples = self.examples.lock().await;
        if examples.len() < ERROR_EXAMPLES {
            examples.push(format!("{}: {what}: {error}", rec.name));
        }
    }
}

/// What one client did, for the report's accounting.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClientRecord {
    pub name: String,
    /// Both informers finished their initial list.
    pub synced: bool,
    /// Its ManagedCluster's status is written and its Lease created.
    pub registered: bool,
    /// Works its watch delivered, by name.
    pub works_seen: BTreeSet<String>,
    pub statuses_written: u64,
    pub lease_renewals: u64,
    pub errors: u64,
    /// Restarts after which both informers listed again.
    pub restarts_synced: u64,
}

/// The running clients.
pub struct Klusterlets {
    tally: Arc<Tally>,
    stop: watch::Sender<bool>,
    /// Bumped by [`Klusterlets::restart_all`]; every client restarts when it changes.
    restarts: watch::Sender<u64>,
    ramp: tokio::task::JoinHandle<Vec<ClientRecord>>,
}

impl Klusterlets {
    /// Starts one client per name, at `spec.connect_rate` per second.
    pub fn start(spec: KlusterletSpec, names: Vec<String>) -> Klusterlets {
        let tally = Arc::new(Tally::default());
        let (stop, stopped) = watch::channel(false);
        let (restarts, restarted) = watch::channel(0);
        let ramp = tokio::spawn(ramp(spec, names, tally.clone(), stopped, restarted));
        Klusterlets {
            tally,
            stop,
            restarts,
            ramp,
        }
    }

    /// Restarts every client at once: new connections, both kinds listed and watched again,
    /// the Lease renewed. `counts().resynced` counts those that have listed again since.
    pub fn restart_all(&self) {
        self.tally.resynced.store(0, Ordering::Relaxed);
        self.restarts.send_modify(|n| *n += 1);
    }

    pub fn counts(&self) -> KlusterletCounts {
        let t = &self.tally;
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        KlusterletCounts {
            started: get(&t.started),
            synced: get(&t.synced),
            resynced: get(&t.resynced),
            registered: get(&t.registered),
            statuses_written: get(&t.statuses_written),
            lease_renewals: get(&t.lease_renewals),
            errors: get(&t.errors),
        }
    }

    /// A few of the clients' failures.
    pub async fn error_examples(&self) -> Vec<String> {
        self.tally.examples.lock().await.clone()
    }

    /// Stops every client (their watches close) and returns what each did.
    pub async fn stop(self) -> anyhow::Result<Vec<ClientRecord>> {
        let _ = self.stop.send(true);
        tokio::time::timeout(STOP_TIMEOUT, self.ramp)
            .await
            .map_err(|_| {
                anyhow::anyhow!("the klusterlet clients did not stop within {STOP_TIMEOUT:?}")
            })?
            .context("the klusterlet clients' task failed")
    }
}

/// Starts the clients on schedule, then waits for the stop and collects their records.
async fn ramp(
    spec: KlusterletSpec,
    names: Vec<String>,
    tally: Arc<Tally>,
    stopped: watch::Receiver<bool>,
    restarted: watch::Receiver<u64>,
) -> Vec<ClientRecord> {
    let mut tasks = JoinSet::new();
    let start = Instant::now();
    let mut rng = rand::rngs::StdRng::seed_from_u64(spec.seed);
    let mut stop = stopped.clone();
    for (i, name) in names.into_iter().enumerate() {
        let at = start + Duration::from_secs_f64(i as f64 / spec.connect_rate);
        tokio::select! {
            _ = tokio::time::sleep_until(at) => {}
            _ = stop_sent(&mut stop) => break,
        }
        let first_renewal = spec.lease_interval.mul_f64(rng.random::<f64>());
        tasks.spawn(client(
            spec.clone(),
            name,
            first_renewal,
            tally.clone(),
            stopped.clone(),
            restarted.clone(),
        ));
    }
    stop_sent(&mut stop).await;
    let mut records = Vec::with_capacity(tasks.len());
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok(record) => records.push(record),
            Err(e) => tracing::error!(error = %e, "a klusterlet client task panicked"),
        }
    }
    records
}

/// Resolves once the stop has been sent (or its sender dropped).
async fn stop_sent(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// One klusterlet-style client, until `stop`.
async fn client(
    spec: KlusterletSpec,
    name: String,
    first_renewal: Duration,
    tally: Arc<Tally>,
    mut stop: watch::Receiver<bool>,
    mut restarted: watch::Receiver<u64>,
) -> ClientRecord {
    Tally::bump(&tally.started);
    let mut rec = ClientRecord {
        name: name.clone(),
        ..Default::default()
    };
    restarted.mark_unchanged();
    let mut conn = match Connection::open(&spec, &name) {
        Ok(c) => c,
        Err(e) => {
            tally.failed(&mut rec, "building its kube client", e).await;
            return rec;
        }
    };
    let spoke = MemoryCluster::new();

    let (mut works_listed, mut cluster_listed) = (false, false);
    // Set by a restart until both informers have listed again.
    let mut restarting = false;
    let mut status_written = false;
    // The Lease as last written (its resourceVersion makes the renewal an update of it);
    // `None` until created, and after a failed renewal so that the next one reads it first.
    let mut lease: Option<Lease> = None;
    let mut renew_at: Option<Instant> = None;
    // Works delivered whose status is still to be written.
    let mut pending: BTreeMap<String, ManifestWork> = BTreeMap::new();
    // After a failed write, nothing is retried before this.
    let mut retry_at: Option<Instant> = None;

    loop {
        if retry_at.is_none_or(|t| t <= Instant::now()) {
            retry_at = None;
            let mut failed = false;
            if works_listed && cluster_listed && !rec.registered {
                if !status_written {
                    match write_cluster_status(&conn.clusters, &name).await {
                        Ok(()) => status_written = true,
                        Err(e) => {
                            failed = true;
                            tally
                                .failed(&mut rec, "writing its ManagedCluster's status", e)
                                .await;
                        }
                    }
                }
                if status_written {
                    match create_lease(&conn.leases, &name, spec.lease_interval).await {
                        Ok(l) => {
                            lease = Some(l);
                            renew_at = Some(Instant::now() + first_renewal);
                            rec.registered = true;
                            Tally::bump(&tally.registered);
                        }
                        Err(e) => {
                            failed = true;
                            tally.failed(&mut rec, "creating its Lease", e).await;
                        }
                    }
                }
            }
            let due: Vec<String> = pending.keys().cloned().collect();
            for work in due {
                match write_work_status(&conn.works, &spoke, &pending[&work]).await {
                    Ok(()) => {
                        pending.remove(&work);
                        rec.statuses_written += 1;
                        Tally::bump(&tally.statuses_written);
                    }
                    Err(e) => {
                        failed = true;
                        let what = format!("writing the status of ManifestWork {name}/{work}");
                        tally.failed(&mut rec, &what, e).await;
                    }
                }
            }
            if failed {
                retry_at = Some(Instant::now() + RETRY_AFTER);
            }
        }
        let wake = [retry_at, renew_at].into_iter().flatten().min();
        tokio::select! {
            _ = stop_sent(&mut stop) => break,
            changed = restarted.changed() => {
                if changed.is_err() {
                    break;
                }
                // A restarted agent: its connections and informers are new; a registered
                // one renews its Lease first thing.
                match Connection::open(&spec, &name) {
                    Ok(c) => conn = c,
                    Err(e) => {
                        tally.failed(&mut rec, "building its kube client", e).await;
                        break;
                    }
                }
                (works_listed, cluster_listed) = (false, false);
                restarting = true;
                if rec.registered {
                    renew_at = Some(Instant::now());
                }
            }
            event = conn.work_events.next() => match event {
                Some(Ok(watcher::Event::Apply(w) | watcher::Event::InitApply(w))) => {
                    let Some(work) = w.metadata.name.clone() else { continue };
                    rec.works_seen.insert(work.clone());
                    if needs_status(&w) {
                        pending.insert(work, w);
                    } else {
                        pending.remove(&work);
                    }
                }
                Some(Ok(watcher::Event::Delete(w))) => {
                    if let Some(work) = &w.metadata.name {
                        pending.remove(work);
                    }
                }
                Some(Ok(watcher::Event::InitDone)) => {
                    if !works_listed {
                        works_listed = true;
                        if cluster_listed {
                            listed_both(&mut rec, &tally, &mut restarting);
                        }
                    }
                }
                Some(Ok(watcher::Event::Init)) => {}
                Some(Err(e)) if expired(&e) => tracing::debug!(cluster = %rec.name, "its ManifestWork watch expired; relisting"),
                Some(Err(e)) => tally.failed(&mut rec, "watching its ManifestWorks", e).await,
                None => break,
            },
            event = conn.cluster_events.next() => match event {
                Some(Ok(watcher::Event::InitDone)) => {
                    if !cluster_listed {
                        cluster_listed = true;
                        if works_listed {
                            listed_both(&mut rec, &tally, &mut restarting);
                        }
                    }
                }
                // Its own status writes coming back; a real agent reacts to spec changes
                // (acceptance, taints), which the scenario does not make.
                Some(Ok(_)) => {}
                Some(Err(e)) if expired(&e) => tracing::debug!(cluster = %rec.name, "its ManagedCluster watch expired; relisting"),
                Some(Err(e)) => tally.failed(&mut rec, "watching its ManagedCluster", e).await,
                None => break,
            },
            _ = tokio::time::sleep_until(wake.unwrap_or_else(Instant::now)), if wake.is_some() => {
                let now = Instant::now();
                if let Some(at) = renew_at.filter(|at| *at <= now) {
                    match renew_lease(&conn.leases, lease.take()).await {
                        Ok(l) => {
                            lease = Some(l);
                            renew_at = Some(at + spec.lease_interval);
                            rec.lease_renewals += 1;
                            Tally::bump(&tally.lease_renewals);
                        }
                        Err(e) => {
                            renew_at = Some(now + RETRY_AFTER);
                            tally.failed(&mut rec, "renewing its Lease", e).await;
                        }
                    }
                }
            }
        }
    }
    rec
}

/// A client's connections to the apiserver: its Apis and its two informers' event streams.
struct Connection {
    works: Api<ManifestWork>,
    clusters: Api<ManagedCluster>,
    leases: Api<Lease>,
    work_events: BoxStream<'static, Result<watcher::Event<ManifestWork>, watcher::Error>>,
    cluster_events: BoxStream<'static, Result<watcher::Event<ManagedCluster>, watcher::Error>>,
}

impl Connection {
    /// A new `kube::Client` (its own connections) and both informers, which list first.
    fn open(spec: &KlusterletSpec, name: &str) -> Result<Connection, kube::Error> {
        let client = kube::Client::try_from(spec.config.clone())?;
        let works: Api<ManifestWork> = Api::namespaced(client.clone(), name);
        let clusters: Api<ManagedCluster> = Api::all(client.clone());
        let leases: Api<Lease> = Api::namespaced(client, name);
        // The watcher re-lists and re-watches after errors, with kube-runtime's default backoff.
        let work_events = watcher(works.clone(), watcher::Config::default())
            .default_backoff()
            .boxed();
        let cluster_events = watcher(
            clusters.clone(),
            watcher::Config::default().fields(&format!("metadata.name={name}")),
        )
        .default_backoff()
        .boxed();
        Ok(Connection {
            works,
            clusters,
            leases,
            work_events,
            cluster_events,
        })
    }
}

/// Both informers have listed: the client is synced, or synced again after a restart.
fn listed_both(rec: &mut ClientRecord, tally: &Tally, restarting: &mut bool) {
    if !rec.synced {
        rec.synced = true;
        Tally::bump(&tally.synced);
    }
    if std::mem::take(restarting) {
        rec.restarts_synced += 1;
        Tally::bump(&tally.resynced);
    }
}

/// Whether a work lacks Applied=True or Available=True for its current generation.
fn needs_status(work: &ManifestWork) -> bool {
    let conditions = work
        .status
        .as_ref()
        .map_or(&[][..], |s| s.conditions.as_slice());
    ![WORK_APPLIED, WORK_AVAILABLE].iter().all(|t| {
        find_condition(conditions, t).is_some_and(|c| {
            c.status == "True" && c.observed_generation == work.metadata.generation
        })
    })
}

/// "Applies" a work to the in-memory spoke and writes the status that results.
async fn write_work_status(
    works: &Api<ManifestWork>,
    spoke: &MemoryCluster,
    work: &ManifestWork,
) -> anyhow::Result<()> {
    let name = work.metadata.name.as_deref().unwrap_or_default();
    let planned = plan_manifests(spoke, &work.spec).await;
    let outcomes = apply_planned(spoke, &planned, &ApplyContext::default()).await;
    let status = work_status(
        work.metadata.generation.unwrap_or(0),
        &outcomes,
        &Time(Timestamp::now()),
    );
    works
        .patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({ "status": status })),
        )
        .await?;
    Ok(())
}

/// The registration agent's status write on start: Joined and Available, and the version.
async fn write_cluster_status(clusters: &Api<ManagedCluster>, name: &str) -> anyhow::Result<()> {
    let now = Time(Timestamp::now());
    let mut conditions = Vec::new();
    for (type_, reason, message) in [
        (
            MANAGED_CLUSTER_JOINED,
            "ManagedClusterJoined",
            "Managed cluster joined",
        ),
        (
            MANAGED_CLUSTER_CONDITION_AVAILABLE,
            "ManagedClusterAvailable",
            "Managed cluster is available",
        ),
    ] {
        set_condition(
            &mut conditions,
            type_,
            ConditionStatus::True,
            reason,
            message,
            None,
            now.clone(),
        );
    }
    let patch = json!({ "status": {
        "conditions": conditions,
        "version": { "kubernetes": KUBERNETES_VERSION },
    }});
    clusters
        .patch_status(name, &PatchParams::default(), &Patch::Merge(patch))
        .await?;
    Ok(())
}

async fn create_lease(
    leases: &Api<Lease>,
    cluster: &str,
    interval: Duration,
) -> anyhow::Result<Lease> {
    let lease = Lease {
        metadata: ObjectMeta {
            name: Some(LEASE_NAME.to_string()),
            ..Default::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(cluster.to_string()),
            lease_duration_seconds: Some(interval.as_secs().try_into().unwrap_or(i32::MAX)),
            renew_time: Some(MicroTime(Timestamp::now())),
            ..Default::default()
        }),
    };
    match leases.create(&PostParams::default(), &lease).await {
        Ok(l) => Ok(l),
        // Created by an attempt whose answer was lost.
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(leases.get(LEASE_NAME).await?),
        Err(e) => Err(e.into()),
    }
}

/// Updates the Lease's renewTime (one PUT; one GET first when the last write failed).
async fn renew_lease(leases: &Api<Lease>, last: Option<Lease>) -> anyhow::Result<Lease> {
    let mut lease = match last {
        Some(l) => l,
        None => leases.get(LEASE_NAME).await?,
    };
    lease.spec.get_or_insert_with(Default::default).renew_time = Some(MicroTime(Timestamp::now()));
    Ok(leases
        .replace(LEASE_NAME, &PostParams::default(), &lease)
        .await?)
}

/// Creates what OCM's hub holds before any klusterlet connects, as setup (not measured): each
/// cluster's namespace, and its ManagedCluster, accepted, with its lease duration.
pub async fn prepare_hub(
    admin: &kube::Client,
    names: &[String],
    lease_interval: Duration,
    progress: &ProgressBar,
) -> anyhow::Result<()> {
    let namespaces: Api<Namespace> = Api::all(admin.clone());
    let clusters: Api<ManagedCluster> = Api::all(admin.clone());
    let params = PostParams {
        field_manager: Some(FIELD_MANAGER.to_string()),
        ..Default::default()
    };
    let results: Vec<anyhow::Result<()>> = futures::stream::iter(names)
        .map(|name| {
            let (namespaces, clusters, params) = (&namespaces, &clusters, &params);
            async move {
                let namespace = Namespace {
                    metadata: ObjectMeta {
                        name: Some(name.clone()),
                        ..Default::default()
                    },
                    ..Default::default()
                };
                ignore_exists(namespaces.create(params, &namespace).await)
                    .with_context(|| format!("creating namespace {name}"))?;
                let cluster = ManagedCluster::new(
                    name,
                    ManagedClusterSpec {
                        hub_accepts_client: true,
                        lease_duration_seconds: Some(
                            lease_interval.as_secs().try_into().unwrap_or(i32::MAX),
                        ),
                        ..Default::default()
                    },
                );
                ignore_exists(clusters.create(params, &cluster).await)
                    .with_context(|| format!("creating ManagedCluster {name}"))?;
                Ok(())
            }
        })
        .buffer_unordered(SETUP_IN_FLIGHT)
        .inspect(|_| progress.inc(1))
        .collect()
        .await;
    results.into_iter().collect()
}

fn ignore_exists<T>(result: Result<T, kube::Error>) -> Result<(), kube::Error> {
    match result {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
        Err(e) => Err(e),
    }
}

/// Creates ManifestWork `work` (the fan-out's shape) in every cluster's namespace,
/// [`CREATES_IN_FLIGHT`] at a time; returns how many were created.
pub async fn create_works(
    admin: &kube::Client,
    names: &[String],
    work: &str,
    progress: &ProgressBar,
) -> anyhow::Result<u64> {
    let params = PostParams {
        field_manager: Some(FIELD_MANAGER.to_string()),
        ..Default::default()
    };
    let results: Vec<anyhow::Result<()>> = futures::stream::iter(names)
        .map(|cluster| {
            let params = &params;
            async move {
                let manifest_work: ManifestWork =
                    serde_json::from_value(crate::scenario::work_json(cluster, work))
                        .context("the fan-out work decodes as a ManifestWork")?;
                Api::<ManifestWork>::namespaced(admin.clone(), cluster)
                    .create(params, &manifest_work)
                    .await
                    .with_context(|| format!("creating ManifestWork {cluster}/{work}"))?;
                Ok(())
            }
        })
        .buffer_unordered(CREATES_IN_FLIGHT)
        .inspect(|_| progress.inc(1))
        .collect()
        .await;
    let created = results.len() as u64;
    results.into_iter().collect::<anyhow::Result<()>>()?;
    Ok(created)
}

/// How many of `ours` the apiserver shows Available=True.
pub async fn available_clusters(
    admin: &kube::Client,
    ours: &HashSet<String>,
) -> anyhow::Result<u64> {
    let list = Api::<ManagedCluster>::all(admin.clone())
        .list(&ListParams::default())
        .await
        .context("listing ManagedClusters")?;
    Ok(list
        .items
        .iter()
        .filter(|c| {
            c.metadata.name.as_ref().is_some_and(|n| ours.contains(n))
                && c.status.as_ref().is_some_and(|s| {
                    is_condition_true(&s.conditions, MANAGED_CLUSTER_CONDITION_AVAILABLE)
                })
        })
        .count() as u64)
}

/// How many ManifestWorks named `work` the apiserver shows Applied=True and Available=True.
pub async fn applied_works(admin: &kube::Client, work: &str) -> anyhow::Result<u64> {
    let list = Api::<ManifestWork>::all(admin.clone())
        .list(&ListParams::default())
        .await
        .context("listing ManifestWorks")?;
    Ok(list
        .items
        .iter()
        .filter(|w| w.metadata.name.as_deref() == Some(work) && !needs_status(w))
        .count() as u64)
}

/// A watch the apiserver ended with 410 Gone ("too old resource version": its watch cache no
/// longer holds the version asked for). kube's watcher lists again on the next poll, as
/// client-go's reflector does; a real klusterlet counts that as a relist, not a failure.
fn expired(e: &watcher::Error) -> bool {
    matches!(e, watcher::Error::WatchError(status) if status.code == 410)
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_proto::api::ManifestWorkStatus;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;

    fn work(generation: i64, conditions: &[(&str, &str, i64)]) -> ManifestWork {
        let mut w = ManifestWork::new("w", Default::default());
        w.metadata.generation = Some(generation);
        if !conditions.is_empty() {
            w.status = Some(ManifestWorkStatus {
                conditions: conditions
                    .iter()
                    .map(|(t, s, g)| Condition {
                        type_: t.to_string(),
                        status: s.to_string(),
                        observed_generation: Some(*g),
                        last_transition_time: Time(Timestamp::UNIX_EPOCH),
                        reason: "R".into(),
                        message: String::new(),
                    })
                    .collect(),
                ..Default::default()
            });
        }
        w
    }

    #[test]
    fn a_work_needs_status_until_applied_and_available_for_its_generation() {
        for (w, needs) in [
            (work(1, &[]), true),
            (work(1, &[(WORK_APPLIED, "True", 1)]), true),
            (
                work(
                    1,
                    &[(WORK_APPLIED, "True", 1), (WORK_AVAILABLE, "False", 1)],
                ),
                true,
            ),
            (
                work(2, &[(WORK_APPLIED, "True", 1), (WORK_AVAILABLE, "True", 1)]),
                true,
            ),
            (
                work(2, &[(WORK_APPLIED, "True", 2), (WORK_AVAILABLE, "True", 2)]),
                false,
            ),
        ] {
            assert_eq!(needs_status(&w), needs, "{:?}", w.status);
        }
    }

    /// The status a client writes for the fan-out's work is the one it then reads as done.
    #[tokio::test]
    async fn the_status_of_the_fanout_work_is_applied_and_available() {
        let mut w: ManifestWork =
            serde_json::from_value(crate::scenario::work_json("lt-00001", "fanout-1")).unwrap();
        w.metadata.generation = Some(1);
        let spoke = MemoryCluster::new();
        let planned = plan_manifests(&spoke, &w.spec).await;
        let outcomes = apply_planned(&spoke, &planned, &ApplyContext::default()).await;
        w.status = Some(work_status(1, &outcomes, &Time(Timestamp::now())));
        assert!(!needs_status(&w), "{:?}", w.status);
        let manifests = &w.status.as_ref().unwrap().resource_status.manifests;
        assert_eq!(manifests.len(), 1);
        assert_eq!(manifests[0].resource_meta.resource, "configmaps");
    }
}
