//! The XDP entry point on external devices: north-south balancing before the stack, the same
//! pipeline as tc ingress (`packet`). A packet XDP cannot finish (its next hop unresolved) is
//! passed untouched to `lb_tc_ingress`, which the loader attaches beside it.
use aya_ebpf::{macros::xdp, programs::XdpContext};

use crate::packet::{self, Hook};

#[xdp]
pub fn lb_xdp(ctx: XdpContext) -> u32 {
    packet::run(&ctx, Hook::External) as u32
}
