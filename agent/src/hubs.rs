//! The hubs one agent serves, on disk: `<data-dir>/hubs/NAME/`, one directory per hub, with
//! the hub's address in `hub.json` and the agent's identity from that hub in `identity/`.
//!
//! `flotilla-agent join --hub-name NAME` on a data directory without a single hub's identity
//! (`<data-dir>/identity`) joins into this layout, and joining again with another hub's token
//! and name adds a hub; `flotilla-agent run` without `--hub` then serves every hub here, each
//! with its own session, identity, cache partition, reconciler, outbox, tunnel end and field
//! managers (`flotilla-work-agent/NAME`). An install of the single-hub layout (`--hub` with an
//! identity in `<data-dir>/identity` or `--cert-dir`) runs exactly as before.
//!
//! Every hub of one data directory is joined as the same cluster name (`--cluster-name`):
//! each hub records it in its own `ManagedCluster`, and the hubs never see each other.

use std::fs;
use std::path::{Path, PathBuf};

use flotilla_transport::files::{Access, write_atomic};
use serde::{Deserialize, Serialize};

use crate::apply::FieldManagers;
use crate::config::{AgentConfig, IDENTITY_SUBDIR};
use crate::identity::Identity;

/// The hubs' directory under `--data-dir`.
pub const HUBS_SUBDIR: &str = "hubs";
/// A hub's address, in its directory.
pub const HUB_FILE: &str = "hub.json";
/// Most hubs one agent serves. Each is a session, a reconciler, a policy governor and a tunnel
/// end in one process, with watches on the spoke of its own; past a handful the spoke's
/// apiserver, not the agent, is what suffers, and a cluster managed by that many hubs is a
/// design to revisit.
pub const MAX_HUBS: usize = 8;

/// Why the joined hubs cannot be read or changed. `Io` is retryable once the disk is fixed;
/// the others need the operator.
#[derive(Debug, thiserror::Error)]
pub enum HubsError {
    /// A file or directory could not be read or written. Retryable once the disk is fixed.
    #[error("joined hubs: {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A hub file does not parse, or names another hub than its directory. Not retryable:
    /// remove the hub's directory and join it again.
    #[error("joined hub file {path}: {detail}; remove its directory and join that hub again")]
    Corrupt { path: PathBuf, detail: String },
    /// The agent serves [`MAX_HUBS`] already. Not retryable: remove a hub first.
    #[error(
        "this agent serves {MAX_HUBS} hubs already ({0}); at most {MAX_HUBS}: leave one first (flotilla-agent leave --hub NAME)"
    )]
    TooMany(String),
    /// No hub of that name is joined. Not retryable.
    #[error("no hub {name} is joined in {dir} (joined: {joined})")]
    NotJoined {
        name: String,
        dir: PathBuf,
        joined: String,
    },
}

/// One hub the agent serves, as `hub.json` holds it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct JoinedHub {
    /// The hub's name on this spoke (`--hub-name`, a DNS label): its field managers, its
    /// cache partition and its directory.
    pub name: String,
    /// The hub's agent address, host:port (`--hub` at join).
    pub address: String,
    /// The name the hub's certificate is checked against.
    pub server_name: String,
}

/// The hubs directory of one data directory.
#[derive(Clone, Debug)]
pub struct JoinedHubs {
    dir: PathBuf,
}

impl JoinedHubs {
    /// The hubs joined in `data_dir`.
    pub fn in_data_dir(data_dir: &Path) -> JoinedHubs {
        JoinedHubs {
            dir: data_dir.join(HUBS_SUBDIR),
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The directory of hub `name`.
    pub fn hub_dir(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// The agent's identity from hub `name`.
    pub fn identity(&self, name: &str) -> Identity {
        Identity::new(self.hub_dir(name).join(IDENTITY_SUBDIR))
    }

    /// Every hub joined (its hub file written, its identity complete), by name. A directory
    /// without a hub file is a join under way or cut short, and not served.
    pub fn list(&self) -> Result<Vec<JoinedHub>, HubsError> {
        let entries = match fs::read_dir(&self.dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(source) => {
                return Err(HubsError::Io {
                    path: self.dir.clone(),
                    source,
                });
            }
        };
        let mut hubs = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|source| HubsError::Io {
                path: self.dir.clone(),
                source,
            })?;
            let path = entry.path().join(HUB_FILE);
            let text = match fs::read(&path) {
                Ok(text) => text,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(source) => return Err(HubsError::Io { path, source }),
            };
            let hub: JoinedHub = serde_json::from_slice(&text).map_err(|e| HubsError::Corrupt {
                path: path.clone(),
                detail: e.to_string(),
            })?;
            if entry.file_name().to_str() != Some(hub.name.as_str()) {
                return Err(HubsError::Corrupt {
                    path,
                    detail: format!("names hub {:?}, not its directory's", hub.name),
                });
            }
            if FieldManagers::for_hub(&hub.name).is_err() {
                return Err(HubsError::Corrupt {
                    path,
                    detail: format!("hub name {:?} is not a DNS label", hub.name),
                });
            }
            if self.identity(&hub.name).exists() {
                hubs.push(hub);
            }
        }
        hubs.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(hubs)
    }

    /// Whether one more hub, `name`, may be joined: it is joined already, or fewer than
    /// [`MAX_HUBS`] are.
    pub fn check_room_for(&self, name: &str) -> Result<(), HubsError> {
        let hubs = self.list()?;
        if hubs.len() >= MAX_HUBS && !hubs.iter().any(|h| h.name == name) {
            return Err(HubsError::TooMany(names(&hubs)));
        }
        Ok(())
    }

    /// Records `hub` as joined, once its identity is stored (the hub file is written last, so
    /// a join cut short is never served).
    pub fn record(&self, hub: &JoinedHub) -> Result<(), HubsError> {
        let path = self.hub_dir(&hub.name).join(HUB_FILE);
        let json = serde_json::to_vec_pretty(hub).expect("a hub file serializes");
        write_atomic(&path, &json, Access::Public).map_err(|source| HubsError::Io { path, source })
    }

    /// The joined hub `name`, or an error listing the hubs there are.
    pub fn get(&self, name: &str) -> Result<JoinedHub, HubsError> {
        let hubs = self.list()?;
        hubs.iter()
            .find(|h| h.name == name)
            .cloned()
            .ok_or_else(|| HubsError::NotJoined {
                name: name.to_owned(),
                dir: self.dir.clone(),
                joined: names(&hubs),
            })
    }

    /// Removes hub `name`'s directory: its hub file first (so it is no longer served), then its
    /// identity.
    pub fn remove(&self, name: &str) -> Result<(), HubsError> {
        let dir = self.hub_dir(name);
        let file = dir.join(HUB_FILE);
        match fs::remove_file(&file) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => return Err(HubsError::Io { path: file, source }),
        }
        fs::remove_dir_all(&dir).map_err(|source| HubsError::Io { path: dir, source })
    }
}

fn names(hubs: &[JoinedHub]) -> String {
    if hubs.is_empty() {
        return "none".to_owned();
    }
    hubs.iter()
        .map(|h| h.name.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

/// The cache partition of `cluster` as served to hub `hub`: hub and cluster names are DNS
/// labels, so `hub/cluster` is no single-hub agent's partition (a bare cluster name) and no
/// other hub's.
pub fn cache_partition(hub: &str, cluster: &str) -> String {
    format!("{hub}/{cluster}")
}

impl AgentConfig {
    /// The configuration of this agent serving `hub` from `hubs`: the process's flags, with the
    /// hub's address, server name, name (its field managers) and identity directory.
    pub fn for_hub(&self, hubs: &JoinedHubs, hub: &JoinedHub) -> AgentConfig {
        AgentConfig {
            hub: Some(hub.address.clone()),
            server_name: Some(hub.server_name.clone()),
            hub_name: Some(hub.name.clone()),
            cert_dir: Some(hubs.identity(&hub.name).dir().to_path_buf()),
            ..self.clone()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hub(name: &str) -> JoinedHub {
        JoinedHub {
            name: name.into(),
            address: format!("{name}.example:443"),
            server_name: format!("{name}.example"),
        }
    }

    /// Marks `name`'s identity complete, as a finished join leaves it.
    fn identity(hubs: &JoinedHubs, name: &str) {
        let dir = hubs.identity(name).dir().to_path_buf();
        fs::create_dir_all(&dir).unwrap();
        for file in [
            crate::identity::CA_FILE,
            crate::identity::CERT_FILE,
            crate::identity::KEY_FILE,
        ] {
            fs::write(dir.join(file), "x").unwrap();
        }
    }

    #[test]
    fn joined_hubs_are_listed_by_name_and_a_join_cut_short_is_not_served() {
        let data = tempfile::tempdir().unwrap();
        let hubs = JoinedHubs::in_data_dir(data.path());
        assert_eq!(hubs.list().unwrap(), vec![]);
        for name in ["department", "central-it"] {
            identity(&hubs, name);
            hubs.record(&hub(name)).unwrap();
        }
        // Identity stored, hub file not yet written: a join under way.
        identity(&hubs, "pending");
        // Hub file written, identity gone: not served either.
        fs::create_dir_all(hubs.hub_dir("broken")).unwrap();
        hubs.record(&hub("broken")).unwrap();
        let names: Vec<_> = hubs.list().unwrap().into_iter().map(|h| h.name).collect();
        assert_eq!(names, ["central-it", "department"]);
        assert_eq!(hubs.get("department").unwrap(), hub("department"));
        let err = hubs.get("elsewhere").unwrap_err().to_string();
        assert!(
            err.starts_with("no hub elsewhere is joined in")
                && err.ends_with("(joined: central-it, department)"),
            "{err}"
        );

        hubs.remove("department").unwrap();
        let names: Vec<_> = hubs.list().unwrap().into_iter().map(|h| h.name).collect();
        assert_eq!(names, ["central-it"]);
        assert!(!hubs.hub_dir("department").exists());
    }

    #[test]
    fn a_hub_file_in_another_hubs_directory_is_refused_naming_it() {
        let data = tempfile::tempdir().unwrap();
        let hubs = JoinedHubs::in_data_dir(data.path());
        identity(&hubs, "department");
        let path = hubs.hub_dir("department").join(HUB_FILE);
        fs::write(&path, serde_json::to_vec(&hub("central-it")).unwrap()).unwrap();
        let err = hubs.list().unwrap_err().to_string();
        assert!(
            err.contains(&path.display().to_string())
                && err.contains("names hub \"central-it\", not its directory's"),
            "{err}"
        );
        fs::write(&path, "{").unwrap();
        assert!(matches!(hubs.list(), Err(HubsError::Corrupt { .. })));
    }

    #[test]
    fn at_most_max_hubs_are_joined() {
        let data = tempfile::tempdir().unwrap();
        let hubs = JoinedHubs::in_data_dir(data.path());
        for n in 0..MAX_HUBS {
            let name = format!("hub-{n}");
            hubs.check_room_for(&name).unwrap();
            identity(&hubs, &name);
            hubs.record(&hub(&name)).unwrap();
        }
        // Joining one of them again is fine; one more is not.
        hubs.check_room_for("hub-0").unwrap();
        let err = hubs.check_room_for("one-more").unwrap_err().to_string();
        assert!(err.contains("leave one first"), "{err}");
    }

    #[test]
    fn partitions_of_hubs_are_neither_each_others_nor_a_single_hub_agents() {
        let a = cache_partition("department", "store-7");
        let b = cache_partition("central-it", "store-7");
        assert_ne!(a, b);
        assert_ne!(a, "store-7");
        assert!(!a.starts_with("store-7"));
    }
}
