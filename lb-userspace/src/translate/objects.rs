//! What translation reads the same way off every object (its name, its labels, an address as
//! kube-proxy parses one), and how it reports an object, or a part of one, it refuses.
use std::{fmt, net::IpAddr};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

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
    /// ([`MAX_SLICE_ENDPOINTS`](super::MAX_SLICE_ENDPOINTS)).
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

/// The skipped parts of one object, appended to a translation's list in the order they are
/// found.
pub(crate) struct Skips<'a> {
    kind: &'static str,
    object: String,
    out: &'a mut Vec<Skipped>,
}

impl<'a> Skips<'a> {
    /// Reports parts of the object of `kind` named `meta` into `out`.
    pub(crate) fn new(kind: &'static str, meta: &ObjectMeta, out: &'a mut Vec<Skipped>) -> Self {
        Self {
            kind,
            object: object_name(meta),
            out,
        }
    }

    pub(crate) fn push(&mut self, reason: SkipReason, detail: String) {
        self.out.push(Skipped {
            kind: self.kind,
            object: self.object.clone(),
            reason,
            detail,
        });
    }

    /// How many entries the list holds so far (a frontend records where it was claimed).
    pub(crate) fn count(&self) -> usize {
        self.out.len()
    }
}

/// `namespace/name`, the namespace `default` when unset: how reports name objects.
pub(crate) fn object_name(meta: &ObjectMeta) -> String {
    format!(
        "{}/{}",
        meta.namespace.as_deref().unwrap_or("default"),
        meta.name.as_deref().unwrap_or("")
    )
}

pub(crate) fn has_label(meta: &ObjectMeta, key: &str) -> bool {
    meta.labels.as_ref().is_some_and(|l| l.contains_key(key))
}

/// Parses an address as Go's `netip.ParseAddr` (kube-proxy's parser) does: a leading zero in an
/// IPv4 octet (`010.1.1.1`, octal to some parsers), an IPv6 zone (`fe80::1%eth0`), a CIDR and
/// surrounding spaces are refused. IPv4-mapped IPv6 addresses (`::ffff:198.18.0.1`) are refused
/// too: their family is ambiguous, and lb never programs one address under two families.
pub(crate) fn parse_ip(s: &str) -> Result<IpAddr, &'static str> {
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
