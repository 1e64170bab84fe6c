//! Backend selection for a new flow or socket, shared by the tc and socket hooks so both agree
//! on what a frontend is, which scope a client gets and what "no backend" means.
//!
//! A frontend `(addr, port, proto, scope)` has a master entry at slot 0 (backend count, flags,
//! rev-NAT id, algorithm) and slots `1..=count` naming backend ids. A master entry with no
//! usable backend behind the chosen slot (count 0, a missing slot, a slot naming a missing
//! backend) is `NoBackend` for every hook: the caller counts it once and drops or denies.
//!
//! Session affinity (`svc_flags::AFFINITY`) comes before the slot: a client whose entry in
//! `lb*_affinity` is younger than the frontend's timeout and names one of its active backends
//! (`lb*_aff_match`) gets that backend again; otherwise the slot's backend is chosen and
//! remembered. Packet hooks key clients by address, socket hooks by network namespace.
use lb_common::{AffinityValue, SvcValue, lb_alg, scope, select_slot, svc_flags, trace_affinity};

use crate::{
    af::{Af, Client, Endpoint},
    maglev,
};

/// Where a flow's client is, which decides the scope of a two-scope frontend.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// Outside the cluster (tc ingress of an external device): the external scope.
    External,
    /// Inside the cluster (pod veths, sockets in the cgroup): the internal scope where the
    /// frontend has one, so an externalTrafficPolicy of Local still sends in-cluster clients
    /// to cluster-wide backends.
    Cluster,
}

/// A frontend's master entry, in the scope its client gets.
pub struct Service<A> {
    pub frontend: Endpoint<A>,
    pub proto: u8,
    pub scope: u8,
    pub master: SvcValue,
}

/// The backend chosen for a new flow or socket.
pub struct Chosen<A> {
    pub backend: Endpoint<A>,
    pub backend_id: u32,
    pub rev_nat_id: u32,
    pub scope: u8,
    pub slot: u16,
    pub svc_flags: u16,
    /// `trace_affinity` value.
    pub affinity: u8,
    /// The master's `lb_alg`, and with `MAGLEV` the cell the backend came from (slot 0).
    pub lb_alg: u8,
    pub maglev_cell: u32,
}

/// A frontend nothing can serve. `slot` and `backend_id` are 0 unless a slot (or Maglev cell)
/// was chosen (it was then missing or empty, or named the missing backend `backend_id`).
pub struct Unserved {
    pub rev_nat_id: u32,
    pub scope: u8,
    pub slot: u16,
    pub backend_id: u32,
    pub svc_flags: u16,
    pub lb_alg: u8,
    pub maglev_cell: u32,
}

pub enum Selected<A> {
    Backend(Chosen<A>),
    /// The frontend exists but has no usable backend (`Unserved`, details dropped); `drop`:
    /// its endpoints are all on other nodes (`svc_flags::EMPTY_DROP`), kube-proxy's DROP
    /// rather than REJECT.
    NoBackend {
        drop: bool,
    },
    NotAService,
}

/// The master entry of `frontend` for a client at `origin`.
#[inline(always)]
pub fn lookup<A: Af>(
    frontend: Endpoint<A::Addr>,
    proto: u8,
    origin: Origin,
) -> Option<Service<A::Addr>> {
    let (addr, port) = (frontend.addr, frontend.port);
    let mut master = A::service(addr, port, proto, 0, scope::EXTERNAL)?;
    let mut svc_scope = scope::EXTERNAL;
    if origin == Origin::Cluster
        && master.flags & svc_flags::TWO_SCOPES != 0
        && let Some(internal) = A::service(addr, port, proto, 0, scope::INTERNAL)
    {
        master = internal;
        svc_scope = scope::INTERNAL;
    }
    Some(Service {
        frontend,
        proto,
        scope: svc_scope,
        master,
    })
}

/// Chooses a backend of `svc` for a new flow of the client `client` names, at `now` (seconds of
/// `CLOCK_MONOTONIC`). `input` supplies the random number or hash the slot (or Maglev cell) is
/// picked with, given the master's `lb_alg`; it is called only when there is something to
/// pick, `client` only for a frontend with session affinity.
#[inline(always)]
pub fn choose<A: Af>(
    svc: &Service<A::Addr>,
    client: impl FnOnce() -> Client<A::Addr>,
    now: u32,
    input: impl FnOnce(u8) -> u32,
    out: &mut Chosen<A::Addr>,
) -> Result<(), Unserved> {
    let (m, scope) = (&svc.master, svc.scope);
    let no_backend = |slot, backend_id, maglev_cell| Unserved {
        rev_nat_id: m.rev_nat_id,
        scope,
        slot,
        backend_id,
        svc_flags: m.flags,
        lb_alg: m.lb_alg,
        maglev_cell,
    };
    if m.count == 0 {
        return Err(no_backend(0, 0, 0));
    }
    let affine = m.flags & svc_flags::AFFINITY != 0;
    let mut who = Client {
        addr: A::ZERO,
        netns_cookie: 0,
    };
    if affine {
        who = client();
        // Written straight into the caller's `out` (scratch memory on the packet path): a
        // second `Chosen` on this frame would overflow the tc path's 512-byte stack.
        if affinity_hit::<A>(svc, &who, now, out) {
            return Ok(());
        }
    }
    // Maglev: the master's `backend_id` is its table; the cell names the backend directly.
    let (slot, backend_id, maglev_cell) = if m.lb_alg == lb_alg::MAGLEV {
        let (cell, id) = maglev::lookup(m.backend_id, input(lb_alg::MAGLEV));
        if id == 0 {
            return Err(no_backend(0, 0, cell));
        }
        (0, id, cell)
    } else {
        // Random, and any algorithm this datapath does not know.
        let slot = select_slot(input(lb_alg::RANDOM), m.count);
        let (addr, port) = (svc.frontend.addr, svc.frontend.port);
        let Some(entry) = A::service(addr, port, svc.proto, slot, scope) else {
            return Err(no_backend(slot, 0, 0));
        };
        (slot, entry.backend_id, 0)
    };
    let Some(backend) = A::backend(backend_id) else {
        return Err(no_backend(slot, backend_id, maglev_cell));
    };
    if affine {
        remember::<A>(&who, m.rev_nat_id, scope, backend_id, now);
    }
    *out = Chosen {
        backend,
        backend_id,
        rev_nat_id: m.rev_nat_id,
        scope,
        slot,
        svc_flags: m.flags,
        affinity: if affine {
            trace_affinity::NEW
        } else {
            trace_affinity::NONE
        },
        lb_alg: m.lb_alg,
        maglev_cell,
    };
    Ok(())
}

/// The backend `client`'s affinity entry for `svc` names (written to `out`), if the entry is
/// within the frontend's timeout and the backend still one of its active ones; the entry's
/// time is refreshed (every new flow restarts the timeout, as kube-proxy's `--set` does).
// A subprogram: the affinity keys stay out of the callers' frames.
#[inline(never)]
fn affinity_hit<A: Af>(
    svc: &Service<A::Addr>,
    client: &Client<A::Addr>,
    now: u32,
    out: &mut Chosen<A::Addr>,
) -> bool {
    let m = &svc.master;
    let Some(v) = A::affinity_get(client, m.rev_nat_id, svc.scope) else {
        return false;
    };
    // SAFETY: map value pointer from a successful lookup, valid for this run (see `af`).
    let (backend_id, last_used) = unsafe { ((*v).backend_id, (*v).last_used) };
    if now.wrapping_sub(last_used) > m.affinity_timeout
        || !A::affinity_match(backend_id, m.rev_nat_id, svc.scope)
    {
        return false;
    }
    let Some(backend) = A::backend(backend_id) else {
        return false;
    };
    if last_used != now {
        // SAFETY: as above; a plain store into the entry.
        unsafe { (*v).last_used = now };
    }
    *out = Chosen {
        backend,
        backend_id,
        rev_nat_id: m.rev_nat_id,
        scope: svc.scope,
        slot: 0,
        svc_flags: m.flags,
        affinity: trace_affinity::HIT,
        lb_alg: m.lb_alg,
        maglev_cell: 0,
    };
    true
}

/// Records that `client` got `backend_id` from frontend `rev_nat_id` at `now`. A failed insert
/// (the LRU map cannot fail for room) only costs the next flow its affinity.
#[inline(never)]
fn remember<A: Af>(
    client: &Client<A::Addr>,
    rev_nat_id: u32,
    scope: u8,
    backend_id: u32,
    now: u32,
) {
    let v = AffinityValue {
        backend_id,
        last_used: now,
    };
    let _ = A::affinity_put(client, rev_nat_id, scope, &v);
}

/// `lookup`, then `choose`: for the socket hooks, which have nothing to check in between (the
/// packet path checks conntrack). A frontend with `loadBalancerSourceRanges` is not theirs: a
/// socket's source is not known at connect(), so its packets go to the packet path, which
/// checks it.
#[inline(always)]
pub fn select<A: Af>(
    frontend: Endpoint<A::Addr>,
    proto: u8,
    origin: Origin,
    client: impl FnOnce() -> Client<A::Addr>,
    input: impl FnOnce(u8) -> u32,
) -> Selected<A::Addr> {
    match lookup::<A>(frontend, proto, origin) {
        None => Selected::NotAService,
        Some(svc) if svc.master.flags & svc_flags::SOURCE_RANGES != 0 => Selected::NotAService,
        Some(svc) => {
            let mut c = Chosen {
                backend: Endpoint {
                    addr: A::ZERO,
                    port: 0,
                },
                backend_id: 0,
                rev_nat_id: 0,
                scope: 0,
                slot: 0,
                svc_flags: 0,
                affinity: trace_affinity::NONE,
                lb_alg: 0,
                maglev_cell: 0,
            };
            match choose::<A>(&svc, client, crate::conntrack::now_secs(), input, &mut c) {
                Ok(()) => Selected::Backend(c),
                Err(n) => Selected::NoBackend {
                    drop: n.svc_flags & svc_flags::EMPTY_DROP != 0,
                },
            }
        }
    }
}
