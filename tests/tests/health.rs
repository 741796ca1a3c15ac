//! Health checks end to end: the real agent checks real servers in the backends'
//! namespaces, and what it decides shows in `lb status --json`, in its log and in where
//! the client's new connections go. Each test builds its own lab (three backends) with
//! short timings (interval 300ms, timeout 200ms, rise 2, fall 2), so they run in parallel
//! and each takes seconds.
//!
//! Needs root, bpffs, the eBPF object and a built `lb` (`cargo build -p lb-userspace`,
//! or `LB_BIN`); otherwise each test prints `SKIPPED` (or fails under
//! `LB_REQUIRE_ALL_TESTS=1`). `cargo test -p lb-tests --test health`.

use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::path::Path;
use std::thread::sleep;
use std::time::{Duration, Instant, SystemTime};

use lb_tests::{
    CheckTiming, Health, HttpBehaviour, HttpServer, Lab, LabOptions, Protocol, Spread, VipView,
    XdpMode, require_e2e, spread,
};

const VIP: &str = "web";
/// The VIP's port: every backend's [`lb_tests::TcpServer`] for the client's traffic.
const PORT: u16 = 80;
/// HTTP checks go to their own port, so that the client's traffic never reaches (and
/// never disturbs) the servers whose answers a test controls.
const HEALTH_PORT: u16 = 8080;
const HEALTH_PATH: &str = "/healthz";
const TIMING: CheckTiming = CheckTiming {
    interval: Duration::from_millis(300),
    timeout: Duration::from_millis(200),
    rise: 2,
    fall: 2,
};
/// How long all backends may take to pass their first `rise` checks.
const UP_TIMEOUT: Duration = Duration::from_secs(10);
/// How long any single change of state may take before a test gives up waiting (the
/// assertions on how long it took are tighter; this only bounds the test).
const CHANGE_TIMEOUT: Duration = Duration::from_secs(10);
/// `lb status --json` is asked this often while a test times a change.
const POLL: Duration = Duration::from_millis(20);

/// The time a change of state may take at most, by the configuration: `n` (rise or
/// fall) consecutive results, the first one at most one interval after the change, each
/// taking at most the timeout when it is the timeout that fails it. The agent is faster
/// (after the first result the others come every `fast_interval`, a quarter of the
/// interval), so this already holds a margin.
fn expected_bound(n: u32, each_times_out: bool) -> Duration {
    let per_check = if each_times_out {
        TIMING.timeout * n
    } else {
        TIMING.timeout
    };
    TIMING.interval * n + per_check
}

/// What the tests assert: 3 × [`expected_bound`], on the agent's own clock: from the
/// test's change (the system time the test took just after making it) to the agent's log
/// line of the transition, so that neither the test's polling of `lb status` nor its
/// process starts count. The margin is for the agent's scheduling on a 2-core VM running
/// several labs (a check task can be late by hundreds of milliseconds) and the ±10%
/// jitter of each interval. A detection that took three times what the configuration
/// allows is a bug, not noise. `polled` (the test's own view) is reported only.
fn assert_bound(what: &str, agent_took: Duration, polled: Duration, n: u32, each_times_out: bool) {
    let expected = expected_bound(n, each_times_out);
    eprintln!(
        "{what}: {:.0} ms by the agent's log, {:.0} ms as the test polled (configuration \
         bound {:.0} ms, asserted below {:.0} ms on the agent's clock)",
        agent_took.as_secs_f64() * 1000.0,
        polled.as_secs_f64() * 1000.0,
        expected.as_secs_f64() * 1000.0,
        (expected * 3).as_secs_f64() * 1000.0
    );
    assert!(
        agent_took < expected * 3,
        "{what} took {agent_took:?} by the agent's own log, more than 3 × {expected:?}"
    );
}

/// A change the test made: when (for waiting) and the system time (to compare with the
/// agent's log).
#[derive(Clone, Copy)]
struct Change {
    at: Instant,
    system: SystemTime,
}

impl Change {
    fn now() -> Change {
        Change {
            at: Instant::now(),
            system: SystemTime::now(),
        }
    }
}

/// A lab, the HTTP check servers of its backends (dropped first: their threads live in
/// the lab's namespaces), and the agent's view.
struct Bed {
    http: Vec<HttpServer>,
    lab: Lab,
}

impl Bed {
    /// A lab with a TCP server on [`PORT`] of the backends in `serving` (0-based) and,
    /// with `http`, an [`HttpServer`] on [`HEALTH_PORT`] of every backend answering
    /// [`HttpBehaviour::Ok`]; the agent checks them with `health`.
    fn new(bin: &Path, serving: &[usize], http: bool, health: Health) -> Bed {
        let mut lab = Lab::new(LabOptions::default()).expect("build the lab");
        let mut servers = Vec::new();
        for &i in serving {
            lab.serve_tcp_on(i, PORT, false)
                .unwrap_or_else(|e| panic!("tcp server of {}: {e:#}", lab.backend_name(i)));
        }
        if http {
            for i in 0..lab.backends().len() {
                let server = HttpServer::start(
                    lab.backend(i),
                    SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), HEALTH_PORT),
                    &format!("{}-http", lab.backend_name(i)),
                    HEALTH_PATH,
                    HttpBehaviour::Ok,
                )
                .unwrap_or_else(|e| panic!("http server of {}: {e:#}", lab.backend_name(i)));
                servers.push(server);
            }
        }
        let config = lab.agent_config(
            XdpMode::Native,
            vec![lab.vip(VIP, false, PORT, Protocol::Tcp, health)],
        );
        lab.start_agent(bin, &config).expect("start the agent");
        Bed { http: servers, lab }
    }

    fn addr(&self, i: usize) -> IpAddr {
        self.lab.backend_addr(i, false)
    }

    fn view(&self) -> VipView {
        let agent = self.lab.agent().expect("agent");
        VipView::fetch(agent, VIP).unwrap_or_else(|e| panic!("lb status --json: {e:#}"))
    }

    /// The view of backend `i`.
    fn backend<'a>(&self, view: &'a VipView, i: usize) -> &'a lb_tests::BackendView {
        let addr = self.addr(i);
        view.backend(addr)
            .unwrap_or_else(|| panic!("no backend {addr} in lb status:\n{}", view.summary()))
    }

    /// Asks `lb status --json` every [`POLL`] until `done(view)`; returns that view and
    /// the time since `since`. Fails after [`CHANGE_TIMEOUT`] with the last view.
    fn wait(
        &self,
        what: &str,
        since: Instant,
        mut done: impl FnMut(&VipView) -> bool,
    ) -> (VipView, Duration) {
        loop {
            let view = self.view();
            if done(&view) {
                return (view, since.elapsed());
            }
            assert!(
                since.elapsed() < CHANGE_TIMEOUT,
                "{what}: not within {CHANGE_TIMEOUT:?}; last lb status:\n{}",
                view.summary()
            );
            sleep(POLL);
        }
    }

    /// Every backend up, within [`UP_TIMEOUT`] of the agent's start.
    fn wait_all_up(&self) {
        let agent = self.lab.agent().expect("agent");
        let (view, took) = lb_tests::wait_backends_up(agent, VIP, UP_TIMEOUT, &|| false)
            .unwrap_or_else(|e| panic!("lb status --json: {e:#}"));
        assert_eq!(
            view.up(),
            view.backends.len(),
            "not every backend up after {took:?}:\n{}",
            view.summary()
        );
        eprintln!(
            "{} of {} backends up after {took:.1?}",
            view.up(),
            view.backends.len()
        );
    }

    /// `n` new connections from the client to the VIP.
    fn spread(&self, n: usize) -> Spread {
        let vip = SocketAddr::new(self.lab.vip4(), PORT);
        spread(self.lab.client(), vip, n).expect("spread")
    }

    /// The agent's log has a line containing `needle`.
    fn assert_logged(&self, needle: &str) {
        let log = self.lab.agent_log();
        assert!(
            log.lines().any(|l| l.contains(needle)),
            "no line with {needle:?} in the agent's log:\n{log}"
        );
    }

    /// How long the agent took, by its own log, from `change` to logging each of
    /// `backends` (0-based) `word` ("UP" or "DOWN"): the longest of them. The line may
    /// trail the status by a moment; it is waited for.
    fn agent_took(&self, change: Change, backends: &[usize], word: &str) -> Duration {
        let deadline = Instant::now() + Duration::from_secs(2);
        let took = |i: usize, log: &str| {
            let needle = format!("backend {} of vip {VIP} is {word}: ", self.addr(i));
            log.lines()
                .filter(|l| l.contains(&needle))
                .filter_map(lb_tests::agent::logged_at)
                .find(|at| *at >= change.system)
                .and_then(|at| at.duration_since(change.system).ok())
        };
        loop {
            let log = self.lab.agent_log();
            let all: Option<Vec<Duration>> = backends.iter().map(|&i| took(i, &log)).collect();
            if let Some(all) = all {
                return all.into_iter().max().unwrap_or_default();
            }
            assert!(
                Instant::now() < deadline,
                "no \"is {word}\" line for backends {backends:?} after the change in the \
                 agent's log:\n{log}"
            );
            sleep(POLL);
        }
    }

    /// The agent's lines about backend `i` changing state.
    fn changes_logged(&self, i: usize) -> Vec<String> {
        let prefix = format!("backend {} of vip {VIP} is ", self.addr(i));
        self.lab
            .agent_log()
            .lines()
            .filter(|l| l.contains(&prefix))
            .map(str::to_string)
            .collect()
    }
}

/// Every one of `n` connections answered, only by the backends named in `only`.
fn assert_all_answered_by(s: &Spread, n: usize, only: &[String]) {
    assert_eq!(
        (s.failures, s.total()),
        (0, n),
        "{} of {n} connections failed: {:?}\n{}",
        s.failures,
        s.errors,
        s.table()
    );
    for name in s.counts.keys() {
        assert!(
            only.contains(name),
            "{name} answered, but only {only:?} should:\n{}",
            s.table()
        );
    }
}

/// A TCP-checked backend whose server stops leaves the table within the configured
/// detection time, and new connections all go to the other two; when its server starts
/// again it returns after `rise` checks and gets new connections again.
#[test]
fn tcp_backend_that_stops_leaves_the_table_and_returns() {
    let test = "tcp_backend_that_stops_leaves_the_table_and_returns";
    let Some(bin) = require_e2e(test) else { return };
    let mut bed = Bed::new(&bin, &[0, 1, 2], false, Health::tcp(TIMING));
    bed.wait_all_up();
    let s = bed.spread(30);
    assert_all_answered_by(
        &s,
        30,
        &(0..3).map(|i| bed.lab.backend_name(i)).collect::<Vec<_>>(),
    );

    // The listener is closed when this returns: connections are refused from here on.
    bed.lab.stop_servers_of(0).expect("stop backend-1's server");
    let stopped = Change::now();
    let (view, took) = bed.wait("backend-1 leaving the table", stopped.at, |v| {
        v.backend(bed.addr(0)).is_some_and(|b| b.health != "up")
    });
    let b1 = bed.backend(&view, 0).clone();
    assert!(
        b1.is_out(),
        "health down must take it out of the table at once (in_table false, 0 slots):\n{}",
        view.summary()
    );
    assert_eq!(
        b1.last_error.as_deref(),
        Some("connection refused"),
        "{}",
        view.summary()
    );
    assert!(
        b1.consecutive >= u64::from(TIMING.fall),
        "{}",
        view.summary()
    );
    assert_eq!(
        (view.healthy_backends, view.unhealthy_backends),
        (2, 1),
        "{}",
        view.summary()
    );
    for i in [1, 2] {
        assert!(bed.backend(&view, i).is_up(), "{}", view.summary());
    }
    let by_agent = bed.agent_took(stopped, &[0], "DOWN");
    assert_bound(
        "tcp: stop -> out of the table",
        by_agent,
        took,
        TIMING.fall,
        false,
    );
    bed.assert_logged(&format!(
        "backend {} of vip {VIP} is DOWN: connection refused ({} consecutive failures)",
        bed.addr(0),
        TIMING.fall
    ));

    let s = bed.spread(100);
    eprintln!("backend-1 down:\n{}", s.table());
    assert_all_answered_by(&s, 100, &[bed.lab.backend_name(1), bed.lab.backend_name(2)]);

    bed.lab
        .serve_tcp_on(0, PORT, false)
        .expect("start backend-1's server again");
    let restarted = Change::now();
    let (view, took) = bed.wait("backend-1 returning", restarted.at, |v| {
        v.backend(bed.addr(0)).is_some_and(|b| b.health != "down")
    });
    let b1 = bed.backend(&view, 0);
    assert!(b1.is_up(), "{}", view.summary());
    assert!(b1.slots > 0, "{}", view.summary());
    assert_eq!(b1.last_ok, Some(true), "{}", view.summary());
    // At least: a check after going up, before this poll, adds one.
    assert!(
        b1.consecutive >= u64::from(TIMING.rise),
        "{}",
        view.summary()
    );
    assert_eq!(
        (view.healthy_backends, view.unhealthy_backends),
        (3, 0),
        "{}",
        view.summary()
    );
    assert_bound(
        "tcp: restart -> back in the table",
        bed.agent_took(restarted, &[0], "UP"),
        took,
        TIMING.rise,
        false,
    );
    // Up at the start, down, up again: one line each.
    let changes = bed.changes_logged(0);
    let words: Vec<bool> = changes.iter().map(|l| l.contains(" is UP: ")).collect();
    assert_eq!(words, [true, false, true], "{changes:#?}");

    let s = bed.spread(100);
    eprintln!("backend-1 back:\n{}", s.table());
    assert_all_answered_by(
        &s,
        100,
        &(0..3).map(|i| bed.lab.backend_name(i)).collect::<Vec<_>>(),
    );
    assert!(
        s.share(&bed.lab.backend_name(0)) >= 0.10,
        "backend-1 is back but got few new connections:\n{}",
        s.table()
    );
}

/// HTTP checks: a 503 on the path takes a backend down (the error names the status), a
/// response that never finishes takes one down by timeout, a stopped server by refusal,
/// and each one returns once its server answers 200 again.
#[test]
fn http_backends_go_down_on_503_hang_and_stop_and_return() {
    let test = "http_backends_go_down_on_503_hang_and_stop_and_return";
    let Some(bin) = require_e2e(test) else { return };
    let health = Health::http(TIMING, Some(HEALTH_PORT), HEALTH_PATH, 200);
    let mut bed = Bed::new(&bin, &[0, 1, 2], true, health);
    bed.wait_all_up();
    let names: Vec<String> = (0..3).map(|i| bed.lab.backend_name(i)).collect();

    // backend-1 answers 503, backend-2 hangs (headers, then part of the body): both go
    // down, each with its reason; backend-3 alone takes the traffic.
    bed.http[0].set(HttpBehaviour::Status(503));
    bed.http[1].set(HttpBehaviour::Hang);
    let changed = Change::now();
    let (mut took_503, mut took_hang) = (None, None);
    let (view, _) = bed.wait(
        "backend-1 (503) and backend-2 (hang) going down",
        changed.at,
        |v| {
            let out = |i: usize| v.backend(bed.addr(i)).is_some_and(|b| b.health != "up");
            if took_503.is_none() && out(0) {
                took_503 = Some(changed.at.elapsed());
            }
            if took_hang.is_none() && out(1) {
                took_hang = Some(changed.at.elapsed());
            }
            out(0) && out(1)
        },
    );
    let (b1, b2) = (bed.backend(&view, 0), bed.backend(&view, 1));
    assert!(b1.is_out() && b2.is_out(), "{}", view.summary());
    assert!(
        b1.last_error.as_deref().is_some_and(|e| e.contains("503")),
        "backend-1's error must name the status:\n{}",
        view.summary()
    );
    assert!(
        b2.last_error
            .as_deref()
            .is_some_and(|e| e.contains("timeout")),
        "backend-2's error must be a timeout:\n{}",
        view.summary()
    );
    assert!(bed.backend(&view, 2).is_up(), "{}", view.summary());
    assert_bound(
        "http: 503 -> out of the table",
        bed.agent_took(changed, &[0], "DOWN"),
        took_503.expect("timed"),
        TIMING.fall,
        false,
    );
    assert_bound(
        "http: hang -> out of the table",
        bed.agent_took(changed, &[1], "DOWN"),
        took_hang.expect("timed"),
        TIMING.fall,
        true,
    );
    bed.assert_logged(&format!(
        "backend {} of vip {VIP} is DOWN: status 503 (expected 200) ({} consecutive failures)",
        bed.addr(0),
        TIMING.fall
    ));
    bed.assert_logged(&format!(
        "backend {} of vip {VIP} is DOWN: timeout after 200ms ({} consecutive failures)",
        bed.addr(1),
        TIMING.fall
    ));
    let s = bed.spread(30);
    assert_all_answered_by(&s, 30, &names[2..]);

    // Both answer 200 again: both return.
    bed.http[0].set(HttpBehaviour::Ok);
    bed.http[1].set(HttpBehaviour::Ok);
    let changed = Change::now();
    let (view, took) = bed.wait("backend-1 and backend-2 returning", changed.at, |v| {
        v.up() == 3
    });
    assert_eq!((view.healthy_backends, view.unhealthy_backends), (3, 0));
    let by_agent = bed.agent_took(changed, &[0, 1], "UP");
    assert_bound(
        "http: 200 again -> both back",
        by_agent,
        took,
        TIMING.rise,
        false,
    );

    // backend-1 accepts and says nothing; backend-2's check server stops (refused).
    bed.http[0].set(HttpBehaviour::Silent);
    bed.http[1].stop().expect("stop backend-2's http server");
    let changed = Change::now();
    let (view, took) = bed.wait(
        "backend-1 (silent) and backend-2 (stopped) going down",
        changed.at,
        |v| {
            [0, 1]
                .iter()
                .all(|&i| v.backend(bed.addr(i)).is_some_and(|b| b.health != "up"))
        },
    );
    let (b1, b2) = (bed.backend(&view, 0), bed.backend(&view, 1));
    assert!(b1.is_out() && b2.is_out(), "{}", view.summary());
    assert!(
        b1.last_error
            .as_deref()
            .is_some_and(|e| e.contains("timeout")),
        "{}",
        view.summary()
    );
    assert_eq!(
        b2.last_error.as_deref(),
        Some("connection refused"),
        "{}",
        view.summary()
    );
    assert_bound(
        "http: silent and stopped -> both out",
        bed.agent_took(changed, &[0, 1], "DOWN"),
        took,
        TIMING.fall,
        true,
    );

    bed.http[0].set(HttpBehaviour::Ok);
    bed.http[1]
        .start_again()
        .expect("start backend-2's http server again");
    let changed = Change::now();
    let (_, took) = bed.wait("backend-1 and backend-2 returning again", changed.at, |v| {
        v.up() == 3
    });
    assert_bound(
        "http: answering again -> both back",
        bed.agent_took(changed, &[0, 1], "UP"),
        took,
        TIMING.rise,
        false,
    );
    let s = bed.spread(100);
    eprintln!("all back:\n{}", s.table());
    assert_all_answered_by(&s, 100, &names);
    assert_eq!(s.counts.len(), 3, "{}", s.table());
}

/// Samples `lb status` every 100 ms for `how_long`; each sample must satisfy
/// `check(view, settled)`, where `settled` was `settled()` just before the sample was
/// asked for. Returns the number of samples.
fn hold_steady(
    bed: &Bed,
    what: &str,
    how_long: Duration,
    settled: impl Fn() -> bool,
    check: impl Fn(&VipView, bool) -> Result<(), String>,
) -> usize {
    let start = Instant::now();
    let mut samples = 0;
    while start.elapsed() < how_long {
        let settled = settled();
        let view = bed.view();
        samples += 1;
        if let Err(why) = check(&view, settled) {
            panic!(
                "{what}: after {:.1?}, sample {samples}: {why}\n{}\nagent log:\n{}",
                start.elapsed(),
                view.summary(),
                bed.lab.agent_log()
            );
        }
        sleep(Duration::from_millis(100));
    }
    samples
}

/// A backend whose check alternates between failing and passing (503, 200, 503...) —
/// never `rise` or `fall` equal results in a row — never changes state: not while it is
/// up, not while it is down. The stable backends stay up all along.
#[test]
fn flapping_backend_never_changes_state() {
    let test = "flapping_backend_never_changes_state";
    let Some(bin) = require_e2e(test) else { return };
    let health = Health::http(TIMING, Some(HEALTH_PORT), HEALTH_PATH, 200);
    let bed = Bed::new(&bin, &[0, 1, 2], true, health);
    bed.wait_all_up();
    let flap = Duration::from_secs(5);
    let b1 = bed.addr(0);
    let control = bed.http[0].control();
    let stable = |v: &VipView| -> Result<(), String> {
        for i in [1, 2] {
            if !bed.backend(v, i).is_up() {
                return Err(format!("stable backend {} is not up", bed.addr(i)));
            }
        }
        Ok(())
    };
    // Once the agent has recorded the first two flapping answers (the server has had a
    // third request: checks of a backend run one after the other), no streak is longer
    // than one. A longer one would mean the alternation did not reach the agent as such,
    // and the test would prove nothing.
    let alternating = |b: &lb_tests::BackendView, settled: bool| -> Result<(), String> {
        if settled && b.consecutive > 1 {
            return Err(format!("{b1}: {} equal results in a row", b.consecutive));
        }
        Ok(())
    };
    // Flaps the server's answers for `flap` while the backend must stay where `holds`
    // says (`broken` names the failure); returns the checks the phase took.
    let flapping = |phase: &str,
                    holds: fn(&lb_tests::BackendView) -> bool,
                    broken: &str|
     -> std::ops::Range<usize> {
        let before = control.requests();
        control.set(HttpBehaviour::Alternate);
        let samples = hold_steady(
            &bed,
            phase,
            flap,
            || control.requests() >= before + 3,
            |v, settled| {
                let b = bed.backend(v, 0);
                if !holds(b) {
                    return Err(format!("{b1} {broken} while flapping"));
                }
                alternating(b, settled)?;
                stable(v)
            },
        );
        let checks = control.requests() - before;
        eprintln!("{phase}: {checks} checks, {samples} status samples, no change");
        assert!(
            checks >= 8,
            "only {checks} checks in {flap:?}: the test proves little"
        );
        before..before + checks
    };
    let mut phases = Vec::new();

    // Up, then flapping: stays up and in the table.
    phases.push(flapping(
        "flapping while up",
        lb_tests::BackendView::is_up,
        "left the table",
    ));

    // Down (by a steady 503), then flapping: stays down and out of the table.
    control.set(HttpBehaviour::Status(503));
    let changed = Change::now();
    let (_, took) = bed.wait("backend-1 going down", changed.at, |v| {
        v.backend(b1).is_some_and(|b| b.health == "down")
    });
    assert_bound(
        "http: 503 -> out (before flapping while down)",
        bed.agent_took(changed, &[0], "DOWN"),
        took,
        TIMING.fall,
        false,
    );
    phases.push(flapping(
        "flapping while down",
        lb_tests::BackendView::is_out,
        "came back",
    ));

    // The answers did alternate, and the agent logged exactly two changes of backend-1:
    // up at the start, down on the steady 503.
    let answers = control.answers();
    for phase in phases {
        let flapped = &answers[phase];
        for pair in flapped.windows(2) {
            assert_ne!(pair[0].status, pair[1].status, "{flapped:?}");
        }
    }
    let changes = bed.changes_logged(0);
    assert_eq!(changes.len(), 2, "{changes:#?}");
    assert!(changes[0].contains(" is UP: "), "{changes:#?}");
    assert!(changes[1].contains(" is DOWN: status 503"), "{changes:#?}");
    for i in [1, 2] {
        let changes = bed.changes_logged(i);
        assert_eq!(
            changes.len(),
            1,
            "stable backend {}: {changes:#?}",
            bed.addr(i)
        );
    }
}

/// A TCP-checked backend with no server at all (never started) is never in the table:
/// not before the first checks, not after; every connection goes to the other two.
#[test]
fn backend_that_never_started_gets_no_traffic() {
    let test = "backend_that_never_started_gets_no_traffic";
    let Some(bin) = require_e2e(test) else { return };
    let bed = Bed::new(&bin, &[0, 1], false, Health::tcp(TIMING));
    // From the agent's start until the others are up, and a while after: backend-3 is
    // never in the table.
    let start = Instant::now();
    let mut samples = 0;
    let mut others_up = None;
    while start.elapsed() < UP_TIMEOUT {
        let view = bed.view();
        samples += 1;
        let b3 = bed.backend(&view, 2);
        assert!(
            !b3.in_table && b3.slots == 0 && b3.health != "up",
            "backend-3 (no server) in the table at sample {samples}:\n{}",
            view.summary()
        );
        if others_up.is_none() && bed.backend(&view, 0).is_up() && bed.backend(&view, 1).is_up() {
            others_up = Some(start.elapsed());
        }
        // Until its checks have failed `fall` times (proof that it is checked).
        if others_up.is_some()
            && b3.last_ok == Some(false)
            && b3.consecutive >= u64::from(TIMING.fall)
        {
            break;
        }
        sleep(POLL);
    }
    let view = bed.view();
    let b3 = bed.backend(&view, 2);
    eprintln!("{samples} status samples:\n{}", view.summary());
    assert!(
        others_up.is_some(),
        "backend-1 and backend-2 never came up:\n{}",
        view.summary()
    );
    assert_eq!(b3.health, "down", "{}", view.summary());
    assert_eq!(
        b3.last_error.as_deref(),
        Some("connection refused"),
        "{}",
        view.summary()
    );
    assert_eq!(
        (view.healthy_backends, view.unhealthy_backends),
        (2, 1),
        "{}",
        view.summary()
    );

    let s = bed.spread(100);
    eprintln!("{}", s.table());
    assert_all_answered_by(&s, 100, &[bed.lab.backend_name(0), bed.lab.backend_name(1)]);
    let view = bed.view();
    let b3 = bed.backend(&view, 2);
    assert_eq!(b3.new_flows, 0, "{}", view.summary());
    assert!(
        bed.changes_logged(2).is_empty(),
        "a backend that starts down and stays down has no change to log: {:#?}",
        bed.changes_logged(2)
    );
}

/// A backend is not checked in maintenance, so its health from before is stale: after
/// `lb ready` it stays out of the table until `rise` checks pass. One whose server died
/// in maintenance never returns; once its server answers again, it does.
#[test]
fn backend_leaving_maintenance_waits_for_its_checks() {
    let test = "backend_leaving_maintenance_waits_for_its_checks";
    let Some(bin) = require_e2e(test) else { return };
    let mut bed = Bed::new(&bin, &[0, 1, 2], false, Health::tcp(TIMING));
    bed.wait_all_up();
    let target = format!("{}:{PORT}/tcp", bed.lab.vip4());
    let b1 = bed.addr(0).to_string();
    let lb = |bed: &Bed, args: &[&str]| {
        let out = bed
            .lab
            .agent()
            .expect("agent")
            .cli(args)
            .unwrap_or_else(|e| panic!("lb {}: {e:#}", args.join(" ")));
        assert!(out.success(), "`lb {}` failed: {out}", args.join(" "));
    };

    lb(&bed, &["maint", &target, &b1]);
    // Not checked in maintenance: not shown up (its last check is stale), and counted
    // neither healthy nor unhealthy.
    let view = bed.view();
    let b = bed.backend(&view, 0);
    assert_eq!(
        (b.state.as_str(), b.health.as_str()),
        ("maint", "unknown"),
        "{}",
        view.summary()
    );
    assert_eq!(
        (view.healthy_backends, view.unhealthy_backends),
        (2, 0),
        "{}",
        view.summary()
    );
    let text = bed.lab.agent().expect("agent").status().expect("lb status");
    let line = text
        .lines()
        .find(|l| l.contains(&format!(" {b1} ")))
        .unwrap();
    assert!(line.ends_with("unchecked (maint)"), "{text}");
    bed.lab.stop_servers_of(0).expect("stop backend-1's server");
    lb(&bed, &["ready", &target, &b1]);
    let ready = Instant::now();
    // Held out from the command on: sampled for longer than `rise` checks would take
    // if they passed, and until `fall` checks have failed (proof that it is checked).
    let hold = expected_bound(TIMING.rise, false) * 2;
    let mut samples = 0;
    loop {
        let view = bed.view();
        samples += 1;
        let b = bed.backend(&view, 0);
        assert_eq!(b.state, "ready", "{}", view.summary());
        assert!(
            !b.in_table && b.slots == 0 && b.health == "down",
            "backend-1 (server stopped in maintenance) in the table {:?} after lb ready, \
             sample {samples}:\n{}",
            ready.elapsed(),
            view.summary()
        );
        let failed = b.last_ok == Some(false) && b.consecutive >= u64::from(TIMING.fall);
        if failed && ready.elapsed() > hold {
            break;
        }
        assert!(
            ready.elapsed() < CHANGE_TIMEOUT,
            "backend-1 not checked after lb ready:\n{}",
            view.summary()
        );
        sleep(POLL);
    }
    assert_eq!(
        bed.backend(&bed.view(), 0).last_error.as_deref(),
        Some("connection refused")
    );
    let s = bed.spread(60);
    assert_all_answered_by(&s, 60, &[bed.lab.backend_name(1), bed.lab.backend_name(2)]);

    bed.lab
        .serve_tcp_on(0, PORT, false)
        .expect("start backend-1's server again");
    let restarted = Change::now();
    let (view, took) = bed.wait("backend-1 returning", restarted.at, |v| {
        v.backend(bed.addr(0)).is_some_and(|b| b.in_table)
    });
    let b = bed.backend(&view, 0);
    assert!(b.is_up(), "{}", view.summary());
    assert!(
        b.consecutive >= u64::from(TIMING.rise),
        "{}",
        view.summary()
    );
    assert_bound(
        "tcp: after maintenance -> back in the table",
        bed.agent_took(restarted, &[0], "UP"),
        took,
        TIMING.rise,
        false,
    );
    let s = bed.spread(60);
    assert!(
        s.counts.contains_key(&bed.lab.backend_name(0)),
        "backend-1 is back but got no new connection:\n{}",
        s.table()
    );
}
