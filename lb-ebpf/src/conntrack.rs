//! Conntrack of tc-balanced flows: a service entry keyed as the client sent the packet (so
//! later packets keep their backend) and a reply entry keyed as the backend answers (so its
//! source can be turned back into the frontend). Both carry the same value; lifetimes follow
//! the TCP or SCTP state seen in either direction.
//!
//! SCTP is tracked like TCP: INIT opens (like SYN), ABORT and SHUTDOWN COMPLETE close (like
//! RST/FIN). Only the first chunk of a packet is looked at.
use aya_ebpf::helpers::bpf_ktime_get_ns;
use lb_common::{CtValue, IPPROTO_SCTP, IPPROTO_TCP, ct_dir, ct_flags, ct_timeouts};

use crate::{
    af::{Af, Endpoint},
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

/// Seconds an entry lives; SCTP uses TCP's lifetimes (see `ct_timeouts`).
#[inline(always)]
fn lifetime(proto: u8, flags: u16) -> u32 {
    if proto != IPPROTO_TCP && proto != IPPROTO_SCTP {
        ct_timeouts::NON_TCP
    } else if flags & (ct_flags::TX_CLOSING | ct_flags::RX_CLOSING) != 0 {
        ct_timeouts::TCP_CLOSING
    } else if flags & ct_flags::SEEN_REPLY != 0 {
        ct_timeouts::TCP_ESTABLISHED
    } else {
        ct_timeouts::TCP_SYN
    }
}

/// The entry with `flags` and a fresh expiry, if it differs enough from `v` to be written.
#[inline(always)]
fn refreshed(v: &CtValue, flags: u16, now: u32, proto: u8) -> Option<CtValue> {
    let expires = now + lifetime(proto, flags);
    if flags == v.flags && expires.abs_diff(v.expires) < ct_timeouts::REFRESH_GRANULARITY {
        return None;
    }
    Some(CtValue {
        expires,
        flags,
        ..*v
    })
}

/// The live flow of a client → frontend packet whose backend still exists, its entries
/// refreshed. `None` for a new flow, an expired one, a SYN or INIT reusing a closed flow's
/// 5-tuple (balanced afresh), or one whose backend is gone (re-balanced rather than
/// blackholed).
#[inline(always)]
pub fn established<A: Af>(p: &Packet<A::Addr>, now: u32) -> Option<Flow<A::Addr>> {
    let fkey = A::ct_key(p.saddr, p.daddr, p.sport, p.dport, p.proto, ct_dir::SERVICE);
    let ct = A::ct_get(&fkey)?;
    // SAFETY: map value pointer from a successful lookup, valid for the program's run.
    let v = unsafe { *ct };
    let reopened = opening(p) && v.flags & (ct_flags::TX_CLOSING | ct_flags::RX_CLOSING) != 0;
    if v.expires <= now || reopened {
        return None;
    }
    let backend = A::backend(v.backend_id)?;
    let flags = v.flags | closing(p, ct_flags::TX_CLOSING);
    if let Some(nv) = refreshed(&v, flags, now, p.proto) {
        // SAFETY: as above.
        unsafe { *ct = nv };
        // Recreates the reply entry if LRU pressure evicted it.
        let rkey = A::ct_key(
            backend.addr,
            p.saddr,
            backend.port,
            p.sport,
            p.proto,
            ct_dir::REPLY,
        );
        let _ = A::ct_put(&rkey, &nv);
    }
    Some(Flow {
        endpoint: backend,
        backend_id: v.backend_id,
        rev_nat_id: v.rev_nat_id,
    })
}

/// Records a new flow of `p` to `backend` (both entries).
#[inline(always)]
pub fn create<A: Af>(
    p: &Packet<A::Addr>,
    backend: Endpoint<A::Addr>,
    backend_id: u32,
    rev_nat_id: u32,
    now: u32,
) -> Result<(), i32> {
    let flags = closing(p, ct_flags::TX_CLOSING);
    let v = CtValue {
        backend_id,
        rev_nat_id,
        expires: now + lifetime(p.proto, flags),
        flags,
        pad: 0,
    };
    let fkey = A::ct_key(p.saddr, p.daddr, p.sport, p.dport, p.proto, ct_dir::SERVICE);
    let rkey = A::ct_key(
        backend.addr,
        p.saddr,
        backend.port,
        p.sport,
        p.proto,
        ct_dir::REPLY,
    );
    A::ct_put(&fkey, &v)?;
    A::ct_put(&rkey, &v)
}

/// The frontend a backend's reply must come from, its entries refreshed (marked as having
/// seen a reply). `None` if `p` is not a live reply.
#[inline(always)]
pub fn reply<A: Af>(p: &Packet<A::Addr>) -> Option<Flow<A::Addr>> {
    let rkey = A::ct_key(p.saddr, p.daddr, p.sport, p.dport, p.proto, ct_dir::REPLY);
    let ct = A::ct_get(&rkey)?;
    // SAFETY: map value pointer from a successful lookup, valid for the program's run.
    let v = unsafe { *ct };
    let now = now_secs();
    if v.expires <= now {
        return None;
    }
    let frontend = A::revnat(v.rev_nat_id)?;
    let flags = v.flags | ct_flags::SEEN_REPLY | closing(p, ct_flags::RX_CLOSING);
    if let Some(nv) = refreshed(&v, flags, now, p.proto) {
        // SAFETY: as above.
        unsafe { *ct = nv };
        let fkey = A::ct_key(
            p.daddr,
            frontend.addr,
            p.dport,
            frontend.port,
            p.proto,
            ct_dir::SERVICE,
        );
        if let Some(f) = A::ct_get(&fkey) {
            // SAFETY: as above.
            unsafe {
                (*f).flags |= flags;
                (*f).expires = nv.expires;
            }
        }
    }
    Some(Flow {
        endpoint: frontend,
        backend_id: v.backend_id,
        rev_nat_id: v.rev_nat_id,
    })
}
