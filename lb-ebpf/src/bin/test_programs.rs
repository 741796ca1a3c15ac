//! The test object `lb-test-xdp`: small programs the tests and benchmarks load beside
//! the balancer, kept out of the production object `lb-xdp` (which the `lb` binary
//! embeds) so that it holds the balancer and its maps only.
#![cfg_attr(target_arch = "bpf", no_std, no_main)]

// The panic handler and the licence.
#[cfg(target_arch = "bpf")]
use lb_ebpf as _;

#[cfg(target_arch = "bpf")]
mod program {
    use aya_ebpf::{
        bindings::xdp_action,
        macros::{map, xdp},
        maps::PerCpuArray,
        programs::XdpContext,
    };
    use lb_common::{BENCH_RECEIVED, BENCH_SENT};
    use network_types::eth::EthHdr;

    /// `lb_common::BENCH_RECEIVED` -> frames the sink saw, `BENCH_SENT` -> frames the
    /// generator sent. Per CPU, read by the benchmark.
    #[map(name = "BENCH_SINK")]
    static BENCH_SINK: PerCpuArray<u64> = PerCpuArray::with_max_entries(2, 0);

    /// Distinct source ports (flows) the generator cycles through; set at load time
    /// (`lb_common::GLOBAL_BENCH_FLOWS`).
    #[unsafe(no_mangle)]
    static BENCH_FLOWS: u64 = 16384;

    /// The Ethernet header the generator writes into every frame before it sends it;
    /// set at load time (`lb_common::GLOBAL_BENCH_ETH`); with EtherType 0 (the default,
    /// all zeroes) the frame's own is left.
    /// Live frames keep what the receiver wrote into them: on a veth a frame's page
    /// comes back to the generator's pool as the balancer left it, and a tunnel's outer
    /// headers lie where the frame's Ethernet header was.
    #[unsafe(no_mangle)]
    static BENCH_ETH: [u8; 14] = [0; 14];

    /// Returns XDP_PASS. Native XDP_TX on a veth needs a program on the peer; this is it.
    /// The packet benchmark's empty program, too.
    /// Multi-buffer aware, so the peer may have an MTU of 9000.
    #[xdp(frags)]
    pub fn xdp_pass(_ctx: XdpContext) -> u32 {
        xdp_action::XDP_PASS
    }

    /// Benchmark traffic generator: run with BPF_PROG_TEST_RUN live frames, it sends its
    /// test frame (untagged IPv4, no options, TCP or UDP) out of the interface given in
    /// the context, with the source port stepped through `BENCH_FLOWS` values so the
    /// balancer sees many flows.
    #[xdp]
    pub fn xdp_bench_tx(ctx: XdpContext) -> u32 {
        // Ethernet (14) + IPv4 (20): the source port is the first L4 field.
        const SRC_PORT_AT: usize = 14 + 20;
        let start = ctx.data();
        if start + SRC_PORT_AT + 2 > ctx.data_end() {
            return xdp_action::XDP_DROP;
        }
        // Volatile, so the compiler does not fold the default in place of what the
        // loader wrote.
        let flows = unsafe { core::ptr::read_volatile(&BENCH_FLOWS) }.clamp(1, 64512);
        // checked: a plain `%` by a variable carries a panic path the verifier rejects.
        let port = 1024 + bump(BENCH_SENT).checked_rem(flows).unwrap_or(0) as u16;
        unsafe {
            let eth = core::ptr::read_volatile(&BENCH_ETH);
            if eth[12] | eth[13] != 0 {
                core::ptr::write_unaligned(start as *mut [u8; 14], eth);
            }
            core::ptr::write_unaligned((start + SRC_PORT_AT) as *mut [u8; 2], port.to_be_bytes())
        };
        xdp_action::XDP_TX
    }

    /// Benchmark sink: counts every frame (`BENCH_SINK`, per CPU) and drops it.
    #[xdp]
    pub fn xdp_bench_sink(_ctx: XdpContext) -> u32 {
        bump(BENCH_RECEIVED);
        xdp_action::XDP_DROP
    }

    /// Benchmark baseline: swap the MACs and send the frame back, nothing else.
    #[xdp]
    pub fn xdp_mac_swap(ctx: XdpContext) -> u32 {
        let start = ctx.data();
        if start + EthHdr::LEN > ctx.data_end() {
            return xdp_action::XDP_DROP;
        }
        let eth = start as *mut EthHdr;
        unsafe { core::mem::swap(&mut (*eth).dst_addr, &mut (*eth).src_addr) };
        xdp_action::XDP_TX
    }

    /// Adds one to `BENCH_SINK[index]` on this CPU and returns the new count.
    #[inline(always)]
    fn bump(index: u32) -> u64 {
        match BENCH_SINK.get_ptr_mut(index) {
            Some(counter) => unsafe {
                *counter += 1;
                *counter
            },
            None => 0,
        }
    }
}

#[cfg(not(target_arch = "bpf"))]
fn main() {}
