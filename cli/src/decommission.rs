//! `flotilla cluster decommission`: taking a cluster out of the fleet as one resumable sequence
//! of idempotent steps, so that its workloads are kept or removed as the operator chose and
//! never deleted by surprise when an offline agent comes back.
//!
//! The danger it is built around: an agent removes a deleted work's resources by the
//! deleteOption of the copy *it* holds. An agent that was offline while an operator switched a
//! work to `Orphan` and deleted it still holds the old `Foreground` copy, and on reconnect it
//! hears "deleted" and deletes everything. So the decommission first writes the chosen policy
//! into every work of the cluster and waits (bounded) for the agent to report that generation:
//! from then on the agent's own copy says what to do. With `orphan`, the agent's session is
//! then revoked *before* any work is deleted, so an agent that never confirmed can never hear
//! of a deletion; with `clean`, the agent must confirm (it is the one that deletes), and the
//! revocation comes last.
//!
//! Each deleted work stays on the hub until its agent reports it released (the gateway then
//! removes its cleanup finalizer), so `delete-works` of `clean` ends when the spoke is clean.
//! With `orphan` the agent is revoked first and never releases anything: `delete-works` removes
//! the finalizers itself.
//!
//! Sequences (the step names are what the progress annotation records):
//! * orphan: `policy` → `confirm` (a timeout goes on) → `revoke` → `unplace` → `delete-works`
//!   → `delete-cluster`
//! * clean: `policy` → `confirm` (a timeout stops, nothing removed yet) → `unplace` →
//!   `delete-works` → `revoke` (only while the agent has a session) → `delete-cluster`
//!
//! Progress lives on the hub, in the ManagedCluster's [`DECOMMISSION_ANNOTATION`]
//! (`policy=orphan,step=revoke`: the next step to run), written after each step. Rerunning the
//! command, from any machine, continues there; each step is idempotent, so a step interrupted
//! before its record is simply run again. A different `--policy` on resume is refused.
//!
//! The decisions ([`Progress`], [`apply_policy`], [`holds_generation`], ...) do no IO and are
//! tested here; [`run`] drives them against the operator API.

use std::fmt;
use std::time::Duration;

use flotilla_proto::api::Kind;
use flotilla_proto::api::conditions::MANAGED_CLUSTER_CONDITION_AVAILABLE;
use flotilla_proto::contract::{DECOMMISSION_ANNOTATION, WORK_CLEANUP_FINALIZER};
use http::{Method, StatusCode};
use serde_json::{Value, json};
use tokio::time::Instant;

use crate::cli::{collection_path, modify_cluster, modify_object, object_path};
use crate::client::{ApiError, OperatorClient};

/// The taint that takes the cluster out of every placement that does not tolerate it.
pub const DECOMMISSION_TAINT: &str = "flotilla.io/decommissioning";
/// Default of `--timeout`: how long one waiting step waits for the agent or the scheduler.
/// Five minutes outlasts an agent's reconnect backoff and a session's health grace period, so
/// an agent that is merely reconnecting is waited for.
pub const DEFAULT_TIMEOUT: &str = "5m";
/// How often a waiting step reads the hub again.
const POLL_INTERVAL: Duration = Duration::from_millis(500);

/// What happens to the cluster's workloads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Policy {
    /// Leave every resource the works applied on the spoke (deleteOption `Orphan`).
    Orphan,
    /// Have the agent delete every resource the works applied (deleteOption `Foreground`).
    Clean,
}

impl Policy {
    fn as_str(self) -> &'static str {
        match self {
            Policy::Orphan => "orphan",
            Policy::Clean => "clean",
        }
    }

    fn parse(s: &str) -> Option<Policy> {
        match s {
            "orphan" => Some(Policy::Orphan),
            "clean" => Some(Policy::Clean),
            _ => None,
        }
    }

    /// The ManifestWork `spec.deleteOption.propagationPolicy` this policy writes.
    pub fn propagation_policy(self) -> &'static str {
        match self {
            Policy::Orphan => "Orphan",
            Policy::Clean => "Foreground",
        }
    }

    /// The steps, in order.
    pub fn steps(self) -> &'static [Step] {
        match self {
            // Revoked before any deletion: an agent that missed the new policy never hears one.
            Self::Orphan => &[
                Step::Policy,
                Step::Confirm,
                Step::Revoke,
                Step::Unplace,
                Step::DeleteWorks,
                Step::DeleteCluster,
            ],
            // The agent deletes, so it keeps its session until the works are deleted.
            Self::Clean => &[
                Step::Policy,
                Step::Confirm,
                Step::Unplace,
                Step::DeleteWorks,
                Step::Revoke,
                Step::DeleteCluster,
            ],
        }
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One step of the sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Write the policy into every work's deleteOption.
    Policy,
    /// Wait for the agent to report the generation carrying it.
    Confirm,
    /// Deny the cluster: its sessions close, its certificate stops working.
    Revoke,
    /// Taint it out of placements and wait until no PlacementDecision lists it.
    Unplace,
    /// Delete every ManifestWork in its namespace.
    DeleteWorks,
    /// Delete the ManagedCluster.
    DeleteCluster,
}

impl Step {
    const ALL: [Step; 6] = [
        Step::Policy,
        Step::Confirm,
        Step::Revoke,
        Step::Unplace,
        Step::DeleteWorks,
        Step::DeleteCluster,
    ];

    fn as_str(self) -> &'static str {
        match self {
            Step::Policy => "policy",
            Step::Confirm => "confirm",
            Step::Revoke => "revoke",
            Step::Unplace => "unplace",
            Step::DeleteWorks => "delete-works",
            Step::DeleteCluster => "delete-cluster",
        }
    }
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where a decommission stands: its policy and the next step to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Progress {
    pub policy: Policy,
    pub next: Step,
}

impl Progress {
    /// The annotation's value.
    pub fn annotation(&self) -> String {
        format!("policy={},step={}", self.policy, self.next)
    }

    /// Parses the annotation's value.
    pub fn parse(value: &str) -> Option<Progress> {
        let mut policy = None;
        let mut next = None;
        for part in value.split(',') {
            match part.trim().split_once('=')? {
                ("policy", p) => policy = Some(Policy::parse(p)?),
                ("step", s) => next = Some(*Step::ALL.iter().find(|x| x.as_str() == s)?),
                _ => return None,
            }
        }
        let progress = Progress {
            policy: policy?,
            next: next?,
        };
        progress
            .policy
            .steps()
            .contains(&progress.next)
            .then_some(progress)
    }

    /// The progress after `self.next` is done; `None` when it was the last step.
    pub fn after(&self) -> Option<Progress> {
        let steps = self.policy.steps();
        let i = steps.iter().position(|s| *s == self.next)?;
        steps.get(i + 1).map(|&next| Progress {
            policy: self.policy,
            next,
        })
    }

    /// `3/6`: the step's place in its sequence.
    pub fn ordinal(&self) -> String {
        let steps = self.policy.steps();
        let i = steps.iter().position(|s| *s == self.next).unwrap_or(0);
        format!("{}/{}", i + 1, steps.len())
    }
}

/// Why a decommission stopped. Every message names the cluster and says how to go on.
#[derive(Debug, thiserror::Error)]
pub enum DecommissionError {
    /// No ManagedCluster of that name. Not retryable.
    #[error(
        "cluster {0} not found: there is nothing to decommission (already decommissioned, or a typo: `flotilla get clusters`)"
    )]
    NotFound(String),
    /// A first run without `--policy`. Not retryable: choose one.
    #[error(
        "cluster {0}: --policy is required to start a decommission: `orphan` leaves every workload \
         on the spoke, `clean` has the agent delete them"
    )]
    PolicyRequired(String),
    /// The run asked for another policy than the one in progress. Not retryable: a
    /// decommission never changes its policy half-way.
    #[error(
        "cluster {cluster} is being decommissioned with --policy {recorded} (next step {next}); \
         a decommission never changes its policy half-way: run `flotilla cluster decommission \
         {cluster} --policy {recorded}` to finish it"
    )]
    PolicyMismatch {
        cluster: String,
        recorded: Policy,
        asked: Policy,
        next: Step,
    },
    /// The progress annotation does not parse. Not retryable until someone fixes it.
    #[error(
        "cluster {cluster}: annotation {DECOMMISSION_ANNOTATION}={value:?} is not a decommission's \
         progress (policy=orphan|clean,step=...); remove it from the ManagedCluster and run again"
    )]
    BadProgress { cluster: String, value: String },
    /// With `clean`, the agent did not report the new policy in time. Retryable: run again
    /// once the agent is back. Nothing has been removed.
    #[error(
        "cluster {cluster}: the agent did not report the Foreground delete policy of {} within \
         {timeout:?} (it is offline or failing: `flotilla get clusters`, `flotilla get works --cluster {cluster}`). \
         Nothing was removed and the cluster keeps serving. Run `flotilla cluster decommission \
         {cluster} --policy clean` again to keep waiting once the agent is back; if the spoke is \
         gone for good, `flotilla cluster delete {cluster}` revokes and deletes it now, leaving \
         whatever it runs in place", works.join(", ")
    )]
    NotConfirmed {
        cluster: String,
        works: Vec<String>,
        timeout: Duration,
    },
    /// With `clean`, the agent's session went away after its works were deleted. Retryable:
    /// the works are deleted on the hub, and the agent hears it when it reconnects.
    #[error(
        "cluster {cluster}: its agent has had no session since its works were deleted (not \
         Available for {timeout:?}); they are deleted on the hub and the agent removes their \
         resources when it reconnects. Run `flotilla cluster decommission {cluster} --policy \
         clean` again to revoke it once it is back"
    )]
    AgentAway { cluster: String, timeout: Duration },
    /// Placements still select the cluster after the taint (they tolerate it). Retryable once
    /// they no longer do.
    #[error(
        "cluster {cluster}: placements {} still select it {timeout:?} after the taint \
         {DECOMMISSION_TAINT}:NoSelect (do they tolerate it?); change them and run the \
         decommission again", placements.join(", ")
    )]
    StillPlaced {
        cluster: String,
        placements: Vec<String>,
        timeout: Duration,
    },
    /// Works came back after being deleted (a controller recreates them). Retryable.
    #[error(
        "cluster {cluster}: ManifestWorks {} are still in its namespace {timeout:?} after being \
         deleted (a ManifestWorkReplicaSet recreating them?); remove their source and run the \
         decommission again", works.join(", ")
    )]
    WorksRemain {
        cluster: String,
        works: Vec<String>,
        timeout: Duration,
    },
    /// The operator API refused or could not be reached. Retryable: the steps are idempotent.
    #[error("cluster {cluster}: step {step}: {cause:#}; run the decommission again to continue")]
    Api {
        cluster: String,
        step: Step,
        /// Shown in the message (not as a `source`, which would print it twice).
        cause: anyhow::Error,
    },
}

/// Where the run starts: a fresh decommission with `asked`, or the recorded one (which `asked`,
/// when given, must match).
pub fn resume(
    cluster: &str,
    recorded: Option<&str>,
    asked: Option<Policy>,
) -> Result<Progress, DecommissionError> {
    let Some(value) = recorded else {
        let policy = asked.ok_or_else(|| DecommissionError::PolicyRequired(cluster.into()))?;
        return Ok(Progress {
            policy,
            next: policy.steps()[0],
        });
    };
    let progress = Progress::parse(value).ok_or_else(|| DecommissionError::BadProgress {
        cluster: cluster.into(),
        value: value.into(),
    })?;
    match asked {
        Some(asked) if asked != progress.policy => Err(DecommissionError::PolicyMismatch {
            cluster: cluster.into(),
            recorded: progress.policy,
            asked,
            next: progress.next,
        }),
        _ => Ok(progress),
    }
}

/// Writes `policy` into a ManifestWork: `spec.deleteOption.propagationPolicy` (without
/// `selectivelyOrphans`, which only `SelectivelyOrphan` reads; `ttlSecondsAfterFinished` kept)
/// and the work's [`DECOMMISSION_ANNOTATION`]. Says whether anything changed.
pub fn apply_policy(work: &mut Value, policy: Policy) -> bool {
    let before = work.clone();
    let option = &mut work["spec"]["deleteOption"];
    if !option.is_object() {
        *option = json!({});
    }
    option["propagationPolicy"] = policy.propagation_policy().into();
    if let Some(o) = option.as_object_mut() {
        o.remove("selectivelyOrphans");
    }
    if !work["metadata"]["annotations"].is_object() {
        work["metadata"]["annotations"] = json!({});
    }
    work["metadata"]["annotations"][DECOMMISSION_ANNOTATION] = policy.as_str().into();
    *work != before
}

/// Removes the cleanup finalizer ([`WORK_CLEANUP_FINALIZER`]) from a work; `false` when it
/// has none. For works whose agent will never release them (an orphaning decommission).
pub fn drop_cleanup_finalizer(work: &mut Value) -> bool {
    let Some(finalizers) = work["metadata"]["finalizers"].as_array_mut() else {
        return false;
    };
    let before = finalizers.len();
    finalizers.retain(|f| f != WORK_CLEANUP_FINALIZER);
    finalizers.len() != before
}

/// Whether the agent has reported a status for the work's current generation: it stores a
/// generation durably before it reports on it, so from then on its own copy carries the
/// generation's deleteOption, whatever happens to its connection.
pub fn holds_generation(work: &Value) -> bool {
    let generation = work["metadata"]["generation"].as_i64().unwrap_or(1);
    work["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|c| c["observedGeneration"].as_i64() >= Some(generation))
}

/// Whether the cluster's agent holds a session now (ManagedCluster `Available=True`).
pub fn session_live(mc: &Value) -> bool {
    mc["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|c| c["type"] == MANAGED_CLUSTER_CONDITION_AVAILABLE && c["status"] == "True")
}

/// The placements (`namespace/name`) whose decisions list `cluster`.
pub fn placements_selecting(decisions: &[Value], cluster: &str) -> Vec<String> {
    let mut placements: Vec<String> = decisions
        .iter()
        .filter(|d| {
            d["status"]["decisions"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|c| c["clusterName"] == cluster)
        })
        .map(|d| {
            let placement = d["metadata"]["labels"][flotilla_proto::api::PLACEMENT_LABEL]
                .as_str()
                .or(d["metadata"]["name"].as_str())
                .unwrap_or_default();
            format!(
                "{}/{placement}",
                d["metadata"]["namespace"].as_str().unwrap_or_default()
            )
        })
        .collect();
    placements.sort();
    placements.dedup();
    placements
}

fn names(items: &[Value]) -> Vec<String> {
    items
        .iter()
        .filter_map(|w| w["metadata"]["name"].as_str().map(str::to_string))
        .collect()
}

fn is_not_found(e: &anyhow::Error) -> bool {
    e.downcast_ref::<ApiError>()
        .is_some_and(|a| a.status == StatusCode::NOT_FOUND)
}

/// Runs the decommission of `cluster` from where it stands, telling `say` one line per step.
pub async fn run(
    client: &OperatorClient,
    cluster: &str,
    asked: Option<Policy>,
    timeout: Duration,
    say: &mut dyn FnMut(String),
) -> Result<(), DecommissionError> {
    let api = |step: Step| {
        move |cause: anyhow::Error| DecommissionError::Api {
            cluster: cluster.to_string(),
            step,
            cause,
        }
    };
    let path = object_path(Kind::ManagedCluster, None, cluster);
    let mc = match client.get_json(&path).await {
        Ok(mc) => mc,
        Err(e) if is_not_found(&e) => return Err(DecommissionError::NotFound(cluster.into())),
        Err(e) => return Err(api(Step::Policy)(e)),
    };
    let recorded = mc["metadata"]["annotations"][DECOMMISSION_ANNOTATION].as_str();
    let mut progress = resume(cluster, recorded, asked)?;
    if recorded.is_some() {
        say(format!(
            "resuming the decommission of cluster {cluster} (policy {}) at step {} {}",
            progress.policy,
            progress.ordinal(),
            progress.next
        ));
    } else {
        say(format!(
            "decommissioning cluster {cluster} with policy {} (each wait at most {})",
            progress.policy,
            humantime::format_duration(timeout)
        ));
        record(client, cluster, progress)
            .await
            .map_err(api(progress.next))?;
    }
    loop {
        let step = progress.next;
        let line = run_step(client, cluster, progress.policy, step, timeout).await?;
        say(format!("step {} {step}: {line}", progress.ordinal()));
        match progress.after() {
            Some(next) => {
                progress = next;
                record(client, cluster, progress).await.map_err(api(step))?;
            }
            None => break,
        }
    }
    say(format!("cluster {cluster} decommissioned"));
    Ok(())
}

/// Records `progress` on the ManagedCluster.
async fn record(client: &OperatorClient, cluster: &str, progress: Progress) -> anyhow::Result<()> {
    let value = progress.annotation();
    modify_cluster(client, cluster, |mc| {
        if mc["metadata"]["annotations"][DECOMMISSION_ANNOTATION] == value.as_str() {
            return Ok(false);
        }
        if !mc["metadata"]["annotations"].is_object() {
            mc["metadata"]["annotations"] = json!({});
        }
        mc["metadata"]["annotations"][DECOMMISSION_ANNOTATION] = value.clone().into();
        Ok(true)
    })
    .await
    .map(drop)
}

/// Runs one step; returns the line that says what it did.
async fn run_step(
    client: &OperatorClient,
    cluster: &str,
    policy: Policy,
    step: Step,
    timeout: Duration,
) -> Result<String, DecommissionError> {
    let api = |cause: anyhow::Error| DecommissionError::Api {
        cluster: cluster.to_string(),
        step,
        cause,
    };
    let works_path = collection_path(Kind::ManifestWork, Some(cluster));
    let list_works = || async {
        let list = client.get_json(&works_path).await?;
        anyhow::Ok(list["items"].as_array().cloned().unwrap_or_default())
    };
    match step {
        Step::Policy => {
            let works = list_works().await.map_err(api)?;
            let mut changed = Vec::new();
            for name in names(&works) {
                let path = object_path(Kind::ManifestWork, Some(cluster), &name);
                let what = format!("ManifestWork {cluster}/{name}");
                match modify_object(client, &path, &what, |w| Ok(apply_policy(w, policy))).await {
                    Ok(true) => changed.push(name),
                    Ok(false) => {}
                    // Deleted meanwhile: nothing left to protect.
                    Err(e) if is_not_found(&e) => {}
                    Err(e) => return Err(api(e)),
                }
            }
            Ok(format!(
                "{} of {} works now have deleteOption {}{}",
                changed.len(),
                works.len(),
                policy.propagation_policy(),
                if changed.is_empty() {
                    String::new()
                } else {
                    format!(" ({})", changed.join(", "))
                }
            ))
        }
        Step::Confirm => {
            let deadline = Instant::now() + timeout;
            loop {
                let works = list_works().await.map_err(api)?;
                let waiting: Vec<Value> = works
                    .iter()
                    .filter(|w| !holds_generation(w))
                    .cloned()
                    .collect();
                if waiting.is_empty() {
                    return Ok(format!(
                        "the agent reported the {} policy of all its works ({})",
                        policy.propagation_policy(),
                        works.len()
                    ));
                }
                if Instant::now() >= deadline {
                    return match policy {
                        Policy::Orphan => Ok(format!(
                            "the agent did not report the Orphan policy of {} within {} \
                             (offline?): it is revoked before any work is deleted, so it never \
                             acts on a deletion",
                            names(&waiting).join(", "),
                            humantime::format_duration(timeout)
                        )),
                        Policy::Clean => Err(DecommissionError::NotConfirmed {
                            cluster: cluster.into(),
                            works: names(&waiting),
                            timeout,
                        }),
                    };
                }
                tokio::time::sleep(POLL_INTERVAL).await;
            }
        }
        Step::Revoke => {
            if policy == Policy::Clean {
                // The deletions travel over the agent's session (or its next hello): revoke
                // only while it has one, not while it is away with the deletions unheard.
                let path = object_path(Kind::ManagedCluster, None, cluster);
                let deadline = Instant::now() + timeout;
                while !session_live(&client.get_json(&path).await.map_err(api)?) {
                    if Instant::now() >= deadline {
                        return Err(DecommissionError::AgentAway {
                            cluster: cluster.into(),
                            timeout,
                        });
                    }
                    tokio::time::sleep(POLL_INTERVAL).await;
                }
            }
            let result = client
                .request(
                    Method::POST,
                    &format!("/registration/v1/clusters/{cluster}/deny"),
                    Some(&json!({ "reason": format!("decommissioned (policy {policy})") })),
                )
                .await;
            match result {
                Ok(_) => Ok(format!(
                    "cluster {cluster} denied: its sessions are closed and its certificate no longer works"
                )),
                Err(e) if is_not_found(&e) => Err(DecommissionError::NotFound(cluster.into())),
                Err(e) => Err(api(e)),
            }
        }
        Step::Unplace => {
            let now = jiff::Timestamp::now()
                .strftime("%Y-%m-%dT%H:%M:%SZ")
                .to_string();
            let taint = crate::cli::TaintChange::Add {
                key: DECOMMISSION_TAINT.into(),
                value: String::new(),
                effect: "NoSelect".into(),
            };
            modify_cluster(client, cluster, |mc| {
                crate::cli::apply_taint_changes(mc, std::slice::from_ref(&taint), &now)
            })
            .await
            .map_err(api)?;
            let deadline = Instant::now() + timeout;
            let decisions_path = collection_path(Kind::PlacementDecision, None);
            loop {
                let list = client.get_json(&decisions_path).await.map_err(api)?;
                let items = list["items"].as_array().cloned().unwrap_or_default();
                let placements = placements_selecting(&items, cluster);
                if placements.is_empty() {
                    return Ok(format!(
                        "taint {DECOMMISSION_TAINT}:NoSelect set; no placement selects the cluster"
                    ));
                }
                if Instant::now() >= deadline {
                    return Err(DecommissionError::StillPlaced {
                        cluster: cluster.into(),
                        placements,
                        timeout,
                    });
                }
                tokio::time::sleep(POLL_INTERVAL).await;
            }
        }
        Step::DeleteWorks => {
            let deadline = Instant::now() + timeout;
            let mut deleted = Vec::new();
            loop {
                let works = list_works().await.map_err(api)?;
                // Works a finalizer holds are on their way out; only live ones need a delete.
                let live: Vec<Value> = works
                    .iter()
                    .filter(|w| w["metadata"]["deletionTimestamp"].is_null())
                    .cloned()
                    .collect();
                if works.is_empty() {
                    return Ok(format!(
                        "{} works deleted{}",
                        deleted.len(),
                        if deleted.is_empty() {
                            String::new()
                        } else {
                            format!(" ({})", deleted.join(", "))
                        }
                    ));
                }
                if Instant::now() >= deadline {
                    return Err(DecommissionError::WorksRemain {
                        cluster: cluster.into(),
                        works: names(&works),
                        timeout,
                    });
                }
                if policy == Policy::Orphan {
                    // The agent is revoked and never releases these works: let them go here,
                    // so their deletion does not wait on the cleanup finalizer for good.
                    for name in names(&works) {
                        let path = object_path(Kind::ManifestWork, Some(cluster), &name);
                        let what = format!("ManifestWork {cluster}/{name}");
                        match modify_object(client, &path, &what, |w| Ok(drop_cleanup_finalizer(w)))
                            .await
                        {
                            Ok(_) => {}
                            Err(e) if is_not_found(&e) => {}
                            Err(e) => return Err(api(e)),
                        }
                    }
                }
                for name in names(&live) {
                    match client
                        .request(
                            Method::DELETE,
                            &object_path(Kind::ManifestWork, Some(cluster), &name),
                            None,
                        )
                        .await
                    {
                        Ok(_) => deleted.push(name),
                        Err(e) if is_not_found(&e) => {}
                        Err(e) => return Err(api(e)),
                    }
                }
                if !live.is_empty() {
                    continue;
                }
                tokio::time::sleep(POLL_INTERVAL).await;
            }
        }
        Step::DeleteCluster => {
            match client
                .request(
                    Method::DELETE,
                    &object_path(Kind::ManagedCluster, None, cluster),
                    None,
                )
                .await
            {
                Ok(_) => Ok(format!("ManagedCluster {cluster} deleted")),
                Err(e) if is_not_found(&e) => Ok(format!("ManagedCluster {cluster} already gone")),
                Err(e) => Err(api(e)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_round_trips_and_walks_each_sequence() {
        for policy in [Policy::Orphan, Policy::Clean] {
            let mut p = resume("store-1", None, Some(policy)).unwrap();
            let mut walked = vec![p.next];
            assert_eq!(Progress::parse(&p.annotation()), Some(p));
            while let Some(next) = p.after() {
                assert_eq!(Progress::parse(&next.annotation()), Some(next));
                walked.push(next.next);
                p = next;
            }
            assert_eq!(walked, policy.steps());
        }
        assert_eq!(
            Progress::parse("policy=orphan,step=revoke")
                .unwrap()
                .ordinal(),
            "3/6"
        );
        assert_eq!(
            Progress::parse("policy=clean,step=revoke")
                .unwrap()
                .ordinal(),
            "5/6"
        );
    }

    #[test]
    fn an_orphan_decommission_revokes_before_anything_is_deleted() {
        let steps = Policy::Orphan.steps();
        let at = |s| steps.iter().position(|x| *x == s).unwrap();
        assert!(at(Step::Revoke) < at(Step::Unplace));
        assert!(at(Step::Revoke) < at(Step::DeleteWorks));
        let steps = Policy::Clean.steps();
        let at = |s| steps.iter().position(|x| *x == s).unwrap();
        assert!(at(Step::DeleteWorks) < at(Step::Revoke));
        assert!(at(Step::Confirm) < at(Step::Unplace));
    }

    #[test]
    fn resuming_keeps_the_recorded_policy() {
        let recorded = "policy=orphan,step=confirm";
        assert_eq!(
            resume("store-1", Some(recorded), None).unwrap(),
            Progress {
                policy: Policy::Orphan,
                next: Step::Confirm
            }
        );
        let err = resume("store-1", Some(recorded), Some(Policy::Clean))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("being decommissioned with --policy orphan (next step confirm)"),
            "{err}"
        );
        assert!(err.contains("--policy orphan` to finish it"), "{err}");
        let err = resume("store-1", None, None).unwrap_err().to_string();
        assert!(err.contains("--policy is required"), "{err}");
        for bad in [
            "policy=keep,step=confirm",
            "step=confirm",
            "policy=orphan,step=explode",
            "garbage",
        ] {
            let err = resume("store-1", Some(bad), Some(Policy::Orphan))
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("is not a decommission's progress"),
                "{bad}: {err}"
            );
        }
    }

    #[test]
    fn the_policy_replaces_the_works_delete_option() {
        let mut work = json!({
            "metadata": {"name": "web", "namespace": "store-1"},
            "spec": {"deleteOption": {"propagationPolicy": "SelectivelyOrphan",
                "selectivelyOrphans": {"orphaningRules": [{"resource": "configmaps", "name": "x"}]},
                "ttlSecondsAfterFinished": 60}},
        });
        assert!(apply_policy(&mut work, Policy::Clean));
        assert_eq!(
            work["spec"]["deleteOption"],
            json!({"propagationPolicy": "Foreground", "ttlSecondsAfterFinished": 60})
        );
        assert_eq!(
            work["metadata"]["annotations"][DECOMMISSION_ANNOTATION],
            "clean"
        );
        assert!(!apply_policy(&mut work, Policy::Clean), "already there");

        let mut bare = json!({"metadata": {"name": "db"}, "spec": {"workload": {}}});
        assert!(apply_policy(&mut bare, Policy::Orphan));
        assert_eq!(bare["spec"]["deleteOption"]["propagationPolicy"], "Orphan");
    }

    #[test]
    fn an_orphaning_decommission_drops_only_the_cleanup_finalizer() {
        let mut work =
            json!({"metadata": {"finalizers": ["example.com/keep", WORK_CLEANUP_FINALIZER]}});
        assert!(drop_cleanup_finalizer(&mut work));
        assert_eq!(work["metadata"]["finalizers"], json!(["example.com/keep"]));
        assert!(!drop_cleanup_finalizer(&mut work), "nothing left to drop");
        assert!(!drop_cleanup_finalizer(&mut json!({"metadata": {}})));
    }

    #[test]
    fn only_a_status_for_the_current_generation_confirms() {
        let work = |generation: i64, observed: Option<i64>| {
            let mut w = json!({"metadata": {"generation": generation}, "status": {}});
            if let Some(o) = observed {
                w["status"]["conditions"] =
                    json!([{"type": "Applied", "status": "True", "observedGeneration": o}]);
            }
            w
        };
        assert!(holds_generation(&work(2, Some(2))));
        assert!(!holds_generation(&work(2, Some(1))));
        assert!(!holds_generation(&work(1, None)), "never reported");
    }

    #[test]
    fn only_an_available_cluster_has_a_live_session() {
        let mc = |status: &str| {
            json!({"status": {"conditions": [
                {"type": "ManagedClusterJoined", "status": "True"},
                {"type": "ManagedClusterConditionAvailable", "status": status},
            ]}})
        };
        assert!(session_live(&mc("True")));
        assert!(!session_live(&mc("Unknown")));
        assert!(!session_live(&json!({"metadata": {"name": "new"}})));
    }

    #[test]
    fn placements_are_named_by_their_decisions() {
        let decisions = [
            json!({"metadata": {"namespace": "default", "name": "p1-decision-1",
                "labels": {"cluster.open-cluster-management.io/placement": "p1"}},
                "status": {"decisions": [{"clusterName": "store-1"}, {"clusterName": "store-2"}]}}),
            json!({"metadata": {"namespace": "apps", "name": "p2-decision-1",
                "labels": {"cluster.open-cluster-management.io/placement": "p2"}},
                "status": {"decisions": [{"clusterName": "store-2"}]}}),
        ];
        assert_eq!(placements_selecting(&decisions, "store-1"), ["default/p1"]);
        assert_eq!(
            placements_selecting(&decisions, "store-2"),
            ["apps/p2", "default/p1"]
        );
        assert!(placements_selecting(&decisions, "store-3").is_empty());
    }
}
