//! Incremental CRC32c update for SCTP port rewrites.
//!
//! SCTP's checksum is a CRC32c over the whole SCTP packet (no IP pseudo-header), so an address
//! rewrite leaves it valid and a port rewrite does not. Recomputing it would mean reading every
//! byte of the packet (non-linear skbs included) in a loop the verifier walks byte by byte.
//! Instead the change is computed from the changed bytes alone:
//!
//! The CRC register update is linear over GF(2), so for two packets of equal length the XOR of
//! their CRCs is the CRC (zero initial value, no final XOR) of the XOR of their bytes. A port
//! rewrite changes only the first 4 bytes, so that difference is 4 bytes followed by zeros.
//! Feeding a 32-bit word into a reflected CRC register and then `n - 4` zero bytes multiplies
//! it by x^(8n) modulo the polynomial: the new checksum is the old one XOR `w · x^(8n) mod P`,
//! for `w` the XOR of old and new first 4 bytes. With x^(8n) = x^(8·(n mod 256)) ·
//! x^(2048·(n / 256)) from two 256-entry tables, that is two carry-less multiplications: a
//! fixed cost whatever the packet's size, and no packet byte past the header is read.
//!
//! Like the incremental Internet checksum, a packet whose CRC was wrong stays wrong by the same
//! error, so the receiver still drops it.

/// CRC32c (Castagnoli) polynomial, bit-reflected.
const POLY: u32 = 0x82f6_3b78;

/// `a · b mod P` for reflected polynomials (bit 31 holds the x^0 coefficient).
///
/// A loop, not unrolled: its head is where the verifier prunes callers' paths it has already
/// seen (the unrolled form made it walk the straight-line body for each, past 1M insns).
/// Branch-free inside, so each iteration is one path.
#[inline(always)]
const fn mul(a: u32, b: u32) -> u32 {
    let mut product = 0;
    let mut b = b;
    let mut i = 0;
    while i < 32 {
        product ^= b & ((a >> (31 - i)) & 1).wrapping_neg();
        // b · x: shift towards x^31; the coefficient leaving x^31 becomes x^32 ≡ POLY.
        b = (b >> 1) ^ (POLY & (b & 1).wrapping_neg());
        i += 1;
    }
    product
}

/// `a · x^8 mod P`: `a` pushed through one zero byte.
const fn times_x8(a: u32) -> u32 {
    let mut a = a;
    let mut i = 0;
    while i < 8 {
        a = (a >> 1) ^ (POLY & (a & 1).wrapping_neg());
        i += 1;
    }
    a
}

/// `ZEROS[i]` = x^(8·i) mod P: the effect of `i` zero bytes on the CRC register.
static ZEROS: [u32; 256] = {
    let mut t = [0u32; 256];
    // x^0: bit 31.
    t[0] = 1 << 31;
    let mut i = 1;
    while i < 256 {
        t[i] = times_x8(t[i - 1]);
        i += 1;
    }
    t
};

/// `ZEROS_256[i]` = x^(8·256·i) mod P: the effect of `256·i` zero bytes. With `ZEROS` this
/// covers every SCTP length an IP packet can carry (< 2^16 bytes).
static ZEROS_256: [u32; 256] = {
    let mut step = 1 << 31;
    let mut i = 0;
    while i < 256 {
        step = times_x8(step);
        i += 1;
    }
    let mut t = [0u32; 256];
    t[0] = 1 << 31;
    let mut i = 1;
    while i < 256 {
        t[i] = mul(t[i - 1], step);
        i += 1;
    }
    t
};

/// The value to XOR into the (little-endian) CRC32c of an SCTP packet of `len` bytes when its
/// first 4 bytes (the ports) change by the XOR `diff` (read little-endian, as the CRC consumes
/// bytes).
///
/// Not inlined: one BPF subprogram instead of a copy at every rewrite site.
#[inline(never)]
pub fn port_change(diff: u32, len: u32) -> u32 {
    // The callers' bounds on `len` let LLVM drop the masks below, but the verifier cannot
    // follow those bounds; a volatile read hides them so the masks (which it checks) stay.
    // SAFETY: a read of a local.
    let len = unsafe { core::ptr::read_volatile(&len) };
    let low = ZEROS[(len & 0xff) as usize];
    let high = ZEROS_256[((len >> 8) & 0xff) as usize];
    mul(mul(diff, low), high)
}
