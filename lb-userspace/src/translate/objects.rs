//! What translation reads the same way off every object (its name, its labels, an address as
//! kube-proxy parses one), and how it reports an object, or a part of one, it refuses.
use std::fmt;

use crate::kube::slim::Meta;

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
    pub(crate) fn new(kind: &'static str, meta: &Meta, out: &'a mut Vec<Skipped>) -> Self {
        Self {
            kind,
            object: meta.object_name(),
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
