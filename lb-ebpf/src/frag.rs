//! IP fragments of balanced datagrams (UDP beyond the MTU: DNS over EDNS, QUIC probes, NFS).
//! Only a datagram's first fragment carries the ports a frontend and a flow are matched by.
//! Once its decision is made, it leaves in `lb4_frags` / `lb6_frags`, under the datagram's
//! key (addresses, protocol, identification) as it arrived, its ports and the flow it was
//! translated with (the conntrack entry's backend and NAT port; none if it was not). Each
//! later fragment, arriving with the same key, takes the ports from there, meets conntrack
//! like any packet of the flow, and is translated only if the flow is still the one its first
//! fragment got (`packet::handle`): a later fragment never gets a translation of its own. One
//! that arrives before its first, or after its entry was evicted, passes untouched and is
//! counted (`metrics::TC_PASS_FRAGMENT_UNKNOWN`), as Cilium does.
//!
//! Socket LB needs none of this: it rewrites the socket's destination, and the stack
//! fragments the datagram after that.
use lb_common::{Frag4Key, Frag6Key, FragEntry};

use crate::{
    af::{Af, V4, V6},
    maps::{FRAGS4, FRAGS6, scratch},
    parse::Packet,
};

/// The flow a first fragment was translated with: its conntrack entry's backend and NAT port
/// (`conntrack::pin`); zero for none.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Pin {
    pub backend_id: u32,
    pub nat_port: u16,
}

/// Per-family fragment map access.
pub trait FragAf: Af {
    fn put(p: &Packet<Self::Addr>, e: &FragEntry);
    fn get(p: &Packet<Self::Addr>) -> Option<FragEntry>;
}

impl FragAf for V4 {
    #[inline(always)]
    fn put(p: &Packet<[u8; 4]>, e: &FragEntry) {
        let _ = FRAGS4.insert(&key4(p), e, 0);
    }

    #[inline(always)]
    fn get(p: &Packet<[u8; 4]>) -> Option<FragEntry> {
        // SAFETY: value pointer of a successful lookup, valid for this run (see `af`).
        FRAGS4.get_ptr(&key4(p)).map(|v| unsafe { *v })
    }
}

impl FragAf for V6 {
    #[inline(always)]
    fn put(p: &Packet<[u8; 16]>, e: &FragEntry) {
        let _ = FRAGS6.insert(&key6(p), e, 0);
    }

    #[inline(always)]
    fn get(p: &Packet<[u8; 16]>) -> Option<FragEntry> {
        // SAFETY: as for IPv4.
        FRAGS6.get_ptr(&key6(p)).map(|v| unsafe { *v })
    }
}

#[inline(always)]
fn key4(p: &Packet<[u8; 4]>) -> Frag4Key {
    Frag4Key {
        saddr: p.saddr,
        daddr: p.daddr,
        id: p.frag_id,
        proto: p.proto,
        pad: [0; 3],
    }
}

#[inline(always)]
fn key6(p: &Packet<[u8; 16]>) -> Frag6Key {
    Frag6Key {
        saddr: p.saddr,
        daddr: p.daddr,
        id: p.frag_id,
        proto: p.proto,
        pad: [0; 3],
    }
}

/// A first fragment, decided: remembers its ports and the flow it got for the later ones (a
/// failed insert only means they pass untouched).
// A subprogram: the key stays out of every other frame.
#[inline(never)]
pub fn remember<A: FragAf>(p: &Packet<A::Addr>, pin: Pin) {
    A::put(
        p,
        &FragEntry {
            sport: p.sport,
            dport: p.dport,
            backend_id: pin.backend_id,
            nat_port: pin.nat_port,
            pad: 0,
        },
    );
}

/// A later fragment: takes the ports its first fragment had and keeps the flow it got in
/// scratch (`pinned`); `false` if the first fragment was not seen.
#[inline(never)]
pub fn recall<A: FragAf>(p: &mut Packet<A::Addr>) -> bool {
    let Some(e) = A::get(p) else {
        return false;
    };
    let Some(s) = scratch() else {
        return false;
    };
    p.sport = e.sport;
    p.dport = e.dport;
    // SAFETY: this CPU's scratch `frag_pin` (8 bytes, 8-aligned), written only here.
    unsafe {
        *(*s).frag_pin.as_mut_ptr().cast::<Pin>() = Pin {
            backend_id: e.backend_id,
            nat_port: e.nat_port,
        };
    }
    true
}

/// Whether a flow (`backend_id`, `nat_port` of the conntrack entry a later fragment met) is
/// the one its first fragment got (`recall`).
#[inline(always)]
pub fn follows_first(backend_id: u32, nat_port: u16) -> bool {
    let Some(s) = scratch() else {
        return false;
    };
    // SAFETY: as in `recall`, which wrote it for this packet.
    let pin = unsafe { *(*s).frag_pin.as_ptr().cast::<Pin>() };
    pin.backend_id != 0 && pin.backend_id == backend_id && pin.nat_port == nat_port
}
