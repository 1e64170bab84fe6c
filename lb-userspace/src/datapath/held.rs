//! Writes held while the reconciler fills empty maps (`LbMaps::hold_writes`, a cold start).
//!
//! Nothing a packet can reach changes until a master entry names it, so everything else (the
//! ClusterIPs, backends, rev-NAT entries and slots) is handed, in `batch::UPDATE_CHUNK`-sized
//! batches as it comes, to two writer threads (one for the slots, one for the rest) while the
//! reconciler goes on; the masters are kept and written last, after both threads are done. The
//! kernel's inserts (with `BPF_F_NO_PREALLOC`, an allocation each) are most of a cold start,
//! and at most a few batches wait in memory at a time.
use std::{
    io,
    os::fd::{AsFd as _, OwnedFd},
    sync::{
        Arc,
        mpsc::{SyncSender, sync_channel},
    },
    thread::JoinHandle,
};

use aya::maps::{HashMap, IterableMap as _, MapData, MapError};
use lb_common::{
    Backend4, Backend6, ClusterIp4Key, ClusterIp6Key, ClusterIpValue, RevNat4, RevNat6, Svc4Key,
    Svc6Key, SvcValue, map_names,
};

use super::{batch, error::MapOpError};

/// The maps [`Held`] writes to, borrowed only to duplicate their descriptors.
pub(crate) struct HeldMaps<'a> {
    pub(crate) cluster_ips4: &'a HashMap<MapData, ClusterIp4Key, ClusterIpValue>,
    pub(crate) cluster_ips6: &'a HashMap<MapData, ClusterIp6Key, ClusterIpValue>,
    pub(crate) backends4: &'a HashMap<MapData, u32, Backend4>,
    pub(crate) backends6: &'a HashMap<MapData, u32, Backend6>,
    pub(crate) revnat4: &'a HashMap<MapData, u32, RevNat4>,
    pub(crate) revnat6: &'a HashMap<MapData, u32, RevNat6>,
    pub(crate) services4: &'a HashMap<MapData, Svc4Key, SvcValue>,
    pub(crate) services6: &'a HashMap<MapData, Svc6Key, SvcValue>,
}

/// A batch for a writer thread.
type Job = Box<dyn FnOnce() -> Result<(), MapOpError> + Send>;

/// A writer thread: runs its jobs in order and stops at the first that fails.
struct Writer {
    tx: Option<SyncSender<Job>>,
    handle: Option<JoinHandle<Result<(), MapOpError>>>,
}

impl Writer {
    fn spawn(name: &str) -> io::Result<Self> {
        // Two batches in flight: enough to keep the thread busy, little memory.
        let (tx, rx) = sync_channel::<Job>(2);
        let handle = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                for job in rx {
                    job()?;
                }
                Ok(())
            })?;
        Ok(Self {
            tx: Some(tx),
            handle: Some(handle),
        })
    }

    fn send(&mut self, job: Job) {
        // A closed channel: the thread stopped at an error, which `finish` returns.
        if let Some(tx) = &self.tx
            && tx.send(job).is_err()
        {
            self.tx = None;
        }
    }

    fn finish(mut self) -> Result<(), MapOpError> {
        self.tx = None;
        match self.handle.take().map(JoinHandle::join) {
            None | Some(Ok(Ok(()))) => Ok(()),
            Some(Ok(Err(e))) => Err(e),
            Some(Err(_)) => Err(update_error(
                map_names::SERVICES4,
                io::Error::other("a map writer thread panicked"),
            )),
        }
    }
}

/// A failed batch update of `map`, as a single write's failure reads.
fn update_error(map: &'static str, e: io::Error) -> MapOpError {
    MapOpError::from_aya(
        map,
        MapError::SyscallError(aya::sys::SyscallError {
            call: "bpf_map_update_batch",
            io_error: e,
        }),
    )
}

/// The held entries of one map not yet handed to its writer.
struct Queue<K, V> {
    map: &'static str,
    fd: Arc<OwnedFd>,
    entries: Vec<(K, V)>,
}

impl<K, V> Queue<K, V>
where
    K: bytemuck::Pod + Send + 'static,
    V: bytemuck::Pod + Send + 'static,
{
    fn new<T: aya::Pod, U: aya::Pod>(
        map: &'static str,
        of: &HashMap<MapData, T, U>,
    ) -> io::Result<Self> {
        Ok(Self {
            map,
            fd: Arc::new(of.map().fd().as_fd().try_clone_to_owned()?),
            entries: Vec::new(),
        })
    }

    fn push(&mut self, entry: (K, V), writer: &mut Writer) {
        self.entries.push(entry);
        if self.entries.len() >= batch::UPDATE_CHUNK {
            self.flush(writer);
        }
    }

    fn flush(&mut self, writer: &mut Writer) {
        if self.entries.is_empty() {
            return;
        }
        let (map, fd, entries) = (
            self.map,
            Arc::clone(&self.fd),
            std::mem::take(&mut self.entries),
        );
        writer.send(Box::new(move || {
            batch::update(fd.as_fd(), &entries).map_err(|(e, _)| update_error(map, e))
        }));
    }
}

/// The master entries held, in write order.
pub(crate) struct Masters {
    pub(crate) v4: Vec<(Svc4Key, SvcValue)>,
    pub(crate) v6: Vec<(Svc6Key, SvcValue)>,
}

pub(crate) struct Held {
    cluster_ips4: Queue<ClusterIp4Key, ClusterIpValue>,
    cluster_ips6: Queue<ClusterIp6Key, ClusterIpValue>,
    backends4: Queue<u32, Backend4>,
    backends6: Queue<u32, Backend6>,
    revnat4: Queue<u32, RevNat4>,
    revnat6: Queue<u32, RevNat6>,
    slots4: Queue<Svc4Key, SvcValue>,
    slots6: Queue<Svc6Key, SvcValue>,
    /// Writes the ClusterIPs, backends and rev-NAT entries.
    others: Writer,
    /// Writes the slots.
    slot_writer: Writer,
    /// Written by `BpfMaps` itself, after `finish_writers`.
    pub(crate) masters: Masters,
}

impl Held {
    /// Starts holding writes to `maps` (its writer threads and descriptors of its maps).
    pub(crate) fn new(maps: &HeldMaps<'_>) -> io::Result<Self> {
        Ok(Self {
            cluster_ips4: Queue::new(map_names::CLUSTER_IPS4, maps.cluster_ips4)?,
            cluster_ips6: Queue::new(map_names::CLUSTER_IPS6, maps.cluster_ips6)?,
            backends4: Queue::new(map_names::BACKENDS4, maps.backends4)?,
            backends6: Queue::new(map_names::BACKENDS6, maps.backends6)?,
            revnat4: Queue::new(map_names::REVNAT4, maps.revnat4)?,
            revnat6: Queue::new(map_names::REVNAT6, maps.revnat6)?,
            slots4: Queue::new(map_names::SERVICES4, maps.services4)?,
            slots6: Queue::new(map_names::SERVICES6, maps.services6)?,
            others: Writer::spawn("lb-map-writer")?,
            slot_writer: Writer::spawn("lb-slot-writer")?,
            masters: Masters {
                v4: Vec::new(),
                v6: Vec::new(),
            },
        })
    }

    pub(crate) fn cluster_ip4(&mut self, e: (ClusterIp4Key, ClusterIpValue)) {
        self.cluster_ips4.push(e, &mut self.others);
    }

    pub(crate) fn cluster_ip6(&mut self, e: (ClusterIp6Key, ClusterIpValue)) {
        self.cluster_ips6.push(e, &mut self.others);
    }

    pub(crate) fn backend4(&mut self, e: (u32, Backend4)) {
        self.backends4.push(e, &mut self.others);
    }

    pub(crate) fn backend6(&mut self, e: (u32, Backend6)) {
        self.backends6.push(e, &mut self.others);
    }

    pub(crate) fn revnat4(&mut self, e: (u32, RevNat4)) {
        self.revnat4.push(e, &mut self.others);
    }

    pub(crate) fn revnat6(&mut self, e: (u32, RevNat6)) {
        self.revnat6.push(e, &mut self.others);
    }

    pub(crate) fn slot4(&mut self, e: (Svc4Key, SvcValue)) {
        self.slots4.push(e, &mut self.slot_writer);
    }

    pub(crate) fn slot6(&mut self, e: (Svc6Key, SvcValue)) {
        self.slots6.push(e, &mut self.slot_writer);
    }

    /// Hands over what is left and waits for both writers: then everything but the masters
    /// (returned, to be written last) is in the maps, or the first error says what is not.
    pub(crate) fn finish_writers(mut self) -> Result<Masters, MapOpError> {
        // Order among these is free: only the ClusterIPs are visible before a master, and the
        // masters come after all of them.
        self.cluster_ips4.flush(&mut self.others);
        self.cluster_ips6.flush(&mut self.others);
        self.backends4.flush(&mut self.others);
        self.backends6.flush(&mut self.others);
        self.revnat4.flush(&mut self.others);
        self.revnat6.flush(&mut self.others);
        self.slots4.flush(&mut self.slot_writer);
        self.slots6.flush(&mut self.slot_writer);
        let others = self.others.finish();
        let slots = self.slot_writer.finish();
        others.and(slots)?;
        Ok(self.masters)
    }
}
