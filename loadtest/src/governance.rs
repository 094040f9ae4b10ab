//! The `governance` scenario: OCM's Policy framework over every agent.
//!
//! The global cluster set is bound to the scenarios' namespace and one Placement selects every
//! enrolled cluster; then `--policies` Policies are created, each with one PlacementBinding to
//! that Placement. Each carries one ConfigurationPolicy the simulated spokes evaluate for real
//! (the agents' governor against their in-memory API): the even-numbered ones `musthave` a
//! namespace under `inform` (the spokes lack it: NonCompliant, nothing written), the odd ones
//! `musthave` a ConfigMap under `enforce` (the agents create it: Compliant).
//!
//! Measured: per (policy, cluster) pair, the time from the policy's create to the pair's
//! verdict in the root Policy's `status.status[]` on the hub (what `kubectl get policy -o yaml`
//! shows; the hub aggregates it from the cluster's ClusterCompliance record); the time until
//! every root Policy's `status.compliant` is the expected aggregate; the hub's store writes
//! over that window. Then the churn: every inform policy flipped to enforce, the agents
//! creating the namespace, and the same measured again from the flips, with the writes per
//! cluster.
//!
//! The roots are read one by one through the operator API every `--poll-interval` (both
//! backends; a list of them all is 70 MB at 10,000 clusters, which a loaded hub does not serve
//! within the client's timeout): a pair is stamped when its root has come back, never earlier
//! than the hub showed it. The records are not listed: at 1,000 clusters × 100 policies a list
//! of them is 100 MB of JSON for the hub to serialise, which slowed what it measured. Store
//! writes come from the store's revision counter (a list's `resourceVersion`: the sled store's
//! own revision, or etcd's with `--store kube`), less the scenario's own writes.

use std::collections::HashMap;

use anyhow::Context;
use flotilla_proto::api::Kind;
use futures::StreamExt;
use serde_json::{Value, json};

use crate::clock::{self, Stamp};
use crate::operator::{OperatorApi, POOL_SIZE};
use crate::placement::{NAMESPACE, bind_global, decided};
use crate::report::{ChurnReport, GovernanceReport, Percentiles, ScenarioReport};
use crate::scenario::{Clock, Run, bounded};
use crate::swarm::AgentRecord;

/// The scenario's Placement, selecting every cluster of the global set.
pub const PLACEMENT: &str = "flotilla-loadtest-governance";
/// Unexpected verdicts quoted in the report.
const EXAMPLES: usize = 5;

/// Policy `i` of the scenario: its name, also the name of its binding, its template and the
/// object that template is about.
pub fn policy_name(i: usize) -> String {
    format!("flotilla-loadtest-gov-{i:04}")
}

/// Whether policy `i` enforces from its create (odd) or only informs (even).
pub fn enforces(i: usize) -> bool {
    i % 2 == 1
}

/// Policy `i` with `remediationAction` `remediation`: an inform policy's template asks for a
/// namespace named as the policy, an enforce policy's for a ConfigMap in `default`.
pub fn policy_json(i: usize, remediation: &str) -> Value {
    let name = policy_name(i);
    let object = if enforces(i) {
        json!({"apiVersion": "v1", "kind": "ConfigMap",
               "metadata": {"name": name, "namespace": "default"},
               "data": {"policy": name}})
    } else {
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    };
    json!({
        "apiVersion": Kind::Policy.api_version(), "kind": "Policy",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "remediationAction": remediation,
            "disabled": false,
            "policy-templates": [{"objectDefinition": {
                "apiVersion": "policy.open-cluster-management.io/v1",
                "kind": "ConfigurationPolicy",
                "metadata": {"name": name},
                "spec": {
                    "remediationAction": remediation,
                    "severity": "low",
                    "object-templates": [{"complianceType": "musthave", "objectDefinition": object}],
                },
            }}],
        },
    })
}

/// The binding of policy `i` to the scenario's Placement.
pub fn binding_json(i: usize) -> Value {
    let name = policy_name(i);
    json!({
        "apiVersion": Kind::PlacementBinding.api_version(), "kind": "PlacementBinding",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "placementRef": {"name": PLACEMENT, "kind": "Placement",
                         "apiGroup": "cluster.open-cluster-management.io"},
        "subjects": [{"name": name, "kind": "Policy",
                      "apiGroup": "policy.open-cluster-management.io"}],
    })
}

/// One phase's target: per policy of the phase, when its write was sent (seconds on the
/// scenario's clock), its uid, the generation a report must be at least at, and the verdict
/// expected of every cluster.
struct Target {
    index: usize,
    sent_s: f64,
    /// The same instant on the machine's clock, against the agents' stamps of its store.
    sent: Stamp,
    uid: String,
    generation: i64,
    expected: &'static str,
}

/// What one phase saw, pair by pair (policy slot × cluster, flattened).
struct Phase {
    /// When the pair's expected verdict was first listed.
    reported_s: Vec<Option<f64>>,
    /// The pair's latest verdict listed (Compliant or NonCompliant), at any generation.
    latest: Vec<Option<bool>>,
    reported: u64,
    time_to_all_reported_s: Option<f64>,
    roots_aggregated: u64,
    time_to_all_aggregated_s: Option<f64>,
    store_writes: Option<u64>,
    window_s: f64,
    done: bool,
}

/// The store's revision, from a list's `metadata.resourceVersion`.
fn revision(list: &Value) -> Option<u64> {
    list["metadata"]["resourceVersion"].as_str()?.parse().ok()
}

/// The store's revision now, from a list of the bindings of the scenario's namespace (a few
/// objects).
async fn revision_now(api: &OperatorApi) -> anyhow::Result<Option<u64>> {
    let list = api
        .request(
            http::Method::GET,
            &flotilla_cli::cli::collection_path(Kind::ManagedClusterSetBinding, Some(NAMESPACE)),
            None,
        )
        .await?;
    Ok(revision(&list))
}

impl Run {
    /// `governance`: see the module docs.
    pub async fn governance(&mut self) -> ScenarioReport {
        let mut r = ScenarioReport::new("governance", self.identities.len());
        let clock = Clock::new(self.args.timeout);
        let result = bounded(&clock, self.governance_inner(&clock, &mut r)).await;
        self.conclude(&mut r, &clock, result).await;
        r
    }

    async fn governance_inner(
        &mut self,
        clock: &Clock,
        r: &mut ScenarioReport,
    ) -> anyhow::Result<bool> {
        self.ensure_connected(clock).await?;
        let n = self.n() as usize;
        let count = self.args.policies;
        let api = self.api.clone();
        let g = r.governance.insert(GovernanceReport {
            clusters: n as u64,
            policies: count as u64,
            enforce_policies: (0..count).filter(|i| enforces(*i)).count() as u64,
            inform_policies: (0..count).filter(|i| !enforces(*i)).count() as u64,
            pairs: (count * n) as u64,
            poll_interval_ms: self.args.poll_interval.as_secs_f64() * 1000.0,
            ..Default::default()
        });

        let t0 = clock.t();
        bind_global(&api).await?;
        api.apply(&json!({
            "apiVersion": Kind::Placement.api_version(), "kind": "Placement",
            "metadata": {"name": PLACEMENT, "namespace": NAMESPACE},
            "spec": {},
        }))
        .await?;
        while decided(&api, NAMESPACE, PLACEMENT).await?.len() < n {
            anyhow::ensure!(
                !clock.expired(),
                "placement {NAMESPACE}/{PLACEMENT} did not select every cluster in time"
            );
            tokio::time::sleep(self.args.poll_interval).await;
        }
        g.setup_s = Some(clock.t() - t0);

        // Every policy, then its binding; pairs are timed from their own policy's create.
        let before = revision_now(&api).await?;
        let t0 = clock.t();
        let created: Vec<anyhow::Result<Target>> = futures::stream::iter(0..count)
            .map(|i| {
                let api = api.clone();
                async move {
                    let (sent_s, sent) = (clock.t(), clock::now());
                    let remediation = if enforces(i) { "enforce" } else { "inform" };
                    let stored = api.apply(&policy_json(i, remediation)).await?;
                    api.apply(&binding_json(i)).await?;
                    Ok(Target {
                        index: i,
                        sent_s,
                        sent,
                        uid: stored["metadata"]["uid"]
                            .as_str()
                            .unwrap_or_default()
                            .into(),
                        generation: 0,
                        expected: if enforces(i) {
                            "Compliant"
                        } else {
                            "NonCompliant"
                        },
                    })
                }
            })
            .buffer_unordered(POOL_SIZE)
            .collect()
            .await;
        let targets = created.into_iter().collect::<anyhow::Result<Vec<_>>>()?;
        g.create_s = Some(clock.t() - t0);

        let (phase, cycle) = self
            .follow(clock, "policies", &targets, before, 2 * count as u64)
            .await?;
        let g = r.governance.as_mut().expect("inserted above");
        g.poll_cycle_ms = cycle.map(|c| c * 1000.0);
        g.reported = phase.reported;
        g.compliance_latency = Some(latency(&targets, &phase, n));
        g.time_to_all_reported_s = phase.time_to_all_reported_s;
        g.roots_aggregated = phase.roots_aggregated;
        g.time_to_all_aggregated_s = phase.time_to_all_aggregated_s;
        g.store_writes = phase.store_writes;
        g.store_writes_per_s = phase
            .store_writes
            .map(|w| w as f64 / phase.window_s.max(1e-3));
        let records = self.records().await?;
        let g = r.governance.as_mut().expect("inserted above");
        let stored = delivery(&targets, &records);
        g.delivered = stored.len() as u64;
        g.delivery_latency = Some(Percentiles::from_micros(&stored));
        let mut examples = Vec::new();
        g.unexpected = 0;
        for (slot, t) in targets.iter().enumerate() {
            for (c, id) in self.identities.iter().enumerate() {
                let verdict = phase.latest[slot * n + c];
                if verdict.is_some_and(|compliant| compliant != (t.expected == "Compliant")) {
                    g.unexpected += 1;
                    if examples.len() < EXAMPLES {
                        examples.push(format!(
                            "{} on {}: {}, expected {}",
                            policy_name(t.index),
                            id.name,
                            if t.expected == "Compliant" {
                                "NonCompliant"
                            } else {
                                "Compliant"
                            },
                            t.expected
                        ));
                    }
                }
            }
        }
        g.unexpected_examples = examples;
        if !phase.done {
            return Ok(false);
        }

        // The churn: every inform policy enforced; its agents create the namespace.
        let before = revision_now(&api).await?;
        let informing: Vec<usize> = (0..count).filter(|i| !enforces(*i)).collect();
        let flipped: Vec<anyhow::Result<Target>> = futures::stream::iter(informing)
            .map(|i| {
                let api = api.clone();
                async move {
                    let (sent_s, sent) = (clock.t(), clock::now());
                    let stored = api
                        .apply(&policy_json(i, "enforce"))
                        .await
                        .with_context(|| format!("enforcing policy {}", policy_name(i)))?;
                    Ok(Target {
                        index: i,
                        sent_s,
                        sent,
                        uid: stored["metadata"]["uid"]
                            .as_str()
                            .unwrap_or_default()
                            .into(),
                        generation: stored["metadata"]["generation"].as_i64().unwrap_or(0),
                        expected: "Compliant",
                    })
                }
            })
            .buffer_unordered(POOL_SIZE)
            .collect()
            .await;
        let flips = flipped.into_iter().collect::<anyhow::Result<Vec<_>>>()?;
        let (phase, _) = self
            .follow(clock, "churn", &flips, before, flips.len() as u64)
            .await?;
        let g = r.governance.as_mut().expect("inserted above");
        g.churn = Some(ChurnReport {
            flipped: flips.len() as u64,
            pairs: (flips.len() * n) as u64,
            reported: phase.reported,
            latency: Some(latency(&flips, &phase, n)),
            time_to_all_reported_s: phase.time_to_all_reported_s,
            roots_aggregated: phase.roots_aggregated,
            time_to_all_aggregated_s: phase.time_to_all_aggregated_s,
            store_writes: phase.store_writes,
            store_writes_per_s: phase
                .store_writes
                .map(|w| w as f64 / phase.window_s.max(1e-3)),
            store_writes_per_cluster: phase.store_writes.map(|w| w as f64 / n.max(1) as f64),
        });
        Ok(phase.done)
    }

    /// Reads the root Policies every `--poll-interval` until every (target, cluster) pair
    /// shows its expected verdict in the target's root (at the target's generation) and every
    /// target's root aggregates to it, or the clock runs out. `before` is the store's revision
    /// before the phase's first write and `own` the writes the harness made in it. Returns what
    /// was seen and the mean time between two rounds of reads coming back.
    async fn follow(
        &self,
        clock: &Clock,
        what: &str,
        targets: &[Target],
        before: Option<u64>,
        own: u64,
    ) -> anyhow::Result<(Phase, Option<f64>)> {
        let n = self.identities.len();
        let clusters: HashMap<&str, usize> = self
            .identities
            .iter()
            .enumerate()
            .map(|(c, id)| (id.name.as_str(), c))
            .collect();
        let slots: HashMap<String, usize> = targets
            .iter()
            .enumerate()
            .map(|(slot, t)| (policy_name(t.index), slot))
            .collect();
        let first_sent = targets
            .iter()
            .map(|t| t.sent_s)
            .fold(f64::INFINITY, f64::min);
        let pairs = targets.len() * n;
        let mut p = Phase {
            reported_s: vec![None; pairs],
            latest: vec![None; pairs],
            reported: 0,
            time_to_all_reported_s: None,
            roots_aggregated: 0,
            time_to_all_aggregated_s: None,
            store_writes: None,
            window_s: 0.0,
            done: false,
        };
        let bar = self.bar(what, pairs as u64);
        // The agents' side of the same pairs, logged each round: where the pairs wait.
        let base = self.sample();
        // (lists that came back, when the first and the latest did)
        let mut lists = (0u32, None::<f64>, 0.0);
        loop {
            // Each root Policy read on its own: its `status.status[]` is what users read
            // (`kubectl get policy -o yaml`), one entry per cluster with its compliance from
            // the cluster's record. One list of them all is 70 MB at 10,000 clusters, which a
            // loaded hub does not serve within the client's timeout; a root is a hundredth.
            let roots: Vec<(f64, anyhow::Result<Value>)> = futures::stream::iter(targets)
                .map(|t| async move {
                    let path = flotilla_cli::cli::object_path(
                        Kind::Policy,
                        Some(NAMESPACE),
                        &policy_name(t.index),
                    );
                    let root = self.api.request(http::Method::GET, &path, None).await;
                    // Stamped once the root has come back: never earlier than the hub showed it.
                    (clock.t(), root)
                })
                .buffer_unordered(POOL_SIZE)
                .collect()
                .await;
            let now = clock.t();
            lists = (lists.0 + 1, lists.1.or(Some(now)), now);
            p.roots_aggregated = 0;
            for (now, root) in roots {
                let root = root?;
                let Some(&slot) = root["metadata"]["name"]
                    .as_str()
                    .and_then(|name| slots.get(name))
                else {
                    continue;
                };
                let t = &targets[slot];
                // Another policy of the same name (an earlier run's) counts for nothing; a
                // root not yet at the phase's generation shows an earlier phase's verdicts.
                if root["metadata"]["uid"] != t.uid.as_str()
                    || root["metadata"]["generation"].as_i64().unwrap_or(0) < t.generation
                {
                    continue;
                }
                if root["status"]["compliant"] == t.expected {
                    p.roots_aggregated += 1;
                }
                for entry in root["status"]["status"].as_array().into_iter().flatten() {
                    let Some(&c) = entry["clustername"]
                        .as_str()
                        .and_then(|name| clusters.get(name))
                    else {
                        continue;
                    };
                    let verdict = match entry["compliant"].as_str() {
                        Some("Compliant") => true,
                        Some("NonCompliant") => false,
                        _ => continue,
                    };
                    let pair = slot * n + c;
                    p.latest[pair] = Some(verdict);
                    // A flipped policy's expected verdict is the opposite of its earlier one,
                    // so a verdict left from before the flip is never taken for the new one.
                    if verdict == (t.expected == "Compliant") && p.reported_s[pair].is_none() {
                        p.reported_s[pair] = Some(now);
                        p.reported += 1;
                    }
                }
            }
            if p.reported as usize == pairs && p.time_to_all_reported_s.is_none() {
                p.time_to_all_reported_s = Some(now - first_sent);
            }
            bar.set_position(p.reported);
            bar.set_message(format!(
                "pairs on the hub, {} / {} roots aggregated",
                p.roots_aggregated,
                targets.len()
            ));
            let agents = self.sample();
            // The hub's store writes so far in the phase (the harness's own included), so a
            // run stopped by hand still tells the rate from its log.
            let store_writes = match (before, revision_now(&self.api).await) {
                (Some(b), Ok(Some(now))) => Some(now.saturating_sub(b)),
                _ => None,
            };
            tracing::info!(
                phase = what,
                t_s = format!("{:.1}", now - first_sent),
                on_hub = p.reported,
                roots_aggregated = p.roots_aggregated,
                stored_by_agents = agents.works_acked - base.works_acked,
                statuses_sent = agents.statuses_sent - base.statuses_sent,
                statuses_acked = agents.statuses_acked - base.statuses_acked,
                store_writes,
                "governance progress"
            );
            if p.reported as usize == pairs && p.roots_aggregated as usize == targets.len() {
                p.time_to_all_aggregated_s = Some(now - first_sent);
                p.done = true;
            }
            if p.done || clock.expired() {
                p.window_s = now - first_sent;
                p.store_writes = before
                    .zip(revision_now(&self.api).await?)
                    .map(|(b, a)| a.saturating_sub(b).saturating_sub(own));
                break;
            }
            tokio::time::sleep(self.args.poll_interval).await;
        }
        bar.finish_and_clear();
        let cycle = match lists {
            (count, Some(first), last) if count > 1 => Some((last - first) / f64::from(count - 1)),
            _ => None,
        };
        Ok((p, cycle))
    }
}

/// Each pair an agent stored, from its policy's write to the agent's ack of it: the hub's
/// delivery (resolution, the gateway's reflector, the session) and the agent's durable store.
fn delivery(targets: &[Target], records: &[AgentRecord]) -> Vec<u64> {
    targets
        .iter()
        .flat_map(|t| {
            let name = policy_name(t.index);
            records.iter().filter_map(move |rec| {
                rec.acks
                    .get(&name)
                    .map(|at| clock::between(t.sent, *at).as_micros() as u64)
            })
        })
        .collect()
}

/// Each reported pair's time from its policy's write to its verdict on the hub.
fn latency(targets: &[Target], phase: &Phase, n: usize) -> Percentiles {
    let micros: Vec<u64> = targets
        .iter()
        .enumerate()
        .flat_map(|(slot, t)| {
            phase.reported_s[slot * n..(slot + 1) * n]
                .iter()
                .flatten()
                .map(move |at| ((at - t.sent_s).max(0.0) * 1e6) as u64)
        })
        .collect();
    Percentiles::from_micros(&micros)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_policy_and_binding_passes_the_hubs_validation() {
        use flotilla_proto::api::policy::{
            PlacementBinding, Policy, validate_placement_binding, validate_policy,
        };
        for i in 0..4 {
            for remediation in ["inform", "enforce"] {
                let raw = policy_json(i, remediation);
                let policy: Policy = serde_json::from_value(raw.clone()).unwrap();
                validate_policy(&policy, Some(&raw)).unwrap();
                assert_eq!(policy.spec.remediation_action.as_deref(), Some(remediation));
            }
            let raw = binding_json(i);
            let binding: PlacementBinding = serde_json::from_value(raw.clone()).unwrap();
            validate_placement_binding(&binding, Some(&raw)).unwrap();
            assert_eq!(binding.subjects[0].name, policy_name(i));
        }
        assert!(!enforces(0) && enforces(1), "even inform, odd enforce");
    }
}
