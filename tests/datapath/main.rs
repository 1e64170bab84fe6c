//! Packet-in/packet-out tests of the tc programs with BPF_PROG_TEST_RUN: the real programs, the
//! real maps (private, unpinned), programmed by the real reconciler. Needs root.
//!
//! One test binary (the kernel matrix of `cargo xtask test --kernel` runs it as `datapath`), a
//! module per scenario; `common` holds the fixture, the packet builders and their independent
//! checks that every scenario shares.

mod affinity;
mod common;
mod conntrack;
mod forward;
mod fragments;
mod icmp;
mod loading;
mod masquerade;
mod policy;
mod reject;
mod sctp;
mod trace;
mod xdp;
