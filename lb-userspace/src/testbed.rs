//! A throw-away network-namespace topology for the integration tests and the demo.
//!
//! ```text
//!               netns lb-<id>-node  (IPv4 + IPv6 forwarding on, no default route)
//!   +--------------------------------------------------------------------------+
//!   |  l<id>c              l<id>b1              l<id>b2          ...  l<id>bN  |
//!   |  198.18.10.1/24      198.18.11.1/24       198.18.12.1/24                 |
//!   |  2001:db8:0:10::1    2001:db8:0:11::1     2001:db8:0:12::1               |
//!   +-----|--------------------|--------------------|--------------------------+
//!    veth |               veth |               veth |
//!   +-----|-----------+  +-----|-----------+  +-----|-----------+
//!   | eth0            |  | eth0            |  | eth0            |
//!   | 198.18.10.2     |  | 198.18.11.2     |  | 198.18.12.2     |   ...
//!   | 2001:db8:0:10::2|  | 2001:db8:0:11::2|  | 2001:db8:0:12::2|
//!   +-----------------+  +-----------------+  +-----------------+
//!    lb-<id>-client       lb-<id>-b1           lb-<id>-b2
//!    (lb-echo client)     (lb-echo serve --name b1)
//! ```
//!
//! * `<id>` is 6 hex digits derived from the pid, the time and a process-wide counter; it is
//!   claimed by creating the cgroup `/sys/fs/cgroup/unified/lb-<id>` (`mkdir` is atomic), so two
//!   testbeds never share names, even across processes.
//! * Link `k` (the client is `k = 0`, backend `i` (1-based, named `b<i>`) is `k = i`) is a veth
//!   pair: `node_if` (`l<id>c` / `l<id>b<i>`) in the node netns and `eth0` in the host netns.
//!   The node side has `198.18.(10+k).1/24` and `2001:db8:0:(10+k)::1/64`, the host side
//!   `198.18.(10+k).2/24` and `2001:db8:0:(10+k)::2/64`. The IPv6 hextet is written with the same
//!   digits as the IPv4 octet (backend 2: `198.18.12.2` and `2001:db8:0:12::2`). IPv6 addresses are
//!   added with `nodad` and every netns has `accept_dad=0` (also for link-local addresses), so
//!   IPv6 is usable at once. At most [`MAX_BACKENDS`] backends.
//! * Every host netns has `lo` up and exactly two routes besides the connected ones:
//!   `198.18.0.0/15 via 198.18.(10+k).1` and `2001:db8::/32 via 2001:db8:0:(10+k)::1`. No netns
//!   has a default route.
//! * Service VIPs belong in `198.19.0.0/16` and `2001:db8:ffff::/96`: the client routes them to
//!   the node, and the node has no route for them, so a packet the load balancer did not
//!   translate dies in the node.
//!
//! [`Testbed::spawn`] and [`Testbed::run`] start processes inside a netns by `setns(2)` in a
//! `pre_exec` hook (the mount namespace is untouched, so `/sys/fs/bpf` and `/sys/fs/cgroup` stay
//! the host's, unlike with `ip netns exec`), optionally moving them into a cgroup first.
//!
//! Dropping the [`Testbed`] kills (SIGKILL) and reaps every process started with
//! [`Testbed::spawn`], deletes all its netns (which deletes the veths) and removes the cgroup
//! (moving any stray processes to the root cgroup first). Teardown problems are printed to
//! stderr; `drop` never panics.
use std::{
    collections::hash_map::DefaultHasher,
    fs::{self, File, OpenOptions},
    hash::{Hash as _, Hasher as _},
    io::{self, BufRead as _, BufReader},
    net::{Ipv4Addr, Ipv6Addr},
    os::{
        fd::{AsRawFd as _, FromRawFd as _, OwnedFd, RawFd},
        unix::process::CommandExt as _,
    },
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Output, Stdio},
    sync::{
        atomic::{AtomicU64, Ordering},
        mpsc,
    },
    thread,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::{Context as _, bail, ensure};

/// Where cgroup v2 is mounted on the test machines.
pub const CGROUP_ROOT: &str = "/sys/fs/cgroup/unified";
/// Interface name of the veth end inside every client/backend netns.
pub const HOST_IF: &str = "eth0";
/// Most backends a testbed can have (link numbers `10 + k` must fit an IPv4 octet).
pub const MAX_BACKENDS: usize = 245;
/// How long [`Testbed::start_echo_servers`] waits for each server's `ready` line.
const ECHO_READY_TIMEOUT: Duration = Duration::from_secs(5);

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// One client or backend netns and its link to the node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Host {
    /// `client` or `b1`..`bN` (the echo servers answer with this name).
    pub name: String,
    /// Netns name (`lb-<id>-client`, `lb-<id>-b<i>`), as in `/run/netns/`.
    pub ns: String,
    /// Node-side veth, in the node netns. The host side is [`HOST_IF`].
    pub node_if: String,
    /// The host's address on its link: `198.18.(10+k).2`.
    pub ipv4: Ipv4Addr,
    /// The host's address on its link: `2001:db8:0:(10+k)::2`.
    pub ipv6: Ipv6Addr,
    link: u8,
}

impl Host {
    fn new(id: &str, name: String, link: u8, node_if: String) -> Self {
        Self {
            ns: format!("lb-{id}-{name}"),
            name,
            node_if,
            ipv4: Ipv4Addr::new(198, 18, link, 2),
            ipv6: link_ipv6(link, 2),
            link,
        }
    }

    /// Link number `10 + k`: the third IPv4 octet (and the digits of the fourth IPv6 hextet).
    pub fn link(&self) -> u8 {
        self.link
    }

    /// The node's address on this link (`198.18.(10+k).1`), the host's IPv4 gateway.
    pub fn node_ipv4(&self) -> Ipv4Addr {
        Ipv4Addr::new(198, 18, self.link, 1)
    }

    /// The node's address on this link (`2001:db8:0:(10+k)::1`), the host's IPv6 gateway.
    pub fn node_ipv6(&self) -> Ipv6Addr {
        link_ipv6(self.link, 1)
    }
}

/// `2001:db8:0:<link as decimal digits>::<host>`.
fn link_ipv6(link: u8, host: u16) -> Ipv6Addr {
    // Decimal digits of a u8 are valid hex digits, so this cannot fail.
    let hextet = u16::from_str_radix(&link.to_string(), 16).unwrap_or_default();
    Ipv6Addr::new(0x2001, 0xdb8, 0, hextet, 0, 0, 0, host)
}

/// A child started by [`Testbed::spawn`], killed and reaped on drop.
#[derive(Debug)]
struct Tracked {
    pid: u32,
    pidfd: OwnedFd,
}

/// The topology described in the [module docs](self). Everything is torn down on drop.
#[derive(Debug)]
pub struct Testbed {
    /// 6 hex digits, unique per testbed.
    pub id: String,
    /// `lb-<id>-node`: the netns in which the load balancer runs.
    pub node_ns: String,
    pub client: Host,
    pub backends: Vec<Host>,
    /// `/sys/fs/cgroup/unified/lb-<id>`, empty, for cgroup-attached programs and their clients.
    pub cgroup: PathBuf,
    created_ns: Vec<String>,
    created_cgroup: bool,
    children: Vec<Tracked>,
    echo_servers: Vec<Child>,
}

impl Testbed {
    /// Creates node netns + client netns + `n_backends` backend netns, wired with veth pairs to
    /// the node, and the cgroup. Anything already created is removed again if a step fails.
    pub fn create(n_backends: usize) -> anyhow::Result<Testbed> {
        ensure!(
            n_backends <= MAX_BACKENDS,
            "at most {MAX_BACKENDS} backends, not {n_backends}"
        );
        let mut attempts = 0;
        let mut tb = loop {
            attempts += 1;
            let tb = Self::named(&new_id(), n_backends);
            if Path::new("/run/netns").join(&tb.node_ns).exists() {
                ensure!(
                    attempts < 16,
                    "no free testbed id after {attempts} attempts"
                );
                continue;
            }
            match fs::create_dir(&tb.cgroup) {
                Ok(()) => break tb,
                Err(err) if err.kind() == io::ErrorKind::AlreadyExists && attempts < 16 => {}
                Err(err) => {
                    return Err(err).with_context(|| format!("mkdir {}", tb.cgroup.display()));
                }
            }
        };
        tb.created_cgroup = true;
        tb.setup()?;
        Ok(tb)
    }

    /// Names only; nothing exists yet.
    fn named(id: &str, n_backends: usize) -> Self {
        let client = Host::new(id, "client".into(), 10, format!("l{id}c"));
        let backends = (1..=n_backends)
            .map(|i| {
                let link = u8::try_from(10 + i).unwrap_or(u8::MAX);
                Host::new(id, format!("b{i}"), link, format!("l{id}b{i}"))
            })
            .collect();
        Self {
            id: id.to_owned(),
            node_ns: format!("lb-{id}-node"),
            client,
            backends,
            cgroup: Path::new(CGROUP_ROOT).join(format!("lb-{id}")),
            created_ns: Vec::new(),
            created_cgroup: false,
            children: Vec::new(),
            echo_servers: Vec::new(),
        }
    }

    fn setup(&mut self) -> anyhow::Result<()> {
        let hosts: Vec<Host> = std::iter::once(self.client.clone())
            .chain(self.backends.iter().cloned())
            .collect();
        let node = self.node_ns.clone();
        // No DAD at all, not even for the link-local addresses: the kernel sends a neighbour
        // solicitation for a forwarded packet only from a non-tentative link-local address, so
        // with DAD the node could not reach IPv6 backends for the first 1-2 s.
        const NO_DAD: [(&str, &str); 2] = [
            ("/proc/sys/net/ipv6/conf/all/accept_dad", "0"),
            ("/proc/sys/net/ipv6/conf/default/accept_dad", "0"),
        ];
        const FORWARDING: [(&str, &str); 2] = [
            ("/proc/sys/net/ipv4/ip_forward", "1"),
            ("/proc/sys/net/ipv6/conf/all/forwarding", "1"),
        ];
        for ns in std::iter::once(&node).chain(hosts.iter().map(|h| &h.ns)) {
            ip(&["netns", "add", ns])?;
            self.created_ns.push(ns.clone());
            let forwarding: &[_] = if *ns == node { &FORWARDING } else { &[] };
            write_sysctls(&ns_path(ns), NO_DAD.iter().chain(forwarding))
                .with_context(|| format!("sysctls in {ns}"))?;
        }
        ip(&["-n", &node, "link", "set", "lo", "up"])?;
        for h in &hosts {
            let (hns, nif, k) = (&h.ns, &h.node_if, h.link);
            // Names and addresses contain no whitespace, so each line splits into arguments.
            let cmds = [
                format!("-n {node} link add {nif} type veth peer name {HOST_IF} netns {hns}"),
                format!("-n {node} addr add 198.18.{k}.1/24 dev {nif}"),
                format!("-n {node} -6 addr add {}/64 dev {nif} nodad", h.node_ipv6()),
                format!("-n {node} link set {nif} up"),
                format!("-n {hns} link set lo up"),
                format!("-n {hns} addr add {}/24 dev {HOST_IF}", h.ipv4),
                format!("-n {hns} -6 addr add {}/64 dev {HOST_IF} nodad", h.ipv6),
                format!("-n {hns} link set {HOST_IF} up"),
                format!("-n {hns} route add 198.18.0.0/15 via {}", h.node_ipv4()),
                format!("-n {hns} -6 route add 2001:db8::/32 via {}", h.node_ipv6()),
            ];
            for cmd in &cmds {
                ip(&cmd.split_whitespace().collect::<Vec<_>>())?;
            }
        }
        Ok(())
    }

    /// The host-side interfaces in `node_ns`: the client's first, then the backends'.
    pub fn node_ifaces(&self) -> Vec<String> {
        std::iter::once(&self.client)
            .chain(&self.backends)
            .map(|h| h.node_if.clone())
            .collect()
    }

    /// The client and every backend.
    pub fn hosts(&self) -> impl Iterator<Item = &Host> {
        std::iter::once(&self.client).chain(&self.backends)
    }

    /// Spawns `cmd` inside netns `ns` (a name in `/run/netns/`, or an absolute path to a netns
    /// file), optionally moving it into cgroup `cgroup` first. The mount namespace is untouched.
    /// Set `cmd`'s stdio as you need (default: inherited).
    ///
    /// The child is killed (SIGKILL) and reaped when the testbed drops unless it has exited and
    /// been waited before; do not use the returned [`Child`] after the testbed dropped.
    pub fn spawn(
        &mut self,
        ns: &str,
        cgroup: Option<&Path>,
        mut cmd: Command,
    ) -> anyhow::Result<Child> {
        let enter = Enter::open(ns, cgroup)?;
        enter.install(&mut cmd);
        let mut child = cmd
            .spawn()
            .with_context(|| format!("spawn {cmd:?} in netns {ns}"))?;
        drop(enter);
        match pidfd_open(child.id()) {
            Ok(pidfd) => {
                self.children.push(Tracked {
                    pid: child.id(),
                    pidfd,
                });
                Ok(child)
            }
            Err(err) => {
                // Best effort: we could not track it, so do not leave it behind.
                let _ = child.kill();
                let _ = child.wait();
                Err(err).context("pidfd_open")
            }
        }
    }

    /// Runs `cmd` to completion inside netns `ns` (see [`Testbed::spawn`]), optionally in
    /// `cgroup`, and returns its [`Output`] (stdout and stderr are captured unless `cmd` sets
    /// them). A non-zero exit status is not an error here.
    pub fn run(&self, ns: &str, cgroup: Option<&Path>, mut cmd: Command) -> anyhow::Result<Output> {
        let enter = Enter::open(ns, cgroup)?;
        enter.install(&mut cmd);
        let out = cmd
            .output()
            .with_context(|| format!("run {cmd:?} in netns {ns}"))?;
        drop(enter);
        Ok(out)
    }

    /// Starts `lb_echo serve --name <backend.name> --port <port>` in every backend netns and
    /// waits (up to 5 s each) until each has printed its `ready` line. The servers are stopped
    /// when the testbed drops.
    pub fn start_echo_servers(&mut self, lb_echo: &Path, port: u16) -> anyhow::Result<()> {
        let mut pending = Vec::new();
        for b in self.backends.clone() {
            let mut cmd = Command::new(lb_echo);
            cmd.args(["serve", "--name", &b.name, "--port", &port.to_string()])
                .stdin(Stdio::null())
                .stdout(Stdio::piped());
            let mut child = self.spawn(&b.ns, None, cmd)?;
            let stdout = child.stdout.take().context("echo server stdout")?;
            self.echo_servers.push(child);
            let (tx, rx) = mpsc::channel();
            thread::Builder::new()
                .name(format!("echo-{}", b.name))
                .spawn(move || {
                    // Forward lines until the receiver is gone, then keep draining until EOF.
                    let mut tx = Some(tx);
                    for line in BufReader::new(stdout).lines() {
                        let Ok(line) = line else { break };
                        if let Some(t) = &tx
                            && t.send(line).is_err()
                        {
                            tx = None;
                        }
                    }
                })
                .context("spawn stdout reader")?;
            pending.push((b, rx));
        }
        for (b, rx) in pending {
            let want = format!("ready {} {port}", b.name);
            let deadline = Instant::now() + ECHO_READY_TIMEOUT;
            loop {
                let left = deadline.saturating_duration_since(Instant::now());
                match rx.recv_timeout(left) {
                    Ok(line) if line.trim() == want => break,
                    Ok(_) => {}
                    Err(mpsc::RecvTimeoutError::Timeout) => {
                        bail!(
                            "echo server {} in {}: no {want:?} within {ECHO_READY_TIMEOUT:?}",
                            b.name,
                            b.ns
                        )
                    }
                    Err(mpsc::RecvTimeoutError::Disconnected) => {
                        bail!("echo server {} in {} exited before {want:?}", b.name, b.ns)
                    }
                }
            }
        }
        Ok(())
    }

    fn teardown(&mut self) {
        let tag = format!("testbed lb-{}", self.id);
        for t in self.children.drain(..) {
            if let Err(err) = kill_and_reap(&t.pidfd)
                && err.raw_os_error() != Some(libc::ECHILD)
            {
                eprintln!("{tag}: kill/reap pid {}: {err}", t.pid);
            }
        }
        // Already reaped above; dropping the Child handles closes their pipes.
        self.echo_servers.clear();
        for ns in self.created_ns.drain(..).rev() {
            if let Err(err) = ip(&["netns", "del", &ns]) {
                eprintln!("{tag}: {err:#}");
            }
        }
        if self.created_cgroup {
            self.created_cgroup = false;
            if let Err(err) = remove_cgroup(&self.cgroup) {
                eprintln!("{tag}: remove cgroup {}: {err:#}", self.cgroup.display());
            }
        }
    }
}

impl Drop for Testbed {
    fn drop(&mut self) {
        self.teardown();
    }
}

/// 6 hex digits from the pid, the time and a process-wide counter.
fn new_id() -> String {
    let mut h = DefaultHasher::new();
    std::process::id().hash(&mut h);
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default()
        .hash(&mut h);
    COUNTER.fetch_add(1, Ordering::Relaxed).hash(&mut h);
    format!("{:06x}", h.finish() & 0xff_ffff)
}

fn ns_path(ns: &str) -> PathBuf {
    if ns.starts_with('/') {
        PathBuf::from(ns)
    } else {
        Path::new("/run/netns").join(ns)
    }
}

fn ip_binary() -> &'static str {
    if Path::new("/usr/sbin/ip").exists() {
        "/usr/sbin/ip"
    } else {
        "ip"
    }
}

/// Runs `ip ARGS…`; a non-zero exit is an error carrying stderr.
pub fn ip(args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new(ip_binary())
        .args(args)
        .stdin(Stdio::null())
        .output()
        .context("run ip")?;
    if !out.status.success() {
        bail!(
            "ip {}: {}: {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Writes `(path, value)` pairs from a short-lived thread that entered netns `ns` (network
/// sysctls resolve against the opening thread's netns).
fn write_sysctls<'a>(
    ns: &Path,
    writes: impl Iterator<Item = &'a (&'a str, &'a str)> + Send,
) -> anyhow::Result<()> {
    let f = File::open(ns).with_context(|| format!("open {}", ns.display()))?;
    thread::scope(|s| {
        s.spawn(|| -> anyhow::Result<()> {
            nix::sched::setns(&f, nix::sched::CloneFlags::CLONE_NEWNET).context("setns")?;
            for (path, value) in writes {
                fs::write(path, value).with_context(|| format!("write {path}"))?;
            }
            Ok(())
        })
        .join()
        .unwrap_or_else(|_| Err(anyhow::anyhow!("sysctl thread panicked")))
    })
}

/// File descriptors a child needs to enter a netns and a cgroup, opened before fork.
struct Enter {
    netns: File,
    cgroup_procs: Option<File>,
}

impl Enter {
    fn open(ns: &str, cgroup: Option<&Path>) -> anyhow::Result<Self> {
        let path = ns_path(ns);
        let netns = File::open(&path).with_context(|| format!("open netns {}", path.display()))?;
        let cgroup_procs = cgroup
            .map(|cg| {
                let procs = cg.join("cgroup.procs");
                OpenOptions::new()
                    .write(true)
                    .open(&procs)
                    .with_context(|| format!("open {}", procs.display()))
            })
            .transpose()?;
        Ok(Self {
            netns,
            cgroup_procs,
        })
    }

    /// Adds the pre_exec hook. `self` must stay alive until the command was spawned.
    fn install(&self, cmd: &mut Command) {
        let netns: RawFd = self.netns.as_raw_fd();
        let procs: Option<RawFd> = self.cgroup_procs.as_ref().map(|f| f.as_raw_fd());
        let hook = move || -> io::Result<()> {
            if let Some(fd) = procs {
                // SAFETY: write(2) is async-signal-safe; fd is open (inherited across fork) and
                // the buffer is a static byte string.
                if unsafe { libc::write(fd, b"0".as_ptr().cast(), 1) } != 1 {
                    return Err(io::Error::last_os_error());
                }
            }
            // SAFETY: setns(2) is async-signal-safe; fd is an open netns file.
            if unsafe { libc::setns(netns, libc::CLONE_NEWNET) } != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        };
        // SAFETY: the hook only makes async-signal-safe system calls and does not allocate.
        unsafe {
            cmd.pre_exec(hook);
        }
    }
}

fn pidfd_open(pid: u32) -> io::Result<OwnedFd> {
    let pid = libc::pid_t::try_from(pid).map_err(io::Error::other)?;
    // SAFETY: pidfd_open(2) with valid arguments; the result is checked.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    let fd = RawFd::try_from(fd).map_err(io::Error::other)?;
    // SAFETY: the kernel just returned this fd to us; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// SIGKILL through the pidfd (no pid-reuse race), then reap it. ECHILD: someone reaped it.
fn kill_and_reap(pidfd: &OwnedFd) -> io::Result<()> {
    let fd = pidfd.as_raw_fd();
    // SAFETY: pidfd_send_signal(2) on our pidfd, no siginfo.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            fd,
            libc::SIGKILL,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    if rc != 0 {
        let err = io::Error::last_os_error();
        // ESRCH: it has already exited (maybe a zombie still to reap).
        if err.raw_os_error() != Some(libc::ESRCH) {
            return Err(err);
        }
    }
    let id = libc::id_t::try_from(fd).map_err(io::Error::other)?;
    loop {
        // SAFETY: siginfo_t is plain old data; waitid writes into it.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: waitid(2) on our pidfd with a valid siginfo_t.
        let rc = unsafe { libc::waitid(libc::P_PIDFD, id, &raw mut info, libc::WEXITED) };
        if rc == 0 {
            return Ok(());
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

/// Moves stray processes to the root cgroup and removes `cg` and any child cgroups.
fn remove_cgroup(cg: &Path) -> anyhow::Result<()> {
    for entry in fs::read_dir(cg).with_context(|| format!("read {}", cg.display()))? {
        let entry = entry?;
        if entry.file_type()?.is_dir() {
            remove_cgroup(&entry.path())?;
        }
    }
    let root_procs = Path::new(CGROUP_ROOT).join("cgroup.procs");
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let procs = fs::read_to_string(cg.join("cgroup.procs")).unwrap_or_default();
        for pid in procs.split_whitespace() {
            // The process may be gone already; rmdir below reports what is left.
            let _ = fs::write(&root_procs, pid);
        }
        match fs::remove_dir(cg) {
            Ok(()) => return Ok(()),
            Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(()),
            // EBUSY: dying tasks still accounted to the cgroup; they leave shortly.
            Err(err) if err.raw_os_error() == Some(libc::EBUSY) && Instant::now() < deadline => {
                thread::sleep(Duration::from_millis(10));
            }
            Err(err) => return Err(err).context("rmdir"),
        }
    }
}

/// `lb run` inside a testbed's node netns with a pin dir and a state dir of its own, its log
/// (stderr) collected line by line. Dropping it stops lb (SIGTERM, then SIGKILL) and removes
/// both directories unless [`LbDaemon::keep_dirs`] was called.
pub struct LbDaemon {
    child: Child,
    lines: mpsc::Receiver<String>,
    /// Every log line received so far.
    pub log: Vec<String>,
    pub pin_dir: PathBuf,
    pub state_dir: PathBuf,
    keep_dirs: bool,
}

/// How long [`LbDaemon`] waits for a log line.
pub const LB_LOG_TIMEOUT: Duration = Duration::from_secs(20);

impl LbDaemon {
    /// Starts `lb run ARGS --pin-dir … --state-dir …` (`lb` is the binary) in `tb`'s node netns
    /// with `RUST_LOG=rust_log`, without waiting for it. Proxy variables are removed: lb talks
    /// to loopback only here.
    pub fn spawn(
        tb: &mut Testbed,
        lb: &Path,
        args: &[&str],
        rust_log: &str,
    ) -> anyhow::Result<Self> {
        let pin_dir = PathBuf::from(format!("/sys/fs/bpf/lb-test-{}", tb.id));
        let state_dir = std::env::temp_dir().join(format!("lb-test-state-{}", tb.id));
        let mut cmd = Command::new(lb);
        cmd.arg("run")
            .args(args)
            .arg("--pin-dir")
            .arg(&pin_dir)
            .arg("--state-dir")
            .arg(&state_dir)
            .env("RUST_LOG", rust_log)
            .env_remove("HTTPS_PROXY")
            .env_remove("https_proxy")
            .env_remove("KUBECONFIG")
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let node_ns = tb.node_ns.clone();
        let mut child = tb.spawn(&node_ns, None, cmd)?;
        let stderr = child.stderr.take().context("lb's stderr")?;
        let (tx, lines) = mpsc::channel();
        thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Ok(Self {
            child,
            lines,
            log: Vec::new(),
            pin_dir,
            state_dir,
            keep_dirs: false,
        })
    }

    /// [`LbDaemon::spawn`] and wait until lb reports `ready` (programmed and attached).
    pub fn start(
        tb: &mut Testbed,
        lb: &Path,
        args: &[&str],
        rust_log: &str,
    ) -> anyhow::Result<Self> {
        let mut daemon = Self::spawn(tb, lb, args, rust_log)?;
        daemon.wait_for(|l| l.contains(" ready"), "ready")?;
        Ok(daemon)
    }

    /// Waits for a new log line matching `pred` and returns it; the error carries the whole
    /// log (timeout, or lb exited).
    pub fn wait_for(&mut self, pred: impl Fn(&str) -> bool, what: &str) -> anyhow::Result<String> {
        self.wait_for_from(self.log.len(), pred, what)
    }

    /// Like [`LbDaemon::wait_for`], but lines already received from index `from` on count too.
    pub fn wait_for_from(
        &mut self,
        from: usize,
        pred: impl Fn(&str) -> bool,
        what: &str,
    ) -> anyhow::Result<String> {
        if let Some(line) = self.log.iter().skip(from).find(|l| pred(l)) {
            return Ok(line.clone());
        }
        let deadline = Instant::now() + LB_LOG_TIMEOUT;
        while Instant::now() < deadline {
            match self.lines.recv_timeout(Duration::from_millis(100)) {
                Ok(line) => {
                    let hit = pred(&line);
                    self.log.push(line.clone());
                    if hit {
                        return Ok(line);
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    if let Ok(Some(status)) = self.child.try_wait() {
                        bail!(
                            "lb exited ({status}) before {what}:\n{}",
                            self.log.join("\n")
                        );
                    }
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            }
        }
        bail!("no {what} from lb:\n{}", self.log.join("\n"))
    }

    /// Sends `signal` to lb.
    pub fn signal(&self, signal: nix::sys::signal::Signal) -> anyhow::Result<()> {
        let pid = nix::unistd::Pid::from_raw(i32::try_from(self.child.id())?);
        nix::sys::signal::kill(pid, signal).context("kill")
    }

    /// Stops lb with SIGTERM (SIGKILL after 5 s) and returns how it exited.
    pub fn stop(&mut self) -> anyhow::Result<ExitStatus> {
        if let Some(status) = self.child.try_wait()? {
            return Ok(status);
        }
        self.signal(nix::sys::signal::Signal::SIGTERM)?;
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status);
            }
            thread::sleep(Duration::from_millis(20));
        }
        self.child.kill()?;
        Ok(self.child.wait()?)
    }

    /// Leaves the pin and state directories behind on drop (a later lb reuses them).
    pub fn keep_dirs(&mut self) {
        self.keep_dirs = true;
    }
}

impl Drop for LbDaemon {
    fn drop(&mut self) {
        if let Err(e) = self.stop() {
            eprintln!("lb-testbed: stopping lb: {e:#}");
        }
        if !self.keep_dirs {
            let _ = fs::remove_dir_all(&self.pin_dir);
            let _ = fs::remove_dir_all(&self.state_dir);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addressing() {
        let tb = Testbed::named("abc123", 2);
        assert_eq!(tb.node_ns, "lb-abc123-node");
        assert_eq!(tb.client.ns, "lb-abc123-client");
        assert_eq!(tb.client.node_if, "labc123c");
        assert_eq!(tb.client.ipv4, Ipv4Addr::new(198, 18, 10, 2));
        assert_eq!(
            tb.client.node_ipv6(),
            "2001:db8:0:10::1".parse::<Ipv6Addr>().unwrap()
        );
        let b2 = &tb.backends[1];
        assert_eq!((b2.name.as_str(), b2.ns.as_str()), ("b2", "lb-abc123-b2"));
        assert_eq!(b2.node_if, "labc123b2");
        assert_eq!(b2.ipv4, Ipv4Addr::new(198, 18, 12, 2));
        assert_eq!(b2.ipv6, "2001:db8:0:12::2".parse::<Ipv6Addr>().unwrap());
        assert_eq!(tb.node_ifaces(), ["labc123c", "labc123b1", "labc123b2"]);
        assert_eq!(tb.cgroup, Path::new("/sys/fs/cgroup/unified/lb-abc123"));
        let last = Testbed::named("abc123", MAX_BACKENDS);
        let last = last.backends.last().unwrap();
        assert!(last.node_if.len() <= 15);
        assert_eq!(last.ipv6, "2001:db8:0:255::2".parse::<Ipv6Addr>().unwrap());
        assert_eq!(new_id().len(), 6);
    }
}
