//! Tests of the pure translation from Services and EndpointSlices to the desired datapath state
//! (`translate::desired_state`). Objects are written as YAML, as a user or the API server
//! would, and parsed with the manifest reader. Cases that are only "these objects render to
//! this state" are golden cases instead (tests/golden/, `cargo test --test golden`).
use std::{
    collections::BTreeSet,
    net::{IpAddr, Ipv4Addr},
    path::Path,
};

use lb::kube::slim::{EndpointSlice, Service};
use lb::{
    kube::manifests::{Objects, parse_into},
    model::{BackendState, Frontend, Proto, Scope, ServiceEntry},
    translate::{
        Ignored, NodeInfo, SkipReason, Skipped, Translation, desired_state, ignored, node_eligible,
    },
};
use lb_common::svc_flags;

/// Parses YAML documents into Services and EndpointSlices; the test input must be clean.
fn objects(yaml: &str) -> Objects {
    let mut objects = Objects::default();
    let mut problems = Vec::new();
    parse_into(Path::new("test.yaml"), yaml, &mut objects, &mut problems);
    assert!(
        problems.is_empty(),
        "test input does not parse: {problems:?}"
    );
    objects
}

/// Translation on a node that no endpoint names and that has no zone: the cluster-wide view.
fn anywhere(o: &Objects) -> Translation {
    desired_state(&o.services, &o.slices, &NodeInfo::default())
}

fn translate(yaml: &str) -> Translation {
    anywhere(&objects(yaml))
}

fn v4(s: &str) -> IpAddr {
    IpAddr::V4(s.parse::<Ipv4Addr>().expect("IPv4 literal"))
}

fn fe(addr: IpAddr, port: u16, proto: Proto) -> Frontend {
    Frontend::new(addr, port, proto)
}

/// The entry of a frontend, which must exist.
fn entry(t: &Translation, frontend: Frontend) -> &ServiceEntry {
    t.state.services.get(&frontend).unwrap_or_else(|| {
        panic!(
            "no frontend {frontend}; have {:?}",
            t.state
                .services
                .keys()
                .map(|f| f.to_string())
                .collect::<Vec<_>>()
        )
    })
}

/// A frontend's backends as `addr:port/PROTO` strings, sorted.
/// The backends new flows of `frontend` may use.
fn backends(t: &Translation, frontend: Frontend) -> BTreeSet<String> {
    backends_in(t, frontend, BackendState::Active)
}

fn backends_in(t: &Translation, frontend: Frontend, state: BackendState) -> BTreeSet<String> {
    entry(t, frontend)
        .backends
        .iter()
        .filter(|b| b.state == state)
        .map(|b| b.l4.to_string())
        .collect()
}

fn set(items: &[&str]) -> BTreeSet<String> {
    items.iter().map(|s| s.to_string()).collect()
}

fn frontends(t: &Translation) -> BTreeSet<String> {
    t.state.services.keys().map(|f| f.to_string()).collect()
}

/// A single-stack IPv4 ClusterIP service with one named TCP port.
fn service_yaml(ns: &str, name: &str, ip: &str, port_name: &str, port: u16) -> String {
    format!(
        "apiVersion: v1
kind: Service
metadata: {{name: {name}, namespace: {ns}}}
spec:
  clusterIP: {ip}
  ports:
    - {{name: {port_name}, protocol: TCP, port: {port}, targetPort: 1}}
"
    )
}

/// An IPv4 slice of `service` with one named TCP port and ready endpoints.
fn slice_yaml(
    ns: &str,
    slice: &str,
    service: &str,
    port_name: &str,
    port: u16,
    addrs: &[&str],
) -> String {
    let mut s = format!(
        "apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: {slice}
  namespace: {ns}
  labels: {{kubernetes.io/service-name: {service}}}
addressType: IPv4
ports:
  - {{name: {port_name}, protocol: TCP, port: {port}}}
endpoints:
"
    );
    for a in addrs {
        s.push_str(&format!("  - addresses: [\"{a}\"]\n"));
    }
    s
}

fn docs(parts: &[String]) -> String {
    parts.join("---\n")
}

#[test]
fn cluster_ip_with_tcp_and_udp_ports_uses_slice_port_numbers_by_name() {
    // The service's targetPorts (9999, 9998, a name) are deliberately not what the slice says:
    // the datapath must use the slice's numbers. The slice lists its ports in another order than
    // the service and has one extra port no service port names.
    let t = translate(
        "apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
spec:
  type: ClusterIP
  clusterIP: 198.19.0.10
  ports:
    - {name: http, protocol: TCP, port: 80, targetPort: 9999}
    - {name: dns, protocol: UDP, port: 53, targetPort: 9998}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-abcde
  namespace: shop
  labels: {kubernetes.io/service-name: web}
addressType: IPv4
ports:
  - {name: metrics, protocol: TCP, port: 9090}
  - {name: dns, protocol: UDP, port: 5353}
  - {name: http, protocol: TCP, port: 8080}
endpoints:
  - addresses: [198.18.0.1]
    conditions: {ready: true}
  - addresses: [198.18.0.2]
    conditions: {ready: true}
",
    );
    assert!(t.skipped.is_empty(), "{:?}", t.skipped);
    let http = fe(v4("198.19.0.10"), 80, Proto::Tcp);
    let dns = fe(v4("198.19.0.10"), 53, Proto::Udp);
    assert_eq!(
        frontends(&t),
        set(&["198.19.0.10:80/TCP", "198.19.0.10:53/UDP"]),
        "exactly one frontend per service port, none for the slice-only port"
    );
    assert_eq!(
        backends(&t, http),
        set(&["198.18.0.1:8080/TCP", "198.18.0.2:8080/TCP"])
    );
    assert_eq!(
        backends(&t, dns),
        set(&["198.18.0.1:5353/UDP", "198.18.0.2:5353/UDP"])
    );

    let http_entry = entry(&t, http);
    assert_eq!(&*http_entry.name.namespace, "shop");
    assert_eq!(&*http_entry.name.name, "web");
    assert_eq!(&*http_entry.name.port_name, "http");
    assert_eq!(http_entry.name.to_string(), "shop/web:http");
    assert_eq!(http_entry.flags, svc_flags::CLUSTER_IP);
    assert_eq!(http_entry.kind(), "ClusterIP");
    assert_eq!(&*entry(&t, dns).name.port_name, "dns");
    assert_eq!(entry(&t, dns).flags, svc_flags::CLUSTER_IP);
    for e in t.state.services.values() {
        assert!(
            e.backends.iter().all(|b| b.state == BackendState::Active),
            "ready endpoints are active backends: {e:?}"
        );
    }
    for f in t.state.services.keys() {
        assert_eq!(f.scope, Scope::External);
    }
}

#[test]
fn headless_external_name_and_other_proxy_services_produce_nothing_and_are_not_skipped() {
    let yaml = docs(&[
        "apiVersion: v1
kind: Service
metadata: {name: headless, namespace: ns}
spec:
  clusterIP: None
  clusterIPs: [None]
  ports:
    - {name: http, port: 80}
"
        .to_string(),
        slice_yaml(
            "ns",
            "headless-1",
            "headless",
            "http",
            8080,
            &["198.18.0.1"],
        ),
        "apiVersion: v1
kind: Service
metadata: {name: external, namespace: ns}
spec:
  type: ExternalName
  externalName: db.example.invalid
  ports:
    - {name: http, port: 80}
"
        .to_string(),
        "apiVersion: v1
kind: Service
metadata:
  name: other
  namespace: ns
  labels: {service.kubernetes.io/service-proxy-name: someone-else}
spec:
  clusterIP: 198.19.0.81
  ports:
    - {name: http, port: 80}
"
        .to_string(),
        slice_yaml("ns", "other-1", "other", "http", 8080, &["198.18.0.2"]),
        service_yaml("ns", "normal", "198.19.0.82", "http", 80),
        slice_yaml("ns", "normal-1", "normal", "http", 8080, &["198.18.0.3"]),
    ]);
    let o = objects(&yaml);
    let by_name = |n: &str| -> &Service {
        o.services
            .iter()
            .find(|s| s.metadata.name.as_deref() == Some(n))
            .expect("service in input")
    };
    assert_eq!(ignored(by_name("headless")), Some(Ignored::Headless));
    assert_eq!(ignored(by_name("external")), Some(Ignored::ExternalName));
    assert_eq!(ignored(by_name("other")), Some(Ignored::OtherProxy));
    assert_eq!(ignored(by_name("normal")), None);

    let t = anywhere(&o);
    assert!(t.skipped.is_empty(), "{:?}", t.skipped);
    assert_eq!(frontends(&t), set(&["198.19.0.82:80/TCP"]));
    assert_eq!(
        backends(&t, fe(v4("198.19.0.82"), 80, Proto::Tcp)),
        set(&["198.18.0.3:8080/TCP"])
    );
    assert!(
        t.state
            .services
            .values()
            .flat_map(|e| &e.backends)
            .all(|b| b.l4.addr == v4("198.18.0.3")),
        "no backend of an ignored service leaks into another: {:?}",
        t.state
    );
}

/// Good objects, and bad ones that must not change what the good ones produce.
const GOOD: &str = "apiVersion: v1
kind: Service
metadata: {name: web, namespace: ns}
spec:
  clusterIP: 198.19.1.1
  clusterIPs: [198.19.1.1, \"2001:db8:ffff::1:1\"]
  ports:
    - {name: http, protocol: TCP, port: 80}
    - {name: dns, protocol: UDP, port: 53}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-v4
  namespace: ns
  labels: {kubernetes.io/service-name: web}
addressType: IPv4
ports:
  - {name: http, protocol: TCP, port: 8080}
  - {name: dns, protocol: UDP, port: 5353}
endpoints:
  - addresses: [198.18.1.1]
  - addresses: [198.18.1.2]
    conditions: {ready: true}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-v6
  namespace: ns
  labels: {kubernetes.io/service-name: web}
addressType: IPv6
ports:
  - {name: http, protocol: TCP, port: 8080}
  - {name: dns, protocol: UDP, port: 5353}
endpoints:
  - addresses: [\"2001:db8:1::1\"]
---
apiVersion: v1
kind: Service
metadata: {name: db, namespace: other}
spec:
  clusterIP: 198.19.1.2
  ports:
    - {name: pg, protocol: TCP, port: 5432}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: db-1
  namespace: other
  labels: {kubernetes.io/service-name: db}
addressType: IPv4
ports:
  - {name: pg, protocol: TCP, port: 5432}
endpoints:
  - addresses: [198.18.2.1]
";

const BAD: &str = "apiVersion: v1
kind: Service
metadata: {name: bad-ip, namespace: ns}
spec:
  clusterIP: not-an-ip
  ports:
    - {name: http, port: 80}
---
apiVersion: v1
kind: Service
metadata: {name: bad-ports, namespace: ns}
spec:
  clusterIP: 198.19.1.3
  ports:
    - {name: a, port: 0}
    - {name: b, port: 70000}
    - {name: c, protocol: ICMP, port: 80}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: bad-addrs
  namespace: ns
  labels: {kubernetes.io/service-name: web}
addressType: IPv4
ports:
  - {name: http, protocol: TCP, port: 8080}
endpoints:
  - addresses: [garbage]
  - addresses: [\"2001:db8:1::99\"]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: no-label
  namespace: ns
addressType: IPv4
ports:
  - {name: http, protocol: TCP, port: 8080}
endpoints:
  - addresses: [198.18.1.99]
";

#[test]
fn bad_objects_do_not_change_what_good_objects_produce() {
    let good = translate(GOOD);
    assert!(good.skipped.is_empty(), "{:#?}", good.skipped);
    assert_eq!(good.state.services.len(), 5);

    let all = translate(&format!("{GOOD}---\n{BAD}"));
    assert_eq!(
        all.state, good.state,
        "the bad objects must leave the good state untouched"
    );
    let mut reasons: Vec<(&str, &str, SkipReason)> = all
        .skipped
        .iter()
        .map(|s| (s.kind, s.object.as_str(), s.reason))
        .collect();
    reasons.sort();
    let mut expected = vec![
        ("EndpointSlice", "ns/bad-addrs", SkipReason::InvalidIp),
        (
            "EndpointSlice",
            "ns/bad-addrs",
            SkipReason::AddressFamilyMismatch,
        ),
        (
            "EndpointSlice",
            "ns/no-label",
            SkipReason::MissingServiceLabel,
        ),
        ("Service", "ns/bad-ip", SkipReason::InvalidIp),
        ("Service", "ns/bad-ports", SkipReason::InvalidPort),
        ("Service", "ns/bad-ports", SkipReason::InvalidPort),
        ("Service", "ns/bad-ports", SkipReason::UnknownProtocol),
    ];
    expected.sort();
    assert_eq!(reasons, expected);
}

#[test]
fn result_does_not_depend_on_input_order() {
    let o = objects(&format!("{GOOD}---\n{BAD}"));
    let forward = anywhere(&o);
    let mut services: Vec<Service> = o.services.clone();
    let mut slices: Vec<EndpointSlice> = o.slices.clone();
    services.reverse();
    slices.reverse();
    let backward = desired_state(&services, &slices, &NodeInfo::default());
    assert_eq!(forward.state, backward.state);
    let mut a = forward.skipped.clone();
    let mut b = backward.skipped.clone();
    a.sort();
    b.sort();
    assert_eq!(a, b);
    // Backends come out in a stable order too (slot order is derived from it).
    for (f, e) in &forward.state.services {
        assert_eq!(e.backends, backward.state.services[f].backends, "{f}");
    }
}

#[test]
fn empty_input_gives_empty_state() {
    let t = desired_state::<Service, EndpointSlice>(&[], &[], &NodeInfo::default());
    assert!(t.state.services.is_empty());
    assert!(t.skipped.is_empty());
    assert_eq!(t.state.backend_count(), 0);
}

#[test]
fn the_example_manifests_translate_to_the_demo_state() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/examples");
    let (o, problems) = lb::kube::manifests::load_dir(&dir).expect("deploy/examples is readable");
    assert!(problems.is_empty(), "{problems:?}");
    let t = anywhere(&o);
    assert!(t.skipped.is_empty(), "{:?}", t.skipped);
    assert_eq!(t.state.services.len(), 4, "2 ports x 2 families");
    for (f, e) in &t.state.services {
        assert_eq!(e.backends.len(), 3, "{f}");
        assert_eq!(&*e.name.namespace, "demo");
        assert_eq!(&*e.name.name, "echo");
        for b in &e.backends {
            assert_eq!(b.l4.port, 8080, "{f}: {b:?}");
            assert_eq!(b.l4.proto, f.l4.proto);
            assert_eq!(b.l4.addr.is_ipv4(), f.l4.addr.is_ipv4());
        }
    }
}

#[test]
fn internal_traffic_policy_local_uses_this_nodes_endpoints_only() {
    let o = objects(
        "apiVersion: v1
kind: Service
metadata: {name: web, namespace: ns}
spec:
  clusterIP: 198.19.2.2
  internalTrafficPolicy: Local
  ports:
    - {name: http, port: 80}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-1
  namespace: ns
  labels: {kubernetes.io/service-name: web}
addressType: IPv4
ports:
  - {name: http, port: 8080}
endpoints:
  - addresses: [198.18.0.1]
    nodeName: node-a
  - addresses: [198.18.0.2]
    nodeName: node-b
  - addresses: [198.18.0.3]
",
    );
    let f = fe(v4("198.19.2.2"), 80, Proto::Tcp);
    let on = |name: &str| {
        desired_state(
            &o.services,
            &o.slices,
            &NodeInfo {
                name: name.into(),
                ..NodeInfo::default()
            },
        )
    };
    let a = on("node-a");
    assert!(a.skipped.is_empty(), "{:?}", a.skipped);
    assert_eq!(backends(&a, f), set(&["198.18.0.1:8080/TCP"]));
    assert_eq!(
        entry(&a, f).flags,
        svc_flags::CLUSTER_IP | svc_flags::INT_LOCAL
    );
    assert_eq!(backends(&on("node-b"), f), set(&["198.18.0.2:8080/TCP"]));
    // A node with no endpoint of its own keeps the frontend, with no backend (kube-proxy drops
    // the traffic rather than leaving the node).
    let c = on("node-c");
    assert!(entry(&c, f).backends.is_empty());
    assert!(anywhere(&o).state.services[&f].backends.is_empty());
}

#[test]
fn node_is_eligible_unless_being_deleted_or_tainted_for_deletion() {
    let node = |yaml: &str| -> lb::kube::slim::Node {
        lb_tests::FromJson::from_json(serde_yaml::from_str(yaml).expect("Node YAML"))
    };
    assert!(
        node_eligible(None),
        "no Node object yet: eligible, as kube-proxy starts"
    );
    assert!(node_eligible(Some(&node(
        "apiVersion: v1\nkind: Node\nmetadata: {name: n}\nspec:\n  taints: [{key: other, effect: NoSchedule}]\n"
    ))));
    assert!(!node_eligible(Some(&node(
        "apiVersion: v1\nkind: Node\nmetadata: {name: n}\nspec:\n  taints:\n    - {key: other, effect: NoSchedule}\n    - {key: ToBeDeletedByClusterAutoscaler, value: '1700000000', effect: NoSchedule}\n"
    ))));
    assert!(!node_eligible(Some(&node(
        "apiVersion: v1\nkind: Node\nmetadata: {name: n, deletionTimestamp: '2026-12-01T00:00:00Z', finalizers: [f]}\n"
    ))));
}

/// kube-proxy's `sync_proxy_rules_no_local_endpoints_total`: service ports with a Local policy
/// whose endpoints are all on other nodes, per policy and family; a service without any
/// endpoint is not counted (it rejects instead).
#[test]
fn service_ports_without_local_endpoints_are_counted_per_policy_and_family() {
    let t = translate(
        "apiVersion: v1
kind: Service
metadata: {name: internal, namespace: ns}
spec:
  clusterIP: 198.19.3.1
  internalTrafficPolicy: Local
  ports: [{name: a, port: 80}, {name: b, port: 81}]
---
apiVersion: v1
kind: Service
metadata: {name: external, namespace: ns}
spec:
  type: NodePort
  clusterIP: 2001:db8:ffff::3
  externalTrafficPolicy: Local
  ports: [{name: a, port: 80, nodePort: 30080}]
---
apiVersion: v1
kind: Service
metadata: {name: empty, namespace: ns}
spec:
  clusterIP: 198.19.3.2
  internalTrafficPolicy: Local
  ports: [{name: a, port: 80}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: internal-1, namespace: ns, labels: {kubernetes.io/service-name: internal}}
addressType: IPv4
ports: [{name: a, port: 8080}, {name: b, port: 8081}]
endpoints:
  - {addresses: [198.18.3.1], nodeName: elsewhere}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: external-1, namespace: ns, labels: {kubernetes.io/service-name: external}}
addressType: IPv6
ports: [{name: a, port: 8080}]
endpoints:
  - {addresses: [\"2001:db8::3:1\"], nodeName: elsewhere}
",
    );
    assert_eq!(t.no_local_endpoints.internal, [2, 0], "two IPv4 ports");
    assert_eq!(t.no_local_endpoints.external, [0, 1], "one IPv6 port");
}

/// `--lb-algorithm` (the node default) and the `lb.io/lb-algorithm` annotation choose every
/// frontend's algorithm, both scopes of a two-scope frontend alike; an unknown value is
/// reported with the object's name and the node default used, the Service still programmed.
#[test]
fn lb_algorithm_comes_from_the_annotation_then_the_node_default() {
    use lb::model::LbAlgorithm::{Maglev, Random};
    let svc = |name: &str, ip: &str, annotation: &str| {
        format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: t{annotation}}}\nspec:\n  type: LoadBalancer\n  externalTrafficPolicy: Local\n  clusterIP: {ip}\n  ports: [{{name: h, protocol: TCP, port: 80, targetPort: 8080}}]\nstatus: {{loadBalancer: {{ingress: [{{ip: 198.19.9.{}}}]}}}}\n",
            &ip[ip.len() - 1..]
        )
    };
    let o = objects(&docs(&[
        svc("plain", "198.19.8.1", ""),
        svc(
            "mag",
            "198.19.8.2",
            ", annotations: {lb.io/lb-algorithm: maglev}",
        ),
        svc(
            "rnd",
            "198.19.8.3",
            ", annotations: {lb.io/lb-algorithm: random}",
        ),
        svc(
            "bad",
            "198.19.8.4",
            ", annotations: {lb.io/lb-algorithm: Maglev}",
        ),
        slice_yaml("t", "plain-1", "plain", "h", 8080, &["198.18.8.1"]),
        slice_yaml("t", "mag-1", "mag", "h", 8080, &["198.18.8.2"]),
    ]));
    let on = |default| {
        let node = NodeInfo {
            lb_algorithm: default,
            ..NodeInfo::default()
        };
        desired_state(&o.services, &o.slices, &node)
    };
    for (default, want) in [
        (Random, [Random, Maglev, Random, Random]),
        (Maglev, [Maglev, Maglev, Random, Maglev]),
    ] {
        let t = on(default);
        for (i, name) in ["plain", "mag", "rnd", "bad"].iter().enumerate() {
            let of: Vec<_> = t
                .state
                .services
                .values()
                .filter(|e| &*e.name.name == *name)
                .collect();
            // The ClusterIP and the LB IP (with an internal scope where eTP=Local splits).
            assert!(of.len() >= 2, "{name}: {of:?}");
            for e in of {
                assert_eq!(e.algorithm, want[i], "{name} with default {default:?}");
            }
        }
        assert!(
            t.state
                .services
                .iter()
                .any(|(f, e)| &*e.name.name == "plain" && f.scope == Scope::Internal),
            "plain has an internal scope too"
        );
        let bad: Vec<&Skipped> = t
            .skipped
            .iter()
            .filter(|s| s.reason == SkipReason::InvalidAnnotation)
            .collect();
        assert_eq!(bad.len(), 1, "{:?}", t.skipped);
        assert_eq!(bad[0].object, "t/bad");
        assert!(
            bad[0].detail.contains("\"Maglev\"")
                && bad[0]
                    .detail
                    .contains(&format!("node default {}", default.as_str())),
            "{}",
            bad[0].detail
        );
    }
}
