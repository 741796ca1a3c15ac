//! Tier 2, differential: random frames and map states through the real XDP program
//! (BPF_PROG_TEST_RUN) and through `lb_common::decide` (the decision the program runs,
//! over `lb explain`'s tables), compared frame by frame: the verdict, the backend (the
//! output frame's destination MAC, and a tunnel's outer destination), every outcome
//! counter, the VIP's and backend's traffic and handshake counters, and what the frame
//! left in the connection and embryonic tables.
//!
//! The program's maps are written by the agent's own code (config -> `Model` ->
//! `TableWriter` -> `AyaDataplane`) and changed as the run goes: backends fail and come
//! back, drain and go to maint, sources turn hot and cold, connection-table entries of
//! every age, flag and backend (gone ones, another VIP's) are written as a cluster peer
//! would, and the frames themselves (SYNs, ACKs, FINs, RSTs, UDP datagrams, ICMP "too
//! big" errors, IPv4 and IPv6, VLAN-tagged, with IPv4 options, for VIPs and not) make
//! the rest. Before each frame the model reads the frame's entry and embryonic slot
//! back from the program's maps, so a difference never carries over to later frames.
//!
//! `LB_DIFFERENTIAL_FRAMES` (default 100,000; 25,000 when `CI` is set) and
//! `LB_DIFFERENTIAL_SEED` (default 34) choose the run; the test prints both.

use std::collections::HashSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::Instant;

use aya::programs::{TestRun, TestRunOptions};
use lb_common::{
    BackendInfo, FLOW_F_CLOSING, FLOW_F_LEARNED, FORWARD_GUE, FORWARD_IPIP, FORWARD_L2, FlowEntry,
    PROTO_TCP, PROTO_UDP, SourceKey, TunnelConfig,
    decide::{Choice, Packet, Verdict, memory::MemoryTables},
    flow, handshake, stat,
};
use lb_tests::program::{IFACE_MAC, Instance};
use lb_userspace::{
    EBPF_OBJECT,
    config::AdminState,
    dataplane::{Counters, Dataplane},
    explain,
    model::Health,
    tables::Desired,
};

const CONFIG: &str = r#"
[dataplane]
interface = "lo"
maglev_table_size = 251
conntrack_entries = 65536
conntrack_insert_limit = 0
tunnel_source = "10.0.0.2"

[[vip]]
name = "t4"
address = "10.0.0.100"
port = 80
protocol = "tcp"
[vip.health]
kind = "none"
# Retry detection (a SYN's slot read) on this VIP only: t6 runs without it.
[vip.outlier]
[[vip.backend]]
address = "10.0.0.11"
mac = "02:00:00:00:01:0b"
[[vip.backend]]
address = "10.0.0.12"
mac = "02:00:00:00:01:0c"
[[vip.backend]]
address = "10.0.0.13"
mac = "02:00:00:00:01:0d"
weight = 2
[[vip.backend]]
address = "10.0.0.14"
mac = "02:00:00:00:01:0e"

[[vip]]
name = "u4"
address = "10.0.0.100"
port = 53
protocol = "udp"
[vip.health]
kind = "none"
[[vip.backend]]
address = "10.0.0.21"
mac = "02:00:00:00:02:15"
[[vip.backend]]
address = "10.0.0.22"
mac = "02:00:00:00:02:16"
[[vip.backend]]
address = "10.0.0.23"
mac = "02:00:00:00:02:17"

[[vip]]
name = "t6"
address = "fd00::100"
port = 80
protocol = "tcp"
[vip.health]
kind = "none"
[[vip.backend]]
address = "fd00::31"
mac = "02:00:00:00:03:1f"
[[vip.backend]]
address = "fd00::32"
mac = "02:00:00:00:03:20"
[[vip.backend]]
address = "fd00::33"
mac = "02:00:00:00:03:21"

[[vip]]
name = "u6"
address = "fd00::100"
port = 53
protocol = "udp"
[vip.health]
kind = "none"
[[vip.backend]]
address = "fd00::41"
mac = "02:00:00:00:04:29"
[[vip.backend]]
address = "fd00::42"
mac = "02:00:00:00:04:2a"

[[vip]]
name = "src"
address = "10.0.0.101"
port = 443
protocol = "tcp"
hash = "src-ip"
hot_source_share = 0.2
[vip.health]
kind = "none"
[[vip.backend]]
address = "10.0.0.51"
mac = "02:00:00:00:05:33"
[[vip.backend]]
address = "10.0.0.52"
mac = "02:00:00:00:05:34"
[[vip.backend]]
address = "10.0.0.53"
mac = "02:00:00:00:05:35"

[[vip]]
name = "tun"
address = "10.0.0.102"
port = 80
protocol = "tcp"
[vip.health]
kind = "none"
[[vip.backend]]
address = "10.1.0.61"
mac = "02:00:00:00:06:3d"
[[vip.backend]]
address = "10.1.0.62"
mac = "02:00:00:00:06:3e"

[[vip]]
name = "q4"
address = "10.0.0.103"
port = 443
protocol = "udp"
quic = true
[vip.health]
kind = "none"
[[vip.backend]]
address = "10.0.0.71"
mac = "02:00:00:00:07:47"
server_id = 1
[[vip.backend]]
address = "10.0.0.72"
mac = "02:00:00:00:07:48"
server_id = 2
[[vip.backend]]
address = "10.0.0.73"
mac = "02:00:00:00:07:49"
server_id = 3

# Stable slots: TCP in a stable slot takes no entry; the run moves slots (health, admin
# state) and turns them stable again (`change`).
[[vip]]
name = "stable"
address = "10.0.0.104"
port = 80
protocol = "tcp"
stable_slots = true
[vip.health]
kind = "none"
[[vip.backend]]
address = "10.0.0.81"
mac = "02:00:00:00:08:51"
[[vip.backend]]
address = "10.0.0.82"
mac = "02:00:00:00:08:52"
[[vip.backend]]
address = "10.0.0.83"
mac = "02:00:00:00:08:53"
"#;

/// The "tun" VIP's backends, as the data path gets them: behind IPIP and GUE (written
/// over the agent's entries, as `tests/tunnels.rs` does, since `lo` routes nothing).
const TUNNELS: [(&str, u8); 2] = [("10.1.0.61", FORWARD_IPIP), ("10.1.0.62", FORWARD_GUE)];
const GUE_PORT: u16 = 6080;
const ROUTER: [u8; 4] = [10, 0, 0, 254];

// ---- the generator ---------------------------------------------------------------------

/// splitmix64: small, seeded, the same sequence everywhere.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// True one time in `n`.
    fn one_in(&mut self, n: u64) -> bool {
        self.below(n) == 0
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len() as u64) as usize]
    }
}

/// A flow of the pool: client to a VIP (or to an address, port or protocol of none).
#[derive(Clone, Copy, Debug)]
struct Flow {
    client: IpAddr,
    client_port: u16,
    server: IpAddr,
    server_port: u16,
    proto: u8,
}

/// What a frame is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Kind {
    Syn,
    Ack,
    FinAck,
    Rst,
    /// A SYN-ACK sent to the VIP: not a connection attempt (SYN with ACK).
    SynAck,
    Datagram,
    /// An ICMP "fragmentation needed" / ICMPv6 "packet too big" about the flow.
    TooBig,
    /// A QUIC short header whose connection ID names server ID 1 + client port % 5
    /// (4 and 5 name no backend): a connection that moved, or a new one.
    QuicShort,
    /// A QUIC Initial (long header).
    QuicLong,
}

/// The pool: every VIP's flows from a few clients (so sources repeat, and can be hot),
/// and flows of no VIP.
fn pool(rng: &mut Rng) -> Vec<Flow> {
    let v4 = |last: u8| IpAddr::V4(Ipv4Addr::new(10, 0, 0, last));
    let v6 = |last: u16| IpAddr::V6(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, last));
    let servers = [
        (v4(100), 80, PROTO_TCP),
        (v4(100), 53, PROTO_UDP),
        (v6(0x100), 80, PROTO_TCP),
        (v6(0x100), 53, PROTO_UDP),
        (v4(101), 443, PROTO_TCP),
        (v4(102), 80, PROTO_TCP),
        (v4(103), 443, PROTO_UDP),
        (v4(104), 80, PROTO_TCP),
        // For no VIP: another port, the other protocol, another address.
        (v4(100), 81, PROTO_TCP),
        (v4(100), 80, PROTO_UDP),
        (v4(200), 80, PROTO_TCP),
        (v6(0x100), 81, PROTO_UDP),
    ];
    let mut flows = Vec::new();
    for (server, server_port, proto) in servers {
        let for_vip = flows.len() < 8 * 48;
        for _ in 0..if for_vip { 48 } else { 8 } {
            let client = match server {
                IpAddr::V4(_) => v4(1 + rng.below(4) as u8),
                IpAddr::V6(_) => v6(1 + rng.below(4) as u16),
            };
            flows.push(Flow {
                client,
                client_port: 1024 + rng.below(60000) as u16,
                server,
                server_port,
                proto,
            });
        }
    }
    flows
}

fn kind_for(rng: &mut Rng, flow: &Flow) -> Kind {
    if flow.proto == PROTO_UDP && flow.server_port == 443 {
        return match rng.below(10) {
            0..6 => Kind::QuicShort,
            6..8 => Kind::QuicLong,
            8 => Kind::Datagram,
            _ => Kind::TooBig,
        };
    }
    if flow.proto == PROTO_UDP {
        return if rng.one_in(10) {
            Kind::TooBig
        } else {
            Kind::Datagram
        };
    }
    match rng.below(100) {
        0..25 => Kind::Syn,
        25..70 => Kind::Ack,
        70..78 => Kind::FinAck,
        78..85 => Kind::Rst,
        85..88 => Kind::SynAck,
        _ => Kind::TooBig,
    }
}

// ---- frames ----------------------------------------------------------------------------

fn octets(address: IpAddr) -> Vec<u8> {
    match address {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    }
}

/// An IP header (IPv4 with `options`) from `src` to `dst` before `payload` bytes.
fn ip_header(src: &[u8], dst: &[u8], proto: u8, payload: usize, options: &[u8]) -> Vec<u8> {
    if src.len() == 4 {
        let ihl = 5 + options.len() / 4;
        let mut h = vec![0u8; 20];
        h[0] = 0x40 | ihl as u8;
        h[2..4].copy_from_slice(&((ihl * 4 + payload) as u16).to_be_bytes());
        h[6] = 0x40; // DF
        h[8] = 64;
        h[9] = proto;
        h[12..16].copy_from_slice(src);
        h[16..20].copy_from_slice(dst);
        h.extend_from_slice(options);
        h
    } else {
        let mut h = vec![0u8; 40];
        h[0] = 0x60;
        h[4..6].copy_from_slice(&(payload as u16).to_be_bytes());
        h[6] = proto;
        h[7] = 64;
        h[8..24].copy_from_slice(src);
        h[24..40].copy_from_slice(dst);
        h
    }
}

/// A UDP datagram's payload of `kind` from port `src`.
fn udp_payload(kind: Kind, src: u16) -> Vec<u8> {
    match kind {
        Kind::QuicShort => {
            let mut packet = vec![0x40 | (src as u8 & 0x3f)];
            let mut cid = [0u8; 11];
            let nonce = src.to_le_bytes().repeat(4);
            lb_common::quic::encode_cid(1 + src as u128 % 5, 2, &nonce, &mut cid);
            packet.extend_from_slice(&cid);
            packet.extend_from_slice(&[0xa7; 24]);
            packet
        }
        Kind::QuicLong => {
            let mut packet = vec![0xc0, 0, 0, 0, 1, 8];
            packet.extend_from_slice(&src.to_be_bytes().repeat(4));
            packet.resize(64, 0);
            packet
        }
        _ => b"question".to_vec(),
    }
}

/// The transport header and payload of `kind` from port `src` to `dst`.
fn transport(proto: u8, kind: Kind, src: u16, dst: u16) -> Vec<u8> {
    let mut h = Vec::new();
    h.extend_from_slice(&src.to_be_bytes());
    h.extend_from_slice(&dst.to_be_bytes());
    if proto == PROTO_UDP {
        let payload = udp_payload(kind, src);
        h.extend_from_slice(&(8 + payload.len() as u16).to_be_bytes());
        h.extend_from_slice(&[0, 0]);
        h.extend_from_slice(&payload);
        return h;
    }
    const FIN: u8 = 0x01;
    const SYN: u8 = 0x02;
    const RST: u8 = 0x04;
    const ACK: u8 = 0x10;
    let flags = match kind {
        Kind::Syn => SYN,
        Kind::FinAck => FIN | ACK,
        Kind::Rst => RST,
        Kind::SynAck => SYN | ACK,
        _ => ACK,
    };
    h.extend_from_slice(&[
        0,
        0,
        0,
        1,
        0,
        0,
        0,
        1,
        5 << 4,
        flags,
        0xfa,
        0xf0,
        0,
        0,
        0,
        0,
    ]);
    h.extend_from_slice(b"payload!");
    h
}

/// The frame of `kind` on `flow`, and the packet the program should parse of it.
fn frame(flow: &Flow, kind: Kind, vlan: bool, options: bool) -> (Vec<u8>, Packet) {
    let (client, server) = (octets(flow.client), octets(flow.server));
    let v4 = client.len() == 4;
    let options: &[u8] = if options && v4 { &[1, 1, 1, 0] } else { &[] };
    let ip = if kind == Kind::TooBig {
        // From a router on the way back: quotes what the server sent to the client.
        let mut quoted = ip_header(&server, &client, flow.proto, 1400, &[]);
        quoted.extend_from_slice(&flow.server_port.to_be_bytes());
        quoted.extend_from_slice(&flow.client_port.to_be_bytes());
        quoted.extend_from_slice(&[0, 0, 0, 1]);
        let (head, router, proto): ([u8; 8], Vec<u8>, u8) = if v4 {
            ([3, 4, 0, 0, 0, 0, 0x05, 0x78], ROUTER.to_vec(), 1)
        } else {
            let router = Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 0xfe)
                .octets()
                .to_vec();
            ([2, 0, 0, 0, 0, 0, 0x05, 0x00], router, 58)
        };
        let mut icmp = head.to_vec();
        icmp.extend(quoted);
        let mut ip = ip_header(&router, &server, proto, icmp.len(), options);
        ip.extend(icmp);
        ip
    } else {
        let l4 = transport(flow.proto, kind, flow.client_port, flow.server_port);
        let mut ip = ip_header(&client, &server, flow.proto, l4.len(), options);
        ip.extend(l4);
        ip
    };
    let mut bytes = IFACE_MAC.to_vec();
    bytes.extend_from_slice(&[0x02, 0, 0, 0, 0, 0x01]);
    if vlan {
        bytes.extend_from_slice(&[0x81, 0x00, 0x00, 0x64]);
    }
    bytes.extend_from_slice(if v4 { &[0x08, 0x00] } else { &[0x86, 0xdd] });
    bytes.extend(ip);

    let (src_addr, family) = lb_common::addr::to_map(flow.client);
    let (dst_addr, _) = lb_common::addr::to_map(flow.server);
    let ports = (flow.client_port.to_be(), flow.server_port.to_be());
    let packet = Packet {
        syn: kind == Kind::Syn,
        rst: kind == Kind::Rst,
        fin: kind == Kind::FinAck,
        vlan,
        ipv4_options: !options.is_empty(),
        icmp_too_big: kind == Kind::TooBig,
        ..Packet::of_flow((src_addr, dst_addr), (family, flow.proto), ports)
    };
    (bytes, packet)
}

// ---- the program and the model ---------------------------------------------------------

/// CLOCK_MONOTONIC_COARSE: the clock the program stamps entries with.
fn coarse_ns() -> u64 {
    let now = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC_COARSE)
        .expect("CLOCK_MONOTONIC_COARSE");
    now.tv_sec() as u64 * 1_000_000_000 + now.tv_nsec() as u64
}

/// The balancer and what the model knows besides what it reads back per frame: the
/// agent's tables (with the tunnels written over them) and the hot sources written.
struct Bed {
    instance: Instance,
    desired: Desired,
    hot: HashSet<SourceKey>,
    /// The live words of each `stable_slots` VIP's table, by vip id, as the program reads
    /// them (the writer marks changed slots, which `desired` does not hold).
    words: std::collections::HashMap<u32, Vec<u32>>,
}

impl Bed {
    fn new() -> Bed {
        let instance = Instance::load_with(CONFIG, |options| options.source_sample = 1)
            .expect("load the instance");
        let desired = instance.model.desired();
        let mut bed = Bed {
            instance,
            desired,
            hot: HashSet::new(),
            words: Default::default(),
        };
        bed.sync();
        bed
    }

    /// Writes the model's tables (as a reload or health result does), the tunnels over
    /// them.
    fn sync(&mut self) {
        self.instance.sync().expect("write the tables");
        self.desired = self.instance.model.desired();
        let tun = self.vip("tun").backends.clone();
        for (address, forward) in TUNNELS {
            let backend = tun
                .iter()
                .filter(|b| b.config.address.to_string() == address)
                .map(|b| b.id)
                .next()
                .expect("the tunnel backend");
            let written = self.desired.backends.get_mut(&backend).expect("its entry");
            let (addr, family) = lb_common::addr::to_map(address.parse().unwrap());
            written.info = BackendInfo {
                forward,
                family,
                addr,
                gue_port_be: if forward == FORWARD_GUE {
                    GUE_PORT.to_be()
                } else {
                    0
                },
                ..written.info
            };
            let (info, identity) = (written.info, written.identity);
            let dataplane = &mut self.instance.dataplane;
            dataplane.set_backend(backend, &info, &identity).unwrap();
        }
        let tunnel = TunnelConfig {
            src_v4: [10, 0, 0, 2],
            mtu: 1500,
            src_v6: [0; 16],
            linear_frames: 1,
        };
        self.instance.dataplane.set_tunnel(&tunnel).unwrap();
        self.read_words();
    }

    /// Reads back the live table of every `stable_slots` VIP (`words`).
    fn read_words(&mut self) {
        let size = self.instance.config.dataplane.maglev_table_size;
        let adopted = self
            .instance
            .dataplane
            .adopted(size)
            .expect("read the tables");
        let stable = |id: &u32| {
            self.desired
                .vips
                .iter()
                .any(|v| v.vip_id == *id && v.flags & lb_common::VIP_F_STABLE != 0)
        };
        self.words = adopted
            .tables
            .into_iter()
            .filter(|(id, _)| stable(id))
            .collect();
    }

    fn vip(&self, name: &str) -> &lb_userspace::model::VipState {
        let vips = &self.instance.model.vips;
        vips.iter()
            .find(|v| v.config.name == name)
            .expect("the VIP")
    }

    /// What the program's maps hold of `packet`'s flow before it runs: its entry, and
    /// its embryonic slot.
    fn before(&self, packet: &Packet) -> (Option<FlowEntry>, lb_common::Embryo) {
        let key = packet.flow_key();
        let dataplane = &self.instance.dataplane;
        let entry = dataplane.flow(&key).expect("read the entry");
        let index = flow::embryo_place(&key).0;
        (entry, dataplane.embryo(index).expect("read the embryo"))
    }

    /// The model's tables for one frame at `now`: the agent's, with the frame's entry
    /// and embryonic slot as the program's maps held them (`before`).
    fn tables(
        &self,
        packet: &Packet,
        (entry, embryo): (Option<FlowEntry>, lb_common::Embryo),
        now: u64,
    ) -> MemoryTables {
        let idle = self.instance.config.dataplane.flow_idle_timeout;
        let mut tables = explain::decision_tables(&self.desired, idle, now);
        for (id, words) in &self.words {
            tables.maglev.insert(*id, words.clone());
        }
        tables.hot_sources = self.hot.clone();
        let key = packet.flow_key();
        tables.set_flow(&key, entry);
        tables.set_embryo(flow::embryo_place(&key).0, embryo);
        tables
    }
}

/// What a frame did (or should do): the XDP action, the outcome counters it moved, the
/// backend it went to (its MAC, and a tunnel's outer destination), the VIP's and the
/// backend's traffic counters, and the frame's entry and embryonic slot afterwards.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Outcome {
    action: u32,
    counted: Vec<(&'static str, u64)>,
    mac: Option<[u8; 6]>,
    outer_dst: Option<[u8; 4]>,
    /// (packets, new flows) of the VIP and the backend.
    traffic: Option<((u64, u64), (u64, u64))>,
    /// The backend's handshake counters that moved (`handshake::STARTED` ...).
    handshakes: [u64; handshake::COUNT],
    entry: Option<FlowEntry>,
    embryo: lb_common::Embryo,
}

fn moved(before: &[u64], after: &[u64]) -> Vec<(&'static str, u64)> {
    let pairs = stat::NAMES.iter().zip(before.iter().zip(after));
    let moved = pairs.filter(|(_, (b, a))| a != b);
    moved.map(|(name, (b, a))| (*name, a - b)).collect()
}

/// The model's outcome: `decide`, then what the program's `forward` and entry point
/// count for it.
fn predict(
    tables: &MemoryTables,
    packet: &Packet,
    payload: &[u8],
) -> (Outcome, Result<Choice, Verdict>) {
    let decision = tables.decide_payload(packet, payload);
    let mut counts = tables.counts();
    let verdict = match decision {
        Err(verdict) => verdict,
        Ok(choice) => {
            let backend = tables.backends[&choice.backend_id];
            match backend.forward {
                FORWARD_L2 => {}
                FORWARD_IPIP => counts[stat::TX_IPIP as usize] += 1,
                _ => counts[stat::TX_GUE as usize] += 1,
            }
            if packet.vlan {
                counts[stat::SEEN_VLAN as usize] += 1;
            }
            if packet.ipv4_options {
                counts[stat::SEEN_IPV4_OPTIONS as usize] += 1;
            }
            Verdict::tx(stat::XDP_TX)
        }
    };
    counts[verdict.action as usize] += 1;
    if verdict.reason != verdict.action {
        counts[verdict.reason as usize] += 1;
    }
    let key = packet.flow_key();
    let backend = decision.ok().map(|c| tables.backends[&c.backend_id]);
    let outcome = Outcome {
        action: verdict.action,
        counted: moved(&vec![0; counts.len()], &counts),
        mac: backend.map(|b| b.mac),
        outer_dst: backend
            .filter(|b| b.forward != FORWARD_L2 && !packet.vlan)
            .map(|b| b.addr[..4].try_into().unwrap()),
        traffic: decision
            .ok()
            .map(|c| ((1, c.new_flow as u64), (1, c.new_flow as u64))),
        handshakes: {
            let mut moved = [0; handshake::COUNT];
            if let Ok(choice) = decision {
                handshake::add(&mut moved, choice.handshake);
            }
            moved
        },
        entry: tables.flow(&key),
        embryo: tables.embryo(flow::embryo_place(&key).0),
    };
    (outcome, decision)
}

/// Runs `frame` through the program: its outcome, and the clock before and after.
fn run(bed: &mut Bed, frame: &[u8], packet: &Packet, ids: (u32, u32)) -> (Outcome, u64, u64) {
    let counters = |bed: &Bed| -> Counters {
        let dataplane = &bed.instance.dataplane;
        dataplane.counters(&[ids.0], &[ids.1]).expect("counters")
    };
    let before = counters(bed);
    let mut out = vec![0u8; frame.len() + 256];
    let t0 = coarse_ns();
    let program = bed.instance.dataplane.program_mut().expect("program");
    let result = program
        .test_run(TestRunOptions {
            data_in: Some(frame),
            data_out: Some(&mut out),
            repeat: 1,
            ..TestRunOptions::default()
        })
        .expect("BPF_PROG_TEST_RUN");
    let t1 = coarse_ns();
    out.truncate(result.data_size_out as usize);
    let after = counters(bed);
    let tx = result.return_value == stat::XDP_TX;
    let traffic = |c: &Counters| {
        let vip = c.vips.get(&ids.0).copied().unwrap_or_default();
        let backend = c.backends.get(&ids.1).copied().unwrap_or_default();
        (
            (vip.packets, vip.new_flows),
            (backend.packets, backend.new_flows),
        )
    };
    let ((vp0, vn0), (bp0, bn0)) = traffic(&before);
    let ((vp1, vn1), (bp1, bn1)) = traffic(&after);
    let handshakes = |c: &Counters| c.backends.get(&ids.1).map(|b| b.handshakes);
    let (h0, h1) = (handshakes(&before), handshakes(&after));
    let key = packet.flow_key();
    let dataplane = &bed.instance.dataplane;
    let l3 = if packet.vlan { 18 } else { 14 };
    let tunnelled = tx && out.len() >= l3 + 20 && out.len() > frame.len() && !packet.vlan;
    let outcome = Outcome {
        action: result.return_value,
        counted: moved(&before.outcomes, &after.outcomes),
        mac: tx.then(|| out[..6].try_into().unwrap()),
        outer_dst: tunnelled.then(|| out[l3 + 16..l3 + 20].try_into().unwrap()),
        traffic: tx.then_some(((vp1 - vp0, vn1 - vn0), (bp1 - bp0, bn1 - bn0))),
        handshakes: match (tx, h0, h1) {
            (true, Some(h0), Some(h1)) => std::array::from_fn(|i| h1[i] - h0[i]),
            _ => [0; handshake::COUNT],
        },
        entry: dataplane.flow(&key).expect("read the entry"),
        embryo: dataplane
            .embryo(flow::embryo_place(&key).0)
            .expect("read the embryo"),
    };
    (outcome, t0, t1)
}

// ---- changes to the maps ---------------------------------------------------------------

/// One random change to the program's maps, through the agent's code: a backend fails or
/// comes back, changes admin state, a source turns hot or cold, or an entry is written
/// as a cluster peer writes one. Returns what it did, for the figures.
fn change(bed: &mut Bed, rng: &mut Rng, flows: &[Flow]) -> Option<&'static str> {
    match rng.below(1000) {
        0..5 => {
            // Failed a third of the time: most VIPs keep a backend.
            let health = *rng.pick(&[Health::Down, Health::Unknown, Health::Unknown]);
            random_backend(bed, rng).health = health;
            bed.sync();
            Some("health")
        }
        5..8 => {
            let states = [AdminState::Drain, AdminState::Maint, AdminState::Ready];
            let state = *rng.pick(&[states[0], states[1], states[2], states[2], states[2]]);
            random_backend(bed, rng).config.state = state;
            bed.sync();
            Some("admin state")
        }
        8..18 => {
            let vip_id = bed.vip("src").id;
            let client = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1 + rng.below(4) as u8));
            let (addr, family) = lb_common::addr::to_map(client);
            let key = SourceKey::new(vip_id, addr, family);
            let hot = !bed.hot.remove(&key);
            if hot {
                bed.hot.insert(key);
            }
            bed.instance.dataplane.set_hot_source(&key, hot).unwrap();
            Some("hot source")
        }
        18..68 => {
            let flow = rng.pick(flows);
            let (_, packet) = frame(flow, Kind::Ack, false, false);
            let entry = random_entry(bed, rng);
            let dataplane = &mut bed.instance.dataplane;
            dataplane.insert_flow(&packet.flow_key(), &entry).unwrap();
            Some("entry written")
        }
        68..73 => {
            // The agent's scan, as if the bound had passed for every changed slot: the
            // slots no live entry holds turn stable (in place, in the live table).
            let flows = bed
                .instance
                .dataplane
                .flow_reader()
                .unwrap()
                .flows()
                .unwrap();
            let idle = bed.instance.config.dataplane.flow_idle_timeout;
            let later = std::time::Instant::now() + idle * 100;
            let writer = &mut bed.instance.writer;
            let turned = writer
                .stabilize(
                    &mut bed.instance.dataplane,
                    &flows,
                    (later, coarse_ns()),
                    idle,
                )
                .expect("stabilize");
            bed.read_words();
            (!turned.is_empty()).then_some("slots stabilized")
        }
        _ => None,
    }
}

fn random_backend<'a>(
    bed: &'a mut Bed,
    rng: &mut Rng,
) -> &'a mut lb_userspace::model::BackendState {
    let vips = &mut bed.instance.model.vips;
    let vip = rng.below(vips.len() as u64) as usize;
    let backends = &mut vips[vip].backends;
    let backend = rng.below(backends.len() as u64) as usize;
    &mut backends[backend]
}

/// An entry of any backend (this VIP's, another's, an unused id, one past the map), any
/// age (around the refresh granularity and the UDP idle time, never within 50 ms of
/// either, nor of the clock's tick; or from the future), any flags.
fn random_entry(bed: &Bed, rng: &mut Rng) -> FlowEntry {
    let ids: Vec<u32> = bed.desired.backends.keys().copied().collect();
    let backend_id = match rng.below(10) {
        0 => 4000,
        1 => 5000,
        _ => *rng.pick(&ids),
    };
    const MS: u64 = 1_000_000;
    let ages: [i64; 8] = [100, 500, 2_000, 10_000, 29_500, 31_000, 120_000, -500];
    let age = rng.pick(&ages) * MS as i64;
    let flags = *rng.pick(&[
        0,
        FLOW_F_CLOSING,
        FLOW_F_LEARNED,
        FLOW_F_CLOSING | FLOW_F_LEARNED,
    ]);
    FlowEntry {
        backend_id,
        flags,
        last_seen_ns: (coarse_ns() as i64 - age) as u64,
    }
}

// ---- the test --------------------------------------------------------------------------

fn setting(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(text) => text
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name}={text:?}: expected a whole number")),
        Err(_) => default,
    }
}

fn in_ci() -> bool {
    std::env::var("CI")
        .is_ok_and(|v| !matches!(v.trim().to_ascii_lowercase().as_str(), "" | "false" | "0"))
}

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

#[test]
fn differential_the_program_and_lb_common_decide_agree_on_random_frames() {
    if !can_run("differential_the_program_and_lb_common_decide_agree_on_random_frames") {
        return;
    }
    let frames = setting(
        "LB_DIFFERENTIAL_FRAMES",
        if in_ci() { 25_000 } else { 100_000 },
    );
    let seed = setting("LB_DIFFERENTIAL_SEED", 34);
    eprintln!("differential: {frames} frames, seed {seed}");
    let mut rng = Rng(seed);
    let mut flows = pool(&mut rng);
    let mut bed = Bed::new();
    let mut figures = Figures::default();
    let mut differences = Vec::new();
    let start = Instant::now();
    for i in 0..frames {
        if let Some(what) = change(&mut bed, &mut rng, &flows) {
            figures.add(what);
        }
        // One frame in ten starts a flow afresh (a new client port): first packets,
        // handshakes and misses keep coming.
        let index = rng.below(flows.len() as u64) as usize;
        if rng.one_in(10) {
            flows[index].client_port = 1024 + rng.below(60000) as u16;
        }
        let flow = flows[index];
        let kind = kind_for(&mut rng, &flow);
        let (bytes, packet) = frame(&flow, kind, rng.one_in(20), rng.one_in(10));
        // The model at the clock before the run; if the program read the next tick,
        // at that one.
        let before = bed.before(&packet);
        let now = coarse_ns();
        let payload = udp_payload(kind, flow.client_port);
        let (want, decision) = predict(&bed.tables(&packet, before, now), &packet, &payload);
        let ids = decision.map_or((0, 0), |c| (c.vip_id, c.backend_id));
        let (got, t0, t1) = run(&mut bed, &bytes, &packet, ids);
        // The clock an entry the program wrote shows: the program reads the coarse
        // clock through its own per-CPU cache, which may be a tick off ours.
        let written = got
            .entry
            .filter(|e| Some(*e) != before.0)
            .map(|e| e.last_seen_ns);
        let agreed = want == got
            || [Some(t0), Some(t1), written]
                .into_iter()
                .flatten()
                .filter(|&at| at != now)
                .any(|at| {
                    let tables = bed.tables(&packet, before, at);
                    let retried = predict(&tables, &packet, &payload).0 == got;
                    figures.retried += u64::from(retried);
                    retried
                });
        figures.count(kind, &got, &decision);
        if !agreed {
            differences.push(format!(
                "frame {i} ({kind:?} {flow:?}, vlan {}, options {}):\n  model:   {want:?}\n  program: {got:?}",
                packet.vlan, packet.ipv4_options
            ));
        }
    }
    eprintln!(
        "differential: {frames} frames in {:.1?}, seed {seed}\n{}",
        start.elapsed(),
        figures.report()
    );
    assert!(
        differences.is_empty(),
        "{} of {frames} frames differ (seed {seed}); the first:\n{}",
        differences.len(),
        differences[..differences.len().min(5)].join("\n")
    );
    // Agreement proves little about a path no frame took (the model and the program
    // share lb-common's code): the QUIC VIP's frames must have been routed by their
    // connection IDs, by the program, and balanced when the ID names no backend.
    for counter in ["quic_routed_by_cid", "quic_cid_unknown"] {
        assert!(
            figures.counters.get(counter).is_some_and(|&n| n > 0),
            "the program never counted {counter}:\n{}",
            figures.report()
        );
    }
    assert!(
        figures.decided_by.contains_key("ConnectionId"),
        "no backend decided by a QUIC connection ID:\n{}",
        figures.report()
    );
    // And the stable-slot VIP's frames took both paths: a stable slot, and a changed
    // slot's previous backend.
    for by in ["StableSlot", "PreviousBackend"] {
        assert!(
            figures.decided_by.contains_key(by),
            "no backend decided by {by}:\n{}",
            figures.report()
        );
    }
}

/// What the run did, for the report.
#[derive(Default)]
struct Figures {
    kinds: std::collections::BTreeMap<String, u64>,
    actions: std::collections::BTreeMap<&'static str, u64>,
    decided_by: std::collections::BTreeMap<String, u64>,
    changes: std::collections::BTreeMap<&'static str, u64>,
    counters: std::collections::BTreeMap<&'static str, u64>,
    backends: HashSet<u32>,
    /// Frames the model agreed with only at the clock the program read (a tick off).
    retried: u64,
}

impl Figures {
    fn add(&mut self, change: &'static str) {
        *self.changes.entry(change).or_default() += 1;
    }

    fn count(&mut self, kind: Kind, got: &Outcome, decision: &Result<Choice, Verdict>) {
        *self.kinds.entry(format!("{kind:?}")).or_default() += 1;
        let action = stat::NAMES[got.action as usize];
        *self.actions.entry(action).or_default() += 1;
        if let Ok(choice) = decision {
            *self
                .decided_by
                .entry(format!("{:?}", choice.by))
                .or_default() += 1;
            self.backends.insert(choice.backend_id);
        }
        for (name, n) in &got.counted {
            *self.counters.entry(name).or_default() += n;
        }
    }

    fn report(&self) -> String {
        let line = |what: &str, map: String| format!("  {what}: {map}\n");
        let show = |map: &dyn std::fmt::Debug| format!("{map:?}");
        let mut out = String::new();
        out += &line("frames", show(&self.kinds));
        out += &line("actions", show(&self.actions));
        out += &line("backend decided by", show(&self.decided_by));
        out += &line("backends chosen", self.backends.len().to_string());
        out += &line("map changes", show(&self.changes));
        out += &line("counters moved", show(&self.counters));
        out += &line("agreed at the program's tick", self.retried.to_string());
        out
    }
}
