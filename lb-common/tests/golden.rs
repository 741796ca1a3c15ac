//! Golden values: the flow hash (IPv4 and IPv6) and a small Maglev table, pinned.
//!
//! A flow keeps its backend across an agent upgrade (the pinned connection table is
//! adopted, but a flow without an entry is hashed again) and across the nodes of a
//! cluster or an ECMP group only while every version and every node computes the same
//! hash and the same table. A change to any value below moves established flows: it is a
//! breaking change, to be made on purpose and announced, never by accident.

use std::net::{IpAddr, SocketAddr};

use lb_common::maglev::{MaglevBackend, build_table};
use lb_common::{BACKEND_NONE, FlowKey, PROTO_TCP, PROTO_UDP, flow_hash};

/// The hash the program computes for a packet from `client` to `vip`, through the map
/// form the program reads (network-order bytes), both ways: per connection and by
/// source only.
fn hashes(client: &str, vip: &str, proto: u8) -> (u32, u32) {
    let client: SocketAddr = client.parse().unwrap();
    let vip: SocketAddr = vip.parse().unwrap();
    let tuple = FlowKey::between(client, vip, proto).tuple();
    (flow_hash(&tuple, false), flow_hash(&tuple, true))
}

#[test]
fn the_ipv4_flow_hash_is_pinned() {
    let golden = [
        // (client, vip, proto, 5-tuple hash, source-only hash)
        (
            "10.0.0.1:40000",
            "10.0.0.100:80",
            PROTO_TCP,
            0x2fb5_dc4d,
            0x804c_e80e,
        ),
        (
            "192.168.7.33:65535",
            "10.0.0.100:80",
            PROTO_TCP,
            0x654b_3639,
            0xfd63_21d5,
        ),
        (
            "10.0.0.1:40000",
            "10.0.0.100:53",
            PROTO_UDP,
            0x258f_39fc,
            0x804c_e80e,
        ),
        (
            "203.0.113.250:1",
            "198.51.100.9:443",
            PROTO_TCP,
            0x828a_ffed,
            0xac38_570b,
        ),
    ];
    check(&golden);
}

#[test]
fn the_ipv6_flow_hash_is_pinned() {
    let golden = [
        (
            "[fd00::1]:40000",
            "[fd00::100]:80",
            PROTO_TCP,
            0x5bf1_03b5,
            0xa20e_85dc,
        ),
        (
            "[2001:db8:1:2:3:4:5:6]:65535",
            "[fd00::100]:80",
            PROTO_TCP,
            0x77fa_c59c,
            0xc4fb_8ab3,
        ),
        (
            "[fd00::1]:40000",
            "[fd00::100]:53",
            PROTO_UDP,
            0x246f_ba1e,
            0xa20e_85dc,
        ),
        // An IPv4-mapped client: 16 bytes like any IPv6 address, not the IPv4 hash.
        (
            "[::ffff:10.0.0.1]:40000",
            "[fd00::100]:80",
            PROTO_TCP,
            0x4d21_aaf4,
            0x6075_e3b2,
        ),
    ];
    check(&golden);
}

fn check(golden: &[(&str, &str, u8, u32, u32)]) {
    let mut wrong = Vec::new();
    for &(client, vip, proto, want_tuple, want_src) in golden {
        let (tuple, src) = hashes(client, vip, proto);
        if (tuple, src) != (want_tuple, want_src) {
            wrong.push(format!(
                "{client} -> {vip} proto {proto}: 5-tuple {tuple:#010x} (golden \
                 {want_tuple:#010x}), source-only {src:#010x} (golden {want_src:#010x})"
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "the flow hash changed: every established flow moves on upgrade, and nodes of \
         different versions disagree:\n{}",
        wrong.join("\n")
    );
}

/// FNV-1a over the table's slots (little-endian words): written here, not taken from
/// lb-common, so a change there cannot change both sides at once.
fn checksum(table: &[u32]) -> u64 {
    table
        .iter()
        .flat_map(|slot| slot.to_le_bytes())
        .fold(0xcbf2_9ce4_8422_2325u64, |h, byte| {
            (h ^ byte as u64).wrapping_mul(0x0000_0100_0000_01b3)
        })
}

fn backend(id: u32, address: &str, weight: u32) -> MaglevBackend {
    MaglevBackend {
        id,
        address: address.parse::<IpAddr>().unwrap(),
        weight,
    }
}

#[test]
fn a_small_maglev_table_is_pinned() {
    // Mixed families and weights, over a small prime: what nodes of a cluster must agree
    // on slot for slot.
    let backends = [
        backend(0, "10.0.0.11", 1),
        backend(1, "10.0.0.12", 2),
        backend(2, "10.0.0.13", 1),
        backend(3, "fd00::14", 3),
    ];
    let table = build_table(&backends, 251);
    assert!(!table.contains(&BACKEND_NONE), "every slot filled");
    let counts: Vec<usize> = (0..4)
        .map(|id| table.iter().filter(|&&slot| slot == id).count())
        .collect();
    assert_eq!(
        (checksum(&table), &table[..12], counts.as_slice()),
        (
            0x8381_1825_fc87_0076,
            &[3u32, 3, 1, 3, 3, 2, 3, 3, 1, 3, 0, 1][..],
            &[36usize, 72, 36, 107][..]
        ),
        "the Maglev table changed: nodes of different versions would send one flow to \
         different backends"
    );
    // The order backends are listed in does not matter, only the set.
    let mut reversed = backends;
    reversed.reverse();
    assert_eq!(build_table(&reversed, 251), table);
}
