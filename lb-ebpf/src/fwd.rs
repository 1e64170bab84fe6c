//! Forwarding of masqueraded packets (and replies restored to a local frontend) past the
//! stack's routing.
//!
//! A masqueraded packet carries one of the node's own addresses as its source, and IPv4 input
//! drops such a packet as a martian; so does a NodePort reply once its source is the node IP. So instead of handing it to the stack, the tc program
//! looks the backend up in the FIB itself and redirects the packet to the egress of the device
//! that route leaves by (the device it came in on, for hairpin traffic), decrementing the TTL
//! as forwarding would. Netfilter's forward and postrouting hooks are skipped for these
//! packets.
use aya_ebpf::bindings::{
    BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_NOT_FWDED, BPF_FIB_LKUP_RET_SUCCESS, bpf_fib_lookup,
};
use lb_common::metrics;

use crate::{
    af::{V4, V6},
    ctx::{Error, PacketCtx},
    maps::{count, scratch},
    parse::Packet,
    rewrite::RewriteAf,
};

const AF_INET: u8 = 2;
const AF_INET6: u8 = 10;

/// Per-family FIB queries and hop-limit handling.
pub trait FwdAf: RewriteAf {
    /// FIB parameters for forwarding `p` (already rewritten) from `src` to `dst`, arrived on
    /// `ifindex`.
    fn fib_params(
        p: &Packet<Self::Addr>,
        src: Self::Addr,
        dst: Self::Addr,
        ifindex: u32,
    ) -> bpf_fib_lookup;
    /// Decrements the TTL / hop limit; `false` if it would reach zero (the stack then sends
    /// the ICMP error).
    fn decrement_ttl<C: PacketCtx>(ctx: &C, p: &Packet<Self::Addr>) -> Result<bool, Error>;
}

#[inline(always)]
fn params_base<A>(p: &Packet<A>, family: u8, ifindex: u32) -> bpf_fib_lookup {
    // SAFETY: bpf_fib_lookup is plain old data; all-zero is a valid (empty) query.
    let mut params: bpf_fib_lookup = unsafe { core::mem::zeroed() };
    params.family = family;
    params.l4_protocol = p.proto;
    params.sport = p.sport.to_be();
    params.dport = p.dport.to_be();
    params.ifindex = ifindex;
    params
}

impl FwdAf for V4 {
    #[inline(always)]
    fn fib_params(p: &Packet<[u8; 4]>, src: [u8; 4], dst: [u8; 4], ifindex: u32) -> bpf_fib_lookup {
        let mut params = params_base(p, AF_INET, ifindex);
        params.__bindgen_anon_3.ipv4_src = u32::from_ne_bytes(src);
        params.__bindgen_anon_4.ipv4_dst = u32::from_ne_bytes(dst);
        params
    }

    #[inline(always)]
    fn decrement_ttl<C: PacketCtx>(ctx: &C, p: &Packet<[u8; 4]>) -> Result<bool, Error> {
        let [ttl, proto] = ctx.load::<[u8; 2]>(p.l3_off + 8)?;
        if ttl <= 1 {
            return Ok(false);
        }
        // TTL and protocol share the 16-bit checksum word.
        let old = u16::from_ne_bytes([ttl, proto]) as u64;
        let new = u16::from_ne_bytes([ttl - 1, proto]) as u64;
        ctx.l3_csum_replace(p.l3_off + 10, old, new, 2)?;
        ctx.store(p.l3_off + 8, &(ttl - 1))?;
        Ok(true)
    }
}

impl FwdAf for V6 {
    #[inline(always)]
    fn fib_params(
        p: &Packet<[u8; 16]>,
        src: [u8; 16],
        dst: [u8; 16],
        ifindex: u32,
    ) -> bpf_fib_lookup {
        let mut params = params_base(p, AF_INET6, ifindex);
        let words = |a: [u8; 16]| {
            let mut w = [0u32; 4];
            for (i, word) in w.iter_mut().enumerate() {
                *word = u32::from_ne_bytes([a[i * 4], a[i * 4 + 1], a[i * 4 + 2], a[i * 4 + 3]]);
            }
            w
        };
        params.__bindgen_anon_3.ipv6_src = words(src);
        params.__bindgen_anon_4.ipv6_dst = words(dst);
        params
    }

    #[inline(always)]
    fn decrement_ttl<C: PacketCtx>(ctx: &C, p: &Packet<[u8; 16]>) -> Result<bool, Error> {
        let hop = ctx.load::<u8>(p.l3_off + 7)?;
        if hop <= 1 {
            return Ok(false);
        }
        // IPv6 has no header checksum.
        ctx.store(p.l3_off + 7, &(hop - 1))?;
        Ok(true)
    }
}

/// What `route` found for a packet about to be forwarded past the stack.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// Next hop and its MAC known: the packet can be sent by any hook.
    Resolved,
    /// Route known, next hop's MAC not yet: only tc can send it (`redirect_neigh`).
    NoNeigh,
    /// No usable route: the stack gets the packet.
    None,
}

/// Looks up the route of `p` once rewritten to `src` → `dst`, into this CPU's scratch FIB
/// query, before anything is rewritten: a hook that cannot send on that route (XDP without a
/// resolved next hop) then leaves the packet untouched for tc.
// A subprogram: the FIB query lives in scratch memory, out of every frame.
#[inline(never)]
pub fn route<C: PacketCtx, A: FwdAf>(
    ctx: &C,
    p: &Packet<A::Addr>,
    src: &A::Addr,
    dst: &A::Addr,
) -> Route {
    let Some(s) = scratch() else {
        return Route::None;
    };
    // SAFETY: this CPU's scratch `fib` area (64 bytes, 8-aligned), used only by `route` and
    // `send` of the same packet.
    let params = unsafe { &mut *(*s).fib.as_mut_ptr().cast::<bpf_fib_lookup>() };
    *params = A::fib_params(p, *src, *dst, ctx.ifindex());
    match ctx.fib_lookup(params) {
        rc if rc == BPF_FIB_LKUP_RET_SUCCESS as i64 => Route::Resolved,
        rc if rc == BPF_FIB_LKUP_RET_NO_NEIGH as i64 => Route::NoNeigh,
        _ => Route::None,
    }
}

/// Whether `backend` is an address of this node (a hostNetwork endpoint), as the FIB sees it
/// from the device `p` arrived on: the lookup finds no unicast route (a local route, or none
/// at all, which forwarding could not use either). Such a flow is not masqueraded: DNATed, it
/// is delivered by the stack, which would drop it as a martian with the node IP as its source,
/// and `send` has no route to forward it on. A device with forwarding off says nothing.
// A subprogram, like `route`: the FIB query lives in scratch memory, out of every frame.
#[inline(never)]
pub fn local<C: PacketCtx, A: FwdAf>(ctx: &C, p: &Packet<A::Addr>, backend: &A::Addr) -> bool {
    let Some(s) = scratch() else {
        return false;
    };
    // SAFETY: as in `route`; `route` writes the query afresh for any later send.
    let params = unsafe { &mut *(*s).fib.as_mut_ptr().cast::<bpf_fib_lookup>() };
    *params = A::fib_params(p, p.saddr, *backend, ctx.ifindex());
    ctx.fib_lookup(params) == BPF_FIB_LKUP_RET_NOT_FWDED as i64
}

/// Sends the rewritten packet `p` on the route `route` found (the scratch FIB answer),
/// returning the verdict. Without a usable route it is left to the stack, counted.
#[inline(never)]
pub fn send<C: PacketCtx, A: FwdAf>(
    ctx: &C,
    p: &Packet<A::Addr>,
    route: Route,
) -> Result<i32, Error> {
    if route == Route::None {
        count(metrics::TC_SNAT_NO_ROUTE, ctx.len());
        return Ok(C::PASS);
    }
    if !A::decrement_ttl(ctx, p)? {
        return Ok(C::PASS);
    }
    let s = scratch().ok_or(Error::Rewrite)?;
    // SAFETY: as in `route`, which filled it for this packet.
    let params = unsafe { &*(*s).fib.as_ptr().cast::<bpf_fib_lookup>() };
    if route == Route::Resolved {
        let mut macs = [0u8; 12];
        macs[..6].copy_from_slice(&params.dmac);
        macs[6..].copy_from_slice(&params.smac);
        ctx.store(0, &macs)?;
        if !C::RESOLVES_NEIGH {
            let sent = if params.ifindex == ctx.ifindex() {
                metrics::XDP_TX
            } else {
                metrics::XDP_REDIRECT
            };
            count(sent, ctx.len());
        }
        Ok(ctx.redirect(params.ifindex))
    } else {
        Ok(ctx.redirect_neigh(params.ifindex))
    }
}
