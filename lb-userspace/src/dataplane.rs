//! How tables are written: a small `Dataplane` trait, implemented over the real BPF maps
//! (`AyaDataplane`) and in memory (`MemoryDataplane`, for unit tests of what is written
//! and in which order).

use std::os::fd::{AsFd, AsRawFd};

use bytemuck::Zeroable;
use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    time::Duration,
};

use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, HashMap as BpfHashMap, IterableMap, MapData, PerCpuArray, PerCpuHashMap},
    programs::{
        Xdp, XdpMode,
        links::{FdLink, PinnedLink},
        xdp::{XdpLink, XdpLinkId},
    },
};
use lb_common::{
    BackendIdentity, BackendInfo, FlowEntry, FlowKey, GLOBAL_CAPTURE_RATE, GLOBAL_CT_INSERT_LIMIT,
    GLOBAL_IFACE_MAC, GLOBAL_MAGLEV_SIZE, GLOBAL_UDP_IDLE_NS, LAYOUT_VERSION, MAP_BACKEND_IDS,
    MAP_BACKEND_STATS, MAP_BACKENDS, MAP_CAPTURE, MAP_CONNTRACK, MAP_FLOOD, MAP_MAGLEV, MAP_META,
    MAP_SOURCES, MAP_STATS, MAP_VIP_SLOTS, MAP_VIP_STATS, MAP_VIPS, MAX_BACKENDS, MAX_VIPS,
    Outcomes, SourceKey, TABLE_GENERATIONS, TrafficCounters, VIP_SLOT_SHARED, VIP_SLOT_USED,
    VIP_SLOTS, VipInfo, VipKey, VipSlot, meta, stat,
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
    #[error("counting the possible CPUs")]
    Cpus(#[source] std::io::Error),
    #[error("map {map} missing from the eBPF object")]
    MissingMap { map: &'static str },
    #[error("pin directory {path}")]
    Pin {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("pinned link {path}")]
    Link {
        path: PathBuf,
        source: aya::programs::links::LinkError,
    },
    #[error("pinning the link at {path}")]
    PinLink {
        path: PathBuf,
        source: aya::pin::PinError,
    },
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
    /// Writes a backend's data-path entry and, for restarts, which backend the id names.
    fn set_backend(
        &mut self,
        id: u32,
        info: &BackendInfo,
        identity: &BackendIdentity,
    ) -> Result<(), DataplaneError>;
    /// Zeroes a VIP id's traffic counters (a new VIP must not inherit an old one's).
    fn reset_vip_counters(&mut self, vip_id: u32) -> Result<(), DataplaneError>;
    /// Zeroes a backend id's traffic counters.
    fn reset_backend_counters(&mut self, backend_id: u32) -> Result<(), DataplaneError>;
    /// Counters of the given VIP and backend ids.
    fn counters(&self, vip_ids: &[u32], backend_ids: &[u32]) -> Result<Counters, DataplaneError>;
    /// The connection-table entry of one flow.
    fn flow(&self, key: &FlowKey) -> Result<Option<FlowEntry>, DataplaneError>;
    /// A handle that reads the connection table on its own, so a long scan need not
    /// hold the agent's lock.
    fn flow_reader(&self) -> Result<FlowReader, DataplaneError>;
    /// New flows per client source and VIP (summed over CPUs) since the program loaded.
    fn sources(&self) -> Result<Vec<(SourceKey, u64)>, DataplaneError>;
}

/// The XDP mode that was actually attached.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
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
    /// Frames per second per CPU copied to the debug capture; 0: off.
    pub capture_rate: u64,
    /// One new flow in this many is counted for heavy hitters.
    pub source_sample: u32,
    /// The interface the program is for (0: not known, as in tests without one); pinned
    /// state of another interface is not adopted.
    pub ifindex: u32,
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
            capture_rate: config.debug.program_rate(),
            source_sample: lb_common::DEFAULT_SOURCE_SAMPLE,
            ifindex: 0,
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
    vip_slots: Array<MapData, VipSlot>,
    /// What `LB_VIPS` holds, which the slots are built from.
    vip_infos: HashMap<VipKey, VipInfo>,
    /// What each written slot of `LB_VIP_SLOTS` holds (absent: zeroes).
    slots: HashMap<u32, VipSlot>,
    maglev: Array<MapData, u32>,
    backends: Array<MapData, BackendInfo>,
    stats: PerCpuArray<MapData, Outcomes>,
    vip_stats: PerCpuArray<MapData, TrafficCounters>,
    backend_stats: PerCpuArray<MapData, TrafficCounters>,
    conntrack: BpfHashMap<MapData, FlowKey, FlowEntry>,
    sources: PerCpuHashMap<MapData, SourceKey, u64>,
    identities: Array<MapData, BackendIdentity>,
    meta: Array<MapData, u64>,
    /// Where the maps and the link are pinned, if they are.
    pin_dir: Option<PathBuf>,
    /// The options in force (adopted pins may have a larger VIP capacity than asked).
    options: LoadOptions,
    /// The mode of a pinned link on this interface that the program can take over.
    link_mode: Option<AttachedMode>,
    /// When incompatible pins were replaced: the backends the old program served.
    previous: Option<Adopted>,
    /// Whether the kernel takes batch map updates (BPF_MAP_UPDATE_BATCH).
    batch_writes: bool,
}

/// What a pinned load found in its pin directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Found {
    /// Nothing pinned: a first start.
    Nothing,
    /// Maps of this layout and these sizes, attached in this mode: adopted.
    Compatible(AttachedMode),
    /// Pinned state of another layout or other sizes: replaced (the connection table is
    /// lost).
    Incompatible(String),
}

/// What the data path holds, read back from adopted maps.
#[derive(Clone, Debug, Default)]
pub struct Adopted {
    pub vips: Vec<(VipKey, VipInfo)>,
    /// By backend id, the ids in use.
    pub backends: Vec<(u32, BackendInfo, BackendIdentity)>,
    /// By vip id, the slots of the table the VIP points at.
    pub tables: Vec<(u32, Vec<u32>)>,
    /// Backend ids a previous agent used and freed: connection-table entries may still
    /// name them, so they are reused last, after the quarantine.
    pub freed: Vec<u32>,
}

/// The name the link is pinned under, next to the maps.
const LINK_PIN: &str = "link";
/// Maps pinned (shared with a restarted agent); the rest are per program instance.
const PINNED_MAPS: [&str; 11] = [
    MAP_VIPS,
    MAP_VIP_SLOTS,
    MAP_MAGLEV,
    MAP_BACKENDS,
    MAP_STATS,
    MAP_VIP_STATS,
    MAP_BACKEND_STATS,
    MAP_CONNTRACK,
    MAP_FLOOD,
    MAP_BACKEND_IDS,
    MAP_META,
];

impl AyaDataplane {
    /// Loads (not attaches) the `lb_xdp` program from `object`, with maps of its own.
    pub fn load(object: &[u8], options: LoadOptions) -> Result<Self, DataplaneError> {
        let mut dataplane = Self::load_with(object, options, None)?;
        dataplane.mend_slots()?;
        Ok(dataplane)
    }

    /// Loads the program with its maps pinned in `dir`, adopting what a previous agent
    /// left there when it is of this layout and these sizes, and replacing it otherwise.
    pub fn load_pinned(
        object: &[u8],
        options: LoadOptions,
        dir: &Path,
    ) -> Result<(Self, Found), DataplaneError> {
        let mut options = options;
        let mut previous = None;
        let link_mode = pinned_link_mode(dir, &options);
        let found = inspect_pins(dir, &mut options);
        if let Found::Incompatible(_) = found {
            if link_mode.is_some() {
                // The backends the running program serves (ids, MACs, serving state), read
                // through the old maps while they are still pinned, so the new tables are
                // not empty while health checks start again. Unreadable (another layout):
                // backends start as a fresh agent's do.
                previous = Self::load_with(object, options, Some(dir))
                    .and_then(|old| old.adopted(0))
                    .ok()
                    .map(|adopted| Adopted {
                        backends: adopted.backends,
                        freed: adopted.freed,
                        ..Adopted::default()
                    });
                // New maps, same link: `attach_pinned` swaps the new program onto it, so
                // the interface is never without a program.
                remove_map_pins(dir)?;
            } else {
                remove_pins(dir)?;
            }
        }
        std::fs::create_dir_all(dir).map_err(|source| DataplaneError::Pin {
            path: dir.to_path_buf(),
            source,
        })?;
        let mut dataplane = Self::load_with(object, options, Some(dir))?;
        dataplane.mend_slots()?;
        dataplane.link_mode = link_mode;
        dataplane.previous = previous;
        if !matches!(found, Found::Compatible(_)) {
            dataplane.write_meta(None)?;
        }
        Ok((dataplane, found))
    }

    fn load_with(
        object: &[u8],
        options: LoadOptions,
        pins: Option<&Path>,
    ) -> Result<Self, DataplaneError> {
        if object.is_empty() {
            return Err(DataplaneError::NoObject);
        }
        let maglev_entries = options.vip_capacity * TABLE_GENERATIONS * options.maglev_table_size;
        let udp_idle_ns = options.flow_idle.as_nanos().min(u64::MAX as u128) as u64;
        let mut loader = EbpfLoader::new();
        loader
            .override_global(GLOBAL_MAGLEV_SIZE, &options.maglev_table_size, true)
            .override_global(GLOBAL_IFACE_MAC, &options.iface_mac, true)
            .override_global(GLOBAL_UDP_IDLE_NS, &udp_idle_ns, true)
            .override_global(
                GLOBAL_CT_INSERT_LIMIT,
                &options.conntrack_insert_limit,
                true,
            )
            .override_global(GLOBAL_CAPTURE_RATE, &options.capture_rate, true)
            .override_global(
                lb_common::GLOBAL_SOURCE_SAMPLE,
                &options.source_sample,
                true,
            )
            .map_max_entries(MAP_MAGLEV, maglev_entries)
            .map_max_entries(MAP_CONNTRACK, options.conntrack_entries);
        if let Some(dir) = pins {
            for name in PINNED_MAPS {
                loader.map_pin_path(name, dir.join(name));
            }
        }
        let mut ebpf = loader.load(object)?;
        let program: &mut Xdp = program(&mut ebpf)?;
        program.load().map_err(lb_xdp_error)?;
        let vips: BpfHashMap<MapData, VipKey, VipInfo> = take_map(&mut ebpf, MAP_VIPS)?;
        let vip_slots: Array<MapData, VipSlot> = take_map(&mut ebpf, MAP_VIP_SLOTS)?;
        // Adopted pins: what the slots and LB_VIPS hold already.
        let vip_infos = vips
            .iter()
            .collect::<Result<_, _>>()
            .map_err(in_map(MAP_VIPS))?;
        let mut slots = HashMap::new();
        for index in 0..VIP_SLOTS {
            let slot = vip_slots.get(&index, 0).map_err(in_map(MAP_VIP_SLOTS))?;
            if slot != VipSlot::zeroed() {
                slots.insert(index, slot);
            }
        }
        let dataplane = Self {
            vips,
            vip_slots,
            vip_infos,
            slots,
            maglev: take_map(&mut ebpf, MAP_MAGLEV)?,
            backends: take_map(&mut ebpf, MAP_BACKENDS)?,
            stats: take_map(&mut ebpf, MAP_STATS)?,
            vip_stats: take_map(&mut ebpf, MAP_VIP_STATS)?,
            backend_stats: take_map(&mut ebpf, MAP_BACKEND_STATS)?,
            conntrack: take_map(&mut ebpf, MAP_CONNTRACK)?,
            sources: take_map(&mut ebpf, MAP_SOURCES)?,
            identities: take_map(&mut ebpf, MAP_BACKEND_IDS)?,
            meta: take_map(&mut ebpf, MAP_META)?,
            pin_dir: pins.map(Path::to_path_buf),
            options,
            link_mode: None,
            previous: None,
            batch_writes: true,
            ebpf,
        };
        Ok(dataplane)
    }

    /// Mends any slot that does not match LB_VIPS (none, when adopted pins were ours).
    /// Not for an instance that only reads a running program's maps.
    fn mend_slots(&mut self) -> Result<(), DataplaneError> {
        let mut indexes: Vec<u32> = self.slots.keys().copied().collect();
        indexes.extend(self.vip_infos.keys().map(VipSlot::index));
        indexes.sort_unstable();
        indexes.dedup();
        for index in indexes {
            self.write_slot(index)?;
        }
        Ok(())
    }

    /// Brings slot `index` to what `vip_infos` says it should hold, in steps the program
    /// can read at any point (`slot_steps`).
    fn write_slot(&mut self, index: u32) -> Result<(), DataplaneError> {
        let current = self
            .slots
            .get(&index)
            .copied()
            .unwrap_or_else(VipSlot::zeroed);
        let keys: Vec<(&VipKey, &VipInfo)> = self
            .vip_infos
            .iter()
            .filter(|(key, _)| VipSlot::index(key) == index)
            .collect();
        let target = target_slot(&current, &keys);
        for step in slot_steps(&current, &target) {
            self.vip_slots
                .set(index, step, 0)
                .map_err(in_map(MAP_VIP_SLOTS))?;
            self.slots.insert(index, step);
        }
        Ok(())
    }

    /// Records the layout, sizes and interface in force (and the attach mode, once
    /// attached) in `LB_META`, for a restarted agent.
    fn write_meta(&mut self, mode: Option<AttachedMode>) -> Result<(), DataplaneError> {
        let options = self.options;
        let mut values = vec![
            (meta::LAYOUT, LAYOUT_VERSION),
            (meta::MAGLEV_SIZE, options.maglev_table_size as u64),
            (meta::VIP_CAPACITY, options.vip_capacity as u64),
            (meta::CONNTRACK_ENTRIES, options.conntrack_entries as u64),
            (meta::IFINDEX, options.ifindex as u64),
        ];
        if let Some(mode) = mode {
            values.push((meta::XDP_MODE, mode_code(mode)));
        }
        for (index, value) in values {
            self.meta.set(index, value, 0).map_err(in_map(MAP_META))?;
        }
        Ok(())
    }

    /// After replacing incompatible pins: the backends the replaced program served.
    pub fn previous(&self) -> Option<&Adopted> {
        self.previous.as_ref()
    }

    /// The options in force: as asked, except a larger VIP capacity adopted from pins.
    pub fn options(&self) -> &LoadOptions {
        &self.options
    }

    /// Reads back what adopted maps hold: VIPs, backends in use and each VIP's live table.
    pub fn adopted(&self, table_size: u32) -> Result<Adopted, DataplaneError> {
        let mut adopted = Adopted::default();
        for item in self.vips.iter() {
            adopted.vips.push(item.map_err(in_map(MAP_VIPS))?);
        }
        for id in 0..MAX_BACKENDS {
            let identity = self
                .identities
                .get(&id, 0)
                .map_err(in_map(MAP_BACKEND_IDS))?;
            if identity.in_use == 1 {
                let info = self.backends.get(&id, 0).map_err(in_map(MAP_BACKENDS))?;
                adopted.backends.push((id, info, identity));
            } else if identity.addr != [0; 16] {
                adopted.freed.push(id);
            }
        }
        for (_, info) in &adopted.vips {
            let base = info.table_base(table_size);
            let table = (base..base + table_size)
                .map(|slot| self.maglev.get(&slot, 0).map_err(in_map(MAP_MAGLEV)))
                .collect::<Result<Vec<u32>, _>>()?;
            adopted.tables.push((info.vip_id, table));
        }
        Ok(adopted)
    }

    /// Attaches to `interface` and pins the link next to the maps, so the program stays
    /// attached after this process exits. When `found` is a compatible pinned state, the
    /// new program replaces the old one on its link in one step: no packet sees no
    /// program.
    pub fn attach_pinned(
        &mut self,
        interface: &str,
        mode: XdpModeSetting,
    ) -> Result<AttachedMode, DataplaneError> {
        let dir = self
            .pin_dir
            .clone()
            .expect("attach_pinned after load_pinned");
        let link_path = dir.join(LINK_PIN);
        // Take over a pinned link of a mode the configuration accepts; otherwise (a
        // changed xdp_mode) attach afresh.
        let wanted = |m: AttachedMode| match mode {
            XdpModeSetting::Auto => true,
            XdpModeSetting::Native => m == AttachedMode::Native,
            XdpModeSetting::Generic => m == AttachedMode::Generic,
        };
        if let Some(mode) = self.link_mode.filter(|m| wanted(*m))
            && link_path.exists()
        {
            let pinned =
                PinnedLink::from_pin(&link_path).map_err(|source| DataplaneError::Link {
                    path: link_path.clone(),
                    source,
                })?;
            let link =
                XdpLink::try_from(FdLink::from(pinned)).map_err(|source| DataplaneError::Link {
                    path: link_path.clone(),
                    source,
                })?;
            let program = program(&mut self.ebpf)?;
            let id = program.attach_to_link(link).map_err(lb_xdp_error)?;
            // The link stays pinned; our handle to it must not detach it on exit.
            let link = program.take_link(id).map_err(lb_xdp_error)?;
            std::mem::forget(link);
            self.write_meta(Some(mode))?;
            return Ok(mode);
        }
        if link_path.exists() {
            std::fs::remove_file(&link_path).map_err(|source| DataplaneError::Pin {
                path: link_path.clone(),
                source,
            })?;
        }
        let (attached, id) = self.attach_link(interface, mode)?;
        let link = program(&mut self.ebpf)?
            .take_link(id)
            .map_err(lb_xdp_error)?;
        let fd_link = FdLink::try_from(link).map_err(|source| DataplaneError::Link {
            path: link_path.clone(),
            source,
        })?;
        fd_link
            .pin(&link_path)
            .map_err(|source| DataplaneError::PinLink {
                path: link_path.clone(),
                source,
            })?;
        self.write_meta(Some(attached))?;
        Ok(attached)
    }

    /// Removes the pins (the program detaches once this process exits too).
    pub fn unpin(&self) -> Result<(), DataplaneError> {
        match &self.pin_dir {
            Some(dir) => remove_pins(dir),
            None => Ok(()),
        }
    }

    /// Attaches to `interface` for as long as this value lives. `Auto` tries native
    /// (driver) mode, then generic.
    pub fn attach(
        &mut self,
        interface: &str,
        mode: XdpModeSetting,
    ) -> Result<AttachedMode, DataplaneError> {
        self.attach_link(interface, mode)
            .map(|(attached, _)| attached)
    }

    fn attach_link(
        &mut self,
        interface: &str,
        mode: XdpModeSetting,
    ) -> Result<(AttachedMode, XdpLinkId), DataplaneError> {
        let program = program(&mut self.ebpf)?;
        let mut try_attach = |attached: AttachedMode| {
            let (xdp_mode, name) = match attached {
                AttachedMode::Native => (XdpMode::Driver, "native"),
                AttachedMode::Generic => (XdpMode::Skb, "generic"),
            };
            program
                .attach(interface, xdp_mode)
                .map(|id| (attached, id))
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

    /// The debug capture's ring buffer, for `capture::write_pcap` (once).
    pub fn take_capture(&mut self) -> Result<aya::maps::RingBuf<MapData>, DataplaneError> {
        take_map(&mut self.ebpf, MAP_CAPTURE)
    }

    /// Writes a connection-table entry (tests: to age or plant an entry).
    pub fn insert_flow(&mut self, key: &FlowKey, entry: &FlowEntry) -> Result<(), DataplaneError> {
        self.conntrack
            .insert(key, entry, 0)
            .map_err(in_map(MAP_CONNTRACK))
    }

    /// The XDP_TX counter: how many packets were forwarded so far.
    pub fn forwarded(&self) -> Result<u64, DataplaneError> {
        Ok(self.outcomes()?[stat::XDP_TX as usize])
    }

    /// Every outcome counter, summed over CPUs.
    fn outcomes(&self) -> Result<Vec<u64>, DataplaneError> {
        let per_cpu = self.stats.get(&0, 0).map_err(in_map(MAP_STATS))?;
        let mut sums = vec![0u64; stat::COUNT as usize];
        for outcomes in per_cpu.iter() {
            for (sum, count) in sums.iter_mut().zip(outcomes.counts) {
                *sum += count;
            }
        }
        Ok(sums)
    }
}

fn program(ebpf: &mut Ebpf) -> Result<&mut Xdp, DataplaneError> {
    let program = ebpf
        .program_mut("lb_xdp")
        .ok_or_else(|| lb_xdp_error(aya::programs::ProgramError::NotLoaded))?;
    program.try_into().map_err(lb_xdp_error)
}

fn take_map<T>(ebpf: &mut Ebpf, name: &'static str) -> Result<T, DataplaneError>
where
    T: TryFrom<aya::maps::Map, Error = aya::maps::MapError>,
{
    let map = ebpf
        .take_map(name)
        .ok_or(DataplaneError::MissingMap { map: name })?;
    T::try_from(map).map_err(in_map(name))
}

/// Zeroes entry `index` of a per-CPU counter map on every CPU.
fn zero(
    map: &mut PerCpuArray<MapData, TrafficCounters>,
    name: &'static str,
    index: u32,
) -> Result<(), DataplaneError> {
    let cpus = aya::util::nr_cpus().map_err(|(_, source)| DataplaneError::Cpus(source))?;
    let zeros = aya::maps::PerCpuValues::try_from(vec![TrafficCounters::default(); cpus])
        .map_err(DataplaneError::Cpus)?;
    map.set(index, zeros, 0).map_err(in_map(name))
}

/// What a VIP slot should hold, given what it holds and the VIP keys that hash to it:
/// nothing (the content stays, unused); one VIP; or, for several, the marker that sends
/// the program to `LB_VIPS`.
fn target_slot(current: &VipSlot, keys: &[(&VipKey, &VipInfo)]) -> VipSlot {
    match keys {
        [] => VipSlot {
            state: 0,
            ..*current
        },
        [(key, info)] => VipSlot {
            key: **key,
            vip_id: info.vip_id,
            generation: info.generation,
            flags: info.flags,
            state: VIP_SLOT_USED,
            _pad: 0,
        },
        _ => VipSlot {
            state: VIP_SLOT_USED | VIP_SLOT_SHARED,
            ..*current
        },
    }
}

/// The writes that take a slot from `current` to `target`. The program reads a slot's
/// content only while its state is `VIP_SLOT_USED` alone, so the content changes only
/// while the slot is unused or marked shared, and every write changes either the state
/// or the content: a packet sees the slot before or after each write, and both are
/// right.
fn slot_steps(current: &VipSlot, target: &VipSlot) -> Vec<VipSlot> {
    let content = |s: &VipSlot| VipSlot {
        state: 0,
        _pad: 0,
        ..*s
    };
    let mut steps = Vec::new();
    if content(current) != content(target) {
        let hidden = if current.state & VIP_SLOT_USED != 0 {
            VIP_SLOT_USED | VIP_SLOT_SHARED
        } else {
            0
        };
        if current.state != hidden {
            steps.push(VipSlot {
                state: hidden,
                ..*current
            });
        }
        steps.push(VipSlot {
            state: hidden,
            ..*target
        });
    }
    if steps.last().unwrap_or(current) != target {
        steps.push(*target);
    }
    steps
}

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
fn update_batch(fd: std::os::fd::RawFd, slots: &[(u32, u32)]) -> std::io::Result<()> {
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

/// An error of the `lb_xdp` program (loading, attaching, links).
fn lb_xdp_error(source: aya::programs::ProgramError) -> DataplaneError {
    DataplaneError::Program {
        program: "lb_xdp",
        source,
    }
}

/// A bpf(2) command made by hand (`call`) that failed on `map`.
fn syscall_error(
    map: &'static str,
    call: &'static str,
    io_error: std::io::Error,
) -> DataplaneError {
    in_map(map)(aya::maps::MapError::SyscallError(aya::sys::SyscallError {
        call,
        io_error,
    }))
}

/// Names the map a map operation failed on.
fn in_map(map: &'static str) -> impl Fn(aya::maps::MapError) -> DataplaneError {
    move |source| DataplaneError::Map { map, source }
}

fn sum_per_cpu(
    map: &PerCpuArray<MapData, TrafficCounters>,
    name: &'static str,
    index: u32,
) -> Result<TrafficCounters, DataplaneError> {
    let values = map.get(&index, 0).map_err(in_map(name))?;
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
        // One bpf() call per chunk instead of one per slot (a full table is 65537).
        if slots.len() > 1 && self.batch_writes {
            let fd = IterableMap::map(&self.maglev).fd().as_fd().as_raw_fd();
            match update_batch(fd, slots) {
                Ok(()) => return Ok(()),
                // An old kernel: each slot on its own from now on.
                Err(error) if error.raw_os_error() == Some(libc::EINVAL) => {
                    self.batch_writes = false;
                }
                Err(source) => {
                    return Err(syscall_error(MAP_MAGLEV, "bpf_map_update_batch", source));
                }
            }
        }
        for &(slot, id) in slots {
            self.maglev.set(slot, id, 0).map_err(in_map(MAP_MAGLEV))?;
        }
        Ok(())
    }

    fn set_vip(&mut self, key: &VipKey, info: &VipInfo) -> Result<(), DataplaneError> {
        // LB_VIPS first: a slot being rewritten sends packets there.
        self.vips.insert(key, info, 0).map_err(in_map(MAP_VIPS))?;
        self.vip_infos.insert(*key, *info);
        self.write_slot(VipSlot::index(key))
    }

    fn remove_vip(&mut self, key: &VipKey) -> Result<(), DataplaneError> {
        // The slot first: once it no longer names the key, nothing asks LB_VIPS for it.
        self.vip_infos.remove(key);
        self.write_slot(VipSlot::index(key))?;
        self.vips.remove(key).map_err(in_map(MAP_VIPS))
    }

    fn set_backend(
        &mut self,
        id: u32,
        info: &BackendInfo,
        identity: &BackendIdentity,
    ) -> Result<(), DataplaneError> {
        debug_assert!(id < MAX_BACKENDS);
        self.identities
            .set(id, identity, 0)
            .map_err(in_map(MAP_BACKEND_IDS))?;
        self.backends.set(id, info, 0).map_err(in_map(MAP_BACKENDS))
    }

    fn counters(&self, vip_ids: &[u32], backend_ids: &[u32]) -> Result<Counters, DataplaneError> {
        let outcomes = self.outcomes()?;
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

    fn reset_vip_counters(&mut self, vip_id: u32) -> Result<(), DataplaneError> {
        zero(&mut self.vip_stats, MAP_VIP_STATS, vip_id)
    }

    fn reset_backend_counters(&mut self, backend_id: u32) -> Result<(), DataplaneError> {
        zero(&mut self.backend_stats, MAP_BACKEND_STATS, backend_id)
    }

    fn flow(&self, key: &FlowKey) -> Result<Option<FlowEntry>, DataplaneError> {
        match self.conntrack.get(key, 0) {
            Ok(entry) => Ok(Some(entry)),
            Err(aya::maps::MapError::KeyNotFound) => Ok(None),
            Err(source) => Err(in_map(MAP_CONNTRACK)(source)),
        }
    }

    fn sources(&self) -> Result<Vec<(SourceKey, u64)>, DataplaneError> {
        let mut sources = Vec::new();
        for item in self.sources.iter() {
            match item {
                Ok((key, per_cpu)) => sources.push((key, per_cpu.iter().sum())),
                Err(aya::maps::MapError::KeyNotFound) => continue,
                Err(source) => {
                    return Err(in_map(MAP_SOURCES)(source));
                }
            }
        }
        Ok(sources)
    }

    fn flow_reader(&self) -> Result<FlowReader, DataplaneError> {
        let fd = aya::maps::IterableMap::map(&self.conntrack)
            .fd()
            .as_fd()
            .try_clone_to_owned()
            .map_err(|source| DataplaneError::Pin {
                path: PathBuf::from(MAP_CONNTRACK),
                source,
            })?;
        let data = MapData::from_fd(fd).map_err(in_map(MAP_CONNTRACK))?;
        let map = BpfHashMap::try_from(aya::maps::Map::LruHashMap(data))
            .map_err(in_map(MAP_CONNTRACK))?;
        Ok(FlowReader(FlowSource::Map(map)))
    }
}

/// One write to the data path, as recorded by `MemoryDataplane`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Write {
    Slots(Vec<(u32, u32)>),
    Vip(VipKey, VipInfo),
    RemoveVip(VipKey),
    Backend(u32, BackendInfo, BackendIdentity),
    ResetVip(u32),
    ResetBackend(u32),
}

/// An in-memory data path that does what the kernel's maps do and records every write.
#[derive(Debug, Default)]
pub struct MemoryDataplane {
    pub vips: HashMap<VipKey, VipInfo>,
    pub maglev: HashMap<u32, u32>,
    pub backends: HashMap<u32, BackendInfo>,
    pub flows: HashMap<FlowKey, FlowEntry>,
    pub sources: HashMap<SourceKey, u64>,
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

    fn set_backend(
        &mut self,
        id: u32,
        info: &BackendInfo,
        identity: &BackendIdentity,
    ) -> Result<(), DataplaneError> {
        self.backends.insert(id, *info);
        self.log.push(Write::Backend(id, *info, *identity));
        Ok(())
    }

    fn counters(&self, _: &[u32], _: &[u32]) -> Result<Counters, DataplaneError> {
        Ok(Counters {
            outcomes: vec![0; stat::COUNT as usize],
            ..Counters::default()
        })
    }

    fn reset_vip_counters(&mut self, vip_id: u32) -> Result<(), DataplaneError> {
        self.log.push(Write::ResetVip(vip_id));
        Ok(())
    }

    fn reset_backend_counters(&mut self, backend_id: u32) -> Result<(), DataplaneError> {
        self.log.push(Write::ResetBackend(backend_id));
        Ok(())
    }

    fn flow(&self, key: &FlowKey) -> Result<Option<FlowEntry>, DataplaneError> {
        Ok(self.flows.get(key).copied())
    }

    fn flow_reader(&self) -> Result<FlowReader, DataplaneError> {
        Ok(FlowReader(FlowSource::Snapshot(
            self.flows.iter().map(|(k, v)| (*k, *v)).collect(),
        )))
    }

    fn sources(&self) -> Result<Vec<(SourceKey, u64)>, DataplaneError> {
        Ok(self.sources.iter().map(|(k, v)| (*k, *v)).collect())
    }
}

/// Reads the connection table apart from the data path's own handle (see
/// `Dataplane::flow_reader`).
pub struct FlowReader(FlowSource);

enum FlowSource {
    Map(BpfHashMap<MapData, FlowKey, FlowEntry>),
    /// The in-memory data path's entries when the reader was made.
    Snapshot(Vec<(FlowKey, FlowEntry)>),
}

impl FlowReader {
    /// Every entry, read in batches where the kernel can.
    pub fn flows(&self) -> Result<Vec<(FlowKey, FlowEntry)>, DataplaneError> {
        match &self.0 {
            FlowSource::Map(map) => read_flows(map),
            FlowSource::Snapshot(flows) => Ok(flows.clone()),
        }
    }

    /// Every entry, in batches only (an error where the kernel cannot): for tests.
    pub fn flows_batched(&self) -> Result<Vec<(FlowKey, FlowEntry)>, DataplaneError> {
        match &self.0 {
            FlowSource::Map(map) => read_flows_batched(map),
            FlowSource::Snapshot(flows) => Ok(flows.clone()),
        }
    }

    /// Every entry, one key at a time: the fallback of `flows`, which tests and the
    /// benchmark compare it with.
    pub fn flows_by_key(&self) -> Result<Vec<(FlowKey, FlowEntry)>, DataplaneError> {
        match &self.0 {
            FlowSource::Map(map) => read_flows_by_key(map),
            FlowSource::Snapshot(flows) => Ok(flows.clone()),
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

fn mode_code(mode: AttachedMode) -> u64 {
    match mode {
        AttachedMode::Native => meta::MODE_NATIVE,
        AttachedMode::Generic => meta::MODE_GENERIC,
    }
}

/// The mode `mode_code` recorded, if any.
fn mode_from_code(code: u64) -> Option<AttachedMode> {
    match code {
        meta::MODE_NATIVE => Some(AttachedMode::Native),
        meta::MODE_GENERIC => Some(AttachedMode::Generic),
        _ => None,
    }
}

/// The values of the `LB_META` pinned in `dir`, indexed by `meta`.
fn read_meta(dir: &Path) -> Result<Vec<u64>, String> {
    let map = MapData::from_pin(dir.join(MAP_META)).map_err(|e| e.to_string())?;
    let array: Array<MapData, u64> =
        Array::try_from(aya::maps::Map::Array(map)).map_err(|e| e.to_string())?;
    (0..meta::COUNT)
        .map(|i| array.get(&i, 0).map_err(|e| e.to_string()))
        .collect()
}

/// Whether pins recorded for interface index `pinned` are for the interface `options`
/// name (an unknown index, 0, on either side matches).
fn same_interface(pinned: u64, options: &LoadOptions) -> bool {
    pinned == 0 || options.ifindex == 0 || pinned == options.ifindex as u64
}

/// What is pinned in `dir`, compared with what `options` ask for.
/// A larger pinned VIP capacity than asked is adopted into `options` (the agent then
/// uses it).
fn inspect_pins(dir: &Path, options: &mut LoadOptions) -> Found {
    let meta_path = dir.join(MAP_META);
    if !meta_path.exists() {
        return Found::Nothing;
    }
    let values = match read_meta(dir) {
        Ok(values) => values,
        Err(error) => {
            return Found::Incompatible(format!("unreadable {}: {error}", meta_path.display()));
        }
    };
    let expected = [
        ("layout version", meta::LAYOUT, LAYOUT_VERSION),
        (
            "maglev_table_size",
            meta::MAGLEV_SIZE,
            options.maglev_table_size as u64,
        ),
        (
            "conntrack_entries",
            meta::CONNTRACK_ENTRIES,
            options.conntrack_entries as u64,
        ),
    ];
    for (what, index, want) in expected {
        let have = values[index as usize];
        if have != want {
            return Found::Incompatible(format!(
                "pinned {what} is {have}, this agent needs {want}"
            ));
        }
    }
    let pinned_capacity = values[meta::VIP_CAPACITY as usize];
    if pinned_capacity < options.vip_capacity as u64 {
        return Found::Incompatible(format!(
            "pinned VIP capacity is {pinned_capacity}, this configuration needs {}",
            options.vip_capacity
        ));
    }
    let pinned_ifindex = values[meta::IFINDEX as usize];
    if !same_interface(pinned_ifindex, options) {
        return Found::Incompatible(format!(
            "pinned for interface index {pinned_ifindex}, this agent attaches to {}",
            options.ifindex
        ));
    }
    options.vip_capacity = pinned_capacity as u32;
    // Maps pinned by a program that never attached are adopted too.
    Found::Compatible(
        mode_from_code(values[meta::XDP_MODE as usize]).unwrap_or(AttachedMode::Generic),
    )
}

/// The mode of the link pinned in `dir` when it is on the interface `options` names (or
/// either index is unknown) and its mode is recorded.
fn pinned_link_mode(dir: &Path, options: &LoadOptions) -> Option<AttachedMode> {
    if !dir.join(LINK_PIN).exists() {
        return None;
    }
    let values = read_meta(dir).ok()?;
    if !same_interface(values[meta::IFINDEX as usize], options) {
        return None;
    }
    mode_from_code(values[meta::XDP_MODE as usize])
}

/// Removes the pinned maps but not the link (the program stays attached).
fn remove_map_pins(dir: &Path) -> Result<(), DataplaneError> {
    // Every map lb pins is named LB_*: maps of other layouts (names since gone) too.
    let names = match std::fs::read_dir(dir) {
        Ok(entries) => entries
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|name| name.starts_with("LB_"))
            .collect::<Vec<_>>(),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(source) => {
            return Err(DataplaneError::Pin {
                path: dir.to_path_buf(),
                source,
            });
        }
    };
    for name in names {
        remove_pin(&dir.join(name))?;
    }
    Ok(())
}

/// Removes one pinned file; one already gone is no error.
fn remove_pin(path: &Path) -> Result<(), DataplaneError> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(DataplaneError::Pin {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// Removes everything lb pinned in `dir` (the link first: that detaches the program).
pub fn remove_pins(dir: &Path) -> Result<(), DataplaneError> {
    remove_pin(&dir.join(LINK_PIN))?;
    remove_map_pins(dir)?;
    let _ = std::fs::remove_dir(dir);
    Ok(())
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

    fn key(last: u8) -> VipKey {
        crate::model::vip_key([10, 0, 0, last].into(), 80, lb_common::PROTO_TCP)
    }

    fn info(vip_id: u32, generation: u32) -> VipInfo {
        VipInfo {
            vip_id,
            generation,
            flags: 0,
            _pad: 0,
        }
    }

    /// Writes from `current` to the slot for `keys`, checked as the program reads them:
    /// each write changes the state or the content, never both, and the content only
    /// while the program does not read it. Returns the final slot.
    fn apply(current: VipSlot, keys: &[(VipKey, VipInfo)]) -> VipSlot {
        let keys: Vec<(&VipKey, &VipInfo)> = keys.iter().map(|(k, i)| (k, i)).collect();
        let target = target_slot(&current, &keys);
        let steps = slot_steps(&current, &target);
        let content = |s: &VipSlot| (s.key, s.vip_id, s.generation, s.flags);
        let mut before = current;
        for step in &steps {
            let content_changed = content(&before) != content(step);
            assert!(
                !(content_changed && before.state != step.state),
                "one write changed state and content: {before:?} -> {step:?}"
            );
            if content_changed {
                assert_ne!(
                    before.state, VIP_SLOT_USED,
                    "content changed under a reader"
                );
                assert_ne!(step.state, VIP_SLOT_USED, "content changed under a reader");
            }
            before = *step;
        }
        assert_eq!(before, target);
        target
    }

    #[test]
    fn slot_writes_never_show_a_packet_a_mixed_slot() {
        let (a, b) = (key(1), key(2));
        let empty = VipSlot::zeroed();
        let one = apply(empty, &[(a, info(3, 0))]);
        assert_eq!((one.state, one.key, one.vip_id), (VIP_SLOT_USED, a, 3));
        // A table switch: the new generation reaches the slot.
        let switched = apply(one, &[(a, info(3, 1))]);
        assert_eq!((switched.state, switched.generation), (VIP_SLOT_USED, 1));
        // A second key on the slot: shared, LB_VIPS decides.
        let shared = apply(switched, &[(a, info(3, 1)), (b, info(4, 0))]);
        assert_eq!(shared.state, VIP_SLOT_USED | VIP_SLOT_SHARED);
        // The first key leaves: the slot is the second key's alone.
        let only_b = apply(shared, &[(b, info(4, 0))]);
        assert_eq!(
            (only_b.state, only_b.key, only_b.vip_id),
            (VIP_SLOT_USED, b, 4)
        );
        // One key replaced by another in one step (an address change keeps the id).
        let moved = apply(only_b, &[(a, info(4, 0))]);
        assert_eq!((moved.state, moved.key), (VIP_SLOT_USED, a));
        let gone = apply(moved, &[]);
        assert_eq!(gone.state, 0);
        assert_eq!(slot_steps(&gone, &gone), Vec::new());
    }
}
