//! `lb run`: start (load and attach the data path, write its tables), serve (the control
//! socket, metrics, health checks, announcements, and the loop that scans flows and
//! follows neighbours), and stop cleanly on SIGINT/SIGTERM. The state and what changes
//! it are in `state`; this module only starts, loops and stops.

use std::{
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::Context;
use futures::StreamExt;
use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;

use crate::{
    EBPF_OBJECT,
    announce::{self, Announcer},
    cluster,
    config::Config,
    control,
    dataplane::{
        AttachHints, AttachTarget, AttachedMode, AyaDataplane, CounterReader, Dataplane,
        EgressPort, FlowReader, Found, LoadOptions, next::NextProgram, remove_pins,
    },
    doctor::{self, Level},
    explain::monotonic_ns,
    health::HealthTasks,
    lock, metrics,
    model::Model,
    neighbor::{self, Neighbors},
    ports, preflight,
    state::{self, InterfaceChange, State},
    statefile,
    status::Start,
    tables::TableWriter,
    turnover,
    writer::{Stabilizer, StabilizerParts, WriteFailed, Writer},
};

/// How often the neighbour table is re-read for backend MAC changes.
const NEIGHBOR_REFRESH: Duration = Duration::from_secs(1);
/// How often time-driven weights (slow-start steps) are looked at.
const LOAD_REFRESH: Duration = Duration::from_millis(250);
/// How often live flows are counted per backend (status, draining, least-flows).
const FLOW_SCAN: Duration = Duration::from_secs(2);
/// `stable_slots`: the writer is asked whether a changed slot may turn stable every
/// quarter of the bound they wait (a slot waits at most a quarter longer than it must),
/// within these.
const STABILIZE_CHECK: std::ops::RangeInclusive<Duration> =
    Duration::from_millis(250)..=Duration::from_secs(5);
/// How long start-up waits for missing backend MACs before serving without them.
const FIRST_RESOLVE_WAIT: Duration = Duration::from_secs(3);

/// What `lb run` does when it stops.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnExit {
    /// The program stays attached with its last tables (the default): a restarted agent
    /// adopts it without dropping a packet.
    StayAttached,
    /// Remove the pins: the program detaches and its maps are freed.
    Detach,
}

/// Runs the agent until SIGINT or SIGTERM.
pub async fn run(config_path: PathBuf, on_exit: OnExit) -> anyhow::Result<()> {
    let file = Config::load(&config_path)?;
    // The runtime changes of the last run, made again before the first tables.
    let config = with_saved_changes(&file, &config_path);
    // First: without privileges every later step fails, each in its own words.
    require_privileges()?;
    raise_open_file_limit();
    // Held until the agent exits: before anything touches the pins or the interface.
    let mut lock = lock::acquire(&config, &config_path)?;
    let pin_dir = config.dataplane.pin_dir();
    ensure_bpffs(&pin_dir)?;
    let pins_reach = pins_reach(&pin_dir);
    lock.lock_pins(&pin_dir)?;
    // Every listener is bound before the data path is touched: a socket or port in use
    // stops the start with nothing attached (not an attached program without an agent).
    let listeners = Listeners::bind(&config).await?;
    let started = match start(&config).await {
        Ok(started) => started,
        Err(error) => {
            listeners.abandon();
            return Err(error);
        }
    };
    let interface = started.neighbors.interface().clone();
    let mut state = State::new(
        config_path,
        config.clone(),
        started.model,
        started.tables,
        interface.clone(),
        started.mode,
    );
    state.set_file_config(file);
    // Not shared yet: no lock is held while it is written.
    if let Some(save) = state.state_file_write() {
        save.write();
    }
    state.set_ports(started.ports);
    state.set_next_program(started.next_program);
    // A node without a table of its own learns its peers' before it announces.
    let learn = started.cluster.is_some() && !matches!(started.start, Start::Adopted);
    state.record_start(
        started.start,
        started.native_refused,
        started
            .cluster
            .as_ref()
            .map(|(opened, _)| opened.stats.clone()),
        learn,
    );
    let state = Arc::new(Mutex::new(state));
    let services = Services::start(
        &config,
        listeners,
        &state,
        started.capture,
        started.announcer,
        started.cluster.map(|(opened, maps)| (opened, maps, learn)),
    )
    .await?;
    println!(
        "serving {} VIP(s) on {} (xdp mode: {}); control socket {}",
        config.vips.len(),
        interface.name,
        started.mode,
        config.control.socket.display()
    );
    let mut neighbors = started.neighbors;
    serve(
        &state,
        &services.health_tasks,
        &mut neighbors,
        &started.flow_reader,
    )
    .await?;
    services.stop().await;
    match on_exit {
        OnExit::StayAttached if pins_reach == crate::bpffs::Reach::Private => tracing::info!(
            "stopping; the program goes with the agent: its pins in {} lie on a bpf \
             filesystem private to this process's mount namespace, which goes too",
            pin_dir.display()
        ),
        OnExit::StayAttached => tracing::info!(
            "stopping; the program stays attached to {} with its last tables (pins in {}; \
             `lb detach --config FILE` removes it)",
            interface.name,
            pin_dir.display()
        ),
        OnExit::Detach => {
            tracing::info!("stopping: detaching from {}", interface.name);
            // The writer finishes what is pending first: dropping the state joins it.
            drop(state);
            remove_pins(&pin_dir)?;
        }
    }
    Ok(())
}

/// How far the bpffs of `pin_dir` reaches; says so when it is private to this mount
/// namespace, since the program then does not outlive the agent.
fn pins_reach(pin_dir: &Path) -> crate::bpffs::Reach {
    let reach = crate::bpffs::reach(pin_dir);
    if reach == crate::bpffs::Reach::Private {
        tracing::warn!(
            "pins in {} lie on a bpf filesystem only this process's mount namespace sees \
             (`ip netns exec` gives each command a fresh /sys): the program goes when the \
             agent stops; to keep it attached across restarts, {}",
            pin_dir.display(),
            crate::bpffs::PRIVATE_FIX
        );
    }
    reach
}

/// A data path serving its first tables, and what the agent needs to go on from there.
struct Started {
    neighbors: Neighbors,
    /// Several interfaces: each as attached (empty with one).
    ports: Vec<crate::dataplane::EgressPort>,
    model: Model,
    tables: Writer,
    mode: crate::dataplane::AttachedMode,
    /// `xdp_mode = "auto"` attached generic: why native was refused.
    native_refused: Option<String>,
    /// `dataplane.next_program` as chained.
    next_program: Option<crate::status::NextProgramStatus>,
    start: Start,
    flow_reader: Arc<FlowReader>,
    capture: Option<(aya::maps::RingBuf<aya::maps::MapData>, PathBuf)>,
    announcer: Option<Announcer>,
    cluster: Option<(cluster::Opened, cluster::Maps)>,
}

/// What the cluster task reads and writes through: its export ring, the table writer's
/// handle for the peers' entries, the flow reader.
fn cluster_maps(
    export: aya::maps::RingBuf<aya::maps::MapData>,
    tables: &Writer,
    reader: &Arc<FlowReader>,
) -> cluster::Maps {
    cluster::Maps {
        export,
        imports: tables.imports(),
        reader: reader.clone(),
    }
}

/// What the host checks found and opened before anything is loaded.
struct HostReady {
    neighbors: Neighbors,
    interface: crate::neighbor::Interface,
    /// By interface (`dataplane.interfaces`, in order).
    hints: Vec<AttachHints>,
    announcer: Option<Announcer>,
    opened: Option<cluster::Opened>,
}

/// The host's checks (`lb doctor`'s, then `preflight`'s) and what must exist before the
/// program is loaded (the announcer's device, the cluster's key and socket). Anything
/// refused here leaves the host as it was.
async fn check_host(config: &Config) -> anyhow::Result<HostReady> {
    // `lb doctor`'s checks: a failing one refuses the start with its fix.
    let reports = doctor::Report::run_each(config).await;
    let hints = reports.iter().map(attach_hints).collect();
    let report = doctor::Report::merge(reports);
    for warning in report.at(Level::Warn) {
        tracing::warn!("doctor: {warning}");
    }
    anyhow::ensure!(!report.failed(), "{}", report.refusal());
    let neighbors = Neighbors::open(&config.dataplane.interface)
        .await
        .context("reading the data-path interface")?;
    let interface = neighbors.interface().clone();
    // The checks `lb check` makes too (the interface's addresses, routes, the cluster's
    // key): a refusal names the field.
    preflight::run(
        config,
        Some(&interface),
        neighbor::route_to,
        preflight::Mode::Start,
    )?;
    // Before attaching: a device that cannot be made stops the start with nothing changed.
    let announcer = match &config.announce {
        Some(announce) => Some(
            Announcer::open(announce)
                .await
                .context("setting up [announce]")?,
        ),
        None => None,
    };
    // The key and the socket too: a key others may read is refused before anything.
    let opened = match &config.cluster {
        Some(cluster) => Some(cluster::open(
            cluster,
            &interface.name,
            &interface.addresses,
        )?),
        None => None,
    };

    Ok(HostReady {
        neighbors,
        interface,
        hints,
        announcer,
        opened,
    })
}

/// Loads (or adopts) the program, writes the tables the configuration asks for, then
/// attaches: the program never runs on empty maps. Anything refused before the pins are
/// touched leaves the host as it was.
async fn start(config: &Config) -> anyhow::Result<Started> {
    let new_model = |vip_capacity: u32| {
        Model::new(
            config.dataplane.maglev_table_size,
            vip_capacity,
            config.dataplane.flow_idle_timeout,
        )
    };
    let HostReady {
        mut neighbors,
        interface,
        hints,
        announcer,
        opened,
    } = check_host(config).await?;
    let mut ports = ports::look_up(config, &mut neighbors).await?;
    let (options, next) = load_options(config, &interface)?;
    let pin_dir = config.dataplane.pin_dir();
    ensure_bpffs(&pin_dir)?;
    let (mut dataplane, found) = AyaDataplane::load_pinned(EBPF_OBJECT, options, &pin_dir)
        .with_context(|| format!("loading the XDP program (pins in {})", pin_dir.display()))?;
    let flow_reader = Arc::new(dataplane.flow_reader()?);
    let capture = match &config.debug.capture {
        Some(path) => Some((dataplane.take_capture()?, path.clone())),
        None => None,
    };
    // `[cluster]`: the export ring for the cluster task; the connection table's write
    // handle for the table writer, which makes the peers' imports (`cluster_maps`).
    let (cluster, flow_writer) = match opened {
        Some(opened) => {
            let (export, writer) = dataplane.take_export()?;
            (Some((opened, export)), Some(writer))
        }
        None => (None, None),
    };
    let mut writer = TableWriter::new(config.dataplane.maglev_table_size);
    // What the model starts from: the adopted maps' backends and ids, or, after replacing
    // incompatible ones, the backends the old program served (kept while checks start).
    let (start, start_from) = match &found {
        Found::Nothing => (Start::Fresh, None),
        Found::Compatible(_) => {
            let adopted = dataplane.adopted(config.dataplane.maglev_table_size)?;
            tracing::info!(
                "adopting the pinned data path in {}: {} VIP(s), {} backend(s); flows continue",
                pin_dir.display(),
                adopted.vips.len(),
                adopted.backends.len()
            );
            writer.adopt(&adopted);
            (Start::Adopted, Some(adopted))
        }
        Found::Incompatible(why) => {
            tracing::warn!(
                "replacing the pinned data path in {}: {why}; its connection table is lost",
                pin_dir.display()
            );
            let why = why.to_string();
            (Start::Replaced { why }, dataplane.previous().cloned())
        }
    };
    // The pinned maps' VIP capacity, which may exceed what this config needs.
    let mut model = new_model(dataplane.options().vip_capacity)
        .with_backend_capacity(dataplane.options().max_backends);
    if let Some(adopted) = &start_from {
        model.adopt(adopted);
    }
    model.update(config)?;
    ports::prepare(&mut dataplane, &mut model, &ports, &interface)?;
    resolve_first_macs(&neighbors, &mut model).await;
    let mut desired = model.desired();
    desired.tunnel = state::tunnel_config(config, &interface, None);
    let report = writer.apply(&mut dataplane, &desired)?;
    tracing::info!(
        "tables written: {} slots, {} table switches, {} backends",
        report.slots_written,
        report.tables_switched,
        report.backends_written
    );
    let next_program = next.as_ref().map(crate::status::NextProgramStatus::from);
    let attached = attach_chained(&mut dataplane, config, &interface, &hints, &mut ports, next)?;
    desired.tunnel = tunnel_once_attached(&mut dataplane, config, &interface, attached.mode)?;
    let tables = Writer::spawn(Box::new(dataplane), writer, desired, flow_writer)
        .context("starting the table writer")?;
    let cluster =
        cluster.map(|(opened, export)| (opened, cluster_maps(export, &tables, &flow_reader)));
    Ok(Started {
        neighbors,
        ports,
        model,
        tables,
        mode: attached.mode,
        native_refused: attached.native_refused,
        next_program,
        start,
        flow_reader,
        capture,
        announcer,
        cluster,
    })
}

/// `LB_TUNNEL` written again once the program is attached in `mode`: until then frames
/// are taken as possibly in several buffers; where none can be (native mode, an MTU one
/// buffer holds), the program reads a frame's length without a helper call.
fn tunnel_once_attached(
    dataplane: &mut AyaDataplane,
    config: &Config,
    interface: &crate::neighbor::Interface,
    mode: AttachedMode,
) -> anyhow::Result<lb_common::TunnelConfig> {
    let tunnel = state::tunnel_config(config, interface, Some(mode));
    dataplane
        .set_tunnel(&tunnel)
        .context("writing the interface's settings")?;
    Ok(tunnel)
}

/// The load-time options for `interface`, and `dataplane.next_program` opened (checked by
/// `preflight` already; opened again for the program it holds now), whose kind says
/// which build of the program to load.
fn load_options(
    config: &Config,
    interface: &crate::neighbor::Interface,
) -> anyhow::Result<(LoadOptions, Option<NextProgram>)> {
    let mut options = LoadOptions::from_config(config, interface.mac.0);
    options.ifindex = interface.index;
    let next = preflight::next_program(config)?;
    if let Some(next) = &next {
        options.program = next.caller();
    }
    Ok((options, next))
}

/// Attaches to every interface (or takes over from a previous agent's program) with
/// `next` chained before: a frame the program passes goes to the host's program from
/// the first. The slot's map is pinned once attached, so the chain outlives this agent.
fn attach_chained(
    dataplane: &mut AyaDataplane,
    config: &Config,
    interface: &crate::neighbor::Interface,
    hints: &[AttachHints],
    ports: &mut [EgressPort],
    next: Option<NextProgram>,
) -> anyhow::Result<crate::dataplane::Attachment> {
    dataplane.chain(next.as_ref())?;
    if let Some(next) = &next {
        tracing::info!(
            "frames lb passes go on to {} ({}), tail-called by {}",
            next.label(),
            next.path.display(),
            next.caller()
        );
    }
    let attached = ports::attach_all(dataplane, config, interface, hints, ports)?;
    dataplane.pin_next_program_map()?;
    Ok(attached)
}

/// Capability numbers (linux/capability.h).
const CAP_NET_ADMIN: u32 = 12;
const CAP_SYS_ADMIN: u32 = 21;
const CAP_BPF: u32 = 39;

/// Refuses, saying what is needed, unless this process may load and attach XDP programs:
/// checked first, so that a user without privileges hears that rather than whichever
/// step (netlink, bpffs, the pins) fails first.
fn require_privileges() -> anyhow::Result<()> {
    let status =
        std::fs::read_to_string("/proc/self/status").context("reading /proc/self/status")?;
    let effective = status
        .lines()
        .find_map(|line| line.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok());
    match effective.and_then(missing_privileges) {
        Some(why) => anyhow::bail!("{why}"),
        None => Ok(()),
    }
}

/// What `effective` (a capability set) lacks for `lb run`, if anything.
fn missing_privileges(effective: u64) -> Option<String> {
    let has = |cap: u32| effective & (1u64 << cap) != 0;
    let mut missing = Vec::new();
    if !has(CAP_BPF) && !has(CAP_SYS_ADMIN) {
        missing.push("CAP_BPF");
    }
    if !has(CAP_NET_ADMIN) {
        missing.push("CAP_NET_ADMIN");
    }
    (!missing.is_empty()).then(|| {
        format!(
            "lb run needs root, or CAP_BPF and CAP_NET_ADMIN (with write access to the pin \
             directory, and CAP_SYS_ADMIN if no bpffs is mounted): this process lacks {}",
            missing.join(" and ")
        )
    })
}

/// What the doctor found that gives an attach error its meaning here.
fn attach_hints(report: &doctor::Report) -> AttachHints {
    let link = report.facts.link.as_ref();
    AttachHints {
        driver: link.and_then(|l| l.driver.as_ref()).map(|d| d.name.clone()),
        mtu: link.map(|l| l.mtu),
        veth_peer: link
            .and_then(|l| l.peer.as_ref())
            .and_then(|p| p.name.clone()),
        attached: link
            .and_then(|l| l.attached.iter().find(|p| Some(p.id) != l.pinned_program))
            .map(|p| p.to_string()),
        native_refused: report.native_refusal(),
        native_known: doctor::native_known(&report.facts),
    }
}

/// The configuration to start with: the file's, with the runtime changes the state file
/// kept made again (each logged, restored or not).
fn with_saved_changes(file: &Config, config_path: &Path) -> Config {
    let path = file.state_file();
    match statefile::load(&path, config_path) {
        Ok(changes) if changes.is_empty() => file.clone(),
        Ok(changes) => {
            let (config, lines) = statefile::restore(file, &changes);
            for line in lines {
                tracing::info!("{line} (from {})", path.display());
            }
            config
        }
        Err(error) => {
            tracing::warn!("{error}: its runtime changes are not made again");
            file.clone()
        }
    }
}

/// The control socket and the metrics endpoint, bound before the data path is touched.
struct Listeners {
    control: control::ControlSocket,
    metrics: Option<tokio::net::TcpListener>,
}

impl Listeners {
    async fn bind(config: &Config) -> anyhow::Result<Self> {
        let control = control::ControlSocket::bind(&config.control).await?;
        let metrics = match config.control.metrics {
            Some(address) => match metrics::bind(address).await {
                Ok(listener) => Some(listener),
                Err(error) => {
                    control.abandon();
                    return Err(error);
                }
            },
            None => None,
        };
        Ok(Self { control, metrics })
    }

    fn abandon(self) {
        self.control.abandon();
    }
}

/// The tasks that serve beside the main loop.
struct Services {
    shutdown: CancellationToken,
    health_tasks: HealthTasks,
    control: tokio::task::JoinHandle<()>,
    metrics: Option<tokio::task::JoinHandle<()>>,
    announcer: Option<announce::Running>,
}

impl Services {
    async fn start(
        config: &Config,
        listeners: Listeners,
        state: &Arc<Mutex<State>>,
        capture: Option<(aya::maps::RingBuf<aya::maps::MapData>, PathBuf)>,
        announcer: Option<Announcer>,
        cluster: Option<(cluster::Opened, cluster::Maps, bool)>,
    ) -> anyhow::Result<Self> {
        let shutdown = CancellationToken::new();
        if let (Some((opened, maps, learn)), Some(config)) = (cluster, &config.cluster) {
            tracing::info!(
                "cluster: sharing new flows with {} peer(s){}",
                config.peers.len(),
                if learn {
                    "; learning theirs before announcing"
                } else {
                    ""
                }
            );
            cluster::start(
                state.clone(),
                opened,
                maps,
                learn,
                config.learn_timeout,
                shutdown.clone(),
            )?;
        }
        if let Some((ring, path)) = capture {
            let shutdown = shutdown.clone();
            tokio::spawn(async move {
                if let Err(error) = crate::capture::run(ring, &path, shutdown).await {
                    tracing::error!("debug capture stopped: {error:#}");
                }
            });
        }
        let health_tasks = HealthTasks::new(shutdown.clone());
        let control = control::serve(listeners.control, state.clone(), health_tasks.clone());
        state::spawn_checks(state, &health_tasks);
        let metrics = listeners.metrics.map(|listener| {
            let published = state.lock().expect("agent state poisoned").published();
            metrics::serve(
                listener,
                crate::snapshot::scraper(published),
                shutdown.clone(),
            )
        });
        let announcer = match (announcer, &config.announce) {
            (Some(announcer), Some(announce)) => {
                Some(announce::start(state.clone(), announcer, announce))
            }
            _ => None,
        };
        Ok(Self {
            shutdown,
            health_tasks,
            control,
            metrics,
            announcer,
        })
    }

    async fn stop(self) {
        // Withdraw first: routers move the traffic while this node still forwards it.
        if let Some(announcer) = self.announcer {
            announcer.stop().await;
        }
        self.shutdown.cancel();
        let _ = self.control.await;
        if let Some(metrics) = self.metrics {
            let _ = metrics.await;
        }
    }
}

/// The agent's own loop until SIGINT or SIGTERM: reloads on SIGHUP, scans the connection
/// table and samples counters (flows, rates, drains), follows neighbours.
async fn serve(
    state: &Arc<Mutex<State>>,
    health_tasks: &HealthTasks,
    neighbors: &mut Neighbors,
    flow_reader: &Arc<FlowReader>,
) -> anyhow::Result<()> {
    let mut link_events = Neighbors::link_events().context("following the interface")?;
    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sigint = signal(SignalKind::interrupt())?;
    let mut sighup = signal(SignalKind::hangup())?;
    let mut refresh = tokio::time::interval(NEIGHBOR_REFRESH);
    let mut load = tokio::time::interval(LOAD_REFRESH);
    let mut flow_scan = tokio::time::interval(FLOW_SCAN);
    // After a slow tick, the next comes a full period later, not at once: rates are
    // sampled over a real interval.
    flow_scan.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut scans = ScanPacer::default();
    let mut outliers = tokio::time::interval(crate::health::outlier::SAMPLE);
    // Its own task: a scan for it waits neither for this loop nor this loop for it.
    let stop_stabilizing = CancellationToken::new();
    let parts = state.lock().expect("agent state poisoned").stabilizer();
    tokio::spawn(stabilize_slots(
        parts,
        flow_reader.clone(),
        stop_stabilizing.clone(),
    ));
    let _stop_stabilizing = stop_stabilizing.drop_guard();
    loop {
        tokio::select! {
            _ = sigterm.recv() => return Ok(()),
            _ = sigint.recv() => return Ok(()),
            _ = sighup.recv() => {
                // `reload` logs what it did, or why it refused.
                let _ = state::reload(state, health_tasks);
            }
            _ = flow_scan.tick() => scan_and_sample(state, flow_reader, &mut scans).await,
            _ = load.tick() => state.lock().expect("agent state poisoned").refresh_load(Instant::now()),
            _ = outliers.tick() => judge_outliers(state),
            // A link, route or neighbour changed somewhere: look at ours, and at the
            // backends' next hops (the refresh does too, in case a notification was
            // lost). A burst of notifications is one look.
            Some(_) = link_events.next() => {
                while link_events.try_recv().is_ok() {}
                follow_host(state, neighbors).await;
            }
            _ = refresh.tick() => follow_host(state, neighbors).await,
        }
    }
}

/// Passive health's sample: the handshake counters are read before the state's lock is
/// taken (a read waits for no change, and no change for a read), then judged under it.
fn judge_outliers(state: &Arc<Mutex<State>>) {
    let (reader, ids) = state
        .lock()
        .expect("agent state poisoned")
        .outliers_to_read();
    match crate::health::outlier::read(&reader, &ids) {
        Ok(readings) => state
            .lock()
            .expect("agent state poisoned")
            .judge_outliers(Instant::now(), &readings),
        Err(error) => tracing::warn!("passive health: {:#}", anyhow::Error::from(error)),
    }
}

/// Follows the interface, then (while attached) the backends' routes and neighbours.
async fn follow_host(state: &Arc<Mutex<State>>, neighbors: &mut Neighbors) {
    follow_interface(state, neighbors).await;
    ports::follow(state, neighbors).await;
    let attached = state.lock().expect("agent state poisoned").is_attached();
    if attached && let Err(error) = follow_neighbors(neighbors, state).await {
        tracing::warn!("neighbour refresh: {error:#}");
    }
}

/// Follows the interface: when it goes, the data path is detached (the kernel took the
/// program off with it); when an interface of that name is there again, or its MAC
/// changed, the program (built for the MAC) is attached by the mode rules of the start
/// and the tables are written. A failed attach is tried again at the next refresh.
async fn follow_interface(state: &Arc<Mutex<State>>, neighbors: &mut Neighbors) {
    let name = neighbors.interface().name.clone();
    let found = match neighbors.lookup(&name).await {
        Ok(found) => found,
        Err(error) => {
            tracing::warn!("looking up interface {name}: {error:#}");
            return;
        }
    };
    let (change, dataplane, mode, attached) = {
        let mut state = state.lock().expect("agent state poisoned");
        let change = state.interface_change(found);
        (
            change,
            state.shared_dataplane(),
            state.xdp_mode_setting(),
            state.mode(),
        )
    };
    let interface = match change {
        InterfaceChange::None => return,
        InterfaceChange::Gone => {
            state.lock().expect("agent state poisoned").interface_lost();
            return;
        }
        InterfaceChange::Attach(interface) => interface,
    };
    let target = AttachTarget {
        object: EBPF_OBJECT,
        interface: interface.name.clone(),
        ifindex: interface.index,
        mac: interface.mac.0,
        mode,
        // In place only on the interface the running program is attached to.
        attached: attached.filter(|_| interface.index == neighbors.interface().index),
    };
    // Loading a program takes a while (the verifier): not on the async workers, and not
    // under the agent's lock. Table writes wait for the data path meanwhile.
    let attach = tokio::task::spawn_blocking(move || {
        dataplane
            .lock()
            .expect("data path poisoned")
            .follow_interface(&target)
    })
    .await;
    match attach {
        Ok(Ok(mode)) => {
            neighbors.set_interface(interface.clone());
            ports::first_followed(state, &interface, mode);
            state
                .lock()
                .expect("agent state poisoned")
                .interface_attached(interface, mode);
        }
        Ok(Err(error)) => tracing::error!(
            "attaching to interface {name} (index {}): {:#}; trying again",
            interface.index,
            anyhow::Error::from(error)
        ),
        Err(error) => tracing::error!("attaching to interface {name}: {error}"),
    }
}

/// Raises this process's soft limit on open files to the hard limit: a busy agent holds
/// a descriptor per health check in flight, per listener connection, per map.
fn raise_open_file_limit() {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit only read and write `limit`.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 || limit.rlim_cur >= limit.rlim_max
        {
            return;
        }
        let before = limit.rlim_cur;
        limit.rlim_cur = limit.rlim_max;
        if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) == 0 {
            tracing::info!("open-file limit raised from {before} to {}", limit.rlim_max);
        } else {
            tracing::warn!(
                "cannot raise the open-file limit from {before}: {}",
                std::io::Error::last_os_error()
            );
        }
    }
}

/// When the last scan began and what it took: a scan's cost grows with the table (a
/// million entries: about 0.3 s of CPU), so a large table is scanned less often, at most
/// a tenth of one CPU's time.
#[derive(Default)]
struct ScanPacer {
    last: Option<(Instant, Duration)>,
}

impl ScanPacer {
    fn due(&self) -> bool {
        self.last.is_none_or(|(at, took)| at.elapsed() >= took * 10)
    }
}

/// One flow-scan tick: a scan of the connection table when due (off the agent's lock, on
/// a blocking thread), then counter samples and drain progress.
async fn scan_and_sample(
    state: &Arc<Mutex<State>>,
    flow_reader: &Arc<FlowReader>,
    pacer: &mut ScanPacer,
) {
    let scanned = if pacer.due() {
        let reader = flow_reader.clone();
        let (started, started_ns) = (Instant::now(), monotonic_ns());
        let scanned = tokio::task::spawn_blocking(move || reader.flows()).await;
        pacer.last = Some((started, started.elapsed()));
        Some((scanned, started, started_ns))
    } else {
        None
    };
    // The counters are read before the lock is taken (their read side takes no lock the
    // writer holds): the agent's state is held for no syscall here.
    let (reader, ids) = state
        .lock()
        .expect("agent state poisoned")
        .counters_to_sample();
    let sample = reader
        .counters(&[], &ids)
        .and_then(|counters| Ok((counters, reader.sources()?)));
    let mut state = state.lock().expect("agent state poisoned");
    match scanned {
        Some((Ok(Ok(flows)), started, started_ns)) => {
            state.record_flows(flows, started, started_ns);
        }
        Some((Ok(Err(error)), ..)) => tracing::warn!("connection-table scan: {error:#}"),
        Some((Err(error), ..)) => tracing::warn!("connection-table scan: {error}"),
        None => {}
    }
    match sample {
        Ok((counters, sources)) => state.record_sample(Instant::now(), counters, sources),
        Err(error) => tracing::warn!("sampling counters: {error:#}"),
    }
    if let Err(error) = state.advance_drains(Instant::now()) {
        tracing::warn!("draining: {error:#}");
    }
    state.reweigh();
    // A backend removed once drained: the state file follows, once the lock is let go.
    let save = state.state_file_write();
    drop(state);
    if let Some(save) = save {
        save.write();
    }
}

/// `stable_slots`: turns changed slots stable once they waited `idle`
/// (`dataplane.flow_idle_timeout`) and the connection table's turnover (`turnover`),
/// and no live entry holds them, until `stop` or the writer stops. Never under the
/// agent's lock: the writer answers on its own thread.
async fn stabilize_slots(parts: StabilizerParts, reader: Arc<FlowReader>, stop: CancellationToken) {
    let StabilizerParts {
        stabilizer,
        idle,
        conntrack_entries,
        counters,
        horizon,
    } = parts;
    let mut turnover = SampledTurnover::new(conntrack_entries, counters, horizon);
    let (min, max) = STABILIZE_CHECK.into_inner();
    let mut tick = tokio::time::interval((idle / 4).clamp(min, max));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let Some(bound) = turnover.bound(idle).await else {
            continue;
        };
        if !stabilize_once(&stabilizer, &reader, bound).await {
            return;
        }
    }
}

/// The connection table's turnover (`turnover::Turnover`), sampled from the data path's
/// counters at each look of the stabilizer, its horizon published.
struct SampledTurnover {
    counters: Arc<CounterReader>,
    conntrack_entries: u32,
    /// Made at the first reading, which tells how many CPUs count.
    turnover: Option<turnover::Turnover>,
    published: Arc<turnover::PublishedHorizon>,
}

impl SampledTurnover {
    fn new(
        conntrack_entries: u32,
        counters: Arc<CounterReader>,
        published: Arc<turnover::PublishedHorizon>,
    ) -> Self {
        Self {
            counters,
            conntrack_entries,
            turnover: None,
            published,
        }
    }

    /// Takes a sample; the bound a changed slot waits now (`Turnover::bound`), None
    /// while none may turn stable (or the counters could not be read).
    async fn bound(&mut self, idle: Duration) -> Option<Duration> {
        let counters = self.counters.clone();
        let read = tokio::task::spawn_blocking(move || counters.counters(&[], &[])).await;
        let entries = match read {
            Ok(Ok(counters)) => counters.entries_per_cpu,
            Ok(Err(error)) => {
                let error = anyhow::Error::from(error);
                tracing::warn!("stable slots: reading the counters: {error:#}");
                return None;
            }
            Err(error) => {
                tracing::warn!("stable slots: {error}");
                return None;
            }
        };
        let now = Instant::now();
        let conntrack_entries = self.conntrack_entries;
        let turnover = self
            .turnover
            .get_or_insert_with(|| turnover::Turnover::new(conntrack_entries, entries.len()));
        turnover.record(now, entries);
        self.published.set(turnover.horizon());
        turnover.bound(now, idle)
    }
}

/// One look: the writer says whether a changed slot waited long enough (cheap, no map
/// read); only then is the connection table read, off the writer's thread and the
/// async workers, and handed to the writer. False once the writer stopped.
async fn stabilize_once(
    stabilizer: &Stabilizer,
    reader: &Arc<FlowReader>,
    bound: Duration,
) -> bool {
    let asked = stabilizer.clone();
    match tokio::task::spawn_blocking(move || asked.due(Instant::now(), bound)).await {
        Ok(Ok(true)) => {}
        Ok(Ok(false)) => return true,
        // The writer stopped: the agent is stopping.
        Ok(Err(_)) => return false,
        Err(error) => {
            tracing::warn!("stable slots: {error}");
            return true;
        }
    }
    let (stabilizer, reader) = (stabilizer.clone(), reader.clone());
    let turned = tokio::task::spawn_blocking(move || {
        // Taken before the read: an entry is judged live against when the scan began.
        let scanned = (Instant::now(), monotonic_ns());
        reader
            .flows()
            .map(|flows| stabilizer.stabilize(flows, scanned, bound))
    })
    .await;
    match turned {
        Ok(Ok(Ok(turned))) => {
            for (vip, slots) in turned {
                let address = lb_common::addr::from_map(&vip.addr, vip.family);
                let vip = std::net::SocketAddr::new(address, u16::from_be(vip.port));
                tracing::info!("stable slots: {slots} changed slot(s) of VIP {vip} turned stable");
            }
        }
        Ok(Ok(Err(WriteFailed::Stopped))) => return false,
        Ok(Ok(Err(error))) => tracing::warn!("stable slots: {error}"),
        Ok(Err(error)) => tracing::warn!(
            "stable slots: reading the connection table: {:#}",
            anyhow::Error::from(error)
        ),
        Err(error) => tracing::warn!("stable slots: {error}"),
    }
    true
}

/// Makes sure `pin_dir` lies on a bpf filesystem: mounts one at /sys/fs/bpf when the
/// directory is under it and none is mounted (a fresh machine has none); refuses a
/// directory elsewhere that is not on one.
///
/// Under `ip netns exec` the agent gets a mount namespace of its own with a fresh /sys,
/// so a bpffs it mounts there vanishes with it: pins then do not outlive the agent. Set
/// `pin_path` to a bpffs mounted outside /sys (as the test lab does) to keep them.
pub fn ensure_bpffs(pin_dir: &Path) -> anyhow::Result<()> {
    const BPF_FS: &str = "/sys/fs/bpf";
    if !pin_dir.starts_with(BPF_FS) {
        let existing = pin_dir
            .ancestors()
            .find(|p| p.exists())
            .unwrap_or(Path::new("/"));
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

/// Provokes resolution of every backend's next hop without a MAC and waits a little for
/// answers.
async fn resolve_first_macs(neighbors: &Neighbors, model: &mut Model) {
    let deadline = tokio::time::Instant::now() + FIRST_RESOLVE_WAIT;
    loop {
        let table = neighbors.table().await.unwrap_or_default();
        let mut missing = 0;
        for b in model.backends_mut() {
            if b.mac.is_none() {
                b.mac = b.next_hop.and_then(|hop| table.get(&hop).copied());
            }
            if b.mac.is_none() {
                missing += 1;
                if let Some(hop) = b.next_hop
                    && let Err(error) = neighbors.provoke(hop)
                {
                    tracing::warn!("cannot probe {hop}: {error}");
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

async fn follow_neighbors(neighbors: &Neighbors, state: &Arc<Mutex<State>>) -> anyhow::Result<()> {
    let table = neighbors.table().await?;
    let mut state = state.lock().expect("agent state poisoned");
    let routes_changed = state.follow_routes();
    for hop in state.next_hops_to_resolve(&table) {
        // Keep the last MAC we had, and ask the kernel to find it again.
        let _ = neighbors.provoke(hop);
    }
    if state.learn_macs(&table) || routes_changed {
        state.sync();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_says_which_privileges_it_lacks() {
        let all = u64::MAX >> 23;
        assert_eq!(missing_privileges(all), None, "root");
        let bpf_and_net = (1 << CAP_BPF) | (1 << CAP_NET_ADMIN);
        assert_eq!(missing_privileges(bpf_and_net), None);
        let nobody = missing_privileges(0).expect("refused");
        assert!(
            nobody.contains("needs root, or CAP_BPF and CAP_NET_ADMIN")
                && nobody.contains("lacks CAP_BPF and CAP_NET_ADMIN"),
            "{nobody}"
        );
        let no_net = missing_privileges(1 << CAP_BPF).expect("refused");
        assert!(no_net.ends_with("lacks CAP_NET_ADMIN"), "{no_net}");
    }

    #[test]
    fn the_open_file_limit_is_raised_to_the_hard_limit() {
        let get = || {
            let mut limit = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            // SAFETY: getrlimit writes `limit`.
            assert_eq!(
                unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) },
                0
            );
            limit
        };
        let mut lowered = get();
        // One below the hard limit: harmless to the other tests of this process.
        lowered.rlim_cur = lowered.rlim_max - 1;
        // SAFETY: setrlimit reads `lowered`.
        assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lowered) }, 0);
        super::raise_open_file_limit();
        let raised = get();
        assert_eq!(raised.rlim_cur, raised.rlim_max);
    }
}
