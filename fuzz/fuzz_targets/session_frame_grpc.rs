#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    flotilla_proto::fuzzing::session_frames(data, tokio::time::Instant::now())
});
