//! Prometheus metrics at `control.metrics` (`GET /metrics`): OpenMetrics text to a
//! scraper that asks for it (Prometheus does), else the classic Prometheus text format
//! (0.0.4), which every other scraper and script reads.
//!
//! Counters of the data path are summed over CPUs from the BPF maps at scrape time, so
//! every scrape is exact and nothing is counted twice in userspace. Health-check
//! durations and transitions are observed by the agent as they happen.

use std::{
    net::SocketAddr,
    sync::{Arc, Mutex},
};

use anyhow::Context;
use axum::{Router, extract::State, http::StatusCode, response::IntoResponse, routing::get};
use lb_common::stat;
use prometheus_client::{
    encoding::{EncodeLabelSet, text::encode},
    metrics::{counter::Counter, family::Family, gauge::Gauge, histogram::Histogram},
    registry::Registry,
};
use tokio_util::sync::CancellationToken;

use crate::{agent::Shared, model::Health};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct VipLabels {
    pub vip: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BackendLabels {
    pub vip: String,
    pub backend: String,
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
    pub check_duration: Family<VipLabels, Histogram>,
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

/// The metrics text for the agent's current state.
pub fn render(shared: &Shared) -> anyhow::Result<String> {
    let mut registry = Registry::with_prefix("lb");
    let status = shared.status()?;

    let vip_packets =
        family::<VipLabels, Counter>(&mut registry, "vip_packets", "Packets forwarded for a VIP");
    let vip_bytes =
        family::<VipLabels, Counter>(&mut registry, "vip_bytes", "Bytes forwarded for a VIP");
    let vip_new_flows = family::<VipLabels, Counter>(
        &mut registry,
        "vip_new_flows",
        "TCP SYNs forwarded for a VIP",
    );
    let healthy = family::<VipLabels, Gauge>(
        &mut registry,
        "vip_healthy_backends",
        "Backends not failed by checks",
    );
    let unhealthy = family::<VipLabels, Gauge>(
        &mut registry,
        "vip_unhealthy_backends",
        "Backends failed by checks or unreachable",
    );
    let hotspot = family::<VipLabels, Gauge<f64, std::sync::atomic::AtomicU64>>(
        &mut registry,
        "vip_busiest_over_average",
        "New flows of the busiest in-table backend over the average, last interval (0: none)",
    );
    let backend_packets = family::<BackendLabels, Counter>(
        &mut registry,
        "backend_packets",
        "Packets forwarded to a backend",
    );
    let backend_bytes = family::<BackendLabels, Counter>(
        &mut registry,
        "backend_bytes",
        "Bytes forwarded to a backend",
    );
    let backend_new_flows = family::<BackendLabels, Counter>(
        &mut registry,
        "backend_new_flows",
        "TCP SYNs forwarded to a backend",
    );
    let backend_up = family::<BackendLabels, Gauge>(
        &mut registry,
        "backend_up",
        "1 when health is up or unchecked",
    );
    let backend_flows = family::<BackendLabels, Gauge>(
        &mut registry,
        "backend_active_flows",
        "Live connection-table entries",
    );
    let admin = family::<StateLabels, Gauge>(
        &mut registry,
        "backend_admin_state",
        "1 for the backend's admin state",
    );

    for vip in &status.vips {
        let labels = VipLabels {
            vip: vip.name.clone(),
        };
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
        for b in &vip.backends {
            let labels = BackendLabels {
                vip: vip.name.clone(),
                backend: b.address.clone(),
            };
            backend_packets.get_or_create(&labels).inc_by(b.packets);
            backend_bytes.get_or_create(&labels).inc_by(b.bytes);
            backend_new_flows.get_or_create(&labels).inc_by(b.new_flows);
            let up = b.health != "down";
            backend_up.get_or_create(&labels).set(i64::from(up));
            backend_flows
                .get_or_create(&labels)
                .set(b.active_flows as i64);
            for state in ["ready", "draining", "drained", "maint"] {
                let labels = StateLabels {
                    vip: vip.name.clone(),
                    backend: b.address.clone(),
                    state: state.into(),
                };
                admin
                    .get_or_create(&labels)
                    .set(i64::from(b.state == state));
            }
        }
    }

    let counter = |name: &str| status.counters.get(name).copied().unwrap_or(0);
    let actions = family::<ActionLabels, Counter>(
        &mut registry,
        "xdp_actions",
        "XDP verdicts of the program",
    );
    for (action, name) in [
        ("aborted", "xdp_aborted"),
        ("drop", "xdp_drop"),
        ("pass", "xdp_pass"),
        ("tx", "xdp_tx"),
        ("redirect", "xdp_redirect"),
    ] {
        actions
            .get_or_create(&ActionLabels {
                action: action.into(),
            })
            .inc_by(counter(name));
    }
    let drops =
        family::<ReasonLabels, Counter>(&mut registry, "drops", "Packets dropped, by reason");
    let passes = family::<ReasonLabels, Counter>(
        &mut registry,
        "passes",
        "Packets passed to the kernel, by reason",
    );
    for name in stat::NAMES {
        if let Some(reason) = name.strip_prefix("drop_") {
            drops
                .get_or_create(&ReasonLabels {
                    reason: reason.into(),
                })
                .inc_by(counter(name));
        } else if let Some(reason) = name.strip_prefix("pass_") {
            passes
                .get_or_create(&ReasonLabels {
                    reason: reason.into(),
                })
                .inc_by(counter(name));
        }
    }
    let misses = family::<KindLabels, Counter>(
        &mut registry,
        "conntrack_misses",
        "Connection-table misses: syn (always hashed), non_syn (flows the table did not know), udp",
    );
    for kind in ["syn", "non_syn", "udp"] {
        misses
            .get_or_create(&KindLabels { kind: kind.into() })
            .inc_by(counter(&format!("ct_miss_{kind}")));
    }
    let conntrack =
        family::<KindLabels, Counter>(&mut registry, "conntrack_events", "Connection-table events");
    for kind in ["hit", "rehash", "created", "insert_skipped"] {
        conntrack
            .get_or_create(&KindLabels { kind: kind.into() })
            .inc_by(counter(&format!("ct_{kind}")));
    }
    let icmp_too_big = Counter::<u64>::default();
    icmp_too_big.inc_by(counter("seen_icmp_too_big"));
    registry.register(
        "icmp_too_big",
        "ICMP fragmentation-needed / ICMPv6 packet-too-big errors about VIP flows, sent to the flows' backends",
        icmp_too_big,
    );
    let entries = Gauge::<i64>::default();
    entries.set(status.dataplane.conntrack_entries as i64);
    registry.register(
        "conntrack_entries",
        "Connection-table entries at the last scan",
        entries,
    );

    registry.register(
        "health_check_duration_seconds",
        "Duration of health checks",
        shared.observed.check_duration.clone(),
    );
    registry.register(
        "health_transitions",
        "Backend health changes",
        shared.observed.transitions.clone(),
    );

    let mut text = String::new();
    encode(&mut text, &registry).context("encoding metrics")?;
    Ok(text)
}

/// Serves `GET /metrics` on `address` until `shutdown`.
pub async fn serve(
    address: SocketAddr,
    shared: Arc<Mutex<Shared>>,
    shutdown: CancellationToken,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let listener = tokio::net::TcpListener::bind(address)
        .await
        .with_context(|| format!("binding the metrics endpoint {address}"))?;
    let app = Router::new()
        .route("/metrics", get(metrics))
        .with_state(shared);
    Ok(tokio::spawn(async move {
        let served = axum::serve(listener, app)
            .with_graceful_shutdown(shutdown.cancelled_owned())
            .await;
        if let Err(error) = served {
            tracing::error!("metrics endpoint: {error}");
        }
    }))
}

async fn metrics(
    State(shared): State<Arc<Mutex<Shared>>>,
    headers: axum::http::HeaderMap,
) -> impl IntoResponse {
    let openmetrics = headers
        .get_all(axum::http::header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(accepts_openmetrics);
    let shared = shared.lock().expect("agent state poisoned");
    match render(&shared) {
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
    backend: &str,
    seconds: f64,
    changed: Option<Health>,
) {
    observed
        .check_duration
        .get_or_create(&VipLabels { vip: vip.into() })
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
    use crate::agent::{
        busiest_over_average,
        test_support::{config, shared},
    };

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

    #[test]
    fn the_classic_text_names_counter_families_as_their_samples() {
        let shared = shared(config("eth0", &["10.0.0.11"]));
        observe_check(&shared.observed, "web", "10.0.0.11", 0.002, None);
        let openmetrics = render(&shared).unwrap();
        assert!(openmetrics.contains("# TYPE lb_vip_packets counter"));
        assert!(openmetrics.ends_with("# EOF\n"));
        let text = prometheus_text(&openmetrics);
        assert!(
            !text.contains("# EOF") && !text.contains("# UNIT"),
            "{text}"
        );
        assert!(
            text.contains("# TYPE lb_vip_packets_total counter\n"),
            "{text}"
        );
        assert!(
            text.contains("# HELP lb_vip_packets_total Packets"),
            "{text}"
        );
        assert!(
            text.contains("# TYPE lb_conntrack_entries gauge\n"),
            "{text}"
        );
        assert!(
            text.contains("# TYPE lb_health_check_duration_seconds histogram\n"),
            "{text}"
        );
        // Only types both formats share (no info, stateset, gaugehistogram).
        for line in openmetrics.lines().filter(|l| l.starts_with("# TYPE ")) {
            let kind = line.rsplit(' ').next().unwrap();
            assert!(
                ["counter", "gauge", "histogram"].contains(&kind),
                "{line}: a type the classic text lacks"
            );
        }
        assert_eq!(
            prometheus_text("# TYPE x unknown\nx 1\n# EOF\n"),
            "# TYPE x untyped\nx 1\n"
        );
        // Every sample line is kept as it was.
        let samples = |t: &str| -> Vec<String> {
            t.lines()
                .filter(|l| !l.starts_with('#'))
                .map(str::to_string)
                .collect()
        };
        assert_eq!(samples(&text), samples(&openmetrics));
        // A 0.0.4 parser now types the counters as counters.
        let lines = text.lines().map(|l| Ok(l.to_string()));
        let scrape = prometheus_parse::Scrape::parse(lines).unwrap();
        let packets = scrape
            .samples
            .iter()
            .find(|s| s.metric == "lb_vip_packets_total")
            .expect("lb_vip_packets_total");
        assert!(
            matches!(packets.value, prometheus_parse::Value::Counter(_)),
            "{:?}",
            packets.value
        );
    }

    #[test]
    fn the_exposition_parses_and_names_every_series() {
        let mut shared = shared(config("eth0", &["10.0.0.11", "10.0.0.12"]));
        // One backend in maintenance, then the other failed its checks: the gauges say so.
        let web = "10.0.0.100:80/tcp".parse().unwrap();
        shared
            .set_admin_state(
                &web,
                "10.0.0.12".parse().unwrap(),
                crate::config::AdminState::Maint,
            )
            .unwrap();
        for b in shared.model.backends_mut() {
            if b.config.address.to_string() == "10.0.0.11" {
                b.health = Health::Down;
            }
        }
        observe_check(
            &shared.observed,
            "web",
            "10.0.0.11",
            0.002,
            Some(Health::Up),
        );
        let text = render(&shared).unwrap();
        let lines = text.lines().map(|l| Ok(l.to_string()));
        let scrape = prometheus_parse::Scrape::parse(lines).expect("a real parser accepts it");
        let names: std::collections::BTreeSet<&str> =
            scrape.samples.iter().map(|s| s.metric.as_str()).collect();
        for name in [
            "lb_vip_packets_total",
            "lb_vip_bytes_total",
            "lb_vip_new_flows_total",
            "lb_vip_healthy_backends",
            "lb_vip_unhealthy_backends",
            "lb_vip_busiest_over_average",
            "lb_backend_packets_total",
            "lb_backend_bytes_total",
            "lb_backend_new_flows_total",
            "lb_backend_up",
            "lb_backend_admin_state",
            "lb_backend_active_flows",
            "lb_xdp_actions_total",
            "lb_drops_total",
            "lb_passes_total",
            "lb_conntrack_misses_total",
            "lb_conntrack_entries",
            "lb_icmp_too_big_total",
            "lb_health_check_duration_seconds_count",
            "lb_health_transitions_total",
        ] {
            assert!(names.contains(name), "{name} missing from:\n{text}");
        }
        let healthy = scrape
            .samples
            .iter()
            .find(|s| s.metric == "lb_vip_healthy_backends")
            .unwrap();
        assert_eq!(healthy.labels.get("vip"), Some("web"));
        // 10.0.0.11 failed its checks; maintenance is an admin state, not health.
        assert!(matches!(healthy.value, prometheus_parse::Value::Gauge(v) if v == 1.0));
        let kinds = |metric: &str| -> std::collections::BTreeSet<String> {
            scrape
                .samples
                .iter()
                .filter(|s| s.metric == metric)
                .filter_map(|s| s.labels.get("kind").map(str::to_string))
                .collect()
        };
        assert_eq!(
            kinds("lb_conntrack_misses_total"),
            ["non_syn", "syn", "udp"].map(String::from).into()
        );

        let gauge = |metric: &str, labels: &[(&str, &str)]| {
            let sample = scrape
                .samples
                .iter()
                .find(|s| {
                    s.metric == metric && labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v))
                })
                .unwrap_or_else(|| panic!("no {metric}{labels:?}"));
            match sample.value {
                prometheus_parse::Value::Gauge(v) => v,
                ref other => panic!("{metric}: {other:?}"),
            }
        };
        assert_eq!(gauge("lb_backend_up", &[("backend", "10.0.0.11")]), 0.0);
        assert_eq!(gauge("lb_backend_up", &[("backend", "10.0.0.12")]), 1.0);
        let admin = |backend: &str, state: &str| {
            gauge(
                "lb_backend_admin_state",
                &[("backend", backend), ("state", state)],
            )
        };
        assert_eq!(
            (admin("10.0.0.12", "maint"), admin("10.0.0.12", "ready")),
            (1.0, 0.0)
        );
        assert_eq!(
            (admin("10.0.0.11", "ready"), admin("10.0.0.11", "maint")),
            (1.0, 0.0)
        );
        assert_eq!(
            kinds("lb_conntrack_events_total"),
            ["created", "hit", "insert_skipped", "rehash"]
                .map(String::from)
                .into()
        );
    }

    #[test]
    fn busiest_over_average_is_max_over_mean() {
        assert_eq!(busiest_over_average(&[0, 0, 0]), 0.0);
        assert_eq!(busiest_over_average(&[10, 10, 10]), 1.0);
        assert_eq!(busiest_over_average(&[30, 0, 0]), 3.0);
        assert!((busiest_over_average(&[12, 10, 8]) - 1.2).abs() < 1e-9);
    }
}
