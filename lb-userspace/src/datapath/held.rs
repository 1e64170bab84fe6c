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
use lb_common::{ClusterIpValue, EchoValue, SvcValue, map_names};

use super::{
    batch,
    error::MapOpError,
    family::{MapFamily, V4, V6},
};

/// One family's maps [`Held`] writes to, borrowed only to duplicate their descriptors.
pub(crate) struct HeldMaps<'a, F: MapFamily> {
    pub(crate) cluster_ips: &'a HashMap<MapData, F::ClusterIpKey, ClusterIpValue>,
    pub(crate) backends: &'a HashMap<MapData, u32, F::Backend>,
    pub(crate) revnat: &'a HashMap<MapData, u32, F::RevNat>,
    pub(crate) services: &'a HashMap<MapData, F::SvcKey, SvcValue>,
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

/// The master entries held, in write order, and the echo entries, written after them (an
/// echo answer says a service is there; one entry at a time was an eighth of a cold start).
pub(crate) struct Masters {
    pub(crate) v4: Vec<(<V4 as MapFamily>::SvcKey, SvcValue)>,
    pub(crate) v6: Vec<(<V6 as MapFamily>::SvcKey, SvcValue)>,
    pub(crate) echo4: Vec<(<V4 as MapFamily>::EchoKey, EchoValue)>,
    pub(crate) echo6: Vec<(<V6 as MapFamily>::EchoKey, EchoValue)>,
}

/// One family's held entries but the masters.
struct Queues<F: MapFamily> {
    cluster_ips: Queue<F::ClusterIpKey, ClusterIpValue>,
    backends: Queue<u32, F::Backend>,
    revnat: Queue<u32, F::RevNat>,
    slots: Queue<F::SvcKey, SvcValue>,
}

impl<F: MapFamily> Queues<F> {
    fn new(maps: &HeldMaps<'_, F>) -> io::Result<Self> {
        let names = &F::NAMES;
        Ok(Self {
            cluster_ips: Queue::new(names.cluster_ips, maps.cluster_ips)?,
            backends: Queue::new(names.backends, maps.backends)?,
            revnat: Queue::new(names.revnat, maps.revnat)?,
            slots: Queue::new(names.services, maps.services)?,
        })
    }
}

pub(crate) struct Held {
    v4: Queues<V4>,
    v6: Queues<V6>,
    /// Writes the ClusterIPs, backends and rev-NAT entries.
    others: Writer,
    /// Writes the slots.
    slot_writer: Writer,
    /// Written by `BpfMaps` itself, after `finish_writers`.
    masters: Masters,
}

/// One family's side of a [`Held`]: where its entries go.
pub(crate) struct HeldFamily<'a, F: MapFamily> {
    queues: &'a mut Queues<F>,
    masters: &'a mut Vec<(F::SvcKey, SvcValue)>,
    echo: &'a mut Vec<(F::EchoKey, EchoValue)>,
    others: &'a mut Writer,
    slot_writer: &'a mut Writer,
}

impl<F: MapFamily> HeldFamily<'_, F> {
    pub(crate) fn cluster_ip(&mut self, e: (F::ClusterIpKey, ClusterIpValue)) {
        self.queues.cluster_ips.push(e, self.others);
    }

    pub(crate) fn backend(&mut self, e: (u32, F::Backend)) {
        self.queues.backends.push(e, self.others);
    }

    pub(crate) fn revnat(&mut self, e: (u32, F::RevNat)) {
        self.queues.revnat.push(e, self.others);
    }

    /// A service entry: a master (slot 0) is kept to be written last, a slot goes to its
    /// writer.
    pub(crate) fn service(&mut self, slot: u16, e: (F::SvcKey, SvcValue)) {
        if slot == 0 {
            self.masters.push(e);
        } else {
            self.queues.slots.push(e, self.slot_writer);
        }
    }

    /// An echo entry, kept to be written after the masters.
    pub(crate) fn echo(&mut self, e: (F::EchoKey, EchoValue)) {
        self.echo.push(e);
    }
}

impl Held {
    /// Starts holding writes to the maps of both families (its writer threads and descriptors
    /// of its maps).
    pub(crate) fn new(v4: &HeldMaps<'_, V4>, v6: &HeldMaps<'_, V6>) -> io::Result<Self> {
        Ok(Self {
            v4: Queues::new(v4)?,
            v6: Queues::new(v6)?,
            others: Writer::spawn("lb-map-writer")?,
            slot_writer: Writer::spawn("lb-slot-writer")?,
            masters: Masters {
                v4: Vec::new(),
                v6: Vec::new(),
                echo4: Vec::new(),
                echo6: Vec::new(),
            },
        })
    }

    pub(crate) fn v4(&mut self) -> HeldFamily<'_, V4> {
        HeldFamily {
            queues: &mut self.v4,
            masters: &mut self.masters.v4,
            echo: &mut self.masters.echo4,
            others: &mut self.others,
            slot_writer: &mut self.slot_writer,
        }
    }

    pub(crate) fn v6(&mut self) -> HeldFamily<'_, V6> {
        HeldFamily {
            queues: &mut self.v6,
            masters: &mut self.masters.v6,
            echo: &mut self.masters.echo6,
            others: &mut self.others,
            slot_writer: &mut self.slot_writer,
        }
    }

    /// Hands over what is left and waits for both writers: then everything but the masters
    /// and echo entries (returned, to be written last) is in the maps, or the first error says what is not.
    pub(crate) fn finish_writers(mut self) -> Result<Masters, MapOpError> {
        // Order among these is free: only the ClusterIPs are visible before a master, and the
        // masters come after all of them.
        self.v4.cluster_ips.flush(&mut self.others);
        self.v6.cluster_ips.flush(&mut self.others);
        self.v4.backends.flush(&mut self.others);
        self.v6.backends.flush(&mut self.others);
        self.v4.revnat.flush(&mut self.others);
        self.v6.revnat.flush(&mut self.others);
        self.v4.slots.flush(&mut self.slot_writer);
        self.v6.slots.flush(&mut self.slot_writer);
        let others = self.others.finish();
        let slots = self.slot_writer.finish();
        others.and(slots)?;
        Ok(self.masters)
    }
}
