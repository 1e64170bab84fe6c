//! Running things inside network namespaces for the benchmarks: commands with their wall time
//! (entered with the testbed's [`Enter`]), scratch namespaces that are deleted on drop, and
//! temporary rule files.
use std::{
    fs,
    path::PathBuf,
    process::{Child, Command, Output, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use lb_tests::netns::{Enter, ip, ns_path};

/// A command started in a netns by [`spawn`].
pub struct Running {
    child: Child,
    shown: String,
    ns: String,
    start: Instant,
}

impl Running {
    /// Waits for the command; fails unless it exits successfully. Returns its output and wall
    /// time since it was started.
    pub fn wait(self) -> anyhow::Result<(Output, Duration)> {
        let out = self
            .child
            .wait_with_output()
            .with_context(|| format!("wait for {}", self.shown))?;
        let elapsed = self.start.elapsed();
        if !out.status.success() {
            let stderr = String::from_utf8_lossy(&out.stderr);
            let first: Vec<&str> = stderr.lines().take(5).collect();
            bail!(
                "{} in netns {}: {}: {}",
                self.shown,
                self.ns,
                out.status,
                first.join(" | ")
            );
        }
        Ok((out, elapsed))
    }
}

/// Starts `cmd` in netns `ns` (a name under /run/netns), stdout and stderr captured.
pub fn spawn(ns: &str, mut cmd: Command) -> anyhow::Result<Running> {
    let enter = Enter::open(ns, None)?;
    enter.install(&mut cmd);
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let shown = format!("{cmd:?}");
    let start = Instant::now();
    let child = cmd
        .spawn()
        .with_context(|| format!("run {shown} in netns {ns}"))?;
    // The child has its own copy of the fd now.
    drop(enter);
    Ok(Running {
        child,
        shown,
        ns: ns.to_owned(),
        start,
    })
}

/// Waits for all `commands` at once, so that each one's wall time ends when it exits.
pub fn wait_all(commands: Vec<Running>) -> anyhow::Result<Vec<(Output, Duration)>> {
    thread::scope(|s| {
        let waiting: Vec<_> = commands
            .into_iter()
            .map(|running| s.spawn(move || running.wait()))
            .collect();
        waiting
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("waiting thread panicked")))
            })
            .collect()
    })
}

/// Runs `cmd` to completion in netns `ns` and returns its output and wall time. Fails unless
/// it exits successfully.
pub fn run(ns: &str, cmd: Command) -> anyhow::Result<(Output, Duration)> {
    spawn(ns, cmd)?.wait()
}

/// An empty network namespace (loopback up) for rule-loading measurements; deleted on drop.
pub struct Scratch {
    pub name: String,
}

impl Scratch {
    pub fn new(tag: &str) -> anyhow::Result<Self> {
        for attempt in 0..16u32 {
            let name = format!("lb-bench-{}-{tag}-{attempt}", std::process::id());
            if ns_path(&name).exists() {
                continue;
            }
            ip(&["netns", "add", &name])?;
            let scratch = Self { name };
            ip(&["-n", &scratch.name, "link", "set", "lo", "up"])?;
            return Ok(scratch);
        }
        bail!("no free scratch netns name for {tag}")
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if let Err(e) = ip(&["netns", "del", &self.name]) {
            eprintln!("lb-bench: {e:#}");
        }
    }
}

/// A private temporary directory for rule files, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> anyhow::Result<Self> {
        let dir = std::env::temp_dir().join(format!("lb-bench-{}-{tag}", std::process::id()));
        fs::create_dir_all(&dir).with_context(|| format!("mkdir {}", dir.display()))?;
        Ok(Self(dir))
    }

    /// Writes `text` to `name` in the directory and returns the path.
    pub fn write(&self, name: &str, text: &str) -> anyhow::Result<PathBuf> {
        let path = self.0.join(name);
        fs::write(&path, text).with_context(|| format!("write {}", path.display()))?;
        Ok(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}
