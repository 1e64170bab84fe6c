//! This node's facts, kube-proxy's flags of the same names: its IPs (`--node-ip`), the cluster
//! CIDRs that tell pod sources from others (`--cluster-cidr`, the local-traffic detector), the
//! service CIDRs (`--service-cidr`) and `--masquerade-all`. `lb run` and `lb trace` share the
//! flags (`NodeFactsArgs`); `NodeFacts` is what they resolve to, and `datapath_config` what the
//! datapath's `lb_config` and cluster-CIDR maps get.
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crate::kube::slim::Node;
use lb_common::{LbConfig, config_flags, nat};
use serde::Serialize;

/// An address range, `198.18.0.0/15` or `2001:db8::/32`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Cidr {
    pub addr: IpAddr,
    pub prefix: u8,
}

impl std::str::FromStr for Cidr {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (a, p) = s
            .split_once('/')
            .ok_or_else(|| format!("{s:?}: want ADDR/PREFIX"))?;
        let addr: IpAddr = a.parse().map_err(|e| format!("{s:?}: {e}"))?;
        let prefix: u8 = p.parse().map_err(|e| format!("{s:?}: {e}"))?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        if prefix > max {
            return Err(format!("{s:?}: prefix over {max}"));
        }
        Ok(Self { addr, prefix })
    }
}

impl std::fmt::Display for Cidr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

impl Serialize for Cidr {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl Cidr {
    /// The range holding just `addr` (/32 or /128).
    pub fn host(addr: IpAddr) -> Self {
        let prefix = if addr.is_ipv4() { 32 } else { 128 };
        Self { addr, prefix }
    }

    pub fn contains(&self, ip: &IpAddr) -> bool {
        let bits = |ip: &IpAddr| -> (u128, u32) {
            match ip {
                IpAddr::V4(a) => (u128::from(u32::from(*a)), 32),
                IpAddr::V6(a) => (u128::from(*a), 128),
            }
        };
        let ((net, width), (host, host_width)) = (bits(&self.addr), bits(ip));
        if width != host_width {
            return false;
        }
        let shift = width - u32::from(self.prefix);
        shift >= width || (net >> shift) == (host >> shift)
    }

    /// The network address: host bits cleared (what an LPM trie key holds).
    pub fn network(&self) -> IpAddr {
        match self.addr {
            IpAddr::V4(a) => {
                let mask = u32::MAX
                    .checked_shl(32 - u32::from(self.prefix))
                    .unwrap_or(0);
                Ipv4Addr::from(u32::from(a) & mask).into()
            }
            IpAddr::V6(a) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.prefix))
                    .unwrap_or(0);
                Ipv6Addr::from(u128::from(a) & mask).into()
            }
        }
    }
}

/// The node-fact flags of `lb run` and `lb trace`.
#[derive(Clone, Debug, Default, PartialEq, Eq, clap::Args)]
pub struct NodeFactsArgs {
    /// This node's IPs (repeatable, comma-separated); per family the first is the source
    /// masqueraded traffic gets [default: the Node object's InternalIP/ExternalIP addresses,
    /// else the host's first global unicast address per family].
    #[arg(long, value_delimiter = ',')]
    pub node_ip: Vec<IpAddr>,
    /// Pod CIDRs (repeatable, comma-separated): the local-traffic detector. Sources inside are
    /// pods; ClusterIP traffic from anywhere else is masqueraded. Without it (and without
    /// --masquerade-all) no ClusterIP traffic is masqueraded, as with kube-proxy.
    #[arg(long, value_delimiter = ',')]
    pub cluster_cidr: Vec<Cidr>,
    /// Service CIDRs (repeatable, comma-separated): on the tc path a packet to an address in
    /// one that is no ClusterIP is dropped (kube-proxy's `cluster-ips-check`); reported by
    /// `lb trace`.
    #[arg(long, value_delimiter = ',')]
    pub service_cidr: Vec<Cidr>,
    /// Masquerade all traffic to ClusterIPs.
    #[arg(long)]
    pub masquerade_all: bool,
    /// Do not answer ping: by default an ICMP/ICMPv6 echo request to a ClusterIP, external IP
    /// or LoadBalancer IP with a usable endpoint is answered by the tc/XDP datapath (rejected or
    /// dropped, as the address's other traffic, when it has none); with this flag echo requests
    /// pass untouched, as with kube-proxy.
    #[arg(long)]
    pub no_echo_reply: bool,
    /// The addresses NodePorts answer on: `primary` (the node IP of each family, the default)
    /// and/or CIDRs selecting host addresses (repeatable, comma-separated). Loopback addresses
    /// only when a CIDR covers them.
    #[arg(long, value_delimiter = ',')]
    pub nodeport_addresses: Vec<NodePortAddress>,
}

impl NodeFactsArgs {
    /// Whether any node fact was given on the command line.
    pub fn any(&self) -> bool {
        *self != Self::default()
    }
}

/// Where the node IPs came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum NodeIpSource {
    Flag,
    NodeObject,
    Host,
}

/// The facts the datapath works with.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct NodeFacts {
    pub node_ips: Vec<IpAddr>,
    pub node_ip_source: NodeIpSource,
    pub cluster_cidrs: Vec<Cidr>,
    pub service_cidrs: Vec<Cidr>,
    pub masquerade_all: bool,
    /// Echo requests to service addresses are answered (`--no-echo-reply` unset).
    pub echo_reply: bool,
    /// The addresses NodePorts answer on (`--nodeport-addresses` resolved).
    pub nodeport_addresses: Vec<IpAddr>,
}

impl NodeFacts {
    /// Resolves the flags: node IPs from `--node-ip`, else the Node object's addresses, else
    /// `host` (the host's addresses, asked for only when needed).
    pub fn resolve(
        args: &NodeFactsArgs,
        node: Option<&Node>,
        host: impl FnOnce() -> Vec<IpAddr>,
    ) -> Self {
        let from_node = node.map(node_object_ips).unwrap_or_default();
        let (node_ips, node_ip_source) = if !args.node_ip.is_empty() {
            (args.node_ip.clone(), NodeIpSource::Flag)
        } else if !from_node.is_empty() {
            (from_node, NodeIpSource::NodeObject)
        } else {
            (host(), NodeIpSource::Host)
        };
        let mut facts = Self {
            node_ips,
            node_ip_source,
            cluster_cidrs: args.cluster_cidr.clone(),
            service_cidrs: args.service_cidr.clone(),
            masquerade_all: args.masquerade_all,
            echo_reply: !args.no_echo_reply,
            nodeport_addresses: Vec::new(),
        };
        // The host's addresses are only listed when a CIDR asks for them.
        let cidrs = args
            .nodeport_addresses
            .iter()
            .any(|a| matches!(a, NodePortAddress::Cidr(_)));
        let host = if cidrs { host_addrs() } else { Vec::new() };
        facts.nodeport_addresses = nodeport_ips(&args.nodeport_addresses, &facts, &host);
        facts
    }

    /// The first node IP of each family: the masquerade sources.
    pub fn snat_ips(&self) -> (Option<Ipv4Addr>, Option<Ipv6Addr>) {
        let v4 = self.node_ips.iter().find_map(|ip| match ip {
            IpAddr::V4(a) => Some(*a),
            IpAddr::V6(_) => None,
        });
        let v6 = self.node_ips.iter().find_map(|ip| match ip {
            IpAddr::V6(a) => Some(*a),
            IpAddr::V4(_) => None,
        });
        (v4, v6)
    }

    /// The `lb_config` value.
    pub fn datapath_config(&self) -> LbConfig {
        let (v4, v6) = self.snat_ips();
        let mut flags = 0;
        if self.masquerade_all {
            flags |= config_flags::MASQUERADE_ALL;
        }
        if !self.echo_reply {
            flags |= config_flags::NO_ECHO_REPLY;
        }
        if self.cluster_cidrs.iter().any(|c| c.addr.is_ipv4()) {
            flags |= config_flags::CLUSTER_CIDR4;
        }
        if self.cluster_cidrs.iter().any(|c| c.addr.is_ipv6()) {
            flags |= config_flags::CLUSTER_CIDR6;
        }
        LbConfig {
            node_ip4: v4.map_or([0; 4], |a| a.octets()),
            node_ip6: v6.map_or([0; 16], |a| a.octets()),
            flags,
            nat_port_min: nat::PORT_MIN,
            nat_port_max: nat::PORT_MAX,
        }
    }
}

/// A Node object's InternalIP addresses, then its ExternalIP ones (kube-proxy's order), parsed;
/// unparsable ones are skipped.
pub fn node_object_ips(node: &Node) -> Vec<IpAddr> {
    ["InternalIP", "ExternalIP"]
        .iter()
        .flat_map(|kind| {
            node.addresses
                .iter()
                .filter(move |(type_, _)| &**type_ == *kind)
                .filter_map(|(_, address)| address.parse().ok())
        })
        .collect()
}

/// Go's `net.IP.IsGlobalUnicast`: not unspecified, loopback, link-local, multicast or the
/// IPv4 broadcast address.
pub fn is_global_unicast(ip: &IpAddr) -> bool {
    match ip {
        IpAddr::V4(a) => {
            !(a.is_unspecified()
                || a.is_loopback()
                || a.is_link_local()
                || a.is_multicast()
                || a.is_broadcast())
        }
        IpAddr::V6(a) => {
            !(a.is_unspecified()
                || a.is_loopback()
                || a.is_unicast_link_local()
                || a.is_multicast())
        }
    }
}

/// One of `--nodeport-addresses`: the node's primary IP of each family, or a range of the
/// host's addresses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodePortAddress {
    Primary,
    Cidr(Cidr),
}

impl std::str::FromStr for NodePortAddress {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s == "primary" {
            Ok(Self::Primary)
        } else {
            s.parse()
                .map(Self::Cidr)
                .map_err(|e| format!("{e} (--nodeport-addresses takes `primary` or CIDRs)"))
        }
    }
}

/// The addresses NodePorts answer on, kube-proxy's `--nodeport-addresses`: with `primary`
/// (or nothing) the first node IP of each family; with CIDRs every host address inside one
/// (loopback only if a CIDR covers it), each once, in `host` order.
pub fn nodeport_ips(
    want: &[NodePortAddress],
    facts: &NodeFacts,
    host: &[(String, IpAddr)],
) -> Vec<IpAddr> {
    let mut out: Vec<IpAddr> = Vec::new();
    let mut push = |ip: IpAddr| {
        if !out.contains(&ip) {
            out.push(ip);
        }
    };
    if want.is_empty() || want.contains(&NodePortAddress::Primary) {
        let (v4, v6) = facts.snat_ips();
        v4.map(IpAddr::V4)
            .into_iter()
            .chain(v6.map(IpAddr::V6))
            .for_each(&mut push);
    }
    for w in want {
        if let NodePortAddress::Cidr(c) = w {
            host.iter()
                .map(|(_, ip)| *ip)
                .filter(|ip| c.contains(ip))
                .for_each(&mut push);
        }
    }
    out
}

/// Every address of the host's interfaces, with the interface's name; empty if the interfaces
/// cannot be listed.
pub fn host_addrs() -> Vec<(String, IpAddr)> {
    let Ok(addrs) = nix::ifaddrs::getifaddrs() else {
        return Vec::new();
    };
    addrs
        .filter_map(|ifa| {
            let sa = ifa.address?;
            let ip = if let Some(v4) = sa.as_sockaddr_in() {
                IpAddr::V4(v4.ip())
            } else {
                IpAddr::V6(sa.as_sockaddr_in6()?.ip())
            };
            Some((ifa.interface_name, ip))
        })
        .collect()
}

/// The interfaces holding any of `ips` (`--devices`' default: those holding the node IPs),
/// each once, in `host` order.
pub fn devices_holding(ips: &[IpAddr], host: &[(String, IpAddr)]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for (name, ip) in host {
        if ips.contains(ip) && !out.contains(name) {
            out.push(name.clone());
        }
    }
    out
}

/// The host's first global unicast address of each family, in interface order; empty if the
/// interfaces cannot be listed.
pub fn host_ips() -> Vec<IpAddr> {
    let Ok(addrs) = nix::ifaddrs::getifaddrs() else {
        return Vec::new();
    };
    let all = addrs.filter_map(|ifa| {
        let sa = ifa.address?;
        if let Some(v4) = sa.as_sockaddr_in() {
            Some(IpAddr::V4(v4.ip()))
        } else {
            sa.as_sockaddr_in6().map(|v6| IpAddr::V6(v6.ip()))
        }
    });
    first_per_family(all.filter(is_global_unicast))
}

fn first_per_family(ips: impl Iterator<Item = IpAddr>) -> Vec<IpAddr> {
    let (mut v4, mut v6) = (None, None);
    for ip in ips {
        match ip {
            IpAddr::V4(_) if v4.is_none() => v4 = Some(ip),
            IpAddr::V6(_) if v6.is_none() => v6 = Some(ip),
            _ => {}
        }
    }
    v4.into_iter().chain(v6).collect()
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::{NodeAddress, NodeStatus};

    use super::*;

    fn node(addrs: &[(&str, &str)]) -> Node {
        Node::from(&k8s_openapi::api::core::v1::Node {
            status: Some(NodeStatus {
                addresses: Some(
                    addrs
                        .iter()
                        .map(|(t, a)| NodeAddress {
                            type_: (*t).into(),
                            address: (*a).into(),
                        })
                        .collect(),
                ),
                ..NodeStatus::default()
            }),
            ..Default::default()
        })
    }

    #[test]
    fn node_ips_come_from_flags_then_the_node_then_the_host() {
        let n = node(&[
            ("Hostname", "n1"),
            ("ExternalIP", "198.18.99.1"),
            ("InternalIP", "198.18.0.1"),
            ("InternalIP", "2001:db8::1"),
            ("InternalIP", "bogus"),
        ]);
        let host = || vec!["198.18.50.1".parse().unwrap()];
        let flags = NodeFactsArgs {
            node_ip: vec!["198.18.7.7".parse().unwrap()],
            ..NodeFactsArgs::default()
        };
        let f = NodeFacts::resolve(&flags, Some(&n), host);
        assert_eq!(
            (f.node_ips.clone(), f.node_ip_source),
            (vec!["198.18.7.7".parse().unwrap()], NodeIpSource::Flag)
        );
        let f = NodeFacts::resolve(&NodeFactsArgs::default(), Some(&n), host);
        let want: Vec<IpAddr> = ["198.18.0.1", "2001:db8::1", "198.18.99.1"]
            .iter()
            .map(|s| s.parse().unwrap())
            .collect();
        assert_eq!(
            (f.node_ips, f.node_ip_source),
            (want, NodeIpSource::NodeObject)
        );
        let f = NodeFacts::resolve(&NodeFactsArgs::default(), Some(&node(&[])), host);
        assert_eq!(f.node_ip_source, NodeIpSource::Host);
        assert_eq!(f.node_ips, host());
    }

    #[test]
    fn datapath_config_takes_the_first_ip_per_family_and_per_family_detectors() {
        let args = NodeFactsArgs {
            node_ip: ["2001:db8::5", "198.18.0.5", "198.18.0.6"]
                .iter()
                .map(|s| s.parse().unwrap())
                .collect(),
            cluster_cidr: vec!["198.18.16.0/20".parse().unwrap()],
            service_cidr: vec!["198.19.0.0/16".parse().unwrap()],
            masquerade_all: false,
            ..NodeFactsArgs::default()
        };
        let c = NodeFacts::resolve(&args, None, Vec::new).datapath_config();
        assert_eq!(c.node_ip4, [198, 18, 0, 5]);
        assert_eq!(
            c.node_ip6,
            "2001:db8::5".parse::<Ipv6Addr>().unwrap().octets()
        );
        assert_eq!(c.flags, config_flags::CLUSTER_CIDR4);
        assert_eq!(
            (c.nat_port_min, c.nat_port_max),
            (nat::PORT_MIN, nat::PORT_MAX)
        );
        let all = NodeFactsArgs {
            masquerade_all: true,
            no_echo_reply: true,
            cluster_cidr: vec!["2001:db8:1::/48".parse().unwrap()],
            ..NodeFactsArgs::default()
        };
        let c = NodeFacts::resolve(&all, None, Vec::new).datapath_config();
        assert_eq!(
            c.flags,
            config_flags::MASQUERADE_ALL
                | config_flags::CLUSTER_CIDR6
                | config_flags::NO_ECHO_REPLY
        );
        assert_eq!(
            (c.node_ip4, c.node_ip6),
            ([0; 4], [0; 16]),
            "no node IP: none"
        );
    }

    #[test]
    fn global_unicast_and_first_per_family() {
        let ips: Vec<IpAddr> = [
            "127.0.0.1",
            "169.254.1.1",
            "fe80::1",
            "::1",
            "198.18.10.1",
            "2001:db8::1",
            "198.18.11.1",
        ]
        .iter()
        .map(|s| s.parse().unwrap())
        .collect();
        let picked = first_per_family(ips.into_iter().filter(is_global_unicast));
        assert_eq!(
            picked,
            vec![
                "198.18.10.1".parse::<IpAddr>().unwrap(),
                "2001:db8::1".parse().unwrap()
            ]
        );
    }

    #[test]
    fn cidr_network_clears_host_bits() {
        let c: Cidr = "198.18.10.77/24".parse().unwrap();
        assert_eq!(c.network(), "198.18.10.0".parse::<IpAddr>().unwrap());
        let c: Cidr = "2001:db8:0:10::2/64".parse().unwrap();
        assert_eq!(c.network(), "2001:db8:0:10::".parse::<IpAddr>().unwrap());
        let c: Cidr = "0.0.0.0/0".parse().unwrap();
        assert!(c.contains(&"198.18.0.1".parse().unwrap()));
        assert_eq!(c.network(), "0.0.0.0".parse::<IpAddr>().unwrap());
    }

    #[test]
    fn nodeport_addresses_are_the_primary_ips_or_host_addresses_in_the_cidrs() {
        let args = NodeFactsArgs {
            node_ip: vec![
                "198.18.0.5".parse().unwrap(),
                "2001:db8::5".parse().unwrap(),
            ],
            ..NodeFactsArgs::default()
        };
        let facts = NodeFacts::resolve(&args, None, Vec::new);
        let host: Vec<(String, IpAddr)> = [
            ("lo", "127.0.0.1"),
            ("lo", "::1"),
            ("eth0", "198.18.0.5"),
            ("eth0", "2001:db8::5"),
            ("eth1", "198.18.7.1"),
        ]
        .iter()
        .map(|(n, a)| (n.to_string(), a.parse().unwrap()))
        .collect();
        let ips = |want: &[&str]| -> Vec<String> {
            let want: Vec<NodePortAddress> = want.iter().map(|w| w.parse().unwrap()).collect();
            nodeport_ips(&want, &facts, &host)
                .iter()
                .map(ToString::to_string)
                .collect()
        };
        // The default and `primary`: the node IPs, never loopback.
        assert_eq!(ips(&[]), ["198.18.0.5", "2001:db8::5"]);
        assert_eq!(ips(&["primary"]), ["198.18.0.5", "2001:db8::5"]);
        // CIDRs pick host addresses, loopback only when covered.
        assert_eq!(ips(&["198.18.7.0/24"]), ["198.18.7.1"]);
        assert_eq!(ips(&["127.0.0.0/8", "::1/128"]), ["127.0.0.1", "::1"]);
        assert_eq!(
            ips(&["primary", "198.18.0.0/15"]),
            ["198.18.0.5", "2001:db8::5", "198.18.7.1"]
        );
        assert!("bogus".parse::<NodePortAddress>().is_err());
        assert_eq!(devices_holding(&facts.node_ips, &host), ["eth0"]);
    }
}
