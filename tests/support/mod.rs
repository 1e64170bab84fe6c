//! Shared helpers of the Kubernetes API tests: the fake API server and object builders.
//! Documentation addresses only: service IPs in 198.19.0.0/16, endpoints in 198.18.0.0/16.
pub mod apiserver;
pub mod maps;

use k8s_openapi::api::{
    core::v1::{Node, Service},
    discovery::v1::EndpointSlice,
};
use serde_json::{Value, json};

/// The port name the builders use on both sides, so service and slice ports match.
pub const PORT_NAME: &str = "http";

/// A single-stack IPv4 ClusterIP Service with one TCP port `port` → `target_port`.
pub fn service(
    namespace: &str,
    name: &str,
    cluster_ip: &str,
    port: i32,
    target_port: i32,
) -> Service {
    serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": { "name": name, "namespace": namespace },
        "spec": {
            "type": "ClusterIP",
            "clusterIP": cluster_ip,
            "clusterIPs": [cluster_ip],
            "ipFamilies": ["IPv4"],
            "ipFamilyPolicy": "SingleStack",
            "ports": [{
                "name": PORT_NAME,
                "protocol": "TCP",
                "port": port,
                "targetPort": target_port,
            }],
        },
    }))
    .expect("a valid Service")
}

/// Adds label `key=value` to any object.
pub fn labelled<T>(obj: &T, key: &str, value: &str) -> T
where
    T: serde::Serialize + serde::de::DeserializeOwned,
{
    let mut v = serde_json::to_value(obj).expect("serialize");
    v["metadata"]["labels"][key] = Value::String(value.into());
    serde_json::from_value(v).expect("deserialize")
}

/// One endpoint of a slice.
#[derive(Clone, Debug)]
pub struct Ep {
    pub addr: &'static str,
    pub ready: bool,
    /// `hints.forZones`.
    pub zone_hint: Option<&'static str>,
}

impl Ep {
    pub fn ready(addr: &'static str) -> Self {
        Self {
            addr,
            ready: true,
            zone_hint: None,
        }
    }

    pub fn not_ready(addr: &'static str) -> Self {
        Self {
            ready: false,
            ..Self::ready(addr)
        }
    }

    pub fn in_zone(addr: &'static str, zone: &'static str) -> Self {
        Self {
            zone_hint: Some(zone),
            ..Self::ready(addr)
        }
    }
}

/// An IPv4 EndpointSlice of service `service` with one TCP port named [`PORT_NAME`].
pub fn slice(namespace: &str, name: &str, service: &str, port: i32, eps: &[Ep]) -> EndpointSlice {
    let endpoints: Vec<Value> = eps
        .iter()
        .map(|e| {
            let mut ep = json!({
                "addresses": [e.addr],
                "conditions": { "ready": e.ready, "serving": e.ready, "terminating": false },
            });
            if let Some(zone) = e.zone_hint {
                ep["zone"] = Value::String(zone.into());
                ep["hints"] = json!({ "forZones": [{ "name": zone }] });
            }
            ep
        })
        .collect();
    serde_json::from_value(json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": { "kubernetes.io/service-name": service },
        },
        "addressType": "IPv4",
        "ports": [{ "name": PORT_NAME, "protocol": "TCP", "port": port }],
        "endpoints": endpoints,
    }))
    .expect("a valid EndpointSlice")
}

/// A Node, with `topology.kubernetes.io/zone` when `zone` is given.
pub fn node(name: &str, zone: Option<&str>) -> Node {
    let mut n = json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": { "name": name },
    });
    if let Some(zone) = zone {
        n["metadata"]["labels"] = json!({ "topology.kubernetes.io/zone": zone });
    }
    serde_json::from_value(n).expect("a valid Node")
}
