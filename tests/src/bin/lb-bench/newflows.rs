//! `newflows`: real connections in network namespaces. A client opens new flows to a service
//! VIP (TCP: connect, one request, close; UDP: one request/response from a fresh source port)
//! through a node netns that runs one implementation, to two backends:
//!
//! - `lb_socket`: lb's cgroup socket hooks (the client sits in the testbed's cgroup);
//! - `lb_tc`: lb's tc programs on every node interface, socket LB off;
//! - `iptables` / `iptables_nft`: kube-proxy's iptables-mode rules (iptables-legacy and the
//!   nf_tables backend), loaded with `iptables-restore` inside the node netns;
//! - `nftables`: kube-proxy's nftables-mode table, loaded with `nft -f` inside the node netns;
//! - `direct`: the client connects to the backends' own addresses (no service at all: the floor).
//!
//! Every implementation has its own testbed (the direct floor shares lb_socket's, with the
//! client outside the cgroup, so no hook runs), all built from the same Service and
//! EndpointSlice objects. The traced service is the last one in rule order (iptables' worst
//! case) or one picked at random. Source ports are assigned sequentially and never reused
//! within a testbed, so every flow is new to conntrack and to lb's conntrack.
use std::{
    io::{Read as _, Write as _},
    net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, TcpStream, UdpSocket},
    os::fd::{FromRawFd as _, OwnedFd},
    path::Path,
    process::Command,
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail, ensure};
use lb::{
    datapath::load::{Datapath, LoadOptions, TcHook},
    datapath::maps::BpfMaps,
    reconcile::Reconciler,
    translate::{NodeInfo, desired_state},
};
use lb_tests::testbed::Testbed;

use crate::{
    kubeproxy::{self, Config},
    netns::{self, TempDir},
    workload::{self, Objects, PinCpu, PortDef, Results, Rng, ServiceDef},
};

const SUITE: &str = "newflows";
const BACKEND_PORT: u16 = 8080;
const FIRST_CLIENT_PORT: u32 = 1024;

pub struct Settings {
    pub sizes: Vec<usize>,
    pub reps: usize,
    /// Measured flows per sample (after `warmup` unmeasured ones).
    pub flows: usize,
    pub warmup: usize,
    /// Bound on one sample's measured loop.
    pub max_ms: u64,
    /// Largest service count iptables-nft is loaded at (`iptables-nft-restore --noflush`
    /// slows down faster than linearly with the number of chains).
    pub iptables_nft_max: usize,
    /// The implementations measured (all unless narrowed by `LB_BENCH_NEWFLOWS`).
    impls: Vec<Impl>,
}

impl Settings {
    pub fn new(quick: bool) -> Self {
        let mut s = Self::defaults(quick);
        // For investigating one comparison:
        // `LB_BENCH_NEWFLOWS=sizes=1+30000,reps=5,flows=4000,impls=direct+lb_socket+lb_tc`.
        if let Ok(v) = std::env::var("LB_BENCH_NEWFLOWS") {
            for kv in v.split(',') {
                match kv.split_once('=') {
                    Some(("sizes", n)) => {
                        s.sizes = n.split('+').filter_map(|x| x.parse().ok()).collect();
                    }
                    Some(("reps", n)) => s.reps = n.parse().unwrap_or(s.reps),
                    Some(("flows", n)) => s.flows = n.parse().unwrap_or(s.flows),
                    Some(("impls", n)) => {
                        s.impls = Impl::ALL
                            .into_iter()
                            .filter(|i| n.split('+').any(|x| x == i.name()))
                            .collect();
                    }
                    _ => {}
                }
            }
        }
        s
    }

    fn defaults(quick: bool) -> Self {
        if quick {
            Self {
                sizes: vec![1, 100],
                reps: 3,
                flows: 100,
                warmup: 10,
                max_ms: 5_000,
                iptables_nft_max: usize::MAX,
                impls: Impl::ALL.to_vec(),
            }
        } else {
            Self {
                sizes: vec![1, 1_000, 10_000, 30_000],
                reps: 5,
                flows: 4_000,
                warmup: 20,
                max_ms: 10_000,
                iptables_nft_max: 10_000,
                impls: Impl::ALL.to_vec(),
            }
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Impl {
    Direct,
    Socket,
    Tc,
    Iptables,
    IptablesNft,
    Nftables,
}

impl Impl {
    const ALL: [Impl; 6] = [
        Impl::Direct,
        Impl::Socket,
        Impl::Tc,
        Impl::Iptables,
        Impl::IptablesNft,
        Impl::Nftables,
    ];

    fn name(self) -> &'static str {
        match self {
            Impl::Direct => "direct",
            Impl::Socket => "lb_socket",
            Impl::Tc => "lb_tc",
            Impl::Iptables => "iptables",
            Impl::IptablesNft => "iptables_nft",
            Impl::Nftables => "nftables",
        }
    }

    /// Index of the testbed this implementation runs in.
    fn bed(self) -> usize {
        match self {
            Impl::Direct | Impl::Socket => 0,
            Impl::Tc => 1,
            Impl::Iptables => 2,
            Impl::IptablesNft => 3,
            Impl::Nftables => 4,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Proto {
    Tcp,
    Udp,
}

impl Proto {
    fn name(self) -> &'static str {
        match self {
            Proto::Tcp => "tcp",
            Proto::Udp => "udp",
        }
    }
}

/// lb's datapath loaded and programmed for one testbed; dropping it detaches everything.
struct LbAgent {
    _datapath: Datapath,
    _reconciler: Reconciler<BpfMaps>,
}

/// One testbed and the implementation loaded into it (lb is dropped, so detached, first).
struct Bed {
    lb: Option<LbAgent>,
    tb: Testbed,
}

/// The client's second address, used by the direct floor (which shares lb_socket's testbed)
/// so that each implementation has source ports of its own.
const DIRECT_CLIENT: Ipv4Addr = Ipv4Addr::new(198, 18, 10, 3);

/// A service every client request goes to: two ports, both to the two real backends.
fn traced(i: usize, backends: &[Ipv4Addr]) -> ServiceDef {
    ServiceDef {
        index: i,
        vip: workload::vip(i),
        ports: vec![
            PortDef {
                name: "tcp",
                protocol: "TCP",
                port: 80,
                target: BACKEND_PORT,
            },
            PortDef {
                name: "udp",
                protocol: "UDP",
                port: 53,
                target: BACKEND_PORT,
            },
        ],
        endpoints: backends.to_vec(),
    }
}

pub fn run(settings: &Settings, results: &mut Results) -> anyhow::Result<()> {
    let exe = std::env::current_exe().context("path of lb-bench")?;
    let mut rng = Rng::new(0x5eed);
    for &n in &settings.sizes {
        let random = (n > 1).then(|| rng.below(n - 1));
        run_size(settings, results, &exe, n, random, &mut rng)
            .with_context(|| format!("newflows at {n} services"))?;
    }
    results.note(
        "newflows_method",
        format!(
            "one sequential client; client and backends pinned to one CPU (so is the softirq \
             work of their packets), so a flow costs CPU time rather than cross-CPU wake-ups; \
             per sample {} warm-up then {} measured new flows (bounded by {} ms); new flows/s \
             = completed flows / wall time of the measured loop; \
             latency = connect() for TCP, request to response for UDP; median over {} samples \
             per cell (latency: median of the samples' p50 and p99); implementations \
             interleaved in a shuffled order within every repetition",
            settings.warmup, settings.flows, settings.max_ms, settings.reps
        ),
    );
    Ok(())
}

fn run_size(
    settings: &Settings,
    results: &mut Results,
    exe: &Path,
    n: usize,
    random: Option<usize>,
    rng: &mut Rng,
) -> anyhow::Result<()> {
    println!("newflows: {n} services, building 5 testbeds");
    let mut beds = Vec::new();
    for _ in 0..5 {
        let mut tb = Testbed::create(2)?;
        tb.start_echo_servers(exe, BACKEND_PORT)?;
        beds.push(Bed { lb: None, tb });
    }
    let mut cmd = Command::new("ip");
    cmd.args([
        "addr",
        "add",
        &format!("{DIRECT_CLIENT}/24"),
        "dev",
        lb_tests::testbed::HOST_IF,
    ]);
    netns::run(&beds[0].tb.client.ns, cmd)?;
    let impls: Vec<Impl> = settings
        .impls
        .iter()
        .copied()
        .filter(|i| *i != Impl::IptablesNft || n <= settings.iptables_nft_max)
        .collect();
    if settings.impls.contains(&Impl::IptablesNft) && !impls.contains(&Impl::IptablesNft) {
        results.note(
            &format!("not_measured_newflows_iptables_nft_{n:06}"),
            format!(
                "iptables_nft at {n} services: not loaded; iptables-nft-restore --noflush (as \
                 kube-proxy runs it) slows down faster than linearly with the number of chains \
                 (see the load times), which would not fit the run's time budget"
            ),
        );
    }
    // Next unused client source port per (implementation, protocol).
    let mut next_port = vec![[FIRST_CLIENT_PORT; 2]; Impl::ALL.len()];
    // Every testbed uses the same addresses, so one set of objects serves all of them.
    let backends: Vec<Ipv4Addr> = beds[0].tb.backends.iter().map(|b| b.ipv4).collect();
    let mut defs = workload::fillers(n, 2);
    defs[n - 1] = traced(n - 1, &backends);
    if let Some(r) = random {
        defs[r] = traced(r, &backends);
        results.note(
            &format!("newflows_position_{n:06}"),
            format!(
                "at {n} services the randomly placed traced service is number {} in rule \
                 order (its TCP rule is number {} of {} in KUBE-SERVICES)",
                r + 1,
                r + 1,
                n + 2
            ),
        );
    }
    let objects = workload::objects(&defs);
    let tmp = TempDir::new("newflows")?;
    program(&mut beds, &objects, &tmp, results, n, &impls)?;

    let mut cases = vec![(Proto::Tcp, "last", n - 1), (Proto::Udp, "last", n - 1)];
    if let Some(r) = random {
        cases.push((Proto::Tcp, "random", r));
        cases.push((Proto::Udp, "random", r));
    }
    // (case, impl) → per-sample (rate, p50, p99).
    let mut samples = vec![vec![Vec::new(); Impl::ALL.len()]; cases.len()];
    // (case, impl) → lb's programs' summed runs and flows attempted.
    let mut bpf = vec![vec![ProgTime::default(); Impl::ALL.len()]; cases.len()];
    for rep in 0..settings.reps {
        for (c, (proto, _, svc)) in cases.iter().enumerate() {
            let mut order = impls.clone();
            rng.shuffle(&mut order);
            for imp in order {
                workload::check_interrupted()?;
                let targets: Vec<SocketAddrV4> = match (imp, proto) {
                    (Impl::Direct, _) => backends
                        .iter()
                        .map(|b| SocketAddrV4::new(*b, BACKEND_PORT))
                        .collect(),
                    (_, Proto::Tcp) => vec![SocketAddrV4::new(workload::vip(*svc), 80)],
                    (_, Proto::Udp) => vec![SocketAddrV4::new(workload::vip(*svc), 53)],
                };
                let index = Impl::ALL.iter().position(|i| *i == imp).unwrap_or(0);
                let port = &mut next_port[index][usize::from(*proto == Proto::Udp)];
                let stats = measure(&beds[imp.bed()], imp, &targets, *proto, port, settings)
                    .with_context(|| format!("{} {} rep {rep}", imp.name(), proto.name()))?;
                samples[c][index].push(stats);
            }
        }
    }
    // One more sample of each lb implementation with the kernel's per-program run-time stats
    // on, so the report can say how much of lb's cost per flow is its own programs. Not in
    // the measured samples: in a VM the stats' two clock reads per run are no small part of a
    // program's cost.
    match aya::sys::enable_stats(aya::sys::Stats::RunTime) {
        Ok(_stats_on) => {
            for (c, (proto, _, svc)) in cases.iter().enumerate() {
                for imp in [Impl::Socket, Impl::Tc] {
                    if !impls.contains(&imp) {
                        continue;
                    }
                    let targets = match proto {
                        Proto::Tcp => vec![SocketAddrV4::new(workload::vip(*svc), 80)],
                        Proto::Udp => vec![SocketAddrV4::new(workload::vip(*svc), 53)],
                    };
                    let index = Impl::ALL.iter().position(|i| *i == imp).unwrap_or(0);
                    let port = &mut next_port[index][usize::from(*proto == Proto::Udp)];
                    let before = prog_stats()?;
                    let stats = measure(&beds[imp.bed()], imp, &targets, *proto, port, settings)
                        .with_context(|| format!("{} {} profile", imp.name(), proto.name()))?;
                    let t = &mut bpf[c][index];
                    t.add(&before, &prog_stats()?);
                    t.flows += stats.ok + stats.errors + settings.warmup;
                }
            }
        }
        Err(e) => results.note(
            "not_measured_newflows_bpf",
            format!("lb's per-program time per flow: BPF run-time stats unavailable ({e})"),
        ),
    }
    for (c, (proto, which, _)) in cases.iter().enumerate() {
        let case = format!("{}_{which}", proto.name());
        for (i, imp) in Impl::ALL.iter().enumerate() {
            let s = &samples[c][i];
            if s.is_empty() {
                continue;
            }
            let mut rates: Vec<f64> = s.iter().map(|x| x.rate).collect();
            let mut p50: Vec<f64> = s.iter().map(|x| x.p50_us).collect();
            let mut p99: Vec<f64> = s.iter().map(|x| x.p99_us).collect();
            let direct = Impl::ALL
                .iter()
                .position(|i| *i == Impl::Direct)
                .unwrap_or(0);
            if bpf[c][i].flows > 0 && !samples[c][direct].is_empty() {
                let mut floor: Vec<f64> = samples[c][direct].iter().map(|x| x.rate).collect();
                let floor = workload::median(&mut floor);
                let rate = workload::median(&mut rates.clone());
                results.note(
                    &format!("newflows_bpf_{n:06}_{case}_{}", imp.name()),
                    format!(
                        "{} {case} at {n} services: a flow took {:.2} µs of wall time, {:.2} µs \
                         more than the direct floor's {:.2} µs; in one more sample with BPF \
                         run-time stats on, lb's programs ran {}",
                        imp.name(),
                        1e6 / rate,
                        1e6 / rate - 1e6 / floor,
                        1e6 / floor,
                        bpf[c][i].describe()
                    ),
                );
            }
            let latency = match proto {
                Proto::Tcp => "connect_latency",
                Proto::Udp => "request_latency",
            };
            results.push(
                SUITE,
                &case,
                imp.name(),
                n,
                "new_flows_per_s",
                workload::median(&mut rates),
                None,
                "flows/s",
            );
            results.push(
                SUITE,
                &case,
                imp.name(),
                n,
                latency,
                workload::median(&mut p50),
                Some(workload::median(&mut p99)),
                "us",
            );
        }
    }
    // Detach lb before the testbeds (and their interfaces) go away.
    for bed in &mut beds {
        bed.lb = None;
    }
    Ok(())
}

/// Loads every implementation into its testbed.
fn program(
    beds: &mut [Bed],
    objects: &Objects,
    tmp: &TempDir,
    results: &mut Results,
    n: usize,
    impls: &[Impl],
) -> anyhow::Result<()> {
    let translation = desired_state(
        &objects.lb.services,
        &objects.lb.slices,
        &NodeInfo::default(),
    );
    ensure!(
        translation.skipped.is_empty(),
        "translation skipped {:?}",
        translation.skipped.first()
    );
    let state = &translation.state;
    for (b, socket) in [(0usize, true), (1, false)] {
        let bed = &mut beds[b];
        let node_ns = bed.tb.node_ns.clone();
        let ifaces = bed.tb.node_ifaces();
        let cgroup = bed.tb.cgroup.clone();
        let start = Instant::now();
        let agent = lb_tests::netns::in_netns(&node_ns, || {
            // `LB_NO_SK_STORAGE=1`, as for `lb run`: socket LB's pairs in the LRU alone (what
            // kernels without socket storage get), to compare the two.
            let mut datapath = Datapath::load(&LoadOptions {
                no_sk_storage: lb::datapath::load::sk_storage_off_by_env(),
                ..LoadOptions::default()
            })?;
            let mut reconciler = Reconciler::new(datapath.take_lb_maps()?)?;
            let report = reconciler.apply(state);
            if let Some(e) = report.errors.first() {
                bail!("lb could not program {}: {}", e.frontend, e.error);
            }
            if socket {
                datapath.attach_cgroup(&cgroup)?;
            } else {
                for iface in &ifaces {
                    datapath.attach_tc(iface, TcHook::Pod)?;
                }
            }
            Ok(LbAgent {
                _datapath: datapath,
                _reconciler: reconciler,
            })
        })?;
        println!(
            "newflows: lb ({}) programmed {n} services in {:.2} s",
            if socket { "socket" } else { "tc" },
            start.elapsed().as_secs_f64()
        );
        bed.lb = Some(agent);
    }
    let cfg = Config {
        pod_cidr: workload::POD_CIDR.into(),
        service_cidr: workload::SERVICE_CIDR.into(),
        node_ip: beds[0].tb.client.node_ipv4(),
    };
    let ports = kubeproxy::service_ports(&objects.services, &objects.slices);
    let jumps = tmp.write("jumps.rules", &kubeproxy::iptables_jumps())?;
    let rules = tmp.write(
        "full.rules",
        &kubeproxy::iptables_restore(&ports, &cfg, None),
    )?;
    let nft = tmp.write("full.nft", &kubeproxy::nft_full(&ports, &cfg))?;
    // The three rule loads run at the same time (they take minutes at the largest sizes);
    // their times are reported for information, the controlplane suite measures loading.
    let mut loads = Vec::new();
    for (imp, restore) in [
        (Impl::Iptables, "iptables-legacy-restore"),
        (Impl::IptablesNft, "iptables-nft-restore"),
    ] {
        if !impls.contains(&imp) {
            continue;
        }
        let ns = beds[imp.bed()].tb.node_ns.clone();
        let mut cmd = Command::new(restore);
        cmd.args(["--noflush"]).arg(&jumps);
        netns::run(&ns, cmd)?;
        let mut cmd = Command::new(restore);
        cmd.args(["--noflush", "--counters"]).arg(&rules);
        loads.push((restore, netns::spawn(&ns, cmd)?));
    }
    if impls.contains(&Impl::Nftables) {
        let mut cmd = Command::new("nft");
        cmd.arg("-f").arg(&nft);
        loads.push((
            "nft -f",
            netns::spawn(&beds[Impl::Nftables.bed()].tb.node_ns, cmd)?,
        ));
    }
    let (names, running): (Vec<&str>, Vec<netns::Running>) = loads.into_iter().unzip();
    for (what, (_, took)) in names.into_iter().zip(netns::wait_all(running)?) {
        results.note(
            &format!("newflows_load_{n:06}_{}", what.replace(' ', "_")),
            format!(
                "{what} of kube-proxy's {n}-service rules: {:.1} s (loaded concurrently)",
                took.as_secs_f64()
            ),
        );
    }
    Ok(())
}

/// Run counts and times of lb's programs (by name) over some flows.
#[derive(Clone, Default)]
struct ProgTime {
    runs: std::collections::BTreeMap<String, (u64, u64)>,
    flows: usize,
}

impl ProgTime {
    fn add(
        &mut self,
        before: &std::collections::BTreeMap<String, (u64, u64)>,
        after: &std::collections::BTreeMap<String, (u64, u64)>,
    ) {
        for (name, (cnt, ns)) in after {
            let (c0, n0) = before.get(name).copied().unwrap_or_default();
            if *cnt > c0 {
                let e = self.runs.entry(name.clone()).or_default();
                e.0 += cnt - c0;
                e.1 += ns.saturating_sub(n0);
            }
        }
    }

    /// "0.41 µs per flow: lb_connect4 1.0 runs × 250 ns, …".
    fn describe(&self) -> String {
        let flows = self.flows.max(1) as f64;
        // Programs that ran for well under one flow in twenty (a stray packet of another
        // testbed's interfaces) are not the flow's.
        let ran: Vec<(&String, u64, u64)> = self
            .runs
            .iter()
            .filter(|(_, (cnt, _))| *cnt as f64 / flows >= 0.05)
            .map(|(name, (cnt, ns))| (name, *cnt, *ns))
            .collect();
        let total: u64 = ran.iter().map(|(_, _, ns)| ns).sum();
        let parts: Vec<String> = ran
            .iter()
            .map(|(name, cnt, ns)| {
                format!(
                    "{name} {:.1} runs × {:.0} ns",
                    *cnt as f64 / flows,
                    *ns as f64 / (*cnt).max(1) as f64
                )
            })
            .collect();
        format!(
            "{:.2} µs per flow ({})",
            total as f64 / flows / 1e3,
            if parts.is_empty() {
                "none ran".to_owned()
            } else {
                parts.join(", ")
            }
        )
    }
}

/// Run count and total run time (ns) of every loaded lb program, summed by name (`bpftool
/// prog show`: aya's program info has no run-time accessor).
fn prog_stats() -> anyhow::Result<std::collections::BTreeMap<String, (u64, u64)>> {
    let out = Command::new("bpftool")
        .args(["-j", "prog", "show"])
        .output()
        .context("bpftool prog show")?;
    ensure!(out.status.success(), "bpftool prog show: {}", out.status);
    let progs: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout)?;
    let mut sums = std::collections::BTreeMap::new();
    for p in progs {
        let Some(name) = p.get("name").and_then(|n| n.as_str()) else {
            continue;
        };
        if !name.starts_with("lb_") {
            continue;
        }
        let field = |k: &str| p.get(k).and_then(serde_json::Value::as_u64).unwrap_or(0);
        let e: &mut (u64, u64) = sums.entry(name.to_owned()).or_default();
        e.0 += field("run_cnt");
        e.1 += field("run_time_ns");
    }
    Ok(sums)
}

/// What one client run reports.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
struct FlowStats {
    ok: usize,
    errors: usize,
    elapsed_s: f64,
    rate: f64,
    p50_us: f64,
    p99_us: f64,
    first_error: Option<String>,
}

/// One sample: a `lb-bench flows` run in the testbed's client netns; `port` is the next unused
/// source port of this implementation and protocol.
fn measure(
    bed: &Bed,
    imp: Impl,
    targets: &[SocketAddrV4],
    proto: Proto,
    port: &mut u32,
    settings: &Settings,
) -> anyhow::Result<FlowStats> {
    let first = *port;
    let needed = (settings.flows + settings.warmup) as u32;
    ensure!(
        first + needed <= 65_535,
        "the client ran out of fresh source ports (lower flows or repetitions)"
    );
    *port += needed;
    let bind = if imp == Impl::Direct {
        DIRECT_CLIENT
    } else {
        bed.tb.client.ipv4
    };
    let exe = std::env::current_exe()?;
    let targets: Vec<String> = targets.iter().map(ToString::to_string).collect();
    let mut cmd = Command::new(exe);
    cmd.args(["flows", "--proto", proto.name()])
        .args(["--target", &targets.join(",")])
        .args(["--bind", &bind.to_string()])
        .args(["--first-port", &first.to_string()])
        .args(["--count", &settings.flows.to_string()])
        .args(["--warmup", &settings.warmup.to_string()])
        .args(["--max-ms", &settings.max_ms.to_string()]);
    let cgroup = (imp == Impl::Socket).then(|| bed.tb.cgroup.clone());
    let client_ns = bed.tb.client.ns.clone();
    let out = bed.tb.run(&client_ns, cgroup.as_deref(), cmd)?;
    ensure!(
        out.status.success(),
        "flows client failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    );
    let stats: FlowStats = serde_json::from_slice(&out.stdout).with_context(|| {
        format!(
            "flows client output {:?}",
            String::from_utf8_lossy(&out.stdout)
        )
    })?;
    ensure!(
        stats.errors * 100 <= stats.ok.max(1),
        "{} of {} flows failed, first: {}",
        stats.errors,
        stats.ok + stats.errors,
        stats.first_error.as_deref().unwrap_or("?")
    );
    ensure!(stats.ok > 0, "no flow completed");
    Ok(stats)
}

// ---------------------------------------------------------------------------------------------
// The processes: backend server and flow client.

/// `lb-bench serve --name NAME --port PORT`: answers each TCP connection's first line and each
/// UDP datagram with `NAME\n` (the server closes TCP connections after the reply). Prints
/// `ready NAME PORT` once both sockets listen.
pub fn serve(name: &str, port: u16) -> anyhow::Result<()> {
    // Same CPU as the client (see `flows`); the UDP thread inherits it.
    let _pin = PinCpu::last()?;
    let reply: &'static [u8] = format!("{name}\n").into_bytes().leak();
    let tcp = TcpListener::bind((Ipv4Addr::UNSPECIFIED, port)).context("TCP listen")?;
    let udp = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, port)).context("UDP bind")?;
    thread::Builder::new()
        .name("udp".into())
        .spawn(move || {
            let mut buf = [0u8; 2048];
            loop {
                if let Ok((_, peer)) = udp.recv_from(&mut buf) {
                    let _ = udp.send_to(reply, peer);
                }
            }
        })
        .context("spawn UDP thread")?;
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "ready {name} {port}")?;
        out.flush()?;
    }
    // One connection at a time: the client is sequential.
    for conn in tcp.incoming() {
        let Ok(mut stream) = conn else { continue };
        let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
        let mut buf = [0u8; 256];
        let mut seen = 0;
        while seen < buf.len() {
            match stream.read(&mut buf[seen..]) {
                Ok(0) | Err(_) => break,
                Ok(k) => {
                    seen += k;
                    if buf[..seen].contains(&b'\n') {
                        let _ = stream.write_all(reply);
                        break;
                    }
                }
            }
        }
    }
    Ok(())
}

/// Options of `lb-bench flows`.
pub struct FlowsArgs {
    pub targets: Vec<SocketAddrV4>,
    pub udp: bool,
    pub bind: Ipv4Addr,
    pub first_port: u16,
    pub count: usize,
    pub warmup: usize,
    pub max_ms: u64,
}

/// `lb-bench flows`: opens `warmup + count` new flows one after the other, each from the next
/// source port, to a target picked at random per flow; prints one JSON [`FlowStats`] line.
pub fn flows(args: &FlowsArgs) -> anyhow::Result<()> {
    ensure!(!args.targets.is_empty(), "no target");
    // Client, backends and the softirq work their packets cause all run on one CPU: a flow's
    // cost is then CPU time, without cross-CPU wake-ups (IPIs, costly and erratic in a VM).
    let _pin = PinCpu::last()?;
    let timeout = Duration::from_secs(1);
    let mut rng = Rng::new(u64::from(args.first_port));
    let mut port = args.first_port;
    let mut latencies = Vec::with_capacity(args.count);
    let (mut ok, mut errors) = (0usize, 0usize);
    let mut first_error = None;
    let mut start = Instant::now();
    let deadline = Duration::from_millis(args.max_ms);
    for i in 0..args.warmup + args.count {
        if i == args.warmup {
            start = Instant::now();
        }
        let target = args.targets[rng.below(args.targets.len())];
        let local = SocketAddrV4::new(args.bind, port);
        port = port.wrapping_add(1);
        let result = if args.udp {
            udp_flow(local, target, timeout)
        } else {
            tcp_flow(local, target, timeout)
        };
        if i < args.warmup {
            if let Err(e) = result {
                errors += 1;
                first_error.get_or_insert_with(|| format!("warm-up: {e:#}"));
            }
            continue;
        }
        match result {
            Ok(latency) => {
                ok += 1;
                latencies.push(latency.as_secs_f64() * 1e6);
            }
            Err(e) => {
                errors += 1;
                first_error.get_or_insert_with(|| format!("{e:#}"));
            }
        }
        if errors > 20 || start.elapsed() > deadline {
            break;
        }
    }
    let elapsed = start.elapsed().as_secs_f64();
    let stats = FlowStats {
        ok,
        errors,
        elapsed_s: elapsed,
        rate: ok as f64 / elapsed.max(1e-9),
        p50_us: workload::percentile(&mut latencies, 50.0),
        p99_us: workload::percentile(&mut latencies, 99.0),
        first_error,
    };
    println!("{}", serde_json::to_string(&stats)?);
    Ok(())
}

/// connect (timed), send a line, read the reply until the server closes, close.
fn tcp_flow(
    local: SocketAddrV4,
    target: SocketAddrV4,
    timeout: Duration,
) -> anyhow::Result<Duration> {
    // SAFETY: plain socket(2); the fd is owned right away.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    ensure!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
    // SAFETY: the kernel just returned this fd; nothing else owns it.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    let tv = libc::timeval {
        tv_sec: libc::time_t::try_from(timeout.as_secs())?,
        tv_usec: 0,
    };
    // SAFETY: valid fd and option buffer; connect() honours SO_SNDTIMEO.
    unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_SNDTIMEO,
            std::ptr::from_ref(&tv).cast(),
            size_of::<libc::timeval>() as libc::socklen_t,
        );
    }
    let sa = |a: SocketAddrV4| libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: a.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from_ne_bytes(a.ip().octets()),
        },
        sin_zero: [0; 8],
    };
    let (l, t) = (sa(local), sa(target));
    let len = size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: valid fd and sockaddr_in.
    if unsafe { libc::bind(fd, std::ptr::from_ref(&l).cast(), len) } != 0 {
        bail!("bind {local}: {}", std::io::Error::last_os_error());
    }
    let t0 = Instant::now();
    // SAFETY: valid fd and sockaddr_in.
    if unsafe { libc::connect(fd, std::ptr::from_ref(&t).cast(), len) } != 0 {
        bail!("connect {target}: {}", std::io::Error::last_os_error());
    }
    let connected = t0.elapsed();
    let mut stream = TcpStream::from(owned);
    stream.set_read_timeout(Some(timeout))?;
    stream.write_all(b"hello\n")?;
    let mut reply = Vec::new();
    stream.read_to_end(&mut reply).context("read reply")?;
    ensure!(reply.ends_with(b"\n"), "short reply {reply:?}");
    Ok(connected)
}

/// One datagram from a fresh socket, timed until the reply arrives.
fn udp_flow(
    local: SocketAddrV4,
    target: SocketAddrV4,
    timeout: Duration,
) -> anyhow::Result<Duration> {
    let sock = UdpSocket::bind(local).with_context(|| format!("bind {local}"))?;
    sock.set_read_timeout(Some(timeout))?;
    let mut buf = [0u8; 256];
    let t0 = Instant::now();
    sock.send_to(b"hello\n", SocketAddr::V4(target))?;
    let (k, _) = sock
        .recv_from(&mut buf)
        .with_context(|| format!("no reply from {target}"))?;
    let took = t0.elapsed();
    ensure!(buf[..k].ends_with(b"\n"), "short reply");
    Ok(took)
}
