//! A Kubernetes cluster on this one machine for `cargo xtask e2e`: a control-plane netns
//! (etcd, kube-apiserver, kube-controller-manager, kube-scheduler, CoreDNS; kubectl and the
//! e2e runner run there too) and N node netns, each with its own containerd, kubelet and CNI
//! bridge, wired to the control plane's bridge. The service proxy is lb, installed with kubectl
//! from deploy/ as a DaemonSet, or upstream kube-proxy (nftables) as one process per node.
//!
//! Everything carries the run's id: netns `<id>-cp`/`<id>-nodeN`, node names `<id>-nodeN`,
//! cgroups `<own cgroup>/<id>` in every hierarchy, state in `/run/<id>`, pins in
//! `/sys/fs/bpf/lb-<id>-nodeN`. [`Cluster`]'s drop tears all of it down (also on errors and
//! Ctrl-C); a run that died without that is swept by the next one ([`sweep_stale`]).
//! Background: /work/shared/notes/real-nodes.md.

use std::{
    ffi::CString,
    fs::{self, File},
    io::{BufRead as _, BufReader, Read as _, Write as _},
    os::{
        fd::{AsRawFd as _, OwnedFd},
        unix::{fs::PermissionsExt as _, process::CommandExt as _},
    },
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::atomic::{AtomicBool, Ordering},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail, ensure};
use serde_json::json;

use super::config::{self, NodeNet};
use crate::process::{display, workspace_root};

/// Set by SIGINT/SIGTERM: every wait gives up, and the cluster is torn down.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);
/// Prefix of every run id (and so of every name a run creates).
pub const ID_PREFIX: &str = "lbe2e-";
const CGROUP_MOUNT: &str = "/sys/fs/cgroup";
const CGROUP2: &str = "/sys/fs/cgroup/unified";
const BPFFS: &str = "/sys/fs/bpf";
/// Exists while bpffs is shared because a run made it so (outside every run's state).
const SHARED_MARK: &str = "/run/lb-e2e-bpffs-made-shared";
const STOP_TIMEOUT: Duration = Duration::from_secs(10);
const POLL: Duration = Duration::from_millis(500);

/// Images the suite names that are another image's content under a second name, tagged on
/// each node when no archive of their own is given: (alias, source).
const IMAGE_ALIASES: [(&str, &str); 1] = [(
    // The DNS specs' glibc querier runs `sh`, `dig`, `seq`, `test` on glibc: agnhost's
    // userland (Debian's glibc and BIND tools) is exactly that.
    "registry.k8s.io/e2e-test-images/glibc-dns-testing:2.1.1",
    crate::images::AGNHOST,
)];

/// The service proxy under test.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Proxy {
    Lb,
    KubeProxy,
}

impl Proxy {
    pub fn name(self) -> &'static str {
        match self {
            Self::Lb => "lb",
            Self::KubeProxy => "kube-proxy",
        }
    }
}

pub struct Options {
    pub nodes: u8,
    pub proxy: Proxy,
    /// Logs, certificates, kubeconfigs, the overlay and the JUnit files (kept).
    pub dir: PathBuf,
    /// Image archives every node imports before kubelet starts.
    pub images: Vec<(String, PathBuf)>,
    /// lb's image name, with [`Proxy::Lb`].
    pub lb_image: Option<String>,
    /// Extra `lb run` flags for the overlay.
    pub lb_args: Vec<String>,
    /// The cluster outlives xtask (`--keep`): its processes are not killed when xtask ends.
    pub keep: bool,
}

struct Proc {
    name: String,
    child: Child,
    log: PathBuf,
}

pub struct Cluster {
    pub id: String,
    pub dir: PathBuf,
    /// `/run/<id>`: sockets and the nodes' runtime state (short paths for unix sockets).
    state: PathBuf,
    pub cp_netns: String,
    pub nodes: Vec<NodeNet>,
    pub admin_kubeconfig: PathBuf,
    /// `<own cgroup>/<id>`, the same relative path in every hierarchy.
    cgroup: String,
    procs: Vec<Proc>,
    /// Leave everything running on drop (`--keep`).
    pub keep: bool,
    /// Started to outlive xtask (`--keep`).
    outlive: bool,
    bin: PathBuf,
}

/// Installs the SIGINT/SIGTERM handler that sets [`INTERRUPTED`] (once per process).
pub fn catch_interrupts() {
    extern "C" fn on_signal(_: libc::c_int) {
        INTERRUPTED.store(true, Ordering::SeqCst);
    }
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe {
        let handler = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
        libc::signal(libc::SIGINT, handler);
        libc::signal(libc::SIGTERM, handler);
    }
}

pub fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::SeqCst)
}

fn check_interrupted() -> Result<()> {
    ensure!(!interrupted(), "interrupted");
    Ok(())
}

/// A fresh run id: the prefix and 4 hex digits (names stay short: interface and cgroup names,
/// unix socket paths).
pub fn new_id() -> Result<String> {
    let mut bytes = [0u8; 2];
    File::open("/dev/urandom")?.read_exact(&mut bytes)?;
    Ok(format!("{ID_PREFIX}{:02x}{:02x}", bytes[0], bytes[1]))
}

impl Cluster {
    /// Brings the cluster up (see the module docs); on any error what was started is torn
    /// down again.
    pub fn up(id: &str, options: &Options) -> Result<Self> {
        let start = Instant::now();
        let base = own_cgroup()?;
        let mut cluster = Self {
            id: id.to_owned(),
            dir: options.dir.clone(),
            state: PathBuf::from(format!("/run/{id}")),
            cp_netns: format!("{id}-cp"),
            nodes: (1..=options.nodes).map(|i| NodeNet::new(id, i)).collect(),
            admin_kubeconfig: options.dir.join("admin.kubeconfig"),
            cgroup: format!("{}/{id}", base.trim_end_matches('/')),
            procs: Vec::new(),
            keep: false,
            outlive: options.keep,
            bin: workspace_root().join("target/tools/bin"),
        };
        fs::create_dir_all(&cluster.dir)?;
        fs::create_dir_all(&cluster.state)?;
        fs::write(
            cluster.state.join("owner.pid"),
            std::process::id().to_string(),
        )?;
        fs::write(cluster.state.join("cgroup"), &cluster.cgroup)?;
        if options.proxy == Proxy::Lb {
            shared_bpffs()?;
        }
        cluster.cgroups()?;
        cluster.network()?;
        println!("e2e: {} network and cgroups ready", cluster.id);
        cluster.control_plane()?;
        println!(
            "e2e: control plane ready after {:.0} s",
            start.elapsed().as_secs_f64()
        );
        for i in 0..cluster.nodes.len() {
            cluster.start_node(i, &options.images)?;
        }
        cluster.wait_nodes_ready()?;
        println!(
            "e2e: {} nodes ready after {:.0} s",
            cluster.nodes.len(),
            start.elapsed().as_secs_f64()
        );
        match options.proxy {
            Proxy::KubeProxy => cluster.start_kube_proxy()?,
            Proxy::Lb => cluster.install_lb(
                options
                    .lb_image
                    .as_deref()
                    .context("lb's image was not built")?,
                &options.lb_args,
            )?,
        }
        println!(
            "e2e: cluster up with {} in {:.0} s",
            options.proxy.name(),
            start.elapsed().as_secs_f64()
        );
        Ok(cluster)
    }

    fn tool(&self, name: &str) -> PathBuf {
        self.bin.join(name)
    }

    fn node_dir(&self, node: &NodeNet) -> PathBuf {
        self.state.join(format!("node{}", node.index))
    }

    /// `<run cgroup>/<node name>`: the node's kubelet cgroupRoot.
    fn node_cgroup(&self, node: &NodeNet) -> String {
        format!("{}/{}", self.cgroup, node.name)
    }

    /// The run's cgroup and each node's cgroupRoot in every hierarchy (kubelet's cgroupfs
    /// driver wants its root in each v1 controller; runc mirrors containers into cgroup v2 at
    /// the same path), cpuset filled in at every level; the daemons' own cgroup in v2 only.
    fn cgroups(&self) -> Result<()> {
        let mut wanted = vec![self.cgroup.clone()];
        wanted.extend(self.nodes.iter().map(|n| self.node_cgroup(n)));
        for hierarchy in cgroup_hierarchies()? {
            for rel in &wanted {
                make_cgroup(&hierarchy, rel)?;
            }
        }
        make_cgroup(Path::new(CGROUP2), &format!("{}/daemons", self.cgroup))
    }

    /// The control-plane netns with its bridge; per node a netns whose `eth0` is on that
    /// bridge, routes to the other nodes' pod CIDRs and to the service range, forwarding on.
    fn network(&self) -> Result<()> {
        let cp = &self.cp_netns;
        ip(&["netns", "add", cp])?;
        ip(&["-n", cp, "link", "set", "lo", "up"])?;
        ip(&["-n", cp, "link", "add", "br0", "type", "bridge"])?;
        ip(&[
            "-n",
            cp,
            "addr",
            "add",
            &format!("{}/{}", config::CP_IP, config::BRIDGE_PREFIX),
            "dev",
            "br0",
        ])?;
        ip(&[
            "-n",
            cp,
            "addr",
            "add",
            &format!("{}/{}", config::CP_IP6, config::BRIDGE_PREFIX6),
            "dev",
            "br0",
            "nodad",
        ])?;
        ip(&["-n", cp, "link", "set", "br0", "up"])?;
        for node in &self.nodes {
            let ns = self.node_netns(node);
            let port = format!("node{}", node.index);
            ip(&["netns", "add", &ns])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
            ip(&[
                "-n", cp, "link", "add", &port, "type", "veth", "peer", "name", "eth0", "netns",
                &ns,
            ])?;
            ip(&["-n", cp, "link", "set", &port, "master", "br0", "up"])?;
            ip(&[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{}/{}", node.ip, config::BRIDGE_PREFIX),
                "dev",
                "eth0",
            ])?;
            ip(&[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{}/{}", node.ip6, config::BRIDGE_PREFIX6),
                "dev",
                "eth0",
                "nodad",
            ])?;
            ip(&["-n", &ns, "link", "set", "eth0", "up"])?;
            ip(&["-n", cp, "route", "add", &node.pod_cidr, "via", &node.ip])?;
            ip(&["-n", cp, "route", "add", &node.pod_cidr6, "via", &node.ip6])?;
            for other in self.nodes.iter().filter(|o| o.index != node.index) {
                ip(&["-n", &ns, "route", "add", &other.pod_cidr, "via", &other.ip])?;
                ip(&[
                    "-n",
                    &ns,
                    "route",
                    "add",
                    &other.pod_cidr6,
                    "via",
                    &other.ip6,
                ])?;
            }
            // Host processes (hostNetwork pods) reach ClusterIPs: the route lookup happens
            // before the proxy translates, and there is no default route.
            ip(&[
                "-n",
                &ns,
                "route",
                "add",
                config::SERVICE_CIDR,
                "via",
                config::CP_IP,
            ])?;
            ip(&[
                "-n",
                &ns,
                "route",
                "add",
                config::SERVICE_CIDR6,
                "via",
                config::CP_IP6,
            ])?;
            for (key, value) in [
                ("net/ipv4/ip_forward", "1"),
                ("net/bridge/bridge-nf-call-iptables", "1"),
                ("net/ipv4/conf/all/rp_filter", "0"),
                ("net/ipv4/conf/default/rp_filter", "0"),
                ("net/ipv6/conf/all/forwarding", "1"),
                ("net/bridge/bridge-nf-call-ip6tables", "1"),
                // Pods' veths get their addresses at once (no duplicate detection delay).
                ("net/ipv6/conf/default/accept_dad", "0"),
            ] {
                in_netns_write(&ns, &format!("/proc/sys/{key}"), value)?;
            }
        }
        Ok(())
    }

    pub fn node_netns(&self, node: &NodeNet) -> String {
        format!("{}-node{}", self.id, node.index)
    }

    /// Certificates, tokens, kubeconfigs; etcd and the apiserver (waited for), the
    /// controller manager, the scheduler, CoreDNS and the kube-dns Service.
    fn control_plane(&mut self) -> Result<()> {
        let pki = self.dir.join("pki");
        fs::create_dir_all(&pki)?;
        write_certs(&pki)?;
        let admin_token = random_hex(16)?;
        fs::write(
            pki.join("tokens.csv"),
            config::token_file(&[(&admin_token, "e2e-admin", &["system:masters"])]),
        )?;
        let server = format!("https://{}:{}", config::CP_IP, config::APISERVER_PORT);
        fs::write(
            &self.admin_kubeconfig,
            config::kubeconfig(&server, &pki.join("ca.crt"), &admin_token),
        )?;
        let p = |name: &str| pki.join(name).display().to_string();
        let cp = self.cp_netns.clone();

        let etcd_data = self.state.join("etcd");
        let mut etcd = Command::new(self.tool("etcd"));
        etcd.arg("--name=e2e")
            .arg(format!("--data-dir={}", etcd_data.display()))
            .args([
                "--listen-client-urls=http://127.0.0.1:2379",
                "--advertise-client-urls=http://127.0.0.1:2379",
                "--listen-peer-urls=http://127.0.0.1:2380",
                "--initial-advertise-peer-urls=http://127.0.0.1:2380",
                "--initial-cluster=e2e=http://127.0.0.1:2380",
                "--log-level=warn",
                "--unsafe-no-fsync",
            ]);
        self.spawn("etcd", &cp, etcd)?;

        let mut api = Command::new(self.tool("kube-apiserver"));
        api.args([
            "--etcd-servers=http://127.0.0.1:2379",
            "--bind-address=0.0.0.0",
            &format!("--advertise-address={}", config::CP_IP),
            &format!("--secure-port={}", config::APISERVER_PORT),
            &format!("--tls-cert-file={}", p("apiserver.crt")),
            &format!("--tls-private-key-file={}", p("apiserver.key")),
            &format!("--client-ca-file={}", p("ca.crt")),
            &format!("--token-auth-file={}", p("tokens.csv")),
            "--authorization-mode=Node,RBAC",
            "--service-account-issuer=https://kubernetes.default.svc",
            &format!("--service-account-key-file={}", p("sa.pub")),
            &format!("--service-account-signing-key-file={}", p("sa.key")),
            &format!("--service-cluster-ip-range={}", config::service_cidrs()),
            "--kubelet-preferred-address-types=InternalIP",
            "--allow-privileged=true",
            "--enable-priority-and-fairness=false",
            "--profiling=false",
        ]);
        self.spawn("kube-apiserver", &cp, api)?;
        self.wait_for("the apiserver", Duration::from_secs(180), |c| {
            Ok(c.kubectl(&["get", "--raw", "/readyz"])?.status.success()
                && c.kubectl(&["get", "namespace", "kube-system", "default"])?
                    .status
                    .success())
        })?;

        let kubeconfig = self.admin_kubeconfig.display().to_string();
        let mut kcm = Command::new(self.tool("kube-controller-manager"));
        kcm.args([
            &format!("--kubeconfig={kubeconfig}"),
            &format!("--authentication-kubeconfig={kubeconfig}"),
            &format!("--authorization-kubeconfig={kubeconfig}"),
            "--controllers=*",
            "--leader-elect=false",
            &format!("--root-ca-file={}", p("ca.crt")),
            &format!("--service-account-private-key-file={}", p("sa.key")),
            &format!("--cluster-signing-cert-file={}", p("ca.crt")),
            &format!("--cluster-signing-key-file={}", p("ca.key")),
            &format!("--service-cluster-ip-range={}", config::service_cidrs()),
            &format!("--cluster-cidr={}", config::cluster_cidrs()),
            "--allocate-node-cidrs=false",
            "--use-service-account-credentials=true",
        ]);
        self.spawn("kube-controller-manager", &cp, kcm)?;
        let mut scheduler = Command::new(self.tool("kube-scheduler"));
        scheduler.args([
            &format!("--kubeconfig={kubeconfig}"),
            &format!("--authentication-kubeconfig={kubeconfig}"),
            &format!("--authorization-kubeconfig={kubeconfig}"),
            "--leader-elect=false",
        ]);
        self.spawn("kube-scheduler", &cp, scheduler)?;

        let corefile = self.dir.join("Corefile");
        fs::write(&corefile, config::corefile(&self.admin_kubeconfig))?;
        let mut coredns = Command::new(self.tool("coredns"));
        coredns.arg("-conf").arg(&corefile);
        self.spawn("coredns", &cp, coredns)?;
        self.apply_json(&config::kube_dns_objects())
    }

    /// containerd (images imported) and kubelet of node `i`.
    fn start_node(&mut self, i: usize, images: &[(String, PathBuf)]) -> Result<()> {
        let node = self.nodes[i].clone();
        let ns = self.node_netns(&node);
        let dir = self.node_dir(&node);
        for sub in ["cni/net.d", "cni/data", "kubelet", "pod-logs", "runc"] {
            fs::create_dir_all(dir.join(sub))?;
        }
        let pause = images
            .iter()
            .map(|(name, _)| name.as_str())
            .find(|name| name.starts_with("registry.k8s.io/pause:"))
            .context("no pause image")?;
        fs::write(
            dir.join("containerd.toml"),
            config::containerd_toml(
                &dir,
                &which("runc")?,
                super::super::setup::nodes::CNI_BIN_DIR,
                pause,
            ),
        )?;
        fs::write(
            dir.join("cni/net.d/10-e2e.conflist"),
            config::cni_conflist(&node, &dir.join("cni/data")),
        )?;
        let mut containerd = Command::new(self.tool("containerd"));
        containerd
            .arg("--config")
            .arg(dir.join("containerd.toml"))
            .arg("--log-level=warn")
            // Its shims are found next to it, never Debian's.
            .env("PATH", path_with(&self.bin));
        self.spawn(&format!("containerd-{}", node.name), &ns, containerd)?;
        let sock = dir.join("containerd.sock");
        self.wait_for("containerd", Duration::from_secs(60), |_| Ok(sock.exists()))?;
        let start = Instant::now();
        for (name, archive) in images {
            let out = Command::new(self.tool("ctr"))
                .arg("--address")
                .arg(&sock)
                .args(["--namespace", "k8s.io", "images", "import"])
                .arg(archive)
                .stdin(Stdio::null())
                .output()
                .context("running ctr")?;
            ensure!(
                out.status.success(),
                "ctr images import {name} ({}) on {}: {}",
                archive.display(),
                node.name,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        for (alias, source) in IMAGE_ALIASES {
            if images.iter().any(|(name, _)| name == alias)
                || !images.iter().any(|(name, _)| name == source)
            {
                continue;
            }
            let out = Command::new(self.tool("ctr"))
                .arg("--address")
                .arg(&sock)
                .args(["--namespace", "k8s.io", "images", "tag", source, alias])
                .stdin(Stdio::null())
                .output()
                .context("running ctr")?;
            ensure!(
                out.status.success(),
                "ctr images tag {source} {alias}: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        println!(
            "e2e: {}: {} images imported in {:.1} s",
            node.name,
            images.len(),
            start.elapsed().as_secs_f64()
        );

        let resolv = dir.join("resolv.conf");
        fs::write(&resolv, "")?;
        let kubelet_config = dir.join("kubelet.json");
        fs::write(
            &kubelet_config,
            serde_json::to_string_pretty(&config::kubelet_config(
                &node,
                &dir,
                &self.node_cgroup(&node),
                &resolv,
            ))?,
        )?;
        let mut kubelet = Command::new(self.tool("kubelet"));
        kubelet
            .arg(format!("--config={}", kubelet_config.display()))
            .arg(format!("--kubeconfig={}", self.admin_kubeconfig.display()))
            .arg(format!("--root-dir={}", dir.join("kubelet").display()))
            .arg(format!("--cert-dir={}", dir.join("kubelet/pki").display()))
            .arg(format!("--hostname-override={}", node.name))
            .arg(format!("--node-ip={},{}", node.ip, node.ip6))
            .arg(format!(
                "--node-labels=topology.kubernetes.io/zone={}",
                node.zone
            ))
            .arg("--v=2")
            .env("PATH", path_with(&self.bin));
        self.spawn(&format!("kubelet-{}", node.name), &ns, kubelet)
    }

    fn wait_nodes_ready(&mut self) -> Result<()> {
        let names: Vec<String> = self.nodes.iter().map(|n| n.name.clone()).collect();
        self.wait_for("the nodes to register", Duration::from_secs(180), |c| {
            Ok(names.iter().all(|n| {
                c.kubectl(&["get", "node", n])
                    .is_ok_and(|o| o.status.success())
            }))
        })?;
        for node in self.nodes.clone() {
            // Not allocated by the controller manager: each node's CNI range is fixed.
            let patch = json!({ "spec": { "podCIDR": node.pod_cidr, "podCIDRs": [node.pod_cidr, node.pod_cidr6] } });
            self.kubectl_ok(&[
                "patch",
                "node",
                &node.name,
                "--type=merge",
                "-p",
                &patch.to_string(),
            ])?;
        }
        self.wait_for("the nodes to be Ready", Duration::from_secs(180), |c| {
            Ok(names.iter().all(|n| {
                c.kubectl(&[
                    "get",
                    "node",
                    n,
                    "-o",
                    "jsonpath={.status.conditions[?(@.type==\"Ready\")].status}",
                ])
                .is_ok_and(|o| o.stdout == b"True")
            }))
        })
    }

    fn start_kube_proxy(&mut self) -> Result<()> {
        for node in self.nodes.clone() {
            let mut cmd = Command::new(self.tool("kube-proxy"));
            cmd.args(config::kube_proxy_args(&node, &self.admin_kubeconfig));
            let ns = self.node_netns(&node);
            self.spawn(&format!("kube-proxy-{}", node.name), &ns, cmd)?;
        }
        let nodes = self.nodes.clone();
        self.wait_for("kube-proxy's /healthz", Duration::from_secs(120), |c| {
            Ok(nodes.iter().all(|n| {
                in_netns(&c.node_netns(n), || {
                    Ok(http_get("127.0.0.1:10256", "/healthz")?.starts_with("HTTP/1.1 200"))
                })
                .unwrap_or(false)
            }))
        })
    }

    /// deploy/rbac.yaml and deploy/daemonset.yaml through the generated overlay, then waits
    /// for the rollout.
    fn install_lb(&mut self, image: &str, extra_args: &[String]) -> Result<()> {
        let facts = super::overlay::Facts {
            image: image.to_owned(),
            devices: "eth0".to_owned(),
            apiserver_host: config::CP_IP.to_owned(),
            apiserver_port: config::APISERVER_PORT,
            cgroup2_mount: CGROUP2.to_owned(),
            node_cgroup_parent: self.cgroup.clone(),
            cluster_cidr: config::cluster_cidrs(),
            service_cidr: config::service_cidrs(),
            extra_args: extra_args.to_vec(),
        };
        let overlay = self.dir.join("lb-overlay");
        super::overlay::write(&overlay, &workspace_root().join("deploy"), &facts)?;
        let rendered = self.kubectl_ok(&["kustomize", &overlay.display().to_string()])?;
        fs::write(self.dir.join("lb-rendered.yaml"), &rendered)?;
        self.kubectl_ok(&["apply", "-k", &overlay.display().to_string()])?;
        let started = Instant::now();
        let result = self.wait_for("lb's DaemonSet rollout", Duration::from_secs(180), |c| {
            let out = c.kubectl(&[
                "-n",
                "kube-system",
                "get",
                "ds",
                "lb",
                "-o",
                "jsonpath={.status.numberReady}/{.status.desiredNumberScheduled}",
            ])?;
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            Ok(text
                .split_once('/')
                .is_some_and(|(r, d)| r == d && d.parse::<usize>().ok() == Some(c.nodes.len())))
        });
        if result.is_err() {
            let pods = self.kubectl(&[
                "-n",
                "kube-system",
                "describe",
                "pods",
                "-l",
                "app.kubernetes.io/name=lb",
            ]);
            if let Ok(out) = pods {
                fs::write(self.dir.join("lb-pods.txt"), &out.stdout)?;
            }
        }
        result?;
        println!(
            "e2e: lb ready on every node {:.0} s after `kubectl apply -k`",
            started.elapsed().as_secs_f64()
        );
        Ok(())
    }

    /// Polls `ready` until it is true, failing after `timeout`, on Ctrl-C, or when a
    /// process of the cluster exited.
    fn wait_for(
        &mut self,
        what: &str,
        timeout: Duration,
        mut ready: impl FnMut(&mut Self) -> Result<bool>,
    ) -> Result<()> {
        let start = Instant::now();
        loop {
            check_interrupted()?;
            self.check_running()?;
            if ready(self)? {
                return Ok(());
            }
            if start.elapsed() > timeout {
                bail!(
                    "timed out after {} s waiting for {what}; logs in {}",
                    timeout.as_secs(),
                    self.dir.display()
                );
            }
            thread::sleep(POLL);
        }
    }

    /// Fails naming the first process that exited, with the end of its log.
    pub fn check_running(&mut self) -> Result<()> {
        for p in &mut self.procs {
            if let Some(status) = p.child.try_wait()? {
                let log = fs::read_to_string(&p.log).unwrap_or_default();
                let lines: Vec<&str> = log.lines().collect();
                bail!(
                    "{} exited ({status}); the end of {}:\n{}",
                    p.name,
                    p.log.display(),
                    lines[lines.len().saturating_sub(20)..].join("\n")
                );
            }
        }
        Ok(())
    }

    /// Starts `cmd` in netns `ns`, in the run's daemon cgroup (v2), in its own process group
    /// (Ctrl-C reaches only xtask, which tears down in order), killed should xtask die; its
    /// output goes to `<dir>/logs/<name>.log`.
    fn spawn(&mut self, name: &str, ns: &str, mut cmd: Command) -> Result<()> {
        let logs = self.dir.join("logs");
        fs::create_dir_all(&logs)?;
        let log = logs.join(format!("{name}.log"));
        let out = File::create(&log).with_context(|| format!("create {}", log.display()))?;
        cmd.stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .env_remove("KUBECONFIG")
            .env_remove("HTTPS_PROXY")
            .env_remove("https_proxy")
            .env_remove("HTTP_PROXY")
            .env_remove("http_proxy");
        let procs = format!("{CGROUP2}/{}/daemons/cgroup.procs", self.cgroup);
        let group = if self.outlive {
            Group::Own
        } else {
            Group::OwnDyingWithXtask
        };
        enter(&mut cmd, ns, Some(Path::new(&procs)), group)?;
        let shown = display(&cmd);
        let child = cmd
            .spawn()
            .with_context(|| format!("could not start `{shown}`"))?;
        fs::write(logs.join(format!("{name}.cmd")), format!("{shown}\n"))?;
        self.procs.push(Proc {
            name: name.to_owned(),
            child,
            log,
        });
        Ok(())
    }

    /// kubectl with the admin kubeconfig in the control-plane netns; a failure is not an
    /// error here.
    pub fn kubectl(&self, args: &[&str]) -> Result<std::process::Output> {
        let mut cmd = Command::new(self.tool("kubectl"));
        cmd.arg(format!("--kubeconfig={}", self.admin_kubeconfig.display()))
            .args(args)
            .stdin(Stdio::null());
        enter(&mut cmd, &self.cp_netns, None, Group::Inherit)?;
        cmd.output().context("running kubectl")
    }

    pub fn kubectl_ok(&self, args: &[&str]) -> Result<String> {
        let out = self.kubectl(args)?;
        ensure!(
            out.status.success(),
            "kubectl {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    fn apply_json(&self, objects: &[serde_json::Value]) -> Result<()> {
        let list = json!({ "apiVersion": "v1", "kind": "List", "items": objects });
        let file = self.dir.join(format!("apply-{}.json", random_hex(4)?));
        fs::write(&file, list.to_string())?;
        self.kubectl_ok(&["apply", "-f", &file.display().to_string()])
            .map(drop)
    }

    /// Runs `e2e.test` in the control-plane netns with `focus`/`skip`, JUnit into
    /// `report_dir`, its output into `<dir>/logs/e2e.test.log` and, one line per spec, on the
    /// terminal. Returns whether it exited successfully.
    pub fn run_e2e(&mut self, focus: &str, skip: &str, report_dir: &Path) -> Result<bool> {
        fs::create_dir_all(report_dir)?;
        let log_path = self.dir.join("logs/e2e.test.log");
        let mut cmd = Command::new(self.tool(crate::setup::nodes::E2E_TEST));
        cmd.args([
            "--provider=local",
            &format!("--kubeconfig={}", self.admin_kubeconfig.display()),
            &format!("--kubectl-path={}", self.tool("kubectl").display()),
            &format!("--report-dir={}", report_dir.display()),
            &format!("--ginkgo.focus={focus}"),
            "--ginkgo.no-color",
            "--ginkgo.v",
            "--ginkgo.timeout=4h",
            "--disable-log-dump=true",
            "--dump-logs-on-failure=false",
            "--allowed-not-ready-nodes=0",
            &format!("--e2e-output-dir={}", self.dir.join("e2e-output").display()),
        ])
        .current_dir(&self.dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .env_remove("KUBECONFIG")
        .env_remove("HTTPS_PROXY")
        .env_remove("https_proxy");
        if !skip.is_empty() {
            cmd.arg(format!("--ginkgo.skip={skip}"));
        }
        enter(
            &mut cmd,
            &self.cp_netns.clone(),
            None,
            Group::OwnDyingWithXtask,
        )?;
        let shown = display(&cmd);
        fs::write(self.dir.join("logs/e2e.test.cmd"), format!("{shown}\n"))?;
        println!("$ {shown}");
        let mut child = cmd.spawn().context("starting e2e.test")?;
        let log = File::create(&log_path)?;
        let stderr = child.stderr.take().context("stderr")?;
        let log_err = log.try_clone()?;
        let err_thread = thread::spawn(move || copy_lines(stderr, log_err, None));
        let stdout = child.stdout.take().context("stdout")?;
        let prefix = self.id.clone();
        let out_thread = thread::spawn(move || copy_lines(stdout, log, Some(&prefix)));
        let status = loop {
            if let Some(status) = child.try_wait()? {
                break status;
            }
            if interrupted() {
                signal(child.id(), libc::SIGTERM);
                break child.wait()?;
            }
            if let Err(err) = self.check_running() {
                println!("e2e: a cluster process died during the suite: {err:#}");
            }
            thread::sleep(POLL);
        };
        let _ = out_thread.join();
        let _ = err_thread.join();
        check_interrupted()?;
        Ok(status.success())
    }

    /// Stops every process and removes everything of the run but `dir`.
    fn teardown(&mut self) {
        // Ask nicely, all at once, then insist.
        for p in self.procs.iter().rev() {
            signal(p.child.id(), libc::SIGTERM);
        }
        let deadline = Instant::now() + STOP_TIMEOUT;
        for p in self.procs.iter_mut().rev() {
            while Instant::now() < deadline && matches!(p.child.try_wait(), Ok(None)) {
                thread::sleep(Duration::from_millis(50));
            }
            let _ = p.child.kill();
            let _ = p.child.wait();
        }
        self.procs.clear();
        // The pods' logs (lb's among them) live in the nodes' state: keep a copy.
        for node in &self.nodes {
            let from = self.node_dir(node).join("pod-logs");
            let to = self.dir.join("logs/pods").join(&node.name);
            if let Err(e) = copy_tree(&from, &to) {
                println!("e2e: copying {}: {e:#}", from.display());
            }
        }
        let nodes: Vec<String> = self.nodes.iter().map(|n| n.name.clone()).collect();
        cleanup(&self.id, &self.cgroup, &nodes);
    }

    /// What `--keep` prints: how to use the cluster, and how to remove it.
    pub fn keep_message(&self) -> String {
        format!(
            "e2e: the cluster {id} stays up.\n\
             \x20 kubeconfig: {kc}\n\
             \x20 enter the control-plane netns: nsenter --net=/run/netns/{cp} bash\n\
             \x20 then: {kubectl} --kubeconfig={kc} get nodes -o wide\n\
             \x20 a node: nsenter --net=/run/netns/{id}-node1 bash\n\
             \x20 logs: {logs}\n\
             \x20 remove it: stop its processes (pids in {logs}/*.pid), then run `cargo xtask e2e` \
             again (it sweeps runs whose owner is gone) or `cargo xtask e2e --sweep`",
            id = self.id,
            kc = self.admin_kubeconfig.display(),
            cp = self.cp_netns,
            kubectl = self.tool("kubectl").display(),
            logs = self.dir.join("logs").display(),
        )
    }

    /// Detaches the processes from xtask's lifetime for `--keep`: records their pids.
    pub fn keep_running(mut self) -> Result<()> {
        self.keep = true;
        let logs = self.dir.join("logs");
        for p in &self.procs {
            fs::write(
                logs.join(format!("{}.pid", p.name)),
                p.child.id().to_string(),
            )?;
        }
        fs::write(self.state.join("owner.pid"), "kept")?;
        println!("{}", self.keep_message());
        Ok(())
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if self.keep {
            return;
        }
        let start = Instant::now();
        self.teardown();
        println!(
            "e2e: {} torn down in {:.1} s",
            self.id,
            start.elapsed().as_secs_f64()
        );
    }
}

/// Removes everything of run `id` that outlives its processes: the processes still in its
/// cgroup (pod containers, shims), mounts below its state directory, its netns, cgroups,
/// pins and per-node lb state. Best effort: each step goes on after a failure, which it
/// prints.
pub fn cleanup(id: &str, cgroup: &str, nodes: &[String]) {
    let warn = |what: &str, r: Result<()>| {
        if let Err(e) = r {
            println!("e2e: cleanup of {id}: {what}: {e:#}");
        }
    };
    // Every process left in the run's cgroups: containers (runc mirrors them into v2),
    // shims and daemons (v2 `daemons`), in any hierarchy.
    warn("killing processes", kill_cgroup_tree(cgroup));
    let state = PathBuf::from(format!("/run/{id}"));
    warn("unmounting", unmount_below(&state));
    for ns in netns_of(id) {
        warn(&format!("netns {ns}"), ip(&["netns", "delete", &ns]));
    }
    match cgroup_hierarchies() {
        Ok(hierarchies) => {
            for h in hierarchies {
                warn(
                    &format!("cgroups in {}", h.display()),
                    remove_cgroup_tree(&h.join(cgroup.trim_start_matches('/'))),
                );
            }
        }
        Err(e) => warn("listing cgroup hierarchies", Err(e)),
    }
    for node in nodes {
        for dir in [
            PathBuf::from(format!("{BPFFS}/lb-{node}")),
            PathBuf::from(format!("/run/lb/{node}")),
        ] {
            if dir.exists() {
                warn(
                    &format!("removing {}", dir.display()),
                    fs::remove_dir_all(&dir).with_context(|| dir.display().to_string()),
                );
            }
        }
    }
    // The last run to go makes bpffs private again if any run made it shared.
    if Path::new(SHARED_MARK).exists() && runs().iter().all(|r| r == id) {
        warn(
            "making bpffs private again",
            set_propagation(BPFFS, libc::MS_PRIVATE),
        );
        let _ = fs::remove_file(SHARED_MARK);
    }
    // kubelet links each container's log into /var/log/containers (a fixed path).
    warn("removing container log links", remove_log_links(&state));
    // /run/lb is created by the DaemonSet's hostPath; remove it once no run uses it.
    let _ = fs::remove_dir("/run/lb");
    if state.exists() {
        warn(
            "removing the state directory",
            fs::remove_dir_all(&state).with_context(|| state.display().to_string()),
        );
    }
}

/// Removes the links in /var/log/containers into `state` (or into any run's state
/// directory that is gone).
fn remove_log_links(state: &Path) -> Result<()> {
    for entry in fs::read_dir("/var/log/containers")
        .into_iter()
        .flatten()
        .flatten()
    {
        let Ok(target) = fs::read_link(entry.path()) else {
            continue;
        };
        let stale_run = target
            .to_str()
            .is_some_and(|t| t.starts_with(&format!("/run/{ID_PREFIX}")))
            && !target.exists();
        if target.starts_with(state) || stale_run {
            fs::remove_file(entry.path())
                .with_context(|| format!("rm {}", entry.path().display()))?;
        }
    }
    Ok(())
}

/// Copies the regular files below `from` into `to` (directories created).
fn copy_tree(from: &Path, to: &Path) -> Result<()> {
    if !from.is_dir() {
        return Ok(());
    }
    fs::create_dir_all(to)?;
    for entry in fs::read_dir(from)? {
        let entry = entry?;
        let kind = entry.file_type()?;
        let dest = to.join(entry.file_name());
        if kind.is_dir() {
            copy_tree(&entry.path(), &dest)?;
        } else if kind.is_file() {
            fs::copy(entry.path(), &dest)
                .with_context(|| format!("cp {}", entry.path().display()))?;
        }
    }
    Ok(())
}

/// Tears down the runs whose owner process is gone (killed without unwinding), found by
/// their state directories `/run/<id>`.
pub fn sweep_stale() -> Result<()> {
    for entry in fs::read_dir("/run")? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.starts_with(ID_PREFIX) {
            continue;
        }
        let dir = entry.path();
        let owner = fs::read_to_string(dir.join("owner.pid")).unwrap_or_default();
        let alive = owner
            .trim()
            .parse::<u32>()
            .is_ok_and(|pid| Path::new(&format!("/proc/{pid}")).exists());
        if alive || owner.trim() == "kept" {
            continue;
        }
        sweep(&name)?;
    }
    Ok(())
}

/// Tears down run `id` whatever state it is in (its processes are killed through its
/// cgroups).
pub fn sweep(id: &str) -> Result<()> {
    let dir = PathBuf::from(format!("/run/{id}"));
    let cgroup = fs::read_to_string(dir.join("cgroup"))
        .with_context(|| format!("{}/cgroup", dir.display()))?;
    let nodes: Vec<String> = (1..=config::MAX_NODES)
        .map(|i| format!("{id}-node{i}"))
        .collect();
    println!("e2e: removing the leftovers of run {id}");
    cleanup(id, cgroup.trim(), &nodes);
    Ok(())
}

/// The runs on this machine (their state directories).
pub fn runs() -> Vec<String> {
    fs::read_dir("/run")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(ID_PREFIX))
        .collect()
}

fn netns_of(id: &str) -> Vec<String> {
    fs::read_dir("/run/netns")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&format!("{id}-")))
        .collect()
}

/// The path of this process's cgroup that kubelet's roots go below: the memory controller's
/// (where the machine accounts this session), else cgroup v2's.
fn own_cgroup() -> Result<String> {
    let text = fs::read_to_string("/proc/self/cgroup").context("reading /proc/self/cgroup")?;
    let mut v2 = None;
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next(), parts.next(), parts.next());
        match controllers {
            Some(c) if c.split(',').any(|c| c == "memory") => {
                return Ok(path.unwrap_or("/").to_owned());
            }
            Some("") => v2 = path.map(str::to_owned),
            _ => {}
        }
    }
    Ok(v2.unwrap_or_else(|| "/".to_owned()))
}

/// Makes bpffs a shared mount, as systemd makes every mount on a real node: the DaemonSet's
/// init container mounts it with Bidirectional propagation, which the runtime refuses on a
/// private mount. Remembered in [`SHARED_MARK`], so the last run's cleanup makes it private
/// again.
fn shared_bpffs() -> Result<()> {
    let info = fs::read_to_string("/proc/self/mountinfo")?;
    let shared = info.lines().any(|l| {
        let f: Vec<&str> = l.split(' ').collect();
        f.get(4) == Some(&BPFFS)
            && f[6..]
                .iter()
                .take_while(|x| **x != "-")
                .any(|x| x.starts_with("shared:"))
    });
    if !shared {
        set_propagation(BPFFS, libc::MS_SHARED)?;
        fs::write(SHARED_MARK, "")?;
        println!("e2e: made {BPFFS} a shared mount (as on a systemd host) for lb's init container");
    }
    Ok(())
}

fn set_propagation(path: &str, flag: libc::c_ulong) -> Result<()> {
    let c = CString::new(path)?;
    // SAFETY: valid C strings; a propagation change takes no source, type or data.
    let rc = unsafe {
        libc::mount(
            std::ptr::null(),
            c.as_ptr(),
            std::ptr::null(),
            flag,
            std::ptr::null(),
        )
    };
    ensure!(
        rc == 0,
        "changing the propagation of {path}: {}",
        std::io::Error::last_os_error()
    );
    Ok(())
}

/// Every mounted cgroup hierarchy: the v1 controllers' and the v2 one.
fn cgroup_hierarchies() -> Result<Vec<PathBuf>> {
    let mounts = fs::read_to_string("/proc/self/mounts")?;
    Ok(mounts
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() > 2
                && (f[2] == "cgroup" || f[2] == "cgroup2")
                && f[1].starts_with(CGROUP_MOUNT))
            .then(|| PathBuf::from(f[1]))
        })
        .collect())
}

/// Creates `rel` below `hierarchy`, level by level; in cpuset every new level gets its
/// parent's CPUs and memory nodes (an empty cpuset cannot take tasks).
fn make_cgroup(hierarchy: &Path, rel: &str) -> Result<()> {
    let mut path = hierarchy.to_path_buf();
    for part in rel.split('/').filter(|p| !p.is_empty()) {
        let parent = path.clone();
        path.push(part);
        if !path.exists() {
            fs::create_dir(&path).with_context(|| format!("mkdir {}", path.display()))?;
        }
        for file in ["cpuset.cpus", "cpuset.mems"] {
            let mine = path.join(file);
            if mine.exists() && fs::read_to_string(&mine)?.trim().is_empty() {
                let value = fs::read_to_string(parent.join(file))?;
                fs::write(&mine, value.trim())
                    .with_context(|| format!("writing {}", mine.display()))?;
            }
        }
    }
    Ok(())
}

/// SIGKILLs every process below `rel` in every hierarchy (cgroup.kill in v2 first), until
/// none is left or 20 s passed.
fn kill_cgroup_tree(rel: &str) -> Result<()> {
    let rel = rel.trim_start_matches('/');
    let v2 = Path::new(CGROUP2).join(rel);
    if v2.join("cgroup.kill").exists() {
        let _ = fs::write(v2.join("cgroup.kill"), "1");
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let mut pids = Vec::new();
        for h in cgroup_hierarchies()? {
            collect_pids(&h.join(rel), &mut pids);
        }
        pids.sort_unstable();
        pids.dedup();
        if pids.is_empty() {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("processes still alive: {pids:?}");
        }
        for pid in &pids {
            signal(*pid, libc::SIGKILL);
        }
        thread::sleep(Duration::from_millis(200));
    }
}

fn collect_pids(dir: &Path, pids: &mut Vec<u32>) {
    if let Ok(text) = fs::read_to_string(dir.join("cgroup.procs")) {
        pids.extend(text.lines().filter_map(|l| l.trim().parse::<u32>().ok()));
    }
    for entry in fs::read_dir(dir).into_iter().flatten().flatten() {
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            collect_pids(&entry.path(), pids);
        }
    }
}

/// rmdir of a cgroup tree, children first.
fn remove_cgroup_tree(dir: &Path) -> Result<()> {
    if !dir.exists() {
        return Ok(());
    }
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        if entry.file_type()?.is_dir() {
            remove_cgroup_tree(&entry.path())?;
        }
    }
    // A cgroup whose last task just died may be busy for a moment.
    for _ in 0..50 {
        match fs::remove_dir(dir) {
            Ok(()) => return Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                thread::sleep(Duration::from_millis(100));
            }
            Err(e) => return Err(e).with_context(|| format!("rmdir {}", dir.display())),
        }
    }
    bail!("rmdir {}: still busy", dir.display())
}

/// Lazily unmounts every mount at or below `dir`, deepest first (pods' volumes, container
/// root filesystems, shm, pod netns files).
fn unmount_below(dir: &Path) -> Result<()> {
    let prefix = dir.display().to_string();
    let info = fs::read_to_string("/proc/self/mountinfo")?;
    let mut points: Vec<String> = info
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(unescape_mount)
        .filter(|p| p == &prefix || p.starts_with(&format!("{prefix}/")))
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.len()));
    points.dedup();
    for p in points {
        let c = CString::new(p.clone())?;
        // SAFETY: a valid C string; MNT_DETACH needs no other state.
        if unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) } != 0 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() != Some(libc::EINVAL) && err.raw_os_error() != Some(libc::ENOENT)
            {
                println!("e2e: umount {p}: {err}");
            }
        }
    }
    Ok(())
}

/// mountinfo escapes space, tab, newline and backslash as octal.
fn unescape_mount(s: &str) -> String {
    let mut out = String::new();
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\\' {
            let code: String = chars.by_ref().take(3).collect();
            if let Ok(n) = u8::from_str_radix(&code, 8) {
                out.push(char::from(n));
                continue;
            }
            out.push('\\');
            out.push_str(&code);
        } else {
            out.push(c);
        }
    }
    out
}

fn signal(pid: u32, sig: libc::c_int) {
    if let Ok(pid) = libc::pid_t::try_from(pid) {
        // SAFETY: kill(2) with a plain pid and signal number.
        unsafe {
            libc::kill(pid, sig);
        }
    }
}

/// The process group of a child, and whether it dies with xtask.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Group {
    /// xtask's (Ctrl-C reaches it too): short commands.
    Inherit,
    /// Its own, so Ctrl-C reaches only xtask, which tears down in order.
    Own,
    /// Its own, and SIGKILLed when the xtask thread that started it ends.
    OwnDyingWithXtask,
}

/// Makes `cmd` start in netns `ns` (setns on `/run/netns/<ns>`: `ip netns exec` would remount
/// /sys and hide the cgroup hierarchies), optionally in the cgroup whose `cgroup.procs` is
/// given, in the process group `group` says.
fn enter(cmd: &mut Command, ns: &str, cgroup_procs: Option<&Path>, group: Group) -> Result<()> {
    let netns: OwnedFd = File::open(format!("/run/netns/{ns}"))
        .with_context(|| format!("opening netns {ns}"))?
        .into();
    let cgroup: Option<OwnedFd> = cgroup_procs
        .map(|p| {
            fs::OpenOptions::new()
                .write(true)
                .open(p)
                .with_context(|| format!("opening {}", p.display()))
        })
        .transpose()?
        .map(Into::into);
    let netns_fd = netns.as_raw_fd();
    let cgroup_fd = cgroup.as_ref().map(|f| f.as_raw_fd());
    // The descriptors must stay open until the child has used them: they move into the
    // closure, which lives as long as the Command.
    let hook = move || -> std::io::Result<()> {
        let _keep = (&netns, &cgroup);
        // SAFETY: only async-signal-safe system calls on descriptors owned above.
        unsafe {
            if libc::setns(netns_fd, libc::CLONE_NEWNET) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if let Some(fd) = cgroup_fd
                && libc::write(fd, b"0".as_ptr().cast(), 1) != 1
            {
                return Err(std::io::Error::last_os_error());
            }
            if group != Group::Inherit && libc::setpgid(0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if group == Group::OwnDyingWithXtask
                && libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
        }
        Ok(())
    };
    // SAFETY: the hook makes only async-signal-safe system calls and does not allocate.
    unsafe {
        cmd.pre_exec(hook);
    }
    Ok(())
}

/// Runs `f` on a thread that has entered netns `ns`.
fn in_netns<T: Send + 'static>(
    ns: &str,
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    let file = File::open(format!("/run/netns/{ns}")).with_context(|| format!("netns {ns}"))?;
    thread::spawn(move || {
        // SAFETY: setns on this thread only (the thread ends after `f`).
        if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            return Err(std::io::Error::last_os_error()).context("setns");
        }
        f()
    })
    .join()
    .map_err(|_| anyhow::anyhow!("the netns thread panicked"))?
}

/// Writes a per-netns file (a sysctl under /proc/sys/net) from inside netns `ns`.
fn in_netns_write(ns: &str, path: &str, value: &str) -> Result<()> {
    let (path, value) = (path.to_owned(), value.to_owned());
    in_netns(ns, move || {
        fs::write(&path, &value).with_context(|| format!("writing {value} to {path}"))
    })
}

/// A minimal HTTP/1.1 GET; returns the whole response.
fn http_get(addr: &str, path: &str) -> Result<String> {
    let mut stream = std::net::TcpStream::connect(addr)?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    Ok(response)
}

fn ip(args: &[&str]) -> Result<()> {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .context("running ip")?;
    ensure!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(())
}

fn which(name: &str) -> Result<String> {
    for dir in ["/usr/sbin", "/usr/bin", "/sbin", "/bin"] {
        let p = Path::new(dir).join(name);
        if p.metadata()
            .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        {
            return Ok(p.display().to_string());
        }
    }
    bail!("{name} is not installed (cargo xtask setup installs it)")
}

/// `dir` first, then the system directories (never rustup's or Go's).
fn path_with(dir: &Path) -> String {
    format!(
        "{}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        dir.display()
    )
}

/// Copies e2e.test's output into its log; with `echo` (a prefix), prints one line per finished spec
/// (outcome, time, name) and Ginkgo's summary.
fn copy_lines(from: impl std::io::Read, mut to: File, echo: Option<&str>) {
    let reader = BufReader::new(from);
    let mut current: Option<String> = None;
    for line in reader.split(b'\n').map_while(Result::ok) {
        let _ = to.write_all(&line);
        let _ = to.write_all(b"\n");
        let Some(prefix) = echo else {
            continue;
        };
        let text = String::from_utf8_lossy(&line);
        if let Some(done) = spec_line(&text, &mut current) {
            println!("  {prefix}: {done}");
        } else if text.starts_with("Ran ")
            || text.starts_with("FAIL!")
            || text.starts_with("SUCCESS!")
            || text.starts_with("Will run ")
        {
            println!("  {prefix}: {text}");
        }
    }
}

/// Follows Ginkgo's verbose output: a line starting `[sig-` names the spec that starts, a
/// line starting `•` ends it (`• [12.3 seconds]`, `• [FAILED] [124.1 seconds]`). Returns the
/// line to print when a spec ended.
fn spec_line(text: &str, current: &mut Option<String>) -> Option<String> {
    if text.starts_with("[sig-") {
        // After a failure Ginkgo repeats the name with `[It]` in it: not a new spec.
        if !text.contains(" [It] ") {
            *current = Some(text.to_owned());
        }
        return None;
    }
    let rest = text.strip_prefix("• ")?;
    let name = current.take()?;
    let outcome = if rest.contains("[FAILED]")
        || rest.contains("[PANICKED]")
        || rest.contains("[TIMEDOUT]")
        || rest.contains("[INTERRUPTED]")
    {
        "FAILED"
    } else if rest.contains("[SKIPPED]") {
        "skipped"
    } else {
        "passed"
    };
    let secs = rest
        .rsplit('[')
        .next()
        .and_then(|s| s.split_whitespace().next())
        .and_then(|s| s.parse::<f64>().ok())
        .unwrap_or(0.0);
    Some(format!("{outcome:<7} {secs:>5.0} s  {name}"))
}

/// A CA, the apiserver's serving certificate (the bridge address, the `kubernetes`
/// ClusterIP and its DNS names) and the ServiceAccount key pair, with the openssl CLI.
fn write_certs(dir: &Path) -> Result<()> {
    let openssl = |args: &[&str]| -> Result<()> {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .stdin(Stdio::null())
            .output()
            .context("running openssl")?;
        ensure!(
            out.status.success(),
            "openssl {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
        Ok(())
    };
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
    ];
    openssl(
        &[
            &["req", "-x509"][..],
            &ec,
            &["-keyout", "ca.key", "-out", "ca.crt", "-days", "2"],
            &["-subj", "/CN=lb-e2e-ca"],
        ]
        .concat(),
    )?;
    fs::write(
        dir.join("apiserver.ext"),
        format!(
            "subjectAltName=IP:{},IP:{},IP:{},IP:127.0.0.1,DNS:localhost,DNS:kubernetes,\
             DNS:kubernetes.default,DNS:kubernetes.default.svc,\
             DNS:kubernetes.default.svc.{}\n\
             basicConstraints=critical,CA:FALSE\n\
             keyUsage=critical,digitalSignature\n\
             extendedKeyUsage=serverAuth\n",
            config::CP_IP,
            config::CP_IP6,
            config::KUBERNETES_SERVICE_IP,
            config::CLUSTER_DOMAIN
        ),
    )?;
    openssl(
        &[
            &["req"][..],
            &ec,
            &["-keyout", "apiserver.key", "-out", "apiserver.csr"],
            &["-subj", "/CN=kube-apiserver"],
        ]
        .concat(),
    )?;
    openssl(&[
        "x509",
        "-req",
        "-in",
        "apiserver.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-out",
        "apiserver.crt",
        "-extfile",
        "apiserver.ext",
    ])?;
    openssl(&[
        "genpkey",
        "-algorithm",
        "EC",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-out",
        "sa.key",
    ])?;
    openssl(&["pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub"])
}

fn random_hex(n: usize) -> Result<String> {
    let mut bytes = vec![0; n];
    File::open("/dev/urandom")?.read_exact(&mut bytes)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_lines_pair_name_and_outcome() {
        let mut cur = None;
        assert_eq!(
            spec_line("[sig-network] Services a [Conformance]", &mut cur),
            None
        );
        assert_eq!(spec_line("  STEP: x", &mut cur), None);
        assert_eq!(
            spec_line("• [FAILED] [124.141 seconds]", &mut cur).unwrap(),
            "FAILED    124 s  [sig-network] Services a [Conformance]"
        );
        // Ginkgo repeats the name after a failure; no spec is running then.
        assert_eq!(spec_line("[sig-network] Services [It] a", &mut cur), None);
        assert_eq!(spec_line("• [4.467 seconds]", &mut cur), None);
        spec_line("[sig-network] b", &mut cur);
        assert_eq!(
            spec_line("• [4.467 seconds]", &mut cur).unwrap(),
            "passed      4 s  [sig-network] b"
        );
    }

    #[test]
    fn mountinfo_unescapes_octal() {
        assert_eq!(unescape_mount(r"/a\040b/c"), "/a b/c");
        assert_eq!(unescape_mount("/plain"), "/plain");
    }

    #[test]
    fn run_ids_are_short_and_prefixed() {
        let id = new_id().unwrap();
        assert!(
            id.starts_with(ID_PREFIX) && id.len() == ID_PREFIX.len() + 4,
            "{id}"
        );
        // The longest interface name a run creates inside its netns is `node3`; netns names
        // `<id>-node3` and node names stay well below the limits.
        assert!(format!("{id}-node3").len() < 63);
    }
}
