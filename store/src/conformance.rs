//! The behaviour every [`Store`] backend must show, as checks to run against a live store.
//!
//! Each check is an async fn taking the store and a prefix that it puts in front of every
//! namespace and cluster-scoped name it uses, so checks can share one store (one apiserver)
//! without seeing each other's objects. A check returns an error describing what a user would
//! notice, instead of panicking, so [`run_all`] can report every failing check at once.
//!
//! Behind the `conformance` feature because it is test code: this crate's tests turn the
//! feature on through a dev-dependency on the crate itself, and so can a crate that adds a
//! backend. `tests/conformance_sled.rs` runs each check on a fresh sled store;
//! `tests/conformance_kube.rs` runs [`run_all`] on one real apiserver.

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use flotilla_proto::api::Kind;
use futures::StreamExt;
use futures::future::BoxFuture;
use serde_json::{Value, json};

use crate::{
    Basis, MAX_OBJECT_BYTES, Object, Revision, Selection, Stale, Store, StoreError, WatchEvent,
    WatchStream, WriteFence, generation_of, name_of, namespace_of, resource_version,
};

/// How long a check waits for a watch event before failing.
const EVENT_DEADLINE: Duration = Duration::from_secs(20);

/// A named check, as listed in [`CHECKS`].
pub struct Check {
    pub name: &'static str,
    pub run: for<'a> fn(&'a dyn Store, &'a str) -> BoxFuture<'a, Result<()>>,
}

macro_rules! checks {
    ($($name:ident),* $(,)?) => {
        /// Every check, in the order [`run_all`] runs them.
        pub const CHECKS: &[Check] = &[
            $(Check { name: stringify!($name), run: |store, prefix| Box::pin($name(store, prefix)) },)*
        ];
    };
}

checks![
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

/// Runs every check against `store`, each with its own prefix (`{prefix}-{index}`), and fails
/// naming every check that failed.
pub async fn run_all(store: &dyn Store, prefix: &str) -> Result<()> {
    let mut failures = Vec::new();
    for (i, check) in CHECKS.iter().enumerate() {
        let prefix = format!("{prefix}-{i}");
        tracing::info!(check = check.name, %prefix, "conformance check");
        if let Err(e) = (check.run)(store, &prefix).await {
            tracing::error!(
                check = check.name,
                error = format!("{e:#}"),
                "conformance check failed"
            );
            failures.push(format!("{}: {e:#}", check.name));
        }
    }
    ensure!(
        failures.is_empty(),
        "{} of {} conformance checks failed:\n{}",
        failures.len(),
        CHECKS.len(),
        failures.join("\n")
    );
    Ok(())
}

/// Runs the check called `name` (for one test per check).
pub async fn run(store: &dyn Store, name: &str, prefix: &str) -> Result<()> {
    let check = CHECKS
        .iter()
        .find(|c| c.name == name)
        .with_context(|| format!("no conformance check named {name}"))?;
    (check.run)(store, prefix).await
}

// ---- fixtures ----

/// A ManifestWork in `namespace` carrying one ConfigMap whose data says `version`.
pub fn manifest_work(namespace: &str, name: &str, version: &str) -> Object {
    json!({
        "apiVersion": Kind::ManifestWork.api_version(),
        "kind": "ManifestWork",
        "metadata": {"name": name, "namespace": namespace, "labels": {"app": "baseline"}},
        "spec": {
            "workload": {"manifests": [{
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": "baseline", "namespace": "default"},
                "data": {"version": version},
            }]},
        },
    })
}

/// A ManagedCluster accepted by the hub.
pub fn managed_cluster(name: &str) -> Object {
    json!({
        "apiVersion": Kind::ManagedCluster.api_version(),
        "kind": "ManagedCluster",
        "metadata": {"name": name},
        "spec": {"hubAcceptsClient": true, "leaseDurationSeconds": 60},
    })
}

/// A ManifestWork status with one condition, as the agent would report it.
pub fn work_status(condition: &str, generation: i64) -> Value {
    json!({
        "conditions": [{
            "type": condition,
            "status": "True",
            "reason": "AppliedManifestWorkComplete",
            "message": "Apply manifest work complete",
            "lastTransitionTime": "2025-01-01T00:00:00Z",
            "observedGeneration": generation,
        }],
    })
}

fn configmap_version(work: &Object) -> Option<&str> {
    work.pointer("/spec/workload/manifests/0/data/version")
        .and_then(Value::as_str)
}

fn revision(object: &Object) -> Result<Revision> {
    Revision::of(object)
        .with_context(|| format!("{} has no metadata.resourceVersion", name_of(object)))
}

async fn next_event(stream: &mut WatchStream) -> Result<WatchEvent> {
    match tokio::time::timeout(EVENT_DEADLINE, stream.next()).await {
        Err(_) => bail!("no watch event within {EVENT_DEADLINE:?}"),
        Ok(None) => bail!("the watch stream ended"),
        Ok(Some(event)) => event.context("the watch stream failed"),
    }
}

/// `Added ns/name` etc.: what a person compares when reading a failure.
fn describe(event: &WatchEvent) -> String {
    let kind = match event {
        WatchEvent::Added(_) => "Added",
        WatchEvent::Modified(_) => "Modified",
        WatchEvent::Deleted(_) => "Deleted",
    };
    let o = event.object();
    match namespace_of(o) {
        Some(ns) => format!("{kind} {ns}/{}", name_of(o)),
        None => format!("{kind} {}", name_of(o)),
    }
}

async fn expect_events(stream: &mut WatchStream, expected: &[String]) -> Result<Vec<WatchEvent>> {
    let mut got = Vec::new();
    for want in expected {
        let event = next_event(stream).await.with_context(|| {
            format!(
                "waiting for {want}; got so far {:?}",
                got.iter().map(describe).collect::<Vec<_>>()
            )
        })?;
        ensure!(
            &describe(&event) == want,
            "expected {want}, got {} (after {:?})",
            describe(&event),
            got.iter().map(describe).collect::<Vec<_>>()
        );
        got.push(event);
    }
    Ok(got)
}

fn expect_err<T: std::fmt::Debug>(
    result: Result<T, StoreError>,
    what: &str,
    matches: impl FnOnce(&StoreError) -> bool,
) -> Result<StoreError> {
    match result {
        Ok(v) => bail!("{what}: expected an error, got {v:?}"),
        Err(e) if matches(&e) => Ok(e),
        Err(e) => bail!("{what}: wrong error {e:?}"),
    }
}

// ---- checks ----

/// What `create` returns is what `get` gives back, with the server-set fields filled in.
pub async fn create_get_round_trip(store: &dyn Store, prefix: &str) -> Result<()> {
    let ns = format!("{prefix}-store");
    let mut work = manifest_work(&ns, "baseline", "v1");
    work["status"] = work_status("Applied", 1);
    work["metadata"]["resourceVersion"] = json!("12345");
    let created = store.create(work).await.context("create")?;
    for field in ["uid", "creationTimestamp", "resourceVersion"] {
        let value = created["metadata"][field].as_str().unwrap_or("");
        ensure!(
            !value.is_empty(),
            "created object has no metadata.{field}: {created}"
        );
    }
    ensure!(
        generation_of(&created) == 1,
        "generation {} on create, want 1",
        generation_of(&created)
    );
    ensure!(
        created.get("status").is_none(),
        "create stored a status: {created}"
    );
    ensure!(
        configmap_version(&created) == Some("v1"),
        "spec not kept: {created}"
    );
    let got = store
        .get(Kind::ManifestWork, Some(&ns), "baseline")
        .await
        .context("get")?
        .context("get after create found nothing")?;
    ensure!(
        got == created,
        "get differs from create:\n got {got}\n created {created}"
    );
    // The same object as the JSON a reader sends on (the operator API's GET).
    let json = store
        .get_json(Kind::ManifestWork, Some(&ns), "baseline")
        .await
        .context("get_json")?
        .context("get_json after create found nothing")?;
    let sent: Object = serde_json::from_slice(&json).context("get_json gave no JSON object")?;
    ensure!(
        sent == created,
        "get_json differs from create:\n got {sent}\n created {created}"
    );
    ensure!(
        store
            .get_json(Kind::ManifestWork, Some(&ns), "other")
            .await?
            .is_none(),
        "get_json of a missing object must be None"
    );
    ensure!(
        store
            .get(Kind::ManifestWork, Some(&ns), "other")
            .await?
            .is_none(),
        "get of a missing object must be None"
    );
    Ok(())
}

pub async fn create_refuses_duplicates(store: &dyn Store, prefix: &str) -> Result<()> {
    let ns = format!("{prefix}-store");
    let first = store.create(manifest_work(&ns, "baseline", "v1")).await?;
    let err = expect_err(
        store.create(manifest_work(&ns, "baseline", "v2")).await,
        "second create",
        |e| matches!(e, StoreError::AlreadyExists { .. }),
    )?;
    let want = format!("ManifestWork {ns}/baseline already exists");
    ensure!(err.to_string() == want, "message {err:?}, want {want:?}");
    let got = store.get(Kind::ManifestWork, Some(&ns), "baseline").await?;
    ensure!(
        got.as_ref() == Some(&first),
        "the refused create changed the object: {got:?}"
    );
    Ok(())
}

pub async fn list_by_namespace_and_across_namespaces(
    store: &dyn Store,
    prefix: &str,
) -> Result<()> {
    let (a, b) = (format!("{prefix}-a"), format!("{prefix}-b"));
    for (ns, name) in [(&a, "one"), (&a, "two"), (&b, "three")] {
        store.create(manifest_work(ns, name, "v1")).await?;
    }
    let keys = |items: &[Object]| -> BTreeSet<String> {
        items
            .iter()
            .filter(|o| namespace_of(o).is_some_and(|ns| ns.starts_with(&format!("{prefix}-"))))
            .map(|o| format!("{}/{}", namespace_of(o).unwrap_or(""), name_of(o)))
            .collect()
    };
    let in_a = store.list(Kind::ManifestWork, Some(&a)).await?;
    ensure!(
        in_a.items.len() == 2,
        "list in {a}: {:?}",
        keys(&in_a.items)
    );
    ensure!(
        keys(&in_a.items) == BTreeSet::from([format!("{a}/one"), format!("{a}/two")]),
        "list in {a}: {:?}",
        keys(&in_a.items)
    );
    ensure!(!in_a.revision.as_str().is_empty(), "list has no revision");
    let all = store.list(Kind::ManifestWork, None).await?;
    let want = BTreeSet::from([format!("{a}/one"), format!("{a}/two"), format!("{b}/three")]);
    ensure!(
        keys(&all.items) == want,
        "list across namespaces: {:?}",
        keys(&all.items)
    );
    let empty = store
        .list(Kind::ManifestWork, Some(&format!("{prefix}-none")))
        .await?;
    ensure!(
        empty.items.is_empty(),
        "list of an empty namespace: {:?}",
        keys(&empty.items)
    );
    Ok(())
}

pub async fn update_spec_bumps_generation_only_for_spec_changes(
    store: &dyn Store,
    prefix: &str,
) -> Result<()> {
    let ns = format!("{prefix}-store");
    store.create(manifest_work(&ns, "baseline", "v1")).await?;
    let status = work_status("Applied", 1);
    store
        .update_status(
            Kind::ManifestWork,
            Some(&ns),
            "baseline",
            status.clone(),
            None,
        )
        .await
        .context("update_status")?;

    // Labels only: same generation, status kept even though the object carries none.
    let mut relabelled = manifest_work(&ns, "baseline", "v1");
    relabelled["metadata"]["labels"] = json!({"app": "baseline", "tier": "edge"});
    let updated = store.update_spec(relabelled).await.context("relabel")?;
    ensure!(
        generation_of(&updated) == 1,
        "a label change bumped generation to {}",
        generation_of(&updated)
    );
    ensure!(
        updated["metadata"]["labels"]["tier"] == "edge",
        "labels not replaced: {updated}"
    );
    ensure!(
        updated.get("status") == Some(&status),
        "update_spec lost the status: {updated}"
    );

    // A spec change: generation 2, and a status in the object is ignored.
    let mut respecced = manifest_work(&ns, "baseline", "v2");
    respecced["status"] = work_status("Degraded", 7);
    let updated = store.update_spec(respecced).await.context("spec change")?;
    ensure!(
        generation_of(&updated) == 2,
        "a spec change gave generation {}, want 2",
        generation_of(&updated)
    );
    ensure!(
        configmap_version(&updated) == Some("v2"),
        "spec not replaced: {updated}"
    );
    ensure!(
        updated.get("status") == Some(&status),
        "update_spec wrote the status: {updated}"
    );

    let got = store
        .get(Kind::ManifestWork, Some(&ns), "baseline")
        .await?
        .context("object gone")?;
    ensure!(
        got == updated,
        "get differs from update_spec's result:\n got {got}\n updated {updated}"
    );
    expect_err(
        store.update_spec(manifest_work(&ns, "missing", "v1")).await,
        "update_spec of a missing object",
        |e| matches!(e, StoreError::NotFound { .. }),
    )?;
    Ok(())
}

pub async fn update_status_leaves_spec_and_generation_alone(
    store: &dyn Store,
    prefix: &str,
) -> Result<()> {
    let ns = format!("{prefix}-store");
    let created = store.create(manifest_work(&ns, "baseline", "v1")).await?;
    let applied = work_status("Applied", 1);
    let updated = store
        .update_status(
            Kind::ManifestWork,
            Some(&ns),
            "baseline",
            applied.clone(),
            None,
        )
        .await?;
    ensure!(
        updated.get("status") == Some(&applied),
        "status not written: {updated}"
    );
    ensure!(
        updated.get("spec") == created.get("spec"),
        "update_status changed the spec: {updated}"
    );
    ensure!(
        generation_of(&updated) == 1,
        "update_status changed generation to {}",
        generation_of(&updated)
    );
    ensure!(
        resource_version(&updated) != resource_version(&created),
        "update_status did not change resourceVersion"
    );
    // The status is replaced, not merged.
    let available = json!({"conditions": [{
        "type": "Available", "status": "True", "reason": "ResourcesAvailable",
        "message": "All resources are available", "lastTransitionTime": "2025-01-01T00:00:00Z",
    }]});
    let updated = store
        .update_status(
            Kind::ManifestWork,
            Some(&ns),
            "baseline",
            available.clone(),
            Some(&revision(&updated)?),
        )
        .await
        .context("update_status with the current revision")?;
    ensure!(
        updated.get("status") == Some(&available),
        "status merged instead of replaced: {updated}"
    );
    let got = store
        .get(Kind::ManifestWork, Some(&ns), "baseline")
        .await?
        .context("object gone")?;
    ensure!(got == updated, "get differs from update_status's result");
    expect_err(
        store
            .update_status(Kind::ManifestWork, Some(&ns), "missing", applied, None)
            .await,
        "update_status of a missing object",
        |e| matches!(e, StoreError::NotFound { .. }),
    )?;
    expect_err(
        store
            .update_status(
                Kind::ManifestWork,
                Some(&ns),
                "baseline",
                json!("Applied"),
                None,
            )
            .await,
        "a status that is not a map",
        |e| matches!(e, StoreError::Invalid { .. }),
    )?;
    Ok(())
}

pub async fn stale_resource_version_conflicts(store: &dyn Store, prefix: &str) -> Result<()> {
    let ns = format!("{prefix}-store");
    let v1 = store.create(manifest_work(&ns, "baseline", "v1")).await?;

    let mut from_v1 = manifest_work(&ns, "baseline", "v2");
    from_v1["metadata"]["resourceVersion"] = json!(revision(&v1)?.as_str());
    let v2 = store
        .update_spec(from_v1.clone())
        .await
        .context("update with the current revision")?;

    let mut stale = from_v1;
    stale["spec"]["workload"]["manifests"][0]["data"]["version"] = json!("v3");
    let err = expect_err(
        store.update_spec(stale).await,
        "update_spec with a stale resourceVersion",
        |e| matches!(e, StoreError::Conflict { .. }),
    )?;
    ensure!(
        err.to_string().contains(&format!("{ns}/baseline")),
        "conflict message does not name the object: {err}"
    );
    expect_err(
        store
            .update_status(
                Kind::ManifestWork,
                Some(&ns),
                "baseline",
                work_status("Applied", 1),
                Some(&revision(&v1)?),
            )
            .await,
        "update_status with a stale resourceVersion",
        |e| matches!(e, StoreError::Conflict { .. }),
    )?;
    let got = store
        .get(Kind::ManifestWork, Some(&ns), "baseline")
        .await?
        .context("object gone")?;
    ensure!(got == v2, "a refused write changed the object: {got}");

    // Without a resourceVersion the last writer wins.
    let v4 = store
        .update_spec(manifest_work(&ns, "baseline", "v4"))
        .await
        .context("unconditional update")?;
    ensure!(
        configmap_version(&v4) == Some("v4"),
        "unconditional update lost: {v4}"
    );
    ensure!(
        generation_of(&v4) == 3,
        "generation {} after two spec changes, want 3",
        generation_of(&v4)
    );
    Ok(())
}

pub async fn delete_then_not_found(store: &dyn Store, prefix: &str) -> Result<()> {
    let ns = format!("{prefix}-store");
    store.create(manifest_work(&ns, "baseline", "v1")).await?;
    store.create(manifest_work(&ns, "keep", "v1")).await?;
    store
        .delete(Kind::ManifestWork, Some(&ns), "baseline")
        .await
        .context("delete")?;
    ensure!(
        store
            .get(Kind::ManifestWork, Some(&ns), "baseline")
            .await?
            .is_none(),
        "the object is still there after delete"
    );
    let err = expect_err(
        store
            .delete(Kind::ManifestWork, Some(&ns), "baseline")
            .await,
        "second delete",
        |e| matches!(e, StoreError::NotFound { .. }),
    )?;
    let want = format!("ManifestWork {ns}/baseline not found");
    ensure!(err.to_string() == want, "message {err:?}, want {want:?}");
    expect_err(
        store
            .update_status(
                Kind::ManifestWork,
                Some(&ns),
                "baseline",
                work_status("Applied", 1),
                None,
            )
            .await,
        "update_status after delete",
        |e| matches!(e, StoreError::NotFound { .. }),
    )?;
    let left = store.list(Kind::ManifestWork, Some(&ns)).await?;
    ensure!(
        left.items.iter().map(name_of).collect::<Vec<_>>() == ["keep"],
        "delete touched another object"
    );
    // The name is free again.
    let again = store
        .create(manifest_work(&ns, "baseline", "v1"))
        .await
        .context("create after delete")?;
    ensure!(
        generation_of(&again) == 1,
        "a re-created object starts at generation 1"
    );
    Ok(())
}

pub async fn watch_from_revision_sees_exactly_the_later_events(
    store: &dyn Store,
    prefix: &str,
) -> Result<()> {
    let (ns, other) = (format!("{prefix}-store"), format!("{prefix}-other"));
    let a = store.create(manifest_work(&ns, "a", "v1")).await?;
    let from = revision(&a)?;

    // Before the watch opens: replayed from history.
    store
        .create(manifest_work(&other, "filtered", "v1"))
        .await?;
    store.update_spec(manifest_work(&ns, "a", "v2")).await?;
    let mut watch = store
        .watch(Kind::ManifestWork, Some(&ns), Some(from))
        .await
        .context("watch")?;
    // After: live.
    store.create(manifest_work(&ns, "b", "v1")).await?;
    store
        .create(manifest_work(&other, "filtered-too", "v1"))
        .await?;
    store.delete(Kind::ManifestWork, Some(&ns), "a").await?;
    store.create(manifest_work(&ns, "marker", "v1")).await?;

    let events = expect_events(
        &mut watch,
        &[
            format!("Modified {ns}/a"),
            format!("Added {ns}/b"),
            format!("Deleted {ns}/a"),
            format!("Added {ns}/marker"),
        ],
    )
    .await?;
    ensure!(
        configmap_version(events[0].object()) == Some("v2"),
        "Modified carries the new spec"
    );
    let revisions: Vec<Revision> = events.iter().filter_map(WatchEvent::revision).collect();
    ensure!(
        revisions.len() == events.len(),
        "every event has a revision"
    );
    let distinct: BTreeSet<&str> = revisions.iter().map(Revision::as_str).collect();
    ensure!(
        distinct.len() == revisions.len(),
        "event revisions repeat: {revisions:?}"
    );

    // Resuming from the middle sees exactly the rest.
    let mut resumed = store
        .watch(Kind::ManifestWork, Some(&ns), Some(revisions[1].clone()))
        .await
        .context("resume")?;
    expect_events(
        &mut resumed,
        &[format!("Deleted {ns}/a"), format!("Added {ns}/marker")],
    )
    .await?;
    Ok(())
}

pub async fn watch_from_list_revision_sees_only_later_changes(
    store: &dyn Store,
    prefix: &str,
) -> Result<()> {
    let ns = format!("{prefix}-store");
    store.create(manifest_work(&ns, "before", "v1")).await?;
    let list = store.list(Kind::ManifestWork, Some(&ns)).await?;
    ensure!(
        list.items.len() == 1,
        "list: {} items, want 1",
        list.items.len()
    );
    store.create(manifest_work(&ns, "after", "v1")).await?;
    store
        .update_status(
            Kind::ManifestWork,
            Some(&ns),
            "before",
            work_status("Applied", 1),
            None,
        )
        .await?;
    let mut watch = store
        .watch(Kind::ManifestWork, Some(&ns), Some(list.revision))
        .await?;
    expect_events(
        &mut watch,
        &[format!("Added {ns}/after"), format!("Modified {ns}/before")],
    )
    .await?;
    Ok(())
}

pub async fn watch_without_revision_starts_with_existing_objects(
    store: &dyn Store,
    prefix: &str,
) -> Result<()> {
    let (ns, other) = (format!("{prefix}-store"), format!("{prefix}-other"));
    store.create(manifest_work(&ns, "one", "v1")).await?;
    store.create(manifest_work(&ns, "two", "v1")).await?;
    store
        .create(manifest_work(&other, "elsewhere", "v1"))
        .await?;
    let mut watch = store.watch(Kind::ManifestWork, Some(&ns), None).await?;
    let mut initial = BTreeSet::new();
    for _ in 0..2 {
        let event = next_event(&mut watch).await?;
        ensure!(
            matches!(event, WatchEvent::Added(_)),
            "initial events are Added, got {}",
            describe(&event)
        );
        initial.insert(describe(&event));
    }
    let want = BTreeSet::from([format!("Added {ns}/one"), format!("Added {ns}/two")]);
    ensure!(initial == want, "initial events {initial:?}, want {want:?}");
    store.create(manifest_work(&ns, "three", "v1")).await?;
    expect_events(&mut watch, &[format!("Added {ns}/three")]).await?;

    // Cluster-wide: includes every namespace.
    let mut all = store.watch(Kind::ManifestWork, None, None).await?;
    let mut seen = BTreeSet::new();
    while seen.len() < 4 {
        let event = next_event(&mut all).await?;
        if namespace_of(event.object()).is_some_and(|n| n == ns || n == other) {
            seen.insert(describe(&event));
        }
    }
    ensure!(
        seen.contains(&format!("Added {other}/elsewhere")),
        "cluster-wide watch: {seen:?}"
    );
    Ok(())
}

pub async fn invalid_objects_are_refused_and_nothing_is_lost(
    store: &dyn Store,
    prefix: &str,
) -> Result<()> {
    let ns = format!("{prefix}-store");
    let kept = store.create(manifest_work(&ns, "baseline", "v1")).await?;
    let invalid = |e: &StoreError| matches!(e, StoreError::Invalid { .. });

    let mut unnamed = manifest_work(&ns, "x", "v1");
    unnamed["metadata"]
        .as_object_mut()
        .context("metadata")?
        .remove("name");
    let err = expect_err(store.create(unnamed).await, "no name", invalid)?;
    ensure!(
        err.to_string().contains("metadata.name is required"),
        "message: {err}"
    );

    let mut wrong_kind = manifest_work(&ns, "x", "v1");
    wrong_kind["kind"] = json!("Deployment");
    wrong_kind["apiVersion"] = json!("apps/v1");
    let err = expect_err(store.create(wrong_kind).await, "wrong kind", invalid)?;
    ensure!(
        err.to_string().contains("Deployment"),
        "message does not name the kind: {err}"
    );

    let mut wrong_version = manifest_work(&ns, "x", "v1");
    wrong_version["apiVersion"] = json!("work.open-cluster-management.io/v9");
    expect_err(
        store.create(wrong_version).await,
        "wrong apiVersion",
        invalid,
    )?;

    expect_err(
        store.create(manifest_work(&ns, "Not_A_Name", "v1")).await,
        "bad name",
        invalid,
    )?;

    let huge = "x".repeat(MAX_OBJECT_BYTES);
    let mut too_large = manifest_work(&ns, "huge", &huge);
    let err = expect_err(store.create(too_large.clone()).await, "too large", invalid)?;
    let message = err.to_string();
    ensure!(
        message.contains(" bytes, the limit is 1572864 bytes") && message.contains("ManifestWork"),
        "the size error names neither size nor object: {message}"
    );

    // Too large as an update of an existing object: refused, the stored one untouched.
    too_large["metadata"]["name"] = json!("baseline");
    expect_err(
        store.update_spec(too_large).await,
        "too large update",
        invalid,
    )?;
    expect_err(
        store
            .update_status(
                Kind::ManifestWork,
                Some(&ns),
                "baseline",
                json!({"blob": huge}),
                None,
            )
            .await,
        "too large status",
        invalid,
    )?;

    let list = store.list(Kind::ManifestWork, Some(&ns)).await?;
    ensure!(
        list.items == vec![kept],
        "refused writes changed what is stored: {:?}",
        list.items.iter().map(name_of).collect::<Vec<_>>()
    );
    Ok(())
}

pub async fn cluster_scoped_and_namespaced_kinds(store: &dyn Store, prefix: &str) -> Result<()> {
    let name = format!("{prefix}-store-7");
    let invalid = |e: &StoreError| matches!(e, StoreError::Invalid { .. });
    let created = store
        .create(managed_cluster(&name))
        .await
        .context("create ManagedCluster")?;
    ensure!(
        namespace_of(&created).is_none(),
        "a cluster-scoped object got a namespace: {created}"
    );
    ensure!(
        store.get(Kind::ManagedCluster, None, &name).await?.as_ref() == Some(&created),
        "get ManagedCluster differs from create"
    );
    let listed = store.list(Kind::ManagedCluster, None).await?;
    ensure!(
        listed.items.iter().any(|o| name_of(o) == name),
        "list ManagedCluster misses {name}"
    );

    let status = json!({"version": {"kubernetes": "v1.36.0"}});
    let updated = store
        .update_status(Kind::ManagedCluster, None, &name, status.clone(), None)
        .await
        .context("ManagedCluster status")?;
    ensure!(
        updated.get("status") == Some(&status),
        "ManagedCluster status not written: {updated}"
    );

    let mut namespaced_cluster = managed_cluster(&format!("{prefix}-x"));
    namespaced_cluster["metadata"]["namespace"] = json!("default");
    let err = expect_err(
        store.create(namespaced_cluster).await,
        "ManagedCluster with a namespace",
        invalid,
    )?;
    ensure!(err.to_string().contains("cluster-scoped"), "message: {err}");
    expect_err(
        store
            .get(Kind::ManagedCluster, Some("default"), &name)
            .await,
        "get ManagedCluster in a namespace",
        invalid,
    )?;
    expect_err(
        store.list(Kind::ManagedCluster, Some("default")).await,
        "list ManagedCluster in a namespace",
        invalid,
    )?;

    let mut unnamespaced_work = manifest_work("x", "baseline", "v1");
    unnamespaced_work["metadata"]
        .as_object_mut()
        .context("metadata")?
        .remove("namespace");
    let err = expect_err(
        store.create(unnamespaced_work).await,
        "ManifestWork without a namespace",
        invalid,
    )?;
    ensure!(err.to_string().contains("namespace"), "message: {err}");
    expect_err(
        store.get(Kind::ManifestWork, None, "baseline").await,
        "get ManifestWork without a namespace",
        invalid,
    )?;
    expect_err(
        store.delete(Kind::ManifestWork, None, "baseline").await,
        "delete ManifestWork without a namespace",
        invalid,
    )?;

    // A cluster-scoped watch sees the cluster's changes.
    let from = revision(&updated)?;
    let mut watch = store.watch(Kind::ManagedCluster, None, Some(from)).await?;
    store.delete(Kind::ManagedCluster, None, &name).await?;
    loop {
        let event = next_event(&mut watch).await?;
        if name_of(event.object()) == name {
            ensure!(
                matches!(event, WatchEvent::Deleted(_)),
                "expected Deleted {name}, got {}",
                describe(&event)
            );
            break;
        }
    }
    ensure!(
        store
            .get(Kind::ManagedCluster, None, &name)
            .await?
            .is_none(),
        "ManagedCluster still there after delete"
    );
    Ok(())
}

/// Writers racing on one store: every create gets its own revision and one event, and racing
/// unconditional spec updates all land (last writer wins, none is refused).
pub async fn concurrent_writes_are_each_seen_once(store: &dyn Store, prefix: &str) -> Result<()> {
    const CREATES: usize = 20;
    const UPDATERS: usize = 4;
    let ns = format!("{prefix}-store");
    let first = store.create(manifest_work(&ns, "shared", "v0")).await?;
    let creates = (0..CREATES).map(|i| {
        let ns = ns.clone();
        async move {
            store
                .create(manifest_work(&ns, &format!("w{i}"), "v1"))
                .await
        }
    });
    let created = futures::future::try_join_all(creates)
        .await
        .context("concurrent creates")?;
    let revisions: BTreeSet<String> = created
        .iter()
        .filter_map(resource_version)
        .map(str::to_owned)
        .collect();
    ensure!(
        revisions.len() == CREATES,
        "{CREATES} creates got {} distinct revisions",
        revisions.len()
    );

    let updates =
        (1..=UPDATERS).map(|i| store.update_spec(manifest_work(&ns, "shared", &format!("v{i}"))));
    futures::future::try_join_all(updates)
        .await
        .context("racing unconditional updates")?;
    let shared = store
        .get(Kind::ManifestWork, Some(&ns), "shared")
        .await?
        .context("shared gone")?;
    let generation = generation_of(&shared);
    ensure!(
        generation == 1 + UPDATERS as i64,
        "{UPDATERS} racing spec updates gave generation {generation}, want {}",
        1 + UPDATERS
    );

    let mut watch = store
        .watch(Kind::ManifestWork, Some(&ns), Some(revision(&first)?))
        .await?;
    store.create(manifest_work(&ns, "marker", "v1")).await?;
    let (mut added, mut modified) = (BTreeSet::new(), 0);
    loop {
        let event = next_event(&mut watch).await?;
        match &event {
            WatchEvent::Added(o) if name_of(o) == "marker" => break,
            WatchEvent::Added(o) => {
                ensure!(
                    added.insert(name_of(o).to_owned()),
                    "Added {} twice",
                    name_of(o)
                );
            }
            WatchEvent::Modified(o) if name_of(o) == "shared" => modified += 1,
            _ => bail!("unexpected {}", describe(&event)),
        }
    }
    ensure!(
        added.len() == CREATES,
        "the watch saw {} of {CREATES} creates",
        added.len()
    );
    ensure!(
        modified == UPDATERS,
        "the watch saw {modified} of {UPDATERS} updates"
    );
    Ok(())
}

/// An object with finalizers is only marked by delete (deletionTimestamp, generation + 1) and
/// goes when an update removes its last finalizer: how the hub keeps a ManifestWork until the
/// agent has cleaned up.
pub async fn finalizers_hold_deletion_until_removed(store: &dyn Store, prefix: &str) -> Result<()> {
    const FINALIZER: &str = "flotilla.io/conformance-cleanup";
    let ns = format!("{prefix}-store");
    let mut work = manifest_work(&ns, "baseline", "v1");
    work["metadata"]["finalizers"] = json!([FINALIZER]);
    let created = store.create(work).await?;
    let mut watch = store
        .watch(Kind::ManifestWork, Some(&ns), Some(revision(&created)?))
        .await?;

    store
        .delete(Kind::ManifestWork, Some(&ns), "baseline")
        .await
        .context("delete")?;
    let marked = store
        .get(Kind::ManifestWork, Some(&ns), "baseline")
        .await?
        .context("an object with a finalizer disappeared on delete")?;
    ensure!(
        marked
            .pointer("/metadata/deletionTimestamp")
            .and_then(Value::as_str)
            .is_some_and(|t| !t.is_empty()),
        "delete did not set deletionTimestamp: {marked}"
    );
    ensure!(
        generation_of(&marked) == 2,
        "marking for deletion gave generation {}, want 2",
        generation_of(&marked)
    );
    let events = expect_events(&mut watch, &[format!("Modified {ns}/baseline")]).await?;
    ensure!(
        events[0].object() == &marked,
        "the Modified event differs from get"
    );

    store
        .delete(Kind::ManifestWork, Some(&ns), "baseline")
        .await
        .context("second delete while finalizing")?;
    let applied = work_status("Applied", 2);
    store
        .update_status(Kind::ManifestWork, Some(&ns), "baseline", applied, None)
        .await
        .context("status while finalizing")?;

    let mut adding = marked.clone();
    adding["metadata"]["finalizers"] = json!([FINALIZER, "flotilla.io/another"]);
    adding["metadata"]
        .as_object_mut()
        .context("metadata")?
        .remove("resourceVersion");
    expect_err(
        store.update_spec(adding).await,
        "adding a finalizer while deleting",
        |e| matches!(e, StoreError::Invalid { .. }),
    )?;

    let mut released = marked;
    released["metadata"]["finalizers"] = json!([]);
    released["metadata"]
        .as_object_mut()
        .context("metadata")?
        .remove("resourceVersion");
    store
        .update_spec(released)
        .await
        .context("removing the last finalizer")?;
    ensure!(
        store
            .get(Kind::ManifestWork, Some(&ns), "baseline")
            .await?
            .is_none(),
        "the object is still there after its last finalizer went"
    );
    expect_events(
        &mut watch,
        &[
            format!("Modified {ns}/baseline"),
            format!("Deleted {ns}/baseline"),
        ],
    )
    .await?;
    Ok(())
}

/// `object` with label `key` set to `value`.
fn labelled(mut object: Object, key: &str, value: &str) -> Object {
    object["metadata"]["labels"][key] = json!(value);
    object
}

/// The label key a selection check uses: its own, so checks sharing a store never select each
/// other's objects.
fn check_label(prefix: &str) -> String {
    format!("{prefix}.flotilla.test/shard")
}

/// `ns/name` (or `name`) of every object, sorted.
fn names(items: &[Object]) -> Vec<String> {
    let mut names: Vec<String> = items
        .iter()
        .map(|o| match namespace_of(o) {
            Some(ns) => format!("{ns}/{}", name_of(o)),
            None => name_of(o).to_owned(),
        })
        .collect();
    names.sort();
    names
}

/// A selected list has the objects whose label has one of the values, across namespaces, of
/// namespaced and cluster-scoped kinds alike; no values select nothing.
pub async fn selected_list_reads_only_the_chosen_label_values(
    store: &dyn Store,
    prefix: &str,
) -> Result<()> {
    let key = check_label(prefix);
    let (a, b, c) = (
        format!("{prefix}-a"),
        format!("{prefix}-b"),
        format!("{prefix}-c"),
    );
    store
        .create(labelled(manifest_work(&a, "w", "v1"), &key, "01"))
        .await?;
    store
        .create(labelled(manifest_work(&b, "w", "v1"), &key, "02"))
        .await?;
    store
        .create(labelled(manifest_work(&c, "w", "v1"), &key, "03"))
        .await?;
    store.create(manifest_work(&c, "unlabelled", "v1")).await?;
    for (cluster, value) in [(&a, "01"), (&b, "02")] {
        store
            .create(labelled(managed_cluster(cluster), &key, value))
            .await?;
    }
    store.create(managed_cluster(&c)).await?;

    let picked = store
        .list_selected(Kind::ManifestWork, &Selection::label_in(&key, ["01", "03"]))
        .await?;
    let want = vec![format!("{a}/w"), format!("{c}/w")];
    ensure!(
        names(&picked.items) == want,
        "works with {key} in (01,03): {:?}, want {want:?}",
        names(&picked.items)
    );
    let clusters = store
        .list_selected(Kind::ManagedCluster, &Selection::label_in(&key, ["02"]))
        .await?;
    ensure!(
        names(&clusters.items) == vec![b.clone()],
        "clusters with {key} in (02): {:?}, want [{b}]",
        names(&clusters.items)
    );
    let none = store
        .list_selected(
            Kind::ManifestWork,
            &Selection::label_in(&key, Vec::<String>::new()),
        )
        .await?;
    ensure!(
        none.items.is_empty(),
        "no values selected {:?}",
        names(&none.items)
    );
    // The empty selection's revision is one to watch from like any other.
    let mut watch = store
        .watch_selected(
            Kind::ManifestWork,
            &Selection::label_in(&key, ["01"]),
            Some(none.revision),
        )
        .await?;
    store
        .create(labelled(manifest_work(&a, "later", "v1"), &key, "01"))
        .await?;
    expect_events(&mut watch, &[format!("Added {a}/later")]).await?;
    let everything = store
        .list_selected(Kind::ManifestWork, &Selection::Everything)
        .await?;
    let everything = names(&everything.items);
    for want in [format!("{b}/w"), format!("{c}/unlabelled")] {
        ensure!(
            everything.contains(&want),
            "selecting everything misses {want}"
        );
    }
    Ok(())
}

/// A selected watch starts with the selected objects, and follows an object whose label
/// changes: `Added` when it comes into the selection, `Deleted` when it leaves, nothing while
/// it is outside, as the apiserver's label-selected watches do.
pub async fn selected_watch_follows_objects_into_and_out_of_the_selection(
    store: &dyn Store,
    prefix: &str,
) -> Result<()> {
    let key = check_label(prefix);
    let (mine, theirs) = (format!("{prefix}-mine"), format!("{prefix}-theirs"));
    store
        .create(labelled(manifest_work(&mine, "first", "v1"), &key, "01"))
        .await?;
    store
        .create(labelled(manifest_work(&theirs, "first", "v1"), &key, "02"))
        .await?;
    let selection = Selection::label_in(&key, ["01"]);
    let mut watch = store
        .watch_selected(Kind::ManifestWork, &selection, None)
        .await?;
    expect_events(&mut watch, &[format!("Added {mine}/first")]).await?;

    // Outside the selection: nothing, even as it changes.
    let mut moving = store
        .create(labelled(manifest_work(&theirs, "moving", "v1"), &key, "02"))
        .await?;
    moving["spec"]["workload"]["manifests"][0]["data"]["version"] = json!("v2");
    let moving = store.update_spec(moving).await?;
    // Relabelled into the selection: Added.
    let moved_in = store.update_spec(labelled(moving, &key, "01")).await?;
    // Status of a selected object: Modified.
    store
        .update_status(
            Kind::ManifestWork,
            Some(&theirs),
            "moving",
            work_status("Applied", generation_of(&moved_in)),
            None,
        )
        .await?;
    // Relabelled out of it: Deleted, and nothing after while it stays out.
    let current = store
        .get(Kind::ManifestWork, Some(&theirs), "moving")
        .await?
        .context("moving work")?;
    let moved_out = store.update_spec(labelled(current, &key, "03")).await?;
    store
        .delete(Kind::ManifestWork, Some(&theirs), "moving")
        .await?;
    // Deleted while selected: Deleted.
    store
        .delete(Kind::ManifestWork, Some(&mine), "first")
        .await?;
    store
        .create(labelled(manifest_work(&mine, "marker", "v1"), &key, "01"))
        .await?;
    let events = expect_events(
        &mut watch,
        &[
            format!("Added {theirs}/moving"),
            format!("Modified {theirs}/moving"),
            format!("Deleted {theirs}/moving"),
            format!("Deleted {mine}/first"),
            format!("Added {mine}/marker"),
        ],
    )
    .await?;
    ensure!(
        configmap_version(events[0].object()) == Some("v2"),
        "the object that comes into the selection arrives as it is now"
    );
    ensure!(
        crate::label(events[2].object(), &key) == Some("01"),
        "the object that leaves the selection is reported as it last matched: {}",
        events[2].object()
    );
    ensure!(
        crate::label(&moved_out, &key) == Some("03"),
        "the stored object has its new label: {moved_out}"
    );

    // Resumed from the middle: the same rules replayed.
    let from = events[0].revision().context("event revision")?;
    let mut resumed = store
        .watch_selected(Kind::ManifestWork, &selection, Some(from))
        .await?;
    expect_events(
        &mut resumed,
        &[
            format!("Modified {theirs}/moving"),
            format!("Deleted {theirs}/moving"),
            format!("Deleted {mine}/first"),
            format!("Added {mine}/marker"),
        ],
    )
    .await?;
    Ok(())
}

// ---- fencing (flotilla_proto::contract::fence) ----

/// `status.fence` of `object`.
fn stored_fence(object: &Object) -> Option<WriteFence> {
    WriteFence::of_object(object)
}

fn fenced(reason: Stale) -> impl FnOnce(&StoreError) -> bool {
    move |e| matches!(e, StoreError::Fenced { reason: r, .. } if *r == reason)
}

/// A fenced status write sets the record; one under an older epoch of the same shard, or of
/// an older report, is refused with an error naming the object, both epochs and sequences and
/// the gateway that wrote the newer one, and leaves the object as it was; a newer epoch, or the
/// same report again under an equal or newer epoch, is written.
pub async fn fenced_status_writes_refuse_what_is_stale(
    store: &dyn Store,
    prefix: &str,
) -> Result<()> {
    let ns = format!("{prefix}-store");
    store.create(manifest_work(&ns, "web", "v1")).await?;
    let write = |status: Value, fence: WriteFence| {
        let ns = ns.clone();
        async move {
            store
                .update_status_fenced(Kind::ManifestWork, Some(&ns), "web", status, &fence, None)
                .await
        }
    };
    let a1 = WriteFence::new(3, 1, "gw-a");
    let b2 = WriteFence::new(3, 2, "gw-b");

    let written = write(work_status("Applied", 1), a1.clone().with_report(10))
        .await
        .context("the first fenced write")?;
    ensure!(
        stored_fence(&written) == Some(a1.clone().with_report(10)),
        "the record is not the write's fence: {written}"
    );
    ensure!(
        written["status"]["conditions"] == work_status("Applied", 1)["conditions"],
        "the status is not the written one: {written}"
    );
    let by_b = write(work_status("Available", 1), b2.clone().with_report(11))
        .await
        .context("a newer epoch's write")?;

    // A's write lands late, under the old epoch, even with a newer report: refused.
    let err = expect_err(
        write(work_status("Degraded", 1), a1.clone().with_report(12)).await,
        "a write under an older epoch",
        fenced(Stale::Epoch),
    )?;
    let message = err.to_string();
    for part in [
        format!("{ns}/web"),
        "stale_epoch".into(),
        "epoch 1".into(),
        "epoch 2".into(),
        "\"gw-b\"".into(),
        "report 12".into(),
        "report 11".into(),
    ] {
        ensure!(
            message.contains(&part),
            "the refusal does not say {part:?}: {message}"
        );
    }
    let got = store
        .get(Kind::ManifestWork, Some(&ns), "web")
        .await?
        .context("object gone")?;
    ensure!(got == by_b, "a refused write changed the object: {got}");

    // An older report is refused whoever writes it, even under a newer epoch.
    expect_err(
        write(
            work_status("Applied", 1),
            WriteFence::new(3, 5, "gw-c").with_report(10),
        )
        .await,
        "an older report under a newer epoch",
        fenced(Stale::Report),
    )?;
    // The same report again under the same epoch, or under a newer one: written.
    write(work_status("Available", 1), b2.clone().with_report(11))
        .await
        .context("the same report again")?;
    let c3 = write(
        work_status("Available", 1),
        WriteFence::new(3, 3, "gw-c").with_report(11),
    )
    .await
    .context("the same report under a newer epoch")?;
    ensure!(
        stored_fence(&c3).map(|f| (f.epoch, f.gateway)) == Some((3, "gw-c".into())),
        "{c3}"
    );
    // A health-style write without a sequence over a record with one: only epochs count.
    write(work_status("Available", 1), WriteFence::new(3, 3, "gw-c"))
        .await
        .context("a write without a report sequence")?;

    // Another shard number (the fleet's --shards changed): written whatever the epochs.
    write(work_status("Available", 1), WriteFence::new(9, 1, "gw-d"))
        .await
        .context("a write of another shard number")?;

    // Missing objects and kinds without a record.
    expect_err(
        store
            .update_status_fenced(
                Kind::ManifestWork,
                Some(&ns),
                "missing",
                work_status("Applied", 1),
                &b2,
                None,
            )
            .await,
        "a fenced status write of a missing object",
        |e| matches!(e, StoreError::NotFound { .. }),
    )?;
    expect_err(
        store
            .update_status_fenced(Kind::Placement, Some(&ns), "web", json!({}), &b2, None)
            .await,
        "a fenced write of a kind without a record",
        |e| matches!(e, StoreError::Invalid { .. }),
    )?;
    Ok(())
}

/// A fenced write compares against the basis it is given and is conditioned on it: when the
/// object changed since (another gateway took the shard and wrote), it is read again and
/// compared again, so a basis read before the takeover never lets a stale write through, and a
/// merely outdated basis costs a read, not the write. The object a write returns is a current
/// basis for the next.
pub async fn fenced_writes_on_an_outdated_basis_read_again(
    store: &dyn Store,
    prefix: &str,
) -> Result<()> {
    let name = format!("{prefix}-cluster");
    store.create(managed_cluster(&name)).await?;
    let status = |available: &str| {
        json!({"conditions": [{
            "type": "ManagedClusterConditionAvailable", "status": available,
            "reason": "R", "message": "", "lastTransitionTime": "2025-01-01T00:00:00Z",
        }]})
    };
    let write = |status: Value, fence: WriteFence, basis: Option<Basis>| {
        let name = name.clone();
        async move {
            store
                .update_status_fenced(
                    Kind::ManagedCluster,
                    None,
                    &name,
                    status,
                    &fence,
                    basis.as_ref(),
                )
                .await
        }
    };
    let a1 = WriteFence::new(5, 1, "gw-a");
    let b2 = WriteFence::new(5, 2, "gw-b");
    let first = write(status("True"), a1.clone(), None).await?;
    let basis = Basis::of(&first).context("the written object has no resourceVersion")?;
    ensure!(basis.fence == Some(a1.clone()), "{basis:?}");

    // The returned object is a current basis.
    let second = write(status("True"), a1.clone(), Some(basis.clone()))
        .await
        .context("a write on the basis the previous one returned")?;
    // An outdated basis (the object changed since, its record the same): read again, written.
    let third = write(status("Unknown"), a1.clone(), Some(basis.clone()))
        .await
        .context("a write on an outdated basis")?;
    ensure!(
        resource_version(&third) != resource_version(&second),
        "not written: {third}"
    );

    // A read its basis before B took the shard and wrote Available; its Unknown lands after:
    // refused, and B's Available stays.
    let a_basis = Basis::of(&third).context("no resourceVersion")?;
    let by_b = write(status("True"), b2.clone(), None).await?;
    expect_err(
        write(status("Unknown"), a1.clone(), Some(a_basis)).await,
        "a stale owner's write on a basis from before the takeover",
        fenced(Stale::Epoch),
    )?;
    let got = store
        .get(Kind::ManagedCluster, None, &name)
        .await?
        .context("object gone")?;
    ensure!(got == by_b, "a refused write changed the object: {got}");
    ensure!(
        got["status"]["conditions"][0]["status"] == "True",
        "B's Available was undone: {got}"
    );
    Ok(())
}

/// A fenced spec write (a finalizer, a taint) is compared against the record and refused when
/// stale. It leaves `status` as stored and its fence in the spec-fence annotation, which later
/// fenced writes are judged against too: an old owner's status after a new owner's spec write is
/// refused. On an object read with its resourceVersion the rule is applied to what was read, and
/// a change since is a conflict.
pub async fn fenced_spec_writes_are_compared_and_fence_later_writes(
    store: &dyn Store,
    prefix: &str,
) -> Result<()> {
    let ns = format!("{prefix}-store");
    store.create(manifest_work(&ns, "web", "v1")).await?;
    let a1 = WriteFence::new(3, 1, "gw-a");
    let b2 = WriteFence::new(3, 2, "gw-b");
    let c3 = WriteFence::new(3, 3, "gw-c");
    let read = || async {
        store
            .get(Kind::ManifestWork, Some(&ns), "web")
            .await?
            .context("object gone")
    };
    let with_finalizer = |mut work: Object, finalizer: &str| {
        work["metadata"]["finalizers"] = json!([finalizer]);
        work
    };

    // No record yet: a spec write under any fence goes through; status stays without one, the
    // object records the spec write's.
    let held = store
        .update_spec_fenced(with_finalizer(read().await?, "example.com/one"), &a1)
        .await
        .context("a fenced spec write of an object no gateway wrote")?;
    ensure!(
        stored_fence(&held).is_none(),
        "a spec write set the status's record: {held}"
    );
    ensure!(
        WriteFence::recorded(&held) == Some(a1.clone()),
        "a spec write left no record of its fence: {held}"
    );

    store
        .update_status_fenced(
            Kind::ManifestWork,
            Some(&ns),
            "web",
            work_status("Applied", 1),
            &b2,
            None,
        )
        .await?;
    // Read after B's write: A's spec write is refused, on the record it read.
    expect_err(
        store
            .update_spec_fenced(with_finalizer(read().await?, "example.com/two"), &a1)
            .await,
        "a stale owner's spec write",
        fenced(Stale::Epoch),
    )?;
    // Without a resourceVersion: read, compared, refused all the same.
    let mut unconditional = with_finalizer(read().await?, "example.com/two");
    if let Some(meta) = unconditional["metadata"].as_object_mut() {
        meta.remove("resourceVersion");
    }
    expect_err(
        store.update_spec_fenced(unconditional, &a1).await,
        "a stale owner's spec write without a resourceVersion",
        fenced(Stale::Epoch),
    )?;
    ensure!(
        read().await?["metadata"]["finalizers"] == json!(["example.com/one"]),
        "a refused spec write changed the object"
    );

    // A new owner's spec write fences the old owner's status writes, with the old owner's
    // basis (conditioned on a version the spec write changed) or without one.
    let before_c = read().await?;
    let by_c = store
        .update_spec_fenced(with_finalizer(read().await?, "example.com/three"), &c3)
        .await
        .context("a new owner's spec write")?;
    ensure!(
        stored_fence(&by_c) == Some(b2.clone()),
        "a spec write changed the status's record: {by_c}"
    );
    for basis in [Basis::of(&before_c), None] {
        expect_err(
            store
                .update_status_fenced(
                    Kind::ManifestWork,
                    Some(&ns),
                    "web",
                    work_status("Available", 1),
                    &b2,
                    basis.as_ref(),
                )
                .await,
            "the old owner's status after the new owner's spec write",
            fenced(Stale::Epoch),
        )?;
    }
    ensure!(
        read().await?["status"]["conditions"] == work_status("Applied", 1)["conditions"],
        "a refused status write changed the object"
    );
    let by_c = store
        .update_status_fenced(
            Kind::ManifestWork,
            Some(&ns),
            "web",
            work_status("Available", 1),
            &c3,
            Basis::of(&by_c).as_ref(),
        )
        .await
        .context("the new owner's status write after its spec write")?;
    ensure!(
        stored_fence(&by_c) == Some(c3.clone()),
        "the new owner's status write did not set its record: {by_c}"
    );

    // A read from before a change is a conflict, not a silent overwrite.
    let before = read().await?;
    store
        .update_spec_fenced(with_finalizer(read().await?, "example.com/four"), &c3)
        .await
        .context("the owner's spec write")?;
    expect_err(
        store
            .update_spec_fenced(with_finalizer(before, "example.com/five"), &c3)
            .await,
        "a fenced spec write on an outdated read",
        |e| matches!(e, StoreError::Conflict { .. }),
    )?;
    let mut missing = manifest_work(&ns, "missing", "v1");
    missing["metadata"]["finalizers"] = json!(["example.com/one"]);
    expect_err(
        store.update_spec_fenced(missing, &c3).await,
        "a fenced spec write of a missing object",
        |e| matches!(e, StoreError::NotFound { .. }),
    )?;
    Ok(())
}

/// Writers that carry no fence (the operator API, the hub's controllers, kubectl through the
/// operator API) never drop or lower the record: a status without it keeps the stored one, a
/// status that carries another gets the stored one, a spec write keeps it; and none invents one
/// on an object no gateway wrote.
pub async fn unfenced_writes_keep_the_fencing_record(
    store: &dyn Store,
    prefix: &str,
) -> Result<()> {
    let ns = format!("{prefix}-store");
    store.create(manifest_work(&ns, "web", "v1")).await?;
    let b2 = WriteFence::new(3, 2, "gw-b").with_report(7);
    let forged = json!({"shard": 3, "epoch": 0, "gateway": "someone"});

    // No record: an unfenced status that carries one does not create it.
    let mut with_forged = work_status("Applied", 1);
    with_forged["fence"] = forged.clone();
    let unfenced = store
        .update_status(
            Kind::ManifestWork,
            Some(&ns),
            "web",
            with_forged.clone(),
            None,
        )
        .await?;
    ensure!(
        stored_fence(&unfenced).is_none(),
        "an unfenced write set a record: {unfenced}"
    );

    store
        .update_status_fenced(
            Kind::ManifestWork,
            Some(&ns),
            "web",
            work_status("Applied", 1),
            &b2,
            None,
        )
        .await?;
    let kept = store
        .update_status(
            Kind::ManifestWork,
            Some(&ns),
            "web",
            work_status("Available", 1),
            None,
        )
        .await
        .context("an unfenced status without a record")?;
    ensure!(
        stored_fence(&kept) == Some(b2.clone()),
        "an unfenced status write dropped the record: {kept}"
    );
    ensure!(
        kept["status"]["conditions"] == work_status("Available", 1)["conditions"],
        "the unfenced status was not written: {kept}"
    );
    let kept = store
        .update_status(
            Kind::ManifestWork,
            Some(&ns),
            "web",
            with_forged,
            Revision::of(&kept).as_ref(),
        )
        .await
        .context("an unfenced status carrying a lower record, on the current version")?;
    ensure!(
        stored_fence(&kept) == Some(b2.clone()),
        "an unfenced status write lowered the record: {kept}"
    );
    expect_err(
        store
            .update_status(
                Kind::ManifestWork,
                Some(&ns),
                "web",
                work_status("Applied", 1),
                Some(&revision(&unfenced)?),
            )
            .await,
        "an unfenced status write on a stale version",
        |e| matches!(e, StoreError::Conflict { .. }),
    )?;
    let respecced = store
        .update_spec(manifest_work(&ns, "web", "v2"))
        .await
        .context("a spec write")?;
    ensure!(
        stored_fence(&respecced) == Some(b2.clone()),
        "a spec write dropped the record: {respecced}"
    );
    // A fenced spec write's record stays through an unfenced spec write that does not carry
    // it (written without a resourceVersion, as the operator API's replace may be), and one
    // that carries a forged one gets the stored one.
    let c3 = WriteFence::new(3, 3, "gw-c");
    store
        .update_spec_fenced(
            store
                .get(Kind::ManifestWork, Some(&ns), "web")
                .await?
                .context("object gone")?,
            &c3,
        )
        .await
        .context("a fenced spec write")?;
    for (what, mut object) in [
        (
            "without the spec write's record",
            manifest_work(&ns, "web", "v3"),
        ),
        ("with a forged one", manifest_work(&ns, "web", "v4")),
    ] {
        if what.contains("forged") {
            WriteFence::new(3, 0, "someone").set_as_spec_annotation(&mut object);
        }
        let respecced = store
            .update_spec(object)
            .await
            .with_context(|| format!("an unfenced spec write {what}"))?;
        ensure!(
            WriteFence::recorded(&respecced)
                == Some(WriteFence {
                    report_sequence: Some(7),
                    ..c3.clone()
                }),
            "an unfenced spec write {what} changed the record: {respecced}"
        );
    }
    // And the stale owners are still refused after all of them.
    for (stale, what) in [
        (
            WriteFence::new(3, 2, "gw-b"),
            "an owner's write after a newer owner's spec write and unfenced writes",
        ),
        (
            WriteFence::new(3, 1, "gw-a"),
            "a stale owner's write after unfenced writes",
        ),
    ] {
        expect_err(
            store
                .update_status_fenced(
                    Kind::ManifestWork,
                    Some(&ns),
                    "web",
                    work_status("Applied", 1),
                    &stale.with_report(8),
                    None,
                )
                .await,
            what,
            fenced(Stale::Epoch),
        )?;
    }
    Ok(())
}

/// A ConfigMap in `namespace` with `data`.
pub fn config_map(namespace: &str, name: &str, data: Value) -> Object {
    json!({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": namespace},
        "data": data,
    })
}

/// Kubernetes' own ConfigMap (no CRD on the kube backend): stored, listed and watched in its
/// namespace; both backends refuse the same bad ones with the same words, naming the object
/// and the field; it has no status; an immutable one keeps its data.
pub async fn config_maps_are_core_objects_checked_alike(
    store: &dyn Store,
    prefix: &str,
) -> Result<()> {
    let ns = format!("{prefix}-policies");
    let invalid = |e: &StoreError| matches!(e, StoreError::Invalid { .. });
    let mut watch = store.watch(Kind::ConfigMap, Some(&ns), None).await?;
    let created = store
        .create(config_map(&ns, "settings", json!({"tier": "gold"})))
        .await
        .context("create ConfigMap")?;
    ensure!(
        created["data"] == json!({"tier": "gold"}) && created.get("status").is_none(),
        "stored as {created}"
    );
    expect_events(&mut watch, &[format!("Added {ns}/settings")]).await?;
    let mut edited = created.clone();
    edited["data"]["tier"] = json!("silver");
    store.update_spec(edited).await.context("edit ConfigMap")?;
    let events = expect_events(&mut watch, &[format!("Modified {ns}/settings")]).await?;
    ensure!(
        events[0].object()["data"]["tier"] == "silver",
        "the watch shows {}",
        events[0].object()
    );
    let listed = store.list(Kind::ConfigMap, Some(&ns)).await?;
    ensure!(
        listed.items.iter().map(name_of).collect::<Vec<_>>() == ["settings"],
        "list of {ns}: {:?}",
        listed.items.iter().map(name_of).collect::<Vec<_>>()
    );

    for (name, bad, want) in [
        (
            "numbers",
            config_map(&ns, "numbers", json!({"replicas": 3})),
            format!(
                "ConfigMap {ns}/numbers: data.replicas is a number; ConfigMap data values are strings (quote it)"
            ),
        ),
        (
            "bytes",
            {
                let mut c = config_map(&ns, "bytes", json!({}));
                c["binaryData"] = json!({"logo": "not base64!"});
                c
            },
            format!(
                "ConfigMap {ns}/bytes: binaryData.logo is not valid base64 (binaryData holds bytes as standard base64 with padding)"
            ),
        ),
        (
            "large",
            config_map(
                &ns,
                "large",
                json!({"a": "x".repeat(600 * 1024), "b": "x".repeat(600 * 1024)}),
            ),
            format!(
                "ConfigMap {ns}/large: data and binaryData hold 1228800 bytes, more than the 1048576 bytes a ConfigMap may hold"
            ),
        ),
    ] {
        let err = expect_err(store.create(bad).await, name, invalid)?;
        ensure!(err.to_string() == want, "{name}: {err}, want {want}");
    }
    let err = expect_err(
        store
            .update_status(Kind::ConfigMap, Some(&ns), "settings", json!({}), None)
            .await,
        "a ConfigMap's status",
        invalid,
    )?;
    ensure!(
        err.to_string().contains("a ConfigMap has no status"),
        "status write: {err}"
    );

    let mut frozen = config_map(&ns, "frozen", json!({"k": "v"}));
    frozen["immutable"] = json!(true);
    let frozen = store.create(frozen).await.context("create immutable")?;
    let mut changed = frozen.clone();
    changed["data"]["k"] = json!("w");
    expect_err(
        store.update_spec(changed).await,
        "edit an immutable ConfigMap",
        invalid,
    )?;
    let kept = store
        .get(Kind::ConfigMap, Some(&ns), "frozen")
        .await?
        .context("the immutable ConfigMap is gone")?;
    ensure!(
        kept["data"]["k"] == "v",
        "an immutable ConfigMap changed: {kept}"
    );

    store.delete(Kind::ConfigMap, Some(&ns), "settings").await?;
    expect_events(
        &mut watch,
        &[
            format!("Added {ns}/frozen"),
            format!("Deleted {ns}/settings"),
        ],
    )
    .await?;
    ensure!(
        store
            .get(Kind::ConfigMap, Some(&ns), "settings")
            .await?
            .is_none(),
        "deleted, yet still there"
    );
    Ok(())
}
