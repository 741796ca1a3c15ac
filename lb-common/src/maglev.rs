//! Maglev consistent hashing (Eisenbud et al., NSDI 2016), with weights.
//!
//! Each backend walks its own permutation of the table's slots, seeded by a stable hash
//! of its address, and claims the next free slot in turn until the table is full. With
//! equal weights every backend ends up with `M/N` slots (rounded either way), and
//! removing one backend moves little more than that backend's own slots.

use std::net::IpAddr;

use crate::{BACKEND_NONE, stable_hash64};

/// One backend as the table builder sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MaglevBackend {
    /// What the table's slots hold for this backend.
    pub id: u32,
    /// Seeds the permutation: the same address gives the same permutation everywhere.
    pub address: IpAddr,
    /// Relative share of slots; 0 takes no slots.
    pub weight: u32,
}

/// Is `n` prime? (Table sizes must be: the permutations below need `skip` coprime to M.)
pub fn is_prime(n: u32) -> bool {
    if n < 2 {
        return false;
    }
    if n.is_multiple_of(2) {
        return n == 2;
    }
    let mut d = 3u32;
    while (d as u64) * (d as u64) <= n as u64 {
        if n.is_multiple_of(d) {
            return false;
        }
        d += 2;
    }
    true
}

fn address_bytes(address: &IpAddr) -> ([u8; 16], usize) {
    let mut out = [0u8; 16];
    match address {
        IpAddr::V4(a) => {
            out[..4].copy_from_slice(&a.octets());
            (out, 4)
        }
        IpAddr::V6(a) => {
            out.copy_from_slice(&a.octets());
            (out, 16)
        }
    }
}

/// `(offset, skip)` of a backend's permutation: slot j of it is `(offset + j*skip) % size`.
pub fn permutation(address: &IpAddr, size: u32) -> (u32, u32) {
    let (bytes, len) = address_bytes(address);
    let offset = stable_hash64(&bytes[..len], 0x6f66_6673_6574) % size as u64; // "offset"
    let skip = stable_hash64(&bytes[..len], 0x736b_6970) % (size as u64 - 1) + 1; // "skip"
    (offset as u32, skip as u32)
}

/// Builds a table of `size` slots (a prime) over `backends`. Slots hold backend ids;
/// with no backend of positive weight every slot is `BACKEND_NONE`.
///
/// The result depends only on the set of (address, weight, id), not on the order of
/// `backends`: ties between backends are broken by address.
pub fn build_table(backends: &[MaglevBackend], size: u32) -> Vec<u32> {
    assert!(is_prime(size), "Maglev table size {size} is not a prime");
    let mut table = vec![BACKEND_NONE; size as usize];
    let mut live: Vec<&MaglevBackend> = backends.iter().filter(|b| b.weight > 0).collect();
    if live.is_empty() {
        return table;
    }
    live.sort_by_key(|b| b.address);
    let max_weight = live.iter().map(|b| b.weight).max().unwrap_or(1) as u64;

    struct Walk {
        id: u32,
        weight: u64,
        position: u64,
        skip: u64,
        credit: u64,
    }
    let mut walks: Vec<Walk> = live
        .iter()
        .map(|b| {
            let (offset, skip) = permutation(&b.address, size);
            Walk {
                id: b.id,
                weight: b.weight as u64,
                position: offset as u64,
                skip: skip as u64,
                credit: 0,
            }
        })
        .collect();

    // Weights: each round a backend earns `weight` credit and claims a slot per
    // `max_weight` of credit, so shares follow the weights exactly up to rounding.
    let size64 = size as u64;
    let mut filled = 0u32;
    loop {
        for walk in walks.iter_mut() {
            walk.credit += walk.weight;
            while walk.credit >= max_weight {
                walk.credit -= max_weight;
                while table[walk.position as usize] != BACKEND_NONE {
                    walk.position = (walk.position + walk.skip) % size64;
                }
                table[walk.position as usize] = walk.id;
                walk.position = (walk.position + walk.skip) % size64;
                filled += 1;
                if filled == size {
                    return table;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::net::Ipv4Addr;

    const M: u32 = 65537;

    fn backends(n: u32) -> Vec<MaglevBackend> {
        (0..n)
            .map(|i| MaglevBackend {
                id: i,
                address: IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + i + 1)),
                weight: 1,
            })
            .collect()
    }

    fn shares(table: &[u32]) -> HashMap<u32, usize> {
        let mut counts = HashMap::new();
        for &id in table {
            *counts.entry(id).or_default() += 1;
        }
        counts
    }

    #[test]
    fn primes() {
        assert!(is_prime(65537) && is_prime(655373) && is_prime(7) && is_prime(2));
        assert!(!is_prime(65536) && !is_prime(1) && !is_prime(0) && !is_prime(65535));
    }

    #[test]
    fn empty_set_gives_empty_table() {
        assert!(build_table(&[], 7).iter().all(|&s| s == BACKEND_NONE));
        let zero = [MaglevBackend {
            weight: 0,
            ..backends(1)[0]
        }];
        assert!(build_table(&zero, 7).iter().all(|&s| s == BACKEND_NONE));
    }

    #[test]
    fn equal_backends_get_equal_shares() {
        for n in [1, 3, 10, 100, 650] {
            let table = build_table(&backends(n), M);
            let counts = shares(&table);
            assert_eq!(counts.len(), n as usize);
            let average = M as f64 / n as f64;
            let busiest = *counts.values().max().unwrap() as f64;
            assert!(
                busiest / average <= 1.01,
                "n={n}: busiest/average {}",
                busiest / average
            );
        }
    }

    #[test]
    fn removing_one_backend_moves_few_other_slots() {
        for n in [3, 10, 100, 400] {
            let all = backends(n);
            let before = build_table(&all, M);
            let removed = n / 2;
            let rest: Vec<_> = all.iter().copied().filter(|b| b.id != removed).collect();
            let after = build_table(&rest, M);
            let others = before.iter().filter(|&&id| id != removed).count();
            let moved = before
                .iter()
                .zip(&after)
                .filter(|(b, a)| **b != removed && b != a)
                .count();
            let fraction = moved as f64 / others as f64;
            assert!(
                fraction <= 0.01,
                "n={n}: {moved} of {others} slots of other backends moved"
            );
        }
    }

    #[test]
    fn weights_are_honoured() {
        let mut set = backends(4);
        set[0].weight = 1;
        set[1].weight = 2;
        set[2].weight = 3;
        set[3].weight = 10;
        let counts = shares(&build_table(&set, M));
        let total: u32 = set.iter().map(|b| b.weight).sum();
        for b in &set {
            let expected = M as f64 * b.weight as f64 / total as f64;
            let got = counts[&b.id] as f64;
            assert!(
                (got - expected).abs() / expected <= 0.01,
                "{b:?}: {got} vs {expected}"
            );
        }
    }

    #[test]
    fn tables_do_not_depend_on_order_or_run() {
        let set = backends(50);
        let mut reversed = set.clone();
        reversed.reverse();
        assert_eq!(build_table(&set, M), build_table(&reversed, M));
        assert_eq!(build_table(&set, M), build_table(&set, M));
    }

    #[test]
    fn ipv6_backends_balance() {
        let set: Vec<_> = (0..5u32)
            .map(|i| MaglevBackend {
                id: i,
                address: format!("fd00::{}", i + 1).parse().unwrap(),
                weight: 1,
            })
            .collect();
        let counts = shares(&build_table(&set, 65537));
        assert_eq!(counts.len(), 5);
    }
}
