//! `cargo xtask e2e`: Kubernetes' own `e2e.test` (`[sig-network]`) against lb installed the
//! way a user installs it (deploy/rbac.yaml and deploy/daemonset.yaml applied with kubectl,
//! lb running as pods from its image), on real kubelet + containerd nodes on this machine,
//! beside upstream kube-proxy (nftables) on the same cluster shape as the baseline. Prints one
//! table (spec, lb, kube-proxy, time); JUnit files and every component's log stay in
//! `target/e2e/<run>/`.

mod cluster;
mod config;
mod junit;
mod overlay;
mod specs;

use std::{fs, thread, time::Instant};

use anyhow::{Result, ensure};

use self::cluster::{Cluster, Options, Proxy};
use crate::{images, process::workspace_root, setup};

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ProxyChoice {
    Lb,
    KubeProxy,
    Both,
}

#[derive(Debug, clap::Args)]
pub struct E2eArgs {
    /// The service proxy: lb (its DaemonSet from deploy/), upstream kube-proxy (nftables), or
    /// both one after the other on fresh clusters of the same shape.
    #[arg(long, value_enum, default_value = "both")]
    proxy: ProxyChoice,
    /// Nodes (each a netns with containerd and kubelet), 1 to 3.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u8).range(1..=3))]
    nodes: u8,
    /// Ginkgo focus expression instead of the default set's (or the conformance subset's).
    #[arg(long)]
    focus: Option<String>,
    /// Ginkgo skip expression instead of the default set's.
    #[arg(long)]
    skip: Option<String>,
    /// Only the conformance subset (what `cargo xtask test` runs with lb).
    #[arg(long)]
    conformance: bool,
    /// Leave the (last) cluster up; prints its kubeconfig and how to enter its netns.
    #[arg(long)]
    keep: bool,
    /// An extra `lb run` flag for the DaemonSet overlay, e.g. `--lb-arg=--tc-pod=cni0`
    /// (repeatable).
    #[arg(long = "lb-arg", allow_hyphen_values = true)]
    lb_args: Vec<String>,
    /// With `--proxy both`: run the two clusters at the same time (about half the wall time;
    /// each has its own netns, cgroups and pins, so they do not meet), at the price of a
    /// busier machine during the suites.
    #[arg(long)]
    parallel: bool,
    /// Only remove what earlier runs left behind (runs kept with --keep included), then exit.
    #[arg(long)]
    sweep: bool,
}

/// `cargo xtask e2e`.
pub fn e2e(args: &E2eArgs) -> Result<()> {
    ensure!(
        setup::is_root()?,
        "`cargo xtask e2e` must run as root: it creates network namespaces, cgroups and mounts"
    );
    if args.sweep {
        for id in cluster::runs() {
            cluster::sweep(&id)?;
        }
        return Ok(());
    }
    let proxies = match args.proxy {
        ProxyChoice::Lb => vec![Proxy::Lb],
        ProxyChoice::KubeProxy => vec![Proxy::KubeProxy],
        ProxyChoice::Both => vec![Proxy::Lb, Proxy::KubeProxy],
    };
    let (focus, skip) = selection(args);
    let outcome = run(&RunSpec {
        proxies,
        nodes: args.nodes,
        focus,
        skip,
        keep: args.keep,
        lb_args: args.lb_args.clone(),
        parallel: args.parallel,
    })?;
    ensure!(
        outcome.completed,
        "e2e.test did not complete for every proxy (see above)"
    );
    Ok(())
}

/// The last phase of `cargo xtask test`: the conformance subset with lb only, on 2 nodes;
/// fails on any failed spec.
pub fn conformance_phase() -> Result<()> {
    let outcome = run(&RunSpec {
        proxies: vec![Proxy::Lb],
        nodes: 2,
        focus: specs::CONFORMANCE_FOCUS.to_owned(),
        skip: specs::CONFORMANCE_SKIP.to_owned(),
        keep: false,
        lb_args: Vec::new(),
        parallel: false,
    })?;
    ensure!(outcome.completed, "e2e.test did not complete");
    ensure!(
        outcome.failed == 0,
        "{} conformance spec(s) failed with lb",
        outcome.failed
    );
    ensure!(outcome.passed > 0, "no conformance spec ran");
    Ok(())
}

fn selection(args: &E2eArgs) -> (String, String) {
    let focus = args.focus.clone().unwrap_or_else(|| {
        if args.conformance {
            specs::CONFORMANCE_FOCUS.to_owned()
        } else {
            specs::DEFAULT_FOCUS.to_owned()
        }
    });
    let skip = args.skip.clone().unwrap_or_else(|| {
        if args.conformance {
            specs::CONFORMANCE_SKIP.to_owned()
        } else {
            specs::default_skip()
        }
    });
    (focus, skip)
}

struct RunSpec {
    proxies: Vec<Proxy>,
    nodes: u8,
    focus: String,
    skip: String,
    keep: bool,
    lb_args: Vec<String>,
    parallel: bool,
}

struct RunOutcome {
    /// e2e.test ran to its end (and wrote its report) for every proxy.
    completed: bool,
    passed: usize,
    failed: usize,
}

/// One proxy's cluster and suite: its cases, and whether the suite completed.
fn run_one(
    cluster_id: &str,
    options: &Options,
    spec: &RunSpec,
    run_dir: &std::path::Path,
) -> Result<(Vec<junit::Case>, bool)> {
    let proxy = options.proxy;
    let up = Instant::now();
    let mut cluster = Cluster::up(cluster_id, options)?;
    println!(
        "time: e2e cluster up ({}) {:.1} s",
        proxy.name(),
        up.elapsed().as_secs_f64()
    );
    let suite = Instant::now();
    let report_dir = run_dir.join(format!("junit-{}", proxy.name()));
    let ok = cluster.run_e2e(&spec.focus, &spec.skip, &report_dir)?;
    println!(
        "time: e2e suite ({}) {:.1} s",
        proxy.name(),
        suite.elapsed().as_secs_f64()
    );
    let report = report_dir.join("junit_01.xml");
    let mut completed = true;
    let cases = match fs::read_to_string(&report) {
        Ok(xml) => junit::parse(&xml)?,
        Err(err) => {
            println!(
                "e2e: {} has no report ({err}); e2e.test's log: {}",
                report.display(),
                options.dir.join("logs/e2e.test.log").display()
            );
            completed = false;
            Vec::new()
        }
    };
    if !ok
        && cases
            .iter()
            .all(|c| !matches!(c.outcome, junit::Outcome::Failed(_)))
    {
        // Exited non-zero without a failed spec: the suite itself broke.
        completed = false;
    }
    if options.keep {
        cluster.keep_running()?;
    }
    Ok((cases, completed))
}

fn run(spec: &RunSpec) -> Result<RunOutcome> {
    let total = Instant::now();
    cluster::catch_interrupts();
    let start = Instant::now();
    setup::setup_for_e2e()?;
    println!("time: e2e tools {:.1} s", start.elapsed().as_secs_f64());
    cluster::sweep_stale()?;

    let start = Instant::now();
    let id = cluster::new_id()?;
    let run_dir = workspace_root().join("target/e2e").join(&id);
    fs::create_dir_all(&run_dir)?;
    let images_dir = workspace_root().join("target/e2e/images");
    let bin = workspace_root().join("target/tools/bin");
    let mut archives = images::e2e_images(
        &images::E2eInputs {
            pause: bin.join("pause"),
            agnhost: bin.join("agnhost"),
            boom_server: bin.join("regression-issue-74839"),
        },
        &images_dir,
    )?;
    let lb_image = if spec.proxies.contains(&Proxy::Lb) {
        let lb = crate::image::static_lb()?;
        let (name, archive) = images::lb_image(&lb, &images_dir)?;
        archives.push((name.clone(), archive));
        Some(name)
    } else {
        None
    };
    println!("time: e2e images {:.1} s", start.elapsed().as_secs_f64());

    let one = |i: usize, proxy: Proxy| {
        let options = Options {
            nodes: spec.nodes,
            proxy,
            dir: run_dir.join(proxy.name()),
            images: archives.clone(),
            lb_image: lb_image.clone(),
            lb_args: spec.lb_args.clone(),
            keep: spec.keep && (spec.parallel || i + 1 == spec.proxies.len()),
        };
        let cluster_id = format!("{id}{}", if proxy == Proxy::Lb { "l" } else { "k" });
        match run_one(&cluster_id, &options, spec, &run_dir) {
            Ok((cases, ok)) => (proxy, cases, ok),
            Err(err) => {
                println!("e2e: {}: {err:#}", proxy.name());
                (proxy, Vec::new(), false)
            }
        }
    };
    let mut results: Vec<(Proxy, Vec<junit::Case>, bool)> = Vec::new();
    if spec.parallel {
        // Each cluster's processes belong to the thread that started them (they are killed
        // when it ends), so each proxy's run stays on one thread from start to teardown.
        thread::scope(|scope| {
            let handles: Vec<_> = spec
                .proxies
                .iter()
                .enumerate()
                .map(|(i, proxy)| scope.spawn(move || one(i, *proxy)))
                .collect();
            for h in handles {
                if let Ok(r) = h.join() {
                    results.push(r);
                }
            }
        });
    } else {
        for (i, proxy) in spec.proxies.iter().copied().enumerate() {
            results.push(one(i, proxy));
            if cluster::interrupted() {
                break;
            }
        }
    }
    let completed = results.len() == spec.proxies.len() && results.iter().all(|r| r.2);

    let runs: Vec<(&str, &[junit::Case])> = results
        .iter()
        .map(|(p, cases, _)| (p.name(), cases.as_slice()))
        .collect();
    let table = junit::table(&runs);
    fs::write(run_dir.join("results.md"), &table)?;
    println!("\n{table}");
    println!(
        "e2e: JUnit files and logs in {} (total {:.0} s)",
        run_dir.display(),
        total.elapsed().as_secs_f64()
    );
    let (passed, failed, _) = results
        .iter()
        .map(|(_, c, _)| junit::summary(c))
        .fold((0, 0, 0), |a, b| (a.0 + b.0, a.1 + b.1, a.2 + b.2));
    Ok(RunOutcome {
        completed,
        passed,
        failed,
    })
}
