//! Herd control, on both carriers: a real hub with a low new-session rate and a few hundred
//! agents (the agent library, in this process, each with its own certificate, real TLS on
//! loopback) dialling at once are let in at the rate — the hub's own count of admitted
//! connections never exceeds rate·t + burst over any window — while the rest are told when to
//! come back, and all end connected; a SIGTERM'd hub spreads its agents' reconnects over its
//! drain window and strands none; the agents of a SIGKILLed hub hear of it from the new one,
//! at their next packet, not by their heartbeat timeout.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use flotilla_agent::apply::MemoryCluster;
use flotilla_agent::cache::CacheDb;
use flotilla_agent::connect::{Dialer, Transport};
use flotilla_agent::{AgentConfig, Observer, Parts};
use flotilla_cli::client::{OperatorClient, OperatorConfig};
use flotilla_e2e::{Hub, current_carrier, on_both_carriers, scrape, wait_for};
use flotilla_proto::wire::{HubFrame, hub_frame};
use flotilla_transport::Carrier;
use futures::StreamExt as _;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::time::Instant;

/// Held for one push or one read, never across an await (the observer's calls are sync).
#[allow(clippy::disallowed_types)]
type SyncMutex<T> = std::sync::Mutex<T>;

/// What one agent's session loop reports, with when (this process's clock).
#[derive(Default)]
struct Seen {
    /// When each session reached Welcome.
    established: SyncMutex<Vec<Instant>>,
    /// Each time the hub said when to come back (a Drain received, or over TCP a connection
    /// turned away before TLS): when, and the retry-after.
    drains: SyncMutex<Vec<(Instant, Duration)>>,
    /// How many of those were told before TLS.
    before_tls: std::sync::atomic::AtomicUsize,
    /// Why each session that reached Welcome ended.
    closed: SyncMutex<Vec<String>>,
}

impl Seen {
    fn established(&self) -> Vec<Instant> {
        self.established.lock().unwrap().clone()
    }
    fn drains(&self) -> Vec<(Instant, Duration)> {
        self.drains.lock().unwrap().clone()
    }
    fn closed(&self) -> Vec<String> {
        self.closed.lock().unwrap().clone()
    }
}

impl Observer for Seen {
    fn session_established(&self) {
        self.established.lock().unwrap().push(Instant::now());
    }
    fn session_closed(&self, reason: &str) {
        self.closed.lock().unwrap().push(reason.to_string());
    }
    fn turned_away(&self, retry_after: Duration) {
        self.before_tls
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.drains
            .lock()
            .unwrap()
            .push((Instant::now(), retry_after));
    }
    fn frame_received(&self, frame: &HubFrame) {
        if let Some(hub_frame::Frame::Drain(drain)) = &frame.frame {
            let retry_after = Duration::from_millis(drain.retry_after_ms.into());
            self.drains
                .lock()
                .unwrap()
                .push((Instant::now(), retry_after));
        }
    }
}

/// Agents of this process: each its own cluster, certificate and observer.
struct Herd {
    seen: Vec<Arc<Seen>>,
    stops: Vec<tokio::sync::oneshot::Sender<()>>,
    tasks: Vec<tokio::task::JoinHandle<anyhow::Result<()>>>,
}

impl Herd {
    /// `n` clusters registered with `hub` (a certificate each from its CA, the key registered
    /// as accepted through the operator API), their agents started together with no startup
    /// jitter: a herd, on the test's carrier.
    async fn start(dir: &Path, hub: &Hub, n: usize) -> anyhow::Result<Herd> {
        let ca = flotilla_hub::ca::Ca::load_or_create(&hub.data_dir.join("ca"))?;
        let operator = Arc::new(OperatorClient::new(&OperatorConfig::load(
            &hub.data_dir.join("operator/config.yaml"),
        )?)?);
        let names: Vec<String> = (0..n).map(|i| format!("herd-{i:03}")).collect();
        let mut dirs = Vec::new();
        for name in &names {
            let issued = ca.issue_cluster(name, Duration::from_secs(24 * 3600))?;
            let out = dir.join("certs").join(name);
            flotilla_hub::ca::write_bundle(&out, &ca.bundle_pem(), &issued)?;
            let key = {
                use rustls_pki_types::{CertificateDer, pem::PemObject};
                let der = CertificateDer::from_pem_slice(issued.cert_pem.as_bytes())?;
                flotilla_transport::identity::public_key_sha256(&der)?
            };
            dirs.push((name.clone(), out, key));
        }
        let registered: Vec<anyhow::Result<(String, PathBuf)>> =
            futures::stream::iter(dirs.into_iter().map(|(name, out, key)| {
                let operator = operator.clone();
                async move {
                    operator
                        .request(
                            http::Method::POST,
                            &format!("/registration/v1/clusters/{name}/dev-key"),
                            Some(&serde_json::json!({ "keySha256": key })),
                        )
                        .await
                        .with_context(|| format!("registering {name}"))?;
                    Ok((name, out))
                }
            }))
            .buffered(8)
            .collect()
            .await;
        let db = CacheDb::temporary()?;
        let transport = match current_carrier() {
            Carrier::Grpc => Transport::Grpc,
            Carrier::Quic => Transport::Quic,
        };
        let mut herd = Herd {
            seen: Vec::new(),
            stops: Vec::new(),
            tasks: Vec::new(),
        };
        for registered in registered {
            let (name, certs) = registered?;
            let seen = Arc::new(Seen::default());
            let config = AgentConfig {
                hub: Some(hub.agents_addr.clone()),
                server_name: Some("localhost".into()),
                cluster_name: name.clone(),
                hub_name: None,
                cert_dir: Some(certs.clone()),
                proxy_url: None,
                kubeconfig: None,
                data_dir: dir.join("agents").join(&name),
                resync_interval: Duration::from_secs(300),
                apply_concurrency: 1,
                // The herd: every agent dials at once.
                initial_jitter: Duration::ZERO,
                max_backoff: Duration::from_secs(1),
                kubernetes_version: "v1.36.3".into(),
                transport,
                quic_congestion: Default::default(),
                feedback_interval: flotilla_agent::reconcile::DEFAULT_FEEDBACK_INTERVAL,
                max_tunnels: flotilla_agent::tunnel::DEFAULT_MAX_TUNNELS,
                tunnel_idle_timeout: flotilla_agent::tunnel::DEFAULT_TUNNEL_IDLE_TIMEOUT,
                spoke_kube_api_qps: flotilla_agent::config::DEFAULT_SPOKE_KUBE_API_QPS,
                spoke_kube_api_burst: flotilla_agent::config::DEFAULT_SPOKE_KUBE_API_BURST,
                failover_order: Vec::new(),
                hub_unreachable_timeout: Duration::from_secs(300),
                ops: Default::default(),
            };
            let (_, kubernetes_version) = tokio::sync::watch::channel("v1.36.3".to_string());
            let (_, cluster_info) = tokio::sync::watch::channel(Default::default());
            let parts = Parts {
                dialer: Dialer::new(&hub.agents_addr, "localhost", &certs)?
                    .with_transport(transport),
                cache: Arc::new(db.cluster(&name)),
                target: Arc::new(MemoryCluster::new()),
                spoke_api: Arc::new(flotilla_agent::SimulatedApi::new(10)),
                kubernetes_version,
                cluster_info,
                observer: seen.clone(),
                seed: Some(herd.seen.len() as u64),
                metrics: Default::default(),
                applied_once: flotilla_ops::ReadyFlag::new(
                    "the first apply pass (nobody probes this agent)",
                ),
            };
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            herd.tasks.push(tokio::spawn(async move {
                flotilla_agent::run_with(&config, parts, async {
                    let _ = stopped.await;
                })
                .await
                .map_err(anyhow::Error::from)
            }));
            herd.seen.push(seen);
            herd.stops.push(stop);
        }
        Ok(herd)
    }

    /// How many agents hold a session now (reached Welcome at least `sessions` times).
    fn with_sessions(&self, sessions: usize) -> usize {
        self.seen
            .iter()
            .filter(|s| s.established().len() >= sessions)
            .count()
    }

    async fn stop(self) -> anyhow::Result<()> {
        for stop in self.stops {
            let _ = stop.send(());
        }
        for task in self.tasks {
            task.await??;
        }
        Ok(())
    }
}

/// The hub's count of new connections with `outcome`, both carriers together.
fn new_connections(page: &flotilla_ops::exposition::Exposition, outcome: &str) -> f64 {
    ["grpc", "quic"]
        .iter()
        .map(|t| {
            page.value(
                "flotilla_gateway_new_connections_total",
                &[("outcome", outcome), ("transport", t)],
            )
            .unwrap_or(0.0)
        })
        .sum()
}

const RATE: u32 = 20;
const BURST: u32 = 5;
const AGENTS: usize = 200;

on_both_carriers! {
    /// 200 agents dialling at once a hub that takes 20 new sessions a second (burst 5): the
    /// hub's count of admitted connections, sampled throughout, never exceeds 20·t + 5 over
    /// any window from its start; the agents turned away were each told when to come back
    /// (counted as over_rate), before any TLS work (over TCP in a notice, over QUIC in the
    /// gateway's first answer), none was dropped into a blind backoff, and all 200 end
    /// connected.
    async fn a_herd_is_let_in_at_the_session_rate() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let d = dir.path();
        // Before the process exists: every admission it counts happens after this.
        let started = Instant::now();
        let hub = Hub::start(
            d,
            &[
                &format!("--session-rate={RATE}"),
                &format!("--session-burst={BURST}"),
                "--metrics-addr=127.0.0.1:0",
            ],
        )
        .await?;
        let metrics = hub.metrics_addr.clone().context("no metrics address")?;
        let herd = Herd::start(d, &hub, AGENTS).await?;

        // (scrape sent, scrape answered, admitted by then)
        let mut samples: Vec<(Instant, Instant, f64)> = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(180);
        loop {
            let sent = Instant::now();
            let page = scrape(&metrics).await?;
            let answered = Instant::now();
            samples.push((sent, answered, new_connections(&page, "admitted")));
            let sessions: f64 = ["grpc", "quic"]
                .iter()
                .filter_map(|t| page.value("flotilla_gateway_sessions", &[("transport", t)]))
                .sum();
            if herd.with_sessions(1) == AGENTS && sessions == AGENTS as f64 {
                break;
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "agents stranded: {} of {AGENTS} connected, {sessions} sessions on the hub\n{}",
                herd.with_sessions(1),
                hub.proc.log()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }

        // The bound, over every window between two samples and from the hub's start: the
        // count read by a scrape lies between its sending and its answer, so the window is
        // measured from the earlier sample's sending to the later one's answer.
        let bound = |from: Instant, to: Instant| {
            (to - from).as_secs_f64() * f64::from(RATE) + f64::from(BURST)
        };
        for (i, &(_, answered, admitted)) in samples.iter().enumerate() {
            assert!(
                admitted <= bound(started, answered),
                "{admitted} admitted within {:?} of the hub's start: more than {RATE}/s + {BURST}",
                answered - started
            );
            for &(sent, _, before) in &samples[..i] {
                assert!(
                    admitted - before <= bound(sent, answered),
                    "{} admitted within {:?}: more than {RATE}/s + {BURST}",
                    admitted - before,
                    answered - sent
                );
            }
        }
        let page = scrape(&metrics).await?;
        let admitted = new_connections(&page, "admitted");
        let over_rate = new_connections(&page, "over_rate");
        // The herd was larger than the burst: most were turned away at first.
        assert!(admitted >= AGENTS as f64, "{admitted} admitted");
        assert!(
            over_rate >= (AGENTS - BURST as usize) as f64 / 2.0,
            "{over_rate} over the rate for a herd of {AGENTS}"
        );
        // Every connection turned away told its agent when to come back, and the agent read
        // it; none was dropped into a blind backoff.
        let told: Vec<Duration> = herd
            .seen
            .iter()
            .flat_map(|s| s.drains())
            .map(|(_, retry_after)| retry_after)
            .collect();
        assert_eq!(
            told.len() as f64,
            over_rate,
            "a retry-after reached an agent for each connection over the rate"
        );
        // Each was told before any TLS work, on either carrier.
        let before_tls: usize = herd
            .seen
            .iter()
            .map(|s| s.before_tls.load(std::sync::atomic::Ordering::Relaxed))
            .sum();
        assert_eq!(before_tls, told.len(), "told before TLS, of {}", told.len());
        // Spread to come back at the rate, not together: as many distinct delays as the
        // rate separates (one interval apart), and the longest reaching past the burst's time.
        let distinct: std::collections::BTreeSet<u128> =
            told.iter().map(|d| d.as_millis()).collect();
        assert!(
            distinct.len() as f64 >= over_rate / 4.0,
            "{} distinct retry-afters for {over_rate} refusals",
            distinct.len()
        );
        let longest = told.iter().max().copied().unwrap_or_default();
        assert!(
            longest >= Duration::from_secs(((AGENTS as u32 - BURST) / RATE / 2) as u64),
            "the longest retry-after ({longest:?}) does not spread {AGENTS} agents at {RATE}/s"
        );
        herd.stop().await?;
        Ok(())
    }
}

const DRAIN_AGENTS: usize = 40;
const DRAIN_WINDOW: Duration = Duration::from_secs(6);

on_both_carriers! {
    /// A hub holding 40 sessions is SIGTERM'd with a 6 s drain window and started again on
    /// the same address: each agent was told a retry-after within the window, the retry-afters
    /// spread over it (not all in its first tenth), no agent came back before its
    /// retry-after, and every one is back.
    async fn a_sigterm_drain_spreads_the_reconnects_over_the_window() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let d = dir.path();
        let window = format!("--drain-window={}ms", DRAIN_WINDOW.as_millis());
        let flags = [window.as_str(), "--metrics-addr=127.0.0.1:0"];
        let mut hub = Hub::start(d, &flags).await?;
        let herd = Herd::start(d, &hub, DRAIN_AGENTS).await?;
        wait_for("every agent connected", Duration::from_secs(90), || async {
            Ok((herd.with_sessions(1) == DRAIN_AGENTS).then_some(()))
        })
        .await?;

        // A real SIGTERM; the hub drains and exits, and a new one starts on the same addresses.
        let signalled = Instant::now();
        kill(Pid::from_raw(hub.proc.pid() as i32), Signal::SIGTERM)?;
        let exit = hub.proc.exited_within(Duration::from_secs(60)).await;
        anyhow::ensure!(exit.is_some(), "the hub did not exit after SIGTERM:\n{}", hub.proc.log());
        let (agents, api) = (hub.agents_addr.clone(), hub.api_addr.clone());
        let hub = Hub::start_listening(d, &agents, &api, &flags).await?;

        wait_for(
            "every agent back",
            DRAIN_WINDOW + Duration::from_secs(60),
            || async { Ok((herd.with_sessions(2) == DRAIN_AGENTS).then_some(())) },
        )
        .await
        .with_context(|| hub.proc.log())?;

        let mut retry_afters = Vec::new();
        for (i, seen) in herd.seen.iter().enumerate() {
            let drains: Vec<(Instant, Duration)> = seen
                .drains()
                .into_iter()
                .filter(|(at, _)| *at >= signalled)
                .collect();
            anyhow::ensure!(drains.len() == 1, "agent {i}: drains {drains:?}");
            let (drained_at, retry_after) = drains[0];
            assert!(
                retry_after < DRAIN_WINDOW,
                "agent {i}: retry-after {retry_after:?} beyond the window"
            );
            let back = seen.established()[1];
            assert!(
                back >= drained_at + retry_after,
                "agent {i} came back {:?} after its drain, before its retry-after {retry_after:?}",
                back - drained_at
            );
            retry_afters.push(retry_after);
        }
        // Spread over the window: not all in its first tenth, and in most of its tenths.
        let tenth = DRAIN_WINDOW / 10;
        let late = retry_afters.iter().filter(|r| **r >= tenth).count();
        assert!(
            late >= DRAIN_AGENTS / 2,
            "only {late} of {DRAIN_AGENTS} told to wait beyond the window's first tenth: {retry_afters:?}"
        );
        let tenths: std::collections::BTreeSet<u32> = retry_afters
            .iter()
            .map(|r| (r.as_millis() / tenth.as_millis()) as u32)
            .collect();
        assert!(
            tenths.len() >= 6,
            "the retry-afters fall in only {} tenths of the window: {retry_afters:?}",
            tenths.len()
        );
        // The new hub holds them all.
        let metrics = hub.metrics_addr.clone().context("no metrics address")?;
        wait_for("the new hub's sessions", Duration::from_secs(30), || async {
            let page = scrape(&metrics).await?;
            let sessions: f64 = ["grpc", "quic"]
                .iter()
                .filter_map(|t| page.value("flotilla_gateway_sessions", &[("transport", t)]))
                .sum();
            Ok((sessions == DRAIN_AGENTS as f64).then_some(()))
        })
        .await?;
        herd.stop().await?;
        Ok(())
    }
}

const KILLED_AGENTS: usize = 5;

on_both_carriers! {
    /// A hub SIGKILLed under its sessions and started again on the same data dir and address:
    /// every agent learns its session is gone from the new process, at its next packet, not
    /// from its own heartbeat timeout. Over TCP the kernel resets a killed process's
    /// connections. Over QUIC a killed process sends nothing; the new one answers the agent's
    /// next packet on a connection it does not have with a stateless reset the agent can
    /// verify, its key derived from the hub's CA key, which outlives the process. And they
    /// come back resuming their TLS sessions with the tickets the killed process gave (their
    /// keys derived from the same CA key): the new process counts resumed handshakes.
    async fn agents_of_a_killed_hub_learn_it_from_the_new_one_not_by_timeout() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let d = dir.path();
        // Heartbeats every second, and a timeout long enough to tell the two apart.
        let flags = [
            "--heartbeat-interval=1s",
            "--heartbeat-timeout=60s",
            "--metrics-addr=127.0.0.1:0",
        ];
        let mut hub = Hub::start(d, &flags).await?;
        let herd = Herd::start(d, &hub, KILLED_AGENTS).await?;
        wait_for("every agent connected", Duration::from_secs(90), || async {
            Ok((herd.with_sessions(1) == KILLED_AGENTS).then_some(()))
        })
        .await?;

        hub.proc.signal_and_wait(Signal::SIGKILL);
        let (agents, api) = (hub.agents_addr.clone(), hub.api_addr.clone());
        let hub = Hub::start_listening(d, &agents, &api, &flags).await?;
        wait_for("every agent back", Duration::from_secs(120), || async {
            Ok((herd.with_sessions(2) == KILLED_AGENTS).then_some(()))
        })
        .await
        .with_context(|| hub.proc.log())?;

        for (i, seen) in herd.seen.iter().enumerate() {
            let closed = seen.closed();
            let first = closed.first().context("the first session's end was seen")?;
            assert!(
                !first.contains("heartbeat timeout"),
                "agent {i} waited for its heartbeat timeout instead of hearing from the new hub: {first}"
            );
        }
        // Each agent resumed, unless a dial of it met the new process before it served (closed
        // before TLS, counted not_ready, the ticket gone out with its hello): then it came back
        // in full.
        let metrics = hub.metrics_addr.clone().context("no metrics address")?;
        let page = scrape(&metrics).await?;
        let resumed = page
            .value("flotilla_gateway_tls_resumptions_total", &[])
            .context("no flotilla_gateway_tls_resumptions_total")?;
        let (admitted, not_ready) = (
            new_connections(&page, "admitted"),
            new_connections(&page, "not_ready"),
        );
        assert!(
            resumed + not_ready >= KILLED_AGENTS as f64 && resumed <= admitted,
            "{resumed} handshakes resumed, {admitted} admitted, {not_ready} closed before TLS, \
             for {KILLED_AGENTS} agents back"
        );
        herd.stop().await?;
        Ok(())
    }
}
