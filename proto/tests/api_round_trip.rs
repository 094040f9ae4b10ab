//! OCM's YAML examples (tests/fixtures, copied from OCM's docs) parse into flotilla's types and
//! serialize back to exactly what was written: no field added, dropped or renamed.

use flotilla_proto::api::{
    self, AddOnPlacementScore, ClusterClaim, Kind, ManagedCluster, ManagedClusterSet,
    ManagedClusterSetBinding, ManifestWork, ManifestWorkReplicaSet, Placement, PlacementDecision,
    Stored, policy,
};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

/// Where the package is: read when the test runs (cargo sets it), not when it was compiled, so
/// a test binary built in another checkout still reads this one.
fn manifest_dir() -> std::path::PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .expect("run by cargo test, which sets CARGO_MANIFEST_DIR")
        .into()
}

fn fixtures() -> std::path::PathBuf {
    manifest_dir().join("tests/fixtures")
}

fn read(path: &str) -> String {
    let full = fixtures().join(path);
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("read {}: {e}", full.display()))
}

/// YAML -> `T` -> JSON must equal YAML -> JSON. Returns the typed object for further checks.
fn round_trip<T: Serialize + DeserializeOwned>(path: &str) -> T {
    let text = read(path);
    let original: Value =
        yaml_serde::from_str(&text).unwrap_or_else(|e| panic!("{path}: not YAML: {e}"));
    let typed: T =
        yaml_serde::from_str(&text).unwrap_or_else(|e| panic!("{path}: does not parse: {e}"));
    let back = serde_json::to_value(&typed).expect("serialize");
    if back != original {
        panic!(
            "{path}: changed by a round trip\n--- original\n{}\n--- after\n{}",
            serde_json::to_string_pretty(&original).unwrap_or_default(),
            serde_json::to_string_pretty(&back).unwrap_or_default()
        );
    }
    // JSON -> T -> JSON too: the store keeps objects as JSON.
    let again: T = serde_json::from_value(back.clone()).expect("from JSON");
    assert_eq!(
        serde_json::to_value(&again).expect("serialize"),
        back,
        "{path}: JSON round trip"
    );
    typed
}

/// Picks the type from the fixture's `kind`, so a new fixture needs no new test code.
fn check_round_trip(path: &str) {
    let head: Value = yaml_serde::from_str(&read(path)).expect("YAML");
    let kind = head["kind"]
        .as_str()
        .unwrap_or_else(|| panic!("{path}: no kind"));
    match kind {
        "ManagedCluster" => drop(round_trip::<ManagedCluster>(path)),
        "ManagedClusterSet" => drop(round_trip::<ManagedClusterSet>(path)),
        "ManagedClusterSetBinding" => drop(round_trip::<ManagedClusterSetBinding>(path)),
        "ManifestWork" => drop(round_trip::<ManifestWork>(path)),
        "ManifestWorkReplicaSet" => drop(round_trip::<ManifestWorkReplicaSet>(path)),
        "Placement" => drop(round_trip::<Placement>(path)),
        "PlacementDecision" => drop(round_trip::<PlacementDecision>(path)),
        "AddOnPlacementScore" => drop(round_trip::<AddOnPlacementScore>(path)),
        "ClusterClaim" => drop(round_trip::<ClusterClaim>(path)),
        "ManifestChunk" => drop(round_trip::<flotilla_proto::api::ManifestChunk>(path)),
        "Policy" => drop(round_trip::<policy::Policy>(path)),
        "PlacementBinding" => drop(round_trip::<policy::PlacementBinding>(path)),
        "PolicySet" => drop(round_trip::<policy::PolicySet>(path)),
        "ClusterCompliance" => drop(round_trip::<policy::ClusterCompliance>(path)),
        "ConfigMap" => {
            let config_map: api::ConfigMap = round_trip(path);
            let value = serde_json::to_value(&config_map).expect("serialize");
            assert_eq!(
                api::check_config_map(&value),
                Vec::<String>::new(),
                "{path}: a valid ConfigMap"
            );
        }
        other => panic!("{path}: no type for kind {other}"),
    }
}

#[test]
fn every_fixture_round_trips() {
    let mut paths: Vec<String> = std::fs::read_dir(fixtures())
        .expect("fixtures dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".yaml"))
        .collect();
    paths.sort();
    assert!(paths.len() >= 15, "fixtures missing: {paths:?}");
    for path in &paths {
        check_round_trip(path);
    }
    // Every hub kind has at least one example.
    for kind in Kind::ALL {
        let covered = paths.iter().any(|p| {
            let v: Value = yaml_serde::from_str(&read(p)).expect("YAML");
            v["kind"] == kind.name()
        });
        assert!(covered, "no fixture of kind {kind}");
    }
}

#[test]
fn manifest_work_keeps_manifests_verbatim_and_in_order() {
    let work: ManifestWork = round_trip("manifestwork_my_first_work.yaml");
    let manifests = &work.spec.workload.manifests;
    assert_eq!(manifests.len(), 2);
    assert_eq!(manifests[0].kind(), Some("ServiceAccount"));
    assert_eq!(manifests[1].api_version(), Some("apps/v1"));
    assert_eq!(manifests[1].name(), Some("nginx-deployment"));
    assert_eq!(manifests[1].namespace(), Some("default"));
    assert_eq!(
        manifests[1].0["spec"]["template"]["spec"]["containers"][0]["image"],
        "nginx:1.14.2"
    );
    assert_eq!(work.metadata.namespace.as_deref(), Some("cluster1"));
}

#[test]
fn manifest_work_status_reads_per_resource_conditions() {
    let work: ManifestWork = round_trip("manifestwork_my_first_work_status.yaml");
    let status = work.status.expect("status");
    assert!(api::conditions::is_condition_true(
        &status.conditions,
        api::conditions::WORK_APPLIED
    ));
    let deployment = &status.resource_status.manifests[1];
    assert_eq!(deployment.resource_meta.ordinal, 1);
    assert_eq!(deployment.resource_meta.resource, "deployments");
    assert!(api::conditions::is_condition_true(
        &deployment.conditions,
        api::conditions::WORK_AVAILABLE
    ));
}

#[test]
fn managed_cluster_taints_claims_and_capacity() {
    let cluster: ManagedCluster = round_trip("managedcluster_unreachable_taint.yaml");
    assert!(cluster.spec.hub_accepts_client);
    let taint = &cluster.spec.taints[0];
    assert_eq!(taint.key, api::TAINT_UNREACHABLE);
    assert_eq!(taint.effect, api::TaintEffect::NoSelect);
    assert!(taint.time_added.is_some());
    let status = cluster.status.expect("status");
    assert_eq!(status.allocatable["memory"].0, "49265496Ki");
    assert_eq!(status.version.kubernetes, "v1.25.3");
    let available = api::conditions::find_condition(
        &status.conditions,
        api::conditions::MANAGED_CLUSTER_CONDITION_AVAILABLE,
    );
    assert_eq!(available.map(|c| c.status.as_str()), Some("Unknown"));

    let claims: ManagedCluster = round_trip("managedcluster_cluster_claims.yaml");
    let claim = &claims.status.expect("status").cluster_claims[0];
    assert_eq!(claim.name, "id.open-cluster-management.io");

    let maintenance: ManagedCluster = round_trip("managedcluster_maintenance_taint.yaml");
    assert_eq!(maintenance.spec.taints[0].time_added, None);
}

#[test]
fn quantities_written_as_numbers_are_accepted() {
    // The apiserver stores int-or-string quantities as written; reading `cpu: 24` must not fail.
    let yaml = "apiVersion: cluster.open-cluster-management.io/v1\nkind: ManagedCluster\n\
                metadata: {name: c}\nspec: {hubAcceptsClient: true}\n\
                status: {capacity: {cpu: 24, memory: 1Gi}, conditions: null}\n";
    let cluster: ManagedCluster = yaml_serde::from_str(yaml).expect("parse");
    let status = cluster.status.expect("status");
    assert_eq!(status.capacity["cpu"].0, "24");
    assert_eq!(status.capacity["memory"].0, "1Gi");
    assert!(
        status.conditions.is_empty(),
        "null conditions (as Go writes them) read as empty"
    );
}

#[test]
fn placements_read_prioritizers_tolerations_and_groups() {
    let p: Placement = round_trip("placement_addon_score_exact.yaml");
    let policy = p.spec.prioritizer_policy.expect("policy");
    assert_eq!(policy.mode, Some(api::PrioritizerPolicyMode::Exact));
    let config = &policy.configurations[0];
    assert_eq!(
        config.score_coordinate.type_,
        api::ScoreCoordinateType::AddOn
    );
    assert_eq!(
        config
            .score_coordinate
            .add_on
            .as_ref()
            .map(|a| a.score_name.as_str()),
        Some("cpuAvailable")
    );
    assert_eq!(config.weight, Some(1));

    let p: Placement = round_trip("placement_guestbook_toleration.yaml");
    let toleration = &p.spec.tolerations[0];
    assert_eq!(toleration.operator, Some(api::TolerationOperator::Exists));
    assert_eq!(toleration.toleration_seconds, Some(300));

    let p: Placement = round_trip("placement_decision_strategy.yaml");
    let groups = p
        .spec
        .decision_strategy
        .and_then(|d| d.group_strategy)
        .expect("group strategy");
    assert_eq!(groups.decision_groups.len(), 2);
    assert_eq!(
        groups.clusters_per_decision_group,
        Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String("25%".into()))
    );

    let d: PlacementDecision = round_trip("placementdecision_placement1_decision_1.yaml");
    let names: Vec<&str> = d
        .status
        .as_ref()
        .expect("status")
        .decisions
        .iter()
        .map(|c| c.cluster_name.as_str())
        .collect();
    assert_eq!(names, ["cluster1", "cluster2"]);
    assert_eq!(
        d.metadata.labels.as_ref().expect("labels")[api::PLACEMENT_LABEL],
        "placement1"
    );
}

#[test]
fn objects_without_spec_gain_no_spec() {
    // OCM's PlacementDecision and AddOnPlacementScore have only status.
    let score: AddOnPlacementScore = round_trip("addonplacementscore_default.yaml");
    let json = serde_json::to_value(&score).expect("json");
    assert!(json.get("spec").is_none(), "{json}");
    let status = score.status.expect("status");
    assert_eq!(status.scores[0].value, 66);
    assert!(status.valid_until.is_some());
}

#[test]
fn replica_set_reads_rollout_strategies() {
    let mwrs: ManifestWorkReplicaSet = round_trip("manifestworkreplicaset_mwrset_cronjob.yaml");
    let refs = &mwrs.spec.placement_refs;
    let progressive = refs[1].rollout_strategy.as_ref().expect("strategy");
    assert_eq!(progressive.type_, Some(api::RolloutType::Progressive));
    let p = progressive.progressive.as_ref().expect("progressive");
    assert_eq!(
        p.mandatory_decision_groups[0].group_name,
        "prod-canary-west"
    );
    let orphan = &mwrs
        .spec
        .manifest_work_template
        .delete_option
        .as_ref()
        .expect("deleteOption");
    assert_eq!(
        orphan.propagation_policy,
        api::PropagationPolicy::SelectivelyOrphan
    );
    let rule = &orphan
        .selectively_orphans
        .as_ref()
        .expect("orphans")
        .orphaning_rules[0];
    assert_eq!(
        (rule.group(), rule.namespace(), rule.name.as_str()),
        ("", "", "ocm-ns")
    );

    let with_status: ManifestWorkReplicaSet = round_trip("manifestworkreplicaset_status.yaml");
    assert_eq!(with_status.status.expect("status").summary.applied, 45);
}

#[test]
fn stored_kinds_have_the_coordinates_of_their_types() {
    fn check<T: Stored>() {
        let kind = T::KIND;
        assert_eq!(T::kind(&()), kind.name());
        assert_eq!(T::group(&()), kind.group());
        assert_eq!(T::version(&()), kind.version());
        assert_eq!(T::api_version(&()), kind.api_version());
        assert_eq!(T::plural(&()), kind.plural());
    }
    check::<ManagedCluster>();
    check::<ManagedClusterSet>();
    check::<ManagedClusterSetBinding>();
    check::<ManifestWork>();
    check::<ManifestWorkReplicaSet>();
    check::<Placement>();
    check::<PlacementDecision>();
    check::<AddOnPlacementScore>();
    check::<api::ConfigMap>();
}

#[test]
fn serialized_objects_carry_api_version_and_kind() {
    // Typed objects built in code (not parsed) must still be valid OCM YAML.
    let work = ManifestWork::new("baseline", api::ManifestWorkSpec::default());
    let json = serde_json::to_value(&work).expect("json");
    assert_eq!(json["apiVersion"], "work.open-cluster-management.io/v1");
    assert_eq!(json["kind"], "ManifestWork");
    assert_eq!(json["metadata"]["name"], "baseline");
    assert_eq!(json["spec"], serde_json::json!({}));
}

#[test]
fn unknown_fields_are_dropped_as_the_apiserver_prunes_them() {
    // OCM's ManifestWorkReplicaSet page writes `rolloutType:`; OCM's CRD has no such field and the
    // apiserver prunes it, leaving the default strategy. Parsing does the same here.
    let yaml = "apiVersion: work.open-cluster-management.io/v1alpha1\nkind: ManifestWorkReplicaSet\n\
                metadata: {name: m, namespace: ocm-ns}\n\
                spec:\n  placementRefs:\n  - name: p\n    rolloutStrategy: {rolloutType: Progressive}\n  \
                manifestWorkTemplate: {}\n";
    let mwrs: ManifestWorkReplicaSet = yaml_serde::from_str(yaml).expect("parse");
    let strategy = mwrs.spec.placement_refs[0]
        .rollout_strategy
        .clone()
        .expect("strategy");
    assert_eq!(strategy.type_, None);
    let json = serde_json::to_value(&mwrs).expect("json");
    assert_eq!(
        json["spec"]["placementRefs"][0]["rolloutStrategy"],
        serde_json::json!({})
    );
}
