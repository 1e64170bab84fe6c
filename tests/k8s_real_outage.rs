//! `lb run` against the real control plane (tests/src/controlplane.rs) when its path to the
//! API server is cut: lb and the control plane share a testbed's node netns, lb reaches the
//! apiserver through a port of its own (a plain TCP forwarder in that netns), and nftables in
//! that netns drops every packet to and from that port, so lb's connections neither answer
//! nor reset, as on a broken network. The test meanwhile changes objects through the
//! apiserver's own port. Needs root and the binaries `cargo xtask setup` builds.
#[expect(
    dead_code,
    reason = "the support module is shared with k8s_watch, which uses the rest of it"
)]
mod support;

use std::{
    collections::{BTreeMap, BTreeSet},
    io::Write as _,
    net::{TcpListener, TcpStream},
    path::Path,
    process::Command,
    time::{Duration, Instant},
};

use lb_tests::{
    bins::LB_ECHO,
    controlplane::{ControlPlane, Options},
    daemon::{LbDaemon, frontends},
    metrics::{HEALTH, METRICS, healthz, metric},
    netns::{in_netns, ns_path},
    testbed::Testbed,
};
use serde_json::{Value, json};
use support::{Ep, service, slice};

const NODE: &str = "node-a";
const NS: &str = "demo";
const ECHO_PORT: u16 = 8080;
/// `--watch-timeout`: each watch request lasts 2 s.
const WATCH_TIMEOUT_S: u64 = 2;
/// How long lb's path stays cut: 15 watch timeouts.
const CUT: Duration = Duration::from_secs(15 * WATCH_TIMEOUT_S);
/// After the path returns: kube-rs' backoff may have grown to 30 s, a connect may take 7 s.
const CONVERGE: Duration = Duration::from_secs(90);
const ECHO: &str = "198.19.0.10:80";
const GONE: &str = "198.19.0.11:80";

fn to_json(v: &impl serde::Serialize) -> Value {
    serde_json::to_value(v).expect("JSON")
}

/// Listens on a free port of 127.0.0.1 in netns `ns` and forwards every connection to
/// `upstream` (in the same netns), on threads that live as long as the test process; returns
/// the port.
fn forward(ns: &str, upstream: String) -> u16 {
    let path = ns_path(ns);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let netns = std::fs::File::open(&path).expect("open netns");
        nix::sched::setns(&netns, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind forwarder");
        tx.send(listener.local_addr().expect("address").port())
            .expect("send port");
        // Threads spawned from here inherit this thread's netns.
        for down in listener.incoming().map_while(Result::ok) {
            let upstream = upstream.clone();
            std::thread::spawn(move || {
                let Ok(up) = TcpStream::connect(&upstream) else {
                    return;
                };
                let (mut down_r, mut up_w) = (
                    down.try_clone().expect("clone"),
                    up.try_clone().expect("clone"),
                );
                let t = std::thread::spawn(move || {
                    let _ = std::io::copy(&mut down_r, &mut up_w);
                    let _ = up_w.shutdown(std::net::Shutdown::Write);
                });
                let (mut up_r, mut down_w) = (up, down);
                let _ = std::io::copy(&mut up_r, &mut down_w);
                let _ = down_w.shutdown(std::net::Shutdown::Write);
                let _ = t.join();
            });
        }
    });
    rx.recv().expect("the forwarder's port")
}

/// Drops every packet to or from TCP port `port` in the node netns while it lives (an nftables
/// table of its own there, deleted on drop).
struct Cut<'a> {
    tb: &'a Testbed,
    table: String,
}

impl<'a> Cut<'a> {
    fn new(tb: &'a Testbed, port: u16) -> Self {
        let table = format!("lbcut{}", tb.id);
        // Loopback traffic passes `output` once per direction: both ends are local senders.
        let script = format!(
            "table inet {table} {{\n  chain out {{\n    type filter hook output priority 0;\n    \
             tcp dport {port} drop\n    tcp sport {port} drop\n  }}\n}}\n"
        );
        nft(tb, &["-f", "-"], Some(&script));
        Self { tb, table }
    }
}

impl Drop for Cut<'_> {
    fn drop(&mut self) {
        nft(self.tb, &["delete", "table", "inet", &self.table], None);
    }
}

fn nft(tb: &Testbed, args: &[&str], stdin: Option<&str>) {
    let ns = tb.node_ns.clone();
    let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
    let stdin = stdin.map(str::to_owned);
    let out = in_netns(&ns, move || {
        let mut child = Command::new("nft")
            .args(&args)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()?;
        if let Some(s) = stdin {
            child.stdin.take().expect("stdin").write_all(s.as_bytes())?;
        }
        drop(child.stdin.take());
        Ok(child.wait_with_output()?)
    })
    .expect("nft");
    assert!(
        out.status.success(),
        "nft: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The backend names that answer 20 TCP connections from the client netns to `target`.
fn reached(tb: &Testbed, target: &str) -> BTreeSet<String> {
    let mut cmd = Command::new(LB_ECHO);
    cmd.args([
        "client", "--target", target, "--proto", "tcp", "--count", "20",
    ]);
    let out = tb.run(&tb.client.ns, None, cmd).expect("run client");
    let mut per_backend = BTreeMap::<String, usize>::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let v: Value = serde_json::from_str(line).expect("client JSON");
        assert!(v.get("error").is_none(), "client error to {target}: {v}");
        *per_backend
            .entry(v["backend"].as_str().unwrap_or_default().to_owned())
            .or_default() += 1;
    }
    assert_eq!(
        per_backend.values().sum::<usize>(),
        20,
        "one reply per request"
    );
    per_backend.into_keys().collect()
}

/// lb's path to the real apiserver is cut (its packets dropped) for 15 watch timeouts while
/// the test deletes a Service with its slice and changes another's endpoints through the API.
/// Real connections to both VIPs keep reaching the old backends, `/healthz` stays 200 and
/// reports the API server disconnected; when the path returns lb converges on exactly the
/// new state.
#[test]
fn lb_keeps_serving_through_a_cut_path_and_converges_when_it_returns() {
    let mut tb = Testbed::create(3).expect("testbed");
    tb.start_echo_servers(Path::new(LB_ECHO), ECHO_PORT)
        .expect("echo servers");
    let cp = ControlPlane::start_with(Options {
        netns: Some(tb.node_ns.clone()),
        endpointslice_controller: false,
        ..Options::default()
    })
    .expect("control plane in the node netns");
    let [b1, b2, b3] = ["198.18.11.2", "198.18.12.2", "198.18.13.2"];
    let echo_slice = |eps: &[Ep]| to_json(&slice(NS, "echo-1", "echo", 8080, eps));
    cp.apply(&[
        json!({ "apiVersion": "v1", "kind": "Namespace", "metadata": { "name": NS } }),
        json!({ "apiVersion": "v1", "kind": "Node", "metadata": { "name": NODE } }),
    ])
    .expect("kubectl apply");
    cp.apply(&[
        to_json(&service(NS, "echo", "198.19.0.10", 80, 8080)),
        echo_slice(&[Ep::ready(b1), Ep::ready(b2), Ep::ready(b3)]),
        to_json(&service(NS, "gone", "198.19.0.11", 80, 8080)),
        to_json(&slice(NS, "gone-1", "gone", 8080, &[Ep::ready(b1)])),
    ])
    .expect("kubectl apply");

    let upstream = cp.server.trim_start_matches("https://").to_owned();
    let port = forward(&tb.node_ns, upstream);
    let token = cp.lb_token().expect("lb token");
    let kubeconfig = cp
        .kubeconfig_at("lb-cut", &format!("https://127.0.0.1:{port}"), &token)
        .expect("kubeconfig");
    let timeout = WATCH_TIMEOUT_S.to_string();
    let extra = [
        "--metrics-bind-address",
        METRICS,
        "--healthz-bind-address",
        HEALTH,
        "--watch-timeout",
        &timeout,
    ];
    let lb = LbDaemon::start_kube(&mut tb, &kubeconfig, NODE, &extra, "info").expect("lb ready");
    let all = [b1, b2, b3];
    let before = frontends(&[(ECHO, &all), (GONE, &[b1])], ECHO_PORT);
    let after = frontends(&[(ECHO, &[b3])], ECHO_PORT);
    let deadline = Instant::now() + CONVERGE;
    while lb.services(&tb, Some(NS)).unwrap() != before {
        assert!(Instant::now() < deadline, "initial state not programmed");
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(healthz(&tb).unwrap().1["apiServer"]["connected"], true);

    let cut = Cut::new(&tb, port);
    let started = Instant::now();
    cp.kubectl_ok(
        &[
            "delete",
            "--namespace",
            NS,
            "service/gone",
            "endpointslice/gone-1",
        ],
        None,
    )
    .expect("delete through the apiserver's own port");
    cp.apply(&[echo_slice(&[Ep::ready(b3)])])
        .expect("kubectl apply");
    let mut saw_disconnected = false;
    while started.elapsed() < CUT {
        assert_eq!(
            reached(&tb, ECHO),
            BTreeSet::from(["b1", "b2", "b3"].map(String::from))
        );
        assert_eq!(reached(&tb, GONE), BTreeSet::from(["b1".to_owned()]));
        assert_eq!(
            lb.services(&tb, Some(NS)).unwrap(),
            before,
            "the last state stays programmed"
        );
        let (status, h) = healthz(&tb).unwrap();
        assert_eq!(status, 200, "a cut path alone keeps healthz 200: {h}");
        if h["apiServer"]["connected"] == false {
            assert_eq!(metric(&tb, "lb_apiserver_connected").unwrap(), 0.0);
            saw_disconnected = true;
        }
        std::thread::sleep(Duration::from_secs(1));
    }
    assert!(
        saw_disconnected,
        "healthz reported the cut: {}",
        healthz(&tb).unwrap().1
    );
    drop(cut);
    let cut_for = started.elapsed();

    let back = Instant::now();
    loop {
        let now = lb.services(&tb, Some(NS)).unwrap();
        let (status, h) = healthz(&tb).unwrap();
        if now == after && h["apiServer"]["connected"] == true {
            assert_eq!(status, 200, "{h}");
            break;
        }
        assert!(
            back.elapsed() < CONVERGE,
            "not converged within {CONVERGE:?} of the path's return: {now:?}, want {after:?}; \
             healthz {h}\nlb log:\n{}",
            lb.log.join("\n")
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    let converged = back.elapsed();
    assert_eq!(reached(&tb, ECHO), BTreeSet::from(["b3".to_owned()]));
    eprintln!(
        "path cut for {cut_for:?} (--watch-timeout {WATCH_TIMEOUT_S} s); converged {converged:?} \
         after it returned"
    );
    drop(lb);
    drop(cp);
}
