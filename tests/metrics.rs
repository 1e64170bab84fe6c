//! `lb::metrics`: the Prometheus exposition scraped over real HTTP, and the kube-proxy-style
//! health endpoints. Only `datapath_maps_are_read_at_scrape_time` needs root (it loads the
//! datapath, privately).
use std::{
    collections::BTreeMap,
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    sync::Arc,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use aya::maps::{HashMap, PerCpuArray, PerCpuValues};
use lb::{
    datapath::conntrack::{Gc, Reason, monotonic_secs},
    datapath::load::{Datapath, LoadOptions},
    metrics::{HEALTH_TIMEOUT, Metrics, rfc3339, serve},
};
use lb_common::{Backend4, Ct4Key, Ct4Value, MetricValue, ct_dir, ct_flags, map_names, metrics};

const GO_ZERO_TIME: &str = "0001-01-01T00:00:00Z";

struct Response {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl Response {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// A minimal HTTP/1.1 GET over a fresh connection (`Connection: close`).
fn get(addr: SocketAddr, path: &str) -> Response {
    let mut stream = TcpStream::connect(addr).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("read timeout");
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .expect("send request");
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).expect("read response");
    let raw = String::from_utf8(raw).expect("utf-8 response");
    let (head, body) = raw.split_once("\r\n\r\n").expect("end of headers");
    let mut lines = head.split("\r\n");
    let status_line = lines.next().expect("status line");
    let status = status_line
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("bad status line {status_line:?}"));
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect();
    let mut response = Response {
        status,
        headers,
        body: body.to_owned(),
    };
    if response
        .header("transfer-encoding")
        .is_some_and(|v| v.eq_ignore_ascii_case("chunked"))
    {
        response.body = dechunk(body);
    } else if let Some(len) = response.header("content-length") {
        let len: usize = len.parse().expect("content-length");
        assert_eq!(response.body.len(), len, "body length");
    }
    response
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    loop {
        let (size, rest) = s.split_once("\r\n").expect("chunk size line");
        let size = usize::from_str_radix(size.split(';').next().unwrap_or("").trim(), 16)
            .expect("chunk size");
        if size == 0 {
            return out;
        }
        out.push_str(&rest[..size]);
        s = rest[size..].strip_prefix("\r\n").expect("chunk end");
    }
}

/// One sample of the text exposition.
#[derive(Debug)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

/// Parses the Prometheus text format: `# HELP` / `# TYPE` lines into `types`, samples into
/// `samples`.
fn parse(text: &str) -> (BTreeMap<String, String>, Vec<Sample>) {
    let mut types = BTreeMap::new();
    let mut samples = Vec::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, ty) = rest.split_once(' ').expect("TYPE line");
            types.insert(name.to_owned(), ty.to_owned());
            continue;
        }
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let (name, labels, rest) = match line.find('{') {
            Some(open) => {
                let (labels, rest) = parse_labels(&line[open + 1..]);
                (&line[..open], labels, rest)
            }
            None => {
                let (name, rest) = line.split_once(' ').expect("sample value");
                (name, BTreeMap::new(), rest)
            }
        };
        let value = rest.split_whitespace().next().expect("value");
        let value = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            v => v
                .parse()
                .unwrap_or_else(|_| panic!("bad value in {line:?}")),
        };
        samples.push(Sample {
            name: name.to_owned(),
            labels,
            value,
        });
    }
    (types, samples)
}

/// Parses `k="v",k2="v2"} rest` into the labels and `rest`.
fn parse_labels(mut s: &str) -> (BTreeMap<String, String>, &str) {
    let mut labels = BTreeMap::new();
    loop {
        s = s.trim_start_matches(',');
        if let Some(rest) = s.strip_prefix('}') {
            return (labels, rest);
        }
        let (key, rest) = s.split_once("=\"").expect("label key");
        let mut value = String::new();
        let mut chars = rest.char_indices();
        let end = loop {
            match chars.next().expect("unterminated label value") {
                (i, '"') => break i,
                (_, '\\') => match chars.next().expect("escape").1 {
                    'n' => value.push('\n'),
                    c => value.push(c),
                },
                (_, c) => value.push(c),
            }
        };
        labels.insert(key.to_owned(), value);
        s = &rest[end + 1..];
    }
}

fn find<'a>(samples: &'a [Sample], name: &str, labels: &[(&str, &str)]) -> Vec<&'a Sample> {
    samples
        .iter()
        .filter(|s| {
            s.name == name
                && labels
                    .iter()
                    .all(|(k, v)| s.labels.get(*k).is_some_and(|l| l == v))
        })
        .collect()
}

/// The value of the one sample named `name` with (at least) `labels`.
fn value(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> f64 {
    match find(samples, name, labels).as_slice() {
        [s] => s.value,
        other => panic!("expected one {name}{labels:?}, found {other:?}"),
    }
}

fn assert_close(got: f64, want: f64, what: &str) {
    assert!((got - want).abs() < 1e-9, "{what}: got {got}, want {want}");
}

async fn start(metrics: &Arc<Metrics>) -> (SocketAddr, SocketAddr, tokio::task::JoinHandle<()>) {
    let any: SocketAddr = "127.0.0.1:0".parse().expect("addr");
    serve(Arc::clone(metrics), any, any).await.expect("serve")
}

/// Runs a blocking HTTP GET off the runtime's workers.
async fn fetch(addr: SocketAddr, path: &'static str) -> Response {
    tokio::task::spawn_blocking(move || get(addr, path))
        .await
        .expect("client thread")
}

/// The healthz body, checked for kube-proxy's shape: `healthy` agrees with the status code,
/// both families report, and the node is eligible unless `eligible` says otherwise.
fn health_json_of(r: &Response, eligible: bool) -> serde_json::Value {
    assert_eq!(r.header("content-type"), Some("application/json"));
    let v: serde_json::Value = serde_json::from_str(&r.body).expect("healthz JSON");
    assert_eq!(v["nodeEligible"], serde_json::Value::Bool(eligible), "{v}");
    assert_eq!(
        v["healthy"],
        serde_json::Value::Bool(r.status == 200),
        "{v}"
    );
    assert!(
        v["currentTime"].as_str().is_some_and(|t| t.ends_with('Z')),
        "{v}"
    );
    for family in ["IPv4", "IPv6"] {
        assert!(v["status"][family]["healthy"].is_boolean(), "{v}");
        assert!(v["status"][family]["lastUpdated"].is_string(), "{v}");
    }
    v
}

fn health_json(r: &Response) -> serde_json::Value {
    health_json_of(r, true)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn livez_and_healthz_follow_sync_state() {
    let metrics = Metrics::new();
    let (metrics_addr, health_addr, task) = start(&metrics).await;
    assert_ne!(metrics_addr, health_addr, "port 0 gives two listeners");

    let livez = fetch(health_addr, "/livez").await;
    assert_eq!(livez.status, 200);

    let before = fetch(health_addr, "/healthz").await;
    assert_eq!(before.status, 503, "unhealthy before the first sync");
    let v = health_json(&before);
    assert_eq!(v["lastUpdated"], GO_ZERO_TIME, "{v}");

    metrics.mark_synced();
    let after = fetch(health_addr, "/healthz").await;
    assert_eq!(after.status, 200, "{}", after.body);
    let v = health_json(&after);
    assert_ne!(v["lastUpdated"], GO_ZERO_TIME, "{v}");

    // A change pending for less than the timeout keeps the proxy healthy.
    metrics.mark_change_pending(Instant::now());
    assert_eq!(fetch(health_addr, "/healthz").await.status, 200);

    // One pending for longer than the timeout does not (when the clock allows an instant that
    // far back; otherwise `healthy_times_out_a_pending_change` covers it).
    if let Some(old) = Instant::now().checked_sub(HEALTH_TIMEOUT + Duration::from_secs(1)) {
        metrics.mark_change_pending(old);
        let stale = fetch(health_addr, "/healthz").await;
        assert_eq!(stale.status, 503, "{}", stale.body);
        health_json(&stale);
    }
    metrics.mark_synced();
    assert_eq!(fetch(health_addr, "/healthz").await.status, 200);
    assert_eq!(fetch(health_addr, "/livez").await.status, 200);

    // A node being deleted (or tainted for deletion) fails healthz, so load balancers drain it,
    // though the proxier itself is healthy.
    metrics.set_node_eligible(false);
    let draining = fetch(health_addr, "/healthz").await;
    assert_eq!(draining.status, 503, "{}", draining.body);
    let v = health_json_of(&draining, false);
    assert_eq!(v["status"]["IPv4"]["healthy"], true, "{v}");
    assert_eq!(v["lastUpdated"], v["status"]["IPv4"]["lastUpdated"], "{v}");
    metrics.set_node_eligible(true);
    assert_eq!(fetch(health_addr, "/healthz").await.status, 200);

    // The endpoints are split by listener, as kube-proxy's are.
    assert_eq!(fetch(metrics_addr, "/healthz").await.status, 404);
    assert_eq!(fetch(health_addr, "/metrics").await.status, 404);
    task.abort();
}

#[test]
fn healthy_is_false_before_the_first_sync() {
    let metrics = Metrics::new();
    let now = Instant::now();
    assert!(!metrics.healthy(now));
    metrics.mark_change_pending(now);
    assert!(!metrics.healthy(now));
    metrics.mark_synced();
    assert!(metrics.healthy(Instant::now()));
    let (healthy, body) = metrics.healthz();
    assert!(healthy, "{body}");
}

#[test]
fn healthy_times_out_a_pending_change() {
    let metrics = Metrics::new();
    metrics.mark_synced();
    let t0 = Instant::now();
    metrics.mark_change_pending(t0);
    assert!(metrics.healthy(t0));
    assert!(metrics.healthy(t0 + HEALTH_TIMEOUT - Duration::from_millis(1)));
    assert!(!metrics.healthy(t0 + HEALTH_TIMEOUT));
    assert!(!metrics.healthy(t0 + HEALTH_TIMEOUT + Duration::from_secs(1)));

    // The oldest pending change counts: a later one does not restart the clock.
    metrics.mark_change_pending(t0 + Duration::from_secs(30));
    assert!(!metrics.healthy(t0 + HEALTH_TIMEOUT + Duration::from_secs(1)));

    // Applying clears it.
    metrics.mark_synced();
    assert!(metrics.healthy(t0 + HEALTH_TIMEOUT * 10));
    assert_eq!(HEALTH_TIMEOUT, Duration::from_secs(60));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scrape_reports_observed_values() {
    let metrics = Metrics::new();
    let observations = [
        (Duration::from_micros(1000), true),
        (Duration::from_micros(1000), true),
        (Duration::from_micros(2000), false),
    ];
    for (d, ok) in observations {
        metrics.observe_sync(d, ok);
    }
    metrics.observe_event_to_write(Duration::from_micros(300));
    metrics.inc_skipped("Service", "InvalidPort");
    metrics.inc_skipped("Service", "InvalidPort");
    metrics.inc_skipped("EndpointSlice", "NoService");
    metrics.set_map_entries("lb4_services", 10, 524_288);
    metrics.set_map_entries("lb6_services", 0, 524_288);
    metrics.set_services(3);
    metrics.set_backends(7);
    metrics.inc_healthcheck_bind_errors();
    metrics.inc_healthcheck_bind_errors();
    metrics.set_healthcheck_listeners(2);
    // Later values replace earlier ones.
    metrics.set_map_entries("lb4_services", 12, 524_288);

    let (metrics_addr, _, task) = start(&metrics).await;
    let r = fetch(metrics_addr, "/metrics").await;
    task.abort();
    assert_eq!(r.status, 200);
    assert_eq!(
        r.header("content-type"),
        Some("text/plain; version=0.0.4; charset=utf-8")
    );
    let (types, s) = parse(&r.body);

    for (name, ty) in [
        ("lb_sync_duration_seconds", "histogram"),
        ("lb_syncs_total", "counter"),
        ("lb_last_sync_timestamp_seconds", "gauge"),
        ("lb_event_to_map_write_seconds", "histogram"),
        ("lb_objects_skipped_total", "counter"),
        ("lb_map_entries", "gauge"),
        ("lb_map_capacity", "gauge"),
        ("lb_services", "gauge"),
        ("lb_backends", "gauge"),
        ("lb_healthcheck_bind_errors_total", "counter"),
        ("lb_healthcheck_listeners", "gauge"),
    ] {
        assert_eq!(types.get(name).map(String::as_str), Some(ty), "{name}");
    }
    assert!(
        !r.body.contains("lb_datapath_")
            && !r.body.contains("lb_conntrack_insert_failures")
            && !r
                .body
                .lines()
                .any(|l| l.starts_with("lb_conntrack_entries{")),
        "no map series without maps, no conntrack entries before a GC pass:\n{}",
        r.body
    );
    assert_eq!(value(&s, "lb_conntrack_gc_runs_total", &[]), 0.0);

    assert_eq!(value(&s, "lb_syncs_total", &[("result", "ok")]), 2.0);
    assert_eq!(value(&s, "lb_syncs_total", &[("result", "error")]), 1.0);
    assert_eq!(value(&s, "lb_sync_duration_seconds_count", &[]), 3.0);
    assert_close(value(&s, "lb_sync_duration_seconds_sum", &[]), 0.004, "sum");
    // Cumulative buckets: each holds the observations at or below its bound; sub-millisecond
    // bounds exist.
    let buckets = find(&s, "lb_sync_duration_seconds_bucket", &[]);
    assert!(buckets.len() > 10, "{buckets:?}");
    let mut bounds = Vec::new();
    for b in &buckets {
        let le = b.labels.get("le").expect("le");
        let le: f64 = if le == "+Inf" {
            f64::INFINITY
        } else {
            le.parse().expect("le value")
        };
        let want = observations
            .iter()
            .filter(|(d, _)| d.as_secs_f64() <= le)
            .count();
        assert_eq!(b.value, want as f64, "bucket le={le}");
        bounds.push(le);
    }
    assert!(bounds.iter().any(|le| *le <= 100e-6), "{bounds:?}");
    assert!(
        bounds.iter().any(|le| *le >= 10.0 && le.is_finite()),
        "{bounds:?}"
    );
    assert_eq!(bounds.last(), Some(&f64::INFINITY));

    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_secs_f64();
    let last = value(&s, "lb_last_sync_timestamp_seconds", &[]);
    assert!((now - last).abs() < 60.0, "last sync {last}, now {now}");

    assert_eq!(value(&s, "lb_event_to_map_write_seconds_count", &[]), 1.0);
    assert_close(
        value(&s, "lb_event_to_map_write_seconds_sum", &[]),
        0.0003,
        "event sum",
    );
    assert_eq!(
        value(
            &s,
            "lb_event_to_map_write_seconds_bucket",
            &[("le", "+Inf")]
        ),
        1.0
    );

    assert_eq!(
        value(
            &s,
            "lb_objects_skipped_total",
            &[("kind", "Service"), ("reason", "InvalidPort")]
        ),
        2.0
    );
    assert_eq!(
        value(
            &s,
            "lb_objects_skipped_total",
            &[("kind", "EndpointSlice"), ("reason", "NoService")]
        ),
        1.0
    );
    assert_eq!(
        value(&s, "lb_map_entries", &[("map", "lb4_services")]),
        12.0
    );
    assert_eq!(value(&s, "lb_map_entries", &[("map", "lb6_services")]), 0.0);
    assert_eq!(
        value(&s, "lb_map_capacity", &[("map", "lb4_services")]),
        524_288.0
    );
    assert_eq!(value(&s, "lb_services", &[]), 3.0);
    assert_eq!(value(&s, "lb_healthcheck_bind_errors_total", &[]), 2.0);
    assert_eq!(value(&s, "lb_healthcheck_listeners", &[]), 2.0);
    assert_eq!(value(&s, "lb_backends", &[]), 7.0);

    // `render` gives the same exposition the endpoint serves.
    let (_, direct) = parse(&metrics.render());
    assert_eq!(direct.len(), s.len());
}

#[test]
fn fresh_metrics_export_zeroed_sync_results() {
    let metrics = Metrics::new();
    let (_, s) = parse(&metrics.render());
    assert_eq!(value(&s, "lb_syncs_total", &[("result", "ok")]), 0.0);
    assert_eq!(value(&s, "lb_syncs_total", &[("result", "error")]), 0.0);
    assert_eq!(value(&s, "lb_sync_duration_seconds_count", &[]), 0.0);
}

fn ct4_key(client_port: u16) -> Ct4Key {
    Ct4Key {
        saddr: [198, 18, 10, 2],
        daddr: [198, 19, 0, 10],
        sport: client_port,
        dport: 80,
        proto: lb_common::IPPROTO_TCP,
        dir: ct_dir::SERVICE,
        ..Default::default()
    }
}

/// Needs root: loads the real datapath (private maps), writes the per-CPU counters and
/// conntrack entries from userspace, runs a conntrack GC pass over them, and reads the counters
/// and what the GC found back through a scrape.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn datapath_maps_are_read_at_scrape_time() {
    let small: BTreeMap<String, u32> = [
        map_names::CT_TCP4,
        map_names::CT_ANY4,
        map_names::CT_TCP6,
        map_names::CT_ANY6,
    ]
    .into_iter()
    .map(|n| (n.to_string(), 1024))
    .collect();
    let mut datapath = Datapath::load(&LoadOptions {
        max_entries: small,
        ..LoadOptions::default()
    })
    .expect("load datapath (root?)");
    let ebpf = datapath.ebpf_mut();
    let mut counters: PerCpuArray<_, MetricValue> =
        PerCpuArray::try_from(ebpf.take_map(map_names::METRICS).expect("lb_metrics"))
            .expect("per-CPU array");
    let take = |ebpf: &mut aya::Ebpf, name: &str| ebpf.take_map(name).expect(name);
    let mut gc = Gc {
        tcp4: HashMap::try_from(take(ebpf, map_names::CT_TCP4)).expect("ct"),
        any4: HashMap::try_from(take(ebpf, map_names::CT_ANY4)).expect("ct"),
        tcp6: HashMap::try_from(take(ebpf, map_names::CT_TCP6)).expect("ct"),
        any6: HashMap::try_from(take(ebpf, map_names::CT_ANY6)).expect("ct"),
        backends4: HashMap::try_from(take(ebpf, map_names::BACKENDS4)).expect("backends"),
        backends6: HashMap::try_from(take(ebpf, map_names::BACKENDS6)).expect("backends"),
    };

    let cpus = aya::util::nr_cpus().expect("nr_cpus");
    let per_cpu = |packets: u64, bytes: u64| -> Vec<MetricValue> {
        (1..=cpus as u64)
            .map(|c| MetricValue {
                packets: packets * c,
                bytes: bytes * c,
            })
            .collect()
    };
    let written = [
        (metrics::TC_FWD_NEW, per_cpu(3, 300)),
        (metrics::TC_REVNAT, per_cpu(5, 700)),
        (metrics::SOCK_REVNAT_INSERT_FAILED, per_cpu(1, 0)),
        (metrics::TC_CT_INSERT_FAILED, per_cpu(2, 100)),
        // Past the named indices: never exported.
        (metrics::NAMES.len() as u32 + 1, per_cpu(9, 9)),
    ];
    for (index, values) in &written {
        let values = PerCpuValues::try_from(values.clone()).expect("per-CPU values");
        counters.set(*index, values, 0).expect("write lb_metrics");
    }

    // Backend 1 lives at 198.19.1.1:8080; backend 2 is gone.
    let backend = Backend4 {
        addr: [198, 19, 1, 1],
        port: 8080,
        proto: lb_common::IPPROTO_TCP,
        state: 0,
    };
    gc.backends4.insert(1, backend, 0).expect("backend");
    let now = monotonic_secs();
    let live = |flags| Ct4Value {
        backend_id: 1,
        rev_nat_id: 1,
        expires: now + 600,
        flags,
        ..Default::default()
    };
    let entries = [
        // Two live flows of backend 1: established, and one still waiting for its reply.
        (ct4_key(40_000), live(ct_flags::SEEN_REPLY)),
        (ct4_key(40_001), live(0)),
        // Expired, and closed past its closing lifetime.
        (
            ct4_key(40_002),
            Ct4Value {
                expires: now.saturating_sub(1),
                ..live(ct_flags::SEEN_REPLY)
            },
        ),
        (
            ct4_key(40_003),
            Ct4Value {
                expires: now,
                ..live(ct_flags::SEEN_REPLY | ct_flags::TX_CLOSING)
            },
        ),
        // Live, but of the backend that is gone.
        (
            ct4_key(40_004),
            Ct4Value {
                backend_id: 2,
                ..live(ct_flags::SEEN_REPLY)
            },
        ),
    ];
    for (k, v) in &entries {
        gc.tcp4.insert(k, v, 0).expect("insert lb4_ct_tcp");
    }
    // The reply entry of the first flow, from backend 1's address, and one of a flow whose id
    // 1 named another address when it was made (an id reused after a restart): its service
    // entry goes with it.
    let reply = |from: [u8; 4], client_port| Ct4Key {
        saddr: from,
        daddr: [198, 18, 10, 2],
        sport: 8080,
        dport: client_port,
        proto: lb_common::IPPROTO_TCP,
        dir: ct_dir::REPLY,
        ..Default::default()
    };
    gc.tcp4
        .insert(reply(backend.addr, 40_000), live(ct_flags::SEEN_REPLY), 0)
        .expect("reply");
    gc.tcp4
        .insert(ct4_key(40_005), live(ct_flags::SEEN_REPLY), 0)
        .expect("service");
    gc.tcp4
        .insert(
            reply([198, 19, 9, 9], 40_005),
            live(ct_flags::SEEN_REPLY),
            0,
        )
        .expect("reply");
    // A UDP flow in the other map.
    let udp = Ct4Key {
        proto: lb_common::IPPROTO_UDP,
        ..ct4_key(40_006)
    };
    gc.any4.insert(udp, live(0), 0).expect("udp");

    let report = gc.pass(now);
    assert_eq!(report.deleted(Reason::Expired), 1, "{report:?}");
    assert_eq!(report.deleted(Reason::Closed), 1, "{report:?}");
    assert_eq!(report.deleted(Reason::BackendGone), 3, "{report:?}");
    assert_eq!(report.errors, 0);
    let left: Vec<u16> = {
        let mut v: Vec<u16> = gc
            .tcp4
            .keys()
            .map(|k| k.expect("key"))
            .filter(|k| k.dir == ct_dir::SERVICE)
            .map(|k| k.sport)
            .collect();
        v.sort_unstable();
        v
    };
    assert_eq!(
        left,
        [40_000, 40_001],
        "only live flows of live backends stay"
    );
    assert!(gc.tcp4.get(&reply(backend.addr, 40_000), 0).is_ok());
    assert!(gc.any4.get(&udp, 0).is_ok(), "the live UDP flow stays");
    // A second pass finds nothing more to do.
    let again = gc.pass(now);
    assert_eq!(again.total_deleted(), 0, "{again:?}");

    let m = Metrics::new();
    m.set_datapath_counters(counters);
    m.observe_ct_gc(&report);
    let (metrics_addr, _, task) = start(&m).await;
    let r = fetch(metrics_addr, "/metrics").await;
    task.abort();
    assert_eq!(r.status, 200);
    let (types, s) = parse(&r.body);
    assert_eq!(
        types.get("lb_datapath_packets_total").map(String::as_str),
        Some("counter")
    );
    assert_eq!(
        types.get("lb_datapath_bytes_total").map(String::as_str),
        Some("counter")
    );
    assert_eq!(
        types.get("lb_conntrack_entries").map(String::as_str),
        Some("gauge")
    );

    for (index, values) in &written[..4] {
        let event = metrics::NAMES[*index as usize];
        let packets: u64 = values.iter().map(|v| v.packets).sum();
        let bytes: u64 = values.iter().map(|v| v.bytes).sum();
        let labels = [("event", event)];
        assert_eq!(
            value(&s, "lb_datapath_packets_total", &labels),
            packets as f64,
            "{event}"
        );
        assert_eq!(
            value(&s, "lb_datapath_bytes_total", &labels),
            bytes as f64,
            "{event}"
        );
    }
    assert_eq!(
        value(
            &s,
            "lb_datapath_packets_total",
            &[(
                "event",
                metrics::NAMES[metrics::TC_PASS_NO_SERVICE as usize]
            )]
        ),
        0.0
    );
    let series = find(&s, "lb_datapath_packets_total", &[]);
    assert_eq!(series.len(), metrics::NAMES.len(), "{series:?}");
    assert!(series.iter().all(|x| {
        x.labels
            .get("event")
            .is_some_and(|e| metrics::NAMES.contains(&e.as_str()))
    }));
    let insert_failed: u64 = written[3].1.iter().map(|v| v.packets).sum();
    assert_eq!(
        value(&s, "lb_conntrack_insert_failures_total", &[]),
        insert_failed as f64
    );

    let ct = |protocol, state| {
        value(
            &s,
            "lb_conntrack_entries",
            &[("family", "ipv4"), ("protocol", protocol), ("state", state)],
        )
    };
    // Two established entries (flow 40000's service and reply entries), one waiting.
    assert_eq!(ct("tcp", "established"), 2.0);
    assert_eq!(ct("tcp", "new"), 1.0);
    assert_eq!(ct("udp", "new"), 1.0);
    assert_eq!(value(&s, "lb_conntrack_gc_runs_total", &[]), 1.0);
    for (reason, n) in [("expired", 1.0), ("closed", 1.0), ("backend_gone", 3.0)] {
        assert_eq!(
            value(&s, "lb_conntrack_gc_deleted_total", &[("reason", reason)]),
            n,
            "{reason}"
        );
    }
    assert_eq!(
        value(&s, "lb_conntrack_gc_duration_seconds_count", &[]),
        1.0
    );

    // States no entry is in any more read 0 after the next pass.
    m.observe_ct_gc(&lb::datapath::conntrack::GcReport::default());
    let r = {
        let (metrics_addr, _, task) = start(&m).await;
        let r = fetch(metrics_addr, "/metrics").await;
        task.abort();
        r
    };
    let (_, s) = parse(&r.body);
    assert_eq!(
        value(
            &s,
            "lb_conntrack_entries",
            &[
                ("family", "ipv4"),
                ("protocol", "tcp"),
                ("state", "established")
            ]
        ),
        0.0
    );
    drop(datapath);
}

/// A Service or EndpointSlice from YAML.
fn object<T: lb_tests::FromJson>(yaml: &str) -> Arc<T> {
    Arc::new(T::from_json(serde_yaml::from_str(yaml).expect("object")))
}

fn snapshot(
    services: Vec<Arc<lb::kube::slim::Service>>,
    slices: Vec<Arc<lb::kube::slim::EndpointSlice>>,
) -> lb::kube::source::Snapshot {
    lb::kube::source::Snapshot {
        services,
        slices,
        node: None,
        problems: Vec::new(),
        changed_at: Instant::now(),
    }
}

/// kube-proxy's SLIs under kube-proxy's names: change counts (pending while a sync is queued,
/// totals after it), network programming latency from the EndpointSlice trigger time, the
/// per-family sync series, no-local-endpoint gauges, probe counters and `/proxyMode`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kube_proxy_slis_follow_changes_and_probes() {
    use lb::{
        metrics::kubeproxy::{ChangeTracker, LAST_CHANGE_TRIGGER_TIME},
        translate::NoLocalEndpoints,
    };
    let metrics = Metrics::new();
    let (maddr, haddr, task) = start(&metrics).await;
    let started = SystemTime::now() - Duration::from_secs(60);
    let mut tracker = ChangeTracker::new(started);
    let service = |name: &str, port: u16| {
        object(&format!(
            "{{metadata: {{name: {name}, namespace: t}}, spec: {{clusterIP: 198.19.0.1, ports: [{{port: {port}}}]}}}}"
        ))
    };
    // As the EndpointSlice controller writes it (RFC 3339; lb's formatter has milliseconds).
    let trigger = |age: u64| rfc3339(SystemTime::now() - Duration::from_secs(age));
    let slice = |name: &str, family: &str, addr: &str, annotation: Option<String>| {
        let ann = annotation
            .map(|t| format!(", annotations: {{\"{LAST_CHANGE_TRIGGER_TIME}\": \"{t}\"}}"))
            .unwrap_or_default();
        object(&format!(
            "{{metadata: {{name: {name}, namespace: t, labels: {{kubernetes.io/service-name: a}}{ann}}}, addressType: {family}, endpoints: [{{addresses: [\"{addr}\"]}}]}}"
        ))
    };

    // First snapshot: two services, two slices; the IPv6 slice was triggered 3 s ago, the IPv4
    // one before lb started (ignored, as kube-proxy ignores it).
    let (old, recent) = (trigger(120), trigger(3));
    let first = snapshot(
        vec![service("a", 80), service("b", 81)],
        vec![
            slice("a-4", "IPv4", "198.18.0.1", Some(old.clone())),
            slice("a-6", "IPv6", "2001:db8::1", Some(recent.clone())),
        ],
    );
    let changes = tracker.observe(&first);
    assert_eq!((changes.services, changes.endpoint_slices), (2, 2));
    assert_eq!(changes.triggers.len(), 1, "{changes:?}");
    metrics.kube_proxy().queued(&changes);
    let (_, samples) = parse(&fetch(maddr, "/metrics").await.body);
    assert_close(
        value(
            &samples,
            "kubeproxy_sync_proxy_rules_service_changes_pending",
            &[],
        ),
        2.0,
        "service changes pending",
    );
    assert_close(
        value(
            &samples,
            "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
            &[],
        ),
        2.0,
        "endpoint changes pending",
    );
    let queued = value(
        &samples,
        "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
        &[("ip_family", "IPv4")],
    );
    assert!(queued > 1e9, "queued timestamp {queued}");

    metrics.observe_sync(Duration::from_millis(3), true);
    let no_local = NoLocalEndpoints {
        internal: [1, 0],
        external: [0, 2],
    };
    metrics
        .kube_proxy()
        .programmed(&changes, SystemTime::now(), &no_local);
    let (_, samples) = parse(&fetch(maddr, "/metrics").await.body);
    for (name, want) in [
        ("kubeproxy_sync_proxy_rules_service_changes_pending", 0.0),
        ("kubeproxy_sync_proxy_rules_endpoint_changes_pending", 0.0),
        ("kubeproxy_sync_proxy_rules_service_changes_total", 2.0),
        ("kubeproxy_sync_proxy_rules_endpoint_changes_total", 2.0),
    ] {
        assert_close(value(&samples, name, &[]), want, name);
    }
    let v6 = [("ip_family", "IPv6")];
    assert_close(
        value(
            &samples,
            "kubeproxy_network_programming_duration_seconds_count",
            &v6,
        ),
        1.0,
        "one IPv6 programming observation",
    );
    let latency = value(
        &samples,
        "kubeproxy_network_programming_duration_seconds_sum",
        &v6,
    );
    assert!(
        (2.5..30.0).contains(&latency),
        "programming latency {latency}"
    );
    // Under 3 s: counted in the 3 s bucket, not the 2 s one (kube-proxy's linear buckets).
    let bucket = |le: f64| {
        find(
            &samples,
            "kubeproxy_network_programming_duration_seconds_bucket",
            &v6,
        )
        .into_iter()
        .find(|b| b.labels.get("le").and_then(|l| l.parse::<f64>().ok()) == Some(le))
        .unwrap_or_else(|| panic!("no bucket le={le}"))
        .value
    };
    assert_close(bucket(2.0), 0.0, "2 s bucket");
    assert_close(bucket(300.0), 1.0, "5 min bucket");
    assert_close(
        value(
            &samples,
            "kubeproxy_network_programming_duration_seconds_count",
            &[("ip_family", "IPv4")],
        ),
        0.0,
        "the IPv4 slice's trigger predates lb",
    );
    for family in ["IPv4", "IPv6"] {
        let l = [("ip_family", family)];
        assert_close(
            value(
                &samples,
                "kubeproxy_sync_proxy_rules_duration_seconds_count",
                &l,
            ),
            1.0,
            "sync observed once per family",
        );
        assert!(
            value(
                &samples,
                "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
                &l
            ) > 1e9
        );
    }
    for (policy, family, want) in [
        ("internal", "IPv4", 1.0),
        ("internal", "IPv6", 0.0),
        ("external", "IPv4", 0.0),
        ("external", "IPv6", 2.0),
    ] {
        assert_close(
            value(
                &samples,
                "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
                &[("traffic_policy", policy), ("ip_family", family)],
            ),
            want,
            &format!("no local endpoints {policy}/{family}"),
        );
    }

    // The same objects again (new copies, as a manifest reload makes): nothing changed. Then
    // one slice changes and a service goes.
    let again = snapshot(
        vec![service("a", 80), service("b", 81)],
        vec![
            slice("a-4", "IPv4", "198.18.0.1", Some(old)),
            slice("a-6", "IPv6", "2001:db8::1", Some(recent.clone())),
        ],
    );
    let none = tracker.observe(&again);
    assert_eq!((none.services, none.endpoint_slices), (0, 0), "{none:?}");
    assert!(none.triggers.is_empty());
    let next = snapshot(
        vec![service("a", 80)],
        vec![
            slice("a-4", "IPv4", "198.18.0.2", Some(trigger(1))),
            slice("a-6", "IPv6", "2001:db8::1", Some(recent)),
        ],
    );
    let changes = tracker.observe(&next);
    assert_eq!((changes.services, changes.endpoint_slices), (1, 1));
    assert_eq!(changes.triggers.len(), 1);
    assert_eq!(changes.triggers[0].0, 0, "the IPv4 slice changed");

    // Probes are counted by answer, and /proxyMode names the mode.
    assert_eq!(fetch(haddr, "/healthz").await.status, 503);
    metrics.mark_synced();
    assert_eq!(fetch(haddr, "/healthz").await.status, 200);
    assert_eq!(fetch(haddr, "/livez").await.status, 200);
    let mode = fetch(maddr, "/proxyMode").await;
    assert_eq!((mode.status, mode.body.as_str()), (200, "ebpf"));
    let (_, samples) = parse(&fetch(maddr, "/metrics").await.body);
    for (name, code) in [
        ("kubeproxy_proxy_healthz_total", "503"),
        ("kubeproxy_proxy_healthz_total", "200"),
        ("kubeproxy_proxy_livez_total", "200"),
    ] {
        assert_close(value(&samples, name, &[("code", code)]), 1.0, name);
    }
    task.abort();
}

/// A measurement, not a check (`cargo test -p lb-tests --test metrics -- --ignored
/// --nocapture`): how long one GC pass takes over 100,000 entries (50,000 flows of a live
/// backend) that all stay, and over the same entries all expired (every one deleted), and what
/// the default-sized conntrack maps cost in kernel memory. Needs root.
#[test]
#[ignore = "measurement"]
fn conntrack_gc_pass_over_a_full_map() {
    use std::os::fd::{AsFd as _, AsRawFd as _};
    let mut datapath = Datapath::load(&LoadOptions::default()).expect("load datapath (root?)");
    let ebpf = datapath.ebpf_mut();
    for (name, prog) in ebpf.programs() {
        let insns = prog
            .info()
            .ok()
            .and_then(|i| i.verified_instruction_count());
        println!("{name}: {insns:?} instructions verified");
    }
    for name in [
        map_names::CT_TCP4,
        map_names::CT_ANY4,
        map_names::CT_TCP6,
        map_names::CT_ANY6,
    ] {
        let m = ebpf.map(name).expect(name);
        let fd = match m {
            aya::maps::Map::LruHashMap(d) => d.fd().as_fd().as_raw_fd(),
            _ => unreachable!(),
        };
        let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}")).unwrap();
        let memlock = info
            .lines()
            .find_map(|l| l.strip_prefix("memlock:"))
            .unwrap_or("?")
            .trim()
            .to_string();
        println!("{name}: memlock {memlock} bytes");
    }
    let take = |ebpf: &mut aya::Ebpf, name: &str| ebpf.take_map(name).expect(name);
    let mut gc = Gc {
        tcp4: HashMap::try_from(take(ebpf, map_names::CT_TCP4)).expect("ct"),
        any4: HashMap::try_from(take(ebpf, map_names::CT_ANY4)).expect("ct"),
        tcp6: HashMap::try_from(take(ebpf, map_names::CT_TCP6)).expect("ct"),
        any6: HashMap::try_from(take(ebpf, map_names::CT_ANY6)).expect("ct"),
        backends4: HashMap::try_from(take(ebpf, map_names::BACKENDS4)).expect("backends"),
        backends6: HashMap::try_from(take(ebpf, map_names::BACKENDS6)).expect("backends"),
    };
    let backend = Backend4 {
        addr: [198, 19, 1, 1],
        port: 8080,
        proto: lb_common::IPPROTO_TCP,
        state: 0,
    };
    gc.backends4.insert(1, backend, 0).expect("backend");
    let now = monotonic_secs();
    const FLOWS: u32 = 50_000;
    let fill = |gc: &mut Gc, expires: u32| {
        for i in 0..FLOWS {
            let client = [198, 18, 10 + (i >> 16) as u8, (i >> 8) as u8];
            let cport = (i & 0xff) as u16 + 1024;
            let v = Ct4Value {
                backend_id: 1,
                rev_nat_id: 1,
                expires,
                flags: ct_flags::SEEN_REPLY,
                ..Default::default()
            };
            let svc = Ct4Key {
                saddr: client,
                daddr: [198, 19, 0, 10],
                sport: cport,
                dport: 80,
                proto: lb_common::IPPROTO_TCP,
                dir: ct_dir::SERVICE,
                ..Default::default()
            };
            let reply = Ct4Key {
                saddr: backend.addr,
                daddr: client,
                sport: 8080,
                dport: cport,
                dir: ct_dir::REPLY,
                ..svc
            };
            gc.tcp4.insert(svc, v, 0).expect("insert");
            gc.tcp4.insert(reply, v, 0).expect("insert");
        }
    };
    fill(&mut gc, now + 3600);
    let r = gc.pass(now);
    println!(
        "pass over {} live entries, none deleted: {:?}",
        r.total_entries(),
        r.duration
    );
    assert_eq!(r.total_entries(), u64::from(2 * FLOWS));
    fill(&mut gc, now.saturating_sub(1));
    let r = gc.pass(now);
    println!(
        "pass over {} expired entries, all deleted: {:?}",
        r.total_deleted(),
        r.duration
    );
    assert_eq!(r.total_deleted(), u64::from(2 * FLOWS));
    drop(datapath);
}
