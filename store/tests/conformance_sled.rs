//! The conformance suite on the sled backend: one test per check, each on a fresh store in its
//! own temporary directory, so a failure names its check and checks run in parallel.

use flotilla_store::SledStore;
use flotilla_store::conformance;

fn trace_init() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

macro_rules! sled_checks {
    ($($check:ident),* $(,)?) => {
        $(
            #[tokio::test]
            async fn $check() -> anyhow::Result<()> {
                trace_init();
                let dir = tempfile::tempdir()?;
                let store = SledStore::open(dir.path())?;
                conformance::run(&store, stringify!($check), "t").await
            }
        )*

        /// A check added to the suite but not here would silently never run on sled.
        #[test]
        fn every_check_runs() {
            let here = [$(stringify!($check)),*];
            let suite: Vec<&str> = conformance::CHECKS.iter().map(|c| c.name).collect();
            assert_eq!(here.as_slice(), suite.as_slice(), "list every conformance check here");
        }
    };
}

sled_checks![
    create_get_round_trip,
    create_refuses_duplicates,
    list_by_namespace_and_across_namespaces,
    update_spec_bumps_generation_only_for_spec_changes,
    update_status_leaves_spec_and_generation_alone,
    stale_resource_version_conflicts,
    delete_then_not_found,
    watch_from_revision_sees_exactly_the_later_events,
    watch_from_list_revision_sees_only_later_changes,
    watch_without_revision_starts_with_existing_objects,
    invalid_objects_are_refused_and_nothing_is_lost,
    cluster_scoped_and_namespaced_kinds,
    concurrent_writes_are_each_seen_once,
    finalizers_hold_deletion_until_removed,
    selected_list_reads_only_the_chosen_label_values,
    selected_watch_follows_objects_into_and_out_of_the_selection,
    fenced_status_writes_refuse_what_is_stale,
    fenced_writes_on_an_outdated_basis_read_again,
    fenced_spec_writes_are_compared_and_fence_later_writes,
    unfenced_writes_keep_the_fencing_record,
    config_maps_are_core_objects_checked_alike,
];

/// All checks in sequence on one store, as the kube suite runs them: checks must not see each
/// other's objects.
#[tokio::test]
async fn run_all_on_one_store() -> anyhow::Result<()> {
    trace_init();
    let dir = tempfile::tempdir()?;
    let store = SledStore::open(dir.path())?;
    conformance::run_all(&store, "all").await
}
