//! `cargo xtask test --kernel`: the kernel-dependent suites (BPF_PROG_TEST_RUN datapath, netns
//! end to end, trace, north-south) on other kernels, each in a virtme-ng VM under QEMU's
//! software emulation, and natively on the host kernel.
//!
//! The guest shares the host's root filesystem read-only, so it runs the very test executables
//! cargo built here; this xtask binary runs inside it too (`vm-guest`), to load the modules,
//! mount bpffs and run the suites in few long-lived processes (each process start costs 40–80×
//! more under emulation). Results come back as JSON through a read-write directory.
use std::{
    fs,
    io::{BufRead as _, BufReader, Write as _},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::mpsc,
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail, ensure};
use serde::{Deserialize, Serialize};

use crate::{
    process::{cargo, display, workspace_root},
    setup::vm::{self, Kernel, VmTools},
};

/// The suites that depend on the kernel (the others test userspace only).
pub const SUITES: [&str; 4] = ["datapath", "netns", "trace", "northsouth"];

/// Longest a VM may run before it is killed and its kernel reported failed.
const VM_TIMEOUT: Duration = Duration::from_secs(60 * 60);

/// Drivers the guest's udev would otherwise spend up to 30 s probing.
const BOOT_APPEND: &str = "module_blacklist=kvm,kvm_amd,kvm_intel,ahci,libahci,floppy,\
                           parport_pc,pcspkr,snd_pcsp,i2c_piix4,psmouse,serio_raw";

/// Modules the suites need where the kernel builds them as modules (Debian does).
const GUEST_MODULES: [&str; 5] = ["veth", "sch_ingress", "cls_bpf", "sctp", "ipv6"];

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SuiteResult {
    pub suite: String,
    pub passed: u32,
    pub failed: u32,
    pub ignored: u32,
    pub secs: f64,
    /// The executable exited 0 and printed a summary.
    pub ok: bool,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct KernelResult {
    /// `host`, or the `--kernel` name.
    pub kernel: String,
    /// `uname -r` where the suites ran.
    pub release: String,
    /// `lb features --json`: what lb found and chose on this kernel.
    pub features: serde_json::Value,
    pub suites: Vec<SuiteResult>,
    /// Wall time, boot included.
    pub secs: f64,
}

impl KernelResult {
    pub fn ok(&self) -> bool {
        self.suites.len() == SUITES.len() && self.suites.iter().all(|s| s.ok)
    }
}

/// What `--kernel` asked for.
pub enum Selection {
    /// No name: list the kernels.
    List,
    /// `all`: the host and every VM kernel.
    All,
    /// One or more names (comma-separated); `host` is the native run.
    Some(Vec<String>),
}

impl Selection {
    pub fn parse(arg: &str) -> Result<Self> {
        match arg {
            "" => Ok(Self::List),
            "all" => Ok(Self::All),
            names => {
                let names: Vec<String> = names.split(',').map(str::to_owned).collect();
                for n in &names {
                    ensure!(
                        n == "host" || vm::KERNELS.iter().any(|k| k.name == n),
                        "unknown kernel `{n}`; `cargo xtask test --kernel` lists them"
                    );
                }
                Ok(Self::Some(names))
            }
        }
    }
}

/// `cargo xtask test --kernel` without a name.
pub fn list() {
    println!("kernels for `cargo xtask test --kernel NAME|all`:");
    let host = fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    println!("  {:<7} native, {}", "host", host.trim());
    for k in &vm::KERNELS {
        match vm::downloaded(k.name) {
            Some(d) => println!("  {:<7} {} (downloaded)", k.name, d.package),
            None => println!(
                "  {:<7} newest Debian package of its line (downloaded on first use)",
                k.name
            ),
        }
    }
}

/// The suites' test executables, built (cargo's JSON names them).
pub fn suite_binaries() -> Result<Vec<(String, PathBuf)>> {
    let mut cmd = cargo();
    cmd.args([
        "test",
        "-p",
        "lb-tests",
        "--no-run",
        "--message-format=json",
    ]);
    for s in SUITES {
        cmd.args(["--test", s]);
    }
    println!("$ {}", display(&cmd));
    let out = cmd.stderr(Stdio::inherit()).output()?;
    ensure!(
        out.status.success(),
        "building the suites failed ({})",
        out.status
    );
    let mut bins = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let name = msg["target"]["name"].as_str().unwrap_or_default();
        if let Some(exe) = msg["executable"].as_str()
            && msg["profile"]["test"].as_bool() == Some(true)
            && SUITES.contains(&name)
        {
            bins.push((name.to_owned(), PathBuf::from(exe)));
        }
    }
    bins.sort_by_key(|(n, _)| SUITES.iter().position(|s| s == n));
    ensure!(
        bins.len() == SUITES.len(),
        "cargo built {} of the {} suites",
        bins.len(),
        SUITES.len()
    );
    Ok(bins)
}

fn out_dir(kernel: &str) -> Result<PathBuf> {
    let dir = workspace_root().join("target/kernel-matrix").join(kernel);
    if dir.exists() {
        fs::remove_dir_all(&dir)?;
    }
    fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// Runs the suites natively (`host`).
pub fn run_host(bins: &[(String, PathBuf)], test_args: &[String]) -> Result<KernelResult> {
    let out = out_dir("host")?;
    let start = Instant::now();
    let mut r = run_suites(&out, bins, 1, test_args)?;
    r.kernel = "host".into();
    r.secs = start.elapsed().as_secs_f64();
    Ok(r)
}

/// Boots `kernel` and runs the suites in it.
pub fn run_vm(
    tools: &VmTools,
    kernel: &Kernel,
    bins: &[(String, PathBuf)],
    test_args: &[String],
) -> Result<KernelResult> {
    let out = out_dir(kernel.name)?;
    // `cargo build --bins` may have replaced this executable since it started (the kernel then
    // names it "… (deleted)"); the path holds the rebuilt one, from the same sources.
    let exe = std::env::current_exe().context("locating xtask")?;
    let xtask = PathBuf::from(
        exe.to_string_lossy()
            .trim_end_matches(" (deleted)")
            .to_owned(),
    );
    let mut cmd = Command::new(&tools.vng);
    cmd.arg("--run")
        .arg(&kernel.vmlinuz)
        // /dev/kvm here is a paravirtual KVM that cannot run stock kernels.
        .arg("--disable-kvm")
        .args(["--cpus", "2", "--memory", "4G"])
        .arg(format!("--rwdir={}", out.display()))
        .arg(format!(
            "--cwd={}",
            workspace_root().join("tests").display()
        ))
        .args(["--append", BOOT_APPEND])
        .arg("--")
        .arg(&xtask)
        .arg("vm-guest")
        .arg("--out")
        .arg(&out);
    for a in test_args {
        cmd.arg(format!("--test-arg={a}"));
    }
    for (name, exe) in bins {
        cmd.arg(format!("{name}={}", exe.display()));
    }
    cmd.env("PATH", &tools.path)
        .current_dir(workspace_root().join("tests"))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    println!("kernel {}: booting {}", kernel.name, kernel.package);
    println!("$ {}", display(&cmd));
    let start = Instant::now();
    let mut child = cmd.spawn().context("starting vng")?;
    // QEMU reopens fds 1 and 2, so its output is read through pipes (a file redirect loses
    // it), echoed and kept in console.log.
    let (tx, rx) = mpsc::channel::<String>();
    for pipe in [
        child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn std::io::Read + Send>),
        child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn std::io::Read + Send>),
    ]
    .into_iter()
    .flatten()
    {
        let tx = tx.clone();
        thread::spawn(move || {
            for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
    }
    drop(tx);
    let mut console = fs::File::create(out.join("console.log"))?;
    let status = loop {
        match rx.recv_timeout(Duration::from_secs(1)) {
            Ok(line) => {
                println!("  [{}] {line}", kernel.name);
                writeln!(console, "{line}")?;
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => break child.wait()?,
        }
        if let Some(status) = child.try_wait()? {
            // Drain what is left.
            for line in rx.try_iter() {
                println!("  [{}] {line}", kernel.name);
                writeln!(console, "{line}")?;
            }
            break status;
        }
        if start.elapsed() > VM_TIMEOUT {
            let _ = child.kill();
            let _ = child.wait();
            bail!(
                "kernel {}: the VM ran longer than {} min and was killed (console: {})",
                kernel.name,
                VM_TIMEOUT.as_secs() / 60,
                out.join("console.log").display()
            );
        }
    };
    let result = out.join("result.json");
    let text = fs::read_to_string(&result).with_context(|| {
        format!(
            "kernel {}: the VM ({status}) wrote no {} (console: {})",
            kernel.name,
            result.display(),
            out.join("console.log").display()
        )
    })?;
    let mut r: KernelResult = serde_json::from_str(&text)?;
    r.kernel = kernel.name.into();
    r.secs = start.elapsed().as_secs_f64();
    Ok(r)
}

/// `xtask vm-guest`: runs inside the VM.
pub fn guest(out: &Path, suites: &[String], test_args: &[String]) -> Result<()> {
    let bins = suites
        .iter()
        .map(|s| {
            let (name, path) = s.split_once('=').context("suite must be NAME=PATH")?;
            Ok((name.to_owned(), PathBuf::from(path)))
        })
        .collect::<Result<Vec<_>>>()?;
    let mounts = fs::read_to_string("/proc/mounts").unwrap_or_default();
    if !mounts
        .lines()
        .any(|l| l.split_whitespace().nth(1) == Some("/sys/fs/bpf"))
    {
        let st = Command::new("mount")
            .args(["-t", "bpf", "bpf", "/sys/fs/bpf"])
            .status()?;
        ensure!(st.success(), "mounting bpffs failed ({st})");
    }
    // Built in on some kernels: a module that is missing is only reported.
    let st = Command::new("modprobe")
        .arg("-a")
        .args(GUEST_MODULES)
        .status()?;
    if !st.success() {
        println!("modprobe -a {} failed ({st})", GUEST_MODULES.join(" "));
    }
    // Emulated: waits for lb to start scale with this (tests/src/daemon.rs `slowdown`).
    let r = run_suites(out, &bins, 3, test_args)?;
    fs::write(out.join("result.json"), serde_json::to_string_pretty(&r)?)?;
    Ok(())
}

/// Runs each suite's executable (from the tests' package directory, as cargo does) with its
/// output in `out/<suite>.log`; `slowdown` scales the tests' waits for lb to start;
/// `test_args` go to each executable (test name filters, `--exact`, ...).
fn run_suites(
    out: &Path,
    bins: &[(String, PathBuf)],
    slowdown: u32,
    test_args: &[String],
) -> Result<KernelResult> {
    let release = fs::read_to_string("/proc/sys/kernel/osrelease")
        .unwrap_or_default()
        .trim()
        .to_owned();
    let lb = bins
        .first()
        .and_then(|(_, exe)| Some(exe.parent()?.parent()?.join("lb")))
        .context("no suites")?;
    let features = Command::new(&lb)
        .args(["features", "--json"])
        .stderr(Stdio::inherit())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| serde_json::from_slice(&o.stdout).ok())
        .unwrap_or(serde_json::Value::Null);
    println!("kernel {release}: lb features {features}");
    let mut suites = Vec::new();
    for (name, exe) in bins {
        let log = out.join(format!("{name}.log"));
        let file = fs::File::create(&log)?;
        let start = Instant::now();
        let status = Command::new(exe)
            .arg("--test-threads=2")
            // Passing tests' output too: the measurements they print (the UDP re-steering loss
            // window) land in the suite's log.
            .arg("--show-output")
            .args(test_args)
            .env("LB_TEST_SLOWDOWN", slowdown.to_string())
            .current_dir(workspace_root().join("tests"))
            .stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file)
            .status()
            .with_context(|| format!("running {}", exe.display()))?;
        let secs = start.elapsed().as_secs_f64();
        let text = fs::read_to_string(&log)?;
        let (passed, failed, ignored) = summary(&text).unwrap_or((0, 0, 0));
        let r = SuiteResult {
            suite: name.clone(),
            passed,
            failed,
            ignored,
            secs,
            ok: status.success() && summary(&text).is_some(),
        };
        println!(
            "suite {name}: {} ({passed} passed, {failed} failed, {ignored} ignored) in {secs:.0} s",
            if r.ok { "ok" } else { "FAILED" }
        );
        if !r.ok {
            // The failures' own output, so a CI log shows why.
            for line in text
                .lines()
                .filter(|l| {
                    l.starts_with("test ") && l.ends_with("FAILED") || l.contains("panicked")
                })
                .take(20)
            {
                println!("  {line}");
            }
        }
        suites.push(r);
    }
    Ok(KernelResult {
        kernel: String::new(),
        release,
        features,
        suites,
        secs: 0.0,
    })
}

/// libtest's `test result: ok. 49 passed; 0 failed; 2 ignored; …`.
fn summary(text: &str) -> Option<(u32, u32, u32)> {
    let line = text.lines().rev().find(|l| l.starts_with("test result:"))?;
    let count = |what: &str| -> Option<u32> {
        line.split(';')
            .find_map(|part| part.trim().strip_suffix(what))?
            .split_whitespace()
            .last()?
            .parse()
            .ok()
    };
    Some((count(" passed")?, count(" failed")?, count(" ignored")?))
}

const TABLE_BEGIN: &str =
    "<!-- kernel-matrix:begin (written by `cargo xtask test --kernel all`) -->";
const TABLE_END: &str = "<!-- kernel-matrix:end -->";

/// The kernel table of docs/datapath.md: kernel × suite, and what lb chose on each kernel.
pub fn table(results: &[KernelResult]) -> String {
    let mut t = String::new();
    t.push_str("| kernel | release |");
    for s in SUITES {
        t.push_str(&format!(" {s} |"));
    }
    t.push_str(" missing features (fallbacks) | wall time |\n|---|---|");
    for _ in SUITES {
        t.push_str("---|");
    }
    t.push_str("---|---|\n");
    for r in results {
        t.push_str(&format!("| {} | {} |", r.kernel, r.release));
        for s in SUITES {
            let cell = match r.suites.iter().find(|x| x.suite == s) {
                Some(x) if x.ok => format!("passed ({}, {:.0} s)", x.passed, x.secs),
                Some(x) => format!("**failed** ({} of {})", x.failed, x.passed + x.failed),
                None => "not run".into(),
            };
            t.push_str(&format!(" {cell} |"));
        }
        t.push_str(&format!(
            " {} | {:.0} s |\n",
            fallbacks(&r.features),
            r.secs
        ));
    }
    t
}

/// The features `lb features` found missing (each selects the fallback docs/datapath.md's feature
/// table names), joined; `none` when everything runs the preferred way.
fn fallbacks(features: &serde_json::Value) -> String {
    let Some(list) = features["features"].as_array() else {
        return "unknown (`lb features` failed)".into();
    };
    let missing: Vec<&str> = list
        .iter()
        .filter(|f| f["available"].as_bool() == Some(false))
        .filter_map(|f| f["name"].as_str())
        .collect();
    if missing.is_empty() {
        "none".into()
    } else {
        format!("no {}", missing.join(", no "))
    }
}

/// Replaces the kernel table of docs/datapath.md (its "Kernels" section) with `table`.
pub fn write_kernel_table(table: &str) -> Result<()> {
    let path = workspace_root().join("docs/datapath.md");
    let doc = fs::read_to_string(&path)?;
    let (Some(b), Some(e)) = (doc.find(TABLE_BEGIN), doc.find(TABLE_END)) else {
        bail!("docs/datapath.md has no kernel-matrix markers");
    };
    let new = format!("{}{TABLE_BEGIN}\n{table}{}", &doc[..b], &doc[e..]);
    fs::write(&path, new)?;
    println!("wrote the kernel table into {}", path.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn libtest_summary_is_parsed() {
        let text = "running 3 tests\n\ntest result: FAILED. 2 passed; 1 failed; 4 ignored; 0 \
                    measured; 0 filtered out; finished in 1.00s\n";
        assert_eq!(summary(text), Some((2, 1, 4)));
        assert_eq!(summary("no summary"), None);
    }
}
