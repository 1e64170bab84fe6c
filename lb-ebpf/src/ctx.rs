//! What packet code needs from a program context: the linear data window to parse, and the
//! helpers a rewrite uses. Parsing and rewriting are written against `PacketCtx`, never against
//! `TcContext`, so an XDP entry can reuse them: `XdpContext` frames are always linear
//! (`pull_data` is a no-op there), and `store`/csum become direct writes plus `bpf_csum_diff`.
use aya_ebpf::{
    EbpfContext,
    bindings::{bpf_adj_room_mode::BPF_ADJ_ROOM_MAC, bpf_fib_lookup},
    helpers::{
        bpf_fib_lookup as fib_lookup_helper, bpf_redirect, bpf_redirect_neigh, bpf_skb_change_tail,
    },
    programs::TcContext,
};

/// Why packet handling stopped early.
pub enum Error {
    /// Not a packet lb understands completely: pass it untouched.
    Unparsed,
    /// A rewrite helper failed midway: drop rather than forward a half-rewritten packet.
    Rewrite,
}

pub trait PacketCtx: EbpfContext {
    /// Start of the linear packet data (an address the verifier tracks as a packet pointer).
    fn data(&self) -> usize;
    /// End of the linear packet data; every access must stay below it.
    fn data_end(&self) -> usize;
    /// Length of the whole packet, linear or not.
    fn len(&self) -> u32;
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
