//! The packet programs as BPF_PROG_TEST_RUN sees them: the real loader with private maps,
//! programmed by the real reconciler, and one call that runs a frame through any of the tc and
//! XDP programs. Needs root.
use std::net::IpAddr;

use aya::programs::{SchedClassifier, TestRun as _, TestRunOptions, Xdp};
use lb::{
    datapath::load::{Datapath, LoadOptions},
    datapath::maps::BpfMaps,
    model::DesiredState,
    node::{NodeFacts, NodeFactsArgs},
    reconcile::Reconciler,
};
use lb_common::prog_names;

/// The packet programs, each with the context type BPF_PROG_TEST_RUN gives it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Prog {
    Xdp,
    TcIngress,
    TcPod,
    TcEgress,
}

impl Prog {
    /// In the order a frame meets them on a node: XDP before tc ingress on the same device (XDP
    /// leaves to tc what it cannot finish), then the pod hook, then egress.
    pub const ALL: [Prog; 4] = [Prog::Xdp, Prog::TcIngress, Prog::TcPod, Prog::TcEgress];

    pub fn name(self) -> &'static str {
        match self {
            Prog::Xdp => prog_names::XDP,
            Prog::TcIngress => prog_names::TC_INGRESS,
            Prog::TcPod => prog_names::TC_POD,
            Prog::TcEgress => prog_names::TC_EGRESS,
        }
    }
}

/// tc verdicts (`TC_ACT_*`).
pub const TC_ACT_OK: u32 = 0;
pub const TC_ACT_SHOT: u32 = 2;
pub const TC_ACT_REDIRECT: u32 = 7;
/// XDP verdicts (`XDP_*`).
pub const XDP_DROP: u32 = 1;
pub const XDP_PASS: u32 = 2;
pub const XDP_TX: u32 = 3;
pub const XDP_REDIRECT: u32 = 4;

/// The largest frame a run may leave: a reject reply grows the packet (and pads it to whole
/// checksum blocks on the way), so the output buffer is not sized from the input.
const OUT_MAX: usize = 4096;

/// A loaded datapath whose maps hold `desired`, optionally this node's facts, and the
/// `--service-cidr` ranges.
pub struct Loaded {
    pub datapath: Datapath,
    /// Owns the service maps: they live as long as it does.
    pub _reconciler: Reconciler<BpfMaps>,
}

impl Loaded {
    pub fn new(
        desired: &DesiredState,
        facts: Option<&NodeFactsArgs>,
        service_cidrs: &[(IpAddr, u8)],
    ) -> Self {
        let mut datapath = Datapath::load(&LoadOptions::default()).expect("load datapath (root?)");
        let maps = datapath.take_lb_maps().expect("maps");
        let mut reconciler = Reconciler::new(maps).expect("reconciler");
        let report = reconciler.apply(desired);
        assert!(report.errors.is_empty(), "{:?}", report.errors);
        if let Some(args) = facts {
            let facts = NodeFacts::resolve(args, None, Vec::new);
            datapath.write_node_facts(&facts).expect("write node facts");
        }
        datapath
            .set_service_cidrs(service_cidrs)
            .expect("service CIDRs");
        Self {
            datapath,
            _reconciler: reconciler,
        }
    }

    /// Runs `pkt` through `prog`: its verdict and the frame it leaves.
    pub fn run(
        &mut self,
        prog: Prog,
        pkt: &[u8],
    ) -> Result<(u32, Vec<u8>), aya::programs::ProgramError> {
        let mut out = vec![0u8; OUT_MAX.max(pkt.len() + 256)];
        let mut opts = TestRunOptions::new();
        opts.data_in = Some(pkt);
        opts.data_out = Some(&mut out);
        let program = self
            .datapath
            .ebpf_mut()
            .program_mut(prog.name())
            .expect("program");
        let result = if prog == Prog::Xdp {
            let p: &mut Xdp = program.try_into().expect("xdp");
            p.test_run(opts)?
        } else {
            let p: &mut SchedClassifier = program.try_into().expect("classifier");
            p.test_run(opts)?
        };
        out.truncate(result.data_size_out as usize);
        Ok((result.return_value, out))
    }
}

/// Moves the calling thread into a network namespace of its own (gone with the thread: nothing
/// to clean up) in which `backends` are reachable: a veth pair whose first end has a /24 or /64
/// around each backend and a permanent neighbour entry for it, forwarding on. BPF_PROG_TEST_RUN
/// runs on this namespace's loopback, so a program's FIB lookup for a backend then resolves
/// (next hop and MACs known) and its forwarding path (XDP_REDIRECT, `bpf_redirect`) runs.
pub fn enter_routed_netns(backends: &[IpAddr]) {
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).expect("unshare(CLONE_NEWNET)");
    let ip = |args: &[&str]| {
        // A child forked from this thread starts in its namespace.
        let status = std::process::Command::new("ip")
            .args(args)
            .status()
            .expect("run ip");
        assert!(status.success(), "ip {}", args.join(" "));
    };
    ip(&["link", "set", "lo", "up"]);
    ip(&["link", "add", "fz0", "type", "veth", "peer", "name", "fz1"]);
    ip(&["link", "set", "fz0", "up"]);
    ip(&["link", "set", "fz1", "up"]);
    for (i, b) in backends.iter().enumerate() {
        let (local, mac) = match b {
            IpAddr::V4(a) => {
                let [x, y, z, _] = a.octets();
                (
                    format!("{x}.{y}.{z}.1/24"),
                    format!("02:00:00:00:04:{i:02x}"),
                )
            }
            IpAddr::V6(a) => {
                let s = a.segments();
                let local = std::net::Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 1);
                (format!("{local}/64"), format!("02:00:00:00:06:{i:02x}"))
            }
        };
        let mut add = vec!["addr", "add", &local, "dev", "fz0"];
        if b.is_ipv6() {
            add.push("nodad");
        }
        ip(&add);
        let addr = b.to_string();
        ip(&[
            "neigh",
            "replace",
            &addr,
            "lladdr",
            &mac,
            "dev",
            "fz0",
            "nud",
            "permanent",
        ]);
    }
    // The FIB helper answers only for a packet whose device forwards.
    for knob in ["ipv4/conf/all/forwarding", "ipv6/conf/all/forwarding"] {
        std::fs::write(format!("/proc/sys/net/{knob}"), "1").expect(knob);
    }
}

/// The fields of a conntrack value both families share.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CtView {
    pub backend_id: u32,
    pub rev_nat_id: u32,
    pub expires: u32,
    pub flags: u16,
    pub nat_port: u16,
}

impl Loaded {
    /// The conntrack entry under `saddr:sport -> daddr:dport` (`proto`, direction `dir`).
    pub fn ct_entry(
        &mut self,
        (saddr, sport): (IpAddr, u16),
        (daddr, dport): (IpAddr, u16),
        proto: u8,
        dir: u8,
    ) -> Option<CtView> {
        use aya::maps::HashMap;
        use lb_common::{Ct4Key, Ct4Value, Ct6Key, Ct6Value, map_names};
        let ebpf = self.datapath.ebpf_mut();
        macro_rules! view {
            ($v:expr) => {
                $v.ok().map(|v| CtView {
                    backend_id: v.backend_id,
                    rev_nat_id: v.rev_nat_id,
                    expires: v.expires,
                    flags: v.flags,
                    nat_port: v.nat_port,
                })
            };
        }
        match (saddr, daddr) {
            (IpAddr::V4(s), IpAddr::V4(d)) => {
                let key = Ct4Key {
                    saddr: s.octets(),
                    daddr: d.octets(),
                    sport,
                    dport,
                    proto,
                    dir,
                    pad: [0; 2],
                };
                let name = if proto == lb_common::IPPROTO_TCP {
                    map_names::CT_TCP4
                } else {
                    map_names::CT_ANY4
                };
                let map: HashMap<_, Ct4Key, Ct4Value> =
                    HashMap::try_from(ebpf.map(name).expect("ct4")).expect("ct4");
                view!(map.get(&key, 0))
            }
            (IpAddr::V6(s), IpAddr::V6(d)) => {
                let key = Ct6Key {
                    saddr: s.octets(),
                    daddr: d.octets(),
                    sport,
                    dport,
                    proto,
                    dir,
                    pad: [0; 2],
                };
                let name = if proto == lb_common::IPPROTO_TCP {
                    map_names::CT_TCP6
                } else {
                    map_names::CT_ANY6
                };
                let map: HashMap<_, Ct6Key, Ct6Value> =
                    HashMap::try_from(ebpf.map(name).expect("ct6")).expect("ct6");
                view!(map.get(&key, 0))
            }
            _ => None,
        }
    }
}
