//! Conntrack lifecycle in userspace: the sizes and lifetimes `lb run` gives the datapath's
//! conntrack maps, and the garbage collector that walks them.
//!
//! The datapath (lb-ebpf `conntrack.rs`) only ever reads, refreshes and inserts entries; LRU
//! eviction makes room under pressure. What it cannot do is notice an entry nobody uses any
//! more: an expired flow, a closed one past its closing lifetime, or the flow of a backend that
//! was removed (whose reply entry, keyed on the backend's address, no packet will look up
//! again). [`Gc`] removes those, every `--ct-gc-interval` and right after a sync that deleted
//! backends, and reports what the maps hold for the `lb_conntrack_*` metrics.
//!
//! A pass reads a whole map first (`BPF_MAP_LOOKUP_BATCH`, 4096 entries a syscall) and deletes
//! after (a delete during a key walk can restart it), and re-reads an expired entry before
//! deleting it, so a flow a new packet re-created meanwhile stays. It never deletes an entry
//! whose backend exists under the same address.
use std::{
    collections::{BTreeMap, HashMap as StdHashMap},
    hash::Hash,
    path::Path,
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::Context as _;
use aya::maps::{HashMap, IterableMap as _, MapData, MapError};
use lb_common::{
    Backend4, Backend6, Ct4Key, Ct4Value, Ct6Key, Ct6Value, IPPROTO_SCTP, IPPROTO_TCP, IPPROTO_UDP,
    ct_dir, ct_flags, map_names,
};

use crate::datapath::{
    batch,
    family::{MapFamily, V4, V6},
    pinned::open_hash,
};

pub use crate::config::{CtArgs, CtTimeouts, MAX_TIMEOUT};

/// `CLOCK_MONOTONIC` in whole seconds: the datapath's clock (`bpf_ktime_get_ns() / 1e9`).
pub fn monotonic_secs() -> u32 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: plain syscall with a valid pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    u32::try_from(ts.tv_sec).unwrap_or(u32::MAX)
}

/// Why the GC deleted an entry (`lb_conntrack_gc_deleted_total{reason}`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Reason {
    /// Past its lifetime, never closed.
    Expired,
    /// Closed (FIN, RST, ABORT…) and past its closing lifetime.
    Closed,
    /// Its backend id is not in the backend map, or names another address now.
    BackendGone,
}

impl Reason {
    pub const ALL: [Reason; 3] = [Reason::Expired, Reason::Closed, Reason::BackendGone];

    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Expired => "expired",
            Reason::Closed => "closed",
            Reason::BackendGone => "backend_gone",
        }
    }
}

/// A live entry's state (`lb_conntrack_entries{state}`).
pub fn state_name(flags: u16) -> &'static str {
    if flags & (ct_flags::TX_CLOSING | ct_flags::RX_CLOSING) != 0 {
        "closing"
    } else if flags & ct_flags::SEEN_REPLY != 0 {
        "established"
    } else {
        "new"
    }
}

/// `lb_conntrack_entries{protocol}` of an IP protocol number.
pub fn protocol_name(proto: u8) -> &'static str {
    match proto {
        IPPROTO_TCP => "tcp",
        IPPROTO_UDP => "udp",
        IPPROTO_SCTP => "sctp",
        _ => "other",
    }
}

/// What one GC pass found and did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GcReport {
    /// Live entries left, by (family `ipv4`/`ipv6`, protocol, state).
    pub entries: BTreeMap<(&'static str, &'static str, &'static str), u64>,
    /// Entries deleted, by reason.
    pub deleted: BTreeMap<Reason, u64>,
    /// Maps that could not be walked or written (logged); their entries are missing above.
    pub errors: u64,
    pub duration: Duration,
}

impl GcReport {
    pub fn deleted(&self, r: Reason) -> u64 {
        self.deleted.get(&r).copied().unwrap_or(0)
    }

    pub fn total_deleted(&self) -> u64 {
        self.deleted.values().sum()
    }

    pub fn total_entries(&self) -> u64 {
        self.entries.values().sum()
    }
}

/// The conntrack maps and the backend maps the GC checks them against.
pub struct Gc {
    pub tcp4: HashMap<MapData, Ct4Key, Ct4Value>,
    pub any4: HashMap<MapData, Ct4Key, Ct4Value>,
    pub tcp6: HashMap<MapData, Ct6Key, Ct6Value>,
    pub any6: HashMap<MapData, Ct6Key, Ct6Value>,
    pub backends4: HashMap<MapData, u32, Backend4>,
    pub backends6: HashMap<MapData, u32, Backend6>,
}

impl Gc {
    /// Opens the maps `lb run` pinned in `dir` (its own handles: the GC runs beside the
    /// reconciler, never on its path).
    pub fn open(dir: &Path) -> anyhow::Result<Self> {
        Ok(Self {
            tcp4: open_hash(dir, map_names::CT_TCP4)?,
            any4: open_hash(dir, map_names::CT_ANY4)?,
            tcp6: open_hash(dir, map_names::CT_TCP6)?,
            any6: open_hash(dir, map_names::CT_ANY6)?,
            backends4: open_hash(dir, map_names::BACKENDS4)?,
            backends6: open_hash(dir, map_names::BACKENDS6)?,
        })
    }

    /// One pass over the four maps at `now` (`monotonic_secs`).
    pub fn pass(&mut self, now: u32) -> GcReport {
        let start = Instant::now();
        let mut report = GcReport::default();
        for (name, map) in [
            (map_names::CT_TCP4, &mut self.tcp4),
            (map_names::CT_ANY4, &mut self.any4),
        ] {
            sweep::<V4>(name, map, &self.backends4, now, &mut report);
        }
        for (name, map) in [
            (map_names::CT_TCP6, &mut self.tcp6),
            (map_names::CT_ANY6, &mut self.any6),
        ] {
            sweep::<V6>(name, map, &self.backends6, now, &mut report);
        }
        report.duration = start.elapsed();
        report
    }
}

fn read_backends<F: MapFamily>(
    map: &HashMap<MapData, u32, F::Backend>,
) -> Result<StdHashMap<u32, (F::Addr, u16)>, MapError> {
    let mut out = StdHashMap::new();
    for item in map.iter() {
        let (id, b) = item?;
        let (addr, port, ..) = F::backend_fields(&b);
        out.insert(id, (addr, port));
    }
    Ok(out)
}

/// Reads the whole map: in batches (`BPF_MAP_LOOKUP_BATCH`, one syscall per 4096 entries
/// instead of two per entry), or entry by entry where the kernel refuses batches.
fn snapshot<K, V>(map: &HashMap<MapData, K, V>) -> Result<StdHashMap<K, V>, MapError>
where
    K: aya::Pod + bytemuck::Pod + Eq + Hash,
    V: aya::Pod + bytemuck::Pod,
{
    use std::os::fd::AsFd as _;
    let mut out = StdHashMap::new();
    let walk = batch::lookup_each(map.map().fd().as_fd(), |k, v| {
        out.insert(k, v);
        Ok::<(), std::io::Error>(())
    })
    .map_err(|io_error| {
        MapError::SyscallError(aya::sys::SyscallError {
            call: "bpf_map_lookup_batch",
            io_error,
        })
    })?;
    match walk {
        batch::Walk::Done => Ok(out),
        batch::Walk::Unsupported => {
            tracing::debug!("no batched map lookups; walking key by key");
            snapshot_by_key(map)
        }
    }
}

/// Reads the whole map key by key (at most twice its capacity of steps: a walk that deletes
/// restarts from the first key, and the datapath deletes too).
fn snapshot_by_key<K: aya::Pod + Eq + Hash, V: aya::Pod>(
    map: &HashMap<MapData, K, V>,
) -> Result<StdHashMap<K, V>, MapError> {
    let max = map
        .map()
        .info()
        .map(|i| u64::from(i.max_entries()))
        .unwrap_or(u64::from(u32::MAX));
    let mut out = StdHashMap::new();
    let mut steps = 0u64;
    for item in map.iter() {
        match item {
            Ok((k, v)) => {
                out.insert(k, v);
            }
            // Deleted between its key and its value: nothing to collect.
            Err(MapError::KeyNotFound) => {}
            Err(e) => return Err(e),
        }
        steps += 1;
        if steps >= 2 * max {
            break;
        }
    }
    Ok(out)
}

/// A reply entry's client side (address, port), protocol and backend id.
type ReplyOf<F> = (<F as MapFamily>::Addr, u16, u8, u32);

/// One map's pass: read it and its family's backends, judge every entry, delete the doomed.
fn sweep<F: MapFamily>(
    name: &str,
    map: &mut HashMap<MapData, F::CtKey, F::CtValue>,
    backend_map: &HashMap<MapData, u32, F::Backend>,
    now: u32,
    report: &mut GcReport,
) {
    let entries = match snapshot(map) {
        Ok(e) => e,
        Err(e) => {
            tracing::warn!(map = name, error = %e, "conntrack GC: cannot walk the map");
            report.errors += 1;
            return;
        }
    };
    // The backends after the entries: a backend added since is in this read with any entry
    // of it the walk saw, so no live flow of a new backend looks orphaned. (Ids are not reused
    // while lb runs, so one deleted meanwhile only keeps its entries until the next pass.)
    let backends = match read_backends::<F>(backend_map) {
        Ok(b) => b,
        Err(e) => {
            // Without the backends nothing can be judged: delete nothing.
            tracing::warn!(map = name, error = %e, "conntrack GC: cannot read the backends");
            report.errors += 1;
            return;
        }
    };
    let replies = replies::<F>(&entries);
    let mut doomed: Vec<(F::CtKey, Reason)> = Vec::new();
    for (k, v) in &entries {
        match judge::<F>(k, v, now, &backends, &replies) {
            Some(r) => doomed.push((*k, r)),
            None => count_live::<F>(report, k, v),
        }
    }
    delete::<F>(name, map, doomed, now, report);
}

/// Where each flow's reply entry says its backend is: (client side as the reply entry is
/// keyed, proto, backend id) → backend address. A service entry's backend id names the
/// backend it was made for only if that address is still the id's.
fn replies<F: MapFamily>(
    entries: &StdHashMap<F::CtKey, F::CtValue>,
) -> StdHashMap<ReplyOf<F>, (F::Addr, u16)> {
    let mut replies = StdHashMap::new();
    for (k, v) in entries {
        let (saddr, sport, daddr, dport, proto, dir) = F::ct_key_fields(k);
        if dir == ct_dir::REPLY {
            let (id, ..) = F::ct_value_fields(v);
            replies.insert((daddr, dport, proto, id), (saddr, sport));
        }
    }
    replies
}

/// Why entry `k` → `v` goes at `now`, if it does.
fn judge<F: MapFamily>(
    k: &F::CtKey,
    v: &F::CtValue,
    now: u32,
    backends: &StdHashMap<u32, (F::Addr, u16)>,
    replies: &StdHashMap<ReplyOf<F>, (F::Addr, u16)>,
) -> Option<Reason> {
    let (saddr, sport, _, _, proto, dir) = F::ct_key_fields(k);
    let (id, expires, flags, nat_addr, nat_port) = F::ct_value_fields(v);
    if expires <= now {
        return Some(
            if flags & (ct_flags::TX_CLOSING | ct_flags::RX_CLOSING) != 0 {
                Reason::Closed
            } else {
                Reason::Expired
            },
        );
    }
    let Some(addr) = backends.get(&id) else {
        return Some(Reason::BackendGone);
    };
    // The address the entry was made for: the reply entry's own source, or what the flow's
    // reply entry says.
    let made_for = if dir == ct_dir::REPLY {
        Some((saddr, sport))
    } else {
        let client = if flags & ct_flags::SNAT != 0 {
            (nat_addr, nat_port)
        } else {
            (saddr, sport)
        };
        replies.get(&(client.0, client.1, proto, id)).copied()
    };
    match made_for {
        Some(a) if a != *addr => Some(Reason::BackendGone),
        _ => None,
    }
}

/// Counts a live entry in `lb_conntrack_entries`.
fn count_live<F: MapFamily>(report: &mut GcReport, k: &F::CtKey, v: &F::CtValue) {
    let (_, _, _, _, proto, _) = F::ct_key_fields(k);
    let (_, _, flags, _, _) = F::ct_value_fields(v);
    *report
        .entries
        .entry((F::NAME, protocol_name(proto), state_name(flags)))
        .or_default() += 1;
}

/// Deletes the doomed entries; an expired or closed one only if no packet revived it since the
/// walk (then it counts as live). Stops at the first failed delete.
fn delete<F: MapFamily>(
    name: &str,
    map: &mut HashMap<MapData, F::CtKey, F::CtValue>,
    doomed: Vec<(F::CtKey, Reason)>,
    now: u32,
    report: &mut GcReport,
) {
    for (k, reason) in doomed {
        if matches!(reason, Reason::Expired | Reason::Closed) {
            // A packet may have revived the flow since the walk.
            match map.get(&k, 0) {
                Ok(v) if F::ct_value_fields(&v).1 > now => {
                    count_live::<F>(report, &k, &v);
                    continue;
                }
                Ok(_) => {}
                Err(_) => continue, // gone already (LRU, the datapath)
            }
        }
        match map.remove(&k) {
            Ok(()) => *report.deleted.entry(reason).or_default() += 1,
            Err(MapError::KeyNotFound) => {}
            Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::ENOENT) => {}
            Err(e) => {
                tracing::warn!(map = name, error = %e, "conntrack GC: cannot delete an entry");
                report.errors += 1;
                return;
            }
        }
    }
}

/// Runs the GC of the maps pinned in `pin_dir` every `interval`, and as soon as `kick` is
/// notified (a sync deleted backends), on a blocking thread; hands each pass's report to
/// `observe` (`lb run`: the metrics).
pub fn spawn(
    pin_dir: &Path,
    interval: Duration,
    observe: impl Fn(&GcReport) + Send + 'static,
) -> anyhow::Result<Arc<tokio::sync::Notify>> {
    let gc = Gc::open(pin_dir).context("opening the conntrack maps for the GC")?;
    let kick = Arc::new(tokio::sync::Notify::new());
    let notified = Arc::clone(&kick);
    tokio::spawn(async move {
        let mut gc = Some(gc);
        // The first pass one interval after start, not at once: until the first sync the
        // pinned backends are the previous run's, and a pass racing it would judge flows by
        // them.
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                () = notified.notified() => {}
            }
            let Some(mut g) = gc.take() else { return };
            let done = tokio::task::spawn_blocking(move || {
                let report = g.pass(monotonic_secs());
                (g, report)
            })
            .await;
            let Ok((g, report)) = done else {
                tracing::error!("conntrack GC pass panicked; GC stopped");
                return;
            };
            gc = Some(g);
            observe(&report);
            if report.total_deleted() > 0 || report.errors > 0 {
                tracing::info!(
                    entries = report.total_entries(),
                    expired = report.deleted(Reason::Expired),
                    closed = report.deleted(Reason::Closed),
                    backend_gone = report.deleted(Reason::BackendGone),
                    errors = report.errors,
                    elapsed_us = report.duration.as_micros() as u64,
                    "conntrack GC pass"
                );
            } else {
                tracing::debug!(
                    entries = report.total_entries(),
                    elapsed_us = report.duration.as_micros() as u64,
                    "conntrack GC pass"
                );
            }
        }
    });
    Ok(kick)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_and_protocols_have_names() {
        assert_eq!(state_name(0), "new");
        assert_eq!(state_name(ct_flags::SEEN_REPLY), "established");
        assert_eq!(
            state_name(ct_flags::SEEN_REPLY | ct_flags::RX_CLOSING),
            "closing"
        );
        assert_eq!(protocol_name(IPPROTO_TCP), "tcp");
        assert_eq!(protocol_name(1), "other");
    }
}
