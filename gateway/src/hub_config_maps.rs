//! The hub's ConfigMaps that hub templates read (`{{hub fromConfigMap "" "NAME" "KEY" hub}}`),
//! kept for exactly the namespaces whose cached root Policies call `fromConfigMap`: one list +
//! watch of that namespace's ConfigMaps each ([`reflect_namespace`]), started when the first
//! such policy appears there and stopped when the last one leaves. Never a watch of every
//! ConfigMap of the hub: a kube hub keeps many, in kube-system and elsewhere, that no template
//! reads.
//!
//! A namespace is *loading* until its first list: its policies are not rendered for delivery
//! meanwhile ([`HubConfigMaps::view`] is `None`), since a ConfigMap not read yet is not one
//! that does not exist, and the sessions' syncs wait for it. Once loaded, each change tells the
//! policies ([`ConfigMapReaders`]) which of them may render differently: those that read the
//! ConfigMap that changed, or all of the namespace's after a list.
//!
//! Bounds: at most [`MAX_FOLLOWED_NAMESPACES`] namespaces are followed; the policies of any
//! further one fail their `fromConfigMap` saying so (OCM's `hub-templates-error`, reported by
//! the agent as NonCompliant) until a followed namespace is released. A namespace's ConfigMaps
//! are kept while their data takes at most [`MAX_NAMESPACE_BYTES`]; beyond that only their
//! sizes are, reads fail saying so, and once the data fits again the namespace is listed anew.
//! Each ConfigMap holds at most 1 MiB of data, the store's rule (and the apiserver's).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use async_trait::async_trait;
use flotilla_proto::api::Kind;
use flotilla_store::reflect::{Reflector, reflect_namespace};
use flotilla_store::{Object, Store, WatchEvent, name_of};
use serde_json::{Map, Value, json};
use tokio::sync::watch;
use tokio::task::{AbortHandle, JoinSet};
use tracing::{debug, info, warn};

use crate::locks::{SyncMutex, lock};

/// Most namespaces whose ConfigMaps one gateway follows: policies that read ConfigMaps live in
/// a few namespaces of a fleet, each one list and one watch on the hub.
pub const MAX_FOLLOWED_NAMESPACES: usize = 64;

/// Most bytes of ConfigMap data (keys and values) a gateway keeps of one namespace: sixteen
/// ConfigMaps of the largest size, far more than the settings templates read.
pub const MAX_NAMESPACE_BYTES: usize = 16 * 1024 * 1024;

/// What templates read of one namespace's ConfigMaps, once it can be read.
#[derive(Clone, Debug)]
pub(crate) enum View {
    /// Each ConfigMap by name, as `{"data": {...}}` (the only field `fromConfigMap` reads).
    Loaded(Arc<BTreeMap<String, Arc<Value>>>),
    /// Every read fails with this reason: the namespace is beyond a bound.
    Unavailable(Arc<str>),
}

impl View {
    /// The ConfigMap `name` as the template engine takes it: the object, `Null` when there is
    /// none, or why it cannot be read.
    pub(crate) fn read(&self, name: &str) -> Result<Value, String> {
        match self {
            View::Loaded(maps) => Ok(maps.get(name).map_or(Value::Null, |m| Value::clone(m))),
            View::Unavailable(reason) => Err(reason.to_string()),
        }
    }
}

/// Which of a namespace's policies may render differently after a change.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Changed {
    /// All of them: the namespace was listed, or went over its bound.
    All,
    /// Those whose rendering read this ConfigMap (created, edited or deleted).
    One(String),
}

/// Who is told of a change to a followed namespace's ConfigMaps: the policies that read them.
pub(crate) trait ConfigMapReaders: Send + Sync + 'static {
    fn changed(&self, namespace: &str, what: &Changed);
}

/// Where a followed namespace stands.
enum Phase {
    /// Its first list (or the list after its data fits again) has not arrived.
    Loading,
    /// Every ConfigMap of the namespace, and the bytes of their data.
    Loaded {
        maps: Arc<BTreeMap<String, Arc<Value>>>,
        bytes: usize,
    },
    /// More than [`MAX_NAMESPACE_BYTES`]: only each ConfigMap's size is kept, to see when the
    /// data fits again.
    Over {
        sizes: HashMap<String, usize>,
        bytes: usize,
    },
}

enum Entry {
    /// Followed by the list + watch of this epoch: a new epoch (after the data fits again)
    /// restarts the loop, and what an older loop still delivers is ignored.
    Followed { epoch: u64, phase: Phase },
    /// Beyond [`MAX_FOLLOWED_NAMESPACES`]: not followed, its reads refused.
    Refused,
}

#[derive(Default)]
struct Entries {
    by_namespace: HashMap<String, Entry>,
    next_epoch: u64,
}

impl Entries {
    fn epoch(&mut self) -> u64 {
        self.next_epoch += 1;
        self.next_epoch
    }

    fn followed(&self) -> usize {
        self.by_namespace
            .values()
            .filter(|e| matches!(e, Entry::Followed { .. }))
            .count()
    }
}

/// The followed namespaces' ConfigMaps; see the module docs.
pub(crate) struct HubConfigMaps {
    entries: SyncMutex<Entries>,
    /// Bumped whenever a namespace is followed, released, restarted or loaded: what the loops'
    /// owner ([`follow`]) and the syncs waiting for a namespace watch.
    version: watch::Sender<u64>,
}

impl Default for HubConfigMaps {
    fn default() -> Self {
        HubConfigMaps {
            entries: SyncMutex::default(),
            version: watch::Sender::new(0),
        }
    }
}

impl HubConfigMaps {
    /// Follows exactly `namespaces` from now on: those not followed yet start loading (up to
    /// [`MAX_FOLLOWED_NAMESPACES`], the rest refused), the others are released.
    pub(crate) fn want(&self, namespaces: &BTreeSet<String>) {
        let mut entries = lock(&self.entries);
        let mut changed = false;
        entries.by_namespace.retain(|namespace, _| {
            let keep = namespaces.contains(namespace);
            if !keep {
                info!(
                    namespace,
                    "no policy reads this namespace's ConfigMaps any more: released"
                );
                changed = true;
            }
            keep
        });
        for namespace in namespaces {
            if matches!(
                entries.by_namespace.get(namespace),
                Some(Entry::Followed { .. })
            ) {
                continue;
            }
            if entries.followed() < MAX_FOLLOWED_NAMESPACES {
                let epoch = entries.epoch();
                entries.by_namespace.insert(
                    namespace.clone(),
                    Entry::Followed {
                        epoch,
                        phase: Phase::Loading,
                    },
                );
                info!(
                    namespace,
                    "a policy's hub templates read this namespace's ConfigMaps: following them"
                );
                changed = true;
            } else if !entries.by_namespace.contains_key(namespace) {
                warn!(
                    namespace,
                    limit = MAX_FOLLOWED_NAMESPACES,
                    "too many namespaces' ConfigMaps to follow; this one's hub templates fail"
                );
                entries
                    .by_namespace
                    .insert(namespace.clone(), Entry::Refused);
                changed = true;
            }
        }
        drop(entries);
        if changed {
            self.version.send_modify(|v| *v += 1);
        }
    }

    /// What templates of `namespace`'s policies read now; `None` while it is loading or not
    /// followed at all (nothing may be rendered from it yet).
    pub(crate) fn view(&self, namespace: &str) -> Option<View> {
        match lock(&self.entries).by_namespace.get(namespace)? {
            Entry::Refused => Some(View::Unavailable(
                format!(
                    "a gateway follows the ConfigMaps of at most {MAX_FOLLOWED_NAMESPACES} \
                     namespaces for hub templates, and namespace {namespace} is beyond them; keep \
                     the policies whose hub templates read ConfigMaps in fewer namespaces"
                )
                .into(),
            )),
            Entry::Followed { phase, .. } => match phase {
                Phase::Loading => None,
                Phase::Loaded { maps, .. } => Some(View::Loaded(maps.clone())),
                Phase::Over { bytes, .. } => Some(View::Unavailable(
                    format!(
                        "the ConfigMaps of namespace {namespace} hold {bytes} bytes of data, more \
                         than the {MAX_NAMESPACE_BYTES} a gateway keeps for hub templates; keep \
                         the ConfigMaps hub templates do not read in another namespace"
                    )
                    .into(),
                )),
            },
        }
    }

    /// The namespaces to run a list + watch for, with the epoch of each.
    pub(crate) fn followed(&self) -> HashMap<String, u64> {
        lock(&self.entries)
            .by_namespace
            .iter()
            .filter_map(|(namespace, entry)| match entry {
                Entry::Followed { epoch, .. } => Some((namespace.clone(), *epoch)),
                Entry::Refused => None,
            })
            .collect()
    }

    /// Changes whenever a namespace is followed, released, restarted or loaded.
    pub(crate) fn changes(&self) -> watch::Receiver<u64> {
        self.version.subscribe()
    }

    /// Takes a list of `namespace`'s ConfigMaps from the loop of `epoch`.
    fn replace(&self, namespace: &str, epoch: u64, items: Vec<Object>) -> Option<Changed> {
        let mut entries = lock(&self.entries);
        let phase = current(&mut entries, namespace, epoch)?;
        let mut maps = BTreeMap::new();
        let mut bytes = 0;
        for item in &items {
            let (name, data) = kept(item);
            bytes += data_bytes(&data);
            maps.insert(name, Arc::new(data));
        }
        let loading = matches!(phase, Phase::Loading);
        *phase = if bytes > MAX_NAMESPACE_BYTES {
            warn!(
                namespace,
                bytes,
                limit = MAX_NAMESPACE_BYTES,
                "the namespace's ConfigMaps exceed what a gateway keeps for hub templates"
            );
            Phase::Over {
                sizes: maps
                    .iter()
                    .map(|(name, data)| (name.clone(), data_bytes(data)))
                    .collect(),
                bytes,
            }
        } else {
            Phase::Loaded {
                maps: Arc::new(maps),
                bytes,
            }
        };
        drop(entries);
        if loading {
            debug!(namespace, configmaps = items.len(), "ConfigMaps loaded");
            self.version.send_modify(|v| *v += 1);
        }
        Some(Changed::All)
    }

    /// Takes one change of `namespace`'s ConfigMaps from the loop of `epoch`.
    fn apply(&self, namespace: &str, epoch: u64, event: WatchEvent) -> Option<Changed> {
        let mut entries = lock(&self.entries);
        let phase = current(&mut entries, namespace, epoch)?;
        let deleted = matches!(event, WatchEvent::Deleted(_));
        let (name, data) = kept(event.object());
        match phase {
            // A loop lists before it watches.
            Phase::Loading => return None,
            Phase::Loaded { maps, bytes } => {
                let before = maps.get(&name);
                if !deleted && before.is_some_and(|d| **d == data) {
                    // Labels or annotations: nothing a template reads.
                    return None;
                }
                *bytes -= before.map_or(0, |d| data_bytes(d));
                let held = Arc::make_mut(maps);
                if deleted {
                    held.remove(&name);
                } else {
                    *bytes += data_bytes(&data);
                    held.insert(name.clone(), Arc::new(data));
                }
                if *bytes <= MAX_NAMESPACE_BYTES {
                    return Some(Changed::One(name));
                }
                warn!(
                    namespace,
                    bytes = *bytes,
                    limit = MAX_NAMESPACE_BYTES,
                    "the namespace's ConfigMaps exceed what a gateway keeps for hub templates"
                );
                let sizes = maps
                    .iter()
                    .map(|(name, data)| (name.clone(), data_bytes(data)))
                    .collect();
                let bytes = *bytes;
                *phase = Phase::Over { sizes, bytes };
                return Some(Changed::All);
            }
            Phase::Over { sizes, bytes } => {
                *bytes -= sizes.remove(&name).unwrap_or(0);
                if !deleted {
                    let size = data_bytes(&data);
                    *bytes += size;
                    sizes.insert(name, size);
                }
                if *bytes > MAX_NAMESPACE_BYTES {
                    return None;
                }
                info!(
                    namespace,
                    bytes = *bytes,
                    "the namespace's ConfigMaps fit again: listing them anew"
                );
                *phase = Phase::Loading;
            }
        }
        // It fits again: listed anew by a new loop, its policies waiting for that list.
        let restart = entries.epoch();
        if let Some(Entry::Followed { epoch, .. }) = entries.by_namespace.get_mut(namespace) {
            *epoch = restart;
        }
        drop(entries);
        self.version.send_modify(|v| *v += 1);
        None
    }
}

/// The phase of `namespace` if it is followed by the loop of `epoch`; `None` for a loop
/// that was released or restarted since (its last deliveries are ignored).
fn current<'a>(entries: &'a mut Entries, namespace: &str, epoch: u64) -> Option<&'a mut Phase> {
    match entries.by_namespace.get_mut(namespace)? {
        Entry::Followed { epoch: e, phase } if *e == epoch => Some(phase),
        _ => None,
    }
}

/// A stored ConfigMap's name and what is kept of it: `{"data": ...}`.
fn kept(object: &Object) -> (String, Value) {
    let data = match object.get("data") {
        Some(Value::Object(data)) => Value::Object(data.clone()),
        _ => Value::Object(Map::new()),
    };
    (name_of(object).to_owned(), json!({ "data": data }))
}

/// The bytes of a kept ConfigMap's data: its keys and values.
fn data_bytes(kept: &Value) -> usize {
    kept["data"].as_object().map_or(0, |data| {
        data.iter()
            .map(|(key, value)| key.len() + value.as_str().map_or(0, str::len))
            .sum()
    })
}

/// One followed namespace's loop target.
struct Following {
    maps: Arc<HubConfigMaps>,
    readers: Arc<dyn ConfigMapReaders>,
    namespace: String,
    epoch: u64,
}

#[async_trait]
impl Reflector for Following {
    async fn replace(&self, items: Vec<Object>) {
        if let Some(changed) = self.maps.replace(&self.namespace, self.epoch, items) {
            self.readers.changed(&self.namespace, &changed);
        }
    }

    async fn apply(&self, event: WatchEvent) {
        if let Some(changed) = self.maps.apply(&self.namespace, self.epoch, event) {
            self.readers.changed(&self.namespace, &changed);
        }
    }
}

/// Runs one list + watch of ConfigMaps per followed namespace, started and stopped as
/// [`HubConfigMaps::want`] says, until `stop` fires. A loop that panics takes this task down
/// with it (and the gateway's supervisor reports it).
pub(crate) async fn follow(
    maps: Arc<HubConfigMaps>,
    store: Arc<dyn Store>,
    readers: Arc<dyn ConfigMapReaders>,
    mut stop: watch::Receiver<bool>,
) {
    let mut changes = maps.changes();
    let mut loops = JoinSet::new();
    let mut running: HashMap<String, (u64, AbortHandle)> = HashMap::new();
    loop {
        changes.borrow_and_update();
        let wanted = maps.followed();
        running.retain(|namespace, (epoch, handle)| {
            let keep = wanted.get(namespace) == Some(epoch);
            if !keep {
                debug!(namespace, "ConfigMap watch stopped");
                handle.abort();
            }
            keep
        });
        for (namespace, epoch) in wanted {
            if running.contains_key(&namespace) {
                continue;
            }
            let target = Following {
                maps: maps.clone(),
                readers: readers.clone(),
                namespace: namespace.clone(),
                epoch,
            };
            let (store, stop) = (store.clone(), stop.clone());
            let handle = loops.spawn(async move {
                reflect_namespace(
                    Kind::ConfigMap,
                    &target.namespace,
                    store.as_ref(),
                    &target,
                    stop,
                )
                .await;
            });
            debug!(namespace, epoch, "ConfigMap watch started");
            running.insert(namespace, (epoch, handle));
        }
        tokio::select! {
            changed = changes.changed() => if changed.is_err() { return },
            Some(ended) = loops.join_next(), if !loops.is_empty() => {
                if let Err(e) = ended && e.is_panic() {
                    std::panic::resume_unwind(e.into_panic());
                }
            }
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config_map(name: &str, data: Value) -> Object {
        json!({"apiVersion": "v1", "kind": "ConfigMap",
               "metadata": {"name": name, "namespace": "policies"}, "data": data})
    }

    fn epoch_of(maps: &HubConfigMaps, namespace: &str) -> u64 {
        maps.followed()[namespace]
    }

    #[test]
    fn a_namespace_is_read_only_once_listed_and_changes_name_what_changed() {
        let maps = HubConfigMaps::default();
        maps.want(&BTreeSet::from(["policies".to_owned()]));
        assert!(
            maps.view("policies").is_none(),
            "loading: nothing to read yet"
        );
        assert!(maps.view("other").is_none(), "not followed");
        let epoch = epoch_of(&maps, "policies");
        let listed = vec![config_map("settings", json!({"tier": "gold"}))];
        assert_eq!(maps.replace("policies", epoch, listed), Some(Changed::All));
        let view = maps.view("policies").expect("loaded");
        assert_eq!(view.read("settings"), Ok(json!({"data": {"tier": "gold"}})));
        assert_eq!(view.read("absent"), Ok(Value::Null));

        let edited = config_map("settings", json!({"tier": "silver"}));
        assert_eq!(
            maps.apply("policies", epoch, WatchEvent::Modified(edited.clone())),
            Some(Changed::One("settings".into()))
        );
        let mut relabelled = edited.clone();
        relabelled["metadata"]["labels"] = json!({"a": "b"});
        assert_eq!(
            maps.apply("policies", epoch, WatchEvent::Modified(relabelled)),
            None,
            "a label is nothing a template reads"
        );
        assert_eq!(
            maps.apply("policies", epoch + 7, WatchEvent::Deleted(edited.clone())),
            None,
            "an older loop's delivery is ignored"
        );
        assert_eq!(
            maps.apply("policies", epoch, WatchEvent::Deleted(edited)),
            Some(Changed::One("settings".into()))
        );
        assert_eq!(
            maps.view("policies").unwrap().read("settings"),
            Ok(Value::Null)
        );

        maps.want(&BTreeSet::new());
        assert!(maps.followed().is_empty() && maps.view("policies").is_none());
    }

    #[test]
    fn namespaces_beyond_the_bound_are_refused_until_one_is_released() {
        let maps = HubConfigMaps::default();
        let namespaces: BTreeSet<String> = (0..=MAX_FOLLOWED_NAMESPACES)
            .map(|i| format!("ns-{i:03}"))
            .collect();
        maps.want(&namespaces);
        assert_eq!(maps.followed().len(), MAX_FOLLOWED_NAMESPACES);
        let last = format!("ns-{MAX_FOLLOWED_NAMESPACES:03}");
        let Some(View::Unavailable(reason)) = maps.view(&last) else {
            panic!("{last} is beyond the bound");
        };
        assert!(
            reason.contains(&format!("namespace {last} is beyond them")),
            "{reason}"
        );
        let mut fewer = namespaces.clone();
        fewer.remove("ns-000");
        maps.want(&fewer);
        assert!(
            maps.followed().contains_key(&last),
            "promoted once a slot frees"
        );
        assert!(maps.view(&last).is_none(), "and loading");
    }

    #[test]
    fn a_namespace_over_its_bytes_fails_reads_until_it_fits_and_is_listed_again() {
        let maps = HubConfigMaps::default();
        maps.want(&BTreeSet::from(["policies".to_owned()]));
        let epoch = epoch_of(&maps, "policies");
        let big = |name: &str| config_map(name, json!({"k": "x".repeat(1024 * 1024 - 1)}));
        let listed: Vec<Object> = (0..16).map(|i| big(&format!("big-{i}"))).collect();
        assert_eq!(maps.replace("policies", epoch, listed), Some(Changed::All));
        assert!(matches!(maps.view("policies"), Some(View::Loaded(_))));
        assert_eq!(
            maps.apply("policies", epoch, WatchEvent::Added(big("big-16"))),
            Some(Changed::All)
        );
        let Some(View::Unavailable(reason)) = maps.view("policies") else {
            panic!("over the bound");
        };
        assert!(
            reason.starts_with("the ConfigMaps of namespace policies hold 17825792 bytes"),
            "{reason}"
        );
        assert_eq!(
            maps.apply("policies", epoch, WatchEvent::Deleted(big("big-3"))),
            None,
            "fits again: listed anew, nothing to render until then"
        );
        assert!(maps.view("policies").is_none(), "loading");
        assert_ne!(epoch_of(&maps, "policies"), epoch, "under a new loop");
    }
}
