//! Loading lb's eBPF object, pinning and reusing its maps, attaching its programs.
use std::{
    collections::{BTreeMap, BTreeSet},
    fs::{self, File},
    net::IpAddr,
    os::{fd::AsFd as _, unix::fs::PermissionsExt as _},
    path::{Path, PathBuf},
};

use anyhow::{Context as _, bail};
use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, HashMap, LpmTrie, MapData, MapInfo, MapType, lpm_trie::Key as LpmKey},
    programs::{
        CgroupAttachMode, CgroupSkb, CgroupSkbAttachType, CgroupSockAddr, Program, ProgramType,
        SchedClassifier, TcAttachType, Xdp,
        links::FdLink,
        tc::{self, NlOptions, SchedClassifierLink, TcAttachOptions},
        xdp::XdpMode as AyaXdpMode,
    },
    sys::{BpfHelper, is_helper_supported},
    util::KernelVersion,
};
use lb_common::{
    Affinity4Key, Affinity6Key, AffinityMatchKey, AffinityValue, Backend4, Backend6, ClusterCidr4,
    ClusterCidr6, ClusterIp4Key, ClusterIp6Key, ClusterIpValue, Ct4Key, Ct4Value, Ct6Key, Ct6Value,
    EchoKey4, EchoKey6, EchoValue, LbConfig, MetricValue, PinMeta, RevNat4, RevNat6, SkRevNat4Key,
    SkRevNat4Value, SkRevNat6Key, SkRevNat6Value, SkStore4, SkStore6, SrcRange4, SrcRange6,
    Svc4Key, Svc6Key, SvcCidrValue, SvcValue, globals, maglev, map_names, map_sizes, prog_names,
};

use super::{
    links,
    maps::{BpfMaps, MaglevGeometry, Table},
};
pub use crate::config::XdpMode;
use crate::{config::valid_table_size, model::Family, node::NodeFacts};

/// The eBPF object, built from lb-ebpf by build.rs on every build.
pub static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/lb-ebpf"));

/// The cgroup sock_addr programs, attached together.
pub const SOCK_PROGRAMS: [&str; 8] = [
    prog_names::CONNECT4,
    prog_names::SENDMSG4,
    prog_names::RECVMSG4,
    prog_names::GETPEERNAME4,
    prog_names::CONNECT6,
    prog_names::SENDMSG6,
    prog_names::RECVMSG6,
    prog_names::GETPEERNAME6,
];

/// What each map must look like; a pinned map that differs was made by an incompatible lb.
struct MapSpec {
    name: &'static str,
    map_type: MapType,
    key_size: usize,
    value_size: usize,
    max_entries: u32,
}

const fn spec<K, V>(name: &'static str, map_type: MapType, max_entries: u32) -> MapSpec {
    MapSpec {
        name,
        map_type,
        key_size: size_of::<K>(),
        value_size: size_of::<V>(),
        max_entries,
    }
}

const MAP_SPECS: [MapSpec; 32] = [
    spec::<Svc4Key, SvcValue>(map_names::SERVICES4, MapType::Hash, map_sizes::SERVICES),
    spec::<u32, Backend4>(map_names::BACKENDS4, MapType::Hash, map_sizes::BACKENDS),
    spec::<u32, RevNat4>(map_names::REVNAT4, MapType::Hash, map_sizes::REVNAT),
    spec::<Ct4Key, Ct4Value>(map_names::CT_TCP4, MapType::LruHash, map_sizes::CT_TCP),
    spec::<Ct4Key, Ct4Value>(map_names::CT_ANY4, MapType::LruHash, map_sizes::CT_ANY),
    spec::<SkRevNat4Key, SkRevNat4Value>(
        map_names::SK_REVNAT4,
        MapType::LruHash,
        map_sizes::SK_REVNAT,
    ),
    spec::<Svc6Key, SvcValue>(map_names::SERVICES6, MapType::Hash, map_sizes::SERVICES),
    spec::<u32, Backend6>(map_names::BACKENDS6, MapType::Hash, map_sizes::BACKENDS),
    spec::<u32, RevNat6>(map_names::REVNAT6, MapType::Hash, map_sizes::REVNAT),
    spec::<Ct6Key, Ct6Value>(map_names::CT_TCP6, MapType::LruHash, map_sizes::CT_TCP),
    spec::<Ct6Key, Ct6Value>(map_names::CT_ANY6, MapType::LruHash, map_sizes::CT_ANY),
    spec::<SkRevNat6Key, SkRevNat6Value>(
        map_names::SK_REVNAT6,
        MapType::LruHash,
        map_sizes::SK_REVNAT,
    ),
    spec::<u32, MetricValue>(map_names::METRICS, MapType::PerCpuArray, map_sizes::METRICS),
    spec::<u32, LbConfig>(map_names::CONFIG, MapType::Array, 1),
    spec::<u32, PinMeta>(map_names::META, MapType::Array, 1),
    spec::<LpmKey<ClusterCidr4>, u8>(
        map_names::CLUSTER_CIDR4,
        MapType::LpmTrie,
        map_sizes::CLUSTER_CIDR,
    ),
    spec::<LpmKey<ClusterCidr6>, u8>(
        map_names::CLUSTER_CIDR6,
        MapType::LpmTrie,
        map_sizes::CLUSTER_CIDR,
    ),
    spec::<ClusterIp4Key, ClusterIpValue>(
        map_names::CLUSTER_IPS4,
        MapType::Hash,
        map_sizes::CLUSTER_IPS,
    ),
    spec::<ClusterIp6Key, ClusterIpValue>(
        map_names::CLUSTER_IPS6,
        MapType::Hash,
        map_sizes::CLUSTER_IPS,
    ),
    spec::<EchoKey4, EchoValue>(map_names::ECHO4, MapType::Hash, map_sizes::ECHO),
    spec::<EchoKey6, EchoValue>(map_names::ECHO6, MapType::Hash, map_sizes::ECHO),
    spec::<LpmKey<[u8; 4]>, SvcCidrValue>(
        map_names::SVC_CIDR4,
        MapType::LpmTrie,
        map_sizes::SVC_CIDR,
    ),
    spec::<LpmKey<[u8; 16]>, SvcCidrValue>(
        map_names::SVC_CIDR6,
        MapType::LpmTrie,
        map_sizes::SVC_CIDR,
    ),
    spec::<LpmKey<SrcRange4>, u8>(
        map_names::SRC_RANGE4,
        MapType::LpmTrie,
        map_sizes::SRC_RANGE,
    ),
    spec::<LpmKey<SrcRange6>, u8>(
        map_names::SRC_RANGE6,
        MapType::LpmTrie,
        map_sizes::SRC_RANGE,
    ),
    spec::<Affinity4Key, AffinityValue>(
        map_names::AFFINITY4,
        MapType::LruHash,
        map_sizes::AFFINITY,
    ),
    spec::<Affinity6Key, AffinityValue>(
        map_names::AFFINITY6,
        MapType::LruHash,
        map_sizes::AFFINITY,
    ),
    spec::<AffinityMatchKey, u8>(map_names::AFF_MATCH4, MapType::Hash, map_sizes::AFF_MATCH),
    spec::<AffinityMatchKey, u8>(map_names::AFF_MATCH6, MapType::Hash, map_sizes::AFF_MATCH),
    // max_entries: tables × M, from `LoadOptions::maglev_geometry` (never `--bpf-map-max`).
    spec::<u32, u32>(map_names::MAGLEV, MapType::Array, 0),
    // Socket storage: keyed by a socket fd, sized by the sockets (max_entries is always 0).
    spec::<i32, SkStore4>(map_names::SK_STORE4, MapType::SkStorage, 0),
    spec::<i32, SkStore6>(map_names::SK_STORE6, MapType::SkStorage, 0),
];

/// Where a tc program is attached, which decides the frontends' scope it uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TcHook {
    /// Ingress of an external-facing device (`lb_tc_ingress`): external scope.
    External,
    /// Ingress of the host side of a pod's veth (`lb_tc_pod`): in-cluster traffic, internal
    /// scope, like socket LB.
    Pod,
    /// Egress (`lb_tc_egress`): reverse NAT of replies only.
    Egress,
}

impl TcHook {
    /// The program attached at this hook.
    pub fn program(self) -> &'static str {
        match self {
            TcHook::External => prog_names::TC_INGRESS,
            TcHook::Pod => prog_names::TC_POD,
            TcHook::Egress => prog_names::TC_EGRESS,
        }
    }
}

/// `LB_NO_SK_STORAGE=1`: socket LB keeps its pairs in `lb*_sk_revnat` alone, as on kernels
/// without socket storage (for `lb run` in tests of that fallback, and for benchmarks
/// comparing the two); sets `LoadOptions::no_sk_storage`.
pub fn sk_storage_off_by_env() -> bool {
    std::env::var_os("LB_NO_SK_STORAGE").is_some_and(|v| v == "1")
}

/// Where the maps live.
#[derive(Clone, Debug, Default)]
pub struct LoadOptions {
    /// Pin (and reuse) the maps in this bpffs directory; `None` gives private maps that vanish
    /// with the process (tests, `lb trace --manifests`).
    pub pin_dir: Option<PathBuf>,
    /// With `pin_dir`: reuse only these pinned maps, which must exist, and keep every other map
    /// private. `lb trace` shares the live services but never touches live conntrack or
    /// counters this way.
    pub only_pinned: Option<Vec<&'static str>>,
    /// max_entries per map name, overriding lb-common's defaults (`--bpf-map-max`, and the
    /// conntrack maps' `--bpf-ct-global-*-max`).
    pub max_entries: BTreeMap<String, u32>,
    /// Conntrack lifetimes (`--bpf-ct-timeout-regular-*`), the datapath's read-only globals.
    pub ct_timeouts: crate::config::CtTimeouts,
    /// The tc programs write each packet's decision into `lb_trace` (a `TraceRecord`), for
    /// `lb trace` and tests. `lb_trace` is never pinned, so each load reads only its own.
    pub trace: bool,
    /// Refuse socket-LB calls with EPERM even where the kernel would let them fail with
    /// ECONNREFUSED (tests of the fallback older kernels get).
    pub no_set_retval: bool,
    /// Keep socket LB's pairs in `lb*_sk_revnat` even where the kernel offers socket storage
    /// (tests of the fallback older kernels get).
    pub no_sk_storage: bool,
    /// With `pin_dir`: attachments outlive the process (links pinned under `links/`, netlink
    /// filters left in place) and a later load adopts them (`lb run`; see `links`).
    pub persist_links: bool,
    /// M of the Maglev tables (`--maglev-table-size`); 0: `maglev::DEFAULT_TABLE_SIZE`.
    pub maglev_table_size: u32,
    /// Maglev tables in `lb_maglev` (`--bpf-maglev-tables`); 0:
    /// `maglev::DEFAULT_TABLES_RANDOM`.
    pub maglev_tables: u32,
}

impl LoadOptions {
    /// `lb_maglev`'s shape with the defaults filled in.
    pub fn maglev_geometry(&self) -> MaglevGeometry {
        let or = |v: u32, d: u32| if v == 0 { d } else { v };
        MaglevGeometry {
            table_size: or(self.maglev_table_size, maglev::DEFAULT_TABLE_SIZE),
            tables: or(self.maglev_tables, maglev::DEFAULT_TABLES_RANDOM),
        }
    }

    /// The max_entries `name` gets: the override, else the default.
    pub fn max_entries_of(&self, name: &str) -> u32 {
        if name == map_names::MAGLEV {
            let g = self.maglev_geometry();
            return g.tables.saturating_mul(g.table_size);
        }
        self.max_entries.get(name).copied().unwrap_or_else(|| {
            MAP_SPECS
                .iter()
                .find(|s| s.name == name)
                .map_or(0, |s| s.max_entries)
        })
    }

    /// Rejects unknown map names and sizes the kernel would refuse.
    pub fn validate(&self) -> anyhow::Result<()> {
        let g = self.maglev_geometry();
        if !valid_table_size(g.table_size) {
            bail!(
                "Maglev table size {} is not one of the allowed primes {:?}",
                g.table_size,
                maglev::TABLE_SIZES
            );
        }
        if u64::from(g.tables) * u64::from(g.table_size) > u64::from(u32::MAX / 8) {
            bail!(
                "{} Maglev tables of {} cells exceed what one array map holds",
                g.tables,
                g.table_size
            );
        }
        self.ct_timeouts.validate()?;
        for (name, n) in &self.max_entries {
            if name == map_names::MAGLEV {
                bail!("{name} is sized by --bpf-maglev-tables and --maglev-table-size");
            }
            if name == map_names::SK_STORE4 || name == map_names::SK_STORE6 {
                bail!("{name} is socket storage: it grows with the sockets and takes no size");
            }
            if !MAP_SPECS.iter().any(|s| s.name == name) {
                bail!("unknown map {name:?}; maps: {}", map_names::ALL.join(", "));
            }
            if *n == 0 {
                bail!("map {name} needs at least one entry");
            }
            if name == map_names::METRICS && *n < map_sizes::METRICS {
                bail!("map {name} needs {} entries", map_sizes::METRICS);
            }
        }
        Ok(())
    }
}

/// The maps that describe services: what a read-only tool shares with a running lb.
pub const SERVICE_MAPS: [&str; 16] = [
    map_names::SERVICES4,
    map_names::BACKENDS4,
    map_names::REVNAT4,
    map_names::SERVICES6,
    map_names::BACKENDS6,
    map_names::REVNAT6,
    map_names::CLUSTER_IPS4,
    map_names::CLUSTER_IPS6,
    map_names::ECHO4,
    map_names::ECHO6,
    map_names::SVC_CIDR4,
    map_names::SVC_CIDR6,
    map_names::AFF_MATCH4,
    map_names::AFF_MATCH6,
    map_names::SRC_RANGE4,
    map_names::SRC_RANGE6,
];

/// Pins `link` at `path` (creating the links directory); the pin keeps it attached after this
/// process exits.
fn pin_link(link: FdLink, path: &Path) -> anyhow::Result<()> {
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        fs::set_permissions(dir, fs::Permissions::from_mode(0o700))?;
    }
    link.pin(path)
        .with_context(|| format!("pinning a link at {}", path.display()))?;
    // Like the map pins: whoever may open a link pin may detach the program.
    fs::set_permissions(path, fs::Permissions::from_mode(0o600))
        .with_context(|| format!("chmod 0600 {}", path.display()))?;
    Ok(())
}

/// Whether cgroup sock_addr programs may call `bpf_set_retval` (5.18+ for some hooks, every
/// connect/sendmsg hook on current kernels), probed by loading a tiny program that calls it.
pub fn sock_set_retval_supported() -> bool {
    match is_helper_supported(ProgramType::CgroupSockAddr, BpfHelper::BPF_FUNC_set_retval) {
        Ok(yes) => yes,
        Err(e) => {
            tracing::debug!(error = %e, "bpf_set_retval probe failed; assuming absent");
            false
        }
    }
}

/// Whether socket LB may keep its pairs in socket storage: `bpf_sk_storage_get` for cgroup
/// sock_addr programs (with `ctx->sk`, both 5.8+ by the kernel's history; probed, not assumed)
/// and for cgroup skb programs (`lb_sk_egress` reads the same storage; 5.2+).
pub fn sock_storage_supported() -> bool {
    [ProgramType::CgroupSockAddr, ProgramType::CgroupSkb]
        .into_iter()
        .all(
            |t| match is_helper_supported(t, BpfHelper::BPF_FUNC_sk_storage_get) {
                Ok(yes) => yes,
                Err(e) => {
                    tracing::debug!(error = %e, "bpf_sk_storage_get probe failed; assuming absent");
                    false
                }
            },
        )
}

/// Checks the pin dir before loading: every map `pinned` names is there (`only_pinned`: a
/// running lb's), or the dir is made ready for new pins; then the pins' layout version,
/// Maglev geometry and map shapes.
fn check_pin_dir(dir: &Path, opts: &LoadOptions, pinned: &[&str]) -> anyhow::Result<()> {
    if opts.only_pinned.is_some() {
        for name in pinned {
            let path = dir.join(name);
            if !path.exists() {
                bail!(
                    "no pinned map {}: is `lb run` running? (--pin-dir)",
                    path.display()
                );
            }
        }
    } else {
        prepare_pin_dir(dir)?;
    }
    // The version first: it explains a layout change better than a size mismatch.
    let meta = super::meta::check(dir)?;
    super::meta::check_maglev(dir, meta.as_ref(), opts.maglev_geometry().table_size)?;
    check_pinned_maps(dir, opts)
}

/// Sets the maps' sizes and the frozen globals the programs are verified with; returns
/// whether the programs may call `bpf_set_retval`, and whether socket LB uses socket storage.
fn configure_loader<'a>(
    loader: &mut EbpfLoader<'a>,
    opts: &'a LoadOptions,
    maglev: &'a MaglevGeometry,
) -> (bool, bool) {
    for (name, n) in &opts.max_entries {
        loader.map_max_entries(name, *n);
    }
    loader.map_max_entries(map_names::MAGLEV, opts.max_entries_of(map_names::MAGLEV));
    // Frozen .rodata like LB_TRACE: the datapath's M is always the tables' M.
    loader.override_global(globals::MAGLEV_TABLE_SIZE, &maglev.table_size, true);
    if opts.trace {
        // A .rodata global: the kernel freezes it, so with the default 0 the verifier
        // prunes the tracing code from production loads.
        loader.override_global(globals::TRACE, &1u8, true);
    }
    let t = &opts.ct_timeouts;
    for (name, secs) in [
        (globals::CT_TIMEOUT_TCP_SYN, &t.tcp_syn),
        (globals::CT_TIMEOUT_TCP, &t.tcp),
        (globals::CT_TIMEOUT_TCP_FIN, &t.tcp_fin),
        (globals::CT_TIMEOUT_ANY, &t.any),
    ] {
        loader.override_global(name, secs, true);
    }
    let sk_storage = !opts.no_sk_storage && sock_storage_supported();
    if sk_storage {
        // Frozen like LB_TRACE: with 0 the storage calls stay unverified dead code.
        loader.override_global(globals::HAS_SK_STORAGE, &1u8, true);
    }
    let set_retval = !opts.no_set_retval && sock_set_retval_supported();
    if set_retval {
        // Frozen like LB_TRACE: with 0 the helper call stays unverified dead code.
        loader.override_global(globals::HAS_SET_RETVAL, &1u8, true);
    }
    (set_retval, sk_storage)
}

/// Makes new pins private (0600) and, in a pin dir, records their layout version.
fn finish_pins(
    ebpf: &mut Ebpf,
    opts: &LoadOptions,
    pins: &[(&str, PathBuf)],
    maglev: MaglevGeometry,
) -> anyhow::Result<()> {
    for (_, path) in pins {
        fs::set_permissions(path, fs::Permissions::from_mode(0o600))
            .with_context(|| format!("chmod 0600 {}", path.display()))?;
    }
    if opts.pin_dir.is_some() {
        super::meta::write(
            ebpf.map_mut(map_names::META)
                .context("map lb_meta missing")?,
            maglev.table_size,
        )?;
    }
    Ok(())
}

/// Loads every program into the kernel (the verifier runs here).
fn load_programs(ebpf: &mut Ebpf) -> anyhow::Result<()> {
    for (name, program) in ebpf.programs_mut() {
        let r = match program {
            Program::SchedClassifier(p) => p.load(),
            Program::CgroupSockAddr(p) => p.load(),
            Program::CgroupSkb(p) => p.load(),
            Program::Xdp(p) => p.load(),
            _ => continue,
        };
        r.with_context(|| format!("loading program {name} (verifier)"))?;
    }
    Ok(())
}

/// The loaded programs and maps. Dropping it detaches everything it attached.
pub struct Datapath {
    ebpf: Ebpf,
    attachments: Vec<String>,
    /// The pin dir when attachments persist (`LoadOptions::persist_links`).
    link_pins: Option<PathBuf>,
    /// The link pins this run uses (kept by `prune_links`).
    used_links: Vec<PathBuf>,
    max_entries: BTreeMap<String, u32>,
    set_retval: bool,
    sk_storage: bool,
    maglev: MaglevGeometry,
}

impl Datapath {
    pub fn load(opts: &LoadOptions) -> anyhow::Result<Self> {
        raise_memlock_limit();
        opts.validate()?;
        let pinned: Vec<&str> = match &opts.only_pinned {
            Some(names) => names.clone(),
            None => map_names::ALL.to_vec(),
        };
        if let Some(dir) = &opts.pin_dir {
            check_pin_dir(dir, opts, &pinned)?;
        }
        let mut loader = EbpfLoader::new();
        let maglev = opts.maglev_geometry();
        let (set_retval, sk_storage) = configure_loader(&mut loader, opts, &maglev);
        let pins: Vec<(&str, PathBuf)> = match &opts.pin_dir {
            Some(dir) => pinned.iter().map(|n| (*n, dir.join(n))).collect(),
            None => Vec::new(),
        };
        for (name, path) in &pins {
            loader.map_pin_path(name, path.as_path());
        }
        let mut ebpf = loader
            .load(EBPF_OBJECT)
            .context("loading lb's eBPF object (maps and BTF)")?;
        if opts.only_pinned.is_none() {
            finish_pins(&mut ebpf, opts, &pins, maglev)?;
        }
        load_programs(&mut ebpf)?;
        let max_entries = MAP_SPECS
            .iter()
            .map(|s| (s.name.to_string(), opts.max_entries_of(s.name)))
            .collect();
        Ok(Self {
            ebpf,
            attachments: Vec::new(),
            link_pins: opts.pin_dir.clone().filter(|_| opts.persist_links),
            used_links: Vec::new(),
            max_entries,
            set_retval,
            sk_storage,
            maglev,
        })
    }

    /// Whether socket LB keeps its pairs in socket storage (`lb*_sk_store`; else
    /// `lb*_sk_revnat` alone).
    pub fn sock_uses_sk_storage(&self) -> bool {
        self.sk_storage
    }

    /// Whether refused socket-LB calls fail with ECONNREFUSED (else EPERM).
    pub fn sock_refuses_with_econnrefused(&self) -> bool {
        self.set_retval
    }

    /// Makes the `--service-cidr` tries hold exactly `cidrs` (host bits are cleared). Pinned
    /// tries keep what an earlier run wrote until this rewrites them, so call it before
    /// attaching.
    pub fn set_service_cidrs(&mut self, cidrs: &[(IpAddr, u8)]) -> anyhow::Result<()> {
        let mut want4 = BTreeSet::new();
        let mut want6 = BTreeSet::new();
        for (addr, prefix) in cidrs {
            match addr {
                IpAddr::V4(a) if *prefix <= 32 => {
                    let mask = u32::MAX.checked_shl(32 - u32::from(*prefix)).unwrap_or(0);
                    want4.insert((u32::from(*prefix), (u32::from(*a) & mask).to_be_bytes()));
                }
                IpAddr::V6(a) if *prefix <= 128 => {
                    let mask = u128::MAX.checked_shl(128 - u32::from(*prefix)).unwrap_or(0);
                    want6.insert((u32::from(*prefix), (u128::from(*a) & mask).to_be_bytes()));
                }
                _ => bail!("bad service CIDR {addr}/{prefix}"),
            }
        }
        sync_trie(&mut self.ebpf, map_names::SVC_CIDR4, &want4)?;
        sync_trie(&mut self.ebpf, map_names::SVC_CIDR6, &want6)
    }

    /// Attaches the tc program for `hook` to `iface` (TCX on 6.6+, a clsact qdisc filter
    /// before). With persisting links, a predecessor's attachment is adopted instead.
    pub fn attach_tc(&mut self, iface: &str, hook: TcHook) -> anyhow::Result<()> {
        let name = hook.program();
        let attach = match hook {
            TcHook::External | TcHook::Pod => TcAttachType::Ingress,
            TcHook::Egress => TcAttachType::Egress,
        };
        let tcx = !KernelVersion::current().is_ok_and(|v| v < KernelVersion::new(6, 6, 0));
        if !tcx {
            // Netlink attachment needs clsact; it may already be there.
            if let Err(e) = tc::qdisc_add_clsact(iface) {
                tracing::debug!(iface, error = %e, "clsact qdisc not added");
            }
        }
        let pin = self
            .link_pins
            .as_deref()
            .map(|d| links::path(d, &format!("{name}@{iface}")));
        let prog: &mut SchedClassifier = self
            .ebpf
            .program_mut(name)
            .context("tc program missing from the object")?
            .try_into()?;
        let adopted = match (&pin, tcx) {
            (Some(pin), true) => {
                if links::adopt(pin, prog.fd()?.as_fd())? {
                    true
                } else {
                    let id = prog
                        .attach(iface, attach)
                        .with_context(|| format!("attaching {name} to {iface}"))?;
                    let link = FdLink::try_from(prog.take_link(id)?)?;
                    pin_link(link, pin)?;
                    false
                }
            }
            (Some(_), false) => {
                // The filter at lb's priority and handle stays when this process exits; a
                // predecessor's is replaced in place, never duplicated.
                let opts = TcAttachOptions::Netlink(NlOptions {
                    priority: links::TC_NETLINK_PRIORITY,
                    handle: links::TC_NETLINK_HANDLE.into(),
                    ..NlOptions::default()
                });
                let (id, adopted) = match prog.attach_with_options(iface, attach, opts) {
                    Ok(id) => (id, false),
                    Err(_) => {
                        let old = SchedClassifierLink::attached(
                            iface,
                            attach,
                            links::TC_NETLINK_PRIORITY,
                            links::TC_NETLINK_HANDLE.into(),
                            None,
                        )?;
                        let id = prog
                            .attach_to_link(old)
                            .with_context(|| format!("replacing {name}'s filter on {iface}"))?;
                        (id, true)
                    }
                };
                std::mem::forget(prog.take_link(id)?);
                adopted
            }
            (None, _) => {
                prog.attach(iface, attach)
                    .with_context(|| format!("attaching {name} to {iface}"))?;
                false
            }
        };
        if let Some(pin) = pin {
            self.used_links.push(pin);
        }
        self.attachments.push(format!(
            "{name} on {iface}{}",
            if adopted { " (adopted)" } else { "" }
        ));
        Ok(())
    }

    /// Forgets the tc attachment of `hook` on `iface`, a device that went away (its link went
    /// with it): the pin is removed and `attachments` no longer lists it.
    pub fn forget_tc(&mut self, iface: &str, hook: TcHook) {
        let name = hook.program();
        if let Some(dir) = &self.link_pins {
            let pin = links::path(dir, &format!("{name}@{iface}"));
            links::forget(&pin);
            self.used_links.retain(|p| *p != pin);
        }
        let shown = format!("{name} on {iface}");
        self.attachments
            .retain(|a| a.strip_suffix(" (adopted)").unwrap_or(a) != shown);
    }

    /// Attaches `lb_xdp` to `iface` in `mode` (with bpf_link where the kernel has it). `Off`
    /// attaches nothing. The caller attaches `lb_tc_ingress` beside it: XDP hands it what it
    /// cannot finish. With persisting links, a predecessor's link in the same mode is adopted;
    /// one in another mode is replaced (XDP cannot change mode in place).
    pub fn attach_xdp(&mut self, iface: &str, mode: XdpMode) -> anyhow::Result<()> {
        let flags = match mode.resolve(iface) {
            XdpMode::Native => AyaXdpMode::Driver,
            XdpMode::Generic => AyaXdpMode::Skb,
            XdpMode::Off | XdpMode::Auto => return Ok(()),
        };
        let shown = match flags {
            AyaXdpMode::Driver => "native",
            _ => "generic",
        };
        let pins = self.link_pins.as_deref().map(|d| {
            let other = if shown == "native" {
                "generic"
            } else {
                "native"
            };
            (
                links::path(d, &format!("{}_{shown}@{iface}", prog_names::XDP)),
                links::path(d, &format!("{}_{other}@{iface}", prog_names::XDP)),
            )
        });
        let prog: &mut Xdp = self
            .ebpf
            .program_mut(prog_names::XDP)
            .context("XDP program missing from the object")?
            .try_into()?;
        let mut adopted = false;
        match &pins {
            Some((pin, other)) => {
                if other.exists() {
                    fs::remove_file(other)
                        .with_context(|| format!("removing {}", other.display()))?;
                }
                adopted = links::adopt(pin, prog.fd()?.as_fd())?;
                if !adopted {
                    let id = prog.attach(iface, flags).with_context(|| {
                        format!("attaching {} ({mode:?}) to {iface}", prog_names::XDP)
                    })?;
                    let link = FdLink::try_from(prog.take_link(id)?)?;
                    pin_link(link, pin)?;
                }
                self.used_links.push(pin.clone());
            }
            None => {
                prog.attach(iface, flags).with_context(|| {
                    format!("attaching {} ({mode:?}) to {iface}", prog_names::XDP)
                })?;
            }
        }
        self.attachments.push(format!(
            "{} ({shown}) on {iface}{}",
            prog_names::XDP,
            if adopted { " (adopted)" } else { "" }
        ));
        Ok(())
    }

    /// Attaches the socket-LB programs to the cgroup v2 directory `path`; with persisting
    /// links, a predecessor's are adopted.
    pub fn attach_cgroup(&mut self, path: &Path) -> anyhow::Result<()> {
        let cgroup =
            File::open(path).with_context(|| format!("opening cgroup {}", path.display()))?;
        // The cgroup id (its directory's inode) names the pins: paths may contain anything.
        let id = std::os::unix::fs::MetadataExt::ino(&cgroup.metadata()?);
        let mut adopted = 0;
        for name in SOCK_PROGRAMS {
            let pin = self
                .link_pins
                .as_deref()
                .map(|d| links::path(d, &format!("{name}@cgroup{id}")));
            let prog: &mut CgroupSockAddr = self
                .ebpf
                .program_mut(name)
                .with_context(|| format!("program {name} missing from the object"))?
                .try_into()?;
            if let Some(pin) = &pin
                && links::adopt(pin, prog.fd()?.as_fd())?
            {
                adopted += 1;
                self.used_links.push(pin.clone());
                continue;
            }
            // On 5.7+ aya attaches with bpf_link, which always coexists with other programs
            // and takes no flags (BPF_F_ALLOW_MULTI there is EINVAL).
            let link = prog
                .attach(&cgroup, CgroupAttachMode::Single)
                .with_context(|| format!("attaching {name} to {}", path.display()))?;
            if let Some(pin) = pin {
                let link = FdLink::try_from(prog.take_link(link)?)?;
                pin_link(link, &pin)?;
                self.used_links.push(pin);
            }
        }
        // The connected-UDP re-steering fallback (`lb_sk_egress`, sock_egress.rs) beside them.
        let name = prog_names::SK_EGRESS;
        let pin = self
            .link_pins
            .as_deref()
            .map(|d| links::path(d, &format!("{name}@cgroup{id}")));
        let prog: &mut CgroupSkb = self
            .ebpf
            .program_mut(name)
            .with_context(|| format!("program {name} missing from the object"))?
            .try_into()?;
        if let Some(pin) = &pin
            && links::adopt(pin, prog.fd()?.as_fd())?
        {
            adopted += 1;
            self.used_links.push(pin.clone());
        } else {
            let link = prog
                .attach(
                    &cgroup,
                    CgroupSkbAttachType::Egress,
                    CgroupAttachMode::Single,
                )
                .with_context(|| format!("attaching {name} to {}", path.display()))?;
            if let Some(pin) = pin {
                let link = FdLink::try_from(prog.take_link(link)?)?;
                pin_link(link, &pin)?;
                self.used_links.push(pin);
            }
        }
        self.attachments.push(format!(
            "socket LB on cgroup {}{}",
            path.display(),
            if adopted > 0 { " (adopted)" } else { "" }
        ));
        Ok(())
    }

    /// Removes the pinned links of attachments this run did not make or adopt (a device or
    /// cgroup no longer configured); returns their names.
    pub fn prune_links(&self) -> anyhow::Result<Vec<String>> {
        match &self.link_pins {
            Some(dir) => links::prune(dir, &self.used_links),
            None => Ok(Vec::new()),
        }
    }

    pub fn attachments(&self) -> &[String] {
        &self.attachments
    }

    /// Writes this node's facts for the datapath: `lb_config`, then the cluster-CIDR tries (new
    /// ranges first, stale ones removed after, so a range that stays is never missing).
    pub fn write_node_facts(&mut self, facts: &NodeFacts) -> anyhow::Result<()> {
        let map = self
            .ebpf
            .map_mut(map_names::CONFIG)
            .context("map lb_config missing")?;
        Array::<_, LbConfig>::try_from(map)?
            .set(0, facts.datapath_config(), 0)
            .context("writing lb_config")?;
        let (mut v4, mut v6) = (Vec::new(), Vec::new());
        for c in &facts.cluster_cidrs {
            match c.network() {
                IpAddr::V4(a) => v4.push(LpmKey::new(u32::from(c.prefix), a.octets())),
                IpAddr::V6(a) => v6.push(LpmKey::new(u32::from(c.prefix), a.octets())),
            }
        }
        self.sync_trie(map_names::CLUSTER_CIDR4, &v4)?;
        self.sync_trie(map_names::CLUSTER_CIDR6, &v6)
    }

    /// Makes the LPM trie `name` hold exactly `want`.
    fn sync_trie<K: aya::Pod + PartialEq>(
        &mut self,
        name: &str,
        want: &[LpmKey<K>],
    ) -> anyhow::Result<()> {
        let map = self
            .ebpf
            .map_mut(name)
            .with_context(|| format!("map {name} missing"))?;
        let mut trie = LpmTrie::<_, K, u8>::try_from(map)?;
        for k in want {
            trie.insert(k, 1, 0)
                .with_context(|| format!("writing {name}"))?;
        }
        let same =
            |a: &LpmKey<K>, b: &LpmKey<K>| a.prefix_len() == b.prefix_len() && a.data() == b.data();
        let stale: Vec<LpmKey<K>> = trie
            .keys()
            .filter_map(Result::ok)
            .filter(|k| !want.iter().any(|w| same(w, k)))
            .collect();
        for k in &stale {
            trie.remove(k).with_context(|| format!("pruning {name}"))?;
        }
        Ok(())
    }

    /// Moves the service, backend and rev-NAT maps out, for the reconciler.
    pub fn take_lb_maps(&mut self) -> anyhow::Result<BpfMaps> {
        let mut capacities = BTreeMap::new();
        for t in Table::ALL {
            for f in [Family::V4, Family::V6] {
                let name = t.map_name(f);
                let max = self.max_entries.get(name).copied().unwrap_or(0);
                capacities.insert((t, f), max);
            }
        }
        Ok(BpfMaps {
            services4: self.take(map_names::SERVICES4)?,
            backends4: self.take(map_names::BACKENDS4)?,
            revnat4: self.take(map_names::REVNAT4)?,
            services6: self.take(map_names::SERVICES6)?,
            backends6: self.take(map_names::BACKENDS6)?,
            revnat6: self.take(map_names::REVNAT6)?,
            cluster_ips4: self.take(map_names::CLUSTER_IPS4)?,
            cluster_ips6: self.take(map_names::CLUSTER_IPS6)?,
            src_ranges4: self.take_trie(map_names::SRC_RANGE4)?,
            src_ranges6: self.take_trie(map_names::SRC_RANGE6)?,
            aff_match4: self.take(map_names::AFF_MATCH4)?,
            aff_match6: self.take(map_names::AFF_MATCH6)?,
            echo4: self.take(map_names::ECHO4)?,
            echo6: self.take(map_names::ECHO6)?,
            capacities,
            maglev: Some(
                Array::try_from(
                    self.ebpf
                        .take_map(map_names::MAGLEV)
                        .context("map lb_maglev missing (already taken?)")?,
                )
                .context("map lb_maglev has an unexpected type")?,
            ),
            maglev_geometry: self.maglev,
            held: None,
        })
    }

    /// A descriptor of `lb_udp_gone`, the pairs `lb_sk_egress` drops datagrams for
    /// (`reconcile::resteer` keeps it up to date).
    pub fn udp_gone_map(&self) -> anyhow::Result<super::sockterm::GoneMap> {
        let map = self
            .ebpf
            .map(map_names::UDP_GONE)
            .context("map lb_udp_gone missing")?;
        let aya::maps::Map::LruHashMap(data) = map else {
            bail!("lb_udp_gone is not an LRU hash");
        };
        Ok(super::sockterm::GoneMap(
            data.fd().as_fd().try_clone_to_owned()?,
        ))
    }

    fn take<K: aya::Pod, V: aya::Pod>(
        &mut self,
        name: &str,
    ) -> anyhow::Result<HashMap<MapData, K, V>> {
        let map = self
            .ebpf
            .take_map(name)
            .with_context(|| format!("map {name} missing (already taken?)"))?;
        HashMap::try_from(map).with_context(|| format!("map {name} has an unexpected type"))
    }

    fn take_trie<K: aya::Pod, V: aya::Pod>(
        &mut self,
        name: &str,
    ) -> anyhow::Result<LpmTrie<MapData, K, V>> {
        let map = self
            .ebpf
            .take_map(name)
            .with_context(|| format!("map {name} missing (already taken?)"))?;
        LpmTrie::try_from(map).with_context(|| format!("map {name} has an unexpected type"))
    }

    /// Takes the datapath counters (`lb_metrics`), for `Metrics::set_datapath_counters` to read
    /// at scrape time (the conntrack series come from the GC's walks: `conntrack::Gc`).
    pub fn take_counters(
        &mut self,
    ) -> anyhow::Result<aya::maps::PerCpuArray<MapData, MetricValue>> {
        let counters = self
            .ebpf
            .take_map(map_names::METRICS)
            .context("map lb_metrics missing")?;
        Ok(aya::maps::PerCpuArray::try_from(counters)?)
    }

    /// Starts forwarding kernel-side aya-log records (rare events only) to `tracing`.
    pub fn spawn_kernel_logger(&mut self) {
        match aya_log::EbpfLogger::init(&mut self.ebpf) {
            Ok(logger) => {
                // SAFETY: the logger owns its ring buffer map's fd, which stays open and
                // unchanged for as long as the AsyncFd owns the logger.
                let fd = unsafe {
                    tokio::io::unix::AsyncFd::register_with_interest(
                        logger,
                        tokio::io::Interest::READABLE,
                    )
                };
                match fd {
                    Ok(mut fd) => {
                        tokio::spawn(async move {
                            while let Ok(mut guard) = fd.readable_mut().await {
                                guard.get_inner_mut().flush();
                                guard.clear_ready();
                            }
                        });
                    }
                    Err(e) => tracing::warn!(error = %e, "kernel log reader not started"),
                }
            }
            Err(e) => tracing::warn!(error = %e, "kernel log map not found"),
        }
    }

    /// The loaded object, for tests and tools that run programs directly.
    pub fn ebpf_mut(&mut self) -> &mut Ebpf {
        &mut self.ebpf
    }
}

/// Makes the LPM trie `name` hold exactly `want` (prefix length, address bytes).
fn sync_trie<const N: usize>(
    ebpf: &mut Ebpf,
    name: &str,
    want: &BTreeSet<(u32, [u8; N])>,
) -> anyhow::Result<()>
where
    [u8; N]: aya::Pod,
{
    let map = ebpf
        .map_mut(name)
        .with_context(|| format!("map {name} missing"))?;
    let mut trie: LpmTrie<&mut MapData, [u8; N], SvcCidrValue> =
        LpmTrie::try_from(map).with_context(|| format!("map {name} has an unexpected type"))?;
    let have: Vec<LpmKey<[u8; N]>> = trie.keys().filter_map(Result::ok).collect();
    for key in have {
        if !want.contains(&(key.prefix_len(), key.data())) {
            trie.remove(&key)
                .with_context(|| format!("removing a stale range from {name}"))?;
        }
    }
    for (prefix_len, data) in want {
        let value = SvcCidrValue {
            prefix_len: *prefix_len,
        };
        trie.insert(&LpmKey::new(*prefix_len, *data), value, 0)
            .with_context(|| format!("writing {name}"))?;
    }
    Ok(())
}

/// Kernels before 5.11 charge BPF memory to RLIMIT_MEMLOCK; later ones to the memory cgroup.
fn raise_memlock_limit() {
    let rlim = libc::rlimit {
        rlim_cur: libc::RLIM_INFINITY,
        rlim_max: libc::RLIM_INFINITY,
    };
    // SAFETY: plain syscall with a valid pointer.
    if unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &rlim) } != 0 {
        tracing::debug!(
            error = %std::io::Error::last_os_error(),
            "cannot raise RLIMIT_MEMLOCK (harmless on kernels >= 5.11)"
        );
    }
}

/// Mounts bpffs at `path` (created if missing) unless `path` is a bpffs already; returns
/// whether it mounted one.
pub fn mount_bpffs(path: &Path) -> anyhow::Result<bool> {
    fs::create_dir_all(path).with_context(|| format!("creating {}", path.display()))?;
    let fs_type = nix::sys::statfs::statfs(path)
        .with_context(|| format!("statfs {}", path.display()))?
        .filesystem_type();
    if fs_type == nix::sys::statfs::BPF_FS_MAGIC {
        return Ok(false);
    }
    nix::mount::mount(
        Some("bpf"),
        path,
        Some("bpf"),
        nix::mount::MsFlags::empty(),
        None::<&str>,
    )
    .with_context(|| format!("mount -t bpf bpf {} (needs CAP_SYS_ADMIN)", path.display()))?;
    Ok(true)
}

fn prepare_pin_dir(dir: &Path) -> anyhow::Result<()> {
    let parent = dir.parent().unwrap_or(Path::new("/"));
    let fs_type = nix::sys::statfs::statfs(parent)
        .with_context(|| format!("statfs {}", parent.display()))?
        .filesystem_type();
    if fs_type != nix::sys::statfs::BPF_FS_MAGIC {
        bail!(
            "{} is not on a bpffs mount; mount one with `mount -t bpf bpf /sys/fs/bpf`",
            parent.display()
        );
    }
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    fs::set_permissions(dir, fs::Permissions::from_mode(0o700))
        .with_context(|| format!("chmod 0700 {}", dir.display()))
}

/// The number of tables of the `lb_maglev` pinned in `dir`, if it was laid out with
/// `table_size` cells per table: a restart without `--bpf-maglev-tables` keeps the pinned
/// size (the default depends on `--lb-algorithm`, and a changed default must not refuse the
/// pins).
pub fn pinned_maglev_tables(dir: &Path, table_size: u32) -> Option<u32> {
    let meta = super::meta::read(dir).ok().flatten()?;
    if meta.maglev_table_size != table_size || table_size == 0 {
        return None;
    }
    let info = MapInfo::from_pin(dir.join(map_names::MAGLEV)).ok()?;
    (info.max_entries() % table_size == 0).then(|| info.max_entries() / table_size)
}

/// Refuses pinned maps whose layout this lb does not understand, rather than misreading them.
fn check_pinned_maps(dir: &Path, opts: &LoadOptions) -> anyhow::Result<()> {
    for spec in &MAP_SPECS {
        let path = dir.join(spec.name);
        // A map this load keeps private (`only_pinned`) may have any size in the pins.
        let shared = opts
            .only_pinned
            .as_ref()
            .is_none_or(|names| names.contains(&spec.name));
        if !shared || !path.exists() {
            continue;
        }
        let info = MapInfo::from_pin(&path)
            .with_context(|| format!("reading pinned map {}", path.display()))?;
        let map_type = info.map_type()?;
        let found = (
            map_type,
            info.key_size() as usize,
            info.value_size() as usize,
            info.max_entries(),
        );
        let want = (
            spec.map_type,
            spec.key_size,
            spec.value_size,
            opts.max_entries_of(spec.name),
        );
        if found != want && spec.name == map_names::MAGLEV && found.0 == want.0 {
            bail!(
                "pinned map {} holds {} Maglev cells, this lb wants {} (--bpf-maglev-tables × \
                 --maglev-table-size): run with the flags it was made with, or stop lb and \
                 remove {} (lb rebuilds every table before its programs attach)",
                path.display(),
                found.3,
                want.3,
                path.display()
            );
        }
        if found.0 == want.0 && found.1 == want.1 && found.2 == want.2 && found.3 != want.3 {
            let flag = match spec.name {
                map_names::CT_TCP4 | map_names::CT_TCP6 => "--bpf-ct-global-tcp-max",
                map_names::CT_ANY4 | map_names::CT_ANY6 => "--bpf-ct-global-any-max",
                _ => "--bpf-map-max",
            };
            bail!(
                "pinned map {} has {} entries, this lb is configured for {} ({flag}): a map \
                 cannot be resized in place; keep the old size, or stop lb and remove {} to \
                 start afresh (conntrack entries are lost: established connections through the \
                 tc path are re-balanced)",
                path.display(),
                found.3,
                want.3,
                path.display()
            );
        }
        if found != want {
            bail!(
                "pinned map {} is {:?} with key/value size {}/{} and {} entries, this lb needs \
                 {:?} {}/{} with {}: it was made by an incompatible lb; stop the old lb and \
                 remove {} (established connections through the tc path lose their state)",
                path.display(),
                found.0,
                found.1,
                found.2,
                found.3,
                want.0,
                want.1,
                want.2,
                want.3,
                dir.display()
            );
        }
    }
    Ok(())
}
