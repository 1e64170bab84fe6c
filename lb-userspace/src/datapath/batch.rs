//! `BPF_MAP_*_BATCH` for hash maps (5.6+): many entries per `bpf()` call, where one call per
//! entry would spend most of its time entering the kernel and copying one key at a time (a
//! cold start writes some 200,000 entries at 10,000 services × 10 endpoints).
use std::{
    io,
    os::fd::{AsRawFd as _, BorrowedFd},
};

/// `BPF_MAP_LOOKUP_BATCH`.
pub const LOOKUP: libc::c_long = 24;
const BPF_MAP_UPDATE_BATCH: libc::c_long = 26;

/// Entries per update call: large enough that the call's own cost vanishes, small enough that
/// the key and value copies stay in cache.
pub(crate) const UPDATE_CHUNK: usize = 4096;

/// The `batch` member of `union bpf_attr`.
#[repr(C)]
#[derive(Default)]
pub struct BatchAttr {
    pub in_batch: u64,
    pub out_batch: u64,
    pub keys: u64,
    pub values: u64,
    pub count: u32,
    pub map_fd: u32,
    pub elem_flags: u64,
    pub flags: u64,
}

/// `bpf(cmd, attr)` for a batch command; returns the syscall's error, if any.
///
/// # Safety
/// `attr`'s pointers must name buffers of `attr.count` keys and values of the map's key and
/// value sizes (and the cursors `in_batch`/`out_batch` a `u32` each, or be 0), valid for the
/// call.
pub unsafe fn call(cmd: libc::c_long, attr: &mut BatchAttr) -> io::Result<()> {
    // SAFETY: per the function's contract; the kernel reads and writes only within `attr` and
    // the buffers it names.
    let r = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            std::ptr::from_mut(attr),
            size_of::<BatchAttr>(),
        )
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Writes `entries` into the hash map `fd` (`BPF_ANY`), in order, `UPDATE_CHUNK` per call.
/// On failure returns the error and how many entries were written before it (the kernel
/// writes a batch's entries one by one and stops at the first that fails).
pub fn update<K: bytemuck::Pod, V: bytemuck::Pod>(
    fd: BorrowedFd<'_>,
    entries: &[(K, V)],
) -> Result<(), (io::Error, usize)> {
    let map_fd = u32::try_from(fd.as_raw_fd()).unwrap_or(u32::MAX);
    let mut done = 0;
    for chunk in entries.chunks(UPDATE_CHUNK) {
        let keys: Vec<K> = chunk.iter().map(|e| e.0).collect();
        let values: Vec<V> = chunk.iter().map(|e| e.1).collect();
        let mut attr = BatchAttr {
            keys: keys.as_ptr() as u64,
            values: values.as_ptr() as u64,
            count: u32::try_from(chunk.len()).unwrap_or(u32::MAX),
            map_fd,
            ..BatchAttr::default()
        };
        // SAFETY: `keys` and `values` hold `count` entries of the map's key and value types
        // (checked by aya when the map was opened) and outlive the call; no cursors.
        if let Err(e) = unsafe { call(BPF_MAP_UPDATE_BATCH, &mut attr) } {
            return Err((e, done + (attr.count as usize).min(chunk.len())));
        }
        done += chunk.len();
    }
    Ok(())
}
