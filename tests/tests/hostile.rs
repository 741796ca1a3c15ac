//! A host that starves, confuses or splits the agent, end to end: a local user holding
//! connections to the metrics port, file descriptors running out, the interface going
//! away and coming back (and changing its MAC), a second agent started on the same
//! interface, a backend at the balancer's own address. Each test builds its own lab.
//!
//! Needs root, bpffs, the eBPF object and a built `lb`; otherwise each test prints
//! `SKIPPED` (or fails under `LB_REQUIRE_ALL_TESTS=1`).
//! `cargo test -p lb-tests --test hostile -- --nocapture` prints the figures measured.

use std::net::{IpAddr, SocketAddr};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

use lb_tests::agent::run_lb;
use lb_tests::netns::ip;
use lb_tests::router::PinDir;
use lb_tests::{
    Agent, BackendConfig, Health, Lab, LabOptions, Protocol, Sniffer, XdpMode, require_e2e, spread,
    tcp_request, wait_backends_up,
};
use serde_json::Value;

const VIP: &str = "web";
const PORT: u16 = 80;
/// Where the agent serves metrics, inside the balancer's namespace.
const METRICS: &str = "127.0.0.1:9650";
const UP_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the agent may take to notice a change of its interface (it is told over
/// netlink at once, and looks every second anyway).
const FOLLOW_TIMEOUT: Duration = Duration::from_secs(5);

/// A lab with TCP servers on every backend and the agent started with fast TCP checks.
fn lab_with_agent(bin: &Path, options: LabOptions, mode: XdpMode, metrics: &str) -> Lab {
    let mut lab = Lab::new(options).expect("build the lab");
    lab.serve_tcp(PORT, false).expect("backend servers");
    let vip = lab.vip(VIP, false, PORT, Protocol::Tcp, Health::fast_tcp());
    let mut config = lab.agent_config(mode, vec![vip]);
    config.metrics = metrics.into();
    lab.start_agent(bin, &config).expect("start the agent");
    all_up(&lab);
    lab
}

fn all_up(lab: &Lab) {
    let agent = lab.agent().expect("an agent");
    let (view, took) = wait_backends_up(agent, VIP, UP_TIMEOUT, &|| false).expect("status");
    assert_eq!(
        view.up(),
        view.backends.len(),
        "backends not up after {took:?}:\n{}",
        view.summary()
    );
}

/// The agent's resident memory (KiB) and open descriptors, from /proc.
fn rss_and_fds(pid: u32) -> (u64, usize) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let rss = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count());
    (rss, fds)
}

/// `GET path` over HTTP/1.1 from the calling thread's namespace: the status code.
fn http_get(addr: SocketAddr, path: &str) -> std::io::Result<u16> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nhost: lb\r\nconnection: close\r\n\r\n"
    )?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer)?;
    answer
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("not an HTTP answer: {answer:?}")))
}

/// The backends of the VIP in `lb status --json`.
fn backends(status: &Value) -> Vec<Value> {
    status["vips"][0]["backends"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

/// What `hold-connections` printed: `key=value` pairs.
fn summary_field(summary: &str, key: &str) -> u64 {
    summary
        .split_whitespace()
        .find_map(|kv| kv.strip_prefix(&format!("{key}=")))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {key} in {summary:?}"))
}

/// A local user (`nobody` or another unprivileged account, from inside the balancer's namespace) holds thousands of
/// connections to the metrics port, half of them with a partial request, and opens new
/// ones as the agent closes them, while the agent has 1024 descriptors. Meanwhile every
/// health check passes, the control socket answers, the agent's descriptors stay within
/// the listener's cap and its memory does not grow with the connections; a scrape works
/// again afterwards.
#[test]
fn a_local_user_holding_metrics_connections_costs_no_check_and_no_control() {
    let test = "a_local_user_holding_metrics_connections_costs_no_check_and_no_control";
    let Some(bin) = require_e2e(test) else {
        return;
    };
    let lab = lab_with_agent(&bin, LabOptions::default(), XdpMode::Generic, METRICS);
    let agent = lab.agent().expect("an agent");
    let pid = agent.pid().expect("the agent runs");
    let metrics: SocketAddr = METRICS.parse().unwrap();
    let scrape = lab.lb().run(|| http_get(metrics, "/metrics")).unwrap();
    assert_eq!(scrape.ok(), Some(200), "a scrape before the abuse");
    // It raised its soft limit to the hard one at start; give it what many systems give
    // a service, so that the abuse could exhaust it.
    let limit = set_nofile(pid, None);
    assert_eq!(limit.rlim_cur, limit.rlim_max, "the agent raised its limit");
    set_nofile(
        pid,
        Some(libc::rlimit {
            rlim_cur: 1024,
            rlim_max: limit.rlim_max,
        }),
    );
    let (rss_before, fds_before) = rss_and_fds(pid);

    const CONNECTIONS: &str = "3000";
    const SECONDS: &str = "7";
    // Looked up, not assumed; and the helper copied out of the checkout, which may be
    // under a home directory (0700) the user cannot traverse.
    let user = lb_tests::host::unprivileged_user().expect("an unprivileged user");
    let dir = lb_tests::host::open_dir().expect("a directory the user can enter");
    let holder = lb_tests::host::copy_out(
        Path::new(env!("CARGO_BIN_EXE_hold-connections")),
        dir.path(),
    )
    .expect("copy hold-connections out of the checkout");
    let abuser = lab
        .lb()
        .run(|| {
            Command::new(&holder)
                .args([METRICS, CONNECTIONS, SECONDS])
                // std drops root's supplementary groups with the uid.
                .uid(user.uid)
                .gid(user.gid)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
        })
        .unwrap()
        .unwrap_or_else(|e| panic!("start hold-connections as {}: {e}", user.name));
    let started = Instant::now();
    let (mut rss_max, mut fds_max, mut slowest_status) = (0, 0, Duration::ZERO);
    let mut samples = 0;
    while started.elapsed() < Duration::from_secs(7) {
        let asked = Instant::now();
        let status = agent
            .status_json()
            .expect("the control socket answers during the abuse");
        slowest_status = slowest_status.max(asked.elapsed());
        for b in backends(&status) {
            assert_eq!(
                b["health"], "up",
                "a backend went down during the abuse: {b}"
            );
            let local_errors = b["local_check_errors"].as_u64().unwrap_or(0);
            assert_eq!(local_errors, 0, "checks were starved: {b}");
        }
        let (rss, fds) = rss_and_fds(pid);
        rss_max = rss_max.max(rss);
        fds_max = fds_max.max(fds);
        samples += 1;
        sleep(Duration::from_millis(250));
    }
    let output = abuser.wait_with_output().expect("hold-connections ends");
    let summary = String::from_utf8_lossy(&output.stdout).trim().to_string();
    assert!(
        output.status.success(),
        "hold-connections failed ({}): {summary} {}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    sleep(Duration::from_secs(1));
    let (rss_after, fds_after) = rss_and_fds(pid);
    let scrape = lab.lb().run(|| http_get(metrics, "/metrics")).unwrap();
    eprintln!(
        "metrics abuse by {}: {summary}\n  agent RSS {rss_before} KiB before, {rss_max} KiB \
         at most during, {rss_after} KiB after; open descriptors {fds_before} before, \
         {fds_max} at most during, {fds_after} after; slowest `lb status` {:.0} ms over \
         {samples} samples",
        user.name,
        slowest_status.as_secs_f64() * 1000.0
    );
    assert_eq!(scrape.ok(), Some(200), "a scrape after the abuse");
    assert!(
        summary_field(&summary, "opened") >= 3000,
        "the abuse did not happen: {summary}"
    );
    assert!(
        summary_field(&summary, "closed_by_server") >= 3000,
        "the agent did not close the connections: {summary}"
    );
    // The held ones are closed after the request timeout (5 s), the rest at once.
    assert!(
        summary_field(&summary, "longest_held_ms") < 8000,
        "a connection was held too long: {summary}"
    );
    let cap = lb_userspace::listen::LIMITS.max_connections;
    assert!(
        fds_max <= fds_before + cap + 16,
        "descriptors grew with the connections: {fds_before} -> {fds_max} (cap {cap})"
    );
    assert!(
        rss_max < rss_before + 32 * 1024,
        "memory grew with the connections: {rss_before} -> {rss_max} KiB"
    );
    assert!(
        slowest_status < Duration::from_secs(3),
        "{slowest_status:?}"
    );
    assert!(!lab.agent_log().contains("is DOWN"), "{}", lab.agent_log());
}

/// Sets the soft open-file limit of `pid`; returns the limit it had.
fn set_nofile(pid: u32, soft: Option<libc::rlimit>) -> libc::rlimit {
    let mut old = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: prlimit reads `new` and writes `old`, both valid for the call.
    let rc = unsafe {
        let new = soft.as_ref().map_or(std::ptr::null(), |l| l as *const _);
        libc::prlimit(pid as libc::pid_t, libc::RLIMIT_NOFILE, new, &mut old)
    };
    assert_eq!(rc, 0, "prlimit: {}", std::io::Error::last_os_error());
    old
}

/// The agent runs out of file descriptors (its limit is lowered under it): every
/// check fails with EMFILE, on this host's account. No backend goes down; status counts
/// the local errors and shows the last one; once descriptors are back, checks count
/// again.
#[test]
fn checks_failing_for_want_of_descriptors_do_not_take_backends_down() {
    let test = "checks_failing_for_want_of_descriptors_do_not_take_backends_down";
    let Some(bin) = require_e2e(test) else {
        return;
    };
    let lab = lab_with_agent(&bin, LabOptions::default(), XdpMode::Generic, "off");
    let agent = lab.agent().expect("an agent");
    let pid = agent.pid().expect("the agent runs");
    let limit = set_nofile(pid, None);
    // No descriptor number below 3 is free: every socket(2) fails with EMFILE.
    set_nofile(
        pid,
        Some(libc::rlimit {
            rlim_cur: 3,
            rlim_max: limit.rlim_max,
        }),
    );
    // Fast checks (every 200 ms, fall 2): ten times what taking them down would need.
    sleep(Duration::from_millis(2000));
    set_nofile(pid, Some(limit));
    let status = agent.status_json().expect("lb status --json");
    for b in backends(&status) {
        assert_eq!(b["health"], "up", "{b}");
        assert!(b["local_check_errors"].as_u64() > Some(2), "{b}");
        assert_eq!(b["last_local_error"]["local"], true, "{b}");
        let error = b["last_local_error"]["error"].as_str().unwrap_or_default();
        assert!(error.contains("Too many open files"), "{b}");
    }
    // Checks count again.
    sleep(Duration::from_millis(500));
    let log = lab.agent_log();
    assert!(log.contains("local check error for backend"), "{log}");
    assert!(log.contains("run again after"), "{log}");
    assert!(!log.contains("is DOWN"), "{log}");
    let text = agent.status().expect("lb status");
    assert!(text.contains("local check error(s), last: "), "{text}");
}

/// The frames a backend receives for the VIP from the balancer with source MAC `mac`.
fn forwarded_from(mac: [u8; 6], vip: IpAddr) -> impl Fn(&[u8]) -> bool + Send + 'static {
    let IpAddr::V4(vip) = vip else {
        panic!("IPv4 VIP")
    };
    move |frame| {
        frame.len() >= 34
            && frame[6..12] == mac
            && frame[12..14] == [0x08, 0x00]
            && frame[30..34] == vip.octets()
    }
}

fn mac_text(mac: [u8; 6]) -> String {
    mac.map(|b| format!("{b:02x}")).join(":")
}

/// Waits until the status's `dataplane` satisfies `done`; returns it.
fn wait_dataplane(agent: &Agent, what: &str, done: impl Fn(&Value) -> bool) -> Value {
    let started = Instant::now();
    loop {
        let status = agent.status_json().expect("lb status --json");
        if done(&status["dataplane"]) {
            eprintln!("{what}: after {:?}", started.elapsed());
            return status;
        }
        assert!(
            started.elapsed() < FOLLOW_TIMEOUT,
            "{what}: not within {FOLLOW_TIMEOUT:?}: {}",
            status["dataplane"]
        );
        sleep(Duration::from_millis(50));
    }
}

/// Requests through the VIP succeed again (within a few seconds: the client learns the
/// balancer's new MAC, the balancer its backends' on the new interface), and the
/// backends see them from the balancer's MAC `mac`.
fn serves_from(lab: &Lab, mac: [u8; 6]) {
    // The client's neighbour entry for the balancer names the old MAC.
    ip(&["-n", lab.client().name(), "neigh", "flush", "dev", "eth0"]).expect("flush");
    let sniffers: Vec<Sniffer> = lab
        .backends()
        .iter()
        .map(|b| Sniffer::start(b, "eth0", forwarded_from(mac, lab.vip4())).expect("sniffer"))
        .collect();
    let vip = SocketAddr::new(lab.vip4(), PORT);
    let started = Instant::now();
    while let Err(error) = tcp_request(lab.client(), vip, Duration::from_millis(500)) {
        assert!(
            started.elapsed() < FOLLOW_TIMEOUT,
            "no request through the VIP within {FOLLOW_TIMEOUT:?}: {error}\n{}",
            lab.agent_log()
        );
    }
    let spread = spread(lab.client(), vip, 30).expect("requests");
    assert_eq!(spread.failures, 0, "{}", spread.table());
    let seen: usize = sniffers.into_iter().map(|s| s.stop().unwrap_or(0)).sum();
    assert!(
        seen >= 30,
        "backends saw {seen} frames for the VIP from {}",
        mac_text(mac)
    );
}

/// The balancer's interface is deleted under the running agent and created again
/// (another device, another MAC), then changes its MAC: the agent says the data path
/// is detached while it is gone (no stale MAC, no mode), attaches again when it is back
/// and writes its tables, and follows the MAC; traffic flows through the VIP after each
/// change. The backends' checks stay up while the interface is gone: their failures
/// (no route) are this host's.
#[test]
fn the_interface_going_away_and_coming_back_is_followed() {
    let test = "the_interface_going_away_and_coming_back_is_followed";
    let Some(bin) = require_e2e(test) else {
        return;
    };
    let options = LabOptions {
        xdp_pass_on_peer: false,
        ..LabOptions::default()
    };
    let mut lab = lab_with_agent(&bin, options, XdpMode::Generic, "off");
    let vip = SocketAddr::new(lab.vip4(), PORT);
    tcp_request(lab.client(), vip, Duration::from_secs(2)).expect("a request before");

    lab.unplug_lb().expect("delete the balancer's interface");
    let agent = lab.agent().expect("an agent");
    let gone = wait_dataplane(agent, "detached", |d| {
        d["detached"].is_string() && d["xdp_mode"].is_null() && d["interface_mac"].is_null()
    });
    assert!(
        agent.log().contains("interface eth0 (index"),
        "no log line about the interface going:\n{}",
        agent.log()
    );
    let text = agent.status().expect("lb status");
    assert!(
        text.contains("data path: eth0 DETACHED: interface eth0 is gone"),
        "{text}"
    );
    sleep(Duration::from_millis(600));
    for b in backends(&agent.status_json().expect("status")) {
        assert_eq!(
            b["health"], "up",
            "a backend went down with our interface: {b}"
        );
    }
    eprintln!("while gone: {}", gone["dataplane"]);

    let new_mac = [0x02, 0x00, 0x00, 0x00, 0x99, 0x02];
    lab.replug_lb(&mac_text(new_mac))
        .expect("create the interface again");
    let agent = lab.agent().expect("an agent");
    wait_dataplane(agent, "attached again", |d| {
        d["detached"].is_null()
            && d["xdp_mode"] == "generic"
            && d["interface_mac"] == mac_text(new_mac)
    });
    assert!(
        agent.log().contains("interface eth0 is back"),
        "{}",
        agent.log()
    );
    serves_from(&lab, new_mac);

    let moved = [0x02, 0x00, 0x00, 0x00, 0x99, 0x03];
    ip(&[
        "-n",
        lab.lb().name(),
        "link",
        "set",
        "eth0",
        "address",
        &mac_text(moved),
    ])
    .expect("change the MAC");
    let agent = lab.agent().expect("an agent");
    wait_dataplane(agent, "MAC followed", |d| {
        d["interface_mac"] == mac_text(moved) && d["xdp_mode"] == "generic"
    });
    assert!(agent.log().contains("changed its MAC"), "{}", agent.log());
    serves_from(&lab, moved);
}

/// The lab's agent config with its pins in `pins`, written to `name` in the lab's
/// directory, with `backends` of the lab's (by index) and control socket `socket`.
fn write_config(lab: &Lab, name: &str, pins: Option<&Path>, backends: &[usize]) -> PathBuf {
    let mut vip = lab.vip(VIP, false, PORT, Protocol::Tcp, Health::fast_tcp());
    vip.backends = backends
        .iter()
        .map(|&i| BackendConfig::new(lab.backend_addr(i, false)))
        .collect();
    let mut config = lab.agent_config(XdpMode::Generic, vec![vip]);
    config.socket = lab.dir().join(format!("{name}.sock"));
    let text = match pins {
        Some(pins) => config.to_toml_pinned(pins),
        None => config.to_toml(),
    };
    let path = lab.dir().join(format!("{name}.toml"));
    std::fs::write(&path, text).expect("write the config");
    path
}

/// A second `lb run` on the interface of a running agent (another config, another
/// control socket; the same pins, or others) exits at once, non-zero, naming the
/// running agent; the data path keeps the first agent's tables.
#[test]
fn a_second_agent_on_the_interface_is_refused_and_changes_nothing() {
    let test = "a_second_agent_on_the_interface_is_refused_and_changes_nothing";
    let Some(bin) = require_e2e(test) else {
        return;
    };
    let mut lab = Lab::new(LabOptions::default()).expect("build the lab");
    lab.serve_tcp(PORT, false).expect("backend servers");
    let pins = PinDir::new(&format!("second-{}", lab.lb().name())).expect("pin directory");
    let first_config = write_config(&lab, "first", Some(pins.path()), &[0, 1, 2]);
    let first_socket = lab.dir().join("first.sock");
    let log = lab.dir().join("first.log");
    let first = Agent::start(&bin, lab.lb(), &first_config, &first_socket, &log)
        .expect("start the first agent");
    let (view, _) = wait_backends_up(&first, VIP, UP_TIMEOUT, &|| false).expect("status");
    assert_eq!(view.up(), 3, "{}", view.summary());
    let first_pid = first.pid().expect("the first agent runs");

    // Only backend 1: had it written its table, every request would go there.
    let same_pins = write_config(&lab, "second", Some(pins.path()), &[0]);
    let own_pins = write_config(&lab, "third", None, &[0]);
    for config in [&same_pins, &own_pins] {
        let started = Instant::now();
        let args = [
            Path::new("run").as_os_str(),
            "--config".as_ref(),
            config.as_os_str(),
        ];
        let out = lab
            .lb()
            .run(|| run_lb(&bin, &args))
            .unwrap()
            .expect("run the second agent");
        eprintln!(
            "second agent ({}): {} after {:?}: {}",
            config.display(),
            out.status,
            started.elapsed(),
            out.stderr.trim()
        );
        assert!(!out.success(), "the second agent ran: {out}");
        for named in [
            "another agent runs on interface eth0".to_string(),
            format!("pid {first_pid}"),
            first_socket.display().to_string(),
        ] {
            assert!(out.stderr.contains(&named), "no {named:?} in: {out}");
        }
        let socket = config.with_extension("sock");
        assert!(!socket.exists(), "{} was made", socket.display());
    }
    let status = first.status_json().expect("the first agent answers");
    assert_eq!(status["dataplane"]["start"], "fresh");
    let spread = spread(lab.client(), SocketAddr::new(lab.vip4(), PORT), 60).expect("spread");
    assert_eq!(spread.failures, 0, "{}", spread.table());
    assert_eq!(
        spread.counts.len(),
        3,
        "the first agent's table (3 backends) must still serve:\n{}",
        spread.table()
    );
    drop(first);
}

/// A backend at the balancer's own address: `lb run` refuses to start (exit 2, the
/// field named) before touching anything; a reload to such a file is refused and the
/// running configuration stays.
#[test]
fn a_backend_at_the_balancers_own_address_is_refused_at_start_and_on_reload() {
    let test = "a_backend_at_the_balancers_own_address_is_refused_at_start_and_on_reload";
    let Some(bin) = require_e2e(test) else {
        return;
    };
    let mut lab = Lab::new(LabOptions::default()).expect("build the lab");
    lab.serve_tcp(PORT, false).expect("backend servers");
    let mut vip = lab.vip(VIP, false, PORT, Protocol::Tcp, Health::fast_tcp());
    let good = lab.agent_config(XdpMode::Generic, vec![vip.clone()]);
    vip.backends.push(BackendConfig::new(lab.lb_addr(false)));
    let bad = lab.agent_config(XdpMode::Generic, vec![vip]);
    let bad_path = lab.dir().join("bad.toml");
    std::fs::write(&bad_path, bad.to_toml()).unwrap();
    let args = [
        Path::new("run").as_os_str(),
        "--config".as_ref(),
        bad_path.as_os_str(),
    ];
    let out = lab
        .lb()
        .run(|| run_lb(&bin, &args))
        .unwrap()
        .expect("lb run");
    assert_eq!(out.status.code(), Some(2), "{out}");
    assert!(out.stderr.contains("`vip[0].backend[3].address`"), "{out}");
    assert!(
        out.stderr
            .contains("10.99.0.2 is an address of dataplane.interface eth0"),
        "{out}"
    );

    let agent = lab.start_agent(&bin, &good).expect("start the agent");
    std::fs::write(agent.config_path(), bad.to_toml()).unwrap();
    let reload = agent.cli(&["reload"]).expect("lb reload");
    assert!(!reload.success(), "{reload}");
    assert!(
        reload.stderr.contains("vip[0].backend[3].address"),
        "{reload}"
    );
    let status = agent.status_json().expect("status");
    assert_eq!(
        backends(&status).len(),
        3,
        "the running configuration stays"
    );
}
