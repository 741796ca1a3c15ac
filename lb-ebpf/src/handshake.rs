//! Backends' TCP handshake counters (`lb_common::handshake` says when each is counted),
//! in the backend's counters (`LB_BE_STATS`). The packet's own backend's events come in
//! `decide`'s `Choice` and are added by `maps::count_backend` in the same write that
//! counts the packet; only a retry counted against another backend (the one the flow
//! waited on left the table) writes here, apart.

use lb_common::handshake;

use crate::maps::LB_BACKEND_STATS;

/// Adds one to backend `backend_id`'s handshake counter `event` on this CPU.
#[inline(always)]
pub fn count(backend_id: u32, event: u32) {
    if let Some(counters) = LB_BACKEND_STATS.get_ptr_mut(backend_id) {
        // Per-CPU memory: no other writer, no atomics needed.
        unsafe { handshake::add(&mut (*counters).handshakes, handshake::event(event)) };
    }
}
