//! Developer tasks for lb, run as `cargo xtask <command>`.

mod bench;
mod e2e;
mod image;
mod images;
mod kernels;
mod oci;
mod process;
mod setup;

use std::{
    ffi::OsString,
    os::unix::process::CommandExt as _,
    process::{Command, ExitCode},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail, ensure};
use clap::{Parser, Subcommand};

use crate::process::{cargo, display, run, workspace_root};

#[derive(Parser)]
#[command(about = "Developer tasks for lb", bin_name = "cargo xtask")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Install and check what building and testing need (Debian packages, bpf-linker, bpffs,
    /// the Kubernetes control plane the tests use, the e2e cluster's node tools and e2e.test,
    /// QEMU, virtme-ng and the 5.10 kernel).
    Setup,
    /// Set up, then build the default workspace members (lb-ebpf comes through lb-userspace).
    Build {
        #[arg(long)]
        release: bool,
    },
    /// Set up, build the binaries and run every test on the host kernel, then the
    /// kernel-dependent suites on the floor kernel (5.10) in a VM; needs root.
    Test {
        /// Run the kernel-dependent suites (datapath, netns, trace, northsouth) on these kernels
        /// instead: `host` (native), `5.10`, `6.1`, `6.12`, `newest` (comma-separated), or
        /// `all`, which also rewrites the kernel table in docs/datapath.md. Without a name: list
        /// them.
        #[arg(long, num_args = 0..=1, default_missing_value = "")]
        kernel: Option<String>,
        /// Extra arguments for `cargo test`, e.g. `-- -p lb-tests --test netns -- --nocapture`;
        /// with `--kernel`, arguments for the suites' test executables instead, e.g. a test
        /// name filter: `--kernel 6.1 -- connected_udp`.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<OsString>,
    },
    /// Set up, build the binaries and run lb-demo.
    Demo {
        /// Run the demo against a real control plane (etcd, kube-apiserver, the EndpointSlice
        /// controller), objects created with kubectl; sets up the Kubernetes binaries first.
        #[arg(long)]
        kubernetes: bool,
        /// Arguments for lb-demo.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<OsString>,
    },
    /// Build the container image (deploy/Containerfile, FROM scratch) around a statically
    /// linked lb, as registry.example.invalid/lb:<version> in the OCI archive
    /// target/image/lb.oci.tar (for `ctr images import`); needs root.
    Image,
    /// Write the OCI archives of the images Kubernetes' e2e suite runs (pause, agnhost,
    /// busybox, nginx, regression-issue-74839) for `ctr -n k8s.io images import`, from these
    /// binaries and the host's Debian packages; unchanged ones are not rewritten.
    E2eImages {
        /// The static pause program.
        #[arg(long)]
        pause: std::path::PathBuf,
        /// k8s.io/kubernetes/test/images/agnhost, built static.
        #[arg(long)]
        agnhost: std::path::PathBuf,
        /// k8s.io/kubernetes/test/images/regression-issue-74839, built static.
        #[arg(long)]
        boom_server: std::path::PathBuf,
        /// Where the archives go [default: target/e2e-images in the workspace].
        #[arg(long)]
        out: Option<std::path::PathBuf>,
    },
    /// Check formatting and run clippy with warnings denied.
    Lint,
    /// Run Kubernetes' e2e.test ([sig-network]) against lb installed from deploy/ as a
    /// DaemonSet and against kube-proxy (nftables), on real kubelet + containerd nodes in
    /// network namespaces of this machine; prints one table. Needs root.
    E2e(e2e::E2eArgs),
    /// Run the benchmarks (lb-bench) and write docs/benchmarks.md; needs root.
    Bench(bench::BenchArgs),
    /// Set up, then run the datapath fuzzer (the `fuzz` suite) at full length: random and
    /// mutated frames through every tc and XDP program; needs root.
    Fuzz {
        /// Frames to generate, each run through all four packet programs.
        #[arg(long, default_value_t = FUZZ_PACKETS)]
        packets: u64,
        /// Seed of the generator (a failure report names it); random when omitted.
        #[arg(long)]
        seed: Option<u64>,
    },
    /// Inside a kernel-matrix VM: run the suites, write `result.json` to `--out`.
    #[command(hide = true)]
    VmGuest {
        #[arg(long)]
        out: std::path::PathBuf,
        /// An argument for each suite's test executable (repeatable).
        #[arg(long = "test-arg", allow_hyphen_values = true)]
        test_args: Vec<String>,
        /// `NAME=PATH` of each suite's test executable.
        suites: Vec<String>,
    },
}

fn main() -> ExitCode {
    // Print the error chain on one line, without the backtrace anyhow adds under RUST_BACKTRACE.
    run_task(Cli::parse().task).unwrap_or_else(|err| {
        eprintln!("error: {err:#}");
        ExitCode::FAILURE
    })
}

fn run_task(task: Task) -> Result<ExitCode> {
    match task {
        Task::Setup => {
            setup::setup_for_tests()?;
            setup::nodes::node_tools()?;
            setup::vm::vm_tools()?;
            setup::vm::kernels(&[setup::vm::FLOOR])?;
        }
        Task::Build { release } => build(release)?,
        Task::Test { kernel, args } => test(kernel.as_deref(), &args)?,
        Task::Demo { kubernetes, args } => demo(kubernetes, &args)?,
        Task::Image => image::image()?,
        Task::E2eImages {
            pause,
            agnhost,
            boom_server,
            out,
        } => {
            let inputs = images::E2eInputs {
                pause,
                agnhost,
                boom_server,
            };
            let out = out.unwrap_or_else(|| workspace_root().join("target/e2e-images"));
            for (name, archive) in images::e2e_images(&inputs, &out)? {
                println!("{name}\t{}", archive.display());
            }
        }
        Task::Lint => lint()?,
        Task::E2e(args) => e2e::e2e(&args)?,
        Task::Bench(args) => bench::bench(&args)?,
        Task::Fuzz { packets, seed } => fuzz(packets, seed)?,
        Task::VmGuest {
            out,
            suites,
            test_args,
        } => kernels::guest(&out, &suites, &test_args)?,
    }
    Ok(ExitCode::SUCCESS)
}

fn build(release: bool) -> Result<()> {
    setup::setup()?;
    // Plain `cargo build` in the root builds the default members; `--workspace` would also
    // pick lb-ebpf, which only builds for the BPF target.
    let mut cmd = cargo();
    cmd.arg("build");
    if release {
        cmd.arg("--release");
    }
    run(&mut cmd)
}

fn test(kernel: Option<&str>, args: &[OsString]) -> Result<()> {
    let selection = kernel.map(kernels::Selection::parse).transpose()?;
    if let Some(kernels::Selection::List) = selection {
        kernels::list();
        return Ok(());
    }
    if !setup::is_root()? {
        bail!(
            "`cargo xtask test` must run as root: the datapath and network-namespace tests load \
             eBPF programs and create network namespaces (CAP_BPF, CAP_NET_ADMIN)"
        );
    }
    let mut phases = Phases::default();
    let result = test_phases(&mut phases, selection, args);
    phases.report();
    result
}

fn test_phases(
    phases: &mut Phases,
    selection: Option<kernels::Selection>,
    args: &[OsString],
) -> Result<()> {
    use kernels::Selection;
    // Without --kernel: everything on the host, then the floor kernel's VM.
    let (full_host, host_suites, vms): (bool, bool, Vec<&'static str>) = match &selection {
        None => (true, false, vec![setup::vm::FLOOR]),
        Some(Selection::All) => (
            false,
            true,
            setup::vm::KERNELS.iter().map(|k| k.name).collect(),
        ),
        Some(Selection::Some(names)) => (
            false,
            names.iter().any(|n| n == "host"),
            setup::vm::KERNELS
                .iter()
                .map(|k| k.name)
                .filter(|k| names.iter().any(|n| n == k))
                .collect(),
        ),
        Some(Selection::List) => unreachable!("listed above"),
    };
    if full_host {
        phases.time("setup", setup::setup_for_tests)?;
    } else {
        phases.time("setup", setup::setup)?;
    }
    let (tools, kernels) = if vms.is_empty() {
        (None, Vec::new())
    } else {
        let mut found = (None, Vec::new());
        phases.time("vm setup", || {
            let tools = setup::vm::vm_tools()?;
            found = (Some(tools), setup::vm::kernels(&vms)?);
            Ok(())
        })?;
        found
    };
    // The tests start target/debug/{lb,lb-echo,lb-demo}, which `cargo test` does not build.
    phases.time("build", || run(cargo().args(["build", "--bins"])))?;
    if full_host {
        phases.time("test", || {
            run(cargo().args(["test", "--no-fail-fast"]).args(args))
        })?;
    }
    if !host_suites && kernels.is_empty() {
        return Ok(());
    }
    let mut bins = Vec::new();
    phases.time("build suites", || {
        bins = kernels::suite_binaries()?;
        Ok(())
    })?;
    // With --kernel, the extra arguments are the suite executables' (filters).
    let test_args: Vec<String> = if full_host {
        Vec::new()
    } else {
        args.iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect()
    };
    let mut results = Vec::new();
    let mut failures = Vec::new();
    if host_suites {
        phases.time("host", || {
            let r = kernels::run_host(&bins, &test_args)?;
            if !r.ok() {
                failures.push("host".to_owned());
            }
            results.push(r);
            Ok(())
        })?;
    }
    if let Some(tools) = &tools {
        for k in &kernels {
            let phase: &'static str = match k.name {
                "5.10" => "vm 5.10",
                "6.1" => "vm 6.1",
                "6.12" => "vm 6.12",
                _ => "vm newest",
            };
            let outcome = phases.time(phase, || {
                let r = kernels::run_vm(tools, k, &bins, &test_args)?;
                let ok = r.ok();
                results.push(r);
                ensure!(ok, "suites failed");
                Ok(())
            });
            if let Err(e) = outcome {
                println!("kernel {}: {e:#}", k.name);
                failures.push(k.name.to_owned());
            }
        }
    }
    // Last: Kubernetes' own conformance specs against lb installed from deploy/ as a DaemonSet
    // on real kubelet + containerd nodes (`cargo xtask e2e --conformance`, lb only).
    if full_host {
        let outcome = phases.time("e2e", e2e::conformance_phase);
        if let Err(e) = outcome {
            println!("e2e: {e:#}");
            failures.push("e2e (conformance)".to_owned());
        }
    }
    let table = kernels::table(&results);
    println!("\n{table}");
    // A filtered run is not the whole matrix.
    if matches!(selection, Some(Selection::All)) && test_args.is_empty() {
        kernels::write_kernel_table(&table)?;
    }
    if !failures.is_empty() {
        bail!("kernel-dependent suites failed on: {}", failures.join(", "));
    }
    Ok(())
}

/// The full fuzz run's frames (the quick form in `cargo test` runs 30,000).
const FUZZ_PACKETS: u64 = 1_000_000;

fn fuzz(packets: u64, seed: Option<u64>) -> Result<()> {
    if !setup::is_root()? {
        bail!("`cargo xtask fuzz` must run as root: it loads the eBPF programs (CAP_BPF)");
    }
    setup::setup()?;
    // The suite itself, as `cargo test` builds it (lb-ebpf comes through lb-userspace), with
    // the length and seed in its environment.
    let mut cmd = cargo();
    cmd.args([
        "test",
        "-p",
        "lb-tests",
        "--test",
        "fuzz",
        "--",
        "--nocapture",
    ])
    .env("LB_FUZZ_PACKETS", packets.to_string());
    if let Some(seed) = seed {
        cmd.env("LB_FUZZ_SEED", seed.to_string());
    }
    run(&mut cmd)
}

fn demo(kubernetes: bool, args: &[OsString]) -> Result<()> {
    if kubernetes {
        setup::setup_for_demo_kubernetes()?;
    } else {
        setup::setup()?;
    }
    run(cargo().args(["build", "--bins"]))?;
    let mut cmd = Command::new(workspace_root().join("target/debug/lb-demo"));
    if kubernetes {
        cmd.arg("--kubernetes");
    }
    cmd.args(args).current_dir(workspace_root());
    println!("$ {}", display(&cmd));
    // lb-demo replaces this process, so its exit code and signals (Ctrl-C) pass straight through.
    let err = cmd.exec();
    Err(err).with_context(|| format!("could not start `{}`", display(&cmd)))
}

fn lint() -> Result<()> {
    // Clippy runs lb-userspace's build script, which builds lb-ebpf with the tools setup provides.
    setup::setup()?;
    // Run both so one run shows every problem.
    let failures: Vec<String> = [
        run(cargo().args(["fmt", "--all", "--", "--check"])),
        run(cargo().args(["clippy", "--all-targets", "--", "-D", "warnings"])),
    ]
    .into_iter()
    .filter_map(|result| result.err().map(|err| err.to_string()))
    .collect();
    if !failures.is_empty() {
        bail!("lint failed:\n  {}", failures.join("\n  "));
    }
    Ok(())
}

/// Wall time of each phase of a task, reported at the end.
#[derive(Default)]
struct Phases(Vec<(&'static str, Duration, bool)>);

impl Phases {
    fn time(&mut self, name: &'static str, phase: impl FnOnce() -> Result<()>) -> Result<()> {
        let start = Instant::now();
        let result = phase();
        self.0.push((name, start.elapsed(), result.is_ok()));
        result
    }

    fn report(&self) {
        for (name, elapsed, ok) in &self.0 {
            let outcome = if *ok { "ok" } else { "FAILED" };
            let secs = elapsed.as_secs_f64();
            println!("time: {name:<6} {secs:>7.1} s  {outcome}");
        }
    }
}
