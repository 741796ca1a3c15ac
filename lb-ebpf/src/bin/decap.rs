//! The decapsulation object `lb-decap` (`lb decap attach`): an XDP program for backends
//! that strips the outer header of tunnel packets addressed to this host and passes the
//! inner packet to the stack, where the VIP on `lo` receives it. See `lb_common::decap`.
//!
//! Tunnels: IPIP (outer IPv4 protocol 4 or 41, outer IPv6 next header 4 or 41) and GUE
//! variant 1 (UDP to the configured port; the payload is the inner IP packet, IPv4 or
//! IPv6 by its version nibble). One 802.1Q tag is kept. The outer header is trusted as
//! far as lengths go: its checksums are not verified (a corrupted outer header still
//! carries an inner packet whose own checksums the stack checks).
//!
//! Untouched (XDP_PASS as it came, counted): anything else, including an outer header
//! cut short or malformed, an inner header that is not what the outer one announces,
//! GUE variant 0 (a GUE header), an outer IPv4 fragment, and tunnels to an address not
//! in `LB_DECAP_ADDRS`.
#![cfg_attr(target_arch = "bpf", no_std, no_main)]

// The panic handler and the licence.
#[cfg(target_arch = "bpf")]
use lb_ebpf as _;

#[cfg(target_arch = "bpf")]
mod program {
    use aya_ebpf::{
        bindings::xdp_action,
        helpers::bpf_xdp_adjust_head,
        macros::{map, xdp},
        maps::{Array, HashMap, PerCpuArray},
        programs::XdpContext,
    };
    use lb_common::{
        ADDR_FAMILY_V4, ADDR_FAMILY_V6, PROTO_UDP,
        decap::{CONFIG_ENTRIES, CONFIG_GUE_PORT, DecapOutcomes, HostAddr, MAX_ADDRS, stat},
    };

    /// 0 -> DecapOutcomes, per CPU. Read by `lb decap status`.
    #[map(name = "LB_DECAP_STATS")]
    static LB_DECAP_STATS: PerCpuArray<DecapOutcomes> = PerCpuArray::with_max_entries(1, 0);

    /// HostAddr -> 1: the outer destinations taken as this host's. Written by the loader.
    #[map(name = "LB_DECAP_ADDRS")]
    static LB_DECAP_ADDRS: HashMap<HostAddr, u8> = HashMap::with_max_entries(MAX_ADDRS, 0);

    /// `lb_common::decap::CONFIG_*` -> u32. Written by the loader.
    #[map(name = "LB_DECAP_CONFIG")]
    static LB_DECAP_CONFIG: Array<u32> = Array::with_max_entries(CONFIG_ENTRIES, 0);

    const ETH_HDR: usize = 14;
    const VLAN_HDR: usize = 4;
    const UDP_HDR: usize = 8;
    const IPV6_HDR: usize = 40;
    const ETH_P_IP: u16 = 0x0800;
    const ETH_P_IPV6: u16 = 0x86dd;
    const ETH_P_8021Q: u16 = 0x8100;
    const PROTO_IPIP: u8 = 4;
    const PROTO_IPV6: u8 = 41;

    #[xdp(frags)]
    pub fn lb_decap(ctx: XdpContext) -> u32 {
        let outcome = decapsulate(&ctx).unwrap_or_else(|reason| reason);
        if let Some(counts) = LB_DECAP_STATS.get_ptr_mut(0)
            && (outcome as usize) < stat::COUNT as usize
        {
            // Per-CPU memory: no other writer.
            unsafe { (*counts).counts[outcome as usize] += 1 };
        }
        if outcome == stat::DROP_FAILED {
            xdp_action::XDP_DROP
        } else {
            xdp_action::XDP_PASS
        }
    }

    /// A pointer to `N` bytes at `offset`, if the frame's first buffer holds them.
    #[inline(always)]
    fn bytes<const N: usize>(
        ctx: &XdpContext,
        offset: usize,
        short: u32,
    ) -> Result<*mut [u8; N], u32> {
        if ctx.data() + offset + N > ctx.data_end() {
            return Err(short);
        }
        Ok((ctx.data() + offset) as *mut [u8; N])
    }

    /// The counter of what happened: a `DECAP_*` when the frame was unwrapped.
    #[inline(always)]
    // The key goes to the map by reference: by value, the call copies it again.
    #[allow(clippy::needless_borrows_for_generic_args)]
    fn decapsulate(ctx: &XdpContext) -> Result<u32, u32> {
        let eth = bytes::<ETH_HDR>(ctx, 0, stat::PASS_NOT_TUNNEL)?;
        let mut ether_type = u16::from_be_bytes(unsafe { [(*eth)[12], (*eth)[13]] });
        let mut l3 = ETH_HDR;
        if ether_type == ETH_P_8021Q {
            let tag = bytes::<VLAN_HDR>(ctx, ETH_HDR, stat::PASS_NOT_TUNNEL)?;
            ether_type = u16::from_be_bytes(unsafe { [(*tag)[2], (*tag)[3]] });
            l3 += VLAN_HDR;
        }
        let malformed = stat::PASS_MALFORMED;
        // The outer header's length, the tunnel protocol and the destination.
        let (outer_v4, header_len, proto, dst) = match ether_type {
            ETH_P_IP => {
                let ip = unsafe { *bytes::<20>(ctx, l3, malformed)? };
                let header_len = ((ip[0] & 0x0f) as usize) * 4;
                if ip[0] >> 4 != 4 || header_len < 20 {
                    return Err(malformed);
                }
                let proto = ip[9];
                if !is_tunnel(proto) {
                    return Err(stat::PASS_NOT_TUNNEL);
                }
                if u16::from_be_bytes([ip[6], ip[7]]) & 0x3fff != 0 {
                    return Err(stat::PASS_FRAGMENT);
                }
                // As words: a zeroed byte array filled in compiles to a `memset` call.
                let dst = u32::from_ne_bytes([ip[16], ip[17], ip[18], ip[19]]);
                let dst: [u8; 16] = unsafe { core::mem::transmute([dst, 0u32, 0, 0]) };
                (true, header_len, proto, dst)
            }
            ETH_P_IPV6 => {
                let ip = bytes::<IPV6_HDR>(ctx, l3, malformed)?;
                let (version, next) = unsafe { ((*ip)[0] >> 4, (*ip)[6]) };
                if version != 6 {
                    return Err(malformed);
                }
                if !is_tunnel(next) {
                    return Err(stat::PASS_NOT_TUNNEL);
                }
                let dst = unsafe { *bytes::<16>(ctx, l3 + 24, malformed)? };
                (false, IPV6_HDR, next, dst)
            }
            _ => return Err(stat::PASS_NOT_TUNNEL),
        };
        let gue = proto == PROTO_UDP;
        if gue {
            let udp = bytes::<UDP_HDR>(ctx, l3 + header_len, malformed)?;
            let port = u16::from_be_bytes(unsafe { [(*udp)[2], (*udp)[3]] });
            let wanted = LB_DECAP_CONFIG.get(CONFIG_GUE_PORT).copied().unwrap_or(0);
            if wanted == 0 || port as u32 != wanted {
                return Err(stat::PASS_NOT_TUNNEL);
            }
        }
        let key = HostAddr {
            addr: dst,
            family: if outer_v4 {
                ADDR_FAMILY_V4
            } else {
                ADDR_FAMILY_V6
            },
            _pad: [0; 3],
        };
        if unsafe { LB_DECAP_ADDRS.get(&key) }.is_none() {
            return Err(stat::PASS_NOT_LOCAL);
        }
        let outer_len = header_len + if gue { UDP_HDR } else { 0 };
        // The inner header must be what the outer one announces, and whole.
        let inner_at = l3 + outer_len;
        let version = unsafe { (*bytes::<1>(ctx, inner_at, malformed)?)[0] } >> 4;
        let inner_v4 = match (proto, version) {
            (PROTO_IPIP, 4) | (PROTO_UDP, 4) => true,
            (PROTO_IPV6, 6) | (PROTO_UDP, 6) => false,
            _ => return Err(malformed),
        };
        if inner_v4 {
            let ip = bytes::<20>(ctx, inner_at, malformed)?;
            if (unsafe { (*ip)[0] } & 0x0f) < 5 {
                return Err(malformed);
            }
        } else {
            bytes::<IPV6_HDR>(ctx, inner_at, malformed)?;
        }
        strip(
            ctx,
            l3,
            outer_len,
            if inner_v4 { ETH_P_IP } else { ETH_P_IPV6 },
        )?;
        Ok(match (outer_v4, gue, inner_v4) {
            (true, false, true) => stat::DECAP_4IN4,
            (true, false, false) => stat::DECAP_6IN4,
            (false, false, true) => stat::DECAP_4IN6,
            (false, false, false) => stat::DECAP_6IN6,
            (true, true, _) => stat::DECAP_GUE4,
            (false, true, _) => stat::DECAP_GUE6,
        })
    }

    /// IPIP (4, 41) or UDP (maybe GUE).
    #[inline(always)]
    fn is_tunnel(proto: u8) -> bool {
        proto == PROTO_IPIP || proto == PROTO_IPV6 || proto == PROTO_UDP
    }

    /// Moves the Ethernet header (and a tag) `outer_len` bytes forward, over the end of
    /// the outer header, with the inner EtherType, and drops what is before it.
    #[inline(always)]
    fn strip(ctx: &XdpContext, l3: usize, outer_len: usize, ether_type: u16) -> Result<(), u32> {
        let failed = stat::DROP_FAILED;
        let head = unsafe { *bytes::<{ ETH_HDR + VLAN_HDR }>(ctx, 0, failed)? };
        let moved = bytes::<{ ETH_HDR + VLAN_HDR }>(ctx, outer_len, failed)?;
        unsafe {
            let moved = &mut *moved;
            // A word at a time: `copy_from_slice` here compiles to a call to a byte-wise
            // `memmove`, on every packet.
            let mut copy_word = |at: usize| {
                let word = u32::from_ne_bytes([head[at], head[at + 1], head[at + 2], head[at + 3]]);
                (moved.as_mut_ptr().add(at) as *mut u32).write_unaligned(word);
            };
            for at in [0, 4, 8] {
                copy_word(at);
            }
            if l3 > ETH_HDR {
                copy_word(12);
            }
            // The inner EtherType, after the tag if there is one.
            let [high, low] = ether_type.to_be_bytes();
            moved[l3 - 2] = high;
            moved[l3 - 1] = low;
        }
        if unsafe { bpf_xdp_adjust_head(ctx.ctx, outer_len as i32) } != 0 {
            return Err(failed);
        }
        Ok(())
    }
}

#[cfg(not(target_arch = "bpf"))]
fn main() {}
