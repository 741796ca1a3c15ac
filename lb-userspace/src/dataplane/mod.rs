//! How tables are written: a small `Dataplane` trait, implemented over the real BPF maps
//! (`AyaDataplane`) and in memory (`MemoryDataplane`, for unit tests of what is written
//! and in which order).
//!
//! One job a file:
//! - `mod.rs`: the trait, its error and the types callers pass in and get back;
//! - `kernel.rs`: `AyaDataplane`: loading the program, attaching it, adopting what a
//!   previous agent pinned, and the trait over the real maps;
//! - `pins.rs`: what is pinned and whether a restarted agent may adopt it: the pinned
//!   maps, their metadata in `LB_META`, the pinned link, removing pins;
//! - `slots.rs`: `LB_VIPS` and its slot index `LB_VIP_SLOTS`, written in steps so that no
//!   packet reads a half-changed slot;
//! - `batch.rs`: the bpf(2) batch commands (by hand: aya 0.14 has none) and
//!   `FlowReader`, the connection-table scan built on them;
//! - `counters.rs`: reading the counter maps, and `CounterReader`, the read side that
//!   takes no lock the writer holds;
//! - `attach.rs`: what an attach error from the kernel means for the interface;
//! - `next.rs`: `dataplane.next_program`, the host's XDP program lb tail-calls with the
//!   frames it passes: opening its pin, and which build of lb's program can call it;
//! - `decap.rs`: the backends' decapsulation program (`lb decap`): attach, detach, status;
//! - `memory.rs`: `MemoryDataplane`, compiled for unit tests only.

mod attach;
mod batch;
mod counters;
pub mod decap;
mod kernel;
#[cfg(test)]
mod memory;
pub mod next;
pub mod peer;
mod pins;
mod slots;

use std::{collections::HashMap, path::PathBuf, time::Duration};

use lb_common::{
    BackendIdentity, BackendInfo, Embryo, FlowEntry, FlowKey, MAX_VIPS, SourceKey, TrafficCounters,
    TunnelConfig, VipInfo, VipKey, quic::ServerKey,
};

use crate::config::Config;

pub use attach::{AttachHints, SINGLE_BUFFER_MTU, foreign_program_fix};
pub use batch::{FlowLookups, FlowReader, FlowWriter, Lookups};
pub use counters::CounterReader;
pub use kernel::AyaDataplane;
#[cfg(test)]
pub use memory::{MemoryDataplane, Write};
pub use pins::{
    PINNED_MAPS, PinnedLinkState, RemovedPins, link_pin_name, pinned_link_state, remove_pins,
};

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
    /// `meaning` says what the kernel's error means for this interface.
    #[error("attaching to {interface} in {mode} mode: {meaning}")]
    Attach {
        interface: String,
        mode: &'static str,
        meaning: String,
        source: Box<aya::programs::ProgramError>,
    },
    #[error("redirect target {index} (interface index {ifindex}) in LB_TX_PORTS")]
    TxPort {
        index: u32,
        ifindex: u32,
        source: aya::maps::xdp::XdpMapError,
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
    #[error(
        "{path} is now {label}, which {caller} can tail-call and \
         the running {loaded} cannot (the kernel chains only programs that agree on \
         multi-buffer frames): restart the agent to load {caller} (lb run adopts the \
         pinned state; flows continue)"
    )]
    NextProgramKind {
        path: PathBuf,
        label: String,
        caller: &'static str,
        loaded: &'static str,
    },
    #[error("pinning map {path}")]
    PinMap {
        path: PathBuf,
        source: aya::pin::PinError,
    },
}

/// Summed (over CPUs) counters of the data path.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// Indexed by `lb_common::stat`.
    pub outcomes: Vec<u64>,
    /// Per CPU: flows that made a connection-table entry, or would have made one outside
    /// a stable slot (`turnover::entries_made`), for `turnover::Turnover`.
    /// Empty where the data path does not count per CPU.
    pub entries_per_cpu: Vec<u64>,
    pub vips: HashMap<u32, TrafficCounters>,
    pub backends: HashMap<u32, TrafficCounters>,
    /// QUIC VIPs' counters, by VIP id (every VIP asked for; zero for others).
    pub quic: HashMap<u32, lb_common::quic::QuicCounters>,
    /// With several interfaces: frames forwarded out of each, by egress index (their
    /// order in `dataplane.interfaces`); empty with one.
    pub egress: Vec<TrafficCounters>,
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
    /// Writes which interface frames to backend `id` leave by (`LB_BE_EGRESS`: its
    /// position in `dataplane.interfaces`). Read only with several interfaces.
    fn set_backend_egress(&mut self, _id: u32, _egress: u32) -> Result<(), DataplaneError> {
        Ok(())
    }
    /// Records the `index`th of several interfaces (`LB_EGRESS`, `LB_TX_PORTS`): where
    /// frames of its backends leave; `port.ifindex` 0: it is gone.
    fn set_egress(&mut self, _index: u32, _port: &EgressPort) -> Result<(), DataplaneError> {
        Ok(())
    }
    /// Attaches the program to the `index`th (not the first) of several interfaces, onto
    /// the link a previous agent pinned there when it can, else afresh.
    fn attach_port(
        &mut self,
        _index: usize,
        _port: &EgressPort,
        _mode: crate::config::XdpModeSetting,
    ) -> Result<Attachment, DataplaneError> {
        Ok(Attachment {
            mode: AttachedMode::Generic,
            native_refused: None,
        })
    }
    /// Writes the tunnel settings (`LB_TUNNEL`): outer source addresses and the
    /// interface MTU, for the VIPs with `forward = "ipip" | "gue"`.
    fn set_tunnel(&mut self, tunnel: &TunnelConfig) -> Result<(), DataplaneError>;
    /// Zeroes a VIP id's traffic counters (a new VIP must not inherit an old one's).
    fn reset_vip_counters(&mut self, vip_id: u32) -> Result<(), DataplaneError>;
    /// Zeroes a backend id's traffic counters.
    fn reset_backend_counters(&mut self, backend_id: u32) -> Result<(), DataplaneError>;
    /// Counters of the given VIP and backend ids.
    fn counters(&self, vip_ids: &[u32], backend_ids: &[u32]) -> Result<Counters, DataplaneError>;
    /// The connection-table entry of one flow.
    fn flow(&self, key: &FlowKey) -> Result<Option<FlowEntry>, DataplaneError>;
    /// Slot `index` of the embryonic table (`lb_common::flow::embryo_place`).
    fn embryo(&self, index: u32) -> Result<Embryo, DataplaneError>;
    /// A handle that reads the connection table on its own, so a long scan need not
    /// hold the agent's lock.
    fn flow_reader(&self) -> Result<FlowReader, DataplaneError>;
    /// A reader of the counters through handles of its own; None where the data path has
    /// none to give (then it is read through its lock: `CounterReader::shared`).
    fn counter_reader(&self) -> Result<Option<CounterReader>, DataplaneError> {
        Ok(None)
    }
    /// Explain's lookups of one flow through handles of their own; None where the data
    /// path has none to give (then they go through its lock: `FlowLookups::shared`).
    fn flow_lookups(&self) -> Result<Option<FlowLookups>, DataplaneError> {
        Ok(None)
    }
    /// New flows per client source and VIP (summed over CPUs) since the program loaded.
    fn sources(&self) -> Result<Vec<(SourceKey, u64)>, DataplaneError>;
    /// The hot sources in `LB_HOT_SRC`: their new flows are hashed per connection.
    fn hot_sources(&self) -> Result<Vec<SourceKey>, DataplaneError>;
    /// Whether `key` is in `LB_HOT_SRC`.
    fn is_hot_source(&self, key: &SourceKey) -> Result<bool, DataplaneError>;
    /// Adds `key` to `LB_HOT_SRC` (`hot`) or removes it.
    fn set_hot_source(&mut self, key: &SourceKey, hot: bool) -> Result<(), DataplaneError>;
    /// The server IDs in `LB_QUIC_IDS`, with the backend each names.
    fn quic_ids(&self) -> Result<Vec<(ServerKey, u32)>, DataplaneError>;
    /// Points server ID `key` at `backend`, or (None) removes it.
    fn set_quic_id(&mut self, key: &ServerKey, backend: Option<u32>) -> Result<(), DataplaneError>;
    /// Follows the interface to `target` (it came back under its name, or its MAC
    /// changed): the program again, built for its MAC, on the same maps, attached in
    /// place of the running one, or afresh by the mode rules of the start. A data path
    /// without a program (in memory) has nothing to do.
    fn follow_interface(&mut self, target: &AttachTarget) -> Result<AttachedMode, DataplaneError> {
        Ok(target.attached.unwrap_or(AttachedMode::Generic))
    }
    /// Puts `next` (`dataplane.next_program`) in the slot the program tail-calls with the
    /// frames it passes, or empties it; returns the id of the program the slot held. A
    /// data path without a program (in memory) has nothing to do.
    fn set_next_program(
        &mut self,
        _next: Option<&next::NextProgram>,
    ) -> Result<Option<u32>, DataplaneError> {
        Ok(None)
    }
}

/// Where `Dataplane::follow_interface` attaches.
#[derive(Clone, Debug)]
pub struct AttachTarget {
    /// The eBPF object to load the program from.
    pub object: &'static [u8],
    pub interface: String,
    pub ifindex: u32,
    /// The interface's MAC: the source of forwarded frames, compiled into the program.
    pub mac: [u8; 6],
    pub mode: crate::config::XdpModeSetting,
    /// The mode the running program is attached in on this interface (`ifindex`); None
    /// when the interface it was attached to is gone.
    pub attached: Option<AttachedMode>,
}

/// One of several data-path interfaces (`dataplane.interfaces`) as the agent attached it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EgressPort {
    pub name: String,
    /// 0 while the interface is gone.
    pub ifindex: u32,
    pub mac: [u8; 6],
    /// The mode attached; None while gone.
    pub mode: Option<AttachedMode>,
    /// `xdp_mode = "auto"` attached generic: why native was refused.
    pub native_refused: Option<String>,
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

/// How the program was attached.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Attachment {
    pub mode: AttachedMode,
    /// `xdp_mode = "auto"` in generic mode: why native was refused.
    pub native_refused: Option<String>,
}

/// Load-time parameters of the program.
#[derive(Clone, Copy, Debug)]
pub struct LoadOptions {
    pub maglev_table_size: u32,
    /// How many VIPs the table map has room for (each gets `TABLE_GENERATIONS` tables).
    pub vip_capacity: u32,
    pub iface_mac: [u8; 6],
    pub conntrack_entries: u32,
    /// Backend ids over all VIPs (`dataplane.max_backends`): the size of the backend maps.
    pub max_backends: u32,
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
    /// `[cluster]`: the program exports the entries it creates (`LB_EXPORT`).
    pub cluster_export: bool,
    /// Which build of the program to load: `next::LB_XDP`, or `next::LB_XDP_1BUF` to
    /// tail-call a `next_program` that is not multi-buffer aware.
    pub program: &'static str,
    /// How many interfaces the program is attached to (`dataplane.interfaces`): above 1,
    /// frames leave by their backend's interface (XDP_REDIRECT where it is another).
    pub egress_count: u32,
}

impl LoadOptions {
    /// The options a configuration asks for.
    pub fn from_config(config: &Config, iface_mac: [u8; 6]) -> Self {
        Self {
            maglev_table_size: config.dataplane.maglev_table_size,
            vip_capacity: vip_capacity(config.vips.len()),
            iface_mac,
            conntrack_entries: config.dataplane.conntrack_entries,
            max_backends: config.dataplane.max_backends,
            flow_idle: config.dataplane.flow_idle_timeout,
            conntrack_insert_limit: config.dataplane.conntrack_insert_limit,
            capture_rate: config.debug.program_rate(),
            source_sample: lb_common::DEFAULT_SOURCE_SAMPLE,
            ifindex: 0,
            cluster_export: config.cluster.is_some(),
            program: next::LB_XDP,
            egress_count: config.dataplane.interfaces.len() as u32,
        }
    }
}

/// VIP capacity for a configuration with `vips` VIPs: room to grow by reload without
/// reloading the program, within MAX_VIPS.
pub fn vip_capacity(vips: usize) -> u32 {
    (vips as u32 * 2).clamp(16, MAX_VIPS)
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
    /// By backend id (in use), the interface its frames leave by (`LB_BE_EGRESS`).
    pub egress: std::collections::BTreeMap<u32, u32>,
    /// By vip id, the slots of the table the VIP points at.
    pub tables: Vec<(u32, Vec<u32>)>,
    /// Backend ids a previous agent used and freed: connection-table entries may still
    /// name them, so they are reused last, after the quarantine.
    pub freed: Vec<u32>,
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

/// Loads `program` into the kernel, again when the verifier gave up with EAGAIN: it
/// stops when a signal is pending for the loading thread (a child's SIGCHLD, a SIGHUP),
/// and libbpf retries the same way, up to 5 tries. A test run once failed so.
pub(crate) fn load_program(
    program: &mut aya::programs::Xdp,
) -> Result<(), aya::programs::ProgramError> {
    const TRIES: u32 = 5;
    let mut tries = 1;
    loop {
        match program.load() {
            Err(aya::programs::ProgramError::LoadError { io_error, .. })
                if io_error.raw_os_error() == Some(libc::EAGAIN) && tries < TRIES =>
            {
                tries += 1;
            }
            loaded => return loaded,
        }
    }
}

/// Another handle on the map `map` (`name`): a duplicated descriptor, for a reader or
/// writer apart from the data path's own handle.
fn dup_map(
    map: &aya::maps::MapData,
    name: &'static str,
) -> Result<aya::maps::MapData, DataplaneError> {
    use std::os::fd::AsFd;
    let fd = map
        .fd()
        .as_fd()
        .try_clone_to_owned()
        .map_err(|e| syscall_error(name, "dup", e))?;
    aya::maps::MapData::from_fd(fd).map_err(in_map(name))
}

/// Names the map a map operation failed on.
fn in_map(map: &'static str) -> impl Fn(aya::maps::MapError) -> DataplaneError {
    move |source| DataplaneError::Map { map, source }
}
