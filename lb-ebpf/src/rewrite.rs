//! Address and port rewriting with incremental checksum updates.
//!
//! The kernel's csum helpers also handle CHECKSUM_PARTIAL skbs from local sockets: with
//! `BPF_F_PSEUDO_HDR` only the pseudo-header part of the L4 checksum changes there.
//!
//! SCTP has no pseudo-header: an address rewrite leaves its CRC32c alone, and a port rewrite
//! updates it incrementally (`crc32c`).
//!
//! A later fragment has no L4 header: only its addresses change. The datagram's L4 checksum
//! (in its first fragment, which got the same rewrite) covers the pseudo-header for all of
//! them. Which of the two a rewrite is, is a const parameter (`L4`), not a branch on the
//! packet: a branch at every rewrite site would double the verifier's paths at each.
use aya_ebpf::helpers::bpf_csum_diff;
use lb_common::{IPPROTO_SCTP, IPPROTO_UDP};

use crate::{
    af::{Af, Endpoint, V4, V6},
    crc32c,
    ctx::{Error, PacketCtx},
    parse::Packet,
};

const BPF_F_PSEUDO_HDR: u64 = 1 << 4;
const BPF_F_MARK_MANGLED_0: u64 = 1 << 5;

/// Which end of the packet a rewrite changes.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Source,
    Destination,
}

/// Per-family address rewriting.
pub trait RewriteAf: Af {
    /// Replaces the `side` address `old` with `new`, fixing the checksums (the L4 one only
    /// with `L4`: not for a later fragment, which has no L4 header).
    fn set_addr<C: PacketCtx, const L4: bool>(
        ctx: &C,
        p: &Packet<Self::Addr>,
        side: Side,
        old: Self::Addr,
        new: Self::Addr,
    ) -> Result<(), Error>;
}

impl RewriteAf for V4 {
    #[inline(always)]
    fn set_addr<C: PacketCtx, const L4: bool>(
        ctx: &C,
        p: &Packet<[u8; 4]>,
        side: Side,
        old: [u8; 4],
        new: [u8; 4],
    ) -> Result<(), Error> {
        let (old_v, new_v) = (
            u32::from_ne_bytes(old) as u64,
            u32::from_ne_bytes(new) as u64,
        );
        if L4 && p.proto != IPPROTO_SCTP {
            ctx.l4_csum_replace(
                p.csum_off,
                old_v,
                new_v,
                BPF_F_PSEUDO_HDR | 4 | mangled0(p.proto),
            )?;
        }
        ctx.l3_csum_replace(p.l3_off + 10, old_v, new_v, 4)?;
        let field = match side {
            Side::Source => 12,
            Side::Destination => 16,
        };
        ctx.store(p.l3_off + field, &new)
    }
}

impl RewriteAf for V6 {
    #[inline(always)]
    fn set_addr<C: PacketCtx, const L4: bool>(
        ctx: &C,
        p: &Packet<[u8; 16]>,
        side: Side,
        old: [u8; 16],
        new: [u8; 16],
    ) -> Result<(), Error> {
        // IPv6 has no header checksum; only the L4 pseudo-header changes, and SCTP has none.
        if L4 && p.proto != IPPROTO_SCTP {
            // SAFETY: both buffers are 16 bytes on this program's stack; the helper only reads
            // them.
            let diff = unsafe {
                bpf_csum_diff(
                    old.as_ptr().cast_mut().cast(),
                    16,
                    new.as_ptr().cast_mut().cast(),
                    16,
                    0,
                )
            };
            if diff < 0 {
                return Err(Error::Rewrite);
            }
            ctx.l4_csum_replace(
                p.csum_off,
                0,
                diff as u64,
                BPF_F_PSEUDO_HDR | mangled0(p.proto),
            )?;
        }
        let field = match side {
            Side::Source => 8,
            Side::Destination => 24,
        };
        ctx.store(p.l3_off + field, &new)
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
fn set_port<C: PacketCtx, A, const L4: bool>(
    ctx: &C,
    p: &Packet<A>,
    side: Side,
    old: u16,
    new: u16,
) -> Result<(), Error> {
    if !L4 || old == new {
        return Ok(());
    }
    let (old_be, new_be) = (old.to_be(), new.to_be());
    let field = match side {
        Side::Source => 0,
        Side::Destination => 2,
    };
    if p.proto == IPPROTO_SCTP {
        sctp_crc_port_change(ctx, p, side, old, new)?;
    } else {
        ctx.l4_csum_replace(
            p.csum_off,
            old_be as u64,
            new_be as u64,
            2 | mangled0(p.proto),
        )?;
    }
    ctx.store(p.l4_off + field, &new_be)
}

/// Updates the SCTP CRC32c for the `side` port going from `old` to `new`.
///
/// A zero CRC is left zero: that is what a local SCTP socket leaves in the header when its
/// device offloads the CRC (CHECKSUM_PARTIAL, which a tc program cannot see), and the kernel or
/// NIC computes it later over the rewritten bytes. A real CRC of zero is a 2^-32 chance, whose packet then
/// fails the receiver's check like any other corrupt one.
#[inline(always)]
fn sctp_crc_port_change<C: PacketCtx, A>(
    ctx: &C,
    p: &Packet<A>,
    side: Side,
    old: u16,
    new: u16,
) -> Result<(), Error> {
    // Through a helper: `p` may live in scratch memory, where the verifier has no bounds for
    // its offsets to do packet pointer arithmetic with.
    let crc = u32::from_le_bytes(
        ctx.load::<[u8; 4]>(p.csum_off)
            .map_err(|_| Error::Rewrite)?,
    );
    if crc == 0 {
        return Ok(());
    }
    let [a, b] = (old ^ new).to_be_bytes();
    let diff = match side {
        Side::Source => u32::from_le_bytes([a, b, 0, 0]),
        Side::Destination => u32::from_le_bytes([0, 0, a, b]),
    };
    let crc = crc ^ crc32c::port_change(diff, p.l4_len as u32);
    ctx.store(p.csum_off, &crc.to_le_bytes())
}

/// Sends the packet to `backend` instead of the frontend it was addressed to.
#[inline(always)]
pub fn dnat<C: PacketCtx, A: RewriteAf, const L4: bool>(
    ctx: &C,
    p: &Packet<A::Addr>,
    backend: Endpoint<A::Addr>,
) -> Result<(), Error> {
    A::set_addr::<C, L4>(ctx, p, Side::Destination, p.daddr, backend.addr)?;
    set_port::<C, _, L4>(ctx, p, Side::Destination, p.dport, backend.port)
}

/// Makes a backend's reply come from `frontend`.
#[inline(always)]
pub fn reverse_nat<C: PacketCtx, A: RewriteAf, const L4: bool>(
    ctx: &C,
    p: &Packet<A::Addr>,
    frontend: Endpoint<A::Addr>,
) -> Result<(), Error> {
    A::set_addr::<C, L4>(ctx, p, Side::Source, p.saddr, frontend.addr)?;
    set_port::<C, _, L4>(ctx, p, Side::Source, p.sport, frontend.port)
}

/// Masquerades the packet: its source becomes `to` (the node IP and NAT port).
#[inline(always)]
pub fn snat<C: PacketCtx, A: RewriteAf, const L4: bool>(
    ctx: &C,
    p: &Packet<A::Addr>,
    to: Endpoint<A::Addr>,
) -> Result<(), Error> {
    A::set_addr::<C, L4>(ctx, p, Side::Source, p.saddr, to.addr)?;
    set_port::<C, _, L4>(ctx, p, Side::Source, p.sport, to.port)
}

/// Makes a backend's reply to a masqueraded flow come from `frontend` and go back to `client`.
#[inline(always)]
pub fn reverse_snat<C: PacketCtx, A: RewriteAf, const L4: bool>(
    ctx: &C,
    p: &Packet<A::Addr>,
    frontend: Endpoint<A::Addr>,
    client: Endpoint<A::Addr>,
) -> Result<(), Error> {
    reverse_nat::<C, A, L4>(ctx, p, frontend)?;
    A::set_addr::<C, L4>(ctx, p, Side::Destination, p.daddr, client.addr)?;
    set_port::<C, _, L4>(ctx, p, Side::Destination, p.dport, client.port)
}
