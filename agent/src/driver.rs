//! One session of the agent, from dial to end, on whichever carrier the dialer chose: read a
//! frame, feed the protocol machine, write what it emits when the link has room, arm the timer
//! it asks for. Work on the disk (the durable cache, the identity files) runs beside the loop
//! and comes back as events, in order where order matters: desired works go into the cache one
//! at a time, and only once durable are they acked and handed to the reconciler; statuses come
//! out of the cache's outbox and stay there until the hub acks them.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::{Duration, SystemTime};

use flotilla_proto::api::ManifestWork;
use flotilla_proto::api::content::ContentRef;
use flotilla_proto::session::{
    AgentConfig as SessionConfig, AgentEvent, AgentSession, DEFAULT_WELCOME_TIMEOUT,
};
use flotilla_proto::wire::{self, AgentFrame};
use flotilla_transport::{Dialed, Link};
use futures::StreamExt as _;
use futures::future::BoxFuture;
use futures::stream::FuturesUnordered;
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use crate::cache::{CachedWork, MAX_MANIFEST_WORK_BYTES, durably};
use crate::config::AgentConfig;
use crate::connect::Dialer;
use crate::identity::Identity;
use crate::refusal::Refusal;
use crate::session::Spoke;

/// How long a session waits for the spoke's version before saying hello without it.
const VERSION_WAIT: Duration = Duration::from_secs(2);
/// How long a closing session may take to hand its goodbye to a hub that stopped reading.
const FINAL_FLUSH: Duration = Duration::from_secs(2);

/// How one session ended, which decides the next delay.
pub(crate) enum Ended {
    /// The hub asked us to come back later (it is draining), at `redirect` if it named the
    /// gateway that owns this cluster's shard.
    Drained {
        retry_after: Duration,
        redirect: Option<String>,
    },
    /// The dial failed, the hub refused, or the session closed; back off.
    Lost {
        refusal: Refusal,
        /// Whether the session got as far as Welcome.
        established: bool,
    },
    /// Our own shutdown.
    Shutdown,
}

/// One session from dial to end. `established_at` is set when the hub welcomes it.
pub(crate) async fn session_once(
    dialer: &Dialer,
    config: &AgentConfig,
    spoke: &Spoke,
    mut stop: watch::Receiver<bool>,
    established_at: &mut Option<Instant>,
) -> Ended {
    // Tell the hub what we hold so it sends only what differs. If the cache cannot say, an
    // empty list is safe: the hub then sends everything, and storing is idempotent.
    let held = durably(&spoke.cache, |c| c.held())
        .await
        .unwrap_or_else(|e| {
            warn!(error = %e, "cannot list the cached works; asking the hub for all of them");
            Vec::new()
        });
    // And what we are still removing, so the hub keeps those works' cleanup finalizers. If the
    // cache cannot say, the hub may let them go early; their resources are still removed here.
    let releasing = durably(&spoke.cache, |c| c.releasing())
        .await
        .unwrap_or_else(|e| {
            warn!(error = %e, "cannot list the works being removed; the hub is not told of them");
            Vec::new()
        });
    let identity = Identity::new(config.identity_dir());
    let mut version = spoke.kubernetes_version.clone();
    let _ = tokio::time::timeout(VERSION_WAIT, version.wait_for(|v| !v.is_empty())).await;
    let kubernetes_version = version.borrow().clone();
    let mut cluster_info = spoke.cluster_info.clone();
    let claims = cluster_info.borrow_and_update().claims.clone();
    let mut machine = AgentSession::new(
        Instant::now(),
        SessionConfig {
            cluster_name: config.cluster_name.clone(),
            agent_version: env!("CARGO_PKG_VERSION").to_string(),
            kubernetes_version,
            claims,
            welcome_timeout: DEFAULT_WELCOME_TIMEOUT,
        },
        held,
    )
    .with_ca_bundle_sha256(identity.ca_bundle_sha256())
    .with_releasing(releasing);
    match identity.validity() {
        Ok((not_before, not_after)) => machine.set_certificate_validity(
            Instant::now(),
            SystemTime::now(),
            not_before,
            not_after,
        ),
        Err(e) => warn!(error = %e, "cannot read the certificate's validity; not renewing"),
    }
    let hello = machine
        .poll_transmit()
        .expect("a new session starts with its hello");
    spoke.observer.frame_sent(&hello);
    let dialed = tokio::select! {
        dialed = dialer.connect(hello) => dialed,
        _ = stop.wait_for(|s| *s) => return Ended::Shutdown,
    };
    let Dialed {
        link,
        pump,
        tunnels,
    } = match dialed {
        Ok(d) => d,
        Err(e) => {
            return Ended::Lost {
                refusal: Refusal::from_link(dialer.hub(), &e),
                established: false,
            };
        }
    };
    let Link {
        mut inbound,
        outbound,
        carrier,
    } = link;
    let mut pump = pump;
    // Over QUIC the gateway opens tunnel streams on this connection itself.
    spoke.tunnels.session(&tunnels);
    let mut cache = CacheQueue::default();
    let mut work: FuturesUnordered<BoxFuture<'static, Done>> = FuturesUnordered::new();
    // Large works whose chunks are being fetched, by uid: stored (and acked) once all are held.
    let mut fetching: HashMap<String, Fetching> = HashMap::new();
    // The latest large work received per uid, as a number that grows with every work frame:
    // a transfer recorded for an older one (replaced or deleted since) is not started.
    let mut frames = 0u64;
    let mut latest_large: HashMap<String, u64> = HashMap::new();
    // Works the hub sent in this session: after the sync, a transfer recorded for any other
    // (one cut off before a restart, whose work the hub deleted meanwhile) is given up.
    let mut received: std::collections::HashSet<String> = std::collections::HashSet::new();
    let mut reported: HashMap<String, u64> = HashMap::new();
    // Releases sent on this session and not acked yet: each is sent once per session.
    let mut released: HashSet<String> = HashSet::new();
    let mut next: Option<AgentFrame> = None;
    let mut drained = None;
    // When the way out broke, and why. The hub may have ended the session with a goodbye
    // (a drain with a redirect, a refusal) that is still on the way in: it is read first,
    // within FINAL_FLUSH, before the session closes for the broken writer.
    let mut writer_gone: Option<(Instant, &'static str)> = None;
    let mut last_close = None;
    let mut closed_at: Option<Instant> = None;
    let mut shutting_down = false;
    // Shows the session established in the gauges until this function returns.
    let mut _connected = None;

    loop {
        while let Some(event) = machine.poll_event() {
            match event {
                AgentEvent::Established { session_id, .. } => {
                    *established_at = Some(Instant::now());
                    info!(session = %session_id, %carrier, "session established");
                    spoke.observer.session_established();
                    _connected = Some(spoke.metrics.connected(carrier));
                    report_outbox(&mut machine, spoke, &mut reported);
                    report_releases(&mut machine, spoke, &mut released);
                    report_cluster_info(&mut machine, &mut cluster_info);
                }
                AgentEvent::WorkReceived { work: update } => {
                    frames += 1;
                    received.insert(update.uid.clone());
                    fetching.remove(&update.uid);
                    match content_of(&update) {
                        // A large work: its chunks first, then the work, so what is acked is
                        // whole. The transfer is recorded in the cache's order of operations.
                        Some(reference) => {
                            latest_large.insert(update.uid.clone(), frames);
                            cache.push(CacheOp::Fetch {
                                work: update,
                                reference,
                                frame: frames,
                            });
                        }
                        None => {
                            latest_large.remove(&update.uid);
                            cache.push(CacheOp::Store(update));
                        }
                    }
                }
                AgentEvent::ChunkReceived { chunk_sha256, data } => {
                    spoke.metrics.chunk_bytes_received.inc_by(data.len() as u64);
                    let cache = spoke.cache.clone();
                    work.push(Box::pin(async move {
                        let sha = chunk_sha256.clone();
                        let stored = durably(&cache, move |c| {
                            if !c.put_chunk(&sha, &data)? {
                                return Ok(None);
                            }
                            c.chunk_totals().map(Some)
                        })
                        .await;
                        Done::ChunkStored {
                            chunk_sha256,
                            stored: stored.map_err(|e| e.to_string()),
                        }
                    }));
                }
                AgentEvent::ChunkRefused {
                    uid,
                    chunk_sha256,
                    reason,
                } => {
                    if let Some(pending) = fetching.remove(&uid) {
                        warn!(work = %format!("{}/{}", pending.work.namespace, pending.work.name), chunk = %chunk_sha256, %reason,
                            "the hub cannot serve a chunk of the work's content; asking again on the next session");
                    }
                }
                AgentEvent::WorkDeleted {
                    uid,
                    namespace,
                    name,
                } => {
                    frames += 1;
                    received.remove(&uid);
                    latest_large.remove(&uid);
                    // Content still being fetched is for a work that is gone now.
                    fetching.remove(&uid);
                    cache.push(CacheOp::Delete {
                        uid,
                        namespace,
                        name,
                    });
                }
                AgentEvent::ReleaseAcked { uid } => {
                    released.remove(&uid);
                    cache.push(CacheOp::AckRelease { uid });
                }
                AgentEvent::StatusAcked { uid, seq } => {
                    spoke.observer.status_acked(&uid, seq);
                    cache.push(CacheOp::AckStatus { uid, seq });
                }
                AgentEvent::RenewalDue => {
                    let (identity, cluster) = (identity.clone(), config.cluster_name.clone());
                    work.push(Box::pin(async move {
                        let made =
                            tokio::task::spawn_blocking(move || identity.renewal_request(&cluster))
                                .await;
                        Done::Request(match made {
                            Ok(Ok(csr)) => Ok(csr),
                            Ok(Err(e)) => Err(e.to_string()),
                            Err(e) => Err(e.to_string()),
                        })
                    }));
                }
                AgentEvent::CertificateIssued {
                    certificate_pem,
                    ca_bundle_pem,
                } => {
                    let identity = identity.clone();
                    work.push(Box::pin(async move {
                        let stored = tokio::task::spawn_blocking(move || {
                            identity.complete_renewal(&certificate_pem, &ca_bundle_pem)?;
                            identity.validity()
                        })
                        .await;
                        Done::Stored(match stored {
                            Ok(Ok(validity)) => Ok(validity),
                            Ok(Err(e)) => Err(e.to_string()),
                            Err(e) => Err(e.to_string()),
                        })
                    }));
                }
                AgentEvent::RenewalRefused { reason } => {
                    warn!(%reason, "the hub refused to renew the certificate; asking again later");
                }
                AgentEvent::TrustBundleUpdated { ca_bundle_pem } => {
                    let identity = identity.clone();
                    work.push(Box::pin(async move {
                        let stored = tokio::task::spawn_blocking(move || {
                            identity.update_ca_bundle(&ca_bundle_pem)
                        })
                        .await;
                        match stored {
                            Ok(Ok(())) => info!(
                                "the hub's CA bundle changed (CA rotation); stored for the next connection"
                            ),
                            Ok(Err(e)) => warn!(error = %e, "cannot store the hub's new CA bundle"),
                            Err(e) => warn!(error = %e, "cannot store the hub's new CA bundle"),
                        }
                        Done::Nothing
                    }));
                }
                AgentEvent::TunnelRequested { id } => {
                    debug!(tunnel = %id, "tunnel requested");
                    spoke.tunnels.requested(&tunnels, id);
                }
                AgentEvent::Synced { sent } => {
                    info!(sent, "in sync with the hub");
                    cache.push(CacheOp::EndFetches {
                        keep: received.iter().cloned().collect(),
                    });
                }
                AgentEvent::Drained {
                    retry_after,
                    redirect,
                    ..
                } => drained = Some((retry_after, redirect)),
                AgentEvent::Closed { reason, .. } => {
                    closed_at = Some(Instant::now());
                    last_close = Some(reason);
                }
            }
        }
        if next.is_none() {
            next = machine.poll_transmit();
            if let Some(frame) = &next {
                spoke.observer.frame_sent(frame);
            }
        }
        if machine.is_closed() {
            let gave_up = closed_at.is_some_and(|t| t.elapsed() >= FINAL_FLUSH);
            if next.is_none() || gave_up || writer_gone.is_some() {
                break;
            }
        }
        if let Some((since, why)) = writer_gone
            && !machine.is_closed()
            && since.elapsed() >= FINAL_FLUSH
        {
            machine.close(why);
            continue;
        }
        let deadline = match (closed_at, writer_gone) {
            (Some(t), _) => Some(t + FINAL_FLUSH),
            (None, Some((since, _))) => Some(since + FINAL_FLUSH),
            (None, None) => machine.poll_timeout(),
        };
        let established = machine.is_established();
        tokio::select! {
            permit = outbound.reserve(), if next.is_some() && writer_gone.is_none() => match permit {
                Ok(permit) => permit.send(next.take().expect("checked above")),
                Err(_) => writer_gone = Some((Instant::now(), "the hub's stream is gone")),
            },
            frame = inbound.next(), if !machine.is_closed() => match frame {
                Some(Ok(frame)) => {
                    spoke.observer.frame_received(&frame);
                    // An error has already closed the session; the log says why.
                    if let Err(e) = machine.handle_frame(Instant::now(), frame) {
                        warn!(error = %e, "protocol error from the hub");
                    }
                }
                Some(Err(e)) => machine.close(format!("the connection to the hub failed: {e}")),
                None => machine.close("the hub ended the stream without a goodbye"),
            },
            _ = sleep_until(deadline) => machine.handle_timeout(Instant::now()),
            done = cache.next(spoke), if cache.is_busy() => {
                if let Some(ack) = done.ack(spoke) {
                    machine.ack_work(ack.0, ack.1);
                }
                match done {
                    CacheDone::StatusAcked { uid, acked: true } => {
                        reported.remove(&uid);
                    }
                    CacheDone::Fetch { work: update, reference, frame, missing } => {
                        let name = format!("{}/{}", update.namespace, update.name);
                        match missing {
                            // Replaced or deleted since: the newer frame's operation decides.
                            _ if latest_large.get(&update.uid) != Some(&frame) => {
                                debug!(work = %name, "content no longer wanted");
                            }
                            Ok(missing) if missing.is_empty() => {
                                latest_large.remove(&update.uid);
                                debug!(work = %name, content = %reference.sha256, "content already held");
                                cache.push(CacheOp::Store(update));
                            }
                            Ok(missing) => {
                                latest_large.remove(&update.uid);
                                let need: u64 = reference.chunks.iter().enumerate()
                                    .filter(|(_, c)| missing.contains(c))
                                    .map(|(i, _)| reference.chunk_len(i))
                                    .sum();
                                info!(work = %name, content = %reference.sha256, need_chunks = missing.len(),
                                    chunks = reference.chunks.len(), need_bytes = need, content_bytes = reference.bytes,
                                    "fetching content");
                                machine.fetch_chunks(&update.uid, missing.iter().cloned());
                                fetching.insert(update.uid.clone(), Fetching { work: update, missing: missing.into_iter().collect() });
                            }
                            Err(e) => {
                                warn!(work = %name, error = %e, "cannot record the content's transfer; the hub resends the work next session");
                            }
                        }
                    }
                    _ => {}
                }
            }
            Some(done) = work.next(), if !work.is_empty() => match done {
                Done::Request(Ok(csr)) => {
                    if machine.renew_certificate(csr) {
                        info!("asking the hub for a new client certificate over the session");
                    }
                }
                Done::Request(Err(e)) => {
                    warn!(error = %e, "cannot make a renewal request; trying again later");
                    machine.renewal_failed(Instant::now());
                }
                Done::Stored(Ok((not_before, not_after))) => {
                    info!("client certificate renewed; the next connection uses it, this session carries on");
                    machine.set_certificate_validity(Instant::now(), SystemTime::now(), not_before, not_after);
                }
                Done::Stored(Err(e)) => {
                    warn!(error = %e, "cannot store the renewed certificate; asking again later");
                    machine.renewal_failed(Instant::now());
                }
                Done::ChunkStored { chunk_sha256, stored: Ok(None) } => {
                    debug!(chunk = %chunk_sha256, "a chunk no work or transfer names any more arrived; dropped");
                }
                Done::ChunkStored { chunk_sha256, stored: Ok(Some((count, bytes))) } => {
                    spoke.metrics.chunks_held.set(count as i64);
                    spoke.metrics.chunk_bytes_held.set(bytes as i64);
                    let mut complete = Vec::new();
                    for (uid, pending) in &mut fetching {
                        pending.missing.remove(&chunk_sha256);
                        if pending.missing.is_empty() {
                            complete.push(uid.clone());
                        }
                    }
                    for uid in complete {
                        if let Some(done) = fetching.remove(&uid) {
                            info!(uid = %uid, "content complete");
                            cache.push(CacheOp::Store(done.work));
                        }
                    }
                }
                Done::ChunkStored { chunk_sha256, stored: Err(e) } => {
                    warn!(chunk = %chunk_sha256, error = %e, "cannot store a chunk; the hub resends the work next session");
                }
                Done::Nothing => {}
            },
            // Only once established: until then a status has nowhere to go, and the wake-up
            // stays stored for later.
            _ = spoke.outbox_changed.notified(), if established => {
                report_outbox(&mut machine, spoke, &mut reported);
                report_releases(&mut machine, spoke, &mut released);
            }
            // A claim, node or version changed on the spoke.
            Ok(()) = cluster_info.changed(), if established => {
                report_cluster_info(&mut machine, &mut cluster_info);
            }
            _ = async { pump.as_mut().expect("checked").await }, if pump.is_some() => {
                // The carrier's writer ended: the connection is going.
                pump = None;
                writer_gone.get_or_insert((Instant::now(), "the connection to the hub ended"));
            }
            _ = stop.wait_for(|s| *s), if !shutting_down => {
                shutting_down = true;
                machine.close("agent shutting down");
            }
        }
    }
    drop(outbound);
    if let Some(pump) = pump {
        let _ = tokio::time::timeout(FINAL_FLUSH, pump).await;
    }
    // Durable work that was under way finishes, and the hub's status acks are recorded; works
    // still queued are redone on the next session (the hub resends what was not acked).
    cache.finish(spoke).await;
    if shutting_down {
        return Ended::Shutdown;
    }
    match drained {
        Some((retry_after, redirect)) => Ended::Drained {
            retry_after,
            redirect,
        },
        None => Ended::Lost {
            refusal: match &last_close {
                Some(reason) => Refusal::from_close(dialer.hub(), reason),
                None => Refusal::from_close(
                    dialer.hub(),
                    &flotilla_proto::session::CloseReason::Local("session ended".into()),
                ),
            },
            established: established_at.is_some(),
        },
    }
}

/// Sends what the agent knows about its spoke now, unless it knows nothing yet.
fn report_cluster_info(
    machine: &mut AgentSession,
    cluster_info: &mut watch::Receiver<wire::ClusterInfo>,
) {
    let info = cluster_info.borrow_and_update().clone();
    if info != wire::ClusterInfo::default() {
        machine.report_cluster_info(info);
    }
}

/// The result of work done beside the loop.
enum Done {
    /// A signing request for a new key, or why none could be made.
    Request(Result<String, String>),
    /// A renewed certificate is stored: its validity, or why it could not be.
    Stored(Result<(SystemTime, SystemTime), String>),
    /// A chunk is durable, with the cache's chunk count and bytes after it; `None` when it was
    /// dropped (nothing names it any more).
    ChunkStored {
        chunk_sha256: String,
        stored: Result<Option<(u64, u64)>, String>,
    },
    Nothing,
}

/// A large work waiting for its chunks.
struct Fetching {
    work: wire::WorkUpdate,
    /// Digests not stored yet.
    missing: std::collections::HashSet<String>,
}

/// The content reference of a work update, if its manifests are chunked (and the reference is
/// well formed: a malformed one is stored as is and refused by the reconciler, naming it).
fn content_of(work: &wire::WorkUpdate) -> Option<ContentRef> {
    let parsed: ManifestWork = serde_json::from_slice(&work.manifest_work_json).ok()?;
    ContentRef::of(&parsed)?.ok()
}

/// Work on the durable cache, in order.
#[derive(Debug)]
pub(crate) enum CacheOp {
    Store(wire::WorkUpdate),
    /// Records the transfer of a large work's content and finds which chunks it needs.
    Fetch {
        work: wire::WorkUpdate,
        reference: ContentRef,
        /// Which work frame asked for it (see the driver's `latest_large`).
        frame: u64,
    },
    /// Gives up the transfers of works the hub did not send in this session's sync.
    EndFetches {
        keep: Vec<String>,
    },
    Delete {
        uid: String,
        namespace: String,
        name: String,
    },
    AckStatus {
        uid: String,
        seq: u64,
    },
    AckRelease {
        uid: String,
    },
}

/// What a cache operation did.
#[derive(Debug)]
pub(crate) enum CacheDone {
    /// The work is durable at this generation (ack it); `changed` when the reconciler must look.
    Stored {
        uid: String,
        generation: i64,
        stored: Option<CachedWork>,
    },
    /// Not stored (the error is logged): not acked, so the hub sends it again.
    NotStored,
    /// A large work's transfer is recorded: which chunks it still needs.
    Fetch {
        work: wire::WorkUpdate,
        reference: ContentRef,
        frame: u64,
        missing: Result<Vec<String>, String>,
    },
    /// Transfers given up (or not: the error is logged).
    FetchesEnded,
    Deleted,
    /// The hub's release ack is recorded (or logged as not).
    ReleaseAcked,
    StatusAcked {
        uid: String,
        acked: bool,
    },
}

impl CacheDone {
    /// The ack the machine sends for it, if any; tells the observer.
    fn ack(&self, spoke: &Spoke) -> Option<(String, i64)> {
        match self {
            CacheDone::Stored {
                uid,
                generation,
                stored,
            } => {
                if let Some(work) = stored {
                    spoke.observer.work_stored(work);
                }
                Some((uid.clone(), *generation))
            }
            _ => None,
        }
    }
}

/// Cache operations run one at a time, in the order the hub's frames asked for them, off the
/// driver's loop.
#[derive(Default)]
struct CacheQueue {
    waiting: VecDeque<CacheOp>,
    running: Option<BoxFuture<'static, CacheDone>>,
}

impl CacheQueue {
    fn push(&mut self, op: CacheOp) {
        self.waiting.push_back(op);
    }

    fn is_busy(&self) -> bool {
        self.running.is_some() || !self.waiting.is_empty()
    }

    /// The next operation's result (starting it if none runs).
    async fn next(&mut self, spoke: &Spoke) -> CacheDone {
        if self.running.is_none() {
            let op = self.waiting.pop_front().expect("called only when busy");
            self.running = Some(Box::pin(run_cache_op(spoke.clone(), op)));
        }
        let done = self.running.as_mut().expect("set above").await;
        self.running = None;
        done
    }

    /// At the session's end: lets an operation already under way finish (its write is not torn
    /// off half-way), then records the status acks still queued, all within [`FINAL_FLUSH`].
    /// The hub has stored those statuses; an ack forgotten here would make the agent send them
    /// again next session. Works and deletes still queued are left: they were not acked, so
    /// the hub sends them again.
    async fn finish(&mut self, spoke: &Spoke) {
        let running = self.running.take();
        let acks: Vec<CacheOp> = self
            .waiting
            .drain(..)
            .filter(|op| matches!(op, CacheOp::AckStatus { .. } | CacheOp::AckRelease { .. }))
            .collect();
        let _ = tokio::time::timeout(FINAL_FLUSH, async {
            if let Some(running) = running {
                running.await;
            }
            for ack in acks {
                run_cache_op(spoke.clone(), ack).await;
            }
        })
        .await;
    }
}

/// Runs one cache operation.
pub(crate) async fn run_cache_op(spoke: Spoke, op: CacheOp) -> CacheDone {
    match op {
        CacheOp::Store(work) => store_work(&spoke, work).await,
        CacheOp::Fetch {
            work,
            reference,
            frame,
        } => {
            let (uid, chunks) = (work.uid.clone(), reference.chunks.clone());
            let missing = durably(&spoke.cache, move |c| c.begin_fetch(&uid, &chunks)).await;
            CacheDone::Fetch {
                work,
                reference,
                frame,
                missing: missing.map_err(|e| e.to_string()),
            }
        }
        CacheOp::EndFetches { keep } => {
            match durably(&spoke.cache, move |c| c.end_fetches(&keep)).await {
                Ok(0) => {}
                Ok(released) => {
                    info!(
                        chunks = released,
                        "released the chunks of transfers the hub no longer asks for"
                    )
                }
                Err(e) => {
                    warn!(error = %e, "cannot give up stale transfers; trying after the next sync")
                }
            }
            CacheDone::FetchesEnded
        }
        CacheOp::Delete {
            uid,
            namespace,
            name,
        } => {
            delete_work(&spoke, uid, &namespace, &name).await;
            CacheDone::Deleted
        }
        CacheOp::AckRelease { uid } => {
            let key = uid.clone();
            if let Err(e) = durably(&spoke.cache, move |c| c.ack_release(&key)).await {
                // Sent again next session; the hub answers it again.
                warn!(uid = %uid, error = %e, "cannot record the hub's release ack");
            }
            CacheDone::ReleaseAcked
        }
        CacheOp::AckStatus { uid, seq } => {
            let key = uid.clone();
            match durably(&spoke.cache, move |c| c.ack_status(&key, seq)).await {
                Ok(acked) => CacheDone::StatusAcked { uid, acked },
                // The status stays pending and is re-sent next session; the hub drops it by seq.
                Err(e) => {
                    warn!(uid = %uid, seq, error = %e, "cannot record the hub's status ack");
                    CacheDone::StatusAcked { uid, acked: false }
                }
            }
        }
    }
}

/// Stores a work from the hub durably and hands it to the reconciler; the caller acks it. An
/// acked generation must survive a crash.
async fn store_work(spoke: &Spoke, work: wire::WorkUpdate) -> CacheDone {
    let wire::WorkUpdate {
        uid,
        namespace,
        name,
        generation,
        content_hash,
        manifest_work_json,
    } = work;
    if uid.is_empty() {
        warn!(work = %format!("{namespace}/{name}"), "the hub sent a work without a uid; ignored");
        return CacheDone::NotStored;
    }
    let size = manifest_work_json.len();
    let refused = if size > MAX_MANIFEST_WORK_BYTES {
        Some(format!(
            "the ManifestWork is {size} bytes, more than the agent's limit of {MAX_MANIFEST_WORK_BYTES} bytes; \
             split its manifests over several ManifestWorks"
        ))
    } else {
        serde_json::from_slice::<ManifestWork>(&manifest_work_json)
            .err()
            .map(|e| format!("the hub sent a ManifestWork the agent cannot read: {e}"))
    };
    // Neither a refused nor a held-already body is kept in memory past this point.
    let content = refused.is_none().then_some(manifest_work_json);
    let cached = CachedWork {
        uid: uid.clone(),
        namespace,
        name,
        generation,
        content_hash,
        refused,
        deleting: false,
    };
    let key = uid.clone();
    match durably(&spoke.cache, move |c| c.work(&key)).await {
        Ok(Some(held)) if held == cached => {
            // A resume after a lost ack: already durable, nothing to apply.
            return CacheDone::Stored {
                uid,
                generation,
                stored: None,
            };
        }
        Ok(_) => {}
        Err(e) => warn!(uid = %uid, error = %e, "cannot read the cached work; storing it again"),
    }
    if let Some(reason) = &cached.refused {
        warn!(work = %cached.display_name(), uid = %uid, %reason, "work refused");
    }
    let work_name = cached.display_name();
    let stored = cached.clone();
    match durably(&spoke.cache, move |c| {
        c.put_work(&cached, content.as_deref())
    })
    .await
    {
        Ok(()) => {
            debug!(work = %work_name, uid = %uid, generation, "work stored");
            spoke.reconciler.work_changed(&uid).await;
            CacheDone::Stored {
                uid,
                generation,
                stored: Some(stored),
            }
        }
        // Not acked: the next session's hello does not hold it, so the hub sends it again.
        Err(e) => {
            warn!(work = %work_name, uid = %uid, error = %e, "cannot store a work from the hub");
            CacheDone::NotStored
        }
    }
}

/// Marks a work deleted by the hub as a tombstone and hands it to the reconciler, which
/// removes or orphans its resources and then forgets it.
async fn delete_work(spoke: &Spoke, uid: String, namespace: &str, name: &str) {
    // A delete found during the hello sync carries only the uid: the name is in the cache.
    let work = if name.is_empty() {
        let key = uid.clone();
        match durably(&spoke.cache, move |c| c.work(&key)).await {
            Ok(Some(cached)) => cached.display_name(),
            _ => format!("uid {uid}"),
        }
    } else {
        format!("{namespace}/{name}")
    };
    let key = uid.clone();
    match durably(&spoke.cache, move |c| c.mark_deleting(&key)).await {
        Ok(true) => {
            info!(uid = %uid, %work, "work deleted on the hub");
            spoke.reconciler.work_changed(&uid).await;
        }
        Ok(false) => {
            // Nothing of it is here (never stored, or already released). Its content may have
            // been on the way: what came of it goes. And it is released, so the hub does not
            // keep the work waiting for this agent.
            debug!(uid = %uid, "the hub deleted a work this agent does not hold; released");
            let key = uid.clone();
            if let Err(e) = durably(&spoke.cache, move |c| c.end_fetch(&key)).await {
                warn!(uid = %uid, error = %e, "cannot give up the transfer of a deleted work; given up after the next sync");
            }
            let key = uid.clone();
            match durably(&spoke.cache, move |c| c.release(&key)).await {
                Ok(()) => spoke.outbox_changed.notify_one(),
                Err(e) => warn!(uid = %uid, error = %e, "cannot record a work release"),
            }
        }
        // Still held: the hub repeats the delete on the next session, where the hello lists it.
        Err(e) => warn!(uid = %uid, error = %e, "cannot record a work deletion"),
    }
}

/// Reports every outbox status not yet reported in this session. The outbox is read from the
/// cache (a read transaction, served from its page cache; no write, no fsync).
pub(crate) fn report_outbox(
    machine: &mut AgentSession,
    spoke: &Spoke,
    reported: &mut HashMap<String, u64>,
) {
    let pending = match spoke.cache.pending_statuses() {
        Ok(p) => p,
        Err(e) => {
            warn!(error = %e, "cannot read the status outbox");
            return;
        }
    };
    for status in pending {
        if reported
            .get(&status.uid)
            .is_some_and(|seq| *seq >= status.seq)
        {
            continue;
        }
        debug!(uid = %status.uid, seq = status.seq, "reporting status");
        reported.insert(status.uid.clone(), status.seq);
        spoke.observer.status_reported(&status.uid, status.seq);
        machine.report_status(
            status.uid,
            status.generation,
            status.seq,
            status.status_json,
        );
    }
}

/// Reports every release in the outbox not yet reported in this session.
pub(crate) fn report_releases(
    machine: &mut AgentSession,
    spoke: &Spoke,
    released: &mut HashSet<String>,
) {
    let pending = match spoke.cache.pending_releases() {
        Ok(p) => p,
        Err(e) => {
            warn!(error = %e, "cannot read the release outbox");
            return;
        }
    };
    for uid in pending {
        if released.insert(uid.clone()) {
            debug!(uid = %uid, "reporting a released work");
            machine.release_work(uid);
        }
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    //! The driver's delivery half against the hub's real protocol machine, frames passed in
    //! memory: what is acked is durable, statuses flow and are acked, a resume re-sends nothing.

    use std::sync::Arc;

    use super::*;
    use crate::apply::MemoryCluster;
    use crate::cache::{CacheDb, WorkCache};
    use crate::reconcile::{Reconciler, ReconcilerConfig};
    use crate::session::Unobserved;
    use flotilla_proto::api::content_hash;
    use flotilla_proto::session::Jitter;
    use flotilla_proto::session::{HubConfig, HubEvent, HubSession};
    use serde_json::json;
    use tokio::sync::Notify;

    struct NoJitter;
    impl Jitter for NoJitter {
        fn uniform(&mut self, _max: Duration) -> Duration {
            Duration::ZERO
        }
    }

    /// One agent (cache, simulated cluster, reconciler task) and helpers to run sessions.
    struct Agent {
        spoke: Spoke,
        cluster: Arc<MemoryCluster>,
        _stop: tokio::sync::oneshot::Sender<()>,
    }

    impl Agent {
        fn start(cache: Arc<dyn WorkCache>) -> Agent {
            let cluster = Arc::new(MemoryCluster::new());
            let outbox_changed = Arc::new(Notify::new());
            let (reconciler, handle) = Reconciler::new(
                Arc::clone(&cache),
                cluster.clone(),
                // No retries or resyncs within a test: each status here comes from a step.
                ReconcilerConfig {
                    retry_initial: Duration::from_secs(3600),
                    resync_interval: Duration::from_secs(3600),
                    ..ReconcilerConfig::default()
                },
                Arc::clone(&outbox_changed),
                Box::new(NoJitter),
            );
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            tokio::spawn(reconciler.run(async {
                let _ = stopped.await;
            }));
            let (_, kubernetes_version) = watch::channel("v1.36.3".to_string());
            let (_, cluster_info) = watch::channel(wire::ClusterInfo::default());
            Agent {
                spoke: Spoke {
                    cache,
                    reconciler: handle,
                    outbox_changed,
                    kubernetes_version,
                    cluster_info,
                    observer: Arc::new(Unobserved),
                    tunnels: crate::tunnel::TunnelHandle::unconnected(),
                    metrics: crate::metrics::AgentMetrics::default(),
                },
                cluster,
                _stop: stop,
            }
        }
    }

    /// One session between the agent's machine and the hub's, connected in memory.
    struct Session<'a> {
        agent: &'a Agent,
        machine: AgentSession,
        hub: HubSession,
        reported: HashMap<String, u64>,
        released: HashSet<String>,
        /// Events the hub side saw, in order.
        hub_events: Vec<HubEvent>,
        /// Works the agent received.
        received: Vec<String>,
    }

    impl<'a> Session<'a> {
        fn open(agent: &'a Agent) -> Session<'a> {
            let now = Instant::now();
            let held = agent.spoke.cache.held().unwrap();
            let machine = AgentSession::new(
                now,
                SessionConfig {
                    cluster_name: "store-7".into(),
                    agent_version: "test".into(),
                    kubernetes_version: "v1.36.3".into(),
                    claims: Vec::new(),
                    welcome_timeout: DEFAULT_WELCOME_TIMEOUT,
                },
                held,
            );
            Session {
                agent,
                machine,
                hub: HubSession::new(now, HubConfig::default(), "store-7", "s1"),
                reported: HashMap::new(),
                released: HashSet::new(),
                hub_events: Vec::new(),
                received: Vec::new(),
            }
        }

        /// Moves frames both ways and handles events until both sides are quiet.
        async fn pump(&mut self) {
            loop {
                let mut moved = false;
                while let Some(frame) = self.machine.poll_transmit() {
                    self.hub.handle_frame(Instant::now(), frame).unwrap();
                    moved = true;
                }
                while let Some(event) = self.hub.poll_event() {
                    if let HubEvent::WorkAcked {
                        uid, generation, ..
                    } = &event
                    {
                        // The point of the ordering: whatever the hub sees acked is durable.
                        let held = self
                            .agent
                            .spoke
                            .cache
                            .work(uid)
                            .unwrap()
                            .expect("acked but not cached");
                        assert_eq!(held.generation, *generation);
                    }
                    self.hub_events.push(event);
                    moved = true;
                }
                while let Some(frame) = self.hub.poll_transmit() {
                    self.machine.handle_frame(Instant::now(), frame).unwrap();
                    moved = true;
                }
                while let Some(event) = self.machine.poll_event() {
                    moved = true;
                    let spoke = &self.agent.spoke;
                    // What the driver does with each event, its cache work awaited in place.
                    let op = match event {
                        AgentEvent::WorkReceived { work } => {
                            self.received.push(work.uid.clone());
                            Some(CacheOp::Store(work))
                        }
                        AgentEvent::WorkDeleted {
                            uid,
                            namespace,
                            name,
                        } => Some(CacheOp::Delete {
                            uid,
                            namespace,
                            name,
                        }),
                        AgentEvent::StatusAcked { uid, seq } => {
                            Some(CacheOp::AckStatus { uid, seq })
                        }
                        AgentEvent::ReleaseAcked { uid } => Some(CacheOp::AckRelease { uid }),
                        AgentEvent::Established { .. } => {
                            report_outbox(&mut self.machine, spoke, &mut self.reported);
                            None
                        }
                        _ => None,
                    };
                    if let Some(op) = op {
                        let done = run_cache_op(spoke.clone(), op).await;
                        if let Some((uid, generation)) = done.ack(spoke) {
                            self.machine.ack_work(uid, generation);
                        }
                        if let CacheDone::StatusAcked { uid, acked: true } = done {
                            self.reported.remove(&uid);
                        }
                    }
                }
                if !moved {
                    return;
                }
            }
        }

        /// Sends the release outbox, as the driver does, and returns the releases the hub got.
        async fn releases(&mut self) -> Vec<String> {
            report_releases(&mut self.machine, &self.agent.spoke, &mut self.released);
            self.pump().await;
            let got = self
                .hub_events
                .iter()
                .filter_map(|e| match e {
                    HubEvent::WorkReleased { uid } => Some(uid.clone()),
                    _ => None,
                })
                .collect();
            self.hub_events
                .retain(|e| !matches!(e, HubEvent::WorkReleased { .. }));
            got
        }

        /// Waits for the reconciler's next status and sends the outbox, as the driver does.
        async fn next_status(&mut self) {
            tokio::time::timeout(
                Duration::from_secs(10),
                self.agent.spoke.outbox_changed.notified(),
            )
            .await
            .expect("no status from the reconciler");
            report_outbox(&mut self.machine, &self.agent.spoke, &mut self.reported);
            self.pump().await;
        }

        fn hello_held(&self) -> Vec<wire::HeldWork> {
            self.hub_events
                .iter()
                .find_map(|e| match e {
                    HubEvent::Established { hello } => Some(hello.held.clone()),
                    _ => None,
                })
                .expect("established")
        }

        /// Statuses the hub received as (uid, seq); the hub acks each.
        fn statuses(&mut self) -> Vec<(String, u64)> {
            let got: Vec<(String, u64)> = self
                .hub_events
                .iter()
                .filter_map(|e| match e {
                    HubEvent::StatusReported { uid, seq, .. } => Some((uid.clone(), *seq)),
                    _ => None,
                })
                .collect();
            self.hub_events
                .retain(|e| !matches!(e, HubEvent::StatusReported { .. }));
            for (uid, seq) in &got {
                self.hub.ack_status(uid.clone(), *seq);
            }
            got
        }
    }

    fn desired(uid: &str, generation: i64, configmaps: &[&str]) -> wire::WorkUpdate {
        let manifests: Vec<_> = configmaps
            .iter()
            .map(|n| json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": n, "namespace": "default"}}))
            .collect();
        let mw: ManifestWork = serde_json::from_value(json!({
            "apiVersion": "work.open-cluster-management.io/v1", "kind": "ManifestWork",
            "metadata": {"name": "w", "namespace": "store-7", "uid": uid, "generation": generation},
            "spec": {"workload": {"manifests": manifests}},
        }))
        .unwrap();
        wire::WorkUpdate {
            uid: uid.into(),
            namespace: "store-7".into(),
            name: "w".into(),
            generation,
            content_hash: content_hash(&mw.spec),
            manifest_work_json: serde_json::to_vec(&mw).unwrap(),
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn works_are_stored_before_the_ack_and_statuses_flow_until_acked() {
        let db = CacheDb::temporary().unwrap();
        let cache: Arc<dyn WorkCache> = Arc::new(db.cluster("store-7"));
        let agent = Agent::start(Arc::clone(&cache));

        let mut s = Session::open(&agent);
        s.pump().await;
        assert!(s.hello_held().is_empty());
        s.hub.begin_sync([desired("a", 1, &["x"])]);
        s.pump().await;
        assert!(
            s.hub_events
                .iter()
                .any(|e| matches!(e, HubEvent::WorkAcked { uid, generation: 1, .. } if uid == "a"))
        );
        s.next_status().await;
        let statuses = s.statuses();
        let first = statuses.first().map_or(0, |(_, seq)| *seq);
        assert_eq!(statuses, [("a".to_string(), first)]);
        s.pump().await;
        assert!(
            cache.pending_statuses().unwrap().is_empty(),
            "the hub's ack empties the outbox"
        );
        assert_eq!(agent.cluster.objects().await.len(), 1);

        // A live update: stored, acked, applied, reported with the next seq.
        s.hub.upsert_work(desired("a", 2, &["x", "y"]));
        s.pump().await;
        s.next_status().await;
        assert_eq!(s.statuses(), [("a".to_string(), first + 1)]);
        s.pump().await;
        assert_eq!(agent.cluster.objects().await.len(), 2);

        // The hub goes away; a drift repair during the outage leaves a status in the outbox.
        drop(s);
        agent.cluster.set_down(true).await;
        agent.spoke.reconciler.resync_all().await;
        tokio::time::timeout(
            Duration::from_secs(10),
            agent.spoke.outbox_changed.notified(),
        )
        .await
        .expect("a status while the hub is away");
        assert_eq!(cache.pending_statuses().unwrap().len(), 1);
        agent.cluster.set_down(false).await;

        // Resume: the hello holds generation 2, the hub sends nothing, the outbox is delivered.
        let mut s = Session::open(&agent);
        s.pump().await;
        let held = s.hello_held();
        assert_eq!((held.len(), held[0].generation), (1, 2));
        s.hub.begin_sync([desired("a", 2, &["x", "y"])]);
        s.pump().await;
        assert!(s.received.is_empty());
        assert!(
            !s.hub_events
                .iter()
                .any(|e| matches!(e, HubEvent::WorkAcked { .. })),
            "nothing re-sent"
        );
        assert_eq!(
            s.statuses(),
            [("a".to_string(), first + 2)],
            "the outage's status, once"
        );
        s.pump().await;
        assert!(cache.pending_statuses().unwrap().is_empty());

        // Deleted on the hub: a tombstone, then the resources and the work are gone.
        s.hub.delete_work("a", "store-7", "w");
        s.pump().await;
        let deadline = Instant::now() + Duration::from_secs(10);
        while cache.work("a").unwrap().is_some() {
            assert!(
                Instant::now() < deadline,
                "the tombstone was not cleaned up"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(agent.cluster.objects().await.is_empty());
        assert!(s.statuses().is_empty(), "no status for a deleted work");
        // The hub hears the work is released, and its ack empties the release outbox.
        assert_eq!(s.releases().await, ["a"]);
        s.hub.ack_release("a");
        s.pump().await;
        assert!(cache.pending_releases().unwrap().is_empty());
        assert!(s.releases().await.is_empty(), "reported once");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn status_acks_still_queued_when_the_session_ends_are_recorded() {
        let db = CacheDb::temporary().unwrap();
        let cache: Arc<dyn WorkCache> = Arc::new(db.cluster("store-7"));
        let agent = Agent::start(Arc::clone(&cache));
        let seqs: Vec<u64> = ["a", "b"]
            .iter()
            .map(|uid| {
                cache
                    .push_status(uid, 1, &json!({"conditions": []}))
                    .unwrap()
            })
            .collect();
        // The hub acked both statuses, and sent a work, just before the connection went: the
        // driver's queue holds a store and two acks when the session ends.
        let mut queue = CacheQueue::default();
        queue.push(CacheOp::Store(desired("w", 1, &["x"])));
        queue.push(CacheOp::AckStatus {
            uid: "a".into(),
            seq: seqs[0],
        });
        queue.push(CacheOp::AckStatus {
            uid: "b".into(),
            seq: seqs[1],
        });
        assert!(matches!(
            queue.next(&agent.spoke).await,
            CacheDone::Stored { .. }
        ));
        queue.finish(&agent.spoke).await;
        // (The stored work's own first status may be pending by now: the reconciler applied it.)
        let pending: Vec<String> = cache
            .pending_statuses()
            .unwrap()
            .into_iter()
            .map(|p| p.uid)
            .filter(|uid| uid != "w")
            .collect();
        assert!(
            pending.is_empty(),
            "acked statuses are not sent again next session: {pending:?}"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_oversized_work_is_acked_but_refused_with_a_status_naming_the_limit() {
        let db = CacheDb::temporary().unwrap();
        let cache: Arc<dyn WorkCache> = Arc::new(db.cluster("store-7"));
        let agent = Agent::start(Arc::clone(&cache));
        let mut s = Session::open(&agent);
        s.pump().await;
        let mut big = desired("big", 1, &["x"]);
        big.manifest_work_json = vec![b' '; MAX_MANIFEST_WORK_BYTES + 1];
        s.hub.begin_sync([big]);
        s.pump().await;
        assert!(
            cache.manifest_work("big").unwrap().is_none(),
            "the content is not kept"
        );
        assert!(cache.work("big").unwrap().unwrap().refused.is_some());
        s.next_status().await;
        let status = cache.last_status("big").unwrap().unwrap().status;
        let degraded = status["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["type"] == "Degraded")
            .unwrap();
        assert_eq!(degraded["status"], "True");
        let message = degraded["message"].as_str().unwrap();
        assert!(
            message.contains(&format!("{} bytes", MAX_MANIFEST_WORK_BYTES + 1)),
            "{message}"
        );
        assert!(
            message.contains(&format!("limit of {MAX_MANIFEST_WORK_BYTES} bytes")),
            "{message}"
        );
        assert!(agent.cluster.objects().await.is_empty());
    }
}
