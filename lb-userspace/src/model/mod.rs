//! The agent's view of its VIPs and backends, and the pure step from it to the tables
//! the data path should hold (`Model::desired`). `weights`: the load rules (slow start,
//! least-flows, an agent's weight) that turn a configured weight into the one the table
//! builder gets. `outlier`: a backend's passive-health state. May call `config`, `dataplane` (the adopted maps' types) and `tables`
//! (the inputs it hands out); no I/O.

pub mod outlier;
pub mod weights;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::IpAddr;
use std::time::{Duration, Instant};

use lb_common::{
    BACKEND_F_SERVES_FLOWS, BackendIdentity, BackendInfo, FORWARD_GUE, FORWARD_IPIP, MAX_BACKENDS,
    MAX_VIPS, VIP_F_HASH_SRC_IP, VIP_F_HOT_SOURCES, VIP_F_OUTLIER, VIP_F_STABLE, VipKey,
    maglev::MaglevBackend, quic::ServerKey,
};
use serde::{Deserialize, Serialize};

use crate::config::{
    AdminState, BackendConfig, Balance, Config, Forward, HashMode, HealthKind, MacAddr, VipConfig,
};
use crate::dataplane::Adopted;
use crate::tables::{Desired, DesiredBackend, TableInputs, VipInputs};

/// What the health checks say of a backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Health {
    Up,
    Down,
    /// Not checked (`kind = "none"`): trusted.
    Unknown,
}

impl std::fmt::Display for Health {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // `pad`, so that table columns (`{:<8}`) line up.
        f.pad(match self {
            Health::Up => "up",
            Health::Down => "down",
            Health::Unknown => "unknown",
        })
    }
}

/// A backend's admin state as it plays out: `drain` is "draining" until its flows are
/// gone (or `drain_timeout` passed), then "drained".
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AdminStatus {
    Ready,
    Draining,
    Drained,
    Maint,
}

impl AdminStatus {
    pub const ALL: [AdminStatus; 4] = [
        AdminStatus::Ready,
        AdminStatus::Draining,
        AdminStatus::Drained,
        AdminStatus::Maint,
    ];

    pub fn word(self) -> &'static str {
        match self {
            AdminStatus::Ready => "ready",
            AdminStatus::Draining => "draining",
            AdminStatus::Drained => "drained",
            AdminStatus::Maint => "maint",
        }
    }
}

impl std::fmt::Display for AdminStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // `pad`, so that table columns (`{:<9}`) line up.
        f.pad(self.word())
    }
}

/// The result of one health check.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CheckRecord {
    pub ok: bool,
    pub latency_ms: f64,
    /// Why it failed ("connection refused", "timeout", "status 503" ...).
    pub error: Option<String>,
    /// It failed for a reason of this host (no file descriptors, no buffers, no source
    /// address, no route): no evidence against the backend, so not counted toward
    /// `fall` or `rise`.
    #[serde(default)]
    pub local: bool,
}

#[derive(Clone, Debug, PartialEq)]
pub struct BackendState {
    pub id: u32,
    pub config: BackendConfig,
    /// The MAC frames to this backend carry: its own (`forward = "l2"`: from the config,
    /// else from the neighbour table) or, tunnelled, its next hop's.
    pub mac: Option<MacAddr>,
    /// The neighbour `mac` belongs to: the backend itself (`l2`, or a tunnelled backend
    /// on-link) or the gateway of its route. None while a tunnelled backend has no route
    /// out of the interface (then it has no MAC either).
    pub next_hop: Option<IpAddr>,
    /// Which of `dataplane.interfaces` reaches `next_hop` (its position there): the
    /// interface frames to this backend leave by. 0 with one interface.
    pub egress: u32,
    pub health: Health,
    /// Consecutive results agreeing with each other (rise/fall progress).
    pub streak: u32,
    pub last_check: Option<CheckRecord>,
    /// Checks that failed for a local reason (see `CheckRecord::local`), since start.
    pub local_check_errors: u64,
    /// Of those, how many in a row since the last counted check.
    pub local_errors_in_a_row: u32,
    /// The last check that failed for a local reason.
    pub last_local_error: Option<CheckRecord>,
    /// When the backend entered `drain`.
    pub drain_started: Option<Instant>,
    /// Draining is over: its flows ended, went idle, or `drain_timeout` passed.
    pub drained: bool,
    /// What the backend's own agent said (`[vip.agent]`).
    pub agent: AgentState,
    /// Load rules (`slow_start`, `balance = "least-flows"`).
    pub load: LoadState,
    /// Passive health (`[vip.outlier]`): its clients' handshakes, and an ejection.
    pub outlier: outlier::Outlier,
}

/// What a backend's agent check last said. A malformed or missing answer changes
/// nothing: the last good one stays, and the error is shown.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AgentState {
    /// `ready`, `drain`, `maint`: applies while the file and runtime commands say ready
    /// (they keep priority).
    pub admin: Option<AdminState>,
    /// `down` (until `up`): out of the table, like a failed health check.
    pub down: bool,
    /// `NN%` of the configured weight.
    pub percent: Option<u32>,
    /// Why the last answer was not used.
    pub error: Option<String>,
}

/// Where a backend is in the load rules.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadState {
    /// It took new flows at the last table request (ramps start when this turns true).
    pub was_in_table: bool,
    /// Slow start: when the ramp began, while it lasts.
    pub ramp_started: Option<Instant>,
    /// Least-flows: its level (`weights::LEAST_FLOWS_LEVELS`).
    pub least_flows_level: usize,
    /// Entering the table starts a slow-start ramp: true for a backend added after the
    /// agent started, and for one seen serving or failing since. False for the backends
    /// of the starting configuration until then: they begin together, and a ramp that
    /// starts with each one's first passing checks would leave a backend returning a few
    /// seconds later ramping against others still ramping (HAProxy: slowstart never
    /// applies when it starts).
    pub ramps_on_entry: bool,
}

impl Default for LoadState {
    fn default() -> Self {
        Self {
            was_in_table: false,
            ramp_started: None,
            least_flows_level: weights::least_flows_neutral(),
            ramps_on_entry: true,
        }
    }
}

impl BackendState {
    /// The admin state in force: the file's or a runtime command's, and while that is
    /// ready, the agent's.
    pub fn admin_state(&self) -> AdminState {
        match self.config.state {
            AdminState::Ready => self.agent.admin.unwrap_or(AdminState::Ready),
            other => other,
        }
    }

    /// Its checks (or its agent) found it failing: not merely unchecked yet.
    fn seen_failing(&self) -> bool {
        self.agent.down || self.last_check.as_ref().is_some_and(|c| !c.ok && !c.local)
    }

    /// Not failed: by its health checks, or by its agent saying `down`.
    pub(crate) fn alive(&self) -> bool {
        self.health != Health::Down && !self.agent.down
    }

    /// May flows it already has stay? (Ready, or draining and not yet drained; and not
    /// failed.)
    pub fn serves_flows(&self) -> bool {
        let admin = match self.admin_state() {
            AdminState::Ready => true,
            AdminState::Drain => !self.drained,
            AdminState::Maint => false,
        };
        admin && self.mac.is_some() && self.alive()
    }

    /// The admin state as status shows it: ready, draining, drained or maint.
    pub fn admin_status(&self) -> AdminStatus {
        match (self.admin_state(), self.drained) {
            (AdminState::Ready, _) => AdminStatus::Ready,
            (AdminState::Drain, false) => AdminStatus::Draining,
            (AdminState::Drain, true) => AdminStatus::Drained,
            (AdminState::Maint, _) => AdminStatus::Maint,
        }
    }

    /// `admin_status` as its word.
    pub fn admin_word(&self) -> &'static str {
        self.admin_status().word()
    }

    /// In maintenance: no traffic, and not checked (its health is not known).
    pub fn is_maint(&self) -> bool {
        self.config.state == AdminState::Maint
    }

    /// May new flows go to this backend? (Not while passive health ejected it.)
    pub fn in_table(&self) -> bool {
        self.admin_state() == AdminState::Ready
            && self.mac.is_some()
            && self.alive()
            && !self.outlier.is_ejected()
    }

    /// Starts or ends a drain when the admin state in force moved into or out of it.
    fn admin_changed(&mut self, before: AdminState, now: Instant) {
        let after = self.admin_state();
        if after != AdminState::Drain {
            self.drain_started = None;
            self.drained = false;
        } else if before != AdminState::Drain {
            self.drain_started = Some(now);
            self.drained = false;
        }
    }

    /// The weight the table builder gets now, and why.
    pub fn effective_weight(&self, vip: &VipConfig, now: Instant) -> weights::Effective {
        let slow_start = vip.slow_start.and_then(|ramp| {
            let started = self.load.ramp_started?;
            weights::slow_start_factor(now.saturating_duration_since(started), ramp)
        });
        let least_flows = (vip.balance == Balance::LeastFlows)
            .then(|| weights::LEAST_FLOWS_LEVELS[self.load.least_flows_level]);
        weights::effective(
            self.config.weight,
            weights::Factors {
                slow_start,
                agent_percent: self.agent.percent,
                least_flows,
            },
        )
    }

    /// Takes an agent's answer (or why there was none usable, kept in its words for
    /// status). Returns whether the tables may change.
    pub fn record_agent(
        &mut self,
        answer: Result<weights::AgentReport, impl std::fmt::Display>,
        now: Instant,
    ) -> bool {
        let report = match answer {
            Ok(report) => report,
            Err(error) => {
                self.agent.error = Some(error.to_string());
                return false;
            }
        };
        let before = (self.admin_state(), self.agent.clone());
        let mut agent = AgentState {
            error: None,
            ..self.agent.clone()
        };
        if let Some(admin) = report.admin {
            agent.admin = Some(admin);
        }
        if let Some(health) = report.health {
            agent.down = health == weights::AgentHealth::Down;
        }
        if let Some(percent) = report.weight_percent {
            agent.percent = Some(percent);
        }
        self.agent = agent;
        self.admin_changed(before.0, now);
        before.1.admin != self.agent.admin
            || before.1.down != self.agent.down
            || before.1.percent != self.agent.percent
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct VipState {
    pub id: u32,
    pub config: VipConfig,
    pub backends: Vec<BackendState>,
}

impl VipState {
    /// The VIP's `VIP_F_*` bits: how the program hashes its new flows, routes QUIC,
    /// whether it tells a retransmitted SYN from a first one (`[vip.outlier]`), and
    /// whether its slots carry slot words (`stable_slots`).
    pub fn flags(&self) -> u32 {
        let quic = if self.config.quic {
            lb_common::quic::vip_flags(self.config.quic_server_id_len())
        } else {
            0
        };
        let outlier = if self.config.outlier.is_some() {
            VIP_F_OUTLIER
        } else {
            0
        };
        let stable = if self.config.stable_slots {
            VIP_F_STABLE
        } else {
            0
        };
        quic | outlier
            | stable
            | match self.config.hash {
                HashMode::FiveTuple => 0,
                HashMode::SrcIp if self.config.hot_source_share.is_some() => {
                    VIP_F_HASH_SRC_IP | VIP_F_HOT_SOURCES
                }
                HashMode::SrcIp => VIP_F_HASH_SRC_IP,
            }
    }

    pub fn key(&self) -> VipKey {
        vip_key(
            self.config.address,
            self.config.port,
            self.config.protocol.number(),
        )
    }
}

/// The data-path key of a VIP.
pub fn vip_key(address: IpAddr, port: u16, proto: u8) -> VipKey {
    let (addr, family) = lb_common::addr::to_map(address);
    VipKey {
        addr,
        port: port.to_be(),
        proto,
        family,
    }
}

/// Hands out small integer ids, reusing freed ones oldest-first, and only after they
/// have been free for `quarantine`: a connection-table entry that still names an old
/// backend id must not land on a new backend while its flow could still be alive.
#[derive(Clone, Debug)]
pub struct IdPool {
    /// Never-used ids (no time) first, then freed ones in the order they were freed.
    free: VecDeque<(u32, Option<Instant>)>,
    quarantine: Duration,
    capacity: u32,
    /// The configuration key that sets `capacity`, named in refusals (None: fixed).
    raised_by: Option<&'static str>,
}

/// How a pool's ids are used at one instant (status `dataplane.backend_ids_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IdUsage {
    pub capacity: u32,
    pub in_use: u32,
    /// Free, but freed within the quarantine: not handed out yet.
    pub held: u32,
}

impl IdPool {
    pub fn new(capacity: u32, quarantine: Duration) -> Self {
        Self {
            free: (0..capacity).map(|id| (id, None)).collect(),
            quarantine,
            capacity,
            raised_by: None,
        }
    }

    /// The pool, with refusals naming `key` as the way to more ids.
    pub fn raised_by(self, key: &'static str) -> Self {
        Self {
            raised_by: Some(key),
            ..self
        }
    }

    /// The ids in use and held at `now`, of the capacity.
    pub fn usage(&self, now: Instant) -> IdUsage {
        let held = self
            .free
            .iter()
            .filter(|(_, freed)| freed.is_some_and(|at| now.duration_since(at) < self.quarantine))
            .count() as u32;
        IdUsage {
            capacity: self.capacity,
            in_use: self.capacity - self.free.len() as u32,
            held,
        }
    }

    pub fn take(&mut self, now: Instant) -> Option<u32> {
        match self.free.front() {
            Some((_, Some(freed))) if now.duration_since(*freed) < self.quarantine => None,
            Some(_) => self.free.pop_front().map(|(id, _)| id),
            None => None,
        }
    }

    /// Takes `id` out of the free list; false when it is not free.
    pub fn take_specific(&mut self, id: u32) -> bool {
        match self.free.iter().position(|(free, _)| *free == id) {
            Some(i) => self.free.remove(i).is_some(),
            None => false,
        }
    }

    pub fn give_back(&mut self, id: u32, now: Instant) {
        self.free.push_back((id, Some(now)));
    }

    /// Why `take` found no id at `now`: every id in use, or ids free but held in
    /// quarantine (how many, and how long until the first is free).
    pub fn refusal(&self, what: &'static str, now: Instant) -> ModelError {
        let held: Vec<Duration> = self
            .free
            .iter()
            .filter_map(|(_, freed)| *freed)
            .map(|freed| self.quarantine.saturating_sub(now.duration_since(freed)))
            .filter(|left| !left.is_zero())
            .collect();
        match held.first() {
            Some(first) => ModelError::Held {
                what,
                held: held.len(),
                free_in: first.as_secs().max(1),
                quarantine: self.quarantine.as_secs(),
                raise: Raise(self.raised_by, self.capacity),
            },
            None => ModelError::Exhausted {
                what,
                capacity: self.capacity,
                raise: Raise(self.raised_by, self.capacity),
            },
        }
    }
}

/// How a refused pool gets more ids: the key that sizes it (and its value), if any.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Raise(Option<&'static str>, u32);

impl std::fmt::Display for Raise {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(key) => write!(
                f,
                "raise {key} (now {}; the data path is sized at start, so a restart)",
                self.1
            ),
            None => f.write_str("the data path was sized for this many when it was built"),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(
        "more {what}s than the data path holds: every {what} id is in use ({capacity}); \
         {raise}"
    )]
    Exhausted {
        what: &'static str,
        capacity: u32,
        raise: Raise,
    },
    /// Ids of removed backends wait out the flow idle time before reuse, so that an old
    /// flow's entry cannot reach a new backend; a restart keeps them held (the pinned
    /// connection table still names them).
    #[error(
        "no free {what} id now: {held} ids of {what}s removed within the flow idle time \
         ({quarantine}s) are held, so that their flows' entries cannot reach a new {what}; \
         the first is free in {free_in}s: retry then (a restart does not free them), or \
         {raise}"
    )]
    Held {
        what: &'static str,
        held: usize,
        free_in: u64,
        quarantine: u64,
        raise: Raise,
    },
}

/// The configuration key that sizes the backend ids.
const BACKENDS_KEY: &str = "dataplane.max_backends";

/// Every VIP and backend the agent serves, with ids stable across updates.
#[derive(Clone, Debug)]
pub struct Model {
    pub table_size: u32,
    pub vips: Vec<VipState>,
    vip_ids: IdPool,
    backend_ids: IdPool,
    /// Ids a previous agent gave (adopted pinned maps): VIPs by key, backends by VIP id
    /// and address. Used by the next `update`, then released.
    reserved_vips: HashMap<VipKey, u32>,
    reserved_backends: HashMap<(u32, [u8; 16]), (u32, BackendInfo)>,
}

impl Model {
    /// `vip_capacity`: how many VIPs the data path's table map has room for.
    /// `flow_idle`: how long a freed backend id waits before it is reused.
    pub fn new(table_size: u32, vip_capacity: u32, flow_idle: Duration) -> Self {
        Self {
            table_size,
            vips: Vec::new(),
            vip_ids: IdPool::new(vip_capacity.min(MAX_VIPS), Duration::ZERO),
            backend_ids: IdPool::new(MAX_BACKENDS, flow_idle).raised_by(BACKENDS_KEY),
            reserved_vips: HashMap::new(),
            reserved_backends: HashMap::new(),
        }
    }

    /// The model with room for `capacity` backend ids (`dataplane.max_backends`, the size
    /// the data path's backend maps were loaded with) instead of the default. Before
    /// `adopt` and `update`: the ids handed out so far are forgotten.
    pub fn with_backend_capacity(self, capacity: u32) -> Self {
        let quarantine = self.backend_ids.quarantine;
        Self {
            backend_ids: IdPool::new(capacity, quarantine).raised_by(BACKENDS_KEY),
            ..self
        }
    }

    /// Backend ids in use and held at `now` (removed backends' ids wait out the flow idle
    /// time), of the data path's capacity.
    pub fn backend_id_usage(&self, now: Instant) -> IdUsage {
        self.backend_ids.usage(now)
    }

    /// Takes over the ids, MACs and serving state a previous agent left in adopted maps,
    /// so connection-table entries keep naming the same backends and the tables do not
    /// empty while health checks start again: a backend that was serving starts up.
    pub fn adopt(&mut self, adopted: &Adopted) {
        for (key, info) in &adopted.vips {
            if self.vip_ids.take_specific(info.vip_id) {
                self.reserved_vips.insert(*key, info.vip_id);
            }
        }
        for (id, info, identity) in &adopted.backends {
            if self.backend_ids.take_specific(*id) {
                self.reserved_backends
                    .insert((identity.vip_id, identity.addr), (*id, *info));
            }
        }
        let now = Instant::now();
        for id in &adopted.freed {
            if self.backend_ids.take_specific(*id) {
                self.backend_ids.give_back(*id, now);
            }
        }
    }

    /// Makes the model follow `config`'s VIPs and backends. VIPs (by name) and backends
    /// (by VIP and address) that stay keep their ids, MACs and health; new ones start
    /// down until checked (or unknown when unchecked); gone ones free their ids.
    pub fn update(&mut self, config: &Config) -> Result<(), ModelError> {
        let now = Instant::now();
        let mut old: Vec<VipState> = std::mem::take(&mut self.vips);
        for vip_config in &config.vips {
            let previous = old
                .iter()
                .position(|v| v.config.name == vip_config.name)
                .map(|i| old.swap_remove(i));
            let (id, mut old_backends) = match previous {
                Some(v) => (v.id, v.backends),
                None => {
                    let key = vip_key(
                        vip_config.address,
                        vip_config.port,
                        vip_config.protocol.number(),
                    );
                    let id = match self.reserved_vips.remove(&key) {
                        Some(id) => id,
                        None => self
                            .vip_ids
                            .take(now)
                            .ok_or_else(|| self.vip_ids.refusal("VIP", now))?,
                    };
                    (id, Vec::new())
                }
            };
            let mut backends = Vec::with_capacity(vip_config.backends.len());
            for backend_config in &vip_config.backends {
                let kept = old_backends
                    .iter()
                    .position(|b| b.config.address == backend_config.address)
                    .map(|i| old_backends.swap_remove(i));
                let state = match kept {
                    Some(b) => Self::keep_backend(b, vip_config, backend_config, now),
                    None => self.new_backend(id, vip_config, backend_config, now)?,
                };
                backends.push(state);
            }
            for gone in old_backends {
                self.backend_ids.give_back(gone.id, now);
            }
            self.vips.push(VipState {
                id,
                config: vip_config.clone(),
                backends,
            });
        }
        for gone in old {
            self.vip_ids.give_back(gone.id, now);
            for b in gone.backends {
                self.backend_ids.give_back(b.id, now);
            }
        }
        // Adopted ids the configuration no longer names: free, after the quarantine.
        for (_, id) in self.reserved_vips.drain() {
            self.vip_ids.give_back(id, now);
        }
        for (_, (id, _)) in self.reserved_backends.drain() {
            self.backend_ids.give_back(id, now);
        }
        Ok(())
    }

    /// A backend the configuration still names, updated to `backend_config`: keeps its
    /// id, MAC and health, except where the change says otherwise.
    fn keep_backend(
        mut b: BackendState,
        vip_config: &VipConfig,
        backend_config: &BackendConfig,
        now: Instant,
    ) -> BackendState {
        if let Some(mac) = backend_config.mac {
            b.mac = Some(mac);
        }
        let leaves_maint =
            b.config.state == AdminState::Maint && backend_config.state != AdminState::Maint;
        if vip_config.health_of(backend_config).kind == HealthKind::None {
            b.health = Health::Unknown;
        } else if b.health == Health::Unknown || leaves_maint {
            // Not checked in maintenance: its health from before may be stale, so it
            // returns only after `rise` passing checks.
            if leaves_maint {
                tracing::info!(
                    "backend {} of vip {} is back from maintenance: out of the table until \
                     its checks pass",
                    backend_config.address,
                    vip_config.name
                );
            }
            b.health = Health::Down;
            b.streak = 0;
            b.last_check = None;
        }
        // A VIP that now forwards by l2 reaches the backend itself; a tunnel's next hop
        // is the route's (`state::follow_routes` looks it up).
        if !vip_config.forward.is_tunnel() {
            b.next_hop = Some(backend_config.address);
        }
        let before = b.admin_state();
        b.config = backend_config.clone();
        b.admin_changed(before, now);
        b
    }

    /// A backend new to VIP `vip_id`: on the id an adopted data path had for it (with
    /// its MAC, and up when it served flows there), else on a fresh id.
    fn new_backend(
        &mut self,
        vip_id: u32,
        vip_config: &VipConfig,
        backend_config: &BackendConfig,
        now: Instant,
    ) -> Result<BackendState, ModelError> {
        let reserved = self
            .reserved_backends
            .remove(&(vip_id, identity(backend_config.address, vip_id).addr));
        let (backend_id, mac, health) = match reserved {
            Some((backend_id, info)) => {
                let serving = info.flags & BACKEND_F_SERVES_FLOWS != 0;
                let health = match initial_health(vip_config, backend_config) {
                    Health::Down if serving => Health::Up,
                    other => other,
                };
                (
                    backend_id,
                    Some(backend_config.mac.unwrap_or(MacAddr(info.mac))),
                    health,
                )
            }
            None => (
                self.backend_ids
                    .take(now)
                    .ok_or_else(|| self.backend_ids.refusal("backend", now))?,
                backend_config.mac,
                initial_health(vip_config, backend_config),
            ),
        };
        // Tunnelled: the next hop is not known before its route is looked up.
        let next_hop = (!vip_config.forward.is_tunnel()).then_some(backend_config.address);
        Ok(BackendState {
            id: backend_id,
            config: backend_config.clone(),
            mac,
            next_hop,
            egress: 0,
            health,
            streak: 0,
            last_check: None,
            local_check_errors: 0,
            local_errors_in_a_row: 0,
            last_local_error: None,
            drain_started: (backend_config.state == AdminState::Drain).then_some(now),
            drained: false,
            agent: AgentState::default(),
            load: LoadState::default(),
            outlier: Default::default(),
        })
    }

    /// The tables the data path should hold now.
    pub fn desired(&self) -> Desired {
        self.table_inputs().build()
    }

    /// What the tables are built from now: each VIP's members at their effective
    /// weights, and every backend with a MAC.
    pub fn table_inputs(&self) -> TableInputs {
        self.table_inputs_at(Instant::now())
    }

    /// Notes which backends take new flows, starting a slow-start ramp for each that just
    /// began to (and ending those that stopped or are done). Call before taking inputs.
    pub fn note_usable(&mut self, now: Instant) {
        for vip in &mut self.vips {
            for b in &mut vip.backends {
                let in_table = b.in_table();
                if !in_table {
                    b.load.ramp_started = None;
                    // Its next entry is a return: that ramps.
                    if b.load.was_in_table || b.seen_failing() {
                        b.load.ramps_on_entry = true;
                    }
                } else if !b.load.was_in_table
                    && b.load.ramps_on_entry
                    && vip.config.slow_start.is_some()
                {
                    b.load.ramp_started = Some(now);
                } else if let (Some(started), Some(ramp)) =
                    (b.load.ramp_started, vip.config.slow_start)
                    && weights::slow_start_factor(now.saturating_duration_since(started), ramp)
                        .is_none()
                {
                    b.load.ramp_started = None;
                }
                b.load.was_in_table = in_table;
            }
        }
    }

    /// Marks the backends that take new flows now as having always done so, and the
    /// others as starting with them: no ramp for what already served when the agent
    /// started, nor for a backend of the starting configuration entering the table on its
    /// first passing checks (`LoadState::ramps_on_entry`).
    pub fn settle_usable(&mut self) {
        for b in self.backends_mut() {
            b.load.was_in_table = b.in_table();
            b.load.ramps_on_entry = false;
        }
    }

    /// Least-flows: re-weights every backend of a `balance = "least-flows"` VIP from the
    /// live flows per backend (`flows_of`). Returns whether any weight changed.
    pub fn reweigh_least_flows(&mut self, flows_of: impl Fn(u32) -> u64) -> bool {
        let mut changed = false;
        for vip in &mut self.vips {
            if vip.config.balance != Balance::LeastFlows {
                continue;
            }
            let live: Vec<u64> = vip
                .backends
                .iter()
                .filter(|b| b.in_table())
                .map(|b| flows_of(b.id))
                .collect();
            if live.is_empty() {
                continue;
            }
            let mean = live.iter().sum::<u64>() as f64 / live.len() as f64;
            for b in vip.backends.iter_mut().filter(|b| b.in_table()) {
                let level =
                    weights::least_flows_level(b.load.least_flows_level, flows_of(b.id), mean);
                if level != b.load.least_flows_level {
                    b.load.least_flows_level = level;
                    changed = true;
                }
            }
        }
        changed
    }

    /// `table_inputs` at `now` (slow-start ramps depend on the time).
    pub fn table_inputs_at(&self, now: Instant) -> TableInputs {
        let mut inputs = TableInputs {
            table_size: self.table_size,
            ..TableInputs::default()
        };
        for vip in &self.vips {
            let members: Vec<MaglevBackend> = vip
                .backends
                .iter()
                .filter(|b| b.in_table())
                .map(|b| MaglevBackend {
                    id: b.id,
                    address: b.config.address,
                    weight: b.effective_weight(&vip.config, now).weight,
                })
                .collect();
            for b in &vip.backends {
                if let Some(mac) = b.mac {
                    let flags = if b.serves_flows() {
                        BACKEND_F_SERVES_FLOWS
                    } else {
                        0
                    };
                    let info = backend_info(&vip.config, b.config.address, mac, flags, vip.id);
                    let identity = identity(b.config.address, vip.id);
                    inputs.backends.insert(
                        b.id,
                        DesiredBackend {
                            info,
                            identity,
                            egress: b.egress,
                        },
                    );
                }
            }
            if vip.config.quic {
                let len = vip.config.quic_server_id_len();
                // Only backends the data path has (with a MAC): an ID must name one.
                let named = vip.backends.iter().filter(|b| b.mac.is_some());
                for b in named {
                    if let Some(id) = b.config.server_id {
                        let key = ServerKey::of_config(vip.id, id as u128, len);
                        inputs.quic_ids.insert(key, b.id);
                    }
                }
            }
            inputs.vips.push(VipInputs {
                key: vip.key(),
                vip_id: vip.id,
                flags: vip.flags(),
                members,
            });
        }
        inputs
    }

    /// Every backend, VIP after VIP.
    pub fn backends(&self) -> impl Iterator<Item = &BackendState> {
        self.vips.iter().flat_map(|v| v.backends.iter())
    }

    /// Every backend, for iteration with its VIP.
    pub fn backends_mut(&mut self) -> impl Iterator<Item = &mut BackendState> {
        self.vips.iter_mut().flat_map(|v| v.backends.iter_mut())
    }

    /// Slots each backend holds in its VIP's current desired table.
    pub fn slot_counts(desired: &Desired) -> BTreeMap<u32, usize> {
        let mut counts = BTreeMap::new();
        for vip in &desired.vips {
            for &id in &vip.table {
                *counts.entry(id).or_default() += 1;
            }
        }
        counts
    }
}

/// What `LB_BACKENDS` holds for a backend at `address` of VIP `vip` (id `vip_id`),
/// reached through `mac` (its own, or its next hop's when tunnelled).
pub fn backend_info(
    vip: &VipConfig,
    address: IpAddr,
    mac: MacAddr,
    flags: u16,
    vip_id: u32,
) -> BackendInfo {
    let forward = match vip.forward {
        Forward::L2 => return BackendInfo::l2(mac.0, flags, vip_id),
        Forward::Ipip => FORWARD_IPIP,
        Forward::Gue => FORWARD_GUE,
    };
    let (addr, family) = lb_common::addr::to_map(address);
    BackendInfo {
        mac: mac.0,
        flags,
        vip_id,
        forward,
        family,
        gue_port_be: if vip.forward == Forward::Gue {
            vip.gue_port().to_be()
        } else {
            0
        },
        addr,
    }
}

/// What `LB_BACKEND_IDS` records for a backend id.
pub fn identity(address: IpAddr, vip_id: u32) -> BackendIdentity {
    let (addr, family) = lb_common::addr::to_map(address);
    BackendIdentity {
        addr,
        vip_id,
        family,
        in_use: 1,
        _pad: [0; 2],
    }
}

fn initial_health(vip: &VipConfig, backend: &BackendConfig) -> Health {
    match vip.health_of(backend).kind {
        HealthKind::None => Health::Unknown,
        // Down until the first checks pass: a backend that never started gets no traffic.
        HealthKind::Tcp
        | HealthKind::Http
        | HealthKind::Https
        | HealthKind::Udp
        | HealthKind::Dns => Health::Down,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lb_common::BACKEND_NONE;

    fn config(backends: &[(&str, &str)], kind: &str) -> Config {
        let mut text = format!(
            "[dataplane]\ninterface = \"eth0\"\nmaglev_table_size = 7\n\
             [[vip]]\nname = \"web\"\naddress = \"10.0.0.100\"\nport = 80\nprotocol = \"tcp\"\n\
             [vip.health]\nkind = \"{kind}\"\n"
        );
        for (address, extra) in backends {
            text += &format!("[[vip.backend]]\naddress = \"{address}\"\n{extra}\n");
        }
        Config::from_toml(&text).unwrap()
    }

    fn resolve_all(model: &mut Model) {
        for b in model.backends_mut() {
            b.mac = Some(MacAddr([2, 0, 0, 0, 0, b.id as u8]));
        }
    }

    #[test]
    fn only_a_vip_with_stable_slots_asks_the_program_for_slot_words() {
        let mut model = Model::new(7, 16, Duration::ZERO);
        model.update(&config(&[("10.0.0.11", "")], "none")).unwrap();
        assert_eq!(model.vips[0].flags() & VIP_F_STABLE, 0);
        let mut stable = config(&[("10.0.0.11", "")], "none");
        stable.vips[0].stable_slots = true;
        model.update(&stable).unwrap();
        assert_ne!(model.vips[0].flags() & VIP_F_STABLE, 0);
        assert_ne!(
            model.desired().vips[0].flags & VIP_F_STABLE,
            0,
            "the table writer is told"
        );
    }

    #[test]
    fn unchecked_backends_with_a_mac_are_in_the_table() {
        let mut model = Model::new(7, 16, Duration::ZERO);
        model
            .update(&config(&[("10.0.0.11", ""), ("10.0.0.12", "")], "none"))
            .unwrap();
        assert!(
            model.desired().vips[0]
                .table
                .iter()
                .all(|&id| id == BACKEND_NONE),
            "no MAC yet"
        );
        resolve_all(&mut model);
        let desired = model.desired();
        let counts = Model::slot_counts(&desired);
        assert_eq!(counts.len(), 2, "{counts:?}");
        assert_eq!(desired.backends.len(), 2);
    }

    #[test]
    fn checked_backends_start_down_and_drained_ones_stay_out() {
        let mut model = Model::new(7, 16, Duration::ZERO);
        model
            .update(&config(
                &[("10.0.0.11", ""), ("10.0.0.12", "state = \"drain\"")],
                "tcp",
            ))
            .unwrap();
        resolve_all(&mut model);
        assert!(
            model.desired().vips[0]
                .table
                .iter()
                .all(|&id| id == BACKEND_NONE)
        );
        for b in model.backends_mut() {
            b.health = Health::Up;
        }
        let table = &model.desired().vips[0].table;
        let first = model.vips[0].backends[0].id;
        assert!(
            table.iter().all(|&id| id == first),
            "drained backend took slots: {table:?}"
        );
    }

    #[test]
    fn ids_a_previous_agent_freed_are_reused_last() {
        let mut model = Model::new(7, 16, Duration::from_secs(30));
        let adopted = crate::dataplane::Adopted {
            freed: vec![0, 1],
            ..Default::default()
        };
        model.adopt(&adopted);
        model.update(&config(&[("10.0.0.11", "")], "none")).unwrap();
        assert_eq!(
            model.vips[0].backends[0].id, 2,
            "ids 0 and 1 wait out their quarantine"
        );
    }

    #[test]
    fn a_backends_own_checks_decide_its_initial_health() {
        let mut model = Model::new(7, 16, Duration::ZERO);
        let unchecked = "[vip.backend.health]\nkind = \"none\"";
        model
            .update(&config(
                &[("10.0.0.11", ""), ("10.0.0.12", unchecked)],
                "tcp",
            ))
            .unwrap();
        let health: Vec<Health> = model.vips[0].backends.iter().map(|b| b.health).collect();
        assert_eq!(health, [Health::Down, Health::Unknown]);
    }

    #[test]
    fn update_keeps_ids_macs_and_health_of_unchanged_backends() {
        let mut model = Model::new(7, 16, Duration::ZERO);
        model
            .update(&config(&[("10.0.0.11", ""), ("10.0.0.12", "")], "tcp"))
            .unwrap();
        resolve_all(&mut model);
        model.vips[0].backends[0].health = Health::Up;
        let before = model.vips[0].backends[0].clone();
        model
            .update(&config(
                &[("10.0.0.13", ""), ("10.0.0.11", "weight = 3")],
                "tcp",
            ))
            .unwrap();
        let kept = model.vips[0]
            .backends
            .iter()
            .find(|b| b.config.address == before.config.address)
            .unwrap();
        assert_eq!(
            (kept.id, kept.mac, kept.health),
            (before.id, before.mac, before.health)
        );
        assert_eq!(kept.config.weight, 3);
        let new = model.vips[0]
            .backends
            .iter()
            .find(|b| b.config.address.to_string() == "10.0.0.13")
            .unwrap();
        assert_eq!(new.health, Health::Down);
        assert_ne!(new.id, before.id);
    }

    #[test]
    fn a_checked_backend_leaving_maintenance_waits_for_its_checks() {
        let mut model = Model::new(7, 16, Duration::ZERO);
        model.update(&config(&[("10.0.0.11", "")], "tcp")).unwrap();
        resolve_all(&mut model);
        let backend = model.backends_mut().next().unwrap();
        backend.health = Health::Up;
        backend.streak = 5;
        assert!(model.vips[0].backends[0].in_table());

        let maint = config(&[("10.0.0.11", "state = \"maint\"")], "tcp");
        model.update(&maint).unwrap();
        assert!(!model.vips[0].backends[0].in_table());
        // Still in maintenance after a reload: nothing changes.
        model.update(&maint).unwrap();
        assert_eq!(model.vips[0].backends[0].health, Health::Up);

        model.update(&config(&[("10.0.0.11", "")], "tcp")).unwrap();
        let backend = &model.vips[0].backends[0];
        assert_eq!(backend.health, Health::Down, "{backend:?}");
        assert_eq!(backend.streak, 0);
        assert!(!backend.in_table(), "back in the table before any check");

        // Unchecked backends have nothing to wait for.
        model
            .update(&config(&[("10.0.0.11", "state = \"maint\"")], "none"))
            .unwrap();
        model.update(&config(&[("10.0.0.11", "")], "none")).unwrap();
        assert!(model.vips[0].backends[0].in_table());
    }

    #[test]
    fn freed_ids_are_reused_last_and_only_after_the_quarantine() {
        let start = Instant::now();
        let later = |s| start + Duration::from_secs(s);
        let mut pool = IdPool::new(2, Duration::from_secs(30));
        let a = pool.take(start).unwrap();
        pool.give_back(a, start);
        assert_eq!(
            pool.take(start),
            Some(1),
            "a freed id waits behind never-used ones"
        );
        assert_eq!(pool.take(later(29)), None, "id {a} is still in quarantine");
        assert_eq!(pool.take(later(30)), Some(a));
    }

    #[test]
    fn a_refusal_says_whether_ids_are_held_or_all_in_use() {
        let start = Instant::now();
        let mut pool = IdPool::new(2, Duration::from_secs(30)).raised_by("dataplane.max_backends");
        let a = pool.take(start).unwrap();
        let b = pool.take(start).unwrap();
        let all_in_use = pool.refusal("backend", start).to_string();
        assert!(
            all_in_use.contains(
                "every backend id is in use (2); raise dataplane.max_backends (now 2; the data \
                 path is sized at start, so a restart)"
            ),
            "{all_in_use}"
        );
        let fixed = IdPool::new(0, Duration::ZERO)
            .refusal("VIP", start)
            .to_string();
        assert!(
            fixed.contains("every VIP id is in use (0); the data path was sized"),
            "{fixed}"
        );
        let at = |seconds| start + Duration::from_secs(seconds);
        assert_eq!(
            pool.usage(at(0)),
            IdUsage {
                capacity: 2,
                in_use: 2,
                held: 0
            }
        );
        pool.give_back(a, start);
        pool.give_back(b, start + Duration::from_secs(5));
        let usage = |pool: &IdPool, seconds| {
            let usage = pool.usage(at(seconds));
            (usage.in_use, usage.held)
        };
        assert_eq!(usage(&pool, 10), (0, 2));
        assert_eq!(usage(&pool, 32), (0, 1), "a is free again");
        assert_eq!(usage(&pool, 40), (0, 0));
        let held = pool.refusal("backend", start + Duration::from_secs(10));
        let text = held.to_string();
        assert!(
            matches!(
                held,
                ModelError::Held {
                    held: 2,
                    free_in: 20,
                    ..
                }
            ),
            "{held:?}"
        );
        assert!(
            text.contains("2 ids of backends removed within the flow idle time (30s) are held")
                && text.contains("free in 20s")
                && text.contains("or raise dataplane.max_backends (now 2;")
                && !text.contains("restart the agent"),
            "{text}"
        );
    }

    #[test]
    fn the_backend_capacity_is_the_configured_one_and_held_ids_count_against_it() {
        let first = [
            ("10.0.0.11", ""),
            ("10.0.0.12", ""),
            ("10.0.0.13", ""),
            ("10.0.0.14", ""),
        ];
        let second = [
            ("10.0.1.11", ""),
            ("10.0.1.12", ""),
            ("10.0.1.13", ""),
            ("10.0.1.14", ""),
        ];
        // The first pool, then all but one of it removed, then the second pool added.
        let swap = |capacity| {
            let mut model =
                Model::new(7, 16, Duration::from_secs(30)).with_backend_capacity(capacity);
            model.update(&config(&first, "none")).unwrap();
            let usage = model.backend_id_usage(Instant::now());
            assert_eq!((usage.capacity, usage.in_use), (capacity, 4));
            model.update(&config(&first[..1], "none")).unwrap();
            let usage = model.backend_id_usage(Instant::now());
            assert_eq!((usage.in_use, usage.held), (1, 3));
            let mut both = first[..1].to_vec();
            both.extend_from_slice(&second);
            model.update(&config(&both, "none"))
        };
        // 3 ids are held for the idle time: the 2 free are too few for 4.
        match swap(6) {
            Err(error @ ModelError::Held { held: 3, .. }) => assert!(
                error
                    .to_string()
                    .contains("raise dataplane.max_backends (now 6;"),
                "{error}"
            ),
            other => panic!("{other:?}"),
        }
        swap(8).expect("room for both pools");
    }

    #[test]
    fn drained_backends_keep_their_flows_but_maint_and_failed_ones_do_not() {
        let mut model = Model::new(7, 16, Duration::ZERO);
        let backends = [
            ("10.0.0.11", "state = \"drain\""),
            ("10.0.0.12", "state = \"maint\""),
            ("10.0.0.13", ""),
        ];
        model.update(&config(&backends, "tcp")).unwrap();
        resolve_all(&mut model);
        for b in model.backends_mut() {
            b.health = Health::Up;
        }
        model.vips[0].backends[2].health = Health::Down;
        let desired = model.desired();
        let flags: Vec<u16> = model.vips[0]
            .backends
            .iter()
            .map(|b| desired.backends[&b.id].info.flags)
            .collect();
        assert_eq!(flags, [BACKEND_F_SERVES_FLOWS, 0, 0]);
    }

    /// Four backends of weight 1, tcp checks, `slow_start = "30s"`, a real-sized table.
    fn ramping_model() -> Model {
        let mut text = "[dataplane]\ninterface = \"eth0\"\nmaglev_table_size = 65537\n\
             [[vip]]\nname = \"web\"\naddress = \"10.0.0.100\"\nport = 80\n\
             protocol = \"tcp\"\nslow_start = \"30s\"\n[vip.health]\nkind = \"tcp\"\n"
            .to_string();
        for last in 11..=14 {
            text += &format!(
                "[[vip.backend]]\naddress = \"10.0.0.{last}\"\nmac = \"02:00:00:00:00:{last}\"\n"
            );
        }
        let mut model = Model::new(65537, 16, Duration::ZERO);
        model.update(&Config::from_toml(&text).unwrap()).unwrap();
        model
    }

    fn pass_checks(b: &mut BackendState) {
        b.health = Health::Up;
        b.last_check = Some(CheckRecord {
            ok: true,
            latency_ms: 1.0,
            error: None,
            local: false,
        });
    }

    fn set_state(model: &mut Model, backend: usize, state: AdminState) {
        let mut config = Config::from_toml(
            "[dataplane]\ninterface = \"eth0\"\n[[vip]]\nname = \"x\"\n\
             address = \"10.0.0.1\"\nport = 1\nprotocol = \"tcp\"\n",
        )
        .unwrap();
        config.vips = vec![model.vips[0].config.clone()];
        config.vips[0].backends[backend].state = state;
        model.update(&config).unwrap();
    }

    /// Issue 34: after `lb maint` then `lb ready`, the returning backend's share of the
    /// table is the share its effective weight gives beside the others'. Before the fix
    /// the starting backends ramped from their first passing checks, so the returning one
    /// (at 10%) ramped against others at 20%: 9,362 slots (1/7), not ~2,114 (10/310).
    #[test]
    fn a_backend_returning_from_maintenance_ramps_against_full_weights() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut model = ramping_model();
        // The agent starts: every backend down until checked.
        model.settle_usable();
        for b in model.backends_mut() {
            pass_checks(b);
        }
        model.note_usable(at(1));
        set_state(&mut model, 0, AdminState::Maint);
        model.note_usable(at(3));
        set_state(&mut model, 0, AdminState::Ready);
        model.note_usable(at(4));
        pass_checks(&mut model.vips[0].backends[0]);
        model.note_usable(at(5));

        let vip = &model.vips[0];
        let effective: Vec<(u32, String)> = vip
            .backends
            .iter()
            .map(|b| {
                let e = b.effective_weight(&vip.config, at(5));
                (e.weight, e.reason.to_string())
            })
            .collect();
        assert_eq!(effective[0], (10, "slow start 10%".to_string()));
        for other in &effective[1..] {
            assert_eq!(other, &(100, "configured".to_string()), "{effective:?}");
        }
        // The table built from the model's inputs gives each backend the share of slots
        // its effective weight says.
        let desired = model.table_inputs_at(at(5)).build();
        let slots = Model::slot_counts(&desired);
        let total: u32 = effective.iter().map(|(w, _)| w).sum();
        for (b, (weight, _)) in vip.backends.iter().zip(&effective) {
            let expected = 65537.0 * *weight as f64 / total as f64;
            let held = slots.get(&b.id).copied().unwrap_or(0) as f64;
            assert!(
                (held - expected).abs() <= expected / 100.0 + 1.0,
                "backend {}: {held} slots, its effective weight gives {expected:.0}",
                b.config.address
            );
        }
    }

    /// What ramps: a backend that left the table, one whose checks failed before it
    /// first passed, and one added after the start; not one of the starting backends on
    /// its first passing checks.
    #[test]
    fn ramps_are_for_returning_and_new_backends() {
        let t0 = Instant::now();
        let mut model = ramping_model();
        model.settle_usable();
        model.vips[0].backends[1].last_check = Some(CheckRecord {
            ok: false,
            latency_ms: 1.0,
            error: Some("connection refused".into()),
            local: false,
        });
        model.note_usable(t0);
        for b in model.backends_mut() {
            pass_checks(b);
        }
        model.note_usable(t0 + Duration::from_secs(1));
        let ramping: Vec<bool> = model
            .backends()
            .map(|b| b.load.ramp_started.is_some())
            .collect();
        assert_eq!(ramping, [false, true, false, false]);
        let mut config = Config::from_toml(
            "[dataplane]\ninterface = \"eth0\"\n[[vip]]\nname = \"x\"\n\
             address = \"10.0.0.1\"\nport = 1\nprotocol = \"tcp\"\n",
        )
        .unwrap();
        config.vips = vec![model.vips[0].config.clone()];
        let mut added = config.vips[0].backends[0].clone();
        added.address = "10.0.0.15".parse().unwrap();
        config.vips[0].backends.push(added);
        model.update(&config).unwrap();
        pass_checks(&mut model.vips[0].backends[4]);
        model.note_usable(t0 + Duration::from_secs(2));
        assert!(model.vips[0].backends[4].load.ramp_started.is_some());
    }
}
