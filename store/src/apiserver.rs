//! The scale-out backend: the OCM CRDs on a real kube-apiserver (`deploy/crds`).
//!
//! Each call maps onto one REST call (two for an unconditional spec update, which reads the
//! current resourceVersion first, and for a status write of a fenced kind without a current
//! basis, which reads the stored fencing record first): objects stay exactly what `kubectl get
//! -o json` shows, minus managedFields, which kubectl hides too.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use flotilla_ops::error_chain;
use flotilla_proto::api::Kind;
use flotilla_proto::contract::fence;
use futures::StreamExt;
use futures::stream::BoxStream;
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Client;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams,
    WatchEvent as KubeEvent, WatchParams,
};
use serde_json::{Value, json};
use tracing::{debug, info, warn};

use crate::fence as fencing;
use crate::object::{
    self, ObjectKey, check_scope, check_size, json_len, remove_meta, resource_version, set_meta,
};
use crate::{
    Basis, Object, ObjectList, Revision, Selection, Store, StoreError, WatchEvent, WatchStream,
    WriteFence,
};

/// How long the apiserver keeps one watch request open before closing it; the stream then
/// re-establishes itself from the last revision it saw. 290 s is kube-rs' and client-go's
/// default: under the apiserver's 5-minute cap, long enough to cost next to nothing.
pub const DEFAULT_WATCH_TIMEOUT_SECS: u32 = 290;

/// Read + write rounds an unconditional `update_spec`, a fenced write or a fenced kind's status
/// write tries before giving up with `Conflict`: more than this many writers racing on one
/// object is a bug upstream, not load.
const UPDATE_ATTEMPTS: usize = 5;

/// Items per list page: large lists come in pages from one consistent snapshot.
const LIST_PAGE_SIZE: u32 = 500;

/// How a list is asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Paging {
    /// In pages of [`LIST_PAGE_SIZE`]: every page after the first is read from etcd, a range
    /// of the whole kind filtered by the selector (the apiserver's watch cache serves only
    /// the first page).
    Paged,
    /// In one response, consistent, which the apiserver serves from its watch cache. For the
    /// selected lists of a gateway's shards: at 50,000 clusters a gateway's paged list of its
    /// 8,300 ManagedClusters took minutes on a busy apiserver, one unpaged list seconds.
    Whole,
}

/// Consecutive failures to (re)open a watch before the stream gives up with `Backend`.
const WATCH_REOPEN_ATTEMPTS: u32 = 5;

/// The [`Store`] on a kube-apiserver with flotilla's CRDs installed. Cheap to clone.
#[derive(Clone)]
pub struct KubeStore {
    client: Client,
    watch_timeout_secs: u32,
    /// How many times watch streams were re-established after the apiserver closed them;
    /// tests read it to see re-establishment happen.
    watch_restarts: Arc<AtomicU64>,
}

impl KubeStore {
    pub fn new(client: Client) -> Self {
        KubeStore {
            client,
            watch_timeout_secs: DEFAULT_WATCH_TIMEOUT_SECS,
            watch_restarts: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Sets how long one watch request stays open (see [`DEFAULT_WATCH_TIMEOUT_SECS`]).
    pub fn with_watch_timeout(mut self, secs: u32) -> Self {
        self.watch_timeout_secs = secs.max(1);
        self
    }

    /// How many times this store's watch streams were re-established after the apiserver
    /// closed them (normal every watch timeout; a steep rise means connection trouble).
    pub fn watch_restarts(&self) -> u64 {
        self.watch_restarts.load(Ordering::Relaxed)
    }

    fn api(&self, kind: Kind, namespace: Option<&str>) -> Api<DynamicObject> {
        let resource = api_resource(kind);
        match namespace {
            Some(ns) => Api::namespaced_with(self.client.clone(), ns, &resource),
            None => Api::all_with(self.client.clone(), &resource),
        }
    }

    /// Creates the namespace a namespaced object is meant for, as OCM's registration controller
    /// does for each cluster; one that exists already is fine.
    async fn create_namespace(&self, name: &str) -> Result<(), StoreError> {
        let namespaces: Api<Namespace> = Api::all(self.client.clone());
        let namespace = Namespace {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                ..ObjectMeta::default()
            },
            ..Namespace::default()
        };
        match namespaces.create(&PostParams::default(), &namespace).await {
            Ok(_) => {
                info!(namespace = name, "created namespace");
                Ok(())
            }
            Err(kube::Error::Api(status)) if status.code == 409 => Ok(()),
            Err(e) => Err(StoreError::backend(format!("creating namespace {name}"), e)),
        }
    }
}

/// Why no client for the hub apiserver could be built. Not retryable: fix the kubeconfig.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("cannot read kubeconfig {path}: {source}")]
    Kubeconfig {
        path: String,
        #[source]
        source: kube::config::KubeconfigError,
    },
    #[error(
        "no --kubeconfig given and none could be inferred (KUBECONFIG, ~/.kube/config, in-cluster): {0}"
    )]
    Infer(#[source] kube::config::InferConfigError),
    #[error("cannot build a client for the hub apiserver: {0}")]
    Client(#[source] kube::Error),
}

/// A client for the hub apiserver from `kubeconfig`, or inferred (KUBECONFIG, in-cluster),
/// whose every request takes a token of `rate` first (the process's `--kube-api-qps` and
/// `--kube-api-burst`; every client of one process shares it).
pub async fn connect(
    kubeconfig: Option<&std::path::Path>,
    rate: &flotilla_ops::KubeApiRate,
) -> Result<Client, ConnectError> {
    let config = match kubeconfig {
        Some(path) => {
            let failed = |source| ConnectError::Kubeconfig {
                path: path.display().to_string(),
                source,
            };
            let kc = kube::config::Kubeconfig::read_from(path).map_err(failed)?;
            kube::Config::from_custom_kubeconfig(kc, &Default::default())
                .await
                .map_err(failed)?
        }
        None => kube::Config::infer().await.map_err(ConnectError::Infer)?,
    };
    Ok(kube::client::ClientBuilder::try_from(config)
        .map_err(ConnectError::Client)?
        .with_layer(rate)
        .build())
}

fn api_resource(kind: Kind) -> ApiResource {
    ApiResource {
        group: kind.group().to_owned(),
        version: kind.version().to_owned(),
        api_version: kind.api_version(),
        kind: kind.name().to_owned(),
        plural: kind.plural().to_owned(),
    }
}

fn to_dynamic(key: &ObjectKey, object: Object) -> Result<DynamicObject, StoreError> {
    serde_json::from_value(object).map_err(|e| {
        key.invalid(format!(
            "metadata does not decode as Kubernetes metadata: {e}"
        ))
    })
}

fn from_dynamic(kind: Kind, object: DynamicObject) -> Result<Object, StoreError> {
    let mut value = serde_json::to_value(object)
        .map_err(|e| StoreError::backend(format!("encoding a {kind}"), e))?;
    if let Some(map) = value.as_object_mut() {
        // List items may come without their type; the store's objects always carry it.
        map.entry("apiVersion")
            .or_insert_with(|| json!(kind.api_version()));
        map.entry("kind").or_insert_with(|| json!(kind.name()));
    }
    remove_meta(&mut value, "managedFields");
    Ok(value)
}

/// Maps an apiserver error about one object onto the store's errors, keeping the apiserver's
/// message where it explains the refusal.
fn object_error(err: kube::Error, key: &ObjectKey, doing: &str) -> StoreError {
    if let kube::Error::Api(status) = &err {
        match status.code {
            404 => return key.not_found(),
            409 if status.reason == "AlreadyExists" => return key.already_exists(),
            409 => return key.conflict(status.message.clone()),
            400 | 413 | 422 => return key.invalid(status.message.clone()),
            _ => {}
        }
    }
    StoreError::backend(format!("{doing} {key}"), err)
}

/// Maps an apiserver error of a list or watch.
fn collection_error(err: kube::Error, kind: Kind, doing: &str) -> StoreError {
    if let kube::Error::Api(status) = &err
        && status.code == 404
    {
        return StoreError::backend(
            format!("{doing} {kind}"),
            format!(
                "{} is not served by the apiserver: install the CRDs (kubectl apply --server-side -k deploy/crds)",
                kind.plural()
            ),
        );
    }
    StoreError::backend(format!("{doing} {kind}"), err)
}

fn is_missing_namespace(err: &kube::Error) -> bool {
    matches!(err, kube::Error::Api(status)
        if status.code == 404 && status.details.as_ref().is_some_and(|d| d.kind == "namespaces"))
}

impl KubeStore {
    async fn list_in(
        &self,
        kind: Kind,
        namespace: Option<&str>,
        selection: &Selection,
        paging: Paging,
    ) -> Result<ObjectList, StoreError> {
        check_scope(kind, namespace, "", false)?;
        let selector = selection.label_selector();
        let api = self.api(kind, namespace);
        let mut items = Vec::new();
        let mut revision = None;
        let mut token: Option<String> = None;
        loop {
            let mut params = match paging {
                Paging::Paged => ListParams::default().limit(LIST_PAGE_SIZE),
                Paging::Whole => ListParams::default(),
            };
            if let Some(selector) = &selector {
                params = params.labels(selector);
            }
            if let Some(token) = &token {
                params = params.continue_token(token);
            }
            let page = api
                .list(&params)
                .await
                .map_err(|e| collection_error(e, kind, "listing"))?;
            // Every page comes from the first page's snapshot.
            if revision.is_none() {
                revision = page.metadata.resource_version.clone();
            }
            for item in page.items {
                items.push(from_dynamic(kind, item)?);
            }
            match page.metadata.continue_.filter(|c| !c.is_empty()) {
                Some(next) => token = Some(next),
                None => break,
            }
        }
        let revision = revision.ok_or_else(|| {
            StoreError::backend(format!("listing {kind}"), "the list has no resourceVersion")
        })?;
        Ok(ObjectList {
            items,
            revision: Revision::new(revision),
        })
    }

    async fn watch_in(
        &self,
        kind: Kind,
        namespace: Option<&str>,
        selection: &Selection,
        from: Option<Revision>,
    ) -> Result<WatchStream, StoreError> {
        check_scope(kind, namespace, "", false)?;
        let (pending, last) = match from {
            Some(from) => (VecDeque::new(), from.as_str().to_owned()),
            None => {
                let list = self
                    .list_in(kind, namespace, selection, Paging::Paged)
                    .await?;
                let added = list.items.into_iter().map(WatchEvent::Added).collect();
                (added, list.revision.as_str().to_owned())
            }
        };
        let api = self.api(kind, namespace);
        let mut params = WatchParams::default().timeout(self.watch_timeout_secs);
        if let Some(selector) = selection.label_selector() {
            params = params.labels(&selector);
        }
        // Opened here so that a missing CRD or a refused request fails the call itself.
        let stream = api
            .watch(&params, &last)
            .await
            .map_err(|e| collection_error(e, kind, "watching"))?
            .boxed();
        debug!(%kind, namespace, from = %last, pending = pending.len(), "watch started");
        let watcher = ApiWatcher {
            api,
            kind,
            params,
            pending,
            stream: Some(stream),
            last,
            failures: 0,
            restarts: self.watch_restarts.clone(),
            ended: false,
        };
        Ok(Box::pin(futures::stream::unfold(
            watcher,
            |mut w| async move { w.next().await.map(|item| (item, w)) },
        )))
    }
}

impl KubeStore {
    async fn read(&self, key: &ObjectKey) -> Result<Option<Object>, StoreError> {
        self.api(key.kind, key.namespace())
            .get_opt(&key.name)
            .await
            .map_err(|e| object_error(e, key, "reading"))?
            .map(|o| from_dynamic(key.kind, o))
            .transpose()
    }

    /// One JSON patch on /status: "add" replaces the whole status, and a resourceVersion in
    /// the patched object makes the apiserver check it (409 Conflict when stale).
    async fn patch_status(
        &self,
        key: &ObjectKey,
        status: Value,
        expected: Option<&Revision>,
    ) -> Result<Object, StoreError> {
        let mut ops = Vec::with_capacity(2);
        if let Some(expected) = expected {
            ops.push(json!({"op": "add", "path": "/metadata/resourceVersion", "value": expected.as_str()}));
        }
        ops.push(json!({"op": "add", "path": "/status", "value": status}));
        let patch = serde_json::from_value(Value::Array(ops))
            .map_err(|e| StoreError::backend(format!("building the status patch of {key}"), e))?;
        let updated = self
            .api(key.kind, key.namespace())
            .patch_status(
                &key.name,
                &PatchParams::default(),
                &Patch::Json::<()>(patch),
            )
            .await
            .map_err(|e| object_error(e, key, "writing the status of"))?;
        debug!(kind = %key.kind, namespace = key.namespace(), name = %key.name, conditional = expected.is_some(), "status updated");
        from_dynamic(key.kind, updated)
    }

    /// [`Store::update_spec`], with the fencing rule applied to what the write replaces when
    /// `fence` is given: to `object`'s own record when it carries the resourceVersion the write
    /// is conditioned on, or to the record read with the version it replaces.
    async fn replace_spec(
        &self,
        object: Object,
        fence: Option<&WriteFence>,
    ) -> Result<Object, StoreError> {
        let key = object::validate(&object)?;
        if fence.is_some() {
            fencing::check_kind(&key)?;
        }
        let api = self.api(key.kind, key.namespace());
        let conditional = resource_version(&object).is_some();
        if conditional && let Some(fence) = fence {
            fencing::judge(&key, fence, WriteFence::recorded(&object).as_ref())?;
        }
        // A fenced write leaves its fence where the next write is judged; an unfenced one
        // conditioned on a version carries the record as its writer read it (nothing was
        // written since, or the version check refuses it).
        let mut object = object;
        if let Some(fence) = fence {
            fence.set_as_spec_annotation(&mut object);
        }
        let mut attempt = 0;
        loop {
            attempt += 1;
            let mut candidate = object.clone();
            if !conditional {
                // CRs refuse updates without a resourceVersion: read the current one, and
                // retry if another writer slips in between.
                let current = self.read(&key).await?.ok_or_else(|| key.not_found())?;
                match fence {
                    Some(fence) => {
                        fencing::judge(&key, fence, WriteFence::recorded(&current).as_ref())?
                    }
                    None => fencing::keep_stored_spec_record(&key, &mut candidate, &current),
                }
                set_meta(
                    &mut candidate,
                    "resourceVersion",
                    json!(resource_version(&current)),
                );
            }
            let candidate = to_dynamic(&key, candidate)?;
            match api
                .replace(&key.name, &PostParams::default(), &candidate)
                .await
            {
                Ok(updated) => {
                    debug!(kind = %key.kind, namespace = key.namespace(), name = %key.name, attempt, fenced = fence.is_some(), "spec updated");
                    return from_dynamic(key.kind, updated);
                }
                Err(e) => {
                    let err = object_error(e, &key, "updating");
                    if !conditional
                        && attempt < UPDATE_ATTEMPTS
                        && matches!(err, StoreError::Conflict { .. })
                    {
                        debug!(kind = %key.kind, namespace = key.namespace(), name = %key.name, attempt, "update raced another writer; retrying");
                        continue;
                    }
                    return Err(err);
                }
            }
        }
    }
}

#[async_trait]
impl Store for KubeStore {
    async fn get(
        &self,
        kind: Kind,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<Option<Object>, StoreError> {
        check_scope(kind, namespace, name, true)?;
        self.read(&ObjectKey::new(kind, namespace, name)).await
    }

    async fn list(&self, kind: Kind, namespace: Option<&str>) -> Result<ObjectList, StoreError> {
        self.list_in(kind, namespace, &Selection::Everything, Paging::Paged)
            .await
    }

    async fn watch(
        &self,
        kind: Kind,
        namespace: Option<&str>,
        from: Option<Revision>,
    ) -> Result<WatchStream, StoreError> {
        self.watch_in(kind, namespace, &Selection::Everything, from)
            .await
    }

    async fn list_selected(
        &self,
        kind: Kind,
        selection: &Selection,
    ) -> Result<ObjectList, StoreError> {
        self.list_in(kind, None, selection, Paging::Whole).await
    }

    async fn watch_selected(
        &self,
        kind: Kind,
        selection: &Selection,
        from: Option<Revision>,
    ) -> Result<WatchStream, StoreError> {
        self.watch_in(kind, None, selection, from).await
    }

    async fn create(&self, mut object: Object) -> Result<Object, StoreError> {
        let key = object::validate(&object)?;
        // The apiserver refuses a create that carries a resourceVersion; the store's contract
        // is that create ignores it, like uid and creationTimestamp.
        remove_meta(&mut object, "resourceVersion");
        let api = self.api(key.kind, key.namespace());
        let object = to_dynamic(&key, object)?;
        let params = PostParams::default();
        let created = match api.create(&params, &object).await {
            Err(e) if is_missing_namespace(&e) => {
                self.create_namespace(key.namespace().unwrap_or_default())
                    .await?;
                api.create(&params, &object).await
            }
            other => other,
        }
        .map_err(|e| object_error(e, &key, "creating"))?;
        debug!(kind = %key.kind, namespace = key.namespace(), name = %key.name, "created");
        from_dynamic(key.kind, created)
    }

    async fn update_spec(&self, object: Object) -> Result<Object, StoreError> {
        self.replace_spec(object, None).await
    }

    async fn update_spec_fenced(
        &self,
        object: Object,
        fence: &WriteFence,
    ) -> Result<Object, StoreError> {
        self.replace_spec(object, Some(fence)).await
    }

    async fn update_status(
        &self,
        kind: Kind,
        namespace: Option<&str>,
        name: &str,
        status: Value,
        expected: Option<&Revision>,
    ) -> Result<Object, StoreError> {
        check_scope(kind, namespace, name, true)?;
        let key = ObjectKey::new(kind, namespace, name);
        object::check_has_status(&key)?;
        if !status.is_object() {
            return Err(key.invalid("status must be a JSON map"));
        }
        check_size(json_len(&status), || key.clone())?;
        if !fence::is_fenced(kind) {
            return self.patch_status(&key, status, expected).await;
        }
        // The fencing record stays as stored, which only a read can tell; the write is
        // conditioned on that read, so no fenced write lands in between unseen.
        let mut status = status;
        for attempt in 1..=UPDATE_ATTEMPTS {
            let current = self.read(&key).await?.ok_or_else(|| key.not_found())?;
            let read = Revision::of(&current);
            if let Some(expected) = expected
                && read.as_ref() != Some(expected)
            {
                return Err(key.conflict(format!(
                    "resourceVersion {expected} is stale: the object changed since it was read; \
                     get it again and reapply the status"
                )));
            }
            fencing::keep_stored(&key, &mut status, Some(&current));
            match self.patch_status(&key, status.clone(), read.as_ref()).await {
                Err(StoreError::Conflict { .. })
                    if expected.is_none() && attempt < UPDATE_ATTEMPTS =>
                {
                    debug!(kind = %key.kind, namespace = key.namespace(), name = %key.name, attempt, "status write raced another writer; reading again");
                }
                other => return other,
            }
        }
        Err(key.conflict(format!(
            "the status changed under {UPDATE_ATTEMPTS} writes in a row; try again"
        )))
    }

    async fn update_status_fenced(
        &self,
        kind: Kind,
        namespace: Option<&str>,
        name: &str,
        status: Value,
        fence: &WriteFence,
        basis: Option<&Basis>,
    ) -> Result<Object, StoreError> {
        check_scope(kind, namespace, name, true)?;
        let key = ObjectKey::new(kind, namespace, name);
        if !status.is_object() {
            return Err(key.invalid("status must be a JSON map"));
        }
        fencing::check_kind(&key)?;
        let mut status = status;
        fence.set_in(&mut status);
        check_size(json_len(&status), || key.clone())?;
        let mut basis = basis.cloned();
        for attempt in 1..=UPDATE_ATTEMPTS {
            let seen = match basis.take() {
                Some(seen) => seen,
                None => {
                    let current = self.read(&key).await?.ok_or_else(|| key.not_found())?;
                    Basis::of(&current).ok_or_else(|| {
                        StoreError::backend(
                            format!("reading {key}"),
                            "the apiserver returned it without a resourceVersion",
                        )
                    })?
                }
            };
            fencing::judge(&key, fence, seen.fence.as_ref())?;
            match self
                .patch_status(&key, status.clone(), Some(&seen.revision))
                .await
            {
                Err(StoreError::Conflict { .. }) if attempt < UPDATE_ATTEMPTS => {
                    debug!(kind = %key.kind, namespace = key.namespace(), name = %key.name, attempt, "fenced status write: the object changed since its basis; reading again");
                }
                other => return other,
            }
        }
        Err(key.conflict(format!(
            "the status changed under {UPDATE_ATTEMPTS} fenced writes in a row; try again"
        )))
    }

    async fn delete(
        &self,
        kind: Kind,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<(), StoreError> {
        check_scope(kind, namespace, name, true)?;
        let key = ObjectKey::new(kind, namespace, name);
        self.api(kind, namespace)
            .delete(name, &DeleteParams::default())
            .await
            .map_err(|e| object_error(e, &key, "deleting"))?;
        debug!(%kind, namespace, name, "deleted");
        Ok(())
    }

    async fn ensure_namespace(&self, name: &str) -> Result<(), StoreError> {
        self.create_namespace(name).await
    }
}

/// The state behind one watch stream on the apiserver.
struct ApiWatcher {
    api: Api<DynamicObject>,
    kind: Kind,
    params: WatchParams,
    /// Synthetic `Added` events from the initial list, delivered first.
    pending: VecDeque<WatchEvent>,
    /// The open watch request, if any; `None` between a close and the reopen.
    stream: Option<BoxStream<'static, kube::Result<KubeEvent<DynamicObject>>>>,
    /// The last revision seen (an event's or a bookmark's): where a reopened watch resumes.
    last: String,
    /// Consecutive failed attempts to reopen; reset by every delivered event.
    failures: u32,
    restarts: Arc<AtomicU64>,
    ended: bool,
}

impl ApiWatcher {
    async fn next(&mut self) -> Option<Result<WatchEvent, StoreError>> {
        loop {
            if self.ended {
                return None;
            }
            if let Some(event) = self.pending.pop_front() {
                return Some(Ok(event));
            }
            let Some(stream) = self.stream.as_mut() else {
                match self.api.watch(&self.params, &self.last).await {
                    Ok(stream) => self.stream = Some(stream.boxed()),
                    Err(e) => {
                        if let Some(err) = self.failed(e).await {
                            return Some(Err(err));
                        }
                    }
                }
                continue;
            };
            let (make, object): (fn(Object) -> WatchEvent, DynamicObject) = match stream
                .next()
                .await
            {
                Some(Ok(KubeEvent::Added(o))) => (WatchEvent::Added, o),
                Some(Ok(KubeEvent::Modified(o))) => (WatchEvent::Modified, o),
                Some(Ok(KubeEvent::Deleted(o))) => (WatchEvent::Deleted, o),
                Some(Ok(KubeEvent::Bookmark(bookmark))) => {
                    self.last = bookmark.metadata.resource_version;
                    continue;
                }
                Some(Ok(KubeEvent::Error(status))) => {
                    self.ended = true;
                    if status.code == 410 {
                        return Some(Err(self.gone()));
                    }
                    return Some(Err(StoreError::backend(
                        format!("watching {}", self.kind),
                        status.message,
                    )));
                }
                Some(Err(e)) => {
                    self.stream = None;
                    if let Some(err) = self.failed(e).await {
                        return Some(Err(err));
                    }
                    continue;
                }
                None => {
                    // The apiserver closes every watch after its timeout: resume.
                    self.stream = None;
                    self.restarts.fetch_add(1, Ordering::Relaxed);
                    debug!(kind = %self.kind, from = %self.last, "watch closed by the apiserver; reopening");
                    continue;
                }
            };
            self.failures = 0;
            if let Some(rv) = &object.metadata.resource_version {
                self.last.clone_from(rv);
            }
            return Some(from_dynamic(self.kind, object).map(make));
        }
    }

    fn gone(&self) -> StoreError {
        StoreError::Gone {
            from: Revision::new(self.last.clone()),
        }
    }

    /// Handles a failure to open or read the watch: `Some(error)` ends the stream, `None` means
    /// try again (after a short backoff).
    async fn failed(&mut self, err: kube::Error) -> Option<StoreError> {
        if let kube::Error::Api(status) = &err {
            if status.code == 410 {
                self.ended = true;
                return Some(self.gone());
            }
            if (400..500).contains(&status.code) && status.code != 429 {
                self.ended = true;
                return Some(collection_error(err, self.kind, "watching"));
            }
        }
        self.failures += 1;
        if self.failures > WATCH_REOPEN_ATTEMPTS {
            self.ended = true;
            return Some(collection_error(err, self.kind, "watching"));
        }
        let backoff = Duration::from_millis(100 << self.failures.min(6));
        warn!(kind = %self.kind, from = %self.last, error = %error_chain(&err), failures = self.failures, ?backoff, "watch failed; reopening");
        tokio::time::sleep(backoff).await;
        None
    }
}
