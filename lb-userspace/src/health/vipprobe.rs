//! Health checks through the VIP (`[vip.health] target = "vip"`): the check is addressed
//! to the VIP and handed to that one backend the way its traffic is, so a pass proves the
//! backend holds the VIP, listens there and answers on the direct-return path.
//!
//! - `tcp`: a SYN to VIP:port from the balancer's own address; a SYN-ACK from the VIP
//!   passes (the balancer's kernel, which has no socket for it, answers it with a RST),
//!   a RST fails ("connection refused by the VIP").
//! - `udp` / `dns`: the datagram from a UDP socket of the balancer's; the reply comes from
//!   the VIP to that socket.
//!
//! Delivery: `forward = "l2"`, the IP packet in a frame to the backend's MAC. A tunnelled
//! VIP (`"ipip"`, `"gue"`), the packet wrapped as `lb-ebpf/src/encap.rs` wraps its
//! traffic (`encapsulate`: IPIP 4in4/6in6/6in4/4in6 by the backend's family, or GUE
//! variant 1 to the VIP's `gue_port`; outer source the data path's tunnel source, outer
//! IPv4 TTL 64, DF, ID 0; UDP checksum 0) in a frame to the next hop's MAC, the one the
//! backend's entry carries. Either way frames go out of the balancer's interface through
//! an AF_PACKET socket (the kernel adds the Ethernet header). Why not let the kernel add
//! the outer header (a raw socket of protocol 4/41, a UDP socket for GUE): its route may
//! leave by another interface or next hop than the data path's (which takes only the
//! route out of `dataplane.interface`, and the MAC the agent resolved for it), and a
//! configured `tunnel_source` need not be an address a socket can bind. Built here, the
//! probe shares the data path's interface, next hop, MAC and outer source, so it fails
//! where the traffic would. Only the flow hash is not the program's: a probe's outer UDP
//! source port (49152 + 14 bits) and IPv6 flow label come from a random number, as each
//! probe is a new flow anyway.
//!
//! The answers come straight from the backend to the balancer's own address, tunnel or
//! not (direct return): SYN-ACKs are read from a raw TCP socket, which gets a copy of
//! every TCP segment the host receives and disturbs none of the kernel's own
//! connections; only one from the VIP counts. `http` through the VIP is not supported (a
//! crafted handshake would need a TCP stack); config refuses it.

use std::{
    io,
    net::{IpAddr, SocketAddr},
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    time::{Duration, Instant},
};

use super::probe::{self, ProbeError};
use crate::config::{HealthConfig, HealthKind};

/// Where a check through the VIP goes: the VIP, the MAC its frames carry (the backend's,
/// or for a tunnel its next hop's), the interface to send from, the balancer's own
/// address there (of the VIP's family: the inner source, where answers come), and the
/// tunnel to wrap the check in, if the VIP's traffic is tunnelled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VipPath {
    pub vip: SocketAddr,
    pub mac: [u8; 6],
    pub ifindex: u32,
    pub source: IpAddr,
    pub tunnel: Option<Tunnel>,
}

/// The outer header of a tunnelled VIP's traffic to one backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tunnel {
    /// The outer source: the data path's (`Config::tunnel_source_for`), of the
    /// backend's family.
    pub source: IpAddr,
    /// The backend's own address.
    pub backend: IpAddr,
    /// GUE to this UDP port; `None`: IPIP.
    pub gue_port: Option<u16>,
}

const PROTO_IPIP: u8 = 4;
const PROTO_TCP: u8 = 6;
const PROTO_UDP: u8 = 17;
const PROTO_IPV6: u8 = 41;
const TCP_SYN: u8 = 0x02;
const TCP_RST: u8 = 0x04;
const TCP_ACK: u8 = 0x10;

/// The one's-complement sum of `data` (big-endian 16-bit words), not yet complemented.
fn sum(data: &[u8], mut acc: u32) -> u32 {
    for chunk in data.chunks(2) {
        acc += u32::from(u16::from_be_bytes([chunk[0], *chunk.get(1).unwrap_or(&0)]));
    }
    acc
}

fn fold(mut acc: u32) -> u16 {
    while acc > 0xffff {
        acc = (acc & 0xffff) + (acc >> 16);
    }
    !(acc as u16)
}

/// The TCP/UDP checksum of `segment` (its checksum field zero) from `src` to `dst`.
fn l4_checksum(src: IpAddr, dst: IpAddr, proto: u8, segment: &[u8]) -> u16 {
    let mut acc = 0;
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            acc = sum(&s.octets(), acc);
            acc = sum(&d.octets(), acc);
            acc += u32::from(proto) + segment.len() as u32;
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            acc = sum(&s.octets(), acc);
            acc = sum(&d.octets(), acc);
            acc += segment.len() as u32 + u32::from(proto);
        }
        _ => unreachable!("one family: checked by the caller"),
    }
    let checksum = fold(sum(segment, acc));
    // UDP sends a computed 0 as all ones (0 means "no checksum").
    if proto == PROTO_UDP && checksum == 0 {
        0xffff
    } else {
        checksum
    }
}

/// An IP packet (v4 or v6 by the addresses) carrying `segment` of protocol `proto`.
fn ip_packet(src: IpAddr, dst: IpAddr, proto: u8, segment: &[u8]) -> Vec<u8> {
    let mut packet = Vec::with_capacity(40 + segment.len());
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            let total = (20 + segment.len()) as u16;
            packet.extend_from_slice(&[0x45, 0]);
            packet.extend_from_slice(&total.to_be_bytes());
            // id 0, don't fragment, TTL 64.
            packet.extend_from_slice(&[0, 0, 0x40, 0, 64, proto, 0, 0]);
            packet.extend_from_slice(&s.octets());
            packet.extend_from_slice(&d.octets());
            let checksum = fold(sum(&packet, 0));
            packet[10..12].copy_from_slice(&checksum.to_be_bytes());
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            packet.extend_from_slice(&[0x60, 0, 0, 0]);
            packet.extend_from_slice(&(segment.len() as u16).to_be_bytes());
            packet.extend_from_slice(&[proto, 64]);
            packet.extend_from_slice(&s.octets());
            packet.extend_from_slice(&d.octets());
        }
        _ => unreachable!("one family: checked by the caller"),
    }
    packet.extend_from_slice(segment);
    packet
}

/// A TCP SYN from `source` to `vip` with sequence number `seq`, as an IP packet.
pub fn tcp_syn(source: SocketAddr, vip: SocketAddr, seq: u32) -> Vec<u8> {
    let mut tcp = Vec::with_capacity(20);
    tcp.extend_from_slice(&source.port().to_be_bytes());
    tcp.extend_from_slice(&vip.port().to_be_bytes());
    tcp.extend_from_slice(&seq.to_be_bytes());
    tcp.extend_from_slice(&[0, 0, 0, 0]);
    // Header of 5 words, SYN, window 64240, checksum, urgent pointer.
    tcp.extend_from_slice(&[0x50, TCP_SYN, 0xfa, 0xf0, 0, 0, 0, 0]);
    let checksum = l4_checksum(source.ip(), vip.ip(), PROTO_TCP, &tcp);
    tcp[16..18].copy_from_slice(&checksum.to_be_bytes());
    ip_packet(source.ip(), vip.ip(), PROTO_TCP, &tcp)
}

/// A UDP datagram from `source` to `vip` carrying `payload`, as an IP packet.
pub fn udp_datagram(source: SocketAddr, vip: SocketAddr, payload: &[u8]) -> Vec<u8> {
    let mut udp = Vec::with_capacity(8 + payload.len());
    udp.extend_from_slice(&source.port().to_be_bytes());
    udp.extend_from_slice(&vip.port().to_be_bytes());
    udp.extend_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
    udp.extend_from_slice(&[0, 0]);
    udp.extend_from_slice(payload);
    let checksum = l4_checksum(source.ip(), vip.ip(), PROTO_UDP, &udp);
    udp[6..8].copy_from_slice(&checksum.to_be_bytes());
    ip_packet(source.ip(), vip.ip(), PROTO_UDP, &udp)
}

/// The IP packet `inner` wrapped for `tunnel` as the data path wraps the VIP's traffic
/// (`lb-ebpf/src/encap.rs`). `entropy` gives the GUE source port (49152 + its top 14
/// bits) and an outer IPv6 header's flow label (its low 20 bits).
pub fn encapsulate(tunnel: &Tunnel, inner: &[u8], entropy: u32) -> Vec<u8> {
    let inner_proto = if inner[0] >> 4 == 4 {
        PROTO_IPIP
    } else {
        PROTO_IPV6
    };
    let mut packet = match tunnel.gue_port {
        None => ip_packet(tunnel.source, tunnel.backend, inner_proto, inner),
        Some(port) => {
            // Variant 1: no GUE header; checksum 0, as the program sends it.
            let mut udp = Vec::with_capacity(8 + inner.len());
            udp.extend_from_slice(&(49152 | (entropy >> 18) as u16).to_be_bytes());
            udp.extend_from_slice(&port.to_be_bytes());
            udp.extend_from_slice(&((8 + inner.len()) as u16).to_be_bytes());
            udp.extend_from_slice(&[0, 0]);
            udp.extend_from_slice(inner);
            ip_packet(tunnel.source, tunnel.backend, PROTO_UDP, &udp)
        }
    };
    if tunnel.backend.is_ipv6() {
        let label = (entropy & 0x000f_ffff).to_be_bytes();
        packet[1] |= label[1];
        packet[2..4].copy_from_slice(&label[2..4]);
    }
    packet
}

/// What the VIP answered a SYN.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SynAnswer {
    SynAck,
    Reset,
}

/// Whether the TCP segment `tcp`, from `from`, answers our SYN (sequence number `seq`)
/// from `source` to `vip`: the right ports and addresses, and it acknowledges `seq + 1`.
pub fn syn_answer(
    tcp: &[u8],
    from: IpAddr,
    source: SocketAddr,
    vip: SocketAddr,
    seq: u32,
) -> Option<SynAnswer> {
    if tcp.len() < 20 || from != vip.ip() {
        return None;
    }
    let port = |at: usize| u16::from_be_bytes([tcp[at], tcp[at + 1]]);
    if port(0) != vip.port() || port(2) != source.port() {
        return None;
    }
    let ack = u32::from_be_bytes([tcp[8], tcp[9], tcp[10], tcp[11]]);
    let flags = tcp[13];
    if flags & TCP_ACK == 0 || ack != seq.wrapping_add(1) {
        return None;
    }
    if flags & TCP_RST != 0 {
        Some(SynAnswer::Reset)
    } else if flags & TCP_SYN != 0 {
        Some(SynAnswer::SynAck)
    } else {
        None
    }
}

fn socket(domain: i32, kind: i32, protocol: i32) -> io::Result<OwnedFd> {
    // SAFETY: socket(2) with constant arguments; the descriptor is owned at once.
    let fd = unsafe { libc::socket(domain, kind | libc::SOCK_CLOEXEC, protocol) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn set_receive_timeout(fd: &OwnedFd, timeout: Duration) -> io::Result<()> {
    let tv = libc::timeval {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_usec: timeout.subsec_micros().max(1) as libc::suseconds_t,
    };
    // SAFETY: setsockopt with a timeval that lives for the call.
    let r = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&tv as *const libc::timeval).cast(),
            size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Sends the IP packet `packet` to the backend along `path`: wrapped for its tunnel, if
/// any, out of its interface in a frame to its MAC.
fn send_to_backend(path: &VipPath, packet: &[u8]) -> io::Result<()> {
    let wrapped;
    let packet = match &path.tunnel {
        Some(tunnel) => {
            wrapped = encapsulate(tunnel, packet, fastrand::u32(..));
            &wrapped[..]
        }
        None => packet,
    };
    // By the outer family, which a tunnel may change (6in4, 4in6).
    let ethertype: u16 = if packet[0] >> 4 == 4 { 0x0800 } else { 0x86dd };
    let fd = socket(
        libc::AF_PACKET,
        libc::SOCK_DGRAM,
        i32::from(ethertype.to_be()),
    )?;
    // SAFETY: an all-zero sockaddr_ll is valid; the fields that matter are set below.
    let mut address: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    address.sll_family = libc::AF_PACKET as u16;
    address.sll_protocol = ethertype.to_be();
    address.sll_ifindex = path.ifindex as i32;
    address.sll_halen = 6;
    address.sll_addr[..6].copy_from_slice(&path.mac);
    // SAFETY: sendto with a buffer and an address that live for the call.
    let sent = unsafe {
        libc::sendto(
            fd.as_raw_fd(),
            packet.as_ptr().cast(),
            packet.len(),
            0,
            (&address as *const libc::sockaddr_ll).cast(),
            size_of::<libc::sockaddr_ll>() as libc::socklen_t,
        )
    };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Receives one packet into `buffer`: its length and where it came from.
fn receive(fd: &OwnedFd, buffer: &mut [u8]) -> io::Result<(usize, IpAddr)> {
    // SAFETY: an all-zero sockaddr_storage is valid to be written into.
    let mut from: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut length = size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    // SAFETY: recvfrom into buffers that live for the call.
    let n = unsafe {
        libc::recvfrom(
            fd.as_raw_fd(),
            buffer.as_mut_ptr().cast(),
            buffer.len(),
            0,
            (&mut from as *mut libc::sockaddr_storage).cast(),
            &mut length,
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let address = match i32::from(from.ss_family) {
        libc::AF_INET => {
            // SAFETY: the family says it is a sockaddr_in.
            let v4 =
                unsafe { &*(&from as *const libc::sockaddr_storage).cast::<libc::sockaddr_in>() };
            IpAddr::from(u32::from_be(v4.sin_addr.s_addr).to_be_bytes())
        }
        _ => {
            // SAFETY: the only other family a raw IPv6 socket reports.
            let v6 =
                unsafe { &*(&from as *const libc::sockaddr_storage).cast::<libc::sockaddr_in6>() };
            IpAddr::from(v6.sin6_addr.s6_addr)
        }
    };
    Ok((n as usize, address))
}

/// A free TCP port of ours to send the SYN from: held by a bound socket while the probe
/// runs, so that no connection of the host uses it meanwhile (the kernel answers the
/// SYN-ACK with a RST, as no socket listens or connects there).
fn reserve_port(source: IpAddr) -> io::Result<std::net::TcpListener> {
    let listener = std::net::TcpListener::bind(SocketAddr::new(source, 0))?;
    Ok(listener)
}

/// Why a check through the VIP failed. The texts are what status shows as the check's
/// error.
#[derive(Debug, thiserror::Error)]
pub enum VipProbeError {
    /// A socket of ours could not be had: `what` is "raw socket", "source port" or "udp
    /// socket".
    #[error("{what}: {error}")]
    Socket {
        what: &'static str,
        error: io::Error,
    },
    /// The probe could not be sent: `what` is "the SYN" or "the datagram".
    #[error("sending {what}: {error}")]
    Send {
        what: &'static str,
        error: io::Error,
    },
    /// Nothing came back in time: `missing` says what ("no SYN-ACK from the VIP").
    #[error("{missing} within {}", humantime::format_duration(*.timeout))]
    NoAnswer {
        missing: &'static str,
        timeout: Duration,
    },
    #[error("receiving the answer: {0}")]
    Receive(io::Error),
    /// A RST answered the SYN.
    #[error("connection refused by the VIP")]
    Refused,
    /// The datagram check's own failure: the query, or a reply it refuses.
    #[error(transparent)]
    Probe(#[from] ProbeError),
    #[error("{0} checks through the VIP are not supported")]
    Unsupported(HealthKind),
    #[error("check task: {0}")]
    Task(#[from] tokio::task::JoinError),
}

/// The SYN probe, blocking: up to `timeout`.
fn syn_probe(path: VipPath, timeout: Duration) -> Result<(), VipProbeError> {
    let domain = if path.vip.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    let socket_error = |what| move |error| VipProbeError::Socket { what, error };
    // Opened before the SYN goes: its answer must not arrive before we listen.
    let raw =
        socket(domain, libc::SOCK_RAW, i32::from(PROTO_TCP)).map_err(socket_error("raw socket"))?;
    let reserved = reserve_port(path.source).map_err(socket_error("source port"))?;
    // Bound but not listening: the kernel sends RST to the SYN-ACK, and the port is ours.
    let source = reserved.local_addr().map_err(socket_error("source port"))?;
    let seq = fastrand::u32(..);
    send_to_backend(&path, &tcp_syn(source, path.vip, seq)).map_err(|error| {
        VipProbeError::Send {
            what: "the SYN",
            error,
        }
    })?;
    let mut buffer = [0u8; 2048];
    let answer = wait_for(timeout, "no SYN-ACK from the VIP", |left| {
        set_receive_timeout(&raw, left)?;
        let (n, from) = receive(&raw, &mut buffer)?;
        // IPv4 raw sockets get the IP header too; IPv6 ones only the segment.
        let header = if path.vip.is_ipv4() {
            usize::from(buffer[0] & 0x0f) * 4
        } else {
            0
        };
        Ok(buffer
            .get(header..n)
            .and_then(|tcp| syn_answer(tcp, from, source, path.vip, seq)))
    })?;
    match answer {
        SynAnswer::SynAck => Ok(()),
        SynAnswer::Reset => Err(VipProbeError::Refused),
    }
}

/// Reads until `read` finds the answer (`Ok(Some)`; `Ok(None)`: not this packet) or
/// `timeout` passes; `read` is given the time left. Says `missing` when none came.
fn wait_for<T>(
    timeout: Duration,
    missing: &'static str,
    mut read: impl FnMut(Duration) -> io::Result<Option<T>>,
) -> Result<T, VipProbeError> {
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(VipProbeError::NoAnswer { missing, timeout });
        }
        match read(left) {
            Ok(Some(found)) => return Ok(found),
            Ok(None) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) => {}
            Err(e) => return Err(VipProbeError::Receive(e)),
        }
    }
}

/// A datagram to the VIP through the backend and its reply from the VIP, blocking: up to
/// `timeout`. Returns the reply.
fn datagram_probe(
    path: VipPath,
    payload: &[u8],
    timeout: Duration,
) -> Result<Vec<u8>, VipProbeError> {
    let socket_error = |error| VipProbeError::Socket {
        what: "udp socket",
        error,
    };
    let socket =
        std::net::UdpSocket::bind(SocketAddr::new(path.source, 0)).map_err(socket_error)?;
    let source = socket.local_addr().map_err(socket_error)?;
    send_to_backend(&path, &udp_datagram(source, path.vip, payload)).map_err(|error| {
        VipProbeError::Send {
            what: "the datagram",
            error,
        }
    })?;
    let mut buffer = vec![0u8; 4096];
    wait_for(timeout, "no reply from the VIP", |left| {
        socket.set_read_timeout(Some(left))?;
        let (n, from) = socket.recv_from(&mut buffer)?;
        // From elsewhere (the backend's own address: the service answers from the wrong
        // address, which DSR clients would drop): not an answer.
        Ok((from == path.vip).then(|| buffer[..n].to_vec()))
    })
}

/// One check of `config` through the VIP along `path`.
pub async fn check_via_vip(config: &HealthConfig, path: VipPath) -> Result<(), VipProbeError> {
    let (config, timeout) = (config.clone(), config.timeout);
    tokio::task::spawn_blocking(move || match config.kind {
        HealthKind::Tcp => syn_probe(path, timeout),
        HealthKind::Udp => {
            let payload = config.send.as_deref().unwrap_or("").as_bytes();
            let reply = datagram_probe(path, payload, timeout)?;
            Ok(probe::check_udp_reply(&config, &reply)?)
        }
        HealthKind::Dns => {
            let query = probe::dns_query(&config, fastrand::u16(..))?;
            let bytes = probe::encode(&query)?;
            let reply = datagram_probe(path, &bytes, timeout)?;
            Ok(probe::check_dns_reply(&query, &reply)?)
        }
        kind @ (HealthKind::Http | HealthKind::Https | HealthKind::None) => {
            Err(VipProbeError::Unsupported(kind))
        }
    })
    .await?
}

/// The interface's own address of `family`'s kind (the first global one), to send
/// checks through the VIP from.
pub fn interface_address(interface: &str, v4: bool) -> Option<IpAddr> {
    let addresses = nix::ifaddrs::getifaddrs().ok()?;
    addresses
        .filter(|a| a.interface_name == interface)
        .filter_map(|a| {
            let address = a.address?;
            if let Some(v4) = address.as_sockaddr_in() {
                Some(IpAddr::from(v4.ip()))
            } else {
                address.as_sockaddr_in6().map(|v6| IpAddr::from(v6.ip()))
            }
        })
        .filter(|ip| ip.is_ipv4() == v4)
        // Not link-local IPv6: replies to it would need a scope.
        .find(|ip| match ip {
            IpAddr::V6(v6) => (v6.segments()[0] & 0xffc0) != 0xfe80,
            IpAddr::V4(_) => true,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(text: &str) -> SocketAddr {
        text.parse().unwrap()
    }

    /// The checksum over a segment with its checksum filled in is 0 (all ones, folded).
    fn verifies(src: IpAddr, dst: IpAddr, proto: u8, segment: &[u8]) -> bool {
        let mut acc = match (src, dst) {
            (IpAddr::V4(s), IpAddr::V4(d)) => sum(&d.octets(), sum(&s.octets(), 0)),
            (IpAddr::V6(s), IpAddr::V6(d)) => sum(&d.octets(), sum(&s.octets(), 0)),
            _ => unreachable!(),
        };
        acc += u32::from(proto) + segment.len() as u32;
        fold(sum(segment, acc)) == 0
    }

    #[test]
    fn a_syn_to_the_vip_is_a_valid_ipv4_packet() {
        let (source, vip) = (addr("10.99.0.2:40000"), addr("10.99.0.100:80"));
        let packet = tcp_syn(source, vip, 0x01020304);
        assert_eq!(packet.len(), 40);
        assert_eq!(packet[0], 0x45);
        assert_eq!(u16::from_be_bytes([packet[2], packet[3]]), 40);
        assert_eq!(packet[9], PROTO_TCP);
        assert_eq!(fold(sum(&packet[..20], 0)), 0, "IPv4 header checksum");
        assert_eq!(&packet[12..16], &[10, 99, 0, 2]);
        assert_eq!(&packet[16..20], &[10, 99, 0, 100]);
        let tcp = &packet[20..];
        assert_eq!(u16::from_be_bytes([tcp[0], tcp[1]]), 40000);
        assert_eq!(u16::from_be_bytes([tcp[2], tcp[3]]), 80);
        assert_eq!(&tcp[4..8], &[1, 2, 3, 4]);
        assert_eq!(tcp[13], TCP_SYN);
        assert!(verifies(source.ip(), vip.ip(), PROTO_TCP, tcp));
    }

    #[test]
    fn a_datagram_to_an_ipv6_vip_is_valid() {
        let (source, vip) = (addr("[fd00:99::2]:40001"), addr("[fd00:99::100]:53"));
        let packet = udp_datagram(source, vip, b"ping");
        assert_eq!(packet.len(), 40 + 8 + 4);
        assert_eq!(packet[0] >> 4, 6);
        assert_eq!(u16::from_be_bytes([packet[4], packet[5]]), 12);
        assert_eq!(packet[6], PROTO_UDP);
        let udp = &packet[40..];
        assert_eq!(u16::from_be_bytes([udp[4], udp[5]]), 12);
        assert_eq!(&udp[8..], b"ping");
        assert!(verifies(source.ip(), vip.ip(), PROTO_UDP, udp));
    }

    /// A TCP header answering our SYN with `flags`, acknowledging `ack`.
    fn answer(from_port: u16, to_port: u16, ack: u32, flags: u8) -> Vec<u8> {
        let mut tcp = vec![0u8; 20];
        tcp[0..2].copy_from_slice(&from_port.to_be_bytes());
        tcp[2..4].copy_from_slice(&to_port.to_be_bytes());
        tcp[8..12].copy_from_slice(&ack.to_be_bytes());
        tcp[12] = 0x50;
        tcp[13] = flags;
        tcp
    }

    #[test]
    fn only_the_vips_answer_to_our_syn_counts() {
        let (source, vip) = (addr("10.99.0.2:40000"), addr("10.99.0.100:80"));
        let seq = 41;
        let from = vip.ip();
        let syn_ack = answer(80, 40000, 42, TCP_SYN | TCP_ACK);
        assert_eq!(
            syn_answer(&syn_ack, from, source, vip, seq),
            Some(SynAnswer::SynAck)
        );
        let reset = answer(80, 40000, 42, TCP_RST | TCP_ACK);
        assert_eq!(
            syn_answer(&reset, from, source, vip, seq),
            Some(SynAnswer::Reset)
        );
        // From the backend's own address (not the VIP), to another port, another ack,
        // a bare ACK, a runt.
        let backend: IpAddr = "10.99.0.11".parse().unwrap();
        assert_eq!(syn_answer(&syn_ack, backend, source, vip, seq), None);
        let other_port = answer(80, 40001, 42, TCP_SYN | TCP_ACK);
        assert_eq!(syn_answer(&other_port, from, source, vip, seq), None);
        let other_ack = answer(80, 40000, 43, TCP_SYN | TCP_ACK);
        assert_eq!(syn_answer(&other_ack, from, source, vip, seq), None);
        let bare = answer(80, 40000, 42, TCP_ACK);
        assert_eq!(syn_answer(&bare, from, source, vip, seq), None);
        assert_eq!(syn_answer(&syn_ack[..12], from, source, vip, seq), None);
    }

    fn tunnel(source: &str, backend: &str, gue_port: Option<u16>) -> Tunnel {
        Tunnel {
            source: source.parse().unwrap(),
            backend: backend.parse().unwrap(),
            gue_port,
        }
    }

    /// The outer IPv4 header `encap.rs` writes: 20 bytes, TOS 0 (the probe's), the
    /// total length, ID 0, DF, TTL 64, `proto`, a valid checksum, the addresses.
    fn assert_outer_v4(packet: &[u8], proto: u8, tunnel: &Tunnel, payload: usize) {
        let (IpAddr::V4(s), IpAddr::V4(d)) = (tunnel.source, tunnel.backend) else {
            panic!("an IPv4 tunnel");
        };
        assert_eq!(&packet[..2], &[0x45, 0]);
        assert_eq!(
            usize::from(u16::from_be_bytes([packet[2], packet[3]])),
            20 + payload
        );
        assert_eq!(
            &packet[4..10],
            &[0, 0, 0x40, 0, 64, proto],
            "ID 0, DF, TTL 64"
        );
        assert_eq!(fold(sum(&packet[..20], 0)), 0, "outer IPv4 header checksum");
        assert_eq!(&packet[12..16], &s.octets());
        assert_eq!(&packet[16..20], &d.octets());
        assert_eq!(packet.len(), 20 + payload);
    }

    /// The outer IPv6 header: version 6, traffic class 0, the flow label from
    /// `entropy`, the payload length, `proto`, hop limit 64, the addresses.
    fn assert_outer_v6(packet: &[u8], proto: u8, tunnel: &Tunnel, payload: usize, entropy: u32) {
        let (IpAddr::V6(s), IpAddr::V6(d)) = (tunnel.source, tunnel.backend) else {
            panic!("an IPv6 tunnel");
        };
        let first = u32::from_be_bytes([packet[0], packet[1], packet[2], packet[3]]);
        assert_eq!(first, (6 << 28) | (entropy & 0x000f_ffff));
        assert_eq!(
            usize::from(u16::from_be_bytes([packet[4], packet[5]])),
            payload
        );
        assert_eq!(&packet[6..8], &[proto, 64]);
        assert_eq!(&packet[8..24], &s.octets());
        assert_eq!(&packet[24..40], &d.octets());
        assert_eq!(packet.len(), 40 + payload);
    }

    const ENTROPY: u32 = 0xdead_beef;

    #[test]
    fn ipip_wraps_the_probe_in_the_backends_family() {
        let syn4 = tcp_syn(addr("10.99.0.2:40000"), addr("10.99.0.100:80"), 7);
        let syn6 = tcp_syn(addr("[fd00:99::2]:40000"), addr("[fd00:99::100]:80"), 7);
        // 4in4: protocol 4.
        let t = tunnel("10.99.0.2", "10.98.1.11", None);
        let packet = encapsulate(&t, &syn4, ENTROPY);
        assert_outer_v4(&packet, PROTO_IPIP, &t, syn4.len());
        assert_eq!(&packet[20..], &syn4[..], "the probe follows unchanged");
        // 6in4: protocol 41.
        let packet = encapsulate(&t, &syn6, ENTROPY);
        assert_outer_v4(&packet, PROTO_IPV6, &t, syn6.len());
        assert_eq!(&packet[20..], &syn6[..]);
        // 6in6: next header 41.
        let t = tunnel("fd00:99::2", "fd00:98:1::11", None);
        let packet = encapsulate(&t, &syn6, ENTROPY);
        assert_outer_v6(&packet, PROTO_IPV6, &t, syn6.len(), ENTROPY);
        assert_eq!(&packet[40..], &syn6[..]);
        // 4in6: next header 4.
        let packet = encapsulate(&t, &syn4, ENTROPY);
        assert_outer_v6(&packet, PROTO_IPIP, &t, syn4.len(), ENTROPY);
        assert_eq!(&packet[40..], &syn4[..]);
    }

    #[test]
    fn gue_wraps_the_probe_in_udp_to_the_vips_gue_port() {
        let datagram = udp_datagram(addr("10.99.0.2:40001"), addr("10.99.0.100:53"), b"ping");
        let udp_header = |packet: &[u8]| {
            let port = |at: usize| u16::from_be_bytes([packet[at], packet[at + 1]]);
            (port(0), port(2), port(4), port(6))
        };
        // Source port 49152 + the top 14 bits of the entropy; checksum 0, as encap.rs.
        let source_port = 49152 | (ENTROPY >> 18) as u16;
        let length = (8 + datagram.len()) as u16;

        let t = tunnel("10.99.0.2", "10.98.1.11", Some(6080));
        let packet = encapsulate(&t, &datagram, ENTROPY);
        assert_outer_v4(&packet, PROTO_UDP, &t, 8 + datagram.len());
        assert_eq!(udp_header(&packet[20..]), (source_port, 6080, length, 0));
        assert_eq!(
            &packet[28..],
            &datagram[..],
            "variant 1: the inner packet, no header"
        );

        let t = tunnel("fd00:99::2", "fd00:98:1::11", Some(7000));
        let packet = encapsulate(&t, &datagram, ENTROPY);
        assert_outer_v6(&packet, PROTO_UDP, &t, 8 + datagram.len(), ENTROPY);
        assert_eq!(udp_header(&packet[40..]), (source_port, 7000, length, 0));
        assert_eq!(&packet[48..], &datagram[..]);
    }
}
