//! What `lb status` shows: the status model as the control socket sends it (`GET
//! /status`, JSON), and its rendering as a table for people.
//!
//! These are wire types: the agent fills them, the CLI (`client`, `top`) reads them, and
//! their JSON names are part of the contract. Enums serialize to the words the contract
//! names (`"draining"`, `"up"`, `"native"` ...).

use std::{collections::BTreeMap, fmt::Write};

use serde::{Deserialize, Serialize};

use crate::{
    config::{Forward, HashMode, Protocol},
    dataplane::AttachedMode,
    explain::{NextHop, VipTarget},
    model::{AdminStatus, CheckRecord, Health, weights::WeightReason},
};

/// How many heavy hitters status reports per VIP.
pub const TOP_SOURCES: usize = 10;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Status {
    pub dataplane: DataplaneStatus,
    pub vips: Vec<VipStatus>,
    /// Outcome counters of the program (`lb_common::stat::NAMES`), summed over CPUs.
    pub counters: BTreeMap<String, u64>,
    /// Announcing VIPs to routers (`[announce]`) and the node's drain state.
    #[serde(default)]
    pub node: NodeStatus,
    /// Sharing flows with other nodes (`[cluster]`); absent without it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster: Option<ClusterStatus>,
    /// The agent itself: what runs, since when, from which file, and its reloads.
    #[serde(default)]
    pub agent: AgentStatus,
}

/// The agent itself (`agent` in status; `lb_build_info` and the reload metrics).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct AgentStatus {
    /// lb's version (the package's).
    pub version: String,
    pub uptime_seconds: u64,
    /// The file `lb reload` reads.
    pub config_path: String,
    /// Reloads accepted and refused since the start.
    pub reloads_ok: u64,
    pub reloads_refused: u64,
    /// When the configuration was last loaded successfully (the start, then each
    /// accepted reload), in seconds since the Unix epoch.
    pub last_load_unix_seconds: u64,
    /// The last reload asked for, if any.
    pub last_reload: Option<LastReload>,
    /// Where the runtime changes are kept across restarts (`control.state_file`).
    #[serde(default)]
    pub state_file: String,
    /// The runtime changes in force (the running configuration's differences from the
    /// file, as the commands said them); a reload undoes them, a restart keeps them.
    #[serde(default)]
    pub runtime_changes: Vec<String>,
}

/// One reload's outcome.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LastReload {
    pub at_unix_seconds: u64,
    /// "ok" or "refused".
    pub result: String,
    /// Why it was refused.
    pub error: Option<String>,
}

/// `[cluster]`: the entries this node shares with its peers.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ClusterStatus {
    /// The address and port the node sends from and listens on.
    pub address: Option<String>,
    /// Learning before announcing: "not_needed" (the table was adopted), "waiting",
    /// "done", "timed_out".
    pub learning: String,
    /// Entries learned from the peers while learning.
    pub learned_at_start: u64,
    /// The transfer of each peer's table while learning (absent when nothing was
    /// learned at start).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub learn: Option<LearnStatus>,
    /// New entries the data path exported, and those it dropped (ring full).
    pub exported: u64,
    pub export_dropped: u64,
    /// New entries dropped because the send queue was full.
    pub queue_dropped: u64,
    /// Datagrams from addresses that are no peer.
    pub unknown_sender: u64,
    pub peers: Vec<PeerStatus>,
}

/// One cluster peer.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PeerStatus {
    pub address: String,
    /// Entries sent to it (new ones and dumps), in how many datagrams and bytes.
    pub sent: u64,
    pub datagrams_sent: u64,
    pub bytes_sent: u64,
    pub send_errors: u64,
    /// Entries received from it in accepted datagrams; of those, inserted here, and
    /// naming a VIP or backend this node lacks.
    pub received: u64,
    pub inserted: u64,
    pub unknown: u64,
    /// Datagrams from its address dropped (authentication, malformed, stale, replayed),
    /// and why the last one was.
    pub rejected: u64,
    pub last_reject: Option<String>,
    /// Seconds since its last accepted datagram; none yet: null.
    pub last_contact_seconds: Option<f64>,
    /// When that datagram came, in seconds since the Unix epoch; none yet: null. Peers
    /// send at least every `cluster::KEEPALIVE`, so an old time means a silent peer.
    #[serde(default)]
    pub last_seen_unix_seconds: Option<f64>,
}

/// The node's part in a multi-node deployment (`[announce]`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeStatus {
    /// VIPs are announced to routers (`[announce]` is configured).
    pub announcing: bool,
    /// `lb node drain`: every VIP is withdrawn until `lb node ready`.
    pub drained: bool,
    /// The kernel routing table and device of the announced routes.
    pub table: Option<u32>,
    pub device: Option<String>,
    /// Warm-up left before anything is announced (0 once over).
    pub warmup_left_seconds: f64,
    /// Addresses announced now (their routes are in the table).
    pub announced: Vec<String>,
    /// The last failure to write the routes, while it lasts.
    pub error: Option<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DataplaneStatus {
    pub interface: String,
    /// The interface's MAC; None while it is gone.
    pub interface_mac: Option<String>,
    /// The XDP mode actually attached; None while detached (the interface is gone).
    pub xdp_mode: Option<AttachedMode>,
    /// Why the data path is not attached, while it is not: the interface went away.
    /// The agent attaches again when an interface of that name returns.
    #[serde(default)]
    pub detached: Option<String>,
    /// `xdp_mode = "auto"` attached in generic mode: why native was refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub native_refused: Option<String>,
    pub maglev_table_size: u32,
    /// Connection-table entries in use at the agent's last scan: the same number as
    /// `conntrack_entries_in_use`, under its first name (kept for scripts; the config key
    /// of that name is the capacity).
    pub conntrack_entries: u64,
    /// Connection-table entries in use at the agent's last scan.
    #[serde(default)]
    pub conntrack_entries_in_use: u64,
    /// The connection table's size: the config's `dataplane.conntrack_entries`.
    #[serde(default)]
    pub conntrack_capacity: u64,
    /// How long ago that scan was (the agent scans every 2 s); None before the first.
    #[serde(default)]
    pub conntrack_scan_age_seconds: Option<f64>,
    /// How the agent found the data path at start: a [`Start`] in its words, shown as
    /// they are.
    pub start: String,
    /// Backend ids: how many the data path has room for (over all VIPs) ...
    #[serde(default)]
    pub backend_id_capacity: u32,
    /// ... how many backends hold one ...
    #[serde(default)]
    pub backend_ids_in_use: u32,
    /// ... and how many are held: freed by backends removed within the flow idle time,
    /// not handed out until it passes (an old flow's entry must not reach a new backend).
    #[serde(default)]
    pub backend_ids_held: u32,
    /// Every interface the program is attached to (`dataplane.interfaces`), in order.
    #[serde(default)]
    pub interfaces: Vec<InterfaceStatus>,
    /// `dataplane.next_program`: the host's program lb passes frames on to; None (null)
    /// without one.
    #[serde(default)]
    pub next_program: Option<NextProgramStatus>,
}

/// The program in `LB_NEXT`'s slot, as the kernel names it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NextProgramStatus {
    /// The pin `dataplane.next_program` names.
    pub path: String,
    /// Its name as the kernel knows it (15 characters at most).
    pub name: String,
    pub id: u32,
    /// The build of lb's program that tail-calls it: `lb_xdp` (multi-buffer aware) or
    /// `lb_xdp_1buf`.
    pub caller: String,
}

impl From<&crate::dataplane::next::NextProgram> for NextProgramStatus {
    fn from(next: &crate::dataplane::next::NextProgram) -> Self {
        Self {
            path: next.path.display().to_string(),
            name: next.name.clone(),
            id: next.id,
            caller: next.caller().to_string(),
        }
    }
}

/// One data-path interface.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct InterfaceStatus {
    pub name: String,
    /// Its MAC, the source of the frames that leave by it; None while it is gone.
    pub mac: Option<String>,
    /// The XDP mode attached on it; None while it is gone.
    pub xdp_mode: Option<AttachedMode>,
    /// Frames forwarded out of it (to backends); with one interface, every VIP's.
    pub forwarded_packets: u64,
    pub forwarded_bytes: u64,
}

/// How the agent found the data path at start. Status carries it as its words (its
/// `Display`, in `DataplaneStatus::start`): `"fresh"`, `"adopted"`, `"replaced (WHY);
/// connection table lost"`; nothing reads the words back into a `Start`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Start {
    /// Nothing was pinned: a new program and empty maps.
    Fresh,
    /// A previous agent's pinned program and maps: flows kept.
    Adopted,
    /// Pinned maps of another layout or size were replaced: their flows are lost.
    Replaced { why: String },
}

impl std::fmt::Display for Start {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Start::Fresh => f.write_str("fresh"),
            Start::Adopted => f.write_str("adopted"),
            Start::Replaced { why } => write!(f, "replaced ({why}); connection table lost"),
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct VipStatus {
    pub name: String,
    /// With `[announce]`: the VIP's address is announced to the routers now.
    #[serde(default)]
    pub announced: bool,
    /// Why (not): "announced", "withdrawn: <reason>", "not announced: no [announce]
    /// section".
    #[serde(default)]
    pub announcement: String,
    pub address: String,
    pub port: u16,
    pub protocol: Protocol,
    pub hash: HashMode,
    /// How packets reach the backends: "l2", "ipip" or "gue".
    #[serde(default)]
    pub forward: Forward,
    /// `forward = "gue"`: the backends' decapsulation port.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gue_port: Option<u16>,
    pub packets: u64,
    pub bytes: u64,
    pub new_flows: u64,
    /// Backends not failed by their checks and reachable (MAC known); backends in
    /// maintenance are not checked and count in neither of these.
    pub healthy_backends: usize,
    /// Backends failed by their checks or unreachable.
    pub unhealthy_backends: usize,
    /// New flows of the busiest in-table backend over the average, over the last sample
    /// interval (2 s); 0 when there were none. 1.0 is perfectly even.
    pub busiest_over_average: f64,
    /// The client sources that opened the most new flows over the last sample interval
    /// (heavy hitters), busiest first, at most `TOP_SOURCES`.
    pub top_sources: Vec<SourceRate>,
    /// With `hot_source_share`: the sources balanced per connection now, the busiest
    /// first, with their share of the VIP's new flows over the last sample.
    #[serde(default)]
    pub hot_sources: Vec<HotSource>,
    /// `quic = true`: short-header packets are routed by the server ID in their
    /// connection ID.
    #[serde(default)]
    pub quic: bool,
    /// Short-header packets sent to the backend their connection ID names (0 without
    /// `quic`).
    #[serde(default)]
    pub quic_routed_by_cid: u64,
    /// Short-header packets whose server ID named no serving backend (unknown, retired,
    /// or down): balanced as UDP.
    #[serde(default)]
    pub quic_cid_unknown: u64,
    /// `stable_slots = true`: TCP flows in slots no recent table change moved make no
    /// connection-table entries.
    #[serde(default)]
    pub stable_slots: bool,
    /// With `stable_slots`: the slots a table change moved, whose flows still make
    /// entries until a scan finds they may turn stable (0 without `stable_slots`).
    #[serde(default)]
    pub changed_slots: usize,
    /// With `stable_slots`: how long ago the connection table last turned over (every
    /// CPU made its share of `conntrack_entries` since): a changed slot whose last change
    /// came before may turn stable. None without `stable_slots`, or while it has not
    /// turned over since the agent started.
    #[serde(default)]
    pub turned_over_seconds_ago: Option<u64>,
    pub backends: Vec<BackendStatus>,
}

impl VipStatus {
    /// `VIP:PORT/PROTO` as the CLI takes it (`[fd00::100]:80/tcp` for IPv6).
    pub fn target(&self) -> String {
        match self.address.parse() {
            Ok(address) => VipTarget {
                address,
                port: self.port,
                protocol: self.protocol,
            }
            .to_string(),
            Err(_) => format!("{}:{}/{}", self.address, self.port, self.protocol),
        }
    }
}

/// A hot source of a VIP (`hot_source_share`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HotSource {
    pub address: String,
    /// Its share (0..=1) of the VIP's new flows over the last sample.
    pub share: f64,
}

impl HotSource {
    /// `10.0.0.1 (62%)`, as status and top print them.
    pub fn list(sources: &[HotSource]) -> String {
        sources
            .iter()
            .map(|s| format!("{} ({:.0}%)", s.address, s.share * 100.0))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SourceRate {
    pub address: String,
    pub new_flows_per_second: f64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BackendStatus {
    pub address: String,
    pub weight: u32,
    pub state: AdminStatus,
    /// "up", "down" or "unknown" (not checked: `kind = "none"`, or in maintenance).
    pub health: Health,
    pub mac: Option<String>,
    /// Where its frames go: the backend itself (on-link), or the gateway of its route
    /// (tunnelled), with the MAC used; None while a tunnelled backend has no route out
    /// of the interface.
    #[serde(default)]
    pub next_hop: Option<NextHop>,
    /// Takes new flows now.
    pub in_table: bool,
    /// Maglev slots held.
    pub slots: usize,
    /// Connection-table entries that saw a packet within `flow_idle_timeout`.
    pub active_flows: u64,
    pub packets: u64,
    pub bytes: u64,
    pub new_flows: u64,
    /// What its checks test ("tcp port 80", "dns port 53 (NS .)"); none when unchecked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub check: Option<String>,
    /// Consecutive check results agreeing with the last one.
    pub consecutive: u32,
    pub last_check: Option<CheckRecord>,
    /// Checks that failed for a reason of this host (file descriptors, buffers, source
    /// addresses, routes): not counted toward rise/fall. Since the agent started.
    #[serde(default)]
    pub local_check_errors: u64,
    /// The last of them.
    #[serde(default)]
    pub last_local_error: Option<CheckRecord>,
    /// New flows per second over the last sample interval.
    pub new_flows_per_second: f64,
    /// The weight new flows are shared by now, in units of the configured weight.
    #[serde(default)]
    pub effective_weight: f64,
    /// Why it differs from the configured weight: "configured", "slow start 40%",
    /// "agent 75%", "least-flows 1.41x".
    #[serde(default)]
    pub weight_reason: WeightReason,
    /// Why the backend's last agent answer was not used (`[vip.agent]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_error: Option<String>,
    /// Why its state or health is not what the file and the runtime commands make it:
    /// its agent check's word ("agent check says drain"); absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state_reason: Option<String>,
    /// TCP handshakes the data path counted for it (`lb_common::handshake`).
    #[serde(default)]
    pub handshakes: Handshakes,
    /// Passive health, with `[vip.outlier]` (null without).
    #[serde(default)]
    pub outlier: Option<OutlierStatus>,
    /// With the VIP's `quic`: the server ID its connection IDs carry (null otherwise).
    #[serde(default)]
    pub server_id: Option<u64>,
}

/// A backend's TCP handshakes since the data path counted them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Handshakes {
    /// First SYNs of flows sent to it (spoofed ones included).
    pub started: u64,
    /// Flows whose SYN the client had to send again (their first attempt failed).
    pub retried: u64,
    /// Flows whose first ACK came: the handshake completed.
    pub completed: u64,
}

/// Passive health of a backend (`[vip.outlier]`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct OutlierStatus {
    /// Handshakes judged in the window (seen twice: completed, or retried).
    pub started: u64,
    /// Of those, completed.
    pub completed: u64,
    /// While ejected: until when (seconds since the Unix epoch); null in the table.
    pub ejected_until: Option<f64>,
    /// Why it was last ejected ("12 of 40 handshakes completed in 10s; peers 100%").
    pub reason: Option<String>,
    /// Ejections since the agent started.
    pub ejections: u64,
}

fn render_cluster(out: &mut String, cluster: &ClusterStatus) {
    let _ = writeln!(
        out,
        "cluster: {}, learning {} ({} entries learned at start), exported {} (dropped {} \
         in the ring, {} in the queue), {} datagrams from unknown senders",
        cluster.address.as_deref().unwrap_or("?"),
        cluster.learning.replace('_', " "),
        cluster.learned_at_start,
        cluster.exported,
        cluster.export_dropped,
        cluster.queue_dropped,
        cluster.unknown_sender
    );
    if let Some(learn) = &cluster.learn {
        let _ = writeln!(out, "  learning: {learn}");
    }
    for peer in &cluster.peers {
        let contact = match peer.last_contact_seconds {
            Some(age) => format!("{age:.1}s ago"),
            None => "never".to_string(),
        };
        let _ = writeln!(
            out,
            "  peer {}: sent {}, received {}, inserted {}, unknown {}, rejected {}{}, \
             last contact {contact}",
            peer.address,
            peer.sent,
            peer.received,
            peer.inserted,
            peer.unknown,
            peer.rejected,
            peer.last_reject
                .as_deref()
                .map(|why| format!(" (last: {why})"))
                .unwrap_or_default()
        );
    }
}

/// The status as a table for people.
pub fn render(status: &Status) -> String {
    let mut out = String::new();
    render_dataplane(&mut out, status);
    for vip in &status.vips {
        render_vip(&mut out, vip, status.node.announcing);
    }
    render_runtime_changes(&mut out, &status.agent);
    let nonzero: Vec<String> = status
        .counters
        .iter()
        .filter(|(_, v)| **v > 0)
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    let _ = writeln!(
        out,
        "\ncounters: {}",
        if nonzero.is_empty() {
            "none yet".into()
        } else {
            nonzero.join(" ")
        }
    );
    out
}

/// The runtime changes in force, when there are any.
fn render_runtime_changes(out: &mut String, agent: &AgentStatus) {
    if agent.runtime_changes.is_empty() {
        return;
    }
    let _ = writeln!(
        out,
        "\nruntime changes (kept across restarts in {}; a reload undoes them): {}",
        agent.state_file,
        agent.runtime_changes.join("; ")
    );
}

fn render_dataplane(out: &mut String, status: &Status) {
    let d = &status.dataplane;
    let scanned = match d.conntrack_scan_age_seconds {
        Some(age) => format!(
            "{} of {} connection-table entries in use {age:.1}s ago",
            d.conntrack_entries_in_use, d.conntrack_capacity
        ),
        None => "connection table not scanned yet".to_string(),
    };
    let attached = match (&d.detached, &d.interface_mac, d.xdp_mode) {
        (Some(why), ..) => format!("DETACHED: {why}"),
        (None, Some(mac), Some(mode)) => format!("({mac}) xdp mode {mode}"),
        (None, ..) => "(?)".to_string(),
    };
    let _ = writeln!(
        out,
        "data path: {} {attached}, maglev table {} slots, {scanned}",
        d.interface, d.maglev_table_size
    );
    if d.interfaces.len() > 1 {
        for i in &d.interfaces {
            let how = match (&i.mac, i.xdp_mode) {
                (Some(mac), Some(mode)) => format!("({mac}) xdp mode {mode}"),
                _ => "GONE: its backends are out of service until it returns".to_string(),
            };
            let _ = writeln!(
                out,
                "  interface {} {how}, {} frames ({} bytes) forwarded out",
                i.name, i.forwarded_packets, i.forwarded_bytes
            );
        }
    }
    let _ = writeln!(out, "start: {}", d.start);
    if d.backend_id_capacity > 0 {
        let _ = writeln!(
            out,
            "backend ids: {} in use, {} held (backends removed within the flow idle time), \
             {} free, of {}",
            d.backend_ids_in_use,
            d.backend_ids_held,
            d.backend_id_capacity
                .saturating_sub(d.backend_ids_in_use + d.backend_ids_held),
            d.backend_id_capacity
        );
    }
    if let Some(why) = &d.native_refused {
        let _ = writeln!(out, "native xdp refused: {why}");
    }
    if let Some(next) = &d.next_program {
        let _ = writeln!(
            out,
            "next program: {} (id {}) at {}, tail-called by {} with every frame lb passes",
            next.name, next.id, next.path, next.caller
        );
    }
    if let Some(cluster) = &status.cluster {
        render_cluster(out, cluster);
    }
    let node = &status.node;
    if node.announcing {
        let _ = writeln!(
            out,
            "node: {}, announcing through table {} (device {}): {}{}{}",
            if node.drained { "DRAINED" } else { "ready" },
            node.table.unwrap_or_default(),
            node.device.as_deref().unwrap_or("?"),
            if node.announced.is_empty() {
                "nothing announced".to_string()
            } else {
                node.announced.join(", ")
            },
            if node.warmup_left_seconds > 0.0 {
                format!(" (warm-up: {:.1}s left)", node.warmup_left_seconds)
            } else {
                String::new()
            },
            node.error
                .as_deref()
                .map(|e| format!("; error: {e}"))
                .unwrap_or_default()
        );
    }
}

fn render_vip(out: &mut String, vip: &VipStatus, announcing: bool) {
    let _ = writeln!(
        out,
        "\nvip {} {} hash {} forward {}: {} healthy, {} unhealthy, {} packets, {} new flows",
        vip.name,
        vip.target(),
        vip.hash,
        match vip.gue_port {
            Some(port) => format!("{} (port {port})", vip.forward),
            None => vip.forward.to_string(),
        },
        vip.healthy_backends,
        vip.unhealthy_backends,
        vip.packets,
        vip.new_flows
    );
    if announcing {
        let _ = writeln!(out, "  announcement: {}", vip.announcement);
    }
    // New flows over the last sample interval: where a hot spot shows.
    let _ = writeln!(
        out,
        "  busiest backend / average new flows: {}; top sources: {}",
        if vip.busiest_over_average > 0.0 {
            format!("{:.2}", vip.busiest_over_average)
        } else {
            "- (no new flows in the last sample)".to_string()
        },
        if vip.top_sources.is_empty() {
            "none".to_string()
        } else {
            vip.top_sources
                .iter()
                .map(|s| format!("{} {:.1}/s", s.address, s.new_flows_per_second))
                .collect::<Vec<_>>()
                .join(", ")
        }
    );
    if !vip.hot_sources.is_empty() {
        let _ = writeln!(
            out,
            "  hot sources (balanced per connection): {}",
            HotSource::list(&vip.hot_sources)
        );
    }
    if vip.quic {
        let _ = writeln!(
            out,
            "  quic: {} packets routed by connection ID, {} with an unknown server ID",
            vip.quic_routed_by_cid, vip.quic_cid_unknown
        );
    }
    if vip.stable_slots {
        let turned_over = match vip.turned_over_seconds_ago {
            Some(seconds) => format!("last turned over {seconds}s ago"),
            None => "has not turned over since the agent started".to_string(),
        };
        let _ = writeln!(
            out,
            "  stable slots: {} changed slots (their flows make entries until the connection \
             table has turned over since their change; it {turned_over})",
            vip.changed_slots
        );
    }
    let _ = writeln!(
        out,
        "  {:<40} {:>6} {:<9} {:<8} {:<17} {:>6} {:>7} {:>10} {:>12} {:>9}  last check",
        "backend",
        "weight",
        "state",
        "health",
        "mac",
        "slots",
        "flows",
        "packets",
        "bytes",
        "new_flows"
    );
    for b in &vip.backends {
        render_backend(out, b);
    }
}

/// A backend's passive health, under its line: the window's handshakes, and an ejection.
fn render_outlier(out: &mut String, o: &OutlierStatus) {
    let mut line = format!(
        "    handshakes: {} of {} completed in the window",
        o.completed, o.started
    );
    match (o.ejected_until, &o.reason) {
        (Some(until), Some(reason)) => {
            let left = until - crate::status::unix_now();
            line += &format!("; EJECTED for {:.0}s more: {reason}", left.max(0.0));
        }
        (None, Some(reason)) if o.ejections > 0 => {
            line += &format!("; ejected {}x, last: {reason}", o.ejections);
        }
        _ => {}
    }
    let _ = writeln!(out, "{line}");
}

/// Now, in seconds since the Unix epoch.
pub fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// One backend's line, and the lines under it that say more when there is more to say.
fn render_backend(out: &mut String, b: &BackendStatus) {
    let mut check = match &b.last_check {
        _ if b.state == AdminStatus::Maint => "unchecked (maint)".to_string(),
        None => "-".to_string(),
        Some(c) if c.ok => format!("ok {:.1}ms", c.latency_ms),
        Some(c) => format!("failed: {}", c.error.as_deref().unwrap_or("?")),
    };
    if let Some(local) = &b.last_local_error {
        check += &format!(
            "; {} local check error(s), last: {}",
            b.local_check_errors,
            local.error.as_deref().unwrap_or("?")
        );
    }
    let _ = writeln!(
        out,
        "  {:<40} {:>6} {:<9} {:<8} {:<17} {:>6} {:>7} {:>10} {:>12} {:>9}  {}",
        b.address,
        b.weight,
        b.state,
        b.health,
        b.mac.as_deref().unwrap_or("unresolved"),
        b.slots,
        b.active_flows,
        b.packets,
        b.bytes,
        b.new_flows,
        check
    );
    if !b.weight_reason.is_configured() {
        let _ = writeln!(
            out,
            "    effective weight {:.2}: {}",
            b.effective_weight, b.weight_reason
        );
    }
    if let Some(reason) = &b.state_reason {
        let _ = writeln!(out, "    {} because {reason}", b.state);
    }
    if let Some(error) = &b.agent_error {
        let _ = writeln!(out, "    agent check: {error}");
    }
    if let Some(outlier) = &b.outlier {
        render_outlier(out, outlier);
    }
    if let Some(id) = b.server_id {
        let _ = writeln!(out, "    quic server_id {id}");
    }
    // An on-link backend is its own next hop: only a router is news.
    match &b.next_hop {
        Some(hop) if hop.address != b.address => {
            let _ = writeln!(
                out,
                "    next hop {} ({})",
                hop.address,
                hop.mac.as_deref().unwrap_or("unresolved")
            );
        }
        Some(_) => {}
        None => {
            let _ = writeln!(out, "    next hop: none (no route out of the interface)");
        }
    }
}

#[cfg(test)]
pub mod tests {
    use super::*;

    #[test]
    fn the_cluster_line_names_each_peer_and_its_counts() {
        let mut status = sample();
        assert!(!render(&status).contains("cluster:"));
        status.cluster = Some(ClusterStatus {
            address: Some("10.0.0.11:4790".into()),
            learning: "timed_out".into(),
            peers: vec![PeerStatus {
                address: "10.0.0.12".into(),
                sent: 40,
                received: 7,
                inserted: 6,
                rejected: 1,
                last_reject: Some("a replay".into()),
                ..Default::default()
            }],
            ..Default::default()
        });
        let text = render(&status);
        assert!(
            text.contains("cluster: 10.0.0.11:4790, learning timed out")
                && text.contains(
                    "peer 10.0.0.12: sent 40, received 7, inserted 6, unknown 0, rejected 1 \
                     (last: a replay), last contact never"
                ),
            "{text}"
        );
    }

    /// A status as an agent with one VIP and two backends sends it.
    pub fn sample() -> Status {
        let backend = |address: &str| BackendStatus {
            address: address.into(),
            weight: 1,
            state: AdminStatus::Ready,
            health: Health::Up,
            mac: Some("02:00:00:00:00:0b".into()),
            next_hop: Some(NextHop {
                address: address.into(),
                mac: Some("02:00:00:00:00:0b".into()),
            }),
            in_table: true,
            slots: 3,
            active_flows: 0,
            packets: 0,
            bytes: 0,
            new_flows: 0,
            check: Some("tcp port 80".into()),
            consecutive: 2,
            last_check: None,
            local_check_errors: 0,
            last_local_error: None,
            new_flows_per_second: 0.0,
            effective_weight: 1.0,
            weight_reason: WeightReason::Configured,
            agent_error: None,
            handshakes: Handshakes::default(),
            outlier: None,
            state_reason: None,
            server_id: None,
        };
        Status {
            dataplane: DataplaneStatus {
                interface: "eth0".into(),
                interface_mac: Some("02:00:00:00:00:01".into()),
                xdp_mode: Some(AttachedMode::Generic),
                detached: None,
                native_refused: None,
                maglev_table_size: 7,
                conntrack_entries: 0,
                conntrack_entries_in_use: 0,
                conntrack_capacity: 4096,
                conntrack_scan_age_seconds: None,
                start: Start::Fresh.to_string(),
                backend_id_capacity: 4096,
                backend_ids_in_use: 2,
                backend_ids_held: 0,
                interfaces: Vec::new(),
                next_program: None,
            },
            vips: vec![VipStatus {
                name: "web".into(),
                announced: false,
                announcement: String::new(),
                address: "10.0.0.100".into(),
                port: 80,
                protocol: Protocol::Tcp,
                hash: HashMode::FiveTuple,
                forward: Forward::L2,
                gue_port: None,
                packets: 0,
                bytes: 0,
                new_flows: 0,
                healthy_backends: 2,
                unhealthy_backends: 0,
                busiest_over_average: 0.0,
                top_sources: Vec::new(),
                hot_sources: Vec::new(),
                quic: false,
                quic_routed_by_cid: 0,
                quic_cid_unknown: 0,
                stable_slots: false,
                changed_slots: 0,
                turned_over_seconds_ago: None,
                backends: vec![backend("10.0.0.11"), backend("10.0.0.12")],
            }],
            counters: BTreeMap::new(),
            node: NodeStatus::default(),
            cluster: None,
            agent: AgentStatus::default(),
        }
    }

    #[test]
    fn a_quic_vip_shows_its_counters_and_server_ids() {
        let mut status = sample();
        let text = render(&status);
        assert!(
            !text.contains("quic"),
            "no quic lines without quic:\n{text}"
        );
        let vip = &mut status.vips[0];
        (vip.quic, vip.quic_routed_by_cid, vip.quic_cid_unknown) = (true, 1234, 5);
        vip.backends[1].server_id = Some(8);
        let text = render(&status);
        assert!(
            text.contains(
                "quic: 1234 packets routed by connection ID, 5 with an unknown server ID"
            ),
            "{text}"
        );
        assert!(text.contains("    quic server_id 8\n"), "{text}");
        let json = serde_json::to_value(&status).unwrap();
        assert_eq!(
            json["vips"][0]["backends"][0]["server_id"],
            serde_json::Value::Null
        );
        assert_eq!(json["vips"][0]["backends"][1]["server_id"], 8);
    }

    #[test]
    fn a_vip_with_stable_slots_shows_its_changed_slots() {
        let mut status = sample();
        let text = render(&status);
        assert!(!text.contains("stable slots"), "{text}");
        let json = serde_json::to_value(&status).unwrap();
        assert_eq!(json["vips"][0]["stable_slots"], false);
        assert_eq!(json["vips"][0]["changed_slots"], 0);
        (status.vips[0].stable_slots, status.vips[0].changed_slots) = (true, 12);
        let text = render(&status);
        assert!(text.contains("  stable slots: 12 changed slots"), "{text}");
        assert!(
            text.contains("has not turned over since the agent started"),
            "{text}"
        );
        let json = serde_json::to_value(&status).unwrap();
        assert_eq!(json["vips"][0]["stable_slots"], true);
        assert_eq!(json["vips"][0]["changed_slots"], 12);
        assert_eq!(
            json["vips"][0]["turned_over_seconds_ago"],
            serde_json::Value::Null
        );
        status.vips[0].turned_over_seconds_ago = Some(42);
        assert!(render(&status).contains("it last turned over 42s ago"));
        let json = serde_json::to_value(&status).unwrap();
        assert_eq!(json["vips"][0]["turned_over_seconds_ago"], 42);
    }

    #[test]
    fn the_table_for_people_has_what_status_promises() {
        let mut status = sample();
        status.vips[0].busiest_over_average = 1.25;
        status.vips[0].top_sources = vec![SourceRate {
            address: "10.0.0.1".into(),
            new_flows_per_second: 12.5,
        }];
        let text = render(&status);
        assert!(
            text.contains("connection table not scanned yet"),
            "before the first scan:\n{text}"
        );
        status.dataplane.conntrack_scan_age_seconds = Some(0.5);
        status.dataplane.conntrack_entries = 7;
        status.dataplane.conntrack_entries_in_use = 7;
        status.vips[0].busiest_over_average = 0.0;
        let quiet = render(&status);
        assert!(
            quiet.contains("7 of 4096 connection-table entries in use 0.5s ago"),
            "{quiet}"
        );
        assert!(
            quiet.contains("new flows: - (no new flows in the last sample)"),
            "{quiet}"
        );
        assert!(
            text.contains("data path: eth0 (02:00:00:00:00:01) xdp mode generic"),
            "{text}"
        );
        assert!(
            !text.contains("  interface "),
            "one interface: no list\n{text}"
        );
        let port = |name: &str, mac: Option<&str>| InterfaceStatus {
            name: name.into(),
            mac: mac.map(String::from),
            xdp_mode: mac.map(|_| AttachedMode::Native),
            forwarded_packets: 3,
            forwarded_bytes: 180,
        };
        let mut two = status.clone();
        two.dataplane.interfaces =
            vec![port("eth0", Some("02:00:00:00:00:01")), port("eth1", None)];
        let listed = render(&two);
        for line in [
            "  interface eth0 (02:00:00:00:00:01) xdp mode native, 3 frames (180 bytes) forwarded out",
            "  interface eth1 GONE: its backends are out of service until it returns, 3 frames",
        ] {
            assert!(listed.contains(line), "{line}\n{listed}");
        }
        for line in [
            "start: fresh",
            "vip web 10.0.0.100:80/tcp hash 5-tuple",
            "busiest backend / average new flows: 1.25; top sources: 10.0.0.1 12.5/s",
            "10.0.0.11",
            "10.0.0.12",
            "counters: ",
        ] {
            assert!(text.contains(line), "no {line:?} in:\n{text}");
        }
    }

    #[test]
    fn a_load_rule_shows_its_effective_weight() {
        let mut status = sample();
        status.vips[0].backends[0].effective_weight = 0.4;
        status.vips[0].backends[0].weight_reason = WeightReason::Rules("slow start 40%".into());
        status.vips[0].backends[1].agent_error = Some("agent 10.0.0.12:4500: refused".into());
        status.vips[0].backends[0].state = AdminStatus::Draining;
        status.vips[0].backends[0].state_reason = Some("agent check says drain".into());
        status.dataplane.backend_ids_held = 1000;
        let text = render(&status);
        assert!(
            text.contains("    draining because agent check says drain\n"),
            "{text}"
        );
        assert!(
            text.contains("backend ids: 2 in use, 1000 held (backends removed within the flow idle time), 3094 free, of 4096"),
            "{text}"
        );
        assert!(
            text.contains("effective weight 0.40: slow start 40%"),
            "{text}"
        );
        assert!(
            text.contains("agent check: agent 10.0.0.12:4500: refused"),
            "{text}"
        );
        assert_eq!(text.matches("effective weight").count(), 1, "{text}");
    }

    #[test]
    fn a_tunnelled_vip_shows_its_forward_kind_and_routed_next_hops() {
        let mut status = sample();
        let plain = render(&status);
        assert!(plain.contains("hash 5-tuple forward l2:"), "{plain}");
        assert!(!plain.contains("next hop"), "on-link: {plain}");
        let vip = &mut status.vips[0];
        vip.forward = Forward::Gue;
        vip.gue_port = Some(6080);
        vip.backends[0].next_hop = Some(NextHop {
            address: "10.0.0.1".into(),
            mac: Some("02:00:00:00:00:fe".into()),
        });
        vip.backends[1].next_hop = None;
        let text = render(&status);
        for line in [
            "forward gue (port 6080):",
            "    next hop 10.0.0.1 (02:00:00:00:00:fe)",
            "    next hop: none (no route out of the interface)",
        ] {
            assert!(text.contains(line), "no {line:?} in:\n{text}");
        }
        let json = serde_json::to_value(&status).unwrap();
        assert_eq!(json["vips"][0]["forward"], "gue");
        assert_eq!(
            json["vips"][0]["backends"][0]["next_hop"]["address"],
            "10.0.0.1"
        );
        assert_eq!(
            json["vips"][0]["backends"][0]["next_hop"]["mac"],
            "02:00:00:00:00:fe"
        );
        assert!(json["vips"][0]["backends"][1]["next_hop"].is_null());
    }

    #[test]
    fn runtime_changes_are_listed_with_their_state_file() {
        let mut status = sample();
        assert!(!render(&status).contains("runtime changes"));
        status.agent.state_file = "/run/lb/lb.state.json".into();
        status.agent.runtime_changes = vec!["10.0.0.100:80/tcp backend 10.0.0.11 -> drain".into()];
        let text = render(&status);
        assert!(
            text.contains(
                "runtime changes (kept across restarts in /run/lb/lb.state.json; a reload \
                 undoes them): 10.0.0.100:80/tcp backend 10.0.0.11 -> drain\n"
            ),
            "{text}"
        );
    }

    #[test]
    fn an_ipv6_vip_is_printed_as_the_cli_takes_it() {
        let mut status = sample();
        status.vips[0].address = "fd00::100".into();
        let text = render(&status);
        assert!(text.contains("vip web [fd00::100]:80/tcp hash"), "{text}");
        let target: VipTarget = status.vips[0].target().parse().unwrap();
        assert_eq!(target.address.to_string(), "fd00::100");
    }

    #[test]
    fn a_detached_data_path_says_so_and_shows_no_stale_mac() {
        let mut status = sample();
        status.dataplane.detached = Some("interface eth0 is gone".into());
        status.dataplane.interface_mac = None;
        status.dataplane.xdp_mode = None;
        let text = render(&status);
        assert!(
            text.contains("data path: eth0 DETACHED: interface eth0 is gone, maglev"),
            "{text}"
        );
        assert!(!text.contains("02:00:00:00:00:01"), "{text}");
        let json = serde_json::to_value(&status).unwrap();
        assert_eq!(json["dataplane"]["xdp_mode"], serde_json::Value::Null);
        assert_eq!(json["dataplane"]["detached"], "interface eth0 is gone");
    }

    #[test]
    fn status_of_an_older_agent_still_parses() {
        // Before `detached`, `local_check_errors` and `last_local_error` existed.
        let mut json = serde_json::to_value(sample()).unwrap();
        json["dataplane"]
            .as_object_mut()
            .unwrap()
            .remove("detached");
        let backend = json["vips"][0]["backends"][0].as_object_mut().unwrap();
        backend.remove("local_check_errors");
        backend.remove("last_local_error");
        backend.insert(
            "last_check".into(),
            serde_json::json!({"ok": false, "latency_ms": 1.0, "error": "refused"}),
        );
        let status: Status = serde_json::from_value(json).unwrap();
        assert_eq!(status.dataplane.detached, None);
        let backend = &status.vips[0].backends[0];
        assert_eq!(backend.local_check_errors, 0);
        assert_eq!(backend.last_check.as_ref().map(|c| c.local), Some(false));
    }

    #[test]
    fn enums_keep_their_json_words() {
        let mut status = sample();
        status.vips[0].backends[1].state = AdminStatus::Draining;
        status.vips[0].backends[1].health = Health::Unknown;
        status.dataplane.start = Start::Replaced {
            why: "map layout 5, this program has 6".into(),
        }
        .to_string();
        let json = serde_json::to_value(&status).unwrap();
        assert_eq!(json["dataplane"]["xdp_mode"], "generic");
        assert_eq!(
            json["dataplane"]["start"],
            "replaced (map layout 5, this program has 6); connection table lost"
        );
        assert_eq!(json["vips"][0]["protocol"], "tcp");
        assert_eq!(json["vips"][0]["hash"], "5-tuple");
        assert_eq!(json["vips"][0]["backends"][0]["state"], "ready");
        assert_eq!(json["vips"][0]["backends"][0]["health"], "up");
        assert_eq!(json["vips"][0]["backends"][1]["state"], "draining");
        assert_eq!(json["vips"][0]["backends"][1]["health"], "unknown");
        let back: Status = serde_json::from_value(json).unwrap();
        assert_eq!(back.dataplane.start, status.dataplane.start);
        assert_eq!(back.vips[0].backends[1].state, AdminStatus::Draining);
    }

    #[test]
    fn auto_mode_says_why_native_was_refused() {
        let mut status = sample();
        assert!(!render(&status).contains("refused"));
        let json = serde_json::to_value(&status).unwrap();
        assert!(json["dataplane"].get("native_refused").is_none(), "{json}");
        // An older agent's answer (no field) still reads.
        let back: Status = serde_json::from_value(json).unwrap();
        assert_eq!(back.dataplane.native_refused, None);
        status.dataplane.native_refused = Some("the veth peer p-lb has no XDP program".into());
        let text = render(&status);
        assert!(
            text.contains("native xdp refused: the veth peer p-lb has no XDP program"),
            "{text}"
        );
        let json = serde_json::to_value(&status).unwrap();
        assert_eq!(
            json["dataplane"]["native_refused"],
            "the veth peer p-lb has no XDP program"
        );
    }
}

// ---- `[cluster]`: a joining node learning its peers' tables ----

/// Where a learning node stands with one peer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PeerLearnState {
    /// Asking (connecting, or waiting for the first answer).
    #[default]
    Asking,
    /// Entries arriving.
    Receiving,
    /// Every entry of its table came.
    Done,
    /// Nothing came from it for `learn_timeout`: given up.
    NoAnswer,
}

impl PeerLearnState {
    pub fn is_final(self) -> bool {
        matches!(self, PeerLearnState::Done | PeerLearnState::NoAnswer)
    }
}

/// Learning from one peer, as status shows it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PeerLearn {
    pub address: String,
    pub state: PeerLearnState,
    /// Entries of its table received so far, and how many it has (once it said).
    pub received: u64,
    pub total: Option<u64>,
    /// Of those received, inserted here (the others: the flow had an entry here, or
    /// this node lacks the VIP or backend).
    pub inserted: u64,
    /// Connections that broke and were resumed.
    pub resumed: u32,
    /// Since the first request; the whole transfer once done.
    pub seconds: f64,
}

/// Learning from all peers: `cluster.learn` in status.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LearnStatus {
    pub received: u64,
    pub total: u64,
    pub inserted: u64,
    pub peers: Vec<PeerLearn>,
}

impl std::fmt::Display for LearnStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "learned {} of {} ({} new here)",
            thousands(self.received),
            thousands(self.total),
            thousands(self.inserted)
        )?;
        for p in &self.peers {
            let total = p.total.map_or("?".into(), thousands);
            write!(
                f,
                "; {} {} {} of {total} in {:.1}s",
                p.address,
                serde_json::to_value(p.state)
                    .ok()
                    .and_then(|v| v.as_str().map(|s| s.replace('_', " ")))
                    .unwrap_or_default(),
                thousands(p.received),
                p.seconds
            )?;
            if p.resumed > 0 {
                write!(f, " (resumed {})", p.resumed)?;
            }
        }
        Ok(())
    }
}

/// `n` with thousands separated: "100,140".
pub fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}
