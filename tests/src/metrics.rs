//! lb's HTTP endpoints as the tests read them: a GET from a thread inside a netns (lb listens in
//! the testbed's node netns), `/metrics` and `/healthz` at lb's default addresses, and one
//! sample of the Prometheus text.
use std::{
    io::{Read as _, Write as _},
    net::TcpStream,
    time::Duration,
};

use anyhow::{Context as _, bail};

use crate::{daemon::slowdown, netns::in_netns, testbed::Testbed};

/// lb's default `--metrics-bind-address` (kube-proxy's), inside the node netns.
pub const METRICS: &str = "127.0.0.1:10249";
/// lb's default `--healthz-bind-address` (kube-proxy's), inside the node netns.
pub const HEALTH: &str = "127.0.0.1:10256";

/// `GET path` from a thread inside netns `ns`: the status code and the body.
pub fn http_get(ns: &str, addr: &str, path: &str) -> anyhow::Result<(u16, String)> {
    let (addr, path) = (addr.to_owned(), path.to_owned());
    in_netns(ns, move || {
        let mut s = TcpStream::connect(&addr).with_context(|| format!("connect {addr}"))?;
        s.set_read_timeout(Some(Duration::from_secs(5) * slowdown()))?;
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
        )?;
        let mut resp = String::new();
        s.read_to_string(&mut resp)
            .with_context(|| format!("read GET {addr}{path}"))?;
        let Some((head, body)) = resp.split_once("\r\n\r\n") else {
            bail!("GET {addr}{path}: no end of headers in {resp:?}");
        };
        let status = head
            .split(' ')
            .nth(1)
            .and_then(|c| c.parse().ok())
            .with_context(|| format!("GET {addr}{path}: no status in {head:?}"))?;
        Ok((status, body.to_owned()))
    })
}

/// The body of `/metrics` at [`METRICS`] in `tb`'s node netns.
pub fn scrape(tb: &Testbed) -> anyhow::Result<String> {
    Ok(http_get(&tb.node_ns, METRICS, "/metrics")?.1)
}

/// `/healthz` at [`HEALTH`] in `tb`'s node netns: the status code and the JSON body.
pub fn healthz(tb: &Testbed) -> anyhow::Result<(u16, serde_json::Value)> {
    let (status, body) = http_get(&tb.node_ns, HEALTH, "/healthz")?;
    let v = serde_json::from_str(&body).with_context(|| format!("healthz JSON: {body}"))?;
    Ok((status, v))
}

/// The value of the sample `series` (the name with its labels, exactly as exposed:
/// `name{labels}` or `name`) in Prometheus text.
pub fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        let (k, v) = l.rsplit_once(' ')?;
        (k == series).then(|| v.parse().ok())?
    })
}

/// The value of `series` in a fresh [`scrape`]; an error if lb does not expose it.
pub fn metric(tb: &Testbed, series: &str) -> anyhow::Result<f64> {
    let text = scrape(tb)?;
    sample(&text, series).with_context(|| format!("no {series} in /metrics:\n{text}"))
}
