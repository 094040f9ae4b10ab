//! Governance end to end: a policy placed on a real spoke's cluster reaches its agent over the
//! session, is evaluated against the spoke's own apiserver, and its compliance comes back to
//! the hub (the cluster's ClusterCompliance record and the root Policy's status); switched to
//! `enforce` it makes the spoke comply, repairs drift made by hand, and keeps doing so while
//! the hub is down. (The spoke is a bare apiserver: a namespace deleted there stays
//! Terminating for want of a controller manager, so drift is made on a ConfigMap.) Each carrier runs on one backend: gRPC with the sled store, QUIC with the
//! kube store, so both of each are covered without running four hubs.

use std::path::Path;
use std::time::Duration;

use flotilla_cli::client::{OperatorClient, OperatorConfig};
use flotilla_e2e::spoke::Spoke;
use flotilla_e2e::{Carrier, Fleet, current_carrier, on_both_carriers, wait_compliance, wait_for};
use flotilla_proto::api::Kind;
use flotilla_testenv::workspace_root;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use kube::api::{Api, Patch, PatchParams};
use nix::sys::signal::Signal;
use serde_json::{Value, json};

/// Long enough for a session to open, a policy to travel and an evaluation to report, on a
/// loaded machine; every wait ends as soon as its condition holds.
const WAIT: Duration = Duration::from_secs(90);

fn example(name: &str) -> std::path::PathBuf {
    workspace_root()
        .join("proto/tests/data/policies")
        .join(name)
}

/// The namespace example (namespace `prod` must exist) as written (in the applier's namespace,
/// `default`), with `remediation` for the policy and its template.
fn namespace_policy(dir: &Path, remediation: &str) -> anyhow::Result<std::path::PathBuf> {
    let text = std::fs::read_to_string(example("policy-namespace.yaml"))?;
    anyhow::ensure!(
        text.contains("remediationAction: inform"),
        "the example changed"
    );
    let path = dir.join(format!("policy-namespace-{remediation}.yaml"));
    std::fs::write(
        &path,
        text.replace(
            "remediationAction: inform",
            &format!("remediationAction: {remediation}"),
        ),
    )?;
    Ok(path)
}

/// Policy `name`'s row of `flotilla get policies -n default`, once it contains `shows`.
async fn wait_row(fleet: &Fleet, name: &str, shows: &str) -> anyhow::Result<String> {
    wait_for(
        &format!("flotilla get policies to show {name} with {shows:?}"),
        WAIT,
        || async {
            let table = fleet.cli(&["get", "policies", "-n", "default"])?;
            Ok(table
                .lines()
                .find(|l| l.split_whitespace().nth(1) == Some(name))
                .filter(|l| l.contains(shows))
                .map(str::to_owned))
        },
    )
    .await
}

/// Every history message of a compliance entry, joined.
fn messages(entry: &Value) -> String {
    entry["details"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|d| d["history"].as_array().into_iter().flatten())
        .filter_map(|h| h["message"].as_str())
        .collect::<Vec<_>>()
        .join("\n")
}

async fn wait_namespace(spoke: &Spoke, name: &str) -> anyhow::Result<()> {
    let namespaces: Api<Namespace> = Api::all(spoke.env.client().await?);
    wait_for(&format!("namespace {name} on the spoke"), WAIT, || async {
        Ok(namespaces.get_opt(name).await?.map(|_| ()))
    })
    .await
}

/// `policy-settings`: ConfigMap `prod/settings` must hold `mode: strict`, enforced.
fn settings_policy() -> Value {
    json!({
        "apiVersion": "policy.open-cluster-management.io/v1",
        "kind": "Policy",
        "metadata": {"name": "policy-settings", "namespace": "default"},
        "spec": {
            "remediationAction": "enforce",
            "disabled": false,
            "policy-templates": [{"objectDefinition": {
                "apiVersion": "policy.open-cluster-management.io/v1",
                "kind": "ConfigurationPolicy",
                "metadata": {"name": "policy-settings-strict"},
                "spec": {
                    "remediationAction": "enforce",
                    "severity": "medium",
                    "object-templates": [{
                        "complianceType": "musthave",
                        "objectDefinition": {
                            "apiVersion": "v1", "kind": "ConfigMap",
                            "metadata": {"name": "settings", "namespace": "prod"},
                            "data": {"mode": "strict"},
                        },
                    }],
                },
            }}],
        },
    })
}

async fn settings(spoke: &Spoke) -> anyhow::Result<Api<ConfigMap>> {
    Ok(Api::namespaced(spoke.env.client().await?, "prod"))
}

/// Sets `mode` in ConfigMap `prod/settings` on the spoke, as a person editing it would.
async fn set_mode(spoke: &Spoke, mode: &str) -> anyhow::Result<()> {
    settings(spoke)
        .await?
        .patch(
            "settings",
            &PatchParams::default(),
            &Patch::Merge(json!({"data": {"mode": mode}})),
        )
        .await?;
    Ok(())
}

async fn wait_mode(spoke: &Spoke, mode: &str) -> anyhow::Result<()> {
    let api = settings(spoke).await?;
    wait_for(
        &format!("ConfigMap prod/settings on the spoke to hold mode {mode}"),
        WAIT,
        || async {
            let found = api.get_opt("settings").await?;
            let holds = found
                .and_then(|c| c.data)
                .is_some_and(|d| d.get("mode").map(String::as_str) == Some(mode));
            Ok(holds.then_some(()))
        },
    )
    .await
}

on_both_carriers! {
    /// Inform reports NonCompliant naming the missing namespace; enforce creates it and
    /// reports Compliant; a ConfigMap value edited by hand is put back, with the hub up and
    /// with the hub killed.
    async fn a_policy_is_evaluated_and_enforced_on_the_spoke() -> anyhow::Result<()> {
        let kube = current_carrier() == Carrier::Quic;
        let dir = tempfile::tempdir()?;
        let mut fleet = Fleet::start(dir.path(), kube).await?;
        let spoke = Spoke::start(dir.path(), &fleet.hub, "cluster1").await?;
        let agent = spoke.start_agent(dir.path(), &fleet.hub, &[])?;
        fleet.hub.wait_available("cluster1").await?;
        fleet.cli(&["cluster", "label", "cluster1", "environment=dev"])?;
        fleet.apply_value(
            dir.path(),
            &json!({"apiVersion": "cluster.open-cluster-management.io/v1beta2",
                    "kind": "ManagedClusterSetBinding",
                    "metadata": {"name": "global", "namespace": "default"},
                    "spec": {"clusterSet": "global"}}),
        )?;
        let operator = OperatorClient::new(&OperatorConfig::load(
            &fleet.hub.data_dir.join("operator/config.yaml"),
        )?)?;

        // Inform: the spoke lacks `prod`; the agent says so, and touches nothing.
        fleet.apply(&namespace_policy(dir.path(), "inform")?)?;
        let entry = wait_compliance(&operator, "cluster1", "policy-namespace", "NonCompliant", WAIT).await?;
        let said = messages(&entry);
        assert!(said.contains("prod"), "the violation names the namespace: {said}");
        let namespaces: Api<Namespace> = Api::all(spoke.env.client().await?);
        assert!(namespaces.get_opt("prod").await?.is_none(), "inform never writes");
        // The hub's answer to "which clusters lack it" is one command away.
        let row = wait_row(&fleet, "policy-namespace", "NonCompliant")
            .await
            .map_err(|e| e.context(format!("hub log:\n{}", fleet.hub.proc.log())))?;
        let columns: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(
            columns[..5],
            ["default", "policy-namespace", "inform", "NonCompliant", "1/1"],
            "{row}"
        );

        // Enforce: created, then Compliant.
        fleet.apply(&namespace_policy(dir.path(), "enforce")?)?;
        wait_namespace(&spoke, "prod")
            .await
            .map_err(|e| e.context(format!("agent log:\n{}\nhub log:\n{}", agent.log(), fleet.hub.proc.log())))?;
        wait_compliance(&operator, "cluster1", "policy-namespace", "Compliant", WAIT).await?;

        // A ConfigMap that must hold `mode: strict`, enforced in the namespace made above.
        fleet.apply_value(dir.path(), &settings_policy())?;
        fleet.apply_value(
            dir.path(),
            &json!({"apiVersion": "policy.open-cluster-management.io/v1",
                    "kind": "PlacementBinding",
                    "metadata": {"name": "binding-settings", "namespace": "default"},
                    "placementRef": {"name": "placement-policy-namespace", "kind": "Placement",
                                     "apiGroup": "cluster.open-cluster-management.io"},
                    "subjects": [{"name": "policy-settings", "kind": "Policy",
                                  "apiGroup": "policy.open-cluster-management.io"}]}),
        )?;
        wait_mode(&spoke, "strict").await?;
        wait_compliance(&operator, "cluster1", "policy-settings", "Compliant", WAIT).await?;

        // Drift by hand: the value edited on the spoke is put back, by the watch of ConfigMaps
        // (the policy's interval is the default: evaluated on change).
        set_mode(&spoke, "lax").await?;
        wait_mode(&spoke, "strict").await?;

        // The hub killed: the agent keeps enforcing its last policies from its cache.
        fleet.hub.proc.signal_and_wait(Signal::SIGKILL);
        set_mode(&spoke, "lax").await?;
        wait_mode(&spoke, "strict")
            .await
            .map_err(|e| e.context(format!("agent log:\n{}", agent.log())))?;
        Ok(())
    }
}

/// A Policy enforcing ConfigMap `default/<name>` with `key: value`, pruned with
/// `DeleteIfCreated` when it leaves a cluster.
fn configmap_policy(name: &str) -> Value {
    json!({
        "apiVersion": "policy.open-cluster-management.io/v1",
        "kind": "Policy",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "remediationAction": "enforce",
            "disabled": false,
            "policy-templates": [{"objectDefinition": {
                "apiVersion": "policy.open-cluster-management.io/v1",
                "kind": "ConfigurationPolicy",
                "metadata": {"name": format!("{name}-configmap")},
                "spec": {
                    "remediationAction": "enforce",
                    "severity": "low",
                    "pruneObjectBehavior": "DeleteIfCreated",
                    "object-templates": [{
                        "complianceType": "musthave",
                        "objectDefinition": {
                            "apiVersion": "v1", "kind": "ConfigMap",
                            "metadata": {"name": name, "namespace": "default"},
                            "data": {"owner": name},
                        },
                    }],
                },
            }}],
        },
    })
}

async fn configmap_present(spoke: &Spoke, name: &str) -> anyhow::Result<bool> {
    let api: Api<ConfigMap> = Api::namespaced(spoke.env.client().await?, "default");
    Ok(api.get_opt(name).await?.is_some())
}

/// The root Policy `default/name` as the hub stores it.
async fn root(operator: &OperatorClient, name: &str) -> anyhow::Result<Value> {
    operator
        .get_json(&flotilla_cli::cli::object_path(
            Kind::Policy,
            Some("default"),
            name,
        ))
        .await
}

fn reached(policy: &Value) -> Vec<String> {
    policy["status"]["status"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| s["clustername"].as_str().map(str::to_owned))
        .collect()
}

on_both_carriers! {
    /// A PolicySet of two policies bound through one PlacementBinding reaches both selected
    /// clusters and each enforces both; a label change that drops one cluster from the
    /// placement takes both policies off it, and `DeleteIfCreated` removes what they created
    /// there, while the other cluster keeps everything.
    async fn a_policy_set_follows_its_placement_and_prunes_where_it_leaves() -> anyhow::Result<()> {
        let kube = current_carrier() == Carrier::Quic;
        let dir = tempfile::tempdir()?;
        let fleet = Fleet::start(dir.path(), kube).await?;
        let spokes = [
            Spoke::start(dir.path(), &fleet.hub, "cluster1").await?,
            Spoke::start(dir.path(), &fleet.hub, "cluster2").await?,
        ];
        let mut agents = Vec::new();
        for spoke in &spokes {
            agents.push(spoke.start_agent(dir.path(), &fleet.hub, &[])?);
            fleet.hub.wait_available(&spoke.name).await?;
            fleet.cli(&["cluster", "label", &spoke.name, "environment=dev"])?;
        }
        let operator = OperatorClient::new(&OperatorConfig::load(
            &fleet.hub.data_dir.join("operator/config.yaml"),
        )?)?;
        for doc in [
            json!({"apiVersion": "cluster.open-cluster-management.io/v1beta2",
                   "kind": "ManagedClusterSetBinding",
                   "metadata": {"name": "global", "namespace": "default"},
                   "spec": {"clusterSet": "global"}}),
            json!({"apiVersion": "cluster.open-cluster-management.io/v1beta1",
                   "kind": "Placement",
                   "metadata": {"name": "dev", "namespace": "default"},
                   "spec": {"predicates": [{"requiredClusterSelector": {"labelSelector":
                            {"matchLabels": {"environment": "dev"}}}}]}}),
            configmap_policy("baseline-a"),
            configmap_policy("baseline-b"),
            json!({"apiVersion": "policy.open-cluster-management.io/v1beta1",
                   "kind": "PolicySet",
                   "metadata": {"name": "baseline", "namespace": "default"},
                   "spec": {"description": "two ConfigMaps every dev cluster has",
                            "policies": ["baseline-a", "baseline-b"]}}),
            json!({"apiVersion": "policy.open-cluster-management.io/v1",
                   "kind": "PlacementBinding",
                   "metadata": {"name": "baseline", "namespace": "default"},
                   "placementRef": {"name": "dev", "kind": "Placement",
                                    "apiGroup": "cluster.open-cluster-management.io"},
                   "subjects": [{"name": "baseline", "kind": "PolicySet",
                                 "apiGroup": "policy.open-cluster-management.io"}]}),
        ] {
            fleet.apply_value(dir.path(), &doc)?;
        }
        for spoke in &spokes {
            for policy in ["baseline-a", "baseline-b"] {
                wait_compliance(&operator, &spoke.name, policy, "Compliant", WAIT).await?;
                assert!(configmap_present(spoke, policy).await?, "{policy} on {}", spoke.name);
            }
        }
        for policy in ["baseline-a", "baseline-b"] {
            let root = wait_for(&format!("{policy} Compliant on the hub"), WAIT, || async {
                let root = root(&operator, policy).await?;
                Ok((root["status"]["compliant"] == "Compliant").then_some(root))
            })
            .await?;
            assert_eq!(reached(&root), ["cluster1", "cluster2"], "{root}");
        }

        // cluster2 leaves the placement: both policies leave it, and what they made goes.
        fleet.cli(&["cluster", "label", "cluster2", "environment=prod", "--overwrite"])?;
        wait_for("the policies to leave cluster2 and what they created with them", WAIT, || async {
            let gone = !configmap_present(&spokes[1], "baseline-a").await?
                && !configmap_present(&spokes[1], "baseline-b").await?;
            Ok(gone.then_some(()))
        })
        .await
        .map_err(|e| e.context(format!("cluster2's agent log:\n{}", agents[1].log())))?;
        for policy in ["baseline-a", "baseline-b"] {
            wait_for(&format!("{policy} to reach cluster1 only"), WAIT, || async {
                Ok((reached(&root(&operator, policy).await?) == ["cluster1"]).then_some(()))
            })
            .await?;
            assert!(configmap_present(&spokes[0], policy).await?, "cluster1 keeps {policy}");
        }
        // cluster2's answers leave the hub with its policies: its record goes once empty.
        let record = flotilla_cli::cli::object_path(Kind::ClusterCompliance, Some("cluster2"), "cluster2");
        wait_for("cluster2's compliance record to go", WAIT, || async {
            Ok(operator.get_json(&record).await.is_err().then_some(()))
        })
        .await?;
        Ok(())
    }
}

/// Creates `doc` (a Namespace, a ClusterRoleBinding, or a LimitRange in `app-api`) on the spoke,
/// as its own operator would.
async fn create_on(spoke: &Spoke, doc: Value) -> anyhow::Result<()> {
    use k8s_openapi::api::core::v1::LimitRange;
    use k8s_openapi::api::rbac::v1::ClusterRoleBinding;
    use kube::api::PostParams;
    let client = spoke.env.client().await?;
    let post = PostParams::default();
    match doc["kind"].as_str() {
        Some("Namespace") => {
            Api::<Namespace>::all(client)
                .create(&post, &serde_json::from_value(doc)?)
                .await?;
        }
        Some("ClusterRoleBinding") => {
            Api::<ClusterRoleBinding>::all(client)
                .create(&post, &serde_json::from_value(doc)?)
                .await?;
        }
        _ => {
            Api::<LimitRange>::namespaced(client, "app-api")
                .create(&post, &serde_json::from_value(doc)?)
                .await?;
        }
    }
    Ok(())
}

on_both_carriers! {
    /// OCM's policy-collection examples as written, on two real spokes: the forbidden
    /// ClusterRoleBinding is removed under enforce; the LimitRange answer is per cluster, so
    /// "how many clusters lack the required limit range" is one `flotilla get policies` away.
    async fn the_policy_collection_examples_are_answered_per_cluster() -> anyhow::Result<()> {
        use k8s_openapi::api::rbac::v1::ClusterRoleBinding;
        let kube = current_carrier() == Carrier::Quic;
        let dir = tempfile::tempdir()?;
        let fleet = Fleet::start(dir.path(), kube).await?;
        let dev = Spoke::start(dir.path(), &fleet.hub, "cluster1").await?;
        let prod = Spoke::start(dir.path(), &fleet.hub, "cluster2").await?;

        // What the spokes hold before any policy: a forbidden binding on the dev cluster, and
        // namespaces the LimitRange policy selects (app-*, not app-test); only prod's has it.
        let namespace = |name: &str| json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}});
        create_on(&dev, namespace("app-web")).await?;
        create_on(&dev, namespace("app-test")).await?;
        create_on(&dev, json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": {"name": "anonymous-admin"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cluster-admin"},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": "system:anonymous"}],
        })).await?;
        create_on(&prod, namespace("app-api")).await?;
        create_on(&prod, json!({
            "apiVersion": "v1", "kind": "LimitRange",
            "metadata": {"name": "container-mem-limit-range", "namespace": "app-api"},
            "spec": {"limits": [{"type": "Container", "default": {"memory": "512Mi"},
                                 "defaultRequest": {"memory": "256Mi"}}]},
        })).await?;

        let mut agents = Vec::new();
        for (spoke, environment) in [(&dev, "dev"), (&prod, "prod")] {
            agents.push(spoke.start_agent(dir.path(), &fleet.hub, &[])?);
            fleet.hub.wait_available(&spoke.name).await?;
            fleet.cli(&["cluster", "label", &spoke.name, &format!("environment={environment}")])?;
        }
        // The baseline PolicySet's placement names the `dev` cluster set.
        fleet.apply_value(dir.path(), &json!({
            "apiVersion": "cluster.open-cluster-management.io/v1beta2", "kind": "ManagedClusterSet",
            "metadata": {"name": "dev"}, "spec": {}}))?;
        fleet.cli(&["cluster", "label", "cluster1", "cluster.open-cluster-management.io/clusterset=dev", "--overwrite"])?;
        for set in ["global", "dev"] {
            fleet.apply_value(dir.path(), &json!({
                "apiVersion": "cluster.open-cluster-management.io/v1beta2",
                "kind": "ManagedClusterSetBinding",
                "metadata": {"name": set, "namespace": "default"},
                "spec": {"clusterSet": set}}))?;
        }
        for file in ["policy-namespace.yaml", "policy-limitrange.yaml", "policy-rbac-anonymous.yaml"] {
            fleet.apply(&example(file))?;
        }
        let operator = OperatorClient::new(&OperatorConfig::load(
            &fleet.hub.data_dir.join("operator/config.yaml"),
        )?)?;

        // Enforce removes the forbidden binding on the dev cluster, which then complies.
        let bindings: Api<ClusterRoleBinding> = Api::all(dev.env.client().await?);
        wait_for("the forbidden binding to be removed", WAIT, || async {
            Ok(bindings.get_opt("anonymous-admin").await?.is_none().then_some(()))
        })
        .await
        .map_err(|e| e.context(format!("cluster1's agent log:\n{}", agents[0].log())))?;
        wait_compliance(&operator, "cluster1", "policy-rbac-anonymous", "Compliant", WAIT).await?;

        // The LimitRange: missing in app-web on cluster1, present in app-api on cluster2.
        let lacking = wait_compliance(&operator, "cluster1", "policy-limitrange", "NonCompliant", WAIT).await?;
        let said = messages(&lacking);
        assert!(said.contains("app-web") && !said.contains("app-test"), "{said}");
        wait_compliance(&operator, "cluster2", "policy-limitrange", "Compliant", WAIT).await?;
        let row = wait_row(&fleet, "policy-limitrange", " 1/2 ").await?;
        assert!(row.contains("NonCompliant"), "{row}");
        Ok(())
    }
}
