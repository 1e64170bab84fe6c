//! Maglev tables in `lb_maglev`: planned per frontend, written in place or in a free index,
//! freed once no master names them; a frontend without a free table falls back to random.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use foldhash::HashMap;
use lb_common::{lb_alg, map_names};

use super::{ApplyReport, Reconciler, Room, ServiceError};
use crate::{
    datapath::maps::{LbMaps, NO_MAGLEV_TABLE, maglev_table_of},
    model::{Backend, DesiredState, Frontend, L4Addr, LbAlgorithm, ServiceEntry},
    translate::maglev,
};

impl<M: LbMaps> Reconciler<M> {
    /// Frees the Maglev tables among `old_tables` (and those claimed by failed writes) that no
    /// frontend of `changed` names any more.
    pub(super) fn free_unnamed_tables(
        &mut self,
        old_tables: Vec<u32>,
        changed: &BTreeSet<Frontend>,
    ) {
        let tables: BTreeSet<u32> = old_tables
            .into_iter()
            .chain(std::mem::take(&mut self.claimed_tables))
            .collect();
        for t in tables {
            let named = changed.iter().any(|fe| {
                self.services
                    .get(fe)
                    .is_some_and(|i| maglev_table_of(&i.master) == Some(t))
            });
            if !named {
                self.maglev_tables.remove(&t);
            }
        }
    }

    /// Tries the Maglev frontends that found no free table once more, when frontends after
    /// them in this apply freed one (a table is free only once its master stopped naming it,
    /// so an earlier frontend cannot take it): one apply then programs what a fresh
    /// reconciler's would.
    pub(super) fn retry_maglev_fallbacks(
        &mut self,
        desired: &DesiredState,
        ips: &BTreeMap<IpAddr, u32>,
        room: &mut Room,
        report: &mut ApplyReport,
    ) {
        let tables = self.maps.maglev_geometry().tables as usize;
        if report.fallbacks.is_empty() || self.maglev_tables.len() >= tables {
            return;
        }
        for e in std::mem::take(&mut report.fallbacks) {
            match desired.services.get(&e.frontend) {
                Some(entry) => self.apply_counted(&e.frontend, entry, ips, room, report),
                None => report.fallbacks.push(e),
            }
        }
    }

    /// The report of a Maglev frontend that found no free table.
    pub(super) fn maglev_fallback(&self, fe: &Frontend, entry: &ServiceEntry) -> ServiceError {
        ServiceError {
            frontend: *fe,
            service: entry.name.to_string(),
            error: format!(
                "map {} is full ({} tables of {} cells in use): Maglev service programmed with \
                 random selection",
                map_names::MAGLEV,
                self.maglev_tables.len(),
                self.maps.maglev_geometry().table_size
            ),
            full_map: Some(map_names::MAGLEV),
        }
    }

    /// How `fe`'s master selects (see `MaglevPlan`), given its active backends and their ids.
    pub(super) fn plan_maglev(
        &self,
        fe: &Frontend,
        entry: &ServiceEntry,
        active: &[Backend],
        ids: &[u32],
    ) -> MaglevPlan {
        let random = MaglevPlan {
            lb_alg: lb_alg::RANDOM,
            master_backend_id: 0,
            writes: Vec::new(),
            built: None,
            fallback: false,
        };
        if entry.algorithm != LbAlgorithm::Maglev {
            return random;
        }
        let set = maglev::canonical(&active.iter().map(|b| b.l4).collect::<Vec<_>>());
        if set.is_empty() {
            // Nothing to choose (count 0): no table.
            return MaglevPlan {
                lb_alg: lb_alg::MAGLEV,
                master_backend_id: NO_MAGLEV_TABLE,
                ..random
            };
        }
        let g = self.maps.maglev_geometry();
        let current = self
            .services
            .get(fe)
            .and_then(|i| maglev_table_of(&i.master))
            .filter(|t| self.maglev_tables.contains_key(t));
        let Some(table) =
            current.or_else(|| (0..g.tables).find(|t| !self.maglev_tables.contains_key(t)))
        else {
            return MaglevPlan {
                fallback: true,
                ..random
            };
        };
        let mut plan = MaglevPlan {
            lb_alg: lb_alg::MAGLEV,
            master_backend_id: table,
            writes: Vec::new(),
            built: Some(set.clone()),
            fallback: false,
        };
        if current.is_some() && self.maglev_built.get(fe) == Some(&set) {
            return plan;
        }
        let id_of: HashMap<L4Addr, u32> = active
            .iter()
            .map(|b| b.l4)
            .zip(ids.iter().copied())
            .collect();
        let have = current.and_then(|t| self.maglev_tables.get(&t));
        plan.writes = maglev::build(&set, g.table_size)
            .iter()
            .enumerate()
            .map(|(cell, i)| {
                (
                    cell as u32,
                    id_of.get(&set[*i as usize]).copied().unwrap_or(0),
                )
            })
            .filter(|(cell, id)| have.is_none_or(|h| h.get(*cell as usize) != Some(id)))
            .collect();
        plan
    }
}

/// What a frontend's master says about its algorithm, and the Maglev cells to write first.
pub(super) struct MaglevPlan {
    pub(super) lb_alg: u8,
    /// The master's `backend_id`: its Maglev table (or `NO_MAGLEV_TABLE`), 0 for random.
    pub(super) master_backend_id: u32,
    /// (cell, backend id) of the master's table that differ from what it holds.
    pub(super) writes: Vec<(u32, u32)>,
    /// The canonical backend set the table holds once `writes` are written.
    pub(super) built: Option<Vec<L4Addr>>,
    /// Maglev was asked for, but `lb_maglev` has no free table: random instead.
    pub(super) fallback: bool,
}
