//! The trace record, and the one selection's answer for broken service state.

use crate::common::*;
use crate::reject::{ReplyKind, parse_reply};

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
pub(crate) fn new_flows_rejected_as_no_backend(fx: &mut Fixture) -> Vec<TraceRecord> {
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
