//! `lb run`: load and attach the data path, keep its tables equal to the model, serve
//! the control socket, and stop cleanly on SIGINT/SIGTERM.

use std::{
    collections::{HashMap, HashSet},
    net::IpAddr,
    path::PathBuf,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::Context;
use lb_common::{SourceKey, stat};
use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;

use crate::{
    EBPF_OBJECT,
    config::{AdminState, BackendConfig, Config, HashMode, VipConfig},
    control::{self, BackendStatus, DataplaneStatus, SourceRate, Status, TOP_SOURCES, VipStatus},
    dataplane::{
        AttachedMode, AyaDataplane, Dataplane, Found, LoadOptions, remove_pins, vip_capacity,
    },
    explain::VipTarget,
    explain::monotonic_ns,
    health,
    metrics::{self, Observed},
    model::{Health, Model},
    neighbor::{Interface, Neighbors},
    tables::{Desired, TableWriter},
};

/// How often the neighbour table is re-read for backend MAC changes.
const NEIGHBOR_REFRESH: Duration = Duration::from_secs(1);
/// A closing flow (client FIN seen) still counts as active while seen this recently.
const CLOSING_GRACE: Duration = Duration::from_secs(3);
/// How often live flows are counted per backend (status, draining).
const FLOW_SCAN: Duration = Duration::from_secs(2);
/// How long start-up waits for missing backend MACs before serving without them.
const FIRST_RESOLVE_WAIT: Duration = Duration::from_secs(3);

/// Everything the agent's tasks share, behind one mutex (operations on it are short).
pub struct Shared {
    /// The file `reload` re-reads.
    pub config_path: PathBuf,
    pub config: Config,
    pub model: Model,
    pub dataplane: Box<dyn Dataplane + Send>,
    pub writer: TableWriter,
    pub desired: Desired,
    pub interface: Interface,
    pub mode: AttachedMode,
    /// Per backend id: connection-table entries seen within `flow_idle_timeout`, as of
    /// the last scan (`record_flows`).
    pub active_flows: HashMap<u32, u64>,
    /// Connection-table entries at the last scan.
    pub conntrack_size: u64,
    /// When `active_flows` was last counted.
    pub last_scan: Option<Instant>,
    /// Changes made at runtime (`lb drain`, `lb backend add` ...), which a reload of the
    /// file undoes: the file is the source of truth.
    pub runtime_changes: Vec<String>,
    /// Backends `lb backend remove` drains, to delete once drained: (VIP name, address).
    pub remove_when_drained: HashSet<(String, IpAddr)>,
    /// Health-check durations and transitions, for metrics.
    pub observed: Observed,
    /// New flows per second per backend id over the last sample interval.
    pub new_flow_rates: HashMap<u32, f64>,
    /// Per VIP id: new flows of the busiest in-table backend over the average, last
    /// interval (0 when there were none): the hot-spot signal.
    pub busiest_over_average: HashMap<u32, f64>,
    /// The previous sample: when, and each backend's new-flow counter then.
    pub last_sample: Option<(Instant, HashMap<u32, u64>)>,
    /// Per VIP id: the heavy hitters of the last interval.
    pub top_sources: HashMap<u32, Vec<SourceRate>>,
    /// Each source's new-flow count at the previous sample.
    last_sources: HashMap<SourceKey, u64>,
    /// How this agent found the data path: "fresh", "adopted", or "replaced (why)".
    pub start: String,
    /// Announcing VIPs to routers (`[announce]`) and the node's drain state.
    pub announce: crate::announce::State,
}

impl Shared {
    /// A freshly started agent's state; `sync` writes its tables.
    pub fn new(
        config_path: PathBuf,
        config: Config,
        model: Model,
        dataplane: Box<dyn Dataplane + Send>,
        interface: Interface,
        mode: AttachedMode,
    ) -> Self {
        Self {
            config_path,
            writer: TableWriter::new(config.dataplane.maglev_table_size),
            config,
            model,
            dataplane,
            desired: Desired::default(),
            interface,
            mode,
            active_flows: HashMap::new(),
            conntrack_size: 0,
            last_scan: None,
            runtime_changes: Vec::new(),
            remove_when_drained: HashSet::new(),
            observed: Observed::default(),
            new_flow_rates: HashMap::new(),
            busiest_over_average: HashMap::new(),
            last_sample: None,
            top_sources: HashMap::new(),
            last_sources: HashMap::new(),
            start: "fresh".to_string(),
            announce: Default::default(),
        }
    }

    /// Recomputes the tables and writes what changed.
    pub fn sync(&mut self) -> anyhow::Result<()> {
        let desired = self.model.desired();
        let report = self.writer.apply(self.dataplane.as_mut(), &desired)?;
        // A switch may write no slot: the idle generation can already hold the new table
        // (a backend that goes down again, back to the table before it came up).
        if report.slots_written > 0 || report.tables_switched > 0 || report.vips_removed > 0 {
            tracing::info!(
                "tables updated: {} slots written, {} tables switched, {} VIPs removed",
                report.slots_written,
                report.tables_switched,
                report.vips_removed
            );
        }
        self.desired = desired;
        Ok(())
    }

    /// Applies neighbour-table MACs to backends without a configured MAC. Returns whether
    /// anything changed.
    pub fn learn_macs(
        &mut self,
        table: &HashMap<std::net::IpAddr, crate::config::MacAddr>,
    ) -> bool {
        let mut changed = false;
        for b in self.model.backends_mut() {
            if b.config.mac.is_some() {
                continue;
            }
            if let Some(mac) = table.get(&b.config.address)
                && b.mac != Some(*mac)
            {
                tracing::info!("backend {} is at {mac}", b.config.address);
                b.mac = Some(*mac);
                changed = true;
            }
        }
        changed
    }

    /// Makes the running agent follow `new`: unchanged backends keep their ids, health
    /// and flows; the tables are rewritten where they differ. Settings fixed at load
    /// time are refused, and then nothing changes.
    pub fn reload(&mut self, new: Config) -> Result<Vec<String>, ReloadError> {
        let old = &self.config;
        let fixed = [
            (
                "dataplane.interface",
                old.dataplane.interface != new.dataplane.interface,
            ),
            (
                "dataplane.xdp_mode",
                old.dataplane.xdp_mode != new.dataplane.xdp_mode,
            ),
            (
                "dataplane.maglev_table_size",
                old.dataplane.maglev_table_size != new.dataplane.maglev_table_size,
            ),
            (
                "dataplane.conntrack_entries",
                old.dataplane.conntrack_entries != new.dataplane.conntrack_entries,
            ),
            (
                "dataplane.flow_idle_timeout",
                old.dataplane.flow_idle_timeout != new.dataplane.flow_idle_timeout,
            ),
            (
                "dataplane.conntrack_insert_limit",
                old.dataplane.conntrack_insert_limit != new.dataplane.conntrack_insert_limit,
            ),
            (
                "dataplane.pin_path",
                old.dataplane.pin_path != new.dataplane.pin_path,
            ),
            ("debug", old.debug != new.debug),
            ("control.socket", old.control.socket != new.control.socket),
            // The endpoint is bound once, at start.
            (
                "control.metrics",
                old.control.metrics != new.control.metrics,
            ),
            (
                "announce (table, protocol, device)",
                !crate::announce::same_routes(&old.announce, &new.announce),
            ),
        ];
        if let Some((field, _)) = fixed.iter().find(|(_, changed)| *changed) {
            return Err(ReloadError::NeedsRestart(field));
        }
        let mut model = self.model.clone();
        model.update(&new).map_err(ReloadError::Model)?;
        let mut changes: Vec<String> = std::mem::take(&mut self.runtime_changes)
            .into_iter()
            .map(|change| format!("undoes runtime change: {change}"))
            .collect();
        changes.extend(describe_changes(&self.model, &model));
        self.remove_when_drained.clear();
        self.model = model;
        self.config = new;
        self.sync().map_err(ReloadError::Write)?;
        Ok(changes)
    }

    /// Applies a runtime change to the running configuration: validated like a file,
    /// then applied as a diff.
    fn change(
        &mut self,
        what: String,
        edit: impl FnOnce(&mut Config) -> Result<(), ControlError>,
    ) -> Result<String, ControlError> {
        let mut config = self.config.clone();
        edit(&mut config)?;
        config.validate()?;
        let mut model = self.model.clone();
        model.update(&config)?;
        self.model = model;
        self.config = config;
        self.sync().map_err(ControlError::Write)?;
        tracing::info!("runtime change: {what}");
        self.runtime_changes.push(what.clone());
        Ok(what)
    }

    /// `lb drain|ready|maint VIP BACKEND`.
    pub fn set_admin_state(
        &mut self,
        vip: &VipTarget,
        backend: IpAddr,
        state: AdminState,
    ) -> Result<String, ControlError> {
        let what = format!("{vip} backend {backend} -> {state}");
        let target = *vip;
        self.change(what, |config| {
            find_backend(config, &target, backend)?.state = state;
            Ok(())
        })
    }

    /// `lb backend add VIP BACKEND [--weight N]`: takes traffic once its MAC is known and
    /// (when checked) its health checks pass.
    pub fn add_backend(
        &mut self,
        vip: &VipTarget,
        backend: IpAddr,
        weight: u32,
    ) -> Result<String, ControlError> {
        let what = format!("{vip} backend {backend} added (weight {weight})");
        let target = *vip;
        self.change(what, |config| {
            let vip = find_vip(config, &target)?;
            if vip.backends.iter().any(|b| b.address == backend) {
                return Err(ControlError::BackendExists(target, backend));
            }
            vip.backends.push(BackendConfig {
                address: backend,
                weight,
                mac: None,
                state: AdminState::Ready,
                health: None,
            });
            Ok(())
        })
    }

    /// `lb backend remove VIP BACKEND`: drains it, and deletes it once drained.
    pub fn remove_backend(
        &mut self,
        vip: &VipTarget,
        backend: IpAddr,
    ) -> Result<String, ControlError> {
        let name = find_vip(&mut self.config, vip)?.name.clone();
        let what = format!(
            "{vip} backend {backend} -> {}; removed once drained",
            AdminState::Drain
        );
        let target = *vip;
        let what = self.change(what, |config| {
            find_backend(config, &target, backend)?.state = AdminState::Drain;
            Ok(())
        })?;
        self.remove_when_drained.insert((name, backend));
        Ok(what)
    }

    /// Marks draining backends drained once their flows are gone (per the last scan) or
    /// their VIP's `drain_timeout` passed, and deletes the ones `remove_backend` asked
    /// for. Rewrites the tables when anything changed.
    pub fn advance_drains(&mut self, now: Instant) -> anyhow::Result<()> {
        let last_scan = self.last_scan;
        let mut changed = false;
        for vip in &mut self.model.vips {
            for b in &mut vip.backends {
                let Some(started) = b.drain_started else {
                    continue;
                };
                if b.drained {
                    continue;
                }
                let flows = self.active_flows.get(&b.id).copied().unwrap_or(0);
                let counted_since = last_scan.is_some_and(|scan| scan > started);
                let timed_out = now.duration_since(started) >= vip.config.drain_timeout;
                if (counted_since && flows == 0) || timed_out {
                    b.drained = true;
                    changed = true;
                    let why = if timed_out && flows > 0 {
                        format!(
                            "drain_timeout passed with {flows} flow(s) left; they are re-hashed"
                        )
                    } else {
                        "no active flows left".to_string()
                    };
                    tracing::info!(
                        "backend {} of vip {} drained: {why}",
                        b.config.address,
                        vip.config.name
                    );
                }
            }
        }
        let removable: Vec<(String, IpAddr)> = self
            .remove_when_drained
            .iter()
            .filter(|(vip, address)| {
                self.model.vips.iter().any(|v| {
                    v.config.name == *vip
                        && v.backends
                            .iter()
                            .any(|b| b.config.address == *address && b.drained)
                })
            })
            .cloned()
            .collect();
        if !removable.is_empty() {
            let mut config = self.config.clone();
            for (vip, address) in &removable {
                if let Some(v) = config.vips.iter_mut().find(|v| v.name == *vip) {
                    v.backends.retain(|b| b.address != *address);
                }
            }
            // On a copy: a failed update must leave the running model whole.
            let mut model = self.model.clone();
            model.update(&config)?;
            self.model = model;
            for (vip, address) in &removable {
                self.remove_when_drained.remove(&(vip.clone(), *address));
                tracing::info!("backend {address} of vip {vip} removed");
            }
            self.config = config;
            changed = true;
        }
        if changed {
            self.sync()?;
        }
        Ok(())
    }

    /// Counts live entries per backend from a scan of the connection table that began
    /// at `started` (`started_ns` on the data path's clock). The scan counts as of its
    /// start: a flow that began later may have landed where the scan had already read.
    pub fn record_flows(
        &mut self,
        flows: Vec<(lb_common::FlowKey, lb_common::FlowEntry)>,
        started: Instant,
        started_ns: u64,
    ) {
        let idle_ns = self.config.dataplane.flow_idle_timeout.as_nanos() as u64;
        self.conntrack_size = flows.len() as u64;
        self.last_scan = Some(started);
        self.active_flows.clear();
        for (_, entry) in flows {
            // A client's FIN only half-closes: the backend may still be sending, so a
            // closing flow counts while its packets (the client's ACKs) keep coming.
            let closing = entry.flags & lb_common::FLOW_F_CLOSING != 0;
            let window = if closing {
                CLOSING_GRACE.as_nanos() as u64
            } else {
                idle_ns
            };
            if started_ns.saturating_sub(entry.last_seen_ns) <= window {
                *self.active_flows.entry(entry.backend_id).or_default() += 1;
            }
        }
    }

    /// New flows per second per backend, and each VIP's busiest-over-average ratio, over
    /// the time since the previous sample.
    pub fn sample_rates(&mut self, now: Instant) -> anyhow::Result<()> {
        let ids: Vec<u32> = self
            .model
            .vips
            .iter()
            .flat_map(|v| v.backends.iter().map(|b| b.id))
            .collect();
        let counters = self.dataplane.counters(&[], &ids)?;
        let current: HashMap<u32, u64> = counters
            .backends
            .iter()
            .map(|(id, c)| (*id, c.new_flows))
            .collect();
        if let Some((then, previous)) = &self.last_sample {
            let seconds = now.duration_since(*then).as_secs_f64().max(1e-3);
            let delta = |id: &u32| {
                current
                    .get(id)
                    .copied()
                    .unwrap_or(0)
                    .saturating_sub(previous.get(id).copied().unwrap_or(0))
            };
            self.new_flow_rates = ids
                .iter()
                .map(|id| (*id, delta(id) as f64 / seconds))
                .collect();
            self.busiest_over_average = self
                .model
                .vips
                .iter()
                .map(|vip| {
                    let deltas: Vec<u64> = vip
                        .backends
                        .iter()
                        .filter(|b| b.in_table())
                        .map(|b| delta(&b.id))
                        .collect();
                    (vip.id, busiest_over_average(&deltas))
                })
                .collect();
        }
        let sources = self.dataplane.sources()?;
        if let Some((then, _)) = &self.last_sample {
            let seconds = now.duration_since(*then).as_secs_f64().max(1e-3);
            self.top_sources = heavy_hitters(&sources, &self.last_sources, seconds);
        }
        self.last_sources = sources.into_iter().collect();
        self.last_sample = Some((now, current));
        Ok(())
    }

    pub fn status(&self) -> anyhow::Result<Status> {
        let vip_ids: Vec<u32> = self.model.vips.iter().map(|v| v.id).collect();
        let backend_ids: Vec<u32> = self
            .model
            .vips
            .iter()
            .flat_map(|v| v.backends.iter().map(|b| b.id))
            .collect();
        let counters = self.dataplane.counters(&vip_ids, &backend_ids)?;
        let slots = Model::slot_counts(&self.desired);
        let now = Instant::now();
        let vips = self
            .model
            .vips
            .iter()
            .map(|vip| {
                let traffic = counters.vips.get(&vip.id).copied().unwrap_or_default();
                let backends: Vec<BackendStatus> = vip
                    .backends
                    .iter()
                    .map(|b| {
                        let traffic = counters.backends.get(&b.id).copied().unwrap_or_default();
                        BackendStatus {
                            address: b.config.address.to_string(),
                            weight: b.config.weight,
                            state: b.admin_word().to_string(),
                            health: match b.health {
                                Health::Up => "up",
                                Health::Down => "down",
                                Health::Unknown => "unknown",
                            }
                            .to_string(),
                            mac: b.mac.map(|m| m.to_string()),
                            in_table: b.in_table(),
                            slots: slots.get(&b.id).copied().unwrap_or(0),
                            active_flows: self.active_flows.get(&b.id).copied().unwrap_or(0),
                            packets: traffic.packets,
                            bytes: traffic.bytes,
                            new_flows: traffic.new_flows,
                            consecutive: b.streak,
                            last_check: b.last_check.clone(),
                            new_flows_per_second: self
                                .new_flow_rates
                                .get(&b.id)
                                .copied()
                                .unwrap_or(0.0),
                        }
                    })
                    .collect();
                // Healthy: not failed by its checks, and reachable (its MAC is known).
                let healthy = vip
                    .backends
                    .iter()
                    .filter(|b| b.health != Health::Down && b.mac.is_some())
                    .count();
                let (announced, announcement) = crate::announce::describe_vip(self, vip, now);
                VipStatus {
                    name: vip.config.name.clone(),
                    announced,
                    announcement,
                    address: vip.config.address.to_string(),
                    port: vip.config.port,
                    protocol: vip.config.protocol.to_string(),
                    hash: match vip.config.hash {
                        HashMode::FiveTuple => "5-tuple",
                        HashMode::SrcIp => "src-ip",
                    }
                    .to_string(),
                    packets: traffic.packets,
                    bytes: traffic.bytes,
                    new_flows: traffic.new_flows,
                    healthy_backends: healthy,
                    unhealthy_backends: vip.backends.len() - healthy,
                    top_sources: self.top_sources.get(&vip.id).cloned().unwrap_or_default(),
                    busiest_over_average: self
                        .busiest_over_average
                        .get(&vip.id)
                        .copied()
                        .unwrap_or(0.0),
                    backends,
                }
            })
            .collect();
        let counters = stat::NAMES
            .iter()
            .zip(&counters.outcomes)
            .map(|(name, value)| (name.to_string(), *value))
            .collect();
        Ok(Status {
            dataplane: DataplaneStatus {
                interface: self.interface.name.clone(),
                interface_mac: self.interface.mac.to_string(),
                xdp_mode: self.mode.to_string(),
                maglev_table_size: self.model.table_size,
                conntrack_entries: self.conntrack_size,
                conntrack_scan_age_seconds: self
                    .last_scan
                    .map(|at| now.saturating_duration_since(at).as_secs_f64()),
                start: self.start.clone(),
            },
            vips,
            counters,
            node: crate::announce::node_status(self, now),
        })
    }
}

/// Runs the agent until SIGINT or SIGTERM.
/// What `lb run` does when it stops.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnExit {
    /// The program stays attached with its last tables (the default): a restarted agent
    /// adopts it without dropping a packet.
    StayAttached,
    /// Remove the pins: the program detaches and its maps are freed.
    Detach,
}

pub async fn run(config_path: PathBuf, on_exit: OnExit) -> anyhow::Result<()> {
    let config = Config::load(&config_path)?;
    let neighbors = Neighbors::open(&config.dataplane.interface)
        .await
        .context("reading the data-path interface")?;
    let interface = neighbors.interface().clone();

    let new_model = |vip_capacity: u32| {
        Model::new(
            config.dataplane.maglev_table_size,
            vip_capacity,
            config.dataplane.flow_idle_timeout,
        )
    };
    // A configuration the model refuses stops the start before any pin is touched.
    new_model(vip_capacity(config.vips.len())).update(&config)?;
    // Before attaching: a device that cannot be made stops the start with nothing changed.
    let announcer = match &config.announce {
        Some(announce) => Some(
            crate::announce::Announcer::open(announce)
                .await
                .context("setting up [announce]")?,
        ),
        None => None,
    };

    let mut options = LoadOptions::from_config(&config, interface.mac.0);
    options.ifindex = interface.index;
    let pin_dir = config.dataplane.pin_dir();
    ensure_bpffs(&pin_dir)?;
    let (mut dataplane, found) = AyaDataplane::load_pinned(EBPF_OBJECT, options, &pin_dir)
        .with_context(|| format!("loading the XDP program (pins in {})", pin_dir.display()))?;
    let flow_reader = Arc::new(dataplane.flow_reader()?);
    let capture = match &config.debug.capture {
        Some(path) => Some((dataplane.take_capture()?, path.clone())),
        None => None,
    };
    let mut writer = TableWriter::new(config.dataplane.maglev_table_size);
    // What the model starts from: the adopted maps' backends and ids, or, after replacing
    // incompatible ones, the backends the old program served (kept while checks start).
    let mut start_from = None;
    let start = match &found {
        Found::Nothing => "fresh".to_string(),
        Found::Compatible(_) => {
            let adopted = dataplane.adopted(config.dataplane.maglev_table_size)?;
            tracing::info!(
                "adopting the pinned data path in {}: {} VIP(s), {} backend(s); flows continue",
                pin_dir.display(),
                adopted.vips.len(),
                adopted.backends.len()
            );
            writer.adopt(&adopted);
            start_from = Some(adopted);
            "adopted".to_string()
        }
        Found::Incompatible(why) => {
            start_from = dataplane.previous().cloned();
            tracing::warn!(
                "replacing the pinned data path in {}: {why}; its connection table is lost",
                pin_dir.display()
            );
            format!("replaced ({why}); connection table lost")
        }
    };
    // The pinned maps' VIP capacity, which may exceed what this config needs.
    let mut model = new_model(dataplane.options().vip_capacity);
    if let Some(adopted) = &start_from {
        model.adopt(adopted);
    }
    model.update(&config)?;
    resolve_first_macs(&neighbors, &mut model).await;
    // Tables first, then attach (or swap the program on the pinned link): the program
    // never runs on empty maps.
    let desired = model.desired();
    let report = writer.apply(&mut dataplane, &desired)?;
    tracing::info!(
        "tables written: {} slots, {} table switches, {} backends",
        report.slots_written,
        report.tables_switched,
        report.backends_written
    );
    let mode = dataplane.attach_pinned(&interface.name, config.dataplane.xdp_mode)?;

    let mut shared = Shared::new(
        config_path,
        config.clone(),
        model,
        Box::new(dataplane),
        interface.clone(),
        mode,
    );
    shared.writer = writer;
    shared.desired = desired;
    shared.start = start;
    let shared = Arc::new(Mutex::new(shared));
    let shutdown = CancellationToken::new();
    if let Some((ring, path)) = capture {
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            if let Err(error) = crate::capture::run(ring, &path, shutdown).await {
                tracing::error!("debug capture stopped: {error:#}");
            }
        });
    }
    let health_tasks = HealthTasks {
        running: Arc::new(Mutex::new(HashSet::new())),
        shutdown: shutdown.clone(),
    };
    let control = control::serve(
        config.control.socket.clone(),
        shared.clone(),
        health_tasks.clone(),
    )
    .await?;
    health::spawn_checks(&shared, &health_tasks);
    let metrics = match config.control.metrics {
        Some(address) => Some(metrics::serve(address, shared.clone(), shutdown.clone()).await?),
        None => None,
    };
    let announcer = match (announcer, &config.announce) {
        (Some(announcer), Some(announce)) => {
            Some(crate::announce::start(shared.clone(), announcer, announce))
        }
        _ => None,
    };

    println!(
        "serving {} VIP(s) on {} (xdp mode: {mode}); control socket {}",
        config.vips.len(),
        interface.name,
        config.control.socket.display()
    );

    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sigint = signal(SignalKind::interrupt())?;
    let mut sighup = signal(SignalKind::hangup())?;
    let mut refresh = tokio::time::interval(NEIGHBOR_REFRESH);
    let mut flow_scan = tokio::time::interval(FLOW_SCAN);
    // After a slow tick, the next comes a full period later, not at once: rates are
    // sampled over a real interval.
    flow_scan.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // When the last scan began and what it took: a scan's cost grows with the table (a
    // million entries: about 0.3 s of CPU), so a large table is scanned less often, at
    // most a tenth of one CPU's time.
    let mut last_scan: Option<(Instant, Duration)> = None;
    loop {
        tokio::select! {
            _ = sigterm.recv() => break,
            _ = sigint.recv() => break,
            _ = sighup.recv() => {
                // `reload` logs what it did, or why it refused.
                let _ = reload(&shared, &health_tasks);
            }
            _ = flow_scan.tick() => {
                let due = last_scan.is_none_or(|(at, took)| at.elapsed() >= took * 10);
                // The scan reads the whole connection table: off the agent's lock.
                let scanned = if due {
                    let reader = flow_reader.clone();
                    let (started, started_ns) = (Instant::now(), monotonic_ns());
                    let scanned = tokio::task::spawn_blocking(move || reader.flows()).await;
                    last_scan = Some((started, started.elapsed()));
                    Some((scanned, started, started_ns))
                } else {
                    None
                };
                let mut shared = shared.lock().expect("agent state poisoned");
                match scanned {
                    Some((Ok(Ok(flows)), started, started_ns)) => {
                        shared.record_flows(flows, started, started_ns);
                    }
                    Some((Ok(Err(error)), ..)) => {
                        tracing::warn!("connection-table scan: {error:#}");
                    }
                    Some((Err(error), ..)) => tracing::warn!("connection-table scan: {error}"),
                    None => {}
                }
                if let Err(error) = shared.sample_rates(Instant::now()) {
                    tracing::warn!("sampling counters: {error:#}");
                }
                if let Err(error) = shared.advance_drains(Instant::now()) {
                    tracing::warn!("draining: {error:#}");
                }
            }
            _ = refresh.tick() => {
                if let Err(error) = follow_neighbors(&neighbors, &shared).await {
                    tracing::warn!("neighbour refresh: {error:#}");
                }
            }
        }
    }
    // Withdraw first: routers move the traffic while this node still forwards it.
    if let Some(announcer) = announcer {
        announcer.stop().await;
    }
    shutdown.cancel();
    let _ = control.await;
    if let Some(metrics) = metrics {
        let _ = metrics.await;
    }
    match on_exit {
        OnExit::StayAttached => tracing::info!(
            "stopping; the program stays attached to {} with its last tables (pins in {}; \
             `lb detach --config FILE` removes it)",
            interface.name,
            pin_dir.display()
        ),
        OnExit::Detach => {
            tracing::info!("stopping: detaching from {}", interface.name);
            remove_pins(&pin_dir)?;
        }
    }
    drop(shared);
    Ok(())
}

/// Makes sure `pin_dir` lies on a bpf filesystem: mounts one at /sys/fs/bpf when the
/// directory is under it and none is mounted (a fresh machine has none); refuses a
/// directory elsewhere that is not on one.
///
/// Under `ip netns exec` the agent gets a mount namespace of its own with a fresh /sys,
/// so a bpffs it mounts there vanishes with it: pins then do not outlive the agent. Set
/// `pin_path` to a bpffs mounted outside /sys (as the test lab does) to keep them.
pub fn ensure_bpffs(pin_dir: &std::path::Path) -> anyhow::Result<()> {
    const BPF_FS: &str = "/sys/fs/bpf";
    if !pin_dir.starts_with(BPF_FS) {
        let existing = pin_dir
            .ancestors()
            .find(|p| p.exists())
            .unwrap_or(std::path::Path::new("/"));
        let on_bpffs = nix::sys::statfs::statfs(existing)
            .is_ok_and(|s| s.filesystem_type().0 as u64 == 0xcafe_4a11);
        anyhow::ensure!(
            on_bpffs,
            "pin_path {} is not on a bpf filesystem (mount one: mount -t bpf bpf {})",
            pin_dir.display(),
            existing.display()
        );
        return Ok(());
    }
    let mounted = std::fs::read_to_string("/proc/self/mounts")
        .unwrap_or_default()
        .lines()
        .any(|line| {
            line.split_whitespace().nth(1) == Some(BPF_FS)
                && line.split_whitespace().nth(2) == Some("bpf")
        });
    if !mounted {
        tracing::info!("mounting a bpf filesystem at {BPF_FS}");
        nix::mount::mount(
            Some("bpf"),
            BPF_FS,
            Some("bpf"),
            nix::mount::MsFlags::empty(),
            None::<&str>,
        )
        .with_context(|| format!("mounting bpffs at {BPF_FS}"))?;
    }
    Ok(())
}

/// Provokes resolution of every backend without a MAC and waits a little for answers.
async fn resolve_first_macs(neighbors: &Neighbors, model: &mut Model) {
    let deadline = tokio::time::Instant::now() + FIRST_RESOLVE_WAIT;
    loop {
        let table = neighbors.table().await.unwrap_or_default();
        let mut missing = 0;
        for b in model.backends_mut() {
            if b.mac.is_none() {
                b.mac = table.get(&b.config.address).copied();
            }
            if b.mac.is_none() {
                missing += 1;
                if let Err(error) = neighbors.provoke(b.config.address) {
                    tracing::warn!("cannot probe {}: {error}", b.config.address);
                }
            }
        }
        if missing == 0 || tokio::time::Instant::now() >= deadline {
            if missing > 0 {
                tracing::warn!("{missing} backend(s) have no MAC yet; they join when resolved");
            }
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn follow_neighbors(
    neighbors: &Neighbors,
    shared: &Arc<Mutex<Shared>>,
) -> anyhow::Result<()> {
    let table = neighbors.table().await?;
    let mut shared = shared.lock().expect("agent state poisoned");
    for b in shared.model.backends_mut() {
        if b.config.mac.is_none() && !table.contains_key(&b.config.address) {
            // Keep the last MAC we had, and ask the kernel to find it again.
            let _ = neighbors.provoke(b.config.address);
        }
    }
    if shared.learn_macs(&table) {
        shared.sync()?;
    }
    Ok(())
}

#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    #[error("`{0}` changed: restart the agent to apply it (nothing was changed)")]
    NeedsRestart(&'static str),
    #[error("{0} (nothing was changed)")]
    Model(crate::model::ModelError),
    #[error("writing the tables")]
    Write(#[source] anyhow::Error),
}

/// One line per VIP or backend added, removed or changed between two models.
fn describe_changes(before: &Model, after: &Model) -> Vec<String> {
    let mut lines = Vec::new();
    for vip in &after.vips {
        let Some(old) = before
            .vips
            .iter()
            .find(|v| v.config.name == vip.config.name)
        else {
            lines.push(format!("vip {}: added", vip.config.name));
            continue;
        };
        for b in &vip.backends {
            match old
                .backends
                .iter()
                .find(|o| o.config.address == b.config.address)
            {
                None => lines.push(format!(
                    "vip {}: backend {} added",
                    vip.config.name, b.config.address
                )),
                Some(o) if o.config != b.config => lines.push(format!(
                    "vip {}: backend {} changed",
                    vip.config.name, b.config.address
                )),
                Some(_) => {}
            }
        }
        for o in &old.backends {
            if !vip
                .backends
                .iter()
                .any(|b| b.config.address == o.config.address)
            {
                lines.push(format!(
                    "vip {}: backend {} removed",
                    vip.config.name, o.config.address
                ));
            }
        }
        let (mut a, mut b) = (old.config.clone(), vip.config.clone());
        a.backends.clear();
        b.backends.clear();
        if a != b {
            lines.push(format!("vip {}: settings changed", vip.config.name));
        }
    }
    for old in &before.vips {
        if !after.vips.iter().any(|v| v.config.name == old.config.name) {
            lines.push(format!("vip {}: removed", old.config.name));
        }
    }
    lines
}

/// Re-reads the configuration file and applies it (SIGHUP, `lb reload`). On any error the
/// running configuration stays as it was.
pub fn reload(
    shared: &Arc<Mutex<Shared>>,
    health_tasks: &HealthTasks,
) -> Result<Vec<String>, ReloadError> {
    let result = {
        let mut guard = shared.lock().expect("agent state poisoned");
        Config::load(&guard.config_path)
            .map_err(ReloadError::from)
            .and_then(|new| guard.reload(new))
    };
    let changes = match result {
        Ok(changes) => changes,
        Err(error) => {
            tracing::error!("reload refused: {}", with_sources(&error));
            return Err(error);
        }
    };
    health::spawn_checks(shared, health_tasks);
    if changes.is_empty() {
        tracing::info!("reload: no change");
    }
    for line in &changes {
        tracing::info!("reload: {line}");
    }
    Ok(changes)
}

/// An error and its sources, as one line.
fn with_sources(error: &dyn std::error::Error) -> String {
    let mut line = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        line += &format!(": {cause}");
        source = cause.source();
    }
    line
}

/// What starting health-check tasks needs.
#[derive(Clone)]
pub struct HealthTasks {
    pub running: Arc<Mutex<HashSet<u32>>>,
    pub shutdown: CancellationToken,
}

/// Per VIP id, the sources with the most new flows since `previous`, busiest first.
pub fn heavy_hitters(
    sources: &[(SourceKey, u64)],
    previous: &HashMap<SourceKey, u64>,
    seconds: f64,
) -> HashMap<u32, Vec<SourceRate>> {
    let mut by_vip: HashMap<u32, Vec<(u64, &SourceKey)>> = HashMap::new();
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
                .push((count - before, key));
        }
    }
    by_vip
        .into_iter()
        .map(|(vip, mut counts)| {
            counts.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.addr.cmp(&b.1.addr)));
            let top = counts
                .into_iter()
                .take(TOP_SOURCES)
                .map(|(delta, key)| SourceRate {
                    address: source_address(key).to_string(),
                    new_flows_per_second: delta as f64 / seconds,
                })
                .collect();
            (vip, top)
        })
        .collect()
}

fn source_address(key: &SourceKey) -> IpAddr {
    if key.family == lb_common::ADDR_FAMILY_V4 {
        IpAddr::from([key.addr[0], key.addr[1], key.addr[2], key.addr[3]])
    } else {
        IpAddr::from(key.addr)
    }
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

/// Why a control command was refused; nothing changed.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("no VIP {0} is configured")]
    UnknownVip(VipTarget),
    #[error("VIP {0} has no backend {1}")]
    UnknownBackend(VipTarget, IpAddr),
    #[error("VIP {0} already has backend {1}")]
    BackendExists(VipTarget, IpAddr),
    #[error(transparent)]
    Invalid(#[from] crate::config::ConfigError),
    #[error(transparent)]
    Model(#[from] crate::model::ModelError),
    #[error("writing the tables")]
    Write(#[source] anyhow::Error),
}

fn find_vip<'a>(
    config: &'a mut Config,
    target: &VipTarget,
) -> Result<&'a mut VipConfig, ControlError> {
    config
        .vips
        .iter_mut()
        .find(|v| VipTarget::of(v) == *target)
        .ok_or(ControlError::UnknownVip(*target))
}

fn find_backend<'a>(
    config: &'a mut Config,
    target: &VipTarget,
    backend: IpAddr,
) -> Result<&'a mut BackendConfig, ControlError> {
    find_vip(config, target)?
        .backends
        .iter_mut()
        .find(|b| b.address == backend)
        .ok_or(ControlError::UnknownBackend(*target, backend))
}

#[cfg(test)]
mod tests {
    use super::*;
    use test_support::{config, shared};

    #[test]
    fn reload_applies_a_backend_diff() {
        let mut shared = shared(config("eth0", &["10.0.0.11", "10.0.0.12"]));
        let kept_id = shared.model.vips[0].backends[0].id;
        let changes = shared
            .reload(config("eth0", &["10.0.0.11", "10.0.0.13"]))
            .unwrap();
        assert_eq!(
            changes,
            [
                "vip web: backend 10.0.0.13 added",
                "vip web: backend 10.0.0.12 removed"
            ]
        );
        assert_eq!(shared.model.vips[0].backends[0].id, kept_id);
        let in_table: HashSet<u32> = shared.desired.vips[0].table.iter().copied().collect();
        assert_eq!(in_table.len(), 2);
        assert!(in_table.contains(&kept_id));
    }

    #[test]
    fn reload_refuses_load_time_settings_and_changes_nothing() {
        let mut shared = shared(config("eth0", &["10.0.0.11"]));
        let before = shared.model.vips.clone();
        let refused = shared.reload(config("eth1", &["10.0.0.11", "10.0.0.12"]));
        assert!(matches!(
            refused,
            Err(ReloadError::NeedsRestart("dataplane.interface"))
        ));
        assert_eq!(shared.model.vips, before);
        assert_eq!(shared.config.dataplane.interface, "eth0");

        let mut moved = config("eth0", &["10.0.0.11", "10.0.0.12"]);
        moved.control.metrics = Some("127.0.0.1:9999".parse().unwrap());
        assert!(matches!(
            shared.reload(moved),
            Err(ReloadError::NeedsRestart("control.metrics"))
        ));
        assert_eq!(shared.model.vips, before);
    }

    fn web() -> VipTarget {
        "10.0.0.100:80/tcp".parse().unwrap()
    }

    #[test]
    fn runtime_changes_name_unknown_vips_and_backends() {
        let mut shared = shared(config("eth0", &["10.0.0.11"]));
        let other: VipTarget = "10.0.0.100:81/tcp".parse().unwrap();
        let address: IpAddr = "10.0.0.11".parse().unwrap();
        assert!(matches!(
            shared.set_admin_state(&other, address, AdminState::Drain),
            Err(ControlError::UnknownVip(_))
        ));
        assert!(matches!(
            shared.set_admin_state(&web(), "10.0.0.99".parse().unwrap(), AdminState::Drain),
            Err(ControlError::UnknownBackend(..))
        ));
        assert!(matches!(
            shared.add_backend(&web(), address, 1),
            Err(ControlError::BackendExists(..))
        ));
        assert!(matches!(
            shared.add_backend(&web(), "10.0.0.12".parse().unwrap(), 0),
            Err(ControlError::Invalid(_))
        ));
        assert!(
            shared.runtime_changes.is_empty(),
            "refused changes leave no trace"
        );
    }

    #[test]
    fn a_scan_counts_flows_seen_within_the_idle_time_and_closing_ones_briefly() {
        let mut shared = shared(config("eth0", &["10.0.0.11", "10.0.0.12"]));
        let idle = shared.config.dataplane.flow_idle_timeout.as_nanos() as u64;
        let grace = CLOSING_GRACE.as_nanos() as u64;
        let now = 1000 * 1_000_000_000u64;
        let flow = |port: u16, backend_id: u32, age: u64, flags: u32| {
            let key =
                crate::explain::flow_key(&web(), std::net::SocketAddr::from(([10, 0, 0, 1], port)));
            let entry = lb_common::FlowEntry {
                backend_id,
                flags,
                last_seen_ns: now - age,
            };
            (key, entry)
        };
        let closing = lb_common::FLOW_F_CLOSING;
        let flows = vec![
            flow(1, 1, 0, 0),
            flow(2, 1, idle, 0),
            flow(3, 1, idle + 1, 0),
            flow(4, 2, grace, closing),
            flow(5, 2, grace + 1, closing),
            flow(6, 2, idle / 2, closing),
        ];
        shared.record_flows(flows, Instant::now(), now);
        assert_eq!(shared.conntrack_size, 6);
        assert_eq!(
            shared.active_flows.get(&1),
            Some(&2),
            "{:?}",
            shared.active_flows
        );
        assert_eq!(
            shared.active_flows.get(&2),
            Some(&1),
            "{:?}",
            shared.active_flows
        );
        assert!(shared.last_scan.is_some());
        // A scan replaces the counts, it does not add to them.
        shared.record_flows(vec![flow(1, 2, 0, 0)], Instant::now(), now);
        assert_eq!(
            shared.active_flows,
            HashMap::from([(2, 1)]),
            "{:?}",
            shared.active_flows
        );
    }

    #[test]
    fn drain_completes_when_flows_end_and_remove_deletes_after_it() {
        let mut shared = shared(config("eth0", &["10.0.0.11", "10.0.0.12"]));
        let drained: IpAddr = "10.0.0.11".parse().unwrap();
        let id = shared.model.vips[0].backends[0].id;
        shared.remove_backend(&web(), drained).unwrap();
        let b = &shared.model.vips[0].backends[0];
        assert_eq!(b.admin_word(), "draining");
        assert!(b.serves_flows(), "a draining backend keeps its flows");
        assert!(
            !shared.desired.vips[0].table.contains(&id),
            "but takes no new ones"
        );

        // Flows counted after the drain began: still draining.
        shared.active_flows.insert(id, 2);
        shared.last_scan = Some(Instant::now());
        shared.advance_drains(Instant::now()).unwrap();
        assert_eq!(shared.model.vips[0].backends.len(), 2);
        // The flows ended: drained, then deleted.
        shared.active_flows.clear();
        shared.last_scan = Some(Instant::now());
        shared.advance_drains(Instant::now()).unwrap();
        let left: Vec<String> = shared.model.vips[0]
            .backends
            .iter()
            .map(|b| b.config.address.to_string())
            .collect();
        assert_eq!(left, ["10.0.0.12"]);
    }

    #[test]
    fn drain_timeout_ends_a_drain_with_flows_left() {
        let mut shared = shared(config("eth0", &["10.0.0.11"]));
        shared
            .set_admin_state(&web(), "10.0.0.11".parse().unwrap(), AdminState::Drain)
            .unwrap();
        let id = shared.model.vips[0].backends[0].id;
        shared.active_flows.insert(id, 5);
        shared.last_scan = Some(Instant::now());
        let timeout = shared.config.vips[0].drain_timeout;
        shared.advance_drains(Instant::now() + timeout).unwrap();
        let b = &shared.model.vips[0].backends[0];
        assert_eq!(b.admin_word(), "drained");
        assert!(
            !b.serves_flows(),
            "after the timeout its flows are re-hashed"
        );
    }

    #[test]
    fn reload_says_which_runtime_changes_it_undoes() {
        let mut shared = shared(config("eth0", &["10.0.0.11"]));
        shared
            .set_admin_state(&web(), "10.0.0.11".parse().unwrap(), AdminState::Maint)
            .unwrap();
        let changes = shared.reload(config("eth0", &["10.0.0.11"])).unwrap();
        assert_eq!(
            changes,
            [
                "undoes runtime change: 10.0.0.100:80/tcp backend 10.0.0.11 -> maint",
                "vip web: backend 10.0.0.11 changed"
            ]
        );
        assert_eq!(shared.model.vips[0].backends[0].admin_word(), "ready");
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
        let top = heavy_hitters(&now, &previous, 2.0);
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
}

/// A `Shared` over an in-memory data path, for unit tests of this crate.
#[cfg(test)]
pub(crate) mod test_support {
    use super::*;
    use crate::{config::MacAddr, dataplane::MemoryDataplane};

    /// One VIP "web" 10.0.0.100:80/tcp, unchecked, with these backends (MACs given).
    pub fn config(interface: &str, backends: &[&str]) -> Config {
        let mut text = format!(
            "[dataplane]\ninterface = \"{interface}\"\nmaglev_table_size = 7\n\
             [[vip]]\nname = \"web\"\naddress = \"10.0.0.100\"\nport = 80\nprotocol = \"tcp\"\n\
             [vip.health]\nkind = \"none\"\n"
        );
        for (i, address) in backends.iter().enumerate() {
            text += &format!(
                "[[vip.backend]]\naddress = \"{address}\"\nmac = \"02:00:00:00:00:{i:02x}\"\n"
            );
        }
        Config::from_toml(&text).unwrap()
    }

    pub fn shared(config: Config) -> Shared {
        let mut model = Model::new(7, 16, Duration::ZERO);
        model.update(&config).unwrap();
        let interface = Interface {
            name: "eth0".into(),
            index: 1,
            mac: MacAddr([2, 0, 0, 0, 0, 1]),
        };
        let dataplane = Box::new(MemoryDataplane::default());
        let mut shared = Shared::new(
            PathBuf::from("/nonexistent"),
            config,
            model,
            dataplane,
            interface,
            AttachedMode::Generic,
        );
        shared.sync().unwrap();
        shared
    }
}
