//! What readers read: a snapshot of the agent's state (`StatusSource`) that the agent
//! publishes after each change (a reload, a runtime command, a health result, a scan's
//! telemetry, an interface change, the announcer's reconcile), into an `ArcSwap`
//! (`Published`), as pingora publishes its load-balancer state. Status, metrics, explain
//! and the API load it without taking the agent's lock: a scrape does not wait for a
//! reload or a health result, and none of those waits for a scrape.
//!
//! Staleness: a change publishes before its lock is let go, so a command's reply, and any
//! read that starts after it, sees the change. The tables the data path holds are not in
//! the copy: they are read from the writer's reports (`Written`) when the status is made,
//! and `tables_written` waits for the write the snapshot asked for. Counters are read
//! through the writer's read side (handles of their own, no lock the writer holds), and
//! so are explain's lookups of the connection, embryonic and hot-source tables
//! (`FlowLookups`): an explain does not wait for a table write.
//!
//! Owns nothing that lives on; may call `model`, `status`, `telemetry`, `announce`,
//! `metrics` (its `Observed` and `Scrape`), `health` (a check's description), `cluster`
//! (its counters), `explain` and `dataplane` (the read sides: counters, explain's lookups).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use arc_swap::ArcSwapOption;
use lb_common::stat;
use tokio::sync::watch;

use crate::{
    announce, cluster,
    config::{AdminState, Config, Forward, MacAddr},
    dataplane::{AttachedMode, CounterReader, Counters, EgressPort, FlowLookups},
    explain::{self, ExplainError, ExplainRequest, Explanation, NextHop},
    health,
    metrics::{Observed, Scrape},
    model::{BackendState, Health, Model, VipState},
    neighbor::Interface,
    status::{
        AgentStatus, BackendStatus, DataplaneStatus, HotSource, InterfaceStatus, NextProgramStatus,
        Start, Status, VipStatus,
    },
    tables::{Desired, SlotWords},
    telemetry::{Telemetry, source_address},
    writer::{Requested, Written},
};

/// The agent's last published snapshot: loaded by readers without a lock, replaced by the
/// agent after each change (`State::publish`).
#[derive(Clone, Default)]
pub struct Published(Arc<ArcSwapOption<StatusSource>>);

impl Published {
    /// The newest snapshot.
    pub fn load(&self) -> Arc<StatusSource> {
        self.0
            .load_full()
            .expect("the agent publishes its first snapshot when it is made")
    }

    pub(crate) fn store(&self, source: StatusSource) {
        self.0.store(Some(Arc::new(source)));
    }
}

/// The scraper of the published snapshot (what `GET /metrics` renders, on the metrics
/// endpoint and the control and operators' sockets).
pub fn scraper(published: Published) -> crate::metrics::Scraper {
    Arc::new(move || published.load().scrape())
}

/// A copy of what a status is made of (`State::status_source`).
pub struct StatusSource {
    pub(crate) model: Model,
    /// The writer's reports: the tables the data path holds, read when a status is made.
    pub(crate) written: watch::Receiver<Written>,
    /// The newest table request when this was published (`tables_written` waits for it).
    pub(crate) requested: u64,
    /// Explain's lookups of the connection, embryonic and hot-source tables (read side).
    pub(crate) lookups: Arc<FlowLookups>,
    pub(crate) counters: Arc<CounterReader>,
    /// The slot words of `stable_slots` VIPs, as the table writer last wrote them.
    pub(crate) slot_words: Arc<SlotWords>,
    /// `stable_slots`: when the connection table last turned over (`turnover`).
    pub(crate) horizon: Arc<crate::turnover::PublishedHorizon>,
    pub(crate) telemetry: Telemetry,
    pub(crate) interface: Interface,
    pub(crate) interface_gone: Option<Instant>,
    /// Several interfaces, as attached (empty with one).
    pub(crate) ports: Vec<EgressPort>,
    pub(crate) mode: Option<AttachedMode>,
    pub(crate) native_refused: Option<String>,
    /// `dataplane.next_program` as last chained (start or reload).
    pub(crate) next_program: Option<NextProgramStatus>,
    pub(crate) config: Config,
    pub(crate) start: Start,
    pub(crate) announce: announce::State,
    pub(crate) cluster: Option<cluster::Shared>,
    pub(crate) observed: Observed,
    /// The agent's own status; its uptime counts from `started`, when it is read.
    pub(crate) agent: AgentStatus,
    pub(crate) started: Instant,
}

/// Why a backend's state or health differs from what the file and runtime commands
/// make it, when its agent check is the reason: it said drain or maint while the admin
/// state is ready (which `lb ready` does not override), or down.
fn agent_reason(b: &BackendState) -> Option<String> {
    let mut why = Vec::new();
    if b.config.state == AdminState::Ready
        && let Some(said) = b.agent.admin.filter(|a| *a != AdminState::Ready)
    {
        why.push(format!(
            "agent check says {said} (until it says ready; lb ready does not override it)"
        ));
    }
    if b.agent.down {
        why.push("agent check says down".to_string());
    }
    (!why.is_empty()).then(|| why.join("; "))
}

impl StatusSource {
    /// The tables the data path holds (the last write's).
    pub fn desired(&self) -> Arc<Desired> {
        self.written.borrow().desired.clone()
    }

    /// Whether the tables this snapshot asked for are written (or their write failed).
    pub fn tables_are_current(&self) -> bool {
        self.written.borrow().ticket >= self.requested
    }

    /// The write this snapshot asked for, to wait for.
    pub fn tables_written(&self) -> Requested {
        Requested::of(self.requested, self.written.clone())
    }

    /// `lb explain`: over the tables the data path holds and its connection table.
    pub fn explain(
        &self,
        request: &ExplainRequest,
        now_ns: u64,
    ) -> Result<Explanation, ExplainError> {
        let desired = self.desired();
        let view = explain::View {
            model: &self.model,
            desired: &desired,
            flows: self.lookups.as_ref(),
            slot_words: &self.slot_words,
            flow_idle: self.config.dataplane.flow_idle_timeout,
            interfaces: &self.config.dataplane.interfaces,
        };
        explain::explain(&view, request, now_ns)
    }

    /// What `lb status` shows.
    pub fn status(&self) -> anyhow::Result<Status> {
        Ok(self.status_and_outcomes()?.0)
    }

    /// What one metrics scrape renders.
    pub fn scrape(&self) -> anyhow::Result<Scrape> {
        let (status, outcomes) = self.status_and_outcomes()?;
        Ok(Scrape {
            status,
            outcomes,
            observed: self.observed.clone(),
        })
    }

    /// The status, and the outcome counters it was made from (indexed by `stat`).
    fn status_and_outcomes(&self) -> anyhow::Result<(Status, Vec<u64>)> {
        let vip_ids: Vec<u32> = self.model.vips.iter().map(|v| v.id).collect();
        let counters = self.counters.counters(&vip_ids, &self.backend_ids())?;
        let slots = Model::slot_counts(&self.desired());
        let now = Instant::now();
        let ids = self.model.backend_id_usage(now);
        let vips = self
            .model
            .vips
            .iter()
            .map(|vip| {
                let traffic = counters.vips.get(&vip.id).copied().unwrap_or_default();
                let backends = vip
                    .backends
                    .iter()
                    .map(|b| self.backend_status(vip, b, &counters, &slots, now))
                    .collect();
                let quic = counters.quic.get(&vip.id).copied().unwrap_or_default();
                self.vip_status(vip, (traffic, quic), backends, now)
            })
            .collect();
        let status = Status {
            dataplane: DataplaneStatus {
                interface: self.interface.name.clone(),
                interface_mac: self
                    .interface_gone
                    .is_none()
                    .then(|| self.interface.mac.to_string()),
                xdp_mode: self.mode,
                native_refused: self.native_refused.clone(),
                detached: self.interface_gone.map(|since| {
                    format!(
                        "interface {} is gone (for {:.0}s); attaches again when an \
                         interface of that name returns",
                        self.interface.name,
                        now.saturating_duration_since(since).as_secs_f64()
                    )
                }),
                maglev_table_size: self.model.table_size,
                conntrack_entries: self.telemetry.conntrack_size,
                conntrack_entries_in_use: self.telemetry.conntrack_size,
                conntrack_capacity: u64::from(self.config.dataplane.conntrack_entries),
                conntrack_scan_age_seconds: self
                    .telemetry
                    .last_scan
                    .map(|at| now.saturating_duration_since(at).as_secs_f64()),
                start: self.start.to_string(),
                backend_id_capacity: ids.capacity,
                backend_ids_in_use: ids.in_use,
                backend_ids_held: ids.held,
                interfaces: self.interface_status(&counters),
                next_program: self.next_program.clone(),
            },
            vips,
            counters: stat::NAMES
                .iter()
                .zip(&counters.outcomes)
                .map(|(name, value)| (name.to_string(), *value))
                .collect(),
            node: announce::node_status(&self.announce_view(), now),
            cluster: self.cluster.as_ref().map(|shared| {
                shared
                    .lock()
                    .expect("cluster stats poisoned")
                    .status(&counters.outcomes, now)
            }),
            agent: AgentStatus {
                uptime_seconds: self.started.elapsed().as_secs(),
                ..self.agent.clone()
            },
        };
        Ok((status, counters.outcomes))
    }

    /// Each data-path interface: several as `ports` has them, with what left by each;
    /// one as `interface`, with every VIP's traffic (all of it leaves there).
    fn interface_status(&self, counters: &Counters) -> Vec<InterfaceStatus> {
        if self.ports.is_empty() {
            let attached = self.interface_gone.is_none();
            return vec![InterfaceStatus {
                name: self.interface.name.clone(),
                mac: attached.then(|| self.interface.mac.to_string()),
                xdp_mode: self.mode,
                forwarded_packets: counters.vips.values().map(|c| c.packets).sum(),
                forwarded_bytes: counters.vips.values().map(|c| c.bytes).sum(),
            }];
        }
        self.ports
            .iter()
            .enumerate()
            .map(|(i, port)| {
                let sent = counters.egress.get(i).copied().unwrap_or_default();
                // The first is followed as a single interface is (`interface_gone`).
                let here = match i {
                    0 => self.interface_gone.is_none(),
                    _ => port.ifindex != 0,
                };
                InterfaceStatus {
                    name: port.name.clone(),
                    mac: here.then(|| MacAddr(port.mac).to_string()),
                    xdp_mode: port.mode.filter(|_| here),
                    forwarded_packets: sent.packets,
                    forwarded_bytes: sent.bytes,
                }
            })
            .collect()
    }

    /// One backend's status: its state, its counters and its slots in the table.
    fn backend_status(
        &self,
        vip: &VipState,
        b: &BackendState,
        counters: &Counters,
        slots: &BTreeMap<u32, usize>,
        now: Instant,
    ) -> BackendStatus {
        let traffic = counters.backends.get(&b.id).copied().unwrap_or_default();
        let effective = b.effective_weight(&vip.config, now);
        BackendStatus {
            address: b.config.address.to_string(),
            weight: b.config.weight,
            state: b.admin_status(),
            // Not checked in maintenance: what it was is no news.
            health: if b.is_maint() {
                Health::Unknown
            } else {
                b.health
            },
            mac: b.mac.map(|m| m.to_string()),
            next_hop: b.next_hop.map(|hop| NextHop {
                address: hop.to_string(),
                mac: b.mac.map(|m| m.to_string()),
            }),
            in_table: b.in_table(),
            slots: slots.get(&b.id).copied().unwrap_or(0),
            active_flows: self.telemetry.flows_of(b.id),
            packets: traffic.packets,
            bytes: traffic.bytes,
            new_flows: traffic.new_flows,
            check: health::describe_check(
                vip.config.health_of(&b.config),
                vip.config.health_port_of(&b.config),
            ),
            consecutive: b.streak,
            last_check: b.last_check.clone(),
            local_check_errors: b.local_check_errors,
            last_local_error: b.last_local_error.clone(),
            new_flows_per_second: self
                .telemetry
                .new_flow_rates
                .get(&b.id)
                .copied()
                .unwrap_or(0.0),
            effective_weight: effective.weight as f64 / crate::model::weights::SCALE as f64,
            weight_reason: effective.reason,
            agent_error: b.agent.error.clone(),
            handshakes: crate::health::outlier::totals(&traffic),
            outlier: vip
                .config
                .outlier
                .is_some()
                .then(|| crate::health::outlier::status(&b.outlier, now)),
            state_reason: agent_reason(b),
            server_id: b.config.server_id.filter(|_| vip.config.quic),
        }
    }

    fn vip_status(
        &self,
        vip: &VipState,
        (traffic, quic): (lb_common::TrafficCounters, lb_common::quic::QuicCounters),
        backends: Vec<BackendStatus>,
        now: Instant,
    ) -> VipStatus {
        // Healthy: not failed by its checks, and reachable (its MAC is known); unhealthy:
        // failed or unreachable. A backend in maintenance is neither: it is not checked.
        let healthy = vip
            .backends
            .iter()
            .filter(|b| !b.is_maint() && b.health != Health::Down && b.mac.is_some())
            .count();
        let unchecked = vip.backends.iter().filter(|b| b.is_maint()).count();
        let (announced, announcement) = announce::describe_vip(&self.announce_view(), vip, now);
        VipStatus {
            name: vip.config.name.clone(),
            announced,
            announcement,
            address: vip.config.address.to_string(),
            port: vip.config.port,
            protocol: vip.config.protocol,
            hash: vip.config.hash,
            forward: vip.config.forward,
            gue_port: (vip.config.forward == Forward::Gue).then(|| vip.config.gue_port()),
            packets: traffic.packets,
            bytes: traffic.bytes,
            new_flows: traffic.new_flows,
            healthy_backends: healthy,
            unhealthy_backends: vip.backends.len() - healthy - unchecked,
            top_sources: self
                .telemetry
                .top_sources
                .get(&vip.id)
                .cloned()
                .unwrap_or_default(),
            hot_sources: self
                .telemetry
                .hot
                .of_vip(vip.id)
                .into_iter()
                .map(|(key, share)| HotSource {
                    address: source_address(&key).to_string(),
                    share,
                })
                .collect(),
            busiest_over_average: self
                .telemetry
                .busiest_over_average
                .get(&vip.id)
                .copied()
                .unwrap_or(0.0),
            quic: vip.config.quic,
            quic_routed_by_cid: quic.routed_by_cid,
            quic_cid_unknown: quic.cid_unknown,
            stable_slots: vip.config.stable_slots,
            changed_slots: self.slot_words.changed(vip.id),
            turned_over_seconds_ago: vip
                .config
                .stable_slots
                .then(|| self.horizon.get())
                .flatten()
                .map(|horizon| horizon.elapsed().as_secs()),
            backends,
        }
    }

    fn announce_view(&self) -> announce::View<'_> {
        announce::View {
            config: self.config.announce.as_ref(),
            vips: &self.model.vips,
            state: &self.announce,
        }
    }

    fn backend_ids(&self) -> Vec<u32> {
        self.model.backends().map(|b| b.id).collect()
    }
}
