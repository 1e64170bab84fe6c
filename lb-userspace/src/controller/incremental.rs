//! The translation of the newest snapshot, kept up to date at the cost of what changed: the
//! same `Translation` as `translate::desired_state` of the whole snapshot (the property test in
//! tests/incremental.rs holds them equal), recomputing only
//!
//! - the services whose Service changed, or one of whose EndpointSlices (by the
//!   `kubernetes.io/service-name` label, before and after the change) changed;
//! - the services that claimed a frontend a recomputed service gave up or won: a contested
//!   frontend belongs to the oldest claimant (`insert` in translate.rs), so when its owner lets
//!   it go every other claimant is recomputed and claims again;
//! - everything when the node's name, zone or default algorithm changes; when only its NodePort
//!   or local addresses change (a pod's veth gets an address), the services with a nodePort,
//!   external IPs or LoadBalancer IPs.
//!
//! An object is unchanged when it is the same `Arc` as before (the reflector stores hand out
//! the same one until the object changes), has the same resourceVersion, or has equal contents
//! (manifests carry no resourceVersion). A snapshot with two objects of one namespace/name (a
//! manifest directory can hold them) is translated whole, and the next one rebuilds the caches.
//!
//! Per service only its frontend keys, its skipped entries and its no-local counts are kept;
//! the entries live once, in the desired state.
use std::{collections::BTreeMap, hash::BuildHasherDefault, sync::Arc};

use foldhash::{HashMap, HashSet, HashSetExt as _};

use k8s_openapi::{
    api::{core::v1::Service, discovery::v1::EndpointSlice},
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};

use super::{
    source::{PtrHasher, same},
    translate::{
        self, LABEL_SERVICE_NAME, NoLocalEndpoints, NodeInfo, ServiceOrder, SkipReason, Skipped,
        Translation,
    },
};
use crate::model::{DesiredState, Frontend, ServiceEntry};

/// What an update changed in the desired state.
#[derive(Debug, PartialEq)]
pub enum Update {
    /// Anything may have changed: the first update, new node facts, or a snapshot translated
    /// whole.
    Full,
    /// Only these frontends changed, each with its entry before the update (`None`: it had
    /// none).
    Changed(BTreeMap<Frontend, Option<ServiceEntry>>),
}

impl Update {
    /// How many frontends changed; `None` for `Full`.
    pub fn changed(&self) -> Option<usize> {
        match self {
            Update::Full => None,
            Update::Changed(c) => Some(c.len()),
        }
    }
}

/// namespace (`default` when unset) and name, as the translation names objects.
type Key = (String, String);

fn key_of(meta: &ObjectMeta) -> Key {
    (
        meta.namespace.clone().unwrap_or_else(|| "default".into()),
        meta.name.clone().unwrap_or_default(),
    )
}

/// The service an EndpointSlice belongs to, if it names one.
fn group_of(slice: &EndpointSlice) -> Option<Key> {
    let service = slice.metadata.labels.as_ref()?.get(LABEL_SERVICE_NAME)?;
    if service.is_empty() {
        return None;
    }
    let ns = slice.metadata.namespace.clone();
    Some((ns.unwrap_or_else(|| "default".into()), service.clone()))
}

type PtrMap = std::collections::HashMap<usize, u32, BuildHasherDefault<PtrHasher>>;

fn ptr<T>(a: &Arc<T>) -> usize {
    Arc::as_ptr(a) as usize
}

/// The id `order` (the last update's objects in snapshot order, by address) has at position
/// `i` for the object at `p`. A reflector store hands its objects out in the same order while
/// only their contents change, so most objects are matched by one sequential compare instead
/// of a hash lookup: what bounds a sync's time at 10,000s of objects, above all on caches a
/// full sync has just flushed. Every address in `order` is of an object the translator still
/// holds, so an equal address is the same object.
fn at(order: &[(usize, u32)], i: usize, p: usize) -> Option<u32> {
    order.get(i).filter(|(q, _)| *q == p).map(|(_, id)| *id)
}

/// Records that position `i` of this update's snapshot holds `p` with id `id`.
fn set_at(order: &mut Vec<(usize, u32)>, i: usize, p: usize, id: u32) {
    match order.get_mut(i) {
        Some(slot) => *slot = (p, id),
        None => order.push((p, id)),
    }
}

struct Svc {
    obj: Arc<Service>,
    key: Key,
    order: ServiceOrder,
    seen: u64,
    /// The frontends it claims in claim order (claim `(id, i)` is `frontends[i]`), each with
    /// the number of `skipped` entries reported before it.
    frontends: Vec<(Frontend, usize)>,
    skipped: Vec<Skipped>,
    no_local: NoLocalEndpoints,
    /// Whether the node's NodePort addresses, and its local addresses, matter to it.
    uses_nodeport_ips: bool,
    uses_local_ips: bool,
}

/// (has a nodePort, has external or LoadBalancer IPs): what of the node's addresses a Service
/// depends on.
fn address_deps(svc: &Service) -> (bool, bool) {
    let spec = svc.spec.as_ref();
    let nodeport = spec
        .and_then(|s| s.ports.as_ref())
        .is_some_and(|p| p.iter().any(|p| p.node_port.is_some()));
    let external = spec
        .and_then(|s| s.external_ips.as_ref())
        .is_some_and(|e| !e.is_empty())
        || svc
            .status
            .as_ref()
            .and_then(|s| s.load_balancer.as_ref())
            .and_then(|lb| lb.ingress.as_ref())
            .is_some_and(|i| !i.is_empty());
    (nodeport, external)
}

struct Slice {
    obj: Arc<EndpointSlice>,
    key: Key,
    group: Option<Key>,
    seen: u64,
}

/// A claim on a frontend: (service id, index among the service's claims).
type Claim = (u32, u32);

/// Where a claim comes in a frontend's claims: its service's order, then its index.
fn claim_order(svcs: &[Option<Svc>], c: Claim) -> (&ServiceOrder, u32) {
    let s = svcs[c.0 as usize].as_ref().expect("live service id");
    (&s.order, c.1)
}

/// Keeps the translation of the newest snapshot (see the module docs).
#[derive(Default)]
pub struct IncrementalTranslator {
    node: Option<NodeInfo>,
    generation: u64,
    svcs: Vec<Option<Svc>>,
    free_svcs: Vec<u32>,
    svc_by_key: HashMap<Key, u32>,
    svc_by_ptr: PtrMap,
    /// The last update's services in snapshot order: (address, id).
    svc_order: Vec<(usize, u32)>,
    slices: Vec<Option<Slice>>,
    free_slices: Vec<u32>,
    slice_by_key: HashMap<Key, u32>,
    slice_by_ptr: PtrMap,
    /// The last update's slices in snapshot order: (address, id).
    slice_order: Vec<(usize, u32)>,
    /// Slice ids per service they name.
    groups: HashMap<Key, Vec<u32>>,
    /// Skipped entries of slices, by slice namespace/name (the order `desired_state` reports
    /// them in); only slices with some.
    slice_skips: BTreeMap<String, Vec<Skipped>>,
    state: DesiredState,
    /// Every claim on each frontend, oldest first: the first owns it (its entry is in `state`).
    claims: HashMap<Frontend, Vec<Claim>>,
    /// Frontends with more than one claim.
    contested: HashSet<Frontend>,
    /// Services with skipped entries of their own.
    with_skips: HashSet<u32>,
    no_local: NoLocalEndpoints,
    /// The skipped entries of a snapshot translated whole; the next update rebuilds.
    whole_skipped: Option<Vec<Skipped>>,
}

impl IncrementalTranslator {
    pub fn new() -> Self {
        Self::default()
    }

    /// The desired state of the last update.
    pub fn state(&self) -> &DesiredState {
        &self.state
    }

    pub fn no_local_endpoints(&self) -> NoLocalEndpoints {
        self.no_local
    }

    /// The last update's translation (a copy; the daemon uses `state` and `skipped`).
    pub fn translation(&self) -> Translation {
        Translation {
            state: self.state.clone(),
            skipped: self.skipped(),
            no_local_endpoints: self.no_local,
        }
    }

    /// What the last update skipped, in `desired_state`'s order: slices by name, then
    /// services in claim order, each with its lost frontends where it claimed them.
    pub fn skipped(&self) -> Vec<Skipped> {
        if let Some(s) = &self.whole_skipped {
            return s.clone();
        }
        let mut out: Vec<Skipped> = self.slice_skips.values().flatten().cloned().collect();
        let mut ids: HashSet<u32> = self.with_skips.clone();
        for fe in &self.contested {
            if let Some(list) = self.claims.get(fe) {
                ids.extend(list.iter().skip(1).map(|c| c.0));
            }
        }
        let mut ids: Vec<u32> = ids.into_iter().collect();
        ids.sort_by(|a, b| self.svc(*a).order.cmp(&self.svc(*b).order));
        for id in ids {
            let s = self.svc(id);
            let mut skips = s.skipped.iter();
            let mut emitted = 0;
            for (seq, (fe, before)) in s.frontends.iter().enumerate() {
                out.extend(skips.by_ref().take(before - emitted).cloned());
                emitted = *before;
                let owner = self.claims.get(fe).and_then(|l| l.first());
                if owner == Some(&(id, seq as u32)) {
                    continue;
                }
                let first = self
                    .state
                    .services
                    .get(fe)
                    .map(|e| e.name.to_string())
                    .unwrap_or_default();
                out.push(Skipped {
                    kind: "Service",
                    object: format!("{}/{}", s.key.0, s.key.1),
                    reason: SkipReason::DuplicateFrontend,
                    detail: format!("frontend {fe} already belongs to {first}"),
                });
            }
            out.extend(skips.cloned());
        }
        out
    }

    fn svc(&self, id: u32) -> &Svc {
        self.svcs[id as usize].as_ref().expect("live service id")
    }

    fn svc_mut(&mut self, id: u32) -> &mut Svc {
        self.svcs[id as usize].as_mut().expect("live service id")
    }

    fn slice_mut(&mut self, id: u32) -> &mut Slice {
        self.slices[id as usize].as_mut().expect("live slice id")
    }

    /// Translates a snapshot; returns which frontends changed.
    pub fn update(
        &mut self,
        services: &[Arc<Service>],
        slices: &[Arc<EndpointSlice>],
        node: &NodeInfo,
    ) -> Update {
        let same_node = |a: &NodeInfo, b: &NodeInfo| {
            a.name == b.name && a.zone == b.zone && a.lb_algorithm == b.lb_algorithm
        };
        let full = self.whole_skipped.is_some()
            || self.node.as_ref().is_none_or(|old| !same_node(old, node));
        let mut dirty: HashSet<u32> = HashSet::new();
        if full {
            *self = Self {
                node: Some(node.clone()),
                ..Self::default()
            };
        } else if let Some(old) = self.node.as_ref().filter(|old| *old != node) {
            // Only addresses changed: the services that have frontends on them.
            let nodeport = old.nodeport_ips != node.nodeport_ips;
            let local = old.local_ips != node.local_ips;
            for (id, s) in self.svcs.iter().enumerate() {
                if let Some(s) = s
                    && ((nodeport && s.uses_nodeport_ips) || (local && s.uses_local_ips))
                {
                    dirty.insert(id as u32);
                }
            }
            self.node = Some(node.clone());
        }
        self.generation += 1;
        let g = self.generation;

        // Which services to recompute, and which are gone.
        let mut gone: HashSet<u32> = HashSet::new();
        let mut seen = 0usize;
        for (i, arc) in services.iter().enumerate() {
            let p = ptr(arc);
            let known = at(&self.svc_order, i, p).or_else(|| self.svc_by_ptr.get(&p).copied());
            let id = match known {
                Some(id) => id,
                None => {
                    let key = key_of(&arc.metadata);
                    match self.svc_by_key.get(&key) {
                        Some(&id) => {
                            let s = self.svc_mut(id);
                            if s.seen == g {
                                return self.whole(services, slices, node);
                            }
                            let (old, changed) = (ptr(&s.obj), !same(&s.obj, arc));
                            s.obj = Arc::clone(arc);
                            self.svc_by_ptr.remove(&old);
                            self.svc_by_ptr.insert(p, id);
                            if changed {
                                dirty.insert(id);
                            }
                            id
                        }
                        None => {
                            let svc = Svc {
                                obj: Arc::clone(arc),
                                key: key.clone(),
                                order: translate::service_order(arc),
                                seen: 0,
                                frontends: Vec::new(),
                                skipped: Vec::new(),
                                no_local: NoLocalEndpoints::default(),
                                uses_nodeport_ips: false,
                                uses_local_ips: false,
                            };
                            let id = match self.free_svcs.pop() {
                                Some(id) => {
                                    self.svcs[id as usize] = Some(svc);
                                    id
                                }
                                None => {
                                    self.svcs.push(Some(svc));
                                    (self.svcs.len() - 1) as u32
                                }
                            };
                            self.svc_by_key.insert(key, id);
                            self.svc_by_ptr.insert(p, id);
                            dirty.insert(id);
                            id
                        }
                    }
                }
            };
            let s = self.svc_mut(id);
            if s.seen == g {
                return self.whole(services, slices, node);
            }
            s.seen = g;
            seen += 1;
            set_at(&mut self.svc_order, i, p, id);
        }
        self.svc_order.truncate(services.len());
        if seen != self.svc_by_key.len() {
            for (id, s) in self.svcs.iter().enumerate() {
                if let Some(s) = s
                    && s.seen != g
                {
                    gone.insert(id as u32);
                    dirty.insert(id as u32);
                }
            }
        }

        // Slices: their own skipped entries, and the services they belong to.
        let mut dirty_groups: HashSet<Key> = HashSet::new();
        let mut seen = 0usize;
        for (i, arc) in slices.iter().enumerate() {
            let p = ptr(arc);
            let known = at(&self.slice_order, i, p).or_else(|| self.slice_by_ptr.get(&p).copied());
            let id = match known {
                Some(id) => id,
                None => {
                    let key = key_of(&arc.metadata);
                    let id = match self.slice_by_key.get(&key) {
                        Some(&id) => {
                            let s = self.slice_mut(id);
                            if s.seen == g {
                                return self.whole(services, slices, node);
                            }
                            let (old, changed) = (ptr(&s.obj), !same(&s.obj, arc));
                            s.obj = Arc::clone(arc);
                            self.slice_by_ptr.remove(&old);
                            self.slice_by_ptr.insert(p, id);
                            if !changed {
                                self.slice_mut(id).seen = g;
                                seen += 1;
                                set_at(&mut self.slice_order, i, p, id);
                                continue;
                            }
                            id
                        }
                        None => {
                            let slice = Slice {
                                obj: Arc::clone(arc),
                                key: key.clone(),
                                group: None,
                                seen: 0,
                            };
                            let id = match self.free_slices.pop() {
                                Some(id) => {
                                    self.slices[id as usize] = Some(slice);
                                    id
                                }
                                None => {
                                    self.slices.push(Some(slice));
                                    (self.slices.len() - 1) as u32
                                }
                            };
                            self.slice_by_key.insert(key, id);
                            self.slice_by_ptr.insert(p, id);
                            id
                        }
                    };
                    self.slice_changed(id, node, &mut dirty_groups);
                    id
                }
            };
            let s = self.slice_mut(id);
            if s.seen == g {
                return self.whole(services, slices, node);
            }
            s.seen = g;
            seen += 1;
            set_at(&mut self.slice_order, i, p, id);
        }
        self.slice_order.truncate(slices.len());
        if seen != self.slice_by_key.len() {
            let gone_slices: Vec<u32> = self
                .slices
                .iter()
                .enumerate()
                .filter_map(|(id, s)| s.as_ref().filter(|s| s.seen != g).map(|_| id as u32))
                .collect();
            for id in gone_slices {
                let Some(s) = self.slices[id as usize].take() else {
                    continue;
                };
                self.slice_by_key.remove(&s.key);
                self.slice_by_ptr.remove(&ptr(&s.obj));
                self.slice_skips.remove(&format!("{}/{}", s.key.0, s.key.1));
                if let Some(group) = s.group {
                    self.leave_group(&group, id);
                    dirty_groups.insert(group);
                }
                self.free_slices.push(id);
            }
        }
        for group in &dirty_groups {
            if let Some(&id) = self.svc_by_key.get(group) {
                dirty.insert(id);
            }
        }

        // Take back the claims of what is recomputed; a frontend whose owner lets it go is
        // claimed again by all its other claimants, so they are recomputed too.
        let mut delta: BTreeMap<Frontend, Option<ServiceEntry>> = BTreeMap::new();
        let mut queue: Vec<u32> = dirty.iter().copied().collect();
        while let Some(id) = queue.pop() {
            let frontends = std::mem::take(&mut self.svc_mut(id).frontends);
            for (seq, (fe, _)) in frontends.iter().enumerate() {
                let Some(list) = self.claims.get_mut(fe) else {
                    continue;
                };
                let Some(pos) = list.iter().position(|c| *c == (id, seq as u32)) else {
                    continue;
                };
                list.remove(pos);
                let others: Vec<u32> = if pos == 0 {
                    list.iter().map(|c| c.0).collect()
                } else {
                    Vec::new()
                };
                if list.len() < 2 {
                    self.contested.remove(fe);
                }
                if list.is_empty() {
                    self.claims.remove(fe);
                }
                if pos == 0 {
                    let old = self.state.services.remove(fe);
                    delta.entry(*fe).or_insert(old);
                    for sid in others {
                        if dirty.insert(sid) {
                            queue.push(sid);
                        }
                    }
                }
            }
        }

        for id in &gone {
            let Some(s) = self.svcs[*id as usize].take() else {
                continue;
            };
            self.no_local.sub(&s.no_local);
            self.svc_by_key.remove(&s.key);
            self.svc_by_ptr.remove(&ptr(&s.obj));
            self.with_skips.remove(id);
            self.free_svcs.push(*id);
        }

        // Recompute, then claim: claims are ordered by the services' (new) order.
        let mut outs = Vec::with_capacity(dirty.len());
        for &id in dirty.difference(&gone) {
            let s = self.svc(id);
            let group: Vec<&EndpointSlice> = self
                .groups
                .get(&s.key)
                .into_iter()
                .flatten()
                .filter_map(|sid| self.slices[*sid as usize].as_ref())
                .map(|sl| sl.obj.as_ref())
                .collect();
            // Their skipped entries are the slices' own, kept per slice.
            let mut slice_skips = Vec::new();
            let index = translate::index_slices(&group, node, &mut slice_skips);
            let ports = translate::slice_port_names(&group);
            let out = translate::translate_service(&s.obj, &index, &ports, node);
            let order = translate::service_order(&s.obj);
            let (nodeport, local) = address_deps(&s.obj);
            outs.push((id, out));
            let s = self.svc_mut(id);
            s.order = order;
            s.uses_nodeport_ips = nodeport;
            s.uses_local_ips = local;
        }
        for (id, out) in outs {
            let mut frontends = Vec::with_capacity(out.frontends.len());
            for (seq, (fe, entry, before)) in out.frontends.into_iter().enumerate() {
                frontends.push((fe, before));
                let claim = (id, seq as u32);
                let svcs = &self.svcs;
                let list = self.claims.entry(fe).or_default();
                let pos =
                    list.partition_point(|c| claim_order(svcs, *c) < claim_order(svcs, claim));
                list.insert(pos, claim);
                if list.len() > 1 {
                    self.contested.insert(fe);
                }
                if pos == 0 {
                    let prev = self.state.services.insert(fe, entry);
                    delta.entry(fe).or_insert(prev);
                }
            }
            let s = self.svc_mut(id);
            s.frontends = frontends;
            s.skipped = out.skipped;
            let (old, new) = (s.no_local, out.no_local);
            s.no_local = new;
            let has_skips = !s.skipped.is_empty();
            self.no_local.sub(&old);
            self.no_local.add(&new);
            if has_skips {
                self.with_skips.insert(id);
            } else {
                self.with_skips.remove(&id);
            }
        }
        if full {
            return Update::Full;
        }
        delta.retain(|fe, old| old.as_ref() != self.state.services.get(fe));
        Update::Changed(delta)
    }

    /// A new or changed slice: its skipped entries and its group.
    fn slice_changed(&mut self, id: u32, node: &NodeInfo, dirty_groups: &mut HashSet<Key>) {
        let s = self.slices[id as usize].as_ref().expect("live slice id");
        let name = format!("{}/{}", s.key.0, s.key.1);
        let mut skipped = Vec::new();
        // A slice's skipped entries depend on it alone (not on the node, nor other slices).
        translate::index_slices(std::slice::from_ref(&s.obj), node, &mut skipped);
        let (old, new) = (s.group.clone(), group_of(&s.obj));
        if skipped.is_empty() {
            self.slice_skips.remove(&name);
        } else {
            self.slice_skips.insert(name, skipped);
        }
        if old != new {
            if let Some(o) = &old {
                self.leave_group(o, id);
            }
            if let Some(n) = &new {
                self.groups.entry(n.clone()).or_default().push(id);
            }
            self.slice_mut(id).group = new.clone();
        }
        dirty_groups.extend(old);
        dirty_groups.extend(new);
    }

    fn leave_group(&mut self, group: &Key, id: u32) {
        if let Some(ids) = self.groups.get_mut(group) {
            ids.retain(|i| *i != id);
            if ids.is_empty() {
                self.groups.remove(group);
            }
        }
    }

    /// Translates a snapshot the caches cannot follow as a whole; the next update rebuilds.
    fn whole(
        &mut self,
        services: &[Arc<Service>],
        slices: &[Arc<EndpointSlice>],
        node: &NodeInfo,
    ) -> Update {
        let t = translate::desired_state(services, slices, node);
        *self = Self {
            node: Some(node.clone()),
            state: t.state,
            no_local: t.no_local_endpoints,
            whole_skipped: Some(t.skipped),
            ..Self::default()
        };
        Update::Full
    }
}
