//! The XDP data path: balance packets for configured VIPs to backends by rewriting the
//! destination MAC and sending the frame back out (direct server return).
#![cfg_attr(target_arch = "bpf", no_std, no_main)]

// The panic handler and the licence.
#[cfg(target_arch = "bpf")]
use lb_ebpf as _;

#[cfg(target_arch = "bpf")]
mod encap;
#[cfg(target_arch = "bpf")]
mod maps;
#[cfg(target_arch = "bpf")]
mod parse;
#[cfg(target_arch = "bpf")]
mod too_big;

#[cfg(target_arch = "bpf")]
mod program {
    use aya_ebpf::{
        bindings::xdp_action,
        helpers::{bpf_xdp_get_buff_len, bpf_xdp_load_bytes},
        macros::xdp,
        maps::PerCpuArray,
        programs::XdpContext,
    };
    use lb_common::{
        BACKEND_NONE, BackendInfo, CAPTURE_BYTES, CaptureRecord, FORWARD_L2, FlowKey, PROTO_UDP,
        RateWindow, VIP_F_HASH_SRC_IP, VIP_SLOT_SHARED, VIP_SLOT_USED, VipInfo, VipKey, VipSlot,
        flow::{self, Lookup},
        flow_hash, maglev_slot, stat,
    };

    use crate::maps::{
        Cpu, LB_BACKEND_STATS, LB_BACKENDS, LB_CAPTURE, LB_CAPTURE_WIN, LB_CONNTRACK, LB_FLOOD,
        LB_MAGLEV, LB_VIP_SLOTS, LB_VIP_STATS, LB_VIPS, Stats, count_source, count_traffic,
    };
    use crate::parse::{Packet, Verdict, ethernet, parse};
    use crate::{encap, too_big};

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
    ///
    /// A packet that is not a SYN follows its connection-table entry while the entry's
    /// backend still serves flows (and, for UDP, while the entry is not idle-expired);
    /// otherwise, and always for a SYN, the VIP's Maglev table chooses, and the entry is
    /// written (a RST never creates one).
    #[inline(always)]
    // Keys go to the maps by reference: by value, each call copies them again on the stack.
    #[allow(clippy::needless_borrows_for_generic_args)]
    fn balance(ctx: &XdpContext, stats: &Stats) -> Result<Verdict, Verdict> {
        let packet = parse(ctx)?;
        let vip_key = VipKey {
            addr: packet.dst_addr,
            port: packet.dst_port_be,
            proto: packet.proto,
            family: packet.family,
        };
        // Most traffic of a host is not for a VIP: one array read and a key compare
        // send it on, before any hash-map lookup.
        let Some(slot) = vip_slot(&vip_key) else {
            return Err(Verdict::pass(stat::PASS_NOT_VIP));
        };
        // From the slot, or from LB_VIPS when the slot is shared: a key LB_VIPS lacks is
        // no VIP's, whatever connection-table entries it left.
        let Some(vip) = vip_info(&slot, &vip_key) else {
            return Err(Verdict::pass(stat::PASS_NOT_VIP));
        };
        let cpu = Cpu::get();
        // Coarse time: entries age in seconds.
        let now = cpu.now_ns();
        let flow_key = FlowKey {
            src: packet.src_addr,
            dst: packet.dst_addr,
            src_port: packet.src_port_be,
            dst_port: packet.dst_port_be,
            proto: packet.proto,
            family: packet.family,
            _pad: [0; 2],
        };
        // Looked up for a SYN too: a reused tuple's entry is then refreshed in place,
        // which costs far less than an insert.
        let entry = LB_CONNTRACK.get_ptr_mut(&flow_key);
        if packet.icmp_too_big {
            // To where the flow's packets go, without touching its entry: an error is
            // not a packet of the flow. TCP: the entry's backend, else the table's; the
            // backend's kernel checks the quoted sequence number, so a forged error
            // cannot touch a connection. UDP: only a live entry's; nothing checks a UDP
            // error, so it must at least name a flow seen within the idle time.
            let held = entry.and_then(|entry| {
                flow::held(&Maps, unsafe { &*entry }, packet.proto, vip.vip_id, now)
            });
            let (backend_id, backend) = match held {
                Some(held) => held,
                None if packet.proto == PROTO_UDP => {
                    return Err(Verdict::pass(stat::PASS_OTHER_PROTO));
                }
                None => table_choice(&packet, &vip)?,
            };
            stats.count(stat::SEEN_ICMP_TOO_BIG);
            return forward(ctx, stats, &packet, vip.vip_id, backend_id, &backend, false);
        }
        let udp = packet.proto == PROTO_UDP;
        let mut miss = if packet.syn {
            stat::CT_MISS_SYN
        } else if udp {
            stat::CT_MISS_UDP
        } else {
            stat::CT_MISS_NON_SYN
        };
        if !packet.syn
            && let Some(entry) = entry
        {
            let entry = unsafe { &mut *entry };
            match flow::follow(
                &Maps,
                entry,
                packet.proto,
                packet.closing(),
                vip.vip_id,
                now,
            ) {
                Ok((backend_id, backend)) => {
                    stats.count(stat::CT_HIT);
                    return forward(ctx, stats, &packet, vip.vip_id, backend_id, &backend, false);
                }
                Err(reason) => miss = reason,
            }
        }
        stats.count(miss);
        if miss == stat::CT_MISS_NON_SYN {
            capture(ctx, stats, now);
        }
        let new_flow = miss == stat::CT_MISS_SYN || miss == stat::CT_MISS_UDP;

        let (backend_id, backend) = table_choice(&packet, &vip)?;
        let fresh = flow::entry_for(backend_id, packet.closing(), now);
        let written = match entry {
            // The backend it already names (a SYN on a reused tuple while the table
            // stands): refreshed in place.
            Some(entry) if unsafe { (*entry).backend_id } == backend_id => {
                unsafe { *entry = fresh };
                true
            }
            // A RST ends a flow: it never creates an entry.
            None if packet.rst => false,
            // A new entry, or another backend for an existing one, goes through the map:
            // a pointer into the LRU may meanwhile name a node recycled for another flow.
            _ if may_insert(stats, now) => LB_CONNTRACK.insert(&flow_key, &fresh, 0).is_ok(),
            // No room this second: a SYN must not leave an older connection's entry
            // (another backend) for the packets that follow it.
            Some(_) if packet.syn => {
                let _ = LB_CONNTRACK.remove(&flow_key);
                false
            }
            _ => false,
        };
        if written {
            stats.count(stat::CT_CREATED);
        }
        // Heavy hitters are sampled: one new flow in SOURCE_SAMPLE is counted, with that
        // weight, so most new flows skip the map.
        if new_flow {
            let sample = read(&SOURCE_SAMPLE).max(1);
            if cpu.one_in(sample) {
                let weight = sample as u64;
                count_source(vip.vip_id, packet.src_addr, packet.family, weight);
            }
        }
        forward(
            ctx, stats, &packet, vip.vip_id, backend_id, &backend, new_flow,
        )
    }

    /// A copy of the VIP slot `key` hashes to, if it may be `key`'s: used, and either
    /// holding `key` or shared (several keys: `LB_VIPS` decides).
    #[inline(always)]
    fn vip_slot(key: &VipKey) -> Option<VipSlot> {
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
        let slot = unsafe { core::mem::transmute::<[u64; 5], VipSlot>(words) };
        if changed != 0 {
            return Some(VipSlot {
                state: VIP_SLOT_USED | VIP_SLOT_SHARED,
                ..slot
            });
        }
        let mine = slot.state == VIP_SLOT_USED && slot.key.same(key);
        let shared = slot.state & VIP_SLOT_USED != 0 && slot.state & VIP_SLOT_SHARED != 0;
        (mine || shared).then_some(slot)
    }

    /// The VIP of `key`: from its slot, or, when the slot is shared, from `LB_VIPS`.
    #[inline(always)]
    // Keys go to the maps by reference: by value, each call copies them again.
    #[allow(clippy::needless_borrows_for_generic_args)]
    fn vip_info(slot: &VipSlot, key: &VipKey) -> Option<VipInfo> {
        if slot.state & VIP_SLOT_SHARED == 0 {
            return Some(VipInfo {
                vip_id: slot.vip_id,
                generation: slot.generation,
                flags: slot.flags,
                _pad: 0,
            });
        }
        // A copy: the map's element may be reused for a new value while we run.
        unsafe { LB_VIPS.get(key) }.copied()
    }

    /// The backend the VIP's Maglev table gives the packet's flow.
    #[inline(always)]
    fn table_choice(packet: &Packet, vip: &VipInfo) -> Result<(u32, BackendInfo), Verdict> {
        let table_size = read(&MAGLEV_SIZE);
        let hash = flow_hash(&packet.flow_tuple(), vip.flags & VIP_F_HASH_SRC_IP != 0);
        let table_slot = vip.table_base(table_size) + maglev_slot(hash, table_size);
        let backend_id = match LB_MAGLEV.get(table_slot) {
            Some(&id) if id != BACKEND_NONE => id,
            _ => return Err(Verdict::drop(stat::DROP_NO_BACKEND)),
        };
        match LB_BACKENDS.get(backend_id) {
            Some(backend) => Ok((backend_id, *backend)),
            None => Err(Verdict::drop(stat::DROP_NO_BACKEND)),
        }
    }

    /// What `lb_common::flow`'s decisions read: this program's maps and globals.
    struct Maps;

    impl Lookup for Maps {
        #[inline(always)]
        fn backend(&self, id: u32) -> Option<&BackendInfo> {
            LB_BACKENDS.get(id)
        }

        #[inline(always)]
        fn udp_idle_ns(&self) -> u64 {
            read(&UDP_IDLE_NS)
        }
    }

    /// Sends the frame to `backend`: its MAC as destination, ours as source, and counts
    /// it for the VIP and the backend. A tunnelled backend's frame is first wrapped in
    /// the outer headers (`encap`), or answered when it would then be too big.
    #[inline(always)]
    fn forward(
        ctx: &XdpContext,
        stats: &Stats,
        packet: &Packet,
        vip_id: u32,
        backend_id: u32,
        backend: &BackendInfo,
        new_flow: bool,
    ) -> Result<Verdict, Verdict> {
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
                    return Err(Verdict {
                        action: xdp_action::XDP_TX,
                        reason: outcome,
                    });
                }
                _ => return Err(Verdict::drop(outcome)),
            }
        }
        let eth = ethernet(ctx)?;
        unsafe {
            (*eth).dst_addr = backend.mac;
            (*eth).src_addr = core::ptr::read_volatile(&IFACE_MAC);
        }
        count_traffic(&LB_VIP_STATS, vip_id, bytes, new_flow);
        count_traffic(&LB_BACKEND_STATS, backend_id, bytes, new_flow);
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

    /// The whole frame's length: with multi-buffer frames `data_end` ends the first
    /// buffer only.
    #[inline(always)]
    fn frame_len(ctx: &XdpContext) -> u64 {
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
