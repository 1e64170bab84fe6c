//! One set of NAT, conntrack and selection logic serves IPv4 and IPv6: `Af` hides the
//! per-family key types and maps.
//!
//! Map value pointers: a successful lookup returns a live, aligned value that stays valid for
//! the program's run (hash map elements are freed only after an RCU grace period). The maps
//! read here are only written by whole-element updates, which swap in a new element, so a
//! value copied out is never half-written.
use aya_ebpf::btf_maps::lpm_trie::Key as LpmKey;
use lb_common::{
    Backend4, Backend6, ClusterIp4Key, ClusterIp6Key, Ct4Key, Ct6Key, CtValue, RevNat4, RevNat6,
    SkRevNat4Key, SkRevNat4Value, SkRevNat6Key, SkRevNat6Value, Svc4Key, Svc6Key, SvcValue,
};

use crate::maps::{
    BACKENDS4, BACKENDS6, CLUSTER_IPS4, CLUSTER_IPS6, CT4, CT6, REVNAT4, REVNAT6, SERVICES4,
    SERVICES6, SK_REVNAT4, SK_REVNAT6, SVC_CIDR4, SVC_CIDR6,
};

/// A frontend or backend address with its port (host order).
#[derive(Clone, Copy)]
pub struct Endpoint<A> {
    pub addr: A,
    pub port: u16,
}

pub trait Af {
    /// Address bytes in network order.
    type Addr: Copy;
    type CtKey;

    fn service(addr: Self::Addr, port: u16, proto: u8, slot: u16, scope: u8) -> Option<SvcValue>;
    fn backend(id: u32) -> Option<Endpoint<Self::Addr>>;
    fn revnat(id: u32) -> Option<Endpoint<Self::Addr>>;
    /// Whether `addr` is the ClusterIP of some frontend (on whatever port).
    fn is_cluster_ip(addr: Self::Addr) -> bool;
    /// Whether `addr` lies in a `--service-cidr` range.
    fn in_service_cidr(addr: Self::Addr) -> bool;

    fn ct_key(
        saddr: Self::Addr,
        daddr: Self::Addr,
        sport: u16,
        dport: u16,
        proto: u8,
        dir: u8,
    ) -> Self::CtKey;
    fn ct_get(key: &Self::CtKey) -> Option<*mut CtValue>;
    fn ct_put(key: &Self::CtKey, value: &CtValue) -> Result<(), i32>;

    /// Remembers that socket `cookie` talks to `backend` on behalf of the frontend.
    fn sk_revnat_put(
        cookie: u64,
        backend: Endpoint<Self::Addr>,
        frontend: Endpoint<Self::Addr>,
        rev_nat_id: u32,
    ) -> Result<(), i32>;
    fn sk_revnat_get(cookie: u64, peer: Endpoint<Self::Addr>) -> Option<Endpoint<Self::Addr>>;
}

pub enum V4 {}
pub enum V6 {}

impl Af for V4 {
    type Addr = [u8; 4];
    type CtKey = Ct4Key;

    #[inline(always)]
    fn service(addr: [u8; 4], port: u16, proto: u8, slot: u16, scope: u8) -> Option<SvcValue> {
        let key = Svc4Key {
            addr,
            port,
            slot,
            proto,
            scope,
            pad: [0; 2],
        };
        // SAFETY: see the module docs (map value pointers).
        SERVICES4.get_ptr(&key).map(|v| unsafe { *v })
    }

    #[inline(always)]
    fn backend(id: u32) -> Option<Endpoint<[u8; 4]>> {
        BACKENDS4.get_ptr(&id).map(|b| {
            // SAFETY: see the module docs (map value pointers).
            let b: Backend4 = unsafe { *b };
            Endpoint {
                addr: b.addr,
                port: b.port,
            }
        })
    }

    #[inline(always)]
    fn revnat(id: u32) -> Option<Endpoint<[u8; 4]>> {
        REVNAT4.get_ptr(&id).map(|r| {
            // SAFETY: see the module docs (map value pointers).
            let r: RevNat4 = unsafe { *r };
            Endpoint {
                addr: r.addr,
                port: r.port,
            }
        })
    }

    #[inline(always)]
    fn is_cluster_ip(addr: [u8; 4]) -> bool {
        CLUSTER_IPS4.get_ptr(&ClusterIp4Key { addr }).is_some()
    }

    #[inline(always)]
    fn in_service_cidr(addr: [u8; 4]) -> bool {
        SVC_CIDR4.get(&LpmKey::new(32, addr)).is_some()
    }

    #[inline(always)]
    fn ct_key(
        saddr: [u8; 4],
        daddr: [u8; 4],
        sport: u16,
        dport: u16,
        proto: u8,
        dir: u8,
    ) -> Ct4Key {
        Ct4Key {
            saddr,
            daddr,
            sport,
            dport,
            proto,
            dir,
            pad: [0; 2],
        }
    }

    #[inline(always)]
    fn ct_get(key: &Ct4Key) -> Option<*mut CtValue> {
        CT4.get_ptr_mut(key)
    }

    #[inline(always)]
    fn ct_put(key: &Ct4Key, value: &CtValue) -> Result<(), i32> {
        CT4.insert(key, value, 0)
    }

    #[inline(always)]
    fn sk_revnat_put(
        cookie: u64,
        backend: Endpoint<[u8; 4]>,
        frontend: Endpoint<[u8; 4]>,
        rev_nat_id: u32,
    ) -> Result<(), i32> {
        let key = SkRevNat4Key {
            cookie,
            addr: backend.addr,
            port: backend.port,
            pad: 0,
        };
        let value = SkRevNat4Value {
            addr: frontend.addr,
            port: frontend.port,
            pad: 0,
            rev_nat_id,
        };
        SK_REVNAT4.insert(&key, &value, 0)
    }

    #[inline(always)]
    fn sk_revnat_get(cookie: u64, peer: Endpoint<[u8; 4]>) -> Option<Endpoint<[u8; 4]>> {
        let key = SkRevNat4Key {
            cookie,
            addr: peer.addr,
            port: peer.port,
            pad: 0,
        };
        SK_REVNAT4.get_ptr(&key).map(|v| {
            // SAFETY: see the module docs (map value pointers).
            let v = unsafe { *v };
            Endpoint {
                addr: v.addr,
                port: v.port,
            }
        })
    }
}

impl Af for V6 {
    type Addr = [u8; 16];
    type CtKey = Ct6Key;

    #[inline(always)]
    fn service(addr: [u8; 16], port: u16, proto: u8, slot: u16, scope: u8) -> Option<SvcValue> {
        let key = Svc6Key {
            addr,
            port,
            slot,
            proto,
            scope,
            pad: [0; 2],
        };
        // SAFETY: see the module docs (map value pointers).
        SERVICES6.get_ptr(&key).map(|v| unsafe { *v })
    }

    #[inline(always)]
    fn backend(id: u32) -> Option<Endpoint<[u8; 16]>> {
        BACKENDS6.get_ptr(&id).map(|b| {
            // SAFETY: see the module docs (map value pointers).
            let b: Backend6 = unsafe { *b };
            Endpoint {
                addr: b.addr,
                port: b.port,
            }
        })
    }

    #[inline(always)]
    fn revnat(id: u32) -> Option<Endpoint<[u8; 16]>> {
        REVNAT6.get_ptr(&id).map(|r| {
            // SAFETY: see the module docs (map value pointers).
            let r: RevNat6 = unsafe { *r };
            Endpoint {
                addr: r.addr,
                port: r.port,
            }
        })
    }

    #[inline(always)]
    fn is_cluster_ip(addr: [u8; 16]) -> bool {
        CLUSTER_IPS6.get_ptr(&ClusterIp6Key { addr }).is_some()
    }

    #[inline(always)]
    fn in_service_cidr(addr: [u8; 16]) -> bool {
        SVC_CIDR6.get(&LpmKey::new(128, addr)).is_some()
    }

    #[inline(always)]
    fn ct_key(
        saddr: [u8; 16],
        daddr: [u8; 16],
        sport: u16,
        dport: u16,
        proto: u8,
        dir: u8,
    ) -> Ct6Key {
        Ct6Key {
            saddr,
            daddr,
            sport,
            dport,
            proto,
            dir,
            pad: [0; 2],
        }
    }

    #[inline(always)]
    fn ct_get(key: &Ct6Key) -> Option<*mut CtValue> {
        CT6.get_ptr_mut(key)
    }

    #[inline(always)]
    fn ct_put(key: &Ct6Key, value: &CtValue) -> Result<(), i32> {
        CT6.insert(key, value, 0)
    }

    #[inline(always)]
    fn sk_revnat_put(
        cookie: u64,
        backend: Endpoint<[u8; 16]>,
        frontend: Endpoint<[u8; 16]>,
        rev_nat_id: u32,
    ) -> Result<(), i32> {
        let key = SkRevNat6Key {
            cookie,
            addr: backend.addr,
            port: backend.port,
            pad: [0; 6],
        };
        let value = SkRevNat6Value {
            addr: frontend.addr,
            port: frontend.port,
            pad: 0,
            rev_nat_id,
        };
        SK_REVNAT6.insert(&key, &value, 0)
    }

    #[inline(always)]
    fn sk_revnat_get(cookie: u64, peer: Endpoint<[u8; 16]>) -> Option<Endpoint<[u8; 16]>> {
        let key = SkRevNat6Key {
            cookie,
            addr: peer.addr,
            port: peer.port,
            pad: [0; 6],
        };
        SK_REVNAT6.get_ptr(&key).map(|v| {
            // SAFETY: see the module docs (map value pointers).
            let v = unsafe { *v };
            Endpoint {
                addr: v.addr,
                port: v.port,
            }
        })
    }
}
