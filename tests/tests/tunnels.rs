//! Tier 2: tunnel DSR through the real XDP programs with BPF_PROG_TEST_RUN, byte for
//! byte: every encapsulation of the balancer (4in4, 4in6, 6in6, 6in4, GUE over IPv4
//! and IPv6, with a VLAN tag), its "too big" answers, and the backends' decapsulation
//! program (`lb-decap`) on each tunnel and on malformed and foreign packets.
//!
//! The expected frames are built here from the RFCs' layouts with a checksum of this
//! file's own, not by the code under test. The backends' `forward` is written straight
//! into `LB_BACKENDS` (the contract's `BackendInfo`), so these cases test the data
//! path alone, whatever the configuration accepts.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Mutex;

use aya::programs::{TestRun, TestRunOptions};
use lb_common::{
    ADDR_FAMILY_V4, ADDR_FAMILY_V6, BACKEND_F_SERVES_FLOWS, BackendIdentity, BackendInfo,
    FORWARD_GUE, FORWARD_IPIP, TunnelConfig, stat,
};
use lb_tests::client::checksum;
use lb_tests::program::{IFACE_MAC, Instance};
use lb_userspace::{EBPF_OBJECT, dataplane::Dataplane};

const CLIENT_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x01];
/// The next hop toward the backends (a router): where every tunnelled frame goes.
const GATEWAY_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0xfe];
const GUE_PORT: u16 = 6080;
const MTU: u32 = 1500;
const TUNNEL_SRC4: [u8; 4] = [10, 0, 0, 2];
const TUNNEL_SRC6: &str = "fd00::2";

const XDP_DROP: u32 = 1;
const XDP_PASS: u32 = 2;
const XDP_TX: u32 = 3;

/// One VIP per case, one backend each: its address in the configuration is only a
/// name; the data path's entry (address, family, forward) is written by `tunnel_to`.
const CONFIG: &str = r#"
[dataplane]
interface = "lo"
maglev_table_size = 251
conntrack_entries = 4096

[[vip]]
name = "ipip44"
address = "10.0.0.100"
port = 80
protocol = "tcp"
[vip.health]
kind = "none"
[[vip.backend]]
address = "10.1.0.11"
mac = "02:00:00:00:00:fe"

[[vip]]
name = "ipip46"
address = "10.0.0.100"
port = 81
protocol = "tcp"
[vip.health]
kind = "none"
[[vip.backend]]
address = "10.1.0.12"
mac = "02:00:00:00:00:fe"

[[vip]]
name = "gue4"
address = "10.0.0.100"
port = 82
protocol = "tcp"
[vip.health]
kind = "none"
[[vip.backend]]
address = "10.1.0.15"
mac = "02:00:00:00:00:fe"

[[vip]]
name = "ipip66"
address = "fd00::100"
port = 80
protocol = "tcp"
[vip.health]
kind = "none"
[[vip.backend]]
address = "fd01::13"
mac = "02:00:00:00:00:fe"

[[vip]]
name = "ipip64"
address = "fd00::100"
port = 81
protocol = "tcp"
[vip.health]
kind = "none"
[[vip.backend]]
address = "fd01::14"
mac = "02:00:00:00:00:fe"

[[vip]]
name = "gue6"
address = "fd00::100"
port = 82
protocol = "udp"
[vip.health]
kind = "none"
[[vip.backend]]
address = "fd01::16"
mac = "02:00:00:00:00:fe"
"#;

/// VIP name -> (forward, backend address as the data path gets it).
const TUNNELS: [(&str, u8, &str); 6] = [
    ("ipip44", FORWARD_IPIP, "10.1.0.11"),
    ("ipip46", FORWARD_IPIP, "fd01::12"),
    ("gue4", FORWARD_GUE, "10.1.0.15"),
    ("ipip66", FORWARD_IPIP, "fd01::13"),
    ("ipip64", FORWARD_IPIP, "10.1.0.14"),
    ("gue6", FORWARD_GUE, "fd01::16"),
];

// ---- bytes ---------------------------------------------------------------------------

fn v4(text: &str) -> [u8; 4] {
    text.parse::<Ipv4Addr>().unwrap().octets()
}

fn v6(text: &str) -> [u8; 16] {
    text.parse::<Ipv6Addr>().unwrap().octets()
}

/// An IPv4 header, checksum computed.
fn ipv4_header(
    src: [u8; 4],
    dst: [u8; 4],
    proto: u8,
    payload: usize,
    tos: u8,
    df: bool,
) -> Vec<u8> {
    let mut h = vec![0u8; 20];
    h[0] = 0x45;
    h[1] = tos;
    h[2..4].copy_from_slice(&((20 + payload) as u16).to_be_bytes());
    if df {
        h[6] = 0x40;
    }
    h[8] = 64;
    h[9] = proto;
    h[12..16].copy_from_slice(&src);
    h[16..20].copy_from_slice(&dst);
    let sum = checksum(&h);
    h[10..12].copy_from_slice(&sum.to_be_bytes());
    h
}

fn ipv6_header(
    src: [u8; 16],
    dst: [u8; 16],
    next: u8,
    payload: usize,
    class: u8,
    label: u32,
) -> Vec<u8> {
    let first = (6u32 << 28) | ((class as u32) << 20) | (label & 0xfffff);
    let mut h = first.to_be_bytes().to_vec();
    h.extend_from_slice(&(payload as u16).to_be_bytes());
    h.push(next);
    h.push(64);
    h.extend_from_slice(&src);
    h.extend_from_slice(&dst);
    h
}

/// A TCP segment (no checksum: nothing on the way checks it) with `extra` payload bytes.
fn tcp(src: u16, dst: u16, extra: usize) -> Vec<u8> {
    let mut h = vec![0u8; 20];
    h[0..2].copy_from_slice(&src.to_be_bytes());
    h[2..4].copy_from_slice(&dst.to_be_bytes());
    h[12] = 5 << 4;
    h[13] = 0x02; // SYN
    h[14..16].copy_from_slice(&64240u16.to_be_bytes());
    h.extend((0..extra).map(|i| i as u8));
    h
}

fn udp(src: u16, dst: u16, payload: &[u8]) -> Vec<u8> {
    let mut h = Vec::new();
    h.extend_from_slice(&src.to_be_bytes());
    h.extend_from_slice(&dst.to_be_bytes());
    h.extend_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
    h.extend_from_slice(&[0, 0]);
    h.extend_from_slice(payload);
    h
}

const CLIENT4: [u8; 4] = [10, 0, 0, 1];
const CLIENT_PORT: u16 = 40000;

fn client6() -> [u8; 16] {
    v6("fd00::1")
}

/// The client's IPv4 packet to VIP port `port`, DF as given, `extra` payload bytes.
fn packet4(port: u16, extra: usize, df: bool) -> Vec<u8> {
    let l4 = tcp(CLIENT_PORT, port, extra);
    let mut p = ipv4_header(CLIENT4, v4("10.0.0.100"), 6, l4.len(), 0x28, df);
    p.extend(l4);
    p
}

fn packet6(port: u16, extra: usize, proto: u8) -> Vec<u8> {
    let l4 = if proto == 17 {
        udp(CLIENT_PORT, port, &vec![7u8; extra])
    } else {
        tcp(CLIENT_PORT, port, extra)
    };
    let mut p = ipv6_header(client6(), v6("fd00::100"), proto, l4.len(), 0x28, 0);
    p.extend(l4);
    p
}

/// An Ethernet frame of `packet` from `src` to `dst`, with an 802.1Q tag if `vlan`.
fn frame(dst: [u8; 6], src: [u8; 6], vlan: Option<u16>, packet: &[u8]) -> Vec<u8> {
    let mut f = dst.to_vec();
    f.extend_from_slice(&src);
    if let Some(tci) = vlan {
        f.extend_from_slice(&0x8100u16.to_be_bytes());
        f.extend_from_slice(&tci.to_be_bytes());
    }
    let ether_type: u16 = if packet[0] >> 4 == 4 { 0x0800 } else { 0x86dd };
    f.extend_from_slice(&ether_type.to_be_bytes());
    f.extend_from_slice(packet);
    f
}

/// What the client sends to the balancer.
fn from_client(vlan: Option<u16>, packet: &[u8]) -> Vec<u8> {
    frame(IFACE_MAC, CLIENT_MAC, vlan, packet)
}

/// The program's flow hash for the outer UDP source port and IPv6 flow label, from the
/// inner addresses and ports as they sit in the packet (MurmurHash3's finaliser over
/// their xor-fold; the function is `lb-ebpf`'s `encap::flow_entropy`).
fn flow_entropy(src: &[u8], dst: &[u8], sport: u16, dport: u16) -> u32 {
    let pad = |a: &[u8]| {
        let mut b = [0u8; 16];
        b[..a.len()].copy_from_slice(a);
        b
    };
    let (s, d) = (pad(src), pad(dst));
    let word = |b: &[u8; 16], i: usize| u16::from_ne_bytes([b[2 * i], b[2 * i + 1]]) as u32;
    let sport = u16::from_ne_bytes(sport.to_be_bytes()) as u32;
    let dport = u16::from_ne_bytes(dport.to_be_bytes()) as u32;
    let mut h = (sport << 16) | dport;
    for i in 0..4 {
        h ^= (word(&s, 2 * i) << 16 | word(&s, 2 * i + 1))
            ^ (word(&d, 2 * i + 1) << 16 | word(&d, 2 * i));
    }
    lb_common::fmix32(h)
}

/// `inner` (a client packet) as the balancer sends it to `backend` over `forward`.
fn encapsulated(inner: &[u8], backend: &str, gue: bool, vlan: Option<u16>) -> Vec<u8> {
    let backend: IpAddr = backend.parse().unwrap();
    let inner_v4 = inner[0] >> 4 == 4;
    let (src, dst, sport, dport, class) = if inner_v4 {
        let ihl = (inner[0] & 0xf) as usize * 4;
        let ports = &inner[ihl..ihl + 4];
        (
            inner[12..16].to_vec(),
            inner[16..20].to_vec(),
            u16::from_be_bytes([ports[0], ports[1]]),
            u16::from_be_bytes([ports[2], ports[3]]),
            inner[1],
        )
    } else {
        (
            inner[8..24].to_vec(),
            inner[24..40].to_vec(),
            u16::from_be_bytes([inner[40], inner[41]]),
            u16::from_be_bytes([inner[42], inner[43]]),
            (inner[0] << 4) | (inner[1] >> 4),
        )
    };
    let entropy = flow_entropy(&src, &dst, sport, dport);
    let mut payload = Vec::new();
    if gue {
        let source_port = 49152 | (entropy >> 18) as u16;
        payload.extend(udp(source_port, GUE_PORT, &[]));
        let len = (8 + inner.len()) as u16;
        payload[4..6].copy_from_slice(&len.to_be_bytes());
    }
    payload.extend_from_slice(inner);
    let inner_proto = if inner_v4 { 4 } else { 41 };
    let proto = if gue { 17 } else { inner_proto };
    let mut packet = match backend {
        IpAddr::V4(b) => ipv4_header(TUNNEL_SRC4, b.octets(), proto, payload.len(), class, true),
        IpAddr::V6(b) => ipv6_header(
            v6(TUNNEL_SRC6),
            b.octets(),
            proto,
            payload.len(),
            class,
            entropy,
        ),
    };
    packet.extend(payload);
    frame(GATEWAY_MAC, IFACE_MAC, vlan, &packet)
}

// ---- harness ------------------------------------------------------------------------

fn can_run(test: &str) -> bool {
    if !nix::unistd::geteuid().is_root() {
        lb_tests::skip(test, "BPF_PROG_TEST_RUN needs root");
        return false;
    }
    if EBPF_OBJECT.is_empty() || lb_userspace::DECAP_OBJECT.is_empty() {
        lb_tests::skip(
            test,
            "the eBPF objects are empty (built with AYA_BUILD_SKIP=1)",
        );
        return false;
    }
    true
}

fn host_key(address: IpAddr) -> ([u8; 16], u8) {
    match address {
        IpAddr::V4(a) => {
            let mut addr = [0; 16];
            addr[..4].copy_from_slice(&a.octets());
            (addr, ADDR_FAMILY_V4)
        }
        IpAddr::V6(a) => (a.octets(), ADDR_FAMILY_V6),
    }
}

fn tunnel_config(mtu: u32) -> TunnelConfig {
    TunnelConfig {
        src_v4: TUNNEL_SRC4,
        mtu,
        src_v6: v6(TUNNEL_SRC6),
        linear_frames: 0,
    }
}

/// The balancer instance with every VIP's backend behind its tunnel of `TUNNELS`.
fn balancer() -> Instance {
    let mut instance = Instance::load(CONFIG).expect("load the instance");
    for (name, forward, address) in TUNNELS {
        let vip = instance
            .model
            .vips
            .iter()
            .find(|v| v.config.name == name)
            .expect("the VIP");
        let (vip_id, id) = (vip.id, vip.backends[0].id);
        let (addr, family) = host_key(address.parse().unwrap());
        let info = BackendInfo {
            forward,
            family,
            gue_port_be: if forward == FORWARD_GUE {
                GUE_PORT.to_be()
            } else {
                0
            },
            addr,
            ..BackendInfo::l2(GATEWAY_MAC, BACKEND_F_SERVES_FLOWS, vip_id)
        };
        let (config_addr, config_family) = host_key(vip.backends[0].config.address);
        let identity = BackendIdentity {
            addr: config_addr,
            vip_id,
            family: config_family,
            in_use: 1,
            _pad: [0; 2],
        };
        instance
            .dataplane
            .set_backend(id, &info, &identity)
            .expect("set the backend");
    }
    instance
        .dataplane
        .set_tunnel(&tunnel_config(MTU))
        .expect("set the tunnel");
    instance
}

static BALANCER: Mutex<Option<Instance>> = Mutex::new(None);

fn with_balancer<T>(test: &str, body: impl FnOnce(&mut Instance) -> T) -> Option<T> {
    if !can_run(test) {
        return None;
    }
    let mut guard = BALANCER.lock().unwrap_or_else(|e| e.into_inner());
    Some(body(guard.get_or_insert_with(balancer)))
}

struct Ran {
    action: u32,
    output: Vec<u8>,
    /// Counters that changed, by name, with their increase.
    counted: Vec<(String, u64)>,
}

fn test_run(program: &mut aya::programs::Xdp, frame: &[u8]) -> (u32, Vec<u8>) {
    let mut out = vec![0u8; frame.len() + 256];
    let result = program
        .test_run(TestRunOptions {
            data_in: Some(frame),
            data_out: Some(&mut out),
            repeat: 1,
            ..TestRunOptions::default()
        })
        .expect("BPF_PROG_TEST_RUN");
    out.truncate(result.data_size_out as usize);
    (result.return_value, out)
}

fn changed(names: &[&str], before: &[u64], after: &[u64]) -> Vec<(String, u64)> {
    names
        .iter()
        .zip(before.iter().zip(after))
        .filter(|(_, (b, a))| a != b)
        .map(|(name, (b, a))| (name.to_string(), a - b))
        .collect()
}

fn run(instance: &mut Instance, frame: &[u8]) -> Ran {
    let outcomes = |i: &Instance| i.dataplane.counters(&[], &[]).expect("counters").outcomes;
    let before = outcomes(instance);
    let (action, output) = test_run(instance.dataplane.program_mut().expect("program"), frame);
    let counted = changed(&stat::NAMES, &before, &outcomes(instance));
    Ran {
        action,
        output,
        counted,
    }
}

/// Names the first differing byte.
fn difference(want: &[u8], got: &[u8]) -> String {
    if want.len() != got.len() {
        return format!("length {} != expected {}", got.len(), want.len());
    }
    match want.iter().zip(got).position(|(a, b)| a != b) {
        Some(i) => format!("byte {i}: got {:#04x}, expected {:#04x}", got[i], want[i]),
        None => "identical".into(),
    }
}

fn check(what: &str, ran: &Ran, action: u32, reasons: &[&str], want: &[u8]) -> Option<String> {
    let mut problems = Vec::new();
    if ran.action != action {
        problems.push(format!("action {} != expected {action}", ran.action));
    }
    for reason in reasons {
        if !ran
            .counted
            .iter()
            .any(|(name, n)| name == reason && *n == 1)
        {
            problems.push(format!("{reason} not counted once: {:?}", ran.counted));
        }
    }
    if ran.output != want {
        problems.push(format!("output: {}", difference(want, &ran.output)));
    }
    (!problems.is_empty()).then(|| format!("{what}: {}", problems.join("; ")))
}

fn assert_all(failures: Vec<Option<String>>) {
    let failures: Vec<String> = failures.into_iter().flatten().collect();
    assert!(
        failures.is_empty(),
        "{} case(s) failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

// ---- the balancer -------------------------------------------------------------------

#[test]
fn every_encapsulation_is_exact() {
    with_balancer("every_encapsulation_is_exact", |lb| {
        let cases = [
            (
                "4in4",
                packet4(80, 8, true),
                "10.1.0.11",
                false,
                None,
                "tx_ipip",
            ),
            (
                "4in6",
                packet4(81, 8, true),
                "fd01::12",
                false,
                None,
                "tx_ipip",
            ),
            (
                "GUE v4 (inner v4)",
                packet4(82, 8, true),
                "10.1.0.15",
                true,
                None,
                "tx_gue",
            ),
            (
                "6in6",
                packet6(80, 8, 6),
                "fd01::13",
                false,
                None,
                "tx_ipip",
            ),
            (
                "6in4",
                packet6(81, 8, 6),
                "10.1.0.14",
                false,
                None,
                "tx_ipip",
            ),
            (
                "GUE v6 (inner v6, UDP)",
                packet6(82, 8, 17),
                "fd01::16",
                true,
                None,
                "tx_gue",
            ),
            (
                "4in4 tagged",
                packet4(80, 8, true),
                "10.1.0.11",
                false,
                Some(100),
                "tx_ipip",
            ),
            (
                "6in4 tagged",
                packet6(81, 8, 6),
                "10.1.0.14",
                false,
                Some(0x2064),
                "tx_ipip",
            ),
            (
                "GUE v6 tagged",
                packet6(82, 8, 17),
                "fd01::16",
                true,
                Some(7),
                "tx_gue",
            ),
            // Without DF, a packet that fits is wrapped as any other.
            (
                "4in4 without DF",
                packet4(80, 8, false),
                "10.1.0.11",
                false,
                None,
                "tx_ipip",
            ),
        ];
        let failures = cases
            .into_iter()
            .map(|(what, packet, backend, gue, vlan, reason)| {
                let ran = run(lb, &from_client(vlan, &packet));
                let want = encapsulated(&packet, backend, gue, vlan);
                check(what, &ran, XDP_TX, &["xdp_tx", reason], &want)
            })
            .collect();
        assert_all(failures);
    });
}

/// Ethernet padding after a short packet stays behind the inner packet; the outer
/// lengths are the packet's, not the frame's.
#[test]
fn a_padded_frame_keeps_its_packet_length() {
    with_balancer("a_padded_frame_keeps_its_packet_length", |lb| {
        let packet = packet4(80, 0, true);
        let mut sent = from_client(None, &packet);
        sent.resize(60, 0);
        let mut want = encapsulated(&packet, "10.1.0.11", false, None);
        want.extend(std::iter::repeat_n(0, 60 - 14 - packet.len()));
        let ran = run(lb, &sent);
        assert_all(vec![check("padded", &ran, XDP_TX, &["tx_ipip"], &want)]);
    });
}

/// The "too big" answer: from the VIP back to the client (MACs swapped, a tag kept),
/// the usable MTU in it, the first 128 bytes of the packet quoted.
fn too_big_answer(sent: &[u8], vlan: Option<u16>, usable: u32) -> Vec<u8> {
    let l3 = 14 + if vlan.is_some() { 4 } else { 0 };
    let packet = &sent[l3..];
    let quoted = &packet[..128];
    let answer = if packet[0] >> 4 == 4 {
        let mut icmp = vec![3, 4, 0, 0, 0, 0];
        icmp.extend_from_slice(&(usable as u16).to_be_bytes());
        icmp.extend_from_slice(quoted);
        let sum = checksum(&icmp);
        icmp[2..4].copy_from_slice(&sum.to_be_bytes());
        let mut ip = ipv4_header(v4("10.0.0.100"), CLIENT4, 1, icmp.len(), 0, false);
        ip.extend(icmp);
        ip
    } else {
        let mut icmp = vec![2, 0, 0, 0];
        icmp.extend_from_slice(&usable.to_be_bytes());
        icmp.extend_from_slice(quoted);
        let mut pseudo = v6("fd00::100").to_vec();
        pseudo.extend_from_slice(&client6());
        pseudo.extend_from_slice(&(icmp.len() as u32).to_be_bytes());
        pseudo.extend_from_slice(&[0, 0, 0, 58]);
        pseudo.extend_from_slice(&icmp);
        let sum = checksum(&pseudo);
        icmp[2..4].copy_from_slice(&sum.to_be_bytes());
        let mut ip = ipv6_header(v6("fd00::100"), client6(), 58, icmp.len(), 0, 0);
        ip.extend(icmp);
        ip
    };
    frame(CLIENT_MAC, IFACE_MAC, vlan, &answer)
}

#[test]
fn packets_too_big_once_wrapped_are_answered_with_the_usable_mtu() {
    with_balancer(
        "packets_too_big_once_wrapped_are_answered_with_the_usable_mtu",
        |lb| {
            // 1500 bytes of IP: they fit the link, not the link less a tunnel header.
            let big4 = |port, df| packet4(port, 1500 - 40, df);
            let big6 =
                |port, proto| packet6(port, 1500 - 40 - if proto == 6 { 20 } else { 8 }, proto);
            let mut failures = Vec::new();
            for (what, packet, vlan, usable) in [
                ("4in4 with DF", big4(80, true), None, MTU - 20),
                ("4in6 with DF", big4(81, true), None, MTU - 40),
                (
                    "GUE v4 with DF, tagged",
                    big4(82, true),
                    Some(100),
                    MTU - 28,
                ),
                ("6in6", big6(80, 6), None, MTU - 40),
                ("6in4, tagged", big6(81, 6), Some(5), MTU - 20),
                ("GUE v6", big6(82, 17), None, MTU - 48),
            ] {
                let sent = from_client(vlan, &packet);
                let ran = run(lb, &sent);
                let want = too_big_answer(&sent, vlan, usable);
                failures.push(check(
                    what,
                    &ran,
                    XDP_TX,
                    &["xdp_tx", "tx_icmp_too_big"],
                    &want,
                ));
            }
            // Without DF it would have to be fragmented: dropped, counted.
            let sent = from_client(None, &big4(80, false));
            let ran = run(lb, &sent);
            failures.push(check(
                "4in4 without DF",
                &ran,
                XDP_DROP,
                &["xdp_drop", "drop_too_big"],
                &sent,
            ));
            // One byte less than the usable MTU's limit: wrapped.
            let fits = packet4(80, 1500 - 20 - 40, true);
            let ran = run(lb, &from_client(None, &fits));
            let want = encapsulated(&fits, "10.1.0.11", false, None);
            failures.push(check("4in4 at the MTU", &ran, XDP_TX, &["tx_ipip"], &want));
            assert_all(failures);
        },
    );
}

/// An ICMP "fragmentation needed" about a tunnelled flow that is itself too big for the
/// tunnel is dropped (`drop_too_big`), not answered: an ICMP error never answers an ICMP
/// error, and it is not wrapped past the MTU either.
#[test]
fn an_icmp_error_too_big_to_wrap_is_dropped_not_answered() {
    with_balancer(
        "an_icmp_error_too_big_to_wrap_is_dropped_not_answered",
        |lb| {
            // A router's error quoting 1462 bytes of a segment the VIP sent to the client:
            // 1490 bytes of IP, above the 1480 a 4in4 tunnel leaves.
            let mut quoted = ipv4_header(v4("10.0.0.100"), CLIENT4, 6, 1440, 0, true);
            quoted.extend_from_slice(&tcp(80, CLIENT_PORT, 0)[..8]);
            quoted.resize(1462, 0);
            let mut icmp = vec![3, 4, 0, 0, 0, 0, 0x05, 0xdc];
            icmp.extend(quoted);
            let sum = checksum(&icmp);
            icmp[2..4].copy_from_slice(&sum.to_be_bytes());
            let mut packet =
                ipv4_header(v4("10.0.0.254"), v4("10.0.0.100"), 1, icmp.len(), 0, true);
            packet.extend(icmp);
            let sent = from_client(None, &packet);
            let ran = run(lb, &sent);
            assert_all(vec![check(
                "ICMP error too big for its 4in4 tunnel",
                &ran,
                XDP_DROP,
                &["xdp_drop", "seen_icmp_too_big", "drop_too_big"],
                &sent,
            )]);
        },
    );
}

#[test]
fn a_family_without_a_tunnel_source_is_dropped() {
    with_balancer("a_family_without_a_tunnel_source_is_dropped", |lb| {
        let only_v4 = TunnelConfig {
            src_v6: [0; 16],
            ..tunnel_config(MTU)
        };
        lb.dataplane.set_tunnel(&only_v4).unwrap();
        let sent = from_client(None, &packet6(80, 8, 6));
        let dropped = run(lb, &sent);
        let sent4 = from_client(None, &packet4(80, 8, true));
        let wrapped = run(lb, &sent4);
        lb.dataplane.set_tunnel(&tunnel_config(MTU)).unwrap();
        assert_all(vec![
            check(
                "6in6",
                &dropped,
                XDP_DROP,
                &["drop_no_tunnel_source"],
                &sent,
            ),
            check(
                "4in4",
                &wrapped,
                XDP_TX,
                &["tx_ipip"],
                &encapsulated(&packet4(80, 8, true), "10.1.0.11", false, None),
            ),
        ]);
    });
}

/// Every packet of a flow gets the same outer source port, and flows spread over many.
#[test]
fn gue_source_ports_follow_the_flow() {
    with_balancer("gue_source_ports_follow_the_flow", |lb| {
        let mut ports = std::collections::HashSet::new();
        for client_port in 1000..1200u16 {
            let l4 = tcp(client_port, 82, 8);
            let mut packet = ipv4_header(CLIENT4, v4("10.0.0.100"), 6, l4.len(), 0, true);
            packet.extend(l4);
            let first = run(lb, &from_client(None, &packet)).output;
            let again = run(lb, &from_client(None, &packet)).output;
            assert_eq!(first, again, "one flow, one outer header");
            let udp_at = 14 + 20;
            ports.insert(u16::from_be_bytes([first[udp_at], first[udp_at + 1]]));
        }
        assert!(
            ports.len() > 180,
            "{} distinct source ports of 200 flows",
            ports.len()
        );
        assert!(ports.iter().all(|p| *p >= 49152));
    });
}

// ---- the decapsulation program ------------------------------------------------------

const BACKEND4: &str = "10.1.0.11";
const BACKEND6: &str = "fd01::13";
const BACKEND_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x0b];

struct Decap {
    ebpf: aya::Ebpf,
}

impl Decap {
    /// The decap program, loaded (not attached), its maps written as `attach` would:
    /// the GUE port, and the host addresses `BACKEND4` and `BACKEND6`.
    fn load() -> Decap {
        use lb_common::decap::{CONFIG_GUE_PORT, HostAddr, MAP_ADDRS, MAP_CONFIG, PROGRAM};
        let mut ebpf = aya::Ebpf::load(lb_userspace::DECAP_OBJECT).expect("load lb-decap");
        let program: &mut aya::programs::Xdp =
            ebpf.program_mut(PROGRAM).unwrap().try_into().unwrap();
        program.load().expect("verify lb_decap");
        let mut config: aya::maps::Array<_, u32> =
            aya::maps::Array::try_from(ebpf.map_mut(MAP_CONFIG).unwrap()).unwrap();
        config.set(CONFIG_GUE_PORT, GUE_PORT as u32, 0).unwrap();
        let mut addrs: aya::maps::HashMap<_, HostAddr, u8> =
            aya::maps::HashMap::try_from(ebpf.map_mut(MAP_ADDRS).unwrap()).unwrap();
        for address in [BACKEND4, BACKEND6] {
            let (addr, family) = host_key(address.parse().unwrap());
            let key = HostAddr {
                addr,
                family,
                _pad: [0; 3],
            };
            addrs.insert(key, 1, 0).unwrap();
        }
        Decap { ebpf }
    }

    fn counters(&self) -> Vec<u64> {
        use lb_common::decap::{DecapOutcomes, MAP_STATS, stat};
        let stats: aya::maps::PerCpuArray<_, DecapOutcomes> =
            aya::maps::PerCpuArray::try_from(self.ebpf.map(MAP_STATS).unwrap()).unwrap();
        let mut sums = vec![0; stat::COUNT as usize];
        for cpu in stats.get(&0, 0).unwrap().iter() {
            for (sum, count) in sums.iter_mut().zip(cpu.counts) {
                *sum += count;
            }
        }
        sums
    }

    fn run(&mut self, frame: &[u8]) -> Ran {
        let before = self.counters();
        let program: &mut aya::programs::Xdp = self
            .ebpf
            .program_mut(lb_common::decap::PROGRAM)
            .unwrap()
            .try_into()
            .unwrap();
        let (action, output) = test_run(program, frame);
        let counted = changed(&lb_common::decap::stat::NAMES, &before, &self.counters());
        Ran {
            action,
            output,
            counted,
        }
    }
}

/// A balancer's frame as the backend receives it: to the backend's MAC, from the
/// router's.
fn arriving(sent: &[u8]) -> Vec<u8> {
    let mut f = sent.to_vec();
    f[0..6].copy_from_slice(&BACKEND_MAC);
    f[6..12].copy_from_slice(&GATEWAY_MAC);
    f
}

/// `inner` after decapsulation: the frame's MACs and tag, the inner EtherType.
fn decapsulated(arrived: &[u8], vlan: Option<u16>, inner: &[u8]) -> Vec<u8> {
    let dst: [u8; 6] = arrived[0..6].try_into().unwrap();
    let src: [u8; 6] = arrived[6..12].try_into().unwrap();
    frame(dst, src, vlan, inner)
}

#[test]
fn the_decap_program_unwraps_every_tunnel_to_this_host() {
    if !can_run("the_decap_program_unwraps_every_tunnel_to_this_host") {
        return;
    }
    let mut decap = Decap::load();
    let cases = [
        (
            "4in4",
            packet4(80, 8, true),
            BACKEND4,
            false,
            None,
            "decap_4in4",
        ),
        (
            "6in4",
            packet6(80, 8, 6),
            BACKEND4,
            false,
            None,
            "decap_6in4",
        ),
        (
            "4in6",
            packet4(80, 8, true),
            BACKEND6,
            false,
            None,
            "decap_4in6",
        ),
        (
            "6in6",
            packet6(80, 8, 6),
            BACKEND6,
            false,
            None,
            "decap_6in6",
        ),
        (
            "GUE v4, inner v4",
            packet4(80, 8, true),
            BACKEND4,
            true,
            None,
            "decap_gue4",
        ),
        (
            "GUE v4, inner v6",
            packet6(80, 8, 17),
            BACKEND4,
            true,
            None,
            "decap_gue4",
        ),
        (
            "GUE v6, inner v6",
            packet6(80, 8, 6),
            BACKEND6,
            true,
            None,
            "decap_gue6",
        ),
        (
            "GUE v6, inner v4",
            packet4(80, 8, true),
            BACKEND6,
            true,
            None,
            "decap_gue6",
        ),
        (
            "4in4 tagged",
            packet4(80, 8, true),
            BACKEND4,
            false,
            Some(100),
            "decap_4in4",
        ),
        (
            "GUE v6 tagged",
            packet6(80, 8, 17),
            BACKEND6,
            true,
            Some(9),
            "decap_gue6",
        ),
    ];
    let mut failures = Vec::new();
    for (what, inner, backend, gue, vlan, reason) in cases {
        let arrived = arriving(&encapsulated(&inner, backend, gue, vlan));
        let ran = decap.run(&arrived);
        let want = decapsulated(&arrived, vlan, &inner);
        failures.push(check(what, &ran, XDP_PASS, &[reason], &want));
    }
    assert_all(failures);
}

#[test]
fn the_decap_program_leaves_everything_else_untouched() {
    if !can_run("the_decap_program_leaves_everything_else_untouched") {
        return;
    }
    let mut decap = Decap::load();
    let wrapped4 = arriving(&encapsulated(&packet4(80, 8, true), BACKEND4, false, None));
    let gue4 = arriving(&encapsulated(&packet4(80, 8, true), BACKEND4, true, None));
    let gue6 = arriving(&encapsulated(&packet6(80, 8, 6), BACKEND6, true, None));
    let edit = |frame: &[u8], at: usize, value: u8| {
        let mut f = frame.to_vec();
        f[at] = value;
        f
    };
    let mut elsewhere = wrapped4.clone();
    elsewhere[14 + 16..14 + 20].copy_from_slice(&[10, 1, 0, 99]);
    let mut other_port = gue4.clone();
    other_port[14 + 20 + 2..14 + 20 + 4].copy_from_slice(&6081u16.to_be_bytes());
    let mut fragment = wrapped4.clone();
    fragment[14 + 6] = 0x20; // MF
    let plain = from_client(None, &packet4(80, 8, true));
    let arp = {
        let mut f = BACKEND_MAC.to_vec();
        f.extend_from_slice(&GATEWAY_MAC);
        f.extend_from_slice(&[0x08, 0x06]);
        f.extend_from_slice(&[0u8; 28]);
        f
    };
    let cases = [
        ("a plain TCP packet", plain, "pass_not_tunnel"),
        ("ARP", arp, "pass_not_tunnel"),
        ("UDP to another port", other_port, "pass_not_tunnel"),
        ("IPIP to another host", elsewhere, "pass_not_local"),
        ("an outer fragment", fragment, "pass_fragment"),
        // The outer header says 4 (IPIP) but the inner is no IPv4 header.
        (
            "IPIP whose inner version is wrong",
            edit(&wrapped4, 14 + 20, 0x65),
            "pass_malformed",
        ),
        (
            "IPIP cut inside the inner header",
            wrapped4[..14 + 20 + 10].to_vec(),
            "pass_malformed",
        ),
        (
            "an outer IPv4 header length below 20",
            edit(&wrapped4, 14, 0x44),
            "pass_malformed",
        ),
        (
            "an outer IPv4 cut short",
            wrapped4[..14 + 12].to_vec(),
            "pass_malformed",
        ),
        (
            "GUE whose payload is no IP packet",
            edit(&gue4, 14 + 28, 0x50),
            "pass_malformed",
        ),
        (
            "GUE variant 0 (a GUE header)",
            edit(&gue6, 14 + 48, 0x00),
            "pass_malformed",
        ),
        (
            "GUE cut inside the UDP header",
            gue6[..14 + 40 + 4].to_vec(),
            "pass_malformed",
        ),
    ];
    let failures = cases
        .into_iter()
        .map(|(what, frame, reason)| {
            let ran = decap.run(&frame);
            check(what, &ran, XDP_PASS, &[reason], &frame)
        })
        .collect();
    assert_all(failures);
}

// ---- the decap loader, in a namespace -----------------------------------------------

/// `lb decap`'s loader on a real veth: attach pins the program per interface and takes
/// the namespace's addresses; a 4in4 packet sent into the veth arrives, unwrapped, at a
/// socket on the VIP on `lo`; status counts it; attach again changes the GUE port in
/// place; detach removes it all.
#[test]
fn the_decap_loader_attaches_counts_and_detaches() {
    use lb_userspace::{config::XdpModeSetting, dataplane::decap};
    let test = "the_decap_loader_attaches_counts_and_detaches";
    if !can_run(test) || !lb_tests::require_root_tools(test) {
        return;
    }
    if let Err(why) = lb_tests::ensure_bpffs() {
        lb_tests::skip(test, &why);
        return;
    }
    let ns = lb_tests::netns::Netns::new("decap").unwrap();
    let sh = |args: &[&str]| ns.exec("ip", args).unwrap();
    sh(&["link", "add", "be0", "type", "veth", "peer", "name", "rt0"]);
    sh(&["addr", "add", "10.9.0.2/24", "dev", "be0"]);
    sh(&["addr", "add", "10.9.9.9/32", "dev", "lo"]);
    sh(&["link", "set", "be0", "up"]);
    sh(&["link", "set", "rt0", "up"]);
    let pins =
        std::path::PathBuf::from(format!("/sys/fs/bpf/lb-test-decap-{}", std::process::id()));
    // The namespace's own sysfs is seen through `ip netns exec` only.
    let mac = |name: &str| -> [u8; 6] {
        let path = format!("/sys/class/net/{name}/address");
        let text = ns.exec("cat", &[&path]).unwrap();
        let bytes: Vec<u8> = text
            .trim()
            .split(':')
            .map(|b| u8::from_str_radix(b, 16).unwrap())
            .collect();
        bytes.try_into().unwrap()
    };
    let (be_mac, rt_mac) = (mac("be0"), mac("rt0"));
    let result = ns.run(|| {
        let attached = decap::attach(
            lb_userspace::DECAP_OBJECT,
            "be0",
            GUE_PORT,
            XdpModeSetting::Auto,
            &pins,
        )
        .expect("attach");
        assert_eq!(attached.gue_port, GUE_PORT);
        assert!(
            attached.addresses.contains(&"10.9.0.2".parse().unwrap()),
            "{attached:?}"
        );
        assert!(attached.mode.is_some());

        let socket = std::net::UdpSocket::bind("10.9.9.9:5000").unwrap();
        socket
            .set_read_timeout(Some(std::time::Duration::from_secs(3)))
            .unwrap();
        let payload = b"through the tunnel";
        let inner = {
            let l4 = udp(40000, 5000, payload);
            let mut p = ipv4_header([10, 9, 0, 1], [10, 9, 9, 9], 17, l4.len(), 0, true);
            p.extend(l4);
            p
        };
        let mut outer = ipv4_header([10, 9, 0, 1], [10, 9, 0, 2], 4, inner.len(), 0, true);
        outer.extend(&inner);
        send_raw("rt0", &frame(be_mac, rt_mac, None, &outer));
        let mut buf = [0u8; 64];
        let (n, from) = socket.recv_from(&mut buf).expect("the inner datagram");
        assert_eq!(&buf[..n], payload);
        assert_eq!(from, "10.9.0.1:40000".parse().unwrap());

        let again = decap::attach(
            lb_userspace::DECAP_OBJECT,
            "be0",
            7000,
            XdpModeSetting::Auto,
            &pins,
        )
        .expect("attach again");
        let listed = decap::status(&pins).expect("status");
        let detached = decap::detach("be0", &pins).expect("detach");
        let after = decap::status(&pins).expect("status after");
        let detached_again = decap::detach("be0", &pins).expect("detach again");
        (again, listed, detached, after, detached_again)
    });
    let _ = std::fs::remove_dir_all(&pins);
    let (again, listed, detached, after, detached_again) = result.unwrap();
    assert_eq!(again.gue_port, 7000);
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].interface, "be0");
    assert_eq!(
        listed[0].counters["decap_4in4"], 1,
        "{:?}",
        listed[0].counters
    );
    assert!(detached && !detached_again);
    assert!(after.is_empty(), "{after:?}");
    let links = ns.exec("ip", &["link", "show", "be0"]).unwrap();
    assert!(!links.contains("xdp"), "{links}");
}

/// Sends one frame out of `interface` through an AF_PACKET socket.
fn send_raw(interface: &str, frame: &[u8]) {
    let fd = lb_tests::sniff::packet_socket(interface, 0).expect("AF_PACKET socket");
    // SAFETY: the frame lives across the call and its length is passed.
    let sent = unsafe {
        libc::send(
            std::os::fd::AsRawFd::as_raw_fd(&fd),
            frame.as_ptr().cast(),
            frame.len(),
            0,
        )
    };
    assert_eq!(sent, frame.len() as isize, "send");
}
