//! Re-steering connected UDP sockets whose backend left the service (issue 15, item 5).
//!
//! socket LB translates a connected UDP socket once, at connect(): its datagrams then go
//! straight to the backend (no sendmsg hook runs for a connected send, no conntrack entry
//! exists to re-balance), so a removed backend keeps receiving them until the application
//! reconnects. After every sync the daemon hands the (frontend, backend) pairs that went away
//! and those that came (back) ([`changes`], pure) to a worker thread, which, in order:
//!
//! 1. forgets the pairs that came back in `lb_udp_gone`;
//! 2. where the kernel has `bpf_sock_destroy` (6.5+), destroys the sockets socket LB pinned to
//!    a gone pair with `datapath::sockterm`'s iterator, in lb's own network namespace and in
//!    each namespace of a process in socket LB's cgroup (with CAP_SYS_ADMIN + CAP_SYS_PTRACE);
//! 3. records the gone pairs in `lb_udp_gone`, where `lb_sk_egress` (cgroup skb egress) drops
//!    the datagrams of sockets still pinned to one, so their send() fails with EPERM and the
//!    application reconnects: the fallback for older kernels and for namespaces lb cannot
//!    enter. After the destroy pass, so a socket the pass reaches sees the destroy.
//!
//! The pair, not the backend address alone: the same address may still serve another
//! frontend, whose sockets stay.
use std::{
    collections::{BTreeMap, BTreeSet},
    fs::File,
    net::IpAddr,
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
    sync::{Arc, mpsc},
    time::{Duration, Instant},
};

use crate::{
    datapath::sockterm::{DestroyKey, Destroyer, GoneMap, netns_in_cgroup},
    model::{DesiredState, Frontend, L4Addr, Proto, ServiceEntry},
    privileges,
    reconcile::ApplyReport,
    translate::incremental::Update,
};

/// What a sync changed for connected UDP sockets.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Changes {
    /// UDP (frontend, backend) pairs `old` had and `new` has not.
    pub gone: Vec<DestroyKey>,
    /// UDP pairs `new` has and `old` had not (a gone entry of theirs must go).
    pub back: Vec<DestroyKey>,
}

impl Changes {
    pub fn is_empty(&self) -> bool {
        self.gone.is_empty() && self.back.is_empty()
    }
}

/// The UDP pairs between `old` and `new`, as `lb_udp_gone` keys. A frontend whose write failed
/// (`report.errors`) kept its previous state in the maps, so its pairs are not gone.
/// Frontends are compared by address only: socket LB records the address the application
/// connected to, whatever scope served it. The whole-state reference `PairTracker` (what the
/// daemon uses, from each sync's `Update`) is tested against.
#[cfg(test)]
pub fn changes(old: &DesiredState, new: &DesiredState, report: &ApplyReport) -> Changes {
    let failed: BTreeSet<L4Addr> = report.errors.iter().map(|e| e.frontend.l4).collect();
    let pairs = |s: &DesiredState| -> BTreeSet<(L4Addr, L4Addr)> {
        s.services
            .iter()
            .filter(|(fe, _)| fe.l4.proto == Proto::Udp)
            .flat_map(|(fe, e)| e.backends.iter().map(move |b| (fe.l4, b.l4)))
            .collect()
    };
    let (before, after) = (pairs(old), pairs(new));
    let keys = |set: Vec<&(L4Addr, L4Addr)>| -> Vec<DestroyKey> {
        set.into_iter().filter_map(|(f, b)| key(*f, *b)).collect()
    };
    Changes {
        gone: keys(
            before
                .difference(&after)
                .filter(|(f, _)| !failed.contains(f))
                .collect(),
        ),
        back: keys(after.difference(&before).collect()),
    }
}

/// The UDP (frontend address, backend) pairs programmed, counted over the frontends of every
/// scope, kept up to date from each sync's `Update`, so a sync that changed a few frontends
/// compares only those (`changes` is the whole-state reference). It diffs no snapshot: the
/// `Update` is the daemon's one snapshot diff (`kube::changes`) as the translator carried
/// it to frontends; the pair counts are the state of its own that a diff cannot name.
#[derive(Debug, Default)]
pub struct PairTracker {
    counts: BTreeMap<(L4Addr, L4Addr), u32>,
}

impl PairTracker {
    /// The pairs the sync described by `update` (its result `new`, its `report`) removed and
    /// brought back. A frontend whose write failed kept its previous state in the maps, so its
    /// pairs stay as they were.
    pub fn observe(
        &mut self,
        update: &Update,
        new: &DesiredState,
        report: &ApplyReport,
    ) -> Changes {
        let failed: BTreeSet<L4Addr> = report.errors.iter().map(|e| e.frontend.l4).collect();
        let (before, touched) = match update {
            Update::Full => self.recount(new, &failed),
            Update::Changed(changed) => self.count_changed(changed, new, &failed),
        };
        let keys = |it: &mut dyn Iterator<Item = &(L4Addr, L4Addr)>| -> Vec<DestroyKey> {
            it.filter_map(|(f, b)| key(*f, *b)).collect()
        };
        Changes {
            gone: keys(
                &mut touched
                    .iter()
                    .filter(|p| before.contains(p) && !self.counts.contains_key(p)),
            ),
            back: keys(
                &mut touched
                    .iter()
                    .filter(|p| !before.contains(p) && self.counts.contains_key(p)),
            ),
        }
    }

    /// Counts every pair of `new` anew (failed frontends keep their counts); returns the
    /// pairs counted before and every pair before or after.
    fn recount(&mut self, new: &DesiredState, failed: &BTreeSet<L4Addr>) -> (Pairs, Pairs) {
        let before: Pairs = self.counts.keys().copied().collect();
        let mut counts: BTreeMap<(L4Addr, L4Addr), u32> = self
            .counts
            .iter()
            .filter(|((f, _), _)| failed.contains(f))
            .map(|(k, n)| (*k, *n))
            .collect();
        for (fe, e) in new
            .services
            .iter()
            .filter(|(fe, _)| fe.l4.proto == Proto::Udp && !failed.contains(&fe.l4))
        {
            for p in udp_pairs(fe, e) {
                *counts.entry(p).or_default() += 1;
            }
        }
        let mut touched = before.clone();
        touched.extend(counts.keys().copied());
        self.counts = counts;
        (before, touched)
    }

    /// Moves the counts of the changed UDP frontends from their old entries to their new ones;
    /// returns the pairs of those that were counted before and every pair they touched.
    fn count_changed(
        &mut self,
        changed: &BTreeMap<Frontend, Option<ServiceEntry>>,
        new: &DesiredState,
        failed: &BTreeSet<L4Addr>,
    ) -> (Pairs, Pairs) {
        let mut was = BTreeSet::new();
        let mut touched = BTreeSet::new();
        for (fe, old) in changed
            .iter()
            .filter(|(fe, _)| fe.l4.proto == Proto::Udp && !failed.contains(&fe.l4))
        {
            if let Some(o) = old {
                for p in udp_pairs(fe, o) {
                    if touched.insert(p) && self.counts.contains_key(&p) {
                        was.insert(p);
                    }
                    if let Some(n) = self.counts.get_mut(&p) {
                        *n -= 1;
                        if *n == 0 {
                            self.counts.remove(&p);
                        }
                    }
                }
            }
            if let Some(e) = new.services.get(fe) {
                for p in udp_pairs(fe, e) {
                    if touched.insert(p) && self.counts.contains_key(&p) {
                        was.insert(p);
                    }
                    *self.counts.entry(p).or_default() += 1;
                }
            }
        }
        (was, touched)
    }
}

/// (frontend address, backend) pairs.
type Pairs = BTreeSet<(L4Addr, L4Addr)>;

/// The (frontend address, backend) pairs of one frontend's entry.
fn udp_pairs(fe: &Frontend, e: &ServiceEntry) -> impl Iterator<Item = (L4Addr, L4Addr)> {
    let f = fe.l4;
    e.backends.iter().map(move |b| (f, b.l4))
}

/// The pairs `changes` reports gone.
#[cfg(test)]
pub fn gone_pairs(old: &DesiredState, new: &DesiredState, report: &ApplyReport) -> Vec<DestroyKey> {
    changes(old, new, report).gone
}

fn key(frontend: L4Addr, backend: L4Addr) -> Option<DestroyKey> {
    let mut k = DestroyKey {
        frontend_port: frontend.port,
        backend_port: backend.port,
        ..DestroyKey::default()
    };
    match (frontend.addr, backend.addr) {
        (IpAddr::V4(f), IpAddr::V4(b)) => {
            k.frontend[..4].copy_from_slice(&f.octets());
            k.backend[..4].copy_from_slice(&b.octets());
            k.family = 4;
        }
        (IpAddr::V6(f), IpAddr::V6(b)) => {
            k.frontend = f.octets();
            k.backend = b.octets();
            k.family = 6;
        }
        // socket LB never pairs families.
        _ => return None,
    }
    Some(k)
}

/// Which mechanism moves connected UDP sockets off a removed backend.
pub fn mechanism(destroy: bool) -> &'static str {
    if destroy {
        "destroyed by an iter/udp program (bpf_sock_destroy); where that cannot reach, their \
         datagrams are dropped at cgroup egress (send() fails with EPERM)"
    } else {
        "their datagrams are dropped at cgroup egress (send() fails with EPERM; no \
         bpf_sock_destroy)"
    }
}

/// The worker thread; changes are applied in the order the syncs happened.
pub struct Resteer {
    tx: mpsc::Sender<Changes>,
}

/// Where each pass is reported: its duration, the sockets it destroyed, and whether it walked
/// every namespace (`lb run`: the metrics' `udp` family).
pub type PassObserver = Arc<dyn Fn(Duration, u64, bool) + Send + Sync>;

impl Resteer {
    /// Starts the worker: `gone` is the datapath's `lb_udp_gone`; the iterator is loaded where
    /// the kernel can (`LB_NO_SOCK_DESTROY=1` leaves it out, for tests of the fallback).
    /// `cgroup`: socket LB's cgroup, whose processes' namespaces each pass walks (with
    /// CAP_SYS_ADMIN and CAP_SYS_PTRACE; else lb's own namespace only).
    pub fn start(
        pin_dir: &Path,
        cgroup: PathBuf,
        gone: GoneMap,
        observe: PassObserver,
    ) -> Option<Self> {
        let destroyer = if std::env::var_os("LB_NO_SOCK_DESTROY").is_some_and(|v| v == "1") {
            tracing::info!("LB_NO_SOCK_DESTROY=1: no socket destroy iterator");
            None
        } else {
            match Destroyer::load(pin_dir) {
                Ok(d) => Some(d),
                Err(e) => {
                    tracing::info!(
                        reason = format!("{e:#}"),
                        "no socket destroy iterator (bpf_sock_destroy needs 6.5+)"
                    );
                    None
                }
            }
        };
        // Other processes' namespaces (pods') need setns and ptrace access; without them the
        // passes walk lb's own namespace only (host-network processes).
        let other_netns =
            privileges::has_all(&[privileges::CAP_SYS_ADMIN, privileges::CAP_SYS_PTRACE]);
        tracing::info!(
            udp_resteer = mechanism(destroy_loaded(&destroyer)),
            netns = match (&destroyer, other_netns) {
                (None, _) => "all (cgroup egress)",
                (Some(_), true) => "lb's and those of the processes in socket LB's cgroup",
                (Some(_), false) => {
                    "destroyed in lb's own only: other network namespaces (pods) need \
                     CAP_SYS_ADMIN and CAP_SYS_PTRACE"
                }
            },
            "connected UDP re-steering"
        );
        let (tx, rx) = mpsc::channel::<Changes>();
        let cgroup = other_netns.then_some(cgroup);
        let spawned = std::thread::Builder::new()
            .name("lb-udp-resteer".into())
            .spawn(move || worker(destroyer.as_ref(), &gone, cgroup.as_deref(), &rx, &*observe));
        match spawned {
            Ok(_) => Some(Self { tx }),
            Err(e) => {
                tracing::warn!(error = %e, "cannot start the UDP re-steering thread");
                None
            }
        }
    }

    /// Queues `changes` (nothing when empty). Never blocks.
    pub fn apply(&self, changes: Changes) {
        if !changes.is_empty() {
            let _ = self.tx.send(changes);
        }
    }
}

fn destroy_loaded(d: &Option<Destroyer>) -> bool {
    d.is_some()
}

fn worker(
    destroyer: Option<&Destroyer>,
    gone: &GoneMap,
    cgroup: Option<&Path>,
    rx: &mpsc::Receiver<Changes>,
    observe: &(dyn Fn(Duration, u64, bool) + Send + Sync),
) {
    // Opened before any setns: this thread's namespace is lb's.
    let home = match File::open("/proc/thread-self/ns/net") {
        Ok(f) => f,
        Err(e) => {
            tracing::warn!(error = %e, "cannot open lb's netns; no UDP re-steering");
            return;
        }
    };
    let home_id = home.metadata().map(|m| (m.dev(), m.ino())).ok();
    let mut warned = false;
    while let Ok(changes) = rx.recv() {
        for k in &changes.back {
            if let Err(e) = gone.remove(k) {
                tracing::warn!(error = %e, "cannot update lb_udp_gone");
            }
        }
        if let Some(destroyer) = destroyer.filter(|_| !changes.gone.is_empty()) {
            let start = Instant::now();
            let (found, unreadable) = cgroup.map_or_else(|| (Vec::new(), 0), netns_in_cgroup);
            let mut netns = Vec::with_capacity(found.len() + 1);
            if let Ok(h) = home.try_clone() {
                netns.push(("lb".to_string(), h));
            }
            netns.extend(
                found
                    .into_iter()
                    .filter(|(_, f)| f.metadata().map(|m| (m.dev(), m.ino())).ok() != home_id),
            );
            let report = destroyer.pass(&changes.gone, &netns, &home);
            let elapsed = start.elapsed();
            let ok = report.failed.is_empty() && unreadable == 0;
            observe(elapsed, report.destroyed, ok);
            tracing::debug!(
                pairs = changes.gone.len(),
                netns = report.netns,
                destroyed = report.destroyed,
                elapsed_us = elapsed.as_micros() as u64,
                "UDP socket destroy pass"
            );
            if !ok && !warned {
                warned = true;
                tracing::warn!(
                    failed = ?report.failed,
                    unreadable_processes = unreadable,
                    "some network namespaces of socket LB's cgroup could not be walked: their \
                     connected UDP sockets are moved by the cgroup egress drop instead; logged \
                     once"
                );
            }
        }
        for k in &changes.gone {
            if let Err(e) = gone.insert(k) {
                tracing::warn!(error = %e, "cannot update lb_udp_gone");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, Ipv6Addr};

    use super::*;
    use crate::model::{Backend, Frontend, Scope, ServiceEntry};

    fn l4(addr: IpAddr, port: u16, proto: Proto) -> L4Addr {
        L4Addr { addr, port, proto }
    }

    fn state(services: &[(L4Addr, Scope, &[L4Addr])]) -> DesiredState {
        let mut s = DesiredState::default();
        for (fe, scope, backends) in services {
            s.services.insert(
                Frontend {
                    l4: *fe,
                    scope: *scope,
                },
                ServiceEntry {
                    backends: backends.iter().map(|b| Backend::active(*b)).collect(),
                    ..ServiceEntry::default()
                },
            );
        }
        s
    }

    const V4: IpAddr = IpAddr::V4(Ipv4Addr::new(198, 19, 0, 10));
    const B1: IpAddr = IpAddr::V4(Ipv4Addr::new(198, 18, 11, 2));
    const B2: IpAddr = IpAddr::V4(Ipv4Addr::new(198, 18, 12, 2));

    /// The `Update` that turns `old` into `new`: every frontend whose entry differs, with its
    /// old entry.
    fn update_of(old: &DesiredState, new: &DesiredState) -> Update {
        let mut changed = BTreeMap::new();
        for fe in old.services.keys().chain(new.services.keys()) {
            if old.services.get(fe) != new.services.get(fe) {
                changed.insert(*fe, old.services.get(fe).cloned());
            }
        }
        Update::Changed(changed)
    }

    fn sorted(mut v: Vec<DestroyKey>) -> Vec<DestroyKey> {
        v.sort();
        v
    }

    /// The tracker, fed each sync's `Update`, reports what comparing whole states does, over a
    /// sequence with two scopes sharing a pair, TCP beside UDP and a full update in between.
    #[test]
    fn the_pair_tracker_agrees_with_whole_state_changes() {
        let udp = l4(V4, 53, Proto::Udp);
        let other = l4(V4, 5353, Proto::Udp);
        let tcp = l4(V4, 80, Proto::Tcp);
        let (b1, b2) = (l4(B1, 8080, Proto::Udp), l4(B2, 8080, Proto::Udp));
        let b1t = l4(B1, 8080, Proto::Tcp);
        let steps = [
            state(&[
                (udp, Scope::External, &[b1, b2]),
                (tcp, Scope::External, &[b1t]),
            ]),
            state(&[
                (udp, Scope::External, &[b1, b2]),
                (udp, Scope::Internal, &[b1]),
            ]),
            state(&[
                (udp, Scope::Internal, &[b1]),
                (other, Scope::External, &[b2]),
            ]),
            state(&[
                (udp, Scope::Internal, &[b2]),
                (other, Scope::External, &[b2]),
            ]),
            state(&[]),
            state(&[(other, Scope::External, &[b1, b2])]),
        ];
        let report = ApplyReport::default();
        let mut tracker = PairTracker::default();
        let first = tracker.observe(&Update::Full, &steps[0], &report);
        assert_eq!(
            sorted(first.back),
            sorted(changes(&state(&[]), &steps[0], &report).back)
        );
        for (i, w) in steps.windows(2).enumerate() {
            let update = if i == 2 {
                Update::Full
            } else {
                update_of(&w[0], &w[1])
            };
            let got = tracker.observe(&update, &w[1], &report);
            let want = changes(&w[0], &w[1], &report);
            assert_eq!(sorted(got.gone), sorted(want.gone), "step {i}: gone");
            assert_eq!(sorted(got.back), sorted(want.back), "step {i}: back");
        }
    }

    #[test]
    fn a_backend_leaving_a_udp_frontend_is_one_pair() {
        let fe = l4(V4, 53, Proto::Udp);
        let (b1, b2) = (l4(B1, 8080, Proto::Udp), l4(B2, 8080, Proto::Udp));
        let old = state(&[(fe, Scope::External, &[b1, b2])]);
        let new = state(&[(fe, Scope::External, &[b2])]);
        let pairs = gone_pairs(&old, &new, &ApplyReport::default());
        assert_eq!(pairs.len(), 1);
        let p = pairs[0];
        assert_eq!((p.family, p.frontend_port, p.backend_port), (4, 53, 8080));
        assert_eq!(&p.frontend[..4], &[198, 19, 0, 10]);
        assert_eq!(&p.backend[..4], &[198, 18, 11, 2]);
        assert!(
            p.frontend[4..]
                .iter()
                .chain(&p.backend[4..])
                .all(|&b| b == 0)
        );
    }

    #[test]
    fn only_udp_pairs_that_are_really_gone() {
        let udp = l4(V4, 53, Proto::Udp);
        let other = l4(V4, 5353, Proto::Udp);
        let tcp = l4(V4, 80, Proto::Tcp);
        let b1 = l4(B1, 8080, Proto::Udp);
        let b1t = l4(B1, 8080, Proto::Tcp);
        let old = state(&[
            (udp, Scope::External, &[b1]),
            (other, Scope::External, &[b1]),
            (tcp, Scope::External, &[b1t]),
        ]);
        // b1 leaves port 53 only; it still serves 5353 (whose sockets stay). TCP is not
        // this mechanism's.
        let new = state(&[(other, Scope::External, &[b1])]);
        let pairs = gone_pairs(&old, &new, &ApplyReport::default());
        assert_eq!(pairs.len(), 1);
        assert_eq!(pairs[0].frontend_port, 53);
        // A two-scope frontend that keeps the backend in one scope keeps the pair.
        let old = state(&[(udp, Scope::External, &[b1]), (udp, Scope::Internal, &[b1])]);
        let new = state(&[(udp, Scope::Internal, &[b1])]);
        assert!(gone_pairs(&old, &new, &ApplyReport::default()).is_empty());
        // Nothing changed: nothing gone.
        assert!(changes(&old, &old, &ApplyReport::default()).is_empty());
        // A pair that comes back is reported as such (its gone entry must go).
        let c = changes(&state(&[]), &new, &ApplyReport::default());
        assert!(c.gone.is_empty());
        assert_eq!(c.back.len(), 1);
    }

    #[test]
    fn a_frontend_whose_write_failed_keeps_its_pairs() {
        let fe = l4(V4, 53, Proto::Udp);
        let b1 = l4(B1, 8080, Proto::Udp);
        let old = state(&[(fe, Scope::External, &[b1])]);
        let new = state(&[]);
        let report = ApplyReport {
            errors: vec![crate::reconcile::ServiceError {
                frontend: Frontend {
                    l4: fe,
                    scope: Scope::External,
                },
                service: String::new(),
                error: "full".into(),
                full_map: None,
            }],
            ..ApplyReport::default()
        };
        assert!(gone_pairs(&old, &new, &report).is_empty());
        assert_eq!(gone_pairs(&old, &new, &ApplyReport::default()).len(), 1);
    }

    #[test]
    fn ipv6_pairs_carry_the_whole_address() {
        let v6 = IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 0xffff, 0, 0, 0, 0, 0x10));
        let b = IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 0, 0x11, 0, 0, 0, 2));
        let fe = l4(v6, 53, Proto::Udp);
        let old = state(&[(fe, Scope::External, &[l4(b, 8080, Proto::Udp)])]);
        let pairs = gone_pairs(&old, &state(&[]), &ApplyReport::default());
        assert_eq!(pairs.len(), 1);
        assert_eq!(pairs[0].family, 6);
        assert_eq!(pairs[0].backend[15], 2);
        assert_eq!(pairs[0].frontend[15], 0x10);
    }
}
