//! The control plane: where objects come from (a watched manifest directory or the Kubernetes
//! API), how they become a desired state, and how the maps are made to hold it.
//!
//! `source`/`manifests`/`k8s` produce snapshots of Services, EndpointSlices and this node's
//! Node; `changes` diffs each snapshot against the one before, once per update, for all that
//! follows changes; `translate` turns a snapshot into a `model::DesiredState` (pure, kube-proxy's rules);
//! `incremental` keeps a translation up to date by recomputing only the services a snapshot
//! changed (the same result as `translate`); `maglev` builds Maglev lookup tables (pure);
//! `reconcile` writes the difference into the maps in an order no packet can see half-done;
//! `resteer` destroys connected UDP sockets pinned to backends a sync removed. The daemon
//! (`crate::daemon`, `lb run`) wires them together from above.
pub mod changes;
pub mod incremental;
pub mod k8s;
pub mod maglev;
pub mod manifests;
pub mod reconcile;
pub mod resteer;
pub mod source;
pub mod translate;
