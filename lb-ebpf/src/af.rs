//! One set of NAT, conntrack and selection logic serves IPv4 and IPv6: `Af` hides the
//! per-family key types and maps.
//!
//! Map value pointers: a successful lookup returns a live, aligned value that stays valid for
//! the program's run (hash map elements are freed only after an RCU grace period). The maps
//! read here are only written by whole-element updates, which swap in a new element, so a
//! value copied out is never half-written.
use aya_ebpf::btf_maps::lpm_trie::Key;
use lb_common::{
    Affinity4Key, Affinity6Key, AffinityMatchKey, AffinityValue, Backend4, Backend6, ClusterIp4Key,
    ClusterIp6Key, Ct4Key, Ct4Value, Ct6Key, Ct6Value, EchoKey4, EchoKey6, EchoValue, IPPROTO_TCP,
    LbConfig, RevNat4, RevNat6, SkRevNat4Key, SkRevNat4Value, SkRevNat6Key, SkRevNat6Value,
    SrcRange4, SrcRange6, Svc4Key, Svc6Key, SvcValue, config_flags,
};

use crate::maps::{
    AFF_MATCH4, AFF_MATCH6, AFFINITY4, AFFINITY6, BACKENDS4, BACKENDS6, CLUSTER_CIDR4,
    CLUSTER_CIDR6, CLUSTER_IPS4, CLUSTER_IPS6, CT_ANY4, CT_ANY6, CT_TCP4, CT_TCP6, ECHO4, ECHO6,
    REVNAT4, REVNAT6, SERVICES4, SERVICES6, SK_REVNAT4, SK_REVNAT6, SRC_RANGE4, SRC_RANGE6,
    SVC_CIDR4, SVC_CIDR6, scratch,
};

/// Which scratch slot (`maps::Scratch::keys`) a conntrack key is built in: the two keys a step
/// holds at once (a flow's service and reply entries) use different slots.
#[derive(Clone, Copy)]
pub enum KeySlot {
    Service = 0,
    Reply = 1,
}

const _: () = {
    assert!(size_of::<Ct6Key>() <= 40 && size_of::<Ct4Key>() <= 40);
    assert!(size_of::<Ct6Value>() <= 32 && size_of::<Ct4Value>() <= 32);
};

/// A frontend or backend address with its port (host order).
#[derive(Clone, Copy)]
pub struct Endpoint<A> {
    pub addr: A,
    pub port: u16,
}

/// The fields both families' conntrack values start with: `Ct4Value` and `Ct6Value` are a
/// `CtHead` followed by `nat_addr`, so a value pointer of either is also one to its head and
/// conntrack updates it in place instead of copying whole values around the stack.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CtHead {
    pub backend_id: u32,
    pub rev_nat_id: u32,
    pub expires: u32,
    pub flags: u16,
    pub nat_port: u16,
}

const _: () = {
    use core::mem::offset_of;
    assert!(offset_of!(Ct4Value, nat_addr) == size_of::<CtHead>());
    assert!(offset_of!(Ct6Value, nat_addr) == size_of::<CtHead>());
    assert!(offset_of!(Ct4Value, flags) == offset_of!(CtHead, flags));
    assert!(offset_of!(Ct6Value, nat_port) == offset_of!(CtHead, nat_port));
    assert!(offset_of!(Ct6Value, expires) == offset_of!(CtHead, expires));
};

pub trait Af {
    /// Address bytes in network order.
    type Addr: Copy + AsRef<[u8]>;
    type CtKey: 'static;
    /// This family's socket storage value (`lb*_sk_store`).
    type Store: crate::sk_store::Store<A = Self>;
    /// The all-zero address: "none" in `LbConfig` and in unused NAT fields.
    const ZERO: Self::Addr;
    /// The `config_flags` bit saying this family's local-traffic detector is on.
    const CLUSTER_CIDR_FLAG: u32;

    /// Address equality as integer compares (a byte-array `==` may become a `bcmp` call, which
    /// BPF has not got).
    fn same(a: Self::Addr, b: Self::Addr) -> bool;
    /// This family's node IP in `cfg`, if one is configured.
    fn node_ip(cfg: &LbConfig) -> Option<Self::Addr>;
    /// Whether `addr` lies in one of this family's cluster CIDRs.
    fn in_cluster_cidr(addr: Self::Addr) -> bool;

    fn service(addr: Self::Addr, port: u16, proto: u8, slot: u16, scope: u8) -> Option<SvcValue>;
    fn backend(id: u32) -> Option<Endpoint<Self::Addr>>;
    fn revnat(id: u32) -> Option<Endpoint<Self::Addr>>;
    /// Whether `addr` is the ClusterIP of some frontend (on whatever port).
    fn is_cluster_ip(addr: Self::Addr) -> bool;
    /// What an echo request to `addr` gets, if it is a service address (`lb*_echo`).
    fn echo(addr: Self::Addr) -> Option<EchoValue>;
    /// Whether `addr` lies in a `--service-cidr` range.
    fn in_service_cidr(addr: Self::Addr) -> bool;
    /// Whether `saddr` lies in one of the `loadBalancerSourceRanges` of frontend `rev_nat_id`.
    fn in_source_range(rev_nat_id: u32, saddr: Self::Addr) -> bool;

    /// Builds a conntrack key in this CPU's scratch `slot` (`None` only if the scratch map
    /// lookup failed, which it cannot for index 0). The key stays valid until the slot is
    /// built again.
    fn ct_key(
        slot: KeySlot,
        saddr: Self::Addr,
        daddr: Self::Addr,
        sport: u16,
        dport: u16,
        proto: u8,
        dir: u8,
    ) -> Option<&'static Self::CtKey>;
    /// The value under `key`, as a pointer to its head (see `CtHead`).
    fn ct_get(key: &Self::CtKey) -> Option<*mut CtHead>;
    /// Writes `head` and `nat_addr` under `key`; `flags` as for `bpf_map_update_elem`
    /// (`BPF_NOEXIST`…).
    fn ct_put(
        key: &Self::CtKey,
        head: &CtHead,
        nat_addr: &Self::Addr,
        flags: u64,
    ) -> Result<(), i32>;
    /// The `nat_addr` of the value whose head `ct_get` returned.
    ///
    /// # Safety
    /// `h` must come from a successful `ct_get` of this family in this program run.
    unsafe fn ct_nat_addr(h: *mut CtHead) -> Self::Addr;
    /// Deletes the entry under `key` (a missing one is no error).
    fn ct_del(key: &Self::CtKey);

    /// Remembers that socket `cookie` talks to `backend` on behalf of the frontend (`flags`:
    /// the map update's, `BPF_ANY` or `BPF_NOEXIST`).
    fn sk_revnat_put(
        cookie: u64,
        backend: Endpoint<Self::Addr>,
        frontend: Endpoint<Self::Addr>,
        rev_nat_id: u32,
        flags: u64,
    ) -> Result<(), i32>;
    fn sk_revnat_get(cookie: u64, peer: Endpoint<Self::Addr>) -> Option<Endpoint<Self::Addr>>;

    /// The affinity entry of `client` (address, or netns cookie with the address zero) for
    /// frontend `rev_nat_id` in `scope`.
    fn affinity_get(
        client: &Client<Self::Addr>,
        rev_nat_id: u32,
        scope: u8,
    ) -> Option<*mut AffinityValue>;
    fn affinity_put(
        client: &Client<Self::Addr>,
        rev_nat_id: u32,
        scope: u8,
        value: &AffinityValue,
    ) -> Result<(), i32>;
    /// Whether `backend_id` is an active backend of frontend `rev_nat_id` in `scope`.
    fn affinity_match(backend_id: u32, rev_nat_id: u32, scope: u8) -> bool;
}

/// Who a session-affinity entry is for: a client address (packet hooks) or a network
/// namespace (socket hooks, keyed by its cookie; `addr` is then zero).
#[derive(Clone, Copy)]
pub struct Client<A> {
    pub addr: A,
    pub netns_cookie: u64,
}

#[inline(always)]
fn match_key(backend_id: u32, rev_nat_id: u32, scope: u8) -> AffinityMatchKey {
    AffinityMatchKey {
        backend_id,
        rev_nat_id,
        scope,
        pad: [0; 3],
    }
}

pub enum V4 {}
pub enum V6 {}

impl Af for V4 {
    type Addr = [u8; 4];
    type CtKey = Ct4Key;
    type Store = lb_common::SkStore4;
    const ZERO: [u8; 4] = [0; 4];
    const CLUSTER_CIDR_FLAG: u32 = config_flags::CLUSTER_CIDR4;

    #[inline(always)]
    fn same(a: [u8; 4], b: [u8; 4]) -> bool {
        u32::from_ne_bytes(a) == u32::from_ne_bytes(b)
    }

    #[inline(always)]
    fn node_ip(cfg: &LbConfig) -> Option<[u8; 4]> {
        (!Self::same(cfg.node_ip4, Self::ZERO)).then_some(cfg.node_ip4)
    }

    #[inline(always)]
    fn in_cluster_cidr(addr: [u8; 4]) -> bool {
        CLUSTER_CIDR4.get(&Key::new(32, addr)).is_some()
    }

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
    fn echo(addr: [u8; 4]) -> Option<EchoValue> {
        // SAFETY: hash value pointer, valid for the run; values are replaced whole.
        ECHO4.get_ptr(&EchoKey4 { addr }).map(|v| unsafe { *v })
    }

    #[inline(always)]
    fn in_service_cidr(addr: [u8; 4]) -> bool {
        SVC_CIDR4.get(&Key::new(32, addr)).is_some()
    }

    #[inline(always)]
    fn in_source_range(rev_nat_id: u32, saddr: [u8; 4]) -> bool {
        let data = SrcRange4 {
            rev_nat_id: rev_nat_id.to_be_bytes(),
            addr: saddr,
        };
        SRC_RANGE4.get(&Key::new(64, data)).is_some()
    }

    #[inline(always)]
    fn ct_key(
        slot: KeySlot,
        saddr: [u8; 4],
        daddr: [u8; 4],
        sport: u16,
        dport: u16,
        proto: u8,
        dir: u8,
    ) -> Option<&'static Ct4Key> {
        let s = scratch()?;
        // SAFETY: this CPU's scratch entry; the slot is 40 bytes, 8-aligned, and holds nothing
        // else (see `KeySlot`).
        unsafe {
            let k = (*s).keys[slot as usize].as_mut_ptr().cast::<Ct4Key>();
            *k = Ct4Key {
                saddr,
                daddr,
                sport,
                dport,
                proto,
                dir,
                pad: [0; 2],
            };
            Some(&*k)
        }
    }

    #[inline(always)]
    fn ct_get(key: &Ct4Key) -> Option<*mut CtHead> {
        let v = if key.proto == IPPROTO_TCP {
            CT_TCP4.get_ptr_mut(key)
        } else {
            CT_ANY4.get_ptr_mut(key)
        };
        v.map(|v| v.cast::<CtHead>())
    }

    #[inline(always)]
    fn ct_del(key: &Ct4Key) {
        let _ = if key.proto == IPPROTO_TCP {
            CT_TCP4.remove(key)
        } else {
            CT_ANY4.remove(key)
        };
    }

    #[inline(always)]
    fn ct_put(key: &Ct4Key, h: &CtHead, nat_addr: &Self::Addr, flags: u64) -> Result<(), i32> {
        let s = scratch().ok_or(-1)?;
        // SAFETY: this CPU's scratch value slot (32 bytes, 8-aligned), used only here.
        let value = unsafe {
            let v = (*s).value.as_mut_ptr().cast::<Ct4Value>();
            *v = Ct4Value {
                backend_id: h.backend_id,
                rev_nat_id: h.rev_nat_id,
                expires: h.expires,
                flags: h.flags,
                nat_port: h.nat_port,
                nat_addr: *nat_addr,
            };
            &*v
        };
        if key.proto == IPPROTO_TCP {
            CT_TCP4.insert(key, value, flags)
        } else {
            CT_ANY4.insert(key, value, flags)
        }
    }

    #[inline(always)]
    unsafe fn ct_nat_addr(h: *mut CtHead) -> Self::Addr {
        // SAFETY: per the caller's contract `h` heads a live `Ct4Value`.
        unsafe { (*h.cast::<Ct4Value>()).nat_addr }
    }

    #[inline(always)]
    fn sk_revnat_put(
        cookie: u64,
        backend: Endpoint<[u8; 4]>,
        frontend: Endpoint<[u8; 4]>,
        rev_nat_id: u32,
        flags: u64,
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
        SK_REVNAT4.insert(&key, &value, flags)
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

    #[inline(always)]
    fn affinity_get(
        client: &Client<Self::Addr>,
        rev_nat_id: u32,
        scope: u8,
    ) -> Option<*mut AffinityValue> {
        AFFINITY4.get_ptr_mut(&affinity4_key(client, rev_nat_id, scope))
    }

    #[inline(always)]
    fn affinity_put(
        client: &Client<Self::Addr>,
        rev_nat_id: u32,
        scope: u8,
        value: &AffinityValue,
    ) -> Result<(), i32> {
        AFFINITY4.insert(&affinity4_key(client, rev_nat_id, scope), value, 0)
    }

    #[inline(always)]
    fn affinity_match(backend_id: u32, rev_nat_id: u32, scope: u8) -> bool {
        AFF_MATCH4
            .get_ptr(&match_key(backend_id, rev_nat_id, scope))
            .is_some()
    }
}

impl Af for V6 {
    type Addr = [u8; 16];
    type CtKey = Ct6Key;
    type Store = lb_common::SkStore6;
    const ZERO: [u8; 16] = [0; 16];
    const CLUSTER_CIDR_FLAG: u32 = config_flags::CLUSTER_CIDR6;

    #[inline(always)]
    fn same(a: [u8; 16], b: [u8; 16]) -> bool {
        let half = |x: &[u8; 16], i: usize| {
            let mut h = [0u8; 8];
            h.copy_from_slice(&x[i * 8..i * 8 + 8]);
            u64::from_ne_bytes(h)
        };
        half(&a, 0) == half(&b, 0) && half(&a, 1) == half(&b, 1)
    }

    #[inline(always)]
    fn node_ip(cfg: &LbConfig) -> Option<[u8; 16]> {
        (!Self::same(cfg.node_ip6, Self::ZERO)).then_some(cfg.node_ip6)
    }

    #[inline(always)]
    fn in_cluster_cidr(addr: [u8; 16]) -> bool {
        CLUSTER_CIDR6.get(&Key::new(128, addr)).is_some()
    }

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
    fn echo(addr: [u8; 16]) -> Option<EchoValue> {
        // SAFETY: hash value pointer, valid for the run; values are replaced whole.
        ECHO6.get_ptr(&EchoKey6 { addr }).map(|v| unsafe { *v })
    }

    #[inline(always)]
    fn in_service_cidr(addr: [u8; 16]) -> bool {
        SVC_CIDR6.get(&Key::new(128, addr)).is_some()
    }

    #[inline(always)]
    fn in_source_range(rev_nat_id: u32, saddr: [u8; 16]) -> bool {
        let data = SrcRange6 {
            rev_nat_id: rev_nat_id.to_be_bytes(),
            addr: saddr,
        };
        SRC_RANGE6.get(&Key::new(160, data)).is_some()
    }

    #[inline(always)]
    fn ct_key(
        slot: KeySlot,
        saddr: [u8; 16],
        daddr: [u8; 16],
        sport: u16,
        dport: u16,
        proto: u8,
        dir: u8,
    ) -> Option<&'static Ct6Key> {
        let s = scratch()?;
        // SAFETY: this CPU's scratch entry; the slot is 40 bytes, 8-aligned, and holds nothing
        // else (see `KeySlot`).
        unsafe {
            let k = (*s).keys[slot as usize].as_mut_ptr().cast::<Ct6Key>();
            *k = Ct6Key {
                saddr,
                daddr,
                sport,
                dport,
                proto,
                dir,
                pad: [0; 2],
            };
            Some(&*k)
        }
    }

    #[inline(always)]
    fn ct_get(key: &Ct6Key) -> Option<*mut CtHead> {
        let v = if key.proto == IPPROTO_TCP {
            CT_TCP6.get_ptr_mut(key)
        } else {
            CT_ANY6.get_ptr_mut(key)
        };
        v.map(|v| v.cast::<CtHead>())
    }

    #[inline(always)]
    fn ct_del(key: &Ct6Key) {
        let _ = if key.proto == IPPROTO_TCP {
            CT_TCP6.remove(key)
        } else {
            CT_ANY6.remove(key)
        };
    }

    #[inline(always)]
    fn ct_put(key: &Ct6Key, h: &CtHead, nat_addr: &Self::Addr, flags: u64) -> Result<(), i32> {
        let s = scratch().ok_or(-1)?;
        // SAFETY: this CPU's scratch value slot (32 bytes, 8-aligned), used only here.
        let value = unsafe {
            let v = (*s).value.as_mut_ptr().cast::<Ct6Value>();
            *v = Ct6Value {
                backend_id: h.backend_id,
                rev_nat_id: h.rev_nat_id,
                expires: h.expires,
                flags: h.flags,
                nat_port: h.nat_port,
                nat_addr: *nat_addr,
            };
            &*v
        };
        if key.proto == IPPROTO_TCP {
            CT_TCP6.insert(key, value, flags)
        } else {
            CT_ANY6.insert(key, value, flags)
        }
    }

    #[inline(always)]
    unsafe fn ct_nat_addr(h: *mut CtHead) -> Self::Addr {
        // SAFETY: per the caller's contract `h` heads a live `Ct6Value`.
        unsafe { (*h.cast::<Ct6Value>()).nat_addr }
    }

    #[inline(always)]
    fn sk_revnat_put(
        cookie: u64,
        backend: Endpoint<[u8; 16]>,
        frontend: Endpoint<[u8; 16]>,
        rev_nat_id: u32,
        flags: u64,
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
        SK_REVNAT6.insert(&key, &value, flags)
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

    #[inline(always)]
    fn affinity_get(
        client: &Client<Self::Addr>,
        rev_nat_id: u32,
        scope: u8,
    ) -> Option<*mut AffinityValue> {
        AFFINITY6.get_ptr_mut(&affinity6_key(client, rev_nat_id, scope))
    }

    #[inline(always)]
    fn affinity_put(
        client: &Client<Self::Addr>,
        rev_nat_id: u32,
        scope: u8,
        value: &AffinityValue,
    ) -> Result<(), i32> {
        AFFINITY6.insert(&affinity6_key(client, rev_nat_id, scope), value, 0)
    }

    #[inline(always)]
    fn affinity_match(backend_id: u32, rev_nat_id: u32, scope: u8) -> bool {
        AFF_MATCH6
            .get_ptr(&match_key(backend_id, rev_nat_id, scope))
            .is_some()
    }
}

#[inline(always)]
fn affinity4_key(client: &Client<[u8; 4]>, rev_nat_id: u32, scope: u8) -> Affinity4Key {
    Affinity4Key {
        netns_cookie: client.netns_cookie,
        addr: client.addr,
        rev_nat_id,
        scope,
        pad: [0; 7],
    }
}

#[inline(always)]
fn affinity6_key(client: &Client<[u8; 16]>, rev_nat_id: u32, scope: u8) -> Affinity6Key {
    Affinity6Key {
        netns_cookie: client.netns_cookie,
        addr: client.addr,
        rev_nat_id,
        scope,
        pad: [0; 3],
    }
}
