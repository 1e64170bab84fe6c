//! [`LbDaemon`]: `lb run` inside a testbed's node netns, the one harness the integration tests
//! and lb-demo start lb with.
use std::{
    collections::{BTreeMap, BTreeSet},
    fs::{self, File},
    io::{BufRead as _, BufReader, Write as _},
    path::{Path, PathBuf},
    process::{Child, ChildStderr, Command, ExitStatus, Stdio},
    sync::{
        atomic::{AtomicBool, Ordering},
        mpsc,
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use lb::{
    datapath::maps::{BpfMaps, Dump, LbMaps as _},
    model::Frontend,
};

use crate::testbed::Testbed;

/// How long [`LbDaemon`] waits for a log line, times [`slowdown`].
pub const LB_LOG_TIMEOUT: Duration = Duration::from_secs(20);

/// `LB_TEST_SLOWDOWN` (default 1): how many times slower than native the tests run. The
/// kernel-matrix VMs set it, since QEMU's software emulation starts processes 40–80× and
/// runs code about 12× slower; only waits for lb to come up scale with it, never an assertion
/// about the datapath.
pub fn slowdown() -> u32 {
    std::env::var("LB_TEST_SLOWDOWN")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|n| *n >= 1)
        .unwrap_or(1)
}
/// The conntrack sizes [`LbDaemon::spawn`] gives lb (a few MiB instead of ~180).
pub const TEST_CT_MAX: [&str; 2] = [
    "--bpf-ct-global-tcp-max=16384",
    "--bpf-ct-global-any-max=16384",
];
/// How long lb may take to exit after SIGTERM before it is killed.
const STOP_TIMEOUT: Duration = Duration::from_secs(5);
/// How often a wait looks at lb's exit and the interrupt flag.
const POLL: Duration = Duration::from_millis(100);

/// How [`LbDaemon::spawn_with`] starts lb.
#[derive(Debug)]
pub struct LbOptions {
    /// `--pin-dir`.
    pub pin_dir: PathBuf,
    /// `--state-dir`.
    pub state_dir: PathBuf,
    /// `RUST_LOG`.
    pub rust_log: String,
    /// Also append every log line to this file (from the reader thread, so a line is kept even
    /// if nobody waits for it).
    pub log_file: Option<File>,
    /// Called on the waiting thread with each log line as it is received (lb-demo prints them).
    pub on_line: Option<fn(&str)>,
    /// Waits fail with "interrupted; cleaning up" once this is set (lb-demo's SIGINT handler).
    pub interrupted: Option<&'static AtomicBool>,
    /// Extra environment variables for lb.
    pub env: Vec<(String, String)>,
}

impl LbOptions {
    /// Pin dir `/sys/fs/bpf/lb-test-<id>` and state dir `$TMPDIR/lb-test-state-<id>`.
    pub fn for_testbed(tb: &Testbed, rust_log: &str) -> Self {
        Self {
            pin_dir: PathBuf::from(format!("/sys/fs/bpf/lb-test-{}", tb.id)),
            state_dir: std::env::temp_dir().join(format!("lb-test-state-{}", tb.id)),
            rust_log: rust_log.to_owned(),
            log_file: None,
            on_line: None,
            interrupted: None,
            env: Vec::new(),
        }
    }
}

/// `lb run` inside a testbed's node netns with a pin dir and a state dir of its own, its log
/// (stderr) collected line by line. Dropping it stops lb (SIGTERM, then SIGKILL) and removes
/// both directories unless [`LbDaemon::keep_dirs`] was called.
pub struct LbDaemon {
    child: Child,
    lines: mpsc::Receiver<String>,
    reader: Option<thread::JoinHandle<()>>,
    /// Every log line received so far.
    pub log: Vec<String>,
    pub pin_dir: PathBuf,
    pub state_dir: PathBuf,
    keep_dirs: bool,
    on_line: Option<fn(&str)>,
    interrupted: Option<&'static AtomicBool>,
}

impl LbDaemon {
    /// Starts `lb run ARGS --pin-dir … --state-dir …` (`lb` is the binary) in `tb`'s node netns
    /// with [`LbOptions::for_testbed`], without waiting for it. Unless ARGS size them, the
    /// conntrack maps get [`TEST_CT_MAX`] entries: at the defaults (Cilium's) they take about
    /// 180 MiB of kernel memory per lb, and tests run several at once.
    pub fn spawn(
        tb: &mut Testbed,
        lb: &Path,
        args: &[&str],
        rust_log: &str,
    ) -> anyhow::Result<Self> {
        let opts = LbOptions::for_testbed(tb, rust_log);
        let mut args: Vec<&str> = args.to_vec();
        if !args.iter().any(|a| a.starts_with("--bpf-ct-global-")) {
            args.extend(TEST_CT_MAX);
        }
        Self::spawn_with(tb, lb, &args, opts)
    }

    /// The arguments [`LbDaemon::spawn_with`] gives lb, for showing the command line.
    pub fn command_args(args: &[&str], opts: &LbOptions) -> Vec<String> {
        let mut out = vec!["run".to_owned()];
        out.extend(args.iter().map(|a| (*a).to_owned()));
        out.extend([
            "--pin-dir".to_owned(),
            opts.pin_dir.display().to_string(),
            "--state-dir".to_owned(),
            opts.state_dir.display().to_string(),
        ]);
        out
    }

    /// Starts `lb run ARGS --pin-dir … --state-dir …` in `tb`'s node netns as `opts` says,
    /// without waiting for it. Proxy variables are removed: lb talks to loopback only here.
    pub fn spawn_with(
        tb: &mut Testbed,
        lb: &Path,
        args: &[&str],
        opts: LbOptions,
    ) -> anyhow::Result<Self> {
        let mut cmd = Command::new(lb);
        cmd.arg("run")
            .args(args)
            .arg("--pin-dir")
            .arg(&opts.pin_dir)
            .arg("--state-dir")
            .arg(&opts.state_dir)
            .env("RUST_LOG", &opts.rust_log)
            .env("NO_COLOR", "1")
            .envs(opts.env.iter().map(|(k, v)| (k, v)))
            .env_remove("HTTPS_PROXY")
            .env_remove("https_proxy")
            .env_remove("KUBECONFIG")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let node_ns = tb.node_ns.clone();
        let mut child = tb
            .spawn(&node_ns, None, cmd)
            .context("starting lb in the node netns")?;
        let stderr = child.stderr.take().context("lb's stderr")?;
        let (tx, lines) = mpsc::channel();
        let log_file = opts.log_file;
        let reader = thread::Builder::new()
            .name("lb-log".into())
            .spawn(move || forward_log(stderr, log_file, &tx));
        let reader = match reader {
            Ok(r) => r,
            Err(err) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(err).context("spawn lb log reader");
            }
        };
        Ok(Self {
            child,
            lines,
            reader: Some(reader),
            log: Vec::new(),
            pin_dir: opts.pin_dir,
            state_dir: opts.state_dir,
            keep_dirs: false,
            on_line: opts.on_line,
            interrupted: opts.interrupted,
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
        daemon.wait_ready()?;
        Ok(daemon)
    }

    /// [`LbDaemon::start`] with the Kubernetes API source on the tc path: `lb run --kubeconfig
    /// KUBECONFIG --hostname-override NODE --socket-lb=false --tc-ingress <tb's node
    /// interfaces> EXTRA…`.
    pub fn start_kube(
        tb: &mut Testbed,
        kubeconfig: &Path,
        node: &str,
        extra: &[&str],
        rust_log: &str,
    ) -> anyhow::Result<Self> {
        let ifaces = tb.node_ifaces().join(",");
        let kubeconfig = kubeconfig.to_str().context("kubeconfig path not UTF-8")?;
        let mut args = vec![
            "--kubeconfig",
            kubeconfig,
            "--hostname-override",
            node,
            "--socket-lb=false",
            "--tc-ingress",
            &ifaces,
        ];
        args.extend_from_slice(extra);
        Self::start(tb, Path::new(crate::bins::LB), &args, rust_log)
    }

    /// lb's pinned maps as the reconciler reads them.
    pub fn dump(&self) -> anyhow::Result<Dump> {
        BpfMaps::open_pinned(&self.pin_dir)?.dump()
    }

    /// `frontend → backend addresses` as `lb services --json` shows lb's pinned maps (run in
    /// `tb`'s node netns); only the Services of `namespace` if given.
    pub fn services(&self, tb: &Testbed, namespace: Option<&str>) -> anyhow::Result<Services> {
        let mut cmd = Command::new(crate::bins::LB);
        cmd.args(["services", "--json", "--pin-dir"])
            .arg(&self.pin_dir)
            .arg("--state-dir")
            .arg(&self.state_dir);
        let out = tb.run(&tb.node_ns, None, cmd).context("lb services")?;
        if !out.status.success() {
            bail!("lb services: {}", String::from_utf8_lossy(&out.stderr));
        }
        let v: serde_json::Value =
            serde_json::from_slice(&out.stdout).context("lb services JSON")?;
        let text = |v: &serde_json::Value| v.as_str().unwrap_or_default().to_owned();
        let mut services = Services::new();
        for s in v.as_array().context("lb services: not an array")? {
            if namespace.is_some_and(|ns| s["service"]["namespace"] != ns) {
                continue;
            }
            let backends = s["backends"].as_array().context("lb services: backends")?;
            let backends = backends.iter().map(|b| text(&b["address"])).collect();
            services.insert(text(&s["frontend"]), backends);
        }
        Ok(services)
    }

    /// Packets (or calls) lb's datapath counted under `index` (a `lb_common::metrics` index),
    /// summed over CPUs, from its pinned `lb_metrics`.
    pub fn counter(&self, index: u32) -> anyhow::Result<u64> {
        let counters = lb::datapath::pinned::read_counters(&self.pin_dir)?;
        let i = usize::try_from(index)?;
        counters
            .get(i)
            .map(|c| c.packets)
            .with_context(|| format!("no datapath counter {index}"))
    }

    /// Waits until lb reports `ready` (programmed and attached).
    pub fn wait_ready(&mut self) -> anyhow::Result<()> {
        self.wait_for(|l| l.contains(" ready"), "ready").map(drop)
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
        let deadline = Instant::now() + LB_LOG_TIMEOUT * slowdown();
        while Instant::now() < deadline {
            if self.interrupted.is_some_and(|i| i.load(Ordering::SeqCst)) {
                bail!("interrupted; cleaning up");
            }
            match self.lines.recv_timeout(POLL) {
                Ok(line) => {
                    let hit = pred(&line);
                    self.push(line.clone());
                    if hit {
                        return Ok(line);
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    if let Ok(Some(status)) = self.child.try_wait() {
                        bail!("lb exited ({status}) before {what}{}", self.log_for_error());
                    }
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            }
        }
        bail!("no {what} from lb{}", self.log_for_error())
    }

    /// Takes the log lines that arrived meanwhile, without waiting.
    pub fn drain(&mut self) {
        while let Ok(line) = self.lines.try_recv() {
            self.push(line);
        }
    }

    fn push(&mut self, line: String) {
        if let Some(f) = self.on_line {
            f(&line);
        }
        self.log.push(line);
    }

    fn log_for_error(&self) -> String {
        if self.on_line.is_some() {
            " (its log is above)".to_owned()
        } else {
            format!(":\n{}", self.log.join("\n"))
        }
    }

    /// Sends `signal` to lb.
    pub fn signal(&self, signal: nix::sys::signal::Signal) -> anyhow::Result<()> {
        let pid = nix::unistd::Pid::from_raw(i32::try_from(self.child.id())?);
        nix::sys::signal::kill(pid, signal).context("kill")
    }

    /// Stops lb with SIGTERM (SIGKILL after 5 s), takes the rest of its log and returns how it
    /// exited.
    pub fn stop(&mut self) -> anyhow::Result<ExitStatus> {
        let status = self.terminate()?;
        // lb has exited, so its stderr is at EOF and the reader ends.
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
        self.drain();
        Ok(status)
    }

    fn terminate(&mut self) -> anyhow::Result<ExitStatus> {
        if let Some(status) = self.child.try_wait()? {
            return Ok(status);
        }
        // Not reaped yet (try_wait said so), so the pid is still this child's.
        self.signal(nix::sys::signal::Signal::SIGTERM)?;
        let deadline = Instant::now() + STOP_TIMEOUT;
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status);
            }
            thread::sleep(Duration::from_millis(20));
        }
        eprintln!("lb-testbed: lb did not exit within {STOP_TIMEOUT:?} of SIGTERM; killing it");
        self.child.kill()?;
        Ok(self.child.wait()?)
    }

    /// Leaves the pin and state directories behind on drop (a later lb reuses them).
    pub fn keep_dirs(&mut self) {
        self.keep_dirs = true;
    }
}

/// `frontend → backend addresses`, as [`LbDaemon::services`] reads them.
pub type Services = BTreeMap<String, BTreeSet<String>>;

/// [`Services`] of TCP frontends `ip:port` with backends `ip` on `backend_port`.
pub fn frontends(entries: &[(&str, &[&str])], backend_port: u16) -> Services {
    entries
        .iter()
        .map(|(fe, bs)| {
            let bs = bs.iter().map(|b| format!("{b}:{backend_port}")).collect();
            (format!("{fe}/TCP"), bs)
        })
        .collect()
}

/// Everything of `frontends` in `d`, one line each: masters and slots, and the rev-NAT entries
/// and backends they name (to compare a part of the maps before and after).
pub fn entries_of(d: &Dump, frontends: &BTreeSet<Frontend>) -> String {
    let mut out = String::new();
    for ((fe, slot), v) in &d.services {
        if !frontends.contains(fe) {
            continue;
        }
        out.push_str(&format!("{fe} slot {slot}: {v:?}\n"));
        if *slot == 0 {
            out.push_str(&format!("  revnat {:?}\n", d.revnat.get(&v.rev_nat_id)));
        } else {
            out.push_str(&format!("  backend {:?}\n", d.backends.get(&v.backend_id)));
        }
    }
    out
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

/// Copies lb's stderr, line by line and without ANSI escapes, to `log` and `tx` until EOF.
/// Invalid UTF-8 is replaced rather than ending the copy, so the pipe never fills up.
fn forward_log(stderr: ChildStderr, mut log: Option<File>, tx: &mpsc::Sender<String>) {
    let mut reader = BufReader::new(stderr);
    let mut buf = Vec::new();
    loop {
        buf.clear();
        match reader.read_until(b'\n', &mut buf) {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        let line = strip_ansi(String::from_utf8_lossy(&buf).trim_end());
        if let Some(f) = log.as_mut()
            && writeln!(f, "{line}").is_err()
        {
            log = None;
        }
        // The receiver may be gone (the harness is tearing down); keep draining the pipe.
        let _ = tx.send(line);
    }
}

/// Removes ANSI escape sequences (`ESC [ … final-byte`), in case lb colours its log anyway.
fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            if chars.next() == Some('[') {
                for c in chars.by_ref() {
                    if ('\u{40}'..='\u{7e}').contains(&c) {
                        break;
                    }
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}
