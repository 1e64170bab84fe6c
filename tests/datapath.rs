//! Packet-in/packet-out tests of the tc programs with BPF_PROG_TEST_RUN: the real programs, the
//! real maps (private, unpinned), programmed by the real reconciler. Needs root.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    sync::LazyLock,
    thread,
    time::Duration,
};

use aya::{
    maps::{Array, HashMap, IterableMap as _, Map, MapData, PerCpuArray},
    programs::{SchedClassifier, TestRun, TestRunOptions, Xdp},
};
use etherparse::{
    Icmpv4Type, Icmpv6Type, LinkHeader, NetHeaders, PacketBuilder, PacketHeaders, TransportHeader,
    icmpv4::DestUnreachableHeader, icmpv6::DestUnreachableCode,
};
use lb::{
    conntrack::{CtTimeouts, monotonic_secs},
    controller::reconcile::Reconciler,
    datapath::load::{Datapath, LoadOptions},
    datapath::maps::BpfMaps,
    model::{Backend, DesiredState, Frontend, L4Addr, Proto, Scope, ServiceEntry, ServicePortName},
    node_facts::{NodeFacts, NodeFactsArgs},
};
use lb_common::{
    Ct4Key, Ct4Value, Ct6Key, Ct6Value, LbConfig, MetricValue, Svc4Key, SvcValue, TraceRecord,
    ct_dir, ct_flags, map_names, metrics, prog_names, scope, svc_flags, trace_affinity, trace_ct,
    trace_frag, trace_verdict,
};

const TC_ACT_OK: u32 = 0;
const TC_ACT_SHOT: u32 = 2;
const TC_ACT_REDIRECT: u32 = 7;

const CLIENT4: Ipv4Addr = Ipv4Addr::new(198, 18, 10, 2);
const VIP4: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 10);
const EMPTY_VIP4: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 11);
const BACKENDS4: [Ipv4Addr; 3] = [
    Ipv4Addr::new(198, 18, 11, 2),
    Ipv4Addr::new(198, 18, 12, 2),
    Ipv4Addr::new(198, 18, 13, 2),
];
const CLIENT6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 0x10, 0, 0, 0, 2);
const VIP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0xffff, 0, 0, 0, 0, 0x10);
const EMPTY_VIP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0xffff, 0, 0, 0, 0, 0x11);
const BACKENDS6: [Ipv6Addr; 3] = [
    Ipv6Addr::new(0x2001, 0xdb8, 0, 0x11, 0, 0, 0, 2),
    Ipv6Addr::new(0x2001, 0xdb8, 0, 0x12, 0, 0, 0, 2),
    Ipv6Addr::new(0x2001, 0xdb8, 0, 0x13, 0, 0, 0, 2),
];
const VPORT: u16 = 80;
const BPORT: u16 = 8080;
/// An SCTP service whose backends listen on its own port (Diameter's): no port rewrite.
const SAME_PORT: u16 = 3868;

/// A conntrack value of either family (`Ct4Value`, `Ct6Value`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Ct {
    backend_id: u32,
    rev_nat_id: u32,
    expires: u32,
    flags: u16,
    nat_port: u16,
    nat_addr: IpAddr,
}

struct Fixture {
    datapath: Datapath,
    _reconciler: Reconciler<BpfMaps>,
    /// What the reconciler was given, for tests that add to it.
    desired: DesiredState,
}

fn service(vip: IpAddr, proto: Proto, backends: &[IpAddr]) -> (Frontend, ServiceEntry) {
    service_ports(vip, VPORT, proto, backends, BPORT)
}

fn service_ports(
    vip: IpAddr,
    vport: u16,
    proto: Proto,
    backends: &[IpAddr],
    bport: u16,
) -> (Frontend, ServiceEntry) {
    (
        Frontend::new(vip, vport, proto),
        ServiceEntry {
            name: ServicePortName {
                namespace: "test".into(),
                name: "echo".into(),
                port_name: proto.to_string().to_lowercase(),
            },
            flags: svc_flags::CLUSTER_IP,
            backends: backends
                .iter()
                .map(|a| {
                    Backend::active(L4Addr {
                        addr: *a,
                        port: bport,
                        proto,
                    })
                })
                .collect(),
            ..ServiceEntry::default()
        },
    )
}

/// Private maps holding VIP4 and VIP6 for TCP, UDP and SCTP (VPORT → BPORT) and SCTP SAME_PORT
/// (no port rewrite) with three backends each, and EMPTY_VIP4 and EMPTY_VIP6 for TCP and UDP
/// without backends (all ClusterIPs).
fn fixture() -> Fixture {
    fixture_with(&LoadOptions::default())
}

/// `fixture()` with the tc programs writing their decision into `lb_trace`.
fn traced_fixture() -> Fixture {
    fixture_with(&LoadOptions {
        trace: true,
        ..LoadOptions::default()
    })
}

fn fixture_with(opts: &LoadOptions) -> Fixture {
    let mut datapath = Datapath::load(opts).expect("load datapath (root?)");
    let maps = datapath.take_lb_maps().expect("maps");
    let mut reconciler = Reconciler::new(maps).expect("reconciler");
    let b4: Vec<IpAddr> = BACKENDS4.iter().map(|a| (*a).into()).collect();
    let b6: Vec<IpAddr> = BACKENDS6.iter().map(|a| (*a).into()).collect();
    let mut desired = DesiredState::default();
    for (fe, entry) in [
        service(VIP4.into(), Proto::Tcp, &b4),
        service(VIP4.into(), Proto::Udp, &b4),
        service(VIP6.into(), Proto::Tcp, &b6),
        service(VIP6.into(), Proto::Udp, &b6),
        service(VIP4.into(), Proto::Sctp, &b4),
        service(VIP6.into(), Proto::Sctp, &b6),
        service_ports(VIP4.into(), SAME_PORT, Proto::Sctp, &b4, SAME_PORT),
        service_ports(VIP6.into(), SAME_PORT, Proto::Sctp, &b6, SAME_PORT),
        service(EMPTY_VIP4.into(), Proto::Tcp, &[]),
        service(EMPTY_VIP4.into(), Proto::Udp, &[]),
        service(EMPTY_VIP6.into(), Proto::Tcp, &[]),
        service(EMPTY_VIP6.into(), Proto::Udp, &[]),
    ] {
        desired.services.insert(fe, entry);
    }
    let report = reconciler.apply(&desired);
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    Fixture {
        datapath,
        _reconciler: reconciler,
        desired,
    }
}

impl Fixture {
    fn run(&mut self, prog: &str, pkt: &[u8]) -> (u32, Vec<u8>) {
        self.try_run(prog, pkt).expect("BPF_PROG_TEST_RUN")
    }

    fn try_run(
        &mut self,
        prog: &str,
        pkt: &[u8],
    ) -> Result<(u32, Vec<u8>), aya::programs::ProgramError> {
        let program: &mut SchedClassifier = self
            .datapath
            .ebpf_mut()
            .program_mut(prog)
            .expect("program")
            .try_into()
            .expect("classifier");
        let mut out = vec![0u8; pkt.len() + 256];
        let mut opts = TestRunOptions::new();
        opts.data_in = Some(pkt);
        opts.data_out = Some(&mut out);
        let result = program.test_run(opts)?;
        out.truncate(result.data_size_out as usize);
        Ok((result.return_value, out))
    }

    fn ingress(&mut self, pkt: &[u8]) -> (u32, Vec<u8>) {
        self.run(prog_names::TC_INGRESS, pkt)
    }

    /// `pkt` through `lb_xdp`: its verdict and the frame it leaves.
    fn xdp(&mut self, pkt: &[u8]) -> (u32, Vec<u8>) {
        let program: &mut Xdp = self
            .datapath
            .ebpf_mut()
            .program_mut(prog_names::XDP)
            .expect("program")
            .try_into()
            .expect("xdp");
        let mut out = vec![0u8; pkt.len() + 256];
        let mut opts = TestRunOptions::new();
        opts.data_in = Some(pkt);
        opts.data_out = Some(&mut out);
        let result = program.test_run(opts).expect("BPF_PROG_TEST_RUN");
        out.truncate(result.data_size_out as usize);
        (result.return_value, out)
    }

    /// `pkt` through the external hook `hook` stands for.
    fn external(&mut self, hook: Ext, pkt: &[u8]) -> (u32, Vec<u8>) {
        match hook {
            Ext::Tc => self.ingress(pkt),
            Ext::Xdp => self.xdp(pkt),
        }
    }

    /// `lb4_ct_tcp`.
    fn ct4(&mut self) -> HashMap<&mut MapData, Ct4Key, Ct4Value> {
        self.ct4_of(6)
    }

    /// The IPv4 conntrack map of `proto`: `lb4_ct_tcp` or `lb4_ct_any`.
    fn ct4_of(&mut self, proto: u8) -> HashMap<&mut MapData, Ct4Key, Ct4Value> {
        let name = if proto == 6 {
            map_names::CT_TCP4
        } else {
            map_names::CT_ANY4
        };
        HashMap::try_from(self.datapath.ebpf_mut().map_mut(name).expect(name)).expect("ct map")
    }

    /// The IPv6 conntrack map of `proto`.
    fn ct6_of(&mut self, proto: u8) -> HashMap<&mut MapData, Ct6Key, Ct6Value> {
        let name = if proto == 6 {
            map_names::CT_TCP6
        } else {
            map_names::CT_ANY6
        };
        HashMap::try_from(self.datapath.ebpf_mut().map_mut(name).expect(name)).expect("ct map")
    }

    /// The conntrack entry of `saddr:sport -> daddr:dport` (`proto`) in direction `dir`.
    fn ct_entry(
        &mut self,
        saddr: IpAddr,
        sport: u16,
        daddr: IpAddr,
        dport: u16,
        proto: u8,
        dir: u8,
    ) -> Option<Ct> {
        match (saddr, daddr) {
            (IpAddr::V4(s), IpAddr::V4(d)) => {
                let key = Ct4Key {
                    saddr: s.octets(),
                    daddr: d.octets(),
                    sport,
                    dport,
                    proto,
                    dir,
                    pad: [0; 2],
                };
                self.ct4_of(proto).get(&key, 0).ok().map(|v| Ct {
                    backend_id: v.backend_id,
                    rev_nat_id: v.rev_nat_id,
                    expires: v.expires,
                    flags: v.flags,
                    nat_port: v.nat_port,
                    nat_addr: Ipv4Addr::from(v.nat_addr).into(),
                })
            }
            (IpAddr::V6(s), IpAddr::V6(d)) => {
                let key = Ct6Key {
                    saddr: s.octets(),
                    daddr: d.octets(),
                    sport,
                    dport,
                    proto,
                    dir,
                    pad: [0; 2],
                };
                self.ct6_of(proto).get(&key, 0).ok().map(|v| Ct {
                    backend_id: v.backend_id,
                    rev_nat_id: v.rev_nat_id,
                    expires: v.expires,
                    flags: v.flags,
                    nat_port: v.nat_port,
                    nat_addr: Ipv6Addr::from(v.nat_addr).into(),
                })
            }
            _ => panic!("mixed families"),
        }
    }

    /// The decision the last tc run wrote (all zero unless loaded with `trace`).
    fn trace_record(&mut self) -> TraceRecord {
        let map = self
            .datapath
            .ebpf_mut()
            .map(map_names::TRACE)
            .expect("lb_trace");
        Array::<_, TraceRecord>::try_from(map)
            .expect("lb_trace is an array")
            .get(&0, 0)
            .expect("lb_trace[0]")
    }

    /// Packets counted under `index`, summed over CPUs.
    fn counter(&mut self, index: u32) -> u64 {
        let map = self
            .datapath
            .ebpf_mut()
            .map(map_names::METRICS)
            .expect("lb_metrics");
        PerCpuArray::<_, MetricValue>::try_from(map)
            .expect("lb_metrics is a per-CPU array")
            .get(&index, 0)
            .expect("counter")
            .iter()
            .map(|v| v.packets)
            .sum()
    }

    /// A second, writable handle on the reconciler's `lb4_services` map, to break its state.
    fn services4(&self) -> HashMap<MapData, Svc4Key, SvcValue> {
        let id = self._reconciler.maps().services4.map().info().unwrap().id();
        HashMap::try_from(Map::HashMap(MapData::from_id(id).unwrap())).unwrap()
    }
}

/// Key of VIP4's TCP frontend (external scope) at `slot`.
fn vip4_tcp(slot: u16) -> Svc4Key {
    Svc4Key {
        addr: VIP4.octets(),
        port: VPORT,
        slot,
        proto: 6,
        scope: scope::EXTERNAL,
        pad: [0; 2],
    }
}

// ---------------------------------------------------------------------------------------------
// Packet building and independent verification (full recomputation, not incremental).

const MAC_A: [u8; 6] = [0x02, 0, 0, 0, 0, 1];
const MAC_B: [u8; 6] = [0x02, 0, 0, 0, 0, 2];
const PAYLOAD: &[u8] = b"hello lb\n";

#[derive(Clone, Copy, Debug)]
enum L4 {
    TcpSyn,
    TcpAck,
    TcpFin,
    TcpRst,
    Udp,
}

fn packet(src: IpAddr, sport: u16, dst: IpAddr, dport: u16, l4: L4) -> Vec<u8> {
    packet_with(src, sport, dst, dport, l4, PAYLOAD)
}

fn packet_with(
    src: IpAddr,
    sport: u16,
    dst: IpAddr,
    dport: u16,
    l4: L4,
    payload: &[u8],
) -> Vec<u8> {
    let eth = PacketBuilder::ethernet2(MAC_A, MAC_B);
    let mut buf = Vec::new();
    macro_rules! finish {
        ($ip:expr) => {
            match l4 {
                L4::TcpSyn => $ip
                    .tcp(sport, dport, 1000, 64240)
                    .syn()
                    .write(&mut buf, payload),
                L4::TcpAck => $ip
                    .tcp(sport, dport, 1001, 64240)
                    .ack(77)
                    .write(&mut buf, payload),
                L4::TcpFin => $ip
                    .tcp(sport, dport, 1001, 64240)
                    .ack(77)
                    .fin()
                    .write(&mut buf, payload),
                L4::TcpRst => $ip
                    .tcp(sport, dport, 1001, 64240)
                    .rst()
                    .write(&mut buf, &[]),
                L4::Udp => $ip.udp(sport, dport).write(&mut buf, payload),
            }
        };
    }
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => finish!(eth.ipv4(s.octets(), d.octets(), 64)),
        (IpAddr::V6(s), IpAddr::V6(d)) => finish!(eth.ipv6(s.octets(), d.octets(), 64)),
        _ => panic!("mixed families"),
    }
    .expect("build packet");
    buf
}

fn ones_sum(data: &[u8]) -> u32 {
    let mut sum = 0u32;
    for chunk in data.chunks(2) {
        let word = if chunk.len() == 2 {
            u16::from_be_bytes([chunk[0], chunk[1]])
        } else {
            u16::from_be_bytes([chunk[0], 0])
        };
        sum += u32::from(word);
    }
    sum
}

fn fold(mut sum: u32) -> u16 {
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    sum as u16
}

/// What a test needs from a parsed packet; checksums are verified while parsing.
#[derive(Debug, PartialEq, Eq)]
struct Parsed {
    src: IpAddr,
    sport: u16,
    dst: IpAddr,
    dport: u16,
    proto: u8,
    l4_csum: u16,
}

fn parse_and_verify(pkt: &[u8]) -> Parsed {
    let ethertype = u16::from_be_bytes([pkt[12], pkt[13]]);
    let (src, dst, proto, l4, pseudo): (IpAddr, IpAddr, u8, &[u8], u32) = match ethertype {
        0x0800 => {
            let ip = &pkt[14..];
            let ihl = usize::from(ip[0] & 0xf) * 4;
            assert_eq!(fold(ones_sum(&ip[..ihl])), 0xffff, "IPv4 header checksum");
            let tot = usize::from(u16::from_be_bytes([ip[2], ip[3]]));
            let l4 = &ip[ihl..tot];
            let pseudo = ones_sum(&ip[12..20]) + u32::from(ip[9]) + l4.len() as u32;
            let s: [u8; 4] = ip[12..16].try_into().unwrap();
            let d: [u8; 4] = ip[16..20].try_into().unwrap();
            (s.into(), d.into(), ip[9], l4, pseudo)
        }
        0x86dd => {
            let ip = &pkt[14..];
            let plen = usize::from(u16::from_be_bytes([ip[4], ip[5]]));
            let l4 = &ip[40..40 + plen];
            let pseudo = ones_sum(&ip[8..40]) + u32::from(ip[6]) + l4.len() as u32;
            let s: [u8; 16] = ip[8..24].try_into().unwrap();
            let d: [u8; 16] = ip[24..40].try_into().unwrap();
            (s.into(), d.into(), ip[6], l4, pseudo)
        }
        other => panic!("unexpected ethertype {other:#x}"),
    };
    // TCP, ICMP/ICMPv6 (a reject's reply), else UDP/SCTP's offset.
    let csum_off = match proto {
        6 => 16,
        1 | 58 => 2,
        _ => 6,
    };
    let l4_csum = u16::from_be_bytes([l4[csum_off], l4[csum_off + 1]]);
    // ICMPv4's checksum covers no pseudo-header.
    let pseudo = if proto == 1 { 0 } else { pseudo };
    if !(proto == 17 && l4_csum == 0 && src.is_ipv4()) {
        assert_eq!(
            fold(pseudo + ones_sum(l4)),
            0xffff,
            "L4 checksum of {src}->{dst}"
        );
    }
    Parsed {
        src,
        sport: u16::from_be_bytes([l4[0], l4[1]]),
        dst,
        dport: u16::from_be_bytes([l4[2], l4[3]]),
        proto,
        l4_csum,
    }
}

fn backends_of(vip: IpAddr) -> Vec<IpAddr> {
    match vip {
        IpAddr::V4(_) => BACKENDS4.iter().map(|a| (*a).into()).collect(),
        IpAddr::V6(_) => BACKENDS6.iter().map(|a| (*a).into()).collect(),
    }
}

// ---------------------------------------------------------------------------------------------

/// The programs of an external device: tc ingress, or XDP (which runs the same pipeline).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ext {
    Tc,
    Xdp,
}

impl Ext {
    /// The verdict that hands a packet on to the stack.
    fn pass(self) -> u32 {
        match self {
            Ext::Tc => TC_ACT_OK,
            Ext::Xdp => XDP_PASS,
        }
    }
}

const XDP_PASS: u32 = 2;
const XDP_DROP: u32 = 1;

/// New flows are DNATed to a backend with valid checksums; further packets of the flow stay on
/// it; the backend's reply is reverse-NATed to come from the VIP; new flows reach every backend.
fn forward_and_reply(client: IpAddr, vip: IpAddr, first: L4, then: L4) {
    forward_and_reply_on(Ext::Tc, client, vip, first, then);
}

/// `forward_and_reply` through the external hook `hook`.
fn forward_and_reply_on(hook: Ext, client: IpAddr, vip: IpAddr, first: L4, then: L4) {
    let mut fx = fixture();
    let backends = backends_of(vip);
    let mut seen = BTreeSet::new();
    for sport in 40_000..40_060u16 {
        let syn = packet(client, sport, vip, VPORT, first);
        let (verdict, out) = fx.external(hook, &syn);
        assert_eq!(verdict, hook.pass());
        assert_eq!(out.len(), syn.len());
        let p = parse_and_verify(&out);
        assert_eq!((p.src, p.sport), (client, sport), "source untouched");
        assert!(
            backends.contains(&p.dst),
            "DNAT to a backend, got {}",
            p.dst
        );
        assert_eq!(p.dport, BPORT);
        seen.insert(p.dst);

        for _ in 0..3 {
            let (verdict, again) = fx.external(hook, &packet(client, sport, vip, VPORT, then));
            assert_eq!(verdict, hook.pass());
            let q = parse_and_verify(&again);
            assert_eq!((q.dst, q.dport), (p.dst, BPORT), "flow keeps its backend");
        }

        let reply = packet(p.dst, BPORT, client, sport, then);
        let (verdict, out) = fx.external(hook, &reply);
        assert_eq!(verdict, hook.pass());
        let r = parse_and_verify(&out);
        assert_eq!((r.src, r.sport), (vip, VPORT), "reply comes from the VIP");
        assert_eq!(
            (r.dst, r.dport),
            (client, sport),
            "reply destination untouched"
        );
    }
    assert_eq!(
        seen.len(),
        3,
        "60 new flows reach all 3 backends, got {seen:?}"
    );
}

#[test]
fn ipv4_tcp_forward_established_and_reverse_nat() {
    forward_and_reply(CLIENT4.into(), VIP4.into(), L4::TcpSyn, L4::TcpAck);
}

/// XDP rewrites with its own checksum code (no skb helpers): every case tc passes, it passes
/// too, checked by full recomputation.
#[test]
fn xdp_forwards_and_reverse_nats_with_valid_checksums() {
    for (client, vip) in [
        (IpAddr::from(CLIENT4), IpAddr::from(VIP4)),
        (CLIENT6.into(), VIP6.into()),
    ] {
        forward_and_reply_on(Ext::Xdp, client, vip, L4::TcpSyn, L4::TcpAck);
        forward_and_reply_on(Ext::Xdp, client, vip, L4::Udp, L4::Udp);
    }
}

/// XDP never changes what is not a service packet it fully parsed: other destinations, other
/// protocols, truncated and non-IP frames leave byte for byte as they came, with XDP_PASS.
#[test]
fn xdp_passes_everything_else_untouched() {
    let mut fx = fixture();
    let mut frames = vec![
        packet(
            CLIENT4.into(),
            40_000,
            Ipv4Addr::new(198, 18, 77, 7).into(),
            VPORT,
            L4::TcpSyn,
        ),
        packet(
            CLIENT6.into(),
            40_000,
            "2001:db8:77::7".parse().unwrap(),
            VPORT,
            L4::Udp,
        ),
        packet(CLIENT4.into(), 40_000, VIP4.into(), VPORT + 1, L4::Udp),
    ];
    let full = packet(CLIENT4.into(), 40_000, VIP4.into(), VPORT, L4::TcpSyn);
    // BPF_PROG_TEST_RUN refuses XDP frames shorter than an Ethernet header.
    for cut in [14, 20, 33, 40] {
        frames.push(full[..cut].to_vec());
    }
    let mut arp = full.clone();
    arp[12..14].copy_from_slice(&0x0806u16.to_be_bytes());
    frames.push(arp);
    for f in &frames {
        let (verdict, out) = fx.xdp(f);
        assert_eq!(verdict, XDP_PASS, "{f:02x?}");
        assert_eq!(&out, f, "untouched");
    }
}

/// kube-proxy's DROPs on the external path, in XDP and tc alike: a LoadBalancer IP's
/// `loadBalancerSourceRanges` (other sources dropped, sources inside served), and an eTP=Local
/// NodePort whose endpoints are all on other nodes (dropped, not rejected).
#[test]
fn source_ranges_and_no_local_endpoint_drop_on_xdp_and_tc() {
    let mut fx = fixture();
    let lb_ip = IpAddr::from(Ipv4Addr::new(198, 19, 1, 42));
    let node_ip = IpAddr::from(Ipv4Addr::new(198, 18, 10, 1));
    let b4: Vec<IpAddr> = BACKENDS4.iter().map(|a| (*a).into()).collect();
    let (fe, mut ranged) = service(lb_ip, Proto::Tcp, &b4);
    ranged.flags = svc_flags::LOAD_BALANCER | svc_flags::SOURCE_RANGES;
    ranged.source_ranges = ["198.18.99.0/24", "198.19.1.42/32"]
        .iter()
        .map(|c| c.parse().unwrap())
        .collect();
    let (np, mut elsewhere) = service_ports(node_ip, 30_080, Proto::Tcp, &[], BPORT);
    elsewhere.flags =
        svc_flags::NODE_PORT | svc_flags::EXT_LOCAL | svc_flags::EMPTY_DROP | svc_flags::LOCAL_ADDR;
    let mut desired = fx.desired.clone();
    desired.services.insert(fe, ranged);
    desired.services.insert(np, elsewhere);
    let report = fx._reconciler.apply(&desired);
    assert!(report.errors.is_empty(), "{:?}", report.errors);

    for hook in [Ext::Xdp, Ext::Tc] {
        let drop = match hook {
            Ext::Xdp => XDP_DROP,
            Ext::Tc => TC_ACT_SHOT,
        };
        let before = fx.counter(metrics::TC_DROP_SOURCE_RANGE);
        let syn = packet(CLIENT4.into(), 41_000, lb_ip, VPORT, L4::TcpSyn);
        assert_eq!(
            fx.external(hook, &syn).0,
            drop,
            "{hook:?}: outside the ranges"
        );
        assert_eq!(fx.counter(metrics::TC_DROP_SOURCE_RANGE), before + 1);
        let inside = IpAddr::from(Ipv4Addr::new(198, 18, 99, 5));
        let (verdict, out) = fx.external(hook, &packet(inside, 41_000, lb_ip, VPORT, L4::TcpSyn));
        assert_eq!(verdict, hook.pass(), "{hook:?}: inside the ranges");
        assert!(b4.contains(&parse_and_verify(&out).dst), "{hook:?}: DNAT");

        let before = fx.counter(metrics::TC_DROP_NO_LOCAL_BACKEND);
        let syn = packet(CLIENT4.into(), 41_001, node_ip, 30_080, L4::TcpSyn);
        assert_eq!(
            fx.external(hook, &syn).0,
            drop,
            "{hook:?}: no local endpoint"
        );
        assert_eq!(fx.counter(metrics::TC_DROP_NO_LOCAL_BACKEND), before + 1);
    }
}

/// kube-proxy's DROP for `internalTrafficPolicy: Local` with endpoints only on other nodes,
/// from manifests through the translator into the maps: in-cluster traffic to the ClusterIP
/// (the pod hook) is dropped, counted `tc_drop_no_local_backend`; a service with no endpoints
/// at all is still rejected. IPv4 and IPv6, TCP and UDP.
#[test]
fn internal_local_with_endpoints_elsewhere_drops_and_without_endpoints_rejects() {
    use lb::controller::{
        manifests::{self, Objects},
        translate::{NodeInfo, desired_state},
    };
    let yaml = r#"
apiVersion: v1
kind: Service
metadata: {name: elsewhere, namespace: t}
spec:
  ipFamilyPolicy: PreferDualStack
  clusterIP: 198.19.4.3
  clusterIPs: [198.19.4.3, "2001:db8:ffff::4:3"]
  internalTrafficPolicy: Local
  ports: [{name: t, protocol: TCP, port: 80}, {name: u, protocol: UDP, port: 80}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: elsewhere-4, namespace: t, labels: {kubernetes.io/service-name: elsewhere}}
addressType: IPv4
ports: [{name: t, protocol: TCP, port: 8080}, {name: u, protocol: UDP, port: 8080}]
endpoints: [{addresses: [198.18.8.21], nodeName: node-b}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: elsewhere-6, namespace: t, labels: {kubernetes.io/service-name: elsewhere}}
addressType: IPv6
ports: [{name: t, protocol: TCP, port: 8080}, {name: u, protocol: UDP, port: 8080}]
endpoints: [{addresses: ["2001:db8:8::21"], nodeName: node-b}]
---
apiVersion: v1
kind: Service
metadata: {name: none, namespace: t}
spec:
  ipFamilyPolicy: PreferDualStack
  clusterIP: 198.19.4.4
  clusterIPs: [198.19.4.4, "2001:db8:ffff::4:4"]
  internalTrafficPolicy: Local
  ports: [{name: t, protocol: TCP, port: 80}, {name: u, protocol: UDP, port: 80}]
"#;
    let mut objects = Objects::default();
    let mut problems = Vec::new();
    manifests::parse_into(
        std::path::Path::new("itp.yaml"),
        yaml,
        &mut objects,
        &mut problems,
    );
    assert!(problems.is_empty(), "{problems:?}");
    let t = desired_state(
        &objects.services,
        &objects.slices,
        &NodeInfo::from_node("node-a", None),
    );
    let mut fx = fixture();
    let report = fx._reconciler.apply(&t.state);
    assert!(report.errors.is_empty(), "{:?}", report.errors);

    for (client, elsewhere, none) in [
        (
            IpAddr::from(CLIENT4),
            IpAddr::from(Ipv4Addr::new(198, 19, 4, 3)),
            IpAddr::from(Ipv4Addr::new(198, 19, 4, 4)),
        ),
        (
            CLIENT6.into(),
            "2001:db8:ffff::4:3".parse().unwrap(),
            "2001:db8:ffff::4:4".parse().unwrap(),
        ),
    ] {
        for l4 in [L4::TcpSyn, L4::Udp] {
            let before = fx.counter(metrics::TC_DROP_NO_LOCAL_BACKEND);
            let pkt = packet(client, 42_000, elsewhere, VPORT, l4);
            let (verdict, _) = fx.run(prog_names::TC_POD, &pkt);
            assert_eq!(verdict, TC_ACT_SHOT, "{elsewhere}: dropped");
            assert_eq!(fx.counter(metrics::TC_DROP_NO_LOCAL_BACKEND), before + 1);

            let before = fx.counter(metrics::TC_REJECT_NO_BACKEND);
            let pkt = packet(client, 42_000, none, VPORT, l4);
            let (verdict, reply) = fx.run(prog_names::TC_POD, &pkt);
            assert_eq!(verdict, TC_ACT_REDIRECT, "{none}: rejected");
            let r = parse_and_verify(&reply);
            assert_eq!((r.src, r.dst), (none, client), "{none}: the reply");
            let reply_proto = match (l4, client) {
                (L4::TcpSyn, _) => 6,
                (_, IpAddr::V4(_)) => 1,
                (_, IpAddr::V6(_)) => 58,
            };
            assert_eq!(r.proto, reply_proto, "{none}: RST or port unreachable");
            assert_eq!(fx.counter(metrics::TC_REJECT_NO_BACKEND), before + 1);
        }
    }
}

/// XDP builds no replies: a packet kube-proxy would REJECT leaves XDP untouched, counted as
/// handed to tc, and tc ingress on the same device answers it.
#[test]
fn xdp_leaves_rejects_to_tc_ingress() {
    let mut fx = fixture();
    for (client, vip) in [
        (IpAddr::from(CLIENT4), IpAddr::from(EMPTY_VIP4)),
        (CLIENT6.into(), EMPTY_VIP6.into()),
    ] {
        let before = fx.counter(metrics::XDP_PASS_TO_TC);
        let syn = packet(client, 40_000, vip, VPORT, L4::TcpSyn);
        let (verdict, out) = fx.xdp(&syn);
        assert_eq!((verdict, &out), (XDP_PASS, &syn), "{vip}: untouched for tc");
        assert_eq!(fx.counter(metrics::XDP_PASS_TO_TC), before + 1);
        let (verdict, rst) = fx.ingress(&out);
        assert_eq!(verdict, TC_ACT_REDIRECT, "{vip}: tc rejects it");
        let r = parse_and_verify(&rst);
        assert_eq!((r.src, r.dst, r.proto), (vip, client, 6), "{vip}: the RST");
    }
}

#[test]
fn ipv4_udp_forward_established_and_reverse_nat() {
    forward_and_reply(CLIENT4.into(), VIP4.into(), L4::Udp, L4::Udp);
}

#[test]
fn ipv6_tcp_forward_established_and_reverse_nat() {
    forward_and_reply(CLIENT6.into(), VIP6.into(), L4::TcpSyn, L4::TcpAck);
}

#[test]
fn ipv6_udp_forward_established_and_reverse_nat() {
    forward_and_reply(CLIENT6.into(), VIP6.into(), L4::Udp, L4::Udp);
}

#[test]
fn ipv4_udp_without_checksum_keeps_it_zero() {
    let mut fx = fixture();
    let mut pkt = packet(CLIENT4.into(), 5353, VIP4.into(), VPORT, L4::Udp);
    // UDP checksum at eth 14 + ip 20 + 6.
    pkt[40] = 0;
    pkt[41] = 0;
    let (verdict, out) = fx.ingress(&pkt);
    assert_eq!(verdict, TC_ACT_OK);
    let p = parse_and_verify(&out);
    assert!(backends_of(VIP4.into()).contains(&p.dst));
    assert_eq!(
        p.l4_csum, 0,
        "a zero UDP checksum means none and must stay zero"
    );
}

#[test]
fn unknown_destination_is_untouched() {
    let mut fx = fixture();
    for pkt in [
        packet(
            CLIENT4.into(),
            1234,
            Ipv4Addr::new(198, 19, 9, 9).into(),
            VPORT,
            L4::TcpSyn,
        ),
        packet(CLIENT6.into(), 1234, BACKENDS6[0].into(), BPORT, L4::Udp),
        packet(
            CLIENT6.into(),
            1234,
            Ipv6Addr::new(0x2001, 0xdb8, 0xffff, 0, 0, 0, 9, 9).into(),
            VPORT,
            L4::TcpSyn,
        ),
    ] {
        let (verdict, out) = fx.ingress(&pkt);
        assert_eq!(verdict, TC_ACT_OK);
        assert_eq!(out, pkt, "not a service: byte for byte unchanged");
    }
}

#[test]
fn service_without_backends_rejects() {
    // Was a DROP before lb answered like kube-proxy's REJECT.
    let mut fx = fixture();
    let pkt = packet(CLIENT4.into(), 1234, EMPTY_VIP4.into(), VPORT, L4::TcpSyn);
    let (verdict, out) = fx.ingress(&pkt);
    assert_eq!(verdict, TC_ACT_REDIRECT);
    assert!(matches!(parse_reply(&out).kind, ReplyKind::Rst { .. }));
}

#[test]
fn unparsable_packets_pass_untouched() {
    let mut fx = fixture();
    let good4 = packet(CLIENT4.into(), 1234, VIP4.into(), VPORT, L4::TcpSyn);
    let good6 = packet(CLIENT6.into(), 1234, VIP6.into(), VPORT, L4::TcpSyn);
    let mut cases: Vec<(&str, Vec<u8>)> = Vec::new();
    // Truncated L4 headers. (BPF_PROG_TEST_RUN itself refuses skbs whose IP header is cut.)
    cases.push(("tcp header cut", good4[..14 + 20 + 10].to_vec()));
    cases.push(("ipv6 tcp header cut", good6[..14 + 40 + 12].to_vec()));
    // IPv4 options claimed to run past the end of the packet.
    let mut long_ihl = good4[..14 + 20 + 12].to_vec();
    long_ihl[14] = 0x4f;
    cases.push(("ipv4 ihl beyond packet", long_ihl));
    // A later IPv4 fragment whose first fragment was never seen: no ports to match by.
    let mut frag = good4.clone();
    frag[14 + 6] = 0x00;
    frag[14 + 7] = 0xb9;
    cases.push(("ipv4 later fragment, first unseen", frag));
    // IPv4 with a bad version nibble.
    let mut badver = good4.clone();
    badver[14] = 0x55;
    cases.push(("ipv4 bad version", badver));
    // IPv4 header length below 20 bytes.
    let mut badihl = good4.clone();
    badihl[14] = 0x44;
    cases.push(("ipv4 ihl 4", badihl));
    // IPv4 total length shorter than the header.
    let mut badlen = good4.clone();
    badlen[14 + 2] = 0;
    badlen[14 + 3] = 10;
    cases.push(("ipv4 total length < ihl", badlen));
    // TCP data offset below 5.
    let mut baddoff = good4.clone();
    baddoff[14 + 20 + 12] = 0x40;
    cases.push(("tcp doff 4", baddoff));
    // IPv6 claiming a hop-by-hop extension header that runs past the end of the packet.
    let mut ext = good6.clone();
    ext[14 + 6] = 0;
    cases.push(("ipv6 extension header beyond packet", ext));
    // ICMP to the VIP.
    let mut icmp = good4.clone();
    icmp[14 + 9] = 1;
    cases.push(("icmp", icmp));
    // ARP and random garbage.
    let mut arp = good4.clone();
    arp[12] = 0x08;
    arp[13] = 0x06;
    cases.push(("arp", arp));
    cases.push(("garbage", (0..60u8).map(|i| i.wrapping_mul(37)).collect()));
    // 802.1Q-tagged frames are not parsed (yet).
    let mut vlan = good4.clone();
    vlan[12] = 0x81;
    vlan[13] = 0x00;
    cases.push(("vlan", vlan));

    for (what, pkt) in cases {
        let (verdict, out) = fx
            .try_run(prog_names::TC_INGRESS, &pkt)
            .unwrap_or_else(|e| panic!("{what}: {e:?}"));
        assert_eq!(verdict, TC_ACT_OK, "{what}");
        assert_eq!(out, pkt, "{what}: passed untouched");
    }
}

#[test]
fn egress_only_reverse_nats() {
    let mut fx = fixture();
    // Egress never DNATs a packet to the VIP...
    let to_vip = packet(CLIENT4.into(), 2000, VIP4.into(), VPORT, L4::TcpSyn);
    let (verdict, out) = fx.run(prog_names::TC_EGRESS, &to_vip);
    assert_eq!(verdict, TC_ACT_OK);
    assert_eq!(out, to_vip);
    // ...but rewrites a backend's reply once ingress created the flow.
    let (_, fwd) = fx.ingress(&to_vip);
    let backend = parse_and_verify(&fwd).dst;
    let reply = packet(backend, BPORT, CLIENT4.into(), 2000, L4::TcpAck);
    let (verdict, out) = fx.run(prog_names::TC_EGRESS, &reply);
    assert_eq!(verdict, TC_ACT_OK);
    let r = parse_and_verify(&out);
    assert_eq!((r.src, r.sport), (VIP4.into(), VPORT));
}

#[test]
fn conntrack_records_flow_and_tcp_state() {
    let mut fx = fixture();
    let (client, sport): (Ipv4Addr, u16) = (CLIENT4, 3333);
    let (_, fwd) = fx.ingress(&packet(
        client.into(),
        sport,
        VIP4.into(),
        VPORT,
        L4::TcpSyn,
    ));
    let IpAddr::V4(backend) = parse_and_verify(&fwd).dst else {
        panic!("v4")
    };
    let key = |saddr: Ipv4Addr, daddr: Ipv4Addr, sp, dp, dir| Ct4Key {
        saddr: saddr.octets(),
        daddr: daddr.octets(),
        sport: sp,
        dport: dp,
        proto: 6,
        dir,
        pad: [0; 2],
    };
    let svc_key = key(client, VIP4, sport, VPORT, ct_dir::SERVICE);
    let reply_key = key(backend, client, BPORT, sport, ct_dir::REPLY);
    let svc = fx.ct4().get(&svc_key, 0).expect("service entry");
    let reply = fx.ct4().get(&reply_key, 0).expect("reply entry");
    assert_eq!(svc.backend_id, reply.backend_id);
    assert_eq!(svc.rev_nat_id, reply.rev_nat_id);
    assert_eq!(svc.flags & ct_flags::SEEN_REPLY, 0);

    // The reply marks the flow as established on both entries.
    fx.ingress(&packet(
        backend.into(),
        BPORT,
        client.into(),
        sport,
        L4::TcpAck,
    ));
    let svc2 = fx.ct4().get(&svc_key, 0).unwrap();
    assert_ne!(svc2.flags & ct_flags::SEEN_REPLY, 0);
    assert!(
        svc2.expires > svc.expires,
        "established lifetime is longer than SYN's"
    );

    // A FIN from the client marks it closing.
    fx.ingress(&packet(
        client.into(),
        sport,
        VIP4.into(),
        VPORT,
        L4::TcpFin,
    ));
    let svc3 = fx.ct4().get(&svc_key, 0).unwrap();
    assert_ne!(svc3.flags & ct_flags::TX_CLOSING, 0);
    assert!(svc3.expires < svc2.expires, "closing shortens the lifetime");
}

#[test]
fn syn_after_close_is_balanced_again() {
    let mut fx = fixture();
    // The same client port reused for a new connection after FIN: each reuse may pick any
    // backend, so across many reuses more than one backend must show up.
    let mut seen = BTreeSet::new();
    for _ in 0..40 {
        let (_, out) = fx.ingress(&packet(
            CLIENT4.into(),
            4444,
            VIP4.into(),
            VPORT,
            L4::TcpSyn,
        ));
        seen.insert(parse_and_verify(&out).dst);
        fx.ingress(&packet(
            CLIENT4.into(),
            4444,
            VIP4.into(),
            VPORT,
            L4::TcpFin,
        ));
    }
    assert!(seen.len() > 1, "reused port always went to {seen:?}");
}

#[test]
fn removed_backend_gets_no_new_flows_and_its_connections_are_reset() {
    let mut fx = fixture();
    // Pin a flow, then remove its backend from the service.
    let (_, out) = fx.ingress(&packet(
        CLIENT4.into(),
        5555,
        VIP4.into(),
        VPORT,
        L4::TcpSyn,
    ));
    let pinned = parse_and_verify(&out).dst;
    let remaining: Vec<IpAddr> = backends_of(VIP4.into())
        .into_iter()
        .filter(|b| *b != pinned)
        .collect();
    let mut desired = DesiredState::default();
    let (fe, entry) = service(VIP4.into(), Proto::Tcp, &remaining);
    desired.services.insert(fe, entry);
    let report = fx._reconciler.apply(&desired);
    assert!(report.errors.is_empty());

    for sport in 50_000..50_050u16 {
        let (_, out) = fx.ingress(&packet(
            CLIENT4.into(),
            sport,
            VIP4.into(),
            VPORT,
            L4::TcpSyn,
        ));
        assert_ne!(
            parse_and_verify(&out).dst,
            pinned,
            "new flow to removed backend"
        );
    }
    // The backend is gone from the maps: its old connection is reset rather than sent into
    // the void or to a backend that never heard of it; the client's next connection on the
    // same 5-tuple goes to a remaining backend.
    let (verdict, out) = fx.ingress(&packet(
        CLIENT4.into(),
        5555,
        VIP4.into(),
        VPORT,
        L4::TcpAck,
    ));
    assert_eq!(verdict, TC_ACT_REDIRECT);
    assert!(matches!(parse_reply(&out).kind, ReplyKind::Rst { .. }));
    let (_, out) = fx.ingress(&packet(
        CLIENT4.into(),
        5555,
        VIP4.into(),
        VPORT,
        L4::TcpSyn,
    ));
    assert!(remaining.contains(&parse_and_verify(&out).dst));
}

#[test]
fn pod_hook_uses_internal_scope_of_two_scope_frontends() {
    // An externalIP with externalTrafficPolicy=Local: external traffic only to the local
    // backend, in-cluster traffic (lb_tc_pod, like socket LB) to all of them.
    let mut fx = fixture();
    let ext: IpAddr = Ipv4Addr::new(198, 18, 200, 1).into();
    let all: Vec<IpAddr> = BACKENDS4.iter().map(|a| (*a).into()).collect();
    let (mut fe, mut external) = service(ext, Proto::Tcp, &all[..1]);
    external.flags = svc_flags::EXTERNAL_IP | svc_flags::EXT_LOCAL | svc_flags::TWO_SCOPES;
    let mut internal = service(ext, Proto::Tcp, &all).1;
    internal.flags = external.flags;
    let mut desired = DesiredState::default();
    desired.services.insert(fe, external);
    fe.scope = Scope::Internal;
    desired.services.insert(fe, internal);
    let report = fx._reconciler.apply(&desired);
    assert!(report.errors.is_empty(), "{:?}", report.errors);

    let mut from_outside = BTreeSet::new();
    let mut from_pods = BTreeSet::new();
    // Distinct source ports per hook: one 5-tuple would be one conntrack flow.
    for sport in 20_000..20_060u16 {
        let outside = packet(CLIENT4.into(), sport, ext, VPORT, L4::TcpSyn);
        from_outside.insert(parse_and_verify(&fx.ingress(&outside).1).dst);
        let pod = packet(CLIENT4.into(), sport + 1000, ext, VPORT, L4::TcpSyn);
        from_pods.insert(parse_and_verify(&fx.run(prog_names::TC_POD, &pod).1).dst);
    }
    assert_eq!(
        from_outside,
        BTreeSet::from([all[0]]),
        "external scope: local backend only"
    );
    assert_eq!(
        from_pods.len(),
        3,
        "internal scope: every backend, got {from_pods:?}"
    );
}

#[test]
fn a_cold_apply_writes_in_batches_what_entry_by_entry_writes_hold() {
    // More service entries than one batch call takes (4096), in both families: the first apply
    // on empty kernel maps holds its writes and releases them in batches; the in-memory maps
    // take the same apply entry by entry.
    let mut desired = DesiredState::default();
    for i in 0..1500u32 {
        let [_, _, hi, lo] = i.to_be_bytes();
        let vip4: IpAddr = Ipv4Addr::new(198, 19, hi, lo).into();
        let vip6: IpAddr = Ipv6Addr::new(0x2001, 0xdb8, 0xffff, 0, 0, 0, 0, i as u16).into();
        let b4: Vec<IpAddr> = (0..3u8)
            .map(|k| Ipv4Addr::new(198, 18, hi.wrapping_add(k), lo).into())
            .collect();
        let b6: Vec<IpAddr> = (0..3u16)
            .map(|k| Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, k, i as u16).into())
            .collect();
        for (fe, entry) in [
            service(vip4, Proto::Tcp, &b4),
            service(vip6, Proto::Udp, &b6),
        ] {
            desired.services.insert(fe, entry);
        }
    }
    let opts = LoadOptions {
        max_entries: [("lb4_services", 1 << 13), ("lb6_services", 1 << 13)]
            .into_iter()
            .map(|(m, n)| (m.to_string(), n))
            .collect(),
        ..LoadOptions::default()
    };
    let mut datapath = Datapath::load(&opts).expect("load");
    let mut kernel = Reconciler::new(datapath.take_lb_maps().unwrap()).unwrap();
    let report = kernel.apply(&desired);
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    let mut mem = Reconciler::new(lb::datapath::maps::MemMaps::with_capacity(1 << 13)).unwrap();
    let report = mem.apply(&desired);
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    let dump = lb::datapath::maps::LbMaps::dump(kernel.maps()).unwrap();
    assert_eq!(dump.services.len(), 2 * 1500 * 4);
    assert_eq!(
        dump,
        mem.maps().dump,
        "kernel maps differ from entry-by-entry writes"
    );
}

#[test]
fn full_service_map_is_reported_and_previous_state_kept() {
    // Real kernel maps with room for 3 service entries (master + slots).
    let opts = LoadOptions {
        max_entries: [("lb4_services".to_string(), 3)].into_iter().collect(),
        ..LoadOptions::default()
    };
    let mut datapath = Datapath::load(&opts).expect("load");
    let mut reconciler = Reconciler::new(datapath.take_lb_maps().unwrap()).unwrap();
    let b4: Vec<IpAddr> = BACKENDS4.iter().map(|a| (*a).into()).collect();
    let other: IpAddr = Ipv4Addr::new(198, 19, 0, 20).into();

    // VIP4 with one backend (2 entries) fits; the other with three (4 entries) does not.
    let mut desired = DesiredState::default();
    let (fe, small) = service(VIP4.into(), Proto::Tcp, &b4[..1]);
    desired.services.insert(fe, small);
    let (fe_other, big) = service(other, Proto::Tcp, &b4);
    desired.services.insert(fe_other, big);
    let report = reconciler.apply(&desired);
    assert_eq!(report.errors.len(), 1, "{:?}", report.errors);
    assert_eq!(report.errors[0].frontend, fe_other);
    assert!(
        report.errors[0].error.contains("lb4_services is full"),
        "{:?}",
        report.errors
    );

    let mut fx = Fixture {
        datapath,
        _reconciler: reconciler,
        desired,
    };
    let run = |fx: &mut Fixture, dst: IpAddr, sport: u16| {
        fx.ingress(&packet(CLIENT4.into(), sport, dst, VPORT, L4::TcpSyn))
    };
    let (verdict, out) = run(&mut fx, VIP4.into(), 1000);
    assert_eq!(verdict, TC_ACT_OK);
    assert_eq!(
        parse_and_verify(&out).dst,
        b4[0],
        "the service that fit works"
    );
    let pkt = packet(CLIENT4.into(), 1001, other, VPORT, L4::TcpSyn);
    assert_eq!(
        fx.ingress(&pkt),
        (TC_ACT_OK, pkt.clone()),
        "nothing half-written"
    );

    // Growing VIP4 to three backends needs 4 entries in a map of 3. Its previous state (one
    // backend) must stay intact and keep serving.
    let mut grow = DesiredState::default();
    let (fe, bigger) = service(VIP4.into(), Proto::Tcp, &b4);
    grow.services.insert(fe, bigger);
    grow.services
        .insert(fe_other, service(other, Proto::Tcp, &b4).1);
    let report = fx._reconciler.apply(&grow);
    assert_eq!(report.errors.len(), 2, "{:?}", report.errors);
    for sport in 2000..2030 {
        let (_, out) = run(&mut fx, VIP4.into(), sport);
        assert_eq!(parse_and_verify(&out).dst, b4[0], "previous state kept");
    }
}

#[test]
fn pinned_map_of_another_size_is_refused() {
    /// Removes the pins even when an assertion fails.
    struct PinDir(std::path::PathBuf);
    impl Drop for PinDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let dir = std::path::PathBuf::from(format!("/sys/fs/bpf/lb-test-size-{}", std::process::id()));
    let _cleanup = PinDir(dir.clone());
    let pinned = LoadOptions {
        pin_dir: Some(dir.clone()),
        ..LoadOptions::default()
    };
    drop(Datapath::load(&pinned).expect("first load pins"));
    let resized = LoadOptions {
        max_entries: [("lb4_ct_tcp".to_string(), 1024)].into_iter().collect(),
        ..pinned.clone()
    };
    let err = Datapath::load(&resized)
        .err()
        .expect("resized load must fail");
    let err = format!("{err:#}");
    assert!(
        err.contains("cannot be resized") && err.contains("--bpf-ct-global-tcp-max"),
        "{err}"
    );
}

// ---------------------------------------------------------------------------------------------
// The trace record, and the one selection's answer for broken service state.

/// A traced load reports the decision the packet itself shows: the new flow's slot names the
/// backend the packet was sent to, later packets are established on it, the reply is
/// reverse-NATed, and misses, drops and unparsed packets say so.
#[test]
fn trace_record_matches_what_the_packet_shows() {
    let mut fx = traced_fixture();
    let (client, sport) = (CLIENT4, 6000u16);
    let master = fx
        ._reconciler
        .maps()
        .services4
        .get(&vip4_tcp(0), 0)
        .expect("master entry");

    let (verdict, out) = fx.ingress(&packet(
        client.into(),
        sport,
        VIP4.into(),
        VPORT,
        L4::TcpSyn,
    ));
    assert_eq!(verdict, TC_ACT_OK);
    let IpAddr::V4(backend) = parse_and_verify(&out).dst else {
        panic!("v4")
    };
    let r = fx.trace_record();
    assert_eq!(r.verdict, trace_verdict::FORWARD, "{r:?}");
    assert_eq!(u32::from(r.reason), metrics::TC_FWD_NEW, "{r:?}");
    assert_eq!(r.ct_state, trace_ct::NEW, "{r:?}");
    assert_eq!(r.scope, scope::EXTERNAL, "{r:?}");
    assert_eq!(r.svc_flags, svc_flags::CLUSTER_IP, "{r:?}");
    assert_eq!(r.rev_nat_id, master.rev_nat_id, "{r:?}");
    assert!((1..=master.count).contains(&r.slot), "{r:?}");
    // The slot names the backend, and the backend is where the packet went.
    let maps = fx._reconciler.maps();
    let slot = maps
        .services4
        .get(&vip4_tcp(r.slot), 0)
        .expect("slot entry");
    assert_eq!(slot.backend_id, r.backend_id, "{r:?}");
    let b = maps.backends4.get(&r.backend_id, 0).expect("backend");
    assert_eq!((Ipv4Addr::from(b.addr), b.port), (backend, BPORT), "{r:?}");
    let new_flow = r;

    fx.ingress(&packet(
        client.into(),
        sport,
        VIP4.into(),
        VPORT,
        L4::TcpAck,
    ));
    let r = fx.trace_record();
    assert_eq!(
        (r.verdict, u32::from(r.reason), r.ct_state),
        (
            trace_verdict::FORWARD,
            metrics::TC_FWD_ESTABLISHED,
            trace_ct::ESTABLISHED
        ),
        "{r:?}"
    );
    assert_eq!(
        r.slot, 0,
        "no slot is chosen for an established flow: {r:?}"
    );
    assert_eq!(
        (r.backend_id, r.rev_nat_id, r.scope),
        (new_flow.backend_id, new_flow.rev_nat_id, scope::EXTERNAL),
        "{r:?}"
    );

    let (_, out) = fx.ingress(&packet(
        backend.into(),
        BPORT,
        client.into(),
        sport,
        L4::TcpAck,
    ));
    assert_eq!(parse_and_verify(&out).src, IpAddr::from(VIP4));
    let r = fx.trace_record();
    assert_eq!(
        (r.verdict, u32::from(r.reason), r.ct_state),
        (
            trace_verdict::REVERSE_NAT,
            metrics::TC_REVNAT,
            trace_ct::REPLY
        ),
        "{r:?}"
    );
    assert_eq!(
        (r.backend_id, r.rev_nat_id),
        (new_flow.backend_id, new_flow.rev_nat_id),
        "{r:?}"
    );

    let (verdict, _) = fx.ingress(&packet(
        client.into(),
        1,
        EMPTY_VIP4.into(),
        VPORT,
        L4::TcpSyn,
    ));
    assert_eq!(verdict, TC_ACT_REDIRECT);
    let r = fx.trace_record();
    assert_eq!(
        (r.verdict, u32::from(r.reason), r.slot, r.backend_id),
        (trace_verdict::REJECT, metrics::TC_REJECT_NO_BACKEND, 0, 0),
        "{r:?}"
    );
    assert_ne!(r.rev_nat_id, 0, "a frontend's reject names it: {r:?}");

    fx.ingress(&packet(client.into(), 1, VIP4.into(), 81, L4::TcpSyn));
    let r = fx.trace_record();
    assert_eq!(
        r,
        TraceRecord {
            verdict: trace_verdict::REJECT,
            reason: metrics::TC_REJECT_UNKNOWN_PORT as u8,
            ..TraceRecord::default()
        }
    );

    let stranger = Ipv4Addr::new(198, 19, 9, 9);
    fx.ingress(&packet(
        client.into(),
        1,
        stranger.into(),
        VPORT,
        L4::TcpSyn,
    ));
    let r = fx.trace_record();
    assert_eq!(
        r,
        TraceRecord {
            verdict: trace_verdict::PASS,
            reason: metrics::TC_PASS_NO_SERVICE as u8,
            ..TraceRecord::default()
        }
    );
    let garbage: Vec<u8> = (0..60u8).map(|i| i.wrapping_mul(37)).collect();
    fx.ingress(&garbage);
    let r = fx.trace_record();
    assert_eq!(
        (r.verdict, u32::from(r.reason)),
        (trace_verdict::PASS, metrics::TC_PASS_UNPARSED),
        "{r:?}"
    );
}

/// The pod hook's record names the internal scope it balanced with.
#[test]
fn trace_record_shows_the_pod_hooks_internal_scope() {
    let mut fx = traced_fixture();
    let ext: IpAddr = Ipv4Addr::new(198, 18, 200, 1).into();
    let all: Vec<IpAddr> = BACKENDS4.iter().map(|a| (*a).into()).collect();
    let (mut fe, mut external) = service(ext, Proto::Tcp, &all[..1]);
    external.flags = svc_flags::EXTERNAL_IP | svc_flags::EXT_LOCAL | svc_flags::TWO_SCOPES;
    let mut internal = service(ext, Proto::Tcp, &all).1;
    internal.flags = external.flags;
    let mut desired = DesiredState::default();
    desired.services.insert(fe, external.clone());
    fe.scope = Scope::Internal;
    desired.services.insert(fe, internal);
    let report = fx._reconciler.apply(&desired);
    assert!(report.errors.is_empty(), "{:?}", report.errors);

    fx.ingress(&packet(CLIENT4.into(), 7000, ext, VPORT, L4::TcpSyn));
    let r = fx.trace_record();
    assert_eq!((r.scope, r.slot), (scope::EXTERNAL, 1), "{r:?}");
    assert_eq!(r.svc_flags, external.flags, "{r:?}");

    let (_, out) = fx.run(
        prog_names::TC_POD,
        &packet(CLIENT4.into(), 7001, ext, VPORT, L4::TcpSyn),
    );
    let r = fx.trace_record();
    assert_eq!(
        (r.verdict, r.scope),
        (trace_verdict::FORWARD, scope::INTERNAL),
        "{r:?}"
    );
    assert!((1..=3).contains(&r.slot), "{r:?}");
    let b = fx
        ._reconciler
        .maps()
        .backends4
        .get(&r.backend_id, 0)
        .expect("backend");
    assert_eq!(IpAddr::from(b.addr), parse_and_verify(&out).dst, "{r:?}");
}

/// Without `trace` the programs never write the record.
#[test]
fn untraced_load_leaves_the_record_zero() {
    let mut fx = fixture();
    let (verdict, out) = fx.ingress(&packet(
        CLIENT4.into(),
        6100,
        VIP4.into(),
        VPORT,
        L4::TcpSyn,
    ));
    assert_eq!(verdict, TC_ACT_OK);
    assert!(backends_of(VIP4.into()).contains(&parse_and_verify(&out).dst));
    fx.ingress(&packet(
        CLIENT4.into(),
        1,
        EMPTY_VIP4.into(),
        VPORT,
        L4::TcpSyn,
    ));
    assert_eq!(fx.trace_record(), TraceRecord::default());
}

/// Sends new TCP flows to VIP4 and checks each is rejected (a RST back) as having no backend,
/// counted once; returns the trace records. (These were drops before lb did REJECT.)
fn new_flows_rejected_as_no_backend(fx: &mut Fixture) -> Vec<TraceRecord> {
    let before = fx.counter(metrics::TC_REJECT_NO_BACKEND);
    let fwd_before = fx.counter(metrics::TC_FWD_NEW);
    let mut records = Vec::new();
    for sport in 31_000..31_020u16 {
        let pkt = packet(CLIENT4.into(), sport, VIP4.into(), VPORT, L4::TcpSyn);
        let (verdict, out) = fx.ingress(&pkt);
        assert_eq!(verdict, TC_ACT_REDIRECT, "sport {sport}");
        assert!(matches!(parse_reply(&out).kind, ReplyKind::Rst { .. }));
        records.push(fx.trace_record());
    }
    assert_eq!(fx.counter(metrics::TC_REJECT_NO_BACKEND) - before, 20);
    assert_eq!(fx.counter(metrics::TC_FWD_NEW), fwd_before);
    for r in &records {
        assert_eq!(
            (r.verdict, u32::from(r.reason), r.ct_state),
            (
                trace_verdict::REJECT,
                metrics::TC_REJECT_NO_BACKEND,
                trace_ct::NONE
            ),
            "{r:?}"
        );
        assert!((1..=3).contains(&r.slot), "a slot was chosen: {r:?}");
    }
    records
}

#[test]
fn master_entry_with_missing_slots_rejects_and_counts_no_backend() {
    let mut fx = traced_fixture();
    let mut services = fx.services4();
    let master = services.get(&vip4_tcp(0), 0).expect("master");
    assert_eq!(master.count, 3);
    for slot in 1..=master.count {
        services.remove(&vip4_tcp(slot)).expect("remove slot");
    }
    for r in new_flows_rejected_as_no_backend(&mut fx) {
        assert_eq!(r.backend_id, 0, "no slot entry, no backend id: {r:?}");
    }
    assert!(
        fx.ct4().keys().next().is_none() && fx.ct4_of(17).keys().next().is_none(),
        "a rejected flow leaves no conntrack entry"
    );
}

#[test]
fn slot_naming_a_missing_backend_rejects_and_counts_no_backend() {
    const GONE: u32 = 0x00ab_cdef;
    let mut fx = traced_fixture();
    assert!(fx._reconciler.maps().backends4.get(&GONE, 0).is_err());
    let mut services = fx.services4();
    let master = services.get(&vip4_tcp(0), 0).expect("master");
    for slot in 1..=master.count {
        let entry = SvcValue {
            backend_id: GONE,
            rev_nat_id: master.rev_nat_id,
            ..SvcValue::default()
        };
        services
            .insert(vip4_tcp(slot), entry, 0)
            .expect("rewrite slot");
    }
    for r in new_flows_rejected_as_no_backend(&mut fx) {
        assert_eq!(
            r.backend_id, GONE,
            "the record names the missing backend: {r:?}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// SCTP. Packets are crafted here with a table-driven CRC32c, independent of the datapath's
// incremental update; every output CRC is recomputed over the whole SCTP packet.

const IPPROTO_SCTP: u8 = 132;

static CRC32C_TABLE: LazyLock<[u32; 256]> = LazyLock::new(|| {
    let mut t = [0u32; 256];
    for (i, e) in t.iter_mut().enumerate() {
        let mut c = i as u32;
        for _ in 0..8 {
            c = if c & 1 != 0 {
                (c >> 1) ^ 0x82f6_3b78
            } else {
                c >> 1
            };
        }
        *e = c;
    }
    t
});

fn crc32c(data: &[u8]) -> u32 {
    !data.iter().fold(!0u32, |c, &b| {
        CRC32C_TABLE[((c ^ u32::from(b)) & 0xff) as usize] ^ (c >> 8)
    })
}

/// The CRC32c field an SCTP packet must carry (little-endian on the wire, RFC 9260 App. B).
fn sctp_crc(sctp: &[u8]) -> [u8; 4] {
    let mut zeroed = sctp.to_vec();
    zeroed[8..12].fill(0);
    crc32c(&zeroed).to_le_bytes()
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Chunk {
    Init,
    /// A DATA chunk carrying this many payload bytes (padded to 4).
    Data(usize),
    Abort,
    ShutdownComplete,
}

/// The SCTP packet (common header + one chunk) with a valid CRC32c.
fn sctp_payload(sport: u16, dport: u16, chunk: Chunk) -> Vec<u8> {
    let mut p = Vec::new();
    p.extend_from_slice(&sport.to_be_bytes());
    p.extend_from_slice(&dport.to_be_bytes());
    // Verification tag (0 only in INIT), CRC filled in below.
    let vtag: u32 = if chunk == Chunk::Init { 0 } else { 0x1234_5678 };
    p.extend_from_slice(&vtag.to_be_bytes());
    p.extend_from_slice(&[0; 4]);
    match chunk {
        Chunk::Init => {
            p.extend_from_slice(&[1, 0, 0, 20]);
            p.extend_from_slice(&0xcafe_f00du32.to_be_bytes()); // initiate tag
            p.extend_from_slice(&65_535u32.to_be_bytes()); // a_rwnd
            p.extend_from_slice(&[0, 10, 0, 10]); // streams out/in
            p.extend_from_slice(&1u32.to_be_bytes()); // initial TSN
        }
        Chunk::Data(n) => {
            p.extend_from_slice(&[0, 0x03]);
            p.extend_from_slice(&((16 + n) as u16).to_be_bytes());
            p.extend_from_slice(&[0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0]); // TSN, stream, seq, PPID
            p.extend((0..n).map(|i| (i * 7 + 3) as u8));
            p.resize(p.len().next_multiple_of(4), 0);
        }
        Chunk::Abort => p.extend_from_slice(&[6, 0, 0, 4]),
        Chunk::ShutdownComplete => p.extend_from_slice(&[14, 0, 0, 4]),
    }
    let crc = sctp_crc(&p);
    p[8..12].copy_from_slice(&crc);
    p
}

fn sctp_packet(src: IpAddr, sport: u16, dst: IpAddr, dport: u16, chunk: Chunk) -> Vec<u8> {
    let payload = sctp_payload(sport, dport, chunk);
    let eth = PacketBuilder::ethernet2(MAC_A, MAC_B);
    let mut buf = Vec::new();
    let proto = etherparse::IpNumber(IPPROTO_SCTP);
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => eth
            .ipv4(s.octets(), d.octets(), 64)
            .write(&mut buf, proto, &payload),
        (IpAddr::V6(s), IpAddr::V6(d)) => eth
            .ipv6(s.octets(), d.octets(), 64)
            .write(&mut buf, proto, &payload),
        _ => panic!("mixed families"),
    }
    .expect("build packet");
    buf
}

/// The SCTP view of a frame: its endpoints, CRC field, and whether that CRC is right. The IPv4
/// header checksum is verified.
#[derive(Debug)]
struct SctpSeen {
    src: IpAddr,
    sport: u16,
    dst: IpAddr,
    dport: u16,
    crc: [u8; 4],
    crc_ok: bool,
}

fn parse_sctp(pkt: &[u8]) -> SctpSeen {
    let ip = &pkt[14..];
    let (src, dst, proto, l4): (IpAddr, IpAddr, u8, &[u8]) =
        match u16::from_be_bytes([pkt[12], pkt[13]]) {
            0x0800 => {
                let ihl = usize::from(ip[0] & 0xf) * 4;
                assert_eq!(fold(ones_sum(&ip[..ihl])), 0xffff, "IPv4 header checksum");
                let tot = usize::from(u16::from_be_bytes([ip[2], ip[3]]));
                let s: [u8; 4] = ip[12..16].try_into().unwrap();
                let d: [u8; 4] = ip[16..20].try_into().unwrap();
                (s.into(), d.into(), ip[9], &ip[ihl..tot])
            }
            0x86dd => {
                let plen = usize::from(u16::from_be_bytes([ip[4], ip[5]]));
                let s: [u8; 16] = ip[8..24].try_into().unwrap();
                let d: [u8; 16] = ip[24..40].try_into().unwrap();
                (s.into(), d.into(), ip[6], &ip[40..40 + plen])
            }
            other => panic!("unexpected ethertype {other:#x}"),
        };
    assert_eq!(proto, IPPROTO_SCTP);
    let crc: [u8; 4] = l4[8..12].try_into().unwrap();
    SctpSeen {
        src,
        sport: u16::from_be_bytes([l4[0], l4[1]]),
        dst,
        dport: u16::from_be_bytes([l4[2], l4[3]]),
        crc,
        crc_ok: crc == sctp_crc(l4),
    }
}

#[test]
fn crc32c_helper_matches_the_standard_check_value() {
    // The check value of CRC-32C (Castagnoli), as in RFC 3720 / every CRC catalogue.
    assert_eq!(crc32c(b"123456789"), 0xe306_9283);
    assert_eq!(
        crc32c(&[0u8; 32]),
        0x8a91_36aa,
        "RFC 3720 B.4: 32 bytes of zeros"
    );
}

/// New associations are DNATed (address and port) with a valid CRC32c; later packets keep
/// their backend; the backend's reply comes from the VIP with a valid CRC32c; new flows reach
/// every backend.
fn sctp_forward_and_reply(client: IpAddr, vip: IpAddr) {
    let mut fx = fixture();
    let backends = backends_of(vip);
    let mut seen = BTreeSet::new();
    for sport in 40_000..40_060u16 {
        let init = sctp_packet(client, sport, vip, VPORT, Chunk::Init);
        let (verdict, out) = fx.ingress(&init);
        assert_eq!(verdict, TC_ACT_OK);
        assert_eq!(out.len(), init.len());
        let p = parse_sctp(&out);
        assert_eq!((p.src, p.sport), (client, sport), "source untouched");
        assert!(
            backends.contains(&p.dst),
            "DNAT to a backend, got {}",
            p.dst
        );
        assert_eq!(p.dport, BPORT, "port rewritten");
        assert!(p.crc_ok, "CRC32c valid after the port rewrite: {p:?}");
        seen.insert(p.dst);

        for _ in 0..3 {
            let data = sctp_packet(client, sport, vip, VPORT, Chunk::Data(100));
            let q = parse_sctp(&fx.ingress(&data).1);
            assert_eq!(
                (q.dst, q.dport),
                (p.dst, BPORT),
                "association keeps its backend"
            );
            assert!(q.crc_ok, "{q:?}");
        }

        let reply = sctp_packet(p.dst, BPORT, client, sport, Chunk::Data(40));
        let (verdict, out) = fx.ingress(&reply);
        assert_eq!(verdict, TC_ACT_OK);
        let r = parse_sctp(&out);
        assert_eq!((r.src, r.sport), (vip, VPORT), "reply comes from the VIP");
        assert_eq!(
            (r.dst, r.dport),
            (client, sport),
            "reply destination untouched"
        );
        assert!(r.crc_ok, "CRC32c valid after the reverse NAT: {r:?}");
    }
    assert_eq!(
        seen.len(),
        3,
        "60 new associations reach all 3 backends, got {seen:?}"
    );
}

#[test]
fn ipv4_sctp_forward_established_and_reverse_nat() {
    sctp_forward_and_reply(CLIENT4.into(), VIP4.into());
}

#[test]
fn ipv6_sctp_forward_established_and_reverse_nat() {
    sctp_forward_and_reply(CLIENT6.into(), VIP6.into());
}

#[test]
fn sctp_port_preserving_service_keeps_the_crc_byte_for_byte() {
    let mut fx = fixture();
    for (client, vip) in [(CLIENT4.into(), VIP4.into()), (CLIENT6.into(), VIP6.into())] {
        let init = sctp_packet(client, 5000, vip, SAME_PORT, Chunk::Init);
        let before = parse_sctp(&init);
        let p = parse_sctp(&fx.ingress(&init).1);
        assert!(
            backends_of(vip).contains(&p.dst),
            "DNAT to a backend, got {}",
            p.dst
        );
        assert_eq!(p.dport, SAME_PORT);
        // The CRC covers no address: an address-only rewrite must leave it as it was.
        assert_eq!(p.crc, before.crc, "{vip}: CRC32c untouched");
        assert!(p.crc_ok);

        let reply = sctp_packet(p.dst, SAME_PORT, client, 5000, Chunk::Data(8));
        let r = parse_sctp(&fx.ingress(&reply).1);
        assert_eq!((r.src, r.sport), (vip, SAME_PORT));
        assert_eq!(
            r.crc,
            parse_sctp(&reply).crc,
            "{vip}: reply CRC32c untouched"
        );
    }
}

#[test]
fn sctp_crc_is_right_for_every_packet_size() {
    let mut fx = fixture();
    // From a bare chunk header up to full 1500-byte IPv4/IPv6 packets and beyond: the update
    // depends on the SCTP length through both of its tables (low and high byte).
    let sizes = [0, 1, 4, 84, 240, 241, 496, 1000, 1452, 1464, 2048, 3000];
    for (client, vip) in [(CLIENT4.into(), VIP4.into()), (CLIENT6.into(), VIP6.into())] {
        for (i, &n) in sizes.iter().enumerate() {
            let sport = 20_000 + i as u16;
            let pkt = sctp_packet(client, sport, vip, VPORT, Chunk::Data(n));
            let p = parse_sctp(&fx.ingress(&pkt).1);
            assert_eq!(p.dport, BPORT);
            assert!(p.crc_ok, "{vip}, {} bytes: {p:?}", pkt.len());
            let reply = sctp_packet(p.dst, BPORT, client, sport, Chunk::Data(n));
            let r = parse_sctp(&fx.ingress(&reply).1);
            assert_eq!(r.sport, VPORT);
            assert!(r.crc_ok, "{vip} reply, {} bytes: {r:?}", reply.len());
        }
    }
    let big = sctp_packet(CLIENT4.into(), 1, VIP4.into(), VPORT, Chunk::Data(1452));
    assert_eq!(
        big.len(),
        14 + 1500,
        "the case above includes a full 1500-byte IPv4 packet"
    );
}

#[test]
fn sctp_zero_crc_stays_zero() {
    // A local SCTP socket on a device with CRC offload leaves the CRC zero for the kernel or
    // NIC to fill in after tc (CHECKSUM_PARTIAL): a delta XORed into it would corrupt it.
    let mut fx = fixture();
    for (client, vip, l4) in [
        (IpAddr::from(CLIENT4), IpAddr::from(VIP4), 14 + 20),
        (CLIENT6.into(), VIP6.into(), 14 + 40),
    ] {
        let mut pkt = sctp_packet(client, 6000, vip, VPORT, Chunk::Init);
        pkt[l4 + 8..l4 + 12].fill(0);
        let p = parse_sctp(&fx.ingress(&pkt).1);
        assert_eq!(p.dport, BPORT, "still translated");
        assert_eq!(p.crc, [0; 4], "{vip}: zero CRC left zero");
    }
}

#[test]
fn truncated_sctp_passes_untouched() {
    let mut fx = fixture();
    let mut cases: Vec<(&str, Vec<u8>)> = Vec::new();
    for (family, client, vip, l3) in [
        ("ipv4", IpAddr::from(CLIENT4), IpAddr::from(VIP4), 20),
        ("ipv6", CLIENT6.into(), VIP6.into(), 40),
    ] {
        let good = sctp_packet(client, 7000, vip, VPORT, Chunk::Init);
        // Common header cut to 8 of its 12 bytes, IP lengths saying so.
        let mut cut = good[..14 + l3 + 8].to_vec();
        let len_off = if l3 == 20 { 14 + 2 } else { 14 + 4 };
        let ip_len = if l3 == 20 { l3 + 8 } else { 8 };
        cut[len_off..len_off + 2].copy_from_slice(&(ip_len as u16).to_be_bytes());
        if l3 == 20 {
            cut[14 + 10..14 + 12].fill(0);
            let c = !fold(ones_sum(&cut[14..14 + 20]));
            cut[14 + 10..14 + 12].copy_from_slice(&c.to_be_bytes());
        }
        cases.push((family, cut));
        // The IP header claims more SCTP bytes than the frame holds: the CRC update would use a
        // wrong length, so the packet is not translated.
        let mut short = good.clone();
        short.truncate(good.len() - 4);
        cases.push((family, short));
    }
    for (what, pkt) in cases {
        let (verdict, out) = fx
            .try_run(prog_names::TC_INGRESS, &pkt)
            .unwrap_or_else(|e| panic!("{what}: {e:?}"));
        assert_eq!(verdict, TC_ACT_OK, "{what}");
        assert_eq!(out, pkt, "{what}: passed untouched");
    }
}

#[test]
fn sctp_conntrack_follows_init_abort_and_shutdown_complete() {
    let mut fx = fixture();
    for (client, vip) in [
        (IpAddr::from(CLIENT4), IpAddr::from(VIP4)),
        (CLIENT6.into(), VIP6.into()),
    ] {
        let sport = 8000;
        let entry = |fx: &mut Fixture| {
            fx.ct_entry(client, sport, vip, VPORT, IPPROTO_SCTP, ct_dir::SERVICE)
                .expect("service entry")
        };
        let backend = parse_sctp(
            &fx.ingress(&sctp_packet(client, sport, vip, VPORT, Chunk::Init))
                .1,
        )
        .dst;
        let init = entry(&mut fx);
        assert_eq!(init.flags, 0);
        let reply_entry = fx
            .ct_entry(backend, BPORT, client, sport, IPPROTO_SCTP, ct_dir::REPLY)
            .expect("reply entry");
        assert_eq!(reply_entry.backend_id, init.backend_id);

        // The backend's answer makes it established, with TCP's established lifetime.
        fx.ingress(&sctp_packet(backend, BPORT, client, sport, Chunk::Data(4)));
        let est = entry(&mut fx);
        assert_ne!(est.flags & ct_flags::SEEN_REPLY, 0, "{vip}");
        assert!(
            est.expires - init.expires > 21_600 - 60 - 5,
            "{vip}: established lives ~6 h, not the 60 s of an unanswered INIT"
        );

        // ABORT from the client closes it; an INIT on the closed entry is balanced afresh.
        fx.ingress(&sctp_packet(client, sport, vip, VPORT, Chunk::Abort));
        let closed = entry(&mut fx);
        assert_ne!(
            closed.flags & ct_flags::TX_CLOSING,
            0,
            "{vip}: ABORT closes"
        );
        assert!(
            closed.expires < init.expires,
            "{vip}: closing is shorter than INIT's 60 s"
        );
        fx.ingress(&sctp_packet(client, sport, vip, VPORT, Chunk::Init));
        assert_eq!(
            entry(&mut fx).flags,
            0,
            "{vip}: INIT after ABORT starts a new entry"
        );

        // SHUTDOWN COMPLETE from the backend closes it too.
        let backend = parse_sctp(
            &fx.ingress(&sctp_packet(client, sport, vip, VPORT, Chunk::Data(4)))
                .1,
        )
        .dst;
        fx.ingress(&sctp_packet(
            backend,
            BPORT,
            client,
            sport,
            Chunk::ShutdownComplete,
        ));
        assert_ne!(
            entry(&mut fx).flags & ct_flags::RX_CLOSING,
            0,
            "{vip}: SHUTDOWN COMPLETE closes"
        );
    }
}

#[test]
fn packet_programs_stay_far_below_the_verifier_limit() {
    // The SCTP CRC update costs verifier work at every rewrite site; keep the total well under
    // the 1M-instruction limit (kernels report the count since 5.16).
    let mut dp = Datapath::load(&LoadOptions::default()).expect("load datapath (root?)");
    for name in [
        prog_names::XDP,
        prog_names::TC_INGRESS,
        prog_names::TC_POD,
        prog_names::TC_EGRESS,
    ] {
        let info = dp
            .ebpf_mut()
            .program(name)
            .expect(name)
            .info()
            .expect("prog info");
        let Some(verified) = info.verified_instruction_count() else {
            eprintln!("{name}: kernel does not report verified instructions; skipped");
            return;
        };
        eprintln!("{name}: {verified} verified instructions");
        assert!(
            verified < 250_000,
            "{name}: {verified} verified instructions"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Masquerade (SNAT): kube-proxy's rules, port allocation, un-SNAT of replies, hairpin.

const NODE4: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 1);
const NODE6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 1);
/// A ClusterIP with one backend (`BACKENDS4[0]` / `BACKENDS6[0]`), so flows share it.
const ONE_VIP4: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 12);
const ONE_VIP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0xffff, 0, 0, 0, 0, 0x12);

fn node_ip(of: IpAddr) -> IpAddr {
    match of {
        IpAddr::V4(_) => NODE4.into(),
        IpAddr::V6(_) => NODE6.into(),
    }
}

fn one_backend_vip(of: IpAddr) -> IpAddr {
    match of {
        IpAddr::V4(_) => ONE_VIP4.into(),
        IpAddr::V6(_) => ONE_VIP6.into(),
    }
}

/// `fixture_with(opts)` plus the one-backend VIPs and this node's facts written to the
/// datapath: node IPs NODE4/NODE6, `cidrs` as --cluster-cidr, `--masquerade-all` as given.
fn masq_fixture(opts: &LoadOptions, cidrs: &[&str], masquerade_all: bool) -> Fixture {
    let mut fx = fixture_with(opts);
    let mut desired = DesiredState::default();
    let b4: Vec<IpAddr> = BACKENDS4.iter().map(|a| (*a).into()).collect();
    let b6: Vec<IpAddr> = BACKENDS6.iter().map(|a| (*a).into()).collect();
    for (fe, entry) in [
        service(VIP4.into(), Proto::Tcp, &b4),
        service(VIP4.into(), Proto::Udp, &b4),
        service(VIP6.into(), Proto::Tcp, &b6),
        service(VIP6.into(), Proto::Udp, &b6),
        service(ONE_VIP4.into(), Proto::Tcp, &b4[..1]),
        service(ONE_VIP4.into(), Proto::Udp, &b4[..1]),
        service(ONE_VIP6.into(), Proto::Tcp, &b6[..1]),
        service(ONE_VIP6.into(), Proto::Udp, &b6[..1]),
        service(EMPTY_VIP4.into(), Proto::Tcp, &[]),
        service(EMPTY_VIP4.into(), Proto::Udp, &[]),
        service(EMPTY_VIP6.into(), Proto::Tcp, &[]),
        service(EMPTY_VIP6.into(), Proto::Udp, &[]),
    ] {
        desired.services.insert(fe, entry);
    }
    let report = fx._reconciler.apply(&desired);
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    let args = NodeFactsArgs {
        node_ip: vec![NODE4.into(), NODE6.into()],
        cluster_cidr: cidrs.iter().map(|c| c.parse().unwrap()).collect(),
        service_cidr: Vec::new(),
        masquerade_all,
        ..NodeFactsArgs::default()
    };
    let facts = NodeFacts::resolve(&args, None, Vec::new);
    fx.datapath
        .write_node_facts(&facts)
        .expect("write node facts");
    fx
}

impl Fixture {
    /// Overwrites the NAT port range in `lb_config`.
    fn set_nat_ports(&mut self, min: u16, max: u16) {
        let map = self.datapath.ebpf_mut().map_mut(map_names::CONFIG).unwrap();
        let mut config = Array::<_, LbConfig>::try_from(map).unwrap();
        let mut c = config.get(&0, 0).unwrap();
        (c.nat_port_min, c.nat_port_max) = (min, max);
        config.set(0, c, 0).unwrap();
    }
}

/// The pod CIDRs of the masquerade tests: the backends' links, not the client's (198.18.10.0/24,
/// 2001:db8:0:10::/64), which is therefore "outside the cluster".
const POD_CIDRS: [&str; 2] = ["198.18.11.0/24", "2001:db8:0:11::/64"];

/// Checks the IP and L4 checksums of `pkt` with etherparse (independently of
/// `parse_and_verify`'s own sums).
fn etherparse_checksums_ok(pkt: &[u8]) {
    use etherparse::{NetHeaders, PacketHeaders, TransportHeader};
    let h = PacketHeaders::from_ethernet_slice(pkt).expect("etherparse parses the output");
    let payload = h.payload.slice();
    match (h.net.expect("IP header"), h.transport.expect("L4 header")) {
        (NetHeaders::Ipv4(ip, _), t) => {
            assert_eq!(ip.header_checksum, ip.calc_header_checksum(), "IPv4 header");
            match t {
                TransportHeader::Tcp(t) => {
                    assert_eq!(
                        t.checksum,
                        t.calc_checksum_ipv4(&ip, payload).unwrap(),
                        "TCP"
                    )
                }
                TransportHeader::Udp(u) => {
                    assert_eq!(
                        u.checksum,
                        u.calc_checksum_ipv4(&ip, payload).unwrap(),
                        "UDP"
                    )
                }
                other => panic!("unexpected {other:?}"),
            }
        }
        (NetHeaders::Ipv6(ip, _), t) => match t {
            TransportHeader::Tcp(t) => {
                assert_eq!(
                    t.checksum,
                    t.calc_checksum_ipv6(&ip, payload).unwrap(),
                    "TCP"
                )
            }
            TransportHeader::Udp(u) => {
                assert_eq!(
                    u.checksum,
                    u.calc_checksum_ipv6(&ip, payload).unwrap(),
                    "UDP"
                )
            }
            other => panic!("unexpected {other:?}"),
        },
        other => panic!("unexpected {other:?}"),
    }
}

/// A masqueraded packet goes out by FIB redirect, or to the stack when the test's netns has no
/// route for the backend; either way it must not be dropped.
fn assert_sent(verdict: u32) {
    assert!(
        verdict == TC_ACT_OK || verdict == TC_ACT_REDIRECT,
        "verdict {verdict}"
    );
}

/// A client outside the cluster CIDRs: its new flow's source becomes the node IP and a port of
/// the range, later packets keep it, and the backend's reply to that address comes back from the
/// VIP to the client's own address and port; every checksum stays valid.
fn snat_forward_and_unsnat(client: IpAddr, vip: IpAddr, first: L4, then: L4) {
    let mut fx = masq_fixture(
        &LoadOptions {
            trace: true,
            ..LoadOptions::default()
        },
        &POD_CIDRS,
        false,
    );
    let node = node_ip(client);
    let before = fx.counter(metrics::TC_SNAT);
    for sport in [40_000u16, 40_001, 40_002] {
        let (verdict, out) = fx.ingress(&packet(client, sport, vip, VPORT, first));
        assert_sent(verdict);
        etherparse_checksums_ok(&out);
        let p = parse_and_verify(&out);
        assert_eq!(p.src, node, "source masqueraded to the node IP");
        assert!(
            (lb_common::nat::PORT_MIN..=lb_common::nat::PORT_MAX).contains(&p.sport),
            "NAT port {} in range",
            p.sport
        );
        assert!(backends_of(vip).contains(&p.dst), "DNAT to a backend");
        let r = fx.trace_record();
        assert_eq!((r.masquerade, r.nat_port), (1, p.sport), "{r:?}");

        let (verdict, again) = fx.ingress(&packet(client, sport, vip, VPORT, then));
        assert_sent(verdict);
        etherparse_checksums_ok(&again);
        let q = parse_and_verify(&again);
        assert_eq!(
            (q.src, q.sport, q.dst),
            (node, p.sport, p.dst),
            "flow keeps its NAT"
        );

        // The backend answers the node IP and NAT port, on the pod-facing device.
        let reply = packet(p.dst, BPORT, node, p.sport, then);
        let (verdict, back) = fx.run(prog_names::TC_POD, &reply);
        assert_eq!(verdict, TC_ACT_OK);
        etherparse_checksums_ok(&back);
        let b = parse_and_verify(&back);
        assert_eq!((b.src, b.sport), (vip, VPORT), "reply comes from the VIP");
        assert_eq!(
            (b.dst, b.dport),
            (client, sport),
            "reply goes back to the client"
        );
        let svc = fx
            .ct_entry(client, sport, vip, VPORT, p.proto, ct_dir::SERVICE)
            .expect("service entry");
        assert_ne!(svc.flags & ct_flags::SNAT, 0);
        assert_eq!((svc.nat_addr, svc.nat_port), (node, p.sport));
        let rev = fx
            .ct_entry(p.dst, BPORT, node, p.sport, p.proto, ct_dir::REPLY)
            .expect("reply entry keyed as the backend answers");
        assert_eq!(
            (rev.nat_addr, rev.nat_port),
            (client, sport),
            "restores the client"
        );
        assert_ne!(rev.flags & ct_flags::SEEN_REPLY, 0);
    }
    assert_eq!(
        fx.counter(metrics::TC_SNAT) - before,
        6,
        "3 flows x 2 packets"
    );
}

#[test]
fn ipv4_tcp_snat_and_unsnat() {
    snat_forward_and_unsnat(CLIENT4.into(), VIP4.into(), L4::TcpSyn, L4::TcpAck);
}

#[test]
fn ipv4_udp_snat_and_unsnat() {
    snat_forward_and_unsnat(CLIENT4.into(), VIP4.into(), L4::Udp, L4::Udp);
}

#[test]
fn ipv6_tcp_snat_and_unsnat() {
    snat_forward_and_unsnat(CLIENT6.into(), VIP6.into(), L4::TcpSyn, L4::TcpAck);
}

#[test]
fn ipv6_udp_snat_and_unsnat() {
    snat_forward_and_unsnat(CLIENT6.into(), VIP6.into(), L4::Udp, L4::Udp);
}

/// Clients that all use the same source port towards one backend get distinct NAT ports, and
/// each reply goes back to its own client. 40 clients in 80 ports: a port handed out twice
/// (an insert that is not `BPF_NOEXIST`) is all but certain to show.
#[test]
fn same_source_port_from_many_clients_gets_distinct_nat_ports() {
    let mut fx = masq_fixture(&LoadOptions::default(), &POD_CIDRS, false);
    fx.set_nat_ports(61_000, 61_079);
    for base in [IpAddr::from(CLIENT4), CLIENT6.into()] {
        let vip = one_backend_vip(base);
        let node = node_ip(base);
        let mut ports = BTreeSet::new();
        let clients: Vec<IpAddr> = (2..42u8)
            .map(|h| match base {
                IpAddr::V4(_) => Ipv4Addr::new(198, 18, 10, h).into(),
                IpAddr::V6(_) => {
                    Ipv6Addr::new(0x2001, 0xdb8, 0, 0x10, 0, 0, 0, u16::from(h)).into()
                }
            })
            .collect();
        let mut out = Vec::new();
        for c in &clients {
            let (verdict, pkt) = fx.ingress(&packet(*c, 5555, vip, VPORT, L4::TcpSyn));
            assert_sent(verdict);
            let p = parse_and_verify(&pkt);
            assert_eq!(p.src, node);
            ports.insert(p.sport);
            out.push(p);
        }
        assert_eq!(
            ports.len(),
            clients.len(),
            "{vip}: one NAT port per client: {ports:?}"
        );
        for (c, p) in clients.iter().zip(&out) {
            let (_, back) = fx.run(
                prog_names::TC_POD,
                &packet(p.dst, BPORT, node, p.sport, L4::TcpAck),
            );
            let b = parse_and_verify(&back);
            assert_eq!(
                (b.src, b.dst, b.dport),
                (vip, *c, 5555),
                "reply to its own client"
            );
        }
    }
}

/// With no free port in the range a new flow is dropped and counted, not sent unmasqueraded.
#[test]
fn exhausted_nat_ports_drop_the_new_flow() {
    let mut fx = masq_fixture(
        &LoadOptions {
            trace: true,
            ..LoadOptions::default()
        },
        &POD_CIDRS,
        false,
    );
    fx.set_nat_ports(61_000, 61_000);
    for base in [IpAddr::from(CLIENT4), CLIENT6.into()] {
        let vip = one_backend_vip(base);
        let (verdict, first) = fx.ingress(&packet(base, 1000, vip, VPORT, L4::Udp));
        assert_sent(verdict);
        assert_eq!(parse_and_verify(&first).sport, 61_000);
        let before = fx.counter(metrics::TC_SNAT_PORT_EXHAUSTED);
        let (verdict, _) = fx.ingress(&packet(base, 1001, vip, VPORT, L4::Udp));
        assert_eq!(verdict, TC_ACT_SHOT, "{vip}: the only port is taken");
        assert_eq!(fx.counter(metrics::TC_SNAT_PORT_EXHAUSTED) - before, 1);
        let r = fx.trace_record();
        assert_eq!(
            (r.verdict, u32::from(r.reason)),
            (trace_verdict::DROP, metrics::TC_SNAT_PORT_EXHAUSTED),
            "{r:?}"
        );
    }
}

/// kube-proxy's local-traffic detector: with --cluster-cidr, a pod source keeps its address;
/// without it (and without --masquerade-all), nobody is masqueraded; --masquerade-all
/// masquerades pods too.
#[test]
fn cluster_cidr_and_masquerade_all_decide_who_is_masqueraded() {
    for client in [IpAddr::from(CLIENT4), CLIENT6.into()] {
        let vip = match client {
            IpAddr::V4(_) => IpAddr::from(VIP4),
            IpAddr::V6(_) => VIP6.into(),
        };
        let node = node_ip(client);
        let client_cidrs = ["198.18.10.0/24", "2001:db8:0:10::/64"];
        let cases: [(&[&str], bool, bool, &str); 4] = [
            (
                &client_cidrs,
                false,
                false,
                "pod source with --cluster-cidr",
            ),
            (&[], false, false, "no detector, no --masquerade-all"),
            (
                &client_cidrs,
                true,
                true,
                "--masquerade-all masquerades pods too",
            ),
            (&POD_CIDRS, false, true, "source outside the cluster CIDRs"),
        ];
        for (cidrs, all, want, what) in cases {
            let mut fx = masq_fixture(&LoadOptions::default(), cidrs, all);
            let (verdict, out) = fx.ingress(&packet(client, 7000, vip, VPORT, L4::TcpSyn));
            assert_sent(verdict);
            etherparse_checksums_ok(&out);
            let p = parse_and_verify(&out);
            assert!(backends_of(vip).contains(&p.dst), "{what}: DNAT");
            if want {
                assert_eq!(p.src, node, "{client}: {what}");
            } else {
                assert_eq!((p.src, p.sport), (client, 7000), "{client}: {what}");
                assert_eq!(
                    verdict, TC_ACT_OK,
                    "{what}: unmasqueraded goes to the stack"
                );
            }
        }
    }
}

/// A backend reaching its own service through tc is masqueraded whatever the rules (KUBE-SEP's
/// `-s <ep ip>`), so its reply comes back through the node; the reply is un-SNATed to come from
/// the VIP.
#[test]
fn hairpin_is_always_masqueraded() {
    // A pod source with a detector: only hairpin can masquerade it.
    let mut fx = masq_fixture(
        &LoadOptions::default(),
        &["198.18.0.0/15", "2001:db8::/32"],
        false,
    );
    for backend in [IpAddr::from(BACKENDS4[0]), BACKENDS6[0].into()] {
        let vip = one_backend_vip(backend);
        let node = node_ip(backend);
        let (verdict, out) = fx.run(
            prog_names::TC_POD,
            &packet(backend, 33_000, vip, VPORT, L4::TcpSyn),
        );
        assert_sent(verdict);
        etherparse_checksums_ok(&out);
        let p = parse_and_verify(&out);
        assert_eq!((p.dst, p.dport), (backend, BPORT), "to itself");
        assert_eq!(p.src, node, "hairpin source is the node IP");
        let (_, back) = fx.run(
            prog_names::TC_POD,
            &packet(backend, BPORT, node, p.sport, L4::TcpAck),
        );
        etherparse_checksums_ok(&back);
        let b = parse_and_verify(&back);
        assert_eq!(
            (b.src, b.sport, b.dst, b.dport),
            (vip, VPORT, backend, 33_000)
        );
        // Another pod is not hairpin: it keeps its source.
        let other = match backend {
            IpAddr::V4(_) => IpAddr::from(BACKENDS4[1]),
            IpAddr::V6(_) => BACKENDS6[1].into(),
        };
        let (_, out) = fx.run(
            prog_names::TC_POD,
            &packet(other, 33_001, vip, VPORT, L4::TcpSyn),
        );
        assert_eq!(parse_and_verify(&out).src, other);
    }
}

// REJECT: the reply lb builds in place and sends back out the device the packet came in on.

/// What a reject reply says; parsed with etherparse, checksums verified twice (etherparse's and
/// a full recomputation here).
#[derive(Debug)]
struct Reply {
    /// (source, destination) MACs.
    macs: ([u8; 6], [u8; 6]),
    src: IpAddr,
    dst: IpAddr,
    kind: ReplyKind,
}

#[derive(Debug, PartialEq, Eq)]
enum ReplyKind {
    Rst {
        sport: u16,
        dport: u16,
        seq: u32,
        ack: Option<u32>,
        other_flags: bool,
        payload: usize,
    },
    /// ICMP or ICMPv6 port unreachable and the original IP packet it quotes.
    PortUnreachable { quoted: Vec<u8> },
}

fn parse_reply(pkt: &[u8]) -> Reply {
    let h = PacketHeaders::from_ethernet_slice(pkt).expect("reply parses");
    let Some(LinkHeader::Ethernet2(eth)) = &h.link else {
        panic!("no Ethernet header: {h:?}");
    };
    let payload = h.payload.slice();
    let (src, dst): (IpAddr, IpAddr) = match &h.net {
        Some(NetHeaders::Ipv4(ip, _)) => {
            assert_eq!(
                ip.header_checksum,
                ip.calc_header_checksum(),
                "IPv4 checksum"
            );
            assert_eq!(fold(ones_sum(&pkt[14..34])), 0xffff, "IPv4 checksum");
            assert_eq!(ip.time_to_live, 64);
            assert_eq!(usize::from(ip.total_len), pkt.len() - 14, "IPv4 length");
            (ip.source.into(), ip.destination.into())
        }
        Some(NetHeaders::Ipv6(ip, _)) => {
            assert_eq!(
                usize::from(ip.payload_length),
                pkt.len() - 54,
                "IPv6 length"
            );
            (ip.source.into(), ip.destination.into())
        }
        other => panic!("no IP header: {other:?}"),
    };
    let l3_len = if src.is_ipv4() { 20 } else { 40 };
    let l4 = &pkt[14 + l3_len..];
    let pseudo = |proto: u8| -> u32 {
        let addrs = match (src, dst) {
            (IpAddr::V4(s), IpAddr::V4(d)) => ones_sum(&s.octets()) + ones_sum(&d.octets()),
            (IpAddr::V6(s), IpAddr::V6(d)) => ones_sum(&s.octets()) + ones_sum(&d.octets()),
            _ => unreachable!(),
        };
        addrs + u32::from(proto) + l4.len() as u32
    };
    let kind = match (&h.net, &h.transport) {
        (Some(net), Some(TransportHeader::Tcp(tcp))) => {
            let want = match net {
                NetHeaders::Ipv4(ip, _) => tcp.calc_checksum_ipv4(ip, payload),
                NetHeaders::Ipv6(ip, _) => tcp.calc_checksum_ipv6(ip, payload),
                _ => unreachable!(),
            };
            assert_eq!(tcp.checksum, want.unwrap(), "TCP checksum (etherparse)");
            assert_eq!(fold(pseudo(6) + ones_sum(l4)), 0xffff, "TCP checksum");
            assert!(tcp.rst, "{tcp:?}");
            ReplyKind::Rst {
                sport: tcp.source_port,
                dport: tcp.destination_port,
                seq: tcp.sequence_number,
                ack: tcp.ack.then_some(tcp.acknowledgment_number),
                other_flags: tcp.syn || tcp.fin || tcp.psh || tcp.urg,
                payload: payload.len(),
            }
        }
        (Some(NetHeaders::Ipv4(..)), Some(TransportHeader::Icmpv4(icmp))) => {
            assert_eq!(
                icmp.icmp_type,
                Icmpv4Type::DestinationUnreachable(DestUnreachableHeader::Port)
            );
            assert_eq!(
                icmp.checksum,
                icmp.icmp_type.calc_checksum(payload),
                "ICMP checksum"
            );
            assert_eq!(fold(ones_sum(l4)), 0xffff, "ICMP checksum");
            assert_eq!(&l4[4..8], &[0; 4], "unused word");
            ReplyKind::PortUnreachable {
                quoted: payload.to_vec(),
            }
        }
        (Some(NetHeaders::Ipv6(ip, _)), Some(TransportHeader::Icmpv6(icmp))) => {
            assert_eq!(
                icmp.icmp_type,
                Icmpv6Type::DestinationUnreachable(DestUnreachableCode::Port)
            );
            let want = icmp
                .icmp_type
                .calc_checksum(ip.source, ip.destination, payload)
                .unwrap();
            assert_eq!(icmp.checksum, want, "ICMPv6 checksum (etherparse)");
            assert_eq!(fold(pseudo(58) + ones_sum(l4)), 0xffff, "ICMPv6 checksum");
            assert_eq!(&l4[4..8], &[0; 4], "unused word");
            ReplyKind::PortUnreachable {
                quoted: payload.to_vec(),
            }
        }
        other => panic!("not a reject reply: {other:?}"),
    };
    Reply {
        macs: (eth.source, eth.destination),
        src,
        dst,
        kind,
    }
}

/// Masquerade and REJECT together: a client outside the cluster CIDRs, whose flows to a served
/// ClusterIP are masqueraded, gets its RST / ICMP port unreachable straight back from the
/// service IP to its own address (no NAT port taken, no flow, no SNAT counted), for a service
/// without backends and for a port the ClusterIP does not have, IPv4 and IPv6.
#[test]
fn masqueraded_client_is_rejected_from_the_service_ip_without_snat() {
    let mut fx = masq_fixture(
        &LoadOptions {
            trace: true,
            ..LoadOptions::default()
        },
        &POD_CIDRS,
        false,
    );
    for (client, empty, served) in [
        (
            IpAddr::from(CLIENT4),
            IpAddr::from(EMPTY_VIP4),
            IpAddr::from(ONE_VIP4),
        ),
        (CLIENT6.into(), EMPTY_VIP6.into(), ONE_VIP6.into()),
    ] {
        // The served VIP masquerades this client.
        let (verdict, out) = fx.ingress(&packet(client, 40_100, served, VPORT, L4::TcpSyn));
        assert_sent(verdict);
        assert_eq!(parse_and_verify(&out).src, node_ip(client), "{served}");

        let snat = fx.counter(metrics::TC_SNAT);
        let syn = packet(client, 40_101, empty, VPORT, L4::TcpSyn);
        let kind = expect_reply(&mut fx, &syn, empty, metrics::TC_REJECT_NO_BACKEND);
        assert!(
            matches!(kind, ReplyKind::Rst { dport: 40_101, .. }),
            "{kind:?}"
        );
        let r = fx.trace_record();
        assert_eq!(
            (r.verdict, r.masquerade, r.nat_port),
            (trace_verdict::REJECT, 0, 0),
            "{r:?}"
        );
        let udp = packet(client, 5353, empty, VPORT, L4::Udp);
        let kind = expect_reply(&mut fx, &udp, empty, metrics::TC_REJECT_NO_BACKEND);
        assert!(
            matches!(kind, ReplyKind::PortUnreachable { .. }),
            "{kind:?}"
        );
        let udp = packet(client, 5354, served, 81, L4::Udp);
        let kind = expect_reply(&mut fx, &udp, served, metrics::TC_REJECT_UNKNOWN_PORT);
        assert!(
            matches!(kind, ReplyKind::PortUnreachable { .. }),
            "{kind:?}"
        );
        assert_eq!(
            fx.counter(metrics::TC_SNAT),
            snat,
            "{client}: nothing SNATed"
        );
        assert!(
            fx.ct_entry(client, 40_101, empty, VPORT, 6, ct_dir::SERVICE)
                .is_none(),
            "{empty}: no flow for a rejected packet"
        );
    }
}

/// Runs `pkt` through `lb_tc_ingress`, expects a reply sent back (redirect) from `from` to the
/// packet's source with the MACs swapped, and counted under `reason`.
fn expect_reply(fx: &mut Fixture, pkt: &[u8], from: IpAddr, reason: u32) -> ReplyKind {
    let before = fx.counter(reason);
    let (verdict, out) = fx.ingress(pkt);
    assert_eq!(verdict, TC_ACT_REDIRECT, "sent back");
    assert_eq!(fx.counter(reason) - before, 1, "counted once");
    let r = parse_reply(&out);
    assert_eq!(r.macs, (MAC_B, MAC_A), "MACs swapped");
    // The input's IP source (any protocol, so not through parse_and_verify).
    let client: IpAddr = match u16::from_be_bytes([pkt[12], pkt[13]]) {
        0x0800 => <[u8; 4]>::try_from(&pkt[26..30]).unwrap().into(),
        _ => <[u8; 16]>::try_from(&pkt[22..38]).unwrap().into(),
    };
    assert_eq!(
        (r.src, r.dst),
        (from, client),
        "from the service IP to the client"
    );
    r.kind
}

/// A SYN to a service without backends gets RST|ACK acknowledging SYN + payload; a segment with
/// ACK gets a bare RST whose seq is that ack (RFC 9293 3.10.7.1), IPv4 and IPv6.
#[test]
fn tcp_to_service_without_backends_gets_a_rst() {
    let mut fx = fixture();
    for vip in [IpAddr::from(EMPTY_VIP4), EMPTY_VIP6.into()] {
        let client = if vip.is_ipv4() {
            CLIENT4.into()
        } else {
            CLIENT6.into()
        };
        let syn = packet(client, 40_001, vip, VPORT, L4::TcpSyn);
        let rst = expect_reply(&mut fx, &syn, vip, metrics::TC_REJECT_NO_BACKEND);
        assert_eq!(
            rst,
            ReplyKind::Rst {
                sport: VPORT,
                dport: 40_001,
                seq: 0,
                ack: Some(1000 + PAYLOAD.len() as u32 + 1),
                other_flags: false,
                payload: 0,
            },
            "{vip}"
        );
        let fin = packet(client, 40_002, vip, VPORT, L4::TcpFin);
        let rst = expect_reply(&mut fx, &fin, vip, metrics::TC_REJECT_NO_BACKEND);
        assert_eq!(
            rst,
            ReplyKind::Rst {
                sport: VPORT,
                dport: 40_002,
                seq: 77,
                ack: None,
                other_flags: false,
                payload: 0,
            },
            "{vip}"
        );
    }
}

/// A RST is never answered: it is dropped, and counted under the reject's reason.
#[test]
fn rst_to_service_without_backends_is_dropped_not_answered() {
    let mut fx = fixture();
    for (client, vip) in [
        (IpAddr::from(CLIENT4), IpAddr::from(EMPTY_VIP4)),
        (CLIENT6.into(), EMPTY_VIP6.into()),
    ] {
        let before = fx.counter(metrics::TC_REJECT_NO_BACKEND);
        let (verdict, _) = fx.ingress(&packet(client, 40_003, vip, VPORT, L4::TcpRst));
        assert_eq!(verdict, TC_ACT_SHOT, "{vip}");
        assert_eq!(fx.counter(metrics::TC_REJECT_NO_BACKEND) - before, 1);
    }
}

/// UDP to a service without backends gets ICMP / ICMPv6 port unreachable quoting the whole
/// (small) original IP packet.
#[test]
fn udp_to_service_without_backends_gets_port_unreachable() {
    let mut fx = fixture();
    for (client, vip) in [
        (IpAddr::from(CLIENT4), IpAddr::from(EMPTY_VIP4)),
        (CLIENT6.into(), EMPTY_VIP6.into()),
    ] {
        let pkt = packet(client, 5353, vip, VPORT, L4::Udp);
        let kind = expect_reply(&mut fx, &pkt, vip, metrics::TC_REJECT_NO_BACKEND);
        assert_eq!(
            kind,
            ReplyKind::PortUnreachable {
                quoted: pkt[14..].to_vec()
            },
            "{vip}"
        );
    }
}

/// A large datagram is quoted only as far as the reply stays within 576 bytes (IPv4) or the
/// 1280-byte minimum MTU (IPv6).
#[test]
fn port_unreachable_quotes_as_much_as_the_rfcs_allow() {
    let mut fx = fixture();
    let big: Vec<u8> = (0..1400u32).map(|i| (i * 7) as u8).collect();
    for (client, vip, max) in [
        (IpAddr::from(CLIENT4), IpAddr::from(EMPTY_VIP4), 576),
        (CLIENT6.into(), EMPTY_VIP6.into(), 1280),
    ] {
        let pkt = packet_with(client, 5353, vip, VPORT, L4::Udp, &big);
        let (verdict, out) = fx.ingress(&pkt);
        assert_eq!(verdict, TC_ACT_REDIRECT);
        assert_eq!(out.len() - 14, max, "{vip}: reply fills the limit");
        let ReplyKind::PortUnreachable { quoted } = parse_reply(&out).kind else {
            panic!("not a port unreachable");
        };
        let hdrs = if vip.is_ipv4() { 28 } else { 48 };
        assert_eq!(quoted.len(), max - hdrs);
        assert_eq!(
            quoted[..],
            pkt[14..14 + quoted.len()],
            "a prefix of the original"
        );
    }
}

/// A ClusterIP on a port (or protocol) it has no frontend for is rejected like kube-proxy's
/// cluster-ips-check; the real port still forwards.
#[test]
fn unknown_port_of_a_cluster_ip_is_rejected() {
    let mut fx = fixture();
    for (client, vip) in [
        (IpAddr::from(CLIENT4), IpAddr::from(VIP4)),
        (CLIENT6.into(), VIP6.into()),
    ] {
        let syn = packet(client, 40_010, vip, 81, L4::TcpSyn);
        let kind = expect_reply(&mut fx, &syn, vip, metrics::TC_REJECT_UNKNOWN_PORT);
        assert!(
            matches!(
                kind,
                ReplyKind::Rst {
                    sport: 81,
                    dport: 40_010,
                    ..
                }
            ),
            "{kind:?}"
        );
        let udp = packet(client, 40_011, vip, 81, L4::Udp);
        let kind = expect_reply(&mut fx, &udp, vip, metrics::TC_REJECT_UNKNOWN_PORT);
        assert_eq!(
            kind,
            ReplyKind::PortUnreachable {
                quoted: udp[14..].to_vec()
            }
        );
        // SCTP gets what UDP gets: any protocol but TCP is answered with ICMP.
        let sctp = sctp_packet(client, 40_014, vip, 81, Chunk::Init);
        let kind = expect_reply(&mut fx, &sctp, vip, metrics::TC_REJECT_UNKNOWN_PORT);
        assert_eq!(
            kind,
            ReplyKind::PortUnreachable {
                quoted: sctp[14..].to_vec()
            }
        );
        let (verdict, out) = fx.ingress(&packet(client, 40_012, vip, VPORT, L4::TcpSyn));
        assert_eq!(verdict, TC_ACT_OK);
        assert!(backends_of(vip).contains(&parse_and_verify(&out).dst));
    }
    // The pod hook rejects the same way.
    let syn = packet(CLIENT4.into(), 40_013, VIP4.into(), 81, L4::TcpSyn);
    let (verdict, out) = fx.run(prog_names::TC_POD, &syn);
    assert_eq!(verdict, TC_ACT_REDIRECT);
    assert!(matches!(parse_reply(&out).kind, ReplyKind::Rst { .. }));
    // Egress only reverse-NATs: nothing is rejected there.
    let (verdict, out) = fx.run(prog_names::TC_EGRESS, &syn);
    assert_eq!((verdict, out), (TC_ACT_OK, syn));
}

/// With `--service-cidr`, an address in the range that is no ClusterIP is dropped (counted);
/// ClusterIPs in it keep their behaviour; addresses outside pass untouched.
#[test]
fn unallocated_service_cidr_address_is_dropped() {
    let mut fx = fixture();
    fx.datapath
        .set_service_cidrs(&[
            (Ipv4Addr::new(198, 19, 0, 0).into(), 16),
            // Host bits are cleared.
            (
                Ipv6Addr::new(0x2001, 0xdb8, 0xffff, 0, 0, 0, 0, 1).into(),
                64,
            ),
        ])
        .expect("service CIDRs");
    let unallocated: [(IpAddr, IpAddr); 2] = [
        (CLIENT4.into(), Ipv4Addr::new(198, 19, 9, 9).into()),
        (
            CLIENT6.into(),
            Ipv6Addr::new(0x2001, 0xdb8, 0xffff, 0, 0, 0, 9, 9).into(),
        ),
    ];
    for (client, addr) in unallocated {
        for l4 in [L4::TcpSyn, L4::Udp] {
            let before = fx.counter(metrics::TC_DROP_UNALLOCATED);
            let (verdict, _) = fx.ingress(&packet(client, 40_020, addr, VPORT, l4));
            assert_eq!(verdict, TC_ACT_SHOT, "{addr}");
            assert_eq!(fx.counter(metrics::TC_DROP_UNALLOCATED) - before, 1);
        }
    }
    let outside: [(IpAddr, IpAddr); 2] = [
        (CLIENT4.into(), Ipv4Addr::new(198, 20, 0, 1).into()),
        (
            CLIENT6.into(),
            Ipv6Addr::new(0x2001, 0xdb8, 0xfffe, 0, 0, 0, 0, 1).into(),
        ),
    ];
    for (client, addr) in outside {
        let pkt = packet(client, 40_021, addr, VPORT, L4::TcpSyn);
        let (verdict, out) = fx.ingress(&pkt);
        assert_eq!((verdict, out), (TC_ACT_OK, pkt), "{addr}: untouched");
    }
    // ClusterIPs inside the range: forwarded on their port, rejected on others.
    let (verdict, _) = fx.ingress(&packet(CLIENT6.into(), 40_022, VIP6.into(), VPORT, L4::Udp));
    assert_eq!(verdict, TC_ACT_OK);
    let (verdict, _) = fx.ingress(&packet(CLIENT4.into(), 40_023, VIP4.into(), 81, L4::Udp));
    assert_eq!(verdict, TC_ACT_REDIRECT);
    // Rewriting the ranges replaces them: the old ones stop matching.
    fx.datapath
        .set_service_cidrs(&[(Ipv4Addr::new(198, 21, 0, 0).into(), 16)])
        .expect("service CIDRs");
    for (client, addr) in unallocated {
        let pkt = packet(client, 40_024, addr, VPORT, L4::TcpSyn);
        let (verdict, out) = fx.ingress(&pkt);
        assert_eq!(
            (verdict, out),
            (TC_ACT_OK, pkt),
            "{addr}: no longer in a range"
        );
    }
}

/// Socket LB's ECONNREFUSED is a branch on the frozen global `LB_HAS_SET_RETVAL`: with it 0
/// the kernel drops the `bpf_set_retval` call as dead code before any pass checks the helper,
/// which is what lets kernels without the helper for sock_addr programs load them (EPERM
/// there). With the probe's 1 the call is in the loaded program; kernels without the helper
/// (before 5.18 for sock_addr programs) get 0 either way.
#[test]
fn set_retval_call_is_dead_code_unless_the_probe_found_the_helper() {
    let found = lb::datapath::load::sock_set_retval_supported();
    for (no_set_retval, present) in [(true, false), (false, found)] {
        let mut dp = Datapath::load(&LoadOptions {
            no_set_retval,
            ..LoadOptions::default()
        })
        .expect("load datapath (root?)");
        assert_eq!(dp.sock_refuses_with_econnrefused(), present);
        for name in [prog_names::CONNECT4, prog_names::SENDMSG6] {
            let id = dp
                .ebpf_mut()
                .program(name)
                .expect(name)
                .info()
                .expect("prog info")
                .id();
            let out = std::process::Command::new("bpftool")
                .args(["prog", "dump", "xlated", "id", &id.to_string()])
                .output()
                .expect("bpftool");
            assert!(out.status.success(), "{out:?}");
            let text = String::from_utf8_lossy(&out.stdout);
            assert!(text.contains("call "), "{name}: an xlated dump: {text}");
            assert_eq!(
                text.contains("set_retval"),
                present,
                "{name} (no_set_retval: {no_set_retval}):\n{text}"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Conntrack pressure.

/// `lb4_ct_tcp` far smaller than the flows through it. New flows are always forwarded to a
/// programmed backend, and each is recorded or counted as an insert failure. A mid-stream
/// packet whose entry LRU pressure evicted is re-balanced over the backends programmed now
/// (counted as `tc_ct_miss_midstream`, traced as `new_midstream`), an established one keeps
/// its backend, and after a backend is removed no flow, evicted or not, is sent to it.
#[test]
fn conntrack_pressure_never_misforwards() {
    const CT_MAX: u32 = 64;
    const FLOWS: u16 = 300;
    // BPF_PROG_TEST_RUN runs on the calling CPU, and an LRU map this small keeps per-CPU free
    // lists (before 5.x's common-list changes): flows run from two CPUs can evict a flow's
    // own service entry when its reply entry is inserted. One CPU makes "recorded or counted"
    // a property of the datapath rather than of the scheduler.
    let mut one = nix::sched::CpuSet::new();
    one.set(0).expect("cpu 0");
    nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &one).expect("pin to cpu 0");
    let mut fx = fixture_with(&LoadOptions {
        trace: true,
        max_entries: [("lb4_ct_tcp".to_string(), CT_MAX)].into_iter().collect(),
        ..LoadOptions::default()
    });
    let programmed: BTreeSet<IpAddr> = backends_of(VIP4.into()).into_iter().collect();
    let syn = |sport| packet(CLIENT4.into(), sport, VIP4.into(), VPORT, L4::TcpSyn);
    let ack = |sport| packet(CLIENT4.into(), sport, VIP4.into(), VPORT, L4::TcpAck);
    let sport = |i: u16| 30_000 + i;
    let mut chosen = Vec::new();
    for i in 0..FLOWS {
        let failed_before = fx.counter(metrics::TC_CT_INSERT_FAILED);
        let (verdict, out) = fx.ingress(&syn(sport(i)));
        assert_eq!(verdict, TC_ACT_OK, "flow {i}");
        let dst = parse_and_verify(&out).dst;
        assert!(programmed.contains(&dst), "flow {i} went to {dst}");
        let recorded = fx
            .ct_entry(
                CLIENT4.into(),
                sport(i),
                VIP4.into(),
                VPORT,
                6,
                ct_dir::SERVICE,
            )
            .is_some();
        let counted = fx.counter(metrics::TC_CT_INSERT_FAILED) > failed_before;
        assert!(
            recorded || counted,
            "flow {i}: neither recorded nor counted"
        );
        chosen.push(dst);
    }
    assert_eq!(fx.counter(metrics::TC_FWD_NEW), u64::from(FLOWS));
    let entries = fx.ct4().keys().count();
    assert!(
        entries <= CT_MAX as usize,
        "{entries} entries in a map of {CT_MAX}"
    );
    let alive = |fx: &mut Fixture, i: u16| {
        fx.ct_entry(
            CLIENT4.into(),
            sport(i),
            VIP4.into(),
            VPORT,
            6,
            ct_dir::SERVICE,
        )
        .is_some()
    };
    let evicted: Vec<u16> = (0..FLOWS).filter(|i| !alive(&mut fx, *i)).collect();
    assert!(
        evicted.len() >= usize::from(FLOWS) - CT_MAX as usize / 2,
        "two entries per flow: most flows lost theirs ({} evicted)",
        evicted.len()
    );

    // A mid-stream packet of an evicted flow: re-balanced, counted, traced.
    let midstream_before = fx.counter(metrics::TC_CT_MISS_MIDSTREAM);
    let (verdict, out) = fx.ingress(&ack(sport(evicted[0])));
    assert_eq!(verdict, TC_ACT_OK);
    let rebalanced = parse_and_verify(&out).dst;
    assert!(programmed.contains(&rebalanced));
    // Tracked anew, with the backend it was balanced to now.
    chosen[usize::from(evicted[0])] = rebalanced;
    assert_eq!(
        fx.counter(metrics::TC_CT_MISS_MIDSTREAM),
        midstream_before + 1
    );
    let r = fx.trace_record();
    assert_eq!(
        (r.verdict, u32::from(r.reason), r.ct_state),
        (
            trace_verdict::FORWARD,
            metrics::TC_FWD_NEW,
            trace_ct::NEW_MIDSTREAM
        ),
        "{r:?}"
    );

    // A flow whose entry survived keeps its backend and is no miss.
    let kept = (0..FLOWS)
        .rev()
        .find(|i| alive(&mut fx, *i))
        .expect("a flow still tracked");
    let midstream_before = fx.counter(metrics::TC_CT_MISS_MIDSTREAM);
    let (_, out) = fx.ingress(&ack(sport(kept)));
    assert_eq!(parse_and_verify(&out).dst, chosen[usize::from(kept)]);
    assert_eq!(fx.trace_record().ct_state, trace_ct::ESTABLISHED);
    assert_eq!(fx.counter(metrics::TC_CT_MISS_MIDSTREAM), midstream_before);

    // Its backend goes: no flow, tracked, evicted or re-balanced, is sent there again.
    let removed = chosen[usize::from(kept)];
    let remaining: Vec<IpAddr> = programmed
        .iter()
        .copied()
        .filter(|b| *b != removed)
        .collect();
    let (fe, entry) = service(VIP4.into(), Proto::Tcp, &remaining);
    fx.desired.services.insert(fe, entry);
    let desired = fx.desired.clone();
    let report = fx._reconciler.apply(&desired);
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    for i in 0..FLOWS {
        let (verdict, out) = fx.ingress(&ack(sport(i)));
        if verdict == TC_ACT_REDIRECT {
            // A tracked flow of the removed backend: a RST to the client, never the backend.
            assert_eq!(chosen[usize::from(i)], removed, "flow {i}");
            assert!(matches!(parse_reply(&out).kind, ReplyKind::Rst { .. }));
            assert_eq!(fx.trace_record().ct_state, trace_ct::BACKEND_GONE);
            continue;
        }
        assert_eq!(verdict, TC_ACT_OK, "flow {i}");
        let dst = parse_and_verify(&out).dst;
        assert!(
            remaining.contains(&dst),
            "flow {i} sent to {dst}, not programmed"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Session affinity.

/// `traced_fixture()` with session affinity of `timeout` seconds on `vip`'s TCP frontend.
fn affine_fixture(vip: IpAddr, timeout: u32) -> Fixture {
    let mut fx = traced_fixture();
    let fe = Frontend::new(vip, VPORT, Proto::Tcp);
    let e = fx.desired.services.get_mut(&fe).expect("TCP frontend");
    e.flags |= svc_flags::AFFINITY;
    e.affinity_timeout = timeout;
    let desired = fx.desired.clone();
    let report = fx._reconciler.apply(&desired);
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    fx
}

/// A SYN of a new flow from `client:sport` to `vip`: the backend it went to and the trace's
/// affinity verdict.
fn syn_to(fx: &mut Fixture, client: IpAddr, sport: u16, vip: IpAddr) -> (IpAddr, u8) {
    let (ret, out) = fx.ingress(&packet(client, sport, vip, VPORT, L4::TcpSyn));
    assert_eq!(ret, TC_ACT_OK);
    let r = fx.trace_record();
    assert_eq!(r.verdict, trace_verdict::FORWARD, "{r:?}");
    (parse_and_verify(&out).dst, r.affinity)
}

#[test]
fn session_affinity_keeps_each_client_on_its_backend_until_the_timeout() {
    let mut fx = affine_fixture(VIP4.into(), 1);
    let clients: Vec<IpAddr> = (2..18u8)
        .map(|i| Ipv4Addr::new(198, 18, 10, i).into())
        .collect();
    let mut first = BTreeMap::new();
    for (n, c) in clients.iter().enumerate() {
        for k in 0..10u16 {
            let (dst, affinity) = syn_to(&mut fx, *c, 10_000 + n as u16 * 100 + k, VIP4.into());
            if k == 0 {
                assert_eq!(affinity, trace_affinity::NEW, "{c}: first flow");
                first.insert(*c, dst);
            } else {
                assert_eq!(affinity, trace_affinity::HIT, "{c}: flow {k}");
                assert_eq!(dst, first[c], "{c}: flow {k} left its backend");
            }
        }
    }
    let spread: BTreeSet<&IpAddr> = first.values().collect();
    assert!(spread.len() >= 2, "clients are still balanced: {first:?}");

    // Past the timeout (1 s; the datapath counts whole seconds) every client is balanced
    // afresh: some land elsewhere (all 16 staying has probability 3^-16).
    thread::sleep(Duration::from_millis(2_200));
    let mut moved = 0;
    for (n, c) in clients.iter().enumerate() {
        let (dst, affinity) = syn_to(&mut fx, *c, 20_000 + n as u16, VIP4.into());
        assert_eq!(affinity, trace_affinity::NEW, "{c}: expired entry");
        moved += usize::from(dst != first[c]);
        // ...and the new choice holds again.
        let (again, affinity) = syn_to(&mut fx, *c, 21_000 + n as u16, VIP4.into());
        assert_eq!((again, affinity), (dst, trace_affinity::HIT), "{c}");
    }
    assert!(moved > 0, "no client was re-balanced after the timeout");

    // Without affinity the same client spreads over the backends.
    let mut plain = BTreeSet::new();
    for sport in 30_000..30_060u16 {
        let (ret, out) = fx.ingress(&packet(CLIENT4.into(), sport, VIP4.into(), VPORT, L4::Udp));
        assert_eq!(ret, TC_ACT_OK);
        assert_eq!(fx.trace_record().affinity, trace_affinity::NONE);
        plain.insert(parse_and_verify(&out).dst);
    }
    assert_eq!(plain.len(), 3, "UDP (no affinity) is balanced: {plain:?}");
}

#[test]
fn session_affinity_never_keeps_a_client_on_a_backend_the_service_left() {
    for vip in [IpAddr::from(VIP4), IpAddr::from(VIP6)] {
        let client: IpAddr = match vip {
            IpAddr::V4(_) => CLIENT4.into(),
            IpAddr::V6(_) => CLIENT6.into(),
        };
        let mut fx = affine_fixture(vip, 10_800);
        let (x, affinity) = syn_to(&mut fx, client, 40_000, vip);
        assert_eq!(affinity, trace_affinity::NEW);
        assert_eq!(
            syn_to(&mut fx, client, 40_001, vip),
            (x, trace_affinity::HIT)
        );

        // The client's backend turns terminating: it keeps its flows (a slot after the active
        // ones) but no affinity entry may send new ones to it.
        let fe = Frontend::new(vip, VPORT, Proto::Tcp);
        let mut desired = fx.desired.clone();
        let e = desired.services.get_mut(&fe).expect("frontend");
        for b in &mut e.backends {
            if b.l4.addr == x {
                b.state = lb::model::BackendState::Terminating;
            }
        }
        assert!(fx._reconciler.apply(&desired).errors.is_empty());
        let (y, affinity) = syn_to(&mut fx, client, 40_002, vip);
        assert_eq!(
            affinity,
            trace_affinity::NEW,
            "{vip}: entry naming a terminating backend"
        );
        assert_ne!(y, x, "{vip}: new flow to the terminating backend");
        assert_eq!(
            syn_to(&mut fx, client, 40_003, vip),
            (y, trace_affinity::HIT)
        );

        // The new backend leaves the service altogether: the one left takes over.
        let e = desired.services.get_mut(&fe).expect("frontend");
        e.backends.retain(|b| b.l4.addr != y);
        assert!(fx._reconciler.apply(&desired).errors.is_empty());
        let (z, affinity) = syn_to(&mut fx, client, 40_004, vip);
        assert_eq!(
            affinity,
            trace_affinity::NEW,
            "{vip}: entry naming a removed backend"
        );
        assert!(
            z != x && z != y,
            "{vip}: {z} is neither terminating {x} nor removed {y}"
        );
    }
}

// Conntrack lifecycle: removed backends and the configured lifetimes.

/// Reprograms `vip`'s `proto` service without `gone`.
fn remove_backend(fx: &mut Fixture, vip: IpAddr, proto: Proto, gone: IpAddr) {
    let remaining: Vec<IpAddr> = backends_of(vip)
        .into_iter()
        .filter(|b| *b != gone)
        .collect();
    let (fe, entry) = service(vip, proto, &remaining);
    fx.desired.services.insert(fe, entry);
    let desired = fx.desired.clone();
    let report = fx._reconciler.apply(&desired);
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert_eq!(report.backends_deleted, 1, "{report:?}");
}

/// A TCP packet without SYN whose entry names a removed backend: XDP hands it to tc untouched
/// (entry kept), tc answers the client with a RST from the service address, deletes the entry,
/// counts `tc_reject_backend_gone` and traces `backend_gone` with the entry's flags; the
/// client's next SYN on the same 5-tuple is balanced afresh to a live backend.
#[test]
fn midstream_tcp_to_a_removed_backend_gets_a_rst() {
    for (client, vip) in [
        (IpAddr::from(CLIENT4), IpAddr::from(VIP4)),
        (CLIENT6.into(), VIP6.into()),
    ] {
        let mut fx = traced_fixture();
        let sport = 7000;
        let (_, out) = fx.ingress(&packet(client, sport, vip, VPORT, L4::TcpSyn));
        let backend = parse_and_verify(&out).dst;
        // The backend answers: the flow is established.
        fx.ingress(&packet(backend, BPORT, client, sport, L4::TcpAck));
        let entry = fx
            .ct_entry(client, sport, vip, VPORT, 6, ct_dir::SERVICE)
            .expect("service entry");
        assert_ne!(entry.flags & ct_flags::SEEN_REPLY, 0);
        remove_backend(&mut fx, vip, Proto::Tcp, backend);

        let ack = packet(client, sport, vip, VPORT, L4::TcpAck);
        let passed = fx.counter(metrics::XDP_PASS_TO_TC);
        let (verdict, out) = fx.xdp(&ack);
        assert_eq!(
            (verdict, &out),
            (XDP_PASS, &ack),
            "{vip}: XDP leaves it to tc"
        );
        assert_eq!(fx.counter(metrics::XDP_PASS_TO_TC), passed + 1);
        assert!(
            fx.ct_entry(client, sport, vip, VPORT, 6, ct_dir::SERVICE)
                .is_some(),
            "{vip}: XDP keeps the entry for tc"
        );

        let before = fx.counter(metrics::TC_REJECT_BACKEND_GONE);
        let (verdict, out) = fx.ingress(&ack);
        assert_eq!(verdict, TC_ACT_REDIRECT, "{vip}: RST sent back");
        let reply = parse_reply(&out);
        assert_eq!((reply.src, reply.dst), (vip, client));
        assert!(
            matches!(
                reply.kind,
                ReplyKind::Rst { sport: s, dport: d, ack: None, .. } if s == VPORT && d == sport
            ),
            "{vip}: {reply:?}"
        );
        assert_eq!(fx.counter(metrics::TC_REJECT_BACKEND_GONE), before + 1);
        let r = fx.trace_record();
        assert_eq!(
            (r.verdict, u32::from(r.reason), r.ct_state),
            (
                trace_verdict::REJECT,
                metrics::TC_REJECT_BACKEND_GONE,
                trace_ct::BACKEND_GONE
            ),
            "{vip}: {r:?}"
        );
        assert_eq!(r.backend_id, entry.backend_id, "{vip}: the gone backend");
        assert_eq!(r.ct_flags, entry.flags, "{vip}: the flags the packet met");
        assert!(
            fx.ct_entry(client, sport, vip, VPORT, 6, ct_dir::SERVICE)
                .is_none(),
            "{vip}: the entry is deleted"
        );

        // The client's next SYN on the same 5-tuple is balanced afresh.
        let again = fx.ingress(&packet(client, sport, vip, VPORT, L4::TcpSyn));
        assert_eq!(again.0, TC_ACT_OK);
        let to = parse_and_verify(&again.1).dst;
        assert_ne!(to, backend, "{vip}: a new SYN goes to a live backend");
        assert_eq!(fx.trace_record().ct_state, trace_ct::NEW);
    }
}

/// UDP keeps no connection a backend could lose: a packet whose entry names a removed backend
/// is re-balanced to a live one, as is a retransmitted SYN; neither is counted as
/// `tc_reject_backend_gone`.
#[test]
fn udp_and_syns_of_a_removed_backend_are_rebalanced() {
    for (client, vip) in [
        (IpAddr::from(CLIENT4), IpAddr::from(VIP4)),
        (CLIENT6.into(), VIP6.into()),
    ] {
        for (proto, l4, n) in [(Proto::Udp, L4::Udp, 17), (Proto::Tcp, L4::TcpSyn, 6)] {
            let mut fx = traced_fixture();
            let sport = 7100;
            let pkt = || packet(client, sport, vip, VPORT, l4);
            let (_, out) = fx.ingress(&pkt());
            let backend = parse_and_verify(&out).dst;
            let old = fx
                .ct_entry(client, sport, vip, VPORT, n, ct_dir::SERVICE)
                .expect("entry");
            remove_backend(&mut fx, vip, proto, backend);
            let (verdict, out) = fx.ingress(&pkt());
            assert_eq!(verdict, TC_ACT_OK, "{vip} {proto}");
            let to = parse_and_verify(&out).dst;
            assert!(
                to != backend && backends_of(vip).contains(&to),
                "{vip} {proto}: re-balanced to a live backend, went to {to}"
            );
            let r = fx.trace_record();
            assert_eq!(
                (u32::from(r.reason), r.ct_state),
                (metrics::TC_FWD_NEW, trace_ct::NEW),
                "{vip} {proto}: {r:?}"
            );
            let new = fx
                .ct_entry(client, sport, vip, VPORT, n, ct_dir::SERVICE)
                .expect("entry");
            assert_ne!(
                new.backend_id, old.backend_id,
                "{vip} {proto}: entry rewritten"
            );
            assert_eq!(fx.counter(metrics::TC_REJECT_BACKEND_GONE), 0);
        }
    }
}

/// The lifetimes set at load (`--bpf-ct-timeout-regular-*`) are what entries get: SYN until the
/// reply, established after it, closing after a FIN, and UDP's.
#[test]
fn conntrack_lifetimes_follow_the_configured_timeouts() {
    let t = CtTimeouts {
        tcp_syn: 111,
        tcp: 2222,
        tcp_fin: 33,
        any: 44,
    };
    let mut fx = fixture_with(&LoadOptions {
        ct_timeouts: t,
        ..LoadOptions::default()
    });
    let client: IpAddr = CLIENT4.into();
    let vip: IpAddr = VIP4.into();
    let sport = 7200;
    let expires = |fx: &mut Fixture, proto| {
        let e = fx
            .ct_entry(client, sport, vip, VPORT, proto, ct_dir::SERVICE)
            .expect("entry");
        e.expires
    };
    let within = |got: u32, before: u32, after: u32, secs: u32, what: &str| {
        assert!(
            (before + secs..=after + secs).contains(&got),
            "{what}: expires {got}, want now + {secs} (now {before}..={after})"
        );
    };
    let before = monotonic_secs();
    let (_, out) = fx.ingress(&packet(client, sport, vip, VPORT, L4::TcpSyn));
    within(
        expires(&mut fx, 6),
        before,
        monotonic_secs(),
        t.tcp_syn,
        "SYN",
    );
    let backend = parse_and_verify(&out).dst;
    let before = monotonic_secs();
    fx.ingress(&packet(backend, BPORT, client, sport, L4::TcpAck));
    within(
        expires(&mut fx, 6),
        before,
        monotonic_secs(),
        t.tcp,
        "established",
    );
    let reply = fx
        .ct_entry(backend, BPORT, client, sport, 6, ct_dir::REPLY)
        .expect("reply entry");
    within(
        reply.expires,
        before,
        monotonic_secs(),
        t.tcp,
        "established (reply)",
    );
    let before = monotonic_secs();
    fx.ingress(&packet(client, sport, vip, VPORT, L4::TcpFin));
    within(
        expires(&mut fx, 6),
        before,
        monotonic_secs(),
        t.tcp_fin,
        "FIN",
    );
    let before = monotonic_secs();
    fx.ingress(&packet(client, sport, vip, VPORT, L4::Udp));
    within(expires(&mut fx, 17), before, monotonic_secs(), t.any, "UDP");
}

/// A zero lifetime is refused at load, naming its flag.
#[test]
fn zero_conntrack_lifetime_is_refused() {
    let err = Datapath::load(&LoadOptions {
        ct_timeouts: CtTimeouts {
            tcp: 0,
            ..CtTimeouts::default()
        },
        ..LoadOptions::default()
    })
    .err()
    .expect("a zero lifetime must be refused");
    assert!(
        format!("{err:#}").contains("--bpf-ct-timeout-regular-tcp "),
        "{err:#}"
    );
}

/// `--bpf-ct-global-*-max` sizes all four conntrack maps (TCP and the rest, both families).
#[test]
fn conntrack_map_sizes_follow_the_flags() {
    let args = lb::conntrack::CtArgs {
        bpf_ct_global_tcp_max: 4096,
        bpf_ct_global_any_max: 2048,
        ..Default::default()
    };
    let mut fx = fixture_with(&LoadOptions {
        max_entries: args
            .map_sizes()
            .into_iter()
            .map(|(n, v)| (n.to_string(), v))
            .collect(),
        ..LoadOptions::default()
    });
    for (name, want) in [
        (map_names::CT_TCP4, 4096),
        (map_names::CT_TCP6, 4096),
        (map_names::CT_ANY4, 2048),
        (map_names::CT_ANY6, 2048),
    ] {
        let map = fx.datapath.ebpf_mut().map(name).expect(name);
        let info = match map {
            Map::LruHashMap(m) => m.info().expect("info"),
            other => panic!("{name} is {other:?}"),
        };
        assert_eq!(info.max_entries(), want, "{name}");
    }
}

// ---------------------------------------------------------------------------------------------
// ICMP errors about translated flows (`icmp` in lb-ebpf).

const ROUTER4: Ipv4Addr = Ipv4Addr::new(198, 18, 99, 1);
const ROUTER6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 0x99, 0, 0, 0, 1);

/// A router of `of`'s family, on no path lb knows.
fn router(of: IpAddr) -> IpAddr {
    match of {
        IpAddr::V4(_) => ROUTER4.into(),
        IpAddr::V6(_) => ROUTER6.into(),
    }
}

/// A "fragmentation needed" (next-hop MTU 1400) or ICMPv6 "packet too big" (MTU 1280) from
/// `src` to `dst` quoting `quote` (an IP packet, from its header on).
fn too_big(src: IpAddr, dst: IpAddr, quote: &[u8]) -> Vec<u8> {
    let eth = PacketBuilder::ethernet2(MAC_A, MAC_B);
    let mut buf = Vec::new();
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => eth
            .ipv4(s.octets(), d.octets(), 64)
            .icmpv4(Icmpv4Type::DestinationUnreachable(
                DestUnreachableHeader::FragmentationNeeded { next_hop_mtu: 1400 },
            ))
            .write(&mut buf, quote),
        (IpAddr::V6(s), IpAddr::V6(d)) => eth
            .ipv6(s.octets(), d.octets(), 64)
            .icmpv6(Icmpv6Type::PacketTooBig { mtu: 1280 })
            .write(&mut buf, quote),
        _ => panic!("mixed families"),
    }
    .expect("build ICMP error");
    buf
}

/// An ICMP error's outer source and destination and what it quotes, with every checksum
/// verified: the outer ones by etherparse and by full recomputation; the quote's IPv4 header
/// checksum; and when the quote is `complete` (the whole packet), its TCP/UDP checksum, both
/// ways. The ICMP type is checked to be the one `too_big` built.
fn parse_error(pkt: &[u8], complete: bool) -> (IpAddr, IpAddr, Parsed) {
    let h = PacketHeaders::from_ethernet_slice(pkt).expect("error parses");
    let quote = h.payload.slice();
    let (src, dst): (IpAddr, IpAddr) = match (&h.net, &h.transport) {
        (Some(NetHeaders::Ipv4(ip, _)), Some(TransportHeader::Icmpv4(icmp))) => {
            assert_eq!(ip.header_checksum, ip.calc_header_checksum(), "IPv4");
            assert_eq!(
                icmp.icmp_type,
                Icmpv4Type::DestinationUnreachable(DestUnreachableHeader::FragmentationNeeded {
                    next_hop_mtu: 1400
                })
            );
            assert_eq!(
                icmp.checksum,
                icmp.icmp_type.calc_checksum(quote),
                "ICMP checksum (etherparse)"
            );
            (ip.source.into(), ip.destination.into())
        }
        (Some(NetHeaders::Ipv6(ip, _)), Some(TransportHeader::Icmpv6(icmp))) => {
            assert_eq!(icmp.icmp_type, Icmpv6Type::PacketTooBig { mtu: 1280 });
            let want = icmp
                .icmp_type
                .calc_checksum(ip.source, ip.destination, quote)
                .unwrap();
            assert_eq!(icmp.checksum, want, "ICMPv6 checksum (etherparse)");
            (ip.source.into(), ip.destination.into())
        }
        other => panic!("not an ICMP error: {other:?}"),
    };
    // The same outer checksum by full recomputation.
    let l3 = if src.is_ipv4() { 20 } else { 40 };
    let icmp = &pkt[14 + l3..];
    let pseudo = match (src, dst) {
        (IpAddr::V4(_), _) => 0,
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            ones_sum(&s.octets()) + ones_sum(&d.octets()) + 58 + icmp.len() as u32
        }
        _ => unreachable!(),
    };
    assert_eq!(fold(pseudo + ones_sum(icmp)), 0xffff, "ICMP checksum");
    let mut frame = pkt[..14].to_vec();
    frame[12..14].copy_from_slice(&pkt[12..14]);
    frame.extend_from_slice(quote);
    let parsed = if complete {
        etherparse_checksums_ok(&frame);
        parse_and_verify(&frame)
    } else {
        // Addresses and ports only; an IPv4 header checksum all the same.
        let (s, d, proto, l4): (IpAddr, IpAddr, u8, &[u8]) = if src.is_ipv4() {
            assert_eq!(fold(ones_sum(&quote[..20])), 0xffff, "quoted IPv4 header");
            let s: [u8; 4] = quote[12..16].try_into().unwrap();
            let d: [u8; 4] = quote[16..20].try_into().unwrap();
            (s.into(), d.into(), quote[9], &quote[20..])
        } else {
            let s: [u8; 16] = quote[8..24].try_into().unwrap();
            let d: [u8; 16] = quote[24..40].try_into().unwrap();
            (s.into(), d.into(), quote[6], &quote[40..])
        };
        Parsed {
            src: s,
            sport: u16::from_be_bytes([l4[0], l4[1]]),
            dst: d,
            dport: u16::from_be_bytes([l4[2], l4[3]]),
            proto,
            l4_csum: 0,
        }
    };
    (src, dst, parsed)
}

/// Conntrack entries of both families, every protocol.
fn ct_count(fx: &mut Fixture) -> usize {
    [6u8, 17]
        .into_iter()
        .map(|p| fx.ct4_of(p).keys().count() + fx.ct6_of(p).keys().count())
        .sum()
}

/// A router's "fragmentation needed" / "packet too big" for a packet lb DNATed reaches the
/// client quoting that packet as the client sent it (client → VIP), with valid checksums
/// inside and out, on tc and XDP, IPv4 and IPv6, TCP and UDP: from a router its source stays
/// the router's, from the backend itself it becomes the VIP. A quote cut to RFC 792's 8
/// bytes of L4 header is translated too. Conntrack gains nothing.
#[test]
fn icmp_errors_about_forwarded_packets_reach_the_client_as_its_own() {
    let mut fx = traced_fixture();
    let before = fx.counter(metrics::TC_ICMP_ERROR_REVNAT);
    let mut translated = 0;
    for (client, vip) in [
        (IpAddr::from(CLIENT4), IpAddr::from(VIP4)),
        (CLIENT6.into(), VIP6.into()),
    ] {
        for (i, l4) in [L4::TcpSyn, L4::Udp].into_iter().enumerate() {
            for hook in [Ext::Tc, Ext::Xdp] {
                let sport = 41_000 + i as u16 * 10 + u16::from(hook == Ext::Xdp);
                let (verdict, fwd) = fx.external(hook, &packet(client, sport, vip, VPORT, l4));
                assert_eq!(verdict, hook.pass());
                let p = parse_and_verify(&fwd);
                let entries = ct_count(&mut fx);
                let quote = fwd[14..].to_vec();
                let ip_len = if client.is_ipv4() { 20 } else { 40 };
                for (from, cut) in [
                    (router(client), quote.len()),
                    (p.dst, quote.len()),
                    (router(client), ip_len + 8),
                ] {
                    let complete = cut == quote.len();
                    let err = too_big(from, client, &quote[..cut]);
                    let what = format!("{hook:?} {client} {l4:?} from {from} quote {cut}");
                    let (verdict, out) = fx.external(hook, &err);
                    assert_eq!(verdict, hook.pass(), "{what}");
                    assert_eq!(out.len(), err.len(), "{what}");
                    let (src, dst, q) = parse_error(&out, complete);
                    let want_src = if from == p.dst { vip } else { from };
                    assert_eq!((src, dst), (want_src, client), "{what}: outer");
                    assert_eq!(
                        (q.src, q.sport, q.dst, q.dport, q.proto),
                        (client, sport, vip, VPORT, p.proto),
                        "{what}: the quote is the client's own packet"
                    );
                    let r = fx.trace_record();
                    assert_eq!(
                        (r.verdict, r.reason, r.ct_state),
                        (
                            trace_verdict::REVERSE_NAT,
                            metrics::TC_ICMP_ERROR_REVNAT as u8,
                            trace_ct::RELATED
                        ),
                        "{what}: {r:?}"
                    );
                    translated += 1;
                }
                // The pod-facing hook, where a backend's errors arrive, does the same.
                let err = too_big(router(client), client, &quote);
                let (verdict, out) = fx.run(prog_names::TC_POD, &err);
                assert_eq!(verdict, TC_ACT_OK);
                let (_, _, q) = parse_error(&out, true);
                assert_eq!((q.dst, q.dport), (vip, VPORT));
                translated += 1;
                assert_eq!(ct_count(&mut fx), entries, "an error creates no flow");
            }
        }
    }
    assert_eq!(
        fx.counter(metrics::TC_ICMP_ERROR_REVNAT) - before,
        translated
    );
}

/// A router on the client's side that cannot pass a reply lb reverse-NATed (VIP → client)
/// sends its error to the VIP; lb hands it to the backend quoting the reply as the backend
/// sent it (backend → client), tc and XDP, IPv4 and IPv6.
#[test]
fn icmp_errors_about_reverse_nated_replies_reach_the_backend_as_its_own() {
    let mut fx = traced_fixture();
    let before = fx.counter(metrics::TC_ICMP_ERROR_FORWARD);
    let mut translated = 0;
    for (client, vip) in [
        (IpAddr::from(CLIENT4), IpAddr::from(VIP4)),
        (CLIENT6.into(), VIP6.into()),
    ] {
        for (i, (first, then)) in [(L4::TcpSyn, L4::TcpAck), (L4::Udp, L4::Udp)]
            .into_iter()
            .enumerate()
        {
            for hook in [Ext::Tc, Ext::Xdp] {
                let sport = 42_000 + i as u16 * 10 + u16::from(hook == Ext::Xdp);
                let (_, fwd) = fx.external(hook, &packet(client, sport, vip, VPORT, first));
                let backend = parse_and_verify(&fwd).dst;
                let (_, reply) = fx.run(
                    prog_names::TC_POD,
                    &packet(backend, BPORT, client, sport, then),
                );
                let r = parse_and_verify(&reply);
                assert_eq!((r.src, r.sport), (vip, VPORT));
                let err = too_big(router(client), vip, &reply[14..]);
                let what = format!("{hook:?} {client} {first:?}");
                let (verdict, out) = fx.external(hook, &err);
                assert_eq!(verdict, hook.pass(), "{what}");
                let (src, dst, q) = parse_error(&out, true);
                assert_eq!((src, dst), (router(client), backend), "{what}: outer");
                assert_eq!(
                    (q.src, q.sport, q.dst, q.dport),
                    (backend, BPORT, client, sport),
                    "{what}: the quote is the backend's own reply"
                );
                let t = fx.trace_record();
                assert_eq!(
                    (t.verdict, t.reason, t.ct_state, t.masquerade),
                    (
                        trace_verdict::FORWARD,
                        metrics::TC_ICMP_ERROR_FORWARD as u8,
                        trace_ct::RELATED,
                        0
                    ),
                    "{what}: {t:?}"
                );
                translated += 1;
            }
        }
    }
    assert_eq!(
        fx.counter(metrics::TC_ICMP_ERROR_FORWARD) - before,
        translated
    );
}

/// Masqueraded flows, both ways: an error to the node IP quoting node:NAT port → backend
/// reaches the client quoting client → VIP; an error to the VIP quoting the reverse-NATed reply
/// reaches the backend from the node IP, quoting backend → node:NAT port.
#[test]
fn icmp_errors_of_masqueraded_flows_are_translated_both_ways() {
    let mut fx = masq_fixture(
        &LoadOptions {
            trace: true,
            ..LoadOptions::default()
        },
        &POD_CIDRS,
        false,
    );
    for (client, vip) in [
        (IpAddr::from(CLIENT4), IpAddr::from(VIP4)),
        (CLIENT6.into(), VIP6.into()),
    ] {
        for (first, then) in [(L4::TcpSyn, L4::TcpAck), (L4::Udp, L4::Udp)] {
            let node = node_ip(client);
            let sport = 43_000;
            let (verdict, fwd) = fx.ingress(&packet(client, sport, vip, VPORT, first));
            assert_sent(verdict);
            let p = parse_and_verify(&fwd);
            assert_eq!(p.src, node, "masqueraded");
            let what = format!("{client} {first:?}");

            let err = too_big(router(client), node, &fwd[14..]);
            let (verdict, out) = fx.run(prog_names::TC_POD, &err);
            assert_eq!(verdict, TC_ACT_OK, "{what}");
            let (src, dst, q) = parse_error(&out, true);
            assert_eq!((src, dst), (router(client), client), "{what}: outer");
            assert_eq!(
                (q.src, q.sport, q.dst, q.dport),
                (client, sport, vip, VPORT),
                "{what}: quote"
            );

            let (_, reply) = fx.run(
                prog_names::TC_POD,
                &packet(p.dst, BPORT, node, p.sport, then),
            );
            let err = too_big(router(client), vip, &reply[14..]);
            let (verdict, out) = fx.ingress(&err);
            assert_sent(verdict);
            let (src, dst, q) = parse_error(&out, true);
            assert_eq!((src, dst), (node, p.dst), "{what}: outer, from the node");
            assert_eq!(
                (q.src, q.sport, q.dst, q.dport),
                (p.dst, BPORT, node, p.sport),
                "{what}: quote"
            );
            let t = fx.trace_record();
            assert_eq!((t.masquerade, t.nat_port), (1, p.sport), "{t:?}");
        }
    }
}

/// ICMP that quotes no flow lb knows, or that is no error, passes untouched on tc and XDP and
/// creates no flow: an error quoting an unknown flow, one quoting a later fragment, one cut
/// inside the quoted L4 header, an echo request to a VIP, a time-exceeded quoting an unknown
/// IPv6 flow.
#[test]
fn icmp_not_quoting_a_known_flow_passes_untouched() {
    let mut fx = traced_fixture();
    let (_, fwd) = fx.ingress(&packet(CLIENT4.into(), 44_000, VIP4.into(), VPORT, L4::Udp));
    let backend = parse_and_verify(&fwd).dst;
    let entries = ct_count(&mut fx);
    let unknown = packet(CLIENT4.into(), 44_001, backend, BPORT, L4::Udp);
    let mut later_fragment = fwd[14..].to_vec();
    later_fragment[6] = 0x00;
    later_fragment[7] = 0x10;
    // To an address that is no service (a service address answers: `echo_requests_…`).
    let mut echo = Vec::new();
    PacketBuilder::ethernet2(MAC_A, MAC_B)
        .ipv4(CLIENT4.octets(), ROUTER4.octets(), 64)
        .icmpv4_echo_request(7, 1)
        .write(&mut echo, b"ping")
        .unwrap();
    let unknown6 = packet(CLIENT6.into(), 44_002, BACKENDS6[0].into(), BPORT, L4::Udp);
    let mut time_exceeded6 = Vec::new();
    PacketBuilder::ethernet2(MAC_A, MAC_B)
        .ipv6(ROUTER6.octets(), CLIENT6.octets(), 64)
        .icmpv6(Icmpv6Type::TimeExceeded(
            etherparse::icmpv6::TimeExceededCode::HopLimitExceeded,
        ))
        .write(&mut time_exceeded6, &unknown6[14..])
        .unwrap();
    let cases = [
        (
            "unknown flow",
            too_big(ROUTER4.into(), CLIENT4.into(), &unknown[14..]),
        ),
        (
            "later fragment",
            too_big(ROUTER4.into(), CLIENT4.into(), &later_fragment),
        ),
        (
            "quote cut in its ports",
            too_big(ROUTER4.into(), CLIENT4.into(), &fwd[14..14 + 20 + 6]),
        ),
        ("echo request", echo),
        ("unknown IPv6 flow", time_exceeded6),
    ];
    for (what, pkt) in cases {
        for hook in [Ext::Tc, Ext::Xdp] {
            let (verdict, out) = fx.external(hook, &pkt);
            assert_eq!(verdict, hook.pass(), "{what} {hook:?}");
            assert_eq!(out, pkt, "{what} {hook:?}: untouched");
        }
    }
    assert_eq!(ct_count(&mut fx), entries, "no flow created");
}

/// An echo request from `src` to `dst` (identifier 7, sequence 1, payload `ping me`), with a
/// TTL / hop limit of 60.
fn echo_request(src: IpAddr, dst: IpAddr) -> Vec<u8> {
    let eth = PacketBuilder::ethernet2(MAC_A, MAC_B);
    let mut buf = Vec::new();
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => eth
            .ipv4(s.octets(), d.octets(), 60)
            .icmpv4_echo_request(7, 1)
            .write(&mut buf, b"ping me"),
        (IpAddr::V6(s), IpAddr::V6(d)) => eth
            .ipv6(s.octets(), d.octets(), 60)
            .icmpv6_echo_request(7, 1)
            .write(&mut buf, b"ping me"),
        _ => panic!("mixed families"),
    }
    .expect("build echo request");
    buf
}

/// Checks `out` is the echo reply to `echo_request(client, addr)`: MACs and addresses
/// swapped, TTL 64, identifier, sequence and payload kept, every checksum valid (etherparse's
/// and a full recomputation).
fn assert_echo_reply(out: &[u8], client: IpAddr, addr: IpAddr, what: &str) {
    assert_eq!(&out[..6], &MAC_A, "{what}: destination MAC");
    assert_eq!(&out[6..12], &MAC_B, "{what}: source MAC");
    let h = PacketHeaders::from_ethernet_slice(out).expect("reply parses");
    let payload = h.payload.slice();
    assert_eq!(payload, b"ping me", "{what}: payload");
    let echo = etherparse::IcmpEchoHeader { id: 7, seq: 1 };
    let (src, dst): (IpAddr, IpAddr) = match (&h.net, &h.transport) {
        (Some(NetHeaders::Ipv4(ip, _)), Some(TransportHeader::Icmpv4(icmp))) => {
            assert_eq!(
                ip.header_checksum,
                ip.calc_header_checksum(),
                "{what}: IPv4"
            );
            assert_eq!(ip.time_to_live, 64, "{what}: TTL");
            assert_eq!(icmp.icmp_type, Icmpv4Type::EchoReply(echo), "{what}");
            assert_eq!(
                icmp.checksum,
                icmp.icmp_type.calc_checksum(payload),
                "{what}"
            );
            (ip.source.into(), ip.destination.into())
        }
        (Some(NetHeaders::Ipv6(ip, _)), Some(TransportHeader::Icmpv6(icmp))) => {
            assert_eq!(ip.hop_limit, 64, "{what}: hop limit");
            assert_eq!(icmp.icmp_type, Icmpv6Type::EchoReply(echo), "{what}");
            let want = icmp
                .icmp_type
                .calc_checksum(ip.source, ip.destination, payload)
                .unwrap();
            assert_eq!(icmp.checksum, want, "{what}: ICMPv6 checksum");
            (ip.source.into(), ip.destination.into())
        }
        other => panic!("{what}: not an echo reply: {other:?}"),
    };
    assert_eq!((src, dst), (addr, client), "{what}: addresses");
    let l3 = if src.is_ipv4() { 20 } else { 40 };
    let icmp = &out[14 + l3..];
    let pseudo = match (src, dst) {
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            ones_sum(&s.octets()) + ones_sum(&d.octets()) + 58 + icmp.len() as u32
        }
        _ => 0,
    };
    assert_eq!(
        fold(pseudo + ones_sum(icmp)),
        0xffff,
        "{what}: ICMP checksum"
    );
}

/// A ping to a service address gets what the address's traffic gets, per client scope: an
/// answer from the datapath while a frontend there has a usable backend (tc, XDP with XDP_TX,
/// pod hook), a REJECT (ICMP unreachable, tc; XDP hands it to tc) when none has an endpoint at
/// all, a DROP when its endpoints are all elsewhere (`EMPTY_DROP`); anything else passes
/// untouched, as every echo does with `--no-echo-reply`. The answer follows the backends: the
/// last one gone, the address rejects. No conntrack entry is made.
#[test]
fn echo_requests_to_service_addresses_get_the_addresses_verdict() {
    let mut fx = traced_fixture();
    let lb4: IpAddr = Ipv4Addr::new(198, 19, 1, 20).into();
    let lb6: IpAddr = Ipv6Addr::new(0x2001, 0xdb8, 0xffff, 1, 0, 0, 0, 0x20).into();
    let mut desired = fx.desired.clone();
    for lb in [lb4, lb6] {
        let (fe, mut elsewhere) = service(lb, Proto::Tcp, &[]);
        elsewhere.flags = svc_flags::LOAD_BALANCER | svc_flags::EXT_LOCAL | svc_flags::EMPTY_DROP;
        desired.services.insert(fe, elsewhere);
    }
    let report = fx._reconciler.apply(&desired);
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    let entries = ct_count(&mut fx);
    let answered = fx.counter(metrics::TC_ECHO_REPLY);
    let mut replies = 0;

    for (client, vip, empty, lb, other) in [
        (
            CLIENT4.into(),
            VIP4.into(),
            EMPTY_VIP4.into(),
            lb4,
            ROUTER4.into(),
        ),
        (
            CLIENT6.into(),
            VIP6.into(),
            EMPTY_VIP6.into(),
            lb6,
            ROUTER6.into(),
        ),
    ] {
        let (client, vip, empty, other): (IpAddr, IpAddr, IpAddr, IpAddr) =
            (client, vip, empty, other);
        // Answered, on every ingress hook.
        let ping = echo_request(client, vip);
        let (verdict, out) = fx.ingress(&ping);
        assert_eq!(verdict, TC_ACT_REDIRECT, "{vip} tc");
        assert_echo_reply(&out, client, vip, "tc");
        assert_eq!(fx.trace_record().verdict, trace_verdict::ECHO_REPLY);
        assert_eq!(fx.trace_record().scope, scope::EXTERNAL);
        let (verdict, out) = fx.xdp(&ping);
        assert_eq!(verdict, 3, "{vip} XDP_TX");
        assert_echo_reply(&out, client, vip, "xdp");
        let (verdict, out) = fx.run(prog_names::TC_POD, &ping);
        assert_eq!(verdict, TC_ACT_REDIRECT, "{vip} pod");
        assert_echo_reply(&out, client, vip, "pod");
        assert_eq!(fx.trace_record().scope, scope::INTERNAL);
        replies += 3;

        // No endpoint at all: rejected as the service's traffic is (tc; XDP leaves it to tc).
        let ping = echo_request(client, empty);
        let (verdict, out) = fx.ingress(&ping);
        assert_eq!(verdict, TC_ACT_REDIRECT, "{empty} tc");
        let h = PacketHeaders::from_ethernet_slice(&out).expect("reject parses");
        let unreachable = match &h.transport {
            Some(TransportHeader::Icmpv4(i)) => matches!(
                i.icmp_type,
                Icmpv4Type::DestinationUnreachable(DestUnreachableHeader::Port)
            ),
            Some(TransportHeader::Icmpv6(i)) => matches!(
                i.icmp_type,
                Icmpv6Type::DestinationUnreachable(DestUnreachableCode::Port)
            ),
            _ => false,
        };
        assert!(unreachable, "{empty}: {:?}", h.transport);
        assert_eq!(fx.trace_record().verdict, trace_verdict::REJECT);
        let (verdict, out) = fx.xdp(&ping);
        assert_eq!((verdict, out), (XDP_PASS, ping), "{empty} xdp");

        // Endpoints only elsewhere: dropped.
        let ping = echo_request(client, lb);
        assert_eq!(fx.ingress(&ping).0, TC_ACT_SHOT, "{lb} tc");
        assert_eq!(
            fx.trace_record().reason,
            metrics::TC_DROP_NO_LOCAL_BACKEND as u8
        );
        assert_eq!(fx.xdp(&ping).0, XDP_DROP, "{lb} xdp");

        // Not a service address.
        let ping = echo_request(client, other);
        for hook in [Ext::Tc, Ext::Xdp] {
            let (verdict, out) = fx.external(hook, &ping);
            assert_eq!(
                (verdict, out),
                (hook.pass(), ping.clone()),
                "{other} {hook:?}"
            );
        }
    }
    assert_eq!(fx.counter(metrics::TC_ECHO_REPLY) - answered, replies);
    assert_eq!(ct_count(&mut fx), entries, "no flow created");

    // The last backend gone, the address rejects.
    let mut gone = desired.clone();
    for (fe, e) in gone.services.iter_mut() {
        if fe.l4.addr == IpAddr::from(VIP4) {
            e.backends.clear();
        }
    }
    let report = fx._reconciler.apply(&gone);
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    let ping = echo_request(CLIENT4.into(), VIP4.into());
    assert_eq!(fx.ingress(&ping).0, TC_ACT_REDIRECT);
    assert_eq!(fx.trace_record().verdict, trace_verdict::REJECT);
    let report = fx._reconciler.apply(&desired);
    assert!(report.errors.is_empty(), "{:?}", report.errors);

    // `--no-echo-reply`: every echo passes untouched.
    let map = fx.datapath.ebpf_mut().map_mut(map_names::CONFIG).unwrap();
    let mut config = Array::<_, LbConfig>::try_from(map).unwrap();
    let mut c = config.get(&0, 0).unwrap();
    c.flags |= lb_common::config_flags::NO_ECHO_REPLY;
    config.set(0, c, 0).unwrap();
    for dst in [VIP4.into(), EMPTY_VIP4.into(), lb4] {
        let ping = echo_request(CLIENT4.into(), dst);
        for hook in [Ext::Tc, Ext::Xdp] {
            let (verdict, out) = fx.external(hook, &ping);
            assert_eq!(
                (verdict, out),
                (hook.pass(), ping.clone()),
                "{dst} {hook:?}"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Fragments and IPv6 extension headers.

/// Splits the IP datagram in `frame` into fragments of at most `chunk` L4 bytes (a multiple
/// of 8), as a router does: IPv4 with MF and offsets, IPv6 with a fragment header; `id`
/// identifies the datagram.
fn fragment(frame: &[u8], chunk: usize, id: u32) -> Vec<Vec<u8>> {
    assert_eq!(chunk % 8, 0);
    let eth = &frame[..14];
    let v4 = frame[12..14] == [0x08, 0x00];
    let (ip, l4) = if v4 {
        (&frame[14..34], &frame[34..])
    } else {
        (&frame[14..54], &frame[54..])
    };
    let parts: Vec<&[u8]> = l4.chunks(chunk).collect();
    let mut out = Vec::new();
    for (i, part) in parts.iter().enumerate() {
        let more = u16::from(i + 1 < parts.len());
        let off = (i * chunk / 8) as u16;
        let mut f = eth.to_vec();
        let mut h = ip.to_vec();
        if v4 {
            h[2..4].copy_from_slice(&((20 + part.len()) as u16).to_be_bytes());
            h[4..6].copy_from_slice(&(id as u16).to_be_bytes());
            h[6..8].copy_from_slice(&((more << 13) | off).to_be_bytes());
            h[10..12].copy_from_slice(&[0, 0]);
            let c = !fold(ones_sum(&h));
            h[10..12].copy_from_slice(&c.to_be_bytes());
            f.extend_from_slice(&h);
        } else {
            let next = h[6];
            h[6] = 44;
            h[4..6].copy_from_slice(&((8 + part.len()) as u16).to_be_bytes());
            f.extend_from_slice(&h);
            f.extend_from_slice(&[next, 0]);
            f.extend_from_slice(&((off << 3) | more).to_be_bytes());
            f.extend_from_slice(&id.to_be_bytes());
        }
        f.extend_from_slice(part);
        out.push(f);
    }
    out
}

/// Puts translated fragments back together into one frame, checking that every fragment
/// carries the same addresses (and, IPv4, a valid header checksum); the L4 checksum of the
/// result is the caller's to verify.
fn reassemble(frags: &[Vec<u8>]) -> Vec<u8> {
    let v4 = frags[0][12..14] == [0x08, 0x00];
    let (addrs, hlen) = if v4 { (26..34, 34) } else { (22..54, 62) };
    let mut l4 = Vec::new();
    for f in frags {
        assert_eq!(f[addrs.clone()], frags[0][addrs.clone()], "fragments agree");
        if v4 {
            assert_eq!(fold(ones_sum(&f[14..34])), 0xffff, "fragment IPv4 checksum");
        }
        l4.extend_from_slice(&f[hlen..]);
    }
    let mut out = frags[0][..14].to_vec();
    if v4 {
        let mut h = frags[0][14..34].to_vec();
        h[2..4].copy_from_slice(&((20 + l4.len()) as u16).to_be_bytes());
        h[6..8].copy_from_slice(&[0x40, 0]);
        h[10..12].copy_from_slice(&[0, 0]);
        let c = !fold(ones_sum(&h));
        h[10..12].copy_from_slice(&c.to_be_bytes());
        out.extend_from_slice(&h);
    } else {
        let mut h = frags[0][14..54].to_vec();
        h[6] = frags[0][54];
        h[4..6].copy_from_slice(&(l4.len() as u16).to_be_bytes());
        out.extend_from_slice(&h);
    }
    out.extend_from_slice(&l4);
    out
}

/// A UDP datagram beyond the MTU, fragmented, through tc and XDP, IPv4 and IPv6: its first
/// fragment is balanced, every later one follows it to the same backend with only its
/// addresses rewritten, and the reassembled datagram's checksum is valid; the backend's
/// fragmented reply comes back from the VIP the same way. A later fragment before its first
/// passes untouched (counted); one of a datagram whose first fragment was rejected passes
/// untouched too and creates no flow.
#[test]
fn fragments_follow_their_first_fragment_both_ways() {
    let mut fx = traced_fixture();
    let payload = vec![0x5a; 3000];
    let mut id = 0x100;
    for (client, vip) in [
        (IpAddr::from(CLIENT4), IpAddr::from(VIP4)),
        (CLIENT6.into(), VIP6.into()),
    ] {
        for hook in [Ext::Tc, Ext::Xdp] {
            let what = format!("{hook:?} {client}");
            let sport = 45_000 + u16::from(hook == Ext::Xdp);
            id += 1;
            let frags = fragment(
                &packet_with(client, sport, vip, VPORT, L4::Udp, &payload),
                1232,
                id,
            );
            assert_eq!(frags.len(), 3);
            let mut out = Vec::new();
            for (i, f) in frags.iter().enumerate() {
                let (verdict, o) = fx.external(hook, f);
                assert_eq!(verdict, hook.pass(), "{what} fragment {i}");
                let r = fx.trace_record();
                let (want_frag, want_ct) = if i == 0 {
                    (trace_frag::FIRST, trace_ct::NEW)
                } else {
                    (trace_frag::LATER, trace_ct::ESTABLISHED)
                };
                assert_eq!(
                    (r.verdict, r.frag, r.ct_state),
                    (trace_verdict::FORWARD, want_frag, want_ct),
                    "{what} fragment {i}: {r:?}"
                );
                out.push(o);
            }
            let whole = reassemble(&out);
            etherparse_checksums_ok(&whole);
            let p = parse_and_verify(&whole);
            assert_eq!((p.src, p.sport), (client, sport), "{what}");
            assert!(backends_of(vip).contains(&p.dst), "{what}: {}", p.dst);
            assert_eq!(p.dport, BPORT, "{what}");

            id += 1;
            let reply = fragment(
                &packet_with(p.dst, BPORT, client, sport, L4::Udp, &payload),
                1232,
                id,
            );
            let back: Vec<Vec<u8>> = reply
                .iter()
                .map(|f| {
                    let (verdict, o) = fx.run(prog_names::TC_POD, f);
                    assert_eq!(verdict, TC_ACT_OK, "{what} reply");
                    o
                })
                .collect();
            let whole = reassemble(&back);
            etherparse_checksums_ok(&whole);
            let r = parse_and_verify(&whole);
            assert_eq!(
                (r.src, r.sport, r.dst, r.dport),
                (vip, VPORT, client, sport),
                "{what}: the reply comes back from the VIP"
            );
        }
    }

    let before = fx.counter(metrics::TC_PASS_FRAGMENT_UNKNOWN);
    let frags = fragment(
        &packet_with(
            CLIENT4.into(),
            45_100,
            VIP4.into(),
            VPORT,
            L4::Udp,
            &payload,
        ),
        1232,
        0x1111,
    );
    for hook in [Ext::Tc, Ext::Xdp] {
        let (verdict, out) = fx.external(hook, &frags[2]);
        assert_eq!(verdict, hook.pass());
        assert_eq!(
            out, frags[2],
            "{hook:?}: a later fragment before its first is untouched"
        );
    }
    assert_eq!(fx.counter(metrics::TC_PASS_FRAGMENT_UNKNOWN) - before, 2);

    let entries = ct_count(&mut fx);
    let before = fx.counter(metrics::TC_PASS_FRAGMENT_NO_FLOW);
    let frags = fragment(
        &packet_with(
            CLIENT4.into(),
            45_200,
            EMPTY_VIP4.into(),
            VPORT,
            L4::Udp,
            &payload,
        ),
        1232,
        0x2222,
    );
    let (verdict, _) = fx.ingress(&frags[0]);
    assert_eq!(verdict, TC_ACT_REDIRECT, "the first fragment is rejected");
    for f in &frags[1..] {
        let (verdict, out) = fx.ingress(f);
        assert_eq!(verdict, TC_ACT_OK);
        assert_eq!(
            &out, f,
            "a later fragment of a rejected datagram is untouched"
        );
    }
    assert_eq!(fx.counter(metrics::TC_PASS_FRAGMENT_NO_FLOW) - before, 2);
    assert_eq!(ct_count(&mut fx), entries, "no flow created");
}

/// `frame` (IPv6) with extension headers of the given types (8 bytes each; a routing header
/// with `segments_left`) between its fixed header and its L4 header.
fn with_ext_headers(frame: &[u8], types: &[u8], segments_left: u8) -> Vec<u8> {
    let l4_proto = frame[14 + 6];
    let mut out = frame[..54].to_vec();
    out[14 + 6] = types[0];
    let plen = u16::from_be_bytes([frame[18], frame[19]]) + 8 * types.len() as u16;
    out[18..20].copy_from_slice(&plen.to_be_bytes());
    for (i, _) in types.iter().enumerate() {
        let next = types.get(i + 1).copied().unwrap_or(l4_proto);
        if types[i] == 43 {
            // Routing type 4 (segment routing), empty.
            out.extend_from_slice(&[next, 0, 4, segments_left, 0, 0, 0, 0]);
        } else {
            // One PadN option filling the 8 bytes.
            out.extend_from_slice(&[next, 0, 1, 4, 0, 0, 0, 0]);
        }
    }
    out.extend_from_slice(&frame[54..]);
    out
}

/// `frame` without the `n` 8-byte extension headers `with_ext_headers` put in.
fn without_ext_headers(frame: &[u8], n: usize) -> Vec<u8> {
    let mut out = frame[..54].to_vec();
    out[14 + 6] = frame[54 + 8 * (n - 1)];
    let plen = u16::from_be_bytes([frame[18], frame[19]]) - 8 * n as u16;
    out[18..20].copy_from_slice(&plen.to_be_bytes());
    out.extend_from_slice(&frame[54 + 8 * n..]);
    out
}

/// IPv6 packets with hop-by-hop, routing (no segments left) and destination-options headers
/// are balanced, established and reverse-NATed like any, on tc and XDP, TCP and UDP, with the
/// extension headers kept and every checksum valid (etherparse reads them with the headers,
/// full recomputation without). A routing header with segments left names a waypoint, not
/// the service: untouched.
#[test]
fn ipv6_extension_headers_are_walked_to_the_l4_header() {
    let mut fx = traced_fixture();
    let types = [0u8, 43, 60];
    for (i, (first, then)) in [(L4::TcpSyn, L4::TcpAck), (L4::Udp, L4::Udp)]
        .into_iter()
        .enumerate()
    {
        for hook in [Ext::Tc, Ext::Xdp] {
            let what = format!("{hook:?} {first:?}");
            let sport = 46_000 + i as u16 * 10 + u16::from(hook == Ext::Xdp);
            let syn = with_ext_headers(
                &packet(CLIENT6.into(), sport, VIP6.into(), VPORT, first),
                &types,
                0,
            );
            let (verdict, out) = fx.external(hook, &syn);
            assert_eq!(verdict, hook.pass(), "{what}");
            assert_eq!(out[54..78], syn[54..78], "{what}: extension headers kept");
            etherparse_checksums_ok(&out);
            let p = parse_and_verify(&without_ext_headers(&out, types.len()));
            assert_eq!((p.src, p.sport), (IpAddr::from(CLIENT6), sport), "{what}");
            assert!(backends_of(VIP6.into()).contains(&p.dst), "{what}");
            let r = fx.trace_record();
            assert_eq!(
                (r.verdict, r.ct_state, r.ext_headers),
                (trace_verdict::FORWARD, trace_ct::NEW, 3),
                "{what}: {r:?}"
            );
            let again = with_ext_headers(
                &packet(CLIENT6.into(), sport, VIP6.into(), VPORT, then),
                &types,
                0,
            );
            let (_, out) = fx.external(hook, &again);
            let q = parse_and_verify(&without_ext_headers(&out, types.len()));
            assert_eq!(q.dst, p.dst, "{what}: established");
            let reply = with_ext_headers(
                &packet(p.dst, BPORT, CLIENT6.into(), sport, then),
                &types,
                0,
            );
            let (verdict, out) = fx.run(prog_names::TC_POD, &reply);
            assert_eq!(verdict, TC_ACT_OK);
            etherparse_checksums_ok(&out);
            let r = parse_and_verify(&without_ext_headers(&out, types.len()));
            assert_eq!(
                (r.src, r.sport),
                (IpAddr::from(VIP6), VPORT),
                "{what}: reply"
            );
        }
    }
    let waypoint = with_ext_headers(
        &packet(CLIENT6.into(), 46_100, VIP6.into(), VPORT, L4::TcpSyn),
        &[43],
        1,
    );
    for hook in [Ext::Tc, Ext::Xdp] {
        let (verdict, out) = fx.external(hook, &waypoint);
        assert_eq!(verdict, hook.pass());
        assert_eq!(out, waypoint, "{hook:?}: segments left: untouched");
    }
}
