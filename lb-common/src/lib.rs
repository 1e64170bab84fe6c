//! The ABI between lb's kernel programs and its userspace: map names, key and value layouts,
//! flag bits and counter indices.
//!
//! Every type is `#[repr(C)]` with explicit padding fields, so the layout is the same on both
//! sides and `bpftool map dump` prints every byte under a field name. Addresses are stored as
//! byte arrays in network order (bpftool prints them as `[198,18,0,10]`); ports and ids are
//! stored in host order so dumps read naturally.
//!
//! Layout follows Cilium's: a service frontend `(vip, port, proto, scope)` has a master entry
//! at slot 0 (backend count, flags, rev-NAT id) and one entry per backend at slots `1..=count`,
//! each naming a backend id; backends live in their own map keyed by id, and the rev-NAT map
//! turns a rev-NAT id back into the frontend address for replies.
#![no_std]

pub mod metrics;

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
    pub const ALL: [&str; 30] = [
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
    ];
}

/// The layout of lb's pinned maps: their keys, values and what the fields mean. Bump it with
/// any change a reader of the old pins would misread, even one that keeps the sizes; lb refuses
/// (or migrates) pins of another version instead of guessing.
///
/// 2: conntrack split by protocol (`lb4_ct` → `lb4_ct_tcp` + `lb4_ct_any`, same for IPv6).
pub const LAYOUT_VERSION: u32 = 2;

/// The one `lb_meta` entry, rewritten by every `lb run` that starts on the pins.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct PinMeta {
    /// `LAYOUT_VERSION` of the lb that wrote the pins; 0: not written yet.
    pub layout_version: u32,
    /// M of the `lb_maglev` tables these pins hold (`maglev::TABLE_SIZES`); 0: written by an
    /// lb without Maglev (this was padding then), whose pins have no `lb_maglev`.
    pub maglev_table_size: u32,
    /// Inode of the network namespace that lb ran in: the ifindexes of its tc/XDP links are
    /// that namespace's.
    pub netns_inode: u64,
    /// lb's version (`CARGO_PKG_VERSION`), NUL-padded.
    pub lb_version: [u8; 16],
}

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

/// Which backend set a frontend's key selects. Services whose internal and external traffic
/// policies differ get two master entries (Cilium's "two scopes").
pub mod scope {
    /// External traffic, and the only scope of a service whose policies agree.
    pub const EXTERNAL: u8 = 0;
    /// Traffic from inside the cluster to a two-scope service.
    pub const INTERNAL: u8 = 1;
}

/// `SvcValue::flags` bits.
pub mod svc_flags {
    pub const CLUSTER_IP: u16 = 1 << 0;
    pub const NODE_PORT: u16 = 1 << 1;
    pub const EXTERNAL_IP: u16 = 1 << 2;
    pub const LOAD_BALANCER: u16 = 1 << 3;
    /// `sessionAffinity: ClientIP`; `affinity_timeout` holds the timeout in seconds.
    pub const AFFINITY: u16 = 1 << 4;
    /// `externalTrafficPolicy: Local`.
    pub const EXT_LOCAL: u16 = 1 << 5;
    /// `internalTrafficPolicy: Local`.
    pub const INT_LOCAL: u16 = 1 << 6;
    /// A second master entry exists under `scope::INTERNAL`.
    pub const TWO_SCOPES: u16 = 1 << 7;
    /// `loadBalancerSourceRanges` apply: sources outside the frontend's `lb*_src_range`
    /// entries are dropped.
    pub const SOURCE_RANGES: u16 = 1 << 8;
    /// Without a backend in this scope the packet is dropped, not rejected: the service has
    /// endpoints, just none on this node (`externalTrafficPolicy: Local`), as kube-proxy drops
    /// external traffic there.
    pub const EMPTY_DROP: u16 = 1 << 9;
    /// The frontend's address is one of this node's own (a NodePort on a node IP): replies
    /// restored to it carry a local source, which IPv4 input drops as a martian, so they are
    /// forwarded past the stack like masqueraded packets.
    pub const LOCAL_ADDR: u16 = 1 << 10;
}

/// `SvcValue::lb_alg` values.
pub mod lb_alg {
    pub const RANDOM: u8 = 0;
    pub const MAGLEV: u8 = 1;
}

/// `Backend*::state` values. Only `ACTIVE` backends are placed in slots for new flows; the
/// others stay in the slots after them (`SvcValue::qcount`) for established flows (graceful
/// termination).
pub mod backend_state {
    pub const ACTIVE: u8 = 0;
    pub const TERMINATING: u8 = 1;
    pub const QUARANTINED: u8 = 2;
    pub const MAINTENANCE: u8 = 3;
}

/// `Ct*Key::dir` values.
pub mod ct_dir {
    /// Client → frontend, keyed as the client sent it (daddr is the VIP).
    pub const SERVICE: u8 = 1;
    /// Backend → client, keyed as the backend sends it; the value's rev-NAT id names the VIP.
    pub const REPLY: u8 = 2;
}

/// `CtValue::flags` bits.
pub mod ct_flags {
    pub const SEEN_REPLY: u16 = 1 << 0;
    /// FIN or RST (SCTP: ABORT or SHUTDOWN COMPLETE) seen from the client.
    pub const TX_CLOSING: u16 = 1 << 1;
    /// FIN or RST (SCTP: ABORT or SHUTDOWN COMPLETE) seen from the backend.
    pub const RX_CLOSING: u16 = 1 << 2;
    /// The flow is masqueraded: `nat_addr`/`nat_port` hold the node-side source (service entry)
    /// or the client to send replies back to (reply entry).
    pub const SNAT: u16 = 1 << 3;
    /// The frontend is a local address (`svc_flags::LOCAL_ADDR`): replies are forwarded past
    /// the stack after reverse NAT.
    pub const LOCAL_FRONTEND: u16 = 1 << 4;
}

/// Masquerade (SNAT) of tc-balanced flows.
pub mod nat {
    /// The source ports masquerade allocates, inclusive: above Linux's default ephemeral range
    /// (`ip_local_port_range` 32768–60999) and the NodePort range (30000–32767), so neither a
    /// node socket's own port nor a NodePort is ever handed out.
    pub const PORT_MIN: u16 = 61_000;
    pub const PORT_MAX: u16 = 65_535;
    /// Random ports tried per new flow before it is dropped as `tc_snat_port_exhausted`.
    pub const PORT_TRIES: u32 = 16;
}

/// `LbConfig::flags` bits.
pub mod config_flags {
    /// `--masquerade-all`: masquerade all traffic to ClusterIPs.
    pub const MASQUERADE_ALL: u32 = 1 << 0;
    /// `--cluster-cidr` has IPv4 ranges: the IPv4 local-traffic detector is on.
    pub const CLUSTER_CIDR4: u32 = 1 << 1;
    /// `--cluster-cidr` has IPv6 ranges.
    pub const CLUSTER_CIDR6: u32 = 1 << 2;
    /// `--no-echo-reply`: echo requests to service addresses are not answered (`lb*_echo` is
    /// still kept), they pass as before.
    pub const NO_ECHO_REPLY: u32 = 1 << 3;
}

/// Value of the one-entry array `lb_config`: this node's facts, written by userspace before
/// the programs are attached. All zero (no node IP, no detector, no masquerade-all) turns
/// masquerading off except hairpin, which then has no address to use either.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct LbConfig {
    /// The IPv4 source masqueraded flows get; all zero: none.
    pub node_ip4: [u8; 4],
    /// The IPv6 source masqueraded flows get; all zero: none.
    pub node_ip6: [u8; 16],
    /// `config_flags` bits.
    pub flags: u32,
    /// The masquerade port range, inclusive (`nat::PORT_MIN`..=`nat::PORT_MAX` by default).
    pub nat_port_min: u16,
    pub nat_port_max: u16,
}

/// Data of an `lb4_clustercidr` key (the LPM trie key is `{prefixlen: u32, addr}`).
pub type ClusterCidr4 = [u8; 4];
/// Data of an `lb6_clustercidr` key.
pub type ClusterCidr6 = [u8; 16];

/// Default conntrack lifetimes in seconds (Cilium's defaults; kube-proxy relies on
/// nf_conntrack's); `lb run` sets them with `--bpf-ct-timeout-regular-*` (`globals::CT_*`).
///
/// SCTP associations use the TCP lifetimes: an INIT without reply is `TCP_SYN`, an association
/// that has seen a reply is `TCP_ESTABLISHED` (nf_conntrack's 210 s relies on heartbeats, which
/// an idle association may have disabled; 5 days, its old value, would pin LRU entries), and
/// one that sent ABORT or SHUTDOWN COMPLETE is `TCP_CLOSING`. An INIT on a closing entry is
/// balanced afresh, like a SYN.
pub mod ct_timeouts {
    pub const TCP_SYN: u32 = 60;
    pub const TCP_ESTABLISHED: u32 = 21_600;
    pub const TCP_CLOSING: u32 = 10;
    /// UDP and anything else without connection state.
    pub const NON_TCP: u32 = 60;
    /// An entry's expiry is rewritten only when it would move by at least this much, so a busy
    /// flow does not dirty its conntrack cache line on every packet.
    pub const REFRESH_GRANULARITY: u32 = 5;
}

/// Map key of `lb4_services`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct Svc4Key {
    pub addr: [u8; 4],
    pub port: u16,
    /// 0 for the master entry, `1..=count` for backend slots.
    pub slot: u16,
    pub proto: u8,
    pub scope: u8,
    pub pad: [u8; 2],
}

/// Map key of `lb6_services`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct Svc6Key {
    pub addr: [u8; 16],
    pub port: u16,
    pub slot: u16,
    pub proto: u8,
    pub scope: u8,
    pub pad: [u8; 2],
}

/// Map value of `lb4_services` and `lb6_services`. In the master entry (slot 0) the fields
/// describe the service and `backend_id` is 0, or with `lb_alg::MAGLEV` the index of the
/// frontend's table in `lb_maglev`; in slot entries only `backend_id` and `rev_nat_id` are
/// set.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct SvcValue {
    pub backend_id: u32,
    /// Active backends: slots `1..=count` are chosen for new flows.
    pub count: u16,
    /// Terminating backends in slots after the active ones, kept for established flows.
    pub qcount: u16,
    pub rev_nat_id: u32,
    /// `svc_flags` bits.
    pub flags: u16,
    /// `lb_alg` value.
    pub lb_alg: u8,
    pub pad: u8,
    /// Session affinity timeout in seconds when `svc_flags::AFFINITY` is set.
    pub affinity_timeout: u32,
}

impl SvcValue {
    /// Slots a master entry covers, `1..=slots()`: active then terminating backends. Saturates,
    /// since a value read from a pinned map may hold anything.
    #[inline(always)]
    pub const fn slots(&self) -> u16 {
        self.count.saturating_add(self.qcount)
    }
}

/// Map value of `lb4_backends` (key: backend id, `u32`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct Backend4 {
    pub addr: [u8; 4],
    pub port: u16,
    pub proto: u8,
    /// `backend_state` value.
    pub state: u8,
}

/// Map value of `lb6_backends` (key: backend id, `u32`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct Backend6 {
    pub addr: [u8; 16],
    pub port: u16,
    pub proto: u8,
    pub state: u8,
}

/// Map value of `lb4_revnat` (key: rev-NAT id, `u32`): the frontend replies must come from.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct RevNat4 {
    pub addr: [u8; 4],
    pub port: u16,
    pub pad: u16,
}

/// Map value of `lb6_revnat` (key: rev-NAT id, `u32`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct RevNat6 {
    pub addr: [u8; 16],
    pub port: u16,
    pub pad: u16,
}

/// Map key of `lb4_ct_tcp` and `lb4_ct_any`: a flow's 5-tuple as seen in `dir`. Service entries are keyed on the
/// tuple the client sent (destination = VIP), so one backend behind several VIPs gets one entry
/// per VIP.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct Ct4Key {
    pub saddr: [u8; 4],
    pub daddr: [u8; 4],
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
    /// `ct_dir` value.
    pub dir: u8,
    pub pad: [u8; 2],
}

/// Map key of `lb6_ct_tcp` and `lb6_ct_any`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct Ct6Key {
    pub saddr: [u8; 16],
    pub daddr: [u8; 16],
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
    pub dir: u8,
    pub pad: [u8; 2],
}

/// Map value of `lb4_ct_tcp` and `lb4_ct_any`. Both entries of a flow carry the same ids, flags and expiry; the NAT
/// endpoint differs (see `ct_flags::SNAT`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct Ct4Value {
    /// Backend chosen for the flow.
    pub backend_id: u32,
    /// Frontend to restore on replies.
    pub rev_nat_id: u32,
    /// Expiry in seconds of `CLOCK_MONOTONIC` (`bpf_ktime_get_ns() / 1e9`).
    pub expires: u32,
    /// `ct_flags` bits.
    pub flags: u16,
    /// With `ct_flags::SNAT`: the service entry's masquerade source port, or the reply entry's
    /// client port; 0 otherwise.
    pub nat_port: u16,
    /// With `ct_flags::SNAT`: the service entry's masquerade source (the node IP), or the reply
    /// entry's client address; zero otherwise.
    pub nat_addr: [u8; 4],
}

/// Map value of `lb6_ct_tcp` and `lb6_ct_any`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct Ct6Value {
    pub backend_id: u32,
    pub rev_nat_id: u32,
    pub expires: u32,
    pub flags: u16,
    pub nat_port: u16,
    pub nat_addr: [u8; 16],
}

/// Map key of `lb4_sk_revnat`: which frontend a socket's peer address stands for, so
/// `recvmsg()` and `getpeername()` report the VIP the application asked for.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct SkRevNat4Key {
    pub cookie: u64,
    pub addr: [u8; 4],
    pub port: u16,
    pub pad: u16,
}

/// Map value of `lb4_sk_revnat`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct SkRevNat4Value {
    pub addr: [u8; 4],
    pub port: u16,
    pub pad: u16,
    pub rev_nat_id: u32,
}

/// Map key of `lb6_sk_revnat`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct SkRevNat6Key {
    pub cookie: u64,
    pub addr: [u8; 16],
    pub port: u16,
    pub pad: [u8; 6],
}

/// Map value of `lb6_sk_revnat`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct SkRevNat6Value {
    pub addr: [u8; 16],
    pub port: u16,
    pub pad: u16,
    pub rev_nat_id: u32,
}

/// Map key of `lb_udp_gone`: a UDP frontend and a backend that left it, as socket LB records
/// them in `lb*_sk_revnat` (IPv4 addresses in the first 4 bytes, the rest zero; ports in host
/// order). The value is a `u32`, unused (0).
/// Map key of `lb4_frags`: one fragmented IPv4 datagram as its fragments arrive (addresses
/// in network order, the IP header's identification in host order).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct Frag4Key {
    pub saddr: [u8; 4],
    pub daddr: [u8; 4],
    pub id: u32,
    pub proto: u8,
    pub pad: [u8; 3],
}

/// Map key of `lb6_frags` (the fragment header's identification).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct Frag6Key {
    pub saddr: [u8; 16],
    pub daddr: [u8; 16],
    pub id: u32,
    pub proto: u8,
    pub pad: [u8; 3],
}

/// Map value of `lb4_frags` and `lb6_frags`: the ports of the datagram's first fragment, as
/// it arrived (host order), and the flow it was translated with: the conntrack entry's
/// backend and NAT port (both 0: it was not translated, so no later fragment is).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct FragEntry {
    pub sport: u16,
    pub dport: u16,
    pub backend_id: u32,
    pub nat_port: u16,
    pub pad: u16,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct UdpGoneKey {
    pub frontend: [u8; 16],
    pub backend: [u8; 16],
    pub frontend_port: u16,
    pub backend_port: u16,
    /// 4 or 6: which `lb*_sk_revnat` the socket's entry is in.
    pub family: u8,
    pub pad: [u8; 3],
}

/// Map key of `lb4_cluster_ips`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct ClusterIp4Key {
    pub addr: [u8; 4],
}

/// Map key of `lb6_cluster_ips`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct ClusterIp6Key {
    pub addr: [u8; 16],
}

/// Map value of `lb4_cluster_ips` and `lb6_cluster_ips`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct ClusterIpValue {
    /// Frontends (port, protocol, scope) programmed at this address; informational, the
    /// datapath only needs the entry to exist.
    pub frontends: u32,
}

/// Map key of `lb4_echo`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct EchoKey4 {
    pub addr: [u8; 4],
}

/// Map key of `lb6_echo`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct EchoKey6 {
    pub addr: [u8; 16],
}

/// Map value of `lb4_echo` and `lb6_echo`: the `echo` verdict of an echo request to the
/// address, per scope of its client (`internal`: pods, `external`: anything from outside).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct EchoValue {
    pub internal: u8,
    pub external: u8,
    pub pad: [u8; 2],
}

/// What an echo request to a service address gets (`EchoValue`): what the address's other
/// traffic would.
pub mod echo {
    /// Not a service address in this scope (or every frontend there filters sources): passed.
    pub const NONE: u8 = 0;
    /// A frontend at the address has a usable backend: answered by the datapath.
    pub const ANSWER: u8 = 1;
    /// No frontend there has an endpoint anywhere: rejected (ICMP unreachable), as the
    /// frontends' traffic is.
    pub const REJECT: u8 = 2;
    /// The frontends' endpoints are all on other nodes (a `Local` traffic policy): dropped.
    pub const DROP: u8 = 3;
}

/// Map value of `lb4_svc_cidr` and `lb6_svc_cidr`, keyed by an LPM key (`u32` prefix length,
/// then the address bytes): the prefix length again, so a lookup tells which range matched.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct SvcCidrValue {
    pub prefix_len: u32,
}

/// Data of an `lb4_src_range` key (the LPM trie key is `{prefixlen: u32, data}`, and
/// `prefixlen` is 32 + the range's prefix, so the rev-NAT id always matches exactly). The id is
/// stored big-endian: the trie compares bytes from the first one on.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct SrcRange4 {
    pub rev_nat_id: [u8; 4],
    pub addr: [u8; 4],
}

/// Data of an `lb6_src_range` key.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct SrcRange6 {
    pub rev_nat_id: [u8; 4],
    pub addr: [u8; 16],
}

/// Map key of `lb4_affinity`: a client of a frontend (`rev_nat_id`, `scope`). Packet hooks key
/// a client by its address (`netns_cookie` 0); socket hooks, which see no source address at
/// `connect()`, by the network namespace of the socket (`addr` zero), as Cilium does.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct Affinity4Key {
    pub netns_cookie: u64,
    pub addr: [u8; 4],
    pub rev_nat_id: u32,
    pub scope: u8,
    pub pad: [u8; 7],
}

/// Map key of `lb6_affinity`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct Affinity6Key {
    pub netns_cookie: u64,
    pub addr: [u8; 16],
    pub rev_nat_id: u32,
    pub scope: u8,
    pub pad: [u8; 3],
}

/// Map value of `lb4_affinity` and `lb6_affinity`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct AffinityValue {
    pub backend_id: u32,
    /// When a new flow last used the entry, in seconds of `CLOCK_MONOTONIC`: the entry holds
    /// for the frontend's `affinity_timeout` after it (kube-proxy's `recent --rcheck --seconds`
    /// with `--set` on each new connection).
    pub last_used: u32,
}

/// Map key of `lb4_aff_match` and `lb6_aff_match`: a backend a frontend's affinity entries may
/// name.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct AffinityMatchKey {
    pub backend_id: u32,
    pub rev_nat_id: u32,
    pub scope: u8,
    pub pad: [u8; 3],
}

/// `TraceRecord::affinity` values.
pub mod trace_affinity {
    /// The frontend has no session affinity (or the packet met no new-flow choice).
    pub const NONE: u8 = 0;
    /// The client's affinity entry chose the backend.
    pub const HIT: u8 = 1;
    /// No usable entry (none, expired, or naming a backend the frontend lost): the backend was
    /// chosen afresh and remembered.
    pub const NEW: u8 = 2;
}

/// `TraceRecord::verdict` values: what a tc program did with the packet.
pub mod trace_verdict {
    /// No record written (tracing off, or no packet run yet).
    pub const NONE: u8 = 0;
    /// DNAT to a backend (new or established flow).
    pub const FORWARD: u8 = 1;
    /// A backend's reply, source rewritten back to the frontend.
    pub const REVERSE_NAT: u8 = 2;
    /// Passed untouched (not a service, not a reply, or not parsed).
    pub const PASS: u8 = 3;
    /// Dropped (no backend, or a rewrite helper failed).
    pub const DROP: u8 = 4;
    /// Answered with a TCP RST or an ICMP/ICMPv6 port unreachable, sent back out the device the
    /// packet came in on (a service without backends, or a ClusterIP port it does not have).
    pub const REJECT: u8 = 5;
    /// An echo request to a service address answered with an echo reply, sent back out the
    /// device it came in on (`lb*_echo`).
    pub const ECHO_REPLY: u8 = 6;
}

/// `TraceRecord::ct_state` values: what conntrack said about the packet.
pub mod trace_ct {
    /// Conntrack not consulted, or no entry matched.
    pub const NONE: u8 = 0;
    /// A new flow: a backend was chosen (entries inserted unless the insert failed).
    pub const NEW: u8 = 1;
    /// The flow's service entry matched: its backend was reused.
    pub const ESTABLISHED: u8 = 2;
    /// A reply entry matched.
    pub const REPLY: u8 = 3;
    /// Like `NEW`, for a TCP/SCTP packet that opens no connection: its flow had no usable entry
    /// (`metrics::TC_CT_MISS_MIDSTREAM`).
    pub const NEW_MIDSTREAM: u8 = 4;
    /// A TCP packet that opens no connection met its flow's entry, but the entry's backend is
    /// gone: answered with a RST, the entry deleted (`metrics::TC_REJECT_BACKEND_GONE`).
    pub const BACKEND_GONE: u8 = 5;
    /// An ICMP/ICMPv6 error whose quoted packet belongs to a flow conntrack knows (its reply
    /// entry for an error towards the client, its service entry for one towards the
    /// backend); translated with the flow, nothing refreshed.
    pub const RELATED: u8 = 6;
}

/// Value of the one-entry array `lb_trace`: the decision of the last packet a tc program
/// handled, written only when the program was loaded with `globals::TRACE` set. `lb trace`
/// reads it after a test run instead of recomputing the datapath's choice.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct TraceRecord {
    /// `trace_verdict` value.
    pub verdict: u8,
    /// The `metrics` index counted for the packet: the precise reason for the verdict.
    pub reason: u8,
    /// `scope` of the master entry used (services only).
    pub scope: u8,
    /// `trace_ct` value.
    pub ct_state: u8,
    /// Backend slot chosen for a new flow (`1..=count`), 0 otherwise.
    pub slot: u16,
    /// `svc_flags` of the master entry (services only).
    pub svc_flags: u16,
    /// Backend of the flow (forward, reverse NAT, or the missing one a slot named).
    pub backend_id: u32,
    /// Rev-NAT id of the frontend (services and replies).
    pub rev_nat_id: u32,
    /// 1 if the packet's source was masqueraded (to the node IP and `nat_port`).
    pub masquerade: u8,
    /// `trace_affinity` value.
    pub affinity: u8,
    /// The masquerade source port (the address is the family's node IP in `lb_config`).
    pub nat_port: u16,
    /// With `lb_alg == lb_alg::MAGLEV`: the Maglev cell (`0..M`) the new flow's backend came
    /// from (`backend_id`; none with a `NoBackend` reason: the cell was empty or named a
    /// missing backend).
    pub maglev_cell: u32,
    /// `lb_alg` of the master entry a new flow's backend was chosen with (new flows only).
    pub lb_alg: u8,
    /// 1 if a new flow's backend is an address of this node (a hostNetwork endpoint): DNATed
    /// only and handed to the local stack, never masqueraded (`metrics::TC_LOCAL_BACKEND`).
    pub local_backend: u8,
    /// `ct_flags` of the conntrack entry the packet met (established, reply, backend gone),
    /// before this packet changed them; 0 without one.
    pub ct_flags: u16,
    /// `trace_frag` value: whether the packet was a fragment, and which.
    pub frag: u8,
    /// IPv6 extension headers walked to reach the L4 header.
    pub ext_headers: u8,
    pub pad: [u8; 2],
}

/// `TraceRecord::frag` values.
pub mod trace_frag {
    /// Not a fragment.
    pub const NONE: u8 = 0;
    /// The first fragment of a datagram (it has the ports; they were remembered).
    pub const FIRST: u8 = 1;
    /// A later fragment: its ports came from its first fragment.
    pub const LATER: u8 = 2;
}

/// Per-CPU value of `lb_metrics` (key: a `metrics` index, `u32`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct MetricValue {
    pub packets: u64,
    pub bytes: u64,
}

/// Maps a 32-bit hash or random number uniformly onto slots `1..=count` without a division
/// (Lemire's multiply-shift). `count` must be non-zero.
#[inline(always)]
pub fn select_slot(rand: u32, count: u16) -> u16 {
    (((rand as u64) * (count as u64)) >> 32) as u16 + 1
}

/// Spreads sequential values (socket cookies) over the 32-bit range before `select_slot`.
#[inline(always)]
pub fn mix64(v: u64) -> u32 {
    // The finalizer of splitmix64: cheap and every input bit affects the high output bits.
    let mut z = v.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    ((z ^ (z >> 31)) >> 32) as u32
}

/// The flow hash Maglev frontends pick their cell with on the packet path: the 5-tuple as the
/// client sent it (addresses as big-endian 32-bit words, then `sport << 16 | dport`, then the
/// protocol), each word folded in by xor and a multiply by the 64-bit golden ratio, finished
/// with `mix64`. No seed: every node computes the same hash for a flow, so with the same
/// backends (the same table) an ECMP'd flow meets the same backend on any node.
#[inline(always)]
pub fn flow_hash(saddr: &[u8], daddr: &[u8], sport: u16, dport: u16, proto: u8) -> u32 {
    #[inline(always)]
    fn fold(h: u64, w: u32) -> u64 {
        let h = (h ^ w as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        h ^ (h >> 32)
    }
    #[inline(always)]
    fn fold_addr(mut h: u64, a: &[u8]) -> u64 {
        let mut i = 0;
        while i + 4 <= a.len() {
            h = fold(h, u32::from_be_bytes([a[i], a[i + 1], a[i + 2], a[i + 3]]));
            i += 4;
        }
        h
    }
    let h = fold_addr(0, saddr);
    let h = fold_addr(h, daddr);
    let h = fold(h, (sport as u32) << 16 | dport as u32);
    mix64(fold(h, proto as u32))
}

#[cfg(feature = "user")]
mod user {
    // SAFETY: each type is repr(C), Copy, has no padding (bytemuck's derive checks that) and is
    // valid for any bit pattern.
    unsafe impl aya::Pod for super::Svc4Key {}
    unsafe impl aya::Pod for super::Svc6Key {}
    unsafe impl aya::Pod for super::SvcValue {}
    unsafe impl aya::Pod for super::EchoKey4 {}
    unsafe impl aya::Pod for super::EchoKey6 {}
    unsafe impl aya::Pod for super::EchoValue {}
    unsafe impl aya::Pod for super::Backend4 {}
    unsafe impl aya::Pod for super::Backend6 {}
    unsafe impl aya::Pod for super::RevNat4 {}
    unsafe impl aya::Pod for super::RevNat6 {}
    unsafe impl aya::Pod for super::Ct4Key {}
    unsafe impl aya::Pod for super::Ct6Key {}
    unsafe impl aya::Pod for super::Ct4Value {}
    unsafe impl aya::Pod for super::Ct6Value {}
    unsafe impl aya::Pod for super::LbConfig {}
    unsafe impl aya::Pod for super::SkRevNat4Key {}
    unsafe impl aya::Pod for super::SkRevNat4Value {}
    unsafe impl aya::Pod for super::SkRevNat6Key {}
    unsafe impl aya::Pod for super::SkRevNat6Value {}
    unsafe impl aya::Pod for super::MetricValue {}
    unsafe impl aya::Pod for super::TraceRecord {}
    unsafe impl aya::Pod for super::ClusterIp4Key {}
    unsafe impl aya::Pod for super::ClusterIp6Key {}
    unsafe impl aya::Pod for super::ClusterIpValue {}
    unsafe impl aya::Pod for super::SvcCidrValue {}
    unsafe impl aya::Pod for super::SrcRange4 {}
    unsafe impl aya::Pod for super::SrcRange6 {}
    unsafe impl aya::Pod for super::PinMeta {}
    unsafe impl aya::Pod for super::Affinity4Key {}
    unsafe impl aya::Pod for super::Affinity6Key {}
    unsafe impl aya::Pod for super::AffinityValue {}
    unsafe impl aya::Pod for super::AffinityMatchKey {}
}

// The sizes are part of the ABI with pinned maps: a change here needs a map migration.
const _: () = {
    assert!(size_of::<Svc4Key>() == 12);
    assert!(size_of::<Svc6Key>() == 24);
    assert!(size_of::<SvcValue>() == 20);
    assert!(size_of::<Backend4>() == 8);
    assert!(size_of::<Backend6>() == 20);
    assert!(size_of::<RevNat4>() == 8);
    assert!(size_of::<RevNat6>() == 20);
    assert!(size_of::<Ct4Key>() == 16);
    assert!(size_of::<Ct6Key>() == 40);
    assert!(size_of::<Ct4Value>() == 20);
    assert!(size_of::<Ct6Value>() == 32);
    assert!(size_of::<LbConfig>() == 28);
    assert!(size_of::<PinMeta>() == 32);
    assert!(size_of::<SkRevNat4Key>() == 16);
    assert!(size_of::<SkRevNat4Value>() == 12);
    assert!(size_of::<SkRevNat6Key>() == 32);
    assert!(size_of::<SkRevNat6Value>() == 24);
    assert!(size_of::<UdpGoneKey>() == 40);
    assert!(size_of::<Frag4Key>() == 16);
    assert!(size_of::<Frag6Key>() == 40);
    assert!(size_of::<FragEntry>() == 12);
    assert!(size_of::<MetricValue>() == 16);
    assert!(size_of::<TraceRecord>() == 32);
    assert!(size_of::<ClusterIp4Key>() == 4);
    assert!(size_of::<ClusterIp6Key>() == 16);
    assert!(size_of::<ClusterIpValue>() == 4);
    assert!(size_of::<SvcCidrValue>() == 4);
    assert!(size_of::<SrcRange4>() == 8);
    assert!(size_of::<SrcRange6>() == 20);
    assert!(size_of::<Affinity4Key>() == 24);
    assert!(size_of::<Affinity6Key>() == 32);
    assert!(size_of::<AffinityValue>() == 8);
    assert!(size_of::<AffinityMatchKey>() == 12);
    // `TraceRecord::reason` holds a metrics index in a u8.
    assert!(metrics::MAX <= 256);
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn select_slot_stays_in_range_and_is_uniform() {
        for count in [1u16, 2, 3, 7, 100, u16::MAX] {
            assert_eq!(select_slot(0, count), 1);
            assert_eq!(select_slot(u32::MAX, count), count);
        }
        // Uniform over 3 slots: equal-width bands of the input space.
        let mut hits = [0u32; 4];
        let step = u32::MAX / 30_000;
        for i in 0..30_000u32 {
            hits[select_slot(i * step, 3) as usize] += 1;
        }
        assert_eq!(hits[0], 0);
        for h in &hits[1..] {
            assert!((9_900..=10_100).contains(h), "{hits:?}");
        }
    }

    #[test]
    fn mix64_spreads_sequential_cookies() {
        let mut hits = [0u32; 5];
        for cookie in 1000..11_000u64 {
            hits[select_slot(mix64(cookie), 4) as usize] += 1;
        }
        for h in &hits[1..] {
            assert!((2_300..=2_700).contains(h), "{hits:?}");
        }
    }

    #[test]
    fn flow_hash_is_fixed_and_spreads_source_ports() {
        // Pinned value: every node and every lb version must agree on a flow's hash.
        let h = flow_hash(&[198, 18, 0, 1], &[198, 18, 1, 1], 40000, 80, IPPROTO_TCP);
        assert_eq!(h, 3_743_174_128);
        let v6 = flow_hash(
            &[0x20, 1, 0xd, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1],
            &[0x20, 1, 0xd, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2],
            40000,
            80,
            6,
        );
        assert_eq!(v6, 120_952_210);
        assert_ne!(
            h,
            flow_hash(&[198, 18, 0, 1], &[198, 18, 1, 1], 40001, 80, 6)
        );
        assert_ne!(
            h,
            flow_hash(&[198, 18, 0, 1], &[198, 18, 1, 1], 40000, 80, 17)
        );
        let mut hits = [0u32; 5];
        for sport in 10_000..20_000u16 {
            let h = flow_hash(&[198, 18, 0, 1], &[198, 18, 1, 1], sport, 80, 6);
            hits[select_slot(h, 4) as usize] += 1;
        }
        for h in &hits[1..] {
            assert!((2_300..=2_700).contains(h), "{hits:?}");
        }
    }

    #[test]
    fn trace_record_layout_is_packed_by_hand() {
        // Field offsets as userspace and bpftool read them; no implicit padding anywhere.
        assert_eq!(core::mem::offset_of!(TraceRecord, verdict), 0);
        assert_eq!(core::mem::offset_of!(TraceRecord, reason), 1);
        assert_eq!(core::mem::offset_of!(TraceRecord, scope), 2);
        assert_eq!(core::mem::offset_of!(TraceRecord, ct_state), 3);
        assert_eq!(core::mem::offset_of!(TraceRecord, slot), 4);
        assert_eq!(core::mem::offset_of!(TraceRecord, svc_flags), 6);
        assert_eq!(core::mem::offset_of!(TraceRecord, backend_id), 8);
        assert_eq!(core::mem::offset_of!(TraceRecord, rev_nat_id), 12);
        assert_eq!(core::mem::offset_of!(TraceRecord, masquerade), 16);
        assert_eq!(core::mem::offset_of!(TraceRecord, affinity), 17);
        assert_eq!(core::mem::offset_of!(TraceRecord, nat_port), 18);
        assert_eq!(core::mem::offset_of!(TraceRecord, maglev_cell), 20);
        assert_eq!(core::mem::offset_of!(TraceRecord, lb_alg), 24);
        assert_eq!(core::mem::offset_of!(TraceRecord, local_backend), 25);
        assert_eq!(core::mem::offset_of!(TraceRecord, ct_flags), 26);
        assert_eq!(core::mem::offset_of!(TraceRecord, frag), 28);
        assert_eq!(core::mem::offset_of!(TraceRecord, ext_headers), 29);
        assert_eq!(core::mem::offset_of!(TraceRecord, pad), 30);
        assert_eq!(size_of::<TraceRecord>(), 32);
    }

    #[test]
    fn ct_and_config_layouts_are_packed_by_hand() {
        use core::mem::offset_of;
        assert_eq!(offset_of!(Ct4Value, flags), 12);
        assert_eq!(offset_of!(Ct4Value, nat_port), 14);
        assert_eq!(offset_of!(Ct4Value, nat_addr), 16);
        assert_eq!(offset_of!(Ct6Value, nat_port), 14);
        assert_eq!(offset_of!(Ct6Value, nat_addr), 16);
        assert_eq!(offset_of!(LbConfig, node_ip6), 4);
        assert_eq!(offset_of!(LbConfig, flags), 20);
        assert_eq!(offset_of!(LbConfig, nat_port_min), 24);
        assert_eq!(offset_of!(LbConfig, nat_port_max), 26);
        assert_eq!(size_of::<PinMeta>(), 32);
        assert_eq!(offset_of!(PinMeta, netns_inode), 8);
        assert_eq!(offset_of!(PinMeta, lb_version), 16);
    }

    #[test]
    fn map_names_fit_the_kernel_limit() {
        assert!(map_names::TRACE.len() <= 15);
        for name in map_names::ALL {
            assert!(name.len() <= 15, "{name}");
        }
        for name in prog_names::ALL {
            assert!(name.len() <= 15, "{name}");
        }
    }
}
