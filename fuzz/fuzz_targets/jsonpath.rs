#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| flotilla_agent::fuzzing::jsonpath(data));
