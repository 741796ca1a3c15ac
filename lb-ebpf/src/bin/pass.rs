//! The object `lb-pass` (`lb peer attach`, and `/usr/lib/lb/xdp-pass.o` for iproute2): one
//! XDP program that passes every frame. Native XDP_TX on a veth drops the frames unless
//! the peer has an XDP program of its own; this is one, and nothing more: no maps, so
//! loaders other than aya take it too. Multi-buffer aware (`xdp.frags`), so the peer may
//! have an MTU of 9000.
#![cfg_attr(target_arch = "bpf", no_std, no_main)]

// The panic handler and the licence.
#[cfg(target_arch = "bpf")]
use lb_ebpf as _;

#[cfg(target_arch = "bpf")]
mod program {
    use aya_ebpf::{bindings::xdp_action, macros::xdp, programs::XdpContext};

    #[xdp(frags)]
    pub fn xdp_pass(_ctx: XdpContext) -> u32 {
        xdp_action::XDP_PASS
    }
}

#[cfg(not(target_arch = "bpf"))]
fn main() {}
