//! Flag bits and small enumerations stored in map entries (scopes, service and conntrack
//! flags, algorithms, backend states, directions), the node's `config_flags`, the NAT port
//! range, conntrack lifetimes and echo verdicts.

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
