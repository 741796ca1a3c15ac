//! Packets per second through a veth pair, in native XDP mode.
//!
//! ```text
//!   gen ns: eth0 (xdp_bench_sink)  <== veth ==>  lb ns: eth0 (lb_xdp, or xdp_mac_swap)
//! ```
//!
//! `xdp_bench_tx` runs with BPF_PROG_TEST_RUN live frames on the gen side: each run
//! writes the frame's Ethernet header again (a wrapped frame's page comes back to the
//! generator's pool with the tunnel's outer headers where the Ethernet header was),
//! rewrites the source port (through the flow count's values) and returns XDP_TX,
//! which sends the frame out of gen's eth0 to the lb side. The program there sends it
//! back (`lb_xdp`: to the backend's MAC, which is gen's; `xdp_mac_swap`: to the
//! sender), and the sink on gen's eth0 counts and drops it. The sink is also what makes native XDP_TX on the lb side
//! work at all: a veth delivers XDP frames only to a peer that has an XDP program.
//! The tunnel cases (TCP to VIPs whose backends are reached by ipip / gue, their next
//! hop gen's MAC) come back wrapped, and the sink counts them the same way.
//!
//! Where the kernel refuses live frames (EPERM, even to root, on some kernels), an
//! AF_PACKET socket on gen's eth0 sends the same frames instead, pre-built one per flow
//! (`generator`): the bench says so loudly, and the report names the generator of every
//! figure. Either way the generator thread is pinned to one CPU, where the veth NAPI
//! of both ends runs too: the Mpps are per core.

use std::net::{IpAddr, Ipv4Addr};
use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, ensure};
use aya::maps::PerCpuArray;
use aya::programs::{TestRun, TestRunAttrs, TestRunOptions, Xdp, XdpMode};
use lb_common::{BENCH_RECEIVED, BENCH_SENT, MAP_BENCH_SINK, stat};
use lb_tests::Netns;
use lb_tests::netns::ip;
use lb_userspace::dataplane::Dataplane;
use serde_json::{Value, json};

use crate::frames::{Frame, L4, TCP_ACK};
use crate::generator::{self, Generator, PacketGen};
use crate::packet::{GUE_PORT_VIP, IPIP_PORT, load_program, make_tunnels, tunnel_vips, xdp};
use crate::report::{Table, median, num, range};
use lb_tests::program::Instance;

const GEN_MAC: [u8; 6] = [0x02, 0xbe, 0, 0, 0, 0x01];
const LB_MAC: [u8; 6] = [0x02, 0xbe, 0, 0, 0, 0x02];
const IFACE: &str = "eth0";
const VIP: Ipv4Addr = Ipv4Addr::new(10, 200, 0, 100);
const BACKENDS: usize = 10;
/// The tunnel cases' names: TCP to a VIP whose backends are reached by ipip / gue (the
/// frames leave wrapped, 20 / 28 bytes longer).
pub const TCP_IPIP: &str = "tcp ipip";
pub const TCP_GUE: &str = "tcp gue";

pub struct Options {
    pub rounds: usize,
    /// Frames per run.
    pub frames: u32,
    /// Live-frame batch size (the kernel's default is 64; at most 256).
    pub batch: u32,
    /// Flow counts the generator cycles through, one set of rounds each.
    pub flows: Vec<u64>,
    /// The generator to use; None: live frames where the kernel allows them, else
    /// AF_PACKET.
    pub generator: Option<Generator>,
}

fn mac(m: [u8; 6]) -> String {
    m.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// The balancer's config: TCP 80 and UDP 53 on the VIP, `BACKENDS` backends that all
/// have gen's MAC (so everything comes back to the sink), and the tunnel VIPs (TCP 81
/// and 82, made ipip and gue by `make_tunnels`). Defaults otherwise.
fn config_text() -> String {
    let mut t = format!("[dataplane]\ninterface = \"{IFACE}\"\n[control]\nmetrics = \"off\"\n");
    for (name, port, proto) in [("tcp", 80, "tcp"), ("udp", 53, "udp")] {
        t += &format!(
            "\n[[vip]]\nname = \"{name}\"\naddress = \"{VIP}\"\nport = {port}\n\
             protocol = \"{proto}\"\n[vip.health]\nkind = \"none\"\n"
        );
        for i in 0..BACKENDS {
            t += &format!(
                "[[vip.backend]]\naddress = \"10.200.1.{}\"\nmac = \"{}\"\n",
                i + 1,
                mac(GEN_MAC)
            );
        }
    }
    t + &tunnel_vips(VIP, BACKENDS)
}

fn sum(map: &PerCpuArray<aya::maps::MapData, u64>, index: u32) -> Result<u64> {
    Ok(map.get(&index, 0)?.iter().sum())
}

/// Non-zero `ethtool -S` counters of `IFACE` in `ns`.
fn ethtool_stats(ns: &Netns) -> Value {
    let text = ns.exec("ethtool", &["-S", IFACE]).unwrap_or_default();
    let mut m = serde_json::Map::new();
    for line in text.lines() {
        if let Some((k, v)) = line.split_once(':')
            && let Ok(v) = v.trim().parse::<u64>()
            && v != 0
        {
            m.insert(k.trim().to_string(), json!(v));
        }
    }
    Value::Object(m)
}

struct Run {
    sent: u64,
    received: u64,
    seconds: f64,
    lb_tx: Option<u64>,
    /// Frames the AF_PACKET generator offered that the veth refused (ring full).
    refused: u64,
}

pub struct Results {
    pub tables: Vec<Table>,
    pub json: Value,
    /// (protocol, flows, lb Mpps, baseline Mpps, ratio).
    pub ratios: Vec<(String, u64, f64, f64, f64)>,
    /// The generator(s) that made the figures.
    pub generator: String,
}

pub fn run(opts: &Options) -> Result<Results> {
    let gen_ns = Netns::new("bgen")?;
    let lb_ns = Netns::new("blb")?;
    for ns in [&gen_ns, &lb_ns] {
        // No IPv6 on the pair: nothing but the benchmark's frames reaches the sink.
        ns.sysctl("net.ipv6.conf.all.disable_ipv6", "1")?;
        ns.sysctl("net.ipv6.conf.default.disable_ipv6", "1")?;
    }
    ip(&[
        "-n",
        gen_ns.name(),
        "link",
        "add",
        IFACE,
        "address",
        &mac(GEN_MAC),
        "type",
        "veth",
        "peer",
        "name",
        IFACE,
        "address",
        &mac(LB_MAC),
        "netns",
        lb_ns.name(),
    ])?;
    ip(&["-n", gen_ns.name(), "link", "set", IFACE, "up"])?;
    ip(&["-n", lb_ns.name(), "link", "set", IFACE, "up"])?;

    let gen_ifindex = gen_ns.run(|| nix::net::if_::if_nametoindex(IFACE))??;
    let mut lb = Instance::load(&config_text())?;
    // The tunnels' next hop is gen too: the sink counts the wrapped frames.
    make_tunnels(&mut lb, GEN_MAC, true)?;
    let mut swap_ebpf = load_program("xdp_mac_swap")?;
    let mut runs: Vec<Value> = Vec::new();
    let mut table = Table::new(
        "Through a veth pair, native XDP (Mpps received back on one core, medians)",
        &[
            "traffic",
            "generator",
            "lb_xdp Mpps",
            "lb loss",
            "mac_swap Mpps",
            "mac_swap loss",
            "lb / baseline",
        ],
    );
    let mut ratios = Vec::new();
    let mut summary = Vec::new();
    let mut generators: Vec<Generator> = Vec::new();
    for &flows in &opts.flows {
        let mut bed = Bed {
            gen_ns: &gen_ns,
            lb_ns: &lb_ns,
            gen_ifindex,
            lb: &mut lb,
            swap_ebpf: &mut swap_ebpf,
            generator: generators.first().copied().or(opts.generator),
        };
        let measured = measure(opts, flows, &mut bed)?;
        runs.extend(measured.runs);
        for row in measured.rows {
            table.row(row);
        }
        ratios.extend(measured.ratios);
        summary.extend(measured.summary);
        if !generators.contains(&measured.generator) {
            generators.push(measured.generator);
        }
    }
    let generator = generators
        .iter()
        .map(|g| g.name())
        .collect::<Vec<_>>()
        .join(" + ");
    let lb_counters = lb.dataplane.counters(&[], &[])?.outcomes;
    let lb_counters: serde_json::Map<String, Value> = stat::NAMES
        .iter()
        .zip(&lb_counters)
        .filter(|(_, v)| **v != 0)
        .map(|(k, v)| (k.to_string(), json!(v)))
        .collect();
    let ethtool = json!({ "gen": ethtool_stats(&gen_ns), "lb": ethtool_stats(&lb_ns) });
    table.note(format!(
        "{} rounds of {} frames per program, protocol and flow count (live-frame batch {}), \
         lb and baseline alternating; ratio = median over rounds of lb / baseline of that \
         round. The generator steps the source port through the flows, so every frame is \
         another flow than the one before.",
        opts.rounds, opts.frames, opts.batch
    ));
    table.note(
        "The generator thread is pinned to one CPU; the veth NAPI of both ends runs in its \
         softirqs there, so generator and both programs share that core: Mpps = frames \
         received by the sink / duration of the generator's sending.",
    );
    if generators.contains(&Generator::AfPacket) {
        table.note(
            "THE KERNEL REFUSED LIVE FRAMES (BPF_PROG_TEST_RUN with \
             BPF_F_TEST_XDP_LIVE_FRAMES: EPERM): rows marked \"AF_PACKET sendmmsg\" were made \
             by an AF_PACKET socket on gen's eth0 (sendmmsg of 256, PACKET_QDISC_BYPASS, one \
             pre-built frame per flow). The sender's own cost per frame (an skb each) is \
             higher than live frames', so these Mpps are lower than live frames would show. \
             lb and the baseline had the same generator in the same rounds, so their ratio \
             compares like with like; but the sender's share of each frame's cost differs \
             between generators: compare AF_PACKET ratios with AF_PACKET ratios only. \
             Frames the full veth ring refused are in the JSON (\"refused\").",
        );
    }
    drop(lb);
    drop(swap_ebpf);
    let tunnels = tunnel_table(&ratios);
    Ok(Results {
        tables: vec![table, tunnels],
        json: json!({
            "frames_per_run": opts.frames,
            "batch": opts.batch,
            "generator": generator,
            "backends": BACKENDS,
            "summary": summary,
            "runs": runs,
            "lb_counters_total": lb_counters,
            "ethtool_nonzero_total": ethtool,
        }),
        ratios,
        generator,
    })
}

/// The veth pair and the programs on it.
struct Bed<'a> {
    gen_ns: &'a Netns,
    lb_ns: &'a Netns,
    gen_ifindex: u32,
    lb: &'a mut Instance,
    swap_ebpf: &'a mut aya::Ebpf,
    /// The generator the first flow count found (None: try live frames).
    generator: Option<Generator>,
}

/// What the rounds for one flow count measured.
struct Measured {
    runs: Vec<Value>,
    /// Table rows, one per protocol.
    rows: Vec<Vec<String>>,
    /// (protocol, flows, lb Mpps, baseline Mpps, ratio).
    ratios: Vec<(String, u64, f64, f64, f64)>,
    summary: Vec<Value>,
    generator: Generator,
}

/// Rounds of lb against the baseline with the generator cycling through `flows` flows.
fn measure(opts: &Options, flows: u64, bed: &mut Bed) -> Result<Measured> {
    let Bed {
        gen_ns,
        lb_ns,
        gen_ifindex,
        lb,
        swap_ebpf,
        generator: known,
    } = bed;
    let (gen_ns, lb_ns, gen_ifindex) = (*gen_ns, *lb_ns, *gen_ifindex);
    // Generator and sink share one object instance, so one BENCH_SINK for both counts.
    // The Ethernet header of every frame below (IPv4).
    let mut eth = [0u8; 14];
    eth[..6].copy_from_slice(&LB_MAC);
    eth[6..12].copy_from_slice(&GEN_MAC);
    eth[12..].copy_from_slice(&0x0800u16.to_be_bytes());
    let mut gen_ebpf = lb_tests::program::load_test_program_with_eth("xdp_bench_sink", flows, eth)?;
    {
        let tx: &mut Xdp = xdp(&mut gen_ebpf, "xdp_bench_tx")?;
        tx.load().context("load xdp_bench_tx")?;
    }
    let sink_link = {
        let sink = xdp(&mut gen_ebpf, "xdp_bench_sink")?;
        gen_ns.run(|| sink.attach(IFACE, XdpMode::Driver))?
    }
    .context("attach xdp_bench_sink (native) on gen's eth0")?;
    let counters: PerCpuArray<_, u64> = PerCpuArray::try_from(
        gen_ebpf
            .take_map(MAP_BENCH_SINK)
            .ok_or_else(|| anyhow!("no map {MAP_BENCH_SINK}"))?,
    )?;

    let frame = |l4: L4, sport: u16, dport: u16| {
        Frame {
            dst_mac: LB_MAC,
            src_mac: GEN_MAC,
            src: IpAddr::from(Ipv4Addr::new(10, 200, 0, 1)),
            dst: IpAddr::from(VIP),
            sport,
            dport,
            l4,
        }
        .bytes()
    };
    let ack = L4::Tcp { flags: TCP_ACK };
    let protos = [
        ("tcp", ack, 80),
        ("udp", L4::Udp, 53),
        (TCP_IPIP, ack, IPIP_PORT),
        (TCP_GUE, ack, GUE_PORT_VIP),
    ];
    // What live frames start from: `xdp_bench_tx` steps the source port from there.
    let live_frames: Vec<Vec<u8>> = protos
        .iter()
        .map(|&(_, l4, dport)| frame(l4, 1024, dport))
        .collect();

    // xdp_md: data, data_end, data_meta, ingress_ifindex, rx_queue_index, egress_ifindex.
    let ctx_for = |len: usize| -> Vec<u8> {
        [0u32, len as u32, 0, gen_ifindex, 0, 0]
            .iter()
            .flat_map(|v| v.to_ne_bytes())
            .collect()
    };
    // `repeat` live frames of `frame` on one core; returns the call's duration.
    let live = |frame: &[u8], repeat: u32| -> Result<f64> {
        let ctx = ctx_for(frame.len());
        let tx = gen_ebpf
            .program("xdp_bench_tx")
            .ok_or_else(|| anyhow!("no xdp_bench_tx"))?;
        let tx: &Xdp = tx.try_into()?;
        gen_ns.run(|| -> Result<f64> {
            generator::pin_to_this_cpu()?;
            let start = Instant::now();
            tx.test_run(TestRunOptions {
                data_in: Some(frame),
                ctx_in: Some(&ctx),
                repeat,
                attrs: TestRunAttrs::new().xdp_live_frames(opts.batch),
                ..TestRunOptions::default()
            })
            .context("BPF_PROG_TEST_RUN live frames")?;
            Ok(start.elapsed().as_secs_f64())
        })?
    };

    // Live frames where the kernel allows them: one frame tells, at the first flow count
    // (the sink counts it before any round starts). Unless the caller chose.
    let probe = match known {
        Some(g) => Ok(*g),
        None => live(&live_frames[0], 1).map(|_| Generator::LiveFrames),
    };
    let generator = match probe {
        Ok(g) => g,
        Err(e) if generator::is_eperm(&e) => {
            eprintln!(
                "bench: WARNING: the kernel refuses live frames ({e:#}): the veth section \
                 sends with an AF_PACKET socket (sendmmsg, PACKET_QDISC_BYPASS) instead; \
                 its Mpps are lower than live frames', and its ratios to the baseline are \
                 comparable with other AF_PACKET runs only"
            );
            Generator::AfPacket
        }
        Err(e) => return Err(e),
    };
    let mut out = Measured {
        runs: Vec::new(),
        rows: Vec::new(),
        ratios: Vec::new(),
        summary: Vec::new(),
        generator,
    };
    // For AF_PACKET: its socket, and one pre-built frame per flow and protocol (as many
    // flows as `xdp_bench_tx` cycles through).
    let (packet_gen, flow_frames) = match generator {
        Generator::LiveFrames => (None, Vec::new()),
        Generator::AfPacket => {
            let sender = gen_ns.run(|| PacketGen::open(IFACE))??;
            let ports = 1024..1024 + flows.clamp(1, 64512) as u16;
            let frames: Vec<Vec<Vec<u8>>> = protos
                .iter()
                .map(|&(_, l4, dport)| ports.clone().map(|p| frame(l4, p, dport)).collect())
                .collect();
            (Some(sender), frames)
        }
    };

    // One run of protocol `pi` with the chosen generator.
    let send = |pi: usize| -> Result<Run> {
        let (sent0, recv0) = (sum(&counters, BENCH_SENT)?, sum(&counters, BENCH_RECEIVED)?);
        let (seconds, accepted, refused) = match &packet_gen {
            None => (live(&live_frames[pi], opts.frames)?, None, 0),
            Some(sender) => {
                let sent = gen_ns.run(|| {
                    generator::pin_to_this_cpu()?;
                    sender.send(&flow_frames[pi], opts.frames.into())
                })??;
                (sent.seconds, Some(sent.accepted), sent.refused)
            }
        };
        // Frames still in the veth rings land within microseconds.
        sleep(Duration::from_millis(100));
        let sent = match accepted {
            Some(n) => n,
            None => sum(&counters, BENCH_SENT)? - sent0,
        };
        Ok(Run {
            sent,
            received: sum(&counters, BENCH_RECEIVED)? - recv0,
            seconds,
            lb_tx: None,
            refused,
        })
    };
    // [proto][0 = lb, 1 = baseline] -> (received Mpps, sent Mpps, loss) per round.
    let mut mpps: Vec<[Vec<f64>; 2]> = protos.iter().map(|_| [vec![], vec![]]).collect();
    let mut sent_mpps: Vec<[Vec<f64>; 2]> = protos.iter().map(|_| [vec![], vec![]]).collect();
    let mut loss: Vec<[Vec<f64>; 2]> = protos.iter().map(|_| [vec![], vec![]]).collect();
    for round in 0..opts.rounds {
        eprintln!(
            "bench: veth pps, {flows} flows, round {}/{}...",
            round + 1,
            opts.rounds
        );
        for (pi, (proto, ..)) in protos.iter().enumerate() {
            // Alternate which program goes first.
            let order: [usize; 2] = if round % 2 == 0 { [0, 1] } else { [1, 0] };
            for which in order {
                let run = if which == 0 {
                    let program = lb.dataplane.program_mut()?;
                    let link = lb_ns.run(|| program.attach(IFACE, XdpMode::Driver))??;
                    let tx_before = lb.dataplane.forwarded()?;
                    let run = send(pi);
                    let tx_after = lb.dataplane.forwarded()?;
                    lb.dataplane.program_mut()?.detach(link)?;
                    let mut run = run?;
                    run.lb_tx = Some(tx_after - tx_before);
                    run
                } else {
                    let program = xdp(swap_ebpf, "xdp_mac_swap")?;
                    let link = lb_ns.run(|| program.attach(IFACE, XdpMode::Driver))??;
                    let run = send(pi);
                    xdp(swap_ebpf, "xdp_mac_swap")?.detach(link)?;
                    run?
                };
                ensure!(run.sent > 0, "the generator sent nothing");
                let recv = run.received as f64 / run.seconds / 1e6;
                let sent = run.sent as f64 / run.seconds / 1e6;
                let lost = 1.0 - run.received as f64 / run.sent as f64;
                mpps[pi][which].push(recv);
                sent_mpps[pi][which].push(sent);
                loss[pi][which].push(lost);
                out.runs.push(json!({
                    "round": round,
                    "flows": flows,
                    "proto": proto,
                    "program": if which == 0 { "lb_xdp" } else { "xdp_mac_swap" },
                    "generator": generator.name(),
                    "refused": run.refused,
                    "sent": run.sent,
                    "received": run.received,
                    "seconds": run.seconds,
                    "lb_xdp_tx": run.lb_tx,
                    "received_mpps": recv,
                    "sent_mpps": sent,
                    "loss": lost,
                }));
            }
        }
    }
    for (pi, (proto, ..)) in protos.iter().enumerate() {
        let r: Vec<f64> = mpps[pi][0]
            .iter()
            .zip(&mpps[pi][1])
            .map(|(a, b)| a / b)
            .collect();
        let (lb_m, base_m) = (median(&mpps[pi][0]), median(&mpps[pi][1]));
        let ratio = median(&r);
        out.rows.push(vec![
            format!("{proto} ({flows} flows)"),
            generator.name().to_string(),
            num(lb_m, 2),
            format!("{}%", num(median(&loss[pi][0]) * 100.0, 2)),
            num(base_m, 2),
            format!("{}%", num(median(&loss[pi][1]) * 100.0, 2)),
            num(ratio, 3),
        ]);
        out.ratios
            .push((proto.to_string(), flows, lb_m, base_m, ratio));
        let (lo, hi) = range(&r);
        out.summary.push(json!({
            "proto": proto,
            "flows": flows,
            "generator": generator.name(),
            "lb_received_mpps": median(&mpps[pi][0]),
            "lb_sent_mpps": median(&sent_mpps[pi][0]),
            "lb_loss": median(&loss[pi][0]),
            "baseline_received_mpps": median(&mpps[pi][1]),
            "baseline_sent_mpps": median(&sent_mpps[pi][1]),
            "baseline_loss": median(&loss[pi][1]),
            "ratio_median_of_rounds": ratio,
            "ratio_min": lo,
            "ratio_max": hi,
        }));
    }
    xdp(&mut gen_ebpf, "xdp_bench_sink")?.detach(sink_link)?;
    Ok(out)
}

/// The tunnel cases next to L2 TCP, per flow count: each against the MAC-swap baseline
/// of its own rounds, and against L2 (the quotient of those ratios).
fn tunnel_table(ratios: &[(String, u64, f64, f64, f64)]) -> Table {
    let mut table = Table::new(
        "Tunnel DSR through the veth pair (TCP, lb / MAC-swap baseline, medians)",
        &[
            "flows",
            "l2",
            "ipip",
            "gue",
            "ipip Mpps",
            "gue Mpps",
            "ipip / l2",
            "gue / l2",
        ],
    );
    let mut counts: Vec<u64> = ratios.iter().map(|r| r.1).collect();
    counts.dedup();
    for flows in counts {
        let find = |proto: &str| ratios.iter().find(|r| r.0 == proto && r.1 == flows);
        let ratio = |proto: &str| find(proto).map_or(f64::NAN, |r| r.4);
        let mpps = |proto: &str| find(proto).map_or(f64::NAN, |r| r.2);
        let (l2, ipip, gue) = (ratio("tcp"), ratio(TCP_IPIP), ratio(TCP_GUE));
        table.row(vec![
            flows.to_string(),
            num(l2, 3),
            num(ipip, 3),
            num(gue, 3),
            num(mpps(TCP_IPIP), 2),
            num(mpps(TCP_GUE), 2),
            num(ipip / l2, 2),
            num(gue / l2, 2),
        ]);
    }
    table.note(
        "The wrapped frames (20 / 28 bytes longer) go back to the sink like the L2 ones; \
         the baseline swaps the MACs of the same frames. Figures, not limits.",
    );
    table
}
