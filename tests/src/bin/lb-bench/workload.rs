//! The Services and EndpointSlices every suite programs, generated deterministically, and the
//! small helpers the suites share (random numbers, statistics, results).
//!
//! Addresses (all inside 198.18.0.0/15, never routed outside the benchmark's namespaces):
//!
//! - ClusterIP of service `i`: `198.19.0.1 + i` for the first 65,534 services, then
//!   `198.18.64.0 + …` (only the 100,000-service datapath case goes that far; it sends no real
//!   traffic);
//! - synthetic endpoints (services nobody sends traffic to): `198.18.0.0/21`, with a target
//!   port from 10000 so that every `ip:port` is unique;
//! - endpoints that replace others in the control-plane change test: `198.18.8.0/21`;
//! - the testbed's links (client, backends) are `198.18.10.0/24` and up.
use std::{
    collections::BTreeMap,
    io,
    net::Ipv4Addr,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
};

use anyhow::Context as _;

use k8s_openapi::{
    api::{
        core::v1::{Service, ServicePort, ServiceSpec},
        discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice},
    },
    apimachinery::pkg::{apis::meta::v1::ObjectMeta, util::intstr::IntOrString},
};
use lb::kube::{LABEL_SERVICE_NAME, slim};

pub const NAMESPACE: &str = "bench";
/// kube-proxy's `--cluster-cidr` in the benchmark: the client is a "pod", so no masquerade.
pub const POD_CIDR: &str = "198.18.0.0/16";
pub const SERVICE_CIDR: &str = "198.19.0.0/16";
/// A destination that is no service: 198.18.250.1:80.
pub const MISS_DST: Ipv4Addr = Ipv4Addr::new(198, 18, 250, 1);

const SYNTHETIC_POOL: u32 = 2048;
const SYNTHETIC_BASE: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 0);
const CHANGE_BASE: Ipv4Addr = Ipv4Addr::new(198, 18, 8, 0);
const FIRST_TARGET_PORT: u32 = 10_000;

/// splitmix64: small, deterministic, good enough to pick services and shuffle orders.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.below(i + 1);
            items.swap(i, j);
        }
    }
}

pub fn vip(i: usize) -> Ipv4Addr {
    let i = u32::try_from(i).unwrap_or(u32::MAX);
    if i < 65_534 {
        Ipv4Addr::from(u32::from(Ipv4Addr::new(198, 19, 0, 1)) + i)
    } else {
        assert!(i - 65_534 < 60_000, "no ClusterIP left for service {i}");
        Ipv4Addr::from(u32::from(Ipv4Addr::new(198, 18, 64, 0)) + (i - 65_534))
    }
}

/// The `e`-th of `per` synthetic endpoints of service `i`: unique `ip:port`s.
fn synthetic(i: usize, e: usize, per: usize) -> (Ipv4Addr, u16) {
    let (i, e, per) = (i as u32, e as u32, per as u32);
    let services_per_port = SYNTHETIC_POOL / per;
    let ip = u32::from(SYNTHETIC_BASE) + (i % services_per_port) * per + e;
    let port = FIRST_TARGET_PORT + i / services_per_port;
    (Ipv4Addr::from(ip), u16::try_from(port).unwrap_or(u16::MAX))
}

/// The `c`-th replacement endpoint address (control-plane changes).
pub fn replacement_ip(c: usize) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(CHANGE_BASE) + (c as u32 % SYNTHETIC_POOL))
}

/// One port of a generated service.
#[derive(Clone, Debug)]
pub struct PortDef {
    pub name: &'static str,
    /// `TCP` or `UDP`.
    pub protocol: &'static str,
    pub port: u16,
    pub target: u16,
}

/// A generated ClusterIP service and its single EndpointSlice.
#[derive(Clone, Debug)]
pub struct ServiceDef {
    pub index: usize,
    pub vip: Ipv4Addr,
    pub ports: Vec<PortDef>,
    pub endpoints: Vec<Ipv4Addr>,
}

impl ServiceDef {
    pub fn name(&self) -> String {
        service_name(self.index)
    }
}

pub fn service_name(i: usize) -> String {
    format!("svc-{i:06}")
}

/// A service nobody sends traffic to: TCP 80 to `per` synthetic endpoints.
pub fn filler(i: usize, per: usize) -> ServiceDef {
    let eps: Vec<(Ipv4Addr, u16)> = (0..per).map(|e| synthetic(i, e, per)).collect();
    ServiceDef {
        index: i,
        vip: vip(i),
        ports: vec![PortDef {
            name: "http",
            protocol: "TCP",
            port: 80,
            target: eps.first().map_or(80, |e| e.1),
        }],
        endpoints: eps.iter().map(|e| e.0).collect(),
    }
}

/// `n` filler services with `per` endpoints each.
pub fn fillers(n: usize, per: usize) -> Vec<ServiceDef> {
    (0..n).map(|i| filler(i, per)).collect()
}

pub fn service(def: &ServiceDef) -> Service {
    Service {
        metadata: ObjectMeta {
            name: Some(def.name()),
            namespace: Some(NAMESPACE.into()),
            ..Default::default()
        },
        spec: Some(ServiceSpec {
            type_: Some("ClusterIP".into()),
            cluster_ip: Some(def.vip.to_string()),
            cluster_ips: Some(vec![def.vip.to_string()]),
            ports: Some(
                def.ports
                    .iter()
                    .map(|p| ServicePort {
                        name: Some(p.name.into()),
                        protocol: Some(p.protocol.into()),
                        port: i32::from(p.port),
                        target_port: Some(IntOrString::Int(i32::from(p.target))),
                        ..Default::default()
                    })
                    .collect(),
            ),
            ..Default::default()
        }),
        ..Default::default()
    }
}

pub fn slice(def: &ServiceDef, endpoints: &[Ipv4Addr]) -> EndpointSlice {
    EndpointSlice {
        metadata: ObjectMeta {
            name: Some(format!("{}-1", def.name())),
            namespace: Some(NAMESPACE.into()),
            labels: Some(BTreeMap::from([(
                LABEL_SERVICE_NAME.to_owned(),
                def.name(),
            )])),
            ..Default::default()
        },
        address_type: "IPv4".into(),
        endpoints: Some(
            endpoints
                .iter()
                .map(|a| Endpoint {
                    addresses: vec![a.to_string()],
                    conditions: Some(EndpointConditions {
                        ready: Some(true),
                        serving: Some(true),
                        terminating: Some(false),
                    }),
                    ..Default::default()
                })
                .collect(),
        ),
        ports: Some(
            def.ports
                .iter()
                .map(|p| EndpointPort {
                    name: Some(p.name.into()),
                    protocol: Some(p.protocol.into()),
                    port: Some(i32::from(p.target)),
                    ..Default::default()
                })
                .collect(),
        ),
    }
}

/// The objects, in service index order (the rule order of the iptables and nftables
/// renderings): as Kubernetes objects for kube-proxy's renderings, and as the slim copies a
/// source hands lb's daemon (`lb`).
pub struct Objects {
    pub services: Vec<Arc<Service>>,
    pub slices: Vec<Arc<EndpointSlice>>,
    pub lb: Slim,
}

/// What lb's sources publish: slim copies (`lb::kube::slim`).
#[derive(Default)]
pub struct Slim {
    pub services: Vec<Arc<slim::Service>>,
    pub slices: Vec<Arc<slim::EndpointSlice>>,
}

impl Objects {
    pub fn new(services: Vec<Arc<Service>>, slices: Vec<Arc<EndpointSlice>>) -> Self {
        let lb = Slim {
            services: services
                .iter()
                .map(|s| Arc::new(s.as_ref().into()))
                .collect(),
            slices: slices.iter().map(|s| Arc::new(s.as_ref().into())).collect(),
        };
        Self {
            services,
            slices,
            lb,
        }
    }

    /// Replaces slice `i` in both forms.
    pub fn set_slice(&mut self, i: usize, slice: EndpointSlice) {
        self.lb.slices[i] = Arc::new((&slice).into());
        self.slices[i] = Arc::new(slice);
    }
}

pub fn objects(defs: &[ServiceDef]) -> Objects {
    Objects::new(
        defs.iter().map(|d| Arc::new(service(d))).collect(),
        defs.iter()
            .map(|d| Arc::new(slice(d, &d.endpoints)))
            .collect(),
    )
}

/// Only lb's slim copies, each Kubernetes object dropped as soon as it is converted (as a
/// source does): what a process holding lb's state holds.
pub fn slim_objects(defs: &[ServiceDef]) -> Slim {
    Slim {
        services: defs
            .iter()
            .map(|d| Arc::new((&service(d)).into()))
            .collect(),
        slices: defs
            .iter()
            .map(|d| Arc::new((&slice(d, &d.endpoints)).into()))
            .collect(),
    }
}

// ---------------------------------------------------------------------------------------------
// Statistics and results

/// Median of `v` (sorted in place); NaN when empty.
pub fn median(v: &mut [f64]) -> f64 {
    percentile(v, 50.0)
}

/// Nearest-rank percentile of `v` (sorted in place); NaN when empty.
pub fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
    v[rank.clamp(1, v.len()) - 1]
}

/// One line of results.json.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Record {
    pub suite: String,
    pub case: String,
    #[serde(rename = "impl")]
    pub impl_: String,
    pub services: usize,
    pub metric: String,
    pub median: f64,
    pub p99: Option<f64>,
    pub unit: String,
}

/// Collects records and free-form notes for the report.
#[derive(Default)]
pub struct Results {
    pub records: Vec<Record>,
    /// Key → text; the report prints them.
    pub notes: BTreeMap<String, String>,
}

impl Results {
    #[expect(
        clippy::too_many_arguments,
        reason = "one argument per results.json field"
    )]
    pub fn push(
        &mut self,
        suite: &str,
        case: &str,
        impl_: &str,
        services: usize,
        metric: &str,
        median: f64,
        p99: Option<f64>,
        unit: &str,
    ) {
        println!(
            "  {suite:<12} {case:<22} {impl_:<20} {services:>7} {metric:<22} {median:>12.3}{} {unit}",
            p99.map(|p| format!(" (p99 {p:.3})")).unwrap_or_default()
        );
        self.records.push(Record {
            suite: suite.into(),
            case: case.into(),
            impl_: impl_.into(),
            services,
            metric: metric.into(),
            median,
            p99,
            unit: unit.into(),
        });
    }

    pub fn note(&mut self, key: &str, text: impl Into<String>) {
        let text = text.into();
        println!("  note {key}: {text}");
        self.notes.insert(key.into(), text);
    }
}

// ---------------------------------------------------------------------------------------------
// Interruption: SIGINT/SIGTERM set a flag the suites check between measurements, so that they
// return an error and every testbed, scratch netns and temporary file is torn down on the way.

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::Relaxed);
}

/// Turns SIGINT and SIGTERM into [`check_interrupted`] errors.
pub fn catch_interrupts() -> anyhow::Result<()> {
    for signal in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        let previous = unsafe {
            libc::signal(
                signal,
                on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t,
            )
        };
        if previous == libc::SIG_ERR {
            return Err(io::Error::last_os_error()).context("installing a signal handler");
        }
    }
    Ok(())
}

/// Fails once SIGINT or SIGTERM arrived.
pub fn check_interrupted() -> anyhow::Result<()> {
    if INTERRUPTED.load(Ordering::Relaxed) {
        anyhow::bail!("interrupted; cleaning up");
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// CPU placement

/// Pins the calling thread (and the threads it starts later) to the last CPU it may run on,
/// while alive.
pub struct PinCpu(libc::cpu_set_t);

impl PinCpu {
    pub fn last() -> anyhow::Result<Self> {
        Self::pick(true)
    }

    /// Pins to the first CPU it may run on (north-south's sinks, away from the sender).
    pub fn first() -> anyhow::Result<Self> {
        Self::pick(false)
    }

    fn pick(last: bool) -> anyhow::Result<Self> {
        // SAFETY: cpu_set_t is plain data; sched_{get,set}affinity write/read it.
        unsafe {
            let mut old: libc::cpu_set_t = std::mem::zeroed();
            if libc::sched_getaffinity(0, size_of::<libc::cpu_set_t>(), &raw mut old) != 0 {
                return Err(io::Error::last_os_error()).context("sched_getaffinity");
            }
            let allowed = |c: &usize| libc::CPU_ISSET(*c, &old);
            let all = 0..libc::CPU_SETSIZE as usize;
            let cpu = if last {
                all.rev().find(allowed)
            } else {
                all.clone().find(allowed)
            }
            .unwrap_or(0);
            let mut one: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu, &mut one);
            if libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &raw const one) != 0 {
                return Err(io::Error::last_os_error()).context("sched_setaffinity");
            }
            Ok(Self(old))
        }
    }
}

impl Drop for PinCpu {
    fn drop(&mut self) {
        // SAFETY: restores the mask read in `last`.
        unsafe {
            libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &raw const self.0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_unique_and_in_range() {
        let mut seen = std::collections::BTreeSet::new();
        for i in 0..50_000 {
            for e in 0..5 {
                assert!(seen.insert(synthetic(i, e, 5)));
            }
        }
        assert_eq!(vip(0), Ipv4Addr::new(198, 19, 0, 1));
        assert_eq!(vip(65_533), Ipv4Addr::new(198, 19, 255, 254));
        assert_eq!(vip(65_534), Ipv4Addr::new(198, 18, 64, 0));
        assert!(vip(99_999) < MISS_DST);
        let mut v = vec![3.0, 1.0, 2.0, 4.0];
        assert_eq!(median(&mut v), 2.0);
        assert_eq!(percentile(&mut v, 99.0), 4.0);
    }
}
