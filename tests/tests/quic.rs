//! QUIC connections routed by connection ID (issue 38), end to end: quinn clients in the
//! client namespace, quinn servers on three backends issuing QUIC-LB connection IDs with
//! their `server_id` (`lb_quic::ServerIdCids`), the real agent and XDP program between.
//!
//! A client that moves (its UDP socket rebound to a new port, as a NAT rebinding does,
//! or to a second address) keeps its connection on a `quic = true` VIP; on the same
//! VIP without `quic` (the control, served by the same servers on another port) the
//! moved connections land where the table hashes their new 5-tuple, and break.
//!
//! Needs root, bpffs, the eBPF object and a built `lb`; otherwise each test prints
//! `SKIPPED` (or fails under `LB_REQUIRE_ALL_TESTS=1`). `cargo test -p lb-tests --test quic`.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;

use anyhow::Result;
use lb_tests::quic::{QuicClient, QuicServer, ask_move_ask};
use lb_tests::{Health, Lab, LabOptions, Protocol, XdpMode, require_e2e};

/// The QUIC VIP's port, and the control VIP's (the same servers, no `quic`).
const QUIC_PORT: u16 = 443;
const PLAIN_PORT: u16 = 4433;
/// Bytes of server ID in the connection IDs.
const ID_LEN: u32 = 2;

/// A lab whose backends serve QUIC on both ports (backend `i` with server ID `i + 1`,
/// answering with its address), and the agent serving the QUIC VIP and the control VIP.
fn quic_lab(bin: &Path) -> (Lab, Vec<QuicServer>) {
    let mut lab = Lab::new(LabOptions::default()).expect("build the lab");
    let mut servers = Vec::new();
    for i in 0..lab.backends().len() {
        let name = lab.backend_addr(i, false).to_string();
        for port in [QUIC_PORT, PLAIN_PORT] {
            let at = SocketAddr::new(lab.vip4(), port);
            let server = QuicServer::start(lab.backend(i), at, &name, i as u64 + 1, ID_LEN)
                .expect("start a quic server");
            servers.push(server);
        }
    }
    let mut quic = lab.vip("h3", false, QUIC_PORT, Protocol::Udp, Health::None);
    quic.extra.push("quic = true".into());
    quic.extra.push(format!("quic_server_id_len = {ID_LEN}"));
    for (i, backend) in quic.backends.iter_mut().enumerate() {
        backend.server_id = Some(i as u64 + 1);
    }
    let plain = lab.vip("h3plain", false, PLAIN_PORT, Protocol::Udp, Health::None);
    let config = lab.agent_config(XdpMode::Native, vec![quic, plain]);
    lab.start_agent(bin, &config).expect("start the agent");
    (lab, servers)
}

/// Connections per backend, by the first answers.
fn spread(results: &[(String, Result<String>)]) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for (first, _) in results {
        *counts.entry(first.clone()).or_default() += 1;
    }
    counts
}

/// The connections whose second request failed or reached another backend.
fn broken(results: &[(String, Result<String>)]) -> Vec<String> {
    results
        .iter()
        .filter(|(first, second)| second.as_ref().ok() != Some(first))
        .map(|(first, second)| match second {
            Ok(other) => format!("{first} -> {other}"),
            Err(e) => format!("{first} -> failed: {e:#}"),
        })
        .collect()
}

fn vip_status(lab: &Lab, name: &str) -> serde_json::Value {
    let status = lab.agent().expect("agent").status_json().expect("status");
    status["vips"]
        .as_array()
        .expect("vips")
        .iter()
        .find(|v| v["name"] == name)
        .cloned()
        .expect("the vip in status")
}

/// Many connections spread over the backends; each, moved to a new port and then to a
/// second address, keeps its connection with no failed request on the QUIC VIP, where
/// the same moves break connections on the VIP without `quic`.
#[test]
fn quic_connections_survive_a_new_port_and_a_new_address() {
    let test = "quic_connections_survive_a_new_port_and_a_new_address";
    let Some(bin) = require_e2e(test) else { return };
    let (lab, _servers) = quic_lab(&bin);
    let client = lab.client_addr(false);
    let second = lab.add_client_addr(3).expect("a second client address");
    let vip = SocketAddr::new(lab.vip4(), QUIC_PORT);

    let new_port = move |c: &QuicClient, _: &str| c.rebind(SocketAddr::new(client, 0));
    let moved = ask_move_ask(lab.client(), client, vip, 24, new_port).expect("new ports");
    let counts = spread(&moved);
    eprintln!("{test}: connections per backend {counts:?}");
    assert_eq!(
        counts.len(),
        3,
        "24 connections reach every backend: {counts:?}"
    );
    assert_eq!(broken(&moved), Vec::<String>::new(), "after a new port");

    let new_address = move |c: &QuicClient, _: &str| c.rebind(SocketAddr::new(second, 0));
    let moved = ask_move_ask(lab.client(), client, vip, 12, new_address).expect("new address");
    assert_eq!(broken(&moved), Vec::<String>::new(), "after a new address");

    let status = vip_status(&lab, "h3");
    let routed = status["quic_routed_by_cid"]
        .as_u64()
        .expect("quic_routed_by_cid");
    // Every second request at least (its stream and acknowledgements are short headers).
    assert!(routed >= 36, "quic_routed_by_cid {routed}");
    assert_eq!(status["quic"], true);
    let ids: Vec<_> = status["backends"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["server_id"].as_u64())
        .collect();
    assert_eq!(ids, [Some(1), Some(2), Some(3)]);

    // The control: without `quic`, a moved connection goes where its new 5-tuple hashes.
    let plain = SocketAddr::new(lab.vip4(), PLAIN_PORT);
    let moved = ask_move_ask(lab.client(), client, plain, 24, new_port).expect("control");
    let broken = broken(&moved);
    eprintln!(
        "{test}: without quic, {} of 24 moved connections broke",
        broken.len()
    );
    // All 24 hashing to their old backend again has odds of (1/3)^24.
    assert!(!broken.is_empty(), "the control broke nothing: {moved:?}");
    assert_eq!(vip_status(&lab, "h3plain")["quic_routed_by_cid"], 0);
}

/// A draining backend keeps its QUIC connections, even when they move (the table no
/// longer gives it new flows; their connection IDs still name it), and takes no new
/// ones.
#[test]
fn a_draining_backend_keeps_its_quic_connections() {
    let test = "a_draining_backend_keeps_its_quic_connections";
    let Some(bin) = require_e2e(test) else { return };
    let (lab, _servers) = quic_lab(&bin);
    let client = lab.client_addr(false);
    let vip = SocketAddr::new(lab.vip4(), QUIC_PORT);
    let agent = lab.agent().expect("agent");

    // Connections are opened, then the busiest backend drained, then they all move.
    let drained = std::sync::Arc::new(std::sync::Mutex::new(None::<IpAddr>));
    let (socket, bin_path) = (agent.socket().to_path_buf(), agent.lb_bin().to_path_buf());
    let chosen = drained.clone();
    let drain_then_move = move |c: &QuicClient, first: &str| {
        let mut chosen = chosen.lock().unwrap();
        if chosen.is_none() {
            // The first client's backend: drained before any client moves.
            let backend: IpAddr = first.parse()?;
            let vip = format!("{}/udp", SocketAddr::new(vip.ip(), QUIC_PORT));
            let socket = socket.to_string_lossy().to_string();
            let args = ["drain", &vip, &backend.to_string(), "--socket", &socket];
            lb_tests::netns::run_cmd(&bin_path.to_string_lossy(), &args)?;
            *chosen = Some(backend);
        }
        c.rebind(SocketAddr::new(client, 0))
    };
    let moved = ask_move_ask(lab.client(), client, vip, 18, drain_then_move).expect("move");
    let drained = drained.lock().unwrap().expect("a backend was drained");
    let kept = moved
        .iter()
        .filter(|(first, _)| *first == drained.to_string())
        .count();
    eprintln!("{test}: drained {drained}, which held {kept} of 18 connections");
    assert!(kept >= 1);
    assert_eq!(
        broken(&moved),
        Vec::<String>::new(),
        "after the drain and the move"
    );

    // New connections go elsewhere.
    let stay = |_: &QuicClient, _: &str| Ok(());
    let fresh = ask_move_ask(lab.client(), client, vip, 12, stay).expect("new connections");
    let counts = spread(&fresh);
    assert!(
        !counts.contains_key(&drained.to_string()),
        "a new connection reached the draining backend: {counts:?}"
    );
    let status = vip_status(&lab, "h3");
    let states: Vec<_> = status["backends"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|b| b["address"] == drained.to_string())
        .map(|b| b["state"].clone())
        .collect();
    assert_eq!(states, [serde_json::json!("draining")]);
}
