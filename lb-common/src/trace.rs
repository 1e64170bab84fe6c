//! The decision record traced loads write (`TraceRecord`) and the values of its fields.

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
