//! `lb services`, `lb backends` and `lb status` against the live pinned maps of a real
//! `lb run` (in a testbed node netns, programmed from deploy/examples), plus the pure views and
//! the error for a missing pin dir. The end-to-end test needs root.
use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    net::IpAddr,
    path::{Path, PathBuf},
    process::{Command, Output},
    time::{Duration, Instant},
};

use aya::maps::{Array, HashMap, Map, MapData};
use lb::{
    cli::inspect::{self, ServiceView},
    datapath::maps::LbMaps as _,
    datapath::testing::MemMaps,
    model::{Backend, Frontend, L4Addr, Proto},
    state_dir::FrontendName,
};
use lb_common::{
    LAYOUT_VERSION, PinMeta, Svc4Key, SvcValue, map_names, metrics, prog_names, svc_flags,
};
use lb_tests::{
    bins::{LB, LB_ECHO},
    daemon::LbDaemon,
    testbed::Testbed,
};
use serde_json::{Value, json};

const ECHO_PORT: u16 = 8080;

/// `lb run` in the node netns, until ready. Socket LB goes on the testbed's own (empty)
/// cgroup, so `lb status` sees cgroup links without any other process being touched.
fn start_lb(tb: &mut Testbed, manifests: &Path) -> LbDaemon {
    let cgroup = tb.cgroup.display().to_string();
    let ifaces = tb.node_ifaces().join(",");
    let args = [
        "--manifests",
        manifests.to_str().unwrap(),
        "--cgroup-path",
        &cgroup,
        "--tc-ingress",
        &ifaces,
        "--metrics-bind-address",
        "off",
    ];
    LbDaemon::start(tb, Path::new(LB), &args, "info").unwrap()
}

/// A temporary copy of deploy/examples, removed on drop.
struct Manifests(PathBuf);

impl Manifests {
    fn new(id: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("lb-test-inspect-manifests-{id}"));
        fs::create_dir_all(&dir).unwrap();
        let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/examples");
        for entry in fs::read_dir(examples).unwrap() {
            let path = entry.unwrap().path();
            // Only the echo service: other example files are for other purposes.
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            if name.starts_with("echo-") {
                fs::copy(&path, dir.join(name)).unwrap();
            }
        }
        Self(dir)
    }
}

impl Drop for Manifests {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// Runs `lb ARGS…` in the node netns; returns the output, whatever the exit status.
fn lb_cli(tb: &Testbed, args: &[&str]) -> Output {
    let mut cmd = Command::new(LB);
    cmd.args(args)
        .env_remove("RUST_BACKTRACE")
        .env_remove("RUST_LIB_BACKTRACE");
    tb.run(&tb.node_ns, None, cmd).expect("run lb")
}

/// Runs `lb ARGS… --json` and parses stdout, failing on a non-zero exit.
fn lb_json(tb: &Testbed, args: &[&str]) -> Value {
    let mut all = args.to_vec();
    all.push("--json");
    let out = lb_cli(tb, &all);
    assert!(
        out.status.success(),
        "lb {all:?}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "lb {all:?}: not JSON ({e}):\n{}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

fn lb_text(tb: &Testbed, args: &[&str]) -> String {
    let out = lb_cli(tb, args);
    assert!(out.status.success(), "lb {args:?}: {}", out.status);
    String::from_utf8(out.stdout).expect("UTF-8")
}

/// What deploy/examples must produce: the 4 frontends of demo/echo with their 3 backends.
fn expected_services() -> Value {
    let v4 = ["198.18.11.2:8080", "198.18.12.2:8080", "198.18.13.2:8080"];
    let v6 = [
        "[2001:db8:0:11::2]:8080",
        "[2001:db8:0:12::2]:8080",
        "[2001:db8:0:13::2]:8080",
    ];
    let fe = |frontend: &str, port: &str, proto: &str, backends: &[&str; 3]| {
        json!({
            "frontend": frontend,
            "scope": "external",
            "type": "ClusterIP",
            "service": {"namespace": "demo", "name": "echo", "port": port},
            "flags": ["ClusterIP"],
            "count": 3,
            "qcount": 0,
            "algorithm": "random",
            "maglev_table": null,
            "backends": backends.iter().zip(1..).map(|(a, slot)| json!({
                "slot": slot, "address": a, "protocol": proto, "state": "active",
            })).collect::<Vec<_>>(),
        })
    };
    json!([
        fe("198.19.0.10:53/UDP", "udp", "UDP", &v4),
        fe("198.19.0.10:80/TCP", "tcp", "TCP", &v4),
        fe("[2001:db8:ffff::10]:53/UDP", "udp", "UDP", &v6),
        fe("[2001:db8:ffff::10]:80/TCP", "tcp", "TCP", &v6),
    ])
}

/// Strips the allocated ids (checked separately) and sorts by frontend.
fn without_ids(services: &Value) -> Value {
    let mut list = services.as_array().expect("array").clone();
    for s in &mut list {
        let s = s.as_object_mut().expect("object");
        assert!(
            s.remove("id")
                .and_then(|v| v.as_u64())
                .is_some_and(|id| id > 0)
        );
        for b in s["backends"].as_array_mut().expect("backends") {
            let b = b.as_object_mut().expect("backend");
            assert!(
                b.remove("id")
                    .and_then(|v| v.as_u64())
                    .is_some_and(|id| id > 0)
            );
        }
    }
    list.sort_by_key(|s| s["frontend"].as_str().unwrap_or_default().to_string());
    Value::Array(list)
}

fn run_echo_client(tb: &Testbed, target: &str, proto: &str) {
    let mut cmd = Command::new(LB_ECHO);
    cmd.args([
        "client", "--target", target, "--proto", proto, "--count", "3",
    ]);
    let out = tb.run(&tb.client.ns, None, cmd).expect("run client");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && !stdout.contains("error"),
        "{target}/{proto}: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn inspection_commands_show_the_live_maps() {
    let mut tb = Testbed::create(3).expect("testbed");
    tb.start_echo_servers(Path::new(LB_ECHO), ECHO_PORT)
        .expect("echo servers");
    let manifests = Manifests::new(&tb.id);
    let mut lb = start_lb(&mut tb, &manifests.0);
    let pin = lb.pin_dir.to_str().unwrap().to_string();
    let state = lb.state_dir.to_str().unwrap().to_string();

    // lb services --json: exactly what the manifests say.
    let services = lb_json(&tb, &["services", "--pin-dir", &pin, "--state-dir", &state]);
    assert_eq!(without_ids(&services), expected_services(), "{services:#}");
    let ids: BTreeSet<u64> = services
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["id"].as_u64().unwrap())
        .collect();
    assert_eq!(ids.len(), 4, "distinct rev-NAT ids: {ids:?}");
    let slot_backend_ids: BTreeSet<u64> = services
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|s| s["backends"].as_array().unwrap().iter())
        .map(|b| b["id"].as_u64().unwrap())
        .collect();

    // lb backends --json: 12 backends (3 addresses x 2 families x TCP/UDP), each used once.
    let backends = lb_json(&tb, &["backends", "--pin-dir", &pin]);
    let backends = backends.as_array().expect("array");
    assert_eq!(backends.len(), 12, "{backends:#?}");
    let mut seen = BTreeSet::new();
    for b in backends {
        assert_eq!(b["references"], 1, "{b}");
        assert_eq!(b["state"], "active", "{b}");
        let addr = b["address"].as_str().unwrap();
        let sa: std::net::SocketAddr = addr.parse().expect("ip:port");
        assert_eq!(sa.port(), ECHO_PORT);
        seen.insert((
            addr.to_string(),
            b["protocol"].as_str().unwrap().to_string(),
        ));
    }
    assert_eq!(seen.len(), 12, "distinct address/protocol pairs");
    let backend_ids: BTreeSet<u64> = backends.iter().map(|b| b["id"].as_u64().unwrap()).collect();
    assert_eq!(
        backend_ids, slot_backend_ids,
        "slots name exactly these ids"
    );

    // The tables show the same.
    let table = lb_text(&tb, &["services", "--pin-dir", &pin, "--state-dir", &state]);
    assert!(table.starts_with("ID  "), "{table}");
    assert!(
        table.contains("198.19.0.10:80/TCP") && table.contains("demo/echo:tcp"),
        "{table}"
    );
    assert!(
        table.contains("  1 => 198.18.11.2:8080/TCP (active)"),
        "{table}"
    );
    assert!(
        table.contains("  3 => [2001:db8:0:13::2]:8080/UDP (active)"),
        "{table}"
    );
    let table = lb_text(&tb, &["backends", "--pin-dir", &pin]);
    assert_eq!(table.lines().count(), 13, "{table}");
    // Without the names file the frontends are still listed, named `-`.
    let unnamed = lb_json(
        &tb,
        &["services", "--pin-dir", &pin, "--state-dir", "/nonexistent"],
    );
    assert!(
        unnamed
            .as_array()
            .unwrap()
            .iter()
            .all(|s| s["service"].is_null()),
        "{unnamed:#}"
    );

    // Traffic through the tc path, so conntrack and counters have something to show.
    for (target, proto) in [
        ("198.19.0.10:80", "tcp"),
        ("198.19.0.10:53", "udp"),
        ("[2001:db8:ffff::10]:80", "tcp"),
        ("[2001:db8:ffff::10]:53", "udp"),
    ] {
        run_echo_client(&tb, target, proto);
    }

    let status = lb_json(&tb, &["status", "--pin-dir", &pin]);
    assert_eq!(status["pin_dir"], pin.as_str());
    assert_eq!(
        status["pins"]["layout_version"], LAYOUT_VERSION,
        "{status:#}"
    );
    assert_eq!(status["pins"]["lb_version"], env!("CARGO_PKG_VERSION"));
    assert_eq!(status["pins"]["same_netns"], true, "{status:#}");
    assert_status_outside_the_netns(&pin, &status);
    assert!(!status["kernel"]["release"].as_str().unwrap().is_empty());
    assert_eq!(
        status["features"]["btf"],
        Path::new("/sys/kernel/btf/vmlinux").exists()
    );
    // Maps: all of them, each within its capacity, holding what the manifests need.
    let maps: BTreeMap<String, &Value> = status["maps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (m["name"].as_str().unwrap().to_string(), m))
        .collect();
    let names: BTreeSet<&str> = maps.keys().map(String::as_str).collect();
    assert_eq!(names, BTreeSet::from(map_names::ALL), "{status:#}");
    let entries = |name: &str| maps[name]["entries"].as_u64().unwrap();
    for (name, m) in &maps {
        // Socket storage has no capacity (max_entries 0: it grows with the sockets) and no
        // key walk, so `lb status` shows it with 0 entries.
        if m["type"] == "SkStorage" {
            assert_eq!(
                (m["entries"].as_u64(), m["max_entries"].as_u64()),
                (Some(0), Some(0))
            );
            continue;
        }
        let max = m["max_entries"].as_u64().unwrap();
        assert!(entries(name) <= max && max > 0, "{name}: {m}");
    }
    for (name, want) in [
        (map_names::SERVICES4, 8),
        (map_names::SERVICES6, 8),
        (map_names::BACKENDS4, 6),
        (map_names::BACKENDS6, 6),
        (map_names::REVNAT4, 2),
        (map_names::REVNAT6, 2),
    ] {
        assert_eq!(entries(name), want, "{name}");
    }
    assert!(
        entries(map_names::CT_TCP4) + entries(map_names::CT_ANY4) > 0,
        "conntrack after IPv4 traffic"
    );
    assert!(
        entries(map_names::CT_TCP6) + entries(map_names::CT_ANY6) > 0,
        "conntrack after IPv6 traffic"
    );
    // Programs: all eleven loaded; tc ingress linked to every node interface, the socket
    // programs to the testbed cgroup.
    let programs: BTreeMap<String, &Value> = status["programs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p["name"].as_str().unwrap().to_string(), p))
        .collect();
    let loaded: BTreeSet<&str> = programs.keys().map(String::as_str).collect();
    assert_eq!(loaded, BTreeSet::from(inspect::PROGRAM_NAMES), "{status:#}");
    let tc = programs[prog_names::TC_INGRESS];
    assert_eq!(tc["type"], "sched_cls");
    if status["features"]["tcx"] == true {
        let targets: BTreeSet<&str> = tc["attachments"]
            .as_array()
            .unwrap()
            .iter()
            .inspect(|a| assert_eq!(a["link_type"], "tcx", "{a}"))
            .map(|a| a["target"].as_str().unwrap())
            .collect();
        let ifaces = tb.node_ifaces();
        assert_eq!(
            targets,
            ifaces.iter().map(String::as_str).collect(),
            "{tc:#}"
        );
    }
    assert_eq!(
        programs[prog_names::TC_EGRESS]["attachments"],
        json!([]),
        "no --tc-egress"
    );
    if status["features"]["cgroup_link"] == true {
        for name in lb::datapath::load::SOCK_PROGRAMS {
            let p = programs[name];
            assert_eq!(p["type"], "cgroup_sock_addr");
            let att = p["attachments"].as_array().unwrap();
            assert_eq!(att.len(), 1, "{p:#}");
            assert_eq!(att[0]["link_type"], "cgroup");
            assert_eq!(att[0]["target"], tb.cgroup.to_str().unwrap(), "{p:#}");
        }
    }
    // Counters: every name, summed over CPUs, with the traffic just sent.
    let counters: BTreeMap<&str, u64> = status["counters"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (c["name"].as_str().unwrap(), c["packets"].as_u64().unwrap()))
        .collect();
    assert_eq!(
        counters.keys().copied().collect::<BTreeSet<_>>(),
        BTreeSet::from(metrics::NAMES)
    );
    assert!(counters["tc_forward_new"] >= 4, "{counters:?}");
    assert!(counters["tc_reverse_nat"] >= 4, "{counters:?}");
    let text = lb_text(&tb, &["status", "--pin-dir", &pin]);
    // Shown with --nocapture (docs/operations.md's examples come from here).
    eprintln!(
        "$ lb services\n{}\n$ lb backends\n{}\n$ lb status\n{text}",
        lb_text(&tb, &["services", "--pin-dir", &pin, "--state-dir", &state]),
        lb_text(&tb, &["backends", "--pin-dir", &pin]),
    );
    for want in [
        "Kernel:",
        "Programs:",
        "lb_tc_ingress",
        "Maps:",
        "lb4_services",
    ] {
        assert!(text.contains(want), "{want}: {text}");
    }

    // After lb exits its programs stay attached (pinned links) and listed; after `lb detach`
    // the maps stay pinned and readable, and no program is listed any more.
    lb.stop().unwrap();
    let status = lb_json(&tb, &["status", "--pin-dir", &pin]);
    assert_ne!(
        status["programs"],
        json!([]),
        "programs stay after lb exits"
    );
    let out = lb_cli(&tb, &["detach", "--pin-dir", &pin]);
    assert!(out.status.success(), "lb detach: {out:?}");
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let status = lb_json(&tb, &["status", "--pin-dir", &pin]);
        if status["programs"] == json!([]) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "programs still listed: {status:#}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let services = lb_json(&tb, &["services", "--pin-dir", &pin, "--state-dir", &state]);
    assert_eq!(without_ids(&services), expected_services());
    drop(lb);
}

/// `lb status` from the host netns, outside the node netns lb runs in: it says so and names no
/// tc/XDP interface (their ifindexes are the node netns's), where `inside` (the same status
/// from the node netns) names them.
fn assert_status_outside_the_netns(pin: &str, inside: &Value) {
    let run = |json: bool| {
        let mut cmd = Command::new(LB);
        cmd.args(["status", "--pin-dir", pin]);
        if json {
            cmd.arg("--json");
        }
        let out = cmd.output().expect("run lb");
        assert!(out.status.success(), "lb status outside: {out:?}");
        String::from_utf8(out.stdout).expect("UTF-8")
    };
    let outside: Value = serde_json::from_str(&run(true)).expect("JSON");
    assert_eq!(outside["pins"]["same_netns"], false, "{outside:#}");
    let by_ifindex = |s: &Value| -> Vec<(u64, Value)> {
        let mut v: Vec<(u64, Value)> = s["programs"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|p| p["attachments"].as_array().unwrap().clone())
            .filter_map(|a| Some((a["ifindex"].as_u64()?, a["target"].clone())))
            .collect();
        v.sort_by_key(|(i, _)| *i);
        v
    };
    let (inside, outside_links) = (by_ifindex(inside), by_ifindex(&outside));
    assert_eq!(
        inside.iter().map(|(i, _)| *i).collect::<Vec<_>>(),
        outside_links.iter().map(|(i, _)| *i).collect::<Vec<_>>(),
        "the same links from both namespaces"
    );
    if !inside.is_empty() {
        assert!(inside.iter().all(|(_, t)| t.is_string()), "{inside:?}");
        assert!(
            outside_links.iter().all(|(_, t)| t.is_null()),
            "{outside:#}"
        );
    }
    let text = run(false);
    assert!(
        text.contains("lb runs in another network namespace"),
        "{text}"
    );
}

/// The service entries pinned in `pin`, and the `lb_meta` entry.
fn pinned_state(pin: &Path) -> (Vec<String>, PinMeta) {
    let services: HashMap<MapData, Svc4Key, SvcValue> = HashMap::try_from(Map::HashMap(
        MapData::from_pin(pin.join(map_names::SERVICES4)).unwrap(),
    ))
    .unwrap();
    let mut entries: Vec<String> = services
        .iter()
        .map(|kv| format!("{:?}", kv.unwrap()))
        .collect();
    entries.sort();
    (entries, meta_of(pin).get(&0, 0).unwrap())
}

fn meta_of(pin: &Path) -> Array<MapData, PinMeta> {
    Array::try_from(Map::Array(
        MapData::from_pin(pin.join(map_names::META)).unwrap(),
    ))
    .unwrap()
}

/// The pin and state directories of a daemon that was dropped with `keep_dirs`, removed on drop.
struct KeptDirs(Vec<PathBuf>);

impl Drop for KeptDirs {
    fn drop(&mut self) {
        for d in &self.0 {
            let _ = fs::remove_dir_all(d);
        }
    }
}

/// Pins of a layout this lb does not read (a newer lb's, made here by bumping `lb_meta`) are
/// refused by `lb run` and by the inspection commands, naming both versions and the way out,
/// and are left exactly as they were. Pins without `lb_meta` (an lb from before it) are layout
/// 1: adopted, and `lb_meta` is written.
#[test]
fn pins_of_another_layout_are_refused_and_left_alone() {
    let mut tb = Testbed::create(1).expect("testbed");
    let manifests = Manifests::new(&tb.id);
    let mut lb = start_lb(&mut tb, &manifests.0);
    let (pin, state) = (lb.pin_dir.clone(), lb.state_dir.clone());
    let _cleanup = KeptDirs(vec![pin.clone(), state.clone()]);
    lb.keep_dirs();
    drop(lb);
    let (services, mut meta) = pinned_state(&pin);
    assert!(!services.is_empty());
    assert_eq!(meta.layout_version, LAYOUT_VERSION);
    meta.layout_version = LAYOUT_VERSION + 1;
    meta_of(&pin).set(0, meta, 0).unwrap();

    let want = format!(
        "have layout version {} (written by lb {}), newer than layout {LAYOUT_VERSION}",
        LAYOUT_VERSION + 1,
        env!("CARGO_PKG_VERSION")
    );
    let cgroup = tb.cgroup.display().to_string();
    let ifaces = tb.node_ifaces().join(",");
    let args = [
        "run",
        "--manifests",
        manifests.0.to_str().unwrap(),
        "--cgroup-path",
        &cgroup,
        "--tc-ingress",
        &ifaces,
        "--metrics-bind-address",
        "off",
        "--pin-dir",
        pin.to_str().unwrap(),
        "--state-dir",
        state.to_str().unwrap(),
    ];
    let out = lb_cli(&tb, &args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "lb run: {stderr}");
    assert!(stderr.contains(&want), "lb run: {stderr}");
    assert!(stderr.contains("remove"), "the way out: {stderr}");
    assert_eq!(
        pinned_state(&pin),
        (services.clone(), meta),
        "the refused lb changed the pins"
    );
    let pin_s = pin.to_str().unwrap();
    let state_s = state.to_str().unwrap();
    for args in [
        vec!["services", "--pin-dir", pin_s, "--state-dir", state_s],
        vec!["backends", "--pin-dir", pin_s],
        vec!["status", "--pin-dir", pin_s, "--json"],
    ] {
        let out = lb_cli(&tb, &args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(stderr.contains(&want), "{args:?}: {stderr}");
    }

    // No lb_meta at all: an lb from before it, layout 1.
    fs::remove_file(pin.join(map_names::META)).unwrap();
    let status = lb_json(&tb, &["status", "--pin-dir", pin_s]);
    assert_eq!(status["pins"]["layout_version"], Value::Null, "{status:#}");
    let mut lb = start_lb(&mut tb, &manifests.0);
    lb.keep_dirs();
    assert!(
        lb.log.iter().any(|l| l.contains("(adopted)")),
        "the old pins' attachments are adopted: {:?}",
        lb.log
    );
    let (after, meta) = pinned_state(&pin);
    assert_eq!(after, services, "the same services, reused");
    assert_eq!(meta.layout_version, LAYOUT_VERSION);
    let out = lb_cli(&tb, &["detach", "--pin-dir", pin_s]);
    assert!(out.status.success(), "lb detach: {out:?}");
}

#[test]
fn missing_pin_dir_is_a_clean_error() {
    let dir = format!("/sys/fs/bpf/lb-test-inspect-missing-{}", std::process::id());
    for args in [
        vec!["services", "--pin-dir", &dir],
        vec!["services", "--pin-dir", &dir, "--json"],
        vec!["backends", "--pin-dir", &dir],
        vec!["status", "--pin-dir", &dir, "--json"],
    ] {
        let out = Command::new(LB)
            .args(&args)
            .env_remove("RUST_BACKTRACE")
            .env_remove("RUST_LIB_BACKTRACE")
            .output()
            .expect("run lb");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(out.stdout.is_empty(), "{args:?}");
        assert!(
            stderr.contains(&format!(
                "no pinned maps at {dir}: is `lb run` running? (--pin-dir)"
            )),
            "{args:?}: {stderr}"
        );
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}

fn l4(addr: &str, port: u16, proto: Proto) -> L4Addr {
    L4Addr {
        addr: addr.parse::<IpAddr>().unwrap(),
        port,
        proto,
    }
}

/// The pure join of a dump with the names file: names, flags, missing slots and backends.
#[test]
fn service_views_join_names_and_report_gaps() {
    let mut maps = MemMaps::with_capacity(100);
    let fe = Frontend::new("198.19.0.20".parse().unwrap(), 443, Proto::Tcp);
    let other = Frontend::new("2001:db8:ffff::20".parse().unwrap(), 53, Proto::Udp);
    maps.put_backend(7, &Backend::active(l4("198.18.11.2", 8443, Proto::Tcp)))
        .unwrap();
    maps.put_backend(9, &Backend::active(l4("198.18.12.2", 8443, Proto::Tcp)))
        .unwrap();
    let master = SvcValue {
        count: 2,
        qcount: 1,
        rev_nat_id: 5,
        flags: svc_flags::CLUSTER_IP | svc_flags::EXTERNAL_IP,
        ..SvcValue::default()
    };
    maps.put_service(&fe, 0, &master).unwrap();
    let slot = |backend_id| SvcValue {
        backend_id,
        rev_nat_id: 5,
        ..SvcValue::default()
    };
    maps.put_service(&fe, 1, &slot(7)).unwrap();
    maps.put_service(&fe, 2, &slot(8)).unwrap(); // backend 8 does not exist
    // slot 3 is missing
    let other_master = SvcValue {
        rev_nat_id: 6,
        flags: svc_flags::CLUSTER_IP,
        ..SvcValue::default()
    };
    maps.put_service(&other, 0, &other_master).unwrap();
    let names = BTreeMap::from([(
        ("198.19.0.20:443/TCP".to_string(), "external".to_string()),
        FrontendName {
            frontend: "198.19.0.20:443/TCP".into(),
            scope: "external".into(),
            namespace: "web".into(),
            name: "front".into(),
            port_name: "https".into(),
            kind: "ExternalIP".into(),
        },
    )]);
    let dump = maps.dump().unwrap();
    let views = inspect::service_views(&dump, &names);
    let json = serde_json::to_value(&views).unwrap();
    assert_eq!(
        json,
        json!([
            {
                "id": 5, "frontend": "198.19.0.20:443/TCP", "scope": "external",
                "type": "ExternalIP",
                "service": {"namespace": "web", "name": "front", "port": "https"},
                "flags": ["ClusterIP", "ExternalIP"], "count": 2, "qcount": 1,
                "algorithm": "random", "maglev_table": null,
                "backends": [
                    {"slot": 1, "id": 7, "address": "198.18.11.2:8443", "protocol": "TCP",
                     "state": "active"},
                    {"slot": 2, "id": 8, "address": null, "protocol": null, "state": "missing"},
                    {"slot": 3, "id": null, "address": null, "protocol": null,
                     "state": "missing"},
                ],
            },
            {
                "id": 6, "frontend": "[2001:db8:ffff::20]:53/UDP", "scope": "external",
                "type": "ClusterIP", "service": null, "flags": ["ClusterIP"],
                "count": 0, "qcount": 0, "backends": [],
                "algorithm": "random", "maglev_table": null,
            },
        ])
    );
    let back: Vec<ServiceView> = serde_json::from_value(json).unwrap();
    assert_eq!(back, views, "the JSON round-trips");

    let table = inspect::render_services(&views);
    assert_eq!(
        table,
        "ID  FRONTEND                    SCOPE     TYPE        SERVICE          BACKENDS\n\
         5   198.19.0.20:443/TCP         external  ExternalIP  web/front:https  2 active, 1 draining\n\
         \x20 1 => 198.18.11.2:8443/TCP (active)\n\
         \x20 2 => backend 8 (missing)\n\
         \x20 3 => - (missing)\n\
         6   [2001:db8:ffff::20]:53/UDP  external  ClusterIP   -                0 active, 0 draining\n"
    );

    let backends = inspect::backend_views(&dump);
    assert_eq!(
        serde_json::to_value(&backends).unwrap(),
        json!([
            {"id": 7, "address": "198.18.11.2:8443", "protocol": "TCP",
             "state": "active", "references": 1},
            {"id": 9, "address": "198.18.12.2:8443", "protocol": "TCP", "state": "active",
             "references": 0},
        ])
    );
}
