//! Starts a real cluster of the test environment for use outside the tests (the container
//! smoke run in `deploy/image/smoke.sh` uses it) and keeps it until SIGINT or SIGTERM.
//!
//! ```sh
//! cargo run -p flotilla-testenv --example cluster -- DIR          # etcd + kube-apiserver
//! cargo run -p flotilla-testenv --example cluster -- DIR --full   # + controllers, scheduler, kwok nodes
//! ```
//!
//! Once the cluster serves, its admin kubeconfig is copied to `DIR/kubeconfig` (the apiserver
//! listens on 127.0.0.1); everything, its data included, is removed when the process ends.

use std::path::PathBuf;

use anyhow::Context as _;
use flotilla_testenv::{TestCluster, TestEnv};
use tokio::signal::unix::{SignalKind, signal};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let dir = PathBuf::from(
        args.next()
            .context("usage: cluster DIR [--full] (DIR receives the kubeconfig)")?,
    );
    let full = match args.next().as_deref() {
        None => false,
        Some("--full") => true,
        Some(other) => anyhow::bail!("unknown argument {other:?}: the only option is --full"),
    };
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut terminate = signal(SignalKind::terminate())?;
    // Started before the kubeconfig is written, so a caller that waits for the file and then
    // signals is always heard.
    // Held until the end: dropping it stops every process and removes the data.
    let (kubeconfig, running): (PathBuf, Box<dyn std::any::Any>) = if full {
        let cluster = TestCluster::start().await?;
        (cluster.kubeconfig_path().to_path_buf(), Box::new(cluster))
    } else {
        let env = TestEnv::start().await?;
        (env.kubeconfig_path().to_path_buf(), Box::new(env))
    };
    // Written under another name and renamed, so a reader never sees half a file.
    let partial = dir.join("kubeconfig.partial");
    std::fs::copy(&kubeconfig, &partial)?;
    std::fs::rename(&partial, dir.join("kubeconfig"))?;
    eprintln!(
        "serving; kubeconfig in {}",
        dir.join("kubeconfig").display()
    );
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = terminate.recv() => {}
    }
    drop(running);
    Ok(())
}
