//! Header parsing, one small function per layer over one bounds-checked `ptr_at`.
//!
//! What happens to what (each outcome has its own counter in `lb_common::stat`):
//! - a frame too short for the header it announces (Ethernet, VLAN, IPv4 with its
//!   options, IPv6, TCP, UDP): dropped, `drop_truncated`. The kernel would discard it too.
//! - an IPv4 header with a version other than 4 or a length below 20 bytes: dropped,
//!   `drop_bad_header`.
//! - EtherType other than IPv4/IPv6 (ARP, LLDP ...): passed, `pass_not_ip`.
//! - one 802.1Q tag: parsed past and kept on the forwarded frame (`seen_vlan`); a second
//!   tag or an 802.1ad outer tag: passed, `pass_vlan_stacked`.
//! - IPv4 options: parsed past, the packet is balanced like any other (`seen_ipv4_options`).
//! - IPv4 fragments (MF set or offset non-zero): passed, `pass_fragment`. Later fragments
//!   carry no ports, so they cannot follow their first fragment's hash.
//! - IPv6 with an extension header before TCP/UDP: passed, `pass_ipv6_ext`.
//! - IP protocols other than TCP and UDP: passed, `pass_other_proto`; except an ICMP
//!   "fragmentation needed" (ICMPv6 "packet too big") sent to a VIP about one of its
//!   flows, which is parsed as that flow (from its quoted header) and goes to the flow's
//!   backend (`seen_icmp_too_big`; a UDP flow's only while its entry is live). Anything
//!   odd in it (another ICMP message, a quoted header cut short, a later fragment, or not
//!   from the address it was sent to) is passed.

use aya_ebpf::programs::XdpContext;
use core::mem::size_of;
pub use lb_common::decide::{Packet, Verdict};
use lb_common::{
    ADDR_FAMILY_V4, ADDR_FAMILY_V6, PROTO_ICMP, PROTO_ICMPV6, PROTO_TCP, PROTO_UDP, stat,
};
use network_types::{
    eth::EthHdr,
    ip::{Ipv4Hdr, Ipv6Hdr},
    tcp::TcpHdr,
    udp::UdpHdr,
};

const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
const ETH_P_8021Q: u16 = 0x8100;
const ETH_P_8021AD: u16 = 0x88a8;
const VLAN_HDR_LEN: usize = 4;
const IPV4_MF_AND_OFFSET: u16 = 0x3fff;
const IPV4_OFFSET: u16 = 0x1fff;
/// ICMP "destination unreachable", code "fragmentation needed and DF set".
const ICMP_UNREACHABLE: u8 = 3;
const ICMP_FRAG_NEEDED: u8 = 4;
/// ICMPv6 "packet too big".
const ICMPV6_TOO_BIG: u8 = 2;
/// An ICMP error's header (type, code, checksum, and 4 bytes: the MTU for ours) before
/// the packet it quotes.
const ICMP_HDR_LEN: usize = 8;

/// A pointer to a `T` at `offset` bytes into the frame, if the frame is long enough.
#[inline(always)]
pub fn ptr_at<T>(ctx: &XdpContext, offset: usize) -> Result<*mut T, Verdict> {
    let start = ctx.data();
    let end = ctx.data_end();
    if start + offset + size_of::<T>() > end {
        return Err(Verdict::drop(stat::DROP_TRUNCATED));
    }
    Ok((start + offset) as *mut T)
}

/// The Ethernet header, for rewriting.
#[inline(always)]
pub fn ethernet(ctx: &XdpContext) -> Result<*mut EthHdr, Verdict> {
    ptr_at::<EthHdr>(ctx, 0)
}

/// Parses up to the transport ports. `Err` carries the verdict for anything not
/// balanced.
#[inline(always)]
pub fn parse(ctx: &XdpContext) -> Result<Packet, Verdict> {
    let eth = ethernet(ctx)?;
    let mut ether_type = u16::from_be(unsafe { (*eth).ether_type });
    let mut l3 = EthHdr::LEN;
    let mut vlan = false;
    if ether_type == ETH_P_8021Q || ether_type == ETH_P_8021AD {
        // The 802.1Q header: TCI, then the inner EtherType.
        let inner = ptr_at::<[u8; VLAN_HDR_LEN]>(ctx, l3)?;
        let inner_type = u16::from_be_bytes(unsafe { [(*inner)[2], (*inner)[3]] });
        if ether_type == ETH_P_8021AD || inner_type == ETH_P_8021Q || inner_type == ETH_P_8021AD {
            return Err(Verdict::pass(stat::PASS_VLAN_STACKED));
        }
        ether_type = inner_type;
        l3 += VLAN_HDR_LEN;
        vlan = true;
    }
    let mut packet = match ether_type {
        ETH_P_IP => ipv4(ctx, l3)?,
        ETH_P_IPV6 => ipv6(ctx, l3)?,
        _ => return Err(Verdict::pass(stat::PASS_NOT_IP)),
    };
    packet.vlan = vlan;
    Ok(packet)
}

/// An IPv4 header's length, fragment field and protocol; `None` when it is no valid
/// IPv4 header (version not 4, or shorter than 20 bytes). The caller checked its bounds.
#[inline(always)]
fn ipv4_header(ip: *const Ipv4Hdr) -> Option<(usize, u16, u8)> {
    let (vihl, frags, proto) =
        unsafe { ((*ip).vihl, u16::from_be_bytes((*ip).frags), (*ip).proto) };
    // Masked to 4 bits so the verifier sees the header length bounded by 60.
    let header_len = ((vihl & 0x0f) as usize) * 4;
    (vihl >> 4 == 4 && header_len >= Ipv4Hdr::LEN).then_some((header_len, frags, proto))
}

/// An IPv4 header's source and destination (bytes 12..20), as the maps hold them.
#[inline(always)]
fn ipv4_addresses(ip: *const Ipv4Hdr) -> ([u8; 16], [u8; 16]) {
    let [src, dst] = load_words::<2>(ip as *const u8, 12);
    (as_bytes([src, 0, 0, 0]), as_bytes([dst, 0, 0, 0]))
}

/// An IPv6 header's next header; `None` when the version is not 6. The caller checked
/// its bounds.
#[inline(always)]
fn ipv6_header(ip: *const Ipv6Hdr) -> Option<u8> {
    let (version, next) = unsafe { ((*ip).vcf[0] >> 4, (*ip).next_hdr) };
    (version == 6).then_some(next)
}

/// An IPv6 header's source and destination (bytes 8..40).
#[inline(always)]
fn ipv6_addresses(ip: *const Ipv6Hdr) -> ([u8; 16], [u8; 16]) {
    let [s0, s1, s2, s3, d0, d1, d2, d3] = load_words::<8>(ip as *const u8, 8);
    (as_bytes([s0, s1, s2, s3]), as_bytes([d0, d1, d2, d3]))
}

#[inline(always)]
fn ipv4(ctx: &XdpContext, offset: usize) -> Result<Packet, Verdict> {
    let ip = ptr_at::<Ipv4Hdr>(ctx, offset)?;
    let Some((header_len, frags, proto)) = ipv4_header(ip) else {
        return Err(Verdict::drop(stat::DROP_BAD_HEADER));
    };
    if frags & IPV4_MF_AND_OFFSET != 0 {
        return Err(Verdict::pass(stat::PASS_FRAGMENT));
    }
    let addresses = ipv4_addresses(ip);
    let l4 = offset + header_len;
    let mut packet = if proto == PROTO_ICMP {
        icmp_too_big(ctx, l4, ADDR_FAMILY_V4, addresses.1)?
    } else {
        transport(ctx, l4, (ADDR_FAMILY_V4, proto), addresses)?
    };
    packet.ipv4_options = header_len > Ipv4Hdr::LEN;
    Ok(packet)
}

#[inline(always)]
fn ipv6(ctx: &XdpContext, offset: usize) -> Result<Packet, Verdict> {
    let ip = ptr_at::<Ipv6Hdr>(ctx, offset)?;
    let Some(next) = ipv6_header(ip) else {
        return Err(Verdict::drop(stat::DROP_BAD_HEADER));
    };
    if next != PROTO_TCP && next != PROTO_UDP && next != PROTO_ICMPV6 {
        return Err(Verdict::pass(if is_ipv6_extension(next) {
            stat::PASS_IPV6_EXT
        } else {
            stat::PASS_OTHER_PROTO
        }));
    }
    let addresses = ipv6_addresses(ip);
    if next == PROTO_ICMPV6 {
        return icmp_too_big(ctx, offset + Ipv6Hdr::LEN, ADDR_FAMILY_V6, addresses.1);
    }
    transport(
        ctx,
        offset + Ipv6Hdr::LEN,
        (ADDR_FAMILY_V6, next),
        addresses,
    )
}

/// An ICMP(v6) message at `offset`, sent to `to`: a "too big" error quoting a packet
/// that `to` sent over TCP or UDP is parsed as the flow of that packet, turned around
/// (client to VIP), so it takes the flow's way to its backend. Everything else passes.
#[inline(always)]
fn icmp_too_big(
    ctx: &XdpContext,
    offset: usize,
    family: u8,
    to: [u8; 16],
) -> Result<Packet, Verdict> {
    let other = Verdict::pass(stat::PASS_OTHER_PROTO);
    let icmp = ptr_at::<[u8; 2]>(ctx, offset).map_err(|_| other)?;
    let (kind, code) = unsafe { ((*icmp)[0], (*icmp)[1]) };
    let quoted = offset + ICMP_HDR_LEN;
    // The quoted header: its protocol, source (the VIP), destination (the client) and
    // the offset of its transport header.
    let (proto, (vip, client), l4) = if family == ADDR_FAMILY_V4 {
        if kind != ICMP_UNREACHABLE || code != ICMP_FRAG_NEEDED {
            return Err(other);
        }
        let ip = ptr_at::<Ipv4Hdr>(ctx, quoted).map_err(|_| other)?;
        // A later fragment quotes no ports.
        let (header_len, _, proto) = ipv4_header(ip)
            .filter(|(_, frags, _)| frags & IPV4_OFFSET == 0)
            .ok_or(other)?;
        (proto, ipv4_addresses(ip), quoted + header_len)
    } else {
        if kind != ICMPV6_TOO_BIG {
            return Err(other);
        }
        let ip = ptr_at::<Ipv6Hdr>(ctx, quoted).map_err(|_| other)?;
        let proto = ipv6_header(ip).ok_or(other)?;
        (proto, ipv6_addresses(ip), quoted + Ipv6Hdr::LEN)
    };
    // Only about a packet the VIP sent: the error goes back to the packet's source.
    if (proto != PROTO_TCP && proto != PROTO_UDP) || !same_address(&vip, &to) {
        return Err(other);
    }
    let ports = ptr_at::<[u16; 2]>(ctx, l4).map_err(|_| other)?;
    let [vip_port, client_port] = unsafe { *ports };
    Ok(Packet {
        icmp_too_big: true,
        ..Packet::of_flow((client, vip), (family, proto), (client_port, vip_port))
    })
}

/// Branch-free compare of two addresses (an array `==` is a byte loop in BPF).
#[inline(always)]
fn same_address(a: &[u8; 16], b: &[u8; 16]) -> bool {
    let a = unsafe { core::mem::transmute::<[u8; 16], [u64; 2]>(*a) };
    let b = unsafe { core::mem::transmute::<[u8; 16], [u64; 2]>(*b) };
    (a[0] ^ b[0]) | (a[1] ^ b[1]) == 0
}

/// Hop-by-hop, routing, fragment, ESP, AH, destination options, mobility, HIP, shim6.
#[inline(always)]
fn is_ipv6_extension(next: u8) -> bool {
    matches!(next, 0 | 43 | 44 | 50 | 51 | 60 | 135 | 139 | 140)
}

/// `N` words (network order, as in the packet) at `offset` bytes past `header`, whose
/// bounds the caller checked. Word loads, not byte loads: packet data after a 14-byte
/// Ethernet header is only 2-byte aligned, which the kernel's loads allow on the
/// architectures it JITs for (the verifier enforces alignment only with
/// BPF_F_STRICT_ALIGNMENT), while a byte-array read costs a load and a spill per byte.
/// An aligned `ptr::read` of a 2-byte-aligned address is undefined in Rust's terms; for
/// the BPF target it is exactly one load (`read_unaligned` would become byte loads).
#[inline(always)]
fn load_words<const N: usize>(header: *const u8, offset: usize) -> [u32; N] {
    let mut words = [0u32; N];
    for (i, word) in words.iter_mut().enumerate() {
        *word = unsafe { core::ptr::read(header.add(offset + 4 * i) as *const u32) };
    }
    words
}

/// An address as the bytes it is in memory (and in the packet).
#[inline(always)]
fn as_bytes(words: [u32; 4]) -> [u8; 16] {
    unsafe { core::mem::transmute::<[u32; 4], [u8; 16]>(words) }
}

#[inline(always)]
fn transport(
    ctx: &XdpContext,
    offset: usize,
    (family, proto): (u8, u8),
    addresses: ([u8; 16], [u8; 16]),
) -> Result<Packet, Verdict> {
    let (src_port, dst_port, syn, rst, fin) = match proto {
        PROTO_TCP => {
            let tcp = ptr_at::<TcpHdr>(ctx, offset)?;
            let tcp = unsafe { &*tcp };
            (
                tcp.source,
                tcp.dest,
                tcp.syn() != 0 && tcp.ack() == 0,
                tcp.rst() != 0,
                tcp.fin() != 0,
            )
        }
        PROTO_UDP => {
            let udp = ptr_at::<UdpHdr>(ctx, offset)?;
            let udp = unsafe { &*udp };
            (udp.src, udp.dst, false, false, false)
        }
        _ => return Err(Verdict::pass(stat::PASS_OTHER_PROTO)),
    };
    let ports = (u16::from_ne_bytes(src_port), u16::from_ne_bytes(dst_port));
    // Read only for a QUIC VIP (`crate::quic::window`), bounds-checked there.
    let payload_at = if proto == PROTO_UDP {
        (offset + UdpHdr::LEN) as u16
    } else {
        0
    };
    Ok(Packet {
        syn,
        rst,
        fin,
        payload_at,
        ..Packet::of_flow(addresses, (family, proto), ports)
    })
}
