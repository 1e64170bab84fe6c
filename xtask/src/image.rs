//! `cargo xtask image`: the container image, `FROM scratch` with a statically linked `lb`.
//!
//! No registry is reachable from the machines lb is built on, so the image cannot start from a
//! distribution's base image; a static binary needs none. glibc is linked statically
//! (`+crt-static` on the host's gnu target): rustup cannot download a musl target here. The
//! eBPF object is embedded in `lb` (aya's `include_bytes_aligned!`), so the binary is the
//! whole image.
//!
//! The image is written as an OCI archive by xtask itself ([`crate::oci`]), no container engine
//! involved: `target/image/lb.oci.tar`, for `ctr -n k8s.io images import` on a node (or
//! `podman load -i`). deploy/Containerfile describes the same image for any other builder; a
//! unit test keeps the two in step.
use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
    time::Instant,
};

use anyhow::{Context as _, Result, bail, ensure};

use crate::{
    images, oci,
    process::{cargo, probe, run, workspace_root},
    setup,
};

/// The image's repository; the tag is the workspace version. deploy/daemonset.yaml names it.
pub const REPOSITORY: &str = "registry.example.invalid/lb";

pub fn name() -> String {
    format!("{REPOSITORY}:{}", env!("CARGO_PKG_VERSION"))
}

/// Builds the static `lb`, then writes the image's archive into target/image/; prints the
/// image's name, digest, size and the time writing took.
pub fn image() -> Result<()> {
    setup::setup()?;
    let lb = static_lb()?;
    let dir = workspace_root().join("target/image");
    let start = Instant::now();
    let (name, archive) = images::lb_image(&lb, &dir)?;
    let took = start.elapsed();
    let digest = oci::manifest_digest(&archive)?;
    println!(
        "image: {name} (digest {}, {:.1} MB, written in {:.1} s from {}) in {}",
        &digest[..digest.len().min("sha256:".len() + 12)],
        fs::metadata(&archive)?.len() as f64 / 1e6,
        took.as_secs_f64(),
        lb.display(),
        archive.display()
    );
    Ok(())
}

/// `cargo build --release` of `lb` for the host's target with glibc linked statically;
/// returns the binary, checked to need no dynamic loader.
pub fn static_lb() -> Result<PathBuf> {
    let host = probe(Command::new("rustc").arg("-vV"))?
        .lines()
        .find_map(|l| l.strip_prefix("host: ").map(str::to_owned))
        .context("no host line in `rustc -vV`")?;
    ensure!(
        host.ends_with("-linux-gnu"),
        "static lb: host target {host} is not a glibc Linux target"
    );
    // Only for the target: build scripts and proc macros (host artifacts with --target) stay
    // dynamic, and aya-build's child build of lb-ebpf (the BPF target) is not touched.
    let var = format!(
        "CARGO_TARGET_{}_RUSTFLAGS",
        host.to_uppercase().replace('-', "_")
    );
    run(cargo()
        .args(["build", "--release", "--locked", "--target", &host])
        .args(["--package", "lb-userspace", "--bin", "lb"])
        .env(var, "-C target-feature=+crt-static"))?;
    let lb = workspace_root().join(format!("target/{host}/release/lb"));
    if let Some(interp) = elf_interpreter(&lb)? {
        bail!(
            "{} is dynamically linked (interpreter {interp}); the image has no libc",
            lb.display()
        );
    }
    Ok(lb)
}

/// The `PT_INTERP` path of a 64-bit little-endian ELF file, `None` for a static binary.
pub fn elf_interpreter(path: &Path) -> Result<Option<String>> {
    let elf = fs::read(path).with_context(|| format!("read {}", path.display()))?;
    let field = |at: usize, len: usize| -> Result<u64> {
        let bytes = elf.get(at..at + len).context("truncated ELF header")?;
        Ok(bytes
            .iter()
            .rev()
            .fold(0u64, |acc, b| (acc << 8) | u64::from(*b)))
    };
    ensure!(
        elf.starts_with(b"\x7fELF\x02\x01"),
        "{} is not a 64-bit little-endian ELF file",
        path.display()
    );
    let (phoff, phentsize, phnum) = (field(0x20, 8)?, field(0x36, 2)?, field(0x38, 2)?);
    const PT_INTERP: u64 = 3;
    for i in 0..phnum {
        let ph = usize::try_from(phoff + i * phentsize)?;
        if field(ph, 4)? == PT_INTERP {
            let (offset, size) = (
                usize::try_from(field(ph + 8, 8)?)?,
                usize::try_from(field(ph + 32, 8)?)?,
            );
            let bytes = elf
                .get(offset..offset + size)
                .context("truncated PT_INTERP")?;
            return Ok(Some(
                String::from_utf8_lossy(bytes)
                    .trim_end_matches('\0')
                    .to_owned(),
            ));
        }
    }
    Ok(None)
}
