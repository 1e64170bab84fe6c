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

/// Entries per `BPF_MAP_LOOKUP_BATCH`.
const LOOKUP_CHUNK: u32 = 4096;

/// How [`lookup_each`] ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Walk {
    /// Every entry was handed over.
    Done,
    /// The kernel has no batched lookups for this map (before any entry was handed over).
    Unsupported,
}

/// Hands every entry of the hash map `fd` to `f`, [`LOOKUP_CHUNK`] per `bpf()` call, in one
/// reused buffer (a full sync reads some 200,000 entries; one call per entry, or a buffer per
/// batch, was most of its time). A hash map's cursor is a bucket index, so an entry the
/// datapath adds or deletes meanwhile is seen at most once.
pub fn lookup_each<K, V, E>(
    fd: BorrowedFd<'_>,
    mut f: impl FnMut(K, V) -> Result<(), E>,
) -> Result<Walk, E>
where
    K: bytemuck::Pod,
    V: bytemuck::Pod,
    E: From<io::Error>,
{
    let map_fd = u32::try_from(fd.as_raw_fd()).unwrap_or(u32::MAX);
    let mut chunk = LOOKUP_CHUNK;
    let mut keys = vec![K::zeroed(); chunk as usize];
    let mut values = vec![V::zeroed(); chunk as usize];
    let (mut cursor_in, mut cursor_out) = (0u32, 0u32);
    let mut first = true;
    loop {
        let mut attr = BatchAttr {
            in_batch: if first {
                0
            } else {
                std::ptr::from_mut(&mut cursor_in) as u64
            },
            out_batch: std::ptr::from_mut(&mut cursor_out) as u64,
            keys: keys.as_mut_ptr() as u64,
            values: values.as_mut_ptr() as u64,
            count: chunk,
            map_fd,
            ..BatchAttr::default()
        };
        // SAFETY: `keys` and `values` hold `count` entries of the map's key and value types
        // (checked by aya when the map was opened); the cursors are `u32`s; all outlive the
        // call.
        let err = unsafe { call(LOOKUP, &mut attr) }.err();
        let done = match err.as_ref().and_then(io::Error::raw_os_error) {
            None => false,
            Some(libc::ENOENT) => true,
            // A bucket holds more than `chunk` entries: retry it with more room.
            Some(libc::ENOSPC) if attr.count == 0 => {
                chunk = chunk.saturating_mul(2);
                keys.resize(chunk as usize, K::zeroed());
                values.resize(chunk as usize, V::zeroed());
                continue;
            }
            // 524: ENOTSUPP, the kernel's own "not supported" for map types without batches.
            Some(libc::EINVAL | libc::ENOTSUP | 524) if first => return Ok(Walk::Unsupported),
            Some(_) => return Err(err.unwrap_or_else(io::Error::last_os_error).into()),
        };
        let n = (attr.count as usize).min(keys.len());
        for (k, v) in keys[..n].iter().zip(&values[..n]) {
            f(*k, *v)?;
        }
        if done {
            return Ok(Walk::Done);
        }
        cursor_in = cursor_out;
        first = false;
    }
}

/// Hands every entry of `map` to `f`: in batches where the kernel has them, else key by key
/// (an entry deleted between its key and its value is skipped). `name` names the map in errors.
pub fn each_entry<K, V>(
    map: &aya::maps::HashMap<aya::maps::MapData, K, V>,
    name: &str,
    mut f: impl FnMut(K, V) -> anyhow::Result<()>,
) -> anyhow::Result<()>
where
    K: aya::Pod + bytemuck::Pod,
    V: aya::Pod + bytemuck::Pod,
{
    use anyhow::Context as _;
    use aya::maps::IterableMap as _;
    use std::os::fd::AsFd as _;
    let walk = lookup_each(map.map().fd().as_fd(), &mut f)
        .with_context(|| format!("reading {name} in batches"))?;
    if walk == Walk::Done {
        return Ok(());
    }
    for item in map.iter() {
        match item {
            Ok((k, v)) => f(k, v)?,
            Err(aya::maps::MapError::KeyNotFound) => {}
            Err(e) => return Err(anyhow::Error::new(e).context(format!("reading {name}"))),
        }
    }
    Ok(())
}
