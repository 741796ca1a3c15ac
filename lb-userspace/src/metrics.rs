//! Prometheus metrics at `control.metrics` (`GET /metrics`): OpenMetrics text to a
//! scraper that asks for it (Prometheus does), else the classic Prometheus text format
//! (0.0.4), which every other scraper and script reads.
//!
//! Counters of the data path are summed over CPUs from the BPF maps at scrape time, so
//! every scrape is exact and nothing is counted twice in userspace. Health-check
//! durations and transitions are observed by the agent as they happen.

use std::{net::SocketAddr, sync::Arc};

use anyhow::Context;
use axum::{Router, extract::State, http::StatusCode, response::IntoResponse, routing::get};
use lb_common::stat;
use prometheus_client::{
    encoding::{EncodeLabelSet, text::encode},
    metrics::{counter::Counter, family::Family, gauge::Gauge, histogram::Histogram},
    registry::Registry,
};
use tokio_util::sync::CancellationToken;

use crate::{
    model::{AdminStatus, Health},
    status::Status,
};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct VipLabels {
    pub vip: String,
}

/// A check's duration is labelled by its VIP and its kind.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CheckLabels {
    pub vip: String,
    /// "tcp", "http", "https", "udp" or "dns".
    pub kind: String,
}

/// The kinds that run checks (`none` runs none), for dropping a VIP's series.
const CHECK_KINDS: [&str; 5] = ["tcp", "http", "https", "udp", "dns"];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BackendLabels {
    pub vip: String,
    pub backend: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PeerLabels {
    peer: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TransitionLabels {
    pub vip: String,
    pub backend: String,
    /// "up" or "down".
    pub to: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabels {
    vip: String,
    backend: String,
    state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ActionLabels {
    action: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: String,
}

/// Metrics the agent observes over time (the rest is read at scrape time).
#[derive(Clone)]
pub struct Observed {
    pub check_duration: Family<CheckLabels, Histogram>,
    pub transitions: Family<TransitionLabels, Counter>,
}

impl Default for Observed {
    fn default() -> Self {
        Self {
            check_duration: Family::new_with_constructor(|| {
                // 0.5 ms .. ~4 s: loopback-fast checks up to timeouts.
                Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(
                    0.0005, 2.0, 14,
                ))
            }),
            transitions: Family::default(),
        }
    }
}

impl Observed {
    /// Drops the series of VIPs (by name) and backends (VIP name, address) that are
    /// gone, so that their series leave the exposition with them.
    pub fn forget(&self, vips: &[String], backends: &[(String, String)]) {
        for vip in vips {
            for kind in CHECK_KINDS {
                self.check_duration.remove(&CheckLabels {
                    vip: vip.clone(),
                    kind: kind.into(),
                });
            }
        }
        for (vip, backend) in backends {
            for to in ["up", "down"] {
                self.transitions.remove(&TransitionLabels {
                    vip: vip.clone(),
                    backend: backend.clone(),
                    to: to.into(),
                });
            }
        }
    }
}

/// A labelled metric family, registered under `name`.
fn family<L, M>(registry: &mut Registry, name: &str, help: &str) -> Family<L, M>
where
    L: EncodeLabelSet + Clone + std::hash::Hash + Eq + std::fmt::Debug + Send + Sync + 'static,
    M: prometheus_client::encoding::EncodeMetric
        + prometheus_client::metrics::TypedMetric
        + Default
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
{
    let family = Family::<L, M>::default();
    registry.register(name, help, family.clone());
    family
}

/// What one scrape renders: the status, the program's outcome counters (indexed by
/// `lb_common::stat`), and what the agent observed.
pub struct Scrape {
    pub status: Status,
    pub outcomes: Vec<u64>,
    pub observed: Observed,
}

/// The metrics text of one scrape.
pub fn render(scrape: &Scrape) -> anyhow::Result<String> {
    let mut registry = Registry::with_prefix("lb");
    register_vips(&mut registry, &scrape.status);
    register_backends(&mut registry, &scrape.status);
    register_handshakes(&mut registry, &scrape.status);
    register_outcomes(&mut registry, &scrape.outcomes);
    if let Some(cluster) = &scrape.status.cluster {
        register_cluster(&mut registry, cluster);
    }
    let dataplane = &scrape.status.dataplane;
    for (name, help, value) in [
        (
            "conntrack_entries",
            "Connection-table entries in use at the last scan",
            dataplane.conntrack_entries_in_use,
        ),
        (
            "conntrack_capacity",
            "Connection-table size (dataplane.conntrack_entries)",
            dataplane.conntrack_capacity,
        ),
    ] {
        let gauge = Gauge::<i64>::default();
        gauge.set(value as i64);
        registry.register(name, help, gauge);
    }
    register_agent(&mut registry, &scrape.status.agent);
    register_interfaces(&mut registry, &dataplane.interfaces);
    register_next_program(&mut registry, dataplane.next_program.as_ref());
    registry.register(
        "health_check_duration_seconds",
        "Duration of health checks",
        scrape.observed.check_duration.clone(),
    );
    registry.register(
        "health_transitions",
        "Backend health changes",
        scrape.observed.transitions.clone(),
    );
    let mut text = String::new();
    encode(&mut text, &registry).context("encoding metrics")?;
    Ok(text)
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct InterfaceLabels {
    interface: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct InterfaceModeLabels {
    interface: String,
    /// "native" or "generic".
    mode: String,
}

/// Each data-path interface: what left by it, and whether (and how) it is attached.
fn register_interfaces(registry: &mut Registry, interfaces: &[crate::status::InterfaceStatus]) {
    let packets = family::<InterfaceLabels, Counter>(
        registry,
        "interface_forwarded_packets",
        "Frames forwarded out of a data-path interface",
    );
    let bytes = family::<InterfaceLabels, Counter>(
        registry,
        "interface_forwarded_bytes",
        "Bytes forwarded out of a data-path interface",
    );
    let attached = family::<InterfaceModeLabels, Gauge>(
        registry,
        "interface_attached",
        "1 while the program is attached to the interface, in this XDP mode",
    );
    for interface in interfaces {
        let labels = InterfaceLabels {
            interface: interface.name.clone(),
        };
        packets
            .get_or_create(&labels)
            .inc_by(interface.forwarded_packets);
        bytes
            .get_or_create(&labels)
            .inc_by(interface.forwarded_bytes);
        if let Some(mode) = interface.xdp_mode {
            attached
                .get_or_create(&InterfaceModeLabels {
                    interface: interface.name.clone(),
                    mode: mode.to_string(),
                })
                .set(1);
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct NextProgramLabels {
    name: String,
    id: String,
    /// The build of lb's program that calls it: "lb_xdp" or "lb_xdp_1buf".
    caller: String,
}

/// `dataplane.next_program`: one sample while a program is chained, none without.
fn register_next_program(registry: &mut Registry, next: Option<&crate::status::NextProgramStatus>) {
    let info = family::<NextProgramLabels, Gauge>(
        registry,
        "next_program_info",
        "The host's XDP program lb tail-calls with the frames it passes (always 1)",
    );
    if let Some(next) = next {
        info.get_or_create(&NextProgramLabels {
            name: next.name.clone(),
            id: next.id.to_string(),
            caller: next.caller.clone(),
        })
        .set(1);
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct VersionLabels {
    version: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    /// "ok" or "refused".
    result: String,
}

/// The agent itself: its version, its reloads and when the file was last loaded.
fn register_agent(registry: &mut Registry, agent: &crate::status::AgentStatus) {
    family::<VersionLabels, Gauge>(registry, "build_info", "lb's version (always 1)")
        .get_or_create(&VersionLabels {
            version: agent.version.clone(),
        })
        .set(1);
    let reloads = family::<ResultLabels, Counter>(registry, "reload", "Reloads by result");
    for (result, count) in [("ok", agent.reloads_ok), ("refused", agent.reloads_refused)] {
        reloads
            .get_or_create(&ResultLabels {
                result: result.into(),
            })
            .inc_by(count);
    }
    let last = Gauge::<i64>::default();
    last.set(agent.last_load_unix_seconds as i64);
    registry.register(
        "last_reload_timestamp_seconds",
        "When the configuration was last loaded successfully (the start, then each accepted \
         reload), in seconds since the Unix epoch",
        last,
    );
}

fn register_vips(registry: &mut Registry, status: &Status) {
    let vip_packets =
        family::<VipLabels, Counter>(registry, "vip_packets", "Packets forwarded for a VIP");
    let vip_bytes =
        family::<VipLabels, Counter>(registry, "vip_bytes", "Bytes forwarded for a VIP");
    let vip_new_flows = family::<VipLabels, Counter>(
        registry,
        "vip_new_flows",
        "New flows forwarded for a VIP (TCP SYNs and new UDP flows)",
    );
    let healthy = family::<VipLabels, Gauge>(
        registry,
        "vip_healthy_backends",
        "Backends not failed by checks and reachable (maintenance excluded)",
    );
    let unhealthy = family::<VipLabels, Gauge>(
        registry,
        "vip_unhealthy_backends",
        "Backends failed by checks or unreachable (maintenance excluded)",
    );
    let hotspot = family::<VipLabels, Gauge<f64, std::sync::atomic::AtomicU64>>(
        registry,
        "vip_busiest_over_average",
        "New flows of the busiest in-table backend over the average, last interval (0: none)",
    );
    let hot_sources = family::<VipLabels, Gauge>(
        registry,
        "vip_hot_sources",
        "Sources balanced per connection now (hot_source_share)",
    );
    let quic_routed = family::<VipLabels, Counter>(
        registry,
        "vip_quic_routed_by_cid",
        "QUIC short-header packets sent to the backend their connection ID's server ID names",
    );
    let quic_unknown = family::<VipLabels, Counter>(
        registry,
        "vip_quic_cid_unknown",
        "QUIC short-header packets whose server ID named no serving backend (balanced as UDP)",
    );
    for vip in &status.vips {
        let labels = VipLabels {
            vip: vip.name.clone(),
        };
        quic_routed
            .get_or_create(&labels)
            .inc_by(vip.quic_routed_by_cid);
        quic_unknown
            .get_or_create(&labels)
            .inc_by(vip.quic_cid_unknown);
        hot_sources
            .get_or_create(&labels)
            .set(vip.hot_sources.len() as i64);
        vip_packets.get_or_create(&labels).inc_by(vip.packets);
        vip_bytes.get_or_create(&labels).inc_by(vip.bytes);
        vip_new_flows.get_or_create(&labels).inc_by(vip.new_flows);
        healthy
            .get_or_create(&labels)
            .set(vip.healthy_backends as i64);
        unhealthy
            .get_or_create(&labels)
            .set(vip.unhealthy_backends as i64);
        hotspot.get_or_create(&labels).set(vip.busiest_over_average);
    }
}

fn register_backends(registry: &mut Registry, status: &Status) {
    let packets = family::<BackendLabels, Counter>(
        registry,
        "backend_packets",
        "Packets forwarded to a backend",
    );
    let bytes =
        family::<BackendLabels, Counter>(registry, "backend_bytes", "Bytes forwarded to a backend");
    let new_flows = family::<BackendLabels, Counter>(
        registry,
        "backend_new_flows",
        "New flows forwarded to a backend (TCP SYNs and new UDP flows)",
    );
    let up = family::<BackendLabels, Gauge>(
        registry,
        "backend_up",
        "1 when health is up or unchecked (kind none, maintenance)",
    );
    let flows = family::<BackendLabels, Gauge>(
        registry,
        "backend_active_flows",
        "Live connection-table entries",
    );
    let admin = family::<StateLabels, Gauge>(
        registry,
        "backend_admin_state",
        "1 for the backend's admin state",
    );
    let effective = family::<BackendLabels, Gauge<f64, std::sync::atomic::AtomicU64>>(
        registry,
        "backend_effective_weight",
        "The weight new flows are shared by now (configured weight after slow start, agent and least-flows)",
    );
    for vip in &status.vips {
        for b in &vip.backends {
            let labels = BackendLabels {
                vip: vip.name.clone(),
                backend: b.address.clone(),
            };
            packets.get_or_create(&labels).inc_by(b.packets);
            bytes.get_or_create(&labels).inc_by(b.bytes);
            new_flows.get_or_create(&labels).inc_by(b.new_flows);
            up.get_or_create(&labels)
                .set(i64::from(b.health != Health::Down));
            flows.get_or_create(&labels).set(b.active_flows as i64);
            effective.get_or_create(&labels).set(b.effective_weight);
            for state in AdminStatus::ALL {
                let labels = StateLabels {
                    vip: vip.name.clone(),
                    backend: b.address.clone(),
                    state: state.word().into(),
                };
                admin
                    .get_or_create(&labels)
                    .set(i64::from(b.state == state));
            }
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    vip: String,
    backend: String,
    /// "completed" or "failed".
    outcome: String,
}

/// Passive health: each backend's TCP handshakes and ejections (`[vip.outlier]`).
fn register_handshakes(registry: &mut Registry, status: &Status) {
    let handshakes = family::<OutcomeLabels, Counter>(
        registry,
        "backend_handshakes",
        "TCP handshakes with a backend: completed (the client's first ACK came), failed \
         (the client had to send its SYN again)",
    );
    let ejections = family::<BackendLabels, Counter>(
        registry,
        "backend_ejections",
        "Ejections by passive health ([vip.outlier]) since the agent started; the reason is \
         in status and the log",
    );
    for vip in &status.vips {
        for b in &vip.backends {
            let label = |outcome: &str| OutcomeLabels {
                vip: vip.name.clone(),
                backend: b.address.clone(),
                outcome: outcome.into(),
            };
            let counts = [
                ("completed", b.handshakes.completed),
                ("failed", b.handshakes.retried),
            ];
            for (outcome, count) in counts {
                handshakes.get_or_create(&label(outcome)).inc_by(count);
            }
            let labels = BackendLabels {
                vip: vip.name.clone(),
                backend: b.address.clone(),
            };
            let ejected = b.outlier.as_ref().map_or(0, |o| o.ejections);
            ejections.get_or_create(&labels).inc_by(ejected);
        }
    }
}

/// The program's outcome counters, read by their `stat` index.
fn register_outcomes(registry: &mut Registry, outcomes: &[u64]) {
    let counter = |index: u32| outcomes.get(index as usize).copied().unwrap_or(0);
    let actions =
        family::<ActionLabels, Counter>(registry, "xdp_actions", "XDP verdicts of the program");
    for (action, index) in [
        ("aborted", stat::XDP_ABORTED),
        ("drop", stat::XDP_DROP),
        ("pass", stat::XDP_PASS),
        ("tx", stat::XDP_TX),
        ("redirect", stat::XDP_REDIRECT),
    ] {
        actions
            .get_or_create(&ActionLabels {
                action: action.into(),
            })
            .inc_by(counter(index));
    }
    let drops = family::<ReasonLabels, Counter>(registry, "drops", "Packets dropped, by reason");
    let passes = family::<ReasonLabels, Counter>(
        registry,
        "passes",
        "Packets passed to the kernel, by reason",
    );
    for index in 0..stat::COUNT {
        let family = match stat::kind(index) {
            stat::Kind::Drop => &drops,
            stat::Kind::Pass => &passes,
            _ => continue,
        };
        family
            .get_or_create(&ReasonLabels {
                reason: stat::reason(index).into(),
            })
            .inc_by(counter(index));
    }
    let misses = family::<KindLabels, Counter>(
        registry,
        "conntrack_misses",
        "Connection-table misses: syn (always hashed), non_syn (flows the table did not know), udp",
    );
    for (kind, index) in [
        ("syn", stat::CT_MISS_SYN),
        ("non_syn", stat::CT_MISS_NON_SYN),
        ("udp", stat::CT_MISS_UDP),
    ] {
        misses
            .get_or_create(&KindLabels { kind: kind.into() })
            .inc_by(counter(index));
    }
    let conntrack =
        family::<KindLabels, Counter>(registry, "conntrack_events", "Connection-table events");
    for (kind, index) in [
        ("hit", stat::CT_HIT),
        ("rehash", stat::CT_REHASH),
        ("created", stat::CT_CREATED),
        ("insert_skipped", stat::CT_INSERT_SKIPPED),
        // First packets kept out of the table, and flows entered by their second packet.
        ("embryonic", stat::CT_EMBRYONIC),
        ("promoted", stat::CT_PROMOTED),
        ("reused", stat::CT_REUSED),
    ] {
        conntrack
            .get_or_create(&KindLabels { kind: kind.into() })
            .inc_by(counter(index));
    }
    for (name, help, index) in [
        (
            "icmp_too_big",
            "ICMP fragmentation-needed / ICMPv6 packet-too-big errors about VIP flows, sent to the flows' backends",
            stat::SEEN_ICMP_TOO_BIG,
        ),
        (
            "hot_source_spread",
            "New flows of hot sources of src-ip VIPs hashed per connection (hot_source_share)",
            stat::HOT_SOURCE_SPREAD,
        ),
    ] {
        let total = Counter::<u64>::default();
        total.inc_by(counter(index));
        registry.register(name, help, total);
    }
}

/// `[cluster]`: per peer, what was sent, received, inserted and rejected, and the last
/// contact; and what the node could not export.
fn register_cluster(registry: &mut Registry, cluster: &crate::status::ClusterStatus) {
    type Get = fn(&crate::status::PeerStatus) -> u64;
    let counters: [(&str, &str, Get); 6] = [
        (
            "cluster_entries_sent",
            "Entries sent to a cluster peer",
            |p| p.sent,
        ),
        (
            "cluster_bytes_sent",
            "UDP payload bytes sent to a cluster peer",
            |p| p.bytes_sent,
        ),
        (
            "cluster_entries_received",
            "Entries received from a cluster peer (accepted datagrams)",
            |p| p.received,
        ),
        (
            "cluster_entries_inserted",
            "Entries from a cluster peer inserted into the connection table",
            |p| p.inserted,
        ),
        (
            "cluster_entries_unknown",
            "Entries from a cluster peer naming a VIP or backend this node lacks",
            |p| p.unknown,
        ),
        (
            "cluster_rejected",
            "Datagrams from a cluster peer's address dropped: authentication, malformed, stale or replayed",
            |p| p.rejected,
        ),
    ];
    for (name, help, get) in counters {
        let family = family::<PeerLabels, Counter>(registry, name, help);
        for peer in &cluster.peers {
            let labels = PeerLabels {
                peer: peer.address.clone(),
            };
            family.get_or_create(&labels).inc_by(get(peer));
        }
    }
    let contact = family::<PeerLabels, Gauge<f64, std::sync::atomic::AtomicU64>>(
        registry,
        "cluster_last_contact_seconds",
        "Seconds since the last accepted datagram from a cluster peer (absent: none yet)",
    );
    let seen = family::<PeerLabels, Gauge<f64, std::sync::atomic::AtomicU64>>(
        registry,
        "cluster_peer_last_seen_timestamp_seconds",
        "When the last accepted datagram from a cluster peer came, in seconds since the Unix \
         epoch (absent: none yet); peers send at least every 2s",
    );
    for peer in &cluster.peers {
        let labels = PeerLabels {
            peer: peer.address.clone(),
        };
        if let Some(age) = peer.last_contact_seconds {
            contact.get_or_create(&labels).set(age);
        }
        if let Some(at) = peer.last_seen_unix_seconds {
            seen.get_or_create(&labels).set(at);
        }
    }
    for (name, help, value) in [
        (
            "cluster_exported",
            "New entries the data path exported for the peers",
            cluster.exported,
        ),
        (
            "cluster_export_dropped",
            "New entries not exported: the export ring was full",
            cluster.export_dropped,
        ),
        (
            "cluster_queue_dropped",
            "New entries not sent: the send queue was full",
            cluster.queue_dropped,
        ),
        (
            "cluster_unknown_sender",
            "Cluster datagrams from addresses that are no peer",
            cluster.unknown_sender,
        ),
    ] {
        let counter = Counter::<u64>::default();
        counter.inc_by(value);
        registry.register(name, help, counter);
    }
}

/// Takes one scrape of the agent's state (briefly under its lock); rendering happens
/// after, outside it.
pub type Scraper = Arc<dyn Fn() -> anyhow::Result<Scrape> + Send + Sync>;

/// Serves `GET /metrics` on `address` until `shutdown`, within the listener limits of
/// `listen` (a local user can reach this port: nothing it does here costs the agent
/// more than those connections).
/// The metrics endpoint's listener, bound before the data path is touched: a port in
/// use stops the start with nothing attached.
pub async fn bind(address: SocketAddr) -> anyhow::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(address)
        .await
        .with_context(|| format!("binding the metrics endpoint {address}"))
}

pub fn serve(
    listener: tokio::net::TcpListener,
    scraper: Scraper,
    shutdown: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    let app = Router::new()
        .route("/metrics", get(metrics))
        .with_state(scraper);
    tokio::spawn(crate::listen::serve(
        listener,
        "metrics endpoint",
        app,
        crate::listen::LIMITS,
        shutdown,
    ))
}

/// `GET /metrics`: Prometheus text, or OpenMetrics when the scraper's Accept asks for it.
/// Also answered on the control and operators' sockets.
pub async fn metrics(
    State(scraper): State<Scraper>,
    headers: axum::http::HeaderMap,
) -> impl IntoResponse {
    let openmetrics = headers
        .get_all(axum::http::header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(accepts_openmetrics);
    match scraper().and_then(|scrape| render(&scrape)) {
        Ok(text) => {
            let (content_type, body) = if openmetrics {
                (
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    text,
                )
            } else {
                (
                    "text/plain; version=0.0.4; charset=utf-8",
                    prometheus_text(&text),
                )
            };
            (StatusCode::OK, [("content-type", content_type)], body).into_response()
        }
        Err(error) => (StatusCode::INTERNAL_SERVER_ERROR, format!("{error:#}")).into_response(),
    }
}

/// Whether an Accept header value asks for OpenMetrics: it lists the media type with a
/// quality above 0 (`q=0` means "not this").
fn accepts_openmetrics(accept: &str) -> bool {
    accept.split(',').any(|range| {
        let mut parts = range.split(';').map(str::trim);
        let media = parts.next().unwrap_or("");
        let quality = parts
            .filter_map(|p| p.strip_prefix("q=").or_else(|| p.strip_prefix("Q=")))
            .find_map(|q| q.parse::<f32>().ok())
            .unwrap_or(1.0);
        media.eq_ignore_ascii_case("application/openmetrics-text") && quality > 0.0
    })
}

/// The classic Prometheus text format (0.0.4) of an OpenMetrics exposition. The samples
/// are the same; what differs is around them: a counter family is named with its
/// `_total` suffix (as its samples are), and there is no `# UNIT` or `# EOF` line.
pub fn prometheus_text(openmetrics: &str) -> String {
    let counters: std::collections::HashSet<&str> = openmetrics
        .lines()
        .filter_map(|line| line.strip_prefix("# TYPE "))
        .filter_map(|rest| rest.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let meta = ["# HELP ", "# TYPE "]
            .into_iter()
            .find_map(|prefix| Some((prefix, line.strip_prefix(prefix)?)));
        match meta {
            Some((prefix, rest)) => {
                let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
                let suffix = if counters.contains(name) {
                    "_total"
                } else {
                    ""
                };
                // 0.0.4 calls OpenMetrics' `unknown` type `untyped`.
                let tail = if prefix == "# TYPE " && tail == "unknown" {
                    "untyped"
                } else {
                    tail
                };
                out.push_str(&format!("{prefix}{name}{suffix} {tail}"));
            }
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

/// Records a check's duration and, when the health changed, the transition.
pub fn observe_check(
    observed: &Observed,
    vip: &str,
    kind: &str,
    backend: &str,
    seconds: f64,
    changed: Option<Health>,
) {
    observed
        .check_duration
        .get_or_create(&CheckLabels {
            vip: vip.into(),
            kind: kind.into(),
        })
        .observe(seconds);
    if let Some(health) = changed {
        let to = if health == Health::Up { "up" } else { "down" };
        observed
            .transitions
            .get_or_create(&TransitionLabels {
                vip: vip.into(),
                backend: backend.into(),
                to: to.into(),
            })
            .inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_series_are_per_peer_and_only_with_cluster() {
        let mut status = crate::status::tests::sample();
        let scrape = |status: &Status| Scrape {
            status: status.clone(),
            outcomes: vec![0; stat::COUNT as usize],
            observed: Observed::default(),
        };
        let plain = render(&scrape(&status)).unwrap();
        assert!(!plain.contains("lb_cluster_"), "{plain}");
        status.cluster = Some(crate::status::ClusterStatus {
            exported: 9,
            peers: vec![crate::status::PeerStatus {
                address: "10.0.0.12".into(),
                sent: 5,
                rejected: 2,
                last_contact_seconds: Some(0.5),
                last_seen_unix_seconds: Some(1_796_000_000.5),
                ..Default::default()
            }],
            ..Default::default()
        });
        let text = prometheus_text(&render(&scrape(&status)).unwrap());
        for line in [
            "lb_cluster_entries_sent_total{peer=\"10.0.0.12\"} 5",
            "lb_cluster_rejected_total{peer=\"10.0.0.12\"} 2",
            "lb_cluster_last_contact_seconds{peer=\"10.0.0.12\"} 0.5",
            "lb_cluster_peer_last_seen_timestamp_seconds{peer=\"10.0.0.12\"} 1796000000.5",
            "lb_cluster_exported_total 9",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in:\n{text}");
        }
    }

    #[test]
    fn the_next_program_is_an_info_series_only_while_chained() {
        let mut status = crate::status::tests::sample();
        let scrape = |status: &Status| Scrape {
            status: status.clone(),
            outcomes: vec![0; stat::COUNT as usize],
            observed: Observed::default(),
        };
        let plain = prometheus_text(&render(&scrape(&status)).unwrap());
        assert!(!plain.contains("lb_next_program_info{"), "{plain}");
        status.dataplane.next_program = Some(crate::status::NextProgramStatus {
            path: "/sys/fs/bpf/host-fw".into(),
            name: "xdpfilt_alw_ip".into(),
            id: 42,
            caller: "lb_xdp_1buf".into(),
        });
        let text = prometheus_text(&render(&scrape(&status)).unwrap());
        let line =
            "lb_next_program_info{name=\"xdpfilt_alw_ip\",id=\"42\",caller=\"lb_xdp_1buf\"} 1";
        assert!(text.lines().any(|l| l == line), "{line} in:\n{text}");
    }

    #[test]
    fn hot_sources_are_a_gauge_per_vip_and_their_spread_a_counter() {
        let mut status = crate::status::tests::sample();
        status.vips[0].hot_sources = vec![crate::status::HotSource {
            address: "10.0.0.1".into(),
            share: 0.6,
        }];
        let mut outcomes = vec![0; stat::COUNT as usize];
        outcomes[stat::HOT_SOURCE_SPREAD as usize] = 7;
        let scrape = Scrape {
            status,
            outcomes,
            observed: Observed::default(),
        };
        let text = prometheus_text(&render(&scrape).unwrap());
        assert!(
            text.contains("lb_vip_hot_sources{vip=\"web\"} 1\n"),
            "{text}"
        );
        assert!(text.contains("lb_hot_source_spread_total 7\n"), "{text}");
    }

    #[test]
    fn openmetrics_only_when_asked_for() {
        // What Prometheus sends.
        assert!(accepts_openmetrics(
            "application/openmetrics-text;version=1.0.0,application/openmetrics-text;\
             version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
        ));
        assert!(accepts_openmetrics(
            "Application/OpenMetrics-Text; version=1.0.0"
        ));
        for plain in [
            "",
            "*/*",
            "text/plain",
            "text/plain;version=0.0.4",
            "application/openmetrics-text;q=0, text/plain",
        ] {
            assert!(!accepts_openmetrics(plain), "{plain:?}");
        }
    }
}
