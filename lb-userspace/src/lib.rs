//! lb: an eBPF service load balancer that replaces kube-proxy.
//!
//! The flow: a source (`controller::source`: manifest files, or the Kubernetes API) publishes
//! objects; `controller::translate`, a pure function, turns them into a `model::DesiredState`;
//! `controller::reconcile` makes the pinned BPF maps (`datapath::maps`, loaded by
//! `datapath::load`) hold it; the kernel programs in lb-ebpf do the balancing. `daemon`
//! (`lb run`) wires these together from above. `cli` reads the live maps back (`lb services`,
//! `lb status`, `lb trace`), with service names from the daemon's `state_dir`; `metrics`
//! serves Prometheus and health; `healthcheck` runs the health check node ports of
//! `externalTrafficPolicy: Local` services; `privileges` checks at start that `lb run` has the
//! capabilities it needs; `conntrack` sizes the conntrack maps, sets their lifetimes and
//! garbage-collects them. `config` holds the option types several of them share, and imports
//! nothing of lb but `model`.
//!
//! Imports run one way, with no circles (tests/layout.rs checks): an option or type two
//! modules share lives below both.
pub mod cli;
pub mod config;
pub mod conntrack;
pub mod controller;
pub mod daemon;
pub mod datapath;
pub mod healthcheck;
pub mod metrics;
pub mod model;
pub mod node_facts;
pub mod privileges;
pub mod state_dir;
