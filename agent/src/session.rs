//! The agent's reconnect loop: wait, dial, drive one session until it ends (`driver`), and ask
//! the protocol's `Reconnect` machine where and when to dial next. Every decision (the backoff,
//! redirects and their bound, the home gateway and its misses) is the machine's, in
//! `flotilla_proto::session::reconnect`; this loop moves between it and the network, tells the
//! observer, and says in the log what was decided.

use std::time::Duration;

use flotilla_proto::session::{Jitter, Reconnect, SessionEnd, Target};
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::{debug, error, info, warn};

use crate::config::AgentConfig;
use crate::connect::Dialer;
use crate::driver::{Ended, session_once};
use crate::refusal::RefusalKind;
use crate::spoke::Spoke;

/// `rand` behind the protocol's jitter interface.
pub(crate) struct RandJitter<R>(pub R);

impl<R: rand::Rng> Jitter for RandJitter<R> {
    fn uniform(&mut self, max: Duration) -> Duration {
        if max.is_zero() {
            return Duration::ZERO;
        }
        Duration::from_nanos(
            self.0
                .random_range(0..=max.as_nanos().min(u64::MAX as u128) as u64),
        )
    }
}

/// Keeps a session with the hub until `stop` turns true (the session under way then says
/// goodbye): wait, dial, drive one session until it ends (`driver`), and ask the protocol's
/// [`Reconnect`] machine where and when to dial next.
pub(crate) async fn hold_session(
    config: &AgentConfig,
    dialer: &Dialer,
    spoke: &Spoke,
    mut jitter: impl Jitter,
    mut stop: watch::Receiver<bool>,
) {
    let mut reconnect = Reconnect::new(Instant::now(), config.backoff(), &mut jitter);
    loop {
        // Disconnected: wait out the delay the machine chose.
        if let Some(until) = reconnect.poll_timeout() {
            tokio::select! {
                _ = tokio::time::sleep_until(until) => {}
                _ = stop.wait_for(|s| *s) => return,
            }
        }
        let Some(target) = reconnect.connect(Instant::now()) else {
            continue;
        };
        if let Target::Home(home) = &target {
            debug!(gateway = %home, "dialling the gateway of the last session first");
        }
        let redirected = target.address().map(|to| dialer.redirected(to));
        // A stop lets the session say goodbye before it ends.
        let ended = session_once(
            redirected.as_ref().unwrap_or(dialer),
            config,
            spoke,
            stop.clone(),
            &mut reconnect,
        )
        .await;
        let Some(end) = observe(spoke, &ended, reconnect.is_connected()) else {
            return;
        };
        let home = reconnect.home().map(str::to_owned);
        let next = reconnect.ended(Instant::now(), end, &mut jitter);
        if let Some(home) = home
            && reconnect.home().is_none()
        {
            debug!(gateway = %home, "the gateway of the last session did not take a session; back to the configured address");
        }
        match (&ended, &next.target) {
            (Ended::Drained { retry_after, .. }, Target::Redirect(to)) => {
                info!(gateway = %to, ?retry_after, "redirected to the gateway that owns this cluster's shard");
                spoke.observer.redirected(to);
            }
            (Ended::Drained { .. }, _) => info!(
                delay = ?next.delay,
                "the hub is draining this session (shutting down, moving it, or over its new-session rate); reconnecting after its delay"
            ),
            (Ended::Lost { refusal }, _) if refusal.kind.is_retryable() => {
                warn!(retry_in = ?next.delay, "{refusal}")
            }
            // Someone has to act; the agent keeps trying meanwhile.
            (Ended::Lost { refusal }, _) => error!(retry_in = ?next.delay, "{refusal}"),
            (Ended::Shutdown, _) => {}
        }
    }
}

/// Tells the observer how the session ended, and the reconnect machine's view of it: `None`
/// for the agent's own shutdown.
fn observe(spoke: &Spoke, ended: &Ended, established: bool) -> Option<SessionEnd> {
    match ended {
        Ended::Shutdown => {
            if established {
                spoke.observer.session_closed("agent shutting down");
            }
            None
        }
        Ended::Drained {
            retry_after,
            redirect,
        } => {
            if established {
                spoke.observer.session_closed("hub draining");
            }
            Some(SessionEnd::Drained {
                retry_after: *retry_after,
                redirect: redirect.clone(),
            })
        }
        Ended::Lost { refusal } => {
            if established {
                spoke.observer.session_closed(&refusal.to_string());
            } else {
                spoke.observer.connection_failed(refusal);
            }
            // Nothing listening (or answering) there: that gateway is gone, not cold.
            let gone = matches!(
                refusal.kind,
                RefusalKind::HubUnreachable | RefusalKind::HubTimedOut
            );
            Some(if gone {
                SessionEnd::Unreachable
            } else {
                SessionEnd::Lost
            })
        }
    }
}
