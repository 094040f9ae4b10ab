//! Large works' content in the cache: chunks keyed by digest (once per content, however many
//! works name it), kept only while a held work or a transfer under way names them, released in
//! the transaction that stops naming them; and the whole content joined and checked before a
//! work is applied.

use std::collections::HashSet;

use redb::ReadableTable;

use super::tables::Tables;
use super::work_cache::{CacheError, WorkCache, storage};

/// Whether stored ManifestWork JSON may name chunks (holds a `ChunkedManifests` reference): a
/// byte search, so works without one are never parsed when chunks are released.
pub(super) fn names_chunks(manifest_work: &[u8]) -> bool {
    let needle = flotilla_proto::api::content::CONTENT_KIND.as_bytes();
    manifest_work.windows(needle.len()).any(|w| w == needle)
}

/// Every chunk digest one cluster's held works and transfers under way name. Records that do
/// not decode name nothing (such a work is refused anyway; such a transfer asks again).
pub(super) fn named_chunks(t: &Tables<'_>, prefix: &[u8]) -> Result<HashSet<String>, CacheError> {
    let mut named = HashSet::new();
    for entry in t.fetches.range::<&[u8]>(prefix..).map_err(storage)? {
        let (key, value) = entry.map_err(storage)?;
        if !key.value().starts_with(prefix) {
            break;
        }
        if let Ok(chunks) = serde_json::from_slice::<Vec<String>>(value.value()) {
            named.extend(chunks);
        }
    }
    for entry in t.manifests.range::<&[u8]>(prefix..).map_err(storage)? {
        let (key, value) = entry.map_err(storage)?;
        if !key.value().starts_with(prefix) {
            break;
        }
        if !names_chunks(value.value()) {
            continue;
        }
        if let Ok(work) = serde_json::from_slice::<serde_json::Value>(value.value()) {
            named.extend(flotilla_proto::api::content::named_chunk_digests(&work));
        }
    }
    Ok(named)
}

pub(super) fn release_unnamed(t: &mut Tables<'_>, prefix: &[u8]) -> Result<u64, CacheError> {
    let named = named_chunks(t, prefix)?;
    let mut unnamed = Vec::new();
    for entry in t.chunks.range::<&[u8]>(prefix..).map_err(storage)? {
        let (key, _) = entry.map_err(storage)?;
        let Some(sha) = key.value().strip_prefix(prefix) else {
            break;
        };
        if !named.contains(String::from_utf8_lossy(sha).as_ref()) {
            unnamed.push(key.value().to_vec());
        }
    }
    for key in &unnamed {
        t.chunks.remove(key.as_slice()).map_err(storage)?;
    }
    Ok(unnamed.len() as u64)
}

/// The ManifestWork to apply from what the cache holds for it: as stored, or, for a large work,
/// with its `ChunkedManifests` reference replaced by the manifests joined from the chunks, every
/// digest checked first.
pub fn joined_manifest_work(
    cache: &dyn WorkCache,
    stored: &[u8],
) -> Result<Result<flotilla_proto::api::ManifestWork, String>, CacheError> {
    use flotilla_proto::api::content::{ContentError, ContentRef};
    let mut work = match serde_json::from_slice::<flotilla_proto::api::ManifestWork>(stored) {
        Ok(work) => work,
        Err(e) => return Ok(Err(format!("the work is not a valid ManifestWork: {e}"))),
    };
    let reference = match ContentRef::of(&work) {
        None => return Ok(Ok(work)),
        Some(Err(e)) => return Ok(Err(e.to_string())),
        Some(Ok(reference)) => reference,
    };
    let mut failed = None;
    let joined = reference.assemble(|_, sha| match cache.chunk(sha) {
        Ok(data) => data,
        Err(e) => {
            failed = Some(e);
            None
        }
    });
    if let Some(e) = failed {
        return Err(e);
    }
    match joined {
        Ok(manifests) => {
            work.spec.workload.manifests = manifests;
            Ok(Ok(work))
        }
        Err(e @ ContentError::MissingChunk { .. }) => Ok(Err(format!(
            "{e}: the content of {} bytes is not all held yet; the hub resends it on the next session",
            reference.bytes
        ))),
        Err(e) => Ok(Err(format!(
            "content sha256 {} cannot be used: {e}",
            reference.sha256
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::super::db::{CacheDb, ClusterCache};
    use super::super::records::CachedWork;
    use super::super::test_support::work;
    use super::super::work_cache::WorkCache;
    use super::joined_manifest_work;
    use serde_json::json;

    #[test]
    fn chunks_survive_a_reopen_and_a_resume_asks_only_for_the_rest() {
        use flotilla_proto::api::Manifest;
        use flotilla_proto::api::content::split;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cache.redb");
        let manifests: Vec<Manifest> = (0..6)
            .map(|i| {
                Manifest(json!({"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": format!("cm-{i}")}, "data": {"x": "y".repeat(300 * 1024)}}))
            })
            .collect();
        let (reference, chunks) = split(&manifests);
        {
            let cache = CacheDb::open(&path).unwrap().cluster("c1");
            assert_eq!(
                cache.begin_fetch("a", &reference.chunks).unwrap(),
                reference.chunks
            );
            for chunk in &chunks[..2] {
                assert!(cache.put_chunk(&chunk.sha256, &chunk.data).unwrap());
            }
        }
        // As after a kill half-way: reopened, only what was not stored is missing, and the
        // transfer is still recorded, so its chunks are kept.
        let cache = CacheDb::open(&path).unwrap().cluster("c1");
        assert_eq!(cache.fetches().unwrap(), ["a"]);
        assert_eq!(
            cache.begin_fetch("a", &reference.chunks).unwrap(),
            reference.chunks[2..].to_vec()
        );
        for chunk in &chunks[2..] {
            assert!(cache.put_chunk(&chunk.sha256, &chunk.data).unwrap());
        }
        assert!(cache.missing_chunks(&reference.chunks).unwrap().is_empty());
        // Two works naming the same content: stored once.
        let stored: Vec<u8> = serde_json::to_vec(&json!({
            "apiVersion": "work.open-cluster-management.io/v1", "kind": "ManifestWork",
            "metadata": {"name": "big", "namespace": "c1"},
            "spec": {"workload": {"manifests": [reference.manifest().0]}},
        }))
        .unwrap();
        cache.put_work(&work("a", 1), Some(&stored)).unwrap();
        cache.put_work(&work("b", 1), Some(&stored)).unwrap();
        assert_eq!(
            cache.chunk_totals().unwrap(),
            (chunks.len() as u64, reference.bytes)
        );
        let joined = joined_manifest_work(&cache, &stored).unwrap().unwrap();
        assert_eq!(joined.spec.workload.manifests, manifests);
    }

    #[test]
    fn chunks_no_held_work_or_transfer_names_are_released_durably() {
        use flotilla_proto::api::Manifest;
        use flotilla_proto::api::content::split;
        let content = |tag: &str| {
            split(&[Manifest(json!({"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": tag}, "data": {"x": tag.repeat(700 * 1024 / tag.len())}}))])
        };
        let ((x, x_chunks), (y, y_chunks), (z, z_chunks)) =
            (content("x"), content("yy"), content("zzz"));
        let fetch_all = |cache: &ClusterCache,
                         uid: &str,
                         r: &flotilla_proto::api::content::ContentRef,
                         chunks: &[flotilla_proto::api::content::Chunk]| {
            cache.begin_fetch(uid, &r.chunks).unwrap();
            for c in chunks {
                cache.put_chunk(&c.sha256, &c.data).unwrap();
            }
        };
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cache.redb");
        {
            let db = CacheDb::open(&path).unwrap();
            let (cache, neighbour) = (db.cluster("c1"), db.cluster("c2"));
            // Another cluster in the same database holds the same content: never touched.
            fetch_all(&neighbour, "n", &x, &x_chunks);
            let (w, stored) = large("n", &x);
            neighbour.put_work(&w, Some(&stored)).unwrap();

            // Nothing names y yet: a chunk of it is not kept.
            assert!(
                !cache
                    .put_chunk(&y_chunks[0].sha256, &y_chunks[0].data)
                    .unwrap()
            );
            assert_eq!(cache.chunk_totals().unwrap(), (0, 0));
            // Works a and b hold content x, stored once.
            fetch_all(&cache, "a", &x, &x_chunks);
            for uid in ["a", "b"] {
                let (w, stored) = large(uid, &x);
                cache.put_work(&w, Some(&stored)).unwrap();
            }
            assert!(
                cache.fetches().unwrap().is_empty(),
                "stored works end their transfers"
            );
            assert_eq!(cache.chunk_totals().unwrap(), (2, x.bytes));
            // a forgotten: b still names x.
            cache.forget("a").unwrap();
            assert_eq!(cache.chunk_totals().unwrap(), (2, x.bytes));
            // b's content replaced by y: x goes once b is stored with y.
            fetch_all(&cache, "b", &y, &y_chunks);
            assert_eq!(cache.chunk_totals().unwrap(), (4, x.bytes + y.bytes));
            let (w, stored) = large("b", &y);
            cache.put_work(&w, Some(&stored)).unwrap();
            assert_eq!(cache.chunk_totals().unwrap(), (2, y.bytes));
            // A transfer cut off half-way, then replaced by another content: the first's part goes.
            cache.begin_fetch("c", &z.chunks).unwrap();
            assert!(
                cache
                    .put_chunk(&z_chunks[0].sha256, &z_chunks[0].data)
                    .unwrap()
            );
            cache.begin_fetch("c", &x.chunks).unwrap();
            assert_eq!(cache.chunk_totals().unwrap(), (2, y.bytes));
            assert!(
                cache
                    .put_chunk(&x_chunks[0].sha256, &x_chunks[0].data)
                    .unwrap()
            );
            // The hub's sync no longer sends c: its transfer is given up.
            assert_eq!(cache.end_fetches(&["b".to_string()]).unwrap(), 1);
            // A chunk of it still on the way is dropped.
            assert!(
                !cache
                    .put_chunk(&x_chunks[1].sha256, &x_chunks[1].data)
                    .unwrap()
            );
            assert_eq!(cache.chunk_totals().unwrap(), (2, y.bytes));
            // A transfer for a work deleted on the hub before it was stored.
            fetch_all(&cache, "d", &z, &z_chunks[..1]);
            assert_eq!(cache.end_fetch("d").unwrap(), 1);
            // b deleted on the hub and removed from the spoke: released, and y with it.
            cache.release("b").unwrap();
            assert_eq!(cache.pending_releases().unwrap(), ["b"]);
        }
        // Reopened: the releases were durable, and the neighbour kept its chunks.
        let db = CacheDb::open(&path).unwrap();
        assert_eq!(db.cluster("c1").chunk_totals().unwrap(), (0, 0));
        assert_eq!(db.cluster("c2").chunk_totals().unwrap(), (2, x.bytes));
    }

    #[test]
    fn a_work_whose_content_is_not_all_held_is_not_applied_and_says_why() {
        use flotilla_proto::api::Manifest;
        use flotilla_proto::api::content::split;
        let cache = CacheDb::temporary().unwrap().cluster("c1");
        let manifests = vec![Manifest(json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "cm"}, "data": {"x": "y".repeat(600 * 1024)}}))];
        let (reference, chunks) = split(&manifests);
        cache.begin_fetch("big", &reference.chunks).unwrap();
        assert!(cache.put_chunk(&chunks[0].sha256, &chunks[0].data).unwrap());
        let stored = serde_json::to_vec(&json!({
            "apiVersion": "work.open-cluster-management.io/v1", "kind": "ManifestWork",
            "metadata": {"name": "big", "namespace": "c1"},
            "spec": {"workload": {"manifests": [reference.manifest().0]}},
        }))
        .unwrap();
        let why = joined_manifest_work(&cache, &stored).unwrap().unwrap_err();
        assert!(
            why.contains("chunk #1") && why.contains("not all held"),
            "{why}"
        );
    }

    /// A work naming content, as the hub sends it.
    fn large(
        uid: &str,
        reference: &flotilla_proto::api::content::ContentRef,
    ) -> (CachedWork, Vec<u8>) {
        let stored = serde_json::to_vec(&json!({
            "apiVersion": "work.open-cluster-management.io/v1", "kind": "ManifestWork",
            "metadata": {"name": uid, "namespace": "c1", "uid": uid},
            "spec": {"workload": {"manifests": [reference.manifest().0]}},
        }))
        .unwrap();
        (work(uid, 1), stored)
    }
}
