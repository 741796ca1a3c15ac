//! End to end: balancing that follows load (slow start, least-flows, agent checks), with
//! real TCP from a client namespace through the real `lb` agent and XDP program to
//! three backends. What a rule does shows in where new connections go, and what it
//! must not do (break open connections) in long-lived ones that keep echoing.
//!
//! Needs root, bpffs, the eBPF object and a built `lb`; otherwise each test prints
//! `SKIPPED` (or fails under `LB_REQUIRE_ALL_TESTS=1`).
//! `cargo test -p lb-tests --test load`.

use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::thread::sleep;
use std::time::{Duration, Instant};

use lb_tests::{
    Conn, Health, Lab, LabOptions, Protocol, TcpServer, XdpMode, require_e2e, spread, wait_status,
};
use serde_json::Value;

const VIP: &str = "web";
const PORT: u16 = 80;
const TIMEOUT: Duration = Duration::from_secs(2);

/// A lab of three backends serving TCP on [`PORT`], and the agent serving VIP `web`
/// (no health checks) with `extra` lines in its `[[vip]]` table.
fn start(bin: &Path, extra: &[&str]) -> Lab {
    let mut lab = Lab::new(LabOptions::default()).expect("build the lab");
    lab.serve_tcp(PORT, false)
        .expect("start the backends' tcp servers");
    let mut vip = lab.vip(VIP, false, PORT, Protocol::Tcp, Health::None);
    vip.extra = extra.iter().map(|line| line.to_string()).collect();
    let config = lab.agent_config(XdpMode::Native, vec![vip]);
    lab.start_agent(bin, &config).expect("start the agent");
    lab
}

fn target(lab: &Lab) -> String {
    format!("{}:{PORT}/tcp", lab.vip4())
}

fn ctl(lab: &Lab, args: &[&str]) {
    let agent = lab.agent().expect("agent");
    let out = agent.cli(args).expect("run lb");
    assert!(
        out.success(),
        "`lb {}` failed: {out}\nagent log:\n{}",
        args.join(" "),
        lab.agent_log()
    );
}

fn status(lab: &Lab) -> Value {
    lab.agent()
        .expect("agent")
        .status_json()
        .unwrap_or_else(|e| panic!("lb status --json: {e:#}\nagent log:\n{}", lab.agent_log()))
}

fn backend(status: &Value, address: IpAddr) -> Value {
    status["vips"][0]["backends"]
        .as_array()
        .and_then(|bs| {
            bs.iter()
                .find(|b| b["address"].as_str() == Some(&address.to_string()))
        })
        .cloned()
        .unwrap_or_else(|| panic!("no backend {address} in:\n{status:#}"))
}

/// The share of `n` new connections that `name` answered (all must be answered).
fn share_of(lab: &Lab, n: usize, name: &str, when: &str) -> f64 {
    let s = spread(lab.client(), SocketAddr::new(lab.vip4(), PORT), n).expect("spread");
    assert_eq!(s.failures, 0, "{when}: {:?}\n{}", s.errors, s.table());
    eprintln!("{when}:\n{}", s.table());
    s.share(name)
}

/// New flows per sample of the slow-start test, and how far a sampled share may stray from
/// the table's: 0.15 is five standard deviations of a share of 240 flows near a third
/// (sqrt(1/3 * 2/3 / 240) = 0.030), so chance alone fails it about once in two million
/// runs. At 60 flows the same slack was 2.6 deviations, and CI met a late share of 0.50
/// against a table share of 0.33.
const SAMPLE: usize = 240;
const SLACK: f64 = 0.15;

#[test]
fn slow_start_ramps_a_returning_backends_share() {
    let Some(bin) = require_e2e("slow_start_ramps_a_returning_backends_share") else {
        return;
    };
    let lab = start(&bin, &["slow_start = \"6s\""]);
    let (t, returning) = (target(&lab), lab.backend_addr(0, false));
    let name = lab.backend_name(0);
    ctl(&lab, &["maint", &t, &returning.to_string()]);
    assert_eq!(share_of(&lab, 30, &name, "in maintenance"), 0.0);
    ctl(&lab, &["ready", &t, &returning.to_string()]);
    let back = Instant::now();
    let b = backend(&status(&lab), returning);
    assert!(
        b["effective_weight"].as_f64().is_some_and(|w| w <= 0.2),
        "just back, it starts with a small share of its weight: {b:#}"
    );
    assert!(
        b["weight_reason"]
            .as_str()
            .is_some_and(|r| r.starts_with("slow start")),
        "{b:#}"
    );
    // The share is judged against the agent's own table, read after the sample: a
    // loaded machine that samples slowly lets the ramp advance, and the table says by
    // how much (a wall-clock "first second" would not).
    let early = share_of(&lab, SAMPLE, &name, "early in the ramp");
    let early_took = back.elapsed();
    let table = status(&lab)["dataplane"]["maglev_table_size"]
        .as_f64()
        .expect("maglev_table_size");
    let b = backend(&status(&lab), returning);
    let early_slots = b["slots"].as_f64().expect("slots") / table;
    let still_ramping = b["effective_weight"].as_f64().is_some_and(|w| w < 1.0);
    sleep(Duration::from_secs(6).saturating_sub(back.elapsed()) + Duration::from_millis(500));
    let b = backend(&status(&lab), returning);
    assert_eq!(b["effective_weight"], 1.0, "ramped to its weight: {b:#}");
    assert_eq!(b["weight_reason"], "configured", "{b:#}");
    let full_slots = b["slots"].as_f64().expect("slots") / table;
    let late = share_of(&lab, SAMPLE, &name, "after the ramp");
    eprintln!(
        "slow start: {:.0}% of new flows in the first {early_took:?} (its table share then \
         {:.0}%, still ramping: {still_ramping}), {:.0}% after the ramp (table share {:.0}%; \
         an equal share is 33%)",
        early * 100.0,
        early_slots * 100.0,
        late * 100.0,
        full_slots * 100.0
    );
    assert!(
        early <= early_slots + SLACK,
        "early share {early:.2} above what the agent's table gave it ({early_slots:.2}) by \
         the end of the sample"
    );
    assert!(
        early_slots * 2.0 < full_slots || !still_ramping,
        "the ramp did not hold its table share back: {early_slots:.2} then {full_slots:.2}"
    );
    assert!(
        (late - full_slots).abs() <= SLACK,
        "late share {late:.2}, table share {full_slots:.2}"
    );
}

#[test]
fn least_flows_sends_new_flows_away_from_held_connections() {
    let Some(bin) = require_e2e("least_flows_sends_new_flows_away_from_held_connections") else {
        return;
    };
    let lab = start(&bin, &["balance = \"least-flows\""]);
    let t = target(&lab);
    let busy_name = lab.backend_name(0);
    let others = [lab.backend_addr(1, false), lab.backend_addr(2, false)];
    // 40 long-lived connections, all to backend-1: the others are in maintenance.
    for other in others {
        ctl(&lab, &["maint", &t, &other.to_string()]);
    }
    let vip = SocketAddr::new(lab.vip4(), PORT);
    let mut held: Vec<Conn> = (0..40)
        .map(|i| {
            Conn::open(lab.client(), vip, TIMEOUT)
                .unwrap_or_else(|e| panic!("held connection {i}: {e}"))
        })
        .collect();
    assert!(held.iter().all(|c| c.backend() == busy_name));
    for other in others {
        ctl(&lab, &["ready", &t, &other.to_string()]);
    }
    // The agent counts flows every 2 s and moves a weight one step per count.
    let busy = lab.backend_addr(0, false);
    let st = wait_status(
        &lab,
        Duration::from_secs(15),
        "backend-1's weight lowered for its 40 flows",
        |s| backend(s, busy)["effective_weight"].as_f64() <= Some(0.5),
    );
    eprintln!(
        "least-flows weights: {}",
        st["vips"][0]["backends"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| format!(
                "{} {} ({})",
                b["address"], b["effective_weight"], b["weight_reason"]
            ))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let share = share_of(&lab, 90, &busy_name, "new flows with 40 held on backend-1");
    assert!(
        share < 0.25,
        "backend-1 holds 40 flows, yet took {:.0}% of new ones (an equal share is 33%)",
        share * 100.0
    );
    for (i, conn) in held.iter_mut().enumerate() {
        conn.echo(b"still here\n")
            .unwrap_or_else(|e| panic!("held connection {i} broke: {e}"));
    }
}

#[test]
fn an_agent_answering_drain_drains_its_backend() {
    let Some(bin) = require_e2e("an_agent_answering_drain_drains_its_backend") else {
        return;
    };
    let lab = start(
        &bin,
        &["agent = { port = 4500, interval = \"300ms\", timeout = \"200ms\" }"],
    );
    let draining = lab.backend_addr(0, false);
    // The greeting of a test server is its name: this one answers "drain".
    let _agent = TcpServer::start(lab.backend(0), SocketAddr::new(draining, 4500), "drain")
        .expect("agent server");
    let st = wait_status(&lab, Duration::from_secs(10), "backend-1 draining", |s| {
        backend(s, draining)["state"] == "draining" || backend(s, draining)["state"] == "drained"
    });
    assert_eq!(backend(&st, draining)["in_table"], false, "{st:#}");
    // The others have no agent: that changes nothing, and says why.
    let other = backend(&st, lab.backend_addr(1, false));
    assert_eq!(other["state"], "ready", "{other:#}");
    let st = wait_status(
        &lab,
        Duration::from_secs(5),
        "the missing agent shown",
        |s| backend(s, lab.backend_addr(1, false))["agent_error"].is_string(),
    );
    eprintln!(
        "agent error shown: {}",
        backend(&st, lab.backend_addr(1, false))["agent_error"]
    );
    assert_eq!(
        share_of(
            &lab,
            30,
            &lab.backend_name(0),
            "with backend-1's agent saying drain"
        ),
        0.0
    );
}

/// The backends `n` new connections from `local` reached (all must be answered).
fn backends_from(lab: &Lab, local: IpAddr, n: usize) -> Vec<String> {
    let vip = SocketAddr::new(lab.vip4(), PORT);
    (0..n)
        .map(|i| {
            let conn = Conn::open_from(lab.client(), local, vip, TIMEOUT)
                .unwrap_or_else(|e| panic!("connection {i} from {local}: {e}"));
            conn.backend().to_string()
        })
        .collect()
}

fn hot_sources(status: &Value) -> Vec<String> {
    status["vips"][0]["hot_sources"]
        .as_array()
        .map(|hot| {
            hot.iter()
                .filter_map(|s| s["address"].as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn a_hot_source_spreads_over_all_backends_while_another_stays_sticky() {
    let test = "a_hot_source_spreads_over_all_backends_while_another_stays_sticky";
    let Some(bin) = require_e2e(test) else {
        return;
    };
    let lab = start(&bin, &["hash = \"src-ip\"", "hot_source_share = 0.5"]);
    let (hot, cold) = (
        lab.client_addr(false),
        lab.add_client_addr(9).expect("a second client address"),
    );
    let vip = SocketAddr::new(lab.vip4(), PORT);
    // Before anything is hot, each source sticks to one backend; the soon-hot one
    // holds 10 connections there.
    let mut held: Vec<Conn> = (0..10)
        .map(|i| {
            Conn::open_from(lab.client(), hot, vip, TIMEOUT)
                .unwrap_or_else(|e| panic!("held connection {i}: {e}"))
        })
        .collect();
    let home = held[0].backend().to_string();
    assert!(held.iter().all(|c| c.backend() == home), "src-ip affinity");
    let cold_home = backends_from(&lab, cold, 1).remove(0);

    // The hot source opens most of the new flows until the agent's sample (2 s) finds it.
    let started = Instant::now();
    let st = loop {
        let s = spread(lab.client(), vip, 40).expect("spread");
        assert_eq!(s.failures, 0, "{:?}", s.errors);
        let st = status(&lab);
        if hot_sources(&st).contains(&hot.to_string()) {
            break st;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "{hot} never turned hot:\n{st:#}\nagent log:\n{}",
            lab.agent_log()
        );
    };
    eprintln!(
        "hot after {:?}: {}",
        started.elapsed(),
        st["vips"][0]["hot_sources"]
    );
    assert_eq!(hot_sources(&st), [hot.to_string()], "only the busy source");

    // Three of the hot source's connections to one of the other's, so it stays hot and
    // the other stays below the share.
    let mut spread_over = std::collections::BTreeMap::<String, usize>::new();
    let mut sticky = std::collections::BTreeSet::new();
    for _ in 0..20 {
        for backend in backends_from(&lab, hot, 3) {
            *spread_over.entry(backend).or_default() += 1;
        }
        sticky.extend(backends_from(&lab, cold, 1));
    }
    eprintln!(
        "hot source {hot}: 60 new connections over {spread_over:?}; {cold}: 20 on {sticky:?}"
    );
    assert_eq!(
        spread_over.len(),
        3,
        "the hot source's new connections reach every backend: {spread_over:?}"
    );
    assert!(
        spread_over.values().all(|&n| n >= 5),
        "spread per connection, not by source: {spread_over:?}"
    );
    assert_eq!(
        sticky,
        [cold_home].into(),
        "the other source stays on its backend"
    );
    for (i, conn) in held.iter_mut().enumerate() {
        conn.echo(b"still here\n")
            .unwrap_or_else(|e| panic!("held connection {i} of the hot source broke: {e}"));
        assert_eq!(conn.backend(), home);
    }

    let st = status(&lab);
    let counted = st["counters"]["hot_source_spread"].as_u64().unwrap_or(0);
    assert!(counted >= 60, "hot_source_spread {counted}:\n{st:#}");
    let agent = lab.agent().expect("agent");
    let target = target(&lab);
    let out = agent
        .cli(&["explain", &target, &format!("{hot}:40000")])
        .expect("lb explain");
    assert!(
        out.success() && out.stdout.contains("hot source: balanced per connection"),
        "{out}"
    );
    let out = agent
        .cli(&["explain", &target, &format!("{cold}:40000")])
        .expect("lb explain");
    assert!(out.success() && !out.stdout.contains("hot source"), "{out}");
}
