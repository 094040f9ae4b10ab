//! The fleet status page end to end: a real hub filled through its operator API with a few
//! hundred simulated clusters (ManagedClusters whose status says Available or not, as
//! gateways write it), one real agent with a live session, the real `flotilla dashboard` in
//! front of the hub, and headless Chromium reading the page as an operator's browser does.
//! Then the same page at 10,000 clusters, timed.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use flotilla_cli::client::{OperatorClient, OperatorConfig};
use flotilla_e2e::browser::{Browser, png_size};
use flotilla_e2e::{Fleet, Hub, Proc, bin, free_port, http_get, start_agent, wait_for};
use futures::{StreamExt as _, TryStreamExt as _};
use jiff::Timestamp;
use serde_json::{Value, json};
use tokio::time::Instant;

/// How long the page may take to show what was written (10,000 clusters' worth of watch
/// events included).
const WAIT: Duration = Duration::from_secs(120);
const CLUSTERS: &str = "/apis/cluster.open-cluster-management.io/v1/managedclusters";
/// The browser window the screenshots are taken in.
const WINDOW: (u32, u32) = (1280, 900);
/// Text a spoke or an operator could put in a condition message or a claim: it must show as
/// text, never become markup.
const HOSTILE: &str = "<img src=x onerror=alert(1)><script>alert(2)</script>";
/// What a spoke says when it cannot apply a manifest, shown verbatim.
const SPOKE_ERROR: &str = "configmaps \"baseline\" is forbidden: exceeded quota: compute-resources, \
                           requested: count/configmaps=1, used: count/configmaps=20, limited: count/configmaps=20";

/// A simulated cluster of the fleet.
struct Simulated {
    name: String,
    labels: Value,
    /// (status of Available, since when), or None when it is Available.
    failing: Option<(&'static str, Timestamp)>,
    message: String,
}

fn simulated(i: usize, failing_every: usize) -> Simulated {
    let name = format!("store-{i:04}");
    // Failing clusters failed longer ago the larger their number: the page's order (longest
    // failing first) is then not the names' order.
    let failing = (i % failing_every == 7).then(|| {
        let status = if (i / failing_every).is_multiple_of(2) {
            "False"
        } else {
            "Unknown"
        };
        let since: Timestamp = "2026-11-01T00:00:00Z".parse().expect("a time");
        let since = since - jiff::SignedDuration::from_hours(i as i64);
        (status, since)
    });
    let message = if i == 32 {
        HOSTILE.to_string()
    } else {
        format!("{name}: no session for 5m")
    };
    Simulated {
        labels: json!({"region": if i.is_multiple_of(2) { "eu" } else { "us" }, "tier": "store"}),
        name,
        failing,
        message,
    }
}

impl Simulated {
    async fn create(&self, client: &OperatorClient) -> anyhow::Result<()> {
        let object = json!({
            "apiVersion": "cluster.open-cluster-management.io/v1", "kind": "ManagedCluster",
            "metadata": {"name": self.name, "labels": self.labels},
            "spec": {"hubAcceptsClient": true},
        });
        client
            .request(http::Method::POST, CLUSTERS, Some(&object))
            .await
            .with_context(|| format!("creating ManagedCluster {}", self.name))?;
        self.write_status(client).await
    }

    /// Writes the cluster's status as a gateway does: Available or failing since when.
    async fn write_status(&self, client: &OperatorClient) -> anyhow::Result<()> {
        let condition = match self.failing {
            Some((status, since)) => json!({
                "type": "ManagedClusterConditionAvailable", "status": status,
                "lastTransitionTime": since.to_string(),
                "reason": "ManagedClusterLeaseUpdateStopped", "message": self.message,
            }),
            None => json!({
                "type": "ManagedClusterConditionAvailable", "status": "True",
                "lastTransitionTime": "2026-10-01T00:00:00Z",
                "reason": "ManagedClusterAvailable", "message": "Managed cluster is available",
            }),
        };
        let status = json!({
            "metadata": {"name": self.name},
            "status": {
                "conditions": [condition],
                "version": {"kubernetes": "v1.31.4"},
                "clusterClaims": [{"name": "note.example.com", "value": self.message}],
            },
        });
        client
            .request(
                http::Method::PUT,
                &format!("{CLUSTERS}/{}/status", self.name),
                Some(&status),
            )
            .await
            .with_context(|| format!("writing the status of ManagedCluster {}", self.name))?;
        Ok(())
    }
}

/// Creates clusters `0..n` (every `failing_every`th failing) through the operator API, a few
/// requests at a time; returns the failing ones, longest failing first (the page's order).
async fn fill(
    client: &OperatorClient,
    n: usize,
    failing_every: usize,
) -> anyhow::Result<Vec<Simulated>> {
    let clusters: Vec<Simulated> = (0..n).map(|i| simulated(i, failing_every)).collect();
    futures::stream::iter(clusters.iter().map(|c| c.create(client)))
        .buffer_unordered(8)
        .try_collect::<()>()
        .await?;
    let mut failing: Vec<Simulated> = clusters
        .into_iter()
        .filter(|c| c.failing.is_some())
        .collect();
    failing.sort_by_key(|c| c.failing.map(|(_, since)| since));
    Ok(failing)
}

fn operator_client(hub: &Hub) -> anyhow::Result<OperatorClient> {
    OperatorClient::new(&OperatorConfig::load(
        &hub.data_dir.join("operator/config.yaml"),
    )?)
}

/// `flotilla dashboard` for `hub` on a free loopback port, once it answers for the page.
async fn dashboard(dir: &std::path::Path, hub: &Hub) -> anyhow::Result<(Proc, String)> {
    let port = free_port()?;
    let mut cmd = std::process::Command::new(bin("flotilla"));
    cmd.env("FLOTILLA_CONFIG", hub.data_dir.join("operator/config.yaml"))
        .args(["dashboard", "--port", &port.to_string()]);
    let proc = Proc::spawn("flotilla dashboard", cmd, dir.join("dashboard.log"))?;
    let address = format!("127.0.0.1:{port}");
    Ok((proc, address))
}

/// Waits until the page, through the dashboard, counts `clusters` clusters, `failing` failing.
async fn wait_summary(address: &str, clusters: usize, failing: usize) -> anyhow::Result<()> {
    wait_for(
        &format!("the status page to count {clusters} clusters, {failing} failing"),
        WAIT,
        || async {
            let (status, body) = http_get(address, "/ui/api/summary").await?;
            if status != 200 {
                return Ok(None);
            }
            let summary: Value = serde_json::from_str(&body)?;
            Ok(
                (summary["clusters"] == clusters && summary["failingClusters"] == failing)
                    .then_some(()),
            )
        },
    )
    .await
}

/// The `data-cluster` names of the rows of table `id` in a page's DOM, in order.
fn rows(dom: &str, id: &str) -> Vec<String> {
    let Some(start) = dom.find(&format!("<table id=\"{id}\"")) else {
        return Vec::new();
    };
    let table = &dom[start..];
    let table = &table[..table.find("</table>").unwrap_or(table.len())];
    table
        .split("data-cluster=\"")
        .skip(1)
        .filter_map(|s| s.split('"').next())
        .map(str::to_string)
        .collect()
}

/// Where screenshots go: `$FLOTILLA_SCREENSHOTS` to look at them afterwards, else the test's
/// temporary directory. Never the repository.
fn screenshot_path(dir: &std::path::Path, name: &str) -> anyhow::Result<std::path::PathBuf> {
    let dir = std::env::var_os("FLOTILLA_SCREENSHOTS")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| dir.to_path_buf());
    std::fs::create_dir_all(&dir)?;
    let path = dir.join(name);
    // A screenshot left by an earlier run must not pass for this run's.
    let _ = std::fs::remove_file(&path);
    Ok(path)
}

fn names(clusters: &[&Simulated]) -> Vec<String> {
    clusters.iter().map(|c| c.name.clone()).collect()
}

/// On the embedded store: the single-node hub an operator starts first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_screen_lists_the_failing_clusters_and_since_when() -> anyhow::Result<()> {
    first_screen(false).await
}

/// The same page on the kube backend: the hub's apiserver is a real one, and the page's rows
/// come from its watches, shared with the fleet gauges (`--metrics-addr` on).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_screen_lists_the_failing_clusters_on_the_kube_backend() -> anyhow::Result<()> {
    first_screen(true).await
}

async fn first_screen(kube: bool) -> anyhow::Result<()> {
    let browser = Browser::find()?;
    let dir = tempfile::tempdir()?;
    // With the gauges on (kube), the page's caches ride their watches; without, their own.
    let extra: &[&str] = if kube {
        &["--metrics-addr=127.0.0.1:0"]
    } else {
        &[]
    };
    let fleet = Fleet::start_with(dir.path(), kube, extra).await?;
    let hub = &fleet.hub;
    if let Some(env) = &fleet.hub_env {
        // Namespaced objects need their namespace on a real apiserver.
        let out = env
            .kubectl()
            .args(["create", "namespace", "ops"])
            .output()?;
        anyhow::ensure!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let out = env
            .kubectl()
            .args(["create", "namespace", "store-0007"])
            .output()?;
        anyhow::ensure!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let client = operator_client(hub)?;
    let failing = fill(&client, 300, 25).await?;
    assert_eq!(failing.len(), 12);

    // One failing cluster's work, with the spoke's error, as the gateway writes it.
    let works = "/apis/work.open-cluster-management.io/v1/namespaces/store-0007/manifestworks";
    client
        .request(
            http::Method::POST,
            works,
            Some(&json!({
                "apiVersion": "work.open-cluster-management.io/v1", "kind": "ManifestWork",
                "metadata": {"name": "baseline"},
                "spec": {"workload": {"manifests": [{"apiVersion": "v1", "kind": "ConfigMap",
                    "metadata": {"name": "baseline", "namespace": "default"}}]}},
            })),
        )
        .await?;
    client
        .request(
            http::Method::PUT,
            &format!("{works}/baseline/status"),
            Some(&json!({"metadata": {"name": "baseline"}, "status": {
                "conditions": [{"type": "Applied", "status": "False", "reason": "AppliedManifestWorkFailed",
                    "message": "Failed to apply manifest work", "lastTransitionTime": "2026-11-01T00:00:00Z"}],
                "resourceStatus": {"manifests": [{
                    "resourceMeta": {"ordinal": 0, "group": "", "version": "v1", "kind": "ConfigMap",
                        "resource": "configmaps", "namespace": "default", "name": "baseline"},
                    "conditions": [{"type": "Applied", "status": "False", "reason": "AppliedManifestFailed",
                        "message": SPOKE_ERROR, "lastTransitionTime": "2026-11-01T00:00:00Z"}]}]},
            }})),
        )
        .await?;
    // A placement with no ManagedClusterSetBinding in its namespace decides no cluster.
    client
        .request(
            http::Method::POST,
            "/apis/cluster.open-cluster-management.io/v1beta1/namespaces/ops/placements",
            Some(&json!({
                "apiVersion": "cluster.open-cluster-management.io/v1beta1", "kind": "Placement",
                "metadata": {"name": "canary", "namespace": "ops"}, "spec": {"numberOfClusters": 1},
            })),
        )
        .await?;
    // And one real agent, whose session the page shows.
    let certs = dir.path().join("store-live");
    hub.dev_cert("store-live", &certs)?;
    let _agent = start_agent(dir.path(), hub, "store-live", &certs)?;

    let (_dashboard, address) = dashboard(dir.path(), hub).await?;
    wait_summary(&address, 301, 12).await?;

    // The first screen: the failing clusters, longest failing first, each with since when.
    let url = format!("http://{address}/ui/");
    let dom = browser.dump_dom(&url).await?;
    let longest_first: Vec<&Simulated> = failing.iter().collect();
    assert_eq!(
        rows(&dom, "failing"),
        names(&longest_first),
        "first screen:\n{dom}"
    );
    assert!(dom.contains("Failing right now: 12 clusters"), "{dom}");
    for c in &failing {
        let (_, since) = c.failing.expect("failing");
        let shown = since.strftime("%Y-%m-%d %H:%M:%S UTC").to_string();
        assert!(
            dom.contains(&shown),
            "{} failing since {shown} is not shown",
            c.name
        );
    }
    // The placement that decides nothing is an alert on the same screen.
    assert!(dom.contains("data-placement=\"ops/canary\""), "{dom}");
    // The hostile message is text on the page, not markup.
    assert!(!dom.contains("<img") && !dom.contains("<script"), "{dom}");
    assert!(
        dom.contains("&lt;img src=x onerror=alert(1)&gt;&lt;script&gt;alert(2)&lt;/script&gt;"),
        "{dom}"
    );
    let first_screen = screenshot_path(dir.path(), "first-screen.png")?;
    browser.screenshot(&url, &first_screen, WINDOW).await?;
    assert_eq!(png_size(&first_screen)?, WINDOW);

    // A filtered view: failing clusters whose name holds "store-01", and only those.
    let url = format!("http://{address}/ui/clusters?state=failing&q=store-01");
    let dom = browser.dump_dom(&url).await?;
    let matching: Vec<&Simulated> = longest_first
        .iter()
        .copied()
        .filter(|c| c.name.contains("store-01"))
        .collect();
    assert_eq!(matching.len(), 4);
    assert_eq!(
        rows(&dom, "clusters"),
        names(&matching),
        "filtered view:\n{dom}"
    );
    let filtered = screenshot_path(dir.path(), "filtered.png")?;
    browser.screenshot(&url, &filtered, WINDOW).await?;
    assert_eq!(png_size(&filtered)?, WINDOW);

    // By label, as kubectl -l writes it.
    let dom = browser
        .dump_dom(&format!(
            "http://{address}/ui/clusters?state=failing&selector=region%3Deu"
        ))
        .await?;
    let in_eu: Vec<&Simulated> = longest_first
        .iter()
        .copied()
        .filter(|c| c.labels["region"] == "eu")
        .collect();
    assert_eq!(
        rows(&dom, "clusters"),
        names(&in_eu),
        "label filter:\n{dom}"
    );

    // The live cluster: its session's carrier, seen now.
    let dom = browser
        .dump_dom(&format!("http://{address}/ui/clusters?q=store-live"))
        .await?;
    assert_eq!(rows(&dom, "clusters"), ["store-live"]);
    assert!(
        dom.contains("<td>grpc</td>") && dom.contains("session live"),
        "{dom}"
    );

    // The failing work, with the spoke's words.
    let dom = browser
        .dump_dom(&format!(
            "http://{address}/ui/works?state=failing&cluster=store-0007"
        ))
        .await?;
    assert!(dom.contains("data-work=\"store-0007/baseline\""), "{dom}");
    assert!(
        dom.contains(SPOKE_ERROR),
        "the spoke's message verbatim:\n{dom}"
    );

    // A cluster that recovers leaves the first screen once the store says so.
    let recovered = Simulated {
        failing: None,
        ..simulated(282, 25)
    };
    assert_eq!(recovered.name, longest_first[0].name);
    recovered.write_status(&client).await?;
    wait_summary(&address, 301, 11).await?;
    let dom = browser.dump_dom(&format!("http://{address}/ui/")).await?;
    assert_eq!(rows(&dom, "failing"), names(&longest_first[1..]), "{dom}");

    // The headline counts the work and the placement too, and their lists show them.
    let (_, body) = http_get(&address, "/ui/api/summary").await?;
    let summary: Value = serde_json::from_str(&body)?;
    assert_eq!(
        (
            &summary["failingWorks"],
            &summary["placementsWithoutDecisions"]
        ),
        (&json!(1), &json!(1)),
        "{summary}"
    );
    let (status, body) = http_get(&address, "/ui/placements?state=failing").await?;
    assert_eq!(status, 200);
    assert!(body.contains("data-placement=\"ops/canary\""), "{body}");
    let (status, body) = http_get(&address, "/ui/rollouts").await?;
    assert_eq!(status, 200);
    assert!(body.contains("No rollout matches."), "{body}");

    // Paging: no answer holds more than one page.
    let (status, body) = http_get(&address, "/ui/api/clusters?limit=100&page=2").await?;
    assert_eq!(status, 200, "{body}");
    let page: Value = serde_json::from_str(&body)?;
    assert_eq!(
        (&page["total"], &page["page"], &page["pages"]),
        (&json!(301), &json!(2), &json!(4))
    );
    assert_eq!(page["items"].as_array().map(Vec::len), Some(100));
    let (status, body) = http_get(&address, "/ui/api/clusters?limit=100000").await?;
    assert_eq!(status, 400);
    assert!(body.contains("at most 500 rows per page"), "{body}");

    // Only an operator reads the page: a kubectl user's certificate is refused by the hub.
    // (Its kubeconfig needs the proxy front, which this hub does not serve; the certificate
    // is written first, and that is what is used here.)
    let kubeconfig = dir.path().join("alice.kubeconfig");
    hub.cli(&[
        "user",
        "create",
        "alice",
        "-o",
        &kubeconfig.to_string_lossy(),
    ])?;
    let operator = hub.data_dir.join("operator");
    let alice = OperatorClient::new(&OperatorConfig {
        server: format!("https://{}", hub.api_addr),
        proxy_server: None,
        certificate_authority: operator.join("ca.crt"),
        client_certificate: operator.join("users/alice/tls.crt"),
        client_key: operator.join("users/alice/tls.key"),
    })?;
    let refused = alice.get_raw("/ui/").await?;
    assert_eq!(refused.status(), http::StatusCode::FORBIDDEN);
    // And the dashboard forwards reads of the page only.
    let (status, _) = http_get(&address, "/registration/v1/tokens").await?;
    assert_eq!(status, 404);
    Ok(())
}

/// Medians of `runs` timed calls of `f`, in milliseconds, and the last result.
async fn median_ms<T, F, Fut>(runs: usize, mut f: F) -> anyhow::Result<(f64, T)>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = anyhow::Result<T>>,
{
    let mut times = Vec::with_capacity(runs);
    let mut last = None;
    for _ in 0..runs {
        let start = Instant::now();
        last = Some(f().await?);
        times.push(start.elapsed().as_secs_f64() * 1000.0);
    }
    times.sort_by(f64::total_cmp);
    Ok((times[runs / 2], last.context("at least one run")?))
}

/// 10,000 clusters, 200 failing: the first screen, a filtered view and the JSON API each
/// answer with one page, timed (medians printed; docs/performance.md has the figures); the
/// whole-fleet list the CLI reads is timed beside them as the baseline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_answers_with_one_page_at_ten_thousand_clusters() -> anyhow::Result<()> {
    const FLEET: usize = 10_000;
    const RUNS: usize = 21;
    let dir = tempfile::tempdir()?;
    let hub = Hub::start(dir.path(), &[]).await?;
    let client = Arc::new(operator_client(&hub)?);
    let filled = Instant::now();
    let failing = fill(&client, FLEET, 50).await?;
    eprintln!(
        "filled {FLEET} clusters ({} failing) in {:?}",
        failing.len(),
        filled.elapsed()
    );
    let (_dashboard, address) = dashboard(dir.path(), &hub).await?;
    wait_summary(&address, FLEET, failing.len()).await?;

    let get = |path: &'static str| {
        let client = client.clone();
        move || {
            let client = client.clone();
            async move {
                let answer = client.get_raw(path).await?;
                anyhow::ensure!(
                    answer.status().is_success(),
                    "GET {path}: {}",
                    answer.status()
                );
                Ok(String::from_utf8_lossy(answer.body()).into_owned())
            }
        }
    };
    let (first_screen_ms, first_screen) = median_ms(RUNS, get("/ui/")).await?;
    let (filtered_ms, filtered) =
        median_ms(RUNS, get("/ui/clusters?state=failing&q=store-09")).await?;
    let (api_ms, api) = median_ms(RUNS, get("/ui/api/clusters?state=failing")).await?;
    let (dashboard_ms, through_dashboard) = median_ms(RUNS, || async {
        let (status, body) = http_get(&address, "/ui/").await?;
        anyhow::ensure!(status == 200, "GET /ui/ through the dashboard: {status}");
        Ok(body)
    })
    .await?;
    let (list_ms, list) = median_ms(RUNS, get(CLUSTERS)).await?;

    // One page each: the first 50 failing clusters, longest failing first.
    let longest: Vec<String> = failing.iter().take(50).map(|c| c.name.clone()).collect();
    assert_eq!(rows(&first_screen, "failing"), longest);
    assert_eq!(rows(&through_dashboard, "failing"), longest);
    let in_09: Vec<String> = failing
        .iter()
        .filter(|c| c.name.contains("store-09"))
        .map(|c| c.name.clone())
        .collect();
    assert_eq!(rows(&filtered, "clusters"), in_09);
    let api: Value = serde_json::from_str(&api)?;
    assert_eq!(api["total"], failing.len());
    assert_eq!(api["items"].as_array().map(Vec::len), Some(50));
    // What a page ships is a page, not the fleet.
    assert!(
        first_screen.len() * 20 < list.len(),
        "the first screen ({} bytes) is not much smaller than the fleet's list ({} bytes)",
        first_screen.len(),
        list.len()
    );

    // The browser's view at this size, for the record.
    let browser = Browser::find()?;
    let url = format!("http://{address}/ui/");
    let (browser_ms, dom) = median_ms(3, || browser.dump_dom(&url)).await?;
    assert_eq!(rows(&dom, "failing"), longest);
    let shot = screenshot_path(dir.path(), "first-screen-10k.png")?;
    browser.screenshot(&url, &shot, WINDOW).await?;
    assert_eq!(png_size(&shot)?, WINDOW);

    eprintln!(
        "status page at {FLEET} clusters ({} failing), median of {RUNS} (browser: of 3):",
        failing.len()
    );
    eprintln!(
        "  GET /ui/ (first screen, hub)                 {first_screen_ms:8.1} ms  {:>9} bytes",
        first_screen.len()
    );
    eprintln!("  GET /ui/ (through flotilla dashboard)        {dashboard_ms:8.1} ms");
    eprintln!(
        "  GET /ui/clusters?state=failing&q=store-09    {filtered_ms:8.1} ms  {:>9} bytes",
        filtered.len()
    );
    eprintln!("  GET /ui/api/clusters?state=failing           {api_ms:8.1} ms");
    eprintln!(
        "  baseline: GET managedclusters (whole fleet)  {list_ms:8.1} ms  {:>9} bytes",
        list.len()
    );
    eprintln!("  chromium --dump-dom of /ui/ (incl. start)    {browser_ms:8.1} ms");
    Ok(())
}
