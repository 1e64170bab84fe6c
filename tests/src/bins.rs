//! The workspace's binaries (`lb`, `lb-echo`, `lb-bench`), found in the target directory the
//! running executable was built into. `lb` belongs to another package, so cargo does not build
//! it for these tests: `cargo build --bins` (which `cargo xtask test` runs first) does.
use std::{
    collections::BTreeMap,
    ffi::OsStr,
    path::{Path, PathBuf},
    sync::{Mutex, PoisonError},
};

use anyhow::{Context as _, ensure};

/// `lb`, the product.
pub const LB: &Bin = &Bin("lb");
/// `lb-echo`, the backend and client of the netns tests and the demo.
pub const LB_ECHO: &Bin = &Bin("lb-echo");
/// `lb-bench`, the benchmarks.
pub const LB_BENCH: &Bin = &Bin("lb-bench");

/// Path of binary `name` in the target directory of the running executable:
/// `target/<profile>/` for binaries, whose test executables live in `target/<profile>/deps/`.
pub fn bin_path(name: &str) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe().context("locating the running executable")?;
    let mut dir = exe
        .parent()
        .context("the running executable has no directory")?;
    if dir.file_name() == Some(OsStr::new("deps")) {
        dir = dir.parent().context("deps/ has no parent directory")?;
    }
    let path = dir.join(name);
    ensure!(
        path.is_file(),
        "{} not found; build the binaries first with `cargo build --bins` (`cargo xtask test` \
         does)",
        path.display()
    );
    Ok(path)
}

/// A binary of the workspace, usable where a path is (`Command::new(LB)`, `Path::new(LB)`).
/// It is looked up with [`bin_path`] on first use; for the tests, a missing binary panics with
/// that error (use [`Bin::path`] to handle it).
#[derive(Debug)]
pub struct Bin(&'static str);

impl Bin {
    pub fn path(&self) -> anyhow::Result<PathBuf> {
        bin_path(self.0)
    }

    fn cached(&self) -> &'static Path {
        // Leaked once per binary name: a handful of paths for the life of a test process.
        static FOUND: Mutex<BTreeMap<&str, &Path>> = Mutex::new(BTreeMap::new());
        let mut found = FOUND.lock().unwrap_or_else(PoisonError::into_inner);
        found.entry(self.0).or_insert_with(|| match self.path() {
            Ok(p) => Box::leak(p.into_boxed_path()),
            Err(e) => panic!("{e:#}"),
        })
    }
}

impl AsRef<Path> for Bin {
    fn as_ref(&self) -> &Path {
        self.cached()
    }
}

impl AsRef<OsStr> for Bin {
    fn as_ref(&self) -> &OsStr {
        self.cached().as_os_str()
    }
}

/// A tool `cargo xtask setup` builds into `target/tools/bin` (kube-apiserver, etcd, kubectl, …;
/// see xtask/src/setup/kube.rs).
pub fn kube_tool(name: &str) -> anyhow::Result<PathBuf> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../target/tools/bin")
        .join(name);
    ensure!(
        path.is_file(),
        "{} not found; `cargo xtask setup` builds it (`cargo xtask test` runs setup first)",
        path.display()
    );
    Ok(path)
}
