//! README.md's command blocks, run as a new user runs them: every line of a block in order, by
//! bash, in an empty directory, with the real binaries, a real spoke apiserver and (for scale
//! out) a real hub apiserver. The test adds only what the README leaves to the reader, and says
//! so where it does:
//!
//! - `target/release/` is the directory of the binaries `scripts/test.sh` built, and `flotilla`
//!   without a path finds the same directory first on `PATH`; `cargo build` lines are skipped
//!   (the binaries are built already);
//! - addresses: the README's fixed ports become free loopback ports, one per listening process
//!   (several "hosts" share this machine), and `<id.secret>`/`<sha256>` come from the join
//!   command `flotilla token create` printed, as the user copies them;
//! - the files the README asks the reader to write (`binding.yaml`, `placement.yaml`,
//!   `manifests.yaml`, `hub.kubeconfig`, the spoke's kubeconfig in `KUBECONFIG`);
//! - a command whose README comment or printed output says what it shows is run again until it
//!   shows that, as a user waits for a cluster to appear; any other command must succeed the
//!   first time.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context as _, ensure};
use flotilla_e2e::{Proc, bin, free_port, wait_for};
use flotilla_testenv::{TestEnv, workspace_root};
use tokio::process::Command;

/// How long a command the README shows a result for may take to show it.
const SHOWS_WITHIN: Duration = Duration::from_secs(90);
/// How long any one command may run.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(180);

/// The commands of the first ```sh block under the `## heading` of the README: lines ending in
/// `\` joined with the next, blank lines and whole-line comments dropped, end-of-line comments
/// kept apart (they say what the command shows).
fn commands_under(readme: &str, heading: &str) -> anyhow::Result<Vec<Typed>> {
    let section = readme
        .split("\n## ")
        .find(|s| s.starts_with(heading))
        .with_context(|| format!("README.md has no section `## {heading}`"))?;
    let block = section
        .split("```sh\n")
        .nth(1)
        .and_then(|rest| rest.split("\n```").next())
        .with_context(|| format!("`## {heading}` has no sh block"))?;
    let mut commands = Vec::new();
    let mut pending = String::new();
    for line in block.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if let Some(start) = line.strip_suffix('\\') {
            pending.push_str(start);
            continue;
        }
        pending.push_str(line);
        let (command, comment) = match pending.split_once(" #") {
            Some((command, comment)) => (command.trim(), Some(comment.trim().to_string())),
            None => (pending.trim(), None),
        };
        commands.push(Typed {
            command: command.split_whitespace().collect::<Vec<_>>().join(" "),
            comment,
        });
        pending.clear();
    }
    Ok(commands)
}

/// The block of output the README prints right after the sh block of `## heading`, if any.
fn output_under(readme: &str, heading: &str) -> Option<String> {
    let section = readme.split("\n## ").find(|s| s.starts_with(heading))?;
    let after = section.split("```sh\n").nth(1)?.split_once("\n```\n")?.1;
    let rest = after.trim_start().strip_prefix("```\n")?;
    Some(rest.split("\n```").next()?.to_string())
}

/// One line of a block as the user types it, and what its comment says.
#[derive(Debug)]
struct Typed {
    command: String,
    comment: Option<String>,
}

/// A user's shell: a directory of their own, the variables `export` set, the processes `&` left
/// running (stopped when the shell is dropped).
struct UserShell {
    dir: PathBuf,
    env: Vec<(String, String)>,
    background: Vec<Proc>,
}

impl UserShell {
    fn new(dir: &Path) -> UserShell {
        let bins = bin("flotilla-hub")
            .parent()
            .expect("binaries live in a directory")
            .to_path_buf();
        let path = format!(
            "{}:{}",
            bins.display(),
            std::env::var("PATH").unwrap_or_default()
        );
        UserShell {
            dir: dir.to_path_buf(),
            env: vec![("PATH".into(), path)],
            background: Vec::new(),
        }
    }

    /// The command with the README's `target/release/` pointing at the built binaries.
    fn as_run(&self, command: &str) -> String {
        command.replace("target/release/", "")
    }

    fn bash(&self, command: &str) -> Command {
        let mut bash = Command::new("bash");
        bash.arg("-c")
            .arg(command)
            .current_dir(&self.dir)
            .envs(self.env.iter().cloned())
            .kill_on_drop(true);
        bash
    }

    /// Runs one line: `export` sets a variable, a trailing `&` starts a process that keeps
    /// running, anything else must exit 0; its standard output.
    async fn run(&mut self, command: &str) -> anyhow::Result<String> {
        let command = self.as_run(command);
        if let Some(assignment) = command.strip_prefix("export ") {
            let (name, value) = assignment
                .split_once('=')
                .with_context(|| format!("`{command}` sets nothing"))?;
            self.env.push((name.to_string(), value.to_string()));
            return Ok(String::new());
        }
        if let Some(started) = command.strip_suffix(" &") {
            let name = format!("background-{}", self.background.len());
            let log = self.dir.join(format!("{name}.log"));
            let mut process = std::process::Command::new("bash");
            process
                .arg("-c")
                // `env` takes the line's leading VAR=value words too; the process is then
                // bash's own, so stopping it stops the command.
                .arg(format!("exec env {started}"))
                .current_dir(&self.dir)
                .envs(self.env.iter().cloned());
            self.background.push(Proc::spawn(&name, process, log)?);
            return Ok(String::new());
        }
        let out = tokio::time::timeout(
            COMMAND_TIMEOUT,
            self.bash(&command).stdin(Stdio::null()).output(),
        )
        .await
        .with_context(|| format!("`{command}` still running after {COMMAND_TIMEOUT:?}"))??;
        ensure!(
            out.status.success(),
            "`{command}` failed ({}):\n{}{}\nbackground processes:\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            self.background_logs()
        );
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Runs `command` until its output has a line holding every one of `words` in order.
    async fn run_until_shows(&mut self, command: &str, words: &[&str]) -> anyhow::Result<String> {
        let what = format!("`{command}` to show a line with {words:?}");
        wait_for(&what, SHOWS_WITHIN, || async {
            let out = self.bash(&self.as_run(command)).output().await?;
            let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
            Ok(stdout
                .lines()
                .any(|line| has_in_order(line, words))
                .then_some(stdout))
        })
        .await
        .with_context(|| format!("background processes:\n{}", self.background_logs()))
    }

    fn background_logs(&self) -> String {
        self.background
            .iter()
            .map(|p| {
                let log = p.log();
                let tail: Vec<&str> = log.lines().rev().take(15).collect();
                format!(
                    "--- {}\n{}",
                    p.log_path().display(),
                    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    }
}

/// Whether `line`'s whitespace-separated columns hold `words` in this order.
fn has_in_order(line: &str, words: &[&str]) -> bool {
    let mut columns = line.split_whitespace();
    words.iter().all(|w| columns.any(|c| c == *w))
}

/// `flag VALUE` from a command line.
fn flag_value<'a>(command: &'a str, flag: &str) -> Option<&'a str> {
    let mut words = command.split_whitespace();
    words.find(|w| *w == flag)?;
    words.next()
}

/// "Start a single-node fleet", then "Place work by what clusters are" on that fleet: the
/// cluster joins, is accepted, shows as the README's table does, and the placed work reaches
/// the spoke.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readme_single_node_fleet_and_placed_work() -> anyhow::Result<()> {
    let readme = std::fs::read_to_string(workspace_root().join("README.md"))?;
    let spoke = TestEnv::start().await?;
    let dir = tempfile::tempdir()?;
    let mut shell = UserShell::new(dir.path());
    // The README's comment: "plus where to keep state and the spoke's kubeconfig".
    shell.env.push((
        "KUBECONFIG".into(),
        spoke.kubeconfig_path().display().to_string(),
    ));
    let agents = format!("127.0.0.1:{}", free_port()?);
    shell
        .env
        .push(("FLOTILLA_HUB_LISTEN".into(), agents.clone()));
    shell.env.push((
        "FLOTILLA_HUB_API_LISTEN".into(),
        format!("127.0.0.1:{}", free_port()?),
    ));

    let commands = commands_under(&readme, "Start a single-node fleet")?;
    ensure!(commands.len() >= 6, "the block lost commands: {commands:?}");
    let mut join_command = None;
    let mut first_listing = true;
    for typed in &commands {
        let command = typed.command.as_str();
        if command.starts_with("cargo build") {
            continue;
        }
        if command.contains("flotilla-hub --data-dir fleet") {
            shell.run(command).await?;
            // The next line reads what the hub writes on its first start.
            let config = dir.path().join("fleet/operator/config.yaml");
            wait_for(
                "the hub to write the CLI's config",
                SHOWS_WITHIN,
                || async { Ok(config.exists().then_some(())) },
            )
            .await?;
            continue;
        }
        if command.contains("token create") {
            let out = shell.run(command).await?;
            join_command = out
                .lines()
                .find(|l| l.contains("flotilla-agent join"))
                .map(str::to_string);
            ensure!(
                join_command.is_some(),
                "`{command}` printed no join command:\n{out}"
            );
            continue;
        }
        if command.contains("flotilla-agent join") {
            let printed = join_command.as_deref().context("no token was created")?;
            let token = printed
                .split_whitespace()
                .find_map(|w| w.strip_prefix("FLOTILLA_BOOTSTRAP_TOKEN="))
                .context("the join command has no token")?;
            let fingerprint =
                flag_value(printed, "--ca-fingerprint").context("no --ca-fingerprint")?;
            let hub = flag_value(printed, "--hub").context("no --hub")?;
            ensure!(
                hub == agents,
                "the join command names hub {hub}, not the hub's address {agents}"
            );
            let typed_in = command
                .replace("<id.secret>", token)
                .replace("<sha256>", fingerprint)
                .replace("127.0.0.1:9443", hub);
            shell.run(&typed_in).await?;
            continue;
        }
        if command.ends_with("get clusters") {
            if first_listing {
                // "# store-0001: HUB ACCEPTED false"
                let comment = typed.comment.as_deref().unwrap_or_default();
                ensure!(
                    comment.contains("store-0001") && comment.contains("false"),
                    "the README's comment on the first listing changed: {comment:?}"
                );
                shell
                    .run_until_shows(command, &["store-0001", "false"])
                    .await?;
                first_listing = false;
            } else {
                // The table the README prints: NAME, HUB ACCEPTED, JOINED, AVAILABLE.
                let table = output_under(&readme, "Start a single-node fleet")
                    .context("the README no longer shows the accepted cluster's table")?;
                let row = table
                    .lines()
                    .find(|l| l.starts_with("store-0001"))
                    .context("the README's table has no store-0001")?;
                let shown: Vec<&str> = row.split_whitespace().take(4).collect();
                ensure!(
                    shown == ["store-0001", "true", "True", "True"],
                    "the README's table changed: {row}"
                );
                shell.run_until_shows(command, &shown).await?;
            }
            continue;
        }
        shell.run(command).await?;
    }
    ensure!(!first_listing, "the block never listed the clusters");

    // "Place work by what clusters are", with the files the reader writes.
    std::fs::write(
        dir.path().join("binding.yaml"),
        "apiVersion: cluster.open-cluster-management.io/v1beta2\n\
         kind: ManagedClusterSetBinding\n\
         metadata: {name: default, namespace: default}\n\
         spec: {clusterSet: default}\n",
    )?;
    std::fs::write(
        dir.path().join("placement.yaml"),
        "apiVersion: cluster.open-cluster-management.io/v1beta1\n\
         kind: Placement\n\
         metadata: {name: placement1, namespace: default}\n\
         spec: {numberOfClusters: 1}\n",
    )?;
    std::fs::write(
        dir.path().join("manifests.yaml"),
        "apiVersion: v1\n\
         kind: ConfigMap\n\
         metadata: {name: web, namespace: default}\n\
         data: {greeting: hello from the readme}\n",
    )?;
    for typed in commands_under(&readme, "Place work by what clusters are")? {
        let command = typed.command.as_str();
        if command.ends_with("get placements") {
            shell
                .run_until_shows(command, &["placement1", "store-0001"])
                .await?;
        } else if command.ends_with("get manifestworkreplicasets") {
            shell.run_until_shows(command, &["web", "Complete"]).await?;
        } else {
            shell.run(command).await?;
        }
    }
    let config_maps: kube::Api<k8s_openapi::api::core::v1::ConfigMap> =
        kube::Api::namespaced(spoke.client().await?, "default");
    let applied = wait_for("the placed work on the spoke", SHOWS_WITHIN, || async {
        Ok(config_maps.get_opt("web").await?)
    })
    .await?;
    ensure!(
        applied
            .data
            .as_ref()
            .and_then(|d| d.get("greeting"))
            .map(String::as_str)
            == Some("hello from the readme"),
        "the spoke's ConfigMap web is not the one placed: {:?}",
        applied.data
    );
    Ok(())
}

/// "Scale out: sharded gateways": the CRDs apply as written, the hub and two gateways start,
/// and the Leases the README points at show every shard held by one of the two gateways.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readme_scale_out() -> anyhow::Result<()> {
    let readme = std::fs::read_to_string(workspace_root().join("README.md"))?;
    // Bare: the README's own `kubectl apply` installs the CRDs.
    let hub_api = TestEnv::start().await?;
    let dir = tempfile::tempdir()?;
    // The reader's hub kubeconfig, and the checkout the README's relative paths assume.
    std::fs::copy(hub_api.kubeconfig_path(), dir.path().join("hub.kubeconfig"))?;
    std::os::unix::fs::symlink(workspace_root().join("deploy"), dir.path().join("deploy"))?;
    let mut shell = UserShell::new(dir.path());
    shell.env.push((
        "KUBECONFIG".into(),
        hub_api.kubeconfig_path().display().to_string(),
    ));
    shell.env.push((
        "FLOTILLA_HUB_API_LISTEN".into(),
        format!("127.0.0.1:{}", free_port()?),
    ));

    let commands = commands_under(&readme, "Scale out: sharded gateways")?;
    let mut gateways = Vec::new();
    let mut listed = false;
    for typed in &commands {
        // Every process listens on a port of its own: on one machine they cannot share 9443.
        let mut command = typed.command.clone();
        while command.contains("0.0.0.0:9443") {
            command = command.replacen("0.0.0.0:9443", &format!("127.0.0.1:{}", free_port()?), 1);
        }
        if command.contains("flotilla-gateway") {
            gateways.push(
                flag_value(&command, "--name")
                    .context("a gateway without --name")?
                    .to_string(),
            );
        }
        if command.contains("get leases") {
            ensure!(gateways.len() >= 2, "the block starts {gateways:?}");
            for gateway in &gateways {
                shell
                    .run_until_shows(&command, &[&format!("flotilla-gateway-{gateway}"), gateway])
                    .await?;
            }
            // Every shard held, by one of the gateways the block started.
            let holders = wait_for(
                "every shard lease held by a gateway",
                SHOWS_WITHIN,
                || async {
                    let out = shell.bash(&shell.as_run(&command)).output().await?;
                    let out = String::from_utf8_lossy(&out.stdout).into_owned();
                    let shards: Vec<&str> = out
                        .lines()
                        .filter(|l| l.starts_with("flotilla-shard-"))
                        .collect();
                    let held = shards
                        .iter()
                        .filter(|l| gateways.iter().any(|g| has_in_order(l, &[g])))
                        .count();
                    Ok((shards.len() == 64 && held == 64).then_some(out))
                },
            )
            .await
            .with_context(|| format!("background processes:\n{}", shell.background_logs()))?;
            ensure!(
                gateways.iter().all(|g| holders
                    .lines()
                    .any(|l| l.starts_with("flotilla-shard-") && has_in_order(l, &[g]))),
                "one gateway holds no shard:\n{holders}"
            );
            listed = true;
            continue;
        }
        if command.starts_with("target/release/flotilla-hub --data-dir fleet")
            && command.ends_with('&')
        {
            shell.run(&command).await?;
            // gateway-cert reads the CA the hub makes on its first start.
            let ca = dir.path().join("fleet/ca/ca.crt");
            wait_for("the hub to make its CA", SHOWS_WITHIN, || async {
                Ok(ca.exists().then_some(()))
            })
            .await?;
            continue;
        }
        shell.run(&command).await?;
    }
    ensure!(listed, "the block never lists the leases");
    Ok(())
}

/// "First command: the whole fabric in one": the load-test demo, with the binary the tests
/// built (a debug build, so 100 agents rather than the README's 1,000 keep it short on a shared
/// machine): it exits 0 and its report says every scenario completed with every agent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readme_first_command() -> anyhow::Result<()> {
    let readme = std::fs::read_to_string(workspace_root().join("README.md"))?;
    let commands = commands_under(&readme, "First command: the whole fabric in one")?;
    let [typed] = commands.as_slice() else {
        anyhow::bail!("the first block is one command, not {commands:?}");
    };
    let args = typed
        .command
        .strip_prefix("cargo run --release -p flotilla-loadtest -- ")
        .with_context(|| format!("the first command changed: {}", typed.command))?;
    ensure!(
        args == "demo --agents 1000",
        "the first command's arguments changed: {args}"
    );
    let dir = tempfile::tempdir()?;
    let mut shell = UserShell::new(dir.path());
    shell
        .run("flotilla-loadtest demo --agents 100 --quiet --out report")
        .await?;
    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("report/report.json"))?)?;
    ensure!(
        report["schema"] == "flotilla-loadtest/v1",
        "{}",
        report["schema"]
    );
    let scenarios = report["scenarios"].as_array().context("no scenarios")?;
    let names: Vec<&str> = scenarios
        .iter()
        .filter_map(|s| s["name"].as_str())
        .collect();
    ensure!(
        names == ["connect", "fanout", "storm"],
        "scenarios {names:?}"
    );
    for scenario in scenarios {
        ensure!(
            scenario["outcome"] == "completed",
            "scenario {} did not complete: {}",
            scenario["name"],
            scenario["error"]
        );
    }
    ensure!(scenarios[0]["available_on_hub"] == 100, "{}", scenarios[0]);
    ensure!(
        scenarios[1]["applied_on_hub"] == 100,
        "{}",
        scenarios[1]["applied_on_hub"]
    );
    ensure!(
        scenarios[2]["sessions_reestablished"] == 100,
        "{}",
        scenarios[2]["sessions_reestablished"]
    );
    Ok(())
}
