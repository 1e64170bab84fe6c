//! Test doubles of the maps, out of the product build (feature `testing`, which the tests
//! crate turns on): `MemMaps`, an in-memory `LbMaps` with the kernel maps' capacity semantics
//! and a journal of every write and delete (`MapOp`), and `render`, the stable text form of a
//! `Dump` the golden tests compare.
use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
    net::IpAddr,
};

use lb_common::{EchoValue, SvcValue, lb_alg, map_names, svc_flags};

use super::maps::{
    AffMatch, Dump, LbMaps, MaglevGeometry, MapOpError, Table, echo_text, maglev_table_of,
};
use crate::{
    model::{Backend, Family, Frontend, Scope, flag_names},
    node::Cidr,
};

/// One write or delete `MemMaps` performed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MapOp {
    PutBackend {
        id: u32,
        backend: Backend,
    },
    DelBackend {
        id: u32,
    },
    PutRevNat {
        id: u32,
        addr: IpAddr,
        port: u16,
    },
    DelRevNat {
        id: u32,
    },
    PutService {
        frontend: Frontend,
        slot: u16,
        value: SvcValue,
    },
    DelService {
        frontend: Frontend,
        slot: u16,
    },
    PutClusterIp {
        addr: IpAddr,
        frontends: u32,
    },
    DelClusterIp {
        addr: IpAddr,
    },
    PutSrcRange {
        rev_nat_id: u32,
        cidr: Cidr,
    },
    DelSrcRange {
        rev_nat_id: u32,
        cidr: Cidr,
    },
    PutAffMatch(AffMatch),
    DelAffMatch(AffMatch),
    PutEcho {
        addr: IpAddr,
        value: EchoValue,
    },
    DelEcho {
        addr: IpAddr,
    },
    PutMaglev {
        table: u32,
        cell: u32,
        id: u32,
    },
}

impl MapOp {
    pub fn is_write(&self) -> bool {
        matches!(
            self,
            MapOp::PutBackend { .. }
                | MapOp::PutRevNat { .. }
                | MapOp::PutService { .. }
                | MapOp::PutClusterIp { .. }
                | MapOp::PutSrcRange { .. }
                | MapOp::PutAffMatch(_)
                | MapOp::PutEcho { .. }
                | MapOp::PutMaglev { .. }
        )
    }
}

impl std::fmt::Display for MapOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MapOp::PutBackend { id, backend } => write!(f, "put backend {id} {}", backend.l4),
            MapOp::DelBackend { id } => write!(f, "del backend {id}"),
            MapOp::PutRevNat { id, addr, port } => write!(f, "put revnat {id} {addr}:{port}"),
            MapOp::DelRevNat { id } => write!(f, "del revnat {id}"),
            MapOp::PutService {
                frontend,
                slot,
                value,
            } => write!(
                f,
                "put service {frontend} slot {slot} backend {} count {}",
                value.backend_id, value.count
            ),
            MapOp::DelService { frontend, slot } => write!(f, "del service {frontend} slot {slot}"),
            MapOp::PutClusterIp { addr, frontends } => {
                write!(f, "put cluster-ip {addr} frontends {frontends}")
            }
            MapOp::DelClusterIp { addr } => write!(f, "del cluster-ip {addr}"),
            MapOp::PutSrcRange { rev_nat_id, cidr } => {
                write!(f, "put source-range {rev_nat_id} {cidr}")
            }
            MapOp::DelSrcRange { rev_nat_id, cidr } => {
                write!(f, "del source-range {rev_nat_id} {cidr}")
            }
            MapOp::PutAffMatch(m) => write!(
                f,
                "put aff-match revnat {} {} backend {}",
                m.rev_nat_id,
                m.scope.as_str(),
                m.backend_id
            ),
            MapOp::DelAffMatch(m) => write!(
                f,
                "del aff-match revnat {} {} backend {}",
                m.rev_nat_id,
                m.scope.as_str(),
                m.backend_id
            ),
            MapOp::PutEcho { addr, value } => write!(f, "put echo {addr} {}", echo_text(value)),
            MapOp::DelEcho { addr } => write!(f, "del echo {addr}"),
            MapOp::PutMaglev { table, cell, id } => {
                write!(f, "put maglev table {table} cell {cell} backend {id}")
            }
        }
    }
}

/// An in-memory stand-in with the kernel maps' capacity semantics, for reconciler unit tests
/// (the datapath itself is always tested against the kernel).
#[derive(Clone, Debug, Default)]
pub struct MemMaps {
    pub dump: Dump,
    pub capacities: BTreeMap<(Table, Family), u32>,
    /// Every write and delete, in order, for ordering assertions.
    pub journal: Vec<MapOp>,
    /// `lb_maglev`'s shape (`with_capacity`: 8 tables of 251 cells); the cells of the tables
    /// masters name are in `dump.maglev`.
    pub maglev_geometry: MaglevGeometry,
}

impl MemMaps {
    pub fn with_capacity(n: u32) -> Self {
        let mut capacities = BTreeMap::new();
        for t in Table::ALL {
            for f in [Family::V4, Family::V6] {
                capacities.insert((t, f), n);
            }
        }
        Self {
            capacities,
            maglev_geometry: MaglevGeometry {
                table_size: 251,
                tables: 8,
            },
            ..Self::default()
        }
    }

    fn check_room(&self, table: Table, family: Family, exists: bool) -> Result<(), MapOpError> {
        if !exists && self.dump.len(table, family) >= self.capacity(table, family) as usize {
            return Err(MapOpError::Full {
                map: table.map_name(family),
            });
        }
        Ok(())
    }
}

impl LbMaps for MemMaps {
    fn dump(&self) -> anyhow::Result<Dump> {
        Ok(self.dump.clone())
    }

    fn capacity(&self, table: Table, family: Family) -> u32 {
        self.capacities.get(&(table, family)).copied().unwrap_or(0)
    }

    fn put_backend(&mut self, id: u32, backend: &Backend) -> Result<(), MapOpError> {
        let family = Family::of(&backend.l4.addr);
        self.check_room(
            Table::Backends,
            family,
            self.dump.backends.contains_key(&id),
        )?;
        self.journal.push(MapOp::PutBackend {
            id,
            backend: *backend,
        });
        self.dump.backends.insert(id, *backend);
        Ok(())
    }

    fn del_backend(&mut self, id: u32, _family: Family) -> Result<(), MapOpError> {
        self.journal.push(MapOp::DelBackend { id });
        self.dump.backends.remove(&id);
        Ok(())
    }

    fn put_revnat(&mut self, id: u32, addr: IpAddr, port: u16) -> Result<(), MapOpError> {
        let family = Family::of(&addr);
        self.check_room(Table::RevNat, family, self.dump.revnat.contains_key(&id))?;
        self.journal.push(MapOp::PutRevNat { id, addr, port });
        self.dump.revnat.insert(id, (addr, port));
        Ok(())
    }

    fn del_revnat(&mut self, id: u32, _family: Family) -> Result<(), MapOpError> {
        self.journal.push(MapOp::DelRevNat { id });
        self.dump.revnat.remove(&id);
        Ok(())
    }

    fn put_service(
        &mut self,
        frontend: &Frontend,
        slot: u16,
        value: &SvcValue,
    ) -> Result<(), MapOpError> {
        let family = Family::of(&frontend.l4.addr);
        let exists = self.dump.services.contains_key(&(*frontend, slot));
        self.check_room(Table::Services, family, exists)?;
        self.journal.push(MapOp::PutService {
            frontend: *frontend,
            slot,
            value: *value,
        });
        self.dump.services.insert((*frontend, slot), *value);
        Ok(())
    }

    fn del_service(&mut self, frontend: &Frontend, slot: u16) -> Result<(), MapOpError> {
        self.journal.push(MapOp::DelService {
            frontend: *frontend,
            slot,
        });
        self.dump.services.remove(&(*frontend, slot));
        Ok(())
    }

    fn put_cluster_ip(&mut self, addr: IpAddr, frontends: u32) -> Result<(), MapOpError> {
        let exists = self.dump.cluster_ips.contains_key(&addr);
        self.check_room(Table::ClusterIps, Family::of(&addr), exists)?;
        self.journal.push(MapOp::PutClusterIp { addr, frontends });
        self.dump.cluster_ips.insert(addr, frontends);
        Ok(())
    }

    fn del_cluster_ip(&mut self, addr: IpAddr) -> Result<(), MapOpError> {
        self.journal.push(MapOp::DelClusterIp { addr });
        self.dump.cluster_ips.remove(&addr);
        Ok(())
    }

    fn put_src_range(&mut self, rev_nat_id: u32, cidr: &Cidr) -> Result<(), MapOpError> {
        let exists = self.dump.src_ranges.contains(&(rev_nat_id, *cidr));
        self.check_room(Table::SourceRanges, Family::of(&cidr.addr), exists)?;
        self.journal.push(MapOp::PutSrcRange {
            rev_nat_id,
            cidr: *cidr,
        });
        self.dump.src_ranges.insert((rev_nat_id, *cidr));
        Ok(())
    }

    fn del_src_range(&mut self, rev_nat_id: u32, cidr: &Cidr) -> Result<(), MapOpError> {
        self.journal.push(MapOp::DelSrcRange {
            rev_nat_id,
            cidr: *cidr,
        });
        self.dump.src_ranges.remove(&(rev_nat_id, *cidr));
        Ok(())
    }

    fn put_aff_match(&mut self, entry: &AffMatch) -> Result<(), MapOpError> {
        let exists = self.dump.aff_match.contains(entry);
        self.check_room(Table::AffinityMatch, entry.family, exists)?;
        self.journal.push(MapOp::PutAffMatch(*entry));
        self.dump.aff_match.insert(*entry);
        Ok(())
    }

    fn del_aff_match(&mut self, entry: &AffMatch) -> Result<(), MapOpError> {
        self.journal.push(MapOp::DelAffMatch(*entry));
        self.dump.aff_match.remove(entry);
        Ok(())
    }

    fn put_echo(&mut self, addr: IpAddr, value: EchoValue) -> Result<(), MapOpError> {
        let exists = self.dump.echo.contains_key(&addr);
        self.check_room(Table::Echo, Family::of(&addr), exists)?;
        self.journal.push(MapOp::PutEcho { addr, value });
        self.dump.echo.insert(addr, value);
        Ok(())
    }

    fn del_echo(&mut self, addr: IpAddr) -> Result<(), MapOpError> {
        self.journal.push(MapOp::DelEcho { addr });
        self.dump.echo.remove(&addr);
        Ok(())
    }

    fn maglev_geometry(&self) -> MaglevGeometry {
        self.maglev_geometry
    }

    fn put_maglev(&mut self, table: u32, cell: u32, id: u32) -> Result<(), MapOpError> {
        let g = self.maglev_geometry;
        if table >= g.tables || cell >= g.table_size {
            return Err(MapOpError::Full {
                map: map_names::MAGLEV,
            });
        }
        self.journal.push(MapOp::PutMaglev { table, cell, id });
        let cells = self
            .dump
            .maglev
            .entry(table)
            .or_insert_with(|| vec![0; g.table_size as usize]);
        cells[cell as usize] = id;
        Ok(())
    }
}

/// A stable, human-readable rendering of the maps: one block per frontend with its slots
/// resolved to backend addresses, then orphans (entries nothing points to). Golden tests
/// compare against it.
pub fn render(dump: &Dump) -> String {
    let mut out = String::new();
    let mut referenced_backends = BTreeSet::new();
    let mut referenced_revnat = BTreeSet::new();
    for ((fe, slot), v) in &dump.services {
        if *slot != 0 {
            continue;
        }
        referenced_revnat.insert(v.rev_nat_id);
        render_frontend(&mut out, dump, fe, v);
        render_slots(&mut out, dump, fe, v, &mut referenced_backends);
    }
    render_orphans(&mut out, dump, &referenced_backends, &referenced_revnat);
    render_address_sets(&mut out, dump);
    render_frontend_sets(&mut out, dump);
    out
}

/// A frontend's master line, its affinity check and its Maglev table.
fn render_frontend(out: &mut String, dump: &Dump, fe: &Frontend, v: &SvcValue) {
    let scope = if fe.scope == Scope::Internal {
        " scope=internal"
    } else {
        ""
    };
    let revnat = match dump.revnat.get(&v.rev_nat_id) {
        Some((a, p)) if (*a, *p) == (fe.l4.addr, fe.l4.port) => "ok".to_string(),
        Some((a, p)) => format!("MISMATCH {a}:{p}"),
        None => "MISSING".to_string(),
    };
    let alg = match (v.lb_alg, maglev_table_of(v)) {
        (lb_alg::MAGLEV, Some(t)) => format!(" alg=maglev table={t}"),
        (lb_alg::MAGLEV, None) => " alg=maglev table=none".to_string(),
        _ => String::new(),
    };
    let _ = writeln!(
        out,
        "{}{scope} flags={} count={} qcount={} revnat={}({revnat}){alg}",
        fe.l4,
        flag_names(v.flags),
        v.count,
        v.qcount,
        v.rev_nat_id
    );
    if v.flags & svc_flags::AFFINITY != 0 {
        render_affinity(out, dump, fe, v);
    }
    if let Some(t) = maglev_table_of(v) {
        render_maglev(out, dump, t);
    }
}

/// A frontend's affinity line: the match entries must name exactly the active slots'
/// backends.
fn render_affinity(out: &mut String, dump: &Dump, fe: &Frontend, v: &SvcValue) {
    let family = Family::of(&fe.l4.addr);
    let active: BTreeSet<u32> = (1..=v.count)
        .filter_map(|s| dump.services.get(&(*fe, s)).map(|sv| sv.backend_id))
        .collect();
    let matched: BTreeSet<u32> = dump
        .aff_match
        .iter()
        .filter(|m| m.family == family && m.rev_nat_id == v.rev_nat_id)
        .filter(|m| m.scope == fe.scope)
        .map(|m| m.backend_id)
        .collect();
    let check = if matched == active {
        "ok".to_string()
    } else {
        format!("MISMATCH {matched:?}")
    };
    let _ = writeln!(
        out,
        "  affinity timeout={}s match({check})",
        v.affinity_timeout
    );
}

/// A frontend's slots, resolved to backends (noted in `referenced`).
fn render_slots(
    out: &mut String,
    dump: &Dump,
    fe: &Frontend,
    v: &SvcValue,
    referenced: &mut BTreeSet<u32>,
) {
    for s in 1..=v.slots() {
        match dump.services.get(&(*fe, s)) {
            Some(sv) => {
                referenced.insert(sv.backend_id);
                match dump.backends.get(&sv.backend_id) {
                    Some(b) => {
                        let _ = writeln!(out, "  slot {s}: {} {}", b.l4, b.state.as_str());
                    }
                    None => {
                        let _ = writeln!(out, "  slot {s}: MISSING backend {}", sv.backend_id);
                    }
                }
            }
            None => {
                let _ = writeln!(out, "  slot {s}: MISSING");
            }
        }
    }
}

/// Slots past their master's, and backends and rev-NAT entries no master names.
fn render_orphans(
    out: &mut String,
    dump: &Dump,
    referenced_backends: &BTreeSet<u32>,
    referenced_revnat: &BTreeSet<u32>,
) {
    for ((fe, slot), v) in &dump.services {
        let covered = dump
            .services
            .get(&(*fe, 0))
            .is_some_and(|m| *slot <= m.slots());
        if *slot != 0 && !covered {
            let _ = writeln!(out, "orphan slot {} slot {slot} -> {}", fe.l4, v.backend_id);
        }
    }
    for (id, b) in &dump.backends {
        if !referenced_backends.contains(id) {
            let _ = writeln!(out, "orphan backend {id}: {}", b.l4);
        }
    }
    for (id, (a, p)) in &dump.revnat {
        if !referenced_revnat.contains(id) {
            let _ = writeln!(out, "orphan revnat {id}: {a}:{p}");
        }
    }
}

/// The ClusterIP set, checked against the ClusterIP frontends, and the echo table.
fn render_address_sets(out: &mut String, dump: &Dump) {
    for (addr, n) in &dump.cluster_ips {
        let at = dump
            .services
            .iter()
            .filter(|((fe, slot), v)| {
                *slot == 0 && fe.l4.addr == *addr && v.flags & svc_flags::CLUSTER_IP != 0
            })
            .count();
        let check = if at == *n as usize {
            "ok".to_string()
        } else {
            format!("MISMATCH {at} ClusterIP frontends")
        };
        let _ = writeln!(out, "cluster-ip {addr} frontends={n}({check})");
    }
    for (addr, v) in &dump.echo {
        let _ = writeln!(out, "echo {addr} {}", echo_text(v));
    }
}

/// The per-frontend sets: source ranges, and affinity-match entries no affinity frontend uses.
fn render_frontend_sets(out: &mut String, dump: &Dump) {
    for (id, cidr) in &dump.src_ranges {
        let used = dump.services.iter().any(|((_, slot), v)| {
            *slot == 0 && v.rev_nat_id == *id && v.flags & svc_flags::SOURCE_RANGES != 0
        });
        let check = if used { "ok" } else { "ORPHAN" };
        let _ = writeln!(out, "source-range revnat={id} {cidr}({check})");
    }
    for m in &dump.aff_match {
        let used = dump.services.iter().any(|((fe, slot), v)| {
            *slot == 0
                && v.rev_nat_id == m.rev_nat_id
                && fe.scope == m.scope
                && v.flags & svc_flags::AFFINITY != 0
        });
        if !used {
            let _ = writeln!(
                out,
                "orphan aff-match revnat={} {} backend {}",
                m.rev_nat_id,
                m.scope.as_str(),
                m.backend_id
            );
        }
    }
}

/// A Maglev table's summary: its cells per backend (or the ids it names that are missing).
fn render_maglev(out: &mut String, dump: &Dump, table: u32) {
    let Some(cells) = dump.maglev.get(&table) else {
        let _ = writeln!(out, "  maglev table {table}: MISSING");
        return;
    };
    let mut per: BTreeMap<u32, usize> = BTreeMap::new();
    for id in cells {
        *per.entry(*id).or_insert(0) += 1;
    }
    let mut parts: Vec<String> = per
        .iter()
        .map(|(id, n)| match dump.backends.get(id) {
            Some(b) => format!("{}={n}", b.l4),
            None if *id == 0 => format!("EMPTY={n}"),
            None => format!("MISSING backend {id}={n}"),
        })
        .collect();
    parts.sort();
    let _ = writeln!(
        out,
        "  maglev table {table}: {} cells: {}",
        cells.len(),
        parts.join(" ")
    );
}
