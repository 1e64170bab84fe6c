//! The maps, BTF-defined so `bpftool map dump` prints their fields. Userspace pins them by
//! name under the pin directory and reuses them across restarts (all but `lb_trace`,
//! `lb_scratch` and `lb_udp_gone`, which each load owns).
use aya_ebpf::{
    bindings::BPF_F_NO_PREALLOC,
    btf_maps::{Array, HashMap, LpmTrie, LruHashMap, PerCpuArray, SkStorage},
    macros::btf_map,
};
use lb_common::{
    Affinity4Key, Affinity6Key, AffinityMatchKey, AffinityValue, Backend4, Backend6, ClusterCidr4,
    ClusterCidr6, ClusterIp4Key, ClusterIp6Key, ClusterIpValue, Ct4Key, Ct4Value, Ct6Key, Ct6Value,
    EchoKey4, EchoKey6, EchoValue, Frag4Key, Frag6Key, FragEntry, LbConfig, MetricValue, PinMeta,
    RevNat4, RevNat6, SkRevNat4Key, SkRevNat4Value, SkRevNat6Key, SkRevNat6Value, SkStore4,
    SkStore6, SrcRange4, SrcRange6, Svc4Key, Svc6Key, SvcCidrValue, SvcValue, TraceRecord,
    UdpGoneKey, map_sizes,
};

// Service, backend and rev-NAT maps are written by userspace only: no preallocation, so their
// memory follows the cluster's size rather than max_entries.
const NO_PREALLOC: usize = BPF_F_NO_PREALLOC as usize;

#[btf_map(name = "lb4_services")]
pub static SERVICES4: HashMap<Svc4Key, SvcValue, { map_sizes::SERVICES as usize }, NO_PREALLOC> =
    HashMap::new();
#[btf_map(name = "lb4_backends")]
pub static BACKENDS4: HashMap<u32, Backend4, { map_sizes::BACKENDS as usize }, NO_PREALLOC> =
    HashMap::new();
#[btf_map(name = "lb4_revnat")]
pub static REVNAT4: HashMap<u32, RevNat4, { map_sizes::REVNAT as usize }, NO_PREALLOC> =
    HashMap::new();
// Conntrack by protocol (see `map_names::CT_TCP4`); `af` picks the map by the key's protocol.
#[btf_map(name = "lb4_ct_tcp")]
pub static CT_TCP4: LruHashMap<Ct4Key, Ct4Value, { map_sizes::CT_TCP as usize }> =
    LruHashMap::new();
#[btf_map(name = "lb4_ct_any")]
pub static CT_ANY4: LruHashMap<Ct4Key, Ct4Value, { map_sizes::CT_ANY as usize }> =
    LruHashMap::new();
#[btf_map(name = "lb4_sk_revnat")]
pub static SK_REVNAT4: LruHashMap<SkRevNat4Key, SkRevNat4Value, { map_sizes::SK_REVNAT as usize }> =
    LruHashMap::new();

#[btf_map(name = "lb6_services")]
pub static SERVICES6: HashMap<Svc6Key, SvcValue, { map_sizes::SERVICES as usize }, NO_PREALLOC> =
    HashMap::new();
#[btf_map(name = "lb6_backends")]
pub static BACKENDS6: HashMap<u32, Backend6, { map_sizes::BACKENDS as usize }, NO_PREALLOC> =
    HashMap::new();
#[btf_map(name = "lb6_revnat")]
pub static REVNAT6: HashMap<u32, RevNat6, { map_sizes::REVNAT as usize }, NO_PREALLOC> =
    HashMap::new();
#[btf_map(name = "lb6_ct_tcp")]
pub static CT_TCP6: LruHashMap<Ct6Key, Ct6Value, { map_sizes::CT_TCP as usize }> =
    LruHashMap::new();
#[btf_map(name = "lb6_ct_any")]
pub static CT_ANY6: LruHashMap<Ct6Key, Ct6Value, { map_sizes::CT_ANY as usize }> =
    LruHashMap::new();
#[btf_map(name = "lb6_sk_revnat")]
pub static SK_REVNAT6: LruHashMap<SkRevNat6Key, SkRevNat6Value, { map_sizes::SK_REVNAT as usize }> =
    LruHashMap::new();

/// Socket storage (`sk_store`): each socket's own pairs, freed with it. Pinned like
/// `lb*_sk_revnat`, so a restarted lb still translates the sockets it steered before.
#[btf_map(name = "lb4_sk_store")]
pub static SK_STORE4: SkStorage<SkStore4> = SkStorage::new();
#[btf_map(name = "lb6_sk_store")]
pub static SK_STORE6: SkStorage<SkStore6> = SkStorage::new();

#[btf_map(name = "lb4_affinity")]
pub static AFFINITY4: LruHashMap<Affinity4Key, AffinityValue, { map_sizes::AFFINITY as usize }> =
    LruHashMap::new();
#[btf_map(name = "lb6_affinity")]
pub static AFFINITY6: LruHashMap<Affinity6Key, AffinityValue, { map_sizes::AFFINITY as usize }> =
    LruHashMap::new();
/// Written by userspace only; the value is unused (1).
#[btf_map(name = "lb4_aff_match")]
pub static AFF_MATCH4: HashMap<
    AffinityMatchKey,
    u8,
    { map_sizes::AFF_MATCH as usize },
    NO_PREALLOC,
> = HashMap::new();
#[btf_map(name = "lb6_aff_match")]
pub static AFF_MATCH6: HashMap<
    AffinityMatchKey,
    u8,
    { map_sizes::AFF_MATCH as usize },
    NO_PREALLOC,
> = HashMap::new();

#[btf_map(name = "lb4_cluster_ips")]
pub static CLUSTER_IPS4: HashMap<
    ClusterIp4Key,
    ClusterIpValue,
    { map_sizes::CLUSTER_IPS as usize },
    NO_PREALLOC,
> = HashMap::new();
#[btf_map(name = "lb6_cluster_ips")]
pub static CLUSTER_IPS6: HashMap<
    ClusterIp6Key,
    ClusterIpValue,
    { map_sizes::CLUSTER_IPS as usize },
    NO_PREALLOC,
> = HashMap::new();
#[btf_map(name = "lb4_echo")]
pub static ECHO4: HashMap<EchoKey4, EchoValue, { map_sizes::ECHO as usize }, NO_PREALLOC> =
    HashMap::new();
#[btf_map(name = "lb6_echo")]
pub static ECHO6: HashMap<EchoKey6, EchoValue, { map_sizes::ECHO as usize }, NO_PREALLOC> =
    HashMap::new();
#[btf_map(name = "lb4_svc_cidr")]
pub static SVC_CIDR4: LpmTrie<[u8; 4], SvcCidrValue, { map_sizes::SVC_CIDR as usize }> =
    LpmTrie::new();
#[btf_map(name = "lb6_svc_cidr")]
pub static SVC_CIDR6: LpmTrie<[u8; 16], SvcCidrValue, { map_sizes::SVC_CIDR as usize }> =
    LpmTrie::new();

/// `loadBalancerSourceRanges` per rev-NAT id; the value is unused (1).
#[btf_map(name = "lb4_src_range")]
pub static SRC_RANGE4: LpmTrie<SrcRange4, u8, { map_sizes::SRC_RANGE as usize }> = LpmTrie::new();
#[btf_map(name = "lb6_src_range")]
pub static SRC_RANGE6: LpmTrie<SrcRange6, u8, { map_sizes::SRC_RANGE as usize }> = LpmTrie::new();

#[btf_map(name = "lb_metrics")]
pub static METRICS: PerCpuArray<MetricValue, { map_sizes::METRICS as usize }> = PerCpuArray::new();

/// This node's facts (node IPs, masquerade flags), written by userspace before attaching.
#[btf_map(name = "lb_config")]
pub static CONFIG: Array<LbConfig, 1> = Array::new();
/// Written and read by userspace only (`map_names::META`); here so it is pinned with BTF.
#[btf_map(name = "lb_meta")]
pub static META: Array<PinMeta, 1> = Array::new();
/// Maglev tables: backend id (0: empty) at `table * M + cell`. max_entries (tables × M) is
/// set by the loader; the size here is only the object file's default (one table).
#[btf_map(name = "lb_maglev")]
pub static MAGLEV: Array<u32, { lb_common::maglev::DEFAULT_TABLE_SIZE as usize }> = Array::new();
/// Cluster CIDRs (`--cluster-cidr`); the value is unused (1).
#[btf_map(name = "lb4_clustercidr")]
pub static CLUSTER_CIDR4: LpmTrie<ClusterCidr4, u8, { map_sizes::CLUSTER_CIDR as usize }> =
    LpmTrie::new();
#[btf_map(name = "lb6_clustercidr")]
pub static CLUSTER_CIDR6: LpmTrie<ClusterCidr6, u8, { map_sizes::CLUSTER_CIDR as usize }> =
    LpmTrie::new();

/// Per-CPU working memory of the tc programs: conntrack keys and values, which would cost
/// each frame of a call chain 32–40 bytes of the 512-byte stack all frames share. A program
/// runs to completion on its CPU, so one entry per CPU is never shared by two packets.
#[repr(C)]
pub struct Scratch {
    /// `Ct4Key` / `Ct6Key` (40 bytes at most) per `af::KeySlot`.
    pub keys: [[u64; 5]; 2],
    /// A `Ct4Value` / `Ct6Value` being written (32 bytes at most).
    pub value: [u64; 4],
    /// The parsed headers of the packet being handled (`parse::Packet`, 80 bytes at most).
    pub packet: [u64; 10],
    /// The packet an ICMP error quotes (`parse::Packet`), beside the error's own headers.
    pub quoted: [u64; 10],
    /// The frontend the packet is for (`select::Service`, 64 bytes at most).
    pub service: [u64; 8],
    /// The backend chosen for a new flow (`select::Chosen`, 48 bytes at most).
    pub chosen: [u64; 6],
    /// The conntrack flow the packet belongs to (`conntrack::Flow`, 64 bytes at most).
    pub flow: [u64; 8],
    /// The FIB query and answer of a packet forwarded past the stack (`bpf_fib_lookup`, 64
    /// bytes), kept from the lookup before the rewrite to the redirect after it.
    pub fib: [u64; 8],
    /// A later fragment's first fragment's flow (`frag::Pin`).
    pub frag_pin: [u64; 1],
}

const _: () = assert!(size_of::<aya_ebpf::bindings::bpf_fib_lookup>() <= 64);

#[btf_map(name = "lb_scratch")]
pub static SCRATCH: PerCpuArray<Scratch, 1> = PerCpuArray::new();

/// This CPU's scratch memory.
#[inline(always)]
pub fn scratch() -> Option<*mut Scratch> {
    SCRATCH.get_ptr_mut(0)
}

/// The node's facts (a map value, not a copy on the stack); `None` cannot happen for index 0.
/// All zero (nothing masqueraded) until userspace wrote them.
#[inline(always)]
pub fn config() -> Option<&'static LbConfig> {
    // SAFETY: array value pointer, valid for the program's run; written only by userspace.
    CONFIG.get_ptr(0).map(|c| unsafe { &*c })
}

/// The last tc decision, written only by traced loads (see `trace.rs`).
/// Gone UDP (frontend, backend) pairs, written by `lb run` (not pinned).
#[btf_map(name = "lb_udp_gone")]
pub static UDP_GONE: LruHashMap<UdpGoneKey, u32, { map_sizes::UDP_GONE as usize }> =
    LruHashMap::new();

/// The ports of fragmented datagrams' first fragments (`frag`); each load owns its own.
#[btf_map(name = "lb4_frags")]
pub static FRAGS4: LruHashMap<Frag4Key, FragEntry, { map_sizes::FRAGS as usize }> =
    LruHashMap::new();
#[btf_map(name = "lb6_frags")]
pub static FRAGS6: LruHashMap<Frag6Key, FragEntry, { map_sizes::FRAGS as usize }> =
    LruHashMap::new();

#[btf_map(name = "lb_trace")]
pub static TRACE: Array<TraceRecord, 1> = Array::new();

/// Counts one event of kind `index` (a `lb_common::metrics` constant) carrying `bytes`.
#[inline(always)]
pub fn count(index: u32, bytes: u32) {
    if let Some(m) = METRICS.get_ptr_mut(index) {
        // SAFETY: per-CPU slot, this program is the only writer on this CPU.
        unsafe {
            (*m).packets += 1;
            (*m).bytes += bytes as u64;
        }
    }
}
