//! `northsouth`: packets/s a node forwards at saturation from an external client to a NodePort
//! service's backends, over veths, with 1, 1,000 and 10,000 services programmed:
//!
//! - `lb_tc`: `lb run --tc-ingress <external device> --tc-pod <backend devices>`;
//! - `lb_xdp`: `lb run --devices <external device> --xdp native --tc-pod <backend devices>`,
//!   only when `lb run --help` lists `--xdp` (otherwise the report says it is not available);
//! - `nftables` / `iptables`: kube-proxy's nftables-mode table and iptables-mode rules
//!   (iptables-legacy) for the same services, loaded inside the node netns.
//!
//! Frontends: node port numbers are unique per protocol and only 2,768 exist (30000–32767), so
//! the last `min(N, 2768)` services are `type: NodePort` (nodePort 30000 + k on the node IP
//! 198.18.10.1) and the ones before them are ClusterIP services with an externalIP
//! `198.18.10.101 + j / 2768` (extra /32 addresses of the node's external device) and port
//! 30000 + j % 2768: every frontend is a distinct (node IP, port) pair on the external device.
//! lb and kube-proxy get the same objects; lb answers NodePorts on its default
//! `--nodeport-addresses` (the node IP, 198.18.10.1), with `externalTrafficPolicy: Cluster`
//! masqueraded as kube-proxy's `KUBE-EXT` / `external-` chains do. All services are UDP with
//! two endpoints; the traffic
//! goes to the last service (the last NodePort: last in `KUBE-NODEPORTS`, after every rule of
//! `KUBE-SERVICES`, iptables' worst case), whose endpoints are the two real backends.
//!
//! The client (`lb-bench blast`) sends crafted UDP datagrams through a raw socket with
//! `sendmmsg`, round-robin over a fresh block of source ports per sample, for a fixed time; the
//! backends run `lb-bench sink` (`recvmmsg`, counting nothing). Forwarded packets are the
//! backends' veth rx counters; every sample also accounts for each of them with the backends'
//! own counters (/proc/net/snmp and snmp6): delivered, dropped for want of room (RcvbufErrors,
//! MemErrors: a loaded machine, fine), other traffic, or refused for a bad checksum, header,
//! address or port. A refused packet, or packets no counter accounts for, fail the sample, so a
//! broken rewrite is an error, not a number.
use std::{
    io::{BufRead as _, BufReader},
    net::{Ipv4Addr, SocketAddrV4},
    path::Path,
    process::{Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail, ensure};
use k8s_openapi::api::core::v1::Service;
use lb_tests::{daemon::LbDaemon, netns::in_netns, testbed::Testbed};

use crate::{
    kubeproxy::{self, Config},
    netns::{self, TempDir},
    workload::{self, PinCpu, PortDef, Results, Rng, ServiceDef},
};

const SUITE: &str = "northsouth";
const CASE: &str = "udp_nodeport";
const BACKEND_PORT: u16 = 8080;
const FIRST_NODE_PORT: u16 = 30_000;
/// 30000–32767.
const NODE_PORTS: usize = 2_768;
/// The node IP NodePorts are reached on: the testbed node's address on the client link.
const NODE_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 10, 1);
/// The first extra node IP of the external device (externalIP frontends).
const FIRST_EXTRA_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 10, 101);
const FIRST_CLIENT_PORT: u32 = 1_024;
const PAYLOAD: usize = 18;

pub struct Settings {
    pub sizes: Vec<usize>,
    pub reps: usize,
    /// Length of one sample's blast.
    pub ms: u64,
    /// Source ports (flows) per sample, fresh in every sample.
    pub flows: usize,
}

impl Settings {
    pub fn new(quick: bool) -> Self {
        if quick {
            Self {
                sizes: vec![1, 100],
                reps: 1,
                ms: 300,
                flows: 256,
            }
        } else {
            Self {
                sizes: vec![1, 1_000, 10_000],
                reps: 3,
                ms: 2_000,
                flows: 4_096,
            }
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LbMode {
    /// tc only: `--tc-ingress` on the external device.
    Tc,
    /// `--devices <external device> --xdp native`.
    Xdp,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Impl {
    Lb(LbMode),
    Nftables,
    Iptables,
}

impl Impl {
    const ALL: [Impl; 4] = [
        Impl::Lb(LbMode::Tc),
        Impl::Lb(LbMode::Xdp),
        Impl::Nftables,
        Impl::Iptables,
    ];

    fn name(self) -> &'static str {
        match self {
            Impl::Lb(LbMode::Tc) => "lb_tc",
            Impl::Lb(LbMode::Xdp) => "lb_xdp",
            Impl::Nftables => "nftables",
            Impl::Iptables => "iptables",
        }
    }
}

/// Where service `i` of `n` is reached from outside.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Frontend {
    NodePort(u16),
    ExternalIp(Ipv4Addr, u16),
}

fn frontend(i: usize, n: usize) -> Frontend {
    let node_ports = n.min(NODE_PORTS);
    let first_node_port = n - node_ports;
    let port = |k: usize| FIRST_NODE_PORT + u16::try_from(k % NODE_PORTS).unwrap_or(0);
    if i >= first_node_port {
        Frontend::NodePort(port(i - first_node_port))
    } else {
        Frontend::ExternalIp(extra_ip(i / NODE_PORTS), port(i))
    }
}

fn extra_ip(j: usize) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(FIRST_EXTRA_IP) + u32::try_from(j).unwrap_or(0))
}

/// Extra node IPs `n` services need.
fn extra_ips(n: usize) -> usize {
    (n - n.min(NODE_PORTS)).div_ceil(NODE_PORTS)
}

/// The Services kube-proxy's rules are generated from, and lb is given (the same objects).
fn services(n: usize, backends: &[Ipv4Addr]) -> (workload::Objects, Vec<Service>, Frontend) {
    let mut defs = Vec::with_capacity(n);
    let mut frontends = Vec::with_capacity(n);
    for i in 0..n {
        let fe = frontend(i, n);
        let port = match fe {
            Frontend::NodePort(p) | Frontend::ExternalIp(_, p) => p,
        };
        let mut def = workload::filler(i, 2);
        if i + 1 == n {
            def.endpoints = backends.to_vec();
        }
        let target = if i + 1 == n {
            BACKEND_PORT
        } else {
            def.ports[0].target
        };
        def = ServiceDef {
            ports: vec![PortDef {
                name: "udp",
                protocol: "UDP",
                port,
                target,
            }],
            ..def
        };
        defs.push(def);
        frontends.push(fe);
    }
    let objects = workload::objects(&defs);
    let mut kube = Vec::with_capacity(n);
    let mut lb = Vec::with_capacity(n);
    for (svc, fe) in objects.services.iter().zip(&frontends) {
        let mut k = (**svc).clone();
        let mut l = (**svc).clone();
        let (ks, ls) = (
            k.spec.as_mut().expect("spec"),
            l.spec.as_mut().expect("spec"),
        );
        ks.external_traffic_policy = Some("Cluster".into());
        ls.external_traffic_policy = Some("Cluster".into());
        match *fe {
            Frontend::NodePort(p) => {
                for spec in [&mut *ks, &mut *ls] {
                    spec.type_ = Some("NodePort".into());
                    for sp in spec.ports.iter_mut().flatten() {
                        sp.node_port = Some(i32::from(p));
                    }
                }
            }
            Frontend::ExternalIp(ip, _) => {
                ks.external_ips = Some(vec![ip.to_string()]);
                ls.external_ips = Some(vec![ip.to_string()]);
            }
        }
        kube.push(k);
        lb.push(l);
    }
    let kube_objects = workload::Objects::new(
        kube.into_iter().map(std::sync::Arc::new).collect(),
        objects.slices,
    );
    (kube_objects, lb, frontends[n - 1])
}

/// One testbed and what runs in it (lb, declared first, stops before the testbed goes).
struct Bed {
    imp: Impl,
    lb: Option<LbDaemon>,
    tb: Testbed,
}

pub fn run(settings: &Settings, results: &mut Results) -> anyhow::Result<()> {
    let lb = lb_tests::bins::LB.path()?;
    let help = Command::new(&lb)
        .args(["run", "--help"])
        .output()
        .context("lb run --help")?;
    let xdp = String::from_utf8_lossy(&help.stdout).contains("--xdp");
    if !xdp {
        results.note(
            "northsouth_xdp_unavailable",
            "lb XDP: not available in this build (`lb run --help` has no --xdp)",
        );
    }
    let impls: Vec<Impl> = Impl::ALL
        .into_iter()
        .filter(|i| xdp || *i != Impl::Lb(LbMode::Xdp))
        .collect();
    let mut rng = Rng::new(0x5015);
    for &n in &settings.sizes {
        run_size(settings, results, &lb, &impls, n, &mut rng)
            .with_context(|| format!("northsouth at {n} services"))?;
    }
    let n = settings.sizes.last().copied().unwrap_or(1);
    let extra = extra_ips(n);
    results.note(
        "northsouth_frontends",
        format!(
            "at N services, the last min(N, {NODE_PORTS}) are type NodePort (UDP, \
             nodePort 30000 + k, reached on node IP {NODE_IP}); the others are ClusterIP \
             services with one externalIP each from {FIRST_EXTRA_IP}{} (extra /32 addresses \
             on the node's external device), port 30000 + (i mod {NODE_PORTS}); all with \
             externalTrafficPolicy: Cluster and 2 endpoints; traffic goes to the last \
             service, the NodePort {NODE_IP}:{} (last in KUBE-NODEPORTS, behind all of \
             KUBE-SERVICES); lb gets the same objects and answers the NodePorts on its default \
             --nodeport-addresses (the node IP)",
            match extra {
                0 => " (none needed at this size)".to_owned(),
                1 => String::new(),
                _ => format!(" to {}", extra_ip(extra - 1)),
            },
            FIRST_NODE_PORT + u16::try_from(n.min(NODE_PORTS) - 1).unwrap_or(0)
        ),
    );
    results.note(
        "northsouth_method",
        format!(
            "north-south: one client thread (`lb-bench blast`: raw socket, sendmmsg of 64 \
             prebuilt UDP datagrams of {PAYLOAD} payload bytes, round-robin over {} fresh \
             source ports per sample) pinned to one CPU, where the kernel also does the \
             forwarding (veth delivers on the sending CPU); the two backends' `lb-bench sink` \
             (recvmmsg) on the other; forwarded packets/s = the backends' veth rx packets \
             during the {} ms blast / its duration, each flow's first packet included (every \
             sample's flows are new to conntrack); GRO on the client's and the backends' veth \
             ends in every testbed (XDP_REDIRECT into a veth needs NAPI on its peer); median \
             over {} samples, implementations interleaved in a shuffled order",
            settings.flows, settings.ms, settings.reps
        ),
    );
    Ok(())
}

fn run_size(
    settings: &Settings,
    results: &mut Results,
    lb: &Path,
    impls: &[Impl],
    n: usize,
    rng: &mut Rng,
) -> anyhow::Result<()> {
    println!(
        "northsouth: {n} services, building {} testbeds",
        impls.len()
    );
    let exe = std::env::current_exe().context("path of lb-bench")?;
    let mut beds = Vec::new();
    for &imp in impls {
        let mut tb = Testbed::create(2)?;
        prepare(&mut tb, &exe, n)?;
        beds.push(Bed { imp, lb: None, tb });
    }
    let backends: Vec<Ipv4Addr> = beds[0].tb.backends.iter().map(|b| b.ipv4).collect();
    let (kube, lb_services, traced) = services(n, &backends);
    let Frontend::NodePort(traced_port) = traced else {
        bail!("the traced service is no NodePort");
    };
    let target = SocketAddrV4::new(NODE_IP, traced_port);
    let tmp = TempDir::new(&format!("northsouth-{n}"))?;
    program(&mut beds, lb, &kube, &lb_services, &tmp, results, n)?;

    let mut next_port = vec![FIRST_CLIENT_PORT; beds.len()];
    let mut samples: Vec<Vec<(f64, f64)>> = vec![Vec::new(); beds.len()];
    for rep in 0..settings.reps {
        let mut order: Vec<usize> = (0..beds.len()).collect();
        rng.shuffle(&mut order);
        for b in order {
            workload::check_interrupted()?;
            let bed = &beds[b];
            let first = next_port[b];
            next_port[b] += u32::try_from(settings.flows)?;
            ensure!(
                next_port[b] <= 65_536,
                "the client ran out of fresh source ports (fewer flows or repetitions)"
            );
            let s = measure(bed, target, first, settings)
                .with_context(|| format!("{} rep {rep}", bed.imp.name()))?;
            samples[b].push(s);
        }
    }
    for (bed, s) in beds.iter().zip(&samples) {
        let mut forwarded: Vec<f64> = s.iter().map(|x| x.0).collect();
        let mut offered: Vec<f64> = s.iter().map(|x| x.1).collect();
        let name = bed.imp.name();
        let median = workload::median(&mut forwarded);
        results.push(
            SUITE,
            CASE,
            name,
            n,
            "forwarded_pps",
            median,
            None,
            "packets/s",
        );
        let offered = workload::median(&mut offered);
        results.push(
            SUITE,
            CASE,
            name,
            n,
            "offered_pps",
            offered,
            None,
            "packets/s",
        );
    }
    for bed in &mut beds {
        bed.lb = None;
    }
    Ok(())
}

/// Extra node IPs, GRO on the veth ends that receive redirected frames, and the sinks.
fn prepare(tb: &mut Testbed, exe: &Path, n: usize) -> anyhow::Result<()> {
    let node_ns = tb.node_ns.clone();
    let ext = tb.client.node_if.clone();
    for j in 0..extra_ips(n) {
        lb_tests::netns::ip(&[
            "-n",
            &node_ns,
            "addr",
            "add",
            &format!("{}/32", extra_ip(j)),
            "dev",
            &ext,
        ])?;
    }
    let hosts: Vec<String> = tb.hosts().map(|h| h.ns.clone()).collect();
    for ns in &hosts {
        in_netns(ns, || {
            lb_tests::netns::set_gro(lb_tests::testbed::HOST_IF, true)
        })?;
    }
    let backends: Vec<String> = tb.backends.iter().map(|b| b.ns.clone()).collect();
    for ns in backends {
        let mut cmd = Command::new(exe);
        cmd.args(["sink", "--port", &BACKEND_PORT.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::piped());
        let mut child = tb.spawn(&ns, None, cmd)?;
        let stdout = child.stdout.take().context("sink stdout")?;
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .context("sink ready line")?;
        ensure!(
            line.trim() == format!("ready sink {BACKEND_PORT}"),
            "sink in {ns}: {line:?}"
        );
    }
    Ok(())
}

/// Starts lb in its testbeds and loads kube-proxy's rules into theirs.
fn program(
    beds: &mut [Bed],
    lb: &Path,
    kube: &workload::Objects,
    lb_services: &[Service],
    tmp: &TempDir,
    results: &mut Results,
    n: usize,
) -> anyhow::Result<()> {
    // One JSON List of every object: what `lb run --manifests` reads.
    let mut items: Vec<serde_json::Value> = Vec::with_capacity(2 * n);
    for s in lb_services {
        items.push(serde_json::to_value(s)?);
    }
    for s in &kube.slices {
        items.push(serde_json::to_value(&**s)?);
    }
    let list = serde_json::json!({"apiVersion": "v1", "kind": "List", "items": items});
    let manifests = tmp.0.join("manifests");
    std::fs::create_dir_all(&manifests)?;
    std::fs::write(manifests.join("services.json"), serde_json::to_vec(&list)?)?;
    let manifests = manifests.display().to_string();

    let cfg = Config {
        pod_cidr: workload::POD_CIDR.into(),
        service_cidr: workload::SERVICE_CIDR.into(),
        node_ip: NODE_IP,
    };
    let ports = kubeproxy::service_ports(&kube.services, &kube.slices);
    let jumps = tmp.write("jumps.rules", &kubeproxy::iptables_jumps())?;
    let rules = tmp.write(
        "full.rules",
        &kubeproxy::iptables_restore(&ports, &cfg, None),
    )?;
    let nft = tmp.write("full.nft", &kubeproxy::nft_full(&ports, &cfg))?;
    let mut loads = Vec::new();
    for bed in beds.iter_mut() {
        let ns = bed.tb.node_ns.clone();
        match bed.imp {
            Impl::Lb(mode) => {
                let ext = bed.tb.client.node_if.clone();
                let pods: Vec<String> = bed.tb.backends.iter().map(|b| b.node_if.clone()).collect();
                let pods = pods.join(",");
                let mut args = vec![
                    "--manifests",
                    &manifests,
                    "--socket-lb=false",
                    "--node-ip",
                    "198.18.10.1",
                    "--hostname-override",
                    "bench-node",
                    "--metrics-bind-address",
                    "off",
                    "--tc-pod",
                    &pods,
                ];
                match mode {
                    LbMode::Tc => args.extend(["--tc-ingress", &ext]),
                    LbMode::Xdp => args.extend(["--devices", &ext, "--xdp", "native"]),
                }
                let start = Instant::now();
                let daemon = LbDaemon::start(&mut bed.tb, lb, &args, "info")
                    .with_context(|| format!("lb run {}", args.join(" ")))?;
                println!(
                    "northsouth: {} ready with {n} services in {:.2} s",
                    bed.imp.name(),
                    start.elapsed().as_secs_f64()
                );
                bed.lb = Some(daemon);
            }
            Impl::Iptables => {
                let mut cmd = Command::new("iptables-legacy-restore");
                cmd.arg("--noflush").arg(&jumps);
                netns::run(&ns, cmd)?;
                let mut cmd = Command::new("iptables-legacy-restore");
                cmd.args(["--noflush", "--counters"]).arg(&rules);
                loads.push(("iptables-legacy-restore", netns::spawn(&ns, cmd)?));
            }
            Impl::Nftables => {
                let mut cmd = Command::new("nft");
                cmd.arg("-f").arg(&nft);
                loads.push(("nft -f", netns::spawn(&ns, cmd)?));
            }
        }
    }
    let (names, running): (Vec<&str>, Vec<netns::Running>) = loads.into_iter().unzip();
    for (what, (_, took)) in names.into_iter().zip(netns::wait_all(running)?) {
        results.note(
            &format!("northsouth_load_{n:06}_{}", what.replace(' ', "_")),
            format!(
                "north-south: {what} of kube-proxy's {n}-service NodePort rules: {:.1} s",
                took.as_secs_f64()
            ),
        );
    }
    Ok(())
}

/// What becomes of a packet a backend's veth received, by the counter that shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fate {
    /// Handed to the sink's socket.
    Delivered,
    /// Dropped for want of room (a socket's receive buffer, UDP's memory limit): the sink's
    /// pace on a loaded machine, not the datapath's fault.
    Room,
    /// Refused for what a bad rewrite does: a wrong checksum, header, address or port.
    Bad,
    /// Other traffic the veth also counts (TCP, ICMP, neighbour discovery), not the blast's.
    Other,
}

/// Where a counter is: /proc/net/snmp (`Udp: InDatagrams …` header and value lines) or
/// /proc/net/snmp6 (`Udp6InDatagrams  123` lines).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Snmp {
    V4(&'static str),
    V6,
}

/// The backends' counters the check accounts the veths' packets with.
const COUNTERS: [(Snmp, &str, Fate); 17] = [
    (Snmp::V4("Udp"), "InDatagrams", Fate::Delivered),
    (Snmp::V6, "Udp6InDatagrams", Fate::Delivered),
    (Snmp::V4("Udp"), "RcvbufErrors", Fate::Room),
    (Snmp::V6, "Udp6RcvbufErrors", Fate::Room),
    (Snmp::V4("Udp"), "MemErrors", Fate::Room),
    (Snmp::V6, "Udp6MemErrors", Fate::Room),
    (Snmp::V4("Udp"), "InCsumErrors", Fate::Bad),
    (Snmp::V6, "Udp6InCsumErrors", Fate::Bad),
    (Snmp::V4("Udp"), "NoPorts", Fate::Bad),
    (Snmp::V6, "Udp6NoPorts", Fate::Bad),
    (Snmp::V4("Ip"), "InHdrErrors", Fate::Bad),
    (Snmp::V6, "Ip6InHdrErrors", Fate::Bad),
    (Snmp::V4("Ip"), "InAddrErrors", Fate::Bad),
    (Snmp::V6, "Ip6InAddrErrors", Fate::Bad),
    (Snmp::V4("Tcp"), "InSegs", Fate::Other),
    (Snmp::V4("Icmp"), "InMsgs", Fate::Other),
    (Snmp::V6, "Icmp6InMsgs", Fate::Other),
];

/// Packets a veth may receive that no counter of [`COUNTERS`] shows: ARP (a few exchanges
/// while a blast runs).
const UNCOUNTED_SLACK: u64 = 16;

/// What the backends' network stacks counted, summed over the backends.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct BackendCounters {
    /// Packets their veths received.
    rx: u64,
    /// The counters of [`COUNTERS`], in its order.
    counters: [u64; COUNTERS.len()],
}

impl BackendCounters {
    /// The counters from one backend's /proc/net/dev, snmp and snmp6 texts.
    fn read(dev: &str, snmp: &str, snmp6: &str) -> anyhow::Result<Self> {
        let mut counters = [0; COUNTERS.len()];
        for (value, (file, name, _)) in counters.iter_mut().zip(COUNTERS) {
            *value = match file {
                Snmp::V4(proto) => snmp_field(snmp, proto, name)?,
                Snmp::V6 => snmp6_field(snmp6, name)?,
            };
        }
        Ok(Self {
            rx: rx_packets(dev, lb_tests::testbed::HOST_IF)?,
            counters,
        })
    }

    fn add(&mut self, other: &Self) {
        self.rx += other.rx;
        for (a, b) in self.counters.iter_mut().zip(other.counters) {
            *a += b;
        }
    }

    /// What the counters grew by since `before`.
    fn since(&self, before: &Self) -> Self {
        let mut d = Self {
            rx: self.rx.saturating_sub(before.rx),
            ..Self::default()
        };
        for ((d, a), b) in d
            .counters
            .iter_mut()
            .zip(self.counters)
            .zip(before.counters)
        {
            *d = a.saturating_sub(b);
        }
        d
    }

    /// The sum of the counters of one fate.
    fn of(&self, fate: Fate) -> u64 {
        self.counters
            .iter()
            .zip(COUNTERS)
            .filter(|(_, (_, _, f))| *f == fate)
            .map(|(v, _)| v)
            .sum()
    }

    /// Received packets no counter accounts for.
    fn unaccounted(&self) -> u64 {
        let accounted: u64 = self.counters.iter().sum();
        self.rx.saturating_sub(accounted)
    }

    /// Each counter of `fates` that moved, as `Udp RcvbufErrors 1249, …` (`none` if none did).
    fn named(&self, fates: &[Fate]) -> String {
        let parts: Vec<String> = self
            .counters
            .iter()
            .zip(COUNTERS)
            .filter(|(v, (_, _, f))| **v > 0 && fates.contains(f))
            .map(|(v, (file, name, _))| match file {
                Snmp::V4(proto) => format!("{proto} {name} {v}"),
                Snmp::V6 => format!("{name} {v}"),
            })
            .collect();
        if parts.is_empty() {
            "none".into()
        } else {
            parts.join(", ")
        }
    }

    /// Err when what the veths received during a sample (`self`, a difference) shows a bad
    /// rewrite: a stack refused a packet for its checksum, header, address or port, or packets
    /// are missing that no counter accounts for. Packets dropped for want of room are fine.
    fn check(&self) -> anyhow::Result<()> {
        let (bad, lost) = (self.of(Fate::Bad), self.unaccounted());
        ensure!(
            bad == 0 && lost <= UNCOUNTED_SLACK,
            "the backends' veths received {} packets: {bad} refused for a bad checksum, header, \
             address or port ({}) and {lost} not accounted for by any counter (a bad rewrite?); \
             delivered: {}; dropped for want of room (a loaded machine, not an error): {}; \
             other traffic: {}",
            self.rx,
            self.named(&[Fate::Bad]),
            self.named(&[Fate::Delivered]),
            self.named(&[Fate::Room]),
            self.named(&[Fate::Other]),
        );
        Ok(())
    }
}

fn backend_counters(tb: &Testbed) -> anyhow::Result<BackendCounters> {
    let mut sum = BackendCounters::default();
    for b in &tb.backends {
        let c = in_netns(&b.ns, || {
            BackendCounters::read(
                &std::fs::read_to_string("/proc/thread-self/net/dev")?,
                &std::fs::read_to_string("/proc/thread-self/net/snmp")?,
                &std::fs::read_to_string("/proc/thread-self/net/snmp6")?,
            )
        })?;
        sum.add(&c);
    }
    Ok(sum)
}

/// Reads the backends' counters until they stop moving (the backlog the blast left is drained;
/// on a busy machine softirqs can lag by far more than a fixed pause): still for one 50 ms poll
/// when they account for every packet the veths received since `before` (give or take
/// [`UNCOUNTED_SLACK`]), else still for `still`; at most `limit`.
fn drained_counters(
    tb: &Testbed,
    before: &BackendCounters,
    still: Duration,
    limit: Duration,
) -> anyhow::Result<BackendCounters> {
    let start = Instant::now();
    let mut last = backend_counters(tb)?;
    let mut moved = Instant::now();
    loop {
        thread::sleep(Duration::from_millis(50));
        let now = backend_counters(tb)?;
        if now != last {
            moved = Instant::now();
        } else if now.since(before).unaccounted() <= UNCOUNTED_SLACK || moved.elapsed() >= still {
            return Ok(now);
        }
        if start.elapsed() >= limit {
            return Ok(now);
        }
        last = now;
    }
}

/// The rx packet count of `ifname` in a /proc/net/dev text.
fn rx_packets(dev: &str, ifname: &str) -> anyhow::Result<u64> {
    let line = dev
        .lines()
        .find_map(|l| l.trim_start().strip_prefix(&format!("{ifname}:")))
        .with_context(|| format!("{ifname} not in /proc/net/dev"))?;
    // Receive: bytes packets …
    line.split_whitespace()
        .nth(1)
        .context("rx packets")?
        .parse()
        .context("rx packets")
}

/// The counter `name` of the `proto` lines ("Udp", "Ip") of a /proc/net/snmp text.
fn snmp_field(snmp: &str, proto: &str, name: &str) -> anyhow::Result<u64> {
    let prefix = format!("{proto}: ");
    let mut lines = snmp.lines().filter(|l| l.starts_with(&prefix));
    let (names, values) = (
        lines.next().with_context(|| format!("{proto} header"))?,
        lines.next().with_context(|| format!("{proto} values"))?,
    );
    names
        .split_whitespace()
        .zip(values.split_whitespace())
        .find(|(n, _)| *n == name)
        .with_context(|| format!("{proto} {name} not in /proc/net/snmp"))?
        .1
        .parse()
        .with_context(|| format!("{proto} {name}"))
}

/// The counter `name` of a /proc/net/snmp6 text (`Udp6InDatagrams  123` lines).
fn snmp6_field(snmp6: &str, name: &str) -> anyhow::Result<u64> {
    snmp6
        .lines()
        .find_map(|l| {
            let mut words = l.split_whitespace();
            (words.next() == Some(name)).then(|| words.next())
        })
        .flatten()
        .with_context(|| format!("{name} not in /proc/net/snmp6"))?
        .parse()
        .with_context(|| name.to_string())
}

/// What `lb-bench blast` reports.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct BlastStats {
    sent: u64,
    elapsed_s: f64,
}

/// One sample: (forwarded packets/s, offered packets/s).
fn measure(
    bed: &Bed,
    target: SocketAddrV4,
    first_port: u32,
    settings: &Settings,
) -> anyhow::Result<(f64, f64)> {
    let exe = std::env::current_exe()?;
    let mut cmd = Command::new(exe);
    cmd.args(["blast", "--target", &target.to_string()])
        .args(["--bind", &bed.tb.client.ipv4.to_string()])
        .args(["--first-port", &first_port.to_string()])
        .args(["--ports", &settings.flows.to_string()])
        .args(["--ms", &settings.ms.to_string()]);
    let before = backend_counters(&bed.tb)?;
    let out = bed.tb.run(&bed.tb.client.ns, None, cmd)?;
    ensure!(
        out.status.success(),
        "blast failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    );
    let after = drained_counters(
        &bed.tb,
        &before,
        Duration::from_secs(1),
        Duration::from_secs(10),
    )?;
    let stats: BlastStats = serde_json::from_slice(&out.stdout)
        .with_context(|| format!("blast output {:?}", String::from_utf8_lossy(&out.stdout)))?;
    let d = after.since(&before);
    let rx = d.rx;
    ensure!(
        rx * 100 >= stats.sent,
        "only {rx} of {} packets reached the backends",
        stats.sent
    );
    // A rewrite or checksum error shows in the backends' own counters, or as packets no counter
    // accounts for; a datagram dropped for want of room (receive buffer, UDP memory) is the
    // machine's load, not lb's.
    d.check()?;
    let room = d.of(Fate::Room);
    if room * 20 > rx {
        eprintln!(
            "note: {room} of the {rx} packets the backends' veths received were dropped for want \
             of room ({}), none for a bad checksum, header, address or port (a loaded machine)",
            d.named(&[Fate::Room])
        );
    }
    Ok((
        rx as f64 / stats.elapsed_s,
        stats.sent as f64 / stats.elapsed_s,
    ))
}

// ---------------------------------------------------------------------------------------------
// The processes: sender and sink.

/// Options of `lb-bench blast`.
pub struct BlastArgs {
    pub target: SocketAddrV4,
    pub bind: Ipv4Addr,
    pub first_port: u16,
    pub ports: usize,
    pub ms: u64,
}

/// `lb-bench blast`: UDP datagrams to `target` from `ports` source ports (round-robin) as
/// fast as one thread can send them, for `ms`; prints one JSON [`BlastStats`] line.
///
/// A raw socket (`IPPROTO_RAW`, the IP header is ours) sends prebuilt datagrams, so every
/// packet of a `sendmmsg` batch can come from another source port without one socket per port.
pub fn blast(args: &BlastArgs) -> anyhow::Result<()> {
    ensure!(args.ports > 0, "no source ports");
    ensure!(
        usize::from(args.first_port) + args.ports <= 65_536,
        "source ports beyond 65535"
    );
    // The forwarding runs on the sending CPU (veth); the sinks are pinned to the other one.
    let _pin = PinCpu::last()?;
    let packets: Vec<Vec<u8>> = (0..args.ports)
        .map(|k| {
            let sport = args.first_port + u16::try_from(k).unwrap_or(0);
            udp_packet(SocketAddrV4::new(args.bind, sport), args.target)
        })
        .collect();
    // SAFETY: plain socket(2); the fd is owned right away.
    let fd = unsafe {
        libc::socket(
            libc::AF_INET,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            libc::IPPROTO_RAW,
        )
    };
    ensure!(fd >= 0, "raw socket: {}", std::io::Error::last_os_error());
    // SAFETY: the kernel just returned this fd; nothing else owns it.
    let _owned = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    let dst = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr {
            s_addr: u32::from_ne_bytes(args.target.ip().octets()),
        },
        sin_zero: [0; 8],
    };
    const BATCH: usize = 64;
    let mut iovs: Vec<libc::iovec> = vec![
        libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        };
        BATCH
    ];
    // SAFETY: mmsghdr is plain data; the pointers are filled in before each call.
    let mut msgs: Vec<libc::mmsghdr> = vec![unsafe { std::mem::zeroed() }; BATCH];
    let deadline = Duration::from_millis(args.ms);
    let start = Instant::now();
    let (mut sent, mut next) = (0u64, 0usize);
    while start.elapsed() < deadline {
        for (iov, msg) in iovs.iter_mut().zip(msgs.iter_mut()) {
            let p = &packets[next];
            next = (next + 1) % packets.len();
            iov.iov_base = p.as_ptr().cast_mut().cast();
            iov.iov_len = p.len();
            msg.msg_hdr.msg_name = std::ptr::from_ref(&dst).cast_mut().cast();
            msg.msg_hdr.msg_namelen = size_of::<libc::sockaddr_in>() as libc::socklen_t;
            msg.msg_hdr.msg_iov = std::ptr::from_mut(iov);
            msg.msg_hdr.msg_iovlen = 1;
        }
        // SAFETY: BATCH valid mmsghdrs whose buffers and address outlive the call.
        let rc = unsafe { libc::sendmmsg(fd, msgs.as_mut_ptr(), BATCH as libc::c_uint, 0) };
        if rc < 0 {
            let err = std::io::Error::last_os_error();
            // A full device queue: try again.
            if err.raw_os_error() == Some(libc::ENOBUFS)
                || err.kind() == std::io::ErrorKind::WouldBlock
            {
                continue;
            }
            bail!("sendmmsg: {err}");
        }
        sent += u64::try_from(rc)?;
    }
    let stats = BlastStats {
        sent,
        elapsed_s: start.elapsed().as_secs_f64(),
    };
    println!("{}", serde_json::to_string(&stats)?);
    Ok(())
}

/// An IPv4 + UDP datagram from `src` to `dst` (the kernel fills in the IP checksum and id).
fn udp_packet(src: SocketAddrV4, dst: SocketAddrV4) -> Vec<u8> {
    let udp_len = 8 + PAYLOAD;
    let total = 20 + udp_len;
    let mut p = vec![0u8; total];
    p[0] = 0x45;
    p[2..4].copy_from_slice(&u16::try_from(total).unwrap_or(0).to_be_bytes());
    p[6] = 0x40; // DF
    p[8] = 64;
    p[9] = libc::IPPROTO_UDP as u8;
    p[12..16].copy_from_slice(&src.ip().octets());
    p[16..20].copy_from_slice(&dst.ip().octets());
    p[20..22].copy_from_slice(&src.port().to_be_bytes());
    p[22..24].copy_from_slice(&dst.port().to_be_bytes());
    p[24..26].copy_from_slice(&u16::try_from(udp_len).unwrap_or(0).to_be_bytes());
    for (i, b) in p[28..].iter_mut().enumerate() {
        *b = b'a' + (i % 26) as u8;
    }
    // Checksum over the pseudo-header (addresses, protocol, UDP length) and the datagram.
    let mut sum: u32 = 0;
    let mut add = |bytes: &[u8]| {
        for pair in bytes.chunks(2) {
            let hi = u32::from(pair[0]) << 8;
            sum += hi | pair.get(1).map_or(0, |b| u32::from(*b));
        }
    };
    add(&p[12..20]);
    add(&[0, libc::IPPROTO_UDP as u8]);
    add(&u16::try_from(udp_len).unwrap_or(0).to_be_bytes());
    add(&p[20..]);
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    let mut csum = !(sum as u16);
    if csum == 0 {
        csum = 0xffff;
    }
    p[26..28].copy_from_slice(&csum.to_be_bytes());
    p
}

/// `lb-bench sink --port PORT`: receives UDP datagrams on PORT with recvmmsg and drops them,
/// on the first CPU (the sender has the last). Prints `ready sink PORT` once bound.
pub fn sink(port: u16) -> anyhow::Result<()> {
    let _pin = PinCpu::first()?;
    let sock = std::net::UdpSocket::bind((Ipv4Addr::UNSPECIFIED, port)).context("UDP bind")?;
    let fd = std::os::fd::AsRawFd::as_raw_fd(&sock);
    let size: libc::c_int = 8 << 20;
    // SAFETY: valid fd and option buffer. Best effort: a small buffer only costs drops, which
    // the counters (RcvbufErrors) still see.
    unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_RCVBUFFORCE,
            std::ptr::from_ref(&size).cast(),
            size_of::<libc::c_int>() as libc::socklen_t,
        );
    }
    println!("ready sink {port}");
    const BATCH: usize = 64;
    let mut bufs = vec![[0u8; 256]; BATCH];
    let mut iovs: Vec<libc::iovec> = bufs
        .iter_mut()
        .map(|b| libc::iovec {
            iov_base: b.as_mut_ptr().cast(),
            iov_len: b.len(),
        })
        .collect();
    // SAFETY: mmsghdr is plain data; each points at its own iovec below.
    let mut msgs: Vec<libc::mmsghdr> = vec![unsafe { std::mem::zeroed() }; BATCH];
    for (msg, iov) in msgs.iter_mut().zip(iovs.iter_mut()) {
        msg.msg_hdr.msg_iov = std::ptr::from_mut(iov);
        msg.msg_hdr.msg_iovlen = 1;
    }
    loop {
        // SAFETY: BATCH valid mmsghdrs whose buffers outlive the call.
        let rc = unsafe {
            libc::recvmmsg(
                fd,
                msgs.as_mut_ptr(),
                BATCH as libc::c_uint,
                libc::MSG_WAITFORONE,
                std::ptr::null_mut(),
            )
        };
        if rc < 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() != std::io::ErrorKind::Interrupted {
                bail!("recvmmsg: {err}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frontends_are_distinct() {
        for n in [1, 1_000, 10_000] {
            let all: std::collections::BTreeSet<_> = (0..n).map(|i| frontend(i, n)).collect();
            assert_eq!(all.len(), n);
            assert_eq!(
                frontend(n - 1, n),
                Frontend::NodePort(FIRST_NODE_PORT + u16::try_from(n.min(NODE_PORTS) - 1).unwrap())
            );
        }
        assert_eq!(
            frontend(0, 10_000),
            Frontend::ExternalIp(FIRST_EXTRA_IP, 30_000)
        );
        assert_eq!(extra_ips(10_000), 3);
        assert_eq!(extra_ips(1_000), 0);
    }

    #[test]
    fn snmp_fields_are_read_by_name() {
        let snmp = "Ip: Forwarding DefaultTTL InReceives InHdrErrors InAddrErrors\n\
                    Ip: 2 64 321001 3 4\n\
                    Udp: InDatagrams NoPorts InErrors OutDatagrams RcvbufErrors InCsumErrors\n\
                    Udp: 325 31 9 363 8 1\n";
        let field = |proto, name| snmp_field(snmp, proto, name).unwrap();
        assert_eq!(field("Ip", "InHdrErrors"), 3);
        assert_eq!(field("Ip", "InAddrErrors"), 4);
        assert_eq!(field("Udp", "InDatagrams"), 325);
        assert_eq!(field("Udp", "NoPorts"), 31);
        assert_eq!(field("Udp", "RcvbufErrors"), 8);
        assert_eq!(field("Udp", "InCsumErrors"), 1);
        assert!(snmp_field(snmp, "Udp", "MemErrors").is_err());
        assert!(snmp_field(snmp, "Tcp", "InSegs").is_err());
        let snmp6 = "Ip6InReceives                   \t7\nUdp6RcvbufErrors                \t12\n";
        assert_eq!(snmp6_field(snmp6, "Udp6RcvbufErrors").unwrap(), 12);
        assert!(snmp6_field(snmp6, "Udp6InErrors").is_err());
    }

    /// A sample of `rx` veth packets and these counters (by name, the rest zero).
    fn sample(rx: u64, counters: &[(&str, u64)]) -> BackendCounters {
        let mut c = BackendCounters {
            rx,
            ..BackendCounters::default()
        };
        for (name, v) in counters {
            let i = COUNTERS.iter().position(|(_, n, _)| n == name).unwrap();
            c.counters[i] = *v;
        }
        c
    }

    #[test]
    fn only_bad_or_unaccounted_packets_fail_a_sample() {
        // The flake: 1,249 datagrams a full receive buffer dropped are the machine's load.
        let full = sample(11_138, &[("InDatagrams", 9_889), ("RcvbufErrors", 1_249)]);
        full.check().unwrap();
        assert_eq!(full.of(Fate::Room), 1_249);
        assert_eq!(full.named(&[Fate::Room]), "Udp RcvbufErrors 1249");
        // IPv6 and other traffic are accounted too; a few ARP packets are not counted anywhere.
        sample(
            1_000,
            &[
                ("Udp6InDatagrams", 900),
                ("Udp6RcvbufErrors", 80),
                ("Icmp6InMsgs", 6),
                ("InSegs", 4),
            ],
        )
        .check()
        .unwrap();
        // A checksum error fails, however few, and the message names the counter.
        let csum = sample(11_138, &[("InDatagrams", 11_137), ("InCsumErrors", 1)]);
        let err = csum.check().unwrap_err().to_string();
        assert!(err.contains("Udp InCsumErrors 1"), "{err}");
        // Packets no counter accounts for fail, naming what the counters did show.
        let lost = sample(11_138, &[("InDatagrams", 9_889), ("RcvbufErrors", 9)]);
        let err = lost.check().unwrap_err().to_string();
        assert!(err.contains("1240 not accounted for"), "{err}");
        assert!(err.contains("Udp RcvbufErrors 9"), "{err}");
        assert!(err.contains("Udp InDatagrams 9889"), "{err}");
        // Differences of two readings.
        let before = sample(10, &[("InDatagrams", 5)]);
        let after = sample(30, &[("InDatagrams", 20), ("RcvbufErrors", 5)]);
        assert_eq!(
            after.since(&before),
            sample(20, &[("InDatagrams", 15), ("RcvbufErrors", 5)])
        );
    }

    #[test]
    fn udp_checksum_verifies() {
        let p = udp_packet(
            SocketAddrV4::new(Ipv4Addr::new(198, 18, 10, 2), 1024),
            SocketAddrV4::new(NODE_IP, 30_000),
        );
        let mut sum: u32 = 0;
        let mut pseudo = p[12..20].to_vec();
        pseudo.extend_from_slice(&[0, 17]);
        pseudo.extend_from_slice(&p[24..26]);
        pseudo.extend_from_slice(&p[20..]);
        for pair in pseudo.chunks(2) {
            sum += (u32::from(pair[0]) << 8) | pair.get(1).map_or(0, |b| u32::from(*b));
        }
        while sum > 0xffff {
            sum = (sum & 0xffff) + (sum >> 16);
        }
        assert_eq!(sum, 0xffff);
    }
}
