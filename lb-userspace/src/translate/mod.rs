//! The pure function from Kubernetes objects (+ this node's facts) to the desired datapath
//! state, porting kube-proxy's decisions:
//!
//! - which Services are proxied (`ShouldSkipService`, the `service-proxy-name` label, headless
//!   EndpointSlices);
//! - per service port and IP family, the endpoints from all of the service's slices, matched on
//!   the slice port's name and protocol, first address only, deduplicated on `ip:port` with a
//!   local copy preferred (`EndpointSliceCache`), then one that is not terminating: the one
//!   index ([`slices`]) the health check node ports count local endpoints from too;
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
mod objects;
pub(crate) mod slices;

use std::{borrow::Borrow, collections::BTreeSet, net::IpAddr};

use crate::kube::slim::{self, Addr, EndpointSlice, Node, Service, ServicePort, ServiceSpec};
use lb_common::svc_flags;

use crate::model::{
    Backend, BackendState, Cidr, DesiredState, Family, Frontend, L4Addr, LbAlgorithm, Proto, Scope,
    ServiceEntry, ServicePortName,
};
use objects::Skips;
pub use objects::{SkipReason, Skipped};
pub use slices::MAX_SLICE_ENDPOINTS;
use slices::{Endpoint, SliceIndex, SlicePortNames, index_slices, slice_port_names};

pub use crate::kube::slim::{ANNOTATION_LB_ALGORITHM, TAINT_TO_BE_DELETED};

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
        let zone = node.and_then(|n| n.zone.as_deref()).map(String::from);
        Self {
            name: name.to_string(),
            zone,
            ..Self::default()
        }
    }
}

/// Whether load balancers should still send traffic to this node (kube-proxy's `SyncNode`):
/// not while its Node is being deleted or carries [`TAINT_TO_BE_DELETED`]. Without a Node
/// object the node counts as eligible, as kube-proxy's starts out.
pub fn node_eligible(node: Option<&Node>) -> bool {
    let Some(node) = node else { return true };
    !node.deleting && !node.to_be_deleted
}

/// kube-proxy's default `sessionAffinityConfig.clientIP.timeoutSeconds` (3 hours).
pub const DEFAULT_AFFINITY_TIMEOUT: u32 = 10_800;
/// The largest timeout the API server accepts (1 day).
pub const MAX_AFFINITY_TIMEOUT: u32 = 86_400;

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

/// Whether lb leaves this service alone, and why.
pub fn ignored(svc: &Service) -> Option<Ignored> {
    if svc.other_proxy {
        return Some(Ignored::OtherProxy);
    }
    let Some(spec) = svc.spec.as_ref() else {
        return Some(Ignored::Headless);
    };
    if spec.type_.as_deref() == Some("ExternalName") {
        return Some(Ignored::ExternalName);
    }
    match &spec.cluster_ip {
        None => Some(Ignored::Headless),
        Some(ip) if ip.is_text("") || ip.is_text("None") => Some(Ignored::Headless),
        Some(_) => None,
    }
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
    let index = index_slices(slices, &node.name, &mut skipped);
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
    ObjectName,
);

pub(crate) fn service_order(s: &Service) -> ServiceOrder {
    let m = &s.metadata;
    (
        s.creation_timestamp.clone(),
        ObjectName(
            m.namespace.clone().unwrap_or_else(|| slim::name("default")),
            m.name.clone().unwrap_or_else(|| slim::name("")),
        ),
    )
}

/// A namespace and name ordered as their `namespace/name` text, without building the text
/// (every service keeps one).
#[derive(Clone, Debug)]
pub(crate) struct ObjectName(slim::Name, slim::Name);

impl ObjectName {
    fn text(&self) -> impl Iterator<Item = u8> + '_ {
        self.0.bytes().chain(*b"/").chain(self.1.bytes())
    }
}

impl Ord for ObjectName {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.text().cmp(other.text())
    }
}

impl PartialOrd for ObjectName {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

/// Equal as text, as the order is (`a/b` + `c` is `a` + `b/c`).
impl PartialEq for ObjectName {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other).is_eq()
    }
}

impl Eq for ObjectName {}

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
/// other services' too): kube-proxy's `ShouldSkipService`, then per service port
/// ([`ServiceFacts::port`]) and IP family the frontends and the endpoints each one gets
/// ([`ServiceFacts::family_frontends`]).
pub(crate) fn translate_service(
    svc: &Service,
    index: &SliceIndex,
    slice_ports: &SlicePortNames,
    node: &NodeInfo,
) -> ServiceOut {
    let mut out = ServiceOut::default();
    let mut skips = Skips::new("Service", &svc.metadata, &mut out.skipped);
    let Some(name) = svc.metadata.name.clone().filter(|n| !n.is_empty()) else {
        skips.push(SkipReason::MissingName, "metadata.name is empty".into());
        return out;
    };
    if ignored(svc).is_some() {
        return out;
    }
    let Some(spec) = svc.spec.as_ref() else {
        return out;
    };
    let facts = ServiceFacts::read(svc, spec, name, node, &mut skips);
    let key = (facts.namespace.to_string(), facts.name.to_string());
    let empty = Default::default();
    let endpoints = index.get(&key).unwrap_or(&empty);
    let ports = &spec.ports[..];
    if ports.is_empty() {
        skips.push(
            SkipReason::NoPorts,
            "no ports (only headless services may have none)".into(),
        );
    }
    let listed = slice_ports.get(&key);
    let mut port_names = BTreeSet::new();
    for port in ports {
        let Some(port) = facts.port(port, &mut port_names, listed, &mut skips) else {
            continue;
        };
        for family in [Family::V4, Family::V6] {
            let eps: Vec<&Endpoint> = endpoints[family.index()]
                .get(&(port.name.port_name.to_string(), port.proto))
                .map(|m| m.values().collect())
                .unwrap_or_default();
            facts.family_frontends(&port, family, &eps, &mut out.frontends, &mut out.no_local);
        }
    }
    out
}

/// What every frontend of one Service on a node shares: its addresses, algorithm, session
/// affinity, source ranges and traffic policies.
struct ServiceFacts<'a> {
    node: &'a NodeInfo,
    namespace: slim::Name,
    name: slim::Name,
    algorithm: LbAlgorithm,
    cluster_ips: Vec<IpAddr>,
    external_ips: Vec<IpAddr>,
    lb_ips: Vec<IpAddr>,
    source_ranges: BTreeSet<Cidr>,
    /// `svc_flags::AFFINITY` with `sessionAffinity: ClientIP`, else 0.
    affinity_flag: u16,
    affinity_timeout: u32,
    /// `internalTrafficPolicy: Local`.
    internal_local: bool,
    /// `externalTrafficPolicy: Local` of a type that is reachable from outside.
    external_local: bool,
}

/// One service port kube-proxy programs (its `ServicePort`).
struct PortFacts {
    name: ServicePortName,
    proto: Proto,
    port: u16,
    /// Its valid nodePort, if any.
    node_port: Option<u16>,
    policies: Policies,
    /// How many skipped entries the service reported before this port's frontends.
    skipped_before: usize,
}

/// The endpoints `CategorizeEndpoints` chose for one service port in one family.
struct Categorized {
    cluster: Vec<Backend>,
    local: Vec<Backend>,
    /// kube-proxy's `hasAnyEndpoints`: a ready or serving terminating endpoint on any node,
    /// whichever policies the service uses.
    has_endpoints: bool,
}

impl Categorized {
    /// Whether traffic of a Local policy is dropped here: the service has endpoints, but none
    /// on this node takes new flows (kube-proxy DROPs; it REJECTs only without any endpoint).
    fn drops_local(&self) -> bool {
        self.has_endpoints && !any_active(&self.local)
    }
}

impl<'a> ServiceFacts<'a> {
    /// Reads the Service-wide facts, reporting the parts it refuses in order: the algorithm
    /// annotation, ClusterIPs, externalIPs, LoadBalancer ingress IPs, source ranges, session
    /// affinity.
    fn read(
        svc: &Service,
        spec: &ServiceSpec,
        name: slim::Name,
        node: &'a NodeInfo,
        skips: &mut Skips,
    ) -> Self {
        let namespace = (svc.metadata.namespace.clone()).unwrap_or_else(|| slim::name("default"));
        let algorithm = lb_algorithm(svc, node, skips);
        let cluster_ips = parse_ips(
            "clusterIP",
            if spec.cluster_ips.is_empty() {
                spec.cluster_ip.iter().collect()
            } else {
                spec.cluster_ips.iter().collect()
            },
            skips,
        );
        let external_ips = parse_ips("externalIP", spec.external_ips.iter().collect(), skips);
        let type_ = spec.type_.as_deref().unwrap_or("ClusterIP");
        let lb_ips = if type_ == "LoadBalancer" {
            load_balancer_ips(svc, skips)
        } else {
            Vec::new()
        };
        let source_ranges = source_ranges(spec, &lb_ips, skips);
        let (affinity_flag, affinity_timeout) = session_affinity(spec, skips);
        let externally_accessible_type = matches!(type_, "NodePort" | "LoadBalancer")
            || (type_ == "ClusterIP" && !external_ips.is_empty());
        Self {
            node,
            namespace,
            name,
            algorithm,
            cluster_ips,
            external_ips,
            lb_ips,
            source_ranges,
            affinity_flag,
            affinity_timeout,
            internal_local: spec.internal_local,
            external_local: externally_accessible_type && spec.external_local,
        }
    }

    /// A service port kube-proxy programs, or `None` for one it skips: an unknown protocol,
    /// a (name, protocol) an earlier port has (kube-proxy keys service ports by it; a second
    /// one would share the first's endpoints under another number), a number out of range.
    /// A name no slice port carries and a bad nodePort are reported, and the port stays.
    fn port(
        &self,
        port: &ServicePort,
        seen: &mut BTreeSet<(String, Proto)>,
        listed: Option<&BTreeSet<String>>,
        skips: &mut Skips,
    ) -> Option<PortFacts> {
        let port_name = port.name.clone().unwrap_or_else(|| slim::name(""));
        let proto_name = port.protocol.as_deref().unwrap_or("TCP");
        let Some(proto) = Proto::from_k8s(proto_name) else {
            skips.push(
                SkipReason::UnknownProtocol,
                format!("port {port_name:?} protocol {proto_name:?}"),
            );
            return None;
        };
        if !seen.insert((port_name.to_string(), proto)) {
            skips.push(
                SkipReason::DuplicatePortName,
                format!(
                    "port {port_name:?}/{proto} number {} (the first port of that name is used)",
                    port.port
                ),
            );
            return None;
        }
        if !(1..=65535).contains(&port.port) {
            skips.push(
                SkipReason::InvalidPort,
                format!("port {port_name:?} number {}", port.port),
            );
            return None;
        }
        check_slice_port_name(&port_name, listed, skips);
        let node_port = node_port(&port_name, port.node_port, skips);
        Some(PortFacts {
            name: ServicePortName {
                namespace: self.namespace.clone(),
                name: self.name.clone(),
                port_name,
            },
            proto,
            port: port.port as u16,
            node_port,
            policies: Policies {
                internal_local: self.internal_local,
                external_local: self.external_local,
                externally_accessible: node_port.is_some()
                    || !self.lb_ips.is_empty()
                    || !self.external_ips.is_empty(),
            },
            skipped_before: skips.count(),
        })
    }

    /// One port's frontends in `family`, with the endpoints `CategorizeEndpoints` chooses from
    /// `eps` (the port's endpoints of that family); counts the port in `no_local` when a Local
    /// policy's traffic is dropped here.
    fn family_frontends(
        &self,
        port: &PortFacts,
        family: Family,
        eps: &[&Endpoint],
        frontends: &mut Vec<(Frontend, ServiceEntry, usize)>,
        no_local: &mut NoLocalEndpoints,
    ) {
        let (cluster, local) = categorize(eps, port.proto, port.policies, self.node);
        let chosen = Categorized {
            cluster,
            local,
            has_endpoints: eps.iter().any(|e| e.ready || (e.serving && e.terminating)),
        };
        self.cluster_ip_frontends(port, family, &chosen, frontends);
        if chosen.drops_local() {
            no_local.internal[family.index()] += usize::from(self.internal_local);
            no_local.external[family.index()] +=
                usize::from(self.external_local && port.policies.externally_accessible);
        }
        self.external_frontends(port, family, &chosen, frontends);
    }

    /// The ClusterIP frontends of a port in `family`, with the internal traffic policy's
    /// endpoints.
    fn cluster_ip_frontends(
        &self,
        port: &PortFacts,
        family: Family,
        chosen: &Categorized,
        frontends: &mut Vec<(Frontend, ServiceEntry, usize)>,
    ) {
        let (internal, mut flags) = if self.internal_local {
            (&chosen.local, svc_flags::INT_LOCAL)
        } else {
            (&chosen.cluster, 0)
        };
        // kube-proxy DROPs in-cluster traffic of an iTP=Local service whose endpoints are all
        // on other nodes; REJECT is for a service with none at all.
        if self.internal_local && chosen.drops_local() {
            flags |= svc_flags::EMPTY_DROP;
        }
        for ip in self
            .cluster_ips
            .iter()
            .filter(|ip| Family::of(ip) == family)
        {
            frontends.push((
                Frontend::new(*ip, port.port, port.proto),
                ServiceEntry {
                    name: port.name.clone(),
                    flags: flags | svc_flags::CLUSTER_IP | self.affinity_flag,
                    backends: internal.clone(),
                    affinity_timeout: self.affinity_timeout,
                    algorithm: self.algorithm,
                    ..ServiceEntry::default()
                },
                port.skipped_before,
            ));
        }
    }

    /// The external frontends of a port in `family`: external IPs, LoadBalancer IPs and
    /// NodePorts on this node's NodePort addresses, all with the external policy's endpoints.
    fn external_frontends(
        &self,
        port: &PortFacts,
        family: Family,
        chosen: &Categorized,
        frontends: &mut Vec<(Frontend, ServiceEntry, usize)>,
    ) {
        let mut flags = self.affinity_flag;
        if self.external_local {
            flags |= svc_flags::EXT_LOCAL;
        }
        // kube-proxy DROPs external traffic of a service whose endpoints are all elsewhere
        // (eTP=Local), and REJECTs only when it has none at all.
        if self.external_local && chosen.drops_local() {
            flags |= svc_flags::EMPTY_DROP;
        }
        // A family's NodePorts belong to services of that family (kube-proxy runs one proxier
        // per family, and each sees only the services with its ClusterIP).
        let nodeport_ips: Vec<IpAddr> = if port.node_port.is_some()
            && self.cluster_ips.iter().any(|ip| Family::of(ip) == family)
        {
            self.node.nodeport_ips.clone()
        } else {
            Vec::new()
        };
        for (ips, kind, fe_port) in [
            (&self.external_ips, svc_flags::EXTERNAL_IP, port.port),
            (&self.lb_ips, svc_flags::LOAD_BALANCER, port.port),
            (
                &nodeport_ips,
                svc_flags::NODE_PORT,
                port.node_port.unwrap_or(0),
            ),
        ] {
            for ip in ips.iter().filter(|ip| Family::of(ip) == family) {
                let fe = Frontend::new(*ip, fe_port, port.proto);
                for (fe, entry) in self.external_entries(port, fe, kind, flags, chosen) {
                    frontends.push((fe, entry, port.skipped_before));
                }
            }
        }
    }

    /// The entries of one external frontend of `kind` (`svc_flags::EXTERNAL_IP`, ...): the
    /// external policy's endpoints; with `externalTrafficPolicy: Local` and cluster endpoints
    /// that differ from the local ones, a second, internal scope with the cluster's.
    fn external_entries(
        &self,
        port: &PortFacts,
        fe: Frontend,
        kind: u16,
        flags: u16,
        chosen: &Categorized,
    ) -> Vec<(Frontend, ServiceEntry)> {
        let ip = fe.l4.addr;
        let two_scopes = self.external_local && chosen.cluster != chosen.local;
        let mut fe_flags = flags | kind;
        if two_scopes {
            fe_flags |= svc_flags::TWO_SCOPES;
        }
        if kind == svc_flags::NODE_PORT || self.node.local_ips.contains(&ip) {
            fe_flags |= svc_flags::LOCAL_ADDR;
        }
        let ranges: BTreeSet<Cidr> = if kind == svc_flags::LOAD_BALANCER {
            self.source_ranges
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
        let external = if self.external_local {
            &chosen.local
        } else {
            &chosen.cluster
        };
        let entry = |flags, backends: &Vec<Backend>, source_ranges| ServiceEntry {
            name: port.name.clone(),
            flags,
            backends: backends.clone(),
            source_ranges,
            affinity_timeout: self.affinity_timeout,
            algorithm: self.algorithm,
        };
        let mut out = vec![(fe, entry(fe_flags, external, ranges.clone()))];
        if two_scopes {
            // Pod and host traffic to an eTP=Local external frontend is not restricted to
            // local endpoints (kube-proxy's short-circuit).
            let internal = Frontend {
                scope: Scope::Internal,
                ..fe
            };
            let flags = fe_flags & !svc_flags::EMPTY_DROP;
            out.push((internal, entry(flags, &chosen.cluster, ranges)));
        }
        out
    }
}

/// The Service's algorithm: its `lb.io/lb-algorithm` annotation, else (or when the annotation
/// is not one lb knows) the node default.
fn lb_algorithm(svc: &Service, node: &NodeInfo, skips: &mut Skips) -> LbAlgorithm {
    match svc.lb_algorithm.as_deref() {
        None => node.lb_algorithm,
        Some(v) => LbAlgorithm::parse(v).unwrap_or_else(|| {
            skips.push(
                SkipReason::InvalidAnnotation,
                format!(
                    "annotation {ANNOTATION_LB_ALGORITHM} {v:?} is not random or maglev; \
                     using the node default {}",
                    node.lb_algorithm.as_str()
                ),
            );
            node.lb_algorithm
        }),
    }
}

/// The addresses of `list` (`what` names the field) that parse as kube-proxy parses them.
fn parse_ips(what: &str, list: Vec<&Addr>, skips: &mut Skips) -> Vec<IpAddr> {
    let mut ips = Vec::new();
    for a in list {
        match a.ip() {
            Ok(ip) => ips.push(ip),
            Err((s, why)) => skips.push(SkipReason::InvalidIp, format!("{what} {s:?}: {why}")),
        }
    }
    ips
}

/// A LoadBalancer Service's ingress IPs that are VIPs on the node: in "Proxy" mode they are
/// reached through the load balancer's own proxy instead.
fn load_balancer_ips(svc: &Service, skips: &mut Skips) -> Vec<IpAddr> {
    parse_ips(
        "loadBalancer ingress IP",
        svc.lb_ingress
            .iter()
            .filter(|i| !i.proxy_mode)
            .filter_map(|i| i.ip.as_ref())
            .collect(),
        skips,
    )
}

/// `loadBalancerSourceRanges`, which kube-proxy applies to the LoadBalancer IPs only, plus
/// the LB IPs themselves (load balancers that hairpin through their own IP); empty without
/// LB IPs or valid ranges.
fn source_ranges(spec: &ServiceSpec, lb_ips: &[IpAddr], skips: &mut Skips) -> BTreeSet<Cidr> {
    let mut source_ranges = BTreeSet::new();
    if lb_ips.is_empty() {
        return source_ranges;
    }
    for r in &spec.load_balancer_source_ranges {
        match r.trim().parse::<Cidr>() {
            Ok(c) => {
                source_ranges.insert(c);
            }
            Err(e) => skips.push(
                SkipReason::InvalidIp,
                format!("loadBalancerSourceRange {r:?}: {e} (range ignored)"),
            ),
        }
    }
    if !source_ranges.is_empty() {
        for ip in lb_ips {
            source_ranges.insert(Cidr::host(*ip));
        }
    }
    source_ranges
}

/// `sessionAffinity: ClientIP`: the flag and timeout every frontend of the service carries,
/// `(0, 0)` without; an out-of-range timeout gets kube-proxy's default.
fn session_affinity(spec: &ServiceSpec, skips: &mut Skips) -> (u16, u32) {
    if !spec.affinity_client_ip {
        return (0, 0);
    }
    let timeout = match spec.affinity_timeout {
        None => DEFAULT_AFFINITY_TIMEOUT,
        Some(t) if (1..=MAX_AFFINITY_TIMEOUT as i32).contains(&t) => t as u32,
        Some(t) => {
            skips.push(
                SkipReason::InvalidSessionAffinity,
                format!(
                    "sessionAffinityConfig.clientIP.timeoutSeconds {t} outside 1..={MAX_AFFINITY_TIMEOUT} (the default {DEFAULT_AFFINITY_TIMEOUT} is used)"
                ),
            );
            DEFAULT_AFFINITY_TIMEOUT
        }
    };
    (svc_flags::AFFINITY, timeout)
}

/// Reports a service port none of its slices' ports is named like, though they name some:
/// the port gets no endpoints (and rejects), typically because the slices were written with
/// the targetPort's name.
fn check_slice_port_name(port_name: &str, listed: Option<&BTreeSet<String>>, skips: &mut Skips) {
    if let Some(listed) = listed
        && !listed.is_empty()
        && !listed.contains(port_name)
    {
        let names: Vec<&str> = listed.iter().map(String::as_str).collect();
        skips.push(
            SkipReason::UnmatchedPort,
            format!(
                "port {port_name:?} is named by none of its EndpointSlices' ports ({}): no endpoints; slice ports carry the service port's name",
                names.join(", ")
            ),
        );
    }
}

/// A port's nodePort: one outside 1..=65535 gets no NodePort frontend (never one truncated to
/// 16 bits); the port's other frontends stay.
fn node_port(port_name: &str, node_port: Option<i32>, skips: &mut Skips) -> Option<u16> {
    match node_port {
        Some(n @ 1..=65535) => Some(n as u16),
        None | Some(0) => None,
        Some(n) => {
            skips.push(
                SkipReason::InvalidPort,
                format!("port {port_name:?} nodePort {n} (no NodePort frontend)"),
            );
            None
        }
    }
}
