//! Prometheus metrics and kube-proxy-compatible health endpoints.
//!
//! `/metrics` serves the Prometheus text format (version 0.0.4, what kube-proxy serves by
//! default); every name starts with `lb_`:
//!
//! | metric | type | labels |
//! |---|---|---|
//! | `lb_sync_duration_seconds` | histogram | |
//! | `lb_syncs_total` | counter | `result` = `ok` \| `error` |
//! | `lb_full_syncs_total` | counter | `result` = `ok` \| `error` (periodic full reconciles, `--full-sync-interval`) |
//! | `lb_full_sync_repaired_total` | counter | |
//! | `lb_last_sync_timestamp_seconds` | gauge | |
//! | `lb_event_to_map_write_seconds` | histogram | |
//! | `lb_objects_skipped_total` | counter | `kind`, `reason` |
//! | `lb_map_entries` | gauge | `map` |
//! | `lb_map_capacity` | gauge | `map` |
//! | `lb_services` | gauge | |
//! | `lb_backends` | gauge | |
//! | `lb_services_unprogrammed` | gauge | |
//! | `lb_map_full_total` | counter | `map` |
//! | `lb_datapath_packets_total` | counter | `event` (a `lb_common::metrics::NAMES` entry) |
//! | `lb_datapath_bytes_total` | counter | `event` |
//! | `lb_conntrack_entries` | gauge | `family` = `ipv4` \| `ipv6`, `protocol` = `tcp` \| `udp` \| `sctp` \| `other`, `state` = `new` \| `established` \| `closing` (live entries after the last GC pass) |
//! | `lb_conntrack_gc_runs_total` | counter | |
//! | `lb_conntrack_gc_deleted_total` | counter | `reason` = `expired` \| `closed` \| `backend_gone` |
//! | `lb_conntrack_gc_duration_seconds` | histogram | |
//! | `lb_conntrack_gc_errors_total` | counter | (maps a pass could not walk or write) |
//! | `lb_conntrack_insert_failures_total` | counter | (the datapath's `tc_ct_insert_failed`) |
//! | `lb_healthcheck_bind_errors_total` | counter | |
//! | `lb_healthcheck_listeners` | gauge | |
//! | `lb_apiserver_connected` | gauge | (Kubernetes source only) 1 while the API server answers |
//! | `lb_apiserver_last_contact_timestamp_seconds` | gauge | (Kubernetes source only) |
//! | `lb_watch_errors_total` | counter | `kind` = `services` \| `endpointslices` \| `node` |
//! | `lb_watch_relists_total` | counter | `kind` (full relists after the first list: 410 Gone, watcher reset) |
//! | `lb_udp_sockets_destroyed_total` | counter | connected UDP sockets destroyed because their backend left the service |
//! | `lb_udp_destroy_passes_total` | counter | `result` = `ok` \| `partial` (some netns not walked) |
//! | `lb_udp_destroy_pass_duration_seconds` | histogram | |
//!
//! kube-proxy's own SLIs are served too, under kube-proxy's names ([`kubeproxy`]), and
//! `/proxyMode` on the metrics port answers `ebpf`, as kube-proxy's answers its mode.
//!
//! The datapath series (and `lb_conntrack_insert_failures_total`) are read from `lb_metrics`
//! at scrape time, once it has been handed over ([`Metrics::set_datapath_counters`]); a map
//! that cannot be read leaves its series out of that scrape. The other conntrack series come
//! from the conntrack GC's passes ([`Metrics::observe_ct_gc`]), which walk the maps anyway: a
//! scrape costs no syscall per entry.
//!
//! Health follows kube-proxy's healthz server: `/healthz` answers 200 once the maps have been
//! programmed, no source change has waited longer than [`HEALTH_TIMEOUT`] to be applied, and
//! the node is eligible (its Node is not being deleted and has no
//! `ToBeDeletedByClusterAutoscaler` taint); 503 otherwise, also before the first sync. The
//! JSON body is kube-proxy's:
//!
//! ```json
//! {"lastUpdated": "<RFC 3339 UTC>", "currentTime": "<RFC 3339 UTC>", "nodeEligible": true,
//!  "healthy": true, "status": {"IPv4": {"lastUpdated": "…", "healthy": true},
//!                              "IPv6": {"lastUpdated": "…", "healthy": true}}}
//! ```
//!
//! As in kube-proxy, the top-level `lastUpdated` is the current time while healthy, and else
//! the time of the last applied sync (Go's zero time, `0001-01-01T00:00:00Z`, before the first).
//! Each family's `lastUpdated` is the last applied sync: lb programs both families in one sync,
//! so they share it. `/livez` answers 200 while the process serves.
//!
//! With the Kubernetes source the body also says what lb knows of its API server:
//!
//! ```json
//! "apiServer": {"connected": false, "since": "<RFC 3339>", "lastContact": "<RFC 3339>|null",
//!               "lastError": "<text>|null"}
//! ```
//!
//! `connected` is true while the last request got an HTTP answer and no watch broke since;
//! `since` is when it last changed, `lastContact` the last answer or watch event. Losing the
//! API server does *not* make `/healthz` fail, as in kube-proxy: nothing is pending, the
//! datapath keeps serving the last state it was given, and an outage of the control plane
//! hits every node at once, so a 503 would make every load balancer drain every node (and a
//! probe restart every lb) exactly when nothing can be reprogrammed. Alert on
//! `lb_apiserver_connected == 0` instead.
use std::{
    fmt::Write as _,
    net::SocketAddr,
    sync::{Arc, Mutex, MutexGuard, PoisonError},
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::Context as _;
use axum::{
    Router,
    extract::State,
    http::{StatusCode, header},
    response::IntoResponse,
    routing::get,
};
use aya::maps::{MapData, PerCpuArray};
use lb_common::{
    MetricValue,
    metrics::{NAMES, TC_CT_INSERT_FAILED},
};
use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric as _, prometheus_text},
    metrics::{
        counter::{ConstCounter, Counter},
        family::Family,
        gauge::Gauge,
        histogram::{Histogram, exponential_buckets},
    },
    registry::Registry,
};

use crate::datapath::maps::read_counter;

pub mod healthcheck;
pub mod kubeproxy;

/// What `/proxyMode` answers (kube-proxy answers `iptables`, `ipvs` or `nftables`).
pub const PROXY_MODE: &str = "ebpf";

/// How long a source change may wait to be applied before `/healthz` reports unhealthy
/// (kube-proxy's `--healthz-bind-address` server uses twice its 30 s sync period).
pub const HEALTH_TIMEOUT: Duration = Duration::from_secs(60);

/// `Content-Type` of `/metrics`.
pub const METRICS_CONTENT_TYPE: &str = prometheus_text::CONTENT_TYPE;

/// Histogram buckets for reconcile and event-to-write latencies: 50 µs doubling up to ~13 s.
fn latency_buckets() -> impl Iterator<Item = f64> {
    exponential_buckets(50e-6, 2.0, 19)
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SkippedLabels {
    kind: String,
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MapLabels {
    map: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CtLabels {
    family: &'static str,
    protocol: &'static str,
    state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

/// The daemon's metrics and health state. Shared as `Arc<Metrics>`; every method takes `&self`.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    sync: SyncMetrics,
    maps: MapMetrics,
    healthcheck: HealthcheckMetrics,
    apiserver: ApiServerMetrics,
    kube_proxy: kubeproxy::KubeProxyMetrics,
    ct: CtMetrics,
    /// Every `lb_conntrack_entries` label set a GC pass reported so far.
    ct_labels: Mutex<Vec<CtLabels>>,
    bpf: Arc<BpfCollector>,
    health: Mutex<Health>,
    /// Connected UDP re-steering (`reconcile::resteer`).
    pub udp: UdpResteerMetrics,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: &'static str,
}

/// What lb knows of its API server (Kubernetes source only).
#[derive(Debug)]
struct ApiServerState {
    connected: bool,
    /// When `connected` last changed (or the source started).
    since: SystemTime,
    /// The last HTTP answer or watch event.
    last_contact: Option<SystemTime>,
    last_error: Option<String>,
}

#[derive(Debug, Default)]
struct Health {
    /// `None` unless the source is the Kubernetes API.
    api_server: Option<ApiServerState>,
    /// When the state was last applied, monotonic and wall-clock.
    last_synced: Option<(Instant, SystemTime)>,
    /// The oldest source change not applied yet.
    pending_since: Option<Instant>,
    /// False while this node's Node is being deleted or tainted for deletion.
    node_ineligible: bool,
}

/// The reconciler's metrics: syncs, full syncs, their latencies and the objects skipped.
#[derive(Debug)]
struct SyncMetrics {
    sync_duration: Histogram,
    syncs: Family<ResultLabels, Counter>,
    full_syncs: Family<ResultLabels, Counter>,
    full_sync_repaired: Counter,
    last_sync: Gauge<f64, std::sync::atomic::AtomicU64>,
    event_to_write: Histogram,
    skipped: Family<SkippedLabels, Counter>,
}

impl SyncMetrics {
    fn register(registry: &mut Registry) -> Self {
        let sync_duration = Histogram::new(latency_buckets());
        registry.register(
            "lb_sync_duration_seconds",
            "Time one reconcile of the BPF maps took",
            sync_duration.clone(),
        );
        let syncs = Family::<ResultLabels, Counter>::default();
        registry.register(
            "lb_syncs",
            "Reconciles of the BPF maps, by result (error: some service was not programmed)",
            syncs.clone(),
        );
        for result in ["ok", "error"] {
            syncs.get_or_create(&ResultLabels { result }).inc_by(0);
        }
        let full_syncs = Family::<ResultLabels, Counter>::default();
        registry.register(
            "lb_full_syncs",
            "Periodic full reconciles (maps re-read, every object translated and every frontend \
             compared), by result (error: the maps could not be read or some service was not \
             programmed)",
            full_syncs.clone(),
        );
        for result in ["ok", "error"] {
            full_syncs.get_or_create(&ResultLabels { result }).inc_by(0);
        }
        let full_sync_repaired = Counter::default();
        registry.register(
            "lb_full_sync_repaired",
            "Map writes and deletes periodic full reconciles made: drift the incremental syncs \
             had not seen (0 while nothing but lb writes the maps)",
            full_sync_repaired.clone(),
        );
        let last_sync = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
        registry.register(
            "lb_last_sync_timestamp_seconds",
            "Unix time of the last reconcile of the BPF maps",
            last_sync.clone(),
        );
        let event_to_write = Histogram::new(latency_buckets());
        registry.register(
            "lb_event_to_map_write_seconds",
            "Latency from a source event (watch event, file change) to the map write applying it",
            event_to_write.clone(),
        );
        let skipped = Family::<SkippedLabels, Counter>::default();
        registry.register(
            "lb_objects_skipped",
            "Source objects skipped as invalid or unsupported, by kind and reason",
            skipped.clone(),
        );
        Self {
            sync_duration,
            syncs,
            full_syncs,
            full_sync_repaired,
            last_sync,
            event_to_write,
            skipped,
        }
    }
}

/// What the BPF maps hold and refuse: entries, capacities, frontends and backends programmed.
#[derive(Debug)]
struct MapMetrics {
    map_entries: Family<MapLabels, Gauge>,
    map_capacity: Family<MapLabels, Gauge>,
    services: Gauge,
    backends: Gauge,
    unprogrammed: Gauge,
    map_full: Family<MapLabels, Counter>,
}

impl MapMetrics {
    fn register(registry: &mut Registry) -> Self {
        let map_entries = Family::<MapLabels, Gauge>::default();
        registry.register(
            "lb_map_entries",
            "Entries lb has written to a BPF map",
            map_entries.clone(),
        );
        let map_capacity = Family::<MapLabels, Gauge>::default();
        registry.register(
            "lb_map_capacity",
            "Maximum entries of a BPF map",
            map_capacity.clone(),
        );
        let services = Gauge::default();
        registry.register(
            "lb_services",
            "Service frontends programmed into the datapath",
            services.clone(),
        );
        let backends = Gauge::default();
        registry.register(
            "lb_backends",
            "Backends programmed into the datapath",
            backends.clone(),
        );
        let unprogrammed = Gauge::default();
        registry.register(
            "lb_services_unprogrammed",
            "Service frontends the last sync could not program (a full map, a failed write); \
             each is logged by name, and a frontend programmed before keeps its previous state",
            unprogrammed.clone(),
        );
        let map_full = Family::<MapLabels, Counter>::default();
        registry.register(
            "lb_map_full",
            "Service frontends a sync refused because a BPF map had no room for them, by map",
            map_full.clone(),
        );
        Self {
            map_entries,
            map_capacity,
            services,
            backends,
            unprogrammed,
            map_full,
        }
    }
}

/// The health check node port listeners.
#[derive(Debug)]
struct HealthcheckMetrics {
    healthcheck_bind_errors: Counter,
    healthcheck_listeners: Gauge,
}

impl HealthcheckMetrics {
    fn register(registry: &mut Registry) -> Self {
        let healthcheck_bind_errors = Counter::default();
        registry.register(
            "lb_healthcheck_bind_errors",
            "Health check node port listeners that could not be opened (port in use), per attempt",
            healthcheck_bind_errors.clone(),
        );
        let healthcheck_listeners = Gauge::default();
        registry.register(
            "lb_healthcheck_listeners",
            "Health check node port listeners open (one per port and IP family)",
            healthcheck_listeners.clone(),
        );
        Self {
            healthcheck_bind_errors,
            healthcheck_listeners,
        }
    }
}

/// The Kubernetes API server connection and its watches.
#[derive(Debug)]
struct ApiServerMetrics {
    apiserver_connected: Gauge,
    apiserver_last_contact: Gauge<f64, std::sync::atomic::AtomicU64>,
    watch_errors: Family<KindLabels, Counter>,
    watch_relists: Family<KindLabels, Counter>,
}

impl ApiServerMetrics {
    fn register(registry: &mut Registry) -> Self {
        let apiserver_connected = Gauge::default();
        registry.register(
            "lb_apiserver_connected",
            "1 while the Kubernetes API server answers lb's requests and no watch broke since, \
             else 0 (the datapath keeps the last state meanwhile)",
            apiserver_connected.clone(),
        );
        let apiserver_last_contact = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
        registry.register(
            "lb_apiserver_last_contact_timestamp_seconds",
            "Unix time of the last answer or watch event from the Kubernetes API server",
            apiserver_last_contact.clone(),
        );
        let watch_errors = Family::<KindLabels, Counter>::default();
        registry.register(
            "lb_watch_errors",
            "Failed lists, failed watch starts, broken watch streams and watch ERROR events, by kind",
            watch_errors.clone(),
        );
        let watch_relists = Family::<KindLabels, Counter>::default();
        registry.register(
            "lb_watch_relists",
            "Full relists after the first list (410 Gone, watcher reset), by kind",
            watch_relists.clone(),
        );
        Self {
            apiserver_connected,
            apiserver_last_contact,
            watch_errors,
            watch_relists,
        }
    }
}

/// The conntrack GC and the entries it leaves.
#[derive(Debug)]
struct CtMetrics {
    ct_entries: Family<CtLabels, Gauge>,
    ct_gc_runs: Counter,
    ct_gc_deleted: Family<ReasonLabels, Counter>,
    ct_gc_duration: Histogram,
    ct_gc_errors: Counter,
}

impl CtMetrics {
    fn register(registry: &mut Registry) -> Self {
        let ct_entries = Family::<CtLabels, Gauge>::default();
        registry.register(
            "lb_conntrack_entries",
            "Live entries in the datapath's conntrack maps after the last GC pass, by family, \
             protocol and state (each flow has a service and a reply entry)",
            ct_entries.clone(),
        );
        let ct_gc_runs = Counter::default();
        registry.register(
            "lb_conntrack_gc_runs",
            "Passes of the conntrack GC",
            ct_gc_runs.clone(),
        );
        let ct_gc_deleted = Family::<ReasonLabels, Counter>::default();
        registry.register(
            "lb_conntrack_gc_deleted",
            "Conntrack entries the GC deleted, by reason",
            ct_gc_deleted.clone(),
        );
        for r in crate::datapath::conntrack::Reason::ALL {
            ct_gc_deleted
                .get_or_create(&ReasonLabels { reason: r.as_str() })
                .inc_by(0);
        }
        let ct_gc_duration = Histogram::new(exponential_buckets(1e-4, 2.0, 20));
        registry.register(
            "lb_conntrack_gc_duration_seconds",
            "Time one conntrack GC pass over all conntrack maps took",
            ct_gc_duration.clone(),
        );
        let ct_gc_errors = Counter::default();
        registry.register(
            "lb_conntrack_gc_errors",
            "Conntrack maps a GC pass could not walk, or entries it could not delete",
            ct_gc_errors.clone(),
        );
        Self {
            ct_entries,
            ct_gc_runs,
            ct_gc_deleted,
            ct_gc_duration,
            ct_gc_errors,
        }
    }
}

impl Metrics {
    /// Registers every metric, a family of them at a time, in the order `/metrics` lists them.
    pub fn new() -> Arc<Metrics> {
        let mut registry = Registry::default();
        let sync = SyncMetrics::register(&mut registry);
        let maps = MapMetrics::register(&mut registry);
        let healthcheck = HealthcheckMetrics::register(&mut registry);
        let apiserver = ApiServerMetrics::register(&mut registry);
        let kube_proxy = kubeproxy::KubeProxyMetrics::register(&mut registry);
        let ct = CtMetrics::register(&mut registry);
        let udp = UdpResteerMetrics::register(&mut registry);
        let bpf = Arc::new(BpfCollector::default());
        registry.register_collector(Box::new(Arc::clone(&bpf)));
        Arc::new(Metrics {
            registry,
            sync,
            maps,
            healthcheck,
            apiserver,
            kube_proxy,
            ct,
            ct_labels: Mutex::new(Vec::new()),
            bpf,
            health: Mutex::new(Health::default()),
            udp,
        })
    }

    /// A periodic full reconcile ended (`ok`: maps read, every service programmed) after
    /// `repaired` writes and deletes.
    pub fn observe_full_sync(&self, ok: bool, repaired: usize) {
        let result = if ok { "ok" } else { "error" };
        self.sync
            .full_syncs
            .get_or_create(&ResultLabels { result })
            .inc();
        self.sync.full_sync_repaired.inc_by(repaired as u64);
    }

    /// One reconcile of the maps took `d`; `ok` = no service errors.
    pub fn observe_sync(&self, d: Duration, ok: bool) {
        self.sync.sync_duration.observe(d.as_secs_f64());
        let result = if ok { "ok" } else { "error" };
        self.sync
            .syncs
            .get_or_create(&ResultLabels { result })
            .inc();
        self.kube_proxy.observe_sync(d);
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        self.sync.last_sync.set(now.as_secs_f64());
    }

    /// kube-proxy's SLIs (change counts, network programming latency, local endpoints).
    pub fn kube_proxy(&self) -> &kubeproxy::KubeProxyMetrics {
        &self.kube_proxy
    }

    /// Latency from a source event (watch event / file change) to the map write that applied it.
    pub fn observe_event_to_write(&self, d: Duration) {
        self.sync.event_to_write.observe(d.as_secs_f64());
    }

    /// A source object of `kind` was skipped for `reason` (keep both low-cardinality).
    pub fn inc_skipped(&self, kind: &str, reason: &str) {
        self.sync
            .skipped
            .get_or_create(&SkippedLabels {
                kind: kind.to_owned(),
                reason: reason.to_owned(),
            })
            .inc();
    }

    /// `map` holds `used` of its `capacity` entries.
    pub fn set_map_entries(&self, map: &str, used: u64, capacity: u64) {
        let labels = MapLabels {
            map: map.to_owned(),
        };
        self.maps
            .map_entries
            .get_or_create(&labels)
            .set(to_i64(used));
        self.maps
            .map_capacity
            .get_or_create(&labels)
            .set(to_i64(capacity));
    }

    pub fn set_services(&self, n: u64) {
        self.maps.services.set(to_i64(n));
    }

    pub fn set_backends(&self, n: u64) {
        self.maps.backends.set(to_i64(n));
    }

    /// `n` frontends of the last sync could not be programmed.
    pub fn set_unprogrammed(&self, n: u64) {
        self.maps.unprogrammed.set(to_i64(n));
    }

    /// A frontend did not fit into `map`.
    pub fn inc_map_full(&self, map: &str) {
        self.maps
            .map_full
            .get_or_create(&MapLabels {
                map: map.to_owned(),
            })
            .inc();
    }

    /// A health check node port listener could not be opened.
    pub fn inc_healthcheck_bind_errors(&self) {
        self.healthcheck.healthcheck_bind_errors.inc();
    }

    /// `n` health check node port listeners are open.
    pub fn set_healthcheck_listeners(&self, n: u64) {
        self.healthcheck.healthcheck_listeners.set(to_i64(n));
    }

    /// The source is the Kubernetes API: from now on `/healthz` and the `lb_apiserver_*` and
    /// `lb_watch_*` series report on it (disconnected until the first answer).
    pub fn watch_api_server(&self) {
        let mut h = lock(&self.health);
        if h.api_server.is_none() {
            h.api_server = Some(ApiServerState {
                connected: false,
                since: SystemTime::now(),
                last_contact: None,
                last_error: None,
            });
        }
        for kind in ["services", "endpointslices", "node"] {
            self.apiserver
                .watch_errors
                .get_or_create(&KindLabels { kind })
                .inc_by(0);
            self.apiserver
                .watch_relists
                .get_or_create(&KindLabels { kind })
                .inc_by(0);
        }
    }

    /// The API server answered (any HTTP status) or sent a watch event.
    pub fn api_server_contact(&self) {
        let now = SystemTime::now();
        let mut h = lock(&self.health);
        let state = h.api_server.get_or_insert(ApiServerState {
            connected: false,
            since: now,
            last_contact: None,
            last_error: None,
        });
        if !state.connected {
            state.connected = true;
            state.since = now;
            tracing::info!("API server reachable");
        }
        state.last_contact = Some(now);
        drop(h);
        self.apiserver.apiserver_connected.set(1);
        self.apiserver.apiserver_last_contact.set(
            now.duration_since(UNIX_EPOCH)
                .unwrap_or_default()
                .as_secs_f64(),
        );
    }

    /// A request got no answer (refused, timed out, reset) or a watch stream broke.
    pub fn api_server_unreachable(&self, error: &str) {
        let now = SystemTime::now();
        let mut h = lock(&self.health);
        let state = h.api_server.get_or_insert(ApiServerState {
            connected: true,
            since: now,
            last_contact: None,
            last_error: None,
        });
        if state.connected {
            state.connected = false;
            state.since = now;
            tracing::warn!(
                error,
                "API server unreachable; the datapath keeps the last state"
            );
        }
        state.last_error = Some(error.to_owned());
        drop(h);
        self.apiserver.apiserver_connected.set(0);
    }

    /// A list or watch of `kind` (`services`, `endpointslices`, `node`) failed.
    pub fn inc_watch_errors(&self, kind: &'static str) {
        self.apiserver
            .watch_errors
            .get_or_create(&KindLabels { kind })
            .inc();
    }

    /// `kind` was listed again from scratch after its first list.
    pub fn inc_watch_relists(&self, kind: &'static str) {
        self.apiserver
            .watch_relists
            .get_or_create(&KindLabels { kind })
            .inc();
    }

    /// Whether the API server is reachable; `None` for a source without one.
    pub fn api_server_connected(&self) -> Option<bool> {
        lock(&self.health).api_server.as_ref().map(|a| a.connected)
    }

    /// Datapath counters come from the per-CPU `lb_metrics` map, summed over CPUs at scrape
    /// time; exported as `lb_datapath_packets_total{event}` and `lb_datapath_bytes_total{event}`
    /// for the indices named in `lb_common::metrics::NAMES`.
    pub fn set_datapath_counters(&self, map: PerCpuArray<MapData, MetricValue>) {
        *lock(&self.bpf.counters) = Some(map);
    }

    /// A conntrack GC pass ran: its entries replace the `lb_conntrack_entries` series (a state
    /// no entry is in any more reads 0), its deletions and duration are counted.
    pub fn observe_ct_gc(&self, report: &crate::datapath::conntrack::GcReport) {
        self.ct.ct_gc_runs.inc();
        self.ct
            .ct_gc_duration
            .observe(report.duration.as_secs_f64());
        self.ct.ct_gc_errors.inc_by(report.errors);
        for (reason, n) in &report.deleted {
            self.ct
                .ct_gc_deleted
                .get_or_create(&ReasonLabels {
                    reason: reason.as_str(),
                })
                .inc_by(*n);
        }
        // Families, protocols and states seen before keep their series, at 0.
        let mut seen = Vec::new();
        for ((family, protocol, state), n) in &report.entries {
            let labels = CtLabels {
                family,
                protocol,
                state,
            };
            self.ct.ct_entries.get_or_create(&labels).set(to_i64(*n));
            seen.push(labels);
        }
        let mut stale = lock(&self.ct_labels);
        for l in stale.iter() {
            if !seen.contains(l) {
                self.ct.ct_entries.get_or_create(l).set(0);
            }
        }
        for l in seen {
            if !stale.contains(&l) {
                stale.push(l);
            }
        }
    }

    /// The full exposition in the Prometheus text format ([`METRICS_CONTENT_TYPE`]).
    pub fn render(&self) -> String {
        let mut out = String::new();
        if let Err(e) = prometheus_text::encode(&mut out, &self.registry) {
            tracing::warn!(error = %e, "encoding metrics failed; exposition is incomplete");
        }
        out
    }

    /// A source change arrived at `since` and is not applied yet. The oldest pending change
    /// counts, as in kube-proxy's `QueuedUpdate`.
    pub fn mark_change_pending(&self, since: Instant) {
        let mut h = lock(&self.health);
        h.pending_since = Some(h.pending_since.map_or(since, |p| p.min(since)));
    }

    /// The state was applied to the maps; clears any pending change (kube-proxy's `Updated`).
    pub fn mark_synced(&self) {
        let mut h = lock(&self.health);
        h.last_synced = Some((Instant::now(), SystemTime::now()));
        h.pending_since = None;
    }

    /// False before the first [`Metrics::mark_synced`]; afterwards true unless a change has
    /// been pending for [`HEALTH_TIMEOUT`] or longer at `now`.
    pub fn healthy(&self, now: Instant) -> bool {
        let h = lock(&self.health);
        h.last_synced.is_some()
            && h.pending_since
                .is_none_or(|p| now.saturating_duration_since(p) < HEALTH_TIMEOUT)
    }

    /// [`Metrics::healthy`] now: kube-proxy's `Health().Healthy`, the proxier's own health
    /// without node eligibility, which the health check node ports report as
    /// `serviceProxyHealthy`. Takes one uncontended lock.
    pub fn proxier_healthy(&self) -> bool {
        self.healthy(Instant::now())
    }

    /// Wall-clock time of the last [`Metrics::mark_synced`].
    pub fn last_synced(&self) -> Option<SystemTime> {
        lock(&self.health).last_synced.map(|(_, t)| t)
    }

    /// Whether this node should still get load-balancer traffic (`translate::
    /// node_eligible` of its Node); `/healthz` fails while it should not.
    pub fn set_node_eligible(&self, eligible: bool) {
        lock(&self.health).node_ineligible = !eligible;
    }

    /// The `/healthz` answer at this moment: healthy (200) or not (503), and the JSON body.
    pub fn healthz(&self) -> (bool, String) {
        let proxier_healthy = self.proxier_healthy();
        let node_eligible = !lock(&self.health).node_ineligible;
        let healthy = proxier_healthy && node_eligible;
        let now = rfc3339(SystemTime::now());
        let last = self
            .last_synced()
            .map_or_else(|| GO_ZERO_TIME.to_owned(), rfc3339);
        let family = serde_json::json!({ "lastUpdated": last, "healthy": proxier_healthy });
        let api_server = lock(&self.health).api_server.as_ref().map(|a| {
            serde_json::json!({
                "connected": a.connected,
                "since": rfc3339(a.since),
                "lastContact": a.last_contact.map(rfc3339),
                "lastError": a.last_error,
            })
        });
        let mut body = serde_json::json!({
            "lastUpdated": if healthy { &now } else { &last },
            "currentTime": now,
            "nodeEligible": node_eligible,
            "healthy": healthy,
            "status": { "IPv4": family, "IPv6": family },
        });
        if let Some(a) = api_server {
            body["apiServer"] = a;
        }
        (healthy, body.to_string())
    }
}

/// Go's zero `time.Time` in RFC 3339, what kube-proxy reports before its first sync.
const GO_ZERO_TIME: &str = "0001-01-01T00:00:00Z";

fn to_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// Locks, ignoring poisoning: the guarded values stay consistent on their own.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// `t` as RFC 3339 in UTC with millisecond precision, e.g. `2024-05-01T12:00:00.123Z`.
pub fn rfc3339(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs();
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Howard Hinnant's civil_from_days, for days since 1970-01-01 (non-negative here).
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z % 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    let mut s = String::with_capacity(24);
    let _ = write!(
        s,
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        d.subsec_millis()
    );
    s
}

/// Reads the BPF maps on every scrape.
#[derive(Default)]
struct BpfCollector {
    counters: Mutex<Option<PerCpuArray<MapData, MetricValue>>>,
}

impl std::fmt::Debug for BpfCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BpfCollector")
            .field("counters", &lock(&self.counters).is_some())
            .finish()
    }
}

impl BpfCollector {
    /// Per-event `(name, packets, bytes)` summed over CPUs; unreadable indices are left out.
    fn datapath_counters(&self) -> Vec<(&'static str, u64, u64)> {
        let guard = lock(&self.counters);
        let Some(map) = guard.as_ref() else {
            return Vec::new();
        };
        let mut out = Vec::with_capacity(NAMES.len());
        for (index, name) in (0u32..).zip(NAMES) {
            match read_counter(map, index) {
                Ok((packets, bytes)) => out.push((name, packets, bytes)),
                Err(e) => tracing::debug!(index, event = name, error = %e, "reading lb_metrics"),
            }
        }
        out
    }
}

impl Collector for BpfCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let counters = self.datapath_counters();
        if !counters.is_empty() {
            let proto = ConstCounter::new(0u64);
            let mut packets = encoder.encode_descriptor(
                "lb_datapath_packets",
                "Packets or socket calls handled by the datapath, by verdict (summed over CPUs)",
                None,
                proto.metric_type(),
            )?;
            for (event, p, _) in &counters {
                let labels = [("event", *event)];
                ConstCounter::new(*p).encode(packets.encode_family(&labels)?)?;
            }
            let mut bytes = encoder.encode_descriptor(
                "lb_datapath_bytes",
                "Bytes handled by the datapath, by verdict (summed over CPUs)",
                None,
                proto.metric_type(),
            )?;
            for (event, _, b) in &counters {
                let labels = [("event", *event)];
                ConstCounter::new(*b).encode(bytes.encode_family(&labels)?)?;
            }
        }
        if let Some((_, p, _)) = counters
            .iter()
            .find(|(event, ..)| *event == NAMES[TC_CT_INSERT_FAILED as usize])
        {
            let mut failures = encoder.encode_descriptor(
                "lb_conntrack_insert_failures",
                "New flows whose conntrack entries could not be inserted (forwarded anyway; \
                 later packets may be re-balanced); the datapath's tc_ct_insert_failed",
                None,
                ConstCounter::new(0u64).metric_type(),
            )?;
            let none: [(&str, &str); 0] = [];
            ConstCounter::new(*p).encode(failures.encode_family(&none)?)?;
        }
        Ok(())
    }
}

/// Serves `GET /metrics` on `metrics_addr`, and `GET /healthz` and `GET /livez` on
/// `health_addr` (both on one listener when the addresses are equal and not port 0). Returns
/// the bound addresses and the task running the servers; abort it to stop them.
pub async fn serve(
    metrics: Arc<Metrics>,
    metrics_addr: SocketAddr,
    health_addr: SocketAddr,
) -> anyhow::Result<(SocketAddr, SocketAddr, tokio::task::JoinHandle<()>)> {
    let metrics_app = Router::new()
        .route("/metrics", get(metrics_handler))
        .route("/proxyMode", get(proxy_mode_handler))
        .with_state(Arc::clone(&metrics));
    let health_app = Router::new()
        .route("/healthz", get(healthz_handler))
        .route("/livez", get(livez_handler))
        .with_state(metrics);
    if metrics_addr == health_addr && metrics_addr.port() != 0 {
        let (listener, addr) = bind(metrics_addr, "metrics and health").await?;
        let app = metrics_app.merge(health_app);
        let task = tokio::spawn(run(listener, app, "metrics and health"));
        return Ok((addr, addr, task));
    }
    let (metrics_listener, metrics_bound) = bind(metrics_addr, "metrics").await?;
    let (health_listener, health_bound) = bind(health_addr, "health").await?;
    let task = tokio::spawn(async move {
        tokio::join!(
            run(metrics_listener, metrics_app, "metrics"),
            run(health_listener, health_app, "health"),
        );
    });
    Ok((metrics_bound, health_bound, task))
}

async fn bind(
    addr: SocketAddr,
    what: &str,
) -> anyhow::Result<(tokio::net::TcpListener, SocketAddr)> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding the {what} server to {addr}"))?;
    let bound = listener.local_addr()?;
    tracing::info!(addr = %bound, "{what} server listening");
    Ok((listener, bound))
}

async fn run(listener: tokio::net::TcpListener, app: Router, what: &'static str) {
    if let Err(e) = axum::serve(listener, app).await {
        tracing::error!(error = %e, "{what} server stopped");
    }
}

async fn metrics_handler(State(metrics): State<Arc<Metrics>>) -> impl IntoResponse {
    // Walking the conntrack maps makes syscalls; keep them off the async workers.
    let body = tokio::task::spawn_blocking(move || metrics.render())
        .await
        .unwrap_or_else(|e| {
            tracing::warn!(error = %e, "rendering metrics failed");
            String::new()
        });
    ([(header::CONTENT_TYPE, METRICS_CONTENT_TYPE)], body)
}

async fn proxy_mode_handler() -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, "text/plain; charset=utf-8"),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        ],
        PROXY_MODE,
    )
}

async fn healthz_handler(State(metrics): State<Arc<Metrics>>) -> impl IntoResponse {
    let (healthy, body) = metrics.healthz();
    let status = if healthy {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    metrics
        .kube_proxy()
        .healthz_answered(if healthy { "200" } else { "503" });
    (
        status,
        [
            (header::CONTENT_TYPE, "application/json"),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        ],
        body,
    )
}

async fn livez_handler(State(metrics): State<Arc<Metrics>>) -> impl IntoResponse {
    metrics.kube_proxy().livez_answered("200");
    ([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], "ok")
}

/// The connected UDP re-steering series (`reconcile::resteer`).
#[derive(Debug)]
pub struct UdpResteerMetrics {
    destroyed: Counter,
    passes: Family<ResultLabels, Counter>,
    duration: Histogram,
}

impl UdpResteerMetrics {
    fn register(registry: &mut Registry) -> Self {
        let destroyed = Counter::default();
        registry.register(
            "lb_udp_sockets_destroyed",
            "Connected UDP sockets destroyed because socket LB had pinned them to a backend that \
             left the service",
            destroyed.clone(),
        );
        let passes = Family::<ResultLabels, Counter>::default();
        registry.register(
            "lb_udp_destroy_passes",
            "Socket destroy passes over the network namespaces of socket LB's cgroup, by result \
             (partial: some namespace could not be entered)",
            passes.clone(),
        );
        let duration = Histogram::new(latency_buckets());
        registry.register(
            "lb_udp_destroy_pass_duration_seconds",
            "Duration of one socket destroy pass",
            duration.clone(),
        );
        Self {
            destroyed,
            passes,
            duration,
        }
    }

    /// One pass took `d`, destroyed `destroyed` sockets and walked every namespace if `ok`.
    pub fn observe_pass(&self, d: Duration, destroyed: u64, ok: bool) {
        self.destroyed.inc_by(destroyed);
        let result = if ok { "ok" } else { "partial" };
        self.passes.get_or_create(&ResultLabels { result }).inc();
        self.duration.observe(d.as_secs_f64());
    }
}

/// The Kubernetes source reports here (`lb run` hands it its `Metrics`).
impl crate::kube::k8s::ApiObserver for Metrics {
    fn watch_api_server(&self) {
        Metrics::watch_api_server(self);
    }
    fn api_server_contact(&self) {
        Metrics::api_server_contact(self);
    }
    fn api_server_unreachable(&self, error: &str) {
        Metrics::api_server_unreachable(self, error);
    }
    fn inc_watch_errors(&self, kind: &'static str) {
        Metrics::inc_watch_errors(self, kind);
    }
    fn inc_watch_relists(&self, kind: &'static str) {
        Metrics::inc_watch_relists(self, kind);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_formats_utc() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00.000Z");
        let t = UNIX_EPOCH + Duration::from_millis(1_709_210_096_789);
        assert_eq!(rfc3339(t), "2024-02-29T12:34:56.789Z");
        let t = UNIX_EPOCH + Duration::from_secs(951_868_800);
        assert_eq!(rfc3339(t), "2000-03-01T00:00:00.000Z");
    }
}
