//! Governance on a real hub, on both store backends: OCM's policy-collection examples apply as
//! written (`kubectl apply` on the kube backend, `flotilla apply` on both), a PlacementBinding
//! puts the namespace policy on the clusters its Placement selects, the root Policy's status
//! lists exactly those clusters and follows a label change, an invalid policy is refused with
//! the field and the reason, and `flotilla get policies` / `describe policy` show it. No agent
//! runs: clusters are registered by their ManagedCluster objects; the hub makes each selected
//! cluster's ClusterCompliance record, and compliance is reported by writing the records'
//! status through the operator API, as a gateway writes what its agents report.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use flotilla_cli::client::{OperatorClient, OperatorConfig};
use flotilla_e2e::{Fleet, scrape, wait_for};
use flotilla_proto::api::Kind;
use flotilla_testenv::workspace_root;
use serde_json::{Value, json};

/// RHACM's compliance gauge, as the hub serves it.
const METRIC: &str = "policy_governance_info";

fn example(name: &str) -> PathBuf {
    workspace_root()
        .join("proto/tests/data/policies")
        .join(name)
}

/// The root Policy `default/name` as `flotilla get policies -o json` lists it.
fn policy(fleet: &Fleet, name: &str) -> anyhow::Result<Option<Value>> {
    Ok(fleet
        .list(&["policies", "-n", "default"])?
        .into_iter()
        .find(|p| p["metadata"]["name"] == name))
}

/// The clusters a root Policy's `status.status[]` lists, in order.
fn listed_clusters(policy: &Value) -> Vec<String> {
    policy["status"]["status"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| s["clustername"].as_str().map(str::to_string))
        .collect()
}

async fn wait_listed(fleet: &Fleet, name: &str, clusters: &[&str]) -> anyhow::Result<Value> {
    wait_for(
        &format!("policy {name} to list exactly {clusters:?}"),
        Duration::from_secs(60),
        || async { Ok(policy(fleet, name)?.filter(|p| listed_clusters(p) == clusters)) },
    )
    .await
}

/// Runs `flotilla apply -f file` and returns its exit status and stderr.
fn flotilla_apply(fleet: &Fleet, file: &Path) -> anyhow::Result<(bool, String)> {
    let out = fleet
        .hub
        .cli(&["apply", "-f", file.to_str().unwrap_or_default()])?;
    Ok((
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

async fn policies_follow_placements(kube: bool) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    // One propagated compliance series on /metrics at most: the bound is what is tested.
    let fleet = Fleet::start_with(
        dir.path(),
        kube,
        &[
            "--metrics-addr=127.0.0.1:0",
            "--policy-metrics-max-propagated=1",
        ],
    )
    .await?;
    let metrics = fleet
        .hub
        .metrics_addr
        .clone()
        .context("the hub wrote no metrics address")?;
    // Four registered clusters, two in the dev environment and one in an environment no
    // example selects; every cluster is in OCM's `global` set, bound to the policies'
    // namespace.
    for (name, environment) in [("c1", "dev"), ("c2", "dev"), ("c3", "prod"), ("c4", "qa")] {
        fleet.apply_value(
            dir.path(),
            &json!({"apiVersion": "cluster.open-cluster-management.io/v1",
                    "kind": "ManagedCluster",
                    "metadata": {"name": name, "labels": {"environment": environment}},
                    "spec": {"hubAcceptsClient": true}}),
        )?;
    }
    fleet.apply_value(
        dir.path(),
        &json!({"apiVersion": "cluster.open-cluster-management.io/v1beta2",
                "kind": "ManagedClusterSetBinding",
                "metadata": {"name": "global", "namespace": "default"},
                "spec": {"clusterSet": "global"}}),
    )?;

    // The examples as written (no namespace: the command's, `default`), each applied the way
    // this backend's operator applies YAML (kubectl on the kube backend) and then again with
    // flotilla apply, which replaces what is there.
    for file in [
        "policy-namespace.yaml",
        "policy-limitrange.yaml",
        "policy-rbac-anonymous.yaml",
    ] {
        fleet.apply(&example(file))?;
        let (ok, stderr) = flotilla_apply(&fleet, &example(file))?;
        anyhow::ensure!(ok, "flotilla apply -f {file}: {stderr}");
    }
    fleet
        .wait_decided("default", "placement-policy-namespace", &["c1", "c2"])
        .await?;

    // The root policy lists exactly the two selected clusters, compliance not yet reported,
    // placed by its own binding and through the baseline PolicySet's.
    let placed = wait_listed(&fleet, "policy-namespace", &["c1", "c2"]).await?;
    let status = &placed["status"];
    assert_eq!(
        status["placement"],
        json!([
            {"placementBinding": "binding-baseline", "placement": "placement-baseline",
             "policySet": "baseline"},
            {"placementBinding": "binding-policy-namespace",
             "placement": "placement-policy-namespace"},
        ]),
        "{status}"
    );
    for entry in status["status"].as_array().into_iter().flatten() {
        assert_eq!(entry["clusternamespace"], entry["clustername"], "{entry}");
        assert!(
            entry.get("compliant").is_none(),
            "not reported yet: {entry}"
        );
    }
    assert!(status.get("compliant").is_none(), "{status}");

    // The baseline PolicySet (the rbac example's) names its binding, and says which of its
    // members is missing: none.
    let operator = OperatorClient::new(&OperatorConfig::load(
        &fleet.hub.data_dir.join("operator/config.yaml"),
    )?)?;
    let set_path = flotilla_cli::cli::object_path(Kind::PolicySet, Some("default"), "baseline");
    let set = wait_for(
        "the baseline PolicySet's placement",
        Duration::from_secs(30),
        || async {
            let set = operator.get_json(&set_path).await?;
            Ok(set["status"]["placement"].is_array().then_some(set))
        },
    )
    .await?;
    assert_eq!(
        set["status"]["placement"],
        json!([{"placementBinding": "binding-baseline", "placement": "placement-baseline"}]),
        "{set}"
    );
    assert!(set["status"].get("statusMessage").is_none(), "{set}");

    // `flotilla get policies` prints the row: inform, no compliance yet, 0 of 2 non-compliant.
    let table = fleet.cli(&["get", "policies", "-n", "default"])?;
    let rows: Vec<Vec<&str>> = table
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(
        rows[0],
        [
            "NAMESPACE",
            "NAME",
            "REMEDIATION",
            "COMPLIANCE",
            "CLUSTERS",
            "AGE"
        ],
        "{table}"
    );
    let row = rows
        .iter()
        .find(|r| r.get(1) == Some(&"policy-namespace"))
        .unwrap_or_else(|| panic!("no policy-namespace row:\n{table}"));
    assert_eq!(
        row[..5],
        ["default", "policy-namespace", "inform", "<none>", "0/2"]
    );
    if let Some(env) = &fleet.hub_env {
        // kubectl shows OCM's columns from the CRD.
        let out = env
            .kubectl()
            .args(["get", "policies", "-n", "default"])
            .output()?;
        let text = String::from_utf8_lossy(&out.stdout);
        let header: Vec<&str> = text
            .lines()
            .next()
            .unwrap_or_default()
            .split("   ")
            .map(str::trim)
            .filter(|c| !c.is_empty())
            .collect();
        assert_eq!(
            header,
            ["NAME", "REMEDIATION ACTION", "COMPLIANCE STATE", "AGE"],
            "{text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            text.lines()
                .any(|l| l.starts_with("policy-namespace ") && l.contains("inform")),
            "{text}"
        );
    }
    let described = fleet.cli(&["describe", "policy", "policy-namespace"])?;
    for part in [
        "ConfigurationPolicy policy-namespace-prod (severity low, remediation inform)",
        "musthave v1 Namespace prod",
        "binding-policy-namespace",
        "Clusters:   2 selected, 0 non-compliant",
    ] {
        assert!(
            described.contains(part),
            "{part:?} missing from:\n{described}"
        );
    }

    // Each cluster carrying a policy has its compliance record, made by the hub (c3 carries
    // the limitrange policy); c4 carries none.
    let record_path = |cluster: &str| {
        flotilla_cli::cli::object_path(Kind::ClusterCompliance, Some(cluster), cluster)
    };
    for cluster in ["c1", "c2", "c3"] {
        wait_for(
            &format!("{cluster}'s compliance record"),
            Duration::from_secs(30),
            || async { Ok(operator.get_json(&record_path(cluster)).await.ok()) },
        )
        .await?;
    }
    assert!(
        operator.get_json(&record_path("c4")).await.is_err(),
        "c4 carries no policy, so has no record"
    );
    // The clusters report, as their gateways would write it: c1 violates the namespace
    // template, c2 meets it.
    let uid = placed["metadata"]["uid"].clone();
    let generation = placed["metadata"]["generation"].clone();
    let report = |cluster: &str, compliant: &str, message: &str| {
        json!({
            "apiVersion": Kind::ClusterCompliance.api_version(), "kind": "ClusterCompliance",
            "metadata": {"name": cluster, "namespace": cluster},
            "status": {"policies": [{
                "namespace": "default", "name": "policy-namespace", "uid": uid,
                "generation": generation, "compliant": compliant,
                "details": [{
                    "templateMeta": {"name": "policy-namespace-prod"},
                    "compliant": compliant,
                    "history": [{"lastTimestamp": "2026-11-26T22:04:05Z", "message": message}],
                }],
            }]},
        })
    };
    let write_report = |cluster: &'static str, body: Value| {
        let operator = &operator;
        let path = format!("{}/status", record_path(cluster));
        async move {
            operator
                .request(http::Method::PUT, &path, Some(&body))
                .await
                .map(drop)
        }
    };
    write_report(
        "c1",
        report(
            "c1",
            "NonCompliant",
            "NonCompliant; violation - namespaces [prod] not found",
        ),
    )
    .await?;
    write_report(
        "c2",
        report(
            "c2",
            "Compliant",
            "Compliant; notification - namespaces [prod] found as specified",
        ),
    )
    .await?;
    let per_cluster = |p: &Value| -> Vec<(String, String)> {
        p["status"]["status"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|s| {
                (
                    s["clustername"].as_str().unwrap_or_default().to_owned(),
                    s["compliant"].as_str().unwrap_or("<none>").to_owned(),
                )
            })
            .collect()
    };
    // Both reports (the first alone makes the root NonCompliant already).
    let both = [
        ("c1".to_owned(), "NonCompliant".to_owned()),
        ("c2".to_owned(), "Compliant".to_owned()),
    ];
    let reported = wait_for(
        "both reports to reach the root policy",
        Duration::from_secs(30),
        || async { Ok(policy(&fleet, "policy-namespace")?.filter(|p| per_cluster(p) == both)) },
    )
    .await?;
    assert_eq!(
        reported["status"]["compliant"], "NonCompliant",
        "{reported}"
    );
    // RHACM's gauge: the root NonCompliant (1); of the propagated series only the bound's one,
    // the non-compliant cluster's, and the rest counted as left out.
    let root = [
        ("type", "root"),
        ("policy", "policy-namespace"),
        ("policy_namespace", "default"),
        ("cluster_namespace", "<null>"),
    ];
    let propagated = |cluster: &'static str| {
        [
            ("type", "propagated"),
            ("policy", "policy-namespace"),
            ("policy_namespace", "default"),
            ("cluster_namespace", cluster),
        ]
    };
    let page = scrape(&metrics).await?;
    assert_eq!(page.value(METRIC, &root), Some(1.0));
    assert_eq!(page.value(METRIC, &propagated("c1")), Some(1.0));
    assert_eq!(
        page.value(METRIC, &propagated("c2")),
        None,
        "a compliant cluster's series is the first left out"
    );
    let pairs: usize = fleet
        .list(&["policies", "-n", "default"])?
        .iter()
        .filter(|p| p["spec"]["disabled"] != true)
        .map(|p| p["status"]["status"].as_array().map_or(0, Vec::len))
        .sum();
    assert_eq!(
        page.value("flotilla_hub_policy_series_omitted", &[]),
        Some((pairs - 1) as f64)
    );
    let row_of = |table: &str| -> Vec<String> {
        table
            .lines()
            .map(|l| l.split_whitespace().map(str::to_owned).collect::<Vec<_>>())
            .find(|r| r.get(1).map(String::as_str) == Some("policy-namespace"))
            .unwrap_or_default()
    };
    let table = fleet.cli(&["get", "policies", "-n", "default"])?;
    assert_eq!(
        row_of(&table)[..5],
        [
            "default",
            "policy-namespace",
            "inform",
            "NonCompliant",
            "1/2"
        ],
        "{table}"
    );
    // The status page's compliance, over the dev clusters only: the namespace policy is
    // violated on 1 of 2, the most violated first; c1 violates it.
    let page = operator
        .get_json("/ui/api/compliance?labels=environment%3Ddev")
        .await?;
    let first = &page["policies"]["items"][0];
    assert_eq!(
        (&first["name"], &first["nonCompliant"], &first["clusters"]),
        (&json!("policy-namespace"), &json!(1), &json!(2)),
        "{page}"
    );
    let worst = &page["clusters"]["items"][0];
    assert_eq!(
        (&worst["cluster"], &worst["violated"], &worst["violating"]),
        (
            &json!("c1"),
            &json!(1),
            &json!(["default/policy-namespace"])
        ),
        "{page}"
    );
    assert!(
        page["clusters"]["items"]
            .as_array()
            .into_iter()
            .flatten()
            .all(|c| c["cluster"] == "c1" || c["cluster"] == "c2"),
        "only the dev clusters: {page}"
    );
    // describe says which cluster violates what, from c1's record.
    let described = fleet.cli(&["describe", "policy", "policy-namespace"])?;
    let violations: Vec<&str> = described
        .lines()
        .skip_while(|l| *l != "Violations:")
        .skip(2)
        .collect();
    assert_eq!(violations.len(), 1, "{described}");
    assert_eq!(
        violations[0].split_whitespace().take(3).collect::<Vec<_>>(),
        ["c1", "policy-namespace-prod", "NonCompliant"],
        "{described}"
    );
    assert!(
        violations[0].ends_with("NonCompliant; violation - namespaces [prod] not found"),
        "{described}"
    );
    // c1 is fixed: the policy is Compliant everywhere.
    write_report(
        "c1",
        report(
            "c1",
            "Compliant",
            "Compliant; notification - namespaces [prod] found as specified",
        ),
    )
    .await?;
    wait_for(
        "the root policy to be Compliant",
        Duration::from_secs(30),
        || async {
            Ok(policy(&fleet, "policy-namespace")?
                .filter(|p| p["status"]["compliant"] == "Compliant"))
        },
    )
    .await?;
    let table = fleet.cli(&["get", "policies", "-n", "default"])?;
    assert_eq!(
        row_of(&table)[..5],
        ["default", "policy-namespace", "inform", "Compliant", "0/2"],
        "{table}"
    );
    assert_eq!(scrape(&metrics).await?.value(METRIC, &root), Some(0.0));

    // A label change drops c2 from the placement, and from the policy's status.
    fleet.cli(&["cluster", "label", "c2", "environment=prod", "--overwrite"])?;
    wait_listed(&fleet, "policy-namespace", &["c1"]).await?;

    // An invalid policy is refused at apply with the object, the field and the reason, and
    // not stored.
    let examples = std::fs::read_to_string(example("policy-namespace.yaml"))?;
    let mut invalid: Value =
        yaml_serde::from_str(examples.split("\n---\n").next().unwrap_or_default())?;
    invalid["metadata"]["name"] = "policy-audit".into();
    invalid["spec"]["remediationAction"] = "audit".into();
    let file = dir.path().join("invalid.json");
    std::fs::write(&file, serde_json::to_vec(&invalid)?)?;
    let (ok, stderr) = flotilla_apply(&fleet, &file)?;
    assert!(!ok, "an invalid policy is refused");
    assert!(
        stderr.contains(
            "Policy default/policy-audit: spec.remediationAction is \"audit\"; use inform or enforce"
        ),
        "{stderr}"
    );
    if let Some(env) = &fleet.hub_env {
        // kubectl reaches the apiserver directly: the CRD's enum refuses it there.
        let out = env.kubectl().arg("apply").arg("-f").arg(&file).output()?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "kubectl apply of an invalid policy");
        assert!(
            stderr.contains("spec.remediationAction") && stderr.contains("audit"),
            "{stderr}"
        );
    }
    // An OCM field flotilla does not implement is refused by name, never ignored.
    let mut dependent = invalid.clone();
    dependent["metadata"]["name"] = "policy-dependent".into();
    dependent["spec"]["remediationAction"] = "inform".into();
    dependent["spec"]["dependencies"] = json!([{"apiVersion": "policy.open-cluster-management.io/v1",
        "kind": "Policy", "name": "policy-limitrange", "compliance": "Compliant"}]);
    let file = dir.path().join("dependent.json");
    std::fs::write(&file, serde_json::to_vec(&dependent)?)?;
    let (ok, stderr) = flotilla_apply(&fleet, &file)?;
    assert!(!ok, "a policy with dependencies is refused");
    assert!(
        stderr.contains(
            "Policy default/policy-dependent: spec.dependencies is not supported by flotilla; remove it"
        ),
        "{stderr}"
    );
    if let Some(env) = &fleet.hub_env {
        // kubectl's strict field validation refuses the field the CRD leaves out.
        let out = env.kubectl().arg("apply").arg("-f").arg(&file).output()?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success(),
            "kubectl apply of a policy with dependencies"
        );
        assert!(stderr.contains("dependencies"), "{stderr}");
    }
    for name in ["policy-audit", "policy-dependent"] {
        assert!(
            policy(&fleet, name)?.is_none(),
            "a refused policy is not stored: {name}"
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policies_follow_placements_on_sled() -> anyhow::Result<()> {
    policies_follow_placements(false).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policies_follow_placements_on_kube() -> anyhow::Result<()> {
    policies_follow_placements(true).await
}
