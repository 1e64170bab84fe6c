//! ICMP and ICMPv6 errors about flows lb translated, handled as netfilter's NAT handles
//! "related" errors (RFC 5508 section 4): an error quoting a packet lb DNATed, masqueraded or
//! reverse-NATed is rewritten so that whoever it goes to finds its own packet in the quote.
//! Without this, a router's "fragmentation needed" / "packet too big" for a flow to a
//! ClusterIP reaches the client quoting the backend's address, the client's socket ignores
//! it, and path-MTU discovery black-holes the connection.
//!
//! - Towards the client (`revnat`): the quote is client (or node, masqueraded) → backend, as
//!   lb sent it; its reply entry names the frontend (and the masqueraded client). The quote
//!   becomes client → frontend, the outer destination the client, and an outer source that
//!   is the backend itself becomes the frontend.
//! - Towards the backend (`dnat`): the quote is frontend → client, a reply lb reverse-NATed;
//!   the flow's service entry names the backend (and the node side of a masqueraded flow).
//!   The quote becomes backend → client (or node), the outer destination the backend, and a
//!   masqueraded flow's outer source the node.
//!
//! Errors are looked up in conntrack only: they create no flow and keep none alive. Errors
//! quoting anything else pass untouched.
//!
//! Checksums: every changed field inside the ICMP message (the quoted addresses and ports,
//! and with them the quoted IPv4 header checksum and the quoted TCP/UDP checksum when the
//! quote holds it) is folded into the ICMP checksum as a plain field change, which keeps the
//! message's own sum, and so a CHECKSUM_COMPLETE skb's, unchanged. Outer addresses change the
//! IPv4 header checksum, or the ICMPv6 checksum's pseudo-header. A quoted SCTP CRC32c is left
//! as it is: it covers bytes the quote has not got, and no receiver checks it. Reads and
//! writes go through `load`/`store`, so quotes beyond the linear part of an skb work too.
use aya_ebpf::helpers::bpf_csum_diff;
use lb_common::{IPPROTO_SCTP, IPPROTO_TCP, IPPROTO_UDP};

use crate::{
    af::{Af, Endpoint, V4, V6},
    conntrack::Flow,
    ctx::{Error, PacketCtx},
    fwd::FwdAf,
    parse::{FRAG_NONE, Packet},
    rewrite::Side,
};

pub const IPPROTO_ICMP: u8 = 1;
pub const IPPROTO_ICMPV6: u8 = 58;
const ETH_HLEN: usize = 14;
const ICMP_HLEN: usize = 8;
const BPF_F_PSEUDO_HDR: u64 = 1 << 4;
/// The TTL / hop limit of an echo reply, a fresh host's (Linux's default).
const REPLY_TTL: u8 = 64;

/// Per-family parsing and rewriting of ICMP errors.
pub trait IcmpAf: FwdAf {
    /// Offsets of the source and destination address in this family's IP header.
    const SADDR_OFF: usize;
    const DADDR_OFF: usize;

    /// Parses an ICMP error into its outer headers `o` (`l4_off`: the ICMP header,
    /// `csum_off`: its checksum, `tcp_flags`: its type) and the packet it quotes `q`
    /// (`csum_off`: the quoted TCP/UDP checksum, 0 when the quote has not got it or it is a
    /// zero UDP checksum, which stays zero). `Error::Unparsed` for anything else: other ICMP
    /// messages, fragments, quotes of other protocols or cut before their ports.
    fn parse_error<C: PacketCtx>(
        ctx: &C,
        o: &mut Packet<Self::Addr>,
        q: &mut Packet<Self::Addr>,
    ) -> Result<(), Error>;

    /// This family's echo reply type (echo request: `ECHO_REQUEST`).
    const ECHO_REQUEST: u8;
    const ECHO_REPLY: u8;

    /// Parses an echo request (code 0, not fragmented, directly after the fixed IP header for
    /// IPv6, the whole packet the IP header declares in the frame) into `o` (`l4_off`: the ICMP header, `csum_off`: its checksum, `tcp_flags`: its
    /// type). `Error::Unparsed` for anything else.
    fn parse_echo<C: PacketCtx>(ctx: &C, o: &mut Packet<Self::Addr>) -> Result<(), Error>;

    /// Sets the TTL / hop limit of the packet `o` to a fresh host's, with the IPv4 checksum.
    fn fresh_ttl<C: PacketCtx>(ctx: &C, o: &Packet<Self::Addr>) -> Result<(), Error>;

    /// Updates the checksum at `at` for an address going from `old` to `new`, as a plain
    /// field change (no pseudo-header bookkeeping).
    fn csum_addr<C: PacketCtx>(
        ctx: &C,
        at: usize,
        old: Self::Addr,
        new: Self::Addr,
    ) -> Result<(), Error>;

    /// Replaces the outer `side` address `old` with `new`: the IPv4 header checksum, or the
    /// ICMPv6 checksum whose pseudo-header covers it.
    fn set_outer_addr<C: PacketCtx>(
        ctx: &C,
        o: &Packet<Self::Addr>,
        side: Side,
        old: Self::Addr,
        new: Self::Addr,
    ) -> Result<(), Error>;

    /// The quoted IP header's own checksum at `q.l3_off` follows an address change (IPv4).
    fn quoted_ip_csum<C: PacketCtx>(
        ctx: &C,
        o: &Packet<Self::Addr>,
        q: &Packet<Self::Addr>,
        old: Self::Addr,
        new: Self::Addr,
    ) -> Result<(), Error>;
}

/// Ports and checksum offset of the quoted L4 header at `l4_off` (the quote must hold its
/// first 8 bytes, RFC 792's minimum), written to `q` with the addresses.
#[inline(always)]
#[expect(
    clippy::too_many_arguments,
    reason = "the parsed fields of the quoted IP header"
)]
fn quoted_l4<C: PacketCtx, A>(
    ctx: &C,
    q: &mut Packet<A>,
    saddr: A,
    daddr: A,
    proto: u8,
    l3_off: usize,
    l4_off: usize,
    zero_udp_csum_is_none: bool,
) -> Result<(), Error> {
    let h = ctx.load::<[u8; 8]>(l4_off)?;
    let csum_off = match proto {
        IPPROTO_TCP if ctx.holds(l4_off + 18) => l4_off + 16,
        IPPROTO_TCP | IPPROTO_SCTP => 0,
        IPPROTO_UDP if h[6] == 0 && h[7] == 0 && zero_udp_csum_is_none => 0,
        IPPROTO_UDP => l4_off + 6,
        _ => return Err(Error::Unparsed),
    };
    *q = Packet {
        saddr,
        daddr,
        sport: u16::from_be_bytes([h[0], h[1]]),
        dport: u16::from_be_bytes([h[2], h[3]]),
        proto,
        tcp_flags: 0,
        sctp_chunk: 0,
        l3_off,
        l4_off,
        l4_len: 0,
        csum_off,
        frag: FRAG_NONE,
        ext_headers: 0,
        frag_id: 0,
    };
    Ok(())
}

/// The outer headers of an ICMP message whose header is at `l4_off`.
#[inline(always)]
fn outer<A>(saddr: A, daddr: A, proto: u8, ty: u8, l4_off: usize, l4_len: usize) -> Packet<A> {
    Packet {
        saddr,
        daddr,
        sport: 0,
        dport: 0,
        proto,
        tcp_flags: ty,
        sctp_chunk: 0,
        l3_off: ETH_HLEN,
        l4_off,
        l4_len,
        csum_off: l4_off + 2,
        frag: FRAG_NONE,
        ext_headers: 0,
        frag_id: 0,
    }
}

/// The outer headers of an ICMP message in the IPv4 header `ip` (`ihl` bytes, `tot_len` in
/// all) of type `ty`.
#[inline(always)]
fn outer4(ip: &[u8; 20], ty: u8, ihl: usize, tot_len: usize) -> Packet<[u8; 4]> {
    outer(
        [ip[12], ip[13], ip[14], ip[15]],
        [ip[16], ip[17], ip[18], ip[19]],
        IPPROTO_ICMP,
        ty,
        ETH_HLEN + ihl,
        tot_len - ihl,
    )
}

impl IcmpAf for V4 {
    const SADDR_OFF: usize = 12;
    const DADDR_OFF: usize = 16;
    const ECHO_REQUEST: u8 = 8;
    const ECHO_REPLY: u8 = 0;

    #[inline(always)]
    fn parse_echo<C: PacketCtx>(ctx: &C, o: &mut Packet<[u8; 4]>) -> Result<(), Error> {
        let ip = ctx.load::<[u8; 20]>(ETH_HLEN)?;
        let ihl = ((ip[0] & 0x0f) as usize) * 4;
        if ip[0] >> 4 != 4 || ihl < 20 || u16::from_be_bytes([ip[6], ip[7]]) & 0x3fff != 0 {
            return Err(Error::Unparsed);
        }
        let tot_len = u16::from_be_bytes([ip[2], ip[3]]) as usize;
        let icmp_off = ETH_HLEN + ihl;
        let icmp = ctx.load::<[u8; 4]>(icmp_off)?;
        // The whole request in the frame: the reply is the request, turned around.
        if icmp[0] != Self::ECHO_REQUEST
            || icmp[1] != 0
            || tot_len < ihl + ICMP_HLEN
            || !ctx.holds(ETH_HLEN + tot_len)
        {
            return Err(Error::Unparsed);
        }
        *o = outer4(&ip, icmp[0], ihl, tot_len);
        Ok(())
    }

    #[inline(always)]
    fn fresh_ttl<C: PacketCtx>(ctx: &C, o: &Packet<[u8; 4]>) -> Result<(), Error> {
        // TTL and protocol share a 16-bit word of the header checksum.
        let old = ctx.load::<[u8; 2]>(o.l3_off + 8)?;
        let new = [REPLY_TTL, old[1]];
        ctx.l3_csum_replace(
            o.l3_off + 10,
            u16::from_ne_bytes(old) as u64,
            u16::from_ne_bytes(new) as u64,
            2,
        )?;
        ctx.store(o.l3_off + 8, &new)
    }

    #[inline(always)]
    fn parse_error<C: PacketCtx>(
        ctx: &C,
        o: &mut Packet<[u8; 4]>,
        q: &mut Packet<[u8; 4]>,
    ) -> Result<(), Error> {
        let ip = ctx.load::<[u8; 20]>(ETH_HLEN)?;
        let ihl = ((ip[0] & 0x0f) as usize) * 4;
        // Not fragmented: a fragment of an error has not got the whole quote.
        if ip[0] >> 4 != 4 || ihl < 20 || u16::from_be_bytes([ip[6], ip[7]]) & 0x3fff != 0 {
            return Err(Error::Unparsed);
        }
        let tot_len = u16::from_be_bytes([ip[2], ip[3]]) as usize;
        let icmp_off = ETH_HLEN + ihl;
        let icmp = ctx.load::<[u8; 4]>(icmp_off)?;
        // Destination unreachable (fragmentation needed among them), time exceeded, parameter
        // problem: the errors that quote the packet that caused them (RFC 792, 1191).
        if !matches!(icmp[0], 3 | 11 | 12) || tot_len < ihl + ICMP_HLEN + 28 {
            return Err(Error::Unparsed);
        }
        let in_off = icmp_off + ICMP_HLEN;
        let inner = ctx.load::<[u8; 20]>(in_off)?;
        let iihl = ((inner[0] & 0x0f) as usize) * 4;
        // Only a quote with ports: not a later fragment (a first one is fine).
        if inner[0] >> 4 != 4 || iihl < 20 || u16::from_be_bytes([inner[6], inner[7]]) & 0x1fff != 0
        {
            return Err(Error::Unparsed);
        }
        *o = outer4(&ip, icmp[0], ihl, tot_len);
        quoted_l4(
            ctx,
            q,
            [inner[12], inner[13], inner[14], inner[15]],
            [inner[16], inner[17], inner[18], inner[19]],
            inner[9],
            in_off,
            in_off + iihl,
            true,
        )
    }

    #[inline(always)]
    fn csum_addr<C: PacketCtx>(
        ctx: &C,
        at: usize,
        old: [u8; 4],
        new: [u8; 4],
    ) -> Result<(), Error> {
        ctx.l3_csum_replace(
            at,
            u32::from_ne_bytes(old) as u64,
            u32::from_ne_bytes(new) as u64,
            4,
        )
    }

    #[inline(always)]
    fn set_outer_addr<C: PacketCtx>(
        ctx: &C,
        o: &Packet<[u8; 4]>,
        side: Side,
        old: [u8; 4],
        new: [u8; 4],
    ) -> Result<(), Error> {
        // ICMPv4's checksum has no pseudo-header: only the IP header's changes.
        Self::csum_addr(ctx, o.l3_off + 10, old, new)?;
        ctx.store(o.l3_off + field::<Self>(side), &new)
    }

    #[inline(always)]
    fn quoted_ip_csum<C: PacketCtx>(
        ctx: &C,
        o: &Packet<[u8; 4]>,
        q: &Packet<[u8; 4]>,
        old: [u8; 4],
        new: [u8; 4],
    ) -> Result<(), Error> {
        patch_csum::<C, Self>(ctx, o, q.l3_off + 10, old, new)
    }
}

impl IcmpAf for V6 {
    const SADDR_OFF: usize = 8;
    const DADDR_OFF: usize = 24;
    const ECHO_REQUEST: u8 = 128;
    const ECHO_REPLY: u8 = 129;

    #[inline(always)]
    fn parse_echo<C: PacketCtx>(ctx: &C, o: &mut Packet<[u8; 16]>) -> Result<(), Error> {
        let ip = ctx.load::<[u8; 8]>(ETH_HLEN)?;
        if ip[0] >> 4 != 6 || ip[6] != IPPROTO_ICMPV6 {
            return Err(Error::Unparsed);
        }
        let payload_len = u16::from_be_bytes([ip[4], ip[5]]) as usize;
        let icmp_off = ETH_HLEN + 40;
        let icmp = ctx.load::<[u8; 4]>(icmp_off)?;
        if icmp[0] != Self::ECHO_REQUEST
            || icmp[1] != 0
            || payload_len < ICMP_HLEN
            || !ctx.holds(icmp_off + payload_len)
        {
            return Err(Error::Unparsed);
        }
        *o = outer(
            ctx.load::<[u8; 16]>(ETH_HLEN + 8)?,
            ctx.load::<[u8; 16]>(ETH_HLEN + 24)?,
            IPPROTO_ICMPV6,
            icmp[0],
            icmp_off,
            payload_len,
        );
        Ok(())
    }

    #[inline(always)]
    fn fresh_ttl<C: PacketCtx>(ctx: &C, o: &Packet<[u8; 16]>) -> Result<(), Error> {
        // No header checksum; the hop limit is outside ICMPv6's pseudo-header.
        ctx.store(o.l3_off + 7, &REPLY_TTL)
    }

    #[inline(always)]
    fn parse_error<C: PacketCtx>(
        ctx: &C,
        o: &mut Packet<[u8; 16]>,
        q: &mut Packet<[u8; 16]>,
    ) -> Result<(), Error> {
        let ip = ctx.load::<[u8; 8]>(ETH_HLEN)?;
        if ip[0] >> 4 != 6 || ip[6] != IPPROTO_ICMPV6 {
            return Err(Error::Unparsed);
        }
        let payload_len = u16::from_be_bytes([ip[4], ip[5]]) as usize;
        let icmp_off = ETH_HLEN + 40;
        let icmp = ctx.load::<[u8; 4]>(icmp_off)?;
        // Destination unreachable, packet too big, time exceeded, parameter problem (RFC 4443).
        if !matches!(icmp[0], 1..=4) || payload_len < ICMP_HLEN + 48 {
            return Err(Error::Unparsed);
        }
        let in_off = icmp_off + ICMP_HLEN;
        let inner = ctx.load::<[u8; 8]>(in_off)?;
        // A quote whose next header is the L4 one (no extension headers in front of it).
        if inner[0] >> 4 != 6 {
            return Err(Error::Unparsed);
        }
        *o = outer(
            ctx.load::<[u8; 16]>(ETH_HLEN + 8)?,
            ctx.load::<[u8; 16]>(ETH_HLEN + 24)?,
            IPPROTO_ICMPV6,
            icmp[0],
            icmp_off,
            payload_len,
        );
        quoted_l4(
            ctx,
            q,
            ctx.load::<[u8; 16]>(in_off + 8)?,
            ctx.load::<[u8; 16]>(in_off + 24)?,
            inner[6],
            in_off,
            in_off + 40,
            false,
        )
    }

    #[inline(always)]
    fn csum_addr<C: PacketCtx>(
        ctx: &C,
        at: usize,
        old: [u8; 16],
        new: [u8; 16],
    ) -> Result<(), Error> {
        ctx.l3_csum_replace(at, 0, diff16(&old, &new)?, 0)
    }

    #[inline(always)]
    fn set_outer_addr<C: PacketCtx>(
        ctx: &C,
        o: &Packet<[u8; 16]>,
        side: Side,
        old: [u8; 16],
        new: [u8; 16],
    ) -> Result<(), Error> {
        // IPv6 has no header checksum; ICMPv6's pseudo-header covers the address.
        ctx.l4_csum_replace(o.csum_off, 0, diff16(&old, &new)?, BPF_F_PSEUDO_HDR)?;
        ctx.store(o.l3_off + field::<Self>(side), &new)
    }

    #[inline(always)]
    fn quoted_ip_csum<C: PacketCtx>(
        _ctx: &C,
        _o: &Packet<[u8; 16]>,
        _q: &Packet<[u8; 16]>,
        _old: [u8; 16],
        _new: [u8; 16],
    ) -> Result<(), Error> {
        Ok(())
    }
}

/// The checksum difference of a 16-byte address change (`bpf_csum_diff`).
#[inline(always)]
fn diff16(old: &[u8; 16], new: &[u8; 16]) -> Result<u64, Error> {
    // SAFETY: both buffers are 16 bytes on this program's stack; the helper only reads them.
    let d = unsafe {
        bpf_csum_diff(
            old.as_ptr().cast_mut().cast(),
            16,
            new.as_ptr().cast_mut().cast(),
            16,
            0,
        )
    };
    if d < 0 {
        return Err(Error::Rewrite);
    }
    Ok(d as u64)
}

#[inline(always)]
fn field<A: IcmpAf>(side: Side) -> usize {
    match side {
        Side::Source => A::SADDR_OFF,
        Side::Destination => A::DADDR_OFF,
    }
}

/// Updates the checksum at `at` inside the ICMP message of `o` for an address change, and
/// the ICMP checksum for that checksum's own change.
#[inline(always)]
fn patch_csum<C: PacketCtx, A: IcmpAf>(
    ctx: &C,
    o: &Packet<A::Addr>,
    at: usize,
    old: A::Addr,
    new: A::Addr,
) -> Result<(), Error> {
    let before = ctx.load::<u16>(at).map_err(|_| Error::Rewrite)?;
    A::csum_addr(ctx, at, old, new)?;
    let after = ctx.load::<u16>(at).map_err(|_| Error::Rewrite)?;
    ctx.l3_csum_replace(o.csum_off, before as u64, after as u64, 2)
}

/// Replaces the quoted `side` address `old` with `new`, with every checksum that covers it.
#[inline(always)]
fn set_quoted_addr<C: PacketCtx, A: IcmpAf>(
    ctx: &C,
    o: &Packet<A::Addr>,
    q: &Packet<A::Addr>,
    side: Side,
    old: A::Addr,
    new: A::Addr,
) -> Result<(), Error> {
    if q.csum_off != 0 {
        patch_csum::<C, A>(ctx, o, q.csum_off, old, new)?;
    }
    A::quoted_ip_csum(ctx, o, q, old, new)?;
    A::csum_addr(ctx, o.csum_off, old, new)?;
    ctx.store(q.l3_off + field::<A>(side), &new)
}

/// Replaces the quoted `side` port `old` with `new` (host order), with the checksums.
#[inline(always)]
fn set_quoted_port<C: PacketCtx, A>(
    ctx: &C,
    o: &Packet<A>,
    q: &Packet<A>,
    side: Side,
    old: u16,
    new: u16,
) -> Result<(), Error> {
    if old == new {
        return Ok(());
    }
    let (old_be, new_be) = (old.to_be() as u64, new.to_be() as u64);
    if q.csum_off != 0 {
        let before = ctx.load::<u16>(q.csum_off).map_err(|_| Error::Rewrite)?;
        ctx.l3_csum_replace(q.csum_off, old_be, new_be, 2)?;
        let after = ctx.load::<u16>(q.csum_off).map_err(|_| Error::Rewrite)?;
        ctx.l3_csum_replace(o.csum_off, before as u64, after as u64, 2)?;
    }
    ctx.l3_csum_replace(o.csum_off, old_be, new_be, 2)?;
    let at = match side {
        Side::Source => q.l4_off,
        Side::Destination => q.l4_off + 2,
    };
    ctx.store(at, &new.to_be())
}

/// The outer source an error towards the client gets: the frontend when the backend itself
/// sent it, else the router that did.
#[inline(always)]
pub fn client_side_source<A: Af>(
    o: &Packet<A::Addr>,
    q: &Packet<A::Addr>,
    frontend: &Endpoint<A::Addr>,
) -> A::Addr {
    if A::same(o.saddr, q.daddr) {
        frontend.addr
    } else {
        o.saddr
    }
}

/// Rewrites an error about a packet lb sent to a backend (`q`: client or node → backend) for
/// the client: `flow` is its reply entry's (`endpoint` the frontend, `nat` the client of a
/// masqueraded flow).
#[inline(always)]
pub fn revnat<C: PacketCtx, A: IcmpAf>(
    ctx: &C,
    o: &Packet<A::Addr>,
    q: &Packet<A::Addr>,
    flow: &Flow<A::Addr>,
) -> Result<(), Error> {
    let src = client_side_source::<A>(o, q, &flow.endpoint);
    set_quoted_addr::<C, A>(ctx, o, q, Side::Destination, q.daddr, flow.endpoint.addr)?;
    set_quoted_port(ctx, o, q, Side::Destination, q.dport, flow.endpoint.port)?;
    if flow.masqueraded() {
        set_quoted_addr::<C, A>(ctx, o, q, Side::Source, q.saddr, flow.nat.addr)?;
        set_quoted_port(ctx, o, q, Side::Source, q.sport, flow.nat.port)?;
        A::set_outer_addr(ctx, o, Side::Destination, o.daddr, flow.nat.addr)?;
    }
    if !A::same(src, o.saddr) {
        A::set_outer_addr(ctx, o, Side::Source, o.saddr, src)?;
    }
    Ok(())
}

/// Rewrites an error about a reply lb reverse-NATed (`q`: frontend → client) for the backend:
/// `flow` is its service entry's (`endpoint` the backend, `nat` the node side of a
/// masqueraded flow).
#[inline(always)]
pub fn dnat<C: PacketCtx, A: IcmpAf>(
    ctx: &C,
    o: &Packet<A::Addr>,
    q: &Packet<A::Addr>,
    flow: &Flow<A::Addr>,
) -> Result<(), Error> {
    set_quoted_addr::<C, A>(ctx, o, q, Side::Source, q.saddr, flow.endpoint.addr)?;
    set_quoted_port(ctx, o, q, Side::Source, q.sport, flow.endpoint.port)?;
    if flow.masqueraded() {
        set_quoted_addr::<C, A>(ctx, o, q, Side::Destination, q.daddr, flow.nat.addr)?;
        set_quoted_port(ctx, o, q, Side::Destination, q.dport, flow.nat.port)?;
        A::set_outer_addr(ctx, o, Side::Source, o.saddr, flow.nat.addr)?;
    }
    A::set_outer_addr(ctx, o, Side::Destination, o.daddr, flow.endpoint.addr)
}

/// Turns the echo request `o` into its reply, in place: Ethernet and IP addresses swapped
/// (which leaves the IPv4 header checksum and ICMPv6's pseudo-header sum as they are), a fresh
/// TTL, the reply type with the ICMP checksum following it as a plain field change (so a
/// CHECKSUM_COMPLETE skb's sum stays right). The caller sends it back out the device it came
/// in on.
#[inline(always)]
pub fn echo_reply<C: PacketCtx, A: IcmpAf>(ctx: &C, o: &Packet<A::Addr>) -> Result<(), Error> {
    let eth = ctx.load::<[u8; 12]>(0)?;
    let mut swapped = [0u8; 12];
    swapped[..6].copy_from_slice(&eth[6..]);
    swapped[6..].copy_from_slice(&eth[..6]);
    ctx.store(0, &swapped)?;
    ctx.store(o.l3_off + A::SADDR_OFF, &o.daddr)?;
    ctx.store(o.l3_off + A::DADDR_OFF, &o.saddr)?;
    A::fresh_ttl(ctx, o)?;
    let old = ctx.load::<[u8; 2]>(o.l4_off)?;
    let new = [A::ECHO_REPLY, old[1]];
    ctx.l3_csum_replace(
        o.csum_off,
        u16::from_ne_bytes(old) as u64,
        u16::from_ne_bytes(new) as u64,
        2,
    )?;
    ctx.store(o.l4_off, &new)
}
