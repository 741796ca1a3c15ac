//! What the agent learns by watching the data path: live flows per backend (from scans of
//! the connection table), new-flow rates, each VIP's busiest-over-average ratio, its
//! heavy hitters and, with `hot_source_share`, its hot sources (`hot`) (from counter
//! samples). Pure bookkeeping: the agent's loop feeds it scans and counter reads;
//! status, draining, metrics and `LB_HOT_SRC` read it.

use std::{
    collections::HashMap,
    net::IpAddr,
    time::{Duration, Instant},
};

use lb_common::{FLOW_F_CLOSING, FLOW_F_LEARNED, FlowEntry, FlowKey, SourceKey};

use crate::{
    config::HashMode,
    hot::HotSources,
    model::Model,
    status::{SourceRate, TOP_SOURCES},
};

/// A closing flow (client FIN seen) still counts as active while seen this recently.
pub const CLOSING_GRACE: Duration = Duration::from_secs(3);

#[derive(Clone, Debug, Default)]
pub struct Telemetry {
    /// Per backend id: connection-table entries seen within `flow_idle_timeout`, as of
    /// the last scan (`record_flows`).
    pub active_flows: HashMap<u32, u64>,
    /// Connection-table entries at the last scan.
    pub conntrack_size: u64,
    /// When the last scan began (a scan counts as of its start).
    pub last_scan: Option<Instant>,
    /// New flows per second per backend id over the last sample interval.
    pub new_flow_rates: HashMap<u32, f64>,
    /// Per VIP id: new flows of the busiest in-table backend over the average, last
    /// interval (0 when there were none): the hot-spot signal.
    pub busiest_over_average: HashMap<u32, f64>,
    /// Per VIP id: the heavy hitters of the last interval.
    pub top_sources: HashMap<u32, Vec<SourceRate>>,
    /// The hot sources of VIPs with `hot_source_share`, as of the last sample: what
    /// `LB_HOT_SRC` is to hold.
    pub hot: HotSources,
    /// The previous sample: when, and each backend's new-flow counter then.
    last_sample: Option<(Instant, HashMap<u32, u64>)>,
    /// Each source's new-flow count at the previous sample.
    last_sources: HashMap<SourceKey, u64>,
}

impl Telemetry {
    /// Counts live entries per backend from a scan of the connection table that began
    /// at `started` (`started_ns` on the data path's clock). The scan counts as of its
    /// start: a flow that began later may have landed where the scan had already read.
    pub fn record_flows(
        &mut self,
        flows: Vec<(FlowKey, FlowEntry)>,
        started: Instant,
        started_ns: u64,
        flow_idle: Duration,
    ) {
        let idle_ns = flow_idle.as_nanos() as u64;
        self.conntrack_size = flows.len() as u64;
        self.last_scan = Some(started);
        self.active_flows.clear();
        for (_, entry) in flows {
            // A cluster peer's flow, not (yet) seen here: that node counts it.
            if entry.flags & FLOW_F_LEARNED != 0 {
                continue;
            }
            // A client's FIN only half-closes: the backend may still be sending, so a
            // closing flow counts while its packets (the client's ACKs) keep coming.
            let window = if entry.flags & FLOW_F_CLOSING != 0 {
                CLOSING_GRACE.as_nanos() as u64
            } else {
                idle_ns
            };
            if started_ns.saturating_sub(entry.last_seen_ns) <= window {
                *self.active_flows.entry(entry.backend_id).or_default() += 1;
            }
        }
    }

    /// Live flows of backend `id` at the last scan.
    pub fn flows_of(&self, id: u32) -> u64 {
        self.active_flows.get(&id).copied().unwrap_or(0)
    }

    /// New flows per second per backend, each VIP's busiest-over-average ratio and its
    /// heavy hitters, over the time since the previous sample. `new_flows` is each
    /// backend's new-flow counter now, `sources` each source's.
    pub fn sample(
        &mut self,
        now: Instant,
        model: &Model,
        new_flows: HashMap<u32, u64>,
        sources: Vec<(SourceKey, u64)>,
    ) {
        if let Some((then, previous)) = &self.last_sample {
            let seconds = now.duration_since(*then).as_secs_f64().max(1e-3);
            let delta = |id: u32| {
                new_flows
                    .get(&id)
                    .copied()
                    .unwrap_or(0)
                    .saturating_sub(previous.get(&id).copied().unwrap_or(0))
            };
            self.new_flow_rates = model
                .vips
                .iter()
                .flat_map(|v| &v.backends)
                .map(|b| (b.id, delta(b.id) as f64 / seconds))
                .collect();
            self.busiest_over_average = model
                .vips
                .iter()
                .map(|vip| {
                    let deltas: Vec<u64> = vip
                        .backends
                        .iter()
                        .filter(|b| b.in_table())
                        .map(|b| delta(b.id))
                        .collect();
                    (vip.id, busiest_over_average(&deltas))
                })
                .collect();
            let deltas = source_deltas(&sources, &self.last_sources);
            self.top_sources = heavy_hitters(&deltas, seconds);
            let shares = model
                .vips
                .iter()
                .filter(|vip| vip.config.hash == HashMode::SrcIp)
                .filter_map(|vip| Some((vip.id, vip.config.hot_source_share?)))
                .collect();
            self.hot.update(&shares, &deltas);
        }
        self.last_sources = sources.into_iter().collect();
        self.last_sample = Some((now, new_flows));
    }
}

/// Per VIP id, each source's new flows since `previous` (sources without any left out).
pub fn source_deltas(
    sources: &[(SourceKey, u64)],
    previous: &HashMap<SourceKey, u64>,
) -> HashMap<u32, Vec<(SourceKey, u64)>> {
    let mut by_vip: HashMap<u32, Vec<(SourceKey, u64)>> = HashMap::new();
    for (key, count) in sources {
        // A source the LRU evicted and re-inserted restarts from 0: count what it has.
        let before = previous
            .get(key)
            .copied()
            .filter(|b| b <= count)
            .unwrap_or(0);
        if *count > before {
            by_vip
                .entry(key.vip_id)
                .or_default()
                .push((*key, count - before));
        }
    }
    by_vip
}

/// Per VIP id, the sources with the most new flows in `deltas` (over `seconds`), busiest
/// first.
pub fn heavy_hitters(
    deltas: &HashMap<u32, Vec<(SourceKey, u64)>>,
    seconds: f64,
) -> HashMap<u32, Vec<SourceRate>> {
    deltas
        .iter()
        .map(|(vip, counts)| {
            let mut counts: Vec<&(SourceKey, u64)> = counts.iter().collect();
            counts.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.addr.cmp(&b.0.addr)));
            let top = counts
                .into_iter()
                .take(TOP_SOURCES)
                .map(|(key, delta)| SourceRate {
                    address: source_address(key).to_string(),
                    new_flows_per_second: *delta as f64 / seconds,
                })
                .collect();
            (*vip, top)
        })
        .collect()
}

pub fn source_address(key: &SourceKey) -> IpAddr {
    lb_common::addr::from_map(&key.addr, key.family)
}

/// Max over mean of per-backend counts; 0 when all are 0 (nothing to compare).
pub fn busiest_over_average(counts: &[u64]) -> f64 {
    let total: u64 = counts.iter().sum();
    if total == 0 {
        return 0.0;
    }
    let mean = total as f64 / counts.len() as f64;
    *counts.iter().max().expect("non-empty: total > 0") as f64 / mean
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::explain::{VipTarget, flow_key};

    fn web() -> VipTarget {
        "10.0.0.100:80/tcp".parse().unwrap()
    }

    #[test]
    fn a_scan_counts_flows_seen_within_the_idle_time_and_closing_ones_briefly() {
        let mut telemetry = Telemetry::default();
        let idle_time = Duration::from_secs(30);
        let idle = idle_time.as_nanos() as u64;
        let grace = CLOSING_GRACE.as_nanos() as u64;
        let now = 1000 * 1_000_000_000u64;
        let flow = |port: u16, backend_id: u32, age: u64, flags: u32| {
            let key = flow_key(&web(), std::net::SocketAddr::from(([10, 0, 0, 1], port)));
            let entry = FlowEntry {
                backend_id,
                flags,
                last_seen_ns: now - age,
            };
            (key, entry)
        };
        let closing = FLOW_F_CLOSING;
        let flows = vec![
            flow(1, 1, 0, 0),
            flow(2, 1, idle, 0),
            flow(3, 1, idle + 1, 0),
            flow(4, 2, grace, closing),
            flow(5, 2, grace + 1, closing),
            flow(6, 2, idle / 2, closing),
            // A cluster peer's flow: that node's to count.
            flow(7, 1, 2_000_000_000, FLOW_F_LEARNED),
        ];
        telemetry.record_flows(flows, Instant::now(), now, idle_time);
        assert_eq!(telemetry.conntrack_size, 7);
        assert_eq!(
            telemetry.active_flows.get(&1),
            Some(&2),
            "{:?}",
            telemetry.active_flows
        );
        assert_eq!(
            telemetry.active_flows.get(&2),
            Some(&1),
            "{:?}",
            telemetry.active_flows
        );
        assert!(telemetry.last_scan.is_some());
        // A scan replaces the counts, it does not add to them.
        telemetry.record_flows(vec![flow(1, 2, 0, 0)], Instant::now(), now, idle_time);
        assert_eq!(
            telemetry.active_flows,
            HashMap::from([(2, 1)]),
            "{:?}",
            telemetry.active_flows
        );
    }

    #[test]
    fn heavy_hitters_are_the_busiest_sources_of_the_interval_per_vip() {
        let key = |last: u8, vip_id: u32| SourceKey {
            addr: [10, 0, 0, last, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            vip_id,
            family: lb_common::ADDR_FAMILY_V4,
            _pad: [0; 3],
        };
        let previous: HashMap<SourceKey, u64> = [(key(1, 0), 100), (key(2, 0), 5)].into();
        let now = [
            (key(1, 0), 110),
            (key(2, 0), 45),
            (key(3, 0), 2),
            (key(9, 1), 7),
        ];
        let top = heavy_hitters(&source_deltas(&now, &previous), 2.0);
        let vip0: Vec<(&str, f64)> = top[&0]
            .iter()
            .map(|s| (s.address.as_str(), s.new_flows_per_second))
            .collect();
        assert_eq!(
            vip0,
            [("10.0.0.2", 20.0), ("10.0.0.1", 5.0), ("10.0.0.3", 1.0)]
        );
        assert_eq!(top[&1][0].address, "10.0.0.9");
    }

    #[test]
    fn hot_sources_come_only_from_vips_with_the_share() {
        // Two src-ip VIPs, one with hot_source_share, and a 5-tuple one.
        let mut text = String::from("[dataplane]\ninterface = \"eth0\"\n");
        for (name, port, lines) in [
            ("hot", 80, "hash = \"src-ip\"\nhot_source_share = 0.3\n"),
            ("sticky", 81, "hash = \"src-ip\"\n"),
            ("spread", 82, ""),
        ] {
            text += &format!(
                "[[vip]]\nname = \"{name}\"\naddress = \"10.0.0.100\"\nport = {port}\n\
                 protocol = \"tcp\"\n{lines}[vip.health]\nkind = \"none\"\n\
                 [[vip.backend]]\naddress = \"10.0.0.11\"\n"
            );
        }
        let config = crate::config::Config::from_toml(&text).unwrap();
        let mut model = Model::new(7, 16, Duration::ZERO);
        model.update(&config).unwrap();
        let ids: Vec<u32> = model.vips.iter().map(|v| v.id).collect();
        let key = |vip_id: u32| {
            SourceKey::new(
                vip_id,
                [10, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
                lb_common::ADDR_FAMILY_V4,
            )
        };
        let mut telemetry = Telemetry::default();
        let start = Instant::now();
        let counts = |n: u64| ids.iter().map(|&id| (key(id), n)).collect::<Vec<_>>();
        telemetry.sample(start, &model, HashMap::new(), counts(0));
        assert!(
            telemetry.hot.hot.is_empty(),
            "the first sample has no interval"
        );
        // The one source of each VIP opened all of its 100 new flows.
        telemetry.sample(
            start + Duration::from_secs(2),
            &model,
            HashMap::new(),
            counts(100),
        );
        assert_eq!(telemetry.hot.of_vip(ids[0]), [(key(ids[0]), 1.0)]);
        assert!(telemetry.hot.of_vip(ids[1]).is_empty());
        assert!(telemetry.hot.of_vip(ids[2]).is_empty());
        assert_eq!(telemetry.hot.hot.len(), 1);
    }

    #[test]
    fn busiest_over_average_is_max_over_mean() {
        assert_eq!(busiest_over_average(&[0, 0, 0]), 0.0);
        assert_eq!(busiest_over_average(&[10, 10, 10]), 1.0);
        assert_eq!(busiest_over_average(&[30, 0, 0]), 3.0);
        assert!((busiest_over_average(&[12, 10, 8]) - 1.2).abs() < 1e-9);
    }
}
