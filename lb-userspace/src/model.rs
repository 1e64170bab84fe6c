//! The desired datapath state: what the maps should hold, independent of how it is stored.
//! Sources (manifest files, the Kubernetes API) are translated into a `DesiredState` by a pure
//! function; the reconciler makes the maps match it.
use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    net::IpAddr,
};

use lb_common::{IPPROTO_SCTP, IPPROTO_TCP, IPPROTO_UDP, backend_state, scope, svc_flags};

pub use crate::node::Cidr;

/// A value read from a map that this lb has no name for (a map written by another lb).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown {what} {value}")]
pub struct UnknownValue {
    pub what: &'static str,
    pub value: u8,
}

/// An address family.
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

    /// The family of an EndpointSlice's `addressType` or a Service's `ipFamilies` entry
    /// (`IPv4`, `IPv6`); `None` for anything else (`FQDN`).
    pub fn from_k8s(s: &str) -> Option<Self> {
        match s {
            "IPv4" => Some(Family::V4),
            "IPv6" => Some(Family::V6),
            _ => None,
        }
    }

    /// The index of per-family arrays (IPv4 first).
    pub fn index(self) -> usize {
        match self {
            Family::V4 => 0,
            Family::V6 => 1,
        }
    }
}

/// `IPv4` or `IPv6`, as Kubernetes spells the families.
impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Family::V4 => "IPv4",
            Family::V6 => "IPv6",
        })
    }
}

/// Which backend set a frontend's key selects. The discriminants are lb-common's `scope` ABI
/// values, so `scope as u8` is the map's byte.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Scope {
    /// External traffic, and the only scope of a service whose policies agree.
    External = scope::EXTERNAL,
    /// Traffic from inside the cluster to a two-scope service.
    Internal = scope::INTERNAL,
}

impl Scope {
    /// `external` or `internal`, as `frontends.json` and `lb services` spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Scope::External => "external",
            Scope::Internal => "internal",
        }
    }
}

impl TryFrom<u8> for Scope {
    type Error = UnknownValue;
    fn try_from(value: u8) -> Result<Self, UnknownValue> {
        match value {
            scope::EXTERNAL => Ok(Scope::External),
            scope::INTERNAL => Ok(Scope::Internal),
            _ => Err(UnknownValue {
                what: "frontend scope",
                value,
            }),
        }
    }
}

/// What a backend is good for. The discriminants are lb-common's `backend_state` ABI values
/// (`state as u8` is the map's byte), and the order is from most to least usable.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum BackendState {
    /// Takes new flows.
    Active = backend_state::ACTIVE,
    /// Keeps its established flows only.
    Terminating = backend_state::TERMINATING,
    Quarantined = backend_state::QUARANTINED,
    Maintenance = backend_state::MAINTENANCE,
}

impl BackendState {
    /// The name `lb services`, `lb backends` and the golden dumps show.
    pub fn as_str(self) -> &'static str {
        match self {
            BackendState::Active => "active",
            BackendState::Terminating => "terminating",
            BackendState::Quarantined => "quarantined",
            BackendState::Maintenance => "maintenance",
        }
    }
}

impl TryFrom<u8> for BackendState {
    type Error = UnknownValue;
    fn try_from(value: u8) -> Result<Self, UnknownValue> {
        match value {
            backend_state::ACTIVE => Ok(BackendState::Active),
            backend_state::TERMINATING => Ok(BackendState::Terminating),
            backend_state::QUARANTINED => Ok(BackendState::Quarantined),
            backend_state::MAINTENANCE => Ok(BackendState::Maintenance),
            _ => Err(UnknownValue {
                what: "backend state",
                value,
            }),
        }
    }
}

/// An L4 protocol lb balances.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Proto {
    Tcp,
    Udp,
    Sctp,
}

impl Proto {
    pub fn number(self) -> u8 {
        match self {
            Proto::Tcp => IPPROTO_TCP,
            Proto::Udp => IPPROTO_UDP,
            Proto::Sctp => IPPROTO_SCTP,
        }
    }

    pub fn from_number(n: u8) -> Option<Self> {
        match n {
            IPPROTO_TCP => Some(Proto::Tcp),
            IPPROTO_UDP => Some(Proto::Udp),
            IPPROTO_SCTP => Some(Proto::Sctp),
            _ => None,
        }
    }

    /// Parses Kubernetes' protocol names (`TCP`, `UDP`, `SCTP`).
    pub fn from_k8s(s: &str) -> Option<Self> {
        match s {
            "TCP" => Some(Proto::Tcp),
            "UDP" => Some(Proto::Udp),
            "SCTP" => Some(Proto::Sctp),
            _ => None,
        }
    }
}

impl fmt::Display for Proto {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Proto::Tcp => "TCP",
            Proto::Udp => "UDP",
            Proto::Sctp => "SCTP",
        })
    }
}

/// An address, port and protocol: a frontend's or a backend's L3/L4 identity.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct L4Addr {
    pub addr: IpAddr,
    pub port: u16,
    pub proto: Proto,
}

impl fmt::Display for L4Addr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.addr {
            IpAddr::V4(a) => write!(f, "{a}:{}/{}", self.port, self.proto),
            IpAddr::V6(a) => write!(f, "[{a}]:{}/{}", self.port, self.proto),
        }
    }
}

/// A service frontend as the datapath keys it: address, port, protocol and scope.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Frontend {
    pub l4: L4Addr,
    pub scope: Scope,
}

impl Frontend {
    pub fn new(addr: IpAddr, port: u16, proto: Proto) -> Self {
        Self {
            l4: L4Addr { addr, port, proto },
            scope: Scope::External,
        }
    }
}

impl fmt::Display for Frontend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.l4)?;
        if self.scope == Scope::Internal {
            f.write_str(" (internal)")?;
        }
        Ok(())
    }
}

/// Which Kubernetes service port a frontend belongs to.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct ServicePortName {
    /// Shared with the object and with the service's other frontends: one frontend is a few
    /// reference counts, not three strings.
    pub namespace: std::sync::Arc<str>,
    pub name: std::sync::Arc<str>,
    pub port_name: std::sync::Arc<str>,
}

impl fmt::Display for ServicePortName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)?;
        if !self.port_name.is_empty() {
            write!(f, ":{}", self.port_name)?;
        }
        Ok(())
    }
}

/// A backend of a frontend, with the state new flows care about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Backend {
    pub l4: L4Addr,
    pub state: BackendState,
}

impl Backend {
    pub fn active(l4: L4Addr) -> Self {
        Self {
            l4,
            state: BackendState::Active,
        }
    }
}

/// How a frontend picks the backend of a new flow (`--lb-algorithm`, the Service annotation
/// `lb.io/lb-algorithm`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, clap::ValueEnum)]
pub enum LbAlgorithm {
    /// A uniformly random active backend (sockets: per connect, or per socket for UDP).
    #[default]
    Random,
    /// Maglev consistent hashing: a per-frontend lookup table, the same flow to the same
    /// backend on every node, and about 1/N of flows moved when one of N backends goes.
    Maglev,
}

impl LbAlgorithm {
    /// The name flags, annotations and `lb services` use.
    pub fn as_str(self) -> &'static str {
        match self {
            LbAlgorithm::Random => "random",
            LbAlgorithm::Maglev => "maglev",
        }
    }

    /// Parses an annotation value (`random` or `maglev`).
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "random" => Some(LbAlgorithm::Random),
            "maglev" => Some(LbAlgorithm::Maglev),
            _ => None,
        }
    }
}

/// Everything the datapath needs to know about one frontend.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServiceEntry {
    pub name: ServicePortName,
    /// `lb_common::svc_flags` bits.
    pub flags: u16,
    /// The frontend's backends. The reconciler puts the active ones in slots `1..=count`
    /// (new flows) and the others after them (established flows only), each group in this order.
    pub backends: Vec<Backend>,
    /// With `svc_flags::SOURCE_RANGES`: the sources (of the frontend's family) allowed to open
    /// flows; all others are dropped.
    pub source_ranges: BTreeSet<Cidr>,
    /// With `svc_flags::AFFINITY`: the session affinity timeout in seconds; 0 otherwise.
    pub affinity_timeout: u32,
    /// How new flows pick among the active backends.
    pub algorithm: LbAlgorithm,
}

impl ServiceEntry {
    pub fn kind(&self) -> &'static str {
        kind_of(self.flags)
    }
}

/// The service type `svc_flags` bits stand for: ClusterIP, ExternalIP, LoadBalancer or
/// NodePort (a NodePort service's frontends say NodePort, and so on).
pub fn kind_of(flags: u16) -> &'static str {
    if flags & svc_flags::NODE_PORT != 0 {
        "NodePort"
    } else if flags & svc_flags::LOAD_BALANCER != 0 {
        "LoadBalancer"
    } else if flags & svc_flags::EXTERNAL_IP != 0 {
        "ExternalIP"
    } else {
        "ClusterIP"
    }
}

/// Names of the set `svc_flags` bits, `|`-joined; `-` for none.
pub fn flag_names(flags: u16) -> String {
    const NAMES: [(u16, &str); 11] = [
        (svc_flags::CLUSTER_IP, "ClusterIP"),
        (svc_flags::NODE_PORT, "NodePort"),
        (svc_flags::EXTERNAL_IP, "ExternalIP"),
        (svc_flags::LOAD_BALANCER, "LoadBalancer"),
        (svc_flags::AFFINITY, "Affinity"),
        (svc_flags::EXT_LOCAL, "ExtLocal"),
        (svc_flags::INT_LOCAL, "IntLocal"),
        (svc_flags::TWO_SCOPES, "TwoScopes"),
        (svc_flags::SOURCE_RANGES, "SourceRanges"),
        (svc_flags::EMPTY_DROP, "EmptyDrop"),
        (svc_flags::LOCAL_ADDR, "LocalAddr"),
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

/// The whole desired datapath state.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DesiredState {
    pub services: BTreeMap<Frontend, ServiceEntry>,
}

impl DesiredState {
    pub fn backend_count(&self) -> usize {
        let mut all: Vec<_> = self
            .services
            .values()
            .flat_map(|s| s.backends.iter().map(|b| b.l4))
            .collect();
        all.sort();
        all.dedup();
        all.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn abi_bytes_round_trip_and_unknown_ones_are_errors() {
        for s in [Scope::External, Scope::Internal] {
            assert_eq!(Scope::try_from(s as u8), Ok(s));
        }
        for s in [
            BackendState::Active,
            BackendState::Terminating,
            BackendState::Quarantined,
            BackendState::Maintenance,
        ] {
            assert_eq!(BackendState::try_from(s as u8), Ok(s));
        }
        assert_eq!(scope::INTERNAL, Scope::Internal as u8);
        assert_eq!(backend_state::MAINTENANCE, BackendState::Maintenance as u8);
        let err = BackendState::try_from(7).unwrap_err();
        assert_eq!(err.to_string(), "unknown backend state 7");
        assert_eq!(
            Scope::try_from(2).unwrap_err().to_string(),
            "unknown frontend scope 2"
        );
    }
}
