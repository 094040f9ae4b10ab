//! One session's driver, whatever carries it: read a frame, feed the protocol machine, write
//! what it emits when the link has room, arm the timer it asks for. Work that touches the store
//! or the CA (admission and sync, status, renewal, health) runs as futures beside the loop
//! whose results come back as events; the loop itself never waits on them, so a slow store
//! costs no session its heartbeats.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use flotilla_ops::error_chain;
use flotilla_ops::sleep_until;
use flotilla_proto::api::Kind;
use flotilla_proto::api::content::{CHUNK_BYTES, chunk_data, chunk_object_name};
use flotilla_proto::contract::ca_bundle_sha256;
use flotilla_proto::session::{DesiredWork, HubConfig, HubEvent, HubSession};
use flotilla_proto::wire::{self, HubFrame};
use flotilla_store::StoreError;
use flotilla_transport::identity::Peer;
use flotilla_transport::{Incoming, Link, LinkError};
use futures::StreamExt as _;
use futures::future::BoxFuture;
use futures::stream::FuturesUnordered;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use crate::admission::AdmissionRefusal;
use crate::certificates::RenewalError;
use crate::health::HealthReport;
use crate::mailbox::{Closing, Mailbox, WorkChange};
use crate::metrics::OpenSession;
use crate::registry::SessionHandle;
use crate::shards::Route;
use crate::shards::leasing::spread_over;
use crate::shared::Shared;

/// How long a closed session may take to hand its last frames (the goodbye) to a peer that
/// stopped reading, before the driver gives up on it.
const FINAL_FLUSH: Duration = Duration::from_secs(2);

/// The result of work done beside the loop.
enum Done {
    /// Admitted and registered; the cluster's desired state to sync. `reconnect`: the cluster
    /// had a session on this gateway before (it ended, or this one replaces it).
    Synced {
        snapshot: Vec<DesiredWork>,
        reconnect: bool,
    },
    /// Not (or no longer) admitted.
    Refused(AdmissionRefusal),
    /// This gateway does not act for the cluster's shard: come back after `retry_after`, at
    /// `redirect` (the owner) when known.
    Redirected {
        retry_after: Duration,
        redirect: Option<String>,
        reason: String,
    },
    /// A renewal was signed, or refused.
    Renewed(Result<crate::certificates::RenewedCertificate, RenewalError>),
    /// A chunk asked for was read from the store and checked, or why it could not be.
    Chunk {
        uid: String,
        chunk_sha256: String,
        read: Result<Vec<u8>, ChunkUnserved>,
    },
    /// Nothing for the machine (a status queued, a report sent).
    Nothing,
}

/// Drives one session from its first frame to its end.
pub(crate) async fn drive(shared: Arc<Shared>, incoming: Incoming, session_id: String) {
    let Incoming {
        peer,
        link,
        tunnels,
    } = incoming;
    let Link {
        mut inbound,
        outbound,
        carrier,
    } = link;
    let config = &shared.config;
    let identity = match &peer.peer {
        Peer::Cluster(name) => name.clone(),
        Peer::Operator { user, .. } => format!("operator {user}"),
        Peer::User { user, .. } => format!("proxy user {user}"),
        Peer::Gateway { name } => format!("gateway {name}"),
        Peer::Anonymous => "anonymous".to_string(),
    };
    let mut machine = HubSession::new(
        Instant::now(),
        HubConfig {
            heartbeat_interval: config.heartbeat_interval,
            heartbeat_timeout: config.heartbeat_timeout,
            hello_timeout: config.hello_timeout,
            max_pending_works: config.session_queue_bound,
        },
        identity.clone(),
        session_id.clone(),
    );
    let cluster = match &peer.peer {
        Peer::Cluster(name) => Some(name.clone()),
        _ => None,
    };
    if cluster.is_none() {
        warn!(%carrier, "session refused: not an agent certificate");
        shared.metrics.refused(wire::Refusal::NotAnAgent);
        machine.refuse(
            wire::Refusal::NotAnAgent,
            match &peer.peer {
                Peer::Anonymous => {
                    "no client certificate: an agent joins first (`flotilla-agent join` with a \
                     bootstrap token) and opens its session with the certificate it receives"
                }
                _ => "only agent certificates (group flotilla:clusters) may open a session",
            },
        );
    } else if let Some(retry_after) = peer.over_rate {
        // Over the new-session rate, a QUIC connection whose first packet the listener no
        // longer remembered (the others, and every TCP one, were turned away before TLS):
        // told when to come back before any admission, sync or store work. Debug only: in a
        // storm this can be many connections.
        debug!(%carrier, ?retry_after, "session turned away: over the new-session rate");
        machine.drain(
            retry_after,
            "the gateway is taking new sessions at its --session-rate; come back after the \
             retry-after",
        );
    }
    let cluster = cluster.unwrap_or_default();
    let key = peer.client_key_sha256.clone().unwrap_or_default();
    let mailbox = Arc::new(Mailbox::default());
    let mut work: FuturesUnordered<BoxFuture<'static, Done>> = FuturesUnordered::new();
    // The next frame for the agent, taken from the machine once the link has room for it.
    let mut next: Option<HubFrame> = None;
    let mut established = false;
    let mut draining = shared.draining.subscribe();
    let mut drained = false;
    let mut closed_at: Option<Instant> = None;
    let spread = spread_over(config.drain_window, &session_id);
    // Counted in the carrier's sessions gauge from sync until the driver ends.
    let sessions = shared.metrics.sessions_on(carrier);
    let mut open = None;
    // When the next chunk read may start: chunks are paced to the per-session byte rate.
    let mut next_chunk_at = Instant::now();

    loop {
        while let Some(event) = machine.poll_event() {
            match event {
                HubEvent::Established { hello } => {
                    established = true;
                    info!(%carrier, agent_version = %hello.agent_version, held = hello.held.len(), "session established");
                    if let Some(certs) = &shared.certificates {
                        let bundle = certs.ca_bundle();
                        if ca_bundle_sha256(&bundle) != hello.ca_bundle_sha256 {
                            debug!("agent trusts an older CA bundle; sending the current one");
                            machine.send_trust_bundle(bundle);
                        }
                    }
                    let handle = SessionHandle {
                        cluster: cluster.clone(),
                        session_id: session_id.clone(),
                        client_key_sha256: key.clone(),
                        mailbox: mailbox.clone(),
                        tunnels: tunnels.clone(),
                        carrier,
                        established: std::time::SystemTime::now(),
                    };
                    work.push(Box::pin(open_session(shared.clone(), handle, hello)));
                }
                HubEvent::StatusReported {
                    uid,
                    generation,
                    seq,
                    status_json,
                } => {
                    let (shared, cluster, reporter) =
                        (shared.clone(), cluster.clone(), mailbox.clone());
                    work.push(Box::pin(async move {
                        let Some(name) = shared.desired.owned_by(&cluster, &uid).await else {
                            // Not a work of the cluster: the compliance of one of its policies?
                            let Some((namespace, name)) = shared.policies.reaching(&cluster, &uid).await else {
                                warn!(uid = %uid, "status for neither a work nor a policy of this cluster; ignored");
                                return Done::Nothing;
                            };
                            debug!(policy = %format!("{namespace}/{name}"), generation, seq, "policy compliance reported");
                            if let Err(e) = shared.compliance.submit(
                                &reporter,
                                &cluster,
                                (&namespace, &name),
                                &uid,
                                generation,
                                seq,
                                &status_json,
                            ) {
                                warn!(error = %error_chain(&e), "compliance refused");
                            }
                            return Done::Nothing;
                        };
                        debug!(work = %name, generation, seq, "status reported");
                        if let Err(e) = shared
                            .statuses
                            .submit(&reporter, &cluster, &name, &uid, seq, &status_json)
                            .await
                        {
                            warn!(error = %error_chain(&e), "status refused");
                        }
                        Done::Nothing
                    }));
                }
                HubEvent::WorkAcked {
                    uid,
                    generation,
                    current,
                } => {
                    debug!(work_uid = %uid, generation, current, "work durable on the agent");
                    if current {
                        // From now on its deletion waits for the agent's release: once per
                        // work, as the cached work shows the finalizer after the first.
                        let (shared, cluster) = (shared.clone(), cluster.clone());
                        work.push(Box::pin(async move {
                            if let Some(name) =
                                shared.desired.lacks_cleanup_finalizer(&cluster, &uid).await
                            {
                                shared.finalizers.hold(&cluster, &name, &uid);
                            }
                            Done::Nothing
                        }));
                    }
                }
                HubEvent::WorkReleased { uid } => {
                    debug!(work_uid = %uid, "work released by the agent");
                    let (shared, cluster, reporter) =
                        (shared.clone(), cluster.clone(), mailbox.clone());
                    work.push(Box::pin(async move {
                        // A work's release takes its cleanup finalizer; anything else may be a
                        // policy's, whose compliance entry goes (the compliance writer hands
                        // what is not a policy's to the finalizers).
                        if shared.desired.owned_by(&cluster, &uid).await.is_some() {
                            shared.finalizers.release(&cluster, &uid, Some(&reporter));
                        } else {
                            shared.compliance.release(&cluster, &uid, &reporter);
                        }
                        Done::Nothing
                    }));
                }
                HubEvent::RenewalRequested { csr_pem } => match &shared.certificates {
                    None => machine.refuse_renewal(
                        "this gateway cannot issue certificates; renew through the hub",
                    ),
                    Some(certs) => {
                        let (certs, cluster, key) = (certs.clone(), cluster.clone(), key.clone());
                        work.push(Box::pin(async move {
                            Done::Renewed(certs.renew(&cluster, &key, &csr_pem).await)
                        }));
                    }
                },
                HubEvent::ClusterInfoReported { info } => {
                    // Off the loop: the health task's buffer may be full in a storm.
                    let (shared, cluster) = (shared.clone(), cluster.clone());
                    work.push(Box::pin(async move {
                        shared
                            .health
                            .send(HealthReport::ClusterInfo {
                                cluster,
                                info: Box::new(info),
                            })
                            .await;
                        Done::Nothing
                    }));
                }
                HubEvent::Closed { reason, by_peer } => {
                    info!(%reason, by_peer, "session closed");
                    closed_at = Some(Instant::now());
                }
                HubEvent::ChunkRequested { uid, chunk_sha256 } => {
                    let now = Instant::now();
                    let at = next_chunk_at.max(now);
                    next_chunk_at = at
                        + Duration::from_secs_f64(
                            CHUNK_BYTES as f64 / config.chunk_bytes_per_second.max(1) as f64,
                        );
                    work.push(Box::pin(read_chunk(
                        shared.clone(),
                        cluster.clone(),
                        uid,
                        chunk_sha256,
                        at,
                    )));
                }
                HubEvent::Alive { .. } => {}
            }
        }
        if next.is_none() {
            next = machine.poll_transmit();
        }
        if machine.is_closed() {
            let gave_up = closed_at.is_some_and(|t| t.elapsed() >= FINAL_FLUSH);
            if next.is_none() || gave_up {
                break;
            }
        }
        if *draining.borrow_and_update() && !drained {
            drained = true;
            machine.drain(spread, "gateway shutting down");
            continue;
        }
        let deadline = match closed_at {
            Some(t) => Some(t + FINAL_FLUSH),
            None => machine.poll_timeout(),
        };
        tokio::select! {
            permit = outbound.reserve(), if next.is_some() => match permit {
                Ok(permit) => permit.send(next.take().expect("checked above")),
                Err(_) => {
                    next = None;
                    machine.close("the agent's stream is gone");
                }
            },
            frame = inbound.next(), if !machine.is_closed() => match frame {
                Some(Ok(frame)) => {
                    // An error has already closed the session (Goodbye queued, Closed emitted).
                    if let Err(e) = machine.handle_frame(Instant::now(), frame) {
                        warn!(error = %e, "protocol error");
                    }
                }
                Some(Err(e)) => {
                    warn!(error = %e, "closing session");
                    machine.close(describe(&e));
                }
                None => machine.close("agent closed the stream"),
            },
            _ = sleep_until(deadline) => machine.handle_timeout(Instant::now()),
            Some(done) = work.next(), if !work.is_empty() => match done {
                Done::Synced { snapshot, reconnect } => {
                    if reconnect {
                        shared.metrics.reconnected();
                    }
                    open.get_or_insert_with(|| OpenSession::new(sessions.clone()));
                    machine.begin_sync(snapshot);
                }
                Done::Refused(refusal) => {
                    warn!(reason = %refusal, "session refused");
                    shared.metrics.refused(refusal.refusal());
                    machine.refuse(refusal.refusal(), refusal.to_string());
                }
                Done::Redirected { retry_after, redirect, reason } => {
                    info!(?retry_after, redirect = ?redirect, %reason, "session redirected");
                    machine.redirect(retry_after, redirect, reason);
                }
                Done::Renewed(Ok(renewed)) => {
                    info!("client certificate renewed over the session");
                    machine.issue_certificate(renewed.certificate_pem, renewed.ca_bundle_pem);
                }
                Done::Renewed(Err(e)) => {
                    warn!(error = %e, "certificate renewal refused");
                    machine.refuse_renewal(e.to_string());
                }
                Done::Chunk { uid, chunk_sha256, read: Ok(data) } => {
                    shared.metrics.chunk_bytes_sent.inc_by(data.len() as u64);
                    machine.send_chunk(uid, &chunk_sha256, data);
                }
                Done::Chunk { uid, chunk_sha256, read: Err(unserved) } => {
                    warn!(work_uid = %uid, chunk = %chunk_sha256, reason = %error_chain(&unserved), "chunk not served");
                    machine.refuse_chunk(uid, &chunk_sha256, unserved.to_string());
                }
                Done::Nothing => {}
            },
            _ = mailbox.ready() => {
                let delivery = mailbox.take();
                for change in delivery.works {
                    match change {
                        WorkChange::Upsert(work) => machine.upsert_work(work),
                        WorkChange::Delete { uid, namespace, name } => machine.delete_work(uid, namespace, name),
                    }
                }
                for (uid, seq) in delivery.status_acks {
                    machine.ack_status(uid, seq);
                }
                for uid in delivery.release_acks {
                    machine.ack_release(uid);
                }
                for id in delivery.open_tunnels {
                    machine.open_tunnel(id);
                }
                if let Some(bundle) = delivery.trust_bundle {
                    machine.send_trust_bundle(bundle);
                }
                match delivery.close {
                    Some(Closing::Close(reason)) => machine.close(reason),
                    Some(Closing::Refuse(refusal, reason)) => {
                        shared.metrics.refused(refusal);
                        machine.refuse(refusal, reason);
                    }
                    Some(Closing::Drain { retry_after, redirect, reason }) => {
                        info!(?retry_after, redirect = ?redirect, %reason, "draining the session: its shard is not this gateway's");
                        machine.redirect(retry_after, redirect, reason);
                    }
                    None => {}
                }
            }
            _ = draining.changed(), if !drained => {}
        }
    }
    drop(outbound);
    drop(open);
    // The session's unfinished work goes first: a future nobody polls any more must not keep
    // what it was waiting for (a channel slot, a write's turn) from everyone else.
    drop(work);
    if established {
        shared.registry.unregister(&cluster, &session_id);
        shared
            .health
            .send(HealthReport::Disconnected {
                cluster,
                session: session_id,
            })
            .await;
    }
}

/// Admission, registration and the sync snapshot, off the driver's loop: the snapshot is taken
/// after registering, so a change that lands in between reaches the mailbox, and the machine
/// treats it as newer than the snapshot.
async fn open_session(shared: Arc<Shared>, handle: SessionHandle, hello: wire::Hello) -> Done {
    let cluster = handle.cluster.clone();
    // The check waits for the shard's clusters to load; a shard handed over or lost meanwhile
    // never loads here, and a session not registered yet is in no registry a drain walks.
    let checked = unless_moved(
        &shared,
        &cluster,
        &handle.session_id,
        shared
            .admissions
            .check_or_read(shared.store.as_ref(), &cluster, &handle.client_key_sha256),
    )
    .await;
    match checked {
        Err(elsewhere) => return elsewhere,
        Ok(Err(refusal)) => return Done::Refused(refusal),
        Ok(Ok(())) => {}
    }
    let (session, key) = (handle.session_id.clone(), handle.client_key_sha256.clone());
    let mut had_one = shared.registry.departed(&cluster).is_some();
    if let Some(older) = shared.registry.register(&cluster, handle) {
        had_one = true;
        info!(older = %older.session_id, "replacing the cluster's older session");
        older
            .mailbox
            .close("replaced by a newer session of the same cluster");
    }
    // A revocation (or the shard moving away) between the checks above and the registration
    // found no session to close: look again now that it is registered.
    if let Err(refusal) = shared
        .admissions
        .check_or_read(shared.store.as_ref(), &cluster, &key)
        .await
    {
        return Done::Refused(refusal);
    }
    if let Some(elsewhere) = not_here(&shared, &cluster, &session) {
        shared.registry.unregister(&cluster, &session);
        return elsewhere;
    }
    // Works the agent holds are deleted over the sync, and those it is removing it releases
    // itself; any other work of the cluster held by its cleanup finalizer is one the agent has
    // nothing of (its cache was lost, or its release ack was): nothing is left to wait for.
    let terminating = shared.desired.terminating(&cluster).await;
    let unknown: Vec<String> = {
        let known: HashSet<&str> = hello
            .held
            .iter()
            .map(|h| h.uid.as_str())
            .chain(hello.releasing.iter().map(String::as_str))
            .collect();
        terminating
            .into_iter()
            .filter(|uid| !known.contains(uid.as_str()))
            .collect()
    };
    for uid in unknown {
        debug!(work_uid = %uid, "deleted work the agent does not hold: released");
        shared.finalizers.release(&cluster, &uid, None);
    }
    shared.desired.wait_loaded(&cluster).await;
    let mut snapshot = shared.desired.snapshot(&cluster);
    snapshot.extend(shared.policies.snapshot(&cluster).await);
    let held: Vec<&str> = hello.held.iter().map(|h| h.uid.as_str()).collect();
    if let Err(e) = keep_unseen_works(&shared, &cluster, &held, &mut snapshot).await {
        warn!(error = %error_chain(&e), "cannot confirm which of the cluster's works are gone: the session waits");
        shared.registry.unregister(&cluster, &session);
        return Done::Redirected {
            retry_after: spread_over(shared.config.drain_window, &session),
            redirect: None,
            reason: format!(
                "the gateway cannot read cluster {cluster}'s works from the hub now ({e}); try again"
            ),
        };
    }
    shared
        .health
        .send(HealthReport::Connected {
            cluster: cluster.clone(),
            session,
            hello: Box::new(hello),
        })
        .await;
    Done::Synced {
        snapshot,
        reconnect: had_one,
    }
}

/// The sync tells the agent to delete every work it holds that `snapshot` lacks. The cache
/// holds only works labelled with this gateway's shards, so before that the store is asked
/// about the works the agent holds and the cache does not show (one list of the cluster's
/// namespace, only when there are some: a work deleted while the agent was away, or one whose
/// shard label is missing or stale, e.g. stored before an upgrade or a change of `--shards`,
/// until the hub's labeller corrects it). A work the store still has, not being deleted, is
/// delivered from the store instead of deleted.
async fn keep_unseen_works(
    shared: &Shared,
    cluster: &str,
    held: &[&str],
    snapshot: &mut Vec<DesiredWork>,
) -> Result<(), flotilla_store::StoreError> {
    let terminating = shared.desired.terminating(cluster).await;
    let shown: HashSet<&str> = snapshot
        .iter()
        .map(|w| w.uid.as_str())
        .chain(terminating.iter().map(String::as_str))
        .collect();
    let unseen: HashSet<&str> = held
        .iter()
        .copied()
        .filter(|uid| !shown.contains(uid))
        .collect();
    if unseen.is_empty() {
        return Ok(());
    }
    let stored = shared
        .store
        .list(flotilla_proto::api::Kind::ManifestWork, Some(cluster))
        .await?;
    for obj in stored.items {
        let meta = &obj["metadata"];
        let uid = meta["uid"].as_str().unwrap_or_default();
        if !unseen.contains(uid) || !meta["deletionTimestamp"].is_null() {
            continue;
        }
        warn!(
            work = meta["name"].as_str().unwrap_or_default(),
            label = %meta["labels"][flotilla_proto::contract::SHARD_LABEL],
            "a work the agent holds is not in this gateway's cache (its shard label is missing or stale; the hub's labeller corrects it): delivered from the store, not deleted"
        );
        if let Some(work) = crate::desired::desired_work(obj) {
            snapshot.push(work);
        }
    }
    Ok(())
}

/// Reads one chunk of a large work for `cluster`'s agent, no sooner than `at` (the session's
/// pace), from the cluster's own namespace, once its work is known to name it.
async fn read_chunk(
    shared: Arc<Shared>,
    cluster: String,
    uid: String,
    chunk_sha256: String,
    at: Instant,
) -> Done {
    tokio::time::sleep_until(at).await;
    let read = if !shared
        .desired
        .names_chunk(&cluster, &uid, &chunk_sha256)
        .await
    {
        Err(ChunkUnserved::NotNamed {
            cluster,
            uid: uid.clone(),
            chunk_sha256: chunk_sha256.clone(),
        })
    } else {
        let name = chunk_object_name(&chunk_sha256);
        match shared
            .store
            .get(Kind::ManifestChunk, Some(&cluster), &name)
            .await
        {
            Ok(Some(object)) => {
                chunk_data(object, &chunk_sha256).map_err(|problem| ChunkUnserved::Damaged {
                    cluster,
                    name,
                    problem,
                })
            }
            Ok(None) => Err(ChunkUnserved::NotStored { cluster, name }),
            Err(source) => Err(ChunkUnserved::Unreadable {
                cluster,
                name,
                source,
            }),
        }
    };
    Done::Chunk {
        uid,
        chunk_sha256,
        read,
    }
}

/// Why a chunk the agent asked for is not sent. The text is the refusal the agent sees, which
/// names the chunk and the fix; the agent asks again after a delay whatever the reason.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ChunkUnserved {
    /// No work of the session's cluster with that uid names the chunk. Not retryable: the
    /// agent asked for what is not its cluster's (or the work has changed since).
    #[error("no ManifestWork of cluster {cluster} with uid {uid} names chunk {chunk_sha256}")]
    NotNamed {
        cluster: String,
        uid: String,
        chunk_sha256: String,
    },
    /// The work names a chunk that is not stored. Not retryable until the work is stored again.
    #[error(
        "ManifestChunk {cluster}/{name} is not stored; re-create the work with `flotilla work create -f`"
    )]
    NotStored { cluster: String, name: String },
    /// The stored chunk's data is missing, malformed or not of its digest. Not retryable until
    /// the work is stored again.
    #[error(
        "ManifestChunk {cluster}/{name} {problem}; re-create the work with `flotilla work create -f`"
    )]
    Damaged {
        cluster: String,
        name: String,
        problem: String,
    },
    /// The store could not be read. Retryable: the agent asks again after a delay.
    #[error("cannot read ManifestChunk {cluster}/{name}: {source}")]
    Unreadable {
        cluster: String,
        name: String,
        #[source]
        source: StoreError,
    },
}

/// `step`'s answer, unless `cluster`'s shard stops being this gateway's before it comes (looked
/// at now and at every change of the shard view): then where to send the session instead.
async fn unless_moved<T>(
    shared: &Shared,
    cluster: &str,
    session_id: &str,
    step: impl std::future::Future<Output = T>,
) -> Result<T, Done> {
    let mut views = shared.shards.subscribe();
    tokio::pin!(step);
    loop {
        if let Some(elsewhere) = not_here(shared, cluster, session_id) {
            return Err(elsewhere);
        }
        tokio::select! {
            answer = &mut step => return Ok(answer),
            changed = views.changed() => if changed.is_err() {
                return Ok(step.await);
            },
        }
    }
}

/// Where to send a session whose cluster's shard this gateway does not act for: to the owner
/// at once, or (no owner reachable: a handover or takeover under way) back after a spread
/// delay. `None` when the shard is this gateway's.
fn not_here(shared: &Shared, cluster: &str, session_id: &str) -> Option<Done> {
    let route = shared.shards.borrow().route(cluster, Instant::now());
    match route {
        Route::Here { .. } => None,
        Route::Elsewhere {
            shard,
            owner,
            address,
        } => Some(Done::Redirected {
            retry_after: Duration::ZERO,
            redirect: Some(address),
            reason: format!("shard {shard} of cluster {cluster} is held by gateway {owner}"),
        }),
        Route::Unowned { shard } => Some(Done::Redirected {
            retry_after: spread_over(shared.config.drain_window, session_id),
            redirect: None,
            reason: format!(
                "shard {shard} of cluster {cluster} has no gateway yet (handover under way)"
            ),
        }),
    }
}

/// A link failure as the session's close reason.
fn describe(e: &LinkError) -> String {
    e.to_string()
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::shards::{DirectoryEntry, Fence, ShardDirectory, ShardView};
    use crate::{Gateway, GatewayConfig};
    use flotilla_proto::contract::shard_of;

    const CLUSTER: &str = "store-7";

    /// A session admitted while its shard was here waits for the shard's clusters to load; a
    /// shard handed over before that never loads here, and the session, not registered yet,
    /// is in no registry a drain walks. It is sent to the new owner instead of waiting for
    /// ever (an agent held there had a session the shard's owner knew nothing of: marked
    /// Unknown, sent nothing).
    #[tokio::test(start_paused = true)]
    async fn a_session_waiting_for_its_shard_is_sent_on_when_the_shard_moves() {
        let dir = tempfile::tempdir().unwrap();
        let store = flotilla_store::SledStore::open(dir.path().join("store")).unwrap();
        let gateway = Gateway::new(Arc::new(store), GatewayConfig::default());
        let shard = shard_of(CLUSTER, 64);
        let fence = Fence {
            epoch: 1,
            valid_until: Instant::now() + Duration::from_secs(3600),
        };
        gateway.set_shard_view(ShardView::leased(
            64,
            [(shard, fence)].into(),
            ShardDirectory::default(),
        ));
        let shared = gateway.shared().clone();
        let waiting = tokio::spawn(async move {
            unless_moved(&shared, CLUSTER, "s-1", std::future::pending::<()>()).await
        });
        tokio::task::yield_now().await;
        let elsewhere = ShardDirectory::new(
            64,
            [(
                shard,
                DirectoryEntry {
                    owner: "gw-2".into(),
                    address: Some("10.0.0.2:9443".into()),
                    epoch: 2,
                },
            )]
            .into(),
        );
        gateway.set_shard_view(ShardView::leased(64, BTreeMap::new(), elsewhere));
        let answer = tokio::time::timeout(Duration::from_secs(30), waiting)
            .await
            .expect("the session is not left waiting for a shard that moved")
            .unwrap();
        match answer {
            Err(Done::Redirected { redirect, .. }) => {
                assert_eq!(redirect.as_deref(), Some("10.0.0.2:9443"))
            }
            Err(_) => panic!("sent elsewhere, but not to the shard's owner"),
            Ok(()) => panic!("a pending step cannot answer"),
        }
    }
}
