//! `apply_update`: `apply`'s order and clean-up for the frontends an `Update` names.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use foldhash::{HashMap, HashMapExt as _};
use lb_common::svc_flags;

use super::{ApplyReport, Installed, Reconciler, Room, at_addr};
use crate::{
    datapath::maps::{LbMaps, maglev_table_of},
    model::{Backend, DesiredState, Frontend, L4Addr, ServiceEntry},
    translate::incremental::Update,
};

impl<M: LbMaps> Reconciler<M> {
    /// Makes the maps hold `desired`, of which `update` says what changed since the last
    /// apply (see the module docs).
    pub fn apply_update(&mut self, desired: &DesiredState, update: &Update) -> ApplyReport {
        let changes = match update {
            Update::Changed(c) if self.incremental => c,
            _ => return self.apply(desired),
        };
        let mut report = ApplyReport::default();
        self.degraded = false;
        self.claimed_tables.clear();
        for (fe, old) in changes {
            if let Some(o) = old {
                self.want(&o.backends, false);
            }
            if let Some(n) = desired.services.get(fe) {
                self.want(&n.backends, true);
            }
        }
        let mut changed: BTreeSet<Frontend> = changes.keys().copied().collect();
        changed.extend(std::mem::take(&mut self.retry));
        let touched = self.touched(&changed, desired);

        // 1. What goes away (as in `apply`).
        for fe in &changed {
            if !desired.services.contains_key(fe) && self.services.contains_key(fe) {
                self.remove_counted(fe, &mut report);
            }
        }
        self.delete_stray_slots(&mut report);
        let (ids, revnat, cw) = (&touched.ids, &touched.revnat, &touched.want);
        self.collect_garbage_of(ids, revnat, &changed, cw, true, &mut report);

        // 2. The changed frontends, in `apply`'s order, with the backend states (`wanted`) and
        // ClusterIP counts of the whole desired state.
        let mut room = self.room();
        for fe in &changed {
            if let Some(entry) = desired.services.get(fe) {
                let ips = &touched.cluster_ips;
                self.apply_counted(fe, entry, ips, &mut room, &mut report);
            }
        }
        self.refresh_backend_states(changes, &changed, desired, &touched.want, &mut report);

        // 3. Clean-up, as `apply`'s, of what the changed frontends touched.
        self.clean_up_touched(desired, &changed, touched, &mut room, &mut report);
        self.finish(&report);
        debug_assert_eq!(self.counts, self.recount(), "entry counts drifted");
        report
    }

    /// What the changed frontends had installed and what they want, for the clean-up passes.
    pub(super) fn touched(&self, changed: &BTreeSet<Frontend>, desired: &DesiredState) -> Touched {
        let old: BTreeMap<Frontend, Installed> = changed
            .iter()
            .filter_map(|fe| Some((*fe, self.services.get(fe)?.clone())))
            .collect();
        let ids = old
            .values()
            .flat_map(|i| i.slots.iter().copied())
            .filter(|id| *id != 0)
            .collect();
        let tables = old
            .values()
            .filter_map(|i| maglev_table_of(&i.master))
            .collect();
        let revnat = old.values().map(|i| i.master.rev_nat_id).collect();
        let mut want: HashMap<L4Addr, u32> = HashMap::new();
        for b in changed
            .iter()
            .filter_map(|fe| desired.services.get(fe))
            .flat_map(|e| &e.backends)
        {
            *want.entry(b.l4).or_default() += 1;
        }
        Touched {
            old,
            ids,
            tables,
            revnat,
            want,
            cluster_ips: changed_cluster_ips(changed, desired),
        }
    }

    /// `apply`'s clean-up, limited to what the changed frontends touched: tables claimed by
    /// failed writes, then backends, rev-NAT entries, ClusterIPs and echo entries, source
    /// ranges and affinity matches nothing refers to any more. `room` is what is left, for
    /// retried Maglev fallbacks.
    pub(super) fn clean_up_touched(
        &mut self,
        desired: &DesiredState,
        changed: &BTreeSet<Frontend>,
        touched: Touched,
        room: &mut Room,
        report: &mut ApplyReport,
    ) {
        let Touched {
            old,
            mut ids,
            tables,
            mut revnat,
            want,
            cluster_ips,
        } = touched;
        self.free_unnamed_tables(tables, changed);
        self.retry_maglev_fallbacks(desired, &cluster_ips, room, report);
        self.delete_stray_slots(report);
        ids.extend(
            changed
                .iter()
                .filter_map(|fe| desired.services.get(fe))
                .flat_map(|e| e.backends.iter())
                .filter_map(|b| self.backends.id_of(&b.l4)),
        );
        revnat.extend(
            changed
                .iter()
                .filter_map(|fe| self.services.get(fe))
                .map(|i| i.master.rev_nat_id),
        );
        self.collect_garbage_of(&ids, &revnat, changed, &want, false, report);
        let addrs: BTreeSet<IpAddr> = changed.iter().map(|fe| fe.l4.addr).collect();
        for addr in addrs {
            self.sync_address(addr, report);
        }
        self.prune_src_ranges_of(changed, desired, &revnat, report);
        self.prune_aff_matches_of(changed, &old, report);
    }

    /// A backend's state is the most usable any frontend gives it: a change may move it for
    /// frontends that did not change (which `apply` would write it for).
    pub(super) fn refresh_backend_states(
        &mut self,
        changes: &BTreeMap<Frontend, Option<ServiceEntry>>,
        changed: &BTreeSet<Frontend>,
        desired: &DesiredState,
        changed_want: &HashMap<L4Addr, u32>,
        report: &mut ApplyReport,
    ) {
        let mut touched: Vec<L4Addr> = changes
            .values()
            .flatten()
            .chain(changed.iter().filter_map(|fe| desired.services.get(fe)))
            .flat_map(|e| e.backends.iter().map(|b| b.l4))
            .collect();
        touched.sort_unstable();
        touched.dedup();
        for l4 in touched {
            let (Some(id), Some(state)) = (self.backends.id_of(&l4), self.wanted_state(&l4)) else {
                continue;
            };
            let total = self.backends.wanted_total(&l4);
            if total <= changed_want.get(&l4).copied().unwrap_or(0) {
                continue;
            }
            let b = Backend { l4, state };
            if self.backends.get(id).is_some_and(|have| have != b) {
                match self.maps.put_backend(id, &b) {
                    Ok(()) => {
                        report.writes += 1;
                        self.backends.insert(id, &b);
                    }
                    Err(e) => {
                        self.degraded = true;
                        tracing::warn!(id, error = %e, "cannot write backend state");
                    }
                }
            }
        }
    }
}

/// What an incremental apply's changed frontends had before it, and what they want.
pub(super) struct Touched {
    /// Their installed entries.
    pub(super) old: BTreeMap<Frontend, Installed>,
    /// The backend ids their slots named.
    pub(super) ids: BTreeSet<u32>,
    /// The Maglev tables their masters named.
    pub(super) tables: Vec<u32>,
    /// Their rev-NAT ids.
    pub(super) revnat: BTreeSet<u32>,
    /// How many entries of the changed frontends name each backend address.
    pub(super) want: HashMap<L4Addr, u32>,
    /// How many ClusterIP frontends the desired state has at each changed ClusterIP.
    pub(super) cluster_ips: BTreeMap<IpAddr, u32>,
}

/// Per address of a changed ClusterIP frontend, how many ClusterIP frontends the whole
/// desired state has there.
pub(super) fn changed_cluster_ips(
    changed: &BTreeSet<Frontend>,
    desired: &DesiredState,
) -> BTreeMap<IpAddr, u32> {
    let mut ips: BTreeMap<IpAddr, u32> = BTreeMap::new();
    for fe in changed {
        let Some(entry) = desired.services.get(fe) else {
            continue;
        };
        if entry.flags & svc_flags::CLUSTER_IP != 0 && !ips.contains_key(&fe.l4.addr) {
            let n = at_addr(&desired.services, fe.l4.addr)
                .filter(|(_, e)| e.flags & svc_flags::CLUSTER_IP != 0)
                .count();
            ips.insert(fe.l4.addr, n as u32);
        }
    }
    ips
}
