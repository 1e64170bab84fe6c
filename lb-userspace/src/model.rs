//! The desired datapath state: what the maps should hold, independent of how it is stored.
//! Sources (manifest files, the Kubernetes API) are translated into a `DesiredState` by a pure
//! function; the reconciler makes the maps match it.
use std::{collections::BTreeMap, fmt, net::IpAddr};

use lb_common::{IPPROTO_SCTP, IPPROTO_TCP, IPPROTO_UDP, backend_state, scope, svc_flags};

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
    /// `lb_common::scope` value.
    pub scope: u8,
}

impl Frontend {
    pub fn new(addr: IpAddr, port: u16, proto: Proto) -> Self {
        Self {
            l4: L4Addr { addr, port, proto },
            scope: scope::EXTERNAL,
        }
    }
}

impl fmt::Display for Frontend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.l4)?;
        if self.scope == scope::INTERNAL {
            f.write_str(" (internal)")?;
        }
        Ok(())
    }
}

/// Which Kubernetes service port a frontend belongs to.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct ServicePortName {
    pub namespace: String,
    pub name: String,
    pub port_name: String,
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
    /// `lb_common::backend_state` value.
    pub state: u8,
}

impl Backend {
    pub fn active(l4: L4Addr) -> Self {
        Self {
            l4,
            state: backend_state::ACTIVE,
        }
    }
}

/// Everything the datapath needs to know about one frontend.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceEntry {
    pub name: ServicePortName,
    /// `lb_common::svc_flags` bits.
    pub flags: u16,
    /// The frontend's backends. The reconciler puts the active ones in slots `1..=count`
    /// (new flows) and the others after them (established flows only), each group in this order.
    pub backends: Vec<Backend>,
}

impl ServiceEntry {
    pub fn kind(&self) -> &'static str {
        if self.flags & svc_flags::NODE_PORT != 0 {
            "NodePort"
        } else if self.flags & svc_flags::LOAD_BALANCER != 0 {
            "LoadBalancer"
        } else if self.flags & svc_flags::EXTERNAL_IP != 0 {
            "ExternalIP"
        } else {
            "ClusterIP"
        }
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
