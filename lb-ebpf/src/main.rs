//! The XDP data path: balance packets for configured VIPs to backends by rewriting the
//! destination MAC and sending the frame back out (direct server return).
#![cfg_attr(target_arch = "bpf", no_std, no_main)]

// The panic handler and the licence.
#[cfg(target_arch = "bpf")]
use lb_ebpf as _;

#[cfg(target_arch = "bpf")]
mod egress;
#[cfg(target_arch = "bpf")]
mod encap;
#[cfg(target_arch = "bpf")]
mod handshake;
#[cfg(target_arch = "bpf")]
mod maps;
#[cfg(target_arch = "bpf")]
mod next;
#[cfg(target_arch = "bpf")]
mod parse;
#[cfg(target_arch = "bpf")]
mod quic;
#[cfg(target_arch = "bpf")]
mod too_big;

#[cfg(target_arch = "bpf")]
mod program {
    use core::{
        ops::{Deref, DerefMut},
        ptr::NonNull,
    };

    use aya_ebpf::{
        helpers::{bpf_xdp_get_buff_len, bpf_xdp_load_bytes},
        macros::xdp,
        maps::PerCpuArray,
        programs::XdpContext,
    };
    use lb_common::{
        BACKEND_NONE, BackendInfo, CAPTURE_BYTES, CaptureRecord, Embryo, FORWARD_L2, FlowEntry,
        FlowKey, FlowTuple, RateWindow, VIP_SLOT_SHARED, VIP_SLOT_USED, VipInfo, VipKey, VipSlot,
        decide::{Choice, Packet, Tables, Verdict, decide},
        flow::Lookup,
        quic::{ServerKey, Window},
        stat,
    };

    use crate::maps::{
        Cpu, LB_BACKENDS, LB_CAPTURE, LB_CAPTURE_WIN, LB_CONNTRACK, LB_EMBRYONIC, LB_FLOOD,
        LB_MAGLEV, LB_SCRATCH, LB_TUNNEL, LB_VIP_SLOTS, LB_VIP_STATS, LB_VIPS, Stats,
        count_backend, count_source, count_traffic, export_flow, hot_source,
    };
    use crate::parse::{ethernet, parse};
    use crate::{egress, encap, next, quic, too_big};

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
    static SOURCE_SAMPLE: u32 = lb_common::DEFAULT_SOURCE_SAMPLE;

    /// Debug captures per second per CPU; 0: off (`lb_common::GLOBAL_CAPTURE_RATE`).
    #[unsafe(no_mangle)]
    static CAPTURE_RATE: u64 = 0;

    // Multi-buffer aware (section `xdp.frags`): the program reads only headers, which are
    // in the first buffer, so it may attach above a page-sized MTU (9000) natively.
    #[xdp(frags)]
    pub fn lb_xdp(ctx: XdpContext) -> u32 {
        run(&ctx)
    }

    /// The same program, not multi-buffer aware: loaded instead of `lb_xdp` when
    /// `dataplane.next_program` is not (the kernel tail-calls only between programs
    /// that agree on it).
    #[xdp]
    pub fn lb_xdp_1buf(ctx: XdpContext) -> u32 {
        run(&ctx)
    }

    /// Balances or passes the frame and counts what it did; a pass goes on to the
    /// host's next program, if one is configured.
    #[inline(always)]
    fn run(ctx: &XdpContext) -> u32 {
        let stats = Stats::get();
        let verdict = balance(ctx, &stats).unwrap_or_else(|verdict| verdict);
        stats.count(verdict.action);
        // A forwarded packet's reason is its action: count it once.
        if verdict.reason != verdict.action {
            stats.count(verdict.reason);
        }
        next::pass_on(ctx, verdict.action)
    }

    /// `Ok` when forwarded (XDP_TX); `Err` for everything else, with its reason. Where
    /// a packet goes is `lb_common::decide`'s, which `lb explain` and the differential
    /// test run too; this program only parses and sends.
    #[inline(always)]
    fn balance(ctx: &XdpContext, stats: &Stats) -> Result<Verdict, Verdict> {
        let packet = parse(ctx)?;
        // One place that sends: `forward` (and the tunnels' code it calls) inlined once,
        // not at every decision.
        let choice = decide(&Kernel { ctx, stats }, &packet)?;
        forward(ctx, stats, &packet, &choice)
    }

    /// What `lb_common::decide` reads and writes: this program's maps, globals and
    /// per-CPU state.
    struct Kernel<'a> {
        ctx: &'a XdpContext,
        stats: &'a Stats,
    }

    /// An element of a map, read and written in place.
    struct InMap<T>(NonNull<T>);

    impl<T> InMap<T> {
        #[inline(always)]
        fn new(element: *mut T) -> Option<Self> {
            NonNull::new(element).map(Self)
        }
    }

    impl<T> Deref for InMap<T> {
        type Target = T;
        #[inline(always)]
        fn deref(&self) -> &T {
            unsafe { self.0.as_ref() }
        }
    }

    impl<T> DerefMut for InMap<T> {
        #[inline(always)]
        fn deref_mut(&mut self) -> &mut T {
            unsafe { self.0.as_mut() }
        }
    }

    impl Lookup for Kernel<'_> {
        #[inline(always)]
        fn backend(&self, id: u32) -> Option<&BackendInfo> {
            LB_BACKENDS.get(id)
        }

        #[inline(always)]
        fn udp_idle_ns(&self) -> u64 {
            read(&UDP_IDLE_NS)
        }
    }

    // Keys go to the maps by reference: by value, each call copies them again on the stack.
    #[allow(clippy::needless_borrows_for_generic_args)]
    impl Tables for Kernel<'_> {
        type Entry = InMap<FlowEntry>;
        type Embryo = InMap<Embryo>;

        #[inline(always)]
        fn vip(&self, key: &VipKey) -> Option<VipInfo> {
            vip_of(key)
        }

        #[inline(always)]
        fn now_ns(&self) -> u64 {
            Cpu::get().now_ns()
        }

        // Built in this CPU's scratch slot, not on the stack: the balancer and the
        // tunnels' functions share 512 bytes of stack.
        #[inline(always)]
        fn flow_key(&self, packet: &Packet) -> Option<&FlowKey> {
            let scratch = LB_SCRATCH.get_ptr_mut(0)?;
            unsafe {
                (*scratch).key = packet.flow_key();
                Some(&(*scratch).key)
            }
        }

        #[inline(always)]
        fn flow(&self, key: &FlowKey) -> Option<InMap<FlowEntry>> {
            InMap::new(LB_CONNTRACK.get_ptr_mut(key)?)
        }

        #[inline(always)]
        fn embryo(&self, index: u32) -> Option<InMap<Embryo>> {
            InMap::new(LB_EMBRYONIC.get_ptr_mut(index)?)
        }

        #[inline(always)]
        fn flow_tuple(&self, packet: &Packet) -> Option<&FlowTuple> {
            let scratch = LB_SCRATCH.get_ptr_mut(0)?;
            unsafe {
                (*scratch).tuple = packet.flow_tuple();
                Some(&(*scratch).tuple)
            }
        }

        #[inline(always)]
        fn is_hot_source(&self, vip_id: u32, packet: &Packet) -> bool {
            hot_source(vip_id, packet.src_addr, packet.family)
        }

        #[inline(always)]
        fn maglev_size(&self) -> u32 {
            read(&MAGLEV_SIZE)
        }

        #[inline(always)]
        fn maglev(&self, vip: &VipInfo, table_size: u32, slot: u32) -> u32 {
            let index = vip.table_base(table_size) + slot;
            LB_MAGLEV.get(index).copied().unwrap_or(BACKEND_NONE)
        }

        #[inline(always)]
        fn count(&self, stat: u32) {
            self.stats.count(stat);
        }

        #[inline(always)]
        fn insert_allowed(&self, now: u64) -> bool {
            let limit = read(&CT_INSERT_LIMIT);
            limit == 0 || within_rate(&LB_FLOOD, limit, now)
        }

        #[inline(always)]
        fn insert_flow(&self, key: &FlowKey, entry: &FlowEntry) -> bool {
            LB_CONNTRACK.insert(key, entry, 0).is_ok()
        }

        #[inline(always)]
        fn export_flow(&self, key: &FlowKey, entry: &FlowEntry) {
            export_flow(self.stats, key, entry);
        }

        /// Counted for heavy hitters, sampled: one new flow in SOURCE_SAMPLE is counted,
        /// with that weight, so most new flows skip the map. A TCP flow counts once its
        /// handshake completes, so spoofed SYNs, which would each insert a new source
        /// into the map, neither cost that nor crowd the real sources out.
        #[inline(always)]
        fn new_source(&self, vip_id: u32, packet: &Packet) {
            let sample = read(&SOURCE_SAMPLE).max(1);
            if Cpu::get().one_in(sample) {
                let weight = sample as u64;
                count_source(vip_id, packet.src_addr, packet.family, weight);
            }
        }

        #[inline(always)]
        fn capture(&self, now: u64) {
            capture(self.ctx, self.stats, now);
        }

        #[inline(always)]
        fn count_handshake(&self, backend_id: u32, event: u32) {
            crate::handshake::count(backend_id, event);
        }

        #[inline(always)]
        fn quic_window(&self, packet: &Packet) -> Option<Window> {
            quic::window(self.ctx, packet)
        }

        #[inline(always)]
        fn quic_server(&self, key: &ServerKey) -> Option<u32> {
            quic::server(key)
        }

        #[inline(always)]
        fn count_quic(&self, vip_id: u32, which: u32) {
            quic::count(vip_id, which);
        }
    }

    /// The VIP of `key`: from the VIP slot it hashes to, after one array read, or from
    /// `LB_VIPS` when the slot is shared (several keys hash there) or was being
    /// rewritten; None for a key that is no VIP's, whatever connection-table entries it
    /// left.
    #[inline(always)]
    // Keys go to the maps by reference: by value, each call copies them again.
    #[allow(clippy::needless_borrows_for_generic_args)]
    fn vip_of(key: &VipKey) -> Option<VipInfo> {
        let live = LB_VIP_SLOTS.get(VipSlot::index(key))? as *const VipSlot as *const u64;
        // Read twice: a copy that differs from the second reading (the agent rewrote
        // the slot meanwhile) may mix two VIPs and is not trusted; LB_VIPS decides, as
        // for a shared slot.
        let mut words = [0u64; 5];
        for (i, word) in words.iter_mut().enumerate() {
            *word = unsafe { core::ptr::read_volatile(live.add(i)) };
        }
        let mut changed = 0;
        for (i, word) in words.iter().enumerate() {
            changed |= unsafe { core::ptr::read_volatile(live.add(i)) } ^ word;
        }
        // Read in place, not copied again: the stack is short.
        let slot = unsafe { &*(words.as_ptr() as *const VipSlot) };
        if changed == 0 && slot.state == VIP_SLOT_USED {
            return slot.key.same(key).then_some(VipInfo {
                vip_id: slot.vip_id,
                generation: slot.generation,
                flags: slot.flags,
                _pad: 0,
            });
        }
        let shared = slot.state & VIP_SLOT_USED != 0 && slot.state & VIP_SLOT_SHARED != 0;
        if changed == 0 && !shared {
            return None;
        }
        // A copy: the map's element may be reused for a new value while we run.
        unsafe { LB_VIPS.get(key) }.copied()
    }

    /// Sends the frame to `backend`: its MAC as destination, ours as source, and counts
    /// it for the VIP and the backend. A tunnelled backend's frame is first wrapped in
    /// the outer headers (`encap`), or answered when it would then be too big.
    #[inline(always)]
    fn forward(
        ctx: &XdpContext,
        stats: &Stats,
        packet: &Packet,
        choice: &Choice,
    ) -> Result<Verdict, Verdict> {
        let Choice {
            vip_id,
            backend_id,
            new_flow,
            handshake,
            ..
        } = *choice;
        // Read where it is, not copied: each decision above passes on only the id.
        let Some(backend) = LB_BACKENDS.get(backend_id) else {
            return Err(Verdict::drop(stat::DROP_NO_BACKEND));
        };
        // Before any tunnel header is added: a frame with nowhere to go is not wrapped.
        let port = egress::port_of(backend_id)?;
        // As the client sent it: the same for every way of forwarding.
        let bytes = frame_len(ctx);
        // L2 first and alone: the common case pays one compare.
        if backend.forward != FORWARD_L2 {
            let mut outcome = encap::tunnel(XdpContext::new(ctx.ctx), packet, backend);
            if outcome == stat::TX_ICMP_TOO_BIG {
                outcome = too_big::answer(XdpContext::new(ctx.ctx), packet, backend);
            }
            match outcome {
                stat::TX_IPIP | stat::TX_GUE => stats.count(outcome),
                // The frame is the answer now, to the client.
                stat::TX_ICMP_TOO_BIG => {
                    return Err(Verdict::tx(outcome));
                }
                _ => return Err(Verdict::drop(outcome)),
            }
        }
        let eth = ethernet(ctx)?;
        unsafe {
            // In two words, not as a `[u8; 6]` copy: the compiler cannot tell the map
            // value from the packet, and copies one into the other with a call to a
            // byte-wise `memmove`.
            let mac = backend.mac.as_ptr();
            let dst = (*eth).dst_addr.as_mut_ptr();
            (dst as *mut u32).write_unaligned((mac as *const u32).read_unaligned());
            (dst.add(4) as *mut u16).write_unaligned((mac.add(4) as *const u16).read_unaligned());
            if !port.write_source((*eth).src_addr.as_mut_ptr()) {
                (*eth).src_addr = core::ptr::read_volatile(&IFACE_MAC);
            }
        }
        count_traffic(&LB_VIP_STATS, vip_id, bytes, new_flow);
        count_backend(backend_id, bytes, new_flow, handshake);
        if packet.vlan {
            stats.count(stat::SEEN_VLAN);
        }
        if packet.ipv4_options {
            stats.count(stat::SEEN_IPV4_OPTIONS);
        }
        Ok(egress::send(ctx, &port, bytes, new_flow))
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
        let len = frame_len(ctx) as u32;
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
    fn within_rate(window: &PerCpuArray<RateWindow>, limit: u64, now: u64) -> bool {
        let Some(window) = window.get_ptr_mut(0) else {
            return true;
        };
        let window = unsafe { &mut *window };
        if now.saturating_sub(window.start_ns) >= 1_000_000_000 {
            window.start_ns = now;
            window.events = 0;
        }
        if window.events >= limit {
            return false;
        }
        window.events += 1;
        true
    }

    /// The whole frame's length: with multi-buffer frames `data_end` ends the first
    /// buffer only, so the kernel is asked, unless the agent said every frame is in one
    /// buffer (`TunnelConfig::linear_frames`): the helper call, with its return through
    /// the CPU's return-stack mitigations, cost 5-20 ns of an established packet's
    /// 75-110 here.
    #[inline(always)]
    fn frame_len(ctx: &XdpContext) -> u64 {
        if LB_TUNNEL
            .get(0)
            .is_some_and(|config| config.linear_frames != 0)
        {
            return (ctx.data_end() - ctx.data()) as u64;
        }
        unsafe { bpf_xdp_get_buff_len(ctx.ctx) }
    }

    /// Reads a load-time global. Volatile, so the compiler does not fold the default in
    /// place of what the loader wrote.
    #[inline(always)]
    fn read<T: Copy>(global: &T) -> T {
        unsafe { core::ptr::read_volatile(global) }
    }
}

#[cfg(not(target_arch = "bpf"))]
fn main() {}
