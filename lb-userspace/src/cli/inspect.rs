//! `lb services`, `lb backends` and `lb status`: read-only views of a running lb, taken from
//! the LIVE pinned maps (like `cilium-dbg service list`), not from the daemon's memory.
//!
//! Nothing here writes to a map. Service names come from `<state-dir>/frontends.json`, which
//! `lb run` rewrites after every sync; a frontend missing from it is shown with the name `-`.
//! The JSON printed by `--json` is documented in docs/operations.md and kept stable: fields may
//! be added, never renamed or removed.
use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    io::{self, Write as _},
    net::{IpAddr, SocketAddr},
    os::{
        fd::{AsRawFd as _, FromRawFd as _, OwnedFd, RawFd},
        unix::fs::MetadataExt as _,
    },
    path::{Path, PathBuf},
};

use anyhow::Context as _;
use aya::{
    maps::MapInfo,
    programs::{links::LinkType, loaded_links, loaded_programs},
    util::KernelVersion,
};
use lb_common::{
    Backend4, Backend6, Ct4Key, Ct4Value, Ct6Key, Ct6Value, DEFAULT_PIN_DIR, RevNat4, RevNat6,
    SkRevNat4Key, SkRevNat4Value, SkRevNat6Key, SkRevNat6Value, Svc4Key, Svc6Key, SvcValue,
    map_names, prog_names,
};
use serde::{Deserialize, Serialize};

use crate::{
    datapath::{
        cgroup::cgroup2_mounts,
        maps::{BpfMaps, Dump, LbMaps as _, count_keys},
        pinned::{check_pin_dir, open_hash, pin_error, read_counters},
    },
    model::{Frontend, flag_names, kind_of},
    state_dir::{self, DEFAULT_STATE_DIR, Names},
};

/// Every program lb loads (as the kernel names them).
pub const PROGRAM_NAMES: [&str; 13] = prog_names::ALL;

/// `lb services`.
#[derive(Clone, Debug, clap::Args)]
pub struct ServicesArgs {
    /// bpffs directory holding lb's pinned maps (as given to `lb run`).
    #[arg(long, default_value = DEFAULT_PIN_DIR)]
    pub pin_dir: PathBuf,
    /// lb's state directory (as given to `lb run`), for the service names.
    #[arg(long, default_value = DEFAULT_STATE_DIR)]
    pub state_dir: PathBuf,
    /// Print JSON (an array, see docs/operations.md) instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// `lb backends` and `lb status`.
#[derive(Clone, Debug, clap::Args)]
pub struct PinDirArgs {
    /// bpffs directory holding lb's pinned maps (as given to `lb run`).
    #[arg(long, default_value = DEFAULT_PIN_DIR)]
    pub pin_dir: PathBuf,
    /// Print JSON (see docs/operations.md) instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// One frontend (master entry) of `lb services --json`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServiceView {
    /// Rev-NAT id of the frontend.
    pub id: u32,
    /// `ip:port/PROTO`, IPv6 in brackets.
    pub frontend: String,
    /// `external` (or the only scope) or `internal`.
    pub scope: String,
    /// ClusterIP, ExternalIP, LoadBalancer or NodePort.
    #[serde(rename = "type")]
    pub kind: String,
    /// The Kubernetes service port; `null` when the state file does not name this frontend.
    pub service: Option<ServiceRef>,
    /// Names of the set `svc_flags` bits.
    pub flags: Vec<String>,
    /// Active backends (slots `1..=count`).
    pub count: u16,
    /// Terminating backends after them.
    pub qcount: u16,
    /// One entry per slot `1..=count+qcount`, in slot order.
    pub backends: Vec<SlotView>,
    /// How new flows pick a backend: `random` or `maglev`.
    #[serde(default)]
    pub algorithm: String,
    /// With `maglev`: the frontend's table in `lb_maglev` (`null` without active backends).
    #[serde(default)]
    pub maglev_table: Option<u32>,
}

/// `service` of a [`ServiceView`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServiceRef {
    pub namespace: String,
    pub name: String,
    /// The service port's name (may be empty for a single unnamed port).
    pub port: String,
}

/// One backend slot of a [`ServiceView`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotView {
    pub slot: u16,
    /// Backend id; `null` when the slot entry itself is missing.
    pub id: Option<u32>,
    /// `ip:port` (IPv6 in brackets); `null` when the slot or the backend is missing.
    pub address: Option<String>,
    /// `TCP`, `UDP` or `SCTP`; `null` when missing.
    pub protocol: Option<String>,
    /// active, terminating, quarantined, maintenance, or missing.
    pub state: String,
}

/// One entry of `lb backends --json`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackendView {
    pub id: u32,
    pub address: String,
    pub protocol: String,
    pub state: String,
    /// How many frontends (master entries) have this backend in a slot.
    pub references: usize,
}

/// `lb status --json`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Status {
    pub pin_dir: String,
    /// Who made the pins (`lb_meta`).
    pub pins: PinsStatus,
    pub kernel: KernelStatus,
    pub features: Features,
    /// Every probed feature and what lb chose (`lb features`).
    pub kernel_features: Vec<crate::datapath::features::Feature>,
    /// lb's programs that use the pinned maps, with their bpf_link attachments.
    pub programs: Vec<ProgramStatus>,
    pub maps: Vec<MapStatus>,
    /// Datapath counters from `lb_metrics`, summed over CPUs.
    pub counters: Vec<CounterStatus>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PinsStatus {
    /// Layout version of the pinned maps; `null`: not recorded (an lb that never finished
    /// starting, or one from before `lb_meta`), which is layout 1.
    pub layout_version: Option<u32>,
    /// Version of the lb that last started on the pins.
    pub lb_version: Option<String>,
    /// Inode of the network namespace that lb ran in (`ls -iL /proc/<pid>/ns/net`).
    pub netns_inode: Option<u64>,
    /// Whether this command runs in that namespace: only then are tc/XDP ifindexes resolved to
    /// interface names. `null` when unknown.
    pub same_netns: Option<bool>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KernelStatus {
    /// `uname -r`.
    pub release: String,
    /// Parsed `major.minor.patch`, `null` if it could not be parsed.
    pub version: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Features {
    /// `/sys/kernel/btf/vmlinux` exists.
    pub btf: bool,
    /// tcx attachment (kernel >= 6.6); older kernels get a clsact qdisc filter.
    pub tcx: bool,
    /// bpf_link for cgroup programs (kernel >= 5.7).
    pub cgroup_link: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProgramStatus {
    pub name: String,
    pub id: u32,
    /// Kernel program type, e.g. `sched_cls`, `cgroup_sock_addr`.
    #[serde(rename = "type")]
    pub prog_type: String,
    /// bpf_link attachments of this program. Attachments made without a link (tc on kernels
    /// before 6.6, cgroups before 5.7) are not listed.
    pub attachments: Vec<Attachment>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Attachment {
    pub link_id: u32,
    /// `tcx`, `cgroup`, `netkit`, … (the kernel's link type).
    pub link_type: String,
    /// tcx/XDP: the interface name, when this command runs in lb's network namespace (else
    /// `null`: the ifindex is that namespace's, see `pins.same_netns`); cgroup: the cgroup
    /// directory, if found.
    pub target: Option<String>,
    /// tcx: the interface index in lb's network namespace.
    pub ifindex: Option<u32>,
    /// cgroup: the cgroup id (inode number of its directory).
    pub cgroup_id: Option<u64>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MapStatus {
    pub name: String,
    /// `null` when the map is not pinned.
    pub id: Option<u32>,
    /// aya's map type name (`Hash`, `LruHash`, `PerCpuArray`).
    #[serde(rename = "type")]
    pub map_type: Option<String>,
    /// Keys present (for arrays: always max_entries).
    pub entries: Option<u64>,
    pub max_entries: Option<u32>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CounterStatus {
    pub name: String,
    pub packets: u64,
    pub bytes: u64,
}

/// The names in `<state_dir>/frontends.json`. A missing file gives no names; an unreadable
/// one is reported on stderr and also gives no names.
pub fn read_names(state_dir: &Path) -> Names {
    state_dir::read_names(state_dir).unwrap_or_else(|e| {
        eprintln!("warning: {e}");
        Names::new()
    })
}

fn socket_addr(addr: IpAddr, port: u16) -> String {
    SocketAddr::new(addr, port).to_string()
}

/// Joins the master entries of `dump` with their slots, backends and names; sorted by id.
pub fn service_views(dump: &Dump, names: &Names) -> Vec<ServiceView> {
    let mut out: Vec<ServiceView> = dump
        .services
        .iter()
        .filter(|((_, slot), _)| *slot == 0)
        .map(|((fe, _), master)| service_view(dump, names, fe, master))
        .collect();
    out.sort_by(|a, b| (a.id, &a.frontend, &a.scope).cmp(&(b.id, &b.frontend, &b.scope)));
    out
}

fn service_view(dump: &Dump, names: &Names, fe: &Frontend, master: &SvcValue) -> ServiceView {
    let frontend = fe.l4.to_string();
    let scope = fe.scope.as_str().to_string();
    let name = names.get(&(frontend.clone(), scope.clone()));
    let backends = (1..=master.slots())
        .map(|slot| match dump.services.get(&(*fe, slot)) {
            None => SlotView {
                slot,
                id: None,
                address: None,
                protocol: None,
                state: "missing".into(),
            },
            Some(sv) => match dump.backends.get(&sv.backend_id) {
                None => SlotView {
                    slot,
                    id: Some(sv.backend_id),
                    address: None,
                    protocol: None,
                    state: "missing".into(),
                },
                Some(b) => SlotView {
                    slot,
                    id: Some(sv.backend_id),
                    address: Some(socket_addr(b.l4.addr, b.l4.port)),
                    protocol: Some(b.l4.proto.to_string()),
                    state: b.state.as_str().into(),
                },
            },
        })
        .collect();
    ServiceView {
        id: master.rev_nat_id,
        frontend,
        scope,
        kind: name.map_or_else(|| kind_of(master.flags).to_string(), |n| n.kind.clone()),
        service: name.map(|n| ServiceRef {
            namespace: n.namespace.clone(),
            name: n.name.clone(),
            port: n.port_name.clone(),
        }),
        flags: flag_names(master.flags)
            .split('|')
            .filter(|f| *f != "-")
            .map(String::from)
            .collect(),
        count: master.count,
        qcount: master.qcount,
        backends,
        algorithm: match master.lb_alg {
            lb_common::lb_alg::RANDOM => "random",
            lb_common::lb_alg::MAGLEV => "maglev",
            _ => "unknown",
        }
        .into(),
        maglev_table: crate::datapath::maps::maglev_table_of(master),
    }
}

/// Every backend with the number of frontends whose slots name it; sorted by id.
pub fn backend_views(dump: &Dump) -> Vec<BackendView> {
    let mut refs: BTreeMap<u32, BTreeSet<Frontend>> = BTreeMap::new();
    for ((fe, slot), master) in &dump.services {
        if *slot != 0 {
            continue;
        }
        for s in 1..=master.slots() {
            if let Some(sv) = dump.services.get(&(*fe, s)) {
                refs.entry(sv.backend_id).or_default().insert(*fe);
            }
        }
    }
    dump.backends
        .iter()
        .map(|(id, b)| BackendView {
            id: *id,
            address: socket_addr(b.l4.addr, b.l4.port),
            protocol: b.l4.proto.to_string(),
            state: b.state.as_str().into(),
            references: refs.get(id).map_or(0, BTreeSet::len),
        })
        .collect()
}

fn col_widths(header: &[&str], rows: &[Vec<String>]) -> Vec<usize> {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.len());
        }
    }
    widths
}

/// One line of left-aligned columns separated by two spaces; the last column is not padded.
fn fmt_row<S: AsRef<str>>(cells: &[S], widths: &[usize], indent: &str) -> String {
    let mut line = String::from(indent);
    for (i, (cell, w)) in cells.iter().zip(widths).enumerate() {
        if i + 1 == cells.len() {
            line.push_str(cell.as_ref());
        } else {
            line.push_str(&format!("{:<w$}  ", cell.as_ref()));
        }
    }
    line.push('\n');
    line
}

fn table(header: &[&str], rows: &[Vec<String>], indent: &str) -> String {
    let widths = col_widths(header, rows);
    let mut out = fmt_row(header, &widths, indent);
    for row in rows {
        out.push_str(&fmt_row(row, &widths, indent));
    }
    out
}

/// The `lb services` table: one line per frontend, then one per backend slot.
pub fn render_services(views: &[ServiceView]) -> String {
    const HEADER: [&str; 6] = ["ID", "FRONTEND", "SCOPE", "TYPE", "SERVICE", "BACKENDS"];
    let rows: Vec<Vec<String>> = views
        .iter()
        .map(|v| {
            let service = v.service.as_ref().map_or_else(
                || "-".to_string(),
                |s| {
                    if s.port.is_empty() {
                        format!("{}/{}", s.namespace, s.name)
                    } else {
                        format!("{}/{}:{}", s.namespace, s.name, s.port)
                    }
                },
            );
            vec![
                v.id.to_string(),
                v.frontend.clone(),
                v.scope.clone(),
                v.kind.clone(),
                service,
                match (v.algorithm.as_str(), v.maglev_table) {
                    ("maglev", Some(t)) => format!(
                        "{} active, {} draining, maglev table {t}",
                        v.count, v.qcount
                    ),
                    ("maglev", None) => {
                        format!("{} active, {} draining, maglev", v.count, v.qcount)
                    }
                    _ => format!("{} active, {} draining", v.count, v.qcount),
                },
            ]
        })
        .collect();
    let widths = col_widths(&HEADER, &rows);
    let mut out = fmt_row(&HEADER, &widths, "");
    for (v, row) in views.iter().zip(&rows) {
        out.push_str(&fmt_row(row, &widths, ""));
        for b in &v.backends {
            let target = match (&b.address, &b.protocol, b.id) {
                (Some(a), Some(p), _) => format!("{a}/{p}"),
                (_, _, Some(id)) => format!("backend {id}"),
                _ => "-".to_string(),
            };
            out.push_str(&format!("  {} => {target} ({})\n", b.slot, b.state));
        }
    }
    out
}

/// The `lb backends` table.
pub fn render_backends(views: &[BackendView]) -> String {
    let rows: Vec<Vec<String>> = views
        .iter()
        .map(|b| {
            vec![
                b.id.to_string(),
                b.address.clone(),
                b.protocol.clone(),
                b.state.clone(),
                b.references.to_string(),
            ]
        })
        .collect();
    table(&["ID", "ADDRESS", "PROTO", "STATE", "FRONTENDS"], &rows, "")
}

fn yes_no(b: bool) -> &'static str {
    if b { "yes" } else { "no" }
}

fn or_dash<T: ToString>(v: Option<T>) -> String {
    v.map_or_else(|| "-".to_string(), |v| v.to_string())
}

/// The `lb status` text.
pub fn render_status(s: &Status) -> String {
    let mut out = status_header(s);
    out.push_str(&status_programs(s));
    out.push_str("Maps:\n");
    out.push_str(&status_maps(&s.maps));
    out.push_str("Datapath counters (summed over CPUs):\n");
    let rows: Vec<Vec<String>> = s
        .counters
        .iter()
        .map(|c| vec![c.name.clone(), c.packets.to_string(), c.bytes.to_string()])
        .collect();
    out.push_str(&table(&["EVENT", "PACKETS", "BYTES"], &rows, "  "));
    out
}

/// The kernel, its features and the pin directory's lines of `lb status`.
fn status_header(s: &Status) -> String {
    let mut out = String::new();
    out.push_str(&format!("Kernel:    {}\n", s.kernel.release));
    out.push_str(&format!(
        "Features:  BTF {}, tcx {}, cgroup bpf_link {}\n",
        yes_no(s.features.btf),
        yes_no(s.features.tcx),
        yes_no(s.features.cgroup_link)
    ));
    out.push_str("Kernel features (available, what lb uses):\n");
    out.push_str(
        &crate::datapath::features::Features {
            release: s.kernel.release.clone(),
            features: s.kernel_features.clone(),
        }
        .render(),
    );
    out.push_str(&format!("Pin dir:   {}\n", s.pin_dir));
    out.push_str(&format!(
        "Pins:      layout {}, written by lb {}{}\n",
        s.pins
            .layout_version
            .map_or_else(|| "1 (not recorded)".to_string(), |v| v.to_string()),
        s.pins.lb_version.as_deref().unwrap_or("-"),
        match (s.pins.same_netns, s.pins.netns_inode) {
            (Some(false), Some(ino)) => format!(
                "; lb runs in another network namespace (net:[{ino}]): interfaces are shown \
                 by its ifindexes"
            ),
            _ => String::new(),
        }
    ));
    out
}

/// The `Programs:` section of `lb status`: one line per attachment; a program's other
/// attachments go on continuation lines.
fn status_programs(s: &Status) -> String {
    if s.programs.is_empty() {
        return "Programs:  none loaded that use these maps (is `lb run` running?)\n".to_string();
    }
    let mut rows: Vec<Vec<String>> = Vec::new();
    for p in &s.programs {
        let attached: Vec<String> = p
            .attachments
            .iter()
            .map(|a| attachment_text(a, s.pins.same_netns))
            .collect();
        let first = attached.first().cloned().unwrap_or_else(|| "-".into());
        rows.push(vec![
            p.id.to_string(),
            p.name.clone(),
            p.prog_type.clone(),
            first,
        ]);
        for more in attached.into_iter().skip(1) {
            rows.push(vec![String::new(), String::new(), String::new(), more]);
        }
    }
    let mut out = "Programs:\n".to_string();
    out.push_str(&table(&["ID", "NAME", "TYPE", "ATTACHED"], &rows, "  "));
    out
}

/// One attachment of a program: its link and what it is attached to (`same_netns`: whether
/// lb runs in the namespace `lb status` does, so that an ifindex names a device here).
fn attachment_text(a: &Attachment, same_netns: Option<bool>) -> String {
    let target = match (&a.target, a.ifindex, a.cgroup_id) {
        (Some(t), Some(i), _) => format!("{t} (ifindex {i})"),
        (Some(t), None, _) => t.clone(),
        (None, Some(i), _) if same_netns == Some(false) => format!("ifindex {i} in lb's netns"),
        (None, Some(i), _) => format!("ifindex {i}"),
        (None, None, Some(c)) => format!("cgroup id {c}"),
        (None, None, None) => "?".to_string(),
    };
    format!("{} link {}: {target}", a.link_type, a.link_id)
}

/// The `Maps:` table of `lb status`: entries and how full each map is (no fill for arrays,
/// whose entries all exist).
fn status_maps(maps: &[MapStatus]) -> String {
    let rows: Vec<Vec<String>> = maps
        .iter()
        .map(|m| {
            let array = m.map_type.as_deref().is_some_and(|t| t.ends_with("Array"));
            let fill = match (m.entries, m.max_entries) {
                (Some(e), Some(max)) if max > 0 && !array => {
                    format!("{:.1}%", e as f64 * 100.0 / f64::from(max))
                }
                _ => "-".to_string(),
            };
            vec![
                m.name.clone(),
                or_dash(m.id),
                m.map_type.clone().unwrap_or_else(|| "not pinned".into()),
                or_dash(m.entries),
                or_dash(m.max_entries),
                fill,
            ]
        })
        .collect();
    table(
        &["NAME", "ID", "TYPE", "ENTRIES", "MAX", "FILL"],
        &rows,
        "  ",
    )
}

fn map_status(dir: &Path, name: &str) -> anyhow::Result<MapStatus> {
    let path = dir.join(name);
    if !path.exists() {
        return Ok(MapStatus {
            name: name.into(),
            id: None,
            map_type: None,
            entries: None,
            max_entries: None,
        });
    }
    let info = MapInfo::from_pin(&path).map_err(|e| pin_error(&path, e))?;
    let max = info.max_entries();
    let count = |r: Result<u64, aya::maps::MapError>| {
        r.with_context(|| format!("walking the keys of {}", path.display()))
    };
    let entries = match name {
        map_names::SERVICES4 => {
            count(count_keys(&open_hash::<Svc4Key, SvcValue>(dir, name)?, max))?
        }
        map_names::SERVICES6 => {
            count(count_keys(&open_hash::<Svc6Key, SvcValue>(dir, name)?, max))?
        }
        map_names::BACKENDS4 => count(count_keys(&open_hash::<u32, Backend4>(dir, name)?, max))?,
        map_names::BACKENDS6 => count(count_keys(&open_hash::<u32, Backend6>(dir, name)?, max))?,
        map_names::REVNAT4 => count(count_keys(&open_hash::<u32, RevNat4>(dir, name)?, max))?,
        map_names::REVNAT6 => count(count_keys(&open_hash::<u32, RevNat6>(dir, name)?, max))?,
        map_names::CT_TCP4 | map_names::CT_ANY4 => {
            count(count_keys(&open_hash::<Ct4Key, Ct4Value>(dir, name)?, max))?
        }
        map_names::CT_TCP6 | map_names::CT_ANY6 => {
            count(count_keys(&open_hash::<Ct6Key, Ct6Value>(dir, name)?, max))?
        }
        map_names::SK_REVNAT4 => count(count_keys(
            &open_hash::<SkRevNat4Key, SkRevNat4Value>(dir, name)?,
            max,
        ))?,
        map_names::SK_REVNAT6 => count(count_keys(
            &open_hash::<SkRevNat6Key, SkRevNat6Value>(dir, name)?,
            max,
        ))?,
        // Arrays always hold max_entries elements.
        _ => u64::from(max),
    };
    Ok(MapStatus {
        name: name.into(),
        id: Some(info.id()),
        map_type: info.map_type().ok().map(|t| format!("{t:?}")),
        entries: Some(entries),
        max_entries: Some(max),
    })
}

/// `BPF_PROG_TYPE_SCHED_CLS` → `sched_cls`.
fn prog_type_name(debug: &str) -> String {
    debug
        .strip_prefix("BPF_PROG_TYPE_")
        .unwrap_or(debug)
        .to_lowercase()
}

fn link_type_name(t: Result<LinkType, aya::programs::links::LinkError>) -> String {
    match t {
        Ok(LinkType::Tcx) => "tcx".into(),
        Ok(LinkType::Cgroup) => "cgroup".into(),
        Ok(LinkType::Netkit) => "netkit".into(),
        Ok(LinkType::Xdp) => "xdp".into(),
        Ok(other) => format!("{other:?}").to_lowercase(),
        Err(_) => "unknown".into(),
    }
}

/// lb's programs that use at least one of the maps pinned in `dir` (so programs of another lb
/// with another pin dir are not counted), with their bpf_link attachments.
/// lb's programs using the maps in `dir` and their links; tc/XDP ifindexes are named only
/// when `same_netns` (they are lb's namespace's).
fn programs(dir: &Path, same_netns: bool) -> anyhow::Result<Vec<ProgramStatus>> {
    let mut pinned_ids = BTreeSet::new();
    for name in map_names::ALL {
        let path = dir.join(name);
        if path.exists() {
            let info = MapInfo::from_pin(&path).map_err(|e| pin_error(&path, e))?;
            pinned_ids.insert(info.id());
        }
    }
    let mut progs = Vec::new();
    for info in loaded_programs() {
        // A program may be unloaded between listing and reading; skip it.
        let Ok(info) = info else { continue };
        let Some(name) = info.name_as_str() else {
            continue;
        };
        if !PROGRAM_NAMES.contains(&name) {
            continue;
        }
        let Ok(Some(map_ids)) = info.map_ids() else {
            continue;
        };
        if !map_ids.iter().any(|id| pinned_ids.contains(id)) {
            continue;
        }
        progs.push(ProgramStatus {
            name: name.to_string(),
            id: info.id(),
            prog_type: prog_type_name(&format!("{:?}", info.program_type())),
            attachments: Vec::new(),
        });
    }
    let cgroup_roots = cgroup2_mounts().unwrap_or_default();
    for link in loaded_links() {
        let Ok(link) = link else { continue };
        let Some(prog) = progs.iter_mut().find(|p| p.id == link.program_id()) else {
            continue;
        };
        let link_type = link.link_type();
        let mut att = Attachment {
            link_id: link.id(),
            link_type: link_type_name(link.link_type()),
            target: None,
            ifindex: None,
            cgroup_id: None,
        };
        if let Some(raw) = raw_link_info(link.id()) {
            match link_type {
                Ok(LinkType::Tcx | LinkType::Netkit | LinkType::Xdp) => {
                    let ifindex = u32::from_ne_bytes([raw[0], raw[1], raw[2], raw[3]]);
                    att.ifindex = Some(ifindex);
                    att.target = if_name(ifindex).filter(|_| same_netns);
                }
                Ok(LinkType::Cgroup) => {
                    let mut id = [0u8; 8];
                    id.copy_from_slice(&raw[..8]);
                    let id = u64::from_ne_bytes(id);
                    att.cgroup_id = Some(id);
                    att.target = cgroup_roots
                        .iter()
                        .find_map(|root| find_cgroup(root, id))
                        .map(|p| p.display().to_string());
                }
                _ => {}
            }
        }
        prog.attachments.push(att);
    }
    progs.sort_by(|a, b| (&a.name, a.id).cmp(&(&b.name, b.id)));
    Ok(progs)
}

const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
const BPF_LINK_GET_FD_BY_ID: libc::c_long = 30;

/// The first 16 bytes of `bpf_link_info`'s per-type union for link `id` (aya 0.14's `LinkInfo`
/// does not expose them): `cgroup.cgroup_id` (u64), or `tcx`/`xdp`/`netkit`'s `ifindex` (u32).
fn raw_link_info(id: u32) -> Option<[u8; 16]> {
    #[repr(C)]
    struct GetFdAttr {
        link_id: u32,
        next_id: u32,
        open_flags: u32,
    }
    #[repr(C)]
    struct InfoAttr {
        bpf_fd: u32,
        info_len: u32,
        info: u64,
    }
    /// `struct bpf_link_info` up to 16 bytes of its union (which is 8-aligned, at offset 16).
    #[repr(C)]
    struct LinkInfo {
        link_type: u32,
        id: u32,
        prog_id: u32,
        pad: u32,
        union: [u8; 16],
    }
    let attr = GetFdAttr {
        link_id: id,
        next_id: 0,
        open_flags: 0,
    };
    // SAFETY: bpf(BPF_LINK_GET_FD_BY_ID) reads `attr` (a valid, fully initialized prefix of
    // `union bpf_attr`, size passed) and returns a new fd or -1.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_LINK_GET_FD_BY_ID,
            &raw const attr,
            size_of::<GetFdAttr>(),
        )
    };
    let fd = RawFd::try_from(fd).ok().filter(|fd| *fd >= 0)?;
    // SAFETY: the kernel just returned this fd to us; nothing else owns it.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut info = LinkInfo {
        link_type: 0,
        id: 0,
        prog_id: 0,
        pad: 0,
        union: [0; 16],
    };
    let attr = InfoAttr {
        bpf_fd: u32::try_from(fd.as_raw_fd()).ok()?,
        info_len: u32::try_from(size_of::<LinkInfo>()).ok()?,
        info: u64::try_from((&raw mut info).expose_provenance()).ok()?,
    };
    // SAFETY: bpf(BPF_OBJ_GET_INFO_BY_FD) writes at most `info_len` bytes to `info`, which
    // points to a live, writable LinkInfo of that size.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_OBJ_GET_INFO_BY_FD,
            &raw const attr,
            size_of::<InfoAttr>(),
        )
    };
    (rc == 0 && info.id == id).then_some(info.union)
}

/// Interface name of `ifindex` in the caller's network namespace.
fn if_name(ifindex: u32) -> Option<String> {
    let mut buf = [0 as libc::c_char; libc::IF_NAMESIZE];
    // SAFETY: if_indextoname writes at most IF_NAMESIZE bytes (NUL included) into buf.
    let p = unsafe { libc::if_indextoname(ifindex, buf.as_mut_ptr()) };
    if p.is_null() {
        return None;
    }
    // SAFETY: on success buf holds a NUL-terminated string.
    let name = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) };
    Some(name.to_string_lossy().into_owned())
}

/// The cgroup directory under `root` whose inode number is `id` (cgroup v2 ids are kernfs
/// inode numbers). Walks at most 100 000 directories.
fn find_cgroup(root: &Path, id: u64) -> Option<PathBuf> {
    let mut stack = vec![root.to_path_buf()];
    let mut seen = 0;
    while let Some(dir) = stack.pop() {
        seen += 1;
        if seen > 100_000 {
            return None;
        }
        if fs::metadata(&dir).is_ok_and(|m| m.ino() == id) {
            return Some(dir);
        }
        let Ok(entries) = fs::read_dir(&dir) else {
            continue;
        };
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                stack.push(e.path());
            }
        }
    }
    None
}

/// Collects everything `lb status` shows.
pub fn status(dir: &Path) -> anyhow::Result<Status> {
    check_pin_dir(dir)?;
    let meta = crate::datapath::meta::check(dir)?;
    let own_netns = crate::datapath::meta::own_netns_inode();
    let netns_inode = meta.map(|m| m.netns_inode).filter(|&i| i != 0);
    let same_netns = match (netns_inode, own_netns) {
        (Some(theirs), Some(ours)) => Some(theirs == ours),
        _ => None,
    };
    let release = fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into());
    let version = KernelVersion::current().ok();
    let at_least = |maj, min| version.is_some_and(|v| v >= KernelVersion::new(maj, min, 0));
    let maps = map_names::ALL
        .iter()
        .map(|name| map_status(dir, name))
        .collect::<anyhow::Result<Vec<_>>>()?;
    Ok(Status {
        pin_dir: dir.display().to_string(),
        pins: PinsStatus {
            layout_version: meta.map(|m| m.layout_version),
            lb_version: meta.map(|m| crate::datapath::meta::lb_version(&m)),
            netns_inode,
            same_netns,
        },
        kernel: KernelStatus {
            release,
            version: version.map(|v| v.to_string()),
        },
        features: Features {
            btf: Path::new("/sys/kernel/btf/vmlinux").exists(),
            tcx: at_least(6, 6),
            cgroup_link: at_least(5, 7),
        },
        kernel_features: crate::datapath::features::probe(&[], crate::datapath::load::XdpMode::Off)
            .features,
        programs: programs(dir, same_netns != Some(false))?,
        maps,
        counters: read_counters(dir)?
            .into_iter()
            .map(|c| CounterStatus {
                name: c.name.into(),
                packets: c.packets,
                bytes: c.bytes,
            })
            .collect(),
    })
}

/// Writes to stdout; a closed pipe (`lb services | head`) is not an error.
fn print(text: &str) -> anyhow::Result<()> {
    match io::stdout().lock().write_all(text.as_bytes()) {
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => Ok(()),
        r => r.context("writing to stdout"),
    }
}

fn print_json<T: Serialize>(value: &T) -> anyhow::Result<()> {
    let mut text = serde_json::to_string_pretty(value)?;
    text.push('\n');
    print(&text)
}

/// `lb services`.
pub fn services_cmd(args: &ServicesArgs) -> anyhow::Result<()> {
    let dump = BpfMaps::open_pinned(&args.pin_dir)?
        .dump()
        .context("reading the pinned maps")?;
    let views = service_views(&dump, &read_names(&args.state_dir));
    if args.json {
        print_json(&views)
    } else {
        print(&render_services(&views))
    }
}

/// `lb backends`.
pub fn backends_cmd(args: &PinDirArgs) -> anyhow::Result<()> {
    let dump = BpfMaps::open_pinned(&args.pin_dir)?
        .dump()
        .context("reading the pinned maps")?;
    let views = backend_views(&dump);
    if args.json {
        print_json(&views)
    } else {
        print(&render_backends(&views))
    }
}

/// `lb status`.
pub fn status_cmd(args: &PinDirArgs) -> anyhow::Result<()> {
    let s = status(&args.pin_dir)?;
    if args.json {
        print_json(&s)
    } else {
        print(&render_status(&s))
    }
}
