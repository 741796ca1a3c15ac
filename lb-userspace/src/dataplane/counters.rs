//! Reads of the data path's counters through map handles of their own: a status, a
//! scrape or a rate sample reads them without the lock the table writer holds while it
//! writes (the read side split from the write side, as Cilium splits its LBMaps).
//! The kernel's `Dataplane::counters` reads through the same functions.

use std::sync::{Arc, Mutex};

use aya::maps::{IterableMap, Map, MapData, PerCpuArray, PerCpuHashMap};
use lb_common::{
    MAP_BACKEND_STATS, MAP_EGRESS_STATS, MAP_QUIC_STATS, MAP_SOURCES, MAP_STATS, MAP_VIP_STATS,
    Outcomes, PacketCounters, SourceKey, TrafficCounters, quic::QuicCounters, stat,
};

use super::{Counters, Dataplane, DataplaneError, dup_map, in_map};

/// The counter maps, as the kernel's data path holds them (borrowed).
pub(super) struct CounterMaps<'a> {
    pub stats: &'a PerCpuArray<MapData, Outcomes>,
    pub vip_stats: &'a PerCpuArray<MapData, PacketCounters>,
    pub backend_stats: &'a PerCpuArray<MapData, TrafficCounters>,
    pub sources: &'a PerCpuHashMap<MapData, SourceKey, u64>,
    pub quic_stats: &'a PerCpuArray<MapData, QuicCounters>,
    pub egress_stats: &'a PerCpuArray<MapData, PacketCounters>,
    /// How many interfaces frames leave by (`LoadOptions::egress_count`); their counters
    /// are read only when there are several.
    pub egress_count: u32,
}

/// A reader's own handles on the counter maps.
struct OwnedCounterMaps {
    stats: PerCpuArray<MapData, Outcomes>,
    vip_stats: PerCpuArray<MapData, PacketCounters>,
    backend_stats: PerCpuArray<MapData, TrafficCounters>,
    sources: PerCpuHashMap<MapData, SourceKey, u64>,
    quic_stats: PerCpuArray<MapData, QuicCounters>,
    egress_stats: PerCpuArray<MapData, PacketCounters>,
    egress_count: u32,
}

impl OwnedCounterMaps {
    fn view(&self) -> CounterMaps<'_> {
        CounterMaps {
            stats: &self.stats,
            vip_stats: &self.vip_stats,
            backend_stats: &self.backend_stats,
            sources: &self.sources,
            quic_stats: &self.quic_stats,
            egress_stats: &self.egress_stats,
            egress_count: self.egress_count,
        }
    }
}

impl CounterMaps<'_> {
    /// Handles of their own on the same maps.
    fn own_handles(&self) -> Result<OwnedCounterMaps, DataplaneError> {
        Ok(OwnedCounterMaps {
            stats: own_array(self.stats, MAP_STATS)?,
            vip_stats: own_array(self.vip_stats, MAP_VIP_STATS)?,
            backend_stats: own_array(self.backend_stats, MAP_BACKEND_STATS)?,
            // LB_SOURCES is an LRU per-CPU hash map.
            sources: PerCpuHashMap::try_from(Map::PerCpuLruHashMap(dup_map(
                IterableMap::map(self.sources),
                MAP_SOURCES,
            )?))
            .map_err(in_map(MAP_SOURCES))?,
            quic_stats: own_array(self.quic_stats, MAP_QUIC_STATS)?,
            egress_stats: own_array(self.egress_stats, MAP_EGRESS_STATS)?,
            egress_count: self.egress_count,
        })
    }

    /// The outcome counters (indexed by `stat`), summed over CPUs.
    pub fn outcomes(&self) -> Result<Vec<u64>, DataplaneError> {
        Ok(self.outcomes_and_entries()?.0)
    }

    /// The outcome counters, and per CPU the flows that made an entry or would have
    /// made one outside a stable slot (`Counters::entries_per_cpu`).
    fn outcomes_and_entries(&self) -> Result<(Vec<u64>, Vec<u64>), DataplaneError> {
        let per_cpu = self.stats.get(&0, 0).map_err(in_map(MAP_STATS))?;
        let mut sums = vec![0u64; stat::COUNT as usize];
        let mut entries = Vec::new();
        for outcomes in per_cpu.iter() {
            for (sum, count) in sums.iter_mut().zip(outcomes.counts) {
                *sum += count;
            }
            entries.push(crate::turnover::entries_made(
                outcomes.counts[stat::CT_PROMOTED as usize],
                outcomes.counts[stat::CT_INSERT_SKIPPED as usize],
            ));
        }
        Ok((sums, entries))
    }

    pub fn counters(
        &self,
        vip_ids: &[u32],
        backend_ids: &[u32],
    ) -> Result<Counters, DataplaneError> {
        let (outcomes, entries_per_cpu) = self.outcomes_and_entries()?;
        let mut counters = Counters {
            outcomes,
            entries_per_cpu,
            ..Counters::default()
        };
        for &id in vip_ids {
            counters
                .vips
                .insert(id, sum_packets(self.vip_stats, MAP_VIP_STATS, id)?);
            let quic = self
                .quic_stats
                .get(&id, 0)
                .map_err(in_map(MAP_QUIC_STATS))?;
            let sum = quic
                .iter()
                .fold(QuicCounters::default(), |sum, c| QuicCounters {
                    routed_by_cid: sum.routed_by_cid + c.routed_by_cid,
                    cid_unknown: sum.cid_unknown + c.cid_unknown,
                });
            counters.quic.insert(id, sum);
        }
        for &id in backend_ids {
            counters
                .backends
                .insert(id, sum_backend(self.backend_stats, id)?);
        }
        if self.egress_count > 1 {
            counters.egress = (0..self.egress_count)
                .map(|index| sum_packets(self.egress_stats, MAP_EGRESS_STATS, index))
                .collect::<Result<_, _>>()?;
        }
        Ok(counters)
    }

    pub fn sources(&self) -> Result<Vec<(SourceKey, u64)>, DataplaneError> {
        let mut sources = Vec::new();
        for item in self.sources.iter() {
            match item {
                Ok((key, per_cpu)) => sources.push((key, per_cpu.iter().sum())),
                Err(aya::maps::MapError::KeyNotFound) => continue,
                Err(source) => return Err(in_map(MAP_SOURCES)(source)),
            }
        }
        Ok(sources)
    }
}

/// A handle of its own on per-CPU array `name`.
fn own_array<V: aya::Pod>(
    map: &PerCpuArray<MapData, V>,
    name: &'static str,
) -> Result<PerCpuArray<MapData, V>, DataplaneError> {
    PerCpuArray::try_from(Map::PerCpuArray(dup_map(IterableMap::map(map), name)?))
        .map_err(in_map(name))
}

/// A VIP's or an interface's counters (`PacketCounters`), summed over CPUs; no handshakes.
fn sum_packets(
    map: &PerCpuArray<MapData, PacketCounters>,
    name: &'static str,
    index: u32,
) -> Result<TrafficCounters, DataplaneError> {
    let values = map.get(&index, 0).map_err(in_map(name))?;
    let sum = values
        .iter()
        .fold(PacketCounters::default(), |sum, c| PacketCounters {
            packets: sum.packets + c.packets,
            bytes: sum.bytes + c.bytes,
            new_flows: sum.new_flows + c.new_flows,
            _reserved: 0,
        });
    Ok(TrafficCounters {
        packets: sum.packets,
        bytes: sum.bytes,
        new_flows: sum.new_flows,
        ..TrafficCounters::default()
    })
}

/// A backend's counters, handshakes included, summed over CPUs.
fn sum_backend(
    map: &PerCpuArray<MapData, TrafficCounters>,
    index: u32,
) -> Result<TrafficCounters, DataplaneError> {
    let values = map.get(&index, 0).map_err(in_map(MAP_BACKEND_STATS))?;
    Ok(values
        .iter()
        .fold(TrafficCounters::default(), |sum, c| TrafficCounters {
            packets: sum.packets + c.packets,
            bytes: sum.bytes + c.bytes,
            new_flows: sum.new_flows + c.new_flows,
            _reserved: 0,
            handshakes: std::array::from_fn(|i| sum.handshakes[i] + c.handshakes[i]),
        }))
}

/// The read side of the data path's counters.
pub struct CounterReader(Source);

enum Source {
    /// Handles of its own on the kernel's maps: no lock.
    Maps(Box<OwnedCounterMaps>),
    /// A data path without maps of its own to share (the in-memory one of unit tests):
    /// read through its lock.
    Shared(Arc<Mutex<Box<dyn Dataplane + Send>>>),
}

impl CounterReader {
    pub(super) fn of(maps: &CounterMaps<'_>) -> Result<Self, DataplaneError> {
        Ok(Self(Source::Maps(Box::new(maps.own_handles()?))))
    }

    /// A reader through `dataplane`'s lock, for a data path without own handles to give.
    pub fn shared(dataplane: Arc<Mutex<Box<dyn Dataplane + Send>>>) -> Self {
        Self(Source::Shared(dataplane))
    }

    /// The outcome counters and those of these VIPs and backends.
    pub fn counters(
        &self,
        vip_ids: &[u32],
        backend_ids: &[u32],
    ) -> Result<Counters, DataplaneError> {
        match &self.0 {
            Source::Maps(maps) => maps.view().counters(vip_ids, backend_ids),
            Source::Shared(dataplane) => lock(dataplane).counters(vip_ids, backend_ids),
        }
    }

    /// New flows per source (`LB_SOURCES`), summed over CPUs.
    pub fn sources(&self) -> Result<Vec<(SourceKey, u64)>, DataplaneError> {
        match &self.0 {
            Source::Maps(maps) => maps.view().sources(),
            Source::Shared(dataplane) => lock(dataplane).sources(),
        }
    }
}

fn lock(
    dataplane: &Mutex<Box<dyn Dataplane + Send>>,
) -> std::sync::MutexGuard<'_, Box<dyn Dataplane + Send>> {
    dataplane.lock().expect("data path poisoned")
}
