//! The controller: the agent's state, shared by its tasks behind one mutex, and every
//! event that changes it: reload, runtime commands, drains, learnt MACs, health results,
//! the scans' telemetry, the interface. An event changes the configuration and the model
//! and computes what the tables should be (`TableInputs`); it hands them to the table
//! writer (`writer`), which owns every data-path write (Maglev builds and bpf(2) writes
//! happen there, off this lock), and publishes what readers read (`snapshot`): status,
//! metrics, explain and the API load that snapshot and never take this lock.
//!
//! Who may change what: the config and the model change only here (through `reload`,
//! `change` and the drain and MAC steps) and through health results (`CheckHost`);
//! telemetry is written by the agent's scan loop; the announcement state by the
//! announcer task (`announce::Host`, which says when it changed). Every method that
//! changes what a reader could see ends by publishing (`publish`), before the lock is
//! let go: a command's reply, and any read after it, sees the change.
//!
//! The rule: no `State` method does I/O; it computes, and says what to do. Routes are
//! looked up through an injectable `route_of` (a fake in unit tests); table writes, the
//! hot sources and the next program's slot go to the writer (`Writer::request`,
//! `Writer::exec`); the state file is written by the caller once this lock is let go
//! (`state_file_write`, then `StateFileWrite::write`, before it answers); a reload's
//! file and next-program pin are read and opened before the lock is taken
//! (`ReloadInput::open`, in `reload`); a check through the VIP gets its way here
//! (`vip_route`) and its interface's address after (`VipRoute::path`); counter samples
//! (rates, outliers) are read before the lock (`counters_to_sample`,
//! `outliers_to_read`). Enforced by `ownership_tests`:
//! `no_method_of_the_controller_does_io` (no `impl ... State` block names a call that
//! does I/O), `the_controller_hands_its_table_decisions_to_the_write_side` (a fake write
//! side), and the readers' tests (`a_status_read_does_not_wait_for_the_agents_lock`,
//! `an_explain_does_not_wait_for_the_data_paths_lock`). One wait remains under the lock:
//! a reload waits for the writer to put the next program in its slot (`Writer::exec`:
//! the writer's queue and one bpf(2) call, never this lock), as the slot's answer
//! decides whether the reload is applied.

use std::{
    collections::HashSet,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    path::PathBuf,
    sync::{Arc, Mutex},
    time::Instant,
};

use lb_common::{SourceKey, TunnelConfig};

use crate::{
    announce, cluster,
    config::{AdminState, BackendConfig, Config, ConfigError, MAX_WEIGHT, MacAddr, VipConfig},
    dataplane::{AttachedMode, EgressPort, next::NextProgram},
    explain::VipTarget,
    health::{
        self, CheckHost, HealthTasks, VipPathError, VipRoute,
        agentcheck::{self, AgentHost},
    },
    metrics::Observed,
    model::{CheckRecord, Model, ModelError, weights::AgentReport},
    neighbor::{self, Interface, RouteLookup},
    snapshot::{Published, StatusSource},
    statefile,
    status::{AgentStatus, LastReload, NextProgramStatus, Start},
    tables::TableInputs,
    telemetry::{Telemetry, source_address},
    writer::{Requested, Writer},
};

/// The agent's state. Shared as `Arc<Mutex<State>>`.
pub struct State {
    /// The file `reload` re-reads.
    config_path: PathBuf,
    /// The running configuration: the file's, with the runtime changes made since.
    config: Config,
    /// The configuration as last read from the file. What `config` differs in are the
    /// runtime changes (`lb drain`, `lb backend add` ...), which a reload of the file
    /// undoes: the file is the source of truth.
    file: Config,
    model: Model,
    /// The table writer, and through it the data path.
    tables: Writer,
    /// `stable_slots`: the connection table's turnover as the stabilizer last found it.
    horizon: Arc<crate::turnover::PublishedHorizon>,
    interface: Interface,
    /// The XDP mode attached; None while the interface is gone.
    mode: Option<AttachedMode>,
    /// `xdp_mode = "auto"` attached generic: why native was refused.
    native_refused: Option<String>,
    /// `dataplane.next_program` as last put in the slot (start, then each reload).
    next_program: Option<NextProgramStatus>,
    /// Since when the interface is gone (the data path detached with it).
    interface_gone: Option<Instant>,
    /// With several interfaces (`dataplane.interfaces`), each as attached, in order
    /// (the first is `interface`); empty with one.
    ports: Vec<EgressPort>,
    /// How this agent found the data path.
    start: Start,
    telemetry: Telemetry,
    /// Backends `lb backend remove` drains, to delete once drained: (VIP name, address).
    remove_when_drained: HashSet<(String, IpAddr)>,
    /// Health-check durations and transitions, for metrics.
    observed: Observed,
    /// Announcing VIPs to routers (`[announce]`) and the node's drain state.
    announce: announce::State,
    /// `[cluster]`: the cluster task's counters.
    cluster: Option<cluster::Shared>,
    /// What the table writer was last asked for, and the request's ticket.
    last_inputs: TableInputs,
    requested: u64,
    /// What readers read: a snapshot published after each change (`publish`).
    published: Published,
    /// How routes are looked up (`neighbor::route_to`; a fake in unit tests).
    route_of: RouteLookup,
    /// Since when this agent runs, and its reloads (status `agent`, the reload metrics).
    started: Instant,
    reloads: Reloads,
    /// Where the runtime changes are kept across restarts (None: nowhere, in unit tests),
    /// and what it holds once the writes asked for are made.
    state_file: Option<PathBuf>,
    saved: Vec<statefile::SavedChange>,
    /// The state file's write to make, for the caller to take (`state_file_write`) and
    /// make once this lock is let go; and how they are ordered.
    unsaved: Option<statefile::StateFileWrite>,
    state_file_writes: statefile::StateFileWrites,
}

/// The reloads asked of this agent.
#[derive(Clone, Debug)]
struct Reloads {
    ok: u64,
    refused: u64,
    /// The last successful load of the file: the start's, then each accepted reload.
    last_load: std::time::SystemTime,
    last: Option<LastReload>,
}

fn unix_seconds(at: std::time::SystemTime) -> u64 {
    at.duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_secs())
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

/// A configuration to reload, with what the reload opens before it takes the state's lock:
/// `dataplane.next_program` opened again from its pin (a program pinned anew at its path
/// is taken up), or why it could not be (the reload refuses then, after its other checks).
pub struct ReloadInput {
    config: Config,
    next: Result<Option<NextProgram>, ConfigError>,
}

impl ReloadInput {
    /// `config`, with its next program opened.
    pub fn open(config: Config) -> Self {
        Self {
            next: crate::preflight::next_program(&config),
            config,
        }
    }
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
    #[error(
        "weight {0} is not allowed: weights are 1..={MAX_WEIGHT} (to take a backend out of \
         service: lb drain or lb maint)"
    )]
    BadWeight(u32),
    /// The change makes the running configuration invalid; said without the file's field
    /// path, which names no line of any file here.
    #[error("{}", runtime_reason(.0))]
    Invalid(#[from] ConfigError),
    #[error(transparent)]
    Model(#[from] ModelError),
}

impl State {
    /// A freshly started agent's state over `tables`, which hold what `model` asks for.
    pub fn new(
        config_path: PathBuf,
        config: Config,
        mut model: Model,
        tables: Writer,
        interface: Interface,
        mode: AttachedMode,
    ) -> Self {
        // What serves already was not just added: no slow start for it.
        model.settle_usable();
        let state = Self {
            config_path,
            state_file: Some(config.state_file()),
            saved: Vec::new(),
            unsaved: None,
            state_file_writes: Default::default(),
            file: config.clone(),
            config,
            model,
            tables,
            horizon: Arc::default(),
            interface,
            mode: Some(mode),
            native_refused: None,
            next_program: None,
            interface_gone: None,
            ports: Vec::new(),
            start: Start::Fresh,
            telemetry: Telemetry::default(),
            remove_when_drained: HashSet::new(),
            observed: Observed::default(),
            announce: Default::default(),
            cluster: None,
            last_inputs: TableInputs::default(),
            requested: 0,
            published: Published::default(),
            route_of: neighbor::route_to,
            started: Instant::now(),
            reloads: Reloads {
                ok: 0,
                refused: 0,
                last_load: std::time::SystemTime::now(),
                last: None,
            },
        };
        state.publish();
        state
    }

    /// Publishes what readers read (status, metrics, explain, the API): called at the end
    /// of every change, under the lock, so a reply or a read that follows sees it.
    fn publish(&self) {
        self.published.store(self.status_source());
    }

    /// The published snapshot's handle, for readers: they load it without this lock.
    pub fn published(&self) -> Published {
        self.published.clone()
    }

    /// The configuration as read from the file, when the running one has the state file's
    /// runtime changes made again on top of it (`statefile::restore`): they are runtime
    /// changes still, which status lists and a reload undoes.
    pub fn set_file_config(&mut self, file: Config) {
        self.file = file;
        self.save_runtime_changes();
        self.publish();
    }

    /// Asks for the runtime changes to be kept in the state file, when they changed since
    /// it was last asked for: the write is the caller's to make (`state_file_write`).
    fn save_runtime_changes(&mut self) {
        let changes: Vec<statefile::SavedChange> = self
            .runtime_differences()
            .into_iter()
            .map(|d| statefile::SavedChange {
                vip: d.vip,
                kind: match d.kind {
                    DifferenceKind::Added => statefile::ChangeKind::Added,
                    DifferenceKind::Removed => statefile::ChangeKind::Removed,
                    DifferenceKind::State => statefile::ChangeKind::State,
                    DifferenceKind::Settings => statefile::ChangeKind::Settings,
                },
                backend: d.backend,
                what: d.what,
            })
            .collect();
        if changes == self.saved {
            return;
        }
        if let Some(path) = &self.state_file {
            let write = self
                .state_file_writes
                .ask(path, &self.config_path, changes.clone());
            // A newer write replaces one not yet taken: it holds what that one held.
            self.unsaved = Some(write);
        }
        self.saved = changes;
    }

    /// The state file's write the last changes asked for, if any: the caller makes it
    /// (`StateFileWrite::write`) once this lock is let go, and answers after it.
    pub fn state_file_write(&mut self) -> Option<statefile::StateFileWrite> {
        self.unsaved.take()
    }

    /// Counts a reload and keeps its outcome (`error`: why it was refused).
    fn record_reload(&mut self, error: Option<String>) {
        let now = std::time::SystemTime::now();
        match error {
            None => {
                self.reloads.ok += 1;
                self.reloads.last_load = now;
            }
            Some(_) => self.reloads.refused += 1,
        }
        self.reloads.last = Some(LastReload {
            at_unix_seconds: unix_seconds(now),
            result: if error.is_none() { "ok" } else { "refused" }.into(),
            error,
        });
    }

    /// The agent itself, as status shows it.
    fn agent_status(&self) -> AgentStatus {
        AgentStatus {
            version: env!("CARGO_PKG_VERSION").into(),
            uptime_seconds: self.started.elapsed().as_secs(),
            config_path: self.config_path.display().to_string(),
            reloads_ok: self.reloads.ok,
            reloads_refused: self.reloads.refused,
            last_load_unix_seconds: unix_seconds(self.reloads.last_load),
            last_reload: self.reloads.last.clone(),
            state_file: self
                .state_file
                .as_ref()
                .map(|path| path.display().to_string())
                .unwrap_or_default(),
            runtime_changes: self.saved.iter().map(|c| c.what.clone()).collect(),
        }
    }

    /// How this start found the data path, whether `xdp_mode = "auto"` fell back to
    /// generic (and why), the cluster task's counters, and whether the node learns its
    /// peers' flows before it announces.
    pub fn record_start(
        &mut self,
        start: Start,
        native_refused: Option<String>,
        cluster: Option<cluster::Shared>,
        learning: bool,
    ) {
        self.start = start;
        self.native_refused = native_refused;
        self.cluster = cluster;
        self.announce.learning = learning;
        self.publish();
    }

    /// Whether the program is attached (the interface is there).
    pub fn is_attached(&self) -> bool {
        self.mode.is_some()
    }

    /// The XDP mode attached; None while the interface is gone.
    pub fn mode(&self) -> Option<AttachedMode> {
        self.mode
    }

    /// The configured `xdp_mode`, for attaching again.
    pub fn xdp_mode_setting(&self) -> crate::config::XdpModeSetting {
        self.config.dataplane.xdp_mode
    }

    /// The data path's lock, for attaching it again (never held with the state's lock).
    pub fn shared_dataplane(&self) -> crate::writer::SharedDataplane {
        self.tables.shared_dataplane()
    }

    /// The newest table request, to wait for outside the lock.
    pub fn requested(&self) -> Requested {
        self.tables.requested()
    }

    /// Whether every table request has been written.
    pub fn tables_are_current(&self) -> bool {
        self.tables.is_current()
    }

    /// Counts live flows per backend from a connection-table scan (`Telemetry::record_flows`).
    pub fn record_flows(
        &mut self,
        flows: Vec<(lb_common::FlowKey, lb_common::FlowEntry)>,
        started: Instant,
        started_ns: u64,
    ) {
        let idle = self.config.dataplane.flow_idle_timeout;
        self.telemetry
            .record_flows(flows, started, started_ns, idle);
        self.publish();
    }

    /// The next hops of backends without a configured MAC that `table` (the neighbour
    /// table) lacks: to ask the kernel to resolve.
    pub fn next_hops_to_resolve(
        &self,
        table: &std::collections::HashMap<IpAddr, MacAddr>,
    ) -> Vec<IpAddr> {
        self.model
            .backends()
            .filter(|b| b.config.mac.is_none())
            .filter_map(|b| b.next_hop)
            .filter(|hop| !table.contains_key(hop))
            .collect()
    }

    /// What `config` needs of this host (`Config::validate_host`, and `l2` backends
    /// on-link): checked at every reload and runtime change, as at start.
    fn validate_on_host(&self, config: &Config) -> Result<(), ConfigError> {
        crate::preflight::interface_checks(config, &self.interface, self.route_of)
    }

    /// The interfaces (`dataplane.interfaces`) as attached: several, or none.
    pub fn set_ports(&mut self, ports: Vec<EgressPort>) {
        self.ports = ports;
        self.publish();
    }

    /// `dataplane.next_program` as the start chained it (reloads keep it up to date).
    pub fn set_next_program(&mut self, next: Option<NextProgramStatus>) {
        self.next_program = next;
        self.publish();
    }

    /// The interfaces attached, in order (several; empty with one).
    pub fn ports(&self) -> &[EgressPort] {
        &self.ports
    }

    /// One of several interfaces changed: gone (`ifindex` 0) or attached again.
    pub fn port_changed(&mut self, port: EgressPort) {
        if let Some(known) = self.ports.iter_mut().find(|p| p.name == port.name) {
            *known = port;
        }
        self.publish();
    }

    /// The interface indexes frames may leave by, in `dataplane.interfaces` order (0 for
    /// one that is gone).
    pub fn ifindexes(&self) -> Vec<u32> {
        let mut indexes: Vec<u32> = self.ports.iter().map(|p| p.ifindex).collect();
        match indexes.first_mut() {
            Some(first) => *first = self.interface.index,
            None => indexes.push(self.interface.index),
        }
        indexes
    }

    /// Looks up the next hop of every tunnelled backend (`follow_routes`). Returns
    /// whether any changed.
    pub fn follow_routes(&mut self) -> bool {
        let ifindexes = self.ifindexes();
        let changed = follow_routes(&mut self.model, &ifindexes, self.route_of);
        if changed {
            self.publish();
        }
        changed
    }

    /// Hands the table writer what the model asks for now (it coalesces bursts), tells
    /// the announcer to look again, and publishes. Returns at once; `tables.requested()`
    /// waits.
    pub fn sync(&mut self) {
        let now = Instant::now();
        self.model.note_usable(now);
        self.last_inputs = self.inputs_at(now);
        self.requested = self.tables.request(self.last_inputs.clone());
        self.announce.changed();
        self.publish();
    }

    /// What the tables are built from at `now`: the model's, and the tunnel settings.
    fn inputs_at(&self, now: Instant) -> TableInputs {
        TableInputs {
            tunnel: tunnel_config(&self.config, &self.interface, self.mode),
            hot_sources: self.telemetry.hot.hot.keys().copied().collect(),
            ..self.model.table_inputs_at(now)
        }
    }

    /// Follows what changes with time alone (a slow-start step): asks for new tables
    /// when the inputs differ from the last request.
    pub fn refresh_load(&mut self, now: Instant) {
        // Only slow start changes with time alone.
        if self.config.vips.iter().all(|v| v.slow_start.is_none()) {
            return;
        }
        self.request_if_changed(now);
        self.publish();
    }

    /// Asks the writer for the tables of `now` when they differ from the last request.
    fn request_if_changed(&mut self, now: Instant) {
        self.model.note_usable(now);
        let inputs = self.inputs_at(now);
        if inputs != self.last_inputs {
            self.last_inputs = inputs.clone();
            self.requested = self.tables.request(inputs);
        }
    }

    /// Least-flows: re-weights from the last scan's live flows; new tables when a
    /// weight moved.
    pub fn reweigh(&mut self) {
        let telemetry = &self.telemetry;
        if self.model.reweigh_least_flows(|id| telemetry.flows_of(id)) {
            self.sync();
        }
    }

    /// Applies neighbour-table MACs to backends without a configured MAC. Returns whether
    /// anything changed.
    pub fn learn_macs(&mut self, table: &std::collections::HashMap<IpAddr, MacAddr>) -> bool {
        let mut changed = false;
        for b in self.model.backends_mut() {
            if b.config.mac.is_some() {
                continue;
            }
            if let Some(next_hop) = b.next_hop
                && let Some(mac) = table.get(&next_hop)
                && b.mac != Some(*mac)
            {
                if next_hop == b.config.address {
                    tracing::info!("backend {} is at {mac}", b.config.address);
                } else {
                    tracing::info!(
                        "backend {}: its next hop {next_hop} is at {mac}",
                        b.config.address
                    );
                }
                b.mac = Some(*mac);
                changed = true;
            }
        }
        if changed {
            self.publish();
        }
        changed
    }

    /// Makes the running agent follow `new`: unchanged backends keep their ids, health
    /// and flows; the tables are rewritten where they differ. Settings fixed at load
    /// time are refused, and then nothing changes.
    pub fn reload(&mut self, input: ReloadInput) -> Result<Vec<String>, ReloadError> {
        let ReloadInput { config: new, next } = input;
        if let Some(field) = self.config.restart_only_change(&new) {
            return Err(ReloadError::NeedsRestart(field));
        }
        self.validate_on_host(&new)?;
        let mut model = self.model.clone();
        model.update(&new).map_err(ReloadError::Model)?;
        // A VIP that changed `forward` takes its new next hops now: the same backend ids
        // (its flows stay on them), written the new way.
        follow_routes(&mut model, &self.ifindexes(), self.route_of);
        let mut changes: Vec<String> = self
            .runtime_differences()
            .into_iter()
            .filter(|difference| difference.undone_by(&new))
            .map(|difference| format!("undoes runtime change: {}", difference.what))
            .collect();
        changes.extend(describe_changes(&self.model, &model));
        // Last, as nothing after it refuses: the slot is written only by a reload that
        // is applied.
        changes.extend(self.chain_next_program(next)?);
        self.remove_when_drained.clear();
        self.replace_model(model);
        self.file = new.clone();
        self.config = new;
        self.sync();
        self.save_runtime_changes();
        self.publish();
        Ok(changes)
    }

    /// Puts `dataplane.next_program`, as opened again before the lock was taken
    /// (`ReloadInput::open`), in the slot lb tail-calls, or empties the slot; says so
    /// when the program there changes.
    fn chain_next_program(
        &mut self,
        next: Result<Option<NextProgram>, ConfigError>,
    ) -> Result<Option<String>, ReloadError> {
        let next = next?;
        // Written by the writer, as every data-path write; its answer decides the reload.
        let (before, next) = self
            .tables
            .exec(move |writes| (writes.set_next_program(next.as_ref()), next))
            .map_err(|stopped| ConfigError::Invalid {
                field: crate::preflight::NEXT_PROGRAM_FIELD.into(),
                reason: stopped.to_string(),
            })?;
        let before = before.map_err(|error| ConfigError::Invalid {
            field: crate::preflight::NEXT_PROGRAM_FIELD.into(),
            reason: error.to_string(),
        })?;
        let now = next.as_ref().map(|n| n.id);
        self.next_program = next.as_ref().map(NextProgramStatus::from);
        Ok((before != now).then(|| {
            let was = before.map_or("none".into(), |id| format!("id {id}"));
            let is = next.map_or("none".into(), |n| {
                format!("{} ({})", n.label(), n.path.display())
            });
            format!("dataplane.next_program: {was} -> {is}")
        }))
    }

    /// Where the running configuration differs from the file: the net effect of the
    /// runtime changes made since the file was read (a drain then a ready is none; a
    /// backend added, then removed, is none).
    pub fn runtime_differences(&self) -> Vec<RuntimeDifference> {
        let mut differences = Vec::new();
        for vip in &self.config.vips {
            let target = VipTarget::of(vip);
            let in_file = self.file.vips.iter().find(|v| v.name == vip.name);
            let file_backends = in_file.map(|v| v.backends.as_slice()).unwrap_or_default();
            for b in &vip.backends {
                let difference = |what: String, kind| RuntimeDifference {
                    vip: vip.name.clone(),
                    backend: b.clone(),
                    kind,
                    what,
                };
                let Some(old) = file_backends.iter().find(|o| o.address == b.address) else {
                    differences.push(difference(
                        format!("{target} backend {} added (weight {})", b.address, b.weight),
                        DifferenceKind::Added,
                    ));
                    continue;
                };
                if old.state != b.state {
                    let removal = if self
                        .remove_when_drained
                        .contains(&(vip.name.clone(), b.address))
                    {
                        "; removed once drained"
                    } else {
                        ""
                    };
                    differences.push(difference(
                        format!("{target} backend {} -> {}{removal}", b.address, b.state),
                        DifferenceKind::State,
                    ));
                }
                let (mut a, mut c) = (old.clone(), b.clone());
                (a.state, c.state) = (AdminState::Ready, AdminState::Ready);
                let fields = field_changes(&a, &c);
                if !fields.is_empty() {
                    differences.push(difference(
                        format!("{target} backend {}: {fields}", b.address),
                        DifferenceKind::Settings,
                    ));
                }
            }
            for old in file_backends {
                if !vip.backends.iter().any(|b| b.address == old.address) {
                    differences.push(RuntimeDifference {
                        vip: vip.name.clone(),
                        backend: old.clone(),
                        kind: DifferenceKind::Removed,
                        what: format!("{target} backend {} removed", old.address),
                    });
                }
            }
        }
        differences
    }

    /// Makes `model` the running one, and drops the metric series of the VIPs and
    /// backends it no longer has.
    fn replace_model(&mut self, model: Model) {
        let mut gone_vips = Vec::new();
        let mut gone_backends = Vec::new();
        for old in &self.model.vips {
            let kept = model.vips.iter().find(|v| v.config.name == old.config.name);
            if kept.is_none() {
                gone_vips.push(old.config.name.clone());
            }
            for b in &old.backends {
                let stays = kept.is_some_and(|v| {
                    v.backends
                        .iter()
                        .any(|n| n.config.address == b.config.address)
                });
                if !stays {
                    gone_backends.push((old.config.name.clone(), b.config.address.to_string()));
                }
            }
        }
        self.observed.forget(&gone_vips, &gone_backends);
        self.model = model;
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
        self.validate_on_host(&config)?;
        let mut model = self.model.clone();
        model.update(&config)?;
        follow_routes(&mut model, &self.ifindexes(), self.route_of);
        self.replace_model(model);
        self.config = config;
        self.sync();
        self.save_runtime_changes();
        self.publish();
        // Logged by the control socket, with who asked.
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
        let what = self.change(what, |config| {
            find_backend(config, &target, backend)?.state = state;
            Ok(())
        })?;
        Ok(match self.agent_overrides(&target, backend) {
            Some(agent) => format!(
                "{what}; its agent check says {agent}, which applies while the admin state \
                 is ready: that state holds until its agent says ready"
            ),
            None => what,
        })
    }

    /// The state a backend's agent check holds it in although its admin state is ready
    /// (`[vip.agent]` said drain or maint), if any.
    fn agent_overrides(&self, vip: &VipTarget, backend: IpAddr) -> Option<AdminState> {
        let vip = self.model.vips.iter().find(|v| {
            v.config.address == vip.address
                && v.config.port == vip.port
                && v.config.protocol == vip.protocol
        })?;
        let b = vip.backends.iter().find(|b| b.config.address == backend)?;
        (b.config.state == AdminState::Ready)
            .then_some(b.agent.admin)
            .flatten()
            .filter(|agent| *agent != AdminState::Ready)
    }

    /// `lb backend add VIP BACKEND [--weight N]`: takes traffic once its MAC is known and
    /// (when checked) its health checks pass.
    pub fn add_backend(
        &mut self,
        vip: &VipTarget,
        backend: IpAddr,
        weight: u32,
    ) -> Result<String, ControlError> {
        if weight == 0 || weight > MAX_WEIGHT {
            return Err(ControlError::BadWeight(weight));
        }
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
                server_id: None,
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
        self.publish();
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
            self.replace_model(model);
            for (vip, address) in &removable {
                self.remove_when_drained.remove(&(vip.clone(), *address));
                tracing::info!("backend {address} of vip {vip} removed");
            }
            self.config = config;
            self.save_runtime_changes();
            changed = true;
        }
        if changed {
            self.sync();
        }
        Ok(())
    }

    /// Marks drained what is done draining; returns whether any was.
    ///
    /// A `stable_slots` VIP's flows in stable slots have no entry to count: one that was
    /// active just before the drain makes its entry (in its slot, changed by the drain)
    /// only when it sends again. Its entry would have counted as active for
    /// `flow_idle_timeout` after its last packet, so such a drain ends no sooner than
    /// that after it began.
    fn finish_drains(&mut self, now: Instant) -> bool {
        let last_scan = self.telemetry.last_scan;
        let idle = self.config.dataplane.flow_idle_timeout;
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
                let unseen_flows_idle =
                    !vip.config.stable_slots || now.duration_since(started) >= idle;
                let counted_since =
                    last_scan.is_some_and(|scan| scan > started) && unseen_flows_idle;
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

    /// `stable_slots`: what the agent's task that turns changed slots stable needs,
    /// outside this lock.
    pub fn stabilizer(&self) -> crate::writer::StabilizerParts {
        crate::writer::StabilizerParts {
            stabilizer: self.tables.stabilizer(),
            idle: self.config.dataplane.flow_idle_timeout,
            conntrack_entries: self.config.dataplane.conntrack_entries,
            counters: self.tables.counters(),
            horizon: self.horizon.clone(),
        }
    }

    /// What a counter sample reads, to read outside this lock: the counters' read side
    /// and the backends to read.
    pub fn counters_to_sample(&self) -> (Arc<crate::dataplane::CounterReader>, Vec<u32>) {
        (self.tables.counters(), self.backend_ids())
    }

    /// Takes a sample of the data path's counters (read outside the lock, through
    /// `counters_to_sample`) into the telemetry: rates, hot spots, heavy hitters.
    pub fn record_sample(
        &mut self,
        now: Instant,
        counters: crate::dataplane::Counters,
        sources: Vec<(SourceKey, u64)>,
    ) {
        let new_flows = counters
            .backends
            .iter()
            .map(|(id, c)| (*id, c.new_flows))
            .collect();
        self.telemetry.sample(now, &self.model, new_flows, sources);
        self.follow_hot_sources(now);
        self.publish();
    }

    /// What an outlier sample reads, to read outside this lock: the counters' read side
    /// and the backends of VIPs with `[vip.outlier]`.
    pub fn outliers_to_read(&self) -> (Arc<crate::dataplane::CounterReader>, Vec<u32>) {
        (
            self.tables.counters(),
            health::outlier::backends_to_read(&self.model),
        )
    }

    /// Passive health (`[vip.outlier]`): judges the backends by their handshakes (read
    /// outside the lock, through `outliers_to_read`); new tables when one leaves or
    /// returns.
    pub fn judge_outliers(&mut self, now: Instant, readings: &health::outlier::Readings) {
        if health::outlier::sample(&mut self.model, readings, now) {
            self.sync();
        } else {
            self.publish();
        }
    }

    /// Hands the writer the telemetry's hot sources (it writes `LB_HOT_SRC`, as every
    /// other data-path write), saying which became hot and which no longer are.
    fn follow_hot_sources(&mut self, now: Instant) {
        let hot = &self.telemetry.hot;
        if hot.skipped > 0 {
            tracing::warn!(
                "{} hot source(s) skipped: {} hot sources at most",
                hot.skipped,
                lb_common::HOT_SOURCE_ENTRIES
            );
        }
        let vip_name = |key: &SourceKey| {
            self.model
                .vips
                .iter()
                .find(|v| v.id == key.vip_id)
                .map_or_else(|| format!("id {}", key.vip_id), |v| v.config.name.clone())
        };
        let held = &self.last_inputs.hot_sources;
        for key in held.iter().filter(|key| !hot.hot.contains_key(key)) {
            tracing::info!(
                "source {} of vip {} is no longer hot: balanced by source again",
                source_address(key),
                vip_name(key)
            );
        }
        for (key, state) in hot.hot.iter().filter(|(key, _)| !held.contains(key)) {
            tracing::info!(
                "source {} of vip {} is hot ({:.0}% of its new flows): its new flows are \
                 balanced per connection",
                source_address(key),
                vip_name(key),
                state.share * 100.0
            );
        }
        self.request_if_changed(now);
    }

    fn backend_ids(&self) -> Vec<u32> {
        self.model
            .vips
            .iter()
            .flat_map(|v| v.backends.iter().map(|b| b.id))
            .collect()
    }

    /// A copy of what a status and a metrics scrape are made of, taken under the agent's
    /// lock without a syscall: the counters are read from it after the lock is let go,
    /// through the writer's read side.
    pub fn status_source(&self) -> StatusSource {
        StatusSource {
            model: self.model.clone(),
            written: self.tables.reports(),
            requested: self.requested,
            lookups: self.tables.lookups(),
            counters: self.tables.counters(),
            slot_words: self.tables.slot_words(),
            horizon: self.horizon.clone(),
            telemetry: self.telemetry.clone(),
            interface: self.interface.clone(),
            interface_gone: self.interface_gone,
            ports: self.ports.clone(),
            mode: self.mode,
            native_refused: self.native_refused.clone(),
            next_program: self.next_program.clone(),
            config: self.config.clone(),
            start: self.start.clone(),
            announce: self.announce.clone(),
            cluster: self.cluster.clone(),
            observed: self.observed.clone(),
            agent: self.agent_status(),
            started: self.started,
        }
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
            self.interface.mtu = now.mtu;
            // The default tunnel sources are the interface's addresses; the MTU bounds
            // tunnelled packets, and says whether frames fit in one buffer.
            let tunnel = tunnel_config(&self.config, &self.interface, self.mode);
            if tunnel != self.last_inputs.tunnel {
                self.sync();
            } else {
                self.publish();
            }
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
        self.publish();
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

    fn vip_route(&self, id: u32) -> Result<VipRoute, VipPathError> {
        let (vip, b) = self
            .model
            .vips
            .iter()
            .find_map(|v| v.backends.iter().find(|b| b.id == id).map(|b| (v, b)))
            .ok_or(VipPathError::BackendGone)?;
        let address = vip.config.address;
        // The interface its traffic leaves by: the first, or (several) the backend's.
        let (name, ifindex) = match self.ports.get(b.egress as usize) {
            Some(port) if port.ifindex == 0 => {
                return Err(VipPathError::InterfaceGone(port.name.clone()));
            }
            Some(port) => (port.name.as_str(), port.ifindex),
            None => (self.interface.name.as_str(), self.interface.index),
        };
        let tunnel = if vip.config.forward.is_tunnel() {
            let backend = b.config.address;
            if b.next_hop.is_none() {
                return Err(VipPathError::NoRoute {
                    backend,
                    interface: name.into(),
                });
            }
            // The data path's outer source (`tunnel_config`).
            let source = self
                .config
                .tunnel_source_for(backend, &self.interface.addresses)
                .map_err(|(_, why)| VipPathError::NoTunnelSource(why))?;
            Some(crate::health::vipprobe::Tunnel {
                source,
                backend,
                gue_port: (vip.config.forward == crate::config::Forward::Gue)
                    .then(|| vip.config.gue_port()),
            })
        } else {
            None
        };
        let mac = b.mac.ok_or(if tunnel.is_some() {
            VipPathError::NextHopMacUnknown
        } else {
            VipPathError::BackendMacUnknown
        })?;
        Ok(VipRoute {
            vip: std::net::SocketAddr::new(address, vip.config.port),
            mac: mac.0,
            interface: name.into(),
            ifindex,
            tunnel,
        })
    }

    fn record_check(&mut self, id: u32, record: CheckRecord, rise: u32, fall: u32) {
        if health::record(&mut self.model, &self.observed, id, record, rise, fall).is_some() {
            self.sync();
        } else {
            // Its last check and streak, which status shows.
            self.publish();
        }
    }
}

impl AgentHost for State {
    fn model(&self) -> &Model {
        &self.model
    }

    fn record_agent(&mut self, id: u32, answer: Result<AgentReport, impl std::fmt::Display>) {
        let now = Instant::now();
        let Some((vip, b)) = self.model.vips.iter_mut().find_map(|v| {
            let name = v.config.name.clone();
            v.backends
                .iter_mut()
                .find(|b| b.id == id)
                .map(|b| (name, b))
        }) else {
            return;
        };
        let address = b.config.address;
        let old_error = b.agent.error.clone();
        let changed = b.record_agent(answer, now);
        match &b.agent.error {
            // Logged once per new error, not every interval.
            Some(error) if old_error.as_ref() != Some(error) => tracing::warn!(
                "backend {address} of vip {vip}: {error}; its last answer stays in force"
            ),
            _ => {}
        }
        if changed {
            let agent = &b.agent;
            tracing::info!(
                "backend {address} of vip {vip}: its agent says{}{}{}",
                agent.percent.map(|p| format!(" {p}%")).unwrap_or_default(),
                agent.admin.map(|a| format!(" {a}")).unwrap_or_default(),
                if agent.down { " down" } else { "" }
            );
            self.sync();
        } else {
            self.publish();
        }
    }
}

/// Starts the check tasks (health and agent) that are missing: after a start, a reload or
/// a runtime change.
pub fn spawn_checks(state: &Arc<Mutex<State>>, tasks: &HealthTasks) {
    health::spawn_checks(state, tasks);
    agentcheck::spawn(state, &tasks.agents, &tasks.shutdown);
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

    fn announce_changed(&mut self) {
        self.publish();
    }
}

impl cluster::Host for State {
    fn cluster_config(&self) -> Option<&crate::config::ClusterConfig> {
        self.config.cluster.as_ref()
    }

    fn directory(&self) -> cluster::Directory {
        cluster::Directory::new(self.model.vips.iter().flat_map(|vip| {
            let key = vip.key();
            vip.backends
                .iter()
                .map(move |b| (key, b.id, lb_common::addr::to_map(b.config.address).0))
        }))
    }

    fn udp_idle(&self) -> std::time::Duration {
        self.config.dataplane.flow_idle_timeout
    }

    fn learned(&mut self) {
        self.announce.learning = false;
        self.announce.changed();
        self.publish();
    }
}

/// Re-reads the configuration file and applies it (SIGHUP, `lb reload`). On any error the
/// running configuration stays as it was. Returns the changes and the table write to
/// wait for.
pub fn reload(
    state: &Arc<Mutex<State>>,
    health_tasks: &HealthTasks,
) -> Result<(Vec<String>, Requested), ReloadError> {
    let config_path = state
        .lock()
        .expect("agent state poisoned")
        .config_path
        .clone();
    // Read and opened before the lock is taken: the file, the next program's pin.
    let input = Config::load(&config_path).map(ReloadInput::open);
    let (result, save) = {
        let mut guard = state.lock().expect("agent state poisoned");
        let result = input
            .map_err(ReloadError::from)
            .and_then(|input| guard.reload(input))
            .map(|changes| (changes, guard.tables.requested()));
        guard.record_reload(result.as_ref().err().map(|error| with_sources(error)));
        guard.publish();
        (result, guard.state_file_write())
    };
    // Written once the lock is let go, before the reload answers.
    if let Some(save) = save {
        save.write();
    }
    let (changes, written) = match result {
        Ok(done) => done,
        Err(error) => {
            tracing::error!("reload refused: {}", with_sources(&error));
            return Err(error);
        }
    };
    spawn_checks(state, health_tasks);
    if changes.is_empty() {
        tracing::info!("reload: no change");
    }
    for line in &changes {
        tracing::info!("reload: {line}");
    }
    Ok((changes, written))
}

/// `LB_TUNNEL` as `config` and `interface`, attached in `mode` (None: not yet), make it:
/// the outer sources (`Config::tunnel_source_for`; all zero: none of that family), the
/// interface MTU, and whether every frame comes in one buffer. That holds only for one
/// interface in native mode at most `SINGLE_BUFFER_MTU`: generic mode hands the program
/// what GRO merged, in several buffers, and so does a driver above that MTU. An MTU
/// raised later is followed (`interface_change`); frames bigger than one buffer that
/// arrive before the agent writes this again count only their first buffer's bytes.
pub fn tunnel_config(
    config: &Config,
    interface: &Interface,
    mode: Option<AttachedMode>,
) -> TunnelConfig {
    let source = |family: IpAddr| config.tunnel_source_for(family, &interface.addresses);
    let linear = config.dataplane.interfaces.len() <= 1
        && mode == Some(AttachedMode::Native)
        && interface.mtu <= crate::dataplane::SINGLE_BUFFER_MTU;
    let mut tunnel = TunnelConfig {
        mtu: interface.mtu,
        linear_frames: linear as u32,
        ..TunnelConfig::default()
    };
    if let Ok(IpAddr::V4(v4)) = source(Ipv4Addr::UNSPECIFIED.into()) {
        tunnel.src_v4 = v4.octets();
    }
    if let Ok(IpAddr::V6(v6)) = source(Ipv6Addr::UNSPECIFIED.into()) {
        tunnel.src_v6 = v6.octets();
    }
    tunnel
}

/// Follows the routes of tunnelled backends (`forward = "ipip"|"gue"`): each one's next
/// hop is its route's out of one of the interfaces `ifindexes` (the gateway, or the
/// backend itself on-link), and its MAC then that neighbour's (`State::learn_macs`). A
/// backend whose route no longer leaves there loses its MAC, and with it its traffic,
/// until a route does again; one whose next hop changed keeps the old MAC until the new
/// one is known. `l2` backends are their own next hop. With several interfaces, each
/// backend's `egress` is the one its route leaves by. Returns whether any changed.
pub fn follow_routes(model: &mut Model, ifindexes: &[u32], route_of: RouteLookup) -> bool {
    let mut changed = false;
    for vip in &mut model.vips {
        let tunnel = vip.config.forward.is_tunnel();
        for b in &mut vip.backends {
            let address = b.config.address;
            let (next_hop, egress, why) = next_hop_of(address, tunnel, ifindexes, route_of);
            if next_hop == b.next_hop && egress == b.egress {
                continue;
            }
            if egress != b.egress {
                tracing::info!(
                    "backend {address} of vip {}: reached through interface {} of the data path",
                    vip.config.name,
                    egress
                );
                b.egress = egress;
            }
            if next_hop == b.next_hop {
                changed = true;
                continue;
            }
            match (next_hop, why) {
                (Some(hop), _) if hop != address => tracing::info!(
                    "backend {address} of vip {}: next hop {hop}",
                    vip.config.name
                ),
                (Some(_), _) => {}
                (None, why) => {
                    tracing::warn!(
                        "backend {address} of vip {}: no next hop ({}); out of service until \
                         a route leads there",
                        vip.config.name,
                        why.unwrap_or_default()
                    );
                    b.mac = None;
                }
            }
            b.next_hop = next_hop;
            // Back in service: a configured MAC needs no neighbour entry.
            if next_hop.is_some() && b.mac.is_none() {
                b.mac = b.config.mac;
            }
            changed = true;
        }
    }
    changed
}

/// A backend's next hop and the interface (its position in `ifindexes`) that reaches
/// it, or why there is none. An `l2` backend is its own next hop; with several
/// interfaces its route tells which one it is on, and it must be on-link there.
fn next_hop_of(
    address: IpAddr,
    tunnel: bool,
    ifindexes: &[u32],
    route_of: RouteLookup,
) -> (Option<IpAddr>, u32, Option<String>) {
    if !tunnel && ifindexes.len() <= 1 {
        return (Some(address), 0, None);
    }
    let route = match route_of(address) {
        Ok(route) => route,
        Err(error) => return (None, 0, Some(error.to_string())),
    };
    match neighbor::egress_of(&route, ifindexes) {
        Some((egress, hop)) if tunnel || hop == address => (Some(hop), egress, None),
        Some(_) => (
            None,
            0,
            Some(format!(
                "its route `{route}` is not on-link: forward = \"l2\" needs it on the \
                 segment of one of the data-path interfaces"
            )),
        ),
        None => (
            None,
            0,
            Some(format!(
                "its route `{route}` does not leave by the data-path interfaces"
            )),
        ),
    }
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

/// One line per VIP or backend added, removed or changed between two models, saying
/// what changed, old -> new.
fn describe_changes(before: &Model, after: &Model) -> Vec<String> {
    let mut lines = Vec::new();
    for vip in &after.vips {
        let Some(old) = before
            .vips
            .iter()
            .find(|v| v.config.name == vip.config.name)
        else {
            lines.push(format!(
                "vip {}: added ({}, {} backend(s))",
                vip.config.name,
                VipTarget::of(&vip.config),
                vip.backends.len()
            ));
            continue;
        };
        let (mut a, mut b) = (old.config.clone(), vip.config.clone());
        a.backends.clear();
        b.backends.clear();
        let settings = field_changes(&a, &b);
        if !settings.is_empty() {
            lines.push(format!("vip {}: {settings}", vip.config.name));
        }
        for b in &vip.backends {
            match old
                .backends
                .iter()
                .find(|o| o.config.address == b.config.address)
            {
                None => lines.push(format!(
                    "vip {}: backend {} added (weight {})",
                    vip.config.name, b.config.address, b.config.weight
                )),
                Some(o) if o.config != b.config => lines.push(format!(
                    "vip {}: backend {}: {}",
                    vip.config.name,
                    b.config.address,
                    field_changes(&o.config, &b.config)
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
    }
    for old in &before.vips {
        if !after.vips.iter().any(|v| v.config.name == old.config.name) {
            lines.push(format!(
                "vip {}: removed ({})",
                old.config.name,
                VipTarget::of(&old.config)
            ));
        }
    }
    lines
}

/// `field old -> new, ...` for every setting that differs between two values of one
/// configuration type, fields named as in the file (`health.interval 2s -> 5s`).
fn field_changes<T: serde::Serialize>(old: &T, new: &T) -> String {
    let (Ok(old), Ok(new)) = (serde_json::to_value(old), serde_json::to_value(new)) else {
        return "changed".to_string();
    };
    let mut changes = Vec::new();
    value_changes("", &old, &new, &mut changes);
    changes.join(", ")
}

fn value_changes(
    field: &str,
    old: &serde_json::Value,
    new: &serde_json::Value,
    out: &mut Vec<String>,
) {
    use serde_json::Value;
    match (old, new) {
        (Value::Object(a), Value::Object(b)) => {
            let keys: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
            for key in keys {
                let inner = if field.is_empty() {
                    key.clone()
                } else {
                    format!("{field}.{key}")
                };
                let unset = Value::Null;
                let (a, b) = (a.get(key), b.get(key));
                value_changes(&inner, a.unwrap_or(&unset), b.unwrap_or(&unset), out);
            }
        }
        _ if old == new => {}
        _ => {
            let show = |v: &Value| match v {
                Value::Null => "(unset)".to_string(),
                Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            out.push(format!("{field} {} -> {}", show(old), show(new)));
        }
    }
}

/// A configuration error of a runtime change, without the field's path in a file.
fn runtime_reason(error: &ConfigError) -> String {
    match error {
        ConfigError::Invalid { field, reason } => {
            let name = field.rsplit('.').next().unwrap_or(field);
            let name = name.split('[').next().unwrap_or(name);
            format!("{name}: {reason}")
        }
        other => other.to_string(),
    }
}

/// One way the running configuration differs from the file (see
/// `State::runtime_differences`).
#[derive(Clone, Debug, PartialEq)]
pub struct RuntimeDifference {
    /// The VIP's name.
    pub vip: String,
    /// The backend as it runs (as it was in the file, for one removed at runtime).
    pub backend: BackendConfig,
    pub kind: DifferenceKind,
    /// As the runtime command said it: `10.0.0.100:80/tcp backend 10.0.0.11 -> drain`.
    pub what: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DifferenceKind {
    /// Added at runtime; not in the file.
    Added,
    /// In the file; removed at runtime.
    Removed,
    /// Its admin state was changed at runtime.
    State,
    /// Another of its settings differs.
    Settings,
}

impl RuntimeDifference {
    /// Whether applying `file` undoes it (a file that now says the same keeps it).
    fn undone_by(&self, file: &Config) -> bool {
        let backend = file.vips.iter().find(|v| v.name == self.vip).and_then(|v| {
            v.backends
                .iter()
                .find(|b| b.address == self.backend.address)
        });
        match (self.kind, backend) {
            (DifferenceKind::Added, found) => found.is_none(),
            (DifferenceKind::Removed, found) => found.is_some(),
            // A backend the file no longer has is removed, not returned to its old state.
            (_, None) => false,
            (DifferenceKind::State, Some(b)) => b.state != self.backend.state,
            (DifferenceKind::Settings, Some(b)) => {
                let (mut a, mut c) = (b.clone(), self.backend.clone());
                (a.state, c.state) = (AdminState::Ready, AdminState::Ready);
                a != c
            }
        }
    }
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
        model::Health,
        status::HotSource,
    };
    use std::collections::HashSet;
    use test_support::{config, shared};

    #[test]
    fn reload_applies_a_backend_diff() {
        let mut shared = shared(config("eth0", &["10.0.0.11", "10.0.0.12"]));
        let kept_id = shared.model.vips[0].backends[0].id;
        let changes = shared
            .reload(ReloadInput::open(config(
                "eth0",
                &["10.0.0.11", "10.0.0.13"],
            )))
            .unwrap();
        assert_eq!(
            changes,
            [
                "vip web: backend 10.0.0.13 added (weight 1)",
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
        let refused = shared.reload(ReloadInput::open(config(
            "eth1",
            &["10.0.0.11", "10.0.0.12"],
        )));
        assert!(matches!(
            refused,
            Err(ReloadError::NeedsRestart("dataplane.interface"))
        ));
        assert_eq!(shared.model.vips, before);
        assert_eq!(shared.config.dataplane.interface, "eth0");

        let mut moved = config("eth0", &["10.0.0.11", "10.0.0.12"]);
        moved.control.metrics = Some("127.0.0.1:9999".parse().unwrap());
        assert!(matches!(
            shared.reload(ReloadInput::open(moved)),
            Err(ReloadError::NeedsRestart("control.metrics"))
        ));
        assert_eq!(shared.model.vips, before);
    }

    /// A reload whose `next_program` is not there is refused naming the field, and
    /// nothing changes: not the backends it adds either (issue 37).
    #[test]
    fn a_reload_naming_a_missing_next_program_changes_nothing() {
        let mut shared = shared(config("eth0", &["10.0.0.11"]));
        let before = shared.model.vips.clone();
        let mut new = config("eth0", &["10.0.0.11", "10.0.0.12"]);
        new.dataplane.next_program = Some("/sys/fs/bpf/lb-state-no-such-program".into());
        match shared.reload(ReloadInput::open(new)) {
            Err(ReloadError::Config(ConfigError::Invalid { field, .. })) => {
                assert_eq!(field, "dataplane.next_program")
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(shared.model.vips, before);
        assert_eq!(shared.config.dataplane.next_program, None);
    }

    fn web() -> VipTarget {
        "10.0.0.100:80/tcp".parse().unwrap()
    }

    #[test]
    fn reload_and_runtime_changes_refuse_the_interfaces_own_address() {
        let mut shared = shared(config("eth0", &["10.0.0.11"]));
        let refused = shared.reload(ReloadInput::open(config(
            "eth0",
            &["10.0.0.11", "10.0.0.2"],
        )));
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
        let zero = shared
            .add_backend(&web(), "10.0.0.12".parse().unwrap(), 0)
            .unwrap_err();
        assert!(matches!(zero, ControlError::BadWeight(0)));
        // A runtime change names no field path of a file.
        let zero = zero.to_string();
        assert!(
            zero.contains("weight 0 is not allowed") && !zero.contains("vip["),
            "{zero}"
        );
        let family = shared
            .add_backend(&web(), "fd00::12".parse().unwrap(), 1)
            .unwrap_err();
        assert!(matches!(family, ControlError::Invalid(_)));
        assert_eq!(
            family.to_string(),
            "address: fd00::12 is not of the same address family as the VIP 10.0.0.100 \
             (only a tunnel, forward = \"ipip\" or \"gue\", mixes the families)"
        );
        assert!(
            shared.runtime_differences().is_empty(),
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
    fn a_stable_slots_drain_waits_out_the_flows_that_have_no_entry_to_count() {
        let mut config = config("eth0", &["10.0.0.11", "10.0.0.12"]);
        config.vips[0].stable_slots = true;
        let mut shared = shared(config);
        let idle = shared.config.dataplane.flow_idle_timeout;
        shared
            .set_admin_state(&web(), "10.0.0.11".parse().unwrap(), AdminState::Drain)
            .unwrap();
        let scanned = Instant::now();
        shared.telemetry.last_scan = Some(scanned);
        shared.advance_drains(scanned + idle / 2).unwrap();
        assert_eq!(
            shared.model.vips[0].backends[0].admin_word(),
            "draining",
            "no entry counted, but a flow in a stable slot may still send and make one"
        );
        shared.advance_drains(scanned + idle).unwrap();
        assert_eq!(shared.model.vips[0].backends[0].admin_word(), "drained");
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
        let changes = shared
            .reload(ReloadInput::open(config("eth0", &["10.0.0.11"])))
            .unwrap();
        assert_eq!(
            changes,
            [
                "undoes runtime change: 10.0.0.100:80/tcp backend 10.0.0.11 -> maint",
                "vip web: backend 10.0.0.11: state maint -> ready"
            ]
        );
        assert_eq!(shared.model.vips[0].backends[0].admin_word(), "ready");
    }

    /// The state file follows the runtime changes (issue 41): written on a change, what
    /// a restart makes again, and gone once a reload undid them.
    #[test]
    fn the_state_file_keeps_the_runtime_changes_a_restart_makes_again() {
        let path = std::env::temp_dir().join(format!("lb-state-{}.json", std::process::id()));
        let file = config("eth0", &["10.0.0.11", "10.0.0.12"]);
        let mut shared = shared(file.clone());
        shared.state_file = Some(path.clone());
        let b11: IpAddr = "10.0.0.11".parse().unwrap();
        shared
            .set_admin_state(&web(), b11, AdminState::Drain)
            .unwrap();
        shared
            .add_backend(&web(), "10.0.0.13".parse().unwrap(), 2)
            .unwrap();
        // The controller does no I/O: it says what to write, the caller writes it.
        assert!(!path.exists(), "written by the controller");
        shared
            .state_file_write()
            .expect("a write asked for")
            .write();
        let saved = statefile::load(&path, std::path::Path::new("/nonexistent")).unwrap();
        assert_eq!(saved.len(), 2, "{saved:?}");
        assert_eq!(
            shared.agent_status().runtime_changes,
            [
                "10.0.0.100:80/tcp backend 10.0.0.11 -> drain",
                "10.0.0.100:80/tcp backend 10.0.0.13 added (weight 2)"
            ]
        );
        // A restart: the file's configuration with the saved changes made again.
        let (running, lines) = statefile::restore(&file, &saved);
        assert_eq!(lines.len(), 2, "{lines:?}");
        let mut restarted = super::test_support::shared(running);
        restarted.set_file_config(file.clone());
        assert_eq!(restarted.model.vips[0].backends[0].admin_word(), "draining");
        assert_eq!(restarted.runtime_differences().len(), 2);
        assert_eq!(restarted.agent_status().runtime_changes.len(), 2);
        // A reload undoes them, and the file goes.
        shared.reload(ReloadInput::open(file)).unwrap();
        shared
            .state_file_write()
            .expect("a write asked for")
            .write();
        assert!(!path.exists(), "nothing left to keep");
    }

    #[test]
    fn reload_lists_only_the_net_runtime_differences_from_the_file() {
        let mut shared = shared(config("eth0", &["10.0.0.11", "10.0.0.12", "10.0.0.13"]));
        let (b11, b12, b13) = (
            "10.0.0.11".parse().unwrap(),
            "10.0.0.12".parse().unwrap(),
            "10.0.0.13".parse().unwrap(),
        );
        // Cancelled: drain, then ready again.
        shared
            .set_admin_state(&web(), b11, AdminState::Drain)
            .unwrap();
        shared
            .set_admin_state(&web(), b11, AdminState::Ready)
            .unwrap();
        // Twice the same.
        shared
            .set_admin_state(&web(), b12, AdminState::Maint)
            .unwrap();
        shared
            .set_admin_state(&web(), b12, AdminState::Maint)
            .unwrap();
        // Added, then removed (drained and deleted).
        let added = "10.0.0.14".parse().unwrap();
        shared.add_backend(&web(), added, 2).unwrap();
        shared.remove_backend(&web(), added).unwrap();
        shared.telemetry.last_scan = Some(Instant::now() + std::time::Duration::from_secs(1));
        shared
            .advance_drains(Instant::now() + std::time::Duration::from_secs(1))
            .unwrap();
        assert_eq!(shared.model.vips[0].backends.len(), 3, "10.0.0.14 deleted");
        // Added and kept.
        shared
            .add_backend(&web(), "10.0.0.15".parse().unwrap(), 3)
            .unwrap();
        // Being removed.
        shared.remove_backend(&web(), b13).unwrap();
        let what: Vec<String> = shared
            .runtime_differences()
            .into_iter()
            .map(|d| d.what)
            .collect();
        assert_eq!(
            what,
            [
                "10.0.0.100:80/tcp backend 10.0.0.12 -> maint",
                "10.0.0.100:80/tcp backend 10.0.0.13 -> drain; removed once drained",
                "10.0.0.100:80/tcp backend 10.0.0.15 added (weight 3)",
            ]
        );

        // A file that now says maint for 10.0.0.12 keeps that change: it is not undone.
        let mut file = config("eth0", &["10.0.0.11", "10.0.0.12", "10.0.0.13"]);
        file.vips[0].backends[1].state = AdminState::Maint;
        let changes = shared.reload(ReloadInput::open(file)).unwrap();
        assert_eq!(
            changes,
            [
                "undoes runtime change: 10.0.0.100:80/tcp backend 10.0.0.13 -> drain; removed \
                 once drained",
                "undoes runtime change: 10.0.0.100:80/tcp backend 10.0.0.15 added (weight 3)",
                "vip web: backend 10.0.0.13: state drain -> ready",
                "vip web: backend 10.0.0.15 removed",
            ]
        );
        assert!(shared.runtime_differences().is_empty());
        // And a removal at runtime is a difference too (the file has the backend).
        assert_eq!(
            shared
                .reload(ReloadInput::open(config("eth0", &["10.0.0.11"])))
                .unwrap(),
            [
                "vip web: backend 10.0.0.12 removed",
                "vip web: backend 10.0.0.13 removed"
            ]
        );
    }

    #[test]
    fn reload_says_what_changed_old_to_new() {
        let mut shared = shared(config("eth0", &["10.0.0.11"]));
        let mut new = config("eth0", &["10.0.0.11"]);
        new.vips[0].backends[0].weight = 3;
        new.vips[0].health.interval = std::time::Duration::from_secs(5);
        new.vips[0].address = "10.0.0.101".parse().unwrap();
        let mut other = new.vips[0].clone();
        other.name = "web6".into();
        other.address = "fd00::100".parse().unwrap();
        other.backends.clear();
        new.vips.push(other);
        assert_eq!(
            shared.reload(ReloadInput::open(new)).unwrap(),
            [
                "vip web: address 10.0.0.100 -> 10.0.0.101, health.interval 2s -> 5s",
                "vip web: backend 10.0.0.11: weight 1 -> 3",
                "vip web6: added ([fd00::100]:80/tcp, 0 backend(s))",
            ]
        );
        assert_eq!(
            shared
                .reload(ReloadInput::open(config("eth0", &["10.0.0.11"])))
                .unwrap()[2],
            "vip web6: removed ([fd00::100]:80/tcp)"
        );
    }

    #[test]
    fn a_removed_backends_metric_series_go_with_it() {
        let mut shared = shared(config("eth0", &["10.0.0.11", "10.0.0.12"]));
        for backend in ["10.0.0.11", "10.0.0.12"] {
            observe_check(
                &shared.observed,
                "web",
                "tcp",
                backend,
                0.001,
                Some(Health::Up),
            );
        }
        let text = render(&shared.scrape().unwrap()).unwrap();
        assert!(text.contains("backend=\"10.0.0.12\""), "{text}");
        shared
            .reload(ReloadInput::open(config("eth0", &["10.0.0.11"])))
            .unwrap();
        let text = render(&shared.scrape().unwrap()).unwrap();
        assert!(!text.contains("10.0.0.12"), "{text}");
        assert!(
            text.contains(
                "lb_health_transitions_total{vip=\"web\",backend=\"10.0.0.11\",to=\"up\"}"
            ),
            "{text}"
        );
        // A VIP renamed: the old name's series go.
        let mut renamed = config("eth0", &["10.0.0.11"]);
        renamed.vips[0].name = "www".into();
        shared.reload(ReloadInput::open(renamed)).unwrap();
        let text = render(&shared.scrape().unwrap()).unwrap();
        assert!(!text.contains("vip=\"web\""), "{text}");
    }

    #[test]
    fn a_backend_in_maintenance_is_unchecked_and_not_counted_healthy() {
        let mut shared = shared(config("eth0", &["10.0.0.11", "10.0.0.12", "10.0.0.13"]));
        shared
            .set_admin_state(&web(), "10.0.0.12".parse().unwrap(), AdminState::Maint)
            .unwrap();
        // As a checked backend that was up when it went into maintenance.
        for b in shared.model.backends_mut() {
            b.health = Health::Up;
            b.last_check = Some(CheckRecord {
                ok: true,
                latency_ms: 1.3,
                error: None,
                local: false,
            });
        }
        shared.model.vips[0].backends[2].health = Health::Down;
        let status = shared.status().unwrap();
        let vip = &status.vips[0];
        assert_eq!(
            (vip.healthy_backends, vip.unhealthy_backends),
            (1, 1),
            "maint counts in neither"
        );
        assert_eq!(vip.backends[1].health, Health::Unknown);
        let text = crate::status::render(&status);
        let line = text.lines().find(|l| l.contains("10.0.0.12")).unwrap();
        assert!(
            line.contains("unknown") && line.ends_with("unchecked (maint)"),
            "{line}"
        );
        assert!(
            !line.contains(" up ") && !line.contains("ok 1.3ms"),
            "{line}"
        );
    }

    fn with_announce(mut config: Config) -> Config {
        config.announce = Some(AnnounceConfig::default());
        config
    }

    #[test]
    fn a_reload_that_moves_the_routes_is_refused() {
        let mut shared = shared(config("eth0", &["10.0.0.11"]));
        let refused = shared.reload(ReloadInput::open(with_announce(config(
            "eth0",
            &["10.0.0.11"],
        ))));
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

    fn member_weights(shared: &State) -> Vec<u32> {
        shared.last_inputs.vips[0]
            .members
            .iter()
            .map(|m| m.weight)
            .collect()
    }

    #[test]
    fn slow_start_ramps_a_backend_that_returns_in_steps() {
        let mut file = config("eth0", &["10.0.0.11", "10.0.0.12"]);
        file.vips[0].slow_start = Some(std::time::Duration::from_secs(10));
        let mut shared = shared(file);
        assert_eq!(member_weights(&shared), [100, 100], "no ramp at start");
        let returning: IpAddr = "10.0.0.11".parse().unwrap();
        shared
            .set_admin_state(&web(), returning, AdminState::Maint)
            .unwrap();
        assert_eq!(member_weights(&shared), [100]);
        shared
            .set_admin_state(&web(), returning, AdminState::Ready)
            .unwrap();
        assert_eq!(member_weights(&shared), [10, 100], "a tenth at first");
        let started = shared.model.vips[0].backends[0]
            .load
            .ramp_started
            .expect("ramping");
        let status = shared.status().unwrap();
        let b = &status.vips[0].backends[0];
        assert_eq!(
            (b.effective_weight, b.weight_reason.as_str()),
            (0.1, "slow start 10%")
        );
        let ticket = shared.tables.requested();
        shared.refresh_load(started + std::time::Duration::from_millis(500));
        assert_eq!(member_weights(&shared), [10, 100], "within the step");
        shared.refresh_load(started + std::time::Duration::from_millis(5500));
        assert_eq!(member_weights(&shared), [60, 100]);
        shared.refresh_load(started + std::time::Duration::from_secs(10));
        assert_eq!(member_weights(&shared), [100, 100], "the full weight");
        assert!(shared.model.vips[0].backends[0].load.ramp_started.is_none());
        drop(ticket);
    }

    /// Issue 34: status's `effective_weight` and `slots` agree after `lb maint` then `lb
    /// ready` on a VIP whose backends came up on their first checks after the start.
    /// Before the fix the three others ramped from those first checks ("slow start 10%"
    /// beside the returning one's), so the returning one held a quarter of the table.
    #[test]
    fn status_weights_and_slots_agree_after_maint_then_ready() {
        let mut file = config(
            "eth0",
            &["10.0.0.11", "10.0.0.12", "10.0.0.13", "10.0.0.14"],
        );
        file.vips[0].slow_start = Some(std::time::Duration::from_secs(300));
        file.vips[0].health.kind = crate::config::HealthKind::Tcp;
        let mut shared = test_support::shared_sized(file, 65537);
        let pass = |shared: &mut State, id: u32| {
            let ok = CheckRecord {
                ok: true,
                latency_ms: 1.0,
                error: None,
                local: false,
            };
            CheckHost::record_check(shared, id, ok, 1, 1);
        };
        let ids: Vec<u32> = shared.model.backends().map(|b| b.id).collect();
        for &id in &ids {
            pass(&mut shared, id);
        }
        let returning: IpAddr = "10.0.0.11".parse().unwrap();
        shared
            .set_admin_state(&web(), returning, AdminState::Maint)
            .unwrap();
        shared
            .set_admin_state(&web(), returning, AdminState::Ready)
            .unwrap();
        pass(&mut shared, ids[0]);

        let status = shared.status().unwrap();
        let backends = &status.vips[0].backends;
        let reasons: Vec<&str> = backends.iter().map(|b| b.weight_reason.as_str()).collect();
        assert_eq!(
            reasons,
            ["slow start 10%", "configured", "configured", "configured"]
        );
        let total: f64 = backends.iter().map(|b| b.effective_weight).sum();
        for b in backends {
            let expected = 65537.0 * b.effective_weight / total;
            assert!(
                (b.slots as f64 - expected).abs() <= expected / 100.0 + 1.0,
                "backend {}: {} slots, effective weight {} gives {expected:.0}",
                b.address,
                b.slots,
                b.effective_weight
            );
        }
    }

    #[test]
    fn status_counts_the_slots_a_change_moved_on_a_vip_with_stable_slots() {
        let mut file = config("eth0", &["10.0.0.11", "10.0.0.12"]);
        file.vips[0].stable_slots = true;
        let mut shared = shared(file);
        let vip = &shared.status().unwrap().vips[0];
        assert!(vip.stable_slots);
        assert_eq!(vip.changed_slots, 0, "a fresh table is all stable");
        let moved = vip.backends[0].slots;
        shared
            .set_admin_state(&web(), "10.0.0.11".parse().unwrap(), AdminState::Drain)
            .unwrap();
        // The drained backend's slots moved; each names it until a scan.
        assert_eq!(shared.status().unwrap().vips[0].changed_slots, moved);
    }

    #[test]
    fn hot_sources_are_written_to_the_data_path_and_shown() {
        let mut file = config("eth0", &["10.0.0.11", "10.0.0.12"]);
        file.vips[0].hash = crate::config::HashMode::SrcIp;
        file.vips[0].hot_source_share = Some(0.3);
        let mut shared = shared(file);
        let vip_id = shared.model.vips[0].id;
        let source = |last: u8| {
            let (addr, family) = lb_common::addr::to_map(IpAddr::from([10, 0, 0, last]));
            SourceKey::new(vip_id, addr, family)
        };
        let sample = |shared: &mut State, deltas: Vec<(SourceKey, u64)>| {
            let shares = [(vip_id, 0.3)].into();
            shared
                .telemetry
                .hot
                .update(&shares, &[(vip_id, deltas)].into());
            shared.follow_hot_sources(Instant::now());
            let mut held = shared.tables.dataplane().hot_sources().unwrap();
            held.sort_by_key(|k| k.addr);
            held
        };
        // 10.0.0.1 has 80% of the new flows, 10.0.0.2 20%.
        let held = sample(&mut shared, vec![(source(1), 80), (source(2), 20)]);
        assert_eq!(held, [source(1)]);
        let status = shared.status().unwrap();
        assert_eq!(
            status.vips[0].hot_sources,
            [HotSource {
                address: "10.0.0.1".into(),
                share: 0.8
            }]
        );
        assert!(
            crate::status::render(&status)
                .contains("hot sources (balanced per connection): 10.0.0.1 (80%)"),
            "{}",
            crate::status::render(&status)
        );
        // The other turns hot as well; then the first cools down and leaves.
        assert_eq!(
            sample(&mut shared, vec![(source(1), 50), (source(2), 50)]),
            [source(1), source(2)]
        );
        for _ in 0..crate::hot::COLD_SAMPLES {
            sample(&mut shared, vec![(source(2), 100)]);
        }
        assert_eq!(sample(&mut shared, vec![(source(2), 100)]), [source(2)]);
        assert_eq!(
            shared.model.vips[0].flags(),
            lb_common::VIP_F_HASH_SRC_IP | lb_common::VIP_F_HOT_SOURCES
        );
    }

    #[test]
    fn least_flows_gives_the_busy_backend_less_and_the_idle_one_more() {
        let mut file = config("eth0", &["10.0.0.11", "10.0.0.12", "10.0.0.13"]);
        file.vips[0].balance = crate::config::Balance::LeastFlows;
        let mut shared = shared(file);
        assert_eq!(member_weights(&shared), [100, 100, 100]);
        let ids: Vec<u32> = shared.model.vips[0].backends.iter().map(|b| b.id).collect();
        shared.telemetry.active_flows = [(ids[0], 40), (ids[1], 2), (ids[2], 3)].into();
        shared.reweigh();
        let weights = member_weights(&shared);
        assert!(
            weights[0] < 100 && weights[1] > 100 && weights[2] > 100,
            "{weights:?}"
        );
        // Bounded, one step per re-weighting.
        for _ in 0..20 {
            shared.reweigh();
        }
        // The idle ones at the 4x bound; the busy one where its goal, (15 + 1) / (40 + 1)
        // = 0.39x, is within the dead band of its level, 0.5x.
        assert_eq!(member_weights(&shared), [50, 400, 400]);
        // Even flows: each weight moves back one step towards its configured one.
        shared.telemetry.active_flows = [(ids[0], 10), (ids[1], 10), (ids[2], 10)].into();
        shared.reweigh();
        assert_eq!(member_weights(&shared), [71, 283, 283]);
    }

    #[test]
    fn an_agent_drains_and_reweighs_its_backend_and_a_bad_answer_changes_nothing() {
        use crate::model::weights::parse_agent_reply;
        let mut shared = shared(config("eth0", &["10.0.0.11", "10.0.0.12"]));
        let id = shared.model.vips[0].backends[0].id;
        shared.record_agent(id, parse_agent_reply("50%"));
        assert_eq!(member_weights(&shared), [50, 100]);
        shared.record_agent(id, parse_agent_reply("sideways"));
        assert_eq!(
            member_weights(&shared),
            [50, 100],
            "the last good answer stays"
        );
        let status = shared.status().unwrap();
        let b = &status.vips[0].backends[0];
        assert_eq!(b.weight_reason.as_str(), "agent 50%");
        assert!(
            b.agent_error
                .as_deref()
                .is_some_and(|e| e.contains("sideways"))
        );
        assert_eq!(b.state_reason, None);
        shared.record_agent(id, parse_agent_reply("drain"));
        let b = &shared.model.vips[0].backends[0];
        assert_eq!(b.admin_word(), "draining");
        assert!(b.serves_flows() && !b.in_table(), "drained like `lb drain`");
        assert_eq!(member_weights(&shared), [100]);
        // Status says why, in JSON and in the text (issue 41 item 5).
        let status = shared.status().unwrap();
        let reason = status.vips[0].backends[0].state_reason.clone().unwrap();
        assert!(reason.starts_with("agent check says drain"), "{reason}");
        let text = crate::status::render(&status);
        assert!(
            text.contains(&format!("    draining because {reason}")),
            "{text}"
        );
        // The file's maint wins over the agent's ready.
        shared
            .set_admin_state(&web(), "10.0.0.11".parse().unwrap(), AdminState::Maint)
            .unwrap();
        shared.record_agent(id, parse_agent_reply("ready 100%"));
        assert_eq!(shared.model.vips[0].backends[0].admin_word(), "maint");
        shared
            .set_admin_state(&web(), "10.0.0.11".parse().unwrap(), AdminState::Ready)
            .unwrap();
        assert_eq!(member_weights(&shared), [100, 100]);
        shared.record_agent(id, parse_agent_reply("down"));
        assert_eq!(member_weights(&shared), [100], "down: out of the table");
        let status = shared.status().unwrap();
        assert_eq!(
            status.vips[0].backends[0].state_reason.as_deref(),
            Some("agent check says down")
        );
    }

    /// A runtime refusal names the setting once and no index of the file (the backend
    /// added is in no file).
    #[test]
    fn lb_backend_add_at_the_balancers_own_address_is_refused_once_without_a_file_index() {
        let mut shared = shared(config("eth0", &["10.0.0.11", "10.0.0.12"]));
        let refusal = shared
            .add_backend(&web(), "10.0.0.2".parse().unwrap(), 1)
            .unwrap_err()
            .to_string();
        assert_eq!(
            refusal,
            "address: 10.0.0.2 is an address of dataplane.interface eth0 (this balancer): a \
             backend must be another host on its segment"
        );
    }

    #[tokio::test]
    async fn status_and_metrics_count_reloads_and_say_the_last_one() {
        let dir = std::env::temp_dir().join(format!("lb-reload-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("lb.toml");
        let state = Arc::new(Mutex::new(shared(config("eth0", &["10.0.0.11"]))));
        state.lock().unwrap().config_path = file.clone();
        let tasks = HealthTasks::new(tokio_util::sync::CancellationToken::new());
        let started = state.lock().unwrap().status().unwrap().agent;
        assert_eq!(started.version, env!("CARGO_PKG_VERSION"));
        assert_eq!(started.config_path, file.display().to_string());
        assert_eq!((started.reloads_ok, started.reloads_refused), (0, 0));
        assert!(started.last_reload.is_none() && started.last_load_unix_seconds > 0);
        // No file yet: refused. Then the same configuration written out: accepted.
        assert!(reload(&state, &tasks).is_err());
        std::fs::write(
            &file,
            "[dataplane]\ninterface = \"eth0\"\nmaglev_table_size = 7\n[[vip]]\n\
             name = \"web\"\naddress = \"10.0.0.100\"\nport = 80\nprotocol = \"tcp\"\n\
             [vip.health]\nkind = \"none\"\n[[vip.backend]]\naddress = \"10.0.0.11\"\n\
             mac = \"02:00:00:00:00:00\"\n",
        )
        .unwrap();
        let refused = state.lock().unwrap().status().unwrap().agent;
        let last = refused.last_reload.unwrap();
        assert_eq!((refused.reloads_ok, refused.reloads_refused), (0, 1));
        assert_eq!(last.result, "refused");
        assert!(last.error.is_some_and(|e| e.contains("lb.toml")));
        reload(&state, &tasks).unwrap();
        // What readers load: the reload published it.
        let source = state.lock().unwrap().published().load();
        let agent = source.status().unwrap().agent;
        assert_eq!((agent.reloads_ok, agent.reloads_refused), (1, 1));
        assert_eq!(agent.last_reload.unwrap().result, "ok");
        let text = crate::metrics::render(&source.scrape().unwrap()).unwrap();
        for line in [
            "lb_reload_total{result=\"ok\"} 1",
            "lb_reload_total{result=\"refused\"} 1",
            &format!(
                "lb_build_info{{version=\"{}\"}} 1",
                env!("CARGO_PKG_VERSION")
            ),
            &format!(
                "lb_last_reload_timestamp_seconds {}",
                agent.last_load_unix_seconds
            ),
        ] {
            assert!(text.lines().any(|l| l == line), "{line} not in:\n{text}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn lb_ready_says_when_the_agent_check_keeps_the_backend_drained() {
        use crate::model::weights::parse_agent_reply;
        let mut shared = shared(config("eth0", &["10.0.0.11", "10.0.0.12"]));
        let b11: IpAddr = "10.0.0.11".parse().unwrap();
        let id = shared.model.vips[0].backends[0].id;
        shared.record_agent(id, parse_agent_reply("drain"));
        let answer = shared
            .set_admin_state(&web(), b11, AdminState::Ready)
            .unwrap();
        assert!(
            answer.ends_with(
                "-> ready; its agent check says drain, which applies while the admin state \
                 is ready: that state holds until its agent says ready"
            ),
            "{answer}"
        );
        assert_eq!(shared.model.vips[0].backends[0].admin_word(), "draining");
        shared.record_agent(id, parse_agent_reply("ready"));
        let answer = shared
            .set_admin_state(&web(), b11, AdminState::Ready)
            .unwrap();
        assert!(answer.ends_with("-> ready"), "{answer}");
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
        observe_check(&shared.observed, "web", "tcp", "10.0.0.11", 0.002, None);
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
            "tcp",
            "10.0.0.11",
            0.002,
            Some(Health::Up),
        );
        let text = render(&shared.scrape().unwrap()).unwrap();
        assert!(
            text.contains("lb_health_check_duration_seconds_count{vip=\"web\",kind=\"tcp\"} 1"),
            "check durations by VIP and kind:\n{text}"
        );
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
            "lb_backend_effective_weight",
            "lb_xdp_actions_total",
            "lb_drops_total",
            "lb_passes_total",
            "lb_conntrack_misses_total",
            "lb_conntrack_entries",
            "lb_conntrack_capacity",
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
        // 10.0.0.11 failed its checks; 10.0.0.12 is in maintenance: not checked, so
        // neither healthy nor unhealthy.
        assert!(matches!(healthy.value, prometheus_parse::Value::Gauge(v) if v == 0.0));
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
            [
                "created",
                "embryonic",
                "hit",
                "insert_skipped",
                "promoted",
                "rehash",
                "reused"
            ]
            .map(String::from)
            .into()
        );
    }
}

/// A `State` over an in-memory data path, for unit tests of this crate.
#[cfg(test)]
pub(crate) mod test_support {
    use super::*;
    use crate::{
        config::MacAddr,
        dataplane::MemoryDataplane,
        neighbor::{NeighborError, Route},
        tables::TableWriter,
    };
    use std::time::Duration;

    use crate::{
        explain::{ExplainError, ExplainRequest, Explanation},
        metrics::Scrape,
        status::Status,
    };

    /// Reads made under the state's lock, for tests only: the agent's readers load the
    /// published snapshot and read the data path without this lock.
    impl State {
        /// What `lb status` shows.
        pub fn status(&self) -> anyhow::Result<Status> {
            self.status_source().status()
        }

        /// What one metrics scrape renders.
        pub fn scrape(&self) -> anyhow::Result<Scrape> {
            self.status_source().scrape()
        }

        /// `lb explain`: over the tables the data path holds and its connection table.
        pub fn explain(
            &self,
            request: &ExplainRequest,
            now_ns: u64,
        ) -> Result<Explanation, ExplainError> {
            self.status_source().explain(request, now_ns)
        }
    }

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

    /// Every address on-link out of interface 1 (the fake interface's index).
    pub fn on_link_route(destination: IpAddr) -> Result<Route, NeighborError> {
        Ok(Route {
            destination,
            oif: Some(1),
            gateway: None,
            unicast: true,
        })
    }

    pub fn shared(config: Config) -> State {
        shared_sized(config, 7)
    }

    /// `shared` with Maglev tables of `table_size` slots.
    pub fn shared_sized(config: Config, table_size: u32) -> State {
        let tables = Writer::inline(
            Box::new(MemoryDataplane::default()),
            TableWriter::new(table_size),
        );
        shared_over(config, table_size, tables)
    }

    /// `shared` whose data-path writes go through `tables`.
    pub fn shared_over(config: Config, table_size: u32, tables: Writer) -> State {
        let mut model = Model::new(table_size, 16, Duration::ZERO);
        model.update(&config).unwrap();
        let interface = Interface {
            name: "eth0".into(),
            index: 1,
            mac: MacAddr([2, 0, 0, 0, 0, 1]),
            addresses: vec!["10.0.0.2".parse().unwrap()],
            mtu: 1500,
        };
        let mut shared = State::new(
            PathBuf::from("/nonexistent"),
            config,
            model,
            tables,
            interface,
            AttachedMode::Generic,
        );
        shared.route_of = on_link_route;
        // Never the host's /var/lib/lb.
        shared.state_file = None;
        shared.sync();
        shared
    }
}

/// The controller (`State`) without I/O, and its readers without its lock (issue 34).
#[cfg(test)]
mod ownership_tests {
    use super::*;
    use crate::{
        dataplane::{MemoryDataplane, next::NextProgram},
        tables::{ApplyReport, Desired},
        writer::TableWrites,
    };
    use lb_common::{FlowEntry, FlowKey, VipKey};
    use std::time::Duration;
    use test_support::{config, shared, shared_over};

    /// A write side that records what it is asked to write and writes nothing.
    #[derive(Clone, Default)]
    struct FakeWrites {
        tables: Arc<Mutex<Vec<Desired>>>,
        imported: Arc<Mutex<Vec<(FlowKey, FlowEntry)>>>,
    }

    impl TableWrites for FakeWrites {
        fn write_tables(
            &mut self,
            desired: &Desired,
        ) -> Result<ApplyReport, crate::dataplane::DataplaneError> {
            self.tables.lock().unwrap().push(desired.clone());
            Ok(ApplyReport::default())
        }

        fn import_flows(
            &mut self,
            flows: &[(FlowKey, FlowEntry)],
        ) -> Result<u64, crate::dataplane::DataplaneError> {
            self.imported.lock().unwrap().extend_from_slice(flows);
            Ok(flows.len() as u64)
        }

        fn set_next_program(
            &mut self,
            _next: Option<&NextProgram>,
        ) -> Result<Option<u32>, crate::dataplane::DataplaneError> {
            Ok(None)
        }

        fn stabilize_due(&self, _at: Instant, _bound: Duration) -> bool {
            false
        }

        fn stabilize(
            &mut self,
            _flows: &[(FlowKey, FlowEntry)],
            _scanned: (Instant, u64),
            _bound: Duration,
        ) -> Result<Vec<(VipKey, usize)>, crate::dataplane::DataplaneError> {
            Ok(Vec::new())
        }
    }

    fn web() -> VipTarget {
        VipTarget::of(&config("eth0", &[]).vips[0])
    }

    /// The backends in the last table the controller asked for.
    fn members(fake: &FakeWrites) -> HashSet<u32> {
        let tables = fake.tables.lock().unwrap();
        tables.last().expect("a table was asked for").vips[0]
            .table
            .iter()
            .copied()
            .collect()
    }

    /// The controller's table decisions, shown through a fake write side (no map, no
    /// syscall): a drain, a failed check and a reload each hand the writer new tables.
    #[test]
    fn the_controller_hands_its_table_decisions_to_the_write_side() {
        let fake = FakeWrites::default();
        let tables =
            Writer::inline_with(Box::new(MemoryDataplane::default()), Box::new(fake.clone()));
        let mut file = config("eth0", &["10.0.0.11", "10.0.0.12", "10.0.0.13"]);
        file.vips[0].health.kind = crate::config::HealthKind::Tcp;
        let mut state = shared_over(file.clone(), 7, tables);
        let ids: Vec<u32> = state.model.backends().map(|b| b.id).collect();
        let check = |ok: bool| CheckRecord {
            ok,
            latency_ms: 1.0,
            error: (!ok).then(|| "connection refused".into()),
            local: false,
        };
        for &id in &ids {
            CheckHost::record_check(&mut state, id, check(true), 1, 1);
        }
        assert_eq!(members(&fake), ids.iter().copied().collect());

        state
            .set_admin_state(&web(), "10.0.0.12".parse().unwrap(), AdminState::Drain)
            .unwrap();
        assert_eq!(members(&fake), [ids[0], ids[2]].into());

        CheckHost::record_check(&mut state, ids[2], check(false), 1, 1);
        assert_eq!(members(&fake), [ids[0]].into());

        let mut new = config("eth0", &["10.0.0.11", "10.0.0.14"]);
        new.vips[0].health.kind = crate::config::HealthKind::None;
        let changes = state.reload(ReloadInput::open(new)).unwrap();
        assert!(
            changes.iter().any(|c| c.contains("10.0.0.14 added")),
            "{changes:?}"
        );
        let added = state.model.vips[0].backends[1].id;
        assert_eq!(members(&fake), [ids[0], added].into());

        let writes = fake.tables.lock().unwrap().len();
        assert!(writes >= 4, "one table request per change: {writes}");
        // What readers see as the data path's tables is what the write side was given.
        let held = state.published().load().desired();
        assert_eq!(
            held.vips[0].table,
            fake.tables.lock().unwrap().last().unwrap().vips[0].table
        );
    }

    /// A peer's entries reach the connection table through the writer, as every other
    /// data-path write (the cluster task holds no map handle of its own to write with).
    #[test]
    fn cluster_imports_go_through_the_write_side() {
        let fake = FakeWrites::default();
        let tables =
            Writer::inline_with(Box::new(MemoryDataplane::default()), Box::new(fake.clone()));
        let state = shared_over(config("eth0", &["10.0.0.11"]), 7, tables);
        let imports = state.tables.imports();
        let flow: (FlowKey, FlowEntry) =
            (bytemuck::Zeroable::zeroed(), bytemuck::Zeroable::zeroed());
        assert_eq!(imports.import_flows(vec![flow]), Ok(1));
        assert_eq!(fake.imported.lock().unwrap().len(), 1);
    }

    /// A status read loads the published snapshot: it answers while a writer holds the
    /// agent's lock (a reload, a health result), and it shows every change made before.
    #[test]
    fn a_status_read_does_not_wait_for_the_agents_lock() {
        let state = Arc::new(Mutex::new(shared(config(
            "eth0",
            &["10.0.0.11", "10.0.0.12"],
        ))));
        let published = {
            let mut state = state.lock().unwrap();
            state
                .set_admin_state(&web(), "10.0.0.12".parse().unwrap(), AdminState::Drain)
                .unwrap();
            state.published()
        };
        let held = state.lock().unwrap();
        let (answer, answered) = std::sync::mpsc::channel();
        let reader = std::thread::spawn(move || {
            let snapshot = published.load();
            let status = snapshot.status().map_err(|e| e.to_string());
            let scrape = snapshot.scrape().map(|_| ()).map_err(|e| e.to_string());
            answer.send((status, scrape)).unwrap();
        });
        // Not a timing assertion: a reader that waited for the lock would not answer
        // at all while it is held; the bound only keeps a failure from hanging.
        let got = answered.recv_timeout(Duration::from_secs(60));
        drop(held);
        reader.join().unwrap();
        let (status, scrape) = got.expect("the status read waited for the agent's lock");
        scrape.unwrap();
        let status = status.unwrap();
        assert_eq!(status.vips[0].backends[1].address, "10.0.0.12");
        assert_eq!(
            status.vips[0].backends[1].state,
            state.lock().unwrap().status().unwrap().vips[0].backends[1].state
        );
        assert!(state.lock().unwrap().tables_are_current());
    }

    /// An explain reads the connection, embryonic and hot-source tables through the read
    /// side (`FlowLookups`), not through the data path's lock the writer holds while it
    /// writes: it answers, with the flow's entry, while that lock is held. (Checked to
    /// fail when explain takes the data path's lock: it does not answer.)
    #[test]
    fn an_explain_does_not_wait_for_the_data_paths_lock() {
        // What the read side sees: the data path's maps, here a copy holding one flow.
        let mut maps = MemoryDataplane::default();
        let source: std::net::SocketAddr = "192.0.2.7:40000".parse().unwrap();
        let key = crate::explain::flow_key(&web(), source);
        let file = config("eth0", &["10.0.0.11", "10.0.0.12"]);
        // Backend ids are given in the file's order: the same in every state made of it.
        let id = shared(file.clone()).model.vips[0].backends[1].id;
        let entry = FlowEntry {
            backend_id: id,
            flags: 0,
            last_seen_ns: 0,
        };
        maps.flows.insert(key, entry);
        let reads: Box<dyn crate::dataplane::Dataplane + Send> = Box::new(maps);
        let lookups = crate::dataplane::FlowLookups::shared(Arc::new(Mutex::new(reads)));
        let tables = Writer::inline(
            Box::new(MemoryDataplane::default()),
            crate::tables::TableWriter::new(7),
        )
        .with_lookups(lookups);
        let state = shared_over(file, 7, tables);
        let published = state.published();
        let writing = state.tables.dataplane();
        let (answer, answered) = std::sync::mpsc::channel();
        let reader = std::thread::spawn(move || {
            let request = crate::explain::ExplainRequest::flow(web(), source);
            let explained = published.load().explain(&request, 0);
            answer.send(explained.map_err(|e| e.to_string())).unwrap();
        });
        // Not a timing assertion: an explain that waited for the lock would not answer
        // at all while it is held; the bound only keeps a failure from hanging.
        let got = answered.recv_timeout(Duration::from_secs(60));
        drop(writing);
        reader.join().unwrap();
        let explained = got
            .expect("the explain waited for the data path's lock")
            .unwrap();
        assert_eq!(
            explained.conntrack_backend.as_deref(),
            Some("10.0.0.12"),
            "{explained:?}"
        );
    }

    /// The controller's rule (this module's doc): no `State` method does I/O. Its
    /// `impl` blocks name none of the calls that do (files, the state file, the next
    /// program's pin, interface addresses, the configuration file, the data path's lock),
    /// where the code around them (`reload`, `ReloadInput::open`) does.
    #[test]
    fn no_method_of_the_controller_does_io() {
        const IO: [&str; 11] = [
            // Reads of the data path (counters, flows) made from a fresh snapshot.
            "status_source().",
            "counters(&",
            "std::fs",
            "statefile::save",
            "statefile::load",
            "preflight::next_program",
            "interface_address",
            "getifaddrs",
            "Config::load",
            ".dataplane()",
            "route_to(",
        ];
        let source = include_str!("state.rs");
        let code = &source[..source.find("#[cfg(test)]\nmod tests").unwrap()];
        // Each `impl ... State` block, by its braces (no brace in a string there).
        let blocks = |name: &str| -> Vec<&str> {
            let mut blocks = Vec::new();
            for (start, _) in code.match_indices("\nimpl ") {
                let header = &code[start..][..code[start..].find('{').unwrap()];
                if !header.trim_end().ends_with(name) {
                    continue;
                }
                let body = &code[start + header.len()..];
                let mut depth = 0;
                let end = body
                    .char_indices()
                    .find(|&(_, c)| {
                        depth += match c {
                            '{' => 1,
                            '}' => -1,
                            _ => 0,
                        };
                        depth == 0
                    })
                    .unwrap()
                    .0;
                blocks.push(&body[..=end]);
            }
            blocks
        };
        let io_in = |blocks: Vec<&str>| -> Vec<&str> {
            IO.into_iter()
                .filter(|call| blocks.iter().any(|b| b.contains(call)))
                .collect()
        };
        let state = blocks(" State");
        assert!(state.len() >= 5, "the State impl blocks: {}", state.len());
        assert_eq!(io_in(state), Vec::<&str>::new());
        // The scan sees a call where there is one.
        assert_eq!(io_in(blocks(" ReloadInput")), ["preflight::next_program"]);
    }

    /// Every kind of change publishes before it returns: what readers load then is what
    /// a status made under the lock shows (no stale snapshot after a command, a reload,
    /// a health result, a scan or an interface change).
    #[test]
    fn every_change_is_published_before_it_returns() {
        let mut state = shared(config("eth0", &["10.0.0.11", "10.0.0.12"]));
        let published = state.published();
        let same = |state: &State, after: &str| {
            let loaded = serde_json::to_value(published.load().status().unwrap().vips).unwrap();
            let fresh = serde_json::to_value(state.status().unwrap().vips).unwrap();
            assert_eq!(loaded, fresh, "stale after {after}");
            let loaded = published.load().status().unwrap().dataplane;
            let fresh = state.status().unwrap().dataplane;
            assert_eq!(
                loaded.detached.is_some(),
                fresh.detached.is_some(),
                "after {after}"
            );
        };
        state
            .set_admin_state(&web(), "10.0.0.12".parse().unwrap(), AdminState::Maint)
            .unwrap();
        same(&state, "lb maint");
        state
            .add_backend(&web(), "10.0.0.13".parse().unwrap(), 2)
            .unwrap();
        same(&state, "lb backend add");
        state
            .remove_backend(&web(), "10.0.0.13".parse().unwrap())
            .unwrap();
        same(&state, "lb backend remove");
        let id = state.model.vips[0].backends[0].id;
        let failed = CheckRecord {
            ok: false,
            latency_ms: 2.0,
            error: Some("timed out".into()),
            local: false,
        };
        CheckHost::record_check(&mut state, id, failed, 3, 3);
        same(&state, "a failed check below fall");
        state
            .reload(ReloadInput::open(config("eth0", &["10.0.0.11"])))
            .unwrap();
        same(&state, "a reload");
        state.record_flows(Vec::new(), Instant::now(), 0);
        same(&state, "a scan");
        state.interface_lost();
        same(&state, "the interface going");
    }
}

#[cfg(test)]
mod tunnel_tests {
    use super::*;
    use crate::neighbor::{NeighborError, Route};
    use lb_common::{ADDR_FAMILY_V4, ADDR_FAMILY_V6, FORWARD_GUE, FORWARD_IPIP, FORWARD_L2};
    use std::collections::HashMap;
    use test_support::shared;

    /// 10.0.0.0/24 on-link out of interface 1; 10.1.0.0/16 and fd00:1::/64 through the
    /// router 10.0.0.1 / fd00::1 there; 10.2.0.0/16 out of interface 2; nothing else.
    fn routes(destination: IpAddr) -> Result<Route, NeighborError> {
        let text = destination.to_string();
        let (oif, gateway) = if text.starts_with("10.0.0.") {
            (1, None)
        } else if text.starts_with("10.1.") {
            (1, Some("10.0.0.1"))
        } else if text.starts_with("fd00:1::") {
            (1, Some("fd00::1"))
        } else if text.starts_with("10.2.") {
            (2, None)
        } else {
            let unreachable = std::io::Error::from_raw_os_error(libc::ENETUNREACH);
            return Err(NeighborError::NoRoute(destination, unreachable));
        };
        Ok(Route {
            destination,
            oif: Some(oif),
            gateway: gateway.map(|g| g.parse().unwrap()),
            unicast: true,
        })
    }

    fn config(forward: &str, backends: &[&str]) -> Config {
        let mut text = format!(
            "[dataplane]\ninterface = \"eth0\"\nmaglev_table_size = 7\n\
             [[vip]]\nname = \"web\"\naddress = \"10.0.0.100\"\nport = 80\nprotocol = \"tcp\"\n\
             forward = \"{forward}\"\n[vip.health]\nkind = \"none\"\n"
        );
        for address in backends {
            text += &format!("[[vip.backend]]\naddress = \"{address}\"\n");
        }
        Config::from_toml(&text).unwrap()
    }

    fn agent(config: Config) -> State {
        let mut state = shared(config);
        state.interface.addresses = vec!["10.0.0.2".parse().unwrap(), "fd00::2".parse().unwrap()];
        state.route_of = routes;
        state.follow_routes();
        state
    }

    fn neighbours() -> HashMap<IpAddr, MacAddr> {
        [("10.0.0.1", 0xfe), ("fd00::1", 0xfd), ("10.0.0.11", 0x0b)]
            .into_iter()
            .map(|(a, last)| (a.parse().unwrap(), MacAddr([2, 0, 0, 0, 0, last])))
            .collect()
    }

    fn info(state: &State, address: &str) -> lb_common::BackendInfo {
        let b = state
            .model
            .backends()
            .find(|b| b.config.address.to_string() == address)
            .unwrap();
        state.tables.desired().backends[&b.id].info
    }

    #[test]
    fn a_routed_backend_takes_its_gateways_mac_and_an_on_link_one_its_own() {
        let mut state = agent(config("ipip", &["10.1.0.11", "10.0.0.11", "fd00:1::12"]));
        let hops: Vec<Option<IpAddr>> = state.model.backends().map(|b| b.next_hop).collect();
        assert_eq!(
            hops,
            [
                Some("10.0.0.1".parse().unwrap()),
                Some("10.0.0.11".parse().unwrap()),
                Some("fd00::1".parse().unwrap())
            ]
        );
        assert!(state.learn_macs(&neighbours()));
        state.sync();
        let routed = info(&state, "10.1.0.11");
        assert_eq!(routed.mac, [2, 0, 0, 0, 0, 0xfe], "the router's MAC");
        assert_eq!(
            (routed.forward, routed.family, routed.gue_port_be),
            (FORWARD_IPIP, ADDR_FAMILY_V4, 0)
        );
        assert_eq!(routed.addr[..4], [10, 1, 0, 11], "the outer destination");
        assert_eq!(info(&state, "10.0.0.11").mac, [2, 0, 0, 0, 0, 0x0b]);
        // An IPv4 VIP to an IPv6 backend: 4in6 through the IPv6 router.
        let mixed = info(&state, "fd00:1::12");
        assert_eq!((mixed.family, mixed.mac[5]), (ADDR_FAMILY_V6, 0xfd));
        // The outer sources: the interface's own addresses.
        let tunnel = state.tables.desired().tunnel;
        assert_eq!(tunnel.src_v4, [10, 0, 0, 2]);
        assert_eq!(
            tunnel.src_v6,
            "fd00::2".parse::<std::net::Ipv6Addr>().unwrap().octets()
        );
        assert_eq!(tunnel.mtu, 1500);
        let status = state.status().unwrap();
        let hop = status.vips[0].backends[0].next_hop.clone().unwrap();
        assert_eq!(hop.address, "10.0.0.1");
        assert_eq!(hop.mac.as_deref(), Some("02:00:00:00:00:fe"));
        assert_eq!(status.vips[0].forward, crate::config::Forward::Ipip);
    }

    #[test]
    fn frames_are_read_as_one_buffer_only_where_none_can_come_in_several() {
        let one = config("ipip", &["10.1.0.11"]);
        let mut interface = Interface {
            name: "eth0".into(),
            index: 1,
            mac: MacAddr([2, 0, 0, 0, 0, 1]),
            addresses: vec!["10.0.0.2".parse().unwrap()],
            mtu: 1500,
        };
        let linear = |config: &Config, interface: &Interface, mode| {
            tunnel_config(config, interface, mode).linear_frames
        };
        let native = Some(AttachedMode::Native);
        assert_eq!(linear(&one, &interface, native), 1);
        assert_eq!(
            linear(&one, &interface, Some(AttachedMode::Generic)),
            0,
            "generic mode hands the program what GRO merged"
        );
        assert_eq!(linear(&one, &interface, None), 0, "not attached yet");
        interface.mtu = crate::dataplane::SINGLE_BUFFER_MTU;
        assert_eq!(linear(&one, &interface, native), 1);
        interface.mtu += 1;
        assert_eq!(linear(&one, &interface, native), 0, "jumbo frames");
        interface.mtu = 1500;
        let mut two = one.clone();
        two.dataplane.interfaces = vec!["eth0".into(), "eth1".into()];
        assert_eq!(linear(&two, &interface, native), 0, "several interfaces");

        // The agent follows the MTU: raised above one buffer, the tables say so.
        let mut state = agent(one);
        state.interface_attached(interface.clone(), AttachedMode::Native);
        assert_eq!(state.tables.desired().tunnel.linear_frames, 1);
        let jumbo = Interface {
            mtu: 9000,
            ..interface
        };
        assert_eq!(state.interface_change(Some(jumbo)), InterfaceChange::None);
        let tunnel = state.tables.desired().tunnel;
        assert_eq!((tunnel.mtu, tunnel.linear_frames), (9000, 0));
    }

    #[test]
    fn a_backend_without_a_route_out_of_the_interface_has_no_next_hop() {
        let mut state = agent(config("gue", &["10.1.0.11", "10.2.0.11", "10.9.0.11"]));
        state.learn_macs(&neighbours());
        state.sync();
        let in_table: Vec<bool> = state.model.backends().map(|b| b.in_table()).collect();
        assert_eq!(in_table, [true, false, false], "only the routed one");
        let gue = info(&state, "10.1.0.11");
        assert_eq!(
            (gue.forward, u16::from_be(gue.gue_port_be)),
            (FORWARD_GUE, 6080)
        );
        // The route goes away: so do its MAC and its traffic.
        state.route_of = |d| {
            Err(NeighborError::NoRoute(
                d,
                std::io::Error::from_raw_os_error(libc::ENETUNREACH),
            ))
        };
        assert!(state.follow_routes());
        assert!(!state.model.backends().next().unwrap().in_table());
        assert!(
            state.status().unwrap().vips[0].backends[0]
                .next_hop
                .is_none()
        );
    }

    /// `agent` on two interfaces: eth0 (index 1) and eth1 (index 2).
    fn two_arm(forward: &str, backends: &[&str]) -> State {
        let mut state = shared(config(forward, backends));
        state.route_of = routes;
        let port = |name: &str, ifindex| EgressPort {
            name: name.into(),
            ifindex,
            mac: [2, 0, 0, 0, 0, ifindex as u8],
            mode: Some(AttachedMode::Generic),
            native_refused: None,
        };
        state.set_ports(vec![port("eth0", 1), port("eth1", 2)]);
        state.follow_routes();
        state
    }

    /// (next hop, egress) of each backend.
    fn ways(state: &State) -> Vec<(Option<String>, u32)> {
        state
            .model
            .backends()
            .map(|b| (b.next_hop.map(|h| h.to_string()), b.egress))
            .collect()
    }

    #[test]
    fn with_two_interfaces_each_backend_leaves_by_the_one_its_route_takes() {
        let l2 = two_arm("l2", &["10.0.0.11", "10.2.0.11", "10.1.0.11"]);
        assert_eq!(
            ways(&l2),
            [
                (Some("10.0.0.11".into()), 0),
                (Some("10.2.0.11".into()), 1),
                // Behind a router: l2 cannot reach it, whichever interface.
                (None, 0),
            ]
        );
        let mut ipip = two_arm("ipip", &["10.1.0.11", "10.2.0.12"]);
        assert_eq!(
            ways(&ipip),
            [(Some("10.0.0.1".into()), 0), (Some("10.2.0.12".into()), 1)]
        );
        ipip.learn_macs(&neighbours());
        ipip.learn_macs(&[("10.2.0.12".parse().unwrap(), MacAddr([2, 0, 0, 0, 2, 12]))].into());
        ipip.sync();
        let egress: Vec<u32> = ipip
            .tables
            .desired()
            .backends
            .values()
            .map(|b| b.egress)
            .collect();
        assert_eq!(egress, [0, 1], "written for the data path");
        // eth1 goes: its routes with it, so its backend has no way out.
        ipip.port_changed(EgressPort {
            ifindex: 0,
            mode: None,
            ..ipip.ports()[1].clone()
        });
        assert_eq!(ipip.ifindexes(), [1, 0]);
        assert!(ipip.follow_routes());
        assert_eq!(ways(&ipip)[1], (None, 0));
        assert!(!ipip.model.backends().nth(1).unwrap().in_table());
    }

    #[test]
    fn a_reload_that_changes_forward_keeps_the_backend_ids_and_rewrites_them() {
        let mut state = agent(config("l2", &["10.0.0.11"]));
        state.learn_macs(&neighbours());
        state.sync();
        let id = state.model.backends().next().unwrap().id;
        assert_eq!(info(&state, "10.0.0.11").forward, FORWARD_L2);
        let changes = state
            .reload(ReloadInput::open(config("ipip", &["10.0.0.11"])))
            .unwrap();
        assert_eq!(changes, ["vip web: forward l2 -> ipip"]);
        let b = state.model.backends().next().unwrap();
        assert_eq!(b.id, id, "its flows keep their backend");
        assert!(b.in_table(), "on-link: the same next hop and MAC");
        let rewritten = info(&state, "10.0.0.11");
        assert_eq!(rewritten.forward, FORWARD_IPIP);
        assert_eq!(rewritten.mac, [2, 0, 0, 0, 0, 0x0b]);
    }

    #[test]
    fn an_l2_backend_behind_a_router_is_refused_naming_the_route() {
        let mut state = agent(config("l2", &["10.0.0.11"]));
        let error = state
            .reload(ReloadInput::open(config("l2", &["10.0.0.11", "10.1.0.12"])))
            .unwrap_err();
        let ReloadError::Config(ConfigError::Invalid { field, reason }) = error else {
            panic!("{error:?}")
        };
        assert_eq!(field, "vip[0].backend[1].address");
        assert!(
            reason.starts_with(
                "10.1.0.12 is not on-link on eth0 (the route found is `10.1.0.12 via 10.0.0.1 dev "
            ) && reason.contains("forward = \"ipip\" or \"gue\""),
            "{reason}"
        );
        let error = state
            .reload(ReloadInput::open(config("l2", &["10.0.0.11", "10.9.0.12"])))
            .unwrap_err();
        assert!(
            error.to_string().contains("no route to 10.9.0.12"),
            "{error}"
        );
        // The same backend through a tunnel is fine.
        state
            .reload(ReloadInput::open(config(
                "ipip",
                &["10.0.0.11", "10.1.0.12"],
            )))
            .unwrap();
    }

    #[test]
    fn a_tunnel_without_a_source_of_the_backends_family_is_refused() {
        let mut state = agent(config("ipip", &["10.1.0.11"]));
        state.interface.addresses = vec!["10.0.0.2".parse().unwrap()];
        let error = state
            .reload(ReloadInput::open(config(
                "ipip",
                &["10.1.0.11", "fd00:1::12"],
            )))
            .unwrap_err();
        let ReloadError::Config(ConfigError::Invalid { field, .. }) = error else {
            panic!("{error:?}")
        };
        assert_eq!(field, "dataplane.tunnel_source6");
    }

    #[test]
    fn routes_are_read_from_the_kernel() {
        // Any namespace has its loopback: a local route, not a unicast one.
        let route = crate::neighbor::route_to("127.0.0.1".parse().unwrap()).unwrap();
        assert!(!route.unicast, "{route}");
        assert_eq!(route.next_hop(route.oif.unwrap_or(1)), None);
    }
}
