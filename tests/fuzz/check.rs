//! The invariants every program run must keep, checked against the fuzzer's own model of what
//! the maps hold and its own parsing (nothing here calls datapath code):
//!
//! - the verdict is one the program may return;
//! - a frame lb cannot parse completely (`parse` below: Ethernet II, IPv4 with IHL ≥ 5, or
//!   IPv6 with at most four hop-by-hop, routing (no segments left), destination-options,
//!   authentication or fragment headers, then a whole TCP, UDP or SCTP header within the
//!   lengths the IP header declares; a later fragment of TCP or UDP instead, with no header)
//!   leaves untouched with the pass verdict;
//! - a later fragment takes the ports its first fragment had; it is never rejected or
//!   dropped, may pass untouched, and when translated only its addresses change, to exactly
//!   the backend (or frontend) its first fragment was sent to: a later fragment never gets a
//!   translation its first did not get;
//! - an ICMP/ICMPv6 error is translated only when it quotes a flow lb opened: the quote made
//!   what the flow's other side sent, the outer addresses to match, every checksum as valid
//!   as it came;
//! - a frame to a frontend with backends is DNATed to one of them (masqueraded to the node IP
//!   and a NAT port where the node says so), a reply from a backend to a flow lb opened is
//!   reverse-NATed to that flow's frontend (and client), and in a rewritten frame nothing but
//!   the NAT fields (and, when forwarded past the stack, MACs and TTL) changed, while every
//!   checksum stays as valid (or as wrong, by the same amount) as it came;
//! - a frame to a frontend without backends, or to a ClusterIP on a port it has not, gets a
//!   well-formed TCP RST or ICMP port unreachable back to its sender from tc (an RST is
//!   dropped), and is left untouched for tc by XDP;
//! - an ICMP/ICMPv6 echo request on an ingress hook (`parse_echo_request`) to an address
//!   where a frontend without source ranges has backends is answered: the request turned
//!   around (MACs and addresses swapped, TTL 64, the reply type, nothing else changed, every
//!   checksum as valid as it came), XDP_TX / TC_ACT_REDIRECT; to one whose frontends have no
//!   backends it is rejected like their traffic (ICMP port unreachable from tc, untouched for
//!   tc by XDP); to any other address it passes untouched;
//! - a frame to an unallocated service-CIDR address, or from outside a frontend's source
//!   ranges, may be dropped; nothing else is;
//! - anything else leaves untouched.
use std::{
    collections::HashMap,
    net::IpAddr,
    ops::Range,
    time::{Duration, Instant},
};

use crate::{
    packets::{
        ICMP, ICMPV6, SCTP, TCP, TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN, UDP, pseudo_sum, sctp_crc,
        word_sum,
    },
    progrun::{
        Prog, TC_ACT_OK, TC_ACT_REDIRECT, TC_ACT_SHOT, XDP_DROP, XDP_PASS, XDP_REDIRECT, XDP_TX,
    },
};

/// A frontend as the fuzzer programmed it.
#[derive(Clone, Debug)]
pub struct Service {
    pub vip: IpAddr,
    pub port: u16,
    pub proto: u8,
    pub backends: Vec<(IpAddr, u16)>,
    pub cluster_ip: bool,
    /// `loadBalancerSourceRanges` (none: every source).
    pub source_ranges: Vec<(IpAddr, u8)>,
}

/// What the maps hold: frontends, service CIDRs, and the node IPs every new flow is
/// masqueraded to (`--masquerade-all`; none: no masquerade).
pub struct Model {
    pub name: &'static str,
    pub services: Vec<Service>,
    pub service_cidrs: Vec<(IpAddr, u8)>,
    pub node_ips: Vec<IpAddr>,
}

pub fn in_cidr(addr: IpAddr, (net, len): (IpAddr, u8)) -> bool {
    match (addr, net) {
        (IpAddr::V4(a), IpAddr::V4(n)) => {
            let mask = u32::MAX.checked_shl(32 - u32::from(len)).unwrap_or(0);
            u32::from(a) & mask == u32::from(n) & mask
        }
        (IpAddr::V6(a), IpAddr::V6(n)) => {
            let mask = u128::MAX.checked_shl(128 - u32::from(len)).unwrap_or(0);
            u128::from(a) & mask == u128::from(n) & mask
        }
        _ => false,
    }
}

impl Model {
    pub fn frontend(&self, addr: IpAddr, port: u16, proto: u8) -> Option<&Service> {
        self.services
            .iter()
            .find(|s| s.vip == addr && s.port == port && s.proto == proto)
    }

    pub fn is_cluster_ip(&self, addr: IpAddr) -> bool {
        self.services.iter().any(|s| s.cluster_ip && s.vip == addr)
    }

    /// What an echo request to `addr` gets (lb's `lb*_echo`): frontends with source ranges
    /// take no part.
    pub fn echo(&self, addr: IpAddr) -> Echo {
        let mut at = self
            .services
            .iter()
            .filter(|s| s.vip == addr && s.source_ranges.is_empty())
            .peekable();
        if at.peek().is_none() {
            Echo::Pass
        } else if at.any(|s| !s.backends.is_empty()) {
            Echo::Answer
        } else {
            Echo::Reject
        }
    }

    pub fn in_service_cidr(&self, addr: IpAddr) -> bool {
        self.service_cidrs.iter().any(|c| in_cidr(addr, *c))
    }

    pub fn node_ip(&self, v6: bool) -> Option<IpAddr> {
        self.node_ips.iter().copied().find(|a| a.is_ipv6() == v6)
    }

    pub fn masquerades(&self) -> bool {
        !self.node_ips.is_empty()
    }
}

/// What an echo request to a service address gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Echo {
    Answer,
    Reject,
    Pass,
}

/// The headers of a frame lb can translate, by the rules lb documents (see the module docs).
#[derive(Clone, Debug)]
pub struct Parsed {
    pub v6: bool,
    pub l3: usize,
    pub ihl: usize,
    pub l4: usize,
    /// The L4 length the IP header declares.
    pub l4_len: usize,
    pub proto: u8,
    pub src: IpAddr,
    pub dst: IpAddr,
    pub sport: u16,
    pub dport: u16,
    pub tcp_flags: u8,
    pub ttl: u8,
    pub frag: Frag,
}

/// Whether a frame is a fragment, and of which datagram (its IP identification).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Frag {
    None,
    First(u32),
    /// No L4 header: `sport`/`dport` are 0 until the first fragment's are filled in.
    Later(u32),
}

/// A fragmented datagram as its first fragment came: (source, destination, protocol, id).
pub type FragKey = (IpAddr, IpAddr, u8, u32);

/// What the first fragment of a datagram had and got.
#[derive(Clone, Debug, Default)]
pub struct FirstFragment {
    pub ports: (u16, u16),
    /// The (source, destination) addresses any program translated it to.
    pub translated: Vec<(IpAddr, IpAddr)>,
}

fn be16(f: &[u8], off: usize) -> u16 {
    u16::from_be_bytes([f[off], f[off + 1]])
}

fn be32(f: &[u8], off: usize) -> u32 {
    u32::from_be_bytes([f[off], f[off + 1], f[off + 2], f[off + 3]])
}

fn addr(b: &[u8]) -> IpAddr {
    match b.len() {
        4 => IpAddr::from(<[u8; 4]>::try_from(b).unwrap()),
        _ => IpAddr::from(<[u8; 16]>::try_from(b).unwrap()),
    }
}

pub fn parse(f: &[u8]) -> Option<Parsed> {
    let l3 = 14;
    if f.len() < l3 {
        return None;
    }
    let (v6, ihl, l4_len, proto, src, dst, ttl, frag) = match be16(f, 12) {
        0x0800 => {
            if f.len() < l3 + 20 || f[l3] >> 4 != 4 {
                return None;
            }
            let ihl = usize::from(f[l3] & 0x0f) * 4;
            let tot = usize::from(be16(f, l3 + 2));
            if ihl < 20 || tot < ihl {
                return None;
            }
            let fo = be16(f, l3 + 6);
            let id = u32::from(be16(f, l3 + 4));
            let frag = if fo & 0x1fff != 0 {
                Frag::Later(id)
            } else if fo & 0x2000 != 0 {
                Frag::First(id)
            } else {
                Frag::None
            };
            let (s, d) = (addr(&f[l3 + 12..l3 + 16]), addr(&f[l3 + 16..l3 + 20]));
            (false, ihl, tot - ihl, f[l3 + 9], s, d, f[l3 + 8], frag)
        }
        0x86dd => {
            if f.len() < l3 + 40 || f[l3] >> 4 != 6 {
                return None;
            }
            let (s, d) = (addr(&f[l3 + 8..l3 + 24]), addr(&f[l3 + 24..l3 + 40]));
            let payload = usize::from(be16(f, l3 + 4));
            let (mut next, mut hl, mut frag) = (f[l3 + 6], 40usize, Frag::None);
            for _ in 0..4 {
                let at = l3 + hl;
                match next {
                    0 | 43 | 60 | 51 => {
                        if f.len() < at + 4 || (next == 43 && f[at + 3] != 0) {
                            return None;
                        }
                        hl += if next == 51 {
                            (usize::from(f[at + 1]) + 2) * 4
                        } else {
                            (usize::from(f[at + 1]) + 1) * 8
                        };
                        next = f[at];
                    }
                    44 => {
                        if f.len() < at + 8 {
                            return None;
                        }
                        let fo = be16(f, at + 2);
                        let id = be32(f, at + 4);
                        frag = if fo & 0xfff8 != 0 {
                            Frag::Later(id)
                        } else if fo & 1 != 0 {
                            Frag::First(id)
                        } else {
                            Frag::None
                        };
                        hl += 8;
                        next = f[at];
                    }
                    _ => break,
                }
            }
            if hl > 0xfff || hl - 40 > payload {
                return None;
            }
            (true, hl, payload + 40 - hl, next, s, d, f[l3 + 7], frag)
        }
        _ => return None,
    };
    let l4 = l3 + ihl;
    if let Frag::Later(_) = frag {
        return matches!(proto, TCP | UDP).then_some(Parsed {
            v6,
            l3,
            ihl,
            l4,
            l4_len,
            proto,
            src,
            dst,
            sport: 0,
            dport: 0,
            tcp_flags: 0,
            ttl,
            frag,
        });
    }
    let holds = |n: usize| f.len() >= l4 + n;
    let tcp_flags = match proto {
        TCP if holds(20) && f[l4 + 12] >> 4 >= 5 && l4_len >= 20 => f[l4 + 13],
        UDP if holds(8) && l4_len >= 8 => 0,
        // SCTP's CRC covers the whole packet: all of it must be there (and no fragment).
        SCTP if holds(12) && l4_len >= 12 && f.len() >= l4 + l4_len && frag == Frag::None => 0,
        _ => return None,
    };
    Some(Parsed {
        v6,
        l3,
        ihl,
        l4,
        l4_len,
        proto,
        src,
        dst,
        sport: be16(f, l4),
        dport: be16(f, l4 + 2),
        tcp_flags,
        ttl,
        frag,
    })
}

/// The conntrack entry a backend's reply is found by: backend → client (or node IP and NAT
/// port).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ReplyKey {
    pub proto: u8,
    pub backend: (IpAddr, u16),
    pub to: (IpAddr, u16),
}

/// What a reply of a flow becomes: from the frontend, to the client where it was masqueraded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reverse {
    pub frontend: (IpAddr, u16),
    pub client: Option<(IpAddr, u16)>,
}

/// The flows the fuzzer saw lb open (every DNAT in any output), for the replies it sends and
/// the reverse NAT it expects.
#[derive(Default)]
pub struct Flows {
    map: HashMap<ReplyKey, Vec<(Reverse, Instant)>>,
    /// First fragments seen, by datagram.
    pub frags: HashMap<FragKey, FirstFragment>,
    /// In the order first seen, for the generator.
    pub keys: Vec<ReplyKey>,
}

/// A flow seen this recently is certainly still in conntrack (the shortest lifetime is
/// 10 s, refreshed once it would move by 5 s).
const SURELY_ALIVE: Duration = Duration::from_secs(1);

impl Flows {
    /// The first reverse translation recorded for `key`.
    pub fn reverse_of(&self, key: &ReplyKey) -> Option<Reverse> {
        self.map.get(key).and_then(|r| r.first()).map(|(r, _)| *r)
    }

    fn record(&mut self, key: ReplyKey, rev: Reverse) {
        let now = Instant::now();
        let recs = self.map.entry(key).or_insert_with(|| {
            self.keys.push(key);
            Vec::new()
        });
        match recs.iter_mut().find(|(r, _)| *r == rev) {
            Some(seen) => seen.1 = now,
            None => recs.push((rev, now)),
        }
    }
}

/// What a run did, for the tallies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Outcome {
    /// Refused by BPF_PROG_TEST_RUN itself (see `kernel_refuses_skb`): no program ran.
    Refused,
    /// Not parseable: passed untouched.
    Unparsed,
    /// Parsed, nothing to do (or left for tc): passed untouched.
    Untouched,
    Dnat,
    /// DNAT and masquerade.
    DnatSnat,
    /// Sent on past the stack (XDP_TX / XDP_REDIRECT / TC_ACT_REDIRECT of a NAT).
    Forwarded,
    ReverseNat,
    Reject,
    Drop,
    /// A later fragment translated as its first fragment was.
    LaterFragment,
    /// An ICMP error rewritten for the flow it quotes.
    IcmpError,
    /// An echo request answered.
    EchoReply,
}

/// What the model says may happen to a parsed frame.
enum Expect<'a> {
    Untouched,
    Dnat {
        svc: &'a Service,
        /// Must be rewritten (not only may).
        must: bool,
        may_drop: bool,
    },
    Reject,
    Drop,
    Reverse {
        revs: Vec<Reverse>,
        must: bool,
    },
}

/// The verdicts of `prog`: (pass, drop, the forwarding ones).
fn verdicts(prog: Prog) -> (u32, u32, &'static [u32]) {
    match prog {
        Prog::Xdp => (XDP_PASS, XDP_DROP, &[XDP_TX, XDP_REDIRECT]),
        _ => (TC_ACT_OK, TC_ACT_SHOT, &[TC_ACT_REDIRECT]),
    }
}

/// Checks one run of `prog` on `input` (verdict, `out`) and records the flows it opened.
pub fn check(
    model: &Model,
    flows: &mut Flows,
    prog: Prog,
    input: &[u8],
    verdict: u32,
    out: &[u8],
) -> Result<Outcome, String> {
    let (pass, _, _) = verdicts(prog);
    let allowed: &[u32] = match prog {
        Prog::Xdp => &[XDP_PASS, XDP_DROP, XDP_TX, XDP_REDIRECT],
        Prog::TcIngress | Prog::TcPod => &[TC_ACT_OK, TC_ACT_SHOT, TC_ACT_REDIRECT],
        Prog::TcEgress => &[TC_ACT_OK],
    };
    if !allowed.contains(&verdict) {
        return Err(format!(
            "unexpected verdict {verdict} (allowed {allowed:?})"
        ));
    }
    let untouched = verdict == pass && out == input;
    if prog != Prog::TcEgress
        && let Some(p) = parse_echo_request(input)
    {
        return check_echo(model, prog, &p, input, verdict, out, untouched);
    }
    if let Some(e) = parse_icmp_error(input) {
        return check_icmp(flows, prog, &e, input, verdict, out, untouched);
    }
    let Some(p) = parse(input) else {
        return if untouched {
            Ok(Outcome::Unparsed)
        } else {
            Err("a frame lb cannot parse was not passed untouched".into())
        };
    };
    match p.frag {
        Frag::Later(id) => return check_later(flows, prog, &p, id, input, verdict, out, untouched),
        Frag::First(id) => {
            let first = flows.frags.entry((p.src, p.dst, p.proto, id)).or_default();
            if first.ports != (p.sport, p.dport) {
                *first = FirstFragment {
                    ports: (p.sport, p.dport),
                    translated: Vec::new(),
                };
            }
        }
        Frag::None => {}
    }
    let outcome = check_parsed(model, flows, prog, &p, input, verdict, out, untouched)?;
    let translation = matches!(
        outcome,
        Outcome::Dnat | Outcome::DnatSnat | Outcome::Forwarded | Outcome::ReverseNat
    );
    if let Frag::First(id) = p.frag
        && translation
        && let Some(q) = parse(out)
        && let Some(first) = flows.frags.get_mut(&(p.src, p.dst, p.proto, id))
    {
        first.translated.push((q.src, q.dst));
    }
    Ok(outcome)
}

/// `check` of a frame `parse` read (not an ICMP error, not a later fragment).
#[expect(
    clippy::too_many_arguments,
    reason = "check's own arguments, passed on"
)]
fn check_parsed(
    model: &Model,
    flows: &mut Flows,
    prog: Prog,
    p: &Parsed,
    input: &[u8],
    verdict: u32,
    out: &[u8],
    untouched: bool,
) -> Result<Outcome, String> {
    let (pass, drop, fwd) = verdicts(prog);
    let p = p.clone();
    let expect = expectation(model, flows, prog, &p);
    match expect {
        Expect::Untouched => {
            if untouched {
                Ok(Outcome::Untouched)
            } else {
                Err("a frame to no service, and no reply of a flow lb opened, was not passed untouched".into())
            }
        }
        Expect::Drop => {
            if verdict == drop {
                Ok(Outcome::Drop)
            } else {
                Err("a frame to an unallocated service-CIDR address was not dropped".into())
            }
        }
        Expect::Reject if prog == Prog::Xdp => {
            if untouched {
                Ok(Outcome::Untouched)
            } else {
                Err("XDP did not leave a frame to reject untouched for tc".into())
            }
        }
        Expect::Reject => {
            if p.proto == TCP && p.tcp_flags & TCP_RST != 0 {
                return if verdict == drop {
                    Ok(Outcome::Drop)
                } else {
                    Err("a TCP RST to reject was not dropped".into())
                };
            }
            if verdict != TC_ACT_REDIRECT {
                return Err(
                    "a frame to reject got no reply sent back (verdict not REDIRECT)".into(),
                );
            }
            reject_reply(&p, input, out).map(|()| Outcome::Reject)
        }
        Expect::Dnat {
            svc,
            must,
            may_drop,
        } => {
            if verdict == drop && may_drop {
                return Ok(Outcome::Drop);
            }
            if untouched {
                return if must {
                    Err("a frame to a frontend with backends was not DNATed".into())
                } else {
                    Ok(Outcome::Untouched)
                };
            }
            let masq = model.masquerades();
            if verdict != pass && !(masq && fwd.contains(&verdict)) {
                return Err(format!("unexpected verdict {verdict} for a DNAT"));
            }
            let q = translated(&p, input, out, masq)?;
            let backend = (q.dst, q.dport);
            if !svc.backends.contains(&backend) {
                return Err(format!(
                    "DNAT to {}:{} which is no backend of {}:{} (backends {:?})",
                    q.dst, q.dport, svc.vip, svc.port, svc.backends
                ));
            }
            let frontend = (svc.vip, svc.port);
            let (key, client) = if masq {
                let node = model.node_ip(p.v6).expect("node IP of the family");
                if q.src != node || q.sport < lb_common::nat::PORT_MIN {
                    return Err(format!(
                        "masqueraded source {}:{} is not the node IP {node} with a NAT port",
                        q.src, q.sport
                    ));
                }
                ((q.src, q.sport), Some((p.src, p.sport)))
            } else {
                if (q.src, q.sport) != (p.src, p.sport) {
                    return Err(format!("DNAT changed the source to {}:{}", q.src, q.sport));
                }
                ((p.src, p.sport), None)
            };
            flows.record(
                ReplyKey {
                    proto: p.proto,
                    backend,
                    to: key,
                },
                Reverse { frontend, client },
            );
            Ok(if fwd.contains(&verdict) {
                Outcome::Forwarded
            } else if masq {
                Outcome::DnatSnat
            } else {
                Outcome::Dnat
            })
        }
        Expect::Reverse { revs, must } => {
            if untouched {
                return if must {
                    Err(format!(
                        "a reply of a flow lb opened just now was not reverse-NATed ({revs:?})"
                    ))
                } else {
                    Ok(Outcome::Untouched)
                };
            }
            if verdict != pass {
                return Err(format!("unexpected verdict {verdict} for a reverse NAT"));
            }
            let q = translated(&p, input, out, false)?;
            let ok = revs.iter().any(|r| {
                (q.src, q.sport) == r.frontend
                    && (q.dst, q.dport) == r.client.unwrap_or((p.dst, p.dport))
            });
            if ok {
                Ok(Outcome::ReverseNat)
            } else {
                Err(format!(
                    "reverse NAT to {}:{} -> {}:{}, but the flows expect {revs:?}",
                    q.src, q.sport, q.dst, q.dport
                ))
            }
        }
    }
}

fn expectation<'a>(model: &'a Model, flows: &Flows, prog: Prog, p: &Parsed) -> Expect<'a> {
    if prog != Prog::TcEgress {
        if let Some(svc) = model.frontend(p.dst, p.dport, p.proto) {
            if svc.backends.is_empty() {
                return Expect::Reject;
            }
            let may_drop = !svc.source_ranges.is_empty()
                && !svc.source_ranges.iter().any(|c| in_cidr(p.src, *c));
            // XDP leaves a masqueraded flow to tc unless the route to the backend is resolved;
            // the pod hook balances the frontends' in-cluster scope, which external addresses
            // need not have.
            let left_to_tc = prog == Prog::Xdp && model.masquerades();
            let other_scope = prog == Prog::TcPod && !svc.cluster_ip;
            let must = !(may_drop || left_to_tc || other_scope);
            return Expect::Dnat {
                svc,
                must,
                may_drop,
            };
        }
        if model.is_cluster_ip(p.dst) {
            return Expect::Reject;
        }
        if model.in_service_cidr(p.dst) {
            return Expect::Drop;
        }
    }
    let key = ReplyKey {
        proto: p.proto,
        backend: (p.src, p.sport),
        to: (p.dst, p.dport),
    };
    match flows.map.get(&key) {
        Some(recs) => Expect::Reverse {
            revs: recs.iter().map(|(r, _)| *r).collect(),
            must: recs.iter().any(|(_, t)| t.elapsed() < SURELY_ALIVE),
        },
        None => Expect::Untouched,
    }
}

/// Checks that `out` is `input` with only NAT fields changed (plus MACs and TTL where `fwd`),
/// every checksum exactly as valid as it came, and returns its headers.
fn translated(p: &Parsed, input: &[u8], out: &[u8], fwd: bool) -> Result<Parsed, String> {
    if out.len() != input.len() {
        return Err(format!(
            "the rewritten frame is {} bytes, the input {}",
            out.len(),
            input.len()
        ));
    }
    let q = parse(out).ok_or("the rewritten frame does not parse")?;
    if (q.v6, q.l4, q.proto, q.l4_len) != (p.v6, p.l4, p.proto, p.l4_len) {
        return Err("the rewrite moved or changed the headers".into());
    }
    let (l3, l4) = (p.l3, p.l4);
    let mut fields: Vec<Range<usize>> = vec![
        if p.v6 {
            l3 + 8..l3 + 40
        } else {
            l3 + 10..l3 + 20
        },
        l4..l4 + 4,
        match p.proto {
            TCP => l4 + 16..l4 + 18,
            UDP => l4 + 6..l4 + 8,
            _ => l4 + 8..l4 + 12,
        },
    ];
    if fwd {
        fields.extend(forwarding_fields(p.v6, l3));
    }
    if let Some(i) = changed_outside(input, out, &fields) {
        return Err(format!(
            "byte {i} changed ({:#04x} -> {:#04x}), which is no NAT field",
            input[i], out[i]
        ));
    }
    if q.ttl != p.ttl && !(fwd && p.ttl > 1 && q.ttl == p.ttl - 1) {
        return Err(format!("TTL {} -> {}", p.ttl, q.ttl));
    }
    if !p.v6 {
        let h = |f: &[u8]| word_sum(&f[l3..l3 + p.ihl]) % 0xffff;
        if h(input) != h(out) {
            return Err(format!(
                "IPv4 header checksum: valid in {}, out {}",
                h(input) == 0,
                h(out) == 0
            ));
        }
    }
    let end = (l4 + p.l4_len).min(input.len());
    match p.proto {
        TCP | UDP => {
            let s = |f: &[u8], q: &Parsed| {
                (pseudo_sum(q.src, q.dst, q.proto, q.l4_len) + word_sum(&f[l4..end])) % 0xffff
            };
            let csum_off = if p.proto == TCP { l4 + 16 } else { l4 + 6 };
            let (cin, cout) = (be16(input, csum_off), be16(out, csum_off));
            if p.proto == UDP && cin == 0 {
                if cout != 0 {
                    return Err(format!("a zero (absent) UDP checksum became {cout:#06x}"));
                }
            } else if p.proto == UDP && cout == 0 {
                return Err("a UDP checksum became zero (absent)".into());
            } else if s(input, p) != s(out, &q) {
                return Err(format!(
                    "L4 checksum: valid in {}, out {} (and not off by the same amount)",
                    s(input, p) == 0,
                    s(out, &q) == 0
                ));
            }
        }
        _ => {
            let stored = |f: &[u8]| u32::from_le_bytes(f[l4 + 8..l4 + 12].try_into().unwrap());
            let (cin, cout) = (stored(input), stored(out));
            let sctp_end = l4 + p.l4_len;
            if cin == 0 {
                if cout != 0 {
                    return Err(format!("a zero SCTP CRC became {cout:#010x}"));
                }
            } else if cin ^ sctp_crc(&input[l4..sctp_end]) != cout ^ sctp_crc(&out[l4..sctp_end]) {
                return Err(format!(
                    "SCTP CRC32c: valid in {}, out {} (and not off by the same bits)",
                    cin == sctp_crc(&input[l4..sctp_end]),
                    cout == sctp_crc(&out[l4..sctp_end])
                ));
            }
        }
    }
    Ok(q)
}

/// Checks that `out` is the reject reply to `input`: to its sender from the address it asked
/// for, a TCP RST (RFC 9293 3.10.7.1) or an ICMP(v6) port unreachable quoting it, every
/// checksum computed in full.
fn reject_reply(p: &Parsed, input: &[u8], out: &[u8]) -> Result<(), String> {
    let hl = if p.v6 { 40 } else { 20 };
    if out.len() < 14 + hl + 8 {
        return Err(format!("reject reply of {} bytes", out.len()));
    }
    if out[0..6] != input[6..12] || out[6..12] != input[0..6] || out[12..14] != input[12..14] {
        return Err("reject reply: Ethernet header not the original's swapped".into());
    }
    let ip = &out[14..14 + hl];
    let (src, dst, proto, l4_len) = if p.v6 {
        if ip[0] >> 4 != 6 || usize::from(be16(ip, 4)) != out.len() - 54 {
            return Err("reject reply: bad IPv6 header".into());
        }
        (addr(&ip[8..24]), addr(&ip[24..40]), ip[6], out.len() - 54)
    } else {
        if ip[0] != 0x45
            || usize::from(be16(ip, 2)) != out.len() - 14
            || be16(ip, 6) & 0x3fff != 0
            || !word_sum(ip).is_multiple_of(0xffff)
        {
            return Err("reject reply: bad IPv4 header (or its checksum)".into());
        }
        (addr(&ip[12..16]), addr(&ip[16..20]), ip[9], out.len() - 34)
    };
    if (src, dst) != (p.dst, p.src) {
        return Err(format!(
            "reject reply from {src} to {dst}, not back to the sender"
        ));
    }
    let l4 = &out[14 + hl..];
    if p.proto == TCP {
        if proto != TCP || l4_len != 20 {
            return Err("reject reply to TCP is no bare TCP segment".into());
        }
        if (be16(l4, 0), be16(l4, 2)) != (p.dport, p.sport) || l4[12] != 0x50 {
            return Err("RST: ports not swapped or bad data offset".into());
        }
        let th = &input[p.l4..];
        let payload = p.l4_len.saturating_sub(usize::from(th[12] >> 4) * 4) as u32;
        let (seq, ack, flags) = if p.tcp_flags & TCP_ACK != 0 {
            (be32(th, 8), 0, TCP_RST)
        } else {
            let ack = be32(th, 4)
                .wrapping_add(payload)
                .wrapping_add(u32::from(p.tcp_flags & TCP_SYN != 0))
                .wrapping_add(u32::from(p.tcp_flags & TCP_FIN != 0));
            (0, ack, TCP_RST | TCP_ACK)
        };
        if (be32(l4, 4), be32(l4, 8), l4[13]) != (seq, ack, flags) {
            return Err(format!(
                "RST seq/ack/flags {:#x}/{:#x}/{:#04x}, want {seq:#x}/{ack:#x}/{flags:#04x}",
                be32(l4, 4),
                be32(l4, 8),
                l4[13]
            ));
        }
        if !(pseudo_sum(src, dst, TCP, 20) + word_sum(l4)).is_multiple_of(0xffff) {
            return Err("RST: bad TCP checksum".into());
        }
        return Ok(());
    }
    let (want_proto, ty, max, ip_len) = if p.v6 {
        (ICMPV6, [1, 4], 1280 - 48, 40 + usize::from(be16(input, 18)))
    } else {
        (ICMP, [3, 3], 576 - 28, usize::from(be16(input, 16)))
    };
    if proto != want_proto || l4[0..2] != ty || be32(l4, 4) != 0 {
        return Err("reject reply is no ICMP port unreachable".into());
    }
    let quote = &l4[8..];
    let want = ip_len.min(input.len() - 14).min(max);
    if quote != &input[14..14 + want] {
        return Err(format!(
            "port unreachable quotes {} bytes, want the first {want} of the original IP packet",
            quote.len()
        ));
    }
    let sum = if p.v6 {
        pseudo_sum(src, dst, ICMPV6, l4.len()) + word_sum(l4)
    } else {
        word_sum(l4)
    };
    if !sum.is_multiple_of(0xffff) {
        return Err("port unreachable: bad ICMP checksum".into());
    }
    Ok(())
}

/// An ICMP/ICMPv6 echo request as lb answers them: code 0, not fragmented, IPv6 without
/// extension headers, the whole packet its IP header declares in the frame.
pub fn parse_echo_request(f: &[u8]) -> Option<Parsed> {
    let (v6, ihl, total, proto, src, dst, ttl) = match be16(f.get(..14)?, 12) {
        0x0800 => {
            let ip = f.get(14..34)?;
            let ihl = usize::from(ip[0] & 0x0f) * 4;
            if ip[0] >> 4 != 4 || ihl < 20 || ip[9] != ICMP || be16(ip, 6) & 0x3fff != 0 {
                return None;
            }
            let (src, dst) = (addr(&ip[12..16]), addr(&ip[16..20]));
            (false, ihl, usize::from(be16(ip, 2)), ICMP, src, dst, ip[8])
        }
        0x86dd => {
            let ip = f.get(14..54)?;
            if ip[0] >> 4 != 6 || ip[6] != ICMPV6 {
                return None;
            }
            let (src, dst) = (addr(&ip[8..24]), addr(&ip[24..40]));
            (
                true,
                40,
                40 + usize::from(be16(ip, 4)),
                ICMPV6,
                src,
                dst,
                ip[7],
            )
        }
        _ => return None,
    };
    let l4 = 14 + ihl;
    let icmp = f.get(l4..l4 + 4)?;
    let request = if v6 { 128 } else { 8 };
    if icmp[0] != request || icmp[1] != 0 || total < ihl + 8 || f.len() < 14 + total {
        return None;
    }
    Some(Parsed {
        v6,
        l3: 14,
        ihl,
        l4,
        l4_len: total - ihl,
        proto,
        src,
        dst,
        sport: 0,
        dport: 0,
        tcp_flags: 0,
        ttl,
        frag: Frag::None,
    })
}

/// An echo request on an ingress hook: answered, rejected or untouched as `Model::echo` says.
fn check_echo(
    model: &Model,
    prog: Prog,
    p: &Parsed,
    input: &[u8],
    verdict: u32,
    out: &[u8],
    untouched: bool,
) -> Result<Outcome, String> {
    match (model.echo(p.dst), prog) {
        (Echo::Answer, _) => {
            let want = if prog == Prog::Xdp {
                XDP_TX
            } else {
                TC_ACT_REDIRECT
            };
            if verdict != want {
                return Err(format!(
                    "echo request to {} (backends): verdict {verdict}, want the reply ({want})",
                    p.dst
                ));
            }
            echo_reply(p, input, out)?;
            Ok(Outcome::EchoReply)
        }
        (Echo::Reject, Prog::TcIngress | Prog::TcPod) => {
            if verdict != TC_ACT_REDIRECT {
                return Err(format!(
                    "echo request to {} (no backends): verdict {verdict}, want a reject",
                    p.dst
                ));
            }
            reject_reply(p, input, out)?;
            Ok(Outcome::Reject)
        }
        _ if untouched => Ok(Outcome::Untouched),
        (echo, _) => Err(format!(
            "echo request to {} ({echo:?}) was not passed untouched",
            p.dst
        )),
    }
}

/// Checks that `out` is `input`, an echo request, turned into its reply: MACs and addresses
/// swapped, TTL / hop limit 64, the reply type; nothing else changed but the checksums, each as
/// valid (or as wrong, by the same amount) as it came.
fn echo_reply(p: &Parsed, input: &[u8], out: &[u8]) -> Result<(), String> {
    if out.len() != input.len() {
        return Err(format!(
            "echo reply of {} bytes to a request of {}",
            out.len(),
            input.len()
        ));
    }
    let mut want = input.to_vec();
    want[..6].copy_from_slice(&input[6..12]);
    want[6..12].copy_from_slice(&input[..6]);
    let (s, d, ttl, csum) = if p.v6 {
        (22..38, 38..54, 21, None)
    } else {
        (26..30, 30..34, 22, Some(24..26))
    };
    want[s.clone()].copy_from_slice(&input[d.clone()]);
    want[d].copy_from_slice(&input[s]);
    want[ttl] = 64;
    want[p.l4] = if p.v6 { 129 } else { 0 };
    let icmp_csum = p.l4 + 2..p.l4 + 4;
    let mut fields = vec![icmp_csum];
    fields.extend(csum.clone());
    if let Some(i) = changed_outside(&want, out, &fields) {
        return Err(format!(
            "echo reply: byte {i} is not the request's, turned around"
        ));
    }
    let sums = |f: &[u8], r: Range<usize>| word_sum(&f[r]) % 0xffff;
    if let Some(ip) = csum.map(|_| 14..14 + p.ihl)
        && sums(input, ip.clone()) != sums(out, ip)
    {
        return Err("echo reply: IPv4 header checksum changed validity".into());
    }
    let icmp = p.l4..p.l4 + p.l4_len;
    if sums(input, icmp.clone()) != sums(out, icmp) {
        return Err("echo reply: ICMP checksum changed validity".into());
    }
    Ok(())
}

/// The first byte where `out` differs from `input` outside `fields` (the frames are the same
/// length).
fn changed_outside(input: &[u8], out: &[u8], fields: &[Range<usize>]) -> Option<usize> {
    (0..input.len()).find(|&i| input[i] != out[i] && !fields.iter().any(|r| r.contains(&i)))
}

/// What forwarding past the stack may change besides the translation: the MACs and the TTL
/// (hop limit) of the IP header at `l3`.
fn forwarding_fields(v6: bool, l3: usize) -> [Range<usize>; 2] {
    [0..12, if v6 { l3 + 7..l3 + 8 } else { l3 + 8..l3 + 9 }]
}

/// A later fragment: untouched, or translated (addresses only) exactly as its first fragment
/// was by some program; never before its first fragment was seen.
#[expect(
    clippy::too_many_arguments,
    reason = "check's own arguments, passed on"
)]
fn check_later(
    flows: &Flows,
    prog: Prog,
    p: &Parsed,
    id: u32,
    input: &[u8],
    verdict: u32,
    out: &[u8],
    untouched: bool,
) -> Result<Outcome, String> {
    let (pass, _, fwd) = verdicts(prog);
    let Some(first) = flows.frags.get(&(p.src, p.dst, p.proto, id)) else {
        return if untouched {
            Ok(Outcome::Unparsed)
        } else {
            Err(
                "a later fragment whose first fragment was never seen was not passed untouched"
                    .into(),
            )
        };
    };
    if untouched {
        return Ok(Outcome::Untouched);
    }
    if verdict != pass && !fwd.contains(&verdict) {
        return Err(format!("unexpected verdict {verdict} for a later fragment"));
    }
    if out.len() != input.len() {
        return Err("a later fragment changed its length".into());
    }
    let l3 = p.l3;
    let mut fields: Vec<Range<usize>> = vec![if p.v6 {
        l3 + 8..l3 + 40
    } else {
        l3 + 10..l3 + 20
    }];
    if fwd.contains(&verdict) {
        fields.extend(forwarding_fields(p.v6, l3));
    }
    if let Some(i) = changed_outside(input, out, &fields) {
        return Err(format!(
            "later fragment: byte {i} changed, which is no address (its data must stay as it came)"
        ));
    }
    if !p.v6 {
        // The options may run past a cut frame (lb reads only the fixed header of a later
        // fragment): the sum over what is there covers every field that may change.
        let end = (l3 + p.ihl).min(input.len());
        let h = |f: &[u8]| word_sum(&f[l3..end]) % 0xffff;
        if h(input) != h(out) {
            return Err("later fragment: IPv4 header checksum".into());
        }
    }
    let q = parse(out).ok_or("the translated later fragment does not parse")?;
    if !first.translated.contains(&(q.src, q.dst)) {
        return Err(format!(
            "a later fragment went {} -> {}, a translation its first fragment never got ({:?})",
            q.src, q.dst, first.translated
        ));
    }
    Ok(Outcome::LaterFragment)
}

/// An ICMP/ICMPv6 error as lb reads one (`icmp` in lb-ebpf): the error's addresses, where
/// its ICMP message and the packet it quotes are, and the quote's addresses and ports.
#[derive(Debug)]
pub struct IcmpError {
    v6: bool,
    ihl: usize,
    icmp: usize,
    src: IpAddr,
    dst: IpAddr,
    quote: usize,
    quote_ihl: usize,
    proto: u8,
    qsrc: (IpAddr, u16),
    qdst: (IpAddr, u16),
    /// The quoted TCP/UDP checksum, where lb updates it.
    qcsum: Option<usize>,
}

pub fn parse_icmp_error(f: &[u8]) -> Option<IcmpError> {
    let l3 = 14;
    if f.len() < l3 + 10 {
        return None;
    }
    let (v6, ihl, icmp, src, dst, quote, quote_ihl, proto) = match be16(f, 12) {
        0x0800 => {
            if f[l3 + 9] != ICMP || f.len() < l3 + 20 {
                return None;
            }
            let ihl = usize::from(f[l3] & 0x0f) * 4;
            if f[l3] >> 4 != 4 || ihl < 20 || be16(f, l3 + 6) & 0x3fff != 0 {
                return None;
            }
            let tot = usize::from(be16(f, l3 + 2));
            let icmp = l3 + ihl;
            if f.len() < icmp + 4 || !matches!(f[icmp], 3 | 11 | 12) || tot < ihl + 8 + 28 {
                return None;
            }
            let q = icmp + 8;
            if f.len() < q + 20 {
                return None;
            }
            let qihl = usize::from(f[q] & 0x0f) * 4;
            if f[q] >> 4 != 4 || qihl < 20 || be16(f, q + 6) & 0x1fff != 0 {
                return None;
            }
            let (s, d) = (addr(&f[l3 + 12..l3 + 16]), addr(&f[l3 + 16..l3 + 20]));
            (false, ihl, icmp, s, d, q, qihl, f[q + 9])
        }
        0x86dd => {
            if f[l3 + 6] != ICMPV6 || f.len() < l3 + 40 || f[l3] >> 4 != 6 {
                return None;
            }
            let payload = usize::from(be16(f, l3 + 4));
            let icmp = l3 + 40;
            if f.len() < icmp + 4 || !(1..=4).contains(&f[icmp]) || payload < 8 + 48 {
                return None;
            }
            let q = icmp + 8;
            if f.len() < q + 40 || f[q] >> 4 != 6 {
                return None;
            }
            let (s, d) = (addr(&f[l3 + 8..l3 + 24]), addr(&f[l3 + 24..l3 + 40]));
            (true, 40, icmp, s, d, q, 40, f[q + 6])
        }
        _ => return None,
    };
    let l4 = quote + quote_ihl;
    if f.len() < l4 + 8 {
        return None;
    }
    let qcsum = match proto {
        TCP if f.len() >= l4 + 18 => Some(l4 + 16),
        TCP | SCTP => None,
        UDP if !v6 && be16(f, l4 + 6) == 0 => None,
        UDP => Some(l4 + 6),
        _ => return None,
    };
    let (qs, qd) = if v6 {
        (
            addr(&f[quote + 8..quote + 24]),
            addr(&f[quote + 24..quote + 40]),
        )
    } else {
        (
            addr(&f[quote + 12..quote + 16]),
            addr(&f[quote + 16..quote + 20]),
        )
    };
    Some(IcmpError {
        v6,
        ihl,
        icmp,
        src,
        dst,
        quote,
        quote_ihl,
        proto,
        qsrc: (qs, be16(f, l4)),
        qdst: (qd, be16(f, l4 + 2)),
        qcsum,
    })
}

/// What a translated error may look like: (outer source, outer destination, quote source,
/// quote destination).
type IcmpShape = (IpAddr, IpAddr, (IpAddr, u16), (IpAddr, u16));

/// An ICMP error: untouched, or translated for a flow lb opened that it quotes (towards that
/// flow's client, or towards its backend from an ingress program) with nothing else changed
/// and every checksum as valid as it came.
fn check_icmp(
    flows: &Flows,
    prog: Prog,
    e: &IcmpError,
    input: &[u8],
    verdict: u32,
    out: &[u8],
    untouched: bool,
) -> Result<Outcome, String> {
    let (pass, _, fwd) = verdicts(prog);
    let mut allowed: Vec<IcmpShape> = Vec::new();
    // Towards the client: the quote is what lb sent to a backend; its reply entry knows it.
    let rkey = ReplyKey {
        proto: e.proto,
        backend: e.qdst,
        to: e.qsrc,
    };
    for (r, _) in flows.map.get(&rkey).into_iter().flatten() {
        let client = r.client.unwrap_or(e.qsrc);
        let osrc = if e.src == e.qdst.0 {
            r.frontend.0
        } else {
            e.src
        };
        let odst = if r.client.is_some() { client.0 } else { e.dst };
        allowed.push((osrc, odst, client, r.frontend));
    }
    // Towards the backend: the quote is a reply lb reverse-NATed (frontend -> client).
    if prog != Prog::TcEgress {
        for (k, recs) in &flows.map {
            for (r, _) in recs {
                let client = r.client.unwrap_or(k.to);
                if k.proto == e.proto && r.frontend == e.qsrc && client == e.qdst {
                    let masq = r.client.is_some();
                    let osrc = if masq { k.to.0 } else { e.src };
                    let qdst = if masq { k.to } else { e.qdst };
                    allowed.push((osrc, k.backend.0, k.backend, qdst));
                }
            }
        }
    }
    if untouched {
        return Ok(Outcome::Untouched);
    }
    if allowed.is_empty() {
        return Err("an ICMP error quoting no flow lb opened was changed".into());
    }
    if verdict != pass && !fwd.contains(&verdict) {
        return Err(format!("unexpected verdict {verdict} for an ICMP error"));
    }
    if out.len() != input.len() {
        return Err("a translated ICMP error changed its length".into());
    }
    let o = parse_icmp_error(out).ok_or("the translated ICMP error does not parse")?;
    let got = (o.src, o.dst, o.qsrc, o.qdst);
    if !allowed.contains(&got) {
        return Err(format!(
            "ICMP error translated to {got:?}, which none of its flows allows ({allowed:?})"
        ));
    }
    let (l3, q) = (14, e.quote);
    let ql4 = q + e.quote_ihl;
    let mut fields: Vec<Range<usize>> = vec![
        if e.v6 {
            l3 + 8..l3 + 40
        } else {
            l3 + 10..l3 + 20
        },
        e.icmp + 2..e.icmp + 4,
        if e.v6 { q + 8..q + 40 } else { q + 10..q + 20 },
        ql4..ql4 + 4,
    ];
    if let Some(c) = e.qcsum {
        fields.push(c..c + 2);
    }
    if fwd.contains(&verdict) {
        fields.extend(forwarding_fields(e.v6, l3));
    }
    if let Some(i) = changed_outside(input, out, &fields) {
        return Err(format!(
            "ICMP error: byte {i} changed, which lb does not translate"
        ));
    }
    // Every checksum exactly as valid as it came: the outer IPv4 header's, the ICMP
    // message's (with ICMPv6's pseudo-header), the quoted IPv4 header's.
    let msg = |f: &[u8], src: IpAddr, dst: IpAddr| {
        let pseudo = if e.v6 {
            pseudo_sum(src, dst, ICMPV6, f.len() - e.icmp)
        } else {
            0
        };
        (pseudo + word_sum(&f[e.icmp..])) % 0xffff
    };
    if msg(input, e.src, e.dst) != msg(out, o.src, o.dst) {
        return Err("ICMP error: the ICMP checksum is not as valid as it came".into());
    }
    if !e.v6 {
        let h = |f: &[u8], at: usize, len: usize| word_sum(&f[at..at + len]) % 0xffff;
        if h(input, l3, e.ihl) != h(out, l3, e.ihl) {
            return Err("ICMP error: outer IPv4 header checksum".into());
        }
        if h(input, q, e.quote_ihl) != h(out, q, e.quote_ihl) {
            return Err("ICMP error: quoted IPv4 header checksum".into());
        }
    }
    Ok(Outcome::IcmpError)
}
