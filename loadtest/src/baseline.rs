//! `baseline-klusterlet` (`--store kube`): the apiserver load of flotilla's agents against that
//! of the pattern flotilla replaces, every spoke's agent listing and watching the hub apiserver
//! itself ([`crate::klusterlet`]), for the same clusters and the same work.
//!
//! * flotilla's side is the hub's own apiserver: `connect` and `fanout` come from the run's
//!   earlier scenarios of those names (when they ran and completed); `idle` is measured here,
//!   over `--baseline-window` with every agent's session up.
//! * the klusterlet side runs on a second, fresh apiserver, so that neither side's counts hold
//!   the other's traffic. Setup (not measured) creates each cluster's namespace and accepted
//!   ManagedCluster, as OCM's hub has them before its agents connect. Then: `connect`, the
//!   clients ramped at `--connect-rate` until each has listed, written Available and created
//!   its Lease, and the apiserver shows every cluster Available; `fanout`, one ManifestWork per
//!   cluster ([`crate::klusterlet::CREATES_IN_FLIGHT`] creates in flight) until the apiserver shows every one
//!   Applied and Available; `idle`, `--baseline-window` with nothing happening but lease
//!   renewals.
//! * `storm`, on both sides, after `idle`: everyone reconnects at once. flotilla's hub is
//!   SIGKILLed and started again (with a child hub, `--hub-mode process`), and the window ends
//!   when every agent has a new session; every klusterlet client restarts
//!   ([`Klusterlets::restart_all`]: new connections, relists, rewatches, a Lease renewal), and
//!   the window ends when every one has listed both kinds again. Each side's `storm` is the
//!   apiserver requests of its window.
//!
//! Both sides are waited on the same way: the harness lists the clusters (connect) and the works
//! (fanout) every `--poll-interval`, through the hub's operator API on flotilla's side and
//! directly on the klusterlet side, so those lists weigh on both.

use std::collections::HashSet;
use std::time::Duration;

use anyhow::Context;
use indicatif::ProgressBar;
use tokio::time::Instant;

use crate::apiserver::{Apiserver, ApiserverSnapshot, crds_dir};
use crate::klusterlet::{
    ClientRecord, KlusterletSpec, Klusterlets, applied_works, available_clusters, create_works,
    prepare_hub,
};
use crate::report::{ApiserverLoad, BaselineReport, Outcome, ScenarioReport};
use crate::scenario::{Clock, Run, SAMPLE_EVERY, bounded, finish};

/// The load an earlier scenario `name` of the run measured, if it completed.
fn earlier_load(earlier: &[ScenarioReport], name: &str) -> Option<ApiserverLoad> {
    earlier
        .iter()
        .rev()
        .find(|s| s.name == name && s.outcome == Some(Outcome::Completed))
        .and_then(|s| s.apiserver.clone())
}

/// Waits out a measurement window; `false` if the scenario's deadline comes first.
async fn wait_window(clock: &Clock, window: Duration, bar: &ProgressBar) -> bool {
    let start = Instant::now();
    let end = start + window;
    if end > clock.deadline {
        tokio::time::sleep_until(clock.deadline).await;
        return false;
    }
    loop {
        let now = Instant::now();
        bar.set_position(now.duration_since(start).as_secs());
        if now >= end {
            return true;
        }
        tokio::time::sleep((end - now).min(SAMPLE_EVERY)).await;
    }
}

/// Runs `f` unless the scenario's deadline comes first (then `None`).
async fn before_deadline<T>(
    clock: &Clock,
    f: impl Future<Output = anyhow::Result<T>>,
) -> anyhow::Result<Option<T>> {
    match tokio::time::timeout_at(clock.deadline, f).await {
        Ok(r) => r.map(Some),
        Err(_) => Ok(None),
    }
}

impl Run {
    /// `baseline-klusterlet`; `earlier` are the reports of the run's scenarios so far.
    pub async fn baseline_klusterlet(&mut self, earlier: &[ScenarioReport]) -> ScenarioReport {
        let mut r = ScenarioReport::new("baseline-klusterlet", self.identities.len());
        let clock = Clock::new(self.args.timeout);
        let mut b = BaselineReport {
            clients: self.n(),
            lease_interval_s: self.args.lease_interval.as_secs_f64(),
            window_s: self.args.baseline_window.as_secs_f64(),
            ..Default::default()
        };
        b.flotilla.connect = earlier_load(earlier, "connect");
        b.flotilla.fanout = earlier_load(earlier, "fanout");
        let result = bounded(&clock, self.baseline_inner(&clock, &mut r, &mut b)).await;
        b.compare();
        r.baseline = Some(b);
        finish(&mut r, &clock, result);
        r
    }

    async fn baseline_inner(
        &mut self,
        clock: &Clock,
        r: &mut ScenarioReport,
        b: &mut BaselineReport,
    ) -> anyhow::Result<bool> {
        anyhow::ensure!(
            self.hub.apiserver().is_some(),
            "needs the hub on a kube-apiserver (--store kube)"
        );
        self.ensure_connected(clock).await?;

        // flotilla, idle: every session up, nothing to deliver.
        let window = self.args.baseline_window;
        let before = self.hub_snapshot().await?;
        let bar = self.bar("idle", window.as_secs());
        bar.set_message("flotilla agents connected, measuring the hub's apiserver");
        let waited = wait_window(clock, window, &bar).await;
        bar.finish_and_clear();
        if !waited {
            return Ok(false);
        }
        let after = self.hub_snapshot().await?;
        let own = self.hub.apiserver().map_or(0, Apiserver::own_watches);
        b.flotilla.idle = Some(after.load_since(&before, own));
        r.connected = Some(self.sample().connected);

        // flotilla, storm: the hub killed under every session and started again.
        if self.hub.can_restart() {
            let Some(back_s) = self.flotilla_storm(clock).await? else {
                return Ok(false);
            };
            let stormed = self.hub_snapshot().await?;
            b.flotilla.storm = Some(stormed.load_since(&after, own));
            b.flotilla_storm_back_s = Some(back_s);
        }

        let bar = self.bar("apiserver", 0);
        bar.set_message("starting a second kube-apiserver for the klusterlet clients");
        let apiserver = Apiserver::start(&crds_dir()).await;
        bar.finish_and_clear();
        let apiserver = apiserver?;
        b.klusterlet_apiserver_pid = Some(apiserver.pid());
        let result = self.klusterlet_side(clock, &apiserver, b).await;
        apiserver.stop().await;
        result
    }

    /// Kills the hub, starts it again and waits for every agent's new session: the time that
    /// took, or `None` if the deadline came first.
    async fn flotilla_storm(&mut self, clock: &Clock) -> anyhow::Result<Option<f64>> {
        let n = self.n();
        let before = self.sample().established_total;
        let bar = self.bar("storm", n);
        bar.set_message("flotilla: hub killed, sessions back");
        let killed = Instant::now();
        self.hub
            .stop_with(nix::sys::signal::Signal::SIGKILL)
            .await?;
        self.hub.start_again().await?;
        loop {
            let s = self.sample();
            let renewed = s.established_total.saturating_sub(before);
            bar.set_position(renewed.min(n));
            if renewed >= n && s.connected >= n {
                bar.finish_and_clear();
                return Ok(Some(killed.elapsed().as_secs_f64()));
            }
            if clock.expired() {
                bar.finish_and_clear();
                return Ok(None);
            }
            tokio::time::sleep(SAMPLE_EVERY).await;
        }
    }

    async fn hub_snapshot(&self) -> anyhow::Result<ApiserverSnapshot> {
        self.hub
            .apiserver()
            .context("the hub has no kube-apiserver (--store kube)")?
            .snapshot()
            .await
    }

    /// Setup, then the clients' phases; the clients are stopped and accounted for whatever
    /// happens.
    async fn klusterlet_side(
        &mut self,
        clock: &Clock,
        apiserver: &Apiserver,
        b: &mut BaselineReport,
    ) -> anyhow::Result<bool> {
        let names: Vec<String> = self.identities.iter().map(|i| i.name.clone()).collect();
        let admin = apiserver.client().await?;
        let bar = self.bar("setup", self.n());
        bar.set_message("namespaces and ManagedClusters (not measured)");
        let prepared = before_deadline(
            clock,
            prepare_hub(&admin, &names, self.args.lease_interval, &bar),
        )
        .await;
        bar.finish_and_clear();
        if prepared?.is_none() {
            return Ok(false);
        }
        let kubeconfig = kube::config::Kubeconfig::read_from(apiserver.kubeconfig_path())
            .context("reading the second apiserver's kubeconfig")?;
        let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
            .await
            .context("loading the second apiserver's kubeconfig")?;
        let start = apiserver.snapshot().await?;
        let clients = Klusterlets::start(
            KlusterletSpec {
                config,
                lease_interval: self.args.lease_interval,
                connect_rate: self.args.connect_rate,
                seed: self.args.seed,
            },
            names.clone(),
        );
        let result = self
            .klusterlet_phases(clock, apiserver, &admin, &clients, start, &names, b)
            .await;
        let examples = clients.error_examples().await;
        let records = clients.stop().await;
        let records = records?;
        account(b, &records, examples);
        result
    }

    #[allow(clippy::too_many_arguments)]
    async fn klusterlet_phases(
        &mut self,
        clock: &Clock,
        apiserver: &Apiserver,
        admin: &kube::Client,
        clients: &Klusterlets,
        start: ApiserverSnapshot,
        names: &[String],
        b: &mut BaselineReport,
    ) -> anyhow::Result<bool> {
        let n = self.n();
        let own = apiserver.own_watches();
        let ours: HashSet<String> = names.iter().cloned().collect();

        // connect
        let bar = self.bar("klusterlet", n);
        loop {
            let available = available_clusters(admin, &ours).await?;
            let c = clients.counts();
            bar.set_position(c.registered);
            bar.set_message(format!(
                "registered ({} synced, {available} Available, {} errors)",
                c.synced, c.errors
            ));
            if c.registered >= n && available >= n {
                break;
            }
            if clock.expired() {
                bar.finish_and_clear();
                return Ok(false);
            }
            tokio::time::sleep(self.args.poll_interval).await;
        }
        bar.finish_and_clear();
        let connected = apiserver.snapshot().await?;
        b.klusterlet.connect = Some(connected.load_since(&start, own));

        // fanout
        let work = self.next_work_name("baseline");
        b.work = Some(work.clone());
        let bar = self.bar("create", n);
        let created = before_deadline(clock, create_works(admin, names, &work, &bar)).await;
        bar.finish_and_clear();
        let Some(created) = created? else {
            return Ok(false);
        };
        b.works_created = created;
        let bar = self.bar("applied", n);
        loop {
            b.works_applied = applied_works(admin, &work).await?;
            bar.set_position(b.works_applied);
            bar.set_message(format!(
                "Applied+Available ({} statuses written)",
                clients.counts().statuses_written
            ));
            if b.works_applied >= n {
                break;
            }
            if clock.expired() {
                bar.finish_and_clear();
                return Ok(false);
            }
            tokio::time::sleep(self.args.poll_interval).await;
        }
        bar.finish_and_clear();
        let fanned_out = apiserver.snapshot().await?;
        b.klusterlet.fanout = Some(fanned_out.load_since(&connected, own));

        // idle
        let bar = self.bar("idle", self.args.baseline_window.as_secs());
        bar.set_message("klusterlet clients connected, measuring their apiserver");
        let waited = wait_window(clock, self.args.baseline_window, &bar).await;
        bar.finish_and_clear();
        if !waited {
            return Ok(false);
        }
        let idle = apiserver.snapshot().await?;
        b.klusterlet.idle = Some(idle.load_since(&fanned_out, own));

        // storm: every client restarts at once. A client is back when it has listed both kinds
        // and watches them again; it opens the watches after its lists, so once every client
        // has listed the window waits for the last watches at the apiserver (the snapshot's
        // count of watches started in it).
        let bar = self.bar("storm", n);
        bar.set_message("klusterlet clients restarted, listed and watching again");
        let restarted = Instant::now();
        clients.restart_all();
        loop {
            let c = clients.counts();
            bar.set_position(c.resynced);
            if c.resynced >= n {
                let load = apiserver.snapshot().await?.load_since(&idle, own);
                if load.requests_by_verb.get("WATCH").copied().unwrap_or(0) >= 2 * n {
                    break;
                }
            }
            if clock.expired() {
                bar.finish_and_clear();
                return Ok(false);
            }
            tokio::time::sleep(SAMPLE_EVERY).await;
        }
        bar.finish_and_clear();
        b.klusterlet_storm_back_s = Some(restarted.elapsed().as_secs_f64());
        let stormed = apiserver.snapshot().await?;
        b.klusterlet.storm = Some(stormed.load_since(&idle, own));
        Ok(true)
    }
}

/// Every client's record into the report's accounting.
fn account(b: &mut BaselineReport, records: &[ClientRecord], examples: Vec<String>) {
    b.clients_started = records.len() as u64;
    b.clients_synced = records.iter().filter(|r| r.synced).count() as u64;
    b.clients_registered = records.iter().filter(|r| r.registered).count() as u64;
    b.clients_saw_work = match &b.work {
        Some(work) => records
            .iter()
            .filter(|r| r.works_seen.contains(work))
            .count() as u64,
        None => 0,
    };
    b.statuses_written = records.iter().map(|r| r.statuses_written).sum();
    b.lease_renewals = records.iter().map(|r| r.lease_renewals).sum();
    b.client_errors = records.iter().map(|r| r.errors).sum();
    b.clients_resynced = records.iter().filter(|r| r.restarts_synced > 0).count() as u64;
    b.client_error_examples = examples;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_client_record_is_counted() {
        let work = "baseline-2".to_string();
        let rec = |name: &str, synced, registered, seen: &[&str], statuses, errors| ClientRecord {
            name: name.into(),
            synced,
            registered,
            works_seen: seen.iter().map(|s| s.to_string()).collect(),
            statuses_written: statuses,
            lease_renewals: 2,
            errors,
            restarts_synced: u64::from(synced),
        };
        let records = [
            rec("a", true, true, &["baseline-2"], 1, 0),
            rec("b", true, true, &["fanout-1", "baseline-2"], 1, 1),
            rec("c", true, false, &["fanout-1"], 0, 3),
            rec("d", false, false, &[], 0, 0),
        ];
        let mut b = BaselineReport {
            work: Some(work),
            ..Default::default()
        };
        account(&mut b, &records, vec!["c: creating its Lease: boom".into()]);
        assert_eq!(
            (
                b.clients_started,
                b.clients_synced,
                b.clients_registered,
                b.clients_saw_work
            ),
            (4, 3, 2, 2)
        );
        assert_eq!(
            (b.statuses_written, b.lease_renewals, b.client_errors),
            (2, 8, 4)
        );
        assert_eq!(b.client_error_examples.len(), 1);
    }
}
