//! `bench`: the benchmarks behind `cargo xtask bench` (issue 8). Reports figures, never
//! asserts a time.
//!
//! 1. per packet through BPF_PROG_TEST_RUN (`packet`), raw and net of the empty program;
//! 2. packets per second through a veth pair in native mode, against a bare MAC swap
//!    (`veth`);
//! 3. requests with wrk in the namespace lab against lb, HAProxy and one backend
//!    (`requests`);
//! 4. control plane: Maglev build, table switch, health failure to switch, agent memory
//!    (`control`);
//! 5. a node joining a cluster: the bulk transfer's rate and its cost to the answering
//!    node (`transfer`).
//!
//! Prints tables (text) and writes the figures as JSON, plus the tables as markdown next
//! to it. Needs root; traffic only goes to namespaces it creates, and every namespace,
//! server and agent is removed by a guard, also on error or Ctrl-C.

mod chain;
mod control;
mod frames;
mod generator;
mod openloop;
mod packet;
mod procs;
mod report;
mod requests;
mod transfer;
mod veth;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use lb_tests::{Health, Lab, LabOptions, Protocol, XdpMode};
use serde_json::{Value, json};

use crate::report::{Machine, Table, num};

#[derive(Parser, Debug)]
#[command(about = "lb benchmarks: per packet, veth pps, requests, control plane")]
struct Args {
    /// The `lb` binary (default: $LB_BIN, else the newest of target/{release,debug}/lb).
    #[arg(long)]
    lb_bin: Option<PathBuf>,
    /// Where to write the JSON (the markdown tables go next to it, as .md).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Sections to run, comma-separated: packet, veth, requests, control, transfer.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "packet,veth,requests,control,transfer"
    )]
    only: Vec<String>,
    /// Per-packet cases to run, comma-separated (default: all), e.g.
    /// `tcp_syn,tcp_established`: fewer cases, more runs of them in the same time.
    #[arg(long, value_delimiter = ',')]
    cases: Vec<String>,
    /// A variant of the `lb_xdp` object, as NAME=PATH (repeatable): the per-packet cases
    /// of the plain instance run on it too, alternating with the built-in object in the
    /// same rounds, reported as `case@NAME` (taking a change apart in one run).
    #[arg(long, value_parser = packet::parse_variant)]
    variant: Vec<(String, PathBuf)>,
    /// Fewer and shorter rounds: checks that everything runs, figures are rough.
    #[arg(long)]
    quick: bool,
    /// The veth section's packet generator (default: live frames where the kernel
    /// allows them, else af-packet, with a warning).
    #[arg(long, value_enum)]
    veth_generator: Option<generator::Generator>,
    /// Seconds per wrk run.
    #[arg(long)]
    wrk_seconds: Option<u32>,
    /// wrk rounds (each: every target in both modes).
    #[arg(long)]
    wrk_rounds: Option<usize>,
}

static CANCELLED: AtomicBool = AtomicBool::new(false);

/// Fails once Ctrl-C was pressed, so the guards tear everything down on the way out.
pub fn check_cancelled() -> Result<()> {
    if CANCELLED.load(Ordering::SeqCst) {
        bail!("interrupted");
    }
    Ok(())
}

fn main() -> ExitCode {
    let args = Args::parse();
    if let Err(e) = ctrlc::set_handler(|| {
        if !CANCELLED.swap(true, Ordering::SeqCst) {
            eprintln!("\nCtrl-C: stopping after the current run, then tearing down...");
        }
    }) {
        eprintln!("error: cannot handle Ctrl-C: {e}");
        return ExitCode::FAILURE;
    }
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bench: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

struct Goal {
    what: String,
    measured: String,
    target: String,
    met: Option<bool>,
}

fn run(args: &Args) -> Result<()> {
    let started = Instant::now();
    if !nix::unistd::geteuid().is_root() {
        bail!("the benchmarks need root (BPF_PROG_TEST_RUN, network namespaces, XDP)");
    }
    lb_tests::ensure_bpffs().map_err(anyhow::Error::msg)?;
    if lb_userspace::EBPF_OBJECT.is_empty() || lb_tests::program::TEST_OBJECT.is_empty() {
        bail!("the eBPF objects are empty (built with AYA_BUILD_SKIP=1?)");
    }
    let sections: Vec<&str> = args.only.iter().map(String::as_str).collect();
    for s in &sections {
        if !["packet", "veth", "requests", "control", "transfer"].contains(s) {
            bail!("unknown section {s:?} (packet, veth, requests, control, transfer)");
        }
    }
    let wants = |s: &str| sections.contains(&s);
    let out = args.out.clone().unwrap_or_else(|| {
        lb_tests::workspace_root()
            .join("target")
            .join("bench")
            .join("results.json")
    });
    let machine = Machine::probe();
    println!("bench: {}", machine.line());
    if machine.cpus <= 2 {
        println!(
            "bench: {} CPU(s): generator, servers and softirqs share them; compare ratios \
             measured in one run, not absolute figures across machines",
            machine.cpus
        );
    }

    let mut tables: Vec<Table> = Vec::new();
    let mut json_sections = serde_json::Map::new();
    // Others' work on a shared machine shows here: kept with the figures.
    let mut load = vec![json!({ "at": "start", "loadavg": loadavg() })];
    let mut goals: Vec<Goal> = Vec::new();

    if wants("packet") {
        let opts = if args.quick {
            packet::Options {
                rounds: 3,
                repeat: 100_000,
                loop_calls: 2_000,
                backend_counts: vec![1, 100, 1000],
                cases: args.cases.clone(),
                variants: args.variant.clone(),
            }
        } else {
            packet::Options {
                rounds: 7,
                repeat: 1_000_000,
                loop_calls: 20_000,
                backend_counts: vec![1, 100, 1000],
                cases: args.cases.clone(),
                variants: args.variant.clone(),
            }
        };
        let r = packet::run(&opts)?;
        packet_goals(&r.net, &mut goals);
        tables.extend(r.tables);
        json_sections.insert("per_packet".into(), r.json);
        load.push(json!({ "at": "after packet", "loadavg": loadavg() }));
        check_cancelled()?;
    }

    if wants("veth") {
        let opts = if args.quick {
            veth::Options {
                rounds: 2,
                frames: 500_000,
                batch: 64,
                flows: vec![256, 16384],
                generator: args.veth_generator,
            }
        } else {
            veth::Options {
                rounds: 5,
                frames: 4_000_000,
                batch: 64,
                flows: vec![256, 16384],
                generator: args.veth_generator,
            }
        };
        let r = veth::run(&opts)?;
        for (proto, flows, lb, base, ratio) in &r.ratios {
            if [veth::TCP_IPIP, veth::TCP_GUE].contains(&proto.as_str()) {
                // Reported in their own table; issue 8's target is for L2 DSR.
                continue;
            }
            // Issue 8 (and 36) ask 0.85x where flows are few; issue 36 0.7x at 16k, where
            // every flow's state is out of the CPU's caches.
            let target = if *flows >= 16384 { 0.7 } else { 0.85 };
            goals.push(Goal {
                what: format!(
                    "veth {proto}, {flows} flows ({}): lb_xdp / xdp_mac_swap Mpps",
                    r.generator
                ),
                measured: format!(
                    "{} ({} / {} Mpps)",
                    num(*ratio, 3),
                    num(*lb, 2),
                    num(*base, 2)
                ),
                target: format!(">= {target}"),
                met: ratio.is_finite().then_some(*ratio >= target),
            });
        }
        tables.extend(r.tables);
        json_sections.insert("veth_pps".into(), r.json);
        load.push(json!({ "at": "after veth", "loadavg": loadavg() }));
        check_cancelled()?;
    }

    if wants("requests") || wants("control") {
        let lb_bin = match &args.lb_bin {
            Some(b) => b.clone(),
            None => lb_tests::find_lb_bin().map_err(anyhow::Error::msg)?,
        };
        println!("bench: agent {}", lb_bin.display());
        let mut lab = build_lab(&lb_bin)?;
        if wants("requests") {
            let opts = requests::Options {
                rounds: args.wrk_rounds.unwrap_or(if args.quick { 1 } else { 3 }),
                keepalive_rounds: if args.quick { 1 } else { 6 },
                seconds: args.wrk_seconds.unwrap_or(if args.quick { 2 } else { 5 }),
                threads: 2,
                connections: 50,
            };
            let dir = lab.dir().join("servers");
            let mut servers = requests::start_servers(&lab, &dir)?;
            for i in 0..lab.backends().len() {
                let addr = lab.backend_addr(i, false).to_string();
                control::wait_backend(
                    &lab,
                    "web",
                    &addr,
                    |b| b["in_table"] == true,
                    Duration::from_secs(20),
                )?;
            }
            let status = || {
                lab.agent()
                    .and_then(|a| a.status_json().ok())
                    .unwrap_or(Value::Null)
            };
            let r = requests::run(&lab, &mut servers, &opts, &status)?;
            request_goals(&r.medians, &r.open_p99_ratios, &mut goals);
            tables.extend(r.tables);
            json_sections.insert("requests".into(), r.json);
            // The same comparison with the program in generic (skb) mode: no veth NAPI
            // ring on the balancer's side of the path.
            check_cancelled()?;
            eprintln!("bench: restarting the agent in generic mode...");
            restart_agent(&mut lab, &lb_bin, XdpMode::Generic)?;
            let status = || {
                lab.agent()
                    .and_then(|a| a.status_json().ok())
                    .unwrap_or(Value::Null)
            };
            let generic_opts = requests::Options {
                keepalive_rounds: if args.quick { 1 } else { 4 },
                ..opts
            };
            let (t, j) =
                requests::keepalive_split(&lab, &mut servers, &generic_opts, "generic", &status)?;
            tables.push(t);
            json_sections.insert("keepalive_generic".into(), j);
            restart_agent(&mut lab, &lb_bin, XdpMode::Native)?;
            load.push(json!({ "at": "after requests", "loadavg": loadavg() }));
            drop(servers);
            check_cancelled()?;
        }
        if wants("control") {
            let (t, j) = control::health_failure(&mut lab, if args.quick { 2 } else { 5 })?;
            tables.push(t);
            json_sections.insert("health_failure".into(), j);
            let (t, j) = control::memory(&mut lab, &lb_bin)?;
            tables.push(t);
            json_sections.insert("agent_memory".into(), j);
        }
        drop(lab);
    }

    if wants("control") {
        let (t, j, builds) = control::maglev(
            if args.quick { 2 } else { 5 },
            &[65537, 655373],
            &[10, 100, 1000],
        )?;
        if let Some(b) = builds
            .iter()
            .find(|b| b.backends == 1000 && b.size == 65537)
        {
            goals.push(Goal {
                what: "Maglev build, 1000 backends, M = 65537".into(),
                measured: format!("{} ms", num(b.ms, 2)),
                target: "< 20 ms".into(),
                met: Some(b.ms < 20.0),
            });
        }
        tables.push(t);
        json_sections.insert("maglev_build".into(), j);
        let (t, j) = control::switch(&[1, 100, 1000])?;
        tables.push(t);
        json_sections.insert("table_switch".into(), j);
        let (t, j) = control::scan(
            if args.quick { 65536 } else { 1 << 20 },
            if args.quick { 2 } else { 5 },
        )?;
        tables.push(t);
        json_sections.insert("conntrack_scan".into(), j);
    }

    if wants("transfer") {
        let lb_bin = match &args.lb_bin {
            Some(b) => b.clone(),
            None => lb_tests::find_lb_bin().map_err(anyhow::Error::msg)?,
        };
        let opts = transfer::Options {
            entries: if args.quick { 20_000 } else { 100_000 },
            rounds: if args.quick { 1 } else { 3 },
        };
        let (t, j) = transfer::run(&lb_bin, &opts)?;
        tables.push(t);
        json_sections.insert("cluster_transfer".into(), j);
        load.push(json!({ "at": "after transfer", "loadavg": loadavg() }));
        check_cancelled()?;
    }

    let mut goal_table = Table::new(
        "Goals (figures of this run only)",
        &["goal", "measured", "target", "met"],
    );
    for g in &goals {
        goal_table.row(vec![
            g.what.clone(),
            g.measured.clone(),
            g.target.clone(),
            match g.met {
                Some(true) => "yes".into(),
                Some(false) => "NO".into(),
                None => "-".into(),
            },
        ]);
    }
    tables.push(goal_table);

    println!("\nbench: {}", machine.line());
    println!(
        "bench: load average at start {}, at the end {}",
        load[0]["loadavg"].as_str().unwrap_or("?"),
        loadavg()
    );
    for t in &tables {
        print!("{}", t.text());
    }

    let elapsed = started.elapsed().as_secs_f64();
    let command: Vec<String> = std::env::args().collect();
    let doc = json!({
        "machine": machine.json(),
        "command": command.join(" "),
        "elapsed_s": elapsed,
        "load": load,
        "sections": json_sections,
        "goals": goals.iter().map(|g| json!({
            "goal": g.what, "measured": g.measured, "target": g.target, "met": g.met,
        })).collect::<Vec<_>>(),
    });
    if let Some(dir) = out.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    }
    std::fs::write(&out, serde_json::to_string_pretty(&doc)?)
        .with_context(|| format!("write {}", out.display()))?;
    let md_path = out.with_extension("md");
    let mut md = format!("Machine: {}\n", machine.line());
    for t in &tables {
        md.push_str(&t.markdown());
    }
    std::fs::write(&md_path, md).with_context(|| format!("write {}", md_path.display()))?;
    println!(
        "\nbench: done in {:.0} s; figures in {} (tables as markdown: {})",
        elapsed,
        out.display(),
        md_path.display()
    );
    Ok(())
}

/// The lab of the request and health benchmarks: three backends, the agent serving the
/// VIP on port 80 (nginx, started by the request benchmark; TCP checks every second) and
/// on port 8080 (the lab's own servers, fast TCP checks, for the health-failure timing).
fn build_lab(lb_bin: &std::path::Path) -> Result<Lab> {
    eprintln!("bench: building the namespace lab...");
    let mut lab = Lab::new(LabOptions {
        backends: 3,
        ..LabOptions::default()
    })?;
    // Many short connections: all ports, and reuse of TIME_WAIT on the side that closes.
    for ns in [lab.client(), lab.lb()] {
        ns.sysctl("net.ipv4.ip_local_port_range", "1024 65535")?;
        ns.sysctl("net.ipv4.tcp_tw_reuse", "1")?;
    }
    lab.serve_tcp(control::HC_PORT, true)?;
    let config = lab_config(&lab, XdpMode::Native);
    lab.start_agent(lb_bin, &config)?;
    for i in 0..lab.backends().len() {
        let addr = lab.backend_addr(i, false).to_string();
        control::wait_backend(
            &lab,
            control::HC_VIP,
            &addr,
            |b| b["in_table"] == true,
            Duration::from_secs(20),
        )?;
    }
    Ok(lab)
}

/// The lab agent's config: the VIP on port 80 for wrk (TCP checks every second) and
/// the health-check VIP.
fn lab_config(lab: &Lab, mode: XdpMode) -> lb_tests::AgentConfig {
    let web = lab.vip(
        "web",
        false,
        80,
        Protocol::Tcp,
        Health::Tcp {
            interval: Duration::from_secs(1),
            timeout: Duration::from_millis(500),
            rise: 2,
            fall: 3,
            port: None,
        },
    );
    lab.agent_config(mode, vec![web, control::hc_vip(lab)])
}

/// Restarts the lab's agent in `mode` and waits until every backend of both VIPs is in
/// the table.
fn restart_agent(lab: &mut Lab, lb_bin: &std::path::Path, mode: XdpMode) -> Result<()> {
    if let Some(agent) = lab.take_agent() {
        agent.stop()?;
    }
    let config = lab_config(lab, mode);
    lab.start_agent(lb_bin, &config)?;
    for i in 0..lab.backends().len() {
        let addr = lab.backend_addr(i, false).to_string();
        for vip in ["web", control::HC_VIP] {
            control::wait_backend(
                lab,
                vip,
                &addr,
                |b| b["in_table"] == true,
                Duration::from_secs(20),
            )?;
        }
    }
    Ok(())
}

/// /proc/loadavg's first three fields.
fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

/// Goals of the per-packet figures, each a ratio of two figures of this run (absolute
/// figures on these machines move 2x between days).
fn packet_goals(net: &[(String, usize, f64, f64, f64)], goals: &mut Vec<Goal>) {
    // Loop, kernel time, net of the empty program: the worst over the backend counts.
    let worst = |case: &str| {
        net.iter()
            .filter(|r| r.0 == case)
            .map(|r| r.3)
            // NaN for a case that did not run (`--cases`): its goals are then not met,
            // rather than met by a ratio to minus infinity.
            .fold(f64::NAN, f64::max)
    };
    // The handshake on another instance or VIP against the plain one, per backend count.
    for backends in [1, 100, 1000] {
        let loop_net = |case: &str| {
            net.iter()
                .find(|r| r.0 == case && r.1 == backends)
                .map_or(f64::NAN, |r| r.3)
        };
        // `case` on its instance or VIP against `plain`, at most `limit`x.
        let mut dearer_by = |what: &str, (plain, case): (&str, &str), limit: f64| {
            let (plain, other) = (loop_net(plain), loop_net(case));
            let ratio = other / plain;
            goals.push(Goal {
                what: format!("{what}, loop kernel net, {backends} backend(s)"),
                measured: format!(
                    "{} ns vs {} ns = {}x",
                    num(other, 1),
                    num(plain, 1),
                    num(ratio, 2)
                ),
                target: format!("<= {limit:.2}x"),
                met: ratio.is_finite().then_some(ratio <= limit),
            });
        };
        // [cluster]: the export must not make the new-flow path more than 20% dearer.
        dearer_by(
            "new flow (handshake) with [cluster] (export) vs without",
            ("tcp_handshake", "tcp_handshake_cluster"),
            1.2,
        );
        // [vip.outlier]: retry detection reads the SYN's embryonic slot, which the ACK
        // reads anyway; a whole handshake should not notice it.
        dearer_by(
            "new flow (handshake) to a VIP with [vip.outlier] vs without",
            ("tcp_handshake", "tcp_handshake_outlier"),
            1.05,
        );
        // stable_slots (issue 36): a handshake at half of Katran's, which costs about what
        // a plain handshake costs here (katran-bench): half the plain one, and a short
        // connection at 0.6x.
        dearer_by(
            "new flow (handshake) to a VIP with stable_slots vs without",
            ("tcp_handshake", "tcp_handshake_stable"),
            0.5,
        );
        dearer_by(
            "short connection (5 packets) to a VIP with stable_slots vs without",
            ("tcp_short_connection", "tcp_short_connection_stable"),
            0.6,
        );
    }
    let (syn, handshake, established) = (
        worst("tcp_syn"),
        worst("tcp_handshake"),
        worst("tcp_established"),
    );
    // The handshake's ACK is the packet that inserts the entry: what every SYN paid
    // before first packets were kept out of the connection table.
    let insert = handshake - syn;
    let ratio = syn / insert;
    goals.push(Goal {
        what: "spoofed SYN / the handshake's inserting ACK (loop, kernel, net; worst of \
               1/100/1000 backends)"
            .into(),
        measured: format!(
            "{} ({} / {} ns)",
            num(ratio, 2),
            num(syn, 1),
            num(insert, 1)
        ),
        target: "<= 0.5".into(),
        met: ratio.is_finite().then_some(ratio <= 0.5),
    });
    let ratio = syn / established;
    goals.push(Goal {
        what: "spoofed SYN / established packet (loop, kernel, net; worst of backends)".into(),
        measured: format!(
            "{} ({} / {} ns)",
            num(ratio, 2),
            num(syn, 1),
            num(established, 1)
        ),
        target: "<= 1.5".into(),
        met: ratio.is_finite().then_some(ratio <= 1.5),
    });
    let pass = worst("pass_not_vip");
    let ratio = pass / established;
    goals.push(Goal {
        what: "packet for no VIP / established packet (loop, kernel, net)".into(),
        measured: format!(
            "{} ({} / {} ns)",
            num(ratio, 2),
            num(pass, 1),
            num(established, 1)
        ),
        target: "<= 0.3".into(),
        met: ratio.is_finite().then_some(ratio <= 0.3),
    });
}

fn request_goals(m: &[Vec<(f64, f64, f64)>], open_p99_ratios: &[f64], goals: &mut Vec<Goal>) {
    // m[mode][target]: mode 0 = new connection per request, 1 = keep-alive; target 0 = lb,
    // 1 = haproxy.
    let (lb, hp) = (m[0][0], m[0][1]);
    let ratio = lb.0 / hp.0;
    goals.push(Goal {
        what: "new connection per request: lb / HAProxy req/s".into(),
        measured: format!("{} ({} / {})", num(ratio, 2), num(lb.0, 0), num(hp.0, 0)),
        target: ">= 1.5".into(),
        met: ratio.is_finite().then_some(ratio >= 1.5),
    });
    let (lb, hp) = (m[1][0], m[1][1]);
    let ratio = lb.2 / hp.2;
    goals.push(Goal {
        what: "keep-alive: lb / HAProxy p99 latency".into(),
        measured: format!("{} ({} / {} ms)", num(ratio, 2), num(lb.2, 2), num(hp.2, 2)),
        target: "<= 1.0".into(),
        met: ratio.is_finite().then_some(ratio <= 1.0),
    });
    // The same comparison at equal offered rates: the worst share.
    let worst = open_p99_ratios
        .iter()
        .copied()
        .fold(f64::NEG_INFINITY, f64::max);
    goals.push(Goal {
        what: "keep-alive, same offered rate (open loop, worst of 25/50/75% of HAProxy's \
               max): lb / HAProxy p99"
            .into(),
        measured: format!(
            "{} (per share: {})",
            num(worst, 2),
            open_p99_ratios
                .iter()
                .map(|r| num(*r, 2))
                .collect::<Vec<_>>()
                .join(" / ")
        ),
        target: "<= 1.0".into(),
        met: worst.is_finite().then_some(worst <= 1.0),
    });
}
