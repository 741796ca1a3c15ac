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
        RateWindow, VIP_SLOT_SHARED, VIP_SLOT_USED, VipInfo, VipKey, VipSlot,
        flow::{self, Lookup},
        maglev_slot, stat, table_hash,
    };

    use crate::maps::{
        Cpu, LB_BACKEND_STATS, LB_BACKENDS, LB_CAPTURE, LB_CAPTURE_WIN, LB_CONNTRACK, LB_EMBRYONIC,
        LB_FLOOD, LB_MAGLEV, LB_SCRATCH, LB_VIP_SLOTS, LB_VIP_STATS, LB_VIPS, Stats, count_source,
        count_traffic, export_flow, hot_source,
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
    /// backend still serves flows (and, for UDP, while the entry is not idle-expired, for
    /// TCP while no SYN reused its tuple).
    /// State is made only for flows seen twice: a flow's first packet (always a SYN)
    /// takes the VIP's Maglev table and is remembered in the embryonic table; its second
    /// packet goes where the first went and enters the flow into the connection table
    /// (a RST never creates an entry). An entry whose backend no longer serves it is
    /// re-written to the table's choice.
    #[inline(always)]
    // Keys go to the maps by reference: by value, each call copies them again on the stack.
    #[allow(clippy::needless_borrows_for_generic_args)]
    fn balance(ctx: &XdpContext, stats: &Stats) -> Result<Verdict, Verdict> {
        let packet = parse(ctx)?;
        // One place that sends: `forward` (and the tunnels' code it calls) inlined once,
        // not at every decision.
        let choice = choose(ctx, stats, &packet)?;
        forward(ctx, stats, &packet, &choice)
    }

    /// Where a VIP packet goes, and what it does to the tables on the way.
    #[derive(Clone, Copy)]
    struct Choice {
        vip_id: u32,
        backend_id: u32,
        new_flow: bool,
    }

    /// `balance`'s decision for a parsed packet: `Ok` to forward, `Err` for everything
    /// else, with its reason.
    #[inline(always)]
    #[allow(clippy::needless_borrows_for_generic_args)]
    fn choose(ctx: &XdpContext, stats: &Stats, packet: &Packet) -> Result<Choice, Verdict> {
        let vip_key = VipKey {
            addr: packet.dst_addr,
            port: packet.dst_port_be,
            proto: packet.proto,
            family: packet.family,
        };
        // Most traffic of a host is not for a VIP: one array read and a key compare
        // send it on, before any hash-map lookup.
        let Some(vip) = vip_of(&vip_key) else {
            return Err(Verdict::pass(stat::PASS_NOT_VIP));
        };
        let cpu = Cpu::get();
        // Coarse time: entries age in seconds.
        let now = cpu.now_ns();
        // Built in this CPU's scratch slot, not on the stack: the balancer and the
        // tunnels' functions share 512 bytes of stack.
        let Some(scratch) = LB_SCRATCH.get_ptr_mut(0) else {
            return Err(Verdict::pass(stat::PASS_NOT_VIP));
        };
        let flow_key = unsafe { &mut (*scratch).key };
        *flow_key = FlowKey {
            src: packet.src_addr,
            dst: packet.dst_addr,
            src_port: packet.src_port_be,
            dst_port: packet.dst_port_be,
            proto: packet.proto,
            family: packet.family,
            _pad: [0; 2],
        };
        let flow_key: &FlowKey = flow_key;
        // A SYN reads no entry (the lookup would be most of what a spoofed SYN costs): it
        // takes the table, and an entry an earlier connection left on its tuple gives way
        // at the new connection's next packet (`flow::follow`'s `CT_REUSED`).
        let entry = if packet.syn {
            None
        } else {
            LB_CONNTRACK.get_ptr_mut(flow_key)
        };
        if packet.icmp_too_big {
            // To where the flow's packets go, without touching its entry: an error is
            // not a packet of the flow. TCP: the entry's backend, else the table's; the
            // backend's kernel checks the quoted sequence number, so a forged error
            // cannot touch a connection. UDP: only a live entry's, or the backend the
            // embryonic table remembers for the flow's first datagram (a flow of one
            // request has no entry); nothing checks a UDP error, so it must at least name
            // a flow seen.
            let held = match entry {
                Some(entry) => flow::held(&Maps, unsafe { &*entry }, packet.proto, vip.vip_id, now),
                None => {
                    let (index, tag) = flow::embryo_place(flow_key);
                    LB_EMBRYONIC
                        .get(index)
                        .and_then(|embryo| flow::remembered(&Maps, embryo, tag, vip.vip_id))
                }
            };
            let backend_id = match held {
                Some(held) => held,
                None if packet.proto == PROTO_UDP => {
                    return Err(Verdict::pass(stat::PASS_OTHER_PROTO));
                }
                None => table_choice(packet, &vip)?,
            };
            stats.count(stat::SEEN_ICMP_TOO_BIG);
            return Ok(Choice {
                vip_id: vip.vip_id,
                backend_id,
                new_flow: false,
            });
        }
        let udp = packet.proto == PROTO_UDP;
        let mut miss = if packet.syn {
            stat::CT_MISS_SYN
        } else if udp {
            stat::CT_MISS_UDP
        } else {
            stat::CT_MISS_NON_SYN
        };
        if let Some(entry) = entry {
            let entry = unsafe { &mut *entry };
            // Asked only of an entry idle past a second or closing.
            let syn_since = || {
                let (index, tag) = flow::embryo_place(flow_key);
                LB_EMBRYONIC
                    .get(index)
                    .is_some_and(|embryo| flow::syn_since(embryo, tag))
            };
            match flow::follow(
                &Maps,
                entry,
                packet.proto,
                packet.closing(),
                vip.vip_id,
                now,
                syn_since,
            ) {
                Ok(backend_id) => {
                    stats.count(stat::CT_HIT);
                    return Ok(Choice {
                        vip_id: vip.vip_id,
                        backend_id,
                        new_flow: false,
                    });
                }
                Err(reason) => miss = reason,
            }
        }
        let (embryo_index, tag) = flow::embryo_place(flow_key);
        let embryo = LB_EMBRYONIC.get_ptr_mut(embryo_index);
        // The second packet of a flow the connection table does not hold, whose first
        // packet the embryonic table remembers (a handshake's ACK, a UDP flow's second
        // datagram): the flow is real, and enters the connection table with the backend
        // its first packet took. A flood of random tuples never gets here.
        if !packet.syn && entry.is_none() {
            let remembered = embryo
                .and_then(|embryo| flow::remembered(&Maps, unsafe { &*embryo }, tag, vip.vip_id));
            if let Some(backend_id) = remembered {
                stats.count(stat::CT_PROMOTED);
                if !udp {
                    sample_source(&cpu, vip.vip_id, packet);
                }
                // A RST ends the flow: it goes where the SYN went, and makes no entry.
                if !packet.rst && may_insert(stats, now) {
                    let fresh = flow::entry_for(backend_id, packet.closing(), now);
                    if LB_CONNTRACK.insert(flow_key, &fresh, 0).is_ok() {
                        stats.count(stat::CT_CREATED);
                        // A new entry: the cluster's peers learn it from here.
                        export_flow(stats, flow_key, &fresh);
                    }
                    // The entry is newer than the SYN now.
                    if let Some(embryo) = embryo {
                        unsafe { (*embryo).flags = 0 };
                    }
                }
                return Ok(Choice {
                    vip_id: vip.vip_id,
                    backend_id,
                    new_flow: false,
                });
            }
        }
        stats.count(miss);
        if miss == stat::CT_MISS_NON_SYN {
            capture(ctx, stats, now);
        }
        let new_flow = miss == stat::CT_MISS_SYN || miss == stat::CT_MISS_UDP;

        // An entry that gives way (reused, or its backend gone) to a connection whose SYN
        // came since: that connection goes where its SYN went.
        let syn_since = entry.is_some()
            && embryo.is_some_and(|embryo| flow::syn_since(unsafe { &*embryo }, tag));
        let reused_to = match embryo {
            Some(embryo) if syn_since => {
                flow::remembered(&Maps, unsafe { &*embryo }, tag, vip.vip_id)
            }
            _ => None,
        };
        let backend_id = match reused_to {
            Some(choice) => choice,
            None => table_choice(packet, &vip)?,
        };
        match entry {
            // A first packet (a SYN, a new UDP flow, an ACK of a flow the connection table
            // lost) is remembered for the flow's second packet, and makes no entry: a flood
            // of spoofed first packets costs no established flow its entry. A RST ends a
            // flow: it is never remembered.
            None => {
                if !packet.rst
                    && let Some(embryo) = embryo
                {
                    unsafe { *embryo = flow::embryo_for(tag, backend_id, packet.syn) };
                    stats.count(stat::CT_EMBRYONIC);
                }
            }
            // A flow the table holds, whose backend no longer serves it, an idle UDP flow,
            // or a reused tuple's new connection: a real flow, re-written to its backend,
            // in place when the backend is the entry's, else through the map (a pointer
            // into the LRU may meanwhile name a node recycled for another flow).
            Some(entry) => {
                let fresh = flow::entry_for(backend_id, packet.closing(), now);
                if unsafe { (*entry).backend_id } == backend_id {
                    unsafe { *entry = fresh };
                    stats.count(stat::CT_CREATED);
                } else if may_insert(stats, now) && LB_CONNTRACK.insert(flow_key, &fresh, 0).is_ok()
                {
                    stats.count(stat::CT_CREATED);
                    // Another backend for the flow: the peers learn that too.
                    export_flow(stats, flow_key, &fresh);
                }
                if let Some(embryo) = embryo
                    && syn_since
                {
                    unsafe { (*embryo).flags = 0 };
                }
            }
        }
        // A UDP flow counts for its source at its first datagram (many send only one);
        // a TCP flow at its handshake's ACK, above.
        if udp && new_flow {
            sample_source(&cpu, vip.vip_id, packet);
        }
        Ok(Choice {
            vip_id: vip.vip_id,
            backend_id,
            new_flow,
        })
    }

    /// Counts a new flow for its client source (heavy hitters), sampled: one new flow in
    /// SOURCE_SAMPLE is counted, with that weight, so most new flows skip the map. A TCP
    /// flow counts once its handshake completes, so spoofed SYNs, which would each insert a
    /// new source into the map, neither cost that nor crowd the real sources out.
    #[inline(always)]
    fn sample_source(cpu: &Cpu, vip_id: u32, packet: &Packet) {
        let sample = read(&SOURCE_SAMPLE).max(1);
        if cpu.one_in(sample) {
            let weight = sample as u64;
            count_source(vip_id, packet.src_addr, packet.family, weight);
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

    /// The backend the VIP's Maglev table gives the packet's flow. A hot source of a
    /// src-ip VIP with hot sources is hashed per connection (`lb_common::table_hash`).
    #[inline(always)]
    fn table_choice(packet: &Packet, vip: &VipInfo) -> Result<u32, Verdict> {
        match table_backend(packet, vip) {
            BACKEND_NONE => Err(Verdict::drop(stat::DROP_NO_BACKEND)),
            id => Ok(id),
        }
    }

    /// `table_choice`'s lookup, `BACKEND_NONE` for none.
    #[inline(always)]
    fn table_backend(packet: &Packet, vip: &VipInfo) -> u32 {
        let table_size = read(&MAGLEV_SIZE);
        let Some(scratch) = LB_SCRATCH.get_ptr_mut(0) else {
            return BACKEND_NONE;
        };
        let tuple = unsafe { &mut (*scratch).tuple };
        *tuple = packet.flow_tuple();
        let (hash, spread) = table_hash(tuple, vip.flags, || {
            hot_source(vip.vip_id, packet.src_addr, packet.family)
        });
        if spread {
            // Rare (hot sources only): the counters are looked up again rather than
            // passed through every caller.
            Stats::get().count(stat::HOT_SOURCE_SPREAD);
        }
        let table_slot = vip.table_base(table_size) + maglev_slot(hash, table_size);
        LB_MAGLEV.get(table_slot).copied().unwrap_or(BACKEND_NONE)
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
        choice: &Choice,
    ) -> Result<Verdict, Verdict> {
        let Choice {
            vip_id,
            backend_id,
            new_flow,
        } = *choice;
        // Read where it is, not copied: each decision above passes on only the id.
        let Some(backend) = LB_BACKENDS.get(backend_id) else {
            return Err(Verdict::drop(stat::DROP_NO_BACKEND));
        };
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
            // In two words, not as a `[u8; 6]` copy: the compiler cannot tell the map
            // value from the packet, and copies one into the other with a call to a
            // byte-wise `memmove`.
            let mac = backend.mac.as_ptr();
            let dst = (*eth).dst_addr.as_mut_ptr();
            (dst as *mut u32).write_unaligned((mac as *const u32).read_unaligned());
            (dst.add(4) as *mut u16).write_unaligned((mac.add(4) as *const u16).read_unaligned());
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

    /// The flood guard: at most `CT_INSERT_LIMIT` inserts per second on this CPU, so even
    /// a flood of complete handshakes (or of each spoofed tuple sent twice) turns the LRU
    /// over slowly.
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
