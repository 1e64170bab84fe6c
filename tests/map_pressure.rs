//! Map pressure with a real `lb run`: service and backend maps made small with `--bpf-map-max`,
//! then filled past capacity. lb must name each service it could not program, keep every
//! service programmed before intact (the baseline byte for byte; no half-written service),
//! export the failure (`lb_services_unprogrammed`, `lb_map_full_total{map}`), and program the
//! refused service on the first sync after room is freed. The baseline keeps answering through
//! socket LB. Conntrack pressure is tested on the datapath itself (tests/datapath/conntrack.rs,
//! `conntrack_pressure_never_misforwards`).
use std::{
    collections::BTreeSet,
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use lb::{datapath::maps::Dump, model::Frontend};
use lb_tests::{
    bins::{LB, LB_ECHO},
    daemon::{LbDaemon, entries_of},
    metrics::{sample, scrape},
    testbed::Testbed,
};

const ECHO_PORT: u16 = 8080;

/// A ClusterIP service `pressure/NAME` at `vip`:80/TCP with `backends` (198.18.98.x) on 8080.
fn service(name: &str, vip: &str, backends: &[u8]) -> String {
    let mut s = format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: pressure}}\n\
         spec:\n  clusterIP: {vip}\n  ports: [{{name: http, protocol: TCP, port: 80}}]\n---\n\
         apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}-1\n  \
         namespace: pressure\n  labels: {{kubernetes.io/service-name: {name}}}\n\
         addressType: IPv4\nports: [{{name: http, protocol: TCP, port: 8080}}]\nendpoints:\n"
    );
    for b in backends {
        s.push_str(&format!("  - addresses: [198.18.98.{b}]\n"));
    }
    s
}

struct Dir(PathBuf);

impl Dir {
    fn add(&self, name: &str, text: &str) {
        let tmp = self.0.join(format!(".{name}.tmp"));
        fs::write(&tmp, text).unwrap();
        fs::rename(&tmp, self.0.join(name)).unwrap();
    }

    fn remove(&self, name: &str) {
        fs::remove_file(self.0.join(name)).unwrap();
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// The value of `series` in the metrics text `m`, 0 if absent.
fn value(m: &str, series: &str) -> f64 {
    sample(m, series).unwrap_or(0.0)
}

/// The programmed services other than the `baseline`, by VIP, with their backend count, after
/// checking none is half-written: every master's slots exist and name existing backends, no
/// slot exists without its master.
fn programmed(d: &Dump, baseline: &BTreeSet<Frontend>, what: &str) -> Vec<(String, u16)> {
    for ((fe, slot), v) in &d.services {
        let master = d
            .services
            .get(&(*fe, 0))
            .unwrap_or_else(|| panic!("{what}: {fe} slot {slot} without a master"));
        if *slot == 0 {
            for s in 1..=master.count + master.qcount {
                let slot = d
                    .services
                    .get(&(*fe, s))
                    .unwrap_or_else(|| panic!("{what}: {fe} misses slot {s}"));
                assert!(
                    d.backends.contains_key(&slot.backend_id),
                    "{what}: {fe} slot {s} names a missing backend"
                );
            }
            assert!(d.revnat.contains_key(&v.rev_nat_id), "{what}: {fe} revnat");
        } else {
            assert!(
                *slot <= master.count + master.qcount,
                "{what}: {fe} stray slot {slot}"
            );
        }
    }
    let mut out: Vec<(String, u16)> = d
        .services
        .iter()
        .filter(|((fe, slot), _)| *slot == 0 && !baseline.contains(fe))
        .map(|((fe, _), v)| (fe.l4.addr.to_string(), v.count))
        .collect();
    out.sort();
    out
}

/// Waits for the sync after a change made now and returns its log lines.
fn next_sync(lb: &mut LbDaemon, what: &str) -> Vec<String> {
    let from = lb.log.len();
    lb.wait_for(|l| l.contains(" synced"), what).unwrap();
    lb.log[from..].to_vec()
}

/// The `service not programmed` lines of `log`: (service, map named in the error).
fn refused(log: &[String]) -> BTreeSet<(String, String)> {
    log.iter()
        .filter(|l| l.contains("service not programmed"))
        .map(|l| {
            let service = l
                .split("service=")
                .nth(1)
                .and_then(|s| s.split_whitespace().next())
                .unwrap_or("")
                .to_string();
            let map = l
                .split("map ")
                .nth(1)
                .and_then(|s| s.split_whitespace().next())
                .unwrap_or("")
                .to_string();
            (service, map)
        })
        .collect()
}

fn request_baseline(tb: &mut Testbed) {
    let mut cmd = Command::new(LB_ECHO);
    cmd.args(["client", "--target", "198.19.0.10:80", "--proto", "tcp"])
        .args(["--count", "3"]);
    let cg = tb.cgroup.clone();
    let ns = tb.client.ns.clone();
    let out = tb.run(&ns, Some(&cg), cmd).expect("run client");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        stdout.lines().filter(|l| l.contains("\"backend\"")).count(),
        3,
        "the baseline answers: {stdout}"
    );
}

fn pairs(list: &[(&str, u16)]) -> Vec<(String, u16)> {
    let mut v: Vec<(String, u16)> = list.iter().map(|(a, n)| ((*a).to_string(), *n)).collect();
    v.sort();
    v
}

#[test]
fn full_maps_name_the_refused_service_and_keep_the_rest() {
    let mut tb = Testbed::create(3).expect("testbed");
    tb.start_echo_servers(Path::new(LB_ECHO), ECHO_PORT)
        .expect("echo servers");
    let dir = Dir(std::env::temp_dir().join(format!("lb-test-pressure-{}", tb.id)));
    fs::create_dir_all(&dir.0).unwrap();
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/examples");
    for entry in fs::read_dir(examples).unwrap() {
        let path = entry.unwrap().path();
        fs::copy(&path, dir.0.join(path.file_name().unwrap())).unwrap();
    }
    // The baseline (demo/echo) takes 8 IPv4 service entries (2 frontends × master + 3 slots)
    // and 6 IPv4 backends (3 addresses × TCP, UDP).
    let dir_arg = dir.0.display().to_string();
    let cgroup = tb.cgroup.display().to_string();
    let args = [
        "--manifests",
        &dir_arg,
        "--cgroup-path",
        &cgroup,
        "--bpf-map-max",
        "lb4_services=16",
        "--bpf-map-max",
        "lb4_backends=10",
    ];
    let mut lb = LbDaemon::start(&mut tb, Path::new(LB), &args, "info").unwrap();
    let before = lb.dump().unwrap();
    let baseline: BTreeSet<Frontend> = before.services.keys().map(|(fe, _)| *fe).collect();
    let baseline_entries = entries_of(&before, &baseline);
    let full = |m: &str, map: &str| value(m, &format!("lb_map_full_total{{map=\"{map}\"}}"));
    assert_eq!(
        value(&scrape(&tb).unwrap(), "lb_services_unprogrammed"),
        0.0
    );

    // a and b fit exactly: services 8 + 3 + 3 = 14 of 16, backends 6 + 2 + 2 = 10 of 10.
    dir.add("a.yaml", &service("a", "198.19.10.1", &[1, 2]));
    assert!(refused(&next_sync(&mut lb, "a")).is_empty());
    dir.add("b.yaml", &service("b", "198.19.10.2", &[3, 4]));
    assert!(refused(&next_sync(&mut lb, "b")).is_empty());
    let d = lb.dump().unwrap();
    assert_eq!(
        programmed(&d, &baseline, "a, b"),
        pairs(&[("198.19.10.1", 2), ("198.19.10.2", 2)])
    );

    // c needs 3 service entries (its backends exist already), 2 are free; it sorts before every
    // other frontend, and still takes nothing from them. d needs 1 new backend, none is free.
    dir.add("c.yaml", &service("c", "198.19.0.5", &[1, 2]));
    next_sync(&mut lb, "c");
    dir.add("d.yaml", &service("d", "198.19.10.4", &[9]));
    let log = next_sync(&mut lb, "d");
    assert_eq!(
        refused(&log),
        BTreeSet::from([
            ("pressure/c:http".to_string(), "lb4_services".to_string()),
            ("pressure/d:http".to_string(), "lb4_backends".to_string()),
        ]),
        "{}",
        log.join("\n")
    );
    let d = lb.dump().unwrap();
    assert_eq!(entries_of(&d, &baseline), baseline_entries, "baseline kept");
    assert_eq!(
        programmed(&d, &baseline, "full"),
        pairs(&[("198.19.10.1", 2), ("198.19.10.2", 2)]),
        "nothing of c or d is written"
    );
    let m = scrape(&tb).unwrap();
    assert_eq!(value(&m, "lb_services_unprogrammed"), 2.0, "{m}");
    assert!(
        full(&m, "lb4_services") >= 2.0,
        "c refused in two syncs: {m}"
    );
    assert!(full(&m, "lb4_backends") >= 1.0, "{m}");
    assert_eq!(
        value(&m, "lb_map_entries{map=\"lb4_services\"}"),
        14.0,
        "{m}"
    );
    request_baseline(&mut tb);

    // Room freed: removing a makes room for c (a's backends stay: c uses them); d still waits.
    dir.remove("a.yaml");
    let log = next_sync(&mut lb, "a removed");
    assert_eq!(
        refused(&log),
        BTreeSet::from([("pressure/d:http".to_string(), "lb4_backends".to_string())]),
        "{}",
        log.join("\n")
    );
    let d = lb.dump().unwrap();
    assert_eq!(
        programmed(&d, &baseline, "a removed"),
        pairs(&[("198.19.0.5", 2), ("198.19.10.2", 2)])
    );
    assert_eq!(
        value(&scrape(&tb).unwrap(), "lb_services_unprogrammed"),
        1.0
    );

    // Removing b frees its two backends: d gets programmed.
    dir.remove("b.yaml");
    let log = next_sync(&mut lb, "b removed");
    assert!(refused(&log).is_empty(), "{}", log.join("\n"));
    let d = lb.dump().unwrap();
    assert_eq!(
        programmed(&d, &baseline, "b removed"),
        pairs(&[("198.19.0.5", 2), ("198.19.10.4", 1)])
    );
    assert_eq!(entries_of(&d, &baseline), baseline_entries, "baseline kept");
    assert_eq!(
        value(&scrape(&tb).unwrap(), "lb_services_unprogrammed"),
        0.0
    );
    request_baseline(&mut tb);
    let status = lb.stop().unwrap();
    assert!(status.success(), "{status}");
}

/// Maglev tables are a map of their own: with `--lb-algorithm maglev` and room for the
/// baseline's four frontends only, a fifth Maglev service is still programmed, with random
/// selection, named in a log line and counted in `lb_map_full_total{map="lb_maglev"}`; it gets
/// a table once one is free. The baseline answers through socket LB (cookie-hashed Maglev).
#[test]
fn full_maglev_tables_fall_back_to_random_and_are_reported() {
    let mut tb = Testbed::create(3).expect("testbed");
    tb.start_echo_servers(Path::new(LB_ECHO), ECHO_PORT)
        .expect("echo servers");
    let dir = Dir(std::env::temp_dir().join(format!("lb-test-maglev-full-{}", tb.id)));
    fs::create_dir_all(&dir.0).unwrap();
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/examples");
    for entry in fs::read_dir(examples).unwrap() {
        let path = entry.unwrap().path();
        fs::copy(&path, dir.0.join(path.file_name().unwrap())).unwrap();
    }
    let dir_arg = dir.0.display().to_string();
    let cgroup = tb.cgroup.display().to_string();
    let args = [
        "--manifests",
        &dir_arg,
        "--cgroup-path",
        &cgroup,
        "--lb-algorithm",
        "maglev",
        "--maglev-table-size",
        "251",
        "--bpf-maglev-tables",
        "4",
    ];
    let mut lb = LbDaemon::start(&mut tb, Path::new(LB), &args, "info").unwrap();
    let full = |m: &str| value(m, "lb_map_full_total{map=\"lb_maglev\"}");
    let tables = |d: &Dump| {
        d.services
            .iter()
            .filter(|((_, slot), v)| *slot == 0 && v.lb_alg == lb_common::lb_alg::MAGLEV)
            .map(|(_, v)| v.backend_id)
            .collect::<BTreeSet<u32>>()
    };
    assert_eq!(tables(&lb.dump().unwrap()), BTreeSet::from([0, 1, 2, 3]));
    assert_eq!(full(&scrape(&tb).unwrap()), 0.0);
    request_baseline(&mut tb);

    dir.add("m.yaml", &service("m", "198.19.10.9", &[1, 2]));
    let log = next_sync(&mut lb, "m");
    let line = log
        .iter()
        .find(|l| l.contains("Maglev service falls back to random selection"))
        .unwrap_or_else(|| panic!("no fallback line: {}", log.join("\n")));
    assert!(
        line.contains("service=pressure/m:http") && line.contains("lb_maglev"),
        "{line}"
    );
    assert!(refused(&log).is_empty(), "{}", log.join("\n"));
    let d = lb.dump().unwrap();
    let m = d
        .services
        .iter()
        .find(|((fe, slot), _)| *slot == 0 && fe.l4.addr.to_string() == "198.19.10.9")
        .map(|(_, v)| *v)
        .expect("m is programmed");
    assert_eq!((m.lb_alg, m.count), (lb_common::lb_alg::RANDOM, 2));
    let text = scrape(&tb).unwrap();
    assert!(full(&text) >= 1.0, "{text}");
    assert_eq!(
        value(&text, "lb_map_entries{map=\"lb_maglev\"}"),
        4.0,
        "{text}"
    );
    assert_eq!(value(&text, "lb_services_unprogrammed"), 0.0, "{text}");

    // The demo service goes: its tables are freed, and m gets one.
    for entry in fs::read_dir(&dir.0).unwrap() {
        let name = entry.unwrap().file_name().to_string_lossy().into_owned();
        if name.starts_with("echo-") {
            dir.remove(&name);
        }
    }
    lb.wait_for(
        |l| l.contains(" synced") && l.contains("services=1 "),
        "echo removed",
    )
    .unwrap();
    let d = lb.dump().unwrap();
    assert_eq!(tables(&d).len(), 1, "m has a table now");
    let status = lb.stop().unwrap();
    assert!(status.success(), "{status}");
}
