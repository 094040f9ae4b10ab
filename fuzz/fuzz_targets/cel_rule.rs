#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| flotilla_agent::fuzzing::cel_rule(data));
