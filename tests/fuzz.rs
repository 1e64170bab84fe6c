//! Datapath fuzzing: random and mutated frames through every packet program (lb_xdp,
//! lb_tc_ingress, lb_tc_pod, lb_tc_egress) with BPF_PROG_TEST_RUN, each result checked against
//! the invariants in `fuzz/check.rs`. The real loader and maps, programmed by the real
//! reconciler, in two configurations: ClusterIPs without masquerade, and `--masquerade-all`
//! with node IPs, service CIDRs and a LoadBalancer IP with source ranges. Needs root.
//!
//! `cargo test` runs the quick form (`QUICK_PACKETS`); `cargo xtask fuzz` the full one.
//! `LB_FUZZ_SEED` replays a run (the generated frames are the same; backend and NAT-port
//! choices are the kernel's random ones), `LB_FUZZ_PACKETS` sets how many frames.
#[path = "fuzz/check.rs"]
mod check;
#[path = "fuzz/packets.rs"]
mod packets;
#[path = "support/progrun.rs"]
mod progrun;

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    time::Instant,
};

use check::{Flows, Model, Outcome, Service};
use lb::{
    model::{Backend, DesiredState, Frontend, L4Addr, Proto, ServiceEntry, ServicePortName},
    node::NodeFactsArgs,
};
use lb_common::{ct_dir, ct_flags, svc_flags};
use packets::{
    Frame, ICMP, ICMPV6, Rng, SCTP, TCP, TCP_ACK, TCP_FIN, TCP_PSH, TCP_RST, TCP_SYN, UDP,
};
use progrun::{Loaded, Prog};

/// Frames of the quick form (split over the two configurations), each through all four
/// programs.
const QUICK_PACKETS: u64 = 30_000;

const VIP4: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 10);
const EMPTY_VIP4: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 11);
const LB_IP4: Ipv4Addr = Ipv4Addr::new(198, 19, 1, 42);
const VIP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0xffff, 0, 0, 0, 0, 0x10);
const EMPTY_VIP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0xffff, 0, 0, 0, 0, 0x11);
const NODE4: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 1);
const NODE6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 1);
const VPORT: u16 = 80;
const BPORT: u16 = 8080;
/// SCTP (Diameter) with backends on the same port: no port rewrite.
const SAME_PORT: u16 = 3868;

fn backends4() -> Vec<IpAddr> {
    (11..14)
        .map(|n| Ipv4Addr::new(198, 18, n, 2).into())
        .collect()
}

fn backends6() -> Vec<IpAddr> {
    (0x11..0x14)
        .map(|n| Ipv6Addr::new(0x2001, 0xdb8, 0, n, 0, 0, 0, 2).into())
        .collect()
}

fn svc(vip: impl Into<IpAddr>, port: u16, proto: u8, backends: &[IpAddr], bport: u16) -> Service {
    Service {
        vip: vip.into(),
        port,
        proto,
        backends: backends.iter().map(|b| (*b, bport)).collect(),
        cluster_ip: true,
        source_ranges: Vec::new(),
    }
}

/// ClusterIPs of every protocol, with and without backends; no masquerade.
fn plain() -> Model {
    let (b4, b6) = (backends4(), backends6());
    let mut services = Vec::new();
    for (vip, empty, b) in [
        (IpAddr::from(VIP4), IpAddr::from(EMPTY_VIP4), &b4),
        (VIP6.into(), EMPTY_VIP6.into(), &b6),
    ] {
        for proto in [TCP, UDP, SCTP] {
            services.push(svc(vip, VPORT, proto, b, BPORT));
        }
        services.push(svc(vip, SAME_PORT, SCTP, b, SAME_PORT));
        services.push(svc(empty, VPORT, TCP, &[], BPORT));
        services.push(svc(empty, VPORT, UDP, &[], BPORT));
    }
    Model {
        name: "cluster-ips",
        services,
        service_cidrs: Vec::new(),
        node_ips: Vec::new(),
    }
}

/// `--masquerade-all` with node IPs, service CIDRs around the ClusterIPs, and a LoadBalancer
/// IP that only 198.18.99.0/24 may open flows to.
fn masquerade() -> Model {
    let (b4, b6) = (backends4(), backends6());
    let mut services = Vec::new();
    for (vip, empty, b) in [
        (IpAddr::from(VIP4), IpAddr::from(EMPTY_VIP4), &b4),
        (VIP6.into(), EMPTY_VIP6.into(), &b6),
    ] {
        for proto in [TCP, UDP, SCTP] {
            services.push(svc(vip, VPORT, proto, b, BPORT));
        }
        services.push(svc(empty, VPORT, TCP, &[], BPORT));
        services.push(svc(empty, VPORT, UDP, &[], BPORT));
    }
    services.push(Service {
        cluster_ip: false,
        source_ranges: vec![(Ipv4Addr::new(198, 18, 99, 0).into(), 24)],
        ..svc(LB_IP4, VPORT, TCP, &b4, BPORT)
    });
    Model {
        name: "masquerade-all",
        services,
        service_cidrs: vec![
            (Ipv4Addr::new(198, 19, 0, 0).into(), 24),
            (
                Ipv6Addr::new(0x2001, 0xdb8, 0xffff, 0, 0, 0, 0, 0).into(),
                112,
            ),
        ],
        node_ips: vec![NODE4.into(), NODE6.into()],
    }
}

/// The desired state and node facts that program `model` into the maps.
fn programmed(model: &Model) -> (DesiredState, Option<NodeFactsArgs>) {
    let mut desired = DesiredState::default();
    for (i, s) in model.services.iter().enumerate() {
        let proto = match s.proto {
            TCP => Proto::Tcp,
            UDP => Proto::Udp,
            _ => Proto::Sctp,
        };
        let entry = ServiceEntry {
            name: ServicePortName {
                namespace: "fuzz".into(),
                name: format!("svc{i}").into(),
                port_name: "p".into(),
            },
            // Every other service (not the first, the TCP one the reopen tests use) has session
            // affinity, so fuzzed new flows walk that path too.
            flags: if s.cluster_ip {
                svc_flags::CLUSTER_IP
            } else {
                svc_flags::LOAD_BALANCER | svc_flags::SOURCE_RANGES
            } | if i % 2 == 1 { svc_flags::AFFINITY } else { 0 },
            affinity_timeout: if i % 2 == 1 { 60 } else { 0 },
            backends: s
                .backends
                .iter()
                .map(|&(addr, port)| Backend::active(L4Addr { addr, port, proto }))
                .collect(),
            source_ranges: s
                .source_ranges
                .iter()
                .map(|(net, len)| format!("{net}/{len}").parse().expect("CIDR"))
                .collect(),
            ..ServiceEntry::default()
        };
        desired
            .services
            .insert(Frontend::new(s.vip, s.port, proto), entry);
    }
    let facts = model.masquerades().then(|| NodeFactsArgs {
        node_ip: model.node_ips.clone(),
        masquerade_all: true,
        ..NodeFactsArgs::default()
    });
    (desired, facts)
}

// ---------------------------------------------------------------------------------------------
// The generator.

struct Gen<'a> {
    rng: Rng,
    model: &'a Model,
}

impl Gen<'_> {
    fn client(&mut self, v6: bool) -> IpAddr {
        let n = self.rng.range(2, 5) as u8;
        match (v6, self.rng.pct(10)) {
            (false, true) => Ipv4Addr::new(198, 18, 99, n).into(),
            (false, false) => Ipv4Addr::new(198, 18, 10, n).into(),
            (true, _) => Ipv6Addr::new(0x2001, 0xdb8, 0, 0x10, 0, 0, 0, u16::from(n)).into(),
        }
    }

    fn client_port(&mut self) -> u16 {
        if self.rng.pct(90) {
            40_000 + self.rng.below(32) as u16
        } else {
            self.rng.u16()
        }
    }

    /// Anywhere in the documentation ranges, now and then a service-CIDR address.
    fn random_addr(&mut self, v6: bool) -> IpAddr {
        match (v6, self.rng.pct(15)) {
            (false, true) => Ipv4Addr::new(198, 19, 0, self.rng.range(100, 250) as u8).into(),
            (false, false) => Ipv4Addr::from(0xc612_0000 | (self.rng.u32() & 0x1_ffff)).into(),
            (true, true) => {
                Ipv6Addr::new(0x2001, 0xdb8, 0xffff, 0, 0, 0, 0, self.rng.u16() | 0x100).into()
            }
            (true, false) => {
                Ipv6Addr::from((0x2001_0db8u128 << 96) | u128::from(self.rng.next_u64())).into()
            }
        }
    }

    fn payload(&mut self) -> Vec<u8> {
        let n = match self.rng.below(100) {
            0..70 => self.rng.range(0, 64),
            70..95 => self.rng.range(64, 600),
            _ => self.rng.range(600, 1400),
        };
        self.rng.bytes(n)
    }

    /// An L4 packet of `proto` (checksum zero, filled in by `Frame`).
    fn l4(&mut self, proto: u8, sport: u16, dport: u16) -> Vec<u8> {
        match proto {
            TCP => {
                let flags = *self.rng.pick(&[
                    TCP_SYN,
                    TCP_SYN,
                    TCP_ACK,
                    TCP_PSH | TCP_ACK,
                    TCP_FIN | TCP_ACK,
                    TCP_RST,
                    TCP_RST | TCP_ACK,
                    TCP_SYN | TCP_ACK,
                    0,
                    0xff,
                ]);
                let opts = if self.rng.pct(30) {
                    let n = self.rng.range(1, 40);
                    self.rng.bytes(n)
                } else {
                    Vec::new()
                };
                let payload = self.payload();
                packets::tcp(sport, dport, flags, &opts, &payload, &mut self.rng)
            }
            UDP => {
                let payload = self.payload();
                packets::udp(sport, dport, &payload)
            }
            _ => {
                let chunk = *self.rng.pick(&[1, 0, 0, 6, 14, 0xff, 3, 10]);
                let n = self.rng.range(0, 300);
                packets::sctp(sport, dport, chunk, n, &mut self.rng)
            }
        }
    }

    /// A frame of `l4` from `src` to `dst`, sometimes with IPv4 options, a zero or wrong
    /// checksum, a low TTL.
    fn frame(&mut self, src: IpAddr, dst: IpAddr, proto: u8, mut l4: Vec<u8>) -> Vec<u8> {
        let mut f = Frame::new(src, dst, proto);
        if src.is_ipv4() && self.rng.pct(12) {
            f.v4_opts = packets::v4_options(&mut self.rng);
        }
        if self.rng.pct(8) {
            f.ttl = self.rng.below(3) as u8;
        }
        match self.rng.below(100) {
            // No checksum: UDP's "none" (invalid for IPv6), SCTP's offloaded CRC.
            0..6 if proto == UDP || proto == SCTP => f.keep_l4_csum = true,
            6..12 => {
                packets::fill_l4_csum(src, dst, proto, &mut l4);
                let off = match proto {
                    TCP => 16,
                    UDP => 6,
                    _ => 8,
                };
                if let Some(b) = l4.get_mut(off) {
                    *b ^= self.rng.range(1, 255) as u8;
                }
                f.keep_l4_csum = true;
            }
            _ => {}
        }
        f.build(&l4)
    }

    /// A frame to one of the model's frontends (with backends or not) from a client, now and
    /// then from a backend (hairpin).
    fn service_frame(&mut self) -> (Frame, Vec<u8>) {
        let s = self.rng.pick(&self.model.services).clone();
        let v6 = s.vip.is_ipv6();
        let src = match s.backends.first() {
            Some(_) if self.rng.pct(5) => self.rng.pick(&s.backends).0,
            _ => self.client(v6),
        };
        let sport = self.client_port();
        let l4 = self.l4(s.proto, sport, s.port);
        (Frame::new(src, s.vip, s.proto), l4)
    }

    /// An ICMP error quoting a packet of a flow lb opened: one it sent to the backend (from the
    /// backend itself or a router, to the client or the node it came from), or a reply it
    /// reverse-NATed (from a router, to the frontend).
    fn icmp_about_a_flow(&mut self, flows: &Flows) -> Vec<u8> {
        let k = *self.rng.pick(&flows.keys);
        let v6 = k.backend.0.is_ipv6();
        let icmp_proto = if v6 { ICMPV6 } else { ICMP };
        let ((qs, qsp), (qd, qdp)) = match flows.reverse_of(&k) {
            Some(r) if self.rng.pct(50) => (r.frontend, r.client.unwrap_or(k.to)),
            _ => (k.to, k.backend),
        };
        let inner = self.l4(k.proto, qsp, qdp);
        let mut quoted = Frame::new(qs, qd, k.proto).ip_packet(&inner);
        if self.rng.pct(30) {
            let cut = self.rng.range(28, quoted.len());
            quoted.truncate(cut);
        }
        let (ty, code, rest) = if v6 {
            *self.rng.pick(&[(2, 0, 1280), (1, 4, 0), (3, 0, 0)])
        } else {
            *self.rng.pick(&[(3, 4, 1400), (3, 3, 0), (11, 0, 0)])
        };
        let m = packets::icmp(ty, code, rest, &quoted);
        let from = if self.rng.pct(50) {
            qd
        } else {
            self.random_addr(v6)
        };
        Frame::new(from, qs, icmp_proto).build(&m)
    }

    fn next(&mut self, flows: &Flows) -> (Vec<u8>, String) {
        let kind = self.rng.below(100);
        let (mut f, what) = match kind {
            0..32 => {
                let (fr, l4) = self.service_frame();
                (self.frame(fr.src, fr.dst, fr.proto, l4), "to a frontend")
            }
            32..50 if !flows.keys.is_empty() => {
                let k = *self.rng.pick(&flows.keys);
                let l4 = self.l4(k.proto, k.backend.1, k.to.1);
                (
                    self.frame(k.backend.0, k.to.0, k.proto, l4),
                    "reply of a flow",
                )
            }
            32..55 => {
                // A backend's packet to a client lb never saw: no flow.
                let s = self.rng.pick(&self.model.services).clone();
                let Some(&(b, bport)) = s.backends.first() else {
                    return self.next(flows);
                };
                let dst = self.client(b.is_ipv6());
                let dport = self.rng.u16();
                let l4 = self.l4(s.proto, bport, dport);
                (self.frame(b, dst, s.proto, l4), "from a backend, no flow")
            }
            55..62 => {
                // A ClusterIP on a port or protocol it has not.
                let s = self.rng.pick(&self.model.services).clone();
                let proto = *self.rng.pick(&[TCP, UDP, SCTP]);
                let dport = if self.rng.pct(50) {
                    VPORT + 1
                } else {
                    self.rng.u16()
                };
                let src = self.client(s.vip.is_ipv6());
                let sport = self.client_port();
                let l4 = self.l4(proto, sport, dport);
                (
                    self.frame(src, s.vip, proto, l4),
                    "to a service address, other port",
                )
            }
            62..70 => {
                let v6 = self.rng.pct(50);
                let (src, dst) = (self.random_addr(v6), self.random_addr(v6));
                let proto = *self.rng.pick(&[TCP, UDP, SCTP]);
                let dport = if self.rng.pct(30) {
                    VPORT
                } else {
                    self.rng.u16()
                };
                let sport = self.rng.u16();
                let l4 = self.l4(proto, sport, dport);
                (self.frame(src, dst, proto, l4), "unrelated")
            }
            70..78 => (self.icmp(flows), "ICMP"),
            78..84 => {
                let (mut fr, l4) = self.service_frame();
                let first = self.rng.pct(50);
                fr.frag = Some(if first {
                    (0, true)
                } else {
                    (self.rng.range(1, 180) as u16, self.rng.pct(50))
                });
                (
                    fr.build(&l4),
                    if first {
                        "first fragment"
                    } else {
                        "later fragment"
                    },
                )
            }
            84..90 => {
                let (mut fr, l4) = self.service_frame();
                if fr.src.is_ipv4() {
                    fr.v4_opts = packets::v4_options(&mut self.rng);
                    (fr.build(&l4), "IPv4 options")
                } else {
                    fr.v6_ext = packets::v6_ext_chain(&mut self.rng);
                    if fr.v6_ext.iter().any(|(t, _)| *t == 44) {
                        fr.frag = Some((self.rng.below(4) as u16, self.rng.pct(50)));
                    }
                    (fr.build(&l4), "IPv6 extension headers")
                }
            }
            90..96 => {
                let (mut fr, l4) = self.service_frame();
                let vid = self.rng.range(1, 4094) as u16;
                fr.vlans = if self.rng.pct(50) {
                    vec![(0x8100, vid)]
                } else {
                    vec![(0x88a8, vid), (0x8100, vid + 1)]
                };
                (fr.build(&l4), "VLAN tagged")
            }
            _ => {
                let n = self.rng.range(14, 200);
                let mut g = self.rng.bytes(n);
                if self.rng.pct(60) {
                    let ethertype: [u8; 2] = *self.rng.pick(&[[0x08, 0x00], [0x86, 0xdd]]);
                    g[12..14].copy_from_slice(&ethertype);
                }
                (g, "garbage")
            }
        };
        let mut what = what.to_string();
        if self.rng.pct(30) {
            for _ in 0..self.rng.range(1, 3) {
                let m = packets::mutate(&mut f, &mut self.rng);
                write!(what, ", {m}").unwrap();
            }
        }
        (f, what)
    }

    /// An echo to a service address, or an error quoting (a prefix of) service traffic in
    /// either direction.
    fn icmp(&mut self, flows: &Flows) -> Vec<u8> {
        let s = self.rng.pick(&self.model.services).clone();
        let v6 = s.vip.is_ipv6();
        let client = self.client(v6);
        let cport = self.client_port();
        let (proto, icmp_proto) = (s.proto, if v6 { ICMPV6 } else { ICMP });
        if !flows.keys.is_empty() && self.rng.pct(50) {
            return self.icmp_about_a_flow(flows);
        }
        if self.rng.pct(20) {
            let ty = if v6 { 128 } else { 8 };
            let body = self.rng.bytes(32);
            let m = packets::icmp(ty, 0, self.rng.u32(), &body);
            return Frame::new(client, s.vip, icmp_proto).build(&m);
        }
        // The quoted packet: client -> VIP, VIP -> client, backend -> client, client -> backend.
        let backend = s.backends.first().copied().unwrap_or((s.vip, s.port));
        let (qs, qd, qsp, qdp) = *self.rng.pick(&[
            (client, s.vip, cport, s.port),
            (s.vip, client, s.port, cport),
            (backend.0, client, backend.1, cport),
            (client, backend.0, cport, backend.1),
        ]);
        let inner = self.l4(proto, qsp, qdp);
        let mut quoted = Frame::new(qs, qd, proto).ip_packet(&inner);
        if self.rng.pct(50) {
            let cut = self.rng.range(1, quoted.len());
            quoted.truncate(cut);
        }
        let (ty, code) = if v6 {
            *self
                .rng
                .pick(&[(1, 4), (1, 0), (1, 3), (2, 0), (3, 0), (4, 1)])
        } else {
            *self
                .rng
                .pick(&[(3, 3), (3, 1), (3, 4), (11, 0), (12, 0), (5, 1)])
        };
        let m = packets::icmp(ty, code, if ty == 2 { 1280 } else { 0 }, &quoted);
        // From whoever was meant to get the quoted packet, or a router on the way, to its sender.
        let from = if self.rng.pct(50) {
            qd
        } else {
            self.random_addr(v6)
        };
        Frame::new(from, qs, icmp_proto).build(&m)
    }
}

// ---------------------------------------------------------------------------------------------

fn hex(b: &[u8]) -> String {
    b.iter()
        .fold(String::with_capacity(b.len() * 2), |mut s, x| {
            write!(s, "{x:02x}").unwrap();
            s
        })
}

fn env_u64(name: &str) -> Option<u64> {
    let v = std::env::var(name).ok()?;
    Some(
        v.parse()
            .unwrap_or_else(|_| panic!("{name}={v}: not a number")),
    )
}

/// Whether BPF_PROG_TEST_RUN refuses `pkt` as an skb (EINVAL) before any program sees it:
/// an IP ethertype with less than the fixed IP header behind it (newer kernels pull it).
fn kernel_refuses_skb(pkt: &[u8]) -> bool {
    match pkt[12..14] {
        [0x08, 0x00] => pkt.len() < 14 + 20,
        [0x86, 0xdd] => pkt.len() < 14 + 40,
        _ => false,
    }
}

/// Runs `packets` generated frames through the four programs of a datapath holding `model`;
/// returns the tallies (program, outcome) -> runs, or the failure report.
fn fuzz(model: &Model, seed: u64, packets: u64) -> Result<BTreeMap<(Prog, Outcome), u64>, String> {
    let (desired, facts) = programmed(model);
    let mut loaded = Loaded::new(&desired, facts.as_ref(), &model.service_cidrs);
    let mut generator = Gen {
        rng: Rng::new(seed),
        model,
    };
    let mut flows = Flows::default();
    let mut tally = BTreeMap::new();
    for i in 0..packets {
        let (pkt, what) = generator.next(&flows);
        for prog in Prog::ALL {
            let fail = |why: String, verdict: Option<u32>, out: &[u8]| {
                format!(
                    "config {}, packet {i} ({what}), program {}: {why}\n  verdict: {verdict:?}\n  \
                     input  ({} bytes): {}\n  output ({} bytes): {}",
                    model.name,
                    prog.name(),
                    pkt.len(),
                    hex(&pkt),
                    out.len(),
                    hex(out)
                )
            };
            let (verdict, out) = match loaded.run(prog, &pkt) {
                Ok(r) => r,
                Err(_) if prog != Prog::Xdp && kernel_refuses_skb(&pkt) => {
                    *tally.entry((prog, Outcome::Refused)).or_insert(0) += 1;
                    continue;
                }
                Err(e) => return Err(fail(format!("BPF_PROG_TEST_RUN failed: {e:?}"), None, &[])),
            };
            let outcome = match check::check(model, &mut flows, prog, &pkt, verdict, &out) {
                Ok(o) => o,
                Err(why) => {
                    // What conntrack holds for the frame, either way round.
                    let ct = check::parse(&pkt).map(|p| {
                        let mut t = libc::timespec {
                            tv_sec: 0,
                            tv_nsec: 0,
                        };
                        // SAFETY: `t` is a valid timespec to write to. bpf_ktime_get_ns's clock.
                        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut t) };
                        let now = t.tv_sec;
                        let key = ((p.src, p.sport), (p.dst, p.dport), p.proto);
                        format!(
                            "\n  conntrack (now {now} s): as service {:?}, as reply {:?}",
                            loaded.ct_entry(key.0, key.1, key.2, ct_dir::SERVICE),
                            loaded.ct_entry(key.0, key.1, key.2, ct_dir::REPLY)
                        )
                    });
                    return Err(fail(why, Some(verdict), &out) + &ct.unwrap_or_default());
                }
            };
            *tally.entry((prog, outcome)).or_insert(0) += 1;
        }
    }
    Ok(tally)
}

/// The outcomes each configuration must have produced somewhere: a run that never balanced,
/// reverse-NATed, rejected or dropped anything has not tested those invariants.
fn required(model: &Model) -> Vec<(Prog, Outcome)> {
    use Outcome::*;
    let mut want = vec![(Prog::TcEgress, ReverseNat), (Prog::TcEgress, Unparsed)];
    for prog in [Prog::TcIngress, Prog::TcPod] {
        want.extend([
            (prog, Reject),
            (prog, Drop),
            (prog, ReverseNat),
            (prog, Unparsed),
        ]);
        want.push((prog, if model.masquerades() { DnatSnat } else { Dnat }));
    }
    want.extend([(Prog::Xdp, ReverseNat), (Prog::Xdp, Unparsed)]);
    // Errors quoting known flows, and later fragments following their first.
    want.extend([
        (Prog::TcIngress, IcmpError),
        (Prog::TcEgress, IcmpError),
        (Prog::TcIngress, LaterFragment),
    ]);
    if !model.masquerades() {
        want.push((Prog::Xdp, Dnat));
    } else {
        // Masqueraded flows go out past the stack: the routed namespace resolves their next hop.
        want.extend([
            (Prog::Xdp, Drop),
            (Prog::Xdp, Forwarded),
            (Prog::TcIngress, Forwarded),
        ]);
    }
    want
}

#[test]
fn every_program_keeps_the_invariants_on_random_and_mutated_frames() {
    let seed = env_u64("LB_FUZZ_SEED").unwrap_or_else(|| {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap();
        t.as_nanos() as u64 ^ u64::from(std::process::id()) << 32
    });
    let packets = env_u64("LB_FUZZ_PACKETS").unwrap_or(QUICK_PACKETS);
    println!("fuzz seed: {seed} ({packets} frames; LB_FUZZ_SEED={seed} replays them)");
    let started = Instant::now();
    let models = [plain(), masquerade()];
    let mut runs = 0;
    for (n, model) in models.iter().enumerate() {
        let share = packets / 2 + if n == 0 { packets % 2 } else { 0 };
        // Each configuration its own stream, both from the one seed.
        let stream = seed ^ (n as u64).wrapping_mul(0xa076_1d64_78bd_642f);
        // The masquerade configuration runs where the backends have routes, so the forwarding
        // past the stack (XDP_REDIRECT, bpf_redirect with the next hop's MAC) runs too.
        let routed = model.masquerades();
        let run = std::thread::scope(|s| {
            s.spawn(|| {
                if routed {
                    let backends: BTreeSet<IpAddr> = model
                        .services
                        .iter()
                        .flat_map(|s| s.backends.iter().map(|b| b.0))
                        .collect();
                    progrun::enter_routed_netns(&backends.into_iter().collect::<Vec<_>>());
                }
                fuzz(model, stream, share)
            })
            .join()
            .expect("fuzz thread")
        });
        let tally = run.unwrap_or_else(|report| {
            panic!("fuzz failure, seed {seed} (LB_FUZZ_SEED={seed} LB_FUZZ_PACKETS={packets}):\n{report}")
        });
        println!("{}: {share} frames", model.name);
        for ((prog, outcome), count) in &tally {
            println!("  {:<14} {outcome:?}: {count}", prog.name());
            runs += count;
        }
        if share >= QUICK_PACKETS / 2 {
            let missing: Vec<_> = required(model)
                .into_iter()
                .filter(|k| !tally.contains_key(k))
                .collect();
            assert!(
                missing.is_empty(),
                "seed {seed}, {}: these outcomes never happened, so their invariants went \
                 untested: {missing:?}",
                model.name
            );
        }
    }
    let secs = started.elapsed().as_secs_f64();
    println!(
        "fuzz: {packets} frames, {runs} program runs in {secs:.1} s ({:.0} frames/s), seed {seed}",
        packets as f64 / secs
    );
}

/// Found by the fuzzer: a UDP frame to a frontend cut inside its header (ports there, checksum
/// not) was parsed, then dropped by XDP and tc when the checksum update failed (tc logging an
/// error per packet). It is not a frame lb can translate: every program passes it untouched.
#[test]
fn udp_header_cut_short_passes_untouched() {
    let model = plain();
    let (desired, facts) = programmed(&model);
    let mut loaded = Loaded::new(&desired, facts.as_ref(), &model.service_cidrs);
    let mut rng = Rng::new(7);
    let mut flows = Flows::default();
    for (client, vip) in [
        (
            IpAddr::from(Ipv4Addr::new(198, 18, 10, 2)),
            IpAddr::from(VIP4),
        ),
        (
            Ipv6Addr::new(0x2001, 0xdb8, 0, 0x10, 0, 0, 0, 2).into(),
            VIP6.into(),
        ),
    ] {
        let full = Frame::new(client, vip, UDP).build(&packets::udp(40_000, VPORT, &rng.bytes(9)));
        let l4 = if vip.is_ipv4() { 34 } else { 54 };
        for cut in l4 + 4..l4 + 8 {
            let pkt = &full[..cut];
            for prog in Prog::ALL {
                let (verdict, out) = loaded.run(prog, pkt).expect("BPF_PROG_TEST_RUN");
                let outcome = check::check(&model, &mut flows, prog, pkt, verdict, &out);
                assert_eq!(
                    outcome,
                    Ok(Outcome::Unparsed),
                    "{vip}, cut at {cut}, {}: verdict {verdict}",
                    prog.name()
                );
            }
        }
    }
}

/// Found by the fuzzer: after a client reopened a closing flow (a new backend or NAT port), a
/// late reply of the old flow, still reverse-NATed through its own reply entry, refreshed the
/// new flow's service entry and marked it closing. That left the new flow's reply entry
/// unrefreshed, so it expired under a live flow and its replies went out untranslated. A reply
/// entry now only touches the service entry of its own flow.
#[test]
fn late_reply_of_a_reopened_flow_leaves_the_new_flow_alone() {
    let model = plain();
    let (desired, facts) = programmed(&model);
    let mut loaded = Loaded::new(&desired, facts.as_ref(), &model.service_cidrs);
    let mut rng = Rng::new(11);
    let client = (IpAddr::from(Ipv4Addr::new(198, 18, 10, 2)), 40_100);
    let vip = (IpAddr::from(VIP4), VPORT);
    let tcp = |rng: &mut Rng, (src, sport): (IpAddr, u16), (dst, dport): (IpAddr, u16), flags| {
        Frame::new(src, dst, TCP).build(&packets::tcp(sport, dport, flags, &[], &[], rng))
    };
    let ingress = |loaded: &mut Loaded, pkt: &[u8]| {
        let (verdict, out) = loaded.run(Prog::TcIngress, pkt).expect("BPF_PROG_TEST_RUN");
        assert_eq!(verdict, progrun::TC_ACT_OK);
        let q = check::parse(&out).expect("parses");
        ((q.src, q.sport), (q.dst, q.dport))
    };
    let (_, old_backend) = ingress(&mut loaded, &tcp(&mut rng, client, vip, TCP_SYN));
    // Close and reopen until the new flow has another backend (2 in 3 each time).
    let mut new_backend = old_backend;
    for _ in 0..30 {
        ingress(&mut loaded, &tcp(&mut rng, client, vip, TCP_FIN | TCP_ACK));
        new_backend = ingress(&mut loaded, &tcp(&mut rng, client, vip, TCP_SYN)).1;
        if new_backend != old_backend {
            break;
        }
    }
    assert_ne!(
        new_backend, old_backend,
        "30 reopens all chose the same backend"
    );
    let service = |loaded: &mut Loaded| {
        loaded
            .ct_entry(client, vip, TCP, ct_dir::SERVICE)
            .expect("service entry")
    };
    let before = service(&mut loaded);
    assert_eq!(
        before.flags & (ct_flags::TX_CLOSING | ct_flags::RX_CLOSING),
        0
    );
    // The old backend's late RST: still translated (its entry lives), ...
    let (from, to) = ingress(&mut loaded, &tcp(&mut rng, old_backend, client, TCP_RST));
    assert_eq!(
        (from, to),
        (vip, client),
        "the old flow's reply is reverse-NATed"
    );
    // ... but the new flow is neither closing nor refreshed by it.
    assert_eq!(
        service(&mut loaded),
        before,
        "the new flow's service entry changed"
    );
}
