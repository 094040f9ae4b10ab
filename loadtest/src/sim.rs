//! The simulated spoke cluster behind each agent: the agent library's in-memory cluster, made
//! slow or flaky on request, counting what was applied.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use flotilla_agent::MemoryCluster;
use flotilla_agent::apply::{
    AccessCheck, ApplyError, ApplyTarget, Deletion, ObjectEvent, ResourceKind,
};
use flotilla_agent::cache::AppliedResource;
use futures::stream::BoxStream;
use rand::{Rng, SeedableRng};
use serde_json::Value;
use tokio::sync::Mutex;

/// How a simulated cluster misbehaves.
#[derive(Clone, Debug, Default)]
pub struct Faults {
    /// Time every apply takes.
    pub apply_delay: Duration,
    /// Fraction of applies that fail as if the apiserver were unreachable.
    pub failure_rate: f64,
    /// Names of objects this cluster refuses, as an apiserver's admission would: the agent
    /// reports the work Degraded, which is how the rollout scenario makes a cluster fail.
    pub rejects: Vec<String>,
}

/// A simulated spoke cluster.
#[derive(Debug)]
pub struct SimCluster {
    inner: MemoryCluster,
    faults: Faults,
    /// Decides which applies fail; seeded per agent, so a run is reproducible.
    rng: Mutex<rand::rngs::StdRng>,
    /// Applies that succeeded and that were failed on purpose.
    pub applied: AtomicU64,
    pub failed: AtomicU64,
}

impl SimCluster {
    pub fn new(faults: Faults, seed: u64) -> Arc<SimCluster> {
        let inner = MemoryCluster::new();
        for name in &faults.rejects {
            inner.reject_now(
                name,
                422,
                "denied by the cluster's admission policy (loadtest)",
            );
        }
        Arc::new(SimCluster {
            inner,
            faults,
            rng: Mutex::new(rand::rngs::StdRng::seed_from_u64(seed)),
            applied: AtomicU64::new(0),
            failed: AtomicU64::new(0),
        })
    }

    /// Objects present in the cluster.
    pub async fn objects(&self) -> usize {
        self.inner.objects().await.len()
    }

    /// Writes an object's status as the spoke's controllers would; `false` when it is absent.
    pub async fn set_status(&self, resource: &AppliedResource, status: Value) -> bool {
        self.inner.set_status(resource, status).await
    }

    /// The delay and injected failures every write goes through.
    async fn faulty_write(&self) -> Result<(), ApplyError> {
        if !self.faults.apply_delay.is_zero() {
            tokio::time::sleep(self.faults.apply_delay).await;
        }
        if self.faults.failure_rate > 0.0
            && self.rng.lock().await.random_bool(self.faults.failure_rate)
        {
            self.failed.fetch_add(1, Ordering::Relaxed);
            return Err(ApplyError::Unreachable(
                "injected failure (loadtest)".into(),
            ));
        }
        Ok(())
    }
}

#[async_trait]
impl ApplyTarget for SimCluster {
    async fn resolve(&self, api_version: &str, kind: &str) -> Result<ResourceKind, ApplyError> {
        self.inner.resolve(api_version, kind).await
    }

    async fn apply(
        &self,
        resource: &AppliedResource,
        manifest: &Value,
        field_manager: &str,
        force: bool,
    ) -> Result<Value, ApplyError> {
        self.faulty_write().await?;
        let stored = self
            .inner
            .apply(resource, manifest, field_manager, force)
            .await?;
        self.applied.fetch_add(1, Ordering::Relaxed);
        Ok(stored)
    }

    async fn create(
        &self,
        resource: &AppliedResource,
        object: &Value,
        field_manager: &str,
    ) -> Result<Value, ApplyError> {
        self.faulty_write().await?;
        let stored = self.inner.create(resource, object, field_manager).await?;
        self.applied.fetch_add(1, Ordering::Relaxed);
        Ok(stored)
    }

    async fn replace(
        &self,
        resource: &AppliedResource,
        object: &Value,
        field_manager: &str,
    ) -> Result<Value, ApplyError> {
        self.faulty_write().await?;
        let stored = self.inner.replace(resource, object, field_manager).await?;
        self.applied.fetch_add(1, Ordering::Relaxed);
        Ok(stored)
    }

    async fn get(&self, resource: &AppliedResource) -> Result<Option<Value>, ApplyError> {
        ApplyTarget::get(&self.inner, resource).await
    }

    async fn list(
        &self,
        kind: &ResourceKind,
        namespace: Option<&str>,
        limit: usize,
    ) -> Result<Vec<Value>, ApplyError> {
        self.inner.list(kind, namespace, limit).await
    }

    async fn exists(&self, resource: &AppliedResource) -> Result<bool, ApplyError> {
        self.inner.exists(resource).await
    }

    async fn delete(&self, resource: &AppliedResource) -> Result<Deletion, ApplyError> {
        self.inner.delete(resource).await
    }

    async fn review_access(&self, check: &AccessCheck) -> Result<bool, ApplyError> {
        self.inner.review_access(check).await
    }

    async fn dry_run_as(
        &self,
        user: &str,
        resource: &AppliedResource,
        manifest: &Value,
        field_manager: &str,
    ) -> Result<(), ApplyError> {
        self.inner
            .dry_run_as(user, resource, manifest, field_manager)
            .await
    }

    fn watch(&self, kind: &ResourceKind) -> BoxStream<'static, ObjectEvent> {
        self.inner.watch(kind)
    }
}
