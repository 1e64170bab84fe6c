//! Backend selection for a new flow or socket, shared by the tc and socket hooks so both agree
//! on what a frontend is, which scope a client gets and what "no backend" means.
//!
//! A frontend `(addr, port, proto, scope)` has a master entry at slot 0 (backend count, flags,
//! rev-NAT id, algorithm) and slots `1..=count` naming backend ids. A master entry with no
//! usable backend behind the chosen slot (count 0, a missing slot, a slot naming a missing
//! backend) is `NoBackend` for every hook: the caller counts it once and drops or denies.
use lb_common::{SvcValue, lb_alg, scope, select_slot, svc_flags};

use crate::{
    af::{Af, Endpoint},
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
    /// The frontend exists but has no usable backend (`Unserved`, details dropped).
    NoBackend,
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

/// Chooses a backend of `svc`. `input` supplies the random number or hash the slot (or
/// Maglev cell) is picked with, given the master's `lb_alg`; it is called only when there is
/// something to pick.
#[inline(always)]
pub fn choose<A: Af>(
    svc: &Service<A::Addr>,
    input: impl FnOnce(u8) -> u32,
) -> Result<Chosen<A::Addr>, Unserved> {
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
    Ok(Chosen {
        backend,
        backend_id,
        rev_nat_id: m.rev_nat_id,
        scope,
        slot,
        svc_flags: m.flags,
        lb_alg: m.lb_alg,
        maglev_cell,
    })
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
    input: impl FnOnce(u8) -> u32,
) -> Selected<A::Addr> {
    match lookup::<A>(frontend, proto, origin) {
        None => Selected::NotAService,
        Some(svc) if svc.master.flags & svc_flags::SOURCE_RANGES != 0 => Selected::NotAService,
        Some(svc) => match choose::<A>(&svc, input) {
            Ok(c) => Selected::Backend(c),
            Err(_) => Selected::NoBackend,
        },
    }
}
