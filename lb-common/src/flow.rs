//! What a packet's connection-table entry decides, written once: the XDP program runs
//! these functions on every packet that has an entry, and `lb explain` runs them over
//! the agent's tables, so the two cannot disagree.
//!
//! They are pure: lookups stay with the caller, behind `Lookup`, whose methods are called
//! only where the decision needs them, so the kernel reads what it read before and no
//! more (one `LB_BACKENDS` element for a followed entry, none for an idle UDP one).

use crate::{
    ADDR_FAMILY_V4, BACKEND_F_SERVES_FLOWS, BackendInfo, EMBRYO_F_SYN, EMBRYONIC_SLOTS, Embryo,
    FLOW_F_CLOSING, FLOW_F_LEARNED, FlowEntry, FlowKey, LAST_SEEN_GRANULARITY_NS, PROTO_UDP, stat,
};

/// What a decision reads besides the entry: in the kernel, its maps and load-time
/// globals; in `lb explain`, what the agent writes into them.
pub trait Lookup {
    /// `LB_BACKENDS[id]`: the backend an entry names, if the id names one.
    fn backend(&self, id: u32) -> Option<&BackendInfo>;
    /// Idle time after which a UDP flow's entry is ignored (`GLOBAL_UDP_IDLE_NS`).
    fn udp_idle_ns(&self) -> u64;
}

/// Nanoseconds since the entry's flow last sent a packet (0 for an entry from the
/// future: another CPU's clock read a little later).
#[inline(always)]
pub fn age(entry: &FlowEntry, now: u64) -> u64 {
    now.saturating_sub(entry.last_seen_ns)
}

/// Whether a flow's entry, idle for `age` ns, is too old to be followed: only UDP
/// entries expire (a TCP entry holds its flow until the LRU evicts it).
#[inline(always)]
pub fn udp_expired(lookup: &impl Lookup, proto: u8, age: u64) -> bool {
    proto == PROTO_UDP && age > lookup.udp_idle_ns()
}

/// Whether `backend` may keep a flow of VIP `vip_id`: it serves flows (ready, or
/// draining while healthy) and belongs to that VIP (an id reused for another VIP's
/// backend must not take this VIP's flows).
#[inline(always)]
pub fn serves(backend: &BackendInfo, vip_id: u32) -> bool {
    backend.flags & BACKEND_F_SERVES_FLOWS != 0 && backend.vip_id == vip_id
}

/// The backend an entry holds its flow to, if the flow may stay there (`serves`).
#[inline(always)]
pub fn serving(lookup: &impl Lookup, entry: &FlowEntry, vip_id: u32) -> Option<u32> {
    backend_serving(lookup, entry.backend_id, vip_id)
}

/// Backend `backend_id`, if it may keep (or take) a flow of VIP `vip_id` (`serves`).
#[inline(always)]
pub fn backend_serving(lookup: &impl Lookup, backend_id: u32, vip_id: u32) -> Option<u32> {
    match lookup.backend(backend_id) {
        Some(backend) if serves(backend, vip_id) => Some(backend_id),
        _ => None,
    }
}

/// The backend an entry of `age` ns holds its flow to, or why it holds it no more
/// (`follow`'s reasons): the one decision `held` and `follow` share.
#[inline(always)]
fn decide(
    lookup: &impl Lookup,
    entry: &FlowEntry,
    proto: u8,
    vip_id: u32,
    age: u64,
) -> Result<u32, u32> {
    if udp_expired(lookup, proto, age) {
        return Err(stat::CT_MISS_UDP);
    }
    serving(lookup, entry, vip_id).ok_or(stat::CT_REHASH)
}

/// The backend a live entry holds its flow to, the entry untouched: where an ICMP error
/// about the flow goes (an error is not a packet of the flow).
#[inline(always)]
pub fn held(
    lookup: &impl Lookup,
    entry: &FlowEntry,
    proto: u8,
    vip_id: u32,
    now: u64,
) -> Option<u32> {
    decide(lookup, entry, proto, vip_id, age(entry, now)).ok()
}

/// A packet (not a SYN) of a flow that has an entry: the backend the entry holds it to,
/// and the entry refreshed (its time, at most once per `LAST_SEEN_GRANULARITY_NS`; the
/// closing flag once the client sent a FIN or RST); or why the flow is balanced afresh:
/// `stat::CT_MISS_UDP` (an idle UDP entry), `stat::CT_REHASH` (the backend is gone, no
/// longer serves flows, or serves another VIP), `stat::CT_REUSED` (a TCP entry of an
/// earlier connection whose tuple a new SYN took: `syn_since` says so; it is asked only
/// of an entry idle past the granularity or closing, as a reused tuple's is, so a busy
/// flow's packets never read the embryonic table).
#[inline(always)]
pub fn follow(
    lookup: &impl Lookup,
    entry: &mut FlowEntry,
    proto: u8,
    closing: bool,
    vip_id: u32,
    now: u64,
    syn_since: impl FnOnce() -> bool,
) -> Result<u32, u32> {
    let age = age(entry, now);
    let held = decide(lookup, entry, proto, vip_id, age)?;
    if proto != PROTO_UDP
        && (age > LAST_SEEN_GRANULARITY_NS || entry.flags & FLOW_F_CLOSING != 0)
        && syn_since()
    {
        return Err(stat::CT_REUSED);
    }
    // Writes only when something changed: entries are shared by every CPU's packets.
    // A learned entry is written with a time older than the granularity, so its flow's
    // first packet here lands in this write and makes it this node's own.
    if age > LAST_SEEN_GRANULARITY_NS {
        entry.last_seen_ns = now;
        entry.flags &= !FLOW_F_LEARNED;
    }
    if closing && entry.flags & FLOW_F_CLOSING == 0 {
        entry.flags |= FLOW_F_CLOSING;
    }
    Ok(held)
}

/// A new entry holding a flow to `backend_id`, seen `now`; closing if its first packet
/// was a FIN or RST.
#[inline(always)]
pub fn entry_for(backend_id: u32, closing: bool, now: u64) -> FlowEntry {
    FlowEntry {
        backend_id,
        flags: if closing { FLOW_F_CLOSING } else { 0 },
        last_seen_ns: now,
    }
}

/// Where a flow's `Embryo` lives in `LB_EMBRYONIC` (the index), and what tells it from
/// another flow's on the same slot (the tag, never 0: an empty slot is all zeroes). Two
/// independent folds of the key, not the Maglev hash: a VIP hashed by source would give
/// every flow of a client one slot, and the tag would repeat the index's bits. An IPv4
/// key folds its two address words only: the other six are zero, and each fold is a
/// multiply in one dependent chain (every SYN and every packet in a stable slot pays it).
#[inline(always)]
pub fn embryo_place(key: &FlowKey) -> (u32, u32) {
    let word = |bytes: &[u8; 16], i: usize| {
        u32::from_ne_bytes([bytes[i], bytes[i + 1], bytes[i + 2], bytes[i + 3]])
    };
    let ports = (key.src_port as u32) << 16 | key.dst_port as u32;
    let mut tag = ports ^ key.proto as u32;
    let mut index = ports.rotate_left(16) ^ key.proto as u32;
    let mut fold = |i: usize| {
        for (n, w) in [word(&key.src, i), word(&key.dst, i)]
            .into_iter()
            .enumerate()
        {
            tag ^= w.rotate_left(n as u32 * 11);
            index = (index ^ w).wrapping_mul(0x9e37_79b1);
        }
    };
    if key.family == ADDR_FAMILY_V4 {
        fold(0);
    } else {
        for i in [0, 4, 8, 12] {
            fold(i);
        }
    }
    ((index >> 16) & (EMBRYONIC_SLOTS - 1), tag | 1)
}

/// The backend a flow's first packet took, if `embryo` is that flow's (`tag`) and the
/// backend may still take it (`serves`): where its second packet goes, and the entry it
/// makes in the connection table.
#[inline(always)]
pub fn remembered(lookup: &impl Lookup, embryo: &Embryo, tag: u32, vip_id: u32) -> Option<u32> {
    if embryo.tag != tag {
        return None;
    }
    backend_serving(lookup, embryo.backend_id as u32, vip_id)
}

/// What the embryonic table remembers of a flow whose first packet (a SYN if `syn`) went
/// to `backend_id`.
#[inline(always)]
pub fn embryo_for(tag: u32, backend_id: u32, syn: bool) -> Embryo {
    Embryo {
        tag,
        backend_id: backend_id as u16,
        flags: if syn { EMBRYO_F_SYN } else { 0 },
    }
}

/// Whether `embryo` says a SYN on the flow of `tag` came after its connection-table entry
/// was last written: the tuple was reused by a new connection.
#[inline(always)]
pub fn syn_since(embryo: &Embryo, tag: u32) -> bool {
    embryo.tag == tag && embryo.flags & EMBRYO_F_SYN != 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::PROTO_TCP;
    use std::cell::Cell;

    const VIP: u32 = 3;
    const SECOND: u64 = 1_000_000_000;
    const IDLE: u64 = 30 * SECOND;
    const NOW: u64 = 10_000 * SECOND;

    /// Backends 0..4: 0 serves VIP 3, 1 is VIP 3's but serves no flows (failed), 2 serves
    /// VIP 4 (the id was reused), 3 is not there. Counts the lookups.
    #[derive(Default)]
    struct Maps {
        backend_reads: Cell<u32>,
        idle_reads: Cell<u32>,
    }

    const BACKENDS: [BackendInfo; 3] = [
        BackendInfo::l2([2, 0, 0, 0, 0, 0], BACKEND_F_SERVES_FLOWS, VIP),
        BackendInfo::l2([2, 0, 0, 0, 0, 1], 0, VIP),
        BackendInfo::l2([2, 0, 0, 0, 0, 2], BACKEND_F_SERVES_FLOWS, VIP + 1),
    ];

    impl Lookup for Maps {
        fn backend(&self, id: u32) -> Option<&BackendInfo> {
            self.backend_reads.set(self.backend_reads.get() + 1);
            BACKENDS.get(id as usize)
        }
        fn udp_idle_ns(&self) -> u64 {
            self.idle_reads.set(self.idle_reads.get() + 1);
            IDLE
        }
    }

    fn entry(backend_id: u32, idle: u64) -> FlowEntry {
        FlowEntry {
            backend_id,
            flags: 0,
            last_seen_ns: NOW - idle,
        }
    }

    #[test]
    fn a_live_entry_is_followed_and_its_time_refreshed_only_past_the_granularity() {
        let maps = Maps::default();
        for proto in [PROTO_TCP, PROTO_UDP] {
            let mut recent = entry(0, SECOND / 2);
            let followed = follow(&maps, &mut recent, proto, false, VIP, NOW, || false);
            assert_eq!(followed, Ok(0));
            assert_eq!(
                recent,
                entry(0, SECOND / 2),
                "within the granularity: unwritten"
            );

            let mut older = entry(0, 5 * SECOND);
            assert_eq!(
                follow(&maps, &mut older, proto, false, VIP, NOW, || false),
                Ok(0)
            );
            assert_eq!(older.last_seen_ns, NOW);
            assert_eq!(older.flags, 0);
        }
    }

    #[test]
    fn a_learned_entry_becomes_this_nodes_own_at_its_first_packet() {
        let maps = Maps::default();
        // As the cluster writes it: older than the granularity, so the packet refreshes it.
        let mut learned = FlowEntry {
            flags: FLOW_F_LEARNED | FLOW_F_CLOSING,
            ..entry(0, LAST_SEEN_GRANULARITY_NS + 1)
        };
        let followed = follow(&maps, &mut learned, PROTO_TCP, false, VIP, NOW, || false);
        assert_eq!(followed, Ok(0));
        assert_eq!(learned.last_seen_ns, NOW);
        assert_eq!(
            learned.flags, FLOW_F_CLOSING,
            "learned cleared, closing kept"
        );
    }

    #[test]
    fn an_idle_udp_entry_expires_and_a_tcp_one_never() {
        let maps = Maps::default();
        let mut idle_udp = entry(0, IDLE + 1);
        let before = idle_udp;
        assert_eq!(
            follow(&maps, &mut idle_udp, PROTO_UDP, false, VIP, NOW, || false),
            Err(stat::CT_MISS_UDP)
        );
        assert_eq!(
            idle_udp, before,
            "an expired entry is left for the new choice"
        );
        assert_eq!(
            maps.backend_reads.get(),
            0,
            "no backend read for an expired entry"
        );
        let mut just_live = entry(0, IDLE);
        assert!(follow(&maps, &mut just_live, PROTO_UDP, false, VIP, NOW, || false).is_ok());

        let mut idle_tcp = entry(0, 100 * IDLE);
        let reads = maps.idle_reads.get();
        assert!(follow(&maps, &mut idle_tcp, PROTO_TCP, false, VIP, NOW, || false).is_ok());
        assert_eq!(
            maps.idle_reads.get(),
            reads,
            "TCP never reads the UDP idle time"
        );
        assert_eq!(idle_tcp.last_seen_ns, NOW);
    }

    #[test]
    fn a_gone_failed_or_other_vips_backend_gives_way_to_the_table() {
        let maps = Maps::default();
        for (backend_id, what) in [(1, "failed"), (2, "another VIP's"), (3, "gone")] {
            let mut stale = entry(backend_id, 5 * SECOND);
            let before = stale;
            assert_eq!(
                follow(&maps, &mut stale, PROTO_TCP, true, VIP, NOW, || false),
                Err(stat::CT_REHASH),
                "{what}"
            );
            assert_eq!(
                stale, before,
                "{what}: the entry is left for the new choice"
            );
            assert_eq!(serving(&maps, &stale, VIP), None, "{what}");
        }
        // Backend 2 is followed by its own VIP's flows.
        assert_eq!(serving(&maps, &entry(2, 0), VIP + 1), Some(2));
    }

    #[test]
    fn a_fin_or_rst_marks_the_entry_closing_and_it_stays_closing() {
        let maps = Maps::default();
        let mut open = entry(0, 0);
        assert!(follow(&maps, &mut open, PROTO_TCP, true, VIP, NOW, || false).is_ok());
        assert_eq!(open.flags, FLOW_F_CLOSING);
        // A late packet after the FIN still follows, and does not reopen the flow.
        assert_eq!(
            follow(&maps, &mut open, PROTO_TCP, false, VIP, NOW, || false),
            Ok(0)
        );
        assert_eq!(open.flags, FLOW_F_CLOSING);

        assert_eq!(
            entry_for(7, false, NOW),
            FlowEntry {
                backend_id: 7,
                flags: 0,
                last_seen_ns: NOW
            }
        );
        assert_eq!(entry_for(7, true, NOW).flags, FLOW_F_CLOSING);
    }

    #[test]
    fn held_gives_a_live_entrys_backend_without_touching_the_entry() {
        let maps = Maps::default();
        let live = entry(0, 5 * SECOND);
        assert_eq!(held(&maps, &live, PROTO_UDP, VIP, NOW), Some(0));
        assert_eq!(held(&maps, &entry(0, IDLE + 1), PROTO_UDP, VIP, NOW), None);
        assert_eq!(
            held(&maps, &entry(0, IDLE + 1), PROTO_TCP, VIP, NOW),
            Some(0)
        );
        assert_eq!(held(&maps, &entry(1, 0), PROTO_TCP, VIP, NOW), None);
    }

    #[test]
    fn an_entry_seen_after_now_is_of_age_zero() {
        let future = FlowEntry {
            backend_id: 0,
            flags: 0,
            last_seen_ns: NOW + SECOND,
        };
        assert_eq!(age(&future, NOW), 0);
        assert_eq!(age(&entry(0, 5), NOW), 5);
    }

    fn key(src_port: u16) -> FlowKey {
        FlowKey {
            src: [10, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            dst: [10, 0, 0, 100, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            src_port: src_port.to_be(),
            dst_port: 80u16.to_be(),
            proto: PROTO_TCP,
            family: crate::ADDR_FAMILY_V4,
            _pad: [0; 2],
        }
    }

    #[test]
    fn embryo_places_spread_and_their_tags_tell_flows_apart() {
        let mut slots = std::collections::HashSet::new();
        let mut tags = std::collections::HashSet::new();
        for port in 0..4096u16 {
            let (index, tag) = embryo_place(&key(port));
            assert!(index < EMBRYONIC_SLOTS);
            assert_ne!(tag, 0, "an empty slot's tag");
            slots.insert(index);
            tags.insert(tag);
        }
        // One client's flows (a VIP hashed by source gives them one Maglev slot) spread
        // over the embryonic table, and no two share a tag.
        assert!(slots.len() > 3900, "{} slots for 4096 flows", slots.len());
        assert_eq!(tags.len(), 4096);
        let mut other_vip = key(1000);
        other_vip.dst[3] = 101;
        assert_ne!(embryo_place(&other_vip).1, embryo_place(&key(1000)).1);
        // Many clients on one port spread too, over IPv4 (two address words folded) and
        // over IPv6 (all eight).
        for family in [crate::ADDR_FAMILY_V4, crate::ADDR_FAMILY_V6] {
            let slots: std::collections::HashSet<u32> = (0..4096u16)
                .map(|client| {
                    let mut key = key(40000);
                    key.family = family;
                    let at = if family == crate::ADDR_FAMILY_V4 {
                        2
                    } else {
                        14
                    };
                    key.src[at..at + 2].copy_from_slice(&client.to_be_bytes());
                    embryo_place(&key).0
                })
                .collect();
            assert!(slots.len() > 3900, "{} slots for 4096 clients", slots.len());
        }
    }

    #[test]
    fn a_remembered_backend_is_taken_only_by_its_own_flow_while_it_serves() {
        let maps = Maps::default();
        let tag = embryo_place(&key(7)).1;
        let embryo = embryo_for(tag, 0, false);
        assert_eq!(remembered(&maps, &embryo, tag, VIP), Some(0));
        assert_eq!(
            remembered(&maps, &embryo, tag ^ 2, VIP),
            None,
            "another flow's"
        );
        assert_eq!(
            remembered(&maps, &embryo_for(tag, 1, false), tag, VIP),
            None,
            "failed"
        );
        assert_eq!(
            remembered(&maps, &embryo_for(tag, 2, false), tag, VIP),
            None,
            "other VIP's"
        );
        assert_eq!(
            remembered(&maps, &embryo_for(tag, 3, false), tag, VIP),
            None,
            "gone"
        );
        assert_eq!(
            remembered(&maps, &Embryo::default(), tag, VIP),
            None,
            "empty"
        );
    }

    #[test]
    fn a_syn_since_the_entry_gives_an_idle_or_closing_tcp_entry_way() {
        let maps = Maps::default();
        let tag = embryo_place(&key(9)).1;
        assert!(syn_since(&embryo_for(tag, 0, true), tag));
        assert!(
            !syn_since(&embryo_for(tag, 0, false), tag),
            "promoted since"
        );
        assert!(
            !syn_since(&embryo_for(tag ^ 2, 0, true), tag),
            "another flow's"
        );
        // Idle past the granularity, or closing: asked, and a SYN since wins.
        let mut idle = entry(0, 2 * SECOND);
        let asked = Cell::new(0);
        let reused = || {
            asked.set(asked.get() + 1);
            true
        };
        assert_eq!(
            follow(&maps, &mut idle, PROTO_TCP, false, VIP, NOW, reused),
            Err(stat::CT_REUSED)
        );
        let mut closing = FlowEntry {
            flags: FLOW_F_CLOSING,
            ..entry(0, SECOND / 2)
        };
        assert_eq!(
            follow(&maps, &mut closing, PROTO_TCP, false, VIP, NOW, reused),
            Err(stat::CT_REUSED)
        );
        assert_eq!(asked.get(), 2);
        // A busy flow's packet (within the granularity) and a UDP flow never ask.
        let mut busy = entry(0, SECOND / 2);
        let never = || -> bool { panic!("asked for a busy flow") };
        assert!(follow(&maps, &mut busy, PROTO_TCP, false, VIP, NOW, never).is_ok());
        let mut udp = entry(0, 2 * SECOND);
        assert!(follow(&maps, &mut udp, PROTO_UDP, false, VIP, NOW, never).is_ok());
    }
}
