//! End to end: `lb peer attach` gives a veth's peer the XDP program native XDP_TX needs,
//! and an agent that adopts a program it left in generic mode (its peer had none then)
//! moves it to native once the peer has one.
//!
//! The lab's balancer port (`p-lb`, in the switch namespace) starts without a program:
//! `xdp_mode = "auto"` attaches generic. After `lb peer attach p-lb` and a restart, the
//! data path runs native, adopted (same maps), and serves the VIP.
//! `cargo test -p lb-tests --test peer`.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use lb_tests::router::PinDir;
use lb_tests::{
    Agent, Health, Lab, LabOptions, Protocol, XdpMode, agent::run_lb, require_e2e, tcp_request,
};

const TIMEOUT: Duration = Duration::from_secs(2);
/// The balancer's bridge port, in the switch namespace.
const LB_PORT: &str = "p-lb";

fn dataplane_field(agent: &Agent, field: &str) -> String {
    let status = agent.status_json().expect("lb status --json");
    status["dataplane"][field]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

/// Waits until the VIP's three backends are up (checked backends start down).
fn wait_all_up(agent: &Agent) {
    let (view, _) = lb_tests::wait_backends_up(agent, "web", Duration::from_secs(10), &|| false)
        .expect("lb status --json");
    assert_eq!(view.up(), 3, "backends not up: {view:?}");
}

/// `lb peer ARGS` in the switch namespace, where the balancer's port is.
fn peer(lab: &Lab, bin: &Path, args: &[&str]) -> lb_tests::agent::CliOutput {
    let mut all = vec!["peer"];
    all.extend(args);
    lab.switch()
        .run(|| run_lb(bin, &all))
        .expect("enter the switch namespace")
        .expect("run lb peer")
}

#[test]
fn a_generic_data_path_moves_to_native_once_the_peer_has_a_program() {
    let Some(bin) = require_e2e("a_generic_data_path_moves_to_native_once_the_peer_has_a_program")
    else {
        return;
    };
    let mut lab = Lab::new(LabOptions {
        xdp_pass_on_peer: false,
        ..LabOptions::default()
    })
    .expect("build the lab");
    lab.serve_tcp(80, false).expect("backend servers");
    let pins = PinDir::new(&format!("peer-{}", lab.lb().name())).expect("pin directory");
    let peer_pins = PinDir::new(&format!("peer-pass-{}", lab.lb().name())).expect("pin dir");
    let peer_pins_arg = peer_pins.path().to_str().unwrap().to_string();
    let vip = lab.vip("web", false, 80, Protocol::Tcp, Health::fast_tcp());
    let config = lab.agent_config(XdpMode::Auto, vec![vip]);
    let config_path = lab.dir().join("lb.toml");
    std::fs::write(&config_path, config.to_toml_pinned(pins.path())).expect("write the config");
    let start = |run: u32| {
        let log = lab.dir().join(format!("lb-{run}.log"));
        Agent::start(&bin, lab.lb(), &config_path, &lab.socket_path(), &log)
            .expect("start the agent")
    };

    // No program on the peer: auto attaches generic, which serves.
    let first = start(1);
    wait_all_up(&first);
    assert_eq!(
        dataplane_field(&first, "xdp_mode"),
        "generic",
        "{}",
        first.log()
    );
    let address = SocketAddr::new(lab.vip4(), 80);
    tcp_request(lab.client(), address, TIMEOUT).expect("a request in generic mode");
    first
        .stop()
        .expect("stop the agent (the program stays attached)");

    let attached = peer(
        &lab,
        &bin,
        &["attach", LB_PORT, "--pin-path", &peer_pins_arg],
    );
    assert!(attached.success(), "lb peer attach: {attached}");
    assert!(
        attached
            .stdout
            .contains("xdp_pass on p-lb (xdp mode native)"),
        "{attached}"
    );
    let shown = lab
        .switch()
        .exec("ip", &["-d", "link", "show", LB_PORT])
        .unwrap();
    assert!(
        shown.contains("xdp"),
        "no XDP program on {LB_PORT}:\n{shown}"
    );
    // Attaching again replaces the program on its link.
    let again = peer(
        &lab,
        &bin,
        &["attach", LB_PORT, "--pin-path", &peer_pins_arg],
    );
    assert!(again.success(), "lb peer attach, again: {again}");

    // The restarted agent adopts the pinned maps and moves the program to native.
    let second = start(2);
    wait_all_up(&second);
    assert_eq!(
        dataplane_field(&second, "start"),
        "adopted",
        "{}",
        second.log()
    );
    assert_eq!(
        dataplane_field(&second, "xdp_mode"),
        "native",
        "adopted, but left in generic mode:\n{}",
        second.log()
    );
    let log = second.log();
    let moved = log
        .lines()
        .find(|l| l.contains("native mode attached"))
        .unwrap_or_else(|| panic!("the switch is logged:\n{log}"));
    println!("{moved}");
    for i in 0..20 {
        tcp_request(lab.client(), address, TIMEOUT)
            .unwrap_or_else(|e| panic!("request {i} in native mode: {e}"));
    }
    second.stop().expect("stop the agent");

    let detached = peer(
        &lab,
        &bin,
        &["detach", LB_PORT, "--pin-path", &peer_pins_arg],
    );
    assert!(detached.success(), "lb peer detach: {detached}");
    let shown = lab
        .switch()
        .exec("ip", &["-d", "link", "show", LB_PORT])
        .unwrap();
    assert!(!shown.contains("prog/xdp"), "still attached:\n{shown}");
    let twice = peer(
        &lab,
        &bin,
        &["detach", LB_PORT, "--pin-path", &peer_pins_arg],
    );
    assert_eq!(twice.status.code(), Some(1), "{twice}");
    assert!(twice.stderr.contains("nothing attached to p-lb"), "{twice}");
}
