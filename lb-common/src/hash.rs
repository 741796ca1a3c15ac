//! The flow hash (run per packet in the kernel and by `lb explain` in userspace) and the
//! stable hash that seeds Maglev permutations.

use crate::{ADDR_FAMILY_V4, VIP_F_HASH_SRC_IP, VIP_F_HOT_SOURCES};

/// The fields of a packet that choose its backend.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlowTuple {
    /// Source address as big-endian words: IPv4 uses word 0 only, the rest are zero.
    pub src: [u32; 4],
    /// Destination address, as `src`.
    pub dst: [u32; 4],
    /// Host order.
    pub src_port: u16,
    /// Host order.
    pub dst_port: u16,
    pub proto: u8,
    /// `ADDR_FAMILY_V4` or `ADDR_FAMILY_V6`.
    pub family: u8,
}

// MurmurHash3 (x86_32) block mixing and finalizer: a few multiplies and rotates per word,
// no tables and no loops with a variable bound, which keeps the verifier and the per-packet
// cost happy, and avalanches well enough for `hash % prime`.
const C1: u32 = 0xcc9e_2d51;
const C2: u32 = 0x1b87_3593;
const SEED: u32 = 0x4c42_5f31; // "LB_1": changing it moves every flow.

#[inline(always)]
const fn mix(h: u32, k: u32) -> u32 {
    let k = k.wrapping_mul(C1).rotate_left(15).wrapping_mul(C2);
    (h ^ k)
        .rotate_left(13)
        .wrapping_mul(5)
        .wrapping_add(0xe654_6b64)
}

/// MurmurHash3's finaliser: every input bit moves every output bit.
#[inline(always)]
pub const fn finish(mut h: u32) -> u32 {
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^ (h >> 16)
}

#[inline(always)]
fn mix_addr(h: u32, addr: &[u32; 4], family: u8) -> u32 {
    if family == ADDR_FAMILY_V4 {
        mix(h, addr[0])
    } else {
        mix(mix(mix(mix(h, addr[0]), addr[1]), addr[2]), addr[3])
    }
}

/// The hash a flow is balanced by. With `src_only` just the source address counts
/// (client affinity); otherwise the whole 5-tuple (per-connection balancing).
#[inline(always)]
pub fn flow_hash(flow: &FlowTuple, src_only: bool) -> u32 {
    let h = mix_addr(SEED, &flow.src, flow.family);
    if src_only {
        return finish(h);
    }
    let h = mix_addr(h, &flow.dst, flow.family);
    let h = mix(h, ((flow.src_port as u32) << 16) | flow.dst_port as u32);
    finish(mix(h, flow.proto as u32))
}

/// The hash a VIP's table is indexed by for a flow without a held backend, given the
/// VIP's `VIP_F_*` flags, and whether the flow was spread: a src-ip VIP hashes the
/// source only, unless it has hot sources (`VIP_F_HOT_SOURCES`) and `is_hot` says the
/// source is one of them; then the whole 5-tuple (per connection). `is_hot` (a map
/// lookup in the kernel) is called only for such a VIP.
#[inline(always)]
pub fn table_hash(flow: &FlowTuple, flags: u32, is_hot: impl FnOnce() -> bool) -> (u32, bool) {
    let src_only = flags & VIP_F_HASH_SRC_IP != 0;
    let spread = src_only && flags & VIP_F_HOT_SOURCES != 0 && is_hot();
    (flow_hash(flow, src_only && !spread), spread)
}

/// Where a VIP's table of `table_size` slots puts a flow without a held backend:
/// `table_hash`'s hash, the slot it indexes (`maglev_slot`), and whether the flow was
/// spread. The program, `lb explain` and the agent's scan of stable slots all place a
/// flow here.
#[inline(always)]
pub fn table_place(
    flow: &FlowTuple,
    flags: u32,
    table_size: u32,
    is_hot: impl FnOnce() -> bool,
) -> (u32, u32, bool) {
    let (hash, spread) = table_hash(flow, flags, is_hot);
    (hash, crate::maglev_slot(hash, table_size), spread)
}

/// Odd multipliers of `vip_key_hash`, one per 64-bit word of the key.
const VIP_K: [u64; 3] = [
    0x9e37_79b9_7f4a_7c15,
    0xc2b2_ae3d_27d4_eb4f,
    0x1656_67b1_9e37_79f9,
];

/// The hash of a VIP key (for `VipSlot::index`, which takes its top bits): every packet
/// computes it, VIP or not. Multiply-shift over the key's three 64-bit words (addresses,
/// then port, protocol and family), summed: three independent multiplies instead of
/// MurmurHash3's chain of rounds, which cost an established packet 6-8 ns here (and a
/// packet for no VIP a third of its cost). The top bits of such a sum depend on every
/// input bit.
#[inline(always)]
pub fn vip_key_hash(key: &crate::VipKey) -> u32 {
    let w = bytemuck::cast::<crate::VipKey, [u32; 5]>(*key).map(u32::from_le);
    let word = |lo: u32, hi: u32| lo as u64 | (hi as u64) << 32;
    let h = word(w[0], w[1])
        .wrapping_mul(VIP_K[0])
        .wrapping_add(word(w[2], w[3]).wrapping_mul(VIP_K[1]))
        .wrapping_add(word(w[4], 0).wrapping_mul(VIP_K[2]));
    (h >> 32) as u32
}

/// A 64-bit hash that never changes between runs, builds or machines (FNV-1a, then the
/// splitmix64 finalizer to spread FNV's weak low bits). Seeds Maglev permutations, so
/// identically configured balancers build identical tables.
pub const fn stable_hash64(bytes: &[u8], seed: u64) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ seed;
    let mut i = 0;
    while i < bytes.len() {
        h ^= bytes[i] as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
        i += 1;
    }
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v4(src: u32, dst: u32, sport: u16, dport: u16) -> FlowTuple {
        FlowTuple {
            src: [src, 0, 0, 0],
            dst: [dst, 0, 0, 0],
            src_port: sport,
            dst_port: dport,
            proto: 6,
            family: ADDR_FAMILY_V4,
        }
    }

    #[test]
    fn flow_hash_is_stable_across_releases() {
        // Pinned values: a change here moves every established flow on upgrade.
        assert_eq!(
            flow_hash(&v4(0x0a00_0001, 0x0a00_0064, 40000, 80), false),
            0x2fb5_dc4d
        );
        assert_eq!(
            flow_hash(&v4(0x0a00_0001, 0x0a00_0064, 40000, 80), true),
            0x804c_e80e
        );
        assert_eq!(stable_hash64(b"10.0.0.11", 0), 0xa0ce_f8d6_2b05_2421);
    }

    #[test]
    fn every_field_of_the_tuple_counts() {
        let base = v4(0x0a00_0001, 0x0a00_0064, 40000, 80);
        let h = flow_hash(&base, false);
        let variants = [
            v4(0x0a00_0002, 0x0a00_0064, 40000, 80),
            v4(0x0a00_0001, 0x0a00_0065, 40000, 80),
            v4(0x0a00_0001, 0x0a00_0064, 40001, 80),
            v4(0x0a00_0001, 0x0a00_0064, 40000, 81),
            FlowTuple { proto: 17, ..base },
        ];
        for v in variants {
            assert_ne!(flow_hash(&v, false), h, "{v:?}");
        }
    }

    #[test]
    fn src_only_ignores_ports_and_destination() {
        let a = v4(0x0a00_0001, 0x0a00_0064, 40000, 80);
        let b = v4(0x0a00_0001, 0x0a00_0099, 50000, 443);
        assert_eq!(flow_hash(&a, true), flow_hash(&b, true));
    }

    #[test]
    fn a_hot_source_of_a_src_ip_vip_is_hashed_per_connection() {
        let a = v4(0x0a00_0001, 0x0a00_0064, 40000, 80);
        let b = v4(0x0a00_0001, 0x0a00_0064, 40001, 80);
        let hot_vip = VIP_F_HASH_SRC_IP | VIP_F_HOT_SOURCES;
        // Cold: by source; hot: by 5-tuple, so two ports of one source differ.
        assert_eq!(
            table_hash(&a, hot_vip, || false),
            (flow_hash(&a, true), false)
        );
        assert_eq!(
            table_hash(&a, hot_vip, || true),
            (flow_hash(&a, false), true)
        );
        assert_ne!(
            table_hash(&a, hot_vip, || true),
            table_hash(&b, hot_vip, || true)
        );
        // Without the flag (or on a 5-tuple VIP) the hot set is never looked at.
        let never = || -> bool { panic!("looked up") };
        assert_eq!(
            table_hash(&a, VIP_F_HASH_SRC_IP, never),
            (flow_hash(&a, true), false)
        );
        assert_eq!(table_hash(&a, 0, never), (flow_hash(&a, false), false));
        assert_eq!(
            table_hash(&a, VIP_F_HOT_SOURCES, never),
            (flow_hash(&a, false), false)
        );
    }

    #[test]
    fn ports_spread_evenly_over_a_prime_table() {
        // Sequential source ports (what one client produces) must not cluster.
        let buckets = 7u32;
        let mut counts = [0u32; 7];
        for port in 0..70_000u32 {
            let h = flow_hash(&v4(0x0a00_0001, 0x0a00_0064, port as u16, 80), false);
            counts[(h % buckets) as usize] += 1;
        }
        for c in counts {
            assert!((9_000..=11_000).contains(&c), "{counts:?}");
        }
    }
}
