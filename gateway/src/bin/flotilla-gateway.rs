//! `flotilla-gateway`: one replica of the session tier in scale-out mode. It holds the
//! sessions of the clusters whose shards its leases give it, on the hub's kube-apiserver, and
//! redirects other agents to their shards' owners. See `flotilla-gateway --help`.

use anyhow::Context as _;
use clap::Parser;
use flotilla_gateway::process::{GatewayProcessConfig, init_tracing, run};
use flotilla_ops::shutdown_signal;

/// mimalloc rather than the C library's allocator: the process allocates and frees small JSON
/// maps by the million (watch events, statuses of 10,000 clusters), where glibc's malloc spent
/// half of a loaded hub's CPU (see docs/performance.md, "The allocator").
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// A flotilla gateway replica (scale-out mode): serves agent sessions for the shards it
/// holds through coordination.k8s.io Leases on the hub apiserver, and redirects agents of
/// other shards to their owners. Run several behind one TCP/UDP load balancer or DNS name;
/// the hub runs with `--gateways external`. Its certificate comes from the hub CA
/// (`flotilla-hub gateway-cert`).
#[derive(Parser)]
#[command(name = "flotilla-gateway", version)]
struct Cli {
    #[command(flatten)]
    config: GatewayProcessConfig,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    init_tracing(cli.config.ops.log_format);
    if cli.config.check_config {
        cli.config.validate()?;
        println!("{:#?}", cli.config);
        return Ok(());
    }
    let runtime = tokio::runtime::Runtime::new().context("starting the tokio runtime")?;
    runtime.block_on(run(cli.config, shutdown_signal()))
}
