//! The kernel side as userspace sees it: loading lb's eBPF object, pinning and reusing its
//! maps, attaching its programs (`load`), and typed access to the service, backend and rev-NAT
//! maps (`maps`).
pub mod load;
pub mod maps;
