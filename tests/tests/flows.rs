//! End to end: the connection table, draining and runtime control, with real TCP from a
//! client namespace through the real `lb` agent and XDP program (native mode) to
//! backends that answer directly (DSR). Long-lived connections keep exchanging data
//! while backends are added, re-weighted, drained, put in maintenance, removed, and
//! the configuration is reloaded; `lb status`, `lb explain` and the connection-table
//! counters must agree with what the client saw.
//!
//! Each test builds its own lab (unique namespace names), so they run in parallel with
//! the other end-to-end tests. Needs root, bpffs, the eBPF object and a built `lb`
//! (`cargo build --workspace`, or `LB_BIN`); otherwise each test prints `SKIPPED` (or
//! fails under `LB_REQUIRE_ALL_TESTS=1`). `cargo test -p lb-tests --test flows`.

use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::thread::sleep;
use std::time::{Duration, Instant};

use lb_tests::agent::{CliOutput, run_lb};
use lb_tests::client::{ChatReport, Chatter};
use lb_tests::{
    AgentConfig, Conn, Health, Lab, LabOptions, Protocol, Spread, XdpMode, require_e2e, spread,
};
use serde_json::Value;

const TIMEOUT: Duration = Duration::from_secs(2);
const VIP_NAME: &str = "web";
const PORT: u16 = 80;
/// The agent counts active flows every 2 s.
const SCAN_PERIOD: Duration = Duration::from_secs(2);
/// One round of exchanges on every long-lived connection this often.
const CHAT_INTERVAL: Duration = Duration::from_millis(100);
/// Upper bound of any chatter (a test stops it well before).
const CHAT_MAX: Duration = Duration::from_secs(35);

/// A lab of `in_lab` backends, all serving TCP on port 80, and the agent (native mode)
/// serving VIP `web` (10.99.0.100:80/tcp, no health checks) with the first `in_config`
/// of them. Returns the lab and the config it runs with.
fn start(
    bin: &Path,
    in_lab: usize,
    in_config: usize,
    drain_timeout: Option<Duration>,
) -> (Lab, AgentConfig) {
    let mut lab = Lab::new(LabOptions {
        backends: in_lab,
        ..LabOptions::default()
    })
    .expect("build the lab");
    lab.serve_tcp(PORT, false)
        .expect("start the backends' tcp servers");
    let mut vip = lab.vip(VIP_NAME, false, PORT, Protocol::Tcp, Health::None);
    vip.backends.truncate(in_config);
    vip.drain_timeout = drain_timeout;
    let config = lab.agent_config(XdpMode::Native, vec![vip]);
    lab.start_agent(bin, &config).expect("start the agent");
    (lab, config)
}

fn vip_addr(lab: &Lab) -> SocketAddr {
    SocketAddr::new(lab.vip4(), PORT)
}

/// `10.99.0.100:80/tcp`, as the commands name the VIP.
fn target(lab: &Lab) -> String {
    format!("{}/tcp", vip_addr(lab))
}

/// Backend `i`'s (0-based) IPv4 address, as a string for the command line.
fn addr(lab: &Lab, i: usize) -> String {
    lab.backend_addr(i, false).to_string()
}

/// The address of the backend whose server greets with `name` (`backend-N`).
fn addr_of(lab: &Lab, name: &str) -> IpAddr {
    (0..lab.backends().len())
        .find(|&i| lab.backend_name(i) == name)
        .map(|i| lab.backend_addr(i, false))
        .unwrap_or_else(|| panic!("no backend named {name:?} in the lab"))
}

fn agent(lab: &Lab) -> &lb_tests::Agent {
    lab.agent().expect("the lab runs an agent")
}

/// `lb ARGS... --socket PATH`, whatever its outcome.
fn cli(lab: &Lab, args: &[&str]) -> CliOutput {
    agent(lab)
        .cli(args)
        .unwrap_or_else(|e| panic!("lb {}: {e:#}", args.join(" ")))
}

/// `lb ARGS...`, which must succeed.
fn ok(lab: &Lab, args: &[&str]) -> CliOutput {
    let out = cli(lab, args);
    assert!(
        out.success(),
        "`lb {}` failed: {out}\nagent log:\n{}",
        args.join(" "),
        lab.agent_log()
    );
    out
}

/// `lb ARGS...`, which must fail with a message on stderr naming each of `named`.
fn refused(lab: &Lab, args: &[&str], named: &[&str]) -> CliOutput {
    let out = cli(lab, args);
    assert!(
        !out.success(),
        "`lb {}` succeeded, but must be refused: {out}",
        args.join(" ")
    );
    for word in named {
        assert!(
            out.stderr.contains(word),
            "`lb {}`: its message does not name {word:?}: {out}",
            args.join(" ")
        );
    }
    out
}

fn status(lab: &Lab) -> Value {
    agent(lab)
        .status_json()
        .unwrap_or_else(|e| panic!("lb status --json: {e:#}\nagent log:\n{}", lab.agent_log()))
}

/// VIP `web` in a status.
fn vip_status(status: &Value) -> &Value {
    status["vips"]
        .as_array()
        .and_then(|vips| vips.iter().find(|v| v["name"] == VIP_NAME))
        .unwrap_or_else(|| panic!("no VIP {VIP_NAME:?} in lb status --json:\n{status:#}"))
}

/// Backend `addr` of VIP `web` in a status, if it is there.
fn backend(status: &Value, addr: IpAddr) -> Option<&Value> {
    vip_status(status)["backends"].as_array().and_then(|bs| {
        bs.iter()
            .find(|b| b["address"].as_str().and_then(|a| a.parse().ok()) == Some(addr))
    })
}

/// Backend `addr` of VIP `web`, which must be there.
fn must_backend(status: &Value, addr: IpAddr) -> &Value {
    backend(status, addr)
        .unwrap_or_else(|| panic!("no backend {addr} under {VIP_NAME:?} in:\n{status:#}"))
}

/// What an operator configured or commanded, per backend of VIP `web`: (address,
/// weight, state, in_table, slots). Traffic counters left out: they move.
fn shape(status: &Value) -> Vec<(String, u64, String, bool, u64)> {
    vip_status(status)["backends"]
        .as_array()
        .map(|bs| {
            bs.iter()
                .map(|b| {
                    (
                        b["address"].as_str().unwrap_or("?").to_string(),
                        b["weight"].as_u64().unwrap_or(0),
                        b["state"].as_str().unwrap_or("?").to_string(),
                        b["in_table"].as_bool().unwrap_or(false),
                        b["slots"].as_u64().unwrap_or(0),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

fn counter(status: &Value, name: &str) -> u64 {
    status["counters"][name]
        .as_u64()
        .unwrap_or_else(|| panic!("no counter {name:?} in lb status --json:\n{status:#}"))
}

/// Polls `lb status --json` every 100 ms until `until` holds; fails after `timeout`
/// naming `what`, with the last status and the agent's log. Returns the status that
/// satisfied it and how long it took.
fn wait_status(
    lab: &Lab,
    timeout: Duration,
    what: &str,
    until: impl Fn(&Value) -> bool,
) -> (Value, Duration) {
    let start = Instant::now();
    loop {
        let s = status(lab);
        if until(&s) {
            return (s, start.elapsed());
        }
        assert!(
            start.elapsed() < timeout,
            "not within {timeout:?}: {what}\nlast status:\n{s:#}\nagent log:\n{}",
            lab.agent_log()
        );
        sleep(Duration::from_millis(100));
    }
}

/// `n` new connections to the VIP, every one answered.
fn spread_ok(lab: &Lab, n: usize, when: &str) -> Spread {
    let s = spread(lab.client(), vip_addr(lab), n).expect("spread");
    assert_eq!(
        s.failures,
        0,
        "{when}: {} of {n} new connections failed: {:?}\n{}\nagent log:\n{}",
        s.failures,
        s.errors,
        s.table(),
        lab.agent_log()
    );
    eprintln!("{when}:\n{}", s.table());
    s
}

/// `n` new connections to the VIP from a client thread pinned to `cpu`: their packets
/// meet the program on that CPU (a veth runs its peer's XDP where the sender runs).
fn spread_on_cpu(lab: &Lab, n: usize, cpu: usize) -> Spread {
    let addr = vip_addr(lab);
    let s = lb_tests::client::spread_with(
        lab.client(),
        n,
        move |i| {
            if i == 0 {
                let mut set = nix::sched::CpuSet::new();
                set.set(cpu).map_err(std::io::Error::other)?;
                nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set)
                    .map_err(std::io::Error::other)?;
            }
            lb_tests::client::tcp_request_here(addr, Duration::from_secs(2))
        },
        || false,
    )
    .expect("spread");
    assert_eq!(s.failures, 0, "on CPU {cpu}: {:?}\n{}", s.errors, s.table());
    s
}

fn count(s: &Spread, name: &str) -> usize {
    s.counts.get(name).copied().unwrap_or(0)
}

/// `lb explain VIP SRC --json` for the flow from `local`.
fn explain(lab: &Lab, local: SocketAddr) -> Value {
    let t = target(lab);
    let src = local.to_string();
    let out = ok(lab, &["explain", &t, &src, "--json"]);
    serde_json::from_str(&out.stdout)
        .unwrap_or_else(|e| panic!("lb explain --json printed no JSON ({e}): {out}"))
}

/// `field` of an explanation names backend `addr`.
fn explains_to(e: &Value, field: &str, addr: IpAddr) -> bool {
    e[field]
        .as_str()
        .and_then(|b| b.parse::<IpAddr>().ok())
        .is_some_and(|b| b == addr)
}

/// Long-lived connections to the VIP, each with the backend that greeted it.
fn open_conns(lab: &Lab, n: usize) -> Vec<Conn> {
    (0..n)
        .map(|i| {
            Conn::open(lab.client(), vip_addr(lab), TIMEOUT)
                .unwrap_or_else(|e| panic!("long-lived connection {i}: {e}"))
        })
        .collect()
}

/// Every chatting connection is intact: no failure, and every round of exchanges done.
fn assert_chat_intact(lab: &Lab, reports: &[ChatReport], rounds: usize) {
    for (i, r) in reports.iter().enumerate() {
        assert!(
            r.error.is_none(),
            "long-lived connection {i} ({:?}, greeted by {}) broke after {} exchanges: {:?}\n\
             agent log:\n{}",
            r.local,
            r.backend,
            r.exchanges,
            r.error,
            lab.agent_log()
        );
        assert!(
            r.exchanges + 1 >= rounds && r.exchanges > 0,
            "connection {i} did {} exchanges in {rounds} rounds",
            r.exchanges
        );
    }
}

/// Issue 3: 12 long-lived connections keep exchanging data (a round every 100 ms for
/// at least 8 s) while two backends are added at runtime, the weights change by a
/// reload of the file, and a backend no connection uses is removed. No connection
/// breaks, loses a byte or changes backend (per the echo and `lb explain`), the data
/// path never misses the connection table for a non-SYN packet and re-hashes nothing,
/// and new connections do reach the added backends.
#[test]
fn runtime_changes_keep_open_connections_on_their_backends() {
    let test = "runtime_changes_keep_open_connections_on_their_backends";
    let Some(bin) = require_e2e(test) else { return };
    let started = Instant::now();
    // Five backends in the lab, the first three in the initial config.
    let (lab, mut config) = start(&bin, 5, 3, None);
    let t = target(&lab);
    let (b4, b5) = (addr(&lab, 3), addr(&lab, 4));

    let conns = open_conns(&lab, 12);
    let initial = [0, 1, 2].map(|i| lab.backend_name(i));
    for c in &conns {
        assert!(
            initial.contains(&c.backend().to_string()),
            "a connection reached {} before it was configured",
            c.backend()
        );
    }
    let chat_began = Instant::now();
    let chatter = Chatter::start(conns, CHAT_INTERVAL, CHAT_MAX);
    assert!(
        chatter.wait_rounds(3, Duration::from_secs(5)),
        "the long-lived connections do not exchange data"
    );

    // (a) Two backends added at runtime; they take new flows once their MAC is known.
    for b in [&b4, &b5] {
        let out = ok(&lab, &["backend", "add", &t, b]);
        assert!(
            out.stdout.contains(b.as_str()) && out.stdout.contains("added"),
            "lb backend add does not say what it did: {out}"
        );
    }
    let (a4, a5) = (lab.backend_addr(3, false), lab.backend_addr(4, false));
    wait_status(
        &lab,
        Duration::from_secs(5),
        "the added backends in the table",
        |s| {
            [a4, a5].iter().all(|&a| {
                backend(s, a).is_some_and(|b| b["in_table"] == true && b["state"] == "ready")
            })
        },
    );
    let s = spread_ok(&lab, 60, "after adding backend-4 and backend-5");
    for i in [3, 4] {
        let name = lab.backend_name(i);
        assert!(
            count(&s, &name) > 0,
            "{name} got no new connection after it was added:\n{}",
            s.table()
        );
    }

    // (b) Weights changed by rewriting the file (which now lists all five backends).
    let weights = [3, 1, 1, 2, 1];
    config.vips[0].backends = lab
        .vip(VIP_NAME, false, PORT, Protocol::Tcp, Health::None)
        .backends;
    for (b, w) in config.vips[0].backends.iter_mut().zip(weights) {
        b.weight = w;
    }
    std::fs::write(agent(&lab).config_path(), config.to_toml()).expect("rewrite the config");
    let out = ok(&lab, &["reload"]);
    // Old -> new; the backends added at runtime are in the file now: nothing undone.
    for line in [
        format!(
            "reloaded: vip {VIP_NAME}: backend {}: weight 1 -> 3",
            addr(&lab, 0)
        ),
        format!("reloaded: vip {VIP_NAME}: backend {b4}: weight 1 -> 2"),
    ] {
        assert!(
            out.stdout.contains(&line),
            "lb reload does not print {line:?}: {out}"
        );
    }
    assert!(!out.stdout.contains("undoes"), "{out}");
    let st = status(&lab);
    for (i, w) in weights.iter().enumerate() {
        let b = must_backend(&st, lab.backend_addr(i, false));
        assert_eq!(b["weight"], *w, "backend {i} after the reload:\n{st:#}");
    }
    let slots = |i: usize| must_backend(&st, lab.backend_addr(i, false))["slots"].as_u64();
    assert!(
        slots(0) > slots(1) && slots(3) > slots(4),
        "the slots do not follow the weights {weights:?}:\n{st:#}"
    );
    let s = spread_ok(&lab, 60, "after the weights changed");
    assert!(
        count(&s, &lab.backend_name(3)) > 0,
        "backend-4 (weight 2) got no new connection:\n{}",
        s.table()
    );

    // (c) A backend that none of the long-lived connections uses is removed.
    let removed_at = Instant::now();
    let out = ok(&lab, &["backend", "remove", &t, &b5]);
    assert!(
        out.stdout.contains(b5.as_str()) && out.stdout.contains("removed once drained"),
        "lb backend remove does not say what it did: {out}"
    );
    wait_status(
        &lab,
        SCAN_PERIOD * 3,
        "the removed backend-5 gone from the status",
        |s| backend(s, a5).is_none(),
    );
    eprintln!(
        "backend-5 left the status {:?} after lb backend remove",
        removed_at.elapsed()
    );
    let s = spread_ok(&lab, 40, "after removing backend-5");
    assert_eq!(
        count(&s, &lab.backend_name(4)),
        0,
        "a new connection reached the removed backend-5:\n{}",
        s.table()
    );

    // At least 8 s of exchanges in all, then the verdict.
    let min_rounds = 80;
    assert!(
        chatter.wait_rounds(min_rounds, Duration::from_secs(20)),
        "the long-lived connections made {} rounds in {:?}",
        chatter.rounds(),
        chat_began.elapsed()
    );
    let rounds = chatter.rounds();
    let reports = chatter.stop();
    let rounds = rounds.max(reports.iter().map(|r| r.exchanges).max().unwrap_or(0));
    assert_chat_intact(&lab, &reports, rounds);
    for (i, r) in reports.iter().enumerate() {
        let local = r.local.expect("the connection's local address");
        let e = explain(&lab, local);
        let home = addr_of(&lab, &r.backend);
        assert!(
            explains_to(&e, "conntrack_backend", home)
                && explains_to(&e, "next_packet_backend", home),
            "connection {i} from {local} was greeted by {} ({home}), but lb explain says:\n{e:#}",
            r.backend
        );
    }
    let bytes: usize = reports.iter().map(|r| r.bytes).sum();
    for (i, r) in reports.into_iter().enumerate() {
        r.conn
            .close()
            .unwrap_or_else(|e| panic!("closing long-lived connection {i}: {e}"));
    }
    let st = status(&lab);
    assert_eq!(
        counter(&st, "ct_miss_non_syn"),
        0,
        "non-SYN packets missed the connection table:\n{st:#}"
    );
    assert_eq!(
        counter(&st, "ct_rehash"),
        0,
        "flows were re-hashed to another backend:\n{st:#}"
    );
    eprintln!(
        "{test}: 12 connections, {rounds} rounds, {bytes} bytes echoed intact; {:?} in all",
        started.elapsed()
    );
}

/// Issue 5, drain: a connection to backend X keeps exchanging data while X drains; no
/// new connection reaches X, the status says `draining` (with the open flow counted)
/// for as long as the connection is open, and `drained` within a few scan periods of
/// the client closing it (long before the drain timeout). `lb ready` brings X back.
#[test]
fn drain_keeps_an_open_connection_until_it_closes() {
    let test = "drain_keeps_an_open_connection_until_it_closes";
    let Some(bin) = require_e2e(test) else { return };
    // A drain timeout far beyond the test: only the flow count can end the drain.
    let drain_timeout = Duration::from_secs(60);
    let (lab, _config) = start(&bin, 3, 3, Some(drain_timeout));
    let t = target(&lab);

    let conn = open_conns(&lab, 1).pop().expect("one connection");
    let x_name = conn.backend().to_string();
    let x = addr_of(&lab, &x_name);
    let xs = x.to_string();
    let local = conn.local_addr().expect("local address");
    let chatter = Chatter::start(vec![conn], CHAT_INTERVAL, CHAT_MAX);
    assert!(
        chatter.wait_rounds(3, Duration::from_secs(5)),
        "the long-lived connection does not exchange data"
    );

    let out = ok(&lab, &["drain", &t, &xs]);
    assert!(
        out.stdout.contains(&xs) && out.stdout.contains("drain"),
        "lb drain does not say what it did: {out}"
    );
    let drain_began = Instant::now();
    let st = status(&lab);
    let b = must_backend(&st, x);
    assert_eq!(b["state"], "draining", "{x} right after lb drain:\n{st:#}");
    assert_eq!(b["in_table"], false, "{x} right after lb drain:\n{st:#}");
    assert_eq!(b["slots"], 0, "{x} right after lb drain:\n{st:#}");

    let s = spread_ok(&lab, 60, "while draining");
    assert_eq!(
        count(&s, &x_name),
        0,
        "new connections reached the draining {x_name}:\n{}",
        s.table()
    );

    // Two scans after the drain began: still draining, its one open flow counted.
    let (st, _) = wait_status(
        &lab,
        SCAN_PERIOD * 4,
        "the open connection counted among the draining backend's active flows",
        |s| must_backend(s, x)["active_flows"].as_u64() >= Some(1),
    );
    assert_eq!(
        must_backend(&st, x)["active_flows"],
        1,
        "only one connection to {x} is open:\n{st:#}"
    );
    sleep((SCAN_PERIOD * 2 + Duration::from_millis(500)).saturating_sub(drain_began.elapsed()));
    let st = status(&lab);
    let b = must_backend(&st, x);
    assert_eq!(
        b["state"],
        "draining",
        "{x} left draining {:?} after lb drain while a connection to it is open:\n{st:#}",
        drain_began.elapsed()
    );
    let e = explain(&lab, local);
    assert!(
        explains_to(&e, "conntrack_backend", x) && explains_to(&e, "next_packet_backend", x),
        "the open connection from {local} is not on {x} per lb explain:\n{e:#}"
    );

    let rounds = chatter.rounds();
    let reports = chatter.stop();
    assert_chat_intact(&lab, &reports, rounds);
    let report = reports.into_iter().next().expect("one report");
    eprintln!(
        "{test}: the connection to {x_name} made {} exchanges ({} bytes), {:?} of them during \
         the drain",
        report.exchanges,
        report.bytes,
        drain_began.elapsed()
    );
    report
        .conn
        .close()
        .expect("closing the long-lived connection");

    let (_, took) = wait_status(
        &lab,
        Duration::from_secs(10),
        "the draining backend drained after its last connection closed",
        |s| must_backend(s, x)["state"] == "drained",
    );
    eprintln!("{test}: {x} drained {took:?} after its last connection closed");
    assert!(
        drain_began.elapsed() < drain_timeout,
        "drained only at the drain timeout"
    );
    let out = ok(&lab, &["ready", &t, &xs]);
    assert!(out.stdout.contains(&xs), "lb ready: {out}");
    let st = status(&lab);
    let b = must_backend(&st, x);
    assert_eq!(b["state"], "ready", "{x} after lb ready:\n{st:#}");
    assert_eq!(b["in_table"], true, "{x} after lb ready:\n{st:#}");
    let s = spread_ok(&lab, 60, "after lb ready");
    assert!(
        count(&s, &x_name) > 0,
        "{x_name} got no new connection after lb ready:\n{}",
        s.table()
    );
    let st = status(&lab);
    assert_eq!(
        counter(&st, "ct_miss_non_syn"),
        0,
        "non-SYN packets missed the connection table:\n{st:#}"
    );
}

/// Drain timeout: a connection that keeps exchanging data holds its draining backend
/// only until the VIP's `drain_timeout`; then the backend is `drained`, the connection's
/// next packets are re-hashed to another backend (`ct_rehash`), which knows nothing of
/// it, so the connection breaks, as an operator who set the timeout asked.
#[test]
fn drain_timeout_ends_the_drain_and_moves_open_flows() {
    let test = "drain_timeout_ends_the_drain_and_moves_open_flows";
    let Some(bin) = require_e2e(test) else { return };
    let drain_timeout = Duration::from_secs(2);
    let (lab, _config) = start(&bin, 3, 3, Some(drain_timeout));
    let t = target(&lab);

    let conn = open_conns(&lab, 1).pop().expect("one connection");
    let x_name = conn.backend().to_string();
    let x = addr_of(&lab, &x_name);
    let local = conn.local_addr().expect("local address");
    let chatter = Chatter::start(vec![conn], CHAT_INTERVAL, CHAT_MAX);
    assert!(
        chatter.wait_rounds(3, Duration::from_secs(5)),
        "the long-lived connection does not exchange data"
    );
    let rehash_before = counter(&status(&lab), "ct_rehash");

    // Taken before the command: the agent starts the drain while answering it.
    let drain_began = Instant::now();
    ok(&lab, &["drain", &t, &x.to_string()]);
    let (_, took) = wait_status(
        &lab,
        drain_timeout + SCAN_PERIOD * 3,
        "the draining backend drained at its drain timeout",
        |s| must_backend(s, x)["state"] == "drained",
    );
    eprintln!("{test}: {x} drained {took:?} after lb drain (timeout {drain_timeout:?})");
    assert!(
        drain_began.elapsed() >= drain_timeout,
        "drained after {:?}, before the drain timeout, while its connection was busy",
        drain_began.elapsed()
    );

    // The next exchanges go to another backend, which answers with a reset.
    let moved = wait_status(
        &lab,
        Duration::from_secs(5),
        "the open connection's packets re-hashed",
        |s| counter(s, "ct_rehash") > rehash_before,
    );
    let e = explain(&lab, local);
    assert!(
        !explains_to(&e, "next_packet_backend", x),
        "after the drain timeout the flow from {local} still goes to {x}:\n{e:#}\n{:#}",
        moved.0
    );
    // A re-hashed pure ACK draws its reset only on the next exchange: let the chatter
    // run until its rounds stop (it stops at its first failure), at most 5 s.
    let mut rounds = chatter.rounds();
    let settle = Instant::now();
    while settle.elapsed() < Duration::from_secs(5) {
        sleep(CHAT_INTERVAL * 5);
        let now = chatter.rounds();
        if now == rounds {
            break;
        }
        rounds = now;
    }
    let reports = chatter.stop();
    let report = reports.into_iter().next().expect("one report");
    let (when, error) = report
        .error
        .clone()
        .unwrap_or_else(|| panic!("the connection to {x_name} survived its re-hash"));
    eprintln!(
        "{test}: the connection broke {when:?} after the chat began ({error}), after {} \
         exchanges",
        report.exchanges
    );
    assert!(
        report.exchanges >= 3,
        "the connection did not exchange data before the drain"
    );
}

/// Issue 5, maint: `lb maint` takes a backend out at once: the status says `maint`, no
/// new connection reaches it, and not even a packet of a connection opened before (it
/// is re-hashed to another backend, where it breaks: expected with DSR). `lb ready`
/// brings it back.
#[test]
fn maint_takes_a_backend_out_at_once() {
    let test = "maint_takes_a_backend_out_at_once";
    let Some(bin) = require_e2e(test) else { return };
    let (lab, _config) = start(&bin, 3, 3, None);
    let t = target(&lab);
    let m_name = lab.backend_name(1);
    let m = lab.backend_addr(1, false);
    let ms = m.to_string();

    // A connection to the backend about to go into maintenance (at most 40 tries).
    let mut on_m = None;
    for _ in 0..40 {
        let c = open_conns(&lab, 1).pop().expect("one connection");
        if c.backend() == m_name {
            on_m = Some(c);
            break;
        }
    }
    let mut on_m = on_m.unwrap_or_else(|| panic!("40 connections and none reached {m_name}"));
    on_m.echo(b"before maint\n").expect("echo before maint");
    // Counted from before the command: the connection's last ACK may reach the balancer
    // just after it, and be the packet re-hashed (its entry then names the new backend).
    let rehash_before = counter(&status(&lab), "ct_rehash");

    let out = ok(&lab, &["maint", &t, &ms]);
    assert!(
        out.stdout.contains(&ms) && out.stdout.contains("maint"),
        "lb maint does not say what it did: {out}"
    );
    let st = status(&lab);
    let b = must_backend(&st, m);
    assert_eq!(b["state"], "maint", "{m} after lb maint:\n{st:#}");
    assert_eq!(b["in_table"], false, "{m} after lb maint:\n{st:#}");
    assert_eq!(b["slots"], 0, "{m} after lb maint:\n{st:#}");
    let packets_before = b["packets"].as_u64();

    let s = spread_ok(&lab, 60, "with backend-2 in maintenance");
    assert_eq!(
        count(&s, &m_name),
        0,
        "new connections reached {m_name} in maintenance:\n{}",
        s.table()
    );

    // The old connection's next packet goes elsewhere (and, with DSR, breaks there).
    let local = on_m.local_addr().expect("local address");
    let e = explain(&lab, local);
    assert!(
        !explains_to(&e, "next_packet_backend", m),
        "lb explain sends the next packet from {local} to {m} in maintenance:\n{e:#}"
    );
    let r = on_m.echo(b"after maint\n");
    assert!(
        r.is_err(),
        "the connection to {m_name} still echoes after lb maint"
    );
    let st = status(&lab);
    assert_eq!(
        must_backend(&st, m)["packets"].as_u64(),
        packets_before,
        "{m} in maintenance still got packets:\n{st:#}"
    );
    assert!(
        counter(&st, "ct_rehash") > rehash_before,
        "the old connection's packet was not re-hashed:\n{st:#}"
    );

    ok(&lab, &["ready", &t, &ms]);
    let st = status(&lab);
    let b = must_backend(&st, m);
    assert_eq!(b["state"], "ready", "{m} after lb ready:\n{st:#}");
    assert_eq!(b["in_table"], true, "{m} after lb ready:\n{st:#}");
    let s = spread_ok(&lab, 60, "after lb ready");
    assert!(
        count(&s, &m_name) > 0,
        "{m_name} got no new connection after lb ready:\n{}",
        s.table()
    );
}

/// Issue 5, remove and refusals: `lb backend remove` of a backend without open
/// connections (only closed ones) deletes it within a few seconds, and new connections
/// never reach it. Unknown VIPs and backends and malformed addresses are refused with a
/// message naming them, and change nothing; `lb status` with no agent behind the socket
/// fails clearly.
#[test]
fn backend_remove_and_refused_commands() {
    let test = "backend_remove_and_refused_commands";
    let Some(bin) = require_e2e(test) else { return };
    let (lab, _config) = start(&bin, 3, 3, None);
    let t = target(&lab);
    let r_name = lab.backend_name(2);
    let r = lab.backend_addr(2, false);
    let rs = r.to_string();

    // Connections that all closed: entries in the table, none active.
    let s = spread_ok(&lab, 30, "before the removal");
    assert!(count(&s, &r_name) > 0, "{}", s.table());

    // Refusals first, while all three are there: each names what is wrong, and
    // changes nothing.
    let before = shape(&status(&lab));
    let other_vip = format!("{}:{}/tcp", lab.vip4(), PORT + 1);
    let unknown_vip = "10.99.0.200:80/tcp";
    for args in [
        vec!["drain", unknown_vip, rs.as_str()],
        vec!["ready", other_vip.as_str(), rs.as_str()],
        vec!["maint", &format!("{}:{PORT}/udp", lab.vip4()), rs.as_str()],
        vec!["backend", "remove", unknown_vip, rs.as_str()],
        vec!["backend", "add", unknown_vip, "10.99.0.20"],
    ] {
        let vip = args[args.len() - 2];
        refused(&lab, &args, &[vip]);
    }
    let unknown_backend = "10.99.0.99";
    for args in [
        vec!["drain", t.as_str(), unknown_backend],
        vec!["ready", t.as_str(), unknown_backend],
        vec!["maint", t.as_str(), unknown_backend],
        vec!["backend", "remove", t.as_str(), unknown_backend],
    ] {
        refused(&lab, &args, &[unknown_backend]);
    }
    refused(&lab, &["backend", "add", &t, &rs], &[&rs]);
    let malformed = refused(&lab, &["drain", &t, "10.99.0.300"], &["10.99.0.300"]);
    assert_eq!(
        malformed.status.code(),
        Some(2),
        "invalid input: {malformed}"
    );
    refused(&lab, &["drain", &t, "backend-3"], &["backend-3"]);
    refused(
        &lab,
        &["drain", "10.99.0.100/tcp", &rs],
        &["10.99.0.100/tcp"],
    );
    refused(&lab, &["drain", "10.99.0.100:80/sctp", &rs], &["sctp"]);
    refused(
        &lab,
        &["drain", "10.99.0.100:http/tcp", &rs],
        &["10.99.0.100:http"],
    );
    refused(
        &lab,
        &["explain", unknown_vip, "10.99.0.1:40000"],
        &[unknown_vip],
    );
    let zero = refused(
        &lab,
        &["backend", "add", &t, "10.99.0.20", "--weight", "0"],
        &["weight 0 is not allowed"],
    );
    // Refused by the agent: exit 1, and no field path of a file in the message.
    assert_eq!(zero.status.code(), Some(1), "{zero}");
    assert!(!zero.stderr.contains("vip["), "{zero}");
    let after = shape(&status(&lab));
    assert_eq!(before, after, "refused commands changed the backends");

    // No agent behind a socket path: a clear failure naming the path.
    let nowhere = lab.dir().join("no-agent.sock");
    let nowhere_s = nowhere.to_string_lossy().into_owned();
    let out = run_lb(
        agent(&lab).lb_bin(),
        &["status", "--socket", nowhere_s.as_str()],
    )
    .expect("run lb status");
    assert!(
        out.status.code() == Some(1) && out.stderr.contains(&nowhere_s),
        "lb status against {nowhere_s} (no agent) must fail (exit 1) naming it: {out}"
    );
    assert!(out.stdout.is_empty(), "{out}");

    // The removal.
    let out = ok(&lab, &["backend", "remove", &t, &rs]);
    assert!(
        out.stdout.contains(&rs) && out.stdout.contains("removed once drained"),
        "lb backend remove does not say what it did: {out}"
    );
    let (_, took) = wait_status(
        &lab,
        Duration::from_secs(5),
        "the removed backend gone from the status",
        |s| backend(s, r).is_none(),
    );
    eprintln!("{test}: {r} left the status {took:?} after lb backend remove");
    let st = status(&lab);
    assert_eq!(
        vip_status(&st)["backends"].as_array().map(Vec::len),
        Some(2),
        "{st:#}"
    );
    let s = spread_ok(&lab, 60, "after the removal");
    assert_eq!(
        count(&s, &r_name),
        0,
        "new connections reached the removed {r_name}:\n{}",
        s.table()
    );
    // Gone means gone: commands on it are refused now.
    refused(&lab, &["ready", &t, &rs], &[&rs]);
}

/// Issue 5, reload: a broken file (a zero weight; a table size that is no prime) is
/// refused by `lb reload` and by SIGHUP with a message naming the field, and nothing
/// changes (status and traffic); a valid file that adds a backend is applied and the
/// change printed; a reload says which runtime change (`lb drain`) it undoes.
#[test]
fn reload_refuses_a_broken_file_and_applies_a_good_one() {
    let test = "reload_refuses_a_broken_file_and_applies_a_good_one";
    let Some(bin) = require_e2e(test) else { return };
    let (lab, config) = start(&bin, 4, 3, None);
    let t = target(&lab);
    let path = agent(&lab).config_path().to_path_buf();
    let write = |c: &AgentConfig| std::fs::write(&path, c.to_toml()).expect("write the config");

    let s = spread_ok(&lab, 30, "before any reload");
    assert_eq!(s.counts.len(), 3, "{}", s.table());
    let before = shape(&status(&lab));

    // A zero weight.
    let mut broken = config.clone();
    broken.vips[0].backends[1].weight = 0;
    write(&broken);
    let out = refused(&lab, &["reload"], &["vip[0].backend[1].weight"]);
    assert!(!out.stdout.contains("reloaded"), "{out}");
    assert_eq!(
        shape(&status(&lab)),
        before,
        "a refused reload changed the backends"
    );

    // A table size that is no prime.
    let mut broken = config.clone();
    broken.maglev_table_size = Some(65536);
    write(&broken);
    refused(&lab, &["reload"], &["dataplane.maglev_table_size"]);
    assert_eq!(
        shape(&status(&lab)),
        before,
        "a refused reload changed the backends"
    );

    // The same broken file by SIGHUP: logged, refused, the agent goes on.
    let named = |log: &str| log.matches("dataplane.maglev_table_size").count();
    let named_before = named(&lab.agent_log());
    let pid = agent(&lab).pid().expect("agent pid");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGHUP,
    )
    .expect("SIGHUP the agent");
    let deadline = Instant::now() + Duration::from_secs(5);
    while named(&lab.agent_log()) <= named_before {
        assert!(
            Instant::now() < deadline,
            "no log line names the refused field after SIGHUP:\n{}",
            lab.agent_log()
        );
        sleep(Duration::from_millis(50));
    }
    assert_eq!(
        shape(&status(&lab)),
        before,
        "a refused SIGHUP changed the backends"
    );
    let s = spread_ok(&lab, 30, "after the refused reloads");
    assert_eq!(s.counts.len(), 3, "{}", s.table());

    // A valid file that adds backend-4.
    let mut good = config.clone();
    good.vips[0].backends = lab
        .vip(VIP_NAME, false, PORT, Protocol::Tcp, Health::None)
        .backends;
    write(&good);
    let b4 = addr(&lab, 3);
    let a4 = lab.backend_addr(3, false);
    let out = ok(&lab, &["reload"]);
    let line = format!("reloaded: vip {VIP_NAME}: backend {b4} added");
    assert!(
        out.stdout.contains(&line),
        "lb reload does not print {line:?}: {out}"
    );
    wait_status(
        &lab,
        Duration::from_secs(5),
        "the backend added by the reload in the table",
        |s| backend(s, a4).is_some_and(|b| b["in_table"] == true),
    );
    let s = spread_ok(&lab, 60, "after the reload added backend-4");
    assert!(
        count(&s, &lab.backend_name(3)) > 0,
        "backend-4 got no new connection after the reload added it:\n{}",
        s.table()
    );

    // A runtime drain, then a reload of the same file: it says it undoes the drain.
    let b1 = addr(&lab, 0);
    let a1 = lab.backend_addr(0, false);
    ok(&lab, &["drain", &t, &b1]);
    assert_ne!(must_backend(&status(&lab), a1)["state"], "ready");
    let out = ok(&lab, &["reload"]);
    let line = format!("reloaded: undoes runtime change: {t} backend {b1} -> drain");
    assert!(
        out.stdout.contains(&line),
        "lb reload does not print {line:?}: {out}"
    );
    let st = status(&lab);
    let b = must_backend(&st, a1);
    assert_eq!(b["state"], "ready", "{a1} after the reload:\n{st:#}");
    assert_eq!(b["in_table"], true, "{a1} after the reload:\n{st:#}");
    let out = ok(&lab, &["reload"]);
    assert_eq!(out.stdout.trim(), "reloaded: no change", "{out}");
    let s = spread_ok(&lab, 60, "after the reload undid the drain");
    assert_eq!(s.counts.len(), 4, "{}", s.table());
}

/// Every setting fixed at start, changed in the file: `lb reload` refuses it naming the
/// field, and nothing changes (status, traffic, the agent's own config). Thirteen fields,
/// one agent: each variant is the running file plus one change.
#[test]
fn reload_refuses_each_setting_fixed_at_start_and_changes_nothing() {
    use std::os::unix::fs::PermissionsExt;
    let test = "reload_refuses_each_setting_fixed_at_start_and_changes_nothing";
    let Some(bin) = require_e2e(test) else { return };
    let (lab, config) = start(&bin, 3, 3, None);
    let path = agent(&lab).config_path().to_path_buf();
    let running = config.to_toml();
    let key = lab.dir().join("cluster.key");
    std::fs::write(&key, [7u8; 32]).expect("write a cluster key");
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
    let before = shape(&status(&lab));
    let dataplane =
        |line: &str| running.replacen("[dataplane]\n", &format!("[dataplane]\n{line}\n"), 1);
    let control = |from: &str, to: &str| {
        assert!(
            running.contains(from),
            "{from:?} not in the file:\n{running}"
        );
        running.replacen(from, to, 1)
    };
    let socket = format!("socket = \"{}\"", lab.socket_path().display());
    let variants = [
        (
            "dataplane.interface",
            running.replacen("interface = \"", "interface = \"x", 1),
        ),
        (
            "dataplane.xdp_mode",
            running.replacen("xdp_mode = \"native\"", "xdp_mode = \"generic\"", 1),
        ),
        (
            "dataplane.maglev_table_size",
            dataplane("maglev_table_size = 251"),
        ),
        (
            "dataplane.conntrack_entries",
            dataplane("conntrack_entries = 4096"),
        ),
        ("dataplane.max_backends", dataplane("max_backends = 8192")),
        (
            "dataplane.flow_idle_timeout",
            dataplane("flow_idle_timeout = \"17s\""),
        ),
        (
            "dataplane.conntrack_insert_limit",
            dataplane("conntrack_insert_limit = 1234"),
        ),
        (
            "dataplane.pin_path",
            dataplane("pin_path = \"/sys/fs/bpf/lb-elsewhere\""),
        ),
        ("debug", format!("{running}\n[debug]\ncapture_rate = 3\n")),
        (
            "control.socket",
            control(&socket, &socket.replacen(".sock\"", "-2.sock\"", 1)),
        ),
        (
            "control.metrics",
            control("metrics = \"off\"", "metrics = \"127.0.0.1:9651\""),
        ),
        (
            "announce (table, protocol, device)",
            format!("{running}\n[announce]\n"),
        ),
        (
            "cluster (all but peers)",
            format!(
                "{running}\n[cluster]\npeers = [\"10.99.0.250\"]\nkey_file = \"{}\"\n",
                key.display()
            ),
        ),
    ];
    for (field, text) in &variants {
        assert_ne!(text, &running, "{field}: the variant changes nothing");
        std::fs::write(&path, text).expect("write the config");
        let out = refused(&lab, &["reload"], &[field, "restart"]);
        assert!(!out.stdout.contains("reloaded"), "{field}: {out}");
        assert_eq!(
            shape(&status(&lab)),
            before,
            "{field}: a refused reload changed the backends"
        );
    }
    // The agent still serves by the file it started with, and reloads it.
    std::fs::write(&path, &running).expect("write the config");
    let out = ok(&lab, &["reload"]);
    assert_eq!(out.stdout.trim(), "reloaded: no change", "{out}");
    let s = spread_ok(&lab, 30, "after the refused reloads");
    assert_eq!(s.counts.len(), 3, "{}", s.table());
}

/// Issue 36, `stable_slots`: flows in stable slots make no connection-table entry, and
/// a table change that moves their slot moves none of them. 20 long-lived connections
/// open to a VIP with `stable_slots` and two backends (no entry made: `ct_created` 0,
/// their packets counted `ct_stable`); a third backend is added at runtime, which moves
/// about a third of the slots; every connection keeps exchanging data with the backend
/// that greeted it (the ones in moved slots go to the slot's previous backend,
/// `ct_previous`, and are pinned there by an entry) for longer than twice the idle
/// bound, so the scan that turns changed slots stable again must leave the slots of
/// live pinned flows changed. New connections reach the added backend. Once the
/// connections close, the moved slots stay changed past the bound while the connection
/// table has not turned over (an idle flow there would still have had its entry without
/// the setting: `turnover`), and turn stable once enough new connections came after the
/// change (the table is made small for it: `conntrack_entries = 256`, 128 per CPU).
#[test]
fn a_connection_in_a_stable_slot_keeps_its_backend_when_the_slot_moves() {
    let test = "a_connection_in_a_stable_slot_keeps_its_backend_when_the_slot_moves";
    let Some(bin) = require_e2e(test) else { return };
    let idle = Duration::from_secs(3);
    let mut lab = Lab::new(LabOptions {
        backends: 3,
        ..LabOptions::default()
    })
    .expect("build the lab");
    lab.serve_tcp(PORT, false)
        .expect("start the backends' tcp servers");
    let mut vip = lab.vip(VIP_NAME, false, PORT, Protocol::Tcp, Health::None);
    vip.backends.truncate(2);
    vip.extra.push("stable_slots = true".into());
    let mut config = lab.agent_config(XdpMode::Native, vec![vip]);
    config.flow_idle_timeout = Some(idle);
    config.conntrack_entries = Some(256);
    lab.start_agent(&bin, &config).expect("start the agent");
    let changed_slots = |s: &Value| {
        vip_status(s)["changed_slots"]
            .as_u64()
            .unwrap_or_else(|| panic!("no vips[].changed_slots in lb status --json:\n{s:#}"))
    };
    assert_eq!(
        changed_slots(&status(&lab)),
        0,
        "a fresh table is all stable"
    );

    let conns = open_conns(&lab, 20);
    let chatter = Chatter::start(conns, CHAT_INTERVAL, CHAT_MAX);
    assert!(
        chatter.wait_rounds(3, Duration::from_secs(5)),
        "the long-lived connections do not exchange data"
    );
    let st = status(&lab);
    assert_eq!(
        counter(&st, "ct_created"),
        0,
        "connections in stable slots made entries:\n{st:#}"
    );
    assert!(counter(&st, "ct_stable") > 0, "{st:#}");

    let added = addr(&lab, 2);
    ok(&lab, &["backend", "add", &target(&lab), &added]);
    let a3 = lab.backend_addr(2, false);
    let (st, _) = wait_status(
        &lab,
        Duration::from_secs(5),
        "the added backend in the table, its slots changed",
        |s| backend(s, a3).is_some_and(|b| b["in_table"] == true) && changed_slots(s) > 0,
    );
    let moved = changed_slots(&st);
    let changed_at = Instant::now();
    // Fewer new connections than a CPU's share of the table: it cannot have turned over.
    let s = spread_ok(&lab, 20, "after adding backend-3");
    assert!(
        count(&s, &lab.backend_name(2)) > 0,
        "backend-3 got no new connection after it was added:\n{}",
        s.table()
    );
    // Past twice the bound, with scans: no slot turns stable before the connection table
    // turned over (an idle flow in it would still have had its entry without the setting).
    while changed_at.elapsed() < idle * 2 + SCAN_PERIOD {
        sleep(Duration::from_millis(200));
    }
    let st = status(&lab);
    assert_eq!(
        changed_slots(&st),
        moved,
        "moved slots turned stable before the connection table turned over"
    );
    // Status says when the table last turned over: before the change.
    let horizon = |s: &Value| {
        vip_status(s)["turned_over_seconds_ago"]
            .as_u64()
            .map(|ago| Instant::now() - Duration::from_secs(ago))
    };
    let before = horizon(&st);
    assert!(
        before.is_none_or(|h| h <= changed_at + Duration::from_secs(1)),
        "status says the table turned over after the change, but the slots stay changed"
    );
    // The table turned over by new connections: the slots without live pinned flows
    // turn stable, the others stay changed.
    let mut opened = turn_over(&lab, |s| changed_slots(s) < moved);
    let st = status(&lab);
    let held = changed_slots(&st);
    let after = horizon(&st).expect("status says when the table turned over");
    assert!(
        after + Duration::from_secs(1) >= changed_at,
        "slots turned stable, but status says the table last turned over before the change"
    );
    let rounds = chatter.rounds();
    let reports = chatter.stop();
    assert_chat_intact(&lab, &reports, rounds);
    let st = status(&lab);
    // The connections whose slot moved are pinned to their backend by an entry (made
    // at their first packets after the change).
    let mut pinned = 0;
    for r in &reports {
        let local = r.local.expect("the connection's local address");
        let (e, home) = (explain(&lab, local), addr_of(&lab, &r.backend));
        assert!(
            explains_to(&e, "next_packet_backend", home),
            "the connection from {local} was greeted by {home}, but lb explain says:\n{e:#}"
        );
        pinned += usize::from(explains_to(&e, "conntrack_backend", home));
    }
    eprintln!(
        "{pinned} of 20 connections pinned; counters: created {}, promoted {}, previous {}, \
         hit {}, stable {}",
        counter(&st, "ct_created"),
        counter(&st, "ct_promoted"),
        counter(&st, "ct_previous"),
        counter(&st, "ct_hit"),
        counter(&st, "ct_stable")
    );
    assert!(
        pinned > 0,
        "no connection was in a moved slot ({moved} slots moved): nothing was tested\n{st:#}"
    );
    assert_eq!(
        counter(&st, "ct_miss_non_syn"),
        0,
        "non-SYN packets missed:\n{st:#}"
    );
    assert!(
        held > 0 && held < moved,
        "after the turnover, only the slots of live pinned flows stay changed: {held} of {moved}"
    );
    for (i, r) in reports.into_iter().enumerate() {
        r.conn
            .close()
            .unwrap_or_else(|e| panic!("closing long-lived connection {i}: {e}"));
    }
    // Their entries count until the table turned over once more.
    opened += turn_over(&lab, |s| changed_slots(s) == 0);
    eprintln!(
        "{test}: {moved} slots moved, {pinned} of 20 connections in them, {held} slots \
         held changed by live flows after the turnover; all stable after the close and \
         {opened} new connections in all; {rounds} rounds intact"
    );
}

/// Opens new connections to the VIP in batches, on each CPU in turn (an entry lives on
/// the list of the CPU that made it), until `done` holds for the status: the
/// connection table of `a_connection_in_a_stable_slot_keeps_its_backend_when_the_slot_moves`
/// (256 entries, 128 per CPU) turns over. Returns how many it opened.
fn turn_over(lab: &Lab, done: impl Fn(&Value) -> bool) -> usize {
    let cpus = lb_tests::allowed_cpus();
    let mut opened = 0;
    while !done(&status(lab)) {
        assert!(
            opened < 2000,
            "not done after {opened} new connections turned the 256-entry table over:\n{:#}",
            status(lab)
        );
        spread_on_cpu(lab, 100, cpus[(opened / 100) % cpus.len()]);
        opened += 100;
        // A look of the stabilizer (every `idle / 4`) samples the counters, the next scans.
        sleep(SCAN_PERIOD);
    }
    opened
}
