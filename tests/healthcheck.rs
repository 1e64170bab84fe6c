//! Health check node ports end to end: `lb run --manifests DIR` in a testbed's node netns serves
//! kube-proxy's service health check on `healthCheckNodePort` of a LoadBalancer Service with
//! `externalTrafficPolicy: Local`, follows its endpoints, reports a port it cannot bind and
//! closes the port when the service goes. Queried over loopback inside the node netns only.
//! Needs root.
use std::{
    fs,
    hash::{BuildHasher as _, RandomState},
    io::{self, Read as _, Write as _},
    net::{SocketAddr, TcpListener, TcpStream},
    path::{Path, PathBuf},
    thread,
    time::{Duration, Instant},
};

use lb_tests::{bins::LB, daemon::LbDaemon, netns::in_netns, testbed::Testbed};

const NODE_NAME: &str = "lb-hc-node";
/// How long a change may take to reach a health check port.
const FOLLOW_TIMEOUT: Duration = Duration::from_secs(10);

/// A manifest directory, removed on drop.
struct Dir(PathBuf);

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

impl Dir {
    /// Writes `name` atomically (the watcher never sees half a file).
    fn write(&self, name: &str, text: &str) {
        let tmp = self.0.join(format!(".{name}.tmp"));
        fs::write(&tmp, text).unwrap();
        fs::rename(&tmp, self.0.join(name)).unwrap();
    }
}

fn service(name: &str, cluster_ip: &str, hc_port: u16) -> String {
    format!(
        "apiVersion: v1
kind: Service
metadata: {{name: {name}, namespace: hc}}
spec:
  type: LoadBalancer
  externalTrafficPolicy: Local
  healthCheckNodePort: {hc_port}
  clusterIP: {cluster_ip}
  ports: [{{name: http, protocol: TCP, port: 80, targetPort: 8080}}]
"
    )
}

/// One endpoint on `node`, listed under two ports (it still counts once).
fn slice(service: &str, ip: &str, node: &str) -> String {
    format!(
        "apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: {service}-1
  namespace: hc
  labels: {{kubernetes.io/service-name: {service}}}
addressType: IPv4
ports: [{{name: http, protocol: TCP, port: 8080}}, {{name: metrics, protocol: TCP, port: 9090}}]
endpoints:
  - addresses: [{ip}]
    nodeName: {node}
    conditions: {{ready: true}}
"
    )
}

struct Response {
    status: u16,
    /// Header lines, names lowercased.
    headers: Vec<(String, String)>,
    body: String,
}

impl Response {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// `GET path` to `addr` from inside netns `ns` (`Connection: close`, body not chunked).
fn get(ns: &str, addr: SocketAddr, path: &str) -> io::Result<Response> {
    let path = path.to_owned();
    in_netns(ns, move || {
        let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
        )?;
        let mut raw = String::new();
        s.read_to_string(&mut raw)?;
        Ok(raw)
    })
    .map_err(|e| match e.downcast::<io::Error>() {
        Ok(e) => e,
        Err(e) => io::Error::other(format!("{e:#}")),
    })
    .map(|raw| {
        let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
        let mut lines = head.split("\r\n");
        let status = lines
            .next()
            .and_then(|l| l.split(' ').nth(1))
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let headers = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
            .collect();
        Response {
            status,
            headers,
            body: body.to_owned(),
        }
    })
}

/// Polls `get` until `done` holds for its result, for up to [`FOLLOW_TIMEOUT`]; returns the
/// last result, which the caller asserts on.
fn until(
    get: impl Fn() -> io::Result<Response>,
    done: impl Fn(&io::Result<Response>) -> bool,
) -> io::Result<Response> {
    let deadline = Instant::now() + FOLLOW_TIMEOUT;
    loop {
        let r = get();
        if done(&r) || Instant::now() >= deadline {
            return r;
        }
        thread::sleep(Duration::from_millis(100));
    }
}

fn body(name: &str, local: usize) -> String {
    format!(
        "{{\n\t\"service\": {{\n\t\t\"namespace\": \"hc\",\n\t\t\"name\": \"{name}\"\n\t}},\n\t\"localEndpoints\": {local},\n\t\"serviceProxyHealthy\": true\n}}"
    )
}

/// A port in the NodePort range, different on every run.
fn random_node_port() -> u16 {
    let r = RandomState::new().hash_one(Instant::now());
    30000 + (r % 2767) as u16
}

#[test]
fn health_check_node_port_follows_endpoints_and_closes() {
    let mut tb = Testbed::create(1).expect("testbed");
    let dir = Dir(std::env::temp_dir().join(format!("lb-test-hc-{}", tb.id)));
    fs::create_dir_all(&dir.0).unwrap();
    let port = random_node_port();
    let busy_port = port + 1;
    let node = tb.node_ns.clone();
    let v4 = SocketAddr::from(([127, 0, 0, 1], port));

    dir.write("web.yaml", &service("web", "198.19.0.50", port));
    dir.write("web-slice.yaml", &slice("web", "198.18.11.2", NODE_NAME));
    let manifests = dir.0.display().to_string();
    let args = [
        "--manifests",
        &manifests,
        "--socket-lb=false",
        "--hostname-override",
        NODE_NAME,
    ];
    let mut lb = LbDaemon::start(&mut tb, Path::new(LB), &args, "info").unwrap();
    lb.wait_for_from(
        0,
        |l| l.contains("opened health check node port") && l.contains(&format!("port={port}")),
        "health check port opened",
    )
    .unwrap();

    // One local ready endpoint: 200, kube-proxy's headers and body, on any path.
    let r = get(&node, v4, "/").expect("health check answers");
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.body, body("web", 1));
    assert_eq!(r.header("content-type"), Some("application/json"));
    assert_eq!(r.header("x-content-type-options"), Some("nosniff"));
    assert_eq!(r.header("x-load-balancing-endpoint-weight"), Some("1"));
    assert_eq!(get(&node, v4, "/anything/else").unwrap().status, 200);
    // An IPv4-only service gets an IPv4 listener only, as kube-proxy's per-family proxiers.
    let v6 = SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, port));
    let e = get(&node, v6, "/").map(|r| r.status).unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::ConnectionRefused, "{e}");

    // Another service's port is taken: reported with its name and counted; web keeps working.
    let taken = in_netns(&node, move || {
        Ok(TcpListener::bind(SocketAddr::from((
            [0, 0, 0, 0],
            busy_port,
        )))?)
    })
    .expect("occupy the second port");
    let from = lb.log.len();
    dir.write("busy.yaml", &service("busy", "198.19.0.51", busy_port));
    lb.wait_for_from(
        from,
        |l| l.contains("cannot open health check node port") && l.contains("hc/busy"),
        "bind error of hc/busy",
    )
    .unwrap();
    let metrics = get(&node, SocketAddr::from(([127, 0, 0, 1], 10249)), "/metrics").unwrap();
    assert!(
        metrics.body.lines().any(|l| l
            .strip_prefix("lb_healthcheck_bind_errors_total ")
            .and_then(|v| v.parse::<f64>().ok())
            .is_some_and(|v| v >= 1.0)),
        "{}",
        metrics.body
    );
    assert_eq!(get(&node, v4, "/").unwrap().status, 200);
    drop(taken);

    // The endpoint moves to another node: 503 with no local endpoints.
    dir.write("web-slice.yaml", &slice("web", "198.18.11.2", "elsewhere"));
    let r = until(
        || get(&node, v4, "/"),
        |r| r.as_ref().is_ok_and(|r| r.status == 503),
    )
    .expect("health check answers");
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(r.body, body("web", 0));
    assert_eq!(r.header("x-load-balancing-endpoint-weight"), Some("0"));

    // The service goes: its port is closed.
    let from = lb.log.len();
    fs::remove_file(dir.0.join("web.yaml")).unwrap();
    lb.wait_for_from(
        from,
        |l| l.contains("closed health check node port") && l.contains("hc/web"),
        "health check port closed",
    )
    .unwrap();
    let e = get(&node, v4, "/").map(|r| r.status).unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::ConnectionRefused, "{e}");
}
