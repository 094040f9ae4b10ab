//! The operator API: what the `flotilla` CLI talks to. HTTPS with hub-issued operator client
//! certificates; paths follow the Kubernetes API's shape (`/apis/<group>/<version>/...`) so the
//! objects read the same as with the kube backend.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete as delete_route, get, post};
use axum::{Extension, Json, Router};
use flotilla_proto::api::Kind;
use flotilla_proto::api::{ManifestWork, validate_manifest_work};
use flotilla_store::{Store, StoreError};
use flotilla_transport::identity::Peer;
use flotilla_transport::tls::{AuthenticatedConn, ConnInfo};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use serde_json::{Value, json};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tracing::{debug, info, warn};

use crate::registration::{self, Authority, ClusterOpError};
use crate::status_page::StatusPage;
use crate::tokens::{BootstrapTokens, TokenRecord};

#[derive(Clone)]
struct ApiState {
    store: Arc<dyn Store>,
    registration: Option<Arc<RegistrationApi>>,
    /// Virtual shards of the fleet: ManagedClusters and ManifestWorks written here carry their
    /// shard label from the first write, so no gateway's selected watch misses them and the
    /// labeller has nothing to correct.
    shards: u32,
}

/// What the registration endpoints (`/registration/v1/...`: tokens, accept, deny, CA
/// rotation) work with.
pub struct RegistrationApi {
    pub tokens: Arc<BootstrapTokens>,
    pub authority: Arc<Authority>,
    /// host:port agents dial, printed in join commands.
    pub agent_address: String,
    /// Bumped after a CA rotation; the hub then re-keys the agents' listener and sends the new
    /// bundle to every session.
    pub ca_changed: watch::Sender<u64>,
}

/// The routes, independent of transport (tests call them in-process).
pub fn router(store: Arc<dyn Store>) -> Router {
    router_with(store, None, None, flotilla_proto::contract::DEFAULT_SHARDS)
}

/// The routes, with the registration endpoints when `registration` is given and the fleet
/// status page (`/ui/`) when `status_page` is: both behind the operator's certificate.
pub fn router_with(
    store: Arc<dyn Store>,
    registration: Option<Arc<RegistrationApi>>,
    status_page: Option<StatusPage>,
    shards: u32,
) -> Router {
    let api = Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route(
            "/registration/v1/tokens",
            get(list_tokens).post(create_token),
        )
        .route("/registration/v1/tokens/{id}", delete_route(revoke_token))
        .route(
            "/registration/v1/clusters/{name}/accept",
            post(accept_cluster),
        )
        .route("/registration/v1/clusters/{name}/deny", post(deny_cluster))
        .route(
            "/registration/v1/clusters/{name}/dev-key",
            post(register_dev_key),
        )
        .route("/registration/v1/ca", get(ca_info))
        .route("/registration/v1/users", post(create_user))
        .route("/registration/v1/ca/rotate", post(rotate_ca))
        .route(
            "/registration/v1/ca/finish-rotation",
            post(finish_ca_rotation),
        )
        // Each verb has one handler for both forms of its path, cluster-scoped and namespaced.
        .route("/apis/{group}/{version}/{plural}", get(list).post(create))
        .route(
            "/apis/{group}/{version}/namespaces/{ns}/{plural}",
            get(list).post(create),
        )
        .route(
            "/apis/{group}/{version}/{plural}/{name}",
            get(get_one).put(replace).delete(delete),
        )
        .route(
            "/apis/{group}/{version}/namespaces/{ns}/{plural}/{name}",
            get(get_one).put(replace).delete(delete),
        )
        // The core group (`/api/v1`): Kubernetes' own ConfigMap, namespaced, with no status.
        .route("/api/{version}/{plural}", get(list))
        .route(
            "/api/{version}/namespaces/{ns}/{plural}",
            get(list).post(create),
        )
        .route(
            "/api/{version}/namespaces/{ns}/{plural}/{name}",
            get(get_one).put(replace).delete(delete),
        )
        // The status subresource, as on an apiserver: how a score provider publishes an
        // AddOnPlacementScore, or a tool replaces any object's status.
        .route(
            "/apis/{group}/{version}/{plural}/{name}/status",
            axum::routing::put(replace_status),
        )
        .route(
            "/apis/{group}/{version}/namespaces/{ns}/{plural}/{name}/status",
            axum::routing::put(replace_status),
        )
        .with_state(ApiState {
            store,
            registration,
            shards,
        });
    let app = match status_page {
        Some(page) => api.merge(page.router()),
        None => api,
    };
    app
        // Bodies beyond the store's object limit (plus JSON slack) are refused before parsing.
        .layer(axum::extract::DefaultBodyLimit::max(
            2 * flotilla_store::MAX_OBJECT_BYTES,
        ))
        .layer(axum::middleware::from_fn(require_operator))
}

/// Serves the API on authenticated connections until the channel closes or `shutdown` fires.
pub async fn serve(
    mut conns: mpsc::Receiver<AuthenticatedConn>,
    store: Arc<dyn Store>,
    registration: Option<Arc<RegistrationApi>>,
    status_page: Option<StatusPage>,
    shards: u32,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ServeError> {
    let app = router_with(store, registration, status_page, shards);
    // Every connection is owned here: on shutdown, requests in flight get a moment to finish
    // and the rest are cut, so the hub's exit never waits on an idle keep-alive connection.
    let mut connections = JoinSet::new();
    tokio::pin!(shutdown);
    let outcome = loop {
        let conn = tokio::select! {
            c = conns.recv() => match c {
                Some(c) => c,
                None => break Err(ServeError::ListenerClosed),
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
            _ = &mut shutdown => break Ok(()),
        };
        let info = conn.info().clone();
        let svc = TowerToHyperService::new(app.clone().layer(Extension(info)));
        connections.spawn(async move {
            if let Err(e) = auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(conn), svc)
                .await
            {
                debug!(error = %e, "operator API connection ended");
            }
        });
    };
    let finish = async { while connections.join_next().await.is_some() {} };
    if tokio::time::timeout(SHUTDOWN_GRACE, finish).await.is_err() {
        connections.shutdown().await;
    }
    outcome
}

/// How long requests in flight may take to finish when the API stops.
const SHUTDOWN_GRACE: std::time::Duration = std::time::Duration::from_secs(2);

/// Why the operator API stopped serving; retryable only by restarting the hub.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The stream of accepted connections ended although nobody asked the API to stop.
    #[error("the stream of operator connections ended: the listener is gone")]
    ListenerClosed,
}

async fn require_operator(
    Extension(info): Extension<ConnInfo>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    match &info.peer {
        Peer::Operator { user, .. } => {
            info!(user = %user, method = %request.method(), path = %request.uri().path(), "operator request");
            next.run(request).await
        }
        Peer::Cluster(name) => error(
            StatusCode::FORBIDDEN,
            format!("cluster {name} may not use the operator API; use an operator certificate"),
        ),
        Peer::User { user, .. } => error(
            StatusCode::FORBIDDEN,
            format!(
                "user {user} is a kubectl user of the proxy front, not an operator; the operator \
                 API needs an operator certificate"
            ),
        ),
        Peer::Gateway { name } => error(
            StatusCode::FORBIDDEN,
            format!("gateway {name} may not use the operator API; use an operator certificate"),
        ),
        Peer::Anonymous => error(
            StatusCode::UNAUTHORIZED,
            "the operator API needs an operator certificate (operator/config.yaml in the hub's data dir)".into(),
        ),
    }
}

/// A refusal, small enough to travel in a `Result`; rendered as a Kubernetes `Status`.
struct Failure(StatusCode, String);

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        error(self.0, self.1)
    }
}

/// What a Kubernetes-shaped path names, in whichever of its forms the route has:
/// `/apis/{group}/{version}[/namespaces/{ns}]/{plural}[/{name}]`, or `/api/{version}/...` for
/// the core group. The kind is resolved by the handler, after the body is read, so a request
/// refused for its body says so first.
#[derive(serde::Deserialize)]
struct ResourcePath {
    /// Empty on the core group's routes (`/api/v1/...`).
    #[serde(default)]
    group: String,
    version: String,
    plural: String,
    /// Absent on the cluster-scoped forms.
    ns: Option<String>,
    /// Absent on the collection routes (list, create).
    name: Option<String>,
}

impl ResourcePath {
    fn kind(&self) -> Result<Kind, Failure> {
        let (group, version, plural) = (&self.group, &self.version, &self.plural);
        Kind::ALL
            .into_iter()
            .find(|k| k.group() == group && k.version() == version && k.plural() == plural)
            .ok_or_else(|| {
                let group_version = if group.is_empty() {
                    version.to_string()
                } else {
                    format!("{group}/{version}")
                };
                Failure(
                    StatusCode::NOT_FOUND,
                    format!("the hub serves no resource {plural} in {group_version}"),
                )
            })
    }

    fn ns(&self) -> Option<&str> {
        self.ns.as_deref()
    }

    /// The kind and the object's name, for the routes that end in one.
    fn object(&self) -> Result<(Kind, &str), Failure> {
        let kind = self.kind()?;
        let name = self.name.as_deref().ok_or_else(|| {
            Failure(
                StatusCode::BAD_REQUEST,
                format!("{kind}: the request's path names no object"),
            )
        })?;
        Ok((kind, name))
    }
}

async fn list(State(s): State<ApiState>, Path(path): Path<ResourcePath>) -> Response {
    let kind = match path.kind() {
        Ok(k) => k,
        Err(r) => return r.into_response(),
    };
    match s.store.list(kind, path.ns()).await {
        Ok(list) => Json(ListBody {
            api_version: kind.api_version(),
            kind: format!("{}List", kind.name()),
            metadata: ListMeta {
                resource_version: list.revision.to_string(),
            },
            items: list.items,
        })
        .into_response(),
        Err(e) => store_error(e),
    }
}

/// A list response, serialized from the store's objects as they are: `json!` would copy every
/// item into a new value first, which at 10,000 ManagedClusters is over 100 MB held for the
/// length of each list (the load test's ramp lists the clusters four times a second).
#[derive(serde::Serialize)]
#[serde(rename_all = "camelCase")]
struct ListBody {
    api_version: String,
    kind: String,
    metadata: ListMeta,
    items: Vec<Value>,
}

#[derive(serde::Serialize)]
#[serde(rename_all = "camelCase")]
struct ListMeta {
    resource_version: String,
}

async fn get_one(State(s): State<ApiState>, Path(path): Path<ResourcePath>) -> Response {
    let (kind, name) = match path.object() {
        Ok(k) => k,
        Err(r) => return r.into_response(),
    };
    let ns = path.ns();
    // As stored: a root Policy reaching 10,000 clusters is half a megabyte of small maps,
    // which parsed and serialised again cost the hub a tenth of a second of CPU per read.
    match s.store.get_json(kind, ns, name).await {
        Ok(Some(json)) => ([(header::CONTENT_TYPE, "application/json")], json).into_response(),
        Ok(None) => error(
            StatusCode::NOT_FOUND,
            format!("{kind} {} not found", qualified(ns, name)),
        ),
        Err(e) => store_error(e),
    }
}

async fn create(
    State(s): State<ApiState>,
    Path(path): Path<ResourcePath>,
    Json(body): Json<Value>,
) -> Response {
    write(s, Write::Create, &path, body).await
}

async fn replace(
    State(s): State<ApiState>,
    Path(path): Path<ResourcePath>,
    Json(body): Json<Value>,
) -> Response {
    write(s, Write::Replace, &path, body).await
}

/// `PUT .../status`: the body is the object; only its `status` is stored, and its
/// `metadata.resourceVersion`, when given, must be the stored one.
async fn replace_status(
    State(s): State<ApiState>,
    Path(path): Path<ResourcePath>,
    Json(body): Json<Value>,
) -> Response {
    let (kind, name) = match path.object() {
        Ok(k) => k,
        Err(r) => return r.into_response(),
    };
    let ns = path.ns();
    let body_name = body["metadata"]["name"].as_str().unwrap_or(name);
    if body_name != name {
        return error(
            StatusCode::BAD_REQUEST,
            format!(
                "{kind}: metadata.name {body_name:?} does not match the request's name {name:?}"
            ),
        );
    }
    let Some(status) = body.get("status").filter(|v| v.is_object()).cloned() else {
        return error(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!(
                "{kind} {}: the body has no status object to store",
                qualified(ns, name)
            ),
        );
    };
    let expected = flotilla_store::Revision::of(&body);
    match s
        .store
        .update_status(kind, ns, name, status, expected.as_ref())
        .await
    {
        Ok(obj) => Json(obj).into_response(),
        Err(e) => store_error(e),
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Write {
    Create,
    Replace,
}

/// Creates or replaces the object `body` at `path` (which names it when replacing).
async fn write(s: ApiState, how: Write, path: &ResourcePath, mut body: Value) -> Response {
    let kind = match path.kind() {
        Ok(k) => k,
        Err(r) => return r.into_response(),
    };
    let (ns, name) = (path.ns(), path.name.as_deref());
    // The path decides where the object goes; a body that says otherwise is a mistake.
    let body_ns = body["metadata"]["namespace"].as_str().map(str::to_string);
    if let (Some(path_ns), Some(body_ns)) = (ns, body_ns.as_deref())
        && path_ns != body_ns
    {
        return error(
            StatusCode::BAD_REQUEST,
            format!(
                "{kind}: metadata.namespace {body_ns:?} does not match the request's namespace {path_ns:?}"
            ),
        );
    }
    if let (Some(ns), Some(meta)) = (ns, body["metadata"].as_object_mut()) {
        meta.insert("namespace".into(), Value::String(ns.to_string()));
    }
    let body_name = body["metadata"]["name"].as_str().unwrap_or("").to_string();
    if let Some(name) = name
        && body_name != name
    {
        return error(
            StatusCode::BAD_REQUEST,
            format!(
                "{kind}: metadata.name {body_name:?} does not match the request's name {name:?}"
            ),
        );
    }
    if let Err(message) = check_object(kind, &body) {
        return error(StatusCode::UNPROCESSABLE_ENTITY, message);
    }
    if how == Write::Replace
        && body["metadata"].get("finalizers").is_none()
        && let Err(e) = keep_finalizers(&s, kind, ns, &mut body).await
    {
        return store_error(e);
    }
    crate::controllers::shard_labels::stamp(&mut body, s.shards);
    if how == Write::Create && kind == Kind::ManifestWork {
        crate::controllers::with_cleanup_finalizer(&mut body);
    }
    let result = match how {
        Write::Create => s.store.create(body).await,
        Write::Replace => s.store.update_spec(body).await,
    };
    match result {
        Ok(obj) => {
            let status = if how == Write::Create {
                StatusCode::CREATED
            } else {
                StatusCode::OK
            };
            (status, Json(obj)).into_response()
        }
        Err(e) => store_error(e),
    }
}

/// A replacement that says nothing of finalizers (`flotilla apply --overwrite` of a YAML file)
/// keeps the stored ones, as `kubectl apply` does: the finalizers are the controllers' and the
/// gateways' (a ManifestWork's cleanup finalizer holds it until its agent has released it),
/// and dropping them would let a deleted object go before its cleanup.
async fn keep_finalizers(
    s: &ApiState,
    kind: Kind,
    ns: Option<&str>,
    body: &mut Value,
) -> Result<(), StoreError> {
    let Some(name) = body["metadata"]["name"].as_str().map(str::to_owned) else {
        return Ok(());
    };
    if let Some(stored) = s.store.get(kind, ns, &name).await?
        && let Some(finalizers) = stored["metadata"].get("finalizers")
        && let Some(meta) = body["metadata"].as_object_mut()
    {
        meta.insert("finalizers".into(), finalizers.clone());
    }
    Ok(())
}

/// The checks an object of `kind` passes before it is stored (created or replaced); the
/// message names the object and what is wrong with it.
pub(crate) fn check_object(kind: Kind, body: &Value) -> Result<(), String> {
    if kind == Kind::ManifestWork {
        validate_work(body)?;
    }
    validate_typed(kind, body)
}

/// What the kube backend's CRD schema refuses, refused here too: an object of a placement kind
/// whose fields do not have OCM's types, and a ManifestWorkReplicaSet whose template would make
/// invalid ManifestWorks. The message names the object and the field.
fn validate_typed(kind: Kind, body: &Value) -> Result<(), String> {
    use flotilla_proto::api::{
        AddOnPlacementScore, ManagedClusterSet, ManagedClusterSetBinding, ManifestWorkReplicaSet,
        Placement, policy,
    };
    let name = || body_name(body);
    let parse = |result: Result<(), serde_json::Error>| {
        result.map_err(|e| format!("{kind} {}: does not parse: {e}", name()))
    };
    match kind {
        Kind::Placement => {
            let placement: Placement = serde_json::from_value(body.clone())
                .map_err(|e| format!("{kind} {}: does not parse: {e}", name()))?;
            flotilla_proto::api::validate_placement(&placement).map_err(|errors| {
                errors
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join("; ")
            })
        }
        Kind::ManagedClusterSet => {
            let set: ManagedClusterSet = serde_json::from_value(body.clone())
                .map_err(|e| format!("{kind} {}: does not parse: {e}", name()))?;
            flotilla_proto::api::validate_cluster_set(&set).map_err(|e| e.to_string())
        }
        Kind::ManagedClusterSetBinding => {
            parse(serde_json::from_value::<ManagedClusterSetBinding>(body.clone()).map(drop))
        }
        Kind::AddOnPlacementScore => {
            parse(serde_json::from_value::<AddOnPlacementScore>(body.clone()).map(drop))
        }
        Kind::ManifestWorkReplicaSet => {
            let set: ManifestWorkReplicaSet = serde_json::from_value(body.clone())
                .map_err(|e| format!("{kind} {}: does not parse: {e}", name()))?;
            if set.spec.placement_refs.is_empty() {
                return Err(format!(
                    "{kind} {}: spec.placementRefs needs at least one placement",
                    name()
                ));
            }
            let mut work = ManifestWork::new(
                set.metadata.name.as_deref().unwrap_or_default(),
                set.spec.manifest_work_template.clone(),
            );
            work.metadata.namespace = set.metadata.namespace.clone();
            validate_manifest_work(&work).map_err(|errors| {
                format!(
                    "{kind} {}: spec.manifestWorkTemplate: {}",
                    name(),
                    errors
                        .iter()
                        .map(ToString::to_string)
                        .collect::<Vec<_>>()
                        .join("; ")
                )
            })
        }
        // Content-addressed: a chunk stored under another digest would be refused by every
        // gateway and agent that reads it; refuse it here, before it is stored.
        Kind::ManifestChunk => flotilla_proto::api::content::check_chunk_object(body),
        // Governance: every problem at once, each naming the object and the field, and OCM's
        // fields flotilla does not implement refused by name (the raw body has them; the
        // typed object would drop them).
        Kind::Policy => {
            let policy: policy::Policy = serde_json::from_value(body.clone())
                .map_err(|e| format!("{kind} {}: does not parse: {e}", name()))?;
            policy::validate_policy(&policy, Some(body)).map_err(policy_errors)
        }
        Kind::PlacementBinding => {
            let binding: policy::PlacementBinding = serde_json::from_value(body.clone())
                .map_err(|e| format!("{kind} {}: does not parse: {e}", name()))?;
            policy::validate_placement_binding(&binding, Some(body)).map_err(policy_errors)
        }
        Kind::PolicySet => {
            let set: policy::PolicySet = serde_json::from_value(body.clone())
                .map_err(|e| format!("{kind} {}: does not parse: {e}", name()))?;
            policy::validate_policy_set(&set, Some(body)).map_err(policy_errors)
        }
        // What the apiserver checks of a ConfigMap (the store checks it too): every problem
        // at once, each naming the field.
        Kind::ConfigMap => {
            let problems = flotilla_proto::api::check_config_map(body);
            if problems.is_empty() {
                Ok(())
            } else {
                Err(format!("{kind} {}: {}", name(), problems.join("; ")))
            }
        }
        // One per cluster, found by the cluster's name: a record named otherwise would be no
        // cluster's, and the hub would neither count nor delete it.
        Kind::ClusterCompliance => {
            let record: policy::ClusterCompliance = serde_json::from_value(body.clone())
                .map_err(|e| format!("{kind} {}: does not parse: {e}", name()))?;
            let (ns, object) = (
                record.metadata.namespace.as_deref().unwrap_or_default(),
                record.metadata.name.as_deref().unwrap_or_default(),
            );
            if ns != object {
                return Err(format!(
                    "{kind} {}: a cluster's compliance record is named as its cluster, in the \
                     cluster's namespace: name it {ns:?} (the hub makes one for every cluster \
                     that carries a policy)",
                    name()
                ));
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

/// A governance object's problems as one refusal.
fn policy_errors(errors: Vec<flotilla_proto::api::policy::PolicyError>) -> String {
    errors
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

/// The object a body is, as refusals name it.
fn body_name(body: &Value) -> String {
    flotilla_proto::api::object_name(
        body["metadata"]["namespace"].as_str(),
        body["metadata"]["name"].as_str(),
    )
}

/// OCM's rules for a ManifestWork, all problems in one message.
fn validate_work(body: &Value) -> Result<(), String> {
    let work: ManifestWork = serde_json::from_value(body.clone())
        .map_err(|e| format!("ManifestWork {}: does not parse: {e}", body_name(body)))?;
    validate_manifest_work(&work).map_err(|errors| {
        errors
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; ")
    })
}

async fn delete(State(s): State<ApiState>, Path(path): Path<ResourcePath>) -> Response {
    let (kind, name) = match path.object() {
        Ok(k) => k,
        Err(r) => return r.into_response(),
    };
    match s.store.delete(kind, path.ns(), name).await {
        Ok(()) => Json(json!({
            "apiVersion": "v1", "kind": "Status", "status": "Success",
            "details": { "name": name, "kind": kind.plural() },
        }))
        .into_response(),
        Err(e) => store_error(e),
    }
}

fn qualified(ns: Option<&str>, name: &str) -> String {
    match ns {
        Some(ns) => format!("{ns}/{name}"),
        None => name.to_string(),
    }
}

fn store_error(e: StoreError) -> Response {
    let status = match &e {
        StoreError::NotFound { .. } => StatusCode::NOT_FOUND,
        StoreError::AlreadyExists { .. } | StoreError::Conflict { .. } => StatusCode::CONFLICT,
        StoreError::Invalid { .. } => StatusCode::UNPROCESSABLE_ENTITY,
        StoreError::Gone { .. } => StatusCode::GONE,
        _ => StatusCode::SERVICE_UNAVAILABLE,
    };
    error(status, e.to_string())
}

/// Errors in the shape of a Kubernetes `Status`, so tools that read those understand them.
fn error(status: StatusCode, message: String) -> Response {
    (
        status,
        Json(json!({
            "apiVersion": "v1", "kind": "Status", "status": "Failure",
            "message": message, "code": status.as_u16(),
        })),
    )
        .into_response()
}

// ---- registration: tokens, acceptance, CA rotation ----

fn registration_api(s: &ApiState) -> Result<Arc<RegistrationApi>, Failure> {
    s.registration.clone().ok_or_else(|| {
        Failure(
            StatusCode::NOT_FOUND,
            "this hub does not serve registration".into(),
        )
    })
}

/// `POST /registration/v1/tokens`: the body of a token request.
#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct TokenRequest {
    ttl_seconds: u64,
    uses: Option<u32>,
    #[serde(default)]
    auto_accept: bool,
    #[serde(default)]
    labels: std::collections::BTreeMap<String, String>,
}

/// A token record as the API shows it: never the secret or its hash.
fn token_view(r: &TokenRecord) -> Value {
    json!({
        "id": r.id,
        "created": r.created,
        "expires": r.expires,
        "maxUses": r.max_uses,
        "uses": r.uses,
        "revoked": r.revoked,
        "autoAccept": r.auto_accept,
        "labels": r.labels,
        "state": r.state(jiff::Timestamp::now()),
    })
}

async fn create_token(State(s): State<ApiState>, Json(body): Json<TokenRequest>) -> Response {
    let api = match registration_api(&s) {
        Ok(a) => a,
        Err(f) => return f.into_response(),
    };
    if body.ttl_seconds == 0 {
        return error(StatusCode::BAD_REQUEST, "--ttl must be positive".into());
    }
    if body.uses == Some(0) {
        return error(StatusCode::BAD_REQUEST, "--uses must be at least 1".into());
    }
    let auto_accept = body.auto_accept || !body.labels.is_empty();
    match api
        .tokens
        .create(
            std::time::Duration::from_secs(body.ttl_seconds),
            body.uses,
            auto_accept,
            body.labels,
        )
        .await
    {
        Ok(created) => {
            let fingerprint = api.authority.current().fingerprint();
            let mut view = token_view(&created.record);
            view["token"] = Value::String(created.token.clone());
            view["caFingerprint"] = Value::String(fingerprint.clone());
            view["hub"] = Value::String(api.agent_address.clone());
            // The secret goes in the environment, not the command line: arguments are
            // visible to every user of the spoke (`ps`) and land in process listings.
            view["joinCommand"] = Value::String(format!(
                "FLOTILLA_BOOTSTRAP_TOKEN={} flotilla-agent join --hub {} --cluster-name <cluster-name> --ca-fingerprint {}",
                created.token, api.agent_address, fingerprint
            ));
            (StatusCode::CREATED, Json(view)).into_response()
        }
        Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    }
}

async fn list_tokens(State(s): State<ApiState>) -> Response {
    match registration_api(&s) {
        Ok(api) => {
            let items: Vec<Value> = api.tokens.list().await.iter().map(token_view).collect();
            Json(json!({ "items": items })).into_response()
        }
        Err(f) => f.into_response(),
    }
}

async fn revoke_token(State(s): State<ApiState>, Path(id): Path<String>) -> Response {
    let api = match registration_api(&s) {
        Ok(a) => a,
        Err(f) => return f.into_response(),
    };
    match api.tokens.revoke(&id).await {
        Ok(true) => Json(json!({ "id": id, "state": "revoked" })).into_response(),
        Ok(false) => error(
            StatusCode::NOT_FOUND,
            format!("bootstrap token {id} not found (`flotilla token list` shows the ids)"),
        ),
        Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    }
}

fn cluster_op(result: Result<Value, ClusterOpError>) -> Response {
    match result {
        Ok(mc) => Json(mc).into_response(),
        Err(e @ ClusterOpError::NotFound(_)) => error(StatusCode::NOT_FOUND, e.to_string()),
        Err(ClusterOpError::Store(e)) => store_error(e),
    }
}

async fn accept_cluster(State(s): State<ApiState>, Path(name): Path<String>) -> Response {
    let result = registration::accept(s.store.as_ref(), &name).await;
    if result.is_ok() {
        info!(cluster = %name, "cluster accepted by an operator");
    }
    cluster_op(result)
}

#[derive(serde::Deserialize)]
struct DenyRequest {
    #[serde(default)]
    reason: String,
}

async fn deny_cluster(
    State(s): State<ApiState>,
    Path(name): Path<String>,
    Json(body): Json<DenyRequest>,
) -> Response {
    let reason = if body.reason.trim().is_empty() {
        "denied by an operator".to_string()
    } else {
        body.reason
    };
    let result = registration::deny(s.store.as_ref(), &name, &reason).await;
    if result.is_ok() {
        warn!(cluster = %name, %reason, "cluster denied by an operator");
    }
    cluster_op(result)
}

#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct DevKeyRequest {
    key_sha256: String,
}

async fn register_dev_key(
    State(s): State<ApiState>,
    Path(name): Path<String>,
    Json(body): Json<DevKeyRequest>,
) -> Response {
    if !flotilla_proto::contract::is_dns1123_label(&name)
        || body.key_sha256.len() != 64
        || !body.key_sha256.bytes().all(|b| b.is_ascii_hexdigit())
    {
        return error(
            StatusCode::BAD_REQUEST,
            format!("dev key for {name:?}: a DNS-1123 cluster name and a hex SHA-256 are needed"),
        );
    }
    warn!(cluster = %name, "cluster registered with a development certificate (no join)");
    cluster_op(
        registration::register_dev_key(s.store.as_ref(), &name, &body.key_sha256, s.shards).await,
    )
}

fn ca_view(ca: &crate::ca::Ca) -> Value {
    json!({
        "fingerprint": ca.fingerprint(),
        "rotating": ca.rotating(),
        "bundle": ca.bundle_pem(),
    })
}

/// Longest and default lifetime of a kubectl user's certificate.
pub const USER_CERT_LIFETIME: std::time::Duration = std::time::Duration::from_secs(90 * 24 * 3600);

/// `POST /registration/v1/users`: a kubectl user's certificate for the proxy front.
#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct UserRequest {
    user: String,
    #[serde(default)]
    groups: Vec<String>,
    /// PEM PKCS#10 request for the user's key, made where the key stays.
    csr: String,
    #[serde(default)]
    lifetime_seconds: Option<u64>,
}

async fn create_user(State(s): State<ApiState>, Json(body): Json<UserRequest>) -> Response {
    let api = match registration_api(&s) {
        Ok(a) => a,
        Err(f) => return f.into_response(),
    };
    let lifetime = body
        .lifetime_seconds
        .map(std::time::Duration::from_secs)
        .unwrap_or(USER_CERT_LIFETIME);
    if lifetime.is_zero() || lifetime > USER_CERT_LIFETIME {
        return error(
            StatusCode::BAD_REQUEST,
            format!("--lifetime must be positive and at most {USER_CERT_LIFETIME:?}"),
        );
    }
    let ca = api.authority.current();
    match ca.sign_user_csr(&body.user, &body.groups, &body.csr, lifetime) {
        Ok(certificate) => {
            tracing::info!(user = %body.user, groups = ?body.groups, "kubectl user certificate issued");
            (
                StatusCode::CREATED,
                Json(json!({
                    "user": body.user, "groups": body.groups,
                    "certificate": certificate, "ca": ca.bundle_pem(),
                })),
            )
                .into_response()
        }
        Err(e) => error(StatusCode::BAD_REQUEST, format!("user {}: {e}", body.user)),
    }
}

async fn ca_info(State(s): State<ApiState>) -> Response {
    match registration_api(&s) {
        Ok(api) => Json(ca_view(&api.authority.current())).into_response(),
        Err(f) => f.into_response(),
    }
}

async fn rotate_ca(State(s): State<ApiState>) -> Response {
    ca_change(s, |a| a.rotate()).await
}

async fn finish_ca_rotation(State(s): State<ApiState>) -> Response {
    ca_change(s, |a| a.finish_rotation()).await
}

async fn ca_change(
    s: ApiState,
    change: impl FnOnce(&Authority) -> Result<Arc<crate::ca::Ca>, crate::ca::CaError>,
) -> Response {
    let api = match registration_api(&s) {
        Ok(a) => a,
        Err(f) => return f.into_response(),
    };
    match change(&api.authority) {
        Ok(ca) => {
            api.ca_changed.send_modify(|n| *n = n.wrapping_add(1));
            Json(ca_view(&ca)).into_response()
        }
        Err(e @ crate::ca::CaError::BadRequest(_)) => error(StatusCode::CONFLICT, e.to_string()),
        Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use flotilla_proto::contract::{SHARD_LABEL, shard_label_value, shard_of};
    use flotilla_store::SledStore;
    use serde_json::json;

    use super::*;

    const SHARDS: u32 = 64;

    fn state(dir: &std::path::Path) -> ApiState {
        ApiState {
            store: Arc::new(SledStore::open(dir).unwrap()),
            registration: None,
            shards: SHARDS,
        }
    }

    fn work(name: &str, labels: Value) -> Value {
        json!({
            "apiVersion": "work.open-cluster-management.io/v1", "kind": "ManifestWork",
            "metadata": {"name": name, "labels": labels},
            "spec": {"workload": {"manifests": [
                {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "namespace": "default"}}
            ]}},
        })
    }

    async fn shard_label_of(s: &ApiState, name: &str) -> Option<String> {
        let stored = s
            .store
            .get(Kind::ManifestWork, Some("store-7"), name)
            .await
            .unwrap()
            .expect("stored");
        stored["metadata"]["labels"][SHARD_LABEL]
            .as_str()
            .map(str::to_owned)
    }

    /// A work written through the API carries its cluster's shard label from its first write,
    /// whatever the body said: a gateway's selected watch sees it at once, and the labeller has
    /// no second write to make.
    #[tokio::test]
    async fn works_written_here_carry_their_shard_label() {
        let dir = tempfile::tempdir().unwrap();
        let s = state(dir.path());
        s.store.ensure_namespace("store-7").await.unwrap();
        let want = shard_label_value(shard_of("store-7", SHARDS));
        let path = |name: Option<&str>| ResourcePath {
            group: "work.open-cluster-management.io".into(),
            version: "v1".into(),
            plural: "manifestworks".into(),
            ns: Some("store-7".into()),
            name: name.map(str::to_owned),
        };

        let created = write(
            s.clone(),
            Write::Create,
            &path(None),
            work("web", json!({"app": "web"})),
        )
        .await;
        assert_eq!(created.status(), StatusCode::CREATED);
        assert_eq!(
            shard_label_of(&s, "web").await.as_deref(),
            Some(want.as_str())
        );

        // A replace that drops the label, or names another shard, gets the right one back.
        for labels in [json!({"app": "web"}), json!({SHARD_LABEL: "99"})] {
            let replaced = write(
                s.clone(),
                Write::Replace,
                &path(Some("web")),
                work("web", labels),
            )
            .await;
            assert_eq!(replaced.status(), StatusCode::OK);
            assert_eq!(
                shard_label_of(&s, "web").await.as_deref(),
                Some(want.as_str())
            );
        }
    }

    /// One request through the routes as the operator, answering its status and JSON body.
    async fn call(
        s: &ApiState,
        method: &str,
        uri: &str,
        body: Option<Value>,
    ) -> (StatusCode, Value) {
        use http_body_util::BodyExt as _;
        use tower::ServiceExt as _;
        let operator = ConnInfo {
            peer: Peer::Operator {
                user: "admin".into(),
                groups: Vec::new(),
            },
            remote: ([127, 0, 0, 1], 1).into(),
            client_key_sha256: None,
            over_rate: None,
        };
        let app = router_with(s.store.clone(), None, None, SHARDS).layer(Extension(operator));
        let request = axum::http::Request::builder()
            .method(method)
            .uri(uri)
            .header("content-type", "application/json")
            .body(axum::body::Body::from(
                body.map(|b| b.to_string()).unwrap_or_default(),
            ))
            .expect("a request");
        let response = app.oneshot(request).await.expect("the router answers");
        let status = response.status();
        let bytes = response
            .into_body()
            .collect()
            .await
            .expect("a body")
            .to_bytes();
        (
            status,
            serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        )
    }

    /// Every verb reaches the object its path names, in the cluster-scoped form of the path
    /// and the namespaced one alike, status subresource included.
    #[tokio::test]
    async fn each_verb_serves_both_forms_of_its_path() {
        let dir = tempfile::tempdir().unwrap();
        let s = state(dir.path());
        s.store.ensure_namespace("store-7").await.unwrap();
        let clusters = "/apis/cluster.open-cluster-management.io/v1/managedclusters";
        let works = "/apis/work.open-cluster-management.io/v1/namespaces/store-7/manifestworks";
        let cluster = json!({
            "apiVersion": "cluster.open-cluster-management.io/v1", "kind": "ManagedCluster",
            "metadata": {"name": "store-7"}, "spec": {"hubAcceptsClient": true},
        });

        let (status, _) = call(&s, "POST", clusters, Some(cluster)).await;
        assert_eq!(status, StatusCode::CREATED);
        let (status, _) = call(&s, "POST", works, Some(work("web", json!({})))).await;
        assert_eq!(status, StatusCode::CREATED);

        let (status, got) = call(&s, "GET", &format!("{clusters}/store-7"), None).await;
        assert_eq!(
            (status, &got["metadata"]["name"]),
            (StatusCode::OK, &json!("store-7"))
        );
        let (status, got) = call(&s, "GET", &format!("{works}/web"), None).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(got["metadata"]["namespace"], "store-7");
        // Created by the hub: held for its agent's cleanup from the start.
        assert_eq!(
            got["metadata"]["finalizers"],
            json!([flotilla_proto::contract::WORK_CLEANUP_FINALIZER])
        );
        let (status, list) = call(&s, "GET", works, None).await;
        assert_eq!(
            (status, list["items"].as_array().map(Vec::len)),
            (StatusCode::OK, Some(1))
        );
        let (status, list) = call(&s, "GET", clusters, None).await;
        assert_eq!(
            (status, list["kind"].as_str()),
            (StatusCode::OK, Some("ManagedClusterList"))
        );

        let mut edited = work("web", json!({"app": "web"}));
        edited["metadata"]["namespace"] = "store-7".into();
        let (status, got) = call(&s, "PUT", &format!("{works}/web"), Some(edited)).await;
        assert_eq!(
            (status, &got["metadata"]["labels"]["app"]),
            (StatusCode::OK, &json!("web"))
        );
        let (status, got) = call(
            &s,
            "PUT",
            &format!("{works}/web"),
            Some(work("other", json!({}))),
        )
        .await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{got}");

        let reported = json!({"conditions": [{"type": "Applied", "status": "True"}]});
        let (status, got) = call(
            &s,
            "PUT",
            &format!("{clusters}/store-7/status"),
            Some(json!({"metadata": {"name": "store-7"}, "status": reported})),
        )
        .await;
        assert_eq!((status, &got["status"]), (StatusCode::OK, &reported));
        let (status, got) = call(
            &s,
            "PUT",
            &format!("{works}/web/status"),
            Some(json!({"metadata": {"name": "web"}, "status": reported})),
        )
        .await;
        assert_eq!((status, &got["status"]), (StatusCode::OK, &reported));

        let (status, _) = call(&s, "DELETE", &format!("{works}/web"), None).await;
        assert_eq!(status, StatusCode::OK);
        // Held by its cleanup finalizer (no gateway here to let it go), then let go.
        let (status, mut got) = call(&s, "GET", &format!("{works}/web"), None).await;
        assert_eq!(status, StatusCode::OK);
        assert!(got["metadata"]["deletionTimestamp"].is_string(), "{got}");
        got["metadata"]["finalizers"] = json!([]);
        if let Some(o) = got.as_object_mut() {
            o.remove("status");
        }
        let (status, got) = call(&s, "PUT", &format!("{works}/web"), Some(got)).await;
        assert_eq!(status, StatusCode::OK, "{got}");
        let (status, got) = call(&s, "GET", &format!("{works}/web"), None).await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        assert_eq!(got["message"], "ManifestWork store-7/web not found");
        let (status, _) = call(&s, "DELETE", &format!("{clusters}/store-7"), None).await;
        assert_eq!(status, StatusCode::OK);

        let (status, got) = call(&s, "GET", "/apis/example.com/v1/widgets/w", None).await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        assert_eq!(
            got["message"],
            "the hub serves no resource widgets in example.com/v1"
        );
    }

    /// Kubernetes' ConfigMap on the core group's paths (`/api/v1`), as kubectl names them: created,
    /// listed in its namespace and across them, replaced, deleted; a bad one refused naming the
    /// object and the field; no status subresource.
    #[tokio::test]
    async fn config_maps_are_served_on_the_core_groups_paths() {
        let dir = tempfile::tempdir().unwrap();
        let s = state(dir.path());
        let maps = "/api/v1/namespaces/policies/configmaps";
        let config_map = |data: Value| {
            json!({"apiVersion": "v1", "kind": "ConfigMap",
                   "metadata": {"name": "settings"}, "data": data})
        };
        let (status, got) = call(&s, "POST", maps, Some(config_map(json!({"tier": "gold"})))).await;
        assert_eq!(status, StatusCode::CREATED, "{got}");
        assert_eq!(got["metadata"]["namespace"], "policies");
        assert!(
            got["metadata"]["labels"].is_null(),
            "no shard label on a ConfigMap: {got}"
        );
        let (status, list) = call(&s, "GET", maps, None).await;
        assert_eq!(
            (status, list["kind"].as_str(), list["apiVersion"].as_str()),
            (StatusCode::OK, Some("ConfigMapList"), Some("v1"))
        );
        assert_eq!(list["items"][0]["data"]["tier"], "gold");
        let (status, list) = call(&s, "GET", "/api/v1/configmaps", None).await;
        assert_eq!(
            (status, list["items"].as_array().map(Vec::len)),
            (StatusCode::OK, Some(1))
        );
        let (status, got) = call(
            &s,
            "PUT",
            &format!("{maps}/settings"),
            Some(config_map(json!({"tier": "silver"}))),
        )
        .await;
        assert_eq!(
            (status, &got["data"]["tier"]),
            (StatusCode::OK, &json!("silver"))
        );
        let (status, got) = call(
            &s,
            "PUT",
            &format!("{maps}/settings"),
            Some(config_map(json!({"tier": 2}))),
        )
        .await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
        assert_eq!(
            got["message"],
            "ConfigMap policies/settings: data.tier is a number; ConfigMap data values are strings (quote it)"
        );
        let (status, _) = call(
            &s,
            "PUT",
            &format!("{maps}/settings/status"),
            Some(json!({"metadata": {"name": "settings"}, "status": {}})),
        )
        .await;
        assert!(
            status.is_client_error(),
            "a ConfigMap has no status: {status}"
        );
        let (status, _) = call(&s, "DELETE", &format!("{maps}/settings"), None).await;
        assert_eq!(status, StatusCode::OK);
        let (status, got) = call(&s, "GET", &format!("{maps}/settings"), None).await;
        assert_eq!(
            (status, got["message"].as_str()),
            (
                StatusCode::NOT_FOUND,
                Some("ConfigMap policies/settings not found")
            )
        );
        let (status, got) = call(&s, "GET", "/api/v1/namespaces/policies/secrets", None).await;
        assert_eq!(
            (status, got["message"].as_str()),
            (
                StatusCode::NOT_FOUND,
                Some("the hub serves no resource secrets in v1")
            )
        );
    }

    /// OCM fields flotilla does not implement are refused before they are stored, naming the
    /// object and the field; the same objects with OCM's defaults are stored.
    #[test]
    fn ocm_fields_flotilla_does_not_implement_are_refused_before_storing() {
        let placement = |spec: Value| {
            json!({
                "apiVersion": "cluster.open-cluster-management.io/v1beta1", "kind": "Placement",
                "metadata": {"name": "stores", "namespace": "fleet"}, "spec": spec,
            })
        };
        let message =
            check_object(Kind::Placement, &placement(json!({"sortBy": "Score"}))).unwrap_err();
        assert!(
            message.starts_with("Placement fleet/stores: spec.sortBy: ")
                && message.ends_with("flotilla does not implement it yet"),
            "{message}"
        );
        assert_eq!(
            check_object(
                Kind::Placement,
                &placement(json!({"sortBy": "ClusterName", "scoreRateLimit": "1m"}))
            ),
            Ok(())
        );
        let set = |spec: Value| {
            json!({
                "apiVersion": "cluster.open-cluster-management.io/v1beta2",
                "kind": "ManagedClusterSet", "metadata": {"name": "stores"}, "spec": spec,
            })
        };
        let message = check_object(
            Kind::ManagedClusterSet,
            &set(json!({"managedNamespaces": [{"name": "shop"}]})),
        )
        .unwrap_err();
        assert!(
            message.starts_with("ManagedClusterSet stores: spec.managedNamespaces: "),
            "{message}"
        );
        assert_eq!(
            check_object(Kind::ManagedClusterSet, &set(json!({}))),
            Ok(())
        );
    }

    /// The governance kinds are checked by proto's validators before they are stored: the
    /// policy-collection examples pass, and a bad one is refused naming object and field.
    #[test]
    fn governance_objects_are_checked_before_storing() {
        let policy = |spec: Value| {
            json!({"apiVersion": "policy.open-cluster-management.io/v1", "kind": "Policy",
                   "metadata": {"name": "policy-namespace", "namespace": "default"}, "spec": spec})
        };
        let good = json!({"remediationAction": "inform", "disabled": false, "policy-templates": [
            {"objectDefinition": {"apiVersion": "policy.open-cluster-management.io/v1",
             "kind": "ConfigurationPolicy", "metadata": {"name": "c"},
             "spec": {"object-templates": [{"complianceType": "musthave", "objectDefinition":
                 {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "prod"}}}]}}}]});
        assert_eq!(check_object(Kind::Policy, &policy(good.clone())), Ok(()));
        let mut audit = good.clone();
        audit["remediationAction"] = "audit".into();
        let message = check_object(Kind::Policy, &policy(audit)).unwrap_err();
        assert_eq!(
            message,
            "Policy default/policy-namespace: spec.remediationAction is \"audit\"; use inform or enforce"
        );
        let mut dependent = good;
        dependent["dependencies"] = json!([]);
        let message = check_object(Kind::Policy, &policy(dependent)).unwrap_err();
        assert!(
            message.contains("spec.dependencies is not supported by flotilla; remove it"),
            "{message}"
        );
        let record = |name: &str| {
            json!({"apiVersion": "governance.flotilla.io/v1alpha1", "kind": "ClusterCompliance",
                   "metadata": {"name": name, "namespace": "store-7"}, "spec": {}})
        };
        assert_eq!(
            check_object(Kind::ClusterCompliance, &record("store-7")),
            Ok(())
        );
        let message = check_object(Kind::ClusterCompliance, &record("other")).unwrap_err();
        assert!(
            message.starts_with(
                "ClusterCompliance store-7/other: a cluster's compliance record is named as its cluster"
            ),
            "{message}"
        );
        let binding = json!({"apiVersion": "policy.open-cluster-management.io/v1",
            "kind": "PlacementBinding", "metadata": {"name": "b", "namespace": "default"},
            "placementRef": {"apiGroup": "apps.open-cluster-management.io", "kind": "PlacementRule", "name": "r"},
            "subjects": [{"apiGroup": "policy.open-cluster-management.io", "kind": "Policy", "name": "p"}]});
        let message = check_object(Kind::PlacementBinding, &binding).unwrap_err();
        assert!(
            message.starts_with("PlacementBinding default/b: placementRef.kind is PlacementRule"),
            "{message}"
        );
        let set = json!({"apiVersion": "policy.open-cluster-management.io/v1beta1",
            "kind": "PolicySet", "metadata": {"name": "s", "namespace": "default"},
            "spec": {"policies": ["p", ""]}});
        let message = check_object(Kind::PolicySet, &set).unwrap_err();
        assert_eq!(
            message,
            "PolicySet default/s: spec.policies[1] is empty; name a Policy"
        );
    }

    /// A refusal names the object even when it has no name: `<unnamed>`, never an empty one.
    #[test]
    fn refusals_of_objects_without_a_name_say_unnamed() {
        let placement = json!({
            "apiVersion": "cluster.open-cluster-management.io/v1beta1", "kind": "Placement",
            "metadata": {"name": "", "namespace": "default"},
            "spec": {"numberOfClusters": "three"},
        });
        let message = check_object(Kind::Placement, &placement).unwrap_err();
        assert!(
            message.starts_with("Placement default/<unnamed>: does not parse"),
            "{message}"
        );
        let mut unnamed = work("", json!({}));
        unnamed["metadata"]["namespace"] = "store-7".into();
        let message = check_object(Kind::ManifestWork, &unnamed).unwrap_err();
        assert!(
            message.starts_with("ManifestWork store-7/<unnamed>: manifest #0 has no metadata.name"),
            "{message}"
        );
        let chunk = json!({
            "apiVersion": "work.flotilla.io/v1alpha1", "kind": "ManifestChunk",
            "metadata": {"namespace": "store-7"}, "spec": {"data": "aGVsbG8="},
        });
        let message = check_object(Kind::ManifestChunk, &chunk).unwrap_err();
        assert!(
            message.starts_with("ManifestChunk store-7/<unnamed>: the name must be"),
            "{message}"
        );
    }
}
