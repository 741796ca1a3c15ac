//! Addresses as the maps hold them, and their conversions, in one place.
//!
//! A map address is 16 bytes in network order with a family beside it: IPv4 in the first
//! 4 bytes and the rest zero (`ADDR_FAMILY_V4`), IPv6 in all 16 (`ADDR_FAMILY_V6`). The
//! flow hash takes the same address as host-order words (`FlowTuple`).

use crate::{FlowKey, FlowTuple};

/// A map address as the flow hash's words (host order; IPv4: word 0, the rest zero).
#[inline(always)]
pub fn words(addr: &[u8; 16]) -> [u32; 4] {
    // Whole words, each byte-swapped: no byte-by-byte assembly in the program.
    bytemuck::cast::<[u8; 16], [u32; 4]>(*addr).map(u32::from_be)
}

impl FlowTuple {
    /// The tuple of a flow between two map addresses, ports in network order: how the
    /// program hashes a packet, and `lb explain` a flow (`FlowKey::tuple`).
    #[inline(always)]
    pub fn of_map(
        (src, dst): (&[u8; 16], &[u8; 16]),
        (src_port_be, dst_port_be): (u16, u16),
        proto: u8,
        family: u8,
    ) -> FlowTuple {
        FlowTuple {
            src: words(src),
            dst: words(dst),
            src_port: u16::from_be(src_port_be),
            dst_port: u16::from_be(dst_port_be),
            proto,
            family,
        }
    }
}

impl FlowKey {
    /// The fields of the flow the hash takes.
    #[inline(always)]
    pub fn tuple(&self) -> FlowTuple {
        let ports = (self.src_port, self.dst_port);
        FlowTuple::of_map((&self.src, &self.dst), ports, self.proto, self.family)
    }

    /// The key of the VIP the flow is to.
    #[inline(always)]
    pub fn vip_key(&self) -> crate::VipKey {
        crate::VipKey {
            addr: self.dst,
            port: self.dst_port,
            proto: self.proto,
            family: self.family,
        }
    }
}

#[cfg(any(feature = "std", test))]
mod user {
    use std::net::{IpAddr, SocketAddr};

    use crate::{ADDR_FAMILY_V4, ADDR_FAMILY_V6, FlowKey};

    /// `address` as a map holds it: its bytes and its family.
    pub fn to_map(address: IpAddr) -> ([u8; 16], u8) {
        let mut bytes = [0u8; 16];
        match address {
            IpAddr::V4(a) => {
                bytes[..4].copy_from_slice(&a.octets());
                (bytes, ADDR_FAMILY_V4)
            }
            IpAddr::V6(a) => (a.octets(), ADDR_FAMILY_V6),
        }
    }

    /// The address a map's bytes and family name (any family but `ADDR_FAMILY_V4` is
    /// IPv6).
    pub fn from_map(bytes: &[u8; 16], family: u8) -> IpAddr {
        if family == ADDR_FAMILY_V4 {
            IpAddr::from([bytes[0], bytes[1], bytes[2], bytes[3]])
        } else {
            IpAddr::from(*bytes)
        }
    }

    impl FlowKey {
        /// The connection-table key of the flow from `client` to `vip` over `proto`. The
        /// family is the client's (both are of one family in any flow the program sees).
        pub fn between(client: SocketAddr, vip: SocketAddr, proto: u8) -> Self {
            let (src, family) = to_map(client.ip());
            let (dst, _) = to_map(vip.ip());
            FlowKey {
                src,
                dst,
                src_port: client.port().to_be(),
                dst_port: vip.port().to_be(),
                proto,
                family,
                _pad: [0; 2],
            }
        }
    }
}

#[cfg(any(feature = "std", test))]
pub use user::{from_map, to_map};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ADDR_FAMILY_V4, ADDR_FAMILY_V6, PROTO_TCP};
    use std::net::{IpAddr, SocketAddr};

    #[test]
    fn addresses_round_trip_through_the_map_form() {
        for text in ["10.0.0.1", "255.1.2.3", "fd00::1", "::ffff:10.0.0.1", "::"] {
            let address: IpAddr = text.parse().unwrap();
            let (bytes, family) = to_map(address);
            assert_eq!(from_map(&bytes, family), address, "{text}");
        }
        let (v4, family) = to_map("10.0.0.1".parse().unwrap());
        assert_eq!(
            (v4, family),
            ([10, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], 4)
        );
        let (v6, family) = to_map("fd00::1".parse().unwrap());
        assert_eq!((v6[0], v6[15], family), (0xfd, 1, ADDR_FAMILY_V6));
        assert_eq!(
            words(&v4),
            [0x0a00_0001, 0, 0, 0],
            "host-order words, IPv4 in word 0"
        );
        assert_eq!(words(&v6)[0], 0xfd00_0000);
    }

    #[test]
    fn a_flow_key_is_in_network_order_and_its_tuple_in_host_order() {
        let client: SocketAddr = "10.0.0.1:40000".parse().unwrap();
        let vip: SocketAddr = "10.0.0.100:80".parse().unwrap();
        let key = FlowKey::between(client, vip, PROTO_TCP);
        assert_eq!(&key.src[..4], &[10, 0, 0, 1]);
        assert_eq!(&key.dst[..4], &[10, 0, 0, 100]);
        assert_eq!(key.src_port.to_ne_bytes(), 40000u16.to_be_bytes());
        assert_eq!(key.dst_port.to_ne_bytes(), 80u16.to_be_bytes());
        assert_eq!(key.family, ADDR_FAMILY_V4);
        let tuple = key.tuple();
        assert_eq!(tuple.src, [0x0a00_0001, 0, 0, 0]);
        assert_eq!(tuple.dst, [0x0a00_0064, 0, 0, 0]);
        assert_eq!((tuple.src_port, tuple.dst_port), (40000, 80));
        assert_eq!((tuple.proto, tuple.family), (PROTO_TCP, ADDR_FAMILY_V4));
    }
}
