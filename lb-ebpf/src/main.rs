//! The XDP data path: balance packets for configured VIPs to backends by rewriting the
//! destination MAC and sending the frame back out (direct server return).
#![cfg_attr(target_arch = "bpf", no_std, no_main)]

#[cfg(target_arch = "bpf")]
mod maps;
#[cfg(target_arch = "bpf")]
mod parse;

#[cfg(target_arch = "bpf")]
mod program {
    use aya_ebpf::{bindings::xdp_action, macros::xdp, programs::XdpContext};
    use lb_common::{BACKEND_NONE, VIP_F_HASH_SRC_IP, VipKey, flow_hash, maglev_slot, stat};

    use crate::maps::{
        LB_BACKEND_STATS, LB_BACKENDS, LB_MAGLEV, LB_VIP_STATS, LB_VIPS, count, count_traffic,
    };
    use crate::parse::{Verdict, ethernet, parse};

    /// Slots per VIP table; set by the agent at load time (`lb_common::GLOBAL_MAGLEV_SIZE`).
    #[unsafe(no_mangle)]
    static MAGLEV_SIZE: u32 = lb_common::DEFAULT_MAGLEV_SIZE;

    /// The attached interface's MAC, the source of forwarded frames; set at load time.
    #[unsafe(no_mangle)]
    static IFACE_MAC: [u8; 6] = [0; 6];

    #[xdp]
    pub fn lb_xdp(ctx: XdpContext) -> u32 {
        let verdict = balance(&ctx).unwrap_or_else(|verdict| verdict);
        count(verdict.action);
        // A forwarded packet's reason is its action: count it once.
        if verdict.reason != verdict.action {
            count(verdict.reason);
        }
        verdict.action
    }

    /// `Ok` when forwarded (XDP_TX); `Err` for everything else, with its reason.
    #[inline(always)]
    fn balance(ctx: &XdpContext) -> Result<Verdict, Verdict> {
        let packet = parse(ctx)?;
        let key = VipKey {
            addr: packet.dst_addr,
            port: packet.dst_port_be,
            proto: packet.flow.proto,
            family: packet.flow.family,
        };
        let Some(vip) = (unsafe { LB_VIPS.get(key) }) else {
            return Err(Verdict::pass(stat::PASS_NOT_VIP));
        };
        // Read-only data: volatile so the compiler does not fold the compile-time
        // default in place of what the loader wrote.
        let table_size = unsafe { core::ptr::read_volatile(&MAGLEV_SIZE) };
        let hash = flow_hash(&packet.flow, vip.flags & VIP_F_HASH_SRC_IP != 0);
        let slot = vip.table_base + maglev_slot(hash, table_size);
        let backend_id = match LB_MAGLEV.get(slot) {
            Some(&id) if id != BACKEND_NONE => id,
            _ => return Err(Verdict::drop(stat::DROP_NO_BACKEND)),
        };
        let Some(backend) = LB_BACKENDS.get(backend_id) else {
            return Err(Verdict::drop(stat::DROP_NO_BACKEND));
        };

        let eth = ethernet(ctx)?;
        unsafe {
            (*eth).dst_addr = backend.mac;
            (*eth).src_addr = core::ptr::read_volatile(&IFACE_MAC);
        }

        let bytes = (ctx.data_end() - ctx.data()) as u64;
        count_traffic(&LB_VIP_STATS, vip.vip_id, bytes, packet.syn);
        count_traffic(&LB_BACKEND_STATS, backend_id, bytes, packet.syn);
        if packet.vlan {
            count(stat::SEEN_VLAN);
        }
        if packet.ipv4_options {
            count(stat::SEEN_IPV4_OPTIONS);
        }
        Ok(Verdict {
            action: xdp_action::XDP_TX,
            reason: stat::XDP_TX,
        })
    }

    /// Returns XDP_PASS. Native XDP_TX on a veth needs a program on the peer; this is it.
    #[xdp]
    pub fn xdp_pass(_ctx: XdpContext) -> u32 {
        xdp_action::XDP_PASS
    }

    /// Benchmark baseline: swap the MACs and send the frame back, nothing else.
    #[xdp]
    pub fn xdp_mac_swap(ctx: XdpContext) -> u32 {
        match ethernet(&ctx) {
            Ok(eth) => {
                unsafe { core::mem::swap(&mut (*eth).dst_addr, &mut (*eth).src_addr) };
                xdp_action::XDP_TX
            }
            Err(_) => xdp_action::XDP_DROP,
        }
    }

    #[panic_handler]
    fn panic(_info: &core::panic::PanicInfo) -> ! {
        loop {}
    }

    #[unsafe(link_section = "license")]
    #[unsafe(no_mangle)]
    static LICENSE: [u8; 4] = *b"GPL\0";
}

#[cfg(not(target_arch = "bpf"))]
fn main() {}
