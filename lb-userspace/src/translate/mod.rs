//! The pure function from Kubernetes objects (+ this node's facts) to the desired datapath
//! state, porting kube-proxy's decisions:
//!
//! - which Services are proxied (`ShouldSkipService`, the `service-proxy-name` label, headless
//!   EndpointSlices);
//! - per service port and IP family, the endpoints from all of the service's slices, matched on
//!   the slice port's name and protocol, first address only, deduplicated on `ip:port` with a
//!   local copy preferred (`EndpointSliceCache`), then one that is not terminating: the one
//!   index ([`index_slices`]) the health check node ports count local endpoints from too;
//! - `CategorizeEndpoints` (pkg/proxy/topology.go): Ready endpoints, else serving-and-terminating
//!   ones, separately for Cluster and Local policy; topology hints (`forNodes`, then
//!   `forZones`) when every ready endpoint has one and one matches this node;
//! - ClusterIPs use the internal traffic policy's set; externalIPs and LoadBalancer ingress IPs
//!   the external policy's, and with `externalTrafficPolicy: Local` in-cluster traffic to them
//!   still reaches cluster-wide endpoints (a second, internal scope), as kube-proxy's
//!   short-circuit for pod and host traffic does.
//!
//! Bad objects are skipped, each with one reason, and never stop the rest from applying.
pub mod incremental;
pub mod maglev;

use std::{
    borrow::Borrow,
    cmp::Ordering,
    collections::{BTreeMap, BTreeSet},
    fmt,
    net::IpAddr,
};

use crate::kube::{LABEL_HEADLESS, LABEL_SERVICE_NAME, LABEL_SERVICE_PROXY_NAME, LABEL_ZONE};
use k8s_openapi::api::{
    core::v1::{Node, Service},
    discovery::v1::EndpointSlice,
};
use lb_common::svc_flags;

use crate::model::{
    Backend, BackendState, Cidr, DesiredState, Family, Frontend, L4Addr, LbAlgorithm, Proto, Scope,
    ServiceEntry, ServicePortName,
};

/// Annotation choosing a Service's load-balancing algorithm (`random` or `maglev`), overriding
/// the node default (`--lb-algorithm`).
pub const ANNOTATION_LB_ALGORITHM: &str = "lb.io/lb-algorithm";

/// What the translation needs to know about the node it runs on.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeInfo {
    /// The node name endpoints' `nodeName` is compared with (kube-proxy's hostname).
    pub name: String,
    /// `topology.kubernetes.io/zone` of this node.
    pub zone: Option<String>,
    /// The addresses NodePorts answer on (`--nodeport-addresses`, resolved).
    pub nodeport_ips: Vec<IpAddr>,
    /// This node's own addresses: an external or LoadBalancer IP among them is a local
    /// frontend (`svc_flags::LOCAL_ADDR`), like a NodePort.
    pub local_ips: Vec<IpAddr>,
    /// The algorithm of Services without the `lb.io/lb-algorithm` annotation
    /// (`--lb-algorithm`).
    pub lb_algorithm: LbAlgorithm,
}

impl NodeInfo {
    /// Facts from the Node object, falling back to `name` when there is none.
    pub fn from_node(name: &str, node: Option<&Node>) -> Self {
        let zone = node
            .and_then(|n| n.metadata.labels.as_ref())
            .and_then(|l| l.get(LABEL_ZONE))
            .cloned();
        Self {
            name: name.to_string(),
            zone,
            ..Self::default()
        }
    }
}

/// The taint the cluster autoscaler puts on a node it is about to delete.
pub const TAINT_TO_BE_DELETED: &str = "ToBeDeletedByClusterAutoscaler";

/// Whether load balancers should still send traffic to this node (kube-proxy's `SyncNode`):
/// not while its Node is being deleted or carries [`TAINT_TO_BE_DELETED`]. Without a Node
/// object the node counts as eligible, as kube-proxy's starts out.
pub fn node_eligible(node: Option<&Node>) -> bool {
    let Some(node) = node else { return true };
    node.metadata.deletion_timestamp.is_none()
        && !node
            .spec
            .as_ref()
            .and_then(|s| s.taints.as_ref())
            .is_some_and(|t| t.iter().any(|t| t.key == TAINT_TO_BE_DELETED))
}

/// Why an object, or a part of one, was not applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SkipReason {
    MissingName,
    InvalidIp,
    InvalidPort,
    UnknownProtocol,
    AddressFamilyMismatch,
    UnknownAddressType,
    MissingServiceLabel,
    /// Another service already has this frontend: the older one (`creationTimestamp`, then
    /// namespace/name order) keeps it.
    DuplicateFrontend,
    /// A Service (not headless) without any port: nothing to program.
    NoPorts,
    /// A second Service port with the same name and protocol (kube-proxy's `ServicePortName`);
    /// the first one is used.
    DuplicatePortName,
    /// An EndpointSlice with more endpoints than the API server allows in one
    /// ([`MAX_SLICE_ENDPOINTS`]).
    TooManyEndpoints,
    /// A Service port whose name none of its EndpointSlices' ports carries, though they list
    /// ports: it is programmed without endpoints (typically the slices were written with the
    /// `targetPort`'s name instead of the service port's).
    UnmatchedPort,
    /// `sessionAffinityConfig.clientIP.timeoutSeconds` outside what the API server allows
    /// (1..=86400): kube-proxy's default timeout is used instead.
    InvalidSessionAffinity,
    /// An annotation lb reads has a value it does not know; the node default is used instead
    /// (the Service is programmed).
    InvalidAnnotation,
}

/// kube-proxy's default `sessionAffinityConfig.clientIP.timeoutSeconds` (3 hours).
pub const DEFAULT_AFFINITY_TIMEOUT: u32 = 10_800;
/// The largest timeout the API server accepts (1 day).
pub const MAX_AFFINITY_TIMEOUT: u32 = 86_400;

/// The API server's cap on endpoints per EndpointSlice (`maxEndpoints` in its validation).
/// A bigger slice cannot come from a cluster; from a manifest it is refused as a whole.
pub const MAX_SLICE_ENDPOINTS: usize = 1000;

impl SkipReason {
    /// The label value used in the `skipped objects` metric.
    pub fn as_str(self) -> &'static str {
        match self {
            SkipReason::MissingName => "missing_name",
            SkipReason::InvalidIp => "invalid_ip",
            SkipReason::InvalidPort => "invalid_port",
            SkipReason::UnknownProtocol => "unknown_protocol",
            SkipReason::AddressFamilyMismatch => "address_family_mismatch",
            SkipReason::UnknownAddressType => "unknown_address_type",
            SkipReason::MissingServiceLabel => "missing_service_label",
            SkipReason::DuplicateFrontend => "duplicate_frontend",
            SkipReason::InvalidSessionAffinity => "invalid_session_affinity",
            SkipReason::NoPorts => "no_ports",
            SkipReason::DuplicatePortName => "duplicate_port_name",
            SkipReason::TooManyEndpoints => "too_many_endpoints",
            SkipReason::UnmatchedPort => "unmatched_port",
            SkipReason::InvalidAnnotation => "invalid_annotation",
        }
    }
}

/// One skipped object or part of one.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Skipped {
    /// `Service` or `EndpointSlice`.
    pub kind: &'static str,
    /// `namespace/name`.
    pub object: String,
    pub reason: SkipReason,
    pub detail: String,
}

impl fmt::Display for Skipped {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {}: {} ({})",
            self.kind,
            self.object,
            self.detail,
            self.reason.as_str()
        )
    }
}

/// Objects that are intentionally not lb's (not errors).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ignored {
    Headless,
    ExternalName,
    OtherProxy,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Translation {
    pub state: DesiredState,
    pub skipped: Vec<Skipped>,
    /// Service ports with a Local traffic policy and endpoints, none of them on this node, per
    /// IP family (0: IPv4): kube-proxy's `sync_proxy_rules_no_local_endpoints_total`.
    pub no_local_endpoints: NoLocalEndpoints,
}

/// Service ports (per IP family, index 0 = IPv4) whose traffic of one policy is dropped on
/// this node: the policy is Local, the service has endpoints, and none is on this node.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NoLocalEndpoints {
    /// `internalTrafficPolicy: Local`.
    pub internal: [usize; 2],
    /// `externalTrafficPolicy: Local` of an externally reachable service.
    pub external: [usize; 2],
}

pub(crate) fn object_name(
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
) -> String {
    format!(
        "{}/{}",
        meta.namespace.as_deref().unwrap_or("default"),
        meta.name.as_deref().unwrap_or("")
    )
}

fn has_label(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta, key: &str) -> bool {
    meta.labels.as_ref().is_some_and(|l| l.contains_key(key))
}

/// Whether lb leaves this service alone, and why.
pub fn ignored(svc: &Service) -> Option<Ignored> {
    if has_label(&svc.metadata, LABEL_SERVICE_PROXY_NAME) {
        return Some(Ignored::OtherProxy);
    }
    let Some(spec) = svc.spec.as_ref() else {
        return Some(Ignored::Headless);
    };
    if spec.type_.as_deref() == Some("ExternalName") {
        return Some(Ignored::ExternalName);
    }
    match spec.cluster_ip.as_deref() {
        None | Some("") | Some("None") => Some(Ignored::Headless),
        _ => None,
    }
}

/// One endpoint of a service port, as kube-proxy's `BaseEndpointInfo` sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Endpoint {
    pub(crate) l4: L4Addr,
    /// `ready` true or unset.
    pub(crate) ready: bool,
    serving: bool,
    terminating: bool,
    /// On this node (`nodeName` is the node's name).
    pub(crate) local: bool,
    zone_hints: BTreeSet<String>,
    node_hints: BTreeSet<String>,
}

impl Endpoint {
    /// Whether this copy of an endpoint replaces `old`, a copy of the same `ip:port` from an
    /// earlier slice (a pod listed twice, as during a slice rebalance): a local copy beats one
    /// of another node (kube-proxy's `EndpointSliceCache`), then a copy that is not terminating
    /// beats a terminating one; between equal copies a later local one replaces the earlier and
    /// a later remote one does not (kube-proxy's rule again). Translation and health checks
    /// both see the copy this keeps.
    fn replaces(&self, old: &Endpoint) -> bool {
        let rank = |e: &Endpoint| (e.local, !e.terminating);
        match rank(self).cmp(&rank(old)) {
            Ordering::Greater => true,
            Ordering::Less => false,
            Ordering::Equal => self.local,
        }
    }
}

/// Endpoints per (namespace, service) → family ([`Family::index`]) → (port name, protocol) →
/// `ip:port`.
pub(crate) type SliceIndex =
    BTreeMap<(String, String), [BTreeMap<(String, Proto), BTreeMap<L4Addr, Endpoint>>; 2]>;

/// The one EndpointSlice index: which service each slice belongs to (its
/// `kubernetes.io/service-name` label; headless and FQDN slices are left out), the endpoints of
/// each of its usable ports (named, numbered, a known protocol) whose first address is of the
/// slice's family, and which copy of an endpoint listed twice is kept ([`Endpoint::replaces`]).
/// Translation programs it; the health check node ports count its local ready endpoints.
/// What it refuses is reported in `skipped`.
pub(crate) fn index_slices<E: Borrow<EndpointSlice>>(
    slices: &[E],
    node: &NodeInfo,
    skipped: &mut Vec<Skipped>,
) -> SliceIndex {
    let mut out = SliceIndex::new();
    let mut slices: Vec<&EndpointSlice> = slices.iter().map(Borrow::borrow).collect();
    // Deterministic precedence among duplicates: slice name order.
    slices.sort_by_key(|s| object_name(&s.metadata));
    for slice in slices {
        if has_label(&slice.metadata, LABEL_HEADLESS) {
            continue;
        }
        let object = object_name(&slice.metadata);
        let skip = |reason, detail: String| Skipped {
            kind: "EndpointSlice",
            object: object.clone(),
            reason,
            detail,
        };
        let Some(service) = slice
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(LABEL_SERVICE_NAME))
            .filter(|s| !s.is_empty())
        else {
            skipped.push(skip(
                SkipReason::MissingServiceLabel,
                format!("no {LABEL_SERVICE_NAME} label"),
            ));
            continue;
        };
        let family = match slice.address_type.as_str() {
            "IPv4" => Family::V4,
            "IPv6" => Family::V6,
            // FQDN slices are for DNS, not proxies.
            "FQDN" => continue,
            other => {
                skipped.push(skip(
                    SkipReason::UnknownAddressType,
                    format!("addressType {other:?}"),
                ));
                continue;
            }
        };
        let endpoints = slice.endpoints.as_deref().unwrap_or_default();
        if endpoints.len() > MAX_SLICE_ENDPOINTS {
            skipped.push(skip(
                SkipReason::TooManyEndpoints,
                format!(
                    "{} endpoints, more than the {MAX_SLICE_ENDPOINTS} the API server allows in one slice",
                    endpoints.len()
                ),
            ));
            continue;
        }
        let mut ports = Vec::new();
        for p in slice.ports.iter().flatten() {
            // kube-proxy ignores ports without a name (the controller writes "" for unnamed
            // service ports) and without a number.
            let Some(name) = p.name.clone() else {
                skipped.push(skip(
                    SkipReason::InvalidPort,
                    "a port without a name (use \"\" for unnamed service ports)".into(),
                ));
                continue;
            };
            let proto_name = p.protocol.as_deref().unwrap_or("TCP");
            let Some(proto) = Proto::from_k8s(proto_name) else {
                skipped.push(skip(
                    SkipReason::UnknownProtocol,
                    format!("port {name:?} protocol {proto_name:?}"),
                ));
                continue;
            };
            match p.port {
                Some(n) if (1..=65535).contains(&n) => ports.push((name, proto, n as u16)),
                Some(n) => skipped.push(skip(
                    SkipReason::InvalidPort,
                    format!("port {name:?} number {n}"),
                )),
                None => skipped.push(skip(
                    SkipReason::InvalidPort,
                    format!("port {name:?} without a number"),
                )),
            }
        }
        let namespace = slice
            .metadata
            .namespace
            .clone()
            .unwrap_or_else(|| "default".into());
        let by_port = &mut out.entry((namespace, service.clone())).or_default()[family.index()];
        for ep in endpoints {
            let Some(first) = ep.addresses.first() else {
                continue;
            };
            let addr: IpAddr = match parse_ip(first) {
                Ok(a) => a,
                Err(why) => {
                    skipped.push(skip(
                        SkipReason::InvalidIp,
                        format!("endpoint address {first:?}: {why}"),
                    ));
                    continue;
                }
            };
            if Family::of(&addr) != family {
                skipped.push(skip(
                    SkipReason::AddressFamilyMismatch,
                    format!("endpoint address {addr} in an {} slice", slice.address_type),
                ));
                continue;
            }
            let cond = ep.conditions.as_ref();
            let ready = cond.and_then(|c| c.ready).unwrap_or(true);
            let serving = cond.and_then(|c| c.serving).unwrap_or(true);
            let terminating = cond.and_then(|c| c.terminating).unwrap_or(false);
            let local =
                !node.name.is_empty() && ep.node_name.as_deref() == Some(node.name.as_str());
            let hints = ep.hints.as_ref();
            let zone_hints: BTreeSet<String> = hints
                .and_then(|h| h.for_zones.as_ref())
                .map(|z| z.iter().map(|z| z.name.clone()).collect())
                .unwrap_or_default();
            let node_hints: BTreeSet<String> = hints
                .and_then(|h| h.for_nodes.as_ref())
                .map(|n| n.iter().map(|n| n.name.clone()).collect())
                .unwrap_or_default();
            for (name, proto, port) in &ports {
                let l4 = L4Addr {
                    addr,
                    port: *port,
                    proto: *proto,
                };
                let entry = Endpoint {
                    l4,
                    ready,
                    serving,
                    terminating,
                    local,
                    zone_hints: zone_hints.clone(),
                    node_hints: node_hints.clone(),
                };
                let set = by_port.entry((name.clone(), *proto)).or_default();
                if set.get(&l4).is_none_or(|old| entry.replaces(old)) {
                    set.insert(l4, entry);
                }
            }
        }
    }
    out
}

/// Parses an address as Go's `netip.ParseAddr` (kube-proxy's parser) does: a leading zero in an
/// IPv4 octet (`010.1.1.1`, octal to some parsers), an IPv6 zone (`fe80::1%eth0`), a CIDR and
/// surrounding spaces are refused. IPv4-mapped IPv6 addresses (`::ffff:198.18.0.1`) are refused
/// too: their family is ambiguous, and lb never programs one address under two families.
fn parse_ip(s: &str) -> Result<IpAddr, &'static str> {
    let Ok(ip) = s.parse::<IpAddr>() else {
        let octets: Vec<&str> = s.split('.').collect();
        let leading_zero = octets.len() == 4
            && octets
                .iter()
                .all(|o| !o.is_empty() && o.bytes().all(|b| b.is_ascii_digit()))
            && octets.iter().any(|o| o.len() > 1 && o.starts_with('0'));
        return Err(if s.contains('%') {
            "an IPv6 zone is not allowed"
        } else if s.contains('/') {
            "a CIDR, not an address"
        } else if leading_zero {
            "an IPv4 octet with a leading zero"
        } else {
            "not an IP address"
        });
    };
    if let IpAddr::V6(v6) = ip
        && v6.to_ipv4_mapped().is_some()
    {
        return Err("an IPv4-mapped IPv6 address");
    }
    Ok(ip)
}

/// The port names each service's EndpointSlices list, for `unmatched_port`.
pub(crate) type SlicePortNames = BTreeMap<(String, String), BTreeSet<String>>;

pub(crate) fn slice_port_names<E: Borrow<EndpointSlice>>(slices: &[E]) -> SlicePortNames {
    let mut out = SlicePortNames::new();
    for slice in slices.iter().map(Borrow::borrow) {
        let Some(service) = slice
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(LABEL_SERVICE_NAME))
        else {
            continue;
        };
        if has_label(&slice.metadata, LABEL_HEADLESS) || slice.address_type == "FQDN" {
            continue;
        }
        let namespace = slice
            .metadata
            .namespace
            .clone()
            .unwrap_or_else(|| "default".into());
        let names = out.entry((namespace, service.clone())).or_default();
        // Names of ports `index_slices` refused count too: those are reported there already.
        names.extend(slice.ports.iter().flatten().filter_map(|p| p.name.clone()));
    }
    out
}

/// The traffic policies of one service port, as kube-proxy's `ServicePort` sees them.
#[derive(Clone, Copy, Debug)]
struct Policies {
    internal_local: bool,
    external_local: bool,
    externally_accessible: bool,
}

impl Policies {
    /// `UsesClusterEndpoints`: some traffic uses the Cluster policy.
    fn uses_cluster(self) -> bool {
        !self.internal_local || (self.externally_accessible && !self.external_local)
    }

    /// `UsesLocalEndpoints`: some traffic uses the Local policy.
    fn uses_local(self) -> bool {
        self.internal_local || (self.externally_accessible && self.external_local)
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Topology {
    None,
    SameZone,
    SameNode,
}

/// kube-proxy's `topologyModeFromHints`.
fn topology_mode(endpoints: &[&Endpoint], node: &NodeInfo) -> Topology {
    let ready: Vec<&&Endpoint> = endpoints.iter().filter(|e| e.ready).collect();
    if ready.is_empty() {
        return Topology::None;
    }
    if ready.iter().all(|e| !e.node_hints.is_empty())
        && ready.iter().any(|e| e.node_hints.contains(&node.name))
    {
        return Topology::SameNode;
    }
    if let Some(zone) = &node.zone
        && ready.iter().all(|e| !e.zone_hints.is_empty())
        && ready.iter().any(|e| e.zone_hints.contains(zone))
    {
        return Topology::SameZone;
    }
    Topology::None
}

fn available_for_topology(e: &Endpoint, mode: Topology, node: &NodeInfo) -> bool {
    match mode {
        Topology::None => true,
        Topology::SameNode => e.node_hints.contains(&node.name),
        Topology::SameZone => node.zone.as_ref().is_some_and(|z| e.zone_hints.contains(z)),
    }
}

/// kube-proxy's `CategorizeEndpoints`: (cluster endpoints, local endpoints), each with the
/// endpoints new flows may use first (`Active`), then those new flows do not use but whose
/// established flows kube-proxy's conntrack keeps: terminating endpoints (`Terminating`,
/// graceful termination, KEP-1669) and not-ready ones (`Quarantined`, a readiness flap must not
/// cut connections), until they leave the EndpointSlice. For UDP only serving ones are kept, as
/// kube-proxy's conntrack cleanup deletes UDP flows of endpoints that stopped serving.
/// Serving terminating endpoints take new flows only when no ready one is left.
fn categorize(
    endpoints: &[&Endpoint],
    proto: Proto,
    policies: Policies,
    node: &NodeInfo,
) -> (Vec<Backend>, Vec<Backend>) {
    let pick = |f: &dyn Fn(&Endpoint) -> bool| -> Vec<L4Addr> {
        endpoints.iter().filter(|e| f(e)).map(|e| e.l4).collect()
    };
    // The chosen endpoints, then the unready or terminating ones among `candidates` not chosen
    // (ready ones that topology or the policy left out keep nothing).
    let with_draining = |chosen: Vec<L4Addr>, candidates: &dyn Fn(&Endpoint) -> bool| {
        let draining = endpoints
            .iter()
            .filter(|e| {
                (e.terminating || !e.ready)
                    && (proto != Proto::Udp || e.serving)
                    && candidates(e)
                    && !chosen.contains(&e.l4)
            })
            .map(|e| Backend {
                l4: e.l4,
                state: if e.terminating {
                    BackendState::Terminating
                } else {
                    BackendState::Quarantined
                },
            })
            .collect::<Vec<_>>();
        let mut out = backends(&chosen);
        out.extend(draining);
        out
    };
    let mut cluster = Vec::new();
    if policies.uses_cluster() {
        let mode = topology_mode(endpoints, node);
        let mut chosen = pick(&|e| e.ready && available_for_topology(e, mode, node));
        if chosen.is_empty() {
            chosen = pick(&|e| e.serving && e.terminating);
        }
        cluster = with_draining(chosen, &|_| true);
    }
    let mut local = Vec::new();
    if policies.uses_local() {
        let mut chosen = pick(&|e| e.local && e.ready);
        if chosen.is_empty() {
            chosen = pick(&|e| e.local && e.serving && e.terminating);
        }
        local = with_draining(chosen, &|e| e.local);
    }
    (cluster, local)
}

/// Whether any of `backends` takes new flows.
fn any_active(backends: &[Backend]) -> bool {
    backends.iter().any(|b| b.state == BackendState::Active)
}

/// Adds a frontend unless an earlier service (namespace/name order) already has it.
fn insert(state: &mut DesiredState, skipped: &mut Vec<Skipped>, fe: Frontend, entry: ServiceEntry) {
    if let Some(first) = state.services.get(&fe) {
        skipped.push(Skipped {
            kind: "Service",
            object: format!("{}/{}", entry.name.namespace, entry.name.name),
            reason: SkipReason::DuplicateFrontend,
            detail: format!("frontend {fe} already belongs to {}", first.name),
        });
        return;
    }
    state.services.insert(fe, entry);
}

fn backends(l4s: &[L4Addr]) -> Vec<Backend> {
    l4s.iter().copied().map(Backend::active).collect()
}

/// Translates Services and EndpointSlices into the datapath state lb should program on
/// `node`.
///
/// Takes owned or shared objects (`Service`, `Arc<Service>`, ...).
pub fn desired_state<S: Borrow<Service>, E: Borrow<EndpointSlice>>(
    services: &[S],
    slices: &[E],
    node: &NodeInfo,
) -> Translation {
    let mut skipped = Vec::new();
    let mut no_local = NoLocalEndpoints::default();
    let index = index_slices(slices, node, &mut skipped);
    let slice_ports = slice_port_names(slices);
    let mut state = DesiredState::default();

    // The older service keeps a contested frontend: creation time first (none, as in most
    // manifests, sorts first, like Go's zero time), then namespace/name.
    let mut services: Vec<&Service> = services.iter().map(Borrow::borrow).collect();
    services.sort_by_cached_key(|s| service_order(s));
    for svc in services {
        let out = translate_service(svc, &index, &slice_ports, node);
        no_local.add(&out.no_local);
        let mut skips = out.skipped.into_iter();
        let mut emitted = 0;
        for (fe, entry, before) in out.frontends {
            skipped.extend(skips.by_ref().take(before - emitted));
            emitted = before;
            insert(&mut state, &mut skipped, fe, entry);
        }
        skipped.extend(skips);
    }
    Translation {
        state,
        skipped,
        no_local_endpoints: no_local,
    }
}

/// The order in which services claim frontends: creation time, then namespace/name.
pub(crate) type ServiceOrder = (
    Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>,
    String,
);

pub(crate) fn service_order(s: &Service) -> ServiceOrder {
    (
        s.metadata.creation_timestamp.clone(),
        object_name(&s.metadata),
    )
}

/// What one Service translates to, before frontends are shared out among services.
#[derive(Debug, Default)]
pub(crate) struct ServiceOut {
    /// Its skipped objects or parts, in order.
    pub skipped: Vec<Skipped>,
    /// Its frontends in the order they were claimed, each with the number of `skipped` entries
    /// reported before it (a lost claim is reported in that place).
    pub frontends: Vec<(Frontend, ServiceEntry, usize)>,
    pub no_local: NoLocalEndpoints,
}

impl NoLocalEndpoints {
    pub(crate) fn add(&mut self, o: &NoLocalEndpoints) {
        for i in 0..2 {
            self.internal[i] += o.internal[i];
            self.external[i] += o.external[i];
        }
    }

    pub(crate) fn sub(&mut self, o: &NoLocalEndpoints) {
        for i in 0..2 {
            self.internal[i] -= o.internal[i];
            self.external[i] -= o.external[i];
        }
    }
}

/// One Service's frontends, from its EndpointSlices' `index` and `slice_ports` (which may hold
/// other services' too).
pub(crate) fn translate_service(
    svc: &Service,
    index: &SliceIndex,
    slice_ports: &SlicePortNames,
    node: &NodeInfo,
) -> ServiceOut {
    let mut out = ServiceOut::default();
    let skipped = &mut out.skipped;
    let no_local = &mut out.no_local;
    let frontends = &mut out.frontends;
    {
        let object = object_name(&svc.metadata);
        let skip = |reason, detail: String| Skipped {
            kind: "Service",
            object: object.clone(),
            reason,
            detail,
        };
        let Some(name) = svc.metadata.name.clone().filter(|n| !n.is_empty()) else {
            skipped.push(skip(
                SkipReason::MissingName,
                "metadata.name is empty".into(),
            ));
            return out;
        };
        if ignored(svc).is_some() {
            return out;
        }
        let Some(spec) = svc.spec.as_ref() else {
            return out;
        };
        let namespace = svc
            .metadata
            .namespace
            .clone()
            .unwrap_or_else(|| "default".into());
        let algorithm = match svc
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(ANNOTATION_LB_ALGORITHM))
        {
            None => node.lb_algorithm,
            Some(v) => LbAlgorithm::parse(v).unwrap_or_else(|| {
                skipped.push(skip(
                    SkipReason::InvalidAnnotation,
                    format!(
                        "annotation {ANNOTATION_LB_ALGORITHM} {v:?} is not random or maglev; \
                         using the node default {}",
                        node.lb_algorithm.as_str()
                    ),
                ));
                node.lb_algorithm
            }),
        };

        let parse_ips = |what: &str, list: Vec<&str>, skipped: &mut Vec<Skipped>| -> Vec<IpAddr> {
            let mut ips = Vec::new();
            for s in list {
                match parse_ip(s) {
                    Ok(ip) => ips.push(ip),
                    Err(why) => {
                        skipped.push(skip(SkipReason::InvalidIp, format!("{what} {s:?}: {why}")))
                    }
                }
            }
            ips
        };
        let cluster_ips = parse_ips(
            "clusterIP",
            match &spec.cluster_ips {
                Some(ips) if !ips.is_empty() => ips.iter().map(String::as_str).collect(),
                _ => spec.cluster_ip.as_deref().into_iter().collect(),
            },
            skipped,
        );
        let external_ips = parse_ips(
            "externalIP",
            spec.external_ips
                .iter()
                .flatten()
                .map(String::as_str)
                .collect(),
            skipped,
        );
        let type_ = spec.type_.as_deref().unwrap_or("ClusterIP");
        // LoadBalancer ingress IPs in "Proxy" mode are reached through the load balancer's
        // own proxy, not as VIPs on the node.
        let lb_ips = if type_ == "LoadBalancer" {
            parse_ips(
                "loadBalancer ingress IP",
                svc.status
                    .as_ref()
                    .and_then(|s| s.load_balancer.as_ref())
                    .and_then(|lb| lb.ingress.as_ref())
                    .into_iter()
                    .flatten()
                    .filter(|i| i.ip_mode.as_deref().is_none_or(|m| m == "VIP"))
                    .filter_map(|i| i.ip.as_deref())
                    .collect(),
                skipped,
            )
        } else {
            Vec::new()
        };
        // kube-proxy applies loadBalancerSourceRanges to the LoadBalancer IPs only, and lets
        // the LB IP itself through too (load balancers that hairpin through their own IP).
        let mut source_ranges = BTreeSet::new();
        if !lb_ips.is_empty() {
            for r in spec.load_balancer_source_ranges.iter().flatten() {
                match r.trim().parse::<Cidr>() {
                    Ok(c) => {
                        source_ranges.insert(c);
                    }
                    Err(e) => skipped.push(skip(
                        SkipReason::InvalidIp,
                        format!("loadBalancerSourceRange {r:?}: {e} (range ignored)"),
                    )),
                }
            }
            if !source_ranges.is_empty() {
                for ip in &lb_ips {
                    source_ranges.insert(Cidr::host(*ip));
                }
            }
        }
        // `sessionAffinity: ClientIP`: flag and timeout on every frontend of the service.
        let (aff_flag, affinity_timeout) = if spec.session_affinity.as_deref() == Some("ClientIP") {
            let t = spec
                .session_affinity_config
                .as_ref()
                .and_then(|c| c.client_ip.as_ref())
                .and_then(|c| c.timeout_seconds);
            let timeout = match t {
                None => DEFAULT_AFFINITY_TIMEOUT,
                Some(t) if (1..=MAX_AFFINITY_TIMEOUT as i32).contains(&t) => t as u32,
                Some(t) => {
                    skipped.push(skip(
                        SkipReason::InvalidSessionAffinity,
                        format!(
                            "sessionAffinityConfig.clientIP.timeoutSeconds {t} outside 1..={MAX_AFFINITY_TIMEOUT} (the default {DEFAULT_AFFINITY_TIMEOUT} is used)"
                        ),
                    ));
                    DEFAULT_AFFINITY_TIMEOUT
                }
            };
            (svc_flags::AFFINITY, timeout)
        } else {
            (0, 0)
        };
        let internal_local = spec.internal_traffic_policy.as_deref() == Some("Local");
        let externally_accessible_type = matches!(type_, "NodePort" | "LoadBalancer")
            || (type_ == "ClusterIP" && !external_ips.is_empty());
        let external_local =
            externally_accessible_type && spec.external_traffic_policy.as_deref() == Some("Local");

        let empty = Default::default();
        let slices = index
            .get(&(namespace.clone(), name.clone()))
            .unwrap_or(&empty);
        let ports = spec.ports.as_deref().unwrap_or_default();
        if ports.is_empty() {
            skipped.push(skip(
                SkipReason::NoPorts,
                "no ports (only headless services may have none)".into(),
            ));
        }
        let listed = slice_ports.get(&(namespace.clone(), name.clone()));
        let mut port_names = BTreeSet::new();
        for port in ports {
            let port_name = port.name.clone().unwrap_or_default();
            let proto_name = port.protocol.as_deref().unwrap_or("TCP");
            let Some(proto) = Proto::from_k8s(proto_name) else {
                skipped.push(skip(
                    SkipReason::UnknownProtocol,
                    format!("port {port_name:?} protocol {proto_name:?}"),
                ));
                continue;
            };
            // kube-proxy keys service ports by (name, protocol); a second one would share the
            // first's endpoints under another number.
            if !port_names.insert((port_name.clone(), proto)) {
                skipped.push(skip(
                    SkipReason::DuplicatePortName,
                    format!("port {port_name:?}/{proto} number {} (the first port of that name is used)", port.port),
                ));
                continue;
            }
            if !(1..=65535).contains(&port.port) {
                skipped.push(skip(
                    SkipReason::InvalidPort,
                    format!("port {port_name:?} number {}", port.port),
                ));
                continue;
            }
            // Slices that name none of their ports like this one: the port gets no endpoints
            // (and rejects), typically because the slice was written with the targetPort's name.
            if let Some(listed) = listed
                && !listed.is_empty()
                && !listed.contains(&port_name)
            {
                let names: Vec<&str> = listed.iter().map(String::as_str).collect();
                skipped.push(skip(
                    SkipReason::UnmatchedPort,
                    format!(
                        "port {port_name:?} is named by none of its EndpointSlices' ports ({}): no endpoints; slice ports carry the service port's name",
                        names.join(", ")
                    ),
                ));
            }
            // A nodePort outside 1..=65535 gets no NodePort frontend (never one truncated to
            // 16 bits); the port's other frontends stay.
            let node_port_number = match port.node_port {
                Some(n @ 1..=65535) => Some(n as u16),
                None | Some(0) => None,
                Some(n) => {
                    skipped.push(skip(
                        SkipReason::InvalidPort,
                        format!("port {port_name:?} nodePort {n} (no NodePort frontend)"),
                    ));
                    None
                }
            };
            let node_port = node_port_number.is_some();
            let policies = Policies {
                internal_local,
                external_local,
                externally_accessible: node_port || !lb_ips.is_empty() || !external_ips.is_empty(),
            };
            let svc_name = ServicePortName {
                namespace: namespace.clone(),
                name: name.clone(),
                port_name: port_name.clone(),
            };
            for family in [0usize, 1] {
                let eps: Vec<&Endpoint> = slices[family]
                    .get(&(port_name.clone(), proto))
                    .map(|m| m.values().collect())
                    .unwrap_or_default();
                let (cluster, local) = categorize(&eps, proto, policies, node);
                let of_family = |ip: &&IpAddr| usize::from(ip.is_ipv6()) == family;

                // kube-proxy's `hasAnyEndpoints`: a ready or serving terminating endpoint on
                // any node, whichever policies the service uses.
                let has_endpoints = eps.iter().any(|e| e.ready || (e.serving && e.terminating));
                let (internal, mut flags) = if internal_local {
                    (&local, svc_flags::INT_LOCAL)
                } else {
                    (&cluster, 0)
                };
                // kube-proxy DROPs in-cluster traffic of an iTP=Local service whose endpoints
                // are all on other nodes; REJECT is for a service with none at all.
                if internal_local && !any_active(&local) && has_endpoints {
                    flags |= svc_flags::EMPTY_DROP;
                }
                for ip in cluster_ips.iter().filter(of_family) {
                    frontends.push((
                        Frontend::new(*ip, port.port as u16, proto),
                        ServiceEntry {
                            name: svc_name.clone(),
                            flags: flags | svc_flags::CLUSTER_IP | aff_flag,
                            backends: internal.clone(),
                            affinity_timeout,
                            algorithm,
                            ..ServiceEntry::default()
                        },
                        skipped.len(),
                    ));
                }

                // External frontends: external IPs, LoadBalancer IPs and NodePorts on this
                // node's NodePort addresses, all with the external policy's endpoints.
                let external = if external_local { &local } else { &cluster };
                let mut flags = aff_flag;
                if external_local {
                    flags |= svc_flags::EXT_LOCAL;
                }
                // kube-proxy DROPs external traffic of a service whose endpoints are all
                // elsewhere (eTP=Local), and REJECTs only when it has none at all.
                if external_local && !any_active(&local) && has_endpoints {
                    flags |= svc_flags::EMPTY_DROP;
                }
                if has_endpoints && !any_active(&local) {
                    no_local.internal[family] += usize::from(internal_local);
                    no_local.external[family] +=
                        usize::from(external_local && policies.externally_accessible);
                }
                let node_port = node_port_number;
                // A family's NodePorts belong to services of that family (kube-proxy runs one
                // proxier per family, and each sees only the services with its ClusterIP).
                let nodeport_ips: Vec<IpAddr> =
                    if node_port.is_some() && cluster_ips.iter().any(|ip| of_family(&ip)) {
                        node.nodeport_ips.clone()
                    } else {
                        Vec::new()
                    };
                for (ips, kind, fe_port) in [
                    (&external_ips, svc_flags::EXTERNAL_IP, port.port as u16),
                    (&lb_ips, svc_flags::LOAD_BALANCER, port.port as u16),
                    (&nodeport_ips, svc_flags::NODE_PORT, node_port.unwrap_or(0)),
                ] {
                    for ip in ips.iter().filter(of_family) {
                        let fe = Frontend::new(*ip, fe_port, proto);
                        let two_scopes = external_local && cluster != local;
                        let mut fe_flags = flags | kind;
                        if two_scopes {
                            fe_flags |= svc_flags::TWO_SCOPES;
                        }
                        if kind == svc_flags::NODE_PORT || node.local_ips.contains(ip) {
                            fe_flags |= svc_flags::LOCAL_ADDR;
                        }
                        let ranges = if kind == svc_flags::LOAD_BALANCER {
                            source_ranges
                                .iter()
                                .filter(|c| c.addr.is_ipv6() == ip.is_ipv6())
                                .copied()
                                .collect()
                        } else {
                            BTreeSet::new()
                        };
                        if !ranges.is_empty() {
                            fe_flags |= svc_flags::SOURCE_RANGES;
                        }
                        frontends.push((
                            fe,
                            ServiceEntry {
                                name: svc_name.clone(),
                                flags: fe_flags,
                                backends: external.clone(),
                                source_ranges: ranges.clone(),
                                affinity_timeout,
                                algorithm,
                            },
                            skipped.len(),
                        ));
                        if two_scopes {
                            // Pod and host traffic to an eTP=Local external frontend is not
                            // restricted to local endpoints (kube-proxy's short-circuit).
                            frontends.push((
                                Frontend {
                                    scope: Scope::Internal,
                                    ..fe
                                },
                                ServiceEntry {
                                    name: svc_name.clone(),
                                    flags: fe_flags & !svc_flags::EMPTY_DROP,
                                    backends: cluster.clone(),
                                    source_ranges: ranges,
                                    affinity_timeout,
                                    algorithm,
                                },
                                skipped.len(),
                            ));
                        }
                    }
                }
            }
        }
    }
    out
}
