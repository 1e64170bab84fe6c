//! Makes the maps hold a `DesiredState`, writing only the difference, in an order that never
//! shows a packet a half-updated service:
//!
//! 1. services that are gone: master first (no new lookups find them), then their slots; then
//!    stray slots, and backends and rev-NAT entries nothing refers to any more (backends some
//!    wanted service still names are kept, with their ids). Going first frees room for what
//!    comes, and what goes was out of use already;
//! 2. per wanted service: its new or changed backends, then its rev-NAT entry, then its slots,
//!    then the master entry whose count makes new slots visible; slots beyond a reduced count
//!    go last;
//! 3. slots and backends that shrinking left unreferenced.
//!
//! The ClusterIP set (`lb*_cluster_ips`, which turns a packet to a ClusterIP on a port no
//! frontend has into a REJECT) brackets this: an address is added before the first of its
//! frontends is written, and removed only after the last one is gone, so a packet to a
//! frontend's port never meets "unknown port" while the frontend exists.
//!
//! A Maglev frontend's table (`lb_maglev`) is written with its slots, before the master that
//! names it: a new table in a free index, a changed one in place, cell by cell, each cell naming
//! a backend that is already written and is deleted only once no slot and no cell of an
//! installed table names it. Tables are rebuilt only when the frontend's active backends (or M)
//! change; an index is freed after the master stops naming it. With no free index the frontend
//! is programmed with random selection and reported (`ApplyReport::fallbacks`).
//!
//! Before writing a service it checks the maps have room for it; a service that does not fit, or
//! whose write fails, is reported and keeps its previous state. The reconciler starts from a
//! dump of the (pinned) maps, so a restart converges without flushing anything.
use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    net::IpAddr,
};

use lb_common::{SvcValue, lb_alg, map_names, svc_flags};

use super::maglev;
use crate::{
    datapath::maps::{
        AffMatch, Dump, LbMaps, MapOpError, NO_MAGLEV_TABLE, Table, aff_match_of, backends_of,
        maglev_table_of, revnat_of, src_ranges_of,
    },
    model::{
        Backend, BackendState, Cidr, DesiredState, Family, Frontend, L4Addr, LbAlgorithm,
        ServiceEntry,
    },
};

/// A frontend as installed: its master entry and the backend id in each slot.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Installed {
    master: SvcValue,
    /// `slots[i]` is slot `i + 1`; 0 where the slot entry is missing.
    slots: Vec<u32>,
}

/// A service that could not be (fully) written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceError {
    pub frontend: Frontend,
    pub service: String,
    pub error: String,
    /// The map that had no room for it, if that is why (nothing of it was written then).
    pub full_map: Option<&'static str>,
}

/// Why `apply_service` failed.
struct Failure {
    error: String,
    full_map: Option<&'static str>,
}

impl From<String> for Failure {
    fn from(error: String) -> Self {
        Self {
            error,
            full_map: None,
        }
    }
}

/// What one `apply` did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ApplyReport {
    pub writes: usize,
    pub deletes: usize,
    /// Backends deleted (their conntrack entries are the GC's to remove: `conntrack::Gc`).
    pub backends_deleted: usize,
    pub errors: Vec<ServiceError>,
    /// Maglev services programmed with random selection instead, because `lb_maglev` had no
    /// free table (`full_map` names it); they work, without Maglev's consistency.
    pub fallbacks: Vec<ServiceError>,
}

pub struct Reconciler<M> {
    maps: M,
    backends: BTreeMap<u32, Backend>,
    backend_ids: HashMap<L4Addr, u32>,
    revnat: BTreeMap<u32, (IpAddr, u16)>,
    revnat_ids: HashMap<L4Addr, u32>,
    services: BTreeMap<Frontend, Installed>,
    /// Slot entries found on start that no master covers; deleted by the next apply.
    stray_slots: BTreeSet<(Frontend, u16)>,
    /// The ClusterIP set as written: address → frontends at it.
    cluster_ips: BTreeMap<IpAddr, u32>,
    /// Source ranges as written: (rev-NAT id, range).
    src_ranges: BTreeSet<(u32, Cidr)>,
    /// Session affinity's backend matches as written.
    aff_match: BTreeSet<AffMatch>,
    next_backend_id: u32,
    next_revnat_id: u32,
    /// Maglev tables in use: index → cells as written (backend ids, 0: empty).
    maglev_tables: BTreeMap<u32, Vec<u32>>,
    /// The canonical active backends each Maglev frontend's table was built from this run
    /// (unknown after a restart: the table is then rebuilt and only differing cells written).
    maglev_built: HashMap<Frontend, Vec<L4Addr>>,
}

impl<M: LbMaps> Reconciler<M> {
    /// Starts from what the maps hold now.
    pub fn new(maps: M) -> anyhow::Result<Self> {
        let dump = maps.dump()?;
        Ok(Self::from_dump(maps, dump))
    }

    fn from_dump(maps: M, dump: Dump) -> Self {
        let mut backend_ids = HashMap::new();
        for (id, b) in &dump.backends {
            backend_ids.entry(b.l4).or_insert(*id);
        }
        let mut services = BTreeMap::new();
        let mut revnat_ids = HashMap::new();
        let mut stray_slots = BTreeSet::new();
        let geometry = maps.maglev_geometry();
        let mut maglev_tables = BTreeMap::new();
        for ((fe, slot), v) in &dump.services {
            if *slot != 0 {
                continue;
            }
            let mut v = *v;
            // A Maglev master keeps its table if the table exists, fits this map and no other
            // master claimed it; otherwise the mirror says "no table" and the next apply
            // writes a fresh one before repointing the master.
            if let Some(t) = maglev_table_of(&v) {
                match dump.maglev.get(&t) {
                    Some(cells)
                        if t < geometry.tables
                            && cells.len() == geometry.table_size as usize
                            && !maglev_tables.contains_key(&t) =>
                    {
                        maglev_tables.insert(t, cells.clone());
                    }
                    // Never equal to a planned master: the next apply rewrites it.
                    _ => v.lb_alg = u8::MAX,
                }
            }
            let v = &v;
            let slots = (1..=v.slots())
                .map(|s| dump.services.get(&(*fe, s)).map_or(0, |sv| sv.backend_id))
                .collect();
            if dump.revnat.get(&v.rev_nat_id) == Some(&(fe.l4.addr, fe.l4.port)) {
                revnat_ids.insert(fe.l4, v.rev_nat_id);
            }
            services.insert(*fe, Installed { master: *v, slots });
        }
        for (fe, slot) in dump.services.keys() {
            let covered = services
                .get(fe)
                .is_some_and(|i| *slot == 0 || (*slot as usize) <= i.slots.len());
            if !covered {
                stray_slots.insert((*fe, *slot));
            }
        }
        let next_backend_id = dump.backends.keys().max().map_or(1, |m| m.wrapping_add(1));
        let next_revnat_id = dump.revnat.keys().max().map_or(1, |m| m.wrapping_add(1));
        Self {
            maps,
            backends: dump.backends,
            backend_ids,
            revnat: dump.revnat,
            revnat_ids,
            services,
            stray_slots,
            cluster_ips: dump.cluster_ips,
            src_ranges: dump.src_ranges,
            aff_match: dump.aff_match,
            next_backend_id,
            next_revnat_id,
            maglev_tables,
            maglev_built: HashMap::new(),
        }
    }

    pub fn maps(&self) -> &M {
        &self.maps
    }

    pub fn service_count(&self) -> usize {
        self.services.len()
    }

    pub fn backend_count(&self) -> usize {
        self.backends.len()
    }

    /// Fill of every map the reconciler owns: (map name, entries, max_entries).
    pub fn usage(&self) -> Vec<(&'static str, usize, u32)> {
        let mut out = Vec::new();
        for t in Table::ALL {
            for f in [Family::V4, Family::V6] {
                out.push((t.map_name(f), self.used(t, f), self.maps.capacity(t, f)));
            }
        }
        out
    }

    /// Entries the mirror says `table` holds for `family`.
    fn used(&self, table: Table, family: Family) -> usize {
        match table {
            Table::Services => {
                self.services
                    .iter()
                    .filter(|(fe, _)| Family::of(&fe.l4.addr) == family)
                    .map(|(_, i)| 1 + i.slots.iter().filter(|id| **id != 0).count())
                    .sum::<usize>()
                    + self
                        .stray_slots
                        .iter()
                        .filter(|(fe, _)| Family::of(&fe.l4.addr) == family)
                        .count()
            }
            Table::Backends => backends_of(&self.backends, family),
            Table::RevNat => revnat_of(&self.revnat, family),
            Table::ClusterIps => self
                .cluster_ips
                .keys()
                .filter(|a| Family::of(a) == family)
                .count(),
            Table::SourceRanges => src_ranges_of(&self.src_ranges, family),
            Table::AffinityMatch => aff_match_of(&self.aff_match, family),
        }
    }

    /// Fill of `lb_maglev`: (tables in use, tables).
    pub fn maglev_usage(&self) -> (usize, u32) {
        (self.maglev_tables.len(), self.maps.maglev_geometry().tables)
    }

    /// Makes the maps hold `desired`.
    pub fn apply(&mut self, desired: &DesiredState) -> ApplyReport {
        let mut report = ApplyReport::default();

        // First what goes away, so the room it frees is usable by what comes (replacing a
        // service at full capacity works in one apply). Removed frontends were already out of
        // use, so no packet can miss anything by their going first.
        let gone: Vec<Frontend> = self
            .services
            .keys()
            .filter(|fe| !desired.services.contains_key(fe))
            .copied()
            .collect();
        for fe in gone {
            if let Err(e) = self.remove_service(&fe, &mut report) {
                report.errors.push(ServiceError {
                    frontend: fe,
                    service: String::new(),
                    error: e.to_string(),
                    full_map: None,
                });
            }
        }
        self.delete_stray_slots(&mut report);
        let wanted: BTreeSet<L4Addr> = desired
            .services
            .values()
            .flat_map(|e| e.backends.iter().map(|b| b.l4))
            .collect();
        self.collect_garbage(&wanted, &mut report);

        // One state per backend address: the backends map has a single entry for it, so the
        // most usable state any frontend gives it wins (active, then terminating, ...).
        let mut states: HashMap<L4Addr, BackendState> = HashMap::new();
        for b in desired.services.values().flat_map(|e| &e.backends) {
            states
                .entry(b.l4)
                .and_modify(|s| *s = (*s).min(b.state))
                .or_insert(b.state);
        }

        let wanted_ips = cluster_ip_counts(desired.services.iter().map(|(fe, e)| (fe, e.flags)));

        let mut room: BTreeMap<(Table, Family), i64> = BTreeMap::new();
        for t in [
            Table::Services,
            Table::Backends,
            Table::RevNat,
            Table::SourceRanges,
            Table::AffinityMatch,
        ] {
            for f in [Family::V4, Family::V6] {
                let free = self.maps.capacity(t, f) as i64 - self.used(t, f) as i64;
                room.insert((t, f), free);
            }
        }
        for (fe, entry) in &desired.services {
            let ips = &wanted_ips;
            if let Err(f) = self.apply_service(fe, entry, &states, ips, &mut room, &mut report) {
                report.errors.push(ServiceError {
                    frontend: *fe,
                    service: entry.name.to_string(),
                    error: f.error,
                    full_map: f.full_map,
                });
            }
        }

        // Tables claimed by writes that failed before their master named them are free again.
        let named: BTreeSet<u32> = self
            .services
            .values()
            .filter_map(|i| maglev_table_of(&i.master))
            .collect();
        self.maglev_tables.retain(|t, _| named.contains(t));
        // Slots dropped by shrinking services leave their backends unreferenced.
        self.delete_stray_slots(&mut report);
        self.collect_garbage(&BTreeSet::new(), &mut report);
        self.sync_cluster_ips(&mut report);
        self.prune_src_ranges(desired, &mut report);
        self.prune_aff_match(&mut report);
        report
    }

    /// Deletes the affinity matches no installed frontend with session affinity wants: after
    /// the masters and slots changed, so a backend stops matching only once no slot of the
    /// frontend offers it to new flows.
    fn prune_aff_match(&mut self, report: &mut ApplyReport) {
        let wanted: BTreeSet<AffMatch> = self
            .services
            .iter()
            .flat_map(|(fe, i)| {
                let active = &i.slots[..(i.master.count as usize).min(i.slots.len())];
                let affine = i.master.flags & svc_flags::AFFINITY != 0;
                aff_matches(fe, affine, i.master.rev_nat_id, active)
            })
            .collect();
        let stale: Vec<AffMatch> = self.aff_match.difference(&wanted).copied().collect();
        for m in stale {
            match self.maps.del_aff_match(&m) {
                Ok(()) => {
                    report.deletes += 1;
                    self.aff_match.remove(&m);
                }
                Err(e) => tracing::warn!(?m, error = %e, "cannot delete affinity match"),
            }
        }
    }

    /// Deletes the source ranges no installed frontend with `SOURCE_RANGES` wants any more:
    /// after the masters changed, so a range is never missing while a master relies on it.
    fn prune_src_ranges(&mut self, desired: &DesiredState, report: &mut ApplyReport) {
        let wanted: BTreeSet<(u32, Cidr)> = self
            .services
            .iter()
            .filter(|(_, i)| i.master.flags & svc_flags::SOURCE_RANGES != 0)
            .filter_map(|(fe, i)| Some((i.master.rev_nat_id, desired.services.get(fe)?)))
            .flat_map(|(id, e)| e.source_ranges.iter().map(move |c| (id, *c)))
            .collect();
        let stale: Vec<(u32, Cidr)> = self.src_ranges.difference(&wanted).copied().collect();
        for (id, cidr) in stale {
            match self.maps.del_src_range(id, &cidr) {
                Ok(()) => {
                    report.deletes += 1;
                    self.src_ranges.remove(&(id, cidr));
                }
                Err(e) => tracing::warn!(id, %cidr, error = %e, "cannot delete source range"),
            }
        }
    }

    /// Writes `addr` into the ClusterIP set. A failure only costs the unknown-port REJECT for
    /// that address (its frontends work), so it is logged, and retried by the next apply.
    fn put_cluster_ip(&mut self, addr: IpAddr, frontends: u32, report: &mut ApplyReport) {
        match self.maps.put_cluster_ip(addr, frontends) {
            Ok(()) => {
                report.writes += 1;
                self.cluster_ips.insert(addr, frontends);
            }
            Err(e) => tracing::warn!(%addr, error = %e, "cannot write ClusterIP entry"),
        }
    }

    /// Makes the ClusterIP set match the frontends installed now: addresses without any are
    /// removed (their last frontend is gone), counts are brought up to date.
    fn sync_cluster_ips(&mut self, report: &mut ApplyReport) {
        let installed = cluster_ip_counts(self.services.iter().map(|(fe, i)| (fe, i.master.flags)));
        let stale: Vec<IpAddr> = self
            .cluster_ips
            .keys()
            .filter(|a| !installed.contains_key(a))
            .copied()
            .collect();
        for addr in stale {
            match self.maps.del_cluster_ip(addr) {
                Ok(()) => {
                    report.deletes += 1;
                    self.cluster_ips.remove(&addr);
                }
                Err(e) => tracing::warn!(%addr, error = %e, "cannot delete ClusterIP entry"),
            }
        }
        for (addr, n) in installed {
            if self.cluster_ips.get(&addr) != Some(&n) {
                self.put_cluster_ip(addr, n, report);
            }
        }
    }

    fn delete_stray_slots(&mut self, report: &mut ApplyReport) {
        for (fe, slot) in std::mem::take(&mut self.stray_slots) {
            match self.maps.del_service(&fe, slot) {
                Ok(()) => report.deletes += 1,
                Err(e) => {
                    self.stray_slots.insert((fe, slot));
                    tracing::warn!(%fe, slot, error = %e, "cannot delete stray slot");
                }
            }
        }
    }

    fn alloc_backend_id(&mut self) -> u32 {
        loop {
            let id = self.next_backend_id;
            self.next_backend_id = self.next_backend_id.wrapping_add(1).max(1);
            if id != 0 && !self.backends.contains_key(&id) {
                return id;
            }
        }
    }

    fn alloc_revnat_id(&mut self) -> u32 {
        loop {
            let id = self.next_revnat_id;
            self.next_revnat_id = self.next_revnat_id.wrapping_add(1).max(1);
            if id != 0 && !self.revnat.contains_key(&id) {
                return id;
            }
        }
    }

    fn apply_service(
        &mut self,
        fe: &Frontend,
        entry: &ServiceEntry,
        states: &HashMap<L4Addr, BackendState>,
        cluster_ips: &BTreeMap<IpAddr, u32>,
        room: &mut BTreeMap<(Table, Family), i64>,
        report: &mut ApplyReport,
    ) -> Result<(), Failure> {
        let family = Family::of(&fe.l4.addr);
        if entry
            .backends
            .iter()
            .any(|b| Family::of(&b.l4.addr) != family)
        {
            return Err(String::from("backend address family differs from the frontend's").into());
        }
        // Slots 1..=count take new flows, so the active backends go first, the others after
        // them (kept for established flows), each group in the entry's order.
        let (mut backends, rest): (Vec<Backend>, Vec<Backend>) = entry
            .backends
            .iter()
            .partition(|b| b.state == BackendState::Active);
        let active = backends.len();
        backends.extend(rest);
        let total = backends.len();
        if total > u16::MAX as usize {
            return Err(format!(
                "{total} backends exceed the {} slots of a service",
                u16::MAX
            )
            .into());
        }

        // Plan: ids (allocated only in the plan until written) and the room it needs.
        let mut new_backends = Vec::new();
        let mut planned_ids = Vec::with_capacity(total);
        let mut seen_new: HashMap<L4Addr, u32> = HashMap::new();
        for b in &backends {
            let id = match self.backend_ids.get(&b.l4).copied() {
                Some(id) => id,
                None => *seen_new.entry(b.l4).or_insert_with(|| {
                    let id = self.alloc_backend_id_excluding(&new_backends);
                    new_backends.push((id, *b));
                    id
                }),
            };
            planned_ids.push(id);
        }
        let existing = self.services.get(fe).cloned();
        let existing_entries = existing
            .as_ref()
            .map_or(0, |i| 1 + i.slots.iter().filter(|id| **id != 0).count());
        let needed_services = (1 + total).saturating_sub(existing_entries) as i64;
        let new_revnat = !self.revnat_ids.contains_key(&fe.l4);
        let rev_nat_id = match self.revnat_ids.get(&fe.l4).copied() {
            Some(id) => id,
            None => self.alloc_revnat_id(),
        };
        let ranges: Vec<Cidr> = if entry.flags & svc_flags::SOURCE_RANGES != 0 {
            entry
                .source_ranges
                .iter()
                .filter(|c| Family::of(&c.addr) == family)
                .filter(|c| !self.src_ranges.contains(&(rev_nat_id, **c)))
                .copied()
                .collect()
        } else {
            Vec::new()
        };
        let affine = entry.flags & svc_flags::AFFINITY != 0;
        let matches: Vec<AffMatch> = aff_matches(fe, affine, rev_nat_id, &planned_ids[..active])
            .filter(|m| !self.aff_match.contains(m))
            .collect();
        for (table, needed) in [
            (Table::Services, needed_services),
            (Table::Backends, new_backends.len() as i64),
            (Table::RevNat, i64::from(new_revnat)),
            (Table::SourceRanges, ranges.len() as i64),
            (Table::AffinityMatch, matches.len() as i64),
        ] {
            let free = room.get(&(table, family)).copied().unwrap_or(0);
            if needed > free {
                return Err(Failure {
                    error: format!(
                        "map {} is full: needs {needed} more entries, {} free of {}",
                        table.map_name(family),
                        free.max(0),
                        self.maps.capacity(table, family)
                    ),
                    full_map: Some(table.map_name(family)),
                });
            }
        }

        let maglev = self.plan_maglev(fe, entry, &backends[..active], &planned_ids[..active]);
        if maglev.fallback {
            let g = self.maps.maglev_geometry();
            report.fallbacks.push(ServiceError {
                frontend: *fe,
                service: entry.name.to_string(),
                error: format!(
                    "map {} is full ({} tables of {} cells in use): Maglev service programmed \
                     with random selection",
                    map_names::MAGLEV,
                    self.maglev_tables.len(),
                    g.table_size
                ),
                full_map: Some(map_names::MAGLEV),
            });
        }
        let master = SvcValue {
            backend_id: maglev.master_backend_id,
            count: active as u16,
            qcount: (total - active) as u16,
            rev_nat_id,
            flags: entry.flags,
            lb_alg: maglev.lb_alg,
            pad: 0,
            affinity_timeout: if affine { entry.affinity_timeout } else { 0 },
        };
        // The state a backend gets in the (shared) backends map.
        let global = |b: &Backend| Backend {
            l4: b.l4,
            state: states.get(&b.l4).copied().unwrap_or(b.state),
        };
        let unchanged = ranges.is_empty()
            && matches.is_empty()
            && maglev.writes.is_empty()
            && existing
                .as_ref()
                .is_some_and(|i| i.master == master && i.slots == planned_ids)
            && self.revnat.get(&rev_nat_id) == Some(&(fe.l4.addr, fe.l4.port))
            && backends
                .iter()
                .zip(&planned_ids)
                .all(|(b, id)| self.backends.get(id) == Some(&global(b)));
        if unchanged {
            if let Some(set) = maglev.built {
                self.maglev_built.insert(*fe, set);
            }
            return Ok(());
        }
        for (table, needed) in [
            (Table::Services, needed_services),
            (Table::Backends, new_backends.len() as i64),
            (Table::RevNat, i64::from(new_revnat)),
            (Table::SourceRanges, ranges.len() as i64),
            (Table::AffinityMatch, matches.len() as i64),
        ] {
            *room.entry((table, family)).or_default() -= needed;
        }

        // 0. A new ClusterIP, before anything of its first frontend (see the module docs).
        if entry.flags & svc_flags::CLUSTER_IP != 0 && !self.cluster_ips.contains_key(&fe.l4.addr) {
            let n = cluster_ips.get(&fe.l4.addr).copied().unwrap_or(1);
            self.put_cluster_ip(fe.l4.addr, n, report);
        }
        // 1. Backends (new ones, and known ones whose state changed).
        for (b, id) in backends.iter().zip(&planned_ids) {
            let b = global(b);
            if self.backends.get(id) != Some(&b) {
                self.maps.put_backend(*id, &b).map_err(|e| e.to_string())?;
                report.writes += 1;
                self.backends.insert(*id, b);
                self.backend_ids.insert(b.l4, *id);
            }
        }
        // 2. Rev-NAT, before any packet can be balanced to a backend of this frontend.
        if self.revnat.get(&rev_nat_id) != Some(&(fe.l4.addr, fe.l4.port)) {
            self.maps
                .put_revnat(rev_nat_id, fe.l4.addr, fe.l4.port)
                .map_err(|e| e.to_string())?;
            report.writes += 1;
            self.revnat.insert(rev_nat_id, (fe.l4.addr, fe.l4.port));
            self.revnat_ids.insert(fe.l4, rev_nat_id);
        }
        // 2b. Source ranges, before a master with SOURCE_RANGES can drop what they allow.
        for cidr in &ranges {
            self.maps
                .put_src_range(rev_nat_id, cidr)
                .map_err(|e| e.to_string())?;
            report.writes += 1;
            self.src_ranges.insert((rev_nat_id, *cidr));
        }
        // 2c. Affinity matches: the new active backends' before the master offers them (an
        // affinity entry naming one is honoured from the first packet that can pick it), and
        // the ones the frontend no longer offers deleted before the master drops them, so no
        // client is kept on a backend the frontend has left.
        for m in &matches {
            self.maps.put_aff_match(m).map_err(|e| e.to_string())?;
            report.writes += 1;
            self.aff_match.insert(*m);
        }
        let keep: BTreeSet<AffMatch> =
            aff_matches(fe, affine, rev_nat_id, &planned_ids[..active]).collect();
        let stale: Vec<AffMatch> = self
            .aff_match
            .iter()
            .filter(|m| m.family == family && m.rev_nat_id == rev_nat_id && m.scope == fe.scope)
            .filter(|m| !keep.contains(m))
            .copied()
            .collect();
        for m in stale {
            self.maps.del_aff_match(&m).map_err(|e| e.to_string())?;
            report.deletes += 1;
            self.aff_match.remove(&m);
        }
        // 3. Slots and the Maglev table, then 4. the master entry that makes them visible.
        let old = existing;
        // Known again only once the table is whole.
        self.maglev_built.remove(fe);
        let table = maglev_table_of(&master).map(|t| (t, maglev.writes.as_slice()));
        if let Err(e) = self.write_slots_and_master(fe, &planned_ids, table, &master, report) {
            if let Some(old) = old {
                self.restore(fe, &old, report);
            }
            return Err(e.to_string().into());
        }
        if let Some(set) = maglev.built {
            self.maglev_built.insert(*fe, set);
        }
        // A table the master no longer names is free (its cells are rewritten before reuse).
        if let Some(t) = old.as_ref().and_then(|i| maglev_table_of(&i.master))
            && maglev_table_of(&master) != Some(t)
        {
            self.maglev_tables.remove(&t);
        }
        // 5. Slots a shrunk service no longer counts.
        let old_len = old.map_or(0, |i| i.slots.len());
        for slot in (total + 1..=old_len).rev() {
            let slot = slot as u16;
            match self.maps.del_service(fe, slot) {
                Ok(()) => report.deletes += 1,
                Err(e) => {
                    tracing::warn!(%fe, slot, error = %e, "cannot delete surplus slot");
                    self.stray_slots.insert((*fe, slot));
                }
            }
        }
        Ok(())
    }

    /// How `fe`'s master selects (see `MaglevPlan`), given its active backends and their ids.
    fn plan_maglev(
        &self,
        fe: &Frontend,
        entry: &ServiceEntry,
        active: &[Backend],
        ids: &[u32],
    ) -> MaglevPlan {
        let random = MaglevPlan {
            lb_alg: lb_alg::RANDOM,
            master_backend_id: 0,
            writes: Vec::new(),
            built: None,
            fallback: false,
        };
        if entry.algorithm != LbAlgorithm::Maglev {
            return random;
        }
        let set = maglev::canonical(&active.iter().map(|b| b.l4).collect::<Vec<_>>());
        if set.is_empty() {
            // Nothing to choose (count 0): no table.
            return MaglevPlan {
                lb_alg: lb_alg::MAGLEV,
                master_backend_id: NO_MAGLEV_TABLE,
                ..random
            };
        }
        let g = self.maps.maglev_geometry();
        let current = self
            .services
            .get(fe)
            .and_then(|i| maglev_table_of(&i.master))
            .filter(|t| self.maglev_tables.contains_key(t));
        let Some(table) =
            current.or_else(|| (0..g.tables).find(|t| !self.maglev_tables.contains_key(t)))
        else {
            return MaglevPlan {
                fallback: true,
                ..random
            };
        };
        let mut plan = MaglevPlan {
            lb_alg: lb_alg::MAGLEV,
            master_backend_id: table,
            writes: Vec::new(),
            built: Some(set.clone()),
            fallback: false,
        };
        if current.is_some() && self.maglev_built.get(fe) == Some(&set) {
            return plan;
        }
        let id_of: HashMap<L4Addr, u32> = active
            .iter()
            .map(|b| b.l4)
            .zip(ids.iter().copied())
            .collect();
        let have = current.and_then(|t| self.maglev_tables.get(&t));
        plan.writes = maglev::build(&set, g.table_size)
            .iter()
            .enumerate()
            .map(|(cell, i)| {
                (
                    cell as u32,
                    id_of.get(&set[*i as usize]).copied().unwrap_or(0),
                )
            })
            .filter(|(cell, id)| have.is_none_or(|h| h.get(*cell as usize) != Some(id)))
            .collect();
        plan
    }

    /// A fresh id that is neither installed nor planned in `pending`.
    fn alloc_backend_id_excluding(&mut self, pending: &[(u32, Backend)]) -> u32 {
        loop {
            let id = self.alloc_backend_id();
            if !pending.iter().any(|(p, _)| *p == id) {
                return id;
            }
        }
    }

    fn write_slots_and_master(
        &mut self,
        fe: &Frontend,
        ids: &[u32],
        table: Option<(u32, &[(u32, u32)])>,
        master: &SvcValue,
        report: &mut ApplyReport,
    ) -> Result<(), MapOpError> {
        let fresh = !self.services.contains_key(fe);
        let result = self.try_write_slots_and_master(fe, ids, table, master, report);
        if result.is_err() && fresh {
            // No master was ever visible: take back the slots written so far, so a new
            // service that failed leaves nothing behind.
            let written = self.services.remove(fe).map_or(0, |i| i.slots.len());
            for slot in (1..=written).rev() {
                match self.maps.del_service(fe, slot as u16) {
                    Ok(()) => report.deletes += 1,
                    Err(_) => {
                        self.stray_slots.insert((*fe, slot as u16));
                    }
                }
            }
        }
        result
    }

    fn try_write_slots_and_master(
        &mut self,
        fe: &Frontend,
        ids: &[u32],
        table: Option<(u32, &[(u32, u32)])>,
        master: &SvcValue,
        report: &mut ApplyReport,
    ) -> Result<(), MapOpError> {
        if let Some((t, cells)) = table {
            let m = self.maps.maglev_geometry().table_size as usize;
            for (cell, id) in cells {
                self.maps.put_maglev(t, *cell, *id)?;
                report.writes += 1;
                // Claimed from the first cell on: collect_garbage keeps what cells name.
                self.maglev_tables.entry(t).or_insert_with(|| vec![0; m])[*cell as usize] = *id;
            }
        }
        let installed = self.services.entry(*fe).or_insert_with(|| Installed {
            master: SvcValue::default(),
            slots: Vec::new(),
        });
        for (i, id) in ids.iter().enumerate() {
            if installed.slots.get(i) == Some(id) {
                continue;
            }
            let slot = (i + 1) as u16;
            let v = SvcValue {
                backend_id: *id,
                rev_nat_id: master.rev_nat_id,
                ..SvcValue::default()
            };
            self.maps.put_service(fe, slot, &v)?;
            report.writes += 1;
            // A slot left over from before is in use again: it is no longer stray.
            self.stray_slots.remove(&(*fe, slot));
            if i < installed.slots.len() {
                installed.slots[i] = *id;
            } else {
                installed.slots.push(*id);
            }
        }
        self.maps.put_service(fe, 0, master)?;
        report.writes += 1;
        installed.master = *master;
        // Slots beyond the new total are deleted by the caller; the mirror drops them now so
        // that a failed delete shows up as a stray slot instead.
        installed.slots.truncate(ids.len());
        Ok(())
    }

    /// Best effort to put a service back as it was after a failed update.
    fn restore(&mut self, fe: &Frontend, old: &Installed, report: &mut ApplyReport) {
        let Some(installed) = self.services.get_mut(fe) else {
            return;
        };
        for (i, id) in old.slots.iter().enumerate() {
            if installed.slots.get(i) != Some(id) && *id != 0 {
                let v = SvcValue {
                    backend_id: *id,
                    rev_nat_id: old.master.rev_nat_id,
                    ..SvcValue::default()
                };
                if self.maps.put_service(fe, (i + 1) as u16, &v).is_ok() {
                    report.writes += 1;
                    if i < installed.slots.len() {
                        installed.slots[i] = *id;
                    }
                }
            }
        }
        for slot in (old.slots.len() + 1..=installed.slots.len()).rev() {
            if self.maps.del_service(fe, slot as u16).is_ok() {
                report.deletes += 1;
                installed.slots.truncate(slot - 1);
            }
        }
    }

    fn remove_service(
        &mut self,
        fe: &Frontend,
        report: &mut ApplyReport,
    ) -> Result<(), MapOpError> {
        let Some(installed) = self.services.get(fe).cloned() else {
            return Ok(());
        };
        self.maps.del_service(fe, 0)?;
        report.deletes += 1;
        self.services.remove(fe);
        if let Some(t) = maglev_table_of(&installed.master) {
            self.maglev_tables.remove(&t);
        }
        self.maglev_built.remove(fe);
        for slot in (1..=installed.slots.len()).rev() {
            match self.maps.del_service(fe, slot as u16) {
                Ok(()) => report.deletes += 1,
                Err(e) => {
                    tracing::warn!(%fe, slot, error = %e, "cannot delete slot");
                    self.stray_slots.insert((*fe, slot as u16));
                }
            }
        }
        Ok(())
    }

    /// Deletes backends and rev-NAT entries no installed service refers to.
    ///
    /// Backends in `keep` survive even when unreferenced: they are about to be used again, and
    /// keeping them keeps their ids (and the conntrack entries naming them) valid.
    fn collect_garbage(&mut self, keep: &BTreeSet<L4Addr>, report: &mut ApplyReport) {
        let used_backends: BTreeSet<u32> = self
            .services
            .values()
            .flat_map(|i| i.slots.iter().copied())
            .chain(self.maglev_tables.values().flatten().copied())
            .collect();
        let unused: Vec<u32> = self
            .backends
            .iter()
            .filter(|(id, b)| !used_backends.contains(id) && !keep.contains(&b.l4))
            .map(|(id, _)| *id)
            .collect();
        for id in unused {
            let Some(b) = self.backends.get(&id).copied() else {
                continue;
            };
            match self.maps.del_backend(id, Family::of(&b.l4.addr)) {
                Ok(()) => {
                    report.deletes += 1;
                    report.backends_deleted += 1;
                    self.backends.remove(&id);
                    if self.backend_ids.get(&b.l4) == Some(&id) {
                        self.backend_ids.remove(&b.l4);
                    }
                }
                Err(e) => tracing::warn!(id, error = %e, "cannot delete backend"),
            }
        }
        let used_revnat: BTreeSet<u32> = self
            .services
            .values()
            .map(|i| i.master.rev_nat_id)
            .collect();
        let unused: Vec<u32> = self
            .revnat
            .keys()
            .filter(|id| !used_revnat.contains(id))
            .copied()
            .collect();
        for id in unused {
            let Some((addr, _)) = self.revnat.get(&id).copied() else {
                continue;
            };
            match self.maps.del_revnat(id, Family::of(&addr)) {
                Ok(()) => {
                    report.deletes += 1;
                    self.revnat.remove(&id);
                    self.revnat_ids.retain(|_, v| *v != id);
                }
                Err(e) => tracing::warn!(id, error = %e, "cannot delete rev-NAT entry"),
            }
        }
    }
}

/// The affinity matches a frontend with session affinity (`affine`) needs: its active
/// backends `active`.
fn aff_matches<'a>(
    fe: &'a Frontend,
    affine: bool,
    rev_nat_id: u32,
    active: &'a [u32],
) -> impl Iterator<Item = AffMatch> + 'a {
    let active = if affine { active } else { &[] };
    active
        .iter()
        .filter(|id| **id != 0)
        .map(move |id| AffMatch {
            family: Family::of(&fe.l4.addr),
            rev_nat_id,
            scope: fe.scope,
            backend_id: *id,
        })
}

/// What a frontend's master says about its algorithm, and the Maglev cells to write first.
struct MaglevPlan {
    lb_alg: u8,
    /// The master's `backend_id`: its Maglev table (or `NO_MAGLEV_TABLE`), 0 for random.
    master_backend_id: u32,
    /// (cell, backend id) of the master's table that differ from what it holds.
    writes: Vec<(u32, u32)>,
    /// The canonical backend set the table holds once `writes` are written.
    built: Option<Vec<L4Addr>>,
    /// Maglev was asked for, but `lb_maglev` has no free table: random instead.
    fallback: bool,
}

/// Frontends per ClusterIP address among `frontends` (frontend, `svc_flags`).
fn cluster_ip_counts<'a>(
    frontends: impl Iterator<Item = (&'a Frontend, u16)>,
) -> BTreeMap<IpAddr, u32> {
    let mut out = BTreeMap::new();
    for (fe, flags) in frontends {
        if flags & svc_flags::CLUSTER_IP != 0 {
            *out.entry(fe.l4.addr).or_insert(0) += 1;
        }
    }
    out
}
