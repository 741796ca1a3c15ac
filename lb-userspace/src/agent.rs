//! `lb run`: load and attach the data path, keep its tables equal to the model, serve
//! the control socket, and stop cleanly on SIGINT/SIGTERM.

use std::{
    collections::{HashMap, HashSet},
    path::PathBuf,
    sync::{Arc, Mutex},
    time::Duration,
};

use anyhow::Context;
use lb_common::stat;
use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;

use crate::{
    EBPF_OBJECT,
    config::{AdminState, Config, HashMode},
    control::{self, BackendStatus, DataplaneStatus, Status, VipStatus},
    dataplane::{AttachedMode, AyaDataplane, Dataplane, LoadOptions, vip_capacity},
    explain::monotonic_ns,
    health,
    model::{Health, Model},
    neighbor::{Interface, Neighbors},
    tables::{Desired, TableWriter},
};

/// How often the neighbour table is re-read for backend MAC changes.
const NEIGHBOR_REFRESH: Duration = Duration::from_secs(1);
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
    /// the last scan (`scan_flows`).
    pub active_flows: HashMap<u32, u64>,
    /// Connection-table entries at the last scan.
    pub conntrack_size: u64,
}

impl Shared {
    /// Recomputes the tables and writes what changed.
    pub fn sync(&mut self) -> anyhow::Result<()> {
        let desired = self.model.desired();
        let report = self.writer.apply(self.dataplane.as_mut(), &desired)?;
        if report.slots_written > 0 || report.vips_removed > 0 {
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
            ("control.socket", old.control.socket != new.control.socket),
        ];
        if let Some((field, _)) = fixed.iter().find(|(_, changed)| *changed) {
            return Err(ReloadError::NeedsRestart(field));
        }
        let mut model = self.model.clone();
        model.update(&new).map_err(ReloadError::Model)?;
        let changes = describe_changes(&self.model, &model);
        self.model = model;
        self.config = new;
        self.sync().map_err(ReloadError::Write)?;
        Ok(changes)
    }

    /// Counts live connection-table entries per backend.
    pub fn scan_flows(&mut self, now_ns: u64) -> anyhow::Result<()> {
        let idle_ns = self.config.dataplane.flow_idle_timeout.as_nanos() as u64;
        let flows = self.dataplane.flows()?;
        self.conntrack_size = flows.len() as u64;
        self.active_flows.clear();
        for (_, entry) in flows {
            if now_ns.saturating_sub(entry.last_seen_ns) <= idle_ns {
                *self.active_flows.entry(entry.backend_id).or_default() += 1;
            }
        }
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
                            state: match b.config.state {
                                AdminState::Ready => "ready",
                                AdminState::Drain => "draining",
                                AdminState::Maint => "maint",
                            }
                            .to_string(),
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
                        }
                    })
                    .collect();
                let healthy = vip
                    .backends
                    .iter()
                    .filter(|b| b.health != Health::Down)
                    .count();
                VipStatus {
                    name: vip.config.name.clone(),
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
            },
            vips,
            counters,
        })
    }
}

/// Runs the agent until SIGINT or SIGTERM.
pub async fn run(config_path: PathBuf) -> anyhow::Result<()> {
    let config = Config::load(&config_path)?;
    let neighbors = Neighbors::open(&config.dataplane.interface)
        .await
        .context("reading the data-path interface")?;
    let interface = neighbors.interface().clone();

    let mut model = Model::new(
        config.dataplane.maglev_table_size,
        vip_capacity(config.vips.len()),
        config.dataplane.flow_idle_timeout,
    );
    model.update(&config)?;
    resolve_first_macs(&neighbors, &mut model).await;

    let mut dataplane = AyaDataplane::load(
        EBPF_OBJECT,
        LoadOptions::from_config(&config, interface.mac.0),
    )
    .context("loading the XDP program")?;
    // Tables first, then attach: the program never runs on empty maps.
    let mut writer = TableWriter::new(config.dataplane.maglev_table_size);
    let desired = model.desired();
    writer.apply(&mut dataplane, &desired)?;
    let mode = dataplane.attach(&interface.name, config.dataplane.xdp_mode)?;

    let shared = Arc::new(Mutex::new(Shared {
        config_path,
        config: config.clone(),
        model,
        dataplane: Box::new(dataplane),
        writer,
        desired,
        interface: interface.clone(),
        mode,
        active_flows: HashMap::new(),
        conntrack_size: 0,
    }));
    let shutdown = CancellationToken::new();
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
    health::spawn_checks(&shared, &health_tasks.running, &shutdown);

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
    loop {
        tokio::select! {
            _ = sigterm.recv() => break,
            _ = sigint.recv() => break,
            _ = sighup.recv() => {
                if let Err(error) = reload(&shared, &health_tasks) {
                    tracing::error!("reload refused: {:#}", anyhow::Error::from(error));
                }
            }
            _ = flow_scan.tick() => {
                let mut shared = shared.lock().expect("agent state poisoned");
                if let Err(error) = shared.scan_flows(monotonic_ns()) {
                    tracing::warn!("connection-table scan: {error:#}");
                }
            }
            _ = refresh.tick() => {
                if let Err(error) = follow_neighbors(&neighbors, &shared).await {
                    tracing::warn!("neighbour refresh: {error:#}");
                }
            }
        }
    }
    tracing::info!("stopping: detaching from {}", interface.name);
    shutdown.cancel();
    let _ = control.await;
    // Dropping the data path detaches the program and frees its maps.
    drop(shared);
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
    let changes = {
        let mut guard = shared.lock().expect("agent state poisoned");
        let new = Config::load(&guard.config_path)?;
        guard.reload(new)?
    };
    health::spawn_checks(shared, &health_tasks.running, &health_tasks.shutdown);
    if changes.is_empty() {
        tracing::info!("reload: no change");
    }
    for line in &changes {
        tracing::info!("reload: {line}");
    }
    Ok(changes)
}

/// What starting health-check tasks needs.
#[derive(Clone)]
pub struct HealthTasks {
    pub running: Arc<Mutex<HashSet<u32>>>,
    pub shutdown: CancellationToken,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{config::MacAddr, dataplane::MemoryDataplane};

    fn config(interface: &str, backends: &[&str]) -> Config {
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

    fn shared(config: Config) -> Shared {
        let mut model = Model::new(7, 16, Duration::ZERO);
        model.update(&config).unwrap();
        let mut shared = Shared {
            config_path: PathBuf::from("/nonexistent"),
            config,
            model,
            dataplane: Box::new(MemoryDataplane::default()),
            writer: TableWriter::new(7),
            desired: Desired::default(),
            interface: Interface {
                name: "eth0".into(),
                index: 1,
                mac: MacAddr([2, 0, 0, 0, 0, 1]),
            },
            mode: AttachedMode::Generic,
            active_flows: HashMap::new(),
            conntrack_size: 0,
        };
        shared.sync().unwrap();
        shared
    }

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
    }
}
