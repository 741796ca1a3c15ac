//! The agent's state, shared by its tasks behind one mutex, and every operation that
//! changes it: reload, runtime commands, drains, learnt MACs, health results. Operations
//! are short: they change the model and hand the table writer (`writer`) its new
//! inputs; Maglev builds and bpf(2) writes happen there, off this lock.
//!
//! Who may change what: the config and the model change only here (through `reload`,
//! `change` and the drain and MAC steps) and through health results (`CheckHost`);
//! telemetry is written by the agent's scan loop; the announcement state by the
//! announcer task (`announce::Host`).

use std::{
    collections::HashSet,
    net::IpAddr,
    path::PathBuf,
    sync::{Arc, Mutex},
    time::Instant,
};

use lb_common::stat;

use crate::{
    announce,
    config::{AdminState, BackendConfig, Config, ConfigError, MacAddr, VipConfig},
    dataplane::AttachedMode,
    explain::{self, ExplainError, ExplainRequest, Explanation, VipTarget},
    health::{self, CheckHost, HealthTasks},
    metrics::{Observed, Scrape},
    model::{CheckRecord, Health, Model, ModelError, VipState},
    neighbor::Interface,
    status::{BackendStatus, DataplaneStatus, Start, Status, VipStatus},
    telemetry::Telemetry,
    writer::{Requested, Writer},
};

/// The agent's state. Shared as `Arc<Mutex<State>>`.
pub struct State {
    /// The file `reload` re-reads.
    pub config_path: PathBuf,
    pub config: Config,
    pub model: Model,
    /// The table writer, and through it the data path.
    pub tables: Writer,
    pub interface: Interface,
    /// The XDP mode attached; None while the interface is gone.
    pub mode: Option<AttachedMode>,
    /// Since when the interface is gone (the data path detached with it).
    pub interface_gone: Option<Instant>,
    /// How this agent found the data path.
    pub start: Start,
    pub telemetry: Telemetry,
    /// Changes made at runtime (`lb drain`, `lb backend add` ...), which a reload of the
    /// file undoes: the file is the source of truth.
    pub runtime_changes: Vec<String>,
    /// Backends `lb backend remove` drains, to delete once drained: (VIP name, address).
    pub remove_when_drained: HashSet<(String, IpAddr)>,
    /// Health-check durations and transitions, for metrics.
    pub observed: Observed,
    /// Announcing VIPs to routers (`[announce]`) and the node's drain state.
    pub announce: announce::State,
}

/// Why a reload was refused; nothing changed.
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("`{0}` changed: restart the agent to apply it (nothing was changed)")]
    NeedsRestart(&'static str),
    #[error("{0} (nothing was changed)")]
    Model(ModelError),
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
    Invalid(#[from] ConfigError),
    #[error(transparent)]
    Model(#[from] ModelError),
}

impl State {
    /// A freshly started agent's state over `tables`, which hold what `model` asks for.
    pub fn new(
        config_path: PathBuf,
        config: Config,
        model: Model,
        tables: Writer,
        interface: Interface,
        mode: AttachedMode,
    ) -> Self {
        Self {
            config_path,
            config,
            model,
            tables,
            interface,
            mode: Some(mode),
            interface_gone: None,
            start: Start::Fresh,
            telemetry: Telemetry::default(),
            runtime_changes: Vec::new(),
            remove_when_drained: HashSet::new(),
            observed: Observed::default(),
            announce: Default::default(),
        }
    }

    /// Hands the table writer what the model asks for now (it coalesces bursts), and
    /// tells the announcer to look again. Returns at once; `tables.requested()` waits.
    pub fn sync(&mut self) {
        self.tables.request(self.model.table_inputs());
        self.announce.changed();
    }

    /// Applies neighbour-table MACs to backends without a configured MAC. Returns whether
    /// anything changed.
    pub fn learn_macs(&mut self, table: &std::collections::HashMap<IpAddr, MacAddr>) -> bool {
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
        if let Some(field) = self.config.restart_only_change(&new) {
            return Err(ReloadError::NeedsRestart(field));
        }
        new.validate_host(&self.interface.addresses)?;
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
        self.sync();
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
        config.validate_host(&self.interface.addresses)?;
        let mut model = self.model.clone();
        model.update(&config)?;
        self.model = model;
        self.config = config;
        self.sync();
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
        let mut changed = self.finish_drains(now);
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
            self.sync();
        }
        Ok(())
    }

    /// Marks drained what is done draining; returns whether any was.
    fn finish_drains(&mut self, now: Instant) -> bool {
        let last_scan = self.telemetry.last_scan;
        let mut changed = false;
        for vip in &mut self.model.vips {
            for b in &mut vip.backends {
                let Some(started) = b.drain_started else {
                    continue;
                };
                if b.drained {
                    continue;
                }
                let flows = self.telemetry.flows_of(b.id);
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
        changed
    }

    /// Samples the data path's counters into the telemetry (rates, hot spots, heavy
    /// hitters).
    pub fn sample_rates(&mut self, now: Instant) -> anyhow::Result<()> {
        let ids: Vec<u32> = self.backend_ids();
        let (counters, sources) = {
            let dataplane = self.tables.dataplane();
            (dataplane.counters(&[], &ids)?, dataplane.sources()?)
        };
        let new_flows = counters
            .backends
            .iter()
            .map(|(id, c)| (*id, c.new_flows))
            .collect();
        self.telemetry.sample(now, &self.model, new_flows, sources);
        Ok(())
    }

    fn backend_ids(&self) -> Vec<u32> {
        self.model
            .vips
            .iter()
            .flat_map(|v| v.backends.iter().map(|b| b.id))
            .collect()
    }

    /// What `lb status` shows.
    pub fn status(&self) -> anyhow::Result<Status> {
        Ok(self.status_and_outcomes()?.0)
    }

    /// What one metrics scrape renders; taken under the lock, rendered outside it.
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
        let counters = self
            .tables
            .dataplane()
            .counters(&vip_ids, &self.backend_ids())?;
        let slots = Model::slot_counts(&self.tables.desired());
        let now = Instant::now();
        let vips = self
            .model
            .vips
            .iter()
            .map(|vip| {
                let traffic = counters.vips.get(&vip.id).copied().unwrap_or_default();
                let backends = vip
                    .backends
                    .iter()
                    .map(|b| {
                        let traffic = counters.backends.get(&b.id).copied().unwrap_or_default();
                        BackendStatus {
                            address: b.config.address.to_string(),
                            weight: b.config.weight,
                            state: b.admin_status(),
                            health: b.health,
                            mac: b.mac.map(|m| m.to_string()),
                            in_table: b.in_table(),
                            slots: slots.get(&b.id).copied().unwrap_or(0),
                            active_flows: self.telemetry.flows_of(b.id),
                            packets: traffic.packets,
                            bytes: traffic.bytes,
                            new_flows: traffic.new_flows,
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
                        }
                    })
                    .collect();
                self.vip_status(vip, traffic, backends, now)
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
                conntrack_scan_age_seconds: self
                    .telemetry
                    .last_scan
                    .map(|at| now.saturating_duration_since(at).as_secs_f64()),
                start: self.start.clone(),
            },
            vips,
            counters: stat::NAMES
                .iter()
                .zip(&counters.outcomes)
                .map(|(name, value)| (name.to_string(), *value))
                .collect(),
            node: announce::node_status(&self.announce_view(), now),
        };
        Ok((status, counters.outcomes))
    }

    fn vip_status(
        &self,
        vip: &VipState,
        traffic: lb_common::TrafficCounters,
        backends: Vec<BackendStatus>,
        now: Instant,
    ) -> VipStatus {
        // Healthy: not failed by its checks, and reachable (its MAC is known).
        let healthy = vip
            .backends
            .iter()
            .filter(|b| b.health != Health::Down && b.mac.is_some())
            .count();
        let (announced, announcement) = announce::describe_vip(&self.announce_view(), vip, now);
        VipStatus {
            name: vip.config.name.clone(),
            announced,
            announcement,
            address: vip.config.address.to_string(),
            port: vip.config.port,
            protocol: vip.config.protocol,
            hash: vip.config.hash,
            packets: traffic.packets,
            bytes: traffic.bytes,
            new_flows: traffic.new_flows,
            healthy_backends: healthy,
            unhealthy_backends: vip.backends.len() - healthy,
            top_sources: self
                .telemetry
                .top_sources
                .get(&vip.id)
                .cloned()
                .unwrap_or_default(),
            busiest_over_average: self
                .telemetry
                .busiest_over_average
                .get(&vip.id)
                .copied()
                .unwrap_or(0.0),
            backends,
        }
    }

    /// `lb explain`: over the tables the data path holds and its connection table.
    pub fn explain(
        &self,
        request: &ExplainRequest,
        now_ns: u64,
    ) -> Result<Explanation, ExplainError> {
        let desired = self.tables.desired();
        let dataplane = self.tables.dataplane();
        let view = explain::View {
            model: &self.model,
            desired: &desired,
            dataplane: dataplane.as_ref(),
            flow_idle: self.config.dataplane.flow_idle_timeout,
        };
        explain::explain(&view, request, now_ns)
    }
}

/// What the agent must do to follow its interface, given what netlink shows now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum InterfaceChange {
    /// Nothing (or only its addresses changed: taken as they are).
    None,
    /// It went away: the data path went with it.
    Gone,
    /// An interface of that name is there and the program is not attached to it as it
    /// is (it came back, or its MAC changed): attach, then `interface_attached`.
    Attach(Interface),
}

impl State {
    /// Compares the interface as netlink shows it (`now`, None: there is none) with the
    /// one the data path is attached to. Takes new addresses as they are.
    pub fn interface_change(&mut self, now: Option<Interface>) -> InterfaceChange {
        let Some(now) = now else {
            return match self.interface_gone {
                Some(_) => InterfaceChange::None,
                None => InterfaceChange::Gone,
            };
        };
        let attached_here = self.interface_gone.is_none()
            && self.mode.is_some()
            && now.index == self.interface.index
            && now.mac == self.interface.mac;
        if attached_here {
            self.interface.addresses = now.addresses;
            return InterfaceChange::None;
        }
        InterfaceChange::Attach(now)
    }

    /// The interface went away, and the data path with it (the kernel detached it).
    pub fn interface_lost(&mut self) {
        tracing::warn!(
            "interface {} (index {}) is gone: the data path is detached and forwards \
             nothing; it attaches again when an interface of that name returns",
            self.interface.name,
            self.interface.index
        );
        self.interface_gone = Some(Instant::now());
        self.mode = None;
    }

    /// The program was attached to `interface` (`Attach`) in `mode`: the data path serves
    /// again, with the tables the model asks for.
    pub fn interface_attached(&mut self, interface: Interface, mode: AttachedMode) {
        let what = match self.interface_gone.take() {
            Some(since) => format!(
                "interface {} is back after {:.1}s (index {}, MAC {}): attached again",
                interface.name,
                since.elapsed().as_secs_f64(),
                interface.index,
                interface.mac
            ),
            None if interface.index == self.interface.index => format!(
                "interface {} changed its MAC from {} to {}: the program follows it",
                interface.name, self.interface.mac, interface.mac
            ),
            None => format!(
                "interface {} was replaced (index {} -> {}, MAC {}): attached to the new one",
                interface.name, self.interface.index, interface.index, interface.mac
            ),
        };
        tracing::info!("{what} (xdp mode {mode})");
        self.interface = interface;
        self.mode = Some(mode);
        self.sync();
    }
}

impl CheckHost for State {
    fn model(&self) -> &Model {
        &self.model
    }

    fn record_check(&mut self, id: u32, record: CheckRecord, rise: u32, fall: u32) {
        if health::record(&mut self.model, &self.observed, id, record, rise, fall).is_some() {
            self.sync();
        }
    }
}

impl announce::Host for State {
    fn announce_view(&self) -> announce::View<'_> {
        announce::View {
            config: self.config.announce.as_ref(),
            vips: &self.model.vips,
            state: &self.announce,
        }
    }

    fn announce_state(&mut self) -> &mut announce::State {
        &mut self.announce
    }
}

impl State {
    fn announce_view(&self) -> announce::View<'_> {
        announce::Host::announce_view(self)
    }
}

/// Re-reads the configuration file and applies it (SIGHUP, `lb reload`). On any error the
/// running configuration stays as it was. Returns the changes and the table write to
/// wait for.
pub fn reload(
    state: &Arc<Mutex<State>>,
    health_tasks: &HealthTasks,
) -> Result<(Vec<String>, Requested), ReloadError> {
    let result = {
        let mut guard = state.lock().expect("agent state poisoned");
        Config::load(&guard.config_path)
            .map_err(ReloadError::from)
            .and_then(|new| guard.reload(new))
            .map(|changes| (changes, guard.tables.requested()))
    };
    let (changes, written) = match result {
        Ok(done) => done,
        Err(error) => {
            tracing::error!("reload refused: {}", with_sources(&error));
            return Err(error);
        }
    };
    health::spawn_checks(state, health_tasks);
    if changes.is_empty() {
        tracing::info!("reload: no change");
    }
    for line in &changes {
        tracing::info!("reload: {line}");
    }
    Ok((changes, written))
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
    use crate::{
        config::AnnounceConfig,
        metrics::{observe_check, prometheus_text, render},
    };
    use std::collections::HashSet;
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
        let in_table: HashSet<u32> = shared.tables.desired().vips[0]
            .table
            .iter()
            .copied()
            .collect();
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
    fn reload_and_runtime_changes_refuse_the_interfaces_own_address() {
        let mut shared = shared(config("eth0", &["10.0.0.11"]));
        let refused = shared.reload(config("eth0", &["10.0.0.11", "10.0.0.2"]));
        assert!(
            matches!(&refused, Err(ReloadError::Config(ConfigError::Invalid { field, .. }))
                if field == "vip[0].backend[1].address"),
            "{refused:?}"
        );
        assert_eq!(shared.model.vips[0].backends.len(), 1, "nothing changed");
        let added = shared.add_backend(&web(), "10.0.0.2".parse().unwrap(), 1);
        assert!(matches!(added, Err(ControlError::Invalid(_))), "{added:?}");
    }

    #[test]
    fn the_interface_is_followed_through_loss_return_and_mac_changes() {
        let mut shared = shared(config("eth0", &["10.0.0.11"]));
        let here = shared.interface.clone();
        assert_eq!(
            shared.interface_change(Some(here.clone())),
            InterfaceChange::None
        );
        // New addresses alone: taken as they are.
        let mut readdressed = here.clone();
        readdressed.addresses.push("10.0.0.3".parse().unwrap());
        assert_eq!(
            shared.interface_change(Some(readdressed)),
            InterfaceChange::None
        );
        assert_eq!(shared.interface.addresses.len(), 2);
        // Gone: once.
        assert_eq!(shared.interface_change(None), InterfaceChange::Gone);
        shared.interface_lost();
        assert_eq!(shared.interface_change(None), InterfaceChange::None);
        let status = shared.status().unwrap();
        assert_eq!(status.dataplane.xdp_mode, None);
        assert_eq!(status.dataplane.interface_mac, None);
        assert!(
            status
                .dataplane
                .detached
                .as_deref()
                .is_some_and(|why| why.contains("interface eth0 is gone")),
            "{:?}",
            status.dataplane.detached
        );
        // Back, as a new interface (another index, another MAC): attach.
        let back = Interface {
            index: 7,
            mac: MacAddr([2, 0, 0, 0, 0, 7]),
            ..here.clone()
        };
        assert_eq!(
            shared.interface_change(Some(back.clone())),
            InterfaceChange::Attach(back.clone())
        );
        shared.interface_attached(back.clone(), AttachedMode::Native);
        let status = shared.status().unwrap();
        assert_eq!(status.dataplane.xdp_mode, Some(AttachedMode::Native));
        assert_eq!(
            status.dataplane.interface_mac.as_deref(),
            Some("02:00:00:00:00:07")
        );
        assert_eq!(status.dataplane.detached, None);
        // A MAC change in place: attach (the program carries the MAC).
        let moved = Interface {
            mac: MacAddr([2, 0, 0, 0, 0, 8]),
            ..back
        };
        assert_eq!(
            shared.interface_change(Some(moved.clone())),
            InterfaceChange::Attach(moved)
        );
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
    fn drain_completes_when_flows_end_and_remove_deletes_after_it() {
        let mut shared = shared(config("eth0", &["10.0.0.11", "10.0.0.12"]));
        let drained: IpAddr = "10.0.0.11".parse().unwrap();
        let id = shared.model.vips[0].backends[0].id;
        shared.remove_backend(&web(), drained).unwrap();
        let b = &shared.model.vips[0].backends[0];
        assert_eq!(b.admin_word(), "draining");
        assert!(b.serves_flows(), "a draining backend keeps its flows");
        assert!(
            !shared.tables.desired().vips[0].table.contains(&id),
            "but takes no new ones"
        );

        // Flows counted after the drain began: still draining.
        shared.telemetry.active_flows.insert(id, 2);
        shared.telemetry.last_scan = Some(Instant::now());
        shared.advance_drains(Instant::now()).unwrap();
        assert_eq!(shared.model.vips[0].backends.len(), 2);
        // The flows ended: drained, then deleted.
        shared.telemetry.active_flows.clear();
        shared.telemetry.last_scan = Some(Instant::now());
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
        shared.telemetry.active_flows.insert(id, 5);
        shared.telemetry.last_scan = Some(Instant::now());
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

    fn with_announce(mut config: Config) -> Config {
        config.announce = Some(AnnounceConfig::default());
        config
    }

    #[test]
    fn a_reload_that_moves_the_routes_is_refused() {
        let mut shared = shared(config("eth0", &["10.0.0.11"]));
        let refused = shared.reload(with_announce(config("eth0", &["10.0.0.11"])));
        assert!(
            matches!(
                refused,
                Err(ReloadError::NeedsRestart(
                    "announce (table, protocol, device)"
                ))
            ),
            "{refused:?}"
        );
        assert_eq!(shared.config.announce, None, "nothing changed");
    }

    #[test]
    fn min_healthy_counts_backends_that_take_new_flows() {
        let mut shared = shared(config("eth0", &["10.0.0.11", "10.0.0.12"]));
        assert_eq!(announce::backends_up(&shared.model.vips[0]), 2);
        shared
            .set_admin_state(&web(), "10.0.0.11".parse().unwrap(), AdminState::Drain)
            .unwrap();
        assert_eq!(
            announce::backends_up(&shared.model.vips[0]),
            1,
            "a draining backend takes no new flows"
        );
    }

    #[test]
    fn a_health_change_rebuilds_only_its_vips_table() {
        let mut builder = crate::tables::TableBuilder::default();
        let mut two = config("eth0", &["10.0.0.11", "10.0.0.12"]);
        let mut other = two.vips[0].clone();
        other.name = "other".into();
        other.port = 81;
        two.vips.push(other);
        let shared = shared(two);
        let mut model = shared.model.clone();
        let first = builder.build(&model.table_inputs());
        model.vips[1].backends[0].health = Health::Down;
        let second = builder.build(&model.table_inputs());
        assert_eq!(first.vips[0].table, second.vips[0].table, "untouched VIP");
        assert_ne!(first.vips[1].table, second.vips[1].table, "its VIP changed");
        assert_eq!(
            second,
            model.desired(),
            "the cache builds what a fresh build does"
        );
        assert_eq!(builder.cached(), 2);
    }

    #[test]
    fn the_classic_text_names_counter_families_as_their_samples() {
        let shared = shared(config("eth0", &["10.0.0.11"]));
        observe_check(&shared.observed, "web", "10.0.0.11", 0.002, None);
        let openmetrics = render(&shared.scrape().unwrap()).unwrap();
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
        let text = render(&shared.scrape().unwrap()).unwrap();
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
}

/// A `State` over an in-memory data path, for unit tests of this crate.
#[cfg(test)]
pub(crate) mod test_support {
    use super::*;
    use crate::{config::MacAddr, dataplane::MemoryDataplane, tables::TableWriter};
    use std::time::Duration;

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

    pub fn shared(config: Config) -> State {
        let mut model = Model::new(7, 16, Duration::ZERO);
        model.update(&config).unwrap();
        let interface = Interface {
            name: "eth0".into(),
            index: 1,
            mac: MacAddr([2, 0, 0, 0, 0, 1]),
            addresses: vec!["10.0.0.2".parse().unwrap()],
        };
        let tables = Writer::inline(Box::new(MemoryDataplane::default()), TableWriter::new(7));
        let mut shared = State::new(
            PathBuf::from("/nonexistent"),
            config,
            model,
            tables,
            interface,
            AttachedMode::Generic,
        );
        shared.sync();
        shared
    }
}
