//! The re-steering fallback for connected UDP sockets (where lb cannot destroy them: kernels
//! before 6.5, or a network namespace lb cannot enter): on socket LB's cgroup, cgroup skb
//! egress drops a datagram whose socket socket LB pinned (its `lb*_sk_store` slots or
//! `lb*_sk_revnat`: the socket and the datagram's destination) to a (frontend, backend) pair `lb run` recorded as gone in
//! `lb_udp_gone`. The send() then fails with EPERM, and the application reconnects through
//! socket LB to a live backend. Anything else passes: one header read for non-UDP packets, two
//! hash lookups for UDP.
use aya_ebpf::{
    cty::c_long, helpers::bpf_get_socket_cookie, macros::cgroup_skb, programs::SkBuffContext,
};
use lb_common::{IPPROTO_UDP, UdpGoneKey, metrics};

use crate::{
    af::{Af, Endpoint, V4, V6},
    maps::{UDP_GONE, count},
    sk_store::{self, Sk},
};

/// Verdicts of cgroup skb programs.
const PASS: i32 = 1;
const DROP: i32 = 0;

#[cgroup_skb(egress)]
pub fn lb_sk_egress(ctx: SkBuffContext) -> i32 {
    match try_egress(&ctx) {
        Ok(true) => {
            count(metrics::SOCK_UDP_GONE_DROP, ctx.len());
            DROP
        }
        _ => PASS,
    }
}

/// Whether the datagram is to drop. The context's data starts at the network header.
fn try_egress(ctx: &SkBuffContext) -> Result<bool, c_long> {
    let version: u8 = ctx.load(0)?;
    match version >> 4 {
        4 => gone4(ctx),
        6 => gone6(ctx),
        _ => Ok(false),
    }
}

#[inline(always)]
fn pad16(a: [u8; 4]) -> [u8; 16] {
    let mut out = [0u8; 16];
    out[0] = a[0];
    out[1] = a[1];
    out[2] = a[2];
    out[3] = a[3];
    out
}

/// The UDP destination port at `offset`.
#[inline(always)]
fn dport(ctx: &SkBuffContext, offset: usize) -> Result<u16, c_long> {
    let ports: [u8; 4] = ctx.load(offset)?;
    Ok(u16::from_be_bytes([ports[2], ports[3]]))
}

/// The frontend the sending socket's pair for `backend` names, from its storage or
/// `lb*_sk_revnat` (`sk_store::recall`).
#[inline(always)]
fn recall<A: Af>(ctx: &SkBuffContext, backend: Endpoint<A::Addr>) -> Option<Endpoint<A::Addr>> {
    sk_store::recall::<A>(
        || Sk::of_skb(ctx),
        // SAFETY: the helper accepts any skb context.
        || unsafe { bpf_get_socket_cookie(ctx.skb.skb.cast()) },
        backend,
    )
}

#[inline(always)]
fn gone4(ctx: &SkBuffContext) -> Result<bool, c_long> {
    let h: [u8; 20] = ctx.load(0)?;
    // UDP, and a first (or only) fragment: later fragments carry no ports.
    if h[9] != IPPROTO_UDP || (h[6] & 0x1f) != 0 || h[7] != 0 {
        return Ok(false);
    }
    let ihl = usize::from(h[0] & 0x0f) * 4;
    let backend = Endpoint {
        addr: [h[16], h[17], h[18], h[19]],
        port: dport(ctx, ihl)?,
    };
    let Some(frontend) = recall::<V4>(ctx, backend) else {
        return Ok(false);
    };
    let key = UdpGoneKey {
        frontend: pad16(frontend.addr),
        backend: pad16(backend.addr),
        frontend_port: frontend.port,
        backend_port: backend.port,
        family: 4,
        pad: [0; 3],
    };
    Ok(UDP_GONE.get_ptr(&key).is_some())
}

#[inline(always)]
fn gone6(ctx: &SkBuffContext) -> Result<bool, c_long> {
    let h: [u8; 40] = ctx.load(0)?;
    // UDP right after the fixed header (socket LB's own datagrams carry no extension headers).
    if h[6] != IPPROTO_UDP {
        return Ok(false);
    }
    let mut addr = [0u8; 16];
    addr.copy_from_slice(&h[24..40]);
    let backend = Endpoint {
        addr,
        port: dport(ctx, 40)?,
    };
    let Some(frontend) = recall::<V6>(ctx, backend) else {
        return Ok(false);
    };
    let key = UdpGoneKey {
        frontend: frontend.addr,
        backend: backend.addr,
        frontend_port: frontend.port,
        backend_port: backend.port,
        family: 6,
        pad: [0; 3],
    };
    Ok(UDP_GONE.get_ptr(&key).is_some())
}
