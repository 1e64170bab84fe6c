//! The kernel side as userspace sees it: loading lb's eBPF object, pinning and reusing its
//! maps, attaching its programs (`load`), and typed access to the service, backend and rev-NAT
//! maps (`maps`), written once over both families (`family`), and their write error
//! (`error`); the pins' layout version (`meta`); opening what a running lb pinned (`pinned`);
//! finding cgroup v2 (`cgroup`); probing what the kernel offers and which fallbacks lb takes
//! (`features`); the links of lb's netns and their changes, over rtnetlink (`linkwatch`);
//! destroying connected UDP sockets pinned to removed backends (`sockterm`); the maps' test
//! doubles (`testing`, feature `testing` only).
pub mod batch;
pub mod cgroup;
pub mod conntrack;
pub mod error;
mod family;
pub mod features;
mod held;
pub mod links;
pub mod linkwatch;
pub mod load;
pub mod maps;
pub mod meta;
pub mod pinned;
pub mod sockterm;
#[cfg(feature = "testing")]
pub mod testing;
