//! Network-namespace primitives shared by the testbed, lb-demo and lb-bench: the `ip` runner,
//! entering a netns in a child before exec (so the mount namespace, `/sys/fs/bpf` and
//! `/sys/fs/cgroup` stay the caller's, unlike with `ip netns exec`), and running a closure on a
//! thread inside a netns.
use std::{
    fs::{File, OpenOptions},
    io,
    os::{
        fd::{AsRawFd as _, FromRawFd as _, RawFd},
        unix::process::CommandExt as _,
    },
    path::{Path, PathBuf},
    process::{Command, Stdio},
    thread,
};

use anyhow::{Context as _, bail};

/// The file of netns `ns`: a name in `/run/netns/`, or an absolute path as is.
pub fn ns_path(ns: &str) -> PathBuf {
    if ns.starts_with('/') {
        PathBuf::from(ns)
    } else {
        Path::new("/run/netns").join(ns)
    }
}

fn ip_binary() -> &'static str {
    if Path::new("/usr/sbin/ip").exists() {
        "/usr/sbin/ip"
    } else {
        "ip"
    }
}

/// Runs `ip ARGS…`; a non-zero exit is an error carrying stderr.
pub fn ip(args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new(ip_binary())
        .args(args)
        .stdin(Stdio::null())
        .output()
        .context("run ip")?;
    if !out.status.success() {
        bail!(
            "ip {}: {}: {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Runs `f` on a short-lived thread that entered netns `ns` first (interface names, netlink and
/// network sysctls then resolve in that namespace); the caller's thread is untouched.
pub fn in_netns<T: Send>(
    ns: &str,
    f: impl FnOnce() -> anyhow::Result<T> + Send,
) -> anyhow::Result<T> {
    let path = ns_path(ns);
    let file = File::open(&path).with_context(|| format!("open netns {}", path.display()))?;
    thread::scope(|s| {
        s.spawn(|| {
            nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET)
                .with_context(|| format!("setns {ns}"))?;
            f()
        })
        .join()
        .unwrap_or_else(|_| Err(anyhow::anyhow!("thread in netns {ns} panicked")))
    })
}

/// File descriptors a child needs to enter a netns and a cgroup, opened before fork.
pub struct Enter {
    netns: File,
    cgroup_procs: Option<File>,
}

impl Enter {
    /// Opens netns `ns` (see [`ns_path`]) and, if given, `cgroup`'s `cgroup.procs`.
    pub fn open(ns: &str, cgroup: Option<&Path>) -> anyhow::Result<Self> {
        let path = ns_path(ns);
        let netns = File::open(&path).with_context(|| format!("open netns {}", path.display()))?;
        let cgroup_procs = cgroup
            .map(|cg| {
                let procs = cg.join("cgroup.procs");
                OpenOptions::new()
                    .write(true)
                    .open(&procs)
                    .with_context(|| format!("open {}", procs.display()))
            })
            .transpose()?;
        Ok(Self {
            netns,
            cgroup_procs,
        })
    }

    /// Adds the pre_exec hook that moves the child into the cgroup, then into the netns.
    /// `self` must stay alive until the command was spawned.
    pub fn install(&self, cmd: &mut Command) {
        let netns: RawFd = self.netns.as_raw_fd();
        let procs: Option<RawFd> = self.cgroup_procs.as_ref().map(|f| f.as_raw_fd());
        let hook = move || -> io::Result<()> {
            if let Some(fd) = procs {
                // SAFETY: write(2) is async-signal-safe; fd is open (inherited across fork) and
                // the buffer is a static byte string.
                if unsafe { libc::write(fd, b"0".as_ptr().cast(), 1) } != 1 {
                    return Err(io::Error::last_os_error());
                }
            }
            // SAFETY: setns(2) is async-signal-safe; fd is an open netns file.
            if unsafe { libc::setns(netns, libc::CLONE_NEWNET) } != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        };
        // SAFETY: the hook only makes async-signal-safe system calls and does not allocate.
        unsafe {
            cmd.pre_exec(hook);
        }
    }
}

/// Turns GRO on or off on interface `ifname` of the calling thread's netns (run it inside the
/// target netns with [`in_netns`]), as `ethtool -K IF gro on|off` does: SIOCETHTOOL with
/// ETHTOOL_SGRO. On a veth, GRO on enables NAPI on its receive side, which an XDP_REDIRECT
/// into the veth's peer needs (there is no `ethtool` binary on these machines).
pub fn set_gro(ifname: &str, on: bool) -> anyhow::Result<()> {
    const IFNAMSIZ: usize = 16;
    const ETHTOOL_SGRO: u32 = 0x2c;
    /// `struct ethtool_value` (linux/ethtool.h).
    #[repr(C)]
    struct EthtoolValue {
        cmd: u32,
        data: u32,
    }
    /// `struct ifreq` with the `ifr_data` member of its union (40 bytes on 64-bit).
    #[repr(C)]
    struct IfreqData {
        name: [u8; IFNAMSIZ],
        data: *mut EthtoolValue,
        _pad: [u8; 16],
    }
    let bytes = ifname.as_bytes();
    if bytes.is_empty() || bytes.len() >= IFNAMSIZ || bytes.contains(&0) {
        bail!("invalid interface name {ifname:?}");
    }
    let mut value = EthtoolValue {
        cmd: ETHTOOL_SGRO,
        data: u32::from(on),
    };
    let mut req = IfreqData {
        name: [0; IFNAMSIZ],
        data: &raw mut value,
        _pad: [0; 16],
    };
    req.name[..bytes.len()].copy_from_slice(bytes);
    // SAFETY: plain socket(2); the fd is owned right away.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error()).context("socket for SIOCETHTOOL");
    }
    // SAFETY: the kernel just returned this fd; nothing else owns it.
    let sock = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
    // SAFETY: SIOCETHTOOL reads the ifreq and the ethtool_value it points to, both alive here.
    let rc = unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCETHTOOL, &raw mut req) };
    if rc != 0 {
        return Err(io::Error::last_os_error())
            .with_context(|| format!("SIOCETHTOOL ETHTOOL_SGRO {on} on {ifname}"));
    }
    Ok(())
}
