//! Tunnel DSR: the packet, as the client sent it, inside an outer IP header to the
//! backend's own address (`forward = "ipip"`), or inside outer IP + UDP (`"gue"`).
//!
//! - IPIP: the outer family is the backend address's, so an IPv6 VIP may go to an IPv4
//!   backend (6in4, protocol 41) and the reverse (4in6, next header 4).
//! - GUE: variant 1 ("direct IP", draft-ietf-intarea-gue section 4): no GUE header, the
//!   UDP payload is the inner IP packet, whose version nibble (0100 or 0110) starts with
//!   the variant bits 01. As Katran sends and Linux fou (`ip fou add port N gue`)
//!   receives it. The UDP source port comes from the flow (49152 + 14 bits of a hash of
//!   its addresses and ports), so a backend's RSS and routers' ECMP spread flows; an
//!   outer IPv6 header's flow label comes from the same hash. The UDP checksum is 0, for
//!   IPv6 too (RFC 6935 allows it for tunnels; Katran does the same): the inner packet
//!   carries its own checksums, and lb's decap program does not require one (RFC 6936
//!   lets a receiver refuse it: the kernel's fou over IPv6 was not tried here).
//! - Outer IPv4: TTL 64, DF set (a tunnel packet fragmented on its way would have to be
//!   reassembled before decapsulation), ID 0, header checksum computed. Outer IPv6: hop
//!   limit 64. The inner TOS / traffic class byte (DSCP and ECN) is copied outward.
//! - A VLAN tag stays on the frame, before the outer header.
//! - A packet that would no longer fit the interface MTU is answered instead
//!   (`too_big`).

use aya_ebpf::{helpers::bpf_xdp_adjust_head, programs::XdpContext};
use lb_common::{ADDR_FAMILY_V4, BackendInfo, FORWARD_GUE, PROTO_UDP, stat};

use crate::maps::LB_TUNNEL;
use crate::parse::{Packet, Verdict, ptr_at};

const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
const ETH_P_8021Q: u16 = 0x8100;
pub const ETH_HDR: usize = 14;
pub const VLAN_HDR: usize = 4;
pub const IPV4_HDR: usize = 20;
pub const IPV6_HDR: usize = 40;
const UDP_HDR: usize = 8;
const PROTO_IPIP: u8 = 4;
const PROTO_IPV6: u8 = 41;
const TTL: u8 = 64;
const IPV4_DF: u16 = 0x4000;

/// The inner packet as the outer header needs it.
#[derive(Clone, Copy)]
pub struct Inner {
    /// Offset of its IP header in the frame (after Ethernet and a VLAN tag).
    pub l3: usize,
    /// Its IP length (IPv4 total length, IPv6 payload + 40): not the frame's, which may
    /// carry Ethernet padding.
    pub len: usize,
    /// TOS / traffic class byte.
    pub tos: u8,
    /// IPv4 DF set (IPv6: always, routers never fragment it).
    pub dont_fragment: bool,
}

/// Wraps the packet for `backend` (`FORWARD_IPIP` or `FORWARD_GUE`); the caller then
/// writes the MACs as for any forwarded frame. Returns what happened, as its counter:
/// `TX_IPIP` or `TX_GUE` (wrapped), `TX_ICMP_TOO_BIG` (too big once wrapped: the
/// caller answers it with `too_big::answer`), or why it is to be dropped.
///
/// Inlined: the verifier adds up the stack frames of a call chain (512 bytes at most),
/// and as a call this function's frame sat on top of all of the balancer's; inlined,
/// LLVM overlaps it with the decision's stack, which is dead by then (392 bytes in all,
/// against 424 + 96 as a call). Headers are written straight into the frame and the
/// settings read in the map, to keep it small.
#[inline(always)]
pub fn tunnel(ctx: XdpContext, packet: &Packet, backend: &BackendInfo) -> u32 {
    match wrap(&ctx, packet, backend) {
        Ok(reason) => reason,
        Err(verdict) => verdict.reason,
    }
}

/// The bytes a tunnel to `backend` adds, and the length of its outer IP header.
#[inline(always)]
pub fn overhead(backend: &BackendInfo) -> (usize, usize) {
    let ip_len = if backend.family == ADDR_FAMILY_V4 {
        IPV4_HDR
    } else {
        IPV6_HDR
    };
    let udp = if backend.forward == FORWARD_GUE {
        UDP_HDR
    } else {
        0
    };
    (ip_len + udp, ip_len)
}

/// The interface MTU (`LB_TUNNEL`; 0: not checked).
#[inline(always)]
pub fn mtu() -> u32 {
    LB_TUNNEL.get(0).map(|c| c.mtu).unwrap_or(0)
}

#[inline(always)]
fn wrap(ctx: &XdpContext, packet: &Packet, backend: &BackendInfo) -> Result<u32, Verdict> {
    let Some(config) = LB_TUNNEL.get(0) else {
        return Err(Verdict::drop(stat::DROP_NO_TUNNEL_SOURCE));
    };
    let inner = inner(ctx, packet)?;
    let gue = backend.forward == FORWARD_GUE;
    let outer_v4 = backend.family == ADDR_FAMILY_V4;
    let (overhead, ip_len) = overhead(backend);
    if config.mtu != 0 && inner.len + overhead > config.mtu as usize {
        return Ok(stat::TX_ICMP_TOO_BIG);
    }
    let src = if outer_v4 {
        let v4 = unsafe { &*(&config.src_v4 as *const [u8; 4] as *const [u16; 2]) };
        if v4[0] | v4[1] == 0 {
            return Err(Verdict::drop(stat::DROP_NO_TUNNEL_SOURCE));
        }
        v4.as_ptr()
    } else {
        let v6 = unsafe { &*(&config.src_v6 as *const [u8; 16] as *const [u64; 2]) };
        if v6[0] | v6[1] == 0 {
            return Err(Verdict::drop(stat::DROP_NO_TUNNEL_SOURCE));
        }
        config.src_v6.as_ptr() as *const u16
    };
    // Computed before the helper call and kept in one stack slot: otherwise the
    // compiler loads the addresses before it and keeps all of them across it. Only
    // where it is written: GUE's source port, an outer IPv6 header's flow label.
    let entropy = if gue || !outer_v4 {
        flow_entropy(packet)
    } else {
        0
    };
    let entropy = unsafe {
        let slot = core::ptr::addr_of!(entropy);
        core::ptr::read_volatile(slot)
    };
    grow(ctx, overhead)?;
    // The old Ethernet header (and tag) now sit `overhead` bytes in: the tag moves to
    // the front with the new header, before the outer IP header.
    let l3 = inner.l3;
    let ether_type = if outer_v4 { ETH_P_IP } else { ETH_P_IPV6 };
    if packet.vlan {
        let tci = read16(ctx, overhead + ETH_HDR)?;
        write16(ctx, ETH_HDR - 2, ETH_P_8021Q.to_be())?;
        write16(ctx, ETH_HDR, tci)?;
    }
    write16(ctx, l3 - 2, ether_type.to_be())?;
    let inner_proto = if packet.family == ADDR_FAMILY_V4 {
        PROTO_IPIP
    } else {
        PROTO_IPV6
    };
    let proto = if gue { PROTO_UDP } else { inner_proto };
    let payload_len = (inner.len + overhead - ip_len) as u16;
    let dst = backend.addr.as_ptr() as *const u16;
    if outer_v4 {
        let ip = ptr_at::<[u16; IPV4_HDR / 2]>(ctx, l3)?;
        unsafe {
            (*ip)[0] = u16::from_be_bytes([0x45, inner.tos]).to_be();
            (*ip)[1] = (IPV4_HDR as u16 + payload_len).to_be();
            (*ip)[2] = 0;
            (*ip)[3] = IPV4_DF.to_be();
            (*ip)[4] = u16::from_be_bytes([TTL, proto]).to_be();
            (*ip)[5] = 0;
            for i in 0..2 {
                (*ip)[6 + i] = *src.add(i);
                (*ip)[8 + i] = *dst.add(i);
            }
            (*ip)[5] = checksum(&*ip);
        }
    } else {
        let ip = ptr_at::<[u16; IPV6_HDR / 2]>(ctx, l3)?;
        let flow_label = entropy & 0x000f_ffff;
        let first = (6 << 28) | ((inner.tos as u32) << 20) | flow_label;
        unsafe {
            (*ip)[0] = ((first >> 16) as u16).to_be();
            (*ip)[1] = (first as u16).to_be();
            (*ip)[2] = payload_len.to_be();
            (*ip)[3] = u16::from_be_bytes([proto, TTL]).to_be();
            for i in 0..8 {
                (*ip)[4 + i] = *src.add(i);
                (*ip)[12 + i] = *dst.add(i);
            }
        }
    }
    if !gue {
        return Ok(stat::TX_IPIP);
    }
    let udp = ptr_at::<[u16; UDP_HDR / 2]>(ctx, l3 + ip_len)?;
    let source_port = 49152 | (entropy >> 18) as u16;
    unsafe {
        (*udp)[0] = source_port.to_be();
        (*udp)[1] = backend.gue_port_be;
        (*udp)[2] = ((inner.len + UDP_HDR) as u16).to_be();
        (*udp)[3] = 0;
    }
    Ok(stat::TX_GUE)
}

/// The inner packet's IP length, TOS and DF, read from its header.
#[inline(always)]
pub fn inner(ctx: &XdpContext, packet: &Packet) -> Result<Inner, Verdict> {
    let l3 = ETH_HDR + if packet.vlan { VLAN_HDR } else { 0 };
    // Parsed already: the header is there.
    let ip = ptr_at::<[u8; 8]>(ctx, l3)?;
    let (len, tos, dont_fragment) = unsafe {
        if packet.family == ADDR_FAMILY_V4 {
            let flags = u16::from_be_bytes([(*ip)[6], (*ip)[7]]);
            let len = u16::from_be_bytes([(*ip)[2], (*ip)[3]]) as usize;
            (len, (*ip)[1], flags & IPV4_DF != 0)
        } else {
            let len = u16::from_be_bytes([(*ip)[4], (*ip)[5]]) as usize + IPV6_HDR;
            (len, ((*ip)[0] << 4) | ((*ip)[1] >> 4), true)
        }
    };
    Ok(Inner {
        l3,
        len,
        tos,
        dont_fragment,
    })
}

/// The Internet checksum of `words` as they sit in memory (ones' complement sums do not
/// depend on byte order, so the result is stored as is).
#[inline(always)]
pub fn checksum(words: &[u16]) -> u16 {
    let mut sum = 0u32;
    for word in words {
        sum += *word as u32;
    }
    !fold(sum)
}

/// Folds a 32-bit ones' complement sum into 16 bits.
#[inline(always)]
pub fn fold(sum: u32) -> u16 {
    let sum = (sum & 0xffff) + (sum >> 16);
    ((sum & 0xffff) + (sum >> 16)) as u16
}

/// A hash of the flow's addresses and ports (MurmurHash3's finaliser over their
/// xor-fold): the outer UDP source port and IPv6 flow label, the same for every packet
/// of a flow. Cheaper than the Maglev hash, which an established flow does not compute.
/// An IPv4 flow folds its first address words alone: the other three are zero, so the
/// hash is the same, for 12 loads and xors less.
#[inline(always)]
fn flow_entropy(packet: &Packet) -> u32 {
    let s = packet.src_addr.as_ptr() as *const u16;
    let d = packet.dst_addr.as_ptr() as *const u16;
    let mut h = ((packet.src_port_be as u32) << 16) | packet.dst_port_be as u32;
    // Word i of both addresses, folded (the pairs' halves as they sit in memory).
    let fold = |i: usize| unsafe {
        let (s0, s1) = (*s.add(2 * i) as u32, *s.add(2 * i + 1) as u32);
        let (d0, d1) = (*d.add(2 * i) as u32, *d.add(2 * i + 1) as u32);
        (s0 << 16 | s1) ^ (d1 << 16 | d0)
    };
    h ^= fold(0);
    if packet.family != ADDR_FAMILY_V4 {
        h ^= fold(1) ^ fold(2) ^ fold(3);
    }
    lb_common::fmix32(h)
}

/// Makes room for `bytes` more in front of the frame.
#[inline(always)]
pub fn grow(ctx: &XdpContext, bytes: usize) -> Result<(), Verdict> {
    if unsafe { bpf_xdp_adjust_head(ctx.ctx, -(bytes as i32)) } != 0 {
        return Err(Verdict::drop(stat::DROP_ENCAP_FAILED));
    }
    Ok(())
}

#[inline(always)]
pub fn read16(ctx: &XdpContext, offset: usize) -> Result<u16, Verdict> {
    Ok(unsafe { *ptr_at::<u16>(ctx, offset)? })
}

#[inline(always)]
pub fn write16(ctx: &XdpContext, offset: usize, value: u16) -> Result<(), Verdict> {
    unsafe { *ptr_at::<u16>(ctx, offset)? = value };
    Ok(())
}
