//! Map keys and values, one `#[repr(C)]` struct each, with explicit padding fields.

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

/// Pairs one socket keeps in its own storage (`lb*_sk_store`) before the rest go to
/// `lb*_sk_revnat`. A connected socket needs one; four cover an unconnected UDP socket
/// talking to a few frontends (a resolver with its name servers) without a global write.
pub const SK_STORE_SLOTS: usize = 4;

/// One (backend → frontend) pair of a socket (`SkStore4`); ports in host order.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct SkSlot4 {
    pub backend: [u8; 4],
    pub frontend: [u8; 4],
    pub backend_port: u16,
    pub frontend_port: u16,
    pub rev_nat_id: u32,
}

/// One (backend → frontend) pair of a socket (`SkStore6`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct SkSlot6 {
    pub backend: [u8; 16],
    pub frontend: [u8; 16],
    pub backend_port: u16,
    pub frontend_port: u16,
    pub rev_nat_id: u32,
}

/// Value of `lb4_sk_store` (socket storage, freed with the socket): what `lb4_sk_revnat`
/// holds for this socket, without a global map write. Slots `0..used` are valid and are
/// filled once, never replaced (a reader never sees a slot change under it); a pair that
/// finds them full goes to `lb4_sk_revnat`, and `overflow` says to look there too. connect()
/// starts over with one slot: a connected socket has one peer.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct SkStore4 {
    pub used: u8,
    pub overflow: u8,
    pub pad: [u8; 2],
    pub slots: [SkSlot4; SK_STORE_SLOTS],
}

/// Value of `lb6_sk_store`, as `SkStore4`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct SkStore6 {
    pub used: u8,
    pub overflow: u8,
    pub pad: [u8; 2],
    pub slots: [SkSlot6; SK_STORE_SLOTS],
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

/// Per-CPU value of `lb_metrics` (key: a `metrics` index, `u32`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct MetricValue {
    pub packets: u64,
    pub bytes: u64,
}
