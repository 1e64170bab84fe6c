//! Conntrack of tc-balanced flows: a service entry keyed as the client sent the packet (so
//! later packets keep their backend) and a reply entry keyed as the backend answers (so its
//! source can be turned back into the frontend). Both carry the same ids, flags and expiry;
//! lifetimes follow the TCP or SCTP state seen in either direction.
//!
//! SCTP is tracked like TCP: INIT opens (like SYN), ABORT and SHUTDOWN COMPLETE close (like
//! RST/FIN). Only the first chunk of a packet is looked at.
//!
//! A masqueraded flow (`ct_flags::SNAT`, see `nat`) is keyed the same way: its reply entry is
//! what the backend sends back, to the node IP and NAT port, and its NAT fields hold the
//! client to restore; the service entry's NAT fields hold that node IP and port.
//!
//! Entries are read and refreshed in place through their `CtHead`; the steps are BPF
//! subprograms of their own (`inline(never)`) so their keys and values do not add to the
//! frames of the tc path, which share one 512-byte stack.
use aya_ebpf::{bindings::BPF_NOEXIST, helpers::bpf_ktime_get_ns};
use lb_common::{IPPROTO_SCTP, IPPROTO_TCP, ct_dir, ct_flags, ct_timeouts};

use crate::{
    af::{Af, CtHead, Endpoint, KeySlot},
    parse::{
        Packet, SCTP_ABORT, SCTP_INIT, SCTP_SHUTDOWN_COMPLETE, TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN,
    },
};

/// A flow conntrack already knows, and where it goes.
pub struct Flow<A> {
    /// The backend (established flows) or the frontend (replies) to rewrite to.
    pub endpoint: Endpoint<A>,
    pub backend_id: u32,
    pub rev_nat_id: u32,
    /// Masqueraded flows (`ct_flags::SNAT` in `flags`): the node-side source (established) or
    /// the client (replies). Always written, zero otherwise: an `Option` here would be copied
    /// with an uninitialised payload, a stack read verifiers before 6.x refuse.
    pub nat: Endpoint<A>,
    /// The entry's `ct_flags`.
    pub flags: u16,
}

impl<A> Flow<A> {
    /// Whether the flow is masqueraded (`nat` holds its other side).
    #[inline(always)]
    pub fn masqueraded(&self) -> bool {
        self.flags & ct_flags::SNAT != 0
    }
}

#[inline(always)]
pub fn now_secs() -> u32 {
    // SAFETY: helper without arguments.
    (unsafe { bpf_ktime_get_ns() } / 1_000_000_000) as u32
}

/// The flag a TCP FIN or RST, or an SCTP ABORT or SHUTDOWN COMPLETE, sets for the side that
/// sent it.
#[inline(always)]
fn closing<A>(p: &Packet<A>, flag: u16) -> u16 {
    let closes = match p.proto {
        IPPROTO_TCP => p.tcp_flags & (TCP_FIN | TCP_RST) != 0,
        IPPROTO_SCTP => p.sctp_chunk == SCTP_ABORT || p.sctp_chunk == SCTP_SHUTDOWN_COMPLETE,
        _ => false,
    };
    if closes { flag } else { 0 }
}

/// Whether `p` opens a new connection: a TCP SYN (without ACK) or an SCTP INIT.
#[inline(always)]
fn opening<A>(p: &Packet<A>) -> bool {
    match p.proto {
        IPPROTO_TCP => p.tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN,
        IPPROTO_SCTP => p.sctp_chunk == SCTP_INIT,
        _ => false,
    }
}

/// Whether `p` belongs to a connection it does not open: TCP without SYN, SCTP without INIT.
/// Such a packet without a conntrack entry lost it (eviction, expiry, a removed backend).
#[inline(always)]
pub fn midstream<A>(p: &Packet<A>) -> bool {
    match p.proto {
        IPPROTO_TCP => p.tcp_flags & TCP_SYN == 0,
        IPPROTO_SCTP => p.sctp_chunk != SCTP_INIT,
        _ => false,
    }
}

// The lifetimes, set by the loader (`lb_common::globals::CT_TIMEOUT_*`, from the
// `--bpf-ct-timeout-regular-*` flags). Frozen .rodata: the verifier sees constants, and each
// load carries its own, so no pinned layout has to hold them.
#[unsafe(no_mangle)]
static LB_CT_TCP_SYN: u32 = ct_timeouts::TCP_SYN;
#[unsafe(no_mangle)]
static LB_CT_TCP: u32 = ct_timeouts::TCP_ESTABLISHED;
#[unsafe(no_mangle)]
static LB_CT_TCP_FIN: u32 = ct_timeouts::TCP_CLOSING;
#[unsafe(no_mangle)]
static LB_CT_ANY: u32 = ct_timeouts::NON_TCP;

/// A lifetime global as the loader set it.
#[inline(always)]
fn timeout(g: &'static u32) -> u32 {
    // SAFETY: a plain read of a static; volatile so the compiler keeps the load the loader's
    // value feeds instead of folding in the default it was compiled with.
    unsafe { core::ptr::read_volatile(g) }
}

/// Seconds an entry lives; SCTP uses TCP's lifetimes (see `ct_timeouts`).
#[inline(always)]
fn lifetime(proto: u8, flags: u16) -> u32 {
    if proto != IPPROTO_TCP && proto != IPPROTO_SCTP {
        timeout(&LB_CT_ANY)
    } else if flags & (ct_flags::TX_CLOSING | ct_flags::RX_CLOSING) != 0 {
        timeout(&LB_CT_TCP_FIN)
    } else if flags & ct_flags::SEEN_REPLY != 0 {
        timeout(&LB_CT_TCP)
    } else {
        timeout(&LB_CT_TCP_SYN)
    }
}

/// The new expiry for an entry going from `(flags, expires)` to `new_flags`, if the entry
/// differs enough to be written.
#[inline(always)]
fn refreshed(flags: u16, expires: u32, new_flags: u16, now: u32, proto: u8) -> Option<u32> {
    let new = now + lifetime(proto, new_flags);
    if new_flags == flags && new.abs_diff(expires) < ct_timeouts::REFRESH_GRANULARITY {
        return None;
    }
    Some(new)
}

/// The service entry's key of `p` (scratch slot `KeySlot::Service`), keyed as the client sent it.
#[inline(always)]
fn service_key<A: Af>(p: &Packet<A::Addr>) -> Option<&'static A::CtKey> {
    A::ct_key(
        KeySlot::Service,
        p.saddr,
        p.daddr,
        p.sport,
        p.dport,
        p.proto,
        ct_dir::SERVICE,
    )
}

/// The reply entry's key (scratch slot `KeySlot::Reply`): what `backend` sends back to the
/// client, or to the node IP and NAT port of a masqueraded flow.
#[inline(always)]
pub fn reply_key<A: Af>(
    backend: &Endpoint<A::Addr>,
    to_addr: &A::Addr,
    to_port: u16,
    proto: u8,
) -> Option<&'static A::CtKey> {
    A::ct_key(
        KeySlot::Reply,
        backend.addr,
        *to_addr,
        backend.port,
        to_port,
        proto,
        ct_dir::REPLY,
    )
}

/// Rewrites the reply entry of a flow of `p` to `backend` with `head` (its NAT fields naming
/// the client for a masqueraded flow, `masq`, whose node side is `snat`), recreating it if LRU pressure
/// evicted it; never takes over another flow's entry, since a masqueraded flow's reply key is
/// only ever claimed with `BPF_NOEXIST` (`nat::allocate`).
#[inline(always)]
fn refresh_reply<A: Af>(
    p: &Packet<A::Addr>,
    backend: &Endpoint<A::Addr>,
    snat: &Endpoint<A::Addr>,
    masq: bool,
    head: &CtHead,
) {
    let (to_addr, to_port, nat_addr) = if masq {
        (snat.addr, snat.port, p.saddr)
    } else {
        (p.saddr, p.sport, A::ZERO)
    };
    let Some(key) = reply_key::<A>(backend, &to_addr, to_port, p.proto) else {
        return;
    };
    match A::ct_get(key) {
        Some(r) => {
            // SAFETY: pointer from a successful lookup in this run.
            unsafe {
                let snat_bit = head.flags & ct_flags::SNAT;
                let ours = (*r).flags & ct_flags::SNAT == snat_bit
                    && (snat_bit == 0
                        || ((*r).nat_port == head.nat_port
                            && A::same(A::ct_nat_addr(r), nat_addr)));
                if ours {
                    (*r).flags = head.flags;
                    (*r).expires = head.expires;
                }
            }
        }
        None => {
            let _ = A::ct_put(key, head, &nat_addr, BPF_NOEXIST as u64);
        }
    }
}

/// `established`: no live entry; the packet opens a new flow (or is re-balanced as one).
pub const CT_NEW: u8 = 0;
/// `established`: the flow's entry and its backend, in `out`.
pub const CT_ESTABLISHED: u8 = 1;
/// `established`: a TCP packet without SYN met a live entry whose backend is gone; `out`
/// holds the entry's ids and flags (its endpoints zero). The caller answers with a RST and
/// deletes the entry (`forget`).
pub const CT_BACKEND_GONE: u8 = 2;

/// The live flow of a client → frontend packet whose backend still exists (written to `out`),
/// its entries refreshed: `CT_ESTABLISHED`. `CT_NEW` for a new flow, an expired one, a SYN or
/// INIT reusing a closed flow's 5-tuple (balanced afresh), or a UDP/SCTP packet or TCP SYN
/// whose backend is gone (re-balanced rather than blackholed); `CT_BACKEND_GONE` for any other
/// TCP packet whose backend is gone: the connection cannot continue anywhere else.
#[inline(never)]
pub fn established<A: Af>(p: &Packet<A::Addr>, now: u32, out: &mut Flow<A::Addr>) -> u8 {
    let Some(key) = service_key::<A>(p) else {
        return CT_NEW;
    };
    let Some(h) = A::ct_get(key) else {
        return CT_NEW;
    };
    // SAFETY: pointer from a successful lookup, valid for this run (see `af`).
    let v = unsafe { *h };
    let reopened = opening(p) && v.flags & (ct_flags::TX_CLOSING | ct_flags::RX_CLOSING) != 0;
    if v.expires <= now || reopened {
        return CT_NEW;
    }
    let Some(backend) = A::backend(v.backend_id) else {
        if p.proto != IPPROTO_TCP || p.tcp_flags & TCP_SYN != 0 {
            return CT_NEW;
        }
        *out = Flow {
            endpoint: Endpoint {
                addr: A::ZERO,
                port: 0,
            },
            backend_id: v.backend_id,
            rev_nat_id: v.rev_nat_id,
            nat: Endpoint {
                addr: A::ZERO,
                port: 0,
            },
            flags: v.flags,
        };
        return CT_BACKEND_GONE;
    };
    // Zero in entries without `ct_flags::SNAT`.
    let nat = Endpoint {
        // SAFETY: as above.
        addr: unsafe { A::ct_nat_addr(h) },
        port: v.nat_port,
    };
    let snat = v.flags & ct_flags::SNAT != 0;
    let flags = v.flags | closing(p, ct_flags::TX_CLOSING);
    if let Some(expires) = refreshed(v.flags, v.expires, flags, now, p.proto) {
        // SAFETY: as above.
        unsafe {
            (*h).flags = flags;
            (*h).expires = expires;
        }
        let head = CtHead {
            flags,
            expires,
            nat_port: if snat { p.sport } else { 0 },
            ..v
        };
        refresh_reply::<A>(p, &backend, &nat, snat, &head);
    }
    *out = Flow {
        endpoint: backend,
        backend_id: v.backend_id,
        rev_nat_id: v.rev_nat_id,
        nat,
        flags: v.flags,
    };
    CT_ESTABLISHED
}

/// Deletes the service entry of `p`'s flow (its backend is gone). The reply entry, keyed on
/// the gone backend's address that nothing here knows any more, is left to expire or to the
/// userspace GC (`backend_gone`).
#[inline(always)]
pub fn forget<A: Af>(p: &Packet<A::Addr>) {
    if let Some(key) = service_key::<A>(p) {
        A::ct_del(key);
    }
}

/// The head a new flow of `p` to a frontend with `svc_flags` starts with (no NAT yet).
#[inline(always)]
pub fn new_head<A>(
    p: &Packet<A>,
    backend_id: u32,
    rev_nat_id: u32,
    svc_flags: u16,
    now: u32,
) -> CtHead {
    let mut flags = closing(p, ct_flags::TX_CLOSING);
    if svc_flags & lb_common::svc_flags::LOCAL_ADDR != 0 {
        flags |= ct_flags::LOCAL_FRONTEND;
    }
    CtHead {
        backend_id,
        rev_nat_id,
        expires: now + lifetime(p.proto, flags),
        flags,
        nat_port: 0,
    }
}

/// Records a new flow of `p` to `backend` starting as `head`. A masqueraded flow (`snat` its
/// node-side source; a port of 0, which `nat::allocate` never hands out, for none) already holds its reply entry (`nat::allocate`), so only the service
/// entry is written, with `ct_flags::SNAT` and the node side.
#[inline(never)]
pub fn create<A: Af>(
    p: &Packet<A::Addr>,
    backend: &Endpoint<A::Addr>,
    head: &CtHead,
    snat: &Endpoint<A::Addr>,
) -> Result<(), i32> {
    let fkey = service_key::<A>(p).ok_or(-1)?;
    if snat.port != 0 {
        let h = CtHead {
            flags: head.flags | ct_flags::SNAT,
            nat_port: snat.port,
            ..*head
        };
        return A::ct_put(fkey, &h, &snat.addr, 0);
    }
    A::ct_put(fkey, head, &A::ZERO, 0)?;
    let rkey = reply_key::<A>(backend, &p.saddr, p.sport, p.proto).ok_or(-1)?;
    A::ct_put(rkey, head, &A::ZERO, 0)
}

/// The frontend a backend's reply must come from (written to `out`), its entries refreshed
/// (marked as having seen a reply). `false` if `p` is not a live reply.
#[inline(never)]
pub fn reply<A: Af>(p: &Packet<A::Addr>, out: &mut Flow<A::Addr>) -> bool {
    match reply_flow::<A>(p) {
        Some(f) => {
            *out = f;
            true
        }
        None => false,
    }
}

#[inline(always)]
fn reply_flow<A: Af>(p: &Packet<A::Addr>) -> Option<Flow<A::Addr>> {
    let rkey = A::ct_key(
        KeySlot::Reply,
        p.saddr,
        p.daddr,
        p.sport,
        p.dport,
        p.proto,
        ct_dir::REPLY,
    )?;
    let h = A::ct_get(rkey)?;
    // SAFETY: pointer from a successful lookup, valid for this run (see `af`).
    let v = unsafe { *h };
    let now = now_secs();
    if v.expires <= now {
        return None;
    }
    let frontend = A::revnat(v.rev_nat_id)?;
    // The client the service entry is keyed on: the reply's destination, or the client a
    // masqueraded flow's reply entry remembers.
    // Zero in entries without `ct_flags::SNAT`.
    let nat = Endpoint {
        // SAFETY: as above.
        addr: unsafe { A::ct_nat_addr(h) },
        port: v.nat_port,
    };
    let flags = v.flags | ct_flags::SEEN_REPLY | closing(p, ct_flags::RX_CLOSING);
    if let Some(expires) = refreshed(v.flags, v.expires, flags, now, p.proto) {
        // SAFETY: as above.
        unsafe {
            (*h).flags = flags;
            (*h).expires = expires;
        }
        let (caddr, cport) = if v.flags & ct_flags::SNAT != 0 {
            (nat.addr, nat.port)
        } else {
            (p.daddr, p.dport)
        };
        let fkey = A::ct_key(
            KeySlot::Service,
            caddr,
            frontend.addr,
            cport,
            frontend.port,
            p.proto,
            ct_dir::SERVICE,
        );
        if let Some(f) = fkey.and_then(A::ct_get) {
            // Only the flow this reply entry is of: once the client reopened it, the service
            // entry names the new flow's backend (or NAT port), and a late reply of the old
            // one must neither keep it alive nor mark it closing, which would leave the new
            // reply entry to expire under a live flow.
            // SAFETY: as above.
            unsafe {
                let ours = (*f).backend_id == v.backend_id
                    && (v.flags & ct_flags::SNAT == 0 || (*f).nat_port == p.dport);
                if ours {
                    (*f).flags |= flags;
                    (*f).expires = expires;
                }
            }
        }
    }
    Some(Flow {
        endpoint: frontend,
        backend_id: v.backend_id,
        rev_nat_id: v.rev_nat_id,
        nat,
        flags: v.flags,
    })
}

/// The flow an ICMP error's quote `q` belongs to, written to `out`. Looked up reversed (the
/// quote is what one side sent, the entry is keyed as the other side's packets are): with
/// `ct_dir::REPLY` the quote is a packet lb sent to a backend (client, or node when
/// masqueraded → backend), found by its reply entry (`endpoint` the frontend, `nat` the
/// masqueraded client); with `ct_dir::SERVICE` it is a reply lb reverse-NATed (frontend →
/// client), found by the client's service entry (`endpoint` the backend, `nat` the node side
/// of a masqueraded flow). Nothing is refreshed: an error keeps no flow alive.
#[inline(never)]
pub fn related<A: Af>(q: &Packet<A::Addr>, dir: u8, out: &mut Flow<A::Addr>) -> bool {
    let slot = if dir == ct_dir::REPLY {
        KeySlot::Reply
    } else {
        KeySlot::Service
    };
    let Some(key) = A::ct_key(slot, q.daddr, q.saddr, q.dport, q.sport, q.proto, dir) else {
        return false;
    };
    let Some(h) = A::ct_get(key) else {
        return false;
    };
    // SAFETY: pointer from a successful lookup, valid for this run (see `af`).
    let v = unsafe { *h };
    if v.expires <= now_secs() {
        return false;
    }
    let endpoint = if dir == ct_dir::REPLY {
        A::revnat(v.rev_nat_id)
    } else {
        A::backend(v.backend_id)
    };
    let Some(endpoint) = endpoint else {
        return false;
    };
    *out = Flow {
        endpoint,
        backend_id: v.backend_id,
        rev_nat_id: v.rev_nat_id,
        nat: Endpoint {
            // SAFETY: as above.
            addr: unsafe { A::ct_nat_addr(h) },
            port: v.nat_port,
        },
        flags: v.flags,
    };
    true
}

/// The flow a first fragment `p` was just translated with (`frag`): its service entry's
/// backend and NAT port when it went to a frontend, else its reply entry's when it was a
/// reply; zero when it has neither (it was not translated).
#[inline(never)]
pub fn pin<A: Af>(p: &Packet<A::Addr>) -> crate::frag::Pin {
    let now = now_secs();
    for dir in [ct_dir::SERVICE, ct_dir::REPLY] {
        let slot = if dir == ct_dir::SERVICE {
            KeySlot::Service
        } else {
            KeySlot::Reply
        };
        let key = A::ct_key(slot, p.saddr, p.daddr, p.sport, p.dport, p.proto, dir);
        if let Some(h) = key.and_then(A::ct_get) {
            // SAFETY: pointer from a successful lookup, valid for this run (see `af`).
            let v = unsafe { *h };
            if v.expires > now {
                return crate::frag::Pin {
                    backend_id: v.backend_id,
                    nat_port: v.nat_port,
                };
            }
        }
    }
    crate::frag::Pin {
        backend_id: 0,
        nat_port: 0,
    }
}
