//! The agent's session loop: connect, drive the protocol state machine until the session ends,
//! back off, reconnect. Everything that needs a decision lives in `flotilla_proto::session`; this
//! file only moves frames, timers and events between it and the network.

use std::time::Duration;

use flotilla_proto::session::{
    AgentConfig as SessionConfig, AgentEvent, AgentSession, Backoff, BackoffConfig,
    DEFAULT_WELCOME_TIMEOUT, Jitter,
};
use flotilla_proto::wire::fleet_client::FleetClient;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tracing::{info, warn};

use crate::AgentConfig;
use crate::connect::Dialer;

/// Largest frame the agent accepts from the hub (a ManifestWork is at most ~1.5 MiB).
pub const MAX_FRAME_BYTES: usize = 8 * 1024 * 1024;

/// Where the connection to the hub stands. Each transition is logged once.
#[derive(Debug)]
enum Link {
    /// Waiting before the next attempt; the delay comes from the backoff policy or the hub's
    /// retry-after.
    Disconnected { delay: Duration },
    /// Dialling and saying hello.
    Connecting,
}

/// How one session ended, which decides the next delay.
enum Ended {
    /// The hub asked us to come back later (it is draining).
    Drained { retry_after: Duration },
    /// The connection failed or the session closed; back off.
    Lost { reason: String },
    /// Our own shutdown.
    Shutdown,
}

/// `rand` behind the protocol's jitter interface.
struct RandJitter(rand::rngs::ThreadRng);

impl Jitter for RandJitter {
    fn uniform(&mut self, max: Duration) -> Duration {
        use rand::Rng;
        if max.is_zero() {
            return Duration::ZERO;
        }
        Duration::from_nanos(self.0.random_range(0..=max.as_nanos().min(u64::MAX as u128) as u64))
    }
}

/// Runs the agent until `shutdown` completes.
pub async fn run(config: AgentConfig, shutdown: impl Future<Output = ()> + Send) -> anyhow::Result<()> {
    let dialer = Dialer::new(&config.hub, &config.server_name(), &config.cert_dir)?;
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut jitter = RandJitter(rand::rng());
    let mut backoff = Backoff::new(BackoffConfig {
        max: config.max_backoff,
        initial: config.max_backoff.min(BackoffConfig::default().initial),
        startup_jitter: config.initial_jitter,
        ..BackoffConfig::default()
    });
    let mut link = Link::Disconnected { delay: backoff.startup_delay(&mut jitter) };
    tokio::pin!(shutdown);
    loop {
        match link {
            Link::Disconnected { delay } => {
                tokio::select! {
                    _ = tokio::time::sleep(delay) => link = Link::Connecting,
                    _ = &mut shutdown => return Ok(()),
                }
            }
            Link::Connecting => {
                let mut established_at = None;
                let ended = {
                    let mut session = std::pin::pin!(session_once(
                        &dialer,
                        &config,
                        stop_rx.clone(),
                        &mut established_at
                    ));
                    tokio::select! {
                        ended = &mut session => ended,
                        _ = &mut shutdown => {
                            // Let the session say goodbye before we exit.
                            let _ = stop_tx.send(true);
                            session.await
                        }
                    }
                };
                // Only a session that got as far as Welcome counts towards a stable connection.
                if let Some(at) = established_at {
                    backoff.connected(at);
                }
                link = match ended {
                    Ended::Shutdown => return Ok(()),
                    Ended::Drained { retry_after } => {
                        let delay = backoff.next_delay(Instant::now(), Some(retry_after), &mut jitter);
                        info!(?delay, "hub is draining; reconnecting after its delay");
                        Link::Disconnected { delay }
                    }
                    Ended::Lost { reason } => {
                        let delay = backoff.next_delay(Instant::now(), None, &mut jitter);
                        if established_at.is_some() {
                            warn!(%reason, ?delay, "session lost; reconnecting");
                        } else {
                            warn!(%reason, ?delay, "cannot reach the hub; retrying");
                        }
                        Link::Disconnected { delay }
                    }
                };
            }
        }
    }
}

/// One session from dial to end.
async fn session_once(
    dialer: &Dialer,
    config: &AgentConfig,
    mut stop: watch::Receiver<bool>,
    established_at: &mut Option<Instant>,
) -> Ended {
    let channel = match dialer.connect().await {
        Ok(c) => c,
        Err(e) => return Ended::Lost { reason: format!("{e:#}") },
    };
    let mut machine = AgentSession::new(
        Instant::now(),
        SessionConfig {
            cluster_name: config.cluster_name.clone(),
            agent_version: env!("CARGO_PKG_VERSION").to_string(),
            kubernetes_version: config.kubernetes_version.clone(),
            claims: Vec::new(),
            welcome_timeout: DEFAULT_WELCOME_TIMEOUT,
        },
        Vec::new(),
    );
    let (tx, rx) = mpsc::channel(32);
    // The hello must be in the request stream before the call starts.
    while let Some(frame) = machine.poll_transmit() {
        let _ = tx.try_send(frame);
    }
    let mut client = FleetClient::new(channel)
        .max_decoding_message_size(MAX_FRAME_BYTES)
        .max_encoding_message_size(MAX_FRAME_BYTES);
    let mut inbound = match client.session(ReceiverStream::new(rx)).await {
        Ok(r) => r.into_inner(),
        Err(status) => return Ended::Lost { reason: hub_refusal(&status) },
    };
    let mut drained = None;
    let mut last_reason = String::from("session ended");
    loop {
        while let Some(frame) = machine.poll_transmit() {
            if tx.send(frame).await.is_err() {
                break;
            }
        }
        while let Some(event) = machine.poll_event() {
            match event {
                AgentEvent::Established { session_id, .. } => {
                    *established_at = Some(Instant::now());
                    info!(session = %session_id, "session established");
                }
                AgentEvent::Synced { sent } => info!(sent, "in sync with the hub"),
                AgentEvent::Drained { retry_after, .. } => drained = Some(retry_after),
                AgentEvent::Closed { reason, .. } => last_reason = reason.to_string(),
                _ => {}
            }
        }
        if machine.is_closed() {
            break;
        }
        let deadline = machine.poll_timeout();
        tokio::select! {
            frame = inbound.message() => match frame {
                Ok(Some(frame)) => {
                    // An error has already closed the session; the log says why.
                    if let Err(e) = machine.handle_frame(Instant::now(), frame) {
                        warn!(error = %e, "protocol error from the hub");
                    }
                }
                Ok(None) => machine.close("hub closed the stream"),
                Err(status) => machine.close(hub_refusal(&status)),
            },
            _ = sleep_until(deadline) => machine.handle_timeout(Instant::now()),
            _ = stop.changed() => {
                machine.close("agent shutting down");
                while let Some(frame) = machine.poll_transmit() {
                    let _ = tx.try_send(frame);
                }
                return Ended::Shutdown;
            }
        }
    }
    match drained {
        Some(retry_after) => Ended::Drained { retry_after },
        None => Ended::Lost { reason: last_reason },
    }
}

/// The hub's reason, as a sentence.
fn hub_refusal(status: &tonic::Status) -> String {
    format!("hub ended the session: {} ({:?})", status.message(), status.code())
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}
