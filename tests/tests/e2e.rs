//! End to end: real TCP and UDP from a client namespace through the real `lb` agent and
//! XDP program on a veth, to backends that answer the client directly (DSR). Each test
//! builds its own lab (unique namespace names), so they run in parallel.
//!
//! Needs root, bpffs, the eBPF object and a built `lb` (`cargo build -p lb-userspace`,
//! or `LB_BIN`); otherwise each test prints `SKIPPED` (or fails under
//! `LB_REQUIRE_ALL_TESTS=1`). `cargo test -p lb-tests --test e2e`.

use std::net::{IpAddr, SocketAddr};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::thread::sleep;
use std::time::{Duration, Instant};

use lb_tests::lab::IFACE;
use lb_tests::sniff::{SETTLE, Sniffed};
use lb_tests::{
    Conn, Health, Lab, LabOptions, Protocol, Sniffer, Spread, TcpServer, UdpServer, XdpMode,
    ip_src_is, ping, require_e2e, spread, tcp_request, udp_request, udp_spread,
};

const TIMEOUT: Duration = Duration::from_secs(2);
/// A connection the balancer must not carry fails within this.
const NOT_BALANCED_TIMEOUT: Duration = Duration::from_secs(1);

/// A lab with TCP servers on port 80 of every backend, and the agent serving `vips`.
fn lab_serving(
    bin: &Path,
    opts: LabOptions,
    mode: XdpMode,
    vips: impl FnOnce(&Lab) -> Vec<lb_tests::VipConfig>,
) -> Lab {
    let mut lab = Lab::new(opts).expect("build the lab");
    lab.serve_tcp(80, false)
        .expect("start the backends' tcp servers");
    let config = lab.agent_config(mode, vips(&lab));
    lab.start_agent(bin, &config).expect("start the agent");
    lab
}

/// A lab with UDP servers on port 53 of every backend, and the agent (native mode)
/// serving `vips`.
fn udp_lab(bin: &Path, vips: impl FnOnce(&Lab) -> Vec<lb_tests::VipConfig>) -> Lab {
    let mut lab = Lab::new(LabOptions::default()).expect("build the lab");
    lab.serve_udp(53, false).expect("udp servers");
    let config = lab.agent_config(XdpMode::Native, vips(&lab));
    lab.start_agent(bin, &config).expect("start the agent");
    lab
}

/// Every request answered, and every backend got at least `min_share` of them.
fn assert_spread(lab: &Lab, s: &Spread, n: usize, min_share: f64) {
    assert_eq!(
        s.failures,
        0,
        "{} of {n} requests failed{}: {:?}\n{}",
        s.failures,
        if s.gave_up {
            " (then the series gave up)"
        } else {
            ""
        },
        s.errors,
        s.table()
    );
    assert_eq!(s.total(), n);
    for i in 0..lab.backends().len() {
        let name = lab.backend_name(i);
        assert!(
            s.share(&name) >= min_share,
            "{name} got {:.1}% (< {:.0}%):\n{}",
            s.share(&name) * 100.0,
            min_share * 100.0,
            s.table()
        );
    }
    assert_eq!(
        s.counts.len(),
        lab.backends().len(),
        "unexpected answers:\n{}",
        s.table()
    );
}

/// Frames from the VIP (backend-to-client replies) seen while some traffic ran.
struct Replies {
    vip: IpAddr,
    on_lb: Sniffed,
    on_client: usize,
}

impl Replies {
    /// None crossed the balancer; the client got them.
    fn assert_bypassed_the_balancer(&self) {
        let vip = self.vip;
        assert_eq!(
            self.on_lb.matched, 0,
            "the balancer's {IFACE} saw {} frames from the VIP {vip} (DSR replies must bypass it)",
            self.on_lb.matched
        );
        // The client's first packets resolve the balancer's MAC (ARP or neighbour
        // discovery): proof that the balancer's sniffer was capturing at all.
        assert!(
            self.on_lb.seen > 0,
            "the sniffer on the balancer's {IFACE} saw no frame at all"
        );
        assert!(
            self.on_client > 0,
            "the client saw no frame from the VIP {vip}"
        );
    }
}

/// Runs `traffic` with sniffers on the balancer's and the client's `eth0` counting frames
/// from `vip`.
fn sniffing_replies<T>(lab: &Lab, vip: IpAddr, traffic: impl FnOnce() -> T) -> (T, Replies) {
    let on_lb = Sniffer::start(lab.lb(), IFACE, ip_src_is(vip)).expect("sniffer on the balancer");
    let on_client =
        Sniffer::start(lab.client(), IFACE, ip_src_is(vip)).expect("sniffer on the client");
    let result = traffic();
    sleep(SETTLE);
    let replies = Replies {
        vip,
        on_lb: on_lb.finish().expect("sniffer on the balancer"),
        on_client: on_client.stop().expect("sniffer on the client"),
    };
    (result, replies)
}

/// `lb status` answers and names the XDP mode; SIGTERM stops the agent cleanly.
fn assert_status_and_clean_stop(lab: &mut Lab, mode: &str) {
    let agent = lab.agent().expect("agent");
    let status = agent
        .status()
        .unwrap_or_else(|e| panic!("lb status: {e:#}\nagent log:\n{}", agent.log()));
    assert!(
        status.contains(mode),
        "lb status does not name the XDP mode {mode:?}:\n{status}"
    );
    // Without --socket, the socket named in the file given with --config.
    let by_config = lb_tests::agent::run_lb(
        agent.lb_bin(),
        &[
            std::ffi::OsStr::new("status"),
            std::ffi::OsStr::new("--config"),
            agent.config_path().as_os_str(),
        ],
    )
    .expect("lb status --config");
    assert!(
        by_config.success() && by_config.stdout.contains(mode),
        "lb status --config FILE did not reach the agent: {by_config}"
    );
    // The control plane is root's alone.
    let socket = std::fs::metadata(agent.socket()).expect("the control socket");
    assert_eq!(
        (socket.mode() & 0o777, socket.uid()),
        (0o600, 0),
        "control socket {} is not 0600 root's",
        agent.socket().display()
    );
    let agent = lab.take_agent().expect("agent");
    let log_path = agent.log_path().to_path_buf();
    let exit = agent.stop().expect("stop the agent");
    let log = std::fs::read_to_string(log_path).unwrap_or_default();
    assert!(
        exit.success(),
        "the agent exited with {exit} on SIGTERM; log:\n{log}"
    );
}

/// The agent's own counters (`lb status --json`) agree with what the client saw: for
/// every backend of VIP `vip_name`, `field` ("new_flows" for TCP: one SYN per
/// connection; "packets" for UDP: one datagram per request) equals its answers. Asked
/// again for up to 3 s, in case the agent reads its counters periodically.
fn assert_agent_counted(lab: &Lab, vip_name: &str, v6: bool, s: &Spread, field: &str) {
    let agent = lab.agent().expect("agent");
    let expected: Vec<(IpAddr, Option<u64>)> = (0..lab.backends().len())
        .map(|i| {
            let seen = s.counts.get(&lab.backend_name(i)).copied().unwrap_or(0);
            (lab.backend_addr(i, v6), Some(seen as u64))
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let status = agent
            .status_json()
            .unwrap_or_else(|e| panic!("lb status --json: {e:#}"));
        let vip = status["vips"]
            .as_array()
            .and_then(|vips| vips.iter().find(|v| v["name"] == vip_name))
            .unwrap_or_else(|| panic!("no VIP {vip_name:?} in lb status --json:\n{status:#}"));
        let counted: Vec<(IpAddr, Option<u64>)> = expected
            .iter()
            .map(|&(addr, _)| {
                let backend = vip["backends"]
                    .as_array()
                    .and_then(|bs| {
                        bs.iter().find(|b| {
                            b["address"].as_str().and_then(|a| a.parse().ok()) == Some(addr)
                        })
                    })
                    .unwrap_or_else(|| {
                        panic!(
                            "no backend {addr} under {vip_name:?} in lb status --json:\n{status:#}"
                        )
                    });
                (addr, backend[field].as_u64())
            })
            .collect();
        if counted == expected {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{vip_name}: the agent's {field} per backend {counted:?} differ from the answers the \
             client saw {expected:?}\n{status:#}"
        );
        sleep(Duration::from_millis(100));
    }
}

/// A few connections held open, each carrying data both ways many times (every segment
/// of it through the balancer, and full-size ones too).
fn long_lived_connections_carry_data(lab: &Lab, vip: SocketAddr) {
    let mut conns: Vec<Conn> = (0..6)
        .map(|i| {
            Conn::open(lab.client(), vip, TIMEOUT).unwrap_or_else(|e| panic!("connection {i}: {e}"))
        })
        .collect();
    let data: Vec<u8> = (0..4000u32).map(|i| (i % 251) as u8).collect();
    for round in 0..20 {
        for conn in &mut conns {
            let size = 1 + (round * 211) % data.len();
            conn.echo(&data[..size]).unwrap_or_else(|e| {
                panic!("round {round} on {} ({size} bytes): {e}", conn.backend())
            });
        }
    }
}

fn ipv4_tcp(mode: XdpMode, opts: LabOptions, test: &str) {
    let Some(bin) = require_e2e(test) else { return };
    let mut lab = lab_serving(&bin, opts, mode, |lab| {
        vec![lab.vip("web", false, 80, Protocol::Tcp, Health::None)]
    });
    let vip = lab.vip4();
    let (s, replies) = sniffing_replies(&lab, vip, || {
        spread(lab.client(), SocketAddr::new(vip, 80), 300).expect("spread")
    });
    eprintln!("{test}:\n{}", s.table());
    assert_spread(&lab, &s, 300, 0.15);
    replies.assert_bypassed_the_balancer();
    assert_agent_counted(&lab, "web", false, &s, "new_flows");
    long_lived_connections_carry_data(&lab, SocketAddr::new(vip, 80));
    assert_status_and_clean_stop(&mut lab, mode.as_str());
}

/// 300 connections to the IPv4 VIP in native mode all succeed and spread over the three
/// backends; their replies never cross the balancer.
#[test]
fn native_ipv4_tcp_spreads_and_replies_bypass_the_balancer() {
    ipv4_tcp(
        XdpMode::Native,
        LabOptions::default(),
        "native_ipv4_tcp_spreads_and_replies_bypass_the_balancer",
    );
}

/// The same in generic (skb) mode, without the two native-mode veth fixes (xdp_pass on
/// the peer, client checksum offload off): generic mode needs neither.
#[test]
fn generic_ipv4_tcp_spreads_and_replies_bypass_the_balancer() {
    let opts = LabOptions {
        xdp_pass_on_peer: false,
        client_tx_csum_off: false,
        ..LabOptions::default()
    };
    ipv4_tcp(
        XdpMode::Generic,
        opts,
        "generic_ipv4_tcp_spreads_and_replies_bypass_the_balancer",
    );
}

/// An IPv6 VIP (beside the IPv4 one) in native mode.
#[test]
fn native_ipv6_tcp_spreads() {
    let test = "native_ipv6_tcp_spreads";
    let Some(bin) = require_e2e(test) else { return };
    let lab = lab_serving(&bin, LabOptions::default(), XdpMode::Native, |lab| {
        vec![
            lab.vip("web", false, 80, Protocol::Tcp, Health::None),
            lab.vip("web6", true, 80, Protocol::Tcp, Health::None),
        ]
    });
    let vip = lab.vip6();
    let (s, replies) = sniffing_replies(&lab, vip, || {
        spread(lab.client(), SocketAddr::new(vip, 80), 100).expect("spread")
    });
    eprintln!("{test}:\n{}", s.table());
    assert_spread(&lab, &s, 100, 0.10);
    replies.assert_bypassed_the_balancer();
    assert_agent_counted(&lab, "web6", true, &s, "new_flows");
    // The IPv4 VIP of the same config still works.
    let s = spread(lab.client(), SocketAddr::new(lab.vip4(), 80), 30).expect("spread v4");
    assert_eq!(s.failures, 0, "{:?}", s.errors);
}

/// A UDP VIP: each datagram from a new source port is hashed on its own, and the answer
/// comes from the VIP (the client's socket is connected to it).
#[test]
fn native_udp_spreads() {
    let test = "native_udp_spreads";
    let Some(bin) = require_e2e(test) else { return };
    let lab = udp_lab(&bin, |lab| {
        vec![
            lab.vip("web", false, 80, Protocol::Tcp, Health::None),
            lab.vip("dns", false, 53, Protocol::Udp, Health::None),
        ]
    });
    let vip = lab.vip4();
    let (s, replies) = sniffing_replies(&lab, vip, || {
        udp_spread(lab.client(), SocketAddr::new(vip, 53), 150).expect("udp spread")
    });
    eprintln!("{test}:\n{}", s.table());
    assert_spread(&lab, &s, 150, 0.10);
    replies.assert_bypassed_the_balancer();
    assert_agent_counted(&lab, "dns", false, &s, "packets");
}

/// Only the configured VIP, port and protocol are touched: a TCP port or a UDP port of
/// the VIP that no `[[vip]]` names is not balanced (backends listen there, and nothing
/// reaches them), while traffic to the balancer's own address passes to its kernel.
#[test]
fn native_other_traffic_passes_untouched() {
    let test = "native_other_traffic_passes_untouched";
    let Some(bin) = require_e2e(test) else { return };
    let mut lab = Lab::new(LabOptions::default()).expect("build the lab");
    lab.serve_tcp(80, false).expect("tcp servers on 80");
    lab.serve_tcp(81, true).expect("tcp servers on 81");
    lab.serve_udp(80, true).expect("udp servers on 80");
    let config = lab.agent_config(
        XdpMode::Native,
        vec![lab.vip("web", false, 80, Protocol::Tcp, Health::None)],
    );
    lab.start_agent(&bin, &config).expect("start the agent");
    let lb_tcp = TcpServer::start(lab.lb(), "[::]:80".parse().unwrap(), "lb-itself")
        .expect("tcp server on the lb");
    let lb_udp = UdpServer::start(lab.lb(), "0.0.0.0:80".parse().unwrap(), "lb-itself")
        .expect("udp server on the lb");
    let vip = lab.vip4();

    // The balanced VIP works...
    let name =
        tcp_request(lab.client(), SocketAddr::new(vip, 80), TIMEOUT).expect("the VIP's port");
    assert!(name.starts_with("backend-"), "{name}");
    // ...another port or protocol of the VIP does not reach any backend.
    let r = tcp_request(lab.client(), SocketAddr::new(vip, 81), NOT_BALANCED_TIMEOUT);
    assert!(r.is_err(), "tcp to {vip}:81 (no VIP) was answered: {r:?}");
    let r = udp_request(lab.client(), SocketAddr::new(vip, 80), NOT_BALANCED_TIMEOUT);
    assert!(
        r.is_err(),
        "udp to {vip}:80 (a tcp VIP) was answered: {r:?}"
    );
    for server in lab.tcp_servers().iter().filter(|s| s.addr().port() == 81) {
        assert_eq!(
            server.accepted(),
            0,
            "{} accepted a connection",
            server.name()
        );
    }

    // The balancer's own address: TCP on the VIP's port, UDP, ICMP, both families.
    for v6 in [false, true] {
        let own = lab.lb_addr(v6);
        let name = tcp_request(lab.client(), SocketAddr::new(own, 80), TIMEOUT)
            .unwrap_or_else(|e| panic!("tcp to the balancer's {own}:80: {e}"));
        assert_eq!(name, "lb-itself");
        ping(lab.client(), own, TIMEOUT).unwrap_or_else(|e| panic!("ping {own}: {e}"));
    }
    let own = lab.lb_addr(false);
    let name = udp_request(lab.client(), SocketAddr::new(own, 80), TIMEOUT)
        .unwrap_or_else(|e| panic!("udp to the balancer's {own}:80: {e}"));
    assert_eq!(name, "lb-itself");
    assert_eq!(lb_tcp.accepted(), 2);
    assert_eq!(lb_udp.answered(), 1);
}

/// Path MTU discovery through the balancer: a router's "fragmentation needed" (ICMPv6
/// "packet too big") about a reply of a UDP flow is addressed to the VIP, so it reaches
/// the balancer, which sends it to the backend that sent the reply; that backend's
/// kernel (and only its) then holds the lower path MTU towards the client.
#[test]
fn icmp_too_big_reaches_the_flows_backend() {
    let test = "icmp_too_big_reaches_the_flows_backend";
    let Some(bin) = require_e2e(test) else { return };
    let lab = udp_lab(&bin, |lab| {
        vec![
            lab.vip("dns", false, 53, Protocol::Udp, Health::None),
            lab.vip("dns6", true, 53, Protocol::Udp, Health::None),
        ]
    });
    for (v6, mtu) in [(false, 1400u16), (true, 1280)] {
        let (vip, client) = (
            if v6 { lab.vip6() } else { lab.vip4() },
            lab.client_addr(v6),
        );
        let client_port = 30999;
        let answer = lb_tests::udp_request_from(
            lab.client(),
            SocketAddr::new(vip, 53),
            client_port,
            Duration::from_secs(2),
        )
        .expect("a UDP request to the VIP");
        let served = (0..lab.backends().len())
            .find(|&i| lab.backend_name(i) == answer)
            .unwrap_or_else(|| panic!("answered by {answer:?}, no backend of the lab"));
        let error = too_big(vip, client, client_port, mtu);
        lb_tests::send_icmp(lab.client(), vip, &error).expect("send the ICMP error");

        let client_text = client.to_string();
        let path_mtu = |i: usize| -> String {
            lab.backend(i)
                .exec("ip", &["route", "get", &client_text])
                .unwrap_or_else(|e| format!("(ip route get failed: {e:#})"))
        };
        let lowered = format!("mtu {mtu}");
        let start = Instant::now();
        while !path_mtu(served).contains(&lowered) {
            assert!(
                start.elapsed() < Duration::from_secs(3),
                "{} (which answered the flow) holds no path MTU {mtu} towards {client}:\n{}\n\
                 balancer: {}",
                lab.backend_name(served),
                path_mtu(served),
                lab.agent().expect("agent").status().unwrap_or_default()
            );
            sleep(Duration::from_millis(50));
        }
        for i in (0..lab.backends().len()).filter(|&i| i != served) {
            let route = path_mtu(i);
            assert!(
                !route.contains(&lowered),
                "{} got the error about another backend's flow:\n{route}",
                lab.backend_name(i)
            );
        }
        eprintln!(
            "{test}: {} lowered its path MTU to {client} to {mtu}:\n{}",
            lab.backend_name(served),
            path_mtu(served)
        );
    }
    let status = lab.agent().expect("agent").status_json().expect("status");
    assert_eq!(status["counters"]["seen_icmp_too_big"], 2, "{status:#}");
}

/// What a router on the way back would send about a UDP reply from `vip`:53 to
/// `client`:`client_port` that was too big for its next hop of `mtu`: the ICMP message
/// (its checksum left to `send_icmp`), quoting the reply's IP header and 8 bytes of UDP.
fn too_big(vip: IpAddr, client: IpAddr, client_port: u16, mtu: u16) -> Vec<u8> {
    let mut quoted = match (vip, client) {
        (IpAddr::V4(vip), IpAddr::V4(client)) => {
            // Version/IHL, TOS, length 1500, id, DF, TTL, UDP, checksum.
            let mut h = vec![0x45, 0, 0x05, 0xdc, 0, 1, 0x40, 0, 64, 17, 0, 0];
            h.extend_from_slice(&vip.octets());
            h.extend_from_slice(&client.octets());
            let checksum = lb_tests::client::checksum(&h);
            h[10..12].copy_from_slice(&checksum.to_be_bytes());
            h
        }
        (IpAddr::V6(vip), IpAddr::V6(client)) => {
            // Version, payload length 1452, UDP, hop limit.
            let mut h = vec![0x60, 0, 0, 0, 0x05, 0xac, 17, 64];
            h.extend_from_slice(&vip.octets());
            h.extend_from_slice(&client.octets());
            h
        }
        _ => panic!("{vip} and {client} are of different families"),
    };
    quoted.extend_from_slice(&53u16.to_be_bytes());
    quoted.extend_from_slice(&client_port.to_be_bytes());
    quoted.extend_from_slice(&[0x05, 0xac, 0, 0]);
    // ICMP: type 3 code 4 "fragmentation needed", 2 unused bytes, the next-hop MTU;
    // ICMPv6: type 2 "packet too big", the MTU in 4 bytes.
    let mut msg = if vip.is_ipv4() {
        vec![3, 4, 0, 0, 0, 0]
    } else {
        vec![2, 0, 0, 0, 0, 0]
    };
    msg.extend_from_slice(&mtu.to_be_bytes());
    msg.extend(quoted);
    msg
}
