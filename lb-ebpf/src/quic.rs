//! What `lb_common::decide` reads for a QUIC VIP (`lb_common::quic`): the start of the
//! UDP payload, the server-ID map, and the per-VIP QUIC counters. Nothing here runs for
//! a packet of any other VIP.

use aya_ebpf::programs::XdpContext;
use lb_common::{
    decide::Packet,
    quic::{ServerKey, WINDOW_LEN, Window},
    stat,
};

use crate::maps::{LB_QUIC_IDS, LB_QUIC_STATS};
use crate::parse::ptr_at;

/// The first `WINDOW_LEN` bytes of the packet's UDP payload, bounds-checked; None when
/// the payload is shorter (then it is no QUIC short header lb can route).
#[inline(always)]
pub fn window(ctx: &XdpContext, packet: &Packet) -> Option<Window> {
    // Masked so the verifier sees the offset bounded (it is at most 14 + 4 + 60 + 8).
    let at = (packet.payload_at & 0xff) as usize;
    if at == 0 {
        return None;
    }
    let head = ptr_at::<[u8; WINDOW_LEN]>(ctx, at).ok()? as *const u8;
    // Two byte loads, then word loads: the payload is 2-byte aligned behind a 14-byte
    // Ethernet header, which the kernel's loads allow (see `parse::load_words`).
    let mut words = [0u32; 4];
    for (i, word) in words.iter_mut().enumerate() {
        *word = unsafe { core::ptr::read(head.add(2 + 4 * i) as *const u32) };
    }
    Some(Window {
        first: unsafe { *head },
        cid_first: unsafe { *head.add(1) },
        after: unsafe { core::mem::transmute::<[u32; 4], [u8; 16]>(words) },
    })
}

/// The backend a server ID names.
#[inline(always)]
// The key goes by reference: by value, each call copies it again on the stack.
#[allow(clippy::needless_borrows_for_generic_args)]
pub fn server(key: &ServerKey) -> Option<u32> {
    unsafe { LB_QUIC_IDS.get(key) }.copied()
}

/// Adds one to VIP `vip_id`'s counter of `which` (`stat::QUIC_*`).
#[inline(always)]
pub fn count(vip_id: u32, which: u32) {
    if let Some(counters) = LB_QUIC_STATS.get_ptr_mut(vip_id) {
        let counters = unsafe { &mut *counters };
        if which == stat::QUIC_ROUTED_BY_CID {
            counters.routed_by_cid += 1;
        } else {
            counters.cid_unknown += 1;
        }
    }
}
