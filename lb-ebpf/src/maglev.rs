//! Maglev lookup (`lb_alg::MAGLEV`): a frontend's table of M cells in `lb_maglev`, written by
//! userspace, turns a flow's hash into a backend id; the table's index is in the master entry.
use crate::maps::MAGLEV;

/// M, set by the loader (`lb_common::globals::MAGLEV_TABLE_SIZE`). In .rodata, frozen: the
/// verifier sees the loader's value. 0 (nothing set) serves no Maglev frontend.
#[unsafe(no_mangle)]
static LB_MAGLEV_M: u32 = 0;

/// The cell `hash` takes in a table and the backend id table `table` holds there (0: empty,
/// or no such table).
#[inline(always)]
pub fn lookup(table: u32, hash: u32) -> (u32, u32) {
    // SAFETY: a plain read of a static; volatile so the loader's value is what is read.
    let m = unsafe { core::ptr::read_volatile(&LB_MAGLEV_M) };
    if m == 0 {
        return (0, 0);
    }
    let cell = hash % m;
    // In u64: a table index read from a map may be anything, and must not wrap into another
    // table's cells.
    let index = u64::from(table) * u64::from(m) + u64::from(cell);
    if index > u64::from(u32::MAX) {
        return (cell, 0);
    }
    let id = MAGLEV.get(index as u32).copied().unwrap_or(0);
    (cell, id)
}
