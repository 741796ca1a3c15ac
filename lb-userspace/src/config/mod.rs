//! The agent's configuration file (TOML), as documented in product.md "Configuration".
//!
//! Parsing and validation are separate steps so that `lb check`, startup and a reload
//! all reject a bad file the same way, before anything in the data path changes.
//! Every validation error names the field by its path (`vip[1].backend[0].weight`),
//! because that is what a user needs to find the mistake.
//!
//! One file per part of the file, each with its types, defaults, validation and tests:
//! `dataplane` (`[dataplane]`), `control` (`[control]`), `announce` (`[announce]`),
//! `cluster` (`[cluster]`), `debug` (`[debug]`), `vip` (`[[vip]]`, `[[vip.backend]]`,
//! QUIC), `health` (`[vip.health]`: the check kinds), `outlier` (`[vip.outlier]`),
//! `values` (durations, MAC addresses) and `host` (the checks against this host's
//! addresses and routes). This file holds `Config`: reading, parsing, the checks across
//! sections and VIPs, and which settings only a restart changes.

use std::collections::HashMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The strings must match the serde names above; `display_matches_serde` checks it.
macro_rules! display_as {
    ($ty:ty { $($variant:ident => $text:literal),+ $(,)? }) => {
        impl std::fmt::Display for $ty {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                // `pad`, so that widths (`{:<8}`) apply.
                f.pad(match self {
                    $(Self::$variant => $text),+
                })
            }
        }
    };
}
mod announce;
mod cluster;
mod control;
mod dataplane;
mod debug;
mod health;
mod host;
mod outlier;
#[cfg(test)]
mod testing;
mod values;
mod vip;

pub use announce::{AnnounceConfig, same_routes};
pub use cluster::ClusterConfig;
pub use control::ControlConfig;
pub use dataplane::{
    DataplaneConfig, MAX_MAGLEV_TABLE_SIZE, MIN_MAGLEV_TABLE_SIZE, XdpModeSetting,
};
pub use debug::DebugConfig;
pub use health::{
    DnsQueryError, HealthConfig, HealthKind, HealthTarget, parse_name, parse_record_type,
};
pub use outlier::{OUTLIER_SAMPLE, OutlierConfig};
pub use values::{MAX_DURATION, MIN_DURATION, MacAddr, ParseMacError};
pub use vip::{
    AdminState, AgentCheckConfig, BackendConfig, Balance, DEFAULT_GUE_PORT,
    DEFAULT_QUIC_SERVER_ID_LEN, Forward, HashMode, MAX_WEIGHT, Protocol, VipConfig,
};

/// Most VIPs one agent serves; the data path's maps are sized for this.
pub const MAX_VIPS: usize = lb_common::MAX_VIPS as usize;
/// Most backends over all VIPs together by default (`dataplane.max_backends`).
pub const MAX_BACKENDS: usize = lb_common::MAX_BACKENDS as usize;

/// Largest configuration file read: a real one is a few KiB (a thousand backends are
/// about 60 KiB), and a file is read only this far, so a wrong path (a log, a device
/// such as /dev/zero) is refused at once instead of being read without end.
pub const MAX_CONFIG_BYTES: u64 = 4 * 1024 * 1024;

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
            ("dataplane.max_backends", d.max_backends != n.max_backends),
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
            self.validate_stable_slots(&at, vip)?;
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
            let max = self.dataplane.max_backends as usize;
            if total_backends > max {
                return Err(invalid(
                    format!("{at}.backend"),
                    format!(
                        "more than {max} backends in total over all VIPs \
                         ({total_backends} up to this VIP): raise dataplane.max_backends"
                    ),
                ));
            }
        }
        Ok(())
    }

    /// A VIP's `stable_slots` against the other sections (its own rules are
    /// `VipConfig::validate`'s).
    fn validate_stable_slots(&self, at: &str, vip: &VipConfig) -> Result<(), ConfigError> {
        if !vip.stable_slots {
            return Ok(());
        }
        if self.cluster.is_some() {
            return Err(invalid(
                format!("{at}.stable_slots"),
                "not yet supported with [cluster]: flows in stable slots make no \
                 connection-table entries, so the peers would not learn them",
            ));
        }
        // A slot's word names its backend in 16 bits (`lb_common::slot`).
        let ids = lb_common::slot::MAX_ID + 1;
        if self.dataplane.max_backends > ids {
            return Err(invalid(
                format!("{at}.stable_slots"),
                format!(
                    "needs dataplane.max_backends at most {ids} (it is {}): a stable \
                     slot names its backend in 16 bits",
                    self.dataplane.max_backends
                ),
            ));
        }
        Ok(())
    }
}
#[cfg(test)]
mod tests {
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
    use std::path::{Path, PathBuf};
    use std::time::Duration;

    use serde::Serialize;

    use super::*;
    use crate::config::testing::*;

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
                max_backends: 4096,
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
                stable_slots: false,
                backends: vec![backend("10.0.0.11")],
            }]
        );
        assert_eq!(config.announce, None, "nothing is announced by default");
        assert_eq!(config.vips[0].health_port(), 80);
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
    fn zero_vips_is_valid() {
        let config = Config::from_toml("[dataplane]\ninterface = \"eth0\"\n").unwrap();
        assert!(config.vips.is_empty());
        let config = Config::from_toml("vip = []\n[dataplane]\ninterface = \"eth0\"\n").unwrap();
        assert!(config.vips.is_empty());
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

    #[test]
    fn a_reload_may_change_forward_and_the_tunnel_sources() {
        let old = minimal();
        let mut new = minimal();
        new.dataplane.tunnel_source = Some("10.0.0.3".parse().unwrap());
        new.vips[0].forward = Forward::Gue;
        // Both are map contents (`LB_TUNNEL`, `LB_BACKENDS`), written at every reload.
        assert_eq!(old.restart_only_change(&new), None);
    }

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

        // A smaller data path holds fewer; a larger one more.
        config.dataplane.max_backends = 8;
        config.vips[0].backends = backends(4);
        config.vips[1].backends = backends(4);
        config.validate().unwrap();
        config.vips[1].backends = backends(5);
        assert!(matches!(
            config.validate(),
            Err(ConfigError::Invalid { field, reason })
                if field == "vip[1].backend" && reason.contains("dataplane.max_backends")
        ));
        config.dataplane.max_backends = 10_000;
        config.vips[1].backends = backends(MAX_BACKENDS);
        config.validate().unwrap();
    }
}
