//! The decision record of traced loads: `lb trace` runs a packet through the real program and
//! reads back what it decided, instead of recomputing selection in userspace.
//!
//! `LB_TRACE` lives in .rodata, which the loader freezes: with the default 0 the verifier
//! knows the branch is dead and prunes it, so a production load pays nothing.
use lb_common::TraceRecord;

use crate::maps::TRACE;

/// Set to non-zero by the loader (`lb_common::globals::TRACE`) to write `lb_trace`.
#[unsafe(no_mangle)]
static LB_TRACE: u8 = 0;

/// Writes the record `fill` sets (on a zeroed one) straight into the map: no copy of it on the
/// stack, which the tc path cannot spare.
#[inline(always)]
pub fn record(fill: impl FnOnce(&mut TraceRecord)) {
    // SAFETY: a plain read of a static; volatile so the compiler keeps the load the loader's
    // value feeds instead of folding in the 0 it was compiled with.
    if unsafe { core::ptr::read_volatile(&LB_TRACE) } == 0 {
        return;
    }
    if let Some(slot) = TRACE.get_ptr_mut(0) {
        // SAFETY: array value pointer, valid for the program's run. Concurrent traced packets
        // may interleave; traced loads run one test packet at a time.
        unsafe {
            *slot = TraceRecord::default();
            fill(&mut *slot);
        }
    }
}

/// Changes the record the decision wrote (no zeroing): details known only after it.
#[inline(always)]
pub fn amend(fill: impl FnOnce(&mut TraceRecord)) {
    // SAFETY: as in `record`.
    if unsafe { core::ptr::read_volatile(&LB_TRACE) } == 0 {
        return;
    }
    if let Some(slot) = TRACE.get_ptr_mut(0) {
        // SAFETY: as in `record`.
        unsafe { fill(&mut *slot) }
    }
}
