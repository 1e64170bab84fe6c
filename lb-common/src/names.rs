//! Names and sizes: the map and program names bpftool shows, the bpffs pin directory, the
//! pins' layout version, default map sizes, the load-time globals, Maglev's table sizes and the
//! IP protocol numbers.

/// Default bpffs directory holding lb's pinned maps (`bpftool map dump pinned <dir>/<map>`).
pub const DEFAULT_PIN_DIR: &str = "/sys/fs/bpf/lb";

/// Map names as the kernel and bpftool show them (at most 15 bytes).
pub mod map_names {
    pub const SERVICES4: &str = "lb4_services";
    pub const BACKENDS4: &str = "lb4_backends";
    pub const REVNAT4: &str = "lb4_revnat";
    /// Conntrack, split by protocol as Cilium's (`--bpf-ct-global-tcp-max`,
    /// `--bpf-ct-global-any-max`): TCP in `lb*_ct_tcp`, UDP, SCTP and anything else in
    /// `lb*_ct_any`, so a UDP flood cannot evict TCP connections.
    pub const CT_TCP4: &str = "lb4_ct_tcp";
    pub const CT_ANY4: &str = "lb4_ct_any";
    pub const SK_REVNAT4: &str = "lb4_sk_revnat";
    pub const SERVICES6: &str = "lb6_services";
    pub const BACKENDS6: &str = "lb6_backends";
    pub const REVNAT6: &str = "lb6_revnat";
    pub const CT_TCP6: &str = "lb6_ct_tcp";
    pub const CT_ANY6: &str = "lb6_ct_any";
    pub const SK_REVNAT6: &str = "lb6_sk_revnat";
    /// Socket storage (`SkStore4`/`SkStore6`, freed with the socket): socket LB's pairs where
    /// the kernel lets sock_addr programs call `bpf_sk_storage_get` (`globals::HAS_SK_STORAGE`);
    /// `lb*_sk_revnat` then holds only what a socket's slots cannot.
    pub const SK_STORE4: &str = "lb4_sk_store";
    pub const SK_STORE6: &str = "lb6_sk_store";
    pub const METRICS: &str = "lb_metrics";
    /// This node's facts for the datapath (`LbConfig`, one entry), written at start-up.
    pub const CONFIG: &str = "lb_config";
    /// Cluster CIDRs (`--cluster-cidr`), LPM tries: sources inside are pods.
    pub const CLUSTER_CIDR4: &str = "lb4_clustercidr";
    pub const CLUSTER_CIDR6: &str = "lb6_clustercidr";
    /// Addresses that are a ClusterIP of some frontend (kube-proxy's `cluster-ips` set): a
    /// packet to one on a port no frontend has is rejected.
    pub const CLUSTER_IPS4: &str = "lb4_cluster_ips";
    pub const CLUSTER_IPS6: &str = "lb6_cluster_ips";
    /// Service addresses that answer ping (`EchoKey4`/`EchoKey6` → `EchoValue`): ClusterIPs,
    /// external IPs and LoadBalancer IPs, with what an ICMP/ICMPv6 echo request to each gets
    /// per scope (answered while a frontend at the address has a usable backend).
    pub const ECHO4: &str = "lb4_echo";
    pub const ECHO6: &str = "lb6_echo";
    /// `--service-cidr` ranges (LPM tries): a packet to an address in one that is no ClusterIP
    /// is dropped. Written at start-up, before the programs attach.
    pub const SVC_CIDR4: &str = "lb4_svc_cidr";
    pub const SVC_CIDR6: &str = "lb6_svc_cidr";
    /// `loadBalancerSourceRanges` (LPM tries keyed by rev-NAT id, then source address): a
    /// packet to a frontend with `svc_flags::SOURCE_RANGES` from a source outside its ranges is
    /// dropped.
    pub const SRC_RANGE4: &str = "lb4_src_range";
    pub const SRC_RANGE6: &str = "lb6_src_range";
    /// The decision record of traced loads (`TraceRecord`). Never pinned, so not in `ALL`: each
    /// load owns its own, and a trace load cannot touch a running lb's.
    pub const TRACE: &str = "lb_trace";
    /// (frontend, backend) pairs of UDP frontends that lost the backend (`UdpGoneKey`), for
    /// `lb_sk_egress`. Not pinned: each `lb run` fills its own from its syncs.
    pub const UDP_GONE: &str = "lb_udp_gone";
    /// Fragmented datagrams in flight (LRU hashes, `Frag4Key` → `FragEntry`): the ports of a
    /// datagram's first fragment, so its later fragments, which carry none, get the same
    /// translation. Not pinned: an entry lives as long as one datagram's fragments.
    pub const FRAGS4: &str = "lb4_frags";
    pub const FRAGS6: &str = "lb6_frags";
    /// Who made the pins (`PinMeta`, one entry): the layout version every other pinned map is
    /// read with, checked before anything is reused.
    pub const META: &str = "lb_meta";
    /// `sessionAffinity: ClientIP` (LRU hashes, `Affinity4Key` → `AffinityValue`): the backend
    /// each client last got from a frontend, and when.
    pub const AFFINITY4: &str = "lb4_affinity";
    pub const AFFINITY6: &str = "lb6_affinity";
    /// Which backends an affinity entry may still name (`AffinityMatchKey`, value unused):
    /// the active backends of each frontend with session affinity, so an entry pointing at a
    /// backend the frontend no longer has is ignored and replaced.
    pub const AFF_MATCH4: &str = "lb4_aff_match";
    pub const AFF_MATCH6: &str = "lb6_aff_match";
    /// Maglev lookup tables (`maglev`): one array of `tables × M` backend ids, table `t`'s cell
    /// `c` at index `t * M + c`.
    pub const MAGLEV: &str = "lb_maglev";

    /// Every map lb pins, in a stable order.
    pub const ALL: [&str; 32] = [
        SERVICES4,
        BACKENDS4,
        REVNAT4,
        CT_TCP4,
        CT_ANY4,
        SK_REVNAT4,
        SERVICES6,
        BACKENDS6,
        REVNAT6,
        CT_TCP6,
        CT_ANY6,
        SK_REVNAT6,
        METRICS,
        CONFIG,
        CLUSTER_CIDR4,
        CLUSTER_CIDR6,
        CLUSTER_IPS4,
        CLUSTER_IPS6,
        ECHO4,
        ECHO6,
        SVC_CIDR4,
        SVC_CIDR6,
        SRC_RANGE4,
        SRC_RANGE6,
        META,
        AFFINITY4,
        AFFINITY6,
        AFF_MATCH4,
        AFF_MATCH6,
        MAGLEV,
        SK_STORE4,
        SK_STORE6,
    ];
}

/// The layout of lb's pinned maps: their keys, values and what the fields mean. Bump it with
/// any change a reader of the old pins would misread, even one that keeps the sizes; lb refuses
/// (or migrates) pins of another version instead of guessing.
///
/// 2: conntrack split by protocol (`lb4_ct` → `lb4_ct_tcp` + `lb4_ct_any`, same for IPv6).
pub const LAYOUT_VERSION: u32 = 2;

/// Program names as the kernel and bpftool show them (at most 15 bytes).
pub mod prog_names {
    pub const TC_INGRESS: &str = "lb_tc_ingress";
    pub const TC_POD: &str = "lb_tc_pod";
    pub const TC_EGRESS: &str = "lb_tc_egress";
    /// XDP on external devices: north-south balancing before the stack.
    pub const XDP: &str = "lb_xdp";
    pub const CONNECT4: &str = "lb_connect4";
    pub const SENDMSG4: &str = "lb_sendmsg4";
    pub const RECVMSG4: &str = "lb_recvmsg4";
    pub const GETPEERNAME4: &str = "lb_getpeername4";
    pub const CONNECT6: &str = "lb_connect6";
    pub const SENDMSG6: &str = "lb_sendmsg6";
    pub const RECVMSG6: &str = "lb_recvmsg6";
    pub const GETPEERNAME6: &str = "lb_getpeername6";
    /// cgroup skb egress on socket LB's cgroup: drops datagrams of connected UDP sockets
    /// pinned to a gone backend (`lb_udp_gone`).
    pub const SK_EGRESS: &str = "lb_sk_egress";

    /// Every program lb loads, in a stable order.
    pub const ALL: [&str; 13] = [
        XDP,
        TC_INGRESS,
        TC_POD,
        TC_EGRESS,
        CONNECT4,
        SENDMSG4,
        RECVMSG4,
        GETPEERNAME4,
        CONNECT6,
        SENDMSG6,
        RECVMSG6,
        GETPEERNAME6,
        SK_EGRESS,
    ];
}

/// Default map sizes; userspace may override them at load time.
pub mod map_sizes {
    /// Service map entries: one master plus one per backend slot, per frontend.
    pub const SERVICES: u32 = 1 << 19;
    pub const BACKENDS: u32 = 1 << 18;
    pub const REVNAT: u32 = 1 << 18;
    /// TCP conntrack entries per family (`--bpf-ct-global-tcp-max`, Cilium's default).
    pub const CT_TCP: u32 = 1 << 19;
    /// Non-TCP conntrack entries per family (`--bpf-ct-global-any-max`, Cilium's default).
    pub const CT_ANY: u32 = 1 << 18;
    pub const SK_REVNAT: u32 = 1 << 17;
    /// Gone UDP (frontend, backend) pairs remembered (LRU: the oldest go first).
    pub const UDP_GONE: u32 = 1 << 14;
    /// Fragmented datagrams in flight per family (Cilium's `bpf-fragments-map-max` default).
    pub const FRAGS: u32 = 8192;
    pub const METRICS: u32 = crate::metrics::MAX as u32;
    /// Cluster CIDRs per family (kube-proxy takes a handful; this is generous).
    pub const CLUSTER_CIDR: u32 = 64;
    /// Distinct ClusterIPs of one family.
    pub const CLUSTER_IPS: u32 = 1 << 17;
    /// Service addresses of one family that answer ping: ClusterIPs plus external and
    /// LoadBalancer IPs.
    pub const ECHO: u32 = 1 << 17;
    /// `--service-cidr` ranges of one family.
    pub const SVC_CIDR: u32 = 64;
    /// `loadBalancerSourceRanges` entries of one family, over all services.
    pub const SRC_RANGE: u32 = 1 << 14;
    /// Session affinity entries of one family (clients × frontends with affinity); Cilium's
    /// `bpf-lb-affinity-map-max` default.
    pub const AFFINITY: u32 = 1 << 16;
    /// (frontend, active backend) pairs of frontends with session affinity, one family.
    pub const AFF_MATCH: u32 = 1 << 18;
}

/// Names of the read-only globals userspace may set at load time.
pub mod globals {
    /// `u8`, non-zero: the tc programs write a `TraceRecord` into `lb_trace` for every packet.
    /// Zero (the default) leaves the branch dead, and the verifier prunes it.
    pub const TRACE: &str = "LB_TRACE";
    /// `u8`, non-zero: the kernel lets cgroup sock_addr programs call `bpf_set_retval`, so a
    /// refused connect()/sendmsg() fails with ECONNREFUSED instead of EPERM. The loader sets
    /// it after probing; zero leaves the helper call in a branch the verifier never walks, so
    /// kernels without the helper (before 5.18) still load the programs.
    pub const HAS_SET_RETVAL: &str = "LB_HAS_SET_RETVAL";
    /// `u8`, non-zero: socket LB keeps its pairs in socket storage (`lb*_sk_store`), which the
    /// probe found sock_addr and cgroup skb programs may use; zero keeps them in the LRU
    /// `lb*_sk_revnat` and leaves the storage helper calls dead, unverified code.
    pub const HAS_SK_STORAGE: &str = "LB_HAS_SK_STORAGE";
    /// `u32`: M, the cells of each Maglev table in `lb_maglev` (`maglev::TABLE_SIZES`). Zero
    /// (the default) leaves every Maglev frontend without a backend, never mis-indexed.
    pub const MAGLEV_TABLE_SIZE: &str = "LB_MAGLEV_M";
    /// `u32` seconds, the conntrack lifetimes (`--bpf-ct-timeout-regular-*`); the defaults
    /// are `ct_timeouts`'. Frozen .rodata: each load (`lb run`, `lb trace`) carries its own.
    pub const CT_TIMEOUT_TCP_SYN: &str = "LB_CT_TCP_SYN";
    pub const CT_TIMEOUT_TCP: &str = "LB_CT_TCP";
    pub const CT_TIMEOUT_TCP_FIN: &str = "LB_CT_TCP_FIN";
    pub const CT_TIMEOUT_ANY: &str = "LB_CT_ANY";
}

/// Maglev consistent hashing (`lb_alg::MAGLEV`): each Maglev master entry (frontend × scope)
/// owns one table of M cells in `lb_maglev`, built in userspace from its active backends; a new
/// flow takes cell `hash % M` (packets: `flow_hash` of the 5-tuple, the same on every node;
/// sockets: `mix64` of the socket cookie).
pub mod maglev {
    /// The table sizes lb accepts (`--maglev-table-size`): primes, so every skip of the
    /// permutation is coprime to M; M should be well above 100 × the backends of a frontend.
    pub const TABLE_SIZES: [u32; 10] = [
        251, 509, 1021, 2039, 4093, 8191, 16381, 32749, 65521, 131071,
    ];
    /// Default M (Cilium's default too).
    pub const DEFAULT_TABLE_SIZE: u32 = 16381;
    /// Default number of tables (`--bpf-maglev-tables`) when the node default is Maglev: at M
    /// = 16381 an array cell takes 8 bytes, so 128 KiB per table, 32 MiB for 256.
    pub const DEFAULT_TABLES: u32 = 256;
    /// Default number of tables when the node default is random (only annotated services use
    /// one): 2 MiB at the default M.
    pub const DEFAULT_TABLES_RANDOM: u32 = 16;
}

pub const IPPROTO_TCP: u8 = 6;
pub const IPPROTO_UDP: u8 = 17;
pub const IPPROTO_SCTP: u8 = 132;
