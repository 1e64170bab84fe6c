//! Where objects come from, and what changed: a watched manifest directory (`manifests`) or the
//! Kubernetes API (`k8s`: reflectors with kube-proxy's label selectors) publish `source`'s
//! `Snapshot`s of Services, EndpointSlices and this node's Node, each converted to `slim`'s
//! compact copy as soon as it is decoded; `changes` diffs each snapshot
//! against the one before, once per update, for every consumer that follows changes (the
//! incremental translator, kube-proxy's counters, re-steering).
pub mod changes;
pub mod k8s;
pub mod manifests;
pub mod slim;
pub mod source;

/// Label naming the service an EndpointSlice belongs to.
pub const LABEL_SERVICE_NAME: &str = "kubernetes.io/service-name";
/// Services with this label belong to another proxy (kube-proxy skips them too).
pub const LABEL_SERVICE_PROXY_NAME: &str = "service.kubernetes.io/service-proxy-name";
/// EndpointSlices of headless services carry this label; proxies ignore them.
pub const LABEL_HEADLESS: &str = "service.kubernetes.io/headless";
/// The node label topology hints refer to.
pub const LABEL_ZONE: &str = "topology.kubernetes.io/zone";
