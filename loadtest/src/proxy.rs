//! The `proxy` scenario: kubectl-shaped requests through the hub's proxy front and the agents'
//! tunnels, beside the same requests sent directly, in the same run.
//!
//! The simulated clusters have no apiserver: each agent forwards to an in-process responder
//! ([`SimulatedApi`]), and the direct path is the same responder served over HTTPS on loopback
//! (TLS, HTTP/1.1, one kept-alive connection, as kubectl holds one). So the difference between
//! the two paths is what the hub, the gateway, the carrier and the agent add. Measured:
//! small-GET latency (p50, p99) direct and through a tunnel, interleaved so both see the same
//! noise, and the added latency; a large list's throughput both ways and their ratio; and one
//! request to every cluster at once (each its own tunnel on its own session), all of which must
//! succeed.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use bytes::Bytes;
use flotilla_agent::{SimulatedApi, SpokeApi};
use http_body_util::{BodyExt as _, Empty};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use serde::{Deserialize, Serialize};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::report::{Percentiles, ScenarioReport};
use crate::scenario::{Clock, Run, bounded};
use crate::swarm::PROXY_LIST_ITEMS;

/// The load test's kubectl user and group (the access rules the harness gives its hub allow
/// the group every cluster).
pub const PROXY_USER: &str = "flotilla-loadtest";
/// Small GETs per path.
pub const SMALL_GETS: usize = 1_000;
/// The small object's path and the large list's, on a cluster.
const SMALL: &str = "/api/v1/namespaces/default";
const LARGE: &str = "/api/v1/configmaps";

/// The hub flags the harness adds so that `proxy` can run: the front on a free port, a rule
/// letting the load test's group reach every cluster, and limits above the scenario's
/// concurrency.
pub fn hub_args(data_dir: &std::path::Path) -> anyhow::Result<Vec<String>> {
    let rules = data_dir.join("loadtest-access-rules.yaml");
    std::fs::write(
        &rules,
        format!(
            "rules:\n- name: loadtest\n  groups: [{PROXY_USER}]\n  clusters: {{selector: {{}}}}\n  access: full\n"
        ),
    )?;
    Ok(vec![
        "--proxy-listen=127.0.0.1:0".into(),
        format!("--proxy-access-rules={}", rules.display()),
        "--proxy-max-per-user=1000000".into(),
    ])
}

/// What `proxy` measured.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct ProxyReport {
    /// The cluster the latency and throughput requests went to.
    pub cluster: String,
    /// A small GET answered directly, and through the tunnel.
    pub direct_get: Percentiles,
    pub tunnel_get: Percentiles,
    /// tunnel minus direct, p50 and p99 (goal: at most 1 ms and 5 ms).
    pub added_p50_ms: f64,
    pub added_p99_ms: f64,
    /// Bytes of the large list, and its median throughput each way.
    pub list_bytes: u64,
    pub direct_list_mb_s: f64,
    pub tunnel_list_mb_s: f64,
    /// tunnel / direct (goal: at least 0.9).
    pub list_ratio: f64,
    /// One request to every cluster at once: how many, how many answered 200, their latency
    /// and how long all took.
    pub concurrent_tunnels: u64,
    pub concurrent_ok: u64,
    pub concurrent: Percentiles,
    pub concurrent_wall_s: f64,
}

impl Run {
    /// `proxy`: see the module docs.
    pub async fn proxy(&mut self) -> ScenarioReport {
        let mut r = ScenarioReport::new("proxy", self.identities.len());
        let clock = Clock::new(self.args.timeout);
        let mut p = ProxyReport::default();
        let result = bounded(&clock, self.proxy_inner(&clock, &mut p)).await;
        r.proxy = Some(p);
        self.conclude(&mut r, &clock, result).await;
        r
    }

    async fn proxy_inner(&mut self, clock: &Clock, p: &mut ProxyReport) -> anyhow::Result<bool> {
        self.ensure_connected(clock).await?;
        let listen: flotilla_hub::ListenInfo = serde_json::from_str(&std::fs::read_to_string(
            flotilla_hub::ListenInfo::path(&self.hub.data_dir),
        )?)?;
        let proxy = listen.proxy.context(
            "the hub serves no proxy front: start it with --proxy-listen (the harness does for the hubs it starts)",
        )?;
        let tls = self.proxy_user_tls().await?;
        let (direct, _server) = serve_directly(&self.hub).await?;
        let cluster = self.identities[0].name.clone();
        p.cluster = cluster.clone();

        // Small GETs, interleaved.
        let mut to_direct = Client::open(direct, &tls).await?;
        let mut to_tunnel = Client::open(proxy, &tls).await?;
        let through = |path: &str| format!("/clusters/{cluster}{path}");
        let (mut direct_us, mut tunnel_us) = (Vec::new(), Vec::new());
        for _ in 0..SMALL_GETS {
            direct_us.push(to_direct.get(SMALL).await?.1.as_micros() as u64);
            tunnel_us.push(to_tunnel.get(&through(SMALL)).await?.1.as_micros() as u64);
        }
        p.direct_get = Percentiles::from_micros(&direct_us);
        p.tunnel_get = Percentiles::from_micros(&tunnel_us);
        p.added_p50_ms = p.tunnel_get.p50_ms - p.direct_get.p50_ms;
        p.added_p99_ms = p.tunnel_get.p99_ms - p.direct_get.p99_ms;

        // Large lists, interleaved; medians.
        let (mut direct_rates, mut tunnel_rates) = (Vec::new(), Vec::new());
        for _ in 0..self.args.proxy_lists {
            let (bytes, took) = to_direct.get(LARGE).await?;
            p.list_bytes = bytes;
            direct_rates.push(bytes as f64 / took.as_secs_f64() / 1e6);
            let (bytes, took) = to_tunnel.get(&through(LARGE)).await?;
            anyhow::ensure!(
                bytes == p.list_bytes,
                "the list through the tunnel lost bytes"
            );
            tunnel_rates.push(bytes as f64 / took.as_secs_f64() / 1e6);
        }
        p.direct_list_mb_s = median(&mut direct_rates);
        p.tunnel_list_mb_s = median(&mut tunnel_rates);
        p.list_ratio = p.tunnel_list_mb_s / p.direct_list_mb_s;

        // One request to every cluster at once, each on its own connection.
        let names: Vec<String> = self.identities.iter().map(|i| i.name.clone()).collect();
        let mut clients = Vec::with_capacity(names.len());
        for name in &names {
            clients.push((name.clone(), Client::open(proxy, &tls).await?));
        }
        let start = Arc::new(tokio::sync::Barrier::new(clients.len() + 1));
        let mut requests = JoinSet::new();
        for (name, mut client) in clients {
            let start = start.clone();
            requests.spawn(async move {
                start.wait().await;
                client.get(&format!("/clusters/{name}{SMALL}")).await
            });
        }
        start.wait().await;
        let began = Instant::now();
        let mut latencies = Vec::new();
        let mut failures = Vec::new();
        while let Some(done) = requests.join_next().await {
            match done? {
                Ok((_, took)) => latencies.push(took.as_micros() as u64),
                Err(e) => failures.push(format!("{e:#}")),
            }
        }
        p.concurrent_wall_s = began.elapsed().as_secs_f64();
        p.concurrent_tunnels = names.len() as u64;
        p.concurrent_ok = latencies.len() as u64;
        p.concurrent = Percentiles::from_micros(&latencies);
        anyhow::ensure!(
            failures.is_empty(),
            "{} of {} concurrent requests failed, e.g. {}",
            failures.len(),
            names.len(),
            failures[0]
        );
        Ok(true)
    }

    /// The load test's kubectl user: a key made here, its certificate signed by the hub CA
    /// through the operator API (as `flotilla user create` does); a TLS client for it.
    pub(crate) async fn proxy_user_tls(&self) -> anyhow::Result<Arc<rustls::ClientConfig>> {
        let key = rcgen::KeyPair::generate()?;
        let mut params = rcgen::CertificateParams::default();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, PROXY_USER);
        let csr = params.serialize_request(&key)?.pem()?;
        let issued = self
            .api
            .request(
                http::Method::POST,
                "/registration/v1/users",
                Some(&serde_json::json!({"user": PROXY_USER, "groups": [PROXY_USER], "csr": csr})),
            )
            .await?;
        let text = |f: &str| issued[f].as_str().unwrap_or_default().as_bytes().to_vec();
        Ok(flotilla_transport::tls::client_config(
            &text("ca"),
            &text("certificate"),
            key.serialize_pem().as_bytes(),
            &[b"http/1.1"],
        )?)
    }
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or_default()
}

/// A kept-alive HTTPS/1.1 connection, as kubectl holds one.
pub(crate) struct Client {
    sender: SendRequest<Empty<Bytes>>,
    _connection: JoinSet<()>,
}

impl Client {
    pub(crate) async fn open(
        address: SocketAddr,
        tls: &Arc<rustls::ClientConfig>,
    ) -> anyhow::Result<Client> {
        let tcp = TcpStream::connect(address).await?;
        tcp.set_nodelay(true)?;
        let name = rustls_pki_types::ServerName::try_from("127.0.0.1")?;
        let stream = tokio_rustls::TlsConnector::from(tls.clone())
            .connect(name, tcp)
            .await?;
        let (sender, connection) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        let mut owner = JoinSet::new();
        owner.spawn(async move {
            let _ = connection.await;
        });
        Ok(Client {
            sender,
            _connection: owner,
        })
    }

    /// GETs `path`, reads the whole body; its length and the time from sending to the last byte.
    pub(crate) async fn get(&mut self, path: &str) -> anyhow::Result<(u64, Duration)> {
        let request = http::Request::get(path)
            .header(http::header::HOST, "127.0.0.1")
            .header(http::header::ACCEPT, "application/json")
            .body(Empty::new())?;
        let started = Instant::now();
        self.sender.ready().await?;
        let response = self.sender.send_request(request).await?;
        let status = response.status();
        let body = response.into_body().collect().await?.to_bytes();
        let took = started.elapsed();
        anyhow::ensure!(
            status == http::StatusCode::OK,
            "GET {path}: {status}: {}",
            String::from_utf8_lossy(&body[..body.len().min(300)])
        );
        Ok((body.len() as u64, took))
    }
}

/// The simulated cluster's responder served directly over HTTPS on loopback: the baseline.
async fn serve_directly(hub: &crate::fleet::Hub) -> anyhow::Result<(SocketAddr, JoinSet<()>)> {
    let (ca, chain, key) = hub.serving_identity(&["127.0.0.1"])?;
    let tls =
        flotilla_transport::tls::server_config(ca.as_bytes(), chain.as_bytes(), key.as_bytes())?;
    let mut tls = (*tls).clone();
    tls.alpn_protocols = vec![b"http/1.1".to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(tls));
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let address = listener.local_addr()?;
    let api = Arc::new(SimulatedApi::new(PROXY_LIST_ITEMS));
    let mut tasks = JoinSet::new();
    tasks.spawn(async move {
        let mut connections = JoinSet::new();
        while let Ok((tcp, _)) = listener.accept().await {
            let _ = tcp.set_nodelay(true);
            let (acceptor, api) = (acceptor.clone(), api.clone());
            connections.spawn(async move {
                let Ok(stream) = acceptor.accept(tcp).await else {
                    return;
                };
                let service = hyper::service::service_fn(
                    move |request: http::Request<hyper::body::Incoming>| {
                        let api = api.clone();
                        async move {
                            let request = request.map(|b| {
                                b.map_err(flotilla_agent::spoke_api::BoxError::from).boxed()
                            });
                            api.send(request).await
                        }
                    },
                );
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    Ok((address, tasks))
}
