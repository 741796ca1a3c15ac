//! The XDP data path: balance packets for configured VIPs to backends by rewriting the
//! destination MAC and sending the frame back out (direct server return).
#![cfg_attr(target_arch = "bpf", no_std, no_main)]

#[cfg(target_arch = "bpf")]
mod maps;
#[cfg(target_arch = "bpf")]
mod parse;

#[cfg(target_arch = "bpf")]
mod program {
    use aya_ebpf::{
        bindings::xdp_action,
        helpers::{bpf_get_prandom_u32, bpf_ktime_get_coarse_ns, bpf_xdp_load_bytes},
        macros::xdp,
        maps::PerCpuArray,
        programs::XdpContext,
    };
    use lb_common::{
        BACKEND_F_SERVES_FLOWS, BACKEND_NONE, BackendInfo, CAPTURE_BYTES, CaptureRecord,
        FLOW_F_CLOSING, FlowEntry, FlowKey, InsertWindow, LAST_SEEN_GRANULARITY_NS, PROTO_UDP,
        VIP_F_HASH_SRC_IP, VipInfo, VipKey, flow_hash, maglev_slot, stat,
    };

    use crate::maps::{
        LB_BACKEND_STATS, LB_BACKENDS, LB_CAPTURE, LB_CAPTURE_WIN, LB_CONNTRACK, LB_FLOOD,
        LB_MAGLEV, LB_VIP_STATS, LB_VIPS, Stats, count_sink, count_source, count_traffic,
        next_sink_sequence,
    };
    use crate::parse::{Packet, Verdict, ethernet, parse};

    /// Slots per VIP table; set by the agent at load time (`lb_common::GLOBAL_MAGLEV_SIZE`).
    #[unsafe(no_mangle)]
    static MAGLEV_SIZE: u32 = lb_common::DEFAULT_MAGLEV_SIZE;

    /// The attached interface's MAC, the source of forwarded frames; set at load time.
    #[unsafe(no_mangle)]
    static IFACE_MAC: [u8; 6] = [0; 6];

    /// Idle time after which a UDP flow's entry is ignored (`lb_common::GLOBAL_UDP_IDLE_NS`).
    #[unsafe(no_mangle)]
    static UDP_IDLE_NS: u64 = 30_000_000_000;

    /// Inserts per second per CPU; 0: unlimited (`lb_common::GLOBAL_CT_INSERT_LIMIT`).
    #[unsafe(no_mangle)]
    static CT_INSERT_LIMIT: u64 = 0;

    /// Ethernet + IPv4 + TCP without options: what a short captured frame keeps.
    const CAPTURE_HEADERS: u32 = 14 + 20 + 20;

    /// One new flow in this many is counted for heavy hitters (`GLOBAL_SOURCE_SAMPLE`).
    #[unsafe(no_mangle)]
    static SOURCE_SAMPLE: u32 = 8;

    /// Debug captures per second per CPU; 0: off (`lb_common::GLOBAL_CAPTURE_RATE`).
    #[unsafe(no_mangle)]
    static CAPTURE_RATE: u64 = 0;

    #[xdp]
    pub fn lb_xdp(ctx: XdpContext) -> u32 {
        let stats = Stats::get();
        let verdict = balance(&ctx, &stats).unwrap_or_else(|verdict| verdict);
        stats.count(verdict.action);
        // A forwarded packet's reason is its action: count it once.
        if verdict.reason != verdict.action {
            stats.count(verdict.reason);
        }
        verdict.action
    }

    /// `Ok` when forwarded (XDP_TX); `Err` for everything else, with its reason.
    #[inline(always)]
    fn balance(ctx: &XdpContext, stats: &Stats) -> Result<Verdict, Verdict> {
        let packet = parse(ctx)?;
        let vip_key = VipKey {
            addr: packet.dst_addr,
            port: packet.dst_port_be,
            proto: packet.flow.proto,
            family: packet.flow.family,
        };
        // A copy: the map's element may be reused for a new value while we run.
        let Some(vip) = (unsafe { LB_VIPS.get(vip_key) }).copied() else {
            return Err(Verdict::pass(stat::PASS_NOT_VIP));
        };
        let (backend_id, backend, new_flow) = choose_backend(ctx, stats, &packet, &vip)?;

        let eth = ethernet(ctx)?;
        unsafe {
            (*eth).dst_addr = backend.mac;
            (*eth).src_addr = core::ptr::read_volatile(&IFACE_MAC);
        }

        let bytes = (ctx.data_end() - ctx.data()) as u64;
        count_traffic(&LB_VIP_STATS, vip.vip_id, bytes, new_flow);
        count_traffic(&LB_BACKEND_STATS, backend_id, bytes, new_flow);
        // Heavy hitters are sampled: one new flow in SOURCE_SAMPLE is counted, with that
        // weight, so most new flows skip the map.
        if new_flow {
            let sample = read(&SOURCE_SAMPLE).max(1);
            if unsafe { bpf_get_prandom_u32() } % sample == 0 {
                let weight = sample as u64;
                count_source(vip.vip_id, packet.src_addr, packet.flow.family, weight);
            }
        }
        if packet.vlan {
            stats.count(stat::SEEN_VLAN);
        }
        if packet.ipv4_options {
            stats.count(stat::SEEN_IPV4_OPTIONS);
        }
        Ok(Verdict {
            action: xdp_action::XDP_TX,
            reason: stat::XDP_TX,
        })
    }

    /// The flow's backend: a TCP SYN always takes the Maglev table (and (re)creates its
    /// entry); other packets follow their connection-table entry while its backend still
    /// serves flows (and, for UDP, while it is not idle-expired), else take the table.
    #[inline(always)]
    /// Returns the backend's id and entry, and whether this packet starts a new flow (a
    /// SYN, or a UDP packet without a live entry).
    fn choose_backend(
        ctx: &XdpContext,
        stats: &Stats,
        packet: &Packet,
        vip: &VipInfo,
    ) -> Result<(u32, BackendInfo, bool), Verdict> {
        // Coarse (jiffies) time: entries age in seconds, and it costs no clock read.
        let now = unsafe { bpf_ktime_get_coarse_ns() };
        let key = FlowKey {
            src: packet.src_addr,
            dst: packet.dst_addr,
            src_port: packet.src_port_be,
            dst_port: packet.dst_port_be,
            proto: packet.flow.proto,
            family: packet.flow.family,
            _pad: [0; 2],
        };
        let udp = packet.flow.proto == PROTO_UDP;
        let closing = packet.fin || packet.rst;
        let new_flow;
        if !packet.syn
            && let Some(entry) = LB_CONNTRACK.get_ptr_mut(key)
        {
            let entry = unsafe { &mut *entry };
            let idle_expired = udp && now.saturating_sub(entry.last_seen_ns) > read(&UDP_IDLE_NS);
            if !idle_expired
                && let Some(backend) = LB_BACKENDS.get(entry.backend_id)
                && backend.flags & BACKEND_F_SERVES_FLOWS != 0
            {
                if now.saturating_sub(entry.last_seen_ns) > LAST_SEEN_GRANULARITY_NS {
                    entry.last_seen_ns = now;
                }
                if closing && entry.flags & FLOW_F_CLOSING == 0 {
                    entry.flags |= FLOW_F_CLOSING;
                }
                stats.count(stat::CT_HIT);
                return Ok((entry.backend_id, *backend, false));
            }
            stats.count(if idle_expired {
                stat::CT_MISS_UDP
            } else {
                stat::CT_REHASH
            });
            new_flow = idle_expired;
        } else {
            new_flow = packet.syn || udp;
            stats.count(if packet.syn {
                stat::CT_MISS_SYN
            } else if udp {
                stat::CT_MISS_UDP
            } else {
                stat::CT_MISS_NON_SYN
            });
            if !packet.syn && !udp {
                capture(ctx, stats, now);
            }
        }

        let table_size = read(&MAGLEV_SIZE);
        let hash = flow_hash(&packet.flow, vip.flags & VIP_F_HASH_SRC_IP != 0);
        let slot = vip.table_base + maglev_slot(hash, table_size);
        let backend_id = match LB_MAGLEV.get(slot) {
            Some(&id) if id != BACKEND_NONE => id,
            _ => return Err(Verdict::drop(stat::DROP_NO_BACKEND)),
        };
        let Some(backend) = LB_BACKENDS.get(backend_id) else {
            return Err(Verdict::drop(stat::DROP_NO_BACKEND));
        };
        if !packet.rst {
            if may_insert(stats, now) {
                let entry = FlowEntry {
                    backend_id,
                    flags: if closing { FLOW_F_CLOSING } else { 0 },
                    last_seen_ns: now,
                };
                if LB_CONNTRACK.insert(key, entry, 0).is_ok() {
                    stats.count(stat::CT_CREATED);
                }
            } else if packet.syn {
                // A SYN that may not insert must not leave an older connection's entry
                // (same 5-tuple, maybe another backend) for the packets that follow it.
                let _ = LB_CONNTRACK.remove(key);
            }
        }
        Ok((backend_id, *backend, new_flow))
    }

    /// Copies the frame's first `CAPTURE_BYTES` to the debug capture, at most
    /// `CAPTURE_RATE` per second on this CPU.
    #[inline(always)]
    fn capture(ctx: &XdpContext, stats: &Stats, now: u64) {
        let rate = read(&CAPTURE_RATE);
        if rate == 0 || !within_rate(&LB_CAPTURE_WIN, rate, now) {
            return;
        }
        // Constant copy lengths only: the verifier cannot follow a variable one through
        // the helper call. Frames shorter than CAPTURE_BYTES keep their headers.
        let len = (ctx.data_end() - ctx.data()) as u32;
        let caplen = if len as usize >= CAPTURE_BYTES {
            CAPTURE_BYTES as u32
        } else if len >= CAPTURE_HEADERS {
            CAPTURE_HEADERS
        } else {
            return;
        };
        let Some(mut entry) = LB_CAPTURE.reserve::<CaptureRecord>(0) else {
            return;
        };
        let record = entry.as_mut_ptr();
        let copied = unsafe {
            (*record).ts_ns = now;
            (*record).len = len;
            (*record).caplen = caplen;
            let data = core::ptr::addr_of_mut!((*record).data) as *mut core::ffi::c_void;
            bpf_xdp_load_bytes(ctx.ctx, 0, data, caplen)
        };
        if copied != 0 {
            entry.discard(0);
            return;
        }
        entry.submit(0);
        stats.count(stat::CAPTURED);
    }

    /// Whether one more event fits in this CPU's `limit` per second, counted in `window`.
    #[inline(always)]
    fn within_rate(window: &PerCpuArray<InsertWindow>, limit: u64, now: u64) -> bool {
        let Some(window) = window.get_ptr_mut(0) else {
            return true;
        };
        let window = unsafe { &mut *window };
        if now.saturating_sub(window.start_ns) >= 1_000_000_000 {
            window.start_ns = now;
            window.inserts = 0;
        }
        if window.inserts >= limit {
            return false;
        }
        window.inserts += 1;
        true
    }

    /// The flood guard: at most `CT_INSERT_LIMIT` inserts per second on this CPU, so a
    /// SYN flood cannot evict every established flow from the LRU.
    #[inline(always)]
    fn may_insert(stats: &Stats, now: u64) -> bool {
        let limit = read(&CT_INSERT_LIMIT);
        if limit == 0 || within_rate(&LB_FLOOD, limit, now) {
            return true;
        }
        stats.count(stat::CT_INSERT_SKIPPED);
        false
    }

    /// Reads a load-time global. Volatile, so the compiler does not fold the default in
    /// place of what the loader wrote.
    #[inline(always)]
    fn read<T: Copy>(global: &T) -> T {
        unsafe { core::ptr::read_volatile(global) }
    }

    /// Returns XDP_PASS. Native XDP_TX on a veth needs a program on the peer; this is it.
    #[xdp]
    pub fn xdp_pass(_ctx: XdpContext) -> u32 {
        xdp_action::XDP_PASS
    }

    /// Benchmark traffic generator: run with BPF_PROG_TEST_RUN live frames, it sends its
    /// test frame (untagged IPv4, no options, TCP or UDP) out of the interface given in
    /// the context, with the source port stepped through `BENCH_PORTS` values so the
    /// balancer sees many flows.
    #[xdp]
    pub fn xdp_bench_tx(ctx: XdpContext) -> u32 {
        // Ethernet (14) + IPv4 (20): the source port is the first L4 field.
        const SRC_PORT_AT: usize = 14 + 20;
        let start = ctx.data();
        if start + SRC_PORT_AT + 2 > ctx.data_end() {
            return xdp_action::XDP_DROP;
        }
        let port = 1024 + (next_sink_sequence() % BENCH_PORTS) as u16;
        unsafe {
            core::ptr::write_unaligned((start + SRC_PORT_AT) as *mut [u8; 2], port.to_be_bytes())
        };
        xdp_action::XDP_TX
    }

    /// Distinct source ports the generator cycles through.
    const BENCH_PORTS: u64 = 16384;

    /// Benchmark sink: counts every frame (`BENCH_SINK`, per CPU) and drops it.
    #[xdp]
    pub fn xdp_bench_sink(_ctx: XdpContext) -> u32 {
        count_sink();
        xdp_action::XDP_DROP
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
