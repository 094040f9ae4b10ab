//! The long-lived tasks of a process (accept loops, servers, watch caches, writers, the agent's
//! reconciler and tunnel server), each with a name and one owner that notices when it ends. A
//! serving task that ends while the process is not shutting down is an error:
//! [`Tasks::first_end`] reports it with its cause at once, and the binary exits non-zero so
//! that its supervisor (systemd, Kubernetes) restarts it, rather than running on without a
//! listener or a reconciler.
//!
//! Shutdown is one pattern in every flotilla process: [`shutdown_signal`] (or a test's future)
//! completes, the owner tells the tasks to stop (a watch channel each of them selects on), then
//! [`Tasks::stop_within`] waits for them with a bound and aborts what is left.

use std::panic::AssertUnwindSafe;
use std::time::Duration;

use futures::FutureExt as _;

use tokio::task::{JoinError, JoinSet};
use tracing::{info, warn};

/// Why a supervised task failed; its own error, kept whole.
pub type TaskError = Box<dyn std::error::Error + Send + Sync>;

/// What a supervised task returns: `Ok` when it ended because it was told to stop.
pub type TaskResult = Result<(), TaskError>;

/// A supervised task ended before the process was shutting down. Not retryable in-process: the
/// process exits non-zero and its supervisor starts it again.
#[derive(Debug, thiserror::Error)]
pub enum TaskEnded {
    /// It returned without being told to stop.
    #[error("{task} stopped on its own")]
    Stopped { task: &'static str },
    /// It returned an error.
    #[error("{task} failed: {source}")]
    Failed {
        task: &'static str,
        #[source]
        source: TaskError,
    },
    /// It was aborted from outside (a panic is [`TaskEnded::Failed`], named).
    #[error("{task} crashed: {cause}")]
    Crashed { task: &'static str, cause: String },
}

impl TaskEnded {
    /// The name of the task that ended.
    pub fn task(&self) -> &'static str {
        match self {
            TaskEnded::Stopped { task }
            | TaskEnded::Failed { task, .. }
            | TaskEnded::Crashed { task, .. } => task,
        }
    }
}

/// Named long-lived tasks with one owner.
#[derive(Default)]
pub struct Tasks {
    set: JoinSet<(&'static str, TaskResult)>,
}

impl Tasks {
    pub fn new() -> Tasks {
        Tasks::default()
    }

    /// Starts `task` under this owner.
    pub fn spawn(
        &mut self,
        name: &'static str,
        task: impl Future<Output = TaskResult> + Send + 'static,
    ) {
        self.set.spawn(async move {
            // A panic is reported with the task's name, like any other failure.
            match AssertUnwindSafe(task).catch_unwind().await {
                Ok(result) => (name, result),
                Err(panic) => (name, Err(Panicked(panic_message(&panic)).into())),
            }
        });
    }

    /// Number of tasks still running.
    pub fn len(&self) -> usize {
        self.set.len()
    }

    /// Whether no task runs.
    pub fn is_empty(&self) -> bool {
        self.set.is_empty()
    }

    /// Waits for the first task to end, and says how. Call it only while the process is
    /// serving: any end is unexpected then. Pends forever when there are no tasks.
    pub async fn first_end(&mut self) -> TaskEnded {
        let first = match self.set.join_next().await {
            Some(ended) => ended_as(ended),
            None => std::future::pending().await,
        };
        // One failure often ends others with it (a server that panics drops its listener's
        // channel, and the accept loop stops): of those that ended together, the failure is
        // the cause worth naming.
        if matches!(first, TaskEnded::Stopped { .. }) {
            tokio::task::yield_now().await;
            while let Some(other) = self.set.try_join_next() {
                let other = ended_as(other);
                if !matches!(other, TaskEnded::Stopped { .. }) {
                    return other;
                }
            }
        }
        first
    }

    /// After the tasks were told to stop: waits for all of them, at most `within`, logging any
    /// that failed on the way out, then aborts the rest. Returns how many had to be aborted.
    pub async fn stop_within(mut self, within: Duration) -> usize {
        let all = async {
            while let Some(ended) = self.set.join_next().await {
                match ended {
                    Ok((_, Ok(()))) => {}
                    Ok((task, Err(e))) => warn!(task, error = %e, "failed while stopping"),
                    Err(e) => {
                        warn!(cause = %describe_join_error(&e), "a task crashed while stopping")
                    }
                }
            }
        };
        if tokio::time::timeout(within, all).await.is_ok() {
            return 0;
        }
        let left = self.set.len();
        info!(
            left,
            ?within,
            "tasks still running after the stop deadline; aborting them"
        );
        self.set.shutdown().await;
        left
    }
}

/// Completes on SIGTERM or Ctrl-C: the one shutdown trigger of every flotilla binary.
pub async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("installing a SIGTERM handler");
    tokio::select! {
        _ = term.recv() => {},
        _ = tokio::signal::ctrl_c() => {},
    }
}

/// A task's panic, as an error.
#[derive(Debug, thiserror::Error)]
#[error("panicked: {0}")]
struct Panicked(String);

fn panic_message(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "no message".to_string())
}

fn ended_as(ended: Result<(&'static str, TaskResult), JoinError>) -> TaskEnded {
    match ended {
        Ok((task, Ok(()))) => TaskEnded::Stopped { task },
        Ok((task, Err(source))) => TaskEnded::Failed { task, source },
        Err(e) => TaskEnded::Crashed {
            task: "a task",
            cause: describe_join_error(&e),
        },
    }
}

fn describe_join_error(e: &JoinError) -> String {
    if e.is_cancelled() {
        return "aborted".to_string();
    }
    match e.to_string() {
        s if s.is_empty() => "panicked".to_string(),
        s => s,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_first_task_to_end_is_named_with_its_cause() {
        let mut tasks = Tasks::new();
        tasks.spawn("watch cache", std::future::pending());
        tasks.spawn("agents' listener", async {
            Err::<(), TaskError>("accept: Invalid argument".into())
        });
        let ended = tasks.first_end().await;
        assert_eq!(ended.task(), "agents' listener");
        assert_eq!(
            ended.to_string(),
            "agents' listener failed: accept: Invalid argument"
        );
        // The one left never stops on its own: it is aborted at the bound.
        assert_eq!(tasks.stop_within(Duration::from_millis(10)).await, 1);
    }

    #[tokio::test]
    async fn a_panic_is_reported_with_the_task_name() {
        let mut tasks = Tasks::new();
        tasks.spawn("desired-state cache", async {
            panic!("store returned garbage")
        });
        let ended = tasks.first_end().await;
        assert_eq!(
            ended.to_string(),
            "desired-state cache failed: panicked: store returned garbage"
        );
    }

    #[tokio::test]
    async fn a_task_that_returns_unasked_is_reported() {
        let mut tasks = Tasks::new();
        tasks.spawn("status writer", async { Ok(()) });
        assert!(matches!(
            tasks.first_end().await,
            TaskEnded::Stopped {
                task: "status writer"
            }
        ));
    }
}
