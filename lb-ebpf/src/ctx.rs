//! What packet code needs from a program context: the linear data window to parse, and the
//! helpers a rewrite uses. Parsing and rewriting are written against `PacketCtx`, never against
//! `TcContext`, so an XDP entry can reuse them: `XdpContext` frames are always linear
//! (`pull_data` is a no-op there), and `store`/csum become direct writes plus `bpf_csum_diff`.
use aya_ebpf::{
    EbpfContext,
    bindings::bpf_adj_room_mode::BPF_ADJ_ROOM_MAC,
    helpers::{bpf_redirect, bpf_skb_change_tail},
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
    /// Writes `v` at `off`.
    fn store<T>(&self, off: usize, v: &T) -> Result<(), Error>;
    /// Updates the L3 checksum at `off` for a `from` → `to` change (`flags`: its size).
    fn l3_csum_replace(&self, off: usize, from: u64, to: u64, flags: u64) -> Result<(), Error>;
    /// Updates the L4 checksum at `off` (`flags`: size, `BPF_F_PSEUDO_HDR`, `MARK_MANGLED_0`).
    fn l4_csum_replace(&self, off: usize, from: u64, to: u64, flags: u64) -> Result<(), Error>;

    // What building a reply in place needs (`reject`). Failures are `Error::Rewrite`: the
    // packet may be half rebuilt, so it is dropped.

    /// Copies a `T` at `off` out of the packet, linear or not.
    fn load<T>(&self, off: usize) -> Result<T, Error>;
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
    fn load<T>(&self, off: usize) -> Result<T, Error> {
        TcContext::load(self, off).map_err(|_| Error::Rewrite)
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
        // SAFETY: the context pointer is valid for the program's run. On tc ingress
        // `ifindex` is the device the packet arrived on; flags 0 redirect to its egress.
        let r = unsafe { bpf_redirect((*self.skb.skb).ifindex, 0) };
        // TC_ACT_REDIRECT on success, TC_ACT_SHOT otherwise.
        if r == aya_ebpf::bindings::TC_ACT_REDIRECT as i64 {
            Ok(r as i32)
        } else {
            Err(Error::Rewrite)
        }
    }
}
