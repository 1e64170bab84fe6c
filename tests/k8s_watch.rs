//! The Kubernetes API source (`k8s::watch`) against a fake API server that speaks the real
//! list/watch protocol (tests/support/apiserver.rs): every published snapshot is translated and
//! applied to in-memory maps, and each test waits for the maps to reach the state the API
//! objects call for — through the initial list, watch events, bookmarks, 410 Gone, dropped
//! connections, label and field selectors. No root needed.
mod support;

use std::{collections::BTreeSet, sync::Arc, time::Duration};

use k8s_openapi::api::core::v1::Service;
use kube::{Api, api::ListParams};
use lb::{
    daemon,
    datapath::testing::{MemMaps, render},
    kube::k8s,
    kube::source::{self, Snapshot, SnapshotReceiver},
    kube::{LABEL_HEADLESS, LABEL_SERVICE_PROXY_NAME},
    metrics::Metrics,
    reconcile::Reconciler,
};
use support::{
    Ep,
    apiserver::{ApiServer, Kind, KubeconfigFile},
    labelled,
    maps::Maps,
    node, service, slice,
};

const NODE: &str = "node-a";
const NS: &str = "demo";
const WAIT: Duration = Duration::from_secs(10);

const VIP: &str = "198.19.0.10";
const FE: &str = "198.19.0.10:80/TCP";
const B1: &str = "198.18.11.2";
const B2: &str = "198.18.12.2";
const B3: &str = "198.18.13.2";

fn echo_service() -> Service {
    service(NS, "echo", VIP, 80, 8080)
}

/// `k8s::watch` against a fake API server, with the daemon's translate + reconcile steps
/// on in-memory maps.
struct Harness {
    server: ApiServer,
    _kubeconfig: KubeconfigFile,
    rx: SnapshotReceiver,
    reconciler: Reconciler<MemMaps>,
    translator: lb::translate::incremental::IncrementalTranslator,
    metrics: Arc<Metrics>,
    maps: Maps,
    snapshots: usize,
    /// `namespace/name` of every Service / EndpointSlice and the name of every Node that ever
    /// appeared in a snapshot.
    seen_services: BTreeSet<String>,
    seen_slices: BTreeSet<String>,
    seen_nodes: BTreeSet<String>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Harness {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn name_of(meta: &lb::kube::slim::Meta) -> String {
    match &meta.namespace {
        Some(ns) => format!("{ns}/{}", meta.name.as_deref().unwrap_or("")),
        None => meta.name.as_deref().unwrap_or_default().to_string(),
    }
}

impl Harness {
    /// Starts the server, lets `setup` create the objects the initial list sees, then starts
    /// the watch.
    async fn start(setup: impl FnOnce(&ApiServer)) -> Harness {
        Self::start_as(setup, None).await
    }

    /// With `Some(timeout)`: `lb run`'s client and watch (`watch_client`, `watch_with`) with
    /// that watch timeout, reporting to the harness's metrics; else the plain `watch`.
    async fn start_as(setup: impl FnOnce(&ApiServer), watch_timeout: Option<Duration>) -> Harness {
        // RUST_LOG=debug shows the watcher's and lb's view (with --nocapture).
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
        let server = ApiServer::start().await.expect("fake API server");
        setup(&server);
        let kubeconfig = server.kubeconfig_file().expect("kubeconfig");
        let (tx, rx) = source::channel();
        let metrics = Metrics::new();
        let task = match watch_timeout {
            None => {
                let client = k8s::client(Some(kubeconfig.path()))
                    .await
                    .expect("kube client");
                tokio::spawn(k8s::watch(client, NODE.into(), tx))
            }
            Some(timeout) => {
                let client = k8s::watch_client(Some(kubeconfig.path()), timeout, metrics.clone())
                    .await
                    .expect("kube client");
                let opts = k8s::WatchOptions {
                    timeout,
                    metrics: Some(metrics.clone()),
                };
                tokio::spawn(k8s::watch_with(client, NODE.into(), tx, opts))
            }
        };
        Harness {
            server,
            _kubeconfig: kubeconfig,
            rx,
            reconciler: Reconciler::new(MemMaps::with_capacity(1024)).expect("reconciler"),
            translator: Default::default(),
            metrics,
            maps: Maps::default(),
            snapshots: 0,
            seen_services: BTreeSet::new(),
            seen_slices: BTreeSet::new(),
            seen_nodes: BTreeSet::new(),
            task,
        }
    }

    /// The daemon's own `sync` of a snapshot, on in-memory maps.
    fn apply(&mut self, snapshot: &Snapshot) {
        self.snapshots += 1;
        self.seen_services
            .extend(snapshot.services.iter().map(|s| name_of(&s.metadata)));
        self.seen_slices
            .extend(snapshot.slices.iter().map(|s| name_of(&s.metadata)));
        self.seen_nodes
            .extend(snapshot.node.iter().map(|n| name_of(&n.metadata)));
        let synced = daemon::sync(
            &mut self.reconciler,
            &mut self.translator,
            snapshot,
            NODE,
            self.snapshots as u64,
            &self.metrics,
        );
        assert!(
            synced.report.errors.is_empty(),
            "apply errors: {:?}",
            synced.report.errors
        );
        self.maps = Maps::parse(render(&self.reconciler.maps().dump));
    }

    /// Applies snapshots as they arrive until `pred` holds for the maps (after at least one
    /// snapshot), for at most 10 s.
    async fn wait_until(&mut self, what: &str, pred: impl Fn(&Maps) -> bool) -> Maps {
        self.wait_until_within(WAIT, what, pred).await
    }

    /// [`Harness::wait_until`] for at most `wait`.
    async fn wait_until_within(
        &mut self,
        wait: Duration,
        what: &str,
        pred: impl Fn(&Maps) -> bool,
    ) -> Maps {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            if self.snapshots > 0 && pred(&self.maps) {
                return self.maps.clone();
            }
            match tokio::time::timeout_at(deadline, self.rx.changed()).await {
                Ok(Ok(())) => {
                    let snapshot: Option<Arc<Snapshot>> = self.rx.borrow_and_update().clone();
                    if let Some(s) = snapshot {
                        self.apply(&s);
                    }
                }
                Ok(Err(_)) => panic!("{what}: the watch task ended\n{}", self.maps.text),
                Err(_) => panic!(
                    "{what}: not reached within {wait:?} ({} snapshots); maps:\n{}\nrequests: {:#?}",
                    self.snapshots,
                    self.maps.text,
                    self.server.requests()
                ),
            }
        }
    }

    /// Waits until each kind has an open watch (the initial lists are done).
    async fn wait_watching(&self) {
        let ok = self
            .server
            .wait_for(WAIT, |s| Kind::ALL.iter().all(|k| s.open_watches(*k) > 0))
            .await;
        assert!(
            ok,
            "no open watch for every kind: {:#?}",
            self.server.requests()
        );
    }

    /// Whether a snapshot arrives within `d`.
    async fn snapshot_within(&mut self, d: Duration) -> bool {
        tokio::time::timeout(d, self.rx.changed()).await.is_ok()
    }
}

fn three_backends() -> [Ep; 3] {
    [Ep::ready(B1), Ep::ready(B2), Ep::ready(B3)]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn initial_list_programs_frontend_with_backends() {
    let mut h = Harness::start(|s| {
        s.create(&echo_service());
        s.create(&slice(NS, "echo-abc", "echo", 8080, &three_backends()));
    })
    .await;
    h.wait_until("frontend with b1..b3", |m| m.is(&[(FE, &[B1, B2, B3])]))
        .await;
    // lb programs services without waiting for its Node, so that list may come later.
    h.wait_watching().await;
    for kind in Kind::ALL {
        assert_eq!(h.server.list_count(kind), 1, "{kind}: one initial list");
    }
    assert_eq!(h.seen_services, BTreeSet::from(["demo/echo".to_string()]));
    assert_eq!(h.seen_slices, BTreeSet::from(["demo/echo-abc".to_string()]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn added_modified_deleted_events_are_followed() {
    let mut h = Harness::start(|_| {}).await;
    h.wait_until("empty maps after the empty lists", |m| m.is(&[]))
        .await;
    h.wait_watching().await;

    // ADDED: the service, then its slice.
    h.server.create(&echo_service());
    h.wait_until("frontend without backends", |m| m.is(&[(FE, &[])]))
        .await;
    h.server.create(&slice(
        NS,
        "echo-abc",
        "echo",
        8080,
        &[Ep::ready(B1), Ep::ready(B2)],
    ));
    h.wait_until("b1 and b2", |m| m.is(&[(FE, &[B1, B2])]))
        .await;

    // MODIFIED: b2 becomes not ready, then b3 is added.
    h.server.update(&slice(
        NS,
        "echo-abc",
        "echo",
        8080,
        &[Ep::ready(B1), Ep::not_ready(B2)],
    ));
    // Not ready: no new flows, but its slot stays for established ones (quarantined).
    let b2_kept = format!("{B2} quarantined");
    h.wait_until("b2 out of the active slots", |m| {
        m.is(&[(FE, &[B1, &b2_kept])])
    })
    .await;
    h.server.update(&slice(
        NS,
        "echo-abc",
        "echo",
        8080,
        &[Ep::ready(B1), Ep::not_ready(B2), Ep::ready(B3)],
    ));
    h.wait_until("b3 added", |m| m.is(&[(FE, &[B1, B3, &b2_kept])]))
        .await;

    // DELETED: the slice (frontend stays, no backends), then the service (all gone).
    h.server.delete_named(Kind::EndpointSlice, NS, "echo-abc");
    h.wait_until("frontend with 0 backends", |m| m.is(&[(FE, &[])]))
        .await;
    h.server.delete(&echo_service());
    let m = h
        .wait_until("frontend gone, backends collected", |m| m.is(&[]))
        .await;
    assert!(m.text.is_empty(), "nothing left in the maps:\n{}", m.text);
    let dump = &h.reconciler.maps().dump;
    assert!(
        dump.services.is_empty() && dump.backends.is_empty() && dump.revnat.is_empty(),
        "maps empty: {dump:?}"
    );

    // All of it came through the watches: no relist.
    for kind in Kind::ALL {
        assert_eq!(h.server.list_count(kind), 1, "{kind}: no relist");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bookmarks_change_nothing_and_break_nothing() {
    let mut h = Harness::start(|s| {
        s.create(&echo_service());
        s.create(&slice(NS, "echo-abc", "echo", 8080, &[Ep::ready(B1)]));
    })
    .await;
    h.wait_until("b1", |m| m.is(&[(FE, &[B1])])).await;
    h.wait_watching().await;
    let watches: Vec<usize> = Kind::ALL.iter().map(|k| h.server.watch_count(*k)).collect();

    // The watcher asked for bookmarks; a bookmark alone publishes nothing.
    assert!(
        h.server
            .requests()
            .iter()
            .filter(|r| r.watch)
            .all(|r| r.allow_bookmarks),
        "watches allow bookmarks: {:#?}",
        h.server.requests()
    );
    if h.rx.has_changed().unwrap_or(false) {
        let pending = h.rx.borrow_and_update().clone();
        if let Some(s) = pending {
            h.apply(&s);
        }
    }
    assert_eq!(h.server.bookmark(), 3, "one bookmark per open watch");
    assert_eq!(h.server.bookmark(), 3);
    assert!(
        !h.snapshot_within(Duration::from_millis(500)).await,
        "a bookmark is no change"
    );

    // Bookmarks interleaved with changes.
    h.server.update(&slice(
        NS,
        "echo-abc",
        "echo",
        8080,
        &[Ep::ready(B1), Ep::ready(B2)],
    ));
    h.server.bookmark();
    h.wait_until("b2 added", |m| m.is(&[(FE, &[B1, B2])])).await;
    h.server.bookmark();
    h.server.update(&slice(
        NS,
        "echo-abc",
        "echo",
        8080,
        &[Ep::ready(B2), Ep::ready(B3)],
    ));
    h.server.bookmark();
    h.wait_until("b1 replaced by b3", |m| m.is(&[(FE, &[B2, B3])]))
        .await;

    // Same watch connections all along, no relist.
    let after: Vec<usize> = Kind::ALL.iter().map(|k| h.server.watch_count(*k)).collect();
    assert_eq!(watches, after, "no reconnect");
    for kind in Kind::ALL {
        assert_eq!(h.server.list_count(kind), 1, "{kind}: no relist");
        assert_eq!(h.server.open_watches(kind), 1, "{kind}: watch still open");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gone_410_relists_and_misses_no_delete() {
    let mut h = Harness::start(|s| {
        s.create(&echo_service());
        s.create(&slice(NS, "echo-abc", "echo", 8080, &three_backends()));
        s.create(&service(NS, "other", "198.19.0.11", 80, 8080));
        s.create(&slice(NS, "other-abc", "other", 8080, &[Ep::ready(B1)]));
    })
    .await;
    h.wait_until("both frontends", |m| {
        m.is(&[(FE, &[B1, B2, B3]), ("198.19.0.11:80/TCP", &[B1])])
    })
    .await;
    h.wait_watching().await;
    let lists_before = h.server.list_count(Kind::Service);

    // History gone and the connections broken: the deletes below reach no open watch, and
    // resuming from any version the client knows is 410 Gone.
    h.server.compact();
    assert_eq!(h.server.drop_watches(), 3);
    h.server.delete(&echo_service());
    h.server.delete_named(Kind::EndpointSlice, NS, "echo-abc");

    let m = h
        .wait_until("echo gone after the relist", |m| {
            m.is(&[("198.19.0.11:80/TCP", &[B1])])
        })
        .await;
    assert!(
        h.server.list_count(Kind::Service) > lists_before,
        "the services were listed again"
    );
    for kind in Kind::ALL {
        assert!(
            h.server.gone_count(kind) >= 1,
            "{kind}: resuming the watch got 410 Gone: {:#?}",
            h.server.requests()
        );
    }
    assert!(m.problems.is_empty(), "b2, b3 collected:\n{}", m.text);

    // And the new watches work.
    h.wait_watching().await;
    h.server.create(&echo_service());
    h.server
        .create(&slice(NS, "echo-abc", "echo", 8080, &[Ep::ready(B2)]));
    h.wait_until("echo back after the relist", |m| {
        m.is(&[(FE, &[B2]), ("198.19.0.11:80/TCP", &[B1])])
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn error_event_410_on_open_watch_relists() {
    let mut h = Harness::start(|s| {
        s.create(&echo_service());
        s.create(&slice(NS, "echo-abc", "echo", 8080, &three_backends()));
    })
    .await;
    h.wait_until("b1..b3", |m| m.is(&[(FE, &[B1, B2, B3])]))
        .await;
    h.wait_watching().await;

    assert_eq!(h.server.expire_watches_with_410(), 3);
    let relisted = h
        .server
        .wait_for(WAIT, |s| Kind::ALL.iter().all(|k| s.list_count(*k) >= 2))
        .await;
    assert!(relisted, "every kind relisted: {:#?}", h.server.requests());
    h.wait_watching().await;
    h.server
        .update(&slice(NS, "echo-abc", "echo", 8080, &[Ep::ready(B3)]));
    h.wait_until("only b3 after the relist", |m| m.is(&[(FE, &[B3])]))
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_connection_reconnects_and_resumes() {
    let mut h = Harness::start(|s| {
        s.create(&echo_service());
        s.create(&slice(NS, "echo-abc", "echo", 8080, &[Ep::ready(B1)]));
    })
    .await;
    h.wait_until("b1", |m| m.is(&[(FE, &[B1])])).await;
    h.wait_watching().await;
    let watches = h.server.watch_count(Kind::EndpointSlice);

    assert_eq!(h.server.drop_watches(), 3);
    // A change while disconnected is replayed from the history on resume...
    h.server.update(&slice(
        NS,
        "echo-abc",
        "echo",
        8080,
        &[Ep::ready(B1), Ep::ready(B2)],
    ));
    h.wait_until("b2 added while disconnected", |m| m.is(&[(FE, &[B1, B2])]))
        .await;
    // ...and changes after the reconnect arrive on the new connection.
    let reconnected = h
        .server
        .wait_for(WAIT, |s| {
            s.watch_count(Kind::EndpointSlice) > watches && s.open_watches(Kind::EndpointSlice) > 0
        })
        .await;
    assert!(reconnected, "reconnected: {:#?}", h.server.requests());
    h.server.update(&slice(
        NS,
        "echo-abc",
        "echo",
        8080,
        &[Ep::ready(B2), Ep::ready(B3)],
    ));
    h.wait_until("b3 after the reconnect", |m| m.is(&[(FE, &[B2, B3])]))
        .await;
    for kind in Kind::ALL {
        assert_eq!(
            h.server.list_count(kind),
            1,
            "{kind}: resumed from its resourceVersion, no relist"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn label_selectors_keep_other_proxies_and_headless_slices_out() {
    let mut h = Harness::start(|s| {
        s.create(&echo_service());
        s.create(&slice(NS, "echo-abc", "echo", 8080, &[Ep::ready(B1)]));
        // Another proxy's service, and a headless slice naming echo.
        s.create(&labelled(
            &service(NS, "theirs", "198.19.0.11", 80, 8080),
            LABEL_SERVICE_PROXY_NAME,
            "other-proxy",
        ));
        s.create(&slice(NS, "theirs-abc", "theirs", 8080, &[Ep::ready(B3)]));
        s.create(&labelled(
            &slice(NS, "echo-headless", "echo", 8080, &[Ep::ready(B2)]),
            LABEL_HEADLESS,
            "",
        ));
    })
    .await;
    h.wait_until("only echo with b1", |m| m.is(&[(FE, &[B1])]))
        .await;
    h.wait_watching().await;

    // Filtered objects created while watching stay out too.
    h.server.create(&labelled(
        &service(NS, "theirs-too", "198.19.0.12", 80, 8080),
        LABEL_SERVICE_PROXY_NAME,
        "other-proxy",
    ));
    h.server.create(&labelled(
        &slice(NS, "echo-headless-2", "echo", 8080, &[Ep::ready(B3)]),
        LABEL_HEADLESS,
        "",
    ));
    // A marker change, so the filtered creations above had their chance to arrive first.
    h.server.update(&slice(
        NS,
        "echo-abc",
        "echo",
        8080,
        &[Ep::ready(B1), Ep::ready(B2)],
    ));
    h.wait_until("echo with b1, b2", |m| m.is(&[(FE, &[B1, B2])]))
        .await;

    // echo moves to another proxy: for the selector that is a DELETED event.
    h.server.update(&labelled(
        &echo_service(),
        LABEL_SERVICE_PROXY_NAME,
        "other-proxy",
    ));
    h.wait_until("echo gone once it carries the label", |m| m.is(&[]))
        .await;

    assert_eq!(
        h.seen_services,
        BTreeSet::from(["demo/echo".to_string()]),
        "labelled services never reach a snapshot"
    );
    assert_eq!(
        h.seen_slices,
        BTreeSet::from(["demo/echo-abc".to_string(), "demo/theirs-abc".to_string()]),
        "headless slices never reach a snapshot"
    );
    let requests = h.server.requests();
    let selector = |kind| {
        requests
            .iter()
            .filter(|r| r.kind == kind)
            .map(|r| r.label_selector.clone())
            .collect::<BTreeSet<_>>()
    };
    assert_eq!(
        selector(Kind::Service),
        BTreeSet::from([Some(format!("!{LABEL_SERVICE_PROXY_NAME}"))]),
        "every Service list and watch has the selector"
    );
    assert_eq!(
        selector(Kind::EndpointSlice),
        BTreeSet::from([Some(format!("!{LABEL_HEADLESS}"))]),
        "every EndpointSlice list and watch has the selector"
    );
    for kind in [Kind::Service, Kind::EndpointSlice] {
        assert!(
            requests.iter().any(|r| r.kind == kind && r.watch)
                && requests.iter().any(|r| r.kind == kind && !r.watch),
            "{kind}: listed and watched"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_zone_from_field_selected_node_picks_same_zone_endpoints() {
    let mut h = Harness::start(|s| {
        s.create(&echo_service());
        s.create(&slice(
            NS,
            "echo-abc",
            "echo",
            8080,
            &[
                Ep::in_zone(B1, "zone-a"),
                Ep::in_zone(B2, "zone-b"),
                Ep::in_zone(B3, "zone-a"),
            ],
        ));
    })
    .await;
    h.wait_until("no Node yet, no zone: all endpoints", |m| {
        m.is(&[(FE, &[B1, B2, B3])])
    })
    .await;
    h.wait_watching().await;

    // Another node in zone-b is not ours: the field selector keeps it out.
    h.server.create(&node("node-b", Some("zone-b")));
    h.server.create(&node(NODE, Some("zone-a")));
    h.wait_until("zone-a endpoints only", |m| m.is(&[(FE, &[B1, B3])]))
        .await;
    h.server.update(&node(NODE, Some("zone-b")));
    h.wait_until("zone-b endpoints only", |m| m.is(&[(FE, &[B2])]))
        .await;
    h.server.update(&node(NODE, None));
    h.wait_until("zone label gone: all endpoints", |m| {
        m.is(&[(FE, &[B1, B2, B3])])
    })
    .await;

    assert_eq!(
        h.seen_nodes,
        BTreeSet::from([NODE.to_string()]),
        "only this node reaches a snapshot"
    );
    let fields: BTreeSet<_> = h
        .server
        .requests()
        .iter()
        .filter(|r| r.kind == Kind::Node)
        .map(|r| r.field_selector.clone())
        .collect();
    assert_eq!(
        fields,
        BTreeSet::from([Some(format!("metadata.name={NODE}"))]),
        "every Node list and watch has the field selector"
    );
}

/// The fake server itself: paginated lists are consistent snapshots, and its selectors work
/// for kube's own requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fake_server_paginates_and_selects() {
    let server = ApiServer::start().await.unwrap();
    for i in 0..5u8 {
        let svc = service(NS, &format!("s{i}"), &format!("198.19.1.{i}"), 80, 8080);
        if i % 2 == 0 {
            server.create(&svc);
        } else {
            server.create(&labelled(&svc, LABEL_SERVICE_PROXY_NAME, "x"));
        }
    }
    let kubeconfig = server.kubeconfig_file().unwrap();
    let client = k8s::client(Some(kubeconfig.path())).await.unwrap();
    let api: Api<Service> = Api::all(client);

    let first = api.list(&ListParams::default().limit(2)).await.unwrap();
    let rv = first.metadata.resource_version.clone();
    let mut names: Vec<String> = first
        .items
        .iter()
        .map(|s| s.metadata.name.clone().unwrap())
        .collect();
    let mut token = first.metadata.continue_.clone();
    assert!(token.is_some(), "more pages");
    // A write between pages does not show up in the paginated list.
    server.delete_named(Kind::Service, NS, "s4");
    while let Some(t) = token.filter(|t| !t.is_empty()) {
        let page = api
            .list(&ListParams::default().limit(2).continue_token(&t))
            .await
            .unwrap();
        assert_eq!(page.metadata.resource_version, rv, "one snapshot");
        names.extend(page.items.iter().map(|s| s.metadata.name.clone().unwrap()));
        token = page.metadata.continue_.clone();
    }
    assert_eq!(names, ["s0", "s1", "s2", "s3", "s4"]);

    let selected = api
        .list(&ListParams::default().labels(&format!("!{LABEL_SERVICE_PROXY_NAME}")))
        .await
        .unwrap();
    let names: Vec<_> = selected
        .items
        .iter()
        .map(|s| s.metadata.name.clone().unwrap())
        .collect();
    assert_eq!(names, ["s0", "s2"]);
    let selected = api
        .list(&ListParams::default().labels(&format!("{LABEL_SERVICE_PROXY_NAME}=x")))
        .await
        .unwrap();
    assert_eq!(selected.items.len(), 2);
    let by_name = api
        .list(&ListParams::default().fields("metadata.name=s1"))
        .await
        .unwrap();
    assert_eq!(by_name.items.len(), 1);

    // An expired continue token is 410 Gone.
    server.compact();
    let err = api
        .list(&ListParams::default().continue_token("page-999"))
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("410") || err.to_string().contains("Expired"),
        "{err}"
    );
}

/// The server on its own thread and runtime (as the end-to-end test runs it in a netns): the
/// handle works from another runtime, and `apply` creates or replaces.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fake_server_on_its_own_thread() {
    let server = ApiServer::start_on_thread(None).unwrap();
    assert!(
        server
            .kubeconfig_yaml()
            .contains(&format!("http://{}", server.addr()))
    );
    let rv0 = server.resource_version();
    server.apply(&echo_service());
    server.apply(&labelled(&echo_service(), "app", "echo"));
    assert_eq!(server.resource_version(), rv0 + 2);

    let kubeconfig = server.kubeconfig_file().unwrap();
    let client = k8s::client(Some(kubeconfig.path())).await.unwrap();
    let api: Api<Service> = Api::all(client);
    let list = api.list(&ListParams::default()).await.unwrap();
    assert_eq!(list.items.len(), 1);
    let labels = list.items[0].metadata.labels.clone().unwrap_or_default();
    assert_eq!(labels.get("app").map(String::as_str), Some("echo"));
    assert_eq!(
        list.items[0].metadata.resource_version,
        Some((rv0 + 2).to_string())
    );
    assert_eq!(list.metadata.resource_version, Some((rv0 + 2).to_string()));
    // Stopping the thread (the guard's drop) must not hang.
    tokio::task::spawn_blocking(move || drop(server))
        .await
        .unwrap();
}

/// The series `series` (labels included, as exposed) in the metrics exposition.
fn metric(m: &Metrics, series: &str) -> f64 {
    let text = m.render();
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no {series} in:\n{text}"))
}

/// The server goes away entirely (listener closed, watches dropped) for many 1 s watch
/// timeouts while a Service is deleted, another's endpoints change and the history is
/// compacted. Meanwhile no snapshot is published (the maps keep the last state), health stays
/// healthy and reports the API server disconnected; once the server is back on its address
/// the resumed watches get 410, relist, and the maps hold exactly the new state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_gone_keeps_the_state_then_relist_removes_what_was_deleted() {
    let gone_fe = "198.19.0.11:80/TCP";
    let gone = service(NS, "gone", "198.19.0.11", 80, 8080);
    let gone_slice = slice(NS, "gone-1", "gone", 8080, &[Ep::ready(B1)]);
    let (g, gs) = (gone.clone(), gone_slice.clone());
    let mut h = Harness::start_as(
        move |s| {
            s.create(&echo_service());
            s.create(&slice(NS, "echo-1", "echo", 8080, &three_backends()));
            s.create(&g);
            s.create(&gs);
        },
        Some(Duration::from_secs(1)),
    )
    .await;
    h.wait_until("both services", |m| {
        m.is(&[(FE, &[B1, B2, B3]), (gone_fe, &[B1])])
    })
    .await;
    assert_eq!(h.metrics.api_server_connected(), Some(true));
    assert_eq!(metric(&h.metrics, "lb_apiserver_connected"), 1.0);
    // Snapshots already published (another watcher's first list may follow the one that
    // showed both services) are consumed first: only what comes while the server is away
    // counts below.
    while h.snapshot_within(Duration::from_millis(500)).await {}

    let server = h.server.clone();
    tokio::task::block_in_place(|| server.stop());
    assert!(!server.is_serving());
    h.server.delete(&gone);
    h.server.delete(&gone_slice);
    h.server
        .update(&slice(NS, "echo-1", "echo", 8080, &[Ep::ready(B3)]));
    h.server.compact();
    let deadline = tokio::time::Instant::now() + WAIT;
    while h.metrics.api_server_connected() != Some(false) {
        assert!(tokio::time::Instant::now() < deadline, "never disconnected");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Many watch timeouts without a snapshot: nothing is flushed.
    assert!(
        !h.snapshot_within(Duration::from_secs(8)).await,
        "no snapshot while the server is away"
    );
    let (healthy, body) = h.metrics.healthz();
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert!(healthy, "an outage alone keeps /healthz healthy: {v}");
    assert_eq!(v["apiServer"]["connected"], false, "{v}");
    assert!(v["apiServer"]["lastError"].is_string(), "{v}");
    assert_eq!(metric(&h.metrics, "lb_apiserver_connected"), 0.0);
    assert!(metric(&h.metrics, "lb_watch_errors_total{kind=\"services\"}") >= 1.0);
    assert_eq!(
        metric(&h.metrics, "lb_watch_relists_total{kind=\"services\"}"),
        0.0
    );

    tokio::task::block_in_place(|| server.restart()).expect("restart");
    assert!(server.is_serving());
    // kube-rs' backoff may have grown to several seconds.
    h.wait_until_within(Duration::from_secs(45), "exactly the new state", |m| {
        m.is(&[(FE, &[B3])])
    })
    .await;
    assert!(h.server.gone_count(Kind::Service) >= 1, "410 on resume");
    assert!(metric(&h.metrics, "lb_watch_relists_total{kind=\"services\"}") >= 1.0);
    assert_eq!(h.metrics.api_server_connected(), Some(true));
    let v: serde_json::Value = serde_json::from_str(&h.metrics.healthz().1).unwrap();
    assert_eq!(v["apiServer"]["connected"], true, "{v}");
    assert!(v["apiServer"]["lastContact"].is_string(), "{v}");
}
