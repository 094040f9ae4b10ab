//! The spoke's kube-apiserver as an [`ApplyTarget`], through kube-rs: kinds resolved by
//! discovery (cached per group version), server-side apply, create, replace, delete,
//! SubjectAccessReviews, impersonated dry runs, and watches.

use std::collections::HashMap;
use std::fmt;

use async_trait::async_trait;
use futures::stream::{BoxStream, StreamExt as _};
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::api::{
    Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams, TypeMeta,
};
use kube::core::{ApiResource, GroupVersionKind};
use kube::runtime::{WatchStreamExt as _, watcher};
use serde_json::Value;
use tokio::sync::RwLock;
use tracing::debug;

use super::target::{
    AccessCheck, ApplyError, ApplyTarget, Deletion, ObjectEvent, ResourceKind, split_api_version,
};
use crate::cache::AppliedResource;

/// Objects asked for per page of a list.
const LIST_PAGE: u32 = 500;

/// The spoke's kube-apiserver as an [`ApplyTarget`]: server-side apply as
/// [`FIELD_MANAGER`](super::target::FIELD_MANAGER)
/// with force (OCM's ServerSideApply strategy), kinds resolved through discovery.
pub struct KubeApplyTarget {
    client: kube::Client,
    /// apiVersion → kind → resource, filled one group version at a time (one request serves
    /// every kind of it). A kind missing from a cached group version refreshes that group
    /// version, so CRDs installed later are found; a 404 on an object evicts its group version
    /// in case the CRD went away.
    kinds: RwLock<HashMap<String, HashMap<String, ResourceKind>>>,
}

impl fmt::Debug for KubeApplyTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KubeApplyTarget").finish_non_exhaustive()
    }
}

impl KubeApplyTarget {
    /// A target on the spoke `client` talks to.
    pub fn new(client: kube::Client) -> Self {
        Self {
            client,
            kinds: RwLock::new(HashMap::new()),
        }
    }

    async fn cached(&self, api_version: &str, kind: &str) -> Option<ResourceKind> {
        self.kinds.read().await.get(api_version)?.get(kind).cloned()
    }

    async fn discover(
        &self,
        api_version: &str,
    ) -> Result<HashMap<String, ResourceKind>, kube::Error> {
        let list = if api_version.contains('/') {
            self.client.list_api_group_resources(api_version).await?
        } else {
            self.client.list_core_api_resources(api_version).await?
        };
        let (group, version) = split_api_version(api_version);
        Ok(list
            .resources
            .into_iter()
            // `deployments/status` and the like are subresources, not kinds to apply.
            .filter(|r| !r.name.contains('/'))
            .map(|r| {
                let kind = ResourceKind {
                    group: group.clone(),
                    version: version.clone(),
                    kind: r.kind.clone(),
                    resource: r.name,
                    namespaced: r.namespaced,
                };
                (r.kind, kind)
            })
            .collect())
    }

    fn api(&self, resource: &AppliedResource) -> Api<DynamicObject> {
        let gvk = GroupVersionKind::gvk(&resource.group, &resource.version, &resource.kind);
        let ar = ApiResource::from_gvk_with_plural(&gvk, &resource.resource);
        if resource.namespace.is_empty() {
            Api::all_with(self.client.clone(), &ar)
        } else {
            Api::namespaced_with(self.client.clone(), &resource.namespace, &ar)
        }
    }

    /// The object a write stored, or the write's error (a 404 forgets the kind's discovery).
    async fn stored(
        &self,
        resource: &AppliedResource,
        result: Result<DynamicObject, kube::Error>,
    ) -> Result<Value, ApplyError> {
        match result {
            Ok(object) => to_json(object),
            Err(e) => {
                self.evict_on_not_found(resource, &e).await;
                Err(spoke_error(e))
            }
        }
    }

    async fn evict_on_not_found(&self, resource: &AppliedResource, error: &kube::Error) {
        if let kube::Error::Api(status) = error
            && status.code == 404
        {
            self.kinds.write().await.remove(&resource.api_version());
        }
    }
}

fn to_json(object: DynamicObject) -> Result<Value, ApplyError> {
    serde_json::to_value(object)
        .map_err(|e| ApplyError::Unreachable(format!("the spoke sent an unreadable object: {e}")))
}

fn spoke_error(error: kube::Error) -> ApplyError {
    match error {
        kube::Error::Api(status) => ApplyError::Rejected {
            code: status.code,
            reason: status.reason,
            message: status.message,
        },
        other => ApplyError::Unreachable(other.to_string()),
    }
}

#[async_trait]
impl ApplyTarget for KubeApplyTarget {
    async fn resolve(&self, api_version: &str, kind: &str) -> Result<ResourceKind, ApplyError> {
        if let Some(found) = self.cached(api_version, kind).await {
            return Ok(found);
        }
        let unknown = |detail: String| ApplyError::UnknownKind {
            api_version: api_version.to_owned(),
            kind: kind.to_owned(),
            detail,
        };
        let kinds = match self.discover(api_version).await {
            Ok(kinds) => kinds,
            Err(kube::Error::Api(status)) if status.code == 404 => {
                return Err(unknown(format!(
                    "the apiserver does not serve {api_version} ({})",
                    status.message
                )));
            }
            Err(e) => return Err(spoke_error(e)),
        };
        let found = kinds.get(kind).cloned();
        self.kinds
            .write()
            .await
            .insert(api_version.to_owned(), kinds);
        found.ok_or_else(|| unknown(format!("{api_version} has no kind {kind}")))
    }

    async fn apply(
        &self,
        resource: &AppliedResource,
        manifest: &Value,
        field_manager: &str,
        force: bool,
    ) -> Result<Value, ApplyError> {
        let mut params = PatchParams::apply(field_manager);
        params.force = force;
        let result = self
            .api(resource)
            .patch(&resource.name, &params, &Patch::Apply(manifest))
            .await;
        self.stored(resource, result).await
    }

    async fn create(
        &self,
        resource: &AppliedResource,
        object: &Value,
        field_manager: &str,
    ) -> Result<Value, ApplyError> {
        let object: DynamicObject =
            serde_json::from_value(object.clone()).map_err(|e| ApplyError::Rejected {
                code: 400,
                reason: "BadRequest".into(),
                message: format!("the manifest is not a Kubernetes object: {e}"),
            })?;
        let params = PostParams {
            field_manager: Some(field_manager.to_owned()),
            ..PostParams::default()
        };
        let result = self.api(resource).create(&params, &object).await;
        self.stored(resource, result).await
    }

    async fn replace(
        &self,
        resource: &AppliedResource,
        object: &Value,
        field_manager: &str,
    ) -> Result<Value, ApplyError> {
        let object: DynamicObject =
            serde_json::from_value(object.clone()).map_err(|e| ApplyError::Rejected {
                code: 400,
                reason: "BadRequest".into(),
                message: format!("the manifest is not a Kubernetes object: {e}"),
            })?;
        let params = PostParams {
            field_manager: Some(field_manager.to_owned()),
            ..PostParams::default()
        };
        let result = self
            .api(resource)
            .replace(&resource.name, &params, &object)
            .await;
        self.stored(resource, result).await
    }

    async fn get(&self, resource: &AppliedResource) -> Result<Option<Value>, ApplyError> {
        match self.api(resource).get_opt(&resource.name).await {
            Ok(found) => found.map(to_json).transpose(),
            Err(e) => Err(spoke_error(e)),
        }
    }

    async fn list(
        &self,
        kind: &ResourceKind,
        namespace: Option<&str>,
        limit: usize,
    ) -> Result<Vec<Value>, ApplyError> {
        let gvk = GroupVersionKind::gvk(&kind.group, &kind.version, &kind.kind);
        let ar = ApiResource::from_gvk_with_plural(&gvk, &kind.resource);
        let api: Api<DynamicObject> = match namespace {
            Some(ns) => Api::namespaced_with(self.client.clone(), ns, &ar),
            None => Api::all_with(self.client.clone(), &ar),
        };
        let mut objects = Vec::new();
        let mut params = ListParams::default().limit(LIST_PAGE);
        // Pages, so that the apiserver never sends more than one page beyond the bound.
        loop {
            let page = api.list(&params).await.map_err(spoke_error)?;
            for mut object in page.items {
                object.types = Some(TypeMeta {
                    api_version: ar.api_version.clone(),
                    kind: ar.kind.clone(),
                });
                objects.push(to_json(object)?);
            }
            if objects.len() > limit {
                return Err(ApplyError::TooMany {
                    resource: kind.resource.clone(),
                    location: namespace
                        .map(|ns| format!(" in namespace {ns}"))
                        .unwrap_or_default(),
                    limit,
                });
            }
            match page.metadata.continue_.filter(|c| !c.is_empty()) {
                Some(token) => params = params.continue_token(&token),
                None => return Ok(objects),
            }
        }
    }

    async fn exists(&self, resource: &AppliedResource) -> Result<bool, ApplyError> {
        match self.api(resource).get_metadata_opt(&resource.name).await {
            Ok(found) => Ok(found.is_some()),
            Err(e) => Err(spoke_error(e)),
        }
    }

    async fn review_access(&self, check: &AccessCheck) -> Result<bool, ApplyError> {
        let r = &check.resource;
        let review = SubjectAccessReview {
            spec: SubjectAccessReviewSpec {
                user: Some(check.user.clone()),
                groups: Some(check.groups.clone()),
                resource_attributes: Some(ResourceAttributes {
                    group: Some(r.group.clone()),
                    version: Some(r.version.clone()),
                    resource: Some(r.resource.clone()),
                    namespace: (!r.namespace.is_empty()).then(|| r.namespace.clone()),
                    name: Some(r.name.clone()),
                    verb: Some(check.verb.clone()),
                    ..ResourceAttributes::default()
                }),
                ..SubjectAccessReviewSpec::default()
            },
            ..SubjectAccessReview::default()
        };
        let api: Api<SubjectAccessReview> = Api::all(self.client.clone());
        match api.create(&PostParams::default(), &review).await {
            Ok(answer) => Ok(answer.status.is_some_and(|s| s.allowed)),
            Err(e) => Err(spoke_error(e)),
        }
    }

    async fn dry_run_as(
        &self,
        user: &str,
        resource: &AppliedResource,
        manifest: &Value,
        field_manager: &str,
    ) -> Result<(), ApplyError> {
        let params = PatchParams::apply(field_manager).force().dry_run();
        let api = self.api(resource);
        let bad = |message: String| ApplyError::Rejected {
            code: 400,
            reason: "BadRequest".into(),
            message,
        };
        let mut request = kube::core::Request::new(api.resource_url())
            .patch(&resource.name, &params, &Patch::Apply(manifest))
            .map_err(|e| bad(format!("cannot build the dry run: {e}")))?;
        // Without Impersonate-Group the apiserver gives a service account its own groups
        // (system:serviceaccounts, system:serviceaccounts:<namespace>), so the agent needs
        // impersonate on serviceaccounts only.
        let value = http::HeaderValue::from_str(user)
            .map_err(|_| bad(format!("{user:?} cannot be impersonated")))?;
        request.headers_mut().insert("Impersonate-User", value);
        let result = self.client.request::<DynamicObject>(request).await;
        self.stored(resource, result).await.map(drop)
    }

    fn watch(&self, kind: &ResourceKind) -> BoxStream<'static, ObjectEvent> {
        let gvk = GroupVersionKind::gvk(&kind.group, &kind.version, &kind.kind);
        let ar = ApiResource::from_gvk_with_plural(&gvk, &kind.resource);
        let api: Api<DynamicObject> = Api::all_with(self.client.clone(), &ar);
        let what = format!("{}/{}", kind.group, kind.resource);
        // The watcher lists, then watches from the list's version, re-lists on `410 Gone`, and
        // backs off on errors (kube-runtime's default backoff); an error only delays events.
        watcher::watcher(api, watcher::Config::default())
            .default_backoff()
            .filter_map(move |event| {
                let what = what.clone();
                async move {
                    match event {
                        Ok(watcher::Event::Apply(obj) | watcher::Event::InitApply(obj)) => {
                            to_json(obj).ok().map(ObjectEvent::Changed)
                        }
                        Ok(watcher::Event::Delete(obj)) => Some(ObjectEvent::Deleted {
                            namespace: obj.metadata.namespace.unwrap_or_default(),
                            name: obj.metadata.name.unwrap_or_default(),
                        }),
                        Ok(watcher::Event::InitDone) => Some(ObjectEvent::Listed),
                        Ok(watcher::Event::Init) => None,
                        Err(e) => {
                            debug!(resource = %what, error = %e, "watch of applied objects interrupted; resuming");
                            None
                        }
                    }
                }
            })
            .boxed()
    }

    async fn delete(&self, resource: &AppliedResource) -> Result<Deletion, ApplyError> {
        // Background, not Foreground: the object goes at once and the garbage collector removes
        // its dependents. Foreground would park the object behind a finalizer only the garbage
        // collector removes, and the work's tombstone with it.
        match self
            .api(resource)
            .delete(&resource.name, &DeleteParams::background())
            .await
        {
            Ok(either) => match either.left() {
                Some(obj)
                    if obj.metadata.deletion_timestamp.is_some()
                        && !obj.metadata.finalizers.as_ref().is_none_or(Vec::is_empty) =>
                {
                    Ok(Deletion::Terminating)
                }
                _ => Ok(Deletion::Gone),
            },
            Err(kube::Error::Api(status)) if status.code == 404 => Ok(Deletion::Gone),
            Err(e) => Err(spoke_error(e)),
        }
    }
}
