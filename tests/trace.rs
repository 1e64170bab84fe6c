//! `lb trace` against real traffic: for the same flows, the trace's backend set and masquerade
//! decision must agree with what clients in network namespaces actually get, both when tracing
//! a private copy programmed from manifests and when tracing the running lb's maps. A live
//! trace must not change live conntrack. Needs root.
use std::{
    collections::BTreeSet,
    fs,
    net::SocketAddr,
    path::{Path, PathBuf},
    process::Command,
};

use aya::maps::{HashMap, Map, MapData};
use lb_common::{Backend4, Ct4Key, Ct4Value, ct_dir, ct_flags};
use lb_tests::{
    bins::{LB, LB_ECHO},
    daemon::LbDaemon,
    testbed::Testbed,
};

fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/examples")
}

/// `lb run` (tc on the pod veths, no socket LB) in the node netns, until ready.
fn start_lb(tb: &mut Testbed) -> LbDaemon {
    let examples = examples();
    let ifaces = tb.node_ifaces().join(",");
    let args = [
        "--manifests",
        examples.to_str().unwrap(),
        "--socket-lb=false",
        "--metrics-bind-address",
        "off",
        "--tc-pod",
        &ifaces,
        // No GC pass during a test: the entries a test writes stay as written.
        "--ct-gc-interval",
        "3600",
    ];
    LbDaemon::start(tb, Path::new(LB), &args, "info").unwrap()
}

const TARGETS: [(&str, &str, &str, &str); 4] = [
    ("198.18.10.2", "198.19.0.10:80", "tcp", "demo/echo:tcp"),
    ("198.18.10.2", "198.19.0.10:53", "udp", "demo/echo:udp"),
    (
        "2001:db8:0:10::2",
        "[2001:db8:ffff::10]:80",
        "tcp",
        "demo/echo:tcp",
    ),
    (
        "2001:db8:0:10::2",
        "[2001:db8:ffff::10]:53",
        "udp",
        "demo/echo:udp",
    ),
];

/// Backend addresses reached by 30 real flows, and whether any backend saw a source other than
/// the client's own address (a masquerade).
fn real_traffic(tb: &mut Testbed, target: &str, proto: &str) -> (BTreeSet<String>, bool) {
    let mut cmd = Command::new(LB_ECHO);
    cmd.args([
        "client", "--target", target, "--proto", proto, "--count", "30",
    ]);
    let ns = tb.client.ns.clone();
    let out = tb.run(&ns, None, cmd).expect("client");
    let mut reached = BTreeSet::new();
    let mut masqueraded = false;
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        assert!(v.get("error").is_none(), "{target}/{proto}: {line}");
        let name = v["backend"].as_str().unwrap();
        let host = tb
            .backends
            .iter()
            .find(|b| b.name == name)
            .unwrap_or_else(|| panic!("unknown backend {name}"));
        let addr = if target.starts_with('[') {
            format!("[{}]:8080", host.ipv6)
        } else {
            format!("{}:8080", host.ipv4)
        };
        reached.insert(addr);
        masqueraded |= v["seen_by_backend"] != v["local"];
    }
    (reached, masqueraded)
}

/// Runs `lb trace ... --json` and returns one parsed result per flow.
fn trace(args: &[&str]) -> Vec<serde_json::Value> {
    let out = Command::new(LB)
        .arg("trace")
        .args(args)
        .arg("--json")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "lb trace {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("trace JSON"))
        .collect()
}

fn strings(v: &serde_json::Value) -> BTreeSet<String> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_string())
        .collect()
}

fn check_agreement(
    results: &[serde_json::Value],
    reached: &BTreeSet<String>,
    masqueraded: bool,
    service: &str,
    live: bool,
) {
    assert_eq!(results.len(), 60);
    let mut chosen = BTreeSet::new();
    for r in results {
        assert_eq!(r["verdict"], "forward", "{r}");
        assert_eq!(r["scope"], "external", "single-scope service: {r}");
        assert_eq!(r["service"], service, "{r}");
        match r["conntrack"].as_str() {
            Some("new") => {
                assert_eq!(r["reason"], "tc_forward_new", "{r}");
                // Candidates are listed in slot order: the datapath's slot names its backend.
                let slot = r["slot"].as_u64().expect("a new flow has a slot") as usize;
                assert_eq!(
                    r["candidates"][slot - 1],
                    r["backend"],
                    "slot {slot} holds the chosen backend: {r}"
                );
            }
            // Live mode copies the live entry of exactly this flow: real traffic may have used
            // this source port, and the flow then keeps its backend.
            Some("established") if live => {
                assert_eq!(r["reason"], "tc_forward_established", "{r}");
                assert_eq!(r["slot"], serde_json::Value::Null, "{r}");
            }
            _ => panic!("a traced flow is new (or, live, established): {r}"),
        }
        assert_eq!(
            &strings(&r["candidates"]),
            reached,
            "candidates = backends real flows reach"
        );
        assert_eq!(
            r["masquerade"], masqueraded,
            "same masquerade decision as real traffic"
        );
        chosen.insert(r["backend"].as_str().unwrap().to_string());
    }
    assert_eq!(
        &chosen, reached,
        "60 traced new flows spread over the same backends"
    );
}

fn ct_entries(pin_dir: &Path) -> usize {
    ["lb4_ct_tcp", "lb4_ct_any"]
        .into_iter()
        .map(|name| {
            let map = MapData::from_pin(pin_dir.join(name)).unwrap();
            let ct: HashMap<MapData, Ct4Key, Ct4Value> =
                HashMap::try_from(Map::LruHashMap(map)).unwrap();
            ct.keys().count()
        })
        .sum()
}

#[test]
fn trace_agrees_with_real_traffic() {
    let mut tb = Testbed::create(3).expect("testbed");
    tb.start_echo_servers(Path::new(LB_ECHO), 8080).unwrap();
    let daemon = start_lb(&mut tb);
    let pin = daemon.pin_dir.to_str().unwrap().to_string();
    let state = daemon.state_dir.to_str().unwrap().to_string();
    let manifests = examples();
    let manifests = manifests.to_str().unwrap();

    for (src, dst, proto, service) in TARGETS {
        let (reached, masqueraded) = real_traffic(&mut tb, dst, proto);
        assert_eq!(
            reached.len(),
            3,
            "{dst}/{proto}: real traffic reaches every backend"
        );
        assert!(!masqueraded, "lb does not masquerade pod traffic");

        let offline = trace(&[
            "--manifests",
            manifests,
            "--hostname-override",
            "node-a",
            "--src",
            src,
            "--dst",
            dst,
            "--proto",
            proto,
            "--from",
            "pod",
            "--flows",
            "60",
        ]);
        check_agreement(&offline, &reached, masqueraded, service, false);

        let ct_before = ct_entries(&daemon.pin_dir);
        let live = trace(&[
            "--pin-dir",
            &pin,
            "--state-dir",
            &state,
            "--src",
            src,
            "--dst",
            dst,
            "--proto",
            proto,
            "--cluster-cidr",
            "198.18.10.0/24,2001:db8:0:10::/64",
            "--flows",
            "60",
        ]);
        check_agreement(&live, &reached, masqueraded, service, true);
        for r in &live {
            assert_eq!(
                r["hook"], "tc ingress, pod veth (lb_tc_pod)",
                "classified as pod by CIDR"
            );
        }
        assert_eq!(
            ct_entries(&daemon.pin_dir),
            ct_before,
            "a live trace leaves live conntrack alone"
        );
    }
}

#[test]
fn trace_reports_rejects_drops_misses_and_hooks() {
    let dir = std::env::temp_dir().join(format!("lb-trace-manifests-{}", std::process::id()));
    fs::create_dir_all(&dir).unwrap();
    fs::write(
        dir.join("empty.yaml"),
        "apiVersion: v1\nkind: Service\nmetadata: {name: empty, namespace: t}\nspec:\n  clusterIP: 198.19.1.1\n  clusterIPs: [198.19.1.1, \"2001:db8:ffff:1::1\"]\n  ipFamilies: [IPv4, IPv6]\n  ipFamilyPolicy: PreferDualStack\n  ports: [{name: p, protocol: TCP, port: 80}]\n",
    )
    .unwrap();
    // internalTrafficPolicy: Local, its one endpoint on another node.
    fs::write(
        dir.join("elsewhere.yaml"),
        "apiVersion: v1\nkind: Service\nmetadata: {name: elsewhere, namespace: t}\nspec:\n  clusterIP: 198.19.1.2\n  internalTrafficPolicy: Local\n  ports: [{name: p, protocol: TCP, port: 80}]\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: elsewhere-1, namespace: t, labels: {kubernetes.io/service-name: elsewhere}}\naddressType: IPv4\nports: [{name: p, protocol: TCP, port: 8080}]\nendpoints: [{addresses: [198.18.20.1], nodeName: another-node}]\n",
    )
    .unwrap();
    let d = dir.to_str().unwrap();
    let no_backend = trace(&[
        "--manifests",
        d,
        "--src",
        "198.18.10.2",
        "--dst",
        "198.19.1.1:80",
    ]);
    // A DROP before lb answered like kube-proxy's REJECT.
    assert_eq!(no_backend[0]["verdict"], "reject");
    assert_eq!(no_backend[0]["reason"], "tc_reject_no_backend");
    assert_eq!(
        no_backend[0]["reply"],
        serde_json::json!({"proto": "tcp-rst", "src": "198.19.1.1:80", "dst": "198.18.10.2:40000"})
    );
    assert_eq!(no_backend[0]["source_after"], "198.18.10.2:40000");
    assert_eq!(no_backend[0]["masquerade"], false);
    assert_eq!(no_backend[0]["conntrack"], serde_json::Value::Null);
    assert_eq!(no_backend[0]["slot"], serde_json::Value::Null);
    assert_eq!(no_backend[0]["scope"], "external");
    assert_eq!(no_backend[0]["service"], "t/empty:p");
    assert_eq!(no_backend[0]["candidates"], serde_json::json!([]));
    assert_eq!(
        no_backend[0]["hook"], "tc ingress (lb_tc_ingress)",
        "unclassified source is external"
    );

    let miss = trace(&[
        "--manifests",
        d,
        "--src",
        "198.18.10.2:1234",
        "--dst",
        "198.19.9.9:80",
        "--from",
        "node",
    ]);
    assert_eq!(miss[0]["verdict"], "pass");
    assert_eq!(miss[0]["reason"], "tc_pass_no_service");
    assert_eq!(miss[0]["scope"], serde_json::Value::Null);
    assert_eq!(miss[0]["service"], serde_json::Value::Null);
    assert_eq!(miss[0]["backend"], serde_json::Value::Null);
    assert_eq!(miss[0]["source_after"], "198.18.10.2:1234");
    assert!(miss[0]["hook"].as_str().unwrap().starts_with("socket LB"));
    // And where socket LB keeps the socket's pair on this kernel (the loader's probe).
    let kept = if lb::datapath::load::sock_storage_supported() {
        "lb*_sk_store"
    } else {
        "lb*_sk_revnat"
    };
    assert!(
        miss[0]["hook"].as_str().unwrap().contains(kept),
        "{}",
        miss[0]
    );

    assert_eq!(miss[0]["reply"], serde_json::Value::Null);

    // UDP to the same ClusterIP: no UDP frontend there, so an ICMP port unreachable from it.
    let unknown_port = trace(&[
        "--manifests",
        d,
        "--src",
        "198.18.10.2",
        "--dst",
        "198.19.1.1:53",
        "--proto",
        "udp",
    ]);
    assert_eq!(unknown_port[0]["verdict"], "reject");
    assert_eq!(unknown_port[0]["reason"], "tc_reject_unknown_port");
    assert_eq!(unknown_port[0]["service"], serde_json::Value::Null);
    assert_eq!(
        unknown_port[0]["reply"],
        serde_json::json!({"proto": "icmp-port-unreachable", "src": "198.19.1.1", "dst": "198.18.10.2"})
    );
    let v6 = trace(&[
        "--manifests",
        d,
        "--src",
        "2001:db8:0:10::2",
        "--dst",
        "[2001:db8:ffff:1::1]:53",
        "--proto",
        "udp",
    ]);
    assert_eq!(v6[0]["verdict"], "reject", "{v6:?}");
    assert_eq!(
        v6[0]["reply"],
        serde_json::json!({"proto": "icmpv6-port-unreachable", "src": "2001:db8:ffff:1::1", "dst": "2001:db8:0:10::2"})
    );

    // With --service-cidr, an unallocated address in it is dropped; outside it passes.
    for (dst, verdict, reason) in [
        ("198.19.9.9:80", "drop", "tc_drop_unallocated_service_ip"),
        ("198.20.9.9:80", "pass", "tc_pass_no_service"),
    ] {
        let r = trace(&[
            "--manifests",
            d,
            "--service-cidr",
            "198.19.0.0/16,2001:db8:ffff::/64",
            "--src",
            "198.18.10.2",
            "--dst",
            dst,
        ]);
        assert_eq!(
            (&r[0]["verdict"], &r[0]["reason"]),
            (&verdict.into(), &reason.into()),
            "{dst}"
        );
        assert_eq!(r[0]["reply"], serde_json::Value::Null);
    }

    // Endpoints only on another node, iTP=Local: dropped from pods and from the node (whose
    // socket LB denies the call), as kube-proxy DROPs it; no reply.
    for from in ["pod", "node"] {
        let r = trace(&[
            "--manifests",
            d,
            "--src",
            "198.18.10.2",
            "--dst",
            "198.19.1.2:80",
            "--from",
            from,
        ]);
        assert_eq!(
            (&r[0]["verdict"], &r[0]["reason"]),
            (&"drop".into(), &"tc_drop_no_local_backend".into()),
            "from {from}: {r:?}"
        );
        assert_eq!(r[0]["service"], "t/elsewhere:p");
        assert_eq!(r[0]["reply"], serde_json::Value::Null);
        assert_eq!(r[0]["backend"], serde_json::Value::Null);
    }

    let out = Command::new(LB)
        .args([
            "trace",
            "--manifests",
            d,
            "--src",
            "2001:db8::1",
            "--dst",
            "198.19.1.1:80",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success(), "mixed families are refused");
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn trace_follows_sctp_through_the_datapath() {
    // An SCTP service with a port rewrite (3868 -> 3869): the traced INIT must be balanced like
    // TCP, not passed as an unparsed protocol.
    let dir = std::env::temp_dir().join(format!("lb-trace-sctp-{}", std::process::id()));
    fs::create_dir_all(&dir).unwrap();
    fs::write(
        dir.join("diameter.yaml"),
        "apiVersion: v1\nkind: Service\nmetadata: {name: diameter, namespace: t}\nspec:\n  clusterIP: 198.19.2.1\n  ports: [{name: d, protocol: SCTP, port: 3868, targetPort: 3869}]\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: diameter-1, namespace: t, labels: {kubernetes.io/service-name: diameter}}\naddressType: IPv4\nports: [{name: d, protocol: SCTP, port: 3869}]\nendpoints:\n  - {addresses: [198.18.11.2], conditions: {ready: true}}\n  - {addresses: [198.18.12.2], conditions: {ready: true}}\n",
    )
    .unwrap();
    let results = trace(&[
        "--manifests",
        dir.to_str().unwrap(),
        "--src",
        "198.18.10.2",
        "--dst",
        "198.19.2.1:3868",
        "--proto",
        "sctp",
        "--flows",
        "20",
    ]);
    let _ = fs::remove_dir_all(&dir);
    assert_eq!(results.len(), 20);
    let mut chosen = BTreeSet::new();
    for r in &results {
        assert_eq!(r["verdict"], "forward", "{r}");
        assert_eq!(r["reason"], "tc_forward_new", "{r}");
        assert_eq!(r["service"], "t/diameter:d", "{r}");
        chosen.insert(r["backend"].as_str().unwrap().to_string());
    }
    let both: BTreeSet<String> = ["198.18.11.2:3869", "198.18.12.2:3869"]
        .map(String::from)
        .into();
    assert_eq!(
        chosen, both,
        "20 traced associations reach both backends, port rewritten"
    );
}

/// `masquerade` and `source_after` come from the datapath: a client outside `--cluster-cidr`
/// leaves from the `--node-ip` and a NAT port, a pod keeps its source; the node facts used are
/// reported. IPv4 and IPv6, from the manifests (no daemon).
#[test]
fn trace_shows_masquerade_from_the_datapath() {
    let examples = examples();
    let ex = examples.to_str().unwrap();
    for (src, dst, node) in [
        ("198.18.10.2", "198.19.0.10:80", "198.18.0.1"),
        ("2001:db8:0:10::2", "[2001:db8:ffff::10]:80", "2001:db8::1"),
    ] {
        let outside = "198.18.11.0/24,2001:db8:0:11::/64";
        let base = [
            "--manifests",
            ex,
            "--hostname-override",
            "n1",
            "--src",
            src,
            "--dst",
            dst,
            "--from",
            "external",
            "--node-ip",
            node,
            "--service-cidr",
            "198.19.0.0/16",
        ];
        let masq = trace(&[&base[..], &["--cluster-cidr", outside]].concat());
        let r = &masq[0];
        assert_eq!(r["verdict"], "forward", "{r}");
        assert_eq!(r["masquerade"], true, "{r}");
        let after: SocketAddr = r["source_after"].as_str().unwrap().parse().unwrap();
        assert_eq!(after.ip().to_string(), node, "{r}");
        assert!(
            (lb_common::nat::PORT_MIN..=lb_common::nat::PORT_MAX).contains(&after.port()),
            "{r}"
        );
        assert_eq!(r["node"]["node_ip_source"], "flag", "{r}");
        assert_eq!(r["node"]["service_cidrs"][0], "198.19.0.0/16", "{r}");

        let inside = format!("{outside},198.18.10.0/24,2001:db8:0:10::/64");
        let pod = trace(&[&base[..], &["--cluster-cidr", &inside]].concat());
        let r = &pod[0];
        assert_eq!(r["masquerade"], false, "{r}");
        let after: SocketAddr = r["source_after"].as_str().unwrap().parse().unwrap();
        assert_eq!(
            (after.ip().to_string(), after.port()),
            (src.to_string(), 40_000),
            "{r}"
        );
    }
}

/// North-south in `--manifests` mode with `--xdp native`: an external packet meets lb_xdp
/// first; what XDP decides alone (source-range and no-local-endpoint drops) it reports as XDP,
/// what it hands on (a reject, a first masqueraded packet whose next hop it cannot resolve)
/// goes on through tc ingress, and the hook says so. NodePorts answer on the
/// --nodeport-addresses given.
#[test]
fn trace_follows_north_south_traffic_through_xdp_and_tc() {
    let golden = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/golden/11-north-south");
    let dir = std::env::temp_dir().join(format!("lb-trace-ns-{}", std::process::id()));
    fs::create_dir_all(&dir).unwrap();
    fs::copy(golden.join("step-1.yaml"), dir.join("objects.yaml")).unwrap();
    let run = |src: &str, dst: &str, extra: &[&str]| {
        let mut args = vec![
            "--manifests",
            dir.to_str().unwrap(),
            "--hostname-override",
            "node-a",
            "--node-ip",
            "198.18.0.2,2001:db8::2",
            "--from",
            "external",
            "--src",
            src,
            "--dst",
            dst,
        ];
        args.extend_from_slice(extra);
        trace(&args).remove(0)
    };
    let xdp = ["--xdp", "native"];
    let r = run("198.18.10.2", "198.18.250.5:443", &xdp);
    assert_eq!(r["verdict"], "drop", "{r}");
    assert_eq!(r["reason"], "tc_drop_source_range", "{r}");
    assert_eq!(r["hook"], "XDP (lb_xdp)", "{r}");
    let r = run("198.18.99.5", "198.18.250.5:443", &xdp);
    assert_eq!(r["verdict"], "forward", "{r}");
    assert_eq!(r["masquerade"], true, "{r}");
    let r = run("198.18.10.2", "198.18.0.2:30082", &xdp);
    assert_eq!(
        (&r["verdict"], &r["reason"], &r["hook"]),
        (
            &"drop".into(),
            &"tc_drop_no_local_backend".into(),
            &"XDP (lb_xdp)".into()
        ),
        "{r}"
    );
    let r = run("198.18.10.2", "198.18.0.2:30083", &xdp);
    assert_eq!(r["verdict"], "reject", "{r}");
    assert!(
        r["hook"].as_str().unwrap().contains("handed to tc ingress"),
        "{r}"
    );
    // The eTP=Local NodePort: the local endpoint only, the client's address kept.
    let r = run("198.18.10.2", "198.18.0.2:30081", &[]);
    assert_eq!(r["backend"], "198.18.9.11:8080", "{r}");
    assert_eq!(r["masquerade"], false, "{r}");
    assert_eq!(r["hook"], "tc ingress (lb_tc_ingress)", "{r}");
    // NodePorts answer on the --nodeport-addresses only: not on the node IP when the CIDR
    // leaves it out (this host holds no address in it, so there are none at all).
    let r = run(
        "198.18.10.2",
        "198.18.0.2:30080",
        &["--nodeport-addresses", "198.18.123.0/24"],
    );
    assert_eq!(r["verdict"], "pass", "{r}");
    assert_eq!(
        r["node"]["nodeport_addresses"],
        serde_json::json!([]),
        "{r}"
    );
    let _ = fs::remove_dir_all(&dir);
}

/// Session affinity from the datapath: of 20 traced flows of one client to a `ClientIP`
/// service, the first makes the client's entry (`new`), the others meet it (`hit`) and reach
/// the same backend; a second client gets an entry of its own. The text form says so too.
#[test]
fn trace_shows_session_affinity() {
    let dir = std::env::temp_dir().join(format!("lb-trace-affinity-{}", std::process::id()));
    fs::create_dir_all(&dir).unwrap();
    fs::write(
        dir.join("sticky.yaml"),
        "apiVersion: v1\nkind: Service\nmetadata: {name: sticky, namespace: t}\nspec:\n  clusterIP: 198.19.2.2\n  sessionAffinity: ClientIP\n  sessionAffinityConfig: {clientIP: {timeoutSeconds: 60}}\n  ports: [{name: web, protocol: TCP, port: 80, targetPort: 8080}]\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: sticky-1, namespace: t, labels: {kubernetes.io/service-name: sticky}}\naddressType: IPv4\nports: [{name: web, protocol: TCP, port: 8080}]\nendpoints:\n  - {addresses: [198.18.11.2], conditions: {ready: true}}\n  - {addresses: [198.18.12.2], conditions: {ready: true}}\n  - {addresses: [198.18.13.2], conditions: {ready: true}}\n",
    )
    .unwrap();
    let args = |src: &'static str| {
        [
            "--manifests",
            dir.to_str().unwrap(),
            "--src",
            src,
            "--dst",
            "198.19.2.2:80",
            "--proto",
            "tcp",
            "--flows",
            "20",
        ]
        .map(String::from)
    };
    let results = trace(&args("198.18.10.2").each_ref().map(String::as_str));
    assert_eq!(results.len(), 20);
    assert_eq!(results[0]["affinity"], "new", "{}", results[0]);
    assert!(
        results[0]["slot"].is_u64(),
        "a new entry's backend has a slot"
    );
    let backend = results[0]["backend"].clone();
    for r in &results[1..] {
        assert_eq!(r["verdict"], "forward", "{r}");
        assert_eq!(r["affinity"], "hit", "{r}");
        assert_eq!(r["slot"], serde_json::Value::Null, "{r}");
        assert_eq!(r["backend"], backend, "{r}");
    }
    let out = Command::new(LB)
        .arg("trace")
        .args(args("198.18.10.3"))
        .output()
        .unwrap();
    let _ = fs::remove_dir_all(&dir);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("session affinity: new entry for the client"),
        "{text}"
    );
    assert!(
        text.contains("session affinity hit (the client's entry chose the backend)"),
        "{text}"
    );
}

/// A Maglev frontend's trace names the cell the flow hashed to (lb-common's 5-tuple hash mod
/// M, recomputed here) and the backend that cell holds; the same flows trace to the same
/// backends in a second private copy; `--lb-algorithm maglev` makes unannotated services Maglev.
#[test]
fn trace_shows_the_maglev_cell() {
    let dir = std::env::temp_dir().join(format!("lb-trace-maglev-{}", std::process::id()));
    fs::create_dir_all(&dir).unwrap();
    let svc = |name: &str, ip: &str, annotation: &str| {
        format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: t{annotation}}}\nspec:\n  clusterIP: {ip}\n  ports: [{{name: h, protocol: TCP, port: 80, targetPort: 8080}}]\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {name}-1, namespace: t, labels: {{kubernetes.io/service-name: {name}}}}}\naddressType: IPv4\nports: [{{name: h, protocol: TCP, port: 8080}}]\nendpoints:\n  - {{addresses: [198.18.11.2], conditions: {{ready: true}}}}\n  - {{addresses: [198.18.12.2], conditions: {{ready: true}}}}\n  - {{addresses: [198.18.13.2], conditions: {{ready: true}}}}\n---\n"
        )
    };
    let manifests = svc(
        "mag",
        "198.19.3.1",
        ", annotations: {lb.io/lb-algorithm: maglev}",
    ) + &svc("plain", "198.19.3.2", "");
    fs::write(dir.join("svc.yaml"), manifests).unwrap();
    let d = dir.to_str().unwrap();
    let run = |dst: &str, extra: &[&str]| {
        let mut args = vec![
            "--manifests",
            d,
            "--src",
            "198.18.10.2",
            "--dst",
            dst,
            "--flows",
            "20",
            "--maglev-table-size",
            "251",
        ];
        args.extend_from_slice(extra);
        trace(&args)
    };
    let first = run("198.19.3.1:80", &[]);
    let second = run("198.19.3.1:80", &[]);
    let plain = run("198.19.3.2:80", &[]);
    let plain_maglev = run("198.19.3.2:80", &["--lb-algorithm", "maglev"]);
    let text = Command::new(LB)
        .args(["trace", "--manifests", d, "--src", "198.18.10.2:40000"])
        .args(["--dst", "198.19.3.1:80", "--maglev-table-size", "251"])
        .output()
        .unwrap();
    let bad = Command::new(LB)
        .args(["trace", "--manifests", d, "--src", "198.18.10.2"])
        .args(["--dst", "198.19.3.1:80", "--maglev-table-size", "1000"])
        .output()
        .unwrap();
    let _ = fs::remove_dir_all(&dir);

    let mut backends = BTreeSet::new();
    for (i, (r, again)) in first.iter().zip(&second).enumerate() {
        let sport = 40_000 + i as u16;
        assert_eq!(r["verdict"], "forward", "{r}");
        assert_eq!(r["lb_algorithm"], "maglev", "{r}");
        assert_eq!(r["maglev_table_size"], 251, "{r}");
        assert!(r["slot"].is_null(), "no slot with Maglev: {r}");
        let want = lb_common::flow_hash(&[198, 18, 10, 2], &[198, 19, 3, 1], sport, 80, 6) % 251;
        assert_eq!(r["maglev_cell"], want, "flow {sport}: {r}");
        assert_eq!(
            r["backend"], again["backend"],
            "flow {sport} is deterministic"
        );
        backends.insert(r["backend"].as_str().unwrap().to_string());
    }
    assert!(
        backends.len() >= 2,
        "20 flows over one backend: {backends:?}"
    );
    for r in &plain {
        assert_eq!(r["lb_algorithm"], "random", "{r}");
        assert!(r["maglev_cell"].is_null() && r["slot"].is_u64(), "{r}");
    }
    for r in &plain_maglev {
        assert_eq!(r["lb_algorithm"], "maglev", "{r}");
        assert!(r["maglev_cell"].is_u64(), "{r}");
    }
    let text = String::from_utf8_lossy(&text.stdout);
    let cell = lb_common::flow_hash(&[198, 18, 10, 2], &[198, 19, 3, 1], 40_000, 80, 6) % 251;
    assert!(
        text.contains(&format!("maglev cell {cell} of 251")),
        "{text}"
    );
    assert!(!bad.status.success());
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(err.contains("not an allowed Maglev table size"), "{err}");
}

/// A live trace shows the conntrack entry a packet meets: a midstream packet of a tracked flow
/// is `established` with the entry's flags and goes to its backend; one whose entry names a
/// removed backend is `backend_gone` and answered with a RST (text and JSON); a SYN of that
/// flow is balanced afresh. Live conntrack is left as it was.
#[test]
fn trace_shows_the_conntrack_state_a_packet_met() {
    let mut tb = Testbed::create(3).expect("testbed");
    tb.start_echo_servers(Path::new(LB_ECHO), 8080).unwrap();
    let daemon = start_lb(&mut tb);
    let pin = daemon.pin_dir.to_str().unwrap().to_string();
    let state = daemon.state_dir.to_str().unwrap().to_string();
    let backends = MapData::from_pin(daemon.pin_dir.join("lb4_backends")).unwrap();
    let backends: HashMap<MapData, u32, Backend4> =
        HashMap::try_from(Map::HashMap(backends)).unwrap();
    let (b1, _) = backends
        .iter()
        .filter_map(Result::ok)
        .find(|(_, b)| b.addr == [198, 18, 11, 2] && b.proto == lb_common::IPPROTO_TCP)
        .expect("b1's TCP backend");
    let map = MapData::from_pin(daemon.pin_dir.join("lb4_ct_tcp")).unwrap();
    let mut ct: HashMap<MapData, Ct4Key, Ct4Value> =
        HashMap::try_from(Map::LruHashMap(map)).unwrap();
    let key = |sport| Ct4Key {
        saddr: [198, 18, 10, 2],
        daddr: [198, 19, 0, 10],
        sport,
        dport: 80,
        proto: lb_common::IPPROTO_TCP,
        dir: ct_dir::SERVICE,
        pad: [0; 2],
    };
    let entry = |backend_id| Ct4Value {
        backend_id,
        rev_nat_id: 1,
        expires: u32::MAX,
        flags: ct_flags::SEEN_REPLY,
        ..Default::default()
    };
    ct.insert(key(45_000), entry(b1), 0).unwrap();
    ct.insert(key(45_001), entry(999_999), 0).unwrap();
    let live = |sport: &str, extra: &[&str]| {
        let src = format!("198.18.10.2:{sport}");
        let mut args = vec![
            "--pin-dir",
            &pin,
            "--state-dir",
            &state,
            "--src",
            &src,
            "--dst",
            "198.19.0.10:80",
            "--from",
            "pod",
        ];
        args.extend_from_slice(extra);
        trace(&args).remove(0)
    };

    let est = live("45000", &["--midstream"]);
    assert_eq!(est["conntrack"], "established", "{est}");
    assert_eq!(est["conntrack_flags"], serde_json::json!(["seen_reply"]));
    assert_eq!(est["backend"], "198.18.11.2:8080");

    let gone = live("45001", &["--midstream"]);
    assert_eq!(gone["verdict"], "reject", "{gone}");
    assert_eq!(gone["reason"], "tc_reject_backend_gone");
    assert_eq!(gone["conntrack"], "backend_gone");
    assert_eq!(gone["conntrack_flags"], serde_json::json!(["seen_reply"]));
    assert_eq!(gone["reply"]["proto"], "tcp-rst");
    let syn = live("45001", &[]);
    assert_eq!(syn["verdict"], "forward", "{syn}");
    assert_eq!(syn["conntrack"], "new", "a SYN is balanced afresh");

    let text = Command::new(LB)
        .args(["trace", "--pin-dir", &pin, "--state-dir", &state])
        .args(["--src", "198.18.10.2:45001", "--dst", "198.19.0.10:80"])
        .args(["--from", "pod", "--midstream"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("conntrack:   backend gone"), "{text}");
    assert!(text.contains("ct flags:    seen_reply"), "{text}");

    assert!(
        ct.get(&key(45_001), 0).is_ok(),
        "the live entry is untouched: the trace deleted its private copy"
    );
}

/// `lb trace --manifests` takes `lb run`'s conntrack flags: valid lifetimes trace as usual, a
/// zero one is refused naming its flag.
#[test]
fn trace_takes_the_conntrack_flags() {
    let d = examples();
    let d = d.to_str().unwrap();
    let base = [
        "--manifests",
        d,
        "--hostname-override",
        "node-a",
        "--src",
        "198.18.10.2",
        "--dst",
        "198.19.0.10:80",
        "--from",
        "pod",
    ];
    let mut ok = base.to_vec();
    ok.extend([
        "--bpf-ct-timeout-regular-tcp-syn=5",
        "--bpf-ct-timeout-regular-tcp=100",
        "--bpf-ct-timeout-regular-tcp-fin=5",
        "--bpf-ct-timeout-regular-any=5",
        "--bpf-ct-global-tcp-max=1000",
    ]);
    let r = trace(&ok).remove(0);
    assert_eq!(r["verdict"], "forward", "{r}");
    let out = Command::new(LB)
        .arg("trace")
        .args(base)
        .arg("--bpf-ct-timeout-regular-tcp-fin=0")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a zero lifetime is refused");
    assert!(
        stderr.contains("--bpf-ct-timeout-regular-tcp-fin") && stderr.contains("1..="),
        "{stderr}"
    );
}

/// A live trace reads the running lb's source ranges: a LoadBalancer IP with
/// `loadBalancerSourceRanges` forwards a client inside them and drops one outside, as the
/// datapath does (the trace's private maps would hold no ranges).
#[test]
fn live_trace_reads_the_running_lbs_source_ranges() {
    let mut tb = Testbed::create(1).expect("testbed");
    let golden = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/golden/11-north-south");
    let dir = std::env::temp_dir().join(format!("lb-trace-ranges-{}", tb.id));
    fs::create_dir_all(&dir).unwrap();
    fs::copy(golden.join("step-1.yaml"), dir.join("objects.yaml")).unwrap();
    let ifaces = tb.node_ifaces().join(",");
    let args = [
        "--manifests",
        dir.to_str().unwrap(),
        "--hostname-override",
        "node-a",
        "--node-ip",
        "198.18.0.2,2001:db8::2",
        "--socket-lb=false",
        "--metrics-bind-address",
        "off",
        "--tc-pod",
        &ifaces,
        "--ct-gc-interval",
        "3600",
    ];
    let daemon = LbDaemon::start(&mut tb, Path::new(LB), &args, "info");
    let _ = fs::remove_dir_all(&dir);
    let daemon = daemon.unwrap();
    let (pin, state) = (
        daemon.pin_dir.to_str().unwrap().to_string(),
        daemon.state_dir.to_str().unwrap().to_string(),
    );
    let live = |src: &str, dst: &str| {
        trace(&[
            "--pin-dir",
            &pin,
            "--state-dir",
            &state,
            "--from",
            "external",
            "--src",
            src,
            "--dst",
            dst,
        ])
        .remove(0)
    };
    let vip = "198.18.250.5:443";
    let r = live("198.18.99.5", vip);
    assert_eq!(r["verdict"], "forward", "198.18.99.5 is in the ranges: {r}");
    let r = live("198.18.10.2", vip);
    assert_eq!(r["verdict"], "drop", "198.18.10.2 is not: {r}");
    assert_eq!(r["reason"], "tc_drop_source_range", "{r}");
    drop(daemon);
}

/// `lb trace` shows what a real network carries besides plain packets, from the datapath's
/// own record: a datagram's first and later fragment (the later one follows the first's
/// backend), IPv6 extension headers walked, and an ICMP error about the forwarded packet
/// rewritten for the client (conntrack `related`, the quote made client → service again; from
/// the service address when the backend itself sent it, from the router otherwise).
#[test]
fn trace_shows_fragments_extension_headers_and_icmp_errors() {
    let ex = examples();
    let d = ex.to_str().unwrap();
    for (src, dst) in [
        ("198.18.10.2", "198.19.0.10:53"),
        ("[2001:db8:0:10::2]", "[2001:db8:ffff::10]:53"),
    ] {
        let mut args = vec![
            "--manifests",
            d,
            "--src",
            src,
            "--dst",
            dst,
            "--proto",
            "udp",
            "--fragments",
        ];
        if src.starts_with('[') {
            args.extend(["--ipv6-ext-headers", "2"]);
        }
        let r = trace(&args);
        assert_eq!(r.len(), 2, "{src}: first and later fragment");
        assert_eq!(r[0]["fragment"], "first", "{r:?}");
        assert_eq!(r[0]["conntrack"], "new");
        assert_eq!(r[1]["fragment"], "later");
        assert_eq!(r[1]["conntrack"], "established");
        assert_eq!(r[1]["verdict"], "forward");
        assert_eq!(
            r[1]["backend"], r[0]["backend"],
            "the later fragment follows the first"
        );
        // Two destination-options headers and the fragment header.
        let ext = if src.starts_with('[') { 3 } else { 0 };
        assert_eq!(r[0]["ipv6_extension_headers"], ext, "{r:?}");
    }
    for (src, dst, vip) in [
        ("198.18.10.2", "198.19.0.10:80", "198.19.0.10"),
        (
            "[2001:db8:0:10::2]",
            "[2001:db8:ffff::10]:80",
            "2001:db8:ffff::10",
        ),
    ] {
        let client = src.trim_matches(['[', ']']);
        let router = if client.contains(':') {
            "2001:db8:0:99::1"
        } else {
            "198.18.99.1"
        };
        for from in [None, Some(router)] {
            let mut args = vec![
                "--manifests",
                d,
                "--src",
                src,
                "--dst",
                dst,
                "--icmp-error",
                "frag-needed",
            ];
            if let Some(f) = from {
                args.extend(["--icmp-from", f]);
            }
            let r = trace(&args);
            assert_eq!(r.len(), 2, "the packet, then the error");
            let e = &r[1];
            assert_eq!(e["verdict"], "forward", "{e:?}");
            assert_eq!(e["reason"], "tc_icmp_error_reverse_nat");
            assert_eq!(e["conntrack"], "related");
            assert_eq!(e["backend"], r[0]["backend"]);
            assert_eq!(e["service"], "demo/echo:tcp");
            let icmp = &e["icmp_error"];
            assert_eq!(icmp["kind"], "frag-needed");
            assert_eq!(icmp["dst"], client);
            assert_eq!(icmp["src"], from.unwrap_or(vip), "{icmp:?}");
            assert_eq!(icmp["quote_src"], r[0]["source_after"]);
            assert_eq!(icmp["quote_dst"], dst);
        }
    }
}

/// `--ping`: an echo request to a ClusterIP with endpoints is answered by the datapath, from
/// outside (tc ingress) and from a pod (pod hook), IPv4 and IPv6, the reply addressed back to
/// the client from the service address; one to an address that is no service passes, and so
/// does every echo with `--no-echo-reply`. The text form names the reply too.
#[test]
fn trace_shows_the_datapath_answering_a_ping() {
    let ex = examples();
    let d = ex.to_str().unwrap();
    for (src, vip, other) in [
        ("198.18.10.2", "198.19.0.10", "198.18.99.1"),
        ("2001:db8:0:10::2", "2001:db8:ffff::10", "2001:db8:0:99::1"),
    ] {
        let dst = SocketAddr::new(vip.parse().unwrap(), 0).to_string();
        for (from, scope) in [("external", "external"), ("pod", "internal")] {
            let r = trace(&[
                "--manifests",
                d,
                "--src",
                src,
                "--dst",
                &dst,
                "--ping",
                "--from",
                from,
            ]);
            assert_eq!(r.len(), 1, "{r:?}");
            let r = &r[0];
            assert_eq!(r["verdict"], "echo-reply", "{from}: {r:?}");
            assert_eq!(r["reason"], "tc_echo_reply");
            assert_eq!(r["scope"], scope);
            assert_eq!(r["conntrack"], serde_json::Value::Null);
            let icmp = if vip.contains(':') { "icmpv6" } else { "icmp" };
            assert_eq!(r["reply"]["proto"], format!("{icmp}-echo-reply"));
            assert_eq!(r["reply"]["src"], vip);
            assert_eq!(r["reply"]["dst"], src);
        }
        let elsewhere = SocketAddr::new(other.parse().unwrap(), 0).to_string();
        let r = trace(&[
            "--manifests",
            d,
            "--src",
            src,
            "--dst",
            &elsewhere,
            "--ping",
        ]);
        assert_eq!(r[0]["verdict"], "pass", "{r:?}");
        assert_eq!(r[0]["reason"], "tc_pass_no_service");
        let r = trace(&[
            "--manifests",
            d,
            "--src",
            src,
            "--dst",
            &dst,
            "--ping",
            "--no-echo-reply",
        ]);
        assert_eq!(r[0]["verdict"], "pass", "{r:?}");
        assert_eq!(r[0]["reply"], serde_json::Value::Null);
    }
    let out = Command::new(LB)
        .args(["trace", "--manifests", d, "--src", "198.18.10.2"])
        .args(["--dst", "198.19.0.10:0", "--ping"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("verdict:     echo-reply")
            && text.contains("ICMP echo reply 198.19.0.10 → 198.18.10.2"),
        "{text}"
    );
}
