//! End to end, two-arm (`dataplane.interfaces = ["eth0", "eth1"]`): clients on one
//! bridge, two backends on another reached through the balancer's second interface
//! (XDP_REDIRECT through the DEVMAP), one backend beside the clients (XDP_TX). Replies go
//! from each backend straight to the client: the backends behind `eth1` have a second
//! leg on the clients' bridge and route the client's subnet there.
//!
//! ```text
//!   client 10.99.0.1          lb eth0 10.99.0.2        b3 10.99.0.13 (VIP on lo)
//!   [======================= br0 ==============================]
//!        | b1 eth1 10.99.0.11, b2 eth1 10.99.0.12 (replies)
//!   lb eth1 10.98.2.2    b1 eth0 10.98.2.11    b2 eth0 10.98.2.12 (VIP on lo)
//!   [======================= br1 ==============================]
//! ```
//!
//! Native mode on veth needs a program on each of the balancer's bridge ports (XDP_TX
//! and redirected frames are received there through XDP). `cargo test -p lb-tests --test
//! multinic`.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::thread;
use std::time::{Duration, Instant};

use lb_tests::client::tcp_request_retransmits;
use lb_tests::lab::{XdpPass, arp_for_dsr, switch_namespace};
use lb_tests::netns::ip;
use lb_tests::router::PinDir;
use lb_tests::{
    Agent, AgentConfig, BackendConfig, Conn, Health, Netns, Protocol, TcpServer, VipConfig,
    XdpMode, require_e2e, spread, wait_backends_up,
};

const TIMEOUT: Duration = Duration::from_secs(2);
const VIP: Ipv4Addr = Ipv4Addr::new(10, 99, 0, 100);
/// The backends behind `eth1`, then the one beside the clients.
const BACKENDS: [Ipv4Addr; 3] = [
    Ipv4Addr::new(10, 98, 2, 11),
    Ipv4Addr::new(10, 98, 2, 12),
    Ipv4Addr::new(10, 99, 0, 13),
];

/// The two-arm test bed; dropping it stops the servers and deletes the namespaces (the
/// agent and pins are the test's).
struct TwoArm {
    servers: Vec<Option<TcpServer>>,
    _pass: Vec<XdpPass>,
    client: Netns,
    lb: Netns,
    backends: Vec<Netns>,
    switch: Netns,
    dir: tempfile::TempDir,
}

/// A veth from `ns` (as `dev`, with `addr`/24, up) to a port of `bridge`.
fn plug(switch: &Netns, bridge: &str, port: &str, ns: &Netns, dev: &str, addr: Ipv4Addr) {
    let sw = switch.name();
    let n = ns.name();
    let cidr = format!("{addr}/24");
    for args in [
        &[
            "-n", sw, "link", "add", port, "type", "veth", "peer", "name", dev, "netns", n,
        ][..],
        &["-n", sw, "link", "set", port, "master", bridge, "up"],
        &["-n", n, "addr", "add", &cidr, "dev", dev],
        &["-n", n, "link", "set", dev, "up"],
    ] {
        ip(args).expect("ip");
    }
}

impl TwoArm {
    fn new() -> TwoArm {
        let switch = switch_namespace().expect("switch namespace");
        ip(&["-n", switch.name(), "link", "add", "br1", "type", "bridge"]).expect("br1");
        ip(&["-n", switch.name(), "link", "set", "br1", "up"]).expect("br1 up");
        let client = Netns::new("client").expect("client");
        plug(
            &switch,
            "br0",
            "p-client",
            &client,
            "eth0",
            [10, 99, 0, 1].into(),
        );
        ip(&[
            "-n",
            client.name(),
            "route",
            "add",
            &format!("{VIP}/32"),
            "via",
            "10.99.0.2",
        ])
        .expect("client route");
        // Native XDP_TX and redirects on veth lose CHECKSUM_PARTIAL.
        client
            .exec("ethtool", &["-K", "eth0", "tx", "off"])
            .expect("ethtool");
        let lb = Netns::new("lb").expect("lb");
        plug(&switch, "br0", "p-lb0", &lb, "eth0", [10, 99, 0, 2].into());
        plug(&switch, "br1", "p-lb1", &lb, "eth1", [10, 98, 2, 2].into());
        let mut backends = Vec::new();
        for (i, address) in BACKENDS.iter().enumerate() {
            let ns = Netns::new(&format!("b{}", i + 1)).expect("backend");
            let bridge = if i < 2 { "br1" } else { "br0" };
            plug(
                &switch,
                bridge,
                &format!("p-b{}", i + 1),
                &ns,
                "eth0",
                *address,
            );
            if i < 2 {
                // The reply leg: the clients' subnet is on-link here.
                let leg = Ipv4Addr::new(10, 99, 0, 11 + i as u8);
                plug(&switch, "br0", &format!("p-r{}", i + 1), &ns, "eth1", leg);
                arp_for_dsr(&ns, "eth1").expect("arp");
                for conf in ["all", "default", "eth0", "eth1"] {
                    ns.sysctl(&format!("net.ipv4.conf.{conf}.rp_filter"), "0")
                        .expect("rp_filter");
                }
            }
            ip(&[
                "-n",
                ns.name(),
                "addr",
                "add",
                &format!("{VIP}/32"),
                "dev",
                "lo",
            ])
            .expect("VIP on lo");
            arp_for_dsr(&ns, "eth0").expect("arp");
            backends.push(ns);
        }
        let pass = ["p-lb0", "p-lb1"]
            .iter()
            .map(|port| XdpPass::attach(&switch, port).expect("xdp_pass on a bridge port"))
            .collect();
        let servers = backends
            .iter()
            .enumerate()
            .map(|(i, ns)| {
                let name = format!("backend-{}", i + 1);
                Some(TcpServer::start(ns, "0.0.0.0:80".parse().unwrap(), &name).expect("server"))
            })
            .collect();
        let dir = tempfile::Builder::new()
            .prefix("lbt-multinic-")
            .tempdir()
            .expect("tempdir");
        TwoArm {
            servers,
            _pass: pass,
            client,
            lb,
            backends,
            switch,
            dir,
        }
    }

    fn socket(&self) -> PathBuf {
        self.dir.path().join("lb.sock")
    }

    /// The balancer's config on both interfaces, pinned in `pins`.
    fn config(&self, mode: XdpMode, pins: &Path) -> PathBuf {
        let vip = VipConfig {
            name: "web".into(),
            address: VIP.into(),
            port: 80,
            protocol: Protocol::Tcp,
            hash: None,
            drain_timeout: Some(Duration::from_secs(30)),
            health: Health::fast_tcp(),
            backends: BACKENDS
                .iter()
                .map(|a| BackendConfig::new((*a).into()))
                .collect(),
            extra: Vec::new(),
        };
        let config = AgentConfig {
            interface: "eth0".into(),
            xdp_mode: mode,
            maglev_table_size: Some(251),
            conntrack_entries: Some(4096),
            flow_idle_timeout: None,
            socket: self.socket(),
            metrics: "off".into(),
            vips: vec![vip],
        };
        let text = config.to_toml_pinned(pins).replacen(
            "interface = \"eth0\"",
            "interfaces = [\"eth0\", \"eth1\"]",
            1,
        );
        let path = self.dir.path().join("lb.toml");
        std::fs::write(&path, text).expect("write the config");
        path
    }

    fn start(&self, bin: &Path, config: &Path, run: u32) -> Agent {
        let log = self.dir.path().join(format!("lb-{run}.log"));
        Agent::start(bin, &self.lb, config, &self.socket(), &log).expect("start the agent")
    }

    fn vip(&self) -> SocketAddr {
        SocketAddr::new(VIP.into(), 80)
    }
}

/// Backend `i`'s address as the status shows it.
fn backend(i: usize) -> IpAddr {
    BACKENDS[i].into()
}

/// The status's `dataplane.interfaces`, as (name, mode, forwarded packets).
fn interfaces(agent: &Agent) -> Vec<(String, String, u64)> {
    let status = agent.status_json().expect("lb status --json");
    status["dataplane"]["interfaces"]
        .as_array()
        .expect("dataplane.interfaces")
        .iter()
        .map(|i| {
            (
                i["name"].as_str().unwrap_or_default().to_string(),
                i["xdp_mode"].as_str().unwrap_or("none").to_string(),
                i["forwarded_packets"].as_u64().unwrap_or(0),
            )
        })
        .collect()
}

fn counter(agent: &Agent, name: &str) -> u64 {
    agent.status_json().expect("status")["counters"][name]
        .as_u64()
        .unwrap_or(0)
}

/// The test bed with an agent on both interfaces in `mode` (its pins in a directory of
/// their own), every backend up. Drop order: the agent first, then the pins, the bed.
fn started(bin: &Path, mode: XdpMode) -> (TwoArm, PinDir, PathBuf, Agent) {
    let bed = TwoArm::new();
    let pins = PinDir::new(&format!("multinic-{}", bed.lb.name())).expect("pin directory");
    let config = bed.config(mode, pins.path());
    let agent = bed.start(bin, &config, 1);
    all_up(&agent, Duration::from_secs(10));
    (bed, pins, config, agent)
}

/// Waits until every backend is up and in the table.
fn all_up(agent: &Agent, timeout: Duration) {
    let (view, waited) = wait_backends_up(agent, "web", timeout, &|| false).expect("status");
    assert_eq!(
        view.up(),
        BACKENDS.len(),
        "not all up after {waited:?}: {view:?}\nlog:\n{}",
        agent.log()
    );
}

/// Waits until backend `i` is out of the table (its checks failed).
fn wait_out(agent: &Agent, i: usize) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let status = agent.status_json().expect("status");
        let out = status["vips"][0]["backends"]
            .as_array()
            .and_then(|b| b.iter().find(|b| b["address"] == backend(i).to_string()))
            .is_some_and(|b| b["in_table"] == false);
        if out {
            return;
        }
        assert!(Instant::now() < deadline, "backend {i} not out: {status}");
        thread::sleep(Duration::from_millis(100));
    }
}

/// Balancing across both interfaces, then a backend behind `eth1` failing and another
/// drained, in `mode`.
fn two_arm_failover_and_drain(test: &str, mode: XdpMode) {
    let Some(bin) = require_e2e(test) else {
        return;
    };
    let (mut bed, _pins, config, agent) = started(&bin, mode);
    let modes = interfaces(&agent);
    assert_eq!(
        modes
            .iter()
            .map(|(n, m, _)| (n.as_str(), m.as_str()))
            .collect::<Vec<_>>(),
        [("eth0", mode.as_str()), ("eth1", mode.as_str())],
        "log:\n{}",
        agent.log()
    );

    // Every backend answers: two behind eth1 (redirected), one beside the client (TX).
    let all = spread(&bed.client, bed.vip(), 60).expect("spread");
    assert_eq!(all.failures, 0, "{:?}\nlog:\n{}", all.errors, agent.log());
    for i in 0..3 {
        let name = format!("backend-{}", i + 1);
        assert!(
            all.counts.get(&name).copied().unwrap_or(0) > 0,
            "{name}: {all:?}"
        );
    }
    let sent = interfaces(&agent);
    assert!(
        sent[0].2 > 0 && sent[1].2 > 0,
        "forwarded per interface: {sent:?}"
    );
    assert!(counter(&agent, "xdp_redirect") > 0, "no frame redirected");
    doctor_checks_each_interface(&bin, &bed, &config);
    assert!(counter(&agent, "xdp_tx") > 0, "no frame sent back out");
    assert_eq!(counter(&agent, "drop_no_egress"), 0);

    // A connection to backend-2 (behind eth1) before it is drained.
    let mut kept = (0..40)
        .map(|_| Conn::open(&bed.client, bed.vip(), TIMEOUT).expect("connection"))
        .find(|c| c.backend() == "backend-2")
        .expect("a connection to backend-2");
    kept.echo(b"before").expect("echo before");

    // backend-1 (behind eth1) fails: its flows move; nothing fails.
    bed.servers[0].take().expect("server").stop().expect("stop");
    wait_out(&agent, 0);
    // backend-2 drained: no new flow, its connection goes on.
    agent
        .ctl(&["drain", "10.99.0.100:80/tcp", "10.98.2.12"])
        .expect("lb drain");
    let after = spread(&bed.client, bed.vip(), 30).expect("spread");
    assert_eq!(after.failures, 0, "{:?}", after.errors);
    assert_eq!(after.counts.get("backend-3"), Some(&30), "{after:?}");
    kept.echo(b"while draining")
        .expect("echo to the drained backend");
    kept.close().expect("close");
    drop(agent);
}

/// `lb doctor` beside the running agent: each interface's checks, named by it, and the
/// program on each taken for lb's own (its pinned link), so nothing fails.
fn doctor_checks_each_interface(bin: &Path, bed: &TwoArm, config: &Path) {
    let out = std::process::Command::new("ip")
        .args(["netns", "exec", bed.lb.name()])
        .arg(bin)
        .args(["doctor", "--config"])
        .arg(config)
        .output()
        .expect("lb doctor");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "lb doctor failed:\n{stdout}");
    for line in [
        "ok xdp-attached: eth0: ",
        "ok xdp-attached: eth1: ",
        "ok driver: eth1: ",
    ] {
        assert!(stdout.contains(line), "no {line:?} in:\n{stdout}");
    }
    assert_eq!(stdout.matches(" kernel: ").count(), 1, "{stdout}");
}

#[test]
fn two_arm_balances_fails_over_and_drains_generic() {
    two_arm_failover_and_drain(
        "two_arm_balances_fails_over_and_drains_generic",
        XdpMode::Generic,
    );
}

#[test]
fn two_arm_balances_fails_over_and_drains_native() {
    two_arm_failover_and_drain(
        "two_arm_balances_fails_over_and_drains_native",
        XdpMode::Native,
    );
}

/// Requests one after another, a new connection each; the failures (a request failed,
/// or needed a retransmission: a SYN lost) and who answered.
fn request_loop(bed: &TwoArm, n: usize) -> (Vec<String>, Vec<String>) {
    let mut failures = Vec::new();
    let mut answered = Vec::new();
    for i in 0..n {
        match tcp_request_retransmits(&bed.client, bed.vip(), TIMEOUT) {
            Err(error) => failures.push(format!("request {i}: {error}")),
            Ok((_, retransmitted)) if retransmitted > 0 => {
                failures.push(format!("request {i}: {retransmitted} retransmission(s)"))
            }
            Ok((name, _)) => answered.push(name),
        }
        thread::sleep(Duration::from_millis(15));
    }
    (failures, answered)
}

/// SIGKILL and a restart while a client keeps sending: the pinned program goes on on
/// both interfaces, the new agent takes both links over in one step each.
#[test]
fn restart_under_traffic_loses_nothing_on_either_interface() {
    let test = "restart_under_traffic_loses_nothing_on_either_interface";
    let Some(bin) = require_e2e(test) else {
        return;
    };
    let (bed, _pins, config, first) = started(&bin, XdpMode::Native);
    let (failures, answered, second) = thread::scope(|scope| {
        let requests = scope.spawn(|| request_loop(&bed, 150));
        thread::sleep(Duration::from_millis(700));
        let pid = first.pid().expect("the agent runs");
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::SIGKILL,
        )
        .expect("SIGKILL");
        thread::sleep(Duration::from_millis(400));
        let second = bed.start(&bin, &config, 2);
        let (failures, answered) = requests.join().expect("request thread");
        (failures, answered, second)
    });
    let status = second.status_json().expect("status");
    assert_eq!(
        status["dataplane"]["start"],
        "adopted",
        "log:\n{}",
        second.log()
    );
    assert!(
        failures.is_empty(),
        "{} failed: {failures:#?}",
        failures.len()
    );
    for name in ["backend-1", "backend-2", "backend-3"] {
        assert!(answered.iter().any(|a| a == name), "{name} never answered");
    }
    let modes = interfaces(&second);
    assert!(
        modes.iter().all(|(_, m, _)| m == "native"),
        "after the restart: {modes:?}"
    );
    // eth1's link taken over in one step, not replaced by a new one.
    assert!(
        second
            .log()
            .contains("eth1: the program took over the pinned link (native mode)"),
        "log:\n{}",
        second.log()
    );
    drop(second);
    drop(first);
}

/// `eth1` deleted and made again: the backends behind it leave (the others serve on),
/// and come back once the program is attached to the new `eth1`, alone.
#[test]
fn an_interface_that_goes_and_returns_is_attached_again_alone() {
    let test = "an_interface_that_goes_and_returns_is_attached_again_alone";
    let Some(bin) = require_e2e(test) else {
        return;
    };
    let (bed, _pins, _config, agent) = started(&bin, XdpMode::Generic);

    ip(&["-n", bed.lb.name(), "link", "del", "eth1"]).expect("delete eth1");
    wait_out(&agent, 0);
    wait_out(&agent, 1);
    let during = spread(&bed.client, bed.vip(), 20).expect("spread");
    assert_eq!(during.failures, 0, "{:?}", during.errors);
    assert_eq!(during.counts.get("backend-3"), Some(&20), "{during:?}");
    let gone = interfaces(&agent);
    assert_eq!(gone[1].1, "none", "eth1 gone: {gone:?}");
    assert_eq!(gone[0].1, "generic", "eth0 stays: {gone:?}");

    plug(
        &bed.switch,
        "br1",
        "p-lb1",
        &bed.lb,
        "eth1",
        [10, 98, 2, 2].into(),
    );
    all_up(&agent, Duration::from_secs(15));
    let back = spread(&bed.client, bed.vip(), 60).expect("spread");
    assert_eq!(back.failures, 0, "{:?}\nlog:\n{}", back.errors, agent.log());
    // Both backends behind the new eth1 take flows again (60 flows over three backends
    // miss one with odds of about 1e-10).
    for name in ["backend-1", "backend-2"] {
        assert!(back.counts.contains_key(name), "{name} not back: {back:?}");
    }
    assert_eq!(interfaces(&agent)[1].1, "generic");
    assert!(
        agent.log().contains("interface eth1 is back"),
        "log:\n{}",
        agent.log()
    );
    drop(agent);
}

impl Drop for TwoArm {
    fn drop(&mut self) {
        for server in self.servers.iter_mut().filter_map(Option::take) {
            let _ = server.stop();
        }
        // The namespaces go with their guards; the backends' first, then the bridges.
        self.backends.clear();
        let _ = (&self.client, &self.switch);
    }
}

/// An interface of the list that does not exist refuses the start, naming it, as a
/// missing single interface does; nothing is attached to the others.
#[test]
fn a_missing_interface_refuses_the_start_naming_it() {
    let Some(bin) = require_e2e("a_missing_interface_refuses_the_start_naming_it") else {
        return;
    };
    let bed = TwoArm::new();
    let pins = PinDir::new(&format!("multinic-{}", bed.lb.name())).expect("pin directory");
    let config = bed.config(XdpMode::Generic, pins.path());
    let text = std::fs::read_to_string(&config)
        .expect("config")
        .replace("\"eth1\"]", "\"nope0\"]");
    std::fs::write(&config, text).expect("write the config");
    // `timeout`: a start that is not refused would serve until stopped.
    let out = std::process::Command::new("timeout")
        .args(["20", "ip", "netns", "exec", bed.lb.name()])
        .arg(&bin)
        .args(["run", "--config"])
        .arg(&config)
        .output()
        .expect("lb run");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "want exit 1:\n{stderr}");
    assert!(
        stderr.contains("nope0"),
        "the missing interface named:\n{stderr}"
    );
    let link = bed
        .lb
        .exec("ip", &["link", "show", "eth0"])
        .expect("ip link");
    assert!(!link.contains("xdp"), "eth0 attached all the same: {link}");
}
