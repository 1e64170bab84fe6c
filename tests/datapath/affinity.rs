//! Session affinity.

use crate::common::*;

/// `traced_fixture()` with session affinity of `timeout` seconds on `vip`'s TCP frontend.
pub(crate) fn affine_fixture(vip: IpAddr, timeout: u32) -> Fixture {
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
pub(crate) fn syn_to(fx: &mut Fixture, client: IpAddr, sport: u16, vip: IpAddr) -> (IpAddr, u8) {
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
