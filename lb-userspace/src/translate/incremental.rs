//! The translation of the newest snapshot, kept up to date at the cost of what changed: the
//! same `Translation` as `translate::desired_state` of the whole snapshot (the property test in
//! tests/incremental.rs holds them equal), recomputing only
//!
//! - the services whose Service changed, or one of whose EndpointSlices (by the
//!   `kubernetes.io/service-name` label, before and after the change) changed;
//! - the services that claimed a frontend a recomputed service gave up or won: a contested
//!   frontend belongs to the oldest claimant (`insert` in translate/mod.rs), so when its owner lets
//!   it go every other claimant is recomputed and claims again;
//! - everything when the node's name, zone or default algorithm changes; when only its NodePort
//!   or local addresses change (a pod's veth gets an address), the services with a nodePort,
//!   external IPs or LoadBalancer IPs.
//!
//! What changed is not found here: [`IncrementalTranslator::apply`] takes the snapshot diff the
//! daemon's change detector computes once per update (`changes`, shared with the metrics), and
//! only walks the objects it names. A diff that does not follow the one applied before (another
//! detector's, or one skipped) rebuilds the caches from the whole snapshot, as the first does;
//! [`IncrementalTranslator::update`] runs a detector of the translator's own, for callers
//! without one. A snapshot with two objects of one namespace/name (a manifest directory can
//! hold them) is translated whole, and the next one rebuilds the caches.
//!
//! Per service only its frontend keys, its skipped entries and its no-local counts are kept;
//! the entries live once, in the desired state.
use std::{collections::BTreeMap, sync::Arc};

use foldhash::{HashMap, HashSet, HashSetExt as _};

use crate::{
    kube::{
        changes::{ChangeDetector, SnapshotDiff},
        slim::{self, EndpointSlice, Meta, Name, Service},
    },
    model::{DesiredState, Frontend, ServiceEntry},
    translate::{
        self, NoLocalEndpoints, NodeInfo, ServiceOrder, ServiceOut, SkipReason, Skipped,
        Translation,
        slices::{index_slices, slice_port_names},
    },
};

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
/// Shared names: every copy of a key is two reference counts, not two strings.
type Key = (Name, Name);

fn key_of(meta: &Meta) -> Key {
    (
        meta.namespace
            .clone()
            .unwrap_or_else(|| slim::name("default")),
        meta.name.clone().unwrap_or_else(|| slim::name("")),
    )
}

/// namespace (empty when unset) and name, as the change detector names objects: two objects
/// with one `key_of` and two of these are two objects of one name here.
fn raw_key(meta: &Meta) -> (&str, &str) {
    (
        meta.namespace.as_deref().unwrap_or_default(),
        meta.name.as_deref().unwrap_or_default(),
    )
}

/// The service an EndpointSlice belongs to, if it names one.
fn group_of(slice: &EndpointSlice) -> Option<Key> {
    let service = slice.service.clone().filter(|s| !s.is_empty())?;
    let ns = slice.metadata.namespace.clone();
    Some((ns.unwrap_or_else(|| slim::name("default")), service))
}

struct Svc {
    obj: Arc<Service>,
    key: Key,
    order: ServiceOrder,
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
    let nodeport = spec.is_some_and(|s| s.ports.iter().any(|p| p.node_port.is_some()));
    let external = spec.is_some_and(|s| !s.external_ips.is_empty()) || !svc.lb_ingress.is_empty();
    (nodeport, external)
}

struct Slice {
    obj: Arc<EndpointSlice>,
    key: Key,
    group: Option<Key>,
}

/// The caches cannot follow the snapshot (an object they do not hold, two objects of one
/// name): it is translated whole.
struct Unfollowable;

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
    /// The (detector, observation) of the diff applied last: the next must follow it.
    applied: Option<(u64, u64)>,
    /// The detector `update` runs, for callers without one.
    own: Option<ChangeDetector>,
    svcs: Vec<Option<Svc>>,
    free_svcs: Vec<u32>,
    svc_by_key: HashMap<Key, u32>,
    slices: Vec<Option<Slice>>,
    free_slices: Vec<u32>,
    slice_by_key: HashMap<Key, u32>,
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

    /// Forgets the translation (the next update rebuilds it from the whole snapshot), keeping
    /// the detector `update` runs.
    pub fn reset(&mut self) {
        let own = self.own.take();
        *self = Self {
            own,
            ..Self::default()
        };
    }

    /// Translates a snapshot, diffing it against the previous one with a detector of the
    /// translator's own; returns which frontends changed.
    pub fn update(
        &mut self,
        services: &[Arc<Service>],
        slices: &[Arc<EndpointSlice>],
        node: &NodeInfo,
    ) -> Update {
        let diff = self
            .own
            .get_or_insert_with(ChangeDetector::new)
            .observe_objects(services, slices);
        self.apply(&diff, services, slices, node)
    }

    /// Translates the snapshot of `services` and `slices`, which `diff` says what changed of;
    /// returns which frontends changed.
    pub fn apply(
        &mut self,
        diff: &SnapshotDiff,
        services: &[Arc<Service>],
        slices: &[Arc<EndpointSlice>],
        node: &NodeInfo,
    ) -> Update {
        let same_node = |a: &NodeInfo, b: &NodeInfo| {
            a.name == b.name && a.zone == b.zone && a.lb_algorithm == b.lb_algorithm
        };
        let full = self.whole_skipped.is_some()
            || !diff.follows(self.applied)
            || self.node.as_ref().is_none_or(|old| !same_node(old, node));
        let mut dirty = if full {
            let own = self.own.take();
            *self = Self {
                node: Some(node.clone()),
                own,
                ..Self::default()
            };
            HashSet::new()
        } else {
            self.new_addresses(node)
        };
        self.applied = Some(diff.id());
        if diff.services.repeats || diff.slices.repeats {
            return self.whole(services, slices, node);
        }
        // A full update takes every object as added; otherwise the diff's.
        let (changed_svcs, removed_svcs, changed_slices, removed_slices) = if full {
            (services, &[][..], slices, &[][..])
        } else {
            (
                &diff.services.changed[..],
                &diff.services.removed[..],
                &diff.slices.changed[..],
                &diff.slices.removed[..],
            )
        };
        let Ok(gone) = self.take_services(removed_svcs, changed_svcs, &mut dirty) else {
            return self.whole(services, slices, node);
        };
        if self
            .take_slices(removed_slices, changed_slices, node, &mut dirty)
            .is_err()
        {
            return self.whole(services, slices, node);
        }
        let mut delta = self.release_claims(&mut dirty);
        self.forget(&gone);
        // Recompute, then claim: claims are ordered by the services' (new) order.
        let outs = self.recompute(&dirty, &gone, node);
        self.claim(outs, &mut delta);
        if full {
            return Update::Full;
        }
        delta.retain(|fe, old| old.as_ref() != self.state.services.get(fe));
        Update::Changed(delta)
    }

    /// With only the node's addresses changed, the services that have frontends on them (to
    /// recompute).
    fn new_addresses(&mut self, node: &NodeInfo) -> HashSet<u32> {
        let mut dirty = HashSet::new();
        if let Some(old) = self.node.as_ref().filter(|old| *old != node) {
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
        dirty
    }

    /// Takes in the diff's Services: the changed and new ones are recomputed (`dirty`); the
    /// removed ones are returned, and are recomputed to take back their claims. A removed one
    /// lets its name go at once, so an object that takes it in the same update (its namespace
    /// now spelled out) is another service.
    fn take_services(
        &mut self,
        removed: &[Arc<Service>],
        changed: &[Arc<Service>],
        dirty: &mut HashSet<u32>,
    ) -> Result<HashSet<u32>, Unfollowable> {
        let mut gone: HashSet<u32> = HashSet::new();
        for old in removed {
            let &id = self
                .svc_by_key
                .get(&key_of(&old.metadata))
                .ok_or(Unfollowable)?;
            if raw_key(&self.svc(id).obj.metadata) != raw_key(&old.metadata) {
                return Err(Unfollowable);
            }
            self.svc_by_key.remove(&key_of(&old.metadata));
            gone.insert(id);
            dirty.insert(id);
        }
        for arc in changed {
            let key = key_of(&arc.metadata);
            if let Some(&id) = self.svc_by_key.get(&key) {
                let s = self.svc_mut(id);
                if raw_key(&s.obj.metadata) != raw_key(&arc.metadata) {
                    // Two objects of one name (`default` spelled out and not).
                    return Err(Unfollowable);
                }
                s.obj = Arc::clone(arc);
                dirty.insert(id);
                continue;
            }
            let id = self.add_service(arc, key);
            dirty.insert(id);
        }
        Ok(gone)
    }

    /// A new service under `key`, with nothing translated yet; returns its id.
    fn add_service(&mut self, arc: &Arc<Service>, key: Key) -> u32 {
        let svc = Svc {
            obj: Arc::clone(arc),
            key: key.clone(),
            order: translate::service_order(arc),
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
        id
    }

    /// Takes in the diff's EndpointSlices: their own skipped entries, and the services they
    /// belong to (before and after the change) are recomputed (`dirty`).
    fn take_slices(
        &mut self,
        removed: &[Arc<EndpointSlice>],
        changed: &[Arc<EndpointSlice>],
        node: &NodeInfo,
        dirty: &mut HashSet<u32>,
    ) -> Result<(), Unfollowable> {
        let mut dirty_groups: HashSet<Key> = HashSet::new();
        for old in removed {
            let key = key_of(&old.metadata);
            let &id = self.slice_by_key.get(&key).ok_or(Unfollowable)?;
            let s = self.slices[id as usize]
                .take_if(|s| raw_key(&s.obj.metadata) == raw_key(&old.metadata))
                .ok_or(Unfollowable)?;
            self.slice_by_key.remove(&key);
            self.slice_skips.remove(&format!("{}/{}", s.key.0, s.key.1));
            if let Some(group) = s.group {
                self.leave_group(&group, id);
                dirty_groups.insert(group);
            }
            self.free_slices.push(id);
        }
        for arc in changed {
            let key = key_of(&arc.metadata);
            let id = match self.slice_by_key.get(&key) {
                Some(&id) => {
                    let s = self.slice_mut(id);
                    if raw_key(&s.obj.metadata) != raw_key(&arc.metadata) {
                        return Err(Unfollowable);
                    }
                    s.obj = Arc::clone(arc);
                    id
                }
                None => self.add_slice(arc, key),
            };
            self.slice_changed(id, node, &mut dirty_groups);
        }
        for group in &dirty_groups {
            if let Some(&id) = self.svc_by_key.get(group) {
                dirty.insert(id);
            }
        }
        Ok(())
    }

    /// A new slice under `key`, in no group yet; returns its id.
    fn add_slice(&mut self, arc: &Arc<EndpointSlice>, key: Key) -> u32 {
        let slice = Slice {
            obj: Arc::clone(arc),
            key: key.clone(),
            group: None,
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
        id
    }

    /// Takes back the claims of the `dirty` services, returning each frontend whose owner let
    /// it go with its entry before. A frontend whose owner lets it go is claimed again by all
    /// its other claimants, so they join `dirty`.
    fn release_claims(
        &mut self,
        dirty: &mut HashSet<u32>,
    ) -> BTreeMap<Frontend, Option<ServiceEntry>> {
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
        delta
    }

    /// Drops the removed services (their claims are taken back already).
    fn forget(&mut self, gone: &HashSet<u32>) {
        for id in gone {
            let Some(s) = self.svcs[*id as usize].take() else {
                continue;
            };
            self.no_local.sub(&s.no_local);
            self.with_skips.remove(id);
            self.free_svcs.push(*id);
        }
    }

    /// Translates each `dirty` service that is not `gone` from its own slices, and notes its
    /// new order and what of the node's addresses it depends on.
    fn recompute(
        &mut self,
        dirty: &HashSet<u32>,
        gone: &HashSet<u32>,
        node: &NodeInfo,
    ) -> Vec<(u32, ServiceOut)> {
        let mut outs = Vec::with_capacity(dirty.len());
        for &id in dirty.difference(gone) {
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
            let index = index_slices(&group, &node.name, &mut slice_skips);
            let ports = slice_port_names(&group);
            let out = translate::translate_service(&s.obj, &index, &ports, node);
            let order = translate::service_order(&s.obj);
            let (nodeport, local) = address_deps(&s.obj);
            outs.push((id, out));
            let s = self.svc_mut(id);
            s.order = order;
            s.uses_nodeport_ips = nodeport;
            s.uses_local_ips = local;
        }
        outs
    }

    /// Makes the recomputed services' claims, in claim order among a frontend's claimants (the
    /// first owns it, its entry goes into the state), and keeps their skipped entries and
    /// no-local counts; frontends whose entry changed are added to `delta`.
    fn claim(
        &mut self,
        outs: Vec<(u32, ServiceOut)>,
        delta: &mut BTreeMap<Frontend, Option<ServiceEntry>>,
    ) {
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
    }

    /// A new or changed slice: its skipped entries and its group.
    fn slice_changed(&mut self, id: u32, node: &NodeInfo, dirty_groups: &mut HashSet<Key>) {
        let s = self.slices[id as usize].as_ref().expect("live slice id");
        let name = format!("{}/{}", s.key.0, s.key.1);
        let mut skipped = Vec::new();
        // A slice's skipped entries depend on it alone (not on the node, nor other slices).
        index_slices(std::slice::from_ref(&s.obj), &node.name, &mut skipped);
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
        let (own, applied) = (self.own.take(), self.applied);
        *self = Self {
            node: Some(node.clone()),
            applied,
            own,
            state: t.state,
            no_local: t.no_local_endpoints,
            whole_skipped: Some(t.skipped),
            ..Self::default()
        };
        Update::Full
    }
}
