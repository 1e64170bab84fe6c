//! Indices into the per-CPU `lb_metrics` array: what the datapath did, per packet or per
//! socket call. Userspace sums the CPUs and exports each index under its `NAMES` entry.
//!
//! The `tc_*` indices count the per-packet path's decisions wherever it runs: tc, or XDP on an
//! external device (the same code); `xdp_*` ones what only XDP does.

/// tc: new flow to a service, DNAT to a freshly chosen backend.
pub const TC_FWD_NEW: u32 = 0;
/// tc: packet of a known flow, DNAT to its conntrack backend.
pub const TC_FWD_ESTABLISHED: u32 = 1;
/// tc: reply from a backend, source rewritten back to the frontend.
pub const TC_REVNAT: u32 = 2;
/// tc: not a service and not a reply; passed untouched.
pub const TC_PASS_NO_SERVICE: u32 = 3;
/// tc: not fully parsed (non-IP, fragment, unknown L4, truncated); passed untouched.
pub const TC_PASS_UNPARSED: u32 = 4;
/// tc: service with no backend; dropped. Retired: such packets are rejected now
/// (`TC_REJECT_NO_BACKEND`); the index stays so the others keep theirs.
pub const TC_DROP_NO_BACKEND: u32 = 5;
/// tc: a rewrite helper failed; dropped rather than forwarded half-rewritten.
pub const TC_DROP_REWRITE: u32 = 6;
/// tc: conntrack insert failed; packet still forwarded to the chosen backend.
pub const TC_CT_INSERT_FAILED: u32 = 7;
/// Socket LB: connect() or sendmsg() translated to a backend.
pub const SOCK_FWD: u32 = 8;
/// Socket LB: recvmsg() or getpeername() translated back to the frontend.
pub const SOCK_REVNAT: u32 = 9;
/// Socket LB: service with no backend, or a ClusterIP port no frontend has; the call fails
/// with ECONNREFUSED (EPERM on kernels without `bpf_set_retval` for sock_addr programs).
pub const SOCK_DROP_NO_BACKEND: u32 = 10;
/// Socket LB: reverse entry insert failed; replies will show the backend address.
pub const SOCK_REVNAT_INSERT_FAILED: u32 = 11;
/// tc: packet to a backend whose source was masqueraded to the node IP (new and established).
pub const TC_SNAT: u32 = 12;
/// tc: new flow that needed masquerading dropped: no free NAT port after `nat::PORT_TRIES`.
pub const TC_SNAT_PORT_EXHAUSTED: u32 = 13;
/// tc: masquerade applied but no node IP of the family is configured; sent unmasqueraded.
pub const TC_SNAT_NO_NODE_IP: u32 = 14;
/// tc: no FIB route to forward a masqueraded packet past the stack; left to the stack, which
/// drops IPv4 packets carrying a local source address.
pub const TC_SNAT_NO_ROUTE: u32 = 15;
/// tc: service with no backend; answered with a TCP RST or ICMP port unreachable (a TCP RST
/// is only dropped: RSTs are never answered).
pub const TC_REJECT_NO_BACKEND: u32 = 16;
/// tc: a ClusterIP on a port/protocol none of its frontends has; answered like
/// `TC_REJECT_NO_BACKEND`.
pub const TC_REJECT_UNKNOWN_PORT: u32 = 17;
/// tc: an address in a `--service-cidr` that is no ClusterIP; dropped.
pub const TC_DROP_UNALLOCATED: u32 = 18;
/// Socket LB: connect()/sendmsg() to a ClusterIP on a port none of its frontends has; the call
/// fails like `SOCK_DROP_NO_BACKEND`.
pub const SOCK_REJECT_UNKNOWN_PORT: u32 = 19;

/// tc/XDP: a frontend with `externalTrafficPolicy: Local` (external traffic) or a ClusterIP
/// with `internalTrafficPolicy: Local` and no endpoint on this node; dropped (kube-proxy's
/// DROP: the service has endpoints elsewhere).
pub const TC_DROP_NO_LOCAL_BACKEND: u32 = 20;
/// tc/XDP: a source outside the frontend's `loadBalancerSourceRanges`; dropped.
pub const TC_DROP_SOURCE_RANGE: u32 = 21;
/// XDP: a packet XDP could not finish itself (masqueraded, but the route to the backend or
/// client is not resolved yet); passed untouched to tc ingress on the same device, which does.
pub const XDP_PASS_TO_TC: u32 = 22;
/// XDP: balanced or reverse-NATed and sent back out the device it came in on (`XDP_TX`).
pub const XDP_TX: u32 = 23;
/// XDP: balanced or reverse-NATed and redirected to the device of its route.
pub const XDP_REDIRECT: u32 = 24;
/// tc/XDP: a TCP or SCTP packet that opens no connection (no SYN, no INIT) found no usable
/// conntrack entry (LRU eviction under pressure, expiry, or its backend was removed); it is
/// balanced as a new flow over the backends programmed now, never a remembered one. Counted in
/// addition to its verdict (`TC_FWD_NEW`).
pub const TC_CT_MISS_MIDSTREAM: u32 = 25;
/// tc: a TCP packet that opens no connection (no SYN) whose conntrack entry names a backend
/// that is gone; answered with a RST (a RST itself is only dropped) and the entry deleted, so
/// the client learns at once instead of retransmitting into a new backend that never heard of
/// the connection. UDP, SCTP and SYNs are re-balanced instead.
pub const TC_REJECT_BACKEND_GONE: u32 = 26;
/// cgroup egress: a datagram of a connected UDP socket that socket LB pinned to a backend that
/// has left its frontend (`lb_udp_gone`); dropped, so the send() fails with EPERM and the
/// application reconnects (the re-steering fallback where sockets cannot be destroyed).
pub const SOCK_UDP_GONE_DROP: u32 = 27;
/// tc/XDP: a new flow whose backend is an address of this node (a hostNetwork endpoint, found
/// by a FIB lookup): DNATed only, never masqueraded, and handed to the local stack, which
/// would drop it as a martian with the node IP as its source; the local socket's replies are
/// reverse-NATed on the egress of the device they leave by (`lb_tc_egress`). Counted in
/// addition to its verdict (`TC_FWD_NEW`).
pub const TC_LOCAL_BACKEND: u32 = 28;
/// Socket LB: connect()/sendmsg() to a ClusterIP with `internalTrafficPolicy: Local` and no
/// endpoint on this node (endpoints elsewhere); denied without a chosen error, so the call
/// fails with EPERM, as a netfilter DROP fails a local sender (kube-proxy's DROP).
pub const SOCK_DROP_NO_LOCAL_BACKEND: u32 = 29;
/// tc/XDP: an ICMP or ICMPv6 error quoting a packet lb sent to a backend (a router's
/// "fragmentation needed", a backend's port unreachable) rewritten for the client: the quote
/// made client → frontend again, the outer addresses to match (see `icmp` in lb-ebpf).
pub const TC_ICMP_ERROR_REVNAT: u32 = 30;
/// tc/XDP: an ICMP or ICMPv6 error quoting a reply lb reverse-NATed rewritten for its backend
/// (the quote made backend → client again, sent to the backend).
pub const TC_ICMP_ERROR_FORWARD: u32 = 31;
/// tc/XDP: a later IPv4/IPv6 fragment whose first fragment lb has not seen (out of order, or
/// its entry evicted): it has no ports to match a flow by, so it passes untouched.
pub const TC_PASS_FRAGMENT_UNKNOWN: u32 = 32;
/// tc/XDP: a later fragment of a datagram to a frontend whose first fragment created no flow
/// (it was rejected or dropped, or its flow is gone): passed untouched, never balanced on its
/// own.
pub const TC_PASS_FRAGMENT_NO_FLOW: u32 = 33;
/// tc/XDP: an ICMP/ICMPv6 echo request to a service address with a usable backend (`lb*_echo`)
/// answered with an echo reply.
pub const TC_ECHO_REPLY: u32 = 34;
/// sock: a socket given socket storage (`lb*_sk_store`), made when it came back to a pair it
/// had recorded in `lb*_sk_revnat` (an unconnected UDP socket's second datagram to a
/// frontend).
pub const SOCK_STORAGE_CREATED: u32 = 35;

/// Size of the metrics array; room for the verdicts later features add.
pub const MAX: usize = 64;

/// Metric names, indexed like the constants above.
pub const NAMES: [&str; 36] = [
    "tc_forward_new",
    "tc_forward_established",
    "tc_reverse_nat",
    "tc_pass_no_service",
    "tc_pass_unparsed",
    "tc_drop_no_backend",
    "tc_drop_rewrite_failed",
    "tc_ct_insert_failed",
    "sock_forward",
    "sock_reverse_nat",
    "sock_drop_no_backend",
    "sock_revnat_insert_failed",
    "tc_snat",
    "tc_snat_port_exhausted",
    "tc_snat_no_node_ip",
    "tc_snat_no_route",
    "tc_reject_no_backend",
    "tc_reject_unknown_port",
    "tc_drop_unallocated_service_ip",
    "sock_reject_unknown_port",
    "tc_drop_no_local_backend",
    "tc_drop_source_range",
    "xdp_pass_to_tc",
    "xdp_tx",
    "xdp_redirect",
    "tc_ct_miss_midstream",
    "tc_reject_backend_gone",
    "sock_udp_gone_drop",
    "tc_local_backend",
    "sock_drop_no_local_backend",
    "tc_icmp_error_reverse_nat",
    "tc_icmp_error_forward",
    "tc_pass_fragment_unknown",
    "tc_pass_fragment_no_flow",
    "tc_echo_reply",
    "sock_storage_created",
];
