//! Maglev on the packet path with BPF_PROG_TEST_RUN: the real programs and maps, tables built
//! and written by the real reconciler. 10,000+ distinct flows meet a Maglev service of 10
//! backends; after one backend is removed (the table rewritten in place) and conntrack cleared,
//! the same flows come again: about 1/N of them may move, and next to none that were not on
//! the removed backend. A random service moves about (N-1)/N for contrast. The datapath tests
//! need root; the reconciler's (`mod reconcile`) run against in-memory maps.
use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr},
};

use aya::{
    maps::{HashMap, MapData},
    programs::{SchedClassifier, TestRun as _, TestRunOptions},
};
use etherparse::{NetHeaders, PacketBuilder, PacketHeaders};
use lb::{
    datapath::load::{Datapath, LoadOptions},
    datapath::maps::BpfMaps,
    model::{
        Backend, DesiredState, Frontend, L4Addr, LbAlgorithm, Proto, ServiceEntry, ServicePortName,
    },
    reconcile::Reconciler,
};
use lb_common::{Ct4Key, Ct4Value, flow_hash, lb_alg, map_names, prog_names, svc_flags};

const MAGLEV_VIP: Ipv4Addr = Ipv4Addr::new(198, 19, 5, 1);
const RANDOM_VIP: Ipv4Addr = Ipv4Addr::new(198, 19, 5, 2);
const VPORT: u16 = 53;
const BPORT: u16 = 5353;
const N: u8 = 10;
/// Distinct flows: 4 clients × 2,600 source ports.
const CLIENTS: u8 = 4;
const PORTS: u16 = 2_600;
const M: u32 = 16381;

fn backends(n: u8, skip: Option<u8>) -> Vec<Backend> {
    (0..n)
        .filter(|i| Some(*i) != skip)
        .map(|i| {
            Backend::active(L4Addr {
                addr: Ipv4Addr::new(198, 18, 20, 10 + i).into(),
                port: BPORT,
                proto: Proto::Udp,
            })
        })
        .collect()
}

fn entry(name: &str, algorithm: LbAlgorithm, backends: Vec<Backend>) -> ServiceEntry {
    ServiceEntry {
        name: ServicePortName {
            namespace: "test".into(),
            name: name.into(),
            port_name: "dns".into(),
        },
        flags: svc_flags::CLUSTER_IP,
        backends,
        algorithm,
        ..ServiceEntry::default()
    }
}

fn desired(skip: Option<u8>) -> DesiredState {
    let mut d = DesiredState::default();
    d.services.insert(
        Frontend::new(MAGLEV_VIP.into(), VPORT, Proto::Udp),
        entry("maglev", LbAlgorithm::Maglev, backends(N, skip)),
    );
    d.services.insert(
        Frontend::new(RANDOM_VIP.into(), VPORT, Proto::Udp),
        entry("random", LbAlgorithm::Random, backends(N, skip)),
    );
    d
}

struct Node {
    datapath: Datapath,
    reconciler: Reconciler<BpfMaps>,
}

impl Node {
    fn new() -> Self {
        let mut datapath = Datapath::load(&LoadOptions {
            maglev_table_size: M,
            maglev_tables: 4,
            ..LoadOptions::default()
        })
        .expect("load datapath (root?)");
        let reconciler = Reconciler::new(datapath.take_lb_maps().expect("maps")).expect("rec");
        Self {
            datapath,
            reconciler,
        }
    }

    fn apply(&mut self, d: &DesiredState) {
        let report = self.reconciler.apply(d);
        assert!(report.errors.is_empty(), "{:?}", report.errors);
        assert!(report.fallbacks.is_empty(), "{:?}", report.fallbacks);
    }

    /// The backend address a new UDP flow `client:sport → vip` is DNATed to.
    fn backend_of(&mut self, client: Ipv4Addr, sport: u16, vip: Ipv4Addr) -> Ipv4Addr {
        let mut pkt = Vec::new();
        PacketBuilder::ethernet2([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2])
            .ipv4(client.octets(), vip.octets(), 64)
            .udp(sport, VPORT)
            .write(&mut pkt, b"maglev")
            .expect("build");
        let prog: &mut SchedClassifier = self
            .datapath
            .ebpf_mut()
            .program_mut(prog_names::TC_POD)
            .expect("program")
            .try_into()
            .expect("classifier");
        let mut out = vec![0u8; pkt.len() + 256];
        let mut opts = TestRunOptions::new();
        opts.data_in = Some(&pkt);
        opts.data_out = Some(&mut out);
        let r = prog.test_run(opts).expect("BPF_PROG_TEST_RUN");
        out.truncate(r.data_size_out as usize);
        let h = PacketHeaders::from_ethernet_slice(&out).expect("output parses");
        match h.net {
            Some(NetHeaders::Ipv4(ip, _)) => Ipv4Addr::from(ip.destination),
            other => panic!("no IPv4 output: {other:?}"),
        }
    }

    fn clear_conntrack(&mut self) {
        for name in [map_names::CT_TCP4, map_names::CT_ANY4] {
            let mut ct: HashMap<&mut MapData, Ct4Key, Ct4Value> =
                HashMap::try_from(self.datapath.ebpf_mut().map_mut(name).expect(name)).expect("ct");
            let keys: Vec<Ct4Key> = ct.keys().filter_map(Result::ok).collect();
            for k in keys {
                let _ = ct.remove(&k);
            }
            assert_eq!(ct.keys().count(), 0, "{name} cleared");
        }
    }

    /// Every flow's backend for `vip`.
    fn round(&mut self, vip: Ipv4Addr) -> BTreeMap<(u8, u16), Ipv4Addr> {
        let mut out = BTreeMap::new();
        for c in 0..CLIENTS {
            let client = Ipv4Addr::new(198, 18, 30, 2 + c);
            for i in 0..PORTS {
                let sport = 20_000 + i;
                let b = self.backend_of(client, sport, vip);
                assert_ne!(b, vip, "flow {client}:{sport} was not balanced");
                out.insert((c, sport), b);
            }
        }
        out
    }
}

/// (moved fraction, moved fraction of flows whose backend stayed) between two rounds.
fn moved(
    before: &BTreeMap<(u8, u16), Ipv4Addr>,
    after: &BTreeMap<(u8, u16), Ipv4Addr>,
    gone: Ipv4Addr,
) -> (f64, f64) {
    let moved = before.iter().filter(|(k, b)| after[*k] != **b).count();
    let kept: Vec<_> = before.iter().filter(|(_, b)| **b != gone).collect();
    let kept_moved = kept.iter().filter(|(k, b)| after[*k] != **b).count();
    (
        moved as f64 / before.len() as f64,
        kept_moved as f64 / kept.len() as f64,
    )
}

#[test]
fn maglev_moves_about_one_nth_of_flows_when_one_of_n_backends_goes() {
    let flows = usize::from(CLIENTS) * usize::from(PORTS);
    assert!(flows >= 10_000);
    let mut node = Node::new();
    node.apply(&desired(None));
    let maglev_before = node.round(MAGLEV_VIP);
    let random_before = node.round(RANDOM_VIP);
    // Balanced: every backend gets about 1/N of the flows.
    let mut per: BTreeMap<Ipv4Addr, usize> = BTreeMap::new();
    for b in maglev_before.values() {
        *per.entry(*b).or_default() += 1;
    }
    assert_eq!(per.len(), usize::from(N), "{per:?}");
    for (b, n) in &per {
        let share = *n as f64 / flows as f64;
        assert!((0.07..=0.13).contains(&share), "{b}: {share:.3} of flows");
    }

    // Backend 3 goes: the reconciler rewrites the Maglev table in place.
    let gone = Ipv4Addr::new(198, 18, 20, 13);
    node.apply(&desired(Some(3)));
    node.clear_conntrack();
    let maglev_after = node.round(MAGLEV_VIP);
    let random_after = node.round(RANDOM_VIP);
    assert!(maglev_after.values().all(|b| *b != gone));
    let (m_moved, m_kept_moved) = moved(&maglev_before, &maglev_after, gone);
    let (r_moved, r_kept_moved) = moved(&random_before, &random_after, gone);
    println!(
        "maglev: {flows} flows, N={N}, M={M}: {:.2}% moved ({:.2}% of flows not on the removed \
         backend); random: {:.2}% moved ({:.2}%)",
        m_moved * 100.0,
        m_kept_moved * 100.0,
        r_moved * 100.0,
        r_kept_moved * 100.0
    );
    assert!(
        (0.08..=0.13).contains(&m_moved),
        "maglev moved {m_moved:.4} of flows, want about 1/{N}"
    );
    assert!(
        m_kept_moved <= 0.03,
        "maglev moved {m_kept_moved:.4} of the flows whose backend stayed"
    );
    assert!(r_moved >= 0.8, "random moved only {r_moved:.4}");
}

#[test]
fn maglev_picks_the_same_backend_on_every_node() {
    // Two nodes with the same backends under different backend ids (node B saw another
    // service first): every flow meets the same backend on both, as ECMP'd traffic must.
    let mut a = Node::new();
    a.apply(&desired(None));
    let mut b = Node::new();
    let mut other = desired(None);
    other.services.insert(
        Frontend::new(Ipv4Addr::new(198, 19, 5, 3).into(), VPORT, Proto::Udp),
        entry(
            "other",
            LbAlgorithm::Random,
            vec![Backend::active(L4Addr {
                addr: Ipv4Addr::new(198, 18, 21, 1).into(),
                port: BPORT,
                proto: Proto::Udp,
            })],
        ),
    );
    let mut first = DesiredState::default();
    first.services.extend(
        other
            .services
            .iter()
            .filter(|(_, e)| &*e.name.name == "other")
            .map(|(f, e)| (*f, e.clone())),
    );
    b.apply(&first);
    b.apply(&other);
    let client = Ipv4Addr::new(198, 18, 30, 2);
    let (mut differ, mut hashed) = (0, BTreeMap::<Ipv4Addr, usize>::new());
    for sport in 30_000..32_000u16 {
        let (x, y) = (
            a.backend_of(client, sport, MAGLEV_VIP),
            b.backend_of(client, sport, MAGLEV_VIP),
        );
        differ += usize::from(x != y);
        *hashed.entry(x).or_default() += 1;
        // The same flow again (established now): still the same backend.
        assert_eq!(x, a.backend_of(client, sport, MAGLEV_VIP));
    }
    assert_eq!(differ, 0, "flows that met different backends on two nodes");
    assert_eq!(hashed.len(), usize::from(N), "{hashed:?}");
    // The master names its table; the hash is lb-common's (the trace test checks the cell).
    let fe = Frontend::new(MAGLEV_VIP.into(), VPORT, Proto::Udp);
    let master = a.reconciler.maps().service(&fe, 0).expect("master");
    assert_eq!(master.lb_alg, lb_alg::MAGLEV);
    let cell = flow_hash(&client.octets(), &MAGLEV_VIP.octets(), 30_000, VPORT, 17) % M;
    let id = a
        .reconciler
        .maps()
        .maglev_cell(master.backend_id, cell)
        .expect("cell");
    let want: IpAddr = a.backend_of(client, 30_000, MAGLEV_VIP).into();
    assert_eq!(
        a.reconciler
            .maps()
            .backend(lb::model::Family::V4, id)
            .map(|s| s.ip()),
        Some(want),
        "cell {cell} names the backend the datapath chose"
    );
}

#[test]
fn pinned_maglev_tables_of_another_shape_are_refused_and_reused_when_equal() {
    /// Removes the pins even when an assertion fails.
    struct PinDir(std::path::PathBuf);
    impl Drop for PinDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let dir =
        std::path::PathBuf::from(format!("/sys/fs/bpf/lb-test-maglev-{}", std::process::id()));
    let _cleanup = PinDir(dir.clone());
    let opts = |m: u32, tables: u32| LoadOptions {
        pin_dir: Some(dir.clone()),
        maglev_table_size: m,
        maglev_tables: tables,
        ..LoadOptions::default()
    };
    // A first lb programs a Maglev service into the pins.
    {
        let mut dp = Datapath::load(&opts(251, 509)).expect("first load pins");
        let mut rec = Reconciler::new(dp.take_lb_maps().unwrap()).unwrap();
        let r = rec.apply(&desired(None));
        assert!(r.errors.is_empty() && r.fallbacks.is_empty(), "{r:?}");
    }
    // Without --bpf-maglev-tables a restart keeps the pinned table count (same M only).
    assert_eq!(
        lb::datapath::load::pinned_maglev_tables(&dir, 251),
        Some(509)
    );
    assert_eq!(lb::datapath::load::pinned_maglev_tables(&dir, 509), None);
    // The same number of cells laid out with another M would be read at the wrong offsets.
    let err = Datapath::load(&opts(509, 251))
        .err()
        .expect("other M refused");
    let msg = format!("{err:#}");
    assert!(
        msg.contains("251 cells each") && msg.contains("--maglev-table-size 251"),
        "{msg}"
    );
    let err = Datapath::load(&opts(251, 16))
        .err()
        .expect("other table count refused");
    assert!(format!("{err:#}").contains("Maglev cells"), "{err:#}");
    // The same shape is reused: a restart rebuilds nothing and writes nothing.
    let mut dp = Datapath::load(&opts(251, 509)).expect("same shape reused");
    let mut rec = Reconciler::new(dp.take_lb_maps().unwrap()).unwrap();
    let r = rec.apply(&desired(None));
    assert!(r.errors.is_empty() && r.fallbacks.is_empty(), "{r:?}");
    assert_eq!(r.writes, 0, "a restart rewrote {} entries", r.writes);
}

// ---------------------------------------------------------------------------------------------
// The reconciler's Maglev writes, against the in-memory maps' journal (no root needed).

mod reconcile {
    use std::collections::BTreeMap;

    use lb::{
        datapath::maps::{Dump, maglev_table_of},
        datapath::testing::{MapOp, MemMaps},
        model::{DesiredState, Frontend, LbAlgorithm, Proto},
        reconcile::Reconciler,
    };
    use lb_common::{SvcValue, lb_alg};

    use super::{backends, entry};

    fn fe(n: u8) -> Frontend {
        Frontend::new(
            std::net::Ipv4Addr::new(198, 19, 6, n).into(),
            80,
            Proto::Udp,
        )
    }

    /// Replays `ops` onto `dump`, checking after each that every Maglev master's table is whole:
    /// every cell names a backend that exists (what a packet can meet).
    fn replay_checked(mut dump: Dump, ops: &[MapOp], m: usize) -> Dump {
        let check = |d: &Dump, after: &MapOp| {
            for ((f, slot), v) in &d.services {
                let Some(t) = maglev_table_of(v).filter(|_| *slot == 0 && v.count > 0) else {
                    continue;
                };
                let cells = d
                    .maglev
                    .get(&t)
                    .unwrap_or_else(|| panic!("{f}: table {t} missing"));
                assert_eq!(cells.len(), m);
                for (c, id) in cells.iter().enumerate() {
                    assert!(
                        d.backends.contains_key(id),
                        "after `{after}`: {f} table {t} cell {c} names missing backend {id}"
                    );
                }
            }
        };
        for op in ops {
            match op {
                MapOp::PutBackend { id, backend } => {
                    dump.backends.insert(*id, *backend);
                }
                MapOp::DelBackend { id } => {
                    dump.backends.remove(id);
                }
                MapOp::PutService {
                    frontend,
                    slot,
                    value,
                } => {
                    dump.services.insert((*frontend, *slot), *value);
                }
                MapOp::DelService { frontend, slot } => {
                    dump.services.remove(&(*frontend, *slot));
                }
                MapOp::PutMaglev { table, cell, id } => {
                    dump.maglev.entry(*table).or_insert_with(|| vec![0; m])[*cell as usize] = *id;
                }
                _ => {}
            }
            check(&dump, op);
        }
        dump
    }

    fn state(services: &[(u8, LbAlgorithm, Vec<lb::model::Backend>)]) -> DesiredState {
        let mut d = DesiredState::default();
        for (n, alg, b) in services {
            d.services.insert(fe(*n), entry("s", *alg, b.clone()));
        }
        d
    }

    fn master(rec: &Reconciler<MemMaps>, n: u8) -> SvcValue {
        rec.maps().dump.services[&(fe(n), 0)]
    }

    #[test]
    fn tables_are_written_before_their_master_and_always_whole() {
        use LbAlgorithm::{Maglev, Random};
        let maps = MemMaps::with_capacity(1024);
        let m = maps.maglev_geometry.table_size as usize;
        let mut rec = Reconciler::new(maps).unwrap();
        let steps = [
            // A new Maglev service and a random one.
            state(&[
                (1, Maglev, backends(5, None)),
                (2, Random, backends(3, None)),
            ]),
            // One backend goes, two come: the table is rewritten in place.
            state(&[
                (
                    1,
                    Maglev,
                    [backends(4, None), backends(7, None)[5..].to_vec()].concat(),
                ),
                (2, Random, backends(3, None)),
            ]),
            // Random now: the table is freed after the master stops naming it.
            state(&[
                (1, Random, backends(4, None)),
                (2, Random, backends(3, None)),
            ]),
            // Both Maglev: the freed index is reused, written before a master names it.
            state(&[
                (1, Maglev, backends(2, None)),
                (2, Maglev, backends(3, None)),
            ]),
            // Gone.
            state(&[(2, Maglev, backends(3, None))]),
        ];
        let mut tables_seen = Vec::new();
        for (i, d) in steps.iter().enumerate() {
            let before = rec.maps().dump.clone();
            let from = rec.maps().journal.len();
            let r = rec.apply(d);
            assert!(
                r.errors.is_empty() && r.fallbacks.is_empty(),
                "step {i}: {r:?}"
            );
            let ops = rec.maps().journal[from..].to_vec();
            let replayed = replay_checked(before, &ops, m);
            assert_eq!(replayed.services, rec.maps().dump.services, "step {i}");
            // The cells go before the master that names their table.
            for f in d.services.keys() {
                let Some(t) = maglev_table_of(&rec.maps().dump.services[&(*f, 0)]) else {
                    continue;
                };
                let last_cell = ops
                    .iter()
                    .rposition(|o| matches!(o, MapOp::PutMaglev { table, .. } if *table == t));
                let master_put = ops.iter().position(
                    |o| matches!(o, MapOp::PutService { frontend, slot: 0, .. } if frontend == f),
                );
                if let (Some(c), Some(p)) = (last_cell, master_put) {
                    assert!(c < p, "step {i}: {f}: a cell of table {t} after the master");
                }
            }
            tables_seen.push(
                d.services
                    .keys()
                    .map(|f| {
                        (
                            f.l4.addr,
                            maglev_table_of(&rec.maps().dump.services[&(*f, 0)]),
                        )
                    })
                    .collect::<BTreeMap<_, _>>(),
            );
            // Unchanged input: nothing written, nothing rebuilt.
            let again = rec.apply(d);
            assert_eq!((again.writes, again.deletes), (0, 0), "step {i} again");
        }
        assert_eq!(master(&rec, 2).lb_alg, lb_alg::MAGLEV);
        // Step 1 rewrote table 0 in place; step 3 reused the freed index for service 1.
        assert_eq!(tables_seen[0][&fe(1).l4.addr], Some(0));
        assert_eq!(tables_seen[1][&fe(1).l4.addr], Some(0));
        assert_eq!(tables_seen[2][&fe(1).l4.addr], None);
        assert_eq!(tables_seen[3][&fe(1).l4.addr], Some(0));
        assert_eq!(tables_seen[3][&fe(2).l4.addr], Some(1));
        // No backend is left that nothing names.
        let dump = &rec.maps().dump;
        assert_eq!(dump.backends.len(), 3, "{:?}", dump.backends);
    }

    #[test]
    fn no_free_table_falls_back_to_random_and_is_reported() {
        let maps = MemMaps::with_capacity(1024);
        let tables = maps.maglev_geometry.tables;
        let mut rec = Reconciler::new(maps).unwrap();
        let all: Vec<_> = (1..=tables as u8 + 1)
            .map(|n| (n, LbAlgorithm::Maglev, backends(3, None)))
            .collect();
        let r = rec.apply(&state(&all));
        assert!(r.errors.is_empty(), "{r:?}");
        assert_eq!(r.fallbacks.len(), 1, "{r:?}");
        let fb = &r.fallbacks[0];
        assert_eq!(fb.full_map, Some(lb_common::map_names::MAGLEV));
        assert!(fb.error.contains("random"), "{}", fb.error);
        let last = tables as u8 + 1;
        assert_eq!(fb.frontend, fe(last));
        assert_eq!(master(&rec, last).lb_alg, lb_alg::RANDOM);
        assert_eq!(master(&rec, last).backend_id, 0);
        assert_eq!(rec.maglev_usage(), (tables as usize, tables));
        // Once a table is free, the service gets it.
        let r = rec.apply(&state(&all[1..]));
        assert!(r.fallbacks.is_empty(), "{r:?}");
        assert_eq!(master(&rec, last).lb_alg, lb_alg::MAGLEV);
        assert_eq!(maglev_table_of(&master(&rec, last)), Some(0));
    }

    #[test]
    fn a_table_freed_later_in_the_same_apply_goes_to_a_frontend_that_fell_back() {
        use LbAlgorithm::{Maglev, Random};
        let maps = MemMaps::with_capacity(1024);
        let tables = maps.maglev_geometry.tables as u8;
        let mut rec = Reconciler::new(maps).unwrap();
        // Frontends 2..=tables+1 hold every table.
        let mut services: Vec<_> = (2..=tables + 1)
            .map(|n| (n, Maglev, backends(3, None)))
            .collect();
        let r = rec.apply(&state(&services));
        assert!(r.errors.is_empty() && r.fallbacks.is_empty(), "{r:?}");
        // Frontend 1 (first in apply order) wants a table; the last one lets its own go.
        services.last_mut().unwrap().1 = Random;
        services.insert(0, (1, Maglev, backends(4, None)));
        let r = rec.apply(&state(&services));
        assert!(r.errors.is_empty() && r.fallbacks.is_empty(), "{r:?}");
        let freed = tables - 1;
        assert_eq!(maglev_table_of(&master(&rec, 1)), Some(u32::from(freed)));
        assert_eq!(master(&rec, tables + 1).lb_alg, lb_alg::RANDOM);
        // One apply converged: a fresh reconciler over the maps has nothing to write.
        let mut fresh = Reconciler::new(rec.maps().clone()).unwrap();
        let again = fresh.apply(&state(&services));
        assert_eq!((again.writes, again.deletes), (0, 0), "{again:?}");
    }

    #[test]
    fn a_restart_reuses_the_tables_it_finds() {
        let maps = MemMaps::with_capacity(1024);
        let mut rec = Reconciler::new(maps).unwrap();
        let d = state(&[
            (1, LbAlgorithm::Maglev, backends(4, None)),
            (2, LbAlgorithm::Maglev, backends(6, None)),
        ]);
        rec.apply(&d);
        let mut maps = rec.maps().clone();
        maps.journal.clear();
        let mut restarted = Reconciler::new(maps).unwrap();
        let r = restarted.apply(&d);
        assert_eq!(
            (r.writes, r.deletes),
            (0, 0),
            "{:?}",
            restarted.maps().journal
        );
        // A table whose cells were lost (lb_maglev removed by hand) is rewritten in place.
        let mut maps = rec.maps().clone();
        let t = maglev_table_of(&maps.dump.services[&(fe(2), 0)]).unwrap();
        maps.dump
            .maglev
            .insert(t, vec![0; maps.maglev_geometry.table_size as usize]);
        maps.journal.clear();
        let mut restarted = Reconciler::new(maps).unwrap();
        restarted.apply(&d);
        let m = restarted.maps().maglev_geometry.table_size as usize;
        let journal = &restarted.maps().journal;
        let cells = journal
            .iter()
            .filter(|o| matches!(o, MapOp::PutMaglev { table, id, .. } if *table == t && *id != 0))
            .count();
        assert_eq!(cells, m, "every cell rewritten: {journal:?}");
        // Besides the cells, only its master is rewritten (unchanged), after them.
        let others: Vec<_> = journal
            .iter()
            .filter(|o| !matches!(o, MapOp::PutMaglev { .. }))
            .collect();
        assert!(
            matches!(others.as_slice(), [MapOp::PutService { frontend, slot: 0, .. }] if *frontend == fe(2)),
            "{others:?}"
        );
    }
}
