//! End to end: health checks for services without a TCP port (`kind = "udp"` and
//! `kind = "dns"`), against real UDP servers in the backends' namespaces, through the
//! real agent. A stopped UDP service goes down even while its TCP port stays open, a DNS
//! server answering SERVFAIL goes down with that reason, and both come back.
//!
//! Needs root, bpffs, the eBPF object and a built `lb`; otherwise each test prints
//! `SKIPPED` (or fails under `LB_REQUIRE_ALL_TESTS=1`).
//! `cargo test -p lb-tests --test datagram_checks`.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::thread::{JoinHandle, sleep};
use std::time::Duration;

use lb_tests::{Health, Lab, LabOptions, Netns, Protocol, UdpServer, XdpMode, require_e2e};
use serde_json::Value;

const UDP_PORT: u16 = 5353;
const DNS_PORT: u16 = 5354;
const WAIT: Duration = Duration::from_secs(10);

fn timing() -> Vec<String> {
    [
        "interval = \"300ms\"",
        "timeout = \"200ms\"",
        "rise = 2",
        "fall = 2",
    ]
    .map(String::from)
    .to_vec()
}

/// A DNS server that answers every query with the RCODE it is set to (0 NOERROR, 2
/// SERVFAIL): the query itself, turned into a response.
struct DnsServer {
    rcode: Arc<AtomicU8>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<anyhow::Result<()>>>,
}

impl DnsServer {
    fn start(ns: &Netns, port: u16) -> DnsServer {
        let (rcode, stop) = (Arc::new(AtomicU8::new(0)), Arc::new(AtomicBool::new(false)));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let thread = {
            let (rcode, stop) = (rcode.clone(), stop.clone());
            ns.spawn("dns", move || {
                let socket = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, port))?;
                socket.set_read_timeout(Some(Duration::from_millis(50)))?;
                let _ = ready_tx.send(());
                let mut buf = [0u8; 512];
                while !stop.load(Ordering::Relaxed) {
                    let Ok((n, from)) = socket.recv_from(&mut buf) else {
                        continue;
                    };
                    if n < 12 {
                        continue;
                    }
                    let mut answer = buf[..n].to_vec();
                    answer[2] |= 0x80; // QR: a response
                    answer[3] = (answer[3] & 0xf0) | rcode.load(Ordering::Relaxed);
                    let _ = socket.send_to(&answer, from);
                }
                Ok(())
            })
            .expect("dns server thread")
        };
        ready_rx
            .recv_timeout(Duration::from_secs(5))
            .expect("dns server bound");
        DnsServer {
            rcode,
            stop,
            thread: Some(thread),
        }
    }

    fn stop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for DnsServer {
    fn drop(&mut self) {
        self.stop();
    }
}

fn backend(status: &Value, vip: &str, address: IpAddr) -> Value {
    status["vips"]
        .as_array()
        .and_then(|vips| vips.iter().find(|v| v["name"] == vip))
        .and_then(|v| {
            v["backends"]
                .as_array()?
                .iter()
                .find(|b| b["address"].as_str() == Some(&address.to_string()))
                .cloned()
        })
        .unwrap_or_else(|| panic!("no backend {address} of {vip} in:\n{status:#}"))
}

fn wait(lab: &Lab, what: &str, until: impl Fn(&Value) -> bool) -> Value {
    lb_tests::wait_status(lab, WAIT, what, until)
}

fn error_of(b: &Value) -> String {
    b["last_check"]["error"].as_str().unwrap_or("").to_string()
}

#[test]
fn udp_and_dns_checks_follow_the_datagram_service() {
    let Some(bin) = require_e2e("udp_and_dns_checks_follow_the_datagram_service") else {
        return;
    };
    let mut lab = Lab::new(LabOptions::default()).expect("build the lab");
    // TCP stays open on the UDP service's port: only a datagram check sees it go.
    lab.serve_tcp(UDP_PORT, false).expect("tcp servers");
    let mut udp: Vec<Option<UdpServer>> = (0..3)
        .map(|i| {
            let addr = SocketAddr::new(lab.backend_addr(i, false), UDP_PORT);
            Some(UdpServer::start(lab.backend(i), addr, &lab.backend_name(i)).expect("udp server"))
        })
        .collect();
    let mut dns: Vec<DnsServer> = (0..3)
        .map(|i| DnsServer::start(lab.backend(i), DNS_PORT))
        .collect();
    let mut udp_vip = lab.vip("udp", false, UDP_PORT, Protocol::Udp, Health::None);
    udp_vip.health = Health::Lines(
        [
            vec![
                "kind = \"udp\"".to_string(),
                "send = \"ping\"".into(),
                "expect = \"backend-\"".into(),
            ],
            timing(),
        ]
        .concat(),
    );
    let mut dns_vip = lab.vip("dns", false, DNS_PORT, Protocol::Udp, Health::None);
    dns_vip.health = Health::Lines(
        [
            vec![
                "kind = \"dns\"".to_string(),
                "query = \"example.com\"".into(),
                "query_type = \"A\"".into(),
            ],
            timing(),
        ]
        .concat(),
    );
    let config = lab.agent_config(XdpMode::Native, vec![udp_vip, dns_vip]);
    lab.start_agent(&bin, &config).expect("start the agent");
    let addr = |i: usize| lab.backend_addr(i, false);
    wait(&lab, "every backend up by its udp and dns checks", |s| {
        (0..3).all(|i| {
            backend(s, "udp", addr(i))["health"] == "up"
                && backend(s, "dns", addr(i))["health"] == "up"
        })
    });

    // backend-1's UDP service stops; its TCP port stays open.
    udp[0]
        .take()
        .expect("running")
        .stop()
        .expect("stop udp server");
    let s = wait(&lab, "backend-1 down by its udp check", |s| {
        backend(s, "udp", addr(0))["health"] == "down"
    });
    let b = backend(&s, "udp", addr(0));
    assert_eq!(error_of(&b), "port unreachable", "{b:#}");
    assert_eq!(backend(&s, "udp", addr(1))["health"], "up");
    let server = UdpServer::start(
        lab.backend(0),
        SocketAddr::new(addr(0), UDP_PORT),
        &lab.backend_name(0),
    )
    .expect("udp server again");
    udp[0] = Some(server);
    wait(&lab, "backend-1 up again by its udp check", |s| {
        backend(s, "udp", addr(0))["health"] == "up"
    });

    // backend-2's DNS server answers SERVFAIL, then NOERROR again.
    dns[1].rcode.store(2, Ordering::Relaxed);
    let s = wait(&lab, "backend-2 down by its dns check", |s| {
        backend(s, "dns", addr(1))["health"] == "down"
    });
    let b = backend(&s, "dns", addr(1));
    assert_eq!(error_of(&b), "DNS SERVFAIL", "{b:#}");
    dns[1].rcode.store(0, Ordering::Relaxed);
    wait(&lab, "backend-2 up again by its dns check", |s| {
        backend(s, "dns", addr(1))["health"] == "up"
    });

    // backend-3's DNS server stops.
    dns[2].stop();
    let s = wait(&lab, "backend-3 down when its dns server stops", |s| {
        backend(s, "dns", addr(2))["health"] == "down"
    });
    assert_eq!(error_of(&backend(&s, "dns", addr(2))), "port unreachable");
    drop(dns);
    drop(udp);
}

/// A backend that lost the VIP from its loopback drops all VIP traffic while its own
/// address still answers: checks through the VIP see it, checks of the backend do not.
#[test]
fn a_backend_without_the_vip_fails_checks_through_the_vip_only() {
    let Some(bin) = require_e2e("a_backend_without_the_vip_fails_checks_through_the_vip_only")
    else {
        return;
    };
    let mut lab = Lab::new(LabOptions::default()).expect("build the lab");
    lab.serve_tcp(80, false).expect("tcp servers on 80");
    lab.serve_tcp(81, false).expect("tcp servers on 81");
    // Bound to the VIP: they answer only what reaches the VIP.
    let udp: Vec<UdpServer> = (0..3)
        .map(|i| {
            let addr = SocketAddr::new(lab.vip4(), UDP_PORT);
            UdpServer::start(lab.backend(i), addr, &lab.backend_name(i)).expect("udp server")
        })
        .collect();
    let through_vip = |kind: &str| {
        [
            vec![format!("kind = \"{kind}\""), "target = \"vip\"".into()],
            timing(),
        ]
        .concat()
    };
    let mut tcp_vip = lab.vip("tcpvip", false, 80, Protocol::Tcp, Health::None);
    tcp_vip.health = Health::Lines(through_vip("tcp"));
    let mut udp_vip = lab.vip("udpvip", false, UDP_PORT, Protocol::Udp, Health::None);
    udp_vip.health = Health::Lines(through_vip("udp"));
    let mut own = lab.vip("own", false, 81, Protocol::Tcp, Health::None);
    own.health = Health::Lines([vec!["kind = \"tcp\"".to_string()], timing()].concat());
    let config = lab.agent_config(XdpMode::Native, vec![tcp_vip, udp_vip, own]);
    lab.start_agent(&bin, &config).expect("start the agent");
    let addr = |i: usize| lab.backend_addr(i, false);
    let s = wait(
        &lab,
        "every backend up, through the VIP and at its own address",
        |s| {
            (0..3).all(|i| {
                ["tcpvip", "udpvip", "own"]
                    .iter()
                    .all(|vip| backend(s, vip, addr(i))["health"] == "up")
            })
        },
    );
    assert_eq!(
        backend(&s, "tcpvip", addr(0))["check"],
        "tcp port 80 through the VIP"
    );

    // backend-1 loses the VIP.
    lab.set_vip_on_lo(0, lab.vip4(), false)
        .expect("remove the VIP from backend-1's lo");
    let s = wait(&lab, "backend-1 down through the VIP (tcp and udp)", |s| {
        backend(s, "tcpvip", addr(0))["health"] == "down"
            && backend(s, "udpvip", addr(0))["health"] == "down"
    });
    let tcp_error = error_of(&backend(&s, "tcpvip", addr(0)));
    assert!(tcp_error.contains("no SYN-ACK from the VIP"), "{tcp_error}");
    let udp_error = error_of(&backend(&s, "udpvip", addr(0)));
    assert!(udp_error.contains("no reply from the VIP"), "{udp_error}");
    // Its own address still answers: a check of the backend keeps it up.
    sleep(Duration::from_secs(1));
    let s = lab.agent().expect("agent").status_json().expect("status");
    assert_eq!(backend(&s, "own", addr(0))["health"], "up", "{s:#}");
    assert_eq!(backend(&s, "tcpvip", addr(1))["health"], "up", "{s:#}");
    assert_eq!(backend(&s, "tcpvip", addr(0))["in_table"], false, "{s:#}");
    drop(udp);
}
