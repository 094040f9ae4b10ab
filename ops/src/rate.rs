//! Budgets of requests per second: a token bucket that makes the excess wait ([`TokenBucket`]),
//! and the same bucket in front of a Kubernetes client ([`KubeApiRate`], a tower layer), the
//! way client-go's `QPS` and `Burst` guard every client it builds. kube-rs has no client-side
//! limiter of its own: without one, a storm (a fleet-wide rollout acknowledged at once, a
//! restart re-listing everything) reaches the apiserver as fast as the process can send it.
//!
//! What is counted: requests, each once as it is sent. A watch is one request when it opens;
//! the events streaming back on it afterwards are not requests and cost nothing. A request
//! over the budget waits for its token, in order; it is never dropped.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::registry::Registry;
use tokio::time::{Instant, Sleep};

/// Default of `--kube-api-qps` (hub and gateway).
pub const DEFAULT_KUBE_API_QPS: f64 = 1000.0;
/// Default of `--kube-api-burst` (hub and gateway).
pub const DEFAULT_KUBE_API_BURST: u32 = 2000;
/// The largest QPS or burst accepted: beyond it the bucket bounds nothing.
pub const MAX_KUBE_API_RATE: f64 = 1_000_000.0;

/// Held for a few arithmetic operations, never across an await: a plain mutex cannot block
/// the runtime here, and it is taken once per request.
#[allow(clippy::disallowed_types)]
type SyncMutex<T> = std::sync::Mutex<T>;

/// A token bucket of `per_second` tokens with room for `burst` at once, in its GCRA form (one
/// theoretical arrival time instead of a count and a refill timer). Tokens are reserved in
/// order: whoever asks gets the next free one and is told how long to wait for it, so over any
/// `t` seconds at most `per_second·t + burst` tokens become usable, and nobody is refused.
#[derive(Debug)]
pub struct TokenBucket {
    /// One token's worth of time: 1/rate.
    interval: Duration,
    /// How far the theoretical arrival time may run ahead of now with a token still free now:
    /// (burst − 1) intervals, so that a full bucket hands out `burst` at once.
    tolerance: Duration,
    /// When the bucket would next be empty-handed if tokens went on being taken at the rate;
    /// each reservation moves it one interval later. `None` until the first (a full bucket).
    tat: SyncMutex<Option<Instant>>,
}

impl TokenBucket {
    /// A full bucket of `burst` (at least 1) refilled at `per_second` (above 0; a rate that is
    /// not a positive number is taken as one token per second).
    pub fn new(per_second: f64, burst: u32) -> TokenBucket {
        let per_second = if per_second.is_finite() && per_second > 0.0 {
            per_second.min(MAX_KUBE_API_RATE)
        } else {
            1.0
        };
        let interval = Duration::from_secs_f64(1.0 / per_second);
        TokenBucket {
            interval,
            tolerance: interval * (burst.max(1) - 1),
            tat: SyncMutex::new(None),
        }
    }

    /// Reserves the next token at `now`: how long from `now` until it may be used (zero when
    /// one is free at once). The reservation holds even if the caller goes away.
    pub fn reserve(&self, now: Instant) -> Duration {
        let mut tat = self
            .tat
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let start = tat.map_or(now, |t| t.max(now));
        *tat = Some(start + self.interval);
        // Free at `start - tolerance`; written without subtracting from an instant.
        start
            .saturating_duration_since(now)
            .saturating_sub(self.tolerance)
    }

    /// Waits for the next token; says how long it waited.
    pub async fn acquire(&self) -> Duration {
        let wait = self.reserve(Instant::now());
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
        wait
    }
}

/// The request budget of one process's Kubernetes clients, and the tower layer that puts it in
/// front of a client's service stack (kube's `ClientBuilder::with_layer`): every client built
/// with it draws from this one bucket, and what waited for it is counted.
/// Cheap to clone; clones share the bucket and the counts.
#[derive(Clone, Debug)]
pub struct KubeApiRate {
    bucket: Arc<TokenBucket>,
    /// Requests that had to wait for a token (`flotilla_kube_api_requests_waited_total`): a
    /// steady rise means the budget is the bottleneck in steady state, not just in a storm.
    waited: Counter,
    /// Seconds requests spent waiting (`flotilla_kube_api_wait_seconds_total`); its rate is
    /// how many requests are waiting on average.
    wait_seconds: Counter<f64>,
}

impl KubeApiRate {
    /// `qps` requests per second with room for `burst` at once.
    pub fn new(qps: f64, burst: u32) -> KubeApiRate {
        KubeApiRate {
            bucket: Arc::new(TokenBucket::new(qps, burst)),
            waited: Counter::default(),
            wait_seconds: Counter::default(),
        }
    }

    /// Registers the counts in `registry` (prefixed `flotilla_` by [`crate::registry`]).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "kube_api_requests_waited",
            "Requests to a Kubernetes apiserver that waited for the process's --kube-api-qps budget",
            self.waited.clone(),
        );
        registry.register_with_unit(
            "kube_api_wait",
            "Time requests to a Kubernetes apiserver spent waiting for the --kube-api-qps budget",
            prometheus_client::registry::Unit::Seconds,
            self.wait_seconds.clone(),
        );
    }

    /// Requests that waited for a token so far.
    pub fn waited(&self) -> u64 {
        self.waited.get()
    }
}

impl<S> tower::Layer<S> for KubeApiRate {
    type Service = RateLimited<S>;

    fn layer(&self, inner: S) -> RateLimited<S> {
        RateLimited {
            inner,
            rate: self.clone(),
            state: Permit::None,
        }
    }
}

/// A service whose every request first takes a token of a [`KubeApiRate`]. The wait happens in
/// `poll_ready`, so a client that queues its requests in front (kube's client buffers them)
/// keeps them in order while one waits.
pub struct RateLimited<S> {
    inner: S,
    rate: KubeApiRate,
    state: Permit,
}

impl<S> std::fmt::Debug for RateLimited<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimited").finish_non_exhaustive()
    }
}

/// Where the next request's token stands.
enum Permit {
    /// None reserved yet.
    None,
    /// Reserved, usable when the sleep ends.
    Waiting(Pin<Box<Sleep>>),
    /// Usable: the next `call` spends it.
    Held,
}

impl<S, R> tower::Service<R> for RateLimited<S>
where
    S: tower::Service<R>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        loop {
            match &mut self.state {
                Permit::None => {
                    let wait = self.rate.bucket.reserve(Instant::now());
                    if wait.is_zero() {
                        self.state = Permit::Held;
                    } else {
                        self.rate.waited.inc();
                        self.rate.wait_seconds.inc_by(wait.as_secs_f64());
                        self.state = Permit::Waiting(Box::pin(tokio::time::sleep(wait)));
                    }
                }
                Permit::Waiting(sleep) => {
                    std::task::ready!(sleep.as_mut().poll(cx));
                    self.state = Permit::Held;
                }
                Permit::Held => return self.inner.poll_ready(cx),
            }
        }
    }

    fn call(&mut self, request: R) -> Self::Future {
        debug_assert!(
            matches!(self.state, Permit::Held),
            "call without poll_ready"
        );
        self.state = Permit::None;
        self.inner.call(request)
    }
}

/// `--kube-api-qps` and `--kube-api-burst`: the budget of a hub's or gateway's requests to the
/// hub apiserver, client-go's names and meaning.
#[derive(Clone, Debug, clap::Args)]
pub struct KubeApiArgs {
    /// Requests per second this process sends to the hub kube-apiserver at most, all its
    /// clients together (client-go's QPS; watches count once when they open, their events do
    /// not). Requests over it wait, in order; none is dropped. The default is well above a
    /// 10,000-cluster fleet's steady state (status writes are budgeted lower still by
    /// --status-writes-per-second) and caps a storm: set it to the share of the apiserver's
    /// capacity (its API Priority and Fairness level) this process may take, and watch
    /// flotilla_kube_api_requests_waited_total: a steady rise means it is too low.
    #[arg(long, env = "FLOTILLA_KUBE_API_QPS", default_value_t = DEFAULT_KUBE_API_QPS)]
    pub kube_api_qps: f64,

    /// Requests this process may send at once after a quiet spell, beyond --kube-api-qps
    /// (client-go's Burst): room for a start's lists and a rollout's first writes.
    #[arg(long, env = "FLOTILLA_KUBE_API_BURST", default_value_t = DEFAULT_KUBE_API_BURST)]
    pub kube_api_burst: u32,
}

impl KubeApiArgs {
    /// Checks what clap cannot; errors say how to fix the flag.
    pub fn validate(&self) -> Result<(), String> {
        check_qps("--kube-api-qps", self.kube_api_qps)?;
        check_burst("--kube-api-burst", self.kube_api_burst)
    }

    /// The budget these flags give.
    pub fn rate(&self) -> KubeApiRate {
        KubeApiRate::new(self.kube_api_qps, self.kube_api_burst)
    }
}

/// Checks a QPS flag: a positive number, at most [`MAX_KUBE_API_RATE`].
pub fn check_qps(flag: &str, qps: f64) -> Result<(), String> {
    if !(qps.is_finite() && qps > 0.0) {
        return Err(format!(
            "{flag} {qps} would let no request through: give a positive number of requests per second"
        ));
    }
    if qps > MAX_KUBE_API_RATE {
        return Err(format!(
            "{flag} {qps} is above {MAX_KUBE_API_RATE}, which bounds nothing: give the share of the apiserver's capacity this process may take"
        ));
    }
    Ok(())
}

/// Checks a burst flag: at least 1, at most [`MAX_KUBE_API_RATE`].
pub fn check_burst(flag: &str, burst: u32) -> Result<(), String> {
    if burst == 0 {
        return Err(format!(
            "{flag} 0 would let no request through: give at least 1"
        ));
    }
    if f64::from(burst) > MAX_KUBE_API_RATE {
        return Err(format!(
            "{flag} {burst} is above {MAX_KUBE_API_RATE}, which bounds nothing"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tower::{Layer as _, Service as _, ServiceExt as _};

    const MS: Duration = Duration::from_millis(1);

    /// A full bucket hands out the burst at once, then one token per interval, each reserved
    /// in order with its own wait.
    #[tokio::test(start_paused = true)]
    async fn the_burst_at_once_then_the_rate_in_order() {
        let bucket = TokenBucket::new(10.0, 3);
        let now = Instant::now();
        let waits: Vec<Duration> = (0..6).map(|_| bucket.reserve(now)).collect();
        assert_eq!(
            waits,
            [
                Duration::ZERO,
                Duration::ZERO,
                Duration::ZERO,
                100 * MS,
                200 * MS,
                300 * MS
            ]
        );
        // A quiet second refills the bucket to its burst, never beyond.
        let later = now + Duration::from_secs(2);
        let free = (0..6).filter(|_| bucket.reserve(later).is_zero()).count();
        assert_eq!(free, 3);
    }

    /// The stub service behind the limiter: counts what reached it.
    #[derive(Clone, Default)]
    struct Apiserver {
        served: Arc<AtomicUsize>,
    }

    impl tower::Service<u32> for Apiserver {
        type Response = u32;
        type Error = std::convert::Infallible;
        type Future = std::future::Ready<Result<u32, Self::Error>>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, request: u32) -> Self::Future {
            self.served.fetch_add(1, Ordering::SeqCst);
            std::future::ready(Ok(request))
        }
    }

    /// Requests beyond the burst wait at the rate, and every one of them is served: over any
    /// stretch of simulated time no more than rate·t + burst reach the apiserver, and in the
    /// end all do. The waits are counted.
    #[tokio::test(start_paused = true)]
    async fn requests_beyond_the_burst_wait_at_the_rate_and_none_is_dropped() {
        let rate = KubeApiRate::new(50.0, 10);
        let apiserver = Apiserver::default();
        let served = apiserver.served.clone();
        // As kube's client does: a buffer in front, the limiter behind it.
        let service = tower::buffer::Buffer::new(rate.layer(apiserver), 1024);
        let mut requests = tokio::task::JoinSet::new();
        for i in 0..200u32 {
            let service = service.clone();
            requests.spawn(async move { service.oneshot(i).await });
        }
        tokio::task::yield_now().await;
        let start = Instant::now();
        for tenth in 1..=30u32 {
            tokio::time::sleep(100 * MS).await;
            let elapsed = (Instant::now() - start).as_secs_f64();
            let bound = (elapsed * 50.0).floor() as usize + 10;
            let now_served = served.load(Ordering::SeqCst);
            assert!(
                now_served <= bound,
                "{now_served} served after {tenth} tenths of a second, bound {bound}"
            );
        }
        // The rate is used, not just bounded: 10 at once, then 50 a second.
        assert!(served.load(Ordering::SeqCst) >= 150);
        let mut answered = Vec::new();
        while let Some(done) = requests.join_next().await {
            answered.push(done.unwrap().unwrap());
        }
        answered.sort_unstable();
        assert_eq!(answered, (0..200).collect::<Vec<_>>(), "none dropped");
        assert_eq!(rate.waited(), 190, "all but the burst waited");
    }

    /// A client built with the layer still talks to its apiserver (the layer fits kube's
    /// service stack) and spends one token per request.
    #[tokio::test(start_paused = true)]
    async fn one_token_per_request() {
        let rate = KubeApiRate::new(1.0, 2);
        let mut service = rate.layer(Apiserver::default());
        for i in 0..2 {
            let ready = service.ready().await.unwrap();
            assert_eq!(ready.call(i).await.unwrap(), i);
        }
        assert_eq!(rate.waited(), 0);
        let before = Instant::now();
        service.ready().await.unwrap().call(2).await.unwrap();
        assert_eq!(Instant::now() - before, Duration::from_secs(1));
        assert_eq!(rate.waited(), 1);
    }

    #[test]
    fn flags_refuse_zero_and_absurd_values_by_name() {
        let check = |qps: f64, burst: u32| {
            KubeApiArgs {
                kube_api_qps: qps,
                kube_api_burst: burst,
            }
            .validate()
        };
        assert_eq!(check(1000.0, 2000), Ok(()));
        assert_eq!(check(0.5, 1), Ok(()));
        for (qps, burst, want) in [
            (0.0, 10, "--kube-api-qps 0 would let no request through"),
            (f64::NAN, 10, "--kube-api-qps NaN"),
            (2e6, 10, "--kube-api-qps 2000000 is above"),
            (10.0, 0, "--kube-api-burst 0 would let no request through"),
            (10.0, 2_000_000, "--kube-api-burst 2000000 is above"),
        ] {
            let err = check(qps, burst).unwrap_err();
            assert!(err.contains(want), "{err:?} lacks {want:?}");
        }
    }
}
