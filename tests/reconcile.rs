//! Tests of the reconciler (`lb::reconcile::Reconciler`) against the in-memory maps
//! (`lb::datapath::testing::MemMaps`): what it writes, in which order, and what it leaves behind.
//!
//! Every expectation is derived from the desired state (which frontends, which backends in which
//! slots) or from the datapath's lookup rules (master entry at slot 0 with a count, slots
//! `1..=count+qcount`, backend and rev-NAT entries by id), never copied from the reconciler's
//! output.
use std::{
    cell::{Cell, RefCell},
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use lb::{
    datapath::maps::{AffMatch, Dump, LbMaps, MapOpError, Table},
    datapath::testing::{MapOp, MemMaps, render},
    model::{
        Backend, BackendState, Cidr, DesiredState, Family, Frontend, L4Addr, Proto, Scope,
        ServiceEntry, ServicePortName,
    },
    reconcile::{ApplyReport, Reconciler},
};
use lb_common::{EchoValue, SvcValue, svc_flags};

// ---------------------------------------------------------------------------------------------
// Building desired states. Documentation addresses only: frontends in 198.19.0.0/16 and
// 2001:db8:ffff::/96, backends in 198.18.0.0/16 and 2001:db8::/96.

const VPORT: u16 = 80;
const BPORT: u16 = 8080;

fn vip4(n: u8) -> IpAddr {
    Ipv4Addr::new(198, 19, 0, n).into()
}

fn vip6(n: u16) -> IpAddr {
    Ipv6Addr::new(0x2001, 0xdb8, 0xffff, 0, 0, 0, 0, n).into()
}

fn fe4(n: u8) -> Frontend {
    Frontend::new(vip4(n), VPORT, Proto::Tcp)
}

fn fe6(n: u16) -> Frontend {
    Frontend::new(vip6(n), VPORT, Proto::Tcp)
}

fn be4(n: u8) -> Backend {
    Backend::active(L4Addr {
        addr: Ipv4Addr::new(198, 18, 0, n).into(),
        port: BPORT,
        proto: Proto::Tcp,
    })
}

fn be6(n: u16) -> Backend {
    Backend::active(L4Addr {
        addr: Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, n).into(),
        port: BPORT,
        proto: Proto::Tcp,
    })
}

fn terminating(b: Backend) -> Backend {
    Backend {
        state: BackendState::Terminating,
        ..b
    }
}

fn entry(name: &str, backends: &[Backend]) -> ServiceEntry {
    ServiceEntry {
        name: ServicePortName {
            namespace: "test".into(),
            name: name.into(),
            port_name: "http".into(),
        },
        flags: svc_flags::CLUSTER_IP,
        backends: backends.to_vec(),
        ..ServiceEntry::default()
    }
}

fn desired(services: &[(Frontend, &[Backend])]) -> DesiredState {
    let mut d = DesiredState::default();
    for (i, (fe, backends)) in services.iter().enumerate() {
        d.services.insert(*fe, entry(&format!("svc{i}"), backends));
    }
    d
}

fn fresh() -> Reconciler<MemMaps> {
    Reconciler::new(MemMaps::with_capacity(1024)).expect("MemMaps dumps")
}

// ---------------------------------------------------------------------------------------------
// The write journal.

#[derive(Clone, Debug, PartialEq, Eq)]
enum Op {
    PutBackend(u32),
    DelBackend(u32),
    PutRevNat(u32),
    DelRevNat(u32),
    PutSlot {
        fe: String,
        slot: u16,
        backend: u32,
        count: u16,
    },
    DelSlot {
        fe: String,
        slot: u16,
    },
    PutClusterIp(String),
    DelClusterIp(String),
    PutSrcRange(u32, String),
    DelSrcRange(u32, String),
    /// (rev-NAT id, backend id)
    PutAffMatch(u32, u32),
    DelAffMatch(u32, u32),
    PutEcho(String),
    DelEcho(String),
    PutMaglev {
        table: u32,
        cell: u32,
        id: u32,
    },
}

/// The journal entry in the form the assertions match on.
fn op_of(m: &MapOp) -> Op {
    match m {
        MapOp::PutBackend { id, .. } => Op::PutBackend(*id),
        MapOp::DelBackend { id } => Op::DelBackend(*id),
        MapOp::PutRevNat { id, .. } => Op::PutRevNat(*id),
        MapOp::DelRevNat { id } => Op::DelRevNat(*id),
        MapOp::PutService {
            frontend,
            slot,
            value,
        } => Op::PutSlot {
            fe: frontend.to_string(),
            slot: *slot,
            backend: value.backend_id,
            count: value.count,
        },
        MapOp::DelService { frontend, slot } => Op::DelSlot {
            fe: frontend.to_string(),
            slot: *slot,
        },
        MapOp::PutClusterIp { addr, .. } => Op::PutClusterIp(addr.to_string()),
        MapOp::DelClusterIp { addr } => Op::DelClusterIp(addr.to_string()),
        MapOp::PutSrcRange { rev_nat_id, cidr } => Op::PutSrcRange(*rev_nat_id, cidr.to_string()),
        MapOp::DelSrcRange { rev_nat_id, cidr } => Op::DelSrcRange(*rev_nat_id, cidr.to_string()),
        MapOp::PutAffMatch(m) => Op::PutAffMatch(m.rev_nat_id, m.backend_id),
        MapOp::DelAffMatch(m) => Op::DelAffMatch(m.rev_nat_id, m.backend_id),
        MapOp::PutEcho { addr, .. } => Op::PutEcho(addr.to_string()),
        MapOp::DelEcho { addr } => Op::DelEcho(addr.to_string()),
        MapOp::PutMaglev { table, cell, id } => Op::PutMaglev {
            table: *table,
            cell: *cell,
            id: *id,
        },
    }
}

/// Applies `d` and returns the report and the operations it performed, in order.
fn apply_logged<M: LbMaps + HasMem>(
    rec: &mut Reconciler<M>,
    d: &DesiredState,
) -> (ApplyReport, Vec<Op>) {
    let before = rec.maps().mem().journal.len();
    let report = rec.apply(d);
    let journal = &rec.maps().mem().journal[before..];
    let writes = journal.iter().filter(|m| m.is_write()).count();
    let ops: Vec<Op> = journal.iter().map(op_of).collect();
    assert_eq!(
        report.writes, writes,
        "report.writes must count the map writes: {ops:#?}"
    );
    assert_eq!(
        report.deletes,
        ops.len() - writes,
        "report.deletes must count the map deletes: {ops:#?}"
    );
    (report, ops)
}

fn position(ops: &[Op], what: &str, pred: impl Fn(&Op) -> bool) -> usize {
    ops.iter()
        .position(pred)
        .unwrap_or_else(|| panic!("no {what} in {ops:#?}"))
}

fn master_put(ops: &[Op], fe: &Frontend) -> usize {
    let name = fe.to_string();
    position(
        ops,
        &format!("master put of {name}"),
        |o| matches!(o, Op::PutSlot { fe, slot: 0, .. } if *fe == name),
    )
}

fn slot_del(ops: &[Op], fe: &Frontend, slot: u16) -> usize {
    let name = fe.to_string();
    position(
        ops,
        &format!("delete of {name} slot {slot}"),
        |o| matches!(o, Op::DelSlot { fe, slot: s } if *fe == name && *s == slot),
    )
}

fn touches(op: &Op, fe: &Frontend) -> bool {
    let name = fe.to_string();
    matches!(op, Op::PutSlot { fe, .. } | Op::DelSlot { fe, .. } if *fe == name)
}

// ---------------------------------------------------------------------------------------------
// Checking map contents.

/// Access to the `MemMaps` inside the maps a reconciler drives.
trait HasMem {
    fn mem(&self) -> &MemMaps;
}

impl HasMem for MemMaps {
    fn mem(&self) -> &MemMaps {
        self
    }
}

fn dump_of<M: LbMaps + HasMem>(rec: &Reconciler<M>) -> &Dump {
    &rec.maps().mem().dump
}

/// What a packet can see must be whole: every master's slots exist and name existing backends of
/// the frontend's family, and its rev-NAT entry exists and names the frontend.
fn check_visible_consistency(dump: &Dump) -> Result<(), String> {
    for ((fe, slot), master) in &dump.services {
        if *slot != 0 {
            continue;
        }
        match dump.revnat.get(&master.rev_nat_id) {
            Some((a, p)) if (*a, *p) == (fe.l4.addr, fe.l4.port) => {}
            other => {
                return Err(format!("{fe}: rev-NAT {} is {other:?}", master.rev_nat_id));
            }
        }
        for s in 1..=(master.count + master.qcount) {
            let Some(sv) = dump.services.get(&(*fe, s)) else {
                return Err(format!("{fe}: slot {s} of {} missing", master.count));
            };
            let Some(b) = dump.backends.get(&sv.backend_id) else {
                return Err(format!(
                    "{fe}: slot {s} names missing backend {}",
                    sv.backend_id
                ));
            };
            if b.l4.addr.is_ipv4() != fe.l4.addr.is_ipv4() {
                return Err(format!("{fe}: slot {s} names {} of the other family", b.l4));
            }
        }
        // Else a packet to this frontend's address on another port would pass instead of
        // being rejected.
        if master.flags & svc_flags::CLUSTER_IP != 0 && !dump.cluster_ips.contains_key(&fe.l4.addr)
        {
            return Err(format!("{fe}: ClusterIP not in the ClusterIP set"));
        }
    }
    Ok(())
}

/// The maps hold exactly `d`: one master per frontend with the right count, flags and rev-NAT,
/// its slots naming the desired backends in order, and nothing else (no orphans).
fn assert_converged(dump: &Dump, d: &DesiredState) {
    check_visible_consistency(dump).unwrap_or_else(|e| panic!("{e}\n{}", render(dump)));
    let masters: BTreeSet<Frontend> = dump
        .services
        .keys()
        .filter(|(_, s)| *s == 0)
        .map(|(fe, _)| *fe)
        .collect();
    let wanted: BTreeSet<Frontend> = d.services.keys().copied().collect();
    assert_eq!(masters, wanted, "frontends\n{}", render(dump));

    let mut used_backends = BTreeSet::new();
    let mut used_revnat = BTreeSet::new();
    let mut expected_entries = 0;
    for (fe, e) in &d.services {
        let master = dump.services[&(*fe, 0)];
        let active = e
            .backends
            .iter()
            .filter(|b| b.state == BackendState::Active)
            .count();
        assert_eq!(usize::from(master.count), active, "{fe} count");
        assert_eq!(
            usize::from(master.qcount),
            e.backends.len() - active,
            "{fe} qcount"
        );
        assert_eq!(master.flags, e.flags, "{fe} flags");
        assert_eq!(master.backend_id, 0, "{fe}: a master names no backend");
        assert_eq!(
            dump.revnat.get(&master.rev_nat_id),
            Some(&(fe.l4.addr, fe.l4.port)),
            "{fe} rev-NAT"
        );
        used_revnat.insert(master.rev_nat_id);
        for (i, want) in e.backends.iter().enumerate() {
            let slot = u16::try_from(i + 1).expect("slot fits");
            let sv = dump.services[&(*fe, slot)];
            assert_eq!(
                dump.backends.get(&sv.backend_id),
                Some(want),
                "{fe} slot {slot}\n{}",
                render(dump)
            );
            assert_eq!(sv.count, 0, "{fe} slot {slot}: only masters carry a count");
            used_backends.insert(sv.backend_id);
        }
        // Session affinity may name exactly the active slots' backends.
        let want_matches: BTreeSet<u32> = if e.flags & svc_flags::AFFINITY != 0 {
            (1..=master.count)
                .map(|s| dump.services[&(*fe, s)].backend_id)
                .collect()
        } else {
            BTreeSet::new()
        };
        let matches: BTreeSet<u32> = dump
            .aff_match
            .iter()
            .filter(|m| m.rev_nat_id == master.rev_nat_id && m.scope == fe.scope)
            .map(|m| m.backend_id)
            .collect();
        assert_eq!(
            matches,
            want_matches,
            "{fe} affinity matches\n{}",
            render(dump)
        );
        let want_timeout = if e.flags & svc_flags::AFFINITY != 0 {
            e.affinity_timeout
        } else {
            0
        };
        assert_eq!(
            master.affinity_timeout, want_timeout,
            "{fe} affinity timeout"
        );
        expected_entries += 1 + e.backends.len();
    }
    let affine_revnat: BTreeSet<(u32, Scope)> = d
        .services
        .iter()
        .filter(|(_, e)| e.flags & svc_flags::AFFINITY != 0)
        .map(|(fe, _)| (dump.services[&(*fe, 0)].rev_nat_id, fe.scope))
        .collect();
    assert!(
        dump.aff_match
            .iter()
            .all(|m| affine_revnat.contains(&(m.rev_nat_id, m.scope))),
        "no affinity matches of frontends without affinity\n{}",
        render(dump)
    );
    assert_eq!(
        dump.services.len(),
        expected_entries,
        "no service entries beyond masters and their slots\n{}",
        render(dump)
    );
    let backend_ids: BTreeSet<u32> = dump.backends.keys().copied().collect();
    assert_eq!(
        backend_ids,
        used_backends,
        "no orphan backends\n{}",
        render(dump)
    );
    let revnat_ids: BTreeSet<u32> = dump.revnat.keys().copied().collect();
    assert_eq!(
        revnat_ids,
        used_revnat,
        "no orphan rev-NAT\n{}",
        render(dump)
    );
    let distinct: BTreeSet<L4Addr> = dump.backends.values().map(|b| b.l4).collect();
    assert_eq!(
        distinct.len(),
        dump.backends.len(),
        "one id per backend address"
    );
    assert!(!backend_ids.contains(&0), "backend id 0 is reserved");
    assert!(!revnat_ids.contains(&0), "rev-NAT id 0 is reserved");
    let mut cluster_ips: BTreeMap<IpAddr, u32> = BTreeMap::new();
    for (fe, e) in &d.services {
        if e.flags & svc_flags::CLUSTER_IP != 0 {
            *cluster_ips.entry(fe.l4.addr).or_default() += 1;
        }
    }
    assert_eq!(
        dump.cluster_ips,
        cluster_ips,
        "the ClusterIP set holds exactly the ClusterIPs, with their frontend counts\n{}",
        render(dump)
    );
    assert_render_matches(dump, d);
}

/// The rendering shows each frontend with its slots resolved to the desired backends, and no
/// orphan, missing or mismatched entry.
fn assert_render_matches(dump: &Dump, d: &DesiredState) {
    let text = render(dump);
    for bad in ["orphan", "MISSING", "MISMATCH"] {
        assert!(!text.contains(bad), "{bad} in\n{text}");
    }
    let lines: Vec<&str> = text.lines().collect();
    for (fe, e) in &d.services {
        let active = e
            .backends
            .iter()
            .filter(|b| b.state == BackendState::Active)
            .count();
        let scope = if fe.scope == Scope::Internal {
            " scope=internal"
        } else {
            ""
        };
        let head = format!(
            "{}{scope} flags={} count={active} qcount={} revnat=",
            fe.l4,
            lb::model::flag_names(e.flags),
            e.backends.len() - active
        );
        let at = lines
            .iter()
            .position(|l| l.starts_with(&head))
            .unwrap_or_else(|| panic!("no line {head:?} in\n{text}"));
        assert!(lines[at].ends_with("(ok)"), "{}", lines[at]);
        let at = if e.flags & svc_flags::AFFINITY != 0 {
            let want = format!("  affinity timeout={}s match(ok)", e.affinity_timeout);
            assert_eq!(lines.get(at + 1).copied(), Some(want.as_str()), "{text}");
            at + 1
        } else {
            at
        };
        for (i, b) in e.backends.iter().enumerate() {
            let state = if b.state == BackendState::Active {
                "active"
            } else {
                "terminating"
            };
            assert_eq!(
                lines.get(at + 1 + i).copied(),
                Some(format!("  slot {}: {} {state}", i + 1, b.l4).as_str()),
                "{fe}\n{text}"
            );
        }
    }
}

/// Backend address → id.
fn backend_ids(dump: &Dump) -> BTreeMap<L4Addr, u32> {
    dump.backends.iter().map(|(id, b)| (b.l4, *id)).collect()
}

fn backend_id(dump: &Dump, b: Backend) -> u32 {
    backend_ids(dump)
        .get(&b.l4)
        .copied()
        .unwrap_or_else(|| panic!("no backend {}", b.l4))
}

fn revnat_id(dump: &Dump, fe: &Frontend) -> u32 {
    dump.services
        .get(&(*fe, 0))
        .unwrap_or_else(|| panic!("no master for {fe}"))
        .rev_nat_id
}

/// The lines of the rendering belonging to one frontend (its header and slots).
fn render_block(dump: &Dump, fe: &Frontend) -> Vec<String> {
    let text = render(dump);
    let head = format!("{} ", fe.l4);
    let mut out = Vec::new();
    let mut inside = false;
    for l in text.lines() {
        if l.starts_with(&head) {
            inside = true;
        } else if !l.starts_with("  ") {
            inside = false;
        }
        if inside {
            out.push(l.to_string());
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Maps that check the datapath's view after every operation and can fail chosen writes.

struct Checked {
    inner: MemMaps,
    /// A write whose description (`put backend ID`, `put revnat ID`, `put service FE slot N`)
    /// starts with this fails with "map full".
    fail: RefCell<Option<String>>,
    violations: Vec<String>,
}

impl Checked {
    fn new(capacity: u32) -> Self {
        Self {
            inner: MemMaps::with_capacity(capacity),
            fail: RefCell::new(None),
            violations: Vec::new(),
        }
    }

    fn fail_on(&self, prefix: Option<&str>) {
        *self.fail.borrow_mut() = prefix.map(str::to_string);
    }

    fn should_fail(&self, what: &str, table: Table, family: Family) -> Result<(), MapOpError> {
        if self
            .fail
            .borrow()
            .as_deref()
            .is_some_and(|p| what.starts_with(p))
        {
            return Err(MapOpError::Full {
                map: table.map_name(family),
            });
        }
        Ok(())
    }

    fn after(&mut self, r: Result<(), MapOpError>) -> Result<(), MapOpError> {
        if let Err(e) = check_visible_consistency(&self.inner.dump) {
            let last = self
                .inner
                .journal
                .last()
                .map(ToString::to_string)
                .unwrap_or_default();
            self.violations.push(format!("after {last:?}: {e}"));
        }
        r
    }
}

impl HasMem for Checked {
    fn mem(&self) -> &MemMaps {
        &self.inner
    }
}

impl LbMaps for Checked {
    fn dump(&self) -> anyhow::Result<Dump> {
        self.inner.dump()
    }

    fn capacity(&self, table: Table, family: Family) -> u32 {
        self.inner.capacity(table, family)
    }

    fn put_backend(&mut self, id: u32, backend: &Backend) -> Result<(), MapOpError> {
        let family = Family::of(&backend.l4.addr);
        self.should_fail(&format!("put backend {id}"), Table::Backends, family)?;
        let r = self.inner.put_backend(id, backend);
        self.after(r)
    }

    fn del_backend(&mut self, id: u32, family: Family) -> Result<(), MapOpError> {
        let r = self.inner.del_backend(id, family);
        self.after(r)
    }

    fn put_revnat(&mut self, id: u32, addr: IpAddr, port: u16) -> Result<(), MapOpError> {
        self.should_fail(
            &format!("put revnat {id}"),
            Table::RevNat,
            Family::of(&addr),
        )?;
        let r = self.inner.put_revnat(id, addr, port);
        self.after(r)
    }

    fn del_revnat(&mut self, id: u32, family: Family) -> Result<(), MapOpError> {
        let r = self.inner.del_revnat(id, family);
        self.after(r)
    }

    fn put_service(
        &mut self,
        frontend: &Frontend,
        slot: u16,
        value: &SvcValue,
    ) -> Result<(), MapOpError> {
        self.should_fail(
            &format!("put service {frontend} slot {slot}"),
            Table::Services,
            Family::of(&frontend.l4.addr),
        )?;
        let r = self.inner.put_service(frontend, slot, value);
        self.after(r)
    }

    fn del_service(&mut self, frontend: &Frontend, slot: u16) -> Result<(), MapOpError> {
        let r = self.inner.del_service(frontend, slot);
        self.after(r)
    }

    fn put_cluster_ip(&mut self, addr: IpAddr, frontends: u32) -> Result<(), MapOpError> {
        self.should_fail(
            &format!("put cluster-ip {addr}"),
            Table::ClusterIps,
            Family::of(&addr),
        )?;
        let r = self.inner.put_cluster_ip(addr, frontends);
        self.after(r)
    }

    fn del_cluster_ip(&mut self, addr: IpAddr) -> Result<(), MapOpError> {
        let r = self.inner.del_cluster_ip(addr);
        self.after(r)
    }

    fn put_src_range(&mut self, id: u32, cidr: &Cidr) -> Result<(), MapOpError> {
        self.should_fail(
            &format!("put source-range {id} {cidr}"),
            Table::SourceRanges,
            Family::of(&cidr.addr),
        )?;
        let r = self.inner.put_src_range(id, cidr);
        self.after(r)
    }

    fn del_src_range(&mut self, id: u32, cidr: &Cidr) -> Result<(), MapOpError> {
        let r = self.inner.del_src_range(id, cidr);
        self.after(r)
    }

    fn put_aff_match(&mut self, m: &AffMatch) -> Result<(), MapOpError> {
        self.should_fail(
            &format!("put aff-match {}", m.rev_nat_id),
            Table::AffinityMatch,
            m.family,
        )?;
        let r = self.inner.put_aff_match(m);
        self.after(r)
    }

    fn del_aff_match(&mut self, m: &AffMatch) -> Result<(), MapOpError> {
        let r = self.inner.del_aff_match(m);
        self.after(r)
    }

    fn put_echo(&mut self, a: IpAddr, v: EchoValue) -> Result<(), MapOpError> {
        let r = self.inner.put_echo(a, v);
        self.after(r)
    }

    fn del_echo(&mut self, a: IpAddr) -> Result<(), MapOpError> {
        let r = self.inner.del_echo(a);
        self.after(r)
    }
}

fn checked(capacity: u32) -> Reconciler<Checked> {
    Reconciler::new(Checked::new(capacity)).expect("dump")
}

fn assert_no_violations(rec: &Reconciler<Checked>) {
    assert!(
        rec.maps().violations.is_empty(),
        "a packet could have seen a half-updated service:\n{:#?}",
        rec.maps().violations
    );
}

// ---------------------------------------------------------------------------------------------
// Fresh apply.

#[test]
fn fresh_apply_programs_every_frontend() {
    let mut rec = fresh();
    let d = desired(&[
        (fe4(1), &[be4(1), be4(2), be4(3)]),
        (fe4(2), &[be4(3), be4(4)]),
        (fe4(3), &[]),
        (fe6(1), &[be6(1), be6(2)]),
    ]);
    let (report, ops) = apply_logged(&mut rec, &d);
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert_eq!(
        report.deletes, 0,
        "nothing to delete on empty maps: {ops:#?}"
    );
    let dump = dump_of(&rec);
    assert_converged(dump, &d);
    // A backend shared by two frontends is stored once.
    assert_eq!(dump.backends.len(), 6);
    assert_eq!(rec.backend_count(), 6);
    assert_eq!(rec.service_count(), 4);
    // Writes: 6 backends + 4 rev-NAT + (1 + 3) + (1 + 2) + 1 + (1 + 2) service entries + 4
    // ClusterIPs + their 4 echo entries.
    assert_eq!(report.writes, 6 + 4 + 4 + 3 + 1 + 3 + 4 + 4);
    // Each frontend its own rev-NAT id.
    let ids: BTreeSet<u32> = d.services.keys().map(|fe| revnat_id(dump, fe)).collect();
    assert_eq!(ids.len(), 4);
    // A frontend without backends still has its master, with count 0.
    assert_eq!(dump.services[&(fe4(3), 0)].count, 0);
    assert!(!dump.services.contains_key(&(fe4(3), 1)));
}

#[test]
fn usage_reports_what_the_maps_hold_per_map_and_family() {
    let mut maps = MemMaps::with_capacity(100);
    maps.capacities.insert((Table::Backends, Family::V6), 7);
    let mut rec = Reconciler::new(maps).expect("dump");
    rec.apply(&desired(&[
        (fe4(1), &[be4(1), be4(2)]),
        (fe4(2), &[be4(2)]),
        (fe6(1), &[be6(1), be6(2), be6(3)]),
    ]));
    let dump = dump_of(&rec).clone();
    let count_services = |v4: bool| {
        dump.services
            .keys()
            .filter(|(fe, _)| fe.l4.addr.is_ipv4() == v4)
            .count()
    };
    let count_backends = |v4: bool| {
        dump.backends
            .values()
            .filter(|b| b.l4.addr.is_ipv4() == v4)
            .count()
    };
    let count_revnat = |v4: bool| {
        dump.revnat
            .values()
            .filter(|(a, _)| a.is_ipv4() == v4)
            .count()
    };
    let usage: BTreeMap<&str, (usize, u32)> = rec
        .usage()
        .into_iter()
        .map(|(name, used, cap)| (name, (used, cap)))
        .collect();
    assert_eq!(usage.len(), 14, "{usage:?}");
    assert_eq!(usage["lb4_aff_match"], (0, 100));
    assert_eq!(usage["lb4_echo"], (2, 100));
    assert_eq!(usage["lb6_echo"], (1, 100));
    assert_eq!(usage["lb4_src_range"], (0, 100));
    assert_eq!(usage["lb4_cluster_ips"], (2, 100));
    assert_eq!(usage["lb6_cluster_ips"], (1, 100));
    assert_eq!(usage["lb4_services"], (count_services(true), 100));
    assert_eq!(usage["lb6_services"], (count_services(false), 100));
    assert_eq!(usage["lb4_backends"], (count_backends(true), 100));
    assert_eq!(usage["lb6_backends"], (count_backends(false), 7));
    assert_eq!(usage["lb4_revnat"], (count_revnat(true), 100));
    assert_eq!(usage["lb6_revnat"], (count_revnat(false), 100));
    // And the counts themselves follow from the desired state.
    assert_eq!(usage["lb4_services"].0, 3 + 2);
    assert_eq!(usage["lb6_services"].0, 4);
    assert_eq!(usage["lb4_backends"].0, 2);
}

#[test]
fn fresh_apply_writes_backends_then_revnat_then_slots_then_master() {
    let mut rec = fresh();
    let d = desired(&[
        (fe4(1), &[be4(1), be4(2), be4(3)]),
        (fe4(2), &[be4(3), be4(4)]),
        (fe6(1), &[be6(1), be6(2)]),
    ]);
    let (report, ops) = apply_logged(&mut rec, &d);
    assert!(report.errors.is_empty());
    let dump = dump_of(&rec).clone();

    // Every backend id is put before any slot that names it.
    for (i, op) in ops.iter().enumerate() {
        if let Op::PutSlot { slot, backend, .. } = op
            && *slot != 0
        {
            let put = position(&ops, &format!("put of backend {backend}"), |o| {
                *o == Op::PutBackend(*backend)
            });
            assert!(
                put < i,
                "backend {backend} put at {put}, named at {i}: {ops:#?}"
            );
        }
    }
    for (fe, e) in &d.services {
        let master = master_put(&ops, fe);
        // Every slot is put, before the master.
        for slot in 1..=e.backends.len() {
            let slot = u16::try_from(slot).expect("fits");
            let name = fe.to_string();
            let at = position(
                &ops,
                &format!("{name} slot {slot}"),
                |o| matches!(o, Op::PutSlot { fe, slot: s, .. } if *fe == name && *s == slot),
            );
            assert!(at < master, "{fe}: slot {slot} at {at}, master at {master}");
        }
        // The master put carries the count.
        let Op::PutSlot { count, backend, .. } = &ops[master] else {
            unreachable!()
        };
        assert_eq!(usize::from(*count), e.backends.len());
        assert_eq!(*backend, 0);
        // Rev-NAT before the master.
        let rid = revnat_id(&dump, fe);
        let rev = position(&ops, &format!("put revnat {rid}"), |o| {
            *o == Op::PutRevNat(rid)
        });
        assert!(rev < master, "{fe}: rev-NAT at {rev}, master at {master}");
        // Exactly one master write per frontend, and slots written once.
        assert_eq!(
            ops.iter()
                .filter(|o| matches!(o, Op::PutSlot { fe: f, .. } if *f == fe.to_string()))
                .count(),
            1 + e.backends.len()
        );
    }
}

#[test]
fn no_intermediate_state_is_half_updated() {
    // The same transitions as the individual tests, checked after every single map operation.
    let mut rec = checked(1024);
    let steps: Vec<DesiredState> = vec![
        desired(&[
            (fe4(1), &[be4(1), be4(2), be4(3)]),
            (fe4(2), &[be4(3)]),
            (fe6(1), &[be6(1)]),
        ]),
        // grow
        desired(&[
            (fe4(1), &[be4(1), be4(2), be4(3), be4(4), be4(5)]),
            (fe4(2), &[be4(3)]),
            (fe6(1), &[be6(1), be6(2)]),
        ]),
        // shrink, including a backend still used elsewhere
        desired(&[
            (fe4(1), &[be4(1), be4(5)]),
            (fe4(2), &[be4(3)]),
            (fe6(1), &[be6(2)]),
        ]),
        // replace every backend
        desired(&[
            (fe4(1), &[be4(6), be4(7)]),
            (fe4(2), &[be4(8)]),
            (fe6(1), &[be6(3)]),
        ]),
        // terminating backends
        desired(&[
            (fe4(1), &[be4(6), terminating(be4(7))]),
            (fe4(2), &[be4(8)]),
            (fe6(1), &[be6(3)]),
        ]),
        // remove and add services
        desired(&[(fe4(2), &[be4(8), be4(6)]), (fe4(9), &[be4(1)])]),
        // drain everything
        DesiredState::default(),
    ];
    for d in &steps {
        let report = rec.apply(d);
        assert!(report.errors.is_empty(), "{:?}", report.errors);
        assert_no_violations(&rec);
        assert_converged(&rec.maps().inner.dump, d);
    }
    let end = &rec.maps().inner.dump;
    assert!(end.services.is_empty() && end.backends.is_empty() && end.revnat.is_empty());
}

// ---------------------------------------------------------------------------------------------
// Idempotence.

#[test]
fn applying_the_same_state_again_writes_nothing() {
    let mut rec = fresh();
    let mut internal = fe4(1);
    internal.scope = Scope::Internal;
    let mut d = desired(&[
        (fe4(1), &[be4(1), be4(2), terminating(be4(3))]),
        (fe4(2), &[be4(2)]),
        (fe4(3), &[]),
        (fe6(1), &[be6(1), be6(2)]),
        (
            Frontend::new(vip4(1), 53, Proto::Udp),
            &[Backend::active(L4Addr {
                addr: be4(1).l4.addr,
                port: 5353,
                proto: Proto::Udp,
            })],
        ),
    ]);
    d.services.insert(internal, entry("internal", &[be4(1)]));
    let (first, _) = apply_logged(&mut rec, &d);
    assert!(first.errors.is_empty());
    assert!(first.writes > 0);
    let snapshot = dump_of(&rec).clone();
    for _ in 0..3 {
        let (again, ops) = apply_logged(&mut rec, &d);
        assert_eq!(
            (again.writes, again.deletes),
            (0, 0),
            "second apply touched the maps: {ops:#?}"
        );
        assert!(ops.is_empty());
        assert!(again.errors.is_empty());
        assert_eq!(dump_of(&rec), &snapshot);
    }
    assert_converged(dump_of(&rec), &d);
}

#[test]
fn an_equal_state_built_separately_is_also_a_no_op() {
    // Idempotence must not depend on object identity: a second, independently built state.
    let mut rec = fresh();
    let build = || desired(&[(fe4(1), &[be4(1), be4(2)]), (fe6(1), &[be6(1)])]);
    rec.apply(&build());
    let (again, ops) = apply_logged(&mut rec, &build());
    assert_eq!((again.writes, again.deletes), (0, 0), "{ops:#?}");
}

#[test]
fn two_scopes_of_one_address_share_the_revnat_entry() {
    let mut rec = fresh();
    let external = fe4(1);
    let mut internal = fe4(1);
    internal.scope = Scope::Internal;
    let mut d = DesiredState::default();
    d.services.insert(external, entry("web", &[be4(1), be4(2)]));
    d.services.insert(internal, entry("web", &[be4(1)]));
    rec.apply(&d);
    let dump = dump_of(&rec).clone();
    assert_converged(&dump, &d);
    assert_eq!(revnat_id(&dump, &external), revnat_id(&dump, &internal));
    assert_eq!(dump.revnat.len(), 1);

    // Dropping one scope keeps the rev-NAT entry the other still uses.
    d.services.remove(&internal);
    let (report, ops) = apply_logged(&mut rec, &d);
    assert!(report.errors.is_empty());
    assert!(
        !ops.iter().any(|o| matches!(o, Op::DelRevNat(_))),
        "{ops:#?}"
    );
    assert_converged(dump_of(&rec), &d);
}

// ---------------------------------------------------------------------------------------------
// Changes.

#[test]
fn shrinking_lowers_the_count_before_deleting_the_slot() {
    let mut rec = fresh();
    // be4(3) is shared with fe4(2); be4(2) is not shared.
    let before = desired(&[(fe4(1), &[be4(1), be4(2), be4(3)]), (fe4(2), &[be4(3)])]);
    rec.apply(&before);
    let ids = backend_ids(dump_of(&rec));

    // 3 → 2, dropping the shared backend from fe4(1): it must survive for fe4(2).
    let shrunk = desired(&[(fe4(1), &[be4(1), be4(2)]), (fe4(2), &[be4(3)])]);
    let (report, ops) = apply_logged(&mut rec, &shrunk);
    assert!(report.errors.is_empty());
    let master = master_put(&ops, &fe4(1));
    let Op::PutSlot { count, .. } = &ops[master] else {
        unreachable!()
    };
    assert_eq!(*count, 2, "master rewritten with the new count");
    let del = slot_del(&ops, &fe4(1), 3);
    assert!(
        master < del,
        "count lowered at {master}, slot 3 deleted at {del}"
    );
    assert!(
        !ops.iter().any(|o| matches!(o, Op::DelBackend(_))),
        "the shared backend is still used: {ops:#?}"
    );
    assert!(!ops.iter().any(|o| touches(o, &fe4(2))), "{ops:#?}");
    assert_eq!(backend_id(dump_of(&rec), be4(3)), ids[&be4(3).l4]);
    assert_converged(dump_of(&rec), &shrunk);

    // 2 → 1, dropping an unshared backend: deleted after the slot stops naming it.
    let shrunk = desired(&[(fe4(1), &[be4(1)]), (fe4(2), &[be4(3)])]);
    let (report, ops) = apply_logged(&mut rec, &shrunk);
    assert!(report.errors.is_empty());
    let master = master_put(&ops, &fe4(1));
    let del = slot_del(&ops, &fe4(1), 2);
    let gone = ids[&be4(2).l4];
    let gc = position(&ops, "backend GC", |o| *o == Op::DelBackend(gone));
    assert!(master < del && del < gc, "{ops:#?}");
    assert_eq!(
        ops.iter()
            .filter(|o| matches!(o, Op::DelBackend(_)))
            .count(),
        1,
        "{ops:#?}"
    );
    assert_converged(dump_of(&rec), &shrunk);
}

#[test]
fn shrinking_out_of_the_middle_keeps_the_visible_slots_valid() {
    // [1,2,3] → [1,3]: slot 2 is rewritten to backend 3 before the count drops.
    let mut rec = fresh();
    rec.apply(&desired(&[(fe4(1), &[be4(1), be4(2), be4(3)])]));
    let ids = backend_ids(dump_of(&rec));
    let d = desired(&[(fe4(1), &[be4(1), be4(3)])]);
    let (report, ops) = apply_logged(&mut rec, &d);
    assert!(report.errors.is_empty());
    let id3 = ids[&be4(3).l4];
    let rewrite = position(
        &ops,
        "slot 2 rewrite",
        |o| matches!(o, Op::PutSlot { slot: 2, backend, .. } if *backend == id3),
    );
    let master = master_put(&ops, &fe4(1));
    let del = slot_del(&ops, &fe4(1), 3);
    let gc = position(&ops, "GC of backend 2", |o| {
        *o == Op::DelBackend(ids[&be4(2).l4])
    });
    assert!(rewrite < master && master < del && del < gc, "{ops:#?}");
    assert_converged(dump_of(&rec), &d);
}

#[test]
fn growing_writes_new_backends_and_slots_before_the_master() {
    let mut rec = fresh();
    rec.apply(&desired(&[(fe4(1), &[be4(1), be4(2)])]));
    let ids_before = backend_ids(dump_of(&rec));
    let d = desired(&[(fe4(1), &[be4(1), be4(2), be4(3), be4(4)])]);
    let (report, ops) = apply_logged(&mut rec, &d);
    assert!(report.errors.is_empty());
    let dump = dump_of(&rec);
    let master = master_put(&ops, &fe4(1));
    let Op::PutSlot { count, .. } = &ops[master] else {
        unreachable!()
    };
    assert_eq!(*count, 4);
    for (slot, b) in [(3u16, be4(3)), (4, be4(4))] {
        let id = backend_id(dump, b);
        let put_b = position(&ops, "backend put", |o| *o == Op::PutBackend(id));
        let put_s = position(
            &ops,
            "slot put",
            |o| matches!(o, Op::PutSlot { slot: s, backend, .. } if *s == slot && *backend == id),
        );
        assert!(put_b < put_s && put_s < master, "{ops:#?}");
    }
    // Unchanged slots and backends are not rewritten, and keep their ids.
    assert!(
        !ops.iter()
            .any(|o| matches!(o, Op::PutSlot { slot: 1 | 2, .. }))
    );
    for b in [be4(1), be4(2)] {
        assert_eq!(backend_id(dump, b), ids_before[&b.l4]);
        assert!(!ops.contains(&Op::PutBackend(ids_before[&b.l4])));
    }
    assert!(!ops.iter().any(|o| matches!(o, Op::PutRevNat(_))));
    assert!(
        !ops.iter()
            .any(|o| matches!(o, Op::DelBackend(_) | Op::DelRevNat(_) | Op::DelSlot { .. })),
        "growing deletes nothing"
    );
    assert_converged(dump, &d);
}

#[test]
fn replacing_a_backend_switches_the_slot_then_collects_the_old_one() {
    let mut rec = fresh();
    rec.apply(&desired(&[(fe4(1), &[be4(1), be4(2), be4(3)])]));
    let old = backend_ids(dump_of(&rec));
    let d = desired(&[(fe4(1), &[be4(1), be4(2), be4(4)])]);
    let (report, ops) = apply_logged(&mut rec, &d);
    assert!(report.errors.is_empty());
    let dump = dump_of(&rec);
    let new_id = backend_id(dump, be4(4));
    assert!(
        !old.values().any(|id| *id == new_id),
        "the new backend gets a fresh id while the old one still exists"
    );
    let put_b = position(&ops, "new backend", |o| *o == Op::PutBackend(new_id));
    let put_s = position(
        &ops,
        "slot 3 switch",
        |o| matches!(o, Op::PutSlot { slot: 3, backend, .. } if *backend == new_id),
    );
    let master = master_put(&ops, &fe4(1));
    let gc = position(&ops, "old backend GC", |o| {
        *o == Op::DelBackend(old[&be4(3).l4])
    });
    assert!(put_b < put_s && put_s < master && master < gc, "{ops:#?}");
    assert!(
        !ops.iter().any(|o| matches!(o, Op::DelSlot { .. })),
        "{ops:#?}"
    );
    assert_converged(dump, &d);
}

#[test]
fn removing_a_service_deletes_master_then_slots_then_revnat_and_backends() {
    let mut rec = fresh();
    rec.apply(&desired(&[
        (fe4(1), &[be4(1), be4(2), be4(3)]),
        (fe4(2), &[be4(3)]),
    ]));
    let dump = dump_of(&rec).clone();
    let ids = backend_ids(&dump);
    let rid = revnat_id(&dump, &fe4(1));
    let keep_rid = revnat_id(&dump, &fe4(2));

    // (Names are not stored in the maps: fe4(2) being "svc0" now changes nothing.)
    let d = desired(&[(fe4(2), &[be4(3)])]);
    let (report, ops) = apply_logged(&mut rec, &d);
    assert!(report.errors.is_empty());
    assert!(report.writes == 0, "removal writes nothing: {ops:#?}");
    let master = slot_del(&ops, &fe4(1), 0);
    let slots: Vec<usize> = (1..=3).map(|s| slot_del(&ops, &fe4(1), s)).collect();
    let rev = position(&ops, "rev-NAT delete", |o| *o == Op::DelRevNat(rid));
    let b1 = position(&ops, "backend 1 delete", |o| {
        *o == Op::DelBackend(ids[&be4(1).l4])
    });
    let b2 = position(&ops, "backend 2 delete", |o| {
        *o == Op::DelBackend(ids[&be4(2).l4])
    });
    for s in &slots {
        assert!(master < *s, "master first: {ops:#?}");
        assert!(*s < rev && *s < b1 && *s < b2, "{ops:#?}");
    }
    assert!(
        !ops.contains(&Op::DelBackend(ids[&be4(3).l4])),
        "shared backend kept"
    );
    assert!(!ops.contains(&Op::DelRevNat(keep_rid)));
    assert!(!ops.iter().any(|o| touches(o, &fe4(2))), "{ops:#?}");
    let ip = position(&ops, "ClusterIP delete", |o| {
        *o == Op::DelClusterIp(vip4(1).to_string())
    });
    assert!(
        slots.iter().all(|s| *s < ip),
        "ClusterIP after the frontend: {ops:#?}"
    );
    let echo = position(&ops, "echo delete", |o| {
        *o == Op::DelEcho(vip4(1).to_string())
    });
    assert!(master < echo, "echo entry after the master: {ops:#?}");
    assert_eq!(ops.len(), 1 + 3 + 1 + 2 + 1 + 1, "{ops:#?}");
    assert_converged(dump_of(&rec), &d);
}

#[test]
fn removing_everything_leaves_empty_maps() {
    let mut rec = fresh();
    rec.apply(&desired(&[
        (fe4(1), &[be4(1), be4(2)]),
        (fe6(1), &[be6(1)]),
        (fe4(2), &[]),
    ]));
    let (report, _) = apply_logged(&mut rec, &DesiredState::default());
    assert!(report.errors.is_empty());
    // The last 3: the echo entries of the three addresses.
    assert_eq!(report.deletes, 3 + 2 + 1 + 3 + 3 + 3 + 3);
    let dump = dump_of(&rec);
    assert_eq!(dump, &Dump::default(), "{}", render(dump));
    assert_eq!(render(dump), "");
    assert_eq!((rec.service_count(), rec.backend_count()), (0, 0));
}

#[test]
fn backend_state_change_rewrites_backend_and_counts() {
    let mut rec = fresh();
    rec.apply(&desired(&[(fe4(1), &[be4(1), be4(2), be4(3)])]));
    let ids = backend_ids(dump_of(&rec));
    // be4(3) starts terminating: it stays in a slot after the active ones (qcount).
    let d = desired(&[(fe4(1), &[be4(1), be4(2), terminating(be4(3))])]);
    let (report, ops) = apply_logged(&mut rec, &d);
    assert!(report.errors.is_empty());
    let id3 = ids[&be4(3).l4];
    let put_b = position(&ops, "backend state update", |o| *o == Op::PutBackend(id3));
    let master = master_put(&ops, &fe4(1));
    assert!(put_b < master);
    let Op::PutSlot { count, .. } = &ops[master] else {
        unreachable!()
    };
    assert_eq!(*count, 2);
    assert!(
        !ops.iter()
            .any(|o| matches!(o, Op::DelSlot { .. } | Op::DelBackend(_)))
    );
    let dump = dump_of(&rec);
    assert_eq!(backend_id(dump, be4(3)), id3, "same id, new state");
    assert_eq!(dump.services[&(fe4(1), 0)].qcount, 1);
    assert!(render(dump).contains("slot 3: 198.18.0.3:8080/TCP terminating"));
    assert_converged(dump, &d);
}

// ---------------------------------------------------------------------------------------------
// Restart.

#[test]
fn restart_from_the_pinned_maps_changes_nothing_then_converges_with_stable_ids() {
    let s1 = desired(&[
        (fe4(1), &[be4(1), be4(2), be4(3)]),
        (fe4(2), &[be4(3)]),
        (fe6(1), &[be6(1), be6(2)]),
    ]);
    let mut first = fresh();
    first.apply(&s1);
    let pinned = first.maps().clone();
    let ids_before = backend_ids(&pinned.dump);
    let revnat_before: BTreeMap<Frontend, u32> = s1
        .services
        .keys()
        .map(|fe| (*fe, revnat_id(&pinned.dump, fe)))
        .collect();
    drop(first);

    let mut rec = Reconciler::new(pinned).expect("dump");
    assert_eq!(rec.service_count(), 3);
    assert_eq!(rec.backend_count(), ids_before.len());
    let (report, ops) = apply_logged(&mut rec, &s1);
    assert_eq!((report.writes, report.deletes), (0, 0), "{ops:#?}");
    assert!(report.errors.is_empty());

    // A change after the restart: fe4(1) loses be4(2) and gains be4(4); fe6(1) is removed; a
    // new frontend arrives.
    let s2 = desired(&[
        (fe4(1), &[be4(1), be4(3), be4(4)]),
        (fe4(2), &[be4(3)]),
        (fe4(3), &[be4(5)]),
    ]);
    let (report, _) = apply_logged(&mut rec, &s2);
    assert!(report.errors.is_empty());
    let dump = dump_of(&rec);
    assert_converged(dump, &s2);
    for b in [be4(1), be4(3)] {
        assert_eq!(
            backend_id(dump, b),
            ids_before[&b.l4],
            "{} keeps its id",
            b.l4
        );
    }
    for fe in [fe4(1), fe4(2)] {
        assert_eq!(
            revnat_id(dump, &fe),
            revnat_before[&fe],
            "{fe} keeps its rev-NAT id"
        );
    }
    // New ids never reuse an id that was in use when the maps were written before the restart
    // (an established flow's conntrack entry may still name it).
    for b in [be4(4), be4(5)] {
        let id = backend_id(dump, b);
        assert!(
            !ids_before.values().any(|old| *old == id),
            "{} got reused id {id}",
            b.l4
        );
    }

    // And a restart from that state is a no-op again.
    let mut again = Reconciler::new(rec.maps().clone()).expect("dump");
    let (report, ops) = apply_logged(&mut again, &s2);
    assert_eq!((report.writes, report.deletes), (0, 0), "{ops:#?}");
}

#[test]
fn stray_state_found_on_start_is_cleaned_by_the_first_apply() {
    let d = desired(&[(fe4(1), &[be4(1), be4(2)]), (fe6(1), &[be6(1)])]);
    let mut first = fresh();
    first.apply(&d);
    let mut maps = first.maps().clone();
    let id1 = backend_id(&maps.dump, be4(1));
    let rid = revnat_id(&maps.dump, &fe4(1));
    // A slot beyond the master's count (a crash between the count drop and the delete).
    maps.dump.services.insert(
        (fe4(1), 3),
        SvcValue {
            backend_id: id1,
            rev_nat_id: rid,
            ..SvcValue::default()
        },
    );
    // A slot of a frontend with no master at all.
    maps.dump.services.insert(
        (fe4(7), 1),
        SvcValue {
            backend_id: id1,
            ..SvcValue::default()
        },
    );
    // A backend and rev-NAT entries nothing names, one per family.
    maps.dump.backends.insert(900, be4(99));
    maps.dump.backends.insert(901, be6(99));
    maps.dump.revnat.insert(700, (vip4(77), VPORT));
    maps.dump.revnat.insert(701, (vip6(77), VPORT));
    // A ClusterIP entry whose frontends are gone.
    maps.dump.cluster_ips.insert(vip4(77), 1);
    let text = render(&maps.dump);
    assert!(
        text.contains("orphan"),
        "the test input has orphans:\n{text}"
    );

    let mut rec = Reconciler::new(maps).expect("dump");
    let (report, ops) = apply_logged(&mut rec, &d);
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert_eq!(
        report.writes, 0,
        "the live services are fine as they are: {ops:#?}"
    );
    for op in [
        Op::DelSlot {
            fe: fe4(1).to_string(),
            slot: 3,
        },
        Op::DelSlot {
            fe: fe4(7).to_string(),
            slot: 1,
        },
        Op::DelBackend(900),
        Op::DelBackend(901),
        Op::DelRevNat(700),
        Op::DelRevNat(701),
        Op::DelClusterIp(vip4(77).to_string()),
    ] {
        assert!(ops.contains(&op), "{op:?} missing from {ops:#?}");
    }
    assert_eq!(ops.len(), 7, "{ops:#?}");
    assert_converged(dump_of(&rec), &d);
    let (report, ops) = apply_logged(&mut rec, &d);
    assert_eq!((report.writes, report.deletes), (0, 0), "{ops:#?}");
}

#[test]
fn missing_slot_and_revnat_found_on_start_are_repaired() {
    let d = desired(&[(fe4(1), &[be4(1), be4(2), be4(3)]), (fe4(2), &[be4(4)])]);
    let mut first = fresh();
    first.apply(&d);
    let mut maps = first.maps().clone();
    // Slot 2 of fe4(1) and fe4(1)'s rev-NAT entry (not the highest id) are gone.
    maps.dump.services.remove(&(fe4(1), 2));
    let rid1 = revnat_id(&maps.dump, &fe4(1));
    assert!(rid1 < revnat_id(&maps.dump, &fe4(2)));
    maps.dump.revnat.remove(&rid1);
    assert!(render(&maps.dump).contains("MISSING"));

    let mut rec = Reconciler::new(maps).expect("dump");
    let (report, ops) = apply_logged(&mut rec, &d);
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert!(
        ops.iter()
            .any(|o| matches!(o, Op::PutSlot { slot: 2, fe, .. } if *fe == fe4(1).to_string())),
        "{ops:#?}"
    );
    assert_converged(dump_of(&rec), &d);
    let (report, ops) = apply_logged(&mut rec, &d);
    assert_eq!((report.writes, report.deletes), (0, 0), "{ops:#?}");
}

#[test]
fn stray_slot_reused_by_growth_is_not_deleted() {
    // The maps hold fe4(1) with 2 slots and a stray slot 3 left over from an interrupted shrink.
    // The desired state grows fe4(1) to 3 backends, so slot 3 is written again and becomes
    // visible; the stray-slot cleanup that runs afterwards must not delete it.
    let two = desired(&[(fe4(1), &[be4(1), be4(2)])]);
    let mut first = fresh();
    first.apply(&two);
    let mut maps = first.maps().clone();
    let id1 = backend_id(&maps.dump, be4(1));
    maps.dump.services.insert(
        (fe4(1), 3),
        SvcValue {
            backend_id: id1,
            rev_nat_id: revnat_id(&maps.dump, &fe4(1)),
            ..SvcValue::default()
        },
    );
    let mut rec = Reconciler::new(maps).expect("dump");
    let three = desired(&[(fe4(1), &[be4(1), be4(2), be4(3)])]);
    let (report, ops) = apply_logged(&mut rec, &three);
    assert!(report.errors.is_empty());
    check_visible_consistency(dump_of(&rec)).unwrap_or_else(|e| {
        panic!(
            "{e}: 1/3 of new flows would find no backend\n{}\n{ops:#?}",
            render(dump_of(&rec))
        )
    });
    assert_converged(dump_of(&rec), &three);
}

#[test]
fn failed_surplus_delete_then_growth_keeps_the_slot() {
    // Same defect reached without a restart: a shrink whose slot delete fails records the slot as
    // stray; when the service grows back before the retry, the retry deletes a live slot.
    struct FailDel {
        inner: MemMaps,
        fail_del: Cell<bool>,
    }
    impl HasMem for FailDel {
        fn mem(&self) -> &MemMaps {
            &self.inner
        }
    }
    impl LbMaps for FailDel {
        fn dump(&self) -> anyhow::Result<Dump> {
            self.inner.dump()
        }
        fn capacity(&self, t: Table, f: Family) -> u32 {
            self.inner.capacity(t, f)
        }
        fn put_backend(&mut self, id: u32, b: &Backend) -> Result<(), MapOpError> {
            self.inner.put_backend(id, b)
        }
        fn del_backend(&mut self, id: u32, f: Family) -> Result<(), MapOpError> {
            self.inner.del_backend(id, f)
        }
        fn put_revnat(&mut self, id: u32, a: IpAddr, p: u16) -> Result<(), MapOpError> {
            self.inner.put_revnat(id, a, p)
        }
        fn del_revnat(&mut self, id: u32, f: Family) -> Result<(), MapOpError> {
            self.inner.del_revnat(id, f)
        }
        fn put_service(&mut self, fe: &Frontend, s: u16, v: &SvcValue) -> Result<(), MapOpError> {
            self.inner.put_service(fe, s, v)
        }
        fn del_service(&mut self, fe: &Frontend, s: u16) -> Result<(), MapOpError> {
            if self.fail_del.get() && s != 0 {
                return Err(MapOpError::Full {
                    map: Table::Services.map_name(Family::of(&fe.l4.addr)),
                });
            }
            self.inner.del_service(fe, s)
        }
        fn put_cluster_ip(&mut self, a: IpAddr, n: u32) -> Result<(), MapOpError> {
            self.inner.put_cluster_ip(a, n)
        }
        fn del_cluster_ip(&mut self, a: IpAddr) -> Result<(), MapOpError> {
            self.inner.del_cluster_ip(a)
        }
        fn put_src_range(&mut self, id: u32, c: &Cidr) -> Result<(), MapOpError> {
            self.inner.put_src_range(id, c)
        }
        fn del_src_range(&mut self, id: u32, c: &Cidr) -> Result<(), MapOpError> {
            self.inner.del_src_range(id, c)
        }
        fn put_aff_match(&mut self, m: &AffMatch) -> Result<(), MapOpError> {
            self.inner.put_aff_match(m)
        }
        fn del_aff_match(&mut self, m: &AffMatch) -> Result<(), MapOpError> {
            self.inner.del_aff_match(m)
        }
        fn put_echo(&mut self, a: IpAddr, v: EchoValue) -> Result<(), MapOpError> {
            self.inner.put_echo(a, v)
        }
        fn del_echo(&mut self, a: IpAddr) -> Result<(), MapOpError> {
            self.inner.del_echo(a)
        }
    }
    let mut rec = Reconciler::new(FailDel {
        inner: MemMaps::with_capacity(64),
        fail_del: Cell::new(false),
    })
    .expect("dump");
    let three = desired(&[(fe4(1), &[be4(1), be4(2), be4(3)])]);
    rec.apply(&three);
    rec.maps().fail_del.set(true);
    rec.apply(&desired(&[(fe4(1), &[be4(1), be4(2)])]));
    rec.maps().fail_del.set(false);
    let report = rec.apply(&three);
    assert!(report.errors.is_empty());
    assert_converged(dump_of(&rec), &three);
}

// ---------------------------------------------------------------------------------------------
// Capacity and errors.

fn error_for<'a>(report: &'a ApplyReport, fe: &Frontend) -> &'a str {
    let errs: Vec<_> = report.errors.iter().filter(|e| e.frontend == *fe).collect();
    assert_eq!(errs.len(), 1, "one error for {fe}: {:?}", report.errors);
    &errs[0].error
}

#[test]
fn new_service_that_does_not_fit_is_not_written_and_others_are() {
    // 6 service entries: fe4(2) needs 3, fe4(1) would need 7.
    let mut rec = Reconciler::new(MemMaps::with_capacity(6)).expect("dump");
    let big: Vec<Backend> = (11..=16).map(be4).collect();
    let d = desired(&[(fe4(1), &big), (fe4(2), &[be4(1), be4(2)])]);
    let (report, ops) = apply_logged(&mut rec, &d);
    assert_eq!(report.errors.len(), 1, "{:?}", report.errors);
    let err = error_for(&report, &fe4(1));
    assert!(err.contains("lb4_services"), "{err}");
    assert_eq!(report.errors[0].service, "test/svc0:http");
    // Nothing of it was written, not even its backends or rev-NAT.
    assert!(!ops.iter().any(|o| touches(o, &fe4(1))), "{ops:#?}");
    let dump = dump_of(&rec);
    assert!(
        dump.backends.values().all(|b| !big.contains(b)),
        "{}",
        render(dump)
    );
    let mut programmed = d.clone();
    programmed.services.remove(&fe4(1));
    assert_converged(dump, &programmed);
    assert!(render_block(dump, &fe4(1)).is_empty());
}

#[test]
fn grown_service_that_does_not_fit_keeps_its_previous_state() {
    let mut rec = Reconciler::new(MemMaps::with_capacity(6)).expect("dump");
    let before = desired(&[(fe4(1), &[be4(1), be4(2)]), (fe4(5), &[be4(5)])]);
    rec.apply(&before);
    assert_converged(dump_of(&rec), &before);
    let block_before = render_block(dump_of(&rec), &fe4(1));
    assert_eq!(block_before.len(), 3);
    let ids_before = backend_ids(dump_of(&rec));

    // 5 entries used, 1 free: fe4(1) growing by 2 does not fit; the new fe4(6) without
    // backends (1 entry) does, and comes after fe4(1) in apply order.
    let mut after = desired(&[
        (fe4(1), &[be4(1), be4(2), be4(3), be4(4)]),
        (fe4(5), &[be4(5)]),
        (fe4(6), &[]),
    ]);
    let (report, ops) = apply_logged(&mut rec, &after);
    assert_eq!(report.errors.len(), 1, "{:?}", report.errors);
    assert!(error_for(&report, &fe4(1)).contains("lb4_services"));
    assert!(!ops.iter().any(|o| touches(o, &fe4(1))), "{ops:#?}");
    let dump = dump_of(&rec);
    assert_eq!(
        render_block(dump, &fe4(1)),
        block_before,
        "previous state intact"
    );
    assert_eq!(
        backend_ids(dump).get(&be4(1).l4),
        ids_before.get(&be4(1).l4)
    );
    assert!(!backend_ids(dump).contains_key(&be4(3).l4));
    // Everything else is as desired: fe4(1) as before, the rest as asked.
    after
        .services
        .insert(fe4(1), before.services[&fe4(1)].clone());
    assert_converged(dump, &after);
}

#[test]
fn full_backend_map_is_reported_by_name() {
    let mut maps = MemMaps::with_capacity(64);
    maps.capacities.insert((Table::Backends, Family::V4), 3);
    let mut rec = Reconciler::new(maps).expect("dump");
    let d = desired(&[
        (fe4(1), &[be4(1), be4(2), be4(3), be4(4)]),
        (fe4(2), &[be4(5), be4(6)]),
        (fe6(1), &[be6(1), be6(2), be6(3), be6(4)]),
    ]);
    let (report, ops) = apply_logged(&mut rec, &d);
    assert_eq!(report.errors.len(), 1, "{:?}", report.errors);
    assert!(error_for(&report, &fe4(1)).contains("lb4_backends"));
    assert!(!ops.iter().any(|o| touches(o, &fe4(1))));
    let mut programmed = d.clone();
    programmed.services.remove(&fe4(1));
    assert_converged(dump_of(&rec), &programmed);
}

#[test]
fn full_revnat_map_is_reported_by_name() {
    let mut maps = MemMaps::with_capacity(64);
    maps.capacities.insert((Table::RevNat, Family::V4), 1);
    let mut rec = Reconciler::new(maps).expect("dump");
    let d = desired(&[(fe4(1), &[be4(1)]), (fe4(2), &[be4(2)])]);
    let (report, ops) = apply_logged(&mut rec, &d);
    assert_eq!(report.errors.len(), 1, "{:?}", report.errors);
    assert!(error_for(&report, &fe4(2)).contains("lb4_revnat"));
    assert!(!ops.iter().any(|o| touches(o, &fe4(2))));
    assert_eq!(
        ops.iter()
            .filter(|o| matches!(o, Op::PutBackend(_)))
            .count(),
        1,
        "only fe4(1)'s backend is written: {ops:#?}"
    );
    let mut programmed = d.clone();
    programmed.services.remove(&fe4(2));
    assert_converged(dump_of(&rec), &programmed);
}

#[test]
fn service_that_failed_for_room_is_programmed_once_room_is_freed() {
    // 5 entries: 3 + 3 do not fit, 2 + 3 do.
    let mut rec = Reconciler::new(MemMaps::with_capacity(5)).expect("dump");
    let d1 = desired(&[(fe4(1), &[be4(1), be4(2)]), (fe4(2), &[be4(3), be4(4)])]);
    let report = rec.apply(&d1);
    assert_eq!(report.errors.len(), 1);
    assert!(error_for(&report, &fe4(2)).contains("lb4_services"));
    // fe4(1) shrinks; the next apply has room for fe4(2).
    let d2 = desired(&[(fe4(1), &[be4(1)]), (fe4(2), &[be4(3), be4(4)])]);
    rec.apply(&d2);
    let report = rec.apply(&d2);
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert_converged(dump_of(&rec), &d2);
}

#[test]
fn replacing_a_service_at_full_capacity_succeeds_in_one_apply() {
    // The maps hold exactly one 3-entry service. The new manifests replace it by another
    // 3-entry service: the end state fits, but the new service is checked for room before the
    // old one is removed, so it is rejected. The daemon only applies again on SIGHUP, so the new
    // service stays unprogrammed until some unrelated change.
    let mut maps = MemMaps::with_capacity(64);
    maps.capacities.insert((Table::Services, Family::V4), 3);
    let mut rec = Reconciler::new(maps).expect("dump");
    rec.apply(&desired(&[(fe4(1), &[be4(1), be4(2)])]));
    let d = desired(&[(fe4(2), &[be4(1), be4(2)])]);
    let report = rec.apply(&d);
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert_converged(dump_of(&rec), &d);
}

#[test]
fn backend_of_the_other_family_fails_that_service_only() {
    let mut rec = fresh();
    let before = desired(&[(fe4(1), &[be4(1)]), (fe4(2), &[be4(2)])]);
    rec.apply(&before);
    let block_before = render_block(dump_of(&rec), &fe4(1));

    let mut d = desired(&[
        (fe4(1), &[be4(1), be6(1)]),
        (fe4(2), &[be4(2), be4(3)]),
        (fe6(1), &[be6(2), be4(4)]),
        (fe6(2), &[be6(3)]),
    ]);
    let (report, ops) = apply_logged(&mut rec, &d);
    assert_eq!(report.errors.len(), 2, "{:?}", report.errors);
    for fe in [fe4(1), fe6(1)] {
        assert!(
            error_for(&report, &fe).contains("family"),
            "{:?}",
            report.errors
        );
        assert!(!ops.iter().any(|o| touches(o, &fe)), "{ops:#?}");
    }
    let dump = dump_of(&rec);
    assert_eq!(
        render_block(dump, &fe4(1)),
        block_before,
        "installed service kept"
    );
    assert!(
        render_block(dump, &fe6(1)).is_empty(),
        "new service not written"
    );
    assert!(!backend_ids(dump).contains_key(&be6(1).l4));
    assert!(!backend_ids(dump).contains_key(&be4(4).l4));
    d.services.insert(fe4(1), before.services[&fe4(1)].clone());
    d.services.remove(&fe6(1));
    assert_converged(dump, &d);
}

#[test]
fn ipv4_and_ipv6_coexist_with_capacity_per_family() {
    // 4 entries per map and family: a 3-backend service of each family fits exactly.
    let mut rec = Reconciler::new(MemMaps::with_capacity(4)).expect("dump");
    let both = desired(&[
        (fe4(1), &[be4(1), be4(2), be4(3)]),
        (fe6(1), &[be6(1), be6(2), be6(3)]),
    ]);
    let (report, _) = apply_logged(&mut rec, &both);
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert_converged(dump_of(&rec), &both);
    let v4 = dump_of(&rec)
        .services
        .keys()
        .filter(|(fe, _)| fe.l4.addr.is_ipv4())
        .count();
    assert_eq!(v4, 4);

    // One more frontend of each family: each error names its own family's map.
    let mut more = both.clone();
    more.services.insert(fe4(2), entry("more4", &[]));
    more.services.insert(fe6(2), entry("more6", &[]));
    let (report, ops) = apply_logged(&mut rec, &more);
    assert_eq!(report.errors.len(), 2, "{:?}", report.errors);
    assert!(error_for(&report, &fe4(2)).contains("lb4_services"));
    assert!(error_for(&report, &fe6(2)).contains("lb6_services"));
    assert!(ops.is_empty(), "{ops:#?}");
    assert_converged(dump_of(&rec), &both);

    // Freeing IPv6 room does not help IPv4, and vice versa.
    let mut v6_shrunk = more.clone();
    v6_shrunk.services.insert(fe6(1), entry("svc1", &[be6(1)]));
    rec.apply(&v6_shrunk);
    let report = rec.apply(&v6_shrunk);
    assert_eq!(report.errors.len(), 1, "{:?}", report.errors);
    assert!(error_for(&report, &fe4(2)).contains("lb4_services"));
    let mut programmed = v6_shrunk.clone();
    programmed.services.remove(&fe4(2));
    assert_converged(dump_of(&rec), &programmed);
}

// ---------------------------------------------------------------------------------------------
// Write failures in the middle of a service.

#[test]
fn failed_slot_write_restores_the_previous_slots() {
    let mut rec = checked(64);
    let before = desired(&[(fe4(1), &[be4(1), be4(2), be4(3)]), (fe4(2), &[be4(9)])]);
    rec.apply(&before);
    let block_before = render_block(&rec.maps().inner.dump, &fe4(1));

    // Slots 2 and 3 change; slot 3's write fails after slot 2 was rewritten.
    rec.maps()
        .fail_on(Some(&format!("put service {} slot 3", fe4(1))));
    let after = desired(&[(fe4(1), &[be4(1), be4(4), be4(5)]), (fe4(2), &[be4(9)])]);
    let report = rec.apply(&after);
    assert_eq!(report.errors.len(), 1, "{:?}", report.errors);
    assert_eq!(report.errors[0].frontend, fe4(1));
    assert_no_violations(&rec);
    let dump = rec.maps().inner.dump.clone();
    assert_eq!(render_block(&dump, &fe4(1)), block_before);
    assert_converged(&dump, &before);

    // Once the map accepts writes again, the next apply converges.
    rec.maps().fail_on(None);
    let report = rec.apply(&after);
    assert!(report.errors.is_empty());
    assert_no_violations(&rec);
    assert_converged(&rec.maps().inner.dump, &after);
}

#[test]
fn failed_master_write_restores_the_previous_slots() {
    let mut rec = checked(64);
    let before = desired(&[(fe4(1), &[be4(1), be4(2)])]);
    rec.apply(&before);
    let block_before = render_block(&rec.maps().inner.dump, &fe4(1));

    rec.maps()
        .fail_on(Some(&format!("put service {} slot 0", fe4(1))));
    // Grow and change: slot 2 rewritten, slot 3 new; the master write fails.
    let after = desired(&[(fe4(1), &[be4(1), be4(3), be4(4)])]);
    let report = rec.apply(&after);
    assert_eq!(report.errors.len(), 1, "{:?}", report.errors);
    assert_no_violations(&rec);
    let dump = rec.maps().inner.dump.clone();
    assert_eq!(render_block(&dump, &fe4(1)), block_before);
    assert_converged(&dump, &before);

    rec.maps().fail_on(None);
    let report = rec.apply(&after);
    assert!(report.errors.is_empty());
    assert_converged(&rec.maps().inner.dump, &after);
}

#[test]
fn failed_backend_or_revnat_write_leaves_a_new_service_invisible() {
    for (what, fail) in [("backend", "put backend"), ("rev-NAT", "put revnat")] {
        let mut rec = checked(64);
        let keep = desired(&[(fe4(2), &[be4(9)])]);
        rec.apply(&keep);
        // Fail only writes made for the new service: ids above those already in use.
        // For backends the second one fails, after the first was written.
        let target = match what {
            "backend" => {
                rec.maps()
                    .inner
                    .dump
                    .backends
                    .keys()
                    .max()
                    .copied()
                    .unwrap_or(0)
                    + 2
            }
            _ => {
                rec.maps()
                    .inner
                    .dump
                    .revnat
                    .keys()
                    .max()
                    .copied()
                    .unwrap_or(0)
                    + 1
            }
        };
        rec.maps().fail_on(Some(&format!("{fail} {target}")));
        let mut d = keep.clone();
        d.services.insert(fe4(1), entry("new", &[be4(1), be4(2)]));
        let report = rec.apply(&d);
        assert_eq!(report.errors.len(), 1, "{what}: {:?}", report.errors);
        assert_eq!(report.errors[0].frontend, fe4(1));
        assert_no_violations(&rec);
        assert_converged(&rec.maps().inner.dump, &keep);

        rec.maps().fail_on(None);
        let report = rec.apply(&d);
        assert!(report.errors.is_empty(), "{what}: {:?}", report.errors);
        assert_converged(&rec.maps().inner.dump, &d);
    }
}

#[test]
fn failed_slot_write_of_a_new_service_leaves_nothing_visible_and_is_cleaned_up() {
    let mut rec = checked(64);
    rec.maps()
        .fail_on(Some(&format!("put service {} slot 2", fe4(1))));
    let d = desired(&[(fe4(1), &[be4(1), be4(2), be4(3)])]);
    let report = rec.apply(&d);
    assert_eq!(report.errors.len(), 1, "{:?}", report.errors);
    assert_no_violations(&rec);
    assert!(
        !rec.maps().inner.dump.services.contains_key(&(fe4(1), 0)),
        "no master: packets do not see the service"
    );
    // If the service is gone by the next apply, whatever was written for it is removed.
    rec.maps().fail_on(None);
    let report = rec.apply(&DesiredState::default());
    assert!(report.errors.is_empty());
    let dump = &rec.maps().inner.dump;
    assert_eq!(dump, &Dump::default(), "{}", render(dump));
}

#[test]
fn failed_slot_write_of_a_new_service_leaves_no_orphans() {
    let mut rec = checked(64);
    rec.maps()
        .fail_on(Some(&format!("put service {} slot 2", fe4(1))));
    let report = rec.apply(&desired(&[(fe4(1), &[be4(1), be4(2), be4(3)])]));
    assert_eq!(report.errors.len(), 1);
    let dump = &rec.maps().inner.dump;
    assert_eq!(render(dump), "", "not half-written");
}

/// The backend ids in `fe`'s slots `1..=count+qcount`, and its master's `(count, qcount)`.
fn slots_of(dump: &Dump, fe: &Frontend) -> (Vec<u32>, (u16, u16)) {
    let master = dump
        .services
        .get(&(*fe, 0))
        .unwrap_or_else(|| panic!("no master for {fe}"));
    let ids = (1..=master.slots())
        .map(|s| {
            dump.services
                .get(&(*fe, s))
                .unwrap_or_else(|| panic!("{fe} slot {s} missing"))
                .backend_id
        })
        .collect();
    (ids, (master.count, master.qcount))
}

fn backend_id_of(dump: &Dump, b: &Backend) -> u32 {
    dump.backends
        .iter()
        .find(|(_, v)| v.l4 == b.l4)
        .map(|(id, _)| *id)
        .unwrap_or_else(|| panic!("no backend {}", b.l4))
}

#[test]
fn shared_backend_in_different_states_gets_one_state_and_per_frontend_slots() {
    // Each frontend places a backend by its own state (active in 1..=count, terminating after),
    // while the backends map holds one state per address: the most usable one. Neither frontend
    // overwrites the other's view, so a second apply writes nothing.
    let mut rec = fresh();
    let d = desired(&[
        (fe4(1), &[be4(1), be4(2)]),
        (fe4(2), &[be4(2), terminating(be4(1))]),
    ]);
    let report = rec.apply(&d);
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    let dump = dump_of(&rec).clone();
    let (id1, id2) = (backend_id_of(&dump, &be4(1)), backend_id_of(&dump, &be4(2)));
    assert_eq!(slots_of(&dump, &fe4(1)), (vec![id1, id2], (2, 0)));
    assert_eq!(slots_of(&dump, &fe4(2)), (vec![id2, id1], (1, 1)));
    assert_eq!(dump.backends.len(), 2, "{}", render(&dump));
    assert_eq!(
        dump.backends[&id1].state,
        BackendState::Active,
        "the most usable state wins"
    );
    let (report, ops) = apply_logged(&mut rec, &d);
    assert_eq!((report.writes, report.deletes), (0, 0), "{ops:#?}");
}

#[test]
fn active_backends_take_the_first_slots_whatever_the_input_order() {
    let mut rec = fresh();
    let d = desired(&[(
        fe4(1),
        &[terminating(be4(1)), be4(2), terminating(be4(3)), be4(4)],
    )]);
    let report = rec.apply(&d);
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    let dump = dump_of(&rec);
    let id = |n| backend_id_of(dump, &be4(n));
    // New flows pick from slots 1..=count: only the active backends may be there.
    assert_eq!(
        slots_of(dump, &fe4(1)),
        (vec![id(2), id(4), id(1), id(3)], (2, 2)),
        "{}",
        render(dump)
    );
    let (again, ops) = apply_logged(&mut rec, &d);
    assert_eq!((again.writes, again.deletes), (0, 0), "{ops:#?}");
}

#[test]
fn missing_revnat_with_the_highest_id_is_repaired() {
    let d = desired(&[(fe4(1), &[be4(1)]), (fe4(2), &[be4(2)])]);
    let mut first = fresh();
    first.apply(&d);
    let mut maps = first.maps().clone();
    let rid2 = revnat_id(&maps.dump, &fe4(2));
    assert_eq!(maps.dump.revnat.keys().max(), Some(&rid2));
    maps.dump.revnat.remove(&rid2);

    let mut rec = Reconciler::new(maps).expect("dump");
    let report = rec.apply(&d);
    assert!(report.errors.is_empty());
    // Replies from fe4(2)'s backends cannot be reverse-NATed while this entry is missing.
    assert_converged(dump_of(&rec), &d);
}

/// The ClusterIP set brackets the frontends at an address: written before the first master,
/// deleted after the last is gone, and holding ClusterIPs only (kube-proxy's `cluster-ips`).
#[test]
fn cluster_ip_set_brackets_the_frontends_of_an_address() {
    let mut rec = checked(64);
    let http = fe4(1);
    let https = Frontend::new(vip4(1), 443, Proto::Tcp);
    let dns = Frontend::new(vip6(1), 53, Proto::Udp);
    let external = Frontend::new(vip4(5), VPORT, Proto::Tcp);
    let mut d = desired(&[(http, &[be4(1)]), (https, &[be4(2)]), (dns, &[be6(1)])]);
    let mut ext = entry("ext", &[be4(3)]);
    ext.flags = svc_flags::EXTERNAL_IP;
    d.services.insert(external, ext);

    let (report, ops) = apply_logged(&mut rec, &d);
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert_no_violations(&rec);
    let put = position(&ops, "put of the ClusterIP", |o| {
        *o == Op::PutClusterIp(vip4(1).to_string())
    });
    assert!(
        put < master_put(&ops, &http) && put < master_put(&ops, &https),
        "{ops:#?}"
    );
    assert!(
        !ops.contains(&Op::PutClusterIp(vip4(5).to_string())),
        "an ExternalIP is no ClusterIP: {ops:#?}"
    );
    assert_eq!(dump_of(&rec).cluster_ips.get(&vip4(1)), Some(&2));
    assert_eq!(
        dump_of(&rec).cluster_ips.len(),
        2,
        "{}",
        render(dump_of(&rec))
    );

    // One port fewer: the address stays, its count drops.
    d.services.remove(&https);
    d.services.remove(&external);
    let (_, ops) = apply_logged(&mut rec, &d);
    assert!(
        !ops.iter().any(|o| matches!(o, Op::DelClusterIp(_))),
        "{ops:#?}"
    );
    assert_converged(dump_of(&rec), &d);

    // The last frontend of the address goes: its master first, then the ClusterIP.
    d.services.remove(&http);
    let (_, ops) = apply_logged(&mut rec, &d);
    let master_del = position(&ops, "master delete", |o| {
        *o == Op::DelSlot {
            fe: http.to_string(),
            slot: 0,
        }
    });
    let ip_del = position(&ops, "ClusterIP delete", |o| {
        *o == Op::DelClusterIp(vip4(1).to_string())
    });
    assert!(master_del < ip_del, "{ops:#?}");
    assert_no_violations(&rec);
    assert_converged(dump_of(&rec), &d);
}

/// A ClusterIP entry that cannot be written costs only the unknown-port REJECT of that address:
/// the frontends are programmed, and the next apply writes the entry.
#[test]
fn failed_cluster_ip_write_is_retried_and_does_not_block_the_service() {
    let mut rec = checked(64);
    let d = desired(&[(fe4(1), &[be4(1)])]);
    rec.maps().fail_on(Some("put cluster-ip"));
    let report = rec.apply(&d);
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert!(dump_of(&rec).services.contains_key(&(fe4(1), 0)));
    assert!(dump_of(&rec).cluster_ips.is_empty());
    rec.maps().fail_on(None);
    let (report, ops) = apply_logged(&mut rec, &d);
    assert_eq!(report.writes, 1, "{ops:#?}");
    assert_converged(dump_of(&rec), &d);
}

/// `loadBalancerSourceRanges` never drop what they allow while a master relies on them: a
/// range is written before the master that turns SOURCE_RANGES on, a new range before the old
/// one goes, and ranges are deleted only after the master stopped using them.
#[test]
fn source_ranges_come_before_their_master_and_go_after_it() {
    let mut rec = Reconciler::new(MemMaps::with_capacity(64)).expect("dump");
    let fe = fe4(1);
    let with = |ranges: &[&str]| {
        let mut e = entry("lb", &[be4(1)]);
        if !ranges.is_empty() {
            e.flags = svc_flags::LOAD_BALANCER | svc_flags::SOURCE_RANGES;
            e.source_ranges = ranges.iter().map(|r| r.parse().unwrap()).collect();
        } else {
            e.flags = svc_flags::LOAD_BALANCER;
        }
        DesiredState {
            services: [(fe, e)].into(),
        }
    };
    let is_master = |o: &Op| matches!(o, Op::PutSlot { slot: 0, .. });
    let (report, ops) = apply_logged(&mut rec, &with(&["198.18.99.0/24"]));
    assert!(report.errors.is_empty(), "{report:?}");
    let range = position(
        &ops,
        "range",
        |o| matches!(o, Op::PutSrcRange(_, c) if c == "198.18.99.0/24"),
    );
    assert!(range < position(&ops, "master", is_master), "{ops:#?}");

    let (_, ops) = apply_logged(&mut rec, &with(&["198.18.98.0/24"]));
    let new = position(
        &ops,
        "new range",
        |o| matches!(o, Op::PutSrcRange(_, c) if c == "198.18.98.0/24"),
    );
    let old = position(
        &ops,
        "old range",
        |o| matches!(o, Op::DelSrcRange(_, c) if c == "198.18.99.0/24"),
    );
    assert!(new < old, "{ops:#?}");
    assert_eq!(rec.maps().dump.src_ranges.len(), 1);

    let (_, ops) = apply_logged(&mut rec, &with(&[]));
    let master = position(&ops, "master", is_master);
    let gone = position(&ops, "range gone", |o| matches!(o, Op::DelSrcRange(..)));
    assert!(master < gone, "{ops:#?}");
    assert!(rec.maps().dump.src_ranges.is_empty());
}

// ---------------------------------------------------------------------------------------------
// Session affinity.

fn affine(d: &mut DesiredState, fe: &Frontend, timeout: u32) {
    let e = d.services.get_mut(fe).expect("frontend");
    e.flags |= svc_flags::AFFINITY;
    e.affinity_timeout = timeout;
}

#[test]
fn affinity_matches_follow_the_active_backends_in_a_safe_order() {
    let mut rec = checked(64);
    let mut d = desired(&[(fe4(1), &[be4(1), be4(2), terminating(be4(3))])]);
    affine(&mut d, &fe4(1), 30);
    let (report, ops) = apply_logged(&mut rec, &d);
    assert!(report.errors.is_empty(), "{report:?}");
    assert_converged(dump_of(&rec), &d);
    let rev = revnat_id(dump_of(&rec), &fe4(1));
    let master = master_put(&ops, &fe4(1));
    // Both active backends match before the master offers them; the terminating one never.
    for b in [be4(1), be4(2)] {
        let id = backend_id(dump_of(&rec), b);
        let put = position(&ops, "match put", |o| *o == Op::PutAffMatch(rev, id));
        assert!(put < master, "{ops:#?}");
    }
    let draining = backend_id(dump_of(&rec), terminating(be4(3)));
    assert!(!ops.contains(&Op::PutAffMatch(rev, draining)), "{ops:#?}");

    // be4(1) leaves: its match goes before the master stops offering it, be4(4)'s comes first.
    let mut d2 = desired(&[(fe4(1), &[be4(2), be4(4)])]);
    affine(&mut d2, &fe4(1), 30);
    let gone = backend_id(dump_of(&rec), be4(1));
    let (_, ops) = apply_logged(&mut rec, &d2);
    assert_converged(dump_of(&rec), &d2);
    let master = master_put(&ops, &fe4(1));
    let new = backend_id(dump_of(&rec), be4(4));
    assert!(position(&ops, "match del", |o| *o == Op::DelAffMatch(rev, gone)) < master);
    assert!(position(&ops, "match put", |o| *o == Op::PutAffMatch(rev, new)) < master);

    // Affinity switched off: every match of the frontend goes, the master says no timeout.
    let d3 = desired(&[(fe4(1), &[be4(2), be4(4)])]);
    apply_logged(&mut rec, &d3);
    assert_converged(dump_of(&rec), &d3);
    assert!(dump_of(&rec).aff_match.is_empty());
    // And the whole service removed with affinity on leaves no match behind either.
    apply_logged(&mut rec, &d2);
    apply_logged(&mut rec, &DesiredState::default());
    assert!(
        dump_of(&rec).aff_match.is_empty(),
        "{}",
        render(dump_of(&rec))
    );
    assert_no_violations(&rec);
}

#[test]
fn affinity_matches_are_rewritten_after_a_restart_that_lost_them() {
    let mut d = desired(&[(fe4(1), &[be4(1), be4(2)])]);
    affine(&mut d, &fe4(1), 10_800);
    let mut rec = fresh();
    rec.apply(&d);
    // A restart onto pins whose match map is new (empty): an otherwise unchanged service
    // must get its matches again.
    let mut dump = dump_of(&rec).clone();
    dump.aff_match.clear();
    let mut maps = MemMaps::with_capacity(1024);
    maps.dump = dump;
    let mut rec = Reconciler::new(maps).expect("dump");
    let report = rec.apply(&d);
    assert!(report.writes >= 2, "{report:?}");
    assert_converged(dump_of(&rec), &d);
}

// ---------------------------------------------------------------------------------------------
// Held writes: the first apply on empty maps (a cold start) hands its backend, rev-NAT and
// service writes to the maps to write together (`LbMaps::hold_writes`, batches in `BpfMaps`).

/// A held write.
enum HeldOp {
    ClusterIp(IpAddr, u32),
    Backend(u32, Backend),
    RevNat(u32, IpAddr, u16),
    Service(Frontend, u16, SvcValue),
    Echo(IpAddr, EchoValue),
}

/// `Checked` that holds writes as `BpfMaps` does: queued, then replayed by `release_writes`
/// in its order (ClusterIPs, backends, rev-NAT, slots, masters, echo), stopping at the first
/// failure.
struct Holding {
    inner: Checked,
    held: Option<Vec<HeldOp>>,
    holds: usize,
}

impl Holding {
    fn new(capacity: u32) -> Self {
        Self {
            inner: Checked::new(capacity),
            held: None,
            holds: 0,
        }
    }

    fn release(&mut self) -> Result<(), MapOpError> {
        let Some(ops) = self.held.take() else {
            return Ok(());
        };
        let rank = |op: &HeldOp| match op {
            HeldOp::ClusterIp(..) => -1,
            HeldOp::Backend(..) => 0,
            HeldOp::RevNat(..) => 1,
            HeldOp::Service(_, slot, _) if *slot != 0 => 2,
            HeldOp::Service(..) => 3,
            HeldOp::Echo(..) => 4,
        };
        let mut ops: Vec<(i32, HeldOp)> = ops.into_iter().map(|op| (rank(&op), op)).collect();
        // Stable: each group keeps the order of its writes.
        ops.sort_by_key(|(r, _)| *r);
        for (_, op) in ops {
            match op {
                HeldOp::ClusterIp(addr, n) => self.inner.put_cluster_ip(addr, n)?,
                HeldOp::Backend(id, b) => self.inner.put_backend(id, &b)?,
                HeldOp::RevNat(id, addr, port) => self.inner.put_revnat(id, addr, port)?,
                HeldOp::Service(fe, slot, v) => self.inner.put_service(&fe, slot, &v)?,
                HeldOp::Echo(addr, v) => self.inner.put_echo(addr, v)?,
            }
        }
        Ok(())
    }
}

impl HasMem for Holding {
    fn mem(&self) -> &MemMaps {
        self.inner.mem()
    }
}

impl LbMaps for Holding {
    fn dump(&self) -> anyhow::Result<Dump> {
        self.inner.dump()
    }

    fn capacity(&self, table: Table, family: Family) -> u32 {
        self.inner.capacity(table, family)
    }

    fn put_backend(&mut self, id: u32, backend: &Backend) -> Result<(), MapOpError> {
        match &mut self.held {
            Some(h) => {
                h.push(HeldOp::Backend(id, *backend));
                Ok(())
            }
            None => self.inner.put_backend(id, backend),
        }
    }

    fn del_backend(&mut self, id: u32, family: Family) -> Result<(), MapOpError> {
        self.release()?;
        self.inner.del_backend(id, family)
    }

    fn put_revnat(&mut self, id: u32, addr: IpAddr, port: u16) -> Result<(), MapOpError> {
        match &mut self.held {
            Some(h) => {
                h.push(HeldOp::RevNat(id, addr, port));
                Ok(())
            }
            None => self.inner.put_revnat(id, addr, port),
        }
    }

    fn del_revnat(&mut self, id: u32, family: Family) -> Result<(), MapOpError> {
        self.release()?;
        self.inner.del_revnat(id, family)
    }

    fn put_service(
        &mut self,
        frontend: &Frontend,
        slot: u16,
        value: &SvcValue,
    ) -> Result<(), MapOpError> {
        match &mut self.held {
            Some(h) => {
                h.push(HeldOp::Service(*frontend, slot, *value));
                Ok(())
            }
            None => self.inner.put_service(frontend, slot, value),
        }
    }

    fn del_service(&mut self, frontend: &Frontend, slot: u16) -> Result<(), MapOpError> {
        self.release()?;
        self.inner.del_service(frontend, slot)
    }

    fn put_cluster_ip(&mut self, addr: IpAddr, frontends: u32) -> Result<(), MapOpError> {
        match &mut self.held {
            Some(h) => {
                h.push(HeldOp::ClusterIp(addr, frontends));
                Ok(())
            }
            None => self.inner.put_cluster_ip(addr, frontends),
        }
    }

    fn del_cluster_ip(&mut self, addr: IpAddr) -> Result<(), MapOpError> {
        self.release()?;
        self.inner.del_cluster_ip(addr)
    }

    fn put_src_range(&mut self, id: u32, cidr: &Cidr) -> Result<(), MapOpError> {
        self.inner.put_src_range(id, cidr)
    }

    fn del_src_range(&mut self, id: u32, cidr: &Cidr) -> Result<(), MapOpError> {
        self.inner.del_src_range(id, cidr)
    }

    fn put_aff_match(&mut self, m: &AffMatch) -> Result<(), MapOpError> {
        self.inner.put_aff_match(m)
    }

    fn del_aff_match(&mut self, m: &AffMatch) -> Result<(), MapOpError> {
        self.inner.del_aff_match(m)
    }

    fn put_echo(&mut self, a: IpAddr, v: EchoValue) -> Result<(), MapOpError> {
        match &mut self.held {
            Some(h) => {
                h.push(HeldOp::Echo(a, v));
                Ok(())
            }
            None => self.inner.put_echo(a, v),
        }
    }

    fn del_echo(&mut self, a: IpAddr) -> Result<(), MapOpError> {
        self.release()?;
        self.inner.del_echo(a)
    }

    fn hold_writes(&mut self) {
        self.holds += 1;
        self.held.get_or_insert_with(Vec::new);
    }

    fn release_writes(&mut self) -> Result<(), MapOpError> {
        self.release()
    }
}

fn holding_desired() -> DesiredState {
    desired(&[
        (fe4(1), &[be4(1), be4(2), be4(3)]),
        (fe4(2), &[be4(3), be4(4)]),
        (fe4(3), &[]),
        (fe4(4), &[be4(5)]),
        (fe6(1), &[be6(1), be6(2)]),
    ])
}

#[test]
fn a_cold_apply_holds_its_writes_and_releases_masters_after_what_they_name() {
    let mut rec = Reconciler::new(Holding::new(1024)).expect("dump");
    let d = holding_desired();
    let report = rec.apply(&d);
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert_eq!(rec.maps().holds, 1, "the first apply on empty maps holds");
    assert!(
        rec.maps().inner.violations.is_empty(),
        "{:#?}",
        rec.maps().inner.violations
    );
    assert_converged(dump_of(&rec), &d);
    // Released in groups: every master after every backend, rev-NAT and slot write.
    let ops: Vec<Op> = rec.maps().mem().journal.iter().map(op_of).collect();
    let first_master = ops
        .iter()
        .position(|o| matches!(o, Op::PutSlot { slot: 0, .. }))
        .expect("a master written");
    let last_other = ops
        .iter()
        .rposition(|o| {
            matches!(o, Op::PutBackend(_) | Op::PutRevNat(_))
                || matches!(o, Op::PutSlot { slot, .. } if *slot != 0)
        })
        .expect("backends written");
    assert!(last_other < first_master, "{ops:#?}");
    // A new ClusterIP before anything of its frontends, as entry by entry.
    let last_ip = ops
        .iter()
        .rposition(|o| matches!(o, Op::PutClusterIp(_)))
        .expect("ClusterIPs written");
    let first_backend = ops
        .iter()
        .position(|o| matches!(o, Op::PutBackend(_)))
        .expect("backends written");
    assert!(last_ip < first_backend, "{ops:#?}");
    // The echo entries are held too, and come after the last master.
    let last_master = ops
        .iter()
        .rposition(|o| matches!(o, Op::PutSlot { slot: 0, .. }))
        .expect("a master written");
    let first_echo = ops
        .iter()
        .position(|o| matches!(o, Op::PutEcho(_)))
        .expect("echo entries written");
    assert!(last_master < first_echo, "{ops:#?}");

    // Maps in use are updated entry by entry.
    let mut d2 = d.clone();
    d2.services.insert(fe4(5), entry("svc5", &[be4(6)]));
    let report = rec.apply(&d2);
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert_eq!(rec.maps().holds, 1, "a second apply does not hold");
    assert_converged(dump_of(&rec), &d2);
}

#[test]
fn a_failed_release_is_redone_entry_by_entry_and_names_the_failing_frontend() {
    let maps = Holding::new(1024);
    // The third frontend's master fails, in the release and again entry by entry.
    let failing = fe4(3);
    maps.inner
        .fail_on(Some(&format!("put service {failing} slot 0")));
    let mut rec = Reconciler::new(maps).expect("dump");
    let d = holding_desired();
    let report = rec.apply(&d);
    let failed: Vec<Frontend> = report.errors.iter().map(|e| e.frontend).collect();
    assert_eq!(failed, vec![failing], "{:?}", report.errors);
    assert!(
        rec.maps().inner.violations.is_empty(),
        "a packet could have seen a half-written service: {:#?}",
        rec.maps().inner.violations
    );
    // Every other frontend is programmed.
    let dump = dump_of(&rec);
    for fe in d.services.keys().filter(|fe| **fe != failing) {
        assert!(dump.services.contains_key(&(*fe, 0)), "{fe} not programmed");
    }
    assert!(!dump.services.contains_key(&(failing, 0)));

    // Once the write succeeds, the next apply converges.
    rec.maps().inner.fail_on(None);
    let report = rec.apply(&d);
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert_converged(dump_of(&rec), &d);
    assert!(rec.maps().inner.violations.is_empty());
}
