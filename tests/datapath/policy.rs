//! Traffic policy: source ranges, and local-only endpoints (external and internal).

use crate::common::*;

/// kube-proxy's DROPs on the external path, in XDP and tc alike: a LoadBalancer IP's
/// `loadBalancerSourceRanges` (other sources dropped, sources inside served), and an eTP=Local
/// NodePort whose endpoints are all on other nodes (dropped, not rejected).
#[test]
fn source_ranges_and_no_local_endpoint_drop_on_xdp_and_tc() {
    let mut fx = fixture();
    let lb_ip = IpAddr::from(Ipv4Addr::new(198, 19, 1, 42));
    let node_ip = IpAddr::from(Ipv4Addr::new(198, 18, 10, 1));
    let b4: Vec<IpAddr> = BACKENDS4.iter().map(|a| (*a).into()).collect();
    let (fe, mut ranged) = service(lb_ip, Proto::Tcp, &b4);
    ranged.flags = svc_flags::LOAD_BALANCER | svc_flags::SOURCE_RANGES;
    ranged.source_ranges = ["198.18.99.0/24", "198.19.1.42/32"]
        .iter()
        .map(|c| c.parse().unwrap())
        .collect();
    let (np, mut elsewhere) = service_ports(node_ip, 30_080, Proto::Tcp, &[], BPORT);
    elsewhere.flags =
        svc_flags::NODE_PORT | svc_flags::EXT_LOCAL | svc_flags::EMPTY_DROP | svc_flags::LOCAL_ADDR;
    let mut desired = fx.desired.clone();
    desired.services.insert(fe, ranged);
    desired.services.insert(np, elsewhere);
    let report = fx._reconciler.apply(&desired);
    assert!(report.errors.is_empty(), "{:?}", report.errors);

    for hook in [Ext::Xdp, Ext::Tc] {
        let drop = match hook {
            Ext::Xdp => XDP_DROP,
            Ext::Tc => TC_ACT_SHOT,
        };
        let before = fx.counter(metrics::TC_DROP_SOURCE_RANGE);
        let syn = packet(CLIENT4.into(), 41_000, lb_ip, VPORT, L4::TcpSyn);
        assert_eq!(
            fx.external(hook, &syn).0,
            drop,
            "{hook:?}: outside the ranges"
        );
        assert_eq!(fx.counter(metrics::TC_DROP_SOURCE_RANGE), before + 1);
        let inside = IpAddr::from(Ipv4Addr::new(198, 18, 99, 5));
        let (verdict, out) = fx.external(hook, &packet(inside, 41_000, lb_ip, VPORT, L4::TcpSyn));
        assert_eq!(verdict, hook.pass(), "{hook:?}: inside the ranges");
        assert!(b4.contains(&parse_and_verify(&out).dst), "{hook:?}: DNAT");

        let before = fx.counter(metrics::TC_DROP_NO_LOCAL_BACKEND);
        let syn = packet(CLIENT4.into(), 41_001, node_ip, 30_080, L4::TcpSyn);
        assert_eq!(
            fx.external(hook, &syn).0,
            drop,
            "{hook:?}: no local endpoint"
        );
        assert_eq!(fx.counter(metrics::TC_DROP_NO_LOCAL_BACKEND), before + 1);
    }
}

/// kube-proxy's DROP for `internalTrafficPolicy: Local` with endpoints only on other nodes,
/// from manifests through the translator into the maps: in-cluster traffic to the ClusterIP
/// (the pod hook) is dropped, counted `tc_drop_no_local_backend`; a service with no endpoints
/// at all is still rejected. IPv4 and IPv6, TCP and UDP.
#[test]
fn internal_local_with_endpoints_elsewhere_drops_and_without_endpoints_rejects() {
    use lb::{
        kube::manifests::{self, Objects},
        translate::{NodeInfo, desired_state},
    };
    let yaml = r#"
apiVersion: v1
kind: Service
metadata: {name: elsewhere, namespace: t}
spec:
  ipFamilyPolicy: PreferDualStack
  clusterIP: 198.19.4.3
  clusterIPs: [198.19.4.3, "2001:db8:ffff::4:3"]
  internalTrafficPolicy: Local
  ports: [{name: t, protocol: TCP, port: 80}, {name: u, protocol: UDP, port: 80}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: elsewhere-4, namespace: t, labels: {kubernetes.io/service-name: elsewhere}}
addressType: IPv4
ports: [{name: t, protocol: TCP, port: 8080}, {name: u, protocol: UDP, port: 8080}]
endpoints: [{addresses: [198.18.8.21], nodeName: node-b}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: elsewhere-6, namespace: t, labels: {kubernetes.io/service-name: elsewhere}}
addressType: IPv6
ports: [{name: t, protocol: TCP, port: 8080}, {name: u, protocol: UDP, port: 8080}]
endpoints: [{addresses: ["2001:db8:8::21"], nodeName: node-b}]
---
apiVersion: v1
kind: Service
metadata: {name: none, namespace: t}
spec:
  ipFamilyPolicy: PreferDualStack
  clusterIP: 198.19.4.4
  clusterIPs: [198.19.4.4, "2001:db8:ffff::4:4"]
  internalTrafficPolicy: Local
  ports: [{name: t, protocol: TCP, port: 80}, {name: u, protocol: UDP, port: 80}]
"#;
    let mut objects = Objects::default();
    let mut problems = Vec::new();
    manifests::parse_into(
        std::path::Path::new("itp.yaml"),
        yaml,
        &mut objects,
        &mut problems,
    );
    assert!(problems.is_empty(), "{problems:?}");
    let t = desired_state(
        &objects.services,
        &objects.slices,
        &NodeInfo::from_node("node-a", None),
    );
    let mut fx = fixture();
    let report = fx._reconciler.apply(&t.state);
    assert!(report.errors.is_empty(), "{:?}", report.errors);

    for (client, elsewhere, none) in [
        (
            IpAddr::from(CLIENT4),
            IpAddr::from(Ipv4Addr::new(198, 19, 4, 3)),
            IpAddr::from(Ipv4Addr::new(198, 19, 4, 4)),
        ),
        (
            CLIENT6.into(),
            "2001:db8:ffff::4:3".parse().unwrap(),
            "2001:db8:ffff::4:4".parse().unwrap(),
        ),
    ] {
        for l4 in [L4::TcpSyn, L4::Udp] {
            let before = fx.counter(metrics::TC_DROP_NO_LOCAL_BACKEND);
            let pkt = packet(client, 42_000, elsewhere, VPORT, l4);
            let (verdict, _) = fx.run(prog_names::TC_POD, &pkt);
            assert_eq!(verdict, TC_ACT_SHOT, "{elsewhere}: dropped");
            assert_eq!(fx.counter(metrics::TC_DROP_NO_LOCAL_BACKEND), before + 1);

            let before = fx.counter(metrics::TC_REJECT_NO_BACKEND);
            let pkt = packet(client, 42_000, none, VPORT, l4);
            let (verdict, reply) = fx.run(prog_names::TC_POD, &pkt);
            assert_eq!(verdict, TC_ACT_REDIRECT, "{none}: rejected");
            let r = parse_and_verify(&reply);
            assert_eq!((r.src, r.dst), (none, client), "{none}: the reply");
            let reply_proto = match (l4, client) {
                (L4::TcpSyn, _) => 6,
                (_, IpAddr::V4(_)) => 1,
                (_, IpAddr::V6(_)) => 58,
            };
            assert_eq!(r.proto, reply_proto, "{none}: RST or port unreachable");
            assert_eq!(fx.counter(metrics::TC_REJECT_NO_BACKEND), before + 1);
        }
    }
}
