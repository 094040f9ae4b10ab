//! The agent's policy governor against a real spoke kube-apiserver (and once against the load
//! test's in-memory cluster): what a delivered Policy reports, and what enforce and prune do
//! to the cluster.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, bail};
use flotilla_agent::apply::{ApplyTarget, KubeApplyTarget, MemoryCluster};
use flotilla_agent::cache::AppliedResource;
use flotilla_agent::governance::{DeliveredPolicy, Governor, GovernorHandle, PolicyReport};
use flotilla_proto::api::policy::template::MAX_LOOKUPS;
use flotilla_proto::api::policy::{ANNOTATION_CREATED_BY_POLICY, ComplianceState, Policy};
use flotilla_testenv::{TestEnv, wait_for};
use k8s_openapi::api::core::v1::{ConfigMap, LimitRange, Namespace};
use k8s_openapi::api::rbac::v1::ClusterRoleBinding;
use kube::api::{
    Api, ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams,
};
use serde_json::{Value, json};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// How long a report or a repair may take on a loaded machine.
const DEADLINE: Duration = Duration::from_secs(60);

fn trace_init() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| "flotilla_agent=debug,info".into());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_test_writer()
        .try_init();
}

/// A real spoke apiserver and the agent's kube target on it.
struct Spoke {
    env: TestEnv,
    client: kube::Client,
    target: Arc<KubeApplyTarget>,
}

impl Spoke {
    async fn start() -> anyhow::Result<Spoke> {
        let env = TestEnv::start().await?;
        let client = env.client().await?;
        Ok(Spoke {
            target: Arc::new(KubeApplyTarget::new(client.clone())),
            client,
            env,
        })
    }

    fn configmaps(&self) -> Api<ConfigMap> {
        Api::namespaced(self.client.clone(), "default")
    }

    async fn create_namespace(&self, name: &str) -> anyhow::Result<()> {
        let api: Api<Namespace> = Api::all(self.client.clone());
        let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": name}}))?;
        api.create(&PostParams::default(), &ns).await?;
        Ok(())
    }

    async fn create_configmap(&self, name: &str, data: Value) -> anyhow::Result<ConfigMap> {
        let cm: ConfigMap =
            serde_json::from_value(json!({"metadata": {"name": name}, "data": data}))?;
        Ok(self
            .configmaps()
            .create(&PostParams::default(), &cm)
            .await?)
    }
}

/// A governor running on a target, with its handle and reports.
struct Running {
    handle: GovernorHandle,
    reports: mpsc::Receiver<PolicyReport>,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<()>,
}

impl Running {
    fn start(target: Arc<dyn ApplyTarget>) -> Running {
        let (governor, handle, reports) = Governor::new(target);
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(governor.run(async move {
            let _ = stopped.await;
        }));
        Running {
            handle,
            reports,
            stop: Some(stop),
            task,
        }
    }

    async fn upsert(&self, policy: DeliveredPolicy) -> anyhow::Result<()> {
        Ok(self.handle.upsert(policy).await?)
    }

    /// The first report of `uid` that `wanted` accepts, within the deadline.
    async fn report(
        &mut self,
        uid: &str,
        what: &str,
        wanted: impl Fn(&PolicyReport) -> bool,
    ) -> anyhow::Result<PolicyReport> {
        let deadline = Instant::now() + DEADLINE;
        let mut last = None;
        loop {
            let report = match tokio::time::timeout_at(deadline, self.reports.recv()).await {
                Ok(Some(report)) => report,
                Ok(None) => bail!("the governor stopped while waiting for {what}"),
                Err(_) => bail!("timed out waiting for {what}; last report of {uid}: {last:#?}"),
            };
            if report.uid != uid {
                continue;
            }
            if wanted(&report) {
                return Ok(report);
            }
            last = Some(report);
        }
    }

    async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ = self.task.await;
    }
}

/// The policy's compliance and the latest message of each template.
fn summary(report: &PolicyReport) -> (Option<ComplianceState>, Vec<String>) {
    (
        report.status.compliant,
        report
            .status
            .details
            .iter()
            .map(|d| {
                d.history
                    .first()
                    .map(|h| h.message.clone())
                    .unwrap_or_default()
            })
            .collect(),
    )
}

fn compliant(report: &PolicyReport) -> bool {
    report.status.compliant == Some(ComplianceState::Compliant)
}

fn noncompliant(report: &PolicyReport) -> bool {
    report.status.compliant == Some(ComplianceState::NonCompliant)
}

/// The Policy document of a policy-collection example in proto's test data.
fn example(file: &str) -> Policy {
    let path = format!(
        "{}/../proto/tests/data/policies/{file}",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(&path).expect("the example exists");
    let first = text.split("\n---\n").next().expect("a first document");
    yaml_serde::from_str(first).expect("the first document is a Policy")
}

/// `policy` as the hub delivers it: in the `policies` namespace, with `uid`.
fn delivered(uid: &str, generation: i64, mut policy: Policy) -> DeliveredPolicy {
    policy.metadata.namespace = Some("policies".into());
    policy.metadata.uid = Some(uid.into());
    DeliveredPolicy {
        uid: uid.into(),
        generation,
        policy,
    }
}

/// A Policy of one ConfigurationPolicy with these object-templates.
fn configuration_policy(
    name: &str,
    remediation: &str,
    object_templates: Value,
    extra_spec: Value,
) -> Policy {
    let mut spec = json!({
        "remediationAction": remediation,
        "severity": "low",
        "object-templates": object_templates,
    });
    if let (Some(spec), Some(extra)) = (spec.as_object_mut(), extra_spec.as_object()) {
        spec.extend(extra.clone());
    }
    serde_json::from_value(json!({
        "apiVersion": "policy.open-cluster-management.io/v1",
        "kind": "Policy",
        "metadata": {"name": name},
        "spec": {
            "disabled": false,
            "remediationAction": remediation,
            "policy-templates": [{"objectDefinition": {
                "apiVersion": "policy.open-cluster-management.io/v1",
                "kind": "ConfigurationPolicy",
                "metadata": {"name": format!("{name}-config")},
                "spec": spec,
            }}],
        },
    }))
    .expect("a Policy")
}

fn with_remediation(mut policy: Policy, remediation: &str) -> Policy {
    policy.spec.remediation_action = Some(remediation.into());
    policy
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_namespace_policy_informs_then_enforce_creates_the_namespace() -> anyhow::Result<()> {
    trace_init();
    let spoke = Spoke::start().await?;
    let mut governor = Running::start(spoke.target.clone());

    governor
        .upsert(delivered("ns-uid", 1, example("policy-namespace.yaml")))
        .await?;
    let report = governor
        .report("ns-uid", "inform's verdict", noncompliant)
        .await?;
    assert_eq!(report.generation, 1);
    assert_eq!(
        report.status.details[0].template_meta.name.as_deref(),
        Some("policy-namespace-prod")
    );
    assert_eq!(
        summary(&report).1,
        ["NonCompliant; violation - namespaces [prod] not found"]
    );
    let namespaces: Api<Namespace> = Api::all(spoke.client.clone());
    assert!(
        namespaces.get_opt("prod").await?.is_none(),
        "inform never writes"
    );

    // The hub changes the policy to enforce: a new generation.
    governor
        .upsert(delivered(
            "ns-uid",
            2,
            with_remediation(example("policy-namespace.yaml"), "enforce"),
        ))
        .await?;
    let report = governor
        .report("ns-uid", "enforce's verdict", |r| {
            r.generation == 2 && compliant(r)
        })
        .await?;
    assert_eq!(
        summary(&report).1,
        ["Compliant; notification - namespaces [prod] found as specified"]
    );
    let history: Vec<&str> = report.status.details[0]
        .history
        .iter()
        .map(|h| h.message.as_str())
        .collect();
    assert_eq!(
        history,
        [
            "Compliant; notification - namespaces [prod] found as specified",
            "NonCompliant; violation - namespaces [prod] not found",
        ],
        "most recent first, one entry per change"
    );
    let prod = namespaces.get("prod").await?;
    assert_eq!(
        prod.metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(ANNOTATION_CREATED_BY_POLICY))
            .map(String::as_str),
        Some("ns-uid"),
        "what enforce creates is marked as the policy's"
    );
    let managers: Vec<String> = prod
        .metadata
        .managed_fields
        .unwrap_or_default()
        .into_iter()
        .filter_map(|m| m.manager)
        .collect();
    assert!(
        managers.iter().any(|m| m == "flotilla-policy-agent"),
        "{managers:?}"
    );

    // Delivered again as it is (a resumed session), then another policy: only the other
    // one is reported.
    governor
        .upsert(delivered(
            "ns-uid",
            2,
            with_remediation(example("policy-namespace.yaml"), "enforce"),
        ))
        .await?;
    governor
        .upsert(delivered("marker-uid", 1, example("policy-namespace.yaml")))
        .await?;
    let deadline = Instant::now() + DEADLINE;
    loop {
        let report = tokio::time::timeout_at(deadline, governor.reports.recv())
            .await
            .context("waiting for the other policy's report")?
            .context("the governor stopped")?;
        assert_ne!(report.uid, "ns-uid", "nothing changed, nothing reported");
        if report.uid == "marker-uid" {
            break;
        }
    }
    governor.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mustnothave_enforce_deletes_the_anonymous_cluster_admin_bindings() -> anyhow::Result<()> {
    trace_init();
    let spoke = Spoke::start().await?;
    let bindings: Api<ClusterRoleBinding> = Api::all(spoke.client.clone());
    let binding = |name: &str, role: &str, group: &str| -> anyhow::Result<ClusterRoleBinding> {
        Ok(serde_json::from_value(json!({
            "metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": group}],
        }))?)
    };
    let params = PostParams::default();
    // Matched by its fields, whatever its name.
    bindings
        .create(
            &params,
            &binding("innocent-name", "cluster-admin", "system:anonymous")?,
        )
        .await?;
    // Matched by its name.
    bindings
        .create(&params, &binding("anonymous-admin", "view", "team-a")?)
        .await?;
    // Neither.
    bindings
        .create(&params, &binding("team-a-view", "view", "team-a")?)
        .await?;

    let mut governor = Running::start(spoke.target.clone());
    governor
        .upsert(delivered(
            "rbac-uid",
            1,
            with_remediation(example("policy-rbac-anonymous.yaml"), "inform"),
        ))
        .await?;
    let report = governor
        .report("rbac-uid", "inform's verdict", noncompliant)
        .await?;
    let message = &summary(&report).1[0];
    assert!(
        message.contains("clusterrolebindings [innocent-name] found")
            && message.contains("clusterrolebindings [anonymous-admin] found"),
        "{message}"
    );

    governor
        .upsert(delivered(
            "rbac-uid",
            2,
            example("policy-rbac-anonymous.yaml"),
        ))
        .await?;
    let report = governor
        .report("rbac-uid", "enforce's verdict", |r| {
            r.generation == 2 && compliant(r)
        })
        .await?;
    assert!(
        summary(&report).1[0].starts_with("Compliant; notification - "),
        "{report:?}"
    );
    assert!(bindings.get_opt("innocent-name").await?.is_none());
    assert!(bindings.get_opt("anonymous-admin").await?.is_none());
    assert!(
        bindings.get_opt("team-a-view").await?.is_some(),
        "a binding the policy does not match stays"
    );
    governor.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mustonlyhave_names_the_extra_key_enforce_removes_it_and_drift_is_seen_by_the_watch()
-> anyhow::Result<()> {
    trace_init();
    let spoke = Spoke::start().await?;
    spoke
        .create_configmap("settings", json!({"mode": "strict", "extra": "x"}))
        .await?;
    spoke
        .create_configmap("watched", json!({"mode": "strict"}))
        .await?;
    let only_mode = |name: &str| {
        json!([{"complianceType": "mustonlyhave", "objectDefinition": {
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": "default"},
            "data": {"mode": "strict"}}}])
    };
    let mut governor = Running::start(spoke.target.clone());
    governor
        .upsert(delivered(
            "settings-uid",
            1,
            configuration_policy("settings", "inform", only_mode("settings"), json!({})),
        ))
        .await?;
    let report = governor
        .report("settings-uid", "inform's verdict", noncompliant)
        .await?;
    assert_eq!(
        summary(&report).1,
        [
            "NonCompliant; violation - configmaps [settings] found but not as specified in namespace default: data.extra"
        ]
    );

    governor
        .upsert(delivered(
            "settings-uid",
            2,
            configuration_policy("settings", "enforce", only_mode("settings"), json!({})),
        ))
        .await?;
    governor
        .report("settings-uid", "enforce's verdict", |r| {
            r.generation == 2 && compliant(r)
        })
        .await?;
    let data = spoke.configmaps().get("settings").await?.data;
    assert_eq!(
        data.unwrap_or_default().into_keys().collect::<Vec<_>>(),
        ["mode"]
    );

    // An inform policy on another ConfigMap, Compliant, then edited by hand: the watch makes
    // it NonCompliant (its interval is `watch`: nothing else would re-evaluate it).
    governor
        .upsert(delivered(
            "watched-uid",
            1,
            configuration_policy("watched", "inform", only_mode("watched"), json!({})),
        ))
        .await?;
    governor
        .report("watched-uid", "the first verdict", compliant)
        .await?;
    let drift = json!({"data": {"mode": "lax"}});
    spoke
        .configmaps()
        .patch("watched", &PatchParams::default(), &Patch::Merge(&drift))
        .await?;
    let report = governor
        .report("watched-uid", "drift reported", noncompliant)
        .await?;
    assert_eq!(
        summary(&report).1,
        [
            "NonCompliant; violation - configmaps [watched] found but not as specified in namespace default: data.mode"
        ]
    );

    // The enforced one, edited by hand, is repaired.
    spoke
        .configmaps()
        .patch(
            "settings",
            &PatchParams::default(),
            &Patch::Merge(&json!({"data": {"mode": "lax", "added": "y"}})),
        )
        .await?;
    let configmaps = spoke.configmaps();
    wait_for("the drifted ConfigMap repaired", DEADLINE, || {
        let configmaps = configmaps.clone();
        async move {
            let data = configmaps.get("settings").await?.data.unwrap_or_default();
            Ok(
                (data.len() == 1 && data.get("mode").map(String::as_str) == Some("strict"))
                    .then_some(()),
            )
        }
    })
    .await?;
    governor.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_limitrange_is_required_in_the_selected_namespaces() -> anyhow::Result<()> {
    trace_init();
    let spoke = Spoke::start().await?;
    for ns in ["app-a", "app-b", "app-test", "other"] {
        spoke.create_namespace(ns).await?;
    }
    let mut governor = Running::start(spoke.target.clone());
    governor
        .upsert(delivered("lr-uid", 1, example("policy-limitrange.yaml")))
        .await?;
    let report = governor
        .report("lr-uid", "inform's verdict", noncompliant)
        .await?;
    assert_eq!(
        summary(&report).1,
        [
            "NonCompliant; violation - limitranges [container-mem-limit-range] not found in namespace app-a; limitranges [container-mem-limit-range] not found in namespace app-b"
        ]
    );

    governor
        .upsert(delivered(
            "lr-uid",
            2,
            with_remediation(example("policy-limitrange.yaml"), "enforce"),
        ))
        .await?;
    governor
        .report("lr-uid", "enforce's verdict", |r| {
            r.generation == 2 && compliant(r)
        })
        .await?;
    for (ns, expected) in [
        ("app-a", true),
        ("app-b", true),
        ("app-test", false),
        ("other", false),
    ] {
        let api: Api<LimitRange> = Api::namespaced(spoke.client.clone(), ns);
        let found = api.get_opt("container-mem-limit-range").await?;
        assert_eq!(found.is_some(), expected, "LimitRange in {ns}");
    }
    governor.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_template_wrong_for_the_spoke_stops_neither_its_engine_nor_other_policies()
-> anyhow::Result<()> {
    trace_init();
    let spoke = Spoke::start().await?;
    let mut governor = Running::start(spoke.target.clone());
    let unknown = configuration_policy(
        "widgets",
        "enforce",
        json!([{"complianceType": "musthave", "objectDefinition": {
            "apiVersion": "example.com/v1", "kind": "Widget",
            "metadata": {"name": "w", "namespace": "default"}}}]),
        json!({}),
    );
    let mut gatekeeper = configuration_policy("gk", "inform", json!([]), json!({}));
    gatekeeper.spec.policy_templates[0].object_definition = json!({
        "apiVersion": "constraints.gatekeeper.sh/v1beta1",
        "kind": "K8sRequiredLabels",
        "metadata": {"name": "ns-must-have-owner"},
        "spec": {"parameters": {"labels": [{"key": "owner"}]}},
    })
    .into();
    let fine = configuration_policy(
        "default-ns",
        "inform",
        json!([{"complianceType": "musthave", "objectDefinition": {
            "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "default"}}}]),
        json!({}),
    );
    let invalid = configuration_policy(
        "invalid",
        "inform",
        json!([{"complianceType": "musthave", "objectDefinition": {
            "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "default"}}}]),
        json!({"pruneObjectBehavior": "Sometimes"}),
    );
    let mut certificates = configuration_policy("certs", "inform", json!([]), json!({}));
    certificates.spec.policy_templates[0].object_definition = json!({
        "apiVersion": "policy.open-cluster-management.io/v1",
        "kind": "CertificatePolicy",
        "metadata": {"name": "certificates-expire-late"},
        "spec": {"minimumDuration": "300h"},
    })
    .into();
    governor.upsert(delivered("widget-uid", 1, unknown)).await?;
    governor.upsert(delivered("gk-uid", 1, gatekeeper)).await?;
    governor
        .upsert(delivered("cert-uid", 1, certificates))
        .await?;
    governor
        .upsert(delivered("invalid-uid", 1, invalid))
        .await?;
    governor.upsert(delivered("fine-uid", 1, fine)).await?;

    let mut seen = std::collections::HashMap::new();
    let deadline = Instant::now() + DEADLINE;
    while seen.len() < 5 {
        let report = tokio::time::timeout_at(deadline, governor.reports.recv())
            .await
            .with_context(|| format!("waiting for five reports, have {seen:#?}"))?
            .context("the governor stopped")?;
        seen.insert(report.uid.clone(), summary(&report));
    }
    let (compliance, messages) = &seen["widget-uid"];
    assert_eq!(*compliance, Some(ComplianceState::NonCompliant));
    assert!(
        messages[0].contains("the spoke cluster serves no kind Widget in example.com/v1"),
        "{messages:?}"
    );
    let (compliance, messages) = &seen["gk-uid"];
    assert_eq!(*compliance, Some(ComplianceState::NonCompliant));
    assert!(
        messages[0].contains("the spoke cluster serves no kind K8sRequiredLabels")
            && messages[0].contains("is the engine that evaluates K8sRequiredLabels ns-must-have-owner installed on the cluster?"),
        "{messages:?}"
    );
    let (compliance, messages) = &seen["cert-uid"];
    assert_eq!(*compliance, Some(ComplianceState::NonCompliant));
    assert_eq!(
        messages[0],
        "NonCompliant; violation - template kind CertificatePolicy is not evaluated by flotilla's agent"
    );
    let (compliance, messages) = &seen["invalid-uid"];
    assert_eq!(*compliance, Some(ComplianceState::NonCompliant));
    assert!(
        messages[0].contains("pruneObjectBehavior") && messages[0].contains("Sometimes"),
        "the validator's message: {messages:?}"
    );
    let (compliance, messages) = &seen["fine-uid"];
    assert_eq!(
        *compliance,
        Some(ComplianceState::Compliant),
        "{messages:?}"
    );
    governor.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removing_a_delete_if_created_policy_deletes_only_what_enforce_created_even_after_a_restart()
-> anyhow::Result<()> {
    trace_init();
    let spoke = Spoke::start().await?;
    spoke
        .create_configmap("existed", json!({"owner": "team-a"}))
        .await?;
    let policy = || {
        let musthave = |name: &str| {
            json!({"complianceType": "musthave", "objectDefinition": {
                "apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": name, "namespace": "default"},
                "data": {"owner": "team-a"}}})
        };
        delivered(
            "prune-uid",
            1,
            configuration_policy(
                "prune",
                "enforce",
                json!([musthave("existed"), musthave("created")]),
                json!({"pruneObjectBehavior": "DeleteIfCreated"}),
            ),
        )
    };
    let mut first = Running::start(spoke.target.clone());
    first.upsert(policy()).await?;
    first
        .report("prune-uid", "enforce's verdict", compliant)
        .await?;
    assert!(spoke.configmaps().get_opt("created").await?.is_some());
    first.stop().await;

    // A restarted agent: the cache delivers the policy again, then the hub removes it.
    let second = Running::start(spoke.target.clone());
    second.upsert(policy()).await?;
    second.handle.remove("prune-uid").await?;
    assert!(
        spoke.configmaps().get_opt("created").await?.is_none(),
        "what enforce created is pruned"
    );
    assert!(
        spoke.configmaps().get_opt("existed").await?.is_some(),
        "what existed before stays"
    );
    second.stop().await;
    Ok(())
}

#[tokio::test]
async fn the_load_tests_in_memory_cluster_evaluates_and_enforces_the_namespace_policy()
-> anyhow::Result<()> {
    trace_init();
    let cluster = Arc::new(MemoryCluster::new());
    let mut governor = Running::start(cluster.clone());
    governor
        .upsert(delivered("ns-uid", 1, example("policy-namespace.yaml")))
        .await?;
    let report = governor
        .report("ns-uid", "inform's verdict", noncompliant)
        .await?;
    assert_eq!(
        summary(&report).1,
        ["NonCompliant; violation - namespaces [prod] not found"]
    );
    governor
        .upsert(delivered(
            "ns-uid",
            2,
            with_remediation(example("policy-namespace.yaml"), "enforce"),
        ))
        .await?;
    governor
        .report("ns-uid", "enforce's verdict", |r| {
            r.generation == 2 && compliant(r)
        })
        .await?;
    let prod = AppliedResource {
        group: String::new(),
        version: "v1".into(),
        kind: "Namespace".into(),
        resource: "namespaces".into(),
        namespace: String::new(),
        name: "prod".into(),
    };
    assert!(cluster.get(&prod).await.is_some());

    // Deleted by someone else: the watch sees it and enforce makes it again.
    ApplyTarget::delete(cluster.as_ref(), &prod).await?;
    wait_for("the namespace made again", DEADLINE, || {
        let cluster = cluster.clone();
        let prod = prod.clone();
        async move { Ok(cluster.get(&prod).await.map(drop)) }
    })
    .await?;
    governor.stop().await;
    Ok(())
}

#[tokio::test(start_paused = true)]
async fn under_an_interval_a_policy_is_evaluated_again_when_the_interval_runs_out_not_on_changes()
-> anyhow::Result<()> {
    trace_init();
    let cluster = Arc::new(MemoryCluster::new());
    let mut governor = Running::start(cluster.clone());
    let policy = configuration_policy(
        "interval",
        "inform",
        json!([{"complianceType": "musthave", "objectDefinition": {
            "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "prod"}}}]),
        json!({"evaluationInterval": {"compliant": "10m", "noncompliant": "30s"}}),
    );
    governor
        .upsert(delivered("interval-uid", 1, policy))
        .await?;
    governor
        .report("interval-uid", "the first verdict", noncompliant)
        .await?;
    let evaluated = Instant::now();
    let prod = AppliedResource {
        group: String::new(),
        version: "v1".into(),
        kind: "Namespace".into(),
        resource: "namespaces".into(),
        namespace: String::new(),
        name: "prod".into(),
    };
    let namespace = json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "prod"}});
    cluster.create(&prod, &namespace, "someone").await?;
    governor
        .report("interval-uid", "the verdict after the interval", compliant)
        .await?;
    assert!(
        evaluated.elapsed() >= Duration::from_secs(30),
        "seen by the 30 s noncompliant interval, not by the change (on the paused clock: {:?})",
        evaluated.elapsed()
    );
    governor.stop().await;
    Ok(())
}

#[tokio::test]
async fn a_lagging_consumer_neither_stalls_the_governor_nor_misses_any_policys_latest_report()
-> anyhow::Result<()> {
    trace_init();
    const POLICIES: usize = 80;
    let cluster = Arc::new(MemoryCluster::new());
    let mut governor = Running::start(cluster.clone());
    let policy = |i: usize, generation: i64| {
        let name = format!("p{i}");
        delivered(
            &format!("uid-{i}"),
            generation,
            configuration_policy(
                &name,
                "inform",
                json!([{"complianceType": "musthave", "objectDefinition": {
                    "apiVersion": "v1", "kind": "Namespace",
                    "metadata": {"name": format!("ns-{i}-{generation}")}}}]),
                json!({}),
            ),
        )
    };
    // Nobody reads while two generations of every policy are delivered and evaluated: more
    // reports than the channel holds. The governor never waits on the consumer, so the
    // handle keeps working (a remove of an unknown policy returns once every command before
    // it was taken).
    for generation in [1, 2] {
        for i in 0..POLICIES {
            governor.upsert(policy(i, generation)).await?;
        }
    }
    tokio::time::timeout(DEADLINE, governor.handle.remove("unknown"))
        .await
        .context("the governor waited on the consumer")??;
    let mut latest = std::collections::HashMap::new();
    let deadline = Instant::now() + DEADLINE;
    while latest.values().filter(|g| **g == 2).count() < POLICIES {
        let report = tokio::time::timeout_at(deadline, governor.reports.recv())
            .await
            .with_context(|| format!("waiting for generation 2 of every policy: {latest:?}"))?
            .context("the governor stopped")?;
        let message = summary(&report).1.join("");
        assert!(
            message.contains(&format!("ns-{}", &report.uid[4..])),
            "{message}"
        );
        let previous = latest.insert(report.uid.clone(), report.generation);
        assert!(
            previous.is_none_or(|g| g < report.generation),
            "reports of a policy arrive in order"
        );
    }
    governor.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gatekeeper_and_kyverno_templates_are_applied_and_judged_by_their_engines_reports()
-> anyhow::Result<()> {
    trace_init();
    let spoke = Spoke::start().await?;
    spoke
        .env
        .install_crds(
            &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/policy-engines"),
        )
        .await?;
    let dynamic = |group: &str, version: &str, kind: &str, plural: &str| -> Api<DynamicObject> {
        let gvk = GroupVersionKind::gvk(group, version, kind);
        Api::all_with(
            spoke.client.clone(),
            &ApiResource::from_gvk_with_plural(&gvk, plural),
        )
    };
    let constraints = dynamic(
        "constraints.gatekeeper.sh",
        "v1beta1",
        "K8sRequiredLabels",
        "k8srequiredlabels",
    );
    let kyverno_policies = dynamic("kyverno.io", "v1", "ClusterPolicy", "clusterpolicies");
    let with_template = |name: &str, object: Value| {
        let mut policy = configuration_policy(name, "enforce", json!([]), json!({}));
        policy.spec.policy_templates[0].object_definition = object.into();
        policy
    };
    let mut governor = Running::start(spoke.target.clone());

    // Gatekeeper: applied, then judged by its audit.
    governor
        .upsert(delivered(
            "gk-uid",
            1,
            with_template(
                "gk",
                json!({
                    "apiVersion": "constraints.gatekeeper.sh/v1beta1",
                    "kind": "K8sRequiredLabels",
                    "metadata": {"name": "ns-must-have-owner"},
                    "spec": {
                        "match": {"kinds": [{"apiGroups": [""], "kinds": ["Namespace"]}]},
                        "parameters": {"labels": [{"key": "owner"}]},
                    },
                }),
            ),
        ))
        .await?;
    let report = governor
        .report("gk-uid", "the constraint before its audit", noncompliant)
        .await?;
    assert_eq!(
        summary(&report).1,
        [
            "NonCompliant; violation - K8sRequiredLabels ns-must-have-owner has not been audited by Gatekeeper yet (status.totalViolations)"
        ]
    );
    let applied = constraints.get("ns-must-have-owner").await?;
    assert_eq!(
        applied.data["spec"]["parameters"]["labels"][0]["key"], "owner",
        "applied as given"
    );
    let audit = |total: u64, violations: Value| json!({"status": {"totalViolations": total, "violations": violations}});
    constraints
        .patch_status(
            "ns-must-have-owner",
            &PatchParams::default(),
            &Patch::Merge(&audit(
                1,
                json!([{"kind": "Namespace", "name": "team-a", "enforcementAction": "deny",
                        "message": "you must provide labels: {\"owner\"}"}]),
            )),
        )
        .await?;
    let report = governor
        .report("gk-uid", "the audit's violation", |r| {
            summary(r).1[0].contains("has 1 violations")
        })
        .await?;
    assert_eq!(
        summary(&report).1,
        [
            "NonCompliant; violation - K8sRequiredLabels ns-must-have-owner has 1 violations: Namespace [team-a]: you must provide labels: {\"owner\"}"
        ]
    );
    constraints
        .patch_status(
            "ns-must-have-owner",
            &PatchParams::default(),
            &Patch::Merge(&audit(0, json!([]))),
        )
        .await?;
    governor
        .report("gk-uid", "the clean audit", compliant)
        .await?;

    // Kyverno: applied, then judged by the policy reports' results for it.
    governor
        .upsert(delivered(
            "kyverno-uid",
            1,
            with_template(
                "kyverno",
                json!({
                    "apiVersion": "kyverno.io/v1",
                    "kind": "ClusterPolicy",
                    "metadata": {"name": "require-team-label"},
                    "spec": {"validationFailureAction": "Audit", "rules": [{
                        "name": "check-team",
                        "match": {"any": [{"resources": {"kinds": ["Pod"]}}]},
                        "validate": {"message": "label team is required",
                                     "pattern": {"metadata": {"labels": {"team": "?*"}}}},
                    }]},
                }),
            ),
        ))
        .await?;
    let report = governor
        .report("kyverno-uid", "the policy without reports", compliant)
        .await?;
    assert_eq!(
        summary(&report).1,
        [
            "Compliant; notification - ClusterPolicy require-team-label has no failing results in the policy reports"
        ]
    );
    assert!(
        kyverno_policies
            .get_opt("require-team-label")
            .await?
            .is_some()
    );
    let reports: Api<DynamicObject> = Api::namespaced_with(
        spoke.client.clone(),
        "default",
        &ApiResource::from_gvk_with_plural(
            &GroupVersionKind::gvk("wgpolicyk8s.io", "v1alpha2", "PolicyReport"),
            "policyreports",
        ),
    );
    let report_object: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "wgpolicyk8s.io/v1alpha2", "kind": "PolicyReport",
        "metadata": {"name": "pod-web", "namespace": "default"},
        "scope": {"apiVersion": "v1", "kind": "Pod", "name": "web", "namespace": "default"},
        "results": [
            {"policy": "require-team-label", "rule": "check-team", "result": "fail",
             "message": "validation error: label team is required"},
            {"policy": "some-other-policy", "rule": "r", "result": "fail", "message": "not ours"},
        ],
        "summary": {"fail": 2, "pass": 0},
    }))?;
    reports
        .create(&PostParams::default(), &report_object)
        .await?;
    let report = governor
        .report("kyverno-uid", "the failing result", noncompliant)
        .await?;
    assert_eq!(
        summary(&report).1,
        [
            "NonCompliant; violation - ClusterPolicy require-team-label has 1 failing results: Pod [web] in namespace default: rule check-team: validation error: label team is required"
        ]
    );

    // Removed from the cluster: the template objects are the policy's and go with it.
    governor.handle.remove("gk-uid").await?;
    governor.handle.remove("kyverno-uid").await?;
    assert!(constraints.get_opt("ns-must-have-owner").await?.is_none());
    assert!(
        kyverno_policies
            .get_opt("require-team-label")
            .await?
            .is_none()
    );
    governor.stop().await;
    Ok(())
}

#[tokio::test]
async fn many_policies_removed_at_once_each_prune_only_what_they_created() -> anyhow::Result<()> {
    trace_init();
    const POLICIES: usize = 10;
    let cluster = Arc::new(MemoryCluster::new());
    let configmap = |name: &str| AppliedResource {
        group: String::new(),
        version: "v1".into(),
        kind: "ConfigMap".into(),
        resource: "configmaps".into(),
        namespace: "default".into(),
        name: name.into(),
    };
    let existed = json!({"apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "existed", "namespace": "default"}, "data": {"owner": "team-a"}});
    cluster
        .create(&configmap("existed"), &existed, "someone")
        .await?;
    let mut governor = Running::start(cluster.clone());
    for i in 0..POLICIES {
        let musthave = |name: String| {
            json!({"complianceType": "musthave", "objectDefinition": {
                "apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": name, "namespace": "default"},
                "data": {"owner": "team-a"}}})
        };
        governor
            .upsert(delivered(
                &format!("uid-{i}"),
                1,
                configuration_policy(
                    &format!("p{i}"),
                    "enforce",
                    json!([musthave("existed".into()), musthave(format!("made-{i}"))]),
                    json!({"pruneObjectBehavior": "DeleteIfCreated"}),
                ),
            ))
            .await?;
    }
    let mut compliant_ones = std::collections::HashSet::new();
    let deadline = Instant::now() + DEADLINE;
    while compliant_ones.len() < POLICIES {
        let report = tokio::time::timeout_at(deadline, governor.reports.recv())
            .await
            .context("waiting for every policy to be Compliant")?
            .context("the governor stopped")?;
        if compliant(&report) {
            compliant_ones.insert(report.uid);
        }
    }
    let removals = (0..POLICIES).map(|i| {
        let handle = governor.handle.clone();
        async move { handle.remove(&format!("uid-{i}")).await }
    });
    tokio::time::timeout(DEADLINE, futures::future::try_join_all(removals))
        .await
        .context("waiting for the removals")??;
    for i in 0..POLICIES {
        assert!(
            cluster
                .get(&configmap(&format!("made-{i}")))
                .await
                .is_none(),
            "made-{i} was created by its policy and pruned"
        );
    }
    assert!(
        cluster.get(&configmap("existed")).await.is_some(),
        "what existed before stays"
    );
    governor.stop().await;
    Ok(())
}

#[tokio::test]
async fn a_changed_template_prunes_what_it_created_and_no_longer_names() -> anyhow::Result<()> {
    trace_init();
    let cluster = Arc::new(MemoryCluster::new());
    let configmap = |name: &str| AppliedResource {
        group: String::new(),
        version: "v1".into(),
        kind: "ConfigMap".into(),
        resource: "configmaps".into(),
        namespace: "default".into(),
        name: name.into(),
    };
    let existed = json!({"apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "existed", "namespace": "default"}, "data": {"owner": "team-a"}});
    cluster
        .create(&configmap("existed"), &existed, "someone")
        .await?;
    let naming = |generation: i64, names: &[&str]| {
        let templates: Vec<Value> = names
            .iter()
            .map(|name| {
                json!({"complianceType": "musthave", "objectDefinition": {
                    "apiVersion": "v1", "kind": "ConfigMap",
                    "metadata": {"name": name, "namespace": "default"},
                    "data": {"owner": "team-a"}}})
            })
            .collect();
        delivered(
            "change-uid",
            generation,
            configuration_policy(
                "change",
                "enforce",
                Value::Array(templates),
                json!({"pruneObjectBehavior": "DeleteIfCreated"}),
            ),
        )
    };
    let mut governor = Running::start(cluster.clone());
    governor.upsert(naming(1, &["existed", "first"])).await?;
    governor
        .report("change-uid", "the first delivery enforced", compliant)
        .await?;
    assert!(cluster.get(&configmap("first")).await.is_some());

    governor.upsert(naming(2, &["second"])).await?;
    governor
        .report("change-uid", "the change enforced", |r| {
            r.generation == 2 && compliant(r)
        })
        .await?;
    assert!(
        cluster.get(&configmap("first")).await.is_none(),
        "created by the policy and no longer named: pruned"
    );
    assert!(cluster.get(&configmap("second")).await.is_some());
    assert!(
        cluster.get(&configmap("existed")).await.is_some(),
        "no longer named, but not the policy's: kept"
    );

    // A change of what the template says of an object it still names prunes nothing.
    let mut changed = naming(3, &["second"]);
    let configuration = &mut changed.policy.spec.policy_templates[0].object_definition.0;
    configuration["spec"]["object-templates"][0]["objectDefinition"]["data"]["owner"] =
        json!("team-b");
    governor.upsert(changed).await?;
    governor
        .report("change-uid", "the third delivery enforced", |r| {
            r.generation == 3 && compliant(r)
        })
        .await?;
    let second = cluster.get(&configmap("second")).await;
    assert_eq!(
        second.as_ref().map(|cm| &cm["data"]["owner"]),
        Some(&json!("team-b")),
        "updated, not pruned"
    );
    governor.stop().await;
    Ok(())
}

#[tokio::test]
async fn a_template_dropped_from_its_policy_is_pruned_as_if_removed() -> anyhow::Result<()> {
    trace_init();
    let cluster = Arc::new(MemoryCluster::new());
    let configmap = |name: &str| AppliedResource {
        group: String::new(),
        version: "v1".into(),
        kind: "ConfigMap".into(),
        resource: "configmaps".into(),
        namespace: "default".into(),
        name: name.into(),
    };
    let template = |name: &str| {
        let policy = configuration_policy(
            name,
            "enforce",
            json!([{"complianceType": "musthave", "objectDefinition": {
                "apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": name, "namespace": "default"}, "data": {"k": "v"}}}]),
            json!({"pruneObjectBehavior": "DeleteIfCreated"}),
        );
        policy.spec.policy_templates[0].clone()
    };
    let with_templates = |generation: i64, names: &[&str]| {
        let mut policy = configuration_policy("two", "enforce", json!([]), json!({}));
        policy.spec.policy_templates = names.iter().map(|n| template(n)).collect();
        delivered("two-uid", generation, policy)
    };
    let mut governor = Running::start(cluster.clone());
    governor
        .upsert(with_templates(1, &["kept", "dropped"]))
        .await?;
    let report = governor
        .report("two-uid", "both templates enforced", compliant)
        .await?;
    assert_eq!(report.status.details.len(), 2);
    assert!(cluster.get(&configmap("dropped")).await.is_some());

    // The hub drops the second template, and puts the first one second behind a new one:
    // templates are matched by name, not position.
    governor
        .upsert(with_templates(2, &["added", "kept"]))
        .await?;
    let report = governor
        .report("two-uid", "the change enforced", |r| {
            r.generation == 2 && compliant(r)
        })
        .await?;
    let names: Vec<_> = report
        .status
        .details
        .iter()
        .map(|d| d.template_meta.name.clone().unwrap_or_default())
        .collect();
    assert_eq!(names, ["added-config", "kept-config"]);
    wait_for("the dropped template's ConfigMap pruned", DEADLINE, || {
        let cluster = cluster.clone();
        let dropped = configmap("dropped");
        async move { Ok(cluster.get(&dropped).await.is_none().then_some(())) }
    })
    .await?;
    assert!(cluster.get(&configmap("kept")).await.is_some());
    assert!(cluster.get(&configmap("added")).await.is_some());
    governor.stop().await;
    Ok(())
}

/// A ConfigMap in `default` of the in-memory cluster.
fn default_configmap(name: &str) -> AppliedResource {
    AppliedResource {
        group: String::new(),
        version: "v1".into(),
        kind: "ConfigMap".into(),
        resource: "configmaps".into(),
        namespace: "default".into(),
        name: name.into(),
    }
}

#[tokio::test]
async fn a_lookup_template_copies_a_value_of_the_spoke_and_follows_its_changes()
-> anyhow::Result<()> {
    trace_init();
    let cluster = Arc::new(MemoryCluster::new());
    let source = |color: &str| {
        json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "source", "namespace": "default"}, "data": {"color": color}})
    };
    cluster
        .create(&default_configmap("source"), &source("blue"), "someone")
        .await?;
    let policy = configuration_policy(
        "copy",
        "enforce",
        json!([{"complianceType": "musthave", "objectDefinition": {
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "copy", "namespace": "default"},
            "data": {
                "color": "{{ (lookup \"v1\" \"ConfigMap\" \"default\" \"source\").data.color }}",
                "shape": "{{ (lookup \"v1\" \"ConfigMap\" \"default\" \"absent\").data.shape | default \"round\" | upper }}"}}}]),
        json!({}),
    );
    let mut governor = Running::start(cluster.clone());
    governor.upsert(delivered("copy-uid", 1, policy)).await?;
    governor
        .report("copy-uid", "the copy enforced", compliant)
        .await?;
    let copy = cluster.get(&default_configmap("copy")).await;
    assert_eq!(
        copy.as_ref().map(|cm| cm["data"].clone()),
        Some(json!({"color": "blue", "shape": "ROUND"}))
    );

    // The looked-up object is watched: its change is copied without a new delivery.
    let current = cluster
        .get(&default_configmap("source"))
        .await
        .context("the source")?;
    let mut red = source("red");
    red["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"].clone();
    cluster
        .replace(&default_configmap("source"), &red, "someone")
        .await?;
    wait_for("the change copied", DEADLINE, || {
        let cluster = cluster.clone();
        async move {
            Ok(cluster
                .get(&default_configmap("copy"))
                .await
                .filter(|cm| cm["data"]["color"] == "red")
                .map(drop))
        }
    })
    .await?;
    governor.stop().await;
    Ok(())
}

#[tokio::test]
async fn a_template_that_fails_to_resolve_is_noncompliant_naming_it_and_others_still_evaluate()
-> anyhow::Result<()> {
    trace_init();
    let cluster = Arc::new(MemoryCluster::new());
    // More reads than one object-template may make.
    let greedy: String = (0..=MAX_LOOKUPS)
        .map(|n| format!("{{{{ (lookup \"v1\" \"ConfigMap\" \"default\" \"cm-{n}\").data.x }}}}"))
        .collect();
    let failing = configuration_policy(
        "failing",
        "enforce",
        json!([
            {"complianceType": "musthave", "objectDefinition": {
                "apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": "from-absent", "namespace": "default"},
                "data": {"v": "{{ fromConfigMap \"default\" \"absent\" \"k\" }}"}}},
            {"complianceType": "musthave", "objectDefinition": {
                "apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": "of-a-kind", "namespace": "default"},
                "data": {"v": "{{ (lookup \"example.com/v1\" \"Widget\" \"\" \"w\").spec.size }}"}}},
            {"complianceType": "musthave", "objectDefinition": {
                "apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": "plain", "namespace": "default"},
                "data": {"v": "{{ \"ok\" }}"}}},
            {"complianceType": "musthave", "objectDefinition": {
                "apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": "greedy", "namespace": "default"},
                "data": {"v": greedy}}},
        ]),
        json!({}),
    );
    let other = configuration_policy(
        "other",
        "enforce",
        json!([{"complianceType": "musthave", "objectDefinition": {
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "other", "namespace": "default"},
            "data": {"v": "{{ \"fine\" | upper }}"}}}]),
        json!({}),
    );
    let mut governor = Running::start(cluster.clone());
    governor
        .upsert(delivered("failing-uid", 1, failing))
        .await?;
    governor.upsert(delivered("other-uid", 1, other)).await?;
    let report = governor
        .report(
            "failing-uid",
            "the failing templates' verdict",
            noncompliant,
        )
        .await?;
    let message = &summary(&report).1[0];
    let unknown_kind = ApplyTarget::resolve(cluster.as_ref(), "example.com/v1", "Widget")
        .await
        .expect_err("the in-memory cluster serves no Widget");
    assert_eq!(
        message,
        &format!(
            "NonCompliant; violation - failed to resolve the template {{{{ fromConfigMap \"default\" \"absent\" \"k\" }}}} at data.v: fromConfigMap: configmaps \"absent\" not found in namespace default; failed to resolve the template {{{{ (lookup \"example.com/v1\" \"Widget\" \"\" \"w\").spec.size }}}} at data.v: {unknown_kind}; configmaps [plain] found as specified in namespace default; failed to resolve the templates: they read more than {MAX_LOOKUPS} objects"
        ),
    );
    assert!(
        cluster
            .get(&default_configmap("from-absent"))
            .await
            .is_none()
            && cluster.get(&default_configmap("of-a-kind")).await.is_none(),
        "a template that did not render enforces nothing"
    );
    assert_eq!(
        cluster
            .get(&default_configmap("plain"))
            .await
            .map(|cm| cm["data"]["v"].clone()),
        Some(json!("ok"))
    );
    governor
        .report("other-uid", "the other policy's verdict", compliant)
        .await?;
    assert_eq!(
        cluster
            .get(&default_configmap("other"))
            .await
            .map(|cm| cm["data"]["v"].clone()),
        Some(json!("FINE"))
    );

    // The ConfigMap appears: the read is watched, so the template resolves and is enforced.
    let absent = json!({"apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "absent", "namespace": "default"}, "data": {"k": "found"}});
    cluster
        .create(&default_configmap("absent"), &absent, "someone")
        .await?;
    wait_for("the template resolved and enforced", DEADLINE, || {
        let cluster = cluster.clone();
        async move {
            Ok(cluster
                .get(&default_configmap("from-absent"))
                .await
                .filter(|cm| cm["data"]["v"] == "found")
                .map(drop))
        }
    })
    .await?;
    governor.stop().await;
    Ok(())
}
