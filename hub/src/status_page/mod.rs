//! The fleet status page: a read-only view of the fleet for operators, served by the hub under
//! the operator API (so behind the operator's client certificate) at `/ui/`, with a JSON API
//! at `/ui/api/...`. A browser reaches it through `flotilla dashboard`, which listens on
//! loopback and forwards with the operator's certificate, as `kubectl proxy` does.
//!
//! The first screen answers seed 001's question, "which clusters are failing right now, and
//! since when?": the clusters whose `ManagedClusterConditionAvailable` is not True, the longest
//! failing first, with the condition's lastTransitionTime. Further screens list every cluster
//! (labels, claims, version, session), works with the spoke's messages verbatim, placements
//! (those deciding no cluster first) and rollouts. The first screen also answers governance's
//! questions, from the policy controller's aggregation ([`ComplianceView`]): which policies
//! are violated on how many clusters, and which clusters violate how many policies, failing
//! first and filtered by the clusters' labels; `/ui/compliance` pages through both.
//!
//! The page's model ([`view::Model`]) is a watch cache of compact rows fed by the store's one
//! list-then-watch loop per kind (the fleet gauges' loops when they run, see
//! [`StatusPage::readers`]); a request filters and pages it in memory and never reads the
//! store, and no response holds more than one page ([`view::MAX_PAGE_SIZE`] rows). Pages are
//! rendered on the server ([`render`]), every value from the store escaped, with no script and
//! a Content-Security-Policy that allows none: labels, claims and spoke messages are user input.
//! The stylesheet is embedded in the binary; the page needs no network.
//!
//! Not for: changing anything (every route is GET), or serving outside the operator API.

pub mod render;
pub mod sessions;
pub mod view;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::SystemTime;

use async_trait::async_trait;
use axum::extract::{Query, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;
use axum::{Json, Router};
use flotilla_gateway::registry::SessionPresence;
use flotilla_proto::api::Kind;
use flotilla_store::reflect::{Reflector, reflect_all};
use flotilla_store::{Object, Store, WatchEvent};
use jiff::Timestamp;
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio::sync::{RwLock, watch};

use crate::controllers::governance::ComplianceView;
use view::{
    ClusterItem, ClusterQuery, ClusterState, LabelSelector, ListQuery, Model, PageRequest,
    WorkQuery,
};

/// The kinds the page shows, each read by its own list-then-watch loop.
pub const KINDS: [Kind; 5] = [
    Kind::ManagedCluster,
    Kind::ManifestWork,
    Kind::Placement,
    Kind::PlacementDecision,
    Kind::ManifestWorkReplicaSet,
];

/// Longest name filter (a Kubernetes name is at most 253 bytes).
pub const MAX_NAME_FILTER: usize = 253;
/// Longest label selector a request may carry.
pub const MAX_SELECTOR: usize = 1024;

/// Where clusters' sessions are, as far as this hub can learn: the in-process gateway's
/// sessions (single node), or the shard owners' ([`sessions::ShardOwners`], scale-out).
#[async_trait]
pub trait LiveSessions: Send + Sync {
    /// The presence of each of a page's `clusters` that the source knows of, asked as one
    /// batch (a page of 50 rows is one question per gateway, not 50). A cluster left out
    /// shows "—": nobody could say, which is not the same as disconnected. Bounded in time.
    async fn presence(&self, clusters: &[&str]) -> HashMap<String, SessionPresence>;
}

#[async_trait]
impl LiveSessions for flotilla_gateway::Gateway {
    async fn presence(&self, clusters: &[&str]) -> HashMap<String, SessionPresence> {
        clusters
            .iter()
            .filter_map(|c| Some((c.to_string(), self.session_presence(c)?)))
            .collect()
    }
}

/// The status page: its model of the fleet and where sessions are. Cheap to clone.
#[derive(Clone)]
pub struct StatusPage {
    model: Arc<RwLock<Model>>,
    /// Kinds listed at least once; the page answers 503 until all of [`KINDS`] have been.
    listed: watch::Sender<usize>,
    sessions: Option<Arc<dyn LiveSessions>>,
    /// The fleet's compliance as the policy controller last aggregated it.
    compliance: ComplianceView,
}

impl StatusPage {
    pub fn new(sessions: Option<Arc<dyn LiveSessions>>) -> StatusPage {
        StatusPage {
            model: Arc::default(),
            listed: watch::Sender::new(0),
            sessions,
            compliance: ComplianceView::default(),
        }
    }

    /// Shows `compliance` (the policy controller's) rather than none.
    pub fn with_compliance(mut self, compliance: ComplianceView) -> StatusPage {
        self.compliance = compliance;
        self
    }

    /// Keeps the model current from `store` until `stop`, with a loop of its own per kind.
    pub async fn run(self, store: Arc<dyn Store>, stop: watch::Receiver<bool>) {
        reflect_all(store.as_ref(), self.readers(), stop).await;
    }

    /// The model's caches, one per kind, for loops that feed other caches too (the hub's
    /// fleet gauges read four of the same kinds: one watch per kind serves both).
    pub fn readers(&self) -> Vec<(Kind, Arc<dyn Reflector>)> {
        KINDS
            .iter()
            .map(|kind| {
                let feed: Arc<dyn Reflector> = Arc::new(KindFeed {
                    kind: *kind,
                    page: self.clone(),
                    listed_once: std::sync::atomic::AtomicBool::new(false),
                });
                (*kind, feed)
            })
            .collect()
    }

    /// Whether every kind has been listed, so the page shows the whole fleet.
    pub fn ready(&self) -> bool {
        *self.listed.borrow() >= KINDS.len()
    }

    /// The routes under `/ui`, for the operator API to serve behind its authentication.
    pub fn router(self) -> Router {
        Router::new()
            .route("/ui", get(|| async { Redirect::permanent("/ui/") }))
            .route("/ui/", get(overview_page))
            .route("/ui/clusters", get(clusters_page))
            .route("/ui/works", get(works_page))
            .route("/ui/placements", get(placements_page))
            .route("/ui/rollouts", get(rollouts_page))
            .route("/ui/compliance", get(compliance_page))
            .route("/ui/style.css", get(stylesheet))
            .route("/ui/api/summary", get(summary_api))
            .route("/ui/api/clusters", get(clusters_api))
            .route("/ui/api/works", get(works_api))
            .route("/ui/api/placements", get(placements_api))
            .route("/ui/api/rollouts", get(rollouts_api))
            .route("/ui/api/compliance", get(compliance_api))
            .with_state(self)
    }

    /// The model, once every kind is listed; a refusal naming what is missing before.
    async fn model(&self) -> Result<tokio::sync::RwLockReadGuard<'_, Model>, Refusal> {
        if !self.ready() {
            return Err(Refusal(
                StatusCode::SERVICE_UNAVAILABLE,
                "the status page is still reading the fleet from the store (ManagedClusters, \
                 ManifestWorks, Placements, PlacementDecisions, ManifestWorkReplicaSets); \
                 try again in a moment"
                    .into(),
            ));
        }
        Ok(self.model.read().await)
    }

    /// Each cluster of a page with where its session is.
    async fn with_sessions(&self, items: Vec<ClusterItem>) -> Vec<ClusterEntry> {
        let mut presence = match &self.sessions {
            Some(s) => {
                let names: Vec<&str> = items.iter().map(|i| i.cluster.name.as_str()).collect();
                s.presence(&names).await
            }
            None => HashMap::new(),
        };
        items
            .into_iter()
            .map(|item| {
                let found = presence.remove(&item.cluster.name);
                ClusterEntry::new(item, found)
            })
            .collect()
    }
}

/// One kind's loop into the shared model.
struct KindFeed {
    kind: Kind,
    page: StatusPage,
    listed_once: std::sync::atomic::AtomicBool,
}

#[async_trait]
impl Reflector for KindFeed {
    async fn replace(&self, items: Vec<Object>) {
        self.page.model.write().await.replace(self.kind, items);
        if !self
            .listed_once
            .swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            self.page.listed.send_modify(|n| *n += 1);
        }
    }

    async fn apply(&self, event: WatchEvent) {
        self.page.model.write().await.apply(self.kind, event);
    }
}

/// A cluster row as the page and the JSON API give it: the store's view and the session's.
#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ClusterEntry {
    #[serde(flatten)]
    pub item: ClusterItem,
    /// The carrier of its live session (`grpc`, `quic`), if it has one.
    pub transport: Option<String>,
    /// When a session of it was last seen: now while connected, else when the last one ended
    /// on the gateway holding its shard (the hub's own in single-node mode). Unknown when
    /// that gateway has seen none since it started or took the shard over, or did not answer
    /// in time.
    pub last_seen: Option<Timestamp>,
    /// When its live session here was established.
    pub session_since: Option<Timestamp>,
    pub connected: bool,
}

impl ClusterEntry {
    fn new(item: ClusterItem, presence: Option<SessionPresence>) -> ClusterEntry {
        let wall = |t: SystemTime| Timestamp::try_from(t).ok();
        let (transport, last_seen, session_since) = match presence {
            Some(SessionPresence::Connected { carrier, since }) => (
                Some(carrier.to_string()),
                Some(Timestamp::now()),
                wall(since),
            ),
            Some(SessionPresence::Departed { at }) => (None, wall(at), None),
            None => (None, None, None),
        };
        ClusterEntry {
            item,
            connected: transport.is_some(),
            transport,
            last_seen,
            session_since,
        }
    }
}

/// A request the page refuses, said in words.
struct Refusal(StatusCode, String);

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        (
            self.0,
            Json(json!({
                "apiVersion": "v1", "kind": "Status", "status": "Failure",
                "message": self.1, "code": self.0.as_u16(),
            })),
        )
            .into_response()
    }
}

/// The query parameters every list takes; each is checked and bounded.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
pub struct Params {
    /// clusters: `failing`, `available`, `all`; works, placements, rollouts: `failing`, `all`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<String>,
    /// Part of the name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub q: Option<String>,
    /// Clusters and compliance: kubectl's `-l` equality selector on the clusters' labels
    /// (`labels=` is the same).
    #[serde(default, alias = "labels", skip_serializing_if = "Option::is_none")]
    pub selector: Option<String>,
    /// Works: only this cluster's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub page: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<String>,
}

impl Params {
    fn filter(value: &Option<String>, param: &str, max: usize) -> Result<Option<String>, Refusal> {
        match value.as_deref().map(str::trim) {
            None | Some("") => Ok(None),
            Some(v) if v.len() > max => Err(Refusal(
                StatusCode::BAD_REQUEST,
                format!("{param}: at most {max} bytes"),
            )),
            Some(v) => Ok(Some(v.to_string())),
        }
    }

    fn page(&self) -> Result<PageRequest, Refusal> {
        let number = |value: &Option<String>, param: &str, default: usize| match value
            .as_deref()
            .map(str::trim)
        {
            None | Some("") => Ok(default),
            Some(v) => v.parse::<usize>().ok().filter(|n| *n >= 1).ok_or_else(|| {
                Refusal(
                    StatusCode::BAD_REQUEST,
                    format!("{param}={v:?}: a whole number of at least 1 is needed"),
                )
            }),
        };
        let limit = number(&self.limit, "limit", view::DEFAULT_PAGE_SIZE)?;
        if limit > view::MAX_PAGE_SIZE {
            return Err(Refusal(
                StatusCode::BAD_REQUEST,
                format!(
                    "limit={limit}: at most {} rows per page; ask for the next page instead",
                    view::MAX_PAGE_SIZE
                ),
            ));
        }
        Ok(PageRequest {
            page: number(&self.page, "page", 1)?,
            limit,
        })
    }

    fn failing(&self) -> Result<bool, Refusal> {
        match self.state.as_deref() {
            None | Some("") | Some("all") => Ok(false),
            Some("failing") => Ok(true),
            Some(other) => Err(Refusal(
                StatusCode::BAD_REQUEST,
                format!("state={other:?}: use failing or all"),
            )),
        }
    }

    fn cluster_query(&self) -> Result<ClusterQuery, Refusal> {
        let state = match self.state.as_deref() {
            None | Some("") | Some("all") => ClusterState::All,
            Some("failing") => ClusterState::Failing,
            Some("available") => ClusterState::Available,
            Some(other) => {
                return Err(Refusal(
                    StatusCode::BAD_REQUEST,
                    format!("state={other:?}: use failing, available or all"),
                ));
            }
        };
        Ok(ClusterQuery {
            state,
            name: Self::filter(&self.q, "q", MAX_NAME_FILTER)?,
            selector: self.selector()?,
        })
    }

    fn selector(&self) -> Result<LabelSelector, Refusal> {
        let selector = Self::filter(&self.selector, "selector", MAX_SELECTOR)?;
        LabelSelector::parse(selector.as_deref().unwrap_or(""))
            .map_err(|e| Refusal(StatusCode::BAD_REQUEST, e))
    }

    fn work_query(&self) -> Result<WorkQuery, Refusal> {
        Ok(WorkQuery {
            cluster: Self::filter(&self.cluster, "cluster", MAX_NAME_FILTER)?,
            failing: self.failing()?,
            name: Self::filter(&self.q, "q", MAX_NAME_FILTER)?,
        })
    }

    fn list_query(&self) -> Result<ListQuery, Refusal> {
        Ok(ListQuery {
            failing: self.failing()?,
            name: Self::filter(&self.q, "q", MAX_NAME_FILTER)?,
        })
    }
}

/// An HTML page with the headers that keep it inert: no script may run (the page has none),
/// nothing loads from elsewhere, and it is never cached (it is a view of now).
fn html(body: String) -> Response {
    let mut response = body.into_response();
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

/// The page's Content-Security-Policy: its own stylesheet and nothing else.
pub const CSP: &str = "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; \
                       base-uri 'none'; frame-ancestors 'none'";

async fn stylesheet() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/css; charset=utf-8"),
            (header::CACHE_CONTROL, "max-age=300"),
        ],
        render::STYLESHEET,
    )
        .into_response()
}

async fn overview_page(
    State(page): State<StatusPage>,
    Query(params): Query<Params>,
) -> Result<Response, Refusal> {
    let request = params.page()?;
    let selector = params.selector()?;
    let snapshot = page.compliance.snapshot();
    let (summary, failing, placements, compliance) = {
        let model = page.model().await?;
        let failing = model.clusters(
            &ClusterQuery {
                state: ClusterState::Failing,
                ..Default::default()
            },
            request,
        );
        let placements = model.placements(
            &ListQuery {
                failing: true,
                name: None,
            },
            PageRequest {
                page: 1,
                limit: render::OVERVIEW_ROWS,
            },
        );
        let compliance = model.compliance(
            &snapshot,
            &selector,
            PageRequest {
                page: 1,
                limit: render::OVERVIEW_ROWS,
            },
        );
        (model.summary(), failing, placements, compliance)
    };
    let (failing, entries) = split(failing);
    let entries = page.with_sessions(entries).await;
    Ok(html(render::overview(
        &summary,
        &failing.with_items(entries),
        &placements,
        &params,
        &compliance,
        Timestamp::now(),
    )))
}

async fn compliance_view(
    page: &StatusPage,
    params: &Params,
) -> Result<view::ComplianceView, Refusal> {
    let (selector, request) = (params.selector()?, params.page()?);
    let snapshot = page.compliance.snapshot();
    Ok(page
        .model()
        .await?
        .compliance(&snapshot, &selector, request))
}

async fn compliance_page(
    State(page): State<StatusPage>,
    Query(params): Query<Params>,
) -> Result<Response, Refusal> {
    let compliance = compliance_view(&page, &params).await?;
    Ok(html(render::compliance(
        &params,
        &compliance,
        Timestamp::now(),
    )))
}

async fn compliance_api(
    State(page): State<StatusPage>,
    Query(params): Query<Params>,
) -> Result<Response, Refusal> {
    Ok(Json(compliance_view(&page, &params).await?).into_response())
}

/// A page's rows apart from its counts, to add the sessions without holding the model.
fn split<T>(page: view::Page<T>) -> (view::Page<()>, Vec<T>) {
    let view::Page {
        total,
        page,
        pages,
        limit,
        items,
    } = page;
    (
        view::Page {
            total,
            page,
            pages,
            limit,
            items: Vec::new(),
        },
        items,
    )
}

impl view::Page<()> {
    fn with_items<T>(self, items: Vec<T>) -> view::Page<T> {
        view::Page {
            total: self.total,
            page: self.page,
            pages: self.pages,
            limit: self.limit,
            items,
        }
    }
}

async fn cluster_entries(
    page: &StatusPage,
    params: &Params,
) -> Result<view::Page<ClusterEntry>, Refusal> {
    let (query, request) = (params.cluster_query()?, params.page()?);
    let clusters = page.model().await?.clusters(&query, request);
    let (counts, items) = split(clusters);
    Ok(counts.with_items(page.with_sessions(items).await))
}

async fn clusters_page(
    State(page): State<StatusPage>,
    Query(params): Query<Params>,
) -> Result<Response, Refusal> {
    let clusters = cluster_entries(&page, &params).await?;
    Ok(html(render::clusters(&params, &clusters, Timestamp::now())))
}

async fn clusters_api(
    State(page): State<StatusPage>,
    Query(params): Query<Params>,
) -> Result<Response, Refusal> {
    Ok(Json(cluster_entries(&page, &params).await?).into_response())
}

async fn works_page(
    State(page): State<StatusPage>,
    Query(params): Query<Params>,
) -> Result<Response, Refusal> {
    let (query, request) = (params.work_query()?, params.page()?);
    let works = page.model().await?.works(&query, request);
    Ok(html(render::works(&params, &works, Timestamp::now())))
}

async fn works_api(
    State(page): State<StatusPage>,
    Query(params): Query<Params>,
) -> Result<Response, Refusal> {
    let (query, request) = (params.work_query()?, params.page()?);
    Ok(Json(page.model().await?.works(&query, request)).into_response())
}

async fn placements_page(
    State(page): State<StatusPage>,
    Query(params): Query<Params>,
) -> Result<Response, Refusal> {
    let (query, request) = (params.list_query()?, params.page()?);
    let placements = page.model().await?.placements(&query, request);
    Ok(html(render::placements(
        &params,
        &placements,
        Timestamp::now(),
    )))
}

async fn placements_api(
    State(page): State<StatusPage>,
    Query(params): Query<Params>,
) -> Result<Response, Refusal> {
    let (query, request) = (params.list_query()?, params.page()?);
    Ok(Json(page.model().await?.placements(&query, request)).into_response())
}

async fn rollouts_page(
    State(page): State<StatusPage>,
    Query(params): Query<Params>,
) -> Result<Response, Refusal> {
    let (query, request) = (params.list_query()?, params.page()?);
    let rollouts = page.model().await?.rollouts(&query, request);
    Ok(html(render::rollouts(&params, &rollouts, Timestamp::now())))
}

async fn rollouts_api(
    State(page): State<StatusPage>,
    Query(params): Query<Params>,
) -> Result<Response, Refusal> {
    let (query, request) = (params.list_query()?, params.page()?);
    Ok(Json(page.model().await?.rollouts(&query, request)).into_response())
}

async fn summary_api(State(page): State<StatusPage>) -> Result<Response, Refusal> {
    Ok(Json(page.model().await?.summary()).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use http_body_util::BodyExt as _;
    use tower::ServiceExt as _;

    async fn get(page: &StatusPage, uri: &str) -> (StatusCode, String) {
        let response = page
            .clone()
            .router()
            .oneshot(
                axum::http::Request::get(uri)
                    .body(Body::empty())
                    .expect("a request"),
            )
            .await
            .expect("the router answers");
        let status = response.status();
        let body = response.into_body().collect().await.expect("a body");
        (
            status,
            String::from_utf8_lossy(&body.to_bytes()).into_owned(),
        )
    }

    /// Lists every kind into `page` as its loops would: clusters `a` (failing) and `b`.
    async fn listed(page: &StatusPage) {
        for kind in KINDS {
            let feed = KindFeed {
                kind,
                page: page.clone(),
                listed_once: Default::default(),
            };
            let items = if kind == Kind::ManagedCluster {
                vec![
                    json!({"metadata": {"name": "a"}, "status": {"conditions": [
                        {"type": view::AVAILABLE, "status": "False",
                         "lastTransitionTime": "2026-11-23T06:00:00Z"}]}}),
                    json!({"metadata": {"name": "b"}, "status": {"conditions": [
                        {"type": view::AVAILABLE, "status": "True",
                         "lastTransitionTime": "2026-11-23T06:00:00Z"}]}}),
                ]
            } else {
                Vec::new()
            };
            feed.replace(items).await;
        }
    }

    #[tokio::test]
    async fn the_page_waits_for_every_list_then_answers_one_checked_page() {
        let page = StatusPage::new(None);
        let (status, body) = get(&page, "/ui/").await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(body.contains("still reading the fleet"), "{body}");

        listed(&page).await;
        let (status, body) = get(&page, "/ui/").await;
        assert_eq!(status, StatusCode::OK);
        assert!(body.contains("data-cluster=\"a\""), "{body}");
        assert!(
            !body.contains("data-cluster=\"b\""),
            "b is Available: {body}"
        );

        let (status, body) = get(&page, "/ui/api/clusters?state=available").await;
        assert_eq!(status, StatusCode::OK);
        let answer: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(answer["total"], 1);
        assert_eq!(answer["items"][0]["name"], "b");
        assert_eq!(answer["items"][0]["transport"], serde_json::Value::Null);

        // Bad parameters are refused with what to write instead.
        for (uri, says) in [
            ("/ui/api/clusters?limit=0", "a whole number of at least 1"),
            ("/ui/api/clusters?limit=501", "at most 500 rows per page"),
            ("/ui/clusters?state=broken", "use failing, available or all"),
            ("/ui/api/works?state=available", "use failing or all"),
            ("/ui/api/clusters?selector=%3Dprod", "has no label key"),
            ("/ui/api/clusters?page=two", "two\\\": a whole number"),
        ] {
            let (status, body) = get(&page, uri).await;
            assert_eq!(status, StatusCode::BAD_REQUEST, "{uri}: {body}");
            assert!(body.contains(says), "{uri}: {body}");
        }
        let long = format!("/ui/api/clusters?q={}", "x".repeat(MAX_NAME_FILTER + 1));
        assert_eq!(get(&page, &long).await.0, StatusCode::BAD_REQUEST);

        // The page's stylesheet is served from the binary, and the page allows no script.
        let response = page
            .clone()
            .router()
            .oneshot(
                axum::http::Request::get("/ui/")
                    .body(Body::empty())
                    .unwrap(),
            )
            .await
            .unwrap();
        let csp = response.headers()[header::CONTENT_SECURITY_POLICY]
            .to_str()
            .unwrap();
        assert!(csp.contains("default-src 'none'") && !csp.contains("script-src"));
        let (status, css) = get(&page, "/ui/style.css").await;
        assert_eq!(status, StatusCode::OK);
        assert!(css.contains(".status.False"));
    }

    /// The first screen and the JSON twin show what the policy controller aggregated, failing
    /// first, filtered by cluster labels (`labels=` as `selector=`), and refuse a bad selector.
    #[tokio::test]
    async fn compliance_is_on_the_first_screen_and_in_the_api() {
        use crate::controllers::governance::{ComplianceSnapshot, RootCompliance};
        use crate::controllers::scheduling::fleet::Key;
        use flotilla_proto::api::policy::ComplianceState::*;
        let compliance = ComplianceView::default();
        let page = StatusPage::new(None).with_compliance(compliance.clone());
        listed(&page).await;
        let (_, body) = get(&page, "/ui/").await;
        assert!(body.contains("Policies: 0 policies"), "{body}");
        compliance.publish(ComplianceSnapshot {
            policies: vec![
                RootCompliance {
                    key: Key::new("policies", "namespace"),
                    compliant: Some(NonCompliant),
                    clusters: vec![
                        ("a".into(), Some(NonCompliant)),
                        ("b".into(), Some(Compliant)),
                    ]
                    .into(),
                },
                RootCompliance {
                    key: Key::new("policies", "limits"),
                    compliant: Some(Compliant),
                    clusters: vec![("a".into(), Some(Compliant))].into(),
                },
            ],
        });
        let (status, body) = get(&page, "/ui/").await;
        assert_eq!(status, StatusCode::OK);
        let namespace = body
            .find("data-policy=\"policies/namespace\"")
            .expect("listed");
        let limits = body
            .find("data-policy=\"policies/limits\"")
            .expect("listed");
        assert!(namespace < limits, "the violated policy first: {body}");
        assert!(body.contains("1</span> of 2 clusters"), "{body}");
        assert!(body.contains("data-compliance-cluster=\"a\""), "{body}");

        let (status, body) = get(&page, "/ui/api/compliance?labels=%21env").await;
        assert_eq!(status, StatusCode::OK, "{body}");
        let answer: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(answer["policies"]["total"], 2);
        assert_eq!(answer["policies"]["items"][0]["name"], "namespace");
        assert_eq!(answer["policies"]["items"][0]["nonCompliant"], 1);
        assert_eq!(answer["clusters"]["items"][0]["cluster"], "a");
        assert_eq!(answer["clusters"]["items"][0]["violated"], 1);
        assert_eq!(
            answer["clusters"]["items"][0]["violating"],
            json!(["policies/namespace"])
        );
        // A selector no cluster matches leaves nothing to show.
        let (_, body) = get(&page, "/ui/api/compliance?selector=env%3Dprod").await;
        let answer: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(answer["policies"]["total"], 0, "{answer}");
        let (status, body) = get(&page, "/ui/compliance?selector=%3Dprod").await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert!(body.contains("has no label key"), "{body}");
        let (status, body) = get(&page, "/ui/compliance").await;
        assert_eq!(status, StatusCode::OK);
        assert!(body.contains("<h1>Compliance</h1>"), "{body}");
    }
}
