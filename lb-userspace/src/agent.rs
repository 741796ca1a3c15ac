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
    health,
    model::{Health, Model},
    neighbor::{Interface, Neighbors},
    tables::{Desired, TableWriter},
};

/// How often the neighbour table is re-read for backend MAC changes.
const NEIGHBOR_REFRESH: Duration = Duration::from_secs(1);
/// How long start-up waits for missing backend MACs before serving without them.
const FIRST_RESOLVE_WAIT: Duration = Duration::from_secs(3);

/// Everything the agent's tasks share, behind one mutex (operations on it are short).
pub struct Shared {
    pub config: Config,
    pub model: Model,
    pub dataplane: Box<dyn Dataplane + Send>,
    pub writer: TableWriter,
    pub desired: Desired,
    pub interface: Interface,
    pub mode: AttachedMode,
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
                            active_flows: None,
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

    let mut model = Model::new(config.dataplane.maglev_table_size);
    model.update(&config)?;
    resolve_first_macs(&neighbors, &mut model).await;

    let mut dataplane = AyaDataplane::load(
        EBPF_OBJECT,
        LoadOptions {
            maglev_table_size: config.dataplane.maglev_table_size,
            vip_capacity: vip_capacity(config.vips.len()),
            iface_mac: interface.mac.0,
        },
    )
    .context("loading the XDP program")?;
    // Tables first, then attach: the program never runs on empty maps.
    let mut writer = TableWriter::new(config.dataplane.maglev_table_size);
    let desired = model.desired();
    writer.apply(&mut dataplane, &desired)?;
    let mode = dataplane.attach(&interface.name, config.dataplane.xdp_mode)?;

    let shared = Arc::new(Mutex::new(Shared {
        config: config.clone(),
        model,
        dataplane: Box::new(dataplane),
        writer,
        desired,
        interface: interface.clone(),
        mode,
    }));
    let shutdown = CancellationToken::new();
    let control = control::serve(
        config.control.socket.clone(),
        shared.clone(),
        shutdown.clone(),
    )
    .await?;
    let health_tasks = Arc::new(Mutex::new(HashSet::new()));
    health::spawn_checks(&shared, &health_tasks, &shutdown);

    println!(
        "serving {} VIP(s) on {} (xdp mode: {mode}); control socket {}",
        config.vips.len(),
        interface.name,
        config.control.socket.display()
    );

    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sigint = signal(SignalKind::interrupt())?;
    let mut refresh = tokio::time::interval(NEIGHBOR_REFRESH);
    loop {
        tokio::select! {
            _ = sigterm.recv() => break,
            _ = sigint.recv() => break,
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
