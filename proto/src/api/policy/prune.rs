//! `pruneObjectBehavior`: which objects to delete when a ConfigurationPolicy is removed from a
//! cluster, or stops naming objects it named before. Pure, in the evaluator's two steps: the
//! agent reads what [`prune_reads`] lists and passes the answers to [`prune_actions`].
//!
//! As in OCM, pruning happens only under `enforce`; `DeleteAll` deletes every object the
//! policy related to that still exists, `DeleteIfCreated` only those the policy created and
//! that still have the uid they were created with (a same-named object someone made since is
//! not the policy's).

use std::collections::BTreeMap;

use serde_json::Value;

use super::evaluate::{EnforceAction, ObjectRead, Observed};
use super::types::{PruneObjectBehavior, RelatedObject, RemediationAction};

fn read_of(related: &RelatedObject) -> ObjectRead {
    let meta = &related.object.metadata;
    ObjectRead {
        api_version: related.object.api_version.clone(),
        kind: related.object.kind.clone(),
        namespace: (!meta.namespace.is_empty()).then(|| meta.namespace.clone()),
        name: Some(meta.name.clone()),
    }
}

/// The related objects to prune candidates of: those in `previous` (the policy's last
/// `relatedObjects`) that are not in `current` (empty when the policy itself is removed),
/// without the `-` placeholders of templates that matched nothing.
fn candidates<'a>(
    previous: &'a [RelatedObject],
    current: &[RelatedObject],
) -> impl Iterator<Item = &'a RelatedObject> {
    let current: Vec<ObjectRead> = current.iter().map(read_of).collect();
    previous.iter().filter(move |r| {
        r.object.metadata.name != "-" && !r.object.metadata.name.is_empty() && {
            let read = read_of(r);
            !current.contains(&read)
        }
    })
}

/// The GETs [`prune_actions`] needs; none when nothing would be pruned.
pub fn prune_reads(
    behavior: PruneObjectBehavior,
    remediation: RemediationAction,
    previous: &[RelatedObject],
    current: &[RelatedObject],
) -> Vec<ObjectRead> {
    if remediation != RemediationAction::Enforce || behavior == PruneObjectBehavior::None {
        return Vec::new();
    }
    candidates(previous, current).map(read_of).collect()
}

/// The deletes pruning must make, given the answers to [`prune_reads`]. Objects already gone,
/// already being deleted, or not read are left alone.
pub fn prune_actions(
    behavior: PruneObjectBehavior,
    remediation: RemediationAction,
    previous: &[RelatedObject],
    current: &[RelatedObject],
    observed: &BTreeMap<ObjectRead, Observed>,
) -> Vec<EnforceAction> {
    if remediation != RemediationAction::Enforce || behavior == PruneObjectBehavior::None {
        return Vec::new();
    }
    let mut actions = Vec::new();
    for related in candidates(previous, current) {
        let read = read_of(related);
        let Some(Observed::Object(Some(existing))) = observed.get(&read) else {
            continue;
        };
        if existing.pointer("/metadata/deletionTimestamp").is_some() {
            continue;
        }
        let ours = match behavior {
            PruneObjectBehavior::DeleteAll => true,
            PruneObjectBehavior::DeleteIfCreated => related.properties.as_ref().is_some_and(|p| {
                p.created_by_policy == Some(true)
                    && existing.pointer("/metadata/uid").and_then(Value::as_str)
                        == Some(p.uid.as_str())
            }),
            PruneObjectBehavior::None => false,
        };
        if ours {
            actions.push(EnforceAction::Delete {
                api_version: read.api_version,
                kind: read.kind,
                namespace: read.namespace,
                name: related.object.metadata.name.clone(),
            });
        }
    }
    actions
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::api::policy::{ObjectProperties, RelatedObjectMeta, RelatedObjectResource};

    fn related(name: &str, created_uid: Option<&str>) -> RelatedObject {
        RelatedObject {
            object: RelatedObjectResource {
                api_version: "v1".to_string(),
                kind: "ConfigMap".to_string(),
                metadata: RelatedObjectMeta {
                    name: name.to_string(),
                    namespace: "default".to_string(),
                },
            },
            compliant: "Compliant".to_string(),
            reason: "Resource found as expected".to_string(),
            properties: created_uid.map(|uid| ObjectProperties {
                created_by_policy: Some(true),
                uid: uid.to_string(),
            }),
        }
    }

    /// The cluster: `made` (created by the policy, uid u-1), `theirs` (there before), and
    /// `remade` (created by the policy as u-2, since deleted and made again by someone as u-3).
    fn cluster(reads: &[ObjectRead]) -> BTreeMap<ObjectRead, Observed> {
        let uids = [("made", "u-1"), ("theirs", "u-9"), ("remade", "u-3")];
        reads
            .iter()
            .map(|r| {
                let name = r.name.as_deref().unwrap();
                let found = uids.iter().find(|(n, _)| *n == name).map(|(n, uid)| {
                    json!({"apiVersion": "v1", "kind": "ConfigMap",
                           "metadata": {"name": n, "namespace": "default", "uid": uid}})
                });
                (r.clone(), Observed::Object(found))
            })
            .collect()
    }

    fn deleted(
        behavior: PruneObjectBehavior,
        remediation: RemediationAction,
        previous: &[RelatedObject],
        current: &[RelatedObject],
    ) -> Vec<String> {
        let reads = prune_reads(behavior, remediation, previous, current);
        prune_actions(behavior, remediation, previous, current, &cluster(&reads))
            .into_iter()
            .map(|a| match a {
                EnforceAction::Delete { name, .. } => name,
                other => panic!("pruning only deletes: {other:?}"),
            })
            .collect()
    }

    #[test]
    fn prune_behaviours() {
        let previous = [
            related("made", Some("u-1")),
            related("theirs", None),
            related("remade", Some("u-2")),
            related("gone", Some("u-4")),
        ];
        use PruneObjectBehavior::{DeleteAll, DeleteIfCreated};
        use RemediationAction::{Enforce, Inform};
        assert_eq!(
            deleted(DeleteIfCreated, Enforce, &previous, &[]),
            vec!["made"]
        );
        assert_eq!(
            deleted(DeleteAll, Enforce, &previous, &[]),
            vec!["made", "theirs", "remade"]
        );
        assert_eq!(
            deleted(PruneObjectBehavior::None, Enforce, &previous, &[]),
            Vec::<String>::new()
        );
        assert_eq!(
            deleted(DeleteAll, Inform, &previous, &[]),
            Vec::<String>::new()
        );
        // Objects the policy still relates to stay.
        assert_eq!(
            deleted(
                DeleteAll,
                Enforce,
                &previous,
                &[related("made", Some("u-1"))]
            ),
            vec!["theirs", "remade"]
        );
    }
}
