//! What the kernel matrix (`cargo xtask test --kernel`) needs: QEMU, virtme-ng, virtiofsd and
//! Debian's kernels. Everything lands under `target/tools` and is skipped when present.
//!
//! Background: /work/shared/notes/vm-kernels.md. The VMs boot a Debian kernel package with the
//! host's root filesystem shared read-only (virtme-ng), under QEMU's software emulation: the
//! machine's /dev/kvm cannot run stock kernels.
use std::{
    ffi::OsString,
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result, ensure};

use super::{DEBIAN_CARGO, DEBIAN_RUSTC, ensure_packages, has_version};
use crate::process::{probe, run, workspace_root};

const VIRTME_NG_VERSION: &str = "1.42";
const VIRTIOFSD_VERSION: &str = "1.14.0";

/// Debian packages the VMs need: QEMU, and what virtme-ng's guest init uses (udev: without it
/// the guest's output is lost; busybox-static for the initramfs; kmod to load modules), plus
/// virtiofsd's build dependencies.
const VM_PACKAGES: [&str; 9] = [
    "qemu-system-x86",
    "kmod",
    "udev",
    "file",
    "busybox-static",
    "python3-venv",
    "libcap-ng-dev",
    "libseccomp-dev",
    "pkg-config",
];

/// A kernel of the matrix, picked from Debian's archive by package name.
pub struct KernelSpec {
    /// What `--kernel` takes.
    pub name: &'static str,
    /// Sort key of a `linux-image-*` package name this kernel can be, `None` if it is none.
    matches: fn(&str) -> Option<Vec<u64>>,
}

/// The kernels reachable from Debian's archive: the floor (5.10, bullseye), bookworm's 6.1 and
/// 6.12, and the newest packaged one (sid). Each resolves to the newest package of its line.
pub const KERNELS: [KernelSpec; 4] = [
    KernelSpec {
        name: "5.10",
        matches: |n| abi_number(n, "linux-image-5.10.0-", "-amd64"),
    },
    KernelSpec {
        name: "6.1",
        matches: |n| abi_number(n, "linux-image-6.1.0-", "-amd64"),
    },
    KernelSpec {
        name: "6.12",
        matches: |n| abi_number(n, "linux-image-6.12.", "+deb12-amd64"),
    },
    KernelSpec {
        name: "newest",
        matches: newest,
    },
];

/// The floor kernel, which the default `cargo xtask test` (and CI) runs.
pub const FLOOR: &str = "5.10";

/// `prefix<digits>suffix` → `[digits]`.
fn abi_number(name: &str, prefix: &str, suffix: &str) -> Option<Vec<u64>> {
    let n = name.strip_prefix(prefix)?.strip_suffix(suffix)?;
    Some(vec![n.parse().ok()?])
}

/// `linux-image-X.Y.Z+debN-amd64` (sid's naming) → `[X, Y, Z]`.
fn newest(name: &str) -> Option<Vec<u64>> {
    let rest = name.strip_prefix("linux-image-")?.strip_suffix("-amd64")?;
    let (version, deb) = rest.split_once('+')?;
    deb.strip_prefix("deb")?.parse::<u64>().ok()?;
    version.split('.').map(|p| p.parse().ok()).collect()
}

/// The installed tools.
pub struct VmTools {
    /// virtme-ng's `vng`.
    pub vng: PathBuf,
    /// `PATH` for `vng`: its venv (it runs `virtme-run`) and `target/tools/bin` (virtiofsd).
    pub path: OsString,
}

fn tools_dir() -> PathBuf {
    workspace_root().join("target/tools")
}

/// Installs QEMU and the guest tools, virtme-ng (in a venv) and virtiofsd.
pub fn vm_tools() -> Result<VmTools> {
    ensure_packages(&VM_PACKAGES)?;
    let tools = tools_dir();
    let venv = tools.join("vng");
    let vng = venv.join("bin/vng");
    if !has_version(&vng, VIRTME_NG_VERSION) {
        println!(
            "installing: virtme-ng {VIRTME_NG_VERSION} into a venv at {}",
            venv.display()
        );
        // Debian's Python: a python3 earlier on PATH (pyenv) may lack venv.
        run(Command::new("/usr/bin/python3")
            .args(["-m", "venv", "--clear"])
            .arg(&venv))?;
        run(Command::new(venv.join("bin/pip"))
            .args(["install", "--quiet", "--disable-pip-version-check"])
            .arg(format!("virtme-ng=={VIRTME_NG_VERSION}")))?;
    }
    let virtiofsd = tools.join("bin/virtiofsd");
    if !has_version(&virtiofsd, VIRTIOFSD_VERSION) {
        // Debian 12's virtiofsd is too old for virtme-ng, which would fall back to 9p
        // (1.2–2× slower guests).
        println!(
            "installing: virtiofsd {VIRTIOFSD_VERSION} into {} (~90 s)",
            tools.display()
        );
        run(Command::new(DEBIAN_CARGO)
            .args(["install", "--locked", "--root"])
            .arg(&tools)
            .arg(format!("virtiofsd@{VIRTIOFSD_VERSION}"))
            .env("RUSTC", DEBIAN_RUSTC)
            .current_dir("/"))?;
    }
    let mut path = OsString::from(venv.join("bin"));
    path.push(":");
    path.push(tools.join("bin"));
    if let Some(p) = std::env::var_os("PATH") {
        path.push(":");
        path.push(p);
    }
    Ok(VmTools { vng, path })
}

/// A downloaded kernel.
pub struct Kernel {
    pub name: &'static str,
    /// The package it came from, e.g. `linux-image-5.10.0-46-amd64`.
    pub package: String,
    /// Its `vmlinuz`; the modules sit beside it in `../lib/modules`, where virtme-ng finds them.
    pub vmlinuz: PathBuf,
}

fn kernel_dir(name: &str) -> PathBuf {
    tools_dir().join("kernels").join(name)
}

/// The kernel `name` if it was downloaded before.
pub fn downloaded(name: &'static str) -> Option<Kernel> {
    let dir = kernel_dir(name);
    let package = fs::read_to_string(dir.join("package")).ok()?;
    let vmlinuz = find_vmlinuz(&dir).ok()?;
    Some(Kernel {
        name,
        package: package.trim().to_owned(),
        vmlinuz,
    })
}

/// Downloads (once) and unpacks the kernels in `names`, each the newest package of its line.
pub fn kernels(names: &[&'static str]) -> Result<Vec<Kernel>> {
    let mut apt = None;
    let mut out = Vec::new();
    for &name in names {
        if let Some(k) = downloaded(name) {
            println!(
                "ok: kernel {name} is {} ({})",
                k.package,
                k.vmlinuz.display()
            );
            out.push(k);
            continue;
        }
        let spec = KERNELS
            .iter()
            .find(|k| k.name == name)
            .with_context(|| format!("no kernel named {name}"))?;
        let apt = match &mut apt {
            Some(a) => a,
            None => apt.insert(PrivateApt::updated()?),
        };
        out.push(apt.fetch(spec)?);
    }
    Ok(out)
}

/// `root/boot/vmlinuz-*` (bullseye, bookworm) or `root/usr/lib/modules/*/vmlinuz` (sid).
fn find_vmlinuz(dir: &Path) -> Result<PathBuf> {
    let root = dir.join("root");
    let boot = fs::read_dir(root.join("boot"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("vmlinuz-"))
        });
    let modules = fs::read_dir(root.join("usr/lib/modules"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join("vmlinuz"))
        .filter(|p| p.is_file());
    boot.chain(modules)
        .next()
        .with_context(|| format!("no vmlinuz in {}", root.display()))
}

/// apt with its own sources and state under `target/tools/kernels/apt`: bullseye and sid are
/// reached without touching the machine's sources.
struct PrivateApt {
    dir: PathBuf,
}

impl PrivateApt {
    fn updated() -> Result<Self> {
        let dir = tools_dir().join("kernels/apt");
        for sub in ["lists/partial", "cache/archives/partial", "debs"] {
            fs::create_dir_all(dir.join(sub))?;
        }
        let keyring = "/usr/share/keyrings/debian-archive-keyring.gpg";
        let sources = [
            ("http://deb.debian.org/debian-security", "bullseye-security"),
            ("http://deb.debian.org/debian-security", "bookworm-security"),
            ("http://deb.debian.org/debian", "sid"),
        ]
        .iter()
        .map(|(url, suite)| format!("deb [signed-by={keyring}] {url} {suite} main\n"))
        .collect::<String>();
        fs::write(dir.join("sources.list"), sources)?;
        let apt = Self { dir };
        println!(
            "installing: Debian kernel package lists (bullseye-security, bookworm-security, sid)"
        );
        run(apt.command("apt-get").arg("update").arg("-qq"))?;
        Ok(apt)
    }

    fn command(&self, program: &str) -> Command {
        let d = &self.dir;
        let mut cmd = Command::new(program);
        for (key, value) in [
            ("Dir::Etc::SourceList", d.join("sources.list")),
            ("Dir::Etc::SourceParts", PathBuf::from("/dev/null")),
            ("Dir::State::Lists", d.join("lists")),
            ("Dir::Cache", d.join("cache")),
            ("Dir::State::status", PathBuf::from("/dev/null")),
            ("APT::Architecture", PathBuf::from("amd64")),
            // Downloads go to a root-owned directory; apt's `_apt` user could not write it.
            ("APT::Sandbox::User", PathBuf::from("root")),
        ] {
            cmd.arg("-o").arg(format!("{key}={}", value.display()));
        }
        cmd.env("DEBIAN_FRONTEND", "noninteractive");
        cmd
    }

    fn fetch(&self, spec: &KernelSpec) -> Result<Kernel> {
        let names = probe(self.command("apt-cache").args(["pkgnames", "linux-image-"]))?;
        let package = names
            .lines()
            .filter_map(|n| Some(((spec.matches)(n)?, n)))
            .max()
            .map(|(_, n)| n.to_owned())
            .with_context(|| format!("no Debian package for kernel {}", spec.name))?;
        // sid splits the kernel: the image package only depends on linux-binary-* (vmlinuz)
        // and linux-modules-*.
        let show = probe(
            self.command("apt-cache")
                .args(["show", "--no-all-versions", &package]),
        )?;
        let mut packages = vec![package.clone()];
        for dep in show
            .lines()
            .filter_map(|l| l.strip_prefix("Depends:"))
            .flat_map(|d| d.split(','))
        {
            let name = dep.split_whitespace().next().unwrap_or_default();
            if name.starts_with("linux-binary-") || name.starts_with("linux-modules-") {
                packages.push(name.to_owned());
            }
        }
        println!(
            "installing: kernel {} from {}",
            spec.name,
            packages.join(" ")
        );
        let debs = self.dir.join("debs");
        for p in &packages {
            run(self
                .command("apt-get")
                .args(["download", "-qq", p])
                .current_dir(&debs))?;
        }
        let dir = kernel_dir(spec.name);
        let root = dir.join("root");
        if root.exists() {
            fs::remove_dir_all(&root)?;
        }
        fs::create_dir_all(&root)?;
        for entry in fs::read_dir(&debs)? {
            let deb = entry?.path();
            let file = deb.file_name().unwrap_or_default().to_string_lossy();
            if packages.iter().any(|p| file.starts_with(&format!("{p}_"))) {
                run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&root))?;
                fs::remove_file(&deb)?;
            }
        }
        let vmlinuz = find_vmlinuz(&dir)?;
        ensure!(
            fs::metadata(&vmlinuz)?.len() > 0,
            "{} is empty",
            vmlinuz.display()
        );
        fs::write(dir.join("package"), format!("{package}\n"))?;
        Ok(Kernel {
            name: spec.name,
            package,
            vmlinuz,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pick(spec: &str, names: &[&str]) -> Option<String> {
        let spec = KERNELS.iter().find(|k| k.name == spec).unwrap();
        names
            .iter()
            .filter_map(|n| Some(((spec.matches)(n)?, *n)))
            .max()
            .map(|(_, n)| n.to_string())
    }

    #[test]
    fn each_line_picks_its_newest_package() {
        let names = [
            "linux-image-5.10.0-9-amd64",
            "linux-image-5.10.0-46-amd64",
            "linux-image-5.10.0-46-rt-amd64",
            "linux-image-6.1.0-0.deb11.52-amd64",
            "linux-image-6.1.0-57-amd64",
            "linux-image-6.1.0-9-amd64",
            "linux-image-6.12.117+deb12-amd64",
            "linux-image-6.12.99+deb12-amd64",
            "linux-image-6.12-amd64",
            "linux-image-7.2.13+deb14-amd64",
            "linux-image-7.10.1+deb14-cloud-amd64",
        ];
        assert_eq!(pick("5.10", &names).unwrap(), "linux-image-5.10.0-46-amd64");
        assert_eq!(pick("6.1", &names).unwrap(), "linux-image-6.1.0-57-amd64");
        assert_eq!(
            pick("6.12", &names).unwrap(),
            "linux-image-6.12.117+deb12-amd64"
        );
        assert_eq!(
            pick("newest", &names).unwrap(),
            "linux-image-7.2.13+deb14-amd64"
        );
    }
}
