//! Socket-level load balancing on a cgroup v2 directory.
//!
//! connect() and UDP sendmsg() to a frontend are rewritten to a backend before the kernel
//! routes anything, so the flow needs no NAT or conntrack per packet. The socket's peer is
//! remembered in `lb*_sk_revnat`, and recvmsg()/getpeername() turn the backend back into the
//! frontend the application asked for. Where the kernel lets these programs use socket
//! storage, the pairs live in the socket's own `lb*_sk_store` instead (`sk_store`). IPv4-mapped IPv6 destinations (`::ffff:a.b.c.d`) on
//! IPv6 sockets use the IPv4 services.
use aya_ebpf::{
    helpers::{bpf_get_netns_cookie, bpf_get_prandom_u32, bpf_get_socket_cookie, bpf_set_retval},
    macros::cgroup_sock_addr,
    programs::SockAddrContext,
};
use lb_common::{IPPROTO_TCP, IPPROTO_UDP, lb_alg, metrics, mix64};

use crate::{
    af::{Af, Client, Endpoint, V4, V6},
    maps::count,
    select::{Origin, Selected, select},
    sk_store::{self, Sk},
};

/// Verdicts of cgroup sock_addr programs.
const ALLOW: i32 = 1;
const DENY: i32 = 0;
const ECONNREFUSED: i32 = 111;

/// Set by the loader (`lb_common::globals::HAS_SET_RETVAL`) when the kernel offers
/// `bpf_set_retval` to sock_addr programs. In .rodata, frozen: with 0 the verifier knows the
/// helper call is dead and never checks it, so kernels without the helper load the program.
#[unsafe(no_mangle)]
static LB_HAS_SET_RETVAL: u8 = 0;

/// Fails the connect()/sendmsg() as a REJECT would: ECONNREFUSED where the kernel lets the
/// program choose the error, EPERM (a plain deny) before.
#[inline(always)]
fn refuse() -> i32 {
    // SAFETY: a plain read of a static; volatile so the loader's value is what is read.
    if unsafe { core::ptr::read_volatile(&LB_HAS_SET_RETVAL) } != 0 {
        // SAFETY: helper with a plain integer argument; its result only says whether the
        // value was accepted, and DENY fails the call either way.
        unsafe { bpf_set_retval(-ECONNREFUSED) };
    }
    DENY
}

/// How a translation picks its backend.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Pick {
    /// connect(): a random backend, once per socket (Maglev frontends: as `SocketHash`).
    Random,
    /// Unconnected sendmsg(): a hash of the socket cookie, so every datagram a socket sends
    /// to a frontend reaches the same backend while the backend set is unchanged.
    SocketHash,
}

#[cgroup_sock_addr(connect4)]
pub fn lb_connect4(ctx: SockAddrContext) -> i32 {
    forward4(&ctx, Pick::Random)
}

#[cgroup_sock_addr(sendmsg4)]
pub fn lb_sendmsg4(ctx: SockAddrContext) -> i32 {
    forward4(&ctx, Pick::SocketHash)
}

#[cgroup_sock_addr(recvmsg4)]
pub fn lb_recvmsg4(ctx: SockAddrContext) -> i32 {
    reverse4(&ctx);
    // recvmsg and getpeername hooks must allow.
    ALLOW
}

#[cgroup_sock_addr(getpeername4)]
pub fn lb_getpeername4(ctx: SockAddrContext) -> i32 {
    reverse4(&ctx);
    ALLOW
}

#[cgroup_sock_addr(connect6)]
pub fn lb_connect6(ctx: SockAddrContext) -> i32 {
    forward6(&ctx, Pick::Random)
}

#[cgroup_sock_addr(sendmsg6)]
pub fn lb_sendmsg6(ctx: SockAddrContext) -> i32 {
    forward6(&ctx, Pick::SocketHash)
}

#[cgroup_sock_addr(recvmsg6)]
pub fn lb_recvmsg6(ctx: SockAddrContext) -> i32 {
    reverse6(&ctx);
    ALLOW
}

#[cgroup_sock_addr(getpeername6)]
pub fn lb_getpeername6(ctx: SockAddrContext) -> i32 {
    reverse6(&ctx);
    ALLOW
}

/// The socket's L4 protocol, if lb balances it.
///
/// Not SCTP: the kernel runs no sock_addr hook for it (sctp_connect(), sctp_connectx() and
/// sctp_sendmsg() call neither `pre_connect` nor the sendmsg hooks), so SCTP is balanced on
/// the tc path only.
#[inline(always)]
fn protocol(ctx: &SockAddrContext) -> Option<u8> {
    // SAFETY: the context pointer is valid for the program's run.
    let proto = unsafe { (*ctx.sock_addr).protocol } as u8;
    (proto == IPPROTO_TCP || proto == IPPROTO_UDP).then_some(proto)
}

/// Ports in `bpf_sock_addr` are in network order in the low 16 bits.
#[inline(always)]
fn port_from_ctx(raw: u32) -> u16 {
    u16::from_be(raw as u16)
}

#[inline(always)]
fn port_to_ctx(port: u16) -> u32 {
    port.to_be() as u32
}

/// Chooses a backend for `frontend` (the shared `select`, for an in-cluster client) and
/// remembers it for the socket's reverse hooks.
#[inline(always)]
fn balance<A: Af>(
    ctx: &SockAddrContext,
    frontend: Endpoint<A::Addr>,
    proto: u8,
    pick: Pick,
) -> Selected<A::Addr> {
    // Session affinity keys a socket's client by its network namespace (a pod), since the
    // source address is not known at connect().
    let client = || Client {
        addr: A::ZERO,
        // SAFETY: the helper accepts any sock_addr context.
        netns_cookie: unsafe { bpf_get_netns_cookie(ctx.sock_addr.cast()) },
    };
    // The socket cookie, fetched at most once (the hash and the sk_revnat key share it) and
    // only for a frontend's socket: it is allocated on first use, and most connect() calls
    // are not to a frontend.
    // 0 for not fetched yet (the kernel's cookies start at 1), not an `Option`: its
    // uninitialised payload would be spilled, a register read the verifier refuses.
    let mut cookie = 0u64;
    let mut socket_cookie = || {
        if cookie == 0 {
            // SAFETY: the helper accepts any sock_addr context.
            cookie = unsafe { bpf_get_socket_cookie(ctx.sock_addr.cast()) };
        }
        cookie
    };
    let selected = select::<A>(frontend, proto, Origin::Cluster, client, |alg| match pick {
        // SAFETY: helper without arguments.
        Pick::Random if alg == lb_alg::RANDOM => unsafe { bpf_get_prandom_u32() },
        // Unconnected sendmsg() keeps a socket on one backend, and Maglev hashes the socket's
        // flow at connect() too: the cookie is the flow.
        _ => mix64(socket_cookie()),
    });
    if let Selected::Backend(c) = &selected {
        let stored = sk_store::remember::<A>(
            || Sk::of_addr(ctx),
            socket_cookie,
            c.backend,
            frontend,
            c.rev_nat_id,
            pick == Pick::Random,
        );
        if stored.is_err() {
            count(metrics::SOCK_REVNAT_INSERT_FAILED, 0);
        }
    }
    selected
}

/// The sock_addr verdict of a selection to `frontend`; counts it. `rewrite` puts the backend
/// in the context.
#[inline(always)]
fn verdict<A: Af>(
    frontend: Endpoint<A::Addr>,
    selected: Selected<A::Addr>,
    rewrite: impl FnOnce(Endpoint<A::Addr>),
) -> i32 {
    match selected {
        // A ClusterIP on a port it does not have is refused like kube-proxy's REJECT.
        Selected::NotAService if A::is_cluster_ip(frontend.addr) => {
            count(metrics::SOCK_REJECT_UNKNOWN_PORT, 0);
            refuse()
        }
        Selected::NotAService => ALLOW,
        // Endpoints only on other nodes (internalTrafficPolicy: Local): kube-proxy DROPs, and
        // a netfilter drop fails a local sender's call with EPERM, a plain deny's error.
        Selected::NoBackend { drop: true } => {
            count(metrics::SOCK_DROP_NO_LOCAL_BACKEND, 0);
            DENY
        }
        // connect()/sendmsg() fail at once rather than reach a VIP nothing answers on.
        Selected::NoBackend { drop: false } => {
            count(metrics::SOCK_DROP_NO_BACKEND, 0);
            refuse()
        }
        Selected::Backend(c) => {
            rewrite(c.backend);
            count(metrics::SOCK_FWD, 0);
            ALLOW
        }
    }
}

#[inline(always)]
fn forward4(ctx: &SockAddrContext, pick: Pick) -> i32 {
    let Some(proto) = protocol(ctx) else {
        return ALLOW;
    };
    let sa = ctx.sock_addr;
    // SAFETY: the context pointer is valid for the program's run; these fields are writable
    // in connect4 and sendmsg4.
    unsafe {
        let frontend = Endpoint {
            addr: (*sa).user_ip4.to_ne_bytes(),
            port: port_from_ctx((*sa).user_port),
        };
        verdict::<V4>(
            frontend,
            balance::<V4>(ctx, frontend, proto, pick),
            |backend| {
                (*sa).user_ip4 = u32::from_ne_bytes(backend.addr);
                (*sa).user_port = port_to_ctx(backend.port);
            },
        )
    }
}

#[inline(always)]
fn reverse4(ctx: &SockAddrContext) {
    if protocol(ctx).is_none() {
        return;
    }
    let sa = ctx.sock_addr;
    // SAFETY: as in forward4; these fields are writable in recvmsg4 and getpeername4.
    unsafe {
        let peer = Endpoint {
            addr: (*sa).user_ip4.to_ne_bytes(),
            port: port_from_ctx((*sa).user_port),
        };
        if let Some(frontend) = recall::<V4>(ctx, peer) {
            (*sa).user_ip4 = u32::from_ne_bytes(frontend.addr);
            (*sa).user_port = port_to_ctx(frontend.port);
            count(metrics::SOCK_REVNAT, 0);
        }
    }
}

/// The frontend `peer` stands for on the context's socket (`sk_store::recall`).
#[inline(always)]
fn recall<A: Af>(ctx: &SockAddrContext, peer: Endpoint<A::Addr>) -> Option<Endpoint<A::Addr>> {
    sk_store::recall::<A>(
        || Some(Sk::of_addr(ctx)),
        // SAFETY: the helper accepts any sock_addr context.
        || unsafe { bpf_get_socket_cookie(ctx.sock_addr.cast()) },
        peer,
    )
}

const V4_MAPPED_PREFIX: [u8; 12] = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff];

#[inline(always)]
fn read_ip6(words: &[u32; 4]) -> [u8; 16] {
    let mut out = [0u8; 16];
    let mut i = 0;
    while i < 4 {
        let b = words[i].to_ne_bytes();
        out[i * 4] = b[0];
        out[i * 4 + 1] = b[1];
        out[i * 4 + 2] = b[2];
        out[i * 4 + 3] = b[3];
        i += 1;
    }
    out
}

/// The IPv4 address inside `::ffff:a.b.c.d`, if it is one.
#[inline(always)]
fn v4_mapped(addr: &[u8; 16]) -> Option<[u8; 4]> {
    (addr[..12] == V4_MAPPED_PREFIX).then(|| [addr[12], addr[13], addr[14], addr[15]])
}

/// Writes `addr` into the context's IPv6 address with 4-byte stores, as the verifier wants.
///
/// # Safety
/// `ctx` must be a sock_addr context whose `user_ip6` is writable in this hook.
#[inline(always)]
unsafe fn write_ip6(ctx: &SockAddrContext, addr: [u8; 16]) {
    let sa = ctx.sock_addr;
    // SAFETY: per the function's contract.
    unsafe {
        (*sa).user_ip6[0] = u32::from_ne_bytes([addr[0], addr[1], addr[2], addr[3]]);
        (*sa).user_ip6[1] = u32::from_ne_bytes([addr[4], addr[5], addr[6], addr[7]]);
        (*sa).user_ip6[2] = u32::from_ne_bytes([addr[8], addr[9], addr[10], addr[11]]);
        (*sa).user_ip6[3] = u32::from_ne_bytes([addr[12], addr[13], addr[14], addr[15]]);
    }
}

#[inline(always)]
fn mapped(v4: [u8; 4]) -> [u8; 16] {
    let mut out = [0u8; 16];
    out[10] = 0xff;
    out[11] = 0xff;
    out[12] = v4[0];
    out[13] = v4[1];
    out[14] = v4[2];
    out[15] = v4[3];
    out
}

#[inline(always)]
fn forward6(ctx: &SockAddrContext, pick: Pick) -> i32 {
    let Some(proto) = protocol(ctx) else {
        return ALLOW;
    };
    let sa = ctx.sock_addr;
    // SAFETY: the context pointer is valid; user_ip6/user_port are writable in connect6 and
    // sendmsg6.
    unsafe {
        let words = [
            (*sa).user_ip6[0],
            (*sa).user_ip6[1],
            (*sa).user_ip6[2],
            (*sa).user_ip6[3],
        ];
        let addr = read_ip6(&words);
        let port = port_from_ctx((*sa).user_port);
        match v4_mapped(&addr) {
            Some(v4) => verdict::<V4>(
                Endpoint { addr: v4, port },
                balance::<V4>(ctx, Endpoint { addr: v4, port }, proto, pick),
                |b| {
                    write_ip6(ctx, mapped(b.addr));
                    (*sa).user_port = port_to_ctx(b.port);
                },
            ),
            None => verdict::<V6>(
                Endpoint { addr, port },
                balance::<V6>(ctx, Endpoint { addr, port }, proto, pick),
                |b| {
                    write_ip6(ctx, b.addr);
                    (*sa).user_port = port_to_ctx(b.port);
                },
            ),
        }
    }
}

#[inline(always)]
fn reverse6(ctx: &SockAddrContext) {
    if protocol(ctx).is_none() {
        return;
    }
    let sa = ctx.sock_addr;
    // SAFETY: as in forward6; writable in recvmsg6 and getpeername6.
    unsafe {
        let words = [
            (*sa).user_ip6[0],
            (*sa).user_ip6[1],
            (*sa).user_ip6[2],
            (*sa).user_ip6[3],
        ];
        let addr = read_ip6(&words);
        let port = port_from_ctx((*sa).user_port);
        let frontend = match v4_mapped(&addr) {
            Some(v4) => {
                recall::<V4>(ctx, Endpoint { addr: v4, port }).map(|f| (mapped(f.addr), f.port))
            }
            None => recall::<V6>(ctx, Endpoint { addr, port }).map(|f| (f.addr, f.port)),
        };
        if let Some((faddr, fport)) = frontend {
            write_ip6(ctx, faddr);
            (*sa).user_port = port_to_ctx(fport);
            count(metrics::SOCK_REVNAT, 0);
        }
    }
}
