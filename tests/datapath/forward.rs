//! Forwarding: DNAT of new flows, established flows, reverse NAT of replies, conntrack.

use crate::common::*;
use crate::reject::{ReplyKind, parse_reply};

#[test]
fn ipv4_tcp_forward_established_and_reverse_nat() {
    forward_and_reply(CLIENT4.into(), VIP4.into(), L4::TcpSyn, L4::TcpAck);
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
