//! The container image, really built: `cargo xtask image` (a statically linked `lb`, then the
//! OCI archive target/image/lb.oci.tar that xtask writes itself, as deploy/Containerfile
//! describes the image). The test reads the archive as an importer does (index.json → manifest →
//! config and layer, each blob checked against its digest), unpacks the image's filesystem, runs
//! its `lb` chrooted into it (nothing but the binary is there) and on the host
//! (`lb trace --manifests` through the real datapath, and the init container's
//! `lb mount-bpffs` in a private mount namespace), and checks that the DaemonSet names the
//! image that was built. Needs root and `tar`.
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

fn sha256sum(path: &Path) -> String {
    let out = Command::new("sha256sum").arg(path).output().unwrap();
    ok("sha256sum", out)
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_owned()
}

/// A directory removed on drop.
struct Extracted {
    dir: PathBuf,
}

impl Drop for Extracted {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// The archive unpacked into `oci/`: its index, manifest and config (each blob's digest and
/// size checked), and the layer unpacked into `rootfs/`; returns the config and the layer's
/// compressed size.
fn unpack(archive: &Path, extracted: &Extracted) -> (Value, Value, u64) {
    let oci = extracted.dir.join("oci");
    let rootfs = extracted.dir.join("rootfs");
    fs::create_dir_all(&oci).unwrap();
    fs::create_dir_all(&rootfs).unwrap();
    let out = Command::new("tar")
        .arg("-xf")
        .arg(archive)
        .arg("-C")
        .arg(&oci)
        .output()
        .unwrap();
    ok("tar -x (archive)", out);
    let blob = |descriptor: &Value| -> PathBuf {
        let digest = descriptor["digest"].as_str().unwrap();
        let hex = digest.strip_prefix("sha256:").unwrap();
        let path = oci.join("blobs/sha256").join(hex);
        assert_eq!(sha256sum(&path), hex, "blob {digest}");
        assert_eq!(
            descriptor["size"].as_u64(),
            Some(fs::metadata(&path).unwrap().len()),
            "{descriptor}"
        );
        path
    };
    let json = |path: &Path| -> Value { serde_json::from_slice(&fs::read(path).unwrap()).unwrap() };
    let index = json(&oci.join("index.json"));
    let manifests = index["manifests"].as_array().unwrap();
    assert_eq!(manifests.len(), 1, "{index}");
    let manifest = json(&blob(&manifests[0]));
    let config = json(&blob(&manifest["config"]));
    let layers = manifest["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 1, "one layer: {manifest}");
    let layer = blob(&layers[0]);
    let out = Command::new("tar")
        .arg("-xzf")
        .arg(&layer)
        .arg("-C")
        .arg(&rootfs)
        .output()
        .unwrap();
    ok("tar -xz (layer)", out);
    let size = fs::metadata(&layer).unwrap().len();
    (manifests[0].clone(), config, size)
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

    // The archive names the image for `ctr images import`; one layer, the entry point lb, and
    // lb reachable by name for the DaemonSet's commands.
    let archive = root().join("target/image/lb.oci.tar");
    let extracted = Extracted {
        dir: std::env::temp_dir().join(format!("lb-image-test-{}", std::process::id())),
    };
    let _ = fs::remove_dir_all(&extracted.dir);
    let (descriptor, image, size) = unpack(&archive, &extracted);
    assert_eq!(
        descriptor["annotations"]["io.containerd.image.name"].as_str(),
        Some(name.as_str()),
        "{descriptor}"
    );
    assert_eq!(image["architecture"], "amd64");
    assert_eq!(image["os"], "linux");
    assert_eq!(
        image["config"]["Entrypoint"],
        serde_json::json!(["/usr/local/bin/lb"])
    );
    assert_eq!(image["config"]["Cmd"], serde_json::json!(["run"]));
    assert!(
        image["config"]["Env"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e == "PATH=/usr/local/bin"),
        "{}",
        image["config"]
    );
    assert_eq!(image["rootfs"]["diff_ids"].as_array().unwrap().len(), 1);
    eprintln!("image {name}: {:.1} MB compressed", size as f64 / 1e6);
    for c in pod["initContainers"].as_array().unwrap() {
        assert_eq!(c["command"][0], "lb", "{c}");
    }

    // Nothing in the image but lb: no shell, no libc, no loader.
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
