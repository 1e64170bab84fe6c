//! The backends the reconciler knows, each address stored once: the backend map's entries as
//! written (id → address and state) and, per address, its own id and how many entries of the
//! desired state name it in each state (`wanted`).
//!
//! One record per address in a flat `Vec`, found through two index tables of record numbers
//! (by id and by address), instead of an id → backend tree beside two address-keyed hash maps
//! that each held the address again: a third of the memory at 10,000 services × 10 endpoints.
//! An address normally has one backend id (its own, the one new slots name); a dump of maps
//! written otherwise may hold more, which get records of their own, found by id only, until
//! the garbage collection deletes them.
use std::hash::BuildHasher as _;

use foldhash::fast::RandomState;
use hashbrown::HashTable;

use crate::model::{Backend, BackendState, Family, L4Addr};

/// An address's record, or an extra backend id's.
#[derive(Clone, Copy, Debug)]
struct Rec {
    /// Entries of the desired state naming the address, per state (index: the state's byte);
    /// always zero in an extra id's record.
    wanted: [u32; 4],
    /// The backend id written for the address; 0: none (the desired state names it only).
    id: u32,
    l4: L4Addr,
    /// The state written with `id`.
    state: BackendState,
    /// Whether the record is in use (else it is on the free list).
    live: bool,
}

const NONE: [u32; 4] = [0; 4];

pub(super) struct Backends {
    recs: Vec<Rec>,
    free: Vec<u32>,
    /// Records with an id, by id.
    by_id: HashTable<u32>,
    /// The record of each address (not those of extra ids), by address.
    by_addr: HashTable<u32>,
    hasher: RandomState,
    /// Records with an id: the backend map's entries.
    installed: usize,
}

impl Backends {
    pub(super) fn new() -> Self {
        Self {
            recs: Vec::new(),
            free: Vec::new(),
            by_id: HashTable::new(),
            by_addr: HashTable::new(),
            hasher: RandomState::default(),
            installed: 0,
        }
    }

    /// The backend map's entries `entries`, in id order: an address's first id is its own.
    pub(super) fn from_entries<'a>(entries: impl Iterator<Item = (&'a u32, &'a Backend)>) -> Self {
        let mut out = Self::new();
        for (id, b) in entries {
            if out.addr_index(&b.l4).is_some() {
                let r = out.push(Rec {
                    wanted: NONE,
                    id: *id,
                    l4: b.l4,
                    state: b.state,
                    live: true,
                });
                out.index_id(r);
                out.installed += 1;
            } else {
                out.insert(*id, b);
            }
        }
        out
    }

    pub(super) fn len(&self) -> usize {
        self.installed
    }

    pub(super) fn is_empty(&self) -> bool {
        self.installed == 0
    }

    /// The backend map's entries of `family`.
    pub(super) fn count(&self, family: Family) -> usize {
        self.iter()
            .filter(|(_, b)| Family::of(&b.l4.addr) == family)
            .count()
    }

    /// The backend map's entries, in no particular order.
    pub(super) fn iter(&self) -> impl Iterator<Item = (u32, Backend)> + '_ {
        self.recs
            .iter()
            .filter(|r| r.live && r.id != 0)
            .map(|r| (r.id, backend(r)))
    }

    pub(super) fn contains_id(&self, id: u32) -> bool {
        self.id_index(id).is_some()
    }

    /// The backend written with `id`.
    pub(super) fn get(&self, id: u32) -> Option<Backend> {
        self.id_index(id).map(|i| backend(&self.recs[i]))
    }

    /// The id written for `l4` (its own: the one slots get).
    pub(super) fn id_of(&self, l4: &L4Addr) -> Option<u32> {
        let i = self.addr_index(l4)?;
        Some(self.recs[i].id).filter(|id| *id != 0)
    }

    /// Records `b` written with `id`, which becomes the address's own id; whether `id` is new.
    pub(super) fn insert(&mut self, id: u32, b: &Backend) -> bool {
        let existed = self.id_index(id);
        if let Some(i) = existed {
            debug_assert_eq!(self.recs[i].l4, b.l4, "a backend id changed its address");
            if self.addr_index(&b.l4) == Some(i) {
                self.recs[i].state = b.state;
                return false;
            }
            // An extra id of the address becomes its own: taken out, and put back as that.
            self.remove(id);
        }
        let a = match self.addr_index(&b.l4) {
            Some(a) => a,
            None => {
                let a = self.push(Rec {
                    wanted: NONE,
                    id: 0,
                    l4: b.l4,
                    state: b.state,
                    live: true,
                });
                self.index_addr(a);
                a
            }
        };
        let old = self.recs[a];
        if old.id != 0 {
            // The address's own id so far stays, as an extra one.
            self.unindex_id(old.id);
            let e = self.push(Rec {
                wanted: NONE,
                ..old
            });
            self.index_id(e);
        }
        self.recs[a].id = id;
        self.recs[a].state = b.state;
        self.index_id(a);
        self.installed += 1;
        existed.is_none()
    }

    /// Forgets the backend written with `id`; what it was.
    pub(super) fn remove(&mut self, id: u32) -> Option<Backend> {
        let i = self.id_index(id)?;
        self.unindex_id(id);
        self.installed -= 1;
        let r = self.recs[i];
        if self.addr_index(&r.l4) == Some(i) {
            self.recs[i].id = 0;
            if r.wanted == NONE {
                self.drop_addr(i);
            }
        } else {
            self.free_rec(i);
        }
        Some(backend(&r))
    }

    /// Counts an entry of the desired state naming `b` in (`add`) or out.
    pub(super) fn want(&mut self, b: &Backend, add: bool) {
        let i = match self.addr_index(&b.l4) {
            Some(i) => i,
            None if add => {
                let i = self.push(Rec {
                    wanted: NONE,
                    id: 0,
                    l4: b.l4,
                    state: b.state,
                    live: true,
                });
                self.index_addr(i);
                i
            }
            None => return,
        };
        let r = &mut self.recs[i];
        let n = &mut r.wanted[b.state as usize];
        if add {
            *n += 1;
        } else {
            *n = n.saturating_sub(1);
            if r.wanted == NONE && r.id == 0 {
                self.drop_addr(i);
            }
        }
    }

    /// Forgets every count of `want`.
    pub(super) fn clear_wanted(&mut self) {
        for i in 0..self.recs.len() {
            let r = &mut self.recs[i];
            if !r.live {
                continue;
            }
            r.wanted = NONE;
            if r.id == 0 {
                self.drop_addr(i);
            }
        }
    }

    /// Entries of the desired state naming `l4`, per state.
    pub(super) fn wanted(&self, l4: &L4Addr) -> [u32; 4] {
        self.addr_index(l4).map_or(NONE, |i| self.recs[i].wanted)
    }

    /// Entries of the desired state naming `l4`.
    pub(super) fn wanted_total(&self, l4: &L4Addr) -> u32 {
        self.wanted(l4).iter().sum()
    }

    /// Gives back the memory of records freed at the end, and of a table that shrank to under
    /// half its capacity (`exact`: any spare capacity, once all addresses are counted in).
    pub(super) fn shrink(&mut self, exact: bool) {
        while self.recs.last().is_some_and(|r| !r.live) {
            self.recs.pop();
        }
        let len = self.recs.len() as u32;
        self.free.retain(|i| *i < len);
        self.free.shrink_to_fit();
        if exact || self.recs.capacity() > 2 * self.recs.len() {
            self.recs.shrink_to_fit();
        }
        let hasher = &self.hasher;
        let recs = &self.recs;
        self.by_id
            .shrink_to(0, |i| hasher.hash_one(recs[*i as usize].id));
        self.by_addr
            .shrink_to(0, |i| hasher.hash_one(recs[*i as usize].l4));
    }

    fn push(&mut self, r: Rec) -> usize {
        match self.free.pop() {
            Some(i) => {
                self.recs[i as usize] = r;
                i as usize
            }
            None => {
                self.recs.push(r);
                self.recs.len() - 1
            }
        }
    }

    fn free_rec(&mut self, i: usize) {
        self.recs[i].live = false;
        self.recs[i].id = 0;
        self.recs[i].wanted = NONE;
        self.free.push(i as u32);
    }

    /// Removes address record `i` (no id, nothing wanted).
    fn drop_addr(&mut self, i: usize) {
        let h = self.hasher.hash_one(self.recs[i].l4);
        if let Ok(e) = self.by_addr.find_entry(h, |j| *j as usize == i) {
            e.remove();
        }
        self.free_rec(i);
    }

    fn id_index(&self, id: u32) -> Option<usize> {
        let h = self.hasher.hash_one(id);
        self.by_id
            .find(h, |i| self.recs[*i as usize].id == id)
            .map(|i| *i as usize)
    }

    fn addr_index(&self, l4: &L4Addr) -> Option<usize> {
        let h = self.hasher.hash_one(l4);
        self.by_addr
            .find(h, |i| self.recs[*i as usize].l4 == *l4)
            .map(|i| *i as usize)
    }

    fn index_id(&mut self, i: usize) {
        let (hasher, recs) = (&self.hasher, &self.recs);
        let h = hasher.hash_one(recs[i].id);
        self.by_id
            .insert_unique(h, i as u32, |j| hasher.hash_one(recs[*j as usize].id));
    }

    fn unindex_id(&mut self, id: u32) {
        let (hasher, recs) = (&self.hasher, &self.recs);
        if let Ok(e) = self
            .by_id
            .find_entry(hasher.hash_one(id), |i| recs[*i as usize].id == id)
        {
            e.remove();
        }
    }

    fn index_addr(&mut self, i: usize) {
        let (hasher, recs) = (&self.hasher, &self.recs);
        let h = hasher.hash_one(recs[i].l4);
        self.by_addr
            .insert_unique(h, i as u32, |j| hasher.hash_one(recs[*j as usize].l4));
    }
}

fn backend(r: &Rec) -> Backend {
    Backend {
        l4: r.l4,
        state: r.state,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Proto;

    fn b(last: u8, state: BackendState) -> Backend {
        Backend {
            l4: L4Addr {
                addr: std::net::IpAddr::from([10, 0, 0, last]),
                port: 80,
                proto: Proto::Tcp,
            },
            state,
        }
    }

    fn sorted(t: &Backends) -> Vec<(u32, Backend)> {
        let mut v: Vec<_> = t.iter().collect();
        v.sort_unstable_by_key(|(id, _)| *id);
        v
    }

    #[test]
    fn an_address_has_its_first_id_and_extra_ids_stay_until_removed() {
        let (a, c) = (b(1, BackendState::Active), b(2, BackendState::Active));
        let dump = [(3, a), (5, a), (7, c)];
        let mut t = Backends::from_entries(dump.iter().map(|(id, b)| (id, b)));
        assert_eq!(
            (t.len(), t.id_of(&a.l4), t.id_of(&c.l4)),
            (3, Some(3), Some(7))
        );
        assert_eq!(t.get(5), Some(a));
        t.want(&a, true);
        // The own id gone: the extra one is not promoted.
        assert_eq!(t.remove(3), Some(a));
        assert_eq!(
            (t.id_of(&a.l4), t.get(5), t.wanted_total(&a.l4)),
            (None, Some(a), 1)
        );
        // A new own id; the extra one stays.
        assert!(t.insert(9, &a));
        assert_eq!(t.id_of(&a.l4), Some(9));
        assert_eq!(sorted(&t), vec![(5, a), (7, c), (9, a)]);
        // An extra id written again becomes the own one; the old own one is an extra.
        let q = Backend {
            state: BackendState::Quarantined,
            ..a
        };
        assert!(!t.insert(5, &q));
        assert_eq!(
            (t.id_of(&a.l4), t.get(5), t.get(9)),
            (Some(5), Some(q), Some(a))
        );
        assert_eq!(t.len(), 3);
        assert_eq!(t.wanted_total(&a.l4), 1);
        for id in [5, 7, 9] {
            assert!(t.remove(id).is_some());
        }
        assert!(t.is_empty());
        // Still wanted: the address keeps its record, without an id.
        assert_eq!((t.id_of(&a.l4), t.wanted_total(&a.l4)), (None, 1));
        t.clear_wanted();
        t.shrink(true);
        assert_eq!((t.recs.len(), t.by_addr.len(), t.by_id.len()), (0, 0, 0));
    }

    #[test]
    fn wanted_counts_per_state() {
        let a = b(1, BackendState::Active);
        let t_ = b(1, BackendState::Terminating);
        let mut t = Backends::new();
        t.want(&t_, true);
        t.want(&a, true);
        t.want(&a, true);
        assert_eq!(t.wanted(&a.l4), [2, 1, 0, 0]);
        t.want(&a, false);
        t.want(&a, false);
        t.want(&a, false);
        assert_eq!(t.wanted(&a.l4), [0, 1, 0, 0]);
        t.want(&t_, false);
        assert_eq!(t.wanted(&a.l4), [0; 4]);
        assert_eq!(t.by_addr.len(), 0);
        // Removing what was never counted is nothing.
        t.want(&a, false);
        assert_eq!(t.by_addr.len(), 0);
    }
}
