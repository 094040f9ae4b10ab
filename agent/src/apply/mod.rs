//! Applying a work's manifests to the spoke cluster, and removing them.
//!
//! The engine (`engine`: [`plan_manifests`], [`apply_planned`]) is written against
//! [`ApplyTarget`] (`target`), the
//! few calls it needs from a cluster: resolve a kind, server-side apply, check existence, delete.
//! [`KubeApplyTarget`] is the real one (kube-rs against the spoke apiserver);
//! [`MemoryCluster`] is an in-memory one for unit tests and for the load-test's simulated
//! clusters.
//!
//! Semantics follow OCM's work agent: manifests are applied in order, Namespaces and CRDs first;
//! each manifest gets its own result, and one failing manifest never stops the others; the
//! spoke apiserver's error is reported verbatim.

mod engine;
mod kube;
mod managers;
pub(crate) mod memory;
pub(crate) mod target;
#[cfg(test)]
mod tests;

pub use engine::{
    ApplyContext, Availability, CONFIG_SPEC_HASH_ANNOTATION, ManifestOutcome, OCM_FIELD_MANAGER,
    PlannedManifest, StatusRules, WriteStrategy, apply_order, apply_planned, find_config,
    identifies, orphans, plan_manifests,
};
pub use kube::KubeApplyTarget;
pub use managers::{
    FieldConflict, FieldManagers, HubNameError, MAX_HUB_NAME, POLICY_MANAGER_PREFIX,
    PolicyWritesAs, WORK_MANAGER_PREFIX, parse_conflicts,
};
pub use memory::MemoryCluster;
pub use target::{
    AccessCheck, ApplyError, ApplyTarget, Deletion, FIELD_MANAGER, ManifestFailure, ObjectEvent,
    REASON_APPLY_CONFLICT, REASON_APPLY_FAILED, REASON_IGNORE_FIELD_ERROR, ResourceKind,
};
