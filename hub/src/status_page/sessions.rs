//! Where clusters' sessions are in scale-out mode (`--gateways external`): on the gateways
//! holding their shards, not on the hub. [`ShardOwners`] groups a page's clusters by owner as
//! the hub's shard directory names them and asks each owner once, all at once, over the relay
//! service (`Relay.Presence`, with the hub's gateway certificate, on the connections the proxy
//! front's tunnels use). Each question is bounded by [`PRESENCE_DEADLINE`]: a slow or dead
//! gateway costs a page at most that, and its rows show "—".
//!
//! The page says nothing false: a gateway's answer counts only for the shards it holds when it
//! answers (a stale directory entry gets "not mine", shown as "—"), and a cluster nobody
//! holds, or whose owner did not answer, shows "—" rather than "disconnected".
//!
//! Not for: routing tunnels (`flotilla_gateway::ShardRoute`), or deciding health (the
//! gateways' grace period writes the Available condition the page shows beside these).

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use async_trait::async_trait;
use flotilla_gateway::Gateway;
use flotilla_gateway::registry::SessionPresence;
use flotilla_gateway::shards::{Route, ShardView};
use flotilla_transport::hop::{HopClient, MAX_PRESENCE_CLUSTERS, OwnerPresence};
use tokio::time::Instant;

use super::LiveSessions;

/// How long a page waits for a gateway's answer, the dial to it included. Short: the page is
/// read by a person, and the Available condition beside these columns does not depend on it.
pub const PRESENCE_DEADLINE: Duration = Duration::from_secs(2);

/// The sessions of a fleet whose shards external gateways hold, learnt from those gateways.
pub struct ShardOwners {
    /// The hub's in-process gateway: its shard view (the directory, from the leases) names
    /// each shard's owner; it holds no shard itself in scale-out, but should it hold one its
    /// own sessions answer.
    gateway: Gateway,
    /// The relay client, presenting the hub's gateway certificate.
    hop: HopClient,
}

impl ShardOwners {
    pub fn new(gateway: Gateway, hop: HopClient) -> ShardOwners {
        ShardOwners { gateway, hop }
    }
}

/// A page's clusters by who can answer for them.
#[derive(Debug, Default, PartialEq, Eq)]
struct Askees<'a> {
    /// Clusters of shards the in-process gateway holds.
    here: Vec<&'a str>,
    /// (owner, clusters) by the owner's advertised address.
    owners: BTreeMap<String, (String, Vec<&'a str>)>,
}

fn askees<'a>(view: &ShardView, clusters: &[&'a str], now: Instant) -> Askees<'a> {
    let mut askees = Askees::default();
    for cluster in clusters {
        match view.route(cluster, now) {
            Route::Here { .. } => askees.here.push(cluster),
            Route::Elsewhere { owner, address, .. } => {
                askees
                    .owners
                    .entry(address)
                    .or_insert_with(|| (owner, Vec::new()))
                    .1
                    .push(cluster);
            }
            // Nobody holds it now (a handover): nobody can say.
            Route::Unowned { .. } => {}
        }
    }
    askees
}

#[async_trait]
impl LiveSessions for ShardOwners {
    async fn presence(&self, clusters: &[&str]) -> HashMap<String, SessionPresence> {
        let askees = askees(
            &self.gateway.shard_views().borrow(),
            clusters,
            Instant::now(),
        );
        let mut found: HashMap<String, SessionPresence> = askees
            .here
            .iter()
            .filter_map(|c| Some((c.to_string(), self.gateway.session_presence(c)?)))
            .collect();
        let questions = askees.owners.iter().flat_map(|(address, (owner, names))| {
            names
                .chunks(MAX_PRESENCE_CLUSTERS)
                .map(move |batch| async move {
                    let answer = self.hop.presence(address, batch, PRESENCE_DEADLINE).await;
                    (owner, answer)
                })
        });
        for (owner, answer) in futures::future::join_all(questions).await {
            match answer {
                Ok(answers) => found.extend(answers.into_iter().filter_map(|(cluster, p)| {
                    let presence = match p {
                        OwnerPresence::Connected { carrier, since } => {
                            SessionPresence::Connected { carrier, since }
                        }
                        OwnerPresence::Departed { at } => SessionPresence::Departed { at },
                        OwnerPresence::Unknown | OwnerPresence::NotHeld => return None,
                    };
                    Some((cluster, presence))
                })),
                Err(error) => {
                    tracing::warn!(gateway = %owner, error = %flotilla_ops::error_chain(&error), "the status page shows no session for this gateway's clusters: its answer failed");
                }
            }
        }
        found
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use flotilla_gateway::shards::{DirectoryEntry, Fence, ShardDirectory};
    use flotilla_proto::contract::shard_of;

    use super::*;

    const SHARDS: u32 = 64;

    fn owned_by(owner: &str, address: &str, epoch: u32) -> DirectoryEntry {
        DirectoryEntry {
            owner: owner.into(),
            address: Some(address.into()),
            epoch,
        }
    }

    #[test]
    fn a_page_is_one_question_per_owner_and_none_for_unowned_shards() {
        // Six clusters of six shards: two on gw-1, one on gw-2, one whose owner advertises no
        // address, one nobody holds, one this side holds.
        let names = [
            "store-a", "store-b", "store-c", "store-d", "store-e", "store-f",
        ];
        let shards: Vec<u32> = names.iter().map(|c| shard_of(c, SHARDS)).collect();
        let distinct: std::collections::BTreeSet<_> = shards.iter().collect();
        assert_eq!(
            distinct.len(),
            names.len(),
            "the test's clusters share no shard"
        );
        let mut entries = BTreeMap::from([
            (shards[0], owned_by("gw-1", "10.0.0.1:9443", 3)),
            (shards[1], owned_by("gw-1", "10.0.0.1:9443", 3)),
            (shards[2], owned_by("gw-2", "10.0.0.2:9443", 1)),
        ]);
        entries.insert(
            shards[3],
            DirectoryEntry {
                owner: "gw-3".into(),
                address: None,
                epoch: 1,
            },
        );
        let now = Instant::now();
        let held = BTreeMap::from([(
            shards[5],
            Fence {
                epoch: 2,
                valid_until: now + Duration::from_secs(60),
            },
        )]);
        let view = ShardView::leased(SHARDS, held, ShardDirectory::new(SHARDS, entries));

        let grouped = askees(&view, &names, now);
        assert_eq!(
            grouped,
            Askees {
                here: vec!["store-f"],
                owners: BTreeMap::from([
                    (
                        "10.0.0.1:9443".to_string(),
                        ("gw-1".to_string(), vec!["store-a", "store-b"])
                    ),
                    (
                        "10.0.0.2:9443".to_string(),
                        ("gw-2".to_string(), vec!["store-c"])
                    ),
                ]),
            }
        );
    }
}
