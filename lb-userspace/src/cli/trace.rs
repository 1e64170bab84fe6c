//! `lb trace`: runs a synthetic packet through the real datapath program with
//! BPF_PROG_TEST_RUN and reports what it did and why.
//!
//! Live mode shares the running lb's pinned service, backend and rev-NAT maps; conntrack,
//! socket rev-NAT and counters are private scratch copies, so a trace never changes live state
//! (an existing live conntrack entry for the exact flow is copied in, so established flows
//! trace as established). Manifest mode loads a private copy of everything, programs it from
//! manifests through `lb run`'s own sync (`daemon::sync_node`), traces and unloads.
use std::{
    collections::HashMap as StdHashMap,
    fmt,
    net::{IpAddr, SocketAddr},
    path::Path,
};

use anyhow::{Context as _, bail};
use aya::{
    maps::{Array, HashMap, MapData},
    programs::{SchedClassifier, TestRun as _, TestRunOptions, Xdp},
};
use lb_common::{
    Affinity4Key, Affinity6Key, AffinityValue, Ct4Key, Ct4Value, Ct6Key, Ct6Value, IPPROTO_TCP,
    TraceRecord, ct_dir, ct_flags, lb_alg, map_names, metrics, prog_names, trace_affinity,
    trace_ct, trace_frag, trace_verdict,
};
use serde::Serialize;

use crate::{
    config::AlgorithmArgs,
    daemon::{self, Observed, SyncKind},
    datapath::conntrack::CtTimeouts,
    datapath::load::XdpMode,
    datapath::{
        load::{Datapath, LoadOptions, SERVICE_MAPS},
        maps::BpfMaps,
        pinned::open_hash,
    },
    kube::source::Snapshot,
    metrics::Metrics,
    model::{Family, Frontend, Proto, Scope},
    node::{NodeFacts, NodeFactsArgs, host_ips},
    reconcile::Reconciler,
    state_dir,
    translate::{NodeInfo, incremental::IncrementalTranslator},
};

const TC_ACT_SHOT: u32 = 2;
const TC_ACT_REDIRECT: u32 = 7;
const XDP_DROP: u32 = 1;
const XDP_PASS: u32 = 2;
const XDP_TX: u32 = 3;
const XDP_REDIRECT: u32 = 4;

/// Where the traced packet comes from, which decides the program it meets first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Origin {
    /// A local pod: the host side of its veth (`lb_tc_pod`).
    Pod,
    /// A process on the node: socket LB, emulated with `lb_tc_pod` (same maps and scope;
    /// cgroup sock_addr programs cannot be test-run).
    Node,
    /// Anything else: an external-facing device (`lb_tc_ingress`).
    External,
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Origin::Pod => "pod",
            Origin::Node => "node",
            Origin::External => "external",
        })
    }
}

pub use crate::node::Cidr;

/// How to classify a source address when `--from` is not given.
#[derive(Clone, Debug, Default)]
pub struct Classifier {
    pub cluster_cidrs: Vec<Cidr>,
    pub node_ips: Vec<IpAddr>,
}

impl Classifier {
    pub fn classify(&self, src: &IpAddr) -> Origin {
        if self.node_ips.contains(src) {
            Origin::Node
        } else if self.cluster_cidrs.iter().any(|c| c.contains(src)) {
            Origin::Pod
        } else {
            Origin::External
        }
    }
}

/// What one traced packet did: the datapath's own decision record (`lb_trace`), named with the
/// maps it used. The JSON form is stable (see the README): fields may be added, never removed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct TraceResult {
    /// `forward`, `drop`, `pass`, `reject`, or `echo-reply` (a `--ping` the datapath answered).
    pub verdict: &'static str,
    /// The counter the datapath bumped for the packet: the precise reason for the verdict
    /// (`tc_forward_new`, `tc_drop_no_backend`, ... from `lb_common::metrics::NAMES`).
    pub reason: &'static str,
    /// Conntrack: `new` (a backend was chosen), `new_midstream` (the same, for a TCP/SCTP
    /// packet that opens no connection and had no usable entry), `established` (the flow's
    /// entry was reused), `reply` (a backend's reply was reverse-NATed), `backend_gone` (a TCP
    /// packet without SYN met an entry whose backend was removed: answered with a RST, the
    /// entry deleted), `related` (an ICMP error quoting a flow conntrack knows, translated
    /// with it), or `null`.
    pub conntrack: Option<&'static str>,
    /// The flags of the conntrack entry the packet met, before the packet changed them:
    /// `seen_reply`, `tx_closing` (FIN/RST from the client), `rx_closing` (from the backend),
    /// `snat`, `local_frontend`; empty without an entry.
    pub conntrack_flags: Vec<&'static str>,
    /// The backend slot chosen for a new flow (`1..=count`), or `null` (none chosen, or the
    /// client's session affinity entry chose the backend).
    pub slot: Option<u16>,
    /// Session affinity of a new flow: `hit` (the client's entry chose the backend), `new` (no
    /// usable entry: the backend was chosen afresh and remembered), or `null` (the frontend has
    /// no session affinity).
    pub affinity: Option<&'static str>,
    /// The algorithm a new flow's backend was chosen with (`random` or `maglev`), or `null`.
    pub lb_algorithm: Option<&'static str>,
    /// With `maglev`: the cell of the frontend's Maglev table the flow hashed to (`0..M`).
    pub maglev_cell: Option<u32>,
    /// With `maglev`: M, the cells of the table.
    pub maglev_table_size: Option<u32>,
    /// The frontend scope the datapath used: `external` or `internal`, or `null`.
    pub scope: Option<&'static str>,
    /// The backend `ip:port` the packet was sent to, if any.
    pub backend: Option<String>,
    /// Whether the datapath masqueraded the source (to the node IP and a NAT port).
    pub masquerade: bool,
    /// Whether the new flow's backend is an address of this node (a hostNetwork endpoint, as
    /// the FIB of the netns `lb trace` runs in sees it): DNATed only and handed to the node's
    /// stack, never masqueraded, even where the rules would masquerade (`tc_local_backend`).
    pub local_backend: bool,
    /// The packet's source `ip:port` as the program sent it out.
    pub source_after: String,
    /// `namespace/name:port` of the matched frontend's service, if any.
    pub service: Option<String>,
    /// Every backend a new flow from this source could be sent to.
    pub candidates: Vec<String>,
    /// The program that ran (and how `node` traffic is emulated).
    pub hook: String,
    /// The node facts the trace ran with; `null` when they are the running lb's own.
    pub node: Option<NodeFacts>,
    /// What a `reject` (or an `echo-reply`) sends back to the client (the program's output
    /// packet), else `null`.
    pub reply: Option<Reply>,
    /// `first` (its ports remembered for the later fragments) or `later` (its ports from
    /// the first fragment: it follows that flow or passes untouched), else `null`.
    pub fragment: Option<&'static str>,
    /// IPv6 extension headers the datapath walked to the L4 header.
    pub ipv6_extension_headers: u8,
    /// For an `--icmp-error`: the error as the program left it, else `null`.
    pub icmp_error: Option<IcmpErrorTrace>,
}

/// The reply packet a REJECT sends back.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Reply {
    /// `tcp-rst`, `icmp-port-unreachable` or `icmpv6-port-unreachable`; for an answered
    /// `--ping`, `icmp-echo-reply` or `icmpv6-echo-reply`.
    pub proto: &'static str,
    /// `ip:port` for a RST, `ip` for ICMP.
    pub src: String,
    pub dst: String,
}

impl Reply {
    /// Reads the reply out of the program's output frame; `None` if it is none of the three.
    fn parse(frame: &[u8]) -> Option<Self> {
        let ethertype = u16::from_be_bytes([*frame.get(12)?, *frame.get(13)?]);
        let ip = frame.get(14..)?;
        let (src, dst, proto, l4): (IpAddr, IpAddr, u8, &[u8]) = match ethertype {
            0x0800 => {
                let s: [u8; 4] = ip.get(12..16)?.try_into().ok()?;
                let d: [u8; 4] = ip.get(16..20)?.try_into().ok()?;
                let ihl = usize::from(ip.first()? & 0xf) * 4;
                (s.into(), d.into(), *ip.get(9)?, ip.get(ihl..)?)
            }
            0x86dd => {
                let s: [u8; 16] = ip.get(8..24)?.try_into().ok()?;
                let d: [u8; 16] = ip.get(24..40)?.try_into().ok()?;
                (s.into(), d.into(), *ip.get(6)?, ip.get(40..)?)
            }
            _ => return None,
        };
        let kind = (proto, *l4.first()?, *l4.get(1)?);
        let port = |o: usize| Some(u16::from_be_bytes([*l4.get(o)?, *l4.get(o + 1)?]));
        match kind {
            (6, _, _) if l4.get(13)? & 0x04 != 0 => Some(Self {
                proto: "tcp-rst",
                src: SocketAddr::new(src, port(0)?).to_string(),
                dst: SocketAddr::new(dst, port(2)?).to_string(),
            }),
            (1, 3, 3) => Some(Self {
                proto: "icmp-port-unreachable",
                src: src.to_string(),
                dst: dst.to_string(),
            }),
            (58, 1, 4) => Some(Self {
                proto: "icmpv6-port-unreachable",
                src: src.to_string(),
                dst: dst.to_string(),
            }),
            (1, 0, 0) => Some(Self {
                proto: "icmp-echo-reply",
                src: src.to_string(),
                dst: dst.to_string(),
            }),
            (58, 129, 0) => Some(Self {
                proto: "icmpv6-echo-reply",
                src: src.to_string(),
                dst: dst.to_string(),
            }),
            _ => None,
        }
    }
}

impl fmt::Display for Reply {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match self.proto {
            "tcp-rst" => "TCP RST",
            "icmp-port-unreachable" => "ICMP port unreachable",
            "icmp-echo-reply" => "ICMP echo reply",
            "icmpv6-echo-reply" => "ICMPv6 echo reply",
            _ => "ICMPv6 port unreachable",
        };
        write!(f, "{what} {} → {}", self.src, self.dst)
    }
}

/// One packet to trace.
#[derive(Clone, Copy, Debug)]
pub struct Probe {
    pub src: IpAddr,
    pub sport: u16,
    pub dst: IpAddr,
    pub dport: u16,
    pub proto: Proto,
    pub origin: Origin,
    /// TCP: an ACK of an established connection instead of a SYN (`--midstream`).
    pub midstream: bool,
    /// IPv6 destination-options headers in front of the L4 header (`--ipv6-ext-headers`).
    pub ext_headers: u8,
    /// Which fragment of a datagram the packet is, if any (`--fragments`).
    pub fragment: FragProbe,
    /// An ICMP/ICMPv6 echo request to `dst` instead (`--ping`; `sport` its identifier).
    pub echo: bool,
}

/// A probe as a fragment: the first (with the ports, more fragments follow) or a later one
/// (no L4 header) of the same datagram.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FragProbe {
    None,
    First,
    Later,
}

/// The ICMP errors `--icmp-error` sends about a traced flow's packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum IcmpErrorKind {
    /// IPv4 fragmentation needed (MTU 1400), IPv6 packet too big (MTU 1280).
    FragNeeded,
    /// Time (hop limit) exceeded in transit.
    TimeExceeded,
    /// Port unreachable (what a backend without the port answers UDP with).
    PortUnreachable,
}

impl IcmpErrorKind {
    fn name(self) -> &'static str {
        match self {
            IcmpErrorKind::FragNeeded => "frag-needed",
            IcmpErrorKind::TimeExceeded => "time-exceeded",
            IcmpErrorKind::PortUnreachable => "port-unreachable",
        }
    }

    /// (type, code, the 4 bytes after the checksum) for `v6` or IPv4.
    fn header(self, v6: bool) -> (u8, u8, [u8; 4]) {
        match (self, v6) {
            (IcmpErrorKind::FragNeeded, false) => (3, 4, [0, 0, 0x05, 0x78]),
            (IcmpErrorKind::FragNeeded, true) => (2, 0, 1280u32.to_be_bytes()),
            (IcmpErrorKind::TimeExceeded, false) => (11, 0, [0; 4]),
            (IcmpErrorKind::TimeExceeded, true) => (3, 0, [0; 4]),
            (IcmpErrorKind::PortUnreachable, false) => (3, 3, [0; 4]),
            (IcmpErrorKind::PortUnreachable, true) => (1, 4, [0; 4]),
        }
    }
}

/// An ICMP error `lb trace --icmp-error` sent, as it left the program.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct IcmpErrorTrace {
    /// `frag-needed`, `time-exceeded` or `port-unreachable`.
    pub kind: &'static str,
    /// Outer source and destination after the program.
    pub src: String,
    pub dst: String,
    /// The quoted packet's source and destination `ip:port` after the program.
    pub quote_src: String,
    pub quote_dst: String,
}

/// Names of `ct_flags` bits, in bit order.
pub fn ct_flag_names(flags: u16) -> Vec<&'static str> {
    [
        (ct_flags::SEEN_REPLY, "seen_reply"),
        (ct_flags::TX_CLOSING, "tx_closing"),
        (ct_flags::RX_CLOSING, "rx_closing"),
        (ct_flags::SNAT, "snat"),
        (ct_flags::LOCAL_FRONTEND, "local_frontend"),
    ]
    .into_iter()
    .filter(|(bit, _)| flags & bit != 0)
    .map(|(_, name)| name)
    .collect()
}

/// The running lb's conntrack maps: TCP and the rest, IPv4 then IPv6.
type LiveCt = (
    [HashMap<MapData, Ct4Key, Ct4Value>; 2],
    [HashMap<MapData, Ct6Key, Ct6Value>; 2],
);

/// The running lb's IPv4 and IPv6 session affinity maps.
type LiveAffinity = (
    HashMap<MapData, Affinity4Key, AffinityValue>,
    HashMap<MapData, Affinity6Key, AffinityValue>,
);
/// The private conntrack maps of a trace hold a handful of flows: no need for the hundreds of
/// megabytes `lb run`'s preallocated defaults take.
fn private_ct_sizes() -> std::collections::BTreeMap<String, u32> {
    [
        map_names::CT_TCP4,
        map_names::CT_ANY4,
        map_names::CT_TCP6,
        map_names::CT_ANY6,
    ]
    .into_iter()
    .map(|n| (n.to_string(), 1024))
    .collect()
}

/// The running lb's Maglev geometry, (M, tables), to read its pinned tables with; (0, 0) when
/// it has none (pins of an lb without Maglev: its frontends are all random).
fn live_maglev(pin_dir: &Path) -> anyhow::Result<(u32, u32)> {
    let meta = crate::datapath::meta::check(pin_dir)?;
    let maglev_path = pin_dir.join(map_names::MAGLEV);
    if let Some(m) = meta.map(|m| m.maglev_table_size).filter(|m| *m != 0)
        && maglev_path.exists()
    {
        let info = aya::maps::MapInfo::from_pin(&maglev_path)
            .map_err(|e| crate::datapath::pinned::pin_error(&maglev_path, e))?;
        return Ok((m, info.max_entries() / m));
    }
    Ok((0, 0))
}

/// The running lb's frontend names from `state_dir`: (frontend, scope) → `ns/name:port`.
fn live_names(state_dir: &Path) -> anyhow::Result<StdHashMap<(String, Scope), String>> {
    let names = match state_dir::read_names(state_dir) {
        Ok(names) => names,
        // No names when the file cannot be read; a file that cannot be parsed is an error.
        Err(state_dir::ReadError::Read { .. }) => state_dir::Names::new(),
        Err(e @ state_dir::ReadError::Parse { .. }) => {
            return Err(e).context("parsing frontends.json");
        }
    };
    Ok(names
        .into_values()
        .map(|n| {
            // As before: anything but `internal` is the external scope.
            let s = if n.scope == Scope::Internal.as_str() {
                Scope::Internal
            } else {
                Scope::External
            };
            ((n.frontend.clone(), s), n.service().to_string())
        })
        .collect())
}

/// Programs the private maps of `reconciler` from `snapshot` through `lb run`'s first sync (a
/// fresh translator translates everything), on private metrics: what it skips and the Maglev
/// fallbacks are warned of as the daemon warns, a service it cannot program is an error.
/// Returns the names of the frontends.
fn program(
    reconciler: &mut Reconciler<BpfMaps>,
    snapshot: &Snapshot,
    node: &NodeInfo,
) -> anyhow::Result<StdHashMap<(String, Scope), String>> {
    let mut translator = IncrementalTranslator::new();
    let first = SyncKind {
        generation: 1,
        full: false,
    };
    let synced = daemon::sync_node(
        reconciler,
        &mut translator,
        snapshot,
        node,
        first,
        &Metrics::new(),
        &Observed::default(),
    );
    if let Some(e) = synced.report.errors.first() {
        bail!("programming {} failed: {}", e.frontend, e.error);
    }
    Ok(translator
        .state()
        .services
        .iter()
        .map(|(fe, e)| ((fe.l4.to_string(), fe.scope), e.name.to_string()))
        .collect())
}

pub struct Tracer {
    datapath: Datapath,
    reconciler: Reconciler<BpfMaps>,
    /// (frontend, scope) → `ns/name:port`.
    names: StdHashMap<(String, Scope), String>,
    /// The running lb's conntrack, to copy an established flow's entry from.
    live_ct: Option<LiveCt>,
    /// The running lb's session affinity, to copy the traced client's entries from.
    live_affinity: Option<LiveAffinity>,
    /// The node facts of a private config; `None` when the running lb's are shared.
    facts: Option<NodeFacts>,
    /// External packets meet `lb_xdp` first (`--xdp`).
    xdp: bool,
    /// M of the Maglev tables the datapath reads.
    maglev_table_size: u32,
    /// The frame the last traced packet left the program as (what `--icmp-error` quotes).
    last_out: Vec<u8>,
}

impl Tracer {
    /// Traces against a running lb's maps in `pin_dir`; names from `state_dir`. The node facts
    /// are the running lb's (its pinned `lb_config` and cluster-CIDR maps, read only), unless
    /// `facts` replaces them in a private copy.
    pub fn live(
        pin_dir: &Path,
        state_dir: &Path,
        facts: Option<&NodeFacts>,
        ct_timeouts: CtTimeouts,
    ) -> anyhow::Result<Self> {
        let mut shared = SERVICE_MAPS.to_vec();
        let maglev = live_maglev(pin_dir)?;
        if maglev.0 != 0 {
            shared.push(map_names::MAGLEV);
        }
        if facts.is_none() {
            shared.extend([
                map_names::CONFIG,
                map_names::CLUSTER_CIDR4,
                map_names::CLUSTER_CIDR6,
            ]);
        }
        let mut datapath = Datapath::load(&LoadOptions {
            pin_dir: Some(pin_dir.to_path_buf()),
            only_pinned: Some(shared),
            max_entries: private_ct_sizes(),
            ct_timeouts,
            trace: true,
            maglev_table_size: maglev.0,
            maglev_tables: maglev.1,
            ..LoadOptions::default()
        })?;
        if let Some(f) = facts {
            datapath.write_node_facts(f)?;
        }
        let reconciler = Reconciler::new(datapath.take_lb_maps()?)?;
        let names = live_names(state_dir)?;
        let live_ct = Some((
            [
                open_hash(pin_dir, map_names::CT_TCP4)?,
                open_hash(pin_dir, map_names::CT_ANY4)?,
            ],
            [
                open_hash(pin_dir, map_names::CT_TCP6)?,
                open_hash(pin_dir, map_names::CT_ANY6)?,
            ],
        ));
        Ok(Self {
            datapath,
            reconciler,
            names,
            live_ct,
            live_affinity: Some((
                open_hash(pin_dir, map_names::AFFINITY4)?,
                open_hash(pin_dir, map_names::AFFINITY6)?,
            )),
            facts: facts.cloned(),
            xdp: false,
            maglev_table_size: maglev.0,
            last_out: Vec::new(),
        })
    }

    /// Loads a private datapath programmed from the manifests in `dir`, as `lb run` would on
    /// `node` with the node facts `facts` (node IPs defaulting to the manifests' Node object's,
    /// then the host's); returns the facts used too.
    pub fn from_manifests(
        dir: &Path,
        node_name: &str,
        facts: &NodeFactsArgs,
        algorithm: &AlgorithmArgs,
        ct_timeouts: CtTimeouts,
    ) -> anyhow::Result<(Self, NodeFacts)> {
        let mut datapath = Datapath::load(&LoadOptions {
            max_entries: private_ct_sizes(),
            ct_timeouts,
            trace: true,
            maglev_table_size: algorithm.maglev_table_size,
            maglev_tables: algorithm.tables(),
            ..LoadOptions::default()
        })?;
        let mut reconciler = Reconciler::new(datapath.take_lb_maps()?)?;
        let snapshot = Snapshot::from_manifests(dir, node_name)?;
        let resolved = NodeFacts::resolve(facts, snapshot.node.as_deref(), host_ips);
        datapath.write_node_facts(&resolved)?;
        // The private copy's service CIDR tries (a live trace uses the running lb's).
        let cidrs: Vec<(IpAddr, u8)> = resolved
            .service_cidrs
            .iter()
            .map(|c| (c.addr, c.prefix))
            .collect();
        datapath.set_service_cidrs(&cidrs)?;
        // The simulated node's own addresses: its node IPs and NodePort addresses.
        let mut local_ips = resolved.node_ips.clone();
        local_ips.extend(resolved.nodeport_addresses.iter().copied());
        let node = daemon::node_info(node_name, Some(&resolved), algorithm, local_ips);
        let names = program(&mut reconciler, &snapshot, &node)?;
        Ok((
            Self {
                datapath,
                reconciler,
                names,
                live_ct: None,
                live_affinity: None,
                facts: Some(resolved.clone()),
                xdp: false,
                maglev_table_size: algorithm.maglev_table_size,
                last_out: Vec::new(),
            },
            resolved,
        ))
    }

    /// Runs `probe` through the program its origin meets first.
    pub fn trace(&mut self, probe: &Probe) -> anyhow::Result<TraceResult> {
        self.copy_live_flow(probe)?;
        self.copy_live_affinity(probe.src)?;
        self.set_record(TraceRecord::default())?;
        let run = self.run_probe(probe)?;
        let verdict = verdict_name(run.record.verdict).with_context(|| {
            format!(
                "the datapath left no decision for the packet (trace verdict {})",
                run.record.verdict
            )
        })?;
        if !return_matches(verdict, run.ret, run.xdp) {
            bail!(
                "the datapath's record says {verdict} but the program returned {}",
                run.ret
            );
        }
        self.last_out.clone_from(&run.out);
        let reply = if matches!(verdict, "reject" | "echo-reply") {
            Some(Reply::parse(&run.out).context("a reject left no RST or ICMP reply")?)
        } else {
            None
        };
        let src_after = source_after(probe, reply.is_some(), &run.out, &run.record)?;
        // The record and the packet must agree: masqueraded means the source left as the NAT
        // port, not masqueraded means a forwarded packet kept its source.
        let masqueraded = run.record.masquerade != 0;
        if masqueraded && src_after.port() != run.record.nat_port
            || !masqueraded
                && run.record.verdict == trace_verdict::FORWARD
                && src_after != SocketAddr::new(probe.src, probe.sport)
        {
            bail!(
                "the datapath's record says masquerade={masqueraded} (port {}) but the packet \
                 left from {src_after}",
                run.record.nat_port
            );
        }
        self.result(probe, verdict, &run, src_after, reply)
    }

    /// The hook line of a socket-LB probe: emulated, and where socket LB keeps the socket's
    /// pair on this kernel (what recvmsg()/getpeername() and the UDP re-steering read).
    fn socket_lb_hook(&self) -> &'static str {
        if self.datapath.sock_uses_sk_storage() {
            "socket LB (emulated with lb_tc_pod: cgroup programs cannot be test-run); the \
             socket's first pair is kept in lb*_sk_revnat, the pairs of a socket that comes \
             back to it in its own lb*_sk_store (socket storage)"
        } else {
            "socket LB (emulated with lb_tc_pod: cgroup programs cannot be test-run); the \
             socket's pair is kept in lb*_sk_revnat (no socket storage for sock_addr programs)"
        }
    }

    /// Runs the probe's packet through the program its origin meets first, and on through
    /// tc ingress when `lb_xdp` hands it there.
    fn run_probe(&mut self, probe: &Probe) -> anyhow::Result<ProbeRun> {
        let (prog, hook) = match probe.origin {
            Origin::Pod => (prog_names::TC_POD, "tc ingress, pod veth (lb_tc_pod)"),
            Origin::Node => (prog_names::TC_POD, self.socket_lb_hook()),
            Origin::External => (prog_names::TC_INGRESS, "tc ingress (lb_tc_ingress)"),
        };
        let pkt = build_packet(probe);
        if !(probe.origin == Origin::External && self.xdp) {
            let (ret, out) = self.test_run(prog, &pkt, false)?;
            let record = self.record()?;
            return Ok(ProbeRun::new(ret, out, record, hook, false));
        }
        let (ret, out) = self.test_run(prog_names::XDP, &pkt, true)?;
        let record = self.record()?;
        if usize::from(record.reason) != metrics::XDP_PASS_TO_TC as usize {
            return Ok(ProbeRun::new(ret, out, record, "XDP (lb_xdp)", true));
        }
        // XDP handed the packet, untouched, to tc ingress on the same device.
        self.set_record(TraceRecord::default())?;
        let (ret, out) = self.test_run(prog, &out, false)?;
        let record = self.record()?;
        let hook = "XDP (lb_xdp), handed to tc ingress (lb_tc_ingress)";
        Ok(ProbeRun::new(ret, out, record, hook, false))
    }

    /// The result of a run whose verdict, reply and source were checked: the datapath's
    /// record, named with the maps it used.
    fn result(
        &self,
        probe: &Probe,
        verdict: &'static str,
        run: &ProbeRun,
        src_after: SocketAddr,
        reply: Option<Reply>,
    ) -> anyhow::Result<TraceResult> {
        let record = &run.record;
        let family = Family::of(&probe.src);
        let scope = Scope::try_from(record.scope)?;
        let maps = self.reconciler.maps();
        // The frontend the datapath matched: from its rev-NAT id, in the scope it used.
        let frontend = (record.rev_nat_id != 0)
            .then(|| maps.revnat(family, record.rev_nat_id))
            .flatten()
            .map(|(addr, port)| Frontend {
                scope,
                ..Frontend::new(addr, port, probe.proto)
            });
        let candidates = match frontend {
            Some(fe) if record.verdict != trace_verdict::REVERSE_NAT => maps
                .active_backends(&fe)
                .iter()
                .map(SocketAddr::to_string)
                .collect(),
            _ => Vec::new(),
        };
        let backend = (record.verdict == trace_verdict::FORWARD)
            .then(|| maps.backend(family, record.backend_id))
            .flatten()
            .map(|b| b.to_string());
        let is_service = frontend.is_some() && record.verdict != trace_verdict::REVERSE_NAT;
        // A new flow's choice was made (a backend, or the slot or cell that had none).
        let chosen = (is_service
            && matches!(record.ct_state, trace_ct::NEW | trace_ct::NEW_MIDSTREAM))
            || record.slot != 0
            || record.lb_alg == lb_alg::MAGLEV;
        let maglev = chosen && record.lb_alg == lb_alg::MAGLEV;
        Ok(TraceResult {
            verdict,
            reason: reason_name(record.reason),
            conntrack: ct_state_name(record.ct_state),
            conntrack_flags: ct_flag_names(record.ct_flags),
            slot: (record.slot != 0).then_some(record.slot),
            affinity: affinity_name(record.affinity),
            lb_algorithm: chosen.then_some(lb_alg_name(record.lb_alg)),
            maglev_cell: maglev.then_some(record.maglev_cell),
            maglev_table_size: maglev.then_some(self.maglev_table_size),
            // An echo's scope: the client's, which picked the address's verdict.
            scope: (is_service || probe.echo && record.verdict != trace_verdict::PASS)
                .then(|| scope.as_str()),
            backend,
            masquerade: record.masquerade != 0,
            local_backend: record.local_backend != 0,
            source_after: src_after.to_string(),
            service: frontend.map(|fe| self.name_of(&fe)),
            candidates,
            hook: run.hook.to_string(),
            node: self.facts.clone(),
            reply,
            fragment: frag_name(record.frag),
            ipv6_extension_headers: record.ext_headers,
            icmp_error: None,
        })
    }

    /// Sends the ICMP error `kind` about the packet the last trace forwarded (its source's
    /// answer from `from`, by default the backend itself) back through the program a
    /// backend's packets meet (`lb_tc_pod`), and reports what the datapath did with it.
    pub fn trace_icmp_error(
        &mut self,
        kind: IcmpErrorKind,
        from: Option<IpAddr>,
        proto: Proto,
    ) -> anyhow::Result<TraceResult> {
        let sent = std::mem::take(&mut self.last_out);
        let (src, dst) = endpoints(&sent).context("no forwarded packet to quote")?;
        let frame = icmp_error_frame(kind, from.unwrap_or(dst.ip()), src.ip(), &sent)?;
        self.set_record(TraceRecord::default())?;
        let (ret, out) = self.test_run(prog_names::TC_POD, &frame, false)?;
        let record = self.record()?;
        let verdict = verdict_name(record.verdict)
            .filter(|v| *v != "reject")
            .context("the datapath left no decision for the ICMP error")?;
        if (verdict == "drop") != (ret == TC_ACT_SHOT) {
            bail!("the datapath's record says {verdict} but the program returned {ret}");
        }
        let seen = quoted_endpoints(&out).context("the ICMP error left the program unreadable")?;
        let family = Family::of(&src.ip());
        let maps = self.reconciler.maps();
        let frontend = (record.rev_nat_id != 0)
            .then(|| maps.revnat(family, record.rev_nat_id))
            .flatten();
        let backend = (record.backend_id != 0)
            .then(|| maps.backend(family, record.backend_id))
            .flatten()
            .map(|b| b.to_string());
        let service = frontend.map(|(addr, port)| self.name_of(&Frontend::new(addr, port, proto)));
        Ok(TraceResult {
            verdict,
            reason: reason_name(record.reason),
            conntrack: (record.ct_state == trace_ct::RELATED).then_some("related"),
            conntrack_flags: ct_flag_names(record.ct_flags),
            slot: None,
            affinity: None,
            lb_algorithm: None,
            maglev_cell: None,
            maglev_table_size: None,
            scope: None,
            backend,
            masquerade: record.masquerade != 0,
            local_backend: false,
            source_after: seen.0.to_string(),
            service,
            candidates: Vec::new(),
            hook: "tc ingress, pod veth (lb_tc_pod): where a backend's packets arrive".into(),
            node: self.facts.clone(),
            reply: None,
            fragment: None,
            ipv6_extension_headers: 0,
            icmp_error: Some(IcmpErrorTrace {
                kind: kind.name(),
                src: seen.0.to_string(),
                dst: seen.1.to_string(),
                quote_src: seen.2.to_string(),
                quote_dst: seen.3.to_string(),
            }),
        })
    }

    /// Runs `pkt` through program `name` (`xdp`: an XDP program, else tc) with
    /// BPF_PROG_TEST_RUN: its return value and the packet it left.
    fn test_run(&mut self, name: &str, pkt: &[u8], xdp: bool) -> anyhow::Result<(u32, Vec<u8>)> {
        let mut out = vec![0u8; pkt.len() + 64];
        let mut opts = TestRunOptions::new();
        opts.data_in = Some(pkt);
        opts.data_out = Some(&mut out);
        let program = self
            .datapath
            .ebpf_mut()
            .program_mut(name)
            .with_context(|| format!("program {name} missing"))?;
        let run = if xdp {
            let p: &mut Xdp = program.try_into()?;
            p.test_run(opts)
        } else {
            let p: &mut SchedClassifier = program.try_into()?;
            p.test_run(opts)
        }
        .context("BPF_PROG_TEST_RUN")?;
        out.truncate(run.data_size_out as usize);
        Ok((run.return_value, out))
    }

    /// External packets go through `lb_xdp` first (and on to tc ingress where it hands them).
    pub fn set_xdp(&mut self, on: bool) {
        self.xdp = on;
    }

    /// `ns/name:port` of a frontend, `-` when the state dir does not know it.
    fn name_of(&self, fe: &Frontend) -> String {
        self.names
            .get(&(fe.l4.to_string(), fe.scope))
            .or_else(|| self.names.get(&(fe.l4.to_string(), Scope::External)))
            .cloned()
            .unwrap_or_else(|| "-".into())
    }

    fn trace_map(&mut self) -> anyhow::Result<Array<&mut MapData, TraceRecord>> {
        let map = self
            .datapath
            .ebpf_mut()
            .map_mut(map_names::TRACE)
            .context("lb_trace missing from the object")?;
        Ok(Array::try_from(map)?)
    }

    /// The decision the last test run wrote.
    fn record(&mut self) -> anyhow::Result<TraceRecord> {
        Ok(self.trace_map()?.get(&0, 0)?)
    }

    fn set_record(&mut self, r: TraceRecord) -> anyhow::Result<()> {
        Ok(self.trace_map()?.set(0, r, 0)?)
    }

    /// Copies the live conntrack entry of exactly this flow into the scratch map.
    fn copy_live_flow(&mut self, p: &Probe) -> anyhow::Result<()> {
        let Some((live4, live6)) = &self.live_ct else {
            return Ok(());
        };
        let proto = p.proto.number();
        // The map the datapath looks the flow up in (see `map_names::CT_TCP4`).
        let i = usize::from(proto != IPPROTO_TCP);
        let (name4, name6) = if i == 0 {
            (map_names::CT_TCP4, map_names::CT_TCP6)
        } else {
            (map_names::CT_ANY4, map_names::CT_ANY6)
        };
        let ebpf = self.datapath.ebpf_mut();
        match (p.src, p.dst) {
            (IpAddr::V4(s), IpAddr::V4(d)) => {
                let key = Ct4Key {
                    saddr: s.octets(),
                    daddr: d.octets(),
                    sport: p.sport,
                    dport: p.dport,
                    proto,
                    dir: ct_dir::SERVICE,
                    pad: [0; 2],
                };
                copy_entry(&live4[i], ebpf, name4, key)
            }
            (IpAddr::V6(s), IpAddr::V6(d)) => {
                let key = Ct6Key {
                    saddr: s.octets(),
                    daddr: d.octets(),
                    sport: p.sport,
                    dport: p.dport,
                    proto,
                    dir: ct_dir::SERVICE,
                    pad: [0; 2],
                };
                copy_entry(&live6[i], ebpf, name6, key)
            }
            _ => bail!("source and destination are of different address families"),
        }
    }
}

impl Tracer {
    /// Copies the live session affinity entries of client address `src` into the scratch
    /// maps, so a traced new flow meets the affinity the running lb would apply.
    fn copy_live_affinity(&mut self, src: IpAddr) -> anyhow::Result<()> {
        let Some((live4, live6)) = &self.live_affinity else {
            return Ok(());
        };
        let ebpf = self.datapath.ebpf_mut();
        match src {
            IpAddr::V4(a) => {
                for (k, _) in live4.iter().filter_map(Result::ok) {
                    if k.netns_cookie == 0 && k.addr == a.octets() {
                        copy_entry(live4, ebpf, map_names::AFFINITY4, k)?;
                    }
                }
            }
            IpAddr::V6(a) => {
                for (k, _) in live6.iter().filter_map(Result::ok) {
                    if k.netns_cookie == 0 && k.addr == a.octets() {
                        copy_entry(live6, ebpf, map_names::AFFINITY6, k)?;
                    }
                }
            }
        }
        Ok(())
    }
}

/// What the programs a probe met did with it.
struct ProbeRun {
    /// The last program's return value and the packet it left.
    ret: u32,
    out: Vec<u8>,
    /// The decision the last program recorded.
    record: TraceRecord,
    /// The programs that ran, as the result names them.
    hook: &'static str,
    /// Whether the last program was `lb_xdp` (its return values are XDP actions).
    xdp: bool,
}

impl ProbeRun {
    fn new(ret: u32, out: Vec<u8>, record: TraceRecord, hook: &'static str, xdp: bool) -> Self {
        Self {
            ret,
            out,
            record,
            hook,
            xdp,
        }
    }
}

/// Whether a program's return value `ret` fits the verdict it recorded. A forward of a
/// masqueraded flow is a redirect too (`fwd`), so only drop and reject have one value each.
fn return_matches(verdict: &str, ret: u32, xdp: bool) -> bool {
    if xdp {
        match verdict {
            "drop" => ret == XDP_DROP,
            "pass" => ret == XDP_PASS,
            "echo-reply" => ret == XDP_TX,
            "forward" => matches!(ret, XDP_PASS | XDP_TX | XDP_REDIRECT),
            _ => false,
        }
    } else {
        match verdict {
            "drop" => ret == TC_ACT_SHOT,
            "reject" | "echo-reply" => ret == TC_ACT_REDIRECT,
            _ => ret != TC_ACT_SHOT,
        }
    }
}

/// The packet's source as the program sent it out (`out`). A rejected (or answered) packet
/// goes nowhere: its source is as it was, as is an echo request's, which has no ports. A later
/// fragment has no ports: its datagram's are the first fragment's (the NAT port when
/// masqueraded).
fn source_after(
    probe: &Probe,
    replied: bool,
    out: &[u8],
    record: &TraceRecord,
) -> anyhow::Result<SocketAddr> {
    if probe.echo || replied {
        return Ok(SocketAddr::new(probe.src, probe.sport));
    }
    let sent = endpoints(out).context("program returned a short packet")?.0;
    if probe.fragment != FragProbe::Later {
        return Ok(sent);
    }
    let port = if record.masquerade != 0 {
        record.nat_port
    } else {
        probe.sport
    };
    Ok(SocketAddr::new(sent.ip(), port))
}

/// The `affinity` of a result, from a trace record's `affinity`.
fn affinity_name(affinity: u8) -> Option<&'static str> {
    match affinity {
        trace_affinity::HIT => Some("hit"),
        trace_affinity::NEW => Some("new"),
        _ => None,
    }
}

/// The `lb_algorithm` of a result, from a trace record's `lb_alg`.
fn lb_alg_name(alg: u8) -> &'static str {
    match alg {
        lb_alg::RANDOM => "random",
        lb_alg::MAGLEV => "maglev",
        _ => "unknown",
    }
}

/// The `fragment` of a result, from a trace record's `frag`.
fn frag_name(frag: u8) -> Option<&'static str> {
    match frag {
        trace_frag::FIRST => Some("first"),
        trace_frag::LATER => Some("later"),
        _ => None,
    }
}

/// The `conntrack` of a result, from a trace record's `ct_state`.
fn ct_state_name(state: u8) -> Option<&'static str> {
    match state {
        trace_ct::NEW => Some("new"),
        trace_ct::NEW_MIDSTREAM => Some("new_midstream"),
        trace_ct::ESTABLISHED => Some("established"),
        trace_ct::REPLY => Some("reply"),
        trace_ct::BACKEND_GONE => Some("backend_gone"),
        trace_ct::RELATED => Some("related"),
        _ => None,
    }
}

/// Copies `key`'s entry, if `live` has one, into the map `name` of the private object.
fn copy_entry<K: aya::Pod, V: aya::Pod>(
    live: &HashMap<MapData, K, V>,
    ebpf: &mut aya::Ebpf,
    name: &str,
    key: K,
) -> anyhow::Result<()> {
    if let Ok(v) = live.get(&key, 0) {
        let map = ebpf
            .map_mut(name)
            .with_context(|| format!("scratch {name}"))?;
        let mut scratch: HashMap<&mut MapData, K, V> = HashMap::try_from(map)?;
        scratch.insert(key, v, 0)?;
    }
    Ok(())
}

fn fold(mut sum: u32) -> u16 {
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    sum as u16
}

fn ones_sum(data: &[u8]) -> u32 {
    data.chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)])))
        .sum()
}

/// An Ethernet frame carrying a TCP SYN, a UDP datagram or an SCTP INIT, with valid checksums
/// (SCTP's CRC32c included).
fn build_packet(p: &Probe) -> Vec<u8> {
    let (proto, mut l4) = l4_segment(p);
    let mut frame = vec![0x02, 0, 0, 0, 0, 2, 0x02, 0, 0, 0, 0, 1];
    let pseudo = push_ip_header(&mut frame, p, proto, l4.len());
    set_l4_checksum(&mut l4, proto, pseudo);
    frame.extend_from_slice(&l4);
    shape(frame, p)
}

/// The probe's L4 protocol number and header (with payload); every checksum but SCTP's left
/// zero for `set_l4_checksum`.
fn l4_segment(p: &Probe) -> (u8, Vec<u8>) {
    match p.proto {
        // An echo request, its identifier the source port.
        _ if p.echo => {
            let mut h = vec![0u8; 12];
            h[0] = if p.src.is_ipv4() { 8 } else { 128 };
            h[4..6].copy_from_slice(&p.sport.to_be_bytes());
            h[6..8].copy_from_slice(&1u16.to_be_bytes());
            h[8..12].copy_from_slice(b"lbtr");
            (if p.src.is_ipv4() { 1 } else { 58 }, h)
        }
        Proto::Tcp => {
            let mut h = vec![0u8; 20];
            h[0..2].copy_from_slice(&p.sport.to_be_bytes());
            h[2..4].copy_from_slice(&p.dport.to_be_bytes());
            h[4..8].copy_from_slice(&1u32.to_be_bytes());
            h[12] = 5 << 4;
            if p.midstream {
                h[8..12].copy_from_slice(&1u32.to_be_bytes());
                h[13] = 0x10; // ACK: a later packet of the connection
            } else {
                h[13] = 0x02; // SYN: a new flow
            }
            h[14..16].copy_from_slice(&64240u16.to_be_bytes());
            (6, h)
        }
        Proto::Udp => {
            let mut h = vec![0u8; 12];
            h[0..2].copy_from_slice(&p.sport.to_be_bytes());
            h[2..4].copy_from_slice(&p.dport.to_be_bytes());
            h[4..6].copy_from_slice(&12u16.to_be_bytes());
            h[8..12].copy_from_slice(b"lbtr");
            (17, h)
        }
        Proto::Sctp => {
            // Common header (verification tag 0, as INIT requires) + INIT chunk: a new flow.
            let mut h = vec![0u8; 32];
            h[0..2].copy_from_slice(&p.sport.to_be_bytes());
            h[2..4].copy_from_slice(&p.dport.to_be_bytes());
            h[12..16].copy_from_slice(&[1, 0, 0, 20]);
            h[16..20].copy_from_slice(b"lbtr"); // initiate tag
            h[20..24].copy_from_slice(&65_535u32.to_be_bytes()); // a_rwnd
            h[24..28].copy_from_slice(&[0, 1, 0, 1]); // streams out/in
            h[28..32].copy_from_slice(&1u32.to_be_bytes()); // initial TSN
            let crc = crc32c(&h);
            h[8..12].copy_from_slice(&crc.to_le_bytes());
            (132, h)
        }
    }
}

/// Appends the probe's IPv4 (with its checksum) or IPv6 header for an L4 segment of `l4_len`
/// bytes; returns the ones' complement sum of the addresses (the L4 pseudo-header's).
fn push_ip_header(frame: &mut Vec<u8>, p: &Probe, proto: u8, l4_len: usize) -> u32 {
    match (p.src, p.dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            frame.extend_from_slice(&0x0800u16.to_be_bytes());
            let mut ip = vec![0x45, 0];
            ip.extend_from_slice(&((20 + l4_len) as u16).to_be_bytes());
            ip.extend_from_slice(&[0, 0, 0x40, 0, 64, proto, 0, 0]);
            ip.extend_from_slice(&s.octets());
            ip.extend_from_slice(&d.octets());
            let c = !fold(ones_sum(&ip));
            ip[10..12].copy_from_slice(&c.to_be_bytes());
            frame.extend_from_slice(&ip);
            ones_sum(&s.octets()) + ones_sum(&d.octets())
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            frame.extend_from_slice(&0x86ddu16.to_be_bytes());
            let mut ip = vec![0x60, 0, 0, 0];
            ip.extend_from_slice(&(l4_len as u16).to_be_bytes());
            ip.extend_from_slice(&[proto, 64]);
            ip.extend_from_slice(&s.octets());
            ip.extend_from_slice(&d.octets());
            frame.extend_from_slice(&ip);
            ones_sum(&s.octets()) + ones_sum(&d.octets())
        }
        _ => unreachable!("families checked by the caller"),
    }
}

/// Fills in the TCP, UDP or ICMP(v6) checksum of `l4`, `pseudo` the sum of the addresses.
fn set_l4_checksum(l4: &mut [u8], proto: u8, pseudo: u32) {
    let csum_off = match proto {
        6 => Some(16),
        17 => Some(6),
        1 | 58 => Some(2),
        _ => None,
    };
    if let Some(off) = csum_off {
        // ICMP's checksum has no pseudo-header; ICMPv6's has.
        let pseudo = match proto {
            1 => 0,
            _ => pseudo + u32::from(proto) + l4.len() as u32,
        };
        let sum = pseudo + ones_sum(l4);
        let c = match !fold(sum) {
            0 if proto == 17 => 0xffff,
            c => c,
        };
        l4[off..off + 2].copy_from_slice(&c.to_be_bytes());
    }
}

/// The fragment id of traced datagrams (both fragments of one `--fragments` trace share it).
const TRACE_FRAG_ID: u32 = 0x6c62;

/// `frame` with the probe's IPv6 extension headers and fragmenting applied: destination-options
/// headers (8 bytes each) in front of the L4 header; a first fragment (more fragments, offset 0)
/// or a later one (offset 64 bytes: its bytes are data, no L4 header).
fn shape(mut frame: Vec<u8>, p: &Probe) -> Vec<u8> {
    let later = p.fragment == FragProbe::Later;
    if frame[12..14] == [0x08, 0x00] {
        if p.fragment != FragProbe::None {
            let field: u16 = if later { 8 } else { 0x2000 };
            frame[18..20].copy_from_slice(&(TRACE_FRAG_ID as u16).to_be_bytes());
            frame[20..22].copy_from_slice(&field.to_be_bytes());
            frame[24..26].copy_from_slice(&[0, 0]);
            let c = !fold(ones_sum(&frame[14..34]));
            frame[24..26].copy_from_slice(&c.to_be_bytes());
        }
        return frame;
    }
    let mut headers: Vec<[u8; 8]> = Vec::new();
    let l4_proto = frame[20];
    let mut types: Vec<u8> = vec![60; usize::from(p.ext_headers)];
    if p.fragment != FragProbe::None {
        types.push(44);
    }
    for (i, ty) in types.iter().enumerate() {
        let next = types.get(i + 1).copied().unwrap_or(l4_proto);
        headers.push(if *ty == 44 {
            let off: u16 = if later { 8 << 3 } else { 1 };
            let [a, b] = off.to_be_bytes();
            let [c, d, e, g] = TRACE_FRAG_ID.to_be_bytes();
            [next, 0, a, b, c, d, e, g]
        } else {
            // One PadN option filling the 8 bytes.
            [next, 0, 1, 4, 0, 0, 0, 0]
        });
    }
    if let Some(first) = types.first() {
        frame[20] = *first;
        let plen = u16::from_be_bytes([frame[18], frame[19]]) + 8 * headers.len() as u16;
        frame[18..20].copy_from_slice(&plen.to_be_bytes());
        let tail = frame.split_off(54);
        for h in &headers {
            frame.extend_from_slice(h);
        }
        frame.extend_from_slice(&tail);
    }
    frame
}

/// CRC32c (Castagnoli, reflected), bit by bit: a probe packet is short.
fn crc32c(data: &[u8]) -> u32 {
    !data.iter().fold(!0u32, |mut c, &b| {
        c ^= u32::from(b);
        for _ in 0..8 {
            c = (c >> 1) ^ (0x82f6_3b78 & (c & 1).wrapping_neg());
        }
        c
    })
}

/// Source and destination `ip:port` of a frame built by `build_packet` (after rewriting).
fn endpoints(frame: &[u8]) -> Option<(SocketAddr, SocketAddr)> {
    let ethertype = u16::from_be_bytes([*frame.get(12)?, *frame.get(13)?]);
    let (src, dst, l4): (IpAddr, IpAddr, &[u8]) = match ethertype {
        0x0800 => {
            let ip = frame.get(14..)?;
            let ihl = usize::from(ip.first()? & 0xf) * 4;
            let s: [u8; 4] = ip.get(12..16)?.try_into().ok()?;
            let d: [u8; 4] = ip.get(16..20)?.try_into().ok()?;
            (s.into(), d.into(), ip.get(ihl..)?)
        }
        0x86dd => {
            let ip = frame.get(14..)?;
            let s: [u8; 16] = ip.get(8..24)?.try_into().ok()?;
            let d: [u8; 16] = ip.get(24..40)?.try_into().ok()?;
            // Past the extension headers `shape` puts in (destination options, fragment).
            let (mut next, mut off) = (*ip.get(6)?, 40);
            while matches!(next, 0 | 43 | 44 | 60) {
                let len = if next == 44 {
                    8
                } else {
                    (usize::from(*ip.get(off + 1)?) + 1) * 8
                };
                next = *ip.get(off)?;
                off += len;
            }
            (s.into(), d.into(), ip.get(off..)?)
        }
        _ => return None,
    };
    let port = |o: usize| Some(u16::from_be_bytes([*l4.get(o)?, *l4.get(o + 1)?]));
    Some((
        SocketAddr::new(src, port(0)?),
        SocketAddr::new(dst, port(2)?),
    ))
}

/// The `--json` verdict of a `trace_verdict`, `None` for no decision.
fn verdict_name(v: u8) -> Option<&'static str> {
    match v {
        trace_verdict::FORWARD | trace_verdict::REVERSE_NAT => Some("forward"),
        trace_verdict::PASS => Some("pass"),
        trace_verdict::DROP => Some("drop"),
        trace_verdict::REJECT => Some("reject"),
        trace_verdict::ECHO_REPLY => Some("echo-reply"),
        _ => None,
    }
}

/// The counter a trace record's `reason` names.
fn reason_name(reason: u8) -> &'static str {
    metrics::NAMES
        .get(usize::from(reason))
        .copied()
        .unwrap_or("unknown")
}

/// An Ethernet frame carrying ICMP(v6) error `kind` from `from` to `to`, quoting the IP
/// packet of `sent` (as much as RFC 1812 / RFC 4443 allow), every checksum computed.
fn icmp_error_frame(
    kind: IcmpErrorKind,
    from: IpAddr,
    to: IpAddr,
    sent: &[u8],
) -> anyhow::Result<Vec<u8>> {
    let v6 = to.is_ipv6();
    let quote = sent
        .get(14..)
        .context("no IP packet to quote")?
        .iter()
        .take(if v6 { 1232 } else { 548 })
        .copied()
        .collect::<Vec<u8>>();
    let (ty, code, rest) = kind.header(v6);
    let mut icmp = vec![ty, code, 0, 0];
    icmp.extend_from_slice(&rest);
    icmp.extend_from_slice(&quote);
    let mut frame = vec![0x02, 0, 0, 0, 0, 2, 0x02, 0, 0, 0, 0, 1];
    let pseudo = match (from, to) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            frame.extend_from_slice(&0x0800u16.to_be_bytes());
            let mut ip = vec![0x45, 0];
            ip.extend_from_slice(&((20 + icmp.len()) as u16).to_be_bytes());
            ip.extend_from_slice(&[0, 0, 0, 0, 64, 1, 0, 0]);
            ip.extend_from_slice(&s.octets());
            ip.extend_from_slice(&d.octets());
            let c = !fold(ones_sum(&ip));
            ip[10..12].copy_from_slice(&c.to_be_bytes());
            frame.extend_from_slice(&ip);
            0
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            frame.extend_from_slice(&0x86ddu16.to_be_bytes());
            let mut ip = vec![0x60, 0, 0, 0];
            ip.extend_from_slice(&(icmp.len() as u16).to_be_bytes());
            ip.extend_from_slice(&[58, 64]);
            ip.extend_from_slice(&s.octets());
            ip.extend_from_slice(&d.octets());
            frame.extend_from_slice(&ip);
            ones_sum(&s.octets()) + ones_sum(&d.octets()) + 58 + icmp.len() as u32
        }
        _ => bail!("--icmp-from must be of the traced packet's family"),
    };
    let c = !fold(pseudo + ones_sum(&icmp));
    icmp[2..4].copy_from_slice(&c.to_be_bytes());
    frame.extend_from_slice(&icmp);
    Ok(frame)
}

/// An ICMP error frame's outer source and destination and its quote's source and
/// destination `ip:port`.
fn quoted_endpoints(frame: &[u8]) -> Option<(IpAddr, IpAddr, SocketAddr, SocketAddr)> {
    let v6 = frame.get(12..14)? == [0x86, 0xdd];
    let (hl, s, d) = if v6 {
        (40, 22..38, 38..54)
    } else {
        (usize::from(frame.get(14)? & 0xf) * 4, 26..30, 30..34)
    };
    let addr = |r: std::ops::Range<usize>| -> Option<IpAddr> {
        let b = frame.get(r)?;
        Some(match b.len() {
            4 => IpAddr::from(<[u8; 4]>::try_from(b).ok()?),
            _ => IpAddr::from(<[u8; 16]>::try_from(b).ok()?),
        })
    };
    let (outer_src, outer_dst) = (addr(s)?, addr(d)?);
    // The quote, framed again so `endpoints` reads it.
    let mut inner = frame.get(..14)?.to_vec();
    inner.extend_from_slice(frame.get(14 + hl + 8..)?);
    let (qs, qd) = endpoints(&inner)?;
    Some((outer_src, outer_dst, qs, qd))
}

impl fmt::Display for TraceResult {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "hook:        {}", self.hook)?;
        writeln!(
            f,
            "service:     {}",
            self.service.as_deref().unwrap_or("(none)")
        )?;
        writeln!(f, "verdict:     {} ({})", self.verdict, self.reason)?;
        self.fmt_conntrack(f)?;
        self.fmt_selection(f)?;
        writeln!(f, "backend:     {}", self.backend.as_deref().unwrap_or("-"))?;
        writeln!(
            f,
            "source:      {}{}",
            self.source_after,
            if self.masquerade {
                " (masqueraded)"
            } else if self.local_backend {
                " (not masqueraded: the backend is an address of this node, delivered to its \
                 stack)"
            } else {
                " (not masqueraded)"
            }
        )?;
        if let Some(n) = &self.node {
            fmt_node(f, n)?;
        }
        self.fmt_packet(f)?;
        write!(f, "candidates:  {}", self.candidates.join(" "))?;
        if let Some(reply) = &self.reply {
            write!(f, "\nreply:       {reply}")?;
        }
        Ok(())
    }
}

impl TraceResult {
    /// The `conntrack:` and `ct flags:` lines.
    fn fmt_conntrack(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.conntrack {
            Some("new_midstream") => writeln!(
                f,
                "conntrack:   new (mid-stream packet without a conntrack entry: re-balanced)"
            )?,
            Some("backend_gone") => writeln!(
                f,
                "conntrack:   backend gone (the entry's backend was removed: RST, entry deleted)"
            )?,
            Some(ct) => writeln!(f, "conntrack:   {ct}")?,
            None => {}
        }
        if !self.conntrack_flags.is_empty() {
            writeln!(f, "ct flags:    {}", self.conntrack_flags.join(", "))?;
        }
        Ok(())
    }

    /// The `selection:` line: how a service packet's backend was chosen.
    fn fmt_selection(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Some(scope) = self.scope else {
            return Ok(());
        };
        let slot = self.slot.map(|s| format!(", slot {s}")).unwrap_or_default();
        let affinity = match self.affinity {
            Some("hit") => ", session affinity hit (the client's entry chose the backend)",
            Some(_) => ", session affinity: new entry for the client",
            None => "",
        };
        let cell = match (self.maglev_cell, self.maglev_table_size) {
            (Some(c), Some(m)) => format!(", maglev cell {c} of {m}"),
            _ => String::new(),
        };
        writeln!(f, "selection:   {scope} scope{slot}{cell}{affinity}")
    }

    /// The lines about the packet's shape: fragment, IPv6 extension headers, ICMP error.
    fn fmt_packet(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.fragment {
            Some("first") => writeln!(
                f,
                "fragment:    first (its ports and flow remembered for the later fragments)"
            )?,
            Some(_) => writeln!(
                f,
                "fragment:    later (ports from its first fragment: follows that flow or passes)"
            )?,
            None => {}
        }
        if self.ipv6_extension_headers != 0 {
            writeln!(
                f,
                "ipv6:        {} extension headers walked to the L4 header",
                self.ipv6_extension_headers
            )?;
        }
        if let Some(e) = &self.icmp_error {
            writeln!(
                f,
                "icmp error:  {} {} → {}, quoting {} → {}",
                e.kind, e.src, e.dst, e.quote_src, e.quote_dst
            )?;
        }
        Ok(())
    }
}

/// The `node:` line of a trace with node facts of its own.
fn fmt_node(f: &mut fmt::Formatter<'_>, n: &NodeFacts) -> fmt::Result {
    fn list<T: ToString>(v: &[T]) -> String {
        if v.is_empty() {
            "-".into()
        } else {
            v.iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(",")
        }
    }
    writeln!(
        f,
        "node:        ips {} ({:?}), cluster-cidr {}, service-cidr {}, masquerade-all {}, \
         echo-reply {}, nodeports on {}",
        list(&n.node_ips),
        n.node_ip_source,
        list(&n.cluster_cidrs),
        list(&n.service_cidrs),
        n.masquerade_all,
        n.echo_reply,
        list(&n.nodeport_addresses),
    )
}

/// `lb trace` arguments.
#[derive(Clone, Debug, clap::Args)]
pub struct TraceArgs {
    /// Source `IP` or `IP:PORT` (IPv6 as `[IP]:PORT`); the port defaults to 40000.
    #[arg(long)]
    pub src: String,
    /// Destination `IP:PORT`.
    #[arg(long)]
    pub dst: SocketAddr,
    #[arg(long, value_enum, default_value = "tcp")]
    pub proto: TraceProto,
    /// Where the packet comes from [default: classified by --cluster-cidr and --node-ip].
    #[arg(long, value_enum)]
    pub from: Option<Origin>,
    /// Trace N new flows that differ only in source port (one result per line).
    #[arg(long, default_value_t = 1)]
    pub flows: u16,
    /// One JSON object per traced packet.
    #[arg(long)]
    pub json: bool,
    /// TCP: trace an ACK of an established connection instead of a SYN, as the flow's later
    /// packets are (what a live flow's conntrack entry does to them, e.g. a removed backend).
    #[arg(long)]
    pub midstream: bool,
    /// Trace the packet as the first fragment of a datagram, then a later fragment of it (no
    /// L4 header: it follows its first fragment's flow or passes untouched).
    #[arg(long)]
    pub fragments: bool,
    /// IPv6: put this many destination-options extension headers (0–4) in front of the L4
    /// header; the datapath walks them.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=4))]
    pub ipv6_ext_headers: u8,
    /// After the packet, trace the ICMP error a router (or the backend) sends about it as
    /// the datapath forwarded it, arriving where a backend's packets arrive: rewritten for
    /// the client when it quotes a flow lb translated.
    #[arg(long, value_enum)]
    pub icmp_error: Option<IcmpErrorKind>,
    /// The ICMP error's source [default: the backend the packet went to].
    #[arg(long, requires = "icmp_error")]
    pub icmp_from: Option<IpAddr>,
    /// Trace an ICMP/ICMPv6 echo request (ping) to --dst's address instead (its port is
    /// ignored; the source port is the echo identifier): answered by the datapath when the
    /// address is a ClusterIP, external or LoadBalancer IP with a usable endpoint.
    #[arg(long, conflicts_with_all = ["fragments", "icmp_error", "midstream", "ipv6_ext_headers"])]
    pub ping: bool,
    /// The conntrack lifetimes, as `lb run` takes them (the sizes are accepted too; a trace's
    /// private conntrack holds a few entries whatever they say).
    #[command(flatten)]
    pub ct: crate::datapath::conntrack::CtArgs,
    /// Trace a private copy programmed from these manifests instead of the running lb.
    #[arg(long)]
    pub manifests: Option<std::path::PathBuf>,
    /// Node name for --manifests (endpoint locality, topology) [default: $NODE_NAME or the
    /// hostname].
    #[arg(long)]
    pub hostname_override: Option<String>,
    /// The node facts, as `lb run` takes them; they also classify the source: `--node-ip`
    /// addresses are `node`, `--cluster-cidr` ranges `pod`. In live mode any of them replaces
    /// the running lb's facts for the trace.
    #[command(flatten)]
    pub node_facts: NodeFactsArgs,
    /// External devices and XDP, as `lb run` takes them: with --xdp native or generic (or
    /// auto and a physical device among --devices) external packets meet lb_xdp first.
    #[command(flatten)]
    pub devices: crate::config::DeviceArgs,
    /// The algorithm flags, as `lb run` takes them (--manifests only: a live trace uses the
    /// running lb's tables).
    #[command(flatten)]
    pub algorithm: AlgorithmArgs,
    /// Pinned maps of the running lb (live mode).
    #[arg(long, default_value = lb_common::DEFAULT_PIN_DIR)]
    pub pin_dir: std::path::PathBuf,
    /// State dir of the running lb, for service names (live mode).
    #[arg(long, default_value = crate::state_dir::DEFAULT_STATE_DIR)]
    pub state_dir: std::path::PathBuf,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum TraceProto {
    Tcp,
    Udp,
    Sctp,
}

fn parse_src(s: &str) -> anyhow::Result<(IpAddr, Option<u16>)> {
    if let Ok(sa) = s.parse::<SocketAddr>() {
        return Ok((sa.ip(), Some(sa.port())));
    }
    let ip = s
        .trim_start_matches('[')
        .trim_end_matches(']')
        .parse::<IpAddr>()
        .with_context(|| format!("--src {s:?}: want IP, IP:PORT or [IPv6]:PORT"))?;
    Ok((ip, None))
}

/// Runs `lb trace`.
pub fn run(
    args: &TraceArgs,
    node_name: impl FnOnce() -> anyhow::Result<String>,
) -> anyhow::Result<()> {
    let (src, sport) = parse_src(&args.src)?;
    check_args(args, src)?;
    let mut tracer = open_tracer(args, node_name)?;
    tracer.set_xdp(xdp_first(&args.devices));
    let classifier = Classifier {
        cluster_cidrs: args.node_facts.cluster_cidr.clone(),
        node_ips: tracer
            .facts
            .as_ref()
            .map_or_else(|| args.node_facts.node_ip.clone(), |f| f.node_ips.clone()),
    };
    let origin = args.from.unwrap_or_else(|| classifier.classify(&src));
    let proto = match args.proto {
        TraceProto::Tcp => Proto::Tcp,
        TraceProto::Udp => Proto::Udp,
        TraceProto::Sctp => Proto::Sctp,
    };
    let base = sport.unwrap_or(40_000);
    for i in 0..args.flows {
        let sport = match base.wrapping_add(i) {
            0 => 1,
            p => p,
        };
        let probe = Probe {
            src,
            sport,
            dst: args.dst.ip(),
            dport: args.dst.port(),
            proto,
            origin,
            midstream: args.midstream,
            ext_headers: args.ipv6_ext_headers,
            fragment: if args.fragments {
                FragProbe::First
            } else {
                FragProbe::None
            },
            echo: args.ping,
        };
        for result in trace_flow(&mut tracer, args, &probe)? {
            print_result(args, &probe, i, &result)?;
        }
    }
    Ok(())
}

/// Refuses argument combinations no packet can be built for (`src` the parsed `--src`).
fn check_args(args: &TraceArgs, src: IpAddr) -> anyhow::Result<()> {
    if src.is_ipv4() != args.dst.is_ipv4() {
        bail!("--src and --dst must be of the same address family");
    }
    if args.flows == 0 {
        bail!("--flows must be at least 1");
    }
    if args.ipv6_ext_headers != 0 && src.is_ipv4() {
        bail!("--ipv6-ext-headers needs IPv6 addresses");
    }
    if args.fragments && args.proto == TraceProto::Sctp {
        bail!("--fragments: SCTP fragments are not translated (see the known limits)");
    }
    Ok(())
}

/// The tracer `args` ask for: a private copy programmed from `--manifests`, else the running
/// lb's maps (with private node facts when any node-fact flag is given).
fn open_tracer(
    args: &TraceArgs,
    node_name: impl FnOnce() -> anyhow::Result<String>,
) -> anyhow::Result<Tracer> {
    if let Some(dir) = &args.manifests {
        let (tracer, _) = Tracer::from_manifests(
            dir,
            &node_name()?,
            &args.node_facts,
            &args.algorithm,
            args.ct.timeouts(),
        )?;
        return Ok(tracer);
    }
    let facts = args
        .node_facts
        .any()
        .then(|| NodeFacts::resolve(&args.node_facts, None, host_ips));
    Tracer::live(
        &args.pin_dir,
        &args.state_dir,
        facts.as_ref(),
        args.ct.timeouts(),
    )
}

/// Whether external packets meet `lb_xdp` first, as `lb run` with these flags would attach it.
fn xdp_first(devices: &crate::config::DeviceArgs) -> bool {
    match devices.xdp {
        XdpMode::Native | XdpMode::Generic => true,
        XdpMode::Off => false,
        XdpMode::Auto => devices
            .devices
            .iter()
            .any(|d| XdpMode::Auto.resolve(d) == XdpMode::Native),
    }
}

/// Traces one flow's packets: `probe`, its later fragment (`--fragments`) and the ICMP error
/// about it (`--icmp-error`).
fn trace_flow(
    tracer: &mut Tracer,
    args: &TraceArgs,
    probe: &Probe,
) -> anyhow::Result<Vec<TraceResult>> {
    let mut results = vec![tracer.trace(probe)?];
    if args.fragments {
        let later = Probe {
            fragment: FragProbe::Later,
            ..*probe
        };
        results.push(tracer.trace(&later)?);
    }
    if let Some(kind) = args.icmp_error {
        if results.last().is_none_or(|r| r.verdict != "forward") {
            bail!("--icmp-error: the packet was not forwarded, so there is nothing to quote");
        }
        results.push(tracer.trace_icmp_error(kind, args.icmp_from, probe.proto)?);
    }
    Ok(results)
}

/// Prints one result of flow `i`: a JSON line, or the text with a heading naming the packet.
fn print_result(
    args: &TraceArgs,
    probe: &Probe,
    i: u16,
    result: &TraceResult,
) -> anyhow::Result<()> {
    if args.json {
        println!("{}", serde_json::to_string(result)?);
        return Ok(());
    }
    let (origin, src) = (probe.origin, SocketAddr::new(probe.src, probe.sport));
    if args.flows > 1 {
        println!("flow {} ({src} -> {}, from {origin})", i + 1, args.dst);
    } else {
        println!("from:        {origin} ({src})");
    }
    println!("{result}\n");
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn crc32c_matches_the_standard_check_value() {
        assert_eq!(super::crc32c(b"123456789"), 0xe306_9283);
    }
}
