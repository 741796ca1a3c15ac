//! Control plane: Maglev table build time, table switch time on a real data path, time
//! from a health-check failure to the table switched, and the agent's memory.

use std::net::{IpAddr, Ipv4Addr};
use std::path::Path;
use std::thread::sleep;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, anyhow, bail};
use lb_common::maglev::{MaglevBackend, build_table};
use lb_tests::{BackendConfig, Health, Lab, Protocol, VipConfig, XdpMode};
use lb_userspace::config::Config;
use serde_json::{Value, json};

use crate::report::{Table, median, num};
use lb_tests::program::Instance;

fn backend_v4(i: usize) -> IpAddr {
    IpAddr::from(Ipv4Addr::new(10, 98, (i / 250) as u8, (i % 250) as u8 + 1))
}

pub struct MaglevResult {
    pub backends: usize,
    pub size: u32,
    pub ms: f64,
}

/// `build_table` for 10, 100, 1000 backends at each size, median of `rounds`.
pub fn maglev(
    rounds: usize,
    sizes: &[u32],
    counts: &[usize],
) -> Result<(Table, Value, Vec<MaglevResult>)> {
    let mut table = Table::new(
        "Maglev table build (lb_common::maglev::build_table, ms, median)",
        &["backends", "M = 65537", "M = 655373"],
    );
    let mut results = Vec::new();
    let mut json_rows = Vec::new();
    for &n in counts {
        let members: Vec<MaglevBackend> = (0..n)
            .map(|i| MaglevBackend {
                id: i as u32,
                address: backend_v4(i),
                weight: 1,
            })
            .collect();
        let mut row = vec![n.to_string()];
        for &size in sizes {
            crate::check_cancelled()?;
            let times: Vec<f64> = (0..rounds)
                .map(|_| {
                    let start = Instant::now();
                    let t = build_table(&members, size);
                    let ms = start.elapsed().as_secs_f64() * 1e3;
                    std::hint::black_box(t);
                    ms
                })
                .collect();
            let ms = median(&times);
            row.push(num(ms, 2));
            json_rows.push(json!({ "backends": n, "table_size": size, "ms": ms, "rounds": times }));
            results.push(MaglevResult {
                backends: n,
                size,
                ms,
            });
        }
        table.row(row);
    }
    table.note(format!(
        "{rounds} builds each, equal weights, release build."
    ));
    Ok((table, Value::Array(json_rows), results))
}

/// One VIP with `backends` (none: no VIP at all).
fn switch_config(backends: Option<&[usize]>) -> String {
    let mut t = String::from(
        "[dataplane]\ninterface = \"lo\"\nconntrack_entries = 1024\n[control]\nmetrics = \"off\"\n",
    );
    let Some(backends) = backends else {
        return t;
    };
    t += "[[vip]]\nname = \"web\"\naddress = \"10.0.0.100\"\nport = 80\nprotocol = \"tcp\"\n\
          [vip.health]\nkind = \"none\"\n";
    for &i in backends {
        t += &format!(
            "[[vip.backend]]\naddress = \"{}\"\nmac = \"02:00:00:00:{:02x}:{:02x}\"\n",
            backend_v4(i),
            (i >> 8) as u8,
            i as u8
        );
    }
    t
}

/// Table switches through `TableWriter::apply` on a real `AyaDataplane`: the first full
/// write, the first removal of one backend (its generation never written: a full write
/// again), then removals in steady state (only the slots that differ).
pub fn switch(counts: &[usize]) -> Result<(Table, Value)> {
    let mut table = Table::new(
        "Table switch on the real data path (M = 65537, ms)",
        &[
            "backends",
            "step",
            "Maglev build",
            "write + switch",
            "total",
            "slots written",
        ],
    );
    let mut rows = Vec::new();
    for &n in counts {
        crate::check_cancelled()?;
        let all: Vec<usize> = (0..n).collect();
        let mut inst = Instance::load(&switch_config(None))?;
        let mut step =
            |inst: &mut Instance, name: &str, members: &[usize]| -> Result<(f64, f64, usize)> {
                inst.config = Config::from_toml(&switch_config(Some(members)))?;
                inst.model.update(&inst.config)?;
                let start = Instant::now();
                let desired = inst.model.desired();
                let build = start.elapsed().as_secs_f64() * 1e3;
                let start = Instant::now();
                let report = inst.writer.apply(&mut inst.dataplane, &desired)?;
                let write = start.elapsed().as_secs_f64() * 1e3;
                rows.push(json!({
                    "backends": n, "step": name, "build_ms": build, "write_ms": write,
                    "slots_written": report.slots_written,
                }));
                Ok((build, write, report.slots_written))
            };
        let (b, w, s) = step(&mut inst, "first full write", &all)?;
        table.row(vec![
            n.to_string(),
            "first full write".into(),
            num(b, 2),
            num(w, 2),
            num(b + w, 2),
            s.to_string(),
        ]);
        let (b, w, s) = step(&mut inst, "remove one (other generation empty)", &all[1..])?;
        table.row(vec![
            n.to_string(),
            "remove one, first switch".into(),
            num(b, 2),
            num(w, 2),
            num(b + w, 2),
            s.to_string(),
        ]);
        if n >= 5 {
            let mut samples = Vec::new();
            for k in 2..5 {
                samples.push(step(&mut inst, "remove one (steady state)", &all[k..])?);
            }
            let b = median(&samples.iter().map(|x| x.0).collect::<Vec<_>>());
            let w = median(&samples.iter().map(|x| x.1).collect::<Vec<_>>());
            let s = median(&samples.iter().map(|x| x.2 as f64).collect::<Vec<_>>());
            table.row(vec![
                n.to_string(),
                "remove one, steady state".into(),
                num(b, 2),
                num(w, 2),
                num(b + w, 2),
                num(s, 0),
            ]);
        }
    }
    table.note(
        "Steady state: median of 3 further removals; each rewrites only the slots that \
         differ in the idle generation, then switches the VIP with one map update.",
    );
    Ok((table, Value::Array(rows)))
}

/// The agent's connection-table scan (every 2 s: active flows, drains) on a real map
/// of `entries` entries, filled with `entries` flows: batched reads (what the agent
/// does) against key-by-key reads (its fallback), medians of `rounds` each.
pub fn scan(entries: u32, rounds: usize) -> Result<(Table, Value)> {
    let mut table = Table::new(
        "Connection-table scan (the agent's, every 2 s; ms, median)",
        &[
            "entries",
            "batched (BPF_MAP_LOOKUP_BATCH)",
            "key by key",
            "ratio",
        ],
    );
    let config = switch_config(Some(&[0])).replace(
        "conntrack_entries = 1024",
        &format!("conntrack_entries = {entries}"),
    );
    let mut inst = Instance::load(&config)?;
    let vip: lb_userspace::explain::VipTarget = "10.0.0.100:80/tcp".parse()?;
    // The LRU keeps per-CPU lists (BPF_F_NO_COMMON_LRU): an insert takes room from its
    // own CPU's share, so the table is filled from every CPU in turn, as traffic would.
    let me = nix::unistd::Pid::from_raw(0);
    let allowed = nix::sched::sched_getaffinity(me)?;
    let cpus = lb_tests::allowed_cpus();
    let share = (entries as usize / cpus.len().max(1)).max(1);
    for i in 0..entries {
        if (i as usize).is_multiple_of(share) {
            let mut one = nix::sched::CpuSet::new();
            one.set(cpus[(i as usize / share).min(cpus.len() - 1)])?;
            nix::sched::sched_setaffinity(me, &one)?;
        }
        let client = std::net::SocketAddr::from((
            [10, (i >> 16) as u8, (i >> 8) as u8, i as u8],
            1024 + (i % 60000) as u16,
        ));
        let key = lb_userspace::explain::flow_key(&vip, client);
        let entry = lb_common::FlowEntry {
            backend_id: 0,
            flags: 0,
            last_seen_ns: 1,
        };
        inst.dataplane.insert_flow(&key, &entry)?;
    }
    nix::sched::sched_setaffinity(me, &allowed)?;
    let reader = lb_userspace::dataplane::Dataplane::flow_reader(&inst.dataplane)?;
    let mut batched = Vec::new();
    let mut by_key = Vec::new();
    let mut read = 0;
    for _ in 0..rounds {
        crate::check_cancelled()?;
        let start = Instant::now();
        read = reader.flows_batched()?.len();
        batched.push(start.elapsed().as_secs_f64() * 1e3);
        let start = Instant::now();
        let n = reader.flows_by_key()?.len();
        by_key.push(start.elapsed().as_secs_f64() * 1e3);
        anyhow::ensure!(n == read, "the two reads disagree: {n} and {read} entries");
    }
    let (b, k) = (median(&batched), median(&by_key));
    table.row(vec![
        read.to_string(),
        num(b, 1),
        num(k, 1),
        format!("{:.1}x faster", k / b),
    ]);
    table.note(format!(
        "{rounds} rounds; the table filled from userspace to its size (LRU: what fits \
         stays); key by key = BPF_MAP_GET_NEXT_KEY + BPF_MAP_LOOKUP_ELEM per entry."
    ));
    Ok((
        table,
        json!({"entries": read, "batched_ms": batched, "by_key_ms": by_key}),
    ))
}

/// Seconds since the epoch of a tracing timestamp such as `2026-05-20T10:11:12.123456Z`.
pub fn parse_timestamp(s: &str) -> Option<f64> {
    let s = s.trim().strip_suffix('Z')?;
    let (date, time) = s.split_once('T')?;
    let mut d = date.split('-').map(|x| x.parse::<i64>());
    let (y, m, day) = (d.next()?.ok()?, d.next()?.ok()?, d.next()?.ok()?);
    let mut t = time.split(':');
    let (hh, mm) = (
        t.next()?.parse::<i64>().ok()?,
        t.next()?.parse::<i64>().ok()?,
    );
    let ss: f64 = t.next()?.parse().ok()?;
    // Days from civil (Howard Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146097 + doe - 719468;
    Some((days * 86400 + hh * 3600 + mm * 60) as f64 + ss)
}

fn now_epoch() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The backend `address` of VIP `vip` in `lb status --json`.
fn backend_status(status: &Value, vip: &str, address: &str) -> Option<Value> {
    status["vips"]
        .as_array()?
        .iter()
        .find(|v| v["name"] == vip)?["backends"]
        .as_array()?
        .iter()
        .find(|b| b["address"] == address)
        .cloned()
}

/// Waits until `pred` holds for the backend, polling `lb status --json`.
pub fn wait_backend(
    lab: &Lab,
    vip: &str,
    address: &str,
    pred: impl Fn(&Value) -> bool,
    timeout: Duration,
) -> Result<()> {
    let agent = lab.agent().ok_or_else(|| anyhow!("no agent"))?;
    let start = Instant::now();
    loop {
        if let Ok(s) = agent.status_json()
            && backend_status(&s, vip, address).is_some_and(|b| pred(&b))
        {
            return Ok(());
        }
        if start.elapsed() > timeout {
            bail!(
                "backend {address} of {vip} not in the expected state within {timeout:?}; status: {}",
                agent.status().unwrap_or_default()
            );
        }
        sleep(Duration::from_millis(50));
    }
}

/// The health-check VIP of the lab: port `HC_PORT`, fast TCP checks.
pub const HC_PORT: u16 = 8080;
pub const HC_VIP: &str = "hc";

pub fn hc_vip(lab: &Lab) -> VipConfig {
    lab.vip(HC_VIP, false, HC_PORT, Protocol::Tcp, Health::fast_tcp())
}

/// Stops one backend's server on `HC_PORT` and times until the agent logs the switched
/// table; then starts it again and waits for it to come back. Rounds take the backends
/// in turn: removing the same one again would find its table already in the idle
/// generation (nothing to write, and no `tables updated` line to time). Per round: ms
/// from the server's stop to the timestamp of the `tables updated` line, and ms until
/// this process saw that line.
pub fn health_failure(lab: &mut Lab, rounds: usize) -> Result<(Table, Value)> {
    let mut logged = Vec::new();
    let mut detected = Vec::new();
    let mut seen = Vec::new();
    let mut lines = Vec::new();
    for round in 0..rounds {
        crate::check_cancelled()?;
        eprintln!(
            "bench: health-check failure, round {}/{rounds}...",
            round + 1
        );
        let i = round % lab.backends().len();
        let address = lab.backend_addr(i, false).to_string();
        let down_marker = format!("{address} of vip {HC_VIP} is DOWN");
        for j in 0..lab.backends().len() {
            wait_backend(
                lab,
                HC_VIP,
                &lab.backend_addr(j, false).to_string(),
                |b| b["health"] == "up" && b["slots"].as_u64().unwrap_or(0) > 0,
                Duration::from_secs(15),
            )?;
        }
        // Let the check cycle run free for a while: the stop falls at a random point of it.
        sleep(Duration::from_millis(300 + 97 * round as u64));
        let agent_log_len = lab.agent_log().len();
        lab.stop_servers_of(i)?;
        let t0 = now_epoch();
        let i0 = Instant::now();
        let stamp = |line: &str| {
            line.split_whitespace()
                .next()
                .and_then(parse_timestamp)
                .with_context(|| format!("no timestamp in {line:?}"))
        };
        let (down_ts, ts, line) = loop {
            let log = lab.agent_log();
            let new = log.get(agent_log_len..).unwrap_or("");
            if let Some(pos) = new.find(&down_marker) {
                let line_start = new[..pos].rfind('\n').map_or(0, |p| p + 1);
                let after = &new[line_start..];
                if let Some(line) = after.lines().find(|l| l.contains("tables updated")) {
                    let down_line = after.lines().next().unwrap_or("");
                    break (stamp(down_line)?, stamp(line)?, line.to_string());
                }
            }
            if i0.elapsed() > Duration::from_secs(10) {
                bail!("no DOWN and table switch in the agent's log within 10 s:\n{new}");
            }
            sleep(Duration::from_millis(2));
        };
        seen.push(i0.elapsed().as_secs_f64() * 1e3);
        logged.push((ts - t0) * 1e3);
        detected.push((down_ts - t0) * 1e3);
        lines.push(line);
        lab.serve_tcp_on(i, HC_PORT, true)?;
    }
    let mut table = Table::new(
        "Health-check failure to table switched (ms)",
        &["stop of the server to", "median", "min", "max"],
    );
    for (what, v) in [
        ("DOWN logged (detection)", &detected),
        ("table switched", &logged),
    ] {
        let (lo, hi) = crate::report::range(v);
        table.row(vec![what.into(), num(median(v), 0), num(lo, 0), num(hi, 0)]);
    }
    table.note(format!(
        "{rounds} rounds: a backend's server stopped (connection refused) at a random \
         point of its check cycle (tcp checks: interval 200ms, timeout 100ms, fall 2, 3 \
         backends); times to the timestamps of the agent's log lines. Detection takes up to \
         one interval (+10% jitter) + (fall - 1) fast intervals (interval/4): about 275 ms; \
         the switch then writes the slots that differ (a third or more of 65537 here)."
    ));
    Ok((
        table,
        json!({
            "interval_ms": 200, "timeout_ms": 100, "rise": 2, "fall": 2,
            "stop_to_down_logged_ms": detected,
            "stop_to_switch_logged_ms": logged,
            "stop_to_switch_seen_ms": seen,
            "lines": lines,
        }),
    ))
}

fn vm_rss_kb(pid: u32) -> Result<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let field = |name: &str| -> Result<u64> {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .with_context(|| format!("no {name} in /proc/{pid}/status"))
    };
    Ok((field("VmRSS:")?, field("VmHWM:")?))
}

/// VmRSS of the lab's running agent, then of agents started with 1 and with 1000
/// backends (MACs given, no checks). Leaves the lab without an agent.
pub fn memory(lab: &mut Lab, lb_bin: &Path) -> Result<(Table, Value)> {
    let mut table = Table::new(
        "Agent memory (VmRSS, MiB)",
        &["configuration", "VmRSS", "VmHWM"],
    );
    let mut rows = Vec::new();
    let mut record = |table: &mut Table, what: &str, pid: u32| -> Result<()> {
        let (rss, hwm) = vm_rss_kb(pid)?;
        table.row(vec![
            what.into(),
            num(rss as f64 / 1024.0, 1),
            num(hwm as f64 / 1024.0, 1),
        ]);
        rows.push(json!({ "configuration": what, "vm_rss_kb": rss, "vm_hwm_kb": hwm }));
        Ok(())
    };
    if let Some(pid) = lab.agent().and_then(|a| a.pid()) {
        let what = format!(
            "lab agent after the request runs ({} backends x 2 VIPs, tcp checks)",
            lab.backends().len()
        );
        record(&mut table, &what, pid)?;
    }
    if let Some(agent) = lab.take_agent() {
        agent.stop()?;
    }
    for n in [1usize, 1000] {
        crate::check_cancelled()?;
        let vip = VipConfig {
            name: "web".into(),
            address: lab.vip4(),
            port: 80,
            protocol: Protocol::Tcp,
            hash: None,
            drain_timeout: None,
            health: Health::None,
            backends: (0..n)
                .map(|i| BackendConfig {
                    mac: Some(format!(
                        "02:00:00:00:{:02x}:{:02x}",
                        (i >> 8) as u8,
                        i as u8
                    )),
                    ..BackendConfig::new(backend_v4(i))
                })
                .collect(),
            extra: Vec::new(),
        };
        let config = lab.agent_config(XdpMode::Native, vec![vip]);
        let agent = lab.start_agent(lb_bin, &config)?;
        let pid = agent.pid().ok_or_else(|| anyhow!("no agent pid"))?;
        // The first table is written before `serving`; give the tasks a moment to settle.
        sleep(Duration::from_secs(2));
        record(&mut table, &format!("{n} backend(s), no checks"), pid)?;
        if let Some(agent) = lab.take_agent() {
            agent.stop()?;
        }
    }
    table.note(
        "User-space memory only: the BPF maps (connection table, Maglev tables) are kernel memory.",
    );
    Ok((table, Value::Array(rows)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_tracing_timestamps() {
        let t = parse_timestamp("1970-01-02T00:00:01.5Z").unwrap();
        assert_eq!(t, 86401.5);
        let t = parse_timestamp("2000-03-01T00:00:00.000000Z").unwrap();
        assert_eq!(t, 951868800.0);
    }
}
