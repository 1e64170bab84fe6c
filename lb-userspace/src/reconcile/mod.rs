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
//! The echo table (`lb*_echo`: what a ping to a ClusterIP, external or LoadBalancer IP gets)
//! follows the installed masters at each address, after them: an address answers once one of
//! its frontends has a usable backend written.
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
//!
//! `apply` works on the whole state; `apply_update` on the frontends an
//! `incremental::Update` names (plus those the last apply could not program), with the same
//! order per frontend and the clean-up passes restricted to what those frontends touched, for
//! the same map contents. It relies on the mirror holding the last desired state: until a full
//! `apply` has run, and after any write or delete failed other than for lack of room, it does a
//! full `apply` instead. `refresh` re-reads the maps, so the next full `apply` repairs what
//! someone else changed in them.
pub mod resteer;

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

// foldhash: these maps are keyed by backend addresses and ids and looked up ~10 times per
// backend of a changed service; SipHash was a tenth of a 1,000-change sync.
use foldhash::{HashMap, HashMapExt as _, HashSet, HashSetExt as _};
use lb_common::{EchoValue, SvcValue, echo, lb_alg, map_names, svc_flags};

use crate::{
    datapath::maps::{
        AffMatch, Dump, LbMaps, MapOpError, NO_MAGLEV_TABLE, Table, aff_match_of, backends_of,
        maglev_table_of, revnat_of, src_ranges_of,
    },
    model::{
        Backend, BackendState, Cidr, DesiredState, Family, Frontend, L4Addr, LbAlgorithm, Proto,
        Scope, ServiceEntry,
    },
    translate::{incremental::Update, maglev},
};

/// What `apply_service` writes for a frontend (`plan_service`), decided before anything is.
struct ServicePlan {
    family: Family,
    /// The entry's backends, the active ones (slots `1..=active`) first.
    backends: Vec<Backend>,
    active: usize,
    /// The backend id of each of `backends`, new ones allocated in the plan.
    ids: Vec<u32>,
    /// The frontend as installed now.
    existing: Option<Installed>,
    rev_nat_id: u32,
    /// Source ranges and affinity matches to add.
    ranges: Vec<Cidr>,
    matches: Vec<AffMatch>,
    affine: bool,
    /// Entries each table needs beyond what the frontend holds now.
    needed: [(Table, i64); 5],
}

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
    /// The echo table as written: address → verdicts.
    echo: BTreeMap<IpAddr, EchoValue>,
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
    /// Per backend address: how many entries of the last desired state name it, per state
    /// (index: the state's byte). The backends map holds the most usable one.
    wanted: HashMap<L4Addr, [u32; 4]>,
    /// Whether the mirror holds the last desired state but for `retry`, so `apply_update`
    /// may work on changes alone.
    incremental: bool,
    /// Frontends the last apply left short of their desired state without writing anything
    /// (no room, or a Maglev fallback): changed for the next one.
    retry: BTreeSet<Frontend>,
    /// A write or delete failed in this apply other than for room: the next one is full.
    degraded: bool,
    /// Entries per map family (index: `fam`), kept as the mirror changes (`used`).
    counts: Counts,
    /// Maglev tables claimed in this apply (`apply_update`'s clean-up looks at them).
    claimed_tables: Vec<u32>,
}

/// Entries of each map, per family (0: IPv4); services counts masters and filled slots.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Counts {
    services: [usize; 2],
    backends: [usize; 2],
    revnat: [usize; 2],
    cluster_ips: [usize; 2],
    echo: [usize; 2],
    src_ranges: [usize; 2],
    aff_match: [usize; 2],
}

fn fam(f: Family) -> usize {
    usize::from(f == Family::V6)
}

fn fam_of(a: &IpAddr) -> usize {
    usize::from(a.is_ipv6())
}

/// The master and filled slots of an installed frontend.
fn entries_of(i: Option<&Installed>) -> usize {
    i.map_or(0, |i| 1 + i.slots.iter().filter(|id| **id != 0).count())
}

impl<M: LbMaps> Reconciler<M> {
    /// Starts from what the maps hold now.
    pub fn new(maps: M) -> anyhow::Result<Self> {
        let dump = maps.dump()?;
        Ok(Self::from_dump(maps, dump))
    }

    fn from_dump(maps: M, dump: Dump) -> Self {
        let mut r = Self {
            maps,
            backends: BTreeMap::new(),
            backend_ids: HashMap::new(),
            revnat: BTreeMap::new(),
            revnat_ids: HashMap::new(),
            services: BTreeMap::new(),
            stray_slots: BTreeSet::new(),
            cluster_ips: BTreeMap::new(),
            echo: BTreeMap::new(),
            src_ranges: BTreeSet::new(),
            aff_match: BTreeSet::new(),
            next_backend_id: 1,
            next_revnat_id: 1,
            maglev_tables: BTreeMap::new(),
            maglev_built: HashMap::new(),
            wanted: HashMap::new(),
            incremental: false,
            retry: BTreeSet::new(),
            degraded: false,
            counts: Counts::default(),
            claimed_tables: Vec::new(),
        };
        r.load_dump(dump);
        r
    }

    /// Re-reads the maps into the mirror: the next `apply` (full) repairs whatever differs
    /// from the desired state, whoever changed it.
    pub fn refresh(&mut self) -> anyhow::Result<()> {
        let dump = self.maps.dump()?;
        self.reload(dump);
        Ok(())
    }

    /// `load_dump`, with ids going on from where they were: a conntrack entry may still name a
    /// deleted one.
    fn reload(&mut self, dump: Dump) {
        let (b, r) = (self.next_backend_id, self.next_revnat_id);
        self.load_dump(dump);
        self.next_backend_id = self.next_backend_id.max(b);
        self.next_revnat_id = self.next_revnat_id.max(r);
    }

    /// Sets the mirror to what `dump` holds; `apply_update` is full until an `apply` ran.
    fn load_dump(&mut self, dump: Dump) {
        let mut backend_ids = HashMap::new();
        for (id, b) in &dump.backends {
            backend_ids.entry(b.l4).or_insert(*id);
        }
        let mut services = BTreeMap::new();
        let mut revnat_ids = HashMap::new();
        let mut stray_slots = BTreeSet::new();
        let geometry = self.maps.maglev_geometry();
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
        self.backends = dump.backends;
        self.backend_ids = backend_ids;
        self.revnat = dump.revnat;
        self.revnat_ids = revnat_ids;
        self.services = services;
        self.stray_slots = stray_slots;
        self.cluster_ips = dump.cluster_ips;
        self.echo = dump.echo;
        self.src_ranges = dump.src_ranges;
        self.aff_match = dump.aff_match;
        self.next_backend_id = next_backend_id;
        self.next_revnat_id = next_revnat_id;
        self.maglev_tables = maglev_tables;
        self.maglev_built = HashMap::new();
        self.incremental = false;
        self.retry = BTreeSet::new();
        self.counts = self.recount();
    }

    /// `counts` from the mirror.
    fn recount(&self) -> Counts {
        let mut c = Counts::default();
        for (fe, i) in &self.services {
            c.services[fam_of(&fe.l4.addr)] += entries_of(Some(i));
        }
        for f in [Family::V4, Family::V6] {
            let i = fam(f);
            c.backends[i] = backends_of(&self.backends, f);
            c.revnat[i] = revnat_of(&self.revnat, f);
            c.src_ranges[i] = src_ranges_of(&self.src_ranges, f);
            c.aff_match[i] = aff_match_of(&self.aff_match, f);
            c.cluster_ips[i] = self
                .cluster_ips
                .keys()
                .filter(|a| Family::of(a) == f)
                .count();
            c.echo[i] = self.echo.keys().filter(|a| Family::of(a) == f).count();
        }
        c
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
        let f = fam(family);
        match table {
            Table::Services => {
                self.counts.services[f]
                    + self
                        .stray_slots
                        .iter()
                        .filter(|(fe, _)| Family::of(&fe.l4.addr) == family)
                        .count()
            }
            Table::Backends => self.counts.backends[f],
            Table::RevNat => self.counts.revnat[f],
            Table::ClusterIps => self.counts.cluster_ips[f],
            Table::SourceRanges => self.counts.src_ranges[f],
            Table::AffinityMatch => self.counts.aff_match[f],
            Table::Echo => self.counts.echo[f],
        }
    }

    /// Fill of `lb_maglev`: (tables in use, tables).
    pub fn maglev_usage(&self) -> (usize, u32) {
        (self.maglev_tables.len(), self.maps.maglev_geometry().tables)
    }

    /// Makes the maps hold `desired`, looking at every frontend.
    pub fn apply(&mut self, desired: &DesiredState) -> ApplyReport {
        self.apply_full(desired, true)
    }

    /// `apply`; with `hold`, a first apply on empty maps holds its writes and releases them
    /// together (`LbMaps::hold_writes`).
    fn apply_full(&mut self, desired: &DesiredState, hold: bool) -> ApplyReport {
        let mut report = ApplyReport::default();
        self.degraded = false;
        self.claimed_tables.clear();
        self.counts = self.recount();

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
            self.remove_counted(&fe, &mut report);
        }
        self.delete_stray_slots(&mut report);
        self.wanted = HashMap::with_capacity(self.wanted.len());
        for e in desired.services.values() {
            self.want(&e.backends, true);
        }
        self.collect_garbage(true, &mut report);

        let wanted_ips = cluster_ip_counts(desired.services.iter().map(|(fe, e)| (fe, e.flags)));

        // Filling empty maps (a cold start): no packet uses any of it yet, so the writes can be
        // held and written in batches, masters last.
        let hold = hold
            && !desired.services.is_empty()
            && self.services.is_empty()
            && self.backends.is_empty();
        if hold {
            self.maps.hold_writes();
        }
        let mut room = self.room();
        for (fe, entry) in &desired.services {
            self.apply_counted(fe, entry, &wanted_ips, &mut room, &mut report);
        }
        if hold && let Err(e) = self.maps.release_writes() {
            // The mirror believes the held writes made it. Re-read what did, and write the rest
            // entry by entry, which names each failure's frontend.
            tracing::warn!(error = %e, "batched writes to empty maps failed; writing entry by entry");
            if let Err(e) = self.refresh() {
                tracing::warn!(error = %e, "cannot re-read the maps; rewriting everything");
                self.reload(Dump::default());
            }
            self.maglev_built.clear();
            return self.apply_full(desired, false);
        }

        // Tables claimed by writes that failed before their master named them are free again.
        let named: BTreeSet<u32> = self
            .services
            .values()
            .filter_map(|i| maglev_table_of(&i.master))
            .collect();
        self.maglev_tables.retain(|t, _| named.contains(t));
        self.retry_maglev_fallbacks(desired, &wanted_ips, &mut room, &mut report);
        // Slots dropped by shrinking services leave their backends unreferenced.
        self.delete_stray_slots(&mut report);
        self.collect_garbage(false, &mut report);
        self.sync_cluster_ips(&mut report);
        self.sync_echo(&mut report);
        self.prune_src_ranges(desired, &mut report);
        self.prune_aff_match(&mut report);
        self.finish(&report);
        report
    }

    /// Makes the maps hold `desired`, of which `update` says what changed since the last
    /// apply (see the module docs).
    pub fn apply_update(&mut self, desired: &DesiredState, update: &Update) -> ApplyReport {
        let changes = match update {
            Update::Changed(c) if self.incremental => c,
            _ => return self.apply(desired),
        };
        let mut report = ApplyReport::default();
        self.degraded = false;
        self.claimed_tables.clear();
        for (fe, old) in changes {
            if let Some(o) = old {
                self.want(&o.backends, false);
            }
            if let Some(n) = desired.services.get(fe) {
                self.want(&n.backends, true);
            }
        }
        let mut changed: BTreeSet<Frontend> = changes.keys().copied().collect();
        changed.extend(std::mem::take(&mut self.retry));
        let touched = self.touched(&changed, desired);

        // 1. What goes away (as in `apply`).
        for fe in &changed {
            if !desired.services.contains_key(fe) && self.services.contains_key(fe) {
                self.remove_counted(fe, &mut report);
            }
        }
        self.delete_stray_slots(&mut report);
        let (ids, revnat, cw) = (&touched.ids, &touched.revnat, &touched.want);
        self.collect_garbage_of(ids, revnat, &changed, cw, true, &mut report);

        // 2. The changed frontends, in `apply`'s order, with the backend states (`wanted`) and
        // ClusterIP counts of the whole desired state.
        let mut room = self.room();
        for fe in &changed {
            if let Some(entry) = desired.services.get(fe) {
                let ips = &touched.cluster_ips;
                self.apply_counted(fe, entry, ips, &mut room, &mut report);
            }
        }
        self.refresh_backend_states(changes, &changed, desired, &touched.want, &mut report);

        // 3. Clean-up, as `apply`'s, of what the changed frontends touched.
        self.clean_up_touched(desired, &changed, touched, &mut room, &mut report);
        self.finish(&report);
        debug_assert_eq!(self.counts, self.recount(), "entry counts drifted");
        report
    }

    /// What the changed frontends had installed and what they want, for the clean-up passes.
    fn touched(&self, changed: &BTreeSet<Frontend>, desired: &DesiredState) -> Touched {
        let old: BTreeMap<Frontend, Installed> = changed
            .iter()
            .filter_map(|fe| Some((*fe, self.services.get(fe)?.clone())))
            .collect();
        let ids = old
            .values()
            .flat_map(|i| i.slots.iter().copied())
            .filter(|id| *id != 0)
            .collect();
        let tables = old
            .values()
            .filter_map(|i| maglev_table_of(&i.master))
            .collect();
        let revnat = old.values().map(|i| i.master.rev_nat_id).collect();
        let mut want: HashMap<L4Addr, u32> = HashMap::new();
        for b in changed
            .iter()
            .filter_map(|fe| desired.services.get(fe))
            .flat_map(|e| &e.backends)
        {
            *want.entry(b.l4).or_default() += 1;
        }
        Touched {
            old,
            ids,
            tables,
            revnat,
            want,
            cluster_ips: changed_cluster_ips(changed, desired),
        }
    }

    /// `apply`'s clean-up, limited to what the changed frontends touched: tables claimed by
    /// failed writes, then backends, rev-NAT entries, ClusterIPs and echo entries, source
    /// ranges and affinity matches nothing refers to any more. `room` is what is left, for
    /// retried Maglev fallbacks.
    fn clean_up_touched(
        &mut self,
        desired: &DesiredState,
        changed: &BTreeSet<Frontend>,
        touched: Touched,
        room: &mut Room,
        report: &mut ApplyReport,
    ) {
        let Touched {
            old,
            mut ids,
            tables,
            mut revnat,
            want,
            cluster_ips,
        } = touched;
        self.free_unnamed_tables(tables, changed);
        self.retry_maglev_fallbacks(desired, &cluster_ips, room, report);
        self.delete_stray_slots(report);
        ids.extend(
            changed
                .iter()
                .filter_map(|fe| desired.services.get(fe))
                .flat_map(|e| e.backends.iter())
                .filter_map(|b| self.backend_ids.get(&b.l4).copied()),
        );
        revnat.extend(
            changed
                .iter()
                .filter_map(|fe| self.services.get(fe))
                .map(|i| i.master.rev_nat_id),
        );
        self.collect_garbage_of(&ids, &revnat, changed, &want, false, report);
        let addrs: BTreeSet<IpAddr> = changed.iter().map(|fe| fe.l4.addr).collect();
        for addr in addrs {
            self.sync_address(addr, report);
        }
        self.prune_src_ranges_of(changed, desired, &revnat, report);
        self.prune_aff_matches_of(changed, &old, report);
    }

    /// A backend's state is the most usable any frontend gives it: a change may move it for
    /// frontends that did not change (which `apply` would write it for).
    fn refresh_backend_states(
        &mut self,
        changes: &BTreeMap<Frontend, Option<ServiceEntry>>,
        changed: &BTreeSet<Frontend>,
        desired: &DesiredState,
        changed_want: &HashMap<L4Addr, u32>,
        report: &mut ApplyReport,
    ) {
        let mut touched: Vec<L4Addr> = changes
            .values()
            .flatten()
            .chain(changed.iter().filter_map(|fe| desired.services.get(fe)))
            .flat_map(|e| e.backends.iter().map(|b| b.l4))
            .collect();
        touched.sort_unstable();
        touched.dedup();
        for l4 in touched {
            let (Some(&id), Some(state)) = (self.backend_ids.get(&l4), self.wanted_state(&l4))
            else {
                continue;
            };
            let total: u32 = self.wanted.get(&l4).map_or(0, |n| n.iter().sum());
            if total <= changed_want.get(&l4).copied().unwrap_or(0) {
                continue;
            }
            let b = Backend { l4, state };
            if self.backends.get(&id).is_some_and(|have| *have != b) {
                match self.maps.put_backend(id, &b) {
                    Ok(()) => {
                        report.writes += 1;
                        self.backends.insert(id, b);
                    }
                    Err(e) => {
                        self.degraded = true;
                        tracing::warn!(id, error = %e, "cannot write backend state");
                    }
                }
            }
        }
    }

    /// Frees the Maglev tables among `old_tables` (and those claimed by failed writes) that no
    /// frontend of `changed` names any more.
    fn free_unnamed_tables(&mut self, old_tables: Vec<u32>, changed: &BTreeSet<Frontend>) {
        let tables: BTreeSet<u32> = old_tables
            .into_iter()
            .chain(std::mem::take(&mut self.claimed_tables))
            .collect();
        for t in tables {
            let named = changed.iter().any(|fe| {
                self.services
                    .get(fe)
                    .is_some_and(|i| maglev_table_of(&i.master) == Some(t))
            });
            if !named {
                self.maglev_tables.remove(&t);
            }
        }
    }

    /// Brings `addr`'s echo entry and ClusterIP set entry in line with the frontends installed
    /// at it.
    fn sync_address(&mut self, addr: IpAddr, report: &mut ApplyReport) {
        let want = echo_at(at_addr(&self.services, addr));
        self.set_echo(addr, want, report);
        let n = at_addr(&self.services, addr)
            .filter(|(_, i)| i.master.flags & svc_flags::CLUSTER_IP != 0)
            .count() as u32;
        if n == 0 && self.cluster_ips.contains_key(&addr) {
            self.del_cluster_ip(addr, report);
        } else if n > 0 && self.cluster_ips.get(&addr) != Some(&n) {
            self.put_cluster_ip(addr, n, report);
        }
    }

    /// Deletes the source ranges of the rev-NAT ids `revnat` that no frontend of `changed`
    /// wants any more.
    fn prune_src_ranges_of(
        &mut self,
        changed: &BTreeSet<Frontend>,
        desired: &DesiredState,
        revnat: &BTreeSet<u32>,
        report: &mut ApplyReport,
    ) {
        // Both scopes of a frontend's address share its rev-NAT id.
        let scoped: BTreeSet<Frontend> = changed
            .iter()
            .flat_map(|fe| {
                [Scope::External, Scope::Internal].map(|scope| Frontend { scope, ..*fe })
            })
            .collect();
        let wanted_ranges: BTreeSet<(u32, Cidr)> = scoped
            .iter()
            .filter_map(|fe| Some((self.services.get(fe)?, desired.services.get(fe)?)))
            .filter(|(i, _)| i.master.flags & svc_flags::SOURCE_RANGES != 0)
            .flat_map(|(i, e)| {
                let id = i.master.rev_nat_id;
                e.source_ranges.iter().map(move |c| (id, *c))
            })
            .collect();
        let stale: Vec<(u32, Cidr)> = self
            .src_ranges
            .iter()
            .filter(|(id, _)| revnat.contains(id))
            .filter(|r| !wanted_ranges.contains(r))
            .copied()
            .collect();
        self.delete_src_ranges(stale, report);
    }

    /// Deletes the affinity matches of `changed` (as installed before, `old`, and now) that
    /// their masters no longer offer.
    fn prune_aff_matches_of(
        &mut self,
        changed: &BTreeSet<Frontend>,
        old: &BTreeMap<Frontend, Installed>,
        report: &mut ApplyReport,
    ) {
        let mut stale = Vec::new();
        for fe in changed {
            let family = Family::of(&fe.l4.addr);
            let ids: BTreeSet<u32> = old
                .get(fe)
                .into_iter()
                .chain(self.services.get(fe))
                .map(|i| i.master.rev_nat_id)
                .collect();
            let keep: BTreeSet<AffMatch> = match self.services.get(fe) {
                Some(i) => {
                    let active = &i.slots[..(i.master.count as usize).min(i.slots.len())];
                    let affine = i.master.flags & svc_flags::AFFINITY != 0;
                    aff_matches(fe, affine, i.master.rev_nat_id, active).collect()
                }
                None => BTreeSet::new(),
            };
            for id in &ids {
                stale.extend(
                    self.aff_matches_of(family, *id, fe.scope)
                        .filter(|m| !keep.contains(m)),
                );
            }
        }
        for m in stale {
            match self.maps.del_aff_match(&m) {
                Ok(()) => {
                    report.deletes += 1;
                    if self.aff_match.remove(&m) {
                        self.counts.aff_match[fam(m.family)] -= 1;
                    }
                }
                Err(e) => {
                    self.degraded = true;
                    tracing::warn!(?m, error = %e, "cannot delete affinity match")
                }
            }
        }
    }

    /// Tries the Maglev frontends that found no free table once more, when frontends after
    /// them in this apply freed one (a table is free only once its master stopped naming it,
    /// so an earlier frontend cannot take it): one apply then programs what a fresh
    /// reconciler's would.
    fn retry_maglev_fallbacks(
        &mut self,
        desired: &DesiredState,
        ips: &BTreeMap<IpAddr, u32>,
        room: &mut Room,
        report: &mut ApplyReport,
    ) {
        let tables = self.maps.maglev_geometry().tables as usize;
        if report.fallbacks.is_empty() || self.maglev_tables.len() >= tables {
            return;
        }
        for e in std::mem::take(&mut report.fallbacks) {
            match desired.services.get(&e.frontend) {
                Some(entry) => self.apply_counted(&e.frontend, entry, ips, room, report),
                None => report.fallbacks.push(e),
            }
        }
    }

    /// After an apply: whether the next may be incremental, and what it must retry.
    fn finish(&mut self, report: &ApplyReport) {
        let clean = report.errors.iter().all(|e| e.full_map.is_some());
        self.incremental = clean && !self.degraded;
        self.retry = report
            .errors
            .iter()
            .chain(&report.fallbacks)
            .map(|e| e.frontend)
            .collect();
    }

    /// Counts `entry`'s backends into (`add`) or out of the desired state's.
    fn want(&mut self, backends: &[Backend], add: bool) {
        for b in backends {
            let n = self.wanted.entry(b.l4).or_default();
            let s = &mut n[b.state as usize];
            if add {
                *s += 1;
            } else {
                *s = s.saturating_sub(1);
                if n.iter().all(|c| *c == 0) {
                    self.wanted.remove(&b.l4);
                }
            }
        }
    }

    /// The most usable state the desired state gives `l4`, if it names it.
    fn wanted_state(&self, l4: &L4Addr) -> Option<BackendState> {
        let n = self.wanted.get(l4)?;
        let i = n.iter().position(|c| *c > 0)?;
        BackendState::try_from(i as u8).ok()
    }

    /// The affinity matches written for (family, rev-NAT id, scope).
    fn aff_matches_of(
        &self,
        family: Family,
        rev_nat_id: u32,
        scope: Scope,
    ) -> impl Iterator<Item = AffMatch> + '_ {
        let lo = AffMatch {
            family,
            rev_nat_id,
            scope,
            backend_id: 0,
        };
        let hi = AffMatch {
            backend_id: u32::MAX,
            ..lo
        };
        self.aff_match.range(lo..=hi).copied()
    }

    /// Free entries per map for the services still to be written.
    fn room(&self) -> Room {
        let mut room = BTreeMap::new();
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
        room
    }

    /// `remove_service`, counted and reported.
    fn remove_counted(&mut self, fe: &Frontend, report: &mut ApplyReport) {
        let before = entries_of(self.services.get(fe));
        let result = self.remove_service(fe, report);
        let after = entries_of(self.services.get(fe));
        let f = fam_of(&fe.l4.addr);
        self.counts.services[f] = self.counts.services[f] + after - before;
        if let Err(e) = result {
            report.errors.push(ServiceError {
                frontend: *fe,
                service: String::new(),
                error: e.to_string(),
                full_map: None,
            });
        }
    }

    /// `apply_service`, counted and reported.
    fn apply_counted(
        &mut self,
        fe: &Frontend,
        entry: &ServiceEntry,
        ips: &BTreeMap<IpAddr, u32>,
        room: &mut Room,
        report: &mut ApplyReport,
    ) {
        let before = entries_of(self.services.get(fe));
        let result = self.apply_service(fe, entry, ips, room, report);
        let after = entries_of(self.services.get(fe));
        let f = fam_of(&fe.l4.addr);
        self.counts.services[f] = self.counts.services[f] + after - before;
        if let Err(f) = result {
            report.errors.push(ServiceError {
                frontend: *fe,
                service: entry.name.to_string(),
                error: f.error,
                full_map: f.full_map,
            });
        }
    }

    /// `collect_garbage` for the backends `ids` and rev-NAT entries `revnat` a change of
    /// `changed` may have left unreferenced. A backend a frontend outside `changed` names is
    /// in its slots (the mirror holds their desired state), so only `changed`'s slots and
    /// tables need looking at; with `keep_wanted`, backends the desired state names stay.
    fn collect_garbage_of(
        &mut self,
        ids: &BTreeSet<u32>,
        revnat: &BTreeSet<u32>,
        changed: &BTreeSet<Frontend>,
        changed_want: &HashMap<L4Addr, u32>,
        keep_wanted: bool,
        report: &mut ApplyReport,
    ) {
        let mut by_changed: HashSet<u32> = HashSet::new();
        for fe in changed {
            if let Some(i) = self.services.get(fe) {
                by_changed.extend(i.slots.iter().copied());
                let table = maglev_table_of(&i.master).and_then(|t| self.maglev_tables.get(&t));
                by_changed.extend(table.into_iter().flatten().copied());
            }
        }
        let unused: Vec<u32> = ids
            .iter()
            .copied()
            .filter(|id| {
                let Some(b) = self.backends.get(id) else {
                    return false;
                };
                let total: u32 = self.wanted.get(&b.l4).map_or(0, |n| n.iter().sum());
                let elsewhere = total > changed_want.get(&b.l4).copied().unwrap_or(0);
                let kept = (keep_wanted && total > 0) || elsewhere;
                !(kept || by_changed.contains(id))
            })
            .collect();
        self.delete_backends(unused, report);
        for id in revnat {
            let Some((addr, port)) = self.revnat.get(id).copied() else {
                continue;
            };
            // Its users: the frontends at its address and port (both scopes, any protocol).
            let used = at_addr(&self.services, addr)
                .any(|(fe, i)| fe.l4.port == port && i.master.rev_nat_id == *id);
            if used {
                continue;
            }
            match self.maps.del_revnat(*id, Family::of(&addr)) {
                Ok(()) => {
                    report.deletes += 1;
                    self.revnat.remove(id);
                    self.counts.revnat[fam_of(&addr)] -= 1;
                    for proto in [Proto::Tcp, Proto::Udp, Proto::Sctp] {
                        let l4 = L4Addr { addr, port, proto };
                        if self.revnat_ids.get(&l4) == Some(id) {
                            self.revnat_ids.remove(&l4);
                        }
                    }
                }
                Err(e) => {
                    self.degraded = true;
                    tracing::warn!(id, error = %e, "cannot delete rev-NAT entry")
                }
            }
        }
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
                    self.counts.aff_match[fam(m.family)] -= 1;
                }
                Err(e) => {
                    self.degraded = true;
                    tracing::warn!(?m, error = %e, "cannot delete affinity match")
                }
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
        self.delete_src_ranges(stale, report);
    }

    /// Deletes the source ranges `stale` from the maps and the mirror; one that cannot be
    /// deleted stays (logged) and marks the reconciler degraded.
    fn delete_src_ranges(&mut self, stale: Vec<(u32, Cidr)>, report: &mut ApplyReport) {
        for (id, cidr) in stale {
            match self.maps.del_src_range(id, &cidr) {
                Ok(()) => {
                    report.deletes += 1;
                    self.src_ranges.remove(&(id, cidr));
                    self.counts.src_ranges[fam_of(&cidr.addr)] -= 1;
                }
                Err(e) => {
                    self.degraded = true;
                    tracing::warn!(id, %cidr, error = %e, "cannot delete source range")
                }
            }
        }
    }

    /// Writes `addr` into the ClusterIP set. A failure only costs the unknown-port REJECT for
    /// that address (its frontends work), so it is logged, and retried by the next apply.
    fn put_cluster_ip(&mut self, addr: IpAddr, frontends: u32, report: &mut ApplyReport) {
        match self.maps.put_cluster_ip(addr, frontends) {
            Ok(()) => {
                report.writes += 1;
                if self.cluster_ips.insert(addr, frontends).is_none() {
                    self.counts.cluster_ips[fam_of(&addr)] += 1;
                }
            }
            Err(e) => {
                self.degraded = true;
                tracing::warn!(%addr, error = %e, "cannot write ClusterIP entry")
            }
        }
    }

    /// Deletes `addr` from the ClusterIP set; a failure is logged, and retried by the next
    /// apply.
    fn del_cluster_ip(&mut self, addr: IpAddr, report: &mut ApplyReport) {
        match self.maps.del_cluster_ip(addr) {
            Ok(()) => {
                report.deletes += 1;
                self.cluster_ips.remove(&addr);
                self.counts.cluster_ips[fam_of(&addr)] -= 1;
            }
            Err(e) => {
                self.degraded = true;
                tracing::warn!(%addr, error = %e, "cannot delete ClusterIP entry")
            }
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
            self.del_cluster_ip(addr, report);
        }
        for (addr, n) in installed {
            if self.cluster_ips.get(&addr) != Some(&n) {
                self.put_cluster_ip(addr, n, report);
            }
        }
    }

    /// Makes the echo table match the frontends installed now.
    fn sync_echo(&mut self, report: &mut ApplyReport) {
        let addrs: BTreeSet<IpAddr> = self
            .services
            .keys()
            .map(|fe| fe.l4.addr)
            .chain(self.echo.keys().copied())
            .collect();
        for addr in addrs {
            let want = echo_at(at_addr(&self.services, addr));
            self.set_echo(addr, want, report);
        }
    }

    /// Writes (or, with `None`, deletes) `addr`'s echo entry where it differs. A failure only
    /// costs the ping answer, so it is logged, and retried by the next full apply.
    fn set_echo(&mut self, addr: IpAddr, want: Option<EchoValue>, report: &mut ApplyReport) {
        if self.echo.get(&addr) == want.as_ref() {
            return;
        }
        let f = fam_of(&addr);
        let result = match want {
            Some(v) => self.maps.put_echo(addr, v),
            None => self.maps.del_echo(addr),
        };
        match (result, want) {
            (Ok(()), Some(v)) => {
                report.writes += 1;
                if self.echo.insert(addr, v).is_none() {
                    self.counts.echo[f] += 1;
                }
            }
            (Ok(()), None) => {
                report.deletes += 1;
                self.echo.remove(&addr);
                self.counts.echo[f] -= 1;
            }
            (Err(e), _) => {
                self.degraded = true;
                tracing::warn!(%addr, error = %e, "cannot write echo entry");
            }
        }
    }

    fn delete_stray_slots(&mut self, report: &mut ApplyReport) {
        for (fe, slot) in std::mem::take(&mut self.stray_slots) {
            self.delete_slot(&fe, slot, "stray slot", report);
        }
    }

    /// Deletes slot `slot` of `fe` (`what` names it in the log); one that cannot be deleted is
    /// kept as a stray slot, for the next apply to delete, and makes that apply a full one.
    fn delete_slot(&mut self, fe: &Frontend, slot: u16, what: &str, report: &mut ApplyReport) {
        match self.maps.del_service(fe, slot) {
            Ok(()) => report.deletes += 1,
            Err(e) => {
                self.degraded = true;
                tracing::warn!(%fe, slot, error = %e, "cannot delete {what}");
                self.stray_slots.insert((*fe, slot));
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
        cluster_ips: &BTreeMap<IpAddr, u32>,
        room: &mut Room,
        report: &mut ApplyReport,
    ) -> Result<(), Failure> {
        let plan = self.plan_service(fe, entry)?;
        let family = plan.family;
        self.check_room(&plan, room)?;
        let active = plan.active;
        let maglev = self.plan_maglev(fe, entry, &plan.backends[..active], &plan.ids[..active]);
        if maglev.fallback {
            report.fallbacks.push(self.maglev_fallback(fe, entry));
        }
        let total = plan.backends.len();
        let master = SvcValue {
            backend_id: maglev.master_backend_id,
            count: active as u16,
            qcount: (total - active) as u16,
            rev_nat_id: plan.rev_nat_id,
            flags: entry.flags,
            lb_alg: maglev.lb_alg,
            pad: 0,
            affinity_timeout: if plan.affine {
                entry.affinity_timeout
            } else {
                0
            },
        };
        // The state a backend gets in the (shared) backends map: one entry per address, so
        // the most usable state any frontend of the desired state gives it.
        let global: Vec<Backend> = plan
            .backends
            .iter()
            .map(|b| Backend {
                l4: b.l4,
                state: self.wanted_state(&b.l4).unwrap_or(b.state),
            })
            .collect();
        if maglev.writes.is_empty() && self.unchanged(fe, &plan, &master, &global) {
            if let Some(set) = maglev.built {
                self.maglev_built.insert(*fe, set);
            }
            return Ok(());
        }
        for (table, needed) in plan.needed {
            *room.entry((table, family)).or_default() -= needed;
        }

        self.write_planned(
            fe,
            entry,
            plan,
            &master,
            maglev,
            &global,
            cluster_ips,
            report,
        )
    }

    /// Whether the plan needs no room the maps do not have left.
    fn check_room(&self, plan: &ServicePlan, room: &Room) -> Result<(), Failure> {
        let family = plan.family;
        for (table, needed) in plan.needed {
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
        Ok(())
    }

    /// Whether the maps already hold what the plan would write (the Maglev table aside):
    /// master, slots, rev-NAT entry and backends, with no source range or affinity match to add.
    fn unchanged(
        &self,
        fe: &Frontend,
        plan: &ServicePlan,
        master: &SvcValue,
        global: &[Backend],
    ) -> bool {
        plan.ranges.is_empty()
            && plan.matches.is_empty()
            && plan
                .existing
                .as_ref()
                .is_some_and(|i| i.master == *master && i.slots == plan.ids)
            && self.revnat.get(&plan.rev_nat_id) == Some(&(fe.l4.addr, fe.l4.port))
            && global
                .iter()
                .zip(&plan.ids)
                .all(|(b, id)| self.backends.get(id) == Some(b))
    }

    /// Writes a frontend `apply_service` planned, in the order the module docs give, its
    /// previous state restored if its slots or master cannot be written.
    #[expect(
        clippy::too_many_arguments,
        reason = "the plan's parts apply_service computed, passed on"
    )]
    fn write_planned(
        &mut self,
        fe: &Frontend,
        entry: &ServiceEntry,
        plan: ServicePlan,
        master: &SvcValue,
        maglev: MaglevPlan,
        global: &[Backend],
        cluster_ips: &BTreeMap<IpAddr, u32>,
        report: &mut ApplyReport,
    ) -> Result<(), Failure> {
        let total = plan.backends.len();
        // 0. A new ClusterIP, before anything of its first frontend (see the module docs).
        if entry.flags & svc_flags::CLUSTER_IP != 0 && !self.cluster_ips.contains_key(&fe.l4.addr) {
            let n = cluster_ips.get(&fe.l4.addr).copied().unwrap_or(1);
            self.put_cluster_ip(fe.l4.addr, n, report);
        }
        // 1.–2c. Backends, rev-NAT, source ranges, affinity matches.
        self.write_referenced(fe, &plan, global, report)
            .map_err(|e| e.to_string())?;
        // 3. Slots and the Maglev table, then 4. the master entry that makes them visible.
        let old = plan.existing;
        // Known again only once the table is whole.
        self.maglev_built.remove(fe);
        let table = maglev_table_of(master).map(|t| (t, maglev.writes.as_slice()));
        if let Err(e) = self.write_slots_and_master(fe, &plan.ids, table, master, report) {
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
            && maglev_table_of(master) != Some(t)
        {
            self.maglev_tables.remove(&t);
        }
        // 5. Slots a shrunk service no longer counts.
        let old_len = old.map_or(0, |i| i.slots.len());
        for slot in (total + 1..=old_len).rev() {
            self.delete_slot(fe, slot as u16, "surplus slot", report);
        }
        Ok(())
    }

    /// The report of a Maglev frontend that found no free table.
    fn maglev_fallback(&self, fe: &Frontend, entry: &ServiceEntry) -> ServiceError {
        ServiceError {
            frontend: *fe,
            service: entry.name.to_string(),
            error: format!(
                "map {} is full ({} tables of {} cells in use): Maglev service programmed with \
                 random selection",
                map_names::MAGLEV,
                self.maglev_tables.len(),
                self.maps.maglev_geometry().table_size
            ),
            full_map: Some(map_names::MAGLEV),
        }
    }

    /// What `apply_service` would write for `fe`, and the room it needs: ids are allocated in
    /// the plan only, until written.
    fn plan_service(
        &mut self,
        fe: &Frontend,
        entry: &ServiceEntry,
    ) -> Result<ServicePlan, Failure> {
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
        let (ids, new_backends) = self.plan_backend_ids(&backends);
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
        let matches: Vec<AffMatch> = aff_matches(fe, affine, rev_nat_id, &ids[..active])
            .filter(|m| !self.aff_match.contains(m))
            .collect();
        let needed = [
            (Table::Services, needed_services),
            (Table::Backends, new_backends.len() as i64),
            (Table::RevNat, i64::from(new_revnat)),
            (Table::SourceRanges, ranges.len() as i64),
            (Table::AffinityMatch, matches.len() as i64),
        ];
        Ok(ServicePlan {
            family,
            backends,
            active,
            ids,
            existing,
            rev_nat_id,
            ranges,
            matches,
            affine,
            needed,
        })
    }

    /// The backend id of each of `backends` (slot order): its own where it has one, else a new
    /// one (the same for repeats of an address), listed in the second vector to be written.
    fn plan_backend_ids(&mut self, backends: &[Backend]) -> (Vec<u32>, Vec<(u32, Backend)>) {
        let mut new_backends = Vec::new();
        let mut ids = Vec::with_capacity(backends.len());
        let mut seen_new: HashMap<L4Addr, u32> = HashMap::new();
        for b in backends {
            let id = match self.backend_ids.get(&b.l4).copied() {
                Some(id) => id,
                None => *seen_new.entry(b.l4).or_insert_with(|| {
                    let id = self.alloc_backend_id_excluding(&new_backends);
                    new_backends.push((id, *b));
                    id
                }),
            };
            ids.push(id);
        }
        (ids, new_backends)
    }

    /// Steps 1–2c of `apply_service`: everything a frontend's slots and master refer to,
    /// written before them.
    fn write_referenced(
        &mut self,
        fe: &Frontend,
        plan: &ServicePlan,
        global: &[Backend],
        report: &mut ApplyReport,
    ) -> Result<(), MapOpError> {
        // 1. Backends (new ones, and known ones whose state changed).
        for (b, id) in global.iter().zip(&plan.ids) {
            let b = *b;
            if self.backends.get(id) != Some(&b) {
                self.maps.put_backend(*id, &b)?;
                report.writes += 1;
                if self.backends.insert(*id, b).is_none() {
                    self.counts.backends[fam_of(&b.l4.addr)] += 1;
                }
                self.backend_ids.insert(b.l4, *id);
            }
        }
        // 2. Rev-NAT, before any packet can be balanced to a backend of this frontend.
        let rev_nat_id = plan.rev_nat_id;
        if self.revnat.get(&rev_nat_id) != Some(&(fe.l4.addr, fe.l4.port)) {
            self.maps.put_revnat(rev_nat_id, fe.l4.addr, fe.l4.port)?;
            report.writes += 1;
            if self
                .revnat
                .insert(rev_nat_id, (fe.l4.addr, fe.l4.port))
                .is_none()
            {
                self.counts.revnat[fam_of(&fe.l4.addr)] += 1;
            }
            self.revnat_ids.insert(fe.l4, rev_nat_id);
        }
        // 2b. Source ranges, before a master with SOURCE_RANGES can drop what they allow.
        for cidr in &plan.ranges {
            self.maps.put_src_range(rev_nat_id, cidr)?;
            report.writes += 1;
            if self.src_ranges.insert((rev_nat_id, *cidr)) {
                self.counts.src_ranges[fam_of(&cidr.addr)] += 1;
            }
        }
        // 2c. Affinity matches: the new active backends' before the master offers them (an
        // affinity entry naming one is honoured from the first packet that can pick it), and
        // the ones the frontend no longer offers deleted before the master drops them, so no
        // client is kept on a backend the frontend has left.
        for m in &plan.matches {
            self.maps.put_aff_match(m)?;
            report.writes += 1;
            if self.aff_match.insert(*m) {
                self.counts.aff_match[fam(m.family)] += 1;
            }
        }
        let keep: BTreeSet<AffMatch> =
            aff_matches(fe, plan.affine, rev_nat_id, &plan.ids[..plan.active]).collect();
        let stale: Vec<AffMatch> = self
            .aff_matches_of(plan.family, rev_nat_id, fe.scope)
            .filter(|m| !keep.contains(m))
            .collect();
        for m in stale {
            self.maps.del_aff_match(&m)?;
            report.deletes += 1;
            self.aff_match.remove(&m);
            self.counts.aff_match[fam(m.family)] -= 1;
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
                        self.degraded = true;
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
                let claimed = &mut self.claimed_tables;
                self.maglev_tables.entry(t).or_insert_with(|| {
                    claimed.push(t);
                    vec![0; m]
                })[*cell as usize] = *id;
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
        // Slots the failed update added beyond the old ones: the old master does not count
        // them. One that cannot be deleted is stray (deleted by the next apply), never left
        // unknown to the mirror.
        let surplus: Vec<usize> = (old.slots.len() + 1..=installed.slots.len())
            .rev()
            .collect();
        installed.slots.truncate(old.slots.len());
        for slot in surplus {
            self.delete_slot(fe, slot as u16, "surplus slot", report);
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
            self.delete_slot(fe, slot as u16, "slot", report);
        }
        Ok(())
    }

    /// Deletes the backends `unused` from the maps and the mirror; one that cannot be deleted
    /// stays (logged) and marks the reconciler degraded (the next sync is a full one).
    fn delete_backends(&mut self, unused: Vec<u32>, report: &mut ApplyReport) {
        for id in unused {
            let Some(b) = self.backends.get(&id).copied() else {
                continue;
            };
            match self.maps.del_backend(id, Family::of(&b.l4.addr)) {
                Ok(()) => {
                    report.deletes += 1;
                    report.backends_deleted += 1;
                    self.backends.remove(&id);
                    self.counts.backends[fam_of(&b.l4.addr)] -= 1;
                    if self.backend_ids.get(&b.l4) == Some(&id) {
                        self.backend_ids.remove(&b.l4);
                    }
                }
                Err(e) => {
                    self.degraded = true;
                    tracing::warn!(id, error = %e, "cannot delete backend")
                }
            }
        }
    }

    /// Deletes backends and rev-NAT entries no installed service refers to.
    ///
    /// With `keep_wanted`, backends the desired state names (`wanted`) survive even when
    /// unreferenced: they are about to be used again, and keeping them keeps their ids (and
    /// the conntrack entries naming them) valid.
    fn collect_garbage(&mut self, keep_wanted: bool, report: &mut ApplyReport) {
        let used_backends: HashSet<u32> = self
            .services
            .values()
            .flat_map(|i| i.slots.iter().copied())
            .chain(self.maglev_tables.values().flatten().copied())
            .collect();
        let unused: Vec<u32> = self
            .backends
            .iter()
            .filter(|(id, b)| {
                let kept = keep_wanted && self.wanted.contains_key(&b.l4);
                !(used_backends.contains(id) || kept)
            })
            .map(|(id, _)| *id)
            .collect();
        self.delete_backends(unused, report);
        let used_revnat: HashSet<u32> = self
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
                    self.counts.revnat[fam_of(&addr)] -= 1;
                    self.revnat_ids.retain(|_, v| *v != id);
                }
                Err(e) => {
                    self.degraded = true;
                    tracing::warn!(id, error = %e, "cannot delete rev-NAT entry")
                }
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

/// The entries of `map` whose frontend is at `addr` (frontends sort by address first).
fn at_addr<V>(map: &BTreeMap<Frontend, V>, addr: IpAddr) -> impl Iterator<Item = (&Frontend, &V)> {
    let lo = Frontend {
        l4: L4Addr {
            addr,
            port: 0,
            proto: Proto::Tcp,
        },
        scope: Scope::External,
    };
    map.range(lo..)
        .take_while(move |(fe, _)| fe.l4.addr == addr)
}

/// What an echo request to an address gets, from the masters installed at it (`at_addr`):
/// per client scope, answered while any ClusterIP, external or LoadBalancer frontend there has
/// a usable backend, else dropped where one drops its traffic (endpoints only elsewhere), else
/// rejected. A frontend with source ranges takes no part (its traffic depends on the source),
/// nor does one at an address of this node (`LOCAL_ADDR`: an external IP on the node, which
/// answers ping itself, whatever the service's endpoints). `None`: the address has no such
/// frontend.
fn echo_at<'a>(at: impl Iterator<Item = (&'a Frontend, &'a Installed)>) -> Option<EchoValue> {
    const SERVICE_ADDR: u16 =
        svc_flags::CLUSTER_IP | svc_flags::EXTERNAL_IP | svc_flags::LOAD_BALANCER;
    // Strongest first: one answering frontend makes the address answer.
    let rank = |v: u8| match v {
        echo::ANSWER => 3,
        echo::DROP => 2,
        echo::REJECT => 1,
        _ => 0,
    };
    let merge = |have: &mut u8, v: u8| {
        if rank(v) > rank(*have) {
            *have = v;
        }
    };
    let mut out = EchoValue::default();
    for (fe, i) in at {
        let m = &i.master;
        if m.flags & SERVICE_ADDR == 0
            || m.flags & (svc_flags::SOURCE_RANGES | svc_flags::LOCAL_ADDR) != 0
        {
            continue;
        }
        let v = if m.count > 0 {
            echo::ANSWER
        } else if m.flags & svc_flags::EMPTY_DROP != 0 {
            echo::DROP
        } else {
            echo::REJECT
        };
        match fe.scope {
            Scope::Internal => merge(&mut out.internal, v),
            Scope::External => {
                merge(&mut out.external, v);
                // One scope serves both kinds of client.
                if m.flags & svc_flags::TWO_SCOPES == 0 {
                    merge(&mut out.internal, v);
                }
            }
        }
    }
    (out != EchoValue::default()).then_some(out)
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

/// Free entries per table and family, as a sync uses them up.
type Room = BTreeMap<(Table, Family), i64>;

/// What an incremental apply's changed frontends had before it, and what they want.
struct Touched {
    /// Their installed entries.
    old: BTreeMap<Frontend, Installed>,
    /// The backend ids their slots named.
    ids: BTreeSet<u32>,
    /// The Maglev tables their masters named.
    tables: Vec<u32>,
    /// Their rev-NAT ids.
    revnat: BTreeSet<u32>,
    /// How many entries of the changed frontends name each backend address.
    want: HashMap<L4Addr, u32>,
    /// How many ClusterIP frontends the desired state has at each changed ClusterIP.
    cluster_ips: BTreeMap<IpAddr, u32>,
}

/// Per address of a changed ClusterIP frontend, how many ClusterIP frontends the whole
/// desired state has there.
fn changed_cluster_ips(
    changed: &BTreeSet<Frontend>,
    desired: &DesiredState,
) -> BTreeMap<IpAddr, u32> {
    let mut ips: BTreeMap<IpAddr, u32> = BTreeMap::new();
    for fe in changed {
        let Some(entry) = desired.services.get(fe) else {
            continue;
        };
        if entry.flags & svc_flags::CLUSTER_IP != 0 && !ips.contains_key(&fe.l4.addr) {
            let n = at_addr(&desired.services, fe.l4.addr)
                .filter(|(_, e)| e.flags & svc_flags::CLUSTER_IP != 0)
                .count();
            ips.insert(fe.l4.addr, n as u32);
        }
    }
    ips
}
