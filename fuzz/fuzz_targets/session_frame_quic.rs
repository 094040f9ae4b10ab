#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| flotilla_transport::fuzzing::quic_frames(data));
