//! `lb-bench`: lb's benchmarks, driven by `cargo xtask bench` (which builds it in release
//! mode, installs iptables and nftables, and writes docs/benchmarks.md from the results).
//!
//! * `lb-bench run [--quick] [--suite datapath|newflows|northsouth|controlplane]… --out DIR`
//!   runs the suites (all by default) and writes `DIR/results.json` (a list of records
//!   `{suite, case, impl, services, metric, median, p99, unit}`) and `DIR/notes.json` (method
//!   notes and facts for the report). `--quick` is a seconds-long version for the tests.
//! * `lb-bench serve`, `lb-bench flows` and `lb-bench rss` are the backend, the client and the
//!   memory probe the suites start in other processes (`lb-bench sink` and `lb-bench blast`
//!   are north-south's backend and sender); `lb-bench rules` writes the kube-proxy
//!   rule sets the control-plane suite loads, for a look or a manual run.
//!
//! Needs root (BPF, network namespaces, cgroups), `iptables` and `nftables`.
use std::{
    fs,
    net::{Ipv4Addr, SocketAddrV4},
    path::{Path, PathBuf},
    process::ExitCode,
    time::Instant,
};

use anyhow::{Context as _, bail};
use clap::{Parser, Subcommand, ValueEnum};

/// The allocator `lb` runs with, so the in-process control-plane cases measure what it does.
#[global_allocator]
static ALLOC: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

mod controlplane;
mod datapath;
mod kubeproxy;
mod netns;
mod newflows;
mod northsouth;
mod workload;

#[derive(Parser)]
#[command(name = "lb-bench", about = "lb's benchmarks (see docs/benchmarks.md)")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Suite {
    Datapath,
    Newflows,
    Northsouth,
    Controlplane,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run suites and write DIR/results.json and DIR/notes.json.
    Run {
        /// A seconds-long version (fewer, smaller cases) that checks everything runs.
        #[arg(long)]
        quick: bool,
        /// Suites to run (repeatable); all when omitted.
        #[arg(long, value_enum)]
        suite: Vec<Suite>,
        #[arg(long)]
        out: PathBuf,
    },
    /// Backend: answer TCP lines and UDP datagrams on PORT with `NAME\n`.
    Serve {
        #[arg(long)]
        name: String,
        #[arg(long)]
        port: u16,
    },
    /// Client: open new flows one after the other and print a JSON summary.
    Flows {
        /// Comma-separated IPv4 `ip:port` targets, one picked at random per flow.
        #[arg(long, value_delimiter = ',')]
        target: Vec<SocketAddrV4>,
        #[arg(long, value_parser = ["tcp", "udp"])]
        proto: String,
        /// Local address to bind.
        #[arg(long)]
        bind: Ipv4Addr,
        /// Source port of the first flow; each flow takes the next one.
        #[arg(long)]
        first_port: u16,
        #[arg(long)]
        count: usize,
        #[arg(long, default_value_t = 0)]
        warmup: usize,
        #[arg(long, default_value_t = 10_000)]
        max_ms: u64,
    },
    /// North-south sender: UDP datagrams from many source ports (raw socket, sendmmsg) for a
    /// fixed time; prints a JSON summary.
    Blast {
        #[arg(long)]
        target: SocketAddrV4,
        /// Source address of the datagrams.
        #[arg(long)]
        bind: Ipv4Addr,
        /// First source port; the datagrams go round-robin over PORTS ports from here.
        #[arg(long)]
        first_port: u16,
        #[arg(long)]
        ports: usize,
        #[arg(long)]
        ms: u64,
    },
    /// North-south backend: receive and drop UDP datagrams on PORT.
    Sink {
        #[arg(long)]
        port: u16,
    },
    /// Write kube-proxy's iptables-restore input and nftables transaction for N services × E
    /// endpoints (the control-plane suite's rule sets) to DIR.
    Rules {
        #[arg(long)]
        services: usize,
        #[arg(long)]
        endpoints: usize,
        #[arg(long)]
        out: PathBuf,
    },
    /// Memory probe: program N services × E endpoints, print VmHWM and map memory as JSON.
    Rss {
        #[arg(long)]
        services: usize,
        #[arg(long)]
        endpoints: usize,
    },
}

fn main() -> ExitCode {
    let result = match Cli::parse().cmd {
        Cmd::Run { quick, suite, out } => run(quick, &suite, &out),
        Cmd::Serve { name, port } => newflows::serve(&name, port),
        Cmd::Flows {
            target,
            proto,
            bind,
            first_port,
            count,
            warmup,
            max_ms,
        } => newflows::flows(&newflows::FlowsArgs {
            targets: target,
            udp: proto == "udp",
            bind,
            first_port,
            count,
            warmup,
            max_ms,
        }),
        Cmd::Blast {
            target,
            bind,
            first_port,
            ports,
            ms,
        } => northsouth::blast(&northsouth::BlastArgs {
            target,
            bind,
            first_port,
            ports,
            ms,
        }),
        Cmd::Sink { port } => northsouth::sink(port),
        Cmd::Rules {
            services,
            endpoints,
            out,
        } => controlplane::write_rules(services, endpoints, &out),
        Cmd::Rss {
            services,
            endpoints,
        } => controlplane::rss_child(services, endpoints),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("lb-bench: {err:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(quick: bool, suites: &[Suite], out: &Path) -> anyhow::Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("lb-bench must run as root (BPF programs, network namespaces, cgroups)");
    }
    let suites = if suites.is_empty() {
        vec![
            Suite::Datapath,
            Suite::Newflows,
            Suite::Northsouth,
            Suite::Controlplane,
        ]
    } else {
        suites.to_vec()
    };
    fs::create_dir_all(out).with_context(|| format!("mkdir {}", out.display()))?;
    workload::catch_interrupts()?;
    let mut results = workload::Results::default();
    let start = Instant::now();
    for suite in &suites {
        let t = Instant::now();
        println!("== {suite:?}{}", if quick { " (quick)" } else { "" });
        match suite {
            Suite::Datapath => datapath::run(&datapath::Settings::new(quick), &mut results),
            Suite::Newflows => newflows::run(&newflows::Settings::new(quick), &mut results),
            Suite::Northsouth => northsouth::run(&northsouth::Settings::new(quick), &mut results),
            Suite::Controlplane => {
                controlplane::run(&controlplane::Settings::new(quick), &mut results)
            }
        }
        .with_context(|| format!("suite {suite:?}"))?;
        results.note(
            &format!("time_{suite:?}").to_lowercase(),
            format!("{:.0} s", t.elapsed().as_secs_f64()),
        );
    }
    results.note(
        "time_total",
        format!("{:.0} s", start.elapsed().as_secs_f64()),
    );
    results.note("quick", quick.to_string());
    let suite_names: Vec<String> = suites
        .iter()
        .map(|s| format!("{s:?}").to_lowercase())
        .collect();
    results.note("suites", suite_names.join(","));
    let path = out.join("results.json");
    fs::write(
        &path,
        serde_json::to_string_pretty(&results.records)? + "\n",
    )
    .with_context(|| format!("write {}", path.display()))?;
    let notes = out.join("notes.json");
    fs::write(&notes, serde_json::to_string_pretty(&results.notes)? + "\n")
        .with_context(|| format!("write {}", notes.display()))?;
    println!("wrote {} and {}", path.display(), notes.display());
    Ok(())
}
