//! Backends' TCP handshake counters (`lb_common::handshake` says when each is counted),
//! in the backend's traffic counters (`LB_BE_STATS`): only SYNs and first ACKs count, so
//! an established flow's packets never come here; the element is the one `forward`
//! counts the packet in next, so it is already in the cache.

use lb_common::handshake;

use crate::maps::LB_BACKEND_STATS;

/// Adds one to backend `backend_id`'s handshake counter `event` on this CPU.
#[inline(always)]
pub fn count(backend_id: u32, event: u32) {
    if event as usize >= handshake::COUNT {
        return;
    }
    if let Some(counters) = LB_BACKEND_STATS.get_ptr_mut(backend_id) {
        // Per-CPU memory: no other writer, no atomics needed.
        unsafe { (*counters).handshakes[event as usize] += 1 };
    }
}
