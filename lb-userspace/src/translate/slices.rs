//! The one EndpointSlice index: per service port and IP family, the endpoints from all of the
//! service's slices, matched on the slice port's name and protocol, first address only,
//! deduplicated on `ip:port` (kube-proxy's `EndpointSliceCache`). Translation programs it; the
//! health check node ports (`metrics::healthcheck`) count its local ready endpoints.
use std::{
    borrow::Borrow,
    cmp::Ordering,
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use crate::{
    kube::{
        LABEL_SERVICE_NAME,
        slim::{self, EndpointSlice},
    },
    model::{Family, L4Addr, Proto},
    translate::objects::{SkipReason, Skipped, Skips},
};

/// The API server's cap on endpoints per EndpointSlice (`maxEndpoints` in its validation).
/// A bigger slice cannot come from a cluster; from a manifest it is refused as a whole.
pub const MAX_SLICE_ENDPOINTS: usize = 1000;

/// One endpoint of a service port, as kube-proxy's `BaseEndpointInfo` sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Endpoint {
    pub(crate) l4: L4Addr,
    /// `ready` true or unset.
    pub(crate) ready: bool,
    pub(super) serving: bool,
    pub(super) terminating: bool,
    /// On this node (`nodeName` is the node's name).
    pub(crate) local: bool,
    pub(super) zone_hints: BTreeSet<String>,
    pub(super) node_hints: BTreeSet<String>,
}

impl Endpoint {
    /// The endpoint `ep` of a slice at `l4` (one of the slice's ports), on node `node_name`:
    /// its conditions as kube-proxy defaults them (ready and serving unless false, terminating
    /// only if true) and its topology hints.
    fn new(ep: &slim::Endpoint, l4: L4Addr, node_name: &str) -> Self {
        let hints = ep.hints.as_deref();
        let set = |names: &[slim::Name]| names.iter().map(|n| n.to_string()).collect();
        Self {
            l4,
            ready: ep.ready.unwrap_or(true),
            serving: ep.serving.unwrap_or(true),
            terminating: ep.terminating.unwrap_or(false),
            local: !node_name.is_empty() && ep.node_name.as_deref() == Some(node_name),
            zone_hints: hints.map(|h| set(&h.for_zones)).unwrap_or_default(),
            node_hints: hints.map(|h| set(&h.for_nodes)).unwrap_or_default(),
        }
    }

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
/// slice's family, and which copy of an endpoint listed twice is kept ([`Endpoint::replaces`]);
/// endpoints whose `nodeName` is `node_name` are local.
/// Translation programs it; the health check node ports count its local ready endpoints.
/// What it refuses is reported in `skipped`.
pub(crate) fn index_slices<E: Borrow<EndpointSlice>>(
    slices: &[E],
    node_name: &str,
    skipped: &mut Vec<Skipped>,
) -> SliceIndex {
    let mut out = SliceIndex::new();
    let mut slices: Vec<&EndpointSlice> = slices.iter().map(Borrow::borrow).collect();
    // Deterministic precedence among duplicates: slice name order.
    slices.sort_by_key(|s| s.metadata.object_name());
    for slice in slices {
        if slice.headless {
            continue;
        }
        let mut skips = Skips::new("EndpointSlice", &slice.metadata, skipped);
        let Some((service, family)) = owner(slice, &mut skips) else {
            continue;
        };
        let endpoints = &slice.endpoints[..];
        if endpoints.len() > MAX_SLICE_ENDPOINTS {
            skips.push(
                SkipReason::TooManyEndpoints,
                format!(
                    "{} endpoints, more than the {MAX_SLICE_ENDPOINTS} the API server allows in one slice",
                    endpoints.len()
                ),
            );
            continue;
        }
        let ports = usable_ports(slice, &mut skips);
        let namespace = slice.metadata.namespace.as_deref().unwrap_or("default");
        let key = (namespace.to_string(), service.to_string());
        let by_port = &mut out.entry(key).or_default()[family.index()];
        for ep in endpoints {
            let Some(addr) = endpoint_addr(ep, slice, family, &mut skips) else {
                continue;
            };
            for (name, proto, port) in &ports {
                let l4 = L4Addr {
                    addr,
                    port: *port,
                    proto: *proto,
                };
                let entry = Endpoint::new(ep, l4, node_name);
                let set = by_port.entry((name.clone(), *proto)).or_default();
                if set.get(&l4).is_none_or(|old| entry.replaces(old)) {
                    set.insert(l4, entry);
                }
            }
        }
    }
    out
}

/// The service a slice belongs to (its `kubernetes.io/service-name` label) and the family of
/// its addresses; `None` for a slice that names no service, has an unknown address type, or
/// is an FQDN one (those are for DNS, not proxies).
fn owner<'s>(slice: &'s EndpointSlice, skips: &mut Skips) -> Option<(&'s str, Family)> {
    let Some(service) = slice.service.as_deref().filter(|s| !s.is_empty()) else {
        skips.push(
            SkipReason::MissingServiceLabel,
            format!("no {LABEL_SERVICE_NAME} label"),
        );
        return None;
    };
    let family = match &*slice.address_type {
        "IPv4" => Family::V4,
        "IPv6" => Family::V6,
        "FQDN" => return None,
        other => {
            skips.push(
                SkipReason::UnknownAddressType,
                format!("addressType {other:?}"),
            );
            return None;
        }
    };
    Some((service, family))
}

/// The slice's ports kube-proxy uses, as (name, protocol, number): it ignores ports without a
/// name (the controller writes "" for unnamed service ports) and without a number.
fn usable_ports(slice: &EndpointSlice, skips: &mut Skips) -> Vec<(String, Proto, u16)> {
    let mut ports = Vec::new();
    for p in slice.ports.iter() {
        let Some(name) = p.name.as_deref().map(String::from) else {
            skips.push(
                SkipReason::InvalidPort,
                "a port without a name (use \"\" for unnamed service ports)".into(),
            );
            continue;
        };
        let proto_name = p.protocol.as_deref().unwrap_or("TCP");
        let Some(proto) = Proto::from_k8s(proto_name) else {
            skips.push(
                SkipReason::UnknownProtocol,
                format!("port {name:?} protocol {proto_name:?}"),
            );
            continue;
        };
        match p.port {
            Some(n) if (1..=65535).contains(&n) => ports.push((name, proto, n as u16)),
            Some(n) => skips.push(SkipReason::InvalidPort, format!("port {name:?} number {n}")),
            None => skips.push(
                SkipReason::InvalidPort,
                format!("port {name:?} without a number"),
            ),
        }
    }
    ports
}

/// The address kube-proxy takes of an endpoint: its first (`None` without one), which must
/// parse and be of the slice's family.
fn endpoint_addr(
    ep: &slim::Endpoint,
    slice: &EndpointSlice,
    family: Family,
    skips: &mut Skips,
) -> Option<IpAddr> {
    let addr = match ep.addr.as_ref()?.ip() {
        Ok(a) => a,
        Err((first, why)) => {
            skips.push(
                SkipReason::InvalidIp,
                format!("endpoint address {first:?}: {why}"),
            );
            return None;
        }
    };
    if Family::of(&addr) != family {
        skips.push(
            SkipReason::AddressFamilyMismatch,
            format!("endpoint address {addr} in an {} slice", slice.address_type),
        );
        return None;
    }
    Some(addr)
}

/// The port names each service's EndpointSlices list, for `unmatched_port`.
pub(crate) type SlicePortNames = BTreeMap<(String, String), BTreeSet<String>>;

pub(crate) fn slice_port_names<E: Borrow<EndpointSlice>>(slices: &[E]) -> SlicePortNames {
    let mut out = SlicePortNames::new();
    for slice in slices.iter().map(Borrow::borrow) {
        let Some(service) = slice.service.as_deref() else {
            continue;
        };
        if slice.headless || &*slice.address_type == "FQDN" {
            continue;
        }
        let namespace = slice.metadata.namespace.as_deref().unwrap_or("default");
        let names = out
            .entry((namespace.to_string(), service.to_string()))
            .or_default();
        // Names of ports `index_slices` refused count too: those are reported there already.
        names.extend(
            slice
                .ports
                .iter()
                .filter_map(|p| p.name.as_deref().map(String::from)),
        );
    }
    out
}
