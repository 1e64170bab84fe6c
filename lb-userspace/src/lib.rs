//! lb: an eBPF service load balancer that replaces kube-proxy.
//!
//! Sources (manifest files, later the Kubernetes API) are translated by a pure function
//! (`translate`) into a `model::DesiredState`; the `reconcile::Reconciler` makes the pinned BPF
//! maps (`maps`, `bpf`) hold it; the kernel programs in lb-ebpf do the balancing.
pub mod bpf;
pub mod daemon;
pub mod inspect;
pub mod k8s;
pub mod manifests;
pub mod maps;
pub mod metrics;
pub mod model;
pub mod reconcile;
pub mod source;
pub mod trace;
pub mod translate;
