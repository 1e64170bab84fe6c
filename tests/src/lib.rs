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

/// Objects written as the API server sends them (JSON), made slim as lb's sources make them:
/// decoded as their Kubernetes type, then kept as `lb::kube::slim`'s copy.
pub trait FromJson: Sized {
    /// Panics on JSON the Kubernetes type refuses (a test's own object).
    fn from_json(v: serde_json::Value) -> Self;
}

macro_rules! from_json {
    ($($slim:ty: $k8s:ty),*) => {$(
        impl FromJson for $slim {
            fn from_json(v: serde_json::Value) -> Self {
                let o: $k8s = serde_json::from_value(v).expect("test object parses");
                Self::from(&o)
            }
        }
    )*};
}

from_json!(
    lb::kube::slim::Service: k8s_openapi::api::core::v1::Service,
    lb::kube::slim::EndpointSlice: k8s_openapi::api::discovery::v1::EndpointSlice,
    lb::kube::slim::Node: k8s_openapi::api::core::v1::Node
);
