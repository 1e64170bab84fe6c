//! What each service address holds beside its frontends: the ClusterIP set (REJECT of an
//! unknown port) and the echo table (what a ping gets), kept after the masters.
use std::{collections::BTreeSet, net::IpAddr};

use lb_common::{EchoValue, echo, svc_flags};

use super::{ApplyReport, Installed, Reconciler, at_addr, cluster_ip_counts, fam_of};
use crate::{
    datapath::maps::LbMaps,
    model::{Frontend, Scope},
};

impl<M: LbMaps> Reconciler<M> {
    /// Brings `addr`'s echo entry and ClusterIP set entry in line with the frontends installed
    /// at it.
    pub(super) fn sync_address(&mut self, addr: IpAddr, report: &mut ApplyReport) {
        let want = echo_at(at_addr(&self.services, addr));
        self.set_echo(addr, want, report);
        let n = at_addr(&self.services, addr)
            .filter(|(_, i)| i.master.flags & svc_flags::CLUSTER_IP != 0)
            .count() as u32;
        if n == 0 && self.cluster_ips.contains_key(&addr) {
            self.del_cluster_ip(addr, report);
        } else if n > 0 && self.cluster_ips.get(&addr) != Some(&n) {
            self.put_cluster_ip(addr, n, report);
        }
    }

    /// Writes `addr` into the ClusterIP set. A failure only costs the unknown-port REJECT for
    /// that address (its frontends work), so it is logged, and retried by the next apply.
    pub(super) fn put_cluster_ip(
        &mut self,
        addr: IpAddr,
        frontends: u32,
        report: &mut ApplyReport,
    ) {
        match self.maps.put_cluster_ip(addr, frontends) {
            Ok(()) => {
                report.writes += 1;
                if self.cluster_ips.insert(addr, frontends).is_none() {
                    self.counts.cluster_ips[fam_of(&addr)] += 1;
                }
            }
            Err(e) => {
                self.degraded = true;
                tracing::warn!(%addr, error = %e, "cannot write ClusterIP entry")
            }
        }
    }

    /// Deletes `addr` from the ClusterIP set; a failure is logged, and retried by the next
    /// apply.
    pub(super) fn del_cluster_ip(&mut self, addr: IpAddr, report: &mut ApplyReport) {
        match self.maps.del_cluster_ip(addr) {
            Ok(()) => {
                report.deletes += 1;
                self.cluster_ips.remove(&addr);
                self.counts.cluster_ips[fam_of(&addr)] -= 1;
            }
            Err(e) => {
                self.degraded = true;
                tracing::warn!(%addr, error = %e, "cannot delete ClusterIP entry")
            }
        }
    }

    /// Makes the ClusterIP set match the frontends installed now: addresses without any are
    /// removed (their last frontend is gone), counts are brought up to date.
    pub(super) fn sync_cluster_ips(&mut self, report: &mut ApplyReport) {
        let installed = cluster_ip_counts(self.services.iter().map(|(fe, i)| (fe, i.master.flags)));
        let stale: Vec<IpAddr> = self
            .cluster_ips
            .keys()
            .filter(|a| !installed.contains_key(a))
            .copied()
            .collect();
        for addr in stale {
            self.del_cluster_ip(addr, report);
        }
        for (addr, n) in installed {
            if self.cluster_ips.get(&addr) != Some(&n) {
                self.put_cluster_ip(addr, n, report);
            }
        }
    }

    /// Makes the echo table match the frontends installed now.
    pub(super) fn sync_echo(&mut self, report: &mut ApplyReport) {
        let addrs: BTreeSet<IpAddr> = self
            .services
            .keys()
            .map(|fe| fe.l4.addr)
            .chain(self.echo.keys().copied())
            .collect();
        for addr in addrs {
            let want = echo_at(at_addr(&self.services, addr));
            self.set_echo(addr, want, report);
        }
    }

    /// Writes (or, with `None`, deletes) `addr`'s echo entry where it differs. A failure only
    /// costs the ping answer, so it is logged, and retried by the next full apply.
    pub(super) fn set_echo(
        &mut self,
        addr: IpAddr,
        want: Option<EchoValue>,
        report: &mut ApplyReport,
    ) {
        if self.echo.get(&addr) == want.as_ref() {
            return;
        }
        let f = fam_of(&addr);
        let result = match want {
            Some(v) => self.maps.put_echo(addr, v),
            None => self.maps.del_echo(addr),
        };
        match (result, want) {
            (Ok(()), Some(v)) => {
                report.writes += 1;
                if self.echo.insert(addr, v).is_none() {
                    self.counts.echo[f] += 1;
                }
            }
            (Ok(()), None) => {
                report.deletes += 1;
                self.echo.remove(&addr);
                self.counts.echo[f] -= 1;
            }
            (Err(e), _) => {
                self.degraded = true;
                tracing::warn!(%addr, error = %e, "cannot write echo entry");
            }
        }
    }
}

/// What an echo request to an address gets, from the masters installed at it (`at_addr`):
/// per client scope, answered while any ClusterIP, external or LoadBalancer frontend there has
/// a usable backend, else dropped where one drops its traffic (endpoints only elsewhere), else
/// rejected. A frontend with source ranges takes no part (its traffic depends on the source),
/// nor does one at an address of this node (`LOCAL_ADDR`: an external IP on the node, which
/// answers ping itself, whatever the service's endpoints). `None`: the address has no such
/// frontend.
pub(super) fn echo_at<'a>(
    at: impl Iterator<Item = (&'a Frontend, &'a Installed)>,
) -> Option<EchoValue> {
    const SERVICE_ADDR: u16 =
        svc_flags::CLUSTER_IP | svc_flags::EXTERNAL_IP | svc_flags::LOAD_BALANCER;
    // Strongest first: one answering frontend makes the address answer.
    let rank = |v: u8| match v {
        echo::ANSWER => 3,
        echo::DROP => 2,
        echo::REJECT => 1,
        _ => 0,
    };
    let merge = |have: &mut u8, v: u8| {
        if rank(v) > rank(*have) {
            *have = v;
        }
    };
    let mut out = EchoValue::default();
    for (fe, i) in at {
        let m = &i.master;
        if m.flags & SERVICE_ADDR == 0
            || m.flags & (svc_flags::SOURCE_RANGES | svc_flags::LOCAL_ADDR) != 0
        {
            continue;
        }
        let v = if m.count > 0 {
            echo::ANSWER
        } else if m.flags & svc_flags::EMPTY_DROP != 0 {
            echo::DROP
        } else {
            echo::REJECT
        };
        match fe.scope {
            Scope::Internal => merge(&mut out.internal, v),
            Scope::External => {
                merge(&mut out.external, v);
                // One scope serves both kinds of client.
                if m.flags & svc_flags::TWO_SCOPES == 0 {
                    merge(&mut out.internal, v);
                }
            }
        }
    }
    (out != EchoValue::default()).then_some(out)
}
