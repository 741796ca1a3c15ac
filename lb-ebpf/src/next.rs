//! The frames lb passes go on to the host's own XDP program (`dataplane.next_program`,
//! a host firewall), by tail call through `LB_NEXT`: lb takes the VIP traffic, the
//! host's program judges the rest as if it were alone on the hook.

use aya_ebpf::{bindings::xdp_action, programs::XdpContext};

use crate::maps::LB_NEXT;

/// `action`, the program's verdict for the frame, except that a pass is first handed
/// to the program in `LB_NEXT`'s slot 0: a tail call, which does not return when it
/// succeeds (that program's verdict is the frame's). An empty slot passes the frame to
/// the kernel, as without a next program.
#[inline(always)]
pub fn pass_on(ctx: &XdpContext, action: u32) -> u32 {
    if action == xdp_action::XDP_PASS {
        // SAFETY: `ctx` is this program's context; the slot holds an XDP program the
        // kernel checked for compatibility when the agent wrote it.
        unsafe { LB_NEXT.tail_call(ctx, 0) };
    }
    action
}
