//! Typed access to the service, backend and rev-NAT maps of both families, behind a trait so
//! the reconciler runs the same against the kernel's maps and against an in-memory model in
//! unit tests.
use std::{
    collections::BTreeMap,
    fmt::Write as _,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use aya::maps::{HashMap, MapData, MapError};
use lb_common::{
    Backend4, Backend6, ClusterIp4Key, ClusterIp6Key, ClusterIpValue, RevNat4, RevNat6, Svc4Key,
    Svc6Key, SvcValue, backend_state, map_names, scope, svc_flags,
};

use crate::model::{Backend, Frontend, L4Addr, Proto};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    pub fn of(addr: &IpAddr) -> Self {
        match addr {
            IpAddr::V4(_) => Family::V4,
            IpAddr::V6(_) => Family::V6,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Table {
    Services,
    Backends,
    RevNat,
    /// The ClusterIP set (`lb*_cluster_ips`).
    ClusterIps,
}

impl Table {
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
        }
    }
}

/// A failed map write or delete.
#[derive(Debug, thiserror::Error)]
pub enum MapOpError {
    #[error("map {map} is full")]
    Full { map: &'static str },
    #[error("map {map}: {source}")]
    Other {
        map: &'static str,
        #[source]
        source: MapError,
    },
}

impl MapOpError {
    fn from_aya(map: &'static str, source: MapError) -> Self {
        if let MapError::SyscallError(e) = &source
            && e.io_error.raw_os_error() == Some(libc::E2BIG)
        {
            return MapOpError::Full { map };
        }
        MapOpError::Other { map, source }
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
}

fn svc4_key(fe: &Frontend, addr: Ipv4Addr, slot: u16) -> Svc4Key {
    Svc4Key {
        addr: addr.octets(),
        port: fe.l4.port,
        slot,
        proto: fe.l4.proto.number(),
        scope: fe.scope,
        pad: [0; 2],
    }
}

fn svc6_key(fe: &Frontend, addr: Ipv6Addr, slot: u16) -> Svc6Key {
    Svc6Key {
        addr: addr.octets(),
        port: fe.l4.port,
        slot,
        proto: fe.l4.proto.number(),
        scope: fe.scope,
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
    pub capacities: BTreeMap<(Table, Family), u32>,
}

impl LbMaps for BpfMaps {
    fn dump(&self) -> anyhow::Result<Dump> {
        let mut dump = Dump::default();
        for item in self.backends4.iter() {
            let (id, b) = item?;
            if let Some(proto) = Proto::from_number(b.proto) {
                let l4 = L4Addr {
                    addr: Ipv4Addr::from(b.addr).into(),
                    port: b.port,
                    proto,
                };
                dump.backends.insert(id, Backend { l4, state: b.state });
            }
        }
        for item in self.backends6.iter() {
            let (id, b) = item?;
            if let Some(proto) = Proto::from_number(b.proto) {
                let l4 = L4Addr {
                    addr: Ipv6Addr::from(b.addr).into(),
                    port: b.port,
                    proto,
                };
                dump.backends.insert(id, Backend { l4, state: b.state });
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
        for item in self.services4.iter() {
            let (k, v) = item?;
            if let Some(proto) = Proto::from_number(k.proto) {
                let fe = Frontend {
                    l4: L4Addr {
                        addr: Ipv4Addr::from(k.addr).into(),
                        port: k.port,
                        proto,
                    },
                    scope: k.scope,
                };
                dump.services.insert((fe, k.slot), v);
            }
        }
        for item in self.services6.iter() {
            let (k, v) = item?;
            if let Some(proto) = Proto::from_number(k.proto) {
                let fe = Frontend {
                    l4: L4Addr {
                        addr: Ipv6Addr::from(k.addr).into(),
                        port: k.port,
                        proto,
                    },
                    scope: k.scope,
                };
                dump.services.insert((fe, k.slot), v);
            }
        }
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
        Ok(dump)
    }

    fn capacity(&self, table: Table, family: Family) -> u32 {
        self.capacities.get(&(table, family)).copied().unwrap_or(0)
    }

    fn put_backend(&mut self, id: u32, backend: &Backend) -> Result<(), MapOpError> {
        let (proto, port, state) = (backend.l4.proto.number(), backend.l4.port, backend.state);
        match backend.l4.addr {
            IpAddr::V4(a) => {
                let v = Backend4 {
                    addr: a.octets(),
                    port,
                    proto,
                    state,
                };
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
                self.backends6
                    .insert(id, v, 0)
                    .map_err(|e| MapOpError::from_aya(map_names::BACKENDS6, e))
            }
        }
    }

    fn del_backend(&mut self, id: u32, family: Family) -> Result<(), MapOpError> {
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
                self.revnat6
                    .insert(id, v, 0)
                    .map_err(|e| MapOpError::from_aya(map_names::REVNAT6, e))
            }
        }
    }

    fn del_revnat(&mut self, id: u32, family: Family) -> Result<(), MapOpError> {
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
        match frontend.l4.addr {
            IpAddr::V4(a) => ignore_missing(self.services4.remove(&svc4_key(frontend, a, slot)))
                .map_err(|e| MapOpError::from_aya(map_names::SERVICES4, e)),
            IpAddr::V6(a) => ignore_missing(self.services6.remove(&svc6_key(frontend, a, slot)))
                .map_err(|e| MapOpError::from_aya(map_names::SERVICES6, e)),
        }
    }

    fn put_cluster_ip(&mut self, addr: IpAddr, frontends: u32) -> Result<(), MapOpError> {
        let v = ClusterIpValue { frontends };
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
}

/// Deleting what is already gone is success.
fn ignore_missing(r: Result<(), MapError>) -> Result<(), MapError> {
    match r {
        Err(MapError::KeyNotFound) => Ok(()),
        Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::ENOENT) => Ok(()),
        other => other,
    }
}

/// An in-memory stand-in with the kernel maps' capacity semantics, for reconciler unit tests
/// (the datapath itself is always tested against the kernel).
#[derive(Clone, Debug, Default)]
pub struct MemMaps {
    pub dump: Dump,
    pub capacities: BTreeMap<(Table, Family), u32>,
    /// Every write and delete, in order, for ordering assertions.
    pub log: Vec<String>,
}

impl MemMaps {
    pub fn with_capacity(n: u32) -> Self {
        let mut capacities = BTreeMap::new();
        for t in [
            Table::Services,
            Table::Backends,
            Table::RevNat,
            Table::ClusterIps,
        ] {
            for f in [Family::V4, Family::V6] {
                capacities.insert((t, f), n);
            }
        }
        Self {
            capacities,
            ..Self::default()
        }
    }

    fn len(&self, table: Table, family: Family) -> usize {
        match table {
            Table::Services => self
                .dump
                .services
                .keys()
                .filter(|(fe, _)| Family::of(&fe.l4.addr) == family)
                .count(),
            Table::Backends => self
                .dump
                .backends
                .values()
                .filter(|b| Family::of(&b.l4.addr) == family)
                .count(),
            Table::RevNat => self
                .dump
                .revnat
                .values()
                .filter(|(a, _)| Family::of(a) == family)
                .count(),
            Table::ClusterIps => self
                .dump
                .cluster_ips
                .keys()
                .filter(|a| Family::of(a) == family)
                .count(),
        }
    }

    fn check_room(&self, table: Table, family: Family, exists: bool) -> Result<(), MapOpError> {
        if !exists && self.len(table, family) >= self.capacity(table, family) as usize {
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
        self.log.push(format!("put backend {id} {}", backend.l4));
        self.dump.backends.insert(id, *backend);
        Ok(())
    }

    fn del_backend(&mut self, id: u32, _family: Family) -> Result<(), MapOpError> {
        self.log.push(format!("del backend {id}"));
        self.dump.backends.remove(&id);
        Ok(())
    }

    fn put_revnat(&mut self, id: u32, addr: IpAddr, port: u16) -> Result<(), MapOpError> {
        let family = Family::of(&addr);
        self.check_room(Table::RevNat, family, self.dump.revnat.contains_key(&id))?;
        self.log.push(format!("put revnat {id}"));
        self.dump.revnat.insert(id, (addr, port));
        Ok(())
    }

    fn del_revnat(&mut self, id: u32, _family: Family) -> Result<(), MapOpError> {
        self.log.push(format!("del revnat {id}"));
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
        self.log.push(format!(
            "put service {frontend} slot {slot} backend {} count {}",
            value.backend_id, value.count
        ));
        self.dump.services.insert((*frontend, slot), *value);
        Ok(())
    }

    fn del_service(&mut self, frontend: &Frontend, slot: u16) -> Result<(), MapOpError> {
        self.log.push(format!("del service {frontend} slot {slot}"));
        self.dump.services.remove(&(*frontend, slot));
        Ok(())
    }

    fn put_cluster_ip(&mut self, addr: IpAddr, frontends: u32) -> Result<(), MapOpError> {
        let exists = self.dump.cluster_ips.contains_key(&addr);
        self.check_room(Table::ClusterIps, Family::of(&addr), exists)?;
        self.log
            .push(format!("put cluster-ip {addr} frontends {frontends}"));
        self.dump.cluster_ips.insert(addr, frontends);
        Ok(())
    }

    fn del_cluster_ip(&mut self, addr: IpAddr) -> Result<(), MapOpError> {
        self.log.push(format!("del cluster-ip {addr}"));
        self.dump.cluster_ips.remove(&addr);
        Ok(())
    }
}

/// Name of a `backend_state` value.
pub fn state_name(state: u8) -> &'static str {
    match state {
        backend_state::ACTIVE => "active",
        backend_state::TERMINATING => "terminating",
        backend_state::QUARANTINED => "quarantined",
        backend_state::MAINTENANCE => "maintenance",
        _ => "unknown",
    }
}

/// Names of the set `svc_flags` bits, `|`-joined.
pub fn flag_names(flags: u16) -> String {
    const NAMES: [(u16, &str); 9] = [
        (svc_flags::CLUSTER_IP, "ClusterIP"),
        (svc_flags::NODE_PORT, "NodePort"),
        (svc_flags::EXTERNAL_IP, "ExternalIP"),
        (svc_flags::LOAD_BALANCER, "LoadBalancer"),
        (svc_flags::AFFINITY, "Affinity"),
        (svc_flags::EXT_LOCAL, "ExtLocal"),
        (svc_flags::INT_LOCAL, "IntLocal"),
        (svc_flags::TWO_SCOPES, "TwoScopes"),
        (svc_flags::SOURCE_RANGES, "SourceRanges"),
    ];
    let names: Vec<_> = NAMES
        .iter()
        .filter(|(bit, _)| flags & bit != 0)
        .map(|(_, n)| *n)
        .collect();
    if names.is_empty() {
        "-".into()
    } else {
        names.join("|")
    }
}

/// A stable, human-readable rendering of the maps: one block per frontend with its slots
/// resolved to backend addresses, then orphans (entries nothing points to). Golden tests
/// compare against it.
pub fn render(dump: &Dump) -> String {
    let mut out = String::new();
    let mut referenced_backends = std::collections::BTreeSet::new();
    let mut referenced_revnat = std::collections::BTreeSet::new();
    for ((fe, slot), v) in &dump.services {
        if *slot != 0 {
            continue;
        }
        referenced_revnat.insert(v.rev_nat_id);
        let scope = if fe.scope == scope::INTERNAL {
            " scope=internal"
        } else {
            ""
        };
        let revnat = match dump.revnat.get(&v.rev_nat_id) {
            Some((a, p)) if (*a, *p) == (fe.l4.addr, fe.l4.port) => "ok".to_string(),
            Some((a, p)) => format!("MISMATCH {a}:{p}"),
            None => "MISSING".to_string(),
        };
        let _ = writeln!(
            out,
            "{}{scope} flags={} count={} qcount={} revnat={}({revnat})",
            fe.l4,
            flag_names(v.flags),
            v.count,
            v.qcount,
            v.rev_nat_id
        );
        for s in 1..=v.slots() {
            match dump.services.get(&(*fe, s)) {
                Some(sv) => {
                    referenced_backends.insert(sv.backend_id);
                    match dump.backends.get(&sv.backend_id) {
                        Some(b) => {
                            let _ = writeln!(out, "  slot {s}: {} {}", b.l4, state_name(b.state));
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
    out
}
