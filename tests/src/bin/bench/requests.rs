//! Requests through the balancer in the namespace lab: wrk from the client against lb
//! (the agent, DSR), against HAProxy in TCP mode in the balancer's namespace, and
//! against one backend directly; nginx on every backend. Rounds interleave the targets.

use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use lb_tests::Lab;
use serde_json::{Value, json};

use crate::procs::{Daemon, haproxy, nginx};
use crate::report::{Table, median, num};

pub struct Options {
    pub rounds: usize,
    /// Extra keep-alive rounds, lb and HAProxy only, for the p99 investigation.
    pub keepalive_rounds: usize,
    pub seconds: u32,
    pub threads: u32,
    pub connections: u32,
}

/// What one wrk run printed, parsed.
#[derive(Clone, Debug, Default)]
pub struct Wrk {
    pub requests_per_sec: f64,
    pub p50_ms: f64,
    pub p75_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub requests: u64,
    pub socket_errors: u64,
    pub non_2xx: u64,
}

/// "1.23ms", "850.00us", "1.02s", "1.5m" in milliseconds.
fn duration_ms(s: &str) -> Option<f64> {
    let s = s.trim();
    let (value, unit) = s
        .find(|c: char| c.is_ascii_alphabetic())
        .map(|i| s.split_at(i))?;
    let v: f64 = value.parse().ok()?;
    Some(match unit {
        "us" => v / 1000.0,
        "ms" => v,
        "s" => v * 1000.0,
        "m" => v * 60_000.0,
        "h" => v * 3_600_000.0,
        _ => return None,
    })
}

pub fn parse_wrk(out: &str) -> Result<Wrk> {
    let mut w = Wrk::default();
    let mut saw_rps = false;
    for line in out.lines() {
        let t = line.trim();
        let words: Vec<&str> = t.split_whitespace().collect();
        match words.as_slice() {
            ["Requests/sec:", v] => {
                w.requests_per_sec = v.parse()?;
                saw_rps = true;
            }
            [p, v] if p.ends_with('%') => {
                let ms = duration_ms(v).with_context(|| format!("latency {v:?}"))?;
                match *p {
                    "50%" => w.p50_ms = ms,
                    "75%" => w.p75_ms = ms,
                    "90%" => w.p90_ms = ms,
                    "99%" => w.p99_ms = ms,
                    _ => {}
                }
            }
            [n, "requests", "in", ..] => w.requests = n.parse().unwrap_or(0),
            ["Socket", "errors:", rest @ ..] => {
                w.socket_errors = rest
                    .iter()
                    .filter_map(|x| x.trim_end_matches(',').parse::<u64>().ok())
                    .sum();
            }
            ["Non-2xx", "or", "3xx", "responses:", n] => w.non_2xx = n.parse().unwrap_or(0),
            _ => {}
        }
    }
    if !saw_rps {
        bail!("no Requests/sec in wrk's output:\n{out}");
    }
    Ok(w)
}

/// Busy share of all CPUs between two reads of /proc/stat: (user+nice, system, softirq,
/// idle) as fractions of the time that passed.
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuShare {
    pub user: f64,
    pub system: f64,
    pub softirq: f64,
    pub idle: f64,
}

fn cpu_ticks() -> Vec<u64> {
    std::fs::read_to_string("/proc/stat")
        .ok()
        .and_then(|s| {
            s.lines().next().map(|l| {
                l.split_whitespace()
                    .skip(1)
                    .filter_map(|x| x.parse().ok())
                    .collect()
            })
        })
        .unwrap_or_default()
}

fn cpu_share(before: &[u64], after: &[u64]) -> CpuShare {
    let d: Vec<f64> = after
        .iter()
        .zip(before)
        .map(|(a, b)| a.saturating_sub(*b) as f64)
        .collect();
    if d.len() < 8 {
        return CpuShare::default();
    }
    // user nice system idle iowait irq softirq steal
    let total: f64 = d.iter().take(8).sum();
    if total == 0.0 {
        return CpuShare::default();
    }
    CpuShare {
        user: (d[0] + d[1]) / total,
        system: (d[2] + d[5]) / total,
        softirq: d[6] / total,
        idle: (d[3] + d[4]) / total,
    }
}

/// CPU ticks (USER_HZ) spent by the ksoftirqd threads: softirq work the kernel could not
/// finish at interrupt exit and deferred to threads that compete with everything else.
fn ksoftirqd_ticks() -> u64 {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return 0;
    };
    dir.flatten()
        .filter(|e| {
            std::fs::read_to_string(e.path().join("comm"))
                .is_ok_and(|c| c.starts_with("ksoftirqd/"))
        })
        .filter_map(|e| std::fs::read_to_string(e.path().join("stat")).ok())
        .filter_map(|stat| {
            // Fields after the ")" of the command: state is field 3, utime 14, stime 15.
            let rest = stat.rsplit_once(')')?.1;
            let f: Vec<&str> = rest.split_whitespace().collect();
            Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
        })
        .sum()
}

/// (ns on a CPU, ns waiting on a run queue) of `pids` and their threads, summed
/// (/proc/PID/task/TID/schedstat).
fn sched_ns(pids: &[u32]) -> (u64, u64) {
    let mut sum = (0, 0);
    for pid in pids {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            continue;
        };
        for t in tasks.flatten() {
            if let Ok(s) = std::fs::read_to_string(t.path().join("schedstat")) {
                let f: Vec<u64> = s
                    .split_whitespace()
                    .filter_map(|x| x.parse().ok())
                    .collect();
                if f.len() >= 2 {
                    sum.0 += f[0];
                    sum.1 += f[1];
                }
            }
        }
    }
    sum
}

/// Times the softirq budget ran out with work left (`time_squeeze` of
/// /proc/net/softnet_stat, summed over CPUs).
fn time_squeeze() -> u64 {
    std::fs::read_to_string("/proc/net/softnet_stat")
        .map(|s| {
            s.lines()
                .filter_map(|l| l.split_whitespace().nth(2))
                .filter_map(|x| u64::from_str_radix(x, 16).ok())
                .sum()
        })
        .unwrap_or(0)
}

/// Waits until `addr` accepts TCP connections from the client's namespace.
fn wait_listening(lab: &Lab, addr: SocketAddr, what: &str) -> Result<()> {
    let start = Instant::now();
    loop {
        let ok = lab
            .client()
            .run(|| TcpStream::connect_timeout(&addr, Duration::from_millis(500)).is_ok())?;
        if ok {
            return Ok(());
        }
        if start.elapsed() > Duration::from_secs(10) {
            bail!("{what} at {addr} does not accept connections");
        }
        sleep(Duration::from_millis(100));
    }
}

pub struct Servers {
    nginx: Vec<Daemon>,
    haproxy: Daemon,
}

impl Servers {
    /// nginx's worker processes (children of the masters).
    fn nginx_workers(&self) -> Vec<u32> {
        let masters: Vec<u32> = self.nginx.iter().filter_map(Daemon::pid).collect();
        let Ok(dir) = std::fs::read_dir("/proc") else {
            return Vec::new();
        };
        dir.flatten()
            .filter_map(|e| {
                let pid: u32 = e.file_name().to_str()?.parse().ok()?;
                let stat = std::fs::read_to_string(e.path().join("stat")).ok()?;
                let ppid: u32 = stat
                    .rsplit_once(')')?
                    .1
                    .split_whitespace()
                    .nth(1)?
                    .parse()
                    .ok()?;
                masters.contains(&ppid).then_some(pid)
            })
            .collect()
    }

    fn check(&mut self) -> Result<()> {
        for n in &mut self.nginx {
            n.check_running()?;
        }
        self.haproxy.check_running()
    }
}

/// nginx on every backend, HAProxy on the balancer's own address (port 80).
pub fn start_servers(lab: &Lab, dir: &Path) -> Result<Servers> {
    let mut nginx_daemons = Vec::new();
    for i in 0..lab.backends().len() {
        let d = nginx(
            lab.backend(i),
            &dir.join(format!("nginx-b{}", i + 1)),
            &lab.backend_name(i),
        )?;
        nginx_daemons.push(d);
    }
    let servers: Vec<String> = (0..lab.backends().len())
        .map(|i| format!("{}:80", lab.backend_addr(i, false)))
        .collect();
    let listen = format!("{}:80", lab.lb_addr(false));
    let haproxy_daemon = haproxy(lab.lb(), &dir.join("haproxy"), &listen, &servers)?;
    let mut s = Servers {
        nginx: nginx_daemons,
        haproxy: haproxy_daemon,
    };
    for i in 0..lab.backends().len() {
        wait_listening(
            lab,
            SocketAddr::new(lab.backend_addr(i, false), 80),
            "nginx",
        )
        .and_then(|()| s.check())
        .with_context(|| format!("nginx on {}", lab.backend_name(i)))?;
    }
    wait_listening(lab, SocketAddr::new(lab.lb_addr(false), 80), "haproxy")
        .and_then(|()| s.check())
        .context("haproxy")?;
    Ok(s)
}

pub fn wrk(
    lab: &Lab,
    url: &str,
    opts: &Options,
    seconds: u32,
    close: bool,
) -> Result<(Wrk, String)> {
    let threads = format!("-t{}", opts.threads);
    let conns = format!("-c{}", opts.connections);
    let dur = format!("-d{seconds}s");
    let mut args = vec![
        threads.as_str(),
        &conns,
        &dur,
        "--latency",
        "--timeout",
        "5s",
    ];
    if close {
        args.extend(["-H", "Connection: close"]);
    }
    args.push(url);
    let out = lab.client().exec("wrk", &args).context("wrk")?;
    Ok((parse_wrk(&out)?, out))
}

pub const TARGETS: [&str; 3] = ["lb", "haproxy", "direct"];
pub const MODES: [&str; 2] = ["new connection per request", "keep-alive"];

pub struct Results {
    pub tables: Vec<Table>,
    pub json: Value,
    /// [mode][target] -> median (req/s, p50, p99).
    pub medians: Vec<Vec<(f64, f64, f64)>>,
    /// Per share of `OPEN_LOOP_SHARES`: lb's keep-alive p99 over HAProxy's at the same
    /// offered rate.
    pub open_p99_ratios: Vec<f64>,
}

/// The agent must already serve the VIP on port 80 in `lab`.
pub fn run(
    lab: &Lab,
    servers: &mut Servers,
    opts: &Options,
    lb_status: &dyn Fn() -> Value,
) -> Result<Results> {
    let urls = [
        format!("http://{}/", lab.vip4()),
        format!("http://{}/", lab.lb_addr(false)),
        format!("http://{}/", lab.backend_addr(0, false)),
    ];
    // Warm-up: neighbour caches, nginx, HAProxy's threads.
    for url in &urls {
        wrk(lab, url, opts, 1, false)?;
        wrk(lab, url, opts, 1, true)?;
    }
    // [mode][target] -> runs
    let mut runs: Vec<Vec<Vec<(Wrk, CpuShare)>>> = vec![vec![Vec::new(); 3]; 2];
    let mut log = Vec::new();
    for round in 0..opts.rounds {
        for (mi, mode) in MODES.iter().enumerate() {
            for (ti, target) in TARGETS.iter().enumerate() {
                eprintln!(
                    "bench: wrk round {}/{}, {mode}, {target}...",
                    round + 1,
                    opts.rounds
                );
                servers.check()?;
                let status_before = (ti == 0).then(lb_status);
                let before = cpu_ticks();
                let (w, out) = wrk(lab, &urls[ti], opts, opts.seconds, mi == 0)?;
                let cpu = cpu_share(&before, &cpu_ticks());
                let split = status_before.map(|b| backend_split(&b, &lb_status()));
                log.push(json!({
                    "round": round,
                    "mode": mode,
                    "target": target,
                    "url": urls[ti],
                    "requests_per_sec": w.requests_per_sec,
                    "p50_ms": w.p50_ms,
                    "p75_ms": w.p75_ms,
                    "p90_ms": w.p90_ms,
                    "p99_ms": w.p99_ms,
                    "requests": w.requests,
                    "socket_errors": w.socket_errors,
                    "non_2xx": w.non_2xx,
                    "cpu": { "user": cpu.user, "system": cpu.system, "softirq": cpu.softirq, "idle": cpu.idle },
                    "lb_new_flows_per_backend": split,
                    "wrk_output": out,
                }));
                runs[mi][ti].push((w, cpu));
            }
        }
    }

    let mut medians = vec![vec![(0.0, 0.0, 0.0); 3]; 2];
    let mut table = Table::new(
        "Requests through the lab (wrk, medians)",
        &[
            "mode",
            "target",
            "req/s",
            "p50 ms",
            "p99 ms",
            "req/s vs haproxy",
            "p99 vs haproxy",
            "CPU idle",
            "errors",
        ],
    );
    for (mi, mode) in MODES.iter().enumerate() {
        for (ti, _) in TARGETS.iter().enumerate() {
            let r = &runs[mi][ti];
            let col = |f: fn(&Wrk) -> f64| median(&r.iter().map(|(w, _)| f(w)).collect::<Vec<_>>());
            medians[mi][ti] = (
                col(|w| w.requests_per_sec),
                col(|w| w.p50_ms),
                col(|w| w.p99_ms),
            );
        }
        for (ti, target) in TARGETS.iter().enumerate() {
            let r = &runs[mi][ti];
            // Ratios per round (same round, same conditions), then their median.
            let ratio = |f: fn(&Wrk) -> f64| {
                median(
                    &r.iter()
                        .zip(&runs[mi][1])
                        .map(|((a, _), (b, _))| f(a) / f(b))
                        .collect::<Vec<_>>(),
                )
            };
            let idle = median(&r.iter().map(|(_, c)| c.idle).collect::<Vec<_>>());
            let errors: u64 = r.iter().map(|(w, _)| w.socket_errors + w.non_2xx).sum();
            let (rps, p50, p99) = medians[mi][ti];
            table.row(vec![
                mode.to_string(),
                target.to_string(),
                num(rps, 0),
                num(p50, 2),
                num(p99, 2),
                num(ratio(|w| w.requests_per_sec), 2),
                num(ratio(|w| w.p99_ms), 2),
                format!("{}%", num(idle * 100.0, 0)),
                errors.to_string(),
            ]);
        }
    }
    table.note(format!(
        "wrk -t{} -c{} -d{}s --latency, {} rounds interleaved (lb, haproxy, direct); \
         lb = the agent (native XDP, DSR) to {} backends; haproxy = mode tcp, round robin, \
         on the balancer's address; direct = backend-1 only. Ratios: median of per-round \
         ratios.",
        opts.threads,
        opts.connections,
        opts.seconds,
        opts.rounds,
        lab.backends().len()
    ));
    table.note(
        "Everything (wrk, nginx, HAProxy, the XDP program's softirq) shares the machine's \
         CPUs: figures compare the paths, they are not capacity figures.",
    );
    let (split_table, split_json) = keepalive_split(lab, servers, opts, "native", lb_status)?;
    let (open_table, open_json, open_p99_ratios) =
        rate_matched(lab, servers, opts, medians[1][1].0)?;
    Ok(Results {
        tables: vec![table, split_table, open_table],
        open_p99_ratios,
        json: json!({
            "keepalive_investigation": split_json,
            "keepalive_open_loop": open_json,
            "threads": opts.threads,
            "connections": opts.connections,
            "seconds": opts.seconds,
            "rounds": opts.rounds,
            "backends": lab.backends().len(),
            "runs": log,
        }),
        medians,
    })
}

/// Keep-alive p99 of lb against HAProxy, round by round, with how lb's connections
/// spread over the backends: per-connection hashing of a few long-lived connections
/// leaves some backends with more of them than others, while HAProxy's round robin
/// spreads them exactly, and the busiest backend's queue makes the tail.
pub fn keepalive_split(
    lab: &Lab,
    servers: &mut Servers,
    opts: &Options,
    mode: &str,
    lb_status: &dyn Fn() -> Value,
) -> Result<(Table, Value)> {
    let urls = [
        format!("http://{}/", lab.vip4()),
        format!("http://{}/", lab.lb_addr(false)),
    ];
    let mut table = Table::new(
        &format!(
            "Keep-alive p99, lb ({mode} XDP) against HAProxy, with lb's connections per backend"
        ),
        &[
            "round",
            "lb p99 ms",
            "haproxy p99 ms",
            "lb / haproxy",
            "lb conns per backend",
            "busiest / mean",
            "ksoftirqd ms lb/hap",
            "nginx wait ms/s lb/hap",
            "nginx cpu ms/s lb/hap",
        ],
    );
    let workers = servers.nginx_workers();
    let mut rows = Vec::new();
    let (mut ratios, mut busiest) = (Vec::new(), Vec::new());
    for round in 0..opts.keepalive_rounds {
        crate::check_cancelled()?;
        eprintln!(
            "bench: keep-alive p99 investigation, round {}/{}...",
            round + 1,
            opts.keepalive_rounds
        );
        servers.check()?;
        let before = lb_status();
        let (k0, q0, s0) = (ksoftirqd_ticks(), time_squeeze(), sched_ns(&workers));
        let (lb, _) = wrk(lab, &urls[0], opts, opts.seconds, false)?;
        let (k1, q1, s1) = (ksoftirqd_ticks(), time_squeeze(), sched_ns(&workers));
        let split = backend_split(&before, &lb_status());
        let (hp, _) = wrk(lab, &urls[1], opts, opts.seconds, false)?;
        let (k2, q2, s2) = (ksoftirqd_ticks(), time_squeeze(), sched_ns(&workers));
        // Per second of run, summed over the nginx workers.
        let per_s = |a: u64, b: u64| (b.saturating_sub(a)) as f64 / 1e6 / opts.seconds as f64;
        let (wait_lb, wait_hp) = (per_s(s0.1, s1.1), per_s(s1.1, s2.1));
        let (cpu_lb, cpu_hp) = (per_s(s0.0, s1.0), per_s(s1.0, s2.0));
        // USER_HZ is 100 on Linux: a tick is 10 ms.
        let (ksoft_lb, ksoft_hp) = ((k1 - k0) * 10, (k2 - k1) * 10);
        let (sq_lb, sq_hp) = (q1 - q0, q2 - q1);
        let counts: Vec<u64> = split
            .as_object()
            .map(|m| m.values().filter_map(Value::as_u64).collect())
            .unwrap_or_default();
        let mean = counts.iter().sum::<u64>() as f64 / counts.len().max(1) as f64;
        let top = counts.iter().copied().max().unwrap_or(0) as f64 / mean;
        let ratio = lb.p99_ms / hp.p99_ms;
        ratios.push(ratio);
        busiest.push(top);
        table.row(vec![
            (round + 1).to_string(),
            num(lb.p99_ms, 2),
            num(hp.p99_ms, 2),
            num(ratio, 2),
            counts
                .iter()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join("/"),
            num(top, 2),
            format!("{ksoft_lb}/{ksoft_hp}"),
            format!("{}/{}", num(wait_lb, 0), num(wait_hp, 0)),
            format!("{}/{}", num(cpu_lb, 0), num(cpu_hp, 0)),
        ]);
        rows.push(json!({
            "round": round,
            "xdp_mode": mode,
            "ksoftirqd_ms": { "lb": ksoft_lb, "haproxy": ksoft_hp },
            "time_squeeze": { "lb": sq_lb, "haproxy": sq_hp },
            "nginx_workers_runqueue_wait_ms_per_s": { "lb": wait_lb, "haproxy": wait_hp },
            "nginx_workers_cpu_ms_per_s": { "lb": cpu_lb, "haproxy": cpu_hp },
            "lb": { "requests_per_sec": lb.requests_per_sec, "p50_ms": lb.p50_ms, "p99_ms": lb.p99_ms },
            "haproxy": { "requests_per_sec": hp.requests_per_sec, "p50_ms": hp.p50_ms, "p99_ms": hp.p99_ms },
            "lb_connections_per_backend": split,
            "busiest_over_mean": top,
        }));
    }
    table.note(format!(
        "{} rounds, lb then HAProxy, keep-alive, {} connections; connections per backend \
         from the agent's per-backend new-flow counters; ksoftirqd: CPU time of the \
         ksoftirqd threads during the run (softirq work deferred to threads); nginx wait / \
         cpu: time the {} nginx workers spent waiting on a run queue / running, summed, per \
         second of run (schedstat); softirq squeezes are in the JSON. Median lb / haproxy \
         p99: {}.",
        opts.keepalive_rounds,
        opts.connections,
        workers.len(),
        num(median(&ratios), 2)
    ));
    Ok((table, json!({ "rounds": rows })))
}

/// Shares of HAProxy's keep-alive rate (wrk's median) that the open-loop comparison
/// offers both targets.
pub const OPEN_LOOP_SHARES: [f64; 3] = [0.25, 0.5, 0.75];

/// Keep-alive latency of lb and HAProxy at the same offered request rates (open loop,
/// `openloop`), rounds interleaved with the order alternating. Returns the table, the
/// JSON and, per share of `OPEN_LOOP_SHARES`, the median over rounds of lb's p99 over
/// HAProxy's.
pub fn rate_matched(
    lab: &Lab,
    servers: &mut Servers,
    opts: &Options,
    haproxy_rate: f64,
) -> Result<(Table, Value, Vec<f64>)> {
    let targets = [
        ("lb", SocketAddr::new(lab.vip4(), 80)),
        ("haproxy", SocketAddr::new(lab.lb_addr(false), 80)),
    ];
    let mut table = Table::new(
        "Keep-alive at the same request rate (open loop), lb against HAProxy (medians)",
        &[
            "offered req/s",
            "share of HAProxy max",
            "lb p50 / p99 ms",
            "haproxy p50 / p99 ms",
            "lb / haproxy p99",
            "answered req/s lb / hap",
            "errors lb / hap",
        ],
    );
    let mut rows = Vec::new();
    let mut p99_ratios = Vec::new();
    for share in OPEN_LOOP_SHARES {
        let load = crate::openloop::Load {
            rate: (haproxy_rate * share).max(100.0),
            connections: opts.connections as usize,
            duration: Duration::from_secs(opts.seconds as u64),
        };
        // [target] -> runs
        let mut runs: Vec<Vec<crate::openloop::Latencies>> = vec![Vec::new(), Vec::new()];
        for round in 0..opts.rounds {
            crate::check_cancelled()?;
            let order: [usize; 2] = if round % 2 == 0 { [0, 1] } else { [1, 0] };
            for ti in order {
                eprintln!(
                    "bench: open loop at {:.0} req/s, round {}/{}, {}...",
                    load.rate,
                    round + 1,
                    opts.rounds,
                    targets[ti].0
                );
                servers.check()?;
                let addr = targets[ti].1;
                let result = lab.client().run(|| crate::openloop::run(addr, &load))??;
                rows.push(json!({
                    "offered_rate": load.rate,
                    "share_of_haproxy_max": share,
                    "round": round,
                    "target": targets[ti].0,
                    "answered_rate": result.achieved_rate,
                    "completed": result.completed,
                    "errors": result.errors,
                    "p50_ms": result.p50_ms,
                    "p90_ms": result.p90_ms,
                    "p99_ms": result.p99_ms,
                    "max_ms": result.max_ms,
                }));
                runs[ti].push(result);
            }
        }
        let med = |ti: usize, f: fn(&crate::openloop::Latencies) -> f64| {
            median(&runs[ti].iter().map(f).collect::<Vec<_>>())
        };
        let ratio = median(
            &runs[0]
                .iter()
                .zip(&runs[1])
                .map(|(a, b)| a.p99_ms / b.p99_ms)
                .collect::<Vec<_>>(),
        );
        p99_ratios.push(ratio);
        let errors = |ti: usize| runs[ti].iter().map(|r| r.errors).sum::<u64>();
        table.row(vec![
            num(load.rate, 0),
            num(share, 2),
            format!(
                "{} / {}",
                num(med(0, |r| r.p50_ms), 2),
                num(med(0, |r| r.p99_ms), 2)
            ),
            format!(
                "{} / {}",
                num(med(1, |r| r.p50_ms), 2),
                num(med(1, |r| r.p99_ms), 2)
            ),
            num(ratio, 2),
            format!(
                "{} / {}",
                num(med(0, |r| r.achieved_rate), 0),
                num(med(1, |r| r.achieved_rate), 0)
            ),
            format!("{} / {}", errors(0), errors(1)),
        ]);
    }
    table.note(format!(
        "{} keep-alive connections, each sending on a fixed schedule; latency from when a \
         request was due to its whole answer (a slow answer delays the requests behind it, \
         and they count it); {} rounds of {} s per rate, lb and HAProxy alternating first. \
         Offered rates are shares of HAProxy's keep-alive req/s under wrk above.",
        opts.connections, opts.rounds, opts.seconds
    ));
    Ok((
        table,
        json!({ "haproxy_wrk_rate": haproxy_rate, "runs": rows }),
        p99_ratios,
    ))
}

/// New flows per backend of the first VIP between two `lb status --json` answers.
fn backend_split(before: &Value, after: &Value) -> Value {
    let get = |s: &Value| -> Vec<(String, u64)> {
        s["vips"][0]["backends"]
            .as_array()
            .map(|bs| {
                bs.iter()
                    .map(|b| {
                        (
                            b["address"].as_str().unwrap_or("?").to_string(),
                            b["new_flows"].as_u64().unwrap_or(0),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default()
    };
    let (b, a) = (get(before), get(after));
    let m: serde_json::Map<String, Value> = a
        .iter()
        .map(|(addr, n)| {
            let was = b.iter().find(|(x, _)| x == addr).map_or(0, |(_, v)| *v);
            (addr.clone(), json!(n.saturating_sub(was)))
        })
        .collect();
    Value::Object(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_wrk_latency_output() {
        let out = "Running 5s test @ http://10.99.0.100/\n  2 threads and 50 connections\n\
  Thread Stats   Avg      Stdev     Max   +/- Stdev\n    Latency     1.57ms    2.01ms  40.34ms   93.01%\n\
    Req/Sec    17.96k     1.30k   20.84k    72.00%\n  Latency Distribution\n     50%  850.00us\n\
     75%    1.61ms\n     90%    3.02ms\n     99%   10.12ms\n  178771 requests in 5.00s, 26.77MB read\n\
  Socket errors: connect 0, read 3, write 0, timeout 1\nRequests/sec:  35723.30\nTransfer/sec:      5.35MB\n";
        let w = parse_wrk(out).unwrap();
        assert_eq!(w.requests_per_sec, 35723.30);
        assert_eq!(w.p50_ms, 0.85);
        assert_eq!(w.p99_ms, 10.12);
        assert_eq!(w.requests, 178771);
        assert_eq!(w.socket_errors, 4);
    }
}
