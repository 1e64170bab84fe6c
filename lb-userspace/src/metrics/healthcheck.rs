//! kube-proxy's service health check servers (`pkg/proxy/healthcheck`, `service_health.go`):
//! an HTTP server on `spec.healthCheckNodePort` of every LoadBalancer Service with
//! `externalTrafficPolicy: Local`, which cloud load balancers probe to learn whether this node
//! has endpoints of the service.
//!
//! - Any method and path: 200 when the node has local ready endpoints and lb's own proxier is
//!   healthy, else 503, with `X-Load-Balancing-Endpoint-Weight: N` and kube-proxy's body, byte
//!   for byte.
//! - kube-proxy runs one proxier per IP family, each with its own health server: a `tcp4`
//!   listener on `0.0.0.0:PORT` counting IPv4 endpoints, a `tcp6` (IPv6-only) one on
//!   `[::]:PORT` counting IPv6 endpoints, each only for services with a ClusterIP of its
//!   family. lb does the same, so a dual-stack pod counts once on each listener.
//! - Local endpoints are `LocalReadyEndpoints`: unique IPs of endpoints on this node whose
//!   `ready` condition is true or unset (serving-but-terminating endpoints do not count),
//!   over all of the service's slices and ports, read from the translation's EndpointSlice
//!   index (`translate::slices::index_slices`): the same slices, ports and copy of an endpoint
//!   listed twice as the programmed backends.
//!
//! [`desired`] is the pure part; [`HealthServers`] opens, updates and closes the listeners.
use std::{
    borrow::Borrow,
    collections::{BTreeMap, BTreeSet, HashSet},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    sync::Arc,
};

use axum::{
    Router,
    extract::State,
    http::{HeaderName, HeaderValue, StatusCode, header},
    response::IntoResponse,
};
use tokio::{
    sync::{oneshot, watch},
    task::JoinHandle,
};

pub use crate::model::Family;
use crate::{
    kube::slim::{Addr, EndpointSlice, Service},
    metrics::Metrics,
    translate::{
        self,
        slices::{SliceIndex, index_slices},
    },
};

/// One listener: a health check node port in one IP family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Listen {
    pub port: u16,
    pub family: Family,
}

/// What a listener answers for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceHealth {
    pub namespace: String,
    pub name: String,
    /// Unique IPs of the family's local ready endpoints.
    pub local_endpoints: usize,
}

/// A service whose health check node port another service (earlier in namespace/name order)
/// already has in that family; in kube-proxy its listen fails with "address in use".
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortConflict {
    pub listen: Listen,
    /// `namespace/name` of the service that gets no listener.
    pub service: String,
    /// `namespace/name` of the one that has the port.
    pub owner: String,
}

/// The listeners lb should run.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HealthChecks {
    pub servers: BTreeMap<Listen, ServiceHealth>,
    pub conflicts: Vec<PortConflict>,
}

/// The families kube-proxy's per-family proxiers see `svc` in (`GetClusterIPByFamily`).
fn cluster_ip_families(svc: &Service) -> BTreeSet<Family> {
    let Some(spec) = svc.spec.as_ref() else {
        return BTreeSet::new();
    };
    let parse = |a: &Addr| a.lenient().map(|ip| Family::of(&ip));
    if !spec.ip_families.is_empty() {
        // With ipFamilies, the i-th family's ClusterIP is clusterIPs[i].
        spec.ip_families
            .iter()
            .zip(spec.cluster_ips.iter())
            .filter_map(|(family, ip)| {
                let want = Family::from_k8s(family)?;
                (parse(ip) == Some(want)).then_some(want)
            })
            .collect()
    } else if !spec.cluster_ips.is_empty() {
        // No ipFamilies (the API server always sets them; manifests may not): the addresses'
        // families, of clusterIPs as translate programs them, else of clusterIP.
        spec.cluster_ips.iter().filter_map(parse).collect()
    } else {
        spec.cluster_ip.iter().filter_map(parse).collect()
    }
}

/// The health check node port of `svc` if it needs one (`NeedsHealthCheck`): type
/// LoadBalancer with `externalTrafficPolicy: Local` and a port in range.
fn health_check_port(svc: &Service) -> Option<u16> {
    let spec = svc.spec.as_ref()?;
    if spec.type_.as_deref() != Some("LoadBalancer") || !spec.external_local {
        return None;
    }
    u16::try_from(spec.health_check_node_port?)
        .ok()
        .filter(|p| *p != 0)
}

/// The health check listeners for `services` and `slices` on node `node_name`: kube-proxy's
/// `HealthCheckNodePorts` and `LocalReadyEndpoints`, per IP family. Services lb ignores
/// ([`translate::ignored`]) get none.
pub fn desired<S: Borrow<Service>, E: Borrow<EndpointSlice>>(
    services: &[S],
    slices: &[E],
    node_name: &str,
) -> HealthChecks {
    // Only services with a health check node port matter (LoadBalancers with
    // `externalTrafficPolicy: Local`), and only their slices are indexed: every sync runs
    // this, and indexing every endpoint of the cluster made it O(all endpoints).
    let mut services: Vec<&Service> = services
        .iter()
        .map(Borrow::borrow)
        .filter(|s| health_check_port(s).is_some())
        .collect();
    services.sort_by_key(|s| s.metadata.object_name());
    let slices = slices_of(&services, slices);
    // What the index refuses, translation reports.
    let index = index_slices(&slices, node_name, &mut Vec::new());
    let mut out = HealthChecks::default();
    for svc in services {
        let Some(name) = svc.metadata.name.as_deref().filter(|n| !n.is_empty()) else {
            continue;
        };
        if translate::ignored(svc).is_some() {
            continue;
        }
        let Some(port) = health_check_port(svc) else {
            continue;
        };
        let namespace = svc.metadata.namespace.as_deref().unwrap_or("default");
        let key = (namespace.to_string(), name.to_string());
        for family in cluster_ip_families(svc) {
            let health = ServiceHealth {
                namespace: key.0.clone(),
                name: key.1.clone(),
                local_endpoints: local_ready_endpoints(&index, &key, family),
            };
            out.listen(Listen { port, family }, health);
        }
    }
    out
}

/// The EndpointSlices of `services` (by their `kubernetes.io/service-name` label).
fn slices_of<'s, E: Borrow<EndpointSlice>>(
    services: &[&Service],
    slices: &'s [E],
) -> Vec<&'s EndpointSlice> {
    let keys: HashSet<(&str, &str)> = services
        .iter()
        .filter_map(|s| {
            let ns = s.metadata.namespace.as_deref().unwrap_or("default");
            Some((ns, s.metadata.name.as_deref()?))
        })
        .collect();
    slices
        .iter()
        .map(Borrow::borrow)
        .filter(|slice| {
            let ns = slice.metadata.namespace.as_deref().unwrap_or("default");
            let service = slice.service.as_deref();
            service.is_some_and(|name| keys.contains(&(ns, name)))
        })
        .collect()
}

/// kube-proxy's `LocalReadyEndpoints` of the service `key` in `family`: the unique IPs of its
/// endpoints on this node whose `ready` condition is true or unset, over all of its ports.
fn local_ready_endpoints(index: &SliceIndex, key: &(String, String), family: Family) -> usize {
    index.get(key).map_or(0, |by_family| {
        by_family[family.index()]
            .values()
            .flat_map(|by_addr| by_addr.values())
            .filter(|e| e.local && e.ready)
            .map(|e| e.l4.addr)
            .collect::<BTreeSet<_>>()
            .len()
    })
}

impl HealthChecks {
    /// Gives `listen` to `health`'s service, unless a service earlier in namespace/name order
    /// has it: then it is a conflict, as kube-proxy's second listen fails with "address in
    /// use".
    fn listen(&mut self, listen: Listen, health: ServiceHealth) {
        if let Some(owner) = self.servers.get(&listen) {
            self.conflicts.push(PortConflict {
                listen,
                service: format!("{}/{}", health.namespace, health.name),
                owner: format!("{}/{}", owner.namespace, owner.name),
            });
            return;
        }
        self.servers.insert(listen, health);
    }
}

/// The body kube-proxy's `hcHandler` writes (a dedented Go template: tab-indented, no trailing
/// newline). Names are DNS labels, so JSON and Go's `%q` quote them alike.
pub fn body(health: &ServiceHealth, proxy_healthy: bool) -> String {
    let quote = |s: &str| serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into());
    format!(
        "{{\n\t\"service\": {{\n\t\t\"namespace\": {},\n\t\t\"name\": {}\n\t}},\n\t\"localEndpoints\": {},\n\t\"serviceProxyHealthy\": {}\n}}",
        quote(&health.namespace),
        quote(&health.name),
        health.local_endpoints,
        proxy_healthy
    )
}

/// One open listener.
struct Server {
    health: watch::Sender<ServiceHealth>,
    /// Dropping it starts axum's graceful shutdown, which also closes idle connections.
    shutdown: Option<oneshot::Sender<()>>,
    task: JoinHandle<()>,
}

/// The running health check listeners. [`HealthServers::update`] makes them match a
/// [`HealthChecks`]; a port that cannot be bound is logged, counted
/// (`lb_healthcheck_bind_errors_total`) and tried again on the next update.
pub struct HealthServers {
    metrics: Arc<Metrics>,
    v4: Ipv4Addr,
    v6: Ipv6Addr,
    servers: BTreeMap<Listen, Server>,
}

impl HealthServers {
    /// Listeners on `0.0.0.0` and `[::]`, as kube-proxy's without `--nodeport-addresses`.
    pub fn new(metrics: Arc<Metrics>) -> Self {
        Self::with_addresses(metrics, Ipv4Addr::UNSPECIFIED, Ipv6Addr::UNSPECIFIED)
    }

    /// Listeners on these addresses instead (tests use loopback).
    pub fn with_addresses(metrics: Arc<Metrics>, v4: Ipv4Addr, v6: Ipv6Addr) -> Self {
        Self {
            metrics,
            v4,
            v6,
            servers: BTreeMap::new(),
        }
    }

    /// The listeners open now.
    pub fn open(&self) -> impl Iterator<Item = Listen> + '_ {
        self.servers.keys().copied()
    }

    /// Closes listeners that are no longer wanted (their ports are closed when this returns),
    /// updates the answers of the others in place, and opens new ones.
    pub async fn update(&mut self, want: &HealthChecks) {
        let gone: Vec<Listen> = self
            .servers
            .keys()
            .filter(|l| !want.servers.contains_key(l))
            .copied()
            .collect();
        for listen in gone {
            if let Some(server) = self.servers.remove(&listen) {
                let service = service_name(&server.health.borrow());
                close(server).await;
                tracing::info!(port = listen.port, family = %listen.family, %service, "closed health check node port");
            }
        }
        for (listen, health) in &want.servers {
            if let Some(server) = self.servers.get(listen) {
                server.health.send_if_modified(|h| {
                    let changed = h != health;
                    if changed {
                        *h = health.clone();
                    }
                    changed
                });
                continue;
            }
            let service = service_name(health);
            match self.open_one(*listen, health.clone()) {
                Ok(server) => {
                    tracing::info!(port = listen.port, family = %listen.family, %service, "opened health check node port");
                    self.servers.insert(*listen, server);
                }
                Err(e) => {
                    self.metrics.inc_healthcheck_bind_errors();
                    tracing::error!(port = listen.port, family = %listen.family, %service, error = %e, "cannot open health check node port");
                }
            }
        }
        for c in &want.conflicts {
            self.metrics.inc_healthcheck_bind_errors();
            tracing::error!(
                port = c.listen.port,
                family = %c.listen.family,
                service = %c.service,
                owner = %c.owner,
                "cannot open health check node port: another service has it"
            );
        }
        self.metrics
            .set_healthcheck_listeners(self.servers.len() as u64);
    }

    fn open_one(&self, listen: Listen, health: ServiceHealth) -> std::io::Result<Server> {
        let ip = match listen.family {
            Family::V4 => IpAddr::V4(self.v4),
            Family::V6 => IpAddr::V6(self.v6),
        };
        let listener = bind(SocketAddr::new(ip, listen.port))?;
        let (health_tx, health_rx) = watch::channel(health);
        let (shutdown_tx, shutdown_rx) = oneshot::channel::<()>();
        let app = Router::new()
            .fallback(handler)
            .with_state((health_rx, Arc::clone(&self.metrics)));
        let task = tokio::spawn(async move {
            let serve = axum::serve(listener, app).with_graceful_shutdown(async move {
                let _ = shutdown_rx.await;
            });
            if let Err(e) = serve.await {
                tracing::error!(port = listen.port, error = %e, "health check server stopped");
            }
        });
        Ok(Server {
            health: health_tx,
            shutdown: Some(shutdown_tx),
            task,
        })
    }
}

impl Drop for HealthServers {
    fn drop(&mut self) {
        for server in self.servers.values() {
            server.task.abort();
        }
    }
}

fn service_name(h: &ServiceHealth) -> String {
    format!("{}/{}", h.namespace, h.name)
}

async fn close(mut server: Server) {
    // Tell open connections to finish, then drop the accept loop (and with it the listening
    // socket) at once rather than waiting for them; awaiting the aborted task means the
    // socket is closed when this returns.
    drop(server.shutdown.take());
    server.task.abort();
    let _ = (&mut server.task).await;
}

/// A listening socket as Go's `net.Listen` makes one: SO_REUSEADDR (a port closed a moment
/// ago, with connections in TIME_WAIT, can be opened again), IPv6 sockets IPv6-only.
fn bind(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    socket.set_reuse_address(true)?;
    if addr.is_ipv6() {
        socket.set_only_v6(true)?;
    }
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    socket.listen(1024)?;
    tokio::net::TcpListener::from_std(socket.into())
}

const ENDPOINT_WEIGHT: HeaderName = HeaderName::from_static("x-load-balancing-endpoint-weight");

async fn handler(
    State((health, metrics)): State<(watch::Receiver<ServiceHealth>, Arc<Metrics>)>,
) -> impl IntoResponse {
    let health = health.borrow().clone();
    let proxy_healthy = metrics.proxier_healthy();
    let status = if health.local_endpoints != 0 && proxy_healthy {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (
        status,
        [
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            ),
            (
                header::X_CONTENT_TYPE_OPTIONS,
                HeaderValue::from_static("nosniff"),
            ),
            (ENDPOINT_WEIGHT, HeaderValue::from(health.local_endpoints)),
        ],
        body(&health, proxy_healthy),
    )
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use serde_json::json;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    use super::*;
    use crate::{
        kube::{LABEL_SERVICE_NAME, slim::slim},
        translate::NodeInfo,
    };

    type Service = k8s_openapi::api::core::v1::Service;
    type EndpointSlice = k8s_openapi::api::discovery::v1::EndpointSlice;

    /// `super::desired` of slim copies of `services` and `slices`.
    fn desired(services: &[Service], slices: &[EndpointSlice], node_name: &str) -> HealthChecks {
        super::desired::<crate::kube::slim::Service, crate::kube::slim::EndpointSlice>(
            &slim(services),
            &slim(slices),
            node_name,
        )
    }

    fn service(v: serde_json::Value) -> Service {
        serde_json::from_value(v).expect("service")
    }

    /// LoadBalancer, eTP=Local, health check port `port`, one ClusterIP per `ips` entry.
    fn lb_service(ns: &str, name: &str, port: i32, ips: &[&str]) -> Service {
        service(json!({
            "metadata": {"namespace": ns, "name": name},
            "spec": {
                "type": "LoadBalancer",
                "externalTrafficPolicy": "Local",
                "healthCheckNodePort": port,
                "clusterIP": ips[0],
                "clusterIPs": ips,
                "ports": [{"name": "http", "port": 80, "protocol": "TCP", "nodePort": 30080}],
            },
        }))
    }

    fn slice(
        ns: &str,
        name: &str,
        svc: &str,
        family: &str,
        ports: serde_json::Value,
        endpoints: serde_json::Value,
    ) -> EndpointSlice {
        serde_json::from_value(json!({
            "metadata": {"namespace": ns, "name": name, "labels": {LABEL_SERVICE_NAME: svc}},
            "addressType": family,
            "ports": ports,
            "endpoints": endpoints,
        }))
        .expect("slice")
    }

    fn two_ports() -> serde_json::Value {
        json!([{"name": "http", "port": 8080, "protocol": "TCP"}, {"name": "https", "port": 8443, "protocol": "TCP"}])
    }

    fn count(checks: &HealthChecks, port: u16, family: Family) -> Option<usize> {
        checks
            .servers
            .get(&Listen { port, family })
            .map(|h| h.local_endpoints)
    }

    #[test]
    fn counts_unique_local_ready_ips_over_slices_and_ports() {
        let svc = lb_service("ns", "web", 31000, &["198.19.0.10"]);
        let a = slice(
            "ns",
            "web-a",
            "web",
            "IPv4",
            two_ports(),
            json!([
                // Local, ready unset: counts once although it has two ports.
                {"addresses": ["198.18.11.2"], "nodeName": "me"},
                // Local and ready.
                {"addresses": ["198.18.12.2"], "nodeName": "me", "conditions": {"ready": true}},
                // Another node.
                {"addresses": ["198.18.13.2"], "nodeName": "other"},
                // No node name.
                {"addresses": ["198.18.14.2"]},
                // Local but serving and terminating: not ready.
                {"addresses": ["198.18.15.2"], "nodeName": "me",
                 "conditions": {"ready": false, "serving": true, "terminating": true}},
            ]),
        );
        // The same IP again in another slice, and one more local endpoint.
        let b = slice(
            "ns",
            "web-b",
            "web",
            "IPv4",
            two_ports(),
            json!([
                {"addresses": ["198.18.11.2"], "nodeName": "me"},
                {"addresses": ["198.18.16.2"], "nodeName": "me"},
            ]),
        );
        // Another service's slice with a local endpoint.
        let c = slice(
            "ns",
            "other-a",
            "other",
            "IPv4",
            two_ports(),
            json!([
                {"addresses": ["198.18.17.2"], "nodeName": "me"},
            ]),
        );
        let checks = desired(&[svc], &[a, b, c], "me");
        assert_eq!(checks.servers.len(), 1, "{checks:?}");
        assert_eq!(
            checks.servers[&Listen {
                port: 31000,
                family: Family::V4
            }],
            ServiceHealth {
                namespace: "ns".into(),
                name: "web".into(),
                local_endpoints: 3
            }
        );
        assert!(checks.conflicts.is_empty());
        // Another node sees one of them; an empty node name matches nothing.
        let svc = [lb_service("ns", "web", 31000, &["198.19.0.10"])];
        let s = [slice(
            "ns",
            "web-a",
            "web",
            "IPv4",
            two_ports(),
            json!([
                {"addresses": ["198.18.11.2"], "nodeName": "other"},
                {"addresses": ["198.18.12.2"]},
            ]),
        )];
        assert_eq!(
            count(&desired(&svc, &s, "other"), 31000, Family::V4),
            Some(1)
        );
        assert_eq!(count(&desired(&svc, &s, ""), 31000, Family::V4), Some(0));
    }

    #[test]
    fn only_the_slices_of_the_service_itself_count() {
        let svc = lb_service("ns", "web", 31000, &["198.19.0.10"]);
        // Same service name in another namespace, and another service in the same one.
        let local = json!([{"addresses": ["198.18.11.2"], "nodeName": "me"}]);
        let elsewhere = slice("other", "web-a", "web", "IPv4", two_ports(), local.clone());
        let neighbour = slice("ns", "api-a", "api", "IPv4", two_ports(), local.clone());
        let own = slice(
            "ns",
            "web-a",
            "web",
            "IPv4",
            two_ports(),
            json!([{"addresses": ["198.18.12.2"], "nodeName": "me"},
                   {"addresses": ["198.18.13.2"], "nodeName": "me"}]),
        );
        let checks = desired(&[svc], &[elsewhere, neighbour, own], "me");
        assert_eq!(count(&checks, 31000, Family::V4), Some(2));
    }

    #[test]
    fn a_slice_without_usable_ports_contributes_nothing() {
        let svc = [lb_service("ns", "web", 31000, &["198.19.0.10"])];
        let s = [slice(
            "ns",
            "web-a",
            "web",
            "IPv4",
            json!([{"port": 8080}, {"name": "x", "port": 0}, {"name": "y"}]),
            json!([{"addresses": ["198.18.11.2"], "nodeName": "me"}]),
        )];
        assert_eq!(count(&desired(&svc, &s, "me"), 31000, Family::V4), Some(0));
    }

    #[test]
    fn a_terminating_copy_does_not_replace_a_ready_one() {
        let svc = [lb_service("ns", "web", 31000, &["198.19.0.10"])];
        let ports = json!([{"name": "http", "port": 8080, "protocol": "TCP"}]);
        let s = [
            slice(
                "ns",
                "web-a",
                "web",
                "IPv4",
                ports.clone(),
                json!([{"addresses": ["198.18.11.2"], "nodeName": "me"}]),
            ),
            slice(
                "ns",
                "web-b",
                "web",
                "IPv4",
                ports,
                json!([{"addresses": ["198.18.11.2"], "nodeName": "me",
                        "conditions": {"ready": false, "terminating": true}}]),
            ),
        ];
        assert_eq!(count(&desired(&svc, &s, "me"), 31000, Family::V4), Some(1));
    }

    /// Health checks and translation read one EndpointSlice index, so an endpoint listed
    /// twice (two slices, copies that differ in readiness or node) is the same copy for both:
    /// the local endpoint count is the number of addresses the eTP=Local NodePort sends new
    /// flows to.
    #[test]
    fn health_checks_and_translation_agree_on_duplicated_endpoints() {
        use crate::model::BackendState;
        let svc = lb_service("ns", "web", 31000, &["198.19.0.10"]);
        let ports = json!([{"name": "http", "port": 8080, "protocol": "TCP"}]);
        let ready = json!({"addresses": ["198.18.11.2"], "nodeName": "me"});
        let terminating = json!({"addresses": ["198.18.11.2"], "nodeName": "me",
            "conditions": {"ready": false, "serving": true, "terminating": true}});
        let not_ready = json!({"addresses": ["198.18.11.2"], "nodeName": "me",
            "conditions": {"ready": false}});
        let remote = json!({"addresses": ["198.18.11.2"], "nodeName": "other"});
        // Another local ready endpoint, so no case falls back to terminating ones.
        let other = json!({"addresses": ["198.18.20.2"], "nodeName": "me"});
        let node = NodeInfo {
            name: "me".into(),
            nodeport_ips: vec!["192.0.2.1".parse().unwrap()],
            ..NodeInfo::default()
        };
        for (a, b, want) in [
            (&ready, &terminating, 2),
            (&terminating, &ready, 2),
            (&ready, &remote, 2),
            (&remote, &ready, 2),
            (&terminating, &remote, 1),
            (&ready, &not_ready, 1),
            (&not_ready, &ready, 2),
        ] {
            let slices = [
                slice(
                    "ns",
                    "web-a",
                    "web",
                    "IPv4",
                    ports.clone(),
                    json!([a, other]),
                ),
                slice("ns", "web-b", "web", "IPv4", ports.clone(), json!([b])),
            ];
            let health = count(
                &desired(std::slice::from_ref(&svc), &slices, "me"),
                31000,
                Family::V4,
            );
            let t = translate::desired_state::<
                crate::kube::slim::Service,
                crate::kube::slim::EndpointSlice,
            >(&slim([&svc]), &slim(&slices), &node);
            let node_ports: Vec<_> = t
                .state
                .services
                .values()
                .filter(|e| e.flags & lb_common::svc_flags::NODE_PORT != 0)
                .collect();
            assert_eq!(node_ports.len(), 1, "{:?}", t.state);
            let active: BTreeSet<IpAddr> = node_ports[0]
                .backends
                .iter()
                .filter(|b| b.state == BackendState::Active)
                .map(|b| b.l4.addr)
                .collect();
            assert_eq!(health, Some(want), "{a} then {b}");
            assert_eq!(active.len(), want, "{a} then {b}: {:?}", node_ports[0]);
        }
    }

    #[test]
    fn families_have_listeners_and_counts_of_their_own() {
        let ports = json!([{"name": "http", "port": 8080, "protocol": "TCP"}]);
        let v4 = slice(
            "ns",
            "web-a",
            "web",
            "IPv4",
            ports.clone(),
            json!([
                {"addresses": ["198.18.11.2"], "nodeName": "me"},
                {"addresses": ["198.18.12.2"], "nodeName": "me"},
            ]),
        );
        let v6 = slice(
            "ns",
            "web-b",
            "web",
            "IPv6",
            ports,
            json!([
                {"addresses": ["2001:db8:0:11::2"], "nodeName": "me"},
            ]),
        );
        let slices = [v4, v6];
        let dual = lb_service("ns", "web", 31000, &["198.19.0.10", "2001:db8:ffff::10"]);
        let checks = desired(&[dual], &slices, "me");
        assert_eq!(count(&checks, 31000, Family::V4), Some(2));
        assert_eq!(count(&checks, 31000, Family::V6), Some(1));
        // A single-stack service gets no listener of the other family.
        let v6_only = lb_service("ns", "web", 31000, &["2001:db8:ffff::10"]);
        let checks = desired(&[v6_only], &slices, "me");
        assert_eq!(count(&checks, 31000, Family::V4), None);
        assert_eq!(count(&checks, 31000, Family::V6), Some(1));
        // ipFamilies pairs with clusterIPs by index.
        let mut svc = lb_service("ns", "web", 31000, &["2001:db8:ffff::10", "198.19.0.10"]);
        svc.spec.as_mut().unwrap().ip_families = Some(vec!["IPv6".into()]);
        let checks = desired(&[svc], &slices, "me");
        assert_eq!(
            checks.servers.keys().map(|l| l.family).collect::<Vec<_>>(),
            [Family::V6]
        );
    }

    #[test]
    fn only_proxied_load_balancers_with_local_policy_and_a_port_get_one() {
        let base = || lb_service("ns", "web", 31000, &["198.19.0.10"]);
        let with = |f: &dyn Fn(&mut Service)| {
            let mut s = base();
            f(&mut s);
            desired(&[s], &[] as &[EndpointSlice], "me").servers.len()
        };
        assert_eq!(with(&|_| {}), 1);
        assert_eq!(
            with(&|s| s.spec.as_mut().unwrap().external_traffic_policy = Some("Cluster".into())),
            0
        );
        assert_eq!(
            with(&|s| s.spec.as_mut().unwrap().type_ = Some("NodePort".into())),
            0
        );
        assert_eq!(
            with(&|s| s.spec.as_mut().unwrap().health_check_node_port = Some(0)),
            0
        );
        assert_eq!(
            with(&|s| s.spec.as_mut().unwrap().health_check_node_port = None),
            0
        );
        assert_eq!(
            with(&|s| s.spec.as_mut().unwrap().health_check_node_port = Some(-1)),
            0
        );
        assert_eq!(
            with(&|s| s.spec.as_mut().unwrap().health_check_node_port = Some(70000)),
            0
        );
        // translate::ignored: headless, ExternalName, another proxy's.
        assert_eq!(
            with(&|s| {
                let spec = s.spec.as_mut().unwrap();
                spec.cluster_ip = Some("None".into());
                spec.cluster_ips = Some(vec!["None".into()]);
            }),
            0
        );
        assert_eq!(
            with(&|s| s.spec.as_mut().unwrap().type_ = Some("ExternalName".into())),
            0
        );
        assert_eq!(
            with(&|s| {
                s.metadata.labels = Some(
                    [(
                        crate::kube::LABEL_SERVICE_PROXY_NAME.to_string(),
                        "x".to_string(),
                    )]
                    .into(),
                );
            }),
            0
        );
        assert_eq!(with(&|s| s.metadata.name = None), 0);
    }

    #[test]
    fn a_port_two_services_ask_for_goes_to_the_first() {
        let a = lb_service("a", "web", 31000, &["198.19.0.10"]);
        let b = lb_service("b", "web", 31000, &["198.19.0.11"]);
        let checks = desired(&[b, a], &[] as &[EndpointSlice], "me");
        assert_eq!(checks.servers.len(), 1);
        assert_eq!(checks.servers.values().next().unwrap().namespace, "a");
        assert_eq!(
            checks.conflicts,
            [PortConflict {
                listen: Listen {
                    port: 31000,
                    family: Family::V4
                },
                service: "b/web".into(),
                owner: "a/web".into(),
            }]
        );
    }

    #[test]
    fn body_is_kube_proxys() {
        let h = ServiceHealth {
            namespace: "ns".into(),
            name: "web".into(),
            local_endpoints: 2,
        };
        assert_eq!(
            body(&h, true),
            "{\n\t\"service\": {\n\t\t\"namespace\": \"ns\",\n\t\t\"name\": \"web\"\n\t},\n\t\"localEndpoints\": 2,\n\t\"serviceProxyHealthy\": true\n}"
        );
        let v: serde_json::Value = serde_json::from_str(&body(&h, false)).unwrap();
        assert_eq!(
            v,
            json!({"service": {"namespace": "ns", "name": "web"}, "localEndpoints": 2, "serviceProxyHealthy": false})
        );
    }

    /// A port that was free a moment ago.
    fn free_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    async fn get(port: u16) -> std::io::Result<(u16, String, String)> {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
        s.write_all(b"GET /any/path HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await?;
        let mut raw = String::new();
        tokio::time::timeout(Duration::from_secs(5), s.read_to_string(&mut raw)).await??;
        let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
        let status = head
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        Ok((status, head.to_ascii_lowercase(), body.to_owned()))
    }

    fn checks(entries: &[(u16, &str, usize)]) -> HealthChecks {
        HealthChecks {
            servers: entries
                .iter()
                .map(|(port, name, n)| {
                    (
                        Listen {
                            port: *port,
                            family: Family::V4,
                        },
                        ServiceHealth {
                            namespace: "ns".into(),
                            name: (*name).into(),
                            local_endpoints: *n,
                        },
                    )
                })
                .collect(),
            conflicts: Vec::new(),
        }
    }

    fn loopback(metrics: &Arc<Metrics>) -> HealthServers {
        HealthServers::with_addresses(
            Arc::clone(metrics),
            Ipv4Addr::LOCALHOST,
            Ipv6Addr::LOCALHOST,
        )
    }

    #[tokio::test]
    async fn servers_open_update_and_close() {
        let metrics = Metrics::new();
        metrics.mark_synced();
        let mut servers = loopback(&metrics);
        let (p1, p2) = (free_port(), free_port());
        servers
            .update(&checks(&[(p1, "web", 2), (p2, "api", 0)]))
            .await;
        let (status, head, body) = get(p1).await.unwrap();
        assert_eq!(status, 200, "{head}{body}");
        assert!(
            head.contains("\r\ncontent-type: application/json\r\n"),
            "{head}"
        );
        assert!(
            head.contains("\r\nx-content-type-options: nosniff\r\n"),
            "{head}"
        );
        assert!(
            head.contains("\r\nx-load-balancing-endpoint-weight: 2\r\n"),
            "{head}"
        );
        let web = ServiceHealth {
            namespace: "ns".into(),
            name: "web".into(),
            local_endpoints: 2,
        };
        assert_eq!(body, super::body(&web, true));
        let (status, head, _) = get(p2).await.unwrap();
        assert_eq!(status, 503);
        assert!(
            head.contains("\r\nx-load-balancing-endpoint-weight: 0\r\n"),
            "{head}"
        );

        // Counts change in place; p2 goes and its port is closed when update returns.
        servers.update(&checks(&[(p1, "web", 0)])).await;
        let (status, _, body) = get(p1).await.unwrap();
        assert_eq!(status, 503);
        assert!(body.contains("\"localEndpoints\": 0"), "{body}");
        let refused = get(p2).await.unwrap_err();
        assert_eq!(refused.kind(), std::io::ErrorKind::ConnectionRefused);
        assert_eq!(servers.open().count(), 1);

        // Unhealthy proxier: 503 although there are endpoints.
        servers.update(&checks(&[(p1, "web", 1)])).await;
        assert_eq!(get(p1).await.unwrap().0, 200);
        metrics.mark_change_pending(std::time::Instant::now() - crate::metrics::HEALTH_TIMEOUT);
        let (status, _, body) = get(p1).await.unwrap();
        assert_eq!(status, 503);
        assert!(body.contains("\"serviceProxyHealthy\": false"), "{body}");

        servers.update(&HealthChecks::default()).await;
        assert_eq!(
            get(p1).await.unwrap_err().kind(),
            std::io::ErrorKind::ConnectionRefused
        );
        assert!(metrics.render().contains("lb_healthcheck_listeners 0\n"));
    }

    #[tokio::test]
    async fn a_port_in_use_is_counted_and_the_rest_keep_working() {
        let metrics = Metrics::new();
        metrics.mark_synced();
        let mut servers = loopback(&metrics);
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let busy = taken.local_addr().unwrap().port();
        let free = free_port();
        servers
            .update(&checks(&[(busy, "busy", 1), (free, "web", 1)]))
            .await;
        assert_eq!(get(free).await.unwrap().0, 200);
        assert_eq!(servers.open().map(|l| l.port).collect::<Vec<_>>(), [free]);
        assert!(
            metrics
                .render()
                .contains("lb_healthcheck_bind_errors_total 1\n"),
            "{}",
            metrics.render()
        );
        // Tried again on the next update, and opened once the port is free.
        drop(taken);
        servers
            .update(&checks(&[(busy, "busy", 1), (free, "web", 1)]))
            .await;
        assert_eq!(get(busy).await.unwrap().0, 200);
        assert!(
            metrics
                .render()
                .contains("lb_healthcheck_bind_errors_total 1\n")
        );
    }
}
