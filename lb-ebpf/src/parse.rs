//! Ethernet / IPv4 / IPv6 / TCP / UDP / SCTP parsing over any `PacketCtx`. Every read is
//! checked against `data_end` first, which is also what the verifier needs to see.
//!
//! Only packets lb can translate completely parse: IPv4 fragments (later ones carry no ports),
//! IPv6 extension headers (not walked), other L4 protocols, bad IHL or TCP data offset, and
//! truncated headers (the IP header and the whole TCP, UDP or SCTP common header must be in
//! the frame) are `Error::Unparsed`, which the caller passes untouched.
use lb_common::{IPPROTO_SCTP, IPPROTO_TCP, IPPROTO_UDP};

use crate::{
    af::{Af, V4, V6},
    ctx::{Error, PacketCtx},
    icmp::{IPPROTO_ICMP, IPPROTO_ICMPV6},
};

const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
/// Ethernet + IPv4 with the largest options + TCP: what must be linear to parse any packet
/// (SCTP's common header plus its first chunk header is 16 bytes).
const MAX_HDR_LEN: u32 = 14 + 60 + 20;

pub const TCP_FIN: u8 = 0x01;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_RST: u8 = 0x04;
pub const TCP_ACK: u8 = 0x10;

/// SCTP chunk types conntrack reacts to (RFC 9260 section 3.2).
pub const SCTP_INIT: u8 = 1;
pub const SCTP_ABORT: u8 = 6;
pub const SCTP_SHUTDOWN_COMPLETE: u8 = 14;
/// `Packet::sctp_chunk` of a packet that carries no chunk (a bare common header).
pub const SCTP_NO_CHUNK: u8 = 0xff;

/// The parsed headers of a TCP, UDP or SCTP packet; addresses in network order, ports host
/// order.
pub struct Packet<A> {
    pub saddr: A,
    pub daddr: A,
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
    pub tcp_flags: u8,
    /// Type of the first SCTP chunk (INIT, INIT ACK and SHUTDOWN COMPLETE are never bundled
    /// with others, so the first is the one that matters); 0 for TCP and UDP.
    pub sctp_chunk: u8,
    /// Offset of the IP header.
    pub l3_off: usize,
    pub l4_off: usize,
    /// Length of the L4 packet per the IP header (SCTP's CRC32c covers all of it).
    pub l4_len: usize,
    /// Offset of the L4 checksum field (SCTP: its CRC32c).
    pub csum_off: usize,
}

/// The network layer of a frame lb can parse, ICMP apart (`icmp` parses its errors).
pub enum L3 {
    V4,
    V6,
    Icmp4,
    Icmp6,
}

/// Makes the headers of the packet in `ctx` linear where the skb is not, and returns its
/// family. The family's `ParseAf::parse` then parses the rest.
#[inline(always)]
pub fn l3<C: PacketCtx>(ctx: &C) -> Result<L3, Error> {
    let linear = ctx.data_end() - ctx.data();
    if linear < MAX_HDR_LEN as usize && (linear as u32) < ctx.len() {
        ctx.pull_data(ctx.len().min(MAX_HDR_LEN))?;
    }
    // Two bytes at a time: the protocol with the TTL before it, the next header with the hop
    // limit after it (a one-byte bounds check gives the XDP verifier no range, see `ctx`).
    match u16::from_be_bytes(read::<C, [u8; 2]>(ctx, 12)?) {
        ETH_P_IP if read::<C, [u8; 2]>(ctx, ETH_HLEN + 8)?[1] == IPPROTO_ICMP => Ok(L3::Icmp4),
        ETH_P_IP => Ok(L3::V4),
        ETH_P_IPV6 if read::<C, [u8; 2]>(ctx, ETH_HLEN + 6)?[0] == IPPROTO_ICMPV6 => Ok(L3::Icmp6),
        ETH_P_IPV6 => Ok(L3::V6),
        _ => Err(Error::Unparsed),
    }
}

/// Per-family header parsing.
pub trait ParseAf: Af {
    /// Parses the IP and L4 headers of an Ethernet frame of this family into `out` (which the
    /// tc path keeps in scratch memory rather than on its stack).
    fn parse<C: PacketCtx>(ctx: &C, out: &mut Packet<Self::Addr>) -> Result<(), Error>;
}

impl ParseAf for V4 {
    #[inline(always)]
    fn parse<C: PacketCtx>(ctx: &C, out: &mut Packet<[u8; 4]>) -> Result<(), Error> {
        parse_ipv4(ctx, ETH_HLEN, out)
    }
}

impl ParseAf for V6 {
    #[inline(always)]
    fn parse<C: PacketCtx>(ctx: &C, out: &mut Packet<[u8; 16]>) -> Result<(), Error> {
        parse_ipv6(ctx, ETH_HLEN, out)
    }
}

/// Reads a `T` at `off`, bounds-checked against `data_end`.
#[inline(always)]
pub fn read<C: PacketCtx, T: Copy>(ctx: &C, off: usize) -> Result<T, Error> {
    let start = ctx.data();
    if start + off + size_of::<T>() > ctx.data_end() {
        return Err(Error::Unparsed);
    }
    // SAFETY: in bounds per the check above; T is plain bytes with alignment 1.
    Ok(unsafe { core::ptr::read_unaligned((start + off) as *const T) })
}

#[inline(always)]
fn parse_ipv4<C: PacketCtx>(
    ctx: &C,
    l3_off: usize,
    out: &mut Packet<[u8; 4]>,
) -> Result<(), Error> {
    let ip = read::<C, [u8; 20]>(ctx, l3_off)?;
    let ihl = ((ip[0] & 0x0f) as usize) * 4;
    if ip[0] >> 4 != 4 || ihl < 20 {
        return Err(Error::Unparsed);
    }
    if u16::from_be_bytes([ip[6], ip[7]]) & 0x3fff != 0 {
        return Err(Error::Unparsed);
    }
    let tot_len = u16::from_be_bytes([ip[2], ip[3]]) as usize;
    if tot_len < ihl {
        return Err(Error::Unparsed);
    }
    let saddr = [ip[12], ip[13], ip[14], ip[15]];
    let daddr = [ip[16], ip[17], ip[18], ip[19]];
    parse_l4(ctx, out, saddr, daddr, ip[9], l3_off, ihl, tot_len - ihl)
}

#[inline(always)]
fn parse_ipv6<C: PacketCtx>(
    ctx: &C,
    l3_off: usize,
    out: &mut Packet<[u8; 16]>,
) -> Result<(), Error> {
    // The fixed part and the addresses are read separately: no 40-byte copy on the stack.
    let ip = read::<C, [u8; 8]>(ctx, l3_off)?;
    if ip[0] >> 4 != 6 {
        return Err(Error::Unparsed);
    }
    let payload_len = u16::from_be_bytes([ip[4], ip[5]]) as usize;
    let saddr = read::<C, [u8; 16]>(ctx, l3_off + 8)?;
    let daddr = read::<C, [u8; 16]>(ctx, l3_off + 24)?;
    // A next header other than TCP/UDP/SCTP (extension headers included) fails in parse_l4.
    parse_l4(ctx, out, saddr, daddr, ip[6], l3_off, 40, payload_len)
}

/// Parses the TCP, UDP or SCTP header after an IP header of `l3_len` bytes at `l3_off`, of a packet
/// whose IP payload is `l4_len` bytes.
#[inline(always)]
#[expect(
    clippy::too_many_arguments,
    reason = "the parsed fields of the IP header"
)]
fn parse_l4<C: PacketCtx, A>(
    ctx: &C,
    out: &mut Packet<A>,
    saddr: A,
    daddr: A,
    proto: u8,
    l3_off: usize,
    l3_len: usize,
    l4_len: usize,
) -> Result<(), Error> {
    let l4_off = l3_off + l3_len;
    let (tcp_flags, sctp_chunk, csum_off) = match proto {
        IPPROTO_TCP => {
            let th = read::<C, [u8; 20]>(ctx, l4_off)?;
            if th[12] >> 4 < 5 || l4_len < 20 {
                return Err(Error::Unparsed);
            }
            (th[13], 0, l4_off + 16)
        }
        IPPROTO_UDP => {
            // The whole header: a rewrite updates its checksum (bytes 6..8), which a frame cut
            // inside the header has not got.
            read::<C, [u8; 8]>(ctx, l4_off)?;
            if l4_len < 8 {
                return Err(Error::Unparsed);
            }
            (0, 0, l4_off + 6)
        }
        IPPROTO_SCTP => {
            // Common header: ports, verification tag, CRC32c. A port rewrite updates the CRC
            // from l4_len, so the IP header must not claim more bytes than the packet holds.
            read::<C, [u8; 12]>(ctx, l4_off)?;
            // The chunk is read before the length check: after it, LLVM would drop this read's
            // own bounds check as implied, which the verifier cannot follow on XDP.
            let chunk = if l4_len >= 16 {
                read::<C, [u8; 4]>(ctx, l4_off + 12)?[0]
            } else {
                SCTP_NO_CHUNK
            };
            if l4_len < 12 || !ctx.holds(l4_off + l4_len) {
                return Err(Error::Unparsed);
            }
            (0, chunk, l4_off + 8)
        }
        _ => return Err(Error::Unparsed),
    };
    let ports = read::<C, [u8; 4]>(ctx, l4_off)?;
    *out = Packet {
        saddr,
        daddr,
        sport: u16::from_be_bytes([ports[0], ports[1]]),
        dport: u16::from_be_bytes([ports[2], ports[3]]),
        proto,
        tcp_flags,
        sctp_chunk,
        l3_off,
        l4_off,
        l4_len,
        csum_off,
    };
    Ok(())
}
