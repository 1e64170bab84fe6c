//! REJECT as kube-proxy's rules do it: the packet is turned, in place, into the answer the
//! client gets, and sent back out the device it came in on.
//!
//! - TCP: a RST, as the kernel's (and nftables' `reject with tcp reset`) is built (RFC 9293
//!   3.10.7.1): to a segment with ACK, `seq = its ack`, RST only; otherwise `seq = 0`,
//!   `ack = seq + payload (+1 for SYN, +1 for FIN)`, RST|ACK. A RST is never answered.
//! - Anything else (UDP, and SCTP once it parses): ICMP port unreachable (type 3 code 3) or
//!   ICMPv6 port unreachable (type 1 code 4), quoting the original IP packet from its header
//!   on: up to 576 bytes of reply for IPv4 (RFC 1812 4.3.2.3, as Linux does), up to the
//!   minimum MTU of 1280 for IPv6 (RFC 4443 2.4(c)).
//!
//! The reply comes from the address the client asked for (the service IP) and carries full,
//! freshly computed checksums. Headers are read and written through the helpers (`load`,
//! `store`), which bounds-check against the packet's current length after each resize and work
//! on non-linear packets; the ICMP sum reads the packet directly, checked against a freshly read
//! `data_end`.
//!
//! Checksum offload state: originals arriving CHECKSUM_PARTIAL come only from local sockets
//! behind a veth, and the reply goes back through that veth, whose peer trusts PARTIAL; the
//! checksums written here are complete anyway, which is what any other receiver checks.
use aya_ebpf::helpers::bpf_csum_diff;
use lb_common::IPPROTO_TCP;

use crate::{
    af::{Af, V4, V6},
    ctx::{Error, PacketCtx},
    parse::{Packet, TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN},
};

const ETH_HLEN: usize = 14;
const IP4_HLEN: usize = 20;
const IP6_HLEN: usize = 40;
const TCP_HLEN: usize = 20;
const ICMP_HLEN: usize = 8;
const IPPROTO_ICMP: u8 = 1;
const IPPROTO_ICMPV6: u8 = 58;
/// Largest ICMP error, IP header included (RFC 1812 4.3.2.3).
const ICMP4_MAX: usize = 576;
/// Largest ICMPv6 error, IPv6 header included (RFC 4443 2.4(c)).
const ICMP6_MAX: usize = 1280;
const TTL: u8 = 64;
/// `bpf_csum_diff` sums at most 512 bytes per call.
const CSUM_BLOCK: usize = 512;
/// The ICMP message (header + quote) zero-padded to whole blocks: at most 556 bytes for IPv4,
/// 1240 for IPv6.
const ICMP4_PAD: usize = 2 * CSUM_BLOCK;
const ICMP6_PAD: usize = 3 * CSUM_BLOCK;

/// Whether a packet gets a reply: a TCP RST is only ever dropped.
#[inline(always)]
pub fn answerable<A>(p: &Packet<A>) -> bool {
    !(p.proto == IPPROTO_TCP && p.tcp_flags & TCP_RST != 0)
}

/// Rewrites the packet into its reject reply and queues it back out the device it came in on;
/// returns the tc verdict.
#[inline(always)]
pub fn reply<C: PacketCtx, A: RejectAf>(ctx: &C, p: &Packet<A::Addr>) -> Result<i32, Error> {
    let eth: [u8; ETH_HLEN] = ctx.load(0)?;
    if p.proto == IPPROTO_TCP {
        tcp_rst::<C, A>(ctx, p, &eth)?;
    } else {
        A::port_unreachable(ctx, p, &eth)?;
    }
    ctx.bounce()
}

/// Per-family reply building.
pub trait RejectAf: Af {
    const IP_HLEN: usize;

    /// The L4 length (header + payload) the IP header declares.
    fn l4_len<C: PacketCtx>(ctx: &C, p: &Packet<Self::Addr>) -> Result<usize, Error>;
    /// Writes the IP header of a reply of `l4_len` bytes of `proto` from `src` to `dst` at
    /// offset `ETH_HLEN`; returns the pseudo-header sum (for the L4 checksum).
    fn write_ip<C: PacketCtx>(
        ctx: &C,
        src: Self::Addr,
        dst: Self::Addr,
        proto: u8,
        l4_len: usize,
    ) -> Result<u32, Error>;
    /// Rewrites the packet into an ICMP(v6) port unreachable quoting it.
    fn port_unreachable<C: PacketCtx>(
        ctx: &C,
        p: &Packet<Self::Addr>,
        eth: &[u8; ETH_HLEN],
    ) -> Result<(), Error>;
}

/// The Ethernet header of the reply: the original's with its addresses swapped.
#[inline(always)]
fn swapped_eth(eth: &[u8; ETH_HLEN]) -> [u8; ETH_HLEN] {
    let mut out = *eth;
    let mut i = 0;
    while i < 6 {
        out[i] = eth[i + 6];
        out[i + 6] = eth[i];
        i += 1;
    }
    out
}

/// `bpf_csum_diff` as a plain sum of `buf` (a multiple of 4 bytes) added to `seed`.
#[inline(always)]
fn sum<const N: usize>(buf: &mut [u8; N], seed: u32) -> Result<u32, Error> {
    // SAFETY: `buf` is N readable bytes on this program's stack; `from` is empty.
    let r = unsafe {
        bpf_csum_diff(
            core::ptr::null_mut(),
            0,
            buf.as_mut_ptr().cast(),
            N as u32,
            seed,
        )
    };
    if r < 0 {
        return Err(Error::Rewrite);
    }
    Ok(r as u32)
}

/// `sum` of the `len` bytes (a multiple of 4) at `off` in `buf`.
#[inline(always)]
fn sum_at<const N: usize>(
    buf: &mut [u8; N],
    off: usize,
    len: usize,
    seed: u32,
) -> Result<u32, Error> {
    if off + len > N {
        return Err(Error::Rewrite);
    }
    // SAFETY: `off + len <= N`, checked above; the bytes are on this program's stack.
    let r = unsafe {
        bpf_csum_diff(
            core::ptr::null_mut(),
            0,
            buf.as_mut_ptr().add(off).cast(),
            len as u32,
            seed,
        )
    };
    if r < 0 {
        return Err(Error::Rewrite);
    }
    Ok(r as u32)
}

/// The Internet checksum of a 32-bit partial sum, as it is stored (native order: the sums
/// are taken over bytes as they lie in memory).
#[inline(always)]
fn fold(sum: u32) -> u16 {
    let s = (sum & 0xffff) + (sum >> 16);
    let s = (s & 0xffff) + (s >> 16);
    !(s as u16)
}

/// Sums the `len` bytes of the packet from `off` onto `seed`, `len <= PAD` (whole blocks).
///
/// No loop for the verifier to walk: the packet is zero-filled up to `off + PAD` (zeros add
/// nothing to the sum), summed in fixed blocks by direct access, and cut back to `off + len`.
#[inline(always)]
fn sum_packet<C: PacketCtx, const PAD: usize>(
    ctx: &C,
    off: usize,
    len: usize,
    seed: u32,
) -> Result<u32, Error> {
    let padded = (off + PAD) as u32;
    ctx.change_tail(padded)?;
    ctx.pull_data(padded).map_err(|_| Error::Rewrite)?;
    // Packet pointers from before the resize are stale: read them again.
    let start = ctx.data() + off;
    if start + PAD > ctx.data_end() {
        return Err(Error::Rewrite);
    }
    let mut acc = seed;
    let mut i = 0;
    while i < PAD / CSUM_BLOCK {
        // SAFETY: `start + PAD <= data_end`, checked above; `from` is empty.
        let r = unsafe {
            bpf_csum_diff(
                core::ptr::null_mut(),
                0,
                (start + i * CSUM_BLOCK) as *mut u32,
                CSUM_BLOCK as u32,
                acc,
            )
        };
        if r < 0 {
            return Err(Error::Rewrite);
        }
        acc = r as u32;
        i += 1;
    }
    ctx.change_tail((off + len) as u32)?;
    Ok(acc)
}

#[inline(always)]
fn tcp_rst<C: PacketCtx, A: RejectAf>(
    ctx: &C,
    p: &Packet<A::Addr>,
    eth: &[u8; ETH_HLEN],
) -> Result<(), Error> {
    let th: [u8; TCP_HLEN] = ctx.load(p.l4_off)?;
    let doff = ((th[12] >> 4) as usize) * 4;
    let payload = A::l4_len(ctx, p)?.saturating_sub(doff) as u32;
    let (seq, ack, flags) = if p.tcp_flags & TCP_ACK != 0 {
        (
            u32::from_be_bytes([th[8], th[9], th[10], th[11]]),
            0,
            TCP_RST,
        )
    } else {
        let their_seq = u32::from_be_bytes([th[4], th[5], th[6], th[7]]);
        let ack = their_seq
            .wrapping_add(payload)
            .wrapping_add((p.tcp_flags & TCP_SYN != 0) as u32)
            .wrapping_add((p.tcp_flags & TCP_FIN != 0) as u32);
        (0, ack, TCP_RST | TCP_ACK)
    };

    // Everything needed is read: cut the packet to Ethernet + IP + a bare TCP header, then
    // write all of it.
    let l4_off = ETH_HLEN + A::IP_HLEN;
    ctx.change_tail((l4_off + TCP_HLEN) as u32)?;
    ctx.store(0, &swapped_eth(eth))?;
    let pseudo = A::write_ip(ctx, p.daddr, p.saddr, IPPROTO_TCP, TCP_HLEN)?;
    let mut tcp = [0u8; TCP_HLEN];
    tcp[0..2].copy_from_slice(&p.dport.to_be_bytes());
    tcp[2..4].copy_from_slice(&p.sport.to_be_bytes());
    tcp[4..8].copy_from_slice(&seq.to_be_bytes());
    tcp[8..12].copy_from_slice(&ack.to_be_bytes());
    tcp[12] = ((TCP_HLEN / 4) as u8) << 4;
    tcp[13] = flags;
    let csum = fold(sum(&mut tcp, pseudo)?);
    tcp[16..18].copy_from_slice(&csum.to_ne_bytes());
    ctx.store(l4_off, &tcp)
}

/// The header of an ICMP error of `ty`/`code` (checksum and unused word zero).
#[inline(always)]
fn icmp_header(ty: u8, code: u8) -> [u8; ICMP_HLEN] {
    let mut h = [0u8; ICMP_HLEN];
    h[0] = ty;
    h[1] = code;
    h
}

/// The part of the original IP packet an ICMP error of at most `max` bytes quotes: the packet
/// from its IP header, as long as the IP header says and the frame holds, cut to fit.
#[inline(always)]
fn quote_len<C: PacketCtx, A>(ctx: &C, p: &Packet<A>, ip_len: usize, max: usize) -> usize {
    let in_frame = (ctx.len() as usize).saturating_sub(p.l3_off);
    ip_len.min(in_frame).min(max)
}

/// Cuts the packet to its `quote` bytes from the IP header on, opens room for `hdr` bytes of
/// new headers before them, and writes the Ethernet header.
#[inline(always)]
fn make_room<C: PacketCtx, A>(
    ctx: &C,
    p: &Packet<A>,
    eth: &[u8; ETH_HLEN],
    quote: usize,
    hdr: usize,
) -> Result<(), Error> {
    // Cut first: less to move when the room opens.
    ctx.change_tail((p.l3_off + quote) as u32)?;
    ctx.grow_after_mac(hdr as u32)?;
    ctx.store(0, &swapped_eth(eth))
}

impl RejectAf for V4 {
    const IP_HLEN: usize = IP4_HLEN;

    #[inline(always)]
    fn l4_len<C: PacketCtx>(ctx: &C, p: &Packet<[u8; 4]>) -> Result<usize, Error> {
        let h: [u8; 4] = ctx.load(p.l3_off)?;
        let ihl = ((h[0] & 0x0f) as usize) * 4;
        Ok((u16::from_be_bytes([h[2], h[3]]) as usize).saturating_sub(ihl))
    }

    #[inline(always)]
    fn write_ip<C: PacketCtx>(
        ctx: &C,
        src: [u8; 4],
        dst: [u8; 4],
        proto: u8,
        l4_len: usize,
    ) -> Result<u32, Error> {
        let mut ip = [0u8; IP4_HLEN];
        ip[0] = 0x45;
        // ICMP errors carry "internetwork control" precedence, as Linux sends them.
        ip[1] = if proto == IPPROTO_ICMP { 0xc0 } else { 0 };
        ip[2..4].copy_from_slice(&((IP4_HLEN + l4_len) as u16).to_be_bytes());
        if proto == IPPROTO_TCP {
            ip[6] = 0x40; // DF, as the kernel's own resets
        }
        ip[8] = TTL;
        ip[9] = proto;
        ip[12..16].copy_from_slice(&src);
        ip[16..20].copy_from_slice(&dst);
        let csum = fold(sum(&mut ip, 0)?);
        ip[10..12].copy_from_slice(&csum.to_ne_bytes());
        ctx.store(ETH_HLEN, &ip)?;
        // Pseudo-header: the addresses as they lie in `ip`, then zero, protocol, L4 length.
        let mut rest = [0, proto, 0, 0];
        rest[2..4].copy_from_slice(&(l4_len as u16).to_be_bytes());
        let addrs = sum_at(&mut ip, 12, 8, 0)?;
        sum(&mut rest, addrs)
    }

    #[inline(always)]
    fn port_unreachable<C: PacketCtx>(
        ctx: &C,
        p: &Packet<[u8; 4]>,
        eth: &[u8; ETH_HLEN],
    ) -> Result<(), Error> {
        let h: [u8; 4] = ctx.load(p.l3_off)?;
        let ip_len = u16::from_be_bytes([h[2], h[3]]) as usize;
        let quote = quote_len(ctx, p, ip_len, ICMP4_MAX - IP4_HLEN - ICMP_HLEN);
        make_room(ctx, p, eth, quote, IP4_HLEN + ICMP_HLEN)?;
        let icmp_len = ICMP_HLEN + quote;
        // ICMP's checksum has no pseudo-header.
        Self::write_ip(ctx, p.daddr, p.saddr, IPPROTO_ICMP, icmp_len)?;
        let icmp_off = ETH_HLEN + IP4_HLEN;
        ctx.store(icmp_off, &icmp_header(3, 3))?;
        let csum = fold(sum_packet::<C, ICMP4_PAD>(ctx, icmp_off, icmp_len, 0)?);
        ctx.store(icmp_off + 2, &csum.to_ne_bytes())
    }
}

impl RejectAf for V6 {
    const IP_HLEN: usize = IP6_HLEN;

    #[inline(always)]
    fn l4_len<C: PacketCtx>(ctx: &C, p: &Packet<[u8; 16]>) -> Result<usize, Error> {
        let h: [u8; 2] = ctx.load(p.l3_off + 4)?;
        // The payload less the extension headers in front of the L4 header.
        let ext = p.l4_off.saturating_sub(p.l3_off + IP6_HLEN);
        Ok((u16::from_be_bytes(h) as usize).saturating_sub(ext))
    }

    #[inline(always)]
    fn write_ip<C: PacketCtx>(
        ctx: &C,
        src: [u8; 16],
        dst: [u8; 16],
        proto: u8,
        l4_len: usize,
    ) -> Result<u32, Error> {
        let mut ip = [0u8; IP6_HLEN];
        ip[0] = 0x60;
        ip[4..6].copy_from_slice(&(l4_len as u16).to_be_bytes());
        ip[6] = proto;
        ip[7] = TTL;
        ip[8..24].copy_from_slice(&src);
        ip[24..40].copy_from_slice(&dst);
        ctx.store(ETH_HLEN, &ip)?;
        // RFC 8200 8.1: source and destination (as they lie in `ip`), the upper-layer length
        // in 32 bits, three zero bytes and the next header.
        let mut rest = [0u8; 8];
        rest[0..4].copy_from_slice(&(l4_len as u32).to_be_bytes());
        rest[7] = proto;
        let addrs = sum_at(&mut ip, 8, 32, 0)?;
        sum(&mut rest, addrs)
    }

    #[inline(always)]
    fn port_unreachable<C: PacketCtx>(
        ctx: &C,
        p: &Packet<[u8; 16]>,
        eth: &[u8; ETH_HLEN],
    ) -> Result<(), Error> {
        // The whole IPv6 packet, extension headers included.
        let ip_len = p.l4_off - p.l3_off + Self::l4_len(ctx, p)?;
        let quote = quote_len(ctx, p, ip_len, ICMP6_MAX - IP6_HLEN - ICMP_HLEN);
        make_room(ctx, p, eth, quote, IP6_HLEN + ICMP_HLEN)?;
        let icmp_len = ICMP_HLEN + quote;
        let pseudo = Self::write_ip(ctx, p.daddr, p.saddr, IPPROTO_ICMPV6, icmp_len)?;
        let icmp_off = ETH_HLEN + IP6_HLEN;
        ctx.store(icmp_off, &icmp_header(1, 4))?;
        let csum = fold(sum_packet::<C, ICMP6_PAD>(ctx, icmp_off, icmp_len, pseudo)?);
        ctx.store(icmp_off + 2, &csum.to_ne_bytes())
    }
}
