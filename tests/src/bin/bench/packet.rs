//! Per-packet cost of `lb_xdp` through BPF_PROG_TEST_RUN, raw and net of `xdp_pass`
//! (the empty program) measured in the same rounds.
//!
//! Two ways: `repeat = N` in one call (the kernel's average per run), and a loop of
//! calls with `repeat = 1` (wall time per call, and the kernel's time per run). Under
//! `repeat > 1` the program sees its own output again; `lb_xdp` only rewrites MACs, so
//! the flow stays the same. A SYN takes the Maglev table and is remembered in the
//! embryonic table, without a connection-table entry; the flow's next packet makes the
//! entry. The new-flow cases give every call of the loop a new source address and port:
//! a spoofed SYN, a handshake (SYN and the ACK that makes the entry), and the client's
//! packets of a whole short connection.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use anyhow::{Context, Result, anyhow, bail, ensure};
use aya::programs::{TestRun, TestRunOptions, Xdp};
use lb_common::stat;
use lb_tests::program::{IFACE_MAC, Instance, load_test_program};
use lb_userspace::dataplane::Dataplane;
use serde_json::{Value, json};

use crate::frames::{
    Frame, L4, TCP_ACK, TCP_FIN, TCP_PSH, TCP_SYN, V4_SRC_ADDR_AT, V4_SRC_PORT_AT,
};
use crate::report::{Table, median, num, range};

const XDP_PASS: u32 = 2;
const XDP_TX: u32 = 3;
const XDP_REDIRECT: u32 = 4;

/// The interfaces of the instance a case runs on.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Nics {
    /// One interface: frames go back out where they came in (the default).
    One,
    /// Two; the backends behind the interface the frames come in by (the loopback of a
    /// test run): XDP_TX after the egress lookups.
    TwoSame,
    /// Two; the backends behind the other: XDP_REDIRECT through `LB_TX_PORTS`.
    TwoOther,
}

impl Nics {
    /// The instance of `insts` this case runs on (see `run`).
    fn instance(self, cluster: bool) -> usize {
        match (self, cluster) {
            (Nics::One, false) => 0,
            (Nics::One, true) => 1,
            (Nics::TwoSame, _) => 2,
            (Nics::TwoOther, _) => 3,
        }
    }
}

/// Makes `inst` one of two interfaces: egress 0 the loopback (where a test run's frames
/// come in), egress 1 another device of this namespace (a test run returns the action
/// and sends nothing), every backend behind egress `egress`.
fn two_nics(inst: &mut Instance, egress: u32) -> Result<()> {
    use lb_userspace::dataplane::EgressPort;
    let other = nix::net::if_::if_nameindex()
        .context("listing the interfaces")?
        .iter()
        .map(|i| i.index())
        .find(|&i| i != 1)
        .ok_or_else(|| {
            anyhow!("no interface but the loopback here: the redirect case needs one")
        })?;
    for (index, ifindex) in [(0, 1), (1, other)] {
        let port = EgressPort {
            name: format!("if{ifindex}"),
            ifindex,
            mac: IFACE_MAC,
            mode: None,
            native_refused: None,
        };
        inst.dataplane.record_egress(index, &port)?;
    }
    let ids: Vec<u32> = inst.model.backends().map(|b| b.id).collect();
    for id in ids {
        inst.dataplane.set_backend_egress(id, egress)?;
    }
    Ok(())
}

const CLIENT_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x01];
const VIP4: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 100);
const VIP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 0x100);
const CLIENT4: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 1);
const CLIENT6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 1);

pub struct Options {
    pub rounds: usize,
    pub repeat: u32,
    pub loop_calls: u32,
    pub backend_counts: Vec<usize>,
    /// The cases to run, by name; empty: all.
    pub cases: Vec<String>,
    /// Variants of the `lb_xdp` object (name, path): the cases of the plain instance run
    /// on each too, in the same rounds.
    pub variants: Vec<(String, std::path::PathBuf)>,
}

/// `--variant NAME=PATH`.
pub fn parse_variant(s: &str) -> Result<(String, std::path::PathBuf), String> {
    match s.split_once('=') {
        Some((name, path)) if !name.is_empty() && !path.is_empty() => {
            Ok((name.to_string(), path.into()))
        }
        _ => Err(format!("--variant {s:?}: expected NAME=PATH")),
    }
}

/// One case on one instance: the built-in object's, or a variant's (named `case@variant`).
struct Run<'a> {
    case: &'a Case,
    name: String,
    /// Index into the loaded instances.
    inst: usize,
}

/// Every case on its instance, and the plain instance's cases again on each variant's
/// (loaded after the first four instances, in the order of `variants`).
fn runs<'a>(cases: &'a [Case], variants: &[(String, std::path::PathBuf)]) -> Vec<Run<'a>> {
    let mut runs = Vec::new();
    for case in cases {
        let inst = case.nics.instance(case.cluster);
        runs.push(Run {
            case,
            name: case.name.to_string(),
            inst,
        });
        if inst != 0 {
            continue;
        }
        for (v, (variant, _)) in variants.iter().enumerate() {
            runs.push(Run {
                case,
                name: format!("{}@{variant}", case.name),
                inst: 4 + v,
            });
        }
    }
    runs
}

/// A config with six VIPs (IPv4 TCP 80, IPv4 UDP 53, IPv6 TCP 80, IPv4 UDP 443
/// with `quic`, at most 64 backends, IPv4 TCP `OUTLIER_PORT` with `[vip.outlier]` and
/// IPv4 TCP `STABLE_PORT` with `stable_slots`),
/// each with `backends` backends whose MACs are given; room for them and the tunnel
/// VIPs' (`max_backends`); no health checks; no insert limit (the
/// handshake cases measure the insert, which the default flood guard would skip above
/// 100k inserts per second per CPU).
pub fn config_text(backends: usize) -> String {
    let mut t = String::from(
        "[dataplane]\ninterface = \"lo\"\nconntrack_insert_limit = 0\nmax_backends = 8192\n\
         [control]\nmetrics = \"off\"\n",
    );
    let vips = [
        ("tcp4", VIP4.to_string(), 80, "tcp", false),
        ("udp4", VIP4.to_string(), 53, "udp", false),
        ("tcp6", VIP6.to_string(), 80, "tcp", true),
        ("quic4", VIP4.to_string(), QUIC_PORT, "udp", false),
        ("tcp4o", VIP4.to_string(), OUTLIER_PORT, "tcp", false),
        ("tcp4s", VIP4.to_string(), STABLE_PORT, "tcp", false),
    ];
    for (v, (name, address, port, proto, v6)) in vips.iter().enumerate() {
        t += &format!(
            "\n[[vip]]\nname = \"{name}\"\naddress = \"{address}\"\nport = {port}\n\
             protocol = \"{proto}\"\n{}[vip.health]\nkind = \"none\"\n",
            match *name {
                "quic4" => "quic = true\n",
                "tcp4o" => "[vip.outlier]\n",
                "tcp4s" => "stable_slots = true\n",
                _ => "",
            }
        );
        // The QUIC VIP's backends count against `MAX_BACKENDS` with the others': a few
        // suffice (its short headers name theirs, the table is not read).
        let count = if *name == "quic4" {
            backends.min(64)
        } else {
            backends
        };
        for i in 0..count {
            let address = if *v6 {
                IpAddr::from(Ipv6Addr::new(0xfd00, 1, 0, 0, 0, 0, 0, i as u16 + 1))
            } else {
                IpAddr::from(Ipv4Addr::new(10, 1, (i / 250) as u8, (i % 250) as u8 + 1))
            };
            t += &format!(
                "[[vip.backend]]\naddress = \"{address}\"\nmac = \"02:00:{v:02x}:00:{:02x}:{:02x}\"\n",
                (i >> 8) as u8,
                i as u8
            );
            // Backend i's connection IDs carry server ID i + 1.
            if *name == "quic4" {
                t += &format!("server_id = {}\n", i + 1);
            }
        }
    }
    t
}

/// The port of "tcp4o" (on VIP4): a TCP VIP like "tcp4" with `[vip.outlier]`, whose
/// SYNs read their embryonic slot to tell a retry (the `_outlier` cases).
pub const OUTLIER_PORT: u16 = 83;

/// The port of "tcp4s" (on VIP4): a TCP VIP like "tcp4" with `stable_slots`, whose
/// flows in stable slots make no connection-table entry (the `_stable` cases; a fresh
/// table has every slot stable).
pub const STABLE_PORT: u16 = 84;

/// The QUIC VIP's port (on VIP4): a UDP VIP with `quic = true`.
pub const QUIC_PORT: u16 = 443;

/// The VIP ports of the tunnel cases (on VIP4), and the backends' GUE port.
pub const IPIP_PORT: u16 = 81;
pub const GUE_PORT_VIP: u16 = 82;
const GUE_PORT: u16 = 6080;

/// Two more TCP VIPs on `vip`, "ipip4" (port `IPIP_PORT`) and "gue4" (`GUE_PORT_VIP`),
/// with `backends` IPv4 backends (at most 500 each: all VIPs share `MAX_BACKENDS`);
/// their data-path entries are then made tunnels by `make_tunnels`.
pub fn tunnel_vips(vip: Ipv4Addr, backends: usize) -> String {
    let backends = backends.min(500);
    let mut t = String::new();
    for (name, port) in [("ipip4", IPIP_PORT), ("gue4", GUE_PORT_VIP)] {
        t += &format!(
            "\n[[vip]]\nname = \"{name}\"\naddress = \"{vip}\"\nport = {port}\n\
             protocol = \"tcp\"\n[vip.health]\nkind = \"none\"\n"
        );
        for i in 0..backends {
            let address = Ipv4Addr::new(10, 1, (i / 250) as u8, (i % 250) as u8 + 1);
            t +=
                &format!("[[vip.backend]]\naddress = \"{address}\"\nmac = \"02:00:00:00:00:fe\"\n");
        }
    }
    t
}

/// Writes the tunnel VIPs' backends as `forward = "ipip"` / `"gue"` (the agent's half
/// of the contract, `BackendInfo`) with `next_hop` as their MAC, and `LB_TUNNEL` as the
/// agent writes it for one interface at MTU 1500 (the outer source; `one_nic`: attached
/// natively, so frames come in one buffer and their length is read without a helper
/// call; else, with several interfaces, the helper's).
pub fn make_tunnels(inst: &mut Instance, next_hop: [u8; 6], one_nic: bool) -> Result<()> {
    let mut entries = Vec::new();
    for vip in &inst.model.vips {
        let forward = match vip.config.name.as_str() {
            "ipip4" => lb_common::FORWARD_IPIP,
            "gue4" => lb_common::FORWARD_GUE,
            _ => continue,
        };
        for b in &vip.backends {
            let IpAddr::V4(address) = b.config.address else {
                continue;
            };
            let mut addr = [0; 16];
            addr[..4].copy_from_slice(&address.octets());
            let info = lb_common::BackendInfo {
                forward,
                family: lb_common::ADDR_FAMILY_V4,
                gue_port_be: GUE_PORT.to_be(),
                addr,
                ..lb_common::BackendInfo::l2(next_hop, lb_common::BACKEND_F_SERVES_FLOWS, vip.id)
            };
            let identity = lb_common::BackendIdentity {
                addr,
                vip_id: vip.id,
                family: lb_common::ADDR_FAMILY_V4,
                in_use: 1,
                _pad: [0; 2],
            };
            entries.push((b.id, info, identity));
        }
    }
    for (id, info, identity) in entries {
        inst.dataplane.set_backend(id, &info, &identity)?;
    }
    inst.dataplane.set_tunnel(&lb_common::TunnelConfig {
        src_v4: [10, 0, 0, 2],
        mtu: 1500,
        src_v6: [0; 16],
        linear_frames: one_nic as u32,
    })?;
    Ok(())
}

/// A program of the test object (`xdp_pass`: the empty program) on its own.
pub fn load_program(name: &str) -> Result<aya::Ebpf> {
    load_test_program(name, 1)
}

pub fn xdp<'a>(ebpf: &'a mut aya::Ebpf, name: &str) -> Result<&'a mut Xdp> {
    Ok(ebpf
        .program_mut(name)
        .ok_or_else(|| anyhow!("no program {name}"))?
        .try_into()?)
}

/// What makes the second instance export its new entries (no socket or key is opened:
/// only the program's global and its ring).
const CLUSTER: &str = "\n[cluster]\npeers = [\"10.0.0.12\"]\nkey_file = \"/etc/lb/cluster.key\"\n";

/// How often the reader drains the ring. The agent drains it every 50 ms, so the program
/// writes records while the reader sleeps (the ring's consumer position then stays in
/// the producer's cache); the loop here creates some 300,000 entries a second, which
/// would overflow the 256 KiB ring in 50 ms, so the reader wakes ten times as often.
const EXPORT_POLL: std::time::Duration = std::time::Duration::from_millis(5);

/// Drains the export ring on a thread of its own, as the agent does.
struct ExportReader {
    stop: Arc<AtomicBool>,
    handle: std::thread::JoinHandle<u64>,
}

impl ExportReader {
    fn start(mut ring: aya::maps::RingBuf<aya::maps::MapData>) -> ExportReader {
        let stop = Arc::new(AtomicBool::new(false));
        let handle = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut records = 0;
                while !stop.load(Ordering::Relaxed) {
                    while ring.next().is_some() {
                        records += 1;
                    }
                    std::thread::sleep(EXPORT_POLL);
                }
                records
            })
        };
        ExportReader { stop, handle }
    }

    /// Records read.
    fn stop(self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        self.handle.join().unwrap_or(0)
    }
}

/// Flows of the many-flows case, like the veth generator's 16384 source ports.
const MANY_FLOWS: u32 = 16384;
const FLOWS_BASE_PORT: u16 = 20000;

fn set_src_port(frame: &mut [u8], port: u16) {
    frame[V4_SRC_PORT_AT..V4_SRC_PORT_AT + 2].copy_from_slice(&port.to_be_bytes());
}

struct Case {
    name: &'static str,
    what: &'static str,
    frame: Vec<u8>,
    /// Sent after `frame` in each call of the loop, from the same source: the rest of a
    /// new flow's packets. The loop's figures are per call (the whole sequence); under
    /// `repeat`, only `frame` is sent, and the figures are not shown.
    then: Vec<Vec<u8>>,
    /// Sent once before measuring, then `frame` once (the two make the flow's entry).
    prime: Option<Vec<u8>>,
    /// Run on the instance loaded with `[cluster]` (new entries go to the export ring).
    cluster: bool,
    /// The instance's interfaces: one (as always), or two (`dataplane.interfaces`) with
    /// the backends behind the one the frame came in by (XDP_TX) or the other
    /// (XDP_REDIRECT through the DEVMAP).
    nics: Nics,
    /// The loop gives every call a new source (IPv4 only).
    new_source_per_call: bool,
    /// The loop cycles the source port through this many flows, each primed with a SYN
    /// (IPv4 only); 1: one flow. Under `repeat` only the first flow is sent.
    flows: u32,
    action: u32,
    /// The output is no packet for the VIP any more (it is encapsulated), so `repeat`
    /// cannot run it again: it runs once, and the loop alone measures the case.
    once_per_call: bool,
}

impl Case {
    /// A case whose `frame` alone is sent, from one source, by the instance of one
    /// interface and no `[cluster]`, and leaves by XDP_TX.
    fn new(name: &'static str, what: &'static str, frame: Vec<u8>) -> Self {
        Self {
            name,
            what,
            frame,
            then: vec![],
            prime: None,
            cluster: false,
            nics: Nics::One,
            new_source_per_call: false,
            flows: 1,
            action: XDP_TX,
            once_per_call: false,
        }
    }

    /// Every frame of one call of the loop.
    fn frames(&self) -> Vec<Vec<u8>> {
        std::iter::once(&self.frame)
            .chain(&self.then)
            .cloned()
            .collect()
    }
}

fn frame(src: IpAddr, dst: IpAddr, sport: u16, dport: u16, l4: L4) -> Vec<u8> {
    Frame {
        dst_mac: IFACE_MAC,
        src_mac: CLIENT_MAC,
        src,
        dst,
        sport,
        dport,
        l4,
    }
    .bytes()
}

/// The cases `names` asks for (all for none), in their order; an unknown name fails.
fn chosen_cases(names: &[String]) -> Result<Vec<Case>> {
    let all = cases();
    if let Some(unknown) = names
        .iter()
        .find(|n| !all.iter().any(|c| c.name == n.as_str()))
    {
        let known: Vec<&str> = all.iter().map(|c| c.name).collect();
        bail!(
            "no per-packet case {unknown:?}; the cases: {}",
            known.join(", ")
        );
    }
    Ok(all
        .into_iter()
        .filter(|c| names.is_empty() || names.iter().any(|n| n == c.name))
        .collect())
}

fn cases() -> Vec<Case> {
    let (c4, v4, c6, v6) = (
        IpAddr::from(CLIENT4),
        IpAddr::from(VIP4),
        IpAddr::from(CLIENT6),
        IpAddr::from(VIP6),
    );
    let syn = L4::Tcp { flags: TCP_SYN };
    let ack = L4::Tcp { flags: TCP_ACK };
    vec![
        Case {
            new_source_per_call: true,
            ..Case::new(
                "tcp_syn",
                "spoofed TCP SYN: a new tuple every call (Maglev, remembered, no entry)",
                frame(c4, v4, 40000, 80, syn),
            )
        },
        Case {
            then: vec![frame(c4, v4, 40008, 80, ack)],
            cluster: true,
            new_source_per_call: true,
            ..Case::new(
                "tcp_handshake_cluster",
                "tcp_handshake with [cluster]: the ACK's new entry is also exported",
                frame(c4, v4, 40008, 80, syn),
            )
        },
        Case {
            then: vec![frame(c4, v4, 40007, 80, ack)],
            new_source_per_call: true,
            ..Case::new(
                "tcp_handshake",
                "a handshake's SYN and ACK, a new tuple every call (the ACK makes the entry)",
                frame(c4, v4, 40007, 80, syn),
            )
        },
        Case {
            new_source_per_call: true,
            ..Case::new(
                "tcp_syn_outlier",
                "tcp_syn to a VIP with [vip.outlier]: the SYN reads its slot to tell a retry",
                frame(c4, v4, 40011, OUTLIER_PORT, syn),
            )
        },
        Case {
            then: vec![frame(c4, v4, 40012, OUTLIER_PORT, ack)],
            new_source_per_call: true,
            ..Case::new(
                "tcp_handshake_outlier",
                "tcp_handshake to a VIP with [vip.outlier]",
                frame(c4, v4, 40012, OUTLIER_PORT, syn),
            )
        },
        Case {
            then: vec![frame(c4, v4, 40013, STABLE_PORT, ack)],
            new_source_per_call: true,
            ..Case::new(
                "tcp_handshake_stable",
                "tcp_handshake to a VIP with stable_slots: the ACK makes no entry",
                frame(c4, v4, 40013, STABLE_PORT, syn),
            )
        },
        Case {
            then: [TCP_ACK, TCP_ACK | TCP_PSH, TCP_ACK | TCP_FIN, TCP_ACK]
                .map(|flags| frame(c4, v4, 40014, STABLE_PORT, L4::Tcp { flags }))
                .into(),
            new_source_per_call: true,
            ..Case::new(
                "tcp_short_connection_stable",
                "tcp_short_connection to a VIP with stable_slots",
                frame(c4, v4, 40014, STABLE_PORT, syn),
            )
        },
        Case {
            prime: Some(frame(c4, v4, 40015, STABLE_PORT, syn)),
            ..Case::new(
                "tcp_established_stable",
                "tcp_established to a VIP with stable_slots (a stable slot: no lookup)",
                frame(c4, v4, 40015, STABLE_PORT, ack),
            )
        },
        Case {
            prime: Some(frame(c4, v4, FLOWS_BASE_PORT, STABLE_PORT, syn)),
            flows: MANY_FLOWS,
            ..Case::new(
                "tcp_established_16k_flows_stable",
                "tcp_established_16k_flows to a VIP with stable_slots",
                frame(c4, v4, FLOWS_BASE_PORT, STABLE_PORT, ack),
            )
        },
        Case {
            then: [TCP_ACK, TCP_ACK | TCP_PSH, TCP_ACK | TCP_FIN, TCP_ACK]
                .map(|flags| frame(c4, v4, 40006, 80, L4::Tcp { flags }))
                .into(),
            new_source_per_call: true,
            ..Case::new(
                "tcp_short_connection",
                "a short connection's client packets: SYN, ACK, request, FIN, last ACK",
                frame(c4, v4, 40006, 80, syn),
            )
        },
        Case {
            prime: Some(frame(c4, v4, 40001, 80, syn)),
            ..Case::new(
                "tcp_established",
                "TCP ACK of an established flow (connection-table hit)",
                frame(c4, v4, 40001, 80, ack),
            )
        },
        Case {
            prime: Some(frame(c4, v4, FLOWS_BASE_PORT, 80, syn)),
            flows: MANY_FLOWS,
            ..Case::new(
                "tcp_established_16k_flows",
                "TCP ACKs cycling over 16384 established flows (table hits, colder cache)",
                frame(c4, v4, FLOWS_BASE_PORT, 80, ack),
            )
        },
        Case {
            prime: Some(frame(c4, v4, 40002, 53, L4::Udp)),
            ..Case::new(
                "udp",
                "UDP to the VIP, flow known (connection-table hit)",
                frame(c4, v4, 40002, 53, L4::Udp),
            )
        },
        Case {
            prime: Some(frame(
                c4,
                v4,
                40009,
                QUIC_PORT,
                L4::QuicShort { server_id: 1 },
            )),
            ..Case::new(
                "quic_short_header",
                "QUIC short header to a quic VIP, routed by its connection ID (entry fresh)",
                frame(c4, v4, 40009, QUIC_PORT, L4::QuicShort { server_id: 1 }),
            )
        },
        Case {
            new_source_per_call: true,
            ..Case::new(
                "quic_moved",
                "QUIC short header from a new source every call: routed by ID, entry made",
                frame(c4, v4, 40010, QUIC_PORT, L4::QuicShort { server_id: 1 }),
            )
        },
        Case {
            prime: Some(frame(c6, v6, 40003, 80, syn)),
            ..Case::new(
                "ipv6_tcp_established",
                "IPv6 TCP ACK of an established flow",
                frame(c6, v6, 40003, 80, ack),
            )
        },
        Case {
            prime: Some(frame(c4, v4, 40005, IPIP_PORT, syn)),
            once_per_call: true,
            ..Case::new(
                "tcp_established_ipip",
                "TCP ACK of an established flow to an ipip VIP (IPv4 in IPv4)",
                frame(c4, v4, 40005, IPIP_PORT, ack),
            )
        },
        Case {
            prime: Some(frame(c4, v4, 40006, GUE_PORT_VIP, syn)),
            once_per_call: true,
            ..Case::new(
                "tcp_established_gue",
                "TCP ACK of an established flow to a gue VIP (IPv4 + UDP + IPv4)",
                frame(c4, v4, 40006, GUE_PORT_VIP, ack),
            )
        },
        Case {
            prime: Some(frame(c4, v4, 40001, 80, syn)),
            nics: Nics::TwoSame,
            ..Case::new(
                "tcp_established_2nic_tx",
                "tcp_established with two interfaces, the backend behind the one the \
                 frame came in by (XDP_TX)",
                frame(c4, v4, 40001, 80, ack),
            )
        },
        Case {
            prime: Some(frame(c4, v4, 40001, 80, syn)),
            nics: Nics::TwoOther,
            action: XDP_REDIRECT,
            ..Case::new(
                "tcp_established_redirect",
                "tcp_established with two interfaces, the backend behind the other one \
                 (XDP_REDIRECT through the DEVMAP)",
                frame(c4, v4, 40001, 80, ack),
            )
        },
        Case {
            action: XDP_PASS,
            ..Case::new(
                "pass_not_vip",
                "TCP to a non-VIP address (XDP_PASS)",
                frame(c4, IpAddr::from(Ipv4Addr::new(10, 0, 0, 2)), 40004, 80, ack),
            )
        },
    ]
}

/// How a case was measured: the loop's kernel time, or `repeat`'s.
#[derive(Clone, Copy)]
enum Way {
    Loop,
    Repeat,
}

/// The net ns of `case` with `backends` backends, measured `way` (NaN: not run).
fn net_ns(net: &[(String, usize, f64, f64, f64)], case: &str, backends: usize, way: Way) -> f64 {
    net.iter()
        .find(|r| r.0 == case && r.1 == backends)
        .map(|r| match way {
            Way::Loop => r.3,
            Way::Repeat => r.2,
        })
        .unwrap_or(f64::NAN)
}

/// The tunnels' cost next to L2's, per backend count and object (the built-in one, then
/// each variant's, against its own L2 case): loop kernel net ns, and ratios.
fn tunnel_ratios(net: &[(String, usize, f64, f64, f64)], variants: &[String]) -> Table {
    let mut table = Table::new(
        "Tunnel DSR next to L2 (established TCP, loop kernel net ns, medians)",
        &[
            "backends",
            "object",
            "l2",
            "ipip",
            "gue",
            "ipip / l2",
            "gue / l2",
        ],
    );
    let mut counts: Vec<usize> = net.iter().map(|r| r.1).collect();
    counts.dedup();
    let objects = std::iter::once(String::new()).chain(variants.iter().map(|v| format!("@{v}")));
    let objects: Vec<String> = objects.collect();
    for backends in counts {
        for object in &objects {
            let ns = |case: &str| net_ns(net, &format!("{case}{object}"), backends, Way::Loop);
            let (l2, ipip, gue) = (
                ns("tcp_established"),
                ns("tcp_established_ipip"),
                ns("tcp_established_gue"),
            );
            table.row(vec![
                backends.to_string(),
                if object.is_empty() {
                    "built-in".into()
                } else {
                    object[1..].to_string()
                },
                num(l2, 1),
                num(ipip, 1),
                num(gue, 1),
                num(ipip / l2, 2),
                num(gue / l2, 2),
            ]);
        }
    }
    table.note("Figures, not limits: ratios of one run on this machine.");
    table
}

/// Leaving by another interface (XDP_REDIRECT) next to XDP_TX, per backend count: net
/// ns of the loop and of `repeat`, and their ratios.
fn egress_ratios(net: &[(String, usize, f64, f64, f64)]) -> Table {
    let mut table = Table::new(
        "Several interfaces (established TCP, net ns, medians)",
        &[
            "backends",
            "way",
            "one nic (tx)",
            "two, same (tx)",
            "two, other (redirect)",
            "redirect / tx",
            "two tx / one",
        ],
    );
    let mut counts: Vec<usize> = net.iter().map(|r| r.1).collect();
    counts.dedup();
    for backends in counts {
        for (way, pick) in [("loop kernel", Way::Loop), ("repeat", Way::Repeat)] {
            let ns = |case: &str| net_ns(net, case, backends, pick);
            let (one, same, other) = (
                ns("tcp_established"),
                ns("tcp_established_2nic_tx"),
                ns("tcp_established_redirect"),
            );
            table.row(vec![
                backends.to_string(),
                way.into(),
                num(one, 1),
                num(same, 1),
                num(other, 1),
                num(other / same, 2),
                num(same / one, 2),
            ]);
        }
    }
    table.note(
        "The program's own cost: a test run returns XDP_REDIRECT without sending the frame, \
         so the device's transmit (ndo_xdp_xmit, the DEVMAP's bulk queue) is not in these \
         figures. Figures, not limits: ratios of one run on this machine.",
    );
    table
}

/// One `repeat = n` call: (return value, kernel ns per run, wall ns per run).
pub fn run_repeat(program: &Xdp, frame: &[u8], n: u32) -> Result<(u32, f64, f64)> {
    let start = Instant::now();
    let r = program
        .test_run(TestRunOptions {
            data_in: Some(frame),
            repeat: n,
            ..TestRunOptions::default()
        })
        .context("BPF_PROG_TEST_RUN")?;
    let wall = start.elapsed().as_nanos() as f64 / n as f64;
    Ok((r.return_value, r.duration.as_nanos() as f64, wall))
}

/// `calls` calls with `repeat = 1` of each of `frames` in turn: (wall ns per call, kernel
/// ns per run of the whole sequence). With `next_source`, every call gets a new IPv4
/// source address and port first.
fn run_loop(
    program: &Xdp,
    frames: &mut [Vec<u8>],
    calls: u32,
    mut next_source: Option<&mut u64>,
    flows: u32,
) -> Result<(f64, f64)> {
    let mut kernel_ns = 0u128;
    let start = Instant::now();
    for call in 0..calls {
        let source = next_source.as_deref_mut().map(|k| {
            *k += 1;
            let port = 1024 + (*k % 64000) as u16;
            let host = 0x0a02_0000u32 + (*k / 64000) as u32; // 10.2.0.0 and up
            (port, host)
        });
        for frame in frames.iter_mut() {
            if flows > 1 {
                set_src_port(frame, FLOWS_BASE_PORT + (call % flows) as u16);
            }
            if let Some((port, host)) = source {
                frame[V4_SRC_PORT_AT..V4_SRC_PORT_AT + 2].copy_from_slice(&port.to_be_bytes());
                frame[V4_SRC_ADDR_AT..V4_SRC_ADDR_AT + 4].copy_from_slice(&host.to_be_bytes());
            }
            let r = program
                .test_run(TestRunOptions {
                    data_in: Some(frame),
                    repeat: 1,
                    ..TestRunOptions::default()
                })
                .context("BPF_PROG_TEST_RUN")?;
            kernel_ns += r.duration.as_nanos();
        }
    }
    let wall = start.elapsed().as_nanos() as f64 / calls as f64;
    Ok((wall, kernel_ns as f64 / calls as f64))
}

#[derive(Default)]
struct Samples {
    repeat_kernel: Vec<f64>,
    repeat_wall: Vec<f64>,
    loop_wall: Vec<f64>,
    loop_kernel: Vec<f64>,
}

/// Counters of the program that changed between two reads, by name.
fn changed(before: &[u64], after: &[u64]) -> Value {
    let mut m = serde_json::Map::new();
    for (i, name) in stat::NAMES.iter().enumerate() {
        let (b, a) = (before.get(i).copied(), after.get(i).copied());
        if let (Some(b), Some(a)) = (b, a)
            && a != b
        {
            m.insert(name.to_string(), json!(a - b));
        }
    }
    Value::Object(m)
}

pub struct Results {
    pub tables: Vec<Table>,
    pub json: Value,
    /// (case, backends) -> (net ns repeat, net ns loop-kernel, net ns loop-wall).
    pub net: Vec<(String, usize, f64, f64, f64)>,
}

pub fn run(opts: &Options) -> Result<Results> {
    let mut pass_ebpf = load_program("xdp_pass")?;
    let mut out_json = Vec::new();
    let mut net_all = Vec::new();
    let mut table = Table::new(
        "Per packet through BPF_PROG_TEST_RUN (ns, medians)",
        &[
            "case",
            "backends",
            "repeat raw",
            "repeat net",
            "loop kernel raw",
            "loop kernel net",
            "loop wall/call",
            "loop wall net",
        ],
    );
    for &backends in &opts.backend_counts {
        eprintln!("bench: per packet, {backends} backend(s)...");
        let cases = chosen_cases(&opts.cases)?;
        // The same tables twice: without `[cluster]`, and with it (the export ring read
        // by a thread of its own, as the agent reads it, so that it never fills). The
        // second instance and its reader only when a chosen case runs there: the reader
        // wakes every few milliseconds, which the other cases should not share.
        let vips = config_text(backends) + &tunnel_vips(VIP4, backends);
        // By `Nics::instance`: plain, [cluster], two interfaces (TX), two (redirect);
        // each loaded only when a chosen case runs there.
        let wanted = |i: usize| cases.iter().any(|c| c.nics.instance(c.cluster) == i);
        let mut insts: Vec<Option<Instance>> = Vec::new();
        let mut exports = None;
        insts.push(wanted(0).then(|| Instance::load(&vips)).transpose()?);
        insts.push(None);
        if wanted(1) {
            // `[cluster]` refuses `stable_slots` (peers learn flows from entries): there
            // "tcp4s" is a plain VIP, and no case of this instance sends to it.
            let plain = vips.replace("stable_slots = true\n", "");
            let mut inst = Instance::load(&(plain + CLUSTER))?;
            exports = Some(ExportReader::start(inst.dataplane.take_export()?.0));
            insts[1] = Some(inst);
        }
        for egress in [0, 1] {
            let inst = if wanted(2 + egress as usize) {
                let mut inst = Instance::load_with(&vips, |o| o.egress_count = 2)?;
                two_nics(&mut inst, egress)?;
                Some(inst)
            } else {
                None
            };
            insts.push(inst);
        }
        for (name, path) in &opts.variants {
            if !wanted(0) {
                insts.push(None);
                continue;
            }
            let object = std::fs::read(path)
                .with_context(|| format!("--variant {name}: cannot read {}", path.display()))?;
            let inst = Instance::load_object(&vips, &object, |_| {})
                .with_context(|| format!("--variant {name}: {}", path.display()))?;
            insts.push(Some(inst));
        }
        for (i, inst) in insts.iter_mut().enumerate() {
            if let Some(inst) = inst {
                let one_nic = ![Nics::TwoSame, Nics::TwoOther]
                    .iter()
                    .any(|nics| nics.instance(false) == i);
                make_tunnels(inst, [2, 0, 0, 0, 0, 0xfe], one_nic)?;
            }
        }
        let runs = runs(&cases, &opts.variants);
        for run in &runs {
            let case = run.case;
            let inst = insts[run.inst].as_mut().expect("loaded for its cases");
            if let Some(p) = &case.prime {
                let program = inst.dataplane.program_mut()?;
                // The flow's first packet, then its frame once: the second packet is
                // the one that enters the flow into the connection table.
                let (mut p, mut second) = (p.clone(), case.frame.clone());
                for flow in 0..case.flows {
                    if case.flows > 1 {
                        set_src_port(&mut p, FLOWS_BASE_PORT + flow as u16);
                        set_src_port(&mut second, FLOWS_BASE_PORT + flow as u16);
                    }
                    run_repeat(program, &p, 1)?;
                    run_repeat(program, &second, 1)?;
                }
            }
        }
        let mut lb: Vec<Samples> = runs.iter().map(|_| Samples::default()).collect();
        let mut pass: Vec<Samples> = runs.iter().map(|_| Samples::default()).collect();
        let mut counters_json = Vec::new();
        let mut source_counter = 0u64;
        for round in 0..opts.rounds {
            for (ci, run) in runs.iter().enumerate() {
                let case = run.case;
                let inst = insts[run.inst].as_mut().expect("loaded for its cases");
                let repeat = if case.once_per_call { 1 } else { opts.repeat };
                let pass_prog = xdp(&mut pass_ebpf, "xdp_pass")?;
                let (rv, k, w) = run_repeat(pass_prog, &case.frame, repeat)?;
                ensure!(rv == XDP_PASS, "xdp_pass returned {rv}");
                pass[ci].repeat_kernel.push(k);
                pass[ci].repeat_wall.push(w);

                let before = inst.dataplane.counters(&[], &[])?.outcomes;
                let program = inst.dataplane.program_mut()?;
                let (rv, k, w) = run_repeat(program, &case.frame, repeat)?;
                if rv != case.action {
                    bail!(
                        "{} with {backends} backends: lb_xdp returned {rv}, expected {}",
                        run.name,
                        case.action
                    );
                }
                lb[ci].repeat_kernel.push(k);
                lb[ci].repeat_wall.push(w);
                if round == 0 {
                    let after = inst.dataplane.counters(&[], &[])?.outcomes;
                    counters_json.push(json!({
                        "case": run.name,
                        "repeat": opts.repeat,
                        "counters": changed(&before, &after),
                    }));
                }

                // The same frames change (for new flows) in both programs' loops alike.
                let mut f = case.frames();
                let mut pass_source = source_counter;
                let pass_prog = xdp(&mut pass_ebpf, "xdp_pass")?;
                let (w, k) = run_loop(
                    pass_prog,
                    &mut f,
                    opts.loop_calls,
                    case.new_source_per_call.then_some(&mut pass_source),
                    case.flows,
                )?;
                pass[ci].loop_wall.push(w);
                pass[ci].loop_kernel.push(k);

                let mut f = case.frames();
                let before = inst.dataplane.counters(&[], &[])?.outcomes;
                let program = inst.dataplane.program_mut()?;
                let (w, k) = run_loop(
                    program,
                    &mut f,
                    opts.loop_calls,
                    case.new_source_per_call.then_some(&mut source_counter),
                    case.flows,
                )?;
                lb[ci].loop_wall.push(w);
                lb[ci].loop_kernel.push(k);
                if round == 0 {
                    let after = inst.dataplane.counters(&[], &[])?.outcomes;
                    counters_json.push(json!({
                        "case": run.name,
                        "loop_calls": opts.loop_calls,
                        "counters": changed(&before, &after),
                    }));
                }
            }
        }
        for (ci, run) in runs.iter().enumerate() {
            let case = run.case;
            let (l, p) = (&lb[ci], &pass[ci]);
            let net = |a: &[f64], b: &[f64]| -> Vec<f64> {
                a.iter().zip(b).map(|(x, y)| x - y).collect()
            };
            let rk_net = net(&l.repeat_kernel, &p.repeat_kernel);
            let lk_net = net(&l.loop_kernel, &p.loop_kernel);
            let lw_net = net(&l.loop_wall, &p.loop_wall);
            // Under repeat the many-flows case is one flow, a sequence its first frame,
            // and an encapsulated case ran once: shown in the JSON only.
            let one_flow = |x: f64| {
                if case.flows > 1 || !case.then.is_empty() || case.once_per_call {
                    f64::NAN
                } else {
                    x
                }
            };
            table.row(vec![
                run.name.clone(),
                backends.to_string(),
                num(one_flow(median(&l.repeat_kernel)), 1),
                num(one_flow(median(&rk_net)), 1),
                num(median(&l.loop_kernel), 1),
                num(median(&lk_net), 1),
                num(median(&l.loop_wall), 0),
                num(median(&lw_net), 1),
            ]);
            net_all.push((
                run.name.clone(),
                backends,
                median(&rk_net),
                median(&lk_net),
                median(&lw_net),
            ));
            let stats = |v: &[f64]| {
                let (lo, hi) = range(v);
                json!({ "median": median(v), "min": lo, "max": hi, "rounds": v })
            };
            out_json.push(json!({
                "case": run.name,
                "what": case.what,
                "backends": backends,
                "frame_bytes": case.frame.len(),
                "flows_in_loop": case.flows,
                "repeat": {
                    "n": opts.repeat,
                    "lb_kernel_ns": stats(&l.repeat_kernel),
                    "lb_wall_ns": stats(&l.repeat_wall),
                    "empty_kernel_ns": stats(&p.repeat_kernel),
                    "empty_wall_ns": stats(&p.repeat_wall),
                    "net_kernel_ns": stats(&rk_net),
                },
                "loop": {
                    "calls": opts.loop_calls,
                    "lb_wall_ns_per_call": stats(&l.loop_wall),
                    "lb_kernel_ns_per_run": stats(&l.loop_kernel),
                    "empty_wall_ns_per_call": stats(&p.loop_wall),
                    "empty_kernel_ns_per_run": stats(&p.loop_kernel),
                    "net_kernel_ns": stats(&lk_net),
                    "net_wall_ns": stats(&lw_net),
                },
            }));
        }
        let exported = exports.map_or(0, ExportReader::stop);
        out_json.push(json!({
            "backends": backends,
            "counter_changes": counters_json,
            "cluster_records_read": exported,
        }));
    }
    table.note(format!(
        "{} rounds; repeat = {} per call; loop = {} calls of repeat = 1; net = lb_xdp minus \
         xdp_pass (empty program) of the same round, median over rounds.",
        opts.rounds, opts.repeat, opts.loop_calls
    ));
    table.note(
        "tcp_syn, tcp_handshake, tcp_short_connection: in the loop every call has a new \
         source address and port (a new flow); the handshake and the short connection are \
         per call, 2 and 5 packets. Under repeat the same SYN runs again (no entry either).",
    );
    table.note(
        "tcp_syn_outlier, tcp_handshake_outlier: the same to a VIP with [vip.outlier] \
         (port 83), whose SYN reads its embryonic slot to tell a client's retransmission; \
         other VIPs' SYNs write the slot unread.",
    );
    table.note(
        "*_stable: the same to a VIP with stable_slots (port 84), every slot stable (a \
         fresh table): a TCP packet that is not a SYN goes where its slot says, with no \
         connection-table lookup and no entry.",
    );
    table.note(
        "tcp_handshake_cluster: tcp_handshake on an instance loaded with [cluster]: every \
         new entry is also written to the export ring (read meanwhile by a thread, as the \
         agent reads it); only the loop shows it.",
    );
    table.note(
        "tcp_established_16k_flows: the loop cycles over 16384 established flows (as the \
         veth generator does); the other cases send one flow, always hot in the cache.",
    );
    table.note(
        "tcp_established_ipip / _gue: the same established ACK as tcp_established, to a VIP \
         whose backends are reached through a tunnel (the program adds the outer headers); \
         measured by the loop only, since under repeat the program would see its own \
         encapsulated output.",
    );
    for (name, path) in &opts.variants {
        table.note(format!(
            "case@{name}: the case on the variant object {} (--variant), alternating with \
             the built-in object in the same rounds.",
            path.display()
        ));
    }
    if let Some(variant) = std::env::var_os("LB_XDP_OBJECT") {
        table.note(format!(
            "lb_xdp: the variant object {} (LB_XDP_OBJECT), not the built-in one.",
            variant.to_string_lossy()
        ));
    }
    let names: Vec<String> = opts.variants.iter().map(|v| v.0.clone()).collect();
    let ratios = tunnel_ratios(&net_all, &names);
    // What a passed frame costs with `next_program` (issue 37), in this run.
    let not_vip = cases().into_iter().find(|c| c.name == "pass_not_vip");
    let (chain, chain_json) = crate::chain::run(opts, &not_vip.expect("case").frame)?;
    let egress = egress_ratios(&net_all);
    Ok(Results {
        tables: vec![table, ratios, egress, chain],
        json: json!({
            "empty_program": "xdp_pass",
            "results": out_json,
            "next_program": chain_json,
        }),
        net: net_all,
    })
}
