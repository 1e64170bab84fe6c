//! Masquerade (SNAT): kube-proxy's rules, port allocation, un-SNAT of replies, hairpin.

use crate::common::*;

pub(crate) const NODE4: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 1);
pub(crate) const NODE6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 1);
/// A ClusterIP with one backend (`BACKENDS4[0]` / `BACKENDS6[0]`), so flows share it.
pub(crate) const ONE_VIP4: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 12);
pub(crate) const ONE_VIP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0xffff, 0, 0, 0, 0, 0x12);

pub(crate) fn node_ip(of: IpAddr) -> IpAddr {
    match of {
        IpAddr::V4(_) => NODE4.into(),
        IpAddr::V6(_) => NODE6.into(),
    }
}

pub(crate) fn one_backend_vip(of: IpAddr) -> IpAddr {
    match of {
        IpAddr::V4(_) => ONE_VIP4.into(),
        IpAddr::V6(_) => ONE_VIP6.into(),
    }
}

/// `fixture_with(opts)` plus the one-backend VIPs and this node's facts written to the
/// datapath: node IPs NODE4/NODE6, `cidrs` as --cluster-cidr, `--masquerade-all` as given.
pub(crate) fn masq_fixture(opts: &LoadOptions, cidrs: &[&str], masquerade_all: bool) -> Fixture {
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
    pub(crate) fn set_nat_ports(&mut self, min: u16, max: u16) {
        let map = self.datapath.ebpf_mut().map_mut(map_names::CONFIG).unwrap();
        let mut config = Array::<_, LbConfig>::try_from(map).unwrap();
        let mut c = config.get(&0, 0).unwrap();
        (c.nat_port_min, c.nat_port_max) = (min, max);
        config.set(0, c, 0).unwrap();
    }
}

/// The pod CIDRs of the masquerade tests: the backends' links, not the client's (198.18.10.0/24,
/// 2001:db8:0:10::/64), which is therefore "outside the cluster".
pub(crate) const POD_CIDRS: [&str; 2] = ["198.18.11.0/24", "2001:db8:0:11::/64"];

/// Checks the IP and L4 checksums of `pkt` with etherparse (independently of
/// `parse_and_verify`'s own sums).
pub(crate) fn etherparse_checksums_ok(pkt: &[u8]) {
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
pub(crate) fn assert_sent(verdict: u32) {
    assert!(
        verdict == TC_ACT_OK || verdict == TC_ACT_REDIRECT,
        "verdict {verdict}"
    );
}

/// A client outside the cluster CIDRs: its new flow's source becomes the node IP and a port of
/// the range, later packets keep it, and the backend's reply to that address comes back from the
/// VIP to the client's own address and port; every checksum stays valid.
pub(crate) fn snat_forward_and_unsnat(client: IpAddr, vip: IpAddr, first: L4, then: L4) {
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
