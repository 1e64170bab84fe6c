//! Sources publish complete snapshots of the objects lb cares about on a `watch` channel. The
//! channel keeps only the newest snapshot, so a burst of changes that arrives while the daemon
//! is applying one is coalesced into a single next sync.
use std::{
    hash::Hasher,
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, Instant, SystemTime},
};

use tokio::sync::{Notify, watch};

use super::{
    manifests::{self, Problem},
    slim::{EndpointSlice, Node, Object, Service},
};

/// Everything a source knows at one point in time.
#[derive(Clone, Debug)]
pub struct Snapshot {
    pub services: Vec<Arc<Service>>,
    pub slices: Vec<Arc<EndpointSlice>>,
    /// This node's Node object, if the source has one.
    pub node: Option<Arc<Node>>,
    /// Documents the source could not use.
    pub problems: Vec<Problem>,
    /// When the newest change in this snapshot was observed (event-to-write latency).
    pub changed_at: Instant,
}

impl Snapshot {
    /// The manifests in `dir` as a snapshot for the node `node_name` (its Node object, if the
    /// directory has one); `lb run --manifests` and `lb trace --manifests` read them so.
    pub fn from_manifests(dir: &Path, node_name: &str) -> anyhow::Result<Self> {
        let changed_at = Instant::now();
        let (objects, problems) = manifests::load_dir(dir)?;
        let node = objects
            .nodes
            .into_iter()
            .find(|n| n.metadata.name.as_deref() == Some(node_name));
        Ok(Self {
            services: objects.services.into_iter().map(Arc::new).collect(),
            slices: objects.slices.into_iter().map(Arc::new).collect(),
            node: node.map(Arc::new),
            problems,
            changed_at,
        })
    }
}

pub type SnapshotSender = watch::Sender<Option<Arc<Snapshot>>>;
pub type SnapshotReceiver = watch::Receiver<Option<Arc<Snapshot>>>;

pub fn channel() -> (SnapshotSender, SnapshotReceiver) {
    watch::channel(None)
}

/// How often the manifest directory is checked for changes. Polling (rather than inotify)
/// also sees ConfigMap-style symlink swaps and files on any filesystem.
pub const MANIFEST_POLL: Duration = Duration::from_millis(250);

/// A cheap fingerprint of a directory tree's manifest files: path, size and mtime of each
/// (symlinks followed: a ConfigMap mount swaps a `..data` link), and the paths of the entries
/// that could not be read. Walked as `manifests::list_files` reads it, so a symlink loop or a
/// dangling link neither hangs the watch nor blinds it to other changes.
type Fingerprint = (Vec<(PathBuf, u64, SystemTime)>, Vec<PathBuf>);

fn fingerprint(dir: &Path) -> Option<Fingerprint> {
    let (files, problems) = manifests::list_files(dir).ok()?;
    let files = files
        .into_iter()
        .map(|(path, meta)| {
            let modified = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
            (path, meta.len(), modified)
        })
        .collect();
    Some((files, problems.into_iter().map(|p| p.file).collect()))
}

/// Publishes a snapshot of `dir` at start, whenever its files change (added, changed,
/// removed), and whenever `reload` is notified (SIGHUP). A directory that cannot be read
/// publishes nothing, so the previous state stays.
pub async fn watch_manifests(
    dir: PathBuf,
    node_name: String,
    tx: SnapshotSender,
    reload: Arc<Notify>,
) {
    let mut last = None;
    let mut forced = true;
    loop {
        let current = fingerprint(&dir);
        if forced || current != last {
            match Snapshot::from_manifests(&dir, &node_name) {
                Ok(snapshot) => {
                    if tx.send(Some(Arc::new(snapshot))).is_err() {
                        return;
                    }
                }
                Err(e) => tracing::error!(
                    dir = %dir.display(),
                    error = format!("{e:#}"),
                    "cannot read manifests; keeping the previous state"
                ),
            }
            last = current;
            forced = false;
        }
        tokio::select! {
            _ = tokio::time::sleep(MANIFEST_POLL) => {}
            _ = reload.notified() => forced = true,
            _ = tx.closed() => return,
        }
    }
}

/// Whether two versions of an object are the same: one `Arc` (an unchanged reflector entry), the
/// same non-empty resourceVersion, or equal contents (manifests carry no resourceVersion).
pub(crate) fn same<T: PartialEq + Object>(a: &Arc<T>, b: &Arc<T>) -> bool {
    if Arc::ptr_eq(a, b) {
        return true;
    }
    match (&a.meta().resource_version, &b.meta().resource_version) {
        (Some(x), Some(y)) if !x.is_empty() => x == y,
        _ => a == b,
    }
}

/// Hashes object addresses (a multiply and a fold: they are aligned and distinct).
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct PtrHasher(u64);

impl Hasher for PtrHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(*b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }

    fn write_usize(&mut self, n: usize) {
        let h = (n as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        self.0 = h ^ (h >> 29);
    }
}
