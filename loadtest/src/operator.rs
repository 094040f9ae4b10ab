//! The hub's operator API, as the harness uses it: the same HTTPS endpoints and operator
//! credentials as the `flotilla` CLI, over a small pool of kept-alive connections so that
//! registering ten thousand clusters is not ten thousand TLS handshakes.

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, anyhow};
use flotilla_cli::cli::{collection_path, object_path};
use flotilla_cli::client::{ApiError, OperatorClient, OperatorConfig};
use flotilla_proto::api::Kind;
use serde_json::Value;

/// Requests the harness keeps in flight against the operator API: as many as the client keeps
/// connections for.
pub const POOL_SIZE: usize = flotilla_cli::client::IDLE_CONNECTIONS;

/// A client of one hub's operator API: the CLI's client plus the calls the harness makes.
///
/// Its requests run on a thread and runtime of their own: the harness's runtime also drives
/// thousands of simulated agents, and a measurement's request, its connection and the parse of
/// a megabyte answer are not to wait behind them when they keep it busy (10,000 agents
/// evaluating 100 policies each), so that the figures are the hub's, not the harness's queue.
pub struct OperatorApi {
    client: Arc<OperatorClient>,
    runtime: Dedicated,
}

/// A current-thread runtime on a thread of its own, stopped (and dropped on that thread) when
/// this is dropped.
struct Dedicated {
    handle: tokio::runtime::Handle,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Dedicated {
    fn start(name: &str) -> anyhow::Result<Dedicated> {
        let (handle_tx, handle_rx) = std::sync::mpsc::channel();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(runtime) => runtime,
                    Err(e) => {
                        let _ = handle_tx.send(Err(e));
                        return;
                    }
                };
                let _ = handle_tx.send(Ok(runtime.handle().clone()));
                runtime.block_on(async {
                    let _ = stopped.await;
                });
            })
            .with_context(|| format!("starting the {name} thread"))?;
        let handle = handle_rx
            .recv()
            .map_err(|_| anyhow!("the {name} thread ended before its runtime started"))?
            .with_context(|| format!("building the {name} runtime"))?;
        Ok(Dedicated {
            handle,
            stop: Some(stop),
        })
    }
}

impl Drop for Dedicated {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

impl OperatorApi {
    /// Reads `<data-dir>/operator/config.yaml`, as the hub wrote it.
    pub fn from_data_dir(data_dir: &Path) -> anyhow::Result<Arc<OperatorApi>> {
        let path = data_dir.join("operator/config.yaml");
        let config = OperatorConfig::load(&path).with_context(|| {
            format!(
                "{} has no operator credentials: is it a flotilla hub's --data-dir?",
                data_dir.display()
            )
        })?;
        Ok(Arc::new(OperatorApi {
            client: Arc::new(OperatorClient::new(&config)?),
            runtime: Dedicated::start("operator-api")?,
        }))
    }

    /// host:port of the API.
    pub fn address(&self) -> &str {
        self.client.address()
    }

    /// One request; the JSON body of a 2xx answer, or an error with the hub's message.
    pub async fn request(
        &self,
        method: http::Method,
        path: &str,
        body: Option<&Value>,
    ) -> anyhow::Result<Value> {
        let what = format!("{method} {path}");
        let (_, value) = self.exchange(method, path, body).await.context(what)?;
        Ok(value)
    }

    /// One request on this API's own runtime: the client's connections are dialled, and their
    /// tasks spawned, where their first request runs, so every request goes through here (a
    /// connection made on the harness's runtime and pooled would be read by that runtime
    /// however the later request was made). A refusal stays an [`ApiError`] for callers that
    /// match on its status.
    async fn exchange(
        &self,
        method: http::Method,
        path: &str,
        body: Option<&Value>,
    ) -> anyhow::Result<(http::StatusCode, Value)> {
        let client = self.client.clone();
        let (what, path, body) = (format!("{method} {path}"), path.to_owned(), body.cloned());
        self.runtime
            .handle
            .spawn(async move { client.request(method, &path, body.as_ref()).await })
            .await
            .map_err(|e| anyhow!("{what}: the request's task ended: {e}"))?
    }

    /// Registers (creating if needed) accepted cluster `name` whose agent holds a certificate
    /// for key `key_sha256`: the hub's development path around the join flow.
    pub async fn register_dev_key(&self, name: &str, key_sha256: &str) -> anyhow::Result<()> {
        self.request(
            http::Method::POST,
            &format!("/registration/v1/clusters/{name}/dev-key"),
            Some(&serde_json::json!({ "keySha256": key_sha256 })),
        )
        .await?;
        Ok(())
    }

    /// Creates a bootstrap token good for `uses` joins within `ttl`, auto-accepting: what
    /// `flotilla token create --uses N --auto-accept` does. Returns the token and the hub CA's
    /// fingerprint that joining agents pin.
    pub async fn bootstrap_token(
        &self,
        uses: usize,
        ttl: std::time::Duration,
    ) -> anyhow::Result<(String, String)> {
        let created = self
            .request(
                http::Method::POST,
                "/registration/v1/tokens",
                Some(&serde_json::json!({
                    "ttlSeconds": ttl.as_secs().max(1),
                    "uses": u32::try_from(uses).context("too many uses for one token")?,
                    "autoAccept": true,
                })),
            )
            .await?;
        let field = |f: &str| {
            created[f]
                .as_str()
                .map(str::to_string)
                .with_context(|| format!("the hub's token answer has no {f}"))
        };
        Ok((field("token")?, field("caFingerprint")?))
    }

    /// Every ManagedCluster.
    pub async fn clusters(&self) -> anyhow::Result<Vec<Value>> {
        let list = self
            .request(
                http::Method::GET,
                "/apis/cluster.open-cluster-management.io/v1/managedclusters",
                None,
            )
            .await?;
        Ok(items(list))
    }

    /// Every ManifestWork, in all namespaces.
    pub async fn works(&self) -> anyhow::Result<Vec<Value>> {
        let list = self
            .request(
                http::Method::GET,
                "/apis/work.open-cluster-management.io/v1/manifestworks",
                None,
            )
            .await?;
        Ok(items(list))
    }

    /// Creates a ManifestWork in its namespace (the cluster's name).
    pub async fn create_work(&self, work: &Value) -> anyhow::Result<Value> {
        let ns = work["metadata"]["namespace"]
            .as_str()
            .ok_or_else(|| anyhow!("ManifestWork without metadata.namespace"))?;
        self.request(
            http::Method::POST,
            &format!("/apis/work.open-cluster-management.io/v1/namespaces/{ns}/manifestworks"),
            Some(work),
        )
        .await
    }
}

impl OperatorApi {
    /// Every object of `kind` in `namespace` (or all namespaces).
    pub async fn list(&self, kind: Kind, namespace: Option<&str>) -> anyhow::Result<Vec<Value>> {
        Ok(items(
            self.request(http::Method::GET, &collection_path(kind, namespace), None)
                .await?,
        ))
    }

    /// One object, or `None` when there is none.
    pub async fn get(
        &self,
        kind: Kind,
        namespace: Option<&str>,
        name: &str,
    ) -> anyhow::Result<Option<Value>> {
        match self
            .exchange(http::Method::GET, &object_path(kind, namespace, name), None)
            .await
        {
            Ok((_, v)) => Ok(Some(v)),
            Err(e)
                if e.downcast_ref::<ApiError>()
                    .is_some_and(|a| a.status == http::StatusCode::NOT_FOUND) =>
            {
                Ok(None)
            }
            Err(e) => Err(e.context(format!("GET {kind} {name}"))),
        }
    }

    /// Creates the object; one that exists already is replaced (`kubectl apply`'s outcome).
    pub async fn apply(&self, obj: &Value) -> anyhow::Result<Value> {
        let kind = Kind::from_name(obj["kind"].as_str().unwrap_or_default())
            .ok_or_else(|| anyhow!("not a hub kind: {}", obj["kind"]))?;
        let ns = obj["metadata"]["namespace"].as_str();
        let name = obj["metadata"]["name"].as_str().unwrap_or_default();
        match self
            .exchange(http::Method::POST, &collection_path(kind, ns), Some(obj))
            .await
        {
            Ok((_, v)) => Ok(v),
            Err(e)
                if e.downcast_ref::<ApiError>()
                    .is_some_and(|a| a.status == http::StatusCode::CONFLICT) =>
            {
                self.request(http::Method::PUT, &object_path(kind, ns, name), Some(obj))
                    .await
            }
            Err(e) => Err(e.context(format!("creating {kind} {name}"))),
        }
    }

    /// Replaces an object (its `metadata.resourceVersion`, if set, must still be current).
    pub async fn replace(&self, obj: &Value) -> anyhow::Result<Value> {
        let kind = Kind::from_name(obj["kind"].as_str().unwrap_or_default())
            .ok_or_else(|| anyhow!("not a hub kind: {}", obj["kind"]))?;
        let ns = obj["metadata"]["namespace"].as_str();
        let name = obj["metadata"]["name"].as_str().unwrap_or_default();
        self.request(http::Method::PUT, &object_path(kind, ns, name), Some(obj))
            .await
    }
}

fn items(list: Value) -> Vec<Value> {
    match list {
        Value::Object(mut m) => match m.remove("items") {
            Some(Value::Array(items)) => items,
            _ => Vec::new(),
        },
        _ => Vec::new(),
    }
}

/// Status of condition `t` of an object ("True", "False", "Unknown").
pub fn condition<'a>(obj: &'a Value, t: &str) -> Option<&'a str> {
    obj["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == t)?["status"]
        .as_str()
}
