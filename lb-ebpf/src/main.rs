//! lb's kernel programs.
//!
//! - `lb_xdp`: north-south balancing on external devices before the stack (NodePort,
//!   LoadBalancer and external IPs from outside the node).
//! - `lb_tc_ingress`, `lb_tc_pod`: per-packet service load balancing on tc ingress: DNAT of new
//!   and established flows to a backend, reverse NAT of backend replies.
//! - `lb_tc_egress`: reverse NAT only, for devices where replies leave towards clients.
//! - `lb_connect4/6`, `lb_sendmsg4/6`, `lb_recvmsg4/6`, `lb_getpeername4/6`: socket-level load
//!   balancing on a cgroup v2 directory; the application sees the VIP, the wire sees the
//!   backend, and no per-packet work is done.
//! - `lb_sk_egress` (`sock_egress`): on the same cgroup, drops datagrams of connected UDP
//!   sockets pinned to a backend that left the frontend, so the application reconnects.
//!
//! Program entry points (`xdp`, `tc`, `sock`) stay thin, and the packet hooks share one
//! pipeline (`packet`); each concern lives in one file they share:
//! `ctx` (what packet code needs from a program context), `parse`, `rewrite` (NAT with
//! incremental checksums, `crc32c` for SCTP's), `conntrack`, `select` (the one backend choice
//! of every hook), `af` (per-family map access), `maps`, `trace` (the decision record of traced
//! loads), `reject` (TCP RST / ICMP port unreachable built in place and sent back).
//!
//! `nat` (masquerade: when, and which port) and `fwd` (forwarding masqueraded packets past
//! the stack's routing) serve the tc hooks beside `conntrack`; `icmp` translates ICMP errors
//! quoting the flows conntrack knows; `frag` gives later fragments their first fragment's ports.
//!
//! Where what comes next goes: session affinity and Maglev in `select`; socket destroy of
//! flows to removed backends as its own program.
#![no_std]
#![no_main]

mod af;
mod conntrack;
mod crc32c;
mod ctx;
mod frag;
mod fwd;
mod icmp;
mod maglev;
mod maps;
mod nat;
mod packet;
mod parse;
mod reject;
mod rewrite;
mod select;
mod sk_store;
mod sock;
mod sock_egress;
mod tc;
mod trace;
mod xdp;

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
