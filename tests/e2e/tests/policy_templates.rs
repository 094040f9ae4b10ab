//! Policy templates end to end, on two real spokes: hub templates (`{{hub ... hub}}`) are
//! resolved by the gateway for each cluster (its name, its labels, its claims), so one policy
//! makes a different object on each spoke and a relabelled cluster gets its object rewritten;
//! managed-cluster templates (`{{ ... }}`) are resolved by each agent against its own spoke
//! (`lookup` copies a value from another object there, and follows its changes); a template
//! that fails makes its policy NonCompliant with the error in `flotilla describe policy`
//! while the cluster's other policies stay Compliant; a hub template reads the hub's own
//! ConfigMap (`fromConfigMap`, stored with `flotilla apply`), and the spokes' objects follow
//! its edits, and its deletion is reported; and a template calling a function flotilla does
//! not provide is refused at `flotilla apply`, naming the field. Each carrier runs on one
//! backend, as in `policy_enforcement`: gRPC with the sled store, QUIC with the kube store.

use std::time::Duration;

use flotilla_cli::client::{OperatorClient, OperatorConfig};
use flotilla_e2e::spoke::Spoke;
use flotilla_e2e::{Carrier, Fleet, current_carrier, on_both_carriers, wait_compliance, wait_for};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

/// Long enough for a session to open, a policy to travel and an evaluation to report, on a
/// loaded machine; every wait ends as soon as its condition holds.
const WAIT: Duration = Duration::from_secs(90);

/// A Policy of one enforced ConfigurationPolicy making ConfigMap `default/<name>` with `data`.
fn templated_policy(name: &str, data: Value) -> Value {
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
                    "object-templates": [{
                        "complianceType": "musthave",
                        "objectDefinition": {
                            "apiVersion": "v1", "kind": "ConfigMap",
                            "metadata": {"name": name, "namespace": "default"},
                            "data": data,
                        },
                    }],
                },
            }}],
        },
    })
}

fn configmaps(client: kube::Client) -> Api<ConfigMap> {
    Api::namespaced(client, "default")
}

/// ConfigMap `default/<name>`'s data on the spoke, once `wanted` holds of it.
async fn wait_data(
    spoke: &Spoke,
    name: &str,
    what: &str,
    wanted: impl Fn(&Value) -> bool,
) -> anyhow::Result<Value> {
    let api = configmaps(spoke.env.client().await?);
    wait_for(
        &format!("ConfigMap default/{name} on {} to {what}", spoke.name),
        WAIT,
        || async {
            let data = api
                .get_opt(name)
                .await?
                .and_then(|c| c.data)
                .map(serde_json::to_value)
                .transpose()?;
            Ok(data.filter(|d| wanted(d)))
        },
    )
    .await
}

on_both_carriers! {
    /// One policy, a different object on each spoke: its name and `environment` label from the
    /// hub, a color looked up on the spoke itself; relabelling a cluster and editing the
    /// looked-up object each rewrite only that spoke's object. A failing template is reported,
    /// not fatal; an unknown function is refused at apply.
    async fn templates_are_resolved_per_cluster_on_the_hub_and_on_the_spoke() -> anyhow::Result<()> {
        let kube = current_carrier() == Carrier::Quic;
        let dir = tempfile::tempdir()?;
        let fleet = Fleet::start(dir.path(), kube).await?;
        let spokes = [
            Spoke::start(dir.path(), &fleet.hub, "cluster1").await?,
            Spoke::start(dir.path(), &fleet.hub, "cluster2").await?,
        ];
        // What each spoke holds before any policy: the object its `lookup` reads.
        for (spoke, color) in [(&spokes[0], "red"), (&spokes[1], "blue")] {
            let source: ConfigMap = serde_json::from_value(json!({
                "metadata": {"name": "source", "namespace": "default"},
                "data": {"color": color}}))?;
            configmaps(spoke.env.client().await?)
                .create(&PostParams::default(), &source)
                .await?;
        }
        let mut agents = Vec::new();
        for (spoke, environment) in [(&spokes[0], "dev"), (&spokes[1], "prod")] {
            agents.push(spoke.start_agent(dir.path(), &fleet.hub, &[])?);
            fleet.hub.wait_available(&spoke.name).await?;
            fleet.cli(&["cluster", "label", &spoke.name, &format!("environment={environment}")])?;
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
                   "metadata": {"name": "labelled", "namespace": "default"},
                   "spec": {"predicates": [{"requiredClusterSelector": {"labelSelector":
                            {"matchExpressions": [{"key": "environment", "operator": "Exists"}]}}}]}}),
            templated_policy("cluster-facts", json!({
                "cluster": "{{hub .ManagedClusterName hub}}",
                "environment": "{{hub index .ManagedClusterLabels \"environment\" hub}}",
                "kube": "{{hub fromClusterClaim \"kubeversion.open-cluster-management.io\" hub}}",
                "color": "{{ (lookup \"v1\" \"ConfigMap\" \"default\" \"source\").data.color | upper }}",
            })),
            templated_policy("unresolvable", json!({
                "setting": "{{ fromConfigMap \"default\" \"absent\" \"setting\" }}",
            })),
            json!({"apiVersion": "policy.open-cluster-management.io/v1",
                   "kind": "PlacementBinding",
                   "metadata": {"name": "templated", "namespace": "default"},
                   "placementRef": {"name": "labelled", "kind": "Placement",
                                    "apiGroup": "cluster.open-cluster-management.io"},
                   "subjects": [{"name": "cluster-facts", "kind": "Policy",
                                 "apiGroup": "policy.open-cluster-management.io"},
                                {"name": "unresolvable", "kind": "Policy",
                                 "apiGroup": "policy.open-cluster-management.io"}]}),
        ] {
            fleet.apply_value(dir.path(), &doc)?;
        }

        // Each spoke gets its own object: the hub's facts of it, and its own color.
        for (index, (spoke, environment, color)) in
            [(&spokes[0], "dev", "RED"), (&spokes[1], "prod", "BLUE")].into_iter().enumerate()
        {
            let data = wait_data(spoke, "cluster-facts", "be rendered for it", |d| {
                d["cluster"] == spoke.name.as_str()
                    && d["environment"] == environment
                    && d["color"] == color
            })
            .await
            .map_err(|e| e.context(format!("agent log:\n{}", agents[index].log())))?;
            let kube_version = data["kube"].as_str().unwrap_or_default();
            assert!(kube_version.starts_with('v'), "the cluster's kubeversion claim: {data}");
            wait_compliance(&operator, &spoke.name, "cluster-facts", "Compliant", WAIT).await?;
        }

        // The hub's side follows the cluster: relabelled, cluster1 gets its object rewritten.
        fleet.cli(&["cluster", "label", "cluster1", "environment=staging", "--overwrite"])?;
        wait_data(&spokes[0], "cluster-facts", "follow the new label", |d| {
            d["environment"] == "staging"
        })
        .await?;
        // The spoke's side follows the spoke: the looked-up object edited on cluster2.
        configmaps(spokes[1].env.client().await?)
            .patch(
                "source",
                &PatchParams::default(),
                &Patch::Merge(json!({"data": {"color": "green"}})),
            )
            .await?;
        wait_data(&spokes[1], "cluster-facts", "follow the edited source", |d| {
            d["color"] == "GREEN"
        })
        .await?;
        let cluster2 = wait_data(&spokes[1], "cluster-facts", "keep its hub facts", |_| true).await?;
        assert_eq!(cluster2["environment"], "prod", "cluster2's label did not change");

        // The unresolvable template: NonCompliant on each cluster, with the template and the
        // error where the operator looks, and nothing made on the spokes.
        for spoke in &spokes {
            wait_compliance(&operator, &spoke.name, "unresolvable", "NonCompliant", WAIT).await?;
            wait_compliance(&operator, &spoke.name, "cluster-facts", "Compliant", WAIT).await?;
            let api = configmaps(spoke.env.client().await?);
            assert!(api.get_opt("unresolvable").await?.is_none(), "{}", spoke.name);
        }
        let described = wait_for("describe policy to show the template's error", WAIT, || async {
            let described = fleet.cli(&["describe", "policy", "unresolvable"])?;
            Ok(described
                .contains("failed to resolve the template {{ fromConfigMap \"default\" \"absent\" \"setting\" }} at data.setting: fromConfigMap: configmaps \"absent\" not found in namespace default")
                .then_some(described))
        })
        .await?;
        assert!(described.contains("cluster1") && described.contains("cluster2"), "{described}");

        // The hub's own ConfigMap, in the policy's namespace, stored with `flotilla apply` on
        // either backend (on the kube backend a native ConfigMap of the hub's apiserver).
        let settings = |tier: &str| {
            json!({"apiVersion": "v1", "kind": "ConfigMap",
                   "metadata": {"name": "settings", "namespace": "default"},
                   "data": {"tier": tier}})
        };
        let settings_file = dir.path().join("settings.json");
        std::fs::write(&settings_file, serde_json::to_vec(&settings("gold"))?)?;
        let applied = fleet.cli(&["apply", "-f", settings_file.to_str().unwrap_or_default()])?;
        assert!(applied.contains("configmaps/default/settings created"), "{applied}");
        let listed = fleet.cli(&["get", "configmaps", "-n", "default"])?;
        assert!(
            listed
                .lines()
                .any(|l| l.split_whitespace().take(3).eq(["default", "settings", "1"])),
            "flotilla get configmaps:\n{listed}"
        );
        if let Some(env) = &fleet.hub_env {
            let stored = Api::<ConfigMap>::namespaced(env.client().await?, "default")
                .get("settings")
                .await?;
            assert_eq!(
                stored.data.and_then(|d| d.get("tier").cloned()).as_deref(),
                Some("gold"),
                "the hub apiserver holds the ConfigMap natively"
            );
        }
        let tier = "{{hub fromConfigMap \"\" \"settings\" \"tier\" hub}}";
        for doc in [
            templated_policy("tiered", json!({"tier": tier, "cluster": "{{hub .ManagedClusterName hub}}"})),
            json!({"apiVersion": "policy.open-cluster-management.io/v1",
                   "kind": "PlacementBinding",
                   "metadata": {"name": "tiered", "namespace": "default"},
                   "placementRef": {"name": "labelled", "kind": "Placement",
                                    "apiGroup": "cluster.open-cluster-management.io"},
                   "subjects": [{"name": "tiered", "kind": "Policy",
                                 "apiGroup": "policy.open-cluster-management.io"}]}),
        ] {
            fleet.apply_value(dir.path(), &doc)?;
        }
        for spoke in &spokes {
            wait_data(spoke, "tiered", "carry the hub's tier", |d| {
                d["tier"] == "gold" && d["cluster"] == spoke.name.as_str()
            })
            .await?;
            wait_compliance(&operator, &spoke.name, "tiered", "Compliant", WAIT).await?;
        }
        // Edited with `flotilla apply`: every spoke's object follows.
        fleet.apply_value(dir.path(), &settings("platinum"))?;
        for spoke in &spokes {
            wait_data(spoke, "tiered", "follow the edited ConfigMap", |d| d["tier"] == "platinum")
                .await?;
        }
        // Deleted: the template fails on each cluster, NonCompliant with the hub's error; the
        // spoke objects stay as they were last enforced.
        let deleted = fleet.cli(&["delete", "configmap", "settings", "-n", "default"])?;
        assert_eq!(deleted.trim(), "configmaps/default/settings deleted");
        for spoke in &spokes {
            wait_compliance(&operator, &spoke.name, "tiered", "NonCompliant", WAIT).await?;
        }
        wait_for("describe policy to show the missing ConfigMap", WAIT, || async {
            let described = fleet.cli(&["describe", "policy", "tiered"])?;
            Ok(described
                .contains("fromConfigMap: configmaps \"settings\" not found in namespace default")
                .then_some(()))
        })
        .await?;
        let listed = fleet.cli(&["get", "configmaps", "-n", "default"])?;
        assert!(!listed.contains("settings"), "{listed}");

        // A function flotilla does not provide: refused at apply, naming the field.
        let refused = dir.path().join("refused.json");
        std::fs::write(
            &refused,
            serde_json::to_vec(&templated_policy("secretive", json!({
                "password": "{{ fromSecret \"default\" \"creds\" \"password\" }}",
            })))?,
        )?;
        let out = fleet
            .hub
            .cli(&["apply", "-f", refused.to_str().unwrap_or_default()])?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "applied: {stderr}");
        assert!(
            stderr.contains(
                "Policy default/secretive: spec.policy-templates[0].objectDefinition.spec.object-templates[0].objectDefinition.data.password holds a template that uses the function \"fromSecret\""
            ),
            "{stderr}"
        );
        Ok(())
    }
}
