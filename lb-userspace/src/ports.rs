//! Several data-path interfaces (`dataplane.interfaces`): looked up at start, the program
//! attached to each but the first (which `agent` attaches as it does a single interface),
//! and each followed on its own: one that goes away is taken out of the egress maps
//! (its backends' routes leave by it no more), and one that returns is attached again,
//! alone, while the others serve on. With one interface nothing here runs.

use std::sync::{Arc, Mutex};

use anyhow::Context as _;

use crate::{
    config::Config,
    dataplane::{AttachHints, AttachedMode, Attachment, AyaDataplane, EgressPort},
    model::Model,
    neighbor::{self, Interface, Neighbors},
    state::{self, State},
};

/// The interfaces of `config` as the kernel knows them now, `neighbors`' first; empty
/// with one. One missing is refused, as a missing single interface is.
pub async fn look_up(
    config: &Config,
    neighbors: &mut Neighbors,
) -> anyhow::Result<Vec<EgressPort>> {
    if !config.dataplane.several_interfaces() {
        return Ok(Vec::new());
    }
    let mut ports = vec![port_of(neighbors.interface())];
    for name in &config.dataplane.interfaces[1..] {
        let interface = neighbors
            .lookup(name)
            .await
            .with_context(|| format!("looking up interface {name} (dataplane.interfaces)"))?
            .with_context(|| {
                format!("`dataplane.interfaces`: no interface {name} in this network namespace")
            })?;
        ports.push(port_of(&interface));
    }
    neighbors.set_all(ports.iter().map(|p| p.ifindex).collect());
    Ok(ports)
}

fn port_of(interface: &Interface) -> EgressPort {
    EgressPort {
        name: interface.name.clone(),
        ifindex: interface.index,
        mac: interface.mac.0,
        mode: None,
        native_refused: None,
    }
}

/// Before the first tables: each backend routed to the interface that reaches it
/// (`state::follow_routes`), and every interface recorded in the egress maps, so the
/// program, once on any of them, knows where each backend's frames leave.
pub fn prepare(
    dataplane: &mut AyaDataplane,
    model: &mut Model,
    ports: &[EgressPort],
    interface: &Interface,
) -> anyhow::Result<()> {
    let ifindexes: Vec<u32> = match ports.is_empty() {
        true => vec![interface.index],
        false => ports.iter().map(|p| p.ifindex).collect(),
    };
    state::follow_routes(model, &ifindexes, neighbor::route_to);
    for (index, port) in ports.iter().enumerate() {
        dataplane
            .record_egress(index as u32, port)
            .with_context(|| format!("recording interface {} for the data path", port.name))?;
    }
    Ok(())
}

/// Attaches the program to `interface` (the first, as a single one is), then to every
/// other, and records the modes; `hints` by interface, from the doctor's checks. Returns
/// the first's.
pub fn attach_all(
    dataplane: &mut AyaDataplane,
    config: &Config,
    interface: &Interface,
    hints: &[AttachHints],
    ports: &mut [EgressPort],
) -> anyhow::Result<Attachment> {
    let hint = |index: usize| hints.get(index).cloned().unwrap_or_default();
    let first = dataplane.attach_pinned(&interface.name, config.dataplane.xdp_mode, &hint(0))?;
    if let Some(why) = &first.native_refused {
        tracing::warn!("xdp_mode = \"auto\": attached in generic mode; native refused: {why}");
    }
    let Some((primary, others)) = ports.split_first_mut() else {
        return Ok(first);
    };
    primary.mode = Some(first.mode);
    primary.native_refused = first.native_refused.clone();
    dataplane.record_egress(0, primary)?;
    for (i, port) in others.iter_mut().enumerate() {
        let index = i + 1;
        let attached = dataplane
            .attach_more(
                index,
                &port.name,
                port.ifindex,
                config.dataplane.xdp_mode,
                &hint(index),
            )
            .with_context(|| format!("attaching to {} (dataplane.interfaces)", port.name))?;
        if let Some(why) = &attached.native_refused {
            tracing::warn!(
                "{}: xdp_mode = \"auto\": attached in generic mode; native refused: {why}",
                port.name
            );
        }
        port.mode = Some(attached.mode);
        port.native_refused = attached.native_refused;
        dataplane.record_egress(index as u32, port)?;
    }
    Ok(first)
}

/// The first interface was attached again (`agent::follow_interface`): its entry in the
/// egress maps follows.
pub fn first_followed(state: &Arc<Mutex<State>>, interface: &Interface, mode: AttachedMode) {
    if state
        .lock()
        .expect("agent state poisoned")
        .ports()
        .is_empty()
    {
        return;
    }
    let port = EgressPort {
        mode: Some(mode),
        ..port_of(interface)
    };
    record(state, 0, port);
}

/// The `index`th interface changed to `port`: in the agent's state and the egress maps.
fn record(state: &Arc<Mutex<State>>, index: u32, port: EgressPort) {
    let dataplane = {
        let mut state = state.lock().expect("agent state poisoned");
        state.port_changed(port.clone());
        state.shared_dataplane()
    };
    let written = dataplane
        .lock()
        .expect("data path poisoned")
        .set_egress(index, &port);
    if let Err(error) = written {
        tracing::error!("recording interface {}: {error}", port.name);
    }
}

/// Follows every interface after the first: one gone leaves the egress maps; one back
/// (or with a new MAC) is attached again on its own. Returns whether any changed (the
/// routes are then looked up again).
pub async fn follow(state: &Arc<Mutex<State>>, neighbors: &mut Neighbors) -> bool {
    let (ports, mode) = {
        let state = state.lock().expect("agent state poisoned");
        (state.ports().to_vec(), state.xdp_mode_setting())
    };
    let mut changed = false;
    for (index, port) in ports.iter().enumerate().skip(1) {
        let found = match neighbors.lookup(&port.name).await {
            Ok(found) => found,
            Err(error) => {
                tracing::warn!("looking up interface {}: {error:#}", port.name);
                continue;
            }
        };
        let now = match found {
            None if port.ifindex == 0 => continue,
            None => gone(port),
            Some(interface) if interface.index == port.ifindex && interface.mac.0 == port.mac => {
                continue;
            }
            Some(interface) => match attach_again(state, index, &interface, mode).await {
                Some(port) => port,
                None => continue,
            },
        };
        record(state, index as u32, now);
        changed = true;
    }
    if changed {
        let ifindexes = state.lock().expect("agent state poisoned").ifindexes();
        neighbors.set_all(ifindexes);
    }
    changed
}

/// The port of an interface that went away: its frames have nowhere to go.
fn gone(port: &EgressPort) -> EgressPort {
    tracing::warn!(
        "interface {} (index {}) is gone: backends reached through it are out of service \
         until it returns; the other interfaces serve on",
        port.name,
        port.ifindex
    );
    EgressPort {
        ifindex: 0,
        mode: None,
        native_refused: None,
        ..port.clone()
    }
}

/// Attaches the program to `interface` (back, or a new one of that name), alone.
async fn attach_again(
    state: &Arc<Mutex<State>>,
    index: usize,
    interface: &Interface,
    mode: crate::config::XdpModeSetting,
) -> Option<EgressPort> {
    let dataplane = state
        .lock()
        .expect("agent state poisoned")
        .shared_dataplane();
    let mut port = port_of(interface);
    let target = port.clone();
    // The attach may wait for the kernel to free an old link: not on the async workers.
    let attached = tokio::task::spawn_blocking(move || {
        dataplane
            .lock()
            .expect("data path poisoned")
            .attach_port(index, &target, mode)
    })
    .await;
    match attached {
        Ok(Ok(attachment)) => {
            tracing::info!(
                "interface {} is back (index {}, MAC {}): attached again ({} mode)",
                interface.name,
                interface.index,
                interface.mac,
                attachment.mode
            );
            port.mode = Some(attachment.mode);
            port.native_refused = attachment.native_refused;
            Some(port)
        }
        Ok(Err(error)) => {
            tracing::error!(
                "attaching to interface {}: {:#}; trying again",
                interface.name,
                anyhow::Error::from(error)
            );
            None
        }
        Err(error) => {
            tracing::error!("attaching to interface {}: {error}", interface.name);
            None
        }
    }
}
