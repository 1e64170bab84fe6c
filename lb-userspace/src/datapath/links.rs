//! Attachments that outlive the process: bpf_links pinned under `<pin dir>/links/`, and on
//! kernels without tcx, clsact filters at a fixed priority and handle. A restarted (or newer)
//! lb adopts them by pointing each at its freshly loaded program (`BPF_LINK_UPDATE`, or a
//! netlink filter replace), so no packet ever meets a device or cgroup without lb's programs.
//!
//! aya covers creating and pinning links; adopting a pinned link of any type needs its fd,
//! which aya does not hand out, so `BPF_OBJ_GET` and `BPF_LINK_UPDATE` are issued here.
use std::{
    ffi::CString,
    fs, io,
    os::fd::{AsFd, AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd},
    path::{Path, PathBuf},
};

use anyhow::Context as _;

/// The clsact filter priority of lb's tc programs where tc attaches over netlink: fixed, so
/// the next lb finds and replaces its predecessor's filter instead of adding a second one.
pub const TC_NETLINK_PRIORITY: u16 = 0x4c42;
/// The filter handle at that priority.
pub const TC_NETLINK_HANDLE: u32 = 1;

const BPF_OBJ_GET: libc::c_long = 7;
const BPF_LINK_UPDATE: libc::c_long = 29;
const BPF_LINK_DETACH: libc::c_long = 34;

/// The directory of the pinned links.
pub fn dir(pin_dir: &Path) -> PathBuf {
    pin_dir.join("links")
}

/// The pin of the link named `key` (bpffs refuses dots in names).
pub fn path(pin_dir: &Path, key: &str) -> PathBuf {
    dir(pin_dir).join(key.replace('.', "~"))
}

fn bpf(cmd: libc::c_long, attr: &mut [u64; 2]) -> io::Result<libc::c_long> {
    // SAFETY: `attr` is a zero-padded bpf_attr prefix of the size given; the kernel reads (and
    // for BPF_OBJ_GET returns) only the fields of `cmd`.
    let r = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr.as_mut_ptr(),
            size_of::<[u64; 2]>() as libc::c_uint,
        )
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// Opens the pinned object at `path`.
fn obj_get(path: &Path) -> io::Result<OwnedFd> {
    let c = CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // bpf_attr for BPF_OBJ_GET: u64 pathname, u32 bpf_fd, u32 file_flags.
    let mut attr = [c.as_ptr() as u64, 0];
    let fd = bpf(BPF_OBJ_GET, &mut attr)?;
    // SAFETY: the kernel returned a new fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Points `link` at `prog`.
fn link_update(link: BorrowedFd<'_>, prog: BorrowedFd<'_>) -> io::Result<()> {
    // bpf_attr for BPF_LINK_UPDATE: u32 link_fd, u32 new_prog_fd, u32 flags, u32 old_prog_fd.
    let mut attr = [
        u64::from(link.as_raw_fd() as u32) | (u64::from(prog.as_raw_fd() as u32) << 32),
        0,
    ];
    bpf(BPF_LINK_UPDATE, &mut attr).map(drop)
}

/// Detaches the link pinned at `path` at once (a link whose last reference goes is released
/// later, from a workqueue), then removes the pin.
fn detach_pinned(path: &Path) -> anyhow::Result<()> {
    if let Ok(link) = obj_get(path) {
        // bpf_attr for BPF_LINK_DETACH: u32 link_fd. ENOLINK: detached already.
        let mut attr = [u64::from(link.as_raw_fd() as u32), 0];
        match bpf(BPF_LINK_DETACH, &mut attr) {
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENOLINK) => {}
            Err(e) => {
                return Err(e).with_context(|| format!("detaching the link at {}", path.display()));
            }
        }
    }
    fs::remove_file(path).with_context(|| format!("removing {}", path.display()))
}

/// Detaches and unpins the link pinned at `path`, if any (a pod device that went away: its
/// link is defunct already).
pub fn forget(path: &Path) {
    if path.exists()
        && let Err(e) = detach_pinned(path)
    {
        tracing::debug!(pin = %path.display(), error = format!("{e:#}"), "link pin not removed");
    }
}

/// Adopts the link pinned at `path` for `prog`. `Ok(false)`: there was none, or it was
/// defunct (its device or cgroup gone) and its pin is removed; attach afresh.
pub fn adopt(path: &Path, prog: BorrowedFd<'_>) -> anyhow::Result<bool> {
    let link = match obj_get(path) {
        Ok(fd) => fd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e).with_context(|| format!("opening {}", path.display())),
    };
    match link_update(link.as_fd(), prog) {
        Ok(()) => Ok(true),
        // ENOLINK: the link was detached (its target went away).
        Err(e) if e.raw_os_error() == Some(libc::ENOLINK) => {
            fs::remove_file(path).with_context(|| format!("removing {}", path.display()))?;
            Ok(false)
        }
        Err(e) => Err(e).with_context(|| format!("updating the link pinned at {}", path.display())),
    }
}

/// Removes the pins under `pin_dir/links` whose names are not in `keep` (attachments this run
/// no longer wants: their links go away with the pin). Returns what it removed.
pub fn prune(pin_dir: &Path, keep: &[PathBuf]) -> anyhow::Result<Vec<String>> {
    let mut removed = Vec::new();
    let Ok(entries) = fs::read_dir(dir(pin_dir)) else {
        return Ok(removed);
    };
    for entry in entries {
        let path = entry?.path();
        if !keep.contains(&path) {
            // A link whose device went away is defunct and detaches as a no-op; whatever else
            // fails here must not stop lb from serving: the pin is dropped all the same.
            if let Err(e) = detach_pinned(&path) {
                tracing::warn!(pin = %path.display(), error = format!("{e:#}"), "stale link not detached cleanly");
                let _ = fs::remove_file(&path);
            }
            removed.push(
                path.file_name()
                    .unwrap_or_default()
                    .to_string_lossy()
                    .into_owned(),
            );
        }
    }
    Ok(removed)
}

/// `lb detach`: removes every pinned link under `pin_dir` and, on kernels that attach tc over
/// netlink, lb's clsact filters on every device of this network namespace. The maps stay.
pub fn detach_all(
    pin_dir: &Path,
    tc_programs: &[(&str, aya::programs::TcAttachType)],
) -> anyhow::Result<Vec<String>> {
    let mut removed = prune(pin_dir, &[])?;
    let _ = fs::remove_dir(dir(pin_dir));
    let netlink = aya::util::KernelVersion::current()
        .is_ok_and(|v| v < aya::util::KernelVersion::new(6, 6, 0));
    if netlink {
        // The devices of this netns (/sys/class/net shows the netns sysfs was mounted in).
        let ifaces = nix::net::if_::if_nameindex().context("listing network devices")?;
        for i in ifaces.iter() {
            let iface = i.name().to_string_lossy().into_owned();
            for (name, attach) in tc_programs {
                if aya::programs::tc::qdisc_detach_program(&iface, *attach, name).is_ok() {
                    removed.push(format!("{name}@{iface}"));
                }
            }
        }
    }
    Ok(removed)
}
