//! The client budget (`--kube-api-qps`, `--kube-api-burst`) on a client made by
//! `flotilla_store::connect`, against a real kube-apiserver: requests beyond the burst wait for
//! their tokens, and every one of them is answered.

use flotilla_ops::KubeApiRate;
use flotilla_testenv::TestEnv;
use k8s_openapi::api::core::v1::Namespace;
use kube::Api;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_over_the_budget_wait_and_all_are_answered() -> anyhow::Result<()> {
    let env = TestEnv::start().await?;
    // A burst of 5, then 2 a second: 12 requests at once are 5 at once and 7 that wait.
    let rate = KubeApiRate::new(2.0, 5);
    let client = flotilla_store::connect(Some(env.kubeconfig_path()), &rate).await?;
    let namespaces: Api<Namespace> = Api::all(client);
    let answers = futures::future::join_all((0..12).map(|_| {
        let namespaces = namespaces.clone();
        async move { namespaces.get("default").await }
    }))
    .await;
    for answer in answers {
        assert_eq!(answer?.metadata.name.as_deref(), Some("default"));
    }
    // Each request past the burst waited for its own token (a scheduler late by a whole
    // interval could let one through on a refilled token, never more than the 7).
    let waited = rate.waited();
    assert!((5..=7).contains(&waited), "{waited} of 12 requests waited");
    Ok(())
}
