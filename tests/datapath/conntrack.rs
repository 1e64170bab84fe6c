//! Conntrack: pressure on a small map, removed backends and the configured lifetimes.

use crate::common::*;
use crate::reject::{ReplyKind, parse_reply};

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

/// Reprograms `vip`'s `proto` service without `gone`.
pub(crate) fn remove_backend(fx: &mut Fixture, vip: IpAddr, proto: Proto, gone: IpAddr) {
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
    let args = lb::datapath::conntrack::CtArgs {
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
