//! Per-packet service load balancing on tc.
//!
//! Ingress (`lb_tc_ingress` on external-facing devices, `lb_tc_pod` on the host side of pod
//! veths): a packet to a frontend is DNATed to its flow's conntrack backend, or to a backend
//! chosen for the new flow, or rejected (TCP RST / ICMP port unreachable, `reject`) when the
//! frontend has no backend or its ClusterIP not that port; a backend's reply gets its source
//! turned back into the frontend.
//! Egress does the reverse NAT only. What does not parse is passed untouched.
//!
//! Every packet ends in one `Decision`: the verdict, the counter it bumps (once), and the
//! trace record traced loads write.
use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_SHOT},
    helpers::bpf_get_prandom_u32,
    macros::classifier,
    programs::TcContext,
};
use lb_common::{TraceRecord, metrics, trace_ct, trace_verdict};

use crate::{
    af::{Endpoint, V4, V6},
    conntrack,
    ctx::{Error, PacketCtx},
    maps::count,
    parse::{self, Packet, Parsed},
    reject::{self, RejectAf},
    rewrite::{self, RewriteAf},
    select::{self, Origin, Service},
    trace,
};

/// Which frontends a tc program balances, by where it is attached.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Hook {
    /// Ingress of an external-facing device: a frontend's external scope.
    External,
    /// Ingress of a pod-facing device: in-cluster clients, like socket LB.
    Pod,
    /// Egress: reverse NAT only.
    Egress,
}

#[classifier]
pub fn lb_tc_ingress(ctx: TcContext) -> i32 {
    finish(&ctx, try_tc(&ctx, Hook::External))
}

#[classifier]
pub fn lb_tc_pod(ctx: TcContext) -> i32 {
    finish(&ctx, try_tc(&ctx, Hook::Pod))
}

#[classifier]
pub fn lb_tc_egress(ctx: TcContext) -> i32 {
    finish(&ctx, try_tc(&ctx, Hook::Egress))
}

/// What happened to a packet: the tc verdict and its trace record, whose `reason` is the
/// `metrics` index counted for it.
struct Decision {
    action: i32,
    record: TraceRecord,
}

impl Decision {
    #[inline(always)]
    fn untouched(action: i32, verdict: u8, reason: u32) -> Self {
        Decision {
            action,
            record: TraceRecord {
                verdict,
                reason: reason as u8,
                ..TraceRecord::default()
            },
        }
    }
}

/// Counts and traces the packet's decision, and returns its verdict.
#[inline(always)]
fn finish<C: PacketCtx>(ctx: &C, result: Result<Decision, Error>) -> i32 {
    let d = match result {
        Ok(d) => d,
        Err(Error::Unparsed) => {
            Decision::untouched(TC_ACT_OK, trace_verdict::PASS, metrics::TC_PASS_UNPARSED)
        }
        Err(Error::Rewrite) => {
            // Rare: a csum/store helper failed on a packet that parsed fine.
            aya_log_ebpf::error!(ctx, "tc: rewrite helper failed, packet dropped");
            Decision::untouched(TC_ACT_SHOT, trace_verdict::DROP, metrics::TC_DROP_REWRITE)
        }
    };
    count(d.record.reason as u32, ctx.len());
    trace::record(&d.record);
    d.action
}

#[inline(always)]
fn try_tc<C: PacketCtx>(ctx: &C, hook: Hook) -> Result<Decision, Error> {
    match parse::parse(ctx)? {
        Parsed::V4(p) => handle::<C, V4>(ctx, &p, hook),
        Parsed::V6(p) => handle::<C, V6>(ctx, &p, hook),
    }
}

/// A packet to a frontend is balanced (ingress only); one to a ClusterIP on a port it does not
/// have is rejected, one to an unallocated address of a `--service-cidr` dropped (kube-proxy's
/// `cluster-ips-check`); anything else may be a reply.
#[inline(always)]
fn handle<C: PacketCtx, A: RewriteAf + RejectAf>(
    ctx: &C,
    p: &Packet<A::Addr>,
    hook: Hook,
) -> Result<Decision, Error> {
    let origin = match hook {
        Hook::External => Some(Origin::External),
        Hook::Pod => Some(Origin::Cluster),
        Hook::Egress => None,
    };
    let frontend = Endpoint {
        addr: p.daddr,
        port: p.dport,
    };
    if let Some(origin) = origin {
        if let Some(svc) = select::lookup::<A>(frontend, p.proto, origin) {
            return to_service::<C, A>(ctx, p, &svc);
        }
        if A::is_cluster_ip(p.daddr) {
            return reject_with::<C, A>(
                ctx,
                p,
                TraceRecord {
                    reason: metrics::TC_REJECT_UNKNOWN_PORT as u8,
                    ..TraceRecord::default()
                },
            );
        }
        if A::in_service_cidr(p.daddr) {
            return Ok(Decision::untouched(
                TC_ACT_SHOT,
                trace_verdict::DROP,
                metrics::TC_DROP_UNALLOCATED,
            ));
        }
    }
    from_backend::<C, A>(ctx, p)
}

/// Answers the packet with its reject reply; `record` carries the reason and service details.
/// A TCP RST gets no answer and is dropped, counted under the same reason (as a REJECT rule
/// counts the RSTs it swallows).
#[inline(always)]
fn reject_with<C: PacketCtx, A: RejectAf>(
    ctx: &C,
    p: &Packet<A::Addr>,
    record: TraceRecord,
) -> Result<Decision, Error> {
    if !reject::answerable(p) {
        return Ok(Decision {
            action: TC_ACT_SHOT,
            record: TraceRecord {
                verdict: trace_verdict::DROP,
                ..record
            },
        });
    }
    let action = reject::reply::<C, A>(ctx, p)?;
    Ok(Decision {
        action,
        record: TraceRecord {
            verdict: trace_verdict::REJECT,
            ..record
        },
    })
}

/// DNAT to the flow's backend if conntrack knows a live one, else to a newly chosen backend.
#[inline(always)]
fn to_service<C: PacketCtx, A: RewriteAf + RejectAf>(
    ctx: &C,
    p: &Packet<A::Addr>,
    svc: &Service<A::Addr>,
) -> Result<Decision, Error> {
    let now = conntrack::now_secs();
    if let Some(flow) = conntrack::established::<A>(p, now) {
        rewrite::dnat::<C, A>(ctx, p, flow.endpoint)?;
        return Ok(Decision {
            action: TC_ACT_OK,
            record: TraceRecord {
                verdict: trace_verdict::FORWARD,
                reason: metrics::TC_FWD_ESTABLISHED as u8,
                scope: svc.scope,
                ct_state: trace_ct::ESTABLISHED,
                slot: 0,
                svc_flags: svc.master.flags,
                backend_id: flow.backend_id,
                rev_nat_id: flow.rev_nat_id,
            },
        });
    }
    // SAFETY: helper without arguments.
    match select::choose::<A>(svc, || unsafe { bpf_get_prandom_u32() }) {
        Ok(c) => {
            if conntrack::create::<A>(p, c.backend, c.backend_id, c.rev_nat_id, now).is_err() {
                // The packet still goes to the chosen backend; later ones may pick another.
                count(metrics::TC_CT_INSERT_FAILED, ctx.len());
            }
            rewrite::dnat::<C, A>(ctx, p, c.backend)?;
            Ok(Decision {
                action: TC_ACT_OK,
                record: TraceRecord {
                    verdict: trace_verdict::FORWARD,
                    reason: metrics::TC_FWD_NEW as u8,
                    scope: c.scope,
                    ct_state: trace_ct::NEW,
                    slot: c.slot,
                    svc_flags: c.svc_flags,
                    backend_id: c.backend_id,
                    rev_nat_id: c.rev_nat_id,
                },
            })
        }
        // kube-proxy's no-endpoint-services: REJECT.
        Err(n) => reject_with::<C, A>(
            ctx,
            p,
            TraceRecord {
                verdict: trace_verdict::REJECT,
                reason: metrics::TC_REJECT_NO_BACKEND as u8,
                scope: n.scope,
                ct_state: trace_ct::NONE,
                slot: n.slot,
                svc_flags: n.svc_flags,
                backend_id: n.backend_id,
                rev_nat_id: n.rev_nat_id,
            },
        ),
    }
}

/// Reverse NAT of a backend's reply; anything else passes untouched.
#[inline(always)]
fn from_backend<C: PacketCtx, A: RewriteAf>(
    ctx: &C,
    p: &Packet<A::Addr>,
) -> Result<Decision, Error> {
    let Some(flow) = conntrack::reply::<A>(p) else {
        return Ok(Decision::untouched(
            TC_ACT_OK,
            trace_verdict::PASS,
            metrics::TC_PASS_NO_SERVICE,
        ));
    };
    rewrite::reverse_nat::<C, A>(ctx, p, flow.endpoint)?;
    Ok(Decision {
        action: TC_ACT_OK,
        record: TraceRecord {
            verdict: trace_verdict::REVERSE_NAT,
            reason: metrics::TC_REVNAT as u8,
            ct_state: trace_ct::REPLY,
            backend_id: flow.backend_id,
            rev_nat_id: flow.rev_nat_id,
            ..TraceRecord::default()
        },
    })
}
