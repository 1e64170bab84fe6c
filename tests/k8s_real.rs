//! lb against a real Kubernetes control plane (tests/src/controlplane.rs: etcd, kube-apiserver
//! and the EndpointSlice controller of kube-controller-manager, built by `cargo xtask setup`):
//! what the fake API server (tests/support/apiserver.rs) cannot prove.
//!
//! * The EndpointSlices come from the real EndpointSlice controller: the tests create Services
//!   with selectors and Pods, and set the Pods' status (podIP, Ready) through the status
//!   subresource, as a kubelet would; no kubelet runs.
//! * lb authenticates with a ServiceAccount token bound by `deploy/rbac.yaml` applied as is.
//! * Each test has a control plane of its own (~5-20 s to start), so they run in parallel.
//!
//! The `lb run` test needs root (netns, eBPF); the others run lb's watch in this process.
#[expect(
    dead_code,
    reason = "the support module is shared with k8s_watch, which uses the fake server in it"
)]
mod support;

use std::{
    collections::{BTreeMap, BTreeSet},
    path::Path,
    process::Command,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use futures::StreamExt as _;
use k8s_openapi::{
    api::{
        core::v1::{Namespace, Node, Pod, Service, ServiceAccount},
        discovery::v1::EndpointSlice,
    },
    apimachinery::pkg::apis::meta::v1::Time,
};
use kube::{
    Api, Client,
    api::{DeleteParams, ListParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams},
};
use lb::{
    daemon,
    datapath::testing::{MemMaps, render},
    kube::source::{self, Snapshot, SnapshotReceiver},
    metrics::Metrics,
    reconcile::Reconciler,
};
use lb_tests::{
    bins::LB_ECHO,
    controlplane::{ControlPlane, Options},
    daemon::LbDaemon,
    testbed::Testbed,
};
use serde_json::{Value, json};
use support::maps::{Maps, be};
use tokio::{net::TcpListener, task::JoinHandle};

const NODE: &str = "node-a";
const ZONE: &str = "zone-a";
const NS: &str = "demo";
/// Generous: the controller batches, and the machine may be busy.
const WAIT: Duration = Duration::from_secs(90);

const VIP: &str = "198.19.0.10";
const FE: &str = "198.19.0.10:80/TCP";
const B1: &str = "198.18.11.2";
const B2: &str = "198.18.12.2";
const B3: &str = "198.18.13.2";

async fn client(kubeconfig: &Path) -> Client {
    lb::kube::k8s::client(Some(kubeconfig))
        .await
        .expect("kube client")
}

fn from_json<K: serde::de::DeserializeOwned>(v: Value) -> K {
    serde_json::from_value(v).expect("a valid object")
}

/// A ClusterIP Service `name` on [`VIP`]-like `ip`, port 80 → 8080, selecting `app=<name>`.
fn selector_service(name: &str, ip: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": { "name": name, "namespace": NS },
        "spec": {
            "selector": { "app": name },
            "clusterIP": ip,
            "ports": [{ "name": "http", "protocol": "TCP", "port": 80, "targetPort": 8080 }],
        },
    })
}

/// A Pod of app `app` bound to [`NODE`] (no scheduler, no kubelet).
fn pod(name: &str, app: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": { "name": name, "namespace": NS, "labels": { "app": app } },
        "spec": {
            "nodeName": NODE,
            "containers": [{
                "name": "echo",
                "image": "lb.invalid/echo:test",
                "ports": [{ "name": "http", "containerPort": 8080 }],
            }],
        },
    })
}

/// The status a kubelet would write: running at `ip`, Ready or not, changed now. The
/// controller's `last-change-trigger-time` annotation is the newest such transition time.
fn pod_status(ip: &str, ready: bool) -> Value {
    let ready = if ready { "True" } else { "False" };
    let now = Time(k8s_openapi::jiff::Timestamp::now());
    json!({
        "status": {
            "phase": "Running",
            "podIP": ip,
            "podIPs": [{ "ip": ip }],
            "conditions": [
                { "type": "Ready", "status": ready, "lastTransitionTime": now },
                { "type": "ContainersReady", "status": ready, "lastTransitionTime": now },
            ],
        },
    })
}

/// Namespace [`NS`] with its `default` ServiceAccount (which Pod admission requires; the
/// controller that would create it is not run) and Node [`NODE`] in [`ZONE`] (the
/// EndpointSlice controller skips Pods whose Node it does not know).
async fn prepare(admin: &Client) {
    let pp = PostParams::default();
    Api::<Namespace>::all(admin.clone())
        .create(&pp, &from_json(json!({ "metadata": { "name": NS } })))
        .await
        .expect("create namespace");
    Api::<ServiceAccount>::namespaced(admin.clone(), NS)
        .create(
            &pp,
            &from_json(json!({ "metadata": { "name": "default" } })),
        )
        .await
        .expect("create default ServiceAccount");
    Api::<Node>::all(admin.clone())
        .create(
            &pp,
            &from_json(json!({
                "metadata": { "name": NODE, "labels": { "topology.kubernetes.io/zone": ZONE } },
            })),
        )
        .await
        .expect("create node");
}

/// Creates Pod `name` of `app` and marks it running at `ip`, ready.
async fn start_pod(admin: &Client, name: &str, app: &str, ip: &str) {
    let pods = Api::<Pod>::namespaced(admin.clone(), NS);
    pods.create(&PostParams::default(), &from_json(pod(name, app)))
        .await
        .expect("create pod");
    set_ready(admin, name, ip, true).await;
}

async fn set_ready(admin: &Client, name: &str, ip: &str, ready: bool) {
    Api::<Pod>::namespaced(admin.clone(), NS)
        .patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(pod_status(ip, ready)),
        )
        .await
        .expect("patch pod status");
}

/// `k8s::watch` with lb's ServiceAccount token, and the daemon's translate + reconcile steps on
/// in-memory maps (as tests/k8s_watch.rs does against the fake).
struct Harness {
    rx: SnapshotReceiver,
    reconciler: Reconciler<MemMaps>,
    translator: lb::translate::incremental::IncrementalTranslator,
    metrics: Arc<Metrics>,
    maps: Maps,
    snapshots: usize,
    task: JoinHandle<()>,
}

impl Drop for Harness {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Harness {
    async fn start(lb_kubeconfig: &Path) -> Harness {
        // RUST_LOG=debug shows the watcher's and lb's view (with --nocapture).
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
        let (tx, rx) = source::channel();
        let task = tokio::spawn(lb::kube::k8s::watch(
            client(lb_kubeconfig).await,
            NODE.into(),
            tx,
        ));
        Harness {
            rx,
            reconciler: Reconciler::new(MemMaps::with_capacity(1024)).expect("reconciler"),
            translator: Default::default(),
            metrics: Metrics::new(),
            maps: Maps::default(),
            snapshots: 0,
            task,
        }
    }

    fn apply(&mut self, snapshot: &Snapshot) {
        self.snapshots += 1;
        let synced = daemon::sync(
            &mut self.reconciler,
            &mut self.translator,
            snapshot,
            NODE,
            self.snapshots as u64,
            &self.metrics,
        );
        assert!(
            synced.report.errors.is_empty(),
            "apply errors: {:?}",
            synced.report.errors
        );
        self.maps = Maps::parse(render(&self.reconciler.maps().dump));
    }

    /// Applies snapshots as they arrive until `pred` holds for the maps.
    async fn wait_until(&mut self, what: &str, pred: impl Fn(&Maps) -> bool) -> Maps {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            if self.snapshots > 0 && pred(&self.maps) {
                return self.maps.clone();
            }
            match tokio::time::timeout_at(deadline, self.rx.changed()).await {
                Ok(Ok(())) => {
                    let snapshot: Option<Arc<Snapshot>> = self.rx.borrow_and_update().clone();
                    if let Some(s) = snapshot {
                        self.apply(&s);
                    }
                }
                Ok(Err(_)) => panic!("{what}: the watch task ended\n{}", self.maps.text),
                Err(_) => panic!(
                    "{what}: not reached within {WAIT:?} ({} snapshots); maps:\n{}",
                    self.snapshots, self.maps.text
                ),
            }
        }
    }
}

/// Frontend `fe` exists with exactly `backends` (ready, in any slot order), and the maps are
/// consistent. Other frontends (the apiserver's own `default/kubernetes`) may exist.
fn has(m: &Maps, fe: &str, backends: &[&str]) -> bool {
    let want: BTreeSet<String> = backends.iter().map(|b| be(b)).collect();
    m.problems.is_empty()
        && m.frontends
            .get(fe)
            .is_some_and(|bs| bs.iter().cloned().collect::<BTreeSet<_>>() == want)
}

fn lacks(m: &Maps, fe: &str) -> bool {
    m.problems.is_empty() && !m.frontends.contains_key(fe)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpointslice_controller_slices_follow_pods() {
    let cp = ControlPlane::start().expect("control plane");
    let admin = client(&cp.admin_kubeconfig).await;
    prepare(&admin).await;
    let mut h = Harness::start(&cp.lb_kubeconfig().expect("lb kubeconfig")).await;
    let services = Api::<Service>::namespaced(admin.clone(), NS);
    let pods = Api::<Pod>::namespaced(admin.clone(), NS);

    services
        .create(
            &PostParams::default(),
            &from_json(selector_service("echo", VIP)),
        )
        .await
        .expect("create service");
    h.wait_until("the frontend, no backends yet", |m| has(m, FE, &[]))
        .await;

    start_pod(&admin, "echo-1", "echo", B1).await;
    start_pod(&admin, "echo-2", "echo", B2).await;
    h.wait_until("both pods as backends", |m| has(m, FE, &[B1, B2]))
        .await;

    // The slice is the controller's own: its labels, the trigger-time annotation lb's
    // programming-latency metric reads, and the Node's name and zone on each endpoint.
    let slices = Api::<EndpointSlice>::namespaced(admin.clone(), NS)
        .list(&ListParams::default().labels("kubernetes.io/service-name=echo"))
        .await
        .expect("list slices");
    // A placeholder slice (no endpoints) the controller keeps for an empty Service may linger.
    let with_endpoints: Vec<&EndpointSlice> = slices
        .items
        .iter()
        .filter(|s| s.endpoints.as_ref().is_some_and(|e| !e.is_empty()))
        .collect();
    assert_eq!(with_endpoints.len(), 1, "one slice: {:#?}", slices.items);
    let slice = with_endpoints[0];
    let labels = slice.metadata.labels.clone().unwrap_or_default();
    assert_eq!(
        labels
            .get("endpointslice.kubernetes.io/managed-by")
            .map(String::as_str),
        Some("endpointslice-controller.k8s.io"),
        "{slice:#?}"
    );
    let annotations = slice.metadata.annotations.clone().unwrap_or_default();
    assert!(
        annotations.contains_key("endpoints.kubernetes.io/last-change-trigger-time"),
        "{annotations:?}"
    );
    let endpoints = slice.endpoints.clone().unwrap_or_default();
    assert_eq!(endpoints.len(), 2, "{endpoints:?}");
    for ep in &endpoints {
        assert_eq!(ep.node_name.as_deref(), Some(NODE), "{ep:?}");
        assert_eq!(ep.zone.as_deref(), Some(ZONE), "{ep:?}");
        assert_eq!(
            ep.target_ref.as_ref().and_then(|r| r.kind.as_deref()),
            Some("Pod")
        );
    }

    // Not ready: out of the active slots, kept for established flows (quarantined). A third
    // pod: in.
    set_ready(&admin, "echo-2", B2, false).await;
    let b2_kept = format!("{B2} quarantined");
    h.wait_until("echo-2 not ready, quarantined", |m| {
        has(m, FE, &[B1, &b2_kept])
    })
    .await;
    start_pod(&admin, "echo-3", "echo", B3).await;
    h.wait_until("echo-3 added", |m| has(m, FE, &[B1, B3, &b2_kept]))
        .await;

    // Deleted pods (immediately: no kubelet would confirm a graceful deletion) leave.
    let now = DeleteParams {
        grace_period_seconds: Some(0),
        ..DeleteParams::default()
    };
    pods.delete("echo-1", &now).await.expect("delete pod");
    h.wait_until("echo-1 deleted, gone", |m| has(m, FE, &[B3, &b2_kept]))
        .await;

    // The Service deleted: the frontend goes, and with it its backends.
    services
        .delete("echo", &DeleteParams::default())
        .await
        .expect("delete service");
    let m = h.wait_until("frontend gone", |m| lacks(m, FE)).await;
    assert!(
        !m.text.contains(B3),
        "no backend of the deleted service left:\n{}",
        m.text
    );
}

fn kubectl_set_ready(cp: &ControlPlane, name: &str, ip: &str, ready: bool) {
    let patch = pod_status(ip, ready).to_string();
    cp.kubectl_ok(
        &[
            "patch",
            "pod",
            name,
            "--namespace",
            NS,
            "--subresource=status",
            "--type=merge",
            "--patch",
            &patch,
        ],
        None,
    )
    .expect("kubectl patch status");
}

/// Waits until the controller's slices of Service `echo` list exactly `n` ready endpoints, so
/// that lb's own (shorter) log waits measure lb, not the controller on a busy machine.
fn wait_ready_endpoints(cp: &ControlPlane, n: usize) {
    let deadline = std::time::Instant::now() + WAIT;
    let args = [
        "get",
        "endpointslices",
        "--namespace",
        NS,
        "--selector=kubernetes.io/service-name=echo",
        "--output=json",
    ];
    loop {
        let list: Value = serde_json::from_str(&cp.kubectl_ok(&args, None).expect("kubectl get"))
            .expect("slice list JSON");
        let ready = list["items"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|slice| slice["endpoints"].as_array().into_iter().flatten())
            .filter(|ep| ep["conditions"]["ready"] == json!(true))
            .count();
        if ready == n {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no slice with {n} ready endpoints within {WAIT:?}: {list:#}"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// The numeric value of `name=` in a log line.
fn field(line: &str, name: &str) -> Option<u64> {
    let prefix = format!("{name}=");
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(&prefix))
        .and_then(|v| v.parse().ok())
}

/// The backends (lb-echo names) that answer 20 TCP requests from the client netns to
/// `VIP:80` (tc path), all replies seen from the VIP.
fn reached(tb: &Testbed) -> BTreeSet<String> {
    let target = format!("{VIP}:80");
    let mut cmd = Command::new(LB_ECHO);
    cmd.args([
        "client", "--target", &target, "--proto", "tcp", "--count", "20",
    ]);
    let out = tb.run(&tb.client.ns, None, cmd).expect("run client");
    let mut per_backend = BTreeMap::<String, usize>::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let v: Value = serde_json::from_str(line).expect("client JSON");
        assert!(v.get("error").is_none(), "client error: {v}");
        assert_eq!(v["peer"].as_str(), Some(target.as_str()), "{v}");
        *per_backend
            .entry(v["backend"].as_str().unwrap_or_default().to_owned())
            .or_default() += 1;
    }
    assert_eq!(
        per_backend.values().sum::<usize>(),
        20,
        "one reply per request; stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    per_backend.into_keys().collect()
}

/// `lb run --kubeconfig` with the ServiceAccount token `deploy/rbac.yaml` binds: it programs
/// the Service from the real API, real connections reach the Pods the EndpointSlice
/// controller published, follow a Pod going unready, and the same token is refused a write.
/// The control plane runs inside the testbed's node netns, where lb is. Needs root.
#[test]
fn lb_run_with_deploy_rbac_follows_the_api_and_may_not_write() {
    let mut tb = Testbed::create(2).expect("testbed");
    tb.start_echo_servers(Path::new(LB_ECHO), 8080)
        .expect("echo servers");
    let cp = ControlPlane::start_with(Options {
        netns: Some(tb.node_ns.clone()),
        ..Options::default()
    })
    .expect("control plane in the node netns");
    let [b1, b2] = [
        tb.backends[0].ipv4.to_string(),
        tb.backends[1].ipv4.to_string(),
    ];
    cp.apply(&[
        json!({ "apiVersion": "v1", "kind": "Namespace", "metadata": { "name": NS } }),
        json!({ "apiVersion": "v1", "kind": "ServiceAccount",
                    "metadata": { "name": "default", "namespace": NS } }),
        json!({ "apiVersion": "v1", "kind": "Node", "metadata": { "name": NODE } }),
    ])
    .expect("kubectl apply");
    cp.apply(&[
        selector_service("echo", VIP),
        pod("echo-1", "echo"),
        pod("echo-2", "echo"),
    ])
    .expect("kubectl apply");
    kubectl_set_ready(&cp, "echo-1", &b1, true);
    kubectl_set_ready(&cp, "echo-2", &b2, true);
    wait_ready_endpoints(&cp, 2);

    let kubeconfig = cp.lb_kubeconfig().expect("lb kubeconfig");
    let extra = ["--metrics-bind-address", "off"];
    let mut lb =
        LbDaemon::start_kube(&mut tb, &kubeconfig, NODE, &extra, "info").expect("lb ready");
    let synced = |n: u64| {
        move |l: &str| {
            l.contains("synced") && field(l, "backends") == Some(n) && field(l, "errors") == Some(0)
        }
    };
    lb.wait_for_from(0, synced(2), "a sync with both pods")
        .expect("lb synced from the API");
    assert_eq!(
        reached(&tb),
        BTreeSet::from(["b1".to_owned(), "b2".to_owned()]),
        "both pods reached"
    );

    kubectl_set_ready(&cp, "echo-2", &b2, false);
    wait_ready_endpoints(&cp, 1);
    // echo-2 stays in the maps for its established flows (quarantined), so the sync's
    // backend count stays 2: wait sync by sync until new connections reach echo-1 only.
    loop {
        lb.wait_for(synced(2), "a sync after the readiness change")
            .expect("lb followed the readiness change");
        if reached(&tb) == BTreeSet::from(["b1".to_owned()]) {
            break;
        }
    }

    // Least privilege: lb's token reads what it watches and writes nothing.
    let read = cp
        .kubectl_as(
            &kubeconfig,
            &["get", "endpointslices", "--all-namespaces"],
            None,
        )
        .expect("kubectl");
    assert!(
        read.status.success(),
        "{}",
        String::from_utf8_lossy(&read.stderr)
    );
    let svc = selector_service("intruder", "198.19.0.99").to_string();
    let write = cp
        .kubectl_as(&kubeconfig, &["create", "-f", "-"], Some(svc.as_bytes()))
        .expect("kubectl");
    let stderr = String::from_utf8_lossy(&write.stderr);
    assert!(
        !write.status.success() && stderr.contains("forbidden"),
        "lb's token must not create Services: {} {stderr}",
        write.status
    );
    let pods = cp.kubectl_as(&kubeconfig, &["get", "pods", "--all-namespaces"], None);
    assert!(
        pods.is_ok_and(|o| !o.status.success()),
        "nor read Pods, which it does not need"
    );
    drop(lb);
    drop(cp);
}

/// Every object under `deploy/` passes the real apiserver's validation (server-side dry-run,
/// strict field validation); a broken object does not, so the check has teeth.
#[test]
fn deploy_manifests_pass_server_side_dry_run() {
    let cp = ControlPlane::start_with(Options {
        endpointslice_controller: false,
        ..Options::default()
    })
    .expect("control plane");
    let deploy = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy");
    let mut files = Vec::new();
    let mut dirs = vec![deploy];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("read deploy/") {
            let path = entry.expect("dir entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "yaml" || e == "yml") {
                files.push(path);
            }
        }
    }
    files.sort();
    assert!(files.len() >= 3, "deploy/ has its manifests: {files:?}");

    // The namespaces the manifests use must exist, as they would in a cluster.
    let mut namespaces = BTreeSet::new();
    for file in &files {
        let text = std::fs::read_to_string(file).expect("read manifest");
        for doc in serde_yaml::Deserializer::from_str(&text) {
            let v: Value = serde::Deserialize::deserialize(doc).expect("YAML");
            if let Some(ns) = v["metadata"]["namespace"].as_str() {
                namespaces.insert(ns.to_owned());
            }
        }
    }
    for ns in namespaces.iter().filter(|ns| *ns != "kube-system") {
        cp.kubectl_ok(&["create", "namespace", ns], None)
            .expect("create namespace");
    }

    for file in &files {
        // A kustomization is not an API object: apply the directory it builds (`-k`), which
        // also proves its resource list resolves.
        let (flag, target) = if file.file_name().is_some_and(|n| n == "kustomization.yaml") {
            ("-k", file.parent().expect("kustomization's directory"))
        } else {
            ("-f", file.as_path())
        };
        let out = cp
            .kubectl_ok(
                &[
                    "apply",
                    "--dry-run=server",
                    "--validate=strict",
                    flag,
                    &target.display().to_string(),
                ],
                None,
            )
            .unwrap_or_else(|e| panic!("{}: {e:#}", file.display()));
        assert!(
            out.lines().count() >= 1 && out.lines().all(|l| l.ends_with("(server dry run)")),
            "{}: every object accepted in a dry run:\n{out}",
            file.display()
        );
    }
    // Dry run: nothing was created.
    let ds = cp.kubectl(&["get", "daemonset", "lb", "--namespace=kube-system"], None);
    assert!(
        ds.is_ok_and(|o| !o.status.success()),
        "the DaemonSet was not created"
    );

    // A port out of range, an unknown field: each refused, so the check has teeth.
    let service = |spec: Value| {
        json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": { "name": "broken", "namespace": "default" },
            "spec": spec,
        })
        .to_string()
    };
    for (broken, why) in [
        (
            service(json!({ "ports": [{ "port": 70000 }] })),
            "spec.ports[0].port",
        ),
        (
            service(json!({ "ports": [{ "port": 80 }], "clusterIPx": "None" })),
            "clusterIPx",
        ),
    ] {
        let out = cp
            .kubectl(
                &["apply", "--dry-run=server", "-f", "-"],
                Some(broken.as_bytes()),
            )
            .expect("kubectl");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && stderr.contains(why),
            "refused for {why}: {stderr}"
        );
    }
}

/// A TCP relay from 127.0.0.1:<port> to the apiserver that can cut every connection and refuse
/// new ones, so a watch loses its server for as long as the test wants.
struct Relay {
    port: u16,
    cut: Arc<AtomicBool>,
    conns: Arc<Mutex<Vec<JoinHandle<()>>>>,
    task: JoinHandle<()>,
}

impl Relay {
    async fn start(upstream: String) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind relay");
        let port = listener.local_addr().expect("relay address").port();
        let cut = Arc::new(AtomicBool::new(false));
        let conns = Arc::new(Mutex::new(Vec::new()));
        let (cut2, conns2) = (cut.clone(), conns.clone());
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut down, _)) = listener.accept().await else {
                    continue;
                };
                if cut2.load(Ordering::SeqCst) {
                    // Accepted and closed at once: the client sees the connection reset.
                    continue;
                }
                let upstream = upstream.clone();
                let conn = tokio::spawn(async move {
                    if let Ok(mut up) = tokio::net::TcpStream::connect(&upstream).await {
                        let _ = tokio::io::copy_bidirectional(&mut down, &mut up).await;
                    }
                });
                conns2.lock().expect("relay lock").push(conn);
            }
        });
        Relay {
            port,
            cut,
            conns,
            task,
        }
    }

    /// Closes every relayed connection; new ones are closed on accept until [`Relay::restore`].
    fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
        for conn in self.conns.lock().expect("relay lock").drain(..) {
            conn.abort();
        }
    }

    fn restore(&self) {
        self.cut.store(false, Ordering::SeqCst);
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.cut();
        self.task.abort();
    }
}

/// lb's watch loses the apiserver; meanwhile a Service is deleted and etcd compacted past
/// everything lb has seen. Without the watch cache (watches are served by etcd) lb's resumed
/// watch gets 410 Gone, relists, and the deleted Service leaves the maps; the survivor stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_relists_after_compaction_without_missing_a_delete() {
    let cp = ControlPlane::start_with(Options {
        endpointslice_controller: false,
        watch_cache: false,
        ..Options::default()
    })
    .expect("control plane");
    let admin = client(&cp.admin_kubeconfig).await;
    prepare(&admin).await;
    let services = Api::<Service>::namespaced(admin.clone(), NS);
    let slices = Api::<EndpointSlice>::namespaced(admin.clone(), NS);
    let pp = PostParams::default();
    for (name, ip, backend) in [("keep", "198.19.0.20", B1), ("gone", "198.19.0.21", B2)] {
        services
            .create(&pp, &from_json(selector_service(name, ip)))
            .await
            .expect("create service");
        let slice = support::slice(
            NS,
            &format!("{name}-1"),
            name,
            8080,
            &[support::Ep::ready(backend)],
        );
        slices.create(&pp, &slice).await.expect("create slice");
    }
    // Slices written by hand (no controller here) use the port name the Services use.
    let keep_fe = "198.19.0.20:80/TCP";
    let gone_fe = "198.19.0.21:80/TCP";

    let relay = Relay::start(cp.server.trim_start_matches("https://").to_owned()).await;
    let token = cp.lb_token().expect("lb token");
    let relayed = cp
        .kubeconfig_at(
            "lb-relayed",
            &format!("https://127.0.0.1:{}", relay.port),
            &token,
        )
        .expect("kubeconfig");
    let mut h = Harness::start(&relayed).await;
    h.wait_until("both services", |m| {
        has(m, keep_fe, &[B1]) && has(m, gone_fe, &[B2])
    })
    .await;
    let seen = services
        .list(&ListParams::default())
        .await
        .expect("list")
        .metadata
        .resource_version
        .expect("list resourceVersion");

    relay.cut();
    services
        .delete("gone", &DeleteParams::default())
        .await
        .expect("delete service");
    slices
        .delete("gone-1", &DeleteParams::default())
        .await
        .expect("delete slice");
    let revision = cp.etcd_revision().expect("etcd revision");
    cp.etcd_compact(revision).expect("compact");

    // The server really answers 410 for what lb has seen (the watch lost its connection at or
    // after `seen`, and everything before `revision` is compacted).
    let mut stream = services
        .watch(&WatchParams::default(), &seen)
        .await
        .expect("watch")
        .boxed();
    let first = tokio::time::timeout(WAIT, stream.next())
        .await
        .expect("an event");
    let code = match first {
        Some(Ok(WatchEvent::Error(status))) => status.code,
        Some(Err(kube::Error::Api(status))) => status.code,
        other => panic!("expected 410 Gone from a compacted resourceVersion, got {other:?}"),
    };
    assert_eq!(
        code, 410,
        "a watch from a compacted resourceVersion is Gone"
    );
    drop(stream);

    relay.restore();
    let m = h
        .wait_until("the deleted service gone after the relist", |m| {
            lacks(m, gone_fe) && has(m, keep_fe, &[B1])
        })
        .await;
    assert!(
        !m.text.contains(B2),
        "no backend of the deleted service left:\n{}",
        m.text
    );
    drop(relay);
}

/// lb's watch loses the apiserver, which restarts (its watch cache starts afresh at etcd's
/// current revision) while a Service is deleted and another created: lb's resumed watch is
/// too old for the new cache, lb relists, and converges on exactly the new state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_converges_after_an_apiserver_restart() {
    let mut cp = ControlPlane::start_with(Options {
        endpointslice_controller: false,
        ..Options::default()
    })
    .expect("control plane");
    let admin = client(&cp.admin_kubeconfig).await;
    prepare(&admin).await;
    let services = Api::<Service>::namespaced(admin.clone(), NS);
    let slices = Api::<EndpointSlice>::namespaced(admin.clone(), NS);
    let pp = PostParams::default();
    for (name, ip, backend) in [("keep", "198.19.0.20", B1), ("gone", "198.19.0.21", B2)] {
        services
            .create(&pp, &from_json(selector_service(name, ip)))
            .await
            .expect("create service");
        let slice = support::slice(
            NS,
            &format!("{name}-1"),
            name,
            8080,
            &[support::Ep::ready(backend)],
        );
        slices.create(&pp, &slice).await.expect("create slice");
    }
    let (keep_fe, gone_fe, new_fe) = (
        "198.19.0.20:80/TCP",
        "198.19.0.21:80/TCP",
        "198.19.0.22:80/TCP",
    );

    let relay = Relay::start(cp.server.trim_start_matches("https://").to_owned()).await;
    let token = cp.lb_token().expect("lb token");
    let relayed = cp
        .kubeconfig_at(
            "lb-relayed",
            &format!("https://127.0.0.1:{}", relay.port),
            &token,
        )
        .expect("kubeconfig");
    let mut h = Harness::start(&relayed).await;
    h.wait_until("both services", |m| {
        has(m, keep_fe, &[B1]) && has(m, gone_fe, &[B2])
    })
    .await;

    relay.cut();
    cp.restart_apiserver().expect("apiserver restarted");
    // Through kubectl (new connections), not the admin client whose pooled connections the
    // restart closed.
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
    .expect("delete");
    let new_slice = serde_json::to_value(support::slice(
        NS,
        "new-1",
        "new",
        8080,
        &[support::Ep::ready(B3)],
    ))
    .expect("slice JSON");
    cp.apply(&[selector_service("new", "198.19.0.22"), new_slice])
        .expect("kubectl apply");

    relay.restore();
    let m = h
        .wait_until("exactly the new state", |m| {
            lacks(m, gone_fe) && has(m, keep_fe, &[B1]) && has(m, new_fe, &[B3])
        })
        .await;
    assert!(
        !m.text.contains(B2),
        "no backend of the deleted service left:\n{}",
        m.text
    );
    drop(relay);
}

/// A Service status condition written without `lastTransitionTime` (Kubernetes' e2e "should
/// complete a service status lifecycle" writes one): the API server stores it and returns
/// `"lastTransitionTime": null`, which k8s-openapi's `Condition` does not decode. lb's watch
/// must keep following that Service and every other one: a port added to it afterwards and a
/// Service created after it are both programmed, on the open watch and after a relist.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_status_condition_without_a_time_breaks_nothing() {
    let cp = ControlPlane::start_with(Options {
        endpointslice_controller: false,
        ..Options::default()
    })
    .expect("control plane");
    let admin = client(&cp.admin_kubeconfig).await;
    prepare(&admin).await;
    let services = Api::<Service>::namespaced(admin.clone(), NS);
    let pp = PostParams::default();
    services
        .create(&pp, &from_json(selector_service("status", "198.19.0.30")))
        .await
        .expect("create service");
    let mut h = Harness::start(&cp.lb_kubeconfig().expect("lb kubeconfig")).await;
    h.wait_until("the service", |m| has(m, "198.19.0.30:80/TCP", &[]))
        .await;

    // Through kubectl: this test's own typed client could not read the answer back either.
    let condition = json!({"status": {"conditions": [{
        "type": "StatusUpdate", "status": "True", "reason": "E2E", "message": "Set from e2e test",
    }]}});
    cp.kubectl_ok(
        &[
            "patch",
            "service",
            "status",
            "--namespace",
            NS,
            "--subresource=status",
            "--type=merge",
            "--patch",
            &condition.to_string(),
        ],
        None,
    )
    .expect("kubectl patch status");
    let stored = cp
        .kubectl_ok(
            &[
                "get",
                "service",
                "status",
                "--namespace",
                NS,
                "--output=json",
            ],
            None,
        )
        .expect("kubectl get");
    let stored: Value = serde_json::from_str(&stored).expect("json");
    assert_eq!(
        stored["status"]["conditions"][0]["lastTransitionTime"],
        Value::Null,
        "the API server stores the condition without a time: {stored}"
    );
    assert!(
        serde_json::from_value::<Service>(stored).is_err(),
        "k8s-openapi refuses such a Service (else this test proves nothing)"
    );

    cp.kubectl_ok(
        &[
            "patch",
            "service",
            "status",
            "--namespace",
            NS,
            "--type=json",
            "--patch",
            r#"[{"op":"add","path":"/spec/ports/-","value":{"name":"alt","protocol":"TCP","port":81,"targetPort":8081}}]"#,
        ],
        None,
    )
    .expect("kubectl patch spec");
    h.wait_until("the port added after the condition", |m| {
        has(m, "198.19.0.30:81/TCP", &[])
    })
    .await;
    services
        .create(&pp, &from_json(selector_service("later", "198.19.0.31")))
        .await
        .expect("create service");
    h.wait_until("a service created after it", |m| {
        has(m, "198.19.0.31:80/TCP", &[]) && has(m, "198.19.0.30:81/TCP", &[])
    })
    .await;

    // A fresh watch lists the Service with its condition.
    let mut fresh = Harness::start(&cp.lb_kubeconfig().expect("lb kubeconfig")).await;
    fresh
        .wait_until("both services from the initial list", |m| {
            has(m, "198.19.0.30:81/TCP", &[]) && has(m, "198.19.0.31:80/TCP", &[])
        })
        .await;
}
