//! One session of the agent, from dial to end, on whichever carrier the dialer chose: read a
//! frame, feed the protocol machine, write what it emits when the link has room, arm the timer
//! it asks for. Every decision is the machine's (`flotilla_proto::session::AgentSession`, with
//! its content fetch); the driver does the IO it asks for. Work on the disk runs beside the
//! loop and comes back as events, in order where order matters: the cache's operations one at
//! a time in the order the hub's frames asked for them (`delivery`), chunks and the identity's
//! files as they finish.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, SystemTime};

use flotilla_ops::error_chain;
use flotilla_ops::sleep_until;
use flotilla_proto::api::content::ContentRef;
use flotilla_proto::session::{
    AgentConfig as SessionConfig, AgentEvent, AgentSession, CloseReason, DEFAULT_WELCOME_TIMEOUT,
    Reconnect,
};
use flotilla_proto::wire::{self, AgentFrame};
use flotilla_transport::{AgentTunnels, Dialed, Link, LinkError};
use futures::StreamExt as _;
use futures::future::BoxFuture;
use futures::stream::FuturesUnordered;
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use crate::cache::{CacheError, durably};
use crate::config::AgentConfig;
use crate::connect::{Dialer, Transport};
use crate::delivery::{CacheDone, CacheOp, CacheQueue, report_outbox, report_releases};
use crate::identity::Identity;
use crate::refusal::Refusal;
use crate::spoke::Spoke;

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
    Lost { refusal: Refusal },
    /// Our own shutdown.
    Shutdown,
}

/// One session from dial to end. `reconnect` is told when the hub welcomes it.
pub(crate) async fn session_once(
    dialer: &Dialer,
    config: &AgentConfig,
    spoke: &Spoke,
    mut stop: watch::Receiver<bool>,
    reconnect: &mut Reconnect,
) -> Ended {
    let identity = Identity::new(config.identity_dir());
    let mut cluster_info = spoke.cluster_info.clone();
    let mut machine = open(config, spoke, &identity, &mut cluster_info).await;
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
        // Over the gateway's rate, told before TLS when to come back: as a drain.
        Err(LinkError::TurnedAway { retry_after, .. }) => {
            spoke.observer.turned_away(retry_after);
            return Ended::Drained {
                retry_after,
                redirect: None,
            };
        }
        Err(e) => {
            let refusal = Refusal::from_link(dialer.hub(), &e);
            return Ended::Lost {
                refusal: if dialer.transport() == Transport::Quic {
                    refusal.over_quic()
                } else {
                    refusal
                },
            };
        }
    };
    // Over QUIC the gateway opens tunnel streams on this connection itself.
    spoke.tunnels.session(&tunnels);
    let mut driver = Driver {
        spoke,
        config,
        identity,
        machine,
        cache: CacheQueue::default(),
        work: FuturesUnordered::new(),
        reported: HashMap::new(),
        released: HashSet::new(),
        cluster_info,
        tunnels,
        carrier: link.carrier,
        drained: None,
        last_close: None,
        closed_at: None,
        connected: None,
    };
    let shutting_down = driver.drive(link, pump, &mut stop, reconnect).await;
    // Durable work that was under way finishes, and the hub's status acks are recorded; works
    // still queued are redone on the next session (the hub resends what was not acked).
    driver.cache.finish(spoke, FINAL_FLUSH).await;
    if shutting_down {
        return Ended::Shutdown;
    }
    match driver.drained {
        Some((retry_after, redirect)) => Ended::Drained {
            retry_after,
            redirect,
        },
        None => Ended::Lost {
            refusal: Refusal::from_close(
                dialer.hub(),
                &driver
                    .last_close
                    .unwrap_or_else(|| CloseReason::Local("session ended".into())),
            ),
        },
    }
}

/// The session's machine with its hello queued: what the cache holds and is still removing
/// (so the hub sends only what differs and keeps those works' finalizers), the spoke's
/// version and claims, the CA bundle trusted, and the certificate's validity for renewal.
async fn open(
    config: &AgentConfig,
    spoke: &Spoke,
    identity: &Identity,
    cluster_info: &mut watch::Receiver<wire::ClusterInfo>,
) -> AgentSession {
    // If the cache cannot say, an empty list is safe: the hub then sends everything, and
    // storing is idempotent.
    let held = durably(&spoke.cache, |c| c.held())
        .await
        .unwrap_or_else(|e| {
            warn!(error = %e, "cannot list the cached works; asking the hub for all of them");
            Vec::new()
        });
    // If the cache cannot say, the hub may let those works go early; their resources are
    // still removed here.
    let releasing = durably(&spoke.cache, |c| c.releasing())
        .await
        .unwrap_or_else(|e| {
            warn!(error = %e, "cannot list the works being removed; the hub is not told of them");
            Vec::new()
        });
    let mut version = spoke.kubernetes_version.clone();
    let _ = tokio::time::timeout(VERSION_WAIT, version.wait_for(|v| !v.is_empty())).await;
    let kubernetes_version = version.borrow().clone();
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
    machine
}

/// One session's state around its machine.
struct Driver<'a> {
    spoke: &'a Spoke,
    config: &'a AgentConfig,
    identity: Identity,
    machine: AgentSession,
    /// Cache operations, one at a time, in the order the hub's frames asked for them.
    cache: CacheQueue,
    /// Disk work beside the loop: chunks stored, renewal requests made, certificates written.
    work: FuturesUnordered<BoxFuture<'static, Done>>,
    /// Statuses reported on this session (uid → seq), so each is sent once.
    reported: HashMap<String, u64>,
    /// Releases sent on this session and not acked yet: each is sent once per session.
    released: HashSet<String>,
    cluster_info: watch::Receiver<wire::ClusterInfo>,
    tunnels: AgentTunnels,
    carrier: flotilla_transport::Carrier,
    /// The hub's drain, if it drained us: its retry-after and redirect.
    drained: Option<(Duration, Option<String>)>,
    last_close: Option<CloseReason>,
    closed_at: Option<Instant>,
    /// Shows the session established in the gauges until the driver ends.
    connected: Option<crate::metrics::Connected>,
}

/// The result of work done beside the loop.
enum Done {
    /// A signing request for a new key, or why none could be made.
    Request(Result<String, Failed>),
    /// A renewed certificate is stored: its validity, or why it could not be.
    Stored(Result<(SystemTime, SystemTime), Failed>),
    /// A chunk is durable; `None` when it was dropped (the cache no longer names it).
    ChunkStored {
        chunk_sha256: String,
        stored: Result<Option<ChunkStored>, CacheError>,
    },
    Nothing,
}

impl Driver<'_> {
    /// The loop: until the machine has closed and said what it had to, or the link is gone.
    /// Returns whether the agent is shutting down.
    async fn drive(
        &mut self,
        link: Link<wire::HubFrame, AgentFrame>,
        mut pump: Option<flotilla_transport::Pump>,
        stop: &mut watch::Receiver<bool>,
        reconnect: &mut Reconnect,
    ) -> bool {
        let Link {
            mut inbound,
            outbound,
            ..
        } = link;
        let mut next: Option<AgentFrame> = None;
        // When the way out broke, and why. The hub may have ended the session with a goodbye
        // (a drain with a redirect, a refusal) that is still on the way in: it is read first,
        // within FINAL_FLUSH, before the session closes for the broken writer.
        let mut writer_gone: Option<(Instant, &'static str)> = None;
        let mut shutting_down = false;
        loop {
            while let Some(event) = self.machine.poll_event() {
                self.on_event(event, reconnect);
            }
            if next.is_none() {
                next = self.machine.poll_transmit();
                if let Some(frame) = &next {
                    self.spoke.observer.frame_sent(frame);
                }
            }
            if self.machine.is_closed() {
                let gave_up = self.closed_at.is_some_and(|t| t.elapsed() >= FINAL_FLUSH);
                if next.is_none() || gave_up || writer_gone.is_some() {
                    break;
                }
            }
            if let Some((since, why)) = writer_gone
                && !self.machine.is_closed()
                && since.elapsed() >= FINAL_FLUSH
            {
                self.machine.close(why);
                continue;
            }
            let deadline = match (self.closed_at, writer_gone) {
                (Some(t), _) => Some(t + FINAL_FLUSH),
                (None, Some((since, _))) => Some(since + FINAL_FLUSH),
                (None, None) => self.machine.poll_timeout(),
            };
            let established = self.machine.is_established();
            tokio::select! {
                permit = outbound.reserve(), if next.is_some() && writer_gone.is_none() => match permit {
                    Ok(permit) => permit.send(next.take().expect("checked above")),
                    Err(_) => writer_gone = Some((Instant::now(), "the hub's stream is gone")),
                },
                frame = inbound.next(), if !self.machine.is_closed() => match frame {
                    Some(Ok(frame)) => {
                        self.spoke.observer.frame_received(&frame);
                        // An error has already closed the session; the log says why.
                        if let Err(e) = self.machine.handle_frame(Instant::now(), frame) {
                            warn!(error = %e, "protocol error from the hub");
                        }
                    }
                    Some(Err(e)) => self.machine.close(format!("the connection to the hub failed: {e}")),
                    None => self.machine.close("the hub ended the stream without a goodbye"),
                },
                _ = sleep_until(deadline) => self.machine.handle_timeout(Instant::now()),
                done = self.cache.next(self.spoke), if self.cache.is_busy() => {
                    for done in done {
                        self.on_cache_done(done);
                    }
                }
                Some(done) = self.work.next(), if !self.work.is_empty() => self.on_done(done),
                // Only once established: until then a status has nowhere to go, and the
                // wake-up stays stored for later.
                _ = self.spoke.outbox_changed.notified(), if established => self.report_outboxes(),
                // A claim, node or version changed on the spoke.
                Ok(()) = self.cluster_info.changed(), if established => self.report_cluster_info(),
                _ = async { pump.as_mut().expect("checked").await }, if pump.is_some() => {
                    // The carrier's writer ended: the connection is going.
                    pump = None;
                    writer_gone.get_or_insert((Instant::now(), "the connection to the hub ended"));
                }
                _ = stop.wait_for(|s| *s), if !shutting_down => {
                    shutting_down = true;
                    self.machine.close("agent shutting down");
                }
            }
        }
        drop(outbound);
        if let Some(pump) = pump {
            let _ = tokio::time::timeout(FINAL_FLUSH, pump).await;
        }
        shutting_down
    }

    /// Acts on what the machine says.
    fn on_event(&mut self, event: AgentEvent, reconnect: &mut Reconnect) {
        let spoke = self.spoke;
        match event {
            AgentEvent::Established { session_id, .. } => {
                reconnect.established(Instant::now());
                info!(session = %session_id, carrier = %self.carrier, "session established");
                spoke.observer.session_established();
                self.connected = Some(spoke.metrics.connected(self.carrier));
                self.report_outboxes();
                self.report_cluster_info();
            }
            AgentEvent::WorkReceived { work } => self.cache.push(CacheOp::Store(work)),
            // A large work: its chunks first, then the work, so what is acked is whole. The
            // transfer is recorded in the cache's order of operations.
            AgentEvent::ContentWanted {
                uid,
                namespace,
                name,
                content,
                transfer,
            } => self.cache.push(CacheOp::Fetch {
                uid,
                name: format!("{namespace}/{name}"),
                content,
                transfer,
            }),
            AgentEvent::ContentHeld { work } => {
                info!(work = %format!("{}/{}", work.namespace, work.name), uid = %work.uid, "content complete");
                self.cache.push(CacheOp::Store(work));
            }
            AgentEvent::ChunkReceived { chunk_sha256, data } => {
                spoke.metrics.chunk_bytes_received.inc_by(data.len() as u64);
                self.work.push(Box::pin(store_chunk(
                    spoke.cache.clone(),
                    chunk_sha256,
                    data,
                )));
            }
            AgentEvent::ChunkRefused {
                uid,
                chunk_sha256,
                reason,
                retry_in,
            } => match retry_in {
                Some(retry_in) => warn!(uid = %uid, chunk = %chunk_sha256, %reason, ?retry_in,
                    "the hub cannot serve a chunk of the work's content; asking again after a delay"),
                None => debug!(uid = %uid, chunk = %chunk_sha256, %reason,
                    "the hub refused a chunk no transfer needs any more"),
            },
            AgentEvent::WorkDeleted {
                uid,
                namespace,
                name,
            } => self.cache.push(CacheOp::Delete {
                uid,
                namespace,
                name,
            }),
            AgentEvent::ReleaseAcked { uid } => {
                self.released.remove(&uid);
                self.cache.push(CacheOp::AckRelease { uid });
            }
            AgentEvent::StatusAcked { uid, seq } => {
                spoke.observer.status_acked(&uid, seq);
                self.cache.push(CacheOp::AckStatus { uid, seq });
            }
            AgentEvent::RenewalDue => {
                let (identity, cluster) = (self.identity.clone(), self.config.cluster_name.clone());
                self.work.push(Box::pin(async move {
                    let made =
                        tokio::task::spawn_blocking(move || identity.renewal_request(&cluster))
                            .await;
                    Done::Request(flatten(made))
                }));
            }
            AgentEvent::CertificateIssued {
                certificate_pem,
                ca_bundle_pem,
            } => {
                let identity = self.identity.clone();
                self.work.push(Box::pin(async move {
                    let stored = tokio::task::spawn_blocking(move || {
                        identity.complete_renewal(&certificate_pem, &ca_bundle_pem)?;
                        identity.validity()
                    })
                    .await;
                    Done::Stored(flatten(stored))
                }));
            }
            AgentEvent::RenewalRefused { reason } => {
                warn!(%reason, "the hub refused to renew the certificate; asking again later");
            }
            AgentEvent::TrustBundleUpdated { ca_bundle_pem } => {
                let identity = self.identity.clone();
                self.work.push(Box::pin(async move {
                    let stored = tokio::task::spawn_blocking(move || {
                        identity.update_ca_bundle(&ca_bundle_pem)
                    })
                    .await;
                    match flatten(stored) {
                        Ok(()) => info!(
                            "the hub's CA bundle changed (CA rotation); stored for the next connection"
                        ),
                        Err(e) => warn!(error = %error_chain(&*e), "cannot store the hub's new CA bundle"),
                    }
                    Done::Nothing
                }));
            }
            AgentEvent::TunnelRequested { id, bytes } => {
                debug!(tunnel = %id, bytes, "tunnel requested");
                spoke.tunnels.requested(&self.tunnels, id, bytes);
            }
            AgentEvent::Synced { sent } => {
                info!(sent, "in sync with the hub");
                self.cache.push(CacheOp::EndFetches {
                    keep: self.machine.works_received(),
                });
            }
            AgentEvent::Drained {
                retry_after,
                redirect,
                ..
            } => self.drained = Some((retry_after, redirect)),
            AgentEvent::Closed { reason, .. } => {
                self.closed_at = Some(Instant::now());
                self.last_close = Some(reason);
            }
        }
    }

    /// Acts on a cache operation's result.
    fn on_cache_done(&mut self, done: CacheDone) {
        if let Some((uid, generation)) = done.ack(self.spoke) {
            self.machine.ack_work(uid, generation);
        }
        match done {
            CacheDone::StatusAcked { uid, acked: true } => {
                self.reported.remove(&uid);
            }
            CacheDone::Fetch {
                uid,
                name,
                content,
                transfer,
                missing: Ok(missing),
            } => {
                let (count, need) = (missing.len(), need_bytes(&content, &missing));
                if !self.machine.content_missing(&uid, transfer, missing) {
                    debug!(work = %name, "content no longer wanted");
                } else if count == 0 {
                    debug!(work = %name, content = %content.sha256, "content already held");
                } else {
                    info!(work = %name, content = %content.sha256, need_chunks = count,
                        chunks = content.chunks.len(), need_bytes = need, content_bytes = content.bytes,
                        "fetching content");
                }
            }
            CacheDone::Fetch {
                uid,
                name,
                transfer,
                missing: Err(e),
                ..
            } => {
                warn!(work = %name, error = %error_chain(&e), "cannot record the content's transfer; the hub resends the work next session");
                self.machine.content_not_recorded(&uid, transfer);
            }
            _ => {}
        }
    }

    /// Acts on work done beside the loop.
    fn on_done(&mut self, done: Done) {
        let now = Instant::now();
        match done {
            Done::Request(Ok(csr)) => {
                if self.machine.renew_certificate(csr) {
                    info!("asking the hub for a new client certificate over the session");
                }
            }
            Done::Request(Err(e)) => {
                warn!(error = %error_chain(&*e), "cannot make a renewal request; trying again later");
                self.machine.renewal_failed(now);
            }
            Done::Stored(Ok((not_before, not_after))) => {
                info!(
                    "client certificate renewed; the next connection uses it, this session carries on"
                );
                self.machine.set_certificate_validity(
                    now,
                    SystemTime::now(),
                    not_before,
                    not_after,
                );
            }
            Done::Stored(Err(e)) => {
                warn!(error = %error_chain(&*e), "cannot store the renewed certificate; asking again later");
                self.machine.renewal_failed(now);
            }
            Done::ChunkStored {
                chunk_sha256,
                stored:
                    Ok(Some(ChunkStored {
                        chunks,
                        bytes,
                        held_before,
                    })),
            } => {
                self.spoke.metrics.chunks_held.set(chunks as i64);
                self.spoke.metrics.chunk_bytes_held.set(bytes as i64);
                if held_before {
                    self.spoke.metrics.chunks_received_again.inc();
                    warn!(chunk = %chunk_sha256, "a chunk the cache held already was received again: its transfer resent what had arrived");
                }
                self.machine.chunk_stored(&chunk_sha256);
            }
            Done::ChunkStored {
                chunk_sha256,
                stored: Ok(None),
            } => {
                debug!(chunk = %chunk_sha256, "a chunk no work or transfer names any more arrived; dropped");
                self.machine.chunk_not_stored(now, &chunk_sha256);
            }
            Done::ChunkStored {
                chunk_sha256,
                stored: Err(e),
            } => {
                let retry_in = self.machine.chunk_not_stored(now, &chunk_sha256);
                warn!(chunk = %chunk_sha256, error = %error_chain(&e), ?retry_in, "cannot store a chunk; asking for it again later");
            }
            Done::Nothing => {}
        }
    }

    fn report_outboxes(&mut self) {
        report_outbox(&mut self.machine, self.spoke, &mut self.reported);
        report_releases(&mut self.machine, self.spoke, &mut self.released);
    }

    /// Sends what the agent knows about its spoke now, unless it knows nothing yet.
    fn report_cluster_info(&mut self) {
        let info = self.cluster_info.borrow_and_update().clone();
        if info != wire::ClusterInfo::default() {
            self.machine.report_cluster_info(info);
        }
    }
}

/// A chunk made durable: the cache's chunk count and bytes after it, and whether the cache
/// held it already (it was asked for and sent again although it had arrived).
struct ChunkStored {
    chunks: u64,
    bytes: u64,
    held_before: bool,
}

/// Stores a chunk durably, off the loop.
async fn store_chunk(
    cache: std::sync::Arc<dyn crate::cache::WorkCache>,
    chunk_sha256: String,
    data: Vec<u8>,
) -> Done {
    let sha = chunk_sha256.clone();
    let stored = durably(&cache, move |c| {
        let held_before = c.chunk(&sha)?.is_some();
        if !c.put_chunk(&sha, &data)? {
            return Ok(None);
        }
        let (chunks, bytes) = c.chunk_totals()?;
        Ok(Some(ChunkStored {
            chunks,
            bytes,
            held_before,
        }))
    })
    .await;
    Done::ChunkStored {
        chunk_sha256,
        stored,
    }
}

/// The bytes of the chunks of `content` that are `missing`.
fn need_bytes(content: &ContentRef, missing: &[String]) -> u64 {
    content
        .chunks
        .iter()
        .enumerate()
        .filter(|(_, c)| missing.contains(c))
        .map(|(i, _)| content.chunk_len(i))
        .sum()
}

/// Why work done beside the loop failed: its own error, or the blocking task's, with its causes.
type Failed = Box<dyn std::error::Error + Send + Sync + 'static>;

/// A blocking task's result, whichever way it failed.
fn flatten<T, E: Into<Failed>>(
    joined: Result<Result<T, E>, tokio::task::JoinError>,
) -> Result<T, Failed> {
    match joined {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(e)) => Err(e.into()),
        Err(e) => Err(e.into()),
    }
}
