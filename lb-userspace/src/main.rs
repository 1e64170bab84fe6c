//! The `lb` command.
use std::{io::IsTerminal as _, path::PathBuf};

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use lb::daemon::{self, RunOptions};
use lb_common::DEFAULT_PIN_DIR;
use tracing_subscriber::EnvFilter;

#[derive(Parser)]
#[command(
    name = "lb",
    version,
    about = "eBPF service load balancer replacing kube-proxy"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Load the datapath, program it from a source and keep it in sync.
    Run(RunArgs),
}

#[derive(clap::Args)]
struct RunArgs {
    /// Directory of Service and EndpointSlice manifests (YAML/JSON); SIGHUP re-reads it.
    #[arg(long)]
    manifests: PathBuf,
    /// bpffs directory where the maps are pinned and reused across restarts.
    #[arg(long, default_value = DEFAULT_PIN_DIR)]
    pin_dir: PathBuf,
    /// Socket-level load balancing (connect/sendmsg/recvmsg/getpeername hooks).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    socket_lb: bool,
    /// cgroup v2 directory the socket-LB programs attach to [default: the cgroup v2 root].
    #[arg(long)]
    cgroup_path: Option<PathBuf>,
    /// Interfaces whose tc ingress gets per-packet service NAT (comma-separated or repeated).
    #[arg(long, value_delimiter = ',')]
    tc_ingress: Vec<String>,
    /// Interfaces whose tc egress gets reverse NAT of replies.
    #[arg(long, value_delimiter = ',')]
    tc_egress: Vec<String>,
}

/// Where the unified (v2) cgroup hierarchy is mounted.
fn cgroup2_root() -> anyhow::Result<PathBuf> {
    let mounts =
        std::fs::read_to_string("/proc/self/mounts").context("reading /proc/self/mounts")?;
    mounts
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (_, path, fs) = (f.next()?, f.next()?, f.next()?);
            (fs == "cgroup2").then(|| PathBuf::from(path))
        })
        .min_by_key(|p| p.components().count())
        .context("no cgroup2 mount found; pass --cgroup-path or --socket-lb=false")
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    match Cli::parse().command {
        Command::Run(args) => {
            let cgroup = if args.socket_lb {
                Some(match args.cgroup_path {
                    Some(p) => p,
                    None => cgroup2_root()?,
                })
            } else {
                None
            };
            daemon::run(RunOptions {
                manifests: args.manifests,
                pin_dir: args.pin_dir,
                cgroup,
                tc_ingress: args.tc_ingress,
                tc_egress: args.tc_egress,
            })
            .await
        }
    }
}
