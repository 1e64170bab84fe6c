//! `controlplane`: programming cost, from objects in memory.
//!
//! - cold: translate + Reconciler over fresh private BpfMaps for N services × E endpoints,
//!   next to `iptables-restore --noflush --counters` (legacy and nf_tables backends) of
//!   kube-proxy's full ruleset and `nft -f` of kube-proxy's full table, each into a fresh
//!   scratch netns;
//! - change: one EndpointSlice change (an endpoint replaced) to map write, through the
//!   daemon's own sync (`ChangeDetector::observe` + `daemon::sync_node`: the incremental
//!   translation and `Reconciler::apply_update`), over many changes, at 10,000 services × 10
//!   endpoints and 1,000 × 100; beside it the full sync (translate of every object + apply of
//!   the full state: what every sync did before, and what `--full-sync-interval` still does),
//!   and kube-proxy's reaction to the same kind of change: a full `iptables-restore`
//!   (kube-proxy rewrites the whole table on full syncs), the partial restore of kube-proxy ≥
//!   1.28 (`KUBE-SERVICES` plus the changed chains), and nftables mode's partial sync
//!   (`nft --json list chains ip` + the `nft -f` transaction);
//! - burst: 1,000 EndpointSlice changes published in one snapshot, through the daemon's sync;
//! - peak RSS (VmHWM) of a child process holding the objects, the desired state and the
//!   programmed maps, and the kernel memory of its maps (memlock);
//! - scale (`controlplane/scale.rs`), lb only: all of the above through the daemon's sync,
//!   plus its periodic full sync, at 10,000 × 10, 50,000 × 1 and 100,000 × 10.
use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail, ensure};
use lb::{
    daemon::{Observed, SyncKind, sync_node},
    datapath::load::{Datapath, LoadOptions},
    datapath::maps::BpfMaps,
    kube::changes::ChangeDetector,
    kube::source::Snapshot,
    metrics::{Metrics, kubeproxy::Changes},
    reconcile::{ApplyReport, Reconciler},
    translate::incremental::IncrementalTranslator,
    translate::{NodeInfo, desired_state},
};
use lb_common::{map_names, map_sizes};

use crate::{
    kubeproxy::{self, Config, ServicePort},
    netns::{self, Scratch, TempDir},
    workload::{self, Objects, Results, Rng, ServiceDef, Slim},
};

mod scale;

const SUITE: &str = "controlplane";

pub struct Settings {
    /// (services, endpoints per service) for the cold case.
    pub cold: Vec<(usize, usize)>,
    /// Largest service count each rules implementation is loaded at: their loading time
    /// grows faster than linearly, and 5 repetitions must fit the run's time budget.
    pub rules_max: [(Rules, usize); 3],
    pub reps: usize,
    /// The change case: services, endpoints per service, changes.
    pub change: (usize, usize, usize),
    /// More change cases, lb only: services, endpoints per service, changes.
    pub more_changes: Vec<(usize, usize, usize)>,
    /// The burst case: services, endpoints per service, changes per snapshot, snapshots.
    pub burst: (usize, usize, usize, usize),
    /// The peak-RSS case: services, endpoints per service.
    pub rss: (usize, usize),
    /// A case tried once with lb's default map sizes, to report whether it fits.
    pub attempt: Option<(usize, usize)>,
    /// The scale cases, lb only (`scale.rs`): cold start, changes, bursts, full syncs and
    /// memory at each shape.
    pub scale: Vec<scale::Shape>,
    /// Which cases run (attempt, cold, change, more, burst, rss, scale); all when empty.
    pub cases: Vec<String>,
    /// In the `more` cases: a full sync (on maps of its own) after every this many changes,
    /// and each change's time printed by whether a full sync came just before it (0: none).
    pub full_every: usize,
}

impl Settings {
    pub fn new(quick: bool) -> Self {
        let mut s = Self::defaults(quick);
        // For investigating lb's own cases:
        // `LB_BENCH_CONTROLPLANE=cases=more+burst+rss,more=10000x10x1000` or
        // `LB_BENCH_CONTROLPLANE=cases=cold,cold=10000x10,rules_max=0,reps=7` or
        // `LB_BENCH_CONTROLPLANE=cases=scale,scale=10000x10+50000x1`.
        if let Ok(v) = std::env::var("LB_BENCH_CONTROLPLANE") {
            for kv in v.split(',') {
                match kv.split_once('=') {
                    Some(("cases", c)) => s.cases = c.split('+').map(str::to_owned).collect(),
                    Some(("full_every", n)) => s.full_every = n.parse().unwrap_or(0),
                    // `scale=10000x10+50000x1`: services × endpoints, repetitions by size.
                    Some(("scale", c)) => s.scale = scale::Shape::parse(c, quick),
                    Some(("reps", n)) => s.reps = n.parse().unwrap_or(s.reps),
                    // `cold=10000x10+1000x10`: services × endpoints.
                    Some(("cold", c)) => {
                        s.cold = c
                            .split('+')
                            .filter_map(|m| {
                                let (n, e) = m.split_once('x')?;
                                Some((n.parse().ok()?, e.parse().ok()?))
                            })
                            .collect();
                    }
                    // `rules_max=0`: the cold case loads no kube-proxy rule set (lb alone).
                    Some(("rules_max", n)) => {
                        if let Ok(max) = n.parse() {
                            for r in &mut s.rules_max {
                                r.1 = max;
                            }
                        }
                    }
                    // `more=10000x10x1000+1000x100x1000`: services × endpoints × changes.
                    Some(("more", c)) => {
                        s.more_changes = c
                            .split('+')
                            .filter_map(|m| {
                                let v: Vec<usize> =
                                    m.split('x').filter_map(|x| x.parse().ok()).collect();
                                (v.len() == 3).then(|| (v[0], v[1], v[2]))
                            })
                            .collect();
                    }
                    _ => {}
                }
            }
        }
        s
    }

    fn runs(&self, case: &str) -> bool {
        self.cases.is_empty() || self.cases.iter().any(|c| c == case)
    }

    fn defaults(quick: bool) -> Self {
        if quick {
            Self {
                cold: vec![(100, 10), (300, 10)],
                rules_max: [
                    (Rules::Iptables, usize::MAX),
                    (Rules::IptablesNft, usize::MAX),
                    (Rules::Nftables, usize::MAX),
                ],
                reps: 3,
                change: (300, 10, 20),
                more_changes: vec![(30, 100, 20)],
                burst: (300, 10, 50, 3),
                rss: (1_000, 10),
                attempt: None,
                scale: scale::Shape::defaults(true),
                cases: Vec::new(),
                full_every: 0,
            }
        } else {
            Self {
                cold: vec![(1_000, 10), (10_000, 10), (50_000, 10)],
                rules_max: [
                    (Rules::Iptables, 10_000),
                    (Rules::IptablesNft, 1_000),
                    (Rules::Nftables, 10_000),
                ],
                reps: 5,
                change: (10_000, 10, 1_000),
                more_changes: vec![(1_000, 100, 1_000)],
                burst: (10_000, 10, 1_000, 20),
                rss: (10_000, 10),
                attempt: Some((50_000, 10)),
                scale: scale::Shape::defaults(false),
                cases: Vec::new(),
                full_every: 0,
            }
        }
    }

    fn loads(&self, rules: Rules, n: usize) -> bool {
        self.rules_max
            .iter()
            .any(|(r, max)| *r == rules && n <= *max)
    }
}

fn kp_config() -> Config {
    Config {
        pod_cidr: workload::POD_CIDR.into(),
        service_cidr: workload::SERVICE_CIDR.into(),
        node_ip: std::net::Ipv4Addr::new(198, 18, 10, 1),
    }
}

pub fn run(settings: &Settings, results: &mut Results) -> anyhow::Result<()> {
    let tmp = TempDir::new("controlplane")?;
    if let Some((n, e)) = settings.attempt.filter(|_| settings.runs("attempt")) {
        attempt(n, e, results)?;
    }
    if settings.runs("cold") {
        cold(settings, &tmp, results)?;
    }
    if settings.runs("change") {
        change(settings, &tmp, results)?;
    }
    if settings.runs("more") {
        for &(n, e, changes) in &settings.more_changes {
            lb_changes(n, e, changes, settings.full_every, results)?;
        }
    }
    if settings.runs("burst") {
        burst(settings, results)?;
    }
    if settings.runs("rss") {
        rss(settings, results)?;
    }
    if settings.runs("scale") {
        scale::run(&settings.scale, results)?;
    }
    Ok(())
}

/// Map sizes that hold `n` services × `e` endpoints: lb's defaults where they suffice, else
/// the next powers of two (what `lb run --bpf-map-max` would be given).
fn load_options(n: usize, e: usize) -> (LoadOptions, Option<String>) {
    let mut opts = LoadOptions::default();
    let mut changed = Vec::new();
    for (name, default, need) in [
        (map_names::SERVICES4, map_sizes::SERVICES, n * (e + 1)),
        (map_names::BACKENDS4, map_sizes::BACKENDS, n * e),
        (map_names::REVNAT4, map_sizes::REVNAT, n),
    ] {
        if need > default as usize {
            let size = u32::try_from(need.next_power_of_two()).unwrap_or(u32::MAX);
            opts.max_entries.insert(name.to_owned(), size);
            changed.push(format!("{name}={size}"));
        }
    }
    let note = (!changed.is_empty()).then(|| changed.join(","));
    (opts, note)
}

/// Programs `n` × `e` once with lb's default map sizes and reports whether (and where) it does
/// not fit.
fn attempt(n: usize, e: usize, results: &mut Results) -> anyhow::Result<()> {
    let objects = workload::objects(&workload::fillers(n, e));
    let (_, report) = program_cold(&objects, &LoadOptions::default())?;
    let text = match report.errors.first() {
        None => format!("{n} services × {e} endpoints fit lb's default map sizes"),
        Some(first) => format!(
            "{n} services × {e} endpoints do not fit lb's default map sizes: they need {} \
             {} entries (default max {}) and {} {} entries (default max {}); with the \
             defaults {} of {n} services were not programmed, the first error being \
             \"{}: {}\"",
            n * (e + 1),
            map_names::SERVICES4,
            map_sizes::SERVICES,
            n * e,
            map_names::BACKENDS4,
            map_sizes::BACKENDS,
            report.errors.len(),
            first.frontend,
            first.error
        ),
    };
    results.note(&format!("controlplane_fit_{n:06}x{e}"), text);
    Ok(())
}

/// translate + Reconciler::new + apply into fresh private maps; the load is not timed.
fn program_cold(objects: &Objects, opts: &LoadOptions) -> anyhow::Result<(Duration, ApplyReport)> {
    let mut datapath = Datapath::load(opts)?;
    let maps = datapath.take_lb_maps()?;
    let start = Instant::now();
    let mut reconciler = Reconciler::new(maps)?;
    let translation = desired_state(
        &objects.lb.services,
        &objects.lb.slices,
        &NodeInfo::default(),
    );
    let report = reconciler.apply(&translation.state);
    Ok((start.elapsed(), report))
}

/// lb as `lb run` syncs, on private maps: each snapshot through `ChangeDetector::observe` and
/// `daemon::sync_node` (incremental translation, `Reconciler::apply_update`).
struct Daemon {
    reconciler: Reconciler<BpfMaps>,
    translator: IncrementalTranslator,
    detector: ChangeDetector,
    started: std::time::SystemTime,
    metrics: Arc<Metrics>,
    generation: u64,
    _datapath: Datapath,
}

impl Daemon {
    /// Loads private maps sized for `n` × `e` and syncs `objects` (the first, full sync).
    fn new(objects: &Slim, n: usize, e: usize) -> anyhow::Result<Self> {
        Ok(Self::cold(objects, n, e)?.0)
    }

    /// [`Daemon::new`], timed as `lb run` starts on empty maps: `Reconciler::new` (reading
    /// the maps) and the first sync of `objects`; the load of programs and maps is not timed.
    fn cold(objects: &Slim, n: usize, e: usize) -> anyhow::Result<(Self, Duration)> {
        Self::start(Self::load(n, e)?, objects)
    }

    /// The datapath with private maps sized for `n` × `e`, loaded as `lb run` loads it before
    /// its source has published anything.
    fn load(n: usize, e: usize) -> anyhow::Result<(Datapath, BpfMaps)> {
        let (opts, _) = load_options(n, e);
        let mut datapath = Datapath::load(&opts)?;
        let maps = datapath.take_lb_maps()?;
        Ok((datapath, maps))
    }

    /// `cold` on a loaded datapath.
    fn start(
        (datapath, maps): (Datapath, BpfMaps),
        objects: &Slim,
    ) -> anyhow::Result<(Self, Duration)> {
        let start = Instant::now();
        let reconciler = Reconciler::new(maps)?;
        let mut d = Self {
            reconciler,
            translator: IncrementalTranslator::new(),
            detector: ChangeDetector::new(),
            started: std::time::SystemTime::now(),
            metrics: Metrics::new(),
            generation: 0,
            _datapath: datapath,
        };
        let (_, report) = d.sync(objects);
        let took = start.elapsed();
        ensure!(
            report.errors.is_empty(),
            "initial programming failed: {} services not programmed, first {:?}",
            report.errors.len(),
            report.errors.first()
        );
        Ok((d, took))
    }

    /// One sync of `objects`, as the daemon's loop does it once the source has published
    /// them: the time from the snapshot to the map write, and what was written.
    fn sync(&mut self, objects: &Slim) -> (Duration, ApplyReport) {
        self.sync_as(objects, false)
    }

    /// The daemon's periodic full sync (`--full-sync-interval`: `on_full_sync`): the newest
    /// snapshot again, translated anew, the maps re-read and compared with all of it.
    fn full_sync(&mut self, objects: &Slim) -> (Duration, ApplyReport) {
        self.sync_as(objects, true)
    }

    fn sync_as(&mut self, objects: &Slim, full: bool) -> (Duration, ApplyReport) {
        let snapshot = Snapshot {
            services: objects.services.clone(),
            slices: objects.slices.clone(),
            node: None,
            problems: Vec::new(),
            changed_at: Instant::now(),
        };
        let start = Instant::now();
        let diff = self.detector.observe(&snapshot);
        let changes = Changes::of(&diff, self.started);
        self.generation += 1;
        let kind = SyncKind {
            generation: self.generation,
            full,
        };
        let node = NodeInfo::default();
        let synced = sync_node(
            &mut self.reconciler,
            &mut self.translator,
            &snapshot,
            &node,
            kind,
            &self.metrics,
            &Observed {
                diff: Some(diff),
                changes,
            },
        );
        (start.elapsed(), synced.report)
    }
}

/// A kube-proxy mode and the command that loads its rules.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rules {
    Iptables,
    IptablesNft,
    Nftables,
}

impl Rules {
    const ALL: [Rules; 3] = [Rules::Iptables, Rules::IptablesNft, Rules::Nftables];

    fn name(self) -> &'static str {
        match self {
            Rules::Iptables => "iptables",
            Rules::IptablesNft => "iptables_nft",
            Rules::Nftables => "nftables",
        }
    }

    fn program(self) -> &'static str {
        match self {
            Rules::Iptables => "iptables-legacy-restore",
            Rules::IptablesNft => "iptables-nft-restore",
            Rules::Nftables => "nft",
        }
    }

    /// The command that loads `file` the way kube-proxy does.
    fn command(self, file: &Path) -> Command {
        let mut cmd = Command::new(self.program());
        match self {
            Rules::Nftables => cmd.arg("-f").arg(file),
            _ => cmd.args(["--noflush", "--counters"]).arg(file),
        };
        cmd
    }

    /// Loads `file` into `ns`; returns the wall time.
    fn load(self, ns: &str, file: &Path) -> anyhow::Result<Duration> {
        Ok(netns::run(ns, self.command(file))?.1)
    }

    /// A fresh netns with what kube-proxy sets up before its first sync (the jump rules).
    fn scratch(self, tmp: &TempDir) -> anyhow::Result<Scratch> {
        let scratch = Scratch::new(self.name())?;
        if self != Rules::Nftables {
            let jumps = tmp.write("jumps.rules", &kubeproxy::iptables_jumps())?;
            let mut cmd = Command::new(self.program());
            cmd.arg("--noflush").arg(&jumps);
            netns::run(&scratch.name, cmd)?;
        }
        Ok(scratch)
    }

    /// The file with kube-proxy's full rules for `ports`.
    fn write_full(
        self,
        tmp: &TempDir,
        tag: &str,
        ports: &[ServicePort],
        cfg: &Config,
    ) -> anyhow::Result<PathBuf> {
        match self {
            Rules::Nftables => tmp.write(&format!("{tag}.nft"), &kubeproxy::nft_full(ports, cfg)),
            _ => tmp.write(
                &format!("{tag}.rules"),
                &kubeproxy::iptables_restore(ports, cfg, None),
            ),
        }
    }
}

fn cold(settings: &Settings, tmp: &TempDir, results: &mut Results) -> anyhow::Result<()> {
    let cfg = kp_config();
    let mut rng = Rng::new(0xc01d);
    struct Size {
        n: usize,
        e: usize,
        opts: LoadOptions,
        objects: Objects,
        /// Slot 0 is lb, then one per loaded rules implementation.
        rules: Vec<(Rules, PathBuf)>,
        samples: Vec<Vec<f64>>,
    }
    let mut sizes = Vec::new();
    for &(n, e) in &settings.cold {
        let objects = workload::objects(&workload::fillers(n, e));
        let ports = kubeproxy::service_ports(&objects.services, &objects.slices);
        let count = kubeproxy::count_iptables(&kubeproxy::iptables_restore(&ports, &cfg, None));
        results.note(
            &format!("controlplane_rules_{n:06}x{e}"),
            format!(
                "kube-proxy's iptables rules for {n} services × {e} endpoints: {} chains, {} \
                 rules",
                count.chains, count.rules
            ),
        );
        let mut rules = Vec::new();
        for r in Rules::ALL {
            let tag = format!("cold-{n}x{e}");
            if settings.loads(r, n) {
                rules.push((r, r.write_full(tmp, &tag, &ports, &cfg)?));
            } else {
                results.note(
                    &format!("not_measured_controlplane_{}_{n:06}x{e}", r.name()),
                    format!(
                        "{} cold load at {n} services × {e} endpoints: not run; {} time grows \
                         faster than linearly with the ruleset (see the smaller sizes) and 5 \
                         repetitions would not fit the run's time budget",
                        r.name(),
                        r.program()
                    ),
                );
            }
        }
        let (opts, enlarged) = load_options(n, e);
        if let Some(maps) = enlarged {
            results.note(
                &format!("controlplane_maps_{n:06}x{e}"),
                format!("lb programmed {n} services × {e} endpoints with --bpf-map-max {maps}"),
            );
        }
        let slots = 1 + rules.len();
        sizes.push(Size {
            n,
            e,
            opts,
            objects,
            rules,
            samples: vec![Vec::new(); slots],
        });
    }
    for rep in 0..settings.reps {
        for size in &mut sizes {
            let mut order: Vec<usize> = (0..size.samples.len()).collect();
            rng.shuffle(&mut order);
            for slot in order {
                workload::check_interrupted()?;
                let took = if slot == 0 {
                    let (took, report) = program_cold(&size.objects, &size.opts)?;
                    if let Some(e) = report.errors.first() {
                        bail!(
                            "{} × {}: {} services not programmed, first {}: {}",
                            size.n,
                            size.e,
                            report.errors.len(),
                            e.frontend,
                            e.error
                        );
                    }
                    took
                } else {
                    let (rules, file) = &size.rules[slot - 1];
                    let scratch = rules.scratch(tmp)?;
                    rules
                        .load(&scratch.name, file)
                        .with_context(|| format!("{} cold {} rep {rep}", rules.name(), size.n))?
                };
                size.samples[slot].push(took.as_secs_f64() * 1e3);
            }
        }
        println!("controlplane: cold repetition {} done", rep + 1);
    }
    for size in &mut sizes {
        let case = format!("cold_{}_endpoints", size.e);
        let mut impls = vec!["lb"];
        impls.extend(size.rules.iter().map(|(r, _)| r.name()));
        for (slot, imp) in impls.iter().enumerate() {
            let median = workload::median(&mut size.samples[slot]);
            results.push(
                SUITE,
                &case,
                imp,
                size.n,
                "program_time",
                median,
                None,
                "ms",
            );
        }
    }
    Ok(())
}

/// Replaces endpoint 0 of service `i` with the `c`-th replacement address.
fn replace_endpoint(defs: &mut [ServiceDef], objects: &mut Objects, i: usize, c: usize) {
    defs[i].endpoints[0] = workload::replacement_ip(c);
    objects.set_slice(i, workload::slice(&defs[i], &defs[i].endpoints));
}

/// kube-proxy's reactions to one change, each timed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Reaction {
    IptablesFull,
    IptablesPartial,
    IptablesNftFull,
    IptablesNftPartial,
    NftPartial,
}

impl Reaction {
    const ALL: [Reaction; 5] = [
        Reaction::IptablesFull,
        Reaction::IptablesPartial,
        Reaction::IptablesNftFull,
        Reaction::IptablesNftPartial,
        Reaction::NftPartial,
    ];

    fn rules(self) -> Rules {
        match self {
            Reaction::IptablesFull | Reaction::IptablesPartial => Rules::Iptables,
            Reaction::IptablesNftFull | Reaction::IptablesNftPartial => Rules::IptablesNft,
            Reaction::NftPartial => Rules::Nftables,
        }
    }

    fn metric(self) -> &'static str {
        match self {
            Reaction::IptablesFull | Reaction::IptablesNftFull => "change_full_restore",
            Reaction::IptablesPartial | Reaction::IptablesNftPartial => "change_partial_restore",
            Reaction::NftPartial => "change_partial_sync",
        }
    }
}

fn change(settings: &Settings, tmp: &TempDir, results: &mut Results) -> anyhow::Result<()> {
    let (n, e, changes) = settings.change;
    let cfg = kp_config();
    let mut defs = workload::fillers(n, e);
    let mut objects = workload::objects(&defs);
    let mut rng = Rng::new(0xc4a6);

    let mut daemon = Daemon::new(&objects.lb, n, e)?;
    // The full sync (every sync before issue 16; `--full-sync-interval` now), on its own maps.
    let mut datapath = Datapath::load(&load_options(n, e).0)?;
    let mut reconciler: Reconciler<BpfMaps> = Reconciler::new(datapath.take_lb_maps()?)?;
    let initial = desired_state(
        &objects.lb.services,
        &objects.lb.slices,
        &NodeInfo::default(),
    );
    let report = reconciler.apply(&initial.state);
    ensure!(report.errors.is_empty(), "initial programming failed");
    drop(initial);

    // kube-proxy's tables, loaded once (concurrently; not timed).
    let ports = kubeproxy::service_ports(&objects.services, &objects.slices);
    let mut scratches: Vec<(Rules, Scratch)> = Vec::new();
    let mut loading = Vec::new();
    for rules in Rules::ALL {
        if !settings.loads(rules, n) {
            results.note(
                &format!("not_measured_controlplane_change_{}", rules.name()),
                format!(
                    "{} reaction to a change at {n} services × {e} endpoints: not run, its \
                     table could not be loaded within the run's time budget (see the cold \
                     loads)",
                    rules.name()
                ),
            );
            continue;
        }
        let scratch = rules.scratch(tmp)?;
        let file = rules.write_full(
            tmp,
            &format!("change-initial-{}", rules.name()),
            &ports,
            &cfg,
        )?;
        loading.push(netns::spawn(&scratch.name, rules.command(&file))?);
        scratches.push((rules, scratch));
    }
    netns::wait_all(loading)?;
    let reactions: Vec<Reaction> = Reaction::ALL
        .into_iter()
        .filter(|r| scratches.iter().any(|(rules, _)| *rules == r.rules()))
        .collect();
    // What the nftables table holds per service port (its partial syncs build on it).
    let mut nft_view: Vec<ServicePort> = ports;

    let rounds = settings.reps.max(1) * 2;
    let per_round = changes.div_ceil(rounds);
    let (mut total, mut full_t) = (Vec::new(), Vec::new());
    let mut kp: Vec<Vec<f64>> = vec![Vec::new(); Reaction::ALL.len()];
    let mut c = 0;
    for round in 0..rounds {
        for k in 0..per_round {
            if c >= changes {
                break;
            }
            workload::check_interrupted()?;
            let i = rng.below(n);
            replace_endpoint(&mut defs, &mut objects, i, c);
            c += 1;
            // The daemon's sync.
            let (took, report) = daemon.sync(&objects.lb);
            ensure!(
                report.errors.is_empty() && report.writes > 0,
                "change {c}: {} writes, errors {:?}",
                report.writes,
                report.errors.first()
            );
            total.push(took.as_secs_f64() * 1e3);
            // The full sync, for every 10th change (it is ~100× slower).
            if c % 10 == 1 {
                let t0 = Instant::now();
                let translation = desired_state(
                    &objects.lb.services,
                    &objects.lb.slices,
                    &NodeInfo::default(),
                );
                let report = reconciler.apply(&translation.state);
                full_t.push(t0.elapsed().as_secs_f64() * 1e3);
                ensure!(
                    report.errors.is_empty(),
                    "full sync {c}: {:?}",
                    report.errors
                );
            }
            if k > 0 || reactions.is_empty() {
                continue;
            }
            // kube-proxy's reactions to the same change, once per round.
            let ports = kubeproxy::service_ports(&objects.services, &objects.slices);
            let full = tmp.write(
                "change-full.rules",
                &kubeproxy::iptables_restore(&ports, &cfg, None),
            )?;
            let partial = tmp.write(
                "change-partial.rules",
                &kubeproxy::iptables_restore(&ports, &cfg, Some(&[i])),
            )?;
            let nft = tmp.write(
                "change.nft",
                &kubeproxy::nft_change(&nft_view[i], &ports[i], &cfg),
            )?;
            nft_view[i] = ports[i].clone();
            let mut order = reactions.clone();
            rng.shuffle(&mut order);
            for reaction in order {
                let ns = scratches
                    .iter()
                    .find(|(r, _)| *r == reaction.rules())
                    .map(|(_, s)| s.name.clone())
                    .context("scratch netns")?;
                let took = match reaction {
                    Reaction::IptablesFull | Reaction::IptablesNftFull => {
                        reaction.rules().load(&ns, &full)?
                    }
                    Reaction::IptablesPartial | Reaction::IptablesNftPartial => {
                        reaction.rules().load(&ns, &partial)?
                    }
                    Reaction::NftPartial => {
                        // knftables' List("chains"): all chains of the family.
                        let mut list = Command::new("nft");
                        list.args(["--json", "list", "chains", "ip"]);
                        let (_, listed) = netns::run(&ns, list)?;
                        listed + Rules::Nftables.load(&ns, &nft)?
                    }
                };
                let slot = Reaction::ALL
                    .iter()
                    .position(|r| *r == reaction)
                    .unwrap_or(0);
                kp[slot].push(took.as_secs_f64() * 1e3);
            }
        }
        println!("controlplane: change round {} of {rounds} done", round + 1);
    }
    let case = format!("change_{e}_endpoints");
    let mut push = |imp: &str, metric: &str, v: &mut Vec<f64>, p99: bool| {
        let median = workload::median(v);
        let p = p99.then(|| workload::percentile(v, 99.0));
        results.push(SUITE, &case, imp, n, metric, median, p, "ms");
    };
    push("lb", "change_to_map_write", &mut total, true);
    push("lb", "change_full_sync", &mut full_t, true);
    for (slot, reaction) in Reaction::ALL.iter().enumerate() {
        if !kp[slot].is_empty() {
            push(
                reaction.rules().name(),
                reaction.metric(),
                &mut kp[slot],
                false,
            );
        }
    }
    results.note(
        "controlplane_change_method",
        format!(
            "{c} changes at {n} services × {e} endpoints, each replacing one endpoint of a \
             random service's EndpointSlice; lb: the daemon's sync (ChangeTracker::observe + \
             daemon::sync_node: incremental translation, Reconciler::apply_update of the \
             changed frontends) from the published snapshot to the last map write, median and \
             p99 over all changes; lb full sync: translate of all objects + Reconciler::apply of \
             the full desired state (every sync before; the periodic full sync now), every 10th \
             change, on maps of its own; kube-proxy: the same kind of change once per round ({rounds} rounds, \
             interleaved with lb's), wall time of the iptables-restore / nft commands only \
             (kube-proxy's own rule rendering is not included), median"
        ),
    );
    Ok(())
}

/// One EndpointSlice change at a time through the daemon's sync, lb only.
fn lb_changes(
    n: usize,
    e: usize,
    changes: usize,
    full_every: usize,
    results: &mut Results,
) -> anyhow::Result<()> {
    let mut defs = workload::fillers(n, e);
    let mut objects = workload::objects(&defs);
    let mut rng = Rng::new(0xc4a7);
    let mut daemon = Daemon::new(&objects.lb, n, e)?;
    let mut took = Vec::with_capacity(changes);
    // The full sync beside, for `full_every` (see `Settings`).
    let mut full = match full_every {
        0 => None,
        _ => {
            let mut datapath = Datapath::load(&load_options(n, e).0)?;
            let reconciler = Reconciler::new(datapath.take_lb_maps()?)?;
            Some((datapath, reconciler))
        }
    };
    let (mut after_full, mut others) = (Vec::new(), Vec::new());
    for c in 0..changes {
        let just_full = full_every > 0 && c % full_every == 0;
        if let Some((_, reconciler)) = full.as_mut().filter(|_| just_full) {
            let t = desired_state(
                &objects.lb.services,
                &objects.lb.slices,
                &NodeInfo::default(),
            );
            reconciler.apply(&t.state);
        }
        workload::check_interrupted()?;
        replace_endpoint(&mut defs, &mut objects, rng.below(n), c);
        let (t, report) = daemon.sync(&objects.lb);
        ensure!(
            report.errors.is_empty() && report.writes > 0,
            "change {c}: {} writes, errors {:?}",
            report.writes,
            report.errors.first()
        );
        took.push(t.as_secs_f64() * 1e3);
        if full_every > 0 {
            let group = if just_full {
                &mut after_full
            } else {
                &mut others
            };
            group.push(t.as_secs_f64() * 1e3);
        }
    }
    if full_every > 0 {
        for (what, v) in [
            ("right after a full sync", &mut after_full),
            ("others", &mut others),
        ] {
            println!(
                "controlplane: {n} × {e}, {what}: {} changes, median {:.3} ms, p99 {:.3} ms",
                v.len(),
                workload::median(v),
                workload::percentile(v, 99.0)
            );
        }
    }
    let median = workload::median(&mut took);
    let p99 = workload::percentile(&mut took, 99.0);
    let case = format!("change_{e}_endpoints");
    results.push(
        SUITE,
        &case,
        "lb",
        n,
        "change_to_map_write",
        median,
        Some(p99),
        "ms",
    );
    println!("controlplane: {changes} changes at {n} × {e} done");
    Ok(())
}

/// Bursts of EndpointSlice changes, each published in one snapshot, through the daemon's
/// sync.
fn burst(settings: &Settings, results: &mut Results) -> anyhow::Result<()> {
    let (n, e, per, bursts) = settings.burst;
    let mut defs = workload::fillers(n, e);
    let mut objects = workload::objects(&defs);
    let mut rng = Rng::new(0xb025);
    let mut daemon = Daemon::new(&objects.lb, n, e)?;
    let mut took = Vec::with_capacity(bursts);
    let mut c = 0;
    for b in 0..bursts {
        workload::check_interrupted()?;
        let mut order: Vec<usize> = (0..n).collect();
        rng.shuffle(&mut order);
        for &i in order.iter().take(per) {
            replace_endpoint(&mut defs, &mut objects, i, c);
            c += 1;
        }
        let (t, report) = daemon.sync(&objects.lb);
        ensure!(
            report.errors.is_empty() && report.writes >= per.min(n),
            "burst {b}: {} writes, errors {:?}",
            report.writes,
            report.errors.first()
        );
        took.push(t.as_secs_f64() * 1e3);
    }
    let median = workload::median(&mut took);
    let p99 = workload::percentile(&mut took, 99.0);
    let case = format!("burst_{e}_endpoints");
    results.push(
        SUITE,
        &case,
        "lb",
        n,
        "burst_to_map_write",
        median,
        Some(p99),
        "ms",
    );
    results.note(
        "controlplane_burst_method",
        format!(
            "{bursts} snapshots at {n} services × {e} endpoints, each with {per} EndpointSlices \
             changed (one endpoint replaced in each of {per} random services): the daemon's \
             sync of the snapshot, median and p99 over the snapshots"
        ),
    );
    Ok(())
}

/// Peak RSS of `lb-bench rss` children (fresh processes).
fn rss(settings: &Settings, results: &mut Results) -> anyhow::Result<()> {
    let (n, e) = settings.rss;
    let (mut hwm, mut memlock) = rss_samples(n, e, settings.reps)?;
    let case = format!("hold_{e}_endpoints");
    let median = workload::median(&mut hwm);
    results.push(SUITE, &case, "lb", n, "peak_rss", median, None, "MiB");
    let median = workload::median(&mut memlock);
    results.push(SUITE, &case, "lb", n, "bpf_map_memory", median, None, "MiB");
    Ok(())
}

/// `reps` fresh `lb-bench rss` children holding `n` × `e`: their VmHWM and their maps'
/// memlock, in MiB.
fn rss_samples(n: usize, e: usize, reps: usize) -> anyhow::Result<(Vec<f64>, Vec<f64>)> {
    let exe = std::env::current_exe()?;
    let (mut hwm, mut memlock) = (Vec::new(), Vec::new());
    for _ in 0..reps {
        workload::check_interrupted()?;
        let out = Command::new(&exe)
            .args(["rss", "--services", &n.to_string()])
            .args(["--endpoints", &e.to_string()])
            .output()
            .context("run lb-bench rss")?;
        ensure!(
            out.status.success(),
            "lb-bench rss failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        ensure!(
            v["backends"].as_u64() == Some((n * e) as u64),
            "lb-bench rss holds {} backends, not {n} × {e}",
            v["backends"]
        );
        hwm.push(v["vm_hwm_kib"].as_f64().context("vm_hwm_kib")? / 1024.0);
        memlock.push(v["map_memlock_bytes"].as_f64().context("memlock")? / (1024.0 * 1024.0));
    }
    Ok((hwm, memlock))
}

/// `lb-bench rss`: holds `n` × `e` programmed the way the daemon does (objects, desired
/// state, reconciler mirror, maps) and prints its VmHWM and its maps' memlock as JSON.
pub fn rss_child(n: usize, e: usize) -> anyhow::Result<()> {
    // In `lb run`'s order: the datapath loads (aya parses the object and the kernel's BTF,
    // tens of MB freed afterwards) before the source has decoded any object.
    let loaded = Daemon::load(n, e)?;
    let objects = workload::slim_objects(&workload::fillers(n, e));
    let (daemon, _) = Daemon::start(loaded, &objects)?;
    let reconciler = &daemon.reconciler;
    let status = fs::read_to_string("/proc/self/status")?;
    let field = |name: &str| -> anyhow::Result<u64> {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .with_context(|| format!("{name} in /proc/self/status"))
    };
    println!(
        "{}",
        serde_json::json!({
            "services": reconciler.service_count(),
            "backends": reconciler.backend_count(),
            "vm_hwm_kib": field("VmHWM:")?,
            "vm_rss_kib": field("VmRSS:")?,
            "map_memlock_bytes": map_memlock()?,
        })
    );
    drop((objects, daemon));
    Ok(())
}

/// Sum of `memlock` over this process's BPF map fds (the kernel memory of its maps).
fn map_memlock() -> anyhow::Result<u64> {
    let mut total = 0;
    for entry in fs::read_dir("/proc/self/fdinfo")? {
        let Ok(text) = fs::read_to_string(entry?.path()) else {
            continue;
        };
        if !text.contains("map_type:") {
            continue;
        }
        total += text
            .lines()
            .find_map(|l| l.strip_prefix("memlock:"))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(0);
    }
    Ok(total)
}

/// `lb-bench rules`: kube-proxy's full iptables-restore input (`kube-proxy-N-E.rules`, load
/// with `iptables-restore --noflush --counters` after `kube-proxy-jumps.rules`) and nftables
/// transaction (`kube-proxy-N-E.nft`, load with `nft -f`) for `n` × `e`.
pub fn write_rules(n: usize, e: usize, dir: &Path) -> anyhow::Result<()> {
    let objects = workload::objects(&workload::fillers(n, e));
    let ports = kubeproxy::service_ports(&objects.services, &objects.slices);
    let cfg = kp_config();
    fs::create_dir_all(dir)?;
    for (name, text) in [
        (
            "kube-proxy-jumps.rules".to_owned(),
            kubeproxy::iptables_jumps(),
        ),
        (
            format!("kube-proxy-{n}-{e}.rules"),
            kubeproxy::iptables_restore(&ports, &cfg, None),
        ),
        (
            format!("kube-proxy-{n}-{e}.nft"),
            kubeproxy::nft_full(&ports, &cfg),
        ),
    ] {
        let path = dir.join(name);
        fs::write(&path, text).with_context(|| format!("write {}", path.display()))?;
        println!("{}", path.display());
    }
    Ok(())
}
