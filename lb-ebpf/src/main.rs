//! lb's kernel programs.
//!
//! - `lb_tc_ingress`: per-packet service load balancing on tc ingress: DNAT of new and
//!   established flows to a backend, reverse NAT of backend replies.
//! - `lb_tc_egress`: reverse NAT only, for devices where replies leave towards clients.
//! - `lb_connect4/6`, `lb_sendmsg4/6`, `lb_recvmsg4/6`, `lb_getpeername4/6`: socket-level load
//!   balancing on a cgroup v2 directory; the application sees the VIP, the wire sees the
//!   backend, and no per-packet work is done.
#![no_std]
#![no_main]

mod af;
mod maps;
mod sock;
mod tc;

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
