//! Which of Kubernetes' `[sig-network]` specs `cargo xtask e2e` runs (Ginkgo focus and skip
//! expressions, Go RE2 syntax).

/// The conformance subset (`--conformance`, and the last phase of `cargo xtask test`): every
/// `[sig-network] … [Conformance]` spec of Services, EndpointSlice(Mirroring), Service
/// endpoints latency and DNS, plus kube-proxy's health and proxyMode URLs.
pub const CONFORMANCE_FOCUS: &str = r"\[sig-network\] (Services|EndpointSlice|EndpointSliceMirroring|Service endpoints latency|DNS) .*\[Conformance\]|\[sig-network\] Networking should check kube-proxy urls";

/// The default set: all of sig-network…
pub const DEFAULT_FOCUS: &str = r"\[sig-network\]";

/// …less these, each with why. Cilium's kube-proxy-replacement CI runs the same focus with
/// the skips `Alpha|Beta|Experimental|Federation|PerformanceDNS|Disruptive|Serial|KubeProxy|
/// kube-proxy|ExternalIP|LoadBalancer|GCE|Netpol|NetworkPolicy|rejected|externalTrafficPolicy`
/// (+ `DualStack|IPv6` on IPv4 clusters). lb is held to more: `rejected`,
/// `externalTrafficPolicy`, `ExternalIP`, `IPv6DualStack` (the cluster is dual-stack), the invalid-conntrack-state spec and the
/// internalTrafficPolicy=Local terminating-fallback spec run here.
pub const DEFAULT_SKIPS: &[(&str, &str)] = &[
    (
        r"\[Alpha\]|\[Beta\]|Experimental|Federation",
        "not GA, or not about this cluster (as in Cilium's list)",
    ),
    (r"\[Disruptive\]", "restarts or breaks components or nodes"),
    (
        r"\[Serial\]",
        "needs the cluster to itself; some change cluster-wide settings (DNS' ConfigMap, default IngressClass)",
    ),
    (
        r"NetworkPolicy|Netpol",
        "network policy is the CNI's job, not the service proxy's",
    ),
    (r"LoadBalancer", "needs a cloud provider's load balancers"),
    (r"GCE|\[Provider:", "cloud-provider specific"),
    (
        r"\[sig-network\] KubeProxy ",
        "kube-proxy's own nf_conntrack timeout and nfacct counter: lb does not use netfilter",
    ),
    (
        r"LocalhostNodePorts",
        "iptables-mode kube-proxy's localhost NodePorts (route_localnet); nftables mode has none either",
    ),
    (
        r"PerformanceDNS|Networking-Performance",
        "load tests, not behaviour",
    ),
    (
        r"Internet connection",
        "needs a route to the Internet; these netns have none",
    ),
    (
        r"SCTP",
        "this kernel has no SCTP (socket(…, IPPROTO_SCTP) fails)",
    ),
];

/// The default skip expression: [`DEFAULT_SKIPS`] joined.
pub fn default_skip() -> String {
    DEFAULT_SKIPS
        .iter()
        .map(|(re, _)| *re)
        .collect::<Vec<_>>()
        .join("|")
}

/// The specs the conformance subset skips: none. (Those needing more nodes than the cluster
/// has skip themselves at run time and show as skipped.)
pub const CONFORMANCE_SKIP: &str = "";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_skip_keeps_what_lb_must_pass() {
        let skip = default_skip();
        for kept in [
            "rejected",
            "externalTrafficPolicy",
            "ExternalIP",
            "invalid conntrack",
            "kube-proxy urls",
        ] {
            assert!(!skip.contains(kept), "{kept} must not be skipped: {skip}");
        }
        for (re, why) in DEFAULT_SKIPS {
            assert!(!re.is_empty() && !why.is_empty());
        }
    }
}
