//! Which interface a forwarded frame leaves by (`dataplane.interfaces`). With one
//! interface (`EGRESS_COUNT` <= 1) nothing here is read: the frame goes back out where it
//! came in (XDP_TX) with `IFACE_MAC` as its source, as it always did. With several, the
//! agent writes for every backend the egress index of the interface that reaches it or
//! its next hop (`LB_BE_EGRESS`), and for every index the interface and its MAC
//! (`LB_EGRESS`, `LB_TX_PORTS`): the frame then leaves by XDP_TX when that interface is
//! the one it arrived on, else by XDP_REDIRECT through the DEVMAP.

use aya_ebpf::programs::XdpContext;
use lb_common::{EgressInfo, decide::Verdict, stat};

use crate::maps::{LB_BACKEND_EGRESS, LB_EGRESS, LB_EGRESS_STATS, LB_TX_PORTS, count_traffic};

/// How many interfaces the program is attached to (`lb_common::GLOBAL_EGRESS_COUNT`).
#[unsafe(no_mangle)]
static EGRESS_COUNT: u32 = 0;

/// The interface a backend's frames leave by.
///
/// Every field is defined in every case, one interface included (`info` None, `index`
/// 0): as an `Option<Port>`, the one-interface case left `index` undefined, and LLVM
/// may spill such a register, which the verifier refuses to read (it did when the
/// program was built for BPF CPU v3).
pub struct Port {
    index: u32,
    /// None: one interface, so the frame goes back out where it came in.
    info: Option<&'static EgressInfo>,
}

impl Port {
    /// Writes the interface's MAC at `source` (the frame's source address) in two words:
    /// a `[u8; 6]` copy from map to packet compiles to a byte-wise `memmove` call.
    /// Returns false, writing nothing, with one interface: the caller writes its own.
    #[inline(always)]
    pub fn write_source(&self, source: *mut u8) -> bool {
        let Some(info) = self.info else {
            return false;
        };
        let mac = info.mac.as_ptr();
        unsafe {
            (source as *mut u32).write_unaligned((mac as *const u32).read_unaligned());
            (source.add(4) as *mut u16)
                .write_unaligned((mac.add(4) as *const u16).read_unaligned());
        }
        true
    }
}

/// Where frames to backend `backend_id` leave: the interface they came in by with one
/// interface (XDP_TX, as always); Err when the backend's interface is gone.
#[inline(always)]
pub fn port_of(backend_id: u32) -> Result<Port, Verdict> {
    if unsafe { core::ptr::read_volatile(&EGRESS_COUNT) } <= 1 {
        return Ok(Port {
            index: 0,
            info: None,
        });
    }
    let no_egress = Verdict::drop(stat::DROP_NO_EGRESS);
    let index = *LB_BACKEND_EGRESS.get(backend_id).ok_or(no_egress)?;
    let info = LB_EGRESS.get(index).ok_or(no_egress)?;
    if info.ifindex == 0 {
        return Err(no_egress);
    }
    Ok(Port {
        index,
        info: Some(info),
    })
}

/// Sends the frame (its MACs written) out of `port`: XDP_TX when it is the interface the
/// frame came in by (always, with one interface), else XDP_REDIRECT; counted for the
/// interface when there are several.
#[inline(always)]
pub fn send(ctx: &XdpContext, port: &Port, bytes: u64, new_flow: bool) -> Verdict {
    let Some(info) = port.info else {
        return Verdict::tx(stat::XDP_TX);
    };
    let ingress = unsafe { (*ctx.ctx).ingress_ifindex };
    let verdict = if info.ifindex == ingress {
        Verdict::tx(stat::XDP_TX)
    } else {
        match LB_TX_PORTS.redirect(port.index, 0) {
            Ok(action) => Verdict {
                action,
                reason: stat::XDP_REDIRECT,
            },
            Err(_) => return Verdict::drop(stat::DROP_NO_EGRESS),
        }
    };
    count_traffic(&LB_EGRESS_STATS, port.index, bytes, new_flow);
    verdict
}
