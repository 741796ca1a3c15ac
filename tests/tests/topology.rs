//! The test bed itself, with plain kernel networking and no agent: every host reaches
//! every other, and DSR works when the balancer's kernel forwards to one backend (which
//! proves the backends' VIP, ARP and routing set-up the end-to-end tests rely on).
//! Needs root; `cargo test -p lb-tests --test topology`.

use std::net::SocketAddr;
use std::thread::sleep;
use std::time::Duration;

use lb_tests::lab::IFACE;
use lb_tests::sniff::SETTLE;
use lb_tests::{
    Lab, LabOptions, Sniffer, TcpServer, ip_src_is, ping, require_root_tools, spread, tcp_request,
    udp_request, udp_spread,
};

const TIMEOUT: Duration = Duration::from_secs(2);

/// No XDP at all: these tests need neither the eBPF object nor the agent.
fn plain_lab() -> Lab {
    Lab::new(LabOptions {
        xdp_pass_on_peer: false,
        ..LabOptions::default()
    })
    .expect("build the lab")
}

#[test]
fn every_host_reaches_every_other() {
    if !require_root_tools("every_host_reaches_every_other") {
        return;
    }
    let mut lab = plain_lab();
    lab.serve_tcp(80, false).expect("tcp servers");
    lab.serve_udp(53, false).expect("udp servers");
    let lb_server =
        TcpServer::start(lab.lb(), "[::]:80".parse().unwrap(), "lb-itself").expect("lb server");

    for v6 in [false, true] {
        for i in 0..lab.backends().len() {
            let addr = SocketAddr::new(lab.backend_addr(i, v6), 80);
            let name = tcp_request(lab.client(), addr, TIMEOUT)
                .unwrap_or_else(|e| panic!("tcp {addr}: {e}"));
            assert_eq!(name, lab.backend_name(i), "tcp {addr}");
            let addr = SocketAddr::new(lab.backend_addr(i, v6), 53);
            let name = udp_request(lab.client(), addr, TIMEOUT)
                .unwrap_or_else(|e| panic!("udp {addr}: {e}"));
            assert_eq!(name, lab.backend_name(i), "udp {addr}");
        }
        let lb = lab.lb_addr(v6);
        ping(lab.client(), lb, TIMEOUT).unwrap_or_else(|e| panic!("ping {lb}: {e}"));
        let name = tcp_request(lab.client(), SocketAddr::new(lb, 80), TIMEOUT)
            .expect("tcp to the lb itself");
        assert_eq!(name, "lb-itself");
        // Backends reach the client too (the way their DSR replies go).
        let client = lab.client_addr(v6);
        ping(lab.backend(0), client, TIMEOUT)
            .unwrap_or_else(|e| panic!("ping {client} from backend-1: {e}"));
    }
    assert_eq!(lb_server.accepted(), 2);

    // The VIP is routed to the balancer, whose kernel does not forward: no answer.
    let vip = SocketAddr::new(lab.vip4(), 80);
    assert!(tcp_request(lab.client(), vip, Duration::from_millis(500)).is_err());
}

/// The balancer's kernel routes the VIP to backend-1: the backend answers from the VIP on
/// its `lo`, straight to the client, and the balancer never sees a reply.
#[test]
fn kernel_routed_dsr() {
    if !require_root_tools("kernel_routed_dsr") {
        return;
    }
    let mut lab = plain_lab();
    lab.serve_tcp(80, false).expect("tcp servers");
    lab.serve_udp(53, false).expect("udp servers");
    let lb = lab.lb();
    for (key, value) in [
        ("net.ipv4.ip_forward", "1"),
        ("net.ipv6.conf.all.forwarding", "1"),
        // In and out of the same port: the kernel would tell the client to go to the
        // backend directly, which is not what is being tested.
        ("net.ipv4.conf.all.send_redirects", "0"),
        ("net.ipv4.conf.eth0.send_redirects", "0"),
    ] {
        lb.sysctl(key, value).expect("sysctl");
    }
    let b1_v4 = lab.backend_addr(0, false).to_string();
    let b1_v6 = lab.backend_addr(0, true).to_string();
    lb.exec(
        "ip",
        &["route", "add", &format!("{}/32", lab.vip4()), "via", &b1_v4],
    )
    .expect("route");
    lb.exec(
        "ip",
        &[
            "-6",
            "route",
            "add",
            &format!("{}/128", lab.vip6()),
            "via",
            &b1_v6,
        ],
    )
    .expect("route");

    for vip in [lab.vip4(), lab.vip6()] {
        let on_lb = Sniffer::start(lab.lb(), IFACE, ip_src_is(vip)).expect("sniffer");
        let on_client = Sniffer::start(lab.client(), IFACE, ip_src_is(vip)).expect("sniffer");
        let tcp = spread(lab.client(), SocketAddr::new(vip, 80), 20).expect("spread");
        let udp = udp_spread(lab.client(), SocketAddr::new(vip, 53), 20).expect("udp spread");
        sleep(SETTLE);
        let (on_lb, on_client) = (on_lb.stop().unwrap(), on_client.stop().unwrap());
        for s in [&tcp, &udp] {
            assert_eq!(s.failures, 0, "{vip}: {:?}", s.errors);
            assert_eq!(s.counts.get("backend-1"), Some(&20), "{vip}: {s:?}");
        }
        assert_eq!(on_lb, 0, "{vip}: the balancer saw replies");
        assert!(on_client >= 40, "{vip}: the client saw {on_client} replies");
    }
}
