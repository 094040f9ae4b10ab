//! Typed access on top of any [`Store`]: `flotilla_proto::api` types in, the same types out.
//!
//! The store itself keeps JSON (so both backends hold exactly what `kubectl` shows, and objects
//! with fields this build does not know survive); this layer converts at the edge, with the kind
//! taken from the type ([`Stored::KIND`]).

use async_trait::async_trait;
use flotilla_proto::api::Stored;
use serde::Serialize;

use crate::object::{name_of, namespace_of};
use crate::{Object, Revision, Store, StoreError};

/// Typed versions of the [`Store`] calls, for every store (`store.get_typed::<ManifestWork>(..)`).
#[async_trait]
pub trait StoreExt: Store {
    async fn get_typed<K: Stored + Send + Sync>(
        &self,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<Option<K>, StoreError> {
        self.get(K::KIND, namespace, name)
            .await?
            .map(decode::<K>)
            .transpose()
    }

    /// Every object of the type in `namespace` (or all namespaces) and the revision to watch from.
    async fn list_typed<K: Stored + Send + Sync>(
        &self,
        namespace: Option<&str>,
    ) -> Result<(Vec<K>, Revision), StoreError> {
        let list = self.list(K::KIND, namespace).await?;
        let items = list
            .items
            .into_iter()
            .map(decode::<K>)
            .collect::<Result<_, _>>()?;
        Ok((items, list.revision))
    }

    async fn create_typed<K: Stored + Send + Sync>(&self, object: &K) -> Result<K, StoreError> {
        let object = encode(object)?;
        decode(self.create(object).await?)
    }

    async fn update_spec_typed<K: Stored + Send + Sync>(
        &self,
        object: &K,
    ) -> Result<K, StoreError> {
        let object = encode(object)?;
        decode(self.update_spec(object).await?)
    }

    async fn update_status_typed<K: Stored + Send + Sync, S: Serialize + Sync>(
        &self,
        namespace: Option<&str>,
        name: &str,
        status: &S,
        expected: Option<&Revision>,
    ) -> Result<K, StoreError> {
        let status = serde_json::to_value(status).map_err(|e| {
            StoreError::invalid(
                K::KIND.name(),
                namespace,
                name,
                format!("status does not encode: {e}"),
            )
        })?;
        decode(
            self.update_status(K::KIND, namespace, name, status, expected)
                .await?,
        )
    }
}

impl<S: Store + ?Sized> StoreExt for S {}

fn encode<K: Stored>(object: &K) -> Result<Object, StoreError> {
    serde_json::to_value(object).map_err(|e| {
        StoreError::invalid(
            K::KIND.name(),
            object.meta().namespace.as_deref(),
            object.meta().name.as_deref().unwrap_or(""),
            format!("does not encode as JSON: {e}"),
        )
    })
}

/// A stored object that does not decode as its type was written by something newer or broken:
/// a backend problem for this reader, not the caller's fault.
fn decode<K: Stored>(object: Object) -> Result<K, StoreError> {
    let key = match namespace_of(&object) {
        Some(ns) => format!("{ns}/{}", name_of(&object)),
        None => name_of(&object).to_owned(),
    };
    serde_json::from_value(object)
        .map_err(|e| StoreError::backend(format!("decoding {} {key}", K::KIND), e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SledStore;
    use flotilla_proto::api::{ManagedCluster, ManifestWork};
    use serde_json::json;

    #[tokio::test]
    async fn typed_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let store = SledStore::open(dir.path()).unwrap();
        let work: ManifestWork = serde_json::from_value(json!({
            "apiVersion": "work.open-cluster-management.io/v1",
            "kind": "ManifestWork",
            "metadata": {"name": "baseline", "namespace": "store-7"},
            "spec": {"workload": {"manifests": [{"apiVersion": "v1", "kind": "ConfigMap",
                     "metadata": {"name": "c", "namespace": "default"}}]}},
        }))
        .unwrap();
        let created = store.create_typed(&work).await.unwrap();
        assert_eq!(created.spec, work.spec);
        assert_eq!(created.metadata.generation, Some(1));
        let got: ManifestWork = store
            .get_typed(Some("store-7"), "baseline")
            .await
            .unwrap()
            .unwrap();
        assert_eq!(got, created);
        let (all, _) = store.list_typed::<ManifestWork>(None).await.unwrap();
        assert_eq!(all, vec![created]);
        let none: Option<ManagedCluster> = store.get_typed(None, "store-7").await.unwrap();
        assert!(none.is_none());
    }
}
