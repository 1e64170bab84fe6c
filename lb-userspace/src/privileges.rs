//! The capabilities `lb run` needs, checked before it binds, creates or loads anything, so a
//! container started without one fails at once with the list of what is missing instead of
//! half-way (a pin dir made, programs loaded, nothing attached).
//!
//! What each is for (measured on 6.18 by running `lb run` with a bounding set of exactly these,
//! first start and restart: it programs, attaches tc and socket LB, and adopts; without any
//! one of them it fails as the table says):
//!
//! | capability | needed for |
//! |---|---|
//! | `CAP_BPF` (5.8+; or `CAP_SYS_ADMIN`) | `bpf(2)`: creating maps, loading BTF and programs, pinning |
//! | `CAP_PERFMON` (5.8+; or `CAP_SYS_ADMIN`) | the verifier's trusted mode: without it the socket programs are refused (pointer arithmetic under spectre hardening) |
//! | `CAP_NET_ADMIN` | loading tc, XDP and cgroup sock_addr programs (network program types) and attaching them: tcx/XDP/cgroup links, and the netlink tc filters used before 6.6, where `CAP_SYS_ADMIN` does not stand in |
//!
//! | `CAP_SYS_ADMIN` + `CAP_SYS_PTRACE` (optional) | re-steering connected UDP sockets in other network namespaces (pods): `setns` into them, and opening other processes' `/proc/PID/ns/net`; without them only lb's own namespace is walked (`reconcile/resteer.rs`, logged at start) |
//!
//! Before 5.8 (no CAP_BPF) `CAP_SYS_ADMIN` is what `bpf(2)` checks, so it is required there.
//! Not needed by `lb run`: `CAP_SYS_ADMIN` on 5.8+ (lb never opens programs or links by id;
//! only `lb status`'s program listing walks ids, which needs it), `CAP_SYS_RESOURCE` on 5.11+
//! (memory is charged to the cgroup; before 5.11 the locked-memory limit must be raised, which
//! lb tries and warns about) and mounting bpffs (the DaemonSet's init container does that).
use anyhow::bail;

/// One capability, by its number in `linux/capability.h`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cap {
    pub name: &'static str,
    pub bit: u32,
}

pub const CAP_NET_ADMIN: Cap = Cap {
    name: "CAP_NET_ADMIN",
    bit: 12,
};
pub const CAP_SYS_PTRACE: Cap = Cap {
    name: "CAP_SYS_PTRACE",
    bit: 19,
};
pub const CAP_SYS_ADMIN: Cap = Cap {
    name: "CAP_SYS_ADMIN",
    bit: 21,
};
pub const CAP_PERFMON: Cap = Cap {
    name: "CAP_PERFMON",
    bit: 38,
};
pub const CAP_BPF: Cap = Cap {
    name: "CAP_BPF",
    bit: 39,
};

/// A requirement: any one of `caps`, for `reason`.
#[derive(Clone, Copy, Debug)]
pub struct Need {
    pub caps: &'static [Cap],
    pub reason: &'static str,
}

/// What `lb run` needs on a kernel that knows capabilities up to `last_cap`
/// (`/proc/sys/kernel/cap_last_cap`): before 5.8 (no CAP_BPF) CAP_SYS_ADMIN covers bpf(2).
pub fn needs(last_cap: u32) -> Vec<Need> {
    let bpf = if last_cap >= CAP_BPF.bit {
        [
            Need {
                caps: &[CAP_BPF, CAP_SYS_ADMIN],
                reason: "bpf(2): maps, BTF, programs, pins",
            },
            Need {
                caps: &[CAP_PERFMON, CAP_SYS_ADMIN],
                reason: "the verifier's trusted mode the socket programs need",
            },
        ]
        .to_vec()
    } else {
        vec![Need {
            caps: &[CAP_SYS_ADMIN],
            reason: "bpf(2) before 5.8",
        }]
    };
    let mut needs = bpf;
    needs.push(Need {
        caps: &[CAP_NET_ADMIN],
        reason: "loading and attaching tc, XDP and cgroup socket programs",
    });
    needs
}

/// The requirements `effective` (a CapEff mask) does not meet.
pub fn missing(effective: u64, needs: &[Need]) -> Vec<Need> {
    let has = |c: &Cap| effective & (1u64 << c.bit) != 0;
    needs
        .iter()
        .filter(|n| !n.caps.iter().any(has))
        .copied()
        .collect()
}

/// The effective capability mask (`CapEff`) from a `/proc/<pid>/status` text.
pub fn parse_cap_eff(status: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
}

/// Whether this process has every capability of `caps` (false if it cannot tell).
pub fn has_all(caps: &[Cap]) -> bool {
    let effective = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| parse_cap_eff(&s));
    effective.is_some_and(|e| caps.iter().all(|c| e & (1u64 << c.bit) != 0))
}

/// Fails, naming every missing capability and what it is for, unless this process has all
/// `lb run` needs.
pub fn check() -> anyhow::Result<()> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    let Some(effective) = parse_cap_eff(&status) else {
        bail!("no CapEff line in /proc/self/status");
    };
    // Without the file (very old kernels), assume CAP_BPF does not exist.
    let last_cap = std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(CAP_BPF.bit - 1);
    let missing = missing(effective, &needs(last_cap));
    if missing.is_empty() {
        return Ok(());
    }
    let list: Vec<String> = missing
        .iter()
        .map(|n| {
            let names: Vec<&str> = n.caps.iter().map(|c| c.name).collect();
            format!("{} ({})", names.join(" or "), n.reason)
        })
        .collect();
    bail!(
        "missing capabilities: {}; nothing was changed (grant them, e.g. the DaemonSet's \
         securityContext.capabilities.add, or run as root)",
        list.join("; ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: u64 = (1 << 40) - 1;

    fn names(missing: &[Need]) -> Vec<&'static str> {
        missing.iter().map(|n| n.caps[0].name).collect()
    }

    #[test]
    fn root_needs_nothing_more() {
        assert!(missing(ALL, &needs(40)).is_empty());
        assert!(missing(ALL, &needs(37)).is_empty());
    }

    #[test]
    fn sys_admin_stands_in_for_bpf_and_perfmon() {
        let caps = 1 << CAP_SYS_ADMIN.bit | 1 << CAP_NET_ADMIN.bit;
        assert!(missing(caps, &needs(40)).is_empty());
    }

    #[test]
    fn each_missing_capability_is_named() {
        let without = |c: Cap| ALL & !(1 << c.bit);
        assert_eq!(
            names(&missing(without(CAP_NET_ADMIN), &needs(40))),
            ["CAP_NET_ADMIN"]
        );
        // CAP_SYS_ADMIN is not needed where CAP_BPF and CAP_PERFMON exist...
        assert!(missing(without(CAP_SYS_ADMIN), &needs(40)).is_empty());
        let minimal = 1 << CAP_BPF.bit | 1 << CAP_PERFMON.bit | 1 << CAP_NET_ADMIN.bit;
        assert!(missing(minimal, &needs(40)).is_empty());
        let none = missing(0, &needs(40));
        assert_eq!(names(&none), ["CAP_BPF", "CAP_PERFMON", "CAP_NET_ADMIN"]);
        // ...but is before 5.8, which has no CAP_BPF to ask for.
        assert_eq!(names(&missing(minimal, &needs(37))), ["CAP_SYS_ADMIN"]);
    }

    #[test]
    fn reads_cap_eff() {
        let status = "Name:\tlb\nCapInh:\t0000000000000000\nCapEff:\t000001fffeffffff\n";
        assert_eq!(parse_cap_eff(status), Some(0x1fffeffffff));
        assert_eq!(parse_cap_eff("Name: lb\n"), None);
    }
}
