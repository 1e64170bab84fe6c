//! `lb_meta`: who made the pins. Every other pinned map is read with the layout the pins were
//! made with, so that version is checked before anything is reused or shown, and a layout this
//! lb does not read is refused with the way out, never misread.
use std::{fs, os::unix::fs::MetadataExt as _, path::Path};

use anyhow::{Context as _, bail};
use aya::maps::{Array, Map, MapData};
use lb_common::{LAYOUT_VERSION, PinMeta, map_names};

/// The entry this lb writes: its layout, its network namespace and its version.
pub fn current() -> PinMeta {
    let mut lb_version = [0u8; 16];
    let v = env!("CARGO_PKG_VERSION").as_bytes();
    let n = v.len().min(lb_version.len());
    lb_version[..n].copy_from_slice(&v[..n]);
    PinMeta {
        layout_version: LAYOUT_VERSION,
        maglev_table_size: 0,
        netns_inode: own_netns_inode().unwrap_or(0),
        lb_version,
    }
}

/// Inode of this process's network namespace (`/proc/self/ns/net`).
pub fn own_netns_inode() -> Option<u64> {
    fs::metadata("/proc/self/ns/net").ok().map(|m| m.ino())
}

/// `lb_version` as text.
pub fn lb_version(meta: &PinMeta) -> String {
    let end = meta
        .lb_version
        .iter()
        .position(|&b| b == 0)
        .unwrap_or(meta.lb_version.len());
    String::from_utf8_lossy(&meta.lb_version[..end]).into_owned()
}

/// The `lb_meta` entry pinned in `dir`; `None` when there is none, or it was never written
/// (pins made by an lb that stopped before writing it, or from before `lb_meta` existed: both
/// are layout 1, which the map shapes check covers).
pub fn read(dir: &Path) -> anyhow::Result<Option<PinMeta>> {
    let path = dir.join(map_names::META);
    if !path.exists() {
        return Ok(None);
    }
    let data = MapData::from_pin(&path).map_err(|e| pin_error(&path, e))?;
    let array = Array::<_, PinMeta>::try_from(Map::Array(data)).with_context(|| {
        format!(
            "pinned map {} is not the lb_meta this lb reads (made by an incompatible lb?)",
            path.display()
        )
    })?;
    let meta = array
        .get(&0, 0)
        .with_context(|| format!("reading {}", path.display()))?;
    Ok((meta.layout_version != 0).then_some(meta))
}

/// Refuses pins of a layout this lb does not read. There is no older layout to migrate from
/// yet; a future bump adds its migration here, run before the pins are reused.
pub fn check(dir: &Path) -> anyhow::Result<Option<PinMeta>> {
    let Some(meta) = read(dir)? else {
        return Ok(None);
    };
    check_version(dir, &meta)?;
    Ok(Some(meta))
}

fn check_version(dir: &Path, meta: &PinMeta) -> anyhow::Result<()> {
    let found = meta.layout_version;
    if found == LAYOUT_VERSION {
        return Ok(());
    }
    let by = lb_version(meta);
    let this = env!("CARGO_PKG_VERSION");
    let way_out = format!(
        "run an lb that reads layout {found}, or stop lb and remove {} to start afresh \
         (established connections through the tc path lose their state)",
        dir.display()
    );
    if found > LAYOUT_VERSION {
        bail!(
            "the maps pinned at {} have layout version {found} (written by lb {by}), newer than \
             layout {LAYOUT_VERSION} of this lb {this}: refusing to misread them; {way_out}",
            dir.display()
        );
    }
    bail!(
        "the maps pinned at {} have layout version {found} (written by lb {by}); this lb {this} \
         reads layout {LAYOUT_VERSION} and knows no migration from {found}: {way_out}",
        dir.display()
    )
}

/// Writes [`current`] into the loaded `lb_meta`, with the Maglev table size `lb_maglev` is
/// laid out with.
pub fn write(map: &mut Map, maglev_table_size: u32) -> anyhow::Result<()> {
    let meta = PinMeta {
        maglev_table_size,
        ..current()
    };
    Array::<_, PinMeta>::try_from(map)?
        .set(0, meta, 0)
        .context("writing lb_meta")
}

/// Refuses a pinned `lb_maglev` laid out with another M than `want`: its cells would be read at
/// the wrong offsets (the map's size alone cannot tell, e.g. 509 tables of 251 vs 251 of 509).
pub fn check_maglev(dir: &Path, meta: Option<&PinMeta>, want: u32) -> anyhow::Result<()> {
    let found = meta.map_or(0, |m| m.maglev_table_size);
    if found == 0 || found == want || !dir.join(map_names::MAGLEV).exists() {
        return Ok(());
    }
    bail!(
        "the Maglev tables pinned at {} have {found} cells each, this lb is configured for \
         {want} (--maglev-table-size): run with --maglev-table-size {found}, or stop lb and \
         remove {} (lb rebuilds every table before its programs attach; other pins stay)",
        dir.join(map_names::MAGLEV).display(),
        dir.join(map_names::MAGLEV).display()
    )
}

/// `e` from opening the pin at `path`, with a hint when it is a permission problem.
pub fn pin_error(path: &Path, e: aya::maps::MapError) -> anyhow::Error {
    let hint = match &e {
        aya::maps::MapError::SyscallError(s)
            if matches!(s.io_error.raw_os_error(), Some(libc::EPERM | libc::EACCES)) =>
        {
            " (lb's pins are readable by root only)"
        }
        _ => "",
    };
    anyhow::Error::new(e).context(format!("opening pinned map {}{hint}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn current_names_this_layout_and_version() {
        let m = current();
        assert_eq!(m.layout_version, LAYOUT_VERSION);
        assert_eq!(lb_version(&m), env!("CARGO_PKG_VERSION"));
    }

    #[test]
    fn other_layouts_are_refused_with_the_way_out() {
        let dir = Path::new("/sys/fs/bpf/x");
        let mut m = current();
        assert!(check_version(dir, &m).is_ok());
        m.layout_version = LAYOUT_VERSION + 1;
        let e = check_version(dir, &m).unwrap_err().to_string();
        assert!(
            e.contains("newer than") && e.contains("/sys/fs/bpf/x"),
            "{e}"
        );
    }
}
