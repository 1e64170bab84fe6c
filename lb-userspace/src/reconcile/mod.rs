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
//!
//! The parts, each an `impl` of `Reconciler` over the mirror this file keeps: `service` (one
//! frontend planned, checked for room and written), `maglev_tables`, `addresses` (ClusterIP
//! set and echo table), `garbage` (what nothing refers to), `incremental` (`apply_update`);
//! `backends` is the mirror's backend table (each address once, with its id and wanted count).
mod addresses;
mod backends;
mod garbage;
mod incremental;
mod maglev_tables;
pub mod resteer;
mod service;

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

// foldhash: these maps are keyed by backend addresses and ids and looked up ~10 times per
// backend of a changed service; SipHash was a tenth of a 1,000-change sync.
use foldhash::{HashMap, HashMapExt as _};
use lb_common::{EchoValue, SvcValue, svc_flags};

use self::backends::Backends;

use crate::{
    datapath::maps::{
        AffMatch, Dump, LbMaps, Table, aff_match_of, maglev_table_of, revnat_of, src_ranges_of,
    },
    model::{Backend, BackendState, Cidr, DesiredState, Family, Frontend, L4Addr, Proto, Scope},
};

/// A frontend as installed: its master entry and the backend id in each slot.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Installed {
    master: SvcValue,
    /// `slots[i]` is slot `i + 1`; 0 where the slot entry is missing. Boxed: exactly as long
    /// as the frontend's slots, without a `Vec`'s capacity.
    slots: Box<[u32]>,
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
    /// The backend map as written, and how many entries of the last desired state name each
    /// backend address, per state (the backend map holds the most usable one).
    backends: Backends,
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
            backends: Backends::new(),
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
        self.backends = Backends::from_entries(dump.backends.iter());
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
            c.backends[i] = self.backends.count(f);
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
        self.backends.clear_wanted();
        for e in desired.services.values() {
            self.want(&e.backends, true);
        }
        // Every wanted address has its record now; few more come in this apply.
        self.backends.shrink(true);
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
        if hold {
            // Echo entries are held too, and written after the masters.
            self.sync_echo(&mut report);
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

    /// After an apply: whether the next may be incremental, and what it must retry.
    fn finish(&mut self, report: &ApplyReport) {
        self.backends.shrink(false);
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
            self.backends.want(b, add);
        }
    }

    /// The most usable state the desired state gives `l4`, if it names it.
    fn wanted_state(&self, l4: &L4Addr) -> Option<BackendState> {
        let n = self.backends.wanted(l4);
        let i = n.iter().position(|c| *c > 0)?;
        BackendState::try_from(i as u8).ok()
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

/// Free entries per table and family, as a sync uses them up.
type Room = BTreeMap<(Table, Family), i64>;

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
