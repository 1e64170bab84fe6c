//! The kernel features lb adapts to, probed at start-up: what the kernel has, and what lb uses
//! because of it. A missing feature selects a fallback and is logged, never a load failure;
//! `lb status` and `lb features` print the same list.
//!
//! Probes load nothing lasting: helpers and map types are probed the way bpftool does (a tiny
//! program or map the kernel accepts or refuses), kfuncs and iterator targets by their kernel
//! symbols, attach types by the kernel version aya itself decides by.
use std::{collections::BTreeSet, fs};

use aya::{maps::MapType, sys::is_map_supported, util::KernelVersion};
use serde::{Deserialize, Serialize};

use super::load::{XdpMode, sock_set_retval_supported, sock_storage_supported};

/// One feature: whether the kernel has it and what lb does about it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Feature {
    pub name: String,
    pub available: bool,
    /// What lb uses: the feature itself, or the fallback.
    pub chosen: String,
}

/// `lb features --json`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Features {
    /// `uname -r`.
    pub release: String,
    pub features: Vec<Feature>,
}

impl Features {
    /// The features that fell back.
    pub fn fallbacks(&self) -> impl Iterator<Item = &Feature> {
        self.features.iter().filter(|f| !f.available)
    }

    /// Logs each feature, fallbacks as warnings-free info lines (a fallback is expected on an
    /// older kernel, not an error).
    pub fn log(&self) {
        for f in &self.features {
            if f.available {
                tracing::info!(feature = %f.name, chosen = %f.chosen, "kernel feature");
            } else {
                tracing::info!(feature = %f.name, fallback = %f.chosen, "kernel feature missing");
            }
        }
    }

    /// Text for `lb status` / `lb features`.
    pub fn render(&self) -> String {
        let width = self
            .features
            .iter()
            .map(|f| f.name.len())
            .max()
            .unwrap_or(0);
        self.features
            .iter()
            .map(|f| {
                let mark = if f.available { "yes" } else { "no " };
                format!("  {:<width$}  {mark}  {}\n", f.name, f.chosen)
            })
            .collect()
    }
}

/// Symbols of the running kernel (`/proc/kallsyms`; names only, addresses may read as 0).
fn kernel_symbols(wanted: &[&str]) -> BTreeSet<String> {
    let Ok(text) = fs::read_to_string("/proc/kallsyms") else {
        return BTreeSet::new();
    };
    text.lines()
        .filter_map(|l| l.split_whitespace().nth(2))
        .filter(|s| wanted.contains(s))
        .map(str::to_owned)
        .collect()
}

/// Probes the running kernel. `devices` are the external devices XDP would go on, with the
/// mode asked for.
pub fn probe(devices: &[String], xdp: XdpMode) -> Features {
    let release = fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|_| "unknown".into());
    let mut features = attach_features();
    features.extend(socket_features());
    features.extend(kernel_features());
    features.extend(xdp_features(devices, xdp));
    Features { release, features }
}

/// A probed feature and what lb does with it or without it.
fn feature(name: &str, available: bool, yes: &str, no: &str) -> Feature {
    Feature {
        name: name.into(),
        available,
        chosen: if available { yes } else { no }.into(),
    }
}

/// How lb's programs attach, by kernel version.
fn attach_features() -> Vec<Feature> {
    let version = KernelVersion::current().ok();
    let at_least = |maj, min| version.is_some_and(|v| v >= KernelVersion::new(maj, min, 0));
    vec![
        feature(
            "tcx",
            at_least(6, 6),
            "tc programs attach with tcx links (6.6+)",
            "tc programs attach as clsact filters over netlink",
        ),
        feature(
            "cgroup bpf_link",
            at_least(5, 7),
            "socket LB attaches with bpf_link (5.7+)",
            "socket LB attaches with BPF_PROG_ATTACH",
        ),
        feature(
            "xdp bpf_link",
            at_least(5, 9),
            "lb_xdp attaches with bpf_link (5.9+)",
            "lb_xdp attaches over netlink",
        ),
        feature(
            "veth XDP via GRO",
            at_least(5, 13),
            "a veth with GRO on receives XDP frames (5.13+)",
            "a veth receives XDP frames only if its peer runs an XDP program: keep --xdp auto \
             (tc on veths)",
        ),
    ]
}

/// What socket LB can do: refuse with ECONNREFUSED, destroy connected UDP sockets.
fn socket_features() -> Vec<Feature> {
    let syms = kernel_symbols(&[
        "bpf_sock_destroy",
        "bpf_iter_tcp_seq_show",
        "bpf_iter_udp_seq_show",
    ]);
    vec![
        feature(
            "bpf_set_retval",
            sock_set_retval_supported(),
            "refused socket-LB connects fail with ECONNREFUSED",
            "refused socket-LB connects fail with EPERM (no bpf_set_retval, before 5.18)",
        ),
        feature(
            "socket storage",
            sock_storage_supported(),
            "bpf_sk_storage_get for sock_addr and cgroup skb programs: socket LB keeps the \
             pairs of a socket that returns to them (unconnected UDP) in lb*_sk_store (freed \
             with the socket), first pairs and those past its slots in lb*_sk_revnat",
            "no bpf_sk_storage_get for sock_addr programs: socket LB keeps its pairs in the LRU \
             lb*_sk_revnat (one write per connect/sendmsg)",
        ),
        feature(
            "bpf_sock_destroy",
            syms.contains("bpf_sock_destroy"),
            "kfunc present (6.5+): connected UDP sockets socket LB pinned to a removed backend \
             are destroyed by an iter/udp program, and the application reconnects",
            "kfunc absent (before 6.5): a connected UDP socket pinned to a removed backend has \
             its next datagram dropped at cgroup egress (EPERM) and the application reconnects",
        ),
        feature(
            "socket iterators",
            syms.contains("bpf_iter_tcp_seq_show") && syms.contains("bpf_iter_udp_seq_show"),
            "iter/tcp and iter/udp present (5.9+)",
            "iter/tcp or iter/udp absent",
        ),
    ]
}

/// Map types and BTF.
fn kernel_features() -> Vec<Feature> {
    vec![
        feature(
            "per-CPU LRU hash",
            is_map_supported(MapType::LruPerCpuHash).unwrap_or(false),
            "available; conntrack uses the shared LRU hash (flows move between CPUs)",
            "absent; conntrack uses the shared LRU hash",
        ),
        feature(
            "BTF",
            std::path::Path::new("/sys/kernel/btf/vmlinux").exists(),
            "vmlinux BTF present",
            "no vmlinux BTF: maps still carry their own BTF for bpftool",
        ),
    ]
}

/// XDP, per external device.
fn xdp_features(devices: &[String], xdp: XdpMode) -> Vec<Feature> {
    let mut features = Vec::new();
    for dev in devices {
        let mode = xdp.resolve(dev);
        let (available, chosen) = match mode {
            XdpMode::Native => (true, "native XDP, tc ingress beside it".to_owned()),
            XdpMode::Generic => (true, "generic XDP, tc ingress beside it".to_owned()),
            _ => (
                false,
                "tc ingress only (virtual device, or --xdp off)".to_owned(),
            ),
        };
        features.push(Feature {
            name: format!("xdp on {dev}"),
            available,
            chosen,
        });
    }
    features
}
