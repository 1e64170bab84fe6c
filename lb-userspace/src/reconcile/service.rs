//! One frontend written, in the module's order (backends, rev-NAT, slots, master) and only
//! after a check that the maps have room for it; its previous state restored if a write fails.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use foldhash::{HashMap, HashMapExt as _};
use lb_common::{SvcValue, svc_flags};

use super::maglev_tables::MaglevPlan;
use super::{
    ApplyReport, Failure, Installed, Reconciler, Room, ServiceError, entries_of, fam, fam_of,
};
use crate::{
    datapath::maps::{AffMatch, LbMaps, MapOpError, Table, maglev_table_of},
    model::{Backend, BackendState, Cidr, Family, Frontend, L4Addr, Scope, ServiceEntry},
};

impl<M: LbMaps> Reconciler<M> {
    /// The affinity matches written for (family, rev-NAT id, scope).
    pub(super) fn aff_matches_of(
        &self,
        family: Family,
        rev_nat_id: u32,
        scope: Scope,
    ) -> impl Iterator<Item = AffMatch> + '_ {
        let lo = AffMatch {
            family,
            rev_nat_id,
            scope,
            backend_id: 0,
        };
        let hi = AffMatch {
            backend_id: u32::MAX,
            ..lo
        };
        self.aff_match.range(lo..=hi).copied()
    }

    /// `remove_service`, counted and reported.
    pub(super) fn remove_counted(&mut self, fe: &Frontend, report: &mut ApplyReport) {
        let before = entries_of(self.services.get(fe));
        let result = self.remove_service(fe, report);
        let after = entries_of(self.services.get(fe));
        let f = fam_of(&fe.l4.addr);
        self.counts.services[f] = self.counts.services[f] + after - before;
        if let Err(e) = result {
            report.errors.push(ServiceError {
                frontend: *fe,
                service: String::new(),
                error: e.to_string(),
                full_map: None,
            });
        }
    }

    /// `apply_service`, counted and reported.
    pub(super) fn apply_counted(
        &mut self,
        fe: &Frontend,
        entry: &ServiceEntry,
        ips: &BTreeMap<IpAddr, u32>,
        room: &mut Room,
        report: &mut ApplyReport,
    ) {
        let before = entries_of(self.services.get(fe));
        let result = self.apply_service(fe, entry, ips, room, report);
        let after = entries_of(self.services.get(fe));
        let f = fam_of(&fe.l4.addr);
        self.counts.services[f] = self.counts.services[f] + after - before;
        if let Err(f) = result {
            report.errors.push(ServiceError {
                frontend: *fe,
                service: entry.name.to_string(),
                error: f.error,
                full_map: f.full_map,
            });
        }
    }

    pub(super) fn alloc_backend_id(&mut self) -> u32 {
        loop {
            let id = self.next_backend_id;
            self.next_backend_id = self.next_backend_id.wrapping_add(1).max(1);
            if id != 0 && !self.backends.contains_id(id) {
                return id;
            }
        }
    }

    pub(super) fn alloc_revnat_id(&mut self) -> u32 {
        loop {
            let id = self.next_revnat_id;
            self.next_revnat_id = self.next_revnat_id.wrapping_add(1).max(1);
            if id != 0 && !self.revnat.contains_key(&id) {
                return id;
            }
        }
    }

    pub(super) fn apply_service(
        &mut self,
        fe: &Frontend,
        entry: &ServiceEntry,
        cluster_ips: &BTreeMap<IpAddr, u32>,
        room: &mut Room,
        report: &mut ApplyReport,
    ) -> Result<(), Failure> {
        let plan = self.plan_service(fe, entry)?;
        let family = plan.family;
        self.check_room(&plan, room)?;
        let active = plan.active;
        let maglev = self.plan_maglev(fe, entry, &plan.backends[..active], &plan.ids[..active]);
        if maglev.fallback {
            report.fallbacks.push(self.maglev_fallback(fe, entry));
        }
        let total = plan.backends.len();
        let master = SvcValue {
            backend_id: maglev.master_backend_id,
            count: active as u16,
            qcount: (total - active) as u16,
            rev_nat_id: plan.rev_nat_id,
            flags: entry.flags,
            lb_alg: maglev.lb_alg,
            pad: 0,
            affinity_timeout: if plan.affine {
                entry.affinity_timeout
            } else {
                0
            },
        };
        // The state a backend gets in the (shared) backends map: one entry per address, so
        // the most usable state any frontend of the desired state gives it.
        let global: Vec<Backend> = plan
            .backends
            .iter()
            .map(|b| Backend {
                l4: b.l4,
                state: self.wanted_state(&b.l4).unwrap_or(b.state),
            })
            .collect();
        if maglev.writes.is_empty() && self.unchanged(fe, &plan, &master, &global) {
            if let Some(set) = maglev.built {
                self.maglev_built.insert(*fe, set);
            }
            return Ok(());
        }
        for (table, needed) in plan.needed {
            *room.entry((table, family)).or_default() -= needed;
        }

        self.write_planned(
            fe,
            entry,
            plan,
            &master,
            maglev,
            &global,
            cluster_ips,
            report,
        )
    }

    /// Whether the plan needs no room the maps do not have left.
    pub(super) fn check_room(&self, plan: &ServicePlan, room: &Room) -> Result<(), Failure> {
        let family = plan.family;
        for (table, needed) in plan.needed {
            let free = room.get(&(table, family)).copied().unwrap_or(0);
            if needed > free {
                return Err(Failure {
                    error: format!(
                        "map {} is full: needs {needed} more entries, {} free of {}",
                        table.map_name(family),
                        free.max(0),
                        self.maps.capacity(table, family)
                    ),
                    full_map: Some(table.map_name(family)),
                });
            }
        }
        Ok(())
    }

    /// Whether the maps already hold what the plan would write (the Maglev table aside):
    /// master, slots, rev-NAT entry and backends, with no source range or affinity match to add.
    pub(super) fn unchanged(
        &self,
        fe: &Frontend,
        plan: &ServicePlan,
        master: &SvcValue,
        global: &[Backend],
    ) -> bool {
        plan.ranges.is_empty()
            && plan.matches.is_empty()
            && plan
                .existing
                .as_ref()
                .is_some_and(|i| i.master == *master && i.slots[..] == plan.ids[..])
            && self.revnat.get(&plan.rev_nat_id) == Some(&(fe.l4.addr, fe.l4.port))
            && global
                .iter()
                .zip(&plan.ids)
                .all(|(b, id)| self.backends.get(*id) == Some(*b))
    }

    /// Writes a frontend `apply_service` planned, in the order the module docs give, its
    /// previous state restored if its slots or master cannot be written.
    #[expect(
        clippy::too_many_arguments,
        reason = "the plan's parts apply_service computed, passed on"
    )]
    pub(super) fn write_planned(
        &mut self,
        fe: &Frontend,
        entry: &ServiceEntry,
        plan: ServicePlan,
        master: &SvcValue,
        maglev: MaglevPlan,
        global: &[Backend],
        cluster_ips: &BTreeMap<IpAddr, u32>,
        report: &mut ApplyReport,
    ) -> Result<(), Failure> {
        let total = plan.backends.len();
        // 0. A new ClusterIP, before anything of its first frontend (see the module docs).
        if entry.flags & svc_flags::CLUSTER_IP != 0 && !self.cluster_ips.contains_key(&fe.l4.addr) {
            let n = cluster_ips.get(&fe.l4.addr).copied().unwrap_or(1);
            self.put_cluster_ip(fe.l4.addr, n, report);
        }
        // 1.–2c. Backends, rev-NAT, source ranges, affinity matches.
        self.write_referenced(fe, &plan, global, report)
            .map_err(|e| e.to_string())?;
        // 3. Slots and the Maglev table, then 4. the master entry that makes them visible.
        let old = plan.existing;
        // Known again only once the table is whole.
        self.maglev_built.remove(fe);
        let table = maglev_table_of(master).map(|t| (t, maglev.writes.as_slice()));
        if let Err(e) = self.write_slots_and_master(fe, &plan.ids, table, master, report) {
            if let Some(old) = old {
                self.restore(fe, &old, report);
            }
            return Err(e.to_string().into());
        }
        if let Some(set) = maglev.built {
            self.maglev_built.insert(*fe, set);
        }
        // A table the master no longer names is free (its cells are rewritten before reuse).
        if let Some(t) = old.as_ref().and_then(|i| maglev_table_of(&i.master))
            && maglev_table_of(master) != Some(t)
        {
            self.maglev_tables.remove(&t);
        }
        // 5. Slots a shrunk service no longer counts.
        let old_len = old.map_or(0, |i| i.slots.len());
        for slot in (total + 1..=old_len).rev() {
            self.delete_slot(fe, slot as u16, "surplus slot", report);
        }
        Ok(())
    }

    /// What `apply_service` would write for `fe`, and the room it needs: ids are allocated in
    /// the plan only, until written.
    pub(super) fn plan_service(
        &mut self,
        fe: &Frontend,
        entry: &ServiceEntry,
    ) -> Result<ServicePlan, Failure> {
        let family = Family::of(&fe.l4.addr);
        if entry
            .backends
            .iter()
            .any(|b| Family::of(&b.l4.addr) != family)
        {
            return Err(String::from("backend address family differs from the frontend's").into());
        }
        // Slots 1..=count take new flows, so the active backends go first, the others after
        // them (kept for established flows), each group in the entry's order.
        let (mut backends, rest): (Vec<Backend>, Vec<Backend>) = entry
            .backends
            .iter()
            .partition(|b| b.state == BackendState::Active);
        let active = backends.len();
        backends.extend(rest);
        let total = backends.len();
        if total > u16::MAX as usize {
            return Err(format!(
                "{total} backends exceed the {} slots of a service",
                u16::MAX
            )
            .into());
        }
        let (ids, new_backends) = self.plan_backend_ids(&backends);
        let existing = self.services.get(fe).cloned();
        let existing_entries = existing
            .as_ref()
            .map_or(0, |i| 1 + i.slots.iter().filter(|id| **id != 0).count());
        let needed_services = (1 + total).saturating_sub(existing_entries) as i64;
        let new_revnat = !self.revnat_ids.contains_key(&fe.l4);
        let rev_nat_id = match self.revnat_ids.get(&fe.l4).copied() {
            Some(id) => id,
            None => self.alloc_revnat_id(),
        };
        let ranges: Vec<Cidr> = if entry.flags & svc_flags::SOURCE_RANGES != 0 {
            entry
                .source_ranges
                .iter()
                .filter(|c| Family::of(&c.addr) == family)
                .filter(|c| !self.src_ranges.contains(&(rev_nat_id, **c)))
                .copied()
                .collect()
        } else {
            Vec::new()
        };
        let affine = entry.flags & svc_flags::AFFINITY != 0;
        let matches: Vec<AffMatch> = aff_matches(fe, affine, rev_nat_id, &ids[..active])
            .filter(|m| !self.aff_match.contains(m))
            .collect();
        let needed = [
            (Table::Services, needed_services),
            (Table::Backends, new_backends.len() as i64),
            (Table::RevNat, i64::from(new_revnat)),
            (Table::SourceRanges, ranges.len() as i64),
            (Table::AffinityMatch, matches.len() as i64),
        ];
        Ok(ServicePlan {
            family,
            backends,
            active,
            ids,
            existing,
            rev_nat_id,
            ranges,
            matches,
            affine,
            needed,
        })
    }

    /// The backend id of each of `backends` (slot order): its own where it has one, else a new
    /// one (the same for repeats of an address), listed in the second vector to be written.
    pub(super) fn plan_backend_ids(
        &mut self,
        backends: &[Backend],
    ) -> (Vec<u32>, Vec<(u32, Backend)>) {
        let mut new_backends = Vec::new();
        let mut ids = Vec::with_capacity(backends.len());
        let mut seen_new: HashMap<L4Addr, u32> = HashMap::new();
        for b in backends {
            let id = match self.backends.id_of(&b.l4) {
                Some(id) => id,
                None => *seen_new.entry(b.l4).or_insert_with(|| {
                    let id = self.alloc_backend_id_excluding(&new_backends);
                    new_backends.push((id, *b));
                    id
                }),
            };
            ids.push(id);
        }
        (ids, new_backends)
    }

    /// Steps 1–2c of `apply_service`: everything a frontend's slots and master refer to,
    /// written before them.
    pub(super) fn write_referenced(
        &mut self,
        fe: &Frontend,
        plan: &ServicePlan,
        global: &[Backend],
        report: &mut ApplyReport,
    ) -> Result<(), MapOpError> {
        // 1. Backends (new ones, and known ones whose state changed).
        for (b, id) in global.iter().zip(&plan.ids) {
            let b = *b;
            if self.backends.get(*id) != Some(b) {
                self.maps.put_backend(*id, &b)?;
                report.writes += 1;
                // `id` becomes the address's own.
                if self.backends.insert(*id, &b) {
                    self.counts.backends[fam_of(&b.l4.addr)] += 1;
                }
            }
        }
        // 2. Rev-NAT, before any packet can be balanced to a backend of this frontend.
        let rev_nat_id = plan.rev_nat_id;
        if self.revnat.get(&rev_nat_id) != Some(&(fe.l4.addr, fe.l4.port)) {
            self.maps.put_revnat(rev_nat_id, fe.l4.addr, fe.l4.port)?;
            report.writes += 1;
            if self
                .revnat
                .insert(rev_nat_id, (fe.l4.addr, fe.l4.port))
                .is_none()
            {
                self.counts.revnat[fam_of(&fe.l4.addr)] += 1;
            }
            self.revnat_ids.insert(fe.l4, rev_nat_id);
        }
        // 2b. Source ranges, before a master with SOURCE_RANGES can drop what they allow.
        for cidr in &plan.ranges {
            self.maps.put_src_range(rev_nat_id, cidr)?;
            report.writes += 1;
            if self.src_ranges.insert((rev_nat_id, *cidr)) {
                self.counts.src_ranges[fam_of(&cidr.addr)] += 1;
            }
        }
        // 2c. Affinity matches: the new active backends' before the master offers them (an
        // affinity entry naming one is honoured from the first packet that can pick it), and
        // the ones the frontend no longer offers deleted before the master drops them, so no
        // client is kept on a backend the frontend has left.
        for m in &plan.matches {
            self.maps.put_aff_match(m)?;
            report.writes += 1;
            if self.aff_match.insert(*m) {
                self.counts.aff_match[fam(m.family)] += 1;
            }
        }
        let keep: BTreeSet<AffMatch> =
            aff_matches(fe, plan.affine, rev_nat_id, &plan.ids[..plan.active]).collect();
        let stale: Vec<AffMatch> = self
            .aff_matches_of(plan.family, rev_nat_id, fe.scope)
            .filter(|m| !keep.contains(m))
            .collect();
        for m in stale {
            self.maps.del_aff_match(&m)?;
            report.deletes += 1;
            self.aff_match.remove(&m);
            self.counts.aff_match[fam(m.family)] -= 1;
        }
        Ok(())
    }

    /// A fresh id that is neither installed nor planned in `pending`.
    pub(super) fn alloc_backend_id_excluding(&mut self, pending: &[(u32, Backend)]) -> u32 {
        loop {
            let id = self.alloc_backend_id();
            if !pending.iter().any(|(p, _)| *p == id) {
                return id;
            }
        }
    }

    pub(super) fn write_slots_and_master(
        &mut self,
        fe: &Frontend,
        ids: &[u32],
        table: Option<(u32, &[(u32, u32)])>,
        master: &SvcValue,
        report: &mut ApplyReport,
    ) -> Result<(), MapOpError> {
        let fresh = !self.services.contains_key(fe);
        let result = self.try_write_slots_and_master(fe, ids, table, master, report);
        if result.is_err() && fresh {
            // No master was ever visible: take back the slots written so far, so a new
            // service that failed leaves nothing behind.
            let written = self.services.remove(fe).map_or(0, |i| i.slots.len());
            for slot in (1..=written).rev() {
                match self.maps.del_service(fe, slot as u16) {
                    Ok(()) => report.deletes += 1,
                    Err(_) => {
                        self.degraded = true;
                        self.stray_slots.insert((*fe, slot as u16));
                    }
                }
            }
        }
        result
    }

    pub(super) fn try_write_slots_and_master(
        &mut self,
        fe: &Frontend,
        ids: &[u32],
        table: Option<(u32, &[(u32, u32)])>,
        master: &SvcValue,
        report: &mut ApplyReport,
    ) -> Result<(), MapOpError> {
        if let Some((t, cells)) = table {
            let m = self.maps.maglev_geometry().table_size as usize;
            for (cell, id) in cells {
                self.maps.put_maglev(t, *cell, *id)?;
                report.writes += 1;
                // Claimed from the first cell on: collect_garbage keeps what cells name.
                let claimed = &mut self.claimed_tables;
                self.maglev_tables.entry(t).or_insert_with(|| {
                    claimed.push(t);
                    vec![0; m]
                })[*cell as usize] = *id;
            }
        }
        let installed = self.services.entry(*fe).or_insert_with(|| Installed {
            master: SvcValue::default(),
            slots: Box::default(),
        });
        // The mirror's slots as written so far, put back (exactly sized) whatever happens.
        let mut slots = std::mem::take(&mut installed.slots).into_vec();
        let mut result = Ok(());
        for (i, id) in ids.iter().enumerate() {
            if slots.get(i) == Some(id) {
                continue;
            }
            let slot = (i + 1) as u16;
            let v = SvcValue {
                backend_id: *id,
                rev_nat_id: master.rev_nat_id,
                ..SvcValue::default()
            };
            result = self.maps.put_service(fe, slot, &v);
            if result.is_err() {
                break;
            }
            report.writes += 1;
            // A slot left over from before is in use again: it is no longer stray.
            self.stray_slots.remove(&(*fe, slot));
            if i < slots.len() {
                slots[i] = *id;
            } else {
                slots.push(*id);
            }
        }
        if result.is_ok() {
            result = self.maps.put_service(fe, 0, master);
        }
        if result.is_ok() {
            report.writes += 1;
            installed.master = *master;
            // Slots beyond the new total are deleted by the caller; the mirror drops them now
            // so that a failed delete shows up as a stray slot instead.
            slots.truncate(ids.len());
        }
        installed.slots = slots.into_boxed_slice();
        result
    }

    /// Best effort to put a service back as it was after a failed update.
    pub(super) fn restore(&mut self, fe: &Frontend, old: &Installed, report: &mut ApplyReport) {
        let Some(installed) = self.services.get_mut(fe) else {
            return;
        };
        for (i, id) in old.slots.iter().enumerate() {
            if installed.slots.get(i) != Some(id) && *id != 0 {
                let v = SvcValue {
                    backend_id: *id,
                    rev_nat_id: old.master.rev_nat_id,
                    ..SvcValue::default()
                };
                if self.maps.put_service(fe, (i + 1) as u16, &v).is_ok() {
                    report.writes += 1;
                    if let Some(s) = installed.slots.get_mut(i) {
                        *s = *id;
                    }
                }
            }
        }
        // Slots the failed update added beyond the old ones: the old master does not count
        // them. One that cannot be deleted is stray (deleted by the next apply), never left
        // unknown to the mirror.
        let surplus: Vec<usize> = (old.slots.len() + 1..=installed.slots.len())
            .rev()
            .collect();
        let keep = old.slots.len().min(installed.slots.len());
        installed.slots = installed.slots[..keep].into();
        for slot in surplus {
            self.delete_slot(fe, slot as u16, "surplus slot", report);
        }
    }

    pub(super) fn remove_service(
        &mut self,
        fe: &Frontend,
        report: &mut ApplyReport,
    ) -> Result<(), MapOpError> {
        let Some(installed) = self.services.get(fe).cloned() else {
            return Ok(());
        };
        self.maps.del_service(fe, 0)?;
        report.deletes += 1;
        self.services.remove(fe);
        if let Some(t) = maglev_table_of(&installed.master) {
            self.maglev_tables.remove(&t);
        }
        self.maglev_built.remove(fe);
        for slot in (1..=installed.slots.len()).rev() {
            self.delete_slot(fe, slot as u16, "slot", report);
        }
        Ok(())
    }
}

/// The affinity matches a frontend with session affinity (`affine`) needs: its active
/// backends `active`.
pub(super) fn aff_matches<'a>(
    fe: &'a Frontend,
    affine: bool,
    rev_nat_id: u32,
    active: &'a [u32],
) -> impl Iterator<Item = AffMatch> + 'a {
    let active = if affine { active } else { &[] };
    active
        .iter()
        .filter(|id| **id != 0)
        .map(move |id| AffMatch {
            family: Family::of(&fe.l4.addr),
            rev_nat_id,
            scope: fe.scope,
            backend_id: *id,
        })
}

/// What `apply_service` writes for a frontend (`plan_service`), decided before anything is.
pub(super) struct ServicePlan {
    pub(super) family: Family,
    /// The entry's backends, the active ones (slots `1..=active`) first.
    pub(super) backends: Vec<Backend>,
    pub(super) active: usize,
    /// The backend id of each of `backends`, new ones allocated in the plan.
    pub(super) ids: Vec<u32>,
    /// The frontend as installed now.
    pub(super) existing: Option<Installed>,
    pub(super) rev_nat_id: u32,
    /// Source ranges and affinity matches to add.
    pub(super) ranges: Vec<Cidr>,
    pub(super) matches: Vec<AffMatch>,
    pub(super) affine: bool,
    /// Entries each table needs beyond what the frontend holds now.
    pub(super) needed: [(Table, i64); 5],
}
