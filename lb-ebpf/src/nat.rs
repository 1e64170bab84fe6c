//! Masquerade (SNAT) of tc-balanced flows, sharing the conntrack table.
//!
//! Whether a new flow is masqueraded follows kube-proxy's rules (`mark-for-masquerade`):
//! - hairpin: the chosen backend is the client itself (KUBE-SEP's `-s <ep ip>` rule);
//! - to a ClusterIP: with `--masquerade-all` always, else with a local-traffic detector
//!   (`--cluster-cidr` of the family) when the source is outside every cluster CIDR; without
//!   a detector never;
//! - to an external destination (externalIP, LoadBalancer IP): with
//!   `externalTrafficPolicy: Cluster` always (it may cross nodes); with `Local` only traffic
//!   from the node itself, never from pods (their short-circuit) or outside (source kept).
//!
//! A flow these rules would masquerade is not when its backend is an address of this node (a
//! hostNetwork endpoint, `fwd::local`): the stack delivers it after the DNAT, and would drop it
//! as a martian with the node IP as its source (`packet::snat_port`).
//!
//! The masquerade source is the family's node IP from `lb_config` with a port allocated here:
//! random candidates from the configured range, the first whose reply key (backend →
//! node IP:port) can be inserted with `BPF_NOEXIST` wins, so two flows never share one.
use aya_ebpf::{bindings::BPF_NOEXIST, helpers::bpf_get_prandom_u32};
use lb_common::{LbConfig, config_flags, ct_flags, nat, svc_flags};

use crate::{
    af::{Af, CtHead, Endpoint},
    conntrack,
    parse::Packet,
    select::Chosen,
};

/// Whether the new flow of `p` to `c` is masqueraded under `cfg`.
#[inline(always)]
pub fn masquerade<A: Af>(cfg: &LbConfig, p: &Packet<A::Addr>, c: &Chosen<A::Addr>) -> bool {
    if A::same(c.backend.addr, p.saddr) {
        return true;
    }
    let detector = cfg.flags & A::CLUSTER_CIDR_FLAG != 0;
    let from_pod = detector && A::in_cluster_cidr(p.saddr);
    if c.svc_flags & svc_flags::CLUSTER_IP != 0 {
        cfg.flags & config_flags::MASQUERADE_ALL != 0 || (detector && !from_pod)
    } else if c.svc_flags & svc_flags::EXT_LOCAL == 0 {
        true
    } else {
        !from_pod && A::node_ip(cfg).is_some_and(|n| A::same(n, p.saddr))
    }
}

/// Claims a NAT port on `node` for a new flow of `p` to `backend` by inserting its reply
/// entry (`head` plus the client to restore) and returns the port, or 0 when every candidate
/// was taken.
#[inline(always)]
pub fn allocate<A: Af>(
    cfg: &LbConfig,
    p: &Packet<A::Addr>,
    backend: &Endpoint<A::Addr>,
    head: &CtHead,
    node: &A::Addr,
) -> u16 {
    let (min, max) = if cfg.nat_port_min == 0 || cfg.nat_port_max < cfg.nat_port_min {
        (nat::PORT_MIN, nat::PORT_MAX)
    } else {
        (cfg.nat_port_min, cfg.nat_port_max)
    };
    let span = u64::from(max - min) + 1;
    let reply = CtHead {
        flags: head.flags | ct_flags::SNAT,
        nat_port: p.sport,
        ..*head
    };
    for _ in 0..nat::PORT_TRIES {
        // SAFETY: helper without arguments.
        let rand = u64::from(unsafe { bpf_get_prandom_u32() });
        // Multiply-shift keeps the port inside the range without a division.
        let port = min + ((rand * span) >> 32) as u16;
        let Some(key) = conntrack::reply_key::<A>(backend, node, port, p.proto) else {
            return 0;
        };
        if A::ct_put(key, &reply, &p.saddr, BPF_NOEXIST as u64).is_ok() {
            return port;
        }
    }
    0
}
