//! Typed access to the service, backend and rev-NAT maps of both families, behind a trait so
//! the reconciler runs the same against the kernel's maps and against an in-memory model in
//! unit tests.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
};

use anyhow::Context as _;
use aya::maps::{Array, HashMap, LpmTrie, MapData, MapError, PerCpuArray, lpm_trie::Key as LpmKey};
use lb_common::{
    AffinityMatchKey, Backend4, Backend6, ClusterIp4Key, ClusterIp6Key, ClusterIpValue, EchoKey4,
    EchoKey6, EchoValue, MetricValue, RevNat4, RevNat6, SrcRange4, SrcRange6, Svc4Key, Svc6Key,
    SvcValue, echo, lb_alg, map_names,
};

pub use super::error::MapOpError;
use super::{
    batch,
    family::{MapFamily, SvcKeyRest, V4, V6},
    held::{Held, HeldFamily, HeldMaps},
};
use crate::{
    model::{Backend, BackendState, Family, Frontend, L4Addr, Proto, Scope},
    node::Cidr,
};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Table {
    Services,
    Backends,
    RevNat,
    /// The ClusterIP set (`lb*_cluster_ips`).
    ClusterIps,
    /// `loadBalancerSourceRanges` per rev-NAT id (`lb*_src_range`).
    SourceRanges,
    /// The backends session affinity may name per frontend (`lb*_aff_match`).
    AffinityMatch,
    /// Service addresses that answer ping (`lb*_echo`).
    Echo,
}

impl Table {
    /// Every table the reconciler owns, in a stable order.
    pub const ALL: [Table; 7] = [
        Table::Services,
        Table::Backends,
        Table::RevNat,
        Table::ClusterIps,
        Table::SourceRanges,
        Table::AffinityMatch,
        Table::Echo,
    ];

    pub fn map_name(self, family: Family) -> &'static str {
        match (self, family) {
            (Table::Services, Family::V4) => map_names::SERVICES4,
            (Table::Backends, Family::V4) => map_names::BACKENDS4,
            (Table::RevNat, Family::V4) => map_names::REVNAT4,
            (Table::Services, Family::V6) => map_names::SERVICES6,
            (Table::Backends, Family::V6) => map_names::BACKENDS6,
            (Table::RevNat, Family::V6) => map_names::REVNAT6,
            (Table::ClusterIps, Family::V4) => map_names::CLUSTER_IPS4,
            (Table::ClusterIps, Family::V6) => map_names::CLUSTER_IPS6,
            (Table::SourceRanges, Family::V4) => map_names::SRC_RANGE4,
            (Table::SourceRanges, Family::V6) => map_names::SRC_RANGE6,
            (Table::AffinityMatch, Family::V4) => map_names::AFF_MATCH4,
            (Table::AffinityMatch, Family::V6) => map_names::AFF_MATCH6,
            (Table::Echo, Family::V4) => map_names::ECHO4,
            (Table::Echo, Family::V6) => map_names::ECHO6,
        }
    }
}

/// Everything the service, backend and rev-NAT maps hold.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Dump {
    pub backends: BTreeMap<u32, Backend>,
    /// Rev-NAT id → frontend address and port.
    pub revnat: BTreeMap<u32, (IpAddr, u16)>,
    /// (frontend, slot) → value; slot 0 is the master entry.
    pub services: BTreeMap<(Frontend, u16), SvcValue>,
    /// ClusterIP → number of frontends at it.
    pub cluster_ips: BTreeMap<IpAddr, u32>,
    /// (rev-NAT id, allowed source range) of frontends with `loadBalancerSourceRanges`.
    pub src_ranges: BTreeSet<(u32, Cidr)>,
    /// The backends session affinity may name, per frontend (`lb*_aff_match`).
    pub aff_match: BTreeSet<AffMatch>,
    /// Service address → what an echo request to it gets (`lb*_echo`).
    pub echo: BTreeMap<IpAddr, EchoValue>,
    /// Maglev table index → its M cells (backend ids, 0: empty), for the tables Maglev masters
    /// name (`lb_maglev`; the other tables' cells are free space).
    pub maglev: BTreeMap<u32, Vec<u32>>,
}

/// An `lb*_aff_match` entry: `backend_id` is an active backend of frontend `rev_nat_id` in
/// `scope`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct AffMatch {
    pub family: Family,
    pub rev_nat_id: u32,
    pub scope: Scope,
    pub backend_id: u32,
}

impl AffMatch {
    fn key(&self) -> AffinityMatchKey {
        AffinityMatchKey {
            backend_id: self.backend_id,
            rev_nat_id: self.rev_nat_id,
            scope: self.scope as u8,
            pad: [0; 3],
        }
    }
}

/// The shape of `lb_maglev`: M cells per table, and how many tables.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MaglevGeometry {
    pub table_size: u32,
    pub tables: u32,
}

/// The table index a Maglev master names, if it is a Maglev master with a table.
pub fn maglev_table_of(master: &SvcValue) -> Option<u32> {
    (master.lb_alg == lb_alg::MAGLEV && master.backend_id != NO_MAGLEV_TABLE)
        .then_some(master.backend_id)
}

/// A Maglev master's `backend_id` while it has no active backend (and so no table).
pub const NO_MAGLEV_TABLE: u32 = u32::MAX;

impl Dump {
    /// Entries `table` holds for `family`.
    pub fn len(&self, table: Table, family: Family) -> usize {
        match table {
            Table::Services => self
                .services
                .keys()
                .filter(|(fe, _)| Family::of(&fe.l4.addr) == family)
                .count(),
            Table::Backends => backends_of(&self.backends, family),
            Table::RevNat => revnat_of(&self.revnat, family),
            Table::ClusterIps => self
                .cluster_ips
                .keys()
                .filter(|a| Family::of(a) == family)
                .count(),
            Table::SourceRanges => src_ranges_of(&self.src_ranges, family),
            Table::AffinityMatch => aff_match_of(&self.aff_match, family),
            Table::Echo => self.echo.keys().filter(|a| Family::of(a) == family).count(),
        }
    }
}

/// Affinity-match entries of `family`.
pub fn aff_match_of(entries: &BTreeSet<AffMatch>, family: Family) -> usize {
    entries.iter().filter(|m| m.family == family).count()
}

/// Source-range entries of `family`.
pub fn src_ranges_of(ranges: &BTreeSet<(u32, Cidr)>, family: Family) -> usize {
    ranges
        .iter()
        .filter(|(_, c)| Family::of(&c.addr) == family)
        .count()
}

/// Backends of `family` in a backend id → backend table.
pub fn backends_of(backends: &BTreeMap<u32, Backend>, family: Family) -> usize {
    backends
        .values()
        .filter(|b| Family::of(&b.l4.addr) == family)
        .count()
}

/// Rev-NAT entries of `family` in a rev-NAT id → frontend table.
pub fn revnat_of(revnat: &BTreeMap<u32, (IpAddr, u16)>, family: Family) -> usize {
    revnat
        .values()
        .filter(|(a, _)| Family::of(a) == family)
        .count()
}

pub trait LbMaps {
    fn dump(&self) -> anyhow::Result<Dump>;
    /// The map's max_entries.
    fn capacity(&self, table: Table, family: Family) -> u32;
    fn put_backend(&mut self, id: u32, backend: &Backend) -> Result<(), MapOpError>;
    fn del_backend(&mut self, id: u32, family: Family) -> Result<(), MapOpError>;
    fn put_revnat(&mut self, id: u32, addr: IpAddr, port: u16) -> Result<(), MapOpError>;
    fn del_revnat(&mut self, id: u32, family: Family) -> Result<(), MapOpError>;
    fn put_service(
        &mut self,
        frontend: &Frontend,
        slot: u16,
        value: &SvcValue,
    ) -> Result<(), MapOpError>;
    fn del_service(&mut self, frontend: &Frontend, slot: u16) -> Result<(), MapOpError>;
    /// Marks `addr` as a ClusterIP with `frontends` frontends.
    fn put_cluster_ip(&mut self, addr: IpAddr, frontends: u32) -> Result<(), MapOpError>;
    fn del_cluster_ip(&mut self, addr: IpAddr) -> Result<(), MapOpError>;
    /// Allows sources in `cidr` to open flows to the frontend with `rev_nat_id`.
    fn put_src_range(&mut self, rev_nat_id: u32, cidr: &Cidr) -> Result<(), MapOpError>;
    fn del_src_range(&mut self, rev_nat_id: u32, cidr: &Cidr) -> Result<(), MapOpError>;
    /// Lets affinity entries of a frontend name a backend.
    fn put_aff_match(&mut self, entry: &AffMatch) -> Result<(), MapOpError>;
    fn del_aff_match(&mut self, entry: &AffMatch) -> Result<(), MapOpError>;
    /// Sets what an echo request to service address `addr` gets.
    fn put_echo(&mut self, addr: IpAddr, value: EchoValue) -> Result<(), MapOpError>;
    fn del_echo(&mut self, addr: IpAddr) -> Result<(), MapOpError>;
    /// `lb_maglev`'s shape; no tables (the default): Maglev frontends fall back to random.
    fn maglev_geometry(&self) -> MaglevGeometry {
        MaglevGeometry::default()
    }
    /// Writes backend `id` into `cell` of Maglev table `table`.
    fn put_maglev(&mut self, _table: u32, _cell: u32, _id: u32) -> Result<(), MapOpError> {
        Err(MapOpError::Full {
            map: map_names::MAGLEV,
        })
    }
    /// Holds the ClusterIP, backend, rev-NAT, service and echo writes that follow until
    /// `release_writes`, for filling maps nothing uses yet (the first apply on empty maps). A
    /// held write reports success; what fails shows in `release_writes`. Deletes, and writes to
    /// other maps, are not held (a delete first releases what is held). Maps that cannot hold
    /// write at once.
    fn hold_writes(&mut self) {}
    /// Writes what `hold_writes` held in an order no packet can tell from entry by entry: the
    /// masters after everything they name. After a failure no master is written, so none ever
    /// names a missing slot or backend.
    fn release_writes(&mut self) -> Result<(), MapOpError> {
        Ok(())
    }
}

/// The `lb4_services` key of `fe`'s `slot`.
pub fn svc4_key(fe: &Frontend, addr: Ipv4Addr, slot: u16) -> Svc4Key {
    V4::svc_key(addr.octets(), svc_key_rest(fe, slot))
}

/// The `lb6_services` key of `fe`'s `slot`.
pub fn svc6_key(fe: &Frontend, addr: Ipv6Addr, slot: u16) -> Svc6Key {
    V6::svc_key(addr.octets(), svc_key_rest(fe, slot))
}

/// A service key's fields of `fe`'s `slot` but the address.
fn svc_key_rest(fe: &Frontend, slot: u16) -> SvcKeyRest {
    (fe.l4.port, fe.l4.proto.number(), fe.scope as u8, slot)
}

/// The kernel's maps, pinned or private.
pub struct BpfMaps {
    pub services4: HashMap<MapData, Svc4Key, SvcValue>,
    pub backends4: HashMap<MapData, u32, Backend4>,
    pub revnat4: HashMap<MapData, u32, RevNat4>,
    pub services6: HashMap<MapData, Svc6Key, SvcValue>,
    pub backends6: HashMap<MapData, u32, Backend6>,
    pub revnat6: HashMap<MapData, u32, RevNat6>,
    pub cluster_ips4: HashMap<MapData, ClusterIp4Key, ClusterIpValue>,
    pub cluster_ips6: HashMap<MapData, ClusterIp6Key, ClusterIpValue>,
    pub src_ranges4: LpmTrie<MapData, SrcRange4, u8>,
    pub src_ranges6: LpmTrie<MapData, SrcRange6, u8>,
    pub aff_match4: HashMap<MapData, AffinityMatchKey, u8>,
    pub aff_match6: HashMap<MapData, AffinityMatchKey, u8>,
    pub echo4: HashMap<MapData, EchoKey4, EchoValue>,
    pub echo6: HashMap<MapData, EchoKey6, EchoValue>,
    pub capacities: BTreeMap<(Table, Family), u32>,
    /// `lb_maglev`, with the M the programs were loaded with (`None`: pins of an lb without
    /// Maglev, opened read-only).
    pub maglev: Option<Array<MapData, u32>>,
    pub maglev_geometry: MaglevGeometry,
    /// Writes `hold_writes` held, in order per map.
    pub(crate) held: Option<Box<Held>>,
}

/// Writes `entries` into `map` in batches; where the kernel refuses a batch (one entry failed,
/// or no batch support), the rest go one by one, so the error is that entry's own.
fn write_all<K, V>(
    map: &mut HashMap<MapData, K, V>,
    name: &'static str,
    entries: &[(K, V)],
) -> Result<(), MapOpError>
where
    K: aya::Pod + bytemuck::Pod,
    V: aya::Pod + bytemuck::Pod,
{
    use std::os::fd::AsFd as _;

    use aya::maps::IterableMap as _;
    let done = match batch::update(map.map().fd().as_fd(), entries) {
        Ok(()) => return Ok(()),
        Err((_, done)) => done,
    };
    for (k, v) in entries.get(done..).unwrap_or_default() {
        map.insert(k, v, 0)
            .map_err(|e| MapOpError::from_aya(name, e))?;
    }
    Ok(())
}

impl BpfMaps {
    /// Writes whatever is held (before a delete, which must come after it).
    fn release_held(&mut self) -> Result<(), MapOpError> {
        let Some(h) = self.held.take() else {
            return Ok(());
        };
        let masters = h.finish_writers()?;
        write_all(&mut self.services4, map_names::SERVICES4, &masters.v4)?;
        write_all(&mut self.services6, map_names::SERVICES6, &masters.v6)?;
        write_all(&mut self.echo4, map_names::ECHO4, &masters.echo4)?;
        write_all(&mut self.echo6, map_names::ECHO6, &masters.echo6)
    }
}

impl LbMaps for BpfMaps {
    fn dump(&self) -> anyhow::Result<Dump> {
        let mut dump = Dump::default();
        self.dump_backends(&mut dump)?;
        self.dump_services(&mut dump)?;
        self.dump_maglev(&mut dump)?;
        self.dump_address_sets(&mut dump)?;
        self.dump_src_ranges(&mut dump)?;
        self.dump_aff_match(&mut dump)?;
        Ok(dump)
    }

    fn capacity(&self, table: Table, family: Family) -> u32 {
        self.capacities.get(&(table, family)).copied().unwrap_or(0)
    }

    fn put_backend(&mut self, id: u32, backend: &Backend) -> Result<(), MapOpError> {
        let l4 = &backend.l4;
        let (port, proto, state) = (l4.port, l4.proto.number(), backend.state as u8);
        match l4.addr {
            IpAddr::V4(a) => self.v4().put_backend(id, a.octets(), port, proto, state),
            IpAddr::V6(a) => self.v6().put_backend(id, a.octets(), port, proto, state),
        }
    }

    fn del_backend(&mut self, id: u32, family: Family) -> Result<(), MapOpError> {
        self.release_held()?;
        match family {
            Family::V4 => self.v4().del_backend(id),
            Family::V6 => self.v6().del_backend(id),
        }
    }

    fn put_revnat(&mut self, id: u32, addr: IpAddr, port: u16) -> Result<(), MapOpError> {
        match addr {
            IpAddr::V4(a) => self.v4().put_revnat(id, a.octets(), port),
            IpAddr::V6(a) => self.v6().put_revnat(id, a.octets(), port),
        }
    }

    fn del_revnat(&mut self, id: u32, family: Family) -> Result<(), MapOpError> {
        self.release_held()?;
        match family {
            Family::V4 => self.v4().del_revnat(id),
            Family::V6 => self.v6().del_revnat(id),
        }
    }

    fn put_service(
        &mut self,
        frontend: &Frontend,
        slot: u16,
        value: &SvcValue,
    ) -> Result<(), MapOpError> {
        let rest = svc_key_rest(frontend, slot);
        match frontend.l4.addr {
            IpAddr::V4(a) => self.v4().put_service(a.octets(), rest, value),
            IpAddr::V6(a) => self.v6().put_service(a.octets(), rest, value),
        }
    }

    fn del_service(&mut self, frontend: &Frontend, slot: u16) -> Result<(), MapOpError> {
        self.release_held()?;
        let rest = svc_key_rest(frontend, slot);
        match frontend.l4.addr {
            IpAddr::V4(a) => self.v4().del_service(a.octets(), rest),
            IpAddr::V6(a) => self.v6().del_service(a.octets(), rest),
        }
    }

    fn put_cluster_ip(&mut self, addr: IpAddr, frontends: u32) -> Result<(), MapOpError> {
        let v = ClusterIpValue { frontends };
        match addr {
            IpAddr::V4(a) => self.v4().put_cluster_ip(a.octets(), v),
            IpAddr::V6(a) => self.v6().put_cluster_ip(a.octets(), v),
        }
    }

    fn del_cluster_ip(&mut self, addr: IpAddr) -> Result<(), MapOpError> {
        self.release_held()?;
        match addr {
            IpAddr::V4(a) => self.v4().del_cluster_ip(a.octets()),
            IpAddr::V6(a) => self.v6().del_cluster_ip(a.octets()),
        }
    }

    fn put_src_range(&mut self, rev_nat_id: u32, cidr: &Cidr) -> Result<(), MapOpError> {
        match cidr.network() {
            IpAddr::V4(a) => self.v4().put_src_range(rev_nat_id, a.octets(), cidr.prefix),
            IpAddr::V6(a) => self.v6().put_src_range(rev_nat_id, a.octets(), cidr.prefix),
        }
    }

    fn del_src_range(&mut self, rev_nat_id: u32, cidr: &Cidr) -> Result<(), MapOpError> {
        match cidr.network() {
            IpAddr::V4(a) => self.v4().del_src_range(rev_nat_id, a.octets(), cidr.prefix),
            IpAddr::V6(a) => self.v6().del_src_range(rev_nat_id, a.octets(), cidr.prefix),
        }
    }

    fn put_aff_match(&mut self, entry: &AffMatch) -> Result<(), MapOpError> {
        let (map, name) = match entry.family {
            Family::V4 => (&mut self.aff_match4, map_names::AFF_MATCH4),
            Family::V6 => (&mut self.aff_match6, map_names::AFF_MATCH6),
        };
        map.insert(entry.key(), 1, 0)
            .map_err(|e| MapOpError::from_aya(name, e))
    }

    fn del_aff_match(&mut self, entry: &AffMatch) -> Result<(), MapOpError> {
        let (map, name) = match entry.family {
            Family::V4 => (&mut self.aff_match4, map_names::AFF_MATCH4),
            Family::V6 => (&mut self.aff_match6, map_names::AFF_MATCH6),
        };
        ignore_missing(map.remove(&entry.key())).map_err(|e| MapOpError::from_aya(name, e))
    }

    fn put_echo(&mut self, addr: IpAddr, value: EchoValue) -> Result<(), MapOpError> {
        match addr {
            IpAddr::V4(a) => self.v4().put_echo(a.octets(), value),
            IpAddr::V6(a) => self.v6().put_echo(a.octets(), value),
        }
    }

    fn del_echo(&mut self, addr: IpAddr) -> Result<(), MapOpError> {
        self.release_held()?;
        match addr {
            IpAddr::V4(a) => self.v4().del_echo(a.octets()),
            IpAddr::V6(a) => self.v6().del_echo(a.octets()),
        }
    }

    fn maglev_geometry(&self) -> MaglevGeometry {
        self.maglev_geometry
    }

    fn hold_writes(&mut self) {
        if self.held.is_some() {
            return;
        }
        let v4 = HeldMaps {
            cluster_ips: &self.cluster_ips4,
            backends: &self.backends4,
            revnat: &self.revnat4,
            services: &self.services4,
        };
        let v6 = HeldMaps {
            cluster_ips: &self.cluster_ips6,
            backends: &self.backends6,
            revnat: &self.revnat6,
            services: &self.services6,
        };
        // Without its threads or descriptors, writes go entry by entry as usual.
        match Held::new(&v4, &v6) {
            Ok(h) => self.held = Some(Box::new(h)),
            Err(e) => tracing::debug!(error = %e, "cannot hold map writes; writing entry by entry"),
        }
    }

    fn release_writes(&mut self) -> Result<(), MapOpError> {
        self.release_held()
    }

    fn put_maglev(&mut self, table: u32, cell: u32, id: u32) -> Result<(), MapOpError> {
        let g = self.maglev_geometry;
        let Some(maglev) = self
            .maglev
            .as_mut()
            .filter(|_| table < g.tables && cell < g.table_size)
        else {
            return Err(MapOpError::Full {
                map: map_names::MAGLEV,
            });
        };
        maglev
            .set(table * g.table_size + cell, id, 0)
            .map_err(|e| MapOpError::from_aya(map_names::MAGLEV, e))
    }
}

/// One family's maps of a [`BpfMaps`] and its side of the held writes: each write and delete
/// is written once here, over the family.
struct FamilyMaps<'a, F: MapFamily> {
    services: &'a mut HashMap<MapData, F::SvcKey, SvcValue>,
    backends: &'a mut HashMap<MapData, u32, F::Backend>,
    revnat: &'a mut HashMap<MapData, u32, F::RevNat>,
    cluster_ips: &'a mut HashMap<MapData, F::ClusterIpKey, ClusterIpValue>,
    src_ranges: &'a mut LpmTrie<MapData, F::SrcRange, u8>,
    echo: &'a mut HashMap<MapData, F::EchoKey, EchoValue>,
    held: Option<HeldFamily<'a, F>>,
}

impl BpfMaps {
    fn v4(&mut self) -> FamilyMaps<'_, V4> {
        FamilyMaps {
            services: &mut self.services4,
            backends: &mut self.backends4,
            revnat: &mut self.revnat4,
            cluster_ips: &mut self.cluster_ips4,
            src_ranges: &mut self.src_ranges4,
            echo: &mut self.echo4,
            held: self.held.as_deref_mut().map(Held::v4),
        }
    }

    fn v6(&mut self) -> FamilyMaps<'_, V6> {
        FamilyMaps {
            services: &mut self.services6,
            backends: &mut self.backends6,
            revnat: &mut self.revnat6,
            cluster_ips: &mut self.cluster_ips6,
            src_ranges: &mut self.src_ranges6,
            echo: &mut self.echo6,
            held: self.held.as_deref_mut().map(Held::v6),
        }
    }
}

/// Writes `k` → `v` into `map`, failing as `name`.
fn insert<K: aya::Pod, V: aya::Pod>(
    map: &mut HashMap<MapData, K, V>,
    name: &'static str,
    k: K,
    v: V,
) -> Result<(), MapOpError> {
    map.insert(k, v, 0)
        .map_err(|e| MapOpError::from_aya(name, e))
}

/// Deletes `k` from `map` (already gone: success), failing as `name`.
fn remove<K: aya::Pod, V: aya::Pod>(
    map: &mut HashMap<MapData, K, V>,
    name: &'static str,
    k: &K,
) -> Result<(), MapOpError> {
    ignore_missing(map.remove(k)).map_err(|e| MapOpError::from_aya(name, e))
}

/// The LPM key of a source range of frontend `rev_nat_id` (the id always matched whole).
fn src_range_key<F: MapFamily>(rev_nat_id: u32, addr: F::Addr, prefix: u8) -> LpmKey<F::SrcRange> {
    LpmKey::new(32 + u32::from(prefix), F::src_range(rev_nat_id, addr))
}

impl<F: MapFamily> FamilyMaps<'_, F> {
    fn put_backend(
        self,
        id: u32,
        addr: F::Addr,
        port: u16,
        proto: u8,
        state: u8,
    ) -> Result<(), MapOpError> {
        let v = F::backend(addr, port, proto, state);
        if let Some(mut h) = self.held {
            h.backend((id, v));
            return Ok(());
        }
        insert(self.backends, F::NAMES.backends, id, v)
    }

    fn del_backend(self, id: u32) -> Result<(), MapOpError> {
        remove(self.backends, F::NAMES.backends, &id)
    }

    fn put_revnat(self, id: u32, addr: F::Addr, port: u16) -> Result<(), MapOpError> {
        let v = F::revnat(addr, port);
        if let Some(mut h) = self.held {
            h.revnat((id, v));
            return Ok(());
        }
        insert(self.revnat, F::NAMES.revnat, id, v)
    }

    fn del_revnat(self, id: u32) -> Result<(), MapOpError> {
        remove(self.revnat, F::NAMES.revnat, &id)
    }

    fn put_service(self, addr: F::Addr, rest: SvcKeyRest, v: &SvcValue) -> Result<(), MapOpError> {
        let k = F::svc_key(addr, rest);
        if let Some(mut h) = self.held {
            let (.., slot) = rest;
            h.service(slot, (k, *v));
            return Ok(());
        }
        insert(self.services, F::NAMES.services, k, *v)
    }

    fn del_service(self, addr: F::Addr, rest: SvcKeyRest) -> Result<(), MapOpError> {
        remove(self.services, F::NAMES.services, &F::svc_key(addr, rest))
    }

    fn put_cluster_ip(self, addr: F::Addr, v: ClusterIpValue) -> Result<(), MapOpError> {
        let k = F::cluster_ip_key(addr);
        if let Some(mut h) = self.held {
            h.cluster_ip((k, v));
            return Ok(());
        }
        insert(self.cluster_ips, F::NAMES.cluster_ips, k, v)
    }

    fn del_cluster_ip(self, addr: F::Addr) -> Result<(), MapOpError> {
        let k = F::cluster_ip_key(addr);
        remove(self.cluster_ips, F::NAMES.cluster_ips, &k)
    }

    fn put_src_range(self, rev_nat_id: u32, addr: F::Addr, prefix: u8) -> Result<(), MapOpError> {
        self.src_ranges
            .insert(&src_range_key::<F>(rev_nat_id, addr, prefix), 1, 0)
            .map_err(|e| MapOpError::from_aya(F::NAMES.src_ranges, e))
    }

    fn del_src_range(self, rev_nat_id: u32, addr: F::Addr, prefix: u8) -> Result<(), MapOpError> {
        let k = src_range_key::<F>(rev_nat_id, addr, prefix);
        ignore_missing(self.src_ranges.remove(&k))
            .map_err(|e| MapOpError::from_aya(F::NAMES.src_ranges, e))
    }

    fn put_echo(self, addr: F::Addr, v: EchoValue) -> Result<(), MapOpError> {
        let k = F::echo_key(addr);
        if let Some(mut h) = self.held {
            h.echo((k, v));
            return Ok(());
        }
        insert(self.echo, F::NAMES.echo, k, v)
    }

    fn del_echo(self, addr: F::Addr) -> Result<(), MapOpError> {
        remove(self.echo, F::NAMES.echo, &F::echo_key(addr))
    }
}

/// Point lookups in the live maps, for views that must read what the datapath reads (trace).
impl BpfMaps {
    /// The backend id in `cell` of Maglev table `table`.
    pub fn maglev_cell(&self, table: u32, cell: u32) -> Option<u32> {
        let m = self.maglev_geometry.table_size;
        let index = u64::from(table) * u64::from(m) + u64::from(cell);
        self.maglev
            .as_ref()?
            .get(&u32::try_from(index).ok()?, 0)
            .ok()
    }

    /// The entry at `slot` of `fe` (0: the master).
    pub fn service(&self, fe: &Frontend, slot: u16) -> Option<SvcValue> {
        match fe.l4.addr {
            IpAddr::V4(a) => self.services4.get(&svc4_key(fe, a, slot), 0).ok(),
            IpAddr::V6(a) => self.services6.get(&svc6_key(fe, a, slot), 0).ok(),
        }
    }

    /// Backend `id`'s address and port.
    pub fn backend(&self, family: Family, id: u32) -> Option<SocketAddr> {
        match family {
            Family::V4 => self.backends4.get(&id, 0).ok().map(|b| {
                let addr = Ipv4Addr::from(b.addr);
                SocketAddr::new(addr.into(), b.port)
            }),
            Family::V6 => self.backends6.get(&id, 0).ok().map(|b| {
                let addr = Ipv6Addr::from(b.addr);
                SocketAddr::new(addr.into(), b.port)
            }),
        }
    }

    /// The frontend rev-NAT id `id` stands for.
    pub fn revnat(&self, family: Family, id: u32) -> Option<(IpAddr, u16)> {
        match family {
            Family::V4 => self.revnat4.get(&id, 0).ok().map(|r| {
                let addr = Ipv4Addr::from(r.addr);
                (addr.into(), r.port)
            }),
            Family::V6 => self.revnat6.get(&id, 0).ok().map(|r| {
                let addr = Ipv6Addr::from(r.addr);
                (addr.into(), r.port)
            }),
        }
    }

    /// The backends in `fe`'s slots `1..=count`: those a new flow can get.
    pub fn active_backends(&self, fe: &Frontend) -> Vec<SocketAddr> {
        let family = Family::of(&fe.l4.addr);
        let count = self.service(fe, 0).map_or(0, |m| m.count);
        (1..=count)
            .filter_map(|slot| self.service(fe, slot))
            .filter_map(|v| self.backend(family, v.backend_id))
            .collect()
    }
}

/// A backend as `dump` reads it from either family's map (`None`: a protocol lb does not
/// know, skipped).
fn backend_entry(
    name: &str,
    id: u32,
    addr: IpAddr,
    port: u16,
    proto: u8,
    state: u8,
) -> anyhow::Result<Option<Backend>> {
    let Some(proto) = Proto::from_number(proto) else {
        return Ok(None);
    };
    let state = BackendState::try_from(state).with_context(|| format!("{name} entry {id}"))?;
    let l4 = L4Addr { addr, port, proto };
    Ok(Some(Backend { l4, state }))
}

/// A frontend as `dump` reads it from either family's service key (`None`: a protocol lb
/// does not know, skipped).
fn frontend_entry(
    name: &str,
    addr: IpAddr,
    port: u16,
    proto: u8,
    scope: u8,
) -> anyhow::Result<Option<Frontend>> {
    let Some(proto) = Proto::from_number(proto) else {
        return Ok(None);
    };
    let scope = Scope::try_from(scope).with_context(|| format!("{name} key {addr} {port}"))?;
    Ok(Some(Frontend {
        l4: L4Addr { addr, port, proto },
        scope,
    }))
}

/// `LbMaps::dump`'s parts, a table each.
impl BpfMaps {
    fn dump_backends(&self, dump: &mut Dump) -> anyhow::Result<()> {
        read_backends::<V4>(&self.backends4, dump)?;
        read_backends::<V6>(&self.backends6, dump)?;
        read_revnat::<V4>(&self.revnat4, dump)?;
        read_revnat::<V6>(&self.revnat6, dump)
    }

    fn dump_services(&self, dump: &mut Dump) -> anyhow::Result<()> {
        read_services::<V4>(&self.services4, dump)?;
        read_services::<V6>(&self.services6, dump)
    }

    /// The tables the masters in `dump` name.
    fn dump_maglev(&self, dump: &mut Dump) -> anyhow::Result<()> {
        let tables: BTreeSet<u32> = dump
            .services
            .iter()
            .filter(|((_, slot), _)| *slot == 0)
            .filter_map(|(_, v)| maglev_table_of(v))
            .filter(|t| *t < self.maglev_geometry.tables)
            .collect();
        let m = self.maglev_geometry.table_size;
        for t in tables {
            let Some(maglev) = &self.maglev else { break };
            let cells = (0..m)
                .map(|c| maglev.get(&(t * m + c), 0))
                .collect::<Result<Vec<u32>, _>>()
                .with_context(|| format!("reading {} table {t}", map_names::MAGLEV))?;
            dump.maglev.insert(t, cells);
        }
        Ok(())
    }

    /// The ClusterIP set and the echo table.
    fn dump_address_sets(&self, dump: &mut Dump) -> anyhow::Result<()> {
        read_cluster_ips::<V4>(&self.cluster_ips4, dump)?;
        read_cluster_ips::<V6>(&self.cluster_ips6, dump)
    }

    fn dump_src_ranges(&self, dump: &mut Dump) -> anyhow::Result<()> {
        read_src_ranges::<V4>(&self.src_ranges4, dump)?;
        read_src_ranges::<V6>(&self.src_ranges6, dump)?;
        read_echo::<V4>(&self.echo4, dump)?;
        read_echo::<V6>(&self.echo6, dump)
    }

    fn dump_aff_match(&self, dump: &mut Dump) -> anyhow::Result<()> {
        for (family, map, name) in [
            (Family::V4, &self.aff_match4, map_names::AFF_MATCH4),
            (Family::V6, &self.aff_match6, map_names::AFF_MATCH6),
        ] {
            for k in map.keys() {
                let k = k?;
                let scope =
                    Scope::try_from(k.scope).with_context(|| format!("{name} key {k:?}"))?;
                dump.aff_match.insert(AffMatch {
                    family,
                    rev_nat_id: k.rev_nat_id,
                    scope,
                    backend_id: k.backend_id,
                });
            }
        }
        Ok(())
    }
}

/// Reads one family's backends into `dump`.
fn read_backends<F: MapFamily>(
    map: &HashMap<MapData, u32, F::Backend>,
    dump: &mut Dump,
) -> anyhow::Result<()> {
    let name = F::NAMES.backends;
    batch::each_entry(map, name, |id, b| {
        let (addr, port, proto, state) = F::backend_fields(&b);
        if let Some(b) = backend_entry(name, id, F::ip(addr), port, proto, state)? {
            dump.backends.insert(id, b);
        }
        Ok(())
    })
}

/// Reads one family's rev-NAT entries into `dump`.
fn read_revnat<F: MapFamily>(
    map: &HashMap<MapData, u32, F::RevNat>,
    dump: &mut Dump,
) -> anyhow::Result<()> {
    batch::each_entry(map, F::NAMES.revnat, |id, r| {
        let (addr, port) = F::revnat_fields(&r);
        dump.revnat.insert(id, (F::ip(addr), port));
        Ok(())
    })
}

/// Reads one family's service entries into `dump`.
fn read_services<F: MapFamily>(
    map: &HashMap<MapData, F::SvcKey, SvcValue>,
    dump: &mut Dump,
) -> anyhow::Result<()> {
    let name = F::NAMES.services;
    batch::each_entry(map, name, |k, v| {
        let (addr, (port, proto, scope, slot)) = F::svc_key_fields(&k);
        if let Some(fe) = frontend_entry(name, F::ip(addr), port, proto, scope)? {
            dump.services.insert((fe, slot), v);
        }
        Ok(())
    })
}

/// Reads one family's ClusterIP set into `dump`.
fn read_cluster_ips<F: MapFamily>(
    map: &HashMap<MapData, F::ClusterIpKey, ClusterIpValue>,
    dump: &mut Dump,
) -> anyhow::Result<()> {
    batch::each_entry(map, F::NAMES.cluster_ips, |k, v| {
        dump.cluster_ips
            .insert(F::ip(F::cluster_ip_addr(&k)), v.frontends);
        Ok(())
    })
}

/// Reads one family's source ranges into `dump`.
fn read_src_ranges<F: MapFamily>(
    map: &LpmTrie<MapData, F::SrcRange, u8>,
    dump: &mut Dump,
) -> anyhow::Result<()> {
    for k in map.keys() {
        let k = k?;
        let (rev_nat_id, addr) = F::src_range_fields(&k.data());
        let prefix = k.prefix_len().saturating_sub(32).min(F::BITS.into()) as u8;
        let addr = F::ip(addr);
        dump.src_ranges.insert((rev_nat_id, Cidr { addr, prefix }));
    }
    Ok(())
}

/// Reads one family's echo table into `dump`.
fn read_echo<F: MapFamily>(
    map: &HashMap<MapData, F::EchoKey, EchoValue>,
    dump: &mut Dump,
) -> anyhow::Result<()> {
    batch::each_entry(map, F::NAMES.echo, |k, v| {
        dump.echo.insert(F::ip(F::echo_addr(&k)), v);
        Ok(())
    })
}

/// Deleting what is already gone is success.
fn ignore_missing(r: Result<(), MapError>) -> Result<(), MapError> {
    match r {
        Err(MapError::KeyNotFound) => Ok(()),
        Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::ENOENT) => Ok(()),
        other => other,
    }
}

/// An `lb*_echo` value as `internal=… external=…`.
pub fn echo_text(v: &EchoValue) -> String {
    format!(
        "internal={} external={}",
        echo_name(v.internal),
        echo_name(v.external)
    )
}

/// The name of an `echo` verdict.
pub fn echo_name(verdict: u8) -> &'static str {
    match verdict {
        echo::NONE => "pass",
        echo::ANSWER => "answer",
        echo::REJECT => "reject",
        echo::DROP => "drop",
        _ => "unknown",
    }
}

/// Counts a hash map's keys by walking them, at most `max` (its capacity). Entries the datapath
/// deletes during the walk can restart it from the first key, so the bound keeps it finite; the
/// result is a snapshot, not exact under churn.
pub fn count_keys<K: aya::Pod, V: aya::Pod>(
    map: &HashMap<MapData, K, V>,
    max: u32,
) -> Result<u64, MapError> {
    let mut n = 0u64;
    for key in map.keys() {
        key?;
        n += 1;
        if n >= u64::from(max) {
            break;
        }
    }
    Ok(n)
}

/// Packets and bytes of datapath counter `index` (a `lb_common::metrics` index), summed over
/// CPUs; wrapping, as the kernel's per-CPU counters do.
pub fn read_counter(
    map: &PerCpuArray<MapData, MetricValue>,
    index: u32,
) -> Result<(u64, u64), MapError> {
    let values = map.get(&index, 0)?;
    Ok(values.iter().fold((0u64, 0u64), |(p, b), v| {
        (p.wrapping_add(v.packets), b.wrapping_add(v.bytes))
    }))
}
