//! The `lb` command.
use std::io::IsTerminal as _;

use clap::Parser as _;
use lb::cli::Cli;
use tracing_subscriber::EnvFilter;

/// jemalloc: see the workspace Cargo.toml for why.
#[global_allocator]
static ALLOC: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    lb::cli::run(Cli::parse()).await
}
