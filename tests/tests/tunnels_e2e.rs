//! Issue 18, tunnel DSR end to end: the backends on another subnet behind a router
//! namespace (`LabOptions::routed`: their default route via the router, the VIP on
//! `lo`), the agent resolving each backend's next hop (the router) over rtnetlink, and
//! `lb decap attach` on each backend's interface stripping the outer headers. Health
//! checks reach the backends at their own address, through the router, or (issue 19)
//! through the VIP, wrapped in the backend's tunnel as its traffic is.
//!
//! Needs root, bpffs, the eBPF objects and a built `lb`; otherwise each test prints
//! `SKIPPED`. `cargo test -p lb-tests --test tunnels_e2e`.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::path::PathBuf;
use std::thread::sleep;
use std::time::{Duration, Instant};

use lb_tests::lab::{IFACE, ROUTER4};
use lb_tests::router::PinDir;
use lb_tests::{
    Agent, BackendConfig, Conn, Health, Lab, LabOptions, Protocol, Sniffer, VipConfig, VipView,
    XdpMode, ip_src_is, require_e2e, spread, udp_spread, wait_backends_up, wait_status,
};

const BACKENDS: usize = 2;
const UP_TIMEOUT: Duration = Duration::from_secs(15);

fn routed_lab() -> Lab {
    Lab::new(LabOptions {
        backends: BACKENDS,
        routed: true,
        ..LabOptions::default()
    })
    .expect("build the routed lab")
}

/// `vip` of the lab's addresses forwarded by `forward` (l2, ipip, gue).
fn tunnelled(lab: &Lab, name: &str, v6: bool, protocol: Protocol, forward: &str) -> VipConfig {
    let port = match protocol {
        Protocol::Tcp => 80,
        Protocol::Udp => 53,
    };
    let mut vip = lab.vip(name, v6, port, protocol, Health::lab_tcp());
    if protocol == Protocol::Udp {
        vip.health = Health::None;
    }
    vip.extra.push(format!("forward = \"{forward}\""));
    vip
}

/// The MAC of `iface` in the router's namespace.
fn router_mac(lab: &Lab, iface: &str) -> String {
    let router = lab.router().expect("a routed lab has a router");
    let out = router
        .exec("cat", &[&format!("/sys/class/net/{iface}/address")])
        .expect("the router's MAC");
    out.trim().to_string()
}

/// `lb status --json`'s VIP `name`.
fn vip_status(lab: &Lab, name: &str) -> serde_json::Value {
    let status = lab.agent().expect("agent").status_json().expect("status");
    status["vips"]
        .as_array()
        .and_then(|vips| vips.iter().find(|v| v["name"] == name).cloned())
        .unwrap_or_else(|| panic!("no VIP {name} in\n{status:#}"))
}

fn wait_up(lab: &Lab, name: &str) {
    wait_up_on(lab.agent().expect("agent"), name);
}

fn wait_up_on(agent: &Agent, name: &str) {
    let (view, waited) = wait_backends_up(agent, name, UP_TIMEOUT, &|| false).expect("status");
    assert_eq!(
        view.up(),
        BACKENDS,
        "{name}: not every routed backend came up within {waited:?}:\n{}\nagent log:\n{}",
        view.summary(),
        agent.log()
    );
}

/// An `l2` VIP whose backends are behind a router is refused at start, naming the
/// backend and the route found. The same backends through `ipip` (IPv4) and `gue`
/// (IPv6) come up by health checks at their own addresses, and status and explain show
/// the router as their next hop, with the router's MAC (the one frames carry).
#[test]
fn routed_backends_take_the_router_as_next_hop_and_l2_refuses_them() {
    let test = "routed_backends_take_the_router_as_next_hop_and_l2_refuses_them";
    let Some(bin) = require_e2e(test) else { return };
    let mut lab = routed_lab();
    lab.serve_tcp(80, false).expect("tcp servers");

    let l2 = lab.agent_config(
        XdpMode::Native,
        vec![tunnelled(&lab, "web", false, Protocol::Tcp, "l2")],
    );
    let refused = lab
        .start_agent(&bin, &l2)
        .err()
        .expect("an l2 VIP with routed backends must be refused");
    let refused = format!("{refused:#}");
    let expected = format!(
        "`vip[0].backend[0].address`: 10.98.1.11 is not on-link on eth0 (the route found is \
         `10.98.1.11 via {ROUTER4} dev eth0`)"
    );
    assert!(
        refused.contains(&expected),
        "no {expected:?} in:\n{refused}"
    );

    let config = lab.agent_config(
        XdpMode::Native,
        vec![
            tunnelled(&lab, "web", false, Protocol::Tcp, "ipip"),
            tunnelled(&lab, "web6", true, Protocol::Tcp, "gue"),
        ],
    );
    lab.start_agent(&bin, &config).expect("start the agent");
    wait_up(&lab, "web");
    wait_up(&lab, "web6");
    let mac = router_mac(&lab, IFACE);
    for (name, forward, router) in [
        ("web", "ipip", ROUTER4.to_string()),
        ("web6", "gue", "fd00:99::254".to_string()),
    ] {
        let vip = vip_status(&lab, name);
        assert_eq!(vip["forward"], forward, "{vip:#}");
        for b in vip["backends"].as_array().expect("backends") {
            assert_eq!(b["next_hop"]["address"], router.as_str(), "{b:#}");
            assert_eq!(b["next_hop"]["mac"], mac.as_str(), "{b:#}");
            assert_eq!(
                b["mac"],
                mac.as_str(),
                "frames carry the router's MAC: {b:#}"
            );
        }
    }
    assert_eq!(vip_status(&lab, "web6")["gue_port"], 6080);
    let agent = lab.agent().expect("agent");
    let text = agent.status().expect("lb status");
    assert!(
        text.contains("forward ipip:") && text.contains(&format!("next hop {ROUTER4} ({mac})")),
        "{text}"
    );
    let explained = agent
        .ctl(&["explain", "10.99.0.100:80/tcp", "10.99.0.1:40000"])
        .expect("lb explain");
    assert!(
        explained.contains(&format!(
            "forwarded by:     ipip, next hop {ROUTER4} ({mac})"
        )),
        "{explained}"
    );
}

/// `lb decap attach` on every backend's interface, for as long as it lives; detached
/// (its pins removed) on drop.
struct Decap {
    pins: Vec<PinDir>,
}

impl Decap {
    fn attach(lab: &Lab, bin: &std::path::Path) -> Decap {
        let mut pins = Vec::new();
        for ns in lab.backends() {
            let dir = PinDir::new(&format!("decap-{}", ns.name())).expect("a pin directory");
            let path = dir.path().to_string_lossy().to_string();
            let out = ns
                .exec(
                    &bin.to_string_lossy(),
                    &["decap", "attach", IFACE, "--pin-path", &path],
                )
                .unwrap_or_else(|e| panic!("lb decap attach in {}: {e:#}", ns.name()));
            assert!(out.contains("ipip and gue port 6080"), "{out}");
            pins.push(dir);
        }
        Decap { pins }
    }

    /// `lb decap status --json` counters of backend `i`: the tunnel kinds unwrapped.
    fn counters(&self, lab: &Lab, bin: &std::path::Path, i: usize) -> [(&'static str, u64); 6] {
        let path = self.pins[i].path().to_string_lossy().to_string();
        let out = lab.backends()[i]
            .exec(
                &bin.to_string_lossy(),
                &["decap", "status", "--json", "--pin-path", &path],
            )
            .expect("lb decap status");
        let status: serde_json::Value = serde_json::from_str(&out).expect("json");
        let counters = &status[0]["counters"];
        [
            "decap_4in4",
            "decap_6in6",
            "decap_6in4",
            "decap_4in6",
            "decap_gue4",
            "decap_gue6",
        ]
        .map(|k| (k, counters[k].as_u64().unwrap_or(0)))
    }

    /// Counter `kind` of `lb decap status`, summed over the backends.
    fn total(&self, lab: &Lab, bin: &std::path::Path, kind: &str) -> u64 {
        (0..self.pins.len())
            .flat_map(|i| self.counters(lab, bin, i))
            .filter(|&(k, _)| k == kind)
            .map(|(_, n)| n)
            .sum()
    }
}

impl Drop for Decap {
    fn drop(&mut self) {
        for dir in &self.pins {
            if let Err(error) = lb_userspace::dataplane::decap::detach(IFACE, dir.path()) {
                eprintln!("lb decap detach ({}): {error}", dir.path().display());
            }
        }
    }
}

/// Real TCP and UDP through `ipip` and `gue` VIPs, IPv4 and IPv6, and the mixed
/// families (an IPv6 VIP to IPv4 backends, 6in4, by gue and by ipip; an IPv4 VIP to
/// IPv6 backends, 4in6): every request answered by a routed backend, spread over both,
/// decapsulated by `lb decap` (every kind of tunnel counted on each backend), the
/// replies never crossing the balancer. Then the ICMP "too big" answers
/// (`too_big_answers`). Then a drain: no new connection reaches the drained backend;
/// then a backend fails (its servers stop): its checks fail and the rest takes every
/// request.
#[test]
fn tcp_and_udp_reach_routed_backends_through_ipip_and_gue() {
    let test = "tcp_and_udp_reach_routed_backends_through_ipip_and_gue";
    let Some(bin) = require_e2e(test) else { return };
    let mut lab = routed_lab();
    lab.serve_tcp(80, false).expect("tcp servers");
    lab.serve_udp(53, false).expect("udp servers");
    let decap = Decap::attach(&lab, &bin);
    // The mixed families: 6in4 by gue and by ipip, 4in6 by ipip.
    let mixed = [
        ("web64", true, 81, "gue"),
        ("web64i", true, 83, "ipip"),
        ("web46", false, 82, "ipip"),
    ];
    let mut vips = vec![
        tunnelled(&lab, "web", false, Protocol::Tcp, "ipip"),
        tunnelled(&lab, "web6", true, Protocol::Tcp, "ipip"),
        tunnelled(&lab, "webg", false, Protocol::Udp, "gue"),
        tunnelled(&lab, "webg6", true, Protocol::Udp, "gue"),
    ];
    for (name, v6_vip, port, forward) in mixed {
        let mut vip = tunnelled(&lab, name, v6_vip, Protocol::Tcp, forward);
        vip.port = port;
        vip.health = Health::None;
        vip.backends = (0..BACKENDS)
            .map(|i| lb_tests::BackendConfig::new(lab.backend_addr(i, !v6_vip)))
            .collect();
        lab.serve_tcp(port, false).expect("tcp servers");
        vips.push(vip);
    }
    let config = lab.agent_config(XdpMode::Native, vips);
    lab.start_agent(&bin, &config).expect("start the agent");
    for name in ["web", "web6"] {
        wait_up(&lab, name);
    }
    let (v4, v6) = (lab.vip4(), lab.vip6());
    let cases: [(&str, SocketAddr, Protocol); 7] = [
        ("ipip 4in4 tcp", SocketAddr::new(v4, 80), Protocol::Tcp),
        ("ipip 6in6 tcp", SocketAddr::new(v6, 80), Protocol::Tcp),
        ("gue v4 udp", SocketAddr::new(v4, 53), Protocol::Udp),
        ("gue v6 udp", SocketAddr::new(v6, 53), Protocol::Udp),
        ("gue 6in4 tcp", SocketAddr::new(v6, 81), Protocol::Tcp),
        ("ipip 6in4 tcp", SocketAddr::new(v6, 83), Protocol::Tcp),
        ("ipip 4in6 tcp", SocketAddr::new(v4, 82), Protocol::Tcp),
    ];
    for (what, vip, protocol) in cases {
        let on_lb = Sniffer::start(lab.lb(), IFACE, ip_src_is(vip.ip())).expect("sniffer");
        let s = match protocol {
            Protocol::Tcp => spread(lab.client(), vip, 60),
            Protocol::Udp => udp_spread(lab.client(), vip, 60),
        }
        .expect("requests");
        sleep(lb_tests::sniff::SETTLE);
        let on_lb = on_lb.finish().expect("sniffer");
        assert_eq!(
            s.failures,
            0,
            "{what}: {:?}\n{}\nagent log:\n{}",
            s.errors,
            s.table(),
            lab.agent_log()
        );
        assert_eq!(
            s.counts.len(),
            BACKENDS,
            "{what}: both backends\n{}",
            s.table()
        );
        assert_eq!(
            on_lb.matched, 0,
            "{what}: replies crossed the balancer ({} frames from the VIP)",
            on_lb.matched
        );
    }
    for i in 0..BACKENDS {
        let counters = decap.counters(&lab, &bin, i);
        assert!(
            counters.iter().all(|&(_, n)| n > 0),
            "backend {i} did not unwrap every tunnel kind: {counters:?}"
        );
    }

    too_big_answers(&lab);

    // Drain: backend 2 of "web" takes no new connection; `lb ready` brings it back.
    let agent = lab.agent().expect("agent");
    let (first, second) = (lab.backend_addr(0, false), lab.backend_addr(1, false));
    let web = "10.99.0.100:80/tcp";
    agent
        .ctl(&["drain", web, &second.to_string()])
        .expect("lb drain");
    let view = lb_tests::VipView::fetch(agent, "web").expect("status");
    let b = view.backend(second).expect("backend 2");
    assert_eq!(
        (b.state.as_str(), b.in_table),
        ("draining", false),
        "{}",
        view.summary()
    );
    let s = spread(lab.client(), SocketAddr::new(v4, 80), 20).expect("while draining");
    assert_eq!(
        s.failures,
        0,
        "while draining: {:?}\n{}",
        s.errors,
        s.table()
    );
    assert_eq!(
        s.counts.get(&lab.backend_name(0)).copied(),
        Some(20),
        "{}",
        s.table()
    );
    agent
        .ctl(&["ready", web, &second.to_string()])
        .expect("lb ready");

    // Failover: backend 1's servers stop; its checks fail, backend 2 takes everything.
    lab.stop_servers_of(0).expect("stop backend 1");
    let agent = lab.agent().expect("agent");
    let deadline = Instant::now() + UP_TIMEOUT;
    loop {
        let view = lb_tests::VipView::fetch(agent, "web").expect("status");
        let (one, two) = (view.backend(first), view.backend(second));
        if one.is_some_and(|b| !b.in_table) && two.is_some_and(|b| b.in_table) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no failover:\n{}",
            view.summary()
        );
        sleep(Duration::from_millis(100));
    }
    let s = spread(lab.client(), SocketAddr::new(v4, 80), 40).expect("after failover");
    assert_eq!(
        s.failures,
        0,
        "after failover: {:?}\n{}",
        s.errors,
        s.table()
    );
    assert_eq!(
        s.counts.get(&lab.backend_name(1)).copied(),
        Some(40),
        "{}",
        s.table()
    );
}

/// `kind` checks of `target` ("vip" or "backend"), fast.
fn checks(kind: &str, target: &str) -> Health {
    Health::Lines(
        [
            format!("kind = \"{kind}\""),
            format!("target = \"{target}\""),
            "interval = \"300ms\"".into(),
            "timeout = \"200ms\"".into(),
            "rise = 2".into(),
            "fall = 2".into(),
        ]
        .to_vec(),
    )
}

/// The health of backend `address` of VIP `name`, and its last check's error.
fn health_of(status: &serde_json::Value, name: &str, address: IpAddr) -> (String, String) {
    let vip = VipView::parse(status, name).expect("status");
    let b = vip
        .backend(address)
        .unwrap_or_else(|| panic!("no backend {address} in\n{}", vip.summary()));
    (b.health.clone(), b.last_error.clone().unwrap_or_default())
}

/// Checks through the VIP of tunnelled VIPs (issue 19): tcp and udp, IPv4 and IPv6,
/// through ipip (4in4, 6in6, 6in4, 4in6) and gue (v4, v6), wrapped as the traffic is and
/// unwrapped by `lb decap`. Every backend comes up; backend 1 losing both VIPs from its
/// `lo` goes down through the VIP, with the probe's reason, while the same service
/// checked at its own address stays up and backend 2 stays up everywhere; with the
/// VIPs back it comes up again.
#[test]
fn checks_through_the_vip_follow_the_tunnel() {
    let test = "checks_through_the_vip_follow_the_tunnel";
    let Some(bin) = require_e2e(test) else { return };
    let mut lab = routed_lab();
    lab.serve_tcp(80, false).expect("tcp servers");
    lab.serve_udp(5353, false).expect("udp servers");
    let decap = Decap::attach(&lab, &bin);
    // (name, IPv6 VIP, IPv6 backends, protocol, port, forward, check kind, target)
    let cases = [
        (
            "tcp4",
            false,
            false,
            Protocol::Tcp,
            80,
            "ipip",
            "tcp",
            "vip",
        ),
        (
            "udp4",
            false,
            false,
            Protocol::Udp,
            5353,
            "gue",
            "udp",
            "vip",
        ),
        ("tcp6", true, true, Protocol::Tcp, 80, "gue", "tcp", "vip"),
        (
            "udp6",
            true,
            true,
            Protocol::Udp,
            5353,
            "ipip",
            "udp",
            "vip",
        ),
        (
            "tcp64",
            true,
            false,
            Protocol::Tcp,
            8080,
            "ipip",
            "tcp",
            "vip",
        ),
        (
            "tcp46",
            false,
            true,
            Protocol::Tcp,
            8080,
            "ipip",
            "tcp",
            "vip",
        ),
        (
            "own4",
            false,
            false,
            Protocol::Tcp,
            81,
            "ipip",
            "tcp",
            "backend",
        ),
        (
            "own6",
            true,
            true,
            Protocol::Udp,
            5354,
            "gue",
            "udp",
            "backend",
        ),
    ];
    let vips: Vec<VipConfig> = cases
        .iter()
        .map(
            |&(name, v6, v6_backends, protocol, port, forward, kind, target)| {
                let mut vip = tunnelled(&lab, name, v6, protocol, forward);
                vip.port = port;
                vip.health = checks(kind, target);
                vip.backends = (0..BACKENDS)
                    .map(|i| BackendConfig::new(lab.backend_addr(i, v6_backends)))
                    .collect();
                vip
            },
        )
        .collect();
    lab.serve_tcp(8080, false).expect("tcp servers on 8080");
    lab.serve_tcp(81, false).expect("tcp servers on 81");
    lab.serve_udp(5354, false).expect("udp servers on 5354");
    let config = lab.agent_config(XdpMode::Native, vips.clone());
    lab.start_agent(&bin, &config).expect("start the agent");
    let addresses =
        |vip: &VipConfig| -> Vec<IpAddr> { vip.backends.iter().map(|b| b.address).collect() };
    let all_up = |s: &serde_json::Value| {
        vips.iter().all(|v| {
            addresses(v)
                .iter()
                .all(|&a| health_of(s, &v.name, a).0 == "up")
        })
    };
    let s = wait_status(
        &lab,
        UP_TIMEOUT,
        "every backend up, through the VIP and at its own",
        all_up,
    );
    let tcp4 = &s["vips"].as_array().expect("vips")[0];
    assert_eq!(
        tcp4["backends"][0]["check"], "tcp port 80 through the VIP",
        "{tcp4:#}"
    );
    // Only checks crossed the tunnels (no client traffic): each kind reached each backend.
    for i in 0..BACKENDS {
        let counters = decap.counters(&lab, &bin, i);
        assert!(
            counters.iter().all(|&(_, n)| n > 0),
            "backend {i} did not unwrap checks of every tunnel kind: {counters:?}"
        );
    }

    // Backend 1 loses both VIPs: checks through the VIP fail, its own address answers.
    let (v4, v6) = (lab.vip4(), lab.vip6());
    lab.set_vip_on_lo(0, v4, false)
        .expect("the VIP on backend 1's lo");
    lab.set_vip_on_lo(0, v6, false)
        .expect("the VIP on backend 1's lo");
    let first = |vip: &VipConfig| addresses(vip)[0];
    let through_vip: Vec<&VipConfig> = vips.iter().filter(|v| !v.name.starts_with("own")).collect();
    let s = wait_status(&lab, UP_TIMEOUT, "backend 1 down through the VIP", |s| {
        through_vip
            .iter()
            .all(|v| health_of(s, &v.name, first(v)).0 == "down")
    });
    for v in &through_vip {
        let (_, error) = health_of(&s, &v.name, first(v));
        let expected = match v.protocol {
            Protocol::Tcp => "no SYN-ACK from the VIP within 200ms",
            Protocol::Udp => "no reply from the VIP within 200ms",
        };
        assert!(
            error.contains(expected),
            "{}: {error:?}, not {expected:?}",
            v.name
        );
    }
    // Checks of the backend's own address keep it up, and backend 2 stays up.
    sleep(Duration::from_secs(1));
    let s = lab.agent().expect("agent").status_json().expect("status");
    for v in &vips {
        let addrs = addresses(v);
        let own = v.name.starts_with("own");
        assert_eq!(
            health_of(&s, &v.name, addrs[1]).0,
            "up",
            "{}: backend 2\n{s:#}",
            v.name
        );
        if own {
            assert_eq!(
                health_of(&s, &v.name, addrs[0]).0,
                "up",
                "{}: backend 1\n{s:#}",
                v.name
            );
        }
    }

    // The VIPs back on its lo: it comes up again.
    lab.set_vip_on_lo(0, v4, true)
        .expect("the VIP on backend 1's lo");
    lab.set_vip_on_lo(0, v6, true)
        .expect("the VIP on backend 1's lo");
    wait_status(
        &lab,
        UP_TIMEOUT,
        "backend 1 up again through the VIP",
        all_up,
    );
}

/// The balancer's interface MTU in a routed lab.
const LB_MTU: usize = 1500;

/// The ICMP "too big" answers, from the balancer to a real client. TCP through the ipip
/// VIP (4in4, 20 bytes of outer header): the client's full-size segments no longer fit
/// once wrapped; the balancer answers "fragmentation needed" with 1480, the client's
/// kernel keeps that path MTU for the VIP, its TCP lowers its segment size and a 16 KiB
/// write is echoed whole. Then UDP datagrams that just do not fit, sent with DF, through
/// the gue VIPs (+28 on IPv4, +48 on IPv6): the client's socket takes 1472 / 1452 as its
/// path MTU. Each answer is counted as `tx_icmp_too_big`.
fn too_big_answers(lab: &Lab) {
    let agent = lab.agent().expect("agent");
    let answered = || {
        let status = agent.status_json().expect("status");
        status["counters"]["tx_icmp_too_big"].as_u64().unwrap_or(0)
    };
    let before = answered();
    let vip = SocketAddr::new(lab.vip4(), 80);
    let mut conn = Conn::open(lab.client(), vip, Duration::from_secs(2)).expect("connect");
    let big: Vec<u8> = (0..16384u32).map(|i| i as u8).collect();
    conn.echo(&big).unwrap_or_else(|e| {
        panic!(
            "a 16 KiB write through the ipip VIP: {e}\nstatus:\n{}",
            agent.status().unwrap_or_default()
        )
    });
    conn.close().expect("orderly close");
    let route = lab
        .client()
        .exec("ip", &["route", "get", &lab.vip4().to_string()])
        .expect("ip route get");
    assert!(
        route.contains(&format!("mtu {}", LB_MTU - 20)),
        "the client holds no lowered path MTU for the VIP:\n{route}"
    );
    let after_tcp = answered();
    assert!(
        after_tcp > before,
        "tx_icmp_too_big: {before} -> {after_tcp}"
    );

    // IPv4: the path MTU is 1480 by now, so a datagram of 1480 leaves the client.
    for (vip, size, usable) in [
        (lab.vip4(), LB_MTU - 20, LB_MTU - 28),
        (lab.vip6(), LB_MTU, LB_MTU - 48),
    ] {
        let vip = SocketAddr::new(vip, 53);
        let mtu = lab
            .client()
            .run(|| udp_path_mtu(vip, size))
            .expect("in the client's namespace")
            .unwrap_or_else(|e| panic!("a {size}-byte datagram to {vip}: {e}"));
        assert_eq!(
            mtu,
            usable,
            "path MTU the client learnt for {vip}\nstatus:\n{}",
            agent.status().unwrap_or_default()
        );
    }
    let after_udp = answered();
    assert!(
        after_udp >= after_tcp + 2,
        "tx_icmp_too_big: {after_tcp} -> {after_udp} for two datagrams"
    );
}

/// Sends one UDP datagram of `size` bytes on the wire (IP header included) to `vip`
/// with path MTU discovery on (DF on IPv4) from a connected socket, and returns the
/// socket's path MTU (`IP_MTU` / `IPV6_MTU`) once it drops below `size` (the ICMP
/// error has arrived), or after 2 s.
fn udp_path_mtu(vip: SocketAddr, size: usize) -> std::io::Result<usize> {
    use libc::{IP_MTU, IP_MTU_DISCOVER, IP_PMTUDISC_DO, IPPROTO_IP, IPPROTO_IPV6};
    use libc::{IPV6_MTU, IPV6_MTU_DISCOVER, IPV6_PMTUDISC_DO};
    use std::os::fd::AsRawFd;
    let v4 = vip.is_ipv4();
    let (level, discover, mtu_opt) = if v4 {
        (IPPROTO_IP, IP_MTU_DISCOVER, IP_MTU)
    } else {
        (IPPROTO_IPV6, IPV6_MTU_DISCOVER, IPV6_MTU)
    };
    let dont_fragment = if v4 { IP_PMTUDISC_DO } else { IPV6_PMTUDISC_DO };
    // IP and UDP headers.
    let headers = if v4 { 20 + 8 } else { 40 + 8 };
    let any: IpAddr = if v4 {
        Ipv4Addr::UNSPECIFIED.into()
    } else {
        Ipv6Addr::UNSPECIFIED.into()
    };
    let socket = UdpSocket::bind(SocketAddr::new(any, 0))?;
    socket.connect(vip)?;
    let fd = socket.as_raw_fd();
    let int = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: an int option on a socket this function owns.
    let set = unsafe {
        libc::setsockopt(
            fd,
            level,
            discover,
            (&dont_fragment as *const libc::c_int).cast(),
            int,
        )
    };
    if set != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let path_mtu = || -> std::io::Result<usize> {
        let (mut value, mut len): (libc::c_int, libc::socklen_t) = (0, int);
        // SAFETY: an int option read into an int.
        let got = unsafe {
            libc::getsockopt(
                fd,
                level,
                mtu_opt,
                (&mut value as *mut libc::c_int).cast(),
                &mut len,
            )
        };
        if got != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(value as usize)
    };
    socket.send(&vec![0u8; size - headers])?;
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let mtu = path_mtu()?;
        if mtu < size || Instant::now() >= deadline {
            return Ok(mtu);
        }
        sleep(Duration::from_millis(20));
    }
}

/// `config` with the pins in `pins`, written to the lab's `lb.toml`.
fn write_pinned(lab: &Lab, config: &lb_tests::AgentConfig, pins: &std::path::Path) -> PathBuf {
    let path = lab.dir().join("lb.toml");
    std::fs::write(&path, config.to_toml_pinned(pins)).expect("write the config");
    path
}

/// The lab's two TCP VIPs, "web" (IPv4) and "web6", forwarded by `forward4` / `forward6`.
fn web_vips(lab: &Lab, forward4: &str, forward6: &str) -> Vec<VipConfig> {
    vec![
        tunnelled(lab, "web", false, Protocol::Tcp, forward4),
        tunnelled(lab, "web6", true, Protocol::Tcp, forward6),
    ]
}

/// Connections to `vip` until both backends hold at least two (at most 40 tries).
fn conns_on_both(lab: &Lab, vip: SocketAddr) -> Vec<Conn> {
    let mut conns: Vec<Conn> = Vec::new();
    for _ in 0..40 {
        let per = |i: usize| {
            let name = lab.backend_name(i);
            conns.iter().filter(|c| c.backend() == name).count()
        };
        if (0..BACKENDS).all(|i| per(i) >= 2) {
            break;
        }
        conns.push(Conn::open(lab.client(), vip, Duration::from_secs(2)).expect("connection"));
    }
    conns
}

/// Echoes on every connection; a connection moved to another backend would be reset.
fn echo_all(conns: &mut [Conn], when: &str) {
    for (i, conn) in conns.iter_mut().enumerate() {
        let backend = conn.backend().to_string();
        conn.echo(format!("{when} {i}").as_bytes())
            .unwrap_or_else(|e| panic!("{when}: connection {i} (to {backend}) broke: {e}"));
    }
}

/// Restart, adoption, a `forward` change and a drain with tunnelled VIPs, while TCP
/// connections through an ipip VIP (IPv4) and a gue VIP (IPv6) stay open on both routed
/// backends: the agent is killed (the pinned program goes on forwarding them), a new one
/// adopts the pinned maps; a reload then swaps the two VIPs' `forward` (ipip <-> gue), so
/// the backends' entries are re-written: every connection keeps its backend, now
/// reached by the other encapsulation (counted by `lb decap`); then a backend is
/// drained and its connections go on. No packet of theirs misses the connection table.
#[test]
fn tunnelled_flows_survive_a_restart_a_forward_change_and_a_drain() {
    let test = "tunnelled_flows_survive_a_restart_a_forward_change_and_a_drain";
    let Some(bin) = require_e2e(test) else { return };
    let mut lab = routed_lab();
    lab.serve_tcp(80, false).expect("tcp servers");
    let decap = Decap::attach(&lab, &bin);
    let pins = PinDir::new(&format!("tunrestart-{}", lab.lb().name())).expect("pin directory");
    let config = lab.agent_config(XdpMode::Native, web_vips(&lab, "ipip", "gue"));
    let path = write_pinned(&lab, &config, pins.path());
    let start = |run: u32| {
        let log = lab.dir().join(format!("lb-{run}.log"));
        Agent::start(&bin, lab.lb(), &path, &lab.socket_path(), &log).expect("start the agent")
    };
    let first = start(1);
    for name in ["web", "web6"] {
        wait_up_on(&first, name);
    }
    let mut conns = conns_on_both(&lab, SocketAddr::new(lab.vip4(), 80));
    conns.extend(conns_on_both(&lab, SocketAddr::new(lab.vip6(), 80)));
    echo_all(&mut conns, "before the restart");

    let pid = first.pid().expect("the agent runs");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::SIGKILL,
    )
    .expect("SIGKILL the agent");
    echo_all(&mut conns, "with no agent");
    let second = start(2);
    let status = second.status_json().expect("status");
    assert_eq!(
        status["dataplane"]["start"],
        "adopted",
        "log:\n{}",
        second.log()
    );
    echo_all(&mut conns, "after the restart");
    for name in ["web", "web6"] {
        wait_up_on(&second, name);
    }

    // ipip <-> gue.
    let (gue4, ipip6) = (
        decap.total(&lab, &bin, "decap_gue4"),
        decap.total(&lab, &bin, "decap_6in6"),
    );
    let swapped = lab.agent_config(XdpMode::Native, web_vips(&lab, "gue", "ipip"));
    write_pinned(&lab, &swapped, pins.path());
    let out = second.ctl(&["reload"]).expect("lb reload");
    let status = second.status_json().expect("status");
    let forward = |name: &str| {
        status["vips"]
            .as_array()
            .and_then(|v| v.iter().find(|v| v["name"] == name))
            .map(|v| v["forward"].clone())
    };
    assert_eq!(
        (forward("web"), forward("web6")),
        (Some("gue".into()), Some("ipip".into())),
        "after `lb reload` ({out}):\n{status:#}"
    );
    echo_all(&mut conns, "after the forward change");
    assert!(
        decap.total(&lab, &bin, "decap_gue4") > gue4
            && decap.total(&lab, &bin, "decap_6in6") > ipip6,
        "the connections are not wrapped the new way: {:?} / {:?}",
        decap.counters(&lab, &bin, 0),
        decap.counters(&lab, &bin, 1)
    );

    // Drain backend 2 of both VIPs: its connections go on.
    let drained = lab.backend_name(1);
    for (vip, v6) in [
        ("10.99.0.100:80/tcp", false),
        ("[fd00:99::100]:80/tcp", true),
    ] {
        second
            .ctl(&["drain", vip, &lab.backend_addr(1, v6).to_string()])
            .expect("lb drain");
    }
    let held = conns.iter().filter(|c| c.backend() == drained).count();
    assert!(held >= 4, "{held} connections on {drained}");
    echo_all(&mut conns, "while draining");
    let status = second.status_json().expect("status");
    assert_eq!(
        status["counters"]["ct_miss_non_syn"], 0,
        "flows lost their entries: {status:#}"
    );
    for conn in conns {
        conn.close().expect("orderly close");
    }
    drop(second);
    drop(first);
}
