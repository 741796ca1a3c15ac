//! Announcing VIPs to routers (`[announce]`): several balancer nodes behind ECMP.
//!
//! The agent speaks no BGP. It keeps one route per VIP address it serves (`VIP/32` or
//! `VIP/128`) in a kernel routing table of its own (`announce.table`, protocol
//! `announce.protocol`), pointing at a tun device it creates and holds open
//! (`announce.device`). A routing daemon imports that table and announces what is in it:
//! BIRD's `protocol kernel { kernel table 4242; learn; }` feeding `protocol bgp` (see
//! `scripts/bird/`). Nothing looks routes up in that table; it is only a mailbox.
//!
//! When: an address is announced while at least one VIP on it qualifies, and a VIP
//! qualifies while the agent serves (attached, tables written), the warm-up since it
//! started serving is over, the node is not drained (`lb node drain`), and at least
//! `min_healthy` of its backends take new flows ([`verdict`]). The agent withdraws by
//! deleting the route: when that stops holding, on `lb node drain`, and before it exits
//! on SIGTERM/SIGINT. If the agent dies without that (SIGKILL, a crash), the kernel
//! removes the tun device with the agent's last file descriptor, and the device's
//! routes with it: BIRD sees them go and withdraws. A node whose agent is gone attracts
//! no traffic.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    net::IpAddr,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use futures::TryStreamExt;
use rtnetlink::{
    Handle, LinkUnspec, RouteMessageBuilder,
    packet_route::route::{RouteAddress, RouteAttribute, RouteMessage, RouteProtocol, RouteScope},
};
use tokio::sync::{Notify, watch};
use tokio_util::sync::CancellationToken;

use crate::{config::AnnounceConfig, model::VipState, status::NodeStatus};

/// How often the announcer re-reads the table even when nothing changed (repairs outside
/// edits). Changes themselves wake it at once.
const RESYNC: Duration = Duration::from_secs(2);
/// How soon it tries again after failing to write the routes.
const RETRY: Duration = Duration::from_millis(200);

/// Why a VIP is not announced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Why {
    /// The data path is not attached with its tables written yet.
    NotServing,
    /// `lb node drain`.
    Drained,
    /// Fewer than `min_healthy` backends take new flows.
    TooFewUp { up: usize, min_healthy: u32 },
    /// The warm-up after start is not over.
    WarmingUp { left: Duration },
    /// `[cluster]`: the node started with an empty connection table and is learning its
    /// peers' entries (until they answered or `cluster.learn_timeout` passed).
    Learning,
}

impl fmt::Display for Why {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Why::NotServing => write!(f, "the data path is not serving yet"),
            Why::Drained => write!(f, "the node is drained (lb node ready undoes it)"),
            Why::TooFewUp { up, min_healthy } => write!(
                f,
                "{up} backend(s) up, fewer than min_healthy {min_healthy}"
            ),
            Why::WarmingUp { left } => write!(f, "warming up ({:.1}s left)", left.as_secs_f64()),
            Why::Learning => write!(f, "learning the cluster peers' flows"),
        }
    }
}

/// The node's side of the decision.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodeView {
    /// How long the data path has been serving (`None`: not yet).
    pub serving_for: Option<Duration>,
    pub warmup: Duration,
    pub drained: bool,
    /// Learning the cluster peers' entries (`Why::Learning`).
    pub learning: bool,
}

/// Whether one VIP should be announced: `Ok(())`, or why not. `up` is the number of its
/// backends that take new flows.
pub fn verdict(node: &NodeView, up: usize, min_healthy: u32) -> Result<(), Why> {
    let Some(serving_for) = node.serving_for else {
        return Err(Why::NotServing);
    };
    if node.drained {
        return Err(Why::Drained);
    }
    if up < min_healthy as usize {
        return Err(Why::TooFewUp { up, min_healthy });
    }
    if serving_for < node.warmup {
        return Err(Why::WarmingUp {
            left: node.warmup - serving_for,
        });
    }
    if node.learning {
        return Err(Why::Learning);
    }
    Ok(())
}

/// The addresses to announce: those with at least one qualifying VIP. Given as
/// (address, backends up, min_healthy) per VIP.
pub fn wanted(
    node: &NodeView,
    vips: impl IntoIterator<Item = (IpAddr, usize, u32)>,
) -> BTreeSet<IpAddr> {
    vips.into_iter()
        .filter(|(_, up, min)| verdict(node, *up, *min).is_ok())
        .map(|(address, _, _)| address)
        .collect()
}

/// Backends of a VIP that take new flows.
pub fn backends_up(vip: &VipState) -> usize {
    vip.backends.iter().filter(|b| b.in_table()).count()
}

/// The announcement state, kept in the agent's state.
#[derive(Clone, Debug, Default)]
pub struct State {
    /// `[announce]` is configured and the announcer runs.
    pub enabled: bool,
    /// When the data path started serving (the warm-up counts from here).
    pub serving_since: Option<Instant>,
    /// `lb node drain` (until `lb node ready`).
    pub drained: bool,
    /// `[cluster]`: learning the peers' entries; nothing is announced meanwhile.
    pub learning: bool,
    /// Addresses whose routes are in the table, as of the last reconcile.
    pub installed: BTreeSet<IpAddr>,
    /// The last reconcile's error, while it lasts.
    pub error: Option<String>,
    /// Wakes the announcer: what it should announce may have changed.
    wake: Arc<Notify>,
    /// Counts the announcer's reconciles, for those who wait for the routes to follow.
    reconciled: Arc<watch::Sender<u64>>,
}

impl State {
    pub fn node_view(&self, warmup: Duration, now: Instant) -> NodeView {
        NodeView {
            serving_for: self.serving_since.map(|since| now.duration_since(since)),
            warmup,
            drained: self.drained,
            learning: self.learning,
        }
    }

    /// Tells the announcer to look again (a VIP's backends or the node state changed).
    pub fn changed(&self) {
        self.wake.notify_one();
    }
}

/// What the announcer reads of the agent's state.
#[derive(Clone, Copy)]
pub struct View<'a> {
    pub config: Option<&'a AnnounceConfig>,
    pub vips: &'a [VipState],
    pub state: &'a State,
}

/// The agent's state as the announcer task sees it.
pub trait Host: Send + 'static {
    fn announce_view(&self) -> View<'_>;
    fn announce_state(&mut self) -> &mut State;
    /// The announcement state changed (through `announce_state`): the host publishes it
    /// for its readers (status).
    fn announce_changed(&mut self) {}
}

/// The addresses `view` should announce now.
fn wanted_now(view: &View<'_>, now: Instant) -> BTreeSet<IpAddr> {
    let Some(config) = view.config else {
        return BTreeSet::new();
    };
    let node = view.state.node_view(config.warmup, now);
    wanted(
        &node,
        view.vips
            .iter()
            .map(|vip| (vip.config.address, backends_up(vip), vip.config.min_healthy)),
    )
}

/// What `lb status` says of one VIP: whether its address is announced, and why (not).
pub fn describe_vip(view: &View<'_>, vip: &VipState, now: Instant) -> (bool, String) {
    let Some(config) = view.config else {
        return (false, "not announced: no [announce] section".into());
    };
    let state = view.state;
    let announced = state.installed.contains(&vip.config.address);
    let node = state.node_view(config.warmup, now);
    let text = match (
        verdict(&node, backends_up(vip), vip.config.min_healthy),
        announced,
    ) {
        (Ok(()), true) => "announced".to_string(),
        (Ok(()), false) => match &state.error {
            Some(error) => format!("not announced yet: {error}"),
            None => "announcing".to_string(),
        },
        (Err(why), true) => format!("announced for another VIP of this address; this one: {why}"),
        (Err(why), false) => format!("withdrawn: {why}"),
    };
    (announced, text)
}

/// The node's part of `lb status`.
pub fn node_status(view: &View<'_>, now: Instant) -> NodeStatus {
    let Some(config) = view.config else {
        return NodeStatus::default();
    };
    let state = view.state;
    let node = state.node_view(config.warmup, now);
    NodeStatus {
        announcing: state.enabled,
        drained: state.drained,
        table: Some(config.table),
        device: Some(config.device.clone()),
        warmup_left_seconds: warmup_left(config, &node).as_secs_f64(),
        announced: state.installed.iter().map(ToString::to_string).collect(),
        error: state.error.clone(),
    }
}

fn warmup_left(config: &AnnounceConfig, node: &NodeView) -> Duration {
    node.serving_for
        .map_or(config.warmup, |s| config.warmup.saturating_sub(s))
}

#[derive(Debug, thiserror::Error)]
pub enum AnnounceError {
    #[error(
        "announce.device {0} already exists: the agent creates it itself (another agent, \
         or a leftover? `ip link del {0}`), or choose another name"
    )]
    DeviceExists(String),
    #[error("creating the tun device {device} (/dev/net/tun)")]
    Tun {
        device: String,
        source: std::io::Error,
    },
    #[error("opening a netlink socket")]
    Connect(#[source] std::io::Error),
    #[error("bringing {device} up")]
    Up {
        device: String,
        source: rtnetlink::Error,
    },
    #[error("reading routing table {table}")]
    List {
        table: u32,
        source: rtnetlink::Error,
    },
    #[error("adding the route {address} to table {table}")]
    Add {
        address: IpAddr,
        table: u32,
        source: rtnetlink::Error,
    },
    #[error("deleting the route {address} from table {table}")]
    Delete {
        address: IpAddr,
        table: u32,
        source: rtnetlink::Error,
    },
}

/// A tun device that exists as long as this value (and so this process) does.
struct Tun {
    /// Held, never read: closing it deletes the device.
    _fd: OwnedFd,
    name: String,
    index: u32,
}

impl Tun {
    fn create(name: &str) -> Result<Tun, AnnounceError> {
        // TUNSETIFF would attach to an existing (persistent) device, which then would not
        // go away with us.
        if nix::net::if_::if_nametoindex(name).is_ok() {
            return Err(AnnounceError::DeviceExists(name.into()));
        }
        let tun_error = |source| AnnounceError::Tun {
            device: name.into(),
            source,
        };
        // SAFETY: open(2) with a NUL-terminated path; the fd is owned at once.
        let raw = unsafe { libc::open(c"/dev/net/tun".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
        if raw < 0 {
            return Err(tun_error(std::io::Error::last_os_error()));
        }
        // SAFETY: `raw` is a fresh descriptor nobody else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: an all-zero ifreq is valid (empty name, zero flags).
        let mut request: libc::ifreq = unsafe { std::mem::zeroed() };
        // The config checked the length (at most IFNAMSIZ - 1 bytes): NUL stays last.
        for (slot, byte) in request.ifr_name.iter_mut().zip(name.bytes()) {
            *slot = byte as libc::c_char;
        }
        request.ifr_ifru.ifru_flags = (libc::IFF_TUN | libc::IFF_NO_PI) as libc::c_short;
        // SAFETY: TUNSETIFF reads (and may update) one ifreq that lives for the call.
        if unsafe { libc::ioctl(fd.as_raw_fd(), libc::TUNSETIFF, &mut request) } < 0 {
            return Err(tun_error(std::io::Error::last_os_error()));
        }
        let index =
            nix::net::if_::if_nametoindex(name).map_err(|e| tun_error(std::io::Error::from(e)))?;
        Ok(Tun {
            _fd: fd,
            name: name.into(),
            index,
        })
    }
}

/// One route of ours found in the table.
struct OurRoute {
    address: IpAddr,
    /// A host route (/32, /128) through our device: exactly what we add.
    exact: bool,
    message: RouteMessage,
}

/// Writes the routes: owns the device and a netlink handle.
pub struct Announcer {
    handle: Handle,
    tun: Tun,
    table: u32,
    protocol: u8,
}

impl Announcer {
    /// Creates the device, brings it up and opens netlink (spawning its task).
    pub async fn open(config: &AnnounceConfig) -> Result<Announcer, AnnounceError> {
        let tun = Tun::create(&config.device)?;
        let (connection, handle, _) =
            rtnetlink::new_connection().map_err(AnnounceError::Connect)?;
        tokio::spawn(connection);
        handle
            .link()
            .set(LinkUnspec::new_with_index(tun.index).up().build())
            .execute()
            .await
            .map_err(|source| AnnounceError::Up {
                device: tun.name.clone(),
                source,
            })?;
        Ok(Announcer {
            handle,
            tun,
            table: config.table,
            protocol: config.protocol,
        })
    }

    /// Routes in our table with our protocol (of either family).
    async fn list(&self) -> Result<Vec<OurRoute>, AnnounceError> {
        let list_error = |source| AnnounceError::List {
            table: self.table,
            source,
        };
        let mut found = Vec::new();
        for query in [
            RouteMessageBuilder::<std::net::Ipv4Addr>::new().build(),
            RouteMessageBuilder::<std::net::Ipv6Addr>::new().build(),
        ] {
            let mut dump = self.handle.route().get(query).execute();
            while let Some(message) = dump.try_next().await.map_err(list_error)? {
                if let Some(route) = self.ours(message) {
                    found.push(route);
                }
            }
        }
        Ok(found)
    }

    fn ours(&self, message: RouteMessage) -> Option<OurRoute> {
        // Tables above 255 are only in the attribute (the header says 252, "compat").
        let table = message
            .attributes
            .iter()
            .find_map(|a| match a {
                RouteAttribute::Table(t) => Some(*t),
                _ => None,
            })
            .unwrap_or(u32::from(message.header.table));
        if table != self.table || u8::from(message.header.protocol) != self.protocol {
            return None;
        }
        let mut address = None;
        let mut oif = None;
        for attribute in &message.attributes {
            match attribute {
                RouteAttribute::Destination(RouteAddress::Inet(a)) => address = Some((*a).into()),
                RouteAttribute::Destination(RouteAddress::Inet6(a)) => address = Some((*a).into()),
                RouteAttribute::Oif(index) => oif = Some(*index),
                _ => {}
            }
        }
        let address: IpAddr = address?;
        let full = if address.is_ipv4() { 32 } else { 128 };
        Some(OurRoute {
            address,
            exact: message.header.destination_prefix_length == full && oif == Some(self.tun.index),
            message,
        })
    }

    fn route(&self, address: IpAddr) -> RouteMessage {
        let prefix = if address.is_ipv4() { 32 } else { 128 };
        let builder = RouteMessageBuilder::<IpAddr>::new()
            .destination_prefix(address, prefix)
            .expect("a host prefix of the address's own family");
        // Link scope, as `ip route add ... dev` gives a route without a gateway.
        let scope = if address.is_ipv4() {
            RouteScope::Link
        } else {
            RouteScope::Universe
        };
        builder
            .output_interface(self.tun.index)
            .table_id(self.table)
            .protocol(RouteProtocol::from(self.protocol))
            .scope(scope)
            .build()
    }

    /// Makes the table hold exactly `wanted` (of our routes); returns what it added and
    /// deleted.
    pub async fn apply(
        &self,
        wanted: &BTreeSet<IpAddr>,
    ) -> Result<(Vec<IpAddr>, Vec<IpAddr>), AnnounceError> {
        let mut present = BTreeSet::new();
        let mut deleted = Vec::new();
        for route in self.list().await? {
            if route.exact && wanted.contains(&route.address) && present.insert(route.address) {
                continue;
            }
            self.handle
                .route()
                .del(route.message)
                .execute()
                .await
                .map_err(|source| AnnounceError::Delete {
                    address: route.address,
                    table: self.table,
                    source,
                })?;
            deleted.push(route.address);
        }
        let mut added = Vec::new();
        for address in wanted.difference(&present) {
            self.handle
                .route()
                .add(self.route(*address))
                .replace()
                .execute()
                .await
                .map_err(|source| AnnounceError::Add {
                    address: *address,
                    table: self.table,
                    source,
                })?;
            added.push(*address);
        }
        Ok((added, deleted))
    }
}

/// The running announcer task.
pub struct Running {
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Running {
    /// Withdraws every VIP, waits until the routes are gone, and removes the device.
    pub async fn stop(self) {
        self.stop.cancel();
        if let Err(error) = self.task.await {
            tracing::error!("announcer task: {error}");
        }
    }
}

/// Starts announcing for `host`, whose data path serves from now on (the warm-up
/// starts here).
pub fn start<H: Host>(
    host: Arc<Mutex<H>>,
    announcer: Announcer,
    config: &AnnounceConfig,
) -> Running {
    tracing::info!(
        "announcing VIPs as routes in table {} (protocol {}, device {}) after a warm-up of {}",
        config.table,
        config.protocol,
        config.device,
        humantime::format_duration(config.warmup)
    );
    let wake = {
        let mut host = host.lock().expect("agent state poisoned");
        let state = host.announce_state();
        state.enabled = true;
        state.serving_since = Some(Instant::now());
        let wake = state.wake.clone();
        host.announce_changed();
        wake
    };
    let stop = CancellationToken::new();
    let task = tokio::spawn(run(announcer, host, wake, stop.clone()));
    Running { stop, task }
}

/// What to announce now, why each other address is not, and when to look again by
/// itself: when the warm-up ends, else at the next re-read.
fn evaluate(view: &View<'_>) -> (BTreeSet<IpAddr>, BTreeMap<IpAddr, String>, Duration) {
    let now = Instant::now();
    let left = view.config.map_or(Duration::ZERO, |config| {
        warmup_left(config, &view.state.node_view(config.warmup, now))
    });
    let next_look = if left > Duration::ZERO {
        // A little past the end, so that the look sees it over.
        (left + Duration::from_millis(10)).min(RESYNC)
    } else {
        RESYNC
    };
    (wanted_now(view, now), reasons(view, now), next_look)
}

async fn run<H: Host>(
    announcer: Announcer,
    host: Arc<Mutex<H>>,
    wake: Arc<Notify>,
    stop: CancellationToken,
) {
    let mut installed: Option<BTreeSet<IpAddr>> = None;
    let mut last_read = Instant::now();
    let mut last_error = None;
    let mut next_look = Duration::ZERO;
    loop {
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = wake.notified() => {}
            _ = tokio::time::sleep(next_look) => {}
        }
        let (wanted, reasons, next) = {
            let host = host.lock().expect("agent state poisoned");
            evaluate(&host.announce_view())
        };
        next_look = next;
        let due = last_read.elapsed() >= RESYNC;
        if installed.as_ref() == Some(&wanted) && !due {
            continue;
        }
        last_read = Instant::now();
        let error = match announcer.apply(&wanted).await {
            Ok((added, deleted)) => {
                for address in &added {
                    tracing::info!("announcing {address}");
                }
                for address in &deleted {
                    let why = reasons.get(address).map_or("", String::as_str);
                    tracing::info!("withdrawing {address}{why}");
                }
                installed = Some(wanted.clone());
                None
            }
            Err(error) => {
                let text = format!("{:#}", anyhow::Error::from(error));
                if last_error.as_ref() != Some(&text) {
                    tracing::warn!("announcing: {text} (retrying)");
                }
                // Unknown: read the table again, soon.
                installed = None;
                next_look = next_look.min(RETRY);
                Some(text)
            }
        };
        last_error = error.clone();
        let mut host = host.lock().expect("agent state poisoned");
        let state = host.announce_state();
        if let Some(installed) = &installed {
            state.installed = installed.clone();
        }
        state.error = error;
        state.reconciled.send_modify(|n| *n += 1);
        host.announce_changed();
    }
    // Stopping: withdraw everything before the agent goes.
    match announcer.apply(&BTreeSet::new()).await {
        Ok((_, deleted)) => {
            for address in deleted {
                tracing::info!("withdrawing {address}: the agent is stopping");
            }
        }
        Err(error) => tracing::error!(
            "withdrawing before stopping: {:#}; removing the device {} takes the routes \
             with it",
            anyhow::Error::from(error),
            announcer.tun.name
        ),
    }
    let mut host = host.lock().expect("agent state poisoned");
    let state = host.announce_state();
    state.installed.clear();
    state.enabled = false;
    host.announce_changed();
}

/// Per address, why it would be withdrawn (for the log): `": vip web: ..."`.
fn reasons(view: &View<'_>, now: Instant) -> BTreeMap<IpAddr, String> {
    let Some(config) = view.config else {
        return BTreeMap::new();
    };
    let node = view.state.node_view(config.warmup, now);
    let mut reasons = BTreeMap::new();
    for vip in view.vips {
        if let Err(why) = verdict(&node, backends_up(vip), vip.config.min_healthy) {
            reasons
                .entry(vip.config.address)
                .or_insert_with(|| format!(": vip {}: {why}", vip.config.name));
        }
    }
    reasons
}

/// Why `lb node drain` or `lb node ready` did not finish.
#[derive(Debug, thiserror::Error)]
pub enum NodeChangeError {
    #[error(
        "this agent announces nothing (no [announce] section): there is no node state to \
         change"
    )]
    NothingAnnounced,
    /// The state is set, and the routes still have to follow: `error` is the last route
    /// change's failure, if any.
    #[error(
        "the node state is set ({}), but the routes did not follow within {:?}{}",
        if *.drained { "drained" } else { "ready" },
        .timeout,
        .error.as_ref().map(|e| format!(": {e}")).unwrap_or_default()
    )]
    RoutesLate {
        drained: bool,
        timeout: Duration,
        error: Option<String>,
    },
}

/// `lb node drain` (`drained = true`) and `lb node ready`: sets the node's state and
/// waits (up to `timeout`) until the routes follow. Returns what it did.
pub async fn set_drained<H: Host>(
    host: &Arc<Mutex<H>>,
    drained: bool,
    timeout: Duration,
) -> Result<String, NodeChangeError> {
    let (before, mut reconciled) = {
        let mut host = host.lock().expect("agent state poisoned");
        let view = host.announce_view();
        if view.config.is_none() || !view.state.enabled {
            return Err(NodeChangeError::NothingAnnounced);
        }
        let state = host.announce_state();
        state.drained = drained;
        state.changed();
        let answer = (state.installed.clone(), state.reconciled.subscribe());
        host.announce_changed();
        answer
    };
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        // Marked seen before looking: a reconcile after the look ends the wait below.
        reconciled.borrow_and_update();
        let (installed, wanted, error) = {
            let host = host.lock().expect("agent state poisoned");
            let view = host.announce_view();
            (
                view.state.installed.clone(),
                wanted_now(&view, Instant::now()),
                view.state.error.clone(),
            )
        };
        if installed == wanted {
            return Ok(node_change_answer(drained, &before, &installed));
        }
        let waited = tokio::time::timeout_at(deadline, reconciled.changed()).await;
        if !matches!(waited, Ok(Ok(()))) {
            return Err(NodeChangeError::RoutesLate {
                drained,
                timeout,
                error,
            });
        }
    }
}

/// What `lb node drain` / `lb node ready` answer once the routes followed.
fn node_change_answer(
    drained: bool,
    before: &BTreeSet<IpAddr>,
    installed: &BTreeSet<IpAddr>,
) -> String {
    let list = |set: &BTreeSet<IpAddr>| {
        if set.is_empty() {
            "none".to_string()
        } else {
            set.iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        }
    };
    if drained {
        format!(
            "node drained: withdrew {}; flows already here continue until the routers move \
             them",
            list(before)
        )
    } else {
        format!(
            "node ready: announcing {} (a VIP waits for its warm-up and min_healthy)",
            list(installed)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECOND: Duration = Duration::from_secs(1);

    fn node(serving_for: Option<u64>, drained: bool) -> NodeView {
        NodeView {
            serving_for: serving_for.map(Duration::from_secs),
            warmup: 5 * SECOND,
            drained,
            learning: false,
        }
    }

    #[test]
    fn announced_only_when_serving_warm_ready_and_healthy_enough() {
        assert_eq!(verdict(&node(Some(10), false), 3, 1), Ok(()));
        assert_eq!(verdict(&node(Some(10), false), 2, 2), Ok(()));
        assert_eq!(verdict(&node(None, false), 3, 1), Err(Why::NotServing));
        assert_eq!(verdict(&node(Some(10), true), 3, 1), Err(Why::Drained));
        assert_eq!(
            verdict(&node(Some(10), false), 1, 2),
            Err(Why::TooFewUp {
                up: 1,
                min_healthy: 2
            })
        );
        assert_eq!(
            verdict(&node(Some(10), false), 0, 1),
            Err(Why::TooFewUp {
                up: 0,
                min_healthy: 1
            })
        );
        assert_eq!(
            verdict(&node(Some(2), false), 3, 1),
            Err(Why::WarmingUp { left: 3 * SECOND })
        );
        // The warm-up ends exactly at `warmup`.
        assert_eq!(verdict(&node(Some(5), false), 3, 1), Ok(()));
        // Learning the cluster's flows holds the announcement past the warm-up.
        let learning = NodeView {
            learning: true,
            ..node(Some(10), false)
        };
        assert_eq!(verdict(&learning, 3, 1), Err(Why::Learning));
    }

    #[test]
    fn the_most_useful_reason_comes_first() {
        // Drained beats everything else: it is what the operator asked for.
        assert_eq!(verdict(&node(Some(1), true), 0, 1), Err(Why::Drained));
        // Health before warm-up: the warm-up ends by itself, health may not.
        assert_eq!(
            verdict(&node(Some(1), false), 0, 1),
            Err(Why::TooFewUp {
                up: 0,
                min_healthy: 1
            })
        );
    }

    #[test]
    fn an_address_is_announced_while_any_of_its_vips_qualifies() {
        let a: IpAddr = "10.0.0.100".parse().unwrap();
        let b: IpAddr = "fd00::100".parse().unwrap();
        let serving = node(Some(10), false);
        // a:80 has no backend up but a:443 has: a is announced; b has none.
        let set = wanted(&serving, [(a, 0, 1), (a, 2, 1), (b, 1, 2)]);
        assert_eq!(set, BTreeSet::from([a]));
        assert!(wanted(&node(Some(10), true), [(a, 3, 1), (b, 3, 1)]).is_empty());
        assert!(wanted(&node(Some(1), false), [(a, 3, 1)]).is_empty());
        assert_eq!(
            wanted(&serving, [(a, 3, 1), (b, 3, 1)]),
            BTreeSet::from([a, b])
        );
    }

    #[test]
    fn reasons_read_well() {
        assert_eq!(
            Why::TooFewUp {
                up: 0,
                min_healthy: 2
            }
            .to_string(),
            "0 backend(s) up, fewer than min_healthy 2"
        );
        assert_eq!(
            Why::WarmingUp {
                left: Duration::from_millis(2500)
            }
            .to_string(),
            "warming up (2.5s left)"
        );
    }

    /// A model with one VIP "web" 10.0.0.100:80/tcp and two unchecked backends.
    fn model() -> crate::model::Model {
        let config = crate::config::Config::from_toml(
            "[dataplane]\ninterface = \"eth0\"\nmaglev_table_size = 7\n\
             [[vip]]\nname = \"web\"\naddress = \"10.0.0.100\"\nport = 80\n\
             protocol = \"tcp\"\n[vip.health]\nkind = \"none\"\n\
             [[vip.backend]]\naddress = \"10.0.0.11\"\nmac = \"02:00:00:00:00:01\"\n\
             [[vip.backend]]\naddress = \"10.0.0.12\"\nmac = \"02:00:00:00:00:02\"\n",
        )
        .unwrap();
        let mut model = crate::model::Model::new(7, 16, Duration::ZERO);
        model.update(&config).unwrap();
        model
    }

    #[test]
    fn status_says_whether_and_why_a_vip_is_announced() {
        let model = model();
        let mut state = State::default();
        let now = Instant::now();
        let none = View {
            config: None,
            vips: &model.vips,
            state: &state,
        };
        let (announced, text) = describe_vip(&none, &model.vips[0], now);
        assert!(!announced);
        assert_eq!(text, "not announced: no [announce] section");
        assert_eq!(node_status(&none, now), NodeStatus::default());

        let config = AnnounceConfig::default();
        state.enabled = true;
        state.serving_since = Some(now - 2 * SECOND);
        let describe = |state: &State| {
            let view = View {
                config: Some(&config),
                vips: &model.vips,
                state,
            };
            describe_vip(&view, &model.vips[0], now)
        };
        let wanted = |state: &State| {
            let view = View {
                config: Some(&config),
                vips: &model.vips,
                state,
            };
            wanted_now(&view, now)
        };
        assert_eq!(
            describe(&state),
            (false, "withdrawn: warming up (3.0s left)".to_string())
        );
        state.serving_since = Some(now - 10 * SECOND);
        assert_eq!(describe(&state), (false, "announcing".to_string()));
        let vip: IpAddr = "10.0.0.100".parse().unwrap();
        assert_eq!(wanted(&state), BTreeSet::from([vip]));
        state.installed.insert(vip);
        assert_eq!(describe(&state), (true, "announced".to_string()));
        state.drained = true;
        assert!(wanted(&state).is_empty());
        assert_eq!(
            describe(&state),
            (
                true,
                "announced for another VIP of this address; this one: the node is drained \
                 (lb node ready undoes it)"
                    .to_string()
            )
        );
        let view = View {
            config: Some(&config),
            vips: &model.vips,
            state: &state,
        };
        let node = node_status(&view, now);
        assert!(node.announcing && node.drained);
        assert_eq!(node.announced, ["10.0.0.100"]);
        assert_eq!((node.table, node.warmup_left_seconds), (Some(4242), 0.0));
    }
}
