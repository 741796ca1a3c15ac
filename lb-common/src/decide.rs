//! The kernel's decision order, written once: which backend a parsed packet goes to,
//! and what it does to the connection and embryonic tables on the way. The XDP program
//! runs `decide` on every packet over its maps; `lb explain` runs it over what the agent
//! reads of them; the differential test (`tests/tests/differential.rs`) runs it against
//! the program through BPF_PROG_TEST_RUN. So the three cannot disagree.
//!
//! `decide` reads and writes only through `Tables`, whose methods are called only where
//! the decision needs them: the kernel does no lookup it did not do before. Tables hand
//! out entries as handles (`Tables::Entry`): the kernel's are pointers into its maps,
//! written in place; `lb explain`'s are copies, so explaining writes nothing.

use core::ops::DerefMut;

use crate::{
    BACKEND_NONE, EMBRYO_F_SYN, Embryo, FlowEntry, FlowKey, FlowTuple, PROTO_UDP, VIP_F_STABLE,
    VipInfo, VipKey,
    flow::{self, Lookup},
    handshake,
    quic::{self, Header, ServerKey, Window},
    slot::{self, Slot},
    stat, table_place,
};

/// A parsed packet that may be for a VIP.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Packet {
    /// The addresses as they sit in the packet (IPv4: first 4 bytes, the rest zero).
    pub src_addr: [u8; 16],
    pub dst_addr: [u8; 16],
    /// `ADDR_FAMILY_V4` or `ADDR_FAMILY_V6`.
    pub family: u8,
    /// `PROTO_TCP` or `PROTO_UDP`.
    pub proto: u8,
    /// Network order, as in the packet.
    pub src_port_be: u16,
    pub dst_port_be: u16,
    /// A TCP SYN without ACK: a connection attempt.
    pub syn: bool,
    /// A TCP RST: never creates a connection-table entry.
    pub rst: bool,
    /// A TCP FIN: the client is closing.
    pub fin: bool,
    pub vlan: bool,
    pub ipv4_options: bool,
    /// An ICMP "fragmentation needed" / ICMPv6 "packet too big" about this flow: the
    /// addresses and ports are those of the flow it quotes, client to VIP.
    pub icmp_too_big: bool,
    /// Where a UDP packet's payload starts in the frame (the kernel reads a QUIC
    /// VIP's connection ID there: `Tables::quic_window`); 0 elsewhere.
    pub payload_at: u16,
}

impl Packet {
    /// A packet of the flow from `src_addr` to `dst_addr` (ports in network order), no
    /// flag set.
    #[inline(always)]
    pub fn of_flow(
        (src_addr, dst_addr): ([u8; 16], [u8; 16]),
        (family, proto): (u8, u8),
        (src_port_be, dst_port_be): (u16, u16),
    ) -> Self {
        Packet {
            src_addr,
            dst_addr,
            family,
            proto,
            src_port_be,
            dst_port_be,
            syn: false,
            rst: false,
            fin: false,
            vlan: false,
            ipv4_options: false,
            icmp_too_big: false,
            payload_at: 0,
        }
    }

    /// A TCP FIN or RST: the client is closing (or aborting) the connection.
    #[inline(always)]
    pub fn closing(&self) -> bool {
        self.fin || self.rst
    }

    /// The fields the flow hash takes, in host order. Built only when a packet is
    /// balanced by the table: an established flow's packets never need it.
    #[inline(always)]
    pub fn flow_tuple(&self) -> FlowTuple {
        let ports = (self.src_port_be, self.dst_port_be);
        let addresses = (&self.src_addr, &self.dst_addr);
        FlowTuple::of_map(addresses, ports, self.proto, self.family)
    }

    /// The packet's connection-table key.
    #[inline(always)]
    pub fn flow_key(&self) -> FlowKey {
        FlowKey {
            src: self.src_addr,
            dst: self.dst_addr,
            src_port: self.src_port_be,
            dst_port: self.dst_port_be,
            proto: self.proto,
            family: self.family,
            _pad: [0; 2],
        }
    }

    /// The key of the VIP the packet is sent to, if it is one.
    #[inline(always)]
    pub fn vip_key(&self) -> VipKey {
        VipKey {
            addr: self.dst_addr,
            port: self.dst_port_be,
            proto: self.proto,
            family: self.family,
        }
    }
}

/// What happens to a packet: the XDP action (`stat::XDP_*`, the kernel's codes) and the
/// counter that says why.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Verdict {
    pub action: u32,
    pub reason: u32,
}

impl Verdict {
    #[inline(always)]
    pub const fn pass(reason: u32) -> Self {
        Self {
            action: stat::XDP_PASS,
            reason,
        }
    }

    #[inline(always)]
    pub const fn drop(reason: u32) -> Self {
        Self {
            action: stat::XDP_DROP,
            reason,
        }
    }

    #[inline(always)]
    pub const fn tx(reason: u32) -> Self {
        Self {
            action: stat::XDP_TX,
            reason,
        }
    }
}

/// Where a VIP packet goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Choice {
    pub vip_id: u32,
    pub backend_id: u32,
    /// Counted as a new flow of the VIP and the backend: a SYN, or a UDP datagram with
    /// no live entry that is not its flow's second.
    pub new_flow: bool,
    /// The packet's TCP handshake events for the backend (`handshake::Events`), counted
    /// with the packet in the backend's counters.
    pub handshake: handshake::Events,
    /// What decided the backend (for `lb explain`; the kernel does not look).
    pub by: Source,
}

/// What decided a packet's backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// The flow's connection-table entry.
    Entry,
    /// The embryonic table: the backend the flow's first packet took.
    Embryo,
    /// The VIP's Maglev table.
    Table,
    /// A stable slot of the VIP's Maglev table (`slot`): no entry is read or made.
    StableSlot,
    /// A changed slot's previous backend (`slot`): the flow has no entry and is not new,
    /// so it began before the change moved its slot.
    PreviousBackend,
    /// The server ID in a QUIC short header's destination connection ID.
    ConnectionId,
}

/// What `decide` reads and writes: in the kernel, the program's maps, load-time globals
/// and per-CPU state; in userspace, what the agent writes into them (and, for the
/// differential test, what it reads back). Every method takes `&self`: the kernel's maps
/// are shared memory, and a userspace implementation keeps its writes in cells.
pub trait Tables: Lookup {
    /// A connection-table entry, read and written in place.
    type Entry: DerefMut<Target = FlowEntry>;
    /// An embryonic-table slot, read and written in place.
    type Embryo: DerefMut<Target = Embryo>;

    /// The VIP of `key` (`LB_VIP_SLOTS`, else `LB_VIPS`); None for traffic of no VIP.
    fn vip(&self, key: &VipKey) -> Option<VipInfo>;
    /// The clock entries are stamped with (the kernel's coarse monotonic clock).
    fn now_ns(&self) -> u64;
    /// `packet`'s connection-table key, built where the caller keeps it (the kernel: in
    /// per-CPU scratch memory, its stack being short); None: no room for it.
    fn flow_key(&self, packet: &Packet) -> Option<&FlowKey>;
    /// `LB_CONNTRACK[key]`.
    fn flow(&self, key: &FlowKey) -> Option<Self::Entry>;
    /// `LB_EMBRYONIC[index]`.
    fn embryo(&self, index: u32) -> Option<Self::Embryo>;
    /// `packet`'s flow hash input, built as `flow_key`.
    fn flow_tuple(&self, packet: &Packet) -> Option<&FlowTuple>;
    /// Whether `packet`'s source is a hot source of VIP `vip_id` (`LB_HOT_SRC`).
    fn is_hot_source(&self, vip_id: u32, packet: &Packet) -> bool;
    /// Slots of each VIP table (`GLOBAL_MAGLEV_SIZE`).
    fn maglev_size(&self) -> u32;
    /// The word in `slot` of `vip`'s live Maglev table (of `table_size` slots): a backend
    /// id (`BACKEND_NONE` for none), or for a VIP with `VIP_F_STABLE` a `slot::word`.
    fn maglev(&self, vip: &VipInfo, table_size: u32, slot: u32) -> u32;

    /// Adds one to outcome counter `stat` (`LB_STATS`).
    fn count(&self, stat: u32);
    /// The flood guard: whether one more insert fits in this second's limit
    /// (`GLOBAL_CT_INSERT_LIMIT`).
    fn insert_allowed(&self, now: u64) -> bool;
    /// Writes a new entry for `key` through the map (replacing any); whether it was
    /// written.
    fn insert_flow(&self, key: &FlowKey, entry: &FlowEntry) -> bool;
    /// A new entry was written: the cluster's peers learn it (`LB_EXPORT`).
    fn export_flow(&self, key: &FlowKey, entry: &FlowEntry);
    /// A new flow from `packet`'s source to VIP `vip_id`, for the heavy hitters
    /// (`LB_SOURCES`, sampled).
    fn new_source(&self, vip_id: u32, packet: &Packet);
    /// A TCP packet that missed the connection table without a SYN: the debug capture
    /// may copy the frame.
    fn capture(&self, now: u64);
    /// Adds one to backend `backend_id`'s handshake counter `event` (`handshake::*`,
    /// `LB_BE_STATS`): only for a backend other than the packet's (`handshake::syn`); the
    /// packet's own backend's events go in `Choice::handshake`.
    fn count_handshake(&self, _backend_id: u32, _event: u32) {}

    /// The first `quic::WINDOW_LEN` bytes of `packet`'s UDP payload; None when it is
    /// shorter. Asked only for a VIP with `quic::VIP_F_QUIC`.
    fn quic_window(&self, packet: &Packet) -> Option<Window>;
    /// `LB_QUIC_IDS[key]`: the backend a server ID names.
    fn quic_server(&self, key: &ServerKey) -> Option<u32>;
    /// Adds one to VIP `vip_id`'s QUIC counter: `stat::QUIC_ROUTED_BY_CID` or
    /// `stat::QUIC_CID_UNKNOWN` (`LB_QUIC_STATS`).
    fn count_quic(&self, vip_id: u32, stat: u32);
}

/// `packet`'s backend, or why it is not forwarded, with what that does to the tables.
///
/// A packet that is not a SYN follows its connection-table entry while the entry's
/// backend still serves flows (and, for UDP, while the entry is not idle-expired, for
/// TCP while no SYN reused its tuple).
/// State is made only for flows seen twice: a flow's first packet (always a SYN) takes
/// the VIP's Maglev table and is remembered in the embryonic table; its second packet
/// goes where the first went and enters the flow into the connection table (a RST
/// never creates an entry). An entry whose backend no longer serves it is re-written to
/// the table's choice.
///
/// A VIP with `VIP_F_STABLE` reads its slot first for a TCP packet that is not a SYN: a
/// stable slot sends it where the table says, with no entry read or made; a changed
/// slot's flows take the path above, except that one with no entry that is not new goes
/// to the slot's previous backend (`slot`).
#[inline(always)]
pub fn decide<T: Tables>(tables: &T, packet: &Packet) -> Result<Choice, Verdict> {
    // Most traffic of a host is not for a VIP: one array read and a key compare send it
    // on, before any hash-map lookup.
    let Some(vip) = tables.vip(&packet.vip_key()) else {
        return Err(Verdict::pass(stat::PASS_NOT_VIP));
    };
    let Some(key) = tables.flow_key(packet) else {
        return Err(Verdict::pass(stat::PASS_NOT_VIP));
    };
    let udp = packet.proto == PROTO_UDP;
    // Before the clock: a packet in a stable slot needs neither it nor an entry.
    let slot = if vip.flags & VIP_F_STABLE != 0 && !packet.syn && !udp {
        let slot = table_slot(tables, packet, &vip);
        if slot.previous.is_none() {
            return stable(tables, packet, &vip, key, slot.backend_id);
        }
        Some(slot)
    } else {
        None
    };
    // Coarse time: entries age in seconds.
    let now = tables.now_ns();
    // A QUIC short header goes where its connection ID says, whatever its 5-tuple.
    if udp
        && !packet.icmp_too_big
        && vip.flags & quic::VIP_F_QUIC != 0
        && let Some(choice) = by_connection_id(tables, packet, &vip, key, now)
    {
        return Ok(choice);
    }
    // A SYN reads no entry (the lookup would be most of what a spoofed SYN costs): it
    // takes the table, and an entry an earlier connection left on its tuple gives way
    // at the new connection's next packet (`flow::follow`'s `CT_REUSED`).
    let mut entry = if packet.syn { None } else { tables.flow(key) };
    if packet.icmp_too_big {
        return too_big(tables, packet, &vip, (key, slot), entry, now);
    }
    let mut miss = if packet.syn {
        stat::CT_MISS_SYN
    } else if udp {
        stat::CT_MISS_UDP
    } else {
        stat::CT_MISS_NON_SYN
    };
    if let Some(entry) = entry.as_mut() {
        // Asked only of an entry idle past a second or closing.
        let syn_since = || {
            let (index, tag) = flow::embryo_place(key);
            tables
                .embryo(index)
                .is_some_and(|embryo| flow::syn_since(&embryo, tag))
        };
        let (proto, closing) = (packet.proto, packet.closing());
        match flow::follow(tables, entry, proto, closing, vip.vip_id, now, syn_since) {
            Ok(backend_id) => {
                tables.count(stat::CT_HIT);
                return Ok(choice(&vip, backend_id, false, Source::Entry));
            }
            Err(reason) => miss = reason,
        }
    }
    let (embryo_index, tag) = flow::embryo_place(key);
    let mut embryo = tables.embryo(embryo_index);
    // The second packet of a flow the connection table does not hold, whose first
    // packet the embryonic table remembers (a handshake's ACK, a UDP flow's second
    // datagram): the flow is real, and enters the connection table with the backend its
    // first packet took. A flood of random tuples never gets here.
    if !packet.syn
        && entry.is_none()
        && let Some(choice) = promote(tables, packet, &vip, key, (embryo.as_deref_mut(), tag), now)
    {
        return Ok(choice);
    }
    let new_flow = miss == stat::CT_MISS_SYN || miss == stat::CT_MISS_UDP;
    // A flow that began before its slot changed is no miss.
    let previous = previous_backend(tables, &vip, slot, entry.is_none());
    if previous.is_some() {
        miss = stat::CT_PREVIOUS;
    }
    tables.count(miss);
    if miss == stat::CT_MISS_NON_SYN {
        tables.capture(now);
    }

    // An entry that gives way (reused, or its backend gone) to a connection whose SYN
    // came since: that connection goes where its SYN went.
    let syn_since = entry.is_some() && embryo.as_deref().is_some_and(|e| flow::syn_since(e, tag));
    let reused_to = match embryo.as_deref() {
        Some(embryo) if syn_since => flow::remembered(tables, embryo, tag, vip.vip_id),
        _ => None,
    };
    let (backend_id, by) = match reused_to {
        Some(backend_id) => (backend_id, Source::Embryo),
        None => match previous {
            Some(backend_id) => (backend_id, Source::PreviousBackend),
            None => (table_choice(tables, packet, &vip, slot)?, Source::Table),
        },
    };
    let handshake = match entry {
        None => remember(
            tables,
            packet,
            (&vip, tag),
            backend_id,
            embryo.as_deref_mut(),
        ),
        Some(entry) => {
            rewrite(tables, packet, key, entry, backend_id, now);
            // The entry is newer than the SYN now.
            if syn_since && let Some(embryo) = embryo.as_deref_mut() {
                embryo.flags = 0;
            }
            0
        }
    };
    // A UDP flow counts for its source at its first datagram (many send only one); a TCP
    // flow at its handshake's ACK (`promote`).
    if udp && new_flow {
        tables.new_source(vip.vip_id, packet);
    }
    Ok(Choice {
        handshake,
        ..choice(&vip, backend_id, new_flow, by)
    })
}

#[inline(always)]
fn choice(vip: &VipInfo, backend_id: u32, new_flow: bool, by: Source) -> Choice {
    Choice {
        vip_id: vip.vip_id,
        backend_id,
        new_flow,
        handshake: 0,
        by,
    }
}

/// A QUIC short-header packet whose destination connection ID names a backend of the
/// VIP that serves flows (up, or draining: drain keeps the connections it has): that
/// backend, and the flow's entry for this 5-tuple refreshed or re-written to it, so the
/// client's new address or port follows the connection. None (balanced as any UDP
/// datagram) for a long header, a payload that is no QUIC lb can read, and a server ID
/// that names no serving backend (counted: `QUIC_CID_UNKNOWN`).
#[inline(always)]
fn by_connection_id<T: Tables>(
    tables: &T,
    packet: &Packet,
    vip: &VipInfo,
    key: &FlowKey,
    now: u64,
) -> Option<Choice> {
    let window = tables.quic_window(packet)?;
    let Header::Short(server) = quic::classify(&window, vip.vip_id, quic::id_len(vip.flags)) else {
        return None;
    };
    let serving = tables.quic_server(&server).filter(|id| {
        tables
            .backend(*id)
            .is_some_and(|b| flow::serves(b, vip.vip_id))
    });
    let Some(backend_id) = serving else {
        tables.count(stat::QUIC_CID_UNKNOWN);
        tables.count_quic(vip.vip_id, stat::QUIC_CID_UNKNOWN);
        return None;
    };
    tables.count(stat::QUIC_ROUTED_BY_CID);
    tables.count_quic(vip.vip_id, stat::QUIC_ROUTED_BY_CID);
    match tables.flow(key) {
        // The entry's time, at most once per granularity: entries are shared by CPUs.
        Some(mut entry) if entry.backend_id == backend_id => {
            if flow::age(&entry, now) > crate::LAST_SEEN_GRANULARITY_NS {
                *entry = flow::entry_for(backend_id, false, now);
            }
        }
        // A new 5-tuple of the connection (or one the table lost): its entry, so the
        // rest of its packets (and a peer of the cluster) need not read the ID.
        _ => {
            let fresh = flow::entry_for(backend_id, false, now);
            if may_insert(tables, now) && tables.insert_flow(key, &fresh) {
                tables.count(stat::CT_CREATED);
                tables.export_flow(key, &fresh);
            }
        }
    }
    Some(choice(vip, backend_id, false, Source::ConnectionId))
}

/// An ICMP "too big" error about a flow: to where the flow's packets go, without
/// touching its entry (an error is not a packet of the flow). TCP: the entry's backend,
/// else the table's; the backend's kernel checks the quoted sequence number, so a forged
/// error cannot touch a connection. UDP: only a live entry's, or the backend the
/// embryonic table remembers for the flow's first datagram (a flow of one request has
/// no entry); nothing checks a UDP error, so it must at least name a flow seen.
#[inline(always)]
fn too_big<T: Tables>(
    tables: &T,
    packet: &Packet,
    vip: &VipInfo,
    (key, slot): (&FlowKey, Option<Slot>),
    entry: Option<T::Entry>,
    now: u64,
) -> Result<Choice, Verdict> {
    let no_entry = entry.is_none();
    let held = match entry {
        Some(entry) => flow::held(tables, &entry, packet.proto, vip.vip_id, now)
            .map(|backend_id| (backend_id, Source::Entry)),
        None => {
            let (index, tag) = flow::embryo_place(key);
            tables
                .embryo(index)
                .and_then(|embryo| flow::remembered(tables, &embryo, tag, vip.vip_id))
                .map(|backend_id| (backend_id, Source::Embryo))
        }
    };
    let previous = || previous_backend(tables, vip, slot, no_entry);
    let (backend_id, by) = match held {
        Some(held) => held,
        None if packet.proto == PROTO_UDP => return Err(Verdict::pass(stat::PASS_OTHER_PROTO)),
        None => match previous() {
            Some(backend_id) => (backend_id, Source::PreviousBackend),
            None => (table_choice(tables, packet, vip, slot)?, Source::Table),
        },
    };
    tables.count(stat::SEEN_ICMP_TOO_BIG);
    Ok(choice(vip, backend_id, false, by))
}

/// A flow's second packet, whose first packet `embryo` remembers: where it goes, and
/// the flow entered into the connection table; None when the embryonic table does not
/// remember the flow (or its backend serves it no more).
#[inline(always)]
fn promote<T: Tables>(
    tables: &T,
    packet: &Packet,
    vip: &VipInfo,
    key: &FlowKey,
    (embryo, tag): (Option<&mut Embryo>, u32),
    now: u64,
) -> Option<Choice> {
    let embryo = embryo?;
    let backend_id = flow::remembered(tables, embryo, tag, vip.vip_id)?;
    tables.count(stat::CT_PROMOTED);
    let handshake = handshake::ack(packet.rst, embryo);
    if packet.proto != PROTO_UDP {
        tables.new_source(vip.vip_id, packet);
    }
    // A RST ends the flow: it goes where the SYN went, and makes no entry.
    if !packet.rst && may_insert(tables, now) {
        let fresh = flow::entry_for(backend_id, packet.closing(), now);
        if tables.insert_flow(key, &fresh) {
            tables.count(stat::CT_CREATED);
            // A new entry: the cluster's peers learn it from here.
            tables.export_flow(key, &fresh);
        }
        // The entry is newer than the SYN now.
        embryo.flags = 0;
    }
    Some(Choice {
        handshake,
        ..choice(vip, backend_id, false, Source::Embryo)
    })
}

/// A first packet (a SYN, a new UDP flow, an ACK of a flow the connection table lost)
/// is remembered for the flow's second packet, and makes no entry: a flood of spoofed
/// first packets costs no established flow its entry. A RST ends a flow: it is never
/// remembered. A SYN's handshake events for `backend_id` (`handshake::syn`).
#[inline(always)]
fn remember<T: Tables>(
    tables: &T,
    packet: &Packet,
    (vip, tag): (&VipInfo, u32),
    backend_id: u32,
    embryo: Option<&mut Embryo>,
) -> handshake::Events {
    let mut events = 0;
    if !packet.rst
        && let Some(embryo) = embryo
    {
        let fresh = flow::embryo_for(tag, backend_id, packet.syn);
        *embryo = if packet.syn {
            let (remembered, syn_events) = handshake::syn(tables, vip, embryo, fresh);
            events = syn_events;
            remembered
        } else {
            fresh
        };
        tables.count(stat::CT_EMBRYONIC);
    }
    events
}

/// A flow the table holds, whose backend no longer serves it, an idle UDP flow, or a
/// reused tuple's new connection: a real flow, re-written to its backend, in place when
/// the backend is the entry's, else through the map (a pointer into the LRU may
/// meanwhile name a node recycled for another flow).
#[inline(always)]
fn rewrite<T: Tables>(
    tables: &T,
    packet: &Packet,
    key: &FlowKey,
    mut entry: T::Entry,
    backend_id: u32,
    now: u64,
) {
    let fresh = flow::entry_for(backend_id, packet.closing(), now);
    if entry.backend_id == backend_id {
        *entry = fresh;
        tables.count(stat::CT_CREATED);
    } else if may_insert(tables, now) && tables.insert_flow(key, &fresh) {
        tables.count(stat::CT_CREATED);
        // Another backend for the flow: the peers learn that too.
        tables.export_flow(key, &fresh);
    }
}

/// The flood guard: at most `GLOBAL_CT_INSERT_LIMIT` inserts per second per CPU, so
/// even a flood of complete handshakes (or of each spoofed tuple sent twice) turns the
/// LRU over slowly.
#[inline(always)]
fn may_insert<T: Tables>(tables: &T, now: u64) -> bool {
    if tables.insert_allowed(now) {
        return true;
    }
    tables.count(stat::CT_INSERT_SKIPPED);
    false
}

/// A TCP packet (not a SYN) in a stable slot (`slot`): to the slot's backend, with no
/// entry read or made. A handshake's first ACK, which the embryonic table remembers, is
/// still counted once as the flow's promotion (its handshake events, its source for the
/// heavy hitters), as `promote` counts it where it makes an entry. A flow the embryonic
/// table remembers on another backend goes there: its first packet came while the slot
/// was changed, and the agent turned the slot stable before its second (the agent sees
/// entries, not embryonic records). An ICMP "too big" about the flow goes where its
/// packets go.
#[inline(always)]
fn stable<T: Tables>(
    tables: &T,
    packet: &Packet,
    vip: &VipInfo,
    key: &FlowKey,
    backend_id: u32,
) -> Result<Choice, Verdict> {
    let (index, tag) = flow::embryo_place(key);
    let mut embryo = tables.embryo(index);
    // Only a record naming another backend is asked whether that one serves: the usual
    // packet reads no backend.
    let elsewhere = embryo
        .as_deref()
        .filter(|embryo| embryo.backend_id as u32 != backend_id)
        .and_then(|embryo| flow::remembered(tables, embryo, tag, vip.vip_id));
    let (backend_id, by) = match elsewhere {
        Some(remembered) => (remembered, Source::Embryo),
        None if backend_id == BACKEND_NONE => return Err(Verdict::drop(stat::DROP_NO_BACKEND)),
        None => (backend_id, Source::StableSlot),
    };
    if packet.icmp_too_big {
        tables.count(stat::SEEN_ICMP_TOO_BIG);
        return Ok(choice(vip, backend_id, false, by));
    }
    tables.count(stat::CT_STABLE);
    let mut handshake = 0;
    if let Some(embryo) = embryo.as_deref_mut()
        && embryo.tag == tag
        && embryo.flags & EMBRYO_F_SYN != 0
    {
        tables.count(stat::CT_PROMOTED);
        handshake = handshake::ack(packet.rst, embryo);
        tables.new_source(vip.vip_id, packet);
        // Counted: the flow's later packets do not count it again.
        embryo.flags = 0;
    }
    Ok(Choice {
        handshake,
        ..choice(vip, backend_id, false, by)
    })
}

/// A changed slot's previous backend (`slot`), for a flow with no entry (`no_entry`)
/// that is not new: it began before the change moved its slot, so it stays where the
/// slot sent it then, while that backend serves the VIP.
#[inline(always)]
fn previous_backend<T: Tables>(
    tables: &T,
    vip: &VipInfo,
    slot: Option<Slot>,
    no_entry: bool,
) -> Option<u32> {
    let previous = slot?.previous.filter(|_| no_entry)?;
    flow::backend_serving(tables, previous, vip.vip_id)
}

/// The backend the VIP's Maglev table gives the packet's flow (`slot`, when the caller
/// read it already). A hot source of a src-ip VIP with hot sources is hashed per
/// connection (`table_hash`).
#[inline(always)]
fn table_choice<T: Tables>(
    tables: &T,
    packet: &Packet,
    vip: &VipInfo,
    slot: Option<Slot>,
) -> Result<u32, Verdict> {
    let slot = match slot {
        Some(slot) => slot,
        None => table_slot(tables, packet, vip),
    };
    match slot.backend_id {
        BACKEND_NONE => Err(Verdict::drop(stat::DROP_NO_BACKEND)),
        id => Ok(id),
    }
}

/// The packet's slot of the VIP's Maglev table (`BACKEND_NONE` for none).
#[inline(always)]
fn table_slot<T: Tables>(tables: &T, packet: &Packet, vip: &VipInfo) -> Slot {
    let table_size = tables.maglev_size();
    let Some(tuple) = tables.flow_tuple(packet) else {
        return Slot::stable(BACKEND_NONE);
    };
    let (_, place, spread) = table_place(tuple, vip.flags, table_size, || {
        tables.is_hot_source(vip.vip_id, packet)
    });
    if spread {
        tables.count(stat::HOT_SOURCE_SPREAD);
    }
    let word = tables.maglev(vip, table_size, place);
    slot::read(word, vip.flags)
}

/// `Tables` in memory, for userspace: `lb explain` fills one with what the agent writes
/// into the maps and what it reads of the connection and embryonic tables; the
/// differential test with what it reads back from the program's maps before a packet.
/// Its writes stay here, to be read back (`flow`, `embryo`, `counts`).
#[cfg(any(feature = "std", test))]
pub mod memory {
    use std::{
        cell::{Cell, RefCell},
        collections::{HashMap, HashSet},
        ops::{Deref, DerefMut},
    };

    use super::{Choice, Packet, Tables, Verdict, decide};
    use crate::{
        BACKEND_NONE, BackendInfo, Embryo, FlowEntry, FlowKey, FlowTuple, SourceKey, VipInfo,
        VipKey,
        flow::Lookup,
        quic::{QuicCounters, ServerKey, Window},
        stat,
    };

    /// The maps `decide` reads and writes, in memory.
    #[derive(Debug, Default)]
    pub struct MemoryTables {
        pub vips: HashMap<VipKey, VipInfo>,
        /// `LB_BACKENDS`, by backend id.
        pub backends: HashMap<u32, BackendInfo>,
        /// Each VIP's live Maglev table, by VIP id.
        pub maglev: HashMap<u32, Vec<u32>>,
        pub maglev_size: u32,
        /// `LB_HOT_SRC`.
        pub hot_sources: HashSet<SourceKey>,
        pub udp_idle_ns: u64,
        pub now_ns: u64,
        /// The flood guard refuses every insert (`CT_INSERT_LIMIT` reached).
        pub inserts_refused: bool,
        /// `LB_QUIC_IDS`: QUIC VIPs' server IDs -> backend id.
        pub quic_ids: HashMap<ServerKey, u32>,
        quic_counts: RefCell<HashMap<u32, QuicCounters>>,
        /// `LB_CONNTRACK`: each element with the generation that made it, so that a
        /// handle to an element replaced since (as an LRU map replaces it on insert)
        /// writes nowhere, as in the kernel.
        flows: RefCell<HashMap<FlowKey, (u64, FlowEntry)>>,
        generation: Cell<u64>,
        /// `LB_EMBRYONIC` (a missing slot is all zeroes).
        embryos: RefCell<HashMap<u32, Embryo>>,
        counts: RefCell<Vec<u64>>,
        sources: RefCell<HashMap<SourceKey, u64>>,
        exported: RefCell<Vec<(FlowKey, FlowEntry)>>,
        captures: Cell<u64>,
        /// Backends' handshake counters (`TrafficCounters::handshakes`), by backend id.
        handshakes: RefCell<HashMap<u32, [u64; crate::handshake::COUNT]>>,
    }

    impl MemoryTables {
        /// `decide` for `packet` over these tables.
        pub fn decide(&self, packet: &Packet) -> Result<Choice, Verdict> {
            self.decide_payload(packet, &[])
        }

        /// `decide` for `packet` whose UDP payload is `payload` (a QUIC VIP reads it).
        pub fn decide_payload(&self, packet: &Packet, payload: &[u8]) -> Result<Choice, Verdict> {
            let run = Run {
                tables: self,
                key: packet.flow_key(),
                tuple: packet.flow_tuple(),
                window: Window::of(payload),
            };
            let choice = decide(&run, packet)?;
            // As the kernel's `forward` adds them, with the packet.
            if choice.handshake != 0 {
                let mut handshakes = self.handshakes.borrow_mut();
                let counters = handshakes.entry(choice.backend_id).or_default();
                crate::handshake::add(counters, choice.handshake);
            }
            Ok(choice)
        }

        /// VIP `vip_id`'s QUIC counters.
        pub fn quic_counts(&self, vip_id: u32) -> QuicCounters {
            let counts = self.quic_counts.borrow();
            counts.get(&vip_id).copied().unwrap_or_default()
        }

        pub fn flow(&self, key: &FlowKey) -> Option<FlowEntry> {
            self.flows.borrow().get(key).map(|(_, entry)| *entry)
        }

        /// Writes (or, None, removes) the entry of `key`.
        pub fn set_flow(&self, key: &FlowKey, entry: Option<FlowEntry>) {
            match entry {
                Some(entry) => self.insert(key, &entry),
                None => {
                    self.flows.borrow_mut().remove(key);
                }
            }
        }

        pub fn embryo(&self, index: u32) -> Embryo {
            self.embryos
                .borrow()
                .get(&index)
                .copied()
                .unwrap_or_default()
        }

        pub fn set_embryo(&self, index: u32, embryo: Embryo) {
            self.embryos.borrow_mut().insert(index, embryo);
        }

        /// The outcome counters, indexed by `stat` (`stat::COUNT` of them).
        pub fn counts(&self) -> Vec<u64> {
            let mut counts = self.counts.borrow().clone();
            counts.resize(stat::COUNT as usize, 0);
            counts
        }

        /// New flows counted per source (unsampled).
        pub fn sources(&self) -> HashMap<SourceKey, u64> {
            self.sources.borrow().clone()
        }

        /// Entries written through the map, in order.
        pub fn exported(&self) -> Vec<(FlowKey, FlowEntry)> {
            self.exported.borrow().clone()
        }

        /// Frames the debug capture would have been asked to copy.
        pub fn captures(&self) -> u64 {
            self.captures.get()
        }

        /// Backend `id`'s handshake counters, indexed by `handshake::STARTED` ...
        pub fn handshakes(&self, id: u32) -> [u64; crate::handshake::COUNT] {
            self.handshakes
                .borrow()
                .get(&id)
                .copied()
                .unwrap_or_default()
        }

        /// Forgets every count, export and capture (the tables stay).
        pub fn reset_counts(&self) {
            self.counts.borrow_mut().clear();
            self.sources.borrow_mut().clear();
            self.exported.borrow_mut().clear();
            self.quic_counts.borrow_mut().clear();
            self.captures.set(0);
            self.handshakes.borrow_mut().clear();
        }

        fn insert(&self, key: &FlowKey, entry: &FlowEntry) {
            let generation = self.generation.get() + 1;
            self.generation.set(generation);
            self.flows.borrow_mut().insert(*key, (generation, *entry));
        }
    }

    /// One packet's run over `MemoryTables`: its key and tuple live here.
    struct Run<'a> {
        tables: &'a MemoryTables,
        key: FlowKey,
        tuple: FlowTuple,
        window: Option<Window>,
    }

    /// A connection-table element, written back when dropped if it changed and the map
    /// still holds it.
    pub struct FlowSlot<'a> {
        flows: &'a RefCell<HashMap<FlowKey, (u64, FlowEntry)>>,
        key: FlowKey,
        generation: u64,
        read: FlowEntry,
        entry: FlowEntry,
    }

    impl Deref for FlowSlot<'_> {
        type Target = FlowEntry;
        fn deref(&self) -> &FlowEntry {
            &self.entry
        }
    }

    impl DerefMut for FlowSlot<'_> {
        fn deref_mut(&mut self) -> &mut FlowEntry {
            &mut self.entry
        }
    }

    impl Drop for FlowSlot<'_> {
        fn drop(&mut self) {
            if self.entry == self.read {
                return;
            }
            if let Some(element) = self.flows.borrow_mut().get_mut(&self.key)
                && element.0 == self.generation
            {
                element.1 = self.entry;
            }
        }
    }

    /// An embryonic-table slot, written back when dropped if it changed.
    pub struct EmbryoSlot<'a> {
        embryos: &'a RefCell<HashMap<u32, Embryo>>,
        index: u32,
        read: Embryo,
        embryo: Embryo,
    }

    impl Deref for EmbryoSlot<'_> {
        type Target = Embryo;
        fn deref(&self) -> &Embryo {
            &self.embryo
        }
    }

    impl DerefMut for EmbryoSlot<'_> {
        fn deref_mut(&mut self) -> &mut Embryo {
            &mut self.embryo
        }
    }

    impl Drop for EmbryoSlot<'_> {
        fn drop(&mut self) {
            if self.embryo != self.read {
                self.embryos.borrow_mut().insert(self.index, self.embryo);
            }
        }
    }

    impl Lookup for Run<'_> {
        fn backend(&self, id: u32) -> Option<&BackendInfo> {
            self.tables.backends.get(&id)
        }

        fn udp_idle_ns(&self) -> u64 {
            self.tables.udp_idle_ns
        }
    }

    impl<'a> Tables for Run<'a> {
        type Entry = FlowSlot<'a>;
        type Embryo = EmbryoSlot<'a>;

        fn vip(&self, key: &VipKey) -> Option<VipInfo> {
            self.tables.vips.get(key).copied()
        }

        fn now_ns(&self) -> u64 {
            self.tables.now_ns
        }

        fn flow_key(&self, _: &Packet) -> Option<&FlowKey> {
            Some(&self.key)
        }

        fn flow(&self, key: &FlowKey) -> Option<FlowSlot<'a>> {
            let (generation, entry) = *self.tables.flows.borrow().get(key)?;
            Some(FlowSlot {
                flows: &self.tables.flows,
                key: *key,
                generation,
                read: entry,
                entry,
            })
        }

        fn embryo(&self, index: u32) -> Option<EmbryoSlot<'a>> {
            let embryo = self.tables.embryo(index);
            Some(EmbryoSlot {
                embryos: &self.tables.embryos,
                index,
                read: embryo,
                embryo,
            })
        }

        fn flow_tuple(&self, _: &Packet) -> Option<&FlowTuple> {
            Some(&self.tuple)
        }

        fn is_hot_source(&self, vip_id: u32, packet: &Packet) -> bool {
            let key = SourceKey::new(vip_id, packet.src_addr, packet.family);
            self.tables.hot_sources.contains(&key)
        }

        fn maglev_size(&self) -> u32 {
            self.tables.maglev_size
        }

        fn maglev(&self, vip: &VipInfo, _: u32, slot: u32) -> u32 {
            self.tables
                .maglev
                .get(&vip.vip_id)
                .and_then(|table| table.get(slot as usize))
                .copied()
                .unwrap_or(BACKEND_NONE)
        }

        fn count(&self, stat: u32) {
            let mut counts = self.tables.counts.borrow_mut();
            counts.resize(stat::COUNT as usize, 0);
            counts[stat as usize] += 1;
        }

        fn insert_allowed(&self, _: u64) -> bool {
            !self.tables.inserts_refused
        }

        fn insert_flow(&self, key: &FlowKey, entry: &FlowEntry) -> bool {
            self.tables.insert(key, entry);
            true
        }

        fn export_flow(&self, key: &FlowKey, entry: &FlowEntry) {
            self.tables.exported.borrow_mut().push((*key, *entry));
        }

        fn new_source(&self, vip_id: u32, packet: &Packet) {
            let key = SourceKey::new(vip_id, packet.src_addr, packet.family);
            *self.tables.sources.borrow_mut().entry(key).or_default() += 1;
        }

        fn capture(&self, _: u64) {
            self.tables.captures.set(self.tables.captures.get() + 1);
        }

        fn count_handshake(&self, backend_id: u32, event: u32) {
            let mut handshakes = self.tables.handshakes.borrow_mut();
            handshakes.entry(backend_id).or_default()[event as usize] += 1;
        }

        fn quic_window(&self, _: &Packet) -> Option<Window> {
            self.window
        }

        fn quic_server(&self, key: &ServerKey) -> Option<u32> {
            self.tables.quic_ids.get(key).copied()
        }

        fn count_quic(&self, vip_id: u32, which: u32) {
            let mut counts = self.tables.quic_counts.borrow_mut();
            let counts = counts.entry(vip_id).or_default();
            match which {
                stat::QUIC_ROUTED_BY_CID => counts.routed_by_cid += 1,
                _ => counts.cid_unknown += 1,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{memory::MemoryTables, *};
    use crate::{
        ADDR_FAMILY_V4, BACKEND_F_SERVES_FLOWS, BackendInfo, EMBRYO_F_SYN, PROTO_TCP, SourceKey,
        VIP_F_HASH_SRC_IP, VIP_F_HOT_SOURCES,
    };

    const VIP: u32 = 1;
    const SECOND: u64 = 1_000_000_000;
    const NOW: u64 = 1_000 * SECOND;

    fn v4(last: u8) -> [u8; 16] {
        let mut addr = [0; 16];
        addr[..4].copy_from_slice(&[10, 0, 0, last]);
        addr
    }

    /// VIP 10.0.0.100:80/tcp (id 1), its table all backend `table`; backends 0 and 1
    /// serve it, 2 is its own but failed.
    fn tables(table: u32) -> MemoryTables {
        let mut tables = MemoryTables::default();
        tables.maglev_size = 7;
        tables.udp_idle_ns = 30 * SECOND;
        tables.now_ns = NOW;
        let info = VipInfo {
            vip_id: VIP,
            generation: 0,
            flags: 0,
            _pad: 0,
        };
        tables.vips.insert(packet(0).vip_key(), info);
        for (id, flags) in [
            (0, BACKEND_F_SERVES_FLOWS),
            (1, BACKEND_F_SERVES_FLOWS),
            (2, 0),
        ] {
            let backend = BackendInfo::l2([2, 0, 0, 0, 0, id as u8], flags, VIP);
            tables.backends.insert(id, backend);
        }
        tables.maglev.insert(VIP, vec![table; 7]);
        tables
    }

    /// A TCP packet from 10.0.0.1:40000 to the VIP with `flags` (SYN 2, RST 4, FIN 1).
    fn packet(flags: u8) -> Packet {
        Packet {
            syn: flags & 2 != 0,
            rst: flags & 4 != 0,
            fin: flags & 1 != 0,
            ..Packet::of_flow(
                (v4(1), v4(100)),
                (ADDR_FAMILY_V4, PROTO_TCP),
                (40000u16.to_be(), 80u16.to_be()),
            )
        }
    }

    const SYN: u8 = 2;
    const ACK: u8 = 0;
    const RST: u8 = 4;

    /// The counters that moved, by name.
    fn counted(tables: &MemoryTables) -> Vec<&'static str> {
        let counts = tables.counts();
        let names = stat::NAMES.iter().zip(&counts);
        let moved = names
            .filter(|(_, n)| **n > 0)
            .map(|(name, _)| *name)
            .collect();
        tables.reset_counts();
        moved
    }

    fn embryo_of(tables: &MemoryTables, packet: &Packet) -> Embryo {
        tables.embryo(flow::embryo_place(&packet.flow_key()).0)
    }

    #[test]
    fn a_handshake_is_remembered_then_entered_where_its_syn_went() {
        let mut tables = tables(0);
        let syn = tables.decide(&packet(SYN)).unwrap();
        assert_eq!(
            (syn.backend_id, syn.new_flow, syn.by),
            (0, true, Source::Table)
        );
        assert_eq!(counted(&tables), ["ct_miss_syn", "ct_embryonic"]);
        assert_eq!(embryo_of(&tables, &packet(SYN)).flags, EMBRYO_F_SYN);
        assert_eq!(
            tables.flow(&packet(SYN).flow_key()),
            None,
            "a SYN makes no entry"
        );

        // The table changed between the SYN and its ACK: the ACK follows the SYN.
        tables.maglev.insert(VIP, vec![1; 7]);
        let ack = tables.decide(&packet(ACK)).unwrap();
        assert_eq!(
            (ack.backend_id, ack.new_flow, ack.by),
            (0, false, Source::Embryo)
        );
        assert_eq!(tables.exported().len(), 1);
        let source = SourceKey::new(VIP, v4(1), ADDR_FAMILY_V4);
        assert_eq!(
            tables.sources().get(&source),
            Some(&1),
            "counted at the ACK"
        );
        assert_eq!(counted(&tables), ["ct_created", "ct_promoted"]);
        let entry = tables.flow(&packet(ACK).flow_key()).unwrap();
        assert_eq!((entry.backend_id, entry.last_seen_ns), (0, NOW));
        assert_eq!(embryo_of(&tables, &packet(ACK)).flags, 0);

        let next = tables.decide(&packet(ACK)).unwrap();
        assert_eq!((next.backend_id, next.by), (0, Source::Entry));
        assert_eq!(counted(&tables), ["ct_hit"]);
    }

    #[test]
    fn a_rst_goes_where_the_syn_went_and_makes_no_entry() {
        let tables = tables(1);
        tables.decide(&packet(SYN)).unwrap();
        let rst = tables.decide(&packet(RST)).unwrap();
        assert_eq!(rst.backend_id, 1);
        assert_eq!(tables.flow(&packet(RST).flow_key()), None);
        assert_eq!(embryo_of(&tables, &packet(RST)).flags, EMBRYO_F_SYN);
    }

    #[test]
    fn traffic_of_no_vip_passes_and_a_vip_without_backends_drops() {
        let tables = tables(BACKEND_NONE);
        let other = Packet {
            dst_port_be: 81u16.to_be(),
            ..packet(SYN)
        };
        assert_eq!(
            tables.decide(&other),
            Err(Verdict::pass(stat::PASS_NOT_VIP))
        );
        assert_eq!(
            tables.decide(&packet(SYN)),
            Err(Verdict::drop(stat::DROP_NO_BACKEND))
        );
        assert_eq!(counted(&tables), ["ct_miss_syn"]);
    }

    #[test]
    fn an_entry_whose_backend_failed_is_rewritten_to_the_table() {
        let tables = tables(1);
        let key = packet(ACK).flow_key();
        tables.set_flow(&key, Some(flow::entry_for(2, false, NOW - SECOND)));
        let ack = tables.decide(&packet(ACK)).unwrap();
        assert_eq!((ack.backend_id, ack.by), (1, Source::Table));
        assert_eq!(counted(&tables), ["ct_rehash", "ct_created"]);
        assert_eq!(tables.flow(&key), Some(flow::entry_for(1, false, NOW)));
    }

    #[test]
    fn a_reused_tuple_goes_where_its_new_syn_went() {
        let tables = tables(0);
        let key = packet(ACK).flow_key();
        tables.set_flow(&key, Some(flow::entry_for(1, false, NOW - 2 * SECOND)));
        tables.decide(&packet(SYN)).unwrap();
        tables.reset_counts();
        let ack = tables.decide(&packet(ACK)).unwrap();
        assert_eq!((ack.backend_id, ack.by), (0, Source::Embryo));
        assert_eq!(counted(&tables), ["ct_created", "ct_reused"]);
        assert_eq!(tables.flow(&key), Some(flow::entry_for(0, false, NOW)));
        assert_eq!(embryo_of(&tables, &packet(ACK)).flags, 0);
    }

    #[test]
    fn the_flood_guard_skips_the_insert_but_not_the_packet() {
        let mut tables = tables(0);
        tables.decide(&packet(SYN)).unwrap();
        tables.inserts_refused = true;
        tables.reset_counts();
        assert_eq!(tables.decide(&packet(ACK)).unwrap().backend_id, 0);
        assert_eq!(counted(&tables), ["ct_insert_skipped", "ct_promoted"]);
        assert_eq!(tables.flow(&packet(ACK).flow_key()), None);
    }

    #[test]
    fn a_too_big_error_follows_its_flow_and_touches_nothing() {
        let mut tables = tables(0);
        let key = packet(ACK).flow_key();
        let entry = flow::entry_for(1, false, NOW - 5 * SECOND);
        tables.set_flow(&key, Some(entry));
        let error = Packet {
            icmp_too_big: true,
            ..packet(ACK)
        };
        assert_eq!(tables.decide(&error).unwrap().backend_id, 1);
        assert_eq!(counted(&tables), ["seen_icmp_too_big"]);
        assert_eq!(tables.flow(&key), Some(entry), "untouched");
        // About a UDP flow the balancer never saw: passed.
        let udp = Packet {
            proto: crate::PROTO_UDP,
            ..error
        };
        let info = tables.vips[&packet(ACK).vip_key()];
        tables.vips.insert(udp.vip_key(), info);
        assert_eq!(
            tables.decide(&udp),
            Err(Verdict::pass(stat::PASS_OTHER_PROTO))
        );
    }

    /// `tables` for a VIP with `VIP_F_STABLE`, every slot holding `slot`'s word.
    fn stable_tables(slot: Slot) -> MemoryTables {
        let mut tables = tables(0);
        tables.vips.get_mut(&packet(0).vip_key()).unwrap().flags = VIP_F_STABLE;
        tables.maglev.insert(VIP, vec![slot::word(slot); 7]);
        tables
    }

    fn changed(backend_id: u32, previous: u32) -> Slot {
        Slot {
            backend_id,
            previous: Some(previous),
        }
    }

    #[test]
    fn a_stable_slot_sends_tcp_where_the_table_says_and_makes_no_entry() {
        let tables = stable_tables(Slot::stable(1));
        let syn = tables.decide(&packet(SYN)).unwrap();
        assert_eq!(
            (syn.backend_id, syn.new_flow, syn.by),
            (1, true, Source::Table)
        );
        assert_eq!(counted(&tables), ["ct_miss_syn", "ct_embryonic"]);
        // The first ACK: counted once as the handshake's completion, no entry.
        let ack = tables.decide(&packet(ACK)).unwrap();
        assert_eq!((ack.backend_id, ack.by), (1, Source::StableSlot));
        assert_eq!(ack.handshake, handshake::event(handshake::COMPLETED));
        let source = SourceKey::new(VIP, v4(1), ADDR_FAMILY_V4);
        assert_eq!(tables.sources().get(&source), Some(&1));
        assert_eq!(counted(&tables), ["ct_promoted", "ct_stable"]);
        assert_eq!(tables.flow(&packet(ACK).flow_key()), None, "no entry");
        assert!(tables.exported().is_empty());
        let next = tables.decide(&packet(ACK)).unwrap();
        assert_eq!((next.backend_id, next.handshake), (1, 0));
        assert_eq!(counted(&tables), ["ct_stable"]);
        // A stale entry naming another backend is not read.
        tables.set_flow(
            &packet(ACK).flow_key(),
            Some(flow::entry_for(0, false, NOW)),
        );
        assert_eq!(tables.decide(&packet(ACK)).unwrap().backend_id, 1);
        // An ICMP too big goes where the table says.
        let error = Packet {
            icmp_too_big: true,
            ..packet(ACK)
        };
        assert_eq!(tables.decide(&error).unwrap().backend_id, 1);
        // A flow whose first packet came while the slot was changed, and went to the
        // slot's previous backend: it stays there when the slot turns stable.
        let mut changed_then = stable_tables(changed(1, 0));
        let late = Packet {
            src_port_be: 40003u16.to_be(),
            ..packet(ACK)
        };
        assert_eq!(changed_then.decide(&late).unwrap().backend_id, 0);
        let stable_word = slot::word(Slot::stable(1));
        changed_then.maglev.insert(VIP, vec![stable_word; 7]);
        let after = changed_then.decide(&late).unwrap();
        assert_eq!((after.backend_id, after.by), (0, Source::Embryo));
        // No backend: dropped.
        let empty = stable_tables(Slot::stable(BACKEND_NONE));
        assert_eq!(
            empty.decide(&packet(ACK)),
            Err(Verdict::drop(stat::DROP_NO_BACKEND))
        );
    }

    #[test]
    fn an_entryless_flow_in_a_changed_slot_stays_on_the_previous_backend() {
        // The slot moved from backend 0 to 1: a flow that began before (no entry, no
        // embryonic record) stays on 0, pinned by an entry at its second packet.
        let tables = stable_tables(changed(1, 0));
        let first = tables.decide(&packet(ACK)).unwrap();
        assert_eq!((first.backend_id, first.by), (0, Source::PreviousBackend));
        assert_eq!(counted(&tables), ["ct_embryonic", "ct_previous"]);
        assert_eq!(
            tables.flow(&packet(ACK).flow_key()),
            None,
            "one packet pins nothing"
        );
        let second = tables.decide(&packet(ACK)).unwrap();
        assert_eq!((second.backend_id, second.by), (0, Source::Embryo));
        assert_eq!(counted(&tables), ["ct_created", "ct_promoted"]);
        let third = tables.decide(&packet(ACK)).unwrap();
        assert_eq!((third.backend_id, third.by), (0, Source::Entry));
        // A new connection takes the table's backend, and its entry holds it.
        let new = Packet {
            src_port_be: 40001u16.to_be(),
            ..packet(SYN)
        };
        assert_eq!(tables.decide(&new).unwrap().backend_id, 1);
        let ack = Packet { syn: false, ..new };
        let promoted = tables.decide(&ack).unwrap();
        assert_eq!((promoted.backend_id, promoted.by), (1, Source::Embryo));
        assert_eq!(tables.flow(&ack.flow_key()).map(|e| e.backend_id), Some(1));
        // A previous backend that no longer serves the VIP: the table's.
        let failed = stable_tables(changed(1, 2));
        assert_eq!(failed.decide(&packet(ACK)).unwrap().backend_id, 1);
        // An ICMP too big about an entry-less flow: where its packets go.
        let error = Packet {
            icmp_too_big: true,
            src_port_be: 40002u16.to_be(),
            ..packet(ACK)
        };
        let too_big = tables.decide(&error).unwrap();
        assert_eq!(
            (too_big.backend_id, too_big.by),
            (0, Source::PreviousBackend)
        );
    }

    #[test]
    fn other_vips_read_their_slots_as_plain_ids() {
        // A word with a previous backend means a large id to a VIP without the flag: the
        // flag, not the word, decides how a slot is read.
        let tables = tables(slot::word(changed(1, 0)));
        assert_eq!(tables.decide(&packet(SYN)).unwrap().backend_id, 1 << 16 | 1);
    }

    #[test]
    fn a_hot_source_of_a_src_ip_vip_is_spread() {
        let mut tables = tables(0);
        let info = tables.vips.values_mut().next().unwrap();
        info.flags = VIP_F_HASH_SRC_IP | VIP_F_HOT_SOURCES;
        tables.decide(&packet(SYN)).unwrap();
        assert_eq!(counted(&tables), ["ct_miss_syn", "ct_embryonic"]);
        tables
            .hot_sources
            .insert(SourceKey::new(VIP, v4(1), ADDR_FAMILY_V4));
        tables.decide(&packet(SYN)).unwrap();
        assert_eq!(
            counted(&tables),
            ["ct_miss_syn", "ct_embryonic", "hot_source_spread"]
        );
    }

    /// A QUIC VIP 10.0.0.100:443/udp (id 1, 2-byte server IDs): its table all backend
    /// 0; backend 0 has server ID 10, 1 (draining: serves flows, not in the table) 11,
    /// 2 (down) 12.
    fn quic_tables() -> MemoryTables {
        let mut tables = tables(0);
        let info = VipInfo {
            vip_id: VIP,
            generation: 0,
            flags: quic::vip_flags(2),
            _pad: 0,
        };
        tables.vips.clear();
        tables.vips.insert(datagram(40000).vip_key(), info);
        for (backend, id) in [(0, 10), (1, 11), (2, 12)] {
            tables
                .quic_ids
                .insert(ServerKey::of_config(VIP, id, 2), backend);
        }
        tables
    }

    fn datagram(src_port: u16) -> Packet {
        Packet::of_flow(
            (v4(1), v4(100)),
            (crate::ADDR_FAMILY_V4, crate::PROTO_UDP),
            (src_port.to_be(), 443u16.to_be()),
        )
    }

    /// A short-header payload whose DCID carries server ID `id`.
    fn short_header(id: u128) -> Vec<u8> {
        let mut payload = vec![0x40; 40];
        quic::encode_cid(id, 2, &[0x5a; 16], &mut payload[1..9]);
        payload
    }

    #[test]
    fn a_quic_short_header_goes_where_its_connection_id_says_from_any_port() {
        let tables = quic_tables();
        for port in [40000, 40001] {
            let to = tables
                .decide_payload(&datagram(port), &short_header(11))
                .unwrap();
            assert_eq!((to.backend_id, to.by), (1, Source::ConnectionId));
            assert_eq!(counted(&tables), ["ct_created", "quic_routed_by_cid"]);
            let entry = tables.flow(&datagram(port).flow_key()).unwrap();
            assert_eq!(entry.backend_id, 1, "the new tuple's entry");
        }
        // An entry for the tuple that names another backend is re-written.
        let key = datagram(40002).flow_key();
        tables.set_flow(&key, Some(flow::entry_for(0, false, NOW)));
        let to = tables
            .decide_payload(&datagram(40002), &short_header(11))
            .unwrap();
        assert_eq!(to.backend_id, 1);
        assert_eq!(tables.flow(&key).unwrap().backend_id, 1);
        // The next packet of the same tuple refreshes nothing: the entry is fresh.
        tables.reset_counts();
        tables
            .decide_payload(&datagram(40002), &short_header(11))
            .unwrap();
        assert_eq!(tables.quic_counts(VIP).routed_by_cid, 1);
        assert_eq!(counted(&tables), ["quic_routed_by_cid"]);
    }

    #[test]
    fn unknown_ids_down_backends_and_other_payloads_are_balanced_as_udp() {
        let tables = quic_tables();
        for (port, id) in [(40000, 99), (40010, 12)] {
            let to = tables
                .decide_payload(&datagram(port), &short_header(id))
                .unwrap();
            assert_eq!((to.backend_id, to.by), (0, Source::Table), "id {id}");
            assert_eq!(
                counted(&tables),
                ["ct_miss_udp", "ct_embryonic", "quic_cid_unknown"]
            );
        }
        let mut long = short_header(11);
        long[0] = 0xc0;
        let mut no_fixed_bit = short_header(11);
        no_fixed_bit[0] = 0x00;
        let truncated = &short_header(11)[..quic::WINDOW_LEN - 1];
        for (port, payload) in [
            (40001, &long[..]),
            (40002, &no_fixed_bit),
            (40003, truncated),
            (40004, &[]),
        ] {
            let to = tables.decide_payload(&datagram(port), payload).unwrap();
            assert_eq!(to.by, Source::Table);
            let moved = counted(&tables);
            assert!(!moved.iter().any(|c| c.starts_with("quic")), "{moved:?}");
        }
        // A VIP without `quic` never reads the payload.
        let mut plain = quic_tables();
        plain.vips.values_mut().for_each(|info| info.flags = 0);
        let to = plain
            .decide_payload(&datagram(40003), &short_header(11))
            .unwrap();
        assert_eq!(to.by, Source::Table);
    }
}
