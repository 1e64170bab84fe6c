//! Least privilege and safe defaults of `lb run`: the capabilities it checks for at start
//! (lb-userspace/src/privileges.rs) are enough and each is needed, a missing one is named and
//! nothing is created; the pins are root's alone (directories 0700, pins 0600); metrics listen
//! on loopback unless told otherwise. Needs root (netns, eBPF, capability bounding sets through
//! util-linux's `setpriv`).
use std::{
    fs,
    io::{BufRead as _, BufReader},
    os::unix::fs::{MetadataExt as _, PermissionsExt as _},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::mpsc,
    time::Duration,
};

use lb_tests::{bins::LB, daemon::LbDaemon, testbed::Testbed};

/// One Service with one backend, as a manifest directory of its own (removed on drop).
struct Manifests(PathBuf);

impl Manifests {
    fn new(tb: &Testbed) -> Self {
        let dir = std::env::temp_dir().join(format!("lb-test-privileges-{}", tb.id));
        fs::create_dir_all(&dir).unwrap();
        let backend = tb.backends[0].ipv4;
        fs::write(
            dir.join("echo.yaml"),
            format!(
                "apiVersion: v1\nkind: Service\nmetadata: {{name: echo, namespace: demo}}\n\
                 spec:\n  clusterIP: 198.19.0.10\n  clusterIPs: [198.19.0.10]\n  \
                 ports: [{{name: http, protocol: TCP, port: 80, targetPort: 8080}}]\n\
                 ---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n\
                 metadata:\n  name: echo-1\n  namespace: demo\n  \
                 labels: {{kubernetes.io/service-name: echo}}\naddressType: IPv4\n\
                 ports: [{{name: http, protocol: TCP, port: 8080}}]\n\
                 endpoints: [{{addresses: [\"{backend}\"], conditions: {{ready: true}}}}]\n"
            ),
        )
        .unwrap();
        Self(dir)
    }
}

impl Drop for Manifests {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// `lb run` arguments for `tb`: tc on the node's interfaces and socket LB on its cgroup, so
/// every program type and attachment lb makes is exercised.
fn run_args(tb: &Testbed, manifests: &Manifests) -> Vec<String> {
    [
        "--manifests",
        manifests.0.to_str().unwrap(),
        "--cgroup-path",
        tb.cgroup.to_str().unwrap(),
        "--tc-ingress",
        &tb.node_ifaces().join(","),
        "--metrics-bind-address",
        "off",
    ]
    .map(String::from)
    .to_vec()
}

/// Every file under `dir`, directories first, with `dir` itself.
fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    out.push(dir.to_owned());
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            walk(&path, out);
        } else {
            out.push(path);
        }
    }
}

#[test]
fn pins_are_root_only() {
    let mut tb = Testbed::create(1).expect("testbed");
    let manifests = Manifests::new(&tb);
    let args = run_args(&tb, &manifests);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let lb = LbDaemon::start(&mut tb, Path::new(LB), &args, "info").expect("lb ready");
    let mut paths = Vec::new();
    walk(&lb.pin_dir, &mut paths);
    let (mut dirs, mut pins, mut links) = (0, 0, 0);
    for path in &paths {
        let meta = fs::metadata(path).unwrap();
        let mode = meta.permissions().mode() & 0o7777;
        assert_eq!(
            (meta.uid(), meta.gid()),
            (0, 0),
            "{} root's",
            path.display()
        );
        if meta.is_dir() {
            assert_eq!(mode, 0o700, "{} is drwx------", path.display());
            dirs += 1;
        } else {
            assert_eq!(mode, 0o600, "{} is -rw-------", path.display());
            pins += 1;
            links += usize::from(path.parent() != Some(lb.pin_dir.as_path()));
        }
    }
    // The maps and at least the tc and socket-LB links, so the check saw both kinds.
    assert!(dirs >= 2 && pins >= 10 && links >= 2, "{paths:#?}");
    drop(lb);
}

/// `setpriv --bounding-set=SET -- lb run …` in the node netns: as root, the process then
/// holds exactly the bounding set. Returns (reached `ready`, stderr so far).
fn run_with_bounding_set(tb: &mut Testbed, set: &str, pin_dir: &Path) -> (bool, String) {
    let manifests = Manifests::new(tb);
    let state_dir = std::env::temp_dir().join(format!("lb-test-privileges-state-{}", tb.id));
    let mut cmd = Command::new("setpriv");
    cmd.arg(format!("--bounding-set={set}"))
        .arg("--")
        .arg(LB)
        .arg("run")
        .args(run_args(tb, &manifests))
        .arg("--pin-dir")
        .arg(pin_dir)
        .arg("--state-dir")
        .arg(&state_dir)
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let node_ns = tb.node_ns.clone();
    let mut child = tb.spawn(&node_ns, None, cmd).expect("spawn setpriv lb");
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    let mut log = Vec::new();
    let mut ready = false;
    while let Ok(line) = rx.recv_timeout(Duration::from_secs(20)) {
        ready = line.contains(" ready");
        log.push(line);
        if ready {
            break;
        }
    }
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(child.id()).unwrap()),
        nix::sys::signal::Signal::SIGTERM,
    );
    let _ = child.wait();
    if pin_dir.exists() {
        // Programs stay attached through pinned links; take them away before the pins.
        let _ = Command::new(LB)
            .args(["detach", "--pin-dir"])
            .arg(pin_dir)
            .output();
    }
    let _ = fs::remove_dir_all(&state_dir);
    (ready, log.join("\n"))
}

/// With exactly CAP_BPF, CAP_PERFMON and CAP_NET_ADMIN lb programs and attaches; without any
/// one of them it exits naming it, before creating a pin.
#[test]
fn lb_run_needs_exactly_the_capabilities_it_checks_for() {
    let mut tb = Testbed::create(1).expect("testbed");
    let pin_dir = PathBuf::from(format!("/sys/fs/bpf/lb-test-privileges-{}", tb.id));

    let (ready, log) = run_with_bounding_set(&mut tb, "-all,+bpf,+perfmon,+net_admin", &pin_dir);
    assert!(
        ready,
        "lb runs with BPF, PERFMON and NET_ADMIN only:\n{log}"
    );
    // The UDP re-steering iterator loads with these too (where the kernel has the kfunc);
    // only entering other processes' netns would need more (reconcile/resteer.rs).
    let kfunc = fs::read_to_string("/proc/kallsyms")
        .unwrap_or_default()
        .lines()
        .any(|l| l.ends_with(" bpf_sock_destroy"));
    assert!(
        log.contains("connected UDP re-steering"),
        "re-steering on:\n{log}"
    );
    assert_eq!(
        log.contains("destroyed by an iter/udp program"),
        kfunc,
        "the destroy iterator exactly where bpf_sock_destroy exists:\n{log}"
    );
    assert!(
        !kfunc || log.contains("need CAP_SYS_ADMIN and CAP_SYS_PTRACE"),
        "without CAP_SYS_ADMIN/CAP_SYS_PTRACE lb says re-steering stays in its own netns:\n{log}"
    );
    let _ = fs::remove_dir_all(&pin_dir);

    for (set, missing) in [
        ("-all,+perfmon,+net_admin", "CAP_BPF or CAP_SYS_ADMIN"),
        ("-all,+bpf,+net_admin", "CAP_PERFMON or CAP_SYS_ADMIN"),
        ("-all,+bpf,+perfmon", "CAP_NET_ADMIN"),
        ("-all", "CAP_NET_ADMIN"),
    ] {
        let (ready, log) = run_with_bounding_set(&mut tb, set, &pin_dir);
        assert!(!ready, "{set}: lb must not start:\n{log}");
        assert!(
            log.contains("missing capabilities") && log.contains(missing),
            "{set}: names {missing}:\n{log}"
        );
        assert!(
            !pin_dir.exists(),
            "{set}: nothing created, no pin dir:\n{log}"
        );
    }
}

#[test]
fn metrics_listen_on_loopback_by_default() {
    let out = Command::new(LB).args(["run", "--help"]).output().unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    let flag = help
        .split("--metrics-bind-address")
        .nth(1)
        .unwrap_or_else(|| panic!("no --metrics-bind-address in:\n{help}"));
    let default = flag
        .split("[default: ")
        .nth(1)
        .and_then(|d| d.split(']').next())
        .unwrap_or_else(|| panic!("no default for --metrics-bind-address:\n{help}"));
    let addr: std::net::SocketAddr = default.parse().expect("an address");
    assert!(addr.ip().is_loopback(), "metrics default {addr}");
}
