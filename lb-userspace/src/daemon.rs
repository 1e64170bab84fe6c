//! `lb run`: load and attach the datapath, program it from a source, follow changes.
use std::{net::SocketAddr, path::PathBuf, sync::Arc, time::Instant};

use anyhow::Context as _;
use tokio::{
    signal::unix::{SignalKind, signal},
    sync::Notify,
};

use crate::{
    datapath::{
        linkwatch::{self, Link, LinkEvent},
        load::{Datapath, LoadOptions, TcHook, XdpMode},
        maps::{BpfMaps, LbMaps},
    },
    kube::changes::{ChangeDetector, SnapshotDiff},
    kube::k8s,
    kube::source::{self, Snapshot},
    metrics::healthcheck::{self, HealthServers},
    metrics::{self, Metrics, kubeproxy::Changes},
    node::{self, NodeFacts, NodeFactsArgs, host_ips},
    reconcile::resteer::{PairTracker, Resteer},
    reconcile::{ApplyReport, Reconciler},
    state_dir,
    translate::incremental::{IncrementalTranslator, Update},
    translate::{self, NodeInfo},
};

/// Where the objects come from.
#[derive(Clone, Debug)]
pub enum SourceConfig {
    /// A directory of manifests, watched for changes and re-read on SIGHUP.
    Manifests(PathBuf),
    /// The Kubernetes API: this kubeconfig, or in-cluster / `$KUBECONFIG` when `None`.
    Kubernetes { kubeconfig: Option<PathBuf> },
}

#[derive(Clone, Debug)]
pub struct RunOptions {
    pub source: SourceConfig,
    /// This node's name (endpoint locality, topology).
    pub node_name: String,
    pub pin_dir: PathBuf,
    /// cgroup v2 directory for socket LB; `None` turns socket LB off.
    pub cgroup: Option<PathBuf>,
    /// External-facing devices: tc ingress NAT with frontends' external scope.
    pub tc_ingress: Vec<String>,
    /// Pod-facing devices (host side of pod veths): tc ingress NAT, internal scope.
    pub tc_pod: Vec<String>,
    /// `--pod-devices auto`: `lb_tc_pod` also goes on every veth of lb's netns that is not an
    /// external device, now and as they appear (`PodWatch`).
    pub pod_devices_auto: bool,
    pub tc_egress: Vec<String>,
    /// External devices (`--devices`): XDP per `xdp` plus tc ingress; empty: the devices
    /// holding the node IPs, unless a `tc_*` list is given.
    pub devices: Vec<String>,
    pub xdp: XdpMode,
    /// Prometheus endpoint; `None` disables it.
    pub metrics_addr: Option<SocketAddr>,
    /// `/healthz` and `/livez`; `None` disables them.
    pub healthz_addr: Option<SocketAddr>,
    /// Where `frontends.json` (frontend → service name, for `lb services`) is written.
    pub state_dir: PathBuf,
    /// max_entries overrides per map name.
    pub map_max: std::collections::BTreeMap<String, u32>,
    /// `--node-ip`, `--cluster-cidr`, `--service-cidr`, `--masquerade-all`. The service CIDRs
    /// also feed the datapath: addresses in them that are no ClusterIP are dropped on the tc
    /// path.
    pub node_facts: NodeFactsArgs,
    /// `timeoutSeconds` of the Kubernetes watches (`--watch-timeout`).
    pub watch_timeout: std::time::Duration,
    /// `--lb-algorithm`, `--maglev-table-size`, `--bpf-maglev-tables`.
    pub algorithm: crate::config::AlgorithmArgs,
    /// Conntrack lifetimes (`--bpf-ct-timeout-regular-*`).
    pub ct_timeouts: crate::datapath::conntrack::CtTimeouts,
    /// Between conntrack GC passes (`--ct-gc-interval`).
    pub ct_gc_interval: std::time::Duration,
    /// `--full-sync-interval`: how often a sync re-reads the maps and compares everything
    /// (zero: never).
    pub full_sync_interval: std::time::Duration,
}

/// Runs until SIGINT or SIGTERM.
pub async fn run(opts: RunOptions) -> anyhow::Result<()> {
    // Before anything is bound, created or loaded: a missing capability changes nothing.
    crate::privileges::check()?;
    let metrics = Metrics::new();
    if let (Some(m), Some(h)) = (opts.metrics_addr, opts.healthz_addr) {
        let (m, h, _task) = metrics::serve(metrics.clone(), m, h).await?;
        tracing::info!(metrics = %m, healthz = %h, "serving metrics and health");
    }
    let mut datapath = load_datapath(&opts)?;
    datapath.spawn_kernel_logger();
    let maps = datapath.take_lb_maps()?;
    metrics.set_datapath_counters(datapath.take_counters()?);
    // Beside the reconciler, with handles of its own: a pass over big maps never delays a sync.
    let ct_gc = {
        let metrics = metrics.clone();
        crate::datapath::conntrack::spawn(&opts.pin_dir, opts.ct_gc_interval, move |r| {
            metrics.observe_ct_gc(r)
        })?
    };
    let reconciler = Reconciler::new(maps).context("reading the pinned maps")?;
    let resteer = start_resteer(&opts, &datapath, &metrics);
    tracing::info!(
        pin_dir = %opts.pin_dir.display(),
        services = reconciler.service_count(),
        backends = reconciler.backend_count(),
        "loaded datapath; pinned state reused"
    );
    let (tx, rx) = source::channel();
    let reload = Arc::new(Notify::new());
    start_source(&opts, &metrics, tx, reload.clone()).await?;
    let daemon = Daemon {
        health_checks: HealthServers::new(metrics.clone()),
        opts,
        metrics,
        datapath,
        reconciler,
        translator: IncrementalTranslator::new(),
        detector: ChangeDetector::new(),
        ct_gc,
        resteer,
        udp_pairs: PairTracker::default(),
        facts: None,
        generation: 0,
        started: std::time::SystemTime::now(),
        last_full: Instant::now(),
        link_tx: None,
        pods: None,
    };
    daemon.serve(rx, reload).await
}

/// Loads the datapath (reusing the pins in `--pin-dir`) and writes the service CIDRs, before
/// anything attaches: the pinned tries may hold an earlier run's ranges.
fn load_datapath(opts: &RunOptions) -> anyhow::Result<Datapath> {
    let maglev_tables = match opts.algorithm.bpf_maglev_tables {
        Some(n) => n,
        None => crate::datapath::load::pinned_maglev_tables(
            &opts.pin_dir,
            opts.algorithm.maglev_table_size,
        )
        .unwrap_or_else(|| opts.algorithm.tables()),
    };
    let mut datapath = Datapath::load(&LoadOptions {
        pin_dir: Some(opts.pin_dir.clone()),
        only_pinned: None,
        max_entries: opts.map_max.clone(),
        ct_timeouts: opts.ct_timeouts,
        trace: false,
        no_set_retval: false,
        // For tests of the fallback older kernels get: socket LB's pairs in the LRU alone.
        no_sk_storage: crate::datapath::load::sk_storage_off_by_env(),
        // A restart (or upgrade) must not leave a moment without programs: see `links`.
        persist_links: true,
        maglev_table_size: opts.algorithm.maglev_table_size,
        maglev_tables,
    })?;
    let service_cidrs: Vec<(std::net::IpAddr, u8)> = opts
        .node_facts
        .service_cidr
        .iter()
        .map(|c| (c.addr, c.prefix))
        .collect();
    datapath
        .set_service_cidrs(&service_cidrs)
        .context("writing the service CIDRs")?;
    tracing::info!(
        service_cidrs = service_cidrs.len(),
        sock_refused_errno = if datapath.sock_refuses_with_econnrefused() {
            "ECONNREFUSED"
        } else {
            "EPERM (no bpf_set_retval for sock_addr programs)"
        },
        sock_pairs = if datapath.sock_uses_sk_storage() {
            "socket storage (lb*_sk_store) for sockets that return to a pair, lb*_sk_revnat for \
             first pairs and overflow"
        } else {
            "lb*_sk_revnat (no bpf_sk_storage_get for sock_addr programs, or LB_NO_SK_STORAGE=1)"
        },
        "datapath reject settings"
    );
    Ok(datapath)
}

/// Connected UDP re-steering (reconcile/resteer.rs), fed the pairs each sync removes; only
/// with socket LB, and without it (a warning) where the datapath has no map for it.
fn start_resteer(
    opts: &RunOptions,
    datapath: &Datapath,
    metrics: &Arc<Metrics>,
) -> Option<Resteer> {
    match (&opts.cgroup, datapath.udp_gone_map()) {
        (Some(cg), Ok(gone)) => {
            let m = metrics.clone();
            Resteer::start(
                &opts.pin_dir,
                cg.clone(),
                gone,
                Arc::new(move |d, n, ok| m.udp.observe_pass(d, n, ok)),
            )
        }
        (Some(_), Err(e)) => {
            tracing::warn!(error = format!("{e:#}"), "no connected UDP re-steering");
            None
        }
        (None, _) => None,
    }
}

/// Starts the source `opts` names, publishing its snapshots on `tx`; a manifest directory is
/// re-read when `reload` is notified (SIGHUP).
async fn start_source(
    opts: &RunOptions,
    metrics: &Arc<Metrics>,
    tx: source::SnapshotSender,
    reload: Arc<Notify>,
) -> anyhow::Result<()> {
    match &opts.source {
        SourceConfig::Manifests(dir) => {
            tracing::info!(dir = %dir.display(), "source: manifest directory");
            tokio::spawn(source::watch_manifests(
                dir.clone(),
                opts.node_name.clone(),
                tx,
                reload,
            ));
        }
        SourceConfig::Kubernetes { kubeconfig } => {
            let client =
                k8s::watch_client(kubeconfig.as_deref(), opts.watch_timeout, metrics.clone())
                    .await?;
            tracing::info!(
                node = %opts.node_name,
                watch_timeout_s = opts.watch_timeout.as_secs(),
                "source: Kubernetes API"
            );
            let watch = k8s::WatchOptions {
                timeout: opts.watch_timeout,
                metrics: Some(metrics.clone()),
            };
            tokio::spawn(k8s::watch_with(client, opts.node_name.clone(), tx, watch));
        }
    }
    Ok(())
}

/// The running daemon: what one sync hands on to the next.
struct Daemon {
    opts: RunOptions,
    metrics: Arc<Metrics>,
    datapath: Datapath,
    reconciler: Reconciler<BpfMaps>,
    translator: IncrementalTranslator,
    /// The one change detector (kube/changes.rs): each update's snapshot diff, computed once,
    /// feeds the translator, kube-proxy's change metrics and, through the translator's
    /// `Update`, the UDP re-steering.
    detector: ChangeDetector,
    /// Starts a conntrack GC pass at once.
    ct_gc: Arc<Notify>,
    resteer: Option<Resteer>,
    udp_pairs: PairTracker,
    /// The node facts written to the datapath last.
    facts: Option<NodeFacts>,
    health_checks: HealthServers,
    generation: u64,
    /// When the daemon started: kube-proxy's change metrics leave out older objects.
    started: std::time::SystemTime,
    last_full: Instant,
    /// `--pod-devices auto`: where the link watch sends its events, until the first attach
    /// starts it.
    link_tx: Option<tokio::sync::mpsc::UnboundedSender<LinkEvent>>,
    pods: Option<PodWatch>,
}

impl Daemon {
    /// Syncs each snapshot `rx` brings, and the newest one again at each full sync, until
    /// SIGINT or SIGTERM; SIGHUP notifies `reload`.
    async fn serve(
        mut self,
        mut rx: source::SnapshotReceiver,
        reload: Arc<Notify>,
    ) -> anyhow::Result<()> {
        let mut hup = signal(SignalKind::hangup())?;
        let mut term = signal(SignalKind::terminate())?;
        let interval = self.opts.full_sync_interval;
        let mut full_timer = tokio::time::interval(if interval.is_zero() {
            std::time::Duration::from_secs(u64::from(u32::MAX))
        } else {
            interval
        });
        full_timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        full_timer.reset();
        // Link events from the watch thread, once the first attach started it.
        let (link_tx, mut link_rx) = tokio::sync::mpsc::unbounded_channel::<LinkEvent>();
        self.link_tx = Some(link_tx);
        loop {
            tokio::select! {
                changed = rx.changed() => {
                    if changed.is_err() {
                        anyhow::bail!("the source stopped");
                    }
                    let Some(snapshot) = rx.borrow_and_update().clone() else { continue };
                    self.on_snapshot(&snapshot).await?;
                }
                // A full sync without a change: the newest snapshot again.
                _ = full_timer.tick(), if self.generation > 0 && !interval.is_zero() => {
                    if self.last_full.elapsed() < interval {
                        continue;
                    }
                    let Some(snapshot) = rx.borrow().clone() else { continue };
                    self.on_full_sync(&snapshot);
                }
                Some(event) = link_rx.recv(), if self.pods.is_some() => {
                    if let Some(p) = self.pods.as_mut() {
                        p.on_event(&mut self.datapath, event);
                    }
                }
                _ = hup.recv() => reload.notify_one(),
                _ = term.recv() => break,
                r = tokio::signal::ctrl_c() => { r?; break }
            }
        }
        tracing::info!(
            "shutting down; programs stay attached through pinned links and maps (`lb detach` \
             removes them)"
        );
        drop(self.datapath);
        Ok(())
    }

    /// A new snapshot from the source: sync it (a full sync when one is due), attach after the
    /// first, and serve the health check ports it asks for.
    async fn on_snapshot(&mut self, snapshot: &Snapshot) -> anyhow::Result<()> {
        // Due at the next sync anyway (also without changes: see the timer arm).
        let interval = self.opts.full_sync_interval;
        let full = !interval.is_zero() && self.last_full.elapsed() >= interval;
        self.metrics.mark_change_pending(snapshot.changed_at);
        let diff = self.detector.observe(snapshot);
        let changes = Changes::of(&diff, self.started);
        self.metrics.kube_proxy().queued(&changes);
        self.generation += 1;
        // Before the first attach, like the maps: the first packet sees this node's facts.
        let now = NodeFacts::resolve(&self.opts.node_facts, snapshot.node.as_deref(), host_ips);
        if self.facts.as_ref() != Some(&now) {
            self.datapath
                .write_node_facts(&now)
                .context("writing the node facts")?;
            log_node_facts(&now);
            self.facts = Some(now);
        }
        let observed = Observed {
            diff: Some(diff),
            changes,
        };
        let synced = self.sync(snapshot, full, &observed);
        if synced.names_changed
            && let Err(e) = state_dir::write_names(&self.opts.state_dir, self.translator.state())
        {
            tracing::warn!(error = format!("{e:#}"), "cannot write frontend names");
        }
        if self.generation == 1 {
            // Attach only once the maps hold the full state, so no packet sees less.
            let events = self.link_tx.take();
            self.pods = attach(&mut self.datapath, &self.opts, self.facts.as_ref(), events)?;
            tracing::info!(attached = ?self.datapath.attachments(), "ready");
        }
        // After the attach: load balancers send traffic once a port answers 200.
        let want = healthcheck::desired(&snapshot.services, &snapshot.slices, &self.opts.node_name);
        self.health_checks.update(&want).await;
        Ok(())
    }

    /// The periodic full sync of the newest snapshot, without a change.
    fn on_full_sync(&mut self, snapshot: &Snapshot) {
        self.generation += 1;
        // Diffed too, so the translator follows the detector's every snapshot (nothing,
        // unless a change arrived that the change arm has not taken yet: its objects are
        // counted here then).
        let diff = self.detector.observe(snapshot);
        let changes = Changes::of(&diff, self.started);
        let observed = Observed {
            diff: Some(diff),
            changes,
        };
        // A repair may have deleted backends too: `sync` hands them on.
        self.sync(snapshot, true, &observed);
    }

    /// Syncs `snapshot` as this generation and hands on what it removed.
    fn sync(&mut self, snapshot: &Snapshot, full: bool, observed: &Observed) -> Synced {
        let base = node_base(&self.opts, self.facts.as_ref());
        let kind = SyncKind {
            generation: self.generation,
            full,
        };
        let synced = sync_node(
            &mut self.reconciler,
            &mut self.translator,
            snapshot,
            &base,
            kind,
            &self.metrics,
            observed,
        );
        if full {
            self.last_full = Instant::now();
        }
        after_sync(
            &synced,
            self.translator.state(),
            &self.ct_gc,
            self.resteer.as_ref(),
            &mut self.udp_pairs,
        );
        synced
    }
}

/// What follows a sync's map writes: the conntrack GC at once when backends were deleted
/// (their flows' entries go now, not at the next interval), and the UDP pairs it removed or
/// brought back to the re-steering worker.
fn after_sync(
    synced: &Synced,
    state: &crate::model::DesiredState,
    ct_gc: &Notify,
    resteer: Option<&Resteer>,
    udp_pairs: &mut PairTracker,
) {
    if synced.report.backends_deleted > 0 {
        ct_gc.notify_one();
    }
    if let Some(r) = resteer {
        r.apply(udp_pairs.observe(&synced.update, state, &synced.report));
    }
}

/// This node's name and addresses for the translation: the NodePort addresses
/// (`--nodeport-addresses` over the node IPs and the host's addresses) and every local address.
fn node_base(opts: &RunOptions, facts: Option<&NodeFacts>) -> NodeInfo {
    let local_ips = node::host_addrs().into_iter().map(|(_, ip)| ip).collect();
    node_info(&opts.node_name, facts, &opts.algorithm, local_ips)
}

/// The node `name` as the translation sees it, its zone left to each sync (the snapshot's Node
/// object): NodePorts answer on the NodePort addresses of `facts` (none without facts), and an
/// external or LoadBalancer IP among `local_ips` is a local frontend. `lb trace --manifests`
/// builds its simulated node with it too.
pub fn node_info(
    name: &str,
    facts: Option<&NodeFacts>,
    algorithm: &crate::config::AlgorithmArgs,
    local_ips: Vec<std::net::IpAddr>,
) -> NodeInfo {
    NodeInfo {
        name: name.to_string(),
        zone: None,
        lb_algorithm: algorithm.lb_algorithm,
        nodeport_ips: facts.map_or_else(Vec::new, |f| f.nodeport_addresses.clone()),
        local_ips,
    }
}

/// The external devices: `--devices`, else those holding the node IPs when no `--tc-*` list
/// lays the hooks out by hand.
fn external_devices(opts: &RunOptions, facts: Option<&NodeFacts>) -> Vec<String> {
    if !opts.devices.is_empty() {
        return opts.devices.clone();
    }
    if !(opts.tc_ingress.is_empty() && opts.tc_pod.is_empty() && opts.tc_egress.is_empty()) {
        return Vec::new();
    }
    let ips = facts.map_or_else(Vec::new, |f| f.node_ips.clone());
    node::devices_holding(&ips, &node::host_addrs())
}

/// The pod devices lb finds by itself (`--pod-devices auto`): every veth of its network
/// namespace that is not an external device (nor on a `--tc-ingress`/`--tc-pod` list) gets
/// `lb_tc_pod`, those there at start and those a CNI creates later (`linkwatch`). A backend's
/// reply to a masqueraded flow (a NodePort) comes back to the node IP through the pod's veth,
/// and one to a pod on the same bridge never crosses the bridge device: without `lb_tc_pod` on
/// the veth itself it would meet no reverse NAT.
pub struct PodWatch {
    /// Names that never get it: the external devices and the hand-listed ones.
    skip: Vec<String>,
    /// What has it: ifindex → name.
    attached: std::collections::BTreeMap<u32, String>,
}

impl PodWatch {
    fn new(opts: &RunOptions, external: &[String]) -> Self {
        let skip = external
            .iter()
            .chain(&opts.tc_ingress)
            .chain(&opts.tc_pod)
            .cloned()
            .collect();
        Self {
            skip,
            attached: Default::default(),
        }
    }

    fn wants(&self, link: &Link) -> bool {
        link.kind == "veth" && !self.skip.contains(&link.name)
    }

    /// Attaches to `link` if it is a pod device without lb_tc_pod yet; an `RTM_NEWLINK` for a
    /// device that has it (up, down, a new master) changes nothing.
    fn add(&mut self, datapath: &mut Datapath, link: &Link) {
        if !self.wants(link) {
            return;
        }
        match self.attached.get(&link.index) {
            Some(name) if *name == link.name => return,
            // Renamed: its pin goes by name.
            Some(old) => datapath.forget_tc(old, TcHook::Pod),
            None => {}
        }
        match datapath.attach_tc(&link.name, TcHook::Pod) {
            Ok(()) => {
                tracing::info!(
                    iface = %link.name,
                    ifindex = link.index,
                    "pod device: lb_tc_pod attached"
                );
                self.attached.insert(link.index, link.name.clone());
            }
            // It may be gone already (a pod that lived for a moment): not lb's failure.
            Err(e) => tracing::warn!(
                iface = %link.name,
                error = format!("{e:#}"),
                "pod device: lb_tc_pod not attached"
            ),
        }
    }

    fn remove(&mut self, datapath: &mut Datapath, link: &Link) {
        if let Some(name) = self.attached.remove(&link.index) {
            datapath.forget_tc(&name, TcHook::Pod);
            tracing::debug!(iface = %name, "pod device gone");
        }
    }

    /// Makes the attachments match the links there are now (start-up, lost events).
    fn scan(&mut self, datapath: &mut Datapath) {
        let links = match linkwatch::links() {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(error = %e, "cannot list the network devices for pod devices");
                return;
            }
        };
        let gone: Vec<Link> = self
            .attached
            .iter()
            .filter(|(i, _)| !links.iter().any(|l| l.index == **i))
            .map(|(i, n)| Link {
                index: *i,
                name: n.clone(),
                kind: String::new(),
            })
            .collect();
        for l in &gone {
            self.remove(datapath, l);
        }
        for l in &links {
            self.add(datapath, l);
        }
    }

    fn on_event(&mut self, datapath: &mut Datapath, event: LinkEvent) {
        match event {
            LinkEvent::New(l) => self.add(datapath, &l),
            LinkEvent::Del(l) => self.remove(datapath, &l),
            LinkEvent::Resync => self.scan(datapath),
        }
    }
}

/// Attaches everything; with `--pod-devices auto` (and `events` to send the link watch's
/// events to) also every pod device, and returns the watch.
fn attach(
    datapath: &mut Datapath,
    opts: &RunOptions,
    facts: Option<&NodeFacts>,
    events: Option<tokio::sync::mpsc::UnboundedSender<LinkEvent>>,
) -> anyhow::Result<Option<PodWatch>> {
    let devices = external_devices(opts, facts);
    // Informational (the choices are made where each feature is used), and reading
    // kallsyms is slow: off the path to the first attach.
    let (probe_devices, xdp) = (devices.clone(), opts.xdp);
    std::thread::spawn(move || crate::datapath::features::probe(&probe_devices, xdp).log());
    for iface in &devices {
        // XDP first, tc ingress beside it: tc finishes what XDP hands on, and serves alone
        // where XDP cannot attach.
        if let Err(e) = datapath.attach_xdp(iface, opts.xdp) {
            tracing::warn!(
                iface,
                error = format!("{e:#}"),
                "XDP not attached; tc ingress only"
            );
        }
        if !opts.tc_ingress.contains(iface) {
            datapath.attach_tc(iface, TcHook::External)?;
        }
        // A local socket's replies (a hostNetwork endpoint's) leave through here unrestored.
        if !opts.tc_egress.contains(iface) {
            datapath.attach_tc(iface, TcHook::Egress)?;
        }
    }
    for iface in &opts.tc_ingress {
        datapath.attach_tc(iface, TcHook::External)?;
    }
    for iface in &opts.tc_pod {
        datapath.attach_tc(iface, TcHook::Pod)?;
    }
    for iface in &opts.tc_egress {
        datapath.attach_tc(iface, TcHook::Egress)?;
    }
    if let Some(cgroup) = &opts.cgroup {
        datapath.attach_cgroup(cgroup)?;
    }
    let mut pods = None;
    if let (true, Some(tx)) = (opts.pod_devices_auto, events) {
        let mut watch = PodWatch::new(opts, &devices);
        // Subscribed before the scan: a device created in between is reported too.
        match linkwatch::watch(move |e| tx.send(e).is_ok()) {
            Ok(_) => tracing::info!(
                external = ?devices,
                "pod devices: lb_tc_pod on every veth that is no external device, watched"
            ),
            Err(e) => tracing::warn!(
                error = %e,
                "cannot watch network devices: pod devices created later get no lb_tc_pod"
            ),
        }
        // Before the prune: the pins of pod devices still there are adopted, not removed.
        watch.scan(datapath);
        pods = Some(watch);
    }
    let pruned = datapath.prune_links()?;
    if !pruned.is_empty() {
        tracing::info!(links = ?pruned, "detached what this run no longer attaches");
    }
    Ok(pods)
}

/// What one sync did.
pub struct Synced {
    /// Service ports whose Local policy finds no endpoint on this node.
    pub no_local_endpoints: translate::NoLocalEndpoints,
    /// What the reconciler wrote, and the services it could not program (logged already).
    pub report: ApplyReport,
    /// Frontends whose desired entry changed (`None`: a full translation).
    pub changed: Option<usize>,
    /// Whether a frontend came, went or changed its name or kind (`frontends.json`).
    pub names_changed: bool,
    /// What the translation changed (the frontends and their entries before).
    pub update: Update,
}

/// What the daemon's change detector found in the snapshot a sync applies.
#[derive(Debug, Default)]
pub struct Observed {
    /// The snapshot's diff against the one before; `None`: the translator diffs it itself
    /// (callers without a detector).
    pub diff: Option<SnapshotDiff>,
    /// What `diff` counts for kube-proxy's SLIs (nothing without one).
    pub changes: Changes,
}

/// Which sync this is.
#[derive(Clone, Copy, Debug)]
pub struct SyncKind {
    pub generation: u64,
    /// A periodic full sync: translate everything anew, re-read the maps and compare every
    /// frontend (`--full-sync-interval`).
    pub full: bool,
}

fn log_node_facts(f: &NodeFacts) {
    let list = |v: &[String]| v.join(",");
    tracing::info!(
        node_ips = list(&f.node_ips.iter().map(ToString::to_string).collect::<Vec<_>>()),
        from = ?f.node_ip_source,
        cluster_cidrs = list(&f.cluster_cidrs.iter().map(ToString::to_string).collect::<Vec<_>>()),
        service_cidrs = list(&f.service_cidrs.iter().map(ToString::to_string).collect::<Vec<_>>()),
        masquerade_all = f.masquerade_all,
        echo_reply = f.echo_reply,
        "node facts written"
    );
    let (v4, v6) = f.snat_ips();
    if v4.is_none() || v6.is_none() {
        tracing::warn!(
            ipv4 = v4.is_some(),
            ipv6 = v6.is_some(),
            "no node IP for a family: its traffic is never masqueraded (hairpin included)"
        );
    }
}

/// Translates a snapshot and applies it, logging and counting what it skipped or failed, for
/// a node without NodePort addresses (see `sync_node`). `translator` carries the translation
/// from one sync to the next. Only the tests' harnesses sync so (the daemon and `lb trace`
/// know their node's addresses), hence not in the product build.
#[cfg(feature = "testing")]
pub fn sync<M: LbMaps>(
    reconciler: &mut Reconciler<M>,
    translator: &mut IncrementalTranslator,
    snapshot: &Snapshot,
    node_name: &str,
    generation: u64,
    metrics: &Metrics,
) -> Synced {
    let base = NodeInfo {
        name: node_name.to_string(),
        ..NodeInfo::default()
    };
    let kind = SyncKind {
        generation,
        full: false,
    };
    sync_node(
        reconciler,
        translator,
        snapshot,
        &base,
        kind,
        metrics,
        &Observed::default(),
    )
}

/// Translates a snapshot and applies it for the node `base` describes (its zone comes from the
/// snapshot's Node object), logging and counting what it skipped or failed; `translator`
/// carries the translation from one sync to the next. `observed` is what the snapshot changed:
/// the translator recomputes what its diff names, and its counts are kube-proxy's SLIs. Only
/// what changed since the last sync is translated and written, unless `kind.full`.
pub fn sync_node<M: LbMaps>(
    reconciler: &mut Reconciler<M>,
    translator: &mut IncrementalTranslator,
    snapshot: &Snapshot,
    base: &NodeInfo,
    kind: SyncKind,
    metrics: &Metrics,
    observed: &Observed,
) -> Synced {
    let start = Instant::now();
    for p in &snapshot.problems {
        let (kind, reason) = p.kind.labels();
        tracing::warn!(problem = %p, reason, "skipping manifest document");
        metrics.inc_skipped(kind, reason);
    }
    metrics.set_node_eligible(translate::node_eligible(snapshot.node.as_deref()));
    let (update, skipped) = translate_snapshot(translator, snapshot, base, kind.full, observed);
    for s in &skipped {
        tracing::warn!(skipped = %s, "skipping object");
        metrics.inc_skipped(s.kind, s.reason.as_str());
    }
    let report = if kind.full {
        full_apply(reconciler, translator.state(), metrics)
    } else {
        reconciler.apply_update(translator.state(), &update)
    };
    let written = Instant::now();
    log_unprogrammed(&report, metrics);
    metrics.observe_sync(written - start, report.errors.is_empty());
    let event_to_write = written.saturating_duration_since(snapshot.changed_at);
    metrics.observe_event_to_write(event_to_write);
    observe_maps(reconciler, metrics);
    let no_local = translator.no_local_endpoints();
    // Before the log line: whoever sees "synced" finds the sync counted.
    metrics
        .kube_proxy()
        .programmed(&observed.changes, std::time::SystemTime::now(), &no_local);
    metrics.mark_synced();
    tracing::debug!(
        generation = kind.generation,
        event_to_write_us = event_to_write.as_micros() as u64,
        "event to map write"
    );
    tracing::info!(
        generation = kind.generation,
        full = kind.full,
        changed_frontends = update.changed(),
        services = translator.state().services.len(),
        backends = reconciler.backend_count(),
        writes = report.writes,
        deletes = report.deletes,
        errors = report.errors.len(),
        skipped = skipped.len() + snapshot.problems.len(),
        elapsed_us = (written - start).as_micros() as u64,
        "synced"
    );
    Synced {
        no_local_endpoints: no_local,
        report,
        changed: update.changed(),
        names_changed: names_changed(&update, translator.state()),
        update,
    }
}

/// Translates what `observed` says the snapshot changed (all of it when `full`) for the node
/// `base` describes; returns what changed and what the translation skipped.
fn translate_snapshot(
    translator: &mut IncrementalTranslator,
    snapshot: &Snapshot,
    base: &NodeInfo,
    full: bool,
    observed: &Observed,
) -> (Update, Vec<translate::Skipped>) {
    let node = NodeInfo {
        zone: NodeInfo::from_node(&base.name, snapshot.node.as_deref()).zone,
        ..base.clone()
    };
    if full {
        // Anew, as if lb had just started: nothing carried over can hide a difference.
        translator.reset();
    }
    let update = match &observed.diff {
        Some(diff) => translator.apply(diff, &snapshot.services, &snapshot.slices, &node),
        None => translator.update(&snapshot.services, &snapshot.slices, &node),
    };
    (update, translator.skipped())
}

/// A full sync's write: the maps re-read and compared with the whole desired state, what
/// differed repaired and counted.
fn full_apply<M: LbMaps>(
    reconciler: &mut Reconciler<M>,
    state: &crate::model::DesiredState,
    metrics: &Metrics,
) -> ApplyReport {
    let refreshed = reconciler.refresh();
    if let Err(e) = &refreshed {
        tracing::error!(
            error = format!("{e:#}"),
            "full sync: cannot re-read the maps"
        );
    }
    let report = reconciler.apply(state);
    let repaired = report.writes + report.deletes;
    metrics.observe_full_sync(refreshed.is_ok() && report.errors.is_empty(), repaired);
    if repaired > 0 {
        tracing::warn!(
            writes = report.writes,
            deletes = report.deletes,
            "full sync repaired map entries the incremental syncs had not seen"
        );
    }
    report
}

/// Logs and counts the services a sync could not program and the Maglev services it left on
/// random selection (a full map among the reasons).
fn log_unprogrammed(report: &ApplyReport, metrics: &Metrics) {
    for e in &report.errors {
        tracing::error!(
            frontend = %e.frontend,
            service = %e.service,
            error = %e.error,
            "service not programmed; previous state kept"
        );
        if let Some(map) = e.full_map {
            metrics.inc_map_full(map);
        }
    }
    for e in &report.fallbacks {
        tracing::warn!(
            frontend = %e.frontend,
            service = %e.service,
            error = %e.error,
            "Maglev service falls back to random selection"
        );
        if let Some(map) = e.full_map {
            metrics.inc_map_full(map);
        }
    }
    metrics.set_unprogrammed(report.errors.len() as u64);
}

/// The programmed services and backends and each map's fill level, as the reconciler counts
/// them.
fn observe_maps<M: LbMaps>(reconciler: &Reconciler<M>, metrics: &Metrics) {
    metrics.set_services(reconciler.service_count() as u64);
    metrics.set_backends(reconciler.backend_count() as u64);
    for (map, used, capacity) in reconciler.usage() {
        metrics.set_map_entries(map, used as u64, u64::from(capacity));
    }
    let (tables, capacity) = reconciler.maglev_usage();
    metrics.set_map_entries(
        lb_common::map_names::MAGLEV,
        tables as u64,
        u64::from(capacity),
    );
}

/// Whether `update` brought, removed or renamed a frontend or changed its kind (what
/// `frontends.json` holds).
fn names_changed(update: &Update, state: &crate::model::DesiredState) -> bool {
    match update {
        Update::Full => true,
        Update::Changed(c) => c.iter().any(|(fe, old)| {
            let new = state.services.get(fe);
            old.as_ref().map(|o| (&o.name, o.kind())) != new.map(|n| (&n.name, n.kind()))
        }),
    }
}
