//! The timer of every driver loop over a sans-IO machine: the machine answers the next
//! deadline it needs, or none, and the loop waits for it beside its other inputs.

use tokio::time::Instant;

/// Completes at `deadline`, or never when there is none (a machine with nothing to time).
pub async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn waits_for_the_deadline_and_forever_without_one() {
        let start = Instant::now();
        sleep_until(Some(start + Duration::from_secs(3))).await;
        assert_eq!(start.elapsed(), Duration::from_secs(3));
        let never = tokio::time::timeout(Duration::from_secs(3600), sleep_until(None)).await;
        assert!(never.is_err(), "no deadline must never complete");
    }
}
