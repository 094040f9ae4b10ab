//! deploy/ as an operator installs it: every kustomization rendered by the real `kubectl
//! kustomize`, server-side applied with strict field validation to the real kube-apiserver
//! (`kubectl apply --server-side --validate=strict`), and read back. The apiserver checks every
//! object against its schema and PodSecurity checks every pod template; what is stored is then
//! held to what the pods need (probes, requests and limits, a restricted security context) and
//! the RBAC to every call the hub, the gateways and the agent make, asked with `kubectl auth
//! can-i` as their ServiceAccounts. No controllers run, so no pod starts: these tests check the
//! stored objects, and the flags they pass against the binaries' own `--help`.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context as _, ensure};
use flotilla_e2e::proxy::kubectl;
use flotilla_e2e::{bin, wait_for};
use flotilla_hub::proxy::access::AccessRules;
use flotilla_proto::api::Kind;
use flotilla_proto::contract::RENEWAL_SIGNER;
use flotilla_testenv::{TestEnv, workspace_root};
use futures::StreamExt as _;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{
    ConfigMap, Container, PersistentVolumeClaim, PodSpec, Probe, Service, ServiceAccount,
};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::Api;
use serde_json::Value;

/// The field manager of these applies, as an operator's CI would name its own.
const FIELD_MANAGER: &str = "flotilla-deploy-test";
/// Where the hub side lives.
const HUB_NAMESPACE: &str = "flotilla-system";
/// Where the agent lives on a spoke.
const AGENT_NAMESPACE: &str = "flotilla-agent";
/// The port every binary serves `/metrics`, `/healthz` and `/readyz` on.
const METRICS_PORT: i32 = 9090;
/// The agents' port: gRPC on TCP and QUIC on UDP.
const AGENTS_PORT: i32 = 9443;
/// How long CRDs may take to be Established after the apply.
const ESTABLISHED_TIMEOUT: Duration = Duration::from_secs(60);

/// `deploy/<path>` (`""`: `deploy/` itself) rendered by `kubectl kustomize` into a file of
/// `dir`.
async fn render(dir: &Path, path: &str) -> anyhow::Result<PathBuf> {
    let source = workspace_root().join("deploy").join(path);
    let source = source.to_string_lossy();
    // kustomize reads no cluster: an empty kubeconfig keeps the machine's own out of it.
    let out = kubectl(Path::new("/dev/null"), &["kustomize", source.as_ref()]).await?;
    ensure!(
        out.status.success(),
        "kubectl kustomize {source}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let name = if path.is_empty() { "deploy" } else { path };
    let file = dir.join(format!("{name}.yaml"));
    std::fs::write(&file, &out.stdout)?;
    Ok(file)
}

/// The documents of a rendered file (kustomize separates them with `---` lines).
fn documents(file: &Path) -> anyhow::Result<Vec<Value>> {
    let text = std::fs::read_to_string(file)?;
    text.split("\n---\n")
        .map(|doc| {
            yaml_serde::from_str(doc).with_context(|| format!("a document of {}", file.display()))
        })
        .collect()
}

/// `kubectl apply --server-side --validate=strict` of `file`, as the operator runs it; its
/// stderr (the apiserver's warnings) on success.
async fn apply(env: &TestEnv, file: &Path) -> anyhow::Result<String> {
    let manager = format!("--field-manager={FIELD_MANAGER}");
    let file_arg = file.to_string_lossy();
    let args = [
        "apply",
        "--server-side",
        manager.as_str(),
        "--validate=strict",
        "-f",
        file_arg.as_ref(),
    ];
    let out = kubectl(env.kubeconfig_path(), &args).await?;
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    ensure!(
        out.status.success(),
        "kubectl apply --server-side --validate=strict -f {}:\n{stderr}",
        file.display()
    );
    Ok(stderr)
}

/// A test apiserver with everything in deploy/ applied: the hub side (`deploy/`: CRDs, hub,
/// gateways) and, as if the same apiserver were a spoke, the agent with the ClusterClaim CRD.
struct Installed {
    env: TestEnv,
    /// The rendered files.
    dir: tempfile::TempDir,
    /// The apiserver's warnings from the applies (PodSecurity's among them).
    warnings: String,
    /// The rendered hub side, for tests that change it.
    hub_side: PathBuf,
}

async fn install() -> anyhow::Result<Installed> {
    let dir = tempfile::tempdir()?;
    let env = TestEnv::start().await?;
    let hub_side = render(dir.path(), "").await?;
    let agent = render(dir.path(), "agent").await?;
    let mut warnings = apply(&env, &hub_side).await?;
    let claims =
        workspace_root().join("deploy/crds/cluster.open-cluster-management.io_clusterclaims.yaml");
    warnings += &apply(&env, &claims).await?;
    warnings += &apply(&env, &agent).await?;
    Ok(Installed {
        env,
        dir,
        warnings,
        hub_side,
    })
}

/// Applies the hub side's first Deployment as `change` leaves it; the apply's warnings.
async fn apply_changed_deployment(
    installed: &Installed,
    change: impl FnOnce(&mut Value),
) -> anyhow::Result<String> {
    let mut docs = documents(&installed.hub_side)?;
    let deployment = docs
        .iter_mut()
        .find(|d| d["kind"] == "Deployment")
        .context("no Deployment in the hub side")?;
    change(deployment);
    let file = installed.dir.path().join("changed.yaml");
    std::fs::write(&file, serde_json::to_string(deployment)?)?;
    apply(&installed.env, &file).await
}

/// Every kustomization renders, the hub side and the agent apply with strict validation, and
/// the objects an operator then reads back are there: the CRDs of every kind the hub serves
/// Established, the three Deployments, both Services with TCP and UDP on the agents' port, the
/// gateways' disruption budget and volumes. Applying again (an upgrade with nothing changed)
/// conflicts with nothing, and a manifest with an unknown field is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deploy_applies_strictly_and_reads_back() -> anyhow::Result<()> {
    let installed = install().await?;
    let scratch = tempfile::tempdir()?;
    // Each component renders on its own too, as docs/operations.md applies them one by one.
    for component in ["crds", "hub", "gateway", "agent"] {
        render(scratch.path(), component).await?;
    }
    let client = installed.env.client().await?;

    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    for crd in flotilla_proto::api::crds() {
        let name = crd.metadata.name.clone().unwrap_or_default();
        wait_for(
            &format!("CRD {name} Established"),
            ESTABLISHED_TIMEOUT,
            || async {
                match crds.get_opt(&name).await? {
                    None => anyhow::bail!(
                        "CRD {name} was not applied: is it listed in deploy/crds/kustomization.yaml?"
                    ),
                    Some(crd) => Ok(established(&crd).then_some(())),
                }
            },
        )
        .await?;
    }

    let deployments: Api<Deployment> = Api::namespaced(client.clone(), HUB_NAMESPACE);
    let hub = deployments.get("flotilla-hub").await?;
    let gateway = deployments.get("flotilla-gateway").await?;
    let agent = Api::<Deployment>::namespaced(client.clone(), AGENT_NAMESPACE)
        .get("flotilla-agent")
        .await?;
    for (deployment, replicas, strategy) in [
        (&hub, 1, "Recreate"),
        (&gateway, 3, "RollingUpdate"),
        (&agent, 1, "Recreate"),
    ] {
        let name = deployment.metadata.name.as_deref().unwrap_or_default();
        let spec = deployment
            .spec
            .as_ref()
            .context("a Deployment without spec")?;
        ensure!(
            spec.replicas == Some(replicas),
            "{name}: replicas {:?}, want {replicas}",
            spec.replicas
        );
        let stored = spec.strategy.as_ref().and_then(|s| s.type_.as_deref());
        ensure!(
            stored == Some(strategy),
            "{name}: strategy {stored:?}, want {strategy}"
        );
    }
    let anti_affinity = pod_spec(&gateway)?
        .affinity
        .as_ref()
        .and_then(|a| a.pod_anti_affinity.as_ref())
        .and_then(|a| {
            a.preferred_during_scheduling_ignored_during_execution
                .as_ref()
        })
        .context("flotilla-gateway has no pod anti-affinity")?;
    ensure!(
        anti_affinity
            .iter()
            .any(|t| t.pod_affinity_term.topology_key == "kubernetes.io/hostname"),
        "flotilla-gateway's anti-affinity does not spread gateways over nodes: {anti_affinity:?}"
    );

    let services: Api<Service> = Api::namespaced(client.clone(), HUB_NAMESPACE);
    for (name, tcp_only) in [
        ("flotilla-hub", &["api", "proxy", "metrics"][..]),
        ("flotilla-gateway", &["metrics"][..]),
    ] {
        let ports = services
            .get(name)
            .await?
            .spec
            .and_then(|s| s.ports)
            .unwrap_or_default();
        let on = |port: i32, protocol: &str| {
            ports
                .iter()
                .any(|p| p.port == port && p.protocol.as_deref() == Some(protocol))
        };
        ensure!(
            on(AGENTS_PORT, "TCP") && on(AGENTS_PORT, "UDP"),
            "Service {name} must carry the agents' port {AGENTS_PORT} on TCP (gRPC) and UDP (QUIC): {ports:?}"
        );
        for wanted in tcp_only {
            ensure!(
                ports.iter().any(|p| p.name.as_deref() == Some(*wanted)),
                "Service {name} has no port named {wanted}: {ports:?}"
            );
        }
    }

    // The proxy front's rules as stored, and the example commented in them, are rules the hub
    // reads: a mistake there would stop the hub at start.
    let config_maps = Api::<ConfigMap>::namespaced(client.clone(), HUB_NAMESPACE)
        .list(&Default::default())
        .await?;
    let rules = config_maps
        .items
        .iter()
        .filter(|c| {
            c.metadata
                .name
                .as_deref()
                .is_some_and(|n| n.starts_with("flotilla-hub-proxy"))
        })
        .find_map(|c| c.data.as_ref()?.get("access-rules.yaml"))
        .context("no ConfigMap flotilla-hub-proxy-* with access-rules.yaml")?;
    AccessRules::parse(rules).map_err(|e| anyhow::anyhow!("deploy/hub's access rules: {e}"))?;
    let example: String = rules
        .lines()
        .skip_while(|l| *l != "# rules:")
        .map(|l| l.strip_prefix("# ").unwrap_or(l.trim_start_matches('#')))
        .map(|l| format!("{l}\n"))
        .collect();
    ensure!(
        !example.is_empty(),
        "deploy/hub's access rules lost their example"
    );
    AccessRules::parse(&example)
        .map_err(|e| anyhow::anyhow!("deploy/hub's example access rules: {e}\n{example}"))?;

    let pdb = Api::<PodDisruptionBudget>::namespaced(client.clone(), HUB_NAMESPACE)
        .get("flotilla-gateway")
        .await?;
    let pdb_selector = pdb
        .spec
        .as_ref()
        .and_then(|s| s.selector.as_ref())
        .and_then(|s| s.match_labels.clone())
        .unwrap_or_default();
    let gateway_labels = pod_labels(&gateway);
    ensure!(
        !pdb_selector.is_empty()
            && pdb_selector
                .iter()
                .all(|(k, v)| gateway_labels.get(k) == Some(v)),
        "the gateways' PodDisruptionBudget selects {pdb_selector:?}, the gateway pods carry {gateway_labels:?}"
    );

    for (namespace, claim, deployment) in [
        (HUB_NAMESPACE, "flotilla-hub-data", &hub),
        (AGENT_NAMESPACE, "flotilla-agent-data", &agent),
    ] {
        Api::<PersistentVolumeClaim>::namespaced(client.clone(), namespace)
            .get(claim)
            .await
            .with_context(|| format!("PersistentVolumeClaim {namespace}/{claim}"))?;
        let mounted = pod_spec(deployment)?.volumes.iter().flatten().any(|v| {
            v.persistent_volume_claim
                .as_ref()
                .is_some_and(|c| c.claim_name == claim)
        });
        ensure!(mounted, "{claim} is not a volume of its Deployment");
    }

    // An upgrade applies the same objects again: the field manager owns them, no conflict.
    apply(&installed.env, &installed.hub_side)
        .await
        .context("applying the hub side a second time")?;

    // The apply path refuses what the schema does not know, so the applies above prove the
    // manifests have no such field.
    let refused = apply_changed_deployment(&installed, |deployment| {
        deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] =
            serde_json::json!({});
    })
    .await;
    let message = format!(
        "{:#}",
        refused.err().context("an unknown field was applied")?
    );
    ensure!(
        message.contains("readinessProbes"),
        "the refusal does not name the unknown field: {message}"
    );
    Ok(())
}

/// Every pod passes the restricted Pod Security Standard (the apiserver's PodSecurity admission
/// warns on none of them), and every container runs as non-root on a read-only root file
/// system with no privilege escalation, no capabilities and the runtime's seccomp profile,
/// asks for CPU and memory and is bounded in both, and (init containers aside) has liveness and
/// readiness probes on `/healthz` and `/readyz` of its metrics port.
/// OCM's own YAML, using fields our CRDs once lacked, applies to the CRDs in deploy/crds with
/// strict field validation (nothing pruned, nothing refused as unknown), reads back with OCM's
/// defaults filled in by the apiserver, and YAML OCM's schema refuses is refused here too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ocm_yaml_with_ocms_fields_applies_strictly_with_ocms_defaults() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let env = TestEnv::start().await?;
    apply(&env, &render(dir.path(), "crds").await?).await?;
    let client = env.client().await?;
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    for crd in flotilla_proto::api::crds() {
        let name = crd.metadata.name.clone().unwrap_or_default();
        if crd.spec.names.kind == "ClusterClaim" {
            continue;
        }
        wait_for(
            &format!("CRD {name} Established"),
            ESTABLISHED_TIMEOUT,
            || async { Ok(crds.get_opt(&name).await?.filter(established).map(drop)) },
        )
        .await?;
    }
    let objects = r#"
apiVersion: v1
kind: Namespace
metadata: {name: store-1}
---
apiVersion: cluster.open-cluster-management.io/v1
kind: ManagedCluster
metadata: {name: store-1}
spec:
  hubAcceptsClient: true
---
apiVersion: cluster.open-cluster-management.io/v1beta2
kind: ManagedClusterSet
metadata: {name: stores}
---
apiVersion: cluster.open-cluster-management.io/v1beta1
kind: Placement
metadata: {name: stores, namespace: store-1}
spec:
  sortBy: ClusterName
  scoreRateLimit: 1m
  prioritizerPolicy:
    configurations:
    - scoreCoordinate: {builtIn: Steady}
  decisionStrategy:
    groupStrategy:
      decisionGroups:
      - groupName: canary
        groupClusterSelector:
          labelSelector: {matchLabels: {canary: "true"}}
---
apiVersion: work.open-cluster-management.io/v1
kind: ManifestWork
metadata: {name: cfg, namespace: store-1}
spec:
  workload:
    manifests:
    - apiVersion: v1
      kind: ConfigMap
      metadata: {name: cfg, namespace: default}
      data: {k: v}
  manifestConfigs:
  - resourceIdentifier: {resource: configmaps, name: cfg, namespace: default}
    feedbackScrapeType: Watch
    updateStrategy:
      type: ServerSideApply
      serverSideApply:
        ignoreFields:
        - condition: OnSpokeChange
          jsonPointers: [/data/k]
"#;
    let file = dir.path().join("ocm.yaml");
    std::fs::write(&file, objects)?;
    apply(&env, &file).await?;

    let get = |kind, namespace, name| get_json(&env, kind, namespace, name);
    let cluster = get("managedclusters", None, "store-1").await?;
    ensure!(
        cluster["spec"]["leaseDurationSeconds"] == 60,
        "leaseDurationSeconds not defaulted to OCM's 60: {}",
        cluster["spec"]
    );
    let set = get("managedclustersets", None, "stores").await?;
    ensure!(
        set["spec"]["clusterSelector"]["selectorType"] == "ExclusiveClusterSetLabel",
        "a ManagedClusterSet without a spec gets OCM's default selector: {}",
        set
    );
    let placement = get("placements", Some("store-1"), "stores").await?;
    let spec = &placement["spec"];
    for (field, want) in [
        ("/sortBy", serde_json::json!("ClusterName")),
        ("/scoreRateLimit", serde_json::json!("1m")),
        ("/prioritizerPolicy/mode", serde_json::json!("Additive")),
        (
            "/prioritizerPolicy/configurations/0/scoreCoordinate/type",
            serde_json::json!("BuiltIn"),
        ),
        (
            "/prioritizerPolicy/configurations/0/weight",
            serde_json::json!(1),
        ),
        (
            "/decisionStrategy/groupStrategy/clustersPerDecisionGroup",
            serde_json::json!("100%"),
        ),
    ] {
        ensure!(
            spec.pointer(field) == Some(&want),
            "Placement spec{field}: want {want}, stored {spec}"
        );
    }
    let work = get("manifestworks", Some("store-1"), "cfg").await?;
    let config = &work["spec"]["manifestConfigs"][0];
    ensure!(
        config["feedbackScrapeType"] == "Watch"
            && config["updateStrategy"]["serverSideApply"]["ignoreFields"][0]["jsonPointers"]
                == serde_json::json!(["/data/k"])
            && config["updateStrategy"]["serverSideApply"]["fieldManager"] == "work-agent",
        "ManifestWork's manifestConfigs not stored as written with OCM's defaults: {config}"
    );

    // What OCM's schema refuses is refused: a sortBy outside its enum, a rate limit that is
    // not a duration.
    for (name, bad, refused_field) in [
        (
            "bad-sort",
            "apiVersion: cluster.open-cluster-management.io/v1beta1\nkind: Placement\nmetadata: {name: bad-sort, namespace: store-1}\nspec: {sortBy: Sideways}\n",
            "spec.sortBy",
        ),
        (
            "bad-rate",
            "apiVersion: cluster.open-cluster-management.io/v1beta1\nkind: Placement\nmetadata: {name: bad-rate, namespace: store-1}\nspec: {scoreRateLimit: often}\n",
            "spec.scoreRateLimit",
        ),
    ] {
        let file = dir.path().join(format!("{name}.yaml"));
        std::fs::write(&file, bad)?;
        let refused = apply(&env, &file)
            .await
            .err()
            .with_context(|| format!("{name} was accepted"))?;
        ensure!(
            refused.to_string().contains(refused_field),
            "{name}: the refusal does not name {refused_field}: {refused}"
        );
    }
    Ok(())
}

/// `kubectl get -o json` of one object.
async fn get_json(
    env: &TestEnv,
    kind: &str,
    namespace: Option<&str>,
    name: &str,
) -> anyhow::Result<Value> {
    let mut args = vec!["get", kind, name, "-o", "json"];
    if let Some(ns) = namespace {
        args.extend(["-n", ns]);
    }
    let out = kubectl(env.kubeconfig_path(), &args).await?;
    ensure!(
        out.status.success(),
        "kubectl get {kind} {name}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(serde_json::from_slice(&out.stdout)?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_pod_runs_restricted_with_probes_and_resources() -> anyhow::Result<()> {
    let installed = install().await?;
    ensure!(
        !installed.warnings.contains("PodSecurity"),
        "the apiserver's PodSecurity admission warned:\n{}",
        installed.warnings
    );
    let client = installed.env.client().await?;
    let mut problems = Vec::new();
    let mut checked = 0;
    for namespace in [HUB_NAMESPACE, AGENT_NAMESPACE] {
        let deployments = Api::<Deployment>::namespaced(client.clone(), namespace)
            .list(&Default::default())
            .await?;
        for deployment in &deployments.items {
            let name = deployment.metadata.name.clone().unwrap_or_default();
            problems.extend(pod_problems(&name, pod_spec(deployment)?));
            checked += 1;
        }
    }
    ensure!(
        checked == 3,
        "found {checked} Deployments, want hub, gateway and agent"
    );
    ensure!(
        problems.is_empty(),
        "pod templates:\n  {}",
        problems.join("\n  ")
    );

    // The apiserver does warn in these namespaces: a template that escalates is reported, so
    // the silence above is PodSecurity's verdict, not its absence.
    let warned = apply_changed_deployment(&installed, |deployment| {
        deployment["metadata"]["name"] = "escalates".into();
        let container = &mut deployment["spec"]["template"]["spec"]["containers"][0];
        container["securityContext"]["allowPrivilegeEscalation"] = true.into();
    })
    .await?;
    ensure!(
        warned.contains("PodSecurity") && warned.contains("allowPrivilegeEscalation"),
        "a template with allowPrivilegeEscalation: true got no PodSecurity warning: {warned}"
    );
    Ok(())
}

/// What the hub's store calls for every OCM kind (store/src/apiserver.rs): get, list (in
/// pages), watch, create, replace and delete; status is one JSON patch of the subresource.
const STORE_VERBS: &[&str] = &["get", "list", "watch", "create", "update", "delete"];

/// One `kubectl auth can-i` question: may `who` (a ServiceAccount) do `verb` on `resource`
/// (`plural.group`, optionally `/subresource`) in `namespace` (None: in every namespace).
struct Question {
    who: &'static str,
    namespace_of_who: &'static str,
    verb: &'static str,
    resource: String,
    namespace: Option<&'static str>,
    /// Why the code needs it, or why it must not have it.
    because: &'static str,
}

fn ask(
    who: &'static str,
    verb: &'static str,
    resource: impl Into<String>,
    namespace: Option<&'static str>,
    because: &'static str,
) -> Question {
    let namespace_of_who = if who == "flotilla-agent" {
        AGENT_NAMESPACE
    } else {
        HUB_NAMESPACE
    };
    Question {
        who,
        namespace_of_who,
        verb,
        resource: resource.into(),
        namespace,
        because,
    }
}

/// `plural.group` as kubectl names a resource; the plural alone in the core group.
fn plural_group(kind: Kind) -> String {
    if kind.group().is_empty() {
        return kind.plural().to_string();
    }
    format!("{}.{}", kind.plural(), kind.group())
}

/// The hub's and the gateways' RBAC covers every call their code makes on the hub apiserver,
/// and the agent's covers what it needs on its spoke beyond the apply rights: each asked with
/// `kubectl auth can-i --as=system:serviceaccount:<namespace>:<account>`. A Role that loses a
/// verb fails here, and so does one that grants the gateways what only the hub may do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rbac_covers_every_call_the_code_makes() -> anyhow::Result<()> {
    let installed = install().await?;
    // The agent's apply role grants everything by default; with its binding gone (as narrow as
    // an operator can make it), what the agent still may do is its own role's.
    let unbound = kubectl(
        installed.env.kubeconfig_path(),
        &["delete", "clusterrolebinding", "flotilla-agent-apply"],
    )
    .await?;
    ensure!(
        unbound.status.success(),
        "deleting the apply binding: {}",
        String::from_utf8_lossy(&unbound.stderr)
    );
    let mut granted = Vec::new();
    // The hub: every verb of the store on every kind it serves, everywhere (ManifestWorks live
    // in one namespace per cluster), and the status patch.
    for kind in Kind::ALL {
        for verb in STORE_VERBS {
            granted.push(ask(
                "flotilla-hub",
                verb,
                plural_group(kind),
                None,
                "the hub's store",
            ));
        }
        if !kind.has_status() {
            // A chunk is written once, a ConfigMap is data only: neither has a status.
            continue;
        }
        granted.push(ask(
            "flotilla-hub",
            "patch",
            format!("{}/status", plural_group(kind)),
            None,
            "the hub's store writes status",
        ));
    }
    granted.extend([
        ask(
            "flotilla-hub",
            "create",
            "namespaces",
            None,
            "a cluster's namespace, on its first ManifestWork",
        ),
        ask(
            "flotilla-hub",
            "list",
            "leases.coordination.k8s.io",
            Some(HUB_NAMESPACE),
            "the hub redirects agents by the shard leases",
        ),
    ]);
    let clusters = plural_group(Kind::ManagedCluster);
    let works = plural_group(Kind::ManifestWork);
    for verb in ["get", "list", "watch", "update"] {
        granted.push(ask(
            "flotilla-gateway",
            verb,
            clusters.clone(),
            None,
            "admission watches clusters, health reads them and sets the unreachable taint",
        ));
    }
    for verb in ["list", "watch"] {
        granted.push(ask(
            "flotilla-gateway",
            verb,
            works.clone(),
            None,
            "the desired-state cache",
        ));
    }
    for verb in ["get", "update"] {
        granted.push(ask(
            "flotilla-gateway",
            verb,
            works.clone(),
            None,
            "the cleanup finalizer, added on the agent's ack (works created around the hub) and removed on its release",
        ));
    }
    for verb in ["get", "list", "watch"] {
        granted.push(ask(
            "flotilla-gateway",
            verb,
            plural_group(Kind::ClusterCompliance),
            None,
            "each cluster's compliance record, cached by shard and read before a fenced write",
        ));
    }
    granted.push(ask(
        "flotilla-gateway",
        "patch",
        format!("{}/status", plural_group(Kind::ClusterCompliance)),
        None,
        "agents' compliance reports, written as fenced status writes",
    ));
    for verb in ["list", "watch"] {
        granted.push(ask(
            "flotilla-gateway",
            verb,
            plural_group(Kind::Policy),
            None,
            "the Policy cache: which clusters each policy reaches, delivered over their sessions",
        ));
    }
    granted.push(ask(
        "flotilla-gateway",
        "get",
        plural_group(Kind::ManifestChunk),
        None,
        "a large work's chunks, as its agent asks for them",
    ));
    for verb in ["list", "watch"] {
        granted.push(ask(
            "flotilla-gateway",
            verb,
            plural_group(Kind::ConfigMap),
            None,
            "hub templates' fromConfigMap: the ConfigMaps of the namespaces whose policies read them",
        ));
    }
    for verb in ["list", "create", "update"] {
        granted.push(ask(
            "flotilla-gateway",
            verb,
            "leases.coordination.k8s.io",
            Some(HUB_NAMESPACE),
            "shard ownership",
        ));
    }
    let csrs = "certificatesigningrequests.certificates.k8s.io";
    for verb in ["create", "watch", "delete"] {
        granted.push(ask(
            "flotilla-gateway",
            verb,
            csrs,
            None,
            "agents' renewals relayed to the hub",
        ));
    }
    for verb in ["list", "watch", "delete"] {
        granted.push(ask(
            "flotilla-hub",
            verb,
            csrs,
            None,
            "the gateways' relayed renewals, answered and collected",
        ));
    }
    for sub in ["approval", "status"] {
        granted.push(ask(
            "flotilla-hub",
            "patch",
            format!("{csrs}/{sub}"),
            None,
            "a relayed renewal approved or denied, then signed",
        ));
    }
    for verb in ["approve", "sign"] {
        granted.push(ask(
            "flotilla-hub",
            verb,
            format!("signers.certificates.k8s.io/{RENEWAL_SIGNER}"),
            None,
            "the hub is the signer of agents' certificates",
        ));
    }
    granted.extend([
        ask(
            "flotilla-gateway",
            "patch",
            format!("{clusters}/status"),
            None,
            "cluster health and claims",
        ),
        ask(
            "flotilla-gateway",
            "patch",
            format!("{works}/status"),
            None,
            "the agents' work status",
        ),
        ask(
            "flotilla-agent",
            "list",
            "nodes",
            None,
            "node count and capacity claims",
        ),
        ask(
            "flotilla-agent",
            "watch",
            "nodes",
            None,
            "node count and capacity claims",
        ),
        ask(
            "flotilla-agent",
            "list",
            "clusterclaims.cluster.open-cluster-management.io",
            None,
            "custom cluster claims",
        ),
        ask(
            "flotilla-agent",
            "watch",
            "clusterclaims.cluster.open-cluster-management.io",
            None,
            "custom cluster claims",
        ),
        ask(
            "flotilla-agent",
            "get",
            "namespaces/kube-system",
            None,
            "the cluster id",
        ),
        ask(
            "flotilla-agent",
            "create",
            "subjectaccessreviews.authorization.k8s.io",
            None,
            "executor checks",
        ),
        ask(
            "flotilla-agent",
            "impersonate",
            "serviceaccounts",
            Some("default"),
            "an executor's RBAC objects are dry-run as its ServiceAccount",
        ),
        ask(
            "flotilla-agent",
            "impersonate",
            "users",
            None,
            "kubectl through the hub runs as the hub user",
        ),
        ask(
            "flotilla-agent",
            "impersonate",
            "groups",
            None,
            "kubectl through the hub runs with the hub user's groups",
        ),
    ]);
    let refused = [
        ask(
            "flotilla-gateway",
            "create",
            clusters.clone(),
            None,
            "only the hub registers clusters",
        ),
        ask(
            "flotilla-gateway",
            "delete",
            works.clone(),
            None,
            "only the hub deletes works",
        ),
        ask(
            "flotilla-gateway",
            "delete",
            plural_group(Kind::ClusterCompliance),
            None,
            "only the hub creates and deletes compliance records",
        ),
        ask(
            "flotilla-gateway",
            "update",
            plural_group(Kind::ConfigMap),
            None,
            "gateways read ConfigMaps for hub templates and never write them",
        ),
        ask(
            "flotilla-gateway",
            "create",
            plural_group(Kind::ConfigMap),
            Some("default"),
            "gateways read ConfigMaps for hub templates and never write them",
        ),
        ask(
            "flotilla-gateway",
            "approve",
            format!("signers.certificates.k8s.io/{RENEWAL_SIGNER}"),
            None,
            "only the hub approves renewals",
        ),
        ask(
            "flotilla-hub",
            "approve",
            "signers.certificates.k8s.io/kubernetes.io/kube-apiserver-client",
            None,
            "the hub signs for its own signer only",
        ),
        ask(
            "flotilla-gateway",
            "create",
            "leases.coordination.k8s.io",
            Some("kube-system"),
            "leases only in the lease namespace",
        ),
        ask(
            "flotilla-gateway",
            "get",
            "secrets",
            Some(HUB_NAMESPACE),
            "no secrets",
        ),
        ask(
            "flotilla-hub",
            "update",
            "leases.coordination.k8s.io",
            Some(HUB_NAMESPACE),
            "the hub never claims a shard",
        ),
        ask(
            "flotilla-hub",
            "get",
            "secrets",
            Some(HUB_NAMESPACE),
            "no secrets",
        ),
        ask(
            "flotilla-agent",
            "get",
            "secrets",
            Some(AGENT_NAMESPACE),
            "beyond its own needs, only the apply role",
        ),
        ask(
            "flotilla-agent",
            "get",
            "namespaces/default",
            None,
            "only kube-system's uid",
        ),
    ];

    // The accounts asked about are the ones the pods run as.
    let client = installed.env.client().await?;
    for (namespace, name) in [
        (HUB_NAMESPACE, "flotilla-hub"),
        (HUB_NAMESPACE, "flotilla-gateway"),
        (AGENT_NAMESPACE, "flotilla-agent"),
    ] {
        let deployment = Api::<Deployment>::namespaced(client.clone(), namespace)
            .get(name)
            .await?;
        let account = pod_spec(&deployment)?.service_account_name.clone();
        ensure!(
            account.as_deref() == Some(name),
            "Deployment {namespace}/{name} runs as ServiceAccount {account:?}, the RBAC binds {name}"
        );
        Api::<ServiceAccount>::namespaced(client.clone(), namespace)
            .get(name)
            .await
            .with_context(|| format!("ServiceAccount {namespace}/{name}"))?;
    }

    let env = &installed.env;
    let answers: Vec<(bool, Question, bool)> = futures::stream::iter(
        granted
            .into_iter()
            .map(|q| (true, q))
            .chain(refused.into_iter().map(|q| (false, q))),
    )
    .map(|(want, q)| async move {
        let allowed = can_i(env, &q).await;
        allowed.map(|allowed| (want, q, allowed))
    })
    .buffer_unordered(4)
    .collect::<Vec<anyhow::Result<_>>>()
    .await
    .into_iter()
    .collect::<anyhow::Result<_>>()?;
    let wrong: Vec<String> = answers
        .iter()
        .filter(|(want, _, allowed)| want != allowed)
        .map(|(want, q, _)| {
            format!(
                "{} {} {} {}{} ({})",
                q.who,
                if *want { "cannot" } else { "can" },
                q.verb,
                q.resource,
                q.namespace.map(|n| format!(" in {n}")).unwrap_or_default(),
                q.because
            )
        })
        .collect();
    ensure!(wrong.is_empty(), "RBAC:\n  {}", wrong.join("\n  "));
    Ok(())
}

/// `kubectl auth can-i` as the question's ServiceAccount: yes (exit 0) or no (exit 1).
async fn can_i(env: &TestEnv, q: &Question) -> anyhow::Result<bool> {
    if let Some(signer) = q.resource.strip_prefix("signers.certificates.k8s.io/") {
        return may_use_signer(env, q, signer).await;
    }
    let who = format!(
        "--as=system:serviceaccount:{}:{}",
        q.namespace_of_who, q.who
    );
    let (resource, subresource) = match q.resource.split_once('/') {
        // namespaces/kube-system is a resource name, not a subresource.
        Some((resource, name)) if resource == "namespaces" => (format!("{resource}/{name}"), None),
        Some((resource, sub)) => (resource.to_string(), Some(sub.to_string())),
        None => (q.resource.clone(), None),
    };
    let subresource = subresource.map(|s| format!("--subresource={s}"));
    let mut args = vec!["auth", "can-i", q.verb, resource.as_str(), who.as_str()];
    args.extend(subresource.as_deref());
    match q.namespace {
        Some(namespace) => args.extend(["-n", namespace]),
        None => args.push("--all-namespaces"),
    }
    let out = kubectl(env.kubeconfig_path(), &args).await?;
    let answer = String::from_utf8_lossy(&out.stdout).trim().to_string();
    match (out.status.code(), answer.as_str()) {
        (Some(0), "yes") => Ok(true),
        (Some(1), "no") => Ok(false),
        _ => anyhow::bail!(
            "kubectl {}: {answer} {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        ),
    }
}

/// A SubjectAccessReview for `verb` on the signer `signer` (a resource name with a slash, which
/// `kubectl auth can-i` cannot ask about) as the question's ServiceAccount.
async fn may_use_signer(env: &TestEnv, q: &Question, signer: &str) -> anyhow::Result<bool> {
    use k8s_openapi::api::authorization::v1::{
        ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
    };
    let namespace = q.namespace_of_who;
    let review = SubjectAccessReview {
        spec: SubjectAccessReviewSpec {
            user: Some(format!("system:serviceaccount:{namespace}:{}", q.who)),
            groups: Some(vec![
                "system:serviceaccounts".into(),
                format!("system:serviceaccounts:{namespace}"),
                "system:authenticated".into(),
            ]),
            resource_attributes: Some(ResourceAttributes {
                group: Some("certificates.k8s.io".into()),
                resource: Some("signers".into()),
                name: Some(signer.into()),
                verb: Some(q.verb.into()),
                ..Default::default()
            }),
            ..Default::default()
        },
        ..Default::default()
    };
    let answered = Api::<SubjectAccessReview>::all(env.client().await?)
        .create(&Default::default(), &review)
        .await?;
    Ok(answered.status.is_some_and(|s| s.allowed))
}

/// Every object of the hub side and of the agent, as rendered (nothing applied).
async fn rendered() -> anyhow::Result<Vec<Value>> {
    let dir = tempfile::tempdir()?;
    let mut objects = documents(&render(dir.path(), "").await?)?;
    objects.extend(documents(&render(dir.path(), "agent").await?)?);
    Ok(objects)
}

/// Variables the manifests set that no flag reads: the log settings every binary's tracing
/// setup reads, and the pod IP the gateway's advertised address is made of.
const VARIABLES_NOT_FLAGS: &[&str] = &["RUST_LOG", "FLOTILLA_LOG_FORMAT", "POD_IP"];

/// Every binary a container runs is one the image (deploy/image/build.sh) puts in, and every flag
/// it passes and every variable it sets (directly or from its ConfigMap) is one that binary's
/// `--help` lists, so a renamed or removed flag cannot leave a manifest that crash-loops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manifests_use_only_flags_and_variables_the_binaries_have() -> anyhow::Result<()> {
    let image_recipe = std::fs::read_to_string(workspace_root().join("deploy/image/build.sh"))?;
    let in_image: BTreeSet<&str> = image_recipe
        .lines()
        .find_map(|line| line.strip_prefix("binaries=("))
        .and_then(|list| list.strip_suffix(')'))
        .context("deploy/image/build.sh has no `binaries=(...)` line")?
        .split_whitespace()
        .collect();
    let objects = rendered().await?;
    let config_maps: Vec<ConfigMap> = objects
        .iter()
        .filter(|o| o["kind"] == "ConfigMap")
        .map(|o| serde_json::from_value(o.clone()))
        .collect::<Result<_, _>>()?;
    let mut problems = Vec::new();
    let mut containers = 0;
    for object in objects.iter().filter(|o| o["kind"] == "Deployment") {
        let deployment: Deployment = serde_json::from_value(object.clone())?;
        for container in &pod_spec(&deployment)?.containers {
            containers += 1;
            let command = container.command.clone().unwrap_or_default();
            let args = container.args.clone().unwrap_or_default();
            let binary = command.first().context("a container without command")?;
            // A subcommand (the agent's `join`) comes first, before any flag.
            let subcommand: Vec<&str> = args
                .iter()
                .take_while(|a| !a.starts_with('-'))
                .map(String::as_str)
                .collect();
            if !in_image.contains(binary.as_str()) {
                problems.push(format!(
                    "{}: deploy/image/build.sh does not put {binary} into the image",
                    container.name
                ));
            }
            let help = help(binary, &subcommand)?;
            for flag in args.iter().filter(|a| a.starts_with("--")) {
                let name = flag.split('=').next().unwrap_or_default();
                if !lists_flag(&help, name) {
                    problems.push(format!("{}: {binary} has no flag {name}", container.name));
                }
            }
            for variable in variables(container, &config_maps) {
                let listed = help.contains(&format!("env: {variable}="))
                    || help.contains(&format!("env: {variable}]"));
                if !listed && !VARIABLES_NOT_FLAGS.contains(&variable.as_str()) {
                    problems.push(format!(
                        "{}: {binary} {} reads no variable {variable}",
                        container.name,
                        subcommand.join(" ")
                    ));
                }
            }
        }
    }
    ensure!(
        containers == 3,
        "found {containers} containers, want hub, gateway and agent"
    );
    ensure!(
        problems.is_empty(),
        "manifests:\n  {}",
        problems.join("\n  ")
    );
    Ok(())
}

/// Every Secret a pod mounts or reads a variable from is one docs/operations.md (Install) tells
/// the operator to create, with the key the pod reads; without it the pod never starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_install_guide_creates_every_secret_the_pods_need() -> anyhow::Result<()> {
    let guide = std::fs::read_to_string(workspace_root().join("docs/operations.md"))?;
    let objects = rendered().await?;
    let mut secrets = Vec::new();
    for object in objects.iter().filter(|o| o["kind"] == "Deployment") {
        let deployment: Deployment = serde_json::from_value(object.clone())?;
        let pod = pod_spec(&deployment)?;
        for volume in pod.volumes.iter().flatten() {
            if let Some(name) = volume.secret.as_ref().and_then(|s| s.secret_name.clone()) {
                secrets.push(format!("create secret generic {name}"));
            }
        }
        let containers = pod.init_containers.iter().flatten().chain(&pod.containers);
        for variable in containers.flat_map(|c| c.env.iter().flatten()) {
            let reference = variable
                .value_from
                .as_ref()
                .and_then(|v| v.secret_key_ref.as_ref());
            if let Some(reference) = reference {
                secrets.push(format!(
                    "create secret generic {} --from-literal={}=",
                    reference.name, reference.key
                ));
            }
        }
    }
    ensure!(
        secrets.len() == 3,
        "found the Secrets {secrets:?}, want the hub CA, the gateways' TLS and the agent's token"
    );
    let missing: Vec<&String> = secrets
        .iter()
        .filter(|s| !guide.contains(s.as_str()))
        .collect();
    ensure!(
        missing.is_empty(),
        "docs/operations.md does not say to run kubectl {missing:?}"
    );
    Ok(())
}

/// `binary [subcommand] --help`, from the workspace's build.
fn help(binary: &str, subcommand: &[&str]) -> anyhow::Result<String> {
    let out = Command::new(bin(binary))
        .args(subcommand)
        .arg("--help")
        .output()
        .with_context(|| format!("running {binary} --help"))?;
    ensure!(
        out.status.success(),
        "{binary} {subcommand:?} --help failed"
    );
    Ok(String::from_utf8(out.stdout)?)
}

/// Whether clap's `--help` lists `flag` (`--name`) as an option: the lines that start with
/// `-x, --name <VALUE>` or `--name <VALUE>`, not a mention in some other option's text.
fn lists_flag(help: &str, flag: &str) -> bool {
    help.lines()
        .map(str::trim_start)
        .filter(|line| line.starts_with('-'))
        .any(|line| {
            line.split_whitespace()
                .take(2)
                .any(|word| word.trim_end_matches(',') == flag)
        })
}

/// The variables a container sets: its `env` and every key of the ConfigMaps in its `envFrom`.
fn variables(container: &Container, config_maps: &[ConfigMap]) -> BTreeSet<String> {
    let mut names: BTreeSet<String> = container
        .env
        .iter()
        .flatten()
        .map(|e| e.name.clone())
        .collect();
    for source in container.env_from.iter().flatten() {
        let Some(name) = source.config_map_ref.as_ref().map(|r| r.name.clone()) else {
            continue;
        };
        let data = config_maps
            .iter()
            .find(|c| c.metadata.name.as_deref() == Some(name.as_str()))
            .and_then(|c| c.data.clone())
            .unwrap_or_default();
        names.extend(data.into_keys());
    }
    names
}

fn established(crd: &CustomResourceDefinition) -> bool {
    crd.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| {
            c.iter()
                .any(|c| c.type_ == "Established" && c.status == "True")
        })
}

fn pod_spec(deployment: &Deployment) -> anyhow::Result<&PodSpec> {
    deployment
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .with_context(|| {
            format!(
                "Deployment {} has no pod template",
                deployment.metadata.name.as_deref().unwrap_or_default()
            )
        })
}

fn pod_labels(deployment: &Deployment) -> std::collections::BTreeMap<String, String> {
    deployment
        .spec
        .as_ref()
        .and_then(|s| s.template.metadata.as_ref())
        .and_then(|m| m.labels.clone())
        .unwrap_or_default()
}

/// What is wrong with one pod template, each problem naming the Deployment and container.
fn pod_problems(deployment: &str, pod: &PodSpec) -> Vec<String> {
    let mut problems = Vec::new();
    let pod_context = pod.security_context.clone().unwrap_or_default();
    let runtime_default = |profile: Option<&k8s_openapi::api::core::v1::SeccompProfile>| {
        profile.is_some_and(|p| p.type_ == "RuntimeDefault")
    };
    let init = pod.init_containers.iter().flatten().map(|c| (c, true));
    for (container, is_init) in init.chain(pod.containers.iter().map(|c| (c, false))) {
        let mut problem = |what: String| {
            problems.push(format!("{deployment}/{}: {what}", container.name));
        };
        let context = container.security_context.clone().unwrap_or_default();
        if context.run_as_non_root.or(pod_context.run_as_non_root) != Some(true) {
            problem("may run as root (runAsNonRoot is not true)".into());
        }
        if context.read_only_root_filesystem != Some(true) {
            problem("root file system is writable (readOnlyRootFilesystem)".into());
        }
        if context.allow_privilege_escalation != Some(false) {
            problem("allowPrivilegeEscalation is not false".into());
        }
        let drops_all = context
            .capabilities
            .as_ref()
            .and_then(|c| c.drop.as_ref())
            .is_some_and(|d| d.iter().any(|c| c == "ALL"));
        if !drops_all {
            problem("capabilities do not drop ALL".into());
        }
        if !runtime_default(
            context
                .seccomp_profile
                .as_ref()
                .or(pod_context.seccomp_profile.as_ref()),
        ) {
            problem("seccomp profile is not RuntimeDefault".into());
        }
        let resources = container.resources.clone().unwrap_or_default();
        for (which, values) in [
            ("requests", &resources.requests),
            ("limits", &resources.limits),
        ] {
            for resource in ["cpu", "memory"] {
                if !values.as_ref().is_some_and(|v| v.contains_key(resource)) {
                    problem(format!("no {resource} in resources.{which}"));
                }
            }
        }
        if is_init {
            continue;
        }
        let metrics = container
            .ports
            .iter()
            .flatten()
            .find(|p| p.name.as_deref() == Some("metrics"));
        if metrics.map(|p| p.container_port) != Some(METRICS_PORT) {
            problem(format!("no container port named metrics on {METRICS_PORT}"));
        }
        let metrics_flag = format!("--metrics-addr=0.0.0.0:{METRICS_PORT}");
        if !container.args.iter().flatten().any(|a| *a == metrics_flag) {
            problem(format!("does not pass {metrics_flag}"));
        }
        for (which, probe, path) in [
            ("livenessProbe", &container.liveness_probe, "/healthz"),
            ("readinessProbe", &container.readiness_probe, "/readyz"),
        ] {
            if let Some(wrong) = probe_problem(probe.as_ref(), path) {
                problem(format!("{which}: {wrong}"));
            }
        }
    }
    problems
}

/// Why `probe` is not an HTTP GET of `path` on the port named metrics, if it is not.
fn probe_problem(probe: Option<&Probe>, path: &str) -> Option<String> {
    let Some(probe) = probe else {
        return Some("missing".into());
    };
    let Some(get) = &probe.http_get else {
        return Some("not an HTTP GET".into());
    };
    let port = serde_json::to_value(&get.port).ok()?;
    if get.path.as_deref() != Some(path) || port != "metrics" {
        return Some(format!(
            "GET {:?} on port {port}, want {path} on port metrics",
            get.path
        ));
    }
    None
}

/// A second hub's agent beside the first (docs/operations.md, One cluster, several hubs):
/// `deploy/agent-another-hub` renders, shares no object with `deploy/agent` (every name and its
/// namespace its own, its bindings naming its own ServiceAccount), sets the hub name the agent
/// reads, and both apply strictly to one apiserver side by side.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_hubs_agent_shares_no_object_with_the_first() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let first_file = render(dir.path(), "agent").await?;
    let second_file = render(dir.path(), "agent-another-hub").await?;
    let identity = |o: &Value| {
        format!(
            "{} {}/{}",
            o["kind"].as_str().unwrap_or_default(),
            o["metadata"]["namespace"].as_str().unwrap_or_default(),
            o["metadata"]["name"].as_str().unwrap_or_default()
        )
    };
    let first: BTreeSet<String> = documents(&first_file)?.iter().map(identity).collect();
    let second_objects = documents(&second_file)?;
    let shared: Vec<String> = second_objects
        .iter()
        .map(identity)
        .filter(|id| first.contains(id))
        .collect();
    ensure!(shared.is_empty(), "both agents would write {shared:?}");
    let namespace = second_objects
        .iter()
        .find(|o| o["kind"] == "Namespace")
        .and_then(|o| o["metadata"]["name"].as_str())
        .context("the overlay has no Namespace")?;
    ensure!(
        namespace != AGENT_NAMESPACE,
        "the overlay reuses {AGENT_NAMESPACE}"
    );
    let service_account = second_objects
        .iter()
        .find(|o| o["kind"] == "ServiceAccount")
        .context("the overlay has no ServiceAccount")?;
    for binding in second_objects
        .iter()
        .filter(|o| o["kind"] == "ClusterRoleBinding")
    {
        for subject in binding["subjects"].as_array().into_iter().flatten() {
            ensure!(
                subject["name"] == service_account["metadata"]["name"]
                    && subject["namespace"] == namespace,
                "{} binds {subject}, not the overlay's own ServiceAccount",
                identity(binding)
            );
        }
    }
    let config_map: ConfigMap = serde_json::from_value(
        second_objects
            .iter()
            .find(|o| o["kind"] == "ConfigMap")
            .context("the overlay has no ConfigMap")?
            .clone(),
    )?;
    let settings = config_map.data.unwrap_or_default();
    ensure!(
        settings
            .get("FLOTILLA_AGENT_HUB_NAME")
            .is_some_and(|n| !n.is_empty()),
        "the overlay's settings name no hub: {settings:?}"
    );
    ensure!(
        help("flotilla-agent", &["join"])?.contains("env: FLOTILLA_AGENT_HUB_NAME="),
        "flotilla-agent join reads no FLOTILLA_AGENT_HUB_NAME"
    );
    let env = TestEnv::start().await?;
    apply(&env, &first_file).await?;
    apply(&env, &second_file).await?;
    let client = env.client().await?;
    for ns in [AGENT_NAMESPACE, namespace] {
        let deployments: Api<Deployment> = Api::namespaced(client.clone(), ns);
        ensure!(
            deployments.list(&Default::default()).await?.items.len() == 1,
            "namespace {ns} does not hold its one agent"
        );
    }
    Ok(())
}
