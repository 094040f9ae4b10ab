//! `flotilla-loadtest`: see `--help`, and the crate docs of `flotilla_loadtest`.
#![forbid(unsafe_code)]

use clap::{CommandFactory, FromArgMatches};
use flotilla_loadtest::cli::{Cli, Command, RunArgs};

/// mimalloc rather than the C library's allocator: the process allocates and frees small JSON
/// maps by the million (watch events, statuses of 10,000 clusters), where glibc's malloc spent
/// half of a loaded hub's CPU (see docs/performance.md, "The allocator").
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> anyhow::Result<()> {
    let matches = Cli::command().get_matches();
    let mut cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    if let (Command::Run(args), Some(("run", run))) = (&mut cli.command, matches.subcommand()) {
        // A flag left at its default is one the chaos scenario may choose.
        args.apply_chaos_defaults(|id| {
            run.value_source(id)
                .is_some_and(|s| s != clap::parser::ValueSource::DefaultValue)
        });
    }
    init_tracing();
    // Rustls needs one process-wide crypto provider; ring only.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let runtime = tokio::runtime::Runtime::new()?;
    match cli.command {
        Command::Hub(config) => {
            flotilla_loadtest::machine::raise_open_files_limit();
            runtime.block_on(flotilla_hub::run(*config, flotilla_ops::shutdown_signal()))
        }
        Command::Gateway(config) => {
            flotilla_loadtest::machine::raise_open_files_limit();
            runtime.block_on(flotilla_gateway::process::run(
                *config,
                flotilla_ops::shutdown_signal(),
            ))
        }
        Command::BareServer(args) => runtime.block_on(flotilla_loadtest::bare::serve(args)),
        Command::Worker { spec } => runtime.block_on(flotilla_loadtest::agents::run_worker(&spec)),
        Command::Demo(demo) => {
            report(runtime.block_on(flotilla_loadtest::run(RunArgs::demo(&demo))))
        }
        Command::Run(args) => report(runtime.block_on(flotilla_loadtest::run(*args))),
        Command::LinkCheck(args) => {
            let measured = runtime.block_on(flotilla_loadtest::link::check(&args))?;
            print!("{}", flotilla_loadtest::link::table(&measured));
            Ok(())
        }
        Command::BenchScheduler(args) => {
            let result = flotilla_loadtest::bench::run(&args)?;
            if args.json {
                println!("{}", serde_json::to_string_pretty(&result)?);
            } else {
                print!("{}", flotilla_loadtest::bench::table(&result));
            }
            Ok(())
        }
    }
}

fn report(
    result: anyhow::Result<(flotilla_loadtest::report::Report, std::path::PathBuf)>,
) -> anyhow::Result<()> {
    let (report, out) = result?;
    print!("{}", flotilla_loadtest::report::table(&report));
    println!("report: {}", out.join("report.json").display());
    let failed: Vec<&str> = report
        .scenarios
        .iter()
        .filter(|s| s.outcome != Some(flotilla_loadtest::report::Outcome::Completed))
        .map(|s| s.name.as_str())
        .collect();
    anyhow::ensure!(
        failed.is_empty(),
        "scenarios that did not complete: {}",
        failed.join(", ")
    );
    Ok(())
}

/// Warnings by default, except the agents' own: a thousand agents each saying "cannot reach the
/// hub; retrying" during a storm is what the storm measures, and the report counts them.
/// `RUST_LOG` overrides.
fn init_tracing() {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new("warn,flotilla_agent=error"));
    let fmt = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if std::env::var(flotilla_loadtest::LOG_FORMAT_ENV).as_deref() == Ok("json") {
        fmt.json().init();
    } else {
        // Colours for a terminal only: log files and collectors get plain text.
        fmt.with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init();
    }
}
