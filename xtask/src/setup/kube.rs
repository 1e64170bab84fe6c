//! The Kubernetes control plane the tests run against (tests/src/controlplane.rs):
//! `kube-apiserver`, `kube-controller-manager` and `kubectl` from `k8s.io/kubernetes`, and
//! `etcd` from `go.etcd.io/etcd/server/v3`, built with Go into `target/tools/bin` once per
//! checkout. Go is a build tool of the tests only; nothing of it ships in lb.
//!
//! `k8s.io/kubernetes` cannot be built as a dependency as is: its go.mod requires the staging
//! modules (`k8s.io/api`, `k8s.io/apiserver`, …) at `v0.0.0` and replaces them with
//! `./staging/…`, which a dependency's replaces do not do. So a scratch module in
//! `target/tools/kube-src` requires the release and replaces each staging module named in that
//! release's go.mod with its published `v0.<minor>.<patch>`. Downloads and compiled packages go
//! to Go's own caches (`go env GOMODCACHE GOCACHE`, outside the checkout), so a fresh clone on a
//! machine that built them before mostly relinks.
//! Background: /work/shared/notes/real-apiserver.md.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
    time::Instant,
};

use anyhow::{Context as _, Result, bail, ensure};

use crate::process::{probe, run, workspace_root};

/// The newest release the Go module proxy listed that builds here (all its dependencies are
/// served).
pub const KUBERNETES_VERSION: &str = "v1.37.2";
/// The etcd server that release's go.mod requires, so the four binaries come from one module
/// graph: no second download, and the apiserver keeps the etcd client it was released with.
const ETCD_VERSION: &str = "v3.7.0";
const MIN_GO_MINOR: u32 = 26;
/// The binaries, as `go build -o DIR/` names them (the last element of the package path).
const BINARIES: [&str; 4] = [
    "kube-apiserver",
    "kube-controller-manager",
    "kubectl",
    "etcd",
];
const STAMP: &str = "kube-tools.version";

pub fn kube_tools() -> Result<()> {
    let tools = workspace_root().join("target/tools");
    let bin = tools.join("bin");
    let stamp = format!("kubernetes {KUBERNETES_VERSION}\netcd {ETCD_VERSION}\n");
    let present = BINARIES.iter().all(|b| bin.join(b).is_file());
    if present && fs::read_to_string(bin.join(STAMP)).ok().as_deref() == Some(stamp.as_str()) {
        println!(
            "ok: kube-apiserver, kube-controller-manager, kubectl {KUBERNETES_VERSION} and \
             etcd {ETCD_VERSION} in {}",
            bin.display()
        );
        return Ok(());
    }
    let go = go_binary()?;
    println!(
        "installing: kube-apiserver, kube-controller-manager, kubectl {KUBERNETES_VERSION} and \
         etcd {ETCD_VERSION} into {} with {} (cold: ~100 MB of downloads, ~13 CPU minutes, \
         up to 2.5 GiB of memory)",
        bin.display(),
        go.display()
    );
    let start = Instant::now();
    let src = tools.join("kube-src");
    write_scratch_module(&go, &src)?;
    fs::create_dir_all(&bin).with_context(|| format!("creating {}", bin.display()))?;
    // A stale stamp must not survive a failed build.
    let _ = fs::remove_file(bin.join(STAMP));
    run(go_command(&go)
        .args(["build", "-ldflags", &ldflags(), "-o"])
        // A trailing slash makes `-o` a directory for several main packages.
        .arg(format!("{}/", bin.display()))
        .args([
            "k8s.io/kubernetes/cmd/kube-apiserver",
            "k8s.io/kubernetes/cmd/kube-controller-manager",
            "k8s.io/kubernetes/cmd/kubectl",
            "./etcd",
        ])
        .current_dir(&src))?;
    let etcd = probe(
        go_command(&go)
            .args(["list", "-m", "go.etcd.io/etcd/server/v3"])
            .current_dir(&src),
    )?;
    ensure!(
        etcd.split_whitespace().nth(1) == Some(ETCD_VERSION),
        "the module graph selected `{}`, expected go.etcd.io/etcd/server/v3 {ETCD_VERSION}: \
         update ETCD_VERSION in xtask/src/setup/kube.rs to what {KUBERNETES_VERSION} requires",
        etcd.trim()
    );
    fs::write(bin.join(STAMP), stamp).context("writing the kube tools stamp")?;
    println!(
        "built: kube-apiserver, kube-controller-manager, kubectl, etcd in {:.0} s",
        start.elapsed().as_secs_f64()
    );
    Ok(())
}

/// The node-side binaries `cargo xtask e2e` runs, built from the same scratch module as the
/// control plane (one module graph, one download): `go build -o DIR/` names and packages.
const NODE_BINARIES: [(&str, &str); 6] = [
    ("kubelet", "k8s.io/kubernetes/cmd/kubelet"),
    ("kube-scheduler", "k8s.io/kubernetes/cmd/kube-scheduler"),
    ("kube-proxy", "k8s.io/kubernetes/cmd/kube-proxy"),
    ("agnhost", "k8s.io/kubernetes/test/images/agnhost"),
    (
        "regression-issue-74839",
        "k8s.io/kubernetes/test/images/regression-issue-74839",
    ),
    ("pause", "./pause"),
];
/// Kubernetes' own end-to-end suite, a test binary.
pub const E2E_TEST: &str = "e2e.test";
const NODE_STAMP: &str = "kube-node-tools.version";

/// The pod sandbox's process: sleeps until SIGTERM/SIGINT, reaping the zombies a shared PID
/// namespace hands it (what registry.k8s.io/pause does, in Go: the image needs no C compiler).
const PAUSE_MAIN: &str = "// Command pause holds a pod's namespaces: it sleeps, reaps children and exits on\n\
// SIGTERM or SIGINT.\n\
package main\n\n\
import (\n\
\t\"os\"\n\
\t\"os/signal\"\n\
\t\"syscall\"\n\
)\n\n\
func main() {\n\
\tsignals := make(chan os.Signal, 4)\n\
\tsignal.Notify(signals, syscall.SIGTERM, syscall.SIGINT, syscall.SIGCHLD)\n\
\tfor s := range signals {\n\
\t\tif s != syscall.SIGCHLD {\n\
\t\t\tos.Exit(0)\n\
\t\t}\n\
\t\tfor {\n\
\t\t\tvar status syscall.WaitStatus\n\
\t\t\tpid, err := syscall.Wait4(-1, &status, syscall.WNOHANG, nil)\n\
\t\t\tif pid <= 0 || err != nil {\n\
\t\t\t\tbreak\n\
\t\t\t}\n\
\t\t}\n\
\t}\n\
}\n";

/// kubelet, kube-scheduler, kube-proxy, agnhost, the regression-issue-74839 server, pause and
/// `e2e.test` (`go test -c` of k8s.io/kubernetes/test/e2e) into `target/tools/bin`, from the
/// control plane's scratch module; skipped when the stamp says they are there.
pub fn node_tools() -> Result<()> {
    let tools = workspace_root().join("target/tools");
    let bin = tools.join("bin");
    let stamp = format!("kubernetes {KUBERNETES_VERSION}\n");
    let names: Vec<&str> = NODE_BINARIES
        .iter()
        .map(|(name, _)| *name)
        .chain([E2E_TEST])
        .collect();
    let present = names.iter().all(|b| bin.join(b).is_file());
    if present && fs::read_to_string(bin.join(NODE_STAMP)).ok().as_deref() == Some(stamp.as_str()) {
        println!(
            "ok: {} {KUBERNETES_VERSION} in {}",
            names.join(", "),
            bin.display()
        );
        return Ok(());
    }
    let go = go_binary()?;
    println!(
        "installing: {} {KUBERNETES_VERSION} into {} (cold: ~12 CPU minutes beside the control \
         plane's, e2e.test alone ~6)",
        names.join(", "),
        bin.display()
    );
    let start = Instant::now();
    let src = tools.join("kube-src");
    write_scratch_module(&go, &src)?;
    fs::create_dir_all(&bin).with_context(|| format!("creating {}", bin.display()))?;
    let _ = fs::remove_file(bin.join(NODE_STAMP));
    run(go_command(&go)
        .args(["build", "-ldflags", &ldflags(), "-o"])
        .arg(format!("{}/", bin.display()))
        .args(NODE_BINARIES.iter().map(|(_, package)| *package))
        .current_dir(&src))?;
    let binaries = start.elapsed();
    // The suite's own flags (--provider, --kubeconfig, ginkgo's) come from its TestMain; vet
    // would only add minutes.
    run(go_command(&go)
        .args(["test", "-c", "-vet=off", "-ldflags", &ldflags(), "-o"])
        .arg(bin.join(E2E_TEST))
        .arg("k8s.io/kubernetes/test/e2e")
        .current_dir(&src))?;
    fs::write(bin.join(NODE_STAMP), stamp).context("writing the node tools stamp")?;
    println!(
        "built: {} in {:.0} s (e2e.test {:.0} s of it)",
        names.join(", "),
        start.elapsed().as_secs_f64(),
        (start.elapsed() - binaries).as_secs_f64()
    );
    Ok(())
}

/// Go from PATH (or its default install directory, which non-login shells may lack), at least
/// 1.26 as k8s.io/kubernetes' go.mod asks.
pub(super) fn go_binary() -> Result<PathBuf> {
    let candidates = [PathBuf::from("go"), PathBuf::from("/usr/local/go/bin/go")];
    for go in candidates {
        let Ok(version) = probe(Command::new(&go).arg("version")) else {
            continue;
        };
        // "go version go1.26.8 linux/amd64"
        let minor = version
            .split_whitespace()
            .nth(2)
            .and_then(|v| v.strip_prefix("go1."))
            .and_then(|v| v.split('.').next())
            .and_then(|v| v.parse::<u32>().ok());
        ensure!(
            minor.is_some_and(|m| m >= MIN_GO_MINOR),
            "{} is `{}`; building Kubernetes {KUBERNETES_VERSION} needs Go 1.{MIN_GO_MINOR} or newer",
            go.display(),
            version.trim()
        );
        return Ok(go);
    }
    bail!(
        "Go is not installed (neither `go` on PATH nor /usr/local/go/bin/go); the tests build \
         kube-apiserver and etcd with Go 1.{MIN_GO_MINOR} or newer"
    )
}

/// A `go` command with the build settings of these tools: static (no cgo), reproducible paths,
/// no VCS stamp from the lb checkout around the scratch module, go.mod/go.sum completed as
/// needed, and never a toolchain download.
pub(super) fn go_command(go: &Path) -> Command {
    let mut cmd = Command::new(go);
    cmd.env("CGO_ENABLED", "0")
        .env("GOFLAGS", "-trimpath -buildvcs=false -mod=mod")
        .env("GOTOOLCHAIN", "local");
    cmd
}

/// Writes the scratch module: go.mod from the release's own go.mod (its `go`/`godebug` lines and
/// a replace per staging module), the tools file that keeps the commands in the graph, and the
/// etcd main.
fn write_scratch_module(go: &Path, src: &Path) -> Result<()> {
    let tools = src.parent().context("kube-src has a parent")?;
    fs::create_dir_all(src.join("etcd")).with_context(|| format!("creating {}", src.display()))?;
    let download = probe(
        go_command(go)
            .args(["mod", "download", "-json"])
            .arg(format!("k8s.io/kubernetes@{KUBERNETES_VERSION}"))
            // Outside any module, so the scratch module's previous go.mod plays no part.
            .current_dir(tools),
    )?;
    let info: serde_json::Value =
        serde_json::from_str(&download).context("parsing `go mod download -json`")?;
    let upstream_mod = info["GoMod"]
        .as_str()
        .context("`go mod download -json` gave no GoMod path")?;
    let upstream =
        fs::read_to_string(upstream_mod).with_context(|| format!("reading {upstream_mod}"))?;
    let go_mod = scratch_go_mod(&upstream)?;
    fs::write(src.join("go.mod"), go_mod).context("writing kube-src/go.mod")?;
    fs::write(
        src.join("tools.go"),
        "//go:build tools\n\n\
         // Package tools keeps the commands `cargo xtask setup` builds in this module's graph.\n\
         package tools\n\n\
         import (\n\
         \t_ \"k8s.io/kubernetes/cmd/kube-apiserver\"\n\
         \t_ \"k8s.io/kubernetes/cmd/kube-controller-manager\"\n\
         \t_ \"k8s.io/kubernetes/cmd/kube-proxy\"\n\
         \t_ \"k8s.io/kubernetes/cmd/kube-scheduler\"\n\
         \t_ \"k8s.io/kubernetes/cmd/kubectl\"\n\
         \t_ \"k8s.io/kubernetes/cmd/kubelet\"\n\
         \t_ \"k8s.io/kubernetes/test/e2e\"\n\
         \t_ \"k8s.io/kubernetes/test/images/agnhost\"\n\
         \t_ \"k8s.io/kubernetes/test/images/regression-issue-74839\"\n\
         )\n",
    )
    .context("writing kube-src/tools.go")?;
    fs::create_dir_all(src.join("pause")).context("creating kube-src/pause")?;
    fs::write(src.join("pause/main.go"), PAUSE_MAIN).context("writing kube-src/pause/main.go")?;
    fs::write(
        src.join("etcd/main.go"),
        "// Command etcd is the etcd server, through its own entry point.\n\
         package main\n\n\
         import (\n\
         \t\"os\"\n\n\
         \t\"go.etcd.io/etcd/server/v3/etcdmain\"\n\
         )\n\n\
         func main() { etcdmain.Main(os.Args) }\n",
    )
    .context("writing kube-src/etcd/main.go")?;
    Ok(())
}

/// The scratch module's go.mod for the release whose go.mod is `upstream`.
fn scratch_go_mod(upstream: &str) -> Result<String> {
    let staging_version = staging_version(KUBERNETES_VERSION)?;
    // `k8s.io/api => ./staging/src/k8s.io/api`, inside the replace block.
    let staging: Vec<&str> = upstream
        .lines()
        .filter_map(|line| {
            let (module, target) = line.trim().split_once("=>")?;
            target
                .trim()
                .starts_with("./staging/")
                .then(|| module.trim())
        })
        .collect();
    ensure!(
        !staging.is_empty(),
        "k8s.io/kubernetes {KUBERNETES_VERSION}'s go.mod replaces no ./staging modules"
    );
    let go_line = upstream
        .lines()
        .find(|line| line.starts_with("go "))
        .context("k8s.io/kubernetes' go.mod has no `go` line")?;
    let mut out = format!(
        "// Generated by `cargo xtask setup` (xtask/src/setup/kube.rs); rewritten on a version change.\n\
         module lb.invalid/kube-tools\n\n{go_line}\n\n"
    );
    // The main module's godebug settings apply to the binaries, as they do in Kubernetes' build.
    for line in upstream.lines().filter(|line| line.starts_with("godebug ")) {
        out.push_str(line);
        out.push('\n');
    }
    out.push_str(&format!(
        "\nrequire (\n\tk8s.io/kubernetes {KUBERNETES_VERSION}\n\tgo.etcd.io/etcd/server/v3 {ETCD_VERSION}\n)\n\nreplace (\n"
    ));
    for module in staging {
        out.push_str(&format!("\t{module} => {module} {staging_version}\n"));
    }
    out.push_str(")\n");
    Ok(out)
}

/// `v1.37.2` → `v0.37.2`: the staging modules are published as v0 with the release's minor.
fn staging_version(release: &str) -> Result<String> {
    let rest = release
        .strip_prefix("v1.")
        .with_context(|| format!("unexpected Kubernetes version {release}"))?;
    Ok(format!("v0.{rest}"))
}

/// Version stamps as Kubernetes' own build sets them (hack/lib/version.sh), so `--version`,
/// `/version` and kubectl's skew check see the release, not `v0.0.0-master`; `-s -w` drops
/// the symbol table and DWARF (about a third of the size).
fn ldflags() -> String {
    let minor = KUBERNETES_VERSION.split('.').nth(1).unwrap_or_default();
    let mut flags = vec!["-s".to_owned(), "-w".to_owned()];
    for package in [
        "k8s.io/component-base/version",
        "k8s.io/client-go/pkg/version",
    ] {
        for (var, value) in [
            ("gitVersion", KUBERNETES_VERSION),
            ("gitMajor", "1"),
            ("gitMinor", minor),
            ("gitTreeState", "clean"),
        ] {
            flags.push(format!("-X={package}.{var}={value}"));
        }
    }
    flags.join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scratch_go_mod_replaces_each_staging_module() {
        let upstream = "module k8s.io/kubernetes\n\ngo 1.26.0\n\ngodebug default=go1.26\n\n\
            require (\n\tk8s.io/api v0.0.0\n\tk8s.io/utils v0.0.0-2026\n)\n\n\
            replace (\n\tk8s.io/api => ./staging/src/k8s.io/api\n\
            \tk8s.io/kubectl => ./staging/src/k8s.io/kubectl\n\
            \tgithub.com/x/y => github.com/x/y v1.0.0\n)\n";
        let out = scratch_go_mod(upstream).unwrap();
        assert!(out.contains("\ngo 1.26.0\n"), "{out}");
        assert!(out.contains("\ngodebug default=go1.26\n"), "{out}");
        let v0 = staging_version(KUBERNETES_VERSION).unwrap();
        assert!(
            out.contains(&format!("\tk8s.io/api => k8s.io/api {v0}\n")),
            "{out}"
        );
        assert!(
            out.contains(&format!("\tk8s.io/kubectl => k8s.io/kubectl {v0}\n")),
            "{out}"
        );
        assert!(
            !out.contains("github.com/x/y"),
            "only staging modules: {out}"
        );
        assert!(!out.contains("k8s.io/utils"), "{out}");
    }

    #[test]
    fn staging_version_is_v0_with_the_release_minor() {
        assert_eq!(staging_version("v1.37.2").unwrap(), "v0.37.2");
        assert!(staging_version("v2.0.0").is_err());
    }
}
