//! The controllers' view of the store: one list-then-watch loop ([`reflect`]) per kind, each
//! forwarding what it sees into the controller's single, bounded queue. The controller owns
//! its model alone and applies updates in order; a full queue holds the watch loops back
//! (they resume from their last revision), so a slow controller costs memory nowhere.

use std::collections::HashSet;
use std::sync::Arc;

use async_trait::async_trait;
use flotilla_proto::api::Kind;
use flotilla_store::reflect::{Reflector, reflect};
use flotilla_store::{Object, Store, WatchEvent, name_of, namespace_of};
use tokio::sync::{Mutex, mpsc, watch};
use tokio::task::JoinSet;

/// One thing a watch loop saw.
#[derive(Debug)]
pub enum Update {
    /// A complete list of the kind (the first one, or after the watch history was lost): the
    /// controller replaces what it knows of the kind with it.
    Listed(Kind, Vec<Object>),
    /// One change.
    Changed(Kind, WatchEvent),
}

/// Decides which objects of a kind a controller keeps (the rest never reach its queue).
pub type Keep = fn(&Object) -> bool;

/// An object's namespace (none for cluster-scoped kinds) and name.
type ObjectKey = (Option<String>, String);

struct Feed {
    kind: Kind,
    tx: mpsc::Sender<Update>,
    /// With a [`Keep`] filter: the objects kept so far, so that one that stops matching reaches
    /// the controller as deleted.
    keep: Option<(Keep, Mutex<HashSet<ObjectKey>>)>,
}

fn key(o: &Object) -> ObjectKey {
    (namespace_of(o).map(str::to_string), name_of(o).to_string())
}

#[async_trait]
impl Reflector for Feed {
    async fn replace(&self, mut items: Vec<Object>) {
        if let Some((keep, kept)) = &self.keep {
            items.retain(keep);
            *kept.lock().await = items.iter().map(key).collect();
        }
        // A closed queue means the controller stopped; its stop signal ends this loop too.
        let _ = self.tx.send(Update::Listed(self.kind, items)).await;
    }

    async fn apply(&self, event: WatchEvent) {
        let event = match &self.keep {
            None => event,
            Some((keep, kept)) => {
                let mut kept = kept.lock().await;
                let k = key(event.object());
                match event {
                    WatchEvent::Deleted(o) if kept.remove(&k) => WatchEvent::Deleted(o),
                    WatchEvent::Deleted(_) => return,
                    WatchEvent::Added(o) | WatchEvent::Modified(o) if keep(&o) => {
                        kept.insert(k);
                        WatchEvent::Modified(o)
                    }
                    WatchEvent::Added(o) | WatchEvent::Modified(o) if kept.remove(&k) => {
                        WatchEvent::Deleted(o)
                    }
                    _ => return,
                }
            }
        };
        let _ = self.tx.send(Update::Changed(self.kind, event)).await;
    }
}

/// Starts one watch loop per kind, all feeding `tx`, until `stop` turns true. `keep` filters
/// the objects of one kind.
pub fn spawn(
    store: Arc<dyn Store>,
    kinds: &[Kind],
    keep: Option<(Kind, Keep)>,
    tx: mpsc::Sender<Update>,
    stop: watch::Receiver<bool>,
    tasks: &mut JoinSet<()>,
) {
    for &kind in kinds {
        let feed = Feed {
            kind,
            tx: tx.clone(),
            keep: keep
                .filter(|(k, _)| *k == kind)
                .map(|(_, f)| (f, Mutex::new(HashSet::new()))),
        };
        let store = store.clone();
        let stop = stop.clone();
        tasks.spawn(async move { reflect(kind, store.as_ref(), &feed, stop).await });
    }
}

/// One update into a controller's model: noted for `readiness`, then each change it makes to
/// what is `known` handed to `apply`.
pub fn absorb(
    update: Update,
    readiness: &mut Readiness,
    known: &mut Known,
    mut apply: impl FnMut(Kind, WatchEvent),
) {
    readiness.note(&update);
    for (kind, event) in known.changes(update) {
        apply(kind, event);
    }
}

/// Up to `batch` more updates that are already waiting, absorbed without waiting for any.
pub fn absorb_waiting(
    rx: &mut mpsc::Receiver<Update>,
    batch: usize,
    readiness: &mut Readiness,
    known: &mut Known,
    mut apply: impl FnMut(Kind, WatchEvent),
) {
    for _ in 0..batch {
        let Ok(update) = rx.try_recv() else {
            break;
        };
        absorb(update, readiness, known, &mut apply);
    }
}

/// Tracks which kinds have delivered their first list: a controller acts only once it has
/// read everything it decides from, so it never undoes what it simply has not read yet.
#[derive(Debug)]
pub struct Readiness {
    waiting: HashSet<Kind>,
}

impl Readiness {
    pub fn new(kinds: &[Kind]) -> Readiness {
        Readiness {
            waiting: kinds.iter().copied().collect(),
        }
    }

    /// Notes an update; true once every kind has been listed.
    pub fn note(&mut self, update: &Update) -> bool {
        if let Update::Listed(kind, _) = update {
            self.waiting.remove(kind);
        }
        self.waiting.is_empty()
    }

    pub fn ready(&self) -> bool {
        self.waiting.is_empty()
    }
}

/// The objects of each kind a controller has seen, so a relist can be turned into changes:
/// an upsert per listed object and a deletion per object that is gone.
#[derive(Debug, Default)]
pub struct Known(std::collections::HashMap<Kind, HashSet<ObjectKey>>);

impl Known {
    /// The changes an update amounts to, in order.
    pub fn changes(&mut self, update: Update) -> Vec<(Kind, WatchEvent)> {
        match update {
            Update::Changed(kind, event) => {
                let k = key(event.object());
                let known = self.0.entry(kind).or_default();
                match &event {
                    WatchEvent::Deleted(_) => known.remove(&k),
                    _ => known.insert(k),
                };
                vec![(kind, event)]
            }
            Update::Listed(kind, items) => {
                let fresh: HashSet<_> = items.iter().map(key).collect();
                let known = self.0.entry(kind).or_default();
                let mut changes: Vec<(Kind, WatchEvent)> = known
                    .difference(&fresh)
                    .map(|(ns, name)| {
                        let mut meta = serde_json::json!({ "name": name });
                        if let Some(ns) = ns {
                            meta["namespace"] = ns.clone().into();
                        }
                        (
                            kind,
                            WatchEvent::Deleted(serde_json::json!({
                                "apiVersion": kind.api_version(), "kind": kind.name(), "metadata": meta,
                            })),
                        )
                    })
                    .collect();
                *known = fresh;
                changes.extend(items.into_iter().map(|o| (kind, WatchEvent::Modified(o))));
                changes
            }
        }
    }
}
