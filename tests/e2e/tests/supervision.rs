//! A hub that cannot serve any more exits, non-zero and saying why, instead of running on
//! without a listener: its supervisor (systemd, Kubernetes) then starts it again. The fault is
//! real: the listening socket is shut down under the running process.

use std::time::Duration;

use flotilla_e2e::Hub;
use flotilla_e2e::faults::{listening_fd, shut_down_socket};

async fn fails_when_its_listener_fails(listener: &str, address: impl Fn(&Hub) -> String) {
    let dir = tempfile::tempdir().unwrap();
    let mut hub = Hub::start(dir.path(), &[]).await.unwrap();
    let address = address(&hub);
    let port: u16 = address.rsplit(':').next().unwrap().parse().unwrap();
    let pid = hub.proc.pid();
    shut_down_socket(pid, listening_fd(pid, port).unwrap()).unwrap();

    let status = hub
        .proc
        .exited_within(Duration::from_secs(30))
        .await
        .unwrap_or_else(|| {
            panic!(
                "the hub runs on without its {listener}:\n{}",
                hub.proc.log()
            )
        });
    assert!(!status.success(), "exit status {status}");
    let log = hub.proc.log();
    assert!(
        log.contains(&format!(
            "{listener} failed: cannot accept on {address} any more"
        )),
        "{log}"
    );
    assert!(
        log.contains("exiting non-zero so that its supervisor restarts it"),
        "{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hub_whose_agents_listener_fails_exits_non_zero_and_says_why() {
    fails_when_its_listener_fails("the agents' listener", |h| h.agents_addr.clone()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hub_whose_operator_listener_fails_exits_non_zero_and_says_why() {
    fails_when_its_listener_fails("the operator API's listener", |h| h.api_addr.clone()).await;
}
