//! lb's test tooling, shared by the integration tests (`tests/*.rs`) and the tool binaries
//! (`lb-echo`, `lb-demo`, `lb-bench` in `src/bin/`); none of it ships in `lb`.
//!
//! * [`testbed`]: a throw-away network-namespace topology (node, client, backends, cgroup);
//! * [`daemon`]: [`daemon::LbDaemon`], `lb run` in a testbed's node netns;
//! * [`metrics`]: lb's `/metrics` and `/healthz` read from inside the node netns;
//! * [`netns`]: the `ip` runner and entering a netns from a child or a thread;
//! * [`bins`]: where the workspace's binaries (and the tools setup builds) are;
//! * [`controlplane`]: a real etcd + kube-apiserver + EndpointSlice controller;
//! * [`relay`]: a TCP relay from a netns's loopback to the caller's netns (lb → API server).
pub mod bins;
pub mod controlplane;
pub mod daemon;
pub mod metrics;
pub mod netns;
pub mod relay;
pub mod testbed;
