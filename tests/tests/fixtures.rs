//! Tier 2: packet fixtures through the real XDP program with BPF_PROG_TEST_RUN.
//!
//! The program is loaded and its maps written by the agent's own code (config ->
//! `Model` -> `TableWriter` -> `AyaDataplane`). Each case is an input frame, the
//! expected action, the counter that must say why, and the expected output bytes.

use std::net::IpAddr;
use std::sync::Mutex;

use aya::programs::{TestRun, TestRunOptions};
use lb_common::stat;
use lb_userspace::{
    EBPF_OBJECT,
    dataplane::{Dataplane, LoadOptions},
    explain::{self, ExplainRequest, VipTarget},
};

use lb_tests::program::IFACE_MAC;
const CLIENT_MAC: [u8; 6] = [0x02, 0x00, 0x00, 0x00, 0x00, 0x01];
const BACKEND_MAC: [u8; 6] = [0x02, 0x00, 0x00, 0x00, 0x00, 0x0b];

const XDP_DROP: u32 = 1;
const XDP_PASS: u32 = 2;
const XDP_TX: u32 = 3;

/// VIPs of the fixtures: "web" (IPv4 TCP 80 and UDP 53, IPv6 TCP 80 and UDP 53: one
/// backend each, so the expected output is known exactly), "three" (IPv4 TCP 8080, three
/// backends, for agreement with userspace) and "empty" (its only backend in maint).
const CONFIG: &str = r#"
[dataplane]
interface = "lo"
maglev_table_size = 251
conntrack_entries = 4096

[[vip]]
name = "web"
address = "10.0.0.100"
port = 80
protocol = "tcp"
[vip.health]
kind = "none"
[[vip.backend]]
address = "10.0.0.11"
mac = "02:00:00:00:00:0b"

[[vip]]
name = "dns"
address = "10.0.0.100"
port = 53
protocol = "udp"
[vip.health]
kind = "none"
[[vip.backend]]
address = "10.0.0.11"
mac = "02:00:00:00:00:0b"

[[vip]]
name = "web6"
address = "fd00::100"
port = 80
protocol = "tcp"
[vip.health]
kind = "none"
[[vip.backend]]
address = "fd00::11"
mac = "02:00:00:00:00:0b"

[[vip]]
name = "dns6"
address = "fd00::100"
port = 53
protocol = "udp"
[vip.health]
kind = "none"
[[vip.backend]]
address = "fd00::11"
mac = "02:00:00:00:00:0b"

[[vip]]
name = "three"
address = "10.0.0.100"
port = 8080
protocol = "tcp"
[vip.health]
kind = "none"
[[vip.backend]]
address = "10.0.0.21"
mac = "02:00:00:00:00:15"
[[vip.backend]]
address = "10.0.0.22"
mac = "02:00:00:00:00:16"
[[vip.backend]]
address = "10.0.0.23"
mac = "02:00:00:00:00:17"

# QUIC by connection ID: the table holds only 10.0.0.11 (server_id 7; 12 drains, 13 is in
# maint), so a packet the table balances comes out to BACKEND_MAC.
[[vip]]
name = "h3"
address = "10.0.0.100"
port = 443
protocol = "udp"
quic = true
[vip.health]
kind = "none"
[[vip.backend]]
address = "10.0.0.11"
mac = "02:00:00:00:00:0b"
server_id = 7
[[vip.backend]]
address = "10.0.0.12"
mac = "02:00:00:00:00:0c"
server_id = 8
state = "drain"
[[vip.backend]]
address = "10.0.0.13"
mac = "02:00:00:00:00:0d"
server_id = 9
state = "maint"

[[vip]]
name = "h36"
address = "fd00::100"
port = 443
protocol = "udp"
quic = true
quic_server_id_len = 4
[vip.health]
kind = "none"
[[vip.backend]]
address = "fd00::11"
mac = "02:00:00:00:00:0b"
server_id = 70000

[[vip]]
name = "empty"
address = "10.0.0.101"
port = 80
protocol = "tcp"
[vip.health]
kind = "none"
[[vip.backend]]
address = "10.0.0.31"
mac = "02:00:00:00:00:1f"
state = "maint"
"#;

// ---- frames -------------------------------------------------------------------------

const TCP_SYN: u8 = 0x02;
const TCP_ACK: u8 = 0x10;

#[derive(Clone, Copy)]
enum L4 {
    Tcp { src: u16, dst: u16, flags: u8 },
    Udp { src: u16, dst: u16 },
    Icmp,
}

impl L4 {
    fn bytes(self) -> Vec<u8> {
        match self {
            L4::Tcp { src, dst, flags } => {
                let mut h = vec![0u8; 20];
                h[0..2].copy_from_slice(&src.to_be_bytes());
                h[2..4].copy_from_slice(&dst.to_be_bytes());
                h[12] = 5 << 4; // data offset: 5 words
                h[13] = flags;
                h[14..16].copy_from_slice(&64240u16.to_be_bytes());
                h.extend_from_slice(b"payload!");
                h
            }
            L4::Udp { src, dst } => {
                let mut h = vec![0u8; 8];
                h[0..2].copy_from_slice(&src.to_be_bytes());
                h[2..4].copy_from_slice(&dst.to_be_bytes());
                h[4..6].copy_from_slice(&16u16.to_be_bytes());
                h.extend_from_slice(b"question");
                h
            }
            L4::Icmp => vec![8, 0, 0, 0, 0, 1, 0, 1],
        }
    }
    fn proto(self) -> u8 {
        match self {
            L4::Tcp { .. } => 6,
            L4::Udp { .. } => 17,
            L4::Icmp => 1,
        }
    }
}

/// A UDP datagram from `src` to `dst` carrying `payload`.
fn udp_bytes(src: u16, dst: u16, payload: &[u8]) -> Vec<u8> {
    let mut h = vec![0u8; 8];
    h[0..2].copy_from_slice(&src.to_be_bytes());
    h[2..4].copy_from_slice(&dst.to_be_bytes());
    h[4..6].copy_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
    h.extend_from_slice(payload);
    h
}

/// An IPv4 QUIC datagram from 10.0.0.1:`src` to the VIP's port 443.
fn quic4(src: u16, payload: &[u8]) -> Vec<u8> {
    let udp = udp_bytes(src, 443, payload);
    let mut f = ethernet(0x0800);
    f.extend(ipv4_header([10, 0, 0, 1], VIP, 17, udp.len(), &[], 0));
    f.extend(udp);
    f
}

/// A QUIC short header (1-RTT) whose destination connection ID carries `server_id` in
/// `id_len` bytes (QUIC-LB plaintext), then a packet number and a sealed payload.
fn short_header(server_id: u128, id_len: u32) -> Vec<u8> {
    let mut packet = vec![0x41];
    let mut cid = [0u8; 12];
    lb_common::quic::encode_cid(server_id, id_len, &[0x5a; 16], &mut cid);
    packet.extend_from_slice(&cid);
    packet.extend_from_slice(&[0xa7; 40]);
    packet
}

/// A QUIC Initial (long header): version 1, a random 8-byte DCID, padding.
fn initial() -> Vec<u8> {
    let mut packet = vec![0xc3, 0, 0, 0, 1, 8, 0x07, 0, 0x08, 1, 2, 3, 4, 5, 0];
    packet.resize(1200, 0);
    packet
}

fn ethernet(ether_type: u16) -> Vec<u8> {
    let mut f = Vec::new();
    f.extend_from_slice(&IFACE_MAC); // the client sends to the balancer
    f.extend_from_slice(&CLIENT_MAC);
    f.extend_from_slice(&ether_type.to_be_bytes());
    f
}

/// IPv4 header with `options` (a multiple of 4 bytes) and the given fragment field.
fn ipv4_header(
    src: [u8; 4],
    dst: [u8; 4],
    proto: u8,
    payload: usize,
    options: &[u8],
    frags: u16,
) -> Vec<u8> {
    let ihl = 5 + options.len() / 4;
    let mut h = vec![0u8; 20];
    h[0] = 0x40 | ihl as u8;
    h[2..4].copy_from_slice(&((ihl * 4 + payload) as u16).to_be_bytes());
    h[6..8].copy_from_slice(&frags.to_be_bytes());
    h[8] = 64;
    h[9] = proto;
    h[12..16].copy_from_slice(&src);
    h[16..20].copy_from_slice(&dst);
    h.extend_from_slice(options);
    h
}

fn ipv4(dst: [u8; 4], l4: L4) -> Vec<u8> {
    ipv4_full(dst, l4, &[], 0)
}

fn ipv4_full(dst: [u8; 4], l4: L4, options: &[u8], frags: u16) -> Vec<u8> {
    let payload = l4.bytes();
    let mut f = ethernet(0x0800);
    f.extend(ipv4_header(
        [10, 0, 0, 1],
        dst,
        l4.proto(),
        payload.len(),
        options,
        frags,
    ));
    f.extend(payload);
    f
}

fn ipv6_with_next(dst: [u8; 16], next: u8, payload: &[u8]) -> Vec<u8> {
    let mut f = ethernet(0x86dd);
    let mut h = vec![0u8; 40];
    h[0] = 0x60;
    h[4..6].copy_from_slice(&(payload.len() as u16).to_be_bytes());
    h[6] = next;
    h[7] = 64;
    h[8..24].copy_from_slice(&"fd00::1".parse::<std::net::Ipv6Addr>().unwrap().octets());
    h[24..40].copy_from_slice(&dst);
    f.extend(h);
    f.extend_from_slice(payload);
    f
}

fn ipv6(dst: [u8; 16], l4: L4) -> Vec<u8> {
    ipv6_with_next(dst, l4.proto(), &l4.bytes())
}

/// Inserts an 802.1Q (or other TPID) tag after the MACs.
fn tagged(frame: Vec<u8>, tpid: u16) -> Vec<u8> {
    let mut f = frame[..12].to_vec();
    f.extend_from_slice(&tpid.to_be_bytes());
    f.extend_from_slice(&100u16.to_be_bytes()); // VLAN 100
    f.extend_from_slice(&frame[12..]);
    f
}

const VIP: [u8; 4] = [10, 0, 0, 100];
const OTHER: [u8; 4] = [10, 0, 0, 2];
const EMPTY_VIP: [u8; 4] = [10, 0, 0, 101];

fn vip6() -> [u8; 16] {
    "fd00::100".parse::<std::net::Ipv6Addr>().unwrap().octets()
}

fn syn(dst: u16) -> L4 {
    L4::Tcp {
        src: 40000,
        dst,
        flags: TCP_SYN,
    }
}

/// What an ICMP error quotes: the start of a packet the VIP sent to a client.
#[derive(Clone, Copy)]
struct Quoted {
    /// The quoted packet's source: the VIP (a test may name another address).
    from: [u8; 4],
    proto: u8,
    vip_port: u16,
    client_port: u16,
    /// The quoted IPv4 header's options and fragment field.
    options: &'static [u8],
    frags: u16,
}

/// The start of a TCP segment the web VIP sent from port 80 to the client's port
/// `client_port` (DF set).
fn quoted_tcp(client_port: u16) -> Quoted {
    Quoted {
        from: VIP,
        proto: 6,
        vip_port: 80,
        client_port,
        options: &[],
        frags: 0x4000,
    }
}

/// An ICMP message `kind`/`code` from a router to `to`, quoting `q` (its IPv4 header
/// and the first 8 bytes of its transport header).
fn icmp4(to: [u8; 4], kind: u8, code: u8, q: Quoted) -> Vec<u8> {
    icmp4_with_options(to, kind, code, q, &[])
}

/// [`icmp4`] with `options` in the ICMP packet's own IPv4 header.
fn icmp4_with_options(to: [u8; 4], kind: u8, code: u8, q: Quoted, options: &[u8]) -> Vec<u8> {
    let mut quoted = ipv4_header(q.from, [10, 0, 0, 1], q.proto, 1400, q.options, q.frags);
    quoted.extend_from_slice(&q.vip_port.to_be_bytes());
    quoted.extend_from_slice(&q.client_port.to_be_bytes());
    quoted.extend_from_slice(&[0, 0, 0, 1]);
    // Type, code, checksum, unused, next-hop MTU 1400.
    let mut icmp = vec![kind, code, 0, 0, 0, 0, 0x05, 0x78];
    icmp.extend(quoted);
    let mut f = ethernet(0x0800);
    f.extend(ipv4_header([10, 0, 0, 254], to, 1, icmp.len(), options, 0));
    f.extend(icmp);
    f
}

/// The UDP counterpart of [`quoted_tcp`]: a datagram the VIP sent from port 53.
fn quoted_udp(client_port: u16) -> Quoted {
    Quoted {
        proto: 17,
        vip_port: 53,
        ..quoted_tcp(client_port)
    }
}

/// An ICMPv6 "packet too big" (MTU 1280) to the IPv6 VIP, quoting a TCP segment it sent
/// from port 80 to fd00::1 port `client_port`.
fn icmp6_too_big(client_port: u16) -> Vec<u8> {
    icmp6_too_big_quoting(6, 80, client_port)
}

/// [`icmp6_too_big`] quoting a `proto` packet the VIP sent from `vip_port`.
fn icmp6_too_big_quoting(proto: u8, vip_port: u16, client_port: u16) -> Vec<u8> {
    let mut quoted = vec![0u8; 40];
    quoted[0] = 0x60;
    quoted[4..6].copy_from_slice(&1400u16.to_be_bytes());
    quoted[6] = proto;
    quoted[7] = 64;
    quoted[8..24].copy_from_slice(&vip6());
    quoted[24..40].copy_from_slice(&"fd00::1".parse::<std::net::Ipv6Addr>().unwrap().octets());
    quoted.extend_from_slice(&vip_port.to_be_bytes());
    quoted.extend_from_slice(&client_port.to_be_bytes());
    quoted.extend_from_slice(&[0, 0, 0, 1]);
    let mut icmp = vec![2, 0, 0, 0, 0, 0, 0x05, 0x00];
    icmp.extend(quoted);
    ipv6_with_next(vip6(), 58, &icmp)
}

const ICMP_UNREACHABLE: u8 = 3;
const ICMP_FRAG_NEEDED: u8 = 4;
const ICMP_PORT_UNREACHABLE: u8 = 3;

/// The frame as the program should send it to `BACKEND_MAC`.
fn forwarded(frame: &[u8]) -> Vec<u8> {
    let mut out = frame.to_vec();
    out[0..6].copy_from_slice(&BACKEND_MAC);
    out[6..12].copy_from_slice(&IFACE_MAC);
    out
}

// ---- harness ------------------------------------------------------------------------

type Fixture = lb_tests::program::Instance;

/// A program instance of its own, its maps written by the agent's code from `text`.
/// Heavy hitters are counted for every new flow here (not sampled), so counts are exact.
fn fixture(text: &str) -> Fixture {
    fixture_with(text, |options| options.source_sample = 1)
}

/// `fixture`, with load-time options changed by `adjust`.
fn fixture_with(text: &str, adjust: impl FnOnce(&mut LoadOptions)) -> Fixture {
    Fixture::load_with(text, adjust).expect("load the fixture")
}

/// Root and a built object, or a loud skip.
fn can_run(test: &str) -> bool {
    if !nix::unistd::geteuid().is_root() {
        lb_tests::skip(test, "BPF_PROG_TEST_RUN needs root");
        return false;
    }
    if EBPF_OBJECT.is_empty() {
        lb_tests::skip(
            test,
            "the eBPF object is empty (built with AYA_BUILD_SKIP=1)",
        );
        return false;
    }
    true
}

// One program instance for all cases; BPF_PROG_TEST_RUN calls are serialized by the lock
// so counter deltas belong to one case.
static FIXTURE: Mutex<Option<Fixture>> = Mutex::new(None);

fn with_fixture<T>(test: &str, body: impl FnOnce(&mut Fixture) -> T) -> Option<T> {
    if !can_run(test) {
        return None;
    }
    let mut guard = FIXTURE.lock().unwrap_or_else(|e| e.into_inner());
    let fixture = guard.get_or_insert_with(|| fixture(CONFIG));
    Some(body(fixture))
}

struct RunResult {
    action: u32,
    output: Vec<u8>,
    /// Outcome counters that changed, by name, with their increase.
    counted: Vec<(&'static str, u64)>,
}

fn run(fixture: &mut Fixture, frame: &[u8]) -> RunResult {
    let before = fixture
        .dataplane
        .counters(&[], &[])
        .expect("counters")
        .outcomes;
    let mut out = vec![0u8; frame.len() + 256];
    let program = fixture.dataplane.program_mut().expect("program");
    let result = program
        .test_run(TestRunOptions {
            data_in: Some(frame),
            data_out: Some(&mut out),
            repeat: 1,
            ..TestRunOptions::default()
        })
        .expect("BPF_PROG_TEST_RUN");
    out.truncate(result.data_size_out as usize);
    let after = fixture
        .dataplane
        .counters(&[], &[])
        .expect("counters")
        .outcomes;
    let counted = stat::NAMES
        .iter()
        .zip(before.iter().zip(&after))
        .filter(|(_, (b, a))| a != b)
        .map(|(name, (b, a))| (*name, a - b))
        .collect();
    RunResult {
        action: result.return_value,
        output: out,
        counted,
    }
}

fn action_name(action: u32) -> &'static str {
    stat::NAMES
        .get(action as usize)
        .copied()
        .unwrap_or("unknown")
}

/// Names the first differing byte and the header field it belongs to.
fn describe_difference(want: &[u8], got: &[u8]) -> String {
    if want.len() != got.len() {
        return format!("length {} != expected {}", got.len(), want.len());
    }
    let Some(i) = want.iter().zip(got).position(|(a, b)| a != b) else {
        return "identical".into();
    };
    let field = match i {
        0..=5 => "ethernet destination MAC",
        6..=11 => "ethernet source MAC",
        12..=13 => "EtherType",
        _ => "a header or payload byte past Ethernet",
    };
    format!(
        "byte {i} ({field}): got {:#04x}, expected {:#04x}",
        got[i], want[i]
    )
}

struct Case {
    what: &'static str,
    frame: Vec<u8>,
    action: u32,
    reason: &'static str,
    /// The other counters the frame moves, each by one: every counter not named (nor the
    /// action's, nor `reason`) must stay where it was.
    also: &'static [&'static str],
    /// None: the frame must come out unchanged.
    output: Option<Vec<u8>>,
}

impl Case {
    fn also(self, also: &'static [&'static str]) -> Case {
        Case { also, ..self }
    }

    /// Every counter the case moves, each by one, sorted by name.
    fn counted(&self) -> Vec<(&'static str, u64)> {
        let mut names = vec![action_name(self.action), self.reason];
        names.extend(self.also);
        names.sort();
        names.dedup();
        names.into_iter().map(|name| (name, 1)).collect()
    }
}

fn cases() -> Vec<Case> {
    let fwd = |what, frame: Vec<u8>, reason| {
        let output = Some(forwarded(&frame));
        Case {
            what,
            frame,
            action: XDP_TX,
            reason,
            also: &[],
            output,
        }
    };
    let pass = |what, frame, reason| Case {
        what,
        frame,
        action: XDP_PASS,
        reason,
        also: &[],
        output: None,
    };
    let drop = |what, frame, reason| Case {
        what,
        frame,
        action: XDP_DROP,
        reason,
        also: &[],
        output: None,
    };

    let syn_frame = ipv4(VIP, syn(80));
    let tcp_l4_offset = 14 + 20;
    let mut cases = vec![
        fwd("IPv4 TCP SYN to the VIP", syn_frame.clone(), "xdp_tx")
            .also(&["ct_embryonic", "ct_miss_syn"]),
        fwd(
            "IPv4 TCP ACK to the VIP",
            ipv4(
                VIP,
                L4::Tcp {
                    src: 40000,
                    dst: 80,
                    flags: TCP_ACK,
                },
            ),
            "xdp_tx",
        )
        .also(&["ct_created", "ct_promoted"]),
        fwd(
            "IPv4 UDP to the UDP VIP",
            ipv4(VIP, L4::Udp { src: 5353, dst: 53 }),
            "xdp_tx",
        )
        .also(&["ct_embryonic", "ct_miss_udp"]),
        fwd("IPv6 TCP SYN to the VIP", ipv6(vip6(), syn(80)), "xdp_tx")
            .also(&["ct_embryonic", "ct_miss_syn"]),
        fwd(
            "IPv6 UDP to the UDP VIP",
            ipv6(vip6(), L4::Udp { src: 5353, dst: 53 }),
            "xdp_tx",
        )
        .also(&["ct_embryonic", "ct_miss_udp"]),
        fwd(
            "802.1Q-tagged IPv4 TCP to the VIP keeps its tag",
            tagged(syn_frame.clone(), 0x8100),
            "seen_vlan",
        )
        .also(&["ct_embryonic", "ct_miss_syn"]),
        fwd(
            "IPv4 with 8 bytes of options is parsed past",
            ipv4_full(VIP, syn(80), &[1, 1, 1, 1, 1, 1, 1, 0], 0),
            "seen_ipv4_options",
        )
        .also(&["ct_embryonic", "ct_miss_syn"]),
        pass(
            "QinQ (802.1ad outer tag) is not parsed",
            tagged(syn_frame.clone(), 0x88a8),
            "pass_vlan_stacked",
        ),
        pass(
            "two 802.1Q tags are not parsed",
            tagged(tagged(syn_frame.clone(), 0x8100), 0x8100),
            "pass_vlan_stacked",
        ),
        pass(
            "TCP to the VIP on another port",
            ipv4(VIP, syn(81)),
            "pass_not_vip",
        ),
        pass(
            "UDP to the TCP VIP's port",
            ipv4(VIP, L4::Udp { src: 5353, dst: 80 }),
            "pass_not_vip",
        ),
        pass(
            "TCP to a non-VIP address",
            ipv4(OTHER, syn(80)),
            "pass_not_vip",
        ),
        pass(
            "IPv6 TCP to the VIP on another port",
            ipv6(vip6(), syn(81)),
            "pass_not_vip",
        ),
        pass("ICMP to the VIP", ipv4(VIP, L4::Icmp), "pass_other_proto"),
        fwd(
            "ICMP fragmentation needed about a TCP flow of the VIP goes to its backend",
            icmp4(VIP, ICMP_UNREACHABLE, ICMP_FRAG_NEEDED, quoted_tcp(40000)),
            "seen_icmp_too_big",
        ),
        fwd(
            "ICMP fragmentation needed with IPv4 options of its own",
            icmp4_with_options(
                VIP,
                ICMP_UNREACHABLE,
                ICMP_FRAG_NEEDED,
                quoted_tcp(40000),
                &[1, 1, 1, 0],
            ),
            "seen_ipv4_options",
        )
        .also(&["seen_icmp_too_big"]),
        fwd(
            "ICMP fragmentation needed quoting a header with IPv4 options",
            icmp4(
                VIP,
                ICMP_UNREACHABLE,
                ICMP_FRAG_NEEDED,
                Quoted {
                    options: &[1, 1, 1, 0],
                    ..quoted_tcp(40000)
                },
            ),
            "seen_icmp_too_big",
        ),
        fwd(
            "802.1Q-tagged ICMP fragmentation needed keeps its tag",
            tagged(
                icmp4(VIP, ICMP_UNREACHABLE, ICMP_FRAG_NEEDED, quoted_tcp(40000)),
                0x8100,
            ),
            "seen_vlan",
        )
        .also(&["seen_icmp_too_big"]),
        pass(
            "ICMP fragmentation needed quoting a later fragment (no ports)",
            icmp4(
                VIP,
                ICMP_UNREACHABLE,
                ICMP_FRAG_NEEDED,
                Quoted {
                    frags: 185,
                    ..quoted_tcp(40000)
                },
            ),
            "pass_other_proto",
        ),
        fwd(
            "ICMPv6 packet too big about a flow of the VIP goes to its backend",
            icmp6_too_big(40000),
            "seen_icmp_too_big",
        ),
        pass(
            "ICMP fragmentation needed about another port of the VIP's address",
            icmp4(
                VIP,
                ICMP_UNREACHABLE,
                ICMP_FRAG_NEEDED,
                Quoted {
                    vip_port: 81,
                    ..quoted_tcp(40000)
                },
            ),
            "pass_not_vip",
        ),
        pass(
            "ICMP port unreachable about a flow of the VIP",
            icmp4(
                VIP,
                ICMP_UNREACHABLE,
                ICMP_PORT_UNREACHABLE,
                quoted_tcp(40000),
            ),
            "pass_other_proto",
        ),
        pass(
            "ICMP fragmentation needed sent to the VIP, quoting another source",
            icmp4(
                VIP,
                ICMP_UNREACHABLE,
                ICMP_FRAG_NEEDED,
                Quoted {
                    from: OTHER,
                    ..quoted_tcp(40000)
                },
            ),
            "pass_other_proto",
        ),
        pass(
            "ICMP fragmentation needed whose quoted ports are cut off",
            {
                let f = icmp4(VIP, ICMP_UNREACHABLE, ICMP_FRAG_NEEDED, quoted_tcp(40000));
                f[..f.len() - 6].to_vec()
            },
            "pass_other_proto",
        ),
        pass(
            "ICMPv6 echo request to the VIP",
            ipv6_with_next(vip6(), 58, &[128, 0, 0, 0, 0, 0, 0, 0]),
            "pass_other_proto",
        ),
        pass(
            "ARP",
            {
                let mut f = ethernet(0x0806);
                f.extend([0u8; 28]);
                f
            },
            "pass_not_ip",
        ),
        pass(
            "unknown EtherType",
            {
                let mut f = ethernet(0x88b5);
                f.extend([0u8; 46]);
                f
            },
            "pass_not_ip",
        ),
        pass(
            "first IPv4 fragment (MF set)",
            ipv4_full(VIP, syn(80), &[], 0x2000),
            "pass_fragment",
        ),
        pass(
            "later IPv4 fragment (offset 185)",
            ipv4_full(VIP, syn(80), &[], 185),
            "pass_fragment",
        ),
        pass(
            "IPv6 with a hop-by-hop header",
            ipv6_with_next(vip6(), 0, &[6, 0, 1, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]),
            "pass_ipv6_ext",
        ),
        drop(
            "Ethernet header alone: IPv4 header missing",
            ethernet(0x0800),
            "drop_truncated",
        ),
        drop(
            "IPv4 header cut short",
            syn_frame[..14 + 12].to_vec(),
            "drop_truncated",
        ),
        drop(
            "TCP header cut short",
            syn_frame[..tcp_l4_offset + 10].to_vec(),
            "drop_truncated",
        ),
        drop(
            "VLAN tag cut short",
            tagged(syn_frame.clone(), 0x8100)[..16].to_vec(),
            "drop_truncated",
        ),
        drop(
            "IPv4 header length 60 (options) longer than the frame",
            {
                let mut f = syn_frame[..14 + 20 + 8].to_vec();
                f[14] = 0x4f;
                f
            },
            "drop_truncated",
        ),
        drop(
            "UDP header cut short",
            ipv4(VIP, L4::Udp { src: 5353, dst: 53 })[..14 + 20 + 4].to_vec(),
            "drop_truncated",
        ),
        drop(
            "IPv4 header length below 20 bytes",
            {
                let mut f = syn_frame.clone();
                f[14] = 0x44;
                f
            },
            "drop_bad_header",
        ),
        drop(
            "IPv4 EtherType, version 6 in the header",
            {
                let mut f = syn_frame.clone();
                f[14] = 0x65;
                f
            },
            "drop_bad_header",
        ),
        drop(
            "IPv6 header cut short",
            ipv6(vip6(), syn(80))[..14 + 30].to_vec(),
            "drop_truncated",
        ),
        drop(
            "IPv6 TCP header cut short",
            ipv6(vip6(), syn(80))[..14 + 40 + 10].to_vec(),
            "drop_truncated",
        ),
        drop(
            "IPv6 EtherType, version 4 in the header",
            {
                let mut f = ipv6(vip6(), syn(80));
                f[14] = 0x40 | (f[14] & 0x0f);
                f
            },
            "drop_bad_header",
        ),
        drop(
            "VIP whose only backend is in maintenance",
            ipv4(EMPTY_VIP, syn(80)),
            "drop_no_backend",
        )
        .also(&["ct_miss_syn"]),
        // TCP flag combinations: only a SYN without ACK is a connection attempt (SYN|ACK
        // and no flags are non-SYN misses, remembered as first packets); a SYN with RST
        // is balanced as a SYN but, as any RST, leaves no state; SYN|FIN is a SYN.
        fwd(
            "IPv4 TCP SYN|ACK to the VIP",
            ipv4(VIP, tcp_flags(41001, TCP_SYN | TCP_ACK)),
            "xdp_tx",
        )
        .also(&["ct_embryonic", "ct_miss_non_syn"]),
        fwd(
            "IPv4 TCP SYN|RST to the VIP",
            ipv4(VIP, tcp_flags(41002, TCP_SYN | TCP_RST)),
            "xdp_tx",
        )
        .also(&["ct_miss_syn"]),
        fwd(
            "IPv4 TCP SYN|FIN to the VIP",
            ipv4(VIP, tcp_flags(41003, TCP_SYN | TCP_FIN)),
            "xdp_tx",
        )
        .also(&["ct_embryonic", "ct_miss_syn"]),
        fwd(
            "IPv4 TCP with no flag to the VIP",
            ipv4(VIP, tcp_flags(41004, 0)),
            "xdp_tx",
        )
        .also(&["ct_embryonic", "ct_miss_non_syn"]),
        fwd(
            "802.1Q-tagged IPv6 TCP to the VIP keeps its tag",
            tagged(ipv6(vip6(), syn(80)), 0x8100),
            "seen_vlan",
        )
        .also(&["ct_embryonic", "ct_miss_syn"]),
        pass(
            "802.1Q-tagged ARP",
            {
                let mut f = ethernet(0x0806);
                f.extend([0u8; 28]);
                tagged(f, 0x8100)
            },
            "pass_not_ip",
        ),
        pass(
            "ICMP fragmentation needed quoting an IPv4 header length below 20 bytes",
            {
                let mut f = icmp4(VIP, ICMP_UNREACHABLE, ICMP_FRAG_NEEDED, quoted_tcp(40000));
                // The quoted header's version and length: after Ethernet, IPv4, ICMP.
                f[14 + 20 + 8] = 0x44;
                f
            },
            "pass_other_proto",
        ),
        // A UDP flow with an entry (its second datagram makes it), then an ICMPv6 too big
        // about it, and one about a UDP flow the balancer does not hold.
        fwd(
            "IPv6 UDP, first datagram of port 5454",
            ipv6(vip6(), L4::Udp { src: 5454, dst: 53 }),
            "xdp_tx",
        )
        .also(&["ct_embryonic", "ct_miss_udp"]),
        fwd(
            "IPv6 UDP, second datagram of port 5454",
            ipv6(vip6(), L4::Udp { src: 5454, dst: 53 }),
            "xdp_tx",
        )
        .also(&["ct_created", "ct_promoted"]),
        fwd(
            "ICMPv6 packet too big about a UDP flow of the VIP goes to its backend",
            icmp6_too_big_quoting(17, 53, 5454),
            "seen_icmp_too_big",
        ),
        pass(
            "ICMPv6 packet too big about a UDP flow without an entry",
            icmp6_too_big_quoting(17, 53, 5455),
            "pass_other_proto",
        ),
    ];
    // Every IPv6 extension header the parser knows but hop-by-hop (above).
    cases.extend(quic_cases(fwd));
    for (next, what) in [
        (43, "IPv6 with a routing header"),
        (44, "IPv6 with a fragment header"),
        (50, "IPv6 with ESP"),
        (51, "IPv6 with AH"),
        (60, "IPv6 with destination options"),
        (135, "IPv6 with a mobility header"),
        (139, "IPv6 with a HIP header"),
        (140, "IPv6 with a shim6 header"),
    ] {
        let header = [6, 0, 1, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        cases.push(pass(
            what,
            ipv6_with_next(vip6(), next, &header),
            "pass_ipv6_ext",
        ));
    }
    cases
}

/// QUIC VIPs ("h3", "h36"): short headers by server ID, the rest as plain UDP; each
/// from a port of its own (the instance's tables carry over from case to case).
fn quic_cases(fwd: impl Fn(&'static str, Vec<u8>, &'static str) -> Case) -> Vec<Case> {
    let by_table = ["ct_embryonic", "ct_miss_udp"].as_slice();
    let mut no_fixed_bit = short_header(7, 2);
    no_fixed_bit[0] = 0x01;
    let mut unroutable = short_header(7, 2);
    unroutable[1] = 0xe0 | 11;
    let drained = quic4(44303, &short_header(8, 2));
    let mut to_drained = forwarded(&drained);
    to_drained[5] = 0x0c;
    let mut v6 = ipv6(
        vip6(),
        L4::Udp {
            src: 44310,
            dst: 443,
        },
    );
    v6.truncate(v6.len() - 8 - 8);
    v6.extend(udp_bytes(44310, 443, &short_header(70000, 4)));
    let payload_len = (v6.len() - 14 - 40) as u16;
    v6[14 + 4..14 + 6].copy_from_slice(&payload_len.to_be_bytes());
    vec![
        fwd(
            "QUIC Initial (long header) is balanced as UDP",
            quic4(44300, &initial()),
            "xdp_tx",
        )
        .also(by_table),
        fwd(
            "QUIC short header with a known server ID goes to that backend",
            quic4(44301, &short_header(7, 2)),
            "quic_routed_by_cid",
        )
        .also(&["xdp_tx", "ct_created"]),
        fwd(
            "QUIC short header of that connection from a new port follows it too",
            quic4(44302, &short_header(7, 2)),
            "quic_routed_by_cid",
        )
        .also(&["xdp_tx", "ct_created"]),
        Case {
            output: Some(to_drained),
            ..fwd(
                "QUIC short header to a draining backend's ID still goes there",
                drained,
                "quic_routed_by_cid",
            )
            .also(&["xdp_tx", "ct_created"])
        },
        fwd(
            "QUIC short header with an unknown server ID is balanced as UDP",
            quic4(44304, &short_header(99, 2)),
            "quic_cid_unknown",
        )
        .also(by_table),
        fwd(
            "QUIC short header naming a backend in maint is balanced as UDP",
            quic4(44305, &short_header(9, 2)),
            "quic_cid_unknown",
        )
        .also(by_table),
        fwd(
            "QUIC short header cut short (17 bytes) is balanced as UDP",
            quic4(44306, &short_header(7, 2)[..17]),
            "xdp_tx",
        )
        .also(by_table),
        fwd(
            "QUIC datagram with the fixed bit clear is balanced as UDP",
            quic4(44307, &no_fixed_bit),
            "xdp_tx",
        )
        .also(by_table),
        fwd(
            "QUIC short header with an unroutable CID is balanced as UDP",
            quic4(44308, &unroutable),
            "xdp_tx",
        )
        .also(by_table),
        fwd(
            "empty UDP datagram to a QUIC VIP is balanced as UDP",
            quic4(44309, &[]),
            "xdp_tx",
        )
        .also(by_table),
        fwd(
            "IPv6 QUIC short header with a 4-byte server ID goes to its backend",
            v6,
            "quic_routed_by_cid",
        )
        .also(&["xdp_tx", "ct_created"]),
    ]
}

/// A TCP segment from port `src` to port 80 with `flags`.
fn tcp_flags(src: u16, flags: u8) -> L4 {
    L4::Tcp {
        src,
        dst: 80,
        flags,
    }
}

const TCP_FIN: u8 = 0x01;

/// Every case, in order, on an instance of its own (the shared one's connection table
/// depends on which tests ran before): the action, the output frame, and exactly the
/// counters the case names moved.
#[test]
fn packet_fixtures() {
    if !can_run("packet_fixtures") {
        return;
    }
    let fixture = &mut fixture(CONFIG);
    {
        let mut failures = Vec::new();
        for case in cases() {
            let result = run(fixture, &case.frame);
            let mut problems = Vec::new();
            if result.action != case.action {
                problems.push(format!(
                    "action {} != expected {}",
                    action_name(result.action),
                    action_name(case.action)
                ));
            }
            let mut counted = result.counted.clone();
            counted.sort();
            if counted != case.counted() {
                problems.push(format!(
                    "counters moved {counted:?}, expected exactly {:?}",
                    case.counted()
                ));
            }
            let want = case.output.clone().unwrap_or_else(|| case.frame.clone());
            if result.output != want {
                problems.push(format!(
                    "output frame: {}",
                    describe_difference(&want, &result.output)
                ));
            }
            if !problems.is_empty() {
                failures.push(format!("{}: {}", case.what, problems.join("; ")));
            }
        }
        assert!(
            failures.is_empty(),
            "{} case(s) failed:\n{}",
            failures.len(),
            failures.join("\n")
        );
    }
}

/// The ids of VIP "web" and of its one backend.
fn web_ids(fixture: &Fixture) -> (u32, u32) {
    let vip = fixture
        .model
        .vips
        .iter()
        .find(|v| v.config.name == "web")
        .unwrap();
    (vip.id, vip.backends[0].id)
}

#[test]
fn syn_counts_a_new_flow_for_the_vip_and_backend() {
    with_fixture("syn_counts_a_new_flow_for_the_vip_and_backend", |fixture| {
        let (vip_id, backend_id) = web_ids(fixture);
        let read = |f: &Fixture| {
            let c = f.dataplane.counters(&[vip_id], &[backend_id]).unwrap();
            (c.vips[&vip_id], c.backends[&backend_id])
        };
        let (vip_before, backend_before) = read(fixture);
        let frame = ipv4(VIP, syn(80));
        run(fixture, &frame);
        run(
            fixture,
            &ipv4(
                VIP,
                L4::Tcp {
                    src: 40000,
                    dst: 80,
                    flags: TCP_ACK,
                },
            ),
        );
        let (vip_after, backend_after) = read(fixture);
        assert_eq!(vip_after.packets - vip_before.packets, 2);
        assert_eq!(
            vip_after.new_flows - vip_before.new_flows,
            1,
            "only the SYN is a new flow"
        );
        assert_eq!(backend_after.packets - backend_before.packets, 2);
        assert_eq!(
            backend_after.bytes - backend_before.bytes,
            2 * frame.len() as u64
        );
        assert_eq!(backend_after.new_flows - backend_before.new_flows, 1);
    });
}

/// An established flow's segment to the VIP's port 80 from port `src`, with `payload`
/// bytes of data (a frame of 14 + 20 + 20 + 8 + `payload` bytes).
fn segment(src: u16, payload: u32) -> Vec<u8> {
    let mut frame = ipv4(
        VIP,
        L4::Tcp {
            src,
            dst: 80,
            flags: TCP_ACK,
        },
    );
    frame.extend((0..payload).map(|i| (i % 251) as u8));
    let ip_len = (frame.len() - 14) as u16;
    frame[16..18].copy_from_slice(&ip_len.to_be_bytes());
    frame
}

/// The bytes the program counted for the web VIP's backend `backend_id`.
fn backend_bytes(fixture: &Fixture, backend_id: u32) -> u64 {
    let counters = fixture.dataplane.counters(&[], &[backend_id]).unwrap();
    counters.backends[&backend_id].bytes
}

/// A jumbo frame (MTU 9000) arrives in several buffers: BPF_PROG_TEST_RUN puts what
/// exceeds a page less headroom (about 3.5 KB) in fragments, as a multi-buffer driver
/// does. The headers are in the first buffer; the program forwards the whole frame and
/// counts all its bytes, not just the first buffer's.
#[test]
fn a_jumbo_frame_in_several_buffers_is_forwarded_whole() {
    with_fixture(
        "a_jumbo_frame_in_several_buffers_is_forwarded_whole",
        |fixture| {
            let (_, backend_id) = web_ids(fixture);
            let frame = segment(40123, 8952);
            assert_eq!(frame.len(), 9014);
            let before = backend_bytes(fixture, backend_id);
            let result = run(fixture, &frame);
            assert_eq!(
                action_name(result.action),
                action_name(XDP_TX),
                "counted {:?}",
                result.counted
            );
            assert_eq!(result.output.len(), frame.len(), "the frame came back cut");
            let want = forwarded(&frame);
            assert!(
                result.output == want,
                "output differs: {}",
                describe_difference(&want, &result.output)
            );
            assert_eq!(
                backend_bytes(fixture, backend_id) - before,
                frame.len() as u64,
                "the backend's bytes count the whole frame"
            );
        },
    );
}

/// Where the agent says every frame comes in one buffer (`TunnelConfig::linear_frames`:
/// one interface, native mode, an MTU one buffer holds), the program reads a frame's
/// length from that buffer instead of asking the kernel, and counts it the same. That
/// it reads the buffer shows in the frame the flag is wrong for: a jumbo frame in
/// several buffers then counts its first buffer only (why the agent clears the flag
/// above `SINGLE_BUFFER_MTU`).
#[test]
fn a_frame_in_one_buffer_is_counted_whole_without_asking_the_kernel() {
    with_fixture(
        "a_frame_in_one_buffer_is_counted_whole_without_asking_the_kernel",
        |fixture| {
            let (_, backend_id) = web_ids(fixture);
            let frame = segment(40124, 1400);
            let linear = lb_common::TunnelConfig {
                linear_frames: 1,
                ..Default::default()
            };
            fixture.dataplane.set_tunnel(&linear).unwrap();
            let before = backend_bytes(fixture, backend_id);
            let result = run(fixture, &frame);
            let jumbo = segment(40125, 8952);
            let jumbo_before = backend_bytes(fixture, backend_id);
            let jumbo_result = run(fixture, &jumbo);
            // The fixture is shared: the default again (ask the kernel), as the agent
            // writes it before it knows the mode.
            fixture.dataplane.set_tunnel(&Default::default()).unwrap();
            assert_eq!(action_name(result.action), action_name(XDP_TX));
            let counted = jumbo_before - before;
            assert_eq!(counted, frame.len() as u64);
            assert_eq!(action_name(jumbo_result.action), action_name(XDP_TX));
            let first_buffer = backend_bytes(fixture, backend_id) - jumbo_before;
            assert!(
                first_buffer < jumbo.len() as u64 && first_buffer >= 54,
                "a multi-buffer frame counted {first_buffer} bytes with the flag set: the \
                 program did not take the first buffer's length"
            );
        },
    );
}

/// `lb explain` over the fixture's model, tables and connection table.
fn explain_flow(fixture: &Fixture, request: &ExplainRequest) -> explain::Explanation {
    let desired = fixture.model.desired();
    let view = explain::View {
        model: &fixture.model,
        desired: &desired,
        flows: &fixture.dataplane,
        slot_words: &fixture.writer.slot_words(),
        flow_idle: fixture.config.dataplane.flow_idle_timeout,
        interfaces: &fixture.config.dataplane.interfaces,
    };
    explain::explain(&view, request, explain::monotonic_ns()).expect("explain")
}

/// The kernel and `lb explain` pick the same backend for many random flows: explain is
/// `lb-common`'s hash over the agent's table plus the connection-table lookup.
#[test]
fn kernel_and_explain_agree_on_random_flows() {
    with_fixture("kernel_and_explain_agree_on_random_flows", |fixture| {
        agree_on_random_flows(fixture, "three", false);
    });
}

/// The same over IPv6: VIP "three6" (fd00::100 port 8080, three backends).
#[test]
fn kernel_and_explain_agree_on_random_ipv6_flows() {
    let test = "kernel_and_explain_agree_on_random_ipv6_flows";
    if !can_run(test) {
        return;
    }
    let mut fixture = fixture(&format!("{CONFIG}{THREE6}"));
    agree_on_random_flows(&mut fixture, "three6", true);
}

const THREE6: &str = r#"
[[vip]]
name = "three6"
address = "fd00::100"
port = 8080
protocol = "tcp"
[vip.health]
kind = "none"
[[vip.backend]]
address = "fd00::21"
mac = "02:00:00:00:00:15"
[[vip.backend]]
address = "fd00::22"
mac = "02:00:00:00:00:16"
[[vip.backend]]
address = "fd00::23"
mac = "02:00:00:00:00:17"
"#;

/// 500 pseudo-random flows to port 8080 of VIP `name` (three backends), half starting
/// with a SYN, half mid-connection: the kernel sends each where `lb explain` said the
/// table would, and the embryonic table then remembers it there.
fn agree_on_random_flows(fixture: &mut Fixture, name: &str, v6: bool) {
    let vip: VipTarget = if v6 {
        "[fd00::100]:8080/tcp"
    } else {
        "10.0.0.100:8080/tcp"
    }
    .parse()
    .unwrap();
    let mut seen = std::collections::HashSet::new();
    let mut state = 0x2545_f491_4f6c_dd1du64;
    for i in 0..500 {
        // xorshift: reproducible pseudo-random flows without a dependency.
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let port = (state >> 32) as u16 | 1024;
        // Half the flows start with a SYN, half mid-connection (no entry yet).
        let flags = if i % 2 == 0 { TCP_SYN } else { TCP_ACK };
        let l4 = L4::Tcp {
            src: port,
            dst: 8080,
            flags,
        };
        let (source, frame) = if v6 {
            let mut src = "fd00::".parse::<std::net::Ipv6Addr>().unwrap().octets();
            src[8..16].copy_from_slice(&state.to_be_bytes());
            let mut frame = ipv6(vip6(), l4);
            frame[14 + 8..14 + 24].copy_from_slice(&src);
            (std::net::SocketAddr::from((src, port)), frame)
        } else {
            let src = [
                10,
                (state >> 8) as u8,
                (state >> 16) as u8,
                (state >> 24) as u8,
            ];
            let mut frame = ipv4(VIP, l4);
            frame[14 + 12..14 + 16].copy_from_slice(&src);
            (std::net::SocketAddr::from((src, port)), frame)
        };
        let request = ExplainRequest::flow(vip, source);
        let before = explain_flow(fixture, &request);
        let result = run(fixture, &frame);
        assert_eq!(result.action, XDP_TX);
        let predicted = before.table_backend.expect("three backends");
        let mac_of = |address: &str| {
            let vip = fixture
                .model
                .vips
                .iter()
                .find(|v| v.config.name == name)
                .unwrap();
            vip.backends
                .iter()
                .find(|b| b.config.address.to_string() == address)
                .unwrap()
                .mac
                .unwrap()
                .0
        };
        assert_eq!(
            result.output[0..6],
            mac_of(&predicted),
            "{source}: kernel and explain disagree"
        );
        // A first packet makes no entry: the embryonic table remembers it, and the
        // next packet goes there.
        let after = explain_flow(fixture, &request);
        assert_eq!(after.conntrack_backend, None, "{source}: entry");
        assert_eq!(
            after.embryonic_backend.as_deref(),
            Some(predicted.as_str()),
            "{source}: remembered"
        );
        assert_eq!(after.next_packet_backend, after.embryonic_backend);
        seen.insert(predicted);
    }
    assert_eq!(seen.len(), 3, "500 flows should reach all three backends");
}

/// The kernel and `lb explain` send the next packet of many flows to the same backend
/// while their entries name backends in every state (serving, draining, failed, another
/// VIP's, gone) and, for UDP, are of every age around the idle time: explain runs the
/// program's own decision (`lb_common::flow`) over what the agent wrote.
#[test]
fn kernel_and_explain_agree_on_where_the_next_packet_goes() {
    if !can_run("kernel_and_explain_agree_on_where_the_next_packet_goes") {
        return;
    }
    let backends = [("10.0.0.41", 1), ("10.0.0.42", 1), ("10.0.0.43", 1)];
    let mut fixture = fixture(&sticky_config(&backends, 0));
    // 41 failed; 42 drains (keeps its flows, out of the table); 43 serves.
    for b in fixture.model.backends_mut() {
        match b.config.address.to_string().as_str() {
            "10.0.0.41" => b.health = lb_userspace::model::Health::Down,
            "10.0.0.42" => b.config.state = lb_userspace::config::AdminState::Drain,
            _ => {}
        }
    }
    fixture.sync().expect("sync");
    let mut ids: Vec<u32> = ["tcp", "udp"]
        .iter()
        .flat_map(|vip| [41, 42, 43].map(|last| backend_named(&fixture, vip, last)))
        .collect();
    ids.push(4000); // no backend
    let idle = fixture.config.dataplane.flow_idle_timeout.as_nanos() as u64;
    // Ages a second clear of the idle time: the program's clock is the coarse one.
    let ages = [0, idle - 1_000_000_000, idle + 1_000_000_000];
    let mut followed = std::collections::HashSet::new();
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    for i in 0..300u32 {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let proto = if i % 2 == 0 { "tcp" } else { "udp" };
        let port = 20000 + i as u16;
        let backend_id = ids[(state % ids.len() as u64) as usize];
        let age = ages[((state >> 8) % ages.len() as u64) as usize];
        let vip: VipTarget = format!(
            "10.0.0.100:{}/{proto}",
            if proto == "udp" { 53 } else { 80 }
        )
        .parse()
        .unwrap();
        let source: std::net::SocketAddr = format!("10.0.0.1:{port}").parse().unwrap();
        let entry = lb_common::FlowEntry {
            backend_id,
            flags: 0,
            last_seen_ns: explain::monotonic_ns() - age,
        };
        fixture
            .dataplane
            .insert_flow(&explain::flow_key(&vip, source), &entry)
            .unwrap();
        let (_, next) = explained(&fixture, proto, port);
        let frame = if proto == "udp" {
            ipv4(VIP, L4::Udp { src: port, dst: 53 })
        } else {
            tcp(port, TCP_ACK)
        };
        let result = run(&mut fixture, &frame);
        assert_eq!(
            Some(backend_of(&result)),
            next,
            "{proto} flow {port} with an entry on backend id {backend_id}, {age} ns idle: \
             kernel and explain disagree ({:?})",
            result.counted
        );
        if counted(&result, "ct_hit") == 1 {
            followed.insert(next);
        }
    }
    // Entries on the draining and the serving backend were followed.
    assert_eq!(followed, [Some(42), Some(43)].into(), "followed to");
}

// ---- connection table -------------------------------------------------------------

/// Two TCP and one UDP VIP for the connection-table cases, each test on its own program.
fn sticky_config(backends: &[(&str, u32)], insert_limit: u64) -> String {
    let mut text = format!(
        "[dataplane]\ninterface = \"lo\"\nmaglev_table_size = 251\nconntrack_entries = 4096\n\
         conntrack_insert_limit = {insert_limit}\n"
    );
    for (name, port, proto) in [("tcp", 80, "tcp"), ("udp", 53, "udp")] {
        text += &format!(
            "[[vip]]\nname = \"{name}\"\naddress = \"10.0.0.100\"\nport = {port}\nprotocol = \"{proto}\"\n\
             [vip.health]\nkind = \"none\"\n"
        );
        for (address, weight) in backends {
            let last: u8 = address.rsplit('.').next().unwrap().parse().unwrap();
            text += &format!(
                "[[vip.backend]]\naddress = \"{address}\"\nweight = {weight}\nmac = \"02:00:00:00:00:{last:02x}\"\n"
            );
        }
    }
    text
}

fn tcp(src_port: u16, flags: u8) -> Vec<u8> {
    ipv4(
        VIP,
        L4::Tcp {
            src: src_port,
            dst: 80,
            flags,
        },
    )
}

/// A TCP handshake from `src_port` as the balancer sees it (the SYN, then the client's
/// ACK, which enters the flow into the connection table): the backend, which both went to.
fn handshake(fixture: &mut Fixture, src_port: u16) -> u8 {
    let syn = run(fixture, &tcp(src_port, TCP_SYN));
    assert_eq!(counted(&syn, "ct_created"), 0, "a SYN makes no entry");
    assert_eq!(counted(&syn, "ct_embryonic"), 1, "{:?}", syn.counted);
    let ack = run(fixture, &tcp(src_port, TCP_ACK));
    assert_eq!(
        (counted(&ack, "ct_promoted"), counted(&ack, "ct_created")),
        (1, 1),
        "the ACK enters the flow: {:?}",
        ack.counted
    );
    assert_eq!(backend_of(&ack), backend_of(&syn), "port {src_port}");
    backend_of(&ack)
}

/// The last octet of the backend a forwarded frame was sent to (its MAC's last byte).
fn backend_of(result: &RunResult) -> u8 {
    assert_eq!(result.action, XDP_TX, "not forwarded: {:?}", result.counted);
    result.output[5]
}

/// Passed to the kernel, counted once as `reason`.
fn assert_passed(result: &RunResult, reason: &str, what: &str) {
    assert_eq!(
        (result.action, counted(result, reason)),
        (XDP_PASS, 1),
        "{what}: expected a pass for {reason}, counted {:?}",
        result.counted
    );
}

fn counted(result: &RunResult, name: &str) -> u64 {
    result
        .counted
        .iter()
        .find(|(n, _)| *n == name)
        .map_or(0, |(_, v)| *v)
}

const TCP_RST: u8 = 0x04;

/// A program whose TCP VIP had two backends when a handshake came from each of `ports`, then
/// a new table (a third backend, other weights) that sends many of those flows
/// elsewhere. Returns it and the backend each flow was given (its MAC's last byte).
fn flows_then_new_table(ports: &[u16]) -> (Fixture, Vec<u8>) {
    let mut fixture = fixture(&sticky_config(&[("10.0.0.41", 1), ("10.0.0.42", 1)], 0));
    let before = ports.iter().map(|&p| handshake(&mut fixture, p)).collect();
    fixture
        .reconfigure(&sticky_config(
            &[("10.0.0.41", 5), ("10.0.0.42", 1), ("10.0.0.43", 3)],
            0,
        ))
        .expect("reconfigure");
    (fixture, before)
}

#[test]
fn established_flows_stay_on_their_backend_while_the_set_changes() {
    if !can_run("established_flows_stay_on_their_backend_while_the_set_changes") {
        return;
    }
    let ports: Vec<u16> = (41000..41200).collect();
    let (mut fixture, before) = flows_then_new_table(&ports);
    let moved_by_table = ports
        .iter()
        .zip(&before)
        .filter(|(p, b)| explained(&fixture, "tcp", **p).0 != **b)
        .count();
    assert!(
        moved_by_table > 20,
        "the new table should move some flows ({moved_by_table})"
    );

    for (port, backend) in ports.iter().zip(&before) {
        let result = run(&mut fixture, &tcp(*port, TCP_ACK));
        assert_eq!(backend_of(&result), *backend, "flow from port {port} moved");
        assert_eq!(counted(&result, "ct_hit"), 1);
        assert_eq!(counted(&result, "ct_miss_non_syn"), 0);
    }
}

/// An ICMP "too big" error follows its flow's connection-table entry, not the table, and
/// leaves the table as it was: it creates no entry and refreshes none.
#[test]
fn icmp_too_big_goes_where_its_flow_goes() {
    if !can_run("icmp_too_big_goes_where_its_flow_goes") {
        return;
    }
    let ports: Vec<u16> = (41000..41100).collect();
    let (mut fixture, before) = flows_then_new_table(&ports);
    let mut moved = 0;
    for (port, backend) in ports.iter().zip(&before) {
        if explained(&fixture, "tcp", *port).0 != *backend {
            moved += 1;
        }
        let error = icmp4(VIP, ICMP_UNREACHABLE, ICMP_FRAG_NEEDED, quoted_tcp(*port));
        let result = run(&mut fixture, &error);
        assert_eq!(
            backend_of(&result),
            *backend,
            "the error about the flow from port {port} went elsewhere: {:?}",
            result.counted
        );
        assert_eq!(counted(&result, "seen_icmp_too_big"), 1);
        assert_eq!(counted(&result, "ct_created"), 0);
        assert_eq!(counted(&result, "ct_hit"), 0);
    }
    assert!(moved > 10, "the new table should move some flows ({moved})");

    // TCP, no entry: the table's choice (the backend's kernel checks the quoted
    // sequence number), and still no entry after it (the next ACK misses).
    let port = 42000;
    let error = icmp4(VIP, ICMP_UNREACHABLE, ICMP_FRAG_NEEDED, quoted_tcp(port));
    let result = run(&mut fixture, &error);
    assert_eq!(backend_of(&result), explained(&fixture, "tcp", port).0);
    assert_eq!(counted(&result, "ct_created"), 0);
    let ack = run(&mut fixture, &tcp(port, TCP_ACK));
    assert_eq!(counted(&ack, "ct_miss_non_syn"), 1, "{:?}", ack.counted);

    // UDP: only with a live entry, whose backend it takes and whose time it leaves.
    let port = 45000;
    let error = icmp4(VIP, ICMP_UNREACHABLE, ICMP_FRAG_NEEDED, quoted_udp(port));
    let unknown = run(&mut fixture, &error);
    assert_passed(
        &unknown,
        "pass_other_proto",
        "an error about a UDP flow without entry",
    );
    let vip: VipTarget = "10.0.0.100:53/udp".parse().unwrap();
    let key = explain::flow_key(&vip, format!("10.0.0.1:{port}").parse().unwrap());
    let table = explained(&fixture, "udp", port).0;
    let other = [41, 42, 43].into_iter().find(|&b| b != table).unwrap();
    let seen = explain::monotonic_ns() - 1_000_000_000;
    let entry = lb_common::FlowEntry {
        backend_id: backend_named(&fixture, "udp", other),
        flags: 0,
        last_seen_ns: seen,
    };
    fixture.dataplane.insert_flow(&key, &entry).unwrap();
    let held = run(&mut fixture, &error);
    assert_eq!(backend_of(&held), other, "{:?}", held.counted);
    assert_eq!(counted(&held, "seen_icmp_too_big"), 1);
    let after = fixture.dataplane.flow(&key).unwrap().expect("the entry");
    assert_eq!(after, entry, "the error changed the flow's entry");
    // Idle for longer than flow_idle_timeout: no flow any more, so passed.
    let idle = fixture.config.dataplane.flow_idle_timeout.as_nanos() as u64;
    let stale = lb_common::FlowEntry {
        last_seen_ns: seen - idle,
        ..entry
    };
    fixture.dataplane.insert_flow(&key, &stale).unwrap();
    let expired = run(&mut fixture, &error);
    assert_passed(
        &expired,
        "pass_other_proto",
        "an error about an idle UDP flow",
    );
}

/// What `lb explain` says of the flow from 10.0.0.1:`port` to the TCP VIP: the last
/// octets of the table's backend and of the backend the next packet goes to.
fn explained(fixture: &Fixture, proto: &str, port: u16) -> (u8, Option<u8>) {
    let vip_port = if proto == "udp" { 53 } else { 80 };
    let request = ExplainRequest {
        vip: format!("10.0.0.100:{vip_port}/{proto}")
            .parse::<VipTarget>()
            .unwrap(),
        source: format!("10.0.0.1:{port}").parse().unwrap(),
        quic_cid: None,
    };
    let e = explain_flow(fixture, &request);
    let last = |a: String| a.rsplit('.').next().unwrap().parse::<u8>().unwrap();
    (
        last(e.table_backend.unwrap()),
        e.next_packet_backend.map(last),
    )
}

fn backend_named(fixture: &Fixture, vip: &str, last_octet: u8) -> u32 {
    let vip = fixture
        .model
        .vips
        .iter()
        .find(|v| v.config.name == vip)
        .unwrap();
    vip.backends
        .iter()
        .find(|b| {
            b.config
                .address
                .to_string()
                .ends_with(&format!(".{last_octet}"))
        })
        .unwrap()
        .id
}

#[test]
fn a_failed_backends_flows_are_rehashed_and_the_others_stay() {
    if !can_run("a_failed_backends_flows_are_rehashed_and_the_others_stay") {
        return;
    }
    let mut fixture = fixture(&sticky_config(&[("10.0.0.41", 1), ("10.0.0.42", 1)], 0));
    let ports: Vec<u16> = (42000..42100).collect();
    let before: Vec<u8> = ports.iter().map(|&p| handshake(&mut fixture, p)).collect();
    assert!(before.contains(&41) && before.contains(&42));
    for b in fixture.model.backends_mut() {
        if b.config.address.to_string() == "10.0.0.41" {
            b.health = lb_userspace::model::Health::Down;
        }
    }
    fixture.sync().expect("sync");
    for (port, backend) in ports.iter().zip(&before) {
        let result = run(&mut fixture, &tcp(*port, TCP_ACK));
        assert_eq!(
            backend_of(&result),
            42,
            "every flow now goes to the live backend"
        );
        let expected_rehash = u64::from(*backend == 41);
        assert_eq!(
            counted(&result, "ct_rehash"),
            expected_rehash,
            "port {port}"
        );
        assert_eq!(explained(&fixture, "tcp", *port).1, Some(42));
    }
}

#[test]
fn rst_never_creates_an_entry_and_a_lone_ack_is_a_non_syn_miss() {
    if !can_run("rst_never_creates_an_entry_and_a_lone_ack_is_a_non_syn_miss") {
        return;
    }
    let mut fixture = fixture(&sticky_config(&[("10.0.0.41", 1), ("10.0.0.42", 1)], 0));
    let vip: VipTarget = "10.0.0.100:80/tcp".parse().unwrap();
    let key = |port: u16| explain::flow_key(&vip, format!("10.0.0.1:{port}").parse().unwrap());

    let result = run(&mut fixture, &tcp(43000, TCP_RST));
    assert_eq!(result.action, XDP_TX, "a RST is still forwarded");
    assert_eq!(counted(&result, "ct_created"), 0);
    assert_eq!(fixture.dataplane.flow(&key(43000)).unwrap(), None);

    // A lone ACK (a flow the table lost, or a spoofed one) makes no entry: remembered,
    // and its flow's next packet enters it.
    let result = run(&mut fixture, &tcp(43001, TCP_ACK));
    assert_eq!(counted(&result, "ct_miss_non_syn"), 1);
    assert_eq!(counted(&result, "ct_created"), 0);
    assert_eq!(counted(&result, "ct_embryonic"), 1);
    assert_eq!(fixture.dataplane.flow(&key(43001)).unwrap(), None);
    let lone = backend_of(&result);
    let result = run(&mut fixture, &tcp(43001, TCP_ACK));
    assert_eq!(counted(&result, "ct_promoted"), 1);
    assert_eq!(counted(&result, "ct_created"), 1);
    assert_eq!(backend_of(&result), lone);
    let entry = fixture
        .dataplane
        .flow(&key(43001))
        .unwrap()
        .expect("entry created");
    assert_eq!(
        entry.backend_id,
        backend_named(&fixture, "tcp", backend_of(&result))
    );
    let result = run(&mut fixture, &tcp(43001, TCP_ACK));
    assert_eq!(counted(&result, "ct_hit"), 1);

    // The client's FIN marks the entry closing (no longer an active flow); it stays.
    let closing = |f: &Fixture| {
        f.dataplane
            .flow(&key(43001))
            .unwrap()
            .expect("entry kept")
            .flags
            & lb_common::FLOW_F_CLOSING
    };
    assert_eq!(closing(&fixture), 0);
    run(&mut fixture, &tcp(43001, TCP_ACK | 0x01));
    assert_eq!(closing(&fixture), lb_common::FLOW_F_CLOSING);
    let result = run(&mut fixture, &tcp(43001, TCP_ACK));
    assert_eq!(
        counted(&result, "ct_hit"),
        1,
        "late packets still follow the entry"
    );
    // A separate reader (the agent scans with one, off its lock) sees the same table.
    let flows = fixture.dataplane.flow_reader().unwrap().flows().unwrap();
    assert!(
        flows
            .iter()
            .any(|(k, e)| *k == key(43001) && e.flags & lb_common::FLOW_F_CLOSING != 0)
    );
}

#[test]
fn udp_entries_hold_until_idle_then_expire() {
    if !can_run("udp_entries_hold_until_idle_then_expire") {
        return;
    }
    let mut fixture = fixture(&sticky_config(&[("10.0.0.41", 1), ("10.0.0.42", 1)], 0));
    let vip: VipTarget = "10.0.0.100:53/udp".parse().unwrap();
    let port = 44000;
    let key = explain::flow_key(&vip, format!("10.0.0.1:{port}").parse().unwrap());
    let frame = ipv4(VIP, L4::Udp { src: port, dst: 53 });
    let first = run(&mut fixture, &frame);
    assert_eq!(counted(&first, "ct_miss_udp"), 1);
    let table_choice = backend_of(&first);
    let other = if table_choice == 41 { 42 } else { 41 };

    // An entry for the other backend, seen just now: the flow follows it.
    let now = explain::monotonic_ns();
    let entry = lb_common::FlowEntry {
        backend_id: backend_named(&fixture, "udp", other),
        flags: 0,
        last_seen_ns: now,
    };
    fixture.dataplane.insert_flow(&key, &entry).unwrap();
    let result = run(&mut fixture, &frame);
    assert_eq!(
        (backend_of(&result), counted(&result, "ct_hit")),
        (other, 1)
    );
    assert_eq!(explained(&fixture, "udp", port).1, Some(other));

    // The same entry idle for longer than flow_idle_timeout (30 s): balanced afresh.
    let idle = fixture.config.dataplane.flow_idle_timeout.as_nanos() as u64;
    let stale = lb_common::FlowEntry {
        last_seen_ns: now - idle - 1_000_000_000,
        ..entry
    };
    fixture.dataplane.insert_flow(&key, &stale).unwrap();
    assert_eq!(explained(&fixture, "udp", port).1, Some(table_choice));
    let result = run(&mut fixture, &frame);
    assert_eq!(
        (backend_of(&result), counted(&result, "ct_miss_udp")),
        (table_choice, 1)
    );
}

/// The agent's scan of the connection table (batched reads, several batches here)
/// returns every entry exactly, as the key-by-key read does.
#[test]
fn the_connection_table_scan_reads_every_entry() {
    if !can_run("the_connection_table_scan_reads_every_entry") {
        return;
    }
    // Inserted from one CPU, which the per-CPU LRU lists give a 1/CPUs share of the
    // table: room for all 20000 on this CPU alone.
    let cpus = aya::util::nr_cpus().expect("possible CPUs") as u32;
    let entries = (20_000 * cpus).next_power_of_two().max(65536);
    let config = sticky_config(&[("10.0.0.41", 1)], 0).replace(
        "conntrack_entries = 4096",
        &format!("conntrack_entries = {entries}"),
    );
    let mut fixture = fixture(&config);
    let vip: VipTarget = "10.0.0.100:80/tcp".parse().unwrap();
    let mut inserted = std::collections::HashMap::new();
    for i in 0..20_000u32 {
        let client =
            std::net::SocketAddr::from(([10, 1, (i >> 8) as u8, i as u8], 1024 + i as u16));
        let key = explain::flow_key(&vip, client);
        let entry = lb_common::FlowEntry {
            backend_id: i % 7,
            flags: i % 2,
            last_seen_ns: u64::from(i) * 1000,
        };
        fixture.dataplane.insert_flow(&key, &entry).unwrap();
        inserted.insert(key, entry);
    }
    let reader = fixture.dataplane.flow_reader().unwrap();
    // Batched reads work on this kernel (`flows` would fall back without them).
    let scanned = reader.flows_batched().unwrap();
    assert_eq!(scanned.len(), inserted.len(), "entries read");
    let as_map: std::collections::HashMap<_, _> = scanned.into_iter().collect();
    assert_eq!(as_map, inserted);
    for read in [reader.flows(), reader.flows_by_key()] {
        let read: std::collections::HashMap<_, _> = read.unwrap().into_iter().collect();
        assert_eq!(read, inserted);
    }
}

#[test]
fn the_flood_guard_caps_inserts_per_cpu_and_flows_still_balance() {
    if !can_run("the_flood_guard_caps_inserts_per_cpu_and_flows_still_balance") {
        return;
    }
    // One CPU, so all inserts fall in one per-CPU window.
    let mut cpus = nix::sched::CpuSet::new();
    cpus.set(0).unwrap();
    nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &cpus).unwrap();
    let mut fixture = fixture(&sticky_config(&[("10.0.0.41", 1), ("10.0.0.42", 1)], 3));
    // An old connection's entry (a backend gone since) on the last tuple: the new
    // connection's packets go where its SYN went, room for an insert or not.
    let vip: VipTarget = "10.0.0.100:80/tcp".parse().unwrap();
    let reused = explain::flow_key(&vip, "10.0.0.1:45004".parse().unwrap());
    let old_entry = lb_common::FlowEntry {
        backend_id: lb_common::BACKEND_NONE - 1,
        flags: 0,
        last_seen_ns: 1,
    };
    fixture.dataplane.insert_flow(&reused, &old_entry).unwrap();
    let ports = 45000..45005;
    let mut syn_went = Vec::new();
    for port in ports.clone() {
        let result = run(&mut fixture, &tcp(port, TCP_SYN));
        assert_eq!(counted(&result, "ct_created"), 0, "a SYN makes no entry");
        syn_went.push(backend_of(&result));
    }
    let mut created = 0;
    let mut skipped = 0;
    for (port, syn_went) in ports.zip(syn_went) {
        let result = run(&mut fixture, &tcp(port, TCP_ACK));
        assert_eq!(backend_of(&result), syn_went, "port {port}");
        let entered = counted(&result, "ct_promoted") + counted(&result, "ct_rehash");
        assert_eq!(entered, 1, "{:?}", result.counted);
        created += counted(&result, "ct_created");
        skipped += counted(&result, "ct_insert_skipped");
    }
    // Five handshakes well within one second: three entries, two balanced without one.
    assert_eq!((created, skipped), (3, 2));
}

/// A new connection on a tuple an earlier connection used (after its FIN, or idle for
/// a while) goes where its SYN went, though the earlier entry names another backend:
/// the SYN reads no entry, and the entry gives way at the connection's next packet.
#[test]
fn a_new_connection_on_a_reused_tuple_goes_where_its_syn_went() {
    if !can_run("a_new_connection_on_a_reused_tuple_goes_where_its_syn_went") {
        return;
    }
    let ports: Vec<u16> = (50000..50100).collect();
    let (mut fixture, before) = flows_then_new_table(&ports);
    let vip: VipTarget = "10.0.0.100:80/tcp".parse().unwrap();
    let mut reused = 0;
    for (i, (port, old)) in ports.iter().zip(&before).enumerate() {
        let key = explain::flow_key(&vip, format!("10.0.0.1:{port}").parse().unwrap());
        if i % 2 == 0 {
            // The earlier connection ended with the client's FIN.
            run(&mut fixture, &tcp(*port, TCP_ACK | 0x01));
        } else {
            // It went quiet two seconds ago.
            let mut entry = fixture.dataplane.flow(&key).unwrap().expect("entry");
            entry.last_seen_ns = explain::monotonic_ns() - 2_000_000_000;
            fixture.dataplane.insert_flow(&key, &entry).unwrap();
        }
        let table = explained(&fixture, "tcp", *port).0;
        let syn = run(&mut fixture, &tcp(*port, TCP_SYN));
        assert_eq!(backend_of(&syn), table, "the SYN takes the table");
        assert_eq!(explained(&fixture, "tcp", *port).1, Some(table));
        let ack = run(&mut fixture, &tcp(*port, TCP_ACK));
        assert_eq!(backend_of(&ack), table, "port {port}: {:?}", ack.counted);
        if table != *old {
            reused += 1;
            assert_eq!(counted(&ack, "ct_reused"), 1, "{:?}", ack.counted);
        }
        let entry = fixture.dataplane.flow(&key).unwrap().expect("entry");
        assert_eq!(entry.backend_id, backend_named(&fixture, "tcp", table));
        assert_eq!(entry.flags, 0, "the new connection is not closing");
        let next = run(&mut fixture, &tcp(*port, TCP_ACK));
        assert_eq!((backend_of(&next), counted(&next, "ct_hit")), (table, 1));
    }
    assert!(
        reused > 10,
        "the new table should move some flows ({reused})"
    );
}

/// A table change between a flow's first and second packet does not split it: the ACK
/// (or a UDP flow's second datagram) goes where the SYN went, and enters the flow there;
/// a RST after the SYN goes there too, and makes no entry.
#[test]
fn a_table_change_between_the_first_and_second_packet_splits_no_flow() {
    if !can_run("a_table_change_between_the_first_and_second_packet_splits_no_flow") {
        return;
    }
    let two = sticky_config(&[("10.0.0.41", 1), ("10.0.0.42", 1)], 0);
    let mut fixture = fixture(&two);
    let ports: Vec<u16> = (49000..49100).collect();
    let udp = |port: u16| ipv4(VIP, L4::Udp { src: port, dst: 53 });
    let syn_went: Vec<u8> = ports
        .iter()
        .map(|&p| backend_of(&run(&mut fixture, &tcp(p, TCP_SYN))))
        .collect();
    let udp_went: Vec<u8> = ports
        .iter()
        .map(|&p| backend_of(&run(&mut fixture, &udp(p))))
        .collect();
    fixture
        .reconfigure(&sticky_config(
            &[("10.0.0.41", 5), ("10.0.0.42", 1), ("10.0.0.43", 3)],
            0,
        ))
        .expect("reconfigure");
    let moved = ports
        .iter()
        .zip(&syn_went)
        .filter(|(p, b)| explained(&fixture, "tcp", **p).0 != **b)
        .count();
    assert!(moved > 10, "the new table should move some flows ({moved})");
    let vip: VipTarget = "10.0.0.100:80/tcp".parse().unwrap();
    for (i, port) in ports.iter().enumerate() {
        let second = if i % 10 == 0 { TCP_RST } else { TCP_ACK };
        let result = run(&mut fixture, &tcp(*port, second));
        assert_eq!(backend_of(&result), syn_went[i], "port {port}");
        let key = explain::flow_key(&vip, format!("10.0.0.1:{port}").parse().unwrap());
        let entry = fixture.dataplane.flow(&key).unwrap();
        assert_eq!(entry.is_some(), second == TCP_ACK, "port {port}: {entry:?}");

        let result = run(&mut fixture, &udp(*port));
        assert_eq!(backend_of(&result), udp_went[i], "udp port {port}");
        assert_eq!(counted(&result, "ct_promoted"), 1);
        let result = run(&mut fixture, &udp(*port));
        assert_eq!(
            (backend_of(&result), counted(&result, "ct_hit")),
            (udp_went[i], 1)
        );
    }
}

/// A flood of spoofed first packets (SYNs, ACKs and UDP datagrams from random tuples,
/// five times the connection table's size) makes no entry, so every established flow
/// keeps its entry, and its backend through a table change after the flood.
#[test]
fn a_flood_of_first_packets_costs_no_established_flow_its_entry() {
    if !can_run("a_flood_of_first_packets_costs_no_established_flow_its_entry") {
        return;
    }
    let ports: Vec<u16> = (48000..48200).collect();
    let mut fixture = fixture(&sticky_config(&[("10.0.0.41", 1), ("10.0.0.42", 1)], 0));
    let before: Vec<u8> = ports.iter().map(|&p| handshake(&mut fixture, p)).collect();
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let (mut created, mut remembered) = (0, 0);
    for i in 0..20_480u32 {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let l4 = match i % 3 {
            0 => L4::Tcp {
                src: state as u16 | 1024,
                dst: 80,
                flags: TCP_SYN,
            },
            1 => L4::Tcp {
                src: state as u16 | 1024,
                dst: 80,
                flags: TCP_ACK,
            },
            _ => L4::Udp {
                src: state as u16 | 1024,
                dst: 53,
            },
        };
        let mut frame = ipv4(VIP, l4);
        frame[14 + 12..14 + 16].copy_from_slice(&[
            10,
            (state >> 16) as u8,
            (state >> 24) as u8,
            (state >> 32) as u8,
        ]);
        let result = run(&mut fixture, &frame);
        assert_eq!(result.action, XDP_TX);
        created += counted(&result, "ct_created");
        remembered += counted(&result, "ct_embryonic");
    }
    assert_eq!(created, 0, "a spoofed first packet made an entry");
    assert_eq!(remembered, 20_480);
    fixture
        .reconfigure(&sticky_config(
            &[("10.0.0.41", 5), ("10.0.0.42", 1), ("10.0.0.43", 3)],
            0,
        ))
        .expect("reconfigure");
    for (port, backend) in ports.iter().zip(&before) {
        let result = run(&mut fixture, &tcp(*port, TCP_ACK));
        assert_eq!(backend_of(&result), *backend, "flow from port {port} moved");
        assert_eq!(counted(&result, "ct_hit"), 1, "port {port}");
    }
}

#[test]
fn a_removed_vips_flows_pass_and_an_added_vip_balances() {
    if !can_run("a_removed_vips_flows_pass_and_an_added_vip_balances") {
        return;
    }
    // Established flows skip the VIP lookup (their entry's backend names the VIP), so
    // removing a VIP must still stop its flows at once; its slot must follow adds.
    let both = sticky_config(&[("10.0.0.41", 1), ("10.0.0.42", 1)], 0);
    let mut fixture = fixture(&both);
    handshake(&mut fixture, 46000);
    assert_eq!(
        counted(&run(&mut fixture, &tcp(46000, TCP_ACK)), "ct_hit"),
        1
    );

    let udp_only: String = both
        .split("[[vip]]")
        .filter(|block| !block.contains("name = \"tcp\""))
        .collect::<Vec<_>>()
        .join("[[vip]]");
    assert!(!udp_only.contains("port = 80") && udp_only.contains("port = 53"));
    fixture.reconfigure(&udp_only).expect("reconfigure");
    for flags in [TCP_ACK, TCP_SYN] {
        let result = run(&mut fixture, &tcp(46000, flags));
        assert_eq!(result.action, XDP_PASS, "flags {flags:#x}");
        assert_eq!(counted(&result, "pass_not_vip"), 1);
        assert_eq!(counted(&result, "ct_hit"), 0);
    }

    fixture.reconfigure(&both).expect("reconfigure");
    let result = run(&mut fixture, &tcp(46001, TCP_SYN));
    assert_eq!(
        result.action, XDP_TX,
        "the VIP balances again once added back"
    );
    assert_eq!(counted(&result, "ct_miss_syn"), 1);
}

#[test]
fn vips_sharing_a_slot_both_balance_and_part_cleanly() {
    if !can_run("vips_sharing_a_slot_both_balance_and_part_cleanly") {
        return;
    }
    // Two VIP keys (same address, two ports) that hash to one slot of LB_VIP_SLOTS: the
    // slot is shared and the program asks LB_VIPS; once one VIP goes, the slot is the
    // other's alone.
    let key = |port: u16| {
        lb_userspace::model::vip_key([10, 0, 0, 100].into(), port, lb_common::PROTO_TCP)
    };
    let slot = lb_common::VipSlot::index(&key(80));
    let other = (81..u16::MAX)
        .find(|&p| lb_common::VipSlot::index(&key(p)) == slot)
        .expect("a port whose key shares port 80's slot");
    let config = |ports: &[(u16, &str)]| {
        let mut text = String::from(
            "[dataplane]\ninterface = \"lo\"\nmaglev_table_size = 251\nconntrack_entries = 4096\n",
        );
        for (port, backend) in ports {
            let last: u8 = backend.rsplit('.').next().unwrap().parse().unwrap();
            text += &format!(
                "[[vip]]\nname = \"p{port}\"\naddress = \"10.0.0.100\"\nport = {port}\n\
                 protocol = \"tcp\"\n[vip.health]\nkind = \"none\"\n\
                 [[vip.backend]]\naddress = \"{backend}\"\nmac = \"02:00:00:00:00:{last:02x}\"\n"
            );
        }
        text
    };
    let syn = |port: u16| {
        ipv4(
            VIP,
            L4::Tcp {
                src: 47000,
                dst: port,
                flags: TCP_SYN,
            },
        )
    };
    let mut fixture = fixture(&config(&[(80, "10.0.0.41"), (other, "10.0.0.42")]));
    assert_eq!(backend_of(&run(&mut fixture, &syn(80))), 41);
    let ack80 = ipv4(
        VIP,
        L4::Tcp {
            src: 47000,
            dst: 80,
            flags: TCP_ACK,
        },
    );
    assert_eq!(counted(&run(&mut fixture, &ack80), "ct_promoted"), 1);
    assert_eq!(backend_of(&run(&mut fixture, &syn(other))), 42);
    let stranger = (other + 1..u16::MAX)
        .find(|&p| lb_common::VipSlot::index(&key(p)) == slot)
        .expect("a third port on the slot");
    let result = run(&mut fixture, &syn(stranger));
    assert_passed(&result, "pass_not_vip", "a non-VIP key on a shared slot");

    // A third VIP on the slot, and an established flow of the port-80 VIP.
    fixture
        .reconfigure(&config(&[
            (80, "10.0.0.41"),
            (other, "10.0.0.42"),
            (stranger, "10.0.0.43"),
        ]))
        .expect("reconfigure");
    assert_eq!(counted(&run(&mut fixture, &ack80), "ct_hit"), 1);
    // The port-80 VIP goes; the slot stays shared by the other two: its established
    // flow is passed, not forwarded by its old entry.
    fixture
        .reconfigure(&config(&[(other, "10.0.0.42"), (stranger, "10.0.0.43")]))
        .expect("reconfigure");
    for frame in [&ack80, &syn(80)] {
        let result = run(&mut fixture, frame);
        assert_passed(&result, "pass_not_vip", "the removed VIP's packet");
    }
    assert_eq!(backend_of(&run(&mut fixture, &syn(stranger))), 43);

    fixture
        .reconfigure(&config(&[(other, "10.0.0.42")]))
        .expect("reconfigure");
    let result = run(&mut fixture, &syn(80));
    assert_passed(&result, "pass_not_vip", "a SYN to the removed VIP");
    assert_eq!(backend_of(&run(&mut fixture, &syn(other))), 42);
    // A table switch on the slot's one VIP (another backend): packets follow it.
    fixture
        .reconfigure(&config(&[(other, "10.0.0.43")]))
        .expect("reconfigure");
    assert_eq!(backend_of(&run(&mut fixture, &syn(other))), 43);
}

#[test]
fn new_flows_are_counted_per_client_source() {
    if !can_run("new_flows_are_counted_per_client_source") {
        return;
    }
    let mut fixture = fixture(&sticky_config(&[("10.0.0.41", 1), ("10.0.0.42", 1)], 0));
    // Three TCP connections and an established packet from 10.0.0.1; two UDP flows from
    // 10.0.0.7 (a UDP packet without an entry is a new flow); a SYN from 10.0.0.9 that
    // no ACK follows (spoofed, say): a TCP flow counts once its handshake completes.
    for port in [46000, 46001, 46002] {
        handshake(&mut fixture, port);
    }
    run(&mut fixture, &tcp(46000, TCP_ACK));
    let mut spoofed = tcp(46003, TCP_SYN);
    spoofed[14 + 12..14 + 16].copy_from_slice(&[10, 0, 0, 9]);
    run(&mut fixture, &spoofed);
    for port in [5000, 5001] {
        let mut frame = ipv4(VIP, L4::Udp { src: port, dst: 53 });
        frame[14 + 12..14 + 16].copy_from_slice(&[10, 0, 0, 7]);
        let result = run(&mut fixture, &frame);
        assert_eq!(counted(&result, "ct_miss_udp"), 1);
    }
    let mut sources: Vec<(IpAddr, String, u64)> = fixture
        .dataplane
        .sources()
        .unwrap()
        .into_iter()
        .map(|(key, count)| {
            let vip = fixture
                .model
                .vips
                .iter()
                .find(|v| v.id == key.vip_id)
                .unwrap();
            (
                lb_common::addr::from_map(&key.addr, key.family),
                vip.config.name.clone(),
                count,
            )
        })
        .collect();
    sources.sort();
    assert_eq!(
        sources,
        [
            (IpAddr::from([10, 0, 0, 1]), "tcp".to_string(), 3),
            (IpAddr::from([10, 0, 0, 7]), "udp".to_string(), 2)
        ]
    );
}

#[test]
fn the_debug_capture_writes_non_syn_misses_as_pcap_at_a_bounded_rate() {
    let test = "the_debug_capture_writes_non_syn_misses_as_pcap_at_a_bounded_rate";
    if !can_run(test) || !lb_tests::host::require_tool(test, lb_tests::host::TCPDUMP) {
        return;
    }
    // One CPU, so the per-CPU rate limit sees every packet.
    let mut cpus = nix::sched::CpuSet::new();
    cpus.set(0).unwrap();
    nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &cpus).unwrap();
    let config = sticky_config(&[("10.0.0.41", 1), ("10.0.0.42", 1)], 0);
    let mut fixture = fixture_with(&config, |options| {
        options.source_sample = 1;
        options.capture_rate = 3;
    });
    run(&mut fixture, &tcp(47000, TCP_SYN)); // a SYN is not captured
    let mut captured = 0;
    for port in 47001..47006 {
        let result = run(&mut fixture, &tcp(port, TCP_ACK));
        assert_eq!(counted(&result, "ct_miss_non_syn"), 1);
        captured += counted(&result, "captured");
    }
    assert_eq!(captured, 3, "five misses within a second, three captured");

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("misses.pcap");
    let mut ring = fixture.dataplane.take_capture().unwrap();
    let mut sink = lb_userspace::capture::PcapSink::create(&path).unwrap();
    assert_eq!(
        lb_userspace::capture::drain(&mut ring, &mut sink).unwrap(),
        3
    );
    drop(sink);
    let out = std::process::Command::new("tcpdump")
        .args(["-nn", "-r"])
        .arg(&path)
        .output()
        .expect("run tcpdump");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "tcpdump: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 3, "{text}");
    for (line, port) in lines.iter().zip(47001..) {
        assert!(
            line.contains(&format!("10.0.0.1.{port} > 10.0.0.100.80")),
            "{line}"
        );
    }
}

#[test]
fn with_cluster_each_new_entry_is_exported_once_and_learned_entries_become_local() {
    if !can_run("with_cluster_each_new_entry_is_exported_once_and_learned_entries_become_local") {
        return;
    }
    let text = sticky_config(&[("10.0.0.41", 1), ("10.0.0.42", 1)], 0)
        + "[cluster]\npeers = [\"10.0.0.12\"]\nkey_file = \"/etc/lb/cluster.key\"\n";
    let mut fixture = fixture(&text);
    let (mut ring, _writer) = fixture.dataplane.take_export().expect("export ring");
    let vip: VipTarget = "10.0.0.100:80/tcp".parse().unwrap();
    let key = |port: u16| explain::flow_key(&vip, format!("10.0.0.1:{port}").parse().unwrap());
    let records = |ring: &mut aya::maps::RingBuf<aya::maps::MapData>| {
        let mut out = Vec::new();
        while let Some(item) = ring.next() {
            out.push(*bytemuck::from_bytes::<lb_common::ExportRecord>(&item));
        }
        out
    };

    // A new flow's entry goes to the ring, with this node's backend id, when its
    // handshake's ACK makes it (a SYN makes none).
    let syn = run(&mut fixture, &tcp(44000, TCP_SYN));
    assert_eq!(counted(&syn, "cluster_exported"), 0);
    let result = run(&mut fixture, &tcp(44000, TCP_ACK));
    assert_eq!(counted(&result, "cluster_exported"), 1);
    let exported = records(&mut ring);
    assert_eq!(exported.len(), 1);
    assert_eq!(exported[0].key, key(44000));
    assert_eq!(
        exported[0].backend_id,
        backend_named(&fixture, "tcp", backend_of(&result))
    );
    // Its next packets, and a SYN on the same tuple, make none.
    run(&mut fixture, &tcp(44000, TCP_ACK));
    let result = run(&mut fixture, &tcp(44000, TCP_SYN));
    assert_eq!(counted(&result, "cluster_exported"), 0);
    assert!(records(&mut ring).is_empty());
    // A flow this node never saw, whose second ACK enters it: exported too.
    let result = run(&mut fixture, &tcp(44001, TCP_ACK));
    assert_eq!(counted(&result, "cluster_exported"), 0);
    let result = run(&mut fixture, &tcp(44001, TCP_ACK));
    assert_eq!(counted(&result, "cluster_exported"), 1);
    assert_eq!(records(&mut ring).len(), 1);

    // An entry learned from a peer (old enough to be refreshed, on the other backend):
    // followed, made this node's own by its first packet, and not exported.
    let other = if backend_of(&run(&mut fixture, &tcp(44002, TCP_SYN))) == 41 {
        42
    } else {
        41
    };
    records(&mut ring);
    let learned = lb_common::FlowEntry {
        backend_id: backend_named(&fixture, "tcp", other),
        flags: lb_common::FLOW_F_LEARNED,
        last_seen_ns: 0,
    };
    fixture
        .dataplane
        .insert_flow(&key(44003), &learned)
        .unwrap();
    let result = run(&mut fixture, &tcp(44003, TCP_ACK));
    assert_eq!(backend_of(&result), other, "the learned backend");
    assert_eq!(counted(&result, "ct_hit"), 1);
    assert_eq!(counted(&result, "cluster_exported"), 0);
    assert!(records(&mut ring).is_empty());
    let entry = fixture.dataplane.flow(&key(44003)).unwrap().unwrap();
    assert_eq!(entry.flags & lb_common::FLOW_F_LEARNED, 0);

    // Without [cluster] nothing is exported.
    let mut plain = fixture_with(&sticky_config(&[("10.0.0.41", 1)], 0), |_| {});
    run(&mut plain, &tcp(44000, TCP_SYN));
    let result = run(&mut plain, &tcp(44000, TCP_ACK));
    assert_eq!(counted(&result, "ct_created"), 1);
    assert_eq!(counted(&result, "cluster_exported"), 0);
}

// ---- hot sources --------------------------------------------------------------------

/// `sticky_config`'s TCP VIP as a src-ip VIP with `hot_source_share`, three backends
/// (.51, .52, .53).
fn hot_config() -> String {
    let backends = [("10.0.0.51", 1), ("10.0.0.52", 1), ("10.0.0.53", 1)];
    sticky_config(&backends, 0).replacen(
        "protocol = \"tcp\"\n",
        "protocol = \"tcp\"\nhash = \"src-ip\"\nhot_source_share = 0.2\n",
        1,
    )
}

/// A TCP packet from `src`:`port` to the VIP's port 80.
fn tcp_from(src: [u8; 4], port: u16, flags: u8) -> Vec<u8> {
    let mut frame = tcp(port, flags);
    frame[14 + 12..14 + 16].copy_from_slice(&src);
    frame
}

/// A source in `LB_HOT_SRC` has its new flows hashed per connection (over every
/// backend, counted as `hot_source_spread`) while a cold source's stay on one backend;
/// the hot source's connection made before it turned hot keeps its backend; `lb
/// explain` says the same as the kernel for both.
#[test]
fn a_hot_sources_new_flows_are_hashed_per_connection_and_a_cold_ones_by_source() {
    let test = "a_hot_sources_new_flows_are_hashed_per_connection_and_a_cold_ones_by_source";
    if !can_run(test) {
        return;
    }
    let mut fixture = fixture(&hot_config());
    let (hot, cold) = ([10, 0, 0, 1], [10, 0, 0, 7]);
    let vip: VipTarget = "10.0.0.100:80/tcp".parse().unwrap();
    // Before it is hot, one of its connections: on its source's backend.
    let early = backend_of(&run(&mut fixture, &tcp_from(hot, 41000, TCP_SYN)));
    let vip_id = fixture.model.vips[0].id;
    assert_eq!(fixture.model.vips[0].config.hot_source_share, Some(0.2));
    let (addr, family) = lb_common::addr::to_map(IpAddr::from(hot));
    let key = lb_common::SourceKey::new(vip_id, addr, family);
    fixture
        .dataplane
        .set_hot_source(&key, true)
        .expect("write LB_HOT_SRC");
    assert_eq!(fixture.dataplane.hot_sources().unwrap(), [key]);

    let mut spread = std::collections::BTreeMap::<u8, u32>::new();
    let mut sticky = std::collections::BTreeSet::new();
    for port in 42000..42060u16 {
        let result = run(&mut fixture, &tcp_from(hot, port, TCP_SYN));
        assert_eq!(
            counted(&result, "hot_source_spread"),
            1,
            "{:?}",
            result.counted
        );
        let backend = backend_of(&result);
        *spread.entry(backend).or_default() += 1;
        let source = std::net::SocketAddr::from((hot, port));
        let e = explain_flow(&fixture, &ExplainRequest::flow(vip, source));
        assert!(e.hot_source, "{source}: explain knows it is hot");
        let predicted: std::net::IpAddr = e.table_backend.unwrap().parse().unwrap();
        assert_eq!(
            predicted,
            IpAddr::from([10, 0, 0, backend - 0x33 + 51]),
            "{source}: kernel and explain disagree"
        );

        let result = run(&mut fixture, &tcp_from(cold, port, TCP_SYN));
        assert_eq!(counted(&result, "hot_source_spread"), 0);
        sticky.insert(backend_of(&result));
        let source = std::net::SocketAddr::from((cold, port));
        assert!(!explain_flow(&fixture, &ExplainRequest::flow(vip, source)).hot_source);
    }
    eprintln!("hot source's 60 new flows by backend MAC: {spread:?}; cold source's: {sticky:?}");
    assert_eq!(
        spread.len(),
        3,
        "the hot source reaches every backend: {spread:?}"
    );
    assert!(spread.values().all(|&n| n >= 10), "{spread:?}");
    assert_eq!(
        sticky.len(),
        1,
        "the cold source stays on one backend: {sticky:?}"
    );
    // The connection from before stays where it was (its entry), hot or not.
    for _ in 0..3 {
        let result = run(&mut fixture, &tcp_from(hot, 41000, TCP_ACK));
        assert_eq!(backend_of(&result), early);
        assert_eq!(counted(&result, "hot_source_spread"), 0);
    }
    // Cold again: by source.
    fixture.dataplane.set_hot_source(&key, false).unwrap();
    let again: std::collections::BTreeSet<u8> = (43000..43020u16)
        .map(|port| backend_of(&run(&mut fixture, &tcp_from(hot, port, TCP_SYN))))
        .collect();
    assert_eq!(again.len(), 1, "{again:?}");
}
