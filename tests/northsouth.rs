//! North-south end to end: an external client reaches NodePorts and LoadBalancer IPs of a node
//! running `lb run`, whose endpoints are partly local pods and partly behind a second node;
//! kube-proxy's rules for that traffic, checked by which backend answered and which source
//! address it saw, for TCP and UDP over IPv4 and IPv6. Run once with the tc path alone on the
//! external device (`--xdp off`) and once with native XDP in front of it. Needs root.
//!
//! ```text
//!   client ── l<id>c ─┐                       ┌─ l<id>b1 ── b1   (pod on node-a)
//!   198.18.10.2       │  node-a (lb)          ├─ l<id>b2 ── b2   (pod on node-a)
//!                     └─ 198.18.10.1 ─────────┴─ l<id>b3 ── b3 = node-b ── podb  (pod on node-b)
//!                        NodePort address                     198.18.13.2    198.18.70.2
//! ```
use std::{
    collections::BTreeSet,
    fmt::Write as _,
    fs,
    io::{BufRead as _, BufReader},
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use lb_common::metrics;
use lb_tests::{
    bins::{LB, LB_ECHO},
    daemon::LbDaemon,
    netns::{in_netns, ip, set_gro, set_tx_checksum},
    testbed::{HOST_IF, Testbed},
};

const ECHO_PORT: u16 = 8080;
const NODE_A: &str = "node-a";
const NODE_B: &str = "node-b";
/// The pod behind node-b.
const REMOTE4: &str = "198.18.70.2";
const REMOTE6: &str = "2001:db8:0:70::2";

/// The second node (backend netns b3 turned into a router) and the pod behind it; the pod's
/// netns is removed on drop (the testbed removes b3's, and with it the veth).
struct NodeB {
    pod_ns: String,
}

impl NodeB {
    fn create(tb: &mut Testbed) -> Self {
        let b3 = tb.backends[2].clone();
        let pod_ns = format!("lb-{}-podb", tb.id);
        ip(&["netns", "add", &pod_ns]).unwrap();
        let node_b = Self { pod_ns };
        in_netns(&node_b.pod_ns, || {
            fs::write("/proc/sys/net/ipv6/conf/default/accept_dad", "0")?;
            fs::write("/proc/sys/net/ipv6/conf/all/accept_dad", "0")?;
            Ok(())
        })
        .unwrap();
        let (a, b) = (format!("r{}a", tb.id), format!("r{}b", tb.id));
        ip(&[
            "link",
            "add",
            &a,
            "netns",
            &b3.ns,
            "type",
            "veth",
            "peer",
            "name",
            &b,
            "netns",
            &node_b.pod_ns,
        ])
        .unwrap();
        let run = |ns: &str, args: &[&str]| {
            let mut full = vec!["-n", ns];
            full.extend_from_slice(args);
            ip(&full).unwrap();
        };
        // node-b: routes between node-a's link and its pod.
        run(&b3.ns, &["addr", "add", "198.18.70.1/24", "dev", &a]);
        run(
            &b3.ns,
            &[
                "-6",
                "addr",
                "add",
                "2001:db8:0:70::1/64",
                "dev",
                &a,
                "nodad",
            ],
        );
        run(&b3.ns, &["link", "set", &a, "up"]);
        in_netns(&b3.ns, || {
            fs::write("/proc/sys/net/ipv4/ip_forward", "1")?;
            fs::write("/proc/sys/net/ipv6/conf/all/forwarding", "1")?;
            Ok(())
        })
        .unwrap();
        // The pod: everything in the test ranges via node-b, no default route.
        let pod = node_b.pod_ns.clone();
        run(&pod, &["link", "set", "lo", "up"]);
        run(&pod, &["addr", "add", &format!("{REMOTE4}/24"), "dev", &b]);
        run(
            &pod,
            &[
                "-6",
                "addr",
                "add",
                &format!("{REMOTE6}/64"),
                "dev",
                &b,
                "nodad",
            ],
        );
        run(&pod, &["link", "set", &b, "up"]);
        run(
            &pod,
            &["route", "add", "198.18.0.0/15", "via", "198.18.70.1"],
        );
        run(
            &pod,
            &[
                "-6",
                "route",
                "add",
                "2001:db8::/32",
                "via",
                "2001:db8:0:70::1",
            ],
        );
        // node-a: node-b's pod range via node-b.
        let node = tb.node_ns.clone();
        run(
            &node,
            &[
                "route",
                "add",
                "198.18.70.0/24",
                "via",
                &b3.ipv4.to_string(),
            ],
        );
        run(
            &node,
            &[
                "-6",
                "route",
                "add",
                "2001:db8:0:70::/64",
                "via",
                &b3.ipv6.to_string(),
            ],
        );
        // The pod's echo server answers as `remote`.
        let mut cmd = Command::new(LB_ECHO);
        cmd.args([
            "serve",
            "--name",
            "remote",
            "--port",
            &ECHO_PORT.to_string(),
        ])
        .stdout(Stdio::piped());
        #[expect(
            clippy::zombie_processes,
            reason = "the testbed kills and reaps what it spawned when it drops"
        )]
        let mut child = tb.spawn(&pod, None, cmd).unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert!(line.starts_with("ready"), "remote echo: {line:?}");
        node_b
    }
}

impl Drop for NodeB {
    fn drop(&mut self) {
        if let Err(e) = ip(&["netns", "del", &self.pod_ns]) {
            eprintln!("teardown: {e:#}");
        }
    }
}

/// A NodePort or LoadBalancer service (dual-stack, TCP 80 and UDP 53 to 8080, NodePorts
/// `tcp`/`udp`) with `eps` as its endpoints: (IPv4, IPv6, node).
struct Svc<'a> {
    name: &'a str,
    cluster_ip: u8,
    node_ports: (u16, u16),
    local_policy: bool,
    /// LoadBalancer ingress IPs' last byte (198.19.1.N, 2001:db8:ffff:1::N) and source ranges.
    lb: Option<(u8, &'a [&'a str])>,
    eps: &'a [(&'a str, &'a str, &'a str)],
}

impl Svc<'_> {
    fn yaml(&self) -> String {
        let mut y = String::new();
        let ty = if self.lb.is_some() {
            "LoadBalancer"
        } else {
            "NodePort"
        };
        let etp = if self.local_policy {
            "Local"
        } else {
            "Cluster"
        };
        let (c, (tcp, udp)) = (self.cluster_ip, self.node_ports);
        let _ = write!(
            y,
            "apiVersion: v1\nkind: Service\nmetadata: {{name: {n}, namespace: ns}}\nspec:\n  \
             type: {ty}\n  externalTrafficPolicy: {etp}\n  clusterIP: 198.19.0.{c}\n  \
             clusterIPs: [198.19.0.{c}, \"2001:db8:ffff::{c}\"]\n  ipFamilyPolicy: \
             PreferDualStack\n  ipFamilies: [IPv4, IPv6]\n  ports:\n    - {{name: tcp, \
             protocol: TCP, port: 80, targetPort: 8080, nodePort: {tcp}}}\n    - {{name: udp, \
             protocol: UDP, port: 53, targetPort: 8080, nodePort: {udp}}}\n",
            n = self.name
        );
        if let Some((ip, ranges)) = self.lb {
            if !ranges.is_empty() {
                let _ = writeln!(y, "  loadBalancerSourceRanges: [{}]", ranges.join(", "));
            }
            let _ = write!(
                y,
                "status:\n  loadBalancer:\n    ingress: [{{ip: 198.19.1.{ip}}}, {{ip: \
                 \"2001:db8:ffff:1::{ip}\"}}]\n"
            );
        }
        for (family, pick) in [("IPv4", 0usize), ("IPv6", 1)] {
            let _ = write!(
                y,
                "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: \
                 {n}-{family}\n  namespace: ns\n  labels: {{kubernetes.io/service-name: {n}}}\n\
                 addressType: {family}\nports: [{{name: tcp, protocol: TCP, port: 8080}}, {{name: \
                 udp, protocol: UDP, port: 8080}}]\nendpoints:\n",
                n = self.name
            );
            if self.eps.is_empty() {
                y.push_str("  []\n");
            }
            for (v4, v6, node) in self.eps {
                let addr = if pick == 0 { v4 } else { v6 };
                let _ = writeln!(
                    y,
                    "  - {{addresses: [\"{addr}\"], nodeName: {node}, conditions: {{ready: true}}}}"
                );
            }
        }
        y
    }
}

const B1: (&str, &str, &str) = ("198.18.11.2", "2001:db8:0:11::2", NODE_A);
const B2: (&str, &str, &str) = ("198.18.12.2", "2001:db8:0:12::2", NODE_A);
const REMOTE: (&str, &str, &str) = (REMOTE4, REMOTE6, NODE_B);

const SERVICES: [Svc<'static>; 7] = [
    // eTP=Cluster: any endpoint, masqueraded to the node IP.
    Svc {
        name: "np-cluster",
        cluster_ip: 30,
        node_ports: (30080, 30053),
        local_policy: false,
        lb: None,
        eps: &[B1, REMOTE],
    },
    // eTP=Local: local endpoints only, client address kept.
    Svc {
        name: "np-local",
        cluster_ip: 31,
        node_ports: (30081, 30054),
        local_policy: true,
        lb: None,
        eps: &[B2, REMOTE],
    },
    // eTP=Local, every endpoint elsewhere: DROP.
    Svc {
        name: "np-elsewhere",
        cluster_ip: 32,
        node_ports: (30082, 30055),
        local_policy: true,
        lb: None,
        eps: &[REMOTE],
    },
    // No endpoints at all: REJECT.
    Svc {
        name: "np-empty",
        cluster_ip: 33,
        node_ports: (30083, 30056),
        local_policy: false,
        lb: None,
        eps: &[],
    },
    // eTP=Local LoadBalancer: external clients get local endpoints; pods short-circuit to all.
    Svc {
        name: "lb-local",
        cluster_ip: 34,
        node_ports: (30084, 30057),
        local_policy: true,
        lb: Some((41, &[])),
        eps: &[B2, REMOTE],
    },
    // Source ranges that leave the client out: DROP.
    Svc {
        name: "lb-denied",
        cluster_ip: 35,
        node_ports: (30085, 30058),
        local_policy: false,
        lb: Some((42, &["198.18.99.0/24", "\"2001:db8:99::/64\""])),
        eps: &[B1],
    },
    // Source ranges that hold the client.
    Svc {
        name: "lb-allowed",
        cluster_ip: 36,
        node_ports: (30086, 30059),
        local_policy: false,
        lb: Some((43, &["198.18.10.0/24", "\"2001:db8:0:10::/64\""])),
        eps: &[B1],
    },
];

/// What `lb-echo client` in `ns` got per reply: the backend, the client address it saw (IP)
/// and the peer the application saw; and the errors.
#[derive(Debug, Default)]
struct Replies {
    ok: Vec<(String, String, String)>,
    errors: Vec<String>,
}

fn echo(
    tb: &mut Testbed,
    ns: &str,
    target: &str,
    proto: &str,
    count: usize,
    extra: &[&str],
) -> Replies {
    let mut cmd = Command::new(LB_ECHO);
    cmd.args(["client", "--target", target, "--proto", proto])
        .args(["--count", &count.to_string()])
        .args(extra);
    let out = tb.run(ns, None, cmd).expect("run client");
    let mut r = Replies::default();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let v: serde_json::Value = serde_json::from_str(line).expect("client JSON");
        if let Some(e) = v.get("error") {
            r.errors.push(e.to_string());
            continue;
        }
        let seen: std::net::SocketAddr = v["seen_by_backend"].as_str().unwrap().parse().unwrap();
        r.ok.push((
            v["backend"].as_str().unwrap().to_string(),
            seen.ip().to_string(),
            v["peer"].as_str().unwrap().to_string(),
        ));
    }
    assert_eq!(
        r.ok.len() + r.errors.len(),
        count,
        "{target}/{proto}: one line per request; stderr {}",
        String::from_utf8_lossy(&out.stderr)
    );
    r
}

/// The four targets of a frontend: (`IP:PORT` for TCP, for UDP) per family.
fn targets(v4: &str, v6: &str, (tcp, udp): (u16, u16)) -> [(String, &'static str, bool); 4] {
    [
        (format!("{v4}:{tcp}"), "tcp", false),
        (format!("{v4}:{udp}"), "udp", false),
        (format!("[{v6}]:{tcp}"), "tcp", true),
        (format!("[{v6}]:{udp}"), "udp", true),
    ]
}

/// Every request to the four targets answered by a backend in `backends` (all of them reached),
/// which saw the client as `seen` (per family), and the reply came from the target.
fn assert_served(
    tb: &mut Testbed,
    ns: &str,
    what: &str,
    targets: &[(String, &str, bool)],
    backends: &[&str],
    seen: (&str, &str),
) {
    for (target, proto, v6) in targets {
        let r = echo(tb, ns, target, proto, 20, &[]);
        assert!(r.errors.is_empty(), "{what} {target}/{proto}: {r:?}");
        let reached: BTreeSet<&str> = r.ok.iter().map(|(b, _, _)| b.as_str()).collect();
        let want: BTreeSet<&str> = backends.iter().copied().collect();
        assert_eq!(reached, want, "{what} {target}/{proto}: backends {r:?}");
        let want_seen = if *v6 { seen.1 } else { seen.0 };
        for (b, s, peer) in &r.ok {
            assert_eq!(s, want_seen, "{what} {target}/{proto}: {b} saw {s}");
            assert_eq!(
                peer, target,
                "{what} {target}/{proto}: reply from the frontend"
            );
        }
    }
}

/// Every request to the targets fails: with ECONNREFUSED (`refused`) or by timing out.
fn assert_fails(tb: &mut Testbed, what: &str, targets: &[(String, &str, bool)], refused: bool) {
    let ns = tb.client.ns.clone();
    for (target, proto, _) in targets {
        // Connected UDP, so an ICMP port unreachable surfaces as ECONNREFUSED.
        let r = echo(
            tb,
            &ns,
            target,
            proto,
            3,
            &["--connected-udp", "--timeout-ms", "300"],
        );
        assert_eq!(
            r.errors.len(),
            3,
            "{what} {target}/{proto}: all fail: {r:?}"
        );
        for e in &r.errors {
            assert_eq!(
                e.contains("os error 111)"),
                refused,
                "{what} {target}/{proto}: refused={refused} expected, got {e}"
            );
        }
    }
}

struct ManifestDir(PathBuf);

impl Drop for ManifestDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// Node-a running `lb run` (tc on every pod veth, `--xdp xdp` on the client's link, the node
/// IP on that link) from manifests holding `services`, node-b with its pod, echo servers
/// everywhere. Fields drop in order: lb first, the testbed last.
struct TwoNodes {
    lb: LbDaemon,
    _dir: ManifestDir,
    _node_b: NodeB,
    tb: Testbed,
}

fn two_nodes(xdp: &str, services: &[Svc]) -> TwoNodes {
    let mut tb = Testbed::create(3).expect("testbed");
    tb.start_echo_servers(Path::new(LB_ECHO), ECHO_PORT)
        .expect("echo servers");
    let node_b = NodeB::create(&mut tb);
    // The external client sends complete checksums, as a packet from another machine has
    // (a veth would hand its peer CHECKSUM_PARTIAL skbs, which only local traffic is).
    let client_ns = tb.client.ns.clone();
    in_netns(&client_ns, || set_tx_checksum(HOST_IF, false)).unwrap();
    if xdp != "off" {
        // XDP frames redirected or sent back into a veth arrive only if its peer has NAPI.
        for h in [
            &tb.client,
            &tb.backends[0],
            &tb.backends[1],
            &tb.backends[2],
        ] {
            in_netns(&h.ns, || set_gro(HOST_IF, true)).unwrap();
        }
    }
    let dir = ManifestDir(std::env::temp_dir().join(format!("lb-test-ns-{}", tb.id)));
    fs::create_dir_all(&dir.0).unwrap();
    for s in services {
        fs::write(dir.0.join(format!("{}.yaml", s.name)), s.yaml()).unwrap();
    }
    let node_ips = format!("{},{}", tb.client.node_ipv4(), tb.client.node_ipv6());
    let manifests = dir.0.display().to_string();
    let pods: Vec<String> = tb.backends.iter().map(|b| b.node_if.clone()).collect();
    let pod_ifs = pods.join(",");
    let external = tb.client.node_if.clone();
    let args = [
        "--manifests",
        manifests.as_str(),
        "--hostname-override",
        NODE_A,
        "--socket-lb=false",
        "--node-ip",
        node_ips.as_str(),
        "--devices",
        external.as_str(),
        "--xdp",
        xdp,
        "--tc-pod",
        pod_ifs.as_str(),
    ];
    let lb = LbDaemon::start(&mut tb, Path::new(LB), &args, "info").unwrap();
    TwoNodes {
        lb,
        _dir: dir,
        _node_b: node_b,
        tb,
    }
}

fn north_south(xdp: &str) {
    let TwoNodes {
        lb,
        _dir,
        _node_b,
        mut tb,
    } = two_nodes(xdp, &SERVICES);
    let client_ns = tb.client.ns.clone();
    let (node4, node6) = (
        tb.client.node_ipv4().to_string(),
        tb.client.node_ipv6().to_string(),
    );
    let (client4, client6) = (tb.client.ipv4.to_string(), tb.client.ipv6.to_string());
    let attached = lb
        .log
        .iter()
        .find(|l| l.contains(" ready"))
        .cloned()
        .unwrap_or_default();
    if xdp == "off" {
        assert!(!attached.contains("lb_xdp"), "{attached}");
    } else {
        assert!(attached.contains(&format!("lb_xdp ({xdp})")), "{attached}");
    }
    let pod_ns = tb.backends[0].ns.clone();
    let np = |s: &Svc| targets(&node4, &node6, s.node_ports);
    let lb_ip = |n: u8| {
        targets(
            &format!("198.19.1.{n}"),
            &format!("2001:db8:ffff:1::{n}"),
            (80, 53),
        )
    };
    let what = format!("xdp={xdp}");

    // eTP=Cluster NodePort: local and remote endpoints, masqueraded to the node IP.
    let t = np(&SERVICES[0]);
    assert_served(
        &mut tb,
        &client_ns,
        &format!("{what} np-cluster"),
        &t,
        &["b1", "remote"],
        (&node4, &node6),
    );
    // eTP=Local NodePort: only the local endpoint, client address kept.
    let t = np(&SERVICES[1]);
    assert_served(
        &mut tb,
        &client_ns,
        &format!("{what} np-local"),
        &t,
        &["b2"],
        (&client4, &client6),
    );
    // eTP=Local without a local endpoint: dropped, not rejected.
    let before = lb.counter(metrics::TC_DROP_NO_LOCAL_BACKEND).unwrap();
    assert_fails(
        &mut tb,
        &format!("{what} np-elsewhere"),
        &np(&SERVICES[2]),
        false,
    );
    assert!(lb.counter(metrics::TC_DROP_NO_LOCAL_BACKEND).unwrap() >= before + 12);
    // No endpoints at all: rejected.
    assert_fails(
        &mut tb,
        &format!("{what} np-empty"),
        &np(&SERVICES[3]),
        true,
    );
    // eTP=Local LoadBalancer IP: external clients get the local endpoint...
    let t = lb_ip(41);
    assert_served(
        &mut tb,
        &client_ns,
        &format!("{what} lb-local"),
        &t,
        &["b2"],
        (&client4, &client6),
    );
    // ...pods short-circuit to every endpoint, unmasqueraded.
    let (pod4, pod6) = (
        tb.backends[0].ipv4.to_string(),
        tb.backends[0].ipv6.to_string(),
    );
    assert_served(
        &mut tb,
        &pod_ns,
        &format!("{what} lb-local from a pod"),
        &t,
        &["b2", "remote"],
        (&pod4, &pod6),
    );
    // loadBalancerSourceRanges: a client outside is dropped, one inside served.
    let before = lb.counter(metrics::TC_DROP_SOURCE_RANGE).unwrap();
    assert_fails(&mut tb, &format!("{what} lb-denied"), &lb_ip(42), false);
    assert!(lb.counter(metrics::TC_DROP_SOURCE_RANGE).unwrap() >= before + 12);
    let t = lb_ip(43);
    assert_served(
        &mut tb,
        &client_ns,
        &format!("{what} lb-allowed"),
        &t,
        &["b1"],
        (&node4, &node6),
    );

    // Which program did the work.
    let xdp_sent =
        lb.counter(metrics::XDP_REDIRECT).unwrap() + lb.counter(metrics::XDP_TX).unwrap();
    if xdp == "off" {
        assert_eq!(xdp_sent, 0, "no XDP program, nothing sent by one");
    } else {
        assert!(
            xdp_sent > 0,
            "masqueraded NodePort flows are redirected by XDP"
        );
    }
    drop(lb);
}

#[test]
fn north_south_on_the_tc_path() {
    north_south("off");
}

#[test]
fn north_south_with_native_xdp() {
    // Kernel-gated: before 5.13 a veth drops XDP frames redirected or sent to it unless its
    // peer runs an XDP program (5.13 lets GRO give it the NAPI instance instead), so this
    // topology cannot work there; `--xdp auto` keeps veths on tc for that reason.
    if aya::util::KernelVersion::current()
        .is_ok_and(|v| v < aya::util::KernelVersion::new(5, 13, 0))
    {
        eprintln!("skipped before 5.13: veth peers need an XDP program to receive XDP frames");
        return;
    }
    north_south("native");
}

/// Network namespaces a test adds beside its testbed's, removed on drop (with their veths).
struct ExtraNs(Vec<String>);

impl ExtraNs {
    fn add(&mut self, name: String) {
        ip(&["netns", "add", &name]).unwrap();
        self.0.push(name.clone());
        in_netns(&name, || {
            fs::write("/proc/sys/net/ipv6/conf/default/accept_dad", "0")?;
            fs::write("/proc/sys/net/ipv6/conf/all/accept_dad", "0")?;
            Ok(())
        })
        .unwrap();
    }
}

impl Drop for ExtraNs {
    fn drop(&mut self) {
        for ns in self.0.drain(..).rev() {
            if let Err(e) = ip(&["netns", "del", &ns]) {
                eprintln!("teardown: {e:#}");
            }
        }
    }
}

/// The CNI bridge plugin's layout in the node netns: a bridge holding the pods' gateway
/// addresses, each pod's veth a port of it.
const BRIDGE4: &str = "198.18.80.1";
const BRIDGE6: &str = "2001:db8:0:80::1";

/// Pod `n` (`198.18.80.<n>`, `2001:db8:0:80::<n>`) in netns `lb-<id>-pod<n>`, its veth
/// `v<id>p<n>` a port of `bridge`, serving lb-echo as `pod<n>` on ECHO_PORT. Returns the veth.
fn bridged_pod(tb: &mut Testbed, extra: &mut ExtraNs, bridge: &str, n: u8) -> String {
    let ns = format!("lb-{}-pod{n}", tb.id);
    extra.add(ns.clone());
    let veth = format!("v{}p{n}", tb.id);
    let node = tb.node_ns.clone();
    let (pod4, pod6) = (
        format!("198.18.80.{n}/24"),
        format!("2001:db8:0:80::{n}/64"),
    );
    let cmds: [Vec<&str>; 10] = [
        vec![
            "-n", &node, "link", "add", &veth, "type", "veth", "peer", "name", HOST_IF, "netns",
            &ns,
        ],
        vec!["-n", &node, "link", "set", &veth, "master", bridge],
        vec!["-n", &node, "link", "set", &veth, "up"],
        vec!["-n", &ns, "link", "set", "lo", "up"],
        vec!["-n", &ns, "addr", "add", &pod4, "dev", HOST_IF],
        vec![
            "-n", &ns, "-6", "addr", "add", &pod6, "dev", HOST_IF, "nodad",
        ],
        vec!["-n", &ns, "link", "set", HOST_IF, "up"],
        vec!["-n", &ns, "route", "add", "198.18.0.0/15", "via", BRIDGE4],
        vec![
            "-n",
            &ns,
            "-6",
            "route",
            "add",
            "2001:db8::/32",
            "via",
            BRIDGE6,
        ],
        vec!["-n", &ns, "link", "show", HOST_IF],
    ];
    for c in &cmds {
        ip(c).unwrap();
    }
    start_echo(tb, &ns, &format!("pod{n}"));
    veth
}

/// Starts `lb-echo serve --name NAME` on ECHO_PORT in `ns` and waits for its `ready` line.
fn start_echo(tb: &mut Testbed, ns: &str, name: &str) {
    let mut cmd = Command::new(LB_ECHO);
    cmd.args(["serve", "--name", name, "--port", &ECHO_PORT.to_string()])
        .stdout(Stdio::piped());
    #[expect(
        clippy::zombie_processes,
        reason = "the testbed kills and reaps what it spawned when it drops"
    )]
    let mut child = tb.spawn(ns, None, cmd).unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(line.starts_with("ready"), "{name} echo: {line:?}");
}

/// A NodePort service (dual-stack, TCP 80 and UDP 53 to 8080) whose endpoints are `eps` on
/// node-a, as YAML.
fn node_port_yaml(
    name: &str,
    cluster_ip: u8,
    node_ports: (u16, u16),
    eps: &[(&str, &str)],
) -> String {
    let eps: Vec<(&str, &str, &str)> = eps.iter().map(|(a, b)| (*a, *b, NODE_A)).collect();
    Svc {
        name,
        cluster_ip,
        node_ports,
        local_policy: false,
        lb: None,
        eps: &eps,
    }
    .yaml()
}

/// Real-node layout (CNI `bridge` plugin): the pods' veths are ports of a bridge in the node
/// netns, and lb runs as the DaemonSet starts it, `--devices <uplink>` and no `--tc-*` list. An
/// external client's NodePort flow to a local pod is masqueraded to the node IP; the pod's
/// reply comes back through its veth and must meet reverse NAT there without anyone listing
/// the device: `--pod-devices auto` (the default) attaches `lb_tc_pod` to every veth that is no
/// external device, also to one created after lb started (the link watch).
#[test]
fn node_port_to_a_bridged_pod_with_pod_devices_found_by_lb() {
    let mut tb = Testbed::create(0).expect("testbed");
    let mut extra = ExtraNs(Vec::new());
    let client_ns = tb.client.ns.clone();
    in_netns(&client_ns, || set_tx_checksum(HOST_IF, false)).unwrap();
    let node = tb.node_ns.clone();
    let bridge = format!("br{}", tb.id);
    for c in [
        vec!["-n", &node, "link", "add", &bridge, "type", "bridge"],
        vec!["-n", &node, "addr", "add", "198.18.80.1/24", "dev", &bridge],
        vec![
            "-n",
            &node,
            "-6",
            "addr",
            "add",
            "2001:db8:0:80::1/64",
            "dev",
            &bridge,
            "nodad",
        ],
        vec!["-n", &node, "link", "set", &bridge, "up"],
    ] {
        ip(&c).unwrap();
    }
    let veth1 = bridged_pod(&mut tb, &mut extra, &bridge, 2);

    let dir = ManifestDir(std::env::temp_dir().join(format!("lb-test-pods-{}", tb.id)));
    fs::create_dir_all(&dir.0).unwrap();
    let pod = |n: u8| (format!("198.18.80.{n}"), format!("2001:db8:0:80::{n}"));
    let (p2, p3) = (pod(2), pod(3));
    fs::write(
        dir.0.join("np-pod2.yaml"),
        node_port_yaml("np-pod2", 50, (31080, 31053), &[(&p2.0, &p2.1)]),
    )
    .unwrap();
    fs::write(
        dir.0.join("np-pod3.yaml"),
        node_port_yaml("np-pod3", 51, (31081, 31054), &[(&p3.0, &p3.1)]),
    )
    .unwrap();
    let (node4, node6) = (
        tb.client.node_ipv4().to_string(),
        tb.client.node_ipv6().to_string(),
    );
    let node_ips = format!("{node4},{node6}");
    let manifests = dir.0.display().to_string();
    let external = tb.client.node_if.clone();
    // As the DaemonSet starts lb: the uplink, nothing about pods.
    let args = [
        "--manifests",
        manifests.as_str(),
        "--hostname-override",
        NODE_A,
        "--socket-lb=false",
        "--node-ip",
        node_ips.as_str(),
        "--devices",
        external.as_str(),
        "--xdp",
        "off",
    ];
    let mut lb = LbDaemon::start(&mut tb, Path::new(LB), &args, "info").unwrap();
    let attached = |lb: &LbDaemon, veth: &str| {
        lb.log
            .iter()
            .any(|l| l.contains("lb_tc_pod attached") && l.contains(veth))
    };
    assert!(attached(&lb, &veth1), "{}", lb.log.join("\n"));
    assert!(
        !lb.log
            .iter()
            .any(|l| l.contains("lb_tc_pod attached") && l.contains(&external)),
        "the external device is no pod device"
    );

    let t = targets(&node4, &node6, (31080, 31053));
    assert_served(
        &mut tb,
        &client_ns,
        "bridged pod2",
        &t,
        &["pod2"],
        (&node4, &node6),
    );

    // A pod started after lb: its veth is found by the link watch.
    let veth2 = bridged_pod(&mut tb, &mut extra, &bridge, 3);
    lb.wait_for(
        |l| l.contains("lb_tc_pod attached") && l.contains(&veth2),
        "lb_tc_pod on the new pod's veth",
    )
    .unwrap();
    let t = targets(&node4, &node6, (31081, 31054));
    assert_served(
        &mut tb,
        &client_ns,
        "bridged pod3 (created after lb)",
        &t,
        &["pod3"],
        (&node4, &node6),
    );
    // A pod that goes away takes its attachment along; lb keeps serving the others.
    ip(&["-n", &node, "link", "del", &veth2]).unwrap();
    let t = targets(&node4, &node6, (31080, 31053));
    assert_served(
        &mut tb,
        &client_ns,
        "bridged pod2 after pod3 left",
        &t,
        &["pod2"],
        (&node4, &node6),
    );
    // A restart adopts the pod devices' pinned links (and drops the gone one's).
    lb.keep_dirs();
    lb.stop().unwrap();
    drop(lb);
    let mut lb = LbDaemon::start(&mut tb, Path::new(LB), &args, "info").unwrap();
    assert!(attached(&lb, &veth1), "{}", lb.log.join("\n"));
    assert!(
        lb.log
            .iter()
            .any(|l| l.contains(" ready") && l.contains(&format!("lb_tc_pod on {veth1} (adopted)"))),
        "{}",
        lb.log.join("\n")
    );
    assert_served(
        &mut tb,
        &client_ns,
        "bridged pod2 after a restart",
        &t,
        &["pod2"],
        (&node4, &node6),
    );
    lb.drain();
    drop(lb);
    drop(extra);
}

/// A NodePort whose only endpoint is a hostNetwork pod of this node: its address is the node
/// IP, so the flow is DNATed only (never masqueraded: the stack would drop a packet from the
/// node IP as a martian, and there is no route to forward it on) and delivered to the local
/// socket; the reply leaves through the external device, whose `lb_tc_egress` restores the
/// NodePort. `lb trace` shows the decision. TCP and UDP, IPv4 and IPv6.
fn node_port_to_a_host_network_endpoint(xdp: &str) {
    let mut tb = Testbed::create(0).expect("testbed");
    let client_ns = tb.client.ns.clone();
    in_netns(&client_ns, || set_tx_checksum(HOST_IF, false)).unwrap();
    if xdp != "off" {
        in_netns(&client_ns, || set_gro(HOST_IF, true)).unwrap();
    }
    let node_ns = tb.node_ns.clone();
    start_echo(&mut tb, &node_ns, "host");
    let (node4, node6) = (
        tb.client.node_ipv4().to_string(),
        tb.client.node_ipv6().to_string(),
    );
    let (client4, client6) = (tb.client.ipv4.to_string(), tb.client.ipv6.to_string());
    let dir = ManifestDir(std::env::temp_dir().join(format!("lb-test-hostnet-{}", tb.id)));
    fs::create_dir_all(&dir.0).unwrap();
    fs::write(
        dir.0.join("np-host.yaml"),
        node_port_yaml("np-host", 52, (31090, 31091), &[(&node4, &node6)]),
    )
    .unwrap();
    let node_ips = format!("{node4},{node6}");
    let manifests = dir.0.display().to_string();
    let external = tb.client.node_if.clone();
    let args = [
        "--manifests",
        manifests.as_str(),
        "--hostname-override",
        NODE_A,
        "--socket-lb=false",
        "--node-ip",
        node_ips.as_str(),
        "--devices",
        external.as_str(),
        "--xdp",
        xdp,
    ];
    let lb = LbDaemon::start(&mut tb, Path::new(LB), &args, "info").unwrap();
    let ready = lb
        .log
        .iter()
        .find(|l| l.contains(" ready"))
        .cloned()
        .unwrap_or_default();
    assert!(
        ready.contains(&format!("lb_tc_egress on {external}")),
        "{ready}"
    );
    let t = targets(&node4, &node6, (31090, 31091));
    // The server sees the client itself, as with kube-proxy (no masquerade for local delivery).
    assert_served(
        &mut tb,
        &client_ns,
        &format!("xdp={xdp} hostNetwork endpoint"),
        &t,
        &["host"],
        (&client4, &client6),
    );
    assert!(lb.counter(metrics::TC_LOCAL_BACKEND).unwrap() >= 4 * 20);
    assert_eq!(lb.counter(metrics::TC_SNAT_NO_ROUTE).unwrap(), 0);

    // `lb trace` on the live node says why.
    let pin = lb.pin_dir.display().to_string();
    for (src, dst) in [
        (client4.clone(), format!("{node4}:31090")),
        (client6.clone(), format!("[{node6}]:31090")),
    ] {
        let mut cmd = Command::new(LB);
        cmd.args(["trace", "--pin-dir", &pin, "--src", &src, "--dst", &dst])
            .args(["--from", "external", "--json"]);
        let out = tb.run(&node_ns, None, cmd).unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let r: serde_json::Value =
            serde_json::from_str(String::from_utf8_lossy(&out.stdout).lines().next().unwrap())
                .unwrap();
        assert_eq!(r["verdict"], "forward", "{r}");
        assert_eq!(r["masquerade"], false, "{r}");
        assert_eq!(r["local_backend"], true, "{r}");
        assert_eq!(r["reason"], "tc_forward_new", "{r}");
        let mut cmd = Command::new(LB);
        cmd.args(["trace", "--pin-dir", &pin, "--src", &src, "--dst", &dst])
            .args(["--from", "external"]);
        let text =
            String::from_utf8_lossy(&tb.run(&node_ns, None, cmd).unwrap().stdout).into_owned();
        assert!(
            text.contains("not masqueraded: the backend is an address of this node"),
            "{text}"
        );
    }
    drop(lb);
}

#[test]
fn node_port_to_a_host_network_endpoint_on_the_tc_path() {
    node_port_to_a_host_network_endpoint("off");
}

#[test]
fn node_port_to_a_host_network_endpoint_with_native_xdp() {
    if aya::util::KernelVersion::current()
        .is_ok_and(|v| v < aya::util::KernelVersion::new(5, 13, 0))
    {
        eprintln!("skipped before 5.13: veth peers need an XDP program to receive XDP frames");
        return;
    }
    node_port_to_a_host_network_endpoint("native");
}

/// Path-MTU discovery through lb: a long-lived TCP connection whose path MTU drops mid-stream
/// (node-b, a router, lowers its link to the pod behind it to 1280 between two bulk uploads)
/// still completes the second upload, because the router's "fragmentation needed" / "packet
/// too big" reaches the sender quoting its own packet to the service (`icmp` in lb-ebpf):
/// a pod's ClusterIP flow on the tc path (not masqueraded), and an external client's NodePort
/// flow that XDP (or tc ingress) balanced and masqueraded. IPv4 and IPv6. Without the
/// translation the sender's socket never hears of the error and the upload stalls.
fn path_mtu_drop_mid_stream(xdp: &str) {
    let svc = Svc {
        name: "np-remote",
        cluster_ip: 37,
        node_ports: (30087, 30060),
        local_policy: false,
        lb: None,
        eps: &[REMOTE],
    };
    let TwoNodes {
        lb,
        _dir: dir,
        _node_b,
        mut tb,
    } = two_nodes(xdp, &[svc]);
    let client_ns = tb.client.ns.clone();
    let (node4, node6) = (
        tb.client.node_ipv4().to_string(),
        tb.client.node_ipv6().to_string(),
    );
    let router_ns = tb.backends[2].ns.clone();
    let router_if = format!("r{}a", tb.id);
    let set_mtu = |mtu: &str| ip(&["-n", &router_ns, "link", "set", &router_if, "mtu", mtu]);
    let pod_ns = tb.backends[0].ns.clone();
    let cases = [
        (pod_ns.clone(), "198.19.0.37:80".to_string(), "ClusterIP"),
        (pod_ns, "[2001:db8:ffff::37]:80".to_string(), "ClusterIP"),
        (client_ns.clone(), format!("{node4}:30087"), "NodePort"),
        (client_ns, format!("[{node6}]:30087"), "NodePort"),
    ];
    for (ns, target, kind) in cases {
        let what = format!("xdp={xdp} {kind} {target}");
        set_mtu("1500").unwrap();
        let before = lb.counter(metrics::TC_ICMP_ERROR_REVNAT).unwrap();
        let go = dir
            .0
            .join(format!("go-{}", target.replace([':', '[', ']'], "_")));
        let mut cmd = Command::new(LB_ECHO);
        cmd.args(["client", "--target", &target, "--proto", "tcp"])
            .args(["--count", "2", "--keep-connection", "--timeout-ms", "20000"])
            .args(["--payload-bytes", "2000000"])
            .arg("--go-file")
            .arg(&go)
            .stdout(Stdio::piped());
        let mut child = tb.spawn(&ns, None, cmd).unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let first = lines.next().expect("first reply").unwrap();
        assert!(first.contains("\"backend\":\"remote\""), "{what}: {first}");
        // The path shrinks under the open connection.
        set_mtu("1280").unwrap();
        fs::write(&go, "").unwrap();
        let second = lines.next().expect("second reply").unwrap();
        assert!(
            second.contains("\"backend\":\"remote\""),
            "{what}: the upload after the MTU drop: {second}"
        );
        assert!(child.wait().unwrap().success(), "{what}");
        let translated = lb.counter(metrics::TC_ICMP_ERROR_REVNAT).unwrap() - before;
        assert!(
            translated >= 1,
            "{what}: the router's error was translated ({translated})"
        );
    }
    set_mtu("1500").unwrap();
    drop(lb);
}

#[test]
fn path_mtu_drop_mid_stream_on_the_tc_path() {
    path_mtu_drop_mid_stream("off");
}

#[test]
fn path_mtu_drop_mid_stream_with_native_xdp() {
    // Kernel-gated as `north_south_with_native_xdp`.
    if aya::util::KernelVersion::current()
        .is_ok_and(|v| v < aya::util::KernelVersion::new(5, 13, 0))
    {
        eprintln!("skipped before 5.13: veth peers need an XDP program to receive XDP frames");
        return;
    }
    path_mtu_drop_mid_stream("native");
}
