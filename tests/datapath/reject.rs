//! REJECT: the reply lb builds in place and sends back out the device the packet came in on.

use crate::common::*;
use crate::masquerade::{ONE_VIP4, ONE_VIP6, POD_CIDRS, assert_sent, masq_fixture, node_ip};
use crate::sctp::{Chunk, sctp_packet};

/// What a reject reply says; parsed with etherparse, checksums verified twice (etherparse's and
/// a full recomputation here).
#[derive(Debug)]
pub(crate) struct Reply {
    /// (source, destination) MACs.
    pub(crate) macs: ([u8; 6], [u8; 6]),
    pub(crate) src: IpAddr,
    pub(crate) dst: IpAddr,
    pub(crate) kind: ReplyKind,
}

#[derive(Debug, PartialEq, Eq)]
pub(crate) enum ReplyKind {
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

pub(crate) fn parse_reply(pkt: &[u8]) -> Reply {
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
pub(crate) fn expect_reply(fx: &mut Fixture, pkt: &[u8], from: IpAddr, reason: u32) -> ReplyKind {
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
