//! The pure function from Kubernetes objects to the desired datapath state.
//!
//! It follows kube-proxy: a frontend per (cluster IP, service port); its backends are the
//! first address of each ready endpoint in the service's EndpointSlices of the same address
//! family, on the slice port whose name matches the service port's name. Bad objects are
//! skipped, each with one reason, and never stop the rest from applying.
use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    net::IpAddr,
};

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use lb_common::svc_flags;

use crate::model::{Backend, DesiredState, Frontend, L4Addr, Proto, ServiceEntry, ServicePortName};

/// Label naming the service an EndpointSlice belongs to.
pub const LABEL_SERVICE_NAME: &str = "kubernetes.io/service-name";
/// Services with this label belong to another proxy (kube-proxy skips them too).
pub const LABEL_SERVICE_PROXY_NAME: &str = "service.kubernetes.io/service-proxy-name";

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
}

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
}

fn object_name(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> String {
    format!(
        "{}/{}",
        meta.namespace.as_deref().unwrap_or("default"),
        meta.name.as_deref().unwrap_or("")
    )
}

/// Whether lb leaves this service alone, and why.
pub fn ignored(svc: &Service) -> Option<Ignored> {
    if svc
        .metadata
        .labels
        .as_ref()
        .is_some_and(|l| l.contains_key(LABEL_SERVICE_PROXY_NAME))
    {
        return Some(Ignored::OtherProxy);
    }
    let spec = svc.spec.as_ref()?;
    if spec.type_.as_deref() == Some("ExternalName") {
        return Some(Ignored::ExternalName);
    }
    match spec.cluster_ip.as_deref() {
        None | Some("") | Some("None") => Some(Ignored::Headless),
        _ => None,
    }
}

/// A ready endpoint's address and port per slice port name, for one service and family.
#[derive(Default)]
struct SliceIndex {
    /// (port name, protocol) → backends.
    by_port: BTreeMap<(String, Proto), BTreeSet<L4Addr>>,
}

fn index_slices<'a>(
    slices: impl Iterator<Item = &'a EndpointSlice>,
    skipped: &mut Vec<Skipped>,
) -> BTreeMap<(String, String), [SliceIndex; 2]> {
    let mut out: BTreeMap<(String, String), [SliceIndex; 2]> = BTreeMap::new();
    for slice in slices {
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
        else {
            skipped.push(skip(
                SkipReason::MissingServiceLabel,
                format!("no {LABEL_SERVICE_NAME} label"),
            ));
            continue;
        };
        let family = match slice.address_type.as_str() {
            "IPv4" => 0,
            "IPv6" => 1,
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
        let namespace = slice
            .metadata
            .namespace
            .clone()
            .unwrap_or_else(|| "default".into());
        let mut ports = Vec::new();
        for p in slice.ports.iter().flatten() {
            let name = p.name.clone().unwrap_or_default();
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
                // A port without a number means "all ports"; kube-proxy ignores it too.
                None => {}
            }
        }
        let idx = &mut out.entry((namespace, service.clone())).or_default()[family];
        for ep in slice.endpoints.iter().flatten() {
            // kube-proxy: only the first address counts; nil `ready` means ready.
            if ep.conditions.as_ref().and_then(|c| c.ready) == Some(false) {
                continue;
            }
            let Some(first) = ep.addresses.first() else {
                continue;
            };
            let addr: IpAddr = match first.parse() {
                Ok(a) => a,
                Err(_) => {
                    skipped.push(skip(
                        SkipReason::InvalidIp,
                        format!("endpoint address {first:?}"),
                    ));
                    continue;
                }
            };
            if (family == 0) != addr.is_ipv4() {
                skipped.push(skip(
                    SkipReason::AddressFamilyMismatch,
                    format!("endpoint address {addr} in an {} slice", slice.address_type),
                ));
                continue;
            }
            for (name, proto, port) in &ports {
                idx.by_port
                    .entry((name.clone(), *proto))
                    .or_default()
                    .insert(L4Addr {
                        addr,
                        port: *port,
                        proto: *proto,
                    });
            }
        }
    }
    out
}

/// Translates Services and EndpointSlices into the datapath state lb should program.
pub fn desired_state(services: &[Service], slices: &[EndpointSlice]) -> Translation {
    let mut skipped = Vec::new();
    let index = index_slices(slices.iter(), &mut skipped);
    let empty = [SliceIndex::default(), SliceIndex::default()];
    let mut state = DesiredState::default();

    let mut services: Vec<&Service> = services.iter().collect();
    services.sort_by_key(|s| object_name(&s.metadata));
    for svc in services {
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
            continue;
        };
        if ignored(svc).is_some() {
            continue;
        }
        let Some(spec) = svc.spec.as_ref() else {
            continue;
        };
        let namespace = svc
            .metadata
            .namespace
            .clone()
            .unwrap_or_else(|| "default".into());
        let ip_strings: Vec<&str> = match &spec.cluster_ips {
            Some(ips) if !ips.is_empty() => ips.iter().map(String::as_str).collect(),
            _ => spec.cluster_ip.as_deref().into_iter().collect(),
        };
        let mut ips = Vec::new();
        for s in ip_strings {
            match s.parse::<IpAddr>() {
                Ok(ip) => ips.push(ip),
                Err(_) => skipped.push(skip(SkipReason::InvalidIp, format!("clusterIP {s:?}"))),
            }
        }
        let slices = index
            .get(&(namespace.clone(), name.clone()))
            .unwrap_or(&empty);
        for port in spec.ports.iter().flatten() {
            let port_name = port.name.clone().unwrap_or_default();
            let proto_name = port.protocol.as_deref().unwrap_or("TCP");
            let Some(proto) = Proto::from_k8s(proto_name) else {
                skipped.push(skip(
                    SkipReason::UnknownProtocol,
                    format!("port {port_name:?} protocol {proto_name:?}"),
                ));
                continue;
            };
            if !(1..=65535).contains(&port.port) {
                skipped.push(skip(
                    SkipReason::InvalidPort,
                    format!("port {port_name:?} number {}", port.port),
                ));
                continue;
            }
            for ip in &ips {
                let family = usize::from(ip.is_ipv6());
                let backends = slices[family]
                    .by_port
                    .get(&(port_name.clone(), proto))
                    .map(|set| set.iter().copied().map(Backend::active).collect())
                    .unwrap_or_default();
                state.services.insert(
                    Frontend::new(*ip, port.port as u16, proto),
                    ServiceEntry {
                        name: ServicePortName {
                            namespace: namespace.clone(),
                            name: name.clone(),
                            port_name: port_name.clone(),
                        },
                        flags: svc_flags::CLUSTER_IP,
                        backends,
                    },
                );
            }
        }
    }
    Translation { state, skipped }
}
