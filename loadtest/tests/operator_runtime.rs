//! The harness's requests to the hub's operator API are answered while its own runtime is
//! too busy to run anything (as when 10,000 simulated agents evaluate policies on it): every
//! request, whichever call makes it, runs on the API client's own thread, and so do the
//! connections it dials and pools. A pooled connection made on the harness's runtime would be
//! read only when that runtime got to it, and the measurement's GET would wait behind the
//! agents however it was issued.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::{args, trace_init};
use flotilla_loadtest::fleet::Hub;
use flotilla_proto::api::Kind;
use serde_json::json;
use tokio::time::Instant;

/// How long the busy runtime spins at most, so that a failing test ends.
const BUSY_AT_MOST: Duration = Duration::from_secs(30);
const NAMESPACE: &str = "default";

#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn operator_requests_are_answered_while_the_harness_runtime_is_busy() {
    trace_init();
    let dir = tempfile::tempdir().unwrap();
    let args = args(&dir.path().join("out"), &["--agents", "1"]);
    let hub = Hub::start(&args, dir.path()).await.expect("the hub starts");
    let api = hub.operator().unwrap();

    // Fill the client's pool through every kind of call the scenarios make: creates
    // (`apply`), reads of one object (`get`) and plain requests.
    let names: Vec<String> = (0..8).map(|i| format!("busy-{i}")).collect();
    let created = futures::future::join_all(names.iter().map(|name| {
        let api = api.clone();
        let config_map = json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": NAMESPACE}, "data": {"k": "v"}});
        async move { api.apply(&config_map).await }
    }))
    .await;
    for c in created {
        c.expect("ConfigMap created");
    }
    assert!(
        api.get(Kind::ConfigMap, Some(NAMESPACE), "busy-0")
            .await
            .unwrap()
            .is_some()
    );

    // The runtime's only worker spins; nothing spawned on this runtime runs until it stops.
    let released = Arc::new(AtomicBool::new(false));
    let worker_busy = Arc::new(AtomicBool::new(false));
    let spinner = tokio::spawn({
        let (released, worker_busy) = (released.clone(), worker_busy.clone());
        async move {
            worker_busy.store(true, Ordering::SeqCst);
            let until = Instant::now() + BUSY_AT_MOST;
            while !released.load(Ordering::SeqCst) && Instant::now() < until {
                std::hint::spin_loop();
            }
            released.load(Ordering::SeqCst)
        }
    });
    while !worker_busy.load(Ordering::SeqCst) {
        std::hint::spin_loop();
    }

    // This test's own future runs on the main thread, not the worker: its requests go out
    // and come back on the client's thread, over the connections pooled above.
    let mut answered = Vec::new();
    for name in &names {
        answered.push(api.get(Kind::ConfigMap, Some(NAMESPACE), name).await);
    }
    released.store(true, Ordering::SeqCst);
    let released_in_time = spinner.await.unwrap();
    assert!(
        released_in_time,
        "the operator API's answers waited until the busy runtime stopped spinning \
         ({BUSY_AT_MOST:?}): a pooled connection is read by the harness's runtime"
    );
    for (name, got) in names.iter().zip(answered) {
        assert!(
            got.unwrap_or_else(|e| panic!("GET ConfigMap {name}: {e:#}"))
                .is_some(),
            "ConfigMap {name} read back"
        );
    }
    hub.shutdown().await.unwrap();
}
