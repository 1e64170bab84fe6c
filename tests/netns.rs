//! End-to-end tests in network namespaces: a client and three backends wired to a node netns
//! where `lb run` loads and attaches the real programs; real sockets, real packets. Run once
//! with socket LB only (the client sits in the test's cgroup, no tc program) and once with the
//! tc path only (no cgroup hooks), so each mechanism has to carry the traffic by itself.
//! Needs root.
use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    thread,
    time::Duration,
};

use aya::maps::{HashMap, Map, MapData};
use lb_common::{
    Backend4, Backend6, Ct4Key, Ct4Value, Ct6Key, Ct6Value, Svc4Key, SvcValue, ct_dir, ct_flags,
    map_names, metrics, scope, svc_flags,
};
use lb_tests::{
    bins::{LB, LB_ECHO},
    daemon::LbDaemon,
    metrics::{HEALTH, METRICS, http_get, sample},
    testbed::Testbed,
};

const ECHO_PORT: u16 = 8080;
const REQUESTS: usize = 30;

fn lb_args(tb: &Testbed, manifests: &Path, socket_lb: bool) -> Vec<String> {
    let mut args = vec!["--manifests".to_string(), manifests.display().to_string()];
    if socket_lb {
        args.extend(["--cgroup-path".into(), tb.cgroup.display().to_string()]);
    } else {
        args.extend([
            "--socket-lb=false".into(),
            "--tc-pod".into(),
            tb.node_ifaces().join(","),
        ]);
    }
    args
}

/// `lb run` in the node netns, started without waiting.
fn spawn_lb(tb: &mut Testbed, manifests: &Path, socket_lb: bool) -> LbDaemon {
    let args = lb_args(tb, manifests, socket_lb);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    LbDaemon::spawn(tb, Path::new(LB), &args, "info").unwrap()
}

/// `lb run` in the node netns, waited for until ready.
fn start_lb(tb: &mut Testbed, manifests: &Path, socket_lb: bool) -> LbDaemon {
    let mut lb = spawn_lb(tb, manifests, socket_lb);
    lb.wait_for(|l| l.contains(" ready"), "ready").unwrap();
    lb
}

/// SIGHUP, then wait for the sync of `generation`.
fn reload(lb: &mut LbDaemon, generation: u64) {
    lb.signal(nix::sys::signal::Signal::SIGHUP).unwrap();
    let want = format!("generation={generation}");
    lb.wait_for(|l| l.contains("synced") && l.contains(&want), &want)
        .unwrap();
}

/// A temporary copy of deploy/examples, removed on drop.
struct Manifests(PathBuf);

impl Manifests {
    fn new(id: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("lb-test-manifests-{id}"));
        fs::create_dir_all(&dir).unwrap();
        let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/examples");
        for entry in fs::read_dir(examples).unwrap() {
            let path = entry.unwrap().path();
            fs::copy(&path, dir.join(path.file_name().unwrap())).unwrap();
        }
        Self(dir)
    }

    /// Removes every endpoint whose address contains one of `needles` from the slices.
    fn remove_endpoints(&self, needles: &[&str]) {
        self.edit_endpoints(needles, |_| None);
    }

    /// Gives every endpoint whose address contains one of `needles` the `conditions` (a YAML
    /// flow mapping).
    fn set_conditions(&self, needles: &[&str], conditions: &str) {
        self.edit_endpoints(needles, |line| {
            Some(if line.trim_start().starts_with("conditions:") {
                format!("    conditions: {conditions}")
            } else {
                line.to_string()
            })
        });
    }

    /// Rewrites the lines of the endpoints whose address contains one of `needles` with `edit`
    /// (`None` drops the line), atomically: lb watches the directory and must never see half
    /// a file.
    fn edit_endpoints(&self, needles: &[&str], edit: impl Fn(&str) -> Option<String>) {
        let name = "echo-endpointslices.yaml";
        let text = fs::read_to_string(self.0.join(name)).unwrap();
        let mut out = Vec::new();
        let mut hit = false;
        for line in text.lines() {
            if line.trim_start().starts_with("- addresses:") {
                hit = needles.iter().any(|n| line.contains(n));
            } else if !line.starts_with("    ") {
                hit = false;
            }
            if !hit {
                out.push(line.to_string());
            } else if let Some(l) = edit(line) {
                out.push(l);
            }
        }
        let new = out.join("\n");
        assert_ne!(new, text, "no endpoint changed");
        self.add(name, &new);
    }
}

impl Manifests {
    /// Edits the echo Service with `edit` (atomically).
    fn edit_service(&self, edit: impl FnOnce(&str) -> String) {
        let path = self.0.join("echo-service.yaml");
        let text = fs::read_to_string(&path).unwrap();
        let new = edit(&text);
        assert_ne!(new, text, "service unchanged");
        self.add("echo-service.yaml", &new);
    }

    /// Adds the manifest file `name` (atomically).
    fn add(&self, name: &str, text: &str) {
        let tmp = self.0.join(format!(".{name}.tmp"));
        fs::write(&tmp, text).unwrap();
        fs::rename(&tmp, self.0.join(name)).unwrap();
    }
}

impl Drop for Manifests {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// Outcome of `lb-echo client --count N`: replies per backend name and the peers seen.
#[derive(Debug, Default)]
struct Outcome {
    per_backend: BTreeMap<String, usize>,
    peers: BTreeSet<String>,
    errors: Vec<String>,
}

fn client(tb: &mut Testbed, cgroup: bool, target: &str, proto: &str, extra: &[&str]) -> Outcome {
    let mut cmd = Command::new(LB_ECHO);
    cmd.args(["client", "--target", target, "--proto", proto])
        .args(["--count", &REQUESTS.to_string()])
        .args(extra);
    let cg = tb.cgroup.clone();
    let ns = tb.client.ns.clone();
    let out = tb
        .run(&ns, cgroup.then_some(cg.as_path()), cmd)
        .expect("run client");
    let mut outcome = Outcome::default();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let v: serde_json::Value = serde_json::from_str(line).expect("client JSON");
        if let Some(e) = v.get("error") {
            outcome.errors.push(e.to_string());
            continue;
        }
        *outcome
            .per_backend
            .entry(v["backend"].as_str().unwrap().to_string())
            .or_default() += 1;
        outcome
            .peers
            .insert(v["peer"].as_str().unwrap().to_string());
    }
    assert_eq!(
        outcome.per_backend.values().sum::<usize>() + outcome.errors.len(),
        REQUESTS,
        "{target}/{proto}: one line per request; stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    outcome
}

const TARGETS: [(&str, &str); 4] = [
    ("198.19.0.10:80", "tcp"),
    ("198.19.0.10:53", "udp"),
    ("[2001:db8:ffff::10]:80", "tcp"),
    ("[2001:db8:ffff::10]:53", "udp"),
];

fn assert_balanced(tb: &mut Testbed, cgroup: bool, expect: &[&str], extra: &[&str]) {
    for (target, proto) in TARGETS {
        let o = client(tb, cgroup, target, proto, extra);
        assert!(
            o.errors.is_empty(),
            "{target}/{proto}: errors {:?}",
            o.errors
        );
        let reached: Vec<&str> = o.per_backend.keys().map(String::as_str).collect();
        assert_eq!(reached, expect, "{target}/{proto}: backends reached {o:?}");
        assert_eq!(
            o.peers,
            BTreeSet::from([target.to_string()]),
            "{target}/{proto}: the application must see the VIP as its peer"
        );
    }
}

fn balance_then_remove_backend(socket_lb: bool) {
    let mut tb = Testbed::create(3).expect("testbed");
    tb.start_echo_servers(Path::new(LB_ECHO), ECHO_PORT)
        .expect("echo servers");
    let manifests = Manifests::new(&tb.id);
    let mut lb = start_lb(&mut tb, &manifests.0, socket_lb);

    assert_balanced(&mut tb, socket_lb, &["b1", "b2", "b3"], &[]);
    if socket_lb {
        // Connected UDP sockets read replies through recvmsg with the connect()ed peer.
        assert_balanced(
            &mut tb,
            socket_lb,
            &["b1", "b2", "b3"],
            &["--connected-udp"],
        );
    }

    // b3 leaves the service: after the reload no new connection reaches it.
    manifests.remove_endpoints(&["198.18.13.2", "2001:db8:0:13::2"]);
    reload(&mut lb, 2);
    assert_balanced(&mut tb, socket_lb, &["b1", "b2"], &[]);

    // Stopping lb leaves its programs attached (a restart must lose nothing): the VIP still
    // answers from the pinned state. `lb detach` removes them: then nothing translates it.
    assert!(lb.stop().unwrap().success(), "lb exits cleanly on SIGTERM");
    let vip_answers = |tb: &mut Testbed| {
        let mut cmd = Command::new(LB_ECHO);
        cmd.args(["client", "--target", "198.19.0.10:80", "--proto", "tcp"])
            .args(["--count", "1", "--timeout-ms", "500"]);
        let (ns, cg) = (tb.client.ns.clone(), tb.cgroup.clone());
        let out = tb
            .run(&ns, socket_lb.then_some(cg.as_path()), cmd)
            .expect("client");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    let (ok, out) = vip_answers(&mut tb);
    assert!(ok, "the VIP answers after lb exited: {out}");
    let mut detach = Command::new(LB);
    detach.args(["detach", "--pin-dir"]).arg(&lb.pin_dir);
    let node = tb.node_ns.clone();
    let out = tb.run(&node, None, detach).expect("lb detach");
    assert!(out.status.success(), "lb detach: {out:?}");
    let (ok, out) = vip_answers(&mut tb);
    assert!(!ok, "VIP still answered after lb detach: {out}");
    drop(lb);
}

/// The generation a "synced" log line reports.
fn generation_of(line: &str) -> Option<u64> {
    let rest = &line[line.find("generation=")? + "generation=".len()..];
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// Waits sync by sync until `/healthz` answers `want` (the directory watch may sync more than
/// once per change, so no generation number is assumed); returns that sync's generation and
/// the body. Fails if no sync brings it within the log timeout.
fn syncs_until_healthz(lb: &mut LbDaemon, node: &str, want: u16, what: &str) -> (u64, String) {
    loop {
        let line = lb
            .wait_for(|l| l.contains("synced"), what)
            .unwrap_or_else(|e| panic!("{what}: healthz never answered {want}: {e:#}"));
        let (status, body) = http_get(node, HEALTH, "/healthz").unwrap();
        if status == want {
            return (
                generation_of(&line).expect("generation in the sync line"),
                body,
            );
        }
    }
}

/// The node name the watched-directory test gives lb (and its Node manifest).
const NODE_NAME: &str = "lb-test-node";

#[test]
fn manifest_dir_is_watched_and_health_and_metrics_follow() {
    let mut tb = Testbed::create(1).expect("testbed");
    let dir = std::env::temp_dir().join(format!("lb-test-watch-{}", tb.id));
    let _cleanup = Manifests(dir.clone());
    // The directory does not exist yet: lb runs, cannot sync, and is not healthy.
    let mut args = lb_args(&tb, &dir, false);
    args.push(format!("--hostname-override={NODE_NAME}"));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut lb = LbDaemon::spawn(&mut tb, Path::new(LB), &args, "info").unwrap();
    lb.wait_for(
        |l| l.contains("cannot read manifests"),
        "manifest read error",
    )
    .unwrap();
    let node = tb.node_ns.clone();
    let (status, body) = http_get(&node, HEALTH, "/healthz").unwrap();
    assert_eq!(status, 503, "unhealthy before the first sync: {body}");
    assert_eq!(http_get(&node, HEALTH, "/livez").unwrap().0, 200);

    // Files appear: lb applies them without a signal.
    fs::create_dir_all(&dir).unwrap();
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/examples");
    for entry in fs::read_dir(examples).unwrap() {
        let path = entry.unwrap().path();
        // Whole files only (a copy read half-written would be one more sync).
        let tmp = dir.join(".copy.tmp");
        fs::copy(&path, &tmp).unwrap();
        fs::rename(&tmp, dir.join(path.file_name().unwrap())).unwrap();
    }
    lb.wait_for(
        |l| l.contains("synced") && l.contains("services=4"),
        "sync of 4 frontends",
    )
    .unwrap();
    lb.wait_for(|l| l.contains(" ready"), "ready").unwrap();
    let (status, body) = http_get(&node, HEALTH, "/healthz").unwrap();
    assert_eq!(status, 200, "healthy after the sync: {body}");

    // This node's Node gets the autoscaler's deletion taint: healthz fails (load balancers
    // drain the node) while services stay programmed; the taint goes, healthz recovers.
    let node_file = dir.join("node.yaml");
    let write_node = |taints: &str| {
        let tmp = dir.join(".node.tmp");
        fs::write(
            &tmp,
            format!("apiVersion: v1\nkind: Node\nmetadata: {{name: {NODE_NAME}}}\nspec:\n  taints: {taints}\n"),
        )
        .unwrap();
        fs::rename(&tmp, &node_file).unwrap();
    };
    write_node("[{key: ToBeDeletedByClusterAutoscaler, value: '1', effect: NoSchedule}]");
    let (_, body) = syncs_until_healthz(&mut lb, &node, 503, "tainted for deletion");
    assert!(body.contains("\"nodeEligible\":false"), "{body}");
    write_node("[]");
    let (untainted, _) = syncs_until_healthz(&mut lb, &node, 200, "taint removed");
    fs::remove_file(&node_file).unwrap();
    lb.wait_for(
        |l| l.contains("synced") && generation_of(l).is_some_and(|g| g > untainted),
        "node removed",
    )
    .unwrap();

    // A file is added, then changed, then removed.
    let extra = dir.join("extra.yaml");
    let svc = |ip: &str| {
        format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: extra, namespace: demo}}\nspec:\n  clusterIP: {ip}\n  ports: [{{name: p, protocol: TCP, port: 80}}]\n"
        )
    };
    let write = |text: String| {
        let tmp = dir.join(".extra.tmp");
        fs::write(&tmp, text).unwrap();
        fs::rename(&tmp, &extra).unwrap();
    };
    write(svc("198.19.0.77"));
    lb.wait_for(
        |l| l.contains("synced") && l.contains("services=5"),
        "added file applied",
    )
    .unwrap();
    write(svc("198.19.0.78"));
    lb.wait_for(
        // rev-NAT and master of the new address, and the address into the ClusterIP set and
        // the echo table.
        |l| l.contains("synced") && l.contains("services=5") && l.contains("writes=4"),
        "changed file applied",
    )
    .unwrap();
    fs::remove_file(&extra).unwrap();
    lb.wait_for(
        |l| l.contains("synced") && l.contains("services=4"),
        "removed file applied",
    )
    .unwrap();

    // Metrics from the running daemon, parsed.
    let (status, metrics) = http_get(&node, METRICS, "/metrics").unwrap();
    assert_eq!(status, 200);
    // kube-proxy's SLIs: the echo Service and its two slices, then the extra Service added,
    // changed and removed (Node changes are neither); the probes answered above.
    let kp = |s: &str| sample(&metrics, s).unwrap_or_else(|| panic!("no {s} in {metrics}"));
    assert_eq!(kp("kubeproxy_sync_proxy_rules_service_changes_total"), 4.0);
    assert_eq!(kp("kubeproxy_sync_proxy_rules_endpoint_changes_total"), 2.0);
    assert_eq!(
        kp("kubeproxy_sync_proxy_rules_service_changes_pending"),
        0.0
    );
    assert!(kp("kubeproxy_sync_proxy_rules_duration_seconds_count{ip_family=\"IPv6\"}") >= 7.0);
    assert!(kp("kubeproxy_sync_proxy_rules_last_timestamp_seconds{ip_family=\"IPv4\"}") > 1e9);
    assert!(kp("kubeproxy_proxy_healthz_total{code=\"200\"}") >= 2.0);
    assert!(kp("kubeproxy_proxy_healthz_total{code=\"503\"}") >= 1.0);
    assert_eq!(
        http_get(&node, METRICS, "/proxyMode").unwrap(),
        (200, "ebpf".to_string())
    );
    assert!(
        sample(&metrics, "lb_syncs_total{result=\"ok\"}").unwrap() >= 4.0,
        "{metrics}"
    );
    assert_eq!(sample(&metrics, "lb_services"), Some(4.0), "{metrics}");
    assert_eq!(sample(&metrics, "lb_backends"), Some(12.0), "{metrics}");
    assert!(
        sample(&metrics, "lb_map_entries{map=\"lb4_services\"}").unwrap() >= 8.0,
        "{metrics}"
    );
    assert!(
        sample(&metrics, "lb_event_to_map_write_seconds_count").unwrap() >= 4.0,
        "{metrics}"
    );
    assert!(
        metrics.contains("lb_datapath_packets_total{event=\"tc_forward_new\"}"),
        "{metrics}"
    );
    // The conntrack GC's series are there from the start (its first pass is one interval
    // after start; netns::conntrack_gc_* test the passes).
    assert!(
        sample(&metrics, "lb_conntrack_gc_runs_total").is_some(),
        "{metrics}"
    );
}

#[test]
fn socket_lb_balances_and_follows_backend_removal() {
    balance_then_remove_backend(true);
}

#[test]
fn tc_path_balances_and_follows_backend_removal() {
    balance_then_remove_backend(false);
}

#[test]
fn restart_reuses_pinned_maps_without_flushing() {
    let mut tb = Testbed::create(1).expect("testbed");
    let manifests = Manifests::new(&tb.id);
    let mut lb = start_lb(&mut tb, &manifests.0, false);
    let pin_dir = lb.pin_dir.clone();
    let before = fs::metadata(pin_dir.join("lb4_services")).unwrap();
    lb.keep_dirs();
    assert!(lb.stop().unwrap().success());
    drop(lb);
    assert!(
        pin_dir.join("lb4_services").exists(),
        "maps stay pinned after exit"
    );

    let mut lb2 = start_lb(&mut tb, &manifests.0, false);
    let reused = lb2
        .log
        .iter()
        .find(|l| l.contains("pinned state reused"))
        .cloned()
        .unwrap_or_default();
    assert!(
        reused.contains("services=4"),
        "second start found the first one's services: {reused}"
    );
    let synced = lb2
        .log
        .iter()
        .find(|l| l.contains("synced"))
        .cloned()
        .unwrap_or_default();
    assert!(
        synced.contains("writes=0") && synced.contains("deletes=0"),
        "converged state needs no writes: {synced}"
    );
    let after = fs::metadata(pin_dir.join("lb4_services")).unwrap();
    use std::os::unix::fs::MetadataExt as _;
    assert_eq!(before.ino(), after.ino(), "same pinned map");
    reload(&mut lb2, 2);
}

/// A master entry whose slots are gone has no backend for socket LB either: connect() fails
/// with ECONNREFUSED (this kernel has `bpf_set_retval` for sock_addr programs; EPERM before)
/// and counts sock_drop_no_backend, as the tc path rejects and counts, instead of going out
/// untranslated to the VIP.
#[test]
fn socket_lb_refuses_a_frontend_whose_slots_are_gone() {
    let mut tb = Testbed::create(1).expect("testbed");
    let manifests = Manifests::new(&tb.id);
    let lb = start_lb(&mut tb, &manifests.0, true);
    let pinned = MapData::from_pin(lb.pin_dir.join(map_names::SERVICES4)).unwrap();
    let mut services: HashMap<_, Svc4Key, SvcValue> =
        HashMap::try_from(Map::HashMap(pinned)).unwrap();
    let key = |slot| Svc4Key {
        addr: [198, 19, 0, 10],
        port: 80,
        slot,
        proto: 6,
        scope: scope::EXTERNAL,
        pad: [0; 2],
    };
    let master = services
        .get(&key(0), 0)
        .expect("master of 198.19.0.10:80/TCP");
    assert!(master.count > 0);
    assert_eq!(
        master.flags & svc_flags::TWO_SCOPES,
        0,
        "one scope: sockets use these slots"
    );
    for slot in 1..=master.count {
        services.remove(&key(slot)).unwrap();
    }

    let before = lb.counter(metrics::SOCK_DROP_NO_BACKEND).unwrap();
    let o = client(&mut tb, true, "198.19.0.10:80", "tcp", &[]);
    assert_eq!(o.errors.len(), REQUESTS, "every connect() fails: {o:?}");
    let refusal = sock_refusal();
    for e in &o.errors {
        assert!(e.contains(refusal), "{refusal} from the connect4 hook: {e}");
    }
    assert_eq!(
        lb.counter(metrics::SOCK_DROP_NO_BACKEND).unwrap() - before,
        REQUESTS as u64
    );
    drop(lb);
}

// ---------------------------------------------------------------------------------------------
// Masquerade: what the backend sees as the client's address, and hairpin.

/// What `lb-echo client` run in `ns` got: per reply the backend's name, the client address it
/// saw (IP only) and the peer the application saw; and the errors.
fn echo_from(
    tb: &mut Testbed,
    ns: &str,
    cgroup: bool,
    target: &str,
    proto: &str,
) -> (Vec<(String, String, String)>, Vec<String>) {
    let mut cmd = Command::new(LB_ECHO);
    cmd.args([
        "client", "--target", target, "--proto", proto, "--count", "10",
    ]);
    let cg = tb.cgroup.clone();
    let out = tb
        .run(ns, cgroup.then_some(cg.as_path()), cmd)
        .expect("run client");
    let (mut replies, mut errors) = (Vec::new(), Vec::new());
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let v: serde_json::Value = serde_json::from_str(line).expect("client JSON");
        if let Some(e) = v.get("error") {
            errors.push(e.to_string());
            continue;
        }
        let seen: std::net::SocketAddr = v["seen_by_backend"].as_str().unwrap().parse().unwrap();
        replies.push((
            v["backend"].as_str().unwrap().to_string(),
            seen.ip().to_string(),
            v["peer"].as_str().unwrap().to_string(),
        ));
    }
    assert_eq!(
        replies.len() + errors.len(),
        10,
        "{target}/{proto}: one line per request"
    );
    (replies, errors)
}

/// A ClusterIP whose only endpoint is b1 (`198.19.0.20`, `2001:db8:ffff::20`, TCP 80 and UDP 53
/// to 8080), for hairpin: b1 reaching its own service.
const SOLO: &str = r#"apiVersion: v1
kind: Service
metadata: {name: solo, namespace: demo}
spec:
  clusterIP: 198.19.0.20
  clusterIPs: [198.19.0.20, "2001:db8:ffff::20"]
  ipFamilyPolicy: PreferDualStack
  ipFamilies: [IPv4, IPv6]
  ports:
    - {name: tcp, protocol: TCP, port: 80, targetPort: 8080}
    - {name: udp, protocol: UDP, port: 53, targetPort: 8080}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: solo-ipv4
  namespace: demo
  labels: {kubernetes.io/service-name: solo}
addressType: IPv4
ports: [{name: tcp, protocol: TCP, port: 8080}, {name: udp, protocol: UDP, port: 8080}]
endpoints: [{addresses: [198.18.11.2], conditions: {ready: true}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: solo-ipv6
  namespace: demo
  labels: {kubernetes.io/service-name: solo}
addressType: IPv6
ports: [{name: tcp, protocol: TCP, port: 8080}, {name: udp, protocol: UDP, port: 8080}]
endpoints: [{addresses: ["2001:db8:0:11::2"], conditions: {ready: true}}]
"#;

const SOLO_TARGETS: [(&str, &str); 4] = [
    ("198.19.0.20:80", "tcp"),
    ("198.19.0.20:53", "udp"),
    ("[2001:db8:ffff::20]:80", "tcp"),
    ("[2001:db8:ffff::20]:53", "udp"),
];

/// `lb run` with the tc path on every node-side veth, no socket LB, and `extra` flags.
fn start_tc_lb(tb: &mut Testbed, manifests: &Path, extra: &[&str]) -> LbDaemon {
    let mut args = lb_args(tb, manifests, false);
    args.extend(extra.iter().map(|s| (*s).to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    LbDaemon::start(tb, Path::new(LB), &args, "info").unwrap()
}

/// The node IPs passed as --node-ip: the node's addresses on the client's link.
fn node_ips(tb: &Testbed) -> String {
    format!("{},{}", tb.client.node_ipv4(), tb.client.node_ipv6())
}

/// Runs the four targets from the client netns and checks every reply came from the VIP, and
/// the backend saw `want_v4` / `want_v6` as the client's address.
fn assert_backend_saw(tb: &mut Testbed, want_v4: String, want_v6: String, what: &str) {
    let ns = tb.client.ns.clone();
    for (target, proto) in TARGETS {
        let (replies, errors) = echo_from(tb, &ns, false, target, proto);
        assert!(errors.is_empty(), "{what} {target}/{proto}: {errors:?}");
        let want = if target.starts_with('[') {
            &want_v6
        } else {
            &want_v4
        };
        for (backend, seen, peer) in &replies {
            assert_eq!(seen, want, "{what} {target}/{proto}: {backend} saw {seen}");
            assert_eq!(peer, target, "{what} {target}/{proto}: reply from the VIP");
        }
    }
}

/// With --cluster-cidr, ClusterIP traffic from outside every cluster CIDR reaches the backend
/// from the node IP (and its replies still come back from the VIP); a pod source (inside the
/// CIDRs) keeps its own address.
#[test]
fn tc_masquerades_clients_outside_the_cluster_cidr_only() {
    let mut tb = Testbed::create(3).expect("testbed");
    tb.start_echo_servers(Path::new(LB_ECHO), ECHO_PORT)
        .expect("echo servers");
    let manifests = Manifests::new(&tb.id);
    let node = node_ips(&tb);
    let (node4, node6) = (
        tb.client.node_ipv4().to_string(),
        tb.client.node_ipv6().to_string(),
    );
    let (client4, client6) = (tb.client.ipv4.to_string(), tb.client.ipv6.to_string());

    // The backends' links are the cluster: the client is outside.
    let backends = "198.18.11.0/24,198.18.12.0/24,198.18.13.0/24,2001:db8:0:11::/64,\
                    2001:db8:0:12::/64,2001:db8:0:13::/64";
    let mut lb = start_tc_lb(
        &mut tb,
        &manifests.0,
        &["--node-ip", &node, "--cluster-cidr", backends],
    );
    assert_backend_saw(&mut tb, node4, node6, "outside the cluster CIDRs");
    assert!(
        lb.counter(metrics::TC_SNAT).unwrap() > 0,
        "tc_snat counted the masqueraded packets"
    );
    assert!(lb.stop().unwrap().success());
    drop(lb);

    // The client's link is a cluster CIDR too: it is a pod, not masqueraded.
    let with_client = format!("{backends},198.18.10.0/24,2001:db8:0:10::/64");
    let lb = start_tc_lb(
        &mut tb,
        &manifests.0,
        &["--node-ip", &node, "--cluster-cidr", &with_client],
    );
    assert_backend_saw(&mut tb, client4, client6, "pod client");
    drop(lb);
}

/// --masquerade-all masquerades without a local-traffic detector; without either, nothing is.
#[test]
fn tc_masquerade_all_and_no_detector() {
    let mut tb = Testbed::create(2).expect("testbed");
    tb.start_echo_servers(Path::new(LB_ECHO), ECHO_PORT)
        .expect("echo servers");
    let manifests = Manifests::new(&tb.id);
    manifests.remove_endpoints(&["198.18.13.2", "2001:db8:0:13::2"]);
    let node = node_ips(&tb);
    let (node4, node6) = (
        tb.client.node_ipv4().to_string(),
        tb.client.node_ipv6().to_string(),
    );
    let (client4, client6) = (tb.client.ipv4.to_string(), tb.client.ipv6.to_string());

    let mut lb = start_tc_lb(
        &mut tb,
        &manifests.0,
        &["--node-ip", &node, "--masquerade-all"],
    );
    assert_backend_saw(&mut tb, node4, node6, "--masquerade-all");
    assert!(lb.stop().unwrap().success());
    drop(lb);

    let lb = start_tc_lb(&mut tb, &manifests.0, &["--node-ip", &node]);
    assert_backend_saw(&mut tb, client4, client6, "no detector");
    drop(lb);
}

/// Hairpin on the tc path: b1 reaching a service whose only backend is itself is DNATed to
/// itself and masqueraded to the node IP (its own address would make it answer itself
/// directly), redirected back out of the veth it came in on, and gets its replies from the VIP.
/// The node IP is the default: the node's first global unicast address per family.
#[test]
fn tc_hairpin_reaches_itself_through_its_service() {
    let mut tb = Testbed::create(2).expect("testbed");
    tb.start_echo_servers(Path::new(LB_ECHO), ECHO_PORT)
        .expect("echo servers");
    let manifests = Manifests::new(&tb.id);
    fs::write(manifests.0.join("solo.yaml"), SOLO).unwrap();
    let lb = start_tc_lb(&mut tb, &manifests.0, &[]);
    let facts = lb
        .log
        .iter()
        .find(|l| l.contains("node facts written"))
        .cloned()
        .unwrap_or_default();
    // Interface order in the node netns: lo, then the client's link.
    let (node4, node6) = (
        tb.client.node_ipv4().to_string(),
        tb.client.node_ipv6().to_string(),
    );
    assert!(
        facts.contains(&node4) && facts.contains(&node6),
        "default node IPs: {facts}"
    );
    let b1 = tb.backends[0].clone();
    for (target, proto) in SOLO_TARGETS {
        let (replies, errors) = echo_from(&mut tb, &b1.ns, false, target, proto);
        assert!(errors.is_empty(), "hairpin {target}/{proto}: {errors:?}");
        let node = if target.starts_with('[') {
            &node6
        } else {
            &node4
        };
        for (backend, seen, peer) in &replies {
            assert_eq!(backend, "b1", "{target}/{proto}");
            assert_eq!(seen, node, "{target}/{proto}: hairpin is masqueraded");
            assert_eq!(peer, target, "{target}/{proto}: reply from the VIP");
        }
    }
    drop(lb);
}

/// Hairpin through socket LB: connect() is rewritten to the pod's own address, so the
/// connection is local and needs no masquerade; the application still sees the VIP.
#[test]
fn socket_lb_hairpin_reaches_itself_without_masquerade() {
    let mut tb = Testbed::create(2).expect("testbed");
    tb.start_echo_servers(Path::new(LB_ECHO), ECHO_PORT)
        .expect("echo servers");
    let manifests = Manifests::new(&tb.id);
    fs::write(manifests.0.join("solo.yaml"), SOLO).unwrap();
    let lb = start_lb(&mut tb, &manifests.0, true);
    let b1 = tb.backends[0].clone();
    for (target, proto) in SOLO_TARGETS {
        let (replies, errors) = echo_from(&mut tb, &b1.ns, true, target, proto);
        assert!(
            errors.is_empty(),
            "socket LB hairpin {target}/{proto}: {errors:?}"
        );
        let own = if target.starts_with('[') {
            b1.ipv6.to_string()
        } else {
            b1.ipv4.to_string()
        };
        for (backend, seen, peer) in &replies {
            assert_eq!(backend, "b1", "{target}/{proto}");
            assert_eq!(
                seen, &own,
                "{target}/{proto}: a local connection from its own address"
            );
            assert_eq!(
                peer, target,
                "{target}/{proto}: the application sees the VIP"
            );
        }
    }
    drop(lb);
}

/// A dual-stack ClusterIP service no EndpointSlice serves.
const NO_ENDPOINTS: &str = "apiVersion: v1
kind: Service
metadata: {name: empty, namespace: demo}
spec:
  ipFamilyPolicy: PreferDualStack
  ipFamilies: [IPv4, IPv6]
  clusterIP: 198.19.0.20
  clusterIPs: [198.19.0.20, \"2001:db8:ffff::20\"]
  ports:
    - {name: tcp, protocol: TCP, port: 80}
    - {name: udp, protocol: UDP, port: 53}
";

/// `internalTrafficPolicy: Local` with its only endpoints on another node: kube-proxy DROPs
/// in-cluster traffic to it (REJECT is for a service with no endpoints at all).
const ENDPOINTS_ELSEWHERE: &str = "apiVersion: v1
kind: Service
metadata: {name: elsewhere, namespace: demo}
spec:
  ipFamilyPolicy: PreferDualStack
  ipFamilies: [IPv4, IPv6]
  clusterIP: 198.19.0.21
  clusterIPs: [198.19.0.21, \"2001:db8:ffff::21\"]
  internalTrafficPolicy: Local
  ports:
    - {name: tcp, protocol: TCP, port: 80}
    - {name: udp, protocol: UDP, port: 53}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: elsewhere-v4
  namespace: demo
  labels: {kubernetes.io/service-name: elsewhere}
addressType: IPv4
ports:
  - {name: tcp, protocol: TCP, port: 8080}
  - {name: udp, protocol: UDP, port: 8080}
endpoints:
  - {addresses: [198.18.250.1], nodeName: another-node}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: elsewhere-v6
  namespace: demo
  labels: {kubernetes.io/service-name: elsewhere}
addressType: IPv6
ports:
  - {name: tcp, protocol: TCP, port: 8080}
  - {name: udp, protocol: UDP, port: 8080}
endpoints:
  - {addresses: [\"2001:db8:250::1\"], nodeName: another-node}
";

/// Every request of `o` failed with ECONNREFUSED: a REJECT answered at once, not a timeout
/// (which would be ETIMEDOUT or EAGAIN).
fn assert_refused(o: &Outcome, what: &str) {
    assert_refused_with(o, what, "os error 111)");
}

/// Every request of `o` failed with `errno` (the end of the error text).
fn assert_refused_with(o: &Outcome, what: &str, errno: &str) {
    assert_eq!(
        o.errors.len(),
        REQUESTS,
        "{what}: every request fails: {o:?}"
    );
    for e in &o.errors {
        assert!(e.contains(errno), "{what}: {errno}, got {e}");
    }
}

/// How a socket-LB refusal fails: ECONNREFUSED where sock_addr programs have
/// `bpf_set_retval` (5.18+), EPERM, the hook's plain refusal, before.
fn sock_refusal() -> &'static str {
    if lb::datapath::load::sock_set_retval_supported() {
        "os error 111)"
    } else {
        "os error 1)"
    }
}

/// kube-proxy's REJECT through real sockets: without endpoints, or on a port the ClusterIP does
/// not have, TCP gets a RST and connected UDP an ICMP port unreachable from the tc path, and
/// both surface as ECONNREFUSED; an unallocated address of `--service-cidr` is dropped, and so
/// is an `internalTrafficPolicy: Local` service whose endpoints are all on other nodes.
#[test]
fn tc_path_rejects_like_kube_proxy() {
    let mut tb = Testbed::create(3).expect("testbed");
    tb.start_echo_servers(Path::new(LB_ECHO), ECHO_PORT)
        .expect("echo servers");
    let manifests = Manifests::new(&tb.id);
    manifests.add("empty.yaml", NO_ENDPOINTS);
    manifests.add("elsewhere.yaml", ENDPOINTS_ELSEWHERE);
    let mut args = lb_args(&tb, &manifests.0, false);
    args.extend([
        "--service-cidr".into(),
        "198.19.0.0/16,2001:db8:ffff::/96".into(),
    ]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut lb = LbDaemon::spawn(&mut tb, Path::new(LB), &args, "info").unwrap();
    lb.wait_for(|l| l.contains(" ready"), "ready").unwrap();

    let before = lb.counter(metrics::TC_REJECT_NO_BACKEND).unwrap();
    for target in ["198.19.0.20:80", "[2001:db8:ffff::20]:80"] {
        assert_refused(&client(&mut tb, false, target, "tcp", &[]), target);
    }
    for target in ["198.19.0.20:53", "[2001:db8:ffff::20]:53"] {
        let o = client(&mut tb, false, target, "udp", &["--connected-udp"]);
        assert_refused(&o, target);
    }
    assert_eq!(
        lb.counter(metrics::TC_REJECT_NO_BACKEND).unwrap() - before,
        4 * REQUESTS as u64
    );

    let before = lb.counter(metrics::TC_REJECT_UNKNOWN_PORT).unwrap();
    for target in ["198.19.0.10:81", "[2001:db8:ffff::10]:81"] {
        assert_refused(&client(&mut tb, false, target, "tcp", &[]), target);
        let o = client(&mut tb, false, target, "udp", &["--connected-udp"]);
        assert_refused(&o, target);
    }
    assert_eq!(
        lb.counter(metrics::TC_REJECT_UNKNOWN_PORT).unwrap() - before,
        4 * REQUESTS as u64
    );

    // Unallocated, and iTP=Local with endpoints only elsewhere: nothing answers, the
    // datagrams are counted as dropped, not rejected.
    for (targets, counter) in [
        (
            ["198.19.0.99:53", "[2001:db8:ffff::99]:53"],
            metrics::TC_DROP_UNALLOCATED,
        ),
        (
            ["198.19.0.21:53", "[2001:db8:ffff::21]:53"],
            metrics::TC_DROP_NO_LOCAL_BACKEND,
        ),
    ] {
        let before = lb.counter(counter).unwrap();
        for target in targets {
            let o = client(&mut tb, false, target, "udp", &["--timeout-ms", "100"]);
            assert_eq!(o.errors.len(), REQUESTS, "{target}: no answer: {o:?}");
            assert!(
                o.errors.iter().all(|e| !e.contains("os error 111)")),
                "{target}: dropped, not rejected: {o:?}"
            );
        }
        assert_eq!(
            lb.counter(counter).unwrap() - before,
            2 * REQUESTS as u64,
            "{targets:?}"
        );
    }
    // The service itself is unaffected.
    let o = client(&mut tb, false, "198.19.0.10:80", "tcp", &[]);
    assert!(o.errors.is_empty(), "{o:?}");
    assert_eq!(o.per_backend.len(), 3, "{o:?}");
    drop(lb);
}

/// `ping` to a ClusterIP from a pod is answered by the tc path (lb_tc_pod turns the request
/// around), IPv4 and IPv6, with a fresh TTL; a ClusterIP without endpoints answers with an ICMP
/// unreachable, as its TCP and UDP do.
#[test]
fn ping_to_a_cluster_ip_is_answered_by_the_tc_path() {
    let mut tb = Testbed::create(3).expect("testbed");
    tb.start_echo_servers(Path::new(LB_ECHO), ECHO_PORT)
        .expect("echo servers");
    let manifests = Manifests::new(&tb.id);
    manifests.add("empty.yaml", NO_ENDPOINTS);
    let lb = start_lb(&mut tb, &manifests.0, false);
    let ping = |tb: &mut Testbed, target: &str| -> Vec<serde_json::Value> {
        let mut cmd = Command::new(LB_ECHO);
        cmd.args(["ping", "--target", target, "--count", "3"])
            .args(["--timeout-ms", "1000"]);
        let ns = tb.client.ns.clone();
        let out = tb.run(&ns, None, cmd).expect("run ping");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|l| serde_json::from_str(l).expect("ping JSON"))
            .collect()
    };
    let before = lb.counter(metrics::TC_ECHO_REPLY).unwrap();
    for vip in ["198.19.0.10", "2001:db8:ffff::10"] {
        let replies = ping(&mut tb, vip);
        assert_eq!(replies.len(), 3, "{vip}: {replies:?}");
        for r in &replies {
            assert_eq!(r["reply_from"], vip, "{r}");
            if !vip.contains(':') {
                assert_eq!(r["ttl"], 64, "the datapath's answer: {r}");
            }
        }
    }
    assert_eq!(lb.counter(metrics::TC_ECHO_REPLY).unwrap() - before, 6);
    for empty in ["198.19.0.20", "2001:db8:ffff::20"] {
        let replies = ping(&mut tb, empty);
        assert_eq!(replies.len(), 3, "{empty}: {replies:?}");
        for r in &replies {
            let e = r["error"].as_str().unwrap_or_default();
            assert!(e.starts_with("unreachable"), "{empty}: {r}");
        }
    }
    drop(lb);
}

/// The same through socket LB: connect() (TCP, and UDP's connect) and unconnected sendto()
/// fail at once with ECONNREFUSED (EPERM before 5.18, see `sock_refusal`), for a service
/// without endpoints and for an unknown port; with EPERM, a DROP's error, for an
/// `internalTrafficPolicy: Local` service whose endpoints are all on other nodes.
#[test]
fn socket_lb_refuses_like_kube_proxy() {
    let mut tb = Testbed::create(1).expect("testbed");
    let manifests = Manifests::new(&tb.id);
    manifests.add("empty.yaml", NO_ENDPOINTS);
    manifests.add("elsewhere.yaml", ENDPOINTS_ELSEWHERE);
    let lb = start_lb(&mut tb, &manifests.0, true);
    let refusal = sock_refusal();

    let before = lb.counter(metrics::SOCK_DROP_NO_BACKEND).unwrap();
    for target in ["198.19.0.20:80", "[2001:db8:ffff::20]:80"] {
        assert_refused_with(&client(&mut tb, true, target, "tcp", &[]), target, refusal);
    }
    for target in ["198.19.0.20:53", "[2001:db8:ffff::20]:53"] {
        let o = client(&mut tb, true, target, "udp", &["--connected-udp"]);
        assert_refused_with(&o, target, refusal);
        assert_refused_with(&client(&mut tb, true, target, "udp", &[]), target, refusal);
    }
    assert_eq!(
        lb.counter(metrics::SOCK_DROP_NO_BACKEND).unwrap() - before,
        6 * REQUESTS as u64
    );

    let before = lb.counter(metrics::SOCK_REJECT_UNKNOWN_PORT).unwrap();
    for target in ["198.19.0.10:81", "[2001:db8:ffff::10]:81"] {
        assert_refused_with(&client(&mut tb, true, target, "tcp", &[]), target, refusal);
        assert_refused_with(&client(&mut tb, true, target, "udp", &[]), target, refusal);
    }
    assert_eq!(
        lb.counter(metrics::SOCK_REJECT_UNKNOWN_PORT).unwrap() - before,
        4 * REQUESTS as u64
    );

    // iTP=Local, endpoints only elsewhere: denied like a netfilter DROP fails a local sender
    // (EPERM), never refused.
    let before = lb.counter(metrics::SOCK_DROP_NO_LOCAL_BACKEND).unwrap();
    for target in ["198.19.0.21:80", "[2001:db8:ffff::21]:80"] {
        let o = client(&mut tb, true, target, "tcp", &[]);
        assert_refused_with(&o, target, "os error 1)");
    }
    for target in ["198.19.0.21:53", "[2001:db8:ffff::21]:53"] {
        let o = client(&mut tb, true, target, "udp", &["--connected-udp"]);
        assert_refused_with(&o, target, "os error 1)");
        assert_refused_with(
            &client(&mut tb, true, target, "udp", &[]),
            target,
            "os error 1)",
        );
    }
    assert_eq!(
        lb.counter(metrics::SOCK_DROP_NO_LOCAL_BACKEND).unwrap() - before,
        6 * REQUESTS as u64
    );
    drop(lb);
}

/// Restarting lb under continuous load loses nothing: SIGTERM then start, and SIGKILL then
/// start, each a second apart, while clients keep sending fresh TCP connections, one
/// long-lived TCP connection and unconnected UDP requests (socket LB, then the tc path).
/// Programs stay attached through pinned links, each new lb adopts them (and says so), and
/// conntrack and socket-LB reverse NAT live in pinned maps: no request fails, the long
/// connection is never reset, and every UDP reply comes from the VIP.
#[test]
fn restart_under_load_loses_nothing() {
    const COUNT: usize = 400;
    for socket_lb in [true, false] {
        let mode = if socket_lb { "socket LB" } else { "tc" };
        let mut tb = Testbed::create(3).expect("testbed");
        tb.start_echo_servers(Path::new(LB_ECHO), ECHO_PORT)
            .expect("echo servers");
        let manifests = Manifests::new(&tb.id);
        let mut lb = start_lb(&mut tb, &manifests.0, socket_lb);

        let loads: [(&str, &str, &[&str]); 3] = [
            ("tcp", "198.19.0.10:80", &[]),
            ("tcp", "198.19.0.10:80", &["--keep-connection"]),
            ("udp", "198.19.0.10:53", &[]),
        ];
        let (ns, cg) = (tb.client.ns.clone(), tb.cgroup.clone());
        let mut clients = Vec::new();
        for (proto, target, extra) in loads {
            let mut cmd = Command::new(LB_ECHO);
            cmd.args(["client", "--target", target, "--proto", proto])
                .args(["--count", &COUNT.to_string(), "--interval-ms", "20"])
                .args(["--timeout-ms", "1000"])
                .args(extra)
                .stdout(Stdio::piped())
                .stderr(Stdio::null());
            let child = tb
                .spawn(&ns, socket_lb.then_some(cg.as_path()), cmd)
                .expect("client");
            clients.push((proto, target, extra, child));
        }

        for kill in [false, true] {
            thread::sleep(Duration::from_millis(700));
            // The next lb reuses the pins.
            lb.keep_dirs();
            if kill {
                lb.signal(nix::sys::signal::Signal::SIGKILL).unwrap();
            }
            lb.stop().unwrap();
            // The gap a restarting DaemonSet pod leaves, roughly.
            thread::sleep(Duration::from_secs(1));
            lb = start_lb(&mut tb, &manifests.0, socket_lb);
            let ready = lb
                .wait_for_from(0, |l| l.contains(" ready"), "ready")
                .unwrap();
            assert!(
                ready.contains("(adopted)"),
                "{mode}: the new lb adopts the attachments: {ready}"
            );
        }

        for (proto, target, extra, child) in clients {
            let out = child.wait_with_output().expect("client output");
            let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
                .lines()
                .map(|l| serde_json::from_str(l).expect("client JSON"))
                .collect();
            let what = format!("{mode} {proto} {extra:?}");
            assert_eq!(lines.len(), COUNT, "{what}: every request reported");
            let failed: Vec<&serde_json::Value> =
                lines.iter().filter(|v| v.get("error").is_some()).collect();
            assert!(
                failed.is_empty(),
                "{what}: {} of {COUNT} requests failed across two restarts: {failed:?}",
                failed.len()
            );
            for v in &lines {
                assert_eq!(v["peer"], target, "{what}: reply from the VIP: {v}");
            }
        }
        drop(lb);
    }
}

/// `sessionAffinity: ClientIP`: every request of the client reaches the backend its first one
/// got, on both paths (socket LB keys the client by its netns, tc by its address), for TCP,
/// UDP and connected UDP, each a new socket.
#[test]
fn session_affinity_keeps_a_client_on_one_backend() {
    for socket_lb in [true, false] {
        let mode = if socket_lb { "socket LB" } else { "tc" };
        let mut tb = Testbed::create(3).expect("testbed");
        tb.start_echo_servers(Path::new(LB_ECHO), ECHO_PORT)
            .expect("echo servers");
        let manifests = Manifests::new(&tb.id);
        manifests.edit_service(|s| {
            s.replace(
                "  type: ClusterIP\n",
                "  type: ClusterIP\n  sessionAffinity: ClientIP\n",
            )
        });
        let lb = start_lb(&mut tb, &manifests.0, socket_lb);
        let mut extras: Vec<&[&str]> = vec![&[]];
        if socket_lb {
            extras.push(&["--connected-udp"]);
        }
        for extra in extras {
            for (target, proto) in TARGETS {
                let o = client(&mut tb, socket_lb, target, proto, extra);
                assert!(
                    o.errors.is_empty(),
                    "{mode} {target}/{proto}: {:?}",
                    o.errors
                );
                assert_eq!(
                    o.per_backend.len(),
                    1,
                    "{mode} {target}/{proto} {extra:?}: one backend for the client: {o:?}"
                );
                assert_eq!(
                    o.peers,
                    BTreeSet::from([target.to_string()]),
                    "{mode} {target}/{proto} {extra:?}: the application sees the VIP: {o:?}"
                );
            }
        }
        drop(lb);
    }
}

/// Graceful termination (KEP-1669): the backend a long-lived TCP connection uses turns
/// terminating (still serving); the connection keeps working to the end, while every new
/// connection goes to the ready backends. Then the backend leaves the slice and no new
/// connection or datagram reaches it either.
#[test]
fn terminating_backend_keeps_its_connection_and_gets_no_new_ones() {
    kept_backend_keeps_its_connection("{ready: false, serving: true, terminating: true}");
}

/// A readiness flap: the backend a long-lived TCP connection uses turns not ready (not
/// terminating); as with kube-proxy's conntrack the connection keeps working while new
/// connections avoid the backend, and the backend leaving the slice ends that too.
#[test]
fn unready_backend_keeps_its_connection_and_gets_no_new_ones() {
    kept_backend_keeps_its_connection("{ready: false, serving: false, terminating: false}");
}

fn kept_backend_keeps_its_connection(conditions: &str) {
    use std::io::BufRead as _;
    const COUNT: usize = 150;
    let addr_of = |b: &str| match b {
        "b1" => ("198.18.11.2", "2001:db8:0:11::2"),
        "b2" => ("198.18.12.2", "2001:db8:0:12::2"),
        "b3" => ("198.18.13.2", "2001:db8:0:13::2"),
        other => panic!("unknown backend {other}"),
    };
    for socket_lb in [true, false] {
        let mode = if socket_lb { "socket LB" } else { "tc" };
        let mut tb = Testbed::create(3).expect("testbed");
        tb.start_echo_servers(Path::new(LB_ECHO), ECHO_PORT)
            .expect("echo servers");
        let manifests = Manifests::new(&tb.id);
        let mut lb = start_lb(&mut tb, &manifests.0, socket_lb);

        let (ns, cg) = (tb.client.ns.clone(), tb.cgroup.clone());
        let mut cmd = Command::new(LB_ECHO);
        cmd.args(["client", "--target", "198.19.0.10:80", "--proto", "tcp"])
            .args(["--count", &COUNT.to_string(), "--interval-ms", "20"])
            .args(["--timeout-ms", "1000", "--keep-connection"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        let mut child = tb
            .spawn(&ns, socket_lb.then_some(cg.as_path()), cmd)
            .expect("client");
        let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
        let first: serde_json::Value =
            serde_json::from_str(&lines.next().unwrap().unwrap()).expect("client JSON");
        let pinned = first["backend"].as_str().expect("first reply").to_string();
        let (v4, v6) = addr_of(&pinned);

        manifests.set_conditions(&[v4, v6], conditions);
        reload(&mut lb, 2);
        for (target, proto) in TARGETS {
            let o = client(&mut tb, socket_lb, target, proto, &[]);
            assert!(
                o.errors.is_empty(),
                "{mode} {target}/{proto}: {:?}",
                o.errors
            );
            assert!(
                !o.per_backend.contains_key(&pinned),
                "{mode} {target}/{proto}: a new flow reached {pinned} ({conditions}): {o:?}"
            );
        }

        let rest: Vec<serde_json::Value> = lines
            .map(|l| serde_json::from_str(&l.unwrap()).expect("client JSON"))
            .collect();
        let _ = child.wait();
        assert_eq!(rest.len(), COUNT - 1, "{mode}: every request reported");
        for v in &rest {
            assert_eq!(
                v["backend"].as_str(),
                Some(pinned.as_str()),
                "{mode}: the open connection stays on {pinned} ({conditions}): {v}"
            );
        }

        // Gone from the slice: the remaining backends serve everything.
        manifests.remove_endpoints(&[v4, v6]);
        reload(&mut lb, 3);
        for (target, proto) in TARGETS {
            let o = client(&mut tb, socket_lb, target, proto, &[]);
            assert!(
                o.errors.is_empty(),
                "{mode} {target}/{proto}: {:?}",
                o.errors
            );
            assert_eq!(o.per_backend.len(), 2, "{mode} {target}/{proto}: {o:?}");
            assert!(!o.per_backend.contains_key(&pinned), "{o:?}");
        }
        drop(lb);
    }
}

// ---------------------------------------------------------------------------------------------
// Conntrack GC through a real `lb run`.

fn open_lru<K: aya::Pod, V: aya::Pod>(pin_dir: &Path, name: &str) -> HashMap<MapData, K, V> {
    let map = MapData::from_pin(pin_dir.join(name)).unwrap();
    HashMap::try_from(Map::LruHashMap(map)).unwrap()
}

fn open_backends<V: aya::Pod>(pin_dir: &Path, name: &str) -> HashMap<MapData, u32, V> {
    let map = MapData::from_pin(pin_dir.join(name)).unwrap();
    HashMap::try_from(Map::HashMap(map)).unwrap()
}

/// Backend id of every conntrack entry in the four maps, with its count.
fn ct_backend_ids(pin_dir: &Path) -> BTreeMap<u32, usize> {
    let mut ids = BTreeMap::new();
    for name in [map_names::CT_TCP4, map_names::CT_ANY4] {
        let m: HashMap<MapData, Ct4Key, Ct4Value> = open_lru(pin_dir, name);
        for (_, v) in m.iter().filter_map(Result::ok) {
            *ids.entry(v.backend_id).or_default() += 1;
        }
    }
    for name in [map_names::CT_TCP6, map_names::CT_ANY6] {
        let m: HashMap<MapData, Ct6Key, Ct6Value> = open_lru(pin_dir, name);
        for (_, v) in m.iter().filter_map(Result::ok) {
            *ids.entry(v.backend_id).or_default() += 1;
        }
    }
    ids
}

/// Ids of the backends at `v4` and `v6` in the pinned backend maps.
fn backend_ids(pin_dir: &Path, v4: [u8; 4], v6: [u8; 16]) -> BTreeSet<u32> {
    let b4: HashMap<MapData, u32, Backend4> = open_backends(pin_dir, map_names::BACKENDS4);
    let b6: HashMap<MapData, u32, Backend6> = open_backends(pin_dir, map_names::BACKENDS6);
    let mut ids: BTreeSet<u32> = b4
        .iter()
        .filter_map(Result::ok)
        .filter(|(_, b)| b.addr == v4)
        .map(|(id, _)| id)
        .collect();
    ids.extend(
        b6.iter()
            .filter_map(Result::ok)
            .filter(|(_, b)| b.addr == v6)
            .map(|(id, _)| id),
    );
    ids
}

/// Polls `f` every 100 ms until it holds or `deadline` passes.
fn eventually(deadline: Duration, mut f: impl FnMut() -> bool) -> bool {
    let end = std::time::Instant::now() + deadline;
    loop {
        if f() {
            return true;
        }
        if std::time::Instant::now() > end {
            return false;
        }
        thread::sleep(Duration::from_millis(100));
    }
}

/// Flows to all three backends over the tc path, then b3 leaves the manifests: right after the
/// sync that deletes it (the GC's interval is an hour here, so only that sync can start the
/// pass), the GC deletes every conntrack entry of b3, TCP and UDP, both families, and keeps
/// b1's and b2's; the GC metrics count it.
#[test]
fn conntrack_gc_removes_a_deleted_backends_entries() {
    let mut tb = Testbed::create(3).expect("testbed");
    tb.start_echo_servers(Path::new(LB_ECHO), ECHO_PORT)
        .expect("echo servers");
    let manifests = Manifests::new(&tb.id);
    let mut args = lb_args(&tb, &manifests.0, false);
    // Long lifetimes: nothing expires during the test, so every deletion is the backend's.
    args.extend(
        [
            "--ct-gc-interval=3600",
            "--bpf-ct-timeout-regular-tcp-fin=3600",
            "--bpf-ct-timeout-regular-any=3600",
            "--bpf-ct-global-tcp-max=65536",
            "--bpf-ct-global-any-max=65536",
        ]
        .map(String::from),
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut lb = LbDaemon::start(&mut tb, Path::new(LB), &args, "info").unwrap();
    assert_balanced(&mut tb, false, &["b1", "b2", "b3"], &[]);

    let b3 = backend_ids(
        &lb.pin_dir,
        [198, 18, 13, 2],
        "2001:db8:0:13::2"
            .parse::<std::net::Ipv6Addr>()
            .unwrap()
            .octets(),
    );
    // One id per family and protocol.
    assert!(!b3.is_empty());
    let before = ct_backend_ids(&lb.pin_dir);
    for id in &b3 {
        assert!(before.contains_key(id), "b3's flows tracked: {before:?}");
    }
    let others: Vec<u32> = before
        .keys()
        .filter(|id| !b3.contains(id))
        .copied()
        .collect();
    assert!(!others.is_empty(), "{before:?}");

    manifests.remove_endpoints(&["198.18.13.2", "2001:db8:0:13::2"]);
    reload(&mut lb, 2);
    let pin_dir = lb.pin_dir.clone();
    let gone = eventually(Duration::from_secs(10), || {
        let now = ct_backend_ids(&pin_dir);
        b3.iter().all(|id| !now.contains_key(id))
    });
    let after = ct_backend_ids(&lb.pin_dir);
    assert!(gone, "b3's entries still there: {after:?}");
    for id in &others {
        assert_eq!(
            after.get(id),
            before.get(id),
            "backend {id}'s entries are all kept: before {before:?}, after {after:?}"
        );
    }
    let (_, metrics) = http_get(&tb.node_ns, METRICS, "/metrics").unwrap();
    let deleted = sample(
        &metrics,
        "lb_conntrack_gc_deleted_total{reason=\"backend_gone\"}",
    )
    .unwrap();
    let b3_entries: usize = b3.iter().filter_map(|id| before.get(id)).sum();
    assert!(
        deleted >= b3_entries as f64,
        "deleted {deleted}, b3 had {b3_entries}:\n{metrics}"
    );
    // The pass the sync started (the interval's first is an hour away).
    assert!(sample(&metrics, "lb_conntrack_gc_runs_total").unwrap() >= 1.0);
    let live: f64 = metrics
        .lines()
        .filter(|l| l.starts_with("lb_conntrack_entries{"))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum();
    let kept: usize = others.iter().filter_map(|id| after.get(id)).sum();
    assert_eq!(
        live, kept as f64,
        "lb_conntrack_entries sums the live entries:\n{metrics}"
    );
    drop(lb);
}

/// An already-expired entry written into the pinned TCP map goes with the next periodic pass;
/// a live one beside it stays.
#[test]
fn conntrack_gc_removes_expired_entries() {
    let mut tb = Testbed::create(1).expect("testbed");
    tb.start_echo_servers(Path::new(LB_ECHO), ECHO_PORT)
        .expect("echo servers");
    let manifests = Manifests::new(&tb.id);
    let mut args = lb_args(&tb, &manifests.0, false);
    args.extend(
        [
            "--ct-gc-interval=1",
            "--bpf-ct-global-tcp-max=4096",
            "--bpf-ct-global-any-max=4096",
        ]
        .map(String::from),
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let lb = LbDaemon::start(&mut tb, Path::new(LB), &args, "info").unwrap();
    let b1 = *backend_ids(&lb.pin_dir, [198, 18, 11, 2], [0xff; 16])
        .iter()
        .next()
        .expect("b1's id");
    let mut ct: HashMap<MapData, Ct4Key, Ct4Value> = open_lru(&lb.pin_dir, map_names::CT_TCP4);
    let key = |sport| Ct4Key {
        saddr: [198, 18, 10, 2],
        daddr: [198, 19, 0, 10],
        sport,
        dport: 80,
        proto: lb_common::IPPROTO_TCP,
        dir: ct_dir::SERVICE,
        pad: [0; 2],
    };
    let now = lb::datapath::conntrack::monotonic_secs();
    let value = |expires| Ct4Value {
        backend_id: b1,
        rev_nat_id: 1,
        expires,
        flags: ct_flags::SEEN_REPLY,
        ..Default::default()
    };
    ct.insert(key(50_000), value(now.saturating_sub(5)), 0)
        .unwrap();
    ct.insert(key(50_001), value(now + 3600), 0).unwrap();
    let expired_gone = eventually(Duration::from_secs(10), || ct.get(&key(50_000), 0).is_err());
    assert!(expired_gone, "the expired entry is still there");
    assert!(ct.get(&key(50_001), 0).is_ok(), "the live entry stays");
    let (_, metrics) = http_get(&tb.node_ns, METRICS, "/metrics").unwrap();
    assert!(
        sample(
            &metrics,
            "lb_conntrack_gc_deleted_total{reason=\"expired\"}"
        )
        .unwrap()
            >= 1.0,
        "{metrics}"
    );
    drop(lb);
}

// ---------------------------------------------------------------------------------------------
// Connected UDP re-steering (issue 15, item 5; reconcile/resteer.rs, datapath/sockterm.rs)

/// Whether the kernel has the `bpf_sock_destroy` kfunc (6.5+), lb's re-steering mechanism.
fn has_sock_destroy() -> bool {
    fs::read_to_string("/proc/kallsyms")
        .unwrap_or_default()
        .lines()
        .any(|l| l.ends_with(" bpf_sock_destroy"))
}

/// Adds or deletes blackhole routes to `client` in netns `ns`: everything sent there
/// vanishes without an error reaching the client.
fn blackhole(ns: &str, client: &lb_tests::testbed::Host, op: &str) {
    let v4 = format!("{}/32", client.ipv4);
    let v6 = format!("{}/128", client.ipv6);
    lb_tests::netns::ip(&["-n", ns, "route", op, "blackhole", &v4]).unwrap();
    lb_tests::netns::ip(&["-n", ns, "-6", "route", op, "blackhole", &v6]).unwrap();
}

/// What one `lb-echo stream` run saw, and when (ms since it started).
#[derive(Debug, Default)]
struct StreamRun {
    replies: Vec<(f64, String)>,
    /// (time, op, errno)
    errors: Vec<(f64, String, i64)>,
    sent: u64,
    received: u64,
}

/// The resolver-like client of `lb-echo stream`: a connected UDP socket sending every 10 ms to
/// a service whose backend is removed (the manifest rewritten, the backend's replies
/// blackholed, as a deleted pod leaves: silent, no ICMP) once the client has had replies for a
/// while. The old backend's last reply to the first reply from another must be at most 1 s
/// apart (the issue's bound; times `LB_TEST_SLOWDOWN` in the emulated VMs), and the client must have been moved by lb's mechanism, not by
/// some other error: where the kernel has `bpf_sock_destroy` (6.5+) its socket is destroyed
/// (ECONNABORTED on recv); before, its next datagram is dropped at cgroup egress (EPERM on send).
/// Where the kernel has `bpf_sock_destroy`, the rounds run once more with the destroy iterator
/// left out (`LB_NO_SOCK_DESTROY=1`): the cgroup egress fallback alone must move the client
/// (EPERM on send), as on kernels before 6.5. One after the other, not as two tests: in the
/// emulated VMs two lbs at once would slow each other past the bound.
#[test]
fn connected_udp_is_resteered_within_1s_when_its_backend_is_removed() {
    resteer_rounds(false);
    if has_sock_destroy() {
        resteer_rounds(true);
    }
}

fn resteer_rounds(no_destroy: bool) {
    let destroy = has_sock_destroy() && !no_destroy;
    // The window is lb's reaction time (manifest watch, sync, pass), CPU-bound: the issue's 1 s
    // holds on a real kernel. The emulated kernel VMs (LB_TEST_SLOWDOWN > 1) run CPU work about
    // 12x slower (shared/notes/vm-kernels.md; 6.1 took 4.1 s with other builds on the cores),
    // so there the bound is 1 s x 12 and the test checks that lb's mechanism moved the client.
    let slowdown = lb_tests::daemon::slowdown();
    let emulation = if slowdown > 1 { 4 * slowdown } else { 1 };
    let bound_ms = 1000.0 * f64::from(emulation);
    let mechanism = if destroy {
        "socket destroy"
    } else {
        "cgroup egress drop"
    };
    let duration_ms = 4000 * u64::from(slowdown);
    const REMOVE_AFTER_REPLIES: usize = 30;
    let mut tb = Testbed::create(3).expect("testbed");
    tb.start_echo_servers(Path::new(LB_ECHO), ECHO_PORT)
        .expect("echo servers");
    let manifests = Manifests::new(&tb.id);
    let args = lb_args(&tb, &manifests.0, true);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut opts =
        lb_tests::daemon::LbOptions::for_testbed(&tb, "info,lb::reconcile::resteer=debug");
    if no_destroy {
        opts.env.push(("LB_NO_SOCK_DESTROY".into(), "1".into()));
    }
    let mut lb = LbDaemon::spawn_with(&mut tb, Path::new(LB), &args, opts).unwrap();
    lb.wait_for(
        |l| l.contains("connected UDP re-steering"),
        "re-steering on",
    )
    .unwrap();
    lb.wait_for(|l| l.contains(" ready"), "ready").unwrap();

    let mut removed: u32 = 0;
    let mut generation = 1;
    // IPv4, IPv6, and an IPv6 socket connected to the IPv4 VIP as ::ffff:a.b.c.d (socket LB
    // balances it with the IPv4 maps; the kernel sends IPv4).
    for target in [
        "198.19.0.10:53",
        "[2001:db8:ffff::10]:53",
        "[::ffff:198.19.0.10]:53",
    ] {
        let mut cmd = Command::new(LB_ECHO);
        cmd.args(["stream", "--target", target, "--interval-ms", "10"])
            .args(["--duration-ms", &duration_ms.to_string()])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let (ns, cg) = (tb.client.ns.clone(), tb.cgroup.clone());
        let mut child = tb.spawn(&ns, Some(cg.as_path()), cmd).expect("stream");
        let stdout = child.stdout.take().unwrap();
        let mut run = StreamRun::default();
        let mut pinned: Option<String> = None;
        use std::io::BufRead as _;
        for line in std::io::BufReader::new(stdout).lines() {
            let line = line.unwrap();
            let v: serde_json::Value = serde_json::from_str(&line).expect("stream JSON");
            let t = v["t_ms"].as_f64().unwrap_or_default();
            match v["event"].as_str() {
                Some("reply") => {
                    let b = v["backend"].as_str().unwrap().to_string();
                    run.replies.push((t, b.clone()));
                    if pinned.is_none() && run.replies.len() == REMOVE_AFTER_REPLIES {
                        // The backend goes silent (its replies to the client blackholed: no
                        // ICMP either) and leaves the service, as a deleted pod does.
                        let host = tb.backends.iter().find(|h| h.name == b).unwrap().clone();
                        blackhole(&host.ns, &tb.client, "add");
                        let (v4, v6) = (host.ipv4.to_string(), host.ipv6.to_string());
                        manifests.remove_endpoints(&[&v4, &v6]);
                        pinned = Some(b);
                    }
                }
                Some("error") => run.errors.push((
                    t,
                    v["op"].as_str().unwrap_or_default().to_string(),
                    v["errno"].as_i64().unwrap_or(-1),
                )),
                Some("done") => {
                    run.sent = v["sent"].as_u64().unwrap_or_default();
                    run.received = v["received"].as_u64().unwrap_or_default();
                }
                _ => {}
            }
        }
        let status = child.wait().unwrap();
        assert!(status.success(), "{target}: lb-echo stream failed: {run:?}");
        let old = pinned.unwrap_or_else(|| panic!("{target}: too few replies: {run:?}"));
        removed += 1;
        generation += 1;
        let last_old = run
            .replies
            .iter()
            .filter(|(_, b)| *b == old)
            .map(|(t, _)| *t)
            .fold(0.0, f64::max);
        let first_new = run
            .replies
            .iter()
            .find(|(t, b)| *b != old && *t > last_old)
            .map(|(t, _)| *t)
            .unwrap_or_else(|| {
                panic!(
                    "{target}: no reply from another backend after {old} was removed (the \
                     socket was never re-steered): errors {:?}",
                    run.errors
                )
            });
        let window = first_new - last_old;
        let lost = run.sent - run.received;
        eprintln!(
            "{target} ({mechanism}): loss window {window:.0} ms ({lost} of {} datagrams \
             unanswered), {old} -> another backend; errors {:?}",
            run.sent, run.errors
        );
        // The error that moved the client is the mechanism's: the destroy's ECONNABORTED (103)
        // on recv (or EDESTADDRREQ (89) on a send after the disconnect), or the egress drop's
        // EPERM (1) on send.
        let cause = run.errors.iter().find(|(t, _, _)| *t > last_old);
        let expected = match cause {
            Some((_, _, 103 | 89)) => destroy,
            Some((_, op, 1)) => !destroy && op == "send",
            _ => false,
        };
        assert!(
            expected,
            "{target}: the client must have been moved by the {mechanism}: errors {:?}",
            run.errors
        );
        assert!(
            window <= bound_ms,
            "{target}: {window:.0} ms without replies, more than the bound of {bound_ms} ms"
        );
        assert!(
            run.replies.iter().all(|(t, b)| *t <= last_old || *b != old),
            "{target}: no reply from the removed backend after the switch"
        );
        if destroy {
            let pass = lb
                .wait_for(
                    |l| l.contains("UDP socket destroy pass") && l.contains("destroyed=1"),
                    "destroy pass",
                )
                .unwrap();
            eprintln!("{target}: {pass}");
        }
        // The backend comes back for the next round (three backends each time).
        let host = tb.backends.iter().find(|h| h.name == old).unwrap().clone();
        blackhole(&host.ns, &tb.client, "del");
        let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/examples");
        let text = fs::read_to_string(examples.join("echo-endpointslices.yaml")).unwrap();
        manifests.add("echo-endpointslices.yaml", &text);
        generation += 1;
        let want = format!("generation={generation}");
        lb.wait_for(|l| l.contains("synced") && l.contains(&want), &want)
            .unwrap();
    }
    let node = tb.node_ns.clone();
    let (_, text) = http_get(&node, METRICS, "/metrics").unwrap();
    let destroyed = sample(&text, "lb_udp_sockets_destroyed_total");
    let dropped = lb.counter(metrics::SOCK_UDP_GONE_DROP).unwrap();
    if destroy {
        assert_eq!(
            destroyed,
            Some(f64::from(removed)),
            "one destroyed socket per removal"
        );
    } else {
        assert_eq!(destroyed.unwrap_or(0.0), 0.0, "nothing destroyed");
        assert_eq!(
            dropped,
            u64::from(removed),
            "one dropped datagram per removal"
        );
    }
    drop(lb);
}

/// UDP datagrams beyond the MTU (4000 bytes each way, so the request and the backend's
/// answer are both fragmented) are served, IPv4 and IPv6: through the tc path, whose later
/// fragments follow their first one's flow (`frag` in lb-ebpf), and through socket LB, which
/// needs nothing for them (it rewrites the socket; the stack fragments afterwards).
#[test]
fn udp_beyond_the_mtu_is_served_on_both_paths() {
    for socket_lb in [false, true] {
        let mut tb = Testbed::create(3).expect("testbed");
        tb.start_echo_servers(Path::new(LB_ECHO), ECHO_PORT)
            .expect("echo servers");
        let manifests = Manifests::new(&tb.id);
        let lb = start_lb(&mut tb, &manifests.0, socket_lb);
        let established = lb.counter(metrics::TC_FWD_ESTABLISHED).unwrap();
        for target in ["198.19.0.10:53", "[2001:db8:ffff::10]:53"] {
            let what = format!("socket_lb={socket_lb} {target}");
            let o = client(
                &mut tb,
                socket_lb,
                target,
                "udp",
                &["--payload-bytes", "4000"],
            );
            assert!(o.errors.is_empty(), "{what}: {o:?}");
            assert!(
                o.per_backend.len() >= 2,
                "{what}: {REQUESTS} requests spread: {o:?}"
            );
            assert_eq!(o.peers.len(), 1, "{what}: replies from the VIP: {o:?}");
        }
        let later = lb.counter(metrics::TC_FWD_ESTABLISHED).unwrap() - established;
        let unknown = lb.counter(metrics::TC_PASS_FRAGMENT_UNKNOWN).unwrap()
            + lb.counter(metrics::TC_PASS_FRAGMENT_NO_FLOW).unwrap();
        assert_eq!(
            unknown, 0,
            "socket_lb={socket_lb}: no fragment passed untranslated"
        );
        if socket_lb {
            assert_eq!(later, 0, "socket LB: no packet went through tc");
        } else {
            // Two later fragments per request, 2 × REQUESTS requests.
            assert!(
                later >= 4 * REQUESTS as u64,
                "tc: later fragments followed their flows ({later})"
            );
        }
    }
}

/// Services `solo1`..`solo{n}`: each a ClusterIP (`198.19.0.3i`, `2001:db8:ffff::3i`, UDP 53 to
/// 8080) whose only endpoint is backend i, so one socket talking to them holds n distinct
/// (backend, frontend) pairs.
fn add_solo_services(manifests: &Manifests, n: usize) -> Vec<(String, String)> {
    (1..=n)
        .map(|i| {
            let text = SOLO
                .replace("solo", &format!("solo{i}"))
                .replace("198.19.0.20", &format!("198.19.0.3{i}"))
                .replace("2001:db8:ffff::20", &format!("2001:db8:ffff::3{i}"))
                .replace("198.18.11.2", &format!("198.18.1{i}.2"))
                .replace("2001:db8:0:11::2", &format!("2001:db8:0:1{i}::2"));
            manifests.add(&format!("solo{i}.yaml"), &text);
            (
                format!("198.19.0.3{i}:53"),
                format!("[2001:db8:ffff::3{i}]:53"),
            )
        })
        .collect()
}

/// `lb-echo multi` from the client in the cgroup: one unconnected UDP socket sending to each
/// of `targets` in turn for `rounds`; asserts every reply came back from the target it was
/// sent to (recvmsg reports the VIP, not the backend) and from its own backend.
fn multi_vip_round_trips(tb: &mut Testbed, targets: &[&str], rounds: u32, what: &str) {
    let mut cmd = Command::new(LB_ECHO);
    cmd.args(["multi", "--rounds", &rounds.to_string()]);
    for t in targets {
        cmd.args(["--target", t]);
    }
    let cg = tb.cgroup.clone();
    let ns = tb.client.ns.clone();
    let out = tb.run(&ns, Some(cg.as_path()), cmd).expect("run multi");
    let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("multi JSON"))
        .collect();
    assert_eq!(
        lines.len(),
        targets.len() * rounds as usize,
        "{what}: one line per request; stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    for v in &lines {
        assert!(v.get("error").is_none(), "{what}: {v}");
        assert_eq!(
            v["peer"], v["target"],
            "{what}: the reply's source is the VIP: {v}"
        );
        // solo{i} at 198.19.0.3i / ::3i is served by backend i alone (`b{i}`).
        let target = v["target"].as_str().unwrap_or_default();
        let i = target.rsplit_once(':').map_or("", |(a, _)| a);
        let i = i.trim_end_matches(']').chars().last().unwrap_or('?');
        assert_eq!(v["backend"], format!("b{i}"), "{what}: {v}");
    }
}

/// Entries of both `lb*_sk_revnat` LRU maps.
fn sk_revnat_entries(pin_dir: &Path) -> usize {
    let m4: HashMap<MapData, lb_common::SkRevNat4Key, lb_common::SkRevNat4Value> =
        open_lru(pin_dir, map_names::SK_REVNAT4);
    let m6: HashMap<MapData, lb_common::SkRevNat6Key, lb_common::SkRevNat6Value> =
        open_lru(pin_dir, map_names::SK_REVNAT6);
    m4.keys().filter_map(Result::ok).count() + m6.keys().filter_map(Result::ok).count()
}

/// Where the probe finds `bpf_sk_storage_get` for sock_addr programs, socket LB gives a socket
/// `lb*_sk_store` storage when it comes back to a pair it recorded in `lb*_sk_revnat`: TCP,
/// connected and unconnected UDP through the VIPs (IPv4, IPv6, `::ffff:` + the IPv4 VIP) get
/// their replies from the VIP, and one unconnected socket alternating between VIPs sees each
/// reply from its own VIP, with exactly one storage made per such socket (its first pairs stay
/// in the LRU, the rest go to its slots; a fifth pair past the four slots overflows to the LRU
/// and still reads back). With `LB_NO_SK_STORAGE=1` (what kernels without the helper get) the
/// same traffic works through the LRU alone and no storage is made.
#[test]
fn socket_lb_keeps_pairs_in_socket_storage_where_the_kernel_has_it() {
    let storage = lb::datapath::load::sock_storage_supported();
    for no_storage in [false, true] {
        if !no_storage && !storage {
            eprintln!("no bpf_sk_storage_get for sock_addr programs: the LRU path only");
            continue;
        }
        let mut tb = Testbed::create(5).expect("testbed");
        tb.start_echo_servers(Path::new(LB_ECHO), ECHO_PORT)
            .expect("echo servers");
        let manifests = Manifests::new(&tb.id);
        let solos = add_solo_services(&manifests, 5);
        let args = lb_args(&tb, &manifests.0, true);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let mut opts = lb_tests::daemon::LbOptions::for_testbed(&tb, "info");
        if no_storage {
            opts.env.push(("LB_NO_SK_STORAGE".into(), "1".into()));
        }
        let mut lb = LbDaemon::spawn_with(&mut tb, Path::new(LB), &args, opts).unwrap();
        lb.wait_for(|l| l.contains(" ready"), "ready").unwrap();
        let mode = if no_storage { "LRU" } else { "socket storage" };
        let used = lb
            .log
            .iter()
            .any(|l| l.contains("sock_pairs=\"socket storage"));
        assert_eq!(used, !no_storage, "{mode}: lb's log names the mode");

        for (target, proto) in TARGETS
            .into_iter()
            .chain([("[::ffff:198.19.0.10]:53", "udp")])
        {
            for extra in [&[][..], &["--connected-udp"][..]] {
                let o = client(&mut tb, true, target, proto, extra);
                assert!(o.errors.is_empty(), "{mode} {target}/{proto}: {o:?}");
                assert_eq!(
                    o.peers,
                    BTreeSet::from([target.to_string()]),
                    "{mode}: {o:?}"
                );
            }
        }
        // Two VIPs per family from one unconnected socket, then all five (one more than a
        // socket's slots).
        let v4: Vec<&str> = solos.iter().map(|(a, _)| a.as_str()).collect();
        let v6: Vec<&str> = solos.iter().map(|(_, b)| b.as_str()).collect();
        let created = || lb.counter(metrics::SOCK_STORAGE_CREATED).unwrap();
        let before = created();
        multi_vip_round_trips(&mut tb, &v4[..2], 3, &format!("{mode}, IPv4 × 2"));
        multi_vip_round_trips(&mut tb, &v6[..2], 3, &format!("{mode}, IPv6 × 2"));
        let lru = sk_revnat_entries(&lb.pin_dir);
        assert!(lru > 0, "{mode}: lb*_sk_revnat holds the first pairs");
        if no_storage {
            assert_eq!(created(), 0, "LRU mode: no socket storage made");
            continue;
        }
        assert_eq!(
            created() - before,
            2,
            "one storage per unconnected socket that came back to its pair (one per family)"
        );
        multi_vip_round_trips(&mut tb, &v4, 2, "socket storage, IPv4 × 5");
        multi_vip_round_trips(&mut tb, &v6, 2, "socket storage, IPv6 × 5");
        assert_eq!(created() - before, 4, "again one storage per socket");
        assert_eq!(
            sk_revnat_entries(&lb.pin_dir) - lru,
            10,
            "each socket's five first pairs are in lb*_sk_revnat; the fifth's overflow \
             rewrites its own entry"
        );
    }
}
