//! The agents of a run, wherever they live: one [`Swarm`] in this process, or one per worker
//! process (`--processes`), each a re-execution of the harness that speaks JSON lines: it
//! prints a [`Sample`] every [`SAMPLE_EVERY`] and answers `records` and `stop` read from stdin.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, Command};
use tokio::sync::{Mutex, mpsc, watch};

use crate::fleet::Identity;
use crate::swarm::{AgentRecord, Sample, Swarm, SwarmSpec};

/// How often a worker reports its counters.
pub const SAMPLE_EVERY: Duration = Duration::from_millis(100);
/// How long a worker may take to answer `records`.
pub const RECORDS_TIMEOUT: Duration = Duration::from_secs(120);

/// What a worker is given.
#[derive(Serialize, Deserialize)]
pub struct WorkerSpec {
    pub swarm: SwarmSpec,
    pub identities: Vec<Identity>,
}

/// A line a worker prints.
#[derive(Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum WorkerLine {
    Sample(Sample),
    Records(Vec<AgentRecord>),
    Failed(String),
    /// `flap` finished after this many steps.
    Flapped(u64),
}

/// Runs as a worker: the swarm of the spec, until stdin says `stop` or closes.
pub async fn run_worker(spec: &Path) -> anyhow::Result<()> {
    crate::machine::raise_open_files_limit();
    let spec: WorkerSpec = serde_json::from_slice(
        &std::fs::read(spec).with_context(|| format!("reading {}", spec.display()))?,
    )?;
    let out = Arc::new(Mutex::new(tokio::io::stdout()));
    let print = move |line: WorkerLine| {
        let out = out.clone();
        async move {
            let mut text = serde_json::to_string(&line).expect("worker lines serialize");
            text.push('\n');
            let mut out = out.lock().await;
            let _ = out.write_all(text.as_bytes()).await;
            let _ = out.flush().await;
        }
    };
    let swarm = match Swarm::start(&spec.swarm, &spec.identities) {
        Ok(s) => Arc::new(s),
        Err(e) => {
            print(WorkerLine::Failed(format!("{e:#}"))).await;
            return Err(e);
        }
    };
    let sampler = {
        let swarm = swarm.clone();
        let print = print.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(SAMPLE_EVERY);
            loop {
                tick.tick().await;
                print(WorkerLine::Sample(swarm.sample())).await;
            }
        })
    };
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        match line.trim() {
            "records" => print(WorkerLine::Records(swarm.records().await)).await,
            "stop" => break,
            flap if flap.starts_with("flap ") => {
                // `flap <duration ms> <every ms>`: the feedback scenario's status changes, run
                // beside the sampler so the coordinator keeps seeing counters.
                let ms: Vec<u64> = flap
                    .split_whitespace()
                    .skip(1)
                    .filter_map(|v| v.parse().ok())
                    .collect();
                let (swarm, print) = (swarm.clone(), print.clone());
                if let [duration, every] = ms[..] {
                    tokio::spawn(async move {
                        let steps = swarm
                            .flap(
                                Duration::from_millis(duration),
                                Duration::from_millis(every),
                            )
                            .await;
                        print(WorkerLine::Flapped(steps)).await;
                    });
                }
            }
            other => tracing::warn!(command = other, "unknown worker command"),
        }
    }
    sampler.abort();
    // The sampler holds the swarm until it has really ended, not when it is told to.
    let _ = sampler.await;
    match Arc::try_unwrap(swarm) {
        Ok(s) => s.stop().await,
        Err(_) => bail!("the swarm is still shared at shutdown"),
    }
    Ok(())
}

pub struct Worker {
    /// Its number among the workers, and how often it has been started.
    index: usize,
    starts: usize,
    exe: PathBuf,
    spec_path: PathBuf,
    log_dir: PathBuf,
    child: Child,
    stdin: ChildStdin,
    sample: watch::Receiver<Sample>,
    records: mpsc::Receiver<Result<Vec<AgentRecord>, String>>,
    flapped: mpsc::Receiver<u64>,
    /// With `--link`: the link whose namespace the worker runs in, kept for its restarts and
    /// removed after it (fields drop in order: the child is killed first).
    link: Option<Arc<flotilla_wan::EmulatedLink>>,
}

impl Worker {
    /// Starts worker `index` on the spec at `spec_path`; its log is `worker-<index>.log`, and
    /// `worker-<index>-<start>.log` for a later start.
    fn spawn(
        exe: &Path,
        spec_path: PathBuf,
        log_dir: &Path,
        index: usize,
        starts: usize,
        link: Option<Arc<flotilla_wan::EmulatedLink>>,
    ) -> anyhow::Result<Worker> {
        let log_name = match starts {
            1 => format!("worker-{index}.log"),
            n => format!("worker-{index}-{n}.log"),
        };
        let log = std::fs::File::create(log_dir.join(log_name))?;
        // Behind a link, `ip netns exec` enters its namespace and execs the harness: the pid
        // is the worker's, so signals reach it.
        let mut command = match &link {
            Some(link) => Command::from(link.command(exe)),
            None => Command::new(exe),
        };
        let mut child = command
            .arg("worker")
            .arg("--spec")
            .arg(&spec_path)
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .context("starting a worker process")?;
        let stdin = child.stdin.take().expect("piped stdin");
        let stdout = child.stdout.take().expect("piped stdout");
        let (sample_tx, sample) = watch::channel(Sample::default());
        let (records_tx, records) = mpsc::channel(1);
        let (flapped_tx, flapped) = mpsc::channel(1);
        tokio::spawn(async move {
            let mut lines = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                match serde_json::from_str::<WorkerLine>(&line) {
                    Ok(WorkerLine::Sample(s)) => {
                        let _ = sample_tx.send(s);
                    }
                    Ok(WorkerLine::Records(r)) => {
                        let _ = records_tx.send(Ok(r)).await;
                    }
                    Ok(WorkerLine::Failed(e)) => {
                        let _ = records_tx.send(Err(e)).await;
                    }
                    Ok(WorkerLine::Flapped(steps)) => {
                        let _ = flapped_tx.send(steps).await;
                    }
                    Err(e) => tracing::warn!(error = %e, "unreadable worker line"),
                }
            }
        });
        Ok(Worker {
            index,
            starts,
            exe: exe.to_path_buf(),
            spec_path,
            log_dir: log_dir.to_path_buf(),
            child,
            stdin,
            sample,
            records,
            flapped,
            link,
        })
    }

    /// Its pid while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }
}

/// Where the agents run.
pub enum Agents {
    Local(Swarm),
    Workers(Vec<Worker>),
}

impl Agents {
    /// With `--link`: each worker's number and its link.
    pub fn links(&self) -> Vec<(usize, Arc<flotilla_wan::EmulatedLink>)> {
        match self {
            Agents::Local(_) => Vec::new(),
            Agents::Workers(ws) => ws
                .iter()
                .filter_map(|w| w.link.clone().map(|l| (w.index, l)))
                .collect(),
        }
    }

    /// Starts the agents: in this process when `processes` is 1, else split evenly over that
    /// many workers, each ramping at its share of the rate. Behind a `link`, always in
    /// workers (at least one), each in the namespace of a link of its own made here, dialling
    /// the hub and gateways through it.
    pub async fn start(
        spec: SwarmSpec,
        identities: Vec<Identity>,
        processes: usize,
        exe: PathBuf,
        run_dir: &Path,
        link: Option<&flotilla_wan::LinkSpec>,
    ) -> anyhow::Result<Agents> {
        if processes <= 1 && link.is_none() {
            return Ok(Agents::Local(Swarm::start(&spec, &identities)?));
        }
        let processes = processes.max(1);
        let per = identities.len().div_ceil(processes);
        let mut workers = Vec::new();
        for (w, chunk) in identities.chunks(per).enumerate() {
            let mut swarm = spec.clone();
            swarm.first_index = spec.first_index + w * per;
            swarm.connect_rate = spec.connect_rate / processes as f64;
            swarm.cache_dir = spec.cache_dir.join(format!("worker-{w}"));
            swarm.transport = spec.transport.of_worker(w);
            let link = match link {
                Some(link_spec) => {
                    let made = flotilla_wan::EmulatedLink::create(
                        link_spec.clone(),
                        spec.seed.wrapping_add(w as u64),
                    )
                    .await
                    .with_context(|| format!("the link of worker {w}"))?;
                    swarm.hub = crate::link::through(&made, spec.hub)?;
                    swarm.gateways = spec
                        .gateways
                        .iter()
                        .map(|g| crate::link::through(&made, *g))
                        .collect::<anyhow::Result<_>>()?;
                    if !spec.gateways.is_empty() {
                        // Redirects between gateways name their loopback addresses.
                        made.send_loopback_to_host()
                            .with_context(|| format!("the link of worker {w}"))?;
                    }
                    swarm.link_address = Some(made.inside_address());
                    swarm.source_addresses = 1;
                    Some(Arc::new(made))
                }
                None => None,
            };
            let spec_path: PathBuf = run_dir.join(format!("worker-{w}.json"));
            std::fs::write(
                &spec_path,
                serde_json::to_vec(&WorkerSpec {
                    swarm,
                    identities: chunk.to_vec(),
                })?,
            )?;
            workers.push(Worker::spawn(&exe, spec_path, run_dir, w, 1, link)?);
        }
        Ok(Agents::Workers(workers))
    }

    /// The counters of all agents now (a worker's are at most [`SAMPLE_EVERY`] old).
    pub fn sample(&self) -> Sample {
        match self {
            Agents::Local(s) => s.sample(),
            Agents::Workers(ws) => {
                let mut total = Sample::default();
                for w in ws {
                    total.add(&w.sample.borrow());
                }
                total
            }
        }
    }

    /// Every agent's record.
    pub async fn records(&mut self) -> anyhow::Result<Vec<AgentRecord>> {
        match self {
            Agents::Local(s) => Ok(s.records().await),
            Agents::Workers(ws) => {
                let mut all = Vec::new();
                for (i, w) in ws.iter_mut().enumerate() {
                    w.stdin.write_all(b"records\n").await?;
                    w.stdin.flush().await?;
                    match tokio::time::timeout(RECORDS_TIMEOUT, w.records.recv()).await {
                        Ok(Some(Ok(r))) => all.extend(r),
                        Ok(Some(Err(e))) => bail!("worker {i} failed: {e}"),
                        Ok(None) => bail!("worker {i} exited (see worker-{i}.log)"),
                        Err(_) => bail!("worker {i} did not answer within {RECORDS_TIMEOUT:?}"),
                    }
                }
                Ok(all)
            }
        }
    }

    /// The feedback scenario's status changes on every simulated cluster (see
    /// [`Swarm::flap`]); returns the steps made.
    pub async fn flap(&mut self, duration: Duration, every: Duration) -> anyhow::Result<u64> {
        match self {
            Agents::Local(s) => Ok(s.flap(duration, every).await),
            Agents::Workers(ws) => {
                let command = format!("flap {} {}\n", duration.as_millis(), every.as_millis());
                for w in ws.iter_mut() {
                    w.stdin.write_all(command.as_bytes()).await?;
                    w.stdin.flush().await?;
                }
                let mut steps = 0;
                for (i, w) in ws.iter_mut().enumerate() {
                    match tokio::time::timeout(duration + RECORDS_TIMEOUT, w.flapped.recv()).await {
                        Ok(Some(s)) => steps = s,
                        Ok(None) => bail!("worker {i} exited (see worker-{i}.log)"),
                        Err(_) => bail!("worker {i} did not finish changing statuses"),
                    }
                }
                Ok(steps)
            }
        }
    }

    /// CPU seconds the agents' processes have used so far: the workers', or this process's
    /// when the agents run in it.
    pub fn cpu_seconds(&self) -> f64 {
        let read = |pid: Option<u32>| {
            let pid = pid.map_or_else(|| "self".to_string(), |p| p.to_string());
            crate::machine::ProcStats::read(&pid).map_or(0.0, |s| s.cpu_seconds)
        };
        match self {
            Agents::Local(_) => read(None),
            Agents::Workers(ws) => ws
                .iter()
                .filter_map(|w| w.child.id())
                .map(|pid| read(Some(pid)))
                .sum(),
        }
    }

    /// Worker processes running the agents (0: they run in this process).
    pub fn workers(&self) -> usize {
        match self {
            Agents::Local(_) => 0,
            Agents::Workers(ws) => ws.len(),
        }
    }

    /// Worker `w`, when the agents run in workers.
    fn worker(&mut self, w: usize) -> anyhow::Result<&mut Worker> {
        match self {
            Agents::Local(_) => bail!("the agents run in this process, not in workers"),
            Agents::Workers(ws) => ws.get_mut(w).context("no such worker"),
        }
    }

    /// Sends `signal` to worker `w` (SIGSTOP and SIGCONT: its agents pause).
    pub fn signal_worker(
        &mut self,
        w: usize,
        signal: nix::sys::signal::Signal,
    ) -> anyhow::Result<()> {
        let pid = self
            .worker(w)?
            .pid()
            .with_context(|| format!("worker {w} has exited"))?;
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), signal)
            .with_context(|| format!("sending {} to worker {w}", signal.as_str()))
    }

    /// Kills worker `w` with SIGKILL (its agents vanish without a goodbye, their caches stay on
    /// disk) and starts it again on the same spec: the same agents, identities and caches.
    /// Returns once it is killed; `start_worker` starts it.
    pub async fn kill_worker(&mut self, w: usize) -> anyhow::Result<std::process::ExitStatus> {
        let worker = self.worker(w)?;
        worker.child.start_kill()?;
        Ok(
            tokio::time::timeout(Duration::from_secs(30), worker.child.wait())
                .await
                .with_context(|| format!("worker {w} outlived SIGKILL"))??,
        )
    }

    /// Starts worker `w` again after [`Agents::kill_worker`].
    pub fn start_worker(&mut self, w: usize) -> anyhow::Result<()> {
        let worker = self.worker(w)?;
        let again = Worker::spawn(
            &worker.exe.clone(),
            worker.spec_path.clone(),
            &worker.log_dir.clone(),
            worker.index,
            worker.starts + 1,
            worker.link.clone(),
        )?;
        *worker = again;
        Ok(())
    }

    /// Stops every agent and waits for them (workers exit); returns each worker's exit, or
    /// that it had to be killed, and whether it exited successfully.
    pub async fn stop_reporting(self) -> Vec<(String, bool)> {
        let mut exits = Vec::new();
        if let Agents::Workers(ws) = self {
            for mut w in ws {
                let _ = w.stdin.write_all(b"stop\n").await;
                let _ = w.stdin.flush().await;
                drop(w.stdin);
                let started = tokio::time::Instant::now();
                match tokio::time::timeout(Duration::from_secs(30), w.child.wait()).await {
                    Ok(status) => exits.push((
                        format!(
                            "worker {} exited in {:.1} s ({})",
                            w.index,
                            started.elapsed().as_secs_f64(),
                            status
                                .as_ref()
                                .map_or_else(|e| e.to_string(), |s| s.to_string())
                        ),
                        status.is_ok_and(|s| s.success()),
                    )),
                    Err(_) => {
                        let _ = w.child.kill().await;
                        exits.push((
                            format!(
                                "worker {} did not exit within 30 s of stop; killed",
                                w.index
                            ),
                            false,
                        ));
                    }
                }
            }
        } else {
            self.stop().await;
        }
        exits
    }

    /// Stops every agent and waits for them (workers exit).
    pub async fn stop(self) {
        match self {
            Agents::Local(s) => s.stop().await,
            Agents::Workers(ws) => {
                for mut w in ws {
                    let _ = w.stdin.write_all(b"stop\n").await;
                    let _ = w.stdin.flush().await;
                    drop(w.stdin);
                    if tokio::time::timeout(Duration::from_secs(30), w.child.wait())
                        .await
                        .is_err()
                    {
                        let _ = w.child.kill().await;
                    }
                }
            }
        }
    }
}
