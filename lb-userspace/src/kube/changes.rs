//! The one change detector: what a snapshot changed since the one before it.
//!
//! The daemon runs a [`ChangeDetector`] once per update and hands the [`SnapshotDiff`] to
//! everything that follows changes, none of which compares snapshots itself:
//!
//! - `incremental::IncrementalTranslator` recomputes the services the diff names (and those
//!   whose slices it names), and turns it into an `incremental::Update`: the frontends that
//!   changed, with their entries before;
//! - kube-proxy's change counters and programming latency (`metrics::kubeproxy::Changes::of`)
//!   count the diff's objects and read its slices' trigger times;
//! - connected UDP re-steering (`resteer::PairTracker`) keeps the (frontend, backend) pairs
//!   programmed and updates them from the translator's `Update`, the diff carried through to
//!   frontends: pairs are no object the diff could name.
//!
//! A diff names its detector and the observation it follows ([`SnapshotDiff::follows`]), so a
//! consumer with caches can tell a diff against the snapshot it last applied from any other
//! one (then it starts over from the whole snapshot).
//!
//! An object is unchanged when it is the same `Arc` as before (the reflector stores hand out
//! the same one until the object changes), has the same resourceVersion, or has equal contents
//! (manifests carry no resourceVersion); see `source::same`.
use std::{
    collections::{HashMap, HashSet},
    hash::BuildHasherDefault,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
};

use super::{
    slim::{self, EndpointSlice, Name, Object, Service},
    source::{PtrHasher, Snapshot, same},
};

/// What one kind of object changed.
#[derive(Debug)]
pub struct ObjectDiff<T> {
    /// Objects added or changed, in snapshot order.
    pub changed: Vec<Arc<T>>,
    /// The previous versions of the objects gone (by namespace/name).
    pub removed: Vec<Arc<T>>,
    /// Two objects of the snapshot have one namespace/name (a manifest directory can hold
    /// them): `changed` and `removed` compare the last of each name.
    pub repeats: bool,
}

impl<T> Default for ObjectDiff<T> {
    fn default() -> Self {
        Self {
            changed: Vec::new(),
            removed: Vec::new(),
            repeats: false,
        }
    }
}

impl<T> ObjectDiff<T> {
    /// How many objects were added, changed or removed.
    pub fn count(&self) -> usize {
        self.changed.len() + self.removed.len()
    }
}

/// What a snapshot changed since the previous one its detector observed.
#[derive(Debug, Default)]
pub struct SnapshotDiff {
    /// The detector (a process-unique id) and the number of its observation this is (1: the
    /// first, against nothing).
    pub detector: u64,
    pub observation: u64,
    pub services: ObjectDiff<Service>,
    pub slices: ObjectDiff<EndpointSlice>,
}

impl SnapshotDiff {
    /// Whether this is the diff against the snapshot of `last`, a (detector, observation) an
    /// earlier diff carried.
    pub fn follows(&self, last: Option<(u64, u64)>) -> bool {
        self.observation > 1 && last == Some((self.detector, self.observation - 1))
    }

    /// This diff's (detector, observation), for `follows`.
    pub fn id(&self) -> (u64, u64) {
        (self.detector, self.observation)
    }
}

static DETECTORS: AtomicU64 = AtomicU64::new(1);

/// Diffs each snapshot against the one before (see the module docs).
#[derive(Debug)]
pub struct ChangeDetector {
    id: u64,
    observations: u64,
    services: Tracked<Service>,
    slices: Tracked<EndpointSlice>,
}

impl Default for ChangeDetector {
    fn default() -> Self {
        Self::new()
    }
}

impl ChangeDetector {
    pub fn new() -> Self {
        Self {
            id: DETECTORS.fetch_add(1, Ordering::Relaxed),
            observations: 0,
            services: Tracked::new(),
            slices: Tracked::new(),
        }
    }

    /// What `snapshot` changed against the previous one; it becomes the previous one.
    pub fn observe(&mut self, snapshot: &Snapshot) -> SnapshotDiff {
        self.observe_objects(&snapshot.services, &snapshot.slices)
    }

    /// `observe` of a snapshot's objects.
    pub fn observe_objects(
        &mut self,
        services: &[Arc<Service>],
        slices: &[Arc<EndpointSlice>],
    ) -> SnapshotDiff {
        self.observations += 1;
        SnapshotDiff {
            detector: self.id,
            observation: self.observations,
            services: self.services.observe(services),
            slices: self.slices.observe(slices),
        }
    }
}

/// namespace (empty when unset) and name, shared with the object.
type Key = (Name, Name);

/// The objects of the previous snapshot, by name and by address (an unchanged reflector
/// entry is the same `Arc`, so most objects are matched without looking at them).
#[derive(Debug)]
struct Tracked<T> {
    by_key: HashMap<Key, Arc<T>>,
    by_ptr: HashSet<usize, BuildHasherDefault<PtrHasher>>,
    /// The previous snapshot's addresses in its order: a reflector store hands its objects out
    /// in the same order while only their contents change, so an object at the same position
    /// as before is matched by one compare instead of a hash lookup (what bounds an update's
    /// time at 10,000s of objects). `by_key` holds them all, so an equal address is the same
    /// object.
    order: Vec<usize>,
}

fn ptr<T>(o: &Arc<T>) -> usize {
    Arc::as_ptr(o) as usize
}

impl<T: PartialEq + Object> Tracked<T> {
    fn new() -> Self {
        Self {
            by_key: HashMap::new(),
            by_ptr: HashSet::default(),
            order: Vec::new(),
        }
    }

    /// What `new` changed against the previous snapshot; `new` becomes the previous snapshot.
    fn observe(&mut self, new: &[Arc<T>]) -> ObjectDiff<T> {
        let mut matched = 0;
        let mut fresh = Vec::new();
        let before = std::mem::take(&mut self.order);
        self.order.extend(new.iter().map(ptr));
        for (i, (o, p)) in new.iter().zip(&self.order).enumerate() {
            if before.get(i) == Some(p) || self.by_ptr.contains(p) {
                matched += 1;
            } else {
                fresh.push((key(o), o));
            }
        }
        let known = fresh
            .iter()
            .filter(|(k, _)| self.by_key.contains_key(k))
            .count();
        let distinct = fresh.iter().map(|(k, _)| k).collect::<HashSet<_>>().len();
        if matched + known != self.by_key.len() || distinct != fresh.len() {
            // Something went (or a name repeats): compare whole.
            let index: HashMap<Key, Arc<T>> = new.iter().map(|o| (key(o), Arc::clone(o))).collect();
            let updated: HashSet<usize> = index
                .iter()
                .filter(|(k, v)| self.by_key.get(*k).is_none_or(|o| !same(o, v)))
                .map(|(_, v)| ptr(v))
                .collect();
            let changed = new
                .iter()
                .filter(|o| updated.contains(&ptr(o)))
                .cloned()
                .collect();
            let removed = self
                .by_key
                .iter()
                .filter(|(k, _)| !index.contains_key(*k))
                .map(|(_, v)| Arc::clone(v))
                .collect();
            self.by_ptr = index.values().map(ptr).collect();
            let repeats = index.len() != new.len();
            if repeats {
                // `by_key` does not hold every object `order` names.
                self.order.clear();
            }
            self.by_key = index;
            return ObjectDiff {
                changed,
                removed,
                repeats,
            };
        }
        let mut changed = Vec::new();
        for (k, o) in fresh {
            if self.by_key.get(&k).is_none_or(|old| !same(old, o)) {
                changed.push(Arc::clone(o));
            }
            if let Some(old) = self.by_key.insert(k, Arc::clone(o)) {
                self.by_ptr.remove(&ptr(&old));
            }
            self.by_ptr.insert(ptr(o));
        }
        ObjectDiff {
            changed,
            removed: Vec::new(),
            repeats: false,
        }
    }
}

fn key<T: Object>(o: &Arc<T>) -> Key {
    let m = o.meta();
    (
        m.namespace.clone().unwrap_or_else(|| slim::name("")),
        m.name.clone().unwrap_or_else(|| slim::name("")),
    )
}
