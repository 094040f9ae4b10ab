//! One child process (etcd or kube-apiserver) whose output goes to a log file and which is always
//! stopped and reaped when dropped.

use std::fs::File;
use std::io::{Read as _, Seek as _, SeekFrom};
use std::path::{Path, PathBuf};
use std::process::{Child, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use anyhow::Context as _;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

/// How long a child gets to exit after SIGTERM before it is killed. Both servers exit well within
/// this on a test machine; the bound only matters for a stuck one.
const TERMINATE_GRACE: Duration = Duration::from_secs(5);

pub(crate) struct ChildProcess {
    name: &'static str,
    pid: u32,
    /// `None` once the child has been reaped, so it is never signalled or waited for twice.
    child: Option<Child>,
    /// SIGTERM was sent. Sent once only: Go servers treat a second SIGTERM as "exit now".
    terminated: bool,
    log_path: PathBuf,
}

impl ChildProcess {
    /// Starts `program` with stdout and stderr appended to `log_path` (never inherited: a test's
    /// output should not carry a server's chatter) and stdin closed.
    ///
    /// The child stays in the test's process group on purpose: a Ctrl-C in the terminal then
    /// reaches it too, which is the only cleanup there is when the test process dies without
    /// unwinding.
    pub(crate) fn spawn(
        name: &'static str,
        program: &Path,
        args: &[String],
        log_path: PathBuf,
    ) -> anyhow::Result<ChildProcess> {
        let log = File::create(&log_path)
            .with_context(|| format!("creating {name}'s log {}", log_path.display()))?;
        let child = std::process::Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {name} ({})", program.display()))?;
        Ok(ChildProcess {
            name,
            pid: child.id(),
            child: Some(child),
            terminated: false,
            log_path,
        })
    }

    pub(crate) fn name(&self) -> &'static str {
        self.name
    }

    pub(crate) fn pid(&self) -> u32 {
        self.pid
    }

    /// The exit status if the child has already exited (and reaps it), `None` while it runs.
    pub(crate) fn try_exited(&mut self) -> anyhow::Result<Option<ExitStatus>> {
        let Some(child) = self.child.as_mut() else {
            anyhow::bail!("{} was already stopped", self.name);
        };
        let status = child.try_wait()?;
        if status.is_some() {
            self.child = None;
        }
        Ok(status)
    }

    /// Asks the child to exit (SIGTERM) without waiting; [`ChildProcess::stop`] then waits. Split
    /// so that several children can shut down at the same time.
    pub(crate) fn terminate(&mut self) {
        if self.child.is_some() && !self.terminated {
            self.terminated = true;
            // An error means it is already gone (ESRCH); `stop` reaps it either way.
            let _ = kill(Pid::from_raw(self.pid as i32), Signal::SIGTERM);
        }
    }

    /// SIGTERM, wait up to [`TERMINATE_GRACE`], then SIGKILL; always reaps the child, so no zombie
    /// is left behind. Blocking: it runs from `Drop`, which cannot await.
    pub(crate) fn stop(&mut self) {
        self.terminate();
        let Some(mut child) = self.child.take() else {
            return;
        };
        let pid = Pid::from_raw(self.pid as i32);
        // std has no wait-with-timeout, so a thread waits and reports; we wait on its report with a
        // deadline instead of polling.
        let (exited, on_exit) = mpsc::channel();
        let waiter = std::thread::spawn(move || {
            let _ = exited.send(child.wait());
        });
        if on_exit.recv_timeout(TERMINATE_GRACE).is_err() {
            tracing::warn!(
                name = self.name,
                pid = self.pid,
                "did not exit after SIGTERM; killing"
            );
            // The child cannot have been reaped yet (the waiter would have reported), so the pid
            // still names it, barring the microseconds between its wait returning and its send.
            let _ = kill(pid, Signal::SIGKILL);
            let _ = on_exit.recv();
        }
        let _ = waiter.join();
    }

    /// The last `lines` lines of the child's log, for error messages.
    pub(crate) fn log_tail(&self, lines: usize) -> String {
        log_tail(&self.log_path, lines)
    }
}

impl Drop for ChildProcess {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The last `lines` lines of the file at `path` (reading at most its last 64 KiB).
fn log_tail(path: &Path, lines: usize) -> String {
    const MAX_BYTES: u64 = 64 * 1024;
    let read = || -> std::io::Result<String> {
        let mut file = File::open(path)?;
        let len = file.metadata()?.len();
        file.seek(SeekFrom::Start(len.saturating_sub(MAX_BYTES)))?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes)?;
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    };
    match read() {
        Ok(text) => {
            let all: Vec<&str> = text.lines().collect();
            all[all.len().saturating_sub(lines)..].join("\n")
        }
        Err(err) => format!("(cannot read {}: {err})", path.display()),
    }
}
