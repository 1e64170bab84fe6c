//! The incremental control plane against the whole one: over a long random sequence of object
//! changes (services, slices and node facts added, changed and removed; endpoints flapping
//! between ready, terminating and gone; shared backends and contested frontends; session
//! affinity, Maglev, Local and Cluster policies, dual stack), after every step
//!
//! - `IncrementalTranslator::update` gives the same `Translation` as `desired_state` of the
//!   whole snapshot (state, skipped objects in order, no-local counts), and
//! - a reconciler driven by `apply_update` holds exactly the maps (ids included) of one that
//!   runs a full `apply` every step;
//!
//! and at the end a full sync (re-read maps, full apply) finds nothing to repair.
//!
//! The seed is printed; `LB_INCREMENTAL_SEED=<seed>` replays a run, `LB_INCREMENTAL_STEPS`
//! changes its length.
use std::{
    cell::{Cell, RefCell},
    net::IpAddr,
    rc::Rc,
    sync::Arc,
    time::{Instant, SystemTime, UNIX_EPOCH},
};

use lb::kube::slim::{EndpointSlice, Service};
use lb::{
    daemon::{self, SyncKind},
    datapath::maps::{AffMatch, Dump, LbMaps, MaglevGeometry, MapOpError, Table},
    datapath::testing::{MemMaps, render},
    kube::source::Snapshot,
    metrics::Metrics,
    model::{Backend, Cidr, Family, Frontend, LbAlgorithm},
    reconcile::Reconciler,
    translate::incremental::{IncrementalTranslator, Update},
    translate::{NodeInfo, desired_state},
};
use lb_common::{EchoValue, SvcValue};
use lb_tests::FromJson;
use serde_json::{Value, json};

/// xorshift64*: small, seeded, reproducible.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

const NAMESPACES: [&str; 2] = ["a", "b"];
const SERVICES: usize = 8;
/// Few ClusterIPs and external addresses, so that services contest frontends.
const CLUSTER_V4: [&str; 6] = [
    "198.19.0.1",
    "198.19.0.2",
    "198.19.0.3",
    "198.19.0.4",
    "198.19.0.5",
    "198.19.0.6",
];
const CLUSTER_V6: [&str; 4] = [
    "2001:db8:ffff::1",
    "2001:db8:ffff::2",
    "2001:db8:ffff::3",
    "2001:db8:ffff::4",
];
const EXTERNAL_V4: [&str; 3] = ["198.19.1.1", "198.19.1.2", "198.18.100.1"];
const EXTERNAL_V6: [&str; 2] = ["2001:db8:1::1", "2001:db8:100::1"];
const NODE_IPS: [&str; 2] = ["198.18.100.1", "2001:db8:100::1"];
const PORT_NAMES: [&str; 3] = ["", "http", "dns"];
const PORTS: [i32; 3] = [80, 443, 53];
const NODES: [Option<&str>; 3] = [Some("node-a"), Some("node-b"), None];

fn backend_ip(rng: &mut Rng, v6: bool) -> String {
    if v6 {
        format!("2001:db8::{}", 1 + rng.below(8))
    } else {
        format!("198.18.0.{}", 1 + rng.below(12))
    }
}

fn service(rng: &mut Rng, ns: &str, name: &str) -> Value {
    let family = rng.below(4); // 0, 1: IPv4; 2: IPv6; 3: dual stack
    let mut ips = Vec::new();
    if family != 2 {
        ips.push(rng.pick(&CLUSTER_V4).to_string());
    }
    if family >= 2 {
        ips.push(rng.pick(&CLUSTER_V6).to_string());
    }
    if rng.chance(3) {
        ips[0] = "300.1.1.1".into();
    }
    let type_ = *rng.pick(&["ClusterIP", "ClusterIP", "NodePort", "LoadBalancer"]);
    let mut ports = Vec::new();
    for _ in 0..1 + rng.below(2) {
        let mut p = json!({
            "name": rng.pick(&PORT_NAMES),
            "port": rng.pick(&PORTS),
            "protocol": rng.pick(&["TCP", "TCP", "UDP"]),
        });
        if type_ != "ClusterIP" {
            p["nodePort"] = json!(30000 + rng.below(3) as i32);
        }
        ports.push(p);
    }
    let mut spec = json!({
        "type": type_,
        "clusterIP": ips[0],
        "clusterIPs": ips,
        "ports": ports,
    });
    if rng.chance(25) {
        let mut ext = vec![rng.pick(&EXTERNAL_V4).to_string()];
        if family >= 2 {
            ext.push(rng.pick(&EXTERNAL_V6).to_string());
        }
        spec["externalIPs"] = json!(ext);
    }
    if rng.chance(40) {
        spec["externalTrafficPolicy"] = json!(rng.pick(&["Local", "Cluster"]));
    }
    if rng.chance(30) {
        spec["internalTrafficPolicy"] = json!(rng.pick(&["Local", "Cluster"]));
    }
    if rng.chance(30) {
        spec["sessionAffinity"] = json!("ClientIP");
        if rng.chance(50) {
            let t = *rng.pick(&[0, 30, 10_800, 100_000]);
            spec["sessionAffinityConfig"] = json!({"clientIP": {"timeoutSeconds": t}});
        }
    }
    if type_ == "LoadBalancer" && rng.chance(30) {
        spec["loadBalancerSourceRanges"] = json!(["198.51.100.0/24", "2001:db8:5::/48"]);
    }
    let mut meta = json!({"name": name, "namespace": ns});
    if rng.chance(50) {
        meta["creationTimestamp"] = json!(format!("2024-01-0{}T00:00:00Z", 1 + rng.below(3)));
    }
    if rng.chance(30) {
        let alg = *rng.pick(&["maglev", "maglev", "random", "bogus"]);
        meta["annotations"] = json!({"lb.io/lb-algorithm": alg});
    }
    let mut svc = json!({"apiVersion": "v1", "kind": "Service", "metadata": meta, "spec": spec});
    if type_ == "LoadBalancer" && rng.chance(70) {
        let mut ingress = vec![json!({"ip": rng.pick(&EXTERNAL_V4)})];
        if family >= 2 {
            ingress.push(json!({"ip": rng.pick(&EXTERNAL_V6)}));
        }
        svc["status"] = json!({"loadBalancer": {"ingress": ingress}});
    }
    svc
}

fn endpoint(rng: &mut Rng, v6: bool) -> Value {
    let mut ep = json!({
        "addresses": [backend_ip(rng, v6)],
        "conditions": {
            "ready": rng.chance(70),
            "serving": rng.chance(70),
            "terminating": rng.chance(30),
        },
    });
    if let Some(node) = rng.pick(&NODES) {
        ep["nodeName"] = json!(node);
    }
    if rng.chance(15) {
        ep["hints"] = json!({"forZones": [{"name": rng.pick(&["zone-1", "zone-2"])}]});
    }
    ep
}

fn slice(rng: &mut Rng, ns: &str, name: &str, service: Option<&str>) -> Value {
    let v6 = rng.chance(35);
    let mut ports = Vec::new();
    for _ in 0..1 + rng.below(2) {
        ports.push(json!({
            "name": rng.pick(&PORT_NAMES),
            "port": 8000 + rng.below(3) as i32,
            "protocol": rng.pick(&["TCP", "TCP", "UDP"]),
        }));
    }
    let endpoints: Vec<Value> = (0..rng.below(5)).map(|_| endpoint(rng, v6)).collect();
    let mut meta = json!({"name": name, "namespace": ns});
    if let Some(s) = service {
        meta["labels"] = json!({"kubernetes.io/service-name": s});
    }
    let mut slice = json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": meta,
        "addressType": if v6 { "IPv6" } else { "IPv4" },
        "ports": ports,
        "endpoints": endpoints,
    });
    if !endpoints_empty(&slice) && rng.chance(3) {
        slice["endpoints"][0] = json!({"addresses": ["not-an-ip"]});
    }
    slice
}

fn endpoints_empty(slice: &Value) -> bool {
    slice["endpoints"].as_array().is_none_or(|a| a.is_empty())
}

fn node(rng: &mut Rng) -> NodeInfo {
    let ips: Vec<IpAddr> = NODE_IPS
        .iter()
        .filter(|_| rng.chance(60))
        .map(|s| s.parse().unwrap())
        .collect();
    NodeInfo {
        name: "node-a".into(),
        zone: rng.chance(50).then(|| "zone-1".into()),
        nodeport_ips: ips.clone(),
        local_ips: if rng.chance(50) { ips } else { Vec::new() },
        lb_algorithm: if rng.chance(20) {
            LbAlgorithm::Maglev
        } else {
            LbAlgorithm::Random
        },
    }
}

/// The objects of the run, by slot: the same `Arc` until a step changes it.
struct World {
    services: Vec<Option<Arc<Service>>>,
    slices: Vec<Option<Arc<EndpointSlice>>>,
    node: NodeInfo,
}

fn names(i: usize) -> (&'static str, String) {
    (NAMESPACES[i % 2], format!("svc{}", i / 2))
}

impl World {
    fn step(&mut self, rng: &mut Rng) {
        let n = if rng.chance(5) { 10 } else { 1 + rng.below(3) };
        for _ in 0..n {
            match rng.below(100) {
                0..=24 => {
                    let i = rng.below(self.services.len());
                    let (ns, name) = names(i);
                    self.services[i] = Some(Arc::new(parse(service(rng, ns, &name))));
                }
                25..=32 => {
                    let i = rng.below(self.services.len());
                    self.services[i] = None;
                }
                33..=64 => {
                    // Two slices per service, and one slot for slices of no or an unknown
                    // service.
                    let i = rng.below(self.slices.len());
                    let (ns, svc) = names(i / 2);
                    let label = match rng.below(20) {
                        0 => None,
                        1 => Some("nobody".to_string()),
                        _ => Some(svc.clone()),
                    };
                    let name = format!("{svc}-{}", i % 2);
                    let s = slice(rng, ns, &name, label.as_deref());
                    self.slices[i] = Some(Arc::new(parse(s)));
                }
                65..=72 => {
                    let i = rng.below(self.slices.len());
                    self.slices[i] = None;
                }
                73..=89 => {
                    // An endpoint flaps: ready, terminating, serving.
                    let i = rng.below(self.slices.len());
                    if let Some(s) = &self.slices[i] {
                        let mut s = (**s).clone();
                        if let Some(ep) = s.endpoints.iter_mut().next() {
                            ep.ready = Some(rng.chance(50));
                            ep.terminating = Some(rng.chance(50));
                            ep.serving = Some(rng.chance(50));
                        }
                        self.slices[i] = Some(Arc::new(s));
                    }
                }
                90..=94 => {
                    // The same contents in a new object (a manifest re-read), with or without
                    // a resourceVersion.
                    let i = rng.below(self.services.len());
                    if let Some(s) = &self.services[i] {
                        let mut s = (**s).clone();
                        if rng.chance(50) {
                            s.metadata.resource_version = Some(format!("{}", rng.next()).into());
                        }
                        self.services[i] = Some(Arc::new(s));
                    }
                }
                _ => self.node = node(rng),
            }
        }
    }

    /// The snapshot's lists, in an order that changes from step to step.
    fn snapshot(&self, rng: &mut Rng) -> (Vec<Arc<Service>>, Vec<Arc<EndpointSlice>>) {
        let mut services: Vec<_> = self.services.iter().flatten().cloned().collect();
        let mut slices: Vec<_> = self.slices.iter().flatten().cloned().collect();
        // Mostly in a stable order, as a reflector store hands its objects out (the
        // translator's positional match), sometimes shuffled (its hash path).
        if rng.chance(33) {
            shuffle(rng, &mut services);
            shuffle(rng, &mut slices);
        }
        (services, slices)
    }
}

fn shuffle<T>(rng: &mut Rng, v: &mut [T]) {
    for i in (1..v.len()).rev() {
        v.swap(i, rng.below(i + 1));
    }
}

fn parse<T: FromJson>(v: Value) -> T {
    T::from_json(v)
}

fn seed() -> u64 {
    match std::env::var("LB_INCREMENTAL_SEED") {
        Ok(s) => s.parse().expect("LB_INCREMENTAL_SEED is a number"),
        Err(_) => {
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
                | 1
        }
    }
}

fn steps(default: usize) -> usize {
    std::env::var("LB_INCREMENTAL_STEPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// Runs `steps` random steps against maps of `capacity` entries each; returns how many
/// updates were incremental and how many frontends they changed.
fn run(seed: u64, steps: usize, capacity: u32) -> (usize, usize, Coverage) {
    println!(
        "seed {seed} ({steps} steps, capacity {capacity}): replay with LB_INCREMENTAL_SEED={seed}"
    );
    let mut rng = Rng(seed.max(1));
    let mut world = World {
        services: vec![None; NAMESPACES.len() * SERVICES],
        slices: vec![None; NAMESPACES.len() * SERVICES * 2],
        node: node(&mut rng),
    };
    let mut translator = IncrementalTranslator::new();
    let mut incremental = Reconciler::new(MemMaps::with_capacity(capacity)).unwrap();
    let mut full = Reconciler::new(MemMaps::with_capacity(capacity)).unwrap();
    let (mut updates, mut changed) = (0, 0);
    let mut seen = Coverage::default();
    // Frontends the last step's apply left unprogrammed (refused for room) or on random.
    let mut left = 0;
    for step in 0..steps {
        world.step(&mut rng);
        let (services, slices) = world.snapshot(&mut rng);
        let update = translator.update(&services, &slices, &world.node);
        let want = desired_state(&services, &slices, &world.node);
        let got = translator.translation();
        if got != want {
            let only = |a: &lb::translate::Translation, b: &lb::translate::Translation| {
                a.state
                    .services
                    .iter()
                    .filter(|(fe, e)| b.state.services.get(fe) != Some(e))
                    .map(|(fe, e)| format!("{fe} {e:?}"))
                    .collect::<Vec<_>>()
            };
            panic!(
                "seed {seed} step {step}: translations differ\nonly incremental: {:#?}\nonly \
                 full: {:#?}\nskipped incremental: {:#?}\nskipped full: {:#?}\nno-local {:?} vs \
                 {:?}",
                only(&got, &want),
                only(&want, &got),
                got.skipped,
                want.skipped,
                got.no_local_endpoints,
                want.no_local_endpoints
            );
        }
        if let Update::Changed(c) = &update {
            updates += 1;
            changed += c.len();
        }
        let a = incremental.apply_update(translator.state(), &update);
        let b = full.apply(&want.state);
        let dup = |r: lb::translate::SkipReason| want.skipped.iter().any(|s| s.reason == r);
        seen.contested += usize::from(dup(lb::translate::SkipReason::DuplicateFrontend));
        seen.errors += usize::from(!b.errors.is_empty());
        left = b.errors.len() + b.fallbacks.len();
        seen.fallbacks += usize::from(!b.fallbacks.is_empty());
        seen.frontends = seen.frontends.max(want.state.services.len());
        let errors = |r: &lb::reconcile::ApplyReport| {
            let mut e: Vec<String> = r.errors.iter().map(|e| e.frontend.to_string()).collect();
            e.sort();
            e
        };
        // The full reconciler reports every frontend it cannot program each time; the
        // incremental one those it retried, which are all of them.
        assert_eq!(errors(&a), errors(&b), "seed {seed} step {step}: errors");
        let (da, db) = (&incremental.maps().dump, &full.maps().dump);
        if da != db {
            panic!(
                "seed {seed} step {step}: maps differ\nincremental:\n{}\nfull:\n{}",
                render(da),
                render(db)
            );
        }
    }
    println!("{updates} incremental updates changed {changed} frontends; steps with: {seen:?}");
    // What a periodic full sync does: it finds nothing to repair. Where the last sync left
    // frontends refused for room, the next sync of either kind may program one (the room the
    // last one freed by its deletes comes after its writes), so both get that sync and must
    // still agree.
    full.apply(translator.state());
    incremental.refresh().unwrap();
    let report = incremental.apply(translator.state());
    if left == 0 {
        assert_eq!(
            (report.writes, report.deletes),
            (0, 0),
            "seed {seed}: a full sync after the incremental ones rewrote entries"
        );
    }
    assert_eq!(
        incremental.maps().dump().unwrap(),
        full.maps().dump().unwrap(),
        "seed {seed}: the next full sync of each agrees"
    );
    (updates, changed, seen)
}

/// How many steps had what the comparison should cover.
#[derive(Debug, Default)]
struct Coverage {
    contested: usize,
    errors: usize,
    fallbacks: usize,
    frontends: usize,
}

#[test]
fn incremental_translation_and_reconcile_match_the_full_ones() {
    let steps = steps(3000);
    let (updates, changed, seen) = run(seed(), steps, 4096);
    assert!(
        seen.contested * 10 > steps && seen.fallbacks > 0,
        "the run should contest frontends and run out of Maglev tables: {seen:?}"
    );
    // Most steps change little: the run exercised the incremental paths, not the fallbacks.
    assert!(
        updates * 10 >= steps * 8,
        "only {updates} of {steps} updates were incremental"
    );
    assert!(changed > 0, "no update changed a frontend");
}

#[test]
fn incremental_reconcile_matches_the_full_one_with_full_maps() {
    // Room for a few services only: frontends that do not fit are reported and retried.
    let (_, _, seen) = run(seed().wrapping_add(1), steps(1500), 24);
    assert!(
        seen.errors * 10 > steps(1500),
        "maps should overflow: {seen:?}"
    );
}

#[test]
fn a_snapshot_with_two_objects_of_one_name_is_translated_whole_and_the_next_rebuilds() {
    let mut rng = Rng(7);
    let node = NodeInfo::default();
    let a = Arc::new(parse::<Service>(service(&mut rng, "a", "svc0")));
    let twin = Arc::new(parse::<Service>(service(&mut rng, "a", "svc0")));
    let other = Arc::new(parse::<Service>(service(&mut rng, "b", "svc1")));
    let mut t = IncrementalTranslator::new();
    let services = vec![a.clone(), twin, other.clone()];
    assert_eq!(t.update(&services, &[], &node), Update::Full);
    assert_eq!(
        t.translation(),
        desired_state(&services, &[] as &[Arc<EndpointSlice>], &node)
    );
    let services = vec![a, other];
    assert_eq!(t.update(&services, &[], &node), Update::Full, "rebuilt");
    assert_eq!(
        t.translation(),
        desired_state(&services, &[] as &[Arc<EndpointSlice>], &node)
    );
    assert!(
        matches!(t.update(&services, &[], &node), Update::Changed(c) if c.is_empty()),
        "the same snapshot again changes nothing"
    );
}

/// The daemon's way: one `ChangeDetector` diffs each snapshot and the translator applies that
/// diff. It translates as `update` (a detector of the translator's own) does, step by step;
/// a diff that does not follow the one applied last (one was skipped, or another detector's)
/// rebuilds from the whole snapshot instead of missing what the skipped one named.
#[test]
fn the_shared_diff_drives_the_translator_as_update_does() {
    use lb::kube::changes::ChangeDetector;
    let mut rng = Rng(11);
    let mut world = World {
        services: vec![None; NAMESPACES.len() * SERVICES],
        slices: vec![None; NAMESPACES.len() * SERVICES * 2],
        node: node(&mut rng),
    };
    let mut detector = ChangeDetector::new();
    let (mut shared, mut own) = (IncrementalTranslator::new(), IncrementalTranslator::new());
    let mut incremental = 0;
    for step in 0..300 {
        world.step(&mut rng);
        let (services, slices) = world.snapshot(&mut rng);
        let diff = detector.observe_objects(&services, &slices);
        if step % 50 == 49 {
            // Skipped: the next diff does not follow what the translator applied.
            continue;
        }
        let got = shared.apply(&diff, &services, &slices, &world.node);
        let want = own.update(&services, &slices, &world.node);
        if step % 50 == 0 && step > 0 {
            assert_eq!(got, Update::Full, "step {step}: after a skipped diff");
        } else {
            assert_eq!(got, want, "step {step}");
        }
        incremental += usize::from(matches!(got, Update::Changed(_)));
        assert_eq!(
            shared.translation(),
            desired_state(&services, &slices, &world.node),
            "step {step}"
        );
    }
    assert!(incremental > 200, "{incremental} incremental updates");
}

/// `MemMaps` whose writes and deletes fail now and then while `flaky` is set.
struct Flaky {
    inner: Rc<RefCell<MemMaps>>,
    flaky: Rc<Cell<bool>>,
    rng: Rng,
}

impl Flaky {
    fn fail(&mut self, map: &'static str) -> Result<(), MapOpError> {
        if self.flaky.get() && self.rng.chance(3) {
            return Err(MapOpError::Full { map });
        }
        Ok(())
    }
}

impl LbMaps for Flaky {
    fn dump(&self) -> anyhow::Result<Dump> {
        self.inner.borrow().dump()
    }
    fn capacity(&self, t: Table, f: Family) -> u32 {
        self.inner.borrow().capacity(t, f)
    }
    fn put_backend(&mut self, id: u32, b: &Backend) -> Result<(), MapOpError> {
        self.fail("backends")?;
        self.inner.borrow_mut().put_backend(id, b)
    }
    fn del_backend(&mut self, id: u32, f: Family) -> Result<(), MapOpError> {
        self.fail("backends")?;
        self.inner.borrow_mut().del_backend(id, f)
    }
    fn put_revnat(&mut self, id: u32, a: IpAddr, p: u16) -> Result<(), MapOpError> {
        self.fail("revnat")?;
        self.inner.borrow_mut().put_revnat(id, a, p)
    }
    fn del_revnat(&mut self, id: u32, f: Family) -> Result<(), MapOpError> {
        self.fail("revnat")?;
        self.inner.borrow_mut().del_revnat(id, f)
    }
    fn put_service(&mut self, fe: &Frontend, s: u16, v: &SvcValue) -> Result<(), MapOpError> {
        self.fail("services")?;
        self.inner.borrow_mut().put_service(fe, s, v)
    }
    fn del_service(&mut self, fe: &Frontend, s: u16) -> Result<(), MapOpError> {
        self.fail("services")?;
        self.inner.borrow_mut().del_service(fe, s)
    }
    fn put_cluster_ip(&mut self, a: IpAddr, n: u32) -> Result<(), MapOpError> {
        self.fail("cluster_ips")?;
        self.inner.borrow_mut().put_cluster_ip(a, n)
    }
    fn del_cluster_ip(&mut self, a: IpAddr) -> Result<(), MapOpError> {
        self.fail("cluster_ips")?;
        self.inner.borrow_mut().del_cluster_ip(a)
    }
    fn put_src_range(&mut self, id: u32, c: &Cidr) -> Result<(), MapOpError> {
        self.fail("src_ranges")?;
        self.inner.borrow_mut().put_src_range(id, c)
    }
    fn del_src_range(&mut self, id: u32, c: &Cidr) -> Result<(), MapOpError> {
        self.fail("src_ranges")?;
        self.inner.borrow_mut().del_src_range(id, c)
    }
    fn put_aff_match(&mut self, m: &AffMatch) -> Result<(), MapOpError> {
        self.fail("aff_match")?;
        self.inner.borrow_mut().put_aff_match(m)
    }
    fn del_aff_match(&mut self, m: &AffMatch) -> Result<(), MapOpError> {
        self.fail("aff_match")?;
        self.inner.borrow_mut().del_aff_match(m)
    }
    fn put_echo(&mut self, a: IpAddr, v: EchoValue) -> Result<(), MapOpError> {
        self.fail("echo")?;
        self.inner.borrow_mut().put_echo(a, v)
    }
    fn del_echo(&mut self, a: IpAddr) -> Result<(), MapOpError> {
        self.fail("echo")?;
        self.inner.borrow_mut().del_echo(a)
    }
    fn maglev_geometry(&self) -> MaglevGeometry {
        self.inner.borrow().maglev_geometry()
    }
    fn put_maglev(&mut self, t: u32, c: u32, id: u32) -> Result<(), MapOpError> {
        self.fail("maglev")?;
        self.inner.borrow_mut().put_maglev(t, c, id)
    }
}

#[test]
fn failed_writes_of_incremental_syncs_are_repaired_by_the_next_sync() {
    repair_run(seed());
}

/// Seeds of failures seen, replayed every run: 1796227027694529091 (noted when a Maglev
/// table freed later in the same apply was found) and 1796301284279890445 (a restored
/// service's surplus slot whose delete failed was forgotten by the mirror; fails without
/// the fix).
#[test]
fn failed_writes_are_repaired_at_seeds_that_once_failed() {
    for seed in [1_796_227_027_694_529_091, 1_796_301_284_279_890_445] {
        repair_run(seed);
    }
}

fn repair_run(seed: u64) {
    let seed = seed.wrapping_add(2);
    println!(
        "seed {seed}: replay with LB_INCREMENTAL_SEED={}",
        seed.wrapping_sub(2)
    );
    let mut rng = Rng(seed.max(1));
    let mut world = World {
        services: vec![None; NAMESPACES.len() * SERVICES],
        slices: vec![None; NAMESPACES.len() * SERVICES * 2],
        node: node(&mut rng),
    };
    let flaky = Rc::new(Cell::new(false));
    let maps = Flaky {
        inner: Rc::new(RefCell::new(MemMaps::with_capacity(4096))),
        flaky: flaky.clone(),
        rng: Rng(seed.wrapping_mul(3) | 1),
    };
    let mut translator = IncrementalTranslator::new();
    let mut reconciler = Reconciler::new(maps).unwrap();
    let (mut failed, mut repaired) = (0, 0);
    for step in 0..steps(1500) {
        world.step(&mut rng);
        let (services, slices) = world.snapshot(&mut rng);
        let update = translator.update(&services, &slices, &world.node);
        // Every other step fails some writes; the one after has none.
        let storm = step % 2 == 0;
        flaky.set(storm);
        let report = reconciler.apply_update(translator.state(), &update);
        if storm {
            failed += usize::from(!report.errors.is_empty());
            continue;
        }
        // The maps hold the desired state: a fresh reconciler over them writes nothing.
        let mut check = Reconciler::new(reconciler.maps().inner.borrow().clone()).unwrap();
        let r = check.apply(translator.state());
        assert_eq!(
            (r.writes, r.deletes, r.errors.len()),
            (0, 0, 0),
            "seed {seed} step {step}: the maps were not repaired"
        );
        repaired += 1;
    }
    assert!(failed > 10, "few storms failed anything ({failed})");
    assert!(repaired > 10);
}

#[test]
fn the_daemons_full_sync_repairs_entries_changed_behind_its_back() {
    let mut rng = Rng(11);
    let mut world = World {
        services: vec![None; NAMESPACES.len() * SERVICES],
        slices: vec![None; NAMESPACES.len() * SERVICES * 2],
        node: NodeInfo::default(),
    };
    for _ in 0..40 {
        world.step(&mut rng);
    }
    world.node = NodeInfo::default();
    let (services, slices) = world.snapshot(&mut rng);
    let shared = Rc::new(RefCell::new(MemMaps::with_capacity(4096)));
    let maps = Flaky {
        inner: shared.clone(),
        flaky: Rc::new(Cell::new(false)),
        rng: Rng(1),
    };
    let mut reconciler = Reconciler::new(maps).unwrap();
    let mut translator = IncrementalTranslator::new();
    let metrics = Metrics::new();
    let snapshot = Snapshot {
        services,
        slices,
        node: None,
        problems: Vec::new(),
        changed_at: Instant::now(),
    };
    let sync = |reconciler: &mut Reconciler<Flaky>, translator: &mut _, generation, full| {
        let kind = SyncKind { generation, full };
        daemon::sync_node(
            reconciler,
            translator,
            &snapshot,
            &NodeInfo::default(),
            kind,
            &metrics,
            &Default::default(),
        )
    };
    sync(&mut reconciler, &mut translator, 1, false);
    let good = shared.borrow().dump.clone();
    assert!(!good.backends.is_empty(), "the world has backends");
    // Someone deletes a backend and a master; an incremental sync does not look.
    {
        let mut m = shared.borrow_mut();
        let id = *m.dump.backends.keys().next().unwrap();
        m.dump.backends.remove(&id);
        let master = *m.dump.services.keys().find(|(_, slot)| *slot == 0).unwrap();
        m.dump.services.remove(&master);
    }
    let synced = sync(&mut reconciler, &mut translator, 2, false);
    assert_eq!(synced.changed, Some(0));
    assert_ne!(shared.borrow().dump, good);
    let synced = sync(&mut reconciler, &mut translator, 3, true);
    assert_eq!(synced.changed, None, "a full sync translates everything");
    // Repaired: a fresh reconciler over the maps finds nothing to write (ids may be new ones).
    let mut check = Reconciler::new(shared.borrow().clone()).unwrap();
    let r = check.apply(translator.state());
    assert_eq!(
        (r.writes, r.deletes),
        (0, 0),
        "the full sync repaired the maps"
    );
    assert_eq!(shared.borrow().dump.services.len(), good.services.len());
    let text = metrics.render();
    let line = |name: &str| {
        text.lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("no {name} in\n{text}"))
            .to_string()
    };
    assert_eq!(
        line("lb_full_syncs_total{result=\"ok\"}"),
        "lb_full_syncs_total{result=\"ok\"} 1"
    );
    let repaired = line("lb_full_sync_repaired_total");
    let n: u64 = repaired.rsplit(' ').next().unwrap().parse().unwrap();
    assert!(n >= 2, "{repaired}");
}
