//! The scale cases, lb only: at each shape (services × endpoints per service; by default
//! 10,000 × 10, 50,000 × 1 as Cilium's control-plane benchmark, and 100,000 × 10, a million
//! endpoints), everything through [`Daemon`], the daemon's own sync path:
//!
//! - cold start: `Reconciler::new` + the first sync into fresh private maps sized to fit (the
//!   load of programs and maps not timed);
//! - one change: one endpoint of a random service's EndpointSlice replaced, in a snapshot of
//!   its own, to the last map write (`ChangeDetector::observe` + `daemon::sync_node`: the
//!   incremental translation and `Reconciler::apply_update`);
//! - burst: that for 1,000 services in one snapshot, as the source coalesces changes that
//!   arrive during a sync;
//! - periodic full sync (`--full-sync-interval`): the same snapshot again with `full`, which
//!   translates everything anew, re-reads the maps and compares; it must repair nothing;
//! - peak RSS (VmHWM) and the maps' memlock of fresh `lb-bench rss` children holding the shape.
use std::time::Duration;

use anyhow::ensure;

use super::{Daemon, SUITE, load_options, replace_endpoint, rss_samples};
use crate::workload::{self, Results, Rng};

/// One scale shape and how often each of its measurements repeats.
#[derive(Clone, Debug)]
pub struct Shape {
    pub services: usize,
    pub endpoints: usize,
    /// Cold starts, and periodic full syncs.
    pub reps: usize,
    /// Single changes, each in a snapshot of its own.
    pub changes: usize,
    /// Changes per burst snapshot.
    pub burst: usize,
    pub bursts: usize,
    /// Fresh child processes for the peak RSS.
    pub rss_reps: usize,
}

/// Endpoints from which a shape gets fewer repetitions (each cold start or full sync takes
/// seconds there).
const LARGE: usize = 1_000_000;

impl Shape {
    /// `services` × `endpoints` with the repetitions of its size.
    pub fn new(services: usize, endpoints: usize, quick: bool) -> Self {
        let large = services * endpoints >= LARGE;
        if quick {
            Self {
                services,
                endpoints,
                reps: 1,
                changes: 20,
                burst: 50,
                bursts: 3,
                rss_reps: 1,
            }
        } else {
            Self {
                services,
                endpoints,
                reps: if large { 3 } else { 5 },
                changes: if large { 500 } else { 1_000 },
                burst: 1_000,
                bursts: if large { 5 } else { 10 },
                rss_reps: if large { 2 } else { 3 },
            }
        }
    }

    /// The shapes, or tiny ones for `--quick`.
    pub fn defaults(quick: bool) -> Vec<Self> {
        let shapes: [(usize, usize); 3] = if quick {
            [(100, 10), (300, 1), (200, 10)]
        } else {
            [(10_000, 10), (50_000, 1), (100_000, 10)]
        };
        shapes
            .into_iter()
            .map(|(n, e)| Self::new(n, e, quick))
            .collect()
    }

    /// `10000x10+50000x1`: services × endpoints, with the repetitions of their size.
    pub fn parse(list: &str, quick: bool) -> Vec<Self> {
        list.split('+')
            .filter_map(|m| {
                let (n, e) = m.split_once('x')?;
                Some(Self::new(n.parse().ok()?, e.parse().ok()?, quick))
            })
            .collect()
    }
}

pub fn run(shapes: &[Shape], results: &mut Results) -> anyhow::Result<()> {
    for shape in shapes {
        let start = std::time::Instant::now();
        one(shape, results)?;
        println!(
            "controlplane: scale {} × {} done in {:.1} s",
            shape.services,
            shape.endpoints,
            start.elapsed().as_secs_f64()
        );
    }
    let (Some(first), large) = (
        shapes.first(),
        shapes.iter().find(|s| s.services * s.endpoints >= LARGE),
    ) else {
        return Ok(());
    };
    let fewer = large.map_or_else(String::new, |l| {
        format!(
            "; from {} endpoints on (each cold start and full sync takes seconds) fewer: {} \
             cold starts and full syncs, {} changes, {} bursts, {} RSS processes",
            LARGE, l.reps, l.changes, l.bursts, l.rss_reps
        )
    });
    results.note(
        "controlplane_scale_method",
        format!(
            "scale, lb only, at every shape through the daemon's own sync \
             (ChangeDetector::observe + daemon::sync_node) on private maps sized to fit: cold \
             start = Reconciler::new + the first sync into empty maps (the load not timed), \
             median of {} fresh loads; one change = one endpoint of a random service's \
             EndpointSlice replaced, snapshot to last map write (incremental translation + \
             Reconciler::apply_update), median and p99 of {}; burst = {} such changes in one \
             snapshot, median and p99 of {}; periodic full sync = the same snapshot again as \
             --full-sync-interval syncs it (everything translated anew, the maps re-read and \
             compared; it must find nothing to repair), median of {}; peak RSS and map \
             memlock: median of {} fresh `lb-bench rss` processes holding the shape \
             programmed{fewer}. Not timed: what the daemon does after the write (health check \
             listeners, connected-UDP re-steering)",
            first.reps, first.changes, first.burst, first.bursts, first.reps, first.rss_reps
        ),
    );
    Ok(())
}

/// Every measurement of one shape; the records are `scale_<E>_endpoints` at `services`.
fn one(shape: &Shape, results: &mut Results) -> anyhow::Result<()> {
    let (n, e) = (shape.services, shape.endpoints);
    let defs = workload::fillers(n, e);
    let mut w = Workload {
        objects: workload::objects(&defs),
        defs,
        rng: Rng::new(0x5ca1e ^ n as u64),
        changed: 0,
    };
    println!("controlplane: scale {n} × {e}: objects generated");
    if let (_, Some(maps)) = load_options(n, e) {
        results.note(
            &format!("controlplane_maps_{n:06}x{e}"),
            format!("lb programmed {n} services × {e} endpoints with --bpf-map-max {maps}"),
        );
    }
    let (mut daemon, mut cold) = cold_starts(shape, &w)?;
    println!("controlplane: scale {n} × {e}: cold starts done");
    let mut change = Vec::with_capacity(shape.changes);
    for _ in 0..shape.changes {
        change.push(w.sync(&mut daemon, 1)?);
    }
    let mut burst = Vec::with_capacity(shape.bursts);
    for _ in 0..shape.bursts {
        burst.push(w.sync(&mut daemon, shape.burst.min(n))?);
    }
    let mut full = Vec::with_capacity(shape.reps);
    for r in 0..shape.reps.max(1) {
        workload::check_interrupted()?;
        let (took, report) = daemon.full_sync(&w.objects.lb);
        ensure!(
            report.errors.is_empty() && report.writes + report.deletes == 0,
            "full sync {r} at {n} × {e} after the incremental syncs: {} writes, {} deletes \
             (repairs), errors {:?}",
            report.writes,
            report.deletes,
            report.errors.first()
        );
        full.push(ms(took));
    }
    drop((daemon, w));
    println!("controlplane: scale {n} × {e}: changes, bursts, full syncs done");

    let (mut hwm, mut memlock) = rss_samples(n, e, shape.rss_reps.max(1))?;
    let case = format!("scale_{e}_endpoints");
    let mut push = |metric: &str, v: &mut Vec<f64>, p99: bool, unit: &str| {
        let median = workload::median(v);
        let p = p99.then(|| workload::percentile(v, 99.0));
        results.push(SUITE, &case, "lb", n, metric, median, p, unit);
    };
    push("cold_start", &mut cold, false, "ms");
    push("change_to_map_write", &mut change, true, "ms");
    push("burst_to_map_write", &mut burst, true, "ms");
    push("full_sync", &mut full, true, "ms");
    push("peak_rss", &mut hwm, false, "MiB");
    push("bpf_map_memory", &mut memlock, false, "MiB");
    Ok(())
}

/// `shape.reps` cold starts, each on fresh maps: their times (ms), and the last daemon, which
/// goes on with the changes.
fn cold_starts(shape: &Shape, w: &Workload) -> anyhow::Result<(Daemon, Vec<f64>)> {
    let (n, e) = (shape.services, shape.endpoints);
    let mut cold = Vec::new();
    let mut daemon = None;
    for _ in 0..shape.reps.max(1) {
        workload::check_interrupted()?;
        // The previous maps go first: at a million endpoints they hold hundreds of MiB.
        drop(daemon.take());
        let (d, took) = Daemon::cold(&w.objects.lb, n, e)?;
        let (services, backends) = (d.reconciler.service_count(), d.reconciler.backend_count());
        ensure!(
            services == n && backends == n * e,
            "cold start of {n} × {e} programmed {services} services and {backends} backends"
        );
        cold.push(ms(took));
        daemon = Some(d);
    }
    let daemon = daemon.ok_or_else(|| anyhow::anyhow!("no cold start"))?;
    Ok((daemon, cold))
}

/// The objects of one shape as the changes leave them.
struct Workload {
    defs: Vec<workload::ServiceDef>,
    objects: workload::Objects,
    rng: Rng,
    /// Endpoints replaced so far (each change takes the next replacement address).
    changed: usize,
}

impl Workload {
    /// Replaces one endpoint in each of `count` distinct random services and syncs the
    /// snapshot: the sync's time (ms).
    fn sync(&mut self, daemon: &mut Daemon, count: usize) -> anyhow::Result<f64> {
        workload::check_interrupted()?;
        let n = self.defs.len();
        let picked: Vec<usize> = if count == 1 {
            vec![self.rng.below(n)]
        } else {
            let mut order: Vec<usize> = (0..n).collect();
            self.rng.shuffle(&mut order);
            order.truncate(count);
            order
        };
        for i in picked {
            replace_endpoint(&mut self.defs, &mut self.objects, i, self.changed);
            self.changed += 1;
        }
        let (took, report) = daemon.sync(&self.objects.lb);
        ensure!(
            report.errors.is_empty() && report.writes >= count,
            "{count} changes at {n} services: {} writes, errors {:?}",
            report.writes,
            report.errors.first()
        );
        Ok(ms(took))
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}
