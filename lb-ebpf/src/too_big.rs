//! The answer to a packet that would exceed the interface MTU once encapsulated: an
//! ICMP "fragmentation needed" (type 3 code 4) or ICMPv6 "packet too big" (type 2) from
//! the VIP to the client, carrying the usable MTU (the interface's less the tunnel
//! headers), built in place of the packet and sent back out (XDP_TX), as vc5 and
//! Katran do. The client's TCP lowers its segment size for the VIP and sends again.
//!
//! It quotes the first `QUOTED` bytes of the packet (its IP header, options and
//! transport header included). Not answered, dropped (`drop_too_big`): an IPv4 packet
//! without DF (a router would fragment it; XDP cannot, and the kernel's tunnel would
//! set DF on the outer header too), an ICMP error itself, and a packet shorter than
//! `QUOTED` (an MTU below any real link's).

use aya_ebpf::{
    helpers::{bpf_csum_diff, bpf_xdp_adjust_tail, bpf_xdp_get_buff_len},
    programs::XdpContext,
};
use lb_common::{ADDR_FAMILY_V4, BackendInfo, PROTO_ICMP, PROTO_ICMPV6, stat};

use crate::encap::{
    ETH_HDR, IPV4_HDR, IPV6_HDR, checksum, fold, grow, inner, mtu, overhead, read16, write16,
};
use crate::parse::{Packet, Verdict, ptr_at};

/// Bytes of the packet quoted (a multiple of 4, as `bpf_csum_diff` wants).
pub const QUOTED: usize = 128;
const ICMP_HDR: usize = 8;
const TTL: u8 = 64;

/// Turns the frame, too big for the tunnel to `backend`, into the answer. Returns its
/// counter: `TX_ICMP_TOO_BIG` (send it back) or why it is dropped.
///
/// Inlined, as `encap::tunnel`, and called after that returned: their stack is never
/// live at once, and LLVM overlaps it with the balancer's.
#[inline(always)]
pub fn answer(ctx: XdpContext, packet: &Packet, backend: &BackendInfo) -> u32 {
    match build(&ctx, packet, backend) {
        Ok(()) => stat::TX_ICMP_TOO_BIG,
        Err(verdict) => verdict.reason,
    }
}

#[inline(always)]
fn build(ctx: &XdpContext, packet: &Packet, backend: &BackendInfo) -> Result<(), Verdict> {
    let refused = Verdict::drop(stat::DROP_TOO_BIG);
    let inner = inner(ctx, packet)?;
    if packet.icmp_too_big || !inner.dont_fragment || inner.len < QUOTED {
        return Err(refused);
    }
    let usable = mtu().saturating_sub(overhead(backend).0 as u32);
    let v4 = packet.family == ADDR_FAMILY_V4;
    let ip_len = if v4 { IPV4_HDR } else { IPV6_HDR };
    let added = ip_len + ICMP_HDR;
    // Back to where it came from: the MACs swap (the frame came through the router or
    // from the client itself).
    let macs = ptr_at::<[u16; 6]>(ctx, 0)?;
    let [d0, d1, d2, s0, s1, s2] = unsafe { *macs };
    grow(ctx, added).map_err(|_| refused)?;
    let l3 = inner.l3;
    let end = l3 + added + QUOTED;
    let len = unsafe { bpf_xdp_get_buff_len(ctx.ctx) } as usize;
    if len > end && unsafe { bpf_xdp_adjust_tail(ctx.ctx, -((len - end) as i32)) } != 0 {
        return Err(refused);
    }
    let eth = ptr_at::<[u16; 6]>(ctx, 0)?;
    unsafe { *eth = [s0, s1, s2, d0, d1, d2] };
    // The EtherType (and a VLAN tag before it) as they were, `added` bytes further in.
    if packet.vlan {
        write16(ctx, ETH_HDR - 2, read16(ctx, added + ETH_HDR - 2)?)?;
        write16(ctx, ETH_HDR, read16(ctx, added + ETH_HDR)?)?;
    }
    write16(ctx, l3 - 2, read16(ctx, added + l3 - 2)?)?;
    let vip = packet.dst_addr.as_ptr() as *const u16;
    let client = packet.src_addr.as_ptr() as *const u16;
    let icmp = ptr_at::<[u16; (ICMP_HDR + QUOTED) / 2]>(ctx, l3 + ip_len)?;
    let seed = if v4 {
        let ip = ptr_at::<[u16; IPV4_HDR / 2]>(ctx, l3)?;
        unsafe {
            (*ip)[0] = u16::from_be_bytes([0x45, 0]).to_be();
            (*ip)[1] = ((IPV4_HDR + ICMP_HDR + QUOTED) as u16).to_be();
            (*ip)[2] = 0;
            (*ip)[3] = 0;
            (*ip)[4] = u16::from_be_bytes([TTL, PROTO_ICMP]).to_be();
            (*ip)[5] = 0;
            for i in 0..2 {
                (*ip)[6 + i] = *vip.add(i);
                (*ip)[8 + i] = *client.add(i);
            }
            (*ip)[5] = checksum(&*ip);
            (*icmp)[0] = u16::from_be_bytes([3, 4]).to_be();
            (*icmp)[2] = 0;
            (*icmp)[3] = (usable.min(u16::MAX as u32) as u16).to_be();
        }
        0
    } else {
        let ip = ptr_at::<[u16; IPV6_HDR / 2]>(ctx, l3)?;
        let payload = ((ICMP_HDR + QUOTED) as u16).to_be();
        // The pseudo-header: addresses, upper-layer length, next header.
        let mut sum = payload as u32 + (PROTO_ICMPV6 as u16).to_be() as u32;
        unsafe {
            (*ip)[0] = 0x6000u16.to_be();
            (*ip)[1] = 0;
            (*ip)[2] = payload;
            (*ip)[3] = u16::from_be_bytes([PROTO_ICMPV6, TTL]).to_be();
            for i in 0..8 {
                let (from, to) = (*vip.add(i), *client.add(i));
                (*ip)[4 + i] = from;
                (*ip)[12 + i] = to;
                sum += from as u32 + to as u32;
            }
            (*icmp)[0] = u16::from_be_bytes([2, 0]).to_be();
            (*icmp)[2] = ((usable >> 16) as u16).to_be();
            (*icmp)[3] = (usable as u16).to_be();
        }
        sum
    };
    unsafe {
        (*icmp)[1] = 0;
        let sum = bpf_csum_diff(
            core::ptr::null_mut(),
            0,
            icmp as *mut u32,
            (ICMP_HDR + QUOTED) as u32,
            seed,
        );
        if sum < 0 {
            return Err(refused);
        }
        (*icmp)[1] = !fold(sum as u32);
    }
    Ok(())
}
