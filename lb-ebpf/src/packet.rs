//! The per-packet service load balancer, one pipeline for every packet hook: tc ingress of
//! external devices (`lb_tc_ingress`) and of pod veths (`lb_tc_pod`), tc egress (reverse NAT
//! only, `lb_tc_egress`), and XDP on external devices (`lb_xdp`). The entries (`tc`, `xdp`)
//! only name their hook.
//!
//! Ingress: a packet to a frontend is DNATed to its flow's conntrack backend, or to a backend
//! chosen for the new flow; it is rejected (TCP RST / ICMP port unreachable, `reject`) when the
//! frontend has no backend or its ClusterIP not that port, and dropped when the frontend has
//! endpoints but none here for external traffic (`externalTrafficPolicy: Local`) or the source
//! is outside its `loadBalancerSourceRanges`; a packet to an unallocated address of a
//! `--service-cidr` is dropped; a backend's reply gets its source turned back into the
//! frontend. What does not parse is passed untouched.
//!
//! A flow that is masqueraded (`nat`) gets its source rewritten too, right after the DNAT, and
//! is forwarded by `fwd` rather than the stack; so are replies whose frontend is a local
//! address (NodePorts). Its route is looked up before anything is rewritten: XDP, which cannot
//! resolve a next hop, leaves such a packet untouched for tc ingress on the same device, which
//! shares the conntrack and NAT table and so finishes it the same way.
//!
//! Every packet ends in one `Decision`: the verdict and the counter it bumps (once). The trace
//! record traced loads keep is written where the decision is made (a record travelling back
//! up through the calls would cost each frame a copy of the 512-byte stack the chain shares).
use aya_ebpf::helpers::bpf_get_prandom_u32;
use lb_common::{
    TraceRecord, config_flags, ct_dir, ct_flags, echo, flow_hash, lb_alg, metrics, scope,
    svc_flags, trace_ct, trace_verdict,
};

use crate::{
    af::{Af, Client, CtHead, Endpoint, V4, V6},
    conntrack,
    ctx::{Error, PacketCtx},
    frag::{self, FragAf},
    fwd::{self, FwdAf, Route},
    icmp::{self, IcmpAf},
    maps::{config, count, scratch},
    nat,
    parse::{self, FRAG_FIRST, FRAG_LATER, L3, Packet, ParseAf},
    reject::{self, RejectAf},
    rewrite,
    select::{self, Chosen, Origin, Service, Unserved},
    trace,
};

/// Which frontends a program balances, by where it is attached.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Hook {
    /// Ingress of an external-facing device (tc or XDP): a frontend's external scope.
    External,
    /// Ingress of a pod-facing device: in-cluster clients, like socket LB.
    Pod,
    /// Egress: reverse NAT only.
    Egress,
}

/// Runs the pipeline for the packet in `ctx` at `hook` and returns the hook's verdict.
#[inline(always)]
pub fn run<C: PacketCtx>(ctx: &C, hook: Hook) -> i32 {
    finish(ctx, try_packet(ctx, hook))
}

/// What happened to a packet: the tc verdict and the `metrics` index counted for it.
struct Decision {
    action: i32,
    reason: u32,
}

/// A decision that needs no more than verdict and reason in its trace record.
#[inline(always)]
fn untouched(action: i32, verdict: u8, reason: u32) -> Decision {
    trace::record(|r| {
        r.verdict = verdict;
        r.reason = reason as u8;
    });
    Decision { action, reason }
}

/// Counts the packet's decision (tracing the errors), and returns its verdict.
#[inline(always)]
fn finish<C: PacketCtx>(ctx: &C, result: Result<Decision, Error>) -> i32 {
    let d = match result {
        Ok(d) => d,
        Err(Error::Unparsed) => untouched(C::PASS, trace_verdict::PASS, metrics::TC_PASS_UNPARSED),
        Err(Error::Rewrite) => {
            // Rare: a csum/store helper failed on a packet that parsed fine.
            aya_log_ebpf::error!(ctx, "lb: rewrite helper failed, packet dropped");
            untouched(C::DROP, trace_verdict::DROP, metrics::TC_DROP_REWRITE)
        }
    };
    count(d.reason, ctx.len());
    d.action
}

#[inline(always)]
fn try_packet<C: PacketCtx>(ctx: &C, hook: Hook) -> Result<Decision, Error> {
    match parse::l3(ctx)? {
        L3::V4 => decided::<V4>(handle::<C, V4>(ctx, hook)),
        L3::V6 => decided::<V6>(handle::<C, V6>(ctx, hook)),
        L3::Icmp4 => icmp::<C, V4>(ctx, hook),
        L3::Icmp6 => icmp::<C, V6>(ctx, hook),
    }
}

/// After `handle` decided on a packet it parsed: a first fragment leaves its ports and the
/// flow it got for the later ones (`frag`), and the trace record gets the packet's shape
/// (fragment, IPv6 extension headers; traced loads only).
#[inline(always)]
fn decided<A: FragAf>(d: Result<Decision, Error>) -> Result<Decision, Error> {
    if d.is_err() {
        return d;
    }
    let Some(s) = scratch() else {
        return d;
    };
    // SAFETY: the packet `handle` parsed, in this CPU's scratch (see `handle`).
    let p = unsafe { &*(*s).packet.as_ptr().cast::<Packet<A::Addr>>() };
    if p.frag == FRAG_FIRST {
        frag::remember::<A>(p, conntrack::pin::<A>(p));
    }
    trace::amend(|r| {
        r.frag = p.frag;
        r.ext_headers = p.ext_headers;
    });
    d
}

const _: () = {
    assert!(size_of::<Packet<[u8; 16]>>() <= 80);
    assert!(size_of::<Service<[u8; 16]>>() <= 64);
    assert!(size_of::<Chosen<[u8; 16]>>() <= 48);
    assert!(size_of::<conntrack::Flow<[u8; 16]>>() <= 64);
};

/// A packet to a frontend is balanced (ingress only); one to a ClusterIP on a port it does not
/// have is rejected, one to an unallocated address of a `--service-cidr` dropped (kube-proxy's
/// `cluster-ips-check`); anything else may be a reply.
// BPF subprograms (`inline(never)`) keep the IPv4 and IPv6 paths, and the new, established
// and reply paths within them, in frames of their own: inlined together they overflow the
// 512-byte stack, which the verifier counts along the deepest call chain.
#[inline(never)]
fn handle<C: PacketCtx, A: FwdAf + ParseAf + RejectAf + FragAf>(
    ctx: &C,
    hook: Hook,
) -> Result<Decision, Error> {
    let s = scratch().ok_or(Error::Unparsed)?;
    // SAFETY: this CPU's scratch entry, alive for this run; each area is written by one step
    // and only read after it (see `maps::Scratch`; sizes checked below).
    let (p, svc, flow) = unsafe {
        (
            &mut *(*s).packet.as_mut_ptr().cast::<Packet<A::Addr>>(),
            &mut *(*s).service.as_mut_ptr().cast::<Service<A::Addr>>(),
            &mut *(*s).flow.as_mut_ptr().cast::<conntrack::Flow<A::Addr>>(),
        )
    };
    parse_into::<C, A>(ctx, p)?;
    if p.frag == FRAG_LATER && !frag::recall::<A>(p) {
        return Ok(untouched(
            C::PASS,
            trace_verdict::PASS,
            metrics::TC_PASS_FRAGMENT_UNKNOWN,
        ));
    }
    let p: &Packet<A::Addr> = p;
    let origin = match hook {
        Hook::External => Some(Origin::External),
        Hook::Pod => Some(Origin::Cluster),
        Hook::Egress => None,
    };
    if let Some(origin) = origin
        && lookup::<A>(p, origin, svc)
    {
        let now = conntrack::now_secs();
        match established::<A>(p, now, flow) {
            conntrack::CT_ESTABLISHED if p.has_l4() => {
                return established_flow::<C, A, true>(ctx, p, svc, flow);
            }
            conntrack::CT_ESTABLISHED if frag::follows_first(flow.backend_id, flow.nat.port) => {
                return established_flow::<C, A, false>(ctx, p, svc, flow);
            }
            // A later fragment only ever follows its first fragment's flow.
            _ if !p.has_l4() => {
                return Ok(untouched(
                    C::PASS,
                    trace_verdict::PASS,
                    metrics::TC_PASS_FRAGMENT_NO_FLOW,
                ));
            }
            conntrack::CT_BACKEND_GONE if !C::BUILDS_REPLIES => return Ok(to_tc::<C>()),
            conntrack::CT_BACKEND_GONE => return backend_gone::<C, A>(ctx, p, svc, flow),
            _ => {}
        }
        return new_flow::<C, A>(ctx, p, svc, now);
    }
    if origin.is_some() && p.has_l4() {
        match unserved::<A>(p) {
            UNSERVED_CLUSTER_IP if !C::BUILDS_REPLIES => return Ok(to_tc::<C>()),
            UNSERVED_CLUSTER_IP => {
                let action = reject_packet::<C, A>(ctx, p)?;
                trace::record(|r| {
                    r.verdict = reject_verdict::<C>(action);
                    r.reason = metrics::TC_REJECT_UNKNOWN_PORT as u8;
                });
                return Ok(Decision {
                    action,
                    reason: metrics::TC_REJECT_UNKNOWN_PORT,
                });
            }
            UNSERVED_SERVICE_CIDR => {
                return Ok(untouched(
                    C::DROP,
                    trace_verdict::DROP,
                    metrics::TC_DROP_UNALLOCATED,
                ));
            }
            _ => {}
        }
    }
    if reply::<A>(p, flow) {
        if p.has_l4() {
            from_backend::<C, A, true>(ctx, p, flow, hook)
        } else if frag::follows_first(flow.backend_id, flow.nat.port) {
            from_backend::<C, A, false>(ctx, p, flow, hook)
        } else {
            Ok(untouched(
                C::PASS,
                trace_verdict::PASS,
                metrics::TC_PASS_FRAGMENT_NO_FLOW,
            ))
        }
    } else {
        Ok(untouched(
            C::PASS,
            trace_verdict::PASS,
            metrics::TC_PASS_NO_SERVICE,
        ))
    }
}

/// `unserved`: the address is a ClusterIP (on another port or protocol).
const UNSERVED_CLUSTER_IP: u8 = 1;
/// `unserved`: the address is in a `--service-cidr` but no ClusterIP.
const UNSERVED_SERVICE_CIDR: u8 = 2;

/// Whether the destination of `p`, which matched no frontend, is still a service address:
/// `UNSERVED_CLUSTER_IP`, `UNSERVED_SERVICE_CIDR`, or 0.
// A subprogram, like `lookup`: the hash and LPM keys stay out of `handle`'s frame.
#[inline(never)]
fn unserved<A: Af>(p: &Packet<A::Addr>) -> u8 {
    if A::is_cluster_ip(p.daddr) {
        UNSERVED_CLUSTER_IP
    } else if A::in_service_cidr(p.daddr) {
        UNSERVED_SERVICE_CIDR
    } else {
        0
    }
}

/// Turns the packet into its reject reply and sends it back out the device it came in on
/// (`reject`); a TCP RST gets no answer and is dropped (`C::DROP`), counted under the same
/// reason, as a REJECT rule counts the RSTs it swallows. Returns the verdict.
// A subprogram: the reply's headers are built in a frame of their own, beside (not below)
// the new-flow and forwarding frames. It reads the packet pointers from `ctx` itself, fresh
// after each resize.
#[inline(never)]
fn reject_packet<C: PacketCtx, A: RejectAf>(ctx: &C, p: &Packet<A::Addr>) -> Result<i32, Error> {
    if !reject::answerable(p) {
        return Ok(C::DROP);
    }
    reject::reply::<C, A>(ctx, p)
}

/// The trace verdict of `reject_packet`'s action.
#[inline(always)]
fn reject_verdict<C: PacketCtx>(action: i32) -> u8 {
    if action == C::DROP {
        trace_verdict::DROP
    } else {
        trace_verdict::REJECT
    }
}

/// `conntrack::established`, into `out`.
#[inline(always)]
fn established<A: Af>(p: &Packet<A::Addr>, now: u32, out: &mut conntrack::Flow<A::Addr>) -> u8 {
    conntrack::established::<A>(p, now, out)
}

/// A TCP packet of an established flow whose backend was removed: no other backend knows the
/// connection, so the client gets a RST now (as Cilium does) instead of retransmitting into a
/// re-balanced backend that would answer with one anyway; the entry goes, so the client's next
/// SYN on the same 5-tuple is balanced afresh. tc only: XDP hands the packet on untouched,
/// entry and all.
#[inline(always)]
fn backend_gone<C: PacketCtx, A: FwdAf + RejectAf>(
    ctx: &C,
    p: &Packet<A::Addr>,
    svc: &Service<A::Addr>,
    flow: &conntrack::Flow<A::Addr>,
) -> Result<Decision, Error> {
    conntrack::forget::<A>(p);
    let action = reject_packet::<C, A>(ctx, p)?;
    trace::record(|r| {
        r.verdict = reject_verdict::<C>(action);
        r.reason = metrics::TC_REJECT_BACKEND_GONE as u8;
        r.scope = svc.scope;
        r.ct_state = trace_ct::BACKEND_GONE;
        r.svc_flags = svc.master.flags;
        r.backend_id = flow.backend_id;
        r.rev_nat_id = flow.rev_nat_id;
        r.ct_flags = flow.flags;
    });
    Ok(Decision {
        action,
        reason: metrics::TC_REJECT_BACKEND_GONE,
    })
}

/// `conntrack::reply`, into `out`.
#[inline(always)]
fn reply<A: Af>(p: &Packet<A::Addr>, out: &mut conntrack::Flow<A::Addr>) -> bool {
    conntrack::reply::<A>(p, out)
}

/// The frontend `p` is addressed to, in the scope its origin gets.
// A subprogram, like `parse_into`: the lookup keys stay out of `handle`'s frame.
#[inline(never)]
fn lookup<A: Af>(p: &Packet<A::Addr>, origin: Origin, out: &mut Service<A::Addr>) -> bool {
    let frontend = Endpoint {
        addr: p.daddr,
        port: p.dport,
    };
    match select::lookup::<A>(frontend, p.proto, origin) {
        Some(svc) => {
            *out = svc;
            true
        }
        None => false,
    }
}

/// A backend for a new flow `p` of `svc`: the client's affinity entry's, or one picked at
/// random, or with Maglev by the flow's hash (`lb_common::flow_hash`, the same on every node).
// A subprogram, like `parse_into`: the slot and backend lookups stay out of `new_flow`'s frame.
#[inline(never)]
fn choose<A: Af>(
    p: &Packet<A::Addr>,
    svc: &Service<A::Addr>,
    now: u32,
    out: &mut Chosen<A::Addr>,
) -> Result<(), Unserved> {
    let client = || Client {
        addr: p.saddr,
        netns_cookie: 0,
    };
    select::choose::<A>(
        svc,
        client,
        now,
        |alg| {
            if alg == lb_alg::MAGLEV {
                maglev_hash::<A>(p)
            } else {
                // SAFETY: helper without arguments.
                unsafe { bpf_get_prandom_u32() }
            }
        },
        out,
    )
}

/// The Maglev hash of the flow of `p` (`lb_common::flow_hash`).
// A subprogram: folding the addresses byte by byte spills registers, which would otherwise
// grow `choose`'s frame past what the tc path's 512-byte stack leaves it.
#[inline(never)]
fn maglev_hash<A: Af>(p: &Packet<A::Addr>) -> u32 {
    flow_hash(
        p.saddr.as_ref(),
        p.daddr.as_ref(),
        p.sport,
        p.dport,
        p.proto,
    )
}

/// Parses the packet into `out`.
// Inlined: as a subprogram LLVM would pass it the packet pointers themselves, and the
// verifier refuses arithmetic on `data_end` there.
#[inline(always)]
fn parse_into<C: PacketCtx, A: ParseAf>(ctx: &C, out: &mut Packet<A::Addr>) -> Result<(), Error> {
    A::parse(ctx, out)
}

/// A packet of a flow conntrack knows: DNAT to its backend (and SNAT if it is masqueraded).
#[inline(always)]
fn established_flow<C: PacketCtx, A: FwdAf, const L4: bool>(
    ctx: &C,
    p: &Packet<A::Addr>,
    svc: &Service<A::Addr>,
    flow: &conntrack::Flow<A::Addr>,
) -> Result<Decision, Error> {
    let Some(action) =
        to_backend::<C, A, L4>(ctx, p, &flow.endpoint, &flow.nat, flow.masqueraded())?
    else {
        return Ok(to_tc::<C>());
    };
    trace::record(|r| {
        r.verdict = trace_verdict::FORWARD;
        r.reason = metrics::TC_FWD_ESTABLISHED as u8;
        r.scope = svc.scope;
        r.ct_state = trace_ct::ESTABLISHED;
        r.svc_flags = svc.master.flags;
        r.backend_id = flow.backend_id;
        r.rev_nat_id = flow.rev_nat_id;
        r.ct_flags = flow.flags;
        trace_nat(r, &flow.nat, flow.masqueraded());
    });
    Ok(Decision {
        action,
        reason: metrics::TC_FWD_ESTABLISHED,
    })
}

/// A new flow: a backend is chosen, the flow recorded (with a NAT port if it is masqueraded,
/// see `nat`) and the packet DNATed (and SNATed) to it.
#[inline(always)]
fn new_flow<C: PacketCtx, A: FwdAf + RejectAf>(
    ctx: &C,
    p: &Packet<A::Addr>,
    svc: &Service<A::Addr>,
    now: u32,
) -> Result<Decision, Error> {
    if !source_allowed::<A>(p, svc) {
        trace::record(|r| {
            r.verdict = trace_verdict::DROP;
            r.reason = metrics::TC_DROP_SOURCE_RANGE as u8;
            r.scope = svc.scope;
            r.svc_flags = svc.master.flags;
            r.rev_nat_id = svc.master.rev_nat_id;
        });
        return Ok(Decision {
            action: C::DROP,
            reason: metrics::TC_DROP_SOURCE_RANGE,
        });
    }
    let s = scratch().ok_or(Error::Unparsed)?;
    // SAFETY: this CPU's scratch `chosen` area (see `handle`).
    let c = unsafe { &mut *(*s).chosen.as_mut_ptr().cast::<Chosen<A::Addr>>() };
    match choose::<A>(p, svc, now, c) {
        Ok(()) => {}
        // kube-proxy's no-endpoint-services: REJECT; a service with endpoints, none of them
        // here for external traffic, is DROPped.
        Err(n) => {
            let (action, reason) = if n.svc_flags & svc_flags::EMPTY_DROP != 0 {
                (C::DROP, metrics::TC_DROP_NO_LOCAL_BACKEND)
            } else if !C::BUILDS_REPLIES {
                return Ok(to_tc::<C>());
            } else {
                (
                    reject_packet::<C, A>(ctx, p)?,
                    metrics::TC_REJECT_NO_BACKEND,
                )
            };
            trace::record(|r| {
                r.verdict = reject_verdict::<C>(action);
                r.reason = reason as u8;
                r.scope = n.scope;
                r.ct_state = trace_ct::NONE;
                r.slot = n.slot;
                r.svc_flags = n.svc_flags;
                r.backend_id = n.backend_id;
                r.rev_nat_id = n.rev_nat_id;
                r.lb_alg = n.lb_alg;
                r.maglev_cell = n.maglev_cell;
            });
            return Ok(Decision { action, reason });
        }
    };
    let head = conntrack::new_head(p, c.backend_id, c.rev_nat_id, c.svc_flags, now);
    // Fully written even when not masqueraded: see `conntrack::Flow::nat`.
    let mut snat = Endpoint {
        addr: A::ZERO,
        port: 0,
    };
    let mut local = false;
    let masq = match snat_port::<C, A>(ctx, p, c, &head) {
        0 => false,
        SNAT_LOCAL => {
            count(metrics::TC_LOCAL_BACKEND, ctx.len());
            local = true;
            false
        }
        SNAT_EXHAUSTED => {
            trace::record(|r| {
                r.verdict = trace_verdict::DROP;
                r.reason = metrics::TC_SNAT_PORT_EXHAUSTED as u8;
                trace_chosen(r, c);
            });
            return Ok(Decision {
                action: C::DROP,
                reason: metrics::TC_SNAT_PORT_EXHAUSTED,
            });
        }
        port => match config().and_then(A::node_ip) {
            Some(addr) => {
                snat = Endpoint {
                    addr,
                    port: port as u16,
                };
                true
            }
            None => false,
        },
    };
    if conntrack::create::<A>(p, &c.backend, &head, &snat).is_err() {
        // The packet still goes to the chosen backend; later ones may pick another.
        count(metrics::TC_CT_INSERT_FAILED, ctx.len());
    }
    // A flow that lost its entry is re-balanced over what is programmed now (Cilium does the
    // same): dropping it would cut every long-lived flow LRU pressure evicts.
    let midstream = conntrack::midstream(p);
    if midstream {
        count(metrics::TC_CT_MISS_MIDSTREAM, ctx.len());
    }
    let Some(action) = to_backend::<C, A, true>(ctx, p, &c.backend, &snat, masq)? else {
        // The flow is recorded: tc finds it established and sends it the same way.
        return Ok(to_tc::<C>());
    };
    trace::record(|r| {
        r.verdict = trace_verdict::FORWARD;
        r.reason = metrics::TC_FWD_NEW as u8;
        r.ct_state = if midstream {
            trace_ct::NEW_MIDSTREAM
        } else {
            trace_ct::NEW
        };
        trace_chosen(r, c);
        trace_nat(r, &snat, masq);
        r.local_backend = u8::from(local);
    });
    Ok(Decision {
        action,
        reason: metrics::TC_FWD_NEW,
    })
}

/// The trace record fields a chosen backend fills.
#[inline(always)]
fn trace_chosen<A>(r: &mut TraceRecord, c: &Chosen<A>) {
    r.scope = c.scope;
    r.slot = c.slot;
    r.svc_flags = c.svc_flags;
    r.backend_id = c.backend_id;
    r.rev_nat_id = c.rev_nat_id;
    r.affinity = c.affinity;
    r.lb_alg = c.lb_alg;
    r.maglev_cell = c.maglev_cell;
}

/// `snat_port` found no free NAT port.
const SNAT_EXHAUSTED: u32 = 1 << 16;
/// `snat_port`: the flow would be masqueraded, but its backend is an address of this node
/// (`fwd::local`): it is DNATed only and delivered by the stack.
const SNAT_LOCAL: u32 = 1 << 17;

/// The NAT port of the new flow of `p` to `c` if it is masqueraded, its reply entry already
/// claimed; 0 if it is not masqueraded, `SNAT_LOCAL` if it is not because its backend is local,
/// `SNAT_EXHAUSTED` if no port was free.
// A subprogram: the decision's LPM key and the allocation's key need a frame of their own.
#[inline(never)]
fn snat_port<C: PacketCtx, A: FwdAf>(
    ctx: &C,
    p: &Packet<A::Addr>,
    c: &Chosen<A::Addr>,
    head: &CtHead,
) -> u32 {
    let Some(cfg) = config() else {
        return 0;
    };
    if !nat::masquerade::<A>(cfg, p, c) {
        return 0;
    }
    // A hostNetwork endpoint: the stack delivers the DNATed packet, and a node source would
    // make it a martian there; its replies meet `lb_tc_egress` on their way out.
    if fwd::local::<C, A>(ctx, p, &c.backend.addr) {
        return SNAT_LOCAL;
    }
    let Some(node) = A::node_ip(cfg) else {
        count(metrics::TC_SNAT_NO_NODE_IP, ctx.len());
        return 0;
    };
    match nat::allocate::<A>(cfg, p, &c.backend, head, &node) {
        0 => SNAT_EXHAUSTED,
        port => u32::from(port),
    }
}

/// DNATs the packet to `backend` and, masqueraded (`masq`), SNATs it to `to` and forwards it out of
/// the route to `backend` past the stack (`fwd`); returns the verdict, or `None` when the hook
/// cannot send it on that route and left it untouched (XDP, next hop unresolved).
#[inline(never)]
fn to_backend<C: PacketCtx, A: FwdAf, const L4: bool>(
    ctx: &C,
    p: &Packet<A::Addr>,
    backend: &Endpoint<A::Addr>,
    to: &Endpoint<A::Addr>,
    masq: bool,
) -> Result<Option<i32>, Error> {
    if !masq {
        rewrite::dnat::<C, A, L4>(ctx, p, *backend)?;
        return Ok(Some(C::PASS));
    }
    // The route is looked up after the rewrite where any route can be sent on (tc): a route
    // result held across the rewrite would make the verifier walk the rewrite once per value.
    let route = if C::RESOLVES_NEIGH {
        Route::None
    } else {
        match fwd::route::<C, A>(ctx, p, &to.addr, &backend.addr) {
            Route::Resolved => Route::Resolved,
            _ => return Ok(None),
        }
    };
    rewrite::dnat::<C, A, L4>(ctx, p, *backend)?;
    rewrite::snat::<C, A, L4>(ctx, p, *to)?;
    count(metrics::TC_SNAT, ctx.len());
    let route = if C::RESOLVES_NEIGH {
        fwd::route::<C, A>(ctx, p, &to.addr, &backend.addr)
    } else {
        route
    };
    fwd::send::<C, A>(ctx, p, route).map(Some)
}

/// Whether this hook can send a packet on `route`: tc always (the stack or `redirect_neigh`
/// covers what the FIB did not resolve), XDP only with a resolved next hop.
#[inline(always)]
fn sendable<C: PacketCtx>(route: Route) -> bool {
    C::RESOLVES_NEIGH || route == Route::Resolved
}

/// A packet left untouched for tc ingress on the same device (XDP only).
#[inline(always)]
fn to_tc<C: PacketCtx>() -> Decision {
    untouched(C::PASS, trace_verdict::PASS, metrics::XDP_PASS_TO_TC)
}

/// Whether the source of `p` may open a flow to `svc` (`loadBalancerSourceRanges`).
// A subprogram: the trie key stays out of `new_flow`'s frame.
#[inline(never)]
fn source_allowed<A: Af>(p: &Packet<A::Addr>, svc: &Service<A::Addr>) -> bool {
    svc.master.flags & svc_flags::SOURCE_RANGES == 0
        || A::in_source_range(svc.master.rev_nat_id, p.saddr)
}

/// The trace record's masquerade fields for `snat`.
#[inline(always)]
fn trace_nat<A>(r: &mut TraceRecord, to: &Endpoint<A>, masq: bool) {
    if masq {
        r.masquerade = 1;
        r.nat_port = to.port;
    }
}

/// The client a reply of `flow` goes back to.
#[inline(always)]
fn reply_client<A: Af>(p: &Packet<A::Addr>, flow: &conntrack::Flow<A::Addr>) -> A::Addr {
    if flow.masqueraded() {
        flow.nat.addr
    } else {
        p.daddr
    }
}

/// Rewrites a reply of `flow` to come from its frontend (and go back to the masqueraded
/// client).
#[inline(always)]
fn reverse_rewrite<C: PacketCtx, A: FwdAf, const L4: bool>(
    ctx: &C,
    p: &Packet<A::Addr>,
    flow: &conntrack::Flow<A::Addr>,
) -> Result<(), Error> {
    if flow.masqueraded() {
        rewrite::reverse_snat::<C, A, L4>(ctx, p, flow.endpoint, flow.nat)
    } else {
        rewrite::reverse_nat::<C, A, L4>(ctx, p, flow.endpoint)
    }
}

/// Reverse NAT of a backend's reply (un-SNAT too for masqueraded flows). On ingress, a reply
/// restored to a local frontend (a NodePort) is forwarded past the stack, which would drop it
/// as a martian.
#[inline(never)]
fn from_backend<C: PacketCtx, A: FwdAf, const L4: bool>(
    ctx: &C,
    p: &Packet<A::Addr>,
    flow: &conntrack::Flow<A::Addr>,
    hook: Hook,
) -> Result<Decision, Error> {
    let forward = hook != Hook::Egress && flow.flags & ct_flags::LOCAL_FRONTEND != 0;
    let action = if C::RESOLVES_NEIGH {
        // tc can send on any route: rewrite first, so the verifier walks the rewrite once
        // rather than once per branch.
        reverse_rewrite::<C, A, L4>(ctx, p, flow)?;
        if forward {
            let route =
                fwd::route::<C, A>(ctx, p, &flow.endpoint.addr, &reply_client::<A>(p, flow));
            fwd::send::<C, A>(ctx, p, route)?
        } else {
            C::PASS
        }
    } else if forward {
        // XDP: the route first, and the packet untouched for tc where it cannot be sent.
        let route = fwd::route::<C, A>(ctx, p, &flow.endpoint.addr, &reply_client::<A>(p, flow));
        if !sendable::<C>(route) {
            return Ok(to_tc::<C>());
        }
        reverse_rewrite::<C, A, L4>(ctx, p, flow)?;
        fwd::send::<C, A>(ctx, p, route)?
    } else {
        reverse_rewrite::<C, A, L4>(ctx, p, flow)?;
        C::PASS
    };
    trace::record(|r| {
        r.verdict = trace_verdict::REVERSE_NAT;
        r.reason = metrics::TC_REVNAT as u8;
        r.ct_state = trace_ct::REPLY;
        r.backend_id = flow.backend_id;
        r.rev_nat_id = flow.rev_nat_id;
        r.ct_flags = flow.flags;
    });
    Ok(Decision {
        action,
        reason: metrics::TC_REVNAT,
    })
}

/// An ICMP/ICMPv6 packet: an echo request on an ingress hook (`echo_request`), else an error
/// (`icmp_error`).
// Inlined into the entry: the reject an echo may get is built from here, the shallowest
// frame, as the subprograms' frames under one another would overflow the 512-byte stack.
#[inline(always)]
fn icmp<C: PacketCtx, A: IcmpAf + RejectAf>(ctx: &C, hook: Hook) -> Result<Decision, Error> {
    if hook == Hook::Egress {
        return icmp_error::<C, A>(ctx, hook);
    }
    match echo_request::<C, A>(ctx, hook) {
        ECHO_NONE => icmp_error::<C, A>(ctx, hook),
        ECHO_FAILED => Err(Error::Rewrite),
        ECHO_REJECT => {
            let s = scratch().ok_or(Error::Rewrite)?;
            // SAFETY: this CPU's scratch entry, its `packet` the request `echo_request`
            // parsed.
            let o = unsafe { &*(*s).packet.as_ptr().cast::<Packet<A::Addr>>() };
            let action = reject_packet::<C, A>(ctx, o)?;
            trace::amend(|r| r.verdict = reject_verdict::<C>(action));
            Ok(Decision {
                action,
                reason: metrics::TC_REJECT_NO_BACKEND,
            })
        }
        packed => Ok(Decision {
            action: packed as u32 as i32,
            reason: (packed >> 32) as u32,
        }),
    }
}

/// An ICMP/ICMPv6 error (`icmp`): one quoting a packet lb sent to a backend is rewritten for
/// the client (any hook, egress too: the node's own errors leave that way); one quoting a
/// reply lb reverse-NATed is rewritten for the backend (ingress hooks). Anything else ICMP
/// passes untouched.
// A subprogram beside `handle`: the error's and the quote's headers live in scratch memory.
#[inline(never)]
fn icmp_error<C: PacketCtx, A: IcmpAf>(ctx: &C, hook: Hook) -> Result<Decision, Error> {
    let s = scratch().ok_or(Error::Unparsed)?;
    // SAFETY: this CPU's scratch entry (see `handle`); the ICMP path uses `packet` for the
    // error's headers, `quoted` for the packet it quotes, `flow` for the quote's flow.
    let (o, q, flow) = unsafe {
        (
            &mut *(*s).packet.as_mut_ptr().cast::<Packet<A::Addr>>(),
            &mut *(*s).quoted.as_mut_ptr().cast::<Packet<A::Addr>>(),
            &mut *(*s).flow.as_mut_ptr().cast::<conntrack::Flow<A::Addr>>(),
        )
    };
    A::parse_error(ctx, o, q)?;
    let (o, q): (&Packet<A::Addr>, &Packet<A::Addr>) = (o, q);
    if conntrack::related::<A>(q, ct_dir::REPLY, flow) {
        return icmp_to_client::<C, A>(ctx, o, q, flow, hook);
    }
    if hook != Hook::Egress && conntrack::related::<A>(q, ct_dir::SERVICE, flow) {
        return icmp_to_backend::<C, A>(ctx, o, q, flow);
    }
    Ok(untouched(
        C::PASS,
        trace_verdict::PASS,
        metrics::TC_PASS_NO_SERVICE,
    ))
}

/// An echo request (ping) on an ingress hook: to a service address it gets what the address's
/// other traffic would (`lb*_echo`, per scope of the client): answered while a frontend there
/// has a usable backend, rejected or dropped as its frontends' traffic is when none has.
/// Anything else, or every echo with `--no-echo-reply`, passes untouched. Returns
/// `ECHO_NONE` for a packet that is no echo request, `ECHO_REJECT` for one the caller
/// rejects.
// A subprogram beside the error path, its decision packed in a scalar (action, reason << 32,
// or one of the `ECHO_*` values): the verifier refuses a subprogram whose return register may
// still hold a pointer into its own stack, which a struct return leaves there.
#[inline(never)]
fn echo_request<C: PacketCtx, A: IcmpAf + RejectAf>(ctx: &C, hook: Hook) -> u64 {
    let Some(s) = scratch() else {
        return ECHO_NONE;
    };
    // SAFETY: this CPU's scratch entry (see `handle`); `packet` takes the request's headers.
    let o = unsafe { &mut *(*s).packet.as_mut_ptr().cast::<Packet<A::Addr>>() };
    if A::parse_echo(ctx, o).is_err() {
        return ECHO_NONE;
    }
    match echo_decision::<C, A>(ctx, o, hook) {
        Ok(d) if d.reason == metrics::TC_REJECT_NO_BACKEND => ECHO_REJECT,
        Ok(d) => u64::from(d.action as u32) | (u64::from(d.reason) << 32),
        Err(_) => ECHO_FAILED,
    }
}

/// `echo_request`'s return for a failed rewrite.
const ECHO_FAILED: u64 = u64::MAX;
/// `echo_request`'s return for a request to reject (its trace record written).
const ECHO_REJECT: u64 = u64::MAX - 1;
/// `echo_request`'s return for anything but an echo request.
const ECHO_NONE: u64 = u64::MAX - 2;

#[inline(always)]
fn echo_decision<C: PacketCtx, A: IcmpAf + RejectAf>(
    ctx: &C,
    o: &Packet<A::Addr>,
    hook: Hook,
) -> Result<Decision, Error> {
    let off = config().is_some_and(|c| c.flags & config_flags::NO_ECHO_REPLY != 0);
    let (verdict, client_scope) = match A::echo(o.daddr) {
        Some(_) if off => (echo::NONE, 0),
        Some(v) if hook == Hook::Pod => (v.internal, scope::INTERNAL),
        Some(v) => (v.external, scope::EXTERNAL),
        None => (echo::NONE, 0),
    };
    let (action, verdict, reason) = match verdict {
        echo::ANSWER => {
            icmp::echo_reply::<C, A>(ctx, o)?;
            (
                ctx.bounce()?,
                trace_verdict::ECHO_REPLY,
                metrics::TC_ECHO_REPLY,
            )
        }
        echo::REJECT if !C::BUILDS_REPLIES => return Ok(to_tc::<C>()),
        // Built by the caller (`ECHO_REJECT`).
        echo::REJECT => (
            C::DROP,
            trace_verdict::REJECT,
            metrics::TC_REJECT_NO_BACKEND,
        ),
        echo::DROP => (
            C::DROP,
            trace_verdict::DROP,
            metrics::TC_DROP_NO_LOCAL_BACKEND,
        ),
        _ => (C::PASS, trace_verdict::PASS, metrics::TC_PASS_NO_SERVICE),
    };
    trace::record(|r| {
        r.verdict = verdict;
        r.reason = reason as u8;
        r.scope = client_scope;
    });
    Ok(Decision { action, reason })
}

/// An error about a packet lb sent to a backend, rewritten for the client (`icmp::revnat`).
/// One the backend itself sent now comes from the frontend; for a local frontend (a
/// NodePort) that is a local source, which the stack would drop as a martian, so it is
/// forwarded past the stack like a reply (`from_backend`).
// Inlined into `icmp_error`: as a subprogram it would take more arguments than BPF passes in
// registers.
#[inline(always)]
fn icmp_to_client<C: PacketCtx, A: IcmpAf>(
    ctx: &C,
    o: &Packet<A::Addr>,
    q: &Packet<A::Addr>,
    flow: &conntrack::Flow<A::Addr>,
    hook: Hook,
) -> Result<Decision, Error> {
    let src = icmp::client_side_source::<A>(o, q, &flow.endpoint);
    let forward = hook != Hook::Egress
        && flow.flags & ct_flags::LOCAL_FRONTEND != 0
        && !A::same(src, o.saddr);
    let action = if !forward {
        icmp::revnat::<C, A>(ctx, o, q, flow)?;
        C::PASS
    } else {
        let dst = if flow.masqueraded() {
            flow.nat.addr
        } else {
            o.daddr
        };
        let route = fwd::route::<C, A>(ctx, o, &src, &dst);
        if !sendable::<C>(route) {
            return Ok(to_tc::<C>());
        }
        icmp::revnat::<C, A>(ctx, o, q, flow)?;
        fwd::send::<C, A>(ctx, o, route)?
    };
    trace::record(|r| {
        r.verdict = trace_verdict::REVERSE_NAT;
        r.reason = metrics::TC_ICMP_ERROR_REVNAT as u8;
        r.ct_state = trace_ct::RELATED;
        r.backend_id = flow.backend_id;
        r.rev_nat_id = flow.rev_nat_id;
        r.ct_flags = flow.flags;
    });
    Ok(Decision {
        action,
        reason: metrics::TC_ICMP_ERROR_REVNAT,
    })
}

/// An error about a reply lb reverse-NATed, rewritten for the backend (`icmp::dnat`) and sent
/// to it as the flow's packets go: by the stack, or past it when masqueraded (`to_backend`).
#[inline(always)]
fn icmp_to_backend<C: PacketCtx, A: IcmpAf>(
    ctx: &C,
    o: &Packet<A::Addr>,
    q: &Packet<A::Addr>,
    flow: &conntrack::Flow<A::Addr>,
) -> Result<Decision, Error> {
    let action = if !flow.masqueraded() {
        icmp::dnat::<C, A>(ctx, o, q, flow)?;
        C::PASS
    } else {
        let route = fwd::route::<C, A>(ctx, o, &flow.nat.addr, &flow.endpoint.addr);
        if !sendable::<C>(route) {
            return Ok(to_tc::<C>());
        }
        icmp::dnat::<C, A>(ctx, o, q, flow)?;
        count(metrics::TC_SNAT, ctx.len());
        fwd::send::<C, A>(ctx, o, route)?
    };
    trace::record(|r| {
        r.verdict = trace_verdict::FORWARD;
        r.reason = metrics::TC_ICMP_ERROR_FORWARD as u8;
        r.ct_state = trace_ct::RELATED;
        r.backend_id = flow.backend_id;
        r.rev_nat_id = flow.rev_nat_id;
        r.ct_flags = flow.flags;
        trace_nat(r, &flow.nat, flow.masqueraded());
    });
    Ok(Decision {
        action,
        reason: metrics::TC_ICMP_ERROR_FORWARD,
    })
}
