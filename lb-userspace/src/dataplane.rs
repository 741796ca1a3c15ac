//! How tables are written: a small `Dataplane` trait, implemented over the real BPF maps
//! (`AyaDataplane`) and in memory (`MemoryDataplane`, for unit tests of what is written
//! and in which order).

use std::{collections::HashMap, time::Duration};

use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, HashMap as BpfHashMap, MapData, PerCpuArray},
    programs::{Xdp, XdpMode},
};
use lb_common::{
    BackendInfo, FlowEntry, FlowKey, GLOBAL_CT_INSERT_LIMIT, GLOBAL_IFACE_MAC, GLOBAL_MAGLEV_SIZE,
    GLOBAL_UDP_IDLE_NS, MAP_BACKEND_STATS, MAP_BACKENDS, MAP_CONNTRACK, MAP_MAGLEV, MAP_STATS,
    MAP_VIP_STATS, MAP_VIPS, MAX_BACKENDS, MAX_VIPS, TABLE_GENERATIONS, TrafficCounters, VipInfo,
    VipKey, stat,
};

use crate::config::{Config, XdpModeSetting};

#[derive(Debug, thiserror::Error)]
pub enum DataplaneError {
    #[error("the eBPF object is empty: this binary was built with AYA_BUILD_SKIP=1")]
    NoObject,
    #[error("loading the eBPF object")]
    Load(#[from] aya::EbpfError),
    #[error("map {map}")]
    Map {
        map: &'static str,
        source: aya::maps::MapError,
    },
    #[error("program {program}")]
    Program {
        program: &'static str,
        source: aya::programs::ProgramError,
    },
    #[error("attaching to {interface} in {mode} mode")]
    Attach {
        interface: String,
        mode: &'static str,
        source: aya::programs::ProgramError,
    },
    #[error("map {map} missing from the eBPF object")]
    MissingMap { map: &'static str },
}

/// Summed (over CPUs) counters of the data path.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// Indexed by `lb_common::stat`.
    pub outcomes: Vec<u64>,
    pub vips: HashMap<u32, TrafficCounters>,
    pub backends: HashMap<u32, TrafficCounters>,
}

/// What the agent needs of a data path.
pub trait Dataplane {
    /// Writes `(slot, backend id)` pairs into `LB_MAGLEV`.
    fn write_slots(&mut self, slots: &[(u32, u32)]) -> Result<(), DataplaneError>;
    fn set_vip(&mut self, key: &VipKey, info: &VipInfo) -> Result<(), DataplaneError>;
    fn remove_vip(&mut self, key: &VipKey) -> Result<(), DataplaneError>;
    fn set_backend(&mut self, id: u32, info: &BackendInfo) -> Result<(), DataplaneError>;
    /// Counters of the given VIP and backend ids.
    fn counters(&self, vip_ids: &[u32], backend_ids: &[u32]) -> Result<Counters, DataplaneError>;
    /// The connection-table entry of one flow.
    fn flow(&self, key: &FlowKey) -> Result<Option<FlowEntry>, DataplaneError>;
    /// Every connection-table entry (a syscall or two per entry: call it off the hot path).
    fn flows(&self) -> Result<Vec<(FlowKey, FlowEntry)>, DataplaneError>;
}

/// The XDP mode that was actually attached.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum AttachedMode {
    Native,
    Generic,
}

impl std::fmt::Display for AttachedMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            AttachedMode::Native => "native",
            AttachedMode::Generic => "generic",
        })
    }
}

/// Load-time parameters of the program.
#[derive(Clone, Copy, Debug)]
pub struct LoadOptions {
    pub maglev_table_size: u32,
    /// How many VIPs the table map has room for (each gets `TABLE_GENERATIONS` tables).
    pub vip_capacity: u32,
    pub iface_mac: [u8; 6],
    pub conntrack_entries: u32,
    /// UDP entries idle this long are re-balanced.
    pub flow_idle: Duration,
    /// Connection-table inserts per second per CPU; 0: unlimited.
    pub conntrack_insert_limit: u64,
}

impl LoadOptions {
    /// The options a configuration asks for.
    pub fn from_config(config: &Config, iface_mac: [u8; 6]) -> Self {
        Self {
            maglev_table_size: config.dataplane.maglev_table_size,
            vip_capacity: vip_capacity(config.vips.len()),
            iface_mac,
            conntrack_entries: config.dataplane.conntrack_entries,
            flow_idle: config.dataplane.flow_idle_timeout,
            conntrack_insert_limit: config.dataplane.conntrack_insert_limit,
        }
    }
}

/// VIP capacity for a configuration with `vips` VIPs: room to grow by reload without
/// reloading the program, within MAX_VIPS.
pub fn vip_capacity(vips: usize) -> u32 {
    (vips as u32 * 2).clamp(16, MAX_VIPS)
}

/// The real data path: the program loaded into the kernel and its maps.
pub struct AyaDataplane {
    // Dropping `Ebpf` detaches the program and frees the maps; keep it for our lifetime.
    ebpf: Ebpf,
    vips: BpfHashMap<MapData, VipKey, VipInfo>,
    maglev: Array<MapData, u32>,
    backends: Array<MapData, BackendInfo>,
    stats: PerCpuArray<MapData, u64>,
    vip_stats: PerCpuArray<MapData, TrafficCounters>,
    backend_stats: PerCpuArray<MapData, TrafficCounters>,
    conntrack: BpfHashMap<MapData, FlowKey, FlowEntry>,
}

impl AyaDataplane {
    /// Loads (not attaches) the `lb_xdp` program from `object`.
    pub fn load(object: &[u8], options: LoadOptions) -> Result<Self, DataplaneError> {
        if object.is_empty() {
            return Err(DataplaneError::NoObject);
        }
        let maglev_entries = options.vip_capacity * TABLE_GENERATIONS * options.maglev_table_size;
        let udp_idle_ns = options.flow_idle.as_nanos().min(u64::MAX as u128) as u64;
        let mut ebpf = EbpfLoader::new()
            .override_global(GLOBAL_MAGLEV_SIZE, &options.maglev_table_size, true)
            .override_global(GLOBAL_IFACE_MAC, &options.iface_mac, true)
            .override_global(GLOBAL_UDP_IDLE_NS, &udp_idle_ns, true)
            .override_global(
                GLOBAL_CT_INSERT_LIMIT,
                &options.conntrack_insert_limit,
                true,
            )
            .map_max_entries(MAP_MAGLEV, maglev_entries)
            .map_max_entries(MAP_CONNTRACK, options.conntrack_entries)
            .load(object)?;
        let program: &mut Xdp = program(&mut ebpf)?;
        program.load().map_err(|source| DataplaneError::Program {
            program: "lb_xdp",
            source,
        })?;
        Ok(Self {
            vips: take_map(&mut ebpf, MAP_VIPS)?,
            maglev: take_map(&mut ebpf, MAP_MAGLEV)?,
            backends: take_map(&mut ebpf, MAP_BACKENDS)?,
            stats: take_map(&mut ebpf, MAP_STATS)?,
            vip_stats: take_map(&mut ebpf, MAP_VIP_STATS)?,
            backend_stats: take_map(&mut ebpf, MAP_BACKEND_STATS)?,
            conntrack: take_map(&mut ebpf, MAP_CONNTRACK)?,
            ebpf,
        })
    }

    /// Attaches to `interface`. `Auto` tries native (driver) mode, then generic.
    pub fn attach(
        &mut self,
        interface: &str,
        mode: XdpModeSetting,
    ) -> Result<AttachedMode, DataplaneError> {
        let program = program(&mut self.ebpf)?;
        let mut try_attach = |attached: AttachedMode| {
            let (xdp_mode, name) = match attached {
                AttachedMode::Native => (XdpMode::Driver, "native"),
                AttachedMode::Generic => (XdpMode::Skb, "generic"),
            };
            program
                .attach(interface, xdp_mode)
                .map(|_| attached)
                .map_err(|source| DataplaneError::Attach {
                    interface: interface.to_string(),
                    mode: name,
                    source,
                })
        };
        match mode {
            XdpModeSetting::Native => try_attach(AttachedMode::Native),
            XdpModeSetting::Generic => try_attach(AttachedMode::Generic),
            XdpModeSetting::Auto => {
                try_attach(AttachedMode::Native).or_else(|_| try_attach(AttachedMode::Generic))
            }
        }
    }

    /// The loaded program, for BPF_PROG_TEST_RUN in tests and benchmarks.
    pub fn program_mut(&mut self) -> Result<&mut Xdp, DataplaneError> {
        program(&mut self.ebpf)
    }

    /// Writes a connection-table entry (tests: to age or plant an entry).
    pub fn insert_flow(&mut self, key: &FlowKey, entry: &FlowEntry) -> Result<(), DataplaneError> {
        self.conntrack
            .insert(key, entry, 0)
            .map_err(|source| DataplaneError::Map {
                map: MAP_CONNTRACK,
                source,
            })
    }

    /// The XDP_TX counter: how many packets were forwarded so far.
    pub fn forwarded(&self) -> Result<u64, DataplaneError> {
        self.outcome(stat::XDP_TX)
    }

    fn outcome(&self, index: u32) -> Result<u64, DataplaneError> {
        let values = self
            .stats
            .get(&index, 0)
            .map_err(|source| DataplaneError::Map {
                map: MAP_STATS,
                source,
            })?;
        Ok(values.iter().sum())
    }
}

fn program(ebpf: &mut Ebpf) -> Result<&mut Xdp, DataplaneError> {
    let program = ebpf.program_mut("lb_xdp").ok_or(DataplaneError::Program {
        program: "lb_xdp",
        source: aya::programs::ProgramError::NotLoaded,
    })?;
    program
        .try_into()
        .map_err(|source| DataplaneError::Program {
            program: "lb_xdp",
            source,
        })
}

fn take_map<T>(ebpf: &mut Ebpf, name: &'static str) -> Result<T, DataplaneError>
where
    T: TryFrom<aya::maps::Map, Error = aya::maps::MapError>,
{
    let map = ebpf
        .take_map(name)
        .ok_or(DataplaneError::MissingMap { map: name })?;
    T::try_from(map).map_err(|source| DataplaneError::Map { map: name, source })
}

fn sum_per_cpu(
    map: &PerCpuArray<MapData, TrafficCounters>,
    name: &'static str,
    index: u32,
) -> Result<TrafficCounters, DataplaneError> {
    let values = map
        .get(&index, 0)
        .map_err(|source| DataplaneError::Map { map: name, source })?;
    Ok(values
        .iter()
        .fold(TrafficCounters::default(), |sum, c| TrafficCounters {
            packets: sum.packets + c.packets,
            bytes: sum.bytes + c.bytes,
            new_flows: sum.new_flows + c.new_flows,
            _reserved: 0,
        }))
}

impl Dataplane for AyaDataplane {
    fn write_slots(&mut self, slots: &[(u32, u32)]) -> Result<(), DataplaneError> {
        for &(slot, id) in slots {
            self.maglev
                .set(slot, id, 0)
                .map_err(|source| DataplaneError::Map {
                    map: MAP_MAGLEV,
                    source,
                })?;
        }
        Ok(())
    }

    fn set_vip(&mut self, key: &VipKey, info: &VipInfo) -> Result<(), DataplaneError> {
        self.vips
            .insert(key, info, 0)
            .map_err(|source| DataplaneError::Map {
                map: MAP_VIPS,
                source,
            })
    }

    fn remove_vip(&mut self, key: &VipKey) -> Result<(), DataplaneError> {
        self.vips.remove(key).map_err(|source| DataplaneError::Map {
            map: MAP_VIPS,
            source,
        })
    }

    fn set_backend(&mut self, id: u32, info: &BackendInfo) -> Result<(), DataplaneError> {
        debug_assert!(id < MAX_BACKENDS);
        self.backends
            .set(id, info, 0)
            .map_err(|source| DataplaneError::Map {
                map: MAP_BACKENDS,
                source,
            })
    }

    fn counters(&self, vip_ids: &[u32], backend_ids: &[u32]) -> Result<Counters, DataplaneError> {
        let outcomes = (0..stat::COUNT)
            .map(|i| self.outcome(i))
            .collect::<Result<Vec<_>, _>>()?;
        let mut counters = Counters {
            outcomes,
            ..Counters::default()
        };
        for &id in vip_ids {
            counters
                .vips
                .insert(id, sum_per_cpu(&self.vip_stats, MAP_VIP_STATS, id)?);
        }
        for &id in backend_ids {
            counters
                .backends
                .insert(id, sum_per_cpu(&self.backend_stats, MAP_BACKEND_STATS, id)?);
        }
        Ok(counters)
    }

    fn flow(&self, key: &FlowKey) -> Result<Option<FlowEntry>, DataplaneError> {
        match self.conntrack.get(key, 0) {
            Ok(entry) => Ok(Some(entry)),
            Err(aya::maps::MapError::KeyNotFound) => Ok(None),
            Err(source) => Err(DataplaneError::Map {
                map: MAP_CONNTRACK,
                source,
            }),
        }
    }

    fn flows(&self) -> Result<Vec<(FlowKey, FlowEntry)>, DataplaneError> {
        let mut flows = Vec::new();
        for item in self.conntrack.iter() {
            match item {
                Ok(flow) => flows.push(flow),
                // An entry evicted between listing its key and reading it.
                Err(aya::maps::MapError::KeyNotFound) => continue,
                Err(source) => {
                    return Err(DataplaneError::Map {
                        map: MAP_CONNTRACK,
                        source,
                    });
                }
            }
        }
        Ok(flows)
    }
}

/// One write to the data path, as recorded by `MemoryDataplane`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Write {
    Slots(Vec<(u32, u32)>),
    Vip(VipKey, VipInfo),
    RemoveVip(VipKey),
    Backend(u32, BackendInfo),
}

/// An in-memory data path that does what the kernel's maps do and records every write.
#[derive(Debug, Default)]
pub struct MemoryDataplane {
    pub vips: HashMap<VipKey, VipInfo>,
    pub maglev: HashMap<u32, u32>,
    pub backends: HashMap<u32, BackendInfo>,
    pub flows: HashMap<FlowKey, FlowEntry>,
    pub log: Vec<Write>,
}

impl Dataplane for MemoryDataplane {
    fn write_slots(&mut self, slots: &[(u32, u32)]) -> Result<(), DataplaneError> {
        self.maglev.extend(slots.iter().copied());
        self.log.push(Write::Slots(slots.to_vec()));
        Ok(())
    }

    fn set_vip(&mut self, key: &VipKey, info: &VipInfo) -> Result<(), DataplaneError> {
        self.vips.insert(*key, *info);
        self.log.push(Write::Vip(*key, *info));
        Ok(())
    }

    fn remove_vip(&mut self, key: &VipKey) -> Result<(), DataplaneError> {
        self.vips.remove(key);
        self.log.push(Write::RemoveVip(*key));
        Ok(())
    }

    fn set_backend(&mut self, id: u32, info: &BackendInfo) -> Result<(), DataplaneError> {
        self.backends.insert(id, *info);
        self.log.push(Write::Backend(id, *info));
        Ok(())
    }

    fn counters(&self, _: &[u32], _: &[u32]) -> Result<Counters, DataplaneError> {
        Ok(Counters {
            outcomes: vec![0; stat::COUNT as usize],
            ..Counters::default()
        })
    }

    fn flow(&self, key: &FlowKey) -> Result<Option<FlowEntry>, DataplaneError> {
        Ok(self.flows.get(key).copied())
    }

    fn flows(&self) -> Result<Vec<(FlowKey, FlowEntry)>, DataplaneError> {
        Ok(self.flows.iter().map(|(k, v)| (*k, *v)).collect())
    }
}
