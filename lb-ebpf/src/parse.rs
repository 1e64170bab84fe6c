//! Ethernet / IPv4 / IPv6 / TCP / UDP / SCTP parsing over any `PacketCtx`. Every read is
//! checked against `data_end` first, which is also what the verifier needs to see.
//!
//! IPv6 extension headers (hop-by-hop, routing with no segments left, destination options,
//! authentication, fragment) are walked, at most `MAX_EXT_HEADERS`, to the L4 header.
//! Fragments of TCP and UDP datagrams parse: a first one like any packet (it has the ports), a
//! later one without an L4 header (`Frag::Later`: `frag` supplies the ports its first
//! fragment had). Other L4 protocols (SCTP fragments too: their CRC32c spans the whole
//! packet), bad IHL or TCP data offset, and truncated headers (the IP header and the whole
//! TCP, UDP or SCTP common header must be in the frame) are `Error::Unparsed`, which the
//! caller passes untouched.
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

/// `Packet::frag` values (`lb_common::trace_frag`, so the trace record takes them as they are).
pub const FRAG_NONE: u8 = lb_common::trace_frag::NONE;
/// The first fragment of a datagram: it has the L4 header.
pub const FRAG_FIRST: u8 = lb_common::trace_frag::FIRST;
/// A later fragment: no L4 header; `sport` and `dport` are zero until `frag::recall`.
pub const FRAG_LATER: u8 = lb_common::trace_frag::LATER;

const NEXTHDR_HOP: u8 = 0;
const NEXTHDR_ROUTING: u8 = 43;
const NEXTHDR_FRAGMENT: u8 = 44;
const NEXTHDR_AUTH: u8 = 51;
const NEXTHDR_DEST: u8 = 60;
/// IPv6 extension headers walked before giving up (Cilium walks 4 too).
const MAX_EXT_HEADERS: usize = 4;

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
    /// `FRAG_NONE`, `FRAG_FIRST` or `FRAG_LATER`.
    pub frag: u8,
    /// IPv6 extension headers in front of the L4 header.
    pub ext_headers: u8,
    /// The fragment's datagram identification (IPv4 header or IPv6 fragment header).
    pub frag_id: u32,
}

impl<A> Packet<A> {
    /// Whether the packet carries its L4 header (all but later fragments).
    #[inline(always)]
    pub fn has_l4(&self) -> bool {
        self.frag != FRAG_LATER
    }
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
    let tot_len = u16::from_be_bytes([ip[2], ip[3]]) as usize;
    if tot_len < ihl {
        return Err(Error::Unparsed);
    }
    let saddr = [ip[12], ip[13], ip[14], ip[15]];
    let daddr = [ip[16], ip[17], ip[18], ip[19]];
    let frag_off = u16::from_be_bytes([ip[6], ip[7]]);
    let frag = if frag_off & 0x1fff != 0 {
        FRAG_LATER
    } else if frag_off & 0x2000 != 0 {
        FRAG_FIRST
    } else {
        FRAG_NONE
    };
    let id = u16::from_be_bytes([ip[4], ip[5]]) as u32;
    let l4 = L4At {
        proto: ip[9],
        l3_off,
        l3_len: ihl,
        l4_len: tot_len - ihl,
    };
    if frag == FRAG_LATER {
        return later_fragment(out, saddr, daddr, &l4, id, 0);
    }
    if frag == FRAG_FIRST && l4.proto == IPPROTO_SCTP {
        return Err(Error::Unparsed);
    }
    parse_l4(ctx, out, saddr, daddr, &l4)?;
    out.frag = frag;
    out.frag_id = id;
    Ok(())
}

/// A later fragment of a TCP or UDP datagram: addresses and where its data starts, no ports.
#[inline(always)]
fn later_fragment<A>(
    out: &mut Packet<A>,
    saddr: A,
    daddr: A,
    at: &L4At,
    frag_id: u32,
    ext_headers: u8,
) -> Result<(), Error> {
    if at.proto != IPPROTO_TCP && at.proto != IPPROTO_UDP {
        return Err(Error::Unparsed);
    }
    *out = Packet {
        saddr,
        daddr,
        sport: 0,
        dport: 0,
        proto: at.proto,
        tcp_flags: 0,
        sctp_chunk: 0,
        l3_off: at.l3_off,
        l4_off: at.l3_off + at.l3_len,
        l4_len: at.l4_len,
        csum_off: 0,
        frag: FRAG_LATER,
        ext_headers,
        frag_id,
    };
    Ok(())
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
    let walked = ext_headers(ctx, l3_off, ip[6]);
    if walked == EXT_UNPARSED {
        return Err(Error::Unparsed);
    }
    // Unpacked with masks: bounds the verifier keeps (see `ext_headers`).
    let next = walked as u8;
    let len = ((walked >> 8) & 0xfff) as usize;
    let frag = ((walked >> 20) & 0x3) as u8;
    let ext = ((walked >> 24) & 0xff) as u8;
    let id = (walked >> 32) as u32;
    if len < 40 || len - 40 > payload_len {
        return Err(Error::Unparsed);
    }
    // A next header other than TCP/UDP/SCTP (more extension headers too) fails in parse_l4.
    let l4 = L4At {
        proto: next,
        l3_off,
        l3_len: len,
        l4_len: payload_len + 40 - len,
    };
    if frag == FRAG_LATER {
        return later_fragment(out, saddr, daddr, &l4, id, ext);
    }
    if frag == FRAG_FIRST && l4.proto == IPPROTO_SCTP {
        return Err(Error::Unparsed);
    }
    parse_l4(ctx, out, saddr, daddr, &l4)?;
    out.frag = frag;
    out.frag_id = id;
    out.ext_headers = ext;
    Ok(())
}

/// `ext_headers` found a header it cannot walk past.
const EXT_UNPARSED: u64 = u64::MAX;

/// Walks the IPv6 extension headers after the fixed header at `l3_off` (whose next header is
/// `next`), at most `MAX_EXT_HEADERS`. Returns, packed: the L4 protocol (bits 0..8), the
/// length of the IPv6 header with its extension headers (8..20), `FRAG_*` (20..22), how many
/// extension headers (24..32) and the fragment identification (32..64); `EXT_UNPARSED` for a
/// routing header with segments left (the destination is a waypoint, not the service) or a
/// truncated header.
// A subprogram: its one unknown return value is one state for the verifier to carry on with,
// where the walk's branches inlined would each carry the whole pipeline after them.
#[inline(never)]
fn ext_headers<C: PacketCtx>(ctx: &C, l3_off: usize, next: u8) -> u64 {
    let (mut next, mut len) = (next, 40usize);
    let (mut frag, mut id, mut ext) = (FRAG_NONE, 0u32, 0u64);
    for _ in 0..MAX_EXT_HEADERS {
        match next {
            NEXTHDR_HOP | NEXTHDR_ROUTING | NEXTHDR_DEST | NEXTHDR_AUTH => {
                // Next header, length, and (routing) type and segments left.
                let Ok(h) = ctx.load::<[u8; 4]>(l3_off + len) else {
                    return EXT_UNPARSED;
                };
                if next == NEXTHDR_ROUTING && h[3] != 0 {
                    return EXT_UNPARSED;
                }
                len += if next == NEXTHDR_AUTH {
                    (h[1] as usize + 2) * 4
                } else {
                    (h[1] as usize + 1) * 8
                };
                next = h[0];
            }
            NEXTHDR_FRAGMENT => {
                let Ok(h) = ctx.load::<[u8; 8]>(l3_off + len) else {
                    return EXT_UNPARSED;
                };
                let off = u16::from_be_bytes([h[2], h[3]]);
                frag = if off & 0xfff8 != 0 {
                    FRAG_LATER
                } else if off & 1 != 0 {
                    FRAG_FIRST
                } else {
                    // An atomic fragment (RFC 6946): a whole datagram.
                    FRAG_NONE
                };
                id = u32::from_be_bytes([h[4], h[5], h[6], h[7]]);
                len += 8;
                next = h[0];
            }
            _ => break,
        }
        ext += 1;
    }
    if len > 0xfff {
        return EXT_UNPARSED;
    }
    u64::from(next) | (len as u64) << 8 | u64::from(frag) << 20 | ext << 24 | u64::from(id) << 32
}

/// Where the L4 header of a packet is: after an IP header (and extension headers) of
/// `l3_len` bytes at `l3_off`, `l4_len` bytes of `proto` (the fragment's share of them, for
/// a fragment).
struct L4At {
    proto: u8,
    l3_off: usize,
    l3_len: usize,
    l4_len: usize,
}

/// Parses the TCP, UDP or SCTP header `at` says where to find (nothing of a later fragment's
/// but its place). The caller fills in the fragment fields.
#[inline(always)]
fn parse_l4<C: PacketCtx, A>(
    ctx: &C,
    out: &mut Packet<A>,
    saddr: A,
    daddr: A,
    at: &L4At,
) -> Result<(), Error> {
    let (proto, l3_off, l4_len) = (at.proto, at.l3_off, at.l4_len);
    let l4_off = l3_off + at.l3_len;
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
        frag: FRAG_NONE,
        ext_headers: 0,
        frag_id: 0,
    };
    Ok(())
}
