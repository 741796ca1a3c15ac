//! `lab`: a self-contained demonstration of `lb` in network namespaces (what
//! `cargo xtask run` runs). It builds a client, the balancer and three backends on one
//! bridge, starts the agent, sends requests from the client to the VIP, shows how they
//! spread and what `lb status` says, and tears everything down: at the end, on failure,
//! and on Ctrl-C at any point.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use lb_tests::client::{REQUEST_TIMEOUT, spread_with, tcp_request_here};
use lb_tests::{Health, Lab, LabOptions, Protocol, XdpMode, wait_backends_up};

#[derive(Parser, Debug)]
#[command(about = "Run lb in a lab of network namespaces and show traffic being balanced")]
struct Args {
    /// The `lb` binary (default: $LB_BIN, else the newest of target/{release,debug}/lb).
    #[arg(long)]
    lb_bin: Option<PathBuf>,
    /// Keep the lab up after the demonstration, until Ctrl-C.
    #[arg(long)]
    keep: bool,
    /// Number of TCP connections to send to the VIP.
    #[arg(long, default_value_t = 300)]
    requests: usize,
    /// XDP attach mode of the balancer: native or generic.
    #[arg(long, default_value = "native")]
    mode: XdpMode,
}

const BACKENDS: usize = 3;
const PORT: u16 = 80;
/// How long the backends may take to pass their first `rise` checks.
const UP_TIMEOUT: Duration = Duration::from_secs(10);

fn main() -> ExitCode {
    let args = Args::parse();
    let cancelled = Arc::new(AtomicBool::new(false));
    {
        let cancelled = cancelled.clone();
        if let Err(e) = ctrlc::set_handler(move || {
            if cancelled.swap(true, Ordering::SeqCst) {
                eprintln!("\n(already stopping)");
            } else {
                eprintln!("\nCtrl-C: tearing the lab down...");
            }
        }) {
            eprintln!("error: cannot handle Ctrl-C: {e}");
            return ExitCode::FAILURE;
        }
    }
    let result = run(&args, &cancelled);
    // Every guard has been dropped by now: the namespaces are gone.
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(_) if cancelled.load(Ordering::SeqCst) => {
            eprintln!("interrupted; the lab is torn down");
            ExitCode::from(130)
        }
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Ok(true) when every request succeeded and every backend got some.
fn run(args: &Args, cancelled: &AtomicBool) -> Result<bool> {
    if args.mode == XdpMode::Auto {
        bail!("--mode is native or generic");
    }
    let check = || -> Result<()> {
        if cancelled.load(Ordering::SeqCst) {
            bail!("interrupted");
        }
        Ok(())
    };
    let lb_bin = match &args.lb_bin {
        Some(bin) => bin.clone(),
        None => lb_tests::find_lb_bin().map_err(anyhow::Error::msg)?,
    };
    if !nix::unistd::geteuid().is_root() {
        bail!("the lab needs root (network namespaces, XDP)");
    }
    lb_tests::ensure_bpffs().map_err(anyhow::Error::msg)?;

    println!("building the lab: a client, the balancer, {BACKENDS} backends on one bridge...");
    let mut lab = Lab::new(LabOptions {
        backends: BACKENDS,
        ..LabOptions::default()
    })
    .context("build the lab")?;
    check()?;
    lab.serve_tcp(PORT, false)
        .context("start the backends' servers")?;
    let vip = lab.vip4();
    let config = lab.agent_config(
        args.mode,
        vec![lab.vip("web", false, PORT, Protocol::Tcp, Health::lab_tcp())],
    );
    println!(
        "starting {} in {} ({} mode)...",
        lb_bin.display(),
        lab.lb().name(),
        args.mode.as_str()
    );
    let is_cancelled = || cancelled.load(Ordering::SeqCst);
    let agent = lab
        .start_agent_cancellable(&lb_bin, &config, &is_cancelled)
        .context("start the agent")?;
    if let Some(line) = agent.serving_line() {
        println!("agent: {}", line.trim());
    }
    check()?;

    // Checked backends start down: traffic goes nowhere until `rise` checks pass.
    let health = Health::lab_tcp()
        .timing()
        .context("the lab's check has a timing")?;
    println!(
        "waiting for the health checks (tcp to port {PORT} every {:?}, timeout {:?}, \
         rise {}, fall {})...",
        health.interval, health.timeout, health.rise, health.fall
    );
    let agent = lab.agent().context("the agent is gone")?;
    let (view, waited) =
        wait_backends_up(agent, "web", UP_TIMEOUT, &is_cancelled).context("lb status --json")?;
    check()?;
    let (up, all) = (view.up(), view.backends.len());
    if up < all {
        println!(
            "FAILED: only {up} of {all} backends up after {:.1} s:\n{}",
            waited.as_secs_f64(),
            view.summary()
        );
        println!(
            "--- agent log ---\n{}--- end of agent log ---",
            lab.agent_log()
        );
        println!("tearing the lab down...");
        return Ok(false);
    }
    println!(
        "{up} of {all} backends up after {:.1} s",
        waited.as_secs_f64()
    );

    let target = std::net::SocketAddr::new(vip, PORT);
    println!(
        "\nsending {} TCP connections from the client ({}) to {target}...",
        args.requests,
        lab.client_addr(false)
    );
    let start = Instant::now();
    let s = spread_with(
        lab.client(),
        args.requests,
        |_| tcp_request_here(target, REQUEST_TIMEOUT),
        is_cancelled,
    )?;
    check()?;
    let elapsed = start.elapsed();
    println!(
        "{} answered, {} failed, in {:.2?}\n",
        s.answered(),
        s.failures,
        elapsed
    );
    print!("{}", s.table());
    for e in &s.errors {
        println!("  {e}");
    }

    let agent = lab.agent().context("the agent is gone")?;
    // The agent samples rates and scans its connection table every 2 s: one more sample,
    // so the status shows this traffic's flows and spread, not the quiet before it.
    println!("\n(waiting 2.5 s for the agent's next sample of rates and flows)");
    for _ in 0..25 {
        check()?;
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    println!("\n$ lb status --socket {}", agent.socket().display());
    match agent.status() {
        Ok(status) => print!("{status}"),
        Err(e) => println!("(lb status failed: {e:#})"),
    }

    let missing: Vec<String> = (0..BACKENDS)
        .map(|i| lab.backend_name(i))
        .filter(|name| !s.counts.contains_key(name))
        .collect();
    let ok = s.failures == 0 && missing.is_empty() && s.total() == args.requests;
    if ok {
        println!("\nOK: every request was answered, every backend got some");
    } else {
        if s.failures > 0 {
            println!(
                "\nFAILED: {} of {} requests got no answer",
                s.failures, args.requests
            );
        }
        if !missing.is_empty() {
            println!("FAILED: no request reached {}", missing.join(", "));
        }
        println!(
            "--- agent log ---\n{}--- end of agent log ---",
            lab.agent_log()
        );
    }

    if args.keep {
        keep(&mut lab, &lb_bin, cancelled);
    }
    println!("tearing the lab down...");
    Ok(ok)
}

/// Prints how to explore the lab, then waits for Ctrl-C (or for the agent to exit).
fn keep(lab: &mut Lab, lb_bin: &std::path::Path, cancelled: &AtomicBool) {
    let (client, lb, b1, sw) = (
        lab.client().name(),
        lab.lb().name(),
        lab.backend(0).name(),
        lab.switch().name(),
    );
    let vip = lab.vip4();
    let socket = lab.socket_path();
    println!(
        "\nThe lab stays up until Ctrl-C. To explore it (as root, from another terminal):\n\
         \n  # a request from the client (bash's /dev/tcp, no tool needed):\
         \n  ip netns exec {client} bash -c 'exec 3<>/dev/tcp/{vip}/{PORT}; head -1 <&3'\
         \n  ip netns exec {client} curl -s --max-time 2 telnet://{vip}:{PORT} </dev/null\
         \n  # the agent:\
         \n  {} status --socket {}\
         \n  # packets: replies go from the backends straight to the client\
         \n  ip netns exec {b1} tcpdump -ni eth0 -c 20 port {PORT}\
         \n  ip netns exec {lb} ip -s link show eth0; ip netns exec {lb} bpftool net\
         \n  ip netns exec {sw} bridge fdb show br br0 dynamic\
         \n  # namespaces: {client} (client), {lb} (balancer), {b1}.. (backends), {sw} (bridge)\
         \n  # the agent's config and log: {}\n",
        lb_bin.display(),
        socket.display(),
        lab.dir().display(),
    );
    let mut last_check = Instant::now();
    while !cancelled.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(200));
        if last_check.elapsed() > Duration::from_secs(1) {
            last_check = Instant::now();
            if !agent_alive(lab) {
                println!("the agent exited; its log:\n{}", lab.agent_log());
                return;
            }
        }
    }
}

fn agent_alive(lab: &mut Lab) -> bool {
    lab.agent_mut()
        .is_some_and(|a| matches!(a.try_wait(), Ok(None)))
}
