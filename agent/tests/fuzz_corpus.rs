//! The kept corpus of the agent's fuzz targets (`fuzz/corpus/<target>/`: seeds, and every input that
//! once failed), replayed through the functions libFuzzer runs, on the stable toolchain.

/// Runs `body` on every file of the target's corpus, naming the file that fails.
fn replay(target: &str, body: impl Fn(&[u8]) + std::panic::RefUnwindSafe) {
    flotilla_proto::fuzzing::replay_corpus(env!("CARGO_MANIFEST_DIR"), target, body)
}

#[test]
fn cel_rule_corpus_holds() {
    replay("cel_rule", flotilla_agent::fuzzing::cel_rule);
}

#[test]
fn jsonpath_corpus_holds() {
    replay("jsonpath", flotilla_agent::fuzzing::jsonpath);
}
