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
//!   claimed by creating the cgroup `<cgroup v2 root>/lb-<id>` (`mkdir` is atomic), so two
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
    fs,
    hash::{Hash as _, Hasher as _},
    io::{self, BufRead as _, BufReader},
    net::{Ipv4Addr, Ipv6Addr},
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd, RawFd},
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    sync::{
        atomic::{AtomicU64, Ordering},
        mpsc,
    },
    thread,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::{Context as _, bail, ensure};

use crate::netns::{Enter, in_netns, ip};

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
    /// `<cgroup v2 root>/lb-<id>` (`/sys/fs/cgroup/unified/lb-<id>` on the test machines),
    /// empty, for cgroup-attached programs and their clients.
    pub cgroup: PathBuf,
    /// Where stray processes go before the cgroup is removed.
    cgroup_root: PathBuf,
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
        // The same cgroup v2 root `lb run` attaches socket LB to by default.
        let cgroup_root = lb::datapath::cgroup::cgroup2_root()?;
        let mut attempts = 0;
        let mut tb = loop {
            attempts += 1;
            let tb = Self::named(&new_id(), n_backends, &cgroup_root);
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
    fn named(id: &str, n_backends: usize, cgroup_root: &Path) -> Self {
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
            cgroup: cgroup_root.join(format!("lb-{id}")),
            cgroup_root: cgroup_root.to_path_buf(),
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
            let writes: Vec<_> = NO_DAD.iter().chain(forwarding).collect();
            in_netns(ns, || {
                for (path, value) in writes {
                    fs::write(path, value).with_context(|| format!("write {path}"))?;
                }
                Ok(())
            })
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
            if let Err(err) = remove_cgroup(&self.cgroup, &self.cgroup_root) {
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
fn remove_cgroup(cg: &Path, root: &Path) -> anyhow::Result<()> {
    for entry in fs::read_dir(cg).with_context(|| format!("read {}", cg.display()))? {
        let entry = entry?;
        if entry.file_type()?.is_dir() {
            remove_cgroup(&entry.path(), root)?;
        }
    }
    let root_procs = root.join("cgroup.procs");
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addressing() {
        let root = Path::new("/sys/fs/cgroup/unified");
        let tb = Testbed::named("abc123", 2, root);
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
        let last = Testbed::named("abc123", MAX_BACKENDS, root);
        let last = last.backends.last().unwrap();
        assert!(last.node_if.len() <= 15);
        assert_eq!(last.ipv6, "2001:db8:0:255::2".parse::<Ipv6Addr>().unwrap());
        assert_eq!(new_id().len(), 6);
    }
}
