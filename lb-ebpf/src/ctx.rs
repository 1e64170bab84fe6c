//! What packet code needs from a program context: the linear data window to parse, and the
//! helpers a rewrite uses. Parsing and rewriting are written against `PacketCtx`, never against
//! `TcContext`, so the XDP entry reuses them: `XdpContext` frames are always linear
//! (`pull_data` is a no-op there), and `store`/csum become bounds-checked direct writes and
//! RFC 1624 incremental updates.
use aya_ebpf::{
    EbpfContext,
    bindings::{
        TC_ACT_OK, TC_ACT_SHOT,
        bpf_adj_room_mode::BPF_ADJ_ROOM_MAC,
        bpf_fib_lookup,
        xdp_action::{XDP_DROP, XDP_PASS, XDP_TX},
    },
    helpers::{
        bpf_fib_lookup as fib_lookup_helper, bpf_redirect, bpf_redirect_neigh, bpf_skb_change_tail,
    },
    programs::{TcContext, XdpContext},
};

/// Why packet handling stopped early.
pub enum Error {
    /// Not a packet lb understands completely: pass it untouched.
    Unparsed,
    /// A rewrite helper failed midway: drop rather than forward a half-rewritten packet.
    Rewrite,
}

pub trait PacketCtx: EbpfContext {
    /// The verdict that hands the packet on to the stack (as it is now).
    const PASS: i32;
    /// The verdict that drops the packet.
    const DROP: i32;
    /// Whether `redirect_neigh` works here (tc). Where it does not (XDP), a packet whose next
    /// hop is not resolved yet is left untouched for tc instead.
    const RESOLVES_NEIGH: bool;
    /// Whether this hook builds REJECT replies in place (tc). XDP leaves packets to reject
    /// untouched for tc ingress on the same device, which does.
    const BUILDS_REPLIES: bool;

    /// Start of the linear packet data (an address the verifier tracks as a packet pointer).
    fn data(&self) -> usize;
    /// End of the linear packet data; every access must stay below it.
    fn data_end(&self) -> usize;
    /// Length of the whole packet, linear or not (what counters count).
    fn len(&self) -> u32;
    /// Whether the packet is at least `len` bytes long.
    fn holds(&self, len: usize) -> bool;
    /// Makes the first `len` bytes linear, so direct access can reach them.
    fn pull_data(&self, len: u32) -> Result<(), Error>;
    /// Reads a `T` at `off` through a helper: no packet pointer, so an offset whose bounds the
    /// verifier lost on the way (a subprogram argument) still works.
    fn load<T>(&self, off: usize) -> Result<T, Error>;
    /// Writes `v` at `off`.
    fn store<T>(&self, off: usize, v: &T) -> Result<(), Error>;
    /// Updates the L3 checksum at `off` for a `from` → `to` change (`flags`: its size).
    fn l3_csum_replace(&self, off: usize, from: u64, to: u64, flags: u64) -> Result<(), Error>;
    /// Updates the L4 checksum at `off` (`flags`: size, `BPF_F_PSEUDO_HDR`, `MARK_MANGLED_0`).
    fn l4_csum_replace(&self, off: usize, from: u64, to: u64, flags: u64) -> Result<(), Error>;
    /// The device the packet arrived on.
    fn ifindex(&self) -> u32;
    /// `bpf_fib_lookup` for forwarding (`BPF_FIB_LKUP_RET_*`; fills `params` out).
    fn fib_lookup(&self, params: &mut bpf_fib_lookup) -> i64;
    /// Sends the packet out of `ifindex` as it is (the returned verdict).
    fn redirect(&self, ifindex: u32) -> i32;
    /// Sends the packet out of `ifindex`, resolving the next hop's MAC on the way.
    fn redirect_neigh(&self, ifindex: u32) -> i32;

    // What building a reply in place needs (`reject`). Failures are `Error::Rewrite`: the
    // packet may be half rebuilt, so it is dropped. (Its header reads go through `load`, all
    // before the first write, so a failed read still leaves the packet untouched.)

    /// Cuts the packet to `len` bytes, or zero-fills it up to `len`.
    fn change_tail(&self, len: u32) -> Result<(), Error>;
    /// Inserts `len` zero bytes between the Ethernet header and the IP header.
    fn grow_after_mac(&self, len: u32) -> Result<(), Error>;
    /// Queues the packet to leave through the device it came in on; returns the verdict that
    /// makes it so.
    fn bounce(&self) -> Result<i32, Error>;
}

impl PacketCtx for TcContext {
    const PASS: i32 = TC_ACT_OK as i32;
    const DROP: i32 = TC_ACT_SHOT as i32;
    const RESOLVES_NEIGH: bool = true;
    const BUILDS_REPLIES: bool = true;

    #[inline(always)]
    fn data(&self) -> usize {
        TcContext::data(self)
    }

    #[inline(always)]
    fn data_end(&self) -> usize {
        TcContext::data_end(self)
    }

    #[inline(always)]
    fn len(&self) -> u32 {
        TcContext::len(self)
    }

    #[inline(always)]
    fn holds(&self, len: usize) -> bool {
        len <= TcContext::len(self) as usize
    }

    #[inline(always)]
    fn pull_data(&self, len: u32) -> Result<(), Error> {
        TcContext::pull_data(self, len).map_err(|_| Error::Unparsed)
    }

    #[inline(always)]
    fn load<T>(&self, off: usize) -> Result<T, Error> {
        TcContext::load(self, off).map_err(|_| Error::Unparsed)
    }

    #[inline(always)]
    fn store<T>(&self, off: usize, v: &T) -> Result<(), Error> {
        TcContext::store(self, off, v, 0).map_err(|_| Error::Rewrite)
    }

    #[inline(always)]
    fn l3_csum_replace(&self, off: usize, from: u64, to: u64, flags: u64) -> Result<(), Error> {
        TcContext::l3_csum_replace(self, off, from, to, flags).map_err(|_| Error::Rewrite)
    }

    #[inline(always)]
    fn l4_csum_replace(&self, off: usize, from: u64, to: u64, flags: u64) -> Result<(), Error> {
        TcContext::l4_csum_replace(self, off, from, to, flags).map_err(|_| Error::Rewrite)
    }

    #[inline(always)]
    fn ifindex(&self) -> u32 {
        // SAFETY: the context's __sk_buff, valid for the program's run.
        unsafe { (*self.skb.skb).ifindex }
    }

    #[inline(always)]
    fn fib_lookup(&self, params: &mut bpf_fib_lookup) -> i64 {
        // SAFETY: params is a whole bpf_fib_lookup on this program's stack.
        unsafe { fib_lookup_helper(self.as_ptr(), params, size_of::<bpf_fib_lookup>() as i32, 0) }
    }

    #[inline(always)]
    fn redirect(&self, ifindex: u32) -> i32 {
        // SAFETY: plain helper call.
        unsafe { bpf_redirect(ifindex, 0) as i32 }
    }

    #[inline(always)]
    fn redirect_neigh(&self, ifindex: u32) -> i32 {
        // SAFETY: no params (the FIB picks the next hop). 5.10's helper takes (ifindex, flags);
        // the NULL lands in flags as 0 and the rest is ignored there.
        unsafe { bpf_redirect_neigh(ifindex, core::ptr::null_mut(), 0, 0) as i32 }
    }

    #[inline(always)]
    fn change_tail(&self, len: u32) -> Result<(), Error> {
        // SAFETY: the helper takes any skb context.
        let r = unsafe { bpf_skb_change_tail(self.skb.skb.cast(), len, 0) };
        if r == 0 { Ok(()) } else { Err(Error::Rewrite) }
    }

    #[inline(always)]
    fn grow_after_mac(&self, len: u32) -> Result<(), Error> {
        self.adjust_room(len as i32, BPF_ADJ_ROOM_MAC, 0)
            .map_err(|_| Error::Rewrite)
    }

    #[inline(always)]
    fn bounce(&self) -> Result<i32, Error> {
        // On tc ingress `ifindex` is the device the packet arrived on; `redirect` sends it to
        // that device's egress: TC_ACT_REDIRECT on success, TC_ACT_SHOT otherwise.
        let r = self.redirect(self.ifindex());
        if r == aya_ebpf::bindings::TC_ACT_REDIRECT as i32 {
            Ok(r)
        } else {
            Err(Error::Rewrite)
        }
    }
}

/// Header offsets XDP accesses are masked with: a bound the verifier can see on offsets that
/// come out of memory (the parsed `Packet`). Every offset lb computes is far below it (the
/// deepest header starts at 14 + 60 bytes), so the mask never changes one; a compare would do
/// as well, but LLVM folds compares into the additions before them and leaves the verifier a
/// signed bound it cannot use.
const XDP_OFF_MASK: usize = 0x3ff;

/// The address of `size` bytes at `off` of the frame in `ctx`, if the frame holds them.
///
/// At least two bytes are checked: LLVM turns a one-byte check `start + 1 > end` into
/// `start >= end`, from which the verifier derives no range. The one-byte accesses lb makes
/// (TTL, hop limit) always have more header after them.
#[inline(always)]
fn xdp_at(ctx: &XdpContext, off: usize, size: usize) -> Option<usize> {
    let start = ctx.data() + (off & XDP_OFF_MASK);
    if start + size.max(2) > ctx.data_end() {
        return None;
    }
    Some(start)
}

/// The frame's length as its IP header tells it (Ethernet header included; 0 if not IP): the
/// verifier refuses arithmetic on `data_end`, so `data_end - data` cannot be computed, and
/// older kernels lack `bpf_xdp_get_buff_len`. Only counters use it; Ethernet padding is not
/// counted.
#[inline(always)]
fn xdp_ip_len(ctx: &XdpContext) -> u32 {
    const ETH: usize = 14;
    let Ok(proto) = ctx.load::<[u8; 2]>(12) else {
        return 0;
    };
    match u16::from_be_bytes(proto) {
        0x0800 => ctx
            .load::<[u8; 2]>(ETH + 2)
            .map_or(0, |l| ETH as u32 + u32::from(u16::from_be_bytes(l))),
        0x86dd => ctx
            .load::<[u8; 2]>(ETH + 4)
            .map_or(0, |l| (ETH + 40) as u32 + u32::from(u16::from_be_bytes(l))),
        _ => 0,
    }
}

/// One's-complement incremental update (RFC 1624, eqn. 3) of the checksum at `csum` for a
/// 16- or 32-bit field (`size` 2 or 4) changing from `from` to `to` (native order, as the bytes
/// lie). With `size` 0, as for `bpf_l4_csum_replace`, `to` is a 32-bit checksum difference:
/// `bpf_csum_diff` returns it folded to 16 bits since 6.12 but unfolded before.
#[inline(always)]
fn csum_update(csum: u16, from: u64, to: u64, size: u64) -> u16 {
    let mut sum = u32::from(!csum);
    let (f, t) = (from as u32, to as u32);
    match size {
        4 => {
            sum += u32::from(!(f as u16)) + u32::from(!((f >> 16) as u16));
            sum += (t & 0xffff) + (t >> 16);
        }
        2 => sum += u32::from(!(f as u16)) + (t & 0xffff),
        _ => sum += (t & 0xffff) + (t >> 16),
    }
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    !(sum as u16)
}

/// `BPF_F_MARK_MANGLED_0`: a UDP checksum of 0 means "none" and stays so; a computed 0 is
/// written as 0xffff.
const MARK_MANGLED_0: u64 = 1 << 5;
const CSUM_SIZE_MASK: u64 = 0xf;

// XDP sees a frame before any skb exists, so its L4 checksum is complete (drivers report
// CHECKSUM_PARTIAL only for locally sent skbs, which never meet XDP on a receiving device;
// virtio-net turns off guest checksum offload while an XDP program is attached): the
// pseudo-header flag needs no special case and every update is a plain one.
impl PacketCtx for XdpContext {
    const PASS: i32 = XDP_PASS as i32;
    const DROP: i32 = XDP_DROP as i32;
    const RESOLVES_NEIGH: bool = false;
    const BUILDS_REPLIES: bool = false;

    #[inline(always)]
    fn data(&self) -> usize {
        XdpContext::data(self)
    }

    #[inline(always)]
    fn data_end(&self) -> usize {
        XdpContext::data_end(self)
    }

    #[inline(always)]
    fn len(&self) -> u32 {
        xdp_ip_len(self)
    }

    #[inline(always)]
    fn holds(&self, len: usize) -> bool {
        len <= 0xffff && self.data() + len <= self.data_end()
    }

    #[inline(always)]
    fn pull_data(&self, _len: u32) -> Result<(), Error> {
        Ok(())
    }

    #[inline(always)]
    fn load<T>(&self, off: usize) -> Result<T, Error> {
        let at = xdp_at(self, off, size_of::<T>()).ok_or(Error::Unparsed)?;
        // SAFETY: `at` checked that the frame holds the whole `T` at `off`.
        Ok(unsafe { core::ptr::read_unaligned(at as *const T) })
    }

    #[inline(always)]
    fn store<T>(&self, off: usize, v: &T) -> Result<(), Error> {
        let at = xdp_at(self, off, size_of::<T>()).ok_or(Error::Rewrite)?;
        // SAFETY: as in `load`; `T` is plain bytes.
        unsafe { core::ptr::write_unaligned(at as *mut T, core::ptr::read(v)) };
        Ok(())
    }

    #[inline(always)]
    fn l3_csum_replace(&self, off: usize, from: u64, to: u64, flags: u64) -> Result<(), Error> {
        let old: u16 = self.load(off).map_err(|_| Error::Rewrite)?;
        self.store(off, &csum_update(old, from, to, flags & CSUM_SIZE_MASK))
    }

    #[inline(always)]
    fn l4_csum_replace(&self, off: usize, from: u64, to: u64, flags: u64) -> Result<(), Error> {
        let old: u16 = self.load(off).map_err(|_| Error::Rewrite)?;
        if flags & MARK_MANGLED_0 != 0 && old == 0 {
            return Ok(());
        }
        let mut new = csum_update(old, from, to, flags & CSUM_SIZE_MASK);
        if flags & MARK_MANGLED_0 != 0 && new == 0 {
            new = 0xffff;
        }
        self.store(off, &new)
    }

    #[inline(always)]
    fn ifindex(&self) -> u32 {
        self.ingress_ifindex() as u32
    }

    #[inline(always)]
    fn fib_lookup(&self, params: &mut bpf_fib_lookup) -> i64 {
        // SAFETY: params is a whole bpf_fib_lookup in memory this program owns.
        unsafe { fib_lookup_helper(self.as_ptr(), params, size_of::<bpf_fib_lookup>() as i32, 0) }
    }

    #[inline(always)]
    fn redirect(&self, ifindex: u32) -> i32 {
        if ifindex == self.ifindex() {
            return XDP_TX as i32;
        }
        // SAFETY: plain helper call.
        unsafe { bpf_redirect(ifindex, 0) as i32 }
    }

    #[inline(always)]
    fn redirect_neigh(&self, _ifindex: u32) -> i32 {
        // Never called (`RESOLVES_NEIGH` is false); leaving the packet to the stack is the
        // safe answer should it be.
        XDP_PASS as i32
    }

    // XDP builds no replies that change the packet's size (`BUILDS_REPLIES`): those are left
    // to tc instead.
    #[inline(always)]
    fn change_tail(&self, _len: u32) -> Result<(), Error> {
        Err(Error::Rewrite)
    }

    #[inline(always)]
    fn grow_after_mac(&self, _len: u32) -> Result<(), Error> {
        Err(Error::Rewrite)
    }

    // Replies rewritten in place (an echo reply) go back out with XDP_TX.
    #[inline(always)]
    fn bounce(&self) -> Result<i32, Error> {
        Ok(XDP_TX as i32)
    }
}
