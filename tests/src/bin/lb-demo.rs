//! `lb-demo`: shows lb balancing a dual-stack TCP/UDP service in a throw-away netns topology.
//!
//! Run as root after `cargo build --bins` (this is what `cargo xtask demo` does). It
//!
//! 1. creates a [`Testbed`] with 3 backends running `lb-echo serve` on port 8080,
//! 2. runs `lb run` in the node netns with socket LB on the testbed's cgroup (and tc ingress on
//!    every node interface), and sends requests to the service from the client netns inside
//!    that cgroup,
//! 3. restarts lb with `--socket-lb=false` on the same pin directory and sends the same requests
//!    from outside the cgroup, so that only the tc ingress program translates them,
//! 4. restarts lb once more for north-south traffic: a NodePort and a LoadBalancer IP reached
//!    from the client netns as an external client, through XDP on the node's client-facing
//!    device, showing the source address each backend saw (the node IP where the service
//!    masquerades, the client's own where `externalTrafficPolicy: Local` keeps it),
//! 5. tears everything down and prints a summary.
//!
//! With `--kubernetes` (`cargo xtask demo --kubernetes`) it runs one other mode instead, mode K:
//! a real control plane (etcd, kube-apiserver and the EndpointSlice controller, started in the
//! node netns), the example Service and three Pods created with kubectl, the Pods' status set as
//! a kubelet would so that the controller writes the EndpointSlices, and `lb run --kubeconfig`
//! with the ServiceAccount token `deploy/rbac.yaml` binds, balancing the same requests (tc only).
//!
//! The exit code is 0 if every request succeeded and every backend was reached for every target
//! in every mode, 1 if not, 2 if the demo itself could not run.
//!
//! `lb` and `lb-echo` are expected next to this binary.
use std::{
    collections::{BTreeMap, BTreeSet},
    fs::{self, File, OpenOptions},
    io::{self, Write as _},
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Command, ExitCode, Stdio},
    sync::{
        atomic::{AtomicBool, Ordering},
        mpsc,
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail, ensure};
use clap::Parser;
use lb::datapath::pinned;
use lb_common::{map_names, metrics};
use lb_tests::{
    bins,
    controlplane::{self, ControlPlane},
    daemon::{LbDaemon, LbOptions},
    netns::{in_netns, set_gro, set_tx_checksum},
    testbed::{HOST_IF, Testbed},
};
use nix::sys::signal::{self, SaFlags, SigAction, SigHandler, SigSet, Signal};
use serde_json::Value;

/// Backends in the testbed; deploy/examples lists exactly their addresses.
const BACKENDS: usize = 3;
/// Port the echo servers listen on (the service's target port).
const ECHO_PORT: u16 = 8080;
/// How often blocking waits look at the interrupt flag.
const POLL: Duration = Duration::from_millis(100);
/// Width of a bar for a backend that got every request.
const BAR_WIDTH: u32 = 30;
/// Where bpffs is mounted; the demo pins its maps in `lb-demo-<testbed id>` below it.
const BPFFS: &str = "/sys/fs/bpf";

/// The service in deploy/examples (namespace `demo`, name `echo`): its ClusterIPs and ports.
const TARGETS: [(&str, Proto); 4] = [
    ("198.19.0.10:80", Proto::Tcp),
    ("198.19.0.10:53", Proto::Udp),
    ("[2001:db8:ffff::10]:80", Proto::Tcp),
    ("[2001:db8:ffff::10]:53", Proto::Udp),
];

/// The north-south services mode C adds (`NS_MANIFEST`): NodePorts on the node IP (its
/// address on the client's link) and a LoadBalancer IP.
const NS_TARGETS: [(&str, Proto); 8] = [
    ("198.18.10.1:30080", Proto::Tcp),
    ("198.18.10.1:30053", Proto::Udp),
    ("[2001:db8:0:10::1]:30080", Proto::Tcp),
    ("[2001:db8:0:10::1]:30053", Proto::Udp),
    ("198.19.1.10:80", Proto::Tcp),
    ("198.19.1.10:53", Proto::Udp),
    ("[2001:db8:ffff:1::10]:80", Proto::Tcp),
    ("[2001:db8:ffff:1::10]:53", Proto::Udp),
];

/// The node name mode C runs lb with: the endpoints of `NS_MANIFEST` are on it.
const NS_NODE: &str = "demo-node";

/// demo/echo-nodeport (NodePort, externalTrafficPolicy Cluster: masqueraded to the node IP)
/// and demo/echo-lb (LoadBalancer 198.19.1.10, externalTrafficPolicy Local: the client's
/// address kept), both with b1..b3 as endpoints on `NS_NODE`.
const NS_MANIFEST: &str = r#"apiVersion: v1
kind: Service
metadata: {name: echo-nodeport, namespace: demo}
spec:
  type: NodePort
  externalTrafficPolicy: Cluster
  clusterIP: 198.19.0.11
  clusterIPs: [198.19.0.11, "2001:db8:ffff::11"]
  ipFamilyPolicy: PreferDualStack
  ipFamilies: [IPv4, IPv6]
  ports:
    - {name: tcp, protocol: TCP, port: 80, targetPort: 8080, nodePort: 30080}
    - {name: udp, protocol: UDP, port: 53, targetPort: 8080, nodePort: 30053}
---
apiVersion: v1
kind: Service
metadata: {name: echo-lb, namespace: demo}
spec:
  type: LoadBalancer
  externalTrafficPolicy: Local
  clusterIP: 198.19.0.12
  clusterIPs: [198.19.0.12, "2001:db8:ffff::12"]
  ipFamilyPolicy: PreferDualStack
  ipFamilies: [IPv4, IPv6]
  ports:
    - {name: tcp, protocol: TCP, port: 80, targetPort: 8080, nodePort: 30081}
    - {name: udp, protocol: UDP, port: 53, targetPort: 8080, nodePort: 30054}
status:
  loadBalancer:
    ingress: [{ip: 198.19.1.10}, {ip: "2001:db8:ffff:1::10"}]
"#;

/// The EndpointSlices of `service` in `NS_MANIFEST`: b1..b3 on `NS_NODE`.
fn ns_slices(service: &str) -> String {
    let mut out = String::new();
    for (family, addrs) in [
        ("IPv4", ["198.18.11.2", "198.18.12.2", "198.18.13.2"]),
        (
            "IPv6",
            ["2001:db8:0:11::2", "2001:db8:0:12::2", "2001:db8:0:13::2"],
        ),
    ] {
        out.push_str(&format!(
            "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: \
             {service}-{family}\n  namespace: demo\n  labels: {{kubernetes.io/service-name: \
             {service}}}\naddressType: {family}\nports: [{{name: tcp, protocol: TCP, port: \
             8080}}, {{name: udp, protocol: UDP, port: 8080}}]\nendpoints:\n"
        ));
        for a in addrs {
            out.push_str(&format!(
                "  - {{addresses: [\"{a}\"], nodeName: {NS_NODE}, conditions: {{ready: true}}}}\n"
            ));
        }
    }
    out
}

#[derive(Parser)]
#[command(
    name = "lb-demo",
    about = "Demonstrate lb (socket LB and tc-only) in a throw-away network-namespace testbed; \
             needs root"
)]
struct Cli {
    /// Requests per service address, protocol and mode (each from a fresh socket).
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u32).range(1..))]
    requests: u32,
    /// Also write lb's logs (both runs) to this file.
    #[arg(long, value_name = "PATH")]
    keep_logs: Option<PathBuf>,
    /// Service manifests to load [default: <workspace>/deploy/examples]. They must describe the
    /// demo/echo service (198.19.0.10 and 2001:db8:ffff::10, TCP 80 and UDP 53 to port 8080).
    #[arg(long, value_name = "DIR")]
    manifests: Option<PathBuf>,
    /// Timeout of each client connect/read, in milliseconds.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..))]
    timeout_ms: u64,
    /// Wait for Enter while lb runs in each mode, to look at the maps and programs meanwhile.
    #[arg(long)]
    pause: bool,
    /// Instead of modes A-C: mode K, lb following a real Kubernetes control plane (built by
    /// `cargo xtask demo --kubernetes`), the Service and Pods created with kubectl.
    #[arg(long)]
    kubernetes: bool,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Proto {
    Tcp,
    Udp,
}

impl Proto {
    fn as_str(self) -> &'static str {
        match self {
            Proto::Tcp => "tcp",
            Proto::Udp => "udp",
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    /// Socket LB on the testbed cgroup (plus tc ingress); the client runs in the cgroup.
    SocketLb,
    /// `--socket-lb=false`: only tc ingress; the client runs outside the cgroup.
    TcOnly,
    /// NodePorts and a LoadBalancer IP from the client as an external client: XDP (and tc
    /// ingress) on the node's client-facing device.
    NorthSouth,
    /// `--kubernetes`: the API server as the source, tc only.
    Kubernetes,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::SocketLb => "socket LB",
            Mode::TcOnly => "tc only",
            Mode::NorthSouth => "north-south",
            Mode::Kubernetes => "kubernetes",
        }
    }

    fn letter(self) -> char {
        match self {
            Mode::SocketLb => 'A',
            Mode::TcOnly => 'B',
            Mode::NorthSouth => 'C',
            Mode::Kubernetes => 'K',
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let start = Instant::now();
    let mut report = Report::default();
    let outcome = install_signal_handlers().and_then(|()| demo(&cli, &mut report));
    // Everything (lb, the pin directory, the testbed) is gone by now, also after an error.
    let results = &report.results;
    if !results.is_empty() {
        print_summary(results);
    }
    let elapsed = start.elapsed().as_secs_f64();
    match outcome {
        Ok(()) => {
            for w in warnings(results).iter().chain(&report.warnings) {
                println!("\nWARNING: {w}");
            }
            let expected = if cli.kubernetes {
                TARGETS.len()
            } else {
                2 * TARGETS.len() + NS_TARGETS.len()
            };
            let problems = problems(results, cli.requests, expected);
            if problems.is_empty() {
                println!(
                    "\nPASS: all {} requests succeeded and every backend was reached for every \
                     target in every mode ({elapsed:.1} s).",
                    results.len() as u64 * u64::from(cli.requests)
                );
                ExitCode::SUCCESS
            } else {
                println!("\nFAIL ({elapsed:.1} s):");
                for p in &problems {
                    println!("  - {p}");
                }
                ExitCode::FAILURE
            }
        }
        Err(err) => {
            eprintln!("\nlb-demo: error after {elapsed:.1} s: {err:#}");
            ExitCode::from(2)
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The demo

/// What the demo found; filled in as it goes, so that it is there after an error too.
#[derive(Default)]
struct Report {
    /// One per target and mode.
    results: Vec<TargetResult>,
    /// Oddities that do not fail the demo.
    warnings: Vec<String>,
}

/// Runs both modes and fills in `report`. Everything it creates is removed before it returns,
/// also on error.
fn demo(cli: &Cli, report: &mut Report) -> anyhow::Result<()> {
    ensure!(
        nix::unistd::geteuid().is_root(),
        "lb-demo needs root (network namespaces, cgroups, BPF); run `cargo xtask demo` or use sudo"
    );
    let lb_bin = bins::LB.path()?;
    let echo_bin = bins::LB_ECHO.path()?;
    let manifests = match &cli.manifests {
        Some(dir) => dir.clone(),
        None => Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .context("workspace root")?
            .join("deploy/examples"),
    };
    let manifests = manifests
        .canonicalize()
        .with_context(|| format!("manifest directory {}", manifests.display()))?;
    let mut log = match &cli.keep_logs {
        Some(path) => Some(
            OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .with_context(|| format!("opening log file {}", path.display()))?,
        ),
        None => None,
    };

    if cli.kubernetes {
        print_intro_kubernetes(cli);
    } else {
        print_intro(cli, &manifests);
    }

    step("Creating the testbed");
    let t = Instant::now();
    let mut tb = Testbed::create(BACKENDS).context("creating the testbed")?;
    tb.start_echo_servers(&echo_bin, ECHO_PORT)
        .context("starting the echo servers")?;
    print_testbed(&tb, t.elapsed());
    check_interrupted()?;
    if cli.kubernetes {
        return kubernetes::demo(cli, report, tb, &manifests, log);
    }

    // Declared after the testbed, so it is removed (after lb stopped) before the testbed goes.
    let pin_dir = DirGuard(Path::new(BPFFS).join(format!("lb-demo-{}", tb.id)));
    let state_dir = DirGuard(std::env::temp_dir().join(format!("lb-demo-state-{}", tb.id)));
    let ifaces = tb.node_ifaces().join(",");
    let backend_ifaces: Vec<String> = tb.backends.iter().map(|b| b.node_if.clone()).collect();
    let backend_ifaces = backend_ifaces.join(",");
    let external = tb.client.node_if.clone();
    let node_ips = format!("{},{}", tb.client.node_ipv4(), tb.client.node_ipv6());
    // Mode C's manifests: the examples plus the north-south services.
    let ns_dir = DirGuard(std::env::temp_dir().join(format!("lb-demo-ns-{}", tb.id)));
    fs::create_dir_all(&ns_dir.0).context("creating the north-south manifest directory")?;
    for entry in fs::read_dir(&manifests).context("reading the manifests")? {
        let path = entry?.path();
        if let Some(name) = path.file_name() {
            fs::copy(&path, ns_dir.0.join(name)).context("copying a manifest")?;
        }
    }
    let ns_text = format!(
        "{NS_MANIFEST}{}{}",
        ns_slices("echo-nodeport"),
        ns_slices("echo-lb")
    );
    fs::write(ns_dir.0.join("echo-external.yaml"), ns_text).context("writing echo-external")?;

    for mode in [Mode::SocketLb, Mode::TcOnly, Mode::NorthSouth] {
        let (manifests, cgroup) = (
            match mode {
                Mode::NorthSouth => ns_dir.0.display().to_string(),
                _ => manifests.display().to_string(),
            },
            tb.cgroup.display().to_string(),
        );
        let mut args = vec!["--manifests", &manifests];
        match mode {
            Mode::SocketLb => args.extend(["--cgroup-path", &cgroup, "--tc-pod", &ifaces]),
            // Mode K runs in `kubernetes::demo`, with its own arguments.
            Mode::TcOnly | Mode::Kubernetes => {
                args.extend(["--socket-lb=false", "--tc-pod", &ifaces]);
            }
            Mode::NorthSouth => {
                args.extend([
                    "--socket-lb=false",
                    "--hostname-override",
                    NS_NODE,
                    "--node-ip",
                    &node_ips,
                    "--devices",
                    &external,
                    "--xdp",
                    "native",
                    "--tc-pod",
                    &backend_ifaces,
                ]);
                // An external client's packets arrive with complete checksums (a veth would
                // hand its peer CHECKSUM_PARTIAL ones), and XDP frames sent into a veth need
                // NAPI (GRO) on its peer.
                in_netns(&tb.client.ns, || set_tx_checksum(HOST_IF, false))?;
                for h in std::iter::once(&tb.client).chain(&tb.backends) {
                    in_netns(&h.ns, || set_gro(HOST_IF, true))?;
                }
            }
        }
        let opts = LbOptions {
            pin_dir: pin_dir.0.clone(),
            state_dir: state_dir.0.clone(),
            rust_log: "info".into(),
            log_file: log
                .as_ref()
                .map(File::try_clone)
                .transpose()
                .context("cloning the log file handle")?,
            on_line: Some(print_lb_line),
            env: Vec::new(),
            interrupted: Some(&INTERRUPTED),
        };
        let shown = LbDaemon::command_args(&args, &opts).join(" ");

        println!();
        match mode {
            Mode::SocketLb | Mode::Kubernetes => section(
                mode,
                &[
                    "lb attaches its connect/sendmsg/recvmsg/getpeername programs to the testbed",
                    "cgroup: a client in that cgroup has the service address replaced by a backend",
                    "once per socket, before any packet exists, and sees the service address again",
                    "in getpeername()/recvmsg(). (tc ingress is attached too, but has nothing to do.)",
                ],
            ),
            Mode::TcOnly => section(
                mode,
                &[
                    "lb restarts with --socket-lb=false on the same pin directory: the maps survive",
                    "the restart (see 'pinned state reused' below). The client now runs outside the",
                    "cgroup, so its packets carry the service address; lb's tc ingress program on",
                    "the node NATs each packet to a backend and reverses the replies (conntrack).",
                ],
            ),
            Mode::NorthSouth => section(
                mode,
                &[
                    "lb restarts for traffic from outside the node: the client is now an external",
                    "client of the NodePorts of demo/echo-nodeport on the node IP (198.18.10.1,",
                    "2001:db8:0:10::1; externalTrafficPolicy Cluster, so masqueraded to the node",
                    "IP) and of the LoadBalancer IP of demo/echo-lb (198.19.1.10, 2001:db8:ffff:1::10;",
                    "Local: the client's address is kept). lb_xdp runs on the client-facing device,",
                    "tc ingress beside it; watch the address each backend saw.",
                ],
            ),
        }
        if let Some(f) = log.as_mut() {
            writeln!(
                f,
                "=== lb-demo testbed {} mode {} ({}): {} {} ===",
                tb.id,
                mode.letter(),
                mode.name(),
                lb_bin.display(),
                shown
            )
            .context("writing the log file")?;
        }
        println!("  $ {} {shown}", lb_bin.display());
        println!("    (in netns {}; its log follows, indented)", tb.node_ns);
        // The counters live in a pinned map, so they carry over from mode A to mode B.
        let before = read_counters(&pin_dir.0);
        let mut lb = LbDaemon::spawn_with(&mut tb, &lb_bin, &args, opts)?;
        // Both modes share the pin dir; the guards above remove it (and the state dir) at the end.
        lb.keep_dirs();
        lb.wait_ready()?;
        print_inspect_hints(&tb, &pin_dir.0, mode, cli.pause);

        let cgroup = match mode {
            Mode::SocketLb => Some(tb.cgroup.as_path()),
            Mode::TcOnly | Mode::NorthSouth | Mode::Kubernetes => None,
        };
        println!();
        println!(
            "  Sending {} requests per target from netns {}{}:",
            cli.requests,
            tb.client.ns,
            match cgroup {
                Some(cg) => format!(" in cgroup {}", cg.display()),
                None => " (outside the testbed cgroup)".to_owned(),
            }
        );
        let targets: &[(&str, Proto)] = match mode {
            Mode::NorthSouth => &NS_TARGETS,
            _ => &TARGETS,
        };
        for &(target, proto) in targets {
            check_interrupted()?;
            let target: SocketAddr = target.parse().context("target address")?;
            let result = run_client(&tb, &echo_bin, cgroup, mode, target, proto, cli)?;
            lb.drain();
            print_table(&result, &tb, cli.requests);
            report.results.push(result);
        }
        check_interrupted()?;
        match (before, read_counters(&pin_dir.0)) {
            (Ok(before), Ok(after)) => {
                if let Some(w) = print_counters(mode, &before, &after) {
                    report.warnings.push(w);
                }
            }
            (Err(err), _) | (_, Err(err)) => {
                println!("\n  (could not read lb's counters: {err:#})");
            }
        }
        if cli.pause {
            pause()?;
            lb.drain();
        }

        println!();
        println!("  Stopping lb (SIGTERM)");
        let status = lb.stop()?;
        ensure!(
            status.success(),
            "lb exited with {status} in mode {}",
            mode.name()
        );
    }

    println!();
    step("Tearing down");
    let pin_path = pin_dir.0.clone();
    pin_dir.remove()?;
    println!("  removed {}", pin_path.display());
    let (node_ns, cgroup) = (tb.node_ns.clone(), tb.cgroup.clone());
    drop(tb);
    let leftover: Vec<String> = [Path::new("/run/netns").join(&node_ns), cgroup]
        .into_iter()
        .filter(|p| p.exists())
        .map(|p| p.display().to_string())
        .collect();
    ensure!(
        leftover.is_empty(),
        "teardown left {}",
        leftover.join(" and ")
    );
    println!("  stopped the echo servers, deleted the netns and the cgroup");
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Mode K: a real control plane

mod kubernetes {
    use super::*;

    /// The node the Pods are bound to, and lb's `--hostname-override`.
    const NODE: &str = "demo-node";
    /// Generous: the controller batches, and the machine may be busy.
    const WAIT: Duration = Duration::from_secs(90);

    /// Pods `echo-1..3` of app `echo` on [`NODE`], with the ports the example Service's
    /// targetPorts name (no scheduler, no kubelet: `nodeName` is set, the image never pulled).
    fn pods_yaml() -> String {
        let mut y = String::new();
        for i in 1..=BACKENDS {
            y.push_str(&format!(
                "---\napiVersion: v1\nkind: Pod\nmetadata: {{name: echo-{i}, namespace: demo, \
                 labels: {{app: echo}}}}\nspec:\n  nodeName: {NODE}\n  containers:\n    - name: \
                 echo\n      image: lb.invalid/echo:demo\n      ports:\n        - {{name: \
                 echo-tcp, containerPort: {ECHO_PORT}, protocol: TCP}}\n        - {{name: \
                 echo-udp, containerPort: {ECHO_PORT}, protocol: UDP}}\n"
            ));
        }
        y
    }

    const BASE_YAML: &str = "apiVersion: v1
kind: Namespace
metadata: {name: demo}
---
apiVersion: v1
kind: ServiceAccount
metadata: {name: default, namespace: demo}
---
apiVersion: v1
kind: Node
metadata: {name: demo-node, labels: {topology.kubernetes.io/zone: zone-a}}
";

    /// Runs kubectl (admin, in the node netns), showing the command; returns stdout.
    fn kubectl(cp: &ControlPlane, args: &[&str], stdin: Option<&str>) -> anyhow::Result<String> {
        // Quoted where a shell would need it, so the line can be pasted.
        let shown: Vec<String> = args
            .iter()
            .map(|a| {
                if a.contains(['{', '"', ' ']) {
                    format!("'{a}'")
                } else {
                    (*a).to_owned()
                }
            })
            .collect();
        let shown = shown.join(" ");
        match stdin {
            Some(text) => {
                println!("  $ kubectl {shown} <<EOF");
                for l in text.lines() {
                    println!("    {l}");
                }
                println!("  EOF");
            }
            None => println!("  $ kubectl {shown}"),
        }
        let out = cp.kubectl_ok(args, stdin.map(str::as_bytes))?;
        for l in out.lines() {
            println!("    {l}");
        }
        Ok(out)
    }

    /// The JSON merge patch a kubelet's status update amounts to: running at `v4`/`v6`, Ready.
    fn pod_status(v4: &str, v6: &str) -> String {
        let now = k8s_openapi::jiff::Timestamp::now().to_string();
        serde_json::json!({ "status": {
            "phase": "Running",
            "podIP": v4,
            "podIPs": [{ "ip": v4 }, { "ip": v6 }],
            "conditions": [
                { "type": "Ready", "status": "True", "lastTransitionTime": now },
                { "type": "ContainersReady", "status": "True", "lastTransitionTime": now },
            ],
        }})
        .to_string()
    }

    /// Ready endpoints per address type in the slices of demo/echo.
    fn ready_endpoints(cp: &ControlPlane) -> anyhow::Result<BTreeMap<String, usize>> {
        let out = cp.kubectl_ok(
            &[
                "get",
                "endpointslices",
                "--namespace=demo",
                "--selector=kubernetes.io/service-name=echo",
                "--output=json",
            ],
            None,
        )?;
        let list: Value = serde_json::from_str(&out).context("slice list JSON")?;
        let mut ready = BTreeMap::new();
        for slice in list["items"].as_array().into_iter().flatten() {
            let n = slice["endpoints"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|ep| ep["conditions"]["ready"] == serde_json::json!(true))
                .count();
            let family = slice["addressType"].as_str().unwrap_or("?").to_owned();
            *ready.entry(family).or_default() += n;
        }
        Ok(ready)
    }

    pub(super) fn demo(
        cli: &Cli,
        report: &mut Report,
        mut tb: Testbed,
        manifests: &Path,
        log: Option<File>,
    ) -> anyhow::Result<()> {
        let lb_bin = bins::LB.path()?;
        let echo_bin = bins::LB_ECHO.path()?;
        println!();
        step("Starting the control plane in the node netns");
        let cp = ControlPlane::start_with(controlplane::Options {
            netns: Some(tb.node_ns.clone()),
            ..controlplane::Options::default()
        })
        .context("starting the control plane (`cargo xtask demo --kubernetes` builds it)")?;
        println!(
            "  etcd and kube-apiserver at {} ready in {:.1} s; kube-controller-manager runs the \
             EndpointSlice controller (logs in {})",
            cp.server,
            cp.ready_after.as_secs_f64(),
            cp.dir.display()
        );
        check_interrupted()?;

        println!();
        step("Creating the objects with kubectl");
        kubectl(&cp, &["apply", "-f", "-"], Some(BASE_YAML))?;
        let service = manifests.join("echo-service.yaml");
        kubectl(&cp, &["apply", "-f", &service.display().to_string()], None)?;
        kubectl(&cp, &["apply", "-f", "-"], Some(&pods_yaml()))?;
        println!("  No kubelet runs: the demo writes each Pod's status as one would.");
        for (i, b) in tb.backends.iter().enumerate() {
            let patch = pod_status(&b.ipv4.to_string(), &b.ipv6.to_string());
            let name = format!("echo-{}", i + 1);
            kubectl(
                &cp,
                &[
                    "patch",
                    "pod",
                    &name,
                    "--namespace=demo",
                    "--subresource=status",
                    "--type=merge",
                    "--patch",
                    &patch,
                ],
                None,
            )?;
        }
        let deadline = Instant::now() + WAIT;
        let want = BTreeMap::from([("IPv4".to_owned(), BACKENDS), ("IPv6".to_owned(), BACKENDS)]);
        loop {
            check_interrupted()?;
            let ready = ready_endpoints(&cp)?;
            if ready == want {
                break;
            }
            ensure!(
                Instant::now() < deadline,
                "the EndpointSlice controller did not publish {BACKENDS} ready endpoints per \
                 family within {WAIT:?} (saw {ready:?}){}",
                cp.logs()
            );
            thread::sleep(Duration::from_millis(250));
        }
        println!("  The EndpointSlice controller wrote the slices:");
        kubectl(
            &cp,
            &["get", "endpointslices", "--namespace=demo", "--output=wide"],
            None,
        )?;
        check_interrupted()?;

        let kubeconfig = cp
            .lb_kubeconfig()
            .context("lb's kubeconfig (deploy/rbac.yaml and a token)")?;
        let kubeconfig = kubeconfig.display().to_string();
        let pin_dir = DirGuard(Path::new(BPFFS).join(format!("lb-demo-{}", tb.id)));
        let state_dir = DirGuard(std::env::temp_dir().join(format!("lb-demo-state-{}", tb.id)));
        let ifaces = tb.node_ifaces().join(",");
        let args = [
            "--kubeconfig",
            &kubeconfig,
            "--hostname-override",
            NODE,
            "--socket-lb=false",
            "--tc-pod",
            &ifaces,
            "--metrics-bind-address",
            "off",
        ];
        let mode = Mode::Kubernetes;
        let mut log = log;
        let opts = LbOptions {
            pin_dir: pin_dir.0.clone(),
            state_dir: state_dir.0.clone(),
            rust_log: "info".into(),
            log_file: log
                .as_ref()
                .map(File::try_clone)
                .transpose()
                .context("cloning the log file handle")?,
            on_line: Some(print_lb_line),
            env: Vec::new(),
            interrupted: Some(&INTERRUPTED),
        };
        let shown = LbDaemon::command_args(&args, &opts).join(" ");
        println!();
        section(
            mode,
            &[
                "lb watches Services, EndpointSlices and its Node through the API server with the",
                "token of ServiceAccount kube-system/lb (deploy/rbac.yaml, read-only), and programs",
                "what the controller published; the node's tc ingress NATs every packet.",
            ],
        );
        if let Some(f) = log.as_mut() {
            writeln!(
                f,
                "=== lb-demo testbed {} mode K: {} {shown} ===",
                tb.id,
                lb_bin.display()
            )
            .context("writing the log file")?;
        }
        println!("  $ {} {shown}", lb_bin.display());
        println!("    (in netns {}; its log follows, indented)", tb.node_ns);
        let before = read_counters(&pin_dir.0);
        let mut lb = LbDaemon::spawn_with(&mut tb, &lb_bin, &args, opts)?;
        lb.keep_dirs();
        lb.wait_ready()?;
        print_inspect_hints(&tb, &pin_dir.0, mode, cli.pause);
        println!();
        println!(
            "  Sending {} requests per target from netns {}:",
            cli.requests, tb.client.ns
        );
        for &(target, proto) in &TARGETS {
            check_interrupted()?;
            let target: SocketAddr = target.parse().context("target address")?;
            let result = run_client(&tb, &echo_bin, None, mode, target, proto, cli)?;
            lb.drain();
            print_table(&result, &tb, cli.requests);
            report.results.push(result);
        }
        check_interrupted()?;
        match (before, read_counters(&pin_dir.0)) {
            (Ok(before), Ok(after)) => {
                if let Some(w) = print_counters(mode, &before, &after) {
                    report.warnings.push(w);
                }
            }
            (Err(err), _) | (_, Err(err)) => {
                println!("\n  (could not read lb's counters: {err:#})");
            }
        }
        if cli.pause {
            pause()?;
            lb.drain();
        }
        println!();
        println!("  Stopping lb (SIGTERM) and the control plane");
        let status = lb.stop()?;
        ensure!(status.success(), "lb exited with {status} in mode K");
        drop(lb);
        drop(cp);

        println!();
        step("Tearing down");
        let pin_path = pin_dir.0.clone();
        pin_dir.remove()?;
        drop(state_dir);
        println!("  removed {}", pin_path.display());
        let (node_ns, cgroup) = (tb.node_ns.clone(), tb.cgroup.clone());
        drop(tb);
        let leftover: Vec<String> = [Path::new("/run/netns").join(&node_ns), cgroup]
            .into_iter()
            .filter(|p| p.exists())
            .map(|p| p.display().to_string())
            .collect();
        ensure!(
            leftover.is_empty(),
            "teardown left {}",
            leftover.join(" and ")
        );
        println!("  stopped the echo servers, deleted the netns and the cgroup");
        Ok(())
    }
}

fn print_intro_kubernetes(cli: &Cli) {
    println!(
        "lb demo against a real Kubernetes control plane
===============================================

The demo builds the same throw-away topology of network namespaces:

    client netns --veth-- node netns --veth-- b1, b2, b3 netns
    198.18.10.2           (runs lb, and       198.18.11.2 .. 198.18.13.2
    2001:db8:0:10::2       the control plane) 2001:db8:0:11::2 .. 2001:db8:0:13::2

starts etcd, kube-apiserver and kube-controller-manager (the EndpointSlice controller) on the
node netns's loopback, creates the Service demo/echo of deploy/examples and three Pods with
kubectl, marks the Pods running and Ready at the backends' addresses (as a kubelet would), and
lets the controller write the EndpointSlices. lb follows the API server with a read-only token
and balances {n} requests per service address and protocol, each from a fresh socket:

    Mode K  kubernetes: tc ingress on the node NATs every packet to a Pod the API lists.
",
        n = cli.requests
    );
}

// ---------------------------------------------------------------------------------------------
// Console output

fn step(title: &str) {
    println!("==> {title}");
}

fn section(mode: Mode, lines: &[&str]) {
    let title = format!("Mode {}: {}", mode.letter(), mode.name());
    println!("{title}");
    println!("{}", "=".repeat(title.len()));
    for l in lines {
        println!("  {l}");
    }
    println!();
}

fn print_intro(cli: &Cli, manifests: &Path) {
    let n = cli.requests;
    println!(
        "lb demo: an eBPF service load balancer replacing kube-proxy
===========================================================

The demo builds a throw-away topology of network namespaces:

    client netns --veth-- node netns --veth-- b1, b2, b3 netns
    198.18.10.2           (runs lb)           198.18.11.2 .. 198.18.13.2
    2001:db8:0:10::2                          2001:db8:0:11::2 .. 2001:db8:0:13::2
                                              (lb-echo serve: answers with its name)

and has lb load the service demo/echo from {manifests}:

    ClusterIPs 198.19.0.10 and 2001:db8:ffff::10
    TCP port 80 and UDP port 53 -> port {ECHO_PORT} on b1, b2 and b3

Nothing routes the service addresses: a request that lb does not translate dies in the node.
lb runs three times; each time the client sends {n} requests to each service address and
protocol, each request from a fresh socket (a new flow):

    Mode A  socket LB: cgroup hooks translate the service address when the socket connects or
            sends (the client runs in the testbed's cgroup).
    Mode B  tc only (--socket-lb=false): the node's tc ingress NATs every packet (the client
            runs outside the cgroup).
    Mode C  north-south: the client, as an external client, reaches NodePorts on the node IP
            and a LoadBalancer IP; XDP on the node's client-facing device balances them.
",
        manifests = manifests.display(),
    );
}

fn print_testbed(tb: &Testbed, took: Duration) {
    println!(
        "  testbed {} ready in {:.2} s: node netns {}, client netns {}, cgroup {}",
        tb.id,
        took.as_secs_f64(),
        tb.node_ns,
        tb.client.ns,
        tb.cgroup.display()
    );
    for b in &tb.backends {
        println!(
            "  backend {}: netns {}, {} and {}, lb-echo serve on port {ECHO_PORT}",
            b.name, b.ns, b.ipv4, b.ipv6
        );
    }
}

fn print_inspect_hints(tb: &Testbed, pin_dir: &Path, mode: Mode, pausing: bool) {
    println!();
    println!(
        "  lb is ready. Its maps are pinned in {}; while it runs, look with e.g.",
        pin_dir.display()
    );
    let mut hints = vec![(
        format!(
            "bpftool map dump pinned {}",
            pin_dir.join(map_names::SERVICES4).display()
        ),
        "",
    )];
    if mode == Mode::SocketLb {
        hints.push((
            format!("bpftool cgroup show {}", tb.cgroup.display()),
            "# socket LB",
        ));
    }
    hints.push((
        "bpftool link show".to_owned(),
        "# tc programs: tcx links (type 11 in bpftool < 7.3)",
    ));
    hints.push((
        format!("ip netns exec {} bpftool net show", tb.node_ns),
        "# bpftool >= 7.3 lists tcx here",
    ));
    let width = hints.iter().map(|(c, _)| c.len()).max().unwrap_or_default();
    for (cmd, note) in hints {
        let line = format!("      {cmd:<width$}  {note}");
        println!("{}", line.trim_end());
    }
    if !pausing {
        println!("  (pass --pause to keep lb running after the requests until Enter is pressed)");
    }
}

/// Waits for Enter on stdin (or EOF), giving up if the demo is interrupted.
fn pause() -> anyhow::Result<()> {
    println!();
    println!("  Paused with lb still running (the hints above apply); press Enter to go on.");
    let (tx, rx) = mpsc::channel();
    // The thread stays blocked in read if we are interrupted; the process exits soon after.
    thread::Builder::new()
        .name("stdin".into())
        .spawn(move || {
            let mut line = String::new();
            let _ = io::stdin().read_line(&mut line);
            let _ = tx.send(());
        })
        .context("spawn stdin reader")?;
    loop {
        check_interrupted()?;
        match rx.recv_timeout(POLL) {
            Ok(()) | Err(mpsc::RecvTimeoutError::Disconnected) => return Ok(()),
            Err(mpsc::RecvTimeoutError::Timeout) => {}
        }
    }
}

/// `n` of `total` as a bar of at most [`BAR_WIDTH`] characters; at least one for `n > 0`.
fn bar(n: u32, total: u32) -> String {
    let width = if total == 0 {
        0
    } else {
        (u64::from(n) * u64::from(BAR_WIDTH)).div_ceil(u64::from(total))
    };
    "#".repeat(usize::try_from(width.min(u64::from(BAR_WIDTH))).unwrap_or_default())
}

fn print_table(r: &TargetResult, tb: &Testbed, requests: u32) {
    let errors = r.errors();
    println!();
    println!(
        "  {} {:<24} requests {:>3}   ok {:>3}   errors {:>3}   peer = service address: {}",
        r.proto.as_str().to_uppercase(),
        r.target.to_string(),
        requests,
        r.ok,
        errors,
        peer_verdict(r)
    );
    let mut names: Vec<&str> = tb.backends.iter().map(|b| b.name.as_str()).collect();
    for name in r.per_backend.keys() {
        if !names.contains(&name.as_str()) {
            names.push(name);
        }
    }
    for name in names {
        let n = r.per_backend.get(name).copied().unwrap_or_default();
        let address = backend_address(tb, name, r.target);
        let seen = r
            .seen
            .get(name)
            .map(|s| format!("  saw {}", s.iter().cloned().collect::<Vec<_>>().join(", ")))
            .unwrap_or_default();
        println!(
            "      {name:<4} {address:<24} {n:>4}  {}{seen}",
            if n == 0 {
                "(not reached)".to_owned()
            } else {
                bar(n, requests)
            }
        );
    }
    if let Some(peer) = r.other_peers.first() {
        println!(
            "      the application saw peer {peer} instead of the service address in {} replies",
            r.ok - r.peer_is_vip
        );
    }
    for (err, n) in &r.error_kinds {
        println!("      error x{n}: {err}");
    }
    if r.missing > 0 {
        println!("      {} requests produced no result line", r.missing);
    }
    if !r.stderr.is_empty() {
        for l in r.stderr.lines().take(5) {
            println!("      client stderr: {l}");
        }
    }
}

/// Whether every reply showed the service address as its peer: `yes (30/30)`, `NO (28/30)`, or
/// `-` without replies.
fn peer_verdict(r: &TargetResult) -> String {
    if r.ok == 0 {
        "- (no replies)".to_owned()
    } else if r.peer_is_vip == r.ok {
        format!("yes ({}/{})", r.peer_is_vip, r.ok)
    } else {
        format!("NO ({}/{})", r.peer_is_vip, r.ok)
    }
}

/// The backend's address in the target's family and the target port, e.g. `198.18.11.2:8080`.
fn backend_address(tb: &Testbed, name: &str, target: SocketAddr) -> String {
    let Some(b) = tb.backends.iter().find(|b| b.name == name) else {
        return "(unknown backend)".to_owned();
    };
    let ip = match target {
        SocketAddr::V4(_) => std::net::IpAddr::V4(b.ipv4),
        SocketAddr::V6(_) => std::net::IpAddr::V6(b.ipv6),
    };
    SocketAddr::new(ip, ECHO_PORT).to_string()
}

fn print_summary(results: &[TargetResult]) {
    println!();
    println!("Summary");
    println!("=======");
    println!(
        "  {:<11} {:<5} {:<26} {:<9} {:<15} peer = service address",
        "mode", "proto", "service address", "ok", "backends hit"
    );
    for r in results {
        let hit = r.per_backend.values().filter(|n| **n > 0).count();
        let split: Vec<String> = r.per_backend.values().map(u32::to_string).collect();
        println!(
            "  {:<11} {:<5} {:<26} {:<9} {:<15} {}",
            r.mode.name(),
            r.proto.as_str(),
            r.target.to_string(),
            format!("{}/{}", r.ok, r.requests),
            format!("{hit}/{BACKENDS} ({})", split.join("/")),
            peer_verdict(r)
        );
    }
}

/// Why the demo failed: requests that failed and backends never reached.
fn problems(results: &[TargetResult], requests: u32, expected: usize) -> Vec<String> {
    let mut out = Vec::new();
    if results.len() < expected {
        out.push(format!(
            "only {} of {expected} target runs completed",
            results.len()
        ));
    }
    for r in results {
        let what = format!("mode {} {} {}", r.mode.name(), r.proto.as_str(), r.target);
        if r.errors() > 0 {
            out.push(format!(
                "{what}: {} of {requests} requests failed",
                r.errors()
            ));
        }
        let unreached: Vec<String> = (1..=BACKENDS)
            .map(|i| format!("b{i}"))
            .filter(|b| r.per_backend.get(b).copied().unwrap_or_default() == 0)
            .collect();
        if !unreached.is_empty() {
            out.push(format!(
                "{what}: backend(s) {} never reached in {requests} requests{}",
                unreached.join(", "),
                if requests < 20 {
                    " (with few requests a backend can miss by chance; try --requests 30)"
                } else {
                    ""
                }
            ));
        }
    }
    out
}

/// Replies in which the application saw another peer than the service address (reported, but
/// not a failure).
fn warnings(results: &[TargetResult]) -> Vec<String> {
    results
        .iter()
        .filter(|r| r.ok > r.peer_is_vip)
        .map(|r| {
            format!(
                "mode {} {} {}: in {} of {} replies the application saw {} instead of the \
                 service address",
                r.mode.name(),
                r.proto.as_str(),
                r.target,
                r.ok - r.peer_is_vip,
                r.ok,
                r.other_peers.join(", ")
            )
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Datapath counters

/// Packets per verdict of lb's datapath (`lb_metrics`, summed over the CPUs), indexed like
/// [`metrics::NAMES`].
type Counters = [u64; metrics::NAMES.len()];

/// Reads the pinned `lb_metrics` map; all zero if it does not exist yet.
fn read_counters(pin_dir: &Path) -> anyhow::Result<Counters> {
    let mut out = [0; metrics::NAMES.len()];
    for (slot, counter) in out.iter_mut().zip(pinned::read_counters(pin_dir)?) {
        *slot = counter.packets;
    }
    Ok(out)
}

/// Prints what the datapath counted between `before` and `after`, and whether that matches the
/// mode; returns a warning if it does not.
fn print_counters(mode: Mode, before: &Counters, after: &Counters) -> Option<String> {
    let delta = |i: u32| {
        let i = usize::try_from(i).unwrap_or(usize::MAX);
        match (after.get(i), before.get(i)) {
            (Some(a), Some(b)) => a.saturating_sub(*b),
            _ => 0,
        }
    };
    let counted: Vec<String> = (0u32..)
        .zip(metrics::NAMES)
        .filter(|(i, _)| delta(*i) > 0)
        .map(|(i, name)| format!("{name} {}", delta(i)))
        .collect();
    println!();
    println!("  What lb's datapath counted meanwhile (pinned map lb_metrics, packets or calls):");
    println!(
        "      {}",
        if counted.is_empty() {
            "nothing".to_owned()
        } else {
            counted.join(", ")
        }
    );
    let (sock, tc) = (delta(metrics::SOCK_FWD), delta(metrics::TC_FWD_NEW));
    match mode {
        Mode::SocketLb if sock > 0 && tc == 0 => {
            println!(
                "      -> the socket hooks translated every request; tc ingress only saw \
                 backend addresses"
            );
            None
        }
        Mode::TcOnly | Mode::Kubernetes if tc > 0 && sock == 0 => {
            println!("      -> tc ingress translated every new flow; no socket hook ran");
            None
        }
        Mode::NorthSouth if sock == 0 && delta(metrics::XDP_REDIRECT) > 0 => {
            println!(
                "      -> lb_xdp sent the masqueraded NodePort packets itself (xdp_redirect); \
                 it handed tc ingress the first packet of a flow whose next hop it could not \
                 resolve yet, and passed the LoadBalancer IP's unmasqueraded packets to the stack"
            );
            None
        }
        _ => Some(format!(
            "mode {}: unexpected datapath counters: sock_forward {sock}, tc_forward_new {tc}",
            mode.name()
        )),
    }
}

// ---------------------------------------------------------------------------------------------
// Clients

/// What one `lb-echo client` run returned.
#[derive(Debug)]
struct TargetResult {
    mode: Mode,
    proto: Proto,
    target: SocketAddr,
    requests: u32,
    ok: u32,
    /// Replies per backend name (every testbed backend is present, possibly with 0).
    per_backend: BTreeMap<String, u32>,
    /// Per backend name, the client addresses (IPs) it saw.
    seen: BTreeMap<String, BTreeSet<String>>,
    /// Replies whose peer was the service address.
    peer_is_vip: u32,
    /// Peers seen other than the service address (first few).
    other_peers: Vec<String>,
    /// Error messages and how often each occurred.
    error_kinds: BTreeMap<String, u32>,
    /// Requests without a line (the client died early).
    missing: u32,
    stderr: String,
}

impl TargetResult {
    fn errors(&self) -> u32 {
        self.requests.saturating_sub(self.ok)
    }
}

fn run_client(
    tb: &Testbed,
    echo_bin: &Path,
    cgroup: Option<&Path>,
    mode: Mode,
    target: SocketAddr,
    proto: Proto,
    cli: &Cli,
) -> anyhow::Result<TargetResult> {
    let mut cmd = Command::new(echo_bin);
    cmd.args([
        "client",
        "--target",
        &target.to_string(),
        "--proto",
        proto.as_str(),
        "--count",
        &cli.requests.to_string(),
        "--timeout-ms",
        &cli.timeout_ms.to_string(),
    ])
    .stdin(Stdio::null());
    let out = tb
        .run(&tb.client.ns, cgroup, cmd)
        .context("running lb-echo client")?;
    let mut r = TargetResult {
        mode,
        proto,
        target,
        requests: cli.requests,
        ok: 0,
        per_backend: tb.backends.iter().map(|b| (b.name.clone(), 0)).collect(),
        seen: BTreeMap::new(),
        peer_is_vip: 0,
        other_peers: Vec::new(),
        error_kinds: BTreeMap::new(),
        missing: 0,
        stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
    };
    let mut lines = 0;
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        lines += 1;
        let v: Value = match serde_json::from_str(line) {
            Ok(v) => v,
            Err(err) => {
                *r.error_kinds
                    .entry(format!("unparsable client output {line:?}: {err}"))
                    .or_default() += 1;
                continue;
            }
        };
        if let Some(err) = v.get("error").and_then(Value::as_str) {
            *r.error_kinds.entry(err.to_owned()).or_default() += 1;
            continue;
        }
        let Some(backend) = v.get("backend").and_then(Value::as_str) else {
            *r.error_kinds
                .entry(format!("client line without backend: {line}"))
                .or_default() += 1;
            continue;
        };
        r.ok += 1;
        *r.per_backend.entry(backend.to_owned()).or_default() += 1;
        if let Some(Ok(seen)) = v
            .get("seen_by_backend")
            .and_then(Value::as_str)
            .map(str::parse::<SocketAddr>)
        {
            r.seen
                .entry(backend.to_owned())
                .or_default()
                .insert(seen.ip().to_string());
        }
        let peer = v.get("peer").and_then(Value::as_str).unwrap_or_default();
        match peer.parse::<SocketAddr>() {
            Ok(p) if p.ip() == target.ip() && p.port() == target.port() => r.peer_is_vip += 1,
            _ => {
                if r.other_peers.len() < 3 && !r.other_peers.iter().any(|o| o == peer) {
                    r.other_peers.push(peer.to_owned());
                }
            }
        }
    }
    r.missing = cli.requests.saturating_sub(lines);
    if !out.status.success() && r.ok == cli.requests {
        // Every request answered, but the client still failed: report it as a problem.
        *r.error_kinds
            .entry(format!("client exited with {}", out.status))
            .or_default() += 1;
    }
    Ok(r)
}

// ---------------------------------------------------------------------------------------------
// lb

/// Prints an lb log line indented, without its timestamp.
fn print_lb_line(line: &str) {
    let trimmed = line.trim_start();
    let rest = match trimmed.split_once(char::is_whitespace) {
        Some((first, rest))
            if first.starts_with(|c: char| c.is_ascii_digit())
                && first.contains('T')
                && first.ends_with('Z') =>
        {
            rest.trim_start()
        }
        _ => trimmed,
    };
    println!("    lb | {rest}");
}

// ---------------------------------------------------------------------------------------------
// Cleanup and signals

/// lb's pin directory, removed on drop (lb leaves its maps pinned on exit).
struct DirGuard(PathBuf);

impl DirGuard {
    fn remove(self) -> anyhow::Result<()> {
        let path = self.0.clone();
        drop(self);
        ensure!(!path.exists(), "could not remove {}", path.display());
        Ok(())
    }
}

impl Drop for DirGuard {
    fn drop(&mut self) {
        match fs::remove_dir_all(&self.0) {
            Ok(()) => {}
            Err(err) if err.kind() == io::ErrorKind::NotFound => {}
            Err(err) => eprintln!("lb-demo: removing {}: {err}", self.0.display()),
        }
    }
}

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// SIGINT and SIGTERM set a flag that the demo checks between steps, so that it still tears
/// everything down. (Ctrl-C also reaches lb and the clients: they share the process group.)
fn install_signal_handlers() -> anyhow::Result<()> {
    let action = SigAction::new(
        SigHandler::Handler(on_signal),
        SaFlags::SA_RESTART,
        SigSet::empty(),
    );
    for sig in [Signal::SIGINT, Signal::SIGTERM] {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        unsafe { signal::sigaction(sig, &action) }
            .with_context(|| format!("installing a {sig} handler"))?;
    }
    Ok(())
}

fn check_interrupted() -> anyhow::Result<()> {
    if INTERRUPTED.load(Ordering::SeqCst) {
        bail!("interrupted; cleaning up");
    }
    Ok(())
}
