//! ICMP errors about translated flows (`icmp` in lb-ebpf).

use crate::common::*;
use crate::masquerade::{POD_CIDRS, assert_sent, etherparse_checksums_ok, masq_fixture, node_ip};

pub(crate) const ROUTER4: Ipv4Addr = Ipv4Addr::new(198, 18, 99, 1);
pub(crate) const ROUTER6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 0x99, 0, 0, 0, 1);

/// A router of `of`'s family, on no path lb knows.
pub(crate) fn router(of: IpAddr) -> IpAddr {
    match of {
        IpAddr::V4(_) => ROUTER4.into(),
        IpAddr::V6(_) => ROUTER6.into(),
    }
}

/// A "fragmentation needed" (next-hop MTU 1400) or ICMPv6 "packet too big" (MTU 1280) from
/// `src` to `dst` quoting `quote` (an IP packet, from its header on).
pub(crate) fn too_big(src: IpAddr, dst: IpAddr, quote: &[u8]) -> Vec<u8> {
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
pub(crate) fn parse_error(pkt: &[u8], complete: bool) -> (IpAddr, IpAddr, Parsed) {
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
pub(crate) fn ct_count(fx: &mut Fixture) -> usize {
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
/// untouched, as every echo does with `--no-echo-reply`. Each client scope has its own
/// verdict (an external IP with `externalTrafficPolicy: Local` and its endpoints elsewhere
/// drops pings from outside, answers pods). The answer follows the backends: the last one
/// gone, the address rejects. No conntrack entry is made.
#[test]
fn echo_requests_to_service_addresses_get_the_addresses_verdict() {
    let mut fx = traced_fixture();
    let lb4: IpAddr = Ipv4Addr::new(198, 19, 1, 20).into();
    let lb6: IpAddr = Ipv6Addr::new(0x2001, 0xdb8, 0xffff, 1, 0, 0, 0, 0x20).into();
    // An external IP with externalTrafficPolicy: Local and its endpoints elsewhere: from
    // outside dropped, from pods (its internal scope, cluster-wide endpoints) answered.
    let ext4: IpAddr = Ipv4Addr::new(198, 19, 1, 21).into();
    let mut desired = fx.desired.clone();
    for lb in [lb4, lb6] {
        let (fe, mut elsewhere) = service(lb, Proto::Tcp, &[]);
        elsewhere.flags = svc_flags::LOAD_BALANCER | svc_flags::EXT_LOCAL | svc_flags::EMPTY_DROP;
        desired.services.insert(fe, elsewhere);
    }
    let two = svc_flags::EXTERNAL_IP | svc_flags::EXT_LOCAL | svc_flags::TWO_SCOPES;
    let b4: Vec<IpAddr> = BACKENDS4.iter().map(|a| (*a).into()).collect();
    let (fe, mut outside) = service(ext4, Proto::Tcp, &[]);
    outside.flags = two | svc_flags::EMPTY_DROP;
    desired.services.insert(fe, outside);
    let (fe, mut inside) = service(ext4, Proto::Tcp, &b4);
    inside.flags = two;
    desired.services.insert(
        Frontend {
            scope: Scope::Internal,
            ..fe
        },
        inside,
    );
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
    let ping = echo_request(CLIENT4.into(), ext4);
    assert_eq!(
        fx.ingress(&ping).0,
        TC_ACT_SHOT,
        "{ext4}: outside, no local endpoint"
    );
    assert_eq!(fx.xdp(&ping).0, XDP_DROP);
    let (verdict, out) = fx.run(prog_names::TC_POD, &ping);
    assert_eq!(verdict, TC_ACT_REDIRECT, "{ext4}: from a pod");
    assert_echo_reply(&out, CLIENT4.into(), ext4, "pod, internal scope");
    replies += 1;
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
