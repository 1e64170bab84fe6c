//! `lb-bench run --quick`: every suite runs end to end and writes a results.json with every
//! suite, case, implementation and metric the report needs, each value finite and positive.
//! It checks shape only, never speed. Needs root, iptables and nftables (`cargo xtask bench`
//! installs them).
use std::{
    collections::BTreeSet,
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use lb_tests::bins::LB_BENCH;
use serde_json::Value;

/// A scratch output directory, removed on drop.
struct OutDir(PathBuf);

impl Drop for OutDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// The tools the kube-proxy baselines need that are not installed.
fn missing_tools() -> Vec<&'static str> {
    ["iptables-legacy-restore", "iptables-nft-restore", "nft"]
        .into_iter()
        .filter(|c| {
            !["/usr/sbin", "/sbin", "/usr/bin"]
                .iter()
                .any(|d| Path::new(d).join(c).exists())
        })
        .collect()
}

/// What each scale shape records, in `lb-bench`'s order.
const SCALE_METRICS: [&str; 6] = [
    "cold_start",
    "change_to_map_write",
    "burst_to_map_write",
    "full_sync",
    "peak_rss",
    "bpf_map_memory",
];

/// The scale cases: three shapes (two with 10 endpoints per service, one with 1), each with
/// every metric once, in its unit, and sane against each other: the p99 of a series is at
/// least its median, one change is cheaper than a burst of them and than a cold start, and
/// the process holding more endpoints needs more memory.
fn check_scale(records: &[Value]) {
    let scale: Vec<&Value> = records
        .iter()
        .filter(|r| r["case"].as_str().is_some_and(|c| c.starts_with("scale_")))
        .collect();
    let mut shapes: Vec<(u64, String)> = scale
        .iter()
        .map(|r| {
            (
                r["services"].as_u64().unwrap(),
                r["case"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    shapes.sort();
    shapes.dedup();
    assert_eq!(shapes.len(), 3, "three scale shapes: {shapes:?}");
    let get = |n: u64, case: &str, metric: &str| -> &Value {
        let found: Vec<&&Value> = scale
            .iter()
            .filter(|r| r["services"] == n && r["case"] == case && r["metric"] == metric)
            .collect();
        assert_eq!(found.len(), 1, "{n} {case} {metric}: {found:?}");
        found[0]
    };
    let median = |n, case: &str, metric| get(n, case, metric)["median"].as_f64().unwrap();
    for (n, case) in &shapes {
        for metric in SCALE_METRICS {
            let r = get(*n, case, metric);
            let unit = if matches!(metric, "peak_rss" | "bpf_map_memory") {
                "MiB"
            } else {
                "ms"
            };
            assert_eq!(r["unit"], unit, "{r}");
            let p99 = r["p99"].as_f64();
            assert_eq!(
                p99.is_some(),
                metric.ends_with("_to_map_write") || metric == "full_sync",
                "{r}"
            );
            if let Some(p) = p99 {
                assert!(p >= r["median"].as_f64().unwrap(), "{r}");
            }
        }
        let change = median(*n, case, "change_to_map_write");
        assert!(
            change < median(*n, case, "burst_to_map_write"),
            "{n} {case}"
        );
        assert!(change < median(*n, case, "cold_start"), "{n} {case}");
        // Beyond the program binary and the runtime: a process of some MiB.
        assert!(median(*n, case, "peak_rss") >= 1.0, "{n} {case}");
    }
    let tens: Vec<u64> = shapes
        .iter()
        .filter(|(_, c)| c == "scale_10_endpoints")
        .map(|(n, _)| *n)
        .collect();
    assert_eq!(tens.len(), 2, "two shapes with 10 endpoints: {shapes:?}");
    let map_mib = |n| median(n, "scale_10_endpoints", "bpf_map_memory");
    assert!(map_mib(tens[0]) > 0.0 && map_mib(tens[1]) >= map_mib(tens[0]));
}

#[test]
fn quick_run_writes_every_result() {
    let missing = missing_tools();
    assert!(
        missing.is_empty(),
        "missing {missing:?}: install the Debian packages iptables and nftables \
         (`cargo xtask bench` does)"
    );
    let out = OutDir(std::env::temp_dir().join(format!("lb-bench-quick-{}", std::process::id())));
    let run = Command::new(LB_BENCH)
        .args(["run", "--quick", "--out"])
        .arg(&out.0)
        .output()
        .expect("start lb-bench");
    assert!(
        run.status.success(),
        "lb-bench run --quick failed ({}):\n{}\n{}",
        run.status,
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );

    let text = fs::read_to_string(out.0.join("results.json")).expect("results.json");
    let records: Vec<Value> = serde_json::from_str(&text).expect("results.json is a JSON list");
    let mut seen = BTreeSet::new();
    for r in &records {
        let field = |k: &str| r[k].as_str().unwrap_or_else(|| panic!("{k} in {r}"));
        for k in ["suite", "case", "impl", "metric", "unit"] {
            assert!(!field(k).is_empty(), "{k} empty in {r}");
        }
        let services = r["services"]
            .as_u64()
            .unwrap_or_else(|| panic!("services in {r}"));
        assert!(services > 0, "{r}");
        let median = r["median"]
            .as_f64()
            .unwrap_or_else(|| panic!("median in {r}"));
        assert!(median.is_finite() && median > 0.0, "median of {r}");
        match &r["p99"] {
            Value::Null => {}
            p => {
                let p = p.as_f64().unwrap_or_else(|| panic!("p99 in {r}"));
                assert!(p.is_finite() && p > 0.0, "p99 of {r}");
            }
        }
        assert_eq!(r.as_object().map(|o| o.len()), Some(8), "fields of {r}");
        seen.insert((
            field("suite").to_owned(),
            field("case").to_owned(),
            field("impl").to_owned(),
            field("metric").to_owned(),
        ));
    }

    let mut expected: Vec<(String, String, String, String)> = Vec::new();
    let mut want = |s: &str, c: &str, i: &str, m: &str| {
        expected.push((s.into(), c.into(), i.into(), m.into()));
    };
    for suffix in ["", "_single"] {
        for case in ["new_flow", "established", "miss"] {
            want(
                "datapath",
                &format!("{case}{suffix}"),
                "lb_tc_ingress",
                "ns_per_packet",
            );
        }
        for imp in ["pass_through", "lb_tc_egress_miss"] {
            want(
                "datapath",
                &format!("baseline{suffix}"),
                imp,
                "ns_per_packet",
            );
        }
    }
    for case in ["new_flow", "established", "miss"] {
        want("datapath", case, "lb_xdp", "ns_per_packet");
    }
    // The reply (rev-NAT) case runs repeated only.
    want("datapath", "reply", "lb_tc_ingress", "ns_per_packet");
    for case in ["tcp_last", "tcp_random", "udp_last", "udp_random"] {
        let latency = if case.starts_with("tcp") {
            "connect_latency"
        } else {
            "request_latency"
        };
        for imp in [
            "direct",
            "lb_socket",
            "lb_tc",
            "iptables",
            "iptables_nft",
            "nftables",
        ] {
            want("newflows", case, imp, "new_flows_per_s");
            want("newflows", case, imp, latency);
        }
    }
    let notes: Value =
        serde_json::from_str(&fs::read_to_string(out.0.join("notes.json")).expect("notes.json"))
            .expect("notes.json is JSON");
    // This build has lb_xdp and `lb run --xdp`: the XDP row must be measured.
    assert!(
        !notes["northsouth_xdp_unavailable"].is_string(),
        "lb XDP missing from the north-south suite: {notes}"
    );
    for imp in ["lb_tc", "lb_xdp", "nftables", "iptables"] {
        for metric in ["forwarded_pps", "offered_pps"] {
            want("northsouth", "udp_nodeport", imp, metric);
        }
    }
    for imp in ["lb", "iptables", "iptables_nft", "nftables"] {
        want("controlplane", "cold_10_endpoints", imp, "program_time");
    }
    for metric in ["change_to_map_write", "change_full_sync"] {
        want("controlplane", "change_10_endpoints", "lb", metric);
    }
    want(
        "controlplane",
        "change_100_endpoints",
        "lb",
        "change_to_map_write",
    );
    want(
        "controlplane",
        "burst_10_endpoints",
        "lb",
        "burst_to_map_write",
    );
    for imp in ["iptables", "iptables_nft"] {
        want(
            "controlplane",
            "change_10_endpoints",
            imp,
            "change_full_restore",
        );
        want(
            "controlplane",
            "change_10_endpoints",
            imp,
            "change_partial_restore",
        );
    }
    want(
        "controlplane",
        "change_10_endpoints",
        "nftables",
        "change_partial_sync",
    );
    want("controlplane", "hold_10_endpoints", "lb", "peak_rss");
    want("controlplane", "hold_10_endpoints", "lb", "bpf_map_memory");
    for case in ["scale_10_endpoints", "scale_1_endpoints"] {
        for metric in SCALE_METRICS {
            want("controlplane", case, "lb", metric);
        }
    }
    let missing: Vec<_> = expected.iter().filter(|e| !seen.contains(*e)).collect();
    assert!(missing.is_empty(), "results.json lacks {missing:?}");

    // Every datapath cell exists at every datapath size.
    let sizes = |suite: &str| -> BTreeSet<u64> {
        records
            .iter()
            .filter(|r| r["suite"] == suite)
            .filter_map(|r| r["services"].as_u64())
            .collect()
    };
    let dp = sizes("datapath");
    assert!(dp.len() >= 2, "datapath at several sizes: {dp:?}");
    assert_eq!(
        records.iter().filter(|r| r["suite"] == "datapath").count(),
        14 * dp.len(),
        "14 datapath records per size (9 cases, 5 of them also in single runs)"
    );
    assert!(sizes("newflows").len() >= 2, "newflows at several sizes");

    assert!(
        sizes("northsouth").len() >= 2,
        "northsouth at several sizes"
    );

    check_scale(&records);

    for key in [
        "controlplane_scale_method",
        "datapath_method",
        "newflows_method",
        "northsouth_method",
        "northsouth_frontends",
        "controlplane_change_method",
        "controlplane_burst_method",
    ] {
        assert!(notes[key].is_string(), "notes.json lacks {key}");
    }
}
