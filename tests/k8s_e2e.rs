//! End to end with the Kubernetes API source: `lb run --kubeconfig` in the node netns of a
//! testbed follows a fake API server (tests/support/apiserver.rs) and steers real TCP
//! connections from the client netns to the backends the EndpointSlice names; a MODIFIED
//! slice takes a backend set down to one. Needs root.
//!
//! The fake API server runs in this process on a thread that entered the node netns before
//! binding, so it listens on 127.0.0.1 *inside* the node netns, where `lb` reaches it; the test
//! controls it through its thread-safe handle. Nothing outside the testbed is touched.
#[expect(
    dead_code,
    reason = "the support module is shared with k8s_watch, which uses the rest of it"
)]
mod support;

use std::{
    collections::{BTreeMap, BTreeSet},
    path::Path,
    process::Command,
};

use lb_tests::{
    bins::{LB, LB_ECHO},
    daemon::LbDaemon,
    testbed::Testbed,
};
use support::{
    Ep,
    apiserver::{ApiServer, Kind},
    service, slice,
};

const ECHO_PORT: u16 = 8080;
const REQUESTS: usize = 30;
const NODE: &str = "node-a";
const TARGET: &str = "198.19.0.10:80";

/// `lb run --kubeconfig` in the node netns, until ready; lb's own debug lines (event-to-write
/// latency) are logged, not the HTTP stack's.
fn start_lb(tb: &mut Testbed, kubeconfig: &Path) -> LbDaemon {
    let ifaces = tb.node_ifaces().join(",");
    let args = [
        "--kubeconfig",
        kubeconfig.to_str().unwrap(),
        "--hostname-override",
        NODE,
        "--socket-lb=false",
        "--tc-ingress",
        &ifaces,
        "--metrics-bind-address",
        "off",
    ];
    LbDaemon::start(tb, Path::new(LB), &args, "info,lb=debug").unwrap()
}

/// The generation of the newest `synced` line so far.
fn last_generation(lb: &LbDaemon) -> u64 {
    lb.log
        .iter()
        .filter(|l| l.contains("synced"))
        .filter_map(|l| field(l, "generation"))
        .max()
        .unwrap_or(0)
}

/// The numeric value of `name=` in a log line.
fn field(line: &str, name: &str) -> Option<u64> {
    let prefix = format!("{name}=");
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(&prefix))
        .and_then(|v| v.parse().ok())
}

/// Replies per backend name from `lb-echo client --count 30` in the client netns (tc path, so
/// no cgroup), and the peers the client saw.
fn client(tb: &Testbed) -> (BTreeMap<String, usize>, BTreeSet<String>) {
    let mut cmd = Command::new(LB_ECHO);
    cmd.args(["client", "--target", TARGET, "--proto", "tcp"])
        .args(["--count", &REQUESTS.to_string()]);
    let out = tb.run(&tb.client.ns, None, cmd).expect("run client");
    let mut per_backend = BTreeMap::new();
    let mut peers = BTreeSet::new();
    let mut errors = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let v: serde_json::Value = serde_json::from_str(line).expect("client JSON");
        if let Some(e) = v.get("error") {
            errors.push(e.to_string());
            continue;
        }
        *per_backend
            .entry(v["backend"].as_str().unwrap_or_default().to_string())
            .or_default() += 1;
        peers.insert(v["peer"].as_str().unwrap_or_default().to_string());
    }
    assert!(
        errors.is_empty(),
        "client errors {errors:?}; stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        per_backend.values().sum::<usize>(),
        REQUESTS,
        "one reply per request; stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    (per_backend, peers)
}

fn backends(tb: &Testbed) -> Vec<String> {
    let (per_backend, peers) = client(tb);
    assert_eq!(
        peers,
        BTreeSet::from([TARGET.to_string()]),
        "the application sees the VIP as its peer"
    );
    per_backend.into_keys().collect()
}

#[test]
fn kubernetes_source_balances_and_follows_slice_changes() {
    let mut tb = Testbed::create(3).expect("testbed");
    tb.start_echo_servers(Path::new(LB_ECHO), ECHO_PORT)
        .expect("echo servers");
    let node_ns = Path::new("/run/netns").join(&tb.node_ns);
    let api =
        ApiServer::start_on_thread(Some(&node_ns)).expect("fake API server in the node netns");
    let kubeconfig = api.kubeconfig_file().expect("kubeconfig");

    let [b1, b2, b3] = ["198.18.11.2", "198.18.12.2", "198.18.13.2"];
    api.create(&service("demo", "echo", "198.19.0.10", 80, 8080));
    api.create(&slice(
        "demo",
        "echo-abc12",
        "echo",
        8080,
        &[Ep::ready(b1), Ep::ready(b2), Ep::ready(b3)],
    ));

    let mut lb = start_lb(&mut tb, kubeconfig.path());
    assert!(
        lb.log.iter().any(|l| l.contains("source: Kubernetes API")),
        "lb uses the API source:\n{}",
        lb.log.join("\n")
    );
    assert_eq!(
        backends(&tb),
        ["b1", "b2", "b3"],
        "all three backends reached"
    );

    // The slice loses b2 and b3: a MODIFIED event, a later generation with one backend.
    let generation = last_generation(&lb);
    let seen = lb.log.len();
    api.update(&slice("demo", "echo-abc12", "echo", 8080, &[Ep::ready(b1)]));
    let synced = lb
        .wait_for_from(
            seen,
            |l| {
                l.contains("synced")
                    && field(l, "generation").is_some_and(|g| g > generation)
                    && field(l, "backends") == Some(1)
            },
            "a later synced generation with one backend",
        )
        .unwrap();
    assert_eq!(field(&synced, "errors"), Some(0), "{synced}");
    assert_eq!(backends(&tb), ["b1"], "only b1 answers after the update");

    // The daemon logs the event-to-map-write latency at debug level.
    let latency = lb
        .wait_for_from(
            0,
            |l| l.contains("DEBUG") && l.contains("event to map write"),
            "the event-to-write latency line",
        )
        .unwrap();
    assert!(
        field(&latency, "event_to_write_us").is_some(),
        "latency in microseconds: {latency}"
    );
    let after_update = lb
        .log
        .iter()
        .filter(|l| l.contains("event to map write"))
        .filter_map(|l| field(l, "generation"))
        .any(|g| g > generation);
    assert!(
        after_update,
        "the update's latency is logged too:\n{}",
        lb.log.join("\n")
    );
    assert!(
        api.list_count(Kind::EndpointSlice) >= 1 && api.watch_count(Kind::EndpointSlice) >= 1,
        "lb listed and watched the API server"
    );

    // Shown with --nocapture.
    eprintln!("lb log:\n{}", lb.log.join("\n"));
    drop(lb);
    drop(kubeconfig);
    drop(api);
}
