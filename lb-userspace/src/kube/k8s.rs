//! The Kubernetes API source: reflectors on Services, EndpointSlices (never v1 Endpoints) and
//! this node's Node, with the label selectors kube-proxy's informers use. Once all three have
//! listed, every change publishes a snapshot of the stores.
//!
//! Losing the API server changes nothing in the datapath: while lists and watches fail, the
//! watchers retry with kube-rs' default backoff (0.8 s doubling to 30 s) and no snapshot is
//! published, so the maps keep the last state. A watch resumed from its resourceVersion gets
//! what it missed (deletions included) as events; one answered 410 Gone relists, and the
//! reflector swaps its whole store at the end of the relist, so objects deleted during the
//! outage leave the next snapshot. What lb knows of the server goes to `Metrics`
//! (`/healthz`'s `apiServer`, `lb_apiserver_connected`, `lb_watch_*_total`).
use std::{
    path::Path,
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::Context as _;
use futures::{FutureExt as _, StreamExt as _, stream};
use k8s_openapi::{
    api::{
        core::v1::{Node, Service},
        discovery::v1::EndpointSlice,
    },
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};

use super::slim;
use kube::{
    Api, Client, Config,
    client::ClientBuilder,
    config::{KubeConfigOptions, Kubeconfig},
    runtime::{WatchStreamExt as _, reflector, watcher},
};

use super::{
    LABEL_HEADLESS, LABEL_SERVICE_PROXY_NAME,
    source::{Snapshot, SnapshotSender},
};

/// A Service as lb's watch decodes it: without `status.conditions`, which lb never reads and
/// which the API server stores unvalidated. A condition written without `lastTransitionTime`
/// (Kubernetes' own e2e "service status lifecycle" writes one) comes back as
/// `"lastTransitionTime": null`, which k8s-openapi's `Condition` refuses; decoded as a plain
/// `Service`, that one object would fail every list and watch event of all Services.
#[derive(Clone, Debug)]
pub struct WatchedService(pub Service);

impl k8s_openapi::Resource for WatchedService {
    const API_VERSION: &'static str = Service::API_VERSION;
    const GROUP: &'static str = Service::GROUP;
    const KIND: &'static str = Service::KIND;
    const VERSION: &'static str = Service::VERSION;
    const URL_PATH_SEGMENT: &'static str = Service::URL_PATH_SEGMENT;
    type Scope = <Service as k8s_openapi::Resource>::Scope;
}

impl k8s_openapi::Metadata for WatchedService {
    type Ty = ObjectMeta;
    fn metadata(&self) -> &ObjectMeta {
        self.0.metadata()
    }
    fn metadata_mut(&mut self) -> &mut ObjectMeta {
        self.0.metadata_mut()
    }
}

impl<'de> serde::Deserialize<'de> for WatchedService {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let mut value = serde_json::Value::deserialize(d)?;
        drop_status_conditions(&mut value);
        Service::deserialize(value)
            .map(Self)
            .map_err(serde::de::Error::custom)
    }
}

/// Removes `status.conditions` from a Service (or any object) given as JSON.
pub fn drop_status_conditions(object: &mut serde_json::Value) {
    if let Some(status) = object
        .get_mut("status")
        .and_then(serde_json::Value::as_object_mut)
    {
        status.remove("conditions");
    }
}

/// The watcher's event with its object made slim (see `slim`): the reflector stores only
/// lb's copy, and the decoded Kubernetes object is dropped here.
fn slim_event<K, T>(event: watcher::Event<K>, slim: impl Fn(&K) -> T) -> watcher::Event<T> {
    use watcher::Event;
    match event {
        Event::Apply(o) => Event::Apply(slim(&o)),
        Event::Delete(o) => Event::Delete(slim(&o)),
        Event::Init => Event::Init,
        Event::InitApply(o) => Event::InitApply(slim(&o)),
        Event::InitDone => Event::InitDone,
    }
}

/// kube-rs' default watch timeout (`timeoutSeconds`), which `lb run --watch-timeout` overrides.
pub const DEFAULT_WATCH_TIMEOUT: Duration = Duration::from_secs(290);

/// How much longer than the watch timeout a response may go without a byte before the
/// connection counts as dead (kube-rs watches use 5 s; lists get the same bound).
const READ_TIMEOUT_MARGIN: Duration = Duration::from_secs(10);

/// A client from `kubeconfig`, or else the in-cluster config, or else `$KUBECONFIG` /
/// `~/.kube/config`.
pub async fn client(kubeconfig: Option<&Path>) -> anyhow::Result<Client> {
    Client::try_from(config(kubeconfig).await?).context("building the Kubernetes client")
}

/// The client `lb run` watches with: [`client`]'s configuration, plus
///
/// * a read timeout of `watch_timeout` + 10 s, so a path that drops packets (no reset ever
///   arrives) fails a request waiting for its answer instead of hanging it forever (kube-rs
///   sets none; its watch idle timeout covers only streams already open), and a connect
///   timeout of at most `watch_timeout` + 5 s (kube-rs: 30 s), so with short watch timeouts a
///   cut path is reported as soon as it is noticed;
/// * every answer and every transport error reported to `metrics` as API-server contact.
pub async fn watch_client(
    kubeconfig: Option<&Path>,
    watch_timeout: Duration,
    metrics: Arc<dyn ApiObserver>,
) -> anyhow::Result<Client> {
    let mut config = config(kubeconfig).await?;
    config.read_timeout = Some(watch_timeout + READ_TIMEOUT_MARGIN);
    let connect = watch_timeout + Duration::from_secs(5);
    config.connect_timeout = Some(config.connect_timeout.map_or(connect, |t| t.min(connect)));
    // Count from the request, not from when a pooled connection went idle.
    config.reset_reader_on_write = true;
    // Any HTTP answer, whatever its status, proves the server is there; errors at this layer
    // are the transport's (refused, reset, timed out, TLS).
    let observe = tower::util::MapResultLayer::new(move |r: Result<_, tower::BoxError>| {
        match &r {
            Ok(_) => metrics.api_server_contact(),
            Err(e) => metrics.api_server_unreachable(&e.to_string()),
        }
        r
    });
    Ok(ClientBuilder::try_from(config)
        .context("building the Kubernetes client")?
        .with_layer(&observe)
        .build())
}

async fn config(kubeconfig: Option<&Path>) -> anyhow::Result<Config> {
    let config = match kubeconfig {
        Some(path) => {
            let kc = Kubeconfig::read_from(path)
                .with_context(|| format!("reading kubeconfig {}", path.display()))?;
            Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
                .await
                .context("kubeconfig")?
        }
        None => Config::infer()
            .await
            .context("no in-cluster config or kubeconfig")?,
    };
    Ok(config)
}

/// Whether a Kubernetes API is reachable by configuration alone (in a pod, or a kubeconfig).
pub fn cluster_configured() -> bool {
    std::env::var_os("KUBERNETES_SERVICE_HOST").is_some()
        || std::env::var_os("KUBECONFIG").is_some()
}

#[derive(Clone, Copy)]
enum Kind {
    Services,
    Slices,
    Node,
}

impl Kind {
    fn label(self) -> &'static str {
        match self {
            Kind::Services => "services",
            Kind::Slices => "endpointslices",
            Kind::Node => "node",
        }
    }
}

/// What the Kubernetes source reports about the API server and its watches; `lb run` hands
/// its `Metrics`, which implements this, so the source needs nothing of the metrics module.
pub trait ApiObserver: Send + Sync + std::fmt::Debug {
    /// The source starts watching an API server.
    fn watch_api_server(&self);
    /// The server answered (any HTTP status).
    fn api_server_contact(&self);
    /// A request failed in transport: the server is not reachable.
    fn api_server_unreachable(&self, error: &str);
    /// A watch of `kind` failed and is retried.
    fn inc_watch_errors(&self, kind: &'static str);
    /// A watch of `kind` listed again (after the first list).
    fn inc_watch_relists(&self, kind: &'static str);
}

/// How [`watch_with`] watches.
#[derive(Clone, Debug)]
pub struct WatchOptions {
    /// `timeoutSeconds` of each watch request: the server ends the watch after it and the
    /// watcher resumes from its resourceVersion.
    pub timeout: Duration,
    /// Where watch errors, relists and API-server contact are reported.
    pub metrics: Option<Arc<dyn ApiObserver>>,
}

impl Default for WatchOptions {
    fn default() -> Self {
        Self {
            timeout: DEFAULT_WATCH_TIMEOUT,
            metrics: None,
        }
    }
}

/// What one watcher step was, as far as the publishing loop cares.
enum Step {
    /// A list started (`Event::Init`): a relist after the first.
    ListStarted,
    Other,
}

/// Whether a watcher error shows the server answered (an API status), rather than the
/// transport failing.
fn server_answered(e: &watcher::Error) -> bool {
    match e {
        watcher::Error::InitialListFailed(e)
        | watcher::Error::WatchStartFailed(e)
        | watcher::Error::WatchFailed(e) => matches!(e, kube::Error::Api(_)),
        watcher::Error::WatchError(_) | watcher::Error::NoResourceVersion => true,
    }
}

/// [`watch_with`] with the default options (no metrics).
pub async fn watch(client: Client, node_name: String, tx: SnapshotSender) {
    watch_with(client, node_name, tx, WatchOptions::default()).await;
}

/// Runs the reflectors and publishes snapshots until `tx` closes. Watch errors (410 Gone,
/// dropped connections, a server gone) are retried by the watcher with backoff; a 410 relists.
/// Nothing is published while the server is away, so the maps keep the last state.
pub async fn watch_with(client: Client, node_name: String, tx: SnapshotSender, opts: WatchOptions) {
    if let Some(m) = &opts.metrics {
        m.watch_api_server();
    }
    let timeout = u32::try_from(opts.timeout.as_secs().max(1)).unwrap_or(u32::MAX);
    let (stores, mut events) = reflectors(client, &node_name, timeout);
    let mut counter = WatchCounter {
        metrics: opts.metrics,
        lists: [0; 3],
    };
    let mut pending_since: Option<Instant> = None;
    while let Some((kind, event)) = events.next().await {
        if !counter.observe(kind, event) {
            continue;
        }
        pending_since.get_or_insert_with(Instant::now);
        // Drain whatever else already arrived, so a burst becomes one snapshot.
        while let Some(Some((kind, e))) = events.next().now_or_never() {
            counter.observe(kind, e);
        }
        if !stores.ready() {
            continue;
        }
        if let Some(since) = pending_since.take()
            && tx.send(Some(Arc::new(stores.snapshot(since)))).is_err()
        {
            return;
        }
    }
}

/// The reflectors' stores: what a snapshot is taken from.
struct Stores {
    services: reflector::Store<slim::Service>,
    slices: reflector::Store<slim::EndpointSlice>,
    node: reflector::Store<slim::Node>,
}

impl Stores {
    /// Services and slices must have listed completely before the first sync (a partial list
    /// would delete frontends). The Node only adds the zone: a Node list that fails (RBAC, a
    /// missing object) must not keep every service from being programmed.
    fn ready(&self) -> bool {
        futures::future::join(
            self.services.wait_until_ready(),
            self.slices.wait_until_ready(),
        )
        .now_or_never()
        .is_some_and(|(a, b)| a.is_ok() && b.is_ok())
    }

    fn snapshot(&self, changed_at: Instant) -> Snapshot {
        Snapshot {
            services: self.services.state(),
            slices: self.slices.state(),
            node: self.node.state().into_iter().next(),
            problems: Vec::new(),
            changed_at,
        }
    }
}

/// Each watcher's steps, tagged with what it watches, as one stream.
type Events = stream::SelectAll<stream::BoxStream<'static, (Kind, Result<Step, watcher::Error>)>>;

/// The three reflectors, with kube-proxy's informers' selectors: only services no other proxy
/// claims, no headless slices, and only this node's Node.
fn reflectors(client: Client, node_name: &str, timeout: u32) -> (Stores, Events) {
    let services: Api<WatchedService> = Api::all(client.clone());
    let slices: Api<EndpointSlice> = Api::all(client.clone());
    let nodes: Api<Node> = Api::all(client);
    let (svc_store, svc_writer) = reflector::store();
    let (slice_store, slice_writer) = reflector::store();
    let (node_store, node_writer) = reflector::store();

    let cfg = watcher::Config::default().timeout(timeout);
    let svc_cfg = cfg.clone().labels(&format!("!{LABEL_SERVICE_PROXY_NAME}"));
    let slice_cfg = cfg.clone().labels(&format!("!{LABEL_HEADLESS}"));
    let node_cfg = cfg.fields(&format!("metadata.name={node_name}"));

    fn step<K>(e: &watcher::Event<K>) -> Step {
        if matches!(e, watcher::Event::Init) {
            Step::ListStarted
        } else {
            Step::Other
        }
    }
    let svc_events = reflector(
        svc_writer,
        watcher(services, svc_cfg)
            .map(|e| e.map(|e| slim_event(e, |s: &WatchedService| slim::Service::from(&s.0)))),
    )
    .default_backoff()
    .map(|e| (Kind::Services, e.map(|e| step(&e))));
    let slice_events = reflector(
        slice_writer,
        watcher(slices, slice_cfg)
            .map(|e| e.map(|e| slim_event(e, |s| slim::EndpointSlice::from(s)))),
    )
    .default_backoff()
    .map(|e| (Kind::Slices, e.map(|e| step(&e))));
    let node_events = reflector(
        node_writer,
        watcher(nodes, node_cfg).map(|e| e.map(|e| slim_event(e, |n| slim::Node::from(n)))),
    )
    .default_backoff()
    .map(|e| (Kind::Node, e.map(|e| step(&e))));
    let stores = Stores {
        services: svc_store,
        slices: slice_store,
        node: node_store,
    };
    let events = stream::select_all([
        svc_events.boxed(),
        slice_events.boxed(),
        node_events.boxed(),
    ]);
    (stores, events)
}

/// Counts and reports watcher steps: API-server contact, relists (every list after a kind's
/// first), watch errors and an unreachable server.
struct WatchCounter {
    metrics: Option<Arc<dyn ApiObserver>>,
    lists: [u64; 3],
}

impl WatchCounter {
    /// True for an event (the stores may have changed), false for an error.
    fn observe(&mut self, kind: Kind, event: Result<Step, watcher::Error>) -> bool {
        match event {
            Ok(step) => {
                if let Some(m) = &self.metrics {
                    m.api_server_contact();
                    if matches!(step, Step::ListStarted) {
                        let n = &mut self.lists[kind as usize];
                        *n += 1;
                        if *n > 1 {
                            m.inc_watch_relists(kind.label());
                        }
                    }
                }
                true
            }
            Err(e) => {
                tracing::warn!(watch = kind.label(), error = %e, "watch error; retrying");
                if let Some(m) = &self.metrics {
                    m.inc_watch_errors(kind.label());
                    if !server_answered(&e) {
                        m.api_server_unreachable(&e.to_string());
                    }
                }
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::{Node, Service};
    use kube::runtime::watcher;
    use serde_json::json;

    use super::{WatchedService, slim};

    /// What the API server returns for a Service whose status condition was written without
    /// a `lastTransitionTime` (the e2e "service status lifecycle" spec makes one).
    fn service_with_null_condition_time() -> serde_json::Value {
        json!({
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "lb-svc", "namespace": "shop", "resourceVersion": "9"},
            "spec": {"type": "LoadBalancer", "clusterIP": "198.19.0.1", "ports": [{"port": 80}]},
            "status": {
                "loadBalancer": {"ingress": [{"ip": "198.18.99.1"}]},
                "conditions": [{
                    "type": "StatusUpdate", "status": "True", "reason": "E2E",
                    "message": "Set from e2e test", "lastTransitionTime": null,
                }],
            },
        })
    }

    #[test]
    fn a_null_condition_time_does_not_keep_the_service_from_decoding() {
        let raw = service_with_null_condition_time();
        // Why the wrapper exists: k8s-openapi's Condition wants a time.
        assert!(serde_json::from_value::<Service>(raw.clone()).is_err());
        let WatchedService(svc) = serde_json::from_value(raw).expect("decodes");
        let status = svc.status.expect("status");
        assert_eq!(status.conditions, None);
        let ingress = status
            .load_balancer
            .and_then(|lb| lb.ingress)
            .expect("ingress");
        assert_eq!(ingress[0].ip.as_deref(), Some("198.18.99.1"));
        assert_eq!(
            svc.spec.and_then(|s| s.cluster_ip).as_deref(),
            Some("198.19.0.1")
        );
        // Lists decode their items the same way.
        let list: kube::core::ObjectList<WatchedService> = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "ServiceList", "metadata": {"resourceVersion": "9"},
            "items": [service_with_null_condition_time()],
        }))
        .expect("list decodes");
        assert_eq!(list.items.len(), 1);
    }

    #[test]
    fn the_store_keeps_what_lb_reads() {
        let raw = service_with_null_condition_time();
        let WatchedService(svc) = serde_json::from_value(raw).expect("decodes");
        let event = super::slim_event(watcher::Event::Apply(svc), |s| slim::Service::from(s));
        let watcher::Event::Apply(svc) = event else {
            panic!("an Apply stays an Apply");
        };
        assert_eq!(svc.metadata.object_name(), "shop/lb-svc");
        assert_eq!(svc.metadata.resource_version.as_deref(), Some("9"));
        let spec = svc.spec.as_ref().expect("spec");
        assert_eq!(spec.type_.as_deref(), Some("LoadBalancer"));
        assert_eq!(
            spec.cluster_ip,
            Some(slim::Addr::Ip("198.19.0.1".parse().expect("ip")))
        );
        assert_eq!(svc.lb_ingress.len(), 1);

        let node: Node = serde_json::from_value(json!({
            "metadata": {"name": "n1", "labels": {"topology.kubernetes.io/zone": "a"}},
            "status": {
                "addresses": [{"type": "InternalIP", "address": "198.18.0.1"}],
                "images": [{"names": ["registry.invalid/app:1"], "sizeBytes": 1}],
            },
        }))
        .expect("node");
        let node = slim::Node::from(&node);
        assert_eq!(node.zone.as_deref(), Some("a"));
        assert_eq!(node.addresses.len(), 1);
    }
}
