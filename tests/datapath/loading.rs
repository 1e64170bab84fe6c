//! Loading and programming: batched cold applies, full and mismatched maps, verifier cost.

use crate::common::*;

#[test]
fn a_cold_apply_writes_in_batches_what_entry_by_entry_writes_hold() {
    // More service entries than one batch call takes (4096), in both families: the first apply
    // on empty kernel maps holds its writes and releases them in batches; the in-memory maps
    // take the same apply entry by entry.
    let mut desired = DesiredState::default();
    for i in 0..1500u32 {
        let [_, _, hi, lo] = i.to_be_bytes();
        let vip4: IpAddr = Ipv4Addr::new(198, 19, hi, lo).into();
        let vip6: IpAddr = Ipv6Addr::new(0x2001, 0xdb8, 0xffff, 0, 0, 0, 0, i as u16).into();
        let b4: Vec<IpAddr> = (0..3u8)
            .map(|k| Ipv4Addr::new(198, 18, hi.wrapping_add(k), lo).into())
            .collect();
        let b6: Vec<IpAddr> = (0..3u16)
            .map(|k| Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, k, i as u16).into())
            .collect();
        for (fe, entry) in [
            service(vip4, Proto::Tcp, &b4),
            service(vip6, Proto::Udp, &b6),
        ] {
            desired.services.insert(fe, entry);
        }
    }
    let opts = LoadOptions {
        max_entries: [("lb4_services", 1 << 13), ("lb6_services", 1 << 13)]
            .into_iter()
            .map(|(m, n)| (m.to_string(), n))
            .collect(),
        ..LoadOptions::default()
    };
    let mut datapath = Datapath::load(&opts).expect("load");
    let mut kernel = Reconciler::new(datapath.take_lb_maps().unwrap()).unwrap();
    let report = kernel.apply(&desired);
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    let mut mem = Reconciler::new(lb::datapath::testing::MemMaps::with_capacity(1 << 13)).unwrap();
    let report = mem.apply(&desired);
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    let dump = lb::datapath::maps::LbMaps::dump(kernel.maps()).unwrap();
    assert_eq!(dump.services.len(), 2 * 1500 * 4);
    assert_eq!(
        dump,
        mem.maps().dump,
        "kernel maps differ from entry-by-entry writes"
    );
}

#[test]
fn full_service_map_is_reported_and_previous_state_kept() {
    // Real kernel maps with room for 3 service entries (master + slots).
    let opts = LoadOptions {
        max_entries: [("lb4_services".to_string(), 3)].into_iter().collect(),
        ..LoadOptions::default()
    };
    let mut datapath = Datapath::load(&opts).expect("load");
    let mut reconciler = Reconciler::new(datapath.take_lb_maps().unwrap()).unwrap();
    let b4: Vec<IpAddr> = BACKENDS4.iter().map(|a| (*a).into()).collect();
    let other: IpAddr = Ipv4Addr::new(198, 19, 0, 20).into();

    // VIP4 with one backend (2 entries) fits; the other with three (4 entries) does not.
    let mut desired = DesiredState::default();
    let (fe, small) = service(VIP4.into(), Proto::Tcp, &b4[..1]);
    desired.services.insert(fe, small);
    let (fe_other, big) = service(other, Proto::Tcp, &b4);
    desired.services.insert(fe_other, big);
    let report = reconciler.apply(&desired);
    assert_eq!(report.errors.len(), 1, "{:?}", report.errors);
    assert_eq!(report.errors[0].frontend, fe_other);
    assert!(
        report.errors[0].error.contains("lb4_services is full"),
        "{:?}",
        report.errors
    );

    let mut fx = Fixture {
        datapath,
        _reconciler: reconciler,
        desired,
    };
    let run = |fx: &mut Fixture, dst: IpAddr, sport: u16| {
        fx.ingress(&packet(CLIENT4.into(), sport, dst, VPORT, L4::TcpSyn))
    };
    let (verdict, out) = run(&mut fx, VIP4.into(), 1000);
    assert_eq!(verdict, TC_ACT_OK);
    assert_eq!(
        parse_and_verify(&out).dst,
        b4[0],
        "the service that fit works"
    );
    let pkt = packet(CLIENT4.into(), 1001, other, VPORT, L4::TcpSyn);
    assert_eq!(
        fx.ingress(&pkt),
        (TC_ACT_OK, pkt.clone()),
        "nothing half-written"
    );

    // Growing VIP4 to three backends needs 4 entries in a map of 3. Its previous state (one
    // backend) must stay intact and keep serving.
    let mut grow = DesiredState::default();
    let (fe, bigger) = service(VIP4.into(), Proto::Tcp, &b4);
    grow.services.insert(fe, bigger);
    grow.services
        .insert(fe_other, service(other, Proto::Tcp, &b4).1);
    let report = fx._reconciler.apply(&grow);
    assert_eq!(report.errors.len(), 2, "{:?}", report.errors);
    for sport in 2000..2030 {
        let (_, out) = run(&mut fx, VIP4.into(), sport);
        assert_eq!(parse_and_verify(&out).dst, b4[0], "previous state kept");
    }
}

#[test]
fn pinned_map_of_another_size_is_refused() {
    /// Removes the pins even when an assertion fails.
    struct PinDir(std::path::PathBuf);
    impl Drop for PinDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let dir = std::path::PathBuf::from(format!("/sys/fs/bpf/lb-test-size-{}", std::process::id()));
    let _cleanup = PinDir(dir.clone());
    let pinned = LoadOptions {
        pin_dir: Some(dir.clone()),
        ..LoadOptions::default()
    };
    drop(Datapath::load(&pinned).expect("first load pins"));
    let resized = LoadOptions {
        max_entries: [("lb4_ct_tcp".to_string(), 1024)].into_iter().collect(),
        ..pinned.clone()
    };
    let err = Datapath::load(&resized)
        .err()
        .expect("resized load must fail");
    let err = format!("{err:#}");
    assert!(
        err.contains("cannot be resized") && err.contains("--bpf-ct-global-tcp-max"),
        "{err}"
    );
}

#[test]
fn packet_programs_stay_far_below_the_verifier_limit() {
    // The SCTP CRC update costs verifier work at every rewrite site; keep the total well under
    // the 1M-instruction limit (kernels report the count since 5.16).
    let mut dp = Datapath::load(&LoadOptions::default()).expect("load datapath (root?)");
    for name in [
        prog_names::XDP,
        prog_names::TC_INGRESS,
        prog_names::TC_POD,
        prog_names::TC_EGRESS,
    ] {
        let info = dp
            .ebpf_mut()
            .program(name)
            .expect(name)
            .info()
            .expect("prog info");
        let Some(verified) = info.verified_instruction_count() else {
            eprintln!("{name}: kernel does not report verified instructions; skipped");
            return;
        };
        eprintln!("{name}: {verified} verified instructions");
        assert!(
            verified < 250_000,
            "{name}: {verified} verified instructions"
        );
    }
}

/// Socket storage is a branch on the frozen global `LB_HAS_SK_STORAGE`, like
/// `LB_HAS_SET_RETVAL`: with 0 no `bpf_sk_storage_get` call is left in the loaded socket LB
/// and egress programs (kernels without the helper for sock_addr programs load them and use
/// `lb*_sk_revnat`); with the probe's 1 every program that remembers or recalls a pair calls
/// it.
#[test]
fn sk_storage_calls_are_dead_code_unless_the_probe_found_the_helper() {
    let found = lb::datapath::load::sock_storage_supported();
    for (no_sk_storage, present) in [(true, false), (false, found)] {
        let mut dp = Datapath::load(&LoadOptions {
            no_sk_storage,
            ..LoadOptions::default()
        })
        .expect("load datapath (root?)");
        assert_eq!(dp.sock_uses_sk_storage(), present);
        for name in [
            prog_names::CONNECT4,
            prog_names::SENDMSG6,
            prog_names::RECVMSG4,
            prog_names::GETPEERNAME6,
            prog_names::SK_EGRESS,
        ] {
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
                text.contains("sk_storage_get"),
                present,
                "{name} (no_sk_storage: {no_sk_storage}):\n{text}"
            );
            // The LRU stays, for the overflow (and for sockets without storage).
            assert!(
                text.contains("map_lookup_elem") || text.contains("map_update_elem"),
                "{name}: still reaches lb*_sk_revnat:\n{text}"
            );
        }
    }
}
