//! The container image, really built: `cargo xtask image` (a statically linked `lb`, then
//! `podman build -f deploy/Containerfile` on a context holding only that binary). `podman run`
//! does not work on these machines (crun and the hybrid cgroup layout), so the test exports the
//! image's filesystem, runs its `lb` chrooted into it (nothing but the binary is there) and on
//! the host (`lb trace --manifests` through the real datapath, and the init container's
//! `lb mount-bpffs` in a private mount namespace), and checks that the DaemonSet names the
//! image that was built. Needs root and podman (`cargo xtask setup` installs it).
use std::{
    collections::BTreeSet,
    fs,
    path::{Path, PathBuf},
    process::{Command, Output, Stdio},
    time::Instant,
};

use serde_json::Value;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `registry.example.invalid/lb:<workspace version>`, what `cargo xtask image` tags.
fn image_name() -> String {
    format!("registry.example.invalid/lb:{}", env!("CARGO_PKG_VERSION"))
}

fn ok(what: &str, out: Output) -> String {
    assert!(
        out.status.success(),
        "{what}: {}\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn podman(args: &[&str]) -> String {
    let out = Command::new("podman")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("podman (`cargo xtask setup` installs it)");
    ok(&format!("podman {}", args.join(" ")), out)
}

/// A container of the image (created, never started) and a directory; both removed on drop.
struct Extracted {
    container: String,
    dir: PathBuf,
}

impl Drop for Extracted {
    fn drop(&mut self) {
        let _ = Command::new("podman")
            .args(["rm", "--force", &self.container])
            .output();
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// The image's filesystem, exported from a created container into a fresh directory.
fn export(image: &str) -> Extracted {
    let tag = format!("lb-image-test-{}", std::process::id());
    let extracted = Extracted {
        container: tag.clone(),
        dir: std::env::temp_dir().join(&tag),
    };
    podman(&["create", "--name", &tag, image]);
    let rootfs = extracted.dir.join("rootfs");
    fs::create_dir_all(&rootfs).unwrap();
    let tar = extracted.dir.join("rootfs.tar");
    podman(&["export", "--output", tar.to_str().unwrap(), &tag]);
    let out = Command::new("tar")
        .arg("-xf")
        .arg(&tar)
        .arg("-C")
        .arg(&rootfs)
        .output()
        .unwrap();
    ok("tar -x", out);
    extracted
}

/// Every file (not directory) under `dir`, relative to it.
fn files(dir: &Path, base: &Path, out: &mut BTreeSet<String>) {
    for entry in fs::read_dir(dir).unwrap() {
        let entry = entry.unwrap();
        let path = entry.path();
        if entry.file_type().unwrap().is_dir() {
            files(&path, base, out);
        } else {
            out.insert(path.strip_prefix(base).unwrap().display().to_string());
        }
    }
}

#[test]
fn image_builds_and_its_lb_runs_and_traces() {
    let name = image_name();

    // Built with the project's own command, as the README and the guide say.
    let start = Instant::now();
    let out = Command::new(env!("CARGO"))
        .args(["xtask", "image"])
        .current_dir(root())
        .stdin(Stdio::null())
        .output()
        .expect("cargo xtask image");
    let shown = ok("cargo xtask image", out);
    eprintln!(
        "cargo xtask image took {:.1} s: {}",
        start.elapsed().as_secs_f64(),
        shown.lines().last().unwrap_or_default()
    );

    // The DaemonSet runs that image, in both of its containers.
    let ds: Value =
        serde_yaml::from_str(&fs::read_to_string(root().join("deploy/daemonset.yaml")).unwrap())
            .unwrap();
    let pod = &ds["spec"]["template"]["spec"];
    for list in ["initContainers", "containers"] {
        for c in pod[list].as_array().unwrap() {
            assert_eq!(
                c["image"].as_str(),
                Some(name.as_str()),
                "{list} {}: the image `cargo xtask image` builds",
                c["name"]
            );
        }
    }

    // One layer, the entry point lb, and lb reachable by name for the DaemonSet's commands.
    let inspect: Value = serde_json::from_str(&podman(&["image", "inspect", &name])).unwrap();
    let image = &inspect[0];
    assert_eq!(
        image["Config"]["Entrypoint"],
        serde_json::json!(["/usr/local/bin/lb"])
    );
    assert_eq!(image["Config"]["Cmd"], serde_json::json!(["run"]));
    assert!(
        image["Config"]["Env"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e == "PATH=/usr/local/bin"),
        "{}",
        image["Config"]
    );
    assert_eq!(image["RootFS"]["Layers"].as_array().unwrap().len(), 1);
    eprintln!(
        "image {name}: {:.1} MB",
        image["Size"].as_f64().unwrap_or_default() / 1e6
    );
    for c in pod["initContainers"].as_array().unwrap() {
        assert_eq!(c["command"][0], "lb", "{c}");
    }

    // Nothing in the image but lb: no shell, no libc, no loader.
    let extracted = export(&name);
    let rootfs = extracted.dir.join("rootfs");
    let mut found = BTreeSet::new();
    files(&rootfs, &rootfs, &mut found);
    assert_eq!(
        found,
        BTreeSet::from(["usr/local/bin/lb".to_owned()]),
        "the image holds lb and nothing else"
    );
    let lb = rootfs.join("usr/local/bin/lb");

    // Chrooted into the image's filesystem, lb runs: it needs nothing the image lacks.
    let out = Command::new("/usr/sbin/chroot")
        .arg(&rootfs)
        .args(["/usr/local/bin/lb", "--version"])
        .env_clear()
        .output()
        .unwrap();
    let version = ok("chroot IMAGE lb --version", out);
    assert_eq!(version.trim(), format!("lb {}", env!("CARGO_PKG_VERSION")));

    // The init container's command, with the image's lb, in a mount namespace of its own: it
    // mounts bpffs where there is none, and leaves a bpffs alone.
    let mnt = extracted.dir.join("bpffs");
    let script = format!(
        "{lb} mount-bpffs --path {mnt} && {lb} mount-bpffs --path {mnt} && stat -f -c %T {mnt}",
        lb = lb.display(),
        mnt = mnt.display()
    );
    let out = Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c", &script])
        .output()
        .unwrap();
    let mounted = ok("unshare --mount lb mount-bpffs (twice)", out);
    assert_eq!(
        mounted.lines().collect::<Vec<_>>(),
        [
            format!("mounted bpffs at {}", mnt.display()),
            format!("bpffs already mounted at {}", mnt.display()),
            "bpf_fs".to_owned(),
        ],
    );

    // On the host, the extracted lb loads its embedded datapath and traces the examples'
    // service through it (BPF_PROG_TEST_RUN): all three backends, from 60 new flows.
    let examples = root().join("deploy/examples");
    let out = Command::new(&lb)
        .args(["trace", "--manifests"])
        .arg(&examples)
        .args([
            "--hostname-override",
            "node-a",
            "--src",
            "198.18.10.2",
            "--dst",
            "198.19.0.10:80",
            "--proto",
            "tcp",
            "--from",
            "pod",
            "--flows",
            "60",
            "--json",
        ])
        .output()
        .unwrap();
    let traced = ok("extracted lb trace --manifests", out);
    let mut backends = BTreeSet::new();
    for line in traced.lines() {
        let r: Value = serde_json::from_str(line).expect("trace JSON");
        assert_eq!(r["verdict"], "forward", "{r}");
        assert_eq!(r["service"], "demo/echo:tcp", "{r}");
        backends.insert(r["backend"].as_str().unwrap_or_default().to_owned());
    }
    assert_eq!(traced.lines().count(), 60);
    assert_eq!(
        backends,
        BTreeSet::from(
            ["198.18.11.2:8080", "198.18.12.2:8080", "198.18.13.2:8080"].map(str::to_owned)
        ),
        "the extracted lb's datapath spreads new flows over the examples' backends"
    );
    drop(extracted);
}
