//! Socket LB's (backend → frontend) pairs in socket storage (`lb*_sk_store`), where the kernel
//! lets sock_addr and cgroup skb programs call `bpf_sk_storage_get` (the loader's probe sets
//! `LB_HAS_SK_STORAGE`). The storage is the socket's own memory, freed with it: no global map
//! write per connect()/sendmsg(), no LRU to evict a live socket's pair, and a datagram to a
//! pair the socket already holds writes nothing at all.
//!
//! Why slots and not one pair: an unconnected UDP socket may talk to several frontends, and
//! recvmsg() must turn each backend back into its own frontend. `SK_STORE_SLOTS` pairs are
//! filled once each and never replaced (a reader sees a slot complete or not at all, since
//! `used` grows after the slot is written); a socket that needs more pairs keeps them in
//! `lb*_sk_revnat`, as every socket did before, and `overflow` tells readers to look there.
//! connect() starts the slots over: a connected socket has exactly one peer.
//!
//! Storage is made lazily. Creating it (an allocation, linked into the socket and the map) costs
//! twice an LRU insert, and most sockets (every TCP one, most connected UDP ones) record one
//! pair and never another. So a socket's first pair goes to `lb*_sk_revnat` with
//! `BPF_NOEXIST`; only a socket that comes back to a pair it already has there (an unconnected
//! UDP socket's next datagram) gets storage, marked `overflow` since its first pair stays in
//! the LRU, and from then on its datagrams to a pair it holds write nothing.
use aya_ebpf::{
    bindings::{BPF_ANY, BPF_NOEXIST, BPF_SK_STORAGE_GET_F_CREATE, bpf_sock},
    cty::c_void,
    helpers::generated::{bpf_sk_fullsock, bpf_sk_storage_get},
    programs::{SkBuffContext, SockAddrContext},
};
use lb_common::{SK_STORE_SLOTS, SkSlot4, SkSlot6, SkStore4, SkStore6, metrics};

use crate::{
    af::{Af, Endpoint, V4, V6},
    maps::{SK_STORE4, SK_STORE6, count},
};

/// Set by the loader (`lb_common::globals::HAS_SK_STORAGE`) when the probe found
/// `bpf_sk_storage_get` for sock_addr and cgroup skb programs. Frozen .rodata: with 0 every
/// storage call is dead code the verifier never walks, so older kernels load the programs
/// and socket LB uses `lb*_sk_revnat` alone.
#[unsafe(no_mangle)]
static LB_HAS_SK_STORAGE: u8 = 0;

#[inline(always)]
pub fn enabled() -> bool {
    // SAFETY: a plain read of a static; volatile so the loader's value is what is read.
    unsafe { core::ptr::read_volatile(&LB_HAS_SK_STORAGE) != 0 }
}

/// The socket a storage call is about.
#[derive(Clone, Copy)]
pub struct Sk(*mut c_void);

impl Sk {
    /// The socket of a connect/sendmsg/recvmsg/getpeername call (always a full socket).
    #[inline(always)]
    pub fn of_addr(ctx: &SockAddrContext) -> Self {
        // SAFETY: the context pointer is valid for the program's run.
        Self(unsafe { (*ctx.sock_addr).__bindgen_anon_1.sk }.cast())
    }

    /// The full socket that sends an skb, if it has one.
    #[inline(always)]
    pub fn of_skb(ctx: &SkBuffContext) -> Option<Self> {
        // SAFETY: the context pointer is valid; `sk` may be NULL, checked before the helper.
        let sk: *mut bpf_sock = unsafe { (*ctx.skb.skb).__bindgen_anon_2.sk };
        if sk.is_null() {
            return None;
        }
        // SAFETY: a non-NULL socket of this skb.
        let full = unsafe { bpf_sk_fullsock(sk) };
        (!full.is_null()).then_some(Self(full.cast()))
    }
}

/// What `put` did.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Put {
    /// The pair is in the socket's slots.
    Stored,
    /// Not stored: the slots are full; the caller writes the pair to `lb*_sk_revnat`.
    Elsewhere,
}

/// What `get` found for a peer.
#[derive(Clone, Copy)]
pub enum Get<A> {
    Frontend(Endpoint<A>),
    /// Not in the slots: look in `lb*_sk_revnat` (the socket overflowed, or has no storage,
    /// e.g. it was translated before this kernel feature was in use).
    TryLru,
    /// Not in the slots and never overflowed: the peer is no backend of this socket's.
    None,
}

/// A family's socket storage value, so `put` and `get` are written once.
pub trait Store: 'static {
    type A: Af;
    type Slot: Copy;
    /// The storage map, as the helpers want it.
    fn map() -> *mut c_void;
    fn used(&mut self) -> *mut u8;
    fn overflow(&mut self) -> *mut u8;
    fn slot(&mut self, i: usize) -> Option<&mut Self::Slot>;
    fn make(backend: Endpoint<Addr<Self>>, frontend: Endpoint<Addr<Self>>, id: u32) -> Self::Slot;
    /// The slot's backend, frontend and rev-NAT id.
    fn read(s: &Self::Slot) -> (Endpoint<Addr<Self>>, Endpoint<Addr<Self>>, u32);
}

type Addr<S> = <<S as Store>::A as Af>::Addr;

/// The socket's storage; `create` makes an all-zero one if it has none.
#[inline(always)]
fn storage<S: Store>(sk: Sk, create: bool) -> Option<&'static mut S> {
    let flags = if create {
        BPF_SK_STORAGE_GET_F_CREATE as u64
    } else {
        0
    };
    // SAFETY: a full socket from the context; no initial value (zeroed by the kernel).
    let p = unsafe { bpf_sk_storage_get(S::map(), sk.0, core::ptr::null_mut(), flags) };
    // SAFETY: a non-NULL storage pointer is this socket's value, live for the program's run.
    (!p.is_null()).then(|| unsafe { &mut *p.cast::<S>() })
}

#[inline(always)]
fn same_endpoint<A: Af>(a: Endpoint<A::Addr>, b: Endpoint<A::Addr>) -> bool {
    a.port == b.port && A::same(a.addr, b.addr)
}

/// Records in the socket's storage `s` that it talks to `backend` for `frontend`. `connect`:
/// the socket's only peer from now on.
#[inline(always)]
pub fn put<S: Store>(
    s: &mut S,
    backend: Endpoint<Addr<S>>,
    frontend: Endpoint<Addr<S>>,
    rev_nat_id: u32,
    connect: bool,
) -> Put {
    let new = S::make(backend, frontend, rev_nat_id);
    // SAFETY (the raw `used`/`overflow` pointers below): fields of the live storage value.
    if connect {
        unsafe {
            core::ptr::write_volatile(s.used(), 0);
            core::ptr::write_volatile(s.overflow(), 0);
        }
        if let Some(slot) = s.slot(0) {
            *slot = new;
        }
        unsafe { core::ptr::write_volatile(s.used(), 1) };
        return Put::Stored;
    }
    let used = usize::from(unsafe { core::ptr::read_volatile(s.used()) });
    // Slots are indexed by the loop counter only, never by `used`: the counter's bound is a
    // constant the verifier checks on every kernel, while a separate `used < SLOTS` test
    // (a register compare on cpu v1) leaves 5.10's verifier walking an impossible path
    // where it refuses the slot pointer.
    let mut i = 0;
    while i < SK_STORE_SLOTS {
        let Some(slot) = s.slot(i) else {
            break;
        };
        if i >= used {
            // The first free slot (`i == used`).
            *slot = new;
            unsafe { core::ptr::write_volatile(s.used(), i as u8 + 1) };
            return Put::Stored;
        }
        let (b, f, id) = S::read(slot);
        if same_endpoint::<S::A>(b, backend) {
            // The same backend for another frontend of this socket: the latest wins, as
            // with `lb*_sk_revnat`'s key. The usual case, a datagram to a pair the socket
            // holds, writes nothing.
            if !same_endpoint::<S::A>(f, frontend) || id != rev_nat_id {
                *slot = new;
            }
            return Put::Stored;
        }
        i += 1;
    }
    unsafe { core::ptr::write_volatile(s.overflow(), 1) };
    Put::Elsewhere
}

/// The frontend `peer` stands for on `sk`, as far as its slots know.
#[inline(always)]
pub fn get<S: Store>(sk: Sk, peer: Endpoint<Addr<S>>) -> Get<Addr<S>> {
    let Some(s) = storage::<S>(sk, false) else {
        return Get::TryLru;
    };
    // SAFETY: fields of the live storage value.
    let used = usize::from(unsafe { core::ptr::read_volatile(s.used()) });
    let mut i = 0;
    while i < SK_STORE_SLOTS && i < used {
        if let Some(slot) = s.slot(i) {
            let (b, f, _) = S::read(slot);
            if same_endpoint::<S::A>(b, peer) {
                return Get::Frontend(f);
            }
        }
        i += 1;
    }
    // SAFETY: as above.
    if unsafe { core::ptr::read_volatile(s.overflow()) } != 0 {
        Get::TryLru
    } else {
        Get::None
    }
}

impl Store for SkStore4 {
    type A = V4;
    type Slot = SkSlot4;
    #[inline(always)]
    fn map() -> *mut c_void {
        core::ptr::from_ref(&SK_STORE4).cast_mut().cast()
    }
    #[inline(always)]
    fn used(&mut self) -> *mut u8 {
        &mut self.used
    }
    #[inline(always)]
    fn overflow(&mut self) -> *mut u8 {
        &mut self.overflow
    }
    #[inline(always)]
    fn slot(&mut self, i: usize) -> Option<&mut SkSlot4> {
        self.slots.get_mut(i)
    }
    #[inline(always)]
    fn make(b: Endpoint<[u8; 4]>, f: Endpoint<[u8; 4]>, rev_nat_id: u32) -> SkSlot4 {
        SkSlot4 {
            backend: b.addr,
            frontend: f.addr,
            backend_port: b.port,
            frontend_port: f.port,
            rev_nat_id,
        }
    }
    #[inline(always)]
    fn read(s: &SkSlot4) -> (Endpoint<[u8; 4]>, Endpoint<[u8; 4]>, u32) {
        (
            Endpoint {
                addr: s.backend,
                port: s.backend_port,
            },
            Endpoint {
                addr: s.frontend,
                port: s.frontend_port,
            },
            s.rev_nat_id,
        )
    }
}

impl Store for SkStore6 {
    type A = V6;
    type Slot = SkSlot6;
    #[inline(always)]
    fn map() -> *mut c_void {
        core::ptr::from_ref(&SK_STORE6).cast_mut().cast()
    }
    #[inline(always)]
    fn used(&mut self) -> *mut u8 {
        &mut self.used
    }
    #[inline(always)]
    fn overflow(&mut self) -> *mut u8 {
        &mut self.overflow
    }
    #[inline(always)]
    fn slot(&mut self, i: usize) -> Option<&mut SkSlot6> {
        self.slots.get_mut(i)
    }
    #[inline(always)]
    fn make(b: Endpoint<[u8; 16]>, f: Endpoint<[u8; 16]>, rev_nat_id: u32) -> SkSlot6 {
        SkSlot6 {
            backend: b.addr,
            frontend: f.addr,
            backend_port: b.port,
            frontend_port: f.port,
            rev_nat_id,
        }
    }
    #[inline(always)]
    fn read(s: &SkSlot6) -> (Endpoint<[u8; 16]>, Endpoint<[u8; 16]>, u32) {
        (
            Endpoint {
                addr: s.backend,
                port: s.backend_port,
            },
            Endpoint {
                addr: s.frontend,
                port: s.frontend_port,
            },
            s.rev_nat_id,
        )
    }
}

/// `-EEXIST`, as map updates return it.
const EEXIST: i32 = -17;

/// Remembers that the socket talks to `backend` for `frontend`: in its storage if it has
/// some, else in `lb*_sk_revnat` under its cookie, where a pair already there makes the
/// storage (see the module docs); a socket whose slots are full keeps the rest in the LRU.
#[inline(always)]
pub fn remember<A: Af>(
    sk: impl FnOnce() -> Sk,
    mut cookie: impl FnMut() -> u64,
    backend: Endpoint<A::Addr>,
    frontend: Endpoint<A::Addr>,
    rev_nat_id: u32,
    connect: bool,
) -> Result<(), i32> {
    if !enabled() {
        return A::sk_revnat_put(cookie(), backend, frontend, rev_nat_id, BPF_ANY.into());
    }
    let sk = sk();
    let s = match storage::<A::Store>(sk, false) {
        Some(s) => s,
        None => {
            let first =
                A::sk_revnat_put(cookie(), backend, frontend, rev_nat_id, BPF_NOEXIST.into());
            match first {
                Err(EEXIST) => {}
                other => return other,
            }
            let Some(s) = storage::<A::Store>(sk, true) else {
                // No memory for storage: the LRU's pair is still the socket's.
                return A::sk_revnat_put(cookie(), backend, frontend, rev_nat_id, BPF_ANY.into());
            };
            count(metrics::SOCK_STORAGE_CREATED, 0);
            // The socket's earlier pairs are in the LRU: readers must look there too.
            // SAFETY: a field of the live storage value.
            unsafe { core::ptr::write_volatile(s.overflow(), 1) };
            s
        }
    };
    if put::<A::Store>(s, backend, frontend, rev_nat_id, connect) == Put::Stored {
        return Ok(());
    }
    A::sk_revnat_put(cookie(), backend, frontend, rev_nat_id, BPF_ANY.into())
}

/// The frontend `peer` stands for on the socket, wherever `remember` put it.
#[inline(always)]
pub fn recall<A: Af>(
    sk: impl FnOnce() -> Option<Sk>,
    cookie: impl FnOnce() -> u64,
    peer: Endpoint<A::Addr>,
) -> Option<Endpoint<A::Addr>> {
    if enabled() {
        if let Some(sk) = sk() {
            match get::<A::Store>(sk, peer) {
                Get::Frontend(f) => return Some(f),
                Get::None => return None,
                Get::TryLru => {}
            }
        }
    }
    A::sk_revnat_get(cookie(), peer)
}
