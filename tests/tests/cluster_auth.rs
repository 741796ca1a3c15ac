//! End to end: what a node accepts from the network on its cluster port. A datagram that
//! carries connection-table entries but fails authentication (another key, an altered
//! byte) inserts none of them; a datagram from an address that is not a peer is dropped
//! before anything is read, however well it is signed; the same entries, signed and sent
//! by the peer, are inserted (so the refusals are the checks', not an entry the agent
//! would not take anyway). Each outcome is read from the agent: its counters and
//! `lb explain` of each flow.
//!
//! Needs root, bpffs, the eBPF object and a built `lb`. `cargo test -p lb-tests --test
//! cluster_auth`.

use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::os::unix::fs::PermissionsExt;
use std::thread::sleep;
use std::time::{Duration, Instant, SystemTime};

use lb_tests::{Agent, Health, Lab, LabOptions, Protocol, XdpMode, require_e2e};
use lb_userspace::cluster::wire;
use serde_json::Value;

const KEY: &[u8] = b"a test key, 32 bytes long......!";
const CLUSTER_PORT: u16 = 4790;

fn status(agent: &Agent) -> Value {
    agent.status_json().expect("lb status --json")
}

/// The sender's clock, as the wire format counts it.
fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// A datagram of entries that put the flow from `client` to `vip` on `backend`.
fn entries(seq: u64, flows: &[(SocketAddr, SocketAddr)], backend: IpAddr) -> wire::Message {
    let (backend, _) = lb_common::addr::to_map(backend);
    wire::Message {
        kind: wire::Kind::Entries,
        boot: 1,
        seq,
        time_ms: now_ms(),
        entries: flows
            .iter()
            .map(|&(client, vip)| wire::Entry {
                key: lb_common::FlowKey::between(client, vip, lb_common::PROTO_TCP),
                backend,
                age_s: 0,
                flags: 0,
            })
            .collect(),
    }
}

/// `lb explain` of the flow from `client`: the backend its connection-table entry holds,
/// if any.
fn held_by(agent: &Agent, vip: SocketAddr, client: SocketAddr) -> Option<String> {
    let out = agent
        .cli(&[
            "explain",
            &format!("{vip}/tcp"),
            &client.to_string(),
            "--json",
        ])
        .expect("lb explain");
    assert!(out.success(), "lb explain: {out}");
    let explained: Value = serde_json::from_str(&out.stdout).expect("explain JSON");
    explained["conntrack_backend"].as_str().map(str::to_string)
}

#[test]
fn entries_are_taken_only_authenticated_and_from_a_peer() {
    let test = "entries_are_taken_only_authenticated_and_from_a_peer";
    let Some(bin) = require_e2e(test) else { return };
    let mut lab = Lab::new(LabOptions::default()).expect("build the lab");
    lab.serve_tcp(80, false).expect("backend servers");
    let key = lab.dir().join("cluster.key");
    std::fs::write(&key, KEY).unwrap();
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
    // The client speaks for the one peer; backend-1 is a host that is not one.
    let peer = lab.client_addr(false);
    let stranger = lab.backend_addr(0, false);
    let agent_addr = SocketAddr::new(lab.lb_addr(false), CLUSTER_PORT);
    let vips = vec![lab.vip("web", false, 80, Protocol::Tcp, Health::None)];
    let mut config = lab.agent_config(XdpMode::Native, vips);
    config.conntrack_entries = Some(4096);
    let text = format!(
        "{}\n[cluster]\npeers = [\"{peer}\"]\nkey_file = \"{}\"\nlearn_timeout = \"1s\"\n",
        config.to_toml(),
        key.display()
    );
    let path = lab.dir().join("lb.toml");
    std::fs::write(&path, text).unwrap();
    let log = lab.dir().join("lb.log");
    let agent =
        Agent::start(&bin, lab.lb(), &path, &lab.socket_path(), &log).expect("start the agent");
    let start = Instant::now();
    while status(&agent)["cluster"]["learning"] == "learning" {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "learning never ended"
        );
        sleep(Duration::from_millis(50));
    }

    let vip = SocketAddr::new(lab.vip4(), 80);
    let flow = |port: u16| SocketAddr::new(peer, port);
    let target = lab.backend_addr(1, false);
    let (forged, altered, unknown, genuine) = (flow(45001), flow(45002), flow(45003), flow(45004));
    let send = |from: IpAddr, datagram: Vec<u8>| {
        lab.client()
            .run(move || {
                let socket = UdpSocket::bind(SocketAddr::new(from, 0)).unwrap();
                socket.send_to(&datagram, agent_addr).unwrap();
            })
            .expect("send from the client's namespace");
    };
    let send_from_stranger = |datagram: Vec<u8>| {
        lab.backend(0)
            .run(move || {
                let socket = UdpSocket::bind(SocketAddr::new(stranger, 0)).unwrap();
                socket.send_to(&datagram, agent_addr).unwrap();
            })
            .expect("send from backend-1's namespace");
    };
    // Another key; an altered byte inside the entries; the cluster's key from a stranger.
    send(
        peer,
        wire::encode(
            &entries(1, &[(forged, vip)], target),
            b"not the cluster's key, wrong!!!!",
        ),
    );
    let mut datagram = wire::encode(&entries(2, &[(altered, vip)], target), KEY);
    datagram[wire::HEADER_LEN + 3] ^= 1;
    send(peer, datagram);
    send_from_stranger(wire::encode(&entries(3, &[(unknown, vip)], target), KEY));
    // And the genuine article.
    send(
        peer,
        wire::encode(&entries(4, &[(genuine, vip)], target), KEY),
    );

    let start = Instant::now();
    let cluster = loop {
        let cluster = status(&agent)["cluster"].clone();
        let peer_status = &cluster["peers"][0];
        let settled = peer_status["rejected"] == 2
            && peer_status["inserted"] == 1
            && cluster["unknown_sender"] == 1;
        if settled || start.elapsed() > Duration::from_secs(5) {
            break cluster;
        }
        sleep(Duration::from_millis(50));
    };
    eprintln!("{test}: cluster status after the datagrams: {cluster:#}");
    let peer_status = &cluster["peers"][0];
    assert_eq!(peer_status["address"], peer.to_string(), "{cluster:#}");
    assert_eq!(
        peer_status["rejected"], 2,
        "forged and altered: {cluster:#}"
    );
    assert_eq!(
        peer_status["received"], 1,
        "the genuine entry only: {cluster:#}"
    );
    assert_eq!(peer_status["inserted"], 1, "{cluster:#}");
    assert_eq!(cluster["unknown_sender"], 1, "{cluster:#}");

    let target = target.to_string();
    assert_eq!(
        held_by(&agent, vip, genuine),
        Some(target),
        "the genuine entry"
    );
    for (what, flow) in [
        ("forged", forged),
        ("altered", altered),
        ("stranger's", unknown),
    ] {
        assert_eq!(
            held_by(&agent, vip, flow),
            None,
            "the {what} entry reached the connection table"
        );
    }
}
