//! The agent's configuration file (TOML), as documented in product.md "Configuration".
//!
//! Parsing and validation are separate steps so that `lb check`, startup and a reload
//! all reject a bad file the same way, before anything in the data path changes.
//! Every validation error names the field by its path (`vip[1].backend[0].weight`),
//! because that is what a user needs to find the mistake.

use std::collections::HashMap;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Most VIPs one agent serves; the data path's maps are sized for this.
pub const MAX_VIPS: usize = lb_common::MAX_VIPS as usize;
/// Most backends over all VIPs together; the data path's maps are sized for this.
pub const MAX_BACKENDS: usize = lb_common::MAX_BACKENDS as usize;
/// Highest backend weight. Weights are relative; 1..=1000 is fine-grained enough for
/// any split and keeps weighted table population cheap.
pub const MAX_WEIGHT: u32 = 1000;

/// Smallest accepted `dataplane.maglev_table_size`.
pub const MIN_MAGLEV_TABLE_SIZE: u32 = 7;
/// Largest accepted `dataplane.maglev_table_size`: the smallest prime above 2^22
/// (16 MiB per table of u32 slots). Far more slots than [`MAX_BACKENDS`] already
/// balance evenly; larger tables would only cost map memory and rebuild time.
pub const MAX_MAGLEV_TABLE_SIZE: u32 = 4_194_319;

/// Linux interface names are at most IFNAMSIZ - 1 bytes.
const MAX_INTERFACE_NAME: usize = 15;

/// Largest configuration file read: a real one is a few KiB (a thousand backends are
/// about 60 KiB), and a file is read only this far, so a wrong path (a log, a device
/// such as /dev/zero) is refused at once instead of being read without end.
pub const MAX_CONFIG_BYTES: u64 = 4 * 1024 * 1024;

/// Shortest duration a setting accepts: below it, timers would spin.
pub const MIN_DURATION: Duration = Duration::from_millis(10);
/// Longest duration a setting accepts: beyond it, a timer that never fires in practice
/// (a typo such as `interval = "100000000000days"`) silently stops what it paces.
pub const MAX_DURATION: Duration = Duration::from_secs(24 * 60 * 60);

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "{path} is larger than {limit} bytes: not a configuration file (a real one is a few KiB)"
    )]
    TooLarge { path: PathBuf, limit: u64 },
    #[error("{0}")]
    Parse(String),
    #[error("`{field}`: {reason}")]
    Invalid { field: String, reason: String },
}

fn invalid(field: impl Into<String>, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field: field.into(),
        reason: reason.into(),
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub dataplane: DataplaneConfig,
    #[serde(default)]
    pub control: ControlConfig,
    /// Announcing VIPs to routers through a routing daemon (several nodes behind ECMP).
    /// Absent (the default): nothing is announced.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub announce: Option<AnnounceConfig>,
    /// Sharing connection-table entries with other nodes that serve the same VIPs.
    /// Absent (the default): nothing is shared, and the data path exports nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster: Option<ClusterConfig>,
    /// Debugging aids, off by default.
    #[serde(default)]
    pub debug: DebugConfig,
    /// Empty is valid: an agent can start with nothing to serve yet.
    #[serde(rename = "vip", default)]
    pub vips: Vec<VipConfig>,
}

/// `[debug]`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DebugConfig {
    /// Write frames of TCP packets that missed the connection table without a SYN (flows
    /// the balancer did not know) to this pcap file. Absent: no capture.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capture: Option<PathBuf>,
    /// Most frames captured per second per CPU (default 10).
    #[serde(default = "default_capture_rate")]
    pub capture_rate: u64,
}

fn default_capture_rate() -> u64 {
    10
}

impl Default for DebugConfig {
    fn default() -> Self {
        Self {
            capture: None,
            capture_rate: default_capture_rate(),
        }
    }
}

impl DebugConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        if let Some(path) = &self.capture
            && !path.is_absolute()
        {
            return Err(invalid(
                "debug.capture",
                format!("{} is not an absolute path", path.display()),
            ));
        }
        if self.capture_rate == 0 {
            return Err(invalid(
                "debug.capture_rate",
                "must be at least 1 (remove `capture` to turn it off)",
            ));
        }
        Ok(())
    }

    /// Frames per second per CPU the program copies: 0 unless a capture file is set.
    pub fn program_rate(&self) -> u64 {
        if self.capture.is_some() {
            self.capture_rate
        } else {
            0
        }
    }
}

/// `[announce]`: the agent keeps one route per VIP address it serves in a kernel routing
/// table of its own, through a device of its own; a routing daemon (BIRD's `protocol
/// kernel` with `learn`) imports that table and announces the routes over BGP. See
/// `announce.rs` for when a VIP is announced.
/// `[cluster]`: nodes that serve the same VIPs send each other the connection-table
/// entries they create (authenticated UDP), so a flow that the routers move to another
/// node keeps its backend whatever changed since it began. See `cluster.rs`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterConfig {
    /// The other nodes' addresses (this node's own may be listed too: it is skipped).
    pub peers: Vec<IpAddr>,
    /// The port, the same on every node: UDP for the new entries, TCP for the
    /// transfer of a table to a node that joins.
    #[serde(default = "default_cluster_port")]
    pub port: u16,
    /// The shared secret (at least 16 bytes; owned by root, mode 0600).
    pub key_file: PathBuf,
    /// The address the socket binds and sends from. Default: the first address of
    /// `dataplane.interface` in the peers' family.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<IpAddr>,
    /// A node that starts with an empty connection table learns its peers' and
    /// announces its VIPs (`[announce]`) only once every peer's table came; a peer from
    /// which nothing came for this long (silent, or stalled) is given up. A transfer
    /// that keeps delivering is never cut by it.
    #[serde(default = "default_learn_timeout", with = "duration")]
    pub learn_timeout: Duration,
    /// The most entries per second this node sends a joining peer (its table, over TCP):
    /// what a join may cost this node. Default 250,000 (100,000 entries in 0.4 s).
    #[serde(default = "default_transfer_rate")]
    pub transfer_rate: u64,
}

fn default_transfer_rate() -> u64 {
    250_000
}

fn default_cluster_port() -> u16 {
    4790
}

fn default_learn_timeout() -> Duration {
    Duration::from_secs(3)
}

impl ClusterConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        if self.port == 0 {
            return Err(invalid("cluster.port", "port 0 is not a fixed port"));
        }
        if !self.key_file.is_absolute() {
            return Err(invalid(
                "cluster.key_file",
                format!("{} is not an absolute path", self.key_file.display()),
            ));
        }
        check_duration("cluster.learn_timeout", self.learn_timeout)?;
        if self.transfer_rate < 1000 {
            return Err(invalid(
                "cluster.transfer_rate",
                format!(
                    "{} entries per second: at least 1000 (a join would take too long)",
                    self.transfer_rate
                ),
            ));
        }
        for (i, peer) in self.peers.iter().enumerate() {
            if peer.is_unspecified() || peer.is_loopback() || peer.is_multicast() {
                return Err(invalid(
                    format!("cluster.peers[{i}]"),
                    format!("{peer} is not a node's address"),
                ));
            }
            if self.peers[..i].contains(peer) {
                return Err(invalid(
                    format!("cluster.peers[{i}]"),
                    format!("{peer} is listed twice"),
                ));
            }
        }
        let families: std::collections::HashSet<bool> =
            self.peers.iter().map(IpAddr::is_ipv4).collect();
        if families.len() > 1 {
            return Err(invalid(
                "cluster.peers",
                "mixes IPv4 and IPv6 addresses; the nodes talk over one family",
            ));
        }
        if let (Some(address), Some(peer)) = (self.address, self.peers.first())
            && address.is_ipv4() != peer.is_ipv4()
        {
            return Err(invalid(
                "cluster.address",
                format!("{address} is not of the peers' address family"),
            ));
        }
        Ok(())
    }

    /// The settings a reload may not change: all but the peers.
    fn fixed(&self) -> ClusterConfig {
        ClusterConfig {
            peers: Vec::new(),
            ..self.clone()
        }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct AnnounceConfig {
    /// The kernel routing table (no lookup uses it: only the routing daemon reads it).
    pub table: u32,
    /// The routes' protocol number (`proto` in `ip route`, `krt_source` in BIRD).
    pub protocol: u8,
    /// How long after the agent starts serving before it announces anything, so that
    /// health checks and neighbour resolution settle first.
    #[serde(with = "duration")]
    pub warmup: Duration,
    /// The tun device the routes point at. The agent creates it and holds it open: when
    /// the agent dies, the kernel deletes the device and its routes, and the VIPs are
    /// withdrawn without the agent's help.
    pub device: String,
}

impl Default for AnnounceConfig {
    fn default() -> Self {
        AnnounceConfig {
            table: 4242,
            protocol: 249,
            warmup: Duration::from_secs(5),
            device: "lb-vips".into(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DataplaneConfig {
    /// The interface, or the first of `interfaces`: the one whose MAC, addresses and
    /// pins are the data path's own (tunnel sources, health checks, `pin_dir`).
    /// Serialized as `interfaces`, which then always holds it.
    #[serde(default, skip_serializing)]
    pub interface: String,
    /// Every interface the program is attached to, `interface` first; a frame leaves by
    /// the one that reaches its backend. Given as `interface = "x"` (one) or
    /// `interfaces = [..]`; `Config::from_toml` fills both.
    #[serde(default)]
    pub interfaces: Vec<String>,
    #[serde(default)]
    pub xdp_mode: XdpModeSetting,
    #[serde(default = "default_maglev_table_size")]
    pub maglev_table_size: u32,
    #[serde(default = "default_conntrack_entries")]
    pub conntrack_entries: u32,
    /// A UDP flow not seen for this long is balanced afresh; a flow (TCP or UDP) not seen
    /// for this long no longer counts as active (draining completes without it).
    #[serde(default = "default_flow_idle_timeout", with = "duration")]
    pub flow_idle_timeout: Duration,
    /// Most connection-table entries one CPU creates per second (0: no limit). Above it,
    /// new flows still balance by the Maglev table but are not cached, so a SYN flood
    /// cannot evict established flows.
    #[serde(default = "default_conntrack_insert_limit")]
    pub conntrack_insert_limit: u64,
    /// Directory (on a bpffs) where the program's link and maps are pinned, so they
    /// outlive the agent and a restarted agent adopts them. Default: see `pin_dir`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pin_path: Option<PathBuf>,
    /// Outer source address of IPv4 tunnel packets (`forward = "ipip"|"gue"` to an IPv4
    /// backend). Default: an IPv4 address of the interface (see `Config::tunnel_source_for`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tunnel_source: Option<IpAddr>,
    /// The same for IPv6 backends.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tunnel_source6: Option<IpAddr>,
    /// A pinned XDP program (a host firewall) that the program tail-calls with every
    /// frame it passes (`dataplane::next`); re-opened at each reload.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_program: Option<PathBuf>,
}

impl DataplaneConfig {
    /// `pin_path`, else `/sys/fs/bpf/lb/<interface>` (with `-ns<inode>` appended when the
    /// agent runs in a network namespace other than the initial one, so agents in
    /// different namespaces never share pins).
    pub fn pin_dir(&self) -> PathBuf {
        if let Some(path) = &self.pin_path {
            return path.clone();
        }
        let inode = |path: &str| {
            std::fs::metadata(path)
                .map(|m| std::os::unix::fs::MetadataExt::ino(&m))
                .ok()
        };
        let ours = inode("/proc/self/ns/net");
        let name = match ours {
            Some(ours) if ours != inode("/proc/1/ns/net").unwrap_or(ours) => {
                format!("{}-ns{ours}", self.interface)
            }
            _ => self.interface.clone(),
        };
        PathBuf::from("/sys/fs/bpf/lb").join(name)
    }
}

impl DataplaneConfig {
    /// Each of `interfaces` a name, none twice, at most `MAX_EGRESS`.
    fn validate_interfaces(&self) -> Result<(), ConfigError> {
        let field = "dataplane.interfaces";
        if self.interfaces.len() > lb_common::MAX_EGRESS as usize {
            return Err(invalid(
                field,
                format!(
                    "{} interfaces; the data path serves at most {}",
                    self.interfaces.len(),
                    lb_common::MAX_EGRESS
                ),
            ));
        }
        for (i, name) in self.interfaces.iter().enumerate() {
            if let Some(why) = bad_interface_name(name) {
                return Err(invalid(field, why));
            }
            if self.interfaces[..i].contains(name) {
                return Err(invalid(field, format!("{name:?} is listed twice")));
            }
        }
        Ok(())
    }

    /// Several interfaces: frames may leave by another than they came in by.
    pub fn several_interfaces(&self) -> bool {
        self.interfaces.len() > 1
    }
}

fn default_flow_idle_timeout() -> Duration {
    Duration::from_secs(30)
}

fn default_conntrack_insert_limit() -> u64 {
    100_000
}

fn default_maglev_table_size() -> u32 {
    lb_common::DEFAULT_MAGLEV_SIZE
}

fn default_conntrack_entries() -> u32 {
    lb_common::DEFAULT_CONNTRACK_ENTRIES
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum XdpModeSetting {
    Native,
    Generic,
    /// Native if the driver supports it, else generic.
    #[default]
    Auto,
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ControlConfig {
    pub socket: PathBuf,
    /// `None` when the file says `metrics = "off"` (or `""`).
    #[serde(with = "metrics_addr")]
    pub metrics: Option<SocketAddr>,
    /// The group whose members may read status through the operators' socket (which
    /// answers status and explain and refuses changes); absent: no such socket.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub operators_group: Option<String>,
    /// Where the operators' socket is; see [`ControlConfig::operators_socket`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub operators_socket: Option<PathBuf>,
    /// Where runtime changes are kept across restarts; see [`Config::state_file`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub state_file: Option<PathBuf>,
}

impl Default for ControlConfig {
    fn default() -> Self {
        ControlConfig {
            socket: PathBuf::from("/run/lb/lb.sock"),
            metrics: Some(SocketAddr::from((Ipv4Addr::LOCALHOST, 9650))),
            operators_group: None,
            operators_socket: None,
            state_file: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct VipConfig {
    pub name: String,
    pub address: IpAddr,
    pub port: u16,
    pub protocol: Protocol,
    #[serde(default)]
    pub hash: HashMode,
    #[serde(default = "default_drain_timeout", with = "duration")]
    pub drain_timeout: Duration,
    #[serde(default)]
    pub health: HealthConfig,
    /// With `[announce]`: announced only while at least this many backends take new
    /// flows (admin ready, MAC known, not failed by health checks).
    #[serde(default = "default_min_healthy")]
    pub min_healthy: u32,
    /// A backend that becomes usable (comes up, leaves maint or drain, is added) ramps
    /// from a tenth of its weight to all of it over this time.
    #[serde(
        default,
        with = "option_duration",
        skip_serializing_if = "Option::is_none"
    )]
    pub slow_start: Option<Duration>,
    /// How new flows are shared: by the Maglev table over the weights, or re-weighted
    /// from each backend's live flows ("least-flows").
    #[serde(default)]
    pub balance: Balance,
    /// With `hash = "src-ip"`: a source above this share of the VIP's new flows is
    /// balanced per connection (5-tuple) until it falls below it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hot_source_share: Option<f64>,
    /// The backends report their own weight and state (HAProxy's agent-check words).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<AgentCheckConfig>,
    /// Passive health: backends judged by the TCP handshakes of real clients.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outlier: Option<OutlierConfig>,
    /// How packets reach the backends: MAC rewrite on the segment, or a tunnel.
    #[serde(default)]
    pub forward: Forward,
    /// `forward = "gue"`: the UDP port the backends decapsulate on (default
    /// [`DEFAULT_GUE_PORT`]; see [`VipConfig::gue_port`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gue_port: Option<u16>,
    /// UDP VIPs: QUIC short-header packets go to the backend whose `server_id` their
    /// destination connection ID carries (QUIC-LB plaintext), whatever their source
    /// address and port (docs/src/operations/quic.md).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub quic: bool,
    /// With `quic`: bytes of server ID after the connection ID's first octet (1..=15;
    /// default [`DEFAULT_QUIC_SERVER_ID_LEN`]; see [`VipConfig::quic_server_id_len`]).
    #[serde(
        default,
        rename = "quic_server_id_len",
        skip_serializing_if = "Option::is_none"
    )]
    pub quic_server_id_len_setting: Option<u32>,
    /// A VIP may start with no backends; they can be added at run time.
    #[serde(rename = "backend", default)]
    pub backends: Vec<BackendConfig>,
}

/// `forward`: how a packet for the VIP reaches its backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Forward {
    /// Direct server return by MAC rewrite: every backend on the interface's segment.
    #[default]
    L2,
    /// IP-in-IP (IPv4 or IPv6 outer header by the backend's address family) to the
    /// backend, through its route's next hop.
    Ipip,
    /// GUE (the "direct IP" variant 1, as Linux fou uses it) over UDP to `gue_port`.
    Gue,
}

impl Forward {
    /// Through a tunnel: the backend may be anywhere a route leads.
    pub fn is_tunnel(self) -> bool {
        self != Forward::L2
    }
}

/// `gue_port` when not given: `lb decap attach`'s default port too.
pub const DEFAULT_GUE_PORT: u16 = lb_common::decap::DEFAULT_GUE_PORT;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Deserialize, Serialize)]
pub enum Balance {
    #[default]
    #[serde(rename = "maglev")]
    Maglev,
    #[serde(rename = "least-flows")]
    LeastFlows,
}

/// `[vip.agent]`: each backend answers one line on `port` (HAProxy agent-check words:
/// "75%", "drain", "ready", "maint", "down", "up").
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct AgentCheckConfig {
    pub port: u16,
    #[serde(default = "default_agent_interval", with = "duration")]
    pub interval: Duration,
    #[serde(default = "default_agent_timeout", with = "duration")]
    pub timeout: Duration,
}

fn default_agent_interval() -> Duration {
    Duration::from_secs(2)
}

fn default_agent_timeout() -> Duration {
    Duration::from_secs(1)
}

/// How often passive health reads the handshake counters: a `[vip.outlier]` window holds
/// at least two readings.
pub const OUTLIER_SAMPLE: Duration = Duration::from_millis(500);

/// `[vip.outlier]` (TCP VIPs): a backend whose clients' handshakes fail, beyond its peers',
/// leaves the table for a while (`health::outlier` judges).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct OutlierConfig {
    /// Handshakes are counted over this sliding window.
    #[serde(default = "default_outlier_window", with = "duration")]
    pub window: Duration,
    /// Fewer handshakes judged in the window: the backend is not judged.
    #[serde(default = "default_min_handshakes")]
    pub min_handshakes: u64,
    /// Ejected above this share of handshakes not completed.
    #[serde(default = "default_max_failure")]
    pub max_failure: f64,
    /// The first ejection lasts this long; each repeat one more of it.
    #[serde(default = "default_eject", with = "duration")]
    pub eject: Duration,
    /// Never more than this share of the VIP's backends ejected at once.
    #[serde(default = "default_max_ejected")]
    pub max_ejected: f64,
}

impl Default for OutlierConfig {
    fn default() -> Self {
        Self {
            window: default_outlier_window(),
            min_handshakes: default_min_handshakes(),
            max_failure: default_max_failure(),
            eject: default_eject(),
            max_ejected: default_max_ejected(),
        }
    }
}

fn default_outlier_window() -> Duration {
    Duration::from_secs(10)
}

fn default_min_handshakes() -> u64 {
    20
}

fn default_max_failure() -> f64 {
    0.5
}

fn default_eject() -> Duration {
    Duration::from_secs(30)
}

fn default_max_ejected() -> f64 {
    0.34
}

fn default_drain_timeout() -> Duration {
    Duration::from_secs(30)
}

fn default_min_healthy() -> u32 {
    1
}

impl VipConfig {
    /// The port health checks connect to on each backend.
    pub fn health_port(&self) -> u16 {
        self.health.port.unwrap_or(self.port)
    }

    /// The checks of `backend`: its own `[vip.backend.health]`, else the VIP's.
    pub fn health_of<'a>(&'a self, backend: &'a BackendConfig) -> &'a HealthConfig {
        backend.health.as_ref().unwrap_or(&self.health)
    }

    /// The port `backend` is checked on: its checks' port, else the VIP's port.
    pub fn health_port_of(&self, backend: &BackendConfig) -> u16 {
        self.health_of(backend).port.unwrap_or(self.port)
    }

    /// `forward = "gue"`: the backends' decapsulation port.
    pub fn gue_port(&self) -> u16 {
        self.gue_port.unwrap_or(DEFAULT_GUE_PORT)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    Tcp,
    Udp,
}

impl Protocol {
    /// The IP protocol number, as the data path sees it in the IP header.
    pub fn number(self) -> u8 {
        match self {
            Protocol::Tcp => 6,
            Protocol::Udp => 17,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Deserialize, Serialize)]
pub enum HashMode {
    #[default]
    #[serde(rename = "5-tuple")]
    FiveTuple,
    #[serde(rename = "src-ip")]
    SrcIp,
}

/// `[vip.health] target`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum HealthTarget {
    /// The backend's own address (`port`, default the VIP's port).
    #[default]
    Backend,
    /// The VIP's address and port, delivered to the backend as its traffic is: a pass
    /// proves the backend holds the VIP and answers on the direct-return path.
    Vip,
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct HealthConfig {
    pub kind: HealthKind,
    #[serde(with = "duration")]
    pub interval: Duration,
    #[serde(with = "duration")]
    pub timeout: Duration,
    pub rise: u32,
    pub fall: u32,
    /// Interval while a backend is changing state (some but not yet `rise`/`fall`
    /// results towards the other state), so a decision comes sooner. Default: interval/4.
    #[serde(with = "option_duration", skip_serializing_if = "Option::is_none")]
    pub fast_interval: Option<Duration>,
    /// Interval while a backend is down and not recovering. Default: the interval.
    #[serde(with = "option_duration", skip_serializing_if = "Option::is_none")]
    pub down_interval: Option<Duration>,
    /// Defaults to the VIP's port; see [`VipConfig::health_port`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
    /// Kept as written (absent stays `None`) so the effective config prints what the
    /// user wrote; see [`HealthConfig::http_path`] for the default.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    pub expect_status: u16,
    /// Where checks go: the backend's own address, or the VIP (through this backend, the
    /// way its traffic goes).
    #[serde(default)]
    pub target: HealthTarget,
    /// `udp`: the datagram sent (text; default empty).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub send: Option<String>,
    /// `udp`: text the reply must contain (default: any reply passes).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expect: Option<String>,
    /// `dns`: the name asked (default ".").
    #[serde(skip_serializing_if = "Option::is_none")]
    pub query: Option<String>,
    /// `dns`: the record type asked (default "NS").
    #[serde(skip_serializing_if = "Option::is_none")]
    pub query_type: Option<String>,
    /// `https`: the name sent as SNI, and the one the certificate must be for (default:
    /// no SNI, and the certificate must be for the backend's address).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sni: Option<String>,
    /// `https`: whether the certificate is verified (default true); see
    /// [`HealthConfig::verify`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub verify: Option<bool>,
    /// `https`: the CA certificates (PEM) the backend's chain must lead to (default: the
    /// host's trust store).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<PathBuf>,
}

impl Default for HealthConfig {
    fn default() -> Self {
        HealthConfig {
            kind: HealthKind::Tcp,
            interval: Duration::from_secs(2),
            timeout: Duration::from_secs(1),
            rise: 2,
            fall: 3,
            fast_interval: None,
            down_interval: None,
            port: None,
            path: None,
            expect_status: 200,
            target: HealthTarget::Backend,
            send: None,
            expect: None,
            query: None,
            query_type: None,
            sni: None,
            verify: None,
            ca_file: None,
        }
    }
}

impl HealthConfig {
    /// The path an HTTP check requests.
    pub fn http_path(&self) -> &str {
        self.path.as_deref().unwrap_or("/")
    }

    /// Whether an https check verifies the backend's certificate (`verify`, default true).
    pub fn verify(&self) -> bool {
        self.verify.unwrap_or(true)
    }

    /// Whether the check sends an HTTP request (`http`, or `https` after TLS).
    pub fn is_http(&self) -> bool {
        matches!(self.kind, HealthKind::Http | HealthKind::Https)
    }

    /// See `fast_interval`.
    pub fn fast_interval(&self) -> Duration {
        self.fast_interval.unwrap_or(self.interval / 4)
    }

    /// See `down_interval`.
    pub fn down_interval(&self) -> Duration {
        self.down_interval.unwrap_or(self.interval)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum HealthKind {
    #[default]
    Tcp,
    Http,
    /// TLS (`sni`, `verify`, `ca_file`), then the request of an `http` check.
    Https,
    /// A datagram (`send`); a reply (containing `expect`) passes, ICMP port unreachable
    /// fails at once.
    Udp,
    /// A DNS query (`query`, `query_type`) over UDP; a well-formed NOERROR answer passes.
    Dns,
    /// No checks: backends count as up unless their admin state says otherwise.
    None,
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct BackendConfig {
    pub address: IpAddr,
    #[serde(default = "default_weight")]
    pub weight: u32,
    /// When absent the agent resolves it from the neighbour table.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mac: Option<MacAddr>,
    #[serde(default)]
    pub state: AdminState,
    /// `[vip.backend.health]`: this backend's checks instead of the VIP's (fields left
    /// out take the defaults, not the VIP's values).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health: Option<HealthConfig>,
    /// With the VIP's `quic`: the server ID this backend writes into the connection
    /// IDs it issues (big-endian, in the VIP's `quic_server_id_len` bytes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_id: Option<u64>,
}

/// `quic_server_id_len` when a `quic` VIP does not say.
pub const DEFAULT_QUIC_SERVER_ID_LEN: u32 = 2;

fn default_weight() -> u32 {
    1
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum AdminState {
    #[default]
    Ready,
    Drain,
    Maint,
}

/// The strings must match the serde names above; `display_matches_serde` checks it.
macro_rules! display_as {
    ($ty:ty { $($variant:ident => $text:literal),+ $(,)? }) => {
        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                // `pad`, so that widths (`{:<8}`) apply.
                f.pad(match self {
                    $(Self::$variant => $text),+
                })
            }
        }
    };
}

display_as!(XdpModeSetting { Native => "native", Generic => "generic", Auto => "auto" });
display_as!(Protocol { Tcp => "tcp", Udp => "udp" });
display_as!(HashMode { FiveTuple => "5-tuple", SrcIp => "src-ip" });
display_as!(HealthKind { Tcp => "tcp", Http => "http", Https => "https", Udp => "udp", Dns => "dns", None => "none" });
display_as!(AdminState { Ready => "ready", Drain => "drain", Maint => "maint" });
display_as!(Balance { Maglev => "maglev", LeastFlows => "least-flows" });
display_as!(HealthTarget { Backend => "backend", Vip => "vip" });
display_as!(Forward { L2 => "l2", Ipip => "ipip", Gue => "gue" });

/// An Ethernet address, written `02:00:00:00:00:0b`.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct MacAddr(pub [u8; 6]);

impl MacAddr {
    fn is_multicast(self) -> bool {
        // The I/G bit; the broadcast address has it set too.
        self.0[0] & 1 == 1
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid MAC address {0:?}: expected six two-digit hex octets like \"02:00:00:00:00:0b\"")]
pub struct ParseMacError(String);

impl FromStr for MacAddr {
    type Err = ParseMacError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let error = || ParseMacError(text.to_owned());
        let mut octets = [0u8; 6];
        let mut parts = text.split(':');
        for octet in &mut octets {
            let part = parts.next().ok_or_else(error)?;
            // from_str_radix alone would accept "+f" or a single digit.
            if part.len() != 2 || !part.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(error());
            }
            *octet = u8::from_str_radix(part, 16).map_err(|_| error())?;
        }
        if parts.next().is_some() {
            return Err(error());
        }
        Ok(MacAddr(octets))
    }
}

impl fmt::Display for MacAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let [a, b, c, d, e, g] = self.0;
        write!(f, "{a:02x}:{b:02x}:{c:02x}:{d:02x}:{e:02x}:{g:02x}")
    }
}

impl fmt::Debug for MacAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl Serialize for MacAddr {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for MacAddr {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// Durations as humantime strings ("500ms", "2s", "1m").
mod duration {
    use std::fmt;
    use std::time::Duration;

    use serde::de::{self, Visitor};
    use serde::{Deserializer, Serializer};

    pub fn serialize<S: Serializer>(value: &Duration, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(&humantime::format_duration(*value))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Duration, D::Error> {
        deserializer.deserialize_str(DurationVisitor)
    }

    struct DurationVisitor;

    // A visitor rather than String::deserialize so that `interval = 2` is reported
    // as "expected a duration such as ...", not "expected a string".
    impl Visitor<'_> for DurationVisitor {
        type Value = Duration;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a duration such as \"500ms\", \"2s\" or \"1m\"")
        }

        fn visit_str<E: de::Error>(self, text: &str) -> Result<Duration, E> {
            humantime::parse_duration(text).map_err(|e| {
                E::custom(format!(
                    "invalid duration {text:?} ({e}); write e.g. \"500ms\", \"2s\" or \"1m\""
                ))
            })
        }
    }
}

/// An optional duration, written like `duration`.
mod option_duration {
    use std::time::Duration;

    use serde::{Deserializer, Serializer};

    pub fn serialize<S: Serializer>(
        value: &Option<Duration>,
        serializer: S,
    ) -> Result<S::Ok, S::Error> {
        match value {
            Some(d) => super::duration::serialize(d, serializer),
            None => serializer.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<Option<Duration>, D::Error> {
        super::duration::deserialize(deserializer).map(Some)
    }
}

/// `control.metrics`: an address, or "off" / "" to disable the endpoint.
mod metrics_addr {
    use std::net::SocketAddr;

    use serde::{Deserialize, Deserializer, Serializer, de};

    pub fn serialize<S: Serializer>(
        value: &Option<SocketAddr>,
        serializer: S,
    ) -> Result<S::Ok, S::Error> {
        match value {
            Some(addr) => serializer.collect_str(addr),
            // Written as "off" so that the printed config parses back to the same thing.
            None => serializer.serialize_str("off"),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<Option<SocketAddr>, D::Error> {
        let text = String::deserialize(deserializer)?;
        match text.as_str() {
            "" | "off" => Ok(None),
            _ => text.parse().map(Some).map_err(|_| {
                de::Error::custom(format!(
                    "invalid metrics address {text:?}: expected IP:PORT such as \
                     \"127.0.0.1:9650\" (IPv6: \"[::1]:9650\"), or \"off\""
                ))
            }),
        }
    }
}

/// A name as `query` is written: absolute or relative, "." for the root.
pub fn parse_name(text: &str) -> Result<hickory_proto::rr::Name, String> {
    hickory_proto::rr::Name::from_ascii(text)
        .map_err(|e| format!("{text:?} is not a DNS name: {e}"))
}

/// A record type as `query_type` is written ("A", "AAAA", "NS", "SOA" ...).
pub fn parse_record_type(text: &str) -> Result<hickory_proto::rr::RecordType, String> {
    text.to_ascii_uppercase()
        .parse::<hickory_proto::rr::RecordType>()
        .map_err(|_| format!("{text:?} is not a DNS record type (A, AAAA, NS, SOA, TXT ...)"))
}

/// Whether two configurations keep the same routes (table, protocol and device): the
/// announcer is set up once, so a reload must not change these.
pub fn same_routes(a: &Option<AnnounceConfig>, b: &Option<AnnounceConfig>) -> bool {
    let key =
        |c: &Option<AnnounceConfig>| c.as_ref().map(|c| (c.table, c.protocol, c.device.clone()));
    key(a) == key(b)
}

impl Config {
    /// Where the runtime changes (`lb drain`, `lb backend add` ...) are kept so that a
    /// restarted agent makes them again: `control.state_file`, else beside the control
    /// socket (`/run/lb/lb.state.json`): one per agent, and gone at a reboot with the
    /// pins, which hold the rest of the running state.
    pub fn state_file(&self) -> PathBuf {
        self.control
            .state_file
            .clone()
            .unwrap_or_else(|| self.control.socket.with_extension("state.json"))
    }

    /// Parses and validates a configuration file's text.
    pub fn from_toml(text: &str) -> Result<Config, ConfigError> {
        let mut config: Config = toml::from_str(text)
            .map_err(|e| ConfigError::Parse(e.to_string().trim_end().to_owned()))?;
        config.dataplane.settle_interfaces()?;
        config.validate()?;
        Ok(config)
    }

    /// Reads, parses and validates a configuration file. Parse and validation errors do
    /// not repeat the path; the caller knows it.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        use std::io::Read as _;
        let read_error = |source| ConfigError::Read {
            path: path.to_owned(),
            source,
        };
        let mut bytes = Vec::new();
        std::fs::File::open(path)
            .and_then(|file| file.take(MAX_CONFIG_BYTES + 1).read_to_end(&mut bytes))
            .map_err(read_error)?;
        if bytes.len() as u64 > MAX_CONFIG_BYTES {
            return Err(ConfigError::TooLarge {
                path: path.to_owned(),
                limit: MAX_CONFIG_BYTES,
            });
        }
        let text = String::from_utf8(bytes).map_err(|_| {
            read_error(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "not UTF-8 text",
            ))
        })?;
        Config::from_toml(&text)
    }

    /// The checks that need the host: no VIP and no backend may be an address of the
    /// balancer's own interface, where frames sent to it would come straight back.
    /// Run where the agent knows the addresses: at start and on every reload.
    pub fn validate_host(&self, interface_addresses: &[IpAddr]) -> Result<(), ConfigError> {
        for (i, vip) in self.vips.iter().enumerate() {
            if interface_addresses.contains(&vip.address) {
                // Its frames would be the balancer's own: its services on that port
                // would answer locally but be sent to backends for everyone else.
                return Err(invalid(
                    format!("vip[{i}].address"),
                    format!(
                        "{} is an address of dataplane.interface {} (this balancer): a VIP \
                         must be an address no host on the segment has (its packets to the \
                         balancer's own services would go to the backends)",
                        vip.address, self.dataplane.interface
                    ),
                ));
            }
            for (j, backend) in vip.backends.iter().enumerate() {
                if interface_addresses.contains(&backend.address) {
                    return Err(invalid(
                        format!("vip[{i}].backend[{j}].address"),
                        format!(
                            "{} is an address of dataplane.interface {} (this balancer): a \
                             backend must be another host on its segment",
                            backend.address, self.dataplane.interface
                        ),
                    ));
                }
                if vip.forward.is_tunnel() {
                    self.tunnel_source_for(backend.address, interface_addresses)
                        .map_err(|(field, why)| {
                            invalid(
                                field,
                                format!(
                                    "vip[{i}] ({:?}) forwards by {} to {} (vip[{i}].backend[{j}]): \
                                     {why}",
                                    vip.name, vip.forward, backend.address
                                ),
                            )
                        })?;
                }
            }
        }
        Ok(())
    }

    /// An `l2` backend must be a neighbour on `interface` (its frames go to its own MAC):
    /// unless its MAC is configured, its route must be on-link there. `on_link` says
    /// whether an address is, or else the route found (or why there is none).
    pub fn validate_routes(
        &self,
        on_link: impl Fn(IpAddr) -> Result<(), String>,
    ) -> Result<(), ConfigError> {
        let interface = self.dataplane.interfaces.join(" or ");
        for (i, vip) in self.vips.iter().enumerate() {
            if vip.forward.is_tunnel() {
                continue;
            }
            for (j, backend) in vip.backends.iter().enumerate() {
                if backend.mac.is_some() {
                    continue;
                }
                if let Err(route) = on_link(backend.address) {
                    return Err(invalid(
                        format!("vip[{i}].backend[{j}].address"),
                        format!(
                            "{} is not on-link on {interface} ({route}): forward = \"l2\" \
                             reaches only backends on the balancer's segment; a backend \
                             behind a router needs forward = \"ipip\" or \"gue\"",
                            backend.address
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    /// The outer source address of tunnel packets to `backend`: the configured
    /// `tunnel_source` (IPv4 backends) or `tunnel_source6`, else the interface's first
    /// address of that family (for IPv6 not a link-local one, which routers drop). Never
    /// made up: networks drop packets from addresses that are not the sender's. Err: the
    /// field to set, and why there is none.
    pub fn tunnel_source_for(
        &self,
        backend: IpAddr,
        interface_addresses: &[IpAddr],
    ) -> Result<IpAddr, (&'static str, String)> {
        let (field, configured) = match backend {
            IpAddr::V4(_) => ("dataplane.tunnel_source", self.dataplane.tunnel_source),
            IpAddr::V6(_) => ("dataplane.tunnel_source6", self.dataplane.tunnel_source6),
        };
        configured
            .or_else(|| {
                interface_addresses.iter().copied().find(|a| {
                    a.is_ipv4() == backend.is_ipv4()
                        && bad_tunnel_source(*a, backend.is_ipv4()).is_none()
                })
            })
            .ok_or_else(|| {
                let family = if backend.is_ipv4() { "IPv4" } else { "IPv6" };
                (
                    field,
                    format!(
                        "no {family} tunnel source: set {field}, or give {} an {family} \
                         address (it has none usable)",
                        self.dataplane.interface
                    ),
                )
            })
    }

    /// The first setting fixed at start that differs in `new`: a reload cannot apply it
    /// (the program was loaded, the maps sized, the sockets bound with the old value).
    pub fn restart_only_change(&self, new: &Config) -> Option<&'static str> {
        let (old, d, n) = (self, &self.dataplane, &new.dataplane);
        [
            ("dataplane.interface", d.interface != n.interface),
            ("dataplane.interfaces", d.interfaces != n.interfaces),
            ("dataplane.xdp_mode", d.xdp_mode != n.xdp_mode),
            (
                "dataplane.maglev_table_size",
                d.maglev_table_size != n.maglev_table_size,
            ),
            (
                "dataplane.conntrack_entries",
                d.conntrack_entries != n.conntrack_entries,
            ),
            (
                "dataplane.flow_idle_timeout",
                d.flow_idle_timeout != n.flow_idle_timeout,
            ),
            (
                "dataplane.conntrack_insert_limit",
                d.conntrack_insert_limit != n.conntrack_insert_limit,
            ),
            ("dataplane.pin_path", d.pin_path != n.pin_path),
            ("debug", old.debug != new.debug),
            ("control.socket", old.control.socket != new.control.socket),
            (
                "control.operators_group",
                old.control.operators_group != new.control.operators_group,
            ),
            (
                "control.operators_socket",
                old.control.operators_socket != new.control.operators_socket,
            ),
            (
                "control.state_file",
                old.control.state_file != new.control.state_file,
            ),
            // The endpoint is bound once, at start.
            (
                "control.metrics",
                old.control.metrics != new.control.metrics,
            ),
            (
                "announce (table, protocol, device)",
                !same_routes(&old.announce, &new.announce),
            ),
            // The program exports entries only if loaded with `[cluster]`; the socket
            // and key are set up once. The peers may change.
            (
                "cluster (all but peers)",
                old.cluster.as_ref().map(ClusterConfig::fixed)
                    != new.cluster.as_ref().map(ClusterConfig::fixed),
            ),
        ]
        .into_iter()
        .find_map(|(field, changed)| changed.then_some(field))
    }

    /// Checks everything serde cannot: ranges, cross-field and cross-VIP rules.
    /// Reports the first problem found, in file order.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.dataplane.validate()?;
        self.control.validate()?;
        self.debug.validate()?;
        if let Some(announce) = &self.announce {
            announce.validate(&self.dataplane.interface)?;
        }
        if let Some(cluster) = &self.cluster {
            cluster.validate()?;
        }

        if self.vips.len() > MAX_VIPS {
            return Err(invalid(
                "vip",
                format!("{} VIPs; at most {MAX_VIPS} are supported", self.vips.len()),
            ));
        }
        let mut names: HashMap<&str, usize> = HashMap::new();
        let mut services: HashMap<(IpAddr, u16, Protocol), usize> = HashMap::new();
        let vip_addresses: HashMap<IpAddr, usize> = self
            .vips
            .iter()
            .enumerate()
            .rev()
            .map(|(i, vip)| (vip.address, i))
            .collect();
        let mut total_backends = 0;
        for (i, vip) in self.vips.iter().enumerate() {
            let at = format!("vip[{i}]");
            vip.validate(&at, self.dataplane.maglev_table_size)?;
            for (j, backend) in vip.backends.iter().enumerate() {
                if let Some(&k) = vip_addresses.get(&backend.address) {
                    return Err(invalid(
                        format!("{at}.backend[{j}].address"),
                        format!(
                            "{} is the address of vip[{k}] ({:?}): a backend is a server \
                             behind the balancer, not a VIP",
                            backend.address, self.vips[k].name
                        ),
                    ));
                }
            }

            if let Some(first) = names.insert(&vip.name, i) {
                return Err(invalid(
                    format!("{at}.name"),
                    format!("{:?} is already the name of vip[{first}]", vip.name),
                ));
            }
            let service = (vip.address, vip.port, vip.protocol);
            if let Some(first) = services.insert(service, i) {
                return Err(invalid(
                    at,
                    format!(
                        "{} port {} {} is already served by vip[{first}] ({:?})",
                        vip.address, vip.port, vip.protocol, self.vips[first].name
                    ),
                ));
            }
            total_backends += vip.backends.len();
            if total_backends > MAX_BACKENDS {
                return Err(invalid(
                    format!("{at}.backend"),
                    format!(
                        "more than {MAX_BACKENDS} backends in total over all VIPs \
                         ({total_backends} up to this VIP)"
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// Why `name` cannot be a Linux interface name, if it cannot.
fn bad_interface_name(name: &str) -> Option<String> {
    if name.is_empty() {
        return Some("must not be empty".into());
    }
    if name.len() > MAX_INTERFACE_NAME {
        return Some(format!(
            "{name:?} is {} bytes; Linux interface names are at most {MAX_INTERFACE_NAME}",
            name.len()
        ));
    }
    if name.contains('/') || name.chars().any(char::is_whitespace) {
        return Some(format!(
            "{name:?} is not an interface name: it contains '/' or whitespace"
        ));
    }
    None
}

impl DataplaneConfig {
    /// Fills `interface` and `interfaces` from whichever of the two the file gives;
    /// refuses both, or neither.
    fn settle_interfaces(&mut self) -> Result<(), ConfigError> {
        match (self.interface.is_empty(), self.interfaces.first()) {
            (false, Some(_)) => Err(invalid(
                "dataplane.interfaces",
                "give `interface` (one) or `interfaces` (several), not both",
            )),
            (true, None) => Err(invalid(
                "dataplane.interface",
                "missing: name the data-path interface (or several, as `interfaces`)",
            )),
            (false, None) => {
                self.interfaces = vec![self.interface.clone()];
                Ok(())
            }
            (true, Some(first)) => {
                self.interface = first.clone();
                Ok(())
            }
        }
    }

    fn validate(&self) -> Result<(), ConfigError> {
        if let Some(why) = bad_interface_name(&self.interface) {
            return Err(invalid("dataplane.interface", why));
        }
        self.validate_interfaces()?;

        let size = self.maglev_table_size;
        if !(MIN_MAGLEV_TABLE_SIZE..=MAX_MAGLEV_TABLE_SIZE).contains(&size) {
            return Err(invalid(
                "dataplane.maglev_table_size",
                format!("{size} is outside {MIN_MAGLEV_TABLE_SIZE}..={MAX_MAGLEV_TABLE_SIZE}"),
            ));
        }
        // Maglev's permutations only cover the whole table when its size is prime.
        if !lb_common::maglev::is_prime(size) {
            return Err(invalid(
                "dataplane.maglev_table_size",
                format!("{size} is not a prime (65537 is the usual choice)"),
            ));
        }
        for (field, path) in [
            ("dataplane.pin_path", &self.pin_path),
            ("dataplane.next_program", &self.next_program),
        ] {
            if let Some(path) = path
                && !path.is_absolute()
            {
                return Err(invalid(
                    field,
                    format!("{} is not an absolute path", path.display()),
                ));
            }
        }
        check_duration("dataplane.flow_idle_timeout", self.flow_idle_timeout)?;
        for (field, source, v4) in [
            ("dataplane.tunnel_source", self.tunnel_source, true),
            ("dataplane.tunnel_source6", self.tunnel_source6, false),
        ] {
            if let Some(source) = source
                && let Some(why) = bad_tunnel_source(source, v4)
            {
                return Err(invalid(field, why));
            }
        }
        if self.conntrack_entries == 0 {
            return Err(invalid("dataplane.conntrack_entries", "must be at least 1"));
        }
        Ok(())
    }
}

impl ControlConfig {
    /// The operators' socket, when `operators_group` asks for one: `operators_socket`,
    /// else `lb-operators.sock` beside `socket`.
    pub fn operators_socket(&self) -> Option<PathBuf> {
        self.operators_group.as_ref()?;
        Some(
            self.operators_socket
                .clone()
                .unwrap_or_else(|| self.socket.with_file_name("lb-operators.sock")),
        )
    }

    fn validate(&self) -> Result<(), ConfigError> {
        if let Some(path) = &self.operators_socket {
            if self.operators_group.is_none() {
                return Err(invalid(
                    "control.operators_socket",
                    "needs control.operators_group: the group that may open it",
                ));
            }
            if !path.is_absolute() {
                return Err(invalid(
                    "control.operators_socket",
                    format!("{} is not an absolute path", path.display()),
                ));
            }
            if *path == self.socket {
                return Err(invalid(
                    "control.operators_socket",
                    "is control.socket: the operators' socket must be a path of its own",
                ));
            }
        }
        if let Some(path) = &self.state_file
            && !path.is_absolute()
        {
            return Err(invalid(
                "control.state_file",
                format!("{} is not an absolute path", path.display()),
            ));
        }
        if let Some(group) = &self.operators_group
            && (group.is_empty() || group.contains(|c: char| c == ':' || c.is_whitespace()))
        {
            return Err(invalid(
                "control.operators_group",
                format!("{group:?} is not a group name"),
            ));
        }
        // The agent may change directory; a relative socket path would then point
        // somewhere else than the one the CLI connects to.
        if !self.socket.is_absolute() {
            return Err(invalid(
                "control.socket",
                format!("{} is not an absolute path", self.socket.display()),
            ));
        }
        if let Some(addr) = self.metrics
            && addr.port() == 0
        {
            return Err(invalid(
                "control.metrics",
                format!("{addr}: port 0 is not a fixed port; use \"off\" to disable metrics"),
            ));
        }
        Ok(())
    }
}

impl AnnounceConfig {
    fn validate(&self, data_interface: &str) -> Result<(), ConfigError> {
        // 0 is no table; 253, 254 and 255 are the kernel's default, main and local tables,
        // where a route to the device would take the VIP's traffic on this host.
        if matches!(self.table, 0 | 253..=255) {
            return Err(invalid(
                "announce.table",
                format!(
                    "{} is a table the kernel uses (0 unspec, 253 default, 254 main, \
                     255 local); give the announced routes a table of their own, e.g. 4242",
                    self.table
                ),
            ));
        }
        // 0-4 are the kernel's own (unspec, redirect, kernel, boot, static); BIRD treats
        // routes with its own number (12) as its leftovers and deletes them.
        if self.protocol <= 4 || self.protocol == 12 {
            return Err(invalid(
                "announce.protocol",
                format!(
                    "{} is reserved (0-4 belong to the kernel, 12 to BIRD); the default is 249",
                    self.protocol
                ),
            ));
        }
        // 0: announce as soon as the VIPs qualify.
        if !self.warmup.is_zero() {
            check_duration("announce.warmup", self.warmup)?;
        }
        if let Some(why) = bad_interface_name(&self.device) {
            return Err(invalid("announce.device", why));
        }
        if self.device == data_interface {
            return Err(invalid(
                "announce.device",
                format!(
                    "{:?} is the data-path interface; the agent creates this device itself",
                    self.device
                ),
            ));
        }
        Ok(())
    }
}

impl VipConfig {
    fn validate(&self, at: &str, maglev_table_size: u32) -> Result<(), ConfigError> {
        if self.name.is_empty() {
            return Err(invalid(format!("{at}.name"), "must not be empty"));
        }
        // Names appear in metric labels, socket commands and logs unquoted.
        if !self
            .name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'))
        {
            return Err(invalid(
                format!("{at}.name"),
                format!(
                    "{:?} may only contain letters, digits, '_', '.' and '-'",
                    self.name
                ),
            ));
        }
        if let Some(why) = unusable_address(self.address) {
            return Err(invalid(format!("{at}.address"), why));
        }
        if self.port == 0 {
            return Err(invalid(format!("{at}.port"), "must not be 0"));
        }
        check_duration(&format!("{at}.drain_timeout"), self.drain_timeout)?;
        if let Some(port) = self.gue_port {
            if self.forward != Forward::Gue {
                return Err(invalid(
                    format!("{at}.gue_port"),
                    format!(
                        "only used with forward = \"gue\" (forward is \"{}\")",
                        self.forward
                    ),
                ));
            }
            if port == 0 {
                return Err(invalid(format!("{at}.gue_port"), "must not be 0"));
            }
        }
        self.health.validate(&format!("{at}.health"))?;
        if self.min_healthy == 0 {
            return Err(invalid(
                format!("{at}.min_healthy"),
                "must be at least 1: a VIP without a backend to send to must not attract traffic",
            ));
        }
        self.validate_load(at)?;
        self.validate_outlier(at)?;
        self.validate_quic(at)?;

        if self.backends.len() >= maglev_table_size as usize {
            return Err(invalid(
                format!("{at}.backend"),
                format!(
                    "{} backends need a dataplane.maglev_table_size larger than that (it is {})",
                    self.backends.len(),
                    maglev_table_size
                ),
            ));
        }
        let mut seen: HashMap<IpAddr, usize> = HashMap::new();
        for (j, backend) in self.backends.iter().enumerate() {
            if let Some(first) = seen.insert(backend.address, j) {
                return Err(invalid(
                    format!("{at}.backend[{j}].address"),
                    format!(
                        "{} is already backend[{first}] of this VIP",
                        backend.address
                    ),
                ));
            }
            self.validate_backend(&format!("{at}.backend[{j}]"), backend)?;
        }
        Ok(())
    }

    /// `quic`, `quic_server_id_len` and the backends' `server_id`s: a UDP VIP's, each
    /// backend with an ID of its own that fits the length.
    fn validate_quic(&self, at: &str) -> Result<(), ConfigError> {
        if !self.quic {
            if self.quic_server_id_len_setting.is_some() {
                return Err(invalid(
                    format!("{at}.quic_server_id_len"),
                    "only used with quic = true",
                ));
            }
            if let Some(j) = self.backends.iter().position(|b| b.server_id.is_some()) {
                return Err(invalid(
                    format!("{at}.backend[{j}].server_id"),
                    "only used when the VIP has quic = true",
                ));
            }
            return Ok(());
        }
        if self.protocol != Protocol::Udp {
            return Err(invalid(
                format!("{at}.quic"),
                format!(
                    "QUIC runs over UDP: the VIP's protocol is \"{}\"",
                    self.protocol
                ),
            ));
        }
        let len = self.quic_server_id_len();
        if !(1..=lb_common::quic::MAX_SERVER_ID_LEN).contains(&len) {
            return Err(invalid(
                format!("{at}.quic_server_id_len"),
                format!("{len} is outside 1..=15 (bytes of server ID in a connection ID)"),
            ));
        }
        let mut seen: HashMap<u64, usize> = HashMap::new();
        for (j, backend) in self.backends.iter().enumerate() {
            let field = format!("{at}.backend[{j}].server_id");
            let Some(id) = backend.server_id else {
                return Err(invalid(
                    field,
                    "missing: every backend of a quic VIP needs the server ID it writes \
                     into its connection IDs",
                ));
            };
            if len < 8 && id >> (8 * len) != 0 {
                return Err(invalid(
                    field,
                    format!("{id} does not fit in quic_server_id_len = {len} bytes"),
                ));
            }
            if let Some(first) = seen.insert(id, j) {
                return Err(invalid(
                    field,
                    format!("{id} is already the server_id of backend[{first}] of this VIP"),
                ));
            }
        }
        Ok(())
    }

    /// Bytes of server ID in a `quic` VIP's connection IDs.
    pub fn quic_server_id_len(&self) -> u32 {
        self.quic_server_id_len_setting
            .unwrap_or(DEFAULT_QUIC_SERVER_ID_LEN)
    }

    /// One backend of this VIP (`at`: its field path), on its own.
    fn validate_backend(&self, at: &str, backend: &BackendConfig) -> Result<(), ConfigError> {
        // A tunnel's outer header takes the backend's family, whatever the VIP's.
        if backend.address.is_ipv4() != self.address.is_ipv4() && !self.forward.is_tunnel() {
            return Err(invalid(
                format!("{at}.address"),
                format!(
                    "{} is not of the same address family as the VIP {} (only a \
                     tunnel, forward = \"ipip\" or \"gue\", mixes the families)",
                    backend.address, self.address
                ),
            ));
        }
        if let Some(why) = unusable_address(backend.address) {
            return Err(invalid(format!("{at}.address"), why));
        }
        if backend.weight == 0 {
            return Err(invalid(
                format!("{at}.weight"),
                "0 is not allowed; to take a backend out of service set \
                 state = \"drain\" or \"maint\"",
            ));
        }
        if let Some(health) = &backend.health {
            health.validate(&format!("{at}.health"))?;
        }
        if backend.weight > MAX_WEIGHT {
            return Err(invalid(
                format!("{at}.weight"),
                format!("{} is above the maximum {MAX_WEIGHT}", backend.weight),
            ));
        }
        // Frames are rewritten to this MAC and sent out; a group address would
        // fan one flow out to many hosts.
        if backend.mac.is_some() && self.forward.is_tunnel() {
            return Err(invalid(
                format!("{at}.mac"),
                format!(
                    "only used with forward = \"l2\": a {} backend's frames go to \
                     the MAC of its route's next hop, which the agent resolves",
                    self.forward
                ),
            ));
        }
        if let Some(mac) = backend.mac
            && (mac.is_multicast() || mac.0 == [0; 6])
        {
            return Err(invalid(
                format!("{at}.mac"),
                format!("{mac} is not a unicast MAC address"),
            ));
        }
        Ok(())
    }
}

/// Why `source` cannot be the outer source of tunnel packets (`v4`: of IPv4 ones).
fn bad_tunnel_source(source: IpAddr, v4: bool) -> Option<String> {
    if source.is_ipv4() != v4 {
        let (want, other) = if v4 {
            ("an IPv4", "tunnel_source6")
        } else {
            ("an IPv6", "tunnel_source")
        };
        return Some(format!(
            "{source} is not {want} address (the other family is dataplane.{other})"
        ));
    }
    if let Some(why) = unusable_address(source) {
        return Some(why);
    }
    // Routers do not forward packets from a link-local source.
    if let IpAddr::V6(v6) = source
        && v6.is_unicast_link_local()
    {
        return Some(format!(
            "{source} is link-local: tunnel packets cross routers, which drop them"
        ));
    }
    None
}

/// Why an address cannot be a VIP or a backend, if it cannot.
fn unusable_address(addr: IpAddr) -> Option<String> {
    let kind = match addr {
        IpAddr::V4(v4) if v4.is_broadcast() => "the broadcast address",
        IpAddr::V4(v4) if v4.is_multicast() => "a multicast address",
        IpAddr::V6(v6) if v6.is_multicast() => "a multicast address",
        _ if addr.is_unspecified() => "the unspecified address",
        // The data path sees frames on dataplane.interface only: loopback traffic never
        // reaches it, and a frame sent to a loopback address never leaves the host.
        _ if addr.is_loopback() => "a loopback address",
        _ => return None,
    };
    Some(format!("{addr} is {kind}"))
}

impl VipConfig {
    /// `slow_start`, `hot_source_share` and `[vip.agent]`.
    fn validate_load(&self, at: &str) -> Result<(), ConfigError> {
        if let Some(ramp) = self.slow_start
            && !(Duration::from_secs(1)..=Duration::from_secs(86400)).contains(&ramp)
        {
            return Err(invalid(
                format!("{at}.slow_start"),
                "must be between 1s and 1 day",
            ));
        }
        if let Some(share) = self.hot_source_share {
            if !(share > 0.0 && share <= 1.0) {
                return Err(invalid(
                    format!("{at}.hot_source_share"),
                    "must be above 0 and at most 1 (a share of the VIP's new flows)",
                ));
            }
            // A 5-tuple VIP already balances every connection on its own.
            if self.hash != HashMode::SrcIp {
                return Err(invalid(
                    format!("{at}.hot_source_share"),
                    "needs hash = \"src-ip\" (a 5-tuple VIP balances every connection \
                     already)",
                ));
            }
        }
        if let Some(agent) = &self.agent {
            if agent.port == 0 {
                return Err(invalid(format!("{at}.agent.port"), "must not be 0"));
            }
            if agent.interval < Duration::from_millis(100)
                || agent.interval > Duration::from_secs(86400)
            {
                return Err(invalid(
                    format!("{at}.agent.interval"),
                    "must be between 100ms and 1 day",
                ));
            }
            if agent.timeout.is_zero() || agent.timeout > agent.interval {
                return Err(invalid(
                    format!("{at}.agent.timeout"),
                    "must be positive and at most the interval",
                ));
            }
        }
        Ok(())
    }
}

impl VipConfig {
    /// `[vip.outlier]`: settings that can work, on a TCP VIP.
    fn validate_outlier(&self, at: &str) -> Result<(), ConfigError> {
        let Some(outlier) = &self.outlier else {
            return Ok(());
        };
        let at = format!("{at}.outlier");
        if self.protocol != Protocol::Tcp {
            return Err(invalid(
                at,
                "only for TCP VIPs: passive health judges TCP handshakes (UDP has none)",
            ));
        }
        let sample = OUTLIER_SAMPLE;
        if outlier.window < 2 * sample || outlier.window > MAX_DURATION {
            return Err(invalid(
                format!("{at}.window"),
                format!(
                    "must hold at least two samples ({} each) and at most a day",
                    humantime::format_duration(sample)
                ),
            ));
        }
        if outlier.min_handshakes == 0 {
            return Err(invalid(
                format!("{at}.min_handshakes"),
                "must be at least 1",
            ));
        }
        if !(outlier.max_failure > 0.0 && outlier.max_failure <= 1.0) {
            return Err(invalid(
                format!("{at}.max_failure"),
                "must be above 0 and at most 1 (a share of handshakes)",
            ));
        }
        check_duration(&format!("{at}.eject"), outlier.eject)?;
        if !(0.0..=1.0).contains(&outlier.max_ejected) {
            return Err(invalid(
                format!("{at}.max_ejected"),
                "must be between 0 and 1 (a share of the VIP's backends)",
            ));
        }
        Ok(())
    }
}

/// A duration setting must lie within [`MIN_DURATION`]..=[`MAX_DURATION`].
fn check_duration(field: &str, value: Duration) -> Result<(), ConfigError> {
    if (MIN_DURATION..=MAX_DURATION).contains(&value) {
        return Ok(());
    }
    let show = |d: Duration| humantime::format_duration(d).to_string();
    Err(invalid(
        field,
        format!(
            "{} is outside {}..={}",
            show(value),
            show(MIN_DURATION),
            show(MAX_DURATION)
        ),
    ))
}

impl HealthConfig {
    /// `send`/`expect` belong to udp checks, `query`/`query_type` to dns checks.
    fn validate_datagram_checks(&self, at: &str) -> Result<(), ConfigError> {
        let only = |field: &str, kind: HealthKind| {
            invalid(
                format!("{at}.{field}"),
                format!(
                    "only used when kind = \"{kind}\" (kind is \"{}\")",
                    self.kind
                ),
            )
        };
        if self.kind != HealthKind::Udp {
            if self.send.is_some() {
                return Err(only("send", HealthKind::Udp));
            }
            if self.expect.is_some() {
                return Err(only("expect", HealthKind::Udp));
            }
        }
        if self.kind != HealthKind::Dns {
            if self.query.is_some() {
                return Err(only("query", HealthKind::Dns));
            }
            if self.query_type.is_some() {
                return Err(only("query_type", HealthKind::Dns));
            }
        }
        if let Some(send) = &self.send
            && send.len() > 1200
        {
            return Err(invalid(
                format!("{at}.send"),
                "at most 1200 bytes: a check datagram must not need fragments",
            ));
        }
        if let Some(query) = &self.query
            && let Err(why) = parse_name(query)
        {
            return Err(invalid(format!("{at}.query"), why));
        }
        if let Some(kind) = &self.query_type
            && let Err(why) = parse_record_type(kind)
        {
            return Err(invalid(format!("{at}.query_type"), why));
        }
        Ok(())
    }

    /// `sni`, `verify` and `ca_file` belong to https checks. The CA file's contents are
    /// the host's: `preflight` reads it (`lb check`, `lb run`, every reload).
    fn validate_tls(&self, at: &str) -> Result<(), ConfigError> {
        if self.kind != HealthKind::Https {
            for (field, set) in [
                ("sni", self.sni.is_some()),
                ("verify", self.verify.is_some()),
                ("ca_file", self.ca_file.is_some()),
            ] {
                if set {
                    return Err(invalid(
                        format!("{at}.{field}"),
                        format!(
                            "only used when kind = \"https\" (kind is \"{}\")",
                            self.kind
                        ),
                    ));
                }
            }
            return Ok(());
        }
        if let Some(sni) = &self.sni {
            // SNI carries host names only (RFC 6066); an address is what the check
            // verifies when sni is left out.
            let is_address = sni.parse::<IpAddr>().is_ok();
            if is_address || rustls_pki_types::DnsName::try_from(sni.as_str()).is_err() {
                return Err(invalid(
                    format!("{at}.sni"),
                    format!(
                        "{sni:?} is not a DNS name{}",
                        if is_address {
                            " (leave sni out to verify the certificate for the backend's address)"
                        } else {
                            ""
                        }
                    ),
                ));
            }
        }
        if let Some(path) = &self.ca_file {
            if !path.is_absolute() {
                return Err(invalid(
                    format!("{at}.ca_file"),
                    format!("{} is not an absolute path", path.display()),
                ));
            }
            if !self.verify() {
                return Err(invalid(
                    format!("{at}.ca_file"),
                    "not used when verify = false (no certificate is verified); remove one",
                ));
            }
        }
        Ok(())
    }

    /// The `ca_file` of an https check that verifies, if it names one.
    pub fn ca_file_to_read(&self) -> Option<&Path> {
        (self.kind == HealthKind::Https && self.verify())
            .then_some(self.ca_file.as_deref())
            .flatten()
    }

    fn validate(&self, at: &str) -> Result<(), ConfigError> {
        let show = |d: Duration| humantime::format_duration(d).to_string();
        check_duration(&format!("{at}.interval"), self.interval)?;
        check_duration(&format!("{at}.timeout"), self.timeout)?;
        // Otherwise checks of one backend would overlap.
        if self.timeout > self.interval {
            return Err(invalid(
                format!("{at}.timeout"),
                format!(
                    "{} is longer than the interval {}",
                    show(self.timeout),
                    show(self.interval)
                ),
            ));
        }
        for (name, value) in [
            ("fast_interval", self.fast_interval),
            ("down_interval", self.down_interval),
        ] {
            if let Some(value) = value {
                check_duration(&format!("{at}.{name}"), value)?;
            }
        }
        if self.rise == 0 {
            return Err(invalid(format!("{at}.rise"), "must be at least 1"));
        }
        if self.fall == 0 {
            return Err(invalid(format!("{at}.fall"), "must be at least 1"));
        }
        if self.port == Some(0) {
            return Err(invalid(format!("{at}.port"), "must not be 0"));
        }
        if let Some(path) = &self.path {
            if !self.is_http() {
                return Err(invalid(
                    format!("{at}.path"),
                    format!(
                        "only used when kind = \"http\" or \"https\" (kind is \"{}\")",
                        self.kind
                    ),
                ));
            }
            if !path.starts_with('/') {
                return Err(invalid(
                    format!("{at}.path"),
                    format!("{path:?} must start with '/'"),
                ));
            }
            // It goes verbatim into the request line; a space or CR/LF would break it.
            if path.chars().any(|c| c.is_whitespace() || c.is_control()) {
                return Err(invalid(
                    format!("{at}.path"),
                    format!("{path:?} must not contain whitespace or control characters"),
                ));
            }
        }
        self.validate_datagram_checks(at)?;
        self.validate_tls(at)?;
        if self.target == HealthTarget::Vip {
            if self.is_http() {
                return Err(invalid(
                    format!("{at}.target"),
                    format!(
                        "\"vip\" is not supported for {} checks (a handshake through the VIP \
                         needs a TCP stack of its own); use kind = \"tcp\" with target = \"vip\", \
                         or {} with target = \"backend\"",
                        self.kind, self.kind
                    ),
                ));
            }
            if self.port.is_some() {
                return Err(invalid(
                    format!("{at}.port"),
                    "target = \"vip\" checks the VIP's own port; leave port out",
                ));
            }
        }
        if !(100..=599).contains(&self.expect_status) {
            return Err(invalid(
                format!("{at}.expect_status"),
                format!("{} is not an HTTP status (100..=599)", self.expect_status),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn load_settings_parse_and_are_checked() {
        let text = MINIMAL.replace(
            "protocol = \"tcp\"",
            "protocol = \"tcp\"\nslow_start = \"30s\"\nbalance = \"least-flows\"\n\
             hash = \"src-ip\"\n[vip.agent]\nport = 4500",
        );
        let config = Config::from_toml(&text).unwrap();
        let vip = &config.vips[0];
        assert_eq!(vip.slow_start, Some(Duration::from_secs(30)));
        assert_eq!(vip.balance, Balance::LeastFlows);
        let agent = vip.agent.as_ref().unwrap();
        assert_eq!(
            (agent.port, agent.interval, agent.timeout),
            (4500, Duration::from_secs(2), Duration::from_secs(1))
        );
        let defaults = minimal();
        assert_eq!(defaults.vips[0].balance, Balance::Maglev);
        assert_eq!(defaults.vips[0].slow_start, None);
        for (change, field) in [
            ("slow_start = \"10ms\"", "vip[0].slow_start"),
            ("hot_source_share = 0.1", "vip[0].hot_source_share"),
            ("balance = \"fewest\"", "balance"),
        ] {
            let text = MINIMAL.replace(
                "protocol = \"tcp\"",
                &format!("protocol = \"tcp\"\n{change}"),
            );
            let error = Config::from_toml(&text).unwrap_err().to_string();
            assert!(error.contains(field), "{change}: {error}");
        }
        let with = |lines: &str| {
            MINIMAL.replace(
                "protocol = \"tcp\"",
                &format!("protocol = \"tcp\"\n{lines}"),
            )
        };
        let hot = Config::from_toml(&with("hash = \"src-ip\"\nhot_source_share = 0.1")).unwrap();
        assert_eq!(hot.vips[0].hot_source_share, Some(0.1));
        assert!(Config::from_toml(&with("hash = \"src-ip\"\nhot_source_share = 1.0")).is_ok());
        for bad in ["0.0", "-0.1", "1.5", "nan"] {
            let text = with(&format!("hash = \"src-ip\"\nhot_source_share = {bad}"));
            let error = Config::from_toml(&text).unwrap_err().to_string();
            assert!(error.contains("above 0 and at most 1"), "{bad}: {error}");
        }
        let error = Config::from_toml(&with("hot_source_share = 0.1"))
            .unwrap_err()
            .to_string();
        assert!(error.contains("needs hash = \"src-ip\""), "{error}");
    }

    #[test]
    fn a_reload_may_change_the_warmup_but_not_where_routes_go() {
        let second = std::time::Duration::from_secs(1);
        let base = Some(AnnounceConfig::default());
        let warmer = Some(AnnounceConfig {
            warmup: 30 * second,
            ..AnnounceConfig::default()
        });
        let other_table = Some(AnnounceConfig {
            table: 100,
            ..AnnounceConfig::default()
        });
        assert!(same_routes(&base, &warmer));
        assert!(!same_routes(&base, &other_table));
        assert!(!same_routes(&base, &None));
        assert!(same_routes(&None, &None));
    }
    use std::net::{Ipv4Addr, Ipv6Addr};

    /// The example from product.md, verbatim.
    const EXAMPLE: &str = r#"
[dataplane]
interface = "eth0"
xdp_mode = "auto"            # "native" | "generic" | "auto" (native, else generic)
# maglev_table_size = 65537  # a prime
# conntrack_entries = 1048576

[control]
socket = "/run/lb/lb.sock"   # created 0600: the control plane is root's alone
metrics = "127.0.0.1:9650"   # Prometheus text format at /metrics

[[vip]]
name = "web"
address = "10.0.0.100"       # IPv4 or IPv6
port = 80
protocol = "tcp"             # "tcp" | "udp"
# hash = "5-tuple"           # or "src-ip" (affinity)
# drain_timeout = "30s"

[vip.health]
kind = "tcp"                 # "tcp" | "http" | "none"
interval = "2s"
timeout = "1s"
rise = 2
fall = 3
# port = 8080                # default: the VIP's port, on the backend's own address
# path = "/healthz"          # http only
# expect_status = 200        # http only

[[vip.backend]]
address = "10.0.0.11"
weight = 1
# mac = "02:00:00:00:00:0b"  # optional: otherwise resolved from the neighbour table
# state = "ready"            # "ready" | "drain" | "maint"
"#;

    const MINIMAL: &str = r#"
[dataplane]
interface = "eth0"

[[vip]]
name = "web"
address = "10.0.0.100"
port = 80
protocol = "tcp"

[[vip.backend]]
address = "10.0.0.11"
"#;

    fn minimal() -> Config {
        Config::from_toml(MINIMAL).expect("minimal config is valid")
    }

    /// A UDP VIP with `quic` and two backends, `vip` lines added to the VIP and the
    /// backends' `server_id` lines as given.
    fn quic_config(vip: &str, ids: [&str; 2]) -> String {
        format!(
            "[dataplane]\ninterface = \"eth0\"\n[[vip]]\nname = \"h3\"\naddress = \"10.0.0.100\"\n\
             port = 443\nprotocol = \"udp\"\n{vip}\n[[vip.backend]]\naddress = \"10.0.0.11\"\n{}\n\
             [[vip.backend]]\naddress = \"10.0.0.12\"\n{}\n",
            ids[0], ids[1]
        )
    }

    #[test]
    fn quic_settings_parse_and_bad_ones_name_their_field() {
        let good = quic_config("quic = true", ["server_id = 7", "server_id = 8"]);
        let config = Config::from_toml(&good).unwrap();
        let vip = &config.vips[0];
        assert!(vip.quic);
        assert_eq!(vip.quic_server_id_len(), DEFAULT_QUIC_SERVER_ID_LEN);
        assert_eq!(vip.backends[1].server_id, Some(8));
        let long = quic_config(
            "quic = true\nquic_server_id_len = 15",
            ["server_id = 1", "server_id = 9223372036854775807"],
        );
        assert_eq!(
            Config::from_toml(&long).unwrap().vips[0].quic_server_id_len(),
            15
        );
        for (vip, ids, field) in [
            (
                "quic = true",
                ["server_id = 7", ""],
                "vip[0].backend[1].server_id",
            ),
            (
                "quic = true",
                ["server_id = 7", "server_id = 7"],
                "vip[0].backend[1].server_id",
            ),
            (
                "quic = true\nquic_server_id_len = 0",
                ["server_id = 0", "server_id = 1"],
                "vip[0].quic_server_id_len",
            ),
            (
                "quic = true\nquic_server_id_len = 16",
                ["server_id = 0", "server_id = 1"],
                "vip[0].quic_server_id_len",
            ),
            (
                "quic = true\nquic_server_id_len = 1",
                ["server_id = 256", "server_id = 1"],
                "vip[0].backend[0].server_id",
            ),
            (
                "quic_server_id_len = 2",
                ["", ""],
                "vip[0].quic_server_id_len",
            ),
            ("", ["server_id = 7", ""], "vip[0].backend[0].server_id"),
        ] {
            let text = quic_config(vip, ids);
            match Config::from_toml(&text) {
                Err(ConfigError::Invalid { field: named, .. }) => {
                    assert_eq!(named, field, "{vip} {ids:?}")
                }
                other => panic!("{vip} {ids:?}: {other:?}"),
            }
        }
        let tcp = quic_config("quic = true", ["server_id = 7", "server_id = 8"])
            .replace("protocol = \"udp\"", "protocol = \"tcp\"");
        let error = Config::from_toml(&tcp).unwrap_err();
        assert!(
            matches!(&error, ConfigError::Invalid { field, .. } if field == "vip[0].quic"),
            "{error}"
        );
        assert!(error.to_string().contains("UDP"), "{error}");
    }

    fn backend(address: &str) -> BackendConfig {
        BackendConfig {
            address: address.parse().unwrap(),
            weight: 1,
            mac: None,
            state: AdminState::Ready,
            health: None,
            server_id: None,
        }
    }

    #[test]
    fn a_backend_may_override_the_vips_checks() {
        let text = format!(
            "{EXAMPLE}\n[[vip.backend]]\naddress = \"10.0.0.12\"\n\
             [vip.backend.health]\nkind = \"http\"\npath = \"/ready\"\nport = 8080\n"
        );
        let config = Config::from_toml(&text).unwrap();
        let vip = &config.vips[0];
        let (plain, special) = (&vip.backends[0], &vip.backends[1]);
        assert_eq!(vip.health_of(plain).kind, HealthKind::Tcp);
        assert_eq!(vip.health_port_of(plain), 80);
        assert_eq!(vip.health_of(special).kind, HealthKind::Http);
        assert_eq!(vip.health_of(special).http_path(), "/ready");
        assert_eq!(vip.health_port_of(special), 8080);
        let bad = text.replace("path = \"/ready\"", "path = \"/ready\"\nrise = 0");
        match Config::from_toml(&bad) {
            Err(ConfigError::Invalid { field, .. }) => {
                assert_eq!(field, "vip[0].backend[1].health.rise")
            }
            other => panic!("{other:?}"),
        }
    }

    fn parse_error(text: &str) -> String {
        match Config::from_toml(text) {
            Err(ConfigError::Parse(message)) => message,
            other => panic!("expected a parse error, got {other:?}"),
        }
    }

    /// Applies `change` to the minimal config and returns the field validation names.
    fn rejected_field(change: impl FnOnce(&mut Config)) -> String {
        let mut config = minimal();
        change(&mut config);
        match config.validate() {
            Err(ConfigError::Invalid { field, .. }) => field,
            other => panic!("expected a validation error, got {other:?}"),
        }
    }

    #[test]
    fn example_from_product_parses() {
        let config = Config::from_toml(EXAMPLE).unwrap();
        assert_eq!(
            config.dataplane,
            DataplaneConfig {
                interface: "eth0".into(),
                interfaces: vec!["eth0".into()],
                xdp_mode: XdpModeSetting::Auto,
                maglev_table_size: 65537,
                conntrack_entries: 1_048_576,
                flow_idle_timeout: Duration::from_secs(30),
                conntrack_insert_limit: 100_000,
                pin_path: None,
                tunnel_source: None,
                tunnel_source6: None,
                next_program: None,
            }
        );
        assert_eq!(config.control.socket, PathBuf::from("/run/lb/lb.sock"));
        assert_eq!(
            config.control.metrics,
            Some(SocketAddr::from(([127, 0, 0, 1], 9650)))
        );
        assert_eq!(
            config.vips,
            vec![VipConfig {
                name: "web".into(),
                address: IpAddr::V4(Ipv4Addr::new(10, 0, 0, 100)),
                port: 80,
                protocol: Protocol::Tcp,
                hash: HashMode::FiveTuple,
                drain_timeout: Duration::from_secs(30),
                health: HealthConfig {
                    kind: HealthKind::Tcp,
                    interval: Duration::from_secs(2),
                    timeout: Duration::from_secs(1),
                    rise: 2,
                    fall: 3,
                    fast_interval: None,
                    down_interval: None,
                    port: None,
                    path: None,
                    expect_status: 200,
                    target: HealthTarget::Backend,
                    send: None,
                    expect: None,
                    query: None,
                    query_type: None,
                    sni: None,
                    verify: None,
                    ca_file: None,
                },
                min_healthy: 1,
                slow_start: None,
                balance: Balance::Maglev,
                hot_source_share: None,
                agent: None,
                outlier: None,
                forward: Forward::L2,
                gue_port: None,
                quic: false,
                quic_server_id_len_setting: None,
                backends: vec![backend("10.0.0.11")],
            }]
        );
        assert_eq!(config.announce, None, "nothing is announced by default");
        assert_eq!(config.vips[0].health_port(), 80);
    }

    #[test]
    fn debug_capture_is_off_by_default_and_validated() {
        let config = Config::from_toml(EXAMPLE).unwrap();
        assert_eq!(config.debug.capture, None);
        assert_eq!(
            config.debug.program_rate(),
            0,
            "no file, no capture in the program"
        );
        let on = format!("{EXAMPLE}\n[debug]\ncapture = \"/var/log/lb/misses.pcap\"\n");
        let config = Config::from_toml(&on).unwrap();
        assert_eq!(config.debug.program_rate(), 10);
        for (text, field) in [
            ("[debug]\ncapture = \"misses.pcap\"\n", "debug.capture"),
            (
                "[debug]\ncapture = \"/tmp/m.pcap\"\ncapture_rate = 0\n",
                "debug.capture_rate",
            ),
        ] {
            match Config::from_toml(&format!("{EXAMPLE}\n{text}")) {
                Err(ConfigError::Invalid { field: f, .. }) => assert_eq!(f, field),
                other => panic!("{text}: {other:?}"),
            }
        }
    }

    #[test]
    fn fast_and_down_intervals_default_from_interval() {
        let config = Config::from_toml(EXAMPLE).unwrap();
        let health = &config.vips[0].health;
        assert_eq!(health.fast_interval(), Duration::from_millis(500));
        assert_eq!(health.down_interval(), Duration::from_secs(2));
        let text = EXAMPLE.replace(
            "rise = 2",
            "rise = 2\nfast_interval = \"200ms\"\ndown_interval = \"10s\"",
        );
        let health = Config::from_toml(&text).unwrap().vips[0].health.clone();
        assert_eq!(health.fast_interval(), Duration::from_millis(200));
        assert_eq!(health.down_interval(), Duration::from_secs(10));
        let zero = EXAMPLE.replace("rise = 2", "rise = 2\nfast_interval = \"0s\"");
        match Config::from_toml(&zero) {
            Err(ConfigError::Invalid { field, .. }) => {
                assert_eq!(field, "vip[0].health.fast_interval")
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn example_with_commented_options_enabled_parses() {
        let text = EXAMPLE
            .replace("kind = \"tcp\"", "kind = \"http\"")
            .replace("# hash", "hash")
            .replace("# drain_timeout", "drain_timeout")
            .replace("# port = 8080", "port = 8080")
            .replace("# path", "path")
            .replace("# expect_status", "expect_status")
            .replace("# mac", "mac")
            .replace("# state", "state")
            .replace("# maglev", "maglev")
            .replace("# conntrack", "conntrack");
        let config = Config::from_toml(&text).unwrap();
        let vip = &config.vips[0];
        assert_eq!(vip.health.kind, HealthKind::Http);
        assert_eq!(vip.health.http_path(), "/healthz");
        assert_eq!(vip.health_port(), 8080);
        assert_eq!(vip.backends[0].mac, Some(MacAddr([2, 0, 0, 0, 0, 0x0b])));
        assert_eq!(vip.backends[0].state, AdminState::Ready);
    }

    #[test]
    fn minimal_file_gets_defaults() {
        let config = minimal();
        assert_eq!(config.dataplane.xdp_mode, XdpModeSetting::Auto);
        assert_eq!(config.dataplane.maglev_table_size, 65537);
        assert_eq!(config.dataplane.conntrack_entries, 1_048_576);
        assert_eq!(config.control, ControlConfig::default());
        assert_eq!(config.control.socket, PathBuf::from("/run/lb/lb.sock"));
        assert_eq!(
            config.control.metrics,
            Some(SocketAddr::from(([127, 0, 0, 1], 9650)))
        );
        let vip = &config.vips[0];
        assert_eq!(vip.hash, HashMode::FiveTuple);
        assert_eq!(vip.drain_timeout, Duration::from_secs(30));
        assert_eq!(vip.health, HealthConfig::default());
        assert_eq!(vip.health.kind, HealthKind::Tcp);
        assert_eq!(vip.health.interval, Duration::from_secs(2));
        assert_eq!(vip.health.timeout, Duration::from_secs(1));
        assert_eq!((vip.health.rise, vip.health.fall), (2, 3));
        assert_eq!(vip.health.expect_status, 200);
        assert_eq!(vip.health.http_path(), "/");
        assert_eq!(vip.health_port(), 80);
        assert_eq!(vip.backends, vec![backend("10.0.0.11")]);
    }

    #[test]
    fn all_options_parse() {
        let text = r#"
[dataplane]
interface = "ens1f0"
xdp_mode = "native"
maglev_table_size = 251
conntrack_entries = 1000

[control]
socket = "/tmp/lb.sock"
metrics = "[::1]:9100"

[[vip]]
name = "dns"
address = "10.0.0.53"
port = 53
protocol = "udp"
hash = "src-ip"
drain_timeout = "1m 30s"

[vip.health]
kind = "none"

[[vip.backend]]
address = "10.0.0.21"
weight = 1000
mac = "AA:bb:CC:00:11:22"
state = "maint"

[[vip.backend]]
address = "10.0.0.22"
state = "drain"
"#;
        let config = Config::from_toml(text).unwrap();
        assert_eq!(config.dataplane.xdp_mode, XdpModeSetting::Native);
        assert_eq!(config.dataplane.maglev_table_size, 251);
        assert_eq!(config.dataplane.conntrack_entries, 1000);
        assert_eq!(
            config.control.metrics,
            Some(SocketAddr::from((Ipv6Addr::LOCALHOST, 9100)))
        );
        let vip = &config.vips[0];
        assert_eq!(vip.protocol, Protocol::Udp);
        assert_eq!(vip.hash, HashMode::SrcIp);
        assert_eq!(vip.drain_timeout, Duration::from_secs(90));
        assert_eq!(vip.health.kind, HealthKind::None);
        assert_eq!(vip.backends[0].weight, 1000);
        assert_eq!(
            vip.backends[0].mac,
            Some(MacAddr([0xaa, 0xbb, 0xcc, 0, 0x11, 0x22]))
        );
        assert_eq!(vip.backends[0].state, AdminState::Maint);
        assert_eq!(vip.backends[1].state, AdminState::Drain);
    }

    #[test]
    fn ipv6_vip_with_ipv6_backends() {
        let text = r#"
[dataplane]
interface = "eth0"

[[vip]]
name = "web6"
address = "2001:db8::100"
port = 443
protocol = "tcp"

[[vip.backend]]
address = "2001:db8::11"

[[vip.backend]]
address = "2001:db8::12"
weight = 3
"#;
        let config = Config::from_toml(text).unwrap();
        let vip = &config.vips[0];
        assert_eq!(vip.address, "2001:db8::100".parse::<IpAddr>().unwrap());
        assert_eq!(vip.backends.len(), 2);
        assert_eq!(
            vip.backends[1].address,
            "2001:db8::12".parse::<IpAddr>().unwrap()
        );
        assert_eq!(vip.backends[1].weight, 3);
    }

    #[test]
    fn zero_vips_is_valid() {
        let config = Config::from_toml("[dataplane]\ninterface = \"eth0\"\n").unwrap();
        assert!(config.vips.is_empty());
        let config = Config::from_toml("vip = []\n[dataplane]\ninterface = \"eth0\"\n").unwrap();
        assert!(config.vips.is_empty());
    }

    #[test]
    fn vip_without_backends_is_valid() {
        let mut config = minimal();
        config.vips[0].backends.clear();
        config.validate().unwrap();
    }

    #[test]
    fn metrics_off_or_empty_disables_metrics() {
        for value in ["off", ""] {
            let text =
                format!("[dataplane]\ninterface = \"eth0\"\n[control]\nmetrics = \"{value}\"\n");
            let config = Config::from_toml(&text).unwrap();
            assert_eq!(config.control.metrics, None, "metrics = {value:?}");
            assert_eq!(config.control.socket, PathBuf::from("/run/lb/lb.sock"));
        }
    }

    #[test]
    fn malformed_metrics_address_is_a_parse_error() {
        let message =
            parse_error("[dataplane]\ninterface = \"eth0\"\n[control]\nmetrics = \"localhost\"\n");
        assert!(
            message.contains("invalid metrics address \"localhost\""),
            "{message}"
        );
    }

    #[test]
    fn unknown_key_is_a_parse_error_naming_the_key() {
        let message = parse_error(&MINIMAL.replace("interface", "interfase = \"x\"\ninterface"));
        assert!(message.contains("interfase"), "{message}");

        let message = parse_error(&format!("{MINIMAL}wieght = 2\n"));
        assert!(message.contains("wieght"), "{message}");

        let message = parse_error(&format!("{MINIMAL}[vip.health]\nintervall = \"2s\"\n"));
        assert!(message.contains("intervall"), "{message}");

        let message = parse_error(&format!("{MINIMAL}[extra]\n"));
        assert!(message.contains("extra"), "{message}");
    }

    #[test]
    fn missing_required_key_is_a_parse_error() {
        let message = parse_error(&MINIMAL.replace("protocol = \"tcp\"", ""));
        assert!(message.contains("protocol"), "{message}");
    }

    #[test]
    fn unknown_enum_value_is_a_parse_error() {
        let message = parse_error(&MINIMAL.replace("\"tcp\"", "\"sctp\""));
        assert!(message.contains("sctp"), "{message}");
    }

    #[test]
    fn malformed_duration_is_a_clear_parse_error() {
        let message = parse_error(&format!(
            "{MINIMAL}[vip.health]\ninterval = \"2 parsecs\"\n"
        ));
        assert!(
            message.contains("invalid duration \"2 parsecs\""),
            "{message}"
        );
        assert!(message.contains("interval"), "{message}");

        let message = parse_error(&format!("{MINIMAL}[vip.health]\ninterval = 2\n"));
        assert!(message.contains("a duration such as"), "{message}");
    }

    #[test]
    fn malformed_mac_is_a_clear_parse_error() {
        let message = parse_error(&format!("{MINIMAL}mac = \"02:00:00:00:0b\"\n"));
        assert!(
            message.contains("invalid MAC address \"02:00:00:00:0b\""),
            "{message}"
        );
        assert!(message.contains("mac"), "{message}");
    }

    #[test]
    fn mac_parses_and_prints() {
        let mac: MacAddr = "02:00:00:00:00:0B".parse().unwrap();
        assert_eq!(mac, MacAddr([2, 0, 0, 0, 0, 0x0b]));
        assert_eq!(mac.to_string(), "02:00:00:00:00:0b");
        assert_eq!(format!("{mac:?}"), "02:00:00:00:00:0b");
        for bad in [
            "",
            "02:00:00:00:00",
            "02:00:00:00:00:0b:0c",
            "02:00:00:00:00:0",
            "02:00:00:00:00:0g",
            "02-00-00-00-00-0b",
            "02:00:00:00:00:+b",
            "02:00:00:00:00:0b:",
        ] {
            assert!(bad.parse::<MacAddr>().is_err(), "{bad:?} should not parse");
        }
    }

    #[test]
    fn display_matches_serde() {
        fn serde_name<T: Serialize>(value: T) -> String {
            #[derive(Serialize)]
            struct Wrap<T> {
                v: T,
            }
            let text = toml::to_string(&Wrap { v: value }).unwrap();
            let (_, quoted) = text.trim().split_once(" = ").unwrap();
            quoted.trim_matches('"').to_owned()
        }
        for v in [
            XdpModeSetting::Native,
            XdpModeSetting::Generic,
            XdpModeSetting::Auto,
        ] {
            assert_eq!(v.to_string(), serde_name(v));
        }
        for v in [Protocol::Tcp, Protocol::Udp] {
            assert_eq!(v.to_string(), serde_name(v));
        }
        for v in [HashMode::FiveTuple, HashMode::SrcIp] {
            assert_eq!(v.to_string(), serde_name(v));
        }
        for v in [
            HealthKind::Tcp,
            HealthKind::Http,
            HealthKind::Udp,
            HealthKind::Dns,
            HealthKind::None,
        ] {
            assert_eq!(v.to_string(), serde_name(v));
        }
        for v in [AdminState::Ready, AdminState::Drain, AdminState::Maint] {
            assert_eq!(v.to_string(), serde_name(v));
        }
        assert_eq!(XdpModeSetting::Auto.to_string(), "auto");
        assert_eq!(HashMode::FiveTuple.to_string(), "5-tuple");
        assert_eq!(Protocol::Udp.to_string(), "udp");
    }

    #[test]
    fn protocol_numbers() {
        assert_eq!(Protocol::Tcp.number(), 6);
        assert_eq!(Protocol::Udp.number(), 17);
    }

    #[test]
    fn serialized_config_parses_back_unchanged() {
        let mut config = minimal();
        config.control.metrics = None;
        config.vips[0].drain_timeout = Duration::from_millis(1500);
        config.vips[0].health.kind = HealthKind::Http;
        config.vips[0].health.path = Some("/healthz".into());
        config.vips[0].backends[0].mac = Some(MacAddr([2, 0, 0, 0, 0, 0x0b]));
        config.vips[0].min_healthy = 2;
        config.announce = Some(AnnounceConfig {
            warmup: Duration::from_millis(2500),
            ..AnnounceConfig::default()
        });
        config.vips.push(VipConfig {
            name: "web6".into(),
            address: "2001:db8::1".parse().unwrap(),
            backends: vec![backend("2001:db8::2")],
            ..config.vips[0].clone()
        });
        let text = toml::to_string(&config).unwrap();
        assert_eq!(Config::from_toml(&text).unwrap(), config, "{text}");
    }

    #[test]
    fn load_reads_the_file_and_names_it_when_it_cannot() {
        let dir = std::env::temp_dir().join(format!("lb-config-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("lb.toml");
        std::fs::write(&path, MINIMAL).unwrap();
        assert_eq!(Config::load(&path).unwrap(), minimal());
        std::fs::remove_dir_all(&dir).unwrap();

        match Config::load(&path) {
            Err(error @ ConfigError::Read { .. }) => {
                let ConfigError::Read { path: named, .. } = &error else {
                    unreachable!()
                };
                assert_eq!(named, &path);
                assert!(error.to_string().contains("lb.toml"));
            }
            other => panic!("expected a read error, got {other:?}"),
        }
    }

    #[test]
    fn load_reads_at_most_a_few_mib() {
        // /dev/zero never ends: read to the cap, then refused.
        let started = std::time::Instant::now();
        match Config::load(Path::new("/dev/zero")) {
            Err(error @ ConfigError::TooLarge { .. }) => {
                assert!(error.to_string().contains("/dev/zero"), "{error}");
            }
            other => panic!("expected TooLarge, got {other:?}"),
        }
        assert!(started.elapsed() < Duration::from_secs(5));
        let dir = std::env::temp_dir().join(format!("lb-config-cap-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("big.toml");
        // A comment line long enough to pass the cap by one byte.
        let mut text = MINIMAL.to_string();
        text += "#";
        text += &" ".repeat(MAX_CONFIG_BYTES as usize - text.len());
        std::fs::write(&path, &text).unwrap();
        assert_eq!(
            Config::load(&path).unwrap(),
            minimal(),
            "exactly at the cap"
        );
        text.push(' ');
        std::fs::write(&path, &text).unwrap();
        assert!(matches!(
            Config::load(&path),
            Err(ConfigError::TooLarge { .. })
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn from_toml_validates() {
        let text = MINIMAL.replace("port = 80", "port = 0");
        assert!(matches!(
            Config::from_toml(&text),
            Err(ConfigError::Invalid { field, .. }) if field == "vip[0].port"
        ));
    }

    #[test]
    fn invalid_error_names_field_and_reason() {
        let error = invalid("dataplane.maglev_table_size", "65536 is not a prime");
        assert_eq!(
            error.to_string(),
            "`dataplane.maglev_table_size`: 65536 is not a prime"
        );
    }

    // --- dataplane ---

    #[test]
    fn interface_must_not_be_empty() {
        assert_eq!(
            rejected_field(|c| c.dataplane.interface.clear()),
            "dataplane.interface"
        );
    }

    #[test]
    fn interface_at_most_15_bytes() {
        let mut config = minimal();
        config.dataplane.interface = "a".repeat(15);
        config.validate().unwrap();
        assert_eq!(
            rejected_field(|c| c.dataplane.interface = "a".repeat(16)),
            "dataplane.interface"
        );
    }

    #[test]
    fn interface_without_slash_or_whitespace() {
        assert_eq!(
            rejected_field(|c| c.dataplane.interface = "eth/0".into()),
            "dataplane.interface"
        );
        assert_eq!(
            rejected_field(|c| c.dataplane.interface = "eth 0".into()),
            "dataplane.interface"
        );
        assert_eq!(
            rejected_field(|c| c.dataplane.interface = "eth0\n".into()),
            "dataplane.interface"
        );
    }

    /// The field a configuration text is refused for.
    fn refused_field(text: &str) -> String {
        match Config::from_toml(text) {
            Err(ConfigError::Invalid { field, .. }) => field,
            other => panic!("expected a validation error, got {other:?}"),
        }
    }

    #[test]
    fn interfaces_lists_several_and_interface_is_a_list_of_one() {
        let several = MINIMAL.replace("interface = \"eth0\"", "interfaces = [\"eth0\", \"eth1\"]");
        let config = Config::from_toml(&several).unwrap();
        assert_eq!(config.dataplane.interface, "eth0");
        assert_eq!(config.dataplane.interfaces, ["eth0", "eth1"]);
        assert!(config.dataplane.several_interfaces());
        let one = Config::from_toml(MINIMAL).unwrap();
        assert_eq!(one.dataplane.interfaces, ["eth0"]);
        assert!(!one.dataplane.several_interfaces());
        // Written back, it reads the same (as `interfaces`).
        let again = Config::from_toml(&toml::to_string(&config).unwrap()).unwrap();
        assert_eq!(again.dataplane, config.dataplane);
    }

    #[test]
    fn interfaces_twice_both_or_none_are_refused_naming_the_field() {
        let with = |line: &str| MINIMAL.replace("interface = \"eth0\"", line);
        assert_eq!(
            refused_field(&with("interfaces = [\"eth0\", \"eth1\", \"eth0\"]")),
            "dataplane.interfaces"
        );
        assert_eq!(
            refused_field(&with("interface = \"eth0\"\ninterfaces = [\"eth1\"]")),
            "dataplane.interfaces"
        );
        assert_eq!(refused_field(&with("")), "dataplane.interface");
        assert_eq!(
            refused_field(&with("interfaces = []")),
            "dataplane.interface"
        );
        assert_eq!(
            refused_field(&with("interfaces = [\"eth0\", \"eth 1\"]")),
            "dataplane.interfaces"
        );
        let many: Vec<String> = (0..17).map(|i| format!("\"e{i}\"")).collect();
        assert_eq!(
            refused_field(&with(&format!("interfaces = [{}]", many.join(", ")))),
            "dataplane.interfaces"
        );
    }

    #[test]
    fn maglev_table_size_must_be_prime() {
        assert_eq!(
            rejected_field(|c| c.dataplane.maglev_table_size = 65536),
            "dataplane.maglev_table_size"
        );
        assert_eq!(
            rejected_field(|c| c.dataplane.maglev_table_size = 9),
            "dataplane.maglev_table_size"
        );
    }

    #[test]
    fn maglev_table_size_within_bounds() {
        for size in [MIN_MAGLEV_TABLE_SIZE, MAX_MAGLEV_TABLE_SIZE] {
            let mut config = minimal();
            config.dataplane.maglev_table_size = size;
            config.validate().unwrap();
        }
        for size in [0, 2, 5, 4_194_329] {
            assert_eq!(
                rejected_field(|c| c.dataplane.maglev_table_size = size),
                "dataplane.maglev_table_size",
                "size {size}"
            );
        }
    }

    #[test]
    fn conntrack_entries_at_least_one() {
        assert_eq!(
            rejected_field(|c| c.dataplane.conntrack_entries = 0),
            "dataplane.conntrack_entries"
        );
    }

    // --- control ---

    #[test]
    fn control_socket_must_be_absolute() {
        assert_eq!(
            rejected_field(|c| c.control.socket = "lb.sock".into()),
            "control.socket"
        );
    }

    #[test]
    fn metrics_port_must_not_be_zero() {
        assert_eq!(
            rejected_field(|c| c.control.metrics = Some(SocketAddr::from(([127, 0, 0, 1], 0)))),
            "control.metrics"
        );
    }

    // --- Tunnels ---

    #[test]
    fn forward_defaults_to_l2_and_gue_to_its_port() {
        let config = minimal();
        assert_eq!(config.vips[0].forward, Forward::L2);
        let text = MINIMAL.replace(
            "protocol = \"tcp\"",
            "protocol = \"tcp\"\nforward = \"gue\"",
        );
        let gue = Config::from_toml(&text).unwrap();
        assert_eq!(gue.vips[0].forward, Forward::Gue);
        assert_eq!(gue.vips[0].gue_port(), DEFAULT_GUE_PORT);
        let text = text.replace("forward = \"gue\"", "forward = \"gue\"\ngue_port = 7000");
        assert_eq!(Config::from_toml(&text).unwrap().vips[0].gue_port(), 7000);
        let unknown = MINIMAL.replace(
            "protocol = \"tcp\"",
            "protocol = \"tcp\"\nforward = \"vxlan\"",
        );
        let message = parse_error(&unknown);
        assert!(message.contains("unknown variant `vxlan`"), "{message}");
    }

    #[test]
    fn gue_port_belongs_to_gue() {
        assert_eq!(
            rejected_field(|c| c.vips[0].gue_port = Some(6080)),
            "vip[0].gue_port",
            "forward is l2"
        );
        assert_eq!(
            rejected_field(|c| {
                c.vips[0].forward = Forward::Ipip;
                c.vips[0].gue_port = Some(6080);
            }),
            "vip[0].gue_port"
        );
        assert_eq!(
            rejected_field(|c| {
                c.vips[0].forward = Forward::Gue;
                c.vips[0].gue_port = Some(0);
            }),
            "vip[0].gue_port"
        );
    }

    #[test]
    fn only_a_tunnel_mixes_address_families() {
        let v6_backend = |c: &mut Config| c.vips[0].backends[0] = backend("fd00::11");
        assert_eq!(
            rejected_field(v6_backend),
            "vip[0].backend[0].address",
            "l2 cannot send an IPv4 packet to an IPv6 address"
        );
        for forward in [Forward::Ipip, Forward::Gue] {
            let mut config = minimal();
            config.vips[0].forward = forward;
            v6_backend(&mut config);
            config.vips[0].backends.push(backend("10.0.0.12"));
            config.validate().unwrap();
        }
    }

    #[test]
    fn checks_through_the_vip_take_any_forward_but_not_http() {
        for forward in [Forward::L2, Forward::Ipip, Forward::Gue] {
            for kind in [HealthKind::Tcp, HealthKind::Udp, HealthKind::Dns] {
                let mut config = minimal();
                config.vips[0].forward = forward;
                config.vips[0].health.kind = kind;
                config.vips[0].health.target = HealthTarget::Vip;
                config.vips[0].backends[0].health = Some(HealthConfig {
                    kind,
                    target: HealthTarget::Vip,
                    ..HealthConfig::default()
                });
                config.validate().unwrap();
            }
        }
        let field = rejected_field(|c| {
            c.vips[0].forward = Forward::Gue;
            c.vips[0].health.kind = HealthKind::Http;
            c.vips[0].health.target = HealthTarget::Vip;
        });
        assert_eq!(field, "vip[0].health.target");
        let field = rejected_field(|c| {
            c.vips[0].forward = Forward::Ipip;
            c.vips[0].backends[0].health = Some(HealthConfig {
                kind: HealthKind::Http,
                target: HealthTarget::Vip,
                ..HealthConfig::default()
            });
        });
        assert_eq!(field, "vip[0].backend[0].health.target");
    }

    #[test]
    fn a_tunnelled_backend_takes_no_mac() {
        let field = rejected_field(|c| {
            c.vips[0].forward = Forward::Ipip;
            c.vips[0].backends[0].mac = Some(MacAddr([2, 0, 0, 0, 0, 0x0b]));
        });
        assert_eq!(field, "vip[0].backend[0].mac");
    }

    #[test]
    fn tunnel_sources_are_unicast_addresses_of_their_family() {
        let mut config = minimal();
        config.dataplane.tunnel_source = Some("10.0.0.2".parse().unwrap());
        config.dataplane.tunnel_source6 = Some("fd00::2".parse().unwrap());
        config.validate().unwrap();
        for (source, v6, field) in [
            ("fd00::2", false, "dataplane.tunnel_source"),
            ("10.0.0.2", true, "dataplane.tunnel_source6"),
            ("224.0.0.1", false, "dataplane.tunnel_source"),
            ("0.0.0.0", false, "dataplane.tunnel_source"),
            ("fe80::2", true, "dataplane.tunnel_source6"),
            ("::1", true, "dataplane.tunnel_source6"),
        ] {
            let address = Some(source.parse().unwrap());
            assert_eq!(
                rejected_field(|c| if v6 {
                    c.dataplane.tunnel_source6 = address
                } else {
                    c.dataplane.tunnel_source = address
                }),
                field,
                "{source}"
            );
        }
    }

    #[test]
    fn a_tunnel_source_is_configured_or_the_interfaces_own() {
        let mut config = minimal();
        config.vips[0].forward = Forward::Ipip;
        config.vips[0].backends.push(backend("fd00:2::12"));
        let own: Vec<IpAddr> = ["10.0.0.2", "fe80::1", "fd00::2"]
            .iter()
            .map(|a| a.parse().unwrap())
            .collect();
        config.validate_host(&own).unwrap();
        let v4 = IpAddr::V4(Ipv4Addr::new(10, 1, 0, 11));
        let v6: IpAddr = "fd00:2::12".parse().unwrap();
        assert_eq!(config.tunnel_source_for(v4, &own), Ok(own[0]));
        assert_eq!(
            config.tunnel_source_for(v6, &own),
            Ok(own[2]),
            "not the link-local one"
        );
        config.dataplane.tunnel_source6 = Some("fd00::99".parse().unwrap());
        assert_eq!(
            config.tunnel_source_for(v6, &own),
            Ok("fd00::99".parse().unwrap())
        );
        // An interface with only an IPv4 and a link-local address: no IPv6 source.
        config.dataplane.tunnel_source6 = None;
        match config.validate_host(&own[..2]) {
            Err(ConfigError::Invalid { field, reason }) => {
                assert_eq!(field, "dataplane.tunnel_source6");
                assert!(
                    reason.contains(
                        "vip[0] (\"web\") forwards by ipip to fd00:2::12 (vip[0].backend[1])"
                    ) && reason.contains("no IPv6 tunnel source: set dataplane.tunnel_source6"),
                    "{reason}"
                );
            }
            other => panic!("{other:?}"),
        }
        // An l2 VIP needs no source.
        config.vips[0].forward = Forward::L2;
        config.vips[0].backends.pop();
        config.validate_host(&[]).unwrap();
    }

    #[test]
    fn a_reload_may_change_forward_and_the_tunnel_sources() {
        let old = minimal();
        let mut new = minimal();
        new.dataplane.tunnel_source = Some("10.0.0.3".parse().unwrap());
        new.vips[0].forward = Forward::Gue;
        // Both are map contents (`LB_TUNNEL`, `LB_BACKENDS`), written at every reload.
        assert_eq!(old.restart_only_change(&new), None);
    }

    // --- VIPs ---

    fn numbered_vip(template: &VipConfig, i: usize) -> VipConfig {
        VipConfig {
            name: format!("vip{i}"),
            port: 1000 + i as u16,
            ..template.clone()
        }
    }

    #[test]
    fn at_most_max_vips() {
        let mut config = minimal();
        let template = config.vips[0].clone();
        config.vips = (0..MAX_VIPS).map(|i| numbered_vip(&template, i)).collect();
        config.validate().unwrap();
        assert_eq!(
            rejected_field(|c| {
                c.vips = (0..=MAX_VIPS).map(|i| numbered_vip(&template, i)).collect();
            }),
            "vip"
        );
    }

    #[test]
    fn vip_name_must_not_be_empty() {
        assert_eq!(rejected_field(|c| c.vips[0].name.clear()), "vip[0].name");
    }

    #[test]
    fn vip_name_charset() {
        let mut config = minimal();
        config.vips[0].name = "Web_1.prod-a".into();
        config.validate().unwrap();
        for bad in ["web 1", "web/1", "wéb", "web\"", "web{x}"] {
            assert_eq!(
                rejected_field(|c| c.vips[0].name = bad.into()),
                "vip[0].name",
                "name {bad:?}"
            );
        }
    }

    #[test]
    fn vip_names_unique() {
        let field = rejected_field(|c| {
            let mut second = c.vips[0].clone();
            second.port = 443;
            c.vips.push(second);
        });
        assert_eq!(field, "vip[1].name");
    }

    #[test]
    fn vip_address_port_protocol_unique() {
        let field = rejected_field(|c| {
            let mut second = c.vips[0].clone();
            second.name = "web2".into();
            c.vips.push(second);
        });
        assert_eq!(field, "vip[1]");

        // The same address and port with another protocol is a different service.
        let mut config = minimal();
        let mut udp = config.vips[0].clone();
        udp.name = "web-udp".into();
        udp.protocol = Protocol::Udp;
        config.vips.push(udp);
        config.validate().unwrap();
    }

    #[test]
    fn vip_port_not_zero() {
        assert_eq!(rejected_field(|c| c.vips[0].port = 0), "vip[0].port");
    }

    #[test]
    fn vip_address_must_be_usable() {
        for bad in ["0.0.0.0", "255.255.255.255", "224.0.0.1", "::", "ff02::1"] {
            assert_eq!(
                rejected_field(|c| c.vips[0].address = bad.parse().unwrap()),
                "vip[0].address",
                "address {bad}"
            );
        }
    }

    #[test]
    fn vip_address_must_not_be_loopback() {
        for bad in ["127.0.0.1", "127.1.2.3", "::1"] {
            assert_eq!(
                rejected_field(|c| c.vips[0].address = bad.parse().unwrap()),
                "vip[0].address",
                "address {bad}"
            );
        }
    }

    #[test]
    fn backend_address_must_not_be_loopback() {
        for bad in ["127.0.0.1", "127.9.9.9"] {
            assert_eq!(
                rejected_field(|c| c.vips[0].backends[0].address = bad.parse().unwrap()),
                "vip[0].backend[0].address",
                "address {bad}"
            );
        }
        let field = rejected_field(|c| {
            c.vips[0].address = "2001:db8::100".parse().unwrap();
            c.vips[0].backends[0].address = "::1".parse().unwrap();
        });
        assert_eq!(field, "vip[0].backend[0].address");
    }

    #[test]
    fn backend_must_not_be_a_vip_address() {
        // Its own VIP's address.
        assert_eq!(
            rejected_field(|c| c.vips[0].backends[0].address = c.vips[0].address),
            "vip[0].backend[0].address"
        );
        // Another VIP's, named in the reason.
        let mut config = minimal();
        let mut second = config.vips[0].clone();
        second.name = "api".into();
        second.address = "10.0.0.200".parse().unwrap();
        config.vips.push(second);
        config.vips[0].backends.push(backend("10.0.0.200"));
        match config.validate() {
            Err(ConfigError::Invalid { field, reason }) => {
                assert_eq!(field, "vip[0].backend[1].address");
                assert!(
                    reason.contains("vip[1]") && reason.contains("api"),
                    "{reason}"
                );
            }
            other => panic!("expected a validation error, got {other:?}"),
        }
    }

    #[test]
    fn backend_must_not_be_the_balancers_own_address() {
        let config = minimal();
        let own: Vec<IpAddr> = ["10.0.0.2", "fe80::1"]
            .iter()
            .map(|a| a.parse().unwrap())
            .collect();
        config.validate_host(&own).unwrap();
        let mut mine = config.clone();
        mine.vips[0].backends.push(backend("10.0.0.2"));
        match mine.validate_host(&own) {
            Err(ConfigError::Invalid { field, reason }) => {
                assert_eq!(field, "vip[0].backend[1].address");
                assert!(reason.contains("dataplane.interface eth0"), "{reason}");
            }
            other => panic!("expected a validation error, got {other:?}"),
        }
    }

    #[test]
    fn durations_must_lie_between_10ms_and_a_day() {
        let too_short = Duration::from_millis(9);
        let too_long = MAX_DURATION + Duration::from_millis(1);
        for bad in [too_short, too_long] {
            assert_eq!(
                rejected_field(|c| c.vips[0].health.interval = bad),
                "vip[0].health.interval"
            );
            assert_eq!(
                rejected_field(|c| c.vips[0].health.fast_interval = Some(bad)),
                "vip[0].health.fast_interval"
            );
            assert_eq!(
                rejected_field(|c| c.vips[0].health.down_interval = Some(bad)),
                "vip[0].health.down_interval"
            );
            assert_eq!(
                rejected_field(|c| c.vips[0].drain_timeout = bad),
                "vip[0].drain_timeout"
            );
            assert_eq!(
                rejected_field(|c| c.dataplane.flow_idle_timeout = bad),
                "dataplane.flow_idle_timeout"
            );
            assert_eq!(
                rejected_field(|c| c.announce = Some(AnnounceConfig {
                    warmup: bad,
                    ..AnnounceConfig::default()
                })),
                "announce.warmup"
            );
        }
        assert_eq!(
            rejected_field(|c| c.vips[0].health.timeout = too_short),
            "vip[0].health.timeout"
        );
        // The bounds themselves are accepted, and no warm-up at all.
        let mut config = minimal();
        config.vips[0].health.interval = MAX_DURATION;
        config.vips[0].health.timeout = MIN_DURATION;
        config.vips[0].drain_timeout = MIN_DURATION;
        config.announce = Some(AnnounceConfig {
            warmup: Duration::ZERO,
            ..AnnounceConfig::default()
        });
        config.validate().unwrap();
    }

    #[test]
    fn an_interval_of_ages_is_refused_with_its_field() {
        let text = MINIMAL.replace(
            "[[vip.backend]]",
            "[vip.health]\ninterval = \"100000000000days\"\n\n[[vip.backend]]",
        );
        match Config::from_toml(&text) {
            Err(error @ ConfigError::Invalid { .. }) => {
                let message = error.to_string();
                assert!(message.starts_with("`vip[0].health.interval`"), "{message}");
                assert!(message.contains("1day"), "{message}");
            }
            other => panic!("expected a validation error, got {other:?}"),
        }
    }

    #[test]
    fn errors_index_the_vip() {
        let field = rejected_field(|c| {
            let mut second = c.vips[0].clone();
            second.name = "second".into();
            second.port = 443;
            second.backends[0].weight = 0;
            c.vips.push(second);
        });
        assert_eq!(field, "vip[1].backend[0].weight");
    }

    // --- health ---

    #[test]
    fn health_interval_positive() {
        assert_eq!(
            rejected_field(|c| c.vips[0].health.interval = Duration::ZERO),
            "vip[0].health.interval"
        );
    }

    #[test]
    fn health_timeout_positive() {
        assert_eq!(
            rejected_field(|c| c.vips[0].health.timeout = Duration::ZERO),
            "vip[0].health.timeout"
        );
    }

    #[test]
    fn health_timeout_not_above_interval() {
        let mut config = minimal();
        config.vips[0].health.timeout = config.vips[0].health.interval;
        config.validate().unwrap();
        assert_eq!(
            rejected_field(|c| c.vips[0].health.timeout = Duration::from_millis(2001)),
            "vip[0].health.timeout"
        );
    }

    #[test]
    fn health_rise_at_least_one() {
        assert_eq!(
            rejected_field(|c| c.vips[0].health.rise = 0),
            "vip[0].health.rise"
        );
    }

    #[test]
    fn health_fall_at_least_one() {
        assert_eq!(
            rejected_field(|c| c.vips[0].health.fall = 0),
            "vip[0].health.fall"
        );
    }

    #[test]
    fn health_port_not_zero() {
        assert_eq!(
            rejected_field(|c| c.vips[0].health.port = Some(0)),
            "vip[0].health.port"
        );
    }

    #[test]
    fn health_path_only_for_http() {
        for kind in [HealthKind::Tcp, HealthKind::None] {
            assert_eq!(
                rejected_field(|c| {
                    c.vips[0].health.kind = kind;
                    c.vips[0].health.path = Some("/healthz".into());
                }),
                "vip[0].health.path"
            );
        }
    }

    /// `kind = "https"` (issue 35): its keys parse; on another kind, or set so that they
    /// cannot work, they are refused by their field.
    #[test]
    fn https_checks_take_sni_verify_and_ca_file() {
        let with_health = |lines: &str| {
            MINIMAL.replace(
                "protocol = \"tcp\"\n",
                &format!("protocol = \"tcp\"\n[vip.health]\n{lines}\n"),
            )
        };
        let text = with_health(
            "kind = \"https\"\npath = \"/healthz\"\nsni = \"app.example.com\"\n\
             ca_file = \"/etc/lb/ca.pem\"",
        );
        let config = Config::from_toml(&text).unwrap();
        let health = &config.vips[0].health;
        assert_eq!(health.kind, HealthKind::Https);
        assert_eq!(health.sni.as_deref(), Some("app.example.com"));
        assert!(health.verify() && health.is_http());
        assert_eq!(health.ca_file_to_read(), Some(Path::new("/etc/lb/ca.pem")));
        let https = |c: &mut Config| c.vips[0].health.kind = HealthKind::Https;
        // Only for https.
        for kind in [HealthKind::Tcp, HealthKind::Http, HealthKind::Dns] {
            let on = |c: &mut Config| c.vips[0].health.kind = kind;
            assert_eq!(
                rejected_field(|c| {
                    on(c);
                    c.vips[0].health.sni = Some("a.example".into());
                }),
                "vip[0].health.sni"
            );
            assert_eq!(
                rejected_field(|c| {
                    on(c);
                    c.vips[0].health.verify = Some(true);
                }),
                "vip[0].health.verify"
            );
            assert_eq!(
                rejected_field(|c| {
                    on(c);
                    c.vips[0].health.ca_file = Some("/etc/lb/ca.pem".into());
                }),
                "vip[0].health.ca_file"
            );
        }
        for sni in ["10.0.0.11", "not a name", "", "::1"] {
            let error =
                Config::from_toml(&with_health(&format!("kind = \"https\"\nsni = {sni:?}")))
                    .unwrap_err();
            assert!(
                matches!(&error, ConfigError::Invalid { field, .. } if field == "vip[0].health.sni"),
                "{sni}: {error}"
            );
        }
        assert_eq!(
            rejected_field(|c| {
                https(c);
                c.vips[0].health.ca_file = Some("ca.pem".into());
            }),
            "vip[0].health.ca_file"
        );
        assert_eq!(
            rejected_field(|c| {
                https(c);
                c.vips[0].health.verify = Some(false);
                c.vips[0].health.ca_file = Some("/etc/lb/ca.pem".into());
            }),
            "vip[0].health.ca_file"
        );
        assert_eq!(
            rejected_field(|c| {
                https(c);
                c.vips[0].health.target = HealthTarget::Vip;
            }),
            "vip[0].health.target"
        );
        // verify = false on its own is fine, and reads no CA file.
        let mut config = minimal();
        https(&mut config);
        config.vips[0].health.verify = Some(false);
        config.validate().unwrap();
        assert_eq!(config.vips[0].health.ca_file_to_read(), None);
    }

    #[test]
    fn health_path_starts_with_slash() {
        assert_eq!(
            rejected_field(|c| {
                c.vips[0].health.kind = HealthKind::Http;
                c.vips[0].health.path = Some("healthz".into());
            }),
            "vip[0].health.path"
        );
    }

    #[test]
    fn health_path_without_whitespace() {
        assert_eq!(
            rejected_field(|c| {
                c.vips[0].health.kind = HealthKind::Http;
                c.vips[0].health.path = Some("/a\r\nHost: x".into());
            }),
            "vip[0].health.path"
        );
    }

    #[test]
    fn http_path_defaults_to_root() {
        let mut config = minimal();
        config.vips[0].health.kind = HealthKind::Http;
        config.validate().unwrap();
        assert_eq!(config.vips[0].health.http_path(), "/");
    }

    #[test]
    fn health_expect_status_is_an_http_status() {
        for status in [0, 99, 600] {
            assert_eq!(
                rejected_field(|c| c.vips[0].health.expect_status = status),
                "vip[0].health.expect_status",
                "status {status}"
            );
        }
        for status in [100, 204, 599] {
            let mut config = minimal();
            config.vips[0].health.expect_status = status;
            config.validate().unwrap();
        }
    }

    // --- backends ---

    #[test]
    fn backend_family_matches_vip() {
        assert_eq!(
            rejected_field(|c| c.vips[0].backends.push(backend("2001:db8::1"))),
            "vip[0].backend[1].address"
        );
    }

    #[test]
    fn backend_addresses_unique_within_vip() {
        assert_eq!(
            rejected_field(|c| c.vips[0].backends.push(backend("10.0.0.11"))),
            "vip[0].backend[1].address"
        );

        // The same backend may serve several VIPs.
        let mut config = minimal();
        let mut second = config.vips[0].clone();
        second.name = "web2".into();
        second.port = 443;
        config.vips.push(second);
        config.validate().unwrap();
    }

    #[test]
    fn backend_weight_not_zero() {
        assert_eq!(
            rejected_field(|c| c.vips[0].backends[0].weight = 0),
            "vip[0].backend[0].weight"
        );
    }

    #[test]
    fn backend_weight_at_most_max() {
        let mut config = minimal();
        config.vips[0].backends[0].weight = MAX_WEIGHT;
        config.validate().unwrap();
        assert_eq!(
            rejected_field(|c| c.vips[0].backends[0].weight = MAX_WEIGHT + 1),
            "vip[0].backend[0].weight"
        );
    }

    #[test]
    fn backend_address_must_be_usable() {
        for bad in ["0.0.0.0", "255.255.255.255", "239.1.2.3"] {
            assert_eq!(
                rejected_field(|c| c.vips[0].backends[0].address = bad.parse().unwrap()),
                "vip[0].backend[0].address",
                "address {bad}"
            );
        }
        for bad in ["::", "ff02::1"] {
            let field = rejected_field(|c| {
                c.vips[0].address = "2001:db8::100".parse().unwrap();
                c.vips[0].backends[0].address = bad.parse().unwrap();
            });
            assert_eq!(field, "vip[0].backend[0].address", "address {bad}");
        }
    }

    #[test]
    fn backend_mac_must_be_unicast() {
        for bad in [[0xff; 6], [0x01, 0, 0x5e, 0, 0, 1], [0; 6]] {
            assert_eq!(
                rejected_field(|c| c.vips[0].backends[0].mac = Some(MacAddr(bad))),
                "vip[0].backend[0].mac"
            );
        }
    }

    fn backends(count: usize) -> Vec<BackendConfig> {
        (0..count)
            .map(|i| backend(&Ipv4Addr::from(0x0a01_0000 + i as u32 + 1).to_string()))
            .collect()
    }

    #[test]
    fn at_most_max_backends_in_total() {
        let mut config = minimal();
        let mut second = config.vips[0].clone();
        second.name = "web2".into();
        second.port = 443;
        config.vips.push(second);
        config.vips[0].backends = backends(MAX_BACKENDS / 2);
        config.vips[1].backends = backends(MAX_BACKENDS / 2);
        config.validate().unwrap();

        config.vips[1].backends = backends(MAX_BACKENDS / 2 + 1);
        assert!(matches!(
            config.validate(),
            Err(ConfigError::Invalid { field, .. }) if field == "vip[1].backend"
        ));
    }

    #[test]
    fn backends_fewer_than_maglev_table_size() {
        let mut config = minimal();
        config.dataplane.maglev_table_size = 7;
        config.vips[0].backends = backends(6);
        config.validate().unwrap();
        assert_eq!(
            rejected_field(|c| {
                c.dataplane.maglev_table_size = 7;
                c.vips[0].backends = backends(7);
            }),
            "vip[0].backend"
        );
    }

    // --- cluster ---

    #[test]
    fn cluster_section_gets_defaults_and_checks_its_fields() {
        let text = format!(
            "{MINIMAL}\n[cluster]\npeers = [\"10.0.0.12\", \"10.0.0.13\"]\nkey_file = \"/etc/lb/cluster.key\"\n"
        );
        let cluster = Config::from_toml(&text).unwrap().cluster.unwrap();
        assert_eq!(cluster.port, 4790);
        assert_eq!(cluster.learn_timeout, Duration::from_secs(3));
        assert_eq!(cluster.address, None);
        assert_eq!(cluster.peers.len(), 2);
        assert_eq!(minimal().cluster, None, "nothing is shared by default");
        let with = |change: fn(&mut ClusterConfig)| {
            move |c: &mut Config| {
                let mut cluster = ClusterConfig {
                    peers: vec!["10.0.0.12".parse().unwrap()],
                    port: 4790,
                    key_file: "/etc/lb/cluster.key".into(),
                    address: None,
                    learn_timeout: Duration::from_secs(3),
                    transfer_rate: 250_000,
                };
                change(&mut cluster);
                c.cluster = Some(cluster);
            }
        };
        assert_eq!(cluster.transfer_rate, 250_000);
        assert_eq!(rejected_field(with(|c| c.port = 0)), "cluster.port");
        assert_eq!(
            rejected_field(with(|c| c.transfer_rate = 999)),
            "cluster.transfer_rate"
        );
        assert_eq!(
            rejected_field(with(|c| c.key_file = "cluster.key".into())),
            "cluster.key_file"
        );
        assert_eq!(
            rejected_field(with(|c| c.peers.push("127.0.0.1".parse().unwrap()))),
            "cluster.peers[1]"
        );
        assert_eq!(
            rejected_field(with(|c| c.peers.push("10.0.0.12".parse().unwrap()))),
            "cluster.peers[1]"
        );
        assert_eq!(
            rejected_field(with(|c| c.peers.push("fd00::12".parse().unwrap()))),
            "cluster.peers"
        );
        assert_eq!(
            rejected_field(with(|c| c.address = Some("fd00::1".parse().unwrap()))),
            "cluster.address"
        );
        // A reload may change the peers, and nothing else of the section.
        let mut old = minimal();
        with(|_| {})(&mut old);
        let mut new = old.clone();
        new.cluster
            .as_mut()
            .unwrap()
            .peers
            .push("10.0.0.13".parse().unwrap());
        assert_eq!(old.restart_only_change(&new), None);
        new.cluster.as_mut().unwrap().port = 4791;
        assert_eq!(
            old.restart_only_change(&new),
            Some("cluster (all but peers)")
        );
        assert_eq!(
            old.restart_only_change(&minimal()),
            Some("cluster (all but peers)")
        );
    }

    // --- announce ---

    #[test]
    fn announce_section_gets_defaults_and_takes_its_fields() {
        let config = Config::from_toml(&format!("{MINIMAL}\n[announce]\n")).unwrap();
        assert_eq!(config.announce, Some(AnnounceConfig::default()));
        let announce = AnnounceConfig::default();
        assert_eq!(
            (announce.table, announce.protocol, announce.warmup),
            (4242, 249, Duration::from_secs(5))
        );
        assert_eq!(announce.device, "lb-vips");
        let text = format!(
            "{MINIMAL}\n[announce]\ntable = 100\nprotocol = 200\nwarmup = \"1s\"\ndevice = \"vips0\"\n"
        );
        assert_eq!(
            Config::from_toml(&text).unwrap().announce,
            Some(AnnounceConfig {
                table: 100,
                protocol: 200,
                warmup: Duration::from_secs(1),
                device: "vips0".into(),
            })
        );
        let unknown = parse_error(&format!("{MINIMAL}\n[announce]\nasn = 65000\n"));
        assert!(unknown.contains("asn"), "{unknown}");
    }

    #[test]
    fn announce_table_protocol_and_device_are_checked() {
        let with = |change: fn(&mut AnnounceConfig)| {
            move |c: &mut Config| {
                let mut announce = AnnounceConfig::default();
                change(&mut announce);
                c.announce = Some(announce);
            }
        };
        for table in [0, 253, 254, 255] {
            let mut config = minimal();
            config.announce = Some(AnnounceConfig {
                table,
                ..AnnounceConfig::default()
            });
            assert!(
                matches!(config.validate(), Err(ConfigError::Invalid { field, .. }) if field == "announce.table"),
                "table {table}"
            );
        }
        assert_eq!(
            rejected_field(with(|a| a.protocol = 4)),
            "announce.protocol"
        );
        assert_eq!(
            rejected_field(with(|a| a.protocol = 12)),
            "announce.protocol"
        );
        assert_eq!(
            rejected_field(with(|a| a.device = String::new())),
            "announce.device"
        );
        assert_eq!(
            rejected_field(with(|a| a.device = "a-name-that-is-too-long".into())),
            "announce.device"
        );
        assert_eq!(
            rejected_field(with(|a| a.device = "eth0".into())),
            "announce.device"
        );
    }

    #[test]
    fn min_healthy_defaults_to_one_and_must_be_at_least_one() {
        assert_eq!(minimal().vips[0].min_healthy, 1);
        let text = MINIMAL.replace("protocol = \"tcp\"", "protocol = \"tcp\"\nmin_healthy = 3");
        assert_eq!(Config::from_toml(&text).unwrap().vips[0].min_healthy, 3);
        assert_eq!(
            rejected_field(|c| c.vips[0].min_healthy = 0),
            "vip[0].min_healthy"
        );
    }

    /// `[control]`: the operators' socket needs its group; paths are absolute.
    #[test]
    fn operators_socket_and_state_file_keys() {
        let config = Config::from_toml(&MINIMAL.replace(
            "[dataplane]",
            "[control]\noperators_group = \"lb\"\nstate_file = \"/var/lib/lb/x.json\"\n[dataplane]",
        ))
        .unwrap();
        assert_eq!(
            config.control.operators_socket(),
            Some(PathBuf::from("/run/lb/lb-operators.sock"))
        );
        assert_eq!(config.state_file(), PathBuf::from("/var/lib/lb/x.json"));
        assert_eq!(minimal().control.operators_socket(), None);
        assert_eq!(
            minimal().state_file(),
            PathBuf::from("/run/lb/lb.state.json")
        );
        assert_eq!(
            rejected_field(|c| c.control.operators_socket = Some("/run/lb/ops.sock".into())),
            "control.operators_socket"
        );
        assert_eq!(
            rejected_field(|c| {
                c.control.operators_group = Some("lb".into());
                c.control.operators_socket = Some(c.control.socket.clone());
            }),
            "control.operators_socket"
        );
        assert_eq!(
            rejected_field(|c| c.control.operators_group = Some("l b".into())),
            "control.operators_group"
        );
        assert_eq!(
            rejected_field(|c| c.control.state_file = Some("state.json".into())),
            "control.state_file"
        );
    }
}
