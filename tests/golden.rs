//! Golden tests, "manifests in, map dump out", in the style of Cilium's loadbalancer testdata.
//!
//! Each folder under tests/golden/ is a case. `step-N.yaml` holds the complete set of objects
//! at step N (Services, EndpointSlices and optionally this node's Node; the node is `node-a`,
//! its NodePort addresses 198.18.0.2 and 2001:db8::2).
//! Steps are applied in order to one reconciler over in-memory maps, and `step-N.expected` is
//! the skipped objects, the translated state and the rendered maps after step N.
//! `LB_BLESS=1 cargo test --test golden` rewrites the expected files; review the diff.
use std::{
    fmt::Write as _,
    fs,
    path::{Path, PathBuf},
};

use lb::{
    datapath::testing::{MemMaps, render},
    kube::manifests::{self, Objects},
    model::{BackendState, LbAlgorithm, flag_names},
    reconcile::Reconciler,
    translate::{NodeInfo, desired_state},
};

const NODE: &str = "node-a";
/// node-a's NodePort addresses (the default `primary`: its node IP of each family), which are
/// also its only local addresses.
const NODE_IPS: [&str; 2] = ["198.18.0.2", "2001:db8::2"];

fn cases() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/golden");
    let mut cases: Vec<PathBuf> = fs::read_dir(&dir)
        .expect("tests/golden")
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir())
        .collect();
    cases.sort();
    cases
}

fn steps(case: &Path) -> Vec<PathBuf> {
    let mut steps: Vec<(u32, PathBuf)> = fs::read_dir(case)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter_map(|p| {
            let name = p.file_name()?.to_str()?;
            let n = name
                .strip_prefix("step-")?
                .strip_suffix(".yaml")?
                .parse()
                .ok()?;
            Some((n, p))
        })
        .collect();
    steps.sort();
    steps.into_iter().map(|(_, p)| p).collect()
}

/// Runs one case and returns (expected file, actual text) per step.
fn run_case(case: &Path) -> Vec<(PathBuf, String)> {
    let mut reconciler = Reconciler::new(MemMaps::with_capacity(1024)).unwrap();
    let mut out = Vec::new();
    let steps = steps(case);
    assert!(!steps.is_empty(), "{}: no step-N.yaml", case.display());
    for step in steps {
        let text = fs::read_to_string(&step).unwrap();
        let mut objects = Objects::default();
        let mut problems = Vec::new();
        manifests::parse_into(&step, &text, &mut objects, &mut problems);
        assert!(problems.is_empty(), "{}: {problems:?}", step.display());
        let node = objects
            .nodes
            .iter()
            .find(|n| n.metadata.name.as_deref() == Some(NODE));
        let ips: Vec<std::net::IpAddr> = NODE_IPS.iter().map(|a| a.parse().unwrap()).collect();
        let node = NodeInfo {
            nodeport_ips: ips.clone(),
            local_ips: ips,
            ..NodeInfo::from_node(NODE, node)
        };
        let t = desired_state(&objects.services, &objects.slices, &node);
        let report = reconciler.apply(&t.state);

        let mut actual = String::new();
        let _ = writeln!(actual, "# skipped");
        for s in &t.skipped {
            let _ = writeln!(actual, "{s}");
        }
        let _ = writeln!(actual, "# desired");
        for (fe, entry) in &t.state.services {
            let alg = match entry.algorithm {
                LbAlgorithm::Maglev => " alg=maglev",
                LbAlgorithm::Random => "",
            };
            let _ = writeln!(
                actual,
                "{fe} {} flags={}{alg}",
                entry.name,
                flag_names(entry.flags)
            );
            for r in &entry.source_ranges {
                let _ = writeln!(actual, "  allow {r}");
            }
            for b in &entry.backends {
                let state = match b.state {
                    BackendState::Active => String::new(),
                    s => format!(" {}", s.as_str()),
                };
                let _ = writeln!(actual, "  {}{state}", b.l4);
            }
        }
        let _ = writeln!(actual, "# apply errors");
        for e in report.errors.iter().chain(&report.fallbacks) {
            let _ = writeln!(actual, "{} {}: {}", e.frontend, e.service, e.error);
        }
        let _ = writeln!(actual, "# maps");
        actual.push_str(&render(&reconciler.maps().dump));
        out.push((step.with_extension("expected"), actual));
    }
    out
}

#[test]
fn golden_cases() {
    let bless = std::env::var_os("LB_BLESS").is_some();
    let cases = cases();
    assert!(cases.len() >= 10, "golden cases missing");
    let mut failures = Vec::new();
    for case in cases {
        for (expected_path, actual) in run_case(&case) {
            if bless {
                fs::write(&expected_path, &actual).unwrap();
                continue;
            }
            let expected = fs::read_to_string(&expected_path).unwrap_or_default();
            if expected != actual {
                failures.push(format!(
                    "--- {}\n+++ actual\n{}",
                    expected_path.display(),
                    diff(&expected, &actual)
                ));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "golden mismatch (LB_BLESS=1 to accept):\n{}",
        failures.join("\n")
    );
}

/// A line diff good enough to read a golden mismatch.
fn diff(expected: &str, actual: &str) -> String {
    let e: Vec<&str> = expected.lines().collect();
    let a: Vec<&str> = actual.lines().collect();
    let mut out = String::new();
    for i in 0..e.len().max(a.len()) {
        match (e.get(i), a.get(i)) {
            (Some(x), Some(y)) if x == y => {
                let _ = writeln!(out, "  {x}");
            }
            (x, y) => {
                if let Some(x) = x {
                    let _ = writeln!(out, "- {x}");
                }
                if let Some(y) = y {
                    let _ = writeln!(out, "+ {y}");
                }
            }
        }
    }
    out
}
