//! End to end with the Kubernetes API source: `lb run --kubeconfig` in the node netns of a
//! testbed follows a fake API server (tests/support/apiserver.rs) and steers real TCP
//! connections from the client netns to the backends the EndpointSlice names; a MODIFIED
//! slice takes a backend set down to one; the API server gone for many watch timeouts changes
//! nothing in the datapath, and lb converges on what changed meanwhile once it is back.
//! Needs root.
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
    time::{Duration, Instant},
};

use lb_tests::{
    bins::LB_ECHO,
    daemon::{LbDaemon, Services, frontends},
    metrics::{HEALTH, METRICS, healthz, metric},
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
    start_lb_with(tb, kubeconfig, &["--metrics-bind-address", "off"])
}

/// [`start_lb`] with `extra` arguments instead of `--metrics-bind-address off`.
fn start_lb_with(tb: &mut Testbed, kubeconfig: &Path, extra: &[&str]) -> LbDaemon {
    LbDaemon::start_kube(tb, kubeconfig, NODE, extra, "info,lb=debug").unwrap()
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

/// Replies per backend name from `lb-echo client --count 30` to `target` in the client netns (tc
/// path, so no cgroup), and the peers the client saw.
fn client_to(tb: &Testbed, target: &str) -> (BTreeMap<String, usize>, BTreeSet<String>) {
    let mut cmd = Command::new(LB_ECHO);
    cmd.args(["client", "--target", target, "--proto", "tcp"])
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
    backends_at(tb, TARGET)
}

/// The backend names that answer [`REQUESTS`] connections to `target`.
fn backends_at(tb: &Testbed, target: &str) -> Vec<String> {
    let (per_backend, peers) = client_to(tb, target);
    assert_eq!(
        peers,
        BTreeSet::from([target.to_string()]),
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

/// `--watch-timeout` for the outage test: every watch request lasts 1 s.
const WATCH_TIMEOUT_S: u64 = 1;
/// How long the API server stays away: many watch timeouts.
const OUTAGE: Duration = Duration::from_secs(12 * WATCH_TIMEOUT_S);
/// After the server returns: kube-rs' backoff has grown to up to 30 s by then.
const CONVERGE: Duration = Duration::from_secs(75);
const GONE_TARGET: &str = "198.19.0.11:80";

/// Takes the API server away for [`OUTAGE`] while `change` rewrites its store; meanwhile the
/// datapath must keep `before` (checked with real connections and the pinned maps), `/healthz`
/// stay 200 and say disconnected. Then the server returns on the same address and lb must
/// converge on exactly `after`. Returns how long the outage lasted and how long convergence
/// took after the server's return.
fn outage(
    tb: &Testbed,
    lb: &LbDaemon,
    api: &ApiServer,
    before: &Services,
    after: &Services,
    change: impl FnOnce(&ApiServer),
) -> (Duration, Duration) {
    assert_eq!(
        &lb.services(tb, None).unwrap(),
        before,
        "state before the outage"
    );
    let errors_before = metric(tb, "lb_watch_errors_total{kind=\"services\"}").unwrap();
    let started = Instant::now();
    api.stop();
    assert!(!api.is_serving());
    change(api);

    let mut saw_disconnected = false;
    let mut checks = 0;
    while started.elapsed() < OUTAGE {
        // The last state keeps serving: every connection succeeds, to the old backends.
        assert_eq!(backends(tb), ["b1", "b2", "b3"], "echo during the outage");
        assert_eq!(
            backends_at(tb, GONE_TARGET),
            ["b1"],
            "gone during the outage"
        );
        assert_eq!(
            &lb.services(tb, None).unwrap(),
            before,
            "maps during the outage"
        );
        let (status, h) = healthz(tb).unwrap();
        assert_eq!(status, 200, "healthz stays 200 during an outage: {h}");
        assert_eq!(h["healthy"], true, "{h}");
        if h["apiServer"]["connected"] == false {
            assert!(h["apiServer"]["lastError"].is_string(), "{h}");
            assert!(h["apiServer"]["lastContact"].is_string(), "{h}");
            assert_eq!(metric(tb, "lb_apiserver_connected").unwrap(), 0.0);
            saw_disconnected = true;
        }
        checks += 1;
        std::thread::sleep(Duration::from_millis(500));
    }
    let lasted = started.elapsed();
    assert!(
        saw_disconnected,
        "healthz reported the API server disconnected"
    );
    assert!(checks >= 3, "the outage was checked {checks} times");
    assert!(
        metric(tb, "lb_watch_errors_total{kind=\"services\"}").unwrap() > errors_before,
        "watch errors counted"
    );

    api.restart()
        .expect("the API server back on the same address");
    let back = Instant::now();
    let deadline = back + CONVERGE;
    loop {
        let now = lb.services(tb, None).unwrap();
        let (status, h) = healthz(tb).unwrap();
        if &now == after && h["apiServer"]["connected"] == true {
            assert_eq!(status, 200, "{h}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not converged within {CONVERGE:?} of the server's return: maps {now:?}, want \
             {after:?}; healthz {h}\nlb log:\n{}",
            lb.log.join("\n")
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    let converged = back.elapsed();
    assert_eq!(metric(tb, "lb_apiserver_connected").unwrap(), 1.0);
    (lasted, converged)
}

/// The API server disappears (listener closed, watches dropped, connections refused) for 12
/// watch timeouts, twice, while the test deletes a Service and changes another's endpoints in
/// its store. Real connections to both VIPs keep working with the old backends throughout,
/// `/healthz` stays 200 and reports the disconnection, and when the server is back on the same
/// address lb converges on exactly the new state:
///
/// 1. history kept: the watches resume from their resourceVersion and get the DELETED and
///    MODIFIED events they missed;
/// 2. history compacted during the outage (as etcd does in minutes): the resumed watches get
///    410 Gone and relist; the reflector's store is replaced, so the deleted Service leaves
///    the maps (cilium#48050 kept such objects).
#[test]
fn api_server_outage_keeps_the_last_state_and_converges_after() {
    let mut tb = Testbed::create(3).expect("testbed");
    tb.start_echo_servers(Path::new(LB_ECHO), ECHO_PORT)
        .expect("echo servers");
    let node_ns = Path::new("/run/netns").join(&tb.node_ns);
    let api =
        ApiServer::start_on_thread(Some(&node_ns)).expect("fake API server in the node netns");
    let kubeconfig = api.kubeconfig_file().expect("kubeconfig");

    let [b1, b2, b3] = ["198.18.11.2", "198.18.12.2", "198.18.13.2"];
    let echo_slice = |eps: &[Ep]| slice("demo", "echo-abc12", "echo", 8080, eps);
    let gone = service("demo", "gone", "198.19.0.11", 80, 8080);
    let gone_slice = slice("demo", "gone-abc12", "gone", 8080, &[Ep::ready(b1)]);
    let setup = |api: &ApiServer| {
        api.apply(&service("demo", "echo", "198.19.0.10", 80, 8080));
        api.apply(&echo_slice(&[Ep::ready(b1), Ep::ready(b2), Ep::ready(b3)]));
        api.apply(&gone);
        api.apply(&gone_slice);
    };
    setup(&api);
    let timeout = WATCH_TIMEOUT_S.to_string();
    let lb = start_lb_with(
        &mut tb,
        kubeconfig.path(),
        &[
            "--metrics-bind-address",
            METRICS,
            "--healthz-bind-address",
            HEALTH,
            "--watch-timeout",
            &timeout,
        ],
    );
    let all = [b1, b2, b3];
    let before = frontends(
        &[("198.19.0.10:80", &all), ("198.19.0.11:80", &[b1])],
        ECHO_PORT,
    );
    let after = frontends(&[("198.19.0.10:80", &[b3])], ECHO_PORT);
    let deadline = Instant::now() + CONVERGE;
    while lb.services(&tb, None).unwrap() != before
        || healthz(&tb).unwrap().1["apiServer"]["connected"] != true
    {
        assert!(Instant::now() < deadline, "initial state not reached");
        std::thread::sleep(Duration::from_millis(100));
    }
    let (status, h) = healthz(&tb).unwrap();
    assert_eq!(status, 200, "{h}");
    assert_eq!(metric(&tb, "lb_apiserver_connected").unwrap(), 1.0);

    // 1. History kept: resumed watches replay what they missed.
    let first = outage(&tb, &lb, &api, &before, &after, |api| {
        api.delete(&gone);
        api.delete(&gone_slice);
        api.update(&echo_slice(&[Ep::ready(b3)]));
    });
    assert_eq!(backends(&tb), ["b3"], "the changed endpoints serve");

    // Back to the first state, through the API.
    let relists = metric(&tb, "lb_watch_relists_total{kind=\"services\"}").unwrap();
    setup(&api);
    let deadline = Instant::now() + CONVERGE;
    while lb.services(&tb, None).unwrap() != before {
        assert!(Instant::now() < deadline, "first state not reached again");
        std::thread::sleep(Duration::from_millis(100));
    }

    // 2. History compacted during the outage: 410 Gone, relist, store replaced.
    let second = outage(&tb, &lb, &api, &before, &after, |api| {
        api.delete(&gone);
        api.delete(&gone_slice);
        api.update(&echo_slice(&[Ep::ready(b3)]));
        api.compact();
    });
    assert_eq!(backends(&tb), ["b3"], "the changed endpoints serve");
    assert!(
        api.gone_count(Kind::Service) >= 1 && api.gone_count(Kind::EndpointSlice) >= 1,
        "the resumed watches were answered 410 Gone"
    );
    assert!(
        metric(&tb, "lb_watch_relists_total{kind=\"services\"}").unwrap() > relists,
        "lb relisted after the 410"
    );
    eprintln!(
        "outages survived (length, convergence after the return): {first:?} resumed, \
         {second:?} relisted; --watch-timeout {WATCH_TIMEOUT_S} s"
    );
    drop(lb);
    drop(kubeconfig);
    drop(api);
}
