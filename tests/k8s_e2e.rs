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
    fs,
    io::{BufRead as _, BufReader},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use lb::testbed::Testbed;
use support::{
    Ep,
    apiserver::{ApiServer, Kind},
    service, slice,
};

const LB: &str = env!("CARGO_BIN_EXE_lb");
const LB_ECHO: &str = env!("CARGO_BIN_EXE_lb-echo");
const ECHO_PORT: u16 = 8080;
const REQUESTS: usize = 30;
const NODE: &str = "node-a";
const TARGET: &str = "198.19.0.10:80";

/// `lb run --kubeconfig` in the node netns, with its log lines collected. Stopped (SIGTERM,
/// then SIGKILL) and its pin dir removed on drop.
struct LbProcess {
    child: Child,
    lines: mpsc::Receiver<String>,
    log: Vec<String>,
    pin_dir: PathBuf,
}

impl LbProcess {
    fn start(tb: &mut Testbed, kubeconfig: &Path) -> Self {
        let pin_dir = PathBuf::from(format!("/sys/fs/bpf/lb-test-{}", tb.id));
        let mut cmd = Command::new(LB);
        cmd.arg("run")
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .args(["--hostname-override", NODE])
            .arg("--pin-dir")
            .arg(&pin_dir)
            .arg("--socket-lb=false")
            .arg("--tc-ingress")
            .arg(tb.node_ifaces().join(","))
            .args(["--metrics-bind-address", "off"])
            // lb's own debug lines (event-to-write latency), not the HTTP stack's.
            .env("RUST_LOG", "info,lb=debug")
            // A proxy from the environment must not take the loopback connection elsewhere.
            .env_remove("HTTPS_PROXY")
            .env_remove("https_proxy")
            .env_remove("KUBECONFIG")
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let node_ns = tb.node_ns.clone();
        let mut child = tb.spawn(&node_ns, None, cmd).expect("spawn lb");
        let stderr = child.stderr.take().expect("stderr");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut lb = Self {
            child,
            lines,
            log: Vec::new(),
            pin_dir,
        };
        lb.wait_for(|l| l.contains(" ready"), "ready");
        lb
    }

    /// Waits for a log line matching `pred` (also among the lines already collected since
    /// `from`), failing with the whole log on timeout or exit. Returns the line.
    fn wait_for(&mut self, pred: impl Fn(&str) -> bool, what: &str) -> String {
        self.wait_for_from(0, pred, what)
    }

    fn wait_for_from(&mut self, from: usize, pred: impl Fn(&str) -> bool, what: &str) -> String {
        if let Some(line) = self.log.iter().skip(from).find(|l| pred(l)) {
            return line.clone();
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            match self.lines.recv_timeout(Duration::from_millis(100)) {
                Ok(line) => {
                    let hit = pred(&line);
                    self.log.push(line.clone());
                    if hit {
                        return line;
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    if let Ok(Some(status)) = self.child.try_wait() {
                        panic!(
                            "lb exited ({status}) before {what}:\n{}",
                            self.log.join("\n")
                        );
                    }
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            }
        }
        panic!("no {what} from lb:\n{}", self.log.join("\n"));
    }

    /// The generation of the newest `synced` line so far.
    fn last_generation(&self) -> u64 {
        self.log
            .iter()
            .filter(|l| l.contains("synced"))
            .filter_map(|l| field(l, "generation"))
            .max()
            .unwrap_or(0)
    }
}

impl Drop for LbProcess {
    fn drop(&mut self) {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = fs::remove_dir_all(&self.pin_dir);
    }
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

    let mut lb = LbProcess::start(&mut tb, kubeconfig.path());
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
    let generation = lb.last_generation();
    let seen = lb.log.len();
    api.update(&slice("demo", "echo-abc12", "echo", 8080, &[Ep::ready(b1)]));
    let synced = lb.wait_for_from(
        seen,
        |l| {
            l.contains("synced")
                && field(l, "generation").is_some_and(|g| g > generation)
                && field(l, "backends") == Some(1)
        },
        "a later synced generation with one backend",
    );
    assert_eq!(field(&synced, "errors"), Some(0), "{synced}");
    assert_eq!(backends(&tb), ["b1"], "only b1 answers after the update");

    // The daemon logs the event-to-map-write latency at debug level.
    let latency = lb.wait_for(
        |l| l.contains("DEBUG") && l.contains("event to map write"),
        "the event-to-write latency line",
    );
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
