//! Records the cache's tests store.

use super::records::{AppliedResource, CachedWork};

pub(super) fn work(uid: &str, generation: i64) -> CachedWork {
    CachedWork {
        uid: uid.into(),
        namespace: "store-7".into(),
        name: format!("work-{uid}"),
        generation,
        content_hash: format!("hash-{generation}"),
        refused: None,
        deleting: false,
        policy: false,
    }
}

pub(super) fn deployment(name: &str) -> AppliedResource {
    AppliedResource {
        group: "apps".into(),
        version: "v1".into(),
        kind: "Deployment".into(),
        resource: "deployments".into(),
        namespace: "default".into(),
        name: name.into(),
    }
}
