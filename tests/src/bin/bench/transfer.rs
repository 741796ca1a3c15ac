//! The cluster's bulk transfer (issue 40): how fast a node that joins learns a peer's
//! connection table, and what answering costs the peer.
//!
//! Two real agents on two nodes of the ECMP lab's fabric (no router needed): node A
//! holds `entries` flows in its table, node B starts fresh and learns them from A over
//! the TCP transfer. A's table is filled as a third peer would fill it: the bench sends
//! A authenticated datagrams of new entries from the router's namespace (listed as a
//! peer), paced so that none is lost. Each round starts B afresh (its pins removed), at
//! A's configured rate and, alternating in the same run, unpaced (a rate no table
//! reaches), and reads from B's status how long the transfer took and from
//! /proc/A/stat the CPU time A spent meanwhile (its idle work over that time included:
//! a tick every 50 ms).

use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::thread::sleep;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, Result, bail};
use lb_common::{ADDR_FAMILY_V4, FlowKey, PROTO_TCP};
use lb_tests::Agent;
use lb_tests::router::{EcmpLab, PinDir, ROUTER, VIP, backend_addr, node_addr};
use lb_userspace::cluster::wire;
use serde_json::{Value, json};

use crate::report::{Table, median, num};

const KEY: &str = "the bench's cluster key, 32 bytes";
/// Backends of the VIP (the entries name them by address).
const BACKENDS: usize = 4;
/// Datagrams sent to A between pauses (of 4 ms) while filling its table: 80,000 entries
/// a second.
const BURST: usize = 16;
/// Times the whole table is sent to A, at most, until A holds it all (a datagram lost in
/// a full socket buffer is sent again; A inserts each flow once).
const FILL_PASSES: usize = 5;

pub struct Options {
    /// Entries in A's table.
    pub entries: usize,
    /// Rounds, each: one transfer at the default rate, one unpaced.
    pub rounds: usize,
}

/// The rates compared: A's default, and one no table reaches (the transfer unpaced).
const RATES: [(&str, u64); 2] = [("default (250,000/s)", 250_000), ("unpaced", 100_000_000)];

fn config(pins: &Path, socket: &Path, key: &Path, peers: &[IpAddr], rate: u64) -> String {
    let peers: Vec<String> = peers.iter().map(|p| format!("\"{p}\"")).collect();
    let mut text = format!(
        "[dataplane]\ninterface = \"eth0\"\nxdp_mode = \"native\"\n\
         conntrack_entries = 262144\npin_path = \"{}\"\n\n\
         [control]\nsocket = \"{}\"\nmetrics = \"off\"\n\n\
         [[vip]]\nname = \"web\"\naddress = \"{VIP}\"\nport = 80\nprotocol = \"tcp\"\n\n\
         [vip.health]\nkind = \"none\"\n",
        pins.display(),
        socket.display()
    );
    for i in 0..BACKENDS {
        text += &format!("\n[[vip.backend]]\naddress = \"{}\"\n", backend_addr(i));
    }
    text += &format!(
        "\n[cluster]\npeers = [{}]\nkey_file = \"{}\"\nlearn_timeout = \"1s\"\n\
         transfer_rate = {rate}\n",
        peers.join(", "),
        key.display()
    );
    text
}

/// Flow `i` of the bench: from 10.98.x.y:port to the VIP.
fn entry(i: usize) -> wire::Entry {
    let mut src = [0u8; 16];
    src[..4].copy_from_slice(&[10, 98, (i >> 24) as u8 | 0x80, (i >> 16) as u8]);
    let mut dst = [0u8; 16];
    dst[..4].copy_from_slice(&VIP.octets());
    let mut backend = [0u8; 16];
    backend[..4].copy_from_slice(&backend_addr(i % BACKENDS).octets());
    wire::Entry {
        key: FlowKey {
            src,
            dst,
            src_port: ((i & 0xffff) as u16).to_be(),
            dst_port: 80u16.to_be(),
            proto: PROTO_TCP,
            family: ADDR_FAMILY_V4,
            _pad: [0; 2],
        },
        backend,
        age_s: 1,
        flags: 0,
    }
}

/// CPU seconds `pid` used so far (user + system).
fn cpu_seconds(pid: u32) -> Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // After the command name's closing parenthesis: fields 3.., utime and stime are
    // the 14th and 15th.
    let rest = stat.rsplit_once(')').context("/proc/PID/stat")?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = fields[11].parse::<f64>()? + fields[12].parse::<f64>()?;
    // SAFETY: sysconf only reads a constant.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Ok(ticks / hz)
}

fn status(agent: &Agent) -> Value {
    agent.status_json().unwrap_or(Value::Null)
}

/// Fills A's table with `n` entries from the router's address (a peer of A's); returns
/// how many A holds.
fn fill(lab: &EcmpLab, a: &Agent, n: usize) -> Result<u64> {
    let boot = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)?
        .as_nanos() as u64;
    let mut held = 0;
    for pass in 0..FILL_PASSES {
        send_table(lab, n, boot, (pass * n) as u64)?;
        held = wait_inserted(a, n)?;
        if held >= n as u64 {
            break;
        }
    }
    Ok(held)
}

/// Sends A the `n` entries once, numbering the datagrams from `first_seq`.
fn send_table(lab: &EcmpLab, n: usize, boot: u64, first_seq: u64) -> Result<()> {
    let target = SocketAddr::new(IpAddr::V4(node_addr(0)), 4790);
    lab.router().run(move || -> Result<()> {
        let socket = UdpSocket::bind(SocketAddr::new(IpAddr::V4(ROUTER), 0))?;
        let entries: Vec<wire::Entry> = (0..n).map(entry).collect();
        for (seq, batch) in entries.chunks(wire::MAX_ENTRIES).enumerate() {
            let message = wire::Message {
                kind: wire::Kind::Entries,
                boot,
                seq: first_seq + seq as u64 + 1,
                time_ms: SystemTime::now()
                    .duration_since(SystemTime::UNIX_EPOCH)?
                    .as_millis() as u64,
                entries: batch.to_vec(),
            };
            socket.send_to(&wire::encode(&message, KEY.as_bytes()), target)?;
            if seq % BURST == BURST - 1 {
                sleep(Duration::from_millis(4));
            }
        }
        Ok(())
    })?
}

/// Waits until A inserted `n` entries, or stopped inserting; returns how many it holds.
fn wait_inserted(a: &Agent, n: usize) -> Result<u64> {
    let inserted = || {
        status(a)["cluster"]["peers"].as_array().map_or(0, |p| {
            p.iter().map(|p| p["inserted"].as_u64().unwrap_or(0)).sum()
        })
    };
    let started = Instant::now();
    let mut last = 0;
    // Until A inserted them all, or stopped inserting.
    while started.elapsed() < Duration::from_secs(30) {
        sleep(Duration::from_millis(300));
        let now = inserted();
        if now >= n as u64 || (now == last && now > 0) {
            return Ok(now);
        }
        last = now;
    }
    Ok(inserted())
}

/// One transfer to a fresh B: (seconds by B's status, entries received, A's CPU s).
fn transfer(
    lab: &EcmpLab,
    lb_bin: &Path,
    a: &Agent,
    b_config: &Path,
    b_pins: &Path,
    round: usize,
) -> Result<(f64, u64, f64)> {
    let pid = a.pid().context("A runs")?;
    let _ = lb_userspace::dataplane::remove_pins(b_pins);
    let cpu_before = cpu_seconds(pid)?;
    let log = lab.dir().join(format!("b-{round}.log"));
    let socket = lab.dir().join("b.sock");
    let b = Agent::start(lb_bin, lab.node(1), b_config, &socket, &log)?;
    let started = Instant::now();
    let learn = loop {
        let cluster = status(&b)["cluster"].clone();
        if cluster["learning"] != "waiting" && !cluster["learning"].is_null() {
            break cluster["learn"].clone();
        }
        if started.elapsed() > Duration::from_secs(120) {
            bail!("B still learning: {cluster:#}");
        }
        sleep(Duration::from_millis(20));
    };
    let cpu = cpu_seconds(pid)? - cpu_before;
    let peer = learn["peers"]
        .as_array()
        .and_then(|p| p.iter().find(|p| p["address"] == node_addr(0).to_string()))
        .cloned()
        .unwrap_or(Value::Null);
    if peer["state"] != "done" {
        bail!("B did not learn A's table: {learn:#}\n{}", b.log());
    }
    drop(b);
    Ok((
        peer["seconds"].as_f64().unwrap_or(f64::NAN),
        peer["received"].as_u64().unwrap_or(0),
        cpu,
    ))
}

fn write_key(dir: &Path) -> Result<PathBuf> {
    let path = dir.join("cluster.key");
    std::fs::write(&path, KEY)?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
    Ok(path)
}

pub fn run(lb_bin: &Path, opts: &Options) -> Result<(Table, Value)> {
    let lab = EcmpLab::new(BACKENDS).context("build the lab")?;
    let key = write_key(lab.dir())?;
    let pins: Vec<PinDir> = (0..2)
        .map(|i| PinDir::new(&format!("bench-transfer-{}", lab.node(i).name())))
        .collect::<Result<_>>()?;
    let a_peers = [
        IpAddr::V4(node_addr(0)),
        IpAddr::V4(node_addr(1)),
        IpAddr::V4(ROUTER),
    ];
    let b_peers = [IpAddr::V4(node_addr(0)), IpAddr::V4(node_addr(1))];
    let mut table = Table::new(
        &format!(
            "Cluster join: a fresh node learns a peer's {} entries over TCP",
            opts.entries
        ),
        &[
            "answer rate",
            "seconds (median)",
            "entries/s",
            "s per 100,000",
            "A's CPU s per 100,000",
        ],
    );
    let mut rows = Vec::new();
    // A restarts per rate (transfer_rate is fixed at start); B afresh every round.
    let mut results: Vec<Vec<(f64, u64, f64)>> = vec![Vec::new(); RATES.len()];
    let mut held = 0;
    for (r, (_, rate)) in RATES.iter().enumerate() {
        let a_config = lab.dir().join(format!("a-{r}.toml"));
        let a_socket = lab.dir().join("a.sock");
        std::fs::write(
            &a_config,
            config(pins[0].path(), &a_socket, &key, &a_peers, *rate),
        )?;
        let b_config = lab.dir().join("b.toml");
        std::fs::write(
            &b_config,
            config(
                pins[1].path(),
                &lab.dir().join("b.sock"),
                &key,
                &b_peers,
                250_000,
            ),
        )?;
        let _ = lb_userspace::dataplane::remove_pins(pins[0].path());
        let a = Agent::start(
            lb_bin,
            lab.node(0),
            &a_config,
            &a_socket,
            &lab.dir().join(format!("a-{r}.log")),
        )?;
        held = fill(&lab, &a, opts.entries)?;
        eprintln!("bench: transfer: A holds {held} entries (rate {rate}/s)");
        for round in 0..opts.rounds {
            crate::check_cancelled()?;
            let result = transfer(&lab, lb_bin, &a, &b_config, pins[1].path(), round)?;
            eprintln!(
                "bench: transfer round {round}: {:.3} s, {} entries, A's CPU {:.3} s",
                result.0, result.1, result.2
            );
            results[r].push(result);
        }
        drop(a);
    }
    for (r, (name, rate)) in RATES.iter().enumerate() {
        let seconds = median(&results[r].iter().map(|x| x.0).collect::<Vec<_>>());
        let received = median(&results[r].iter().map(|x| x.1 as f64).collect::<Vec<_>>());
        let cpu = median(&results[r].iter().map(|x| x.2).collect::<Vec<_>>());
        let per_100k = |x: f64| x * 100_000.0 / received.max(1.0);
        table.row(vec![
            name.to_string(),
            num(seconds, 3),
            num(received / seconds, 0),
            num(per_100k(seconds), 3),
            num(per_100k(cpu), 3),
        ]);
        rows.push(json!({
            "rate": rate, "seconds": seconds, "received": received,
            "entries_per_second": received / seconds,
            "seconds_per_100k": per_100k(seconds),
            "answering_cpu_seconds_per_100k": per_100k(cpu),
            "runs": results[r].iter().map(|x| json!({"seconds": x.0, "received": x.1, "cpu": x.2})).collect::<Vec<_>>(),
        }));
    }
    table.note(format!(
        "A held {held} entries; seconds: B's own measure (first request to the last frame \
         inserted); A's CPU: user+system time of A's process from B's start to the end of \
         its learning (including A's idle work over that time)"
    ));
    Ok((table, json!({ "entries": held, "rates": rows })))
}
