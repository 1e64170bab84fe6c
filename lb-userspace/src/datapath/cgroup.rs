//! Where the unified (v2) cgroup hierarchy is mounted: socket LB attaches to a cgroup v2
//! directory, and `lb status` names the cgroups programs are attached to.
use std::{fs, io, path::PathBuf};

use anyhow::Context as _;

/// Mount points of cgroup v2, shortest first.
pub fn cgroup2_mounts() -> io::Result<Vec<PathBuf>> {
    let mounts = fs::read_to_string("/proc/self/mounts")?;
    let mut out: Vec<PathBuf> = mounts
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (_, path, fs_type) = (f.next()?, f.next()?, f.next()?);
            (fs_type == "cgroup2").then(|| PathBuf::from(path))
        })
        .collect();
    out.sort_by_key(|p| p.components().count());
    out.dedup();
    Ok(out)
}

/// The cgroup v2 root: the shortest cgroup2 mount point.
pub fn cgroup2_root() -> anyhow::Result<PathBuf> {
    cgroup2_mounts()
        .context("reading /proc/self/mounts")?
        .into_iter()
        .next()
        .context("no cgroup2 mount found; pass --cgroup-path or --socket-lb=false")
}
