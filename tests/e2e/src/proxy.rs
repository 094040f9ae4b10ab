//! kubectl through the hub's proxy front: a hub with the front on, access rules, and kubectl
//! users made with the real `flotilla user create`, run with the real `kubectl`.

use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

use anyhow::Context;
use serde_json::Value;

use crate::Hub;

/// The longest one kubectl run may take.
pub const KUBECTL_TIMEOUT: Duration = Duration::from_secs(120);

/// Starts a hub whose proxy front listens on a free port, with `rules` (YAML) as its access
/// rules and `tokens` (kube-apiserver token file lines) as its bearer tokens.
pub async fn hub_with_proxy(
    dir: &Path,
    rules: &str,
    tokens: &str,
    extra: &[&str],
) -> anyhow::Result<Hub> {
    let mut args = proxy_flags(dir, rules, tokens)?;
    args.extend(extra.iter().map(|s| s.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Hub::start(dir, &args).await
}

/// The hub flags of a proxy front on a free port with `rules` (YAML) as its access rules and
/// `tokens` (kube-apiserver token file lines) as its bearer tokens, written into `dir`.
pub fn proxy_flags(dir: &Path, rules: &str, tokens: &str) -> anyhow::Result<Vec<String>> {
    let rules_path = dir.join("access-rules.yaml");
    std::fs::write(&rules_path, rules)?;
    let tokens_path = dir.join("proxy-tokens.csv");
    std::fs::write(&tokens_path, tokens)?;
    Ok(vec![
        "--proxy-listen=127.0.0.1:0".to_string(),
        format!("--proxy-access-rules={}", rules_path.display()),
        format!("--proxy-token-file={}", tokens_path.display()),
    ])
}

impl Hub {
    /// `https://127.0.0.1:PORT` of the proxy front.
    pub fn proxy_url(&self) -> anyhow::Result<String> {
        let listen: Value =
            serde_json::from_str(&std::fs::read_to_string(self.data_dir.join("listen.json"))?)?;
        let address = listen["proxy"]
            .as_str()
            .context("the hub serves no proxy front (listen.json has no proxy)")?;
        Ok(format!("https://{address}"))
    }

    /// The proxy front's audit log, one parsed line each.
    pub fn audit_lines(&self) -> anyhow::Result<Vec<Value>> {
        let text = std::fs::read_to_string(self.audit_path()).unwrap_or_default();
        text.lines()
            .map(|l| serde_json::from_str(l).with_context(|| format!("audit line {l:?}")))
            .collect()
    }

    pub fn audit_path(&self) -> PathBuf {
        self.data_dir.join("proxy-audit.log")
    }

    /// `flotilla user create NAME --groups ...`, returning the kubeconfig it wrote.
    pub fn create_user(&self, dir: &Path, user: &str, groups: &[&str]) -> anyhow::Result<PathBuf> {
        let kubeconfig = dir.join(format!("{user}.kubeconfig"));
        let groups = groups.join(",");
        let mut args = vec!["user", "create", user, "-o", kubeconfig.to_str().unwrap()];
        if !groups.is_empty() {
            args.extend(["--groups", groups.as_str()]);
        }
        let out = self.cli(&args)?;
        anyhow::ensure!(
            out.status.success(),
            "flotilla user create {user}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(kubeconfig)
    }
}

/// Runs the real kubectl with `kubeconfig`, bounded.
pub async fn kubectl(kubeconfig: &Path, args: &[&str]) -> anyhow::Result<Output> {
    let run = tokio::process::Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(args)
        .kill_on_drop(true)
        .output();
    tokio::time::timeout(KUBECTL_TIMEOUT, run)
        .await
        .with_context(|| format!("kubectl {args:?} did not finish within {KUBECTL_TIMEOUT:?}"))?
        .with_context(|| format!("running kubectl {args:?}"))
}

/// [`kubectl`] that must succeed; its standard output.
pub async fn kubectl_ok(kubeconfig: &Path, args: &[&str]) -> anyhow::Result<String> {
    let out = kubectl(kubeconfig, args).await?;
    anyhow::ensure!(
        out.status.success(),
        "kubectl {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8(out.stdout)?)
}
