//! `cargo xtask bench [--quick] [--suite datapath|newflows|northsouth|controlplane]…`: sets
//! up (setup installs iptables and nftables too), builds `lb-bench` and `lb` in release mode,
//! runs it, and writes the report.
//!
//! The measuring happens in `lb-bench` (tests/src/bin/lb-bench/); it writes
//! `target/bench/results.json` and `target/bench/notes.json`. A full run (every suite, not
//! quick) writes `docs/benchmarks.md`; a quick or partial run writes
//! `target/bench/benchmarks.md`, so it never replaces the published numbers.
mod report;

use std::{
    fs,
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail, ensure};

use crate::process::{cargo, probe, run, workspace_root};

/// Commands the kube-proxy comparisons run (from the iptables and nftables packages).
const RULE_COMMANDS: [&str; 3] = ["iptables-legacy-restore", "iptables-nft-restore", "nft"];

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Suite {
    Datapath,
    Newflows,
    Northsouth,
    Controlplane,
}

impl Suite {
    fn name(self) -> &'static str {
        match self {
            Suite::Datapath => "datapath",
            Suite::Newflows => "newflows",
            Suite::Northsouth => "northsouth",
            Suite::Controlplane => "controlplane",
        }
    }
}

#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    /// A seconds-long version of every suite (fewer, smaller cases); the report goes to
    /// target/bench/benchmarks.md.
    #[arg(long)]
    quick: bool,
    /// Run only these suites (repeatable); all when omitted.
    #[arg(long, value_enum)]
    suite: Vec<Suite>,
}

pub fn bench(args: &BenchArgs) -> Result<()> {
    if !crate::setup::is_root()? {
        bail!(
            "`cargo xtask bench` must run as root: it loads eBPF programs, creates network \
             namespaces and cgroups, and installs iptables/nftables if missing"
        );
    }
    let started = Instant::now();
    let mut phases: Vec<(&str, Duration)> = Vec::new();

    let t = Instant::now();
    crate::setup::setup()?;
    rule_tools()?;
    phases.push(("setup", t.elapsed()));

    let t = Instant::now();
    // `lb` too: the north-south suite runs `lb run` itself.
    run(cargo().args(["build", "--release", "--bin", "lb-bench", "--bin", "lb"]))?;
    phases.push(("build", t.elapsed()));

    let out = workspace_root().join("target/bench");
    let t = Instant::now();
    let mut cmd = Command::new(workspace_root().join("target/release/lb-bench"));
    cmd.arg("run").arg("--out").arg(&out);
    if args.quick {
        cmd.arg("--quick");
    }
    for suite in &args.suite {
        cmd.args(["--suite", suite.name()]);
    }
    run(&mut cmd)?;
    phases.push(("run", t.elapsed()));

    let results = report::Results::load(&out)?;
    let full = !args.quick
        && (args.suite.is_empty()
            || [
                Suite::Datapath,
                Suite::Newflows,
                Suite::Northsouth,
                Suite::Controlplane,
            ]
            .iter()
            .all(|s| args.suite.contains(s)));
    phases.push(("total", started.elapsed()));
    let text = report::render(&results, &machine_facts(), &phases, args.quick);
    let path = if full {
        workspace_root().join("docs/benchmarks.md")
    } else {
        out.join("benchmarks.md")
    };
    fs::create_dir_all(path.parent().context("report directory")?)?;
    fs::write(&path, text).with_context(|| format!("write {}", path.display()))?;
    for (name, d) in &phases {
        println!("time: {name:<6} {:>7.1} s", d.as_secs_f64());
    }
    println!(
        "wrote {}, {} and {}",
        path.display(),
        out.join("results.json").display(),
        out.join("notes.json").display()
    );
    Ok(())
}

/// Checks the kube-proxy tools are there (`setup` installs the iptables and nftables packages).
fn rule_tools() -> Result<()> {
    for command in RULE_COMMANDS {
        let found = ["/usr/sbin", "/sbin", "/usr/bin"]
            .iter()
            .any(|dir| std::path::Path::new(dir).join(command).exists());
        ensure!(
            found,
            "{command} not found: the Debian packages iptables and nftables provide it \
             (`cargo xtask setup` installs them)"
        );
    }
    Ok(())
}

/// What the report says about the machine.
pub struct MachineFacts {
    pub date: String,
    pub kernel: String,
    pub cpu: String,
    pub cores: usize,
    pub memory: String,
    pub os: String,
    pub iptables: String,
    pub nft: String,
}

fn machine_facts() -> MachineFacts {
    let read = |path: &str| fs::read_to_string(path).unwrap_or_default();
    let cpuinfo = read("/proc/cpuinfo");
    let cpu = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .and_then(|l| l.split_once(':'))
        .map_or_else(|| "unknown".to_owned(), |(_, v)| v.trim().to_owned());
    let cores = cpuinfo
        .lines()
        .filter(|l| l.starts_with("processor"))
        .count();
    let memory = read("/proc/meminfo")
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
        .map_or_else(
            || "unknown".to_owned(),
            |kib| format!("{:.1} GiB", kib / (1024.0 * 1024.0)),
        );
    let os = read("/etc/os-release")
        .lines()
        .find_map(|l| l.strip_prefix("PRETTY_NAME="))
        .map_or_else(|| "unknown".to_owned(), |v| v.trim_matches('"').to_owned());
    let version = |cmd: &mut Command| {
        probe(cmd).map_or_else(|_| "unknown".to_owned(), |v| v.trim().to_owned())
    };
    MachineFacts {
        date: version(Command::new("date").args(["-u", "+%Y-%m-%d %H:%M UTC"])),
        kernel: read("/proc/sys/kernel/osrelease").trim().to_owned(),
        cpu,
        cores,
        memory,
        os,
        iptables: version(Command::new("iptables-legacy").arg("--version")),
        nft: version(Command::new("nft").arg("--version")),
    }
}
