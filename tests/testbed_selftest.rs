//! Self-test of `lb_tests::testbed` and `lb-echo`: no load balancer involved, the client talks
//! to the backends' own addresses through the forwarding node netns. Needs root.
use std::{
    collections::HashSet,
    net::{IpAddr, SocketAddr},
    os::unix::fs::MetadataExt as _,
    path::Path,
    process::Command,
    thread,
    time::Instant,
};

use lb_tests::{bins::LB_ECHO, testbed::Testbed};
use serde_json::Value;

const PORT: u16 = 8080;

/// Runs `lb-echo client` in the client netns; returns its exit success and the parsed lines.
fn client(tb: &Testbed, target: SocketAddr, args: &[&str]) -> (bool, Vec<Value>) {
    let mut cmd = Command::new(LB_ECHO);
    cmd.args(["client", "--target", &target.to_string()])
        .args(args);
    let out = tb
        .run(&tb.client.ns, None, cmd)
        .expect("run lb-echo client");
    let stdout = String::from_utf8(out.stdout).expect("UTF-8 stdout");
    let lines = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad JSON {l:?}: {e}")))
        .collect();
    (out.status.success(), lines)
}

fn ip_stdout(args: &[&str]) -> String {
    let out = Command::new("ip").args(args).output().expect("run ip");
    assert!(out.status.success(), "ip {args:?}: {out:?}");
    String::from_utf8(out.stdout).expect("UTF-8")
}

fn netns_list() -> String {
    ip_stdout(&["netns", "list"])
}

#[test]
fn testbed_echo_and_teardown() {
    let t0 = Instant::now();
    let mut tb = Testbed::create(3).expect("create testbed");
    let setup = t0.elapsed();
    let t1 = Instant::now();
    tb.start_echo_servers(Path::new(LB_ECHO), PORT)
        .expect("start echo servers");
    let echo_start = t1.elapsed();

    // Names and addressing.
    let id = tb.id.clone();
    assert_eq!(id.len(), 6);
    let all_ns: Vec<String> = std::iter::once(tb.node_ns.clone())
        .chain(tb.hosts().map(|h| h.ns.clone()))
        .collect();
    let listed = netns_list();
    for ns in &all_ns {
        assert!(
            listed
                .lines()
                .any(|l| l.split_whitespace().next() == Some(ns)),
            "{ns} missing"
        );
    }
    assert_eq!(tb.node_ifaces().len(), 4);
    let links = ip_stdout(&["-n", &tb.node_ns, "-o", "link", "show"]);
    for nif in tb.node_ifaces() {
        assert!(nif.len() <= 15);
        assert!(
            links.contains(&format!(": {nif}@")),
            "{nif} not in node netns: {links}"
        );
    }
    assert!(tb.cgroup.is_dir());

    // No default route in the client (or anywhere else).
    for ns in &all_ns {
        for family in ["-4", "-6"] {
            let routes = ip_stdout(&["-n", ns, family, "route", "show", "default"]);
            assert!(
                routes.trim().is_empty(),
                "default route in {ns} ({family}): {routes}"
            );
        }
    }

    // Every backend answers on its own addresses, over TCP, UDP and connected UDP, v4 and v6.
    let variants: [(&str, &[&str]); 3] = [
        ("tcp", &["--proto", "tcp", "--count", "2"]),
        ("udp", &["--proto", "udp", "--count", "2"]),
        (
            "udp-connected",
            &["--proto", "udp", "--count", "2", "--connected-udp"],
        ),
    ];
    for b in &tb.backends {
        for (ip, client_ip) in [
            (IpAddr::V4(b.ipv4), IpAddr::V4(tb.client.ipv4)),
            (IpAddr::V6(b.ipv6), IpAddr::V6(tb.client.ipv6)),
        ] {
            let target = SocketAddr::new(ip, PORT);
            for (what, args) in variants {
                let (ok, lines) = client(&tb, target, args);
                assert!(ok, "{what} {target}: {lines:?}");
                assert_eq!(lines.len(), 2, "{what} {target}: {lines:?}");
                let mut ports = HashSet::new();
                for (seq, l) in lines.iter().enumerate() {
                    assert_eq!(l["seq"], seq, "{what} {target}: {l}");
                    assert_eq!(l["backend"], b.name.as_str(), "{what} {target}: {l}");
                    assert_eq!(l["peer"], target.to_string(), "{what} {target}: {l}");
                    let local: SocketAddr = l["local"].as_str().unwrap().parse().unwrap();
                    assert_eq!(local.ip(), client_ip, "{what} {target}: {l}");
                    ports.insert(local.port());
                }
                assert_eq!(
                    ports.len(),
                    2,
                    "{what} {target}: no fresh source port: {lines:?}"
                );
            }
        }
    }

    // A service VIP nobody translates dies in the node: errors, exit code 1.
    for vip in ["198.19.0.1:80", "[2001:db8:ffff::1]:80"] {
        let target: SocketAddr = vip.parse().unwrap();
        for proto in ["tcp", "udp"] {
            let (ok, lines) = client(&tb, target, &["--proto", proto, "--timeout-ms", "300"]);
            assert!(!ok, "{proto} {vip} answered: {lines:?}");
            assert!(lines[0]["error"].is_string(), "{proto} {vip}: {lines:?}");
        }
    }

    // run/spawn: right netns, host mount namespace, optional cgroup.
    let mut cmd = Command::new("sh");
    cmd.args([
        "-c",
        "readlink /proc/self/ns/net /proc/self/ns/mnt; cat /proc/self/cgroup",
    ]);
    let out = tb
        .run(&tb.client.ns, Some(&tb.cgroup), cmd)
        .expect("run sh");
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8(out.stdout).unwrap();
    let mut lines = text.lines();
    let netns_ino = std::fs::metadata(Path::new("/run/netns").join(&tb.client.ns))
        .unwrap()
        .ino();
    assert_eq!(lines.next(), Some(format!("net:[{netns_ino}]").as_str()));
    let my_mnt = std::fs::read_link("/proc/self/ns/mnt").unwrap();
    assert_eq!(lines.next(), my_mnt.to_str());
    // Hybrid hierarchy: the v2 line is the one with hierarchy id 0.
    let v2 = lines.find(|l| l.starts_with("0::"));
    assert_eq!(v2, Some(format!("0::/lb-{id}").as_str()), "{text}");

    let mut sleep = Command::new("sleep");
    sleep.arg("1000");
    #[expect(
        clippy::zombie_processes,
        reason = "the testbed kills and reaps it on drop"
    )]
    let sleeper = tb
        .spawn(&tb.client.ns.clone(), Some(&tb.cgroup.clone()), sleep)
        .expect("spawn sleep");
    let procs = std::fs::read_to_string(tb.cgroup.join("cgroup.procs")).unwrap();
    assert!(
        procs
            .split_whitespace()
            .any(|p| p == sleeper.id().to_string()),
        "{procs}"
    );

    // Teardown: children gone, netns gone, cgroup gone.
    let cgroup = tb.cgroup.clone();
    let t2 = Instant::now();
    drop(tb);
    let teardown = t2.elapsed();
    assert!(
        !Path::new(&format!("/proc/{}", sleeper.id())).exists(),
        "spawned child survived"
    );
    let listed = netns_list();
    for ns in &all_ns {
        assert!(!listed.contains(ns.as_str()), "{ns} left behind: {listed}");
    }
    assert!(!cgroup.exists(), "{} left behind", cgroup.display());
    eprintln!("testbed {id}: setup {setup:?}, echo servers {echo_start:?}, teardown {teardown:?}");
}

#[test]
fn parallel_testbeds_get_distinct_names() {
    let ids: Vec<String> = (0..4)
        .map(|_| thread::spawn(|| Testbed::create(1).map(|tb| tb.id.clone())))
        .collect::<Vec<_>>()
        .into_iter()
        .map(|h| h.join().unwrap().expect("create testbed"))
        .collect();
    let unique: HashSet<&String> = ids.iter().collect();
    assert_eq!(unique.len(), ids.len(), "{ids:?}");
    let listed = netns_list();
    for id in &ids {
        assert!(
            !listed.contains(&format!("lb-{id}-")),
            "lb-{id} left behind: {listed}"
        );
        assert!(!Path::new(&format!("/sys/fs/cgroup/unified/lb-{id}")).exists());
    }
}
