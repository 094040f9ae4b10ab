//! The kept corpus of proto's fuzz targets (`fuzz/corpus/<target>/`: seeds, and every input that
//! once failed), replayed through the functions libFuzzer runs, on the stable toolchain.

/// Runs `body` on every file of the target's corpus, naming the file that fails.
fn replay(target: &str, body: impl Fn(&[u8]) + std::panic::RefUnwindSafe) {
    flotilla_proto::fuzzing::replay_corpus(env!("CARGO_MANIFEST_DIR"), target, body)
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
