//! The bpf(2) batch commands (BPF_MAP_LOOKUP_BATCH, BPF_MAP_UPDATE_BATCH), made by hand
//! because aya 0.14 has no call for them, `FlowReader`, the connection-table scan that
//! uses them where the kernel can, and `FlowLookups`, explain's lookups of one flow.

use std::{
    os::fd::{AsFd, AsRawFd},
    sync::{Arc, Mutex},
};

use aya::maps::{Array, HashMap as BpfHashMap, MapData};
use bytemuck::Zeroable;
use lb_common::{
    Embryo, FlowEntry, FlowKey, MAP_CONNTRACK, MAP_EMBRYONIC, MAP_HOT_SOURCES, SourceKey,
};

use super::{Dataplane, DataplaneError, dup_map, in_map, syscall_error};

/// The `batch` member of `union bpf_attr` (BPF_MAP_*_BATCH, Linux 5.6).
#[repr(C)]
#[derive(Default)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

/// Elements per batch call.
const BATCH: usize = 8192;

/// The kernel's internal ENOTSUPP, which bpf(2) returns for a command a map lacks.
const KERNEL_ENOTSUPP: i32 = 524;

/// One bpf(2) batch command.
fn batch_call(command: libc::c_long, attr: &mut BatchAttr) -> std::io::Result<()> {
    // SAFETY: `attr` is a valid `union bpf_attr` prefix whose pointers the caller keeps
    // alive, and the size passed is its own.
    let done = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            command,
            attr as *mut BatchAttr,
            std::mem::size_of::<BatchAttr>() as u32,
        )
    };
    if done != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Every entry of the connection table `fd` with BPF_MAP_LOOKUP_BATCH: one call per
/// `BATCH` entries, where iterating costs two calls per entry (a full table of a million
/// entries: 128 calls instead of two million).
fn lookup_flows_batch(fd: std::os::fd::RawFd) -> std::io::Result<Vec<(FlowKey, FlowEntry)>> {
    const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;
    let mut keys = vec![FlowKey::zeroed(); BATCH];
    let mut values = vec![FlowEntry::zeroed(); BATCH];
    let mut flows = Vec::new();
    // A hash map's batch position is a bucket index (a u32); none for the first call.
    let mut position: Option<u32> = None;
    loop {
        let mut next: u32 = 0;
        let mut attr = BatchAttr {
            in_batch: position.as_ref().map_or(0, |p| p as *const u32 as u64),
            out_batch: &mut next as *mut u32 as u64,
            keys: keys.as_mut_ptr() as u64,
            values: values.as_mut_ptr() as u64,
            count: BATCH as u32,
            map_fd: fd as u32,
            ..BatchAttr::default()
        };
        let result = batch_call(BPF_MAP_LOOKUP_BATCH, &mut attr);
        // ENOENT: the end of the table, with the last `count` entries filled in.
        let end = match &result {
            Ok(()) => false,
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => true,
            Err(_) => return result.map(|()| flows),
        };
        let n = (attr.count as usize).min(BATCH);
        flows.extend(keys[..n].iter().copied().zip(values[..n].iter().copied()));
        if end {
            return Ok(flows);
        }
        position = Some(next);
    }
}

/// Writes `(index, value)` pairs into the array map `fd` with BPF_MAP_UPDATE_BATCH
/// (Linux 5.6), in chunks; each element is written as a single update would write it.
pub(super) fn update_batch(fd: std::os::fd::RawFd, slots: &[(u32, u32)]) -> std::io::Result<()> {
    const BPF_MAP_UPDATE_BATCH: libc::c_long = 26;
    for chunk in slots.chunks(BATCH) {
        let keys: Vec<u32> = chunk.iter().map(|&(slot, _)| slot).collect();
        let values: Vec<u32> = chunk.iter().map(|&(_, id)| id).collect();
        let mut attr = BatchAttr {
            keys: keys.as_ptr() as u64,
            values: values.as_ptr() as u64,
            count: chunk.len() as u32,
            map_fd: fd as u32,
            ..BatchAttr::default()
        };
        batch_call(BPF_MAP_UPDATE_BATCH, &mut attr)?;
        if attr.count as usize != chunk.len() {
            return Err(std::io::Error::other(format!(
                "batch update wrote {} of {} slots",
                attr.count,
                chunk.len()
            )));
        }
    }
    Ok(())
}

/// Reads the connection table apart from the data path's own handle (see
/// `Dataplane::flow_reader`).
pub struct FlowReader(FlowSource);

enum FlowSource {
    Map(BpfHashMap<MapData, FlowKey, FlowEntry>),
    /// The in-memory data path's entries when the reader was made.
    #[cfg(test)]
    Snapshot(Vec<(FlowKey, FlowEntry)>),
}

impl FlowReader {
    /// A reader of `conntrack` through a handle of its own.
    pub(super) fn of(
        conntrack: &BpfHashMap<MapData, FlowKey, FlowEntry>,
    ) -> Result<Self, DataplaneError> {
        Ok(FlowReader(FlowSource::Map(own_handle(conntrack)?)))
    }

    /// A reader of these entries (the in-memory data path's).
    #[cfg(test)]
    pub(super) fn snapshot(flows: Vec<(FlowKey, FlowEntry)>) -> Self {
        FlowReader(FlowSource::Snapshot(flows))
    }

    /// Every entry, read in batches where the kernel can.
    pub fn flows(&self) -> Result<Vec<(FlowKey, FlowEntry)>, DataplaneError> {
        match &self.0 {
            FlowSource::Map(map) => read_flows(map),
            #[cfg(test)]
            FlowSource::Snapshot(flows) => Ok(flows.clone()),
        }
    }

    /// Every entry, in batches only (an error where the kernel cannot): for tests.
    pub fn flows_batched(&self) -> Result<Vec<(FlowKey, FlowEntry)>, DataplaneError> {
        match &self.0 {
            FlowSource::Map(map) => read_flows_batched(map),
            #[cfg(test)]
            FlowSource::Snapshot(flows) => Ok(flows.clone()),
        }
    }

    /// Every entry, one key at a time: the fallback of `flows`, which tests and the
    /// benchmark compare it with.
    pub fn flows_by_key(&self) -> Result<Vec<(FlowKey, FlowEntry)>, DataplaneError> {
        match &self.0 {
            FlowSource::Map(map) => read_flows_by_key(map),
            #[cfg(test)]
            FlowSource::Snapshot(flows) => Ok(flows.clone()),
        }
    }
}

/// Another handle on the connection table (a duplicated descriptor).
fn own_handle(
    conntrack: &BpfHashMap<MapData, FlowKey, FlowEntry>,
) -> Result<BpfHashMap<MapData, FlowKey, FlowEntry>, DataplaneError> {
    let data = dup_map(aya::maps::IterableMap::map(conntrack), MAP_CONNTRACK)?;
    BpfHashMap::try_from(aya::maps::Map::LruHashMap(data)).map_err(in_map(MAP_CONNTRACK))
}

/// What `lb explain` reads of one flow: its connection-table entry, its embryonic slot and
/// whether its source is hot. The data path answers these itself (`Dataplane`); the read
/// side answers them through handles of its own (`FlowLookups`).
pub trait Lookups {
    /// The connection-table entry of one flow.
    fn flow(&self, key: &FlowKey) -> Result<Option<FlowEntry>, DataplaneError>;
    /// Slot `index` of the embryonic table (`lb_common::flow::embryo_place`).
    fn embryo(&self, index: u32) -> Result<Embryo, DataplaneError>;
    /// Whether `key` is in `LB_HOT_SRC`.
    fn is_hot_source(&self, key: &SourceKey) -> Result<bool, DataplaneError>;
}

impl<T: Dataplane + ?Sized> Lookups for T {
    fn flow(&self, key: &FlowKey) -> Result<Option<FlowEntry>, DataplaneError> {
        Dataplane::flow(self, key)
    }

    fn embryo(&self, index: u32) -> Result<Embryo, DataplaneError> {
        Dataplane::embryo(self, index)
    }

    fn is_hot_source(&self, key: &SourceKey) -> Result<bool, DataplaneError> {
        Dataplane::is_hot_source(self, key)
    }
}

/// Explain's lookups of one flow, on the read side: an explain does not wait for a table
/// write (the writer holds the data path's lock while it writes, not these handles).
pub struct FlowLookups(LookupSource);

enum LookupSource {
    /// Handles of its own on the kernel's connection, embryonic and hot-source maps.
    Maps(Box<LookupMaps>),
    /// A data path without maps of its own to share (the in-memory one of unit tests):
    /// read through its lock.
    Shared(Arc<Mutex<Box<dyn Dataplane + Send>>>),
}

struct LookupMaps {
    conntrack: BpfHashMap<MapData, FlowKey, FlowEntry>,
    embryonic: Array<MapData, Embryo>,
    hot_sources: BpfHashMap<MapData, SourceKey, u32>,
}

impl FlowLookups {
    /// Lookups through handles of their own on these maps (duplicated descriptors).
    pub(super) fn of(
        conntrack: &BpfHashMap<MapData, FlowKey, FlowEntry>,
        embryonic: &Array<MapData, Embryo>,
        hot_sources: &BpfHashMap<MapData, SourceKey, u32>,
    ) -> Result<Self, DataplaneError> {
        use aya::maps::{IterableMap, Map};
        let embryonic = dup_map(IterableMap::map(embryonic), MAP_EMBRYONIC)?;
        let hot_sources = dup_map(IterableMap::map(hot_sources), MAP_HOT_SOURCES)?;
        Ok(Self(LookupSource::Maps(Box::new(LookupMaps {
            conntrack: own_handle(conntrack)?,
            embryonic: Array::try_from(Map::Array(embryonic)).map_err(in_map(MAP_EMBRYONIC))?,
            hot_sources: BpfHashMap::try_from(Map::HashMap(hot_sources))
                .map_err(in_map(MAP_HOT_SOURCES))?,
        }))))
    }

    /// Lookups through `dataplane`'s lock, for a data path without own handles to give.
    pub fn shared(dataplane: Arc<Mutex<Box<dyn Dataplane + Send>>>) -> Self {
        Self(LookupSource::Shared(dataplane))
    }

    fn through_lock<R>(
        dataplane: &Mutex<Box<dyn Dataplane + Send>>,
        read: impl FnOnce(&dyn Dataplane) -> R,
    ) -> R {
        read(dataplane.lock().expect("data path poisoned").as_ref())
    }
}

impl Lookups for FlowLookups {
    fn flow(&self, key: &FlowKey) -> Result<Option<FlowEntry>, DataplaneError> {
        match &self.0 {
            LookupSource::Maps(maps) => match maps.conntrack.get(key, 0) {
                Ok(entry) => Ok(Some(entry)),
                Err(aya::maps::MapError::KeyNotFound) => Ok(None),
                Err(source) => Err(in_map(MAP_CONNTRACK)(source)),
            },
            LookupSource::Shared(dataplane) => Self::through_lock(dataplane, |d| d.flow(key)),
        }
    }

    fn embryo(&self, index: u32) -> Result<Embryo, DataplaneError> {
        match &self.0 {
            LookupSource::Maps(maps) => {
                maps.embryonic.get(&index, 0).map_err(in_map(MAP_EMBRYONIC))
            }
            LookupSource::Shared(dataplane) => Self::through_lock(dataplane, |d| d.embryo(index)),
        }
    }

    fn is_hot_source(&self, key: &SourceKey) -> Result<bool, DataplaneError> {
        match &self.0 {
            LookupSource::Maps(maps) => match maps.hot_sources.get(key, 0) {
                Ok(_) => Ok(true),
                Err(aya::maps::MapError::KeyNotFound) => Ok(false),
                Err(source) => Err(in_map(MAP_HOT_SOURCES)(source)),
            },
            LookupSource::Shared(dataplane) => {
                Self::through_lock(dataplane, |d| d.is_hot_source(key))
            }
        }
    }
}

/// Writes entries learned from cluster peers into the connection table: a handle of its
/// own, owned by the table writer (`writer::DataplaneWrites`) like every data-path write.
pub struct FlowWriter(BpfHashMap<MapData, FlowKey, FlowEntry>);

impl FlowWriter {
    pub(super) fn of(
        conntrack: &BpfHashMap<MapData, FlowKey, FlowEntry>,
    ) -> Result<Self, DataplaneError> {
        Ok(FlowWriter(own_handle(conntrack)?))
    }

    /// Inserts `entry` unless the flow has one already (BPF_NOEXIST: what this node's
    /// own packets decided wins). Returns whether it was inserted.
    pub fn insert_new(&mut self, key: &FlowKey, entry: &FlowEntry) -> Result<bool, DataplaneError> {
        const BPF_NOEXIST: u64 = 1;
        match self.0.insert(key, entry, BPF_NOEXIST) {
            Ok(()) => Ok(true),
            Err(aya::maps::MapError::SyscallError(e))
                if e.io_error.raw_os_error() == Some(libc::EEXIST) =>
            {
                Ok(false)
            }
            Err(source) => Err(in_map(MAP_CONNTRACK)(source)),
        }
    }
}

fn read_flows(
    map: &BpfHashMap<MapData, FlowKey, FlowEntry>,
) -> Result<Vec<(FlowKey, FlowEntry)>, DataplaneError> {
    match read_flows_batched(map) {
        Err(error) if batch_unsupported(&error) => read_flows_by_key(map),
        read => read,
    }
}

/// A kernel without batch lookups: EINVAL (no such command, before 5.6) or the kernel's
/// own ENOTSUPP, 524 (none for this map type). Any other error is a real one.
fn batch_unsupported(error: &DataplaneError) -> bool {
    match error {
        DataplaneError::Map {
            source: aya::maps::MapError::SyscallError(e),
            ..
        } => matches!(
            e.io_error.raw_os_error(),
            Some(libc::EINVAL | libc::ENOTSUP | KERNEL_ENOTSUPP)
        ),
        _ => false,
    }
}

/// [`read_flows`] with BPF_MAP_LOOKUP_BATCH only.
fn read_flows_batched(
    map: &BpfHashMap<MapData, FlowKey, FlowEntry>,
) -> Result<Vec<(FlowKey, FlowEntry)>, DataplaneError> {
    let fd = aya::maps::IterableMap::map(map).fd().as_fd().as_raw_fd();
    lookup_flows_batch(fd)
        .map_err(|source| syscall_error(MAP_CONNTRACK, "bpf_map_lookup_batch", source))
}

/// [`read_flows`] one key at a time (two bpf(2) calls per entry).
fn read_flows_by_key(
    map: &BpfHashMap<MapData, FlowKey, FlowEntry>,
) -> Result<Vec<(FlowKey, FlowEntry)>, DataplaneError> {
    let mut flows = Vec::new();
    for item in map.iter() {
        match item {
            Ok(flow) => flows.push(flow),
            // An entry evicted between listing its key and reading it.
            Err(aya::maps::MapError::KeyNotFound) => continue,
            Err(source) => {
                return Err(in_map(MAP_CONNTRACK)(source));
            }
        }
    }
    Ok(flows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_missing_batch_command_falls_back_to_key_by_key() {
        let error = |errno: i32| {
            let io_error = std::io::Error::from_raw_os_error(errno);
            syscall_error(MAP_CONNTRACK, "bpf_map_lookup_batch", io_error)
        };
        for errno in [libc::EINVAL, KERNEL_ENOTSUPP, libc::ENOTSUP] {
            assert!(batch_unsupported(&error(errno)), "errno {errno}");
        }
        for errno in [libc::EFAULT, libc::ENOSPC, libc::EPERM, libc::ENOMEM] {
            assert!(!batch_unsupported(&error(errno)), "errno {errno}");
        }
        assert!(!batch_unsupported(&DataplaneError::NoObject));
    }
}
