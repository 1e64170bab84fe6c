//! [`ControlPlane`]: a real Kubernetes control plane for the tests — etcd, kube-apiserver and
//! kube-controller-manager (only the EndpointSlice controller) — as child processes on
//! 127.0.0.1 with free ports and a temporary directory of their own, built by
//! `cargo xtask setup` into `target/tools/bin` (xtask/src/setup/kube.rs).
//!
//! * TLS: a throw-away CA and a serving certificate for `127.0.0.1`/`localhost` (openssl CLI).
//! * Authentication: a static admin token (group `system:masters`) from a token file, and
//!   ServiceAccount tokens signed with the control plane's own key (TokenRequest API).
//! * Authorization: RBAC, so a token can do only what its bindings allow.
//! * Services get ClusterIPs from 198.19.0.0/16 and 2001:db8:ffff::/108; no `default/kubernetes` endpoints are written
//!   (`--endpoint-reconciler-type=none`), no kubelet runs: tests set Pod status themselves.
//! * Optionally inside a netns (a testbed's node netns, where lb can reach it).
//!
//! Dropping it stops the processes (SIGTERM, then SIGKILL) and removes the directory, also
//! while a failing test unwinds. Should the test process die without unwinding, the children
//! get SIGKILL from the kernel (`PR_SET_PDEATHSIG`): so keep the [`ControlPlane`] on the thread
//! that started it.
use std::{
    ffi::{OsStr, OsString},
    fs::{self, File},
    io::{self, Read as _, Write as _},
    net::TcpListener,
    os::unix::process::CommandExt as _,
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    sync::atomic::{AtomicU32, Ordering},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail, ensure};
use serde_json::json;

use crate::{
    bins::kube_tool,
    netns::{Enter, in_netns},
};

/// The Service ClusterIP ranges, dual-stack (deploy/examples has a dual-stack Service):
/// documentation addresses, like every address of the tests. IPv6 allows at most /108.
pub const SERVICE_CIDRS: &str = "198.19.0.0/16,2001:db8:ffff::/108";
/// How long start-up may take on a loaded two-core machine (ready in ~5-15 s there).
const READY_TIMEOUT: Duration = Duration::from_secs(180);
/// How long a stopping process gets after SIGTERM before SIGKILL.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);
const POLL: Duration = Duration::from_millis(250);

/// How [`ControlPlane::start_with`] runs the control plane.
#[derive(Clone, Debug)]
pub struct Options {
    /// Run every process inside this netns (a name in `/run/netns/` or a path).
    pub netns: Option<String>,
    /// Start kube-controller-manager with the EndpointSlice controller.
    pub endpointslice_controller: bool,
    /// The apiserver's watch cache. Without it watches are served by etcd itself, so a watch
    /// from a compacted resourceVersion gets 410 Gone.
    pub watch_cache: bool,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            netns: None,
            endpointslice_controller: true,
            watch_cache: true,
        }
    }
}

/// The running control plane; see the [module docs](self).
pub struct ControlPlane {
    /// The temporary directory: certificates, kubeconfigs, etcd's data, the logs.
    pub dir: PathBuf,
    /// `https://127.0.0.1:<port>`.
    pub server: String,
    /// `http://127.0.0.1:<port>`: etcd's client URL (its JSON gateway takes `/v3/...` calls).
    pub etcd_url: String,
    /// A kubeconfig with the admin token (`system:masters`), for the test itself.
    pub admin_kubeconfig: PathBuf,
    /// The CA the serving certificate chains to.
    pub ca_file: PathBuf,
    /// How long etcd + apiserver took from the first spawn to `/readyz` ok.
    pub ready_after: Duration,
    options: Options,
    /// etcd, kube-apiserver, kube-controller-manager: stopped in reverse order.
    procs: Vec<Proc>,
}

struct Proc {
    name: &'static str,
    child: Child,
    log: PathBuf,
    /// Program and arguments, for a restart.
    argv: Vec<OsString>,
}

impl ControlPlane {
    /// etcd + kube-apiserver + the EndpointSlice controller on the host's loopback.
    pub fn start() -> anyhow::Result<Self> {
        Self::start_with(Options::default())
    }

    /// Starts the control plane as `options` say and waits until `/readyz` is ok and the
    /// system namespaces exist. A port taken meanwhile by someone else is retried with others.
    pub fn start_with(options: Options) -> anyhow::Result<Self> {
        let mut attempt = 0;
        loop {
            attempt += 1;
            match Self::try_start(options.clone()) {
                Err(err)
                    if attempt < 3 && format!("{err:#}").contains("address already in use") =>
                {
                    eprintln!("control plane: a port was taken, retrying: {err:#}");
                }
                result => return result,
            }
        }
    }

    fn try_start(options: Options) -> anyhow::Result<Self> {
        let dir = temp_dir()?;
        let mut cp = Self {
            server: String::new(),
            etcd_url: String::new(),
            admin_kubeconfig: dir.join("admin.kubeconfig"),
            ca_file: dir.join("ca.crt"),
            ready_after: Duration::ZERO,
            dir,
            options,
            procs: Vec::new(),
        };
        // On any error below, dropping `cp` stops what already runs and removes the directory.
        let admin_token = random_hex(16)?;
        cp.write_certs()?;
        fs::write(
            cp.dir.join("tokens.csv"),
            format!("{admin_token},lb-test-admin,lb-test-admin,system:masters\n"),
        )?;
        let [etcd_client, etcd_peer, api_port] = cp.free_ports()?;
        cp.server = format!("https://127.0.0.1:{api_port}");
        cp.etcd_url = format!("http://127.0.0.1:{etcd_client}");
        write_kubeconfig(&cp.admin_kubeconfig, &cp.server, &cp.ca_file, &admin_token)?;

        let start = Instant::now();
        let etcd_peer_url = format!("http://127.0.0.1:{etcd_peer}");
        let data = cp.dir.join("etcd");
        let mut etcd = Command::new(kube_tool("etcd")?);
        etcd.arg("--name=lb-test")
            .arg(format!("--data-dir={}", data.display()))
            .arg(format!("--listen-client-urls={}", cp.etcd_url))
            .arg(format!("--advertise-client-urls={}", cp.etcd_url))
            .arg(format!("--listen-peer-urls={etcd_peer_url}"))
            .arg(format!("--initial-advertise-peer-urls={etcd_peer_url}"))
            .arg(format!("--initial-cluster=lb-test={etcd_peer_url}"))
            .arg("--log-level=warn")
            // Throw-away data: no fsync, which costs seconds on a busy disk.
            .arg("--unsafe-no-fsync");
        cp.spawn("etcd", etcd)?;

        let d = |name: &str| cp.dir.join(name).display().to_string();
        let mut api = Command::new(kube_tool("kube-apiserver")?);
        api.arg(format!("--etcd-servers={}", cp.etcd_url))
            .arg("--bind-address=127.0.0.1")
            .arg("--advertise-address=127.0.0.1")
            .arg(format!("--secure-port={api_port}"))
            .arg(format!("--tls-cert-file={}", d("apiserver.crt")))
            .arg(format!("--tls-private-key-file={}", d("apiserver.key")))
            .arg(format!("--cert-dir={}", d("certs")))
            .arg(format!("--token-auth-file={}", d("tokens.csv")))
            .arg("--authorization-mode=RBAC")
            .arg("--service-account-issuer=https://kubernetes.default.svc")
            .arg(format!("--service-account-key-file={}", d("sa.pub")))
            .arg(format!(
                "--service-account-signing-key-file={}",
                d("sa.key")
            ))
            .arg(format!("--service-cluster-ip-range={SERVICE_CIDRS}"))
            .arg("--endpoint-reconciler-type=none")
            // As every cluster that runs kube-proxy (a privileged DaemonSet) has it; the
            // apiserver's default refuses lb's DaemonSet.
            .arg("--allow-privileged=true")
            // Fewer moving parts on a small machine; neither is under test.
            .arg("--enable-priority-and-fairness=false")
            .arg("--profiling=false")
            .arg(format!("--watch-cache={}", cp.options.watch_cache));
        cp.spawn("kube-apiserver", api)?;
        cp.wait_ready(start)?;
        cp.ready_after = start.elapsed();

        if cp.options.endpointslice_controller {
            let mut kcm = Command::new(kube_tool("kube-controller-manager")?);
            kcm.arg(format!("--kubeconfig={}", cp.admin_kubeconfig.display()))
                .arg("--controllers=endpointslice-controller")
                .arg("--leader-elect=false")
                // No serving endpoint: nothing scrapes it, and it would need another port.
                .arg("--secure-port=0");
            cp.spawn("kube-controller-manager", kcm)?;
        }
        eprintln!(
            "control plane: {} ready in {:.1} s (etcd {}, dir {})",
            cp.server,
            cp.ready_after.as_secs_f64(),
            cp.etcd_url,
            cp.dir.display()
        );
        Ok(cp)
    }

    /// A CA, the apiserver's serving certificate signed by it, and the ServiceAccount signing
    /// key pair. EC P-256 keys: fast to generate.
    fn write_certs(&self) -> anyhow::Result<()> {
        let ec = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
        ];
        self.openssl(&[
            &["req", "-x509"],
            &ec[..],
            &[
                "-keyout",
                "ca.key",
                "-out",
                "ca.crt",
                "-days",
                "7",
                "-subj",
                "/CN=lb-test-ca",
            ],
        ])?;
        fs::write(
            self.dir.join("apiserver.ext"),
            "subjectAltName=IP:127.0.0.1,DNS:localhost\n\
             basicConstraints=critical,CA:FALSE\n\
             keyUsage=critical,digitalSignature\n\
             extendedKeyUsage=serverAuth\n",
        )?;
        self.openssl(&[
            &["req"],
            &ec[..],
            &["-keyout", "apiserver.key", "-out", "apiserver.csr"],
            &["-subj", "/CN=kube-apiserver"],
        ])?;
        self.openssl(&[
            &[
                "x509",
                "-req",
                "-in",
                "apiserver.csr",
                "-CA",
                "ca.crt",
                "-CAkey",
                "ca.key",
            ],
            &["-CAcreateserial", "-days", "7", "-out", "apiserver.crt"],
            &["-extfile", "apiserver.ext"],
        ])?;
        self.openssl(&[&[
            "genpkey",
            "-algorithm",
            "EC",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-out",
            "sa.key",
        ]])?;
        self.openssl(&[&["pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub"]])
    }

    /// Runs `openssl ARGS` in the directory; fails with its stderr.
    fn openssl(&self, args: &[&[&str]]) -> anyhow::Result<()> {
        let out = Command::new("openssl")
            .args(args.concat())
            .current_dir(&self.dir)
            .stdin(Stdio::null())
            .output()
            .context("running openssl (`cargo xtask setup` installs it)")?;
        ensure!(
            out.status.success(),
            "openssl {}: {}",
            args.concat().join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
        Ok(())
    }

    /// Three ports free on 127.0.0.1 (in the netns, if any) at the time of asking.
    fn free_ports(&self) -> anyhow::Result<[u16; 3]> {
        let pick = || -> anyhow::Result<[u16; 3]> {
            // Held together, so the three differ.
            let listeners = [(); 3].map(|()| TcpListener::bind("127.0.0.1:0"));
            let mut ports = [0; 3];
            for (port, listener) in ports.iter_mut().zip(listeners) {
                *port = listener.context("bind 127.0.0.1:0")?.local_addr()?.port();
            }
            Ok(ports)
        };
        match &self.options.netns {
            Some(ns) => in_netns(ns, pick),
            None => pick(),
        }
    }

    /// Spawns `cmd` (in the netns, if any) with its output going to `<dir>/<name>.log`.
    fn spawn(&mut self, name: &'static str, mut cmd: Command) -> anyhow::Result<()> {
        let log = self.dir.join(format!("{name}.log"));
        let out = File::create(&log).with_context(|| format!("create {}", log.display()))?;
        cmd.stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .env_remove("KUBECONFIG")
            // Only loopback here: no proxy, as for lb.
            .env_remove("HTTPS_PROXY")
            .env_remove("https_proxy")
            .env_remove("HTTP_PROXY")
            .env_remove("http_proxy");
        kill_with_parent(&mut cmd);
        let enter = self
            .options
            .netns
            .as_deref()
            .map(|ns| Enter::open(ns, None))
            .transpose()?;
        if let Some(enter) = &enter {
            enter.install(&mut cmd);
        }
        let child = cmd.spawn().with_context(|| format!("spawn {name}"))?;
        drop(enter);
        let argv = std::iter::once(cmd.get_program())
            .chain(cmd.get_args())
            .map(OsStr::to_owned)
            .collect();
        self.procs.push(Proc {
            name,
            child,
            log,
            argv,
        });
        Ok(())
    }

    /// Polls `/readyz` and the kube-system namespace (created right after start by a
    /// post-start hook that `/readyz` does not wait for) until both answer, or a process died.
    fn wait_ready(&mut self, start: Instant) -> anyhow::Result<()> {
        loop {
            self.check_running()?;
            let ready = self
                .kubectl(&["get", "--raw", "/readyz"], None)
                .is_ok_and(|o| o.status.success())
                && self
                    .kubectl(&["get", "--raw", "/api/v1/namespaces/kube-system"], None)
                    .is_ok_and(|o| o.status.success());
            if ready {
                return Ok(());
            }
            if start.elapsed() > READY_TIMEOUT {
                bail!(
                    "the control plane was not ready within {READY_TIMEOUT:?}{}",
                    self.logs()
                );
            }
            thread::sleep(POLL);
        }
    }

    /// Fails with the logs if a process has exited.
    pub fn check_running(&mut self) -> anyhow::Result<()> {
        for p in &mut self.procs {
            if let Some(status) = p.child.try_wait()? {
                let name = p.name;
                bail!("{name} exited ({status}){}", self.logs());
            }
        }
        Ok(())
    }

    /// The last lines of each process's log, for error messages.
    pub fn logs(&self) -> String {
        let mut out = String::new();
        for p in &self.procs {
            let text = fs::read_to_string(&p.log).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            let tail = &lines[lines.len().saturating_sub(30)..];
            out.push_str(&format!(
                "\n--- {} ({}):\n{}",
                p.name,
                p.log.display(),
                tail.join("\n")
            ));
        }
        out
    }

    /// Runs the built kubectl with the admin kubeconfig (in the netns, if any), `stdin` fed
    /// in if given; a non-zero exit is not an error here.
    pub fn kubectl(&self, args: &[&str], stdin: Option<&[u8]>) -> anyhow::Result<Output> {
        self.kubectl_as(&self.admin_kubeconfig, args, stdin)
    }

    /// [`ControlPlane::kubectl`] with another kubeconfig.
    pub fn kubectl_as(
        &self,
        kubeconfig: &Path,
        args: &[&str],
        stdin: Option<&[u8]>,
    ) -> anyhow::Result<Output> {
        let mut cmd = Command::new(kube_tool("kubectl")?);
        cmd.arg(format!("--kubeconfig={}", kubeconfig.display()))
            .args(args)
            .env_remove("HTTPS_PROXY")
            .env_remove("https_proxy")
            .stdin(if stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let enter = self
            .options
            .netns
            .as_deref()
            .map(|ns| Enter::open(ns, None))
            .transpose()?;
        if let Some(enter) = &enter {
            enter.install(&mut cmd);
        }
        let mut child = cmd.spawn().context("spawn kubectl")?;
        drop(enter);
        if let Some(input) = stdin {
            let mut pipe = child.stdin.take().context("kubectl stdin")?;
            // Written from a thread so a kubectl that fills its stdout pipe cannot deadlock us.
            let input = input.to_vec();
            thread::spawn(move || {
                let _ = pipe.write_all(&input);
            });
        }
        child.wait_with_output().context("wait for kubectl")
    }

    /// [`ControlPlane::kubectl`], failing unless it exits successfully; returns stdout.
    pub fn kubectl_ok(&self, args: &[&str], stdin: Option<&[u8]>) -> anyhow::Result<String> {
        let out = self.kubectl(args, stdin)?;
        ensure!(
            out.status.success(),
            "kubectl {}: {}: {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// `kubectl apply` of `objects` (JSON documents, sent on stdin as one `v1/List`).
    pub fn apply(&self, objects: &[serde_json::Value]) -> anyhow::Result<()> {
        let list = json!({ "apiVersion": "v1", "kind": "List", "items": objects });
        self.kubectl_ok(&["apply", "-f", "-"], Some(list.to_string().as_bytes()))
            .map(drop)
    }

    /// A token for lb: `deploy/rbac.yaml` applied as is, and a one-hour token of its
    /// ServiceAccount `kube-system/lb` from the TokenRequest API.
    pub fn lb_token(&self) -> anyhow::Result<String> {
        let rbac = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/rbac.yaml");
        self.kubectl_ok(&["apply", "-f", &rbac.display().to_string()], None)?;
        let token = self.kubectl_ok(
            &[
                "create",
                "token",
                "lb",
                "--namespace=kube-system",
                "--duration=1h",
            ],
            None,
        )?;
        Ok(token.trim().to_owned())
    }

    /// A kubeconfig with [`ControlPlane::lb_token`]; returns its path.
    pub fn lb_kubeconfig(&self) -> anyhow::Result<PathBuf> {
        let token = self.lb_token()?;
        self.kubeconfig_at("lb", &self.server, &token)
    }

    /// A kubeconfig for `server` (this control plane's, or a relay's on 127.0.0.1) with
    /// `token`, at `<dir>/<name>.kubeconfig`.
    pub fn kubeconfig_at(&self, name: &str, server: &str, token: &str) -> anyhow::Result<PathBuf> {
        let path = self.dir.join(format!("{name}.kubeconfig"));
        write_kubeconfig(&path, server, &self.ca_file, token)?;
        Ok(path)
    }

    /// etcd's current revision: the resourceVersion of the newest write.
    pub fn etcd_revision(&self) -> anyhow::Result<i64> {
        // Range over an empty key just to read the response header.
        let resp = self.etcd_post("/v3/kv/range", &json!({ "key": "AA==" }))?;
        resp["header"]["revision"]
            .as_str()
            .and_then(|r| r.parse().ok())
            .with_context(|| format!("no revision in {resp}"))
    }

    /// Compacts etcd's history up to `revision`: older resourceVersions are then gone.
    pub fn etcd_compact(&self, revision: i64) -> anyhow::Result<()> {
        let body = json!({ "revision": revision.to_string(), "physical": true });
        self.etcd_post("/v3/kv/compaction", &body).map(drop)
    }

    /// One plain-HTTP JSON POST to etcd's gRPC gateway (in the netns, if any).
    fn etcd_post(&self, path: &str, body: &serde_json::Value) -> anyhow::Result<serde_json::Value> {
        let addr = self
            .etcd_url
            .strip_prefix("http://")
            .context("etcd URL")?
            .to_owned();
        let body = body.to_string();
        let request = format!(
            "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        let call = move || -> anyhow::Result<String> {
            let mut stream = std::net::TcpStream::connect(&addr).context("connect to etcd")?;
            stream.set_read_timeout(Some(Duration::from_secs(30)))?;
            stream.write_all(request.as_bytes())?;
            let mut response = String::new();
            stream.read_to_string(&mut response)?;
            Ok(response)
        };
        let response = match &self.options.netns {
            Some(ns) => in_netns(ns, call)?,
            None => call()?,
        };
        let (head, body) = response
            .split_once("\r\n\r\n")
            .context("etcd's response has no header end")?;
        ensure!(
            head.starts_with("HTTP/1.1 200"),
            "etcd {path}: {head}\n{body}"
        );
        serde_json::from_str(body.trim()).with_context(|| format!("etcd {path}: {body}"))
    }

    /// Stops and restarts kube-apiserver with the same flags (its clients see the connection
    /// drop and the port refuse until it is ready again); waits until it is ready.
    pub fn restart_apiserver(&mut self) -> anyhow::Result<()> {
        let index = self
            .procs
            .iter()
            .position(|p| p.name == "kube-apiserver")
            .context("no kube-apiserver")?;
        let mut proc = self.procs.remove(index);
        stop(&mut proc.child);
        let (program, args) = proc.argv.split_first().context("empty command line")?;
        let mut cmd = Command::new(program);
        cmd.args(args);
        let start = Instant::now();
        self.spawn("kube-apiserver", cmd)?;
        self.wait_ready(start)
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        // Controller manager and apiserver before etcd, so neither logs a storm of errors.
        while let Some(mut p) = self.procs.pop() {
            stop(&mut p.child);
        }
        if std::env::var_os("LB_KEEP_CONTROL_PLANE").is_some() {
            eprintln!("control plane: keeping {}", self.dir.display());
            return;
        }
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// SIGTERM, then SIGKILL after [`STOP_TIMEOUT`]; always reaps.
fn stop(child: &mut Child) {
    if let Ok(Some(_)) = child.try_wait() {
        return;
    }
    if let Ok(pid) = i32::try_from(child.id()) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGTERM,
        );
    }
    let deadline = Instant::now() + STOP_TIMEOUT;
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// The child gets SIGKILL when the thread that spawned it ends (the test process died).
fn kill_with_parent(cmd: &mut Command) {
    let hook = || -> io::Result<()> {
        // SAFETY: prctl(2) is async-signal-safe and takes no pointers here.
        if unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    };
    // SAFETY: the hook only makes one async-signal-safe system call and does not allocate.
    unsafe {
        cmd.pre_exec(hook);
    }
}

/// A kubeconfig (JSON, which is YAML) for `server` trusting `ca`, authenticating with `token`.
fn write_kubeconfig(path: &Path, server: &str, ca: &Path, token: &str) -> anyhow::Result<()> {
    let config = json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{ "name": "lb-test", "cluster": {
            "server": server,
            "certificate-authority": ca,
        }}],
        "users": [{ "name": "lb-test", "user": { "token": token } }],
        "contexts": [{ "name": "lb-test", "context": { "cluster": "lb-test", "user": "lb-test" } }],
        "current-context": "lb-test",
    });
    fs::write(path, serde_json::to_vec_pretty(&config)?)
        .with_context(|| format!("write {}", path.display()))
}

/// `$TMPDIR/lb-cp-<pid>-<n>`, created empty.
fn temp_dir() -> anyhow::Result<PathBuf> {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("lb-cp-{}-{n}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).with_context(|| format!("mkdir {}", dir.display()))?;
    Ok(dir)
}

/// `n` random bytes from the kernel, hex encoded.
fn random_hex(n: usize) -> anyhow::Result<String> {
    let mut bytes = vec![0; n];
    File::open("/dev/urandom")?.read_exact(&mut bytes)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}
