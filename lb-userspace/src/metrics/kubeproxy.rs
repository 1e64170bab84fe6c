//! kube-proxy's own SLIs, under kube-proxy's names, labels and buckets
//! (`k8s.io/kubernetes/pkg/proxy/metrics`), so dashboards and alerts written for kube-proxy
//! work unchanged:
//!
//! | metric | type | labels |
//! |---|---|---|
//! | `kubeproxy_sync_proxy_rules_duration_seconds` | histogram | `ip_family` |
//! | `kubeproxy_sync_proxy_rules_last_timestamp_seconds` | gauge | `ip_family` |
//! | `kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds` | gauge | `ip_family` |
//! | `kubeproxy_network_programming_duration_seconds` | histogram | `ip_family` |
//! | `kubeproxy_sync_proxy_rules_endpoint_changes_pending` | gauge | |
//! | `kubeproxy_sync_proxy_rules_endpoint_changes_total` | counter | |
//! | `kubeproxy_sync_proxy_rules_service_changes_pending` | gauge | |
//! | `kubeproxy_sync_proxy_rules_service_changes_total` | counter | |
//! | `kubeproxy_sync_proxy_rules_no_local_endpoints_total` | gauge | `traffic_policy`, `ip_family` |
//! | `kubeproxy_proxy_healthz_total` | counter | `code` |
//! | `kubeproxy_proxy_livez_total` | counter | `code` |
//!
//! kube-proxy runs one proxier per IP family; lb programs both families in one sync, so the
//! sync series carry the same value under `IPv4` and `IPv6`. A change is an object that
//! differs from the snapshot lb last applied (added, changed, removed), as kube-proxy's change
//! trackers count them (from the daemon's one snapshot diff, `kube::changes`); network
//! programming latency is observed once per changed
//! EndpointSlice with an `endpoints.kubernetes.io/last-change-trigger-time` later than lb's
//! start, from that time to the map write, labelled with the slice's address family.
use std::{
    sync::atomic::AtomicU64,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use crate::kube::slim::EndpointSlice;
use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{
        counter::Counter,
        family::Family,
        gauge::Gauge,
        histogram::{Histogram, exponential_buckets},
    },
    registry::Registry,
};

use crate::{
    kube::changes::{ChangeDetector, SnapshotDiff},
    kube::source::Snapshot,
    translate::NoLocalEndpoints,
};

/// The EndpointSlice controller's annotation: when the change that caused the slice's last
/// update happened (a Pod or Service change).
pub use crate::kube::slim::LAST_CHANGE_TRIGGER_TIME;

const FAMILIES: [&str; 2] = ["IPv4", "IPv6"];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FamilyLabels {
    ip_family: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PolicyLabels {
    traffic_policy: &'static str,
    ip_family: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CodeLabels {
    code: &'static str,
}

type FloatGauge = Gauge<f64, AtomicU64>;
type Histograms = Family<FamilyLabels, Histogram, fn() -> Histogram>;

/// kube-proxy's `ExponentialBuckets(0.001, 2, 15)`: 1 ms to ~16 s.
fn sync_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 15))
}

/// kube-proxy's network programming buckets: 0.25 s, 0.5 s, 1..59 s, 60..115 s by 5 s,
/// 2..5 min by 30 s.
fn programming_buckets() -> Vec<f64> {
    let mut b = vec![0.25, 0.5];
    b.extend((1..=59).map(f64::from));
    b.extend((0..12).map(|i| 60.0 + 5.0 * f64::from(i)));
    b.extend((0..7).map(|i| 120.0 + 30.0 * f64::from(i)));
    b
}

fn programming_histogram() -> Histogram {
    Histogram::new(programming_buckets())
}

/// The kube-proxy series (see the module docs).
#[derive(Debug)]
pub struct KubeProxyMetrics {
    sync_duration: Histograms,
    last_sync: Family<FamilyLabels, FloatGauge>,
    last_queued: Family<FamilyLabels, FloatGauge>,
    programming: Histograms,
    endpoint_changes_pending: Gauge,
    endpoint_changes: Counter,
    service_changes_pending: Gauge,
    service_changes: Counter,
    no_local_endpoints: Family<PolicyLabels, Gauge>,
    healthz: Family<CodeLabels, Counter>,
    livez: Family<CodeLabels, Counter>,
}

impl KubeProxyMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self {
            sync_duration: Family::new_with_constructor(sync_histogram),
            last_sync: Family::default(),
            last_queued: Family::default(),
            programming: Family::new_with_constructor(programming_histogram),
            endpoint_changes_pending: Gauge::default(),
            endpoint_changes: Counter::default(),
            service_changes_pending: Gauge::default(),
            service_changes: Counter::default(),
            no_local_endpoints: Family::default(),
            healthz: Family::default(),
            livez: Family::default(),
        };
        m.register_series(registry);
        m.create_series();
        m
    }

    /// Registers every series under kube-proxy's names and help texts.
    fn register_series(&self, registry: &mut Registry) {
        registry.register(
            "kubeproxy_sync_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds",
            self.sync_duration.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            "The last time proxy rules were successfully synced",
            self.last_sync.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
            "The last time a sync of proxy rules was queued",
            self.last_queued.clone(),
        );
        registry.register(
            "kubeproxy_network_programming_duration_seconds",
            "In Cluster Network Programming Latency in seconds",
            self.programming.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
            "Pending proxy rules Endpoint changes",
            self.endpoint_changes_pending.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_endpoint_changes",
            "Cumulative proxy rules Endpoint changes",
            self.endpoint_changes.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_service_changes_pending",
            "Pending proxy rules Service changes",
            self.service_changes_pending.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_service_changes",
            "Cumulative proxy rules Service changes",
            self.service_changes.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
            "Number of services with a Local traffic policy and no endpoints",
            self.no_local_endpoints.clone(),
        );
        registry.register(
            "kubeproxy_proxy_healthz",
            "Cumulative proxy healthz HTTP status",
            self.healthz.clone(),
        );
        registry.register(
            "kubeproxy_proxy_livez",
            "Cumulative proxy livez HTTP status",
            self.livez.clone(),
        );
    }

    /// Creates the labelled series that are present from the start, as kube-proxy's are once
    /// registered.
    fn create_series(&self) {
        for ip_family in FAMILIES {
            let l = FamilyLabels { ip_family };
            let _ = self.sync_duration.get_or_create(&l);
            let _ = self.programming.get_or_create(&l);
            for traffic_policy in ["internal", "external"] {
                let _ = self.no_local_endpoints.get_or_create(&PolicyLabels {
                    traffic_policy,
                    ip_family,
                });
            }
        }
    }

    /// One sync of both families took `d` and ended now.
    pub fn observe_sync(&self, d: Duration) {
        let now = unix_secs(SystemTime::now());
        for ip_family in FAMILIES {
            let l = FamilyLabels { ip_family };
            self.sync_duration
                .get_or_create(&l)
                .observe(d.as_secs_f64());
            self.last_sync.get_or_create(&l).set(now);
        }
    }

    /// A sync was queued with `changes` pending.
    pub fn queued(&self, changes: &Changes) {
        let now = unix_secs(SystemTime::now());
        for ip_family in FAMILIES {
            self.last_queued
                .get_or_create(&FamilyLabels { ip_family })
                .set(now);
        }
        self.endpoint_changes_pending
            .set(i64::try_from(changes.endpoint_slices).unwrap_or(i64::MAX));
        self.service_changes_pending
            .set(i64::try_from(changes.services).unwrap_or(i64::MAX));
    }

    /// The sync of `changes` wrote the maps at `written`, finding `no_local` service ports
    /// without local endpoints.
    pub fn programmed(&self, changes: &Changes, written: SystemTime, no_local: &NoLocalEndpoints) {
        self.endpoint_changes.inc_by(changes.endpoint_slices as u64);
        self.service_changes.inc_by(changes.services as u64);
        self.endpoint_changes_pending.set(0);
        self.service_changes_pending.set(0);
        for (family, trigger) in &changes.triggers {
            let latency = written
                .duration_since(*trigger)
                .unwrap_or_default()
                .as_secs_f64();
            self.programming
                .get_or_create(&FamilyLabels {
                    ip_family: FAMILIES[*family],
                })
                .observe(latency);
        }
        for (i, ip_family) in FAMILIES.into_iter().enumerate() {
            for (traffic_policy, n) in [
                ("internal", no_local.internal[i]),
                ("external", no_local.external[i]),
            ] {
                self.no_local_endpoints
                    .get_or_create(&PolicyLabels {
                        traffic_policy,
                        ip_family,
                    })
                    .set(i64::try_from(n).unwrap_or(i64::MAX));
            }
        }
    }

    /// `/healthz` answered `code`.
    pub fn healthz_answered(&self, code: &'static str) {
        self.healthz.get_or_create(&CodeLabels { code }).inc();
    }

    /// `/livez` answered `code`.
    pub fn livez_answered(&self, code: &'static str) {
        self.livez.get_or_create(&CodeLabels { code }).inc();
    }
}

fn unix_secs(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
}

/// What a snapshot changed against the one applied before it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Changes {
    /// Services added, changed or removed.
    pub services: usize,
    /// EndpointSlices added, changed or removed.
    pub endpoint_slices: usize,
    /// (IP family index, trigger time) of each changed EndpointSlice that says when its change
    /// was triggered.
    pub triggers: Vec<(usize, SystemTime)>,
}

impl Changes {
    /// What `diff` counts for kube-proxy: its Services and EndpointSlices added, changed or
    /// removed, and the trigger times later than `started` (lb's start: kube-proxy ignores
    /// changes made before it ran) of the slices added or changed (a deleted slice's trigger
    /// time is of its last update, not of the deletion).
    pub fn of(diff: &SnapshotDiff, started: SystemTime) -> Self {
        let mut triggers = Vec::new();
        for slice in &diff.slices.changed {
            if let Some(t) = trigger_time(slice)
                && t > started
            {
                triggers.push((usize::from(&*slice.address_type == "IPv6"), t));
            }
        }
        Changes {
            services: diff.services.count(),
            endpoint_slices: diff.slices.count(),
            triggers,
        }
    }
}

/// Counts the objects each snapshot changes, as kube-proxy's change trackers do: the shared
/// change detector ([`ChangeDetector`]) and [`Changes::of`], for callers without a daemon's
/// detector (the daemon counts the diff it computes once per update).
#[derive(Debug)]
pub struct ChangeTracker {
    detector: ChangeDetector,
    /// Trigger times before this are of changes made before lb ran (kube-proxy ignores them).
    started: SystemTime,
}

impl ChangeTracker {
    pub fn new(started: SystemTime) -> Self {
        Self {
            detector: ChangeDetector::new(),
            started,
        }
    }

    /// The changes `snapshot` makes against the previous one; it becomes the previous one.
    pub fn observe(&mut self, snapshot: &Snapshot) -> Changes {
        Changes::of(&self.detector.observe(snapshot), self.started)
    }
}

/// The slice's `LAST_CHANGE_TRIGGER_TIME`, if it is there and parses.
fn trigger_time(slice: &EndpointSlice) -> Option<SystemTime> {
    parse_rfc3339(slice.trigger_time.as_deref()?)
}

/// Parses an RFC 3339 UTC time as Go's `time.RFC3339Nano` writes it (`Z` or a numeric
/// offset, optional fraction).
fn parse_rfc3339(s: &str) -> Option<SystemTime> {
    let (date, time) = s.split_once(['T', 't'])?;
    let mut d = date.splitn(3, '-');
    let (y, mo, da): (i64, u32, u32) = (
        d.next()?.parse().ok()?,
        d.next()?.parse().ok()?,
        d.next()?.parse().ok()?,
    );
    let (clock, offset) = if let Some(c) = time.strip_suffix(['Z', 'z']) {
        (c, 0i64)
    } else {
        let at = time.rfind(['+', '-'])?;
        let (c, off) = time.split_at(at);
        let sign = if off.starts_with('-') { -1 } else { 1 };
        let (oh, om) = off[1..].split_once(':')?;
        (
            c,
            sign * (oh.parse::<i64>().ok()? * 3600 + om.parse::<i64>().ok()? * 60),
        )
    };
    let (hms, frac) = clock.split_once('.').unwrap_or((clock, ""));
    let mut t = hms.splitn(3, ':');
    let (h, mi, se): (i64, i64, i64) = (
        t.next()?.parse().ok()?,
        t.next()?.parse().ok()?,
        t.next()?.parse().ok()?,
    );
    if !(1..=12).contains(&mo) || !(1..=31).contains(&da) || h > 23 || mi > 59 || se > 60 {
        return None;
    }
    let nanos: u32 = if frac.is_empty() {
        0
    } else {
        let digits: String = frac.chars().take(9).collect();
        if !digits.chars().all(|c| c.is_ascii_digit()) {
            return None;
        }
        format!("{digits:0<9}").parse().ok()?
    };
    // Days since 1970-01-01 (Howard Hinnant's days_from_civil).
    let y = if mo <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = i64::from((mo + 9) % 12);
    let doy = (153 * mp + 2) / 5 + i64::from(da) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let secs = days * 86_400 + h * 3600 + mi * 60 + se - offset;
    let secs = u64::try_from(secs).ok()?;
    Some(UNIX_EPOCH + Duration::new(secs, nanos))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_go_rfc3339_nano() {
        let t = |s| parse_rfc3339(s).map(|t| t.duration_since(UNIX_EPOCH).unwrap());
        assert_eq!(t("1970-01-01T00:00:00Z"), Some(Duration::ZERO));
        assert_eq!(
            t("2024-02-29T12:34:56.789Z"),
            Some(Duration::from_millis(1_709_210_096_789))
        );
        assert_eq!(
            t("2024-02-29T14:34:56.5+02:00"),
            Some(Duration::from_millis(1_709_210_096_500))
        );
        assert_eq!(
            t("2000-03-01T00:00:00.000000001Z"),
            Some(Duration::new(951_868_800, 1))
        );
        for bad in [
            "",
            "2024-13-01T00:00:00Z",
            "yesterday",
            "2024-01-01T25:00:00Z",
        ] {
            assert_eq!(t(bad), None, "{bad}");
        }
    }

    #[test]
    fn programming_buckets_are_kube_proxys() {
        let b = programming_buckets();
        assert_eq!(b.len(), 2 + 59 + 12 + 7);
        assert_eq!(&b[..3], &[0.25, 0.5, 1.0]);
        assert_eq!(b[60], 59.0);
        assert_eq!(b[61], 60.0);
        assert_eq!(b[72], 115.0);
        assert_eq!(b[73], 120.0);
        assert_eq!(b[79], 300.0);
        assert!(b.windows(2).all(|w| w[0] < w[1]));
    }
}
