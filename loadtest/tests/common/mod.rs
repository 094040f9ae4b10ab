//! What the load-test's integration tests share: logging, and run arguments as the command
//! line would give them.

use std::path::PathBuf;

use clap::Parser;
use flotilla_loadtest::cli::RunArgs;

/// Test logging (warnings, the harness's info) and the process-wide rustls provider.
pub fn trace_init() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,flotilla_loadtest=info".into()),
        )
        .with_test_writer()
        .try_init();
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// `flotilla-loadtest run --quiet --out <out> <extra>` as parsed arguments.
pub fn args(out: &std::path::Path, extra: &[&str]) -> RunArgs {
    #[derive(Parser)]
    struct Only {
        #[command(flatten)]
        args: RunArgs,
    }
    let mut argv = vec!["run", "--quiet", "--out", out.to_str().unwrap()];
    argv.extend_from_slice(extra);
    let mut args = Only::parse_from(argv).args;
    // The child hub and the workers are this package's binary, not the test executable.
    args.harness_exe = Some(PathBuf::from(env!("CARGO_BIN_EXE_flotilla-loadtest")));
    args
}
