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

/// The LPM key of source range `cidr` of frontend `rev_nat_id` (the id always matched whole).
fn src_range4_key(rev_nat_id: u32, cidr: &Cidr) -> Option<LpmKey<SrcRange4>> {
    match cidr.network() {
        IpAddr::V4(a) => Some(LpmKey::new(
            32 + u32::from(cidr.prefix),
            SrcRange4 {
                rev_nat_id: rev_nat_id.to_be_bytes(),
                addr: a.octets(),
            },
        )),
        IpAddr::V6(_) => None,
    }
}

fn src_range6_key(rev_nat_id: u32, cidr: &Cidr) -> Option<LpmKey<SrcRange6>> {
    match cidr.network() {
        IpAddr::V6(a) => Some(LpmKey::new(
            32 + u32::from(cidr.prefix),
            SrcRange6 {
                rev_nat_id: rev_nat_id.to_be_bytes(),
                addr: a.octets(),
            },
        )),
        IpAddr::V4(_) => None,
    }
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
    /// Holds the ClusterIP, backend, rev-NAT and service writes that follow until
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
    Svc4Key {
        addr: addr.octets(),
        port: fe.l4.port,
        slot,
        proto: fe.l4.proto.number(),
        scope: fe.scope as u8,
        pad: [0; 2],
    }
}

/// The `lb6_services` key of `fe`'s `slot`.
pub fn svc6_key(fe: &Frontend, addr: Ipv6Addr, slot: u16) -> Svc6Key {
    Svc6Key {
        addr: addr.octets(),
        port: fe.l4.port,
        slot,
        proto: fe.l4.proto.number(),
        scope: fe.scope as u8,
        pad: [0; 2],
    }
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
    pub(crate) held: Option<Box<super::held::Held>>,
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
    let done = match super::batch::update(map.map().fd().as_fd(), entries) {
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
        write_all(&mut self.services6, map_names::SERVICES6, &masters.v6)
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
        let (proto, port, state) = (
            backend.l4.proto.number(),
            backend.l4.port,
            backend.state as u8,
        );
        match backend.l4.addr {
            IpAddr::V4(a) => {
                let v = Backend4 {
                    addr: a.octets(),
                    port,
                    proto,
                    state,
                };
                if let Some(h) = &mut self.held {
                    h.backend4((id, v));
                    return Ok(());
                }
                self.backends4
                    .insert(id, v, 0)
                    .map_err(|e| MapOpError::from_aya(map_names::BACKENDS4, e))
            }
            IpAddr::V6(a) => {
                let v = Backend6 {
                    addr: a.octets(),
                    port,
                    proto,
                    state,
                };
                if let Some(h) = &mut self.held {
                    h.backend6((id, v));
                    return Ok(());
                }
                self.backends6
                    .insert(id, v, 0)
                    .map_err(|e| MapOpError::from_aya(map_names::BACKENDS6, e))
            }
        }
    }

    fn del_backend(&mut self, id: u32, family: Family) -> Result<(), MapOpError> {
        self.release_held()?;
        match family {
            Family::V4 => ignore_missing(self.backends4.remove(&id))
                .map_err(|e| MapOpError::from_aya(map_names::BACKENDS4, e)),
            Family::V6 => ignore_missing(self.backends6.remove(&id))
                .map_err(|e| MapOpError::from_aya(map_names::BACKENDS6, e)),
        }
    }

    fn put_revnat(&mut self, id: u32, addr: IpAddr, port: u16) -> Result<(), MapOpError> {
        match addr {
            IpAddr::V4(a) => {
                let v = RevNat4 {
                    addr: a.octets(),
                    port,
                    pad: 0,
                };
                if let Some(h) = &mut self.held {
                    h.revnat4((id, v));
                    return Ok(());
                }
                self.revnat4
                    .insert(id, v, 0)
                    .map_err(|e| MapOpError::from_aya(map_names::REVNAT4, e))
            }
            IpAddr::V6(a) => {
                let v = RevNat6 {
                    addr: a.octets(),
                    port,
                    pad: 0,
                };
                if let Some(h) = &mut self.held {
                    h.revnat6((id, v));
                    return Ok(());
                }
                self.revnat6
                    .insert(id, v, 0)
                    .map_err(|e| MapOpError::from_aya(map_names::REVNAT6, e))
            }
        }
    }

    fn del_revnat(&mut self, id: u32, family: Family) -> Result<(), MapOpError> {
        self.release_held()?;
        match family {
            Family::V4 => ignore_missing(self.revnat4.remove(&id))
                .map_err(|e| MapOpError::from_aya(map_names::REVNAT4, e)),
            Family::V6 => ignore_missing(self.revnat6.remove(&id))
                .map_err(|e| MapOpError::from_aya(map_names::REVNAT6, e)),
        }
    }

    fn put_service(
        &mut self,
        frontend: &Frontend,
        slot: u16,
        value: &SvcValue,
    ) -> Result<(), MapOpError> {
        if let Some(h) = &mut self.held {
            match frontend.l4.addr {
                IpAddr::V4(a) if slot == 0 => h.masters.v4.push((svc4_key(frontend, a, 0), *value)),
                IpAddr::V4(a) => h.slot4((svc4_key(frontend, a, slot), *value)),
                IpAddr::V6(a) if slot == 0 => h.masters.v6.push((svc6_key(frontend, a, 0), *value)),
                IpAddr::V6(a) => h.slot6((svc6_key(frontend, a, slot), *value)),
            }
            return Ok(());
        }
        match frontend.l4.addr {
            IpAddr::V4(a) => self
                .services4
                .insert(svc4_key(frontend, a, slot), value, 0)
                .map_err(|e| MapOpError::from_aya(map_names::SERVICES4, e)),
            IpAddr::V6(a) => self
                .services6
                .insert(svc6_key(frontend, a, slot), value, 0)
                .map_err(|e| MapOpError::from_aya(map_names::SERVICES6, e)),
        }
    }

    fn del_service(&mut self, frontend: &Frontend, slot: u16) -> Result<(), MapOpError> {
        self.release_held()?;
        match frontend.l4.addr {
            IpAddr::V4(a) => ignore_missing(self.services4.remove(&svc4_key(frontend, a, slot)))
                .map_err(|e| MapOpError::from_aya(map_names::SERVICES4, e)),
            IpAddr::V6(a) => ignore_missing(self.services6.remove(&svc6_key(frontend, a, slot)))
                .map_err(|e| MapOpError::from_aya(map_names::SERVICES6, e)),
        }
    }

    fn put_cluster_ip(&mut self, addr: IpAddr, frontends: u32) -> Result<(), MapOpError> {
        let v = ClusterIpValue { frontends };
        if let Some(h) = &mut self.held {
            match addr {
                IpAddr::V4(a) => h.cluster_ip4((ClusterIp4Key { addr: a.octets() }, v)),
                IpAddr::V6(a) => h.cluster_ip6((ClusterIp6Key { addr: a.octets() }, v)),
            }
            return Ok(());
        }
        match addr {
            IpAddr::V4(a) => self
                .cluster_ips4
                .insert(ClusterIp4Key { addr: a.octets() }, v, 0)
                .map_err(|e| MapOpError::from_aya(map_names::CLUSTER_IPS4, e)),
            IpAddr::V6(a) => self
                .cluster_ips6
                .insert(ClusterIp6Key { addr: a.octets() }, v, 0)
                .map_err(|e| MapOpError::from_aya(map_names::CLUSTER_IPS6, e)),
        }
    }

    fn del_cluster_ip(&mut self, addr: IpAddr) -> Result<(), MapOpError> {
        self.release_held()?;
        match addr {
            IpAddr::V4(a) => ignore_missing(
                self.cluster_ips4
                    .remove(&ClusterIp4Key { addr: a.octets() }),
            )
            .map_err(|e| MapOpError::from_aya(map_names::CLUSTER_IPS4, e)),
            IpAddr::V6(a) => ignore_missing(
                self.cluster_ips6
                    .remove(&ClusterIp6Key { addr: a.octets() }),
            )
            .map_err(|e| MapOpError::from_aya(map_names::CLUSTER_IPS6, e)),
        }
    }

    fn put_src_range(&mut self, rev_nat_id: u32, cidr: &Cidr) -> Result<(), MapOpError> {
        if let Some(k) = src_range4_key(rev_nat_id, cidr) {
            self.src_ranges4
                .insert(&k, 1, 0)
                .map_err(|e| MapOpError::from_aya(map_names::SRC_RANGE4, e))
        } else if let Some(k) = src_range6_key(rev_nat_id, cidr) {
            self.src_ranges6
                .insert(&k, 1, 0)
                .map_err(|e| MapOpError::from_aya(map_names::SRC_RANGE6, e))
        } else {
            Ok(())
        }
    }

    fn del_src_range(&mut self, rev_nat_id: u32, cidr: &Cidr) -> Result<(), MapOpError> {
        if let Some(k) = src_range4_key(rev_nat_id, cidr) {
            ignore_missing(self.src_ranges4.remove(&k))
                .map_err(|e| MapOpError::from_aya(map_names::SRC_RANGE4, e))
        } else if let Some(k) = src_range6_key(rev_nat_id, cidr) {
            ignore_missing(self.src_ranges6.remove(&k))
                .map_err(|e| MapOpError::from_aya(map_names::SRC_RANGE6, e))
        } else {
            Ok(())
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
            IpAddr::V4(a) => self
                .echo4
                .insert(EchoKey4 { addr: a.octets() }, value, 0)
                .map_err(|e| MapOpError::from_aya(map_names::ECHO4, e)),
            IpAddr::V6(a) => self
                .echo6
                .insert(EchoKey6 { addr: a.octets() }, value, 0)
                .map_err(|e| MapOpError::from_aya(map_names::ECHO6, e)),
        }
    }

    fn del_echo(&mut self, addr: IpAddr) -> Result<(), MapOpError> {
        match addr {
            IpAddr::V4(a) => ignore_missing(self.echo4.remove(&EchoKey4 { addr: a.octets() }))
                .map_err(|e| MapOpError::from_aya(map_names::ECHO4, e)),
            IpAddr::V6(a) => ignore_missing(self.echo6.remove(&EchoKey6 { addr: a.octets() }))
                .map_err(|e| MapOpError::from_aya(map_names::ECHO6, e)),
        }
    }

    fn maglev_geometry(&self) -> MaglevGeometry {
        self.maglev_geometry
    }

    fn hold_writes(&mut self) {
        if self.held.is_some() {
            return;
        }
        // Without its threads or descriptors, writes go entry by entry as usual.
        let maps = super::held::HeldMaps {
            cluster_ips4: &self.cluster_ips4,
            cluster_ips6: &self.cluster_ips6,
            backends4: &self.backends4,
            backends6: &self.backends6,
            revnat4: &self.revnat4,
            revnat6: &self.revnat6,
            services4: &self.services4,
            services6: &self.services6,
        };
        match super::held::Held::new(&maps) {
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
        for item in self.backends4.iter() {
            let (id, b) = item?;
            let addr = Ipv4Addr::from(b.addr).into();
            let name = map_names::BACKENDS4;
            if let Some(b) = backend_entry(name, id, addr, b.port, b.proto, b.state)? {
                dump.backends.insert(id, b);
            }
        }
        for item in self.backends6.iter() {
            let (id, b) = item?;
            let addr = Ipv6Addr::from(b.addr).into();
            let name = map_names::BACKENDS6;
            if let Some(b) = backend_entry(name, id, addr, b.port, b.proto, b.state)? {
                dump.backends.insert(id, b);
            }
        }
        for item in self.revnat4.iter() {
            let (id, r) = item?;
            dump.revnat
                .insert(id, (Ipv4Addr::from(r.addr).into(), r.port));
        }
        for item in self.revnat6.iter() {
            let (id, r) = item?;
            dump.revnat
                .insert(id, (Ipv6Addr::from(r.addr).into(), r.port));
        }
        Ok(())
    }

    fn dump_services(&self, dump: &mut Dump) -> anyhow::Result<()> {
        for item in self.services4.iter() {
            let (k, v) = item?;
            let addr = Ipv4Addr::from(k.addr).into();
            let name = map_names::SERVICES4;
            if let Some(fe) = frontend_entry(name, addr, k.port, k.proto, k.scope)? {
                dump.services.insert((fe, k.slot), v);
            }
        }
        for item in self.services6.iter() {
            let (k, v) = item?;
            let addr = Ipv6Addr::from(k.addr).into();
            let name = map_names::SERVICES6;
            if let Some(fe) = frontend_entry(name, addr, k.port, k.proto, k.scope)? {
                dump.services.insert((fe, k.slot), v);
            }
        }
        Ok(())
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
        for item in self.cluster_ips4.iter() {
            let (k, v) = item?;
            dump.cluster_ips
                .insert(Ipv4Addr::from(k.addr).into(), v.frontends);
        }
        for item in self.cluster_ips6.iter() {
            let (k, v) = item?;
            dump.cluster_ips
                .insert(Ipv6Addr::from(k.addr).into(), v.frontends);
        }
        Ok(())
    }

    fn dump_src_ranges(&self, dump: &mut Dump) -> anyhow::Result<()> {
        for k in self.src_ranges4.keys() {
            let k = k?;
            let d = k.data();
            let prefix = k.prefix_len().saturating_sub(32).min(32) as u8;
            let addr = Ipv4Addr::from(d.addr).into();
            dump.src_ranges
                .insert((u32::from_be_bytes(d.rev_nat_id), Cidr { addr, prefix }));
        }
        for k in self.src_ranges6.keys() {
            let k = k?;
            let d = k.data();
            let prefix = k.prefix_len().saturating_sub(32).min(128) as u8;
            let addr = Ipv6Addr::from(d.addr).into();
            dump.src_ranges
                .insert((u32::from_be_bytes(d.rev_nat_id), Cidr { addr, prefix }));
        }
        for item in self.echo4.iter() {
            let (k, v) = item?;
            dump.echo.insert(Ipv4Addr::from(k.addr).into(), v);
        }
        for item in self.echo6.iter() {
            let (k, v) = item?;
            dump.echo.insert(Ipv6Addr::from(k.addr).into(), v);
        }
        Ok(())
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
