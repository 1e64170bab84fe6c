//! lb: an eBPF service load balancer that replaces kube-proxy.
//!
//! One folder per stage, read bottom-up; imports run only down (tests/layout.rs fails on a
//! circle between modules or between folders, and on a function over 80 lines without a
//! `// Long:` reason):
//!
//! - ground: `model` (frontends, backends, the desired state), `config` (option types the
//!   cli and the daemon share), `node` (this node's facts: IPs, cluster and service CIDRs),
//!   `state_dir` (names the daemon leaves for the read-only commands), `privileges`;
//! - `kube/`: where objects come from (a manifest directory or the Kubernetes API), made
//!   slim right after decoding (`kube::slim`: only what lb reads, interned names, parsed
//!   addresses), as snapshots, and `kube::changes`, the one diff of a snapshot against the one
//!   before;
//! - `translate/`: the pure function from a snapshot to a `model::DesiredState` (kube-proxy's
//!   rules, on the one EndpointSlice index, `slices`), kept up to date per service
//!   (`incremental`), and Maglev tables (`maglev`);
//! - `datapath/`: lb's eBPF object loaded and attached, its pinned maps typed (`maps`), the
//!   conntrack maps sized and collected (`conntrack`), sockets destroyed (`sockterm`), kernel
//!   features probed;
//! - `reconcile/`: the ordered diff that makes the maps hold a desired state (one frontend
//!   in `service`, Maglev tables, the per-address ClusterIP and echo entries, garbage, the
//!   incremental `apply_update`), and re-steering of connected UDP sockets after a sync
//!   (`resteer`);
//! - `metrics/`: what lb serves over HTTP: Prometheus metrics (kube-proxy's among them),
//!   health, and the health check node ports of `externalTrafficPolicy: Local` services
//!   (`metrics::healthcheck`, as kube-proxy's `pkg/proxy/healthcheck` serves both);
//! - `daemon` (`lb run`) wires the stages together; `cli` (the `lb` command: `run`, `trace`,
//!   `services`, `status`, …) is on top.
pub mod cli;
pub mod config;
pub mod daemon;
pub mod datapath;
pub mod kube;
pub mod metrics;
pub mod model;
pub mod node;
pub mod privileges;
pub mod reconcile;
pub mod state_dir;
pub mod translate;
