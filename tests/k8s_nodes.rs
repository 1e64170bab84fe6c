//! A small cluster on one machine: two `lb run` daemons, `node-a` (zone-a) and `node-b`
//! (zone-b), each in a testbed of its own (node netns, pin dir, state dir, cgroup), against one
//! real control plane (tests/src/controlplane.rs), each reaching it through a relay on its own
//! node's loopback. Real connections from a client in each node's testbed show which
//! endpoints each node's lb chose for Services with node-local traffic policies and with
//! topology hints written by the real EndpointSlice controller. Needs root.
//!
//! ```text
//!   zone-a: node-a (lb, 2 CPUs)  pod p1      node-c (no lb, 2 CPUs)  pod p2
//!   zone-b: node-b (lb, 4 CPUs)  pods p3, p4
//! ```
//!
//! The pod network: pod `p<i>` has address `198.18.(10+i).2`, the address of backend `b<i>`
//! in every testbed, and each testbed runs an echo server `b<i>` at each of the four
//! addresses. So a node's lb can forward to any pod of the cluster, as over a real pod network,
//! and the echo server's name tells which pod (endpoint address) lb chose.
//!
//! Node `node-c` (zone-a, no lb) makes a zone differ from a node: with topology hints node-a
//! reaches p1 and p2, with `internalTrafficPolicy: Local` only p1.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::SocketAddr,
    path::Path,
    process::Command,
    time::{Duration, Instant},
};

use lb_tests::{
    bins::{LB, LB_ECHO},
    controlplane::ControlPlane,
    daemon::LbDaemon,
    relay::Relay,
    testbed::Testbed,
};
use serde_json::{Value, json};

const NS: &str = "demo";
/// Generous: the controller batches, and the machine may be busy.
const WAIT: Duration = Duration::from_secs(90);
/// Requests per check: with 4 equally likely backends, missing one in 60 random picks has a
/// probability of about 1e-7.
const REQUESTS: usize = 60;

/// (pod, node, zone, node CPUs); pod `p<i>` is at backend `b<i>`'s address.
const PODS: [(&str, &str); 4] = [
    ("p1", "node-a"),
    ("p2", "node-c"),
    ("p3", "node-b"),
    ("p4", "node-b"),
];
const NODES: [(&str, &str, &str); 3] = [
    ("node-a", "zone-a", "2"),
    ("node-b", "zone-b", "4"),
    ("node-c", "zone-a", "2"),
];

/// The Services, all selecting the four pods (`app=echo`), port 80 → 8080.
const CLUSTER: &str = "198.19.0.10";
const ITP_LOCAL: &str = "198.19.0.11";
/// ClusterIP of the `externalTrafficPolicy: Local` Service, and its external IP.
const ETP_LOCAL: &str = "198.19.0.12";
const ETP_LOCAL_EXTERNAL: &str = "198.19.1.12";
/// `service.kubernetes.io/topology-mode: Auto`: hints from the controller's topology cache.
const TOPOLOGY_AUTO: &str = "198.19.0.13";
/// `trafficDistribution: PreferClose`: hints to each endpoint's own zone.
const PREFER_CLOSE: &str = "198.19.0.14";

fn service(name: &str, ip: &str, spec: Value, annotations: Value) -> Value {
    let mut s = json!({
        "selector": { "app": "echo" },
        "clusterIP": ip,
        "ports": [{ "name": "http", "protocol": "TCP", "port": 80, "targetPort": 8080 }],
    });
    if let (Some(s), Some(extra)) = (s.as_object_mut(), spec.as_object()) {
        s.extend(extra.clone());
    }
    json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": { "name": name, "namespace": NS, "annotations": annotations },
        "spec": s,
    })
}

fn services() -> Vec<Value> {
    vec![
        service("cluster", CLUSTER, json!({}), json!({})),
        service(
            "itp-local",
            ITP_LOCAL,
            json!({ "internalTrafficPolicy": "Local" }),
            json!({}),
        ),
        service(
            "etp-local",
            ETP_LOCAL,
            json!({ "externalIPs": [ETP_LOCAL_EXTERNAL], "externalTrafficPolicy": "Local" }),
            json!({}),
        ),
        service(
            "topology-auto",
            TOPOLOGY_AUTO,
            json!({}),
            json!({ "service.kubernetes.io/topology-mode": "Auto" }),
        ),
        service(
            "prefer-close",
            PREFER_CLOSE,
            json!({ "trafficDistribution": "PreferClose" }),
            json!({}),
        ),
    ]
}

fn kubectl_apply(cp: &ControlPlane, objects: &[Value]) {
    let list = json!({ "apiVersion": "v1", "kind": "List", "items": objects });
    cp.kubectl_ok(&["apply", "-f", "-"], Some(list.to_string().as_bytes()))
        .expect("kubectl apply");
}

/// `kubectl patch KIND NAME --subresource=status` with a merge patch, as a kubelet (or the
/// node's own heartbeat) would write it.
fn patch_status(cp: &ControlPlane, kind: &str, name: &str, namespaced: bool, status: &Value) {
    let patch = json!({ "status": status }).to_string();
    let mut args = vec!["patch", kind, name];
    if namespaced {
        args.extend(["--namespace", NS]);
    }
    args.extend(["--subresource=status", "--type=merge", "--patch", &patch]);
    cp.kubectl_ok(&args, None).expect("kubectl patch status");
}

/// Nodes with zones, Ready and with allocatable CPU (what the topology cache weighs zones
/// by); the namespace; the four pods running and Ready; then the Services.
fn create_cluster(cp: &ControlPlane) {
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    let mut objects = vec![
        json!({ "apiVersion": "v1", "kind": "Namespace", "metadata": { "name": NS } }),
        json!({ "apiVersion": "v1", "kind": "ServiceAccount",
                "metadata": { "name": "default", "namespace": NS } }),
    ];
    for (node, zone, _) in NODES {
        objects.push(json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": { "name": node, "labels": {
                "topology.kubernetes.io/zone": zone, "kubernetes.io/hostname": node,
            } },
        }));
    }
    kubectl_apply(cp, &objects);
    for (node, _, cpus) in NODES {
        let status = json!({
            "capacity": { "cpu": cpus, "memory": "4Gi", "pods": "110" },
            "allocatable": { "cpu": cpus, "memory": "4Gi", "pods": "110" },
            "conditions": [{
                "type": "Ready", "status": "True", "reason": "KubeletReady",
                "lastHeartbeatTime": now, "lastTransitionTime": now,
            }],
        });
        patch_status(cp, "node", node, false, &status);
    }
    let pods: Vec<Value> = PODS
        .iter()
        .map(|(pod, node)| {
            json!({
                "apiVersion": "v1", "kind": "Pod",
                "metadata": { "name": pod, "namespace": NS, "labels": { "app": "echo" } },
                "spec": {
                    "nodeName": node,
                    "containers": [{
                        "name": "echo", "image": "lb.invalid/echo:test",
                        "ports": [{ "name": "http", "containerPort": 8080 }],
                    }],
                },
            })
        })
        .collect();
    kubectl_apply(cp, &pods);
    for (i, (pod, _)) in PODS.iter().enumerate() {
        let ip = pod_ip(i + 1);
        let status = json!({
            "phase": "Running", "podIP": ip, "podIPs": [{ "ip": ip }],
            "conditions": [
                { "type": "Ready", "status": "True", "lastTransitionTime": now },
                { "type": "ContainersReady", "status": "True", "lastTransitionTime": now },
            ],
        });
        patch_status(cp, "pod", pod, true, &status);
    }
    kubectl_apply(cp, &services());
}

/// Backend `b<i>`'s address in every testbed: pod `p<i>`'s IP.
fn pod_ip(i: usize) -> String {
    format!("198.18.{}.2", 10 + i)
}

/// The ready endpoints of Service `name`'s slices: address → the zones of its hints.
fn slice_endpoints(cp: &ControlPlane, name: &str) -> (BTreeMap<String, Vec<String>>, Value) {
    let selector = format!("--selector=kubernetes.io/service-name={name}");
    let args = [
        "get",
        "endpointslices",
        "--namespace",
        NS,
        &selector,
        "--output=json",
    ];
    let list: Value = serde_json::from_str(&cp.kubectl_ok(&args, None).expect("kubectl get"))
        .expect("slice list JSON");
    let mut out = BTreeMap::new();
    for ep in list["items"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|s| s["endpoints"].as_array().into_iter().flatten())
        .filter(|ep| ep["conditions"]["ready"] == json!(true))
    {
        let zones = ep["hints"]["forZones"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|z| z["name"].as_str().map(str::to_owned))
            .collect();
        out.insert(ep["addresses"][0].as_str().unwrap_or("").to_owned(), zones);
    }
    (out, list)
}

/// Waits until every Service has its four ready endpoints from the controller, and the two
/// topology-aware ones carry each endpoint's own zone as its hint.
fn wait_for_slices(cp: &ControlPlane) {
    let zone_of = |ip: &str| {
        let i = (1..=4).find(|i| pod_ip(*i) == ip)?;
        let node = PODS[i - 1].1;
        NODES.iter().find(|n| n.0 == node).map(|n| n.1.to_owned())
    };
    let deadline = Instant::now() + WAIT;
    for name in [
        "cluster",
        "itp-local",
        "etp-local",
        "topology-auto",
        "prefer-close",
    ] {
        let hinted = name == "topology-auto" || name == "prefer-close";
        loop {
            let (eps, list) = slice_endpoints(cp, name);
            let complete = eps.len() == 4
                && eps.iter().all(|(ip, zones)| {
                    if hinted {
                        zone_of(ip).is_some_and(|z| *zones == [z])
                    } else {
                        zones.is_empty()
                    }
                });
            if complete {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "Service {name}: no 4 ready endpoints{} within {WAIT:?}: {list:#}{}",
                if hinted {
                    " hinted to their own zones"
                } else {
                    ""
                },
                cp.logs()
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    }
}

/// One node of the cluster: its testbed (client + echo servers at the four pod addresses),
/// the relay to the API server and its lb. Fields drop in order: lb first.
struct Node {
    _lb: LbDaemon,
    _relay: Relay,
    tb: Testbed,
    name: &'static str,
}

impl Node {
    fn start(cp: &ControlPlane, name: &'static str, token: &str) -> Node {
        let mut tb = Testbed::create(4).expect("testbed");
        tb.start_echo_servers(Path::new(LB_ECHO), 8080)
            .expect("echo servers");
        let upstream: SocketAddr = cp
            .server
            .trim_start_matches("https://")
            .parse()
            .expect("apiserver address");
        let relay = Relay::start(&tb.node_ns, upstream).expect("relay");
        let kubeconfig = cp
            .kubeconfig_at(&format!("lb-{name}"), &relay.https_url(), token)
            .expect("kubeconfig");
        let ifaces = tb.node_ifaces().join(",");
        let args = [
            "--kubeconfig",
            kubeconfig.to_str().expect("UTF-8 path"),
            "--hostname-override",
            name,
            "--socket-lb=false",
            "--tc-ingress",
            &ifaces,
            "--metrics-bind-address",
            "off",
        ];
        let mut lb = LbDaemon::start(&mut tb, Path::new(LB), &args, "info").expect("lb ready");
        lb.wait_for_from(
            0,
            |l| l.contains("synced") && l.split_whitespace().any(|w| w == "errors=0"),
            "a sync without errors",
        )
        .expect("lb synced from the API");
        Node {
            _lb: lb,
            _relay: relay,
            tb,
            name,
        }
    }

    /// The pods (echo server names `b<i>` → `p<i>`) that answer [`REQUESTS`] TCP connections
    /// from this node's client to `ip:80`, every reply seen from `ip:80`.
    fn reached(&self, ip: &str) -> BTreeSet<String> {
        let target = format!("{ip}:80");
        let mut cmd = Command::new(LB_ECHO);
        cmd.args(["client", "--target", &target, "--proto", "tcp", "--count"])
            .arg(REQUESTS.to_string());
        let out = self
            .tb
            .run(&self.tb.client.ns, None, cmd)
            .expect("run client");
        let mut per_pod = BTreeMap::<String, usize>::new();
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let v: Value = serde_json::from_str(line).expect("client JSON");
            assert!(v.get("error").is_none(), "{}: client error: {v}", self.name);
            assert_eq!(v["peer"].as_str(), Some(target.as_str()), "{v}");
            let backend = v["backend"].as_str().unwrap_or_default();
            *per_pod.entry(backend.replacen('b', "p", 1)).or_default() += 1;
        }
        assert_eq!(
            per_pod.values().sum::<usize>(),
            REQUESTS,
            "{}: one reply per request to {target}; stderr: {}",
            self.name,
            String::from_utf8_lossy(&out.stderr)
        );
        per_pod.into_keys().collect()
    }
}

impl Node {
    /// Asserts that this node's client reaches exactly `want` at `ip`. lb's first sync may come
    /// before its Node (which only adds the zone: lb does not wait for it), so a zone-hinted
    /// answer is retried until [`WAIT`] has passed; the last answer is the one asserted.
    fn converges(&self, ip: &str, want: &BTreeSet<String>, what: &str) {
        let deadline = Instant::now() + WAIT;
        loop {
            let got = self.reached(ip);
            if got == *want || Instant::now() > deadline {
                assert_eq!(&got, want, "{}, {what} ({ip})", self.name);
                return;
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    }
}

fn pods(names: &[&str]) -> BTreeSet<String> {
    names.iter().map(|n| (*n).to_owned()).collect()
}

/// Node-local policies and zone hints, as two lb daemons of one cluster apply them: each
/// node's client reaches exactly the pods kube-proxy would pick on that node.
#[test]
fn two_nodes_use_their_own_and_their_zones_endpoints() {
    let started = Instant::now();
    let cp = ControlPlane::start().expect("control plane");
    create_cluster(&cp);
    wait_for_slices(&cp);
    let token = cp.lb_token().expect("lb token");
    // Both start after the slices are complete, so their first sync has all of them.
    let node_a = Node::start(&cp, "node-a", &token);
    let node_b = Node::start(&cp, "node-b", &token);
    let all = pods(&["p1", "p2", "p3", "p4"]);
    let cases: [(&str, &str, BTreeSet<String>, BTreeSet<String>); 6] = [
        // (what, address, node-a reaches, node-b reaches)
        ("Cluster policy", CLUSTER, all.clone(), all.clone()),
        (
            "internalTrafficPolicy: Local",
            ITP_LOCAL,
            pods(&["p1"]),
            pods(&["p3", "p4"]),
        ),
        (
            "externalTrafficPolicy: Local, external IP",
            ETP_LOCAL_EXTERNAL,
            pods(&["p1"]),
            pods(&["p3", "p4"]),
        ),
        (
            "externalTrafficPolicy: Local, its ClusterIP (internal policy Cluster)",
            ETP_LOCAL,
            all.clone(),
            all.clone(),
        ),
        (
            "topology-mode: Auto (controller's zone hints)",
            TOPOLOGY_AUTO,
            pods(&["p1", "p2"]),
            pods(&["p3", "p4"]),
        ),
        (
            "trafficDistribution: PreferClose (zone hints)",
            PREFER_CLOSE,
            pods(&["p1", "p2"]),
            pods(&["p3", "p4"]),
        ),
    ];
    for (what, ip, want_a, want_b) in cases {
        node_a.converges(ip, &want_a, what);
        node_b.converges(ip, &want_b, what);
    }
    eprintln!(
        "two nodes: control plane ready in {:.1} s, whole test {:.1} s",
        cp.ready_after.as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
    drop(node_b);
    drop(node_a);
    drop(cp);
}
