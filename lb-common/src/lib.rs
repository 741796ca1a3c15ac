//! Types and pure logic shared by the XDP program and the agent.
//!
//! Everything that lives in BPF map memory is `#[repr(C)]` with its padding written out,
//! `Pod`, and has its size asserted, so both sides agree on every byte. The flow hash is
//! here too: the agent predicts where a flow goes (`lb explain`) with the very function
//! the kernel runs, and so is the whole decision order of a packet (`decide`, over what
//! a connection-table entry decides, `flow`): the kernel, `lb explain` and the
//! differential test run the one function.
#![cfg_attr(not(any(feature = "std", test)), no_std)]

#[cfg(feature = "user")]
pub mod maglev;

pub mod addr;
pub mod decide;
pub mod flow;
pub mod handshake;
mod hash;
pub mod quic;
pub mod slot;
pub use hash::{FlowTuple, finish as fmix32, flow_hash, stable_hash64, table_hash, table_place};

use bytemuck::{Pod, Zeroable};
use core::mem::size_of;

/// Most VIPs one data path serves; sizes `LB_VIPS` and the per-VIP stats.
pub const MAX_VIPS: u32 = 256;
/// Default of `dataplane.max_backends` (backend ids over all VIPs): the compiled size of
/// `LB_BACKENDS` and the other maps indexed by backend id, which the agent sets at load.
pub const MAX_BACKENDS: u32 = 4096;
/// Default Maglev table size (a prime), per VIP.
pub const DEFAULT_MAGLEV_SIZE: u32 = 65537;
/// Each VIP owns two tables in `LB_MAGLEV` so a new one is written aside and then
/// switched to in one map update (see `VipInfo::generation`).
pub const TABLE_GENERATIONS: u32 = 2;
/// A Maglev slot or backend id that names no backend (a VIP with no usable backend).
pub const BACKEND_NONE: u32 = u32::MAX;

/// Map names (at most 15 characters: the kernel truncates longer names).
pub const MAP_VIPS: &str = "LB_VIPS";
pub const MAP_VIP_SLOTS: &str = "LB_VIP_SLOTS";
pub const MAP_MAGLEV: &str = "LB_MAGLEV";
pub const MAP_BACKENDS: &str = "LB_BACKENDS";
pub const MAP_STATS: &str = "LB_STATS";
pub const MAP_VIP_STATS: &str = "LB_VIP_STATS";
pub const MAP_BACKEND_STATS: &str = "LB_BE_STATS";
pub const MAP_CONNTRACK: &str = "LB_CONNTRACK";
pub const MAP_EMBRYONIC: &str = "LB_EMBRYONIC";
/// Slots of `LB_EMBRYONIC` (a power of two): first packets of flows the connection table
/// does not hold yet. 512 KiB.
pub const EMBRYONIC_SLOTS: u32 = 1 << 16;
pub const MAP_FLOOD: &str = "LB_FLOOD";
pub const MAP_SOURCES: &str = "LB_SOURCES";
pub const MAP_HOT_SOURCES: &str = "LB_HOT_SRC";
/// `quic::ServerKey` -> backend id: the server IDs of QUIC VIPs' backends.
pub const MAP_QUIC_IDS: &str = "LB_QUIC_IDS";
/// vip id -> `quic::QuicCounters`, per CPU.
pub const MAP_QUIC_STATS: &str = "LB_QUIC_STATS";
/// Most server IDs over all QUIC VIPs (one per backend at most).
pub const QUIC_ID_ENTRIES: u32 = MAX_BACKENDS;
pub const MAP_CAPTURE: &str = "LB_CAPTURE";
/// The ring buffer of new connection-table entries for the cluster's peers.
pub const MAP_EXPORT: &str = "LB_EXPORT";
/// Global set at load time: non-zero when `[cluster]` is configured, so the program
/// exports every entry it creates to `MAP_EXPORT` (zero: one predictable branch).
pub const GLOBAL_CLUSTER_EXPORT: &str = "CLUSTER_EXPORT";
/// The tunnel settings (`TunnelConfig`, one entry).
pub const MAP_TUNNEL: &str = "LB_TUNNEL";
/// Bytes of each captured frame kept (the rest is cut, as tcpdump's snaplen).
pub const CAPTURE_BYTES: usize = 128;
/// Global set at load time: one new flow in this many is counted (with that weight) for
/// the heavy-hitter report.
pub const GLOBAL_SOURCE_SAMPLE: &str = "SOURCE_SAMPLE";
/// The default of `GLOBAL_SOURCE_SAMPLE`.
pub const DEFAULT_SOURCE_SAMPLE: u32 = 8;
/// Global set at load time: frames per second per CPU the debug capture may copy (0: off).
pub const GLOBAL_CAPTURE_RATE: &str = "CAPTURE_RATE";
/// Client sources tracked for heavy-hitter reports (LRU: the busiest stay).
pub const SOURCE_ENTRIES: u32 = 16384;
/// Most hot sources (`LB_HOT_SRC`) over all VIPs at once.
pub const HOT_SOURCE_ENTRIES: u32 = 1024;
/// Written by the agent only, read back by a restarted agent: what the pinned maps hold.
pub const MAP_META: &str = "LB_META";
/// The program array holding `dataplane.next_program` (pinned, never adopted).
pub const MAP_NEXT: &str = "LB_NEXT";
pub const MAP_BACKEND_IDS: &str = "LB_BACKEND_IDS";
/// Bumped whenever a map's key, value or meaning changes: a restarted agent adopts pinned
/// maps only of its own layout (and sizes), and otherwise replaces them.
pub const LAYOUT_VERSION: u64 = 11;
/// Global set at load time: how many flows (source ports) the benchmark generator
/// (`xdp_bench_tx`, in the test object `lb-test-xdp`) cycles through.
pub const GLOBAL_BENCH_FLOWS: &str = "BENCH_FLOWS";
/// The test object's global: the Ethernet header (14 bytes) the benchmark generator
/// writes into every frame it sends; with EtherType 0 (the default, all zeroes) it
/// leaves the frame's own.
pub const GLOBAL_BENCH_ETH: &str = "BENCH_ETH";
/// Frames counted by the benchmark programs (test object `lb-test-xdp`), per CPU, at
/// `BENCH_RECEIVED` and `BENCH_SENT`.
pub const MAP_BENCH_SINK: &str = "BENCH_SINK";
/// `MAP_BENCH_SINK` index: frames the sink (`xdp_bench_sink`) saw.
pub const BENCH_RECEIVED: u32 = 0;
/// `MAP_BENCH_SINK` index: frames the generator (`xdp_bench_tx`) sent.
pub const BENCH_SENT: u32 = 1;
/// Default size of the connection table.
pub const DEFAULT_CONNTRACK_ENTRIES: u32 = 1 << 20;
/// Most interfaces one data path is attached to (`dataplane.interfaces`); sizes the
/// egress maps.
pub const MAX_EGRESS: u32 = 16;
/// Egress index -> `EgressInfo`: the interfaces a forwarded frame may leave by.
pub const MAP_EGRESS: &str = "LB_EGRESS";
/// Egress index -> interface index (a DEVMAP): the target of XDP_REDIRECT.
pub const MAP_TX_PORTS: &str = "LB_TX_PORTS";
/// Backend id -> egress index (u32): the interface that reaches the backend or its next
/// hop.
pub const MAP_BACKEND_EGRESS: &str = "LB_BE_EGRESS";
/// Egress index -> traffic counters (per CPU): frames forwarded out of each interface.
pub const MAP_EGRESS_STATS: &str = "LB_EGRESS_STATS";
/// Global set at load time: how many interfaces the program is attached to. Above 1 a
/// forwarded frame leaves by its backend's interface (`LB_BE_EGRESS`); 0 or 1: back out
/// of the interface it came in by (XDP_TX), with `IFACE_MAC` as its source, as before.
pub const GLOBAL_EGRESS_COUNT: &str = "EGRESS_COUNT";
/// Global (read-only data) set at load time: the Maglev table size.
pub const GLOBAL_MAGLEV_SIZE: &str = "MAGLEV_SIZE";
/// Global set at load time: the interface's own MAC, written as the source of forwarded
/// frames.
pub const GLOBAL_IFACE_MAC: &str = "IFACE_MAC";
/// Global set at load time: nanoseconds after which an idle UDP flow's entry no longer
/// holds it to its backend.
pub const GLOBAL_UDP_IDLE_NS: &str = "UDP_IDLE_NS";
/// Global set at load time: most connection-table entries one CPU creates per second
/// (0: no limit). Above it, flows still balance by the Maglev table, uncached.
pub const GLOBAL_CT_INSERT_LIMIT: &str = "CT_INSERT_LIMIT";
/// Entries refresh their `last_seen_ns` at most this often: fewer writes to shared
/// cache lines from many CPUs.
pub const LAST_SEEN_GRANULARITY_NS: u64 = 1_000_000_000;

pub const ADDR_FAMILY_V4: u8 = 4;
pub const ADDR_FAMILY_V6: u8 = 6;
pub const PROTO_TCP: u8 = 6;
pub const PROTO_UDP: u8 = 17;
pub const PROTO_ICMP: u8 = 1;
pub const PROTO_ICMPV6: u8 = 58;

/// Key of `LB_VIPS`: which traffic is balanced.
// Aligned beyond its fields so the program copies and compares it a word at a time.
#[repr(C, align(4))]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct VipKey {
    /// IPv4: the first 4 bytes, the rest zero. IPv6: all 16. Network order.
    pub addr: [u8; 16],
    /// Network order.
    pub port: u16,
    /// `PROTO_TCP` or `PROTO_UDP`.
    pub proto: u8,
    /// `ADDR_FAMILY_V4` or `ADDR_FAMILY_V6`.
    pub family: u8,
}
const _: () = assert!(size_of::<VipKey>() == 20);

/// `VipInfo::flags`: hash on the source address only (client affinity).
pub const VIP_F_HASH_SRC_IP: u32 = 1;
/// `VipInfo::flags`, with `VIP_F_HASH_SRC_IP`: the VIP has `hot_source_share`, so a new
/// flow from a source in `LB_HOT_SRC` is hashed on its 5-tuple. Without it the program
/// never looks there: other VIPs pay nothing.
pub const VIP_F_HOT_SOURCES: u32 = 2;
/// `VipInfo::flags`: the VIP has `[vip.outlier]`, so a SYN reads its embryonic slot to
/// tell a client's retransmission from a first SYN (`handshake::syn`). Without it the
/// slot is written unread: the read is a cache miss a spoofed SYN would pay for nothing.
/// (Bit 4 is `quic::VIP_F_QUIC`, bits 8-11 its server ID length.)
pub const VIP_F_OUTLIER: u32 = 8;
/// `VipInfo::flags`: the VIP has `stable_slots`: its slots carry `slot::word`s, and a TCP
/// packet that is not a SYN in a slot no recent table change touched goes where the slot
/// says, with no connection-table lookup and no entry (`slot`).
pub const VIP_F_STABLE: u32 = 1 << 12;

/// Value of `LB_VIPS`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct VipInfo {
    /// Index into the per-VIP stats.
    pub vip_id: u32,
    /// Which of the VIP's `TABLE_GENERATIONS` tables in `LB_MAGLEV` is live. Switching it
    /// is how a new table takes effect atomically.
    pub generation: u32,
    /// `VIP_F_*` bits.
    pub flags: u32,
    pub _pad: u32,
}
const _: () = assert!(size_of::<VipInfo>() == 16);

impl VipInfo {
    /// First slot of `generation`'s table for `vip_id` in `LB_MAGLEV`.
    pub const fn table_base_for(vip_id: u32, generation: u32, table_size: u32) -> u32 {
        (vip_id * TABLE_GENERATIONS + generation) * table_size
    }

    /// First slot of the live table in `LB_MAGLEV`.
    #[inline(always)]
    pub const fn table_base(&self, table_size: u32) -> u32 {
        Self::table_base_for(self.vip_id, self.generation, table_size)
    }
}

/// `BackendInfo::flags`: the backend may keep the flows it has (ready, or draining while
/// healthy). Without it, a connection-table entry pointing here is re-hashed.
pub const BACKEND_F_SERVES_FLOWS: u16 = 1;

/// `BackendInfo::forward`: the frame keeps its packet, only the MACs are rewritten
/// (the backend shares the balancer's L2 segment).
pub const FORWARD_L2: u8 = 0;
/// `BackendInfo::forward`: the packet is encapsulated in an outer IP header to the
/// backend's address (IPIP: 4in4, 6in6, 4in6, 6in4, by the two families).
pub const FORWARD_IPIP: u8 = 1;
/// `BackendInfo::forward`: the packet is encapsulated in outer IP + UDP to
/// `BackendInfo::gue_port_be`, GUE variant 1 ("direct IP": no GUE header; the inner IP
/// version nibble tells IPv4 from IPv6), as Linux fou (`encap gue`, `ipproto 4/41`
/// receive side: `ip fou add port N gue`) and Katran send it.
pub const FORWARD_GUE: u8 = 2;

/// Value of `LB_BACKENDS`, indexed by backend id.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct BackendInfo {
    /// Destination MAC of frames sent to this backend: the backend's own for an on-link
    /// backend (always for `FORWARD_L2`), the gateway's for a routed one.
    pub mac: [u8; 6],
    /// `BACKEND_F_*` bits.
    pub flags: u16,
    /// The VIP this backend id belongs to (every id serves one VIP): a packet that
    /// follows its connection-table entry counts for this VIP without looking it up.
    pub vip_id: u32,
    /// `FORWARD_*`: how frames reach the backend.
    pub forward: u8,
    /// `ADDR_FAMILY_V4` or `ADDR_FAMILY_V6` of `addr`: the outer header's family for a
    /// tunnel (which may differ from the VIP's: 4in6, 6in4).
    pub family: u8,
    /// `FORWARD_GUE`: the outer UDP destination port. Network order.
    pub gue_port_be: u16,
    /// The backend's own address: the outer destination of a tunnel. IPv4: the first 4
    /// bytes, the rest zero. Network order.
    pub addr: [u8; 16],
}
const _: () = assert!(size_of::<BackendInfo>() == 32);

impl BackendInfo {
    /// A backend reached by MAC rewrite alone (`FORWARD_L2`); no address needed.
    pub const fn l2(mac: [u8; 6], flags: u16, vip_id: u32) -> Self {
        Self {
            mac,
            flags,
            vip_id,
            forward: FORWARD_L2,
            family: 0,
            gue_port_be: 0,
            addr: [0; 16],
        }
    }
}

/// Value of `LB_TUNNEL` (one entry): what the program needs to know of the interface:
/// what every encapsulation needs besides the backend, and whether a frame's length may
/// be read from its first buffer. Written by the agent at start, on every reload (so a
/// reload can change the source) and when the interface changes (its MTU, its
/// addresses); read by the program for each tunnelled packet, and `linear_frames` for
/// each forwarded one.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct TunnelConfig {
    /// Outer IPv4 source (`dataplane.tunnel_source`, else the interface's address).
    /// All zero: no IPv4 source; packets to IPv4-addressed tunnel backends are dropped
    /// (`drop_no_tunnel_source`). Network order.
    pub src_v4: [u8; 4],
    /// The interface MTU: an encapsulated packet longer than this (IP packet, without
    /// the Ethernet header) is answered with "fragmentation needed" / "packet too big".
    /// 0: not checked.
    pub mtu: u32,
    /// Outer IPv6 source (`dataplane.tunnel_source6`, else the interface's global
    /// address); all zero: none, as for `src_v4`.
    pub src_v6: [u8; 16],
    /// Non-zero: every frame the program sees is in one buffer (one interface, attached
    /// in native mode, its MTU at most the single-buffer limit), so a frame's length is
    /// `data_end - data`. 0, the safe default (generic mode, jumbo frames, several
    /// interfaces, or not yet attached): the program asks the kernel
    /// (`bpf_xdp_get_buff_len`), a helper call per forwarded packet.
    pub linear_frames: u32,
}
const _: () = assert!(size_of::<TunnelConfig>() == 28);

/// Entries of `LB_VIP_SLOTS`.
pub const VIP_SLOTS: u32 = 4096;
/// `VipSlot::state`: a VIP key hashes to this slot.
pub const VIP_SLOT_USED: u32 = 1;
/// `VipSlot::state`: the slot's content is not to be read: more than one VIP key hashes
/// here, or the content is being rewritten. The program looks the key up in `LB_VIPS`.
pub const VIP_SLOT_SHARED: u32 = 2;

/// Value of `LB_VIP_SLOTS`, indexed by `VipSlot::index` of a VIP's key: the VIP, so a
/// packet finds its VIP with one array read and a key compare, and traffic for no VIP is
/// passed after it, before any hash-map lookup.
///
/// Every update by the agent changes either the state or the content, and the content
/// only while the program does not read it (`state` not `VIP_SLOT_USED` alone); the
/// program copies a slot twice and trusts it only if both copies agree. So a packet
/// never takes one VIP's key with another VIP's table.
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct VipSlot {
    pub key: VipKey,
    pub vip_id: u32,
    /// Which of the VIP's two tables is live (`VipInfo::table_base_for`).
    pub generation: u32,
    /// `VIP_F_*` bits, as `VipInfo::flags`.
    pub flags: u32,
    /// `VIP_SLOT_*` bits.
    pub state: u32,
    pub _pad: u32,
}
const _: () = assert!(size_of::<VipSlot>() == 40);

impl VipSlot {
    /// The slot of a VIP key: the top bits of `hash::vip_key_hash` (multiply-shift over
    /// all its words), so keys that differ in any field land on unrelated slots.
    #[inline(always)]
    pub fn index(key: &VipKey) -> u32 {
        hash::vip_key_hash(key) >> (32 - VIP_SLOTS.trailing_zeros())
    }
}

impl VipKey {
    /// Equality word by word, without branches (the program compares keys on every
    /// packet; an array `==` becomes a byte-by-byte memcmp loop in BPF).
    #[inline(always)]
    pub fn same(&self, other: &VipKey) -> bool {
        let a = bytemuck::cast::<VipKey, [u32; 5]>(*self);
        let b = bytemuck::cast::<VipKey, [u32; 5]>(*other);
        (a[0] ^ b[0]) | (a[1] ^ b[1]) | (a[2] ^ b[2]) | (a[3] ^ b[3]) | (a[4] ^ b[4]) == 0
    }
}

/// Key of `LB_SOURCES`: a client address of a VIP; its value counts the new flows it
/// opened (per CPU), so the agent can name the heavy hitters.
// Aligned beyond its fields so the program copies and compares it a word at a time.
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct SourceKey {
    /// IPv4: the first 4 bytes. Network order.
    pub addr: [u8; 16],
    pub vip_id: u32,
    pub family: u8,
    pub _pad: [u8; 3],
}
const _: () = assert!(size_of::<SourceKey>() == 24);

impl SourceKey {
    /// The key of client `addr` (map form, `addr::to_map`) of VIP `vip_id`.
    #[inline(always)]
    pub const fn new(vip_id: u32, addr: [u8; 16], family: u8) -> Self {
        Self {
            addr,
            vip_id,
            family,
            _pad: [0; 3],
        }
    }
}

/// One frame sent to userspace by the debug capture (`LB_CAPTURE` ring buffer).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct CaptureRecord {
    /// CLOCK_MONOTONIC when the frame arrived, as the program reads it: the coarse clock
    /// (`bpf_ktime_get_coarse_ns`, read once per jiffy), so up to a tick early.
    pub ts_ns: u64,
    /// The frame's length on the wire.
    pub len: u32,
    /// Bytes of it in `data`.
    pub caplen: u32,
    pub data: [u8; CAPTURE_BYTES],
}
const _: () = assert!(size_of::<CaptureRecord>() == 16 + CAPTURE_BYTES);

/// Indices of `LB_META` (u64 values).
pub mod meta {
    pub const LAYOUT: u32 = 0;
    pub const MAGLEV_SIZE: u32 = 1;
    pub const VIP_CAPACITY: u32 = 2;
    pub const CONNTRACK_ENTRIES: u32 = 3;
    /// `MODE_NATIVE` or `MODE_GENERIC`: how the pinned link was attached.
    pub const XDP_MODE: u32 = 4;
    /// The interface index the program was attached to.
    pub const IFINDEX: u32 = 5;
    pub const COUNT: u32 = 8;
    pub const MODE_NATIVE: u64 = 1;
    pub const MODE_GENERIC: u64 = 2;
}

/// Value of `LB_BACKEND_IDS`, indexed by backend id: which backend an id names, so a
/// restarted agent gives every backend the id its connection-table entries use.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct BackendIdentity {
    /// IPv4: the first 4 bytes. Network order.
    pub addr: [u8; 16],
    pub vip_id: u32,
    pub family: u8,
    /// 1 while the id is assigned.
    pub in_use: u8,
    pub _pad: [u8; 2],
}
const _: () = assert!(size_of::<BackendIdentity>() == 24);

/// Key of `LB_CONNTRACK`: one flow, as it arrives (client to VIP).
// Aligned beyond its fields so the program copies and compares it a word at a time.
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct FlowKey {
    /// IPv4: the first 4 bytes. Network order.
    pub src: [u8; 16],
    pub dst: [u8; 16],
    /// Network order.
    pub src_port: u16,
    /// Network order.
    pub dst_port: u16,
    pub proto: u8,
    pub family: u8,
    pub _pad: [u8; 2],
}
const _: () = assert!(size_of::<FlowKey>() == 40);

/// `FlowEntry::flags`: the client sent a FIN or RST. The entry stays (late packets
/// still follow it) but the flow no longer counts as active, so a drain can end.
pub const FLOW_F_CLOSING: u32 = 1;
/// `FlowEntry::flags`: the entry came from a cluster peer (`[cluster]`), not from this
/// node's own packets. Cleared by the first packet that follows it here (that refresh
/// writes the entry anyway); meanwhile it does not count as an active flow of this node.
pub const FLOW_F_LEARNED: u32 = 2;

/// Value of `LB_CONNTRACK`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct FlowEntry {
    pub backend_id: u32,
    /// `FLOW_F_*` bits.
    pub flags: u32,
    /// CLOCK_MONOTONIC of the last packet, as the program reads it (the coarse clock,
    /// `bpf_ktime_get_coarse_ns`, read once per jiffy), to
    /// `LAST_SEEN_GRANULARITY_NS`.
    pub last_seen_ns: u64,
}
const _: () = assert!(size_of::<FlowEntry>() == 16);

/// One entry the program created, for the cluster's peers (`LB_EXPORT` ring buffer).
/// The backend is named by this node's id: the agent turns it into the backend's address,
/// which the peers map to their own ids.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct ExportRecord {
    pub key: FlowKey,
    pub backend_id: u32,
    /// `FLOW_F_*` bits of the new entry.
    pub flags: u32,
}
const _: () = assert!(size_of::<ExportRecord>() == 48);
/// `Embryo::flags`: the first packet was a SYN, and no later packet of the flow has
/// entered (or re-written) its connection-table entry since. A SYN does not look the
/// connection table up (that lookup is most of what a spoofed SYN would cost); an entry
/// left by an earlier connection on the same tuple meets this flag at its next packet and
/// gives way to the new connection.
pub const EMBRYO_F_SYN: u16 = 1;
/// `Embryo::flags`: the flow's SYN was sent again while it waited (`handshake::syn`).
pub const EMBRYO_F_RETRIED: u16 = 2;
/// `Embryo::flags`: the flow's handshake was counted completed (`handshake::ack`): an
/// ACK whose entry the flood guard did not insert, sent again, is not counted twice.
pub const EMBRYO_F_COMPLETED: u16 = 4;

/// Value of `LB_EMBRYONIC`, indexed by `flow::embryo_place`: the backend the first
/// packet of a flow took (a SYN, a UDP flow's first datagram, an ACK the connection table
/// did not know), so the flow's second packet, which enters it into the connection table,
/// goes there too even if the Maglev table changed in between. Direct-mapped: a newer
/// flow on the same slot overwrites it, and the older flow's next packet then takes the
/// Maglev table, as it would have anyway.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct Embryo {
    /// `flow::embryo_place`'s tag of the flow (never 0: an empty slot is all zeroes).
    pub tag: u32,
    /// Below `MAX_BACKENDS`.
    pub backend_id: u16,
    /// `EMBRYO_F_*` bits.
    pub flags: u16,
}
const _: () = assert!(size_of::<Embryo>() == 8);

/// A per-CPU rate limit's window: events counted in the second that began at
/// `start_ns`. The value of `LB_FLOOD` (connection-table inserts) and of
/// `LB_CAPTURE_WIN` (frames copied to the debug capture).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct RateWindow {
    pub start_ns: u64,
    pub events: u64,
}
const _: () = assert!(size_of::<RateWindow>() == 16);

/// Value of `LB_EGRESS`, indexed by egress index (the position of the interface in
/// `dataplane.interfaces`): where a frame leaves and the source MAC it then carries.
/// Written by the agent at attach and when an interface comes back or changes its MAC.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct EgressInfo {
    /// The interface's index; 0: no interface (gone, or never attached).
    pub ifindex: u32,
    /// The interface's MAC: the source of frames that leave by it.
    pub mac: [u8; 6],
    /// `meta::MODE_NATIVE` or `MODE_GENERIC` (as a u8): how its link was attached, for a
    /// restarted agent (the program does not read it).
    pub mode: u8,
    pub _pad: u8,
}
const _: () = assert!(size_of::<EgressInfo>() == 12);

/// Value of `LB_VIP_STATS` and `LB_EGRESS_STATS` (per CPU; the agent sums them into
/// `TrafficCounters`, handshakes zero): 32 bytes, the size they had before backends
/// counted handshakes, as a VIP or an interface counts none.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct PacketCounters {
    pub packets: u64,
    pub bytes: u64,
    /// New flows forwarded, as `TrafficCounters::new_flows`.
    pub new_flows: u64,
    pub _reserved: u64,
}
const _: () = assert!(size_of::<PacketCounters>() == 32);

/// Value of `LB_BE_STATS`, a backend's counters (per CPU), and the sum over CPUs the agent
/// reads of a VIP, a backend or an interface. 64 bytes: one cache line when the element
/// is aligned, which a forwarded packet writes once (`handshake::Events` included).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct TrafficCounters {
    pub packets: u64,
    pub bytes: u64,
    /// New flows forwarded: TCP SYNs (without ACK), and UDP packets without a live
    /// connection-table entry.
    pub new_flows: u64,
    pub _reserved: u64,
    /// Backends only: TCP handshakes, indexed by `handshake::STARTED` ... (zero for a VIP).
    pub handshakes: [u64; handshake::COUNT],
}
const _: () = assert!(size_of::<TrafficCounters>() == 64);

/// Value of `LB_STATS` (one entry, per CPU): a counter for every outcome of the program,
/// indexed by `stat`. One struct, so a packet looks the counters up once.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct Outcomes {
    pub counts: [u64; stat::COUNT as usize],
}
const _: () = assert!(size_of::<Outcomes>() == 8 * stat::COUNT as usize);

/// Indices of `Outcomes::counts`: one counter for every outcome of the program.
/// 0..=4 are the XDP actions by their kernel codes; the rest say why.
pub mod stat {
    pub const XDP_ABORTED: u32 = 0;
    pub const XDP_DROP: u32 = 1;
    pub const XDP_PASS: u32 = 2;
    pub const XDP_TX: u32 = 3;
    pub const XDP_REDIRECT: u32 = 4;
    /// Passed: EtherType neither IPv4 nor IPv6 (ARP, LLDP ...).
    pub const PASS_NOT_IP: u32 = 5;
    /// Passed: IP, but not to a configured VIP, port and protocol.
    pub const PASS_NOT_VIP: u32 = 6;
    /// Passed: IP protocol other than TCP and UDP (ICMP ...).
    pub const PASS_OTHER_PROTO: u32 = 7;
    /// Passed: an IPv4 fragment; lb does not balance fragments (no ports in later ones).
    pub const PASS_FRAGMENT: u32 = 8;
    /// Passed: an IPv6 packet whose next header is an extension header.
    pub const PASS_IPV6_EXT: u32 = 9;
    /// Passed: a second VLAN tag (QinQ) is not parsed.
    pub const PASS_VLAN_STACKED: u32 = 10;
    /// Dropped: a header is cut short by the end of the frame.
    pub const DROP_TRUNCATED: u32 = 11;
    /// Dropped: an IPv4 header length below 20 bytes or a wrong version field.
    pub const DROP_BAD_HEADER: u32 = 12;
    /// Dropped: a packet for a VIP that has no usable backend.
    pub const DROP_NO_BACKEND: u32 = 13;
    /// Forwarded, noted: an IPv4 header with options (parsed past, not an error).
    pub const SEEN_IPV4_OPTIONS: u32 = 14;
    /// Forwarded, noted: a packet with an 802.1Q tag.
    pub const SEEN_VLAN: u32 = 15;
    /// A TCP SYN: always balanced by the Maglev table, and remembered in the embryonic
    /// table; it neither reads nor writes the connection table (a spoofed SYN costs no
    /// entry and no lookup).
    pub const CT_MISS_SYN: u32 = 16;
    /// A TCP packet other than SYN with no entry whose flow's first packet the embryonic
    /// table does not remember: a flow lb did not know (or a spoofed ACK). Steady
    /// non-zero growth means flows are being broken.
    pub const CT_MISS_NON_SYN: u32 = 17;
    /// A UDP packet with no live entry, not its flow's second: a new (or idle-expired)
    /// UDP flow.
    pub const CT_MISS_UDP: u32 = 18;
    /// A packet that followed its entry.
    pub const CT_HIT: u32 = 19;
    /// An entry whose backend no longer serves flows (failed, maint, removed): re-hashed.
    pub const CT_REHASH: u32 = 20;
    /// Entries written: created by a flow's second packet (`CT_PROMOTED`), or an
    /// existing entry re-written (a SYN on a reused tuple, a re-hash, an idle UDP flow).
    pub const CT_CREATED: u32 = 21;
    /// Inserts skipped by the flood guard (`CT_INSERT_LIMIT`).
    pub const CT_INSERT_SKIPPED: u32 = 22;
    /// Frames copied to the debug capture (TCP non-SYN misses, rate limited).
    pub const CAPTURED: u32 = 23;
    /// Forwarded, noted: an ICMP "fragmentation needed" or ICMPv6 "packet too big" about
    /// a VIP flow, sent to that flow's backend (whose replies bypass the balancer, so
    /// only it can lower its path MTU).
    pub const SEEN_ICMP_TOO_BIG: u32 = 24;
    /// First packets of flows remembered in the embryonic table (`LB_EMBRYONIC`) instead
    /// of the connection table: SYNs, UDP flows' first datagrams, ACKs of flows the
    /// connection table did not hold. A flood of random tuples ends here.
    pub const CT_EMBRYONIC: u32 = 25;
    /// Flows entered into the connection table by their second packet (a handshake's
    /// ACK, a UDP flow's second datagram), to the backend their first packet took.
    pub const CT_PROMOTED: u32 = 26;
    /// A new flow of a hot source (`LB_HOT_SRC`) of a src-ip VIP, hashed on its 5-tuple
    /// instead of its source.
    pub const HOT_SOURCE_SPREAD: u32 = 27;
    /// Entries of an earlier connection on a tuple a new SYN reused: re-written to the
    /// SYN's backend at the new connection's next packet.
    pub const CT_REUSED: u32 = 28;
    /// Forwarded in an IPIP tunnel (`forward = "ipip"`).
    pub const TX_IPIP: u32 = 29;
    /// Forwarded in a GUE tunnel (`forward = "gue"`).
    pub const TX_GUE: u32 = 30;
    /// Answered (XDP_TX back to the client): too big for the interface MTU once
    /// encapsulated; an ICMP "fragmentation needed" / ICMPv6 "packet too big" carries
    /// the usable MTU.
    pub const TX_ICMP_TOO_BIG: u32 = 31;
    /// Dropped: too big once encapsulated and not answerable (an IPv4 packet without
    /// DF, which would have to be fragmented; or the answer could not be built).
    pub const DROP_TOO_BIG: u32 = 32;
    /// Dropped: a tunnel backend of a family with no outer source address in
    /// `LB_TUNNEL`.
    pub const DROP_NO_TUNNEL_SOURCE: u32 = 33;
    /// Dropped: the frame could not be grown for the outer headers
    /// (`bpf_xdp_adjust_head` refused).
    pub const DROP_ENCAP_FAILED: u32 = 34;
    /// New entries written to the cluster export ring (`[cluster]`).
    pub const CLUSTER_EXPORTED: u32 = 35;
    /// New entries not exported: the ring was full (the agent or its peers are slow).
    pub const CLUSTER_EXPORT_DROPPED: u32 = 36;
    /// A short-header QUIC packet of a `quic` VIP sent to the backend its destination
    /// connection ID names (`quic::classify`), whatever its source.
    pub const QUIC_ROUTED_BY_CID: u32 = 37;
    /// A short-header QUIC packet whose server ID names no backend of its VIP (unknown,
    /// retired) or one that is down: balanced as any UDP datagram.
    pub const QUIC_CID_UNKNOWN: u32 = 38;
    /// Dropped: the interface that reaches the backend (`dataplane.interfaces`) is gone,
    /// or its redirect target is not set (XDP_REDIRECT refused).
    pub const DROP_NO_EGRESS: u32 = 39;
    /// A TCP packet (not a SYN) of a `stable_slots` VIP sent where its stable slot says,
    /// with no connection-table lookup (`slot`).
    pub const CT_STABLE: u32 = 40;
    /// A TCP packet (not a SYN) with no entry in a changed slot of a `stable_slots` VIP:
    /// a flow that began before a table change moved its slot, sent to the slot's
    /// previous backend (and pinned there by an entry at its next packet), not counted
    /// as `ct_miss_non_syn`.
    pub const CT_PREVIOUS: u32 = 41;
    pub const COUNT: u32 = 42;

    /// Names for status and metrics, indexed like the constants above.
    pub const NAMES: [&str; COUNT as usize] = [
        "xdp_aborted",
        "xdp_drop",
        "xdp_pass",
        "xdp_tx",
        "xdp_redirect",
        "pass_not_ip",
        "pass_not_vip",
        "pass_other_proto",
        "pass_fragment",
        "pass_ipv6_ext",
        "pass_vlan_stacked",
        "drop_truncated",
        "drop_bad_header",
        "drop_no_backend",
        "seen_ipv4_options",
        "seen_vlan",
        "ct_miss_syn",
        "ct_miss_non_syn",
        "ct_miss_udp",
        "ct_hit",
        "ct_rehash",
        "ct_created",
        "ct_insert_skipped",
        "captured",
        "seen_icmp_too_big",
        "ct_embryonic",
        "ct_promoted",
        "hot_source_spread",
        "ct_reused",
        "tx_ipip",
        "tx_gue",
        "tx_icmp_too_big",
        "drop_too_big",
        "drop_no_tunnel_source",
        "drop_encap_failed",
        "cluster_exported",
        "cluster_export_dropped",
        "quic_routed_by_cid",
        "quic_cid_unknown",
        "drop_no_egress",
        "ct_stable",
        "ct_previous",
    ];

    /// What a counter counts. Readers group counters by it (every drop, every pass),
    /// never by the words of their names.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    pub enum Kind {
        /// An XDP action the program returned (`XDP_*`): every packet counts once here.
        Action,
        /// Passed to the kernel, and why (`PASS_*`).
        Pass,
        /// Dropped, and why (`DROP_*`).
        Drop,
        /// Sent in a tunnel, or answered to the client (`TX_*`).
        Tx,
        /// Forwarded, and noted (`SEEN_*`).
        Seen,
        /// What the connection and embryonic tables did (`CT_*`).
        Conntrack,
        /// The cluster's export ring (`CLUSTER_*`).
        Cluster,
        /// QUIC routing by connection ID (`QUIC_*`).
        Quic,
        /// The rest: the debug capture, hot sources spread.
        Other,
    }

    impl Kind {
        /// How the names of this kind's counters begin ("" for `Other`).
        pub const fn prefix(self) -> &'static str {
            match self {
                Kind::Action => "xdp_",
                Kind::Pass => "pass_",
                Kind::Drop => "drop_",
                Kind::Tx => "tx_",
                Kind::Seen => "seen_",
                Kind::Conntrack => "ct_",
                Kind::Cluster => "cluster_",
                Kind::Quic => "quic_",
                Kind::Other => "",
            }
        }
    }

    /// The kind of the counter at `index`.
    pub const fn kind(index: u32) -> Kind {
        match index {
            XDP_ABORTED..=XDP_REDIRECT => Kind::Action,
            PASS_NOT_IP..=PASS_VLAN_STACKED => Kind::Pass,
            DROP_TRUNCATED..=DROP_NO_BACKEND
            | DROP_TOO_BIG..=DROP_ENCAP_FAILED
            | DROP_NO_EGRESS => Kind::Drop,
            TX_IPIP..=TX_ICMP_TOO_BIG => Kind::Tx,
            SEEN_IPV4_OPTIONS | SEEN_VLAN | SEEN_ICMP_TOO_BIG => Kind::Seen,
            CT_MISS_SYN..=CT_INSERT_SKIPPED
            | CT_EMBRYONIC
            | CT_PROMOTED
            | CT_REUSED
            | CT_STABLE
            | CT_PREVIOUS => Kind::Conntrack,
            CLUSTER_EXPORTED | CLUSTER_EXPORT_DROPPED => Kind::Cluster,
            QUIC_ROUTED_BY_CID | QUIC_CID_UNKNOWN => Kind::Quic,
            _ => Kind::Other,
        }
    }

    /// The index of the counter named `name` (status carries counters by name).
    pub fn index(name: &str) -> Option<u32> {
        (0u32..)
            .zip(NAMES)
            .find(|(_, n)| *n == name)
            .map(|(i, _)| i)
    }

    /// The counter at `index` within its kind: its name without the kind's prefix
    /// (`DROP_NO_BACKEND`: "no_backend"), the `reason` label of the metrics.
    pub fn reason(index: u32) -> &'static str {
        let name = NAMES[index as usize];
        &name[kind(index).prefix().len()..]
    }
}

/// The decapsulation program for backends (`lb decap`): object `lb-decap` (embedded in
/// `lb` as `lb_userspace::DECAP_OBJECT`), one XDP program that strips the outer header of
/// IPIP (4in4, 6in4, 4in6, 6in6) and GUE packets addressed to one of this host's
/// addresses and passes the inner packet to the stack; everything else passes untouched.
pub mod decap {
    use super::{Pod, Zeroable, size_of};

    /// The program's name in the object.
    pub const PROGRAM: &str = "lb_decap";
    /// `Outcomes`-like counters (`DecapOutcomes`, one entry, per CPU), by `stat`.
    pub const MAP_STATS: &str = "LB_DECAP_STATS";
    /// `HostAddr` -> u8 (1): the outer destinations taken as this host's. Filled by the
    /// loader from the host's addresses at attach.
    pub const MAP_ADDRS: &str = "LB_DECAP_ADDRS";
    /// Array of u32 (`CONFIG_*` indices): settings the loader writes.
    pub const MAP_CONFIG: &str = "LB_DECAP_CONFIG";
    /// `MAP_CONFIG` index: the GUE UDP port (host order); 0: GUE not decapsulated.
    pub const CONFIG_GUE_PORT: u32 = 0;
    /// `MAP_CONFIG` index, for `lb decap status` only: how the link was attached
    /// (`meta::MODE_NATIVE` or `meta::MODE_GENERIC`).
    pub const CONFIG_MODE: u32 = 1;
    pub const CONFIG_ENTRIES: u32 = 4;
    /// Most host addresses `MAP_ADDRS` holds.
    pub const MAX_ADDRS: u32 = 256;
    /// The port `lb decap attach` listens on without `--gue-port` (and the default
    /// `gue_port` of a VIP).
    pub const DEFAULT_GUE_PORT: u16 = 6080;

    /// Key of `MAP_ADDRS`.
    #[repr(C)]
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Pod, Zeroable)]
    pub struct HostAddr {
        /// IPv4: the first 4 bytes, the rest zero. Network order.
        pub addr: [u8; 16],
        /// `ADDR_FAMILY_V4` or `ADDR_FAMILY_V6`.
        pub family: u8,
        pub _pad: [u8; 3],
    }
    const _: () = assert!(size_of::<HostAddr>() == 20);

    /// Value of `MAP_STATS`.
    #[repr(C)]
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
    pub struct DecapOutcomes {
        pub counts: [u64; stat::COUNT as usize],
    }

    /// Indices of `DecapOutcomes::counts`: every frame counts once.
    pub mod stat {
        /// Decapsulated and passed: IPv4 in IPv4 (protocol 4).
        pub const DECAP_4IN4: u32 = 0;
        /// IPv6 in IPv4 (protocol 41).
        pub const DECAP_6IN4: u32 = 1;
        /// IPv4 in IPv6 (next header 4).
        pub const DECAP_4IN6: u32 = 2;
        /// IPv6 in IPv6 (next header 41).
        pub const DECAP_6IN6: u32 = 3;
        /// GUE (variant 1) in outer IPv4, either inner family.
        pub const DECAP_GUE4: u32 = 4;
        /// GUE (variant 1) in outer IPv6.
        pub const DECAP_GUE6: u32 = 5;
        /// Passed untouched: not a tunnel packet (not IP, another protocol, UDP to
        /// another port, an IPv6 extension header).
        pub const PASS_NOT_TUNNEL: u32 = 6;
        /// Passed untouched: a tunnel packet to an address not in `MAP_ADDRS`.
        pub const PASS_NOT_LOCAL: u32 = 7;
        /// Passed untouched: a tunnel packet whose headers are malformed or cut short
        /// (outer or inner), or a GUE header other than variant 1 with a known version.
        pub const PASS_MALFORMED: u32 = 8;
        /// Passed untouched: an outer IPv4 fragment (the stack reassembles it).
        pub const PASS_FRAGMENT: u32 = 9;
        /// Dropped: the frame could not be shrunk after the headers were moved.
        pub const DROP_FAILED: u32 = 10;
        pub const COUNT: u32 = 11;

        pub const NAMES: [&str; COUNT as usize] = [
            "decap_4in4",
            "decap_6in4",
            "decap_4in6",
            "decap_6in6",
            "decap_gue4",
            "decap_gue6",
            "pass_not_tunnel",
            "pass_not_local",
            "pass_malformed",
            "pass_fragment",
            "drop_failed",
        ];
    }
}

// The agent reads and writes these through aya's typed maps.
#[cfg(feature = "user")]
mod aya_pod {
    unsafe impl aya::Pod for super::VipKey {}
    unsafe impl aya::Pod for super::VipInfo {}
    unsafe impl aya::Pod for super::BackendInfo {}
    unsafe impl aya::Pod for super::TunnelConfig {}
    unsafe impl aya::Pod for super::decap::HostAddr {}
    unsafe impl aya::Pod for super::decap::DecapOutcomes {}
    unsafe impl aya::Pod for super::VipSlot {}
    unsafe impl aya::Pod for super::BackendIdentity {}
    unsafe impl aya::Pod for super::SourceKey {}
    unsafe impl aya::Pod for super::Outcomes {}
    unsafe impl aya::Pod for super::TrafficCounters {}
    unsafe impl aya::Pod for super::PacketCounters {}
    unsafe impl aya::Pod for super::FlowKey {}
    unsafe impl aya::Pod for super::FlowEntry {}
    unsafe impl aya::Pod for super::Embryo {}
    unsafe impl aya::Pod for super::RateWindow {}
    unsafe impl aya::Pod for super::quic::ServerKey {}
    unsafe impl aya::Pod for super::quic::QuicCounters {}
    unsafe impl aya::Pod for super::EgressInfo {}
}

/// The Maglev slot a flow hash selects: `hash` scaled onto `0..table_size` by a
/// multiply and a shift, as even as `hash % table_size` for a well-mixed hash, without
/// the division (tens of cycles on every new flow).
#[inline(always)]
pub const fn maglev_slot(hash: u32, table_size: u32) -> u32 {
    ((hash as u64 * table_size as u64) >> 32) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_counter_is_named_as_its_kind_says() {
        let kinds = [
            stat::Kind::Action,
            stat::Kind::Pass,
            stat::Kind::Drop,
            stat::Kind::Tx,
            stat::Kind::Seen,
            stat::Kind::Conntrack,
            stat::Kind::Cluster,
            stat::Kind::Quic,
        ];
        for (index, name) in (0u32..).zip(stat::NAMES) {
            let kind = stat::kind(index);
            // A counter left out of `kind` falls to `Other`: its name must then not
            // look like one of the kinds'.
            let by_name = kinds.iter().find(|k| name.starts_with(k.prefix()));
            assert_eq!(
                by_name.copied().unwrap_or(stat::Kind::Other),
                kind,
                "{name}"
            );
            assert_eq!(stat::index(name), Some(index));
            assert_eq!(format!("{}{}", kind.prefix(), stat::reason(index)), name);
        }
        assert_eq!(stat::kind(stat::DROP_NO_EGRESS), stat::Kind::Drop);
        assert_eq!(stat::reason(stat::DROP_NO_BACKEND), "no_backend");
        assert_eq!(stat::kind(stat::XDP_DROP), stat::Kind::Action);
        assert_eq!(stat::kind(stat::CAPTURED), stat::Kind::Other);
        assert_eq!(stat::index("drop_nothing"), None);
    }

    fn vip(addr: [u8; 16], port: u16, proto: u8, family: u8) -> VipKey {
        VipKey {
            addr,
            port: port.to_be(),
            proto,
            family,
        }
    }

    #[test]
    fn flow_hashes_spread_evenly_over_maglev_slots() {
        let size = 251;
        let mut hits = vec![0u32; size as usize];
        for port in 0..(size * 400) {
            let flow = FlowTuple {
                src: [0x0a00_0001, 0, 0, 0],
                dst: [0x0a00_0064, 0, 0, 0],
                src_port: port as u16,
                dst_port: 80,
                proto: PROTO_TCP,
                family: ADDR_FAMILY_V4,
            };
            hits[maglev_slot(flow_hash(&flow, false), size) as usize] += 1;
        }
        let (min, max) = (hits.iter().min().unwrap(), hits.iter().max().unwrap());
        // 400 flows per slot on average; a fair spread stays well within +-30%.
        assert!(*min >= 280 && *max <= 520, "min {min} max {max}");
        assert_eq!(maglev_slot(u32::MAX, size), size - 1);
        assert_eq!(maglev_slot(u32::MAX, 0), 0);
    }

    #[test]
    fn vip_keys_spread_over_slots() {
        let mut keys = Vec::new();
        for i in 0..200u16 {
            let mut v4 = [0; 16];
            v4[..4].copy_from_slice(&[10, 0, (i >> 8) as u8, i as u8]);
            let mut v6 = [0; 16];
            v6[0] = 0xfd;
            v6[14..].copy_from_slice(&i.to_be_bytes());
            keys.push(vip(v4, 80, PROTO_TCP, ADDR_FAMILY_V4));
            keys.push(vip(v6, 443, PROTO_TCP, ADDR_FAMILY_V6));
        }
        let slots: std::collections::HashSet<u32> = keys.iter().map(VipSlot::index).collect();
        assert!(slots.iter().all(|&s| s < VIP_SLOTS));
        // 400 keys over 4096 slots: about 20 collisions expected at random.
        assert!(slots.len() >= 360, "{} distinct slots", slots.len());
        // The same hosts on other ports and protocols mostly land on other slots than
        // the VIPs' (their packets are passed after one array read).
        let others = keys.iter().flat_map(|k| {
            [
                VipKey {
                    port: 22u16.to_be(),
                    ..*k
                },
                VipKey {
                    proto: PROTO_UDP,
                    ..*k
                },
            ]
        });
        let (mut total, mut hits) = (0, 0);
        for k in others {
            total += 1;
            hits += usize::from(slots.contains(&VipSlot::index(&k)));
        }
        assert!(hits * 100 <= total * 15, "{hits} of {total}");
        assert!(keys[0].same(&keys[0]) && !keys[0].same(&keys[1]));
    }
}
