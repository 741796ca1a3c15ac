//! `[[vip]]` and `[[vip.backend]]`: a service and its backends, how packets reach them
//! (`forward`), how new flows are shared (`hash`, `balance`, `slow_start`, hot sources,
//! `[vip.agent]`), QUIC, and the checks of each VIP and backend on their own.

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::values::{MacAddr, check_duration, duration, option_duration};
use super::{ConfigError, HealthConfig, OutlierConfig, invalid};

/// Highest backend weight. Weights are relative; 1..=1000 is fine-grained enough for
/// any split and keeps weighted table population cheap.
pub const MAX_WEIGHT: u32 = 1000;

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
    /// TCP VIPs: a Maglev slot no recent table change touched sends its flows' packets
    /// where the table says, with no connection-table entry; only slots a change moved
    /// keep entries, until their flows idle (`lb_common::slot`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub stable_slots: bool,
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

display_as!(Protocol { Tcp => "tcp", Udp => "udp" });
display_as!(HashMode { FiveTuple => "5-tuple", SrcIp => "src-ip" });
display_as!(AdminState { Ready => "ready", Drain => "drain", Maint => "maint" });
display_as!(Balance { Maglev => "maglev", LeastFlows => "least-flows" });
display_as!(Forward { L2 => "l2", Ipip => "ipip", Gue => "gue" });

impl VipConfig {
    pub(super) fn validate(&self, at: &str, maglev_table_size: u32) -> Result<(), ConfigError> {
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
        self.validate_stable_slots(at)?;

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

    /// `stable_slots`: only where every flow's slot is fixed by its tuple and nothing
    /// counts the flows' entries. (`[cluster]` and `dataplane.max_backends` are checked
    /// with the other sections: `Config::validate_stable_slots`.)
    fn validate_stable_slots(&self, at: &str) -> Result<(), ConfigError> {
        if !self.stable_slots {
            return Ok(());
        }
        let field = format!("{at}.stable_slots");
        if self.protocol != Protocol::Tcp {
            return Err(invalid(
                field,
                format!(
                    "only for TCP VIPs (the VIP's protocol is \"{}\"): a UDP flow has no \
                     handshake to tell a new flow from an old one",
                    self.protocol
                ),
            ));
        }
        if self.balance == Balance::LeastFlows {
            return Err(invalid(
                field,
                "not with balance = \"least-flows\": its weights count connection-table \
                 entries, which flows in stable slots do not make",
            ));
        }
        if self.hot_source_share.is_some() {
            return Err(invalid(
                field,
                "not with hot_source_share: a hot source's flows are hashed per \
                 connection, so their slots move with the list of hot sources",
            ));
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

/// Why an address cannot be a VIP or a backend, if it cannot.
pub(super) fn unusable_address(addr: IpAddr) -> Option<String> {
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
#[cfg(test)]
mod tests {
    use std::net::IpAddr;
    use std::time::Duration;

    use super::*;
    use crate::config::testing::*;
    use crate::config::*;

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
    fn vip_without_backends_is_valid() {
        let mut config = minimal();
        config.vips[0].backends.clear();
        config.validate().unwrap();
    }

    #[test]
    fn protocol_numbers() {
        assert_eq!(Protocol::Tcp.number(), 6);
        assert_eq!(Protocol::Udp.number(), 17);
    }

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
    fn a_tunnelled_backend_takes_no_mac() {
        let field = rejected_field(|c| {
            c.vips[0].forward = Forward::Ipip;
            c.vips[0].backends[0].mac = Some(MacAddr([2, 0, 0, 0, 0, 0x0b]));
        });
        assert_eq!(field, "vip[0].backend[0].mac");
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

    #[test]
    fn stable_slots_are_off_by_default_and_a_tcp_vip_may_have_them() {
        assert!(!minimal().vips[0].stable_slots);
        let text = MINIMAL.replace(
            "protocol = \"tcp\"",
            "protocol = \"tcp\"\nstable_slots = true",
        );
        let config = Config::from_toml(&text).unwrap();
        assert!(config.vips[0].stable_slots);
        // With src-ip hashing (no hot sources) and the largest id a slot word holds.
        let mut config = minimal();
        config.vips[0].stable_slots = true;
        config.vips[0].hash = HashMode::SrcIp;
        config.dataplane.max_backends = lb_common::slot::MAX_ID + 1;
        config.validate().unwrap();
    }

    /// The field and the reason the minimal file with `stable_slots` is refused for once
    /// `change` is made.
    fn stable_slots_refusal(change: impl FnOnce(&mut Config)) -> (String, String) {
        let mut config = minimal();
        config.vips[0].stable_slots = true;
        change(&mut config);
        match config.validate() {
            Err(ConfigError::Invalid { field, reason }) => (field, reason),
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    /// Each refusal names the key and why.
    #[test]
    fn stable_slots_are_refused_where_flows_need_their_entries() {
        let cluster = cluster_section();
        for ((field, reason), why) in [
            (
                stable_slots_refusal(|c| c.vips[0].protocol = Protocol::Udp),
                "only for TCP VIPs",
            ),
            (
                stable_slots_refusal(|c| c.vips[0].balance = Balance::LeastFlows),
                "least-flows",
            ),
            (
                stable_slots_refusal(|c| {
                    c.vips[0].hash = HashMode::SrcIp;
                    c.vips[0].hot_source_share = Some(0.1);
                }),
                "hot_source_share",
            ),
            (
                stable_slots_refusal(|c| c.cluster = Some(cluster)),
                "not yet supported with [cluster]",
            ),
            (
                stable_slots_refusal(|c| c.dataplane.max_backends = lb_common::slot::MAX_ID + 2),
                "max_backends at most 65535",
            ),
        ] {
            assert_eq!(field, "vip[0].stable_slots", "{why}: {reason}");
            assert!(reason.contains(why), "{why}: {reason}");
        }
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
}
