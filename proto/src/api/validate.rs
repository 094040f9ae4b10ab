//! Checks on a ManifestWork before it is stored or delivered, so that a bad manifest is refused
//! with a message naming the work and the manifest instead of failing later on the spoke.

use super::clusterset::ManagedClusterSet;
use super::content::ContentRef;
use super::placement::{Placement, SortBy};
use super::work::{Manifest, ManifestConfigOption, ManifestWork};

/// Largest total size of a work's manifests, in bytes of compact JSON. The stores hold objects up
/// to 1.5 MiB (etcd's request limit); 1 MiB of manifests leaves room within it for metadata and
/// the per-resource status the agent reports into the same object. (OCM's webhook stops at
/// 500 KiB, so everything that works on OCM works here.)
pub const MAX_WORKLOAD_BYTES: usize = 1024 * 1024;

/// One problem with a ManifestWork. None is retryable: the work must be fixed and re-applied.
///
/// `ordinal` is the manifest's index in `spec.workload.manifests` counting from 0, the same
/// number as `status.resourceStatus.manifests[].resourceMeta.ordinal`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ManifestError {
    /// The work has no manifests at all (OCM refuses these too). Not retryable.
    #[error("ManifestWork {work}: spec.workload.manifests is empty; add at least one manifest")]
    NoManifests { work: String },
    /// The manifests together exceed [`MAX_WORKLOAD_BYTES`]. Not retryable: split the work.
    #[error(
        "ManifestWork {work}: manifests take {bytes} bytes, more than the {limit} one object holds; create it with `flotilla work create -f` (or `apply -f`), which stores larger works in chunks, or split them over several ManifestWorks"
    )]
    TooLarge {
        work: String,
        bytes: usize,
        limit: usize,
    },
    /// The work's `ChunkedManifests` reference is malformed. Not retryable: re-create the work
    /// with `flotilla work create -f`.
    #[error("ManifestWork {work}: {problem}")]
    Content { work: String, problem: String },
    /// A manifest is not a JSON/YAML object (e.g. a string or a list). Not retryable.
    #[error("ManifestWork {work}: manifest #{ordinal} is not an object")]
    NotAnObject { work: String, ordinal: usize },
    /// A manifest has no non-empty string `apiVersion`. Not retryable.
    #[error("ManifestWork {work}: manifest #{ordinal} has no apiVersion")]
    MissingApiVersion { work: String, ordinal: usize },
    /// A manifest has no non-empty string `kind`. Not retryable.
    #[error("ManifestWork {work}: manifest #{ordinal} has no kind")]
    MissingKind { work: String, ordinal: usize },
    /// A manifest has no non-empty string `metadata.name` (`generateName` is not enough: the
    /// agent must find the object again to update, report on and delete it). Not retryable.
    #[error("ManifestWork {work}: manifest #{ordinal} has no metadata.name")]
    MissingName { work: String, ordinal: usize },
    /// An entry of `spec.manifestConfigs` asks for something OCM does not define (the rules
    /// OCM's CRD and webhook enforce). Not retryable.
    #[error("ManifestWork {work}: spec.manifestConfigs[{index}]: {problem}")]
    Config {
        work: String,
        index: usize,
        problem: String,
    },
    /// `spec.executor` or `spec.deleteOption` is not usable. Not retryable.
    #[error("ManifestWork {work}: {field}: {problem}")]
    Spec {
        work: String,
        field: &'static str,
        problem: String,
    },
}

/// A field of OCM's that flotilla carries but does not implement, set to a value that would
/// need it: refused rather than silently ignored.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UnsupportedField {
    /// Not retryable: remove the field, or set it to OCM's default, and apply again.
    #[error("{kind} {object}: {field}: {problem}; flotilla does not implement it yet")]
    NotImplemented {
        kind: &'static str,
        object: String,
        field: &'static str,
        problem: String,
    },
}

/// OCM's default `scoreRateLimit`, the one value flotilla accepts (its scheduler does not
/// rate-limit rescheduling on score changes; OCM's default is what a placement gets that says
/// nothing).
const DEFAULT_SCORE_RATE_LIMIT: &str = "1m";

/// Refuses the Placement fields flotilla does not implement: `sortBy: Score` and a
/// `scoreRateLimit` other than OCM's default.
pub fn validate_placement(placement: &Placement) -> Result<(), Vec<UnsupportedField>> {
    let object = super::object_name(
        placement.metadata.namespace.as_deref(),
        placement.metadata.name.as_deref(),
    );
    let unsupported = |field, problem: String| UnsupportedField::NotImplemented {
        kind: "Placement",
        object: object.clone(),
        field,
        problem,
    };
    let mut errors = Vec::new();
    if placement.spec.sort_by == Some(SortBy::Score) {
        errors.push(unsupported(
            "spec.sortBy",
            "Score orders decisions by score; use ClusterName (the default)".to_owned(),
        ));
    }
    if let Some(limit) = placement
        .spec
        .score_rate_limit
        .as_deref()
        .filter(|l| *l != DEFAULT_SCORE_RATE_LIMIT)
    {
        errors.push(unsupported(
            "spec.scoreRateLimit",
            format!(
                "{limit:?} rate-limits rescheduling on score changes; leave it out or use \
                 {DEFAULT_SCORE_RATE_LIMIT:?}"
            ),
        ));
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors)
    }
}

/// Refuses the ManagedClusterSet fields flotilla does not implement: `spec.managedNamespaces`.
pub fn validate_cluster_set(set: &ManagedClusterSet) -> Result<(), UnsupportedField> {
    if set.spec.managed_namespaces.is_empty() {
        return Ok(());
    }
    let names: Vec<&str> = set
        .spec
        .managed_namespaces
        .iter()
        .map(|n| n.name.as_str())
        .collect();
    Err(UnsupportedField::NotImplemented {
        kind: "ManagedClusterSet",
        object: super::object_name(None, set.metadata.name.as_deref()),
        field: "spec.managedNamespaces",
        problem: format!("{names:?} asks for namespaces on every member cluster; leave it out"),
    })
}

/// Checks every manifest of `work`; returns all the problems found, not just the first.
pub fn validate_manifest_work(work: &ManifestWork) -> Result<(), Vec<ManifestError>> {
    let name = work_name(work);
    let manifests = &work.spec.workload.manifests;
    let mut errors = Vec::new();
    if manifests.is_empty() {
        errors.push(ManifestError::NoManifests { work: name.clone() });
    }
    // A chunked work's one manifest stands for content stored beside it: it is checked as a
    // reference here, and the manifests themselves where the content is joined (the CLI before
    // storing them, the agent before applying them).
    match ContentRef::of(work) {
        Some(Ok(_)) => {}
        Some(Err(e)) => errors.push(ManifestError::Content {
            work: name.clone(),
            problem: e.to_string(),
        }),
        None => {
            let bytes: usize = manifests.iter().map(|m| m.0.to_string().len()).sum();
            if bytes > MAX_WORKLOAD_BYTES {
                errors.push(ManifestError::TooLarge {
                    work: name.clone(),
                    bytes,
                    limit: MAX_WORKLOAD_BYTES,
                });
            }
            for (ordinal, manifest) in manifests.iter().enumerate() {
                check_manifest(&name, ordinal, manifest, &mut errors);
            }
        }
    }
    for (index, config) in work.spec.manifest_configs.iter().enumerate() {
        for problem in config_problems(config) {
            errors.push(ManifestError::Config {
                work: name.clone(),
                index,
                problem,
            });
        }
    }
    if let Some(executor) = &work.spec.executor {
        let subject = &executor.subject;
        let problem = if subject.type_ != "ServiceAccount" {
            Some(format!(
                "subject type {:?} is not supported; use ServiceAccount",
                subject.type_
            ))
        } else if subject
            .service_account
            .as_ref()
            .is_none_or(|sa| sa.namespace.is_empty() || sa.name.is_empty())
        {
            Some("a ServiceAccount subject needs serviceAccount.namespace and .name".to_owned())
        } else {
            None
        };
        if let Some(problem) = problem {
            errors.push(ManifestError::Spec {
                work: name.clone(),
                field: "spec.executor",
                problem,
            });
        }
    }
    if let Some(ttl) = work
        .spec
        .delete_option
        .as_ref()
        .and_then(|o| o.ttl_seconds_after_finished)
        .filter(|ttl| *ttl < 0)
    {
        errors.push(ManifestError::Spec {
            work: name.clone(),
            field: "spec.deleteOption.ttlSecondsAfterFinished",
            problem: format!("{ttl} is negative; use 0 or more seconds"),
        });
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors)
    }
}

/// What is wrong with one `manifestConfigs` entry, as OCM's CRD validation would say it.
fn config_problems(config: &ManifestConfigOption) -> Vec<String> {
    let mut problems = Vec::new();
    if let Some(ssa) = config
        .update_strategy
        .as_ref()
        .and_then(|u| u.server_side_apply.as_ref())
    {
        if !ssa.field_manager.is_empty() && !ssa.field_manager.starts_with("work-agent") {
            problems.push(format!(
                "updateStrategy.serverSideApply.fieldManager {:?} must start with \"work-agent\"",
                ssa.field_manager
            ));
        }
        for field in &ssa.ignore_fields {
            if !matches!(field.condition.as_str(), "OnSpokePresent" | "OnSpokeChange") {
                problems.push(format!(
                    "ignoreFields condition {:?} must be OnSpokePresent or OnSpokeChange",
                    field.condition
                ));
            }
            if !field.jq_path_expressions.is_empty() {
                problems.push(format!(
                    "ignoreFields[{:?}].jqPathExpressions: flotilla does not implement jq \
                     expressions yet; use jsonPaths or jsonPointers",
                    field.condition
                ));
            } else if field.json_paths.is_empty() && field.json_pointers.is_empty() {
                problems.push(
                    "ignoreFields entries need at least one jsonPath or jsonPointer".to_owned(),
                );
            }
            for pointer in field.json_pointers.iter().filter(|p| !p.starts_with('/')) {
                problems.push(format!(
                    "ignoreFields jsonPointer {pointer:?} must start with \"/\" (RFC 6901)"
                ));
            }
        }
    }
    for rule in &config.condition_rules {
        match rule.type_.as_str() {
            "CEL" if rule.condition.is_empty() => {
                problems.push("condition is required for CEL rules".to_owned())
            }
            "CEL" if rule.cel_expressions.is_empty() => problems.push(format!(
                "CEL rule {:?} has no celExpressions",
                rule.condition
            )),
            "CEL" | "WellKnownConditions" | "WellKnownCompletions" => {}
            other => problems.push(format!(
                "conditionRules type {other:?} must be WellKnownConditions or CEL"
            )),
        }
    }
    problems
}

fn check_manifest(
    work: &str,
    ordinal: usize,
    manifest: &Manifest,
    errors: &mut Vec<ManifestError>,
) {
    let work = work.to_owned();
    if !manifest.0.is_object() {
        errors.push(ManifestError::NotAnObject { work, ordinal });
        return;
    }
    let present = |s: Option<&str>| s.is_some_and(|s| !s.is_empty());
    if !present(manifest.api_version()) {
        errors.push(ManifestError::MissingApiVersion {
            work: work.clone(),
            ordinal,
        });
    }
    if !present(manifest.kind()) {
        errors.push(ManifestError::MissingKind {
            work: work.clone(),
            ordinal,
        });
    }
    if !present(manifest.name()) {
        errors.push(ManifestError::MissingName { work, ordinal });
    }
}

/// `namespace/name` as people write it; just `name` when the work has no namespace yet.
fn work_name(work: &ManifestWork) -> String {
    super::object_name(
        work.metadata.namespace.as_deref(),
        work.metadata.name.as_deref(),
    )
}
