//! A real kube-apiserver for `--store kube` (and for the klusterlet baseline), and what the
//! harness reads from it: requests served, watches held, resident memory.
//!
//! The apiserver is the test environment's (`flotilla-testenv`: etcd and kube-apiserver built
//! from their Go modules, on loopback ports), with flotilla's CRDs (`deploy/crds`) installed.
//!
//! Counting requests: `apiserver_request_total` counts a request when it *finishes*, so a watch
//! opened during a window and still open at its end is not in the counter; the gauge
//! `apiserver_longrunning_requests` holds it instead. The load of a window is therefore, per
//! (verb, resource), the rise of the counter plus the rise of the gauge: every request that
//! started in the window, once. (A watch that opened before the window and closed within it adds
//! one to the counter and takes one from the gauge: nothing.) The apiserver does not count
//! `GET /metrics`, so reading it costs nothing here. v1.36 has no `apiserver_registered_watchers`;
//! the long-running WATCH gauge is how many watches it holds, including its own internal
//! informers' watches on its loopback client, which [`Apiserver::start`] counts once so reports
//! can tell them apart.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::Context;
use flotilla_testenv::TestEnv;
use tokio::time::Instant;

use crate::machine::ProcStats;
use crate::prometheus;
use crate::report::ApiserverLoad;

/// The counter of finished requests.
pub const REQUESTS_METRIC: &str = "apiserver_request_total";
/// The gauge of open long-running requests (watches, exec, proxy).
pub const LONGRUNNING_METRIC: &str = "apiserver_longrunning_requests";
/// How `requests_by_resource` names requests to non-resource paths (`/readyz`, `/version`).
pub const NON_RESOURCE: &str = "(non-resource)";

/// The directory of flotilla's CRDs in the repository the harness was built from.
pub fn crds_dir() -> PathBuf {
    flotilla_testenv::workspace_root().join("deploy/crds")
}

/// A kube-apiserver (with its etcd) that this process started; both stop when it is dropped.
pub struct Apiserver {
    env: TestEnv,
    /// Watches the apiserver held on its own (internal informers) once it was ready, before
    /// any client of the harness connected.
    own_watches: u64,
}

impl Apiserver {
    /// Starts etcd and kube-apiserver, installs the CRDs of `crds` and waits until they are
    /// Established.
    pub async fn start(crds: &Path) -> anyhow::Result<Apiserver> {
        Apiserver::start_serving(crds, &[]).await
    }

    /// [`Apiserver::start`] with `addresses` in its serving certificate, for clients that
    /// reach it through a relay on one of them (`--gateway-netns`).
    pub async fn start_serving(
        crds: &Path,
        addresses: &[std::net::IpAddr],
    ) -> anyhow::Result<Apiserver> {
        let env = TestEnv::start_serving(addresses)
            .await
            .context("starting a kube-apiserver and etcd from the test environment")?;
        env.install_crds(crds)
            .await
            .with_context(|| format!("installing the CRDs of {}", crds.display()))?;
        let mut apiserver = Apiserver {
            env,
            own_watches: 0,
        };
        apiserver.own_watches = apiserver.snapshot().await?.watches();
        Ok(apiserver)
    }

    /// An admin kubeconfig for the hub's `--kubeconfig`.
    pub fn kubeconfig_path(&self) -> &Path {
        self.env.kubeconfig_path()
    }

    /// `https://127.0.0.1:<port>`.
    pub fn url(&self) -> &str {
        self.env.server_url()
    }

    /// Its address, from [`Apiserver::url`].
    pub fn address(&self) -> anyhow::Result<std::net::SocketAddr> {
        let url = self.url();
        url.trim_start_matches("https://")
            .parse()
            .with_context(|| format!("the apiserver URL {url} is not https://<ip>:<port>"))
    }

    pub fn pid(&self) -> u32 {
        self.env.apiserver_pid()
    }

    /// A new admin client with its own connections (each call builds a new connection pool).
    pub async fn client(&self) -> anyhow::Result<kube::Client> {
        self.env.client().await
    }

    /// Watches the apiserver holds for itself (see the module docs).
    pub fn own_watches(&self) -> u64 {
        self.own_watches
    }

    /// The apiserver's counters and resident memory now.
    pub async fn snapshot(&self) -> anyhow::Result<ApiserverSnapshot> {
        let text = self
            .env
            .metrics()
            .await
            .with_context(|| format!("reading /metrics of the apiserver at {}", self.url()))?;
        let rss = ProcStats::read(&self.pid().to_string()).map(|s| s.rss_bytes);
        ApiserverSnapshot::parse(&text, rss)
            .with_context(|| format!("/metrics of the apiserver at {}", self.url()))
    }

    /// Stops kube-apiserver alone (etcd keeps the data) and waits until it has exited.
    pub fn stop_apiserver(&mut self) {
        // Blocking for at most the test environment's grace period.
        tokio::task::block_in_place(|| self.env.stop_apiserver());
    }

    /// Starts kube-apiserver again on the same port and etcd; returns once it is ready.
    pub async fn start_apiserver(&mut self) -> anyhow::Result<()> {
        self.env.start_apiserver().await
    }

    /// Stops kube-apiserver and etcd and waits until both have exited, off the runtime's
    /// threads (dropping an [`Apiserver`] does the same, blocking).
    pub async fn stop(self) {
        let _ = tokio::task::spawn_blocking(move || drop(self)).await;
    }
}

/// Requests and watches of one apiserver at one moment, keyed by (verb, resource).
#[derive(Clone, Debug, PartialEq)]
pub struct ApiserverSnapshot {
    /// `apiserver_request_total`, summed over response codes, scopes and versions.
    finished: BTreeMap<(String, String), f64>,
    /// `apiserver_longrunning_requests`, summed the same way.
    open: BTreeMap<(String, String), f64>,
    rss_bytes: Option<u64>,
    at: Instant,
}

impl ApiserverSnapshot {
    /// From the text of `/metrics` and the process's resident memory.
    pub fn parse(metrics: &str, rss_bytes: Option<u64>) -> anyhow::Result<ApiserverSnapshot> {
        let mut finished = BTreeMap::new();
        let mut open = BTreeMap::new();
        let mut seen_counter = false;
        for s in prometheus::samples(metrics, |n| n == REQUESTS_METRIC || n == LONGRUNNING_METRIC)?
        {
            let key = (s.label("verb").to_string(), resource_key(&s));
            let into = if s.name == REQUESTS_METRIC {
                seen_counter = true;
                &mut finished
            } else {
                &mut open
            };
            *into.entry(key).or_insert(0.0) += s.value;
        }
        anyhow::ensure!(
            seen_counter,
            "no {REQUESTS_METRIC} samples: is this a kube-apiserver's /metrics?"
        );
        Ok(ApiserverSnapshot {
            finished,
            open,
            rss_bytes,
            at: Instant::now(),
        })
    }

    /// Watches open now.
    pub fn watches(&self) -> u64 {
        self.open
            .iter()
            .filter(|((verb, _), _)| verb == "WATCH")
            .map(|(_, v)| *v)
            .sum::<f64>()
            .max(0.0) as u64
    }

    pub fn rss_bytes(&self) -> Option<u64> {
        self.rss_bytes
    }

    /// The load between `before` and this snapshot: every request that started in between
    /// (see the module docs), and the watches and memory at the end. `own_watches` is what the
    /// apiserver holds for itself.
    pub fn load_since(&self, before: &ApiserverSnapshot, own_watches: u64) -> ApiserverLoad {
        let mut per_key: BTreeMap<&(String, String), f64> = BTreeMap::new();
        for (key, v) in &self.finished {
            *per_key.entry(key).or_default() += v - before.finished.get(key).unwrap_or(&0.0);
        }
        for (key, v) in &self.open {
            *per_key.entry(key).or_default() += v - before.open.get(key).unwrap_or(&0.0);
        }
        for (key, v) in &before.open {
            if !self.open.contains_key(key) {
                *per_key.entry(key).or_default() -= v;
            }
        }
        let mut load = ApiserverLoad {
            window_s: self.at.duration_since(before.at).as_secs_f64(),
            watches_held: self.watches(),
            watches_held_by_clients: self.watches().saturating_sub(own_watches),
            rss_bytes: self.rss_bytes,
            ..Default::default()
        };
        for ((verb, resource), v) in per_key {
            // A counter only falls if the apiserver restarted, which the harness never does;
            // rounding keeps the gauge's float arithmetic out of the integers.
            let n = v.round().max(0.0) as u64;
            if n == 0 {
                continue;
            }
            load.requests += n;
            *load.requests_by_verb.entry(verb.clone()).or_default() += n;
            *load
                .requests_by_resource
                .entry(resource.clone())
                .or_default() += n;
            *load
                .requests_by_verb_resource
                .entry(format!("{verb} {resource}"))
                .or_default() += n;
        }
        load
    }
}

/// `resource` or `resource/subresource` (plural names, as in RBAC rules), or [`NON_RESOURCE`].
fn resource_key(s: &prometheus::Sample) -> String {
    match (s.label("resource"), s.label("subresource")) {
        ("", _) => NON_RESOURCE.to_string(),
        (r, "") => r.to_string(),
        (r, sub) => format!("{r}/{sub}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page(lines: &[(&str, &str, &str, &str, f64)]) -> String {
        lines
            .iter()
            .map(|(metric, verb, resource, sub, v)| {
                let code = if *metric == REQUESTS_METRIC {
                    r#"code="200","#
                } else {
                    ""
                };
                format!(
                    r#"{metric}{{{code}component="apiserver",group="g",resource="{resource}",scope="namespace",subresource="{sub}",verb="{verb}",version="v1"}} {v}"#
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    const R: &str = REQUESTS_METRIC;
    const L: &str = LONGRUNNING_METRIC;

    #[test]
    fn a_window_counts_each_request_that_started_in_it_once() {
        let before = ApiserverSnapshot::parse(
            &page(&[
                (R, "GET", "leases", "", 10.0),
                (R, "LIST", "manifestworks", "", 4.0),
                // Two watches of the apiserver itself and one of a client, open before.
                (L, "WATCH", "secrets", "", 2.0),
                (L, "WATCH", "manifestworks", "", 1.0),
            ]),
            Some(100),
        )
        .unwrap();
        let after = ApiserverSnapshot::parse(
            &page(&[
                (R, "GET", "leases", "", 10.0),
                (R, "PUT", "leases", "", 3.0),
                (R, "LIST", "manifestworks", "", 6.0),
                (R, "PATCH", "manifestworks", "status", 5.0),
                // The old client watch closed (counted now), five new ones are open.
                (R, "WATCH", "manifestworks", "", 1.0),
                (L, "WATCH", "secrets", "", 2.0),
                (L, "WATCH", "manifestworks", "", 5.0),
                (L, "WATCH", "managedclusters", "", 2.0),
            ]),
            Some(300),
        )
        .unwrap();
        assert_eq!(before.watches(), 3);
        assert_eq!(after.watches(), 9);
        let load = after.load_since(&before, 2);
        // PUT leases 3, LIST 2, PATCH 5, and seven watches opened (five on manifestworks,
        // two on managedclusters).
        assert_eq!(load.requests, 3 + 2 + 5 + 7);
        assert_eq!(
            load.requests_by_verb,
            [("LIST", 2), ("PATCH", 5), ("PUT", 3), ("WATCH", 7)]
                .map(|(k, v)| (k.to_string(), v))
                .into()
        );
        assert_eq!(
            load.requests_by_resource,
            [
                ("leases", 3),
                ("managedclusters", 2),
                ("manifestworks", 2 + 5),
                ("manifestworks/status", 5)
            ]
            .map(|(k, v)| (k.to_string(), v))
            .into()
        );
        assert_eq!(load.requests_by_verb.values().sum::<u64>(), load.requests);
        assert_eq!(
            load.requests_by_resource.values().sum::<u64>(),
            load.requests
        );
        assert_eq!(
            load.requests_by_verb_resource,
            [
                ("LIST manifestworks", 2),
                ("PATCH manifestworks/status", 5),
                ("PUT leases", 3),
                ("WATCH managedclusters", 2),
                ("WATCH manifestworks", 5)
            ]
            .map(|(k, v)| (k.to_string(), v))
            .into()
        );
        assert_eq!((load.watches_held, load.watches_held_by_clients), (9, 7));
        assert_eq!(load.rss_bytes, Some(300));
    }

    #[test]
    fn watches_that_close_are_not_new_requests() {
        let before = ApiserverSnapshot::parse(
            &page(&[
                (R, "GET", "x", "", 1.0),
                (L, "WATCH", "manifestworks", "", 4.0),
            ]),
            None,
        )
        .unwrap();
        // All four closed: the counter rose by four, the gauge series is gone.
        let after = ApiserverSnapshot::parse(
            &page(&[
                (R, "GET", "x", "", 1.0),
                (R, "WATCH", "manifestworks", "", 4.0),
            ]),
            None,
        )
        .unwrap();
        let load = after.load_since(&before, 0);
        assert_eq!(load.requests, 0, "{load:?}");
        assert!(load.requests_by_verb.is_empty());
        assert_eq!(load.watches_held, 0);
    }

    #[test]
    fn non_resource_requests_and_other_pages_are_told_apart() {
        let text = r#"apiserver_request_total{code="200",component="",dry_run="",group="",resource="",scope="",subresource="/readyz",verb="GET",version=""} 3
apiserver_request_total{code="500",component="",dry_run="",group="",resource="",scope="",subresource="/readyz",verb="GET",version=""} 2"#;
        let zero =
            ApiserverSnapshot::parse("apiserver_request_total{verb=\"GET\"} 0", None).unwrap();
        let load = ApiserverSnapshot::parse(text, None)
            .unwrap()
            .load_since(&zero, 0);
        assert_eq!(load.requests_by_resource[NON_RESOURCE], 5);
        let err = ApiserverSnapshot::parse("process_start_time_seconds 1", None).unwrap_err();
        assert!(
            err.to_string().contains("no apiserver_request_total"),
            "{err}"
        );
    }
}
