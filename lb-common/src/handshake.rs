//! TCP handshakes per backend, as the data path sees them, for passive health
//! (`[vip.outlier]`). In DSR the balancer sees the client's half of a handshake only:
//! the SYN it forwards, and the client's first ACK, which the client sends only once
//! the backend's SYN-ACK reached it. The embryonic slot that remembers a SYN's backend
//! (`flow::embryo_for`) also says whether the SYN was sent again and whether the
//! handshake was counted, so counting costs no lookup of its own.
//!
//! Spoofed SYNs never complete; they are told apart because they are not seen again: a
//! real client whose SYN goes unanswered sends it again (after about a second on Linux),
//! a flood of random tuples does not. The agent judges a backend only by handshakes
//! seen twice: completed, or retried (`STARTED` is shown, never judged).

use crate::{
    EMBRYO_F_COMPLETED, EMBRYO_F_RETRIED, EMBRYO_F_SYN, Embryo, VIP_F_OUTLIER, VipInfo,
    decide::Tables,
};

/// `TrafficCounters::handshakes` index: the first SYN of a flow sent to the backend
/// (spoofed SYNs included).
pub const STARTED: u32 = 0;
/// A flow's SYN sent again while it waited on the backend (once per flow).
pub const RETRIED: u32 = 1;
/// A flow's first ACK: its handshake with the backend completed.
pub const COMPLETED: u32 = 2;
/// Of `COMPLETED`, those whose SYN had been retried.
pub const RETRIED_COMPLETED: u32 = 3;
/// How many there are.
pub const COUNT: usize = 4;

/// A packet's handshake events for the backend it is sent to: bit `1 << event` for each
/// event (`STARTED` ...) it is; 0 for every packet but a flow's SYN and its first ACK.
/// `decide` returns them in its `Choice`, so the kernel adds them in the one write of the
/// backend's counters that counts the packet (`add`), and an established flow's packet
/// passes one test of a register it already tests for new flows.
pub type Events = u8;

/// `Events` of one event.
#[inline(always)]
pub const fn event(event: u32) -> Events {
    1 << event
}

/// Adds `events` to a backend's `handshakes` counters: without a branch per event, the
/// counters being in the cache line the packet's own count has just written.
#[inline(always)]
pub fn add(handshakes: &mut [u64; COUNT], events: Events) {
    for (i, counter) in handshakes.iter_mut().enumerate() {
        *counter += ((events >> i) & 1) as u64;
    }
}

/// A SYN to `vip` about to be remembered as `fresh` in the embryonic slot that holds
/// `old`: what the slot is to hold, and the events of `fresh`'s backend (a new handshake,
/// or a retry of one still waiting). A retry is counted against the backend the flow
/// waited on; if the table sends it elsewhere now (that backend left it), a new handshake
/// starts there, and the retry, of another backend than the packet's, is counted on its
/// own (`Tables::count_handshake`: rare, a table change during a handshake).
///
/// Retries are told apart only for a VIP with `VIP_F_OUTLIER` (`[vip.outlier]`): `old`
/// is read for nothing else, and reading it is a cache miss every spoofed SYN would pay.
/// Elsewhere every SYN starts a handshake and `old` is never read.
#[inline(always)]
pub fn syn<T: Tables>(tables: &T, vip: &VipInfo, old: &Embryo, fresh: Embryo) -> (Embryo, Events) {
    if vip.flags & VIP_F_OUTLIER == 0 {
        return (fresh, event(STARTED));
    }
    let waiting =
        old.tag == fresh.tag && old.flags & (EMBRYO_F_SYN | EMBRYO_F_COMPLETED) == EMBRYO_F_SYN;
    if !waiting {
        return (fresh, event(STARTED));
    }
    let first_retry = old.flags & EMBRYO_F_RETRIED == 0;
    if old.backend_id != fresh.backend_id {
        if first_retry {
            tables.count_handshake(old.backend_id as u32, RETRIED);
        }
        return (fresh, event(STARTED));
    }
    let retried = Embryo {
        flags: fresh.flags | EMBRYO_F_RETRIED,
        ..fresh
    };
    (retried, if first_retry { event(RETRIED) } else { 0 })
}

/// A flow's second packet, sent to the backend `embryo` remembers: the handshake
/// completed if the first was a SYN and this is no RST. Its events, counted once per
/// flow (`EMBRYO_F_COMPLETED`).
#[inline(always)]
pub fn ack(rst: bool, embryo: &mut Embryo) -> Events {
    if rst || embryo.flags & (EMBRYO_F_SYN | EMBRYO_F_COMPLETED) != EMBRYO_F_SYN {
        return 0;
    }
    embryo.flags |= EMBRYO_F_COMPLETED;
    if embryo.flags & EMBRYO_F_RETRIED != 0 {
        event(COMPLETED) | event(RETRIED_COMPLETED)
    } else {
        event(COMPLETED)
    }
}

/// What the agent judges of a backend from its counters over a window (the differences
/// of two readings): only handshakes seen twice.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Judged {
    /// Completed, or retried and not (yet) completed.
    pub started: u64,
    pub completed: u64,
}

impl Judged {
    /// From the differences of `handshakes` counters over a window.
    pub fn of(delta: &[u64; COUNT]) -> Self {
        let completed = delta[COMPLETED as usize];
        let waiting = delta[RETRIED as usize].saturating_sub(delta[RETRIED_COMPLETED as usize]);
        Judged {
            started: completed + waiting,
            completed,
        }
    }

    pub fn failed(&self) -> u64 {
        self.started - self.completed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        ADDR_FAMILY_V4, BACKEND_F_SERVES_FLOWS, BackendInfo, PROTO_TCP, VIP_F_OUTLIER, VipInfo,
        decide::{Packet, memory::MemoryTables},
    };

    /// VIP 10.0.0.100:80/tcp (id 1) with `[vip.outlier]`, every slot of its table
    /// backend `to`; backends 0 and 1 serve it.
    fn tables(to: u32) -> MemoryTables {
        tables_with(to, VIP_F_OUTLIER)
    }

    fn tables_with(to: u32, flags: u32) -> MemoryTables {
        let mut tables = MemoryTables::default();
        tables.maglev_size = 7;
        tables.now_ns = 1_000_000_000_000;
        let info = VipInfo {
            vip_id: 1,
            generation: 0,
            flags,
            _pad: 0,
        };
        tables.vips.insert(packet(0, 2).vip_key(), info);
        for id in [0u32, 1] {
            let backend = BackendInfo::l2([2, 0, 0, 0, 0, id as u8], BACKEND_F_SERVES_FLOWS, 1);
            tables.backends.insert(id, backend);
        }
        tables.maglev.insert(1, vec![to; 7]);
        tables
    }

    /// A TCP packet of client port `port`: a SYN (flags 2), an ACK (0) or a RST (4).
    fn packet(port: u16, flags: u8) -> Packet {
        let addr = |last: u8| {
            let mut addr = [0; 16];
            addr[..4].copy_from_slice(&[10, 0, 0, last]);
            addr
        };
        Packet {
            syn: flags & 2 != 0,
            rst: flags & 4 != 0,
            ..Packet::of_flow(
                (addr(1), addr(100)),
                (ADDR_FAMILY_V4, PROTO_TCP),
                (port.to_be(), 80u16.to_be()),
            )
        }
    }

    const ONE_COMPLETED: Judged = Judged {
        started: 1,
        completed: 1,
    };

    fn judged(tables: &MemoryTables, id: u32) -> Judged {
        Judged::of(&tables.handshakes(id))
    }

    #[test]
    fn a_handshake_counts_started_then_completed_once() {
        let tables = tables(0);
        tables.decide(&packet(1000, 2)).unwrap();
        assert_eq!(tables.handshakes(0), [1, 0, 0, 0]);
        tables.decide(&packet(1000, 0)).unwrap();
        tables.decide(&packet(1000, 0)).unwrap();
        assert_eq!(
            tables.handshakes(0),
            [1, 0, 1, 0],
            "the second ACK follows the entry"
        );
        assert_eq!(judged(&tables, 0), ONE_COMPLETED);
    }

    #[test]
    fn the_events_ride_in_the_choice_for_the_packets_backend() {
        let tables = tables(0);
        let events = |flags| tables.decide(&packet(1000, flags)).unwrap().handshake;
        assert_eq!(events(2), event(STARTED));
        assert_eq!(events(2), event(RETRIED), "the first retry");
        assert_eq!(events(2), 0, "a second retry");
        assert_eq!(events(0), event(COMPLETED) | event(RETRIED_COMPLETED));
        assert_eq!(events(0), 0, "an established flow's packet");
        let mut counters = [0; COUNT];
        add(&mut counters, event(COMPLETED) | event(RETRIED_COMPLETED));
        add(&mut counters, event(STARTED));
        assert_eq!(counters, [1, 0, 1, 1]);
    }

    #[test]
    fn a_retried_syn_counts_once_and_its_completion_is_not_a_failure() {
        let tables = tables(0);
        for _ in 0..3 {
            tables.decide(&packet(1000, 2)).unwrap();
        }
        assert_eq!(tables.handshakes(0), [1, 1, 0, 0], "retried once per flow");
        assert_eq!(judged(&tables, 0).failed(), 1);
        tables.decide(&packet(1000, 0)).unwrap();
        assert_eq!(tables.handshakes(0), [1, 1, 1, 1]);
        assert_eq!(judged(&tables, 0), ONE_COMPLETED);
    }

    #[test]
    fn without_outlier_a_syn_sent_again_starts_a_handshake_again() {
        let tables = tables_with(0, 0);
        for _ in 0..3 {
            tables.decide(&packet(1000, 2)).unwrap();
        }
        assert_eq!(tables.handshakes(0), [3, 0, 0, 0], "no retry told apart");
        tables.decide(&packet(1000, 0)).unwrap();
        assert_eq!(tables.handshakes(0), [3, 0, 1, 0]);
        assert_eq!(judged(&tables, 0), ONE_COMPLETED, "nothing judged failed");
    }

    #[test]
    fn spoofed_syns_seen_once_are_never_judged() {
        let tables = tables(0);
        for port in 0..500 {
            tables.decide(&packet(port, 2)).unwrap();
        }
        assert_eq!(tables.handshakes(0)[STARTED as usize], 500);
        assert_eq!(judged(&tables, 0), Judged::default());
    }

    #[test]
    fn a_retry_the_table_sends_elsewhere_blames_the_first_backend_and_starts_anew() {
        let mut tables = tables(0);
        tables.decide(&packet(1000, 2)).unwrap();
        tables.maglev.insert(1, vec![1; 7]);
        tables.decide(&packet(1000, 2)).unwrap();
        tables.decide(&packet(1000, 0)).unwrap();
        assert_eq!(tables.handshakes(0), [1, 1, 0, 0]);
        assert_eq!(tables.handshakes(1), [1, 0, 1, 0]);
    }

    #[test]
    fn a_rst_completes_nothing_and_a_reused_tuple_starts_anew() {
        let tables = tables(0);
        tables.decide(&packet(1000, 2)).unwrap();
        tables.decide(&packet(1000, 4)).unwrap();
        assert_eq!(tables.handshakes(0), [1, 0, 0, 0]);
        tables.decide(&packet(1000, 0)).unwrap();
        tables.decide(&packet(1000, 2)).unwrap();
        assert_eq!(
            tables.handshakes(0),
            [2, 0, 1, 0],
            "a new connection on the tuple"
        );
    }
}
