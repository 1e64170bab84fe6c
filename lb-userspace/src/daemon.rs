//! `lb run`: load and attach the datapath, program it from a source, follow changes.
use std::{
    path::{Path, PathBuf},
    time::Instant,
};

use anyhow::Context as _;
use aya::programs::TcAttachType;
use tokio::signal::unix::{SignalKind, signal};

use crate::{
    bpf::{Datapath, LoadOptions},
    manifests,
    maps::LbMaps,
    reconcile::Reconciler,
    translate,
};

#[derive(Clone, Debug)]
pub struct RunOptions {
    pub manifests: PathBuf,
    pub pin_dir: PathBuf,
    /// cgroup v2 directory for socket LB; `None` turns socket LB off.
    pub cgroup: Option<PathBuf>,
    pub tc_ingress: Vec<String>,
    pub tc_egress: Vec<String>,
}

/// Runs until SIGINT or SIGTERM; SIGHUP re-reads the manifests.
pub async fn run(opts: RunOptions) -> anyhow::Result<()> {
    let mut datapath = Datapath::load(&LoadOptions {
        pin_dir: Some(opts.pin_dir.clone()),
    })?;
    datapath.spawn_kernel_logger();
    let maps = datapath.take_lb_maps()?;
    let mut reconciler = Reconciler::new(maps).context("reading the pinned maps")?;
    tracing::info!(
        pin_dir = %opts.pin_dir.display(),
        services = reconciler.service_count(),
        backends = reconciler.backend_count(),
        "loaded datapath; pinned state reused"
    );

    // Program the maps before attaching, so the first packet already sees the full state.
    let mut generation = 1;
    sync(&mut reconciler, &opts.manifests, generation);

    for iface in &opts.tc_ingress {
        datapath.attach_tc(iface, TcAttachType::Ingress)?;
    }
    for iface in &opts.tc_egress {
        datapath.attach_tc(iface, TcAttachType::Egress)?;
    }
    if let Some(cgroup) = &opts.cgroup {
        datapath.attach_cgroup(cgroup)?;
    }
    tracing::info!(attached = ?datapath.attachments(), "ready");

    let mut hup = signal(SignalKind::hangup())?;
    let mut term = signal(SignalKind::terminate())?;
    loop {
        tokio::select! {
            _ = hup.recv() => {
                generation += 1;
                sync(&mut reconciler, &opts.manifests, generation);
            }
            _ = term.recv() => break,
            r = tokio::signal::ctrl_c() => { r?; break }
        }
    }
    tracing::info!("shutting down; detaching programs, keeping pinned maps");
    drop(datapath);
    Ok(())
}

/// Reads the manifests and applies them. A directory that cannot be read keeps the previous
/// state; bad objects are skipped one by one.
pub fn sync<M: LbMaps>(reconciler: &mut Reconciler<M>, dir: &Path, generation: u64) -> bool {
    let start = Instant::now();
    let (objects, problems) = match manifests::load_dir(dir) {
        Ok(r) => r,
        Err(e) => {
            tracing::error!(
                generation,
                error = format!("{e:#}"),
                "cannot read manifests; keeping the previous state"
            );
            return false;
        }
    };
    for p in &problems {
        tracing::warn!(problem = %p, "skipping manifest document");
    }
    let translation = translate::desired_state(&objects.services, &objects.slices);
    for s in &translation.skipped {
        tracing::warn!(skipped = %s, "skipping object");
    }
    let report = reconciler.apply(&translation.state);
    for e in &report.errors {
        tracing::error!(frontend = %e.frontend, service = %e.service, error = %e.error, "service not programmed; previous state kept");
    }
    tracing::info!(
        generation,
        services = translation.state.services.len(),
        backends = translation.state.backend_count(),
        writes = report.writes,
        deletes = report.deletes,
        errors = report.errors.len(),
        skipped = translation.skipped.len() + problems.len(),
        elapsed_us = start.elapsed().as_micros() as u64,
        "synced"
    );
    report.errors.is_empty()
}
