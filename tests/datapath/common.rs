//! The shared harness: the fixture, the packet builders and their independent checks, and the
//! imports every scenario module takes with `use crate::common::*`.

pub(crate) use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    sync::LazyLock,
    thread,
    time::Duration,
};

pub(crate) use aya::{
    maps::{Array, HashMap, IterableMap as _, Map, MapData, PerCpuArray},
    programs::{SchedClassifier, TestRun, TestRunOptions, Xdp},
};
pub(crate) use etherparse::{
    Icmpv4Type, Icmpv6Type, LinkHeader, NetHeaders, PacketBuilder, PacketHeaders, TransportHeader,
    icmpv4::DestUnreachableHeader, icmpv6::DestUnreachableCode,
};
pub(crate) use lb::{
    datapath::conntrack::{CtTimeouts, monotonic_secs},
    datapath::load::{Datapath, LoadOptions},
    datapath::maps::BpfMaps,
    model::{Backend, DesiredState, Frontend, L4Addr, Proto, Scope, ServiceEntry, ServicePortName},
    node::{NodeFacts, NodeFactsArgs},
    reconcile::Reconciler,
};
pub(crate) use lb_common::{
    Ct4Key, Ct4Value, Ct6Key, Ct6Value, LbConfig, MetricValue, Svc4Key, SvcValue, TraceRecord,
    ct_dir, ct_flags, map_names, metrics, prog_names, scope, svc_flags, trace_affinity, trace_ct,
    trace_frag, trace_verdict,
};

pub(crate) const TC_ACT_OK: u32 = 0;
pub(crate) const TC_ACT_SHOT: u32 = 2;
pub(crate) const TC_ACT_REDIRECT: u32 = 7;

pub(crate) const CLIENT4: Ipv4Addr = Ipv4Addr::new(198, 18, 10, 2);
pub(crate) const VIP4: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 10);
pub(crate) const EMPTY_VIP4: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 11);
pub(crate) const BACKENDS4: [Ipv4Addr; 3] = [
    Ipv4Addr::new(198, 18, 11, 2),
    Ipv4Addr::new(198, 18, 12, 2),
    Ipv4Addr::new(198, 18, 13, 2),
];
pub(crate) const CLIENT6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 0x10, 0, 0, 0, 2);
pub(crate) const VIP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0xffff, 0, 0, 0, 0, 0x10);
pub(crate) const EMPTY_VIP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0xffff, 0, 0, 0, 0, 0x11);
pub(crate) const BACKENDS6: [Ipv6Addr; 3] = [
    Ipv6Addr::new(0x2001, 0xdb8, 0, 0x11, 0, 0, 0, 2),
    Ipv6Addr::new(0x2001, 0xdb8, 0, 0x12, 0, 0, 0, 2),
    Ipv6Addr::new(0x2001, 0xdb8, 0, 0x13, 0, 0, 0, 2),
];
pub(crate) const VPORT: u16 = 80;
pub(crate) const BPORT: u16 = 8080;
/// An SCTP service whose backends listen on its own port (Diameter's): no port rewrite.
pub(crate) const SAME_PORT: u16 = 3868;

/// A conntrack value of either family (`Ct4Value`, `Ct6Value`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Ct {
    pub(crate) backend_id: u32,
    pub(crate) rev_nat_id: u32,
    pub(crate) expires: u32,
    pub(crate) flags: u16,
    pub(crate) nat_port: u16,
    pub(crate) nat_addr: IpAddr,
}

pub(crate) struct Fixture {
    pub(crate) datapath: Datapath,
    pub(crate) _reconciler: Reconciler<BpfMaps>,
    /// What the reconciler was given, for tests that add to it.
    pub(crate) desired: DesiredState,
}

pub(crate) fn service(vip: IpAddr, proto: Proto, backends: &[IpAddr]) -> (Frontend, ServiceEntry) {
    service_ports(vip, VPORT, proto, backends, BPORT)
}

pub(crate) fn service_ports(
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
                port_name: proto.to_string().to_lowercase().into(),
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
pub(crate) fn fixture() -> Fixture {
    fixture_with(&LoadOptions::default())
}

/// `fixture()` with the tc programs writing their decision into `lb_trace`.
pub(crate) fn traced_fixture() -> Fixture {
    fixture_with(&LoadOptions {
        trace: true,
        ..LoadOptions::default()
    })
}

pub(crate) fn fixture_with(opts: &LoadOptions) -> Fixture {
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
    pub(crate) fn run(&mut self, prog: &str, pkt: &[u8]) -> (u32, Vec<u8>) {
        self.try_run(prog, pkt).expect("BPF_PROG_TEST_RUN")
    }

    pub(crate) fn try_run(
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

    pub(crate) fn ingress(&mut self, pkt: &[u8]) -> (u32, Vec<u8>) {
        self.run(prog_names::TC_INGRESS, pkt)
    }

    /// `pkt` through `lb_xdp`: its verdict and the frame it leaves.
    pub(crate) fn xdp(&mut self, pkt: &[u8]) -> (u32, Vec<u8>) {
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
    pub(crate) fn external(&mut self, hook: Ext, pkt: &[u8]) -> (u32, Vec<u8>) {
        match hook {
            Ext::Tc => self.ingress(pkt),
            Ext::Xdp => self.xdp(pkt),
        }
    }

    /// `lb4_ct_tcp`.
    pub(crate) fn ct4(&mut self) -> HashMap<&mut MapData, Ct4Key, Ct4Value> {
        self.ct4_of(6)
    }

    /// The IPv4 conntrack map of `proto`: `lb4_ct_tcp` or `lb4_ct_any`.
    pub(crate) fn ct4_of(&mut self, proto: u8) -> HashMap<&mut MapData, Ct4Key, Ct4Value> {
        let name = if proto == 6 {
            map_names::CT_TCP4
        } else {
            map_names::CT_ANY4
        };
        HashMap::try_from(self.datapath.ebpf_mut().map_mut(name).expect(name)).expect("ct map")
    }

    /// The IPv6 conntrack map of `proto`.
    pub(crate) fn ct6_of(&mut self, proto: u8) -> HashMap<&mut MapData, Ct6Key, Ct6Value> {
        let name = if proto == 6 {
            map_names::CT_TCP6
        } else {
            map_names::CT_ANY6
        };
        HashMap::try_from(self.datapath.ebpf_mut().map_mut(name).expect(name)).expect("ct map")
    }

    /// The conntrack entry of `saddr:sport -> daddr:dport` (`proto`) in direction `dir`.
    pub(crate) fn ct_entry(
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
    pub(crate) fn trace_record(&mut self) -> TraceRecord {
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
    pub(crate) fn counter(&mut self, index: u32) -> u64 {
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
    pub(crate) fn services4(&self) -> HashMap<MapData, Svc4Key, SvcValue> {
        let id = self._reconciler.maps().services4.map().info().unwrap().id();
        HashMap::try_from(Map::HashMap(MapData::from_id(id).unwrap())).unwrap()
    }
}

/// Key of VIP4's TCP frontend (external scope) at `slot`.
pub(crate) fn vip4_tcp(slot: u16) -> Svc4Key {
    Svc4Key {
        addr: VIP4.octets(),
        port: VPORT,
        slot,
        proto: 6,
        scope: scope::EXTERNAL,
        pad: [0; 2],
    }
}

// Packet building and independent verification (full recomputation, not incremental).

pub(crate) const MAC_A: [u8; 6] = [0x02, 0, 0, 0, 0, 1];
pub(crate) const MAC_B: [u8; 6] = [0x02, 0, 0, 0, 0, 2];
pub(crate) const PAYLOAD: &[u8] = b"hello lb\n";

#[derive(Clone, Copy, Debug)]
pub(crate) enum L4 {
    TcpSyn,
    TcpAck,
    TcpFin,
    TcpRst,
    Udp,
}

pub(crate) fn packet(src: IpAddr, sport: u16, dst: IpAddr, dport: u16, l4: L4) -> Vec<u8> {
    packet_with(src, sport, dst, dport, l4, PAYLOAD)
}

pub(crate) fn packet_with(
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

pub(crate) fn ones_sum(data: &[u8]) -> u32 {
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

pub(crate) fn fold(mut sum: u32) -> u16 {
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    sum as u16
}

/// What a test needs from a parsed packet; checksums are verified while parsing.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Parsed {
    pub(crate) src: IpAddr,
    pub(crate) sport: u16,
    pub(crate) dst: IpAddr,
    pub(crate) dport: u16,
    pub(crate) proto: u8,
    pub(crate) l4_csum: u16,
}

pub(crate) fn parse_and_verify(pkt: &[u8]) -> Parsed {
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

pub(crate) fn backends_of(vip: IpAddr) -> Vec<IpAddr> {
    match vip {
        IpAddr::V4(_) => BACKENDS4.iter().map(|a| (*a).into()).collect(),
        IpAddr::V6(_) => BACKENDS6.iter().map(|a| (*a).into()).collect(),
    }
}

/// The programs of an external device: tc ingress, or XDP (which runs the same pipeline).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Ext {
    Tc,
    Xdp,
}

impl Ext {
    /// The verdict that hands a packet on to the stack.
    pub(crate) fn pass(self) -> u32 {
        match self {
            Ext::Tc => TC_ACT_OK,
            Ext::Xdp => XDP_PASS,
        }
    }
}

pub(crate) const XDP_PASS: u32 = 2;
pub(crate) const XDP_DROP: u32 = 1;

/// New flows are DNATed to a backend with valid checksums; further packets of the flow stay on
/// it; the backend's reply is reverse-NATed to come from the VIP; new flows reach every backend.
pub(crate) fn forward_and_reply(client: IpAddr, vip: IpAddr, first: L4, then: L4) {
    forward_and_reply_on(Ext::Tc, client, vip, first, then);
}

/// `forward_and_reply` through the external hook `hook`.
pub(crate) fn forward_and_reply_on(hook: Ext, client: IpAddr, vip: IpAddr, first: L4, then: L4) {
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
