//! The Kubernetes API source: reflectors on Services, EndpointSlices (never v1 Endpoints) and
//! this node's Node, with the label selectors kube-proxy's informers use. Once all three have
//! listed, every change publishes a snapshot of the stores.
use std::{path::Path, sync::Arc, time::Instant};

use anyhow::Context as _;
use futures::{FutureExt as _, StreamExt as _, stream};
use k8s_openapi::api::{
    core::v1::{Node, Service},
    discovery::v1::EndpointSlice,
};
use kube::{
    Api, Client, Config,
    config::{KubeConfigOptions, Kubeconfig},
    runtime::{WatchStreamExt as _, reflector, watcher},
};

use super::{
    source::{Snapshot, SnapshotSender},
    translate::{LABEL_HEADLESS, LABEL_SERVICE_PROXY_NAME},
};

/// A client from `kubeconfig`, or else the in-cluster config, or else `$KUBECONFIG` /
/// `~/.kube/config`.
pub async fn client(kubeconfig: Option<&Path>) -> anyhow::Result<Client> {
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
    Client::try_from(config).context("building the Kubernetes client")
}

/// Whether a Kubernetes API is reachable by configuration alone (in a pod, or a kubeconfig).
pub fn cluster_configured() -> bool {
    std::env::var_os("KUBERNETES_SERVICE_HOST").is_some()
        || std::env::var_os("KUBECONFIG").is_some()
}

enum Kind {
    Services,
    Slices,
    Node,
}

/// Runs the reflectors and publishes snapshots until `tx` closes. Watch errors (410 Gone,
/// dropped connections) are retried by the watcher with backoff; a 410 relists.
pub async fn watch(client: Client, node_name: String, tx: SnapshotSender) {
    let services: Api<Service> = Api::all(client.clone());
    let slices: Api<EndpointSlice> = Api::all(client.clone());
    let nodes: Api<Node> = Api::all(client);

    let (svc_store, svc_writer) = reflector::store();
    let (slice_store, slice_writer) = reflector::store();
    let (node_store, node_writer) = reflector::store();

    // kube-proxy's informers: only services no other proxy claims, no headless slices.
    let svc_cfg = watcher::Config::default().labels(&format!("!{LABEL_SERVICE_PROXY_NAME}"));
    let slice_cfg = watcher::Config::default().labels(&format!("!{LABEL_HEADLESS}"));
    let node_cfg = watcher::Config::default().fields(&format!("metadata.name={node_name}"));

    let svc_events = reflector(svc_writer, watcher(services, svc_cfg))
        .default_backoff()
        .map(|e| (Kind::Services, e.map(|_| ()).map_err(|e| e.to_string())));
    let slice_events = reflector(slice_writer, watcher(slices, slice_cfg))
        .default_backoff()
        .map(|e| (Kind::Slices, e.map(|_| ()).map_err(|e| e.to_string())));
    let node_events = reflector(node_writer, watcher(nodes, node_cfg))
        .default_backoff()
        .map(|e| (Kind::Node, e.map(|_| ()).map_err(|e| e.to_string())));
    let mut events = stream::select_all([
        svc_events.boxed(),
        slice_events.boxed(),
        node_events.boxed(),
    ]);

    let mut pending_since: Option<Instant> = None;
    let publish = |changed_at: Instant| {
        let snapshot = Snapshot {
            services: svc_store.state(),
            slices: slice_store.state(),
            node: node_store.state().into_iter().next(),
            problems: Vec::new(),
            changed_at,
        };
        tx.send(Some(Arc::new(snapshot))).is_ok()
    };
    // Services and slices must have listed completely before the first sync (a partial list
    // would delete frontends). The Node only adds the zone: a Node list that fails (RBAC, a
    // missing object) must not keep every service from being programmed.
    let ready = || {
        futures::future::join(svc_store.wait_until_ready(), slice_store.wait_until_ready())
            .now_or_never()
            .is_some_and(|(a, b)| a.is_ok() && b.is_ok())
    };

    while let Some((kind, event)) = events.next().await {
        if let Err(e) = event {
            let what = match kind {
                Kind::Services => "services",
                Kind::Slices => "endpointslices",
                Kind::Node => "node",
            };
            tracing::warn!(watch = what, error = %e, "watch error; retrying");
            continue;
        }
        pending_since.get_or_insert_with(Instant::now);
        // Drain whatever else already arrived, so a burst becomes one snapshot.
        while let Some(Some((_, e))) = events.next().now_or_never() {
            if let Err(e) = e {
                tracing::warn!(error = %e, "watch error; retrying");
            }
        }
        if !ready() {
            continue;
        }
        if let Some(since) = pending_since.take()
            && !publish(since)
        {
            return;
        }
    }
}
