//! Watches of the kinds the templates read: every change to an object of a watched kind is
//! passed to the governor, which marks due the templates whose reads cover it.
//!
//! One task per kind (never more than [`MAX_WATCHED_KINDS`]), each forwarding the target's
//! watch stream into one bounded channel: when the governor is busy the watches wait, and
//! the stream (re-listing by itself after errors) waits with them. A watch starts by listing
//! the kind, and every (re)list ends with `Listed`, which marks due every template reading the
//! kind: so a change made between an evaluation and the start of its watch, or while the watch
//! was down, is seen, deletions included (a deleted object is in no list and sends no event of
//! its own).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use futures::StreamExt as _;
use serde_json::Value;
use tokio::sync::mpsc;
use tokio::task::{AbortHandle, JoinSet};
use tracing::{debug, warn};

use super::MAX_WATCHED_KINDS;
use crate::apply::{ApplyTarget, ObjectEvent, ResourceKind};

/// Changes buffered between the watches and the governor.
const CHANGE_CHANNEL: usize = 256;

/// A kind by what identifies it on the spoke: (group, version, resource).
pub(crate) type KindKey = (String, String, String);

pub(crate) fn kind_key(kind: &ResourceKind) -> KindKey {
    (
        kind.group.clone(),
        kind.version.clone(),
        kind.resource.clone(),
    )
}

/// One object of a watched kind changed (or went away), or the kind was (re)listed.
#[derive(Debug)]
pub(crate) struct WatchedChange {
    pub kind: KindKey,
    /// `None` for a (re)list: anything of the kind may have changed.
    pub object: Option<(String, String)>,
}

/// The running watches.
pub(crate) struct KindWatches {
    target: Arc<dyn ApplyTarget>,
    running: HashMap<KindKey, AbortHandle>,
    tasks: JoinSet<()>,
    changes_tx: mpsc::Sender<WatchedChange>,
    changes: mpsc::Receiver<WatchedChange>,
    /// Whether the bound was already said (once, not per evaluation).
    said_full: bool,
}

impl KindWatches {
    pub fn new(target: Arc<dyn ApplyTarget>) -> KindWatches {
        let (changes_tx, changes) = mpsc::channel(CHANGE_CHANNEL);
        KindWatches {
            target,
            running: HashMap::new(),
            tasks: JoinSet::new(),
            changes_tx,
            changes,
            said_full: false,
        }
    }

    /// Watches exactly `kinds`: stops the watches of kinds no longer read, starts those of new
    /// ones while fewer than [`MAX_WATCHED_KINDS`] run.
    pub fn watch_only(&mut self, kinds: BTreeMap<KindKey, ResourceKind>) {
        self.running.retain(|key, task| {
            let keep = kinds.contains_key(key);
            if !keep {
                task.abort();
            }
            keep
        });
        // Reap the stopped ones so the set does not grow.
        while self.tasks.try_join_next().is_some() {}
        for (key, kind) in kinds {
            if self.running.contains_key(&key) {
                continue;
            }
            if self.running.len() >= MAX_WATCHED_KINDS {
                if !self.said_full {
                    warn!(
                        resource = %kind.resource,
                        limit = MAX_WATCHED_KINDS,
                        "policies read more kinds than the agent watches; the others are evaluated by their interval only"
                    );
                    self.said_full = true;
                }
                continue;
            }
            debug!(resource = %kind.resource, group = %kind.group, "watching a kind policies read");
            let stream = self.target.watch(&kind);
            let tx = self.changes_tx.clone();
            let task_key = key.clone();
            let task = self.tasks.spawn(async move {
                let mut stream = stream;
                while let Some(event) = stream.next().await {
                    let object = match event {
                        ObjectEvent::Changed(object) => Some((
                            text_at(&object, "/metadata/namespace"),
                            text_at(&object, "/metadata/name"),
                        )),
                        ObjectEvent::Deleted { namespace, name } => Some((namespace, name)),
                        ObjectEvent::Listed => None,
                    };
                    let change = WatchedChange {
                        kind: task_key.clone(),
                        object,
                    };
                    if tx.send(change).await.is_err() {
                        return;
                    }
                }
            });
            self.running.insert(key, task);
        }
    }

    /// The next change on a watched kind.
    pub async fn next_change(&mut self) -> Option<WatchedChange> {
        self.changes.recv().await
    }
}

fn text_at(object: &Value, pointer: &str) -> String {
    object
        .pointer(pointer)
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string()
}
