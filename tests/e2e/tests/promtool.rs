//! Operators' own tools on flotilla's outputs: Prometheus' `promtool` checks the real `/metrics`
//! page of every process that serves one (`check metrics`, Prometheus' naming and typing lint)
//! and the alert rules of `deploy/prometheus` (`check rules`, and `test rules` with their unit
//! tests); the metric names the alerts use are read off the real pages, so renaming a metric
//! breaks this file before it breaks an operator's alerts.
//!
//! promtool is built from its Go module by `deploy/testenv/build.sh --promtool`, and found
//! through `FLOTILLA_PROMTOOL_BIN` (scripts/test.sh sets it).

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write as _;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::Context as _;
use flotilla_e2e::spoke::Spoke;
use flotilla_e2e::{
    Fleet, GatewayProc, free_port, http_get, http_get_accepting, hub_apiserver, scrape,
    start_agent, wait_for,
};
use flotilla_testenv::workspace_root;

const RULES: &str = "deploy/prometheus/flotilla-rules.yaml";
const RULE_TESTS: &str = "deploy/prometheus/flotilla-rules.test.yaml";
const SEED_WORK: &str = "proto/tests/fixtures/manifestwork_my_first_work.yaml";
const WAIT: Duration = Duration::from_secs(60);

/// The promtool binary of `FLOTILLA_PROMTOOL_BIN`; an error saying how to build it when the
/// variable is unset or the binary missing.
fn promtool() -> anyhow::Result<PathBuf> {
    const HOW: &str = "build it with `deploy/testenv/build.sh --promtool` and export \
        FLOTILLA_PROMTOOL_BIN=$(deploy/testenv/build.sh --promtool | tail -n 1) \
        (scripts/test.sh does both)";
    let dir = std::env::var_os("FLOTILLA_PROMTOOL_BIN")
        .with_context(|| format!("FLOTILLA_PROMTOOL_BIN is unset: {HOW}"))?;
    let promtool = PathBuf::from(dir).join("promtool");
    anyhow::ensure!(
        promtool.is_file(),
        "{} does not exist: {HOW}",
        promtool.display()
    );
    Ok(promtool)
}

/// Runs promtool with `args` in the workspace root, `stdin` on its standard input; its
/// output when it succeeds, an error with everything it said when it does not.
fn run_promtool(args: &[&str], stdin: &str) -> anyhow::Result<String> {
    let mut child = Command::new(promtool()?)
        .args(args)
        .current_dir(workspace_root())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting promtool")?;
    child
        .stdin
        .take()
        .context("promtool's stdin")?
        .write_all(stdin.as_bytes())?;
    let out = child.wait_with_output()?;
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    anyhow::ensure!(
        out.status.success(),
        "promtool {} failed ({}):\n{said}",
        args.join(" "),
        out.status
    );
    Ok(said)
}

/// `/metrics` at `address` in the Prometheus text format, the one `promtool check metrics`
/// reads, after checking that the page Prometheus itself is served (OpenMetrics) reads too.
async fn text_page(address: &str) -> anyhow::Result<String> {
    scrape(address).await?;
    let (status, body) =
        http_get_accepting(address, "/metrics", "text/plain;version=0.0.4").await?;
    anyhow::ensure!(
        status == 200,
        "GET /metrics from {address}: {status} {body}"
    );
    Ok(body)
}

/// `promtool check metrics` on the page of `what` at `address`: no lint problem at all.
async fn check_metrics(what: &str, address: &str) -> anyhow::Result<String> {
    let page = text_page(address).await?;
    let said = run_promtool(&["check", "metrics"], &page)
        .with_context(|| format!("the /metrics of {what}:\n{page}"))?;
    // promtool exits 0 on a clean page and says nothing; anything it says is a problem.
    anyhow::ensure!(
        said.trim().is_empty(),
        "promtool on the /metrics of {what}:\n{said}"
    );
    Ok(page)
}

/// Metric names on a page in the text format: every sample's name.
fn sample_names(page: &str) -> BTreeSet<String> {
    page.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_string)
        .collect()
}

/// The alert rules, by group: (alert, expression).
fn alert_groups() -> anyhow::Result<BTreeMap<String, Vec<(String, String)>>> {
    let text = std::fs::read_to_string(workspace_root().join(RULES))?;
    let file: serde_json::Value = yaml_serde::from_str(&text).context(RULES)?;
    let mut groups = BTreeMap::new();
    for group in file["groups"].as_array().context("no groups")? {
        let name = group["name"].as_str().context("a group without a name")?;
        let alerts = group["rules"]
            .as_array()
            .with_context(|| format!("group {name} has no rules"))?
            .iter()
            .map(|rule| {
                let alert = rule["alert"].as_str().context("a rule that is no alert")?;
                let expr = rule["expr"].as_str().context("an alert without expr")?;
                Ok((alert.to_string(), expr.to_string()))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        groups.insert(name.to_string(), alerts);
    }
    Ok(groups)
}

/// flotilla's metric names in a PromQL expression (every flotilla metric starts `flotilla_`;
/// no PromQL function, keyword or label name does).
fn metric_names(expr: &str) -> BTreeSet<String> {
    expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
        .filter(|word| word.starts_with("flotilla_"))
        .map(str::to_string)
        .collect()
}

/// Every metric the alerts of `group` use is a sample on `page`, the process that serves them.
fn alerts_read_the_page(group: &str, what: &str, page: &str) -> anyhow::Result<()> {
    let groups = alert_groups()?;
    let alerts = groups
        .get(group)
        .with_context(|| format!("{RULES} has no group {group}"))?;
    let served = sample_names(page);
    for (alert, expr) in alerts {
        let names = metric_names(expr);
        anyhow::ensure!(
            !names.is_empty(),
            "{alert} reads no flotilla metric: {expr}"
        );
        for name in names {
            anyhow::ensure!(
                served.contains(&name),
                "alert {alert} reads {name}, which the /metrics of {what} does not serve"
            );
        }
    }
    Ok(())
}

/// The rule file passes `promtool check rules` (with its lint fatal) and its unit tests; every
/// alert has a unit test in which it fires; and the operations guide points to the file
/// instead of keeping a copy of the rules that could drift from it.
#[test]
fn the_alert_rules_pass_promtool_and_their_unit_tests() -> anyhow::Result<()> {
    let alerts: BTreeSet<String> = alert_groups()?
        .into_values()
        .flatten()
        .map(|(alert, _)| alert)
        .collect();
    let checked = run_promtool(&["check", "rules", "--lint-fatal", RULES], "")?;
    let found = format!("SUCCESS: {} rules found", alerts.len());
    assert!(checked.contains(&found), "{checked}");
    let tested = run_promtool(&["test", "rules", RULE_TESTS], "")?;
    assert!(tested.contains("SUCCESS"), "{tested}");

    let tests: serde_json::Value =
        yaml_serde::from_str(&std::fs::read_to_string(workspace_root().join(RULE_TESTS))?)?;
    let fired: BTreeSet<&str> = tests["tests"]
        .as_array()
        .context("no tests")?
        .iter()
        .flat_map(|t| t["alert_rule_test"].as_array().into_iter().flatten())
        .filter(|case| case["exp_alerts"].as_array().is_some_and(|a| !a.is_empty()))
        .filter_map(|case| case["alertname"].as_str())
        .collect();
    for alert in &alerts {
        assert!(
            fired.contains(alert.as_str()),
            "{RULE_TESTS} has no case in which {alert} fires"
        );
    }

    let guide = std::fs::read_to_string(workspace_root().join("docs/operations.md"))?;
    assert!(
        guide.contains(RULES),
        "docs/operations.md does not point to {RULES}"
    );
    for line in guide.lines() {
        assert!(
            !line.trim_start().starts_with("- alert:") && !line.trim_start().starts_with("expr:"),
            "docs/operations.md keeps a copy of a rule; it should point to {RULES}: {line}"
        );
    }
    Ok(())
}

/// A single-node hub (its own metrics and its in-process gateway's) and an agent, after a
/// cluster joined and a work was applied on its real spoke: both pages pass `promtool check
/// metrics`, and every metric an alert reads is on the page of the process it is meant for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_node_hub_and_an_agent_pass_promtool_check_metrics() -> anyhow::Result<()> {
    promtool()?;
    let dir = tempfile::tempdir()?;
    let d = dir.path();
    let fleet = Fleet::start_with(d, true, &["--metrics-addr=127.0.0.1:0"]).await?;
    let hub = fleet
        .hub
        .metrics_addr
        .clone()
        .context("the hub wrote no metrics address")?;
    let spoke = Spoke::start(d, &fleet.hub, "cluster1").await?;
    let agent = format!("127.0.0.1:{}", free_port()?);
    let agent_flag = format!("--metrics-addr={agent}");
    let _agent = spoke.start_agent(d, &fleet.hub, &[agent_flag.as_str()])?;
    fleet.apply(&workspace_root().join(SEED_WORK))?;
    fleet.wait_applied("cluster1", "my-first-work").await?;
    // A policy, so that the compliance gauge has a series for promtool to read.
    fleet.apply(&workspace_root().join("proto/tests/data/policies/policy-namespace.yaml"))?;
    wait_for("the policy's compliance series", WAIT, || async {
        let page = scrape(&hub).await?;
        let root = page.value(
            "policy_governance_info",
            &[("type", "root"), ("policy", "policy-namespace")],
        );
        Ok(root.map(drop))
    })
    .await?;
    wait_for("the agent's apply counted", WAIT, || async {
        let page = scrape(&agent).await?;
        let applies = page.value("flotilla_agent_work_apply_duration_seconds_count", &[]);
        Ok(applies.is_some_and(|n| n >= 1.0).then_some(()))
    })
    .await?;

    let hub_page = check_metrics("the single-node hub", &hub).await?;
    let agent_page = check_metrics("the agent", &agent).await?;
    alerts_read_the_page("flotilla.fleet", "the hub", &hub_page)?;
    alerts_read_the_page("flotilla.agent", "the agent", &agent_page)?;
    Ok(())
}

/// A hub with `--gateways external` and a `flotilla-gateway` replica, after an agent joined
/// through the gateway: both pages pass `promtool check metrics`, and the hub's still serves
/// every metric the fleet alerts read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_replica_and_its_hub_pass_promtool_check_metrics() -> anyhow::Result<()> {
    promtool()?;
    let dir = tempfile::tempdir()?;
    let d = dir.path();
    let (env, kc) = hub_apiserver().await?;
    let shards = ["--shards=4", "--lease-duration=3s", "--renew-period=1s"];
    let mut hub_flags = vec![
        "--store=kube",
        "--kubeconfig",
        kc.as_str(),
        "--gateways=external",
        "--metrics-addr=127.0.0.1:0",
    ];
    hub_flags.extend(shards);
    let hub = flotilla_e2e::Hub::start(d, &hub_flags).await?;
    let hub_metrics = hub.metrics_addr.clone().context("no hub metrics address")?;
    let certs = hub.gateway_cert(d)?;
    let metrics = format!("127.0.0.1:{}", free_port()?);
    let metrics_flag = format!("--metrics-addr={metrics}");
    let mut flags = vec![metrics_flag.as_str()];
    flags.extend(shards);
    let gateway = GatewayProc::start(d, "gw-1", env.kubeconfig_path(), &certs, &flags)?;
    wait_for("the gateway ready", WAIT, || async {
        Ok((http_get(&metrics, "/readyz").await.ok().map(|r| r.0) == Some(200)).then_some(()))
    })
    .await
    .with_context(|| gateway.proc.log())?;

    hub.dev_cert("cluster1", &d.join("cluster1"))?;
    let _agent = start_agent(d, &hub, "cluster1", &d.join("cluster1"))?;
    wait_for("the agent's session on the gateway", WAIT, || async {
        let page = scrape(&metrics).await?;
        let open: f64 = ["grpc", "quic"]
            .iter()
            .filter_map(|t| page.value("flotilla_gateway_sessions", &[("transport", t)]))
            .sum();
        Ok((open == 1.0).then_some(()))
    })
    .await
    .with_context(|| gateway.proc.log())?;

    check_metrics("the gateway replica", &metrics).await?;
    let hub_page = check_metrics("the hub with --gateways external", &hub_metrics).await?;
    alerts_read_the_page("flotilla.fleet", "the hub", &hub_page)?;
    Ok(())
}
