//! The bad-input corpus (`tests/bad-input/*.yaml`, plus the cases generated here: a file above
//! the size cap, a symlink loop, a dangling symlink and a slice of 10,000 endpoints), each beside
//! the known-good baseline service `demo/echo` (deploy/examples). Every case must be refused or
//! normalised as its header says (`# expect:` lines, see tests/bad-input/README.md), logged with
//! the object's name and reason, counted in `lb_objects_skipped_total`, and change nothing of the
//! baseline.
//!
//! `corpus_translates_as_documented` checks the loader and translation alone (no root);
//! `running_daemon_refuses_each_case_and_keeps_serving` adds each case to the manifest
//! directory of a real `lb run` in a netns testbed and compares the pinned maps before and
//! after, then requests the baseline VIP through socket LB.
use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::{Path, PathBuf},
    process::Command,
    thread,
};

use lb::{
    datapath::maps::Dump,
    kube::manifests,
    model::{DesiredState, Frontend},
    translate::{self, NodeInfo},
};
use lb_tests::{
    bins::{LB, LB_ECHO},
    daemon::{LbDaemon, entries_of},
    metrics::{sample, scrape},
    testbed::Testbed,
};

const ECHO_PORT: u16 = 8080;
/// The baseline service's IPv4 TCP frontend, requested through socket LB.
const BASELINE_VIP: &str = "198.19.0.10:80";

/// One `# expect:` line.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Expect {
    /// `skip KIND NAMESPACE/NAME REASON`.
    Skip {
        kind: String,
        object: String,
        reason: String,
    },
    /// `problem KIND REASON`.
    Problem { kind: String, reason: String },
    /// `frontend ADDR:PORT/PROTO backends=N [owner=NS/NAME]`.
    Frontend {
        frontend: String,
        backends: usize,
        owner: Option<String>,
    },
}

/// A case: files to put into the manifest directory, and what lb must do about them.
struct Case {
    name: String,
    /// Written as (file name, content) into the directory.
    files: Vec<(String, Vec<u8>)>,
    /// Symlinks to create in the directory: (link name, target).
    links: Vec<(String, String)>,
    expects: Vec<Expect>,
}

impl Case {
    fn skips(&self) -> BTreeSet<(String, String, String)> {
        self.expects
            .iter()
            .filter_map(|e| match e {
                Expect::Skip {
                    kind,
                    object,
                    reason,
                } => Some((kind.clone(), object.clone(), reason.clone())),
                _ => None,
            })
            .collect()
    }

    fn problems(&self) -> BTreeSet<(String, String)> {
        self.expects
            .iter()
            .filter_map(|e| match e {
                Expect::Problem { kind, reason } => Some((kind.clone(), reason.clone())),
                _ => None,
            })
            .collect()
    }

    /// Frontend (as displayed) → (backends, owner).
    fn frontends(&self) -> BTreeMap<String, (usize, Option<String>)> {
        self.expects
            .iter()
            .filter_map(|e| match e {
                Expect::Frontend {
                    frontend,
                    backends,
                    owner,
                } => Some((frontend.clone(), (*backends, owner.clone()))),
                _ => None,
            })
            .collect()
    }

    /// Every `(kind, reason)` metric series the case must bump.
    fn series(&self) -> BTreeSet<(String, String)> {
        let mut out: BTreeSet<(String, String)> = self
            .skips()
            .into_iter()
            .map(|(kind, _, reason)| (kind, reason))
            .collect();
        out.extend(self.problems());
        out
    }

    /// Puts the case into `dir`: files atomically (written beside, then renamed), then links.
    fn add_to(&self, dir: &Path) {
        for (name, content) in &self.files {
            let tmp = dir.join(format!(".{name}.tmp"));
            fs::write(&tmp, content).unwrap();
            fs::rename(&tmp, dir.join(name)).unwrap();
        }
        for (name, target) in &self.links {
            std::os::unix::fs::symlink(target, dir.join(name)).unwrap();
        }
    }

    /// The names the case puts into the directory.
    fn names(&self) -> Vec<&str> {
        self.files
            .iter()
            .map(|(n, _)| n.as_str())
            .chain(self.links.iter().map(|(n, _)| n.as_str()))
            .collect()
    }

    fn remove_from(&self, dir: &Path) {
        for name in self
            .files
            .iter()
            .map(|(n, _)| n)
            .chain(self.links.iter().map(|(n, _)| n))
        {
            fs::remove_file(dir.join(name)).unwrap();
        }
    }
}

fn corpus_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("bad-input")
}

fn parse_expects(name: &str, text: &str) -> Vec<Expect> {
    let mut out = Vec::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("# expect: ") else {
            continue;
        };
        let words: Vec<&str> = rest.split_whitespace().collect();
        let e = match words.as_slice() {
            ["skip", kind, object, reason] => Expect::Skip {
                kind: (*kind).into(),
                object: (*object).into(),
                reason: (*reason).into(),
            },
            ["problem", kind, reason] => Expect::Problem {
                kind: (*kind).into(),
                reason: (*reason).into(),
            },
            ["frontend", fe, backends, rest @ ..] => Expect::Frontend {
                frontend: (*fe).into(),
                backends: backends
                    .strip_prefix("backends=")
                    .and_then(|n| n.parse().ok())
                    .unwrap_or_else(|| panic!("{name}: bad backends= in {line:?}")),
                owner: match rest {
                    [] => None,
                    [o] => Some(
                        o.strip_prefix("owner=")
                            .unwrap_or_else(|| panic!("{name}: bad owner= in {line:?}"))
                            .into(),
                    ),
                    _ => panic!("{name}: bad expect line {line:?}"),
                },
            },
            _ => panic!("{name}: bad expect line {line:?}"),
        };
        out.push(e);
    }
    out
}

/// The committed cases, in name order.
fn committed() -> Vec<Case> {
    let mut names: Vec<PathBuf> = fs::read_dir(corpus_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    names.sort();
    names
        .into_iter()
        .map(|path| {
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            let text = fs::read_to_string(&path).unwrap();
            assert!(
                text.starts_with("# Wrong:") || text.starts_with("# Not wrong"),
                "{name}: a case starts by saying what is wrong"
            );
            assert!(
                text.contains("\n# lb: "),
                "{name}: a case says what lb does"
            );
            Case {
                expects: parse_expects(&name, &text),
                files: vec![(format!("bad-{name}"), text.into_bytes())],
                links: Vec::new(),
                name,
            }
        })
        .collect()
}

/// Endpoints in the generated big slice.
const BIG_SLICE: usize = 10_000;

/// The cases too big (or too odd) to commit.
fn generated() -> Vec<Case> {
    // 17 MiB of comment lines: valid YAML, above the 16 MiB cap.
    let line = "# padding, never parsed: the file is refused by its size\n";
    let huge = line.repeat((17 << 20) / line.len() + 1).into_bytes();
    assert!(huge.len() as u64 > manifests::MAX_FILE_BYTES);

    let mut big = String::from(
        "apiVersion: v1\nkind: Service\nmetadata: {name: huge-slice, namespace: bad-input}\n\
         spec:\n  clusterIP: 198.19.9.27\n  ports: [{name: http, protocol: TCP, port: 80}]\n---\n\
         apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: huge-slice-1\n  \
         namespace: bad-input\n  labels: {kubernetes.io/service-name: huge-slice}\n\
         addressType: IPv4\nports: [{name: http, protocol: TCP, port: 8080}]\nendpoints:\n",
    );
    for i in 0..BIG_SLICE {
        // 198.18.100.0 - 198.18.139.15: inside 198.18.0.0/15.
        big.push_str(&format!(
            "  - addresses: [198.18.{}.{}]\n",
            100 + i / 256,
            i % 256
        ));
    }
    vec![
        Case {
            name: "generated: a 17 MiB file".into(),
            files: vec![("bad-huge.yaml".into(), huge)],
            links: Vec::new(),
            expects: vec![Expect::Problem {
                kind: "File".into(),
                reason: "too_large".into(),
            }],
        },
        Case {
            name: "generated: a symlink loop".into(),
            files: Vec::new(),
            links: vec![("bad-loop".into(), ".".into())],
            expects: vec![Expect::Problem {
                kind: "File".into(),
                reason: "symlink_loop".into(),
            }],
        },
        Case {
            name: "generated: a dangling symlink".into(),
            files: Vec::new(),
            links: vec![("bad-dangling.yaml".into(), "nowhere.yaml".into())],
            expects: vec![Expect::Problem {
                kind: "File".into(),
                reason: "unreadable".into(),
            }],
        },
        Case {
            name: "generated: 10,000 endpoints in one slice".into(),
            files: vec![("bad-big-slice.yaml".into(), big.into_bytes())],
            links: Vec::new(),
            expects: vec![
                Expect::Skip {
                    kind: "EndpointSlice".into(),
                    object: "bad-input/huge-slice-1".into(),
                    reason: "too_many_endpoints".into(),
                },
                Expect::Frontend {
                    frontend: "198.19.9.27:80/TCP".into(),
                    backends: 0,
                    owner: None,
                },
            ],
        },
    ]
}

fn all_cases() -> Vec<Case> {
    let mut cases = committed();
    cases.extend(generated());
    cases
}

/// A scratch directory, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(what: &str) -> Self {
        let dir =
            std::env::temp_dir().join(format!("lb-test-bad-input-{what}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    /// With a copy of deploy/examples: the baseline service.
    fn with_baseline(what: &str) -> Self {
        let dir = Self::new(what);
        let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/examples");
        for entry in fs::read_dir(examples).unwrap() {
            let path = entry.unwrap().path();
            fs::copy(&path, dir.0.join(path.file_name().unwrap())).unwrap();
        }
        dir
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn translate_dir(dir: &Path) -> (translate::Translation, Vec<manifests::Problem>) {
    let (objects, problems) = manifests::load_dir(dir).expect("the directory reads");
    let node = NodeInfo {
        name: "lb-test-node".into(),
        ..NodeInfo::default()
    };
    let t = translate::desired_state(&objects.services, &objects.slices, &node);
    (t, problems)
}

/// The frontends of `state` that are not in `baseline`.
fn added(state: &DesiredState, baseline: &DesiredState) -> BTreeMap<String, (usize, String)> {
    state
        .services
        .iter()
        .filter(|(fe, _)| !baseline.services.contains_key(fe))
        .map(|(fe, e)| {
            let owner = format!("{}/{}", e.name.namespace, e.name.name);
            (fe.to_string(), (e.backends.len(), owner))
        })
        .collect()
}

#[test]
fn corpus_translates_as_documented() {
    let cases = all_cases();
    assert!(cases.len() >= 25, "{} cases", cases.len());
    let base = TempDir::with_baseline("baseline");
    let (baseline, problems) = translate_dir(&base.0);
    assert!(problems.is_empty() && baseline.skipped.is_empty());
    assert_eq!(baseline.state.services.len(), 4, "the baseline's frontends");

    for case in &cases {
        let dir = TempDir::with_baseline("case");
        case.add_to(&dir.0);
        let (t, problems) = translate_dir(&dir.0);
        let what = &case.name;
        let skips: BTreeSet<(String, String, String)> = t
            .skipped
            .iter()
            .map(|s| {
                (
                    s.kind.to_string(),
                    s.object.clone(),
                    s.reason.as_str().to_string(),
                )
            })
            .collect();
        assert_eq!(skips, case.skips(), "{what}: skipped {:#?}", t.skipped);
        let got_problems: BTreeSet<(String, String)> = problems
            .iter()
            .map(|p| {
                let (k, r) = p.kind.labels();
                (k.to_string(), r.to_string())
            })
            .collect();
        assert_eq!(
            got_problems,
            case.problems(),
            "{what}: problems {problems:#?}"
        );
        for p in &problems {
            assert!(
                case.names().iter().any(|n| p.to_string().contains(n)),
                "{what}: a problem names its file: {p}"
            );
        }
        // The baseline's frontends are exactly as they are alone.
        for (fe, entry) in &baseline.state.services {
            assert_eq!(
                t.state.services.get(fe),
                Some(entry),
                "{what}: baseline {fe}"
            );
        }
        let added = added(&t.state, &baseline.state);
        let want = case.frontends();
        assert_eq!(
            added.keys().collect::<Vec<_>>(),
            want.keys().collect::<Vec<_>>(),
            "{what}: frontends the case programs"
        );
        for (fe, (backends, owner)) in &want {
            let (got_backends, got_owner) = &added[fe];
            assert_eq!(got_backends, backends, "{what}: backends of {fe}");
            if let Some(owner) = owner {
                assert_eq!(got_owner, owner, "{what}: owner of {fe}");
            }
        }
    }
}

/// The loader never reads past the cap: a file that grows is refused too, and the walk of a
/// directory with a loop below a subdirectory ends.
#[test]
fn loader_survives_nested_loops_and_configmap_layouts() {
    let dir = TempDir::new("walk");
    let sub = dir.0.join("sub");
    fs::create_dir_all(sub.join("deeper")).unwrap();
    std::os::unix::fs::symlink("..", sub.join("deeper/up")).unwrap();
    std::os::unix::fs::symlink(&dir.0, sub.join("root")).unwrap();
    // A ConfigMap mount: files link through `..data` to a timestamped directory.
    let stamp = dir.0.join("..2026_12_02");
    fs::create_dir_all(&stamp).unwrap();
    fs::write(
        stamp.join("svc.yaml"),
        "apiVersion: v1\nkind: Service\nmetadata: {name: cm, namespace: bad-input}\n\
         spec: {clusterIP: 198.19.9.28, ports: [{name: http, port: 80}]}\n",
    )
    .unwrap();
    std::os::unix::fs::symlink("..2026_12_02", dir.0.join("..data")).unwrap();
    std::os::unix::fs::symlink("..data/svc.yaml", dir.0.join("svc.yaml")).unwrap();

    let (objects, problems) = manifests::load_dir(&dir.0).unwrap();
    assert_eq!(
        objects.services.len(),
        1,
        "each file read once: {problems:?}"
    );
    let loops: Vec<&manifests::Problem> = problems
        .iter()
        .filter(|p| p.kind == manifests::ProblemKind::SymlinkLoop)
        .collect();
    assert_eq!(loops.len(), 2, "both loops reported: {problems:#?}");
    assert_eq!(problems.len(), 2, "{problems:#?}");
    // The same directory twice: the same answer.
    let (again, problems2) = manifests::load_dir(&dir.0).unwrap();
    assert_eq!(again.services.len(), 1);
    assert_eq!(problems, problems2);
}

// ---------------------------------------------------------------------------------------------
// The running daemon.

/// `lb_objects_skipped_total{kind, reason}`, 0 if absent.
fn skipped_count(metrics: &str, kind: &str, reason: &str) -> f64 {
    let series = format!("lb_objects_skipped_total{{kind=\"{kind}\",reason=\"{reason}\"}}");
    sample(metrics, &series).unwrap_or(0.0)
}

fn frontends_of(d: &Dump) -> BTreeSet<Frontend> {
    d.services.keys().map(|(fe, _)| *fe).collect()
}

/// No half-written service: every master's slots exist and name existing backends, and no
/// slot exists without its master.
fn assert_whole(d: &Dump, what: &str) {
    for ((fe, slot), v) in &d.services {
        let Some(master) = d.services.get(&(*fe, 0)) else {
            panic!("{what}: {fe} slot {slot} without a master");
        };
        if *slot == 0 {
            for s in 1..=master.count + master.qcount {
                assert!(
                    d.services.contains_key(&(*fe, s)),
                    "{what}: {fe} misses slot {s}"
                );
            }
            assert!(d.revnat.contains_key(&v.rev_nat_id), "{what}: {fe} revnat");
        } else {
            assert!(
                *slot <= master.count + master.qcount,
                "{what}: {fe} slot {slot} beyond the master's count"
            );
            assert!(
                d.backends.contains_key(&v.backend_id),
                "{what}: {fe} slot {slot} names a missing backend"
            );
        }
    }
}

/// Waits for the sync after a change made now; returns the log lines from `from` to it.
fn next_sync(lb: &mut LbDaemon, from: usize, what: &str) -> Vec<String> {
    lb.wait_for_from(from, |l| l.contains(" synced"), what)
        .unwrap();
    let end = lb.log.iter().rposition(|l| l.contains(" synced")).unwrap();
    lb.log[from..=end].to_vec()
}

/// One request to the baseline VIP from the client netns, through socket LB: it must answer.
fn request_baseline(tb: &mut Testbed) {
    let mut cmd = Command::new(LB_ECHO);
    cmd.args(["client", "--target", BASELINE_VIP, "--proto", "tcp"])
        .args(["--count", "3"]);
    let cg = tb.cgroup.clone();
    let ns = tb.client.ns.clone();
    let out = tb.run(&ns, Some(&cg), cmd).expect("run client");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let answered = stdout.lines().filter(|l| l.contains("\"backend\"")).count();
    assert_eq!(
        answered,
        3,
        "the baseline answers: {stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn running_daemon_refuses_each_case_and_keeps_serving() {
    let cases = all_cases();
    let mut tb = Testbed::create(3).expect("testbed");
    tb.start_echo_servers(Path::new(LB_ECHO), ECHO_PORT)
        .expect("echo servers");
    let dir = TempDir::with_baseline(&tb.id);
    let cgroup = tb.cgroup.display().to_string();
    let dir_arg = dir.0.display().to_string();
    let args = ["--manifests", &dir_arg, "--cgroup-path", &cgroup];
    let mut lb = LbDaemon::start(&mut tb, Path::new(LB), &args, "info").unwrap();
    let before = lb.dump().unwrap();
    let baseline = frontends_of(&before);
    assert_eq!(baseline.len(), 4, "the baseline's frontends: {before:?}");
    let baseline_entries = entries_of(&before, &baseline);
    request_baseline(&mut tb);

    for case in &cases {
        let what = &case.name;
        let metrics_before = scrape(&tb).unwrap();
        let from = lb.log.len();
        case.add_to(&dir.0);
        let log = next_sync(&mut lb, from, what);
        let metrics = scrape(&tb).unwrap();

        // Logged by name and reason.
        for (kind, object, reason) in case.skips() {
            let named = format!("{kind} {object}:");
            assert!(
                log.iter().any(|l| l.contains("skipping object")
                    && l.contains(&named)
                    && l.contains(&format!("({reason})"))),
                "{what}: no log line for {named} ({reason}):\n{}",
                log.join("\n")
            );
        }
        for (_, reason) in case.problems() {
            assert!(
                log.iter().any(|l| l.contains("skipping manifest document")
                    && case.names().iter().any(|n| l.contains(n))
                    && l.contains(&reason)),
                "{what}: no log line for the file ({reason}):\n{}",
                log.join("\n")
            );
        }
        if case.series().is_empty() {
            assert!(
                !log.iter().any(|l| l.contains("skipping")),
                "{what}: valid input logs no skip:\n{}",
                log.join("\n")
            );
        }
        // Counted.
        for (kind, reason) in case.series() {
            let (was, now) = (
                skipped_count(&metrics_before, &kind, &reason),
                skipped_count(&metrics, &kind, &reason),
            );
            assert!(now > was, "{what}: {kind}/{reason} {was} -> {now}");
        }
        // The baseline is byte for byte what it was; the case adds only what it documents,
        // each whole.
        let after = lb.dump().unwrap();
        assert_eq!(
            entries_of(&after, &baseline),
            baseline_entries,
            "{what}: baseline changed"
        );
        assert_whole(&after, what);
        let added: BTreeMap<String, usize> = after
            .services
            .iter()
            .filter(|((fe, slot), _)| *slot == 0 && !baseline.contains(fe))
            .map(|((fe, _), v)| (fe.to_string(), usize::from(v.count + v.qcount)))
            .collect();
        let want: BTreeMap<String, usize> = case
            .frontends()
            .into_iter()
            .map(|(fe, (n, _))| (fe, n))
            .collect();
        assert_eq!(added, want, "{what}: frontends programmed");

        // Taken out again: the maps are as they were before the case.
        let from = lb.log.len();
        case.remove_from(&dir.0);
        next_sync(&mut lb, from, what);
        assert_eq!(
            lb.dump().unwrap(),
            before,
            "{what}: removing the case restores the maps"
        );
    }

    // All of them at once, to a daemon that is still the same process and still serves. The
    // additions may take more than one sync; the one after SIGHUP sees them all.
    for case in &cases {
        case.add_to(&dir.0);
    }
    thread::sleep(std::time::Duration::from_secs(1));
    lb.drain();
    let from = lb.log.len();
    lb.signal(nix::sys::signal::Signal::SIGHUP).unwrap();
    let log = next_sync(&mut lb, from, "the whole corpus");
    assert!(log.iter().any(|l| l.contains("skipping object")));
    let after = lb.dump().unwrap();
    assert_eq!(
        entries_of(&after, &baseline),
        baseline_entries,
        "whole corpus"
    );
    assert_whole(&after, "whole corpus");
    request_baseline(&mut tb);
    assert!(
        !lb.log.iter().any(|l| l.contains("panicked")),
        "lb panicked:\n{}",
        lb.log.join("\n")
    );
    let status = lb.stop().unwrap();
    assert!(status.success(), "lb kept running until stopped: {status}");
    eprintln!("bad inputs tried: {} cases", cases.len());
}
