//! Whose writes are whose on a spoke that agents of several hubs write to.
//!
//! Every write the apiserver records under a field manager; server-side apply merges the
//! fields of different managers and refuses (409) to change a field another manager owns
//! unless forced. An agent given `--hub-name NAME` writes works as `flotilla-work-agent/NAME`
//! and policies as `flotilla-policy-agent/NAME`, so two hubs' agents on one spoke own their
//! own fields, and the apiserver tells each whose fields it met. An agent without a hub name
//! keeps the managers every agent had before ([`FIELD_MANAGER`], [`POLICY_FIELD_MANAGER`]):
//! upgrading an existing install changes no ownership.

use std::sync::Arc;

use async_trait::async_trait;
use futures::stream::BoxStream;
use serde_json::Value;

use super::target::{
    AccessCheck, ApplyError, ApplyTarget, Deletion, FIELD_MANAGER, ObjectEvent, ResourceKind,
};
use crate::cache::AppliedResource;
use crate::governance::POLICY_FIELD_MANAGER;

/// What a hub's work manager starts with; the hub's name follows.
pub const WORK_MANAGER_PREFIX: &str = "flotilla-work-agent/";
/// What a hub's policy manager starts with; the hub's name follows.
pub const POLICY_MANAGER_PREFIX: &str = "flotilla-policy-agent/";
/// Longest `--hub-name`: a DNS label, which also keeps every manager under the apiserver's
/// 128 bytes and lets the name be part of a namespace's.
pub const MAX_HUB_NAME: usize = 63;

/// Why a hub name cannot be used. Not retryable: fix the flag.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum HubNameError {
    /// Not a DNS label (lower-case letters, digits and `-`, starting and ending with a letter
    /// or digit, at most 63 bytes). Not retryable.
    #[error(
        "--hub-name {0:?} is not a DNS label: use at most {MAX_HUB_NAME} lower-case letters, digits and '-', starting and ending with a letter or digit (e.g. central-it)"
    )]
    NotALabel(String),
}

/// The field managers one agent writes as, by the hub it serves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldManagers {
    hub: Option<String>,
    work: String,
    policy: String,
}

impl Default for FieldManagers {
    fn default() -> Self {
        Self::sole()
    }
}

impl FieldManagers {
    /// An agent that names no hub: the managers of every earlier agent, forcing as before.
    pub fn sole() -> Self {
        Self {
            hub: None,
            work: FIELD_MANAGER.to_owned(),
            policy: POLICY_FIELD_MANAGER.to_owned(),
        }
    }

    /// The managers of the agent serving hub `name`.
    pub fn for_hub(name: &str) -> Result<Self, HubNameError> {
        let label = !name.is_empty()
            && name.len() <= MAX_HUB_NAME
            && name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !name.starts_with('-')
            && !name.ends_with('-');
        if !label {
            return Err(HubNameError::NotALabel(name.to_owned()));
        }
        Ok(Self {
            hub: Some(name.to_owned()),
            work: format!("{WORK_MANAGER_PREFIX}{name}"),
            policy: format!("{POLICY_MANAGER_PREFIX}{name}"),
        })
    }

    /// The managers `--hub-name` asks for: a hub's when given, else [`Self::sole`].
    pub fn from_flag(name: Option<&str>) -> Result<Self, HubNameError> {
        name.map_or_else(|| Ok(Self::sole()), Self::for_hub)
    }

    /// The hub served, when named.
    pub fn hub(&self) -> Option<&str> {
        self.hub.as_deref()
    }

    /// The manager works are applied as.
    pub fn work(&self) -> &str {
        &self.work
    }

    /// The manager enforced policies write as.
    pub fn policy(&self) -> &str {
        &self.policy
    }

    /// The other hub whose agent writes as `manager`, if it is one: only an agent that names
    /// its own hub recognises others (an agent without a name forces, as it always did).
    pub fn other_hub<'a>(&self, manager: &'a str) -> Option<&'a str> {
        let own = self.hub.as_deref()?;
        let hub = manager
            .strip_prefix(WORK_MANAGER_PREFIX)
            .or_else(|| manager.strip_prefix(POLICY_MANAGER_PREFIX))?;
        (hub != own && !hub.is_empty()).then_some(hub)
    }

    /// The other hubs whose agents own fields of `object` (by its `metadata.managedFields`),
    /// sorted and without repeats.
    pub fn other_hubs_managing(&self, object: &Value) -> Vec<String> {
        let mut hubs: Vec<String> = object["metadata"]["managedFields"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|entry| entry["manager"].as_str())
            .filter_map(|manager| self.other_hub(manager))
            .map(str::to_owned)
            .collect();
        hubs.sort();
        hubs.dedup();
        hubs
    }
}

/// One field a server-side apply met that another manager owns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldConflict {
    /// The owning manager.
    pub manager: String,
    /// The field, as the apiserver writes it (`.data.key`, `.spec.containers[name="app"]`).
    pub field: String,
}

/// The conflicts of an apply's 409 message, as the apiserver words it ("Apply failed with 1
/// conflict: conflict with \"m\": .data.k", or one "conflicts with \"m\":" line per manager
/// followed by "- field" lines). Empty when the message is not of that form.
pub fn parse_conflicts(message: &str) -> Vec<FieldConflict> {
    let mut conflicts = Vec::new();
    let mut manager: Option<String> = None;
    for line in message.lines() {
        let line = line.trim();
        if let Some(field) = line.strip_prefix("- ") {
            if let Some(manager) = &manager {
                conflicts.push(FieldConflict {
                    manager: manager.clone(),
                    field: field.to_owned(),
                });
            }
            continue;
        }
        let Some(at) = line
            .find("conflicts with \"")
            .map(|at| at + "conflicts with ".len())
            .or_else(|| {
                line.find("conflict with \"")
                    .map(|at| at + "conflict with ".len())
            })
        else {
            continue;
        };
        let Some((name, rest)) = quoted(&line[at..]) else {
            continue;
        };
        // What follows the manager: ` using v1`, ` at <time>`, then ": <field>" for a single
        // conflict, or ":" alone before the "- field" lines.
        match rest.find(": ") {
            Some(colon) => conflicts.push(FieldConflict {
                manager: name,
                field: rest[colon + 2..].trim().to_owned(),
            }),
            None => manager = Some(name),
        }
    }
    conflicts
}

/// A Go-quoted string at the start of `s` and what follows it.
fn quoted(s: &str) -> Option<(String, &str)> {
    let body = s.strip_prefix('"')?;
    let mut out = String::new();
    let mut chars = body.char_indices();
    while let Some((i, c)) = chars.next() {
        match c {
            '"' => return Some((out, &body[i + 1..])),
            '\\' => out.push(chars.next()?.1),
            c => out.push(c),
        }
    }
    None
}

/// Removes the field an apiserver field path names from `object`, when the path is map keys
/// only (`.data.app.properties`: keys may hold dots, so the object's own keys decide where one
/// ends). False when it cannot be removed this way (list items, or the field is not there).
pub fn remove_field_path(object: &mut Value, path: &str) -> bool {
    let Some(mut rest) = path.strip_prefix('.') else {
        return false;
    };
    if rest.contains('[') {
        return false;
    }
    let mut node = object;
    loop {
        let Value::Object(map) = node else {
            return false;
        };
        if map.remove(rest).is_some() {
            return true;
        }
        // The longest key that is a whole segment of what remains.
        let Some(key) = map
            .keys()
            .filter(|k| rest.len() > k.len() && rest.starts_with(k.as_str()))
            .filter(|k| rest.as_bytes()[k.len()] == b'.')
            .max_by_key(|k| k.len())
            .cloned()
        else {
            return false;
        };
        rest = &rest[key.len() + 1..];
        node = map.get_mut(&key).expect("the key was just found");
    }
}

/// The spoke as the policy governor sees it: its writes recorded as the hub's policy manager
/// instead of [`POLICY_FIELD_MANAGER`]. The governor itself knows no hub.
#[derive(Debug)]
pub struct PolicyWritesAs {
    inner: Arc<dyn ApplyTarget>,
    manager: String,
}

impl PolicyWritesAs {
    /// `inner`, with the governor's manager replaced by `managers.policy()`.
    pub fn wrap(inner: Arc<dyn ApplyTarget>, managers: &FieldManagers) -> Arc<dyn ApplyTarget> {
        if managers.policy() == POLICY_FIELD_MANAGER {
            return inner;
        }
        Arc::new(Self {
            inner,
            manager: managers.policy().to_owned(),
        })
    }

    fn manager<'a>(&'a self, asked: &'a str) -> &'a str {
        if asked == POLICY_FIELD_MANAGER {
            &self.manager
        } else {
            asked
        }
    }
}

#[async_trait]
impl ApplyTarget for PolicyWritesAs {
    async fn resolve(&self, api_version: &str, kind: &str) -> Result<ResourceKind, ApplyError> {
        self.inner.resolve(api_version, kind).await
    }

    async fn apply(
        &self,
        resource: &AppliedResource,
        manifest: &Value,
        field_manager: &str,
        force: bool,
    ) -> Result<Value, ApplyError> {
        let manager = self.manager(field_manager);
        self.inner.apply(resource, manifest, manager, force).await
    }

    async fn create(
        &self,
        resource: &AppliedResource,
        object: &Value,
        field_manager: &str,
    ) -> Result<Value, ApplyError> {
        let manager = self.manager(field_manager);
        self.inner.create(resource, object, manager).await
    }

    async fn replace(
        &self,
        resource: &AppliedResource,
        object: &Value,
        field_manager: &str,
    ) -> Result<Value, ApplyError> {
        let manager = self.manager(field_manager);
        self.inner.replace(resource, object, manager).await
    }

    async fn get(&self, resource: &AppliedResource) -> Result<Option<Value>, ApplyError> {
        self.inner.get(resource).await
    }

    async fn list(
        &self,
        kind: &ResourceKind,
        namespace: Option<&str>,
        limit: usize,
    ) -> Result<Vec<Value>, ApplyError> {
        self.inner.list(kind, namespace, limit).await
    }

    async fn exists(&self, resource: &AppliedResource) -> Result<bool, ApplyError> {
        self.inner.exists(resource).await
    }

    async fn delete(&self, resource: &AppliedResource) -> Result<Deletion, ApplyError> {
        self.inner.delete(resource).await
    }

    async fn review_access(&self, check: &AccessCheck) -> Result<bool, ApplyError> {
        self.inner.review_access(check).await
    }

    async fn dry_run_as(
        &self,
        user: &str,
        resource: &AppliedResource,
        manifest: &Value,
        field_manager: &str,
    ) -> Result<(), ApplyError> {
        let manager = self.manager(field_manager);
        self.inner
            .dry_run_as(user, resource, manifest, manager)
            .await
    }

    fn watch(&self, kind: &ResourceKind) -> BoxStream<'static, ObjectEvent> {
        self.inner.watch(kind)
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn a_hub_name_is_a_dns_label() {
        let m = FieldManagers::for_hub("central-it").unwrap();
        assert_eq!(m.work(), "flotilla-work-agent/central-it");
        assert_eq!(m.policy(), "flotilla-policy-agent/central-it");
        for bad in ["", "Central", "a_b", "-a", "a-", &"a".repeat(64)] {
            let err = FieldManagers::for_hub(bad).unwrap_err().to_string();
            assert!(err.starts_with("--hub-name"), "{err}");
        }
        let longest = FieldManagers::for_hub(&"a".repeat(63)).unwrap();
        assert!(longest.policy().len() <= 128);
        assert_eq!(
            FieldManagers::from_flag(None).unwrap().work(),
            FIELD_MANAGER
        );
    }

    #[test]
    fn only_a_named_agent_sees_other_hubs() {
        let a = FieldManagers::for_hub("a").unwrap();
        assert_eq!(a.other_hub("flotilla-work-agent/b"), Some("b"));
        assert_eq!(a.other_hub("flotilla-policy-agent/b"), Some("b"));
        assert_eq!(a.other_hub("flotilla-work-agent/a"), None);
        assert_eq!(a.other_hub("kubectl"), None);
        assert_eq!(a.other_hub(FIELD_MANAGER), None);
        assert_eq!(
            FieldManagers::sole().other_hub("flotilla-work-agent/b"),
            None
        );
        let object = json!({"metadata": {"managedFields": [
            {"manager": "flotilla-work-agent/c"}, {"manager": "kubectl"},
            {"manager": "flotilla-work-agent/b"}, {"manager": "flotilla-policy-agent/b"},
            {"manager": "flotilla-work-agent/a"},
        ]}});
        assert_eq!(a.other_hubs_managing(&object), ["b", "c"]);
    }

    #[test]
    fn the_apiservers_conflict_messages_are_read() {
        let one =
            "Apply failed with 1 conflict: conflict with \"flotilla-work-agent/a\": .data.shared";
        assert_eq!(
            parse_conflicts(one),
            [FieldConflict {
                manager: "flotilla-work-agent/a".into(),
                field: ".data.shared".into()
            }]
        );
        let many = "Apply failed with 3 conflicts: conflicts with \"flotilla-work-agent/a\":\n\
                    - .data.x\n- .data.y\nconflicts with \"kubectl\" using v1 at 2026-01-01T00:00:00Z:\n- .data.z";
        let got: Vec<(String, String)> = parse_conflicts(many)
            .into_iter()
            .map(|c| (c.manager, c.field))
            .collect();
        assert_eq!(
            got,
            [
                ("flotilla-work-agent/a".into(), ".data.x".into()),
                ("flotilla-work-agent/a".into(), ".data.y".into()),
                ("kubectl".into(), ".data.z".into()),
            ]
        );
        let update = "Apply failed with 1 conflict: conflict with \"kubectl\" using v1: .data.k";
        assert_eq!(parse_conflicts(update)[0].field, ".data.k");
        assert!(parse_conflicts("the server could not find the requested resource").is_empty());
    }

    #[test]
    fn map_fields_are_removed_even_with_dots_in_keys() {
        let mut cm = json!({"data": {"app.properties": "x", "app": {"y": 1}, "k": "v"}});
        assert!(remove_field_path(&mut cm, ".data.app.properties"));
        assert!(remove_field_path(&mut cm, ".data.app.y"));
        assert!(!remove_field_path(&mut cm, ".data.missing"));
        assert!(!remove_field_path(
            &mut cm,
            ".spec.containers[name=\"app\"].image"
        ));
        assert_eq!(cm, json!({"data": {"app": {}, "k": "v"}}));
    }
}
