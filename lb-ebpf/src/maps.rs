//! Every map of the data path. Userspace (`lb-userspace`'s dataplane module) writes the
//! configuration maps and reads the counters; the program only looks things up and counts.
//!
//! Lookups in array and hash maps are inlined by the verifier, but only where each call
//! site names one map: code that picks the map by a branch (say, one connection table
//! per address family) may be merged by LLVM into one call with either map, which the
//! verifier then leaves a full helper call. An attempt at a 16-byte IPv4 key in a table
//! of its own measured 20-30 ns more per packet here, not less.

use aya_ebpf::{
    helpers::{bpf_get_prandom_u32, bpf_jiffies64, bpf_ktime_get_coarse_ns},
    macros::map,
    maps::{
        Array, DevMap, HashMap, LruHashMap, LruPerCpuHashMap, PerCpuArray, ProgramArray, RingBuf,
    },
};
use lb_common::{
    BackendIdentity, BackendInfo, EMBRYONIC_SLOTS, EgressInfo, Embryo, ExportRecord, FlowEntry,
    FlowKey, FlowTuple, HOT_SOURCE_ENTRIES, MAX_BACKENDS, MAX_EGRESS, MAX_VIPS, Outcomes,
    PacketCounters, QUIC_ID_ENTRIES, RateWindow, SOURCE_ENTRIES, SourceKey, TrafficCounters,
    TunnelConfig, VipInfo, VipKey, VipSlot, handshake,
    quic::{QuicCounters, ServerKey},
    stat,
};

/// LRU lists per CPU instead of one shared list: no global lock on insert.
const BPF_F_NO_COMMON_LRU: u32 = 1 << 1;

/// VipKey -> VipInfo: which (address, port, protocol) is balanced, and where its current
/// Maglev table starts. Written by the agent; MAX_VIPS entries.
#[map(name = "LB_VIPS")]
pub static LB_VIPS: HashMap<VipKey, VipInfo> = HashMap::with_max_entries(MAX_VIPS, 0);

/// `VipSlot::index(key)` -> VipSlot: the VIP a key hashes to, read by every packet
/// before any hash-map lookup. Written by the agent with every VIP change.
#[map(name = "LB_VIP_SLOTS")]
pub static LB_VIP_SLOTS: Array<VipSlot> = Array::with_max_entries(lb_common::VIP_SLOTS, 0);

/// slot -> backend id: every VIP's tables, two generations each, back to back
/// (`VipInfo::table_base_for`). Written by the agent; resized at load time to
/// VIP capacity x 2 x MAGLEV_SIZE.
#[map(name = "LB_MAGLEV")]
pub static LB_MAGLEV: Array<u32> = Array::with_max_entries(1, 0);

/// backend id -> BackendInfo (its MAC, and how it is reached: L2 or a tunnel). Written by
/// the agent. Every map indexed or keyed by backend id is resized at load time to
/// `dataplane.max_backends` (MAX_BACKENDS is its default); the program only looks ids up,
/// so the kernel's bounds check against the loaded size is the only one.
#[map(name = "LB_BACKENDS")]
pub static LB_BACKENDS: Array<BackendInfo> = Array::with_max_entries(MAX_BACKENDS, 0);

/// egress index -> EgressInfo: the interfaces forwarded frames leave by, and their MACs
/// (`dataplane.interfaces`, in order). Written by the agent; MAX_EGRESS entries.
#[map(name = "LB_EGRESS")]
pub static LB_EGRESS: Array<EgressInfo> = Array::with_max_entries(MAX_EGRESS, 0);

/// egress index -> interface index (DEVMAP): XDP_REDIRECT's targets, as `LB_EGRESS`.
/// Written by the agent with it; the kernel removes an entry whose interface goes.
#[map(name = "LB_TX_PORTS")]
pub static LB_TX_PORTS: DevMap = DevMap::with_max_entries(MAX_EGRESS, 0);

/// backend id -> egress index (u32): the interface that reaches the backend or its next
/// hop. Written by the agent with every backend; read only with several interfaces.
/// Resized at load, as LB_BACKENDS.
#[map(name = "LB_BE_EGRESS")]
pub static LB_BACKEND_EGRESS: Array<u32> = Array::with_max_entries(MAX_BACKENDS, 0);

/// egress index -> traffic counters, per CPU: frames forwarded out of each interface.
/// Read by the agent.
#[map(name = "LB_EGRESS_STATS")]
pub static LB_EGRESS_STATS: PerCpuArray<PacketCounters> =
    PerCpuArray::with_max_entries(MAX_EGRESS, 0);

/// 0 -> TunnelConfig: outer source addresses and the interface MTU, for tunnelled
/// backends, and whether frames come in one buffer. Written by the agent (start, reload,
/// interface changes).
#[map(name = "LB_TUNNEL")]
pub static LB_TUNNEL: Array<TunnelConfig> = Array::with_max_entries(1, 0);

/// 0 -> Outcomes, per CPU: every outcome of the program (`lb_common::stat`). Read by
/// the agent.
#[map(name = "LB_STATS")]
pub static LB_STATS: PerCpuArray<Outcomes> = PerCpuArray::with_max_entries(1, 0);

/// vip id -> traffic counters, per CPU. Read by the agent.
#[map(name = "LB_VIP_STATS")]
pub static LB_VIP_STATS: PerCpuArray<PacketCounters> = PerCpuArray::with_max_entries(MAX_VIPS, 0);

/// backend id -> traffic and handshake counters, per CPU. Read by the agent. Resized at
/// load, as LB_BACKENDS.
#[map(name = "LB_BE_STATS")]
pub static LB_BACKEND_STATS: PerCpuArray<TrafficCounters> =
    PerCpuArray::with_max_entries(MAX_BACKENDS, 0);

/// FlowKey -> FlowEntry: the connection table, so a flow stays on its backend while the
/// backend set changes. Written by the program; read (and aged) by the agent. Resized
/// at load time to `conntrack_entries`; the least recently used entries go first.
#[map(name = "LB_CONNTRACK")]
pub static LB_CONNTRACK: LruHashMap<FlowKey, FlowEntry> =
    LruHashMap::with_max_entries(lb_common::DEFAULT_CONNTRACK_ENTRIES, BPF_F_NO_COMMON_LRU);

/// What the balancer builds per packet in map memory rather than on the stack, which it
/// shares with the tunnels' functions (512 bytes in all).
pub struct Scratch {
    /// The packet's connection-table key.
    pub key: FlowKey,
    /// The Maglev hash's input.
    pub tuple: FlowTuple,
}

/// 0 -> Scratch, per CPU.
#[map(name = "LB_SCRATCH")]
pub static LB_SCRATCH: PerCpuArray<Scratch> = PerCpuArray::with_max_entries(1, 0);

/// `flow::embryo_place` -> Embryo: the backend each new flow's first packet took, until
/// its second packet enters it into `LB_CONNTRACK`. Shared by all CPUs (a flow's SYN and
/// ACK may arrive on different ones); written by the program only.
#[map(name = "LB_EMBRYONIC")]
pub static LB_EMBRYONIC: Array<Embryo> = Array::with_max_entries(EMBRYONIC_SLOTS, 0);

/// SourceKey (VIP, client address) -> new flows it opened, per CPU: the heavy hitters.
/// Written by the program on each new flow; read (and diffed) by the agent. LRU, so
/// memory stays bounded and the active sources stay.
#[map(name = "LB_SOURCES")]
pub static LB_SOURCES: LruPerCpuHashMap<SourceKey, u64> =
    LruPerCpuHashMap::with_max_entries(SOURCE_ENTRIES, 0);

/// Counts `weight` new flows from `addr` to VIP `vip_id`.
#[inline(always)]
// The key goes by reference: by value, each call copies it again on the stack.
#[allow(clippy::needless_borrows_for_generic_args)]
pub fn count_source(vip_id: u32, addr: [u8; 16], family: u8, weight: u64) {
    let key = SourceKey::new(vip_id, addr, family);
    match LB_SOURCES.get_ptr_mut(&key) {
        Some(count) => unsafe { *count += weight },
        None => {
            let _ = LB_SOURCES.insert(&key, &weight, 0);
        }
    }
}

/// SourceKey (VIP, client address) -> 1: the hot sources of VIPs with
/// `hot_source_share`, whose new flows are hashed on the 5-tuple. Written by the agent
/// every sample; read by the program only for a VIP with `VIP_F_HOT_SOURCES`.
#[map(name = "LB_HOT_SRC")]
pub static LB_HOT_SOURCES: HashMap<SourceKey, u32> =
    HashMap::with_max_entries(HOT_SOURCE_ENTRIES, 0);

/// Whether `addr` is a hot source of VIP `vip_id`.
#[inline(always)]
// The key goes by reference: by value, each call copies it again on the stack.
#[allow(clippy::needless_borrows_for_generic_args)]
pub fn hot_source(vip_id: u32, addr: [u8; 16], family: u8) -> bool {
    let key = SourceKey::new(vip_id, addr, family);
    unsafe { LB_HOT_SOURCES.get(&key) }.is_some()
}

/// `quic::ServerKey` (VIP, server ID) -> backend id: where a QUIC short header whose
/// connection ID carries the ID goes. Written by the agent for VIPs with `quic`;
/// resized at load to `dataplane.max_backends` (one server ID per backend at most).
#[map(name = "LB_QUIC_IDS")]
pub static LB_QUIC_IDS: HashMap<ServerKey, u32> = HashMap::with_max_entries(QUIC_ID_ENTRIES, 0);

/// vip id -> QUIC counters (packets routed by connection ID, unknown IDs), per CPU.
/// Written by the program for QUIC VIPs; read by the agent.
#[map(name = "LB_QUIC_STATS")]
pub static LB_QUIC_STATS: PerCpuArray<QuicCounters> = PerCpuArray::with_max_entries(MAX_VIPS, 0);

/// Frames (`CaptureRecord`) of TCP packets that missed the connection table without a
/// SYN, for the agent's debug pcap. Written by the program only when `CAPTURE_RATE` > 0;
/// drained by the agent. 256 KiB.
#[map(name = "LB_CAPTURE")]
pub static LB_CAPTURE: RingBuf = RingBuf::with_byte_size(256 * 1024, 0);

/// New connection-table entries (`ExportRecord`) for the cluster's peers. Written by the
/// program only when `CLUSTER_EXPORT` is set; drained by the agent every 50 ms. 256 KiB:
/// 4681 records (56 bytes with the ring's header), 50 ms of 90,000 new flows per second;
/// small enough to stay in a CPU's L2 cache (a 1 MiB ring measured dearer per record).
#[map(name = "LB_EXPORT")]
pub static LB_EXPORT: RingBuf = RingBuf::with_byte_size(256 * 1024, 0);

/// Non-zero when `[cluster]` is configured (`lb_common::GLOBAL_CLUSTER_EXPORT`).
#[unsafe(no_mangle)]
static CLUSTER_EXPORT: u32 = 0;

/// `bpf_ringbuf_submit` flag: no wakeup of the reader. The agent polls on a timer (it
/// batches anyway), so the program never pays for waking it.
const BPF_RB_NO_WAKEUP: u64 = 1;

/// Hands a newly created entry to the agent for the cluster's peers. Without `[cluster]`
/// one load and a branch; with it, a reserve and a submit. A full ring (the agent is
/// behind) drops the record and counts it: a slow peer never slows the data path.
#[inline(always)]
pub fn export_flow(stats: &Stats, key: &FlowKey, entry: &FlowEntry) {
    if unsafe { core::ptr::read_volatile(&CLUSTER_EXPORT) } == 0 {
        return;
    }
    match LB_EXPORT.reserve::<ExportRecord>(0) {
        Some(mut slot) => {
            let record = slot.as_mut_ptr();
            unsafe {
                copy_key(&raw mut (*record).key, key);
                (*record).backend_id = entry.backend_id;
                (*record).flags = entry.flags;
            }
            slot.submit(BPF_RB_NO_WAKEUP);
            stats.count(stat::CLUSTER_EXPORTED);
        }
        None => stats.count(stat::CLUSTER_EXPORT_DROPPED),
    }
}

/// Copies a flow key a word at a time (it is 8-aligned): `*to = *from` between two map
/// values compiles to a call to a byte-wise `memmove` (the compiler cannot tell that
/// they do not overlap), 40 rounds of its loop per record.
#[inline(always)]
fn copy_key(to: *mut FlowKey, from: &FlowKey) {
    let (to, from) = (to as *mut u64, from as *const FlowKey as *const u64);
    for i in 0..size_of::<FlowKey>() / 8 {
        unsafe { to.add(i).write_volatile(from.add(i).read_volatile()) };
    }
}

/// 0 -> this CPU's captures in the current second (the capture's rate limit).
#[map(name = "LB_CAPTURE_WIN")]
pub static LB_CAPTURE_WIN: PerCpuArray<RateWindow> = PerCpuArray::with_max_entries(1, 0);

/// 0 -> this CPU's inserts in the current second (flood guard). Program only.
#[map(name = "LB_FLOOD")]
pub static LB_FLOOD: PerCpuArray<RateWindow> = PerCpuArray::with_max_entries(1, 0);

/// 0 -> the host's next XDP program (`dataplane.next_program`), tail-called with every
/// frame lb passes (`next::pass_on`); empty: frames pass to the kernel. Written by the
/// agent (start, reload); pinned by it, because the kernel empties a program array once
/// no user-space handle holds it, and the chain must outlive the agent. Not adopted: a
/// new program gets a new one (a program array admits only programs of its first
/// user's kind).
#[map(name = "LB_NEXT")]
pub static LB_NEXT: ProgramArray = ProgramArray::with_max_entries(1, 0);

/// index -> u64 (`lb_common::meta`): layout version and sizes of the pinned maps.
/// Written and read by the agent only (restart adoption); 8 entries.
#[map(name = "LB_META")]
pub static LB_META: Array<u64> = Array::with_max_entries(lb_common::meta::COUNT, 0);

/// backend id -> BackendIdentity (address, VIP). Written and read by the agent only
/// (restart adoption). Resized at load, as LB_BACKENDS.
#[map(name = "LB_BACKEND_IDS")]
pub static LB_BACKEND_IDS: Array<BackendIdentity> = Array::with_max_entries(MAX_BACKENDS, 0);

/// 0 -> this CPU's `CpuState`: its cached clock and random state. Program only.
#[map(name = "LB_CPU")]
pub static LB_CPU: PerCpuArray<CpuState> = PerCpuArray::with_max_entries(1, 0);

#[repr(C)]
pub struct CpuState {
    /// The jiffy `now_ns` was read in.
    jiffies: u64,
    now_ns: u64,
    /// xorshift32 state; 0 until seeded.
    random: u32,
    _pad: u32,
}

/// Per-CPU helpers that spare helper calls on the per-packet path.
pub struct Cpu(*mut CpuState);

impl Cpu {
    #[inline(always)]
    pub fn get() -> Self {
        Self(LB_CPU.get_ptr_mut(0).unwrap_or(core::ptr::null_mut()))
    }

    /// Coarse monotonic time, as `bpf_ktime_get_coarse_ns` gives it (it moves once per
    /// jiffy). The verifier inlines `bpf_jiffies64` into a load, so the clock helper is
    /// called once per jiffy on this CPU instead of once per packet.
    #[inline(always)]
    pub fn now_ns(&self) -> u64 {
        let jiffies = unsafe { bpf_jiffies64() };
        if self.0.is_null() {
            return unsafe { bpf_ktime_get_coarse_ns() };
        }
        let state = unsafe { &mut *self.0 };
        if state.jiffies != jiffies {
            state.jiffies = jiffies;
            state.now_ns = unsafe { bpf_ktime_get_coarse_ns() };
        }
        state.now_ns
    }

    /// True with probability 1 / `n` (a per-CPU xorshift32, seeded once from
    /// `bpf_get_prandom_u32`): sampling without a helper call per packet.
    #[inline(always)]
    pub fn one_in(&self, n: u32) -> bool {
        if self.0.is_null() {
            return unsafe { bpf_get_prandom_u32() } % n.max(1) == 0;
        }
        let state = unsafe { &mut *self.0 };
        let mut x = state.random;
        if x == 0 {
            x = unsafe { bpf_get_prandom_u32() } | 1;
        }
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        state.random = x;
        // Multiply-shift maps x onto 0..n evenly, without a division.
        (x as u64 * n as u64) >> 32 == 0
    }
}

/// This CPU's outcome counters, looked up once per packet.
pub struct Stats(*mut Outcomes);

impl Stats {
    #[inline(always)]
    pub fn get() -> Self {
        Self(LB_STATS.get_ptr_mut(0).unwrap_or(core::ptr::null_mut()))
    }

    /// Adds one to an outcome counter.
    #[inline(always)]
    pub fn count(&self, index: u32) {
        if !self.0.is_null() && (index as usize) < stat::COUNT as usize {
            // Per-CPU memory: no other writer, no atomics needed.
            unsafe { (*self.0).counts[index as usize] += 1 };
        }
    }
}

/// Adds a packet of `bytes` to a VIP's or an interface's counters.
#[inline(always)]
pub fn count_traffic(map: &PerCpuArray<PacketCounters>, index: u32, bytes: u64, new_flow: bool) {
    if let Some(counters) = map.get_ptr_mut(index) {
        let counters = unsafe { &mut *counters };
        counters.packets += 1;
        counters.bytes += bytes;
        if new_flow {
            counters.new_flows += 1;
        }
    }
}

/// Adds a packet of `bytes` and its handshake events to backend `backend_id`'s counters:
/// one write of the element. An established flow's packet (no new flow, no events) takes
/// one branch past both.
#[inline(always)]
pub fn count_backend(backend_id: u32, bytes: u64, new_flow: bool, events: handshake::Events) {
    if let Some(counters) = LB_BACKEND_STATS.get_ptr_mut(backend_id) {
        let counters = unsafe { &mut *counters };
        counters.packets += 1;
        counters.bytes += bytes;
        if (new_flow as u8 | events) != 0 {
            counters.new_flows += new_flow as u64;
            handshake::add(&mut counters.handshakes, events);
        }
    }
}
