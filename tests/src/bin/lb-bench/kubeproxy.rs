//! kube-proxy's rule sets, rendered from the same Service and EndpointSlice objects lb
//! translates, so the iptables and nftables cases program exactly what kube-proxy would:
//!
//! - iptables mode (pkg/proxy/iptables/proxier.go): the `iptables-restore --noflush --counters`
//!   input of a full sync (filter + nat tables, `KUBE-SERVICES` → `KUBE-SVC-<hash>` with
//!   `-m statistic --mode random --probability` → `KUBE-SEP-<hash>` with DNAT, `KUBE-MARK-MASQ`
//!   and `KUBE-POSTROUTING`), the one-service partial sync, and the jump rules kube-proxy adds
//!   to the built-in chains (`PREROUTING`, `OUTPUT`, `POSTROUTING`, `INPUT`, `FORWARD`);
//! - nftables mode (pkg/proxy/nftables/proxier.go): table `ip kube-proxy` with the
//!   `service-ips` verdict map, per-service chains with `numgen random mod N vmap`, endpoint
//!   chains with `dnat`, and the partial-sync transaction of a one-endpoint change.
//!
//! Services reachable from outside (a `nodePort`, `externalIPs`) get kube-proxy's external
//! chains for `externalTrafficPolicy: Cluster`: iptables `KUBE-NODEPORTS` / `KUBE-SERVICES`
//! external-IP rules → `KUBE-EXT-<hash>` (`KUBE-MARK-MASQ`, then `KUBE-SVC-<hash>`); nftables
//! `service-nodeports` / `service-ips` elements → `external-<hash>` (`mark-for-masquerade`,
//! then `goto service-<hash>`).
//!
//! Chain names use kube-proxy's hashes (SHA-256, base32), checked against names from
//! kube-proxy's own tests. Only what services with ready endpoints and
//! `externalTrafficPolicy: Cluster` need is modelled.
use std::{
    borrow::Borrow,
    collections::BTreeMap,
    fmt::Write as _,
    net::{IpAddr, Ipv4Addr},
};

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};

/// The masquerade mark kube-proxy uses by default (`--iptables-masquerade-bit=14`).
const MASQ_MARK: &str = "0x4000";
/// Above this many endpoints kube-proxy's iptables mode drops per-rule comments.
const LARGE_CLUSTER_ENDPOINTS: usize = 1000;

/// What kube-proxy is configured with on the benchmark's node.
#[derive(Clone, Debug)]
pub struct Config {
    /// `--cluster-cidr`: pod traffic is not masqueraded.
    pub pod_cidr: String,
    /// The service CIDR (nftables drops traffic to unallocated ClusterIPs in it).
    pub service_cidr: String,
    /// The node's IP (nftables `nodeport-ips`).
    pub node_ip: Ipv4Addr,
}

/// One service port with its ready endpoints, in rule order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServicePort {
    pub namespace: String,
    pub name: String,
    pub port_name: String,
    /// `tcp` or `udp`.
    pub protocol: &'static str,
    pub cluster_ip: Ipv4Addr,
    pub port: u16,
    /// `ip:port` of each ready endpoint.
    pub endpoints: Vec<(Ipv4Addr, u16)>,
    /// The port's `nodePort` (NodePort and LoadBalancer services).
    pub node_port: Option<u16>,
    /// The service's `externalIPs` (IPv4).
    pub external_ips: Vec<Ipv4Addr>,
}

impl ServicePort {
    /// kube-proxy's `ServicePortName.String()`: `ns/name:port` (or `ns/name`).
    fn name_string(&self) -> String {
        if self.port_name.is_empty() {
            format!("{}/{}", self.namespace, self.name)
        } else {
            format!("{}/{}:{}", self.namespace, self.name, self.port_name)
        }
    }

    fn svc_chain(&self) -> String {
        let hash = base32_prefix(&sha256(
            format!("{}{}", self.name_string(), self.protocol).as_bytes(),
        ));
        format!("KUBE-SVC-{}", &hash[..16])
    }

    /// Reachable from outside the cluster: kube-proxy gives it an external chain.
    fn external(&self) -> bool {
        self.node_port.is_some() || !self.external_ips.is_empty()
    }

    fn ext_chain(&self) -> String {
        self.svc_chain().replacen("KUBE-SVC-", "KUBE-EXT-", 1)
    }

    fn sep_chain(&self, ep: (Ipv4Addr, u16)) -> String {
        let input = format!("{}{}{}:{}", self.name_string(), self.protocol, ep.0, ep.1);
        format!(
            "KUBE-SEP-{}",
            &base32_prefix(&sha256(input.as_bytes()))[..16]
        )
    }

    fn nft_base(&self) -> String {
        hash_and_truncate(&format!(
            "{}/{}/{}/{}",
            self.namespace, self.name, self.protocol, self.port_name
        ))
    }

    fn nft_service_chain(&self) -> String {
        format!("service-{}", self.nft_base())
    }

    fn nft_external_chain(&self) -> String {
        format!("external-{}", self.nft_base())
    }

    fn nft_endpoint_chain(&self, ep: (Ipv4Addr, u16)) -> String {
        let base = hash_and_truncate(&format!(
            "{}/{}/{}/{}__{}/{}",
            self.namespace, self.name, self.protocol, self.port_name, ep.0, ep.1
        ));
        format!("endpoint-{base}")
    }
}

/// The service ports of `services` (in the given order, which is the rule order) with the
/// ready IPv4 endpoints their slices list for each port, as kube-proxy matches them: slice port
/// name and protocol equal the service port's.
pub fn service_ports<S: Borrow<Service>, E: Borrow<EndpointSlice>>(
    services: &[S],
    slices: &[E],
) -> Vec<ServicePort> {
    // (namespace, service, port name, protocol) → endpoints, in slice order.
    type Key = (String, String, String, String);
    let mut by_port: BTreeMap<Key, Vec<(Ipv4Addr, u16)>> = BTreeMap::new();
    for slice in slices.iter().map(Borrow::borrow) {
        if slice.address_type != "IPv4" {
            continue;
        }
        let ns = slice.metadata.namespace.clone().unwrap_or_default();
        let Some(svc) = slice
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(lb::kube::LABEL_SERVICE_NAME))
        else {
            continue;
        };
        for p in slice.ports.iter().flatten() {
            let (Some(name), Some(port)) = (p.name.clone(), p.port) else {
                continue;
            };
            let proto = p.protocol.clone().unwrap_or_else(|| "TCP".into());
            let list = by_port
                .entry((ns.clone(), svc.clone(), name, proto))
                .or_default();
            for ep in slice.endpoints.iter().flatten() {
                let ready = ep.conditions.as_ref().and_then(|c| c.ready).unwrap_or(true);
                let Some(Ok(ip)) = ep.addresses.first().map(|a| a.parse::<Ipv4Addr>()) else {
                    continue;
                };
                if ready {
                    list.push((ip, u16::try_from(port).unwrap_or_default()));
                }
            }
        }
    }
    let mut out = Vec::new();
    for svc in services.iter().map(Borrow::borrow) {
        let ns = svc.metadata.namespace.clone().unwrap_or_default();
        let name = svc.metadata.name.clone().unwrap_or_default();
        let Some(spec) = &svc.spec else { continue };
        let Some(Ok(IpAddr::V4(cluster_ip))) = spec.cluster_ip.as_deref().map(str::parse) else {
            continue;
        };
        let external_ips: Vec<Ipv4Addr> = spec
            .external_ips
            .iter()
            .flatten()
            .filter_map(|a| a.parse().ok())
            .collect();
        let with_node_ports = matches!(spec.type_.as_deref(), Some("NodePort" | "LoadBalancer"));
        for p in spec.ports.iter().flatten() {
            let proto = p.protocol.clone().unwrap_or_else(|| "TCP".into());
            let port_name = p.name.clone().unwrap_or_default();
            let key = (ns.clone(), name.clone(), port_name.clone(), proto.clone());
            out.push(ServicePort {
                namespace: ns.clone(),
                name: name.clone(),
                port_name,
                protocol: if proto == "UDP" { "udp" } else { "tcp" },
                cluster_ip,
                port: u16::try_from(p.port).unwrap_or_default(),
                endpoints: by_port.get(&key).cloned().unwrap_or_default(),
                node_port: p
                    .node_port
                    .filter(|_| with_node_ports)
                    .and_then(|n| u16::try_from(n).ok())
                    .filter(|n| *n != 0),
                external_ips: external_ips.clone(),
            });
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// iptables

/// The rules kube-proxy adds once to the built-in chains (`iptablesJumpChains` and kubelet's
/// `KUBE-FIREWALL` jumps), as an `iptables-restore --noflush` input.
pub fn iptables_jumps() -> String {
    let new = "-m conntrack --ctstate NEW ";
    let mut s = String::from("*filter\n");
    for c in [
        "KUBE-EXTERNAL-SERVICES",
        "KUBE-NODEPORTS",
        "KUBE-SERVICES",
        "KUBE-FORWARD",
        "KUBE-PROXY-FIREWALL",
        "KUBE-FIREWALL",
    ] {
        let _ = writeln!(s, ":{c} - [0:0]");
    }
    let filter = [
        (
            "INPUT",
            new,
            "kubernetes externally-visible service portals",
            "KUBE-EXTERNAL-SERVICES",
        ),
        (
            "FORWARD",
            new,
            "kubernetes externally-visible service portals",
            "KUBE-EXTERNAL-SERVICES",
        ),
        (
            "INPUT",
            "",
            "kubernetes health check service ports",
            "KUBE-NODEPORTS",
        ),
        (
            "FORWARD",
            new,
            "kubernetes service portals",
            "KUBE-SERVICES",
        ),
        ("OUTPUT", new, "kubernetes service portals", "KUBE-SERVICES"),
        ("FORWARD", "", "kubernetes forwarding rules", "KUBE-FORWARD"),
        (
            "INPUT",
            new,
            "kubernetes load balancer firewall",
            "KUBE-PROXY-FIREWALL",
        ),
        (
            "OUTPUT",
            new,
            "kubernetes load balancer firewall",
            "KUBE-PROXY-FIREWALL",
        ),
        (
            "FORWARD",
            new,
            "kubernetes load balancer firewall",
            "KUBE-PROXY-FIREWALL",
        ),
    ];
    for (chain, extra, comment, target) in filter {
        let _ = writeln!(
            s,
            "-A {chain} {extra}-m comment --comment \"{comment}\" -j {target}"
        );
    }
    s.push_str("-A INPUT -j KUBE-FIREWALL\n-A OUTPUT -j KUBE-FIREWALL\nCOMMIT\n*nat\n");
    for c in ["KUBE-SERVICES", "KUBE-POSTROUTING"] {
        let _ = writeln!(s, ":{c} - [0:0]");
    }
    for (chain, comment, target) in [
        ("OUTPUT", "kubernetes service portals", "KUBE-SERVICES"),
        ("PREROUTING", "kubernetes service portals", "KUBE-SERVICES"),
        (
            "POSTROUTING",
            "kubernetes postrouting rules",
            "KUBE-POSTROUTING",
        ),
    ] {
        let _ = writeln!(
            s,
            "-A {chain} -m comment --comment \"{comment}\" -j {target}"
        );
    }
    s.push_str("COMMIT\n");
    s
}

/// Counts of what a rendered iptables input holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RuleCount {
    pub chains: usize,
    pub rules: usize,
}

pub fn count_iptables(text: &str) -> RuleCount {
    let mut c = RuleCount::default();
    for line in text.lines() {
        if line.starts_with(':') {
            c.chains += 1;
        } else if line.starts_with("-A ") {
            c.rules += 1;
        }
    }
    c
}

/// The `iptables-restore --noflush --counters` input of a kube-proxy sync. With `only`, a
/// partial sync that rewrites the top-level chains (all of `KUBE-SERVICES`) and only the
/// chains of the service ports at those indices, as kube-proxy ≥ 1.28 does after a change.
pub fn iptables_restore(ports: &[ServicePort], cfg: &Config, only: Option<&[usize]>) -> String {
    let total_endpoints: usize = ports.iter().map(|p| p.endpoints.len()).sum();
    let large = total_endpoints > LARGE_CLUSTER_ENDPOINTS;
    let mut out = String::with_capacity(ports.len() * 400 + total_endpoints * 300);
    out.push_str("*filter\n");
    for c in [
        "KUBE-SERVICES",
        "KUBE-EXTERNAL-SERVICES",
        "KUBE-FORWARD",
        "KUBE-NODEPORTS",
        "KUBE-PROXY-FIREWALL",
        "KUBE-FIREWALL",
    ] {
        let _ = writeln!(out, ":{c} - [0:0]");
    }
    let _ = writeln!(
        out,
        "-A KUBE-FIREWALL -m comment --comment \"block incoming localnet connections\" \
         -d 127.0.0.0/8 ! -s 127.0.0.0/8 -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP"
    );
    let _ = writeln!(
        out,
        "-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP"
    );
    let _ = writeln!(
        out,
        "-A KUBE-FORWARD -m comment --comment \"kubernetes forwarding rules\" \
         -m mark --mark {MASQ_MARK}/{MASQ_MARK} -j ACCEPT"
    );
    let _ = writeln!(
        out,
        "-A KUBE-FORWARD -m comment --comment \"kubernetes forwarding conntrack rule\" \
         -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT"
    );
    out.push_str("COMMIT\n*nat\n");

    let mut chains = String::new();
    let mut rules = String::new();
    for c in [
        "KUBE-SERVICES",
        "KUBE-NODEPORTS",
        "KUBE-POSTROUTING",
        "KUBE-MARK-MASQ",
    ] {
        let _ = writeln!(chains, ":{c} - [0:0]");
    }
    let _ = writeln!(
        rules,
        "-A KUBE-POSTROUTING -m mark ! --mark {MASQ_MARK}/{MASQ_MARK} -j RETURN"
    );
    let _ = writeln!(rules, "-A KUBE-POSTROUTING -j MARK --xor-mark {MASQ_MARK}");
    let _ = writeln!(
        rules,
        "-A KUBE-POSTROUTING -m comment --comment \"kubernetes service traffic requiring SNAT\" \
         -j MASQUERADE --random-fully"
    );
    let _ = writeln!(rules, "-A KUBE-MARK-MASQ -j MARK --or-mark {MASQ_MARK}");
    for (i, sp) in ports.iter().enumerate() {
        if sp.endpoints.is_empty() {
            // kube-proxy REJECTs these in the filter table; the benchmark has none.
            continue;
        }
        let name = sp.name_string();
        let svc = sp.svc_chain();
        let proto = sp.protocol;
        let matcher = format!(
            "-m comment --comment \"{name} cluster IP\" -m {proto} -p {proto} -d {} --dport {}",
            sp.cluster_ip, sp.port
        );
        let _ = writeln!(rules, "-A KUBE-SERVICES {matcher} -j {svc}");
        let ext = sp.ext_chain();
        for eip in &sp.external_ips {
            let _ = writeln!(
                rules,
                "-A KUBE-SERVICES -m comment --comment \"{name} external IP\" -m {proto} \
                 -p {proto} -d {eip} --dport {} -j {ext}",
                sp.port
            );
        }
        if let Some(np) = sp.node_port {
            let _ = writeln!(
                rules,
                "-A KUBE-NODEPORTS -m comment --comment {name} -m {proto} -p {proto} \
                 --dport {np} -j {ext}"
            );
        }
        if only.is_some_and(|o| !o.contains(&i)) {
            continue;
        }
        if sp.external() {
            // externalTrafficPolicy: Cluster: the backend may be on another node, so
            // external traffic is always masqueraded.
            let _ = writeln!(chains, ":{ext} - [0:0]");
            let _ = writeln!(
                rules,
                "-A {ext} -m comment --comment \"masquerade traffic for {name} external \
                 destinations\" -j KUBE-MARK-MASQ"
            );
            let _ = writeln!(rules, "-A {ext} -j {svc}");
        }
        let _ = writeln!(chains, ":{svc} - [0:0]");
        let _ = writeln!(
            rules,
            "-A {svc} {matcher} ! -s {} -j KUBE-MARK-MASQ",
            cfg.pod_cidr
        );
        let n = sp.endpoints.len();
        for (k, ep) in sp.endpoints.iter().enumerate() {
            let _ = write!(rules, "-A {svc} ");
            if !large {
                let _ = write!(
                    rules,
                    "-m comment --comment \"{name} -> {}:{}\" ",
                    ep.0, ep.1
                );
            }
            if k + 1 < n {
                let p = 1.0 / (n - k) as f64;
                let _ = write!(rules, "-m statistic --mode random --probability {p:.10} ");
            }
            let _ = writeln!(rules, "-j {}", sp.sep_chain(*ep));
        }
        for ep in &sp.endpoints {
            let sep = sp.sep_chain(*ep);
            let _ = writeln!(chains, ":{sep} - [0:0]");
            let comment = if large {
                String::new()
            } else {
                format!("-m comment --comment {name} ")
            };
            let _ = writeln!(rules, "-A {sep} {comment}-s {} -j KUBE-MARK-MASQ", ep.0);
            let _ = writeln!(
                rules,
                "-A {sep} {comment}-m {proto} -p {proto} -j DNAT --to-destination {}:{}",
                ep.0, ep.1
            );
        }
    }
    let _ = writeln!(
        rules,
        "-A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports; NOTE: this must \
         be the last rule in this chain\" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS"
    );
    out.push_str(&chains);
    out.push_str(&rules);
    out.push_str("COMMIT\n");
    out
}

// ---------------------------------------------------------------------------------------------
// nftables

const NFT_TABLE: &str = "ip kube-proxy";

/// kube-proxy nftables mode's full-sync transaction into an empty table (`nft -f`).
pub fn nft_full(ports: &[ServicePort], cfg: &Config) -> String {
    let t = NFT_TABLE;
    let mut s = String::with_capacity(ports.len() * 600);
    let _ = writeln!(s, "add table {t} {{ comment \"rules for kube-proxy\" ; }}");
    let _ = writeln!(
        s,
        "add set {t} cluster-ips {{ type ipv4_addr ; comment \"Active ClusterIPs\" ; }}"
    );
    let _ = writeln!(
        s,
        "add set {t} nodeport-ips {{ type ipv4_addr ; comment \"IPs that accept NodePort traffic\" ; }}"
    );
    for (name, ty, comment) in [
        (
            "firewall-ips",
            "ipv4_addr . inet_proto . inet_service",
            "destinations that are subject to LoadBalancerSourceRanges",
        ),
        (
            "no-endpoint-nodeports",
            "inet_proto . inet_service",
            "vmap to drop or reject packets to service nodeports with no endpoints",
        ),
        (
            "no-endpoint-services",
            "ipv4_addr . inet_proto . inet_service",
            "vmap to drop or reject packets to services with no endpoints",
        ),
        (
            "service-ips",
            "ipv4_addr . inet_proto . inet_service",
            "ClusterIP, ExternalIP and LoadBalancer IP traffic",
        ),
        (
            "service-nodeports",
            "inet_proto . inet_service",
            "NodePort traffic",
        ),
    ] {
        let _ = writeln!(
            s,
            "add map {t} {name} {{ type {ty} : verdict ; comment \"{comment}\" ; }}"
        );
    }
    for (name, hook) in [
        ("cluster-ips-check", ""),
        (
            "filter-prerouting-pre-dnat",
            "type filter hook prerouting priority -110",
        ),
        (
            "filter-output-pre-dnat",
            "type filter hook output priority -110",
        ),
        ("filter-forward", "type filter hook forward priority 0"),
        ("filter-input", "type filter hook input priority 0"),
        ("filter-output", "type filter hook output priority 0"),
        ("firewall-check", ""),
        ("mark-for-masquerade", ""),
        ("masquerading", ""),
        ("nat-output", "type nat hook output priority -100"),
        ("nat-postrouting", "type nat hook postrouting priority 100"),
        ("nat-prerouting", "type nat hook prerouting priority -100"),
        ("nodeport-endpoints-check", ""),
        ("reject-chain", ""),
        ("services", ""),
        ("service-endpoints-check", ""),
    ] {
        if hook.is_empty() {
            let _ = writeln!(s, "add chain {t} {name}");
        } else {
            let _ = writeln!(s, "add chain {t} {name} {{ {hook} ; }}");
        }
    }
    let rules = [
        ("cluster-ips-check", "ip daddr @cluster-ips reject comment \"Reject traffic to invalid ports of ClusterIPs\"".to_owned()),
        ("cluster-ips-check", format!("ip daddr {{ {} }} drop comment \"Drop traffic to unallocated ClusterIPs\"", cfg.service_cidr)),
        ("filter-prerouting-pre-dnat", "ct state new jump firewall-check".into()),
        ("filter-forward", "ct state new jump service-endpoints-check".into()),
        ("filter-forward", "ct state new jump cluster-ips-check".into()),
        ("filter-input", "ct state new jump nodeport-endpoints-check".into()),
        ("filter-input", "ct state new jump service-endpoints-check".into()),
        ("filter-output", "ct state new jump service-endpoints-check".into()),
        ("filter-output-pre-dnat", "ct state new jump firewall-check".into()),
        ("filter-output", "ct state new jump cluster-ips-check".into()),
        ("firewall-check", "ip daddr . meta l4proto . th dport vmap @firewall-ips".into()),
        ("mark-for-masquerade", format!("mark set mark or {MASQ_MARK}")),
        ("masquerading", format!("mark and {MASQ_MARK} == 0 return")),
        ("masquerading", format!("mark set mark xor {MASQ_MARK}")),
        ("masquerading", "masquerade fully-random".into()),
        ("nat-output", "jump services".into()),
        ("nat-postrouting", "jump masquerading".into()),
        ("nat-prerouting", "jump services".into()),
        ("nodeport-endpoints-check", "ip daddr @nodeport-ips meta l4proto . th dport vmap @no-endpoint-nodeports".into()),
        ("reject-chain", "reject".into()),
        ("services", "ip daddr . meta l4proto . th dport vmap @service-ips".into()),
        ("services", "ip daddr @nodeport-ips meta l4proto . th dport vmap @service-nodeports".into()),
        ("service-endpoints-check", "ip daddr . meta l4proto . th dport vmap @no-endpoint-services".into()),
    ];
    for (chain, rule) in rules {
        let _ = writeln!(s, "add rule {t} {chain} {rule}");
    }
    let _ = writeln!(s, "add element {t} nodeport-ips {{ {} }}", cfg.node_ip);
    for sp in ports {
        nft_service(&mut s, sp, cfg);
    }
    s
}

/// The chains, rules and map elements of one service port.
fn nft_service(s: &mut String, sp: &ServicePort, cfg: &Config) {
    nft_service_chains(s, sp, cfg, false);
    if !sp.endpoints.is_empty() {
        let t = NFT_TABLE;
        let _ = writeln!(s, "add element {t} cluster-ips {{ {} }}", sp.cluster_ip);
        let _ = writeln!(
            s,
            "add element {t} service-ips {{ {} . {} . {} : goto {} }}",
            sp.cluster_ip,
            sp.protocol,
            sp.port,
            sp.nft_service_chain()
        );
        let ext = sp.nft_external_chain();
        for eip in &sp.external_ips {
            let _ = writeln!(
                s,
                "add element {t} service-ips {{ {eip} . {} . {} : goto {ext} }}",
                sp.protocol, sp.port
            );
        }
        if let Some(np) = sp.node_port {
            let _ = writeln!(
                s,
                "add element {t} service-nodeports {{ {} . {np} : goto {ext} }}",
                sp.protocol
            );
        }
    }
}

/// The chains and rules of one service port; `flush` adds kube-proxy's `flush chain` after
/// each `add chain` (a partial sync of a changed service).
fn nft_service_chains(s: &mut String, sp: &ServicePort, cfg: &Config, flush: bool) {
    if sp.endpoints.is_empty() {
        return;
    }
    let t = NFT_TABLE;
    let svc = sp.nft_service_chain();
    let _ = writeln!(s, "add chain {t} {svc}");
    if flush {
        let _ = writeln!(s, "flush chain {t} {svc}");
    }
    if sp.external() {
        // externalTrafficPolicy: Cluster: masquerade, then the cluster-wide endpoints.
        let ext = sp.nft_external_chain();
        let _ = writeln!(s, "add chain {t} {ext}");
        if flush {
            let _ = writeln!(s, "flush chain {t} {ext}");
        }
        let _ = writeln!(
            s,
            "add rule {t} {ext} jump mark-for-masquerade comment \"masquerade traffic for {} \
             external destinations\"",
            sp.name_string()
        );
        let _ = writeln!(s, "add rule {t} {ext} goto {svc}");
    }
    for ep in &sp.endpoints {
        let chain = sp.nft_endpoint_chain(*ep);
        let _ = writeln!(s, "add chain {t} {chain}");
        if flush {
            let _ = writeln!(s, "flush chain {t} {chain}");
        }
    }
    let _ = writeln!(
        s,
        "add rule {t} {svc} ip daddr {} {} dport {} ip saddr != {} jump mark-for-masquerade",
        sp.cluster_ip, sp.protocol, sp.port, cfg.pod_cidr
    );
    let vmap: Vec<String> = sp
        .endpoints
        .iter()
        .enumerate()
        .map(|(i, ep)| format!("{i} : goto {}", sp.nft_endpoint_chain(*ep)))
        .collect();
    let _ = writeln!(
        s,
        "add rule {t} {svc} numgen random mod {} vmap {{ {} }}",
        sp.endpoints.len(),
        vmap.join(" , ")
    );
    for ep in &sp.endpoints {
        let chain = sp.nft_endpoint_chain(*ep);
        let _ = writeln!(
            s,
            "add rule {t} {chain} ip saddr {} jump mark-for-masquerade",
            ep.0
        );
        let _ = writeln!(
            s,
            "add rule {t} {chain} meta l4proto {} dnat to {}:{}",
            sp.protocol, ep.0, ep.1
        );
    }
}

/// kube-proxy nftables mode's partial-sync transaction after `new` replaced `old` (same
/// service port, one endpoint changed): the service's chains are re-added and flushed and
/// their rules rewritten; endpoint chains no longer used are flushed (and deleted a second
/// later, in another transaction, which is not part of the change's latency).
pub fn nft_change(old: &ServicePort, new: &ServicePort, cfg: &Config) -> String {
    let mut s = String::new();
    nft_service_chains(&mut s, new, cfg, true);
    for ep in &old.endpoints {
        if !new.endpoints.contains(ep) {
            let _ = writeln!(s, "flush chain {NFT_TABLE} {}", old.nft_endpoint_chain(*ep));
        }
    }
    s
}

// ---------------------------------------------------------------------------------------------
// Hashes

/// kube-proxy nftables' `hashAndTruncate`: 8 base32 characters of SHA-256, `-`, the name.
fn hash_and_truncate(name: &str) -> String {
    let hash = base32_prefix(&sha256(name.as_bytes()));
    let mut out = format!("{}-{name}", &hash[..8]);
    // chainNameBaseLengthMax = 256 - 16; the benchmark's names are far shorter.
    out.truncate(240);
    out
}

/// RFC 4648 base32 (standard alphabet) of `data`, without padding.
fn base32_prefix(data: &[u8]) -> String {
    const ALPHABET: &[u8; 32] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";
    let mut out = String::new();
    let (mut buf, mut bits) = (0u32, 0u32);
    for &b in data {
        buf = (buf << 8) | u32::from(b);
        bits += 8;
        while bits >= 5 {
            bits -= 5;
            out.push(char::from(ALPHABET[((buf >> bits) & 31) as usize]));
        }
        buf &= (1 << bits) - 1;
    }
    if bits > 0 {
        out.push(char::from(ALPHABET[((buf << (5 - bits)) & 31) as usize]));
    }
    out
}

/// SHA-256 (FIPS 180-4).
fn sha256(data: &[u8]) -> [u8; 32] {
    const K: [u32; 64] = [
        0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
        0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
        0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
        0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
        0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
        0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
        0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
        0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
        0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
        0xc67178f2,
    ];
    let mut h: [u32; 8] = [
        0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab,
        0x5be0cd19,
    ];
    let mut msg = data.to_vec();
    let bit_len = (data.len() as u64).wrapping_mul(8);
    msg.push(0x80);
    while msg.len() % 64 != 56 {
        msg.push(0);
    }
    msg.extend_from_slice(&bit_len.to_be_bytes());
    for block in msg.chunks_exact(64) {
        let mut w = [0u32; 64];
        for (i, word) in block.chunks_exact(4).enumerate() {
            w[i] = u32::from_be_bytes([word[0], word[1], word[2], word[3]]);
        }
        for i in 16..64 {
            let s0 = w[i - 15].rotate_right(7) ^ w[i - 15].rotate_right(18) ^ (w[i - 15] >> 3);
            let s1 = w[i - 2].rotate_right(17) ^ w[i - 2].rotate_right(19) ^ (w[i - 2] >> 10);
            w[i] = w[i - 16]
                .wrapping_add(s0)
                .wrapping_add(w[i - 7])
                .wrapping_add(s1);
        }
        let mut v = h;
        for i in 0..64 {
            let s1 = v[4].rotate_right(6) ^ v[4].rotate_right(11) ^ v[4].rotate_right(25);
            let ch = (v[4] & v[5]) ^ (!v[4] & v[6]);
            let t1 = v[7]
                .wrapping_add(s1)
                .wrapping_add(ch)
                .wrapping_add(K[i])
                .wrapping_add(w[i]);
            let s0 = v[0].rotate_right(2) ^ v[0].rotate_right(13) ^ v[0].rotate_right(22);
            let maj = (v[0] & v[1]) ^ (v[0] & v[2]) ^ (v[1] & v[2]);
            let t2 = s0.wrapping_add(maj);
            v = [
                t1.wrapping_add(t2),
                v[0],
                v[1],
                v[2],
                v[3].wrapping_add(t1),
                v[4],
                v[5],
                v[6],
            ];
        }
        for (hi, vi) in h.iter_mut().zip(v) {
            *hi = hi.wrapping_add(vi);
        }
    }
    let mut out = [0u8; 32];
    for (chunk, word) in out.chunks_exact_mut(4).zip(h) {
        chunk.copy_from_slice(&word.to_be_bytes());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn port(eps: &[(&str, u16)]) -> ServicePort {
        ServicePort {
            namespace: "ns1".into(),
            name: "svc1".into(),
            port_name: "p80".into(),
            protocol: "tcp",
            cluster_ip: Ipv4Addr::new(172, 30, 0, 41),
            port: 80,
            endpoints: eps
                .iter()
                .map(|(ip, p)| (ip.parse().unwrap(), *p))
                .collect(),
            node_port: None,
            external_ips: Vec::new(),
        }
    }

    #[test]
    fn sha256_known_answers() {
        let hex = |d: [u8; 32]| d.iter().map(|b| format!("{b:02x}")).collect::<String>();
        assert_eq!(
            hex(sha256(b"")),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        assert_eq!(
            hex(sha256(b"abc")),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(base32_prefix(b"foobar"), "MZXW6YTBOI");
    }

    /// Chain names from kube-proxy's own tests (pkg/proxy/{iptables,nftables}/proxier_test.go).
    #[test]
    fn chain_names_match_kube_proxy() {
        let sp = port(&[("10.180.0.1", 80)]);
        assert_eq!(sp.svc_chain(), "KUBE-SVC-XPGD46QRK7WJZT7O");
        assert_eq!(sp.sep_chain(sp.endpoints[0]), "KUBE-SEP-SXIVWICOYRO3J4NJ");
        assert_eq!(sp.nft_service_chain(), "service-ULMVA6XW-ns1/svc1/tcp/p80");
        assert_eq!(
            sp.nft_endpoint_chain(sp.endpoints[0]),
            "endpoint-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80"
        );
    }

    #[test]
    fn iptables_layout() {
        let cfg = Config {
            pod_cidr: "10.0.0.0/8".into(),
            service_cidr: "172.30.0.0/16".into(),
            node_ip: Ipv4Addr::new(192, 168, 0, 2),
        };
        let text = iptables_restore(
            &[port(&[("10.180.0.1", 80), ("10.180.0.2", 80)])],
            &cfg,
            None,
        );
        assert!(text.contains(
            "-A KUBE-SERVICES -m comment --comment \"ns1/svc1:p80 cluster IP\" -m tcp -p tcp \
             -d 172.30.0.41 --dport 80 -j KUBE-SVC-XPGD46QRK7WJZT7O\n"
        ));
        assert!(text.contains(
            "-A KUBE-SVC-XPGD46QRK7WJZT7O -m comment --comment \"ns1/svc1:p80 -> 10.180.0.1:80\" \
             -m statistic --mode random --probability 0.5000000000 -j KUBE-SEP-SXIVWICOYRO3J4NJ\n"
        ));
        assert!(text.contains(
            "-A KUBE-SEP-SXIVWICOYRO3J4NJ -m comment --comment ns1/svc1:p80 -m tcp -p tcp \
             -j DNAT --to-destination 10.180.0.1:80\n"
        ));
        assert_eq!(
            count_iptables(&text),
            RuleCount {
                chains: 13,
                rules: 17
            }
        );
        let nft = nft_full(&[port(&[("10.180.0.1", 80)])], &cfg);
        assert!(nft.contains(
            "add rule ip kube-proxy service-ULMVA6XW-ns1/svc1/tcp/p80 numgen random mod 1 vmap \
             { 0 : goto endpoint-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80 }\n"
        ));
        assert!(nft.contains(
            "add element ip kube-proxy service-ips { 172.30.0.41 . tcp . 80 : goto \
             service-ULMVA6XW-ns1/svc1/tcp/p80 }\n"
        ));
    }

    #[test]
    fn external_layout() {
        let cfg = Config {
            pod_cidr: "10.0.0.0/8".into(),
            service_cidr: "172.30.0.0/16".into(),
            node_ip: Ipv4Addr::new(192, 168, 0, 2),
        };
        let mut sp = port(&[("10.180.0.1", 80)]);
        sp.node_port = Some(30_080);
        sp.external_ips = vec![Ipv4Addr::new(192, 168, 0, 9)];
        let text = iptables_restore(std::slice::from_ref(&sp), &cfg, None);
        for rule in [
            "-A KUBE-NODEPORTS -m comment --comment ns1/svc1:p80 -m tcp -p tcp --dport 30080 \
             -j KUBE-EXT-XPGD46QRK7WJZT7O\n",
            "-A KUBE-SERVICES -m comment --comment \"ns1/svc1:p80 external IP\" -m tcp -p tcp \
             -d 192.168.0.9 --dport 80 -j KUBE-EXT-XPGD46QRK7WJZT7O\n",
            "-A KUBE-EXT-XPGD46QRK7WJZT7O -m comment --comment \"masquerade traffic for \
             ns1/svc1:p80 external destinations\" -j KUBE-MARK-MASQ\n",
            "-A KUBE-EXT-XPGD46QRK7WJZT7O -j KUBE-SVC-XPGD46QRK7WJZT7O\n",
        ] {
            assert!(text.contains(rule), "{rule}");
        }
        let nft = nft_full(&[sp], &cfg);
        for line in [
            "add element ip kube-proxy service-nodeports { tcp . 30080 : goto \
             external-ULMVA6XW-ns1/svc1/tcp/p80 }\n",
            "add element ip kube-proxy service-ips { 192.168.0.9 . tcp . 80 : goto \
             external-ULMVA6XW-ns1/svc1/tcp/p80 }\n",
            "add rule ip kube-proxy external-ULMVA6XW-ns1/svc1/tcp/p80 goto \
             service-ULMVA6XW-ns1/svc1/tcp/p80\n",
        ] {
            assert!(nft.contains(line), "{line}");
        }
    }
}
