//! [`ShardOwner`]: which shard leases this gateway claims, renews and releases, decided from
//! the leases it observed and the time, with no IO (the driver in `leasing` lists and writes).
//!
//! Expiry never compares the apiserver's `renewTime` with the local clock (clocks differ
//! between hosts). As client-go's leader election does, a reader notes *when it saw* a lease
//! change (holder, renewTime or resourceVersion) and counts it expired once it has seen no
//! change for the lease's duration. The holder is stricter with itself: it counts a lease as
//! its own only until `duration - margin` after it *sent* the write that claimed or renewed it.
//! Since every reader sees that write after it was sent, a holder stops acting before anyone
//! else may claim, and at no instant do two gateways act as owner of one shard.
//!
//! A renewal that comes late (a round slower than the margin on a loaded machine or a slow
//! store) does not lose the shard by itself: past its fence the gateway stops acting for it
//! (the shard is *lapsed*: no writes, no new sessions, its sessions kept), and the next round
//! renews it on the resourceVersion it observed. That write succeeds only if nobody wrote the
//! lease since, so nobody else has claimed it and acted meanwhile; then the gateway acts again
//! at the same epoch. A lease found naming another holder or epoch, a renewal that conflicts,
//! or a lapse longer than a lease duration loses it (and its sessions are drained). Likewise a
//! gateway restarted under its name takes the shards its leases still name at once (with a new
//! epoch) instead of waiting for them to expire: names are unique, so the process that held
//! them is gone.
//!
//! Fair share: with `n` live gateways (their own leases seen renewed within the duration)
//! each claims up to `ceil(shards / n)`; one holding more releases the excess (handover).
//! Each gateway prefers shards in its own rotation of the shard numbers, so gateways starting
//! together do not all race for shard 0.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use flotilla_proto::contract::{
    LEASE_ROLE_GATEWAY, LEASE_ROLE_SHARD, gateway_lease_name, shard_lease_name, shard_of_lease,
};
use flotilla_store::leases::LeaseRecord;
use tokio::time::Instant;

use super::view::{DirectoryEntry, Fence, ShardDirectory};

/// What a gateway is told about itself and the fleet's shards.
#[derive(Clone, Debug)]
pub struct OwnerConfig {
    /// This gateway's name: the holder identity written in its leases. Unique in the fleet.
    pub name: String,
    /// host:port agents dial to reach this gateway (redirects name it).
    pub address: String,
    /// Virtual shards of the fleet (the same on every hub and gateway).
    pub shards: u32,
    /// How long a lease stays valid without renewal.
    pub lease_duration: Duration,
    /// How often leases are read and renewed; at most a third of the duration, so one failed
    /// renewal does not lose the shards.
    pub renew_period: Duration,
    /// `false` for a reader that never claims nor announces itself (the hub in scale-out mode,
    /// which only routes by the directory).
    pub claims: bool,
}

/// Why a lease is written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Intent {
    /// The gateway's own lease: it is alive, and where to reach it.
    Announce,
    /// Take a shard that is free, released or expired (bumps the epoch).
    Claim(u32),
    /// Keep a held shard.
    Renew(u32),
    /// Give a shard up for another gateway to take (after draining its sessions).
    Release(u32),
    /// Clear the gateway's own lease (shutdown): it no longer counts as live.
    Withdraw,
}

/// One lease write the driver is to make, then report with [`ShardOwner::written`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseWrite {
    pub intent: Intent,
    /// The lease as it is to be stored; its resourceVersion is the precondition (`None`:
    /// create).
    pub record: LeaseRecord,
}

/// How a write went, as the machine needs to know it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WriteOutcome {
    /// Stored; the lease as the apiserver returned it.
    Stored(LeaseRecord),
    /// Someone else wrote the lease first: for a renewal, the shard is lost.
    Conflict,
    /// The apiserver did not answer: nothing is known; a held shard stays held until its
    /// validity runs out.
    Failed,
}

/// A lease as last observed, and when this process saw it change.
#[derive(Clone, Debug)]
struct Seen {
    record: LeaseRecord,
    changed_at: Instant,
}

impl Seen {
    fn expired(&self, now: Instant) -> bool {
        self.record.holder().is_none() || now >= self.changed_at + self.record.duration
    }
}

/// The claim/renew/release decisions of one gateway.
#[derive(Debug)]
pub struct ShardOwner {
    config: OwnerConfig,
    seen: HashMap<String, Seen>,
    held: BTreeMap<u32, Fence>,
    /// Shards being handed over: no longer acted for, not yet released.
    releasing: BTreeSet<u32>,
    /// When this gateway's own lease was first stored.
    announced_at: Option<Instant>,
    /// Whether a lease list read after that has been observed: only then does this gateway
    /// claim shards no lease names it for, so gateways starting together (each announcing in
    /// its first round) see each other before dividing the shards. Shards whose leases still
    /// name it (it restarted under its name) it takes back in its first round.
    settled: bool,
}

impl ShardOwner {
    pub fn new(config: OwnerConfig) -> ShardOwner {
        ShardOwner {
            config,
            seen: HashMap::new(),
            held: BTreeMap::new(),
            releasing: BTreeSet::new(),
            announced_at: None,
            settled: false,
        }
    }

    pub fn config(&self) -> &OwnerConfig {
        &self.config
    }

    /// Safety margin on the holder's own validity: room for clock-rate differences.
    fn margin(&self) -> Duration {
        self.config.lease_duration / 5
    }

    /// Takes in every flotilla lease as listed at `now`. A held shard whose lease now names
    /// another holder or another epoch is lost at once.
    pub fn observe(&mut self, now: Instant, records: Vec<LeaseRecord>) {
        let mut fresh = HashMap::with_capacity(records.len());
        for record in records {
            let changed_at = match self.seen.get(&record.name) {
                Some(seen)
                    if seen.record.holder == record.holder
                        && seen.record.renewed == record.renewed
                        && seen.record.resource_version == record.resource_version =>
                {
                    seen.changed_at
                }
                _ => now,
            };
            fresh.insert(record.name.clone(), Seen { record, changed_at });
        }
        self.seen = fresh;
        self.settled |= self.announced_at.is_some();
        let me = self.config.name.clone();
        self.held.retain(|shard, fence| {
            self.seen.get(&shard_lease_name(*shard)).is_some_and(|s| {
                s.record.holder() == Some(me.as_str()) && s.record.transitions == fence.epoch
            })
        });
        self.expire(now);
    }

    /// Drops held shards whose validity ran out a lease duration ago (renewals failed all that
    /// time). A shard past its fence but not that far is lapsed: not acted for, renewed by the
    /// next round if its lease is still this gateway's.
    pub fn expire(&mut self, now: Instant) {
        let grace = self.config.lease_duration;
        self.held.retain(|_, fence| now < fence.valid_until + grace);
    }

    /// Gateways alive at `now` (their own leases renewed within the duration), this one
    /// included when it claims.
    fn live_gateways(&self, now: Instant) -> usize {
        let others = self
            .seen
            .values()
            .filter(|s| s.record.role == LEASE_ROLE_GATEWAY && !s.expired(now))
            .filter(|s| s.record.holder() != Some(self.config.name.as_str()))
            .count();
        others + usize::from(self.config.claims)
    }

    /// This gateway's preference for `shard` (lower first): the shard numbers rotated by a
    /// hash of its name.
    fn rank(&self, shard: u32) -> u32 {
        let shards = self.config.shards.max(1);
        let offset = flotilla_proto::contract::shard_of(&self.config.name, shards);
        (shard + shards - offset) % shards
    }

    /// The writes due at `now`: the announcement, renewals of held shards, releases of the
    /// excess over the fair share, claims up to it. Shards to release stop being held at once.
    pub fn plan(&mut self, now: Instant) -> Vec<LeaseWrite> {
        if !self.config.claims {
            return Vec::new();
        }
        let me = self.config.name.clone();
        let mut writes = vec![LeaseWrite {
            intent: Intent::Announce,
            record: self.next_record(
                &gateway_lease_name(&me),
                LEASE_ROLE_GATEWAY,
                false,
                Some(self.config.address.clone()),
            ),
        }];
        let shards = self.config.shards.max(1) as usize;
        let fair = shards.div_ceil(self.live_gateways(now).max(1));

        // Release the excess, least preferred first.
        let mut by_rank: Vec<u32> = self.held.keys().copied().collect();
        by_rank.sort_by_key(|s| std::cmp::Reverse(self.rank(*s)));
        for shard in by_rank
            .into_iter()
            .take(self.held.len().saturating_sub(fair))
        {
            self.held.remove(&shard);
            self.releasing.insert(shard);
            let mut record =
                self.next_record(&shard_lease_name(shard), LEASE_ROLE_SHARD, false, None);
            record.holder = None;
            writes.push(LeaseWrite {
                intent: Intent::Release(shard),
                record,
            });
        }
        for &shard in self.held.keys() {
            writes.push(LeaseWrite {
                intent: Intent::Renew(shard),
                record: self.next_record(&shard_lease_name(shard), LEASE_ROLE_SHARD, false, None),
            });
        }

        if self.held.len() < fair {
            let mine = Some(self.config.name.as_str());
            let mut free: Vec<u32> = (0..self.config.shards.max(1))
                .filter(|s| !self.held.contains_key(s) && !self.releasing.contains(s))
                .filter(|s| match self.seen.get(&shard_lease_name(*s)) {
                    // Still naming this gateway from before a restart: at once.
                    Some(seen) if seen.record.holder() == mine => true,
                    Some(seen) => self.settled && seen.expired(now),
                    None => self.settled,
                })
                .collect();
            free.sort_by_key(|s| self.rank(*s));
            for shard in free.into_iter().take(fair - self.held.len()) {
                writes.push(LeaseWrite {
                    intent: Intent::Claim(shard),
                    record: self.next_record(
                        &shard_lease_name(shard),
                        LEASE_ROLE_SHARD,
                        true,
                        None,
                    ),
                });
            }
        }
        writes
    }

    /// Gives up every held shard (shutdown): they stop being held now; the writes release
    /// them, and withdraw this gateway's own lease so the others count it gone at once (and
    /// take its shards into their fair shares).
    pub fn release_all(&mut self) -> Vec<LeaseWrite> {
        let mut withdraw = self.next_record(
            &gateway_lease_name(&self.config.name),
            LEASE_ROLE_GATEWAY,
            false,
            Some(self.config.address.clone()),
        );
        withdraw.holder = None;
        let held: Vec<u32> = std::mem::take(&mut self.held).into_keys().collect();
        let releases: Vec<LeaseWrite> = held
            .into_iter()
            .map(|shard| {
                self.releasing.insert(shard);
                let mut record =
                    self.next_record(&shard_lease_name(shard), LEASE_ROLE_SHARD, false, None);
                record.holder = None;
                LeaseWrite {
                    intent: Intent::Release(shard),
                    record,
                }
            })
            .collect();
        let mut writes = releases;
        if self.config.claims {
            writes.push(LeaseWrite {
                intent: Intent::Withdraw,
                record: withdraw,
            });
        }
        writes
    }

    /// The record to write for lease `name`: held by this gateway, on the observed
    /// resourceVersion, with the epoch bumped for a claim.
    fn next_record(
        &self,
        name: &str,
        role: &str,
        claim: bool,
        address: Option<String>,
    ) -> LeaseRecord {
        let seen = self.seen.get(name).map(|s| &s.record);
        let transitions = seen.map_or(0, |r| r.transitions);
        LeaseRecord {
            name: name.to_string(),
            role: role.to_string(),
            holder: Some(self.config.name.clone()),
            duration: self.config.lease_duration,
            transitions: if claim { transitions + 1 } else { transitions },
            renewed: seen.and_then(|r| r.renewed.clone()),
            resource_version: seen.and_then(|r| r.resource_version.clone()),
            address,
        }
    }

    /// How `write`, sent at `sent_at`, went.
    pub fn written(&mut self, write: &LeaseWrite, outcome: WriteOutcome, sent_at: Instant) {
        let valid_until = sent_at + self.config.lease_duration.saturating_sub(self.margin());
        if let WriteOutcome::Stored(record) = &outcome {
            self.seen.insert(
                record.name.clone(),
                Seen {
                    record: record.clone(),
                    changed_at: sent_at,
                },
            );
        }
        match (write.intent, outcome) {
            (Intent::Announce, WriteOutcome::Stored(_)) => {
                self.announced_at.get_or_insert(sent_at);
            }
            (Intent::Claim(shard) | Intent::Renew(shard), WriteOutcome::Stored(record)) => {
                self.held.insert(
                    shard,
                    Fence {
                        epoch: record.transitions,
                        valid_until,
                    },
                );
            }
            (Intent::Renew(shard), WriteOutcome::Conflict) => {
                self.held.remove(&shard);
            }
            (Intent::Release(shard), _) => {
                self.releasing.remove(&shard);
            }
            _ => {}
        }
    }

    /// The shards this gateway may act for, with their fences.
    pub fn fences(&self) -> BTreeMap<u32, Fence> {
        self.held.clone()
    }

    /// Who owns which shard as observed at `now`, with their advertised addresses.
    pub fn directory(&self, now: Instant) -> ShardDirectory {
        let addresses: HashMap<&str, &str> = self
            .seen
            .values()
            .filter(|s| s.record.role == LEASE_ROLE_GATEWAY && !s.expired(now))
            .filter_map(|s| Some((s.record.holder()?, s.record.address.as_deref()?)))
            .collect();
        let mut entries = BTreeMap::new();
        for seen in self.seen.values() {
            let Some(shard) = shard_of_lease(&seen.record.name) else {
                continue;
            };
            if seen.expired(now) {
                continue;
            }
            let Some(owner) = seen.record.holder() else {
                continue;
            };
            entries.insert(
                shard,
                DirectoryEntry {
                    owner: owner.to_string(),
                    address: addresses.get(owner).map(|a| a.to_string()),
                    epoch: seen.record.transitions,
                },
            );
        }
        ShardDirectory::new(self.config.shards, entries)
    }
}

#[cfg(test)]
mod tests {
    //! The decisions on paused time: fair shares, expiry by observation, fencing by the
    //! holder's own send time, handover.

    use super::*;

    const DURATION: Duration = Duration::from_secs(15);
    const RENEW: Duration = Duration::from_secs(5);

    fn config(name: &str, shards: u32) -> OwnerConfig {
        OwnerConfig {
            name: name.into(),
            address: format!("{name}:9443"),
            shards,
            lease_duration: DURATION,
            renew_period: RENEW,
            claims: true,
        }
    }

    /// A shared in-memory lease table with the apiserver's precondition rule, so machines can
    /// race on it.
    #[derive(Default)]
    struct Table {
        leases: BTreeMap<String, LeaseRecord>,
        version: u64,
    }

    impl Table {
        fn write(&mut self, mut record: LeaseRecord, now: Instant) -> WriteOutcome {
            let current = self.leases.get(&record.name);
            if current.and_then(|c| c.resource_version.clone()) != record.resource_version {
                return WriteOutcome::Conflict;
            }
            self.version += 1;
            record.resource_version = Some(self.version.to_string());
            record.renewed = record.holder.as_ref().map(|_| format!("{now:?}"));
            self.leases.insert(record.name.clone(), record.clone());
            WriteOutcome::Stored(record)
        }

        /// One renewal round of `owner` at `now`: list, plan, write.
        fn round(&mut self, owner: &mut ShardOwner, now: Instant) {
            owner.observe(now, self.leases.values().cloned().collect());
            for write in owner.plan(now) {
                let outcome = self.write(write.record.clone(), now);
                owner.written(&write, outcome, now);
            }
        }

        fn holders(&self) -> BTreeMap<u32, String> {
            self.leases
                .values()
                .filter_map(|r| Some((shard_of_lease(&r.name)?, r.holder()?.to_string())))
                .collect()
        }
    }

    #[tokio::test(start_paused = true)]
    async fn gateways_divide_the_shards_fairly_and_take_over_a_dead_ones() {
        let mut table = Table::default();
        let mut gws: Vec<ShardOwner> = ["a", "b", "c"]
            .into_iter()
            .map(|n| ShardOwner::new(config(n, 64)))
            .collect();
        for _ in 0..6 {
            let now = Instant::now();
            for gw in &mut gws {
                table.round(gw, now);
            }
            tokio::time::advance(RENEW).await;
        }
        let counts: Vec<usize> = gws.iter().map(|g| g.fences().len()).collect();
        assert_eq!(
            counts.iter().sum::<usize>(),
            64,
            "every shard owned: {counts:?}"
        );
        assert!(counts.iter().all(|&c| c <= 22), "fair shares: {counts:?}");
        assert_eq!(table.holders().len(), 64);

        // c dies (stops renewing). Until its leases expire nobody takes them; then a and b
        // share all 64, each claim bumping the epoch.
        let c_shards: Vec<u32> = gws[2].fences().keys().copied().collect();
        let c_epochs: Vec<u32> = c_shards
            .iter()
            .map(|s| table.leases[&shard_lease_name(*s)].transitions)
            .collect();
        gws.truncate(2);
        let died = Instant::now();
        while Instant::now() < died + DURATION * 3 {
            let now = Instant::now();
            for gw in &mut gws {
                table.round(gw, now);
            }
            let owners = table.holders();
            if now < died + DURATION {
                assert!(
                    c_shards.iter().all(|s| owners[s] == "c"),
                    "taken before expiry"
                );
            }
            tokio::time::advance(RENEW).await;
        }
        let fences: Vec<_> = gws.iter().map(|g| g.fences()).collect();
        assert_eq!(fences[0].len() + fences[1].len(), 64);
        for (s, old) in c_shards.iter().zip(c_epochs) {
            let epoch = fences.iter().find_map(|f| f.get(s)).expect("taken").epoch;
            assert_eq!(epoch, old + 1, "shard {s}: one owner change, one epoch");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_holder_stops_acting_before_anyone_else_may_claim() {
        let mut table = Table::default();
        let mut a = ShardOwner::new(config("a", 4));
        for _ in 0..3 {
            table.round(&mut a, Instant::now());
            tokio::time::advance(RENEW).await;
        }
        assert_eq!(a.fences().len(), 4);
        let last_renewal = Instant::now() - RENEW;
        // a is cut off from the apiserver; b keeps reading. b may claim only after the
        // duration since it saw the last renewal; a's fences end before that.
        let mut b = ShardOwner::new(config("b", 4));
        let mut claimed_at = None;
        for _ in 0..30 {
            let now = Instant::now();
            table.round(&mut b, now);
            a.expire(now);
            let a_acts = a.fences().values().any(|f| now < f.valid_until);
            if !b.fences().is_empty() {
                claimed_at.get_or_insert(now);
                assert!(!a_acts, "two owners at {:?}", now - last_renewal);
            }
            tokio::time::advance(Duration::from_secs(1)).await;
        }
        assert!(claimed_at.is_some(), "b took over");
        assert!(a.fences().is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn a_late_renewal_resumes_the_shard_at_its_epoch_unless_another_took_it() {
        let mut table = Table::default();
        let mut a = ShardOwner::new(config("a", 2));
        for _ in 0..3 {
            table.round(&mut a, Instant::now());
            tokio::time::advance(RENEW).await;
        }
        let before = a.fences();
        assert_eq!(before.len(), 2);
        // The next round comes long after the fences ran out (a stalled process), but before
        // anyone took the leases: a stops acting meanwhile, then resumes at the same epochs.
        tokio::time::advance(DURATION).await;
        let now = Instant::now();
        assert!(a.fences().values().all(|f| now >= f.valid_until), "lapsed");
        table.round(&mut a, now);
        let after = a.fences();
        assert_eq!(
            after.iter().map(|(s, f)| (*s, f.epoch)).collect::<Vec<_>>(),
            before
                .iter()
                .map(|(s, f)| (*s, f.epoch))
                .collect::<Vec<_>>(),
        );
        assert!(after.values().all(|f| now < f.valid_until), "acting again");

        // Stalled again; this time b takes the leases once they expired for it: a's late
        // renewal conflicts, and a holds nothing.
        let mut b = ShardOwner::new(config("b", 2));
        let stalled = Instant::now();
        while Instant::now() < stalled + DURATION * 2 {
            table.round(&mut b, Instant::now());
            tokio::time::advance(RENEW).await;
        }
        assert_eq!(b.fences().len(), 2, "b took both");
        table.round(&mut a, Instant::now());
        let now = Instant::now();
        assert!(
            a.fences().values().all(|f| now >= f.valid_until),
            "a never acts again for b's shards"
        );
        table.round(&mut a, Instant::now());
        assert!(a.fences().is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn a_gateway_restarted_under_its_name_takes_its_shards_back_at_once() {
        let mut table = Table::default();
        let mut a = ShardOwner::new(config("a", 4));
        for _ in 0..3 {
            table.round(&mut a, Instant::now());
            tokio::time::advance(RENEW).await;
        }
        let epochs: BTreeMap<u32, u32> =
            a.fences().into_iter().map(|(s, f)| (s, f.epoch)).collect();
        assert_eq!(epochs.len(), 4);
        // Killed and started again at once: a new machine with the same name.
        let mut a = ShardOwner::new(config("a", 4));
        table.round(&mut a, Instant::now());
        assert_eq!(
            a.fences().len(),
            4,
            "taken back in its first round, long before its old leases expire"
        );
        for (s, f) in a.fences() {
            assert_eq!(f.epoch, epochs[&s] + 1, "a new epoch for the new process");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn two_claimers_of_one_lease_cannot_both_win() {
        let mut table = Table::default();
        let mut a = ShardOwner::new(config("a", 1));
        let mut b = ShardOwner::new(config("b", 1));
        // Both announced a period ago and read the same table.
        for gw in [&mut a, &mut b] {
            table.round(gw, Instant::now());
        }
        tokio::time::advance(RENEW).await;
        let now = Instant::now();
        a.observe(now, table.leases.values().cloned().collect());
        b.observe(now, table.leases.values().cloned().collect());
        let (wa, wb) = (a.plan(now), b.plan(now));
        for (gw, writes) in [(&mut a, wa), (&mut b, wb)] {
            for w in writes {
                let outcome = table.write(w.record.clone(), now);
                gw.written(&w, outcome, now);
            }
        }
        assert_eq!(a.fences().len() + b.fences().len(), 1, "exactly one owner");
    }

    #[tokio::test(start_paused = true)]
    async fn a_joining_gateway_gets_its_share_through_releases() {
        let mut table = Table::default();
        let mut a = ShardOwner::new(config("a", 8));
        for _ in 0..3 {
            table.round(&mut a, Instant::now());
            tokio::time::advance(RENEW).await;
        }
        assert_eq!(a.fences().len(), 8);
        let mut b = ShardOwner::new(config("b", 8));
        let mut released = Vec::new();
        for _ in 0..4 {
            let now = Instant::now();
            table.round(&mut b, now);
            a.observe(now, table.leases.values().cloned().collect());
            for w in a.plan(now) {
                if let Intent::Release(s) = w.intent {
                    // Released shards stop being acted for before the write goes out.
                    assert!(!a.fences().contains_key(&s));
                    released.push(s);
                }
                let outcome = table.write(w.record.clone(), now);
                a.written(&w, outcome, now);
            }
            tokio::time::advance(RENEW).await;
        }
        assert_eq!(released.len(), 4);
        assert_eq!((a.fences().len(), b.fences().len()), (4, 4));
        let directory = b.directory(Instant::now());
        for s in 0..8 {
            let entry = directory.owner(s).expect("owned");
            assert_eq!(
                entry.address.as_deref(),
                Some(&*format!("{}:9443", entry.owner))
            );
        }
    }
}
