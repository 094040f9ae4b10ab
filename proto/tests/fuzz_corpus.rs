//! The kept corpus of proto's fuzz targets (`fuzz/corpus/<target>/`: seeds, and every input that
//! once failed), replayed through the functions libFuzzer runs, on the stable toolchain.

use std::path::Path;

/// Runs `body` on every file of the target's corpus, naming the file that fails.
fn replay(target: &str, body: impl Fn(&[u8]) + std::panic::RefUnwindSafe) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz/corpus")
        .join(target);
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.expect("a directory entry").path())
        .collect();
    files.sort();
    assert!(!files.is_empty(), "{} holds no inputs", dir.display());
    for file in files {
        let data = std::fs::read(&file).expect("a corpus file reads");
        if std::panic::catch_unwind(|| body(&data)).is_err() {
            panic!("{target}: {} fails", file.display());
        }
    }
}

#[test]
fn session_frames_corpus_holds() {
    replay("session_frame_grpc", |data| {
        flotilla_proto::fuzzing::session_frames(data, tokio::time::Instant::now())
    });
}

#[test]
fn chunks_corpus_holds() {
    replay("chunks", flotilla_proto::fuzzing::chunks);
}
