//! The database's records, transactions and files: what survives a reopen, what a second
//! opener or a foreign file gets, how clusters in one database stay apart.

use super::super::test_support::{deployment, work};
use super::*;
use serde_json::json;

#[test]
fn works_round_trip_with_content_and_show_in_the_hello() {
    let db = CacheDb::temporary().unwrap();
    let cache = db.cluster("store-7");
    cache
        .put_work(&work("a", 1), Some(br#"{"kind":"ManifestWork"}"#))
        .unwrap();
    let mut refused = work("b", 4);
    refused.refused = Some("too big".into());
    cache.put_work(&refused, None).unwrap();

    assert_eq!(cache.work("a").unwrap(), Some(work("a", 1)));
    assert_eq!(
        cache.manifest_work("a").unwrap().unwrap(),
        br#"{"kind":"ManifestWork"}"#
    );
    assert_eq!(cache.manifest_work("b").unwrap(), None);
    assert_eq!(cache.works().unwrap().len(), 2);
    let held = cache.held().unwrap();
    assert_eq!(held.len(), 2);
    assert_eq!((held[1].uid.as_str(), held[1].generation), ("b", 4));

    // A newer generation replaces the old one, content included.
    cache.put_work(&work("a", 2), Some(b"{}")).unwrap();
    assert_eq!(cache.work("a").unwrap().unwrap().generation, 2);
    assert_eq!(cache.manifest_work("a").unwrap().unwrap(), b"{}");
}

#[test]
fn tombstones_leave_the_hello_and_forget_drops_everything() {
    let db = CacheDb::temporary().unwrap();
    let cache = db.cluster("c");
    cache.put_work(&work("a", 1), Some(b"{}")).unwrap();
    cache.set_ledger("a", &[deployment("web")]).unwrap();
    cache.push_status("a", 1, &json!({"x": 1})).unwrap();

    assert!(cache.mark_deleting("a").unwrap());
    assert!(!cache.mark_deleting("nope").unwrap());
    assert!(cache.work("a").unwrap().unwrap().deleting);
    assert!(cache.held().unwrap().is_empty(), "a tombstone is not held");
    assert_eq!(
        cache.ledger("a").unwrap(),
        vec![deployment("web")],
        "ledger kept for cleanup"
    );

    cache.forget("a").unwrap();
    assert_eq!(cache.work("a").unwrap(), None);
    assert_eq!(cache.manifest_work("a").unwrap(), None);
    assert!(cache.ledger("a").unwrap().is_empty());
    assert_eq!(cache.last_status("a").unwrap(), None);
    assert!(cache.pending_statuses().unwrap().is_empty());
}

#[test]
fn a_release_forgets_the_work_and_stays_in_the_outbox_across_a_restart_until_acked() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cache.redb");
    {
        let db = CacheDb::open(&path).unwrap();
        let cache = db.cluster("c");
        cache.put_work(&work("a", 1), Some(b"{}")).unwrap();
        cache.put_work(&work("b", 1), Some(b"{}")).unwrap();
        cache.set_ledger("a", &[deployment("web")]).unwrap();
        cache.push_status("a", 1, &json!({"x": 1})).unwrap();
        cache.mark_deleting("a").unwrap();
        cache.mark_deleting("b").unwrap();
        assert_eq!(
            cache.releasing().unwrap(),
            ["a", "b"],
            "tombstones are releasing"
        );

        cache.release("a").unwrap();
        assert_eq!(cache.work("a").unwrap(), None);
        assert!(cache.ledger("a").unwrap().is_empty());
        assert!(cache.pending_statuses().unwrap().is_empty());
        // A delete for a work never held is released too: the hub must still hear it.
        cache.release("never-held").unwrap();
        assert_eq!(cache.pending_releases().unwrap(), ["a", "never-held"]);
        // The other cluster of the same database sees none of it.
        assert!(db.cluster("d").pending_releases().unwrap().is_empty());
    }
    let db = CacheDb::open(&path).unwrap();
    let cache = db.cluster("c");
    assert_eq!(cache.releasing().unwrap(), ["b", "a", "never-held"]);
    cache.ack_release("a").unwrap();
    cache.ack_release("never-held").unwrap();
    assert!(cache.pending_releases().unwrap().is_empty());
    assert_eq!(cache.releasing().unwrap(), ["b"]);
}

#[test]
fn everything_survives_reopening() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("agent").join("cache.redb");
    let reopen = || CacheDb::open(&path).expect("reopening the cache");
    let first;
    {
        let db = CacheDb::open(&path).unwrap();
        let cache = db.cluster("store-7");
        cache.put_work(&work("a", 3), Some(b"{}")).unwrap();
        cache.set_ledger("a", &[deployment("web")]).unwrap();
        first = cache.push_status("a", 3, &json!({"n": 1})).unwrap();
        assert_eq!(
            cache.push_status("a", 3, &json!({"n": 2})).unwrap(),
            first + 1
        );
    }
    let db = reopen();
    let cache = db.cluster("store-7");
    assert_eq!(cache.work("a").unwrap(), Some(work("a", 3)));
    assert_eq!(cache.ledger("a").unwrap(), vec![deployment("web")]);
    let pending = cache.pending_statuses().unwrap();
    assert_eq!(pending.len(), 1);
    assert_eq!((pending[0].seq, pending[0].generation), (first + 1, 3));
    assert_eq!(pending[0].status_json, br#"{"n":2}"#);
    // The seq keeps counting from where it was, even after the hub acked everything.
    assert!(cache.ack_status("a", first + 1).unwrap());
    drop(cache);
    drop(db);
    let db = reopen();
    let cache = db.cluster("store-7");
    assert!(cache.pending_statuses().unwrap().is_empty());
    assert_eq!(
        cache.push_status("a", 4, &json!({"n": 3})).unwrap(),
        first + 2
    );
}

#[test]
fn batches_store_push_and_ack_as_their_single_calls_do_and_survive_reopening() {
    for mode in [CommitMode::PerWrite, CommitMode::Group] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cache.redb");
        let seqs;
        {
            let db = CacheDb::open_with(&path, mode).unwrap();
            let cache = db.cluster("store-7");
            cache
                .put_works(&[
                    (work("a", 1), Some(b"{}".to_vec())),
                    (work("b", 2), Some(br#"{"b":2}"#.to_vec())),
                ])
                .unwrap();
            let first = cache.push_status("a", 1, &json!({"n": 0})).unwrap();
            seqs = cache
                .push_statuses(vec![
                    ("a".into(), 1, json!({"n": 1})),
                    ("b".into(), 2, json!({"n": 1})),
                    ("a".into(), 1, json!({"n": 2})),
                ])
                .unwrap();
            // Per work, each the previous + 1, in the order given.
            assert_eq!(seqs[0], first + 1, "{mode:?}");
            assert_eq!(seqs[2], first + 2, "{mode:?}");
            // a's latest acked, b's an older seq than its own: a leaves the outbox, b stays;
            // an ack of a work never reported says so.
            assert_eq!(
                cache
                    .ack_statuses(&[
                        ("a".into(), seqs[2]),
                        ("b".into(), seqs[1] - 1),
                        ("c".into(), 1),
                    ])
                    .unwrap(),
                [true, false, false],
                "{mode:?}"
            );
        }
        let db = CacheDb::open(&path).unwrap();
        let cache = db.cluster("store-7");
        assert_eq!(cache.work("b").unwrap(), Some(work("b", 2)), "{mode:?}");
        assert_eq!(cache.manifest_work("b").unwrap().unwrap(), br#"{"b":2}"#);
        let pending = cache.pending_statuses().unwrap();
        assert_eq!(pending.len(), 1, "{mode:?}: {pending:?}");
        assert_eq!((pending[0].uid.as_str(), pending[0].seq), ("b", seqs[1]));
    }
}

#[test]
fn a_second_opener_of_the_same_file_is_refused_with_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cache.redb");
    let _first = CacheDb::open(&path).unwrap();
    let err = CacheDb::open(&path).unwrap_err();
    let message = err.to_string();
    assert!(
        message.contains("cache.redb") && message.contains("--data-dir"),
        "{message}"
    );
}

#[test]
fn a_file_that_is_not_a_cache_is_refused_and_left_alone() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cache.redb");
    std::fs::write(&path, b"not a database, but someone's data").unwrap();
    let err = CacheDb::open(&path).unwrap_err();
    assert!(matches!(err, CacheError::Open { .. }), "{err}");
    assert_eq!(
        std::fs::read(&path).unwrap(),
        b"not a database, but someone's data"
    );
}

#[test]
fn an_old_sled_cache_is_removed_and_anything_else_left_alone() {
    let dir = tempfile::tempdir().unwrap();
    // What sled 0.34 leaves in its directory.
    let sled = dir.path().join("cache");
    std::fs::create_dir_all(sled.join("blobs")).unwrap();
    for file in ["conf", "db", "snap.0000000000001A2B"] {
        std::fs::write(sled.join(file), b"sled").unwrap();
    }
    assert!(retire_sled_cache(&sled));
    assert!(!sled.exists());
    assert!(!retire_sled_cache(&sled), "nothing left to retire");

    let other = dir.path().join("identity");
    std::fs::create_dir_all(&other).unwrap();
    std::fs::write(other.join("tls.key"), b"key").unwrap();
    assert!(!retire_sled_cache(&other));
    assert!(other.join("tls.key").exists());
}

#[test]
fn clusters_in_one_database_are_isolated() {
    let db = CacheDb::temporary().unwrap();
    // "store-1" is a byte prefix of "store-10": the NUL separator keeps them apart.
    let one = db.cluster("store-1");
    let ten = db.cluster("store-10");
    one.put_work(&work("a", 1), Some(b"{}")).unwrap();
    ten.put_work(&work("b", 1), Some(b"{}")).unwrap();
    one.set_ledger("a", &[deployment("one")]).unwrap();
    one.push_status("a", 1, &json!({})).unwrap();

    assert_eq!(one.works().unwrap(), vec![work("a", 1)]);
    assert_eq!(ten.works().unwrap(), vec![work("b", 1)]);
    assert_eq!(ten.work("a").unwrap(), None);
    assert!(ten.ledgers().unwrap().is_empty());
    assert!(ten.pending_statuses().unwrap().is_empty());
    ten.forget("a").unwrap();
    assert_eq!(one.work("a").unwrap(), Some(work("a", 1)));
}

#[test]
fn clearing_a_hubs_partition_leaves_the_other_hubs_and_a_single_hub_agents() {
    let db = CacheDb::temporary().unwrap();
    let department = db.cluster(&crate::hubs::cache_partition("department", "store-7"));
    let central = db.cluster(&crate::hubs::cache_partition("central-it", "store-7"));
    let single = db.cluster("store-7");
    for cache in [&department, &central, &single] {
        cache.put_work(&work("a", 1), Some(b"{}")).unwrap();
        cache.set_ledger("a", &[deployment("web")]).unwrap();
        cache.push_status("a", 1, &json!({})).unwrap();
    }
    department.put_work(&work("b", 1), Some(b"{}")).unwrap();
    department.release("b").unwrap();

    department.clear().unwrap();
    assert!(department.works().unwrap().is_empty());
    assert!(department.ledgers().unwrap().is_empty());
    assert!(department.pending_statuses().unwrap().is_empty());
    assert!(department.pending_releases().unwrap().is_empty());
    for cache in [&central, &single] {
        assert_eq!(cache.works().unwrap(), vec![work("a", 1)]);
        assert_eq!(cache.ledger("a").unwrap(), vec![deployment("web")]);
        assert_eq!(cache.pending_statuses().unwrap().len(), 1);
    }
}

#[test]
fn the_outbox_keeps_the_latest_status_per_work_with_increasing_seq() {
    let db = CacheDb::temporary().unwrap();
    let cache = db.cluster("c");
    let a1 = cache.push_status("a", 1, &json!({"v": 1})).unwrap();
    assert_eq!(cache.push_status("a", 2, &json!({"v": 2})).unwrap(), a1 + 1);
    let b1 = cache.push_status("b", 1, &json!({"v": 9})).unwrap();
    assert!(
        b1 >= a1,
        "a new work starts at the clock, never below an older one"
    );
    let pending = cache.pending_statuses().unwrap();
    assert_eq!(pending.len(), 2, "coalesced per work: {pending:?}");
    let a = pending.iter().find(|p| p.uid == "a").unwrap();
    assert_eq!((a.generation, a.seq), (2, a1 + 1));
    assert_eq!(a.status_json, br#"{"v":2}"#);
}

#[test]
fn an_ack_for_an_older_seq_keeps_the_newer_status_pending() {
    let db = CacheDb::temporary().unwrap();
    let cache = db.cluster("c");
    let first = cache.push_status("a", 1, &json!({"v": 1})).unwrap();
    cache.push_status("a", 1, &json!({"v": 2})).unwrap();
    assert!(!cache.ack_status("a", first).unwrap());
    assert_eq!(cache.pending_statuses().unwrap()[0].seq, first + 1);
    assert!(cache.ack_status("a", first + 1).unwrap());
    assert!(cache.pending_statuses().unwrap().is_empty());
    // A late duplicate ack changes nothing; an unknown work is not an error.
    assert!(cache.ack_status("a", first).unwrap());
    assert!(!cache.ack_status("zzz", 1).unwrap());
    // The last status stays for comparison after the ack.
    assert_eq!(
        cache.last_status("a").unwrap().unwrap().status,
        json!({"v": 2})
    );
}

#[test]
fn an_ack_past_our_seq_does_not_hide_later_statuses() {
    let db = CacheDb::temporary().unwrap();
    let cache = db.cluster("c");
    let first = cache.push_status("a", 1, &json!({})).unwrap();
    assert!(cache.ack_status("a", first + 6).unwrap());
    assert_eq!(
        cache.push_status("a", 1, &json!({"v": 2})).unwrap(),
        first + 1
    );
    assert_eq!(cache.pending_statuses().unwrap().len(), 1);
}

#[test]
fn ledgers_list_every_work_of_the_cluster() {
    let db = CacheDb::temporary().unwrap();
    let cache = db.cluster("c");
    cache.set_ledger("a", &[deployment("x")]).unwrap();
    cache.set_ledger("b", &[deployment("y")]).unwrap();
    cache.set_ledger("b", &[]).unwrap();
    assert_eq!(
        cache.ledgers().unwrap(),
        vec![("a".to_string(), vec![deployment("x")])]
    );
    assert_eq!(deployment("x").to_string(), "apps/v1 Deployment default/x");
}

/// A first start killed while creating the cache leaves only the temporary file (the cache
/// appears whole, by a rename, or not at all); the next start replaces it and opens.
#[test]
fn a_cache_whose_creation_was_cut_short_opens_at_the_next_start() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cache.redb");
    let creating = dir.path().join("cache.redb.creating");
    // What a kill part-way through redb's header leaves.
    std::fs::write(&creating, b"\0\0\0\0 half a header").unwrap();
    {
        let db = CacheDb::open(&path).expect("the next start opens a new cache");
        db.cluster("store-7")
            .put_work(&work("a", 3), Some(b"{}"))
            .unwrap();
    }
    assert!(!creating.exists(), "the cut creation's file is gone");
    let db = CacheDb::open(&path).expect("and it opens again");
    assert_eq!(
        db.cluster("store-7").work("a").unwrap(),
        Some(work("a", 3)),
        "with what was stored"
    );
}
