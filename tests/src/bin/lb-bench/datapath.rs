//! `datapath`: per-packet cost of `lb_tc_ingress` with BPF_PROG_TEST_RUN, at several service
//! counts, against two baselines measured in the same run: a 2-instruction pass-through
//! SCHED_CLS program (loaded here with raw `bpf(2)` calls) and `lb_tc_egress` on a packet that
//! matches nothing (parse + one conntrack lookup).
//!
//! BPF_PROG_TEST_RUN runs the program `repeat` times on the *same* skb, and a DNAT rewrites
//! that skb, so a plain service packet would hit a service once and then miss. The traced
//! services therefore form a ring: A:80 and B:80 have the backends C:81 and D:81, which are
//! services whose backends are A:80 and B:80. Every repetition is a service hit with a full
//! DNAT (address and port) of the packet the previous one produced. The smallest case is that
//! ring alone (4 services).
//!
//! - established: a TCP ACK; after priming, every repetition finds its conntrack entry;
//! - new flow: a TCP SYN+FIN. lb treats a SYN on a closing conntrack entry as a new connection
//!   (port reuse), so every repetition takes the whole new-flow path: backend selection, two
//!   conntrack writes (replacing the entries, which costs an LRU insert each), DNAT;
//! - miss: an ACK to an address that is no service (service lookup + reply-conntrack lookup).
//!
//! The lb_metrics counters are checked after each run: every repetition must have taken the
//! intended path. A second method, one BPF_PROG_TEST_RUN per packet (repeat = 1) over
//! distinct source ports, gives genuinely new flows (conntrack misses) with the kernel's
//! per-run duration; it is reported next to the repeat method as a cross-check.
use std::{
    io,
    net::Ipv4Addr,
    os::fd::{AsFd as _, AsRawFd as _, FromRawFd as _, OwnedFd, RawFd},
    time::Instant,
};

use anyhow::{Context as _, bail, ensure};
use aya::{
    maps::PerCpuArray,
    programs::{Program, SchedClassifier},
};
use lb::{
    datapath::load::{Datapath, LoadOptions},
    datapath::maps::BpfMaps,
    reconcile::Reconciler,
    translate::{NodeInfo, desired_state},
};
use lb_common::{MetricValue, map_names, metrics, prog_names};

use crate::workload::{self, MISS_DST, PinCpu, PortDef, Results, Rng, ServiceDef};

const SUITE: &str = "datapath";
const CLIENT: Ipv4Addr = Ipv4Addr::new(198, 18, 10, 2);
const TCP_FIN: u8 = 0x01;
const TCP_SYN: u8 = 0x02;
const TCP_ACK: u8 = 0x10;
const SPORT_ESTABLISHED: u16 = 40_000;
const SPORT_NEW: u16 = 40_001;
const SPORT_MISS: u16 = 40_002;
/// lb_xdp's flows, apart from lb_tc_ingress's (the two share conntrack).
const SPORT_XDP_ESTABLISHED: u16 = 40_010;
const SPORT_XDP_NEW: u16 = 40_011;
/// The first client port `reply_flows` tries (each repetition takes fresh ones).
const SPORT_REPLY_FIRST: u16 = 50_000;
/// lb's XDP program (external devices, `lb run --devices`), once the build has it.
const XDP_PROGRAM: &str = "lb_xdp";

pub struct Settings {
    pub sizes: Vec<usize>,
    pub repeat: u32,
    pub reps: usize,
    /// Packets per size and repetition for the one-packet-per-run method.
    pub single_shot: usize,
    /// Only these cases of the repeat method (`Case` names), all if empty.
    pub cases: Vec<String>,
}

impl Settings {
    pub fn new(quick: bool) -> Self {
        let mut s = Self::defaults(quick);
        // For investigating one cell: `LB_BENCH_DATAPATH=sizes=4+100000,reps=5,single=0`.
        if let Ok(v) = std::env::var("LB_BENCH_DATAPATH") {
            for kv in v.split(',') {
                match kv.split_once('=') {
                    Some(("sizes", n)) => {
                        s.sizes = n.split('+').filter_map(|x| x.parse().ok()).collect();
                    }
                    Some(("reps", n)) => s.reps = n.parse().unwrap_or(s.reps),
                    Some(("repeat", n)) => s.repeat = n.parse().unwrap_or(s.repeat),
                    Some(("single", n)) => s.single_shot = n.parse().unwrap_or(s.single_shot),
                    Some(("cases", n)) => s.cases = n.split('+').map(str::to_owned).collect(),
                    _ => {}
                }
            }
        }
        s
    }

    fn defaults(quick: bool) -> Self {
        if quick {
            Self {
                sizes: vec![4, 1_000],
                repeat: 100_000,
                reps: 3,
                single_shot: 200,
                cases: Vec::new(),
            }
        } else {
            Self {
                sizes: vec![4, 1_000, 10_000, 100_000],
                repeat: 1_000_000,
                reps: 7,
                single_shot: 3_000,
                cases: Vec::new(),
            }
        }
    }
}

/// The ring of services every repetition bounces between, then `n - 4` services with two
/// synthetic endpoints each.
fn services(n: usize) -> Vec<ServiceDef> {
    assert!(n >= 4, "the ring needs 4 services");
    let ring = |i: usize, port: u16, target: u16, eps: [usize; 2]| ServiceDef {
        index: i,
        vip: workload::vip(i),
        ports: vec![PortDef {
            name: "http",
            protocol: "TCP",
            port,
            target,
        }],
        endpoints: eps.iter().map(|e| workload::vip(*e)).collect(),
    };
    let mut defs = vec![
        ring(0, 80, 81, [2, 3]),
        ring(1, 80, 81, [2, 3]),
        ring(2, 81, 80, [0, 1]),
        ring(3, 81, 80, [0, 1]),
    ];
    defs.extend((4..n).map(|i| workload::filler(i, 2)));
    defs
}

/// One loaded datapath with `services` services programmed through translate + Reconciler.
struct Fixture {
    services: usize,
    datapath: Datapath,
    _reconciler: Reconciler<BpfMaps>,
    ingress: RawFd,
    egress: RawFd,
    xdp: RawFd,
    /// The next client port `reply_flows` tries.
    next_reply_port: u16,
}

impl Fixture {
    fn new(n: usize) -> anyhow::Result<Self> {
        let mut datapath =
            Datapath::load(&LoadOptions::default()).context("loading lb's datapath (root?)")?;
        let maps = datapath.take_lb_maps()?;
        let mut reconciler = Reconciler::new(maps)?;
        let objects = workload::objects(&services(n));
        let translation = desired_state(
            &objects.lb.services,
            &objects.lb.slices,
            &NodeInfo::default(),
        );
        ensure!(
            translation.skipped.is_empty(),
            "translation skipped objects: {:?}",
            translation.skipped.first()
        );
        ensure!(
            translation.state.services.len() == n,
            "{n} frontends expected"
        );
        let report = reconciler.apply(&translation.state);
        if let Some(e) = report.errors.first() {
            bail!(
                "programming {n} services failed for {} of them, first: {} {}: {}",
                report.errors.len(),
                e.frontend,
                e.service,
                e.error
            );
        }
        let ingress = prog_fd(&mut datapath, prog_names::TC_INGRESS)?;
        let egress = prog_fd(&mut datapath, prog_names::TC_EGRESS)?;
        let xdp = xdp_fd(&mut datapath)?;
        Ok(Self {
            services: n,
            datapath,
            _reconciler: reconciler,
            ingress,
            egress,
            xdp,
            next_reply_port: SPORT_REPLY_FIRST,
        })
    }

    /// Sum over CPUs of the packet counter `index`.
    fn counter(&mut self, index: u32) -> anyhow::Result<u64> {
        let map = self
            .datapath
            .ebpf_mut()
            .map(map_names::METRICS)
            .context("lb_metrics map")?;
        let array = PerCpuArray::<_, MetricValue>::try_from(map)?;
        Ok(array.get(&index, 0)?.iter().map(|v| v.packets).sum())
    }
}

/// The program's fd, valid while `datapath` lives.
fn prog_fd(datapath: &mut Datapath, name: &str) -> anyhow::Result<RawFd> {
    let program: &Program = datapath
        .ebpf_mut()
        .program(name)
        .with_context(|| format!("program {name} missing"))?;
    let classifier: &SchedClassifier = program.try_into()?;
    Ok(classifier.fd()?.as_fd().as_raw_fd())
}

/// `lb_xdp`'s fd, valid while `datapath` lives.
fn xdp_fd(datapath: &mut Datapath) -> anyhow::Result<RawFd> {
    let program: &Program = datapath
        .ebpf_mut()
        .program(XDP_PROGRAM)
        .with_context(|| format!("program {XDP_PROGRAM} missing"))?;
    let xdp: &aya::programs::Xdp = program.try_into()?;
    Ok(xdp.fd()?.as_fd().as_raw_fd())
}

/// XDP's "hand on to the stack" verdict, which the XDP cases return (tc's is 0).
const XDP_PASS: u32 = 2;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Case {
    /// lb_tc_ingress, SYN+FIN on the ring.
    New,
    /// lb_tc_ingress, ACK on the ring.
    Established,
    /// lb_tc_ingress, ACK to a non-service address.
    Miss,
    /// lb_tc_egress on the miss packet.
    Egress,
    /// The 2-instruction program on the miss packet.
    PassThrough,
    /// lb_xdp, SYN+FIN on the ring (the same pipeline as lb_tc_ingress, in XDP).
    XdpNew,
    /// lb_xdp, ACK on the ring.
    XdpEstablished,
    /// lb_xdp, ACK to a non-service address.
    XdpMiss,
    /// lb_tc_ingress, ACK from a backend to the client of two established flows that rev-NAT
    /// into each other (see `reply_flows`).
    Reply,
}

impl Case {
    const ALL: [Case; 9] = [
        Case::New,
        Case::Established,
        Case::Miss,
        Case::Egress,
        Case::PassThrough,
        Case::XdpNew,
        Case::XdpEstablished,
        Case::XdpMiss,
        Case::Reply,
    ];
    /// The cases of the single-run cross-check (tc only), the first of `ALL`.
    const SINGLE: usize = 5;

    /// The verdict every run must return.
    fn verdict(self) -> u32 {
        match self {
            Case::XdpNew | Case::XdpEstablished | Case::XdpMiss => XDP_PASS,
            _ => 0,
        }
    }

    /// (case, impl) as recorded.
    fn names(self) -> (&'static str, &'static str) {
        match self {
            Case::New => ("new_flow", "lb_tc_ingress"),
            Case::Established => ("established", "lb_tc_ingress"),
            Case::Miss => ("miss", "lb_tc_ingress"),
            Case::Egress => ("baseline", "lb_tc_egress_miss"),
            Case::PassThrough => ("baseline", "pass_through"),
            Case::XdpNew => ("new_flow", "lb_xdp"),
            Case::XdpEstablished => ("established", "lb_xdp"),
            Case::XdpMiss => ("miss", "lb_xdp"),
            Case::Reply => ("reply", "lb_tc_ingress"),
        }
    }

    /// The counter every run of this case must increment (none for the pass-through program).
    fn counter(self) -> Option<u32> {
        match self {
            Case::New | Case::XdpNew => Some(metrics::TC_FWD_NEW),
            Case::Established | Case::XdpEstablished => Some(metrics::TC_FWD_ESTABLISHED),
            Case::Miss | Case::Egress | Case::XdpMiss => Some(metrics::TC_PASS_NO_SERVICE),
            Case::Reply => Some(metrics::TC_REVNAT),
            Case::PassThrough => None,
        }
    }
}

pub fn run(settings: &Settings, results: &mut Results) -> anyhow::Result<()> {
    println!("datapath: loading {} datapaths", settings.sizes.len());
    let pass = load_pass_through().context("loading the pass-through SCHED_CLS program")?;
    let mut fixtures = Vec::new();
    for &n in &settings.sizes {
        let start = Instant::now();
        fixtures.push(Fixture::new(n)?);
        println!(
            "datapath: {n} services programmed in {:.2} s",
            start.elapsed().as_secs_f64()
        );
    }
    results.note(
        "datapath_xdp",
        "lb_xdp: the same packets (a ClusterIP from outside, not masqueraded: DNAT and \
         XDP_PASS) through BPF_PROG_TEST_RUN of the XDP program; repeat method only",
    );
    let _pin = PinCpu::last()?;
    let mut rng = Rng::new(0xda7a);

    // Repeat method: one BPF_PROG_TEST_RUN of `repeat` runs per sample.
    let mut samples = vec![vec![Vec::new(); Case::ALL.len()]; fixtures.len()];
    for rep in 0..settings.reps {
        let mut order: Vec<(usize, usize)> = (0..fixtures.len())
            .flat_map(|f| (0..Case::ALL.len()).map(move |c| (f, c)))
            .filter(|(_, c)| {
                settings.cases.is_empty()
                    || settings.cases.contains(&format!("{:?}", Case::ALL[*c]))
            })
            .collect();
        rng.shuffle(&mut order);
        workload::check_interrupted()?;
        for (f, c) in order {
            let ns = measure_repeat(
                &mut fixtures[f],
                pass.as_raw_fd(),
                Case::ALL[c],
                settings.repeat,
            )
            .with_context(|| {
                format!(
                    "{:?} at {} services, rep {rep}",
                    Case::ALL[c],
                    fixtures[f].services
                )
            })?;
            samples[f][c].push(ns);
        }
    }
    for (f, fixture) in fixtures.iter().enumerate() {
        for (c, case) in Case::ALL.iter().enumerate() {
            let (name, impl_) = case.names();
            if samples[f][c].is_empty() {
                continue;
            }
            let median = workload::median(&mut samples[f][c]);
            println!(
                "datapath: {} services, {case:?}: median {median} ns of {:?}",
                fixture.services, samples[f][c]
            );
            results.push(
                SUITE,
                name,
                impl_,
                fixture.services,
                "ns_per_packet",
                median,
                None,
                "ns",
            );
        }
    }

    // One packet per run, distinct flows: kernel-timed single runs.
    let mut single = vec![vec![Vec::new(); Case::ALL.len()]; fixtures.len()];
    for rep in 0..settings.reps {
        let mut order: Vec<usize> = (0..fixtures.len()).collect();
        rng.shuffle(&mut order);
        for f in order {
            workload::check_interrupted()?;
            measure_single(
                &mut fixtures[f],
                pass.as_raw_fd(),
                rep,
                settings.single_shot,
                &mut single[f],
            )
            .with_context(|| format!("single runs at {} services", fixtures[f].services))?;
        }
    }
    for (f, fixture) in fixtures.iter().enumerate() {
        for (c, case) in Case::ALL[..Case::SINGLE].iter().enumerate() {
            let (name, impl_) = case.names();
            let v = &mut single[f][c];
            let median = workload::median(v);
            let p99 = workload::percentile(v, 99.0);
            results.push(
                SUITE,
                &format!("{name}_single"),
                impl_,
                fixture.services,
                "ns_per_packet",
                median,
                Some(p99),
                "ns",
            );
        }
    }
    results.note(
        "datapath_method",
        format!(
            "BPF_PROG_TEST_RUN, repeat = {} per sample, median of {} samples per cell, all \
             cells interleaved in random order; single-run cross-check: {} distinct flows per \
             size and repetition, kernel-reported duration of each run (includes one \
             ktime_get_ns), median and p99 over all runs",
            settings.repeat, settings.reps, settings.single_shot
        ),
    );
    Ok(())
}

/// ns per run of one BPF_PROG_TEST_RUN with `repeat` runs, after checking every run took the
/// case's path.
fn measure_repeat(fx: &mut Fixture, pass: RawFd, case: Case, repeat: u32) -> anyhow::Result<f64> {
    let (fd, pkt) = match case {
        Case::New => (
            fx.ingress,
            tcp(CLIENT, SPORT_NEW, workload::vip(0), 80, TCP_SYN | TCP_FIN),
        ),
        Case::Established => (
            fx.ingress,
            tcp(CLIENT, SPORT_ESTABLISHED, workload::vip(0), 80, TCP_ACK),
        ),
        Case::Miss => (fx.ingress, tcp(CLIENT, SPORT_MISS, MISS_DST, 80, TCP_ACK)),
        Case::Egress => (fx.egress, tcp(CLIENT, SPORT_MISS, MISS_DST, 80, TCP_ACK)),
        Case::PassThrough => (pass, tcp(CLIENT, SPORT_MISS, MISS_DST, 80, TCP_ACK)),
        Case::XdpNew => (
            fx.xdp,
            tcp(
                CLIENT,
                SPORT_XDP_NEW,
                workload::vip(0),
                80,
                TCP_SYN | TCP_FIN,
            ),
        ),
        Case::XdpEstablished => (
            fx.xdp,
            tcp(CLIENT, SPORT_XDP_ESTABLISHED, workload::vip(0), 80, TCP_ACK),
        ),
        Case::XdpMiss => (fx.xdp, tcp(CLIENT, SPORT_MISS, MISS_DST, 80, TCP_ACK)),
        Case::Reply => {
            let (sport, backend) = reply_flows(fx)?;
            (fx.ingress, tcp(backend, 81, CLIENT, sport, TCP_ACK))
        }
    };
    if matches!(case, Case::Established | Case::XdpEstablished) {
        // Creates (or refreshes) the ring's conntrack entries for this flow.
        test_run(fd, &pkt, 64)?;
    }
    let before = case.counter().map(|c| fx.counter(c)).transpose()?;
    let (retval, duration) = test_run(fd, &pkt, repeat)?;
    ensure!(
        retval == case.verdict(),
        "{case:?}: program returned {retval}, expected {}",
        case.verdict()
    );
    if let (Some(c), Some(before)) = (case.counter(), before) {
        let delta = fx.counter(c)? - before;
        ensure!(
            delta == u64::from(repeat),
            "{case:?}: {delta} of {repeat} runs took the intended path (counter {c})"
        );
    }
    Ok(f64::from(duration))
}

/// One run per packet over `count` fresh flows: new (SYN), then established (ACK, same flow),
/// miss, egress and pass-through; each run's kernel duration goes to `out[case]`.
fn measure_single(
    fx: &mut Fixture,
    pass: RawFd,
    rep: usize,
    count: usize,
    out: &mut [Vec<f64>],
) -> anyhow::Result<()> {
    // A client address per repetition keeps every flow new.
    let client = Ipv4Addr::new(198, 18, 20 + u8::try_from(rep % 200)?, 2);
    let cases = &Case::ALL[..Case::SINGLE];
    let before: Vec<Option<u64>> = cases
        .iter()
        .map(|c| c.counter().map(|i| fx.counter(i)).transpose())
        .collect::<anyhow::Result<_>>()?;
    for k in 0..count {
        let sport = 10_000 + u16::try_from(k)?;
        for (c, case) in cases.iter().enumerate() {
            let (fd, pkt) = match case {
                Case::New => (
                    fx.ingress,
                    tcp(client, sport, workload::vip(0), 80, TCP_SYN),
                ),
                Case::Established => (
                    fx.ingress,
                    tcp(client, sport, workload::vip(0), 80, TCP_ACK),
                ),
                Case::Miss => (fx.ingress, tcp(client, sport, MISS_DST, 80, TCP_ACK)),
                Case::Egress => (fx.egress, tcp(client, sport, MISS_DST, 80, TCP_ACK)),
                Case::PassThrough => (pass, tcp(client, sport, MISS_DST, 80, TCP_ACK)),
                Case::XdpNew | Case::XdpEstablished | Case::XdpMiss | Case::Reply => {
                    bail!("{case:?} is not a single-run case")
                }
            };
            let (retval, duration) = test_run(fd, &pkt, 1)?;
            ensure!(retval == 0, "{case:?}: program returned {retval}");
            out[c].push(f64::from(duration));
        }
    }
    // Miss and egress both count as "no service".
    for (c, case) in cases.iter().enumerate() {
        let (Some(index), Some(b)) = (case.counter(), before[c]) else {
            continue;
        };
        let per_case = if index == metrics::TC_PASS_NO_SERVICE {
            2
        } else {
            1
        };
        let delta = fx.counter(index)? - b;
        ensure!(
            delta == (per_case * count) as u64,
            "{case:?}: counter {index} moved by {delta}, expected {}",
            per_case * count
        );
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Packets

/// Ethernet + IPv4 + TCP with `flags` and a short payload; checksums valid.
fn tcp(src: Ipv4Addr, sport: u16, dst: Ipv4Addr, dport: u16, flags: u8) -> Vec<u8> {
    const PAYLOAD: &[u8] = b"hello\n";
    let tcp_len = 20 + PAYLOAD.len();
    let total = 20 + tcp_len;
    let mut p = Vec::with_capacity(14 + total);
    p.extend_from_slice(&[0x02, 0, 0, 0, 0, 2, 0x02, 0, 0, 0, 0, 1, 0x08, 0x00]);
    let ip_start = p.len();
    p.extend_from_slice(&[0x45, 0]);
    p.extend_from_slice(&u16::try_from(total).unwrap_or_default().to_be_bytes());
    p.extend_from_slice(&[0, 1, 0x40, 0, 64, 6, 0, 0]); // id, DF, ttl, TCP, checksum
    p.extend_from_slice(&src.octets());
    p.extend_from_slice(&dst.octets());
    let ip_csum = checksum(&p[ip_start..ip_start + 20], 0);
    p[ip_start + 10..ip_start + 12].copy_from_slice(&ip_csum.to_be_bytes());
    let tcp_start = p.len();
    p.extend_from_slice(&sport.to_be_bytes());
    p.extend_from_slice(&dport.to_be_bytes());
    p.extend_from_slice(&1000u32.to_be_bytes()); // seq
    let ack: u32 = if flags & TCP_ACK != 0 { 77 } else { 0 };
    p.extend_from_slice(&ack.to_be_bytes());
    p.extend_from_slice(&[0x50, flags, 0xfa, 0xf0, 0, 0, 0, 0]); // offset, flags, window, csum, urg
    p.extend_from_slice(PAYLOAD);
    let mut pseudo = Vec::with_capacity(12);
    pseudo.extend_from_slice(&src.octets());
    pseudo.extend_from_slice(&dst.octets());
    pseudo.extend_from_slice(&[0, 6]);
    pseudo.extend_from_slice(&u16::try_from(tcp_len).unwrap_or_default().to_be_bytes());
    let tcp_csum = checksum(&p[tcp_start..], sum16(&pseudo));
    p[tcp_start + 16..tcp_start + 18].copy_from_slice(&tcp_csum.to_be_bytes());
    p
}

fn sum16(data: &[u8]) -> u32 {
    data.chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], c.get(1).copied().unwrap_or(0)])))
        .sum()
}

/// The Internet checksum of `data` plus an initial one's-complement sum.
fn checksum(data: &[u8], initial: u32) -> u16 {
    let mut sum = initial + sum16(data);
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

// ---------------------------------------------------------------------------------------------
// Raw bpf(2): the pass-through program (aya loads programs from ELF objects only) and
// BPF_PROG_TEST_RUN with the kernel's own timing.

const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_PROG_TEST_RUN: libc::c_long = 10;
const BPF_PROG_TYPE_SCHED_CLS: u32 = 3;

/// The prefix of `union bpf_attr` BPF_PROG_LOAD uses; the rest stays zero.
#[repr(C)]
#[derive(Default)]
struct ProgLoadAttr {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
    kern_version: u32,
    prog_flags: u32,
    prog_name: [u8; 16],
    tail: [u64; 8],
}

/// `union bpf_attr`'s `test` member.
#[repr(C)]
#[derive(Default)]
struct TestRunAttr {
    prog_fd: u32,
    retval: u32,
    data_size_in: u32,
    data_size_out: u32,
    data_in: u64,
    data_out: u64,
    repeat: u32,
    duration: u32,
    ctx_size_in: u32,
    ctx_size_out: u32,
    ctx_in: u64,
    ctx_out: u64,
    flags: u32,
    cpu: u32,
    batch_size: u32,
    pad: u32,
}

fn bpf<T>(cmd: libc::c_long, attr: &mut T) -> io::Result<libc::c_long> {
    // SAFETY: `attr` is a valid, writable bpf_attr prefix of size_of::<T>() bytes; unused
    // trailing fields are zero, as the kernel requires.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            std::ptr::from_mut(attr).cast::<libc::c_void>(),
            size_of::<T>() as libc::c_uint,
        )
    };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

/// `r0 = 0 (TC_ACT_OK); exit` as a SCHED_CLS program.
fn load_pass_through() -> io::Result<OwnedFd> {
    // struct bpf_insn { u8 code; u8 dst:4, src:4; s16 off; s32 imm } in little endian.
    let insns: [u64; 2] = [
        0xb7, // BPF_ALU64 | BPF_MOV | BPF_K, r0, imm 0
        0x95, // BPF_JMP | BPF_EXIT
    ];
    let license = c"GPL";
    let mut name = [0u8; 16];
    name[..12].copy_from_slice(b"bench_passth");
    let mut attr = ProgLoadAttr {
        prog_type: BPF_PROG_TYPE_SCHED_CLS,
        insn_cnt: 2,
        insns: insns.as_ptr() as u64,
        license: license.as_ptr() as u64,
        prog_name: name,
        ..Default::default()
    };
    let fd = bpf(BPF_PROG_LOAD, &mut attr)?;
    let fd = RawFd::try_from(fd).map_err(io::Error::other)?;
    // SAFETY: the kernel just returned this fd; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Runs `fd` `repeat` times on `pkt`; returns (return value, kernel ns per run).
/// Opens, from the first free client port on, the flows CLIENT:s → A:80 (backend X:81) and
/// CLIENT:s → X:81 (backend A:80), A being the ring's first service: a reply from X:81 to
/// CLIENT:s is rev-NATed to come from A:80, which is the reply of the second flow, rev-NATed
/// back to X:81, so every repeated run is a reply. Backends are picked at random: ports are
/// tried until both picks close the loop. Returns (s, X).
fn reply_flows(fx: &mut Fixture) -> anyhow::Result<(u16, Ipv4Addr)> {
    let a = workload::vip(0);
    for _ in 0..64 {
        let sport = fx.next_reply_port;
        fx.next_reply_port = fx.next_reply_port.wrapping_add(1).max(SPORT_REPLY_FIRST);
        let out = test_run_out(fx.ingress, &tcp(CLIENT, sport, a, 80, TCP_SYN))?;
        let x = ipv4_dst(&out)?;
        let out = test_run_out(fx.ingress, &tcp(CLIENT, sport, x, 81, TCP_SYN))?;
        if ipv4_dst(&out)? == a {
            return Ok((sport, x));
        }
    }
    bail!("64 pairs of flows never rev-NATed into each other")
}

/// The destination address of a packet `tcp` built (after any rewrite).
fn ipv4_dst(pkt: &[u8]) -> anyhow::Result<Ipv4Addr> {
    let b: [u8; 4] = pkt
        .get(30..34)
        .and_then(|b| b.try_into().ok())
        .context("short packet out of the program")?;
    Ok(Ipv4Addr::from(b))
}

/// One run of `pkt`; returns the packet the program left.
fn test_run_out(fd: RawFd, pkt: &[u8]) -> anyhow::Result<Vec<u8>> {
    let mut out = vec![0u8; pkt.len() + 256];
    let mut attr = TestRunAttr {
        prog_fd: u32::try_from(fd)?,
        data_size_in: u32::try_from(pkt.len())?,
        data_in: pkt.as_ptr() as u64,
        data_size_out: u32::try_from(out.len())?,
        data_out: out.as_mut_ptr() as u64,
        repeat: 1,
        ..Default::default()
    };
    bpf(BPF_PROG_TEST_RUN, &mut attr).context("BPF_PROG_TEST_RUN")?;
    out.truncate(attr.data_size_out as usize);
    Ok(out)
}

fn test_run(fd: RawFd, pkt: &[u8], repeat: u32) -> anyhow::Result<(u32, u32)> {
    let mut attr = TestRunAttr {
        prog_fd: u32::try_from(fd)?,
        data_size_in: u32::try_from(pkt.len())?,
        data_in: pkt.as_ptr() as u64,
        repeat,
        ..Default::default()
    };
    bpf(BPF_PROG_TEST_RUN, &mut attr).context("BPF_PROG_TEST_RUN")?;
    Ok((attr.retval, attr.duration))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packet_checksums_verify() {
        let p = tcp(CLIENT, 1234, MISS_DST, 80, TCP_SYN);
        assert_eq!(p.len(), 14 + 20 + 20 + 6);
        assert_eq!(checksum(&p[14..34], 0), 0, "IPv4 header");
        let mut pseudo = Vec::new();
        pseudo.extend_from_slice(&p[26..34]);
        pseudo.extend_from_slice(&[0, 6, 0, 26]);
        assert_eq!(checksum(&p[34..], sum16(&pseudo)), 0, "TCP");
        assert_eq!(size_of::<TestRunAttr>(), 80);
    }
}
