//! Maglev lookup tables (Eisenbud et al., "Maglev: A Fast and Reliable Software Network Load
//! Balancer", NSDI 2016, section 3.4), built here and written into `lb_maglev` by the
//! reconciler; the datapath only reads cell `hash % M`.
//!
//! Each backend gets a permutation of the M cells from two hashes of its identity (address
//! bytes, port big-endian, protocol number): `offset = h1 % M`, `skip = h2 % (M - 1) + 1`, cell
//! `j` of the permutation `(offset + j * skip) % M`. Backends take turns claiming the next free
//! cell of their permutation until every cell is taken, so each gets M/N cells (± 1 before the
//! last round) and removing one backend moves little more than its own cells. The hashes are
//! fixed (FNV-1a 64 of the identity, then the splitmix64 finalizer with two different seeds),
//! and backends are sorted and deduplicated first: every node builds the same table from the
//! same backends, whatever order they were listed in.
use crate::model::L4Addr;

/// `h1`'s and `h2`'s seeds, xored into the FNV-1a hash before the finalizer.
const SEED_OFFSET: u64 = 0x6c62_2d6d_676c_7631; // "lb-mglv1"
const SEED_SKIP: u64 = 0x6c62_2d6d_676c_7632; // "lb-mglv2"

/// The bytes a backend's permutation is derived from: address, port (big-endian), protocol.
fn identity(b: &L4Addr) -> Vec<u8> {
    let mut out = match b.addr {
        std::net::IpAddr::V4(a) => a.octets().to_vec(),
        std::net::IpAddr::V6(a) => a.octets().to_vec(),
    };
    out.extend_from_slice(&b.port.to_be_bytes());
    out.push(b.proto.number());
    out
}

fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

fn splitmix64(v: u64) -> u64 {
    let mut z = v.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The backends a table is built over: sorted and deduplicated.
pub fn canonical(backends: &[L4Addr]) -> Vec<L4Addr> {
    let mut out = backends.to_vec();
    out.sort();
    out.dedup();
    out
}

/// The table of size `m` for `backends` (which must be `canonical`): for each cell, the index
/// into `backends` of the backend it names. Empty without backends or with an `m` below 2.
pub fn build(backends: &[L4Addr], m: u32) -> Vec<u32> {
    let n = backends.len();
    if n == 0 || m < 2 {
        return Vec::new();
    }
    let m64 = u64::from(m);
    let perm: Vec<(u64, u64)> = backends
        .iter()
        .map(|b| {
            let h = fnv1a64(&identity(b));
            let offset = splitmix64(h ^ SEED_OFFSET) % m64;
            let skip = splitmix64(h ^ SEED_SKIP) % (m64 - 1) + 1;
            (offset, skip)
        })
        .collect();
    let mut next = vec![0u64; n];
    let mut table = vec![u32::MAX; m as usize];
    let mut filled = 0u32;
    'fill: loop {
        for (i, (offset, skip)) in perm.iter().enumerate() {
            // With M prime every skip is coprime to M: the permutation visits every cell, so a
            // free one comes within M steps.
            let mut c = (offset + next[i] * skip) % m64;
            while table[c as usize] != u32::MAX {
                next[i] += 1;
                c = (offset + next[i] * skip) % m64;
            }
            table[c as usize] = i as u32;
            next[i] += 1;
            filled += 1;
            if filled == m {
                break 'fill;
            }
        }
    }
    table
}

#[cfg(test)]
mod tests {
    use std::net::{IpAddr, Ipv4Addr};

    use super::*;
    use crate::model::Proto;

    fn backends(n: u8) -> Vec<L4Addr> {
        (0..n)
            .map(|i| L4Addr {
                addr: IpAddr::V4(Ipv4Addr::new(198, 18, 1, 10 + i)),
                port: 8080,
                proto: Proto::Tcp,
            })
            .collect()
    }

    /// Cells per backend identity.
    fn shares(bs: &[L4Addr], t: &[u32]) -> std::collections::BTreeMap<L4Addr, usize> {
        let mut out = std::collections::BTreeMap::new();
        for i in t {
            *out.entry(bs[*i as usize]).or_insert(0) += 1;
        }
        out
    }

    #[test]
    fn tables_are_balanced() {
        for (n, m) in [(10u8, 16381u32), (3, 251), (7, 1021), (100, 65521)] {
            let bs = canonical(&backends(n));
            let t = build(&bs, m);
            assert_eq!(t.len(), m as usize);
            let s = shares(&bs, &t);
            assert_eq!(s.len(), n as usize, "every backend gets cells");
            let fair = m as usize / n as usize;
            for (b, k) in &s {
                // The rounds fill evenly: at most one cell off the fair share.
                assert!(
                    k.abs_diff(fair) <= 1,
                    "{b}: {k} cells, fair {fair} (n={n}, m={m})"
                );
            }
        }
    }

    const PINNED: &[u32] = &[5, 6, 4, 0, 8, 6, 2, 1, 8, 6, 0, 6];

    #[test]
    fn tables_are_deterministic_and_order_independent() {
        let bs = backends(10);
        let a = build(&canonical(&bs), 16381);
        let mut rev = bs.clone();
        rev.reverse();
        rev.push(bs[3]);
        let b = build(&canonical(&rev), 16381);
        assert_eq!(a, b);
        // Pinned cells: the hashes are part of the contract (every node, every version).
        println!("first cells: {:?}", &a[..12]);
        assert_eq!(&a[..12], PINNED);
        assert!(build(&[], 16381).is_empty());
    }

    #[test]
    fn removing_one_of_n_moves_about_one_nth() {
        for (n, m) in [(10u8, 16381u32), (5, 4093), (20, 65521)] {
            let bs = canonical(&backends(n));
            let before = build(&bs, m);
            let gone = bs[n as usize / 2];
            let rest: Vec<L4Addr> = bs.iter().copied().filter(|b| *b != gone).collect();
            let after = build(&rest, m);
            let mut moved = 0usize;
            let mut moved_others = 0usize;
            for (x, y) in before.iter().zip(&after) {
                let (bx, by) = (bs[*x as usize], rest[*y as usize]);
                if bx != by {
                    moved += 1;
                    if bx != gone {
                        moved_others += 1;
                    }
                }
            }
            let frac = moved as f64 / f64::from(m);
            let bound = 1.0 / f64::from(n) + 0.02;
            println!(
                "n={n} m={m}: {moved} cells moved ({frac:.4}), {moved_others} not of the removed backend"
            );
            assert!(frac <= bound, "moved {frac:.4} > {bound:.4} (n={n}, m={m})");
            assert!(
                frac >= 1.0 / f64::from(n) - 0.01,
                "the removed backend's cells move"
            );
            assert!(
                (moved_others as f64) / f64::from(m) <= 0.02,
                "{moved_others} cells of remaining backends moved"
            );
        }
    }
}
