//! Builds lb-ebpf from source with aya-build on every build of lb-userspace.
//!
//! The BPF target needs `-Z build-std=core`, so the child build runs on Debian's rustc (which
//! ships its std source) through the rustup toolchain `lb-debian` that `cargo xtask setup`
//! links, with RUSTC_BOOTSTRAP=1 and bpf-linker from target/tools/bin.
use std::{env, path::PathBuf};

use anyhow::{Context as _, bail};

const TOOLCHAIN: &str = "lb-debian";

fn main() -> anyhow::Result<()> {
    let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR")?);
    let root = manifest_dir.parent().context("workspace root")?;
    let tools = root.join("target/tools/bin");
    if !tools.join("bpf-linker").exists() {
        bail!(
            "bpf-linker not found in {}; run `cargo xtask setup` (the README's commands do)",
            tools.display()
        );
    }
    let path = env::var_os("PATH").unwrap_or_default();
    let path = env::join_paths(std::iter::once(tools).chain(env::split_paths(&path)))?;
    // SAFETY: build scripts are single-threaded; the variables reach aya-build's child cargo.
    unsafe {
        env::set_var("PATH", path);
        env::set_var("RUSTC_BOOTSTRAP", "1");
    }
    println!(
        "cargo:rerun-if-changed={}",
        root.join("lb-common/src").display()
    );
    println!(
        "cargo:rerun-if-changed={}",
        root.join("Cargo.lock").display()
    );

    let ebpf_dir = root.join("lb-ebpf");
    let ebpf_dir = ebpf_dir.to_str().context("non-UTF-8 path")?;
    aya_build::build_ebpf(
        [aya_build::Package {
            name: "lb-ebpf",
            root_dir: ebpf_dir,
            ..Default::default()
        }],
        aya_build::Toolchain::Custom(TOOLCHAIN),
    )
}
