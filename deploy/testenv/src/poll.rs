//! How flotilla's tests wait: on the condition, with a deadline, never with a sleep standing in
//! for it. Every crate's tests share this one poller.

use std::time::Duration;

use anyhow::bail;
use tokio::time::Instant;

/// The first pause between two checks: a condition met almost at once is seen almost at once.
const FIRST_POLL: Duration = Duration::from_millis(5);
/// The longest pause between two checks: a long wait costs a loaded machine few checks (each
/// may be a request to an apiserver or a process under test).
const MAX_POLL: Duration = Duration::from_millis(50);

/// Waits until `check` gives a value, and returns it; fails after `timeout` naming `what` and
/// the last observation. An error from `check` is an observation too (a process still
/// starting, a connection refused): it is kept for the failure's message and checked again.
/// Pauses between checks double from 5 ms to 50 ms. On a paused tokio clock the pauses
/// advance it, so the deadline is virtual time there.
pub async fn wait_for<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = anyhow::Result<Option<T>>>,
{
    let deadline = Instant::now() + timeout;
    let mut pause = FIRST_POLL;
    loop {
        let last = match check().await {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => "condition not met".to_string(),
            Err(e) => format!("{e:#}"),
        };
        if Instant::now() >= deadline {
            bail!("timed out after {timeout:?} waiting for {what}; last: {last}");
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(MAX_POLL);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn returns_the_value_once_the_condition_holds() {
        let mut checks = 0;
        let got = wait_for("the third check", Duration::from_secs(1), || {
            checks += 1;
            let n = checks;
            async move {
                if n == 1 {
                    bail!("not started yet");
                }
                Ok((n >= 3).then_some(n))
            }
        })
        .await
        .unwrap();
        assert_eq!(got, 3);
    }

    #[tokio::test(start_paused = true)]
    async fn fails_at_the_deadline_naming_the_wait_and_the_last_observation() {
        let err = wait_for(
            "a condition that never holds",
            Duration::from_secs(1),
            || async { anyhow::Ok(None::<()>) },
        )
        .await
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("waiting for a condition that never holds; last: condition not met"),
            "{err}"
        );
        let err = wait_for("a server", Duration::from_secs(1), || async {
            Err::<Option<()>, _>(anyhow::anyhow!("connection refused"))
        })
        .await
        .unwrap_err()
        .to_string();
        assert!(err.ends_with("last: connection refused"), "{err}");
    }
}
