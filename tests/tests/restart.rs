//! End to end: the agent is killed with SIGKILL and started again while a client keeps
//! sending; the pinned program keeps forwarding with the last tables, and the new agent
//! adopts the pinned program and maps (connection table included).
//!
//! The pins live on a bpffs mounted at `lb_tests::router::PIN_FS` (outside /sys): the agent runs under
//! `ip netns exec`, which gives it a fresh /sys, so a bpffs it mounted there would vanish
//! with it. `cargo test -p lb-tests --test restart`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::thread;
use std::time::{Duration, Instant};

use lb_tests::client::tcp_request_retransmits;
use lb_tests::router::PinDir;
use lb_tests::{Agent, Conn, Health, Lab, LabOptions, Protocol, XdpMode, require_e2e, tcp_request};

const TIMEOUT: Duration = Duration::from_secs(2);

/// The lab's agent config with checked backends and the pins in `pins`.
fn write_config(lab: &Lab, pins: &Path, weights: &[u32]) -> PathBuf {
    write_config_sized(lab, pins, weights, None)
}

/// `write_config` with a Maglev table size (None: the default).
fn write_config_sized(lab: &Lab, pins: &Path, weights: &[u32], table: Option<u32>) -> PathBuf {
    let mut vip = lab.vip("web", false, 80, Protocol::Tcp, Health::fast_tcp());
    for (backend, weight) in vip.backends.iter_mut().zip(weights) {
        backend.weight = *weight;
    }
    let mut config = lab.agent_config(XdpMode::Native, vec![vip]);
    config.maglev_table_size = table;
    let path = lab.dir().join("lb.toml");
    std::fs::write(&path, config.to_toml_pinned(pins)).expect("write the config");
    path
}

fn start(lab: &Lab, bin: &Path, config: &Path, run: u32) -> Agent {
    let log = lab.dir().join(format!("lb-{run}.log"));
    Agent::start(bin, lab.lb(), config, &lab.socket_path(), &log).expect("start the agent")
}

fn sigkill(agent: &Agent) {
    let pid = agent.pid().expect("the agent runs");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::SIGKILL,
    )
    .expect("SIGKILL the agent");
}

fn status_field(agent: &Agent, field: &str) -> String {
    let status = agent.status_json().expect("lb status --json");
    status["dataplane"][field]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

/// Waits until every backend is up (checked backends start down).
fn wait_all_up(agent: &Agent, backends: usize) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let status = agent.status_json().expect("lb status --json");
        let up = status["vips"][0]["backends"]
            .as_array()
            .map_or(0, |b| b.iter().filter(|b| b["health"] == "up").count());
        if up == backends {
            return;
        }
        assert!(Instant::now() < deadline, "backends not up: {status}");
        thread::sleep(Duration::from_millis(100));
    }
}

/// Sends `n` requests, one new connection each, `gap` apart; returns the failures: a
/// request that failed, or whose connection needed a retransmission (a SYN that found no
/// program is sent again after 1 s and then succeeds: the client's kernel counts it,
/// where a wall-clock bound would also count a loaded machine's delays).
fn request_loop(lab: &Lab, n: usize, gap: Duration) -> Vec<String> {
    let vip = SocketAddr::new(lab.vip4(), 80);
    let started = Instant::now();
    let mut failures = Vec::new();
    let mut slowest = Duration::ZERO;
    for i in 0..n {
        let sent = Instant::now();
        match tcp_request_retransmits(lab.client(), vip, TIMEOUT) {
            Err(error) => failures.push(format!("request {i} at {:?}: {error}", started.elapsed())),
            Ok((_, retransmitted)) if retransmitted > 0 => failures.push(format!(
                "request {i} at {:?}: {retransmitted} segment(s) retransmitted (a SYN was \
                 lost), took {:?}",
                started.elapsed(),
                sent.elapsed()
            )),
            Ok(_) => {}
        }
        slowest = slowest.max(sent.elapsed());
        thread::sleep(gap);
    }
    eprintln!("{n} requests, the slowest took {slowest:?}");
    failures
}

#[test]
fn sigkill_and_restart_lose_no_request_and_no_connection() {
    let Some(bin) = require_e2e("sigkill_and_restart_lose_no_request_and_no_connection") else {
        return;
    };
    let mut lab = Lab::new(LabOptions::default()).expect("build the lab");
    lab.serve_tcp(80, false).expect("backend servers");
    let pins = PinDir::new(&format!("restart-{}", lab.lb().name())).expect("pin directory");
    let config = write_config(&lab, pins.path(), &[1, 1, 1]);
    let first = start(&lab, &bin, &config, 1);
    wait_all_up(&first, 3);
    assert_eq!(status_field(&first, "start"), "fresh");

    let vip = SocketAddr::new(lab.vip4(), 80);
    let mut long_lived = Conn::open(lab.client(), vip, TIMEOUT).expect("long-lived connection");
    long_lived.echo(b"before").expect("echo before the restart");

    // 200 requests at 20 ms (about 5 s with the requests themselves), across the kill
    // and the restart.
    let (failures, second) = thread::scope(|scope| {
        let requests = scope.spawn(|| request_loop(&lab, 200, Duration::from_millis(20)));
        thread::sleep(Duration::from_millis(800));
        sigkill(&first);
        long_lived
            .echo(b"while no agent runs")
            .expect("echo with the agent dead");
        thread::sleep(Duration::from_millis(500));
        let second = start(&lab, &bin, &config, 2);
        (requests.join().expect("request thread"), second)
    });
    assert_eq!(
        status_field(&second, "start"),
        "adopted",
        "log:\n{}",
        second.log()
    );
    assert!(
        failures.is_empty(),
        "{} requests failed: {failures:#?}",
        failures.len()
    );
    long_lived
        .echo(b"after the restart")
        .expect("echo after the restart");

    // The new agent runs health checks again and keeps every backend in the table.
    wait_all_up(&second, 3);
    let status = second.status_json().unwrap();
    assert_eq!(
        status["counters"]["ct_miss_non_syn"], 0,
        "flows were broken: {status}"
    );
    long_lived.close().expect("orderly close");
    drop(second);
    drop(first);
}

#[test]
fn restart_with_a_changed_config_keeps_flows_of_unchanged_backends() {
    let Some(bin) = require_e2e("restart_with_a_changed_config_keeps_flows_of_unchanged_backends")
    else {
        return;
    };
    let mut lab = Lab::new(LabOptions::default()).expect("build the lab");
    lab.serve_tcp(80, false).expect("backend servers");
    let pins = PinDir::new(&format!("change-{}", lab.lb().name())).expect("pin directory");
    let config = write_config(&lab, pins.path(), &[1, 1, 1]);
    let first = start(&lab, &bin, &config, 1);
    wait_all_up(&first, 3);

    // Connections to every backend; the new config changes backend-3's weight only.
    let vip = SocketAddr::new(lab.vip4(), 80);
    let mut conns = Vec::new();
    for _ in 0..30 {
        conns.push(Conn::open(lab.client(), vip, TIMEOUT).expect("connection"));
    }
    let backends: Vec<String> = conns.iter().map(|c| c.backend().to_string()).collect();
    sigkill(&first);
    let config = write_config(&lab, pins.path(), &[1, 1, 5]);
    let second = start(&lab, &bin, &config, 2);
    assert_eq!(
        status_field(&second, "start"),
        "adopted",
        "log:\n{}",
        second.log()
    );
    let status = second.status_json().unwrap();
    assert_eq!(
        status["vips"][0]["backends"][2]["weight"], 5,
        "the change applied: {status}"
    );
    for (i, conn) in conns.iter_mut().enumerate() {
        conn.echo(format!("data {i}").as_bytes())
            .unwrap_or_else(|e| panic!("connection {i} to {} broke: {e}", backends[i]));
    }
    for conn in conns {
        conn.close().expect("orderly close");
    }
    let status = second.status_json().unwrap();
    assert_eq!(
        status["counters"]["ct_miss_non_syn"], 0,
        "flows were broken: {status}"
    );
}

#[test]
fn detach_on_exit_removes_the_program_and_its_pins() {
    let Some(bin) = require_e2e("detach_on_exit_removes_the_program_and_its_pins") else {
        return;
    };
    let mut lab = Lab::new(LabOptions::default()).expect("build the lab");
    lab.serve_tcp(80, false).expect("backend servers");
    let pins = PinDir::new(&format!("detach-{}", lab.lb().name())).expect("pin directory");
    let config = write_config(&lab, pins.path(), &[1, 1, 1]);
    let agent = start(&lab, &bin, &config, 1);
    wait_all_up(&agent, 3);
    assert!(pins.path().join("link").exists(), "the link is pinned");
    drop(agent); // SIGTERM: the default keeps the program attached.
    assert!(
        pins.path().join("link").exists(),
        "a plain stop leaves the program attached"
    );
    let vip = SocketAddr::new(lab.vip4(), 80);
    tcp_request(lab.client(), vip, TIMEOUT).expect("still balanced with no agent");

    // `lb detach` removes it; the VIP is then no longer balanced, even while another
    // process (here this test) holds the link, which unpinning alone would leave attached.
    let held = aya::programs::links::PinnedLink::from_pin(pins.path().join("link"))
        .expect("open the pinned link");
    let out =
        lb_tests::agent::run_lb(&bin, &["detach", "--config", config.to_str().unwrap()]).unwrap();
    assert!(out.success(), "lb detach: {}", out.stderr);
    assert!(!pins.path().exists(), "pins removed");
    let link = lab
        .lb()
        .exec("ip", &["-d", "link", "show", lb_tests::lab::IFACE])
        .expect("ip link");
    assert!(
        !link.contains("prog/xdp"),
        "still attached after lb detach:\n{link}"
    );
    drop(held);
    // A packet the kernel was already handing to the detached program may still be
    // balanced (a loaded run once saw one answer): the VIP must go quiet within seconds.
    let deadline = Instant::now() + Duration::from_secs(5);
    while tcp_request(lab.client(), vip, Duration::from_millis(500)).is_ok() {
        assert!(
            Instant::now() < deadline,
            "the VIP still answers 5 s after detach"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn pinned_maps_are_adopted_when_compatible_and_replaced_otherwise() {
    use lb_userspace::dataplane::{AyaDataplane, Dataplane, Found, LoadOptions};
    if require_e2e("pinned_maps_are_adopted_when_compatible_and_replaced_otherwise").is_none() {
        return;
    }
    let pins = PinDir::new(&format!("layout-{}", std::process::id())).expect("pin directory");
    let options = |table_size| LoadOptions {
        maglev_table_size: table_size,
        ifindex: 0,
        ..small_load_options()
    };
    let (key, entry) = sample_flow();
    let object = lb_userspace::EBPF_OBJECT;

    let (mut first, found) = AyaDataplane::load_pinned(object, options(251), pins.path()).unwrap();
    assert_eq!(found, Found::Nothing);
    first.insert_flow(&key, &entry).unwrap();
    drop(first);

    let (second, found) = AyaDataplane::load_pinned(object, options(251), pins.path()).unwrap();
    assert!(matches!(found, Found::Compatible(_)), "{found:?}");
    assert_eq!(
        second.flow(&key).unwrap(),
        Some(entry),
        "the connection table was adopted"
    );
    drop(second);

    // A configuration that needs fewer VIPs adopts the larger pinned capacity.
    let mut smaller = options(251);
    smaller.vip_capacity = 8;
    let (fourth, found) = AyaDataplane::load_pinned(object, smaller, pins.path()).unwrap();
    assert!(matches!(found, Found::Compatible(_)), "{found:?}");
    assert_eq!(fourth.options().vip_capacity, 16);
    drop(fourth);

    let (third, found) = AyaDataplane::load_pinned(object, options(257), pins.path()).unwrap();
    assert_eq!(
        found,
        Found::Incompatible("pinned maglev_table_size is 251, this agent needs 257".into())
    );
    assert_eq!(
        third.flow(&key).unwrap(),
        None,
        "replaced: the old table is gone"
    );
}

#[test]
fn an_incompatible_restart_replaces_the_maps_without_detaching() {
    let Some(bin) = require_e2e("an_incompatible_restart_replaces_the_maps_without_detaching")
    else {
        return;
    };
    let mut lab = Lab::new(LabOptions::default()).expect("build the lab");
    lab.serve_tcp(80, false).expect("backend servers");
    let pins = PinDir::new(&format!("replace-{}", lab.lb().name())).expect("pin directory");
    let config = write_config(&lab, pins.path(), &[1, 1, 1]);
    let first = start(&lab, &bin, &config, 1);
    wait_all_up(&first, 3);
    // A new table size: the pinned maps cannot be adopted. New connections keep working
    // throughout: the new program takes over the pinned link, no gap.
    let (failures, second) = thread::scope(|scope| {
        let requests = scope.spawn(|| request_loop(&lab, 150, Duration::from_millis(20)));
        thread::sleep(Duration::from_millis(600));
        sigkill(&first);
        let config = write_config_sized(&lab, pins.path(), &[1, 1, 1], Some(251));
        let second = start(&lab, &bin, &config, 2);
        (requests.join().expect("request thread"), second)
    });
    let start_state = status_field(&second, "start");
    assert!(
        start_state.starts_with("replaced (pinned maglev_table_size"),
        "{start_state}"
    );
    assert!(
        failures.is_empty(),
        "{} requests failed: {failures:#?}",
        failures.len()
    );
    wait_all_up(&second, 3);
    let vip = SocketAddr::new(lab.vip4(), 80);
    tcp_request(lab.client(), vip, TIMEOUT).expect("served by the new program");
}

/// Every reason a restarted agent refuses the pinned maps, each on its own pins: the
/// pinned state is replaced (the flow written before is gone), the reason names what
/// differs, and the new `LB_META` records this agent's layout, so the next start adopts.
#[test]
fn every_incompatible_pin_is_refused_with_its_reason_and_replaced() {
    use lb_common::{LAYOUT_VERSION, MAP_META, meta};
    use lb_userspace::dataplane::{AyaDataplane, Dataplane, Found, LoadOptions};
    let test = "every_incompatible_pin_is_refused_with_its_reason_and_replaced";
    if require_e2e(test).is_none() {
        return;
    }
    let base = small_load_options();
    let (key, entry) = sample_flow();
    let object = lb_userspace::EBPF_OBJECT;
    // (what differs, how the pins are changed after the first agent, the second agent's
    // options, the reason expected at its start)
    type Tamper = fn(&Path);
    let cases: [(&str, Tamper, LoadOptions, String); 6] = [
        (
            "layout version",
            |dir| {
                let mut array = meta_array_of(dir);
                array.set(meta::LAYOUT, LAYOUT_VERSION + 1, 0).unwrap();
            },
            base,
            format!(
                "pinned layout version is {}, this agent needs {LAYOUT_VERSION}",
                LAYOUT_VERSION + 1
            ),
        ),
        (
            "conntrack_entries",
            |_| {},
            LoadOptions {
                conntrack_entries: 2048,
                ..base
            },
            "pinned conntrack_entries is 1024, this agent needs 2048".into(),
        ),
        (
            "max_backends",
            |_| {},
            LoadOptions {
                max_backends: 8,
                ..base
            },
            "pinned backend capacity is 4096, this configuration asks for \
             dataplane.max_backends = 8"
                .into(),
        ),
        (
            "interface index",
            |_| {},
            LoadOptions { ifindex: 2, ..base },
            "pinned for interface index 1, this agent attaches to 2".into(),
        ),
        (
            "a larger VIP capacity",
            |_| {},
            LoadOptions {
                vip_capacity: 32,
                ..base
            },
            "pinned VIP capacity is 16, this configuration needs 32".into(),
        ),
        (
            "an unreadable LB_META",
            |dir| {
                // A program pinned where the map was (bpffs holds no plain files): the
                // pin opens, but is no map.
                std::fs::remove_file(dir.join(MAP_META)).unwrap();
                let mut test_object =
                    aya::Ebpf::load(lb_tests::program::TEST_OBJECT).expect("the test object");
                let program: &mut aya::programs::Xdp = test_object
                    .program_mut("xdp_pass")
                    .expect("xdp_pass")
                    .try_into()
                    .expect("an XDP program");
                program.load().expect("load xdp_pass");
                program.pin(dir.join(MAP_META)).expect("pin it as LB_META");
            },
            base,
            "unreadable ".into(),
        ),
    ];
    for (case, (what, tamper, options, reason)) in cases.into_iter().enumerate() {
        let pins =
            PinDir::new(&format!("refuse-{}-{case}", std::process::id())).expect("pin directory");
        let (mut first, found) = AyaDataplane::load_pinned(object, base, pins.path()).unwrap();
        assert_eq!(found, Found::Nothing, "{what}");
        first.insert_flow(&key, &entry).unwrap();
        drop(first);
        tamper(pins.path());

        let (second, found) = AyaDataplane::load_pinned(object, options, pins.path()).unwrap();
        match &found {
            Found::Incompatible(why) => assert!(
                why.starts_with(&reason),
                "{what}: refused for {why:?}, not {reason:?}"
            ),
            other => panic!("{what}: {other:?}, not refused"),
        }
        assert_eq!(
            second.flow(&key).unwrap(),
            None,
            "{what}: the old connection table was kept"
        );
        let recorded = meta_array_of(pins.path());
        assert_eq!(recorded.get(&meta::LAYOUT, 0).unwrap(), LAYOUT_VERSION);
        drop(second);
        // The replacement is what the next start of the same agent adopts.
        let (_third, found) = AyaDataplane::load_pinned(object, options, pins.path()).unwrap();
        assert!(
            matches!(found, Found::Compatible(_)),
            "{what}: the replaced pins are not adopted: {found:?}"
        );
    }
}

/// `LB_META` pinned in `dir`, for writing.
fn meta_array_of(dir: &Path) -> aya::maps::Array<aya::maps::MapData, u64> {
    let map = aya::maps::MapData::from_pin(dir.join(lb_common::MAP_META)).expect("LB_META");
    aya::maps::Array::try_from(aya::maps::Map::Array(map)).expect("LB_META is an array")
}

/// A small data path, for the tests that load it directly: a 251-slot table, 16 VIPs,
/// 1024 connection-table entries, recorded for interface index 1.
fn small_load_options() -> lb_userspace::dataplane::LoadOptions {
    lb_userspace::dataplane::LoadOptions {
        maglev_table_size: 251,
        vip_capacity: 16,
        iface_mac: [2, 0, 0, 0, 0, 1],
        conntrack_entries: 1024,
        max_backends: 4096,
        flow_idle: Duration::from_secs(30),
        conntrack_insert_limit: 0,
        capture_rate: 0,
        source_sample: 1,
        ifindex: 1,
        cluster_export: false,
        program: lb_userspace::dataplane::next::LB_XDP,
        egress_count: 1,
    }
}

/// A connection-table entry to write before a restart and look for after it.
fn sample_flow() -> (lb_common::FlowKey, lb_common::FlowEntry) {
    let key = lb_common::FlowKey::between(
        "10.0.0.1:40000".parse().unwrap(),
        "10.0.0.100:80".parse().unwrap(),
        lb_common::PROTO_TCP,
    );
    let entry = lb_common::FlowEntry {
        backend_id: 7,
        flags: 0,
        last_seen_ns: 1,
    };
    (key, entry)
}
