//! `links` (`--link`/`--link-spec`, `--store kube`): what an edge link does to each carrier and
//! to the klusterlet pattern, side by side, each side's clusters behind links of the same spec.
//!
//! flotilla's side is the run's agents: with `--transport both` the even workers are gRPC and
//! the odd QUIC, each worker behind a link of its own, so one run measures both carriers over
//! the same kind of link at the same time. The klusterlet side ([`crate::klusterlet`]) runs on
//! a second kube-apiserver, as in `baseline-klusterlet`; here its clients are split over as
//! many links as flotilla's workers, and every connection they make is made inside a link's
//! namespace (a runtime there: [`flotilla_wan::NamespaceRuntime`]), so their lists, watches,
//! status writes and lease renewals cross a link as an agent's session does.
//!
//! Per side, in this order: time to all connected; one ManifestWork to every cluster, create →
//! durable ack (flotilla) and → Applied on the hub, p50/p99, and ack → Applied (the status's
//! way back); a 1 MiB and a 10 MiB work to one cluster, create → Applied; bytes on the wire
//! per cluster per hour over an idle window (`--baseline-window`), read from the links' own
//! counters (every IP byte both ways, headers included); with a flapping link, each session
//! through one outage: kept, or ended and back (and when, against 2 round trips plus the
//! backoff's first step); kubectl through the tunnel to one cluster (a small GET's latency
//! and a 5,000-object list); and clusters marked Unknown, judged against the agents' session
//! logs over the whole scenario.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use flotilla_proto::api::conditions::WORK_APPLIED;
use futures::StreamExt;
use kube::api::{Api, ApiResource, DynamicObject, PostParams};
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::sync::watch;
use tokio::time::Instant;

use crate::apiserver::{Apiserver, crds_dir};
use crate::chaos::unknown::{self, UnknownMark};
use crate::cli::AgentTransport;
use crate::clock::{self, Stamp};
use crate::klusterlet::{KlusterletSpec, Klusterlets, available_clusters, prepare_hub};
use crate::operator::{POOL_SIZE, condition};
use crate::report::{Percentiles, ScenarioReport};
use crate::scenario::{Clock, Run, bounded, work_json};

/// The large works: MiB of ConfigMap data, in ConfigMaps of [`LARGE_PART`] bytes.
pub const LARGE_WORKS_MIB: [u64; 2] = [1, 10];
const LARGE_PART: usize = 512 * 1024;
/// Small GETs through the tunnel per carrier (each a round trip of the link).
pub const KUBECTL_GETS: usize = 30;
/// How often a large work's state is read from the hub apiserver.
const LARGE_POLL: Duration = Duration::from_millis(100);
/// How long past the flap bound sessions are watched for a late end.
const FLAP_SETTLE: Duration = Duration::from_secs(5);

/// Now, in Unix milliseconds (the agents' session logs and the Unknown marks use it).
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// `links`, per side.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct LinksReport {
    /// The link as asked (profile and spec).
    pub link: String,
    pub round_trip_ms: f64,
    pub sides: Vec<SideOverLink>,
    /// flotilla's agents (both carriers) against the hub at the end: every agent's latest
    /// status stored, none twice.
    #[serde(default)]
    pub statuses: Option<crate::report::StatusAudit>,
}

/// One side's figures: a carrier of flotilla's, or the klusterlet pattern.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct SideOverLink {
    /// `grpc`, `quic` or `klusterlet`.
    pub side: String,
    pub clusters: u64,
    pub links: u64,
    pub connected_s: Option<f64>,
    pub ack: Option<Percentiles>,
    pub applied: Option<Percentiles>,
    /// Ack → Applied on the hub: the status's way back (flotilla only).
    pub status_lag: Option<Percentiles>,
    pub large: Vec<LargeWork>,
    pub idle_bytes_per_cluster_hour: Option<f64>,
    pub flap: Option<FlapBack>,
    pub kubectl_get: Option<Percentiles>,
    pub kubectl_list_s: Option<f64>,
    pub kubectl_list_bytes: Option<u64>,
    pub unknown_marks: Option<u64>,
    pub wrong_unknown: Option<u64>,
    /// Why a figure is missing on this side.
    pub notes: Vec<String>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct LargeWork {
    pub mib: u64,
    pub cluster: String,
    pub applied_s: Option<f64>,
    /// The hub's refusal, if it refused the work.
    pub refused: Option<String>,
}

/// Each session through one outage of its link.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct FlapBack {
    pub outage_s: f64,
    /// Sessions that lived through the outage (no end logged).
    pub kept: u64,
    /// Sessions that ended and began again, and how long after the link was back.
    pub back: u64,
    pub back_p50_s: Option<f64>,
    pub back_max_s: Option<f64>,
    /// Two round trips plus the backoff's first step.
    pub bound_s: f64,
    pub within_bound: u64,
    /// Sessions not up again when the watch ended.
    pub not_back: u64,
    /// A work created for each cluster the moment its link came back: create → durable ack
    /// (flotilla) and → Applied on the hub. What an operator sees of the outage.
    pub after_up_ack: Option<Percentiles>,
    pub after_up_applied: Option<Percentiles>,
    /// Clusters whose work was acked (flotilla) or Applied (klusterlet) within `bound_s`.
    pub after_up_within_bound: u64,
}

impl Run {
    /// `links`.
    pub async fn links(&mut self) -> ScenarioReport {
        let mut r = ScenarioReport::new("links", self.identities.len());
        let clock = Clock::new(self.args.timeout);
        let mut l = LinksReport {
            link: self.args.link.describe().unwrap_or_default(),
            ..Default::default()
        };
        let result = bounded(&clock, self.links_inner(&clock, &mut l)).await;
        r.links = Some(l);
        self.conclude(&mut r, &clock, result).await;
        r
    }

    async fn links_inner(&mut self, clock: &Clock, l: &mut LinksReport) -> anyhow::Result<bool> {
        let spec = self
            .args
            .link
            .spec()?
            .context("scenario links needs --link or --link-spec")?;
        l.round_trip_ms = spec.delay.as_secs_f64() * 1000.0;
        let hub_client = self
            .hub
            .apiserver()
            .context("scenario links needs --store kube (works and clusters are watched on the hub apiserver)")?
            .client()
            .await?;
        self.ensure_connected(clock).await?;
        let duplicates_before = self.sample().duplicate_status_acks;
        let names: Vec<String> = self.identities.iter().map(|i| i.name.clone()).collect();
        let per = names.len().div_ceil(self.args.processes.max(1));
        let links = self.agents.as_ref().map(|a| a.links()).unwrap_or_default();
        // Each carrier's clusters and links.
        let mut sides: Vec<(
            AgentTransport,
            Vec<String>,
            Vec<Arc<flotilla_wan::EmulatedLink>>,
        )> = Vec::new();
        for (w, link) in &links {
            let carrier = self.args.transport.of_worker(*w);
            let clusters = names.chunks(per).nth(*w).unwrap_or_default().to_vec();
            match sides.iter_mut().find(|(c, _, _)| *c == carrier) {
                Some((_, cs, ls)) => {
                    cs.extend(clusters);
                    ls.push(link.clone());
                }
                None => sides.push((carrier, clusters, vec![link.clone()])),
            }
        }
        sides.sort_by_key(|(c, _, _)| carrier_name(*c));
        let carrier_of: HashMap<&str, usize> = sides
            .iter()
            .enumerate()
            .flat_map(|(i, (_, cs, _))| cs.iter().map(move |c| (c.as_str(), i)))
            .collect();
        for (carrier, clusters, links) in &sides {
            l.sides.push(SideOverLink {
                side: carrier_name(*carrier).into(),
                clusters: clusters.len() as u64,
                links: links.len() as u64,
                ..Default::default()
            });
        }

        // Unknown marks, over the whole scenario.
        let (stop_marks, stopped) = watch::channel(false);
        let marks = tokio::spawn(crate::chaos::scenario::watch_unknown(
            hub_client.clone(),
            names.iter().cloned().collect(),
            stopped,
        ));

        // Time to all connected, from the session logs.
        let records = self.records().await?;
        if let Some(started) = self.agents_started_unix_ms {
            for rec in &records {
                let Some(&i) = carrier_of.get(rec.name.as_str()) else {
                    continue;
                };
                let first = rec.session_log.iter().find(|(_, up)| *up).map(|(t, _)| *t);
                let s = &mut l.sides[i];
                if let Some(first) = first {
                    let t = first.saturating_sub(started) as f64 / 1000.0;
                    s.connected_s = Some(s.connected_s.map_or(t, |m: f64| m.max(t)));
                }
            }
        }

        // One work to every cluster.
        let name = self.next_work_name("links");
        let acked_before = self.sample().works_acked;
        let bar = self.bar("fanout", self.n());
        let (created, (applied_at, done)) = futures::future::try_join(
            self.create_everywhere(&name),
            self.applied_by_watch(hub_client.clone(), &name, clock, &bar, acked_before),
        )
        .await?;
        bar.finish_and_clear();
        if !done {
            return Ok(false);
        }
        let records = self.records().await?;
        let mut acks = vec![Vec::new(); sides.len()];
        let mut applied = vec![Vec::new(); sides.len()];
        let mut lag = vec![Vec::new(); sides.len()];
        for rec in &records {
            let Some(&i) = carrier_of.get(rec.name.as_str()) else {
                continue;
            };
            let sent = created.get(&rec.name).copied();
            let ack = rec.acks.get(&name).copied();
            let at = applied_at.get(&rec.name).copied();
            if let (Some(sent), Some(ack)) = (sent, ack) {
                acks[i].push(micros(sent, ack));
            }
            if let (Some(sent), Some(at)) = (sent, at) {
                applied[i].push(micros(sent, at));
            }
            if let (Some(ack), Some(at)) = (ack, at) {
                lag[i].push(micros(ack, at));
            }
        }
        for (i, s) in l.sides.iter_mut().enumerate() {
            s.ack = Some(Percentiles::from_micros(&acks[i]));
            s.applied = Some(Percentiles::from_micros(&applied[i]));
            s.status_lag = Some(Percentiles::from_micros(&lag[i]));
        }

        // Idle: bytes on the wire.
        let window = self.args.baseline_window;
        let before: Vec<u64> = sides.iter().map(|(_, _, ls)| wire_bytes(ls)).collect();
        let bar = self.bar("idle", window.as_secs());
        bar.set_message("bytes on the links with nothing to deliver");
        let began = Instant::now();
        while began.elapsed() < window && !clock.expired() {
            bar.set_position(began.elapsed().as_secs());
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        bar.finish_and_clear();
        let took = began.elapsed().as_secs_f64();
        for (i, (_, clusters, links)) in sides.iter().enumerate() {
            let bytes = wire_bytes(links) - before[i];
            l.sides[i].idle_bytes_per_cluster_hour =
                Some(bytes as f64 / clusters.len() as f64 * 3600.0 / took);
        }

        // Large works, the carriers at once (each over its own links).
        let large = futures::future::join_all(sides.iter().map(|(_, clusters, _)| {
            let cluster = clusters[0].clone();
            let api = self.api.clone();
            let client = hub_client.clone();
            let seed = self.args.seed;
            async move {
                let mut out = Vec::new();
                for mib in LARGE_WORKS_MIB {
                    let work = large_work(&cluster, &format!("links-large-{mib}mib"), mib, seed);
                    let started = Instant::now();
                    let made = create_chunked(&api, &work).await;
                    out.push(match made {
                        Err(e) => LargeWork {
                            mib,
                            cluster: cluster.clone(),
                            applied_s: None,
                            refused: Some(format!("{e:#}")),
                        },
                        Ok(_) => LargeWork {
                            mib,
                            cluster: cluster.clone(),
                            applied_s: wait_applied(&client, &work, clock)
                                .await?
                                .then(|| started.elapsed().as_secs_f64()),
                            refused: None,
                        },
                    });
                }
                anyhow::Ok(out)
            }
        }))
        .await;
        for (s, large) in l.sides.iter_mut().zip(large) {
            s.large = large?;
        }

        // A flap: each session through one outage of its link.
        if let Some(flap) = spec.flap {
            let bound = 2 * spec.delay
                + flotilla_proto::session::DEFAULT_BACKOFF_INITIAL.min(self.args.max_backoff);
            let flap_work = self.next_work_name("links-flap");
            let api = self.api.clone();
            let (flap_work, names, api) = (&flap_work, &names, &api);
            let outages = futures::future::join_all(links.iter().map(|(w, link)| async move {
                let outage = next_outage(link, clock).await;
                // The moment the link is back, a change for every cluster behind it.
                let clusters = names.chunks(per).nth(*w).unwrap_or_default();
                let created = match outage {
                    Some(_) => create_works(api, clusters, flap_work).await,
                    None => Ok(HashMap::new()),
                };
                (*w, outage, created)
            }));
            let (outages, applied_at) = futures::future::join(
                outages,
                applied_stamps(hub_client.clone(), flap_work, self.n(), clock),
            )
            .await;
            let applied_at = applied_at?;
            let mut created = HashMap::new();
            let outages: Vec<(usize, Option<(u64, u64)>)> = outages
                .into_iter()
                .map(|(w, o, c)| {
                    created.extend(c?);
                    anyhow::Ok((w, o))
                })
                .collect::<anyhow::Result<_>>()?;
            // Sessions that end late (a timeout after the link is back) count too.
            let last_up = outages
                .iter()
                .filter_map(|(_, o)| o.map(|(_, up)| up))
                .max()
                .unwrap_or_else(unix_ms);
            let settle_until = last_up + (bound + FLAP_SETTLE).as_millis() as u64;
            while unix_ms() < settle_until || self.sample().connected < self.n() {
                anyhow::ensure!(
                    !clock.expired(),
                    "the sessions were not all back after the flap before the deadline"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            let records = self.records().await?;
            let window_of: HashMap<&str, (u64, u64)> = outages
                .iter()
                .filter_map(|(w, o)| o.map(|o| (*w, o)))
                .flat_map(|(w, o)| {
                    names
                        .chunks(per)
                        .nth(w)
                        .unwrap_or_default()
                        .iter()
                        .map(move |n| (n.as_str(), o))
                })
                .collect();
            let mut backs: Vec<Vec<f64>> = vec![Vec::new(); sides.len()];
            let mut after_ack = vec![Vec::new(); sides.len()];
            let mut after_applied = vec![Vec::new(); sides.len()];
            let mut within = vec![0u64; sides.len()];
            for rec in &records {
                let (Some(&i), Some(&sent)) =
                    (carrier_of.get(rec.name.as_str()), created.get(&rec.name))
                else {
                    continue;
                };
                if let Some(&ack) = rec.acks.get(flap_work.as_str()) {
                    after_ack[i].push(micros(sent, ack));
                    if clock::between(sent, ack) <= bound {
                        within[i] += 1;
                    }
                }
                if let Some(&at) = applied_at.get(&rec.name) {
                    after_applied[i].push(micros(sent, at));
                }
            }
            let mut flaps: Vec<FlapBack> = (0..sides.len())
                .map(|_| FlapBack {
                    outage_s: flap.down.as_secs_f64(),
                    bound_s: bound.as_secs_f64(),
                    ..Default::default()
                })
                .collect();
            for rec in &records {
                let (Some(&i), Some(&(down, up))) = (
                    carrier_of.get(rec.name.as_str()),
                    window_of.get(rec.name.as_str()),
                ) else {
                    continue;
                };
                let f = &mut flaps[i];
                let ended = rec.session_log.iter().any(|(t, u)| !u && *t >= down);
                if !ended {
                    f.kept += 1;
                    continue;
                }
                match rec.session_log.iter().find(|(t, u)| *u && *t >= down) {
                    Some((t, _)) => {
                        let s = t.saturating_sub(up) as f64 / 1000.0;
                        f.back += 1;
                        if s <= f.bound_s {
                            f.within_bound += 1;
                        }
                        backs[i].push(s);
                    }
                    None => f.not_back += 1,
                }
            }
            for (i, mut f) in flaps.into_iter().enumerate() {
                backs[i].sort_by(f64::total_cmp);
                f.back_p50_s = backs[i].get(backs[i].len() / 2).copied();
                f.back_max_s = backs[i].last().copied();
                f.after_up_ack = Some(Percentiles::from_micros(&after_ack[i]));
                f.after_up_applied = Some(Percentiles::from_micros(&after_applied[i]));
                f.after_up_within_bound = within[i];
                l.sides[i].flap = Some(f);
            }
        }

        // kubectl through the tunnel, to each carrier's first cluster.
        let listen: flotilla_hub::ListenInfo = serde_json::from_str(&std::fs::read_to_string(
            flotilla_hub::ListenInfo::path(&self.hub.data_dir),
        )?)?;
        if let Some(proxy) = listen.proxy {
            let tls = self.proxy_user_tls().await?;
            for (i, (_, clusters, _)) in sides.iter().enumerate() {
                let mut to = crate::proxy::Client::open(proxy, &tls).await?;
                let base = format!("/clusters/{}", clusters[0]);
                let mut us = Vec::new();
                for _ in 0..KUBECTL_GETS {
                    us.push(
                        to.get(&format!("{base}/api/v1/namespaces/default"))
                            .await?
                            .1
                            .as_micros() as u64,
                    );
                }
                l.sides[i].kubectl_get = Some(Percentiles::from_micros(&us));
                let (bytes, took) = to.get(&format!("{base}/api/v1/configmaps")).await?;
                l.sides[i].kubectl_list_s = Some(took.as_secs_f64());
                l.sides[i].kubectl_list_bytes = Some(bytes);
            }
        }

        // The Unknown marks, judged.
        let _ = stop_marks.send(true);
        let marks: Vec<UnknownMark> = marks.await.unwrap_or_default();
        let records = self.records().await?;
        let sessions: HashMap<String, Vec<(u64, bool)>> = records
            .iter()
            .map(|r| (r.name.clone(), r.session_log.clone()))
            .collect();
        let wrong = unknown::judge(&marks, &sessions);
        for (i, s) in l.sides.iter_mut().enumerate() {
            let of_side = |c: &str| carrier_of.get(c) == Some(&i);
            s.unknown_marks = Some(marks.iter().filter(|m| of_side(&m.cluster)).count() as u64);
            s.wrong_unknown = Some(wrong.iter().filter(|m| of_side(&m.cluster)).count() as u64);
        }

        // Every status the agents made is on the hub, none twice.
        let (audit, _) = self.converge_and_audit(clock, duplicates_before).await?;
        l.statuses = Some(audit);

        // The klusterlet pattern over links of the same spec.
        let side = self
            .klusterlet_over_links(
                clock,
                &spec,
                sides.iter().map(|(_, _, ls)| ls.len()).sum(),
                per,
            )
            .await?;
        l.sides.push(side);
        Ok(true)
    }

    /// The klusterlet side: its clients over `links` links of `spec`, `per` clusters each.
    async fn klusterlet_over_links(
        &mut self,
        clock: &Clock,
        spec: &flotilla_wan::LinkSpec,
        links: usize,
        per: usize,
    ) -> anyhow::Result<SideOverLink> {
        let names: Vec<String> = self.identities.iter().map(|i| i.name.clone()).collect();
        let mut s = SideOverLink {
            side: "klusterlet".into(),
            clusters: names.len() as u64,
            links: links as u64,
            notes: vec![
                "no durable ack: a klusterlet's watch delivers the work, nothing acknowledges it"
                    .into(),
                "kubectl: no path to a spoke behind NAT without an add-on (OCM's cluster-proxy)"
                    .into(),
                "Unknown: the baseline runs no hub controller that marks leases Unknown".into(),
            ],
            ..Default::default()
        };
        let bar = self.bar("apiserver", 0);
        bar.set_message("a second kube-apiserver for the klusterlet clients");
        let apiserver = Apiserver::start(&crds_dir()).await;
        bar.finish_and_clear();
        let apiserver = apiserver?;
        let result = self
            .klusterlet_measured(clock, spec, links, per, &names, &apiserver, &mut s)
            .await;
        apiserver.stop().await;
        result.map(|()| s)
    }

    #[allow(clippy::too_many_arguments)]
    async fn klusterlet_measured(
        &mut self,
        clock: &Clock,
        spec: &flotilla_wan::LinkSpec,
        links: usize,
        per: usize,
        names: &[String],
        apiserver: &Apiserver,
        s: &mut SideOverLink,
    ) -> anyhow::Result<()> {
        let admin = apiserver.client().await?;
        prepare_hub(
            &admin,
            names,
            self.args.lease_interval,
            &self.bar("setup", self.n()),
        )
        .await?;
        let kubeconfig = kube::config::Kubeconfig::read_from(apiserver.kubeconfig_path())
            .context("reading the second apiserver's kubeconfig")?;
        let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
            .await
            .context("loading the second apiserver's kubeconfig")?;
        // Links first, their runtimes after: the clients stop before their runtimes, the
        // runtimes before their links.
        let mut made = Vec::new();
        for w in 0..links {
            let link = flotilla_wan::EmulatedLink::create(
                spec.clone(),
                self.args.seed.wrapping_add(1_000 + w as u64),
            )
            .await
            .with_context(|| format!("the klusterlet clients' link {w}"))?;
            // The clients dial the apiserver's loopback address, as its kubeconfig names it.
            link.send_loopback_to_host()?;
            let runtime = link.runtime().await?;
            made.push((link, runtime));
        }
        let started = Instant::now();
        let mut clients = Vec::new();
        for ((_, runtime), group) in made.iter().zip(names.chunks(per)) {
            let _inside = runtime.handle().enter();
            clients.push(Klusterlets::start(
                KlusterletSpec {
                    config: config.clone(),
                    lease_interval: self.args.lease_interval,
                    connect_rate: self.args.connect_rate / links as f64,
                    seed: self.args.seed,
                },
                group.to_vec(),
            ));
        }
        let result = self
            .klusterlet_phases_over_links(clock, spec, &admin, &made, started, names, per, s)
            .await;
        for c in clients {
            if let Err(e) = c.stop().await {
                tracing::warn!(error = %e, "stopping the klusterlet clients");
            }
        }
        result
    }

    #[allow(clippy::too_many_arguments)]
    async fn klusterlet_phases_over_links(
        &mut self,
        clock: &Clock,
        spec: &flotilla_wan::LinkSpec,
        admin: &kube::Client,
        made: &[(flotilla_wan::EmulatedLink, flotilla_wan::NamespaceRuntime)],
        started: Instant,
        names: &[String],
        per: usize,
        s: &mut SideOverLink,
    ) -> anyhow::Result<()> {
        let n = names.len() as u64;
        let ours: HashSet<String> = names.iter().cloned().collect();
        while available_clusters(admin, &ours).await? < n {
            anyhow::ensure!(
                !clock.expired(),
                "the klusterlet clients were not all Available before the deadline"
            );
            tokio::time::sleep(self.args.poll_interval).await;
        }
        s.connected_s = Some(started.elapsed().as_secs_f64());

        // One work to every cluster, Applied stamped by a watch of the apiserver.
        let work = self.next_work_name("links-klusterlet");
        let watching = applied_stamps(admin.clone(), &work, n, clock);
        let creating = create_kube_works(admin, names, &work);
        let (created, applied_at) = futures::future::try_join(creating, watching).await?;
        let applied: Vec<u64> = created
            .iter()
            .filter_map(|(c, sent)| applied_at.get(c).map(|at| micros(*sent, *at)))
            .collect();
        s.applied = Some(Percentiles::from_micros(&applied));

        // Idle.
        let links: Vec<&flotilla_wan::EmulatedLink> = made.iter().map(|(l, _)| l).collect();
        let bytes = |ls: &[&flotilla_wan::EmulatedLink]| {
            ls.iter()
                .map(|l| l.inbound().offered_bytes + l.outbound().offered_bytes)
                .sum::<u64>()
        };
        let before = bytes(&links);
        let began = Instant::now();
        let window = self.args.baseline_window;
        let bar = self.bar("idle", window.as_secs());
        bar.set_message("klusterlet clients: bytes on the links with nothing to deliver");
        while began.elapsed() < window && !clock.expired() {
            bar.set_position(began.elapsed().as_secs());
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        bar.finish_and_clear();
        s.idle_bytes_per_cluster_hour = Some(
            (bytes(&links) - before) as f64 / n as f64 * 3600.0 / began.elapsed().as_secs_f64(),
        );
        // Large works to the first cluster.
        let cluster = names[0].clone();
        for mib in LARGE_WORKS_MIB {
            let work = large_work(
                &cluster,
                &format!("links-large-{mib}mib"),
                mib,
                self.args.seed,
            );
            let api =
                Api::<DynamicObject>::namespaced_with(admin.clone(), &cluster, &work_resource());
            let body: DynamicObject = serde_json::from_value(work.clone())?;
            let began = Instant::now();
            s.large
                .push(match api.create(&PostParams::default(), &body).await {
                    Err(e) => LargeWork {
                        mib,
                        cluster: cluster.clone(),
                        applied_s: None,
                        refused: Some(e.to_string().chars().take(200).collect()),
                    },
                    Ok(_) => LargeWork {
                        mib,
                        cluster: cluster.clone(),
                        applied_s: wait_applied(admin, &work, clock)
                            .await?
                            .then(|| began.elapsed().as_secs_f64()),
                        refused: None,
                    },
                });
        }

        // A work made for each cluster the moment its link comes back from an outage.
        if let Some(flap) = spec.flap {
            let bound = 2 * spec.delay
                + flotilla_proto::session::DEFAULT_BACKOFF_INITIAL.min(self.args.max_backoff);
            let work = self.next_work_name("links-klusterlet-flap");
            let work = &work;
            let created = futures::future::join_all(made.iter().zip(names.chunks(per)).map(
                |((link, _), group)| async move {
                    match next_outage(link, clock).await {
                        Some(_) => create_kube_works(admin, group, work).await,
                        None => Ok(HashMap::new()),
                    }
                },
            ));
            let (created, applied_at) =
                futures::future::join(created, applied_stamps(admin.clone(), work, n, clock)).await;
            let applied_at = applied_at?;
            let mut applied = Vec::new();
            let mut within = 0;
            for group in created {
                for (cluster, sent) in group? {
                    if let Some(&at) = applied_at.get(&cluster) {
                        applied.push(micros(sent, at));
                        if clock::between(sent, at) <= bound {
                            within += 1;
                        }
                    }
                }
            }
            s.flap = Some(FlapBack {
                outage_s: flap.down.as_secs_f64(),
                bound_s: bound.as_secs_f64(),
                after_up_applied: Some(Percentiles::from_micros(&applied)),
                after_up_within_bound: within,
                ..Default::default()
            });
        }
        Ok(())
    }
}

fn carrier_name(c: AgentTransport) -> &'static str {
    match c {
        AgentTransport::Grpc => "grpc",
        AgentTransport::Quic => "quic",
        AgentTransport::Auto => "auto",
        AgentTransport::Both => "both",
    }
}

fn micros(from: Stamp, to: Stamp) -> u64 {
    clock::between(from, to).as_micros() as u64
}

/// Every IP byte the links carried, both ways.
fn wire_bytes(links: &[Arc<flotilla_wan::EmulatedLink>]) -> u64 {
    links
        .iter()
        .map(|l| l.inbound().offered_bytes + l.outbound().offered_bytes)
        .sum()
}

fn work_resource() -> ApiResource {
    ApiResource {
        group: "work.open-cluster-management.io".into(),
        version: "v1".into(),
        api_version: "work.open-cluster-management.io/v1".into(),
        kind: "ManifestWork".into(),
        plural: "manifestworks".into(),
    }
}

/// A work of `mib` MiB of ConfigMap data (random letters: the carriers compress nothing
/// away), in ConfigMaps of [`LARGE_PART`] bytes.
pub fn large_work(cluster: &str, name: &str, mib: u64, seed: u64) -> Value {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ mib);
    let parts = (mib as usize * 1024 * 1024).div_ceil(LARGE_PART);
    let manifests: Vec<Value> = (0..parts)
        .map(|p| {
            let blob: String = (0..LARGE_PART)
                .map(|_| char::from(b'a' + rng.random_range(0..26u8)))
                .collect();
            json!({
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": { "name": format!("{name}-{p}"), "namespace": "default" },
                "data": { "blob": blob },
            })
        })
        .collect();
    json!({
        "apiVersion": "work.open-cluster-management.io/v1",
        "kind": "ManifestWork",
        "metadata": { "name": name, "namespace": cluster },
        "spec": { "workload": { "manifests": manifests } },
    })
}

/// Creates work `name` (the fan-out's one ConfigMap) for each of `clusters` on the klusterlet
/// side's apiserver, each stamped as it was sent.
async fn create_kube_works(
    admin: &kube::Client,
    clusters: &[String],
    name: &str,
) -> anyhow::Result<HashMap<String, Stamp>> {
    let made: Vec<anyhow::Result<(String, Stamp)>> =
        futures::stream::iter(clusters.iter().cloned())
            .map(|cluster| async move {
                let api = Api::<DynamicObject>::namespaced_with(
                    admin.clone(),
                    &cluster,
                    &work_resource(),
                );
                let body: DynamicObject = serde_json::from_value(work_json(&cluster, name))?;
                let sent = clock::now();
                api.create(&PostParams::default(), &body)
                    .await
                    .with_context(|| format!("creating ManifestWork {cluster}/{name}"))?;
                Ok((cluster, sent))
            })
            .buffer_unordered(POOL_SIZE)
            .collect()
            .await;
    made.into_iter().collect()
}

/// Creates work `name` (the fan-out's one ConfigMap) for each of `clusters` through the
/// operator API, each stamped as it was sent.
async fn create_works(
    api: &crate::operator::OperatorApi,
    clusters: &[String],
    name: &str,
) -> anyhow::Result<HashMap<String, Stamp>> {
    let made: Vec<anyhow::Result<(String, Stamp)>> =
        futures::stream::iter(clusters.iter().cloned())
            .map(|cluster| async move {
                let sent = clock::now();
                api.create_work(&work_json(&cluster, name))
                    .await
                    .with_context(|| format!("creating ManifestWork {cluster}/{name}"))?;
                Ok((cluster, sent))
            })
            .buffer_unordered(POOL_SIZE)
            .collect()
            .await;
    made.into_iter().collect()
}

/// Creates `work` as `flotilla work create -f` does a work too large for one object: its
/// manifests stored as content-addressed chunks first, then the work naming them.
async fn create_chunked(api: &crate::operator::OperatorApi, work: &Value) -> anyhow::Result<()> {
    use flotilla_proto::api::{Kind, ManifestWork, content};
    let parsed: ManifestWork = serde_json::from_value(work.clone())?;
    let ns = parsed.metadata.namespace.clone().unwrap_or_default();
    let (reference, chunks) = content::split(&parsed.spec.workload.manifests);
    let kind = Kind::ManifestChunk;
    let path = format!(
        "/apis/{}/{}/namespaces/{ns}/{}",
        kind.group(),
        kind.version(),
        kind.plural()
    );
    for chunk in &chunks {
        api.request(
            http::Method::POST,
            &path,
            Some(&content::chunk_object(&ns, chunk)),
        )
        .await
        .with_context(|| {
            format!(
                "storing a chunk of ManifestWork {ns}/{}",
                work["metadata"]["name"]
            )
        })?;
    }
    let mut stored = work.clone();
    stored["spec"]["workload"]["manifests"] = json!([reference.manifest().0]);
    api.create_work(&stored).await?;
    Ok(())
}

/// Waits until `work` shows Applied on the apiserver (read every [`LARGE_POLL`]); `false` if
/// the deadline comes first.
async fn wait_applied(client: &kube::Client, work: &Value, clock: &Clock) -> anyhow::Result<bool> {
    let ns = work["metadata"]["namespace"].as_str().unwrap_or_default();
    let name = work["metadata"]["name"].as_str().unwrap_or_default();
    let api = Api::<DynamicObject>::namespaced_with(client.clone(), ns, &work_resource());
    while !clock.expired() {
        if let Some(w) = api.get_opt(name).await? {
            let v = serde_json::to_value(&w)?;
            if condition(&v, WORK_APPLIED) == Some("True") {
                return Ok(true);
            }
        }
        tokio::time::sleep(LARGE_POLL).await;
    }
    Ok(false)
}

/// When each cluster's work `name` turned Applied, from a watch; until `n` have or the
/// deadline.
async fn applied_stamps(
    client: kube::Client,
    name: &str,
    n: u64,
    clock: &Clock,
) -> anyhow::Result<HashMap<String, Stamp>> {
    use kube::runtime::{WatchStreamExt, watcher};
    let api = Api::<DynamicObject>::all_with(client, &work_resource());
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let mut events = watcher(api, config).default_backoff().boxed();
    let mut applied_at = HashMap::new();
    while (applied_at.len() as u64) < n {
        anyhow::ensure!(
            !clock.expired(),
            "the klusterlet side's works were not all Applied before the deadline"
        );
        let Ok(event) = tokio::time::timeout(Duration::from_millis(500), events.next()).await
        else {
            continue;
        };
        let now = clock::now();
        match event {
            Some(Ok(watcher::Event::Apply(w) | watcher::Event::InitApply(w))) => {
                let v = serde_json::to_value(&w)?;
                if let (Some("True"), Some(ns)) =
                    (condition(&v, WORK_APPLIED), w.metadata.namespace)
                {
                    applied_at.entry(ns).or_insert(now);
                }
            }
            Some(Ok(_)) => {}
            Some(Err(e)) => tracing::warn!(error = %e, "watching ManifestWorks {name}"),
            None => anyhow::bail!("the watch of ManifestWorks {name} ended"),
        }
    }
    Ok(applied_at)
}

/// The next outage of `link` as (went down, came back) in Unix ms, watched as it happens;
/// `None` if the deadline comes first.
async fn next_outage(link: &flotilla_wan::EmulatedLink, clock: &Clock) -> Option<(u64, u64)> {
    const LOOK: Duration = Duration::from_millis(10);
    // An outage already under way is not whole: wait for the next.
    while link.is_down() {
        if clock.expired() {
            return None;
        }
        tokio::time::sleep(LOOK).await;
    }
    while !link.is_down() {
        if clock.expired() {
            return None;
        }
        tokio::time::sleep(LOOK).await;
    }
    let down = unix_ms();
    while link.is_down() {
        if clock.expired() {
            return None;
        }
        tokio::time::sleep(LOOK).await;
    }
    Some((down, unix_ms()))
}

impl LinksReport {
    /// The report's rows: one per figure, the sides side by side.
    pub fn rows(&self) -> Vec<(String, String)> {
        let mut rows = vec![(
            "link".to_string(),
            format!("{} (round trip {:.0} ms)", self.link, self.round_trip_ms),
        )];
        let sides = |f: &dyn Fn(&SideOverLink) -> String| {
            self.sides
                .iter()
                .map(|s| format!("{} {}", s.side, f(s)))
                .collect::<Vec<_>>()
                .join(" | ")
        };
        let pct = |p: &Option<Percentiles>| {
            p.as_ref().filter(|p| p.count > 0).map_or_else(
                || "-".into(),
                |p| format!("{:.0}/{:.0} ms", p.p50_ms, p.p99_ms),
            )
        };
        let secs = |v: Option<f64>| v.map_or_else(|| "-".into(), |v| format!("{v:.2} s"));
        rows.push((
            "clusters (links)".into(),
            sides(&|s| format!("{} ({})", s.clusters, s.links)),
        ));
        rows.push((
            "time to all connected".into(),
            sides(&|s| secs(s.connected_s)),
        ));
        rows.push(("create → ack p50/p99".into(), sides(&|s| pct(&s.ack))));
        rows.push((
            "create → Applied p50/p99".into(),
            sides(&|s| pct(&s.applied)),
        ));
        rows.push((
            "ack → Applied (status back)".into(),
            sides(&|s| pct(&s.status_lag)),
        ));
        for (i, mib) in LARGE_WORKS_MIB.iter().enumerate() {
            rows.push((
                format!("{mib} MiB work create → Applied"),
                sides(&|s| match s.large.get(i) {
                    Some(LargeWork {
                        refused: Some(e), ..
                    }) => format!("refused: {e}"),
                    Some(w) => secs(w.applied_s),
                    None => "-".into(),
                }),
            ));
        }
        rows.push((
            "idle bytes per cluster per hour".into(),
            sides(&|s| {
                s.idle_bytes_per_cluster_hour
                    .map_or_else(|| "-".into(), |b| format!("{:.1} KiB", b / 1024.0))
            }),
        ));
        if self.sides.iter().any(|s| s.flap.is_some()) {
            rows.push((
                "sessions through one outage: kept / ended and back / not back".into(),
                sides(&|s| match &s.flap {
                    Some(f) => format!(
                        "{} / {} (p50 {} max {} after the link) / {}",
                        f.kept,
                        f.back,
                        secs(f.back_p50_s),
                        secs(f.back_max_s),
                        f.not_back
                    ),
                    None => "-".into(),
                }),
            ));
            rows.push((
                "work made as the link comes back: → ack, → Applied p50/max".into(),
                sides(&|s| match &s.flap {
                    Some(f) => {
                        let pm = |p: &Option<Percentiles>| {
                            p.as_ref().filter(|p| p.count > 0).map_or_else(
                                || "-".into(),
                                |p| format!("{:.0}/{:.0} ms", p.p50_ms, p.max_ms),
                            )
                        };
                        format!(
                            "{}, {}; {} within {:.2} s",
                            pm(&f.after_up_ack),
                            pm(&f.after_up_applied),
                            f.after_up_within_bound,
                            f.bound_s
                        )
                    }
                    None => "-".into(),
                }),
            ));
        }
        rows.push((
            "kubectl small GET p50/p99".into(),
            sides(&|s| pct(&s.kubectl_get)),
        ));
        rows.push((
            "kubectl list of 5,000 ConfigMaps".into(),
            sides(&|s| match (s.kubectl_list_s, s.kubectl_list_bytes) {
                (Some(t), Some(b)) => format!("{t:.2} s ({:.1} MiB)", b as f64 / 1048576.0),
                _ => "-".into(),
            }),
        ));
        rows.push((
            "Unknown marks (wrong)".into(),
            sides(&|s| match (s.unknown_marks, s.wrong_unknown) {
                (Some(m), Some(w)) => format!("{m} ({w})"),
                _ => "-".into(),
            }),
        ));
        if let Some(a) = &self.statuses {
            rows.push((
                "statuses (flotilla): compared / lost / twice / unacked".into(),
                format!(
                    "{} / {} / {} / {}",
                    a.compared, a.lost, a.duplicated, a.unacked
                ),
            ));
        }
        for s in &self.sides {
            for n in &s.notes {
                rows.push((format!("{} note", s.side), n.clone()));
            }
        }
        rows
    }
}
