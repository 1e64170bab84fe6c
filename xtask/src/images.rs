//! The images a node without a registry needs, as OCI archives for
//! `ctr -n k8s.io images import` (written by [`crate::oci`]).
//!
//! The Kubernetes e2e suite names its images in `test/utils/image/manifest.go`; these carry
//! exactly those names (k8s.io/kubernetes v1.37.2), so the kubelet finds them imported and
//! never pulls:
//!
//! | image | from |
//! | --- | --- |
//! | `registry.k8s.io/pause:3.10.2` | the static pause binary at `/pause` |
//! | `registry.k8s.io/e2e-test-images/agnhost:2.66.1` | `/agnhost`, and the userland the specs run with `/bin/sh -c` |
//! | `registry.k8s.io/e2e-test-images/busybox:1.37.0-2` | Debian's busybox-static, applets under `/bin` (its wget segfaults: Debian bookworm's 1.35) |
//! | `registry.k8s.io/e2e-test-images/nginx:1.27.0-2` | Debian's nginx-light serving `/usr/share/nginx/html` on :80, with busybox |
//! | `registry.k8s.io/e2e-test-images/regression-issue-74839:1.5` | the boom server at `/regression-issue-74839` |
//!
//! Upstream builds agnhost on Alpine (`apk add bind-tools curl netcat-openbsd iproute2 bash …`,
//! test/images/agnhost/Dockerfile). Here its userland is the host's Debian one: every program
//! of [`AGNHOST_PACKAGES`] (dash as `/bin/sh`, coreutils, grep, sed, awk, ps, tar, wget, curl,
//! OpenBSD `nc` for `nc -v -t|-u -w`, BIND's `dig` and `nslookup`, iproute2's `ip`, …) and
//! glibc's `getent`, each with every shared library `ldd` names, at the path the loader finds
//! it. Programs live in /usr/bin and /usr/sbin; /bin and /sbin link there, as on a merged-/usr
//! system, so `/bin/sh` and `/bin/cat` work too. Not busybox: Debian's busybox-static is built
//! with FEATURE_SH_STANDALONE and FEATURE_PREFER_APPLETS, so its `sh` (and `timeout`, `env`,
//! `xargs`) would run its own `nc`, `nslookup` and `ip` whatever PATH says. The busybox and
//! nginx images use busybox, where that does not matter.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result, bail, ensure};

use crate::{
    image::elf_interpreter,
    oci::{self, Config, Image, Layer},
    process::probe,
};

/// Host packages the userland images copy binaries from (installed by setup).
pub const DEBIAN_PACKAGES: &[&str] = &[
    // The busybox image, and sh for the nginx image's hooks.
    "busybox-static",
    // agnhost's userland (AGNHOST_PACKAGES) and getent.
    "dash",
    "bash",
    "coreutils",
    "grep",
    "sed",
    "mawk",
    "findutils",
    "procps",
    "hostname",
    "tar",
    "gzip",
    "wget",
    "curl",
    "netcat-openbsd",
    "bind9-dnsutils",
    "iproute2",
    "libc-bin",
    // /etc/ssl/certs/ca-certificates.crt, /etc/services and /etc/protocols.
    "ca-certificates",
    "netbase",
    // The nginx image. Its postinst starts nginx on :80 unless invoke-rc.d is told not to
    // (policy-rc.d); the image needs only the binary and mime.types.
    "nginx-light",
];

/// The binaries built from k8s.io/kubernetes for the e2e images.
pub struct E2eInputs {
    /// The pause container's program (static; Kubernetes' build/pause, or any program that
    /// sleeps until SIGINT/SIGTERM and reaps children).
    pub pause: PathBuf,
    /// test/images/agnhost, built with CGO_ENABLED=0.
    pub agnhost: PathBuf,
    /// test/images/regression-issue-74839 (the "boom server").
    pub boom_server: PathBuf,
}

pub const PAUSE: &str = "registry.k8s.io/pause:3.10.2";
pub const AGNHOST: &str = "registry.k8s.io/e2e-test-images/agnhost:2.66.1";
pub const BUSYBOX: &str = "registry.k8s.io/e2e-test-images/busybox:1.37.0-2";
pub const NGINX: &str = "registry.k8s.io/e2e-test-images/nginx:1.27.0-2";
pub const REGRESSION_ISSUE_74839: &str =
    "registry.k8s.io/e2e-test-images/regression-issue-74839:1.5";

/// Alpine's (and the busybox image's) PATH.
const PATH: &str = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// Where the host's programs are looked up.
const HOST_BIN_DIRS: [&str; 4] = ["/usr/sbin", "/usr/bin", "/sbin", "/bin"];
const BUSYBOX_BIN: &str = "/bin/busybox";
/// The Debian packages whose every program agnhost gets.
pub const AGNHOST_PACKAGES: &[&str] = &[
    "dash",
    "bash",
    "coreutils",
    "grep",
    "sed",
    "mawk",
    "findutils",
    "procps",
    "hostname",
    "tar",
    "gzip",
    "wget",
    "curl",
    "netcat-openbsd",
    "bind9-dnsutils",
    "iproute2",
];
/// Names Debian gives through alternatives or diversions (not in the packages' file lists):
/// (name in /usr/bin, program it runs).
const AGNHOST_ALIASES: [(&str, &str); 3] = [("sh", "dash"), ("awk", "mawk"), ("nc", "nc.openbsd")];

/// Writes one OCI archive per image into out_dir, skipping ones whose inputs did not change
/// (a stamp/digest file), and returns (image name, archive path) for each.
pub fn e2e_images(inputs: &E2eInputs, out_dir: &Path) -> Result<Vec<(String, PathBuf)>> {
    let images = [
        ("pause", pause(&inputs.pause)?),
        ("agnhost", agnhost(&inputs.agnhost)?),
        ("busybox", busybox()?),
        ("nginx", nginx()?),
        (
            "regression-issue-74839",
            regression_issue_74839(&inputs.boom_server)?,
        ),
    ];
    images
        .into_iter()
        .map(|(file, image)| {
            let out = out_dir.join(format!("{file}.oci.tar"));
            write_reporting(&image, &out)?;
            Ok((image.name, out))
        })
        .collect()
}

/// lb's image (`crate::image::name()`, registry.example.invalid/lb:<version>) from the static lb binary.
pub fn lb_image(lb_static: &Path, out_dir: &Path) -> Result<(String, PathBuf)> {
    let image = lb(lb_static)?;
    let out = out_dir.join("lb.oci.tar");
    write_reporting(&image, &out)?;
    Ok((image.name, out))
}

fn write_reporting(image: &Image, out: &Path) -> Result<()> {
    if oci::write_cached(image, out)? {
        println!(
            "image: {} → {} ({:.1} MB)",
            image.name,
            out.display(),
            fs::metadata(out)?.len() as f64 / 1e6
        );
    } else {
        println!("ok: image {} unchanged in {}", image.name, out.display());
    }
    Ok(())
}

/// deploy/Containerfile's image: the static lb alone.
fn lb(lb_static: &Path) -> Result<Image> {
    if let Some(interp) = elf_interpreter(lb_static)? {
        bail!(
            "{} is dynamically linked (interpreter {interp}); the lb image has no libc",
            lb_static.display()
        );
    }
    let mut layer = Layer::new();
    layer.host_file("/usr/local/bin/lb", lb_static, 0o755)?;
    Ok(Image {
        name: crate::image::name(),
        config: Config::new(&["/usr/local/bin/lb"], &["run"], &["PATH=/usr/local/bin"]),
        layer,
    })
}

/// registry.k8s.io/pause: `/pause` as entry point, run as 65535 like upstream's image.
fn pause(pause: &Path) -> Result<Image> {
    let mut layer = Layer::new();
    program(&mut layer, "/pause", pause)?;
    Ok(Image {
        name: PAUSE.to_owned(),
        config: Config {
            user: Some("65535:65535".to_owned()),
            ..Config::new(&["/pause"], &[], &[])
        },
        layer,
    })
}

/// test/images/regression-issue-74839/Dockerfile: the binary at the root, as entry point.
fn regression_issue_74839(boom_server: &Path) -> Result<Image> {
    let mut layer = Layer::new();
    program(&mut layer, "/regression-issue-74839", boom_server)?;
    Ok(Image {
        name: REGRESSION_ISSUE_74839.to_owned(),
        config: Config::new(&["/regression-issue-74839"], &[], &[]),
        layer,
    })
}

/// test/images/agnhost/Dockerfile on this host's programs (see the module's documentation).
fn agnhost(agnhost: &Path) -> Result<Image> {
    let mut layer = Layer::new();
    let mut names = BTreeSet::new();
    // Each file once: a second name for it (rbash, pgrep/pkill…) is a link to the first.
    let mut copied: BTreeMap<PathBuf, String> = BTreeMap::new();
    for package in AGNHOST_PACKAGES {
        for host in package_programs(package)? {
            let name = host
                .file_name()
                .and_then(|n| n.to_str())
                .context("program name")?
                .to_owned();
            // /bin and /sbin are links to /usr/bin and /usr/sbin in the image.
            let dir = if host.parent().is_some_and(|d| d.ends_with("sbin")) {
                "/usr/sbin"
            } else {
                "/usr/bin"
            };
            let at = format!("{dir}/{name}");
            let real =
                fs::canonicalize(&host).with_context(|| format!("resolving {}", host.display()))?;
            match copied.get(&real) {
                Some(first) => {
                    layer.symlink(&at, first)?;
                }
                None => {
                    program(&mut layer, &at, &real)?;
                    copied.insert(real, at);
                }
            }
            names.insert(name);
        }
    }
    program(&mut layer, "/usr/bin/getent", &host_program("getent")?)?;
    for (alias, name) in AGNHOST_ALIASES {
        ensure!(
            names.contains(name),
            "agnhost: no {name} for {alias} in the packages {}",
            AGNHOST_PACKAGES.join(" ")
        );
        layer.symlink(&format!("/usr/bin/{alias}"), name)?;
    }
    layer
        .symlink("/bin", "usr/bin")?
        .symlink("/sbin", "usr/sbin")?
        .dir("/tmp", 0o1777)?
        .dir("/root", 0o700)?
        .file("/etc/nsswitch.conf", NSSWITCH, 0o644)?
        .host_file("/etc/services", "/etc/services", 0o644)?
        .host_file("/etc/protocols", "/etc/protocols", 0o644)?;
    program(&mut layer, "/agnhost", agnhost)?;
    layer.symlink("/agnhost-2", "agnhost")?;
    // netexec's /upload writes here.
    layer.dir("/uploads", 0o755)?;
    layer.host_file(
        "/etc/ssl/certs/ca-certificates.crt",
        "/etc/ssl/certs/ca-certificates.crt",
        0o644,
    )?;
    // The security-context specs run as the image's user-defined-in-image (uid 1000), a
    // member of group-defined-in-image (gid 50000).
    accounts(
        &mut layer,
        &["user-defined-in-image:x:1000:1000::/home/user-defined-in-image:/bin/sh"],
        &[
            "user-defined-in-image:x:1000:",
            "group-defined-in-image:x:50000:user-defined-in-image",
        ],
    )?;
    layer.dir("/home/user-defined-in-image", 0o755)?;
    Ok(Image {
        name: AGNHOST.to_owned(),
        config: Config {
            exposed_ports: ["80", "8080", "8081", "9376", "5000"]
                .map(|p| format!("{p}/tcp"))
                .into(),
            ..Config::new(&["/agnhost"], &["pause"], &[PATH])
        },
        layer,
    })
}

/// The busybox image: busybox's applets under /bin, `sh` by default.
fn busybox() -> Result<Image> {
    let mut layer = Layer::new();
    busybox_userland(&mut layer)?;
    accounts(&mut layer, &[], &[])?;
    Ok(Image {
        name: BUSYBOX.to_owned(),
        config: Config::new(&[], &["sh"], &[PATH]),
        layer,
    })
}

/// nginx's configuration: what the upstream image's default server does (the welcome page on
/// :80, logs to the container's stdout/stderr), workers as the nginx user.
const NGINX_CONF: &str = "\
user nginx;
worker_processes 1;
pid /run/nginx.pid;
error_log stderr notice;

events {
    worker_connections 1024;
}

http {
    include /etc/nginx/mime.types;
    default_type application/octet-stream;
    access_log /var/log/nginx/access.log;
    sendfile on;
    keepalive_timeout 65;

    server {
        listen 80;
        listen [::]:80;
        server_name localhost;

        location / {
            root /usr/share/nginx/html;
            index index.html index.htm;
        }

        error_page 500 502 503 504 /50x.html;
        location = /50x.html {
            root /usr/share/nginx/html;
        }
    }
}
";

const NGINX_INDEX: &str = "<!DOCTYPE html>
<html>
<head><title>Welcome to nginx!</title></head>
<body>
<h1>Welcome to nginx!</h1>
<p>If you see this page, the nginx web server is successfully installed and working.</p>
</body>
</html>
";

/// The nginx image (upstream: nginx:1.27-alpine): nginx in the foreground on :80, stopped by
/// SIGQUIT, with busybox for the specs' `sh -c` hooks.
fn nginx() -> Result<Image> {
    let mut layer = Layer::new();
    busybox_userland(&mut layer)?;
    program(&mut layer, "/usr/sbin/nginx", &host_program("nginx")?)?;
    layer
        .file("/etc/nginx/nginx.conf", NGINX_CONF, 0o644)?
        .host_file("/etc/nginx/mime.types", "/etc/nginx/mime.types", 0o644)?
        .file("/usr/share/nginx/html/index.html", NGINX_INDEX, 0o644)?
        .file(
            "/usr/share/nginx/html/50x.html",
            "<!DOCTYPE html>\n<html><body><h1>An error occurred.</h1></body></html>\n",
            0o644,
        )?
        // As upstream's image: the logs are the container's.
        .symlink("/var/log/nginx/access.log", "/dev/stdout")?
        .symlink("/var/log/nginx/error.log", "/dev/stderr")?
        // Debian's build keeps its temporary files here (--http-*-temp-path).
        .dir("/var/lib/nginx", 0o755)?
        .dir("/var/cache/nginx", 0o755)?
        .dir("/run", 0o755)?
        // Upstream's entry point runs its argv (after optional setup scripts this image lacks).
        .file(
            "/docker-entrypoint.sh",
            "#!/bin/sh\nset -e\nexec \"$@\"\n",
            0o755,
        )?;
    accounts(
        &mut layer,
        &["nginx:x:101:101:nginx:/var/cache/nginx:/sbin/nologin"],
        &["nginx:x:101:nginx"],
    )?;
    Ok(Image {
        name: NGINX.to_owned(),
        config: Config {
            exposed_ports: vec!["80/tcp".to_owned()],
            stop_signal: Some("SIGQUIT".to_owned()),
            ..Config::new(
                &["/docker-entrypoint.sh"],
                &["nginx", "-g", "daemon off;"],
                &[PATH],
            )
        },
        layer,
    })
}

const NSSWITCH: &str = "passwd: files\ngroup: files\nshadow: files\nhosts: files dns\n\
                        networks: files\nprotocols: files\nservices: files\n";

/// `/bin/busybox` (with its libraries, if any) and a symlink in /bin for each of its applets;
/// `/tmp` (1777), `/root`, the name-service files and netbase's `/etc/services` and
/// `/etc/protocols`.
fn busybox_userland(layer: &mut Layer) -> Result<()> {
    program(layer, BUSYBOX_BIN, Path::new(BUSYBOX_BIN))?;
    for applet in busybox_applets()? {
        if applet != "busybox" {
            layer.symlink(&format!("/bin/{applet}"), "busybox")?;
        }
    }
    layer
        .dir("/tmp", 0o1777)?
        .dir("/root", 0o700)?
        .file("/etc/nsswitch.conf", NSSWITCH, 0o644)?
        .host_file("/etc/services", "/etc/services", 0o644)?
        .host_file("/etc/protocols", "/etc/protocols", 0o644)?;
    Ok(())
}

/// `/etc/passwd` and `/etc/group`: root, nobody, and the extra lines.
fn accounts(layer: &mut Layer, users: &[&str], groups: &[&str]) -> Result<()> {
    let mut passwd = String::from(
        "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\n",
    );
    let mut group = String::from("root:x:0:\nnogroup:x:65534:\n");
    for line in users {
        passwd.push_str(line);
        passwd.push('\n');
    }
    for line in groups {
        group.push_str(line);
        group.push('\n');
    }
    layer
        .file("/etc/passwd", passwd, 0o644)?
        .file("/etc/group", group, 0o644)?;
    Ok(())
}

/// The applets of the host's busybox (`busybox --list`), sorted.
fn busybox_applets() -> Result<BTreeSet<String>> {
    let list = probe(Command::new(BUSYBOX_BIN).arg("--list"))?;
    let applets: BTreeSet<String> = list
        .lines()
        .map(str::trim)
        .filter(|a| !a.is_empty() && !a.contains('/'))
        .map(str::to_owned)
        .collect();
    ensure!(
        applets.contains("sh"),
        "{BUSYBOX_BIN} --list has no sh applet"
    );
    Ok(applets)
}

/// The programs a Debian package installed (its files in /bin, /sbin, /usr/bin, /usr/sbin,
/// from dpkg's list), sorted.
fn package_programs(package: &str) -> Result<Vec<PathBuf>> {
    let info = Path::new("/var/lib/dpkg/info");
    let list = [format!("{package}.list"), format!("{package}:amd64.list")]
        .iter()
        .map(|name| info.join(name))
        .find(|path| path.is_file())
        .with_context(|| {
            format!(
                "Debian package {package} is not installed (install {})",
                DEBIAN_PACKAGES.join(" ")
            )
        })?;
    let mut programs: Vec<PathBuf> = fs::read_to_string(&list)
        .with_context(|| format!("reading {}", list.display()))?
        .lines()
        .map(PathBuf::from)
        .filter(|path| {
            path.parent()
                .is_some_and(|dir| HOST_BIN_DIRS.iter().any(|d| dir == Path::new(d)))
                && path.is_file()
        })
        .collect();
    programs.sort();
    ensure!(
        !programs.is_empty(),
        "Debian package {package} installed no programs"
    );
    Ok(programs)
}

/// The host program `name` from the Debian directories, symlinks (alternatives) resolved.
fn host_program(name: &str) -> Result<PathBuf> {
    for dir in HOST_BIN_DIRS {
        let path = Path::new(dir).join(name);
        if path.is_file() {
            return fs::canonicalize(&path)
                .with_context(|| format!("resolving {}", path.display()));
        }
    }
    bail!(
        "no `{name}` in {}: install the Debian packages {}",
        HOST_BIN_DIRS.join(", "),
        DEBIAN_PACKAGES.join(" ")
    )
}

/// `host` at `path` in the layer (mode 0755), with the shared libraries it loads.
fn program(layer: &mut Layer, path: &str, host: &Path) -> Result<()> {
    let real =
        fs::canonicalize(host).with_context(|| format!("{} (for {path})", host.display()))?;
    layer.host_file(path, &real, 0o755)?;
    for library in shared_libraries(&real)? {
        let file = fs::canonicalize(&library)
            .with_context(|| format!("resolving {} (for {path})", library.display()))?;
        let at = library
            .to_str()
            .with_context(|| format!("library path {} is not UTF-8", library.display()))?;
        layer.host_file(at, file, 0o755)?;
    }
    Ok(())
}

/// The shared libraries `binary` loads, by the paths the dynamic loader finds them at (as
/// `ldd` prints them, the loader's own path included); none for a static binary.
fn shared_libraries(binary: &Path) -> Result<Vec<PathBuf>> {
    // A script (gzip's zcat, …) loads nothing itself; its interpreter is in the image anyway.
    let mut magic = [0u8; 4];
    let is_elf = fs::File::open(binary)
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic))
        .is_ok()
        && magic == *b"\x7fELF";
    if !is_elf || elf_interpreter(binary)?.is_none() {
        return Ok(Vec::new());
    }
    let out = probe(Command::new("ldd").arg(binary))?;
    parse_ldd(&out).with_context(|| format!("ldd {}", binary.display()))
}

/// `ldd`'s lines: `libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x…)`,
/// `/lib64/ld-linux-x86-64.so.2 (0x…)`, `linux-vdso.so.1 (0x…)` (in the kernel: skipped).
fn parse_ldd(out: &str) -> Result<Vec<PathBuf>> {
    let mut libraries = Vec::new();
    for line in out.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let target = match line.split_once("=>") {
            Some((name, target)) => {
                let target = target.trim();
                ensure!(
                    !target.starts_with("not found"),
                    "{} is not found",
                    name.trim()
                );
                target
            }
            None => line,
        };
        let path = target
            .rsplit_once(" (0x")
            .map_or(target, |(path, _)| path)
            .trim();
        if path.starts_with('/') {
            libraries.push(PathBuf::from(path));
        } else if !path.starts_with("linux-vdso") && !path.starts_with("linux-gate") {
            bail!("unexpected ldd line: {line:?}");
        }
    }
    Ok(libraries)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::oci::tests::{TempDir, read_archive};

    #[test]
    fn ldd_output_is_parsed_into_loader_paths() {
        let out = "\tlinux-vdso.so.1 (0x00007ffd)\n\
                   \tlibcurl.so.4 => /lib/x86_64-linux-gnu/libcurl.so.4 (0x00007f)\n\
                   \tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f)\n\
                   \t/lib64/ld-linux-x86-64.so.2 (0x00007f)\n";
        assert_eq!(
            parse_ldd(out).unwrap(),
            [
                "/lib/x86_64-linux-gnu/libcurl.so.4",
                "/lib/x86_64-linux-gnu/libc.so.6",
                "/lib64/ld-linux-x86-64.so.2"
            ]
            .map(PathBuf::from)
        );
        assert!(parse_ldd("\tlibfoo.so.1 => not found\n").is_err());
    }

    /// deploy/Containerfile documents the image `cargo xtask image` writes: the same entry
    /// point, command, PATH and file.
    #[test]
    fn lb_image_matches_the_containerfile() {
        let containerfile =
            fs::read_to_string(crate::process::workspace_root().join("deploy/Containerfile"))
                .unwrap();
        let instruction = |word: &str| -> String {
            containerfile
                .lines()
                .find_map(|l| l.strip_prefix(word).map(|rest| rest.trim().to_owned()))
                .unwrap_or_else(|| panic!("no {word} in deploy/Containerfile"))
        };
        let tmp = TempDir::new("lb-image");
        // An ELF header without program headers (so no interpreter) stands in for lb.
        let lb = tmp.0.join("lb");
        let mut elf = b"\x7fELF\x02\x01\x01".to_vec();
        elf.resize(64, 0);
        fs::write(&lb, &elf).unwrap();
        let (name, out) = lb_image(&lb, &tmp.0.join("out")).unwrap();
        assert_eq!(name, crate::image::name());
        let (_, config, entries) = read_archive(&out);
        let config = &config["config"];
        assert_eq!(
            config["Entrypoint"],
            serde_json::from_str::<serde_json::Value>(&instruction("ENTRYPOINT ")).unwrap()
        );
        assert_eq!(
            config["Cmd"],
            serde_json::from_str::<serde_json::Value>(&instruction("CMD ")).unwrap()
        );
        assert_eq!(config["Env"], serde_json::json!([instruction("ENV ")]));
        assert_eq!(instruction("COPY "), "lb /usr/local/bin/lb");
        let files: Vec<&String> = entries
            .iter()
            .filter(|(_, e)| e.kind != tar::EntryType::Directory)
            .map(|(p, _)| p)
            .collect();
        assert_eq!(files, ["usr/local/bin/lb"]);
        assert_eq!(entries["usr/local/bin/lb"].mode, 0o755);
        assert_eq!(entries["usr/local/bin/lb"].data, elf);
    }
}

/// The archives imported into a real containerd and run, as a node would: needs root, runc on
/// PATH, and containerd v2 (`containerd`, `ctr`, `containerd-shim-runc-v2`) plus the inputs
/// (`pause`, `agnhost`, `regression-issue-74839`) in one directory, `$XTASK_E2E_BIN` or
/// target/tools/bin. Run with `cargo test -p xtask -- --ignored --nocapture containerd`.
#[cfg(test)]
mod containerd {
    use std::{
        process::{Child, Output, Stdio},
        thread,
        time::{Duration, Instant},
    };

    use super::*;
    use crate::process::workspace_root;

    /// A containerd of its own (root, state, socket in a fresh directory), a network namespace
    /// for the containers, and the containers started; all torn down on drop.
    struct Containerd {
        dir: PathBuf,
        bin: PathBuf,
        daemon: Child,
        netns: String,
        containers: Vec<String>,
    }

    fn text(out: &Output) -> String {
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    }

    impl Containerd {
        fn start(bin: &Path) -> Self {
            let dir = std::env::temp_dir().join(format!("xtask-ctd-{}", std::process::id()));
            let _ = fs::remove_dir_all(&dir);
            fs::create_dir_all(&dir).unwrap();
            let config = format!(
                "version = 3\nroot = \"{d}/root\"\nstate = \"{d}/state\"\n\
                 [grpc]\n  address = \"{d}/containerd.sock\"\n\
                 [ttrpc]\n  address = \"{d}/containerd.sock.ttrpc\"\n\
                 [plugins.\"io.containerd.cri.v1.runtime\"]\n  restrict_oom_score_adj = true\n",
                d = dir.display()
            );
            fs::write(dir.join("config.toml"), config).unwrap();
            let log = fs::File::create(dir.join("containerd.log")).unwrap();
            let path = format!(
                "{}:{}",
                bin.display(),
                std::env::var("PATH").unwrap_or_default()
            );
            let daemon = Command::new(bin.join("containerd"))
                .arg("--config")
                .arg(dir.join("config.toml"))
                .env("PATH", &path)
                .stdin(Stdio::null())
                .stdout(log.try_clone().unwrap())
                .stderr(log)
                .spawn()
                .expect("containerd");
            let netns = format!("xtask-oci-{}", std::process::id());
            let mut ctd = Self {
                dir,
                bin: bin.to_owned(),
                daemon,
                netns,
                containers: Vec::new(),
            };
            let ns = Command::new("ip")
                .args(["netns", "add", &ctd.netns])
                .output()
                .unwrap();
            assert!(ns.status.success(), "ip netns add: {}", text(&ns));
            let lo = Command::new("ip")
                .args(["-n", &ctd.netns, "link", "set", "lo", "up"])
                .output()
                .unwrap();
            assert!(lo.status.success(), "lo up: {}", text(&lo));
            let start = Instant::now();
            while !ctd.dir.join("containerd.sock").exists() {
                assert!(
                    start.elapsed() < Duration::from_secs(30),
                    "containerd did not start: {}",
                    fs::read_to_string(ctd.dir.join("containerd.log")).unwrap_or_default()
                );
                if let Ok(Some(status)) = ctd.daemon.try_wait() {
                    panic!(
                        "containerd exited ({status}): {}",
                        fs::read_to_string(ctd.dir.join("containerd.log")).unwrap_or_default()
                    );
                }
                thread::sleep(Duration::from_millis(100));
            }
            ctd
        }

        fn ctr(&self, args: &[&str]) -> Output {
            Command::new(self.bin.join("ctr"))
                .arg("--address")
                .arg(self.dir.join("containerd.sock"))
                .args(["--namespace", "k8s.io"])
                .args(args)
                .stdin(Stdio::null())
                .output()
                .unwrap()
        }

        fn ok(&self, args: &[&str]) -> String {
            let out = self.ctr(args);
            assert!(
                out.status.success(),
                "ctr {}: {}",
                args.join(" "),
                text(&out)
            );
            String::from_utf8_lossy(&out.stdout).into_owned()
        }

        fn ns_flag(&self) -> String {
            format!("network:/var/run/netns/{}", self.netns)
        }

        /// `ctr run --rm` of `argv` in `image`, in the namespace; its output.
        fn run(&mut self, image: &str, id: &str, argv: &[&str]) -> String {
            let ns = self.ns_flag();
            let mut args = vec!["run", "--rm", "--with-ns", &ns, image, id];
            args.extend(argv);
            self.ok(&args)
        }

        /// `ctr run -d`: a task left running (killed on drop).
        fn start_task(&mut self, image: &str, id: &str, extra: &[&str], argv: &[&str]) {
            let ns = self.ns_flag();
            let mut args = vec!["run", "-d", "--with-ns", &ns];
            args.extend(extra);
            args.extend([image, id]);
            args.extend(argv);
            self.containers.push(id.to_owned());
            self.ok(&args);
        }

        /// The task's status from `ctr task ls` (`RUNNING`, `STOPPED`).
        fn status(&self, id: &str) -> String {
            self.ok(&["task", "ls"])
                .lines()
                .find_map(|l| {
                    let f: Vec<&str> = l.split_whitespace().collect();
                    (f.first() == Some(&id)).then(|| f.get(2).unwrap_or(&"").to_string())
                })
                .unwrap_or_default()
        }
    }

    impl Drop for Containerd {
        fn drop(&mut self) {
            for id in self.containers.clone() {
                let _ = self.ctr(&["task", "kill", "--signal", "SIGKILL", &id]);
                let start = Instant::now();
                while self.status(&id) == "RUNNING" && start.elapsed() < Duration::from_secs(10) {
                    thread::sleep(Duration::from_millis(100));
                }
                let _ = self.ctr(&["task", "delete", "--force", &id]);
                let _ = self.ctr(&["container", "delete", &id]);
            }
            let _ = Command::new("kill")
                .arg(self.daemon.id().to_string())
                .status();
            let start = Instant::now();
            while !matches!(self.daemon.try_wait(), Ok(Some(_))) {
                if start.elapsed() > Duration::from_secs(15) {
                    let _ = self.daemon.kill();
                    let _ = self.daemon.wait();
                    break;
                }
                thread::sleep(Duration::from_millis(100));
            }
            // Anything containerd left mounted under its root, innermost first.
            let mounts = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
            let mut ours: Vec<&str> = mounts
                .lines()
                .filter_map(|l| l.split(' ').nth(4))
                .filter(|m| Path::new(m).starts_with(&self.dir))
                .collect();
            ours.sort_by_key(|m| std::cmp::Reverse(m.len()));
            for m in ours {
                let _ = Command::new("umount").args(["-l", m]).status();
            }
            let _ = Command::new("ip")
                .args(["netns", "delete", &self.netns])
                .status();
            let _ = fs::remove_dir_all(&self.dir);
        }
    }

    /// Runs `script` in agnhost with `sh -c` until its output contains `want` (20 tries).
    fn eventually(ctd: &mut Containerd, id: &str, script: &str, want: &str) -> String {
        let mut last = String::new();
        for i in 0..20 {
            last = ctd.run(AGNHOST, &format!("{id}-{i}"), &["/bin/sh", "-c", script]);
            if last.contains(want) {
                return last;
            }
            thread::sleep(Duration::from_millis(500));
        }
        panic!("`{script}` never printed {want:?}; last: {last}");
    }

    #[test]
    #[ignore = "needs root, runc, containerd and the e2e binaries"]
    fn archives_import_and_run_in_containerd() {
        let bin = std::env::var_os("XTASK_E2E_BIN")
            .map_or_else(|| workspace_root().join("target/tools/bin"), PathBuf::from);
        let inputs = E2eInputs {
            pause: bin.join("pause"),
            agnhost: bin.join("agnhost"),
            boom_server: bin.join("regression-issue-74839"),
        };
        let out = workspace_root().join("target/e2e-images");
        let archives = e2e_images(&inputs, &out).unwrap();
        let mut ctd = Containerd::start(&bin);
        for (name, archive) in &archives {
            let shown = ctd.ok(&["images", "import", archive.to_str().unwrap()]);
            eprintln!(
                "imported {name}: {}",
                shown.lines().next().unwrap_or_default()
            );
        }
        let listed = ctd.ok(&["images", "ls", "--quiet"]);
        for (name, _) in &archives {
            assert!(listed.lines().any(|l| l == name), "{name} in {listed}");
        }

        // agnhost's userland: the host tools by name, busybox for the rest.
        let shown = ctd.run(
            AGNHOST,
            "userland",
            &[
                "/bin/sh",
                "-c",
                "echo ok; nc -h 2>&1 | head -1; nslookup -version 2>&1; dig -v 2>&1; \
                 curl --version | head -1; seq 3; ip -V; bash -c 'echo bash'; \
                 getent passwd user-defined-in-image; id user-defined-in-image; \
                 timeout 1 sleep 5; echo timeout=$?; stat -c %a /tmp; ls /agnhost-2; \
                 readlink -f /bin/sh; command -v nc",
            ],
        );
        for want in [
            "ok\n",
            "OpenBSD netcat",
            "nslookup 9.18",
            "DiG 9.18",
            "curl 7.",
            "1\n2\n3\n",
            "iproute2",
            "bash\n",
            "user-defined-in-image:x:1000:1000:",
            "groups=1000(user-defined-in-image),50000(group-defined-in-image)",
            "timeout=124",
            "/usr/bin/dash\n/usr/bin/nc\n",
            "1777",
            "/agnhost-2",
        ] {
            assert!(shown.contains(want), "{want:?} in:\n{shown}");
        }

        // The specs' probes against agnhost netexec: curl and TCP/UDP nc.
        ctd.start_task(
            AGNHOST,
            "netexec",
            &[],
            &["/agnhost", "netexec", "--http-port=8080", "--udp-port=8081"],
        );
        eventually(
            &mut ctd,
            "curl",
            "curl -g -q -s --max-time 15 --connect-timeout 1 http://127.0.0.1:8080/echo?msg=hi",
            "hi",
        );
        eventually(
            &mut ctd,
            "nc-tcp",
            "nc -v -t -w 2 127.0.0.1 8080 </dev/null 2>&1",
            "succeeded",
        );
        let udp = eventually(
            &mut ctd,
            "nc-udp",
            "echo echo hello-udp | nc -v -u -w 2 127.0.0.1 8081 2>&1",
            "hello-udp",
        );
        eprintln!("nc -u: {udp}");

        // busybox's sh and applets. (Not its wget: Debian bookworm's busybox 1.35 wget
        // segfaults, static or not; the specs' wget runs in agnhost, which has GNU wget.)
        let shown = ctd.run(
            BUSYBOX,
            "busybox",
            &[
                "sh",
                "-c",
                "echo hi | nc -w 2 127.0.0.1 8080 >/dev/null && echo nc-ok; seq 2; ls /bin | wc -l",
            ],
        );
        assert!(shown.contains("nc-ok\n1\n2\n"), "{shown}");

        // nginx serves its page on :80.
        ctd.start_task(NGINX, "nginx", &[], &[]);
        eventually(
            &mut ctd,
            "nginx",
            "curl -s --connect-timeout 1 http://127.0.0.1:80/",
            "Welcome to nginx!",
        );

        // The boom server listens on 9000 with the downward API's POD_IP.
        ctd.start_task(
            REGRESSION_ISSUE_74839,
            "boom",
            &["--env", "POD_IP=127.0.0.1"],
            &[],
        );
        eventually(
            &mut ctd,
            "boom",
            "nc -z -v -w 2 127.0.0.1 9000 2>&1",
            "succeeded",
        );

        // pause runs until SIGTERM, then exits.
        ctd.start_task(PAUSE, "pause", &[], &[]);
        thread::sleep(Duration::from_secs(1));
        assert_eq!(ctd.status("pause"), "RUNNING");
        ctd.ok(&["task", "kill", "--signal", "SIGTERM", "pause"]);
        let start = Instant::now();
        while ctd.status("pause") != "STOPPED" {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "pause still {} 10 s after SIGTERM",
                ctd.status("pause")
            );
            thread::sleep(Duration::from_millis(100));
        }
        for (name, archive) in &archives {
            eprintln!(
                "{name}: {:.1} MB archive",
                fs::metadata(archive).unwrap().len() as f64 / 1e6
            );
        }
    }
}
