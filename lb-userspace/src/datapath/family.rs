//! IPv4 and IPv6 as lb's maps hold them: each family's key and value types, map names and
//! how an address goes into and comes out of an entry. The two families' types differ only
//! in the address's width, so code over both (`maps`, `held`, `conntrack`) is written once, generic over
//! [`MapFamily`], and picks [`V4`] or [`V6`] from the address it is given.
use std::{
    hash::Hash,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use lb_common::{
    Backend4, Backend6, ClusterIp4Key, ClusterIp6Key, Ct4Key, Ct4Value, Ct6Key, Ct6Value, EchoKey4,
    EchoKey6, RevNat4, RevNat6, SrcRange4, SrcRange6, Svc4Key, Svc6Key, map_names,
};

/// IPv4: the `lb4_*` maps.
pub enum V4 {}

/// IPv6: the `lb6_*` maps.
pub enum V6 {}

/// The names of one family's maps.
pub struct MapNames {
    pub services: &'static str,
    pub backends: &'static str,
    pub revnat: &'static str,
    pub cluster_ips: &'static str,
    pub src_ranges: &'static str,
    pub echo: &'static str,
}

/// A service key's fields but the address: (port, proto, scope, slot).
pub type SvcKeyRest = (u16, u8, u8, u16);

/// A conntrack key's fields: (saddr, sport, daddr, dport, proto, dir).
pub type CtKeyFields<A> = (A, u16, A, u16, u8, u8);

/// A conntrack value's fields: (backend_id, expires, flags, nat_addr, nat_port).
pub type CtValueFields<A> = (u32, u32, u16, A, u16);

/// One family's entries in the service, backend, rev-NAT, ClusterIP, echo, source-range and
/// conntrack maps.
pub trait MapFamily {
    /// The family as metrics label it (`ipv4`, `ipv6`).
    const NAME: &'static str;
    const NAMES: MapNames;
    /// The address's bits (a source range's prefix is at most this).
    const BITS: u8;
    /// The address as the entries hold it, in network order.
    type Addr: Copy + Eq + Hash + Send + 'static;
    type SvcKey: aya::Pod + bytemuck::Pod + Send + 'static;
    type Backend: aya::Pod + bytemuck::Pod + Send + 'static;
    type RevNat: aya::Pod + bytemuck::Pod + Send + 'static;
    type ClusterIpKey: aya::Pod + bytemuck::Pod + Send + 'static;
    type EchoKey: aya::Pod + bytemuck::Pod + Send + 'static;
    type SrcRange: aya::Pod;
    type CtKey: aya::Pod + bytemuck::Pod + Eq + Hash;
    type CtValue: aya::Pod + bytemuck::Pod;

    fn ip(addr: Self::Addr) -> IpAddr;
    fn svc_key(addr: Self::Addr, rest: SvcKeyRest) -> Self::SvcKey;
    fn svc_key_fields(k: &Self::SvcKey) -> (Self::Addr, SvcKeyRest);
    fn backend(addr: Self::Addr, port: u16, proto: u8, state: u8) -> Self::Backend;
    /// (address, port, proto, state)
    fn backend_fields(b: &Self::Backend) -> (Self::Addr, u16, u8, u8);
    fn revnat(addr: Self::Addr, port: u16) -> Self::RevNat;
    fn revnat_fields(r: &Self::RevNat) -> (Self::Addr, u16);
    fn cluster_ip_key(addr: Self::Addr) -> Self::ClusterIpKey;
    fn cluster_ip_addr(k: &Self::ClusterIpKey) -> Self::Addr;
    fn echo_key(addr: Self::Addr) -> Self::EchoKey;
    fn echo_addr(k: &Self::EchoKey) -> Self::Addr;
    /// A source range's data: the rev-NAT id (network order, matched whole), the address.
    fn src_range(rev_nat_id: u32, addr: Self::Addr) -> Self::SrcRange;
    fn src_range_fields(k: &Self::SrcRange) -> (u32, Self::Addr);
    fn ct_key_fields(k: &Self::CtKey) -> CtKeyFields<Self::Addr>;
    fn ct_value_fields(v: &Self::CtValue) -> CtValueFields<Self::Addr>;
}

/// The family's types and names, written once for both: the lb-common types of a family
/// have the same fields, only the address's width differs.
macro_rules! map_family {
    ($fam:ident, $name:literal, $bits:expr, $ip:ty, $n:literal,
     $svc:ident, $backend:ident, $revnat:ident, $cip:ident, $echo:ident, $src:ident,
     $ct_key:ident, $ct_value:ident, $names:expr) => {
        impl MapFamily for $fam {
            const NAME: &'static str = $name;
            const NAMES: MapNames = $names;
            const BITS: u8 = $bits;
            type Addr = [u8; $n];
            type SvcKey = $svc;
            type Backend = $backend;
            type RevNat = $revnat;
            type ClusterIpKey = $cip;
            type EchoKey = $echo;
            type SrcRange = $src;
            type CtKey = $ct_key;
            type CtValue = $ct_value;

            fn ip(addr: [u8; $n]) -> IpAddr {
                <$ip>::from(addr).into()
            }
            fn svc_key(addr: [u8; $n], (port, proto, scope, slot): SvcKeyRest) -> $svc {
                $svc {
                    addr,
                    port,
                    slot,
                    proto,
                    scope,
                    pad: [0; 2],
                }
            }
            fn svc_key_fields(k: &$svc) -> ([u8; $n], SvcKeyRest) {
                (k.addr, (k.port, k.proto, k.scope, k.slot))
            }
            fn backend(addr: [u8; $n], port: u16, proto: u8, state: u8) -> $backend {
                $backend {
                    addr,
                    port,
                    proto,
                    state,
                }
            }
            fn backend_fields(b: &$backend) -> ([u8; $n], u16, u8, u8) {
                (b.addr, b.port, b.proto, b.state)
            }
            fn revnat(addr: [u8; $n], port: u16) -> $revnat {
                $revnat { addr, port, pad: 0 }
            }
            fn revnat_fields(r: &$revnat) -> ([u8; $n], u16) {
                (r.addr, r.port)
            }
            fn cluster_ip_key(addr: [u8; $n]) -> $cip {
                $cip { addr }
            }
            fn cluster_ip_addr(k: &$cip) -> [u8; $n] {
                k.addr
            }
            fn echo_key(addr: [u8; $n]) -> $echo {
                $echo { addr }
            }
            fn echo_addr(k: &$echo) -> [u8; $n] {
                k.addr
            }
            fn src_range(rev_nat_id: u32, addr: [u8; $n]) -> $src {
                $src {
                    rev_nat_id: rev_nat_id.to_be_bytes(),
                    addr,
                }
            }
            fn src_range_fields(k: &$src) -> (u32, [u8; $n]) {
                (u32::from_be_bytes(k.rev_nat_id), k.addr)
            }
            fn ct_key_fields(k: &$ct_key) -> CtKeyFields<[u8; $n]> {
                (k.saddr, k.sport, k.daddr, k.dport, k.proto, k.dir)
            }
            fn ct_value_fields(v: &$ct_value) -> CtValueFields<[u8; $n]> {
                (v.backend_id, v.expires, v.flags, v.nat_addr, v.nat_port)
            }
        }
    };
}

map_family!(
    V4,
    "ipv4",
    32,
    Ipv4Addr,
    4,
    Svc4Key,
    Backend4,
    RevNat4,
    ClusterIp4Key,
    EchoKey4,
    SrcRange4,
    Ct4Key,
    Ct4Value,
    MapNames {
        services: map_names::SERVICES4,
        backends: map_names::BACKENDS4,
        revnat: map_names::REVNAT4,
        cluster_ips: map_names::CLUSTER_IPS4,
        src_ranges: map_names::SRC_RANGE4,
        echo: map_names::ECHO4,
    }
);

map_family!(
    V6,
    "ipv6",
    128,
    Ipv6Addr,
    16,
    Svc6Key,
    Backend6,
    RevNat6,
    ClusterIp6Key,
    EchoKey6,
    SrcRange6,
    Ct6Key,
    Ct6Value,
    MapNames {
        services: map_names::SERVICES6,
        backends: map_names::BACKENDS6,
        revnat: map_names::REVNAT6,
        cluster_ips: map_names::CLUSTER_IPS6,
        src_ranges: map_names::SRC_RANGE6,
        echo: map_names::ECHO6,
    }
);
