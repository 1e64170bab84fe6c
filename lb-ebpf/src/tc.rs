//! Per-packet service load balancing on tc.
//!
//! Ingress (`lb_tc_ingress` on external-facing devices, `lb_tc_pod` on the host side of pod
//! veths): a packet to a frontend (VIP, port, proto) is DNATed to a backend chosen uniformly
//! for a new flow, or to the flow's conntrack backend; a packet matching a reply conntrack
//! entry gets its source rewritten back to the frontend. Egress does the reverse NAT only.
//! Anything not fully parsed (non-IP, IPv4 fragments, IPv6 extension headers, other L4,
//! truncated headers) is passed untouched.
//!
//! Checksums are updated incrementally with the kernel's csum helpers, which also handle
//! CHECKSUM_PARTIAL skbs from local sockets (only the pseudo-header part changes there).
use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_SHOT},
    helpers::{bpf_csum_diff, bpf_get_prandom_u32, bpf_ktime_get_ns},
    macros::classifier,
    programs::TcContext,
};
use lb_common::{
    CtValue, IPPROTO_TCP, IPPROTO_UDP, SvcValue, ct_dir, ct_flags, ct_timeouts, metrics, scope,
    select_slot, svc_flags,
};

use crate::{
    af::{Af, Endpoint, V4, V6},
    maps::count,
};

const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
/// Ethernet + IPv4 with the largest options + TCP: what must be linear to parse any packet.
const MAX_HDR_LEN: u32 = 14 + 60 + 20;

const BPF_F_PSEUDO_HDR: u64 = 1 << 4;
const BPF_F_MARK_MANGLED_0: u64 = 1 << 5;

const TCP_FIN: u8 = 0x01;
const TCP_SYN: u8 = 0x02;
const TCP_RST: u8 = 0x04;
const TCP_ACK: u8 = 0x10;

enum Error {
    /// Not a packet lb understands completely: pass it untouched.
    Unparsed,
    /// A rewrite helper failed midway: drop rather than forward a half-rewritten packet.
    Rewrite,
}

/// The parsed headers of a TCP or UDP packet.
struct Packet<A> {
    saddr: A,
    daddr: A,
    sport: u16,
    dport: u16,
    proto: u8,
    tcp_flags: u8,
    l4_off: usize,
    /// Offset of the L4 checksum field.
    csum_off: usize,
}

/// Which frontends a tc program balances, by where it is attached.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Hook {
    /// Ingress of an external-facing device: DNAT with a frontend's external scope.
    External,
    /// Ingress of a pod-facing device (the host side of a pod's veth): in-cluster traffic,
    /// DNAT with a frontend's internal scope where it has one, like socket LB.
    Pod,
    /// Egress: reverse NAT only.
    Egress,
}

#[classifier]
pub fn lb_tc_ingress(ctx: TcContext) -> i32 {
    run(&ctx, Hook::External)
}

#[classifier]
pub fn lb_tc_pod(ctx: TcContext) -> i32 {
    run(&ctx, Hook::Pod)
}

#[classifier]
pub fn lb_tc_egress(ctx: TcContext) -> i32 {
    run(&ctx, Hook::Egress)
}

#[inline(always)]
fn run(ctx: &TcContext, hook: Hook) -> i32 {
    match try_tc(ctx, hook) {
        Ok(verdict) => verdict,
        Err(Error::Unparsed) => {
            count(metrics::TC_PASS_UNPARSED, ctx.len());
            TC_ACT_OK
        }
        Err(Error::Rewrite) => {
            // Rare: a csum/store helper failed on a packet that parsed fine.
            aya_log_ebpf::error!(ctx, "tc: rewrite helper failed, packet dropped");
            count(metrics::TC_DROP_REWRITE, ctx.len());
            TC_ACT_SHOT
        }
    }
}

#[inline(always)]
fn try_tc(ctx: &TcContext, hook: Hook) -> Result<i32, Error> {
    // Direct packet access needs the headers in the linear part of the skb.
    let linear = ctx.data_end() - ctx.data();
    if linear < MAX_HDR_LEN as usize && (linear as u32) < ctx.len() {
        let want = if ctx.len() < MAX_HDR_LEN {
            ctx.len()
        } else {
            MAX_HDR_LEN
        };
        ctx.pull_data(want).map_err(|_| Error::Unparsed)?;
    }
    let eth_proto = u16::from_be_bytes(read::<[u8; 2]>(ctx, 12)?);
    match eth_proto {
        ETH_P_IP => {
            let p = V4::parse(ctx)?;
            nat::<V4>(ctx, &p, hook)
        }
        ETH_P_IPV6 => {
            let p = V6::parse(ctx)?;
            nat::<V6>(ctx, &p, hook)
        }
        _ => Err(Error::Unparsed),
    }
}

/// Reads a `T` at `off`, bounds-checked against `data_end`.
#[inline(always)]
fn read<T: Copy>(ctx: &TcContext, off: usize) -> Result<T, Error> {
    let start = ctx.data();
    if start + off + size_of::<T>() > ctx.data_end() {
        return Err(Error::Unparsed);
    }
    // SAFETY: in bounds per the check above; T is plain bytes with alignment 1.
    Ok(unsafe { core::ptr::read_unaligned((start + off) as *const T) })
}

/// Parses the TCP or UDP header at `l4_off`, of a packet whose IP payload is `l4_len` bytes.
#[inline(always)]
fn parse_l4<A>(
    ctx: &TcContext,
    saddr: A,
    daddr: A,
    proto: u8,
    l4_off: usize,
    l4_len: usize,
) -> Result<Packet<A>, Error> {
    let (tcp_flags, csum_off) = match proto {
        IPPROTO_TCP => {
            let th = read::<[u8; 20]>(ctx, l4_off)?;
            if th[12] >> 4 < 5 || l4_len < 20 {
                return Err(Error::Unparsed);
            }
            (th[13], l4_off + 16)
        }
        IPPROTO_UDP => {
            if l4_len < 8 {
                return Err(Error::Unparsed);
            }
            (0, l4_off + 6)
        }
        _ => return Err(Error::Unparsed),
    };
    let ports = read::<[u8; 4]>(ctx, l4_off)?;
    Ok(Packet {
        saddr,
        daddr,
        sport: u16::from_be_bytes([ports[0], ports[1]]),
        dport: u16::from_be_bytes([ports[2], ports[3]]),
        proto,
        tcp_flags,
        l4_off,
        csum_off,
    })
}

/// Per-family parsing and address rewriting.
trait PacketAf: Af {
    fn parse(ctx: &TcContext) -> Result<Packet<Self::Addr>, Error>;
    /// Replaces the source (`src`) or destination address, fixing the checksums.
    fn set_addr(
        ctx: &TcContext,
        p: &Packet<Self::Addr>,
        src: bool,
        old: Self::Addr,
        new: Self::Addr,
    ) -> Result<(), Error>;
}

impl PacketAf for V4 {
    #[inline(always)]
    fn parse(ctx: &TcContext) -> Result<Packet<[u8; 4]>, Error> {
        let ip = read::<[u8; 20]>(ctx, ETH_HLEN)?;
        let ihl = ((ip[0] & 0x0f) as usize) * 4;
        if ip[0] >> 4 != 4 || ihl < 20 {
            return Err(Error::Unparsed);
        }
        // Fragments: later ones carry no ports, so no fragment of a datagram is translated.
        if u16::from_be_bytes([ip[6], ip[7]]) & 0x3fff != 0 {
            return Err(Error::Unparsed);
        }
        let tot_len = u16::from_be_bytes([ip[2], ip[3]]) as usize;
        if tot_len < ihl {
            return Err(Error::Unparsed);
        }
        let saddr = [ip[12], ip[13], ip[14], ip[15]];
        let daddr = [ip[16], ip[17], ip[18], ip[19]];
        parse_l4(ctx, saddr, daddr, ip[9], ETH_HLEN + ihl, tot_len - ihl)
    }

    #[inline(always)]
    fn set_addr(
        ctx: &TcContext,
        p: &Packet<[u8; 4]>,
        src: bool,
        old: [u8; 4],
        new: [u8; 4],
    ) -> Result<(), Error> {
        let (old_v, new_v) = (
            u32::from_ne_bytes(old) as u64,
            u32::from_ne_bytes(new) as u64,
        );
        ctx.l4_csum_replace(
            p.csum_off,
            old_v,
            new_v,
            BPF_F_PSEUDO_HDR | 4 | mangled0(p.proto),
        )
        .map_err(|_| Error::Rewrite)?;
        ctx.l3_csum_replace(ETH_HLEN + 10, old_v, new_v, 4)
            .map_err(|_| Error::Rewrite)?;
        let off = ETH_HLEN + if src { 12 } else { 16 };
        ctx.store(off, &new, 0).map_err(|_| Error::Rewrite)
    }
}

impl PacketAf for V6 {
    #[inline(always)]
    fn parse(ctx: &TcContext) -> Result<Packet<[u8; 16]>, Error> {
        let ip = read::<[u8; 40]>(ctx, ETH_HLEN)?;
        if ip[0] >> 4 != 6 {
            return Err(Error::Unparsed);
        }
        let payload_len = u16::from_be_bytes([ip[4], ip[5]]) as usize;
        let mut saddr = [0u8; 16];
        saddr.copy_from_slice(&ip[8..24]);
        let mut daddr = [0u8; 16];
        daddr.copy_from_slice(&ip[24..40]);
        // Extension headers are not walked: such packets are not ours to rewrite.
        parse_l4(ctx, saddr, daddr, ip[6], ETH_HLEN + 40, payload_len)
    }

    #[inline(always)]
    fn set_addr(
        ctx: &TcContext,
        p: &Packet<[u8; 16]>,
        src: bool,
        old: [u8; 16],
        new: [u8; 16],
    ) -> Result<(), Error> {
        let mut old = old;
        let mut new = new;
        // SAFETY: both buffers are 16 bytes on this program's stack.
        let diff =
            unsafe { bpf_csum_diff(old.as_mut_ptr().cast(), 16, new.as_mut_ptr().cast(), 16, 0) };
        if diff < 0 {
            return Err(Error::Rewrite);
        }
        ctx.l4_csum_replace(
            p.csum_off,
            0,
            diff as u64,
            BPF_F_PSEUDO_HDR | mangled0(p.proto),
        )
        .map_err(|_| Error::Rewrite)?;
        let off = ETH_HLEN + if src { 8 } else { 24 };
        ctx.store(off, &new, 0).map_err(|_| Error::Rewrite)
    }
}

/// A zero UDP checksum means "none" (IPv4) and must stay zero.
#[inline(always)]
fn mangled0(proto: u8) -> u64 {
    if proto == IPPROTO_UDP {
        BPF_F_MARK_MANGLED_0
    } else {
        0
    }
}

#[inline(always)]
fn set_port<A: PacketAf>(
    ctx: &TcContext,
    p: &Packet<A::Addr>,
    src: bool,
    old: u16,
    new: u16,
) -> Result<(), Error> {
    if old == new {
        return Ok(());
    }
    let (old_be, new_be) = (old.to_be(), new.to_be());
    ctx.l4_csum_replace(
        p.csum_off,
        old_be as u64,
        new_be as u64,
        2 | mangled0(p.proto),
    )
    .map_err(|_| Error::Rewrite)?;
    let off = p.l4_off + if src { 0 } else { 2 };
    ctx.store(off, &new_be, 0).map_err(|_| Error::Rewrite)
}

#[inline(always)]
fn now_secs() -> u32 {
    // SAFETY: helper without arguments.
    (unsafe { bpf_ktime_get_ns() } / 1_000_000_000) as u32
}

/// The conntrack flag a FIN or RST sets for the side that sent it.
#[inline(always)]
fn closing(p: &Packet<impl Copy>, flag: u16) -> u16 {
    if p.proto == IPPROTO_TCP && p.tcp_flags & (TCP_FIN | TCP_RST) != 0 {
        flag
    } else {
        0
    }
}

#[inline(always)]
fn lifetime(proto: u8, flags: u16) -> u32 {
    if proto != IPPROTO_TCP {
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

#[inline(always)]
fn nat<A: PacketAf>(ctx: &TcContext, p: &Packet<A::Addr>, hook: Hook) -> Result<i32, Error> {
    if hook != Hook::Egress
        && let Some(mut svc) = A::service(p.daddr, p.dport, p.proto, 0, scope::EXTERNAL)
    {
        let mut svc_scope = scope::EXTERNAL;
        if hook == Hook::Pod
            && svc.flags & svc_flags::TWO_SCOPES != 0
            && let Some(internal) = A::service(p.daddr, p.dport, p.proto, 0, scope::INTERNAL)
        {
            svc = internal;
            svc_scope = scope::INTERNAL;
        }
        return service_forward::<A>(ctx, p, &svc, svc_scope);
    }
    if reverse_nat::<A>(ctx, p)? {
        count(metrics::TC_REVNAT, ctx.len());
    } else {
        count(metrics::TC_PASS_NO_SERVICE, ctx.len());
    }
    Ok(TC_ACT_OK)
}

/// DNAT of a packet to a frontend whose master entry (in `svc_scope`) is `svc`.
#[inline(always)]
fn service_forward<A: PacketAf>(
    ctx: &TcContext,
    p: &Packet<A::Addr>,
    svc: &SvcValue,
    svc_scope: u8,
) -> Result<i32, Error> {
    let (count_active, rev_nat_id) = (svc.count, svc.rev_nat_id);
    let now = now_secs();
    let fkey = A::ct_key(p.saddr, p.daddr, p.sport, p.dport, p.proto, ct_dir::SERVICE);
    if let Some(ct) = A::ct_get(&fkey) {
        // SAFETY: map value pointer, valid for the program's run.
        let v = unsafe { *ct };
        // A SYN after FIN/RST reuses the 5-tuple for a new connection: balance it afresh.
        let reopened = p.proto == IPPROTO_TCP
            && p.tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN
            && v.flags & (ct_flags::TX_CLOSING | ct_flags::RX_CLOSING) != 0;
        if v.expires > now
            && !reopened
            && let Some(backend) = A::backend(v.backend_id)
        {
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
            dnat::<A>(ctx, p, backend)?;
            count(metrics::TC_FWD_ESTABLISHED, ctx.len());
            return Ok(TC_ACT_OK);
        }
    }

    if count_active == 0 {
        count(metrics::TC_DROP_NO_BACKEND, ctx.len());
        return Ok(TC_ACT_SHOT);
    }
    // SAFETY: helper without arguments.
    let slot = select_slot(unsafe { bpf_get_prandom_u32() }, count_active);
    let Some(backend_id) =
        A::service(p.daddr, p.dport, p.proto, slot, svc_scope).map(|s| s.backend_id)
    else {
        count(metrics::TC_DROP_NO_BACKEND, ctx.len());
        return Ok(TC_ACT_SHOT);
    };
    let Some(backend) = A::backend(backend_id) else {
        count(metrics::TC_DROP_NO_BACKEND, ctx.len());
        return Ok(TC_ACT_SHOT);
    };
    let flags = closing(p, ct_flags::TX_CLOSING);
    let v = CtValue {
        backend_id,
        rev_nat_id,
        expires: now + lifetime(p.proto, flags),
        flags,
        pad: 0,
    };
    let rkey = A::ct_key(
        backend.addr,
        p.saddr,
        backend.port,
        p.sport,
        p.proto,
        ct_dir::REPLY,
    );
    if A::ct_put(&fkey, &v).is_err() || A::ct_put(&rkey, &v).is_err() {
        count(metrics::TC_CT_INSERT_FAILED, ctx.len());
    }
    dnat::<A>(ctx, p, backend)?;
    count(metrics::TC_FWD_NEW, ctx.len());
    Ok(TC_ACT_OK)
}

#[inline(always)]
fn dnat<A: PacketAf>(
    ctx: &TcContext,
    p: &Packet<A::Addr>,
    backend: Endpoint<A::Addr>,
) -> Result<(), Error> {
    A::set_addr(ctx, p, false, p.daddr, backend.addr)?;
    set_port::<A>(ctx, p, false, p.dport, backend.port)
}

/// Rewrites a backend's reply to come from the frontend. Returns whether it was a reply.
#[inline(always)]
fn reverse_nat<A: PacketAf>(ctx: &TcContext, p: &Packet<A::Addr>) -> Result<bool, Error> {
    let rkey = A::ct_key(p.saddr, p.daddr, p.sport, p.dport, p.proto, ct_dir::REPLY);
    let Some(ct) = A::ct_get(&rkey) else {
        return Ok(false);
    };
    // SAFETY: map value pointer, valid for the program's run.
    let v = unsafe { *ct };
    let now = now_secs();
    if v.expires <= now {
        return Ok(false);
    }
    let Some(frontend) = A::revnat(v.rev_nat_id) else {
        return Ok(false);
    };
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
    A::set_addr(ctx, p, true, p.saddr, frontend.addr)?;
    set_port::<A>(ctx, p, true, p.sport, frontend.port)?;
    Ok(true)
}
