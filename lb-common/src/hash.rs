//! The hashes and slot choice both sides compute the same way: backend slots, Maglev's flow
//! hash.

/// Maps a 32-bit hash or random number uniformly onto slots `1..=count` without a division
/// (Lemire's multiply-shift). `count` must be non-zero.
#[inline(always)]
pub fn select_slot(rand: u32, count: u16) -> u16 {
    (((rand as u64) * (count as u64)) >> 32) as u16 + 1
}

/// Spreads sequential values (socket cookies) over the 32-bit range before `select_slot`.
#[inline(always)]
pub fn mix64(v: u64) -> u32 {
    // The finalizer of splitmix64: cheap and every input bit affects the high output bits.
    let mut z = v.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    ((z ^ (z >> 31)) >> 32) as u32
}

/// The flow hash Maglev frontends pick their cell with on the packet path: the 5-tuple as the
/// client sent it (addresses as big-endian 32-bit words, then `sport << 16 | dport`, then the
/// protocol), each word folded in by xor and a multiply by the 64-bit golden ratio, finished
/// with `mix64`. No seed: every node computes the same hash for a flow, so with the same
/// backends (the same table) an ECMP'd flow meets the same backend on any node.
#[inline(always)]
pub fn flow_hash(saddr: &[u8], daddr: &[u8], sport: u16, dport: u16, proto: u8) -> u32 {
    #[inline(always)]
    fn fold(h: u64, w: u32) -> u64 {
        let h = (h ^ w as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        h ^ (h >> 32)
    }
    #[inline(always)]
    fn fold_addr(mut h: u64, a: &[u8]) -> u64 {
        let mut i = 0;
        while i + 4 <= a.len() {
            h = fold(h, u32::from_be_bytes([a[i], a[i + 1], a[i + 2], a[i + 3]]));
            i += 4;
        }
        h
    }
    let h = fold_addr(0, saddr);
    let h = fold_addr(h, daddr);
    let h = fold(h, (sport as u32) << 16 | dport as u32);
    mix64(fold(h, proto as u32))
}
