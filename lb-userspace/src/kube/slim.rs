//! lb's own compact copies of the Kubernetes objects it reads (as Cilium's `pkg/k8s/slim`):
//! every source converts a Service, EndpointSlice or Node into these right after decoding it,
//! so no k8s-openapi object outlives its decode. They keep only the fields lb reads, and keep
//! them so that translation still reports a bad value exactly as before: an address that does
//! not parse stays as its text ([`Addr::Invalid`]), a number out of range stays a number.
//!
//! What makes them small, at a million endpoints: an endpoint keeps its first address only (the
//! one kube-proxy uses) as an `IpAddr`, its conditions as three bytes and its topology hints
//! behind one pointer; names that repeat across objects (namespaces, node names, zones, port
//! names, protocols, types) are interned `Arc<str>`s, and identical EndpointSlice port lists
//! are one shared `Arc`.
use std::{
    borrow::Borrow,
    collections::HashSet,
    fmt,
    hash::Hash,
    net::IpAddr,
    sync::{Arc, LazyLock, Mutex},
};

use k8s_openapi::{
    api::{core::v1, discovery::v1 as discovery},
    apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time},
};

use super::{LABEL_HEADLESS, LABEL_SERVICE_NAME, LABEL_SERVICE_PROXY_NAME, LABEL_ZONE};

/// A name many objects share (namespace, node, zone, port name, protocol, type), interned.
pub type Name = Arc<str>;

/// Annotation choosing a Service's load-balancing algorithm (`random` or `maglev`), overriding
/// the node default (`--lb-algorithm`).
pub const ANNOTATION_LB_ALGORITHM: &str = "lb.io/lb-algorithm";
/// When the change an EndpointSlice records was triggered (kube-proxy's programming latency).
pub const LAST_CHANGE_TRIGGER_TIME: &str = "endpoints.kubernetes.io/last-change-trigger-time";
/// The taint the cluster autoscaler puts on a node it is about to delete.
pub const TAINT_TO_BE_DELETED: &str = "ToBeDeletedByClusterAutoscaler";

/// One table of shared values. Entries only the table still holds are dropped whenever it has
/// doubled since the last sweep, so churn (namespaces, nodes coming and going) cannot grow it
/// without bound.
struct Interner<T: ?Sized> {
    set: HashSet<Arc<T>>,
    swept_at: usize,
}

impl<T: ?Sized + Hash + Eq> Interner<T> {
    fn new() -> Self {
        Self {
            set: HashSet::new(),
            swept_at: 1024,
        }
    }

    fn get<Q>(&mut self, value: &Q, make: impl FnOnce(&Q) -> Arc<T>) -> Arc<T>
    where
        Arc<T>: Borrow<Q>,
        Q: ?Sized + Hash + Eq,
    {
        if let Some(v) = self.set.get(value) {
            return Arc::clone(v);
        }
        if self.set.len() >= 2 * self.swept_at {
            self.set.retain(|v| Arc::strong_count(v) > 1);
            self.swept_at = self.set.len().max(1024);
        }
        let v = make(value);
        self.set.insert(Arc::clone(&v));
        v
    }
}

static NAMES: LazyLock<Mutex<Interner<str>>> = LazyLock::new(|| Mutex::new(Interner::new()));
static SLICE_PORTS: LazyLock<Mutex<Interner<[SlicePort]>>> =
    LazyLock::new(|| Mutex::new(Interner::new()));

/// The shared copy of `s`.
pub fn name(s: &str) -> Name {
    // A poisoned lock only means another thread panicked mid-insert; the set is still valid.
    let mut names = NAMES.lock().unwrap_or_else(|e| e.into_inner());
    names.get(s, |s| Arc::from(s))
}

fn names(list: Option<&Vec<String>>) -> Box<[Name]> {
    list.into_iter().flatten().map(|s| name(s)).collect()
}

fn boxed(s: Option<&String>) -> Option<Box<str>> {
    s.map(|s| s.as_str().into())
}

/// Parses an address as Go's `netip.ParseAddr` (kube-proxy's parser) does: a leading zero in an
/// IPv4 octet (`010.1.1.1`, octal to some parsers), an IPv6 zone (`fe80::1%eth0`), a CIDR and
/// surrounding spaces are refused. IPv4-mapped IPv6 addresses (`::ffff:198.18.0.1`) are refused
/// too: their family is ambiguous, and lb never programs one address under two families.
pub fn parse_ip(s: &str) -> Result<IpAddr, &'static str> {
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

/// An address field: parsed as kube-proxy parses it ([`parse_ip`]), or the text that did not
/// parse, kept for the report.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Addr {
    Ip(IpAddr),
    Invalid(Box<str>),
}

impl Addr {
    pub fn parse(s: &str) -> Self {
        match parse_ip(s) {
            Ok(ip) => Addr::Ip(ip),
            Err(_) => Addr::Invalid(s.into()),
        }
    }

    /// The address, or the text and why it is none.
    pub fn ip(&self) -> Result<IpAddr, (&str, &'static str)> {
        match self {
            Addr::Ip(ip) => Ok(*ip),
            Addr::Invalid(s) => Err((s, parse_ip(s).err().unwrap_or("not an IP address"))),
        }
    }

    /// The address as Rust's lenient parser reads the text (an IPv4-mapped IPv6 address
    /// included), for the places that read it so.
    pub fn lenient(&self) -> Option<IpAddr> {
        match self {
            Addr::Ip(ip) => Some(*ip),
            Addr::Invalid(s) => s.parse().ok(),
        }
    }

    /// Whether the text was exactly `s` (only ever an invalid address: `""`, `"None"`).
    pub fn is_text(&self, s: &str) -> bool {
        matches!(self, Addr::Invalid(t) if &**t == s)
    }
}

impl fmt::Display for Addr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Addr::Ip(ip) => ip.fmt(f),
            Addr::Invalid(s) => f.write_str(s),
        }
    }
}

fn addrs(list: Option<&Vec<String>>) -> Box<[Addr]> {
    list.into_iter().flatten().map(|s| Addr::parse(s)).collect()
}

/// The metadata lb reads: what names an object and tells its versions apart.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Meta {
    pub namespace: Option<Name>,
    /// Shared, not interned: the caches that name an object by it clone the `Arc`.
    pub name: Option<Arc<str>>,
    pub resource_version: Option<Box<str>>,
}

impl Meta {
    fn of(m: &ObjectMeta) -> Self {
        Self {
            namespace: m.namespace.as_deref().map(name),
            name: m.name.as_deref().map(Arc::from),
            resource_version: boxed(m.resource_version.as_ref()),
        }
    }

    /// `namespace/name`, the namespace `default` when unset: how reports name objects.
    pub fn object_name(&self) -> String {
        format!(
            "{}/{}",
            self.namespace.as_deref().unwrap_or("default"),
            self.name.as_deref().unwrap_or("")
        )
    }
}

fn label<'m>(m: &'m ObjectMeta, key: &str) -> Option<&'m String> {
    m.labels.as_ref().and_then(|l| l.get(key))
}

fn annotation<'m>(m: &'m ObjectMeta, key: &str) -> Option<&'m String> {
    m.annotations.as_ref().and_then(|a| a.get(key))
}

/// A Service, as lb reads it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Service {
    pub metadata: Meta,
    pub creation_timestamp: Option<Time>,
    /// It carries the `service.kubernetes.io/service-proxy-name` label (another proxy's).
    pub other_proxy: bool,
    /// Its `lb.io/lb-algorithm` annotation.
    pub lb_algorithm: Option<Box<str>>,
    pub spec: Option<ServiceSpec>,
    /// `status.loadBalancer.ingress`.
    pub lb_ingress: Box<[LbIngress]>,
}

/// The part of a ServiceSpec lb reads; an empty list stands for an absent one too (lb never
/// tells them apart).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServiceSpec {
    pub type_: Option<Name>,
    pub cluster_ip: Option<Addr>,
    pub cluster_ips: Box<[Addr]>,
    pub ip_families: Box<[Name]>,
    pub external_ips: Box<[Addr]>,
    pub ports: Box<[ServicePort]>,
    /// `sessionAffinity: ClientIP`.
    pub affinity_client_ip: bool,
    /// `sessionAffinityConfig.clientIP.timeoutSeconds`.
    pub affinity_timeout: Option<i32>,
    /// `internalTrafficPolicy: Local`.
    pub internal_local: bool,
    /// `externalTrafficPolicy: Local` (whatever the type).
    pub external_local: bool,
    pub load_balancer_source_ranges: Box<[Box<str>]>,
    pub health_check_node_port: Option<i32>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct ServicePort {
    pub name: Option<Name>,
    pub protocol: Option<Name>,
    pub port: i32,
    pub node_port: Option<i32>,
}

/// One `status.loadBalancer.ingress` entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LbIngress {
    pub ip: Option<Addr>,
    /// `ipMode` is set and not `VIP` (`Proxy`: reached through the load balancer's proxy).
    pub proxy_mode: bool,
}

impl From<&v1::Service> for Service {
    fn from(s: &v1::Service) -> Self {
        let m = &s.metadata;
        let ingress = s
            .status
            .as_ref()
            .and_then(|s| s.load_balancer.as_ref())
            .and_then(|lb| lb.ingress.as_ref());
        Self {
            metadata: Meta::of(m),
            creation_timestamp: m.creation_timestamp.clone(),
            other_proxy: label(m, LABEL_SERVICE_PROXY_NAME).is_some(),
            lb_algorithm: boxed(annotation(m, ANNOTATION_LB_ALGORITHM)),
            spec: s.spec.as_ref().map(ServiceSpec::from),
            lb_ingress: ingress
                .into_iter()
                .flatten()
                .map(|i| LbIngress {
                    ip: i.ip.as_deref().map(Addr::parse),
                    proxy_mode: i.ip_mode.as_deref().is_some_and(|m| m != "VIP"),
                })
                .collect(),
        }
    }
}

impl From<&v1::ServiceSpec> for ServiceSpec {
    fn from(s: &v1::ServiceSpec) -> Self {
        let affinity = s.session_affinity_config.as_ref();
        Self {
            type_: s.type_.as_deref().map(name),
            cluster_ip: s.cluster_ip.as_deref().map(Addr::parse),
            cluster_ips: addrs(s.cluster_ips.as_ref()),
            ip_families: names(s.ip_families.as_ref()),
            external_ips: addrs(s.external_ips.as_ref()),
            ports: s
                .ports
                .iter()
                .flatten()
                .map(|p| ServicePort {
                    name: p.name.as_deref().map(name),
                    protocol: p.protocol.as_deref().map(name),
                    port: p.port,
                    node_port: p.node_port,
                })
                .collect(),
            affinity_client_ip: s.session_affinity.as_deref() == Some("ClientIP"),
            affinity_timeout: affinity
                .and_then(|c| c.client_ip.as_ref())
                .and_then(|c| c.timeout_seconds),
            internal_local: s.internal_traffic_policy.as_deref() == Some("Local"),
            external_local: s.external_traffic_policy.as_deref() == Some("Local"),
            load_balancer_source_ranges: s
                .load_balancer_source_ranges
                .iter()
                .flatten()
                .map(|r| r.as_str().into())
                .collect(),
            health_check_node_port: s.health_check_node_port,
        }
    }
}

/// An EndpointSlice, as lb reads it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EndpointSlice {
    pub metadata: Meta,
    /// Its `kubernetes.io/service-name` label.
    pub service: Option<Arc<str>>,
    /// It carries the `service.kubernetes.io/headless` label.
    pub headless: bool,
    pub address_type: Name,
    /// Shared with every slice that lists the same ports.
    pub ports: Arc<[SlicePort]>,
    pub endpoints: Box<[Endpoint]>,
    /// Its `endpoints.kubernetes.io/last-change-trigger-time` annotation.
    pub trigger_time: Option<Box<str>>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct SlicePort {
    pub name: Option<Name>,
    pub protocol: Option<Name>,
    pub port: Option<i32>,
}

/// One endpoint: its first address (the one kube-proxy uses; `None` without any), its
/// conditions as written (unset is `None`), its node and its topology hints.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Endpoint {
    pub addr: Option<Addr>,
    pub ready: Option<bool>,
    pub serving: Option<bool>,
    pub terminating: Option<bool>,
    pub node_name: Option<Name>,
    /// `None` without hints (the common case: one pointer instead of two lists).
    pub hints: Option<Box<Hints>>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Hints {
    pub for_zones: Box<[Name]>,
    pub for_nodes: Box<[Name]>,
}

impl From<&discovery::EndpointSlice> for EndpointSlice {
    fn from(s: &discovery::EndpointSlice) -> Self {
        let m = &s.metadata;
        let ports: Vec<SlicePort> = s
            .ports
            .iter()
            .flatten()
            .map(|p| SlicePort {
                name: p.name.as_deref().map(name),
                protocol: p.protocol.as_deref().map(name),
                port: p.port,
            })
            .collect();
        let ports = {
            let mut table = SLICE_PORTS.lock().unwrap_or_else(|e| e.into_inner());
            table.get(ports.as_slice(), |p| Arc::from(p))
        };
        Self {
            metadata: Meta::of(m),
            service: label(m, LABEL_SERVICE_NAME).map(|s| Arc::from(s.as_str())),
            headless: label(m, LABEL_HEADLESS).is_some(),
            address_type: name(&s.address_type),
            ports,
            endpoints: s.endpoints.iter().flatten().map(Endpoint::from).collect(),
            trigger_time: boxed(annotation(m, LAST_CHANGE_TRIGGER_TIME)),
        }
    }
}

impl From<&discovery::Endpoint> for Endpoint {
    fn from(e: &discovery::Endpoint) -> Self {
        let c = e.conditions.as_ref();
        let hints = e.hints.as_ref().and_then(|h| {
            let hints = Hints {
                for_zones: h
                    .for_zones
                    .iter()
                    .flatten()
                    .map(|z| name(&z.name))
                    .collect(),
                for_nodes: h
                    .for_nodes
                    .iter()
                    .flatten()
                    .map(|n| name(&n.name))
                    .collect(),
            };
            (!hints.for_zones.is_empty() || !hints.for_nodes.is_empty()).then(|| Box::new(hints))
        });
        Self {
            addr: e.addresses.first().map(|a| Addr::parse(a)),
            ready: c.and_then(|c| c.ready),
            serving: c.and_then(|c| c.serving),
            terminating: c.and_then(|c| c.terminating),
            node_name: e.node_name.as_deref().map(name),
            hints,
        }
    }
}

/// This node's Node object, as lb reads it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Node {
    pub metadata: Meta,
    /// Its `topology.kubernetes.io/zone` label.
    pub zone: Option<Name>,
    /// It has a deletion timestamp.
    pub deleting: bool,
    /// It carries the [`TAINT_TO_BE_DELETED`] taint.
    pub to_be_deleted: bool,
    /// `status.addresses` as (type, address).
    pub addresses: Box<[(Name, Box<str>)]>,
}

impl From<&v1::Node> for Node {
    fn from(n: &v1::Node) -> Self {
        let m = &n.metadata;
        Self {
            metadata: Meta::of(m),
            zone: label(m, LABEL_ZONE).map(|z| name(z)),
            deleting: m.deletion_timestamp.is_some(),
            to_be_deleted: n
                .spec
                .as_ref()
                .and_then(|s| s.taints.as_ref())
                .is_some_and(|t| t.iter().any(|t| t.key == TAINT_TO_BE_DELETED)),
            addresses: n
                .status
                .as_ref()
                .and_then(|s| s.addresses.as_ref())
                .into_iter()
                .flatten()
                .map(|a| (name(&a.type_), a.address.as_str().into()))
                .collect(),
        }
    }
}

/// The metadata every slim object has.
pub trait Object {
    fn meta(&self) -> &Meta;
}

macro_rules! object {
    ($($t:ty: $kind:literal $group:literal $version:literal $plural:literal),*) => {$(
        impl Object for $t {
            fn meta(&self) -> &Meta {
                &self.metadata
            }
        }

        /// What kube-rs' reflector store keys objects by, so it stores slim objects.
        impl kube::runtime::reflector::Lookup for $t {
            type DynamicType = ();
            fn kind(_: &()) -> std::borrow::Cow<'_, str> {
                $kind.into()
            }
            fn group(_: &()) -> std::borrow::Cow<'_, str> {
                $group.into()
            }
            fn version(_: &()) -> std::borrow::Cow<'_, str> {
                $version.into()
            }
            fn plural(_: &()) -> std::borrow::Cow<'_, str> {
                $plural.into()
            }
            fn name(&self) -> Option<std::borrow::Cow<'_, str>> {
                self.metadata.name.as_deref().map(Into::into)
            }
            fn namespace(&self) -> Option<std::borrow::Cow<'_, str>> {
                self.metadata.namespace.as_deref().map(Into::into)
            }
            fn resource_version(&self) -> Option<std::borrow::Cow<'_, str>> {
                self.metadata.resource_version.as_deref().map(Into::into)
            }
            fn uid(&self) -> Option<std::borrow::Cow<'_, str>> {
                None
            }
        }
    )*};
}

object!(
    Service: "Service" "" "v1" "services",
    EndpointSlice: "EndpointSlice" "discovery.k8s.io" "v1" "endpointslices",
    Node: "Node" "" "v1" "nodes"
);

/// Slim copies of `objects`.
pub fn slim<'a, K: 'a, T: From<&'a K>>(objects: impl IntoIterator<Item = &'a K>) -> Vec<T> {
    objects.into_iter().map(T::from).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interned_names_and_slice_ports_are_shared() {
        assert!(Arc::ptr_eq(&name("shop"), &name("shop")));
        let slice = |n: &str| -> EndpointSlice {
            serde_json::from_value::<discovery::EndpointSlice>(serde_json::json!({
                "metadata": {"name": n, "namespace": "shop"},
                "addressType": "IPv4",
                "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
                "endpoints": [{"addresses": ["198.18.0.1", "198.18.0.2"], "nodeName": "a"}],
            }))
            .map(|s| EndpointSlice::from(&s))
            .expect("slice")
        };
        let (a, b) = (slice("a"), slice("b"));
        assert!(Arc::ptr_eq(&a.ports, &b.ports));
        assert!(Arc::ptr_eq(
            a.metadata.namespace.as_ref().expect("namespace"),
            b.metadata.namespace.as_ref().expect("namespace")
        ));
        assert_eq!(
            a.endpoints[0].addr,
            Some(Addr::Ip("198.18.0.1".parse().expect("ip")))
        );
        assert_eq!(a.endpoints[0].hints, None);
    }

    #[test]
    fn a_bad_address_keeps_its_text_and_why() {
        let a = Addr::parse("010.1.1.1");
        assert_eq!(
            a.ip(),
            Err(("010.1.1.1", "an IPv4 octet with a leading zero"))
        );
        let mapped = Addr::parse("::ffff:198.18.0.1");
        assert_eq!(
            mapped.ip(),
            Err(("::ffff:198.18.0.1", "an IPv4-mapped IPv6 address"))
        );
        assert!(mapped.lenient().is_some_and(|ip| ip.is_ipv6()));
        assert!(Addr::parse("None").is_text("None"));
    }

    #[test]
    fn the_interner_forgets_values_nobody_holds() {
        let mut t: Interner<str> = Interner::new();
        for i in 0..5000 {
            drop(t.get(format!("ns-{i}").as_str(), |s| Arc::from(s)));
        }
        assert!(t.set.len() <= 2 * 1024 + 1, "{} entries kept", t.set.len());
        let kept = t.get("kept", |s| Arc::from(s));
        assert!(Arc::ptr_eq(&kept, &t.get("kept", |s| Arc::from(s))));
    }
}
