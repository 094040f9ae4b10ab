//! Shard leases on the real kube-apiserver: gateways divide the shards, a claim races only
//! one winner through resourceVersion preconditions, and a dead gateway's shards move to the
//! live ones with their epochs bumped. Lease rounds are driven by hand (list, plan, write)
//! exactly as the lease driver makes them.

use std::time::Duration;

use flotilla_gateway::shards::owner::{Intent, LeaseWrite, WriteOutcome};
use flotilla_gateway::shards::{OwnerConfig, ShardOwner};
use flotilla_proto::contract::{shard_lease_name, shard_of_lease};
use flotilla_store::leases::{KubeLeases, LeaseError};
use flotilla_testenv::TestEnv;
use tokio::time::Instant;

const DURATION: Duration = Duration::from_secs(3);
const RENEW: Duration = Duration::from_secs(1);
const SHARDS: u32 = 8;

fn owner(name: &str) -> ShardOwner {
    ShardOwner::new(OwnerConfig {
        name: name.into(),
        address: format!("{name}.gateways:9443"),
        shards: SHARDS,
        lease_duration: DURATION,
        renew_period: RENEW,
        claims: true,
    })
}

/// One lease round of `gw`: list, plan, write, report.
async fn round(leases: &KubeLeases, gw: &mut ShardOwner) -> anyhow::Result<()> {
    let now = Instant::now();
    gw.observe(now, leases.list().await?);
    for w in gw.plan(now) {
        let outcome = write(leases, &w).await;
        gw.written(&w, outcome, now);
    }
    Ok(())
}

async fn write(leases: &KubeLeases, w: &LeaseWrite) -> WriteOutcome {
    match leases
        .write(&w.record, matches!(w.intent, Intent::Claim(_)))
        .await
    {
        Ok(r) => WriteOutcome::Stored(r),
        Err(LeaseError::Conflict { .. }) => WriteOutcome::Conflict,
        Err(_) => WriteOutcome::Failed,
    }
}

/// shard -> (holder, epoch) as stored.
async fn stored(leases: &KubeLeases) -> anyhow::Result<Vec<(u32, String, u32)>> {
    let mut out: Vec<_> = leases
        .list()
        .await?
        .into_iter()
        .filter_map(|r| {
            let shard = shard_of_lease(&r.name)?;
            Some((shard, r.holder()?.to_string(), r.transitions))
        })
        .collect();
    out.sort();
    Ok(out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shard_leases_on_a_real_apiserver() -> anyhow::Result<()> {
    let env = TestEnv::start().await?;
    let leases = KubeLeases::new(env.client().await?, "flotilla-system");
    leases.ensure_namespace().await;

    // Two gateways divide eight shards, four each.
    let (mut a, mut b) = (owner("a"), owner("b"));
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        round(&leases, &mut a).await?;
        round(&leases, &mut b).await?;
        if a.fences().len() == 4 && b.fences().len() == 4 {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "no fair split: a {:?}, b {:?}",
            a.fences(),
            b.fences()
        );
        tokio::time::sleep(RENEW).await;
    }
    let owners = stored(&leases).await?;
    assert_eq!(owners.len(), 8);
    for (shard, holder, epoch) in &owners {
        let fences = if holder == "a" {
            a.fences()
        } else {
            b.fences()
        };
        assert_eq!(
            fences[shard].epoch, *epoch,
            "shard {shard}: the held epoch is the stored one"
        );
    }
    // The directory, as any reader derives it, names each owner and its address.
    let directory = b.directory(Instant::now());
    for (shard, holder, _) in &owners {
        let entry = directory.owner(*shard).expect("owned");
        assert_eq!(&entry.owner, holder);
        assert_eq!(
            entry.address.as_deref(),
            Some(&*format!("{holder}.gateways:9443"))
        );
    }

    // Two writes decided on the same resourceVersion: the apiserver lets exactly one through.
    let lease = leases
        .list()
        .await?
        .into_iter()
        .find(|r| r.name == shard_lease_name(0))
        .expect("shard 0's lease");
    let mut first = lease.clone();
    first.holder = Some("x".into());
    first.transitions += 1;
    let mut second = lease.clone();
    second.holder = Some("y".into());
    second.transitions += 1;
    let (r1, r2) = tokio::join!(leases.write(&first, true), leases.write(&second, true));
    let wins = [&r1, &r2].iter().filter(|r| r.is_ok()).count();
    assert_eq!(wins, 1, "{r1:?} / {r2:?}");
    assert!(
        [&r1, &r2]
            .iter()
            .any(|r| matches!(r, Err(LeaseError::Conflict { .. }))),
        "the loser is told it lost"
    );
    // The holder of shard 0 notices at its next round and stops acting for it.
    let holder0 = owners[0].1.clone();
    let gw = if holder0 == "a" { &mut a } else { &mut b };
    round(&leases, gw).await?;
    assert!(
        !gw.fences().contains_key(&0),
        "shard 0 lost to the stolen write"
    );

    // b dies (stops renewing). Within the lease duration and a few rounds, a holds all eight
    // (the stolen shard 0 too, once "x"/"y" stop renewing), each taken shard's epoch bumped.
    let before = stored(&leases).await?;
    let deadline = Instant::now() + DURATION * 6;
    loop {
        round(&leases, &mut a).await?;
        if a.fences().len() == 8 {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "a never took over: {:?}",
            a.fences()
        );
        tokio::time::sleep(RENEW).await;
    }
    for (shard, holder, epoch) in before {
        if holder != "a" {
            assert_eq!(a.fences()[&shard].epoch, epoch + 1, "shard {shard}");
        }
    }
    Ok(())
}
