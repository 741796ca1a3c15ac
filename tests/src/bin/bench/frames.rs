//! Test frames: Ethernet + IPv4/IPv6 + TCP/UDP, built byte by byte.

use std::net::IpAddr;

use lb_tests::client::checksum;

pub const TCP_SYN: u8 = 0x02;
pub const TCP_ACK: u8 = 0x10;
pub const TCP_FIN: u8 = 0x01;
pub const TCP_PSH: u8 = 0x08;

/// Where the source port sits in an untagged IPv4 frame without options.
pub const V4_SRC_PORT_AT: usize = 14 + 20;
/// Where the source address sits in an untagged IPv4 frame.
pub const V4_SRC_ADDR_AT: usize = 14 + 12;

#[derive(Clone, Copy, Debug)]
pub enum L4 {
    Tcp {
        flags: u8,
    },
    Udp,
    /// UDP carrying a QUIC short header whose connection ID names `server_id` (two
    /// bytes, QUIC-LB plaintext), then a packet number and 24 sealed bytes.
    QuicShort {
        server_id: u16,
    },
}

/// One frame from `src:sport` to `dst:dport` with 18 bytes of payload (a 72-byte IPv4
/// TCP frame: what a small request looks like on the wire).
pub struct Frame {
    pub dst_mac: [u8; 6],
    pub src_mac: [u8; 6],
    pub src: IpAddr,
    pub dst: IpAddr,
    pub sport: u16,
    pub dport: u16,
    pub l4: L4,
}

impl Frame {
    pub fn bytes(&self) -> Vec<u8> {
        let mut payload = b"GET / HTTP/1.1\r\n\r\n".to_vec();
        if let L4::QuicShort { server_id } = self.l4 {
            let mut cid = [0u8; 11];
            lb_common::quic::encode_cid(server_id.into(), 2, &[0x5a; 8], &mut cid);
            payload = [&[0x41][..], &cid, &[0xa7; 25]].concat();
        }
        let (proto, mut l4) = match self.l4 {
            L4::Tcp { flags } => {
                let mut h = vec![0u8; 20];
                h[4..8].copy_from_slice(&1u32.to_be_bytes());
                h[12] = 5 << 4;
                h[13] = flags;
                h[14..16].copy_from_slice(&64240u16.to_be_bytes());
                (6u8, h)
            }
            L4::Udp | L4::QuicShort { .. } => {
                let mut h = vec![0u8; 8];
                h[4..6].copy_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
                (17u8, h)
            }
        };
        l4[0..2].copy_from_slice(&self.sport.to_be_bytes());
        l4[2..4].copy_from_slice(&self.dport.to_be_bytes());
        l4.extend_from_slice(&payload);

        let mut f = Vec::with_capacity(128);
        f.extend_from_slice(&self.dst_mac);
        f.extend_from_slice(&self.src_mac);
        match (self.src, self.dst) {
            (IpAddr::V4(s), IpAddr::V4(d)) => {
                f.extend_from_slice(&0x0800u16.to_be_bytes());
                let mut ip = vec![0u8; 20];
                ip[0] = 0x45;
                ip[2..4].copy_from_slice(&((20 + l4.len()) as u16).to_be_bytes());
                ip[6] = 0x40; // don't fragment
                ip[8] = 64;
                ip[9] = proto;
                ip[12..16].copy_from_slice(&s.octets());
                ip[16..20].copy_from_slice(&d.octets());
                let c = checksum(&ip);
                ip[10..12].copy_from_slice(&c.to_be_bytes());
                f.extend(ip);
            }
            (IpAddr::V6(s), IpAddr::V6(d)) => {
                f.extend_from_slice(&0x86ddu16.to_be_bytes());
                let mut ip = vec![0u8; 40];
                ip[0] = 0x60;
                ip[4..6].copy_from_slice(&(l4.len() as u16).to_be_bytes());
                ip[6] = proto;
                ip[7] = 64;
                ip[8..24].copy_from_slice(&s.octets());
                ip[24..40].copy_from_slice(&d.octets());
                f.extend(ip);
            }
            _ => panic!("source and destination of different families"),
        }
        f.extend(l4);
        f
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipv4_tcp_layout() {
        let f = Frame {
            dst_mac: [2, 0, 0, 0, 0, 2],
            src_mac: [2, 0, 0, 0, 0, 1],
            src: "10.0.0.1".parse().unwrap(),
            dst: "10.0.0.100".parse().unwrap(),
            sport: 40000,
            dport: 80,
            l4: L4::Tcp { flags: TCP_SYN },
        }
        .bytes();
        assert_eq!(f.len(), 14 + 20 + 20 + 18);
        assert_eq!(
            &f[V4_SRC_PORT_AT..V4_SRC_PORT_AT + 2],
            &40000u16.to_be_bytes()
        );
        assert_eq!(&f[V4_SRC_ADDR_AT..V4_SRC_ADDR_AT + 4], &[10, 0, 0, 1]);
        assert_eq!(checksum(&f[14..34]), 0, "IPv4 header checksum");
    }
}
