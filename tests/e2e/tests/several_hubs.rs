//! One cluster, several hubs. Two real hubs (one on the kube backend, one on sled) and one real
//! spoke apiserver, served OCM's first way, an agent per hub (two `flotilla-agent` processes,
//! each with its own certificate from its hub, its own data directory and its own
//! `--hub-name`), and flotilla's own, one agent joined to both hubs.
//!
//! These agents are hosted agents (OCM's second way): they run off the spoke, on the test's
//! host, with a kubeconfig to the spoke's apiserver, which is the setup docs/operations.md
//! describes for an agent outside its cluster.

use std::path::Path;
use std::time::Duration;

use flotilla_e2e::proxy::{kubectl, kubectl_ok};
use flotilla_e2e::spoke::Spoke;
use flotilla_e2e::{Fleet, free_port, on_both_carriers, scrape, wait_for};
use nix::sys::signal::Signal;
use serde_json::{Value, json};

/// The hub names the two agents are given.
const DEPARTMENT: &str = "department";
const CENTRAL: &str = "central-it";

/// A work for `cluster1` of one ConfigMap `cm` in `default` with `data`.
fn configmap_work(name: &str, cm: &str, data: Value) -> Value {
    json!({
        "apiVersion": "work.open-cluster-management.io/v1", "kind": "ManifestWork",
        "metadata": {"name": name, "namespace": "cluster1"},
        "spec": {"workload": {"manifests": [{
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": cm, "namespace": "default"},
            "data": data,
        }]}},
    })
}

/// The spoke's ConfigMap `default/name` data, or `None` when it is not there.
async fn spoke_data(spoke: &Spoke, name: &str) -> anyhow::Result<Option<Value>> {
    Ok(spoke
        .config_map("default", name)
        .await?
        .map(|cm| json!(cm.data.unwrap_or_default())))
}

async fn wait_spoke_data(spoke: &Spoke, name: &str, want: Value) -> anyhow::Result<()> {
    wait_for(
        &format!("ConfigMap default/{name} on the spoke to hold {want}"),
        Duration::from_secs(60),
        || async {
            let got = spoke_data(spoke, name).await?;
            Ok((got.as_ref() == Some(&want)).then_some(()))
        },
    )
    .await
}

/// The first manifest's Applied condition of the work as `fleet`'s hub shows it.
fn manifest_applied(work: &Value) -> Option<&Value> {
    work["status"]["resourceStatus"]["manifests"][0]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == "Applied")
}

fn start_dir(dir: &Path, name: &str) -> anyhow::Result<std::path::PathBuf> {
    let sub = dir.join(name);
    std::fs::create_dir_all(&sub)?;
    Ok(sub)
}

on_both_carriers! {
    /// Each hub's works are delivered by its own agent; a ConfigMap both hubs apply keeps both
    /// hubs' keys, the overlapping key stays the first hub's and the second hub's work says so
    /// naming it; deleting the first hub's work leaves the object with the second hub's keys;
    /// the first hub killed does not stop the second hub's next work.
    async fn two_hubs_share_one_spoke_through_an_agent_each() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let dept_dir = start_dir(dir.path(), "department")?;
        let central_dir = start_dir(dir.path(), "central")?;
        let mut department = fleet_with_proxy(&dept_dir, true, DEPARTMENT_RULES).await?;
        let central = fleet_with_proxy(&central_dir, false, CENTRAL_RULES).await?;
        let spoke = Spoke::start(dir.path(), &department.hub, "cluster1").await?;
        // A short resync: a field one hub lets go is taken by the other within seconds.
        let fast = ["--resync-interval=2s"];
        let _dept_agent = spoke.start_agent_for_hub(dir.path(), &department.hub, DEPARTMENT, &fast)?;
        let _central_agent = spoke.start_agent_for_hub(dir.path(), &central.hub, CENTRAL, &fast)?;

        // Each hub's own work arrives through its own agent.
        department.apply_value(
            &dept_dir,
            &configmap_work("dept-only", "dept-settings", json!({"store": "7"})),
        )?;
        central.apply_value(
            &central_dir,
            &configmap_work("central-only", "central-settings", json!({"audit": "on"})),
        )?;
        department.wait_applied("cluster1", "dept-only").await?;
        central.wait_applied("cluster1", "central-only").await?;
        wait_spoke_data(&spoke, "dept-settings", json!({"store": "7"})).await?;
        wait_spoke_data(&spoke, "central-settings", json!({"audit": "on"})).await?;

        // One ConfigMap, both hubs: the department first.
        department.apply_value(
            &dept_dir,
            &configmap_work("dept-shared", "shared", json!({"store": "7", "tier": "gold"})),
        )?;
        department.wait_applied("cluster1", "dept-shared").await?;
        central.apply_value(
            &central_dir,
            &configmap_work("central-shared", "shared", json!({"audit": "on", "tier": "bronze"})),
        )?;
        let conflict = wait_for(
            "central-shared's manifest to report the conflict",
            Duration::from_secs(60),
            || async {
                let work = central.work("cluster1", "central-shared")?;
                Ok(work
                    .as_ref()
                    .and_then(manifest_applied)
                    .filter(|c| c["reason"] == "ApplyConflict")
                    .cloned())
            },
        )
        .await?;
        assert_eq!(conflict["status"], "False");
        let message = conflict["message"].as_str().unwrap_or_default();
        assert!(
            message.contains("hub department (flotilla-work-agent/department)")
                && message.contains(".data.tier"),
            "{message}"
        );
        // Both hubs' keys; the overlapping one stays the department's.
        wait_spoke_data(
            &spoke,
            "shared",
            json!({"store": "7", "tier": "gold", "audit": "on"}),
        )
        .await?;

        // Deleting the department's work leaves the object with central IT's keys, and central
        // IT then applies the key it no longer shares.
        department.cli(&["work", "delete", "dept-shared", "--clusters", "cluster1"])?;
        wait_spoke_data(&spoke, "shared", json!({"audit": "on", "tier": "bronze"})).await?;
        central.wait_applied("cluster1", "central-shared").await?;

        // kubectl through each hub's proxy front reaches the spoke through that hub's agent,
        // each hub's rules its own.
        kubectl_through_each_hub(&spoke, (&department, &dept_dir), (&central, &central_dir)).await?;

        // The department's hub dies; central IT's next work is applied all the same.
        department.hub.proc.signal_and_wait(Signal::SIGKILL);
        central.apply_value(
            &central_dir,
            &configmap_work("central-after", "central-after", json!({"after": "yes"})),
        )?;
        central.wait_applied("cluster1", "central-after").await?;
        wait_spoke_data(&spoke, "central-after", json!({"after": "yes"})).await?;
        // What the department's agent applied stays while its hub is away.
        assert_eq!(spoke_data(&spoke, "dept-settings").await?, Some(json!({"store": "7"})));
        Ok(())
    }
}

/// Access rules of the department's proxy front: its group may do anything on `cluster1`.
const DEPARTMENT_RULES: &str = r#"
rules:
  - name: department-staff
    groups: [department-staff]
    clusters: {names: [cluster1]}
    access: full
"#;

/// Access rules of central IT's proxy front: its group may only read `cluster1`.
const CENTRAL_RULES: &str = r#"
rules:
  - name: central-auditors
    groups: [central-auditors]
    clusters: {names: [cluster1]}
    access: readOnly
"#;

/// On the spoke, both hubs' kubectl groups may do anything with ConfigMaps: what one of them
/// may not do is its hub's proxy's refusal, not the spoke's.
async fn spoke_rbac_for_both_groups(client: kube::Client) -> anyhow::Result<()> {
    use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
    use kube::api::{Api, PostParams};
    let pp = PostParams::default();
    Api::<ClusterRole>::all(client.clone())
        .create(
            &pp,
            &serde_json::from_value(json!({
                "metadata": {"name": "configmaps"},
                "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["*"]}],
            }))?,
        )
        .await?;
    Api::<ClusterRoleBinding>::all(client)
        .create(&pp, &serde_json::from_value(json!({
            "metadata": {"name": "configmaps"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "configmaps"},
            "subjects": [
                {"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": "department-staff"},
                {"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": "central-auditors"},
            ],
        }))?)
        .await?;
    Ok(())
}

/// kubectl through each hub's proxy front, each with its own rules: the department's staff
/// read the shared ConfigMap (holding central IT's keys by then) and create one; central IT's
/// auditors read it, and their create is refused by their hub and never reaches the spoke.
async fn kubectl_through_each_hub(
    spoke: &Spoke,
    (department, dept_dir): (&Fleet, &Path),
    (central, central_dir): (&Fleet, &Path),
) -> anyhow::Result<()> {
    spoke_rbac_for_both_groups(spoke.env.client().await?).await?;
    let dora = department
        .hub
        .create_user(dept_dir, "dora", &["department-staff"])?;
    let ivan = central
        .hub
        .create_user(central_dir, "ivan", &["central-auditors"])?;
    for user in [&dora, &ivan] {
        let seen = kubectl_ok(
            user,
            &["get", "configmap", "shared", "-n", "default", "-o", "json"],
        )
        .await?;
        let seen: Value = serde_json::from_str(&seen)?;
        assert_eq!(
            seen["data"],
            json!({"audit": "on", "tier": "bronze"}),
            "{seen}"
        );
    }
    kubectl_ok(
        &dora,
        &["create", "configmap", "from-department", "-n", "default"],
    )
    .await?;
    assert!(
        spoke
            .config_map("default", "from-department")
            .await?
            .is_some()
    );
    let refused = kubectl(
        &ivan,
        &["create", "configmap", "from-central", "-n", "default"],
    )
    .await?;
    assert!(
        !refused.status.success(),
        "central IT's read-only rule let a write through"
    );
    assert!(
        spoke.config_map("default", "from-central").await?.is_none(),
        "central IT's proxy refused the write, yet it reached the spoke"
    );
    Ok(())
}

/// Waits until the one agent's `/metrics` at `address` shows each hub's session as `want`
/// says (1 connected, 0 not), each in its own `hub` series.
async fn wait_connected(address: &str, want: &[(&str, f64)]) -> anyhow::Result<()> {
    wait_for(
        &format!("the agent's hub_connected series to be {want:?}"),
        Duration::from_secs(60),
        || async {
            let page = scrape(address).await?;
            let all = want.iter().all(|(hub, value)| {
                page.value("flotilla_agent_hub_connected", &[("hub", hub)]) == Some(*value)
            });
            Ok(all.then_some(()))
        },
    )
    .await
}

/// A hub on `kube` or sled with its proxy front on, `rules` its access rules.
async fn fleet_with_proxy(dir: &Path, kube: bool, rules: &str) -> anyhow::Result<Fleet> {
    let flags = flotilla_e2e::proxy::proxy_flags(dir, rules, "")?;
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    Fleet::start_with(dir, kube, &flags).await
}

on_both_carriers! {
    /// One agent process joined to both hubs (`join --hub-name` twice into one data
    /// directory, `run` without `--hub`): each hub's works are delivered; a ConfigMap both hubs
    /// apply keeps both hubs' keys and the conflict names the other hub; deleting the
    /// department's work leaves central IT's object; kubectl through each hub's proxy front
    /// reaches the spoke under that hub's own access rules; the department's hub killed does
    /// not stop central IT's next work; `leave --hub department` takes only the department's
    /// objects, and the agent then serves central IT alone.
    async fn one_agent_serves_two_hubs() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let dept_dir = start_dir(dir.path(), "department")?;
        let central_dir = start_dir(dir.path(), "central")?;
        let mut department = fleet_with_proxy(&dept_dir, true, DEPARTMENT_RULES).await?;
        let central = fleet_with_proxy(&central_dir, false, CENTRAL_RULES).await?;
        let spoke = Spoke::start_unregistered(dir.path(), "cluster1").await?;
        let data = dir.path().join("cluster1-one-agent-data");
        spoke.join_hub(dir.path(), &department.hub, DEPARTMENT, &data).await?;
        spoke.join_hub(dir.path(), &central.hub, CENTRAL, &data).await?;
        let metrics = format!("127.0.0.1:{}", free_port()?);
        let metrics_flag = format!("--metrics-addr={metrics}");
        let fast = ["--resync-interval=2s"];
        let mut agent = spoke.start_agent_for_joined_hubs(
            dir.path(),
            &department.hub,
            &data,
            &[fast[0], &metrics_flag],
        )?;
        department.hub.wait_available("cluster1").await?;
        central.hub.wait_available("cluster1").await?;
        wait_connected(&metrics, &[(DEPARTMENT, 1.0), (CENTRAL, 1.0)]).await?;

        // Each hub's own work arrives through the one agent.
        department.apply_value(
            &dept_dir,
            &configmap_work("dept-only", "dept-settings", json!({"store": "7"})),
        )?;
        central.apply_value(
            &central_dir,
            &configmap_work("central-only", "central-settings", json!({"audit": "on"})),
        )?;
        department.wait_applied("cluster1", "dept-only").await?;
        central.wait_applied("cluster1", "central-only").await?;
        wait_spoke_data(&spoke, "dept-settings", json!({"store": "7"})).await?;
        wait_spoke_data(&spoke, "central-settings", json!({"audit": "on"})).await?;

        // One ConfigMap both hubs apply without overlapping: both hubs' keys, kept after the
        // department leaves (below).
        department.apply_value(
            &dept_dir,
            &configmap_work("dept-both", "both", json!({"dept": "yes"})),
        )?;
        central.apply_value(
            &central_dir,
            &configmap_work("central-both", "both", json!({"central": "yes"})),
        )?;
        department.wait_applied("cluster1", "dept-both").await?;
        central.wait_applied("cluster1", "central-both").await?;
        wait_spoke_data(&spoke, "both", json!({"dept": "yes", "central": "yes"})).await?;

        // One ConfigMap, both hubs, one key in common: the department first.
        department.apply_value(
            &dept_dir,
            &configmap_work("dept-shared", "shared", json!({"store": "7", "tier": "gold"})),
        )?;
        department.wait_applied("cluster1", "dept-shared").await?;
        central.apply_value(
            &central_dir,
            &configmap_work("central-shared", "shared", json!({"audit": "on", "tier": "bronze"})),
        )?;
        let conflict = wait_for(
            "central-shared's manifest to report the conflict",
            Duration::from_secs(60),
            || async {
                let work = central.work("cluster1", "central-shared")?;
                Ok(work
                    .as_ref()
                    .and_then(manifest_applied)
                    .filter(|c| c["reason"] == "ApplyConflict")
                    .cloned())
            },
        )
        .await?;
        assert_eq!(conflict["status"], "False");
        let message = conflict["message"].as_str().unwrap_or_default();
        assert!(
            message.contains("hub department (flotilla-work-agent/department)")
                && message.contains(".data.tier"),
            "{message}"
        );
        wait_spoke_data(
            &spoke,
            "shared",
            json!({"store": "7", "tier": "gold", "audit": "on"}),
        )
        .await?;

        // Deleting the department's work leaves the object with central IT's keys, and central
        // IT then applies the key it no longer shares.
        department.cli(&["work", "delete", "dept-shared", "--clusters", "cluster1"])?;
        wait_spoke_data(&spoke, "shared", json!({"audit": "on", "tier": "bronze"})).await?;
        central.wait_applied("cluster1", "central-shared").await?;

        // kubectl through each hub's proxy front reaches the spoke through the one agent, each
        // hub's rules its own.
        kubectl_through_each_hub(&spoke, (&department, &dept_dir), (&central, &central_dir)).await?;

        // The department's hub dies; central IT's next work is applied all the same.
        department.hub.proc.signal_and_wait(Signal::SIGKILL);
        central.apply_value(
            &central_dir,
            &configmap_work("central-after", "central-after", json!({"after": "yes"})),
        )?;
        central.wait_applied("cluster1", "central-after").await?;
        wait_spoke_data(&spoke, "central-after", json!({"after": "yes"})).await?;
        assert_eq!(spoke_data(&spoke, "dept-settings").await?, Some(json!({"store": "7"})));
        wait_connected(&metrics, &[(DEPARTMENT, 0.0), (CENTRAL, 1.0)]).await?;

        // The agent leaves the department: the department's objects go, the keys it shared
        // with central IT go from the object both apply, central IT's stay.
        agent.signal_and_wait(Signal::SIGTERM);
        let said = spoke.leave_hub(&data, DEPARTMENT)?;
        assert!(said.contains("left hub department: 2 of its works removed"), "{said}");
        assert_eq!(spoke_data(&spoke, "dept-settings").await?, None);
        assert_eq!(spoke_data(&spoke, "both").await?, Some(json!({"central": "yes"})));
        assert_eq!(spoke_data(&spoke, "central-settings").await?, Some(json!({"audit": "on"})));
        assert!(!data.join("hubs").join(DEPARTMENT).exists());

        // Started again, the agent serves central IT alone.
        let _agent = spoke.start_agent_for_joined_hubs(dir.path(), &central.hub, &data, &fast)?;
        central.apply_value(
            &central_dir,
            &configmap_work("central-alone", "central-alone", json!({"alone": "yes"})),
        )?;
        central.wait_applied("cluster1", "central-alone").await?;
        wait_spoke_data(&spoke, "central-alone", json!({"alone": "yes"})).await?;
        Ok(())
    }
}

on_both_carriers! {
    /// Failover mode: one agent joined to both hubs serves the department's hub (sled) alone,
    /// central IT's standing by; the department's hub SIGKILLed, the agent serves central IT
    /// within `--hub-unreachable-timeout` and applies its works, the department's objects left
    /// on the spoke; the department's hub back and the agent told so (`flotilla-agent failover
    /// --to department`), the department's next work applies and central IT's objects stay.
    async fn failover_moves_to_the_next_hub_and_back_when_told() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let dept_dir = start_dir(dir.path(), "department")?;
        let central_dir = start_dir(dir.path(), "central")?;
        let mut department = Fleet::start(&dept_dir, false).await?;
        let central = Fleet::start(&central_dir, true).await?;
        let spoke = Spoke::start_unregistered(dir.path(), "cluster1").await?;
        let data = dir.path().join("cluster1-failover-data");
        spoke.join_hub(dir.path(), &department.hub, DEPARTMENT, &data).await?;
        spoke.join_hub(dir.path(), &central.hub, CENTRAL, &data).await?;
        let metrics = format!("127.0.0.1:{}", free_port()?);
        let metrics_flag = format!("--metrics-addr={metrics}");
        let order = format!("--failover-order={DEPARTMENT},{CENTRAL}");
        let flags = [
            "--resync-interval=2s",
            "--hub-unreachable-timeout=3s",
            metrics_flag.as_str(),
            order.as_str(),
        ];
        let agent = spoke.start_agent_for_joined_hubs(dir.path(), &department.hub, &data, &flags)?;
        department.hub.wait_available("cluster1").await?;
        wait_connected(&metrics, &[(DEPARTMENT, 1.0), (CENTRAL, 0.0)]).await?;

        // The department's work applies; central IT's waits for its hub's turn.
        central.apply_value(
            &central_dir,
            &configmap_work("central-work", "central-settings", json!({"audit": "on"})),
        )?;
        department.apply_value(
            &dept_dir,
            &configmap_work("dept-work", "dept-settings", json!({"store": "7"})),
        )?;
        department.wait_applied("cluster1", "dept-work").await?;
        wait_spoke_data(&spoke, "dept-settings", json!({"store": "7"})).await?;
        assert_eq!(
            spoke_data(&spoke, "central-settings").await?,
            None,
            "central IT's work was applied while its hub stood by"
        );

        // The department's hub dies: the agent moves to central IT and applies its work; the
        // department's object stays, no longer enforced.
        department.hub.proc.signal_and_wait(Signal::SIGKILL);
        central.hub.wait_available("cluster1").await.map_err(|e| e.context(format!("agent log:\n{}", agent.log())))?;
        central.wait_applied("cluster1", "central-work").await?;
        wait_spoke_data(&spoke, "central-settings", json!({"audit": "on"})).await?;
        wait_connected(&metrics, &[(DEPARTMENT, 0.0), (CENTRAL, 1.0)]).await?;
        assert_eq!(spoke_data(&spoke, "dept-settings").await?, Some(json!({"store": "7"})));
        assert_eq!(std::fs::read_to_string(data.join("active-hub"))?.trim(), CENTRAL);

        // The department's hub is back; the operator moves the agent back to it.
        department.hub.restart(&dept_dir, &[]).await?;
        let said = spoke.fail_over(&data, DEPARTMENT)?;
        assert!(said.contains("active hub: department (was central-it)"), "{said}");
        wait_connected(&metrics, &[(DEPARTMENT, 1.0), (CENTRAL, 0.0)]).await?;
        department.apply_value(
            &dept_dir,
            &configmap_work("dept-after", "dept-after", json!({"back": "yes"})),
        )?;
        department.wait_applied("cluster1", "dept-after").await?;
        wait_spoke_data(&spoke, "dept-after", json!({"back": "yes"})).await?;
        assert_eq!(spoke_data(&spoke, "dept-settings").await?, Some(json!({"store": "7"})));
        assert_eq!(spoke_data(&spoke, "central-settings").await?, Some(json!({"audit": "on"})));
        Ok(())
    }
}
