//! `cargo xtask setup`: makes a fresh Debian 12 machine ready to build and test lb.
//!
//! Every step checks before it acts, so on a ready machine this is a sub-second no-op.
//! Background: /work/shared/notes/toolchain.md (rustup's toolchains have no rust-src here, so
//! the eBPF crate is built by Debian's rustc, and bpf-linker must use the same LLVM).

mod kube;
pub mod nodes;
pub mod vm;

use std::{
    fs,
    io::{self, BufRead as _, BufReader, Write as _},
    os::unix::fs::MetadataExt as _,
    path::Path,
    process::{Command, Stdio},
    thread,
    time::Duration,
};

use anyhow::{Context as _, Result, bail, ensure};

use crate::process::{display, probe, run, workspace_root};

/// LLVM major version of Debian's rustc-web; bpf-linker is built against the same one.
const LLVM_MAJOR: u32 = 22;
const BPF_LINKER_VERSION: &str = "0.13.0";
const DEBIAN_RUSTC: &str = "/usr/bin/rustc";
const DEBIAN_CARGO: &str = "/usr/bin/cargo";
/// Where build-std looks for `core`'s source when building with Debian's rustc.
const RUST_SRC_CORE: &str = "/usr/lib/rustlib/src/rust/library/core";
/// Must match the toolchain lb-userspace/build.rs hands to aya-build.
const RUSTUP_TOOLCHAIN: &str = "lb-debian";
const BPFFS: &str = "/sys/fs/bpf";

/// What building lb and running it need (every task).
pub fn setup() -> Result<()> {
    let root = is_root()?;
    if !root {
        println!("warning: not root; setup can check but not install packages or mount bpffs");
    }
    let wanted = packages();
    ensure_packages(&wanted.iter().map(String::as_str).collect::<Vec<_>>())?;
    debian_rustc()?;
    rust_src()?;
    bpf_linker()?;
    rustup_toolchain()?;
    bpffs(root)
}

/// `setup`, plus the real Kubernetes control plane the tests run against. Kept out of the other
/// tasks: the control plane is a long Go build that lint and bench never use. (The image test
/// needs no container engine: xtask writes the image's OCI archive itself.)
pub fn setup_for_tests() -> Result<()> {
    setup()?;
    kube::kube_tools()
}

/// `setup`, plus what `cargo xtask e2e` runs: the control plane, the node tools (containerd,
/// kubelet, kube-proxy, CoreDNS, runc, the CNI plugins), `e2e.test` and the host packages its
/// images copy their userland from.
pub fn setup_for_e2e() -> Result<()> {
    setup()?;
    ensure_packages(crate::images::DEBIAN_PACKAGES)?;
    kube::kube_tools()?;
    nodes::node_tools()
}

/// `setup`, plus the control plane `cargo xtask demo --kubernetes` runs lb against.
pub fn setup_for_demo_kubernetes() -> Result<()> {
    setup()?;
    kube::kube_tools()
}

/// Whether this process runs with effective uid 0.
pub fn is_root() -> Result<bool> {
    let status = fs::read_to_string("/proc/self/status").context("reading /proc/self/status")?;
    // "Uid:\treal\teffective\tsaved\tfs"
    let euid = status
        .lines()
        .find_map(|line| line.strip_prefix("Uid:"))
        .and_then(|uids| uids.split_whitespace().nth(1))
        .context("no Uid line in /proc/self/status")?;
    Ok(euid == "0")
}

fn packages() -> Vec<String> {
    [
        // eBPF toolchain: rustc/cargo on LLVM 22 with their std source (for build-std), and
        // LLVM's libraries for bpf-linker.
        "rustc-web".to_owned(),
        "cargo-web".to_owned(),
        "rust-web-src".to_owned(),
        format!("llvm-{LLVM_MAJOR}-dev"),
        // Runtime tools the tests and the demo call.
        "iproute2".to_owned(),
        "bpftool".to_owned(),
        "util-linux".to_owned(),
        // Certificates and keys of the tests' Kubernetes control plane.
        "openssl".to_owned(),
        // kube-proxy's rule layouts, for the benchmark and its quick test.
        "iptables".to_owned(),
        "nftables".to_owned(),
    ]
    .into()
}

/// Installs the Debian packages of `wanted` that are missing.
fn ensure_packages(wanted: &[&str]) -> Result<()> {
    let wanted: Vec<String> = wanted.iter().map(|p| (*p).to_owned()).collect();
    let missing = missing_packages(&wanted)?;
    if missing.is_empty() {
        println!("ok: Debian packages installed: {}", wanted.join(" "));
        return Ok(());
    }
    ensure!(
        is_root()?,
        "missing Debian packages: {}; run `cargo xtask setup` as root to install them",
        missing.join(" ")
    );
    println!("installing: Debian packages {}", missing.join(" "));
    apt_get(&["update"])?;
    apt_get(
        &["install", "-y", "--no-install-recommends"]
            .into_iter()
            .chain(missing.iter().map(String::as_str))
            .collect::<Vec<_>>(),
    )?;
    let still_missing = missing_packages(&wanted)?;
    ensure!(
        still_missing.is_empty(),
        "apt-get install succeeded but these packages are still not installed: {}",
        still_missing.join(" ")
    );
    Ok(())
}

fn missing_packages(wanted: &[String]) -> Result<Vec<String>> {
    // One query for all packages; dpkg-query exits 1 when it knows none of some of them, so
    // its status is ignored and only the "installed" lines count.
    let output = Command::new("dpkg-query")
        .args(["-W", "-f=${Package} ${Status}\\n"])
        .args(wanted)
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .context("could not run dpkg-query (is this Debian?)")?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let installed: Vec<&str> = stdout
        .lines()
        .filter_map(|line| line.strip_suffix(" install ok installed"))
        .collect();
    Ok(wanted
        .iter()
        .filter(|package| !installed.contains(&package.as_str()))
        .cloned()
        .collect())
}

/// Runs apt-get, retrying while another process (e.g. unattended-upgrades) holds apt's lock.
fn apt_get(args: &[&str]) -> Result<()> {
    const ATTEMPTS: u32 = 10;
    const WAIT: Duration = Duration::from_secs(5);

    let mut cmd = Command::new("apt-get");
    cmd.args(args)
        .env("DEBIAN_FRONTEND", "noninteractive")
        .stdin(Stdio::null())
        .stderr(Stdio::piped());
    let shown = display(&cmd);
    for attempt in 1..=ATTEMPTS {
        println!("$ {shown}");
        let mut child = cmd
            .spawn()
            .with_context(|| format!("could not start `{shown}`"))?;
        // Stream stderr while keeping it, to tell a busy lock from a real failure.
        let mut errors = Vec::new();
        let mut line = Vec::new();
        let mut reader = BufReader::new(child.stderr.take().context("apt-get stderr")?);
        while reader.read_until(b'\n', &mut line)? > 0 {
            io::stderr().write_all(&line)?;
            errors.append(&mut line);
        }
        let status = child.wait()?;
        if status.success() {
            return Ok(());
        }
        let locked = status.code() == Some(100)
            && String::from_utf8_lossy(&errors).contains("Could not get lock");
        ensure!(locked, "`{shown}` failed ({status})");
        if attempt < ATTEMPTS {
            println!(
                "apt's lock is held by another process; retrying in {} s ({attempt}/{ATTEMPTS})",
                WAIT.as_secs()
            );
            thread::sleep(WAIT);
        }
    }
    bail!("`{shown}` failed: apt's lock was still held by another process after {ATTEMPTS} tries")
}

fn debian_rustc() -> Result<()> {
    let info = probe(Command::new(DEBIAN_RUSTC).arg("-vV"))?;
    let llvm = info
        .lines()
        .find(|line| line.starts_with("LLVM version:"))
        .unwrap_or("no LLVM version line");
    if !llvm.starts_with(&format!("LLVM version: {LLVM_MAJOR}.")) {
        bail!(
            "{DEBIAN_RUSTC} reports `{llvm}`, expected LLVM {LLVM_MAJOR}: a Debian update \
             probably moved rustc-web to another LLVM. bpf-linker must be built against the \
             same LLVM: update LLVM_MAJOR in xtask/src/setup.rs (llvm-N-dev, bpf-linker's \
             llvm-N feature) and remove target/tools/bin/bpf-linker"
        );
    }
    let version = info.lines().next().unwrap_or_default();
    println!("ok: {DEBIAN_RUSTC} is {version}, {llvm}");
    Ok(())
}

fn rust_src() -> Result<()> {
    ensure!(
        Path::new(RUST_SRC_CORE).is_dir(),
        "{RUST_SRC_CORE} is missing although rust-web-src is installed; \
         build-std needs it to build `core` for the BPF target"
    );
    println!("ok: Rust std source at {RUST_SRC_CORE}");
    Ok(())
}

fn bpf_linker() -> Result<()> {
    // Cached under target/ so it is built once per machine (~100 s) and `cargo clean` resets it.
    let tools = workspace_root().join("target/tools");
    let linker = tools.join("bin/bpf-linker");
    if has_version(&linker, BPF_LINKER_VERSION) {
        return Ok(());
    }
    println!(
        "installing: bpf-linker {BPF_LINKER_VERSION} for LLVM {LLVM_MAJOR} into {} (~100 s)",
        tools.display()
    );
    run(Command::new(DEBIAN_CARGO)
        .args(["install", "--locked", "--root"])
        .arg(&tools)
        .arg(format!("bpf-linker@{BPF_LINKER_VERSION}"))
        .args(["--no-default-features", "--features"])
        .arg(format!("llvm-{LLVM_MAJOR}"))
        .env("LLVM_PREFIX", format!("/usr/lib/llvm-{LLVM_MAJOR}"))
        // Debian's rustc, not whichever rustup proxy comes first on PATH.
        .env("RUSTC", DEBIAN_RUSTC)
        // Outside the workspace, so its .cargo/config.toml does not apply.
        .current_dir("/"))
}

/// Whether `bin --version` names `version`; prints the `ok:` line when it does.
fn has_version(bin: &Path, version: &str) -> bool {
    match probe(Command::new(bin).arg("--version")) {
        Ok(v) if v.contains(version) => {
            println!("ok: {} is {}", bin.display(), v.trim());
            true
        }
        _ => false,
    }
}

fn rustup_toolchain() -> Result<()> {
    let list = match Command::new("rustup").args(["toolchain", "list"]).output() {
        Err(err) if err.kind() == io::ErrorKind::NotFound => {
            println!("ok: rustup is not on PATH, no {RUSTUP_TOOLCHAIN} toolchain link needed");
            return Ok(());
        }
        result => result.context("could not run `rustup toolchain list`")?,
    };
    ensure!(
        list.status.success(),
        "`rustup toolchain list` failed ({})",
        list.status
    );
    let linked = String::from_utf8_lossy(&list.stdout)
        .lines()
        .any(|line| line.split_whitespace().next() == Some(RUSTUP_TOOLCHAIN));
    if linked {
        println!("ok: rustup toolchain {RUSTUP_TOOLCHAIN} exists");
        return Ok(());
    }
    println!("installing: rustup toolchain {RUSTUP_TOOLCHAIN} linked to /usr (Debian's rustc)");
    run(Command::new("rustup").args(["toolchain", "link", RUSTUP_TOOLCHAIN, "/usr"]))
}

fn bpffs(root: bool) -> Result<()> {
    let path = Path::new(BPFFS);
    // A mount point sits on another device than its parent directory.
    let device = |path: &Path| {
        fs::metadata(path)
            .map(|meta| meta.dev())
            .with_context(|| format!("stat {}", path.display()))
    };
    if device(path)? != device(path.parent().context("/sys/fs")?)? {
        println!("ok: bpffs mounted at {BPFFS}");
        return Ok(());
    }
    if !root {
        println!("warning: bpffs is not mounted at {BPFFS}; run `cargo xtask setup` as root");
        return Ok(());
    }
    println!("installing: mounting bpffs at {BPFFS}");
    run(Command::new("mount").args(["-t", "bpf", "bpf", BPFFS]))
}
