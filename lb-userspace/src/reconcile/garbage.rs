//! What nothing refers to any more, deleted: stray slots, backends, rev-NAT entries, source
//! ranges and affinity matches, after what named them is gone.
use std::collections::{BTreeMap, BTreeSet};

use foldhash::{HashMap, HashSet, HashSetExt as _};
use lb_common::svc_flags;

use super::service::aff_matches;
use super::{ApplyReport, Installed, Reconciler, at_addr, fam, fam_of};
use crate::{
    datapath::maps::{AffMatch, LbMaps, maglev_table_of},
    model::{Cidr, DesiredState, Family, Frontend, L4Addr, Proto, Scope},
};

impl<M: LbMaps> Reconciler<M> {
    /// Deletes the source ranges of the rev-NAT ids `revnat` that no frontend of `changed`
    /// wants any more.
    pub(super) fn prune_src_ranges_of(
        &mut self,
        changed: &BTreeSet<Frontend>,
        desired: &DesiredState,
        revnat: &BTreeSet<u32>,
        report: &mut ApplyReport,
    ) {
        // Both scopes of a frontend's address share its rev-NAT id.
        let scoped: BTreeSet<Frontend> = changed
            .iter()
            .flat_map(|fe| {
                [Scope::External, Scope::Internal].map(|scope| Frontend { scope, ..*fe })
            })
            .collect();
        let wanted_ranges: BTreeSet<(u32, Cidr)> = scoped
            .iter()
            .filter_map(|fe| Some((self.services.get(fe)?, desired.services.get(fe)?)))
            .filter(|(i, _)| i.master.flags & svc_flags::SOURCE_RANGES != 0)
            .flat_map(|(i, e)| {
                let id = i.master.rev_nat_id;
                e.source_ranges.iter().map(move |c| (id, *c))
            })
            .collect();
        let stale: Vec<(u32, Cidr)> = self
            .src_ranges
            .iter()
            .filter(|(id, _)| revnat.contains(id))
            .filter(|r| !wanted_ranges.contains(r))
            .copied()
            .collect();
        self.delete_src_ranges(stale, report);
    }

    /// Deletes the affinity matches of `changed` (as installed before, `old`, and now) that
    /// their masters no longer offer.
    pub(super) fn prune_aff_matches_of(
        &mut self,
        changed: &BTreeSet<Frontend>,
        old: &BTreeMap<Frontend, Installed>,
        report: &mut ApplyReport,
    ) {
        let mut stale = Vec::new();
        for fe in changed {
            let family = Family::of(&fe.l4.addr);
            let ids: BTreeSet<u32> = old
                .get(fe)
                .into_iter()
                .chain(self.services.get(fe))
                .map(|i| i.master.rev_nat_id)
                .collect();
            let keep: BTreeSet<AffMatch> = match self.services.get(fe) {
                Some(i) => {
                    let active = &i.slots[..(i.master.count as usize).min(i.slots.len())];
                    let affine = i.master.flags & svc_flags::AFFINITY != 0;
                    aff_matches(fe, affine, i.master.rev_nat_id, active).collect()
                }
                None => BTreeSet::new(),
            };
            for id in &ids {
                stale.extend(
                    self.aff_matches_of(family, *id, fe.scope)
                        .filter(|m| !keep.contains(m)),
                );
            }
        }
        for m in stale {
            match self.maps.del_aff_match(&m) {
                Ok(()) => {
                    report.deletes += 1;
                    if self.aff_match.remove(&m) {
                        self.counts.aff_match[fam(m.family)] -= 1;
                    }
                }
                Err(e) => {
                    self.degraded = true;
                    tracing::warn!(?m, error = %e, "cannot delete affinity match")
                }
            }
        }
    }

    /// `collect_garbage` for the backends `ids` and rev-NAT entries `revnat` a change of
    /// `changed` may have left unreferenced. A backend a frontend outside `changed` names is
    /// in its slots (the mirror holds their desired state), so only `changed`'s slots and
    /// tables need looking at; with `keep_wanted`, backends the desired state names stay.
    pub(super) fn collect_garbage_of(
        &mut self,
        ids: &BTreeSet<u32>,
        revnat: &BTreeSet<u32>,
        changed: &BTreeSet<Frontend>,
        changed_want: &HashMap<L4Addr, u32>,
        keep_wanted: bool,
        report: &mut ApplyReport,
    ) {
        let mut by_changed: HashSet<u32> = HashSet::new();
        for fe in changed {
            if let Some(i) = self.services.get(fe) {
                by_changed.extend(i.slots.iter().copied());
                let table = maglev_table_of(&i.master).and_then(|t| self.maglev_tables.get(&t));
                by_changed.extend(table.into_iter().flatten().copied());
            }
        }
        let unused: Vec<u32> = ids
            .iter()
            .copied()
            .filter(|id| {
                let Some(b) = self.backends.get(*id) else {
                    return false;
                };
                let total = self.backends.wanted_total(&b.l4);
                let elsewhere = total > changed_want.get(&b.l4).copied().unwrap_or(0);
                let kept = (keep_wanted && total > 0) || elsewhere;
                !(kept || by_changed.contains(id))
            })
            .collect();
        self.delete_backends(unused, report);
        for id in revnat {
            let Some((addr, port)) = self.revnat.get(id).copied() else {
                continue;
            };
            // Its users: the frontends at its address and port (both scopes, any protocol).
            let used = at_addr(&self.services, addr)
                .any(|(fe, i)| fe.l4.port == port && i.master.rev_nat_id == *id);
            if used {
                continue;
            }
            match self.maps.del_revnat(*id, Family::of(&addr)) {
                Ok(()) => {
                    report.deletes += 1;
                    self.revnat.remove(id);
                    self.counts.revnat[fam_of(&addr)] -= 1;
                    for proto in [Proto::Tcp, Proto::Udp, Proto::Sctp] {
                        let l4 = L4Addr { addr, port, proto };
                        if self.revnat_ids.get(&l4) == Some(id) {
                            self.revnat_ids.remove(&l4);
                        }
                    }
                }
                Err(e) => {
                    self.degraded = true;
                    tracing::warn!(id, error = %e, "cannot delete rev-NAT entry")
                }
            }
        }
    }

    /// Deletes the affinity matches no installed frontend with session affinity wants: after
    /// the masters and slots changed, so a backend stops matching only once no slot of the
    /// frontend offers it to new flows.
    pub(super) fn prune_aff_match(&mut self, report: &mut ApplyReport) {
        let wanted: BTreeSet<AffMatch> = self
            .services
            .iter()
            .flat_map(|(fe, i)| {
                let active = &i.slots[..(i.master.count as usize).min(i.slots.len())];
                let affine = i.master.flags & svc_flags::AFFINITY != 0;
                aff_matches(fe, affine, i.master.rev_nat_id, active)
            })
            .collect();
        let stale: Vec<AffMatch> = self.aff_match.difference(&wanted).copied().collect();
        for m in stale {
            match self.maps.del_aff_match(&m) {
                Ok(()) => {
                    report.deletes += 1;
                    self.aff_match.remove(&m);
                    self.counts.aff_match[fam(m.family)] -= 1;
                }
                Err(e) => {
                    self.degraded = true;
                    tracing::warn!(?m, error = %e, "cannot delete affinity match")
                }
            }
        }
    }

    /// Deletes the source ranges no installed frontend with `SOURCE_RANGES` wants any more:
    /// after the masters changed, so a range is never missing while a master relies on it.
    pub(super) fn prune_src_ranges(&mut self, desired: &DesiredState, report: &mut ApplyReport) {
        let wanted: BTreeSet<(u32, Cidr)> = self
            .services
            .iter()
            .filter(|(_, i)| i.master.flags & svc_flags::SOURCE_RANGES != 0)
            .filter_map(|(fe, i)| Some((i.master.rev_nat_id, desired.services.get(fe)?)))
            .flat_map(|(id, e)| e.source_ranges.iter().map(move |c| (id, *c)))
            .collect();
        let stale: Vec<(u32, Cidr)> = self.src_ranges.difference(&wanted).copied().collect();
        self.delete_src_ranges(stale, report);
    }

    /// Deletes the source ranges `stale` from the maps and the mirror; one that cannot be
    /// deleted stays (logged) and marks the reconciler degraded.
    pub(super) fn delete_src_ranges(&mut self, stale: Vec<(u32, Cidr)>, report: &mut ApplyReport) {
        for (id, cidr) in stale {
            match self.maps.del_src_range(id, &cidr) {
                Ok(()) => {
                    report.deletes += 1;
                    self.src_ranges.remove(&(id, cidr));
                    self.counts.src_ranges[fam_of(&cidr.addr)] -= 1;
                }
                Err(e) => {
                    self.degraded = true;
                    tracing::warn!(id, %cidr, error = %e, "cannot delete source range")
                }
            }
        }
    }

    pub(super) fn delete_stray_slots(&mut self, report: &mut ApplyReport) {
        for (fe, slot) in std::mem::take(&mut self.stray_slots) {
            self.delete_slot(&fe, slot, "stray slot", report);
        }
    }

    /// Deletes slot `slot` of `fe` (`what` names it in the log); one that cannot be deleted is
    /// kept as a stray slot, for the next apply to delete, and makes that apply a full one.
    pub(super) fn delete_slot(
        &mut self,
        fe: &Frontend,
        slot: u16,
        what: &str,
        report: &mut ApplyReport,
    ) {
        match self.maps.del_service(fe, slot) {
            Ok(()) => report.deletes += 1,
            Err(e) => {
                self.degraded = true;
                tracing::warn!(%fe, slot, error = %e, "cannot delete {what}");
                self.stray_slots.insert((*fe, slot));
            }
        }
    }

    /// Deletes the backends `unused` from the maps and the mirror; one that cannot be deleted
    /// stays (logged) and marks the reconciler degraded (the next sync is a full one).
    pub(super) fn delete_backends(&mut self, unused: Vec<u32>, report: &mut ApplyReport) {
        for id in unused {
            let Some(b) = self.backends.get(id) else {
                continue;
            };
            match self.maps.del_backend(id, Family::of(&b.l4.addr)) {
                Ok(()) => {
                    report.deletes += 1;
                    report.backends_deleted += 1;
                    self.backends.remove(id);
                    self.counts.backends[fam_of(&b.l4.addr)] -= 1;
                }
                Err(e) => {
                    self.degraded = true;
                    tracing::warn!(id, error = %e, "cannot delete backend")
                }
            }
        }
    }

    /// Deletes backends and rev-NAT entries no installed service refers to.
    ///
    /// With `keep_wanted`, backends the desired state names (`wanted`) survive even when
    /// unreferenced: they are about to be used again, and keeping them keeps their ids (and
    /// the conntrack entries naming them) valid.
    pub(super) fn collect_garbage(&mut self, keep_wanted: bool, report: &mut ApplyReport) {
        let used_backends: HashSet<u32> = self
            .services
            .values()
            .flat_map(|i| i.slots.iter().copied())
            .chain(self.maglev_tables.values().flatten().copied())
            .collect();
        let mut unused: Vec<u32> = self
            .backends
            .iter()
            .filter(|(id, b)| {
                let kept = keep_wanted && self.backends.wanted_total(&b.l4) > 0;
                !(used_backends.contains(id) || kept)
            })
            .map(|(id, _)| id)
            .collect();
        // In id order, as they are deleted.
        unused.sort_unstable();
        self.delete_backends(unused, report);
        let used_revnat: HashSet<u32> = self
            .services
            .values()
            .map(|i| i.master.rev_nat_id)
            .collect();
        let unused: Vec<u32> = self
            .revnat
            .keys()
            .filter(|id| !used_revnat.contains(id))
            .copied()
            .collect();
        for id in unused {
            let Some((addr, _)) = self.revnat.get(&id).copied() else {
                continue;
            };
            match self.maps.del_revnat(id, Family::of(&addr)) {
                Ok(()) => {
                    report.deletes += 1;
                    self.revnat.remove(&id);
                    self.counts.revnat[fam_of(&addr)] -= 1;
                    self.revnat_ids.retain(|_, v| *v != id);
                }
                Err(e) => {
                    self.degraded = true;
                    tracing::warn!(id, error = %e, "cannot delete rev-NAT entry")
                }
            }
        }
    }
}
