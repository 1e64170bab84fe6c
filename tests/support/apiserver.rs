//! A local fake Kubernetes API server that speaks the real list/watch protocol for Services,
//! EndpointSlices and Nodes, so the kube-rs reflectors in `kube::k8s` can be tested without a
//! cluster.
//!
//! Behaviour against the real thing is tested in tests/k8s_real.rs (etcd + kube-apiserver +
//! the EndpointSlice controller). This fake stays for the faults and observations a real server
//! does not give deterministically, used by tests/k8s_watch.rs and tests/k8s_e2e.rs:
//!
//! * a BOOKMARK exactly when the test asks ([`ApiServer::bookmark`]);
//! * a `410 Expired` ERROR event on an already open watch
//!   ([`ApiServer::expire_watches_with_410`]), and history dropped at once
//!   ([`ApiServer::compact`]);
//! * every open watch connection dropped at a chosen moment ([`ApiServer::drop_watches`]);
//! * the whole server gone and back on the same address with its store and history kept
//!   ([`ApiServer::stop`], [`ApiServer::restart`]): listener closed (connections refused),
//!   watches dropped, keep-alive connections closed;
//! * lists, watches and 410s counted per kind (proving "no relist", "one initial list");
//! * small pages (`limit`/`continue`) over a consistent snapshot;
//! * starting in a netns in this process, in milliseconds (the netns end-to-end test).
//!
//! * Plain HTTP on `127.0.0.1:<ephemeral>`, no authentication; [`ApiServer::kubeconfig_file`]
//!   writes a kubeconfig pointing at it.
//! * `GET /api/v1/services`, `/apis/discovery.k8s.io/v1/endpointslices`, `/api/v1/nodes` (and
//!   the namespaced `/…/namespaces/<ns>/<resource>` forms) list with `labelSelector` (`key`,
//!   `!key`, `key=value`, `key==value`, `key!=value`), `fieldSelector` (`metadata.name`,
//!   `metadata.namespace`, `=`/`==`/`!=`) and `limit`/`continue` pagination (pages are
//!   consistent snapshots taken at the first page's resourceVersion).
//! * The same paths with `watch=true` stream newline-delimited JSON watch events (chunked) from
//!   `resourceVersion` on: ADDED / MODIFIED / DELETED as the real watch cache computes them
//!   against the selector (an object that stops matching is DELETED, one that starts matching
//!   ADDED), BOOKMARK when [`ApiServer::bookmark`] is called and the client allowed bookmarks.
//!   A resourceVersion older than the retained history gets a `{"type":"ERROR"}` event with a
//!   `410 Expired` Status, as the real apiserver sends for watches. `resourceVersion` unset or
//!   `0` starts with synthetic ADDED events for everything that matches. `timeoutSeconds`
//!   ends the stream cleanly.
//! * One global, monotonically increasing resourceVersion, stamped on every written object.
//!
//! The control handle ([`ApiServer`]) is synchronous and can be used from any thread; the
//! server itself runs on a tokio runtime: the caller's ([`ApiServer::start`]) or a dedicated
//! thread, optionally inside a network namespace ([`ApiServer::start_on_thread`]).
use std::{
    collections::{BTreeMap, HashMap},
    fmt,
    net::{Ipv4Addr, SocketAddr},
    path::{Path, PathBuf},
    sync::{Arc, Mutex, MutexGuard, PoisonError},
    time::Duration,
};

use anyhow::Context as _;
use axum::{
    Router,
    body::{Body, Bytes},
    extract::{Request, State},
    http::{Method, StatusCode, header},
    response::Response,
};
use serde::Serialize;
use serde_json::{Value, json};
use tokio::sync::mpsc;

/// The resource kinds the fake server serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    Service,
    EndpointSlice,
    Node,
}

impl Kind {
    pub const ALL: [Kind; 3] = [Kind::Service, Kind::EndpointSlice, Kind::Node];

    /// The object `kind`.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Service => "Service",
            Kind::EndpointSlice => "EndpointSlice",
            Kind::Node => "Node",
        }
    }

    pub fn api_version(self) -> &'static str {
        match self {
            Kind::Service | Kind::Node => "v1",
            Kind::EndpointSlice => "discovery.k8s.io/v1",
        }
    }

    /// The path prefix of the API group version.
    fn group_path(self) -> &'static str {
        match self {
            Kind::Service | Kind::Node => "/api/v1",
            Kind::EndpointSlice => "/apis/discovery.k8s.io/v1",
        }
    }

    /// The plural resource name in URLs.
    pub fn resource(self) -> &'static str {
        match self {
            Kind::Service => "services",
            Kind::EndpointSlice => "endpointslices",
            Kind::Node => "nodes",
        }
    }

    pub fn namespaced(self) -> bool {
        !matches!(self, Kind::Node)
    }

    fn from_name(kind: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.name() == kind)
    }

    /// `(kind, namespace)` of a request path, if it is a collection this server serves.
    fn from_path(path: &str) -> Option<(Kind, Option<String>)> {
        let path = path.trim_end_matches('/');
        for kind in Kind::ALL {
            let Some(rest) = path
                .strip_prefix(kind.group_path())
                .and_then(|r| r.strip_prefix('/'))
            else {
                continue;
            };
            if rest == kind.resource() {
                return Some((kind, None));
            }
            if kind.namespaced()
                && let Some(rest) = rest.strip_prefix("namespaces/")
                && let Some((ns, resource)) = rest.split_once('/')
                && resource == kind.resource()
                && !ns.is_empty()
            {
                return Some((kind, Some(ns.to_string())));
            }
        }
        None
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One request the server answered, for assertions on what the client asked for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestRecord {
    pub kind: Kind,
    pub namespace: Option<String>,
    pub watch: bool,
    pub label_selector: Option<String>,
    pub field_selector: Option<String>,
    pub resource_version: Option<String>,
    pub limit: Option<usize>,
    pub continue_token: Option<String>,
    pub allow_bookmarks: bool,
    pub timeout_seconds: Option<u64>,
}

// ---------------------------------------------------------------------------------------------
// Selectors

#[derive(Clone, Debug)]
enum LabelReq {
    Exists(String),
    NotExists(String),
    Equals(String, String),
    NotEquals(String, String),
}

#[derive(Clone, Debug)]
enum FieldReq {
    Equals(String, String),
    NotEquals(String, String),
}

#[derive(Clone, Debug, Default)]
struct Selector {
    namespace: Option<String>,
    labels: Vec<LabelReq>,
    fields: Vec<FieldReq>,
}

impl Selector {
    fn parse(
        namespace: Option<String>,
        labels: Option<&str>,
        fields: Option<&str>,
    ) -> Result<Self, String> {
        let mut sel = Selector {
            namespace,
            ..Selector::default()
        };
        for req in labels.unwrap_or("").split(',').map(str::trim) {
            if req.is_empty() {
                continue;
            }
            if req.contains('(') || req.contains(' ') {
                return Err(format!("unsupported label selector requirement {req:?}"));
            }
            let parsed = if let Some((k, v)) = req.split_once("!=") {
                LabelReq::NotEquals(k.into(), v.into())
            } else if let Some((k, v)) = req.split_once("==") {
                LabelReq::Equals(k.into(), v.into())
            } else if let Some((k, v)) = req.split_once('=') {
                LabelReq::Equals(k.into(), v.into())
            } else if let Some(k) = req.strip_prefix('!') {
                LabelReq::NotExists(k.into())
            } else {
                LabelReq::Exists(req.into())
            };
            sel.labels.push(parsed);
        }
        for req in fields.unwrap_or("").split(',').map(str::trim) {
            if req.is_empty() {
                continue;
            }
            let parsed = if let Some((k, v)) = req.split_once("!=") {
                FieldReq::NotEquals(k.into(), v.into())
            } else if let Some((k, v)) = req.split_once("==") {
                FieldReq::Equals(k.into(), v.into())
            } else if let Some((k, v)) = req.split_once('=') {
                FieldReq::Equals(k.into(), v.into())
            } else {
                return Err(format!("invalid field selector requirement {req:?}"));
            };
            let (FieldReq::Equals(k, _) | FieldReq::NotEquals(k, _)) = &parsed;
            if k != "metadata.name" && k != "metadata.namespace" {
                return Err(format!("field label not supported: {k}"));
            }
            sel.fields.push(parsed);
        }
        Ok(sel)
    }

    fn matches(&self, obj: &Value) -> bool {
        let meta = &obj["metadata"];
        let ns = meta["namespace"].as_str().unwrap_or("");
        if self.namespace.as_deref().is_some_and(|want| want != ns) {
            return false;
        }
        let label = |k: &str| meta["labels"].get(k).and_then(Value::as_str);
        let labels_ok = self.labels.iter().all(|r| match r {
            LabelReq::Exists(k) => label(k).is_some(),
            LabelReq::NotExists(k) => label(k).is_none(),
            LabelReq::Equals(k, v) => label(k) == Some(v.as_str()),
            LabelReq::NotEquals(k, v) => label(k) != Some(v.as_str()),
        });
        let field = |k: &str| {
            let f = if k == "metadata.name" {
                "name"
            } else {
                "namespace"
            };
            meta[f].as_str().unwrap_or("").to_string()
        };
        let fields_ok = self.fields.iter().all(|r| match r {
            FieldReq::Equals(k, v) => field(k) == *v,
            FieldReq::NotEquals(k, v) => field(k) != *v,
        });
        labels_ok && fields_ok
    }
}

// ---------------------------------------------------------------------------------------------
// State

/// What a watch response stream is sent.
enum Frame {
    /// One JSON watch event (with its trailing newline).
    Line(String),
    /// Close the connection abruptly: no terminating chunk, the client sees a broken body.
    Abort,
    /// End the response cleanly (as the apiserver does after an ERROR event or a timeout).
    End,
}

struct Watcher {
    kind: Kind,
    selector: Selector,
    bookmarks: bool,
    tx: mpsc::UnboundedSender<Frame>,
}

/// One write, kept in the history watches resume from.
struct Change {
    rv: u64,
    kind: Kind,
    /// The object before the write (`None` for a create).
    before: Option<Value>,
    /// The object as written; for a delete, the last state stamped with the deletion's rv.
    after: Value,
    deleted: bool,
}

type Key = (Kind, String, String);

#[derive(Default)]
struct Inner {
    rv: u64,
    /// Watches from a resourceVersion at or below this get 410 Gone.
    compacted: u64,
    objects: BTreeMap<Key, Value>,
    history: Vec<Change>,
    watchers: Vec<Watcher>,
    next_uid: u64,
    /// Remaining pages of paginated lists: token → (resourceVersion, items).
    continues: HashMap<String, (u64, Vec<Value>)>,
    next_continue: u64,
    lists: BTreeMap<Kind, usize>,
    watches: BTreeMap<Kind, usize>,
    /// Watches ended with a 410 ERROR event (on resume or by the test).
    gone: BTreeMap<Kind, usize>,
    requests: Vec<RequestRecord>,
    /// Between [`ApiServer::stop`] and [`ApiServer::restart`]: a request that raced the
    /// shutdown on a kept-alive connection is refused with 503.
    down: bool,
}

fn event_line(type_: &str, object: &Value) -> String {
    let mut line = json!({ "type": type_, "object": object }).to_string();
    line.push('\n');
    line
}

fn expired_status(message: &str) -> Value {
    json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": "Expired",
        "code": 410,
    })
}

fn with_rv(obj: &Value, rv: u64) -> Value {
    let mut obj = obj.clone();
    obj["metadata"]["resourceVersion"] = Value::String(rv.to_string());
    obj
}

impl Inner {
    /// The watch event a watcher with `selector` sees for `change`, if any.
    fn event_for(selector: &Selector, change: &Change) -> Option<String> {
        let before = change.before.as_ref().is_some_and(|b| selector.matches(b));
        let after = !change.deleted && selector.matches(&change.after);
        match (before, after) {
            (false, true) => Some(event_line("ADDED", &change.after)),
            (true, true) => Some(event_line("MODIFIED", &change.after)),
            (true, false) => {
                // Deleted, or no longer matching the selector: the previous object, stamped
                // with this change's resourceVersion (as the watch cache does).
                let gone = if change.deleted {
                    change.after.clone()
                } else {
                    with_rv(change.before.as_ref()?, change.rv)
                };
                Some(event_line("DELETED", &gone))
            }
            (false, false) => None,
        }
    }

    fn record(&mut self, change: Change) {
        let mut keep = Vec::with_capacity(self.watchers.len());
        for w in self.watchers.drain(..) {
            if w.kind == change.kind
                && let Some(line) = Self::event_for(&w.selector, &change)
                && w.tx.send(Frame::Line(line)).is_err()
            {
                continue;
            }
            if !w.tx.is_closed() {
                keep.push(w);
            }
        }
        self.watchers = keep;
        self.history.push(change);
    }

    fn write(&mut self, obj: Value, mode: WriteMode) -> Result<u64, String> {
        let kind_name = obj["kind"].as_str().unwrap_or_default().to_string();
        let kind =
            Kind::from_name(&kind_name).ok_or_else(|| format!("unsupported kind {kind_name:?}"))?;
        let mut obj = obj;
        if obj["apiVersion"].as_str().is_none() {
            obj["apiVersion"] = Value::String(kind.api_version().into());
        }
        if !obj["metadata"].is_object() {
            obj["metadata"] = json!({});
        }
        let name = obj["metadata"]["name"]
            .as_str()
            .filter(|n| !n.is_empty())
            .ok_or("metadata.name is required")?
            .to_string();
        let namespace = if kind.namespaced() {
            let ns = obj["metadata"]["namespace"]
                .as_str()
                .filter(|n| !n.is_empty())
                .unwrap_or("default")
                .to_string();
            obj["metadata"]["namespace"] = Value::String(ns.clone());
            ns
        } else {
            if let Some(m) = obj["metadata"].as_object_mut() {
                m.remove("namespace");
            }
            String::new()
        };
        let key = (kind, namespace, name);
        let before = self.objects.get(&key).cloned();
        match (mode, &before) {
            (WriteMode::Create, Some(_)) => return Err(format!("{key:?} already exists")),
            (WriteMode::Update | WriteMode::Delete, None) => {
                return Err(format!("{key:?} not found"));
            }
            _ => {}
        }
        self.rv += 1;
        let rv = self.rv;
        if mode == WriteMode::Delete {
            let gone = with_rv(before.as_ref().unwrap_or(&obj), rv);
            self.objects.remove(&key);
            self.record(Change {
                rv,
                kind,
                before,
                after: gone,
                deleted: true,
            });
            return Ok(rv);
        }
        let uid = match before.as_ref().and_then(|b| b["metadata"]["uid"].as_str()) {
            Some(uid) => uid.to_string(),
            None => {
                self.next_uid += 1;
                format!("00000000-0000-4000-8000-{:012x}", self.next_uid)
            }
        };
        obj["metadata"]["uid"] = Value::String(uid);
        let obj = with_rv(&obj, rv);
        self.objects.insert(key, obj.clone());
        self.record(Change {
            rv,
            kind,
            before,
            after: obj,
            deleted: false,
        });
        Ok(rv)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum WriteMode {
    Create,
    Update,
    Apply,
    Delete,
}

struct Shared {
    addr: SocketAddr,
    inner: Mutex<Inner>,
    /// The runtime the server runs on, where [`ApiServer::restart`] binds again (in the netns
    /// the server was started in).
    runtime: tokio::runtime::Handle,
    /// The running HTTP server; `None` while stopped.
    serving: Mutex<Option<Serving>>,
}

/// A running HTTP server: a graceful-shutdown trigger and a signal when it has ended.
struct Serving {
    stop: tokio::sync::oneshot::Sender<()>,
    done: std::sync::mpsc::Receiver<()>,
}

/// Serves `listener` on the current runtime until the returned [`Serving`] is stopped.
fn serve(shared: &Arc<Shared>, listener: tokio::net::TcpListener) -> Serving {
    let (stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let (done_tx, done) = std::sync::mpsc::channel();
    let app = Router::new().fallback(handle).with_state(shared.clone());
    tokio::spawn(async move {
        let shutdown = async {
            let _ = stop_rx.await;
        };
        // On shutdown axum drops the listener at once (new connections are refused) and
        // closes idle keep-alive connections; the test's watches are aborted separately.
        if let Err(e) = axum::serve(listener, app)
            .with_graceful_shutdown(shutdown)
            .await
        {
            eprintln!("fake API server: {e}");
        }
        let _ = done_tx.send(());
    });
    Serving { stop, done }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

// ---------------------------------------------------------------------------------------------
// The control handle

/// The control handle of a running fake API server. Cheap to clone; every method is
/// synchronous and may be called from any thread.
#[derive(Clone)]
pub struct ApiServer {
    shared: Arc<Shared>,
}

impl ApiServer {
    /// Binds `127.0.0.1:0` and serves on the current tokio runtime until the runtime ends.
    pub async fn start() -> anyhow::Result<ApiServer> {
        let listener = tokio::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .await
            .context("bind the fake API server")?;
        let shared = Arc::new(Shared {
            addr: listener.local_addr()?,
            inner: Mutex::new(Inner::default()),
            runtime: tokio::runtime::Handle::current(),
            serving: Mutex::new(None),
        });
        let serving = serve(&shared, listener);
        *shared
            .serving
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(serving);
        Ok(ApiServer { shared })
    }

    /// Takes the whole server away, keeping its store and history: the listener closes (new
    /// connections are refused), every watch is dropped abruptly and keep-alive connections
    /// are closed. Returns once the HTTP server has ended. Blocks: call it from a thread that
    /// is not driving the server's runtime (servers from [`ApiServer::start_on_thread`]).
    pub fn stop(&self) {
        let serving = self
            .shared
            .serving
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let Some(serving) = serving else { return };
        self.shared.lock().down = true;
        let _ = serving.stop.send(());
        // After the trigger, so a watch that raced it cannot keep the shutdown waiting.
        self.drop_watches();
        let _ = serving.done.recv_timeout(Duration::from_secs(10));
    }

    /// Serves again on the same address (and netns) after [`ApiServer::stop`], with the store
    /// as the test left it. Blocks like [`ApiServer::stop`].
    pub fn restart(&self) -> anyhow::Result<()> {
        let mut serving = self
            .shared
            .serving
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if serving.is_some() {
            return Ok(());
        }
        let shared = self.shared.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        self.shared.runtime.spawn(async move {
            // SO_REUSEADDR (tokio sets it): the old connections' TIME_WAIT does not block this.
            let bound = tokio::net::TcpListener::bind(shared.addr).await;
            let _ = tx.send(bound.map(|l| serve(&shared, l)));
        });
        let started = rx
            .recv_timeout(Duration::from_secs(10))
            .context("the fake API server's runtime did not answer")?
            .with_context(|| format!("bind {} again", self.shared.addr))?;
        *serving = Some(started);
        self.shared.lock().down = false;
        Ok(())
    }

    /// Whether the server is serving (not between [`ApiServer::stop`] and
    /// [`ApiServer::restart`]).
    pub fn is_serving(&self) -> bool {
        self.shared
            .serving
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some()
    }

    /// Starts the server on a dedicated thread with its own runtime. With `netns` (a path such
    /// as `/run/netns/<name>`), the thread first enters that network namespace, so the server
    /// listens on `127.0.0.1` inside it. Stopped when the returned guard drops.
    pub fn start_on_thread(netns: Option<&Path>) -> anyhow::Result<ApiServerThread> {
        let netns = netns
            .map(|p| std::fs::File::open(p).with_context(|| format!("open {}", p.display())))
            .transpose()?;
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("fake-apiserver".into())
            .spawn(move || {
                let started = (|| -> anyhow::Result<_> {
                    if let Some(ns) = &netns {
                        nix::sched::setns(ns, nix::sched::CloneFlags::CLONE_NEWNET)
                            .context("setns into the netns")?;
                    }
                    let rt = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .context("tokio runtime")?;
                    let server = rt.block_on(ApiServer::start())?;
                    Ok((rt, server))
                })();
                match started {
                    Ok((rt, server)) => {
                        let _ = ready_tx.send(Ok(server));
                        // Serve until stopped (or the guard is gone); dropping the runtime
                        // closes every connection.
                        let _ = rt.block_on(stop_rx);
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                    }
                }
            })
            .context("spawn the fake API server thread")?;
        let server = ready_rx
            .recv()
            .context("the fake API server thread died")??;
        Ok(ApiServerThread {
            server,
            stop: Some(stop_tx),
            thread: Some(thread),
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.shared.addr
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.shared.addr)
    }

    /// A kubeconfig pointing at this server, no authentication.
    pub fn kubeconfig_yaml(&self) -> String {
        format!(
            "apiVersion: v1\n\
             kind: Config\n\
             clusters:\n\
             - name: fake\n  cluster:\n    server: {}\n\
             contexts:\n\
             - name: fake\n  context:\n    cluster: fake\n    user: fake\n\
             current-context: fake\n\
             users:\n\
             - name: fake\n  user: {{}}\n",
            self.url()
        )
    }

    /// Writes [`ApiServer::kubeconfig_yaml`] to a fresh file in the temp dir, removed when the
    /// returned guard drops.
    pub fn kubeconfig_file(&self) -> anyhow::Result<KubeconfigFile> {
        let path = std::env::temp_dir().join(format!(
            "lb-test-kubeconfig-{}-{}.yaml",
            std::process::id(),
            self.shared.addr.port()
        ));
        std::fs::write(&path, self.kubeconfig_yaml())
            .with_context(|| format!("write {}", path.display()))?;
        Ok(KubeconfigFile(path))
    }

    fn write(&self, obj: &impl Serialize, mode: WriteMode) -> u64 {
        let value = serde_json::to_value(obj).expect("serialize the object");
        let result = self.shared.lock().write(value, mode);
        result.unwrap_or_else(|e| panic!("fake API server {mode:?}: {e}"))
    }

    /// Creates `obj` (its `kind` must be Service, EndpointSlice or Node; a missing namespace
    /// is `default`) and returns the new resourceVersion. Panics if it exists.
    pub fn create(&self, obj: &impl Serialize) -> u64 {
        self.write(obj, WriteMode::Create)
    }

    /// Replaces the existing object with `obj`. Panics if it does not exist.
    pub fn update(&self, obj: &impl Serialize) -> u64 {
        self.write(obj, WriteMode::Update)
    }

    /// Creates or replaces `obj`.
    pub fn apply(&self, obj: &impl Serialize) -> u64 {
        self.write(obj, WriteMode::Apply)
    }

    /// Deletes the object with `obj`'s kind, namespace and name. Panics if it does not exist.
    pub fn delete(&self, obj: &impl Serialize) -> u64 {
        self.write(obj, WriteMode::Delete)
    }

    /// Deletes `kind` `namespace/name` (namespace ignored for cluster-scoped kinds).
    pub fn delete_named(&self, kind: Kind, namespace: &str, name: &str) -> u64 {
        let obj = json!({
            "kind": kind.name(),
            "apiVersion": kind.api_version(),
            "metadata": { "name": name, "namespace": namespace },
        });
        self.write(&obj, WriteMode::Delete)
    }

    /// Sends a BOOKMARK at the current resourceVersion on every open watch that allows them.
    /// Returns how many watches got one.
    pub fn bookmark(&self) -> usize {
        let mut inner = self.shared.lock();
        let rv = inner.rv.to_string();
        let mut sent = 0;
        inner.watchers.retain(|w| {
            if !w.bookmarks {
                return !w.tx.is_closed();
            }
            let bm = json!({
                "kind": w.kind.name(),
                "apiVersion": w.kind.api_version(),
                "metadata": { "resourceVersion": rv },
            });
            let ok = w.tx.send(Frame::Line(event_line("BOOKMARK", &bm))).is_ok();
            sent += usize::from(ok);
            ok
        });
        sent
    }

    /// Drops the history: every resourceVersion issued so far becomes too old to resume a
    /// watch from (410 Expired), and pending list continuations expire. The server moves to a
    /// fresh resourceVersion, so a relist can watch again.
    pub fn compact(&self) {
        let mut inner = self.shared.lock();
        inner.compacted = inner.rv;
        inner.rv += 1;
        inner.history.clear();
        inner.continues.clear();
    }

    /// Closes every open watch connection abruptly (no terminating chunk). Returns how many.
    pub fn drop_watches(&self) -> usize {
        let mut inner = self.shared.lock();
        let n = inner.watchers.len();
        for w in inner.watchers.drain(..) {
            let _ = w.tx.send(Frame::Abort);
        }
        n
    }

    /// Sends the `410 Expired` ERROR event on every open watch and ends them. Returns how many.
    pub fn expire_watches_with_410(&self) -> usize {
        let mut inner = self.shared.lock();
        let n = inner.watchers.len();
        let line = event_line(
            "ERROR",
            &expired_status("too old resource version: expired by the test"),
        );
        let watchers: Vec<Watcher> = inner.watchers.drain(..).collect();
        for w in watchers {
            *inner.gone.entry(w.kind).or_default() += 1;
            let _ = w.tx.send(Frame::Line(line.clone()));
            let _ = w.tx.send(Frame::End);
        }
        n
    }

    /// The current (newest issued) resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.shared.lock().rv
    }

    /// List requests served for `kind` (every page counts).
    pub fn list_count(&self, kind: Kind) -> usize {
        self.shared.lock().lists.get(&kind).copied().unwrap_or(0)
    }

    /// Watch requests served for `kind`.
    pub fn watch_count(&self, kind: Kind) -> usize {
        self.shared.lock().watches.get(&kind).copied().unwrap_or(0)
    }

    /// Watches of `kind` ended with a 410 ERROR event: resumed from a compacted
    /// resourceVersion, or expired by [`ApiServer::expire_watches_with_410`].
    pub fn gone_count(&self, kind: Kind) -> usize {
        self.shared.lock().gone.get(&kind).copied().unwrap_or(0)
    }

    /// Watches of `kind` that are open now.
    pub fn open_watches(&self, kind: Kind) -> usize {
        let mut inner = self.shared.lock();
        inner.watchers.retain(|w| !w.tx.is_closed());
        inner.watchers.iter().filter(|w| w.kind == kind).count()
    }

    /// Every request served so far, oldest first.
    pub fn requests(&self) -> Vec<RequestRecord> {
        self.shared.lock().requests.clone()
    }

    /// Waits until `pred(self)` holds, polling every 10 ms; false on timeout.
    pub async fn wait_for(&self, timeout: Duration, pred: impl Fn(&ApiServer) -> bool) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if pred(self) {
                return true;
            }
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// A server started with [`ApiServer::start_on_thread`]; derefs to its [`ApiServer`]. Dropping
/// it stops the runtime (closing every connection) and joins the thread.
pub struct ApiServerThread {
    server: ApiServer,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl std::ops::Deref for ApiServerThread {
    type Target = ApiServer;

    fn deref(&self) -> &ApiServer {
        &self.server
    }
}

impl Drop for ApiServerThread {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A kubeconfig file, removed on drop.
pub struct KubeconfigFile(PathBuf);

impl KubeconfigFile {
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for KubeconfigFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

// ---------------------------------------------------------------------------------------------
// HTTP

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("");
                match u8::from_str_radix(hex, 16) {
                    Ok(b) => {
                        out.push(b);
                        i += 3;
                        continue;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn query_params(query: Option<&str>) -> HashMap<String, String> {
    query
        .unwrap_or("")
        .split('&')
        .filter(|kv| !kv.is_empty())
        .map(|kv| {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

fn json_response(status: StatusCode, body: &Value) -> Response {
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body.to_string()))
        .unwrap_or_default()
}

fn status_response(status: StatusCode, reason: &str, message: &str) -> Response {
    json_response(
        status,
        &json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": message,
            "reason": reason,
            "code": status.as_u16(),
        }),
    )
}

async fn handle(State(shared): State<Arc<Shared>>, req: Request) -> Response {
    if req.method() != Method::GET {
        return status_response(
            StatusCode::METHOD_NOT_ALLOWED,
            "MethodNotAllowed",
            "the fake API server only serves GET",
        );
    }
    let Some((kind, namespace)) = Kind::from_path(req.uri().path()) else {
        return status_response(
            StatusCode::NOT_FOUND,
            "NotFound",
            &format!("the server could not find {}", req.uri().path()),
        );
    };
    let q = query_params(req.uri().query());
    let nonempty = |k: &str| q.get(k).filter(|v| !v.is_empty()).cloned();
    let record = RequestRecord {
        kind,
        namespace: namespace.clone(),
        watch: matches!(q.get("watch").map(String::as_str), Some("true" | "1")),
        label_selector: nonempty("labelSelector"),
        field_selector: nonempty("fieldSelector"),
        resource_version: nonempty("resourceVersion"),
        limit: nonempty("limit").and_then(|l| l.parse().ok()),
        continue_token: nonempty("continue"),
        allow_bookmarks: q.get("allowWatchBookmarks").map(String::as_str) == Some("true"),
        timeout_seconds: nonempty("timeoutSeconds").and_then(|t| t.parse().ok()),
    };
    let selector = match Selector::parse(
        namespace,
        record.label_selector.as_deref(),
        record.field_selector.as_deref(),
    ) {
        Ok(s) => s,
        Err(e) => return status_response(StatusCode::BAD_REQUEST, "BadRequest", &e),
    };
    let mut inner = shared.lock();
    if inner.down {
        return status_response(
            StatusCode::SERVICE_UNAVAILABLE,
            "ServiceUnavailable",
            "the fake API server is stopped",
        );
    }
    inner.requests.push(record.clone());
    if record.watch {
        *inner.watches.entry(kind).or_default() += 1;
        watch(&mut inner, kind, selector, &record)
    } else {
        *inner.lists.entry(kind).or_default() += 1;
        list(&mut inner, kind, &selector, &record)
    }
}

fn list(inner: &mut Inner, kind: Kind, selector: &Selector, record: &RequestRecord) -> Response {
    let (rv, items) = match &record.continue_token {
        Some(token) => match inner.continues.remove(token) {
            Some(page) => page,
            None => {
                return status_response(
                    StatusCode::GONE,
                    "Expired",
                    "the provided continue parameter is too old",
                );
            }
        },
        None => {
            let items: Vec<Value> = inner
                .objects
                .iter()
                .filter(|((k, _, _), obj)| *k == kind && selector.matches(obj))
                .map(|(_, obj)| obj.clone())
                .collect();
            (inner.rv, items)
        }
    };
    let mut items = items;
    let mut metadata = json!({ "resourceVersion": rv.to_string() });
    if let Some(limit) = record.limit.filter(|l| *l > 0 && *l < items.len()) {
        let rest = items.split_off(limit);
        inner.next_continue += 1;
        let token = format!("page-{}", inner.next_continue);
        metadata["continue"] = Value::String(token.clone());
        metadata["remainingItemCount"] = Value::from(rest.len());
        inner.continues.insert(token, (rv, rest));
    }
    json_response(
        StatusCode::OK,
        &json!({
            "kind": format!("{}List", kind.name()),
            "apiVersion": kind.api_version(),
            "metadata": metadata,
            "items": items,
        }),
    )
}

fn watch(inner: &mut Inner, kind: Kind, selector: Selector, record: &RequestRecord) -> Response {
    let (tx, rx) = mpsc::unbounded_channel();
    let from = record.resource_version.as_deref().unwrap_or("0");
    let mut expired = false;
    match from.parse::<u64>() {
        Ok(0) => {
            // "Any": the current state as ADDED events, then changes.
            for ((k, _, _), obj) in &inner.objects {
                if *k == kind && selector.matches(obj) {
                    let _ = tx.send(Frame::Line(event_line("ADDED", obj)));
                }
            }
        }
        Ok(rv) if rv > inner.compacted => {
            for change in inner.history.iter().filter(|c| c.rv > rv && c.kind == kind) {
                if let Some(line) = Inner::event_for(&selector, change) {
                    let _ = tx.send(Frame::Line(line));
                }
            }
        }
        Ok(rv) => {
            let status = expired_status(&format!(
                "too old resource version: {rv} ({})",
                inner.compacted + 1
            ));
            let _ = tx.send(Frame::Line(event_line("ERROR", &status)));
            let _ = tx.send(Frame::End);
            *inner.gone.entry(kind).or_default() += 1;
            expired = true;
        }
        Err(_) => {
            return status_response(
                StatusCode::BAD_REQUEST,
                "BadRequest",
                &format!("invalid resourceVersion {from:?}"),
            );
        }
    }
    if !expired {
        inner.watchers.push(Watcher {
            kind,
            selector,
            bookmarks: record.allow_bookmarks,
            tx,
        });
    }
    let timeout = Duration::from_secs(record.timeout_seconds.unwrap_or(1800));
    let deadline = tokio::time::Instant::now() + timeout;
    let body = futures::stream::unfold(Some(rx), move |rx| async move {
        let mut rx = rx?;
        match tokio::time::timeout_at(deadline, rx.recv()).await {
            Ok(Some(Frame::Line(line))) => Some((Ok(Bytes::from(line)), Some(rx))),
            Ok(Some(Frame::Abort)) => Some((
                Err(std::io::Error::new(
                    std::io::ErrorKind::ConnectionAborted,
                    "watch dropped by the test",
                )),
                None,
            )),
            Ok(Some(Frame::End) | None) | Err(_) => None,
        }
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from_stream(body))
        .unwrap_or_default()
}
