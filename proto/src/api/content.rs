//! Works beyond the store's object limit: a ManifestWork's manifests stored content-addressed
//! in bounded chunks beside it, the rule both the hub (which splits and stores them) and the
//! agent (which fetches, verifies and joins them) follow.
//!
//! The manifests of a large work are serialized once as compact JSON (the *content*), hashed
//! (SHA-256, the content's identity), and cut into pieces of at most [`CHUNK_BYTES`]. Each
//! piece is a [`ManifestChunk`] object in the work's namespace (the cluster's), named after its
//! own SHA-256 (`sha256-<hex>`), so two works with the same manifests share their chunks and a
//! chunk is never rewritten with other bytes. The work keeps one manifest in place of the
//! others: a [`ContentRef`] (kind `ChunkedManifests`) naming the content's digest, its size and
//! its chunks in order. Because the reference sits in the spec, changing the content bumps the
//! work's generation and content hash as any edit does, and the session's resume and
//! `observedGeneration` work unchanged.
//!
//! A chunk object is at most [`CHUNK_BYTES`] of data, about 700 KiB once base64-encoded:
//! well under etcd's 1.5 MiB request limit and the apiserver's 3 MiB body limit.

use k8s_openapi::ByteString;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::work::{Manifest, ManifestWork};

/// Largest piece of content one [`ManifestChunk`] holds, and one session frame carries.
pub const CHUNK_BYTES: usize = 512 * 1024;

/// Largest content a chunked work may have: the protocol's ceiling, which no configured cap
/// may exceed (the agent refuses a larger reference). 256 MiB is 512 chunks.
pub const MAX_CONTENT_BYTES: u64 = 256 * 1024 * 1024;

/// The default cap of `flotilla work create -f` and `apply -f` on a work's manifests.
pub const DEFAULT_MAX_WORK_BYTES: u64 = 64 * 1024 * 1024;

/// `apiVersion` of the reference manifest and of [`ManifestChunk`].
pub const CONTENT_API_VERSION: &str = "work.flotilla.io/v1alpha1";

/// Annotation on a [`ManifestChunk`]: when `flotilla work create -f` or `apply -f` last stored
/// it (RFC 3339). Set when the chunk was there already, so that its grace before the hub
/// collects it starts again before the new work naming it is created.
pub const STORED_AT_ANNOTATION: &str = "work.flotilla.io/stored-at";

/// `kind` of the reference manifest that stands for a work's chunked manifests.
pub const CONTENT_KIND: &str = "ChunkedManifests";

/// One piece of a chunked work's manifests, in the work's namespace, named
/// [`chunk_object_name`] of its digest. Its data is written once and never changed: its name is
/// its content (only its metadata may change: see the hub's chunk collection).
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq)]
#[kube(
    group = "work.flotilla.io",
    version = "v1alpha1",
    kind = "ManifestChunk",
    namespaced,
    derive = "PartialEq",
    doc = "ManifestChunk is one piece (at most 512 KiB) of the manifests of a ManifestWork too large for one object, in the managed cluster's namespace, named sha256-<hex digest of data>. Made by `flotilla work create -f`; read by the gateway for that cluster's agent only."
)]
#[serde(rename_all = "camelCase")]
pub struct ManifestChunkSpec {
    /// The piece of content, base64-encoded as Kubernetes encodes bytes.
    #[schemars(schema_with = "bytes_schema")]
    pub data: ByteString,
}

fn bytes_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({ "type": "string", "format": "byte" })
}

/// The name of the chunk object holding the piece with this hex SHA-256.
pub fn chunk_object_name(sha256: &str) -> String {
    format!("sha256-{sha256}")
}

/// Hex SHA-256 of `data`.
pub fn sha256_hex(data: &[u8]) -> String {
    hex::encode(Sha256::digest(data))
}

/// Whether `s` is a hex SHA-256 as flotilla writes them (64 lower-case hex digits).
pub fn is_sha256_hex(s: &str) -> bool {
    s.len() == 64
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// What a chunked work's one manifest says: which content stands in for its manifests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContentRef {
    /// Hex SHA-256 of the whole content (the manifests as compact JSON).
    pub sha256: String,
    /// The content's length in bytes.
    pub bytes: u64,
    /// The hex SHA-256 of each chunk, in order.
    pub chunks: Vec<String>,
}

/// A piece of content with its digest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chunk {
    /// Hex SHA-256 of `data`.
    pub sha256: String,
    /// At most [`CHUNK_BYTES`].
    pub data: Vec<u8>,
}

/// Why content could not be used. None is retryable with the same input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ContentError {
    /// The reference manifest is malformed. Not retryable: re-create the work with
    /// `flotilla work create -f`.
    #[error(
        "the ChunkedManifests reference is invalid: {0}; re-create the work with `flotilla work create -f`"
    )]
    BadReference(String),
    /// A chunk's bytes do not hash to its name. Not retryable: the chunk is damaged.
    #[error("chunk #{index} hashes to {got}, not {expected}")]
    ChunkDigest {
        /// Its position in the reference.
        index: usize,
        /// The digest the reference names.
        expected: String,
        /// The digest of the bytes found.
        got: String,
    },
    /// A chunk the reference names is not there. Retryable once it is fetched.
    #[error("chunk #{index} (sha256 {sha256}) is missing")]
    MissingChunk {
        /// Its position in the reference.
        index: usize,
        /// Its digest.
        sha256: String,
    },
    /// The joined chunks do not hash to the content's digest, or have another length. Not
    /// retryable: the reference or the chunks are wrong.
    #[error("the joined content ({bytes} bytes) hashes to {got}, not {expected}")]
    ContentDigest {
        /// The content digest the reference names.
        expected: String,
        /// The digest of what was joined.
        got: String,
        /// How many bytes were joined.
        bytes: u64,
    },
    /// The content is not a JSON array of manifests. Not retryable.
    #[error("the joined content is not a list of manifests: {0}")]
    NotManifests(String),
}

impl ContentRef {
    /// The reference in `work`, if its manifests are chunked (its only manifest is of kind
    /// [`CONTENT_KIND`]); `Some(Err)` when that manifest is malformed.
    pub fn of(work: &ManifestWork) -> Option<Result<ContentRef, ContentError>> {
        let manifests = &work.spec.workload.manifests;
        let position = manifests.iter().position(is_reference)?;
        if manifests.len() != 1 {
            return Some(Err(ContentError::BadReference(format!(
                "manifest #{position} is a {CONTENT_KIND} reference, which must be the work's only manifest"
            ))));
        }
        Some(ContentRef::from_manifest(&manifests[0]))
    }

    /// Parses a reference manifest.
    pub fn from_manifest(manifest: &Manifest) -> Result<ContentRef, ContentError> {
        let bad = |what: &str| Err(ContentError::BadReference(what.to_string()));
        let value = &manifest.0;
        let Some(sha256) = value["content"]["sha256"].as_str() else {
            return bad("content.sha256 is missing");
        };
        if !is_sha256_hex(sha256) {
            return bad("content.sha256 is not 64 lower-case hex digits");
        }
        let Some(bytes) = value["content"]["bytes"].as_u64() else {
            return bad("content.bytes is missing");
        };
        if bytes == 0 || bytes > MAX_CONTENT_BYTES {
            return Err(ContentError::BadReference(format!(
                "content.bytes is {bytes}; it must be between 1 and {MAX_CONTENT_BYTES}"
            )));
        }
        let Some(list) = value["content"]["chunks"].as_array() else {
            return bad("content.chunks is missing");
        };
        let chunks: Vec<String> = list
            .iter()
            .filter_map(|c| c.as_str().filter(|c| is_sha256_hex(c)).map(str::to_string))
            .collect();
        if chunks.len() != list.len() {
            return bad("content.chunks holds something other than hex SHA-256 digests");
        }
        let expected = bytes.div_ceil(CHUNK_BYTES as u64);
        if chunks.len() as u64 != expected {
            return Err(ContentError::BadReference(format!(
                "{bytes} bytes make {expected} chunks of at most {CHUNK_BYTES} bytes, not {}",
                chunks.len()
            )));
        }
        if value["metadata"]["name"].as_str() != Some(&chunk_object_name(sha256)) {
            return bad("metadata.name is not sha256-<content.sha256>");
        }
        Ok(ContentRef {
            sha256: sha256.to_string(),
            bytes,
            chunks,
        })
    }

    /// The reference as the manifest that stands in the work.
    pub fn manifest(&self) -> Manifest {
        Manifest(serde_json::json!({
            "apiVersion": CONTENT_API_VERSION,
            "kind": CONTENT_KIND,
            "metadata": { "name": chunk_object_name(&self.sha256) },
            "content": {
                "sha256": self.sha256,
                "bytes": self.bytes,
                "chunks": self.chunks,
            },
        }))
    }

    /// How many bytes chunk `index` holds (every chunk is full but the last).
    pub fn chunk_len(&self, index: usize) -> u64 {
        let start = index as u64 * CHUNK_BYTES as u64;
        (self.bytes - start.min(self.bytes)).min(CHUNK_BYTES as u64)
    }

    /// Joins the chunks (in the reference's order; `chunk(i)` gives the i-th one's bytes),
    /// checks every digest, and parses the manifests.
    pub fn assemble(
        &self,
        mut chunk: impl FnMut(usize, &str) -> Option<Vec<u8>>,
    ) -> Result<Vec<Manifest>, ContentError> {
        let mut content = Vec::with_capacity(usize::try_from(self.bytes).unwrap_or(0));
        let mut whole = Sha256::new();
        for (index, sha256) in self.chunks.iter().enumerate() {
            let data = chunk(index, sha256).ok_or_else(|| ContentError::MissingChunk {
                index,
                sha256: sha256.clone(),
            })?;
            let got = sha256_hex(&data);
            if &got != sha256 {
                return Err(ContentError::ChunkDigest {
                    index,
                    expected: sha256.clone(),
                    got,
                });
            }
            whole.update(&data);
            content.extend_from_slice(&data);
        }
        let got = hex::encode(whole.finalize());
        if got != self.sha256 || content.len() as u64 != self.bytes {
            return Err(ContentError::ContentDigest {
                expected: self.sha256.clone(),
                got,
                bytes: content.len() as u64,
            });
        }
        serde_json::from_slice(&content).map_err(|e| ContentError::NotManifests(e.to_string()))
    }
}

/// Whether a manifest is a [`CONTENT_KIND`] reference.
pub fn is_reference(manifest: &Manifest) -> bool {
    manifest.0["kind"] == CONTENT_KIND && manifest.0["apiVersion"] == CONTENT_API_VERSION
}

/// The content of `manifests` (compact JSON), its reference and its chunks.
pub fn split(manifests: &[Manifest]) -> (ContentRef, Vec<Chunk>) {
    let content = serde_json::to_vec(manifests).expect("manifests are plain JSON");
    let chunks: Vec<Chunk> = content
        .chunks(CHUNK_BYTES)
        .map(|data| Chunk {
            sha256: sha256_hex(data),
            data: data.to_vec(),
        })
        .collect();
    let reference = ContentRef {
        sha256: sha256_hex(&content),
        bytes: content.len() as u64,
        chunks: chunks.iter().map(|c| c.sha256.clone()).collect(),
    };
    (reference, chunks)
}

/// The [`ManifestChunk`] object for `chunk` in `namespace`, as JSON for a store.
pub fn chunk_object(namespace: &str, chunk: &Chunk) -> serde_json::Value {
    let mut object = ManifestChunk::new(
        &chunk_object_name(&chunk.sha256),
        ManifestChunkSpec {
            data: ByteString(chunk.data.clone()),
        },
    );
    object.metadata.namespace = Some(namespace.to_string());
    serde_json::to_value(object).expect("a ManifestChunk serializes")
}

/// The bytes of a stored [`ManifestChunk`] object, checked against `sha256`.
pub fn chunk_data(object: serde_json::Value, sha256: &str) -> Result<Vec<u8>, String> {
    let chunk: ManifestChunk =
        serde_json::from_value(object).map_err(|e| format!("does not parse: {e}"))?;
    let data = chunk.spec.data.0;
    let got = sha256_hex(&data);
    if got != sha256 {
        return Err(format!("its data hashes to {got}"));
    }
    Ok(data)
}

/// The chunk digests a ManifestWork (as JSON) names through its `ChunkedManifests`
/// reference, read loosely: any reference-kind manifest, any string in its `content.chunks`.
/// What decides which chunks may go (the hub's collection, the agent's cache) keeps what looks
/// named, so a malformed reference keeps its chunks rather than losing someone else's.
pub fn named_chunk_digests(work: &serde_json::Value) -> Vec<String> {
    let Some(manifests) = work
        .pointer("/spec/workload/manifests")
        .and_then(serde_json::Value::as_array)
    else {
        return Vec::new();
    };
    manifests
        .iter()
        .filter(|m| m["kind"] == CONTENT_KIND)
        .filter_map(|m| {
            m.pointer("/content/chunks")
                .and_then(serde_json::Value::as_array)
        })
        .flatten()
        .filter_map(serde_json::Value::as_str)
        .map(str::to_string)
        .collect()
}

/// Checks a [`ManifestChunk`] object before it is stored: its name must be `sha256-<hex>` of
/// its data. The error names the chunk and both digests and says how to fix it.
pub fn check_chunk_object(object: &serde_json::Value) -> Result<(), String> {
    let name = object["metadata"]["name"].as_str().unwrap_or("");
    let qualified = super::object_name(object["metadata"]["namespace"].as_str(), Some(name));
    let chunk: ManifestChunk = serde_json::from_value(object.clone())
        .map_err(|e| format!("ManifestChunk {qualified}: does not parse: {e}"))?;
    let got = sha256_hex(&chunk.spec.data.0);
    let named = name
        .strip_prefix("sha256-")
        .filter(|hex| is_sha256_hex(hex));
    match named {
        Some(expected) if expected == got => Ok(()),
        Some(expected) => Err(format!(
            "ManifestChunk {qualified}: its data hashes to sha256 {got}, not {expected} as its name says; \
             nothing was stored. A chunk is named after its content: name it sha256-{got}, or let \
             `flotilla work create -f` store the chunks"
        )),
        None => Err(format!(
            "ManifestChunk {qualified}: the name must be sha256-<64 lower-case hex digits> of its data \
             (sha256 {got}, so sha256-{got}); nothing was stored"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::ManifestWorkSpec;

    #[test]
    fn a_chunk_is_stored_only_under_its_own_digest() {
        let piece = Chunk {
            sha256: sha256_hex(b"some content"),
            data: b"some content".to_vec(),
        };
        let good = chunk_object("c1", &piece);
        assert_eq!(check_chunk_object(&good), Ok(()));
        let other = sha256_hex(b"other content");
        let mut renamed = good.clone();
        renamed["metadata"]["name"] = chunk_object_name(&other).into();
        let err = check_chunk_object(&renamed).unwrap_err();
        assert!(
            err.starts_with(&format!("ManifestChunk c1/sha256-{other}:")),
            "{err}"
        );
        assert!(
            err.contains(&format!("hashes to sha256 {}, not {other}", piece.sha256)),
            "{err}"
        );
        let mut unnamed = good;
        unnamed["metadata"]["name"] = "chunk-1".into();
        let err = check_chunk_object(&unnamed).unwrap_err();
        assert!(err.contains(&format!("sha256-{}", piece.sha256)), "{err}");
    }

    fn config_maps(n: usize, each: usize) -> Vec<Manifest> {
        (0..n)
            .map(|i| {
                Manifest(serde_json::json!({
                    "apiVersion": "v1", "kind": "ConfigMap",
                    "metadata": {"name": format!("cm-{i}"), "namespace": "default"},
                    "data": {"blob": "x".repeat(each)},
                }))
            })
            .collect()
    }

    fn work_with(manifests: Vec<Manifest>) -> ManifestWork {
        let mut spec = ManifestWorkSpec::default();
        spec.workload.manifests = manifests;
        ManifestWork::new("big", spec)
    }

    #[test]
    fn a_ten_mib_bundle_splits_into_chunks_each_well_under_the_object_limit() {
        let manifests = config_maps(100, 105 * 1024);
        let (reference, chunks) = split(&manifests);
        assert!(reference.bytes > 10 * 1024 * 1024);
        assert_eq!(
            chunks.len() as u64,
            reference.bytes.div_ceil(CHUNK_BYTES as u64)
        );
        for (i, chunk) in chunks.iter().enumerate() {
            assert_eq!(chunk.data.len() as u64, reference.chunk_len(i));
            assert_eq!(sha256_hex(&chunk.data), reference.chunks[i]);
        }
        // Each stored object stays well under etcd's 1.5 MiB request limit.
        let object = serde_json::to_vec(&chunk_object("cluster1", &chunks[0])).unwrap();
        assert!(object.len() < 1024 * 1024, "{} bytes", object.len());
    }

    #[test]
    fn the_reference_round_trips_through_a_work_and_joins_back_to_the_manifests() {
        let manifests = config_maps(8, 200 * 1024);
        let (reference, chunks) = split(&manifests);
        let work = work_with(vec![reference.manifest()]);
        let parsed = ContentRef::of(&work).unwrap().unwrap();
        assert_eq!(parsed, reference);
        let joined = parsed
            .assemble(|i, sha| (chunks[i].sha256 == sha).then(|| chunks[i].data.clone()))
            .unwrap();
        assert_eq!(joined, manifests);
    }

    #[test]
    fn the_same_manifests_make_the_same_chunks() {
        let (a, _) = split(&config_maps(4, 300 * 1024));
        let (b, _) = split(&config_maps(4, 300 * 1024));
        assert_eq!(a, b);
        let (c, _) = split(&config_maps(4, 300 * 1024 + 1));
        assert_ne!(a.sha256, c.sha256);
    }

    #[test]
    fn a_damaged_or_missing_chunk_is_named() {
        let (reference, chunks) = split(&config_maps(4, 300 * 1024));
        let err = reference
            .assemble(|i, _| {
                let mut data = chunks[i].data.clone();
                if i == 1 {
                    data[0] ^= 1;
                }
                Some(data)
            })
            .unwrap_err();
        assert!(
            matches!(err, ContentError::ChunkDigest { index: 1, .. }),
            "{err}"
        );
        let err = reference
            .assemble(|i, _| (i != 2).then(|| chunks[i].data.clone()))
            .unwrap_err();
        assert!(
            matches!(err, ContentError::MissingChunk { index: 2, .. }),
            "{err}"
        );
    }

    #[test]
    fn a_reference_whose_chunks_hash_right_but_join_to_other_content_is_refused() {
        let (mut reference, chunks) = split(&config_maps(4, 300 * 1024));
        reference.sha256 = sha256_hex(b"something else");
        let err = reference
            .assemble(|i, _| Some(chunks[i].data.clone()))
            .unwrap_err();
        assert!(matches!(err, ContentError::ContentDigest { .. }), "{err}");
    }

    #[test]
    fn malformed_references_are_refused_with_the_field() {
        let (reference, _) = split(&config_maps(3, 300 * 1024));
        let check = |edit: &dyn Fn(&mut serde_json::Value), expect: &str| {
            let mut manifest = reference.manifest();
            edit(&mut manifest.0);
            let err = ContentRef::from_manifest(&manifest)
                .unwrap_err()
                .to_string();
            assert!(err.contains(expect), "{err} lacks {expect}");
        };
        check(&|m| m["content"]["sha256"] = "ABC".into(), "content.sha256");
        check(&|m| m["content"]["bytes"] = 0.into(), "content.bytes is 0");
        check(
            &|m| {
                m["content"]["chunks"]
                    .as_array_mut()
                    .unwrap()
                    .pop()
                    .map(drop)
                    .unwrap()
            },
            "chunks of at most",
        );
        check(&|m| m["metadata"]["name"] = "other".into(), "metadata.name");
        let mut two = vec![reference.manifest()];
        two.extend(config_maps(1, 10));
        let err = ContentRef::of(&work_with(two)).unwrap().unwrap_err();
        assert!(err.to_string().contains("only manifest"), "{err}");
        assert!(ContentRef::of(&work_with(config_maps(1, 10))).is_none());
    }

    #[test]
    fn a_stored_chunk_is_checked_against_its_name() {
        let (_, chunks) = split(&config_maps(2, 10));
        let object = chunk_object("cluster1", &chunks[0]);
        assert_eq!(
            object["metadata"]["name"],
            chunk_object_name(&chunks[0].sha256)
        );
        assert_eq!(
            chunk_data(object.clone(), &chunks[0].sha256).unwrap(),
            chunks[0].data
        );
        let err = chunk_data(object, &sha256_hex(b"x")).unwrap_err();
        assert!(err.contains("hashes to"), "{err}");
    }
}
