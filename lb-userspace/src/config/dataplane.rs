//! `[dataplane]`: the interfaces, the XDP mode, the tables' sizes, the pins, the tunnel
//! sources and the next program.

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::values::{check_duration, duration};
use super::vip::unusable_address;
use super::{ConfigError, invalid};

/// Smallest accepted `dataplane.maglev_table_size`.
pub const MIN_MAGLEV_TABLE_SIZE: u32 = 7;
/// Largest accepted `dataplane.maglev_table_size`: the smallest prime above 2^22
/// (16 MiB per table of u32 slots). Far more slots than backends (`max_backends`) already
/// balance evenly; larger tables would only cost map memory and rebuild time.
pub const MAX_MAGLEV_TABLE_SIZE: u32 = 4_194_319;

/// Largest accepted `dataplane.max_backends`: the embryonic table (`lb_common::Embryo`)
/// keeps a backend id in 16 bits.
pub const MAX_MAX_BACKENDS: u32 = 1 << 16;

/// Linux interface names are at most IFNAMSIZ - 1 bytes.
const MAX_INTERFACE_NAME: usize = 15;

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
    /// Backend ids over all VIPs: sizes the backend maps when the program is loaded, and
    /// the ids the agent hands out (removed backends' ids are held for
    /// `flow_idle_timeout` before reuse, so a blue/green swap of a pool needs room for
    /// both pools for that long).
    #[serde(default = "default_max_backends")]
    pub max_backends: u32,
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
        // Linux 6.18 on numbers the initial network namespace 0xEFFFFFF9 (below every
        // number it hands out, so no other namespace has it on any kernel).
        const INITIAL_NET: u64 = 0xEFFF_FFF9;
        let ours = inode("/proc/self/ns/net");
        let initial = match (ours, inode("/proc/1/ns/net")) {
            (Some(ours), Some(init)) => ours == init,
            (Some(INITIAL_NET), None) | (None, _) => true,
            // Unreadable (a container, hidepid): other pins must not be shared by mistake.
            (Some(ours), None) => {
                static SAID: std::sync::Once = std::sync::Once::new();
                SAID.call_once(|| {
                    tracing::warn!(
                        "/proc/1/ns/net is unreadable, so whether this is the initial network \
                         namespace cannot be told: taking it as another one (pins in \
                         /sys/fs/bpf/lb/{}-ns{ours}; set dataplane.pin_path to choose)",
                        self.interface
                    )
                });
                false
            }
        };
        let name = match ours {
            Some(ours) if !initial => format!("{}-ns{ours}", self.interface),
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

fn default_max_backends() -> u32 {
    lb_common::MAX_BACKENDS
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

display_as!(XdpModeSetting { Native => "native", Generic => "generic", Auto => "auto" });

/// Why `name` cannot be a Linux interface name, if it cannot.
pub(super) fn bad_interface_name(name: &str) -> Option<String> {
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
    pub(super) fn settle_interfaces(&mut self) -> Result<(), ConfigError> {
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

    pub(super) fn validate(&self) -> Result<(), ConfigError> {
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
        if !(1..=MAX_MAX_BACKENDS).contains(&self.max_backends) {
            return Err(invalid(
                "dataplane.max_backends",
                format!(
                    "{} is outside 1..={MAX_MAX_BACKENDS} (the data path keeps a backend id \
                     in 16 bits)",
                    self.max_backends
                ),
            ));
        }
        Ok(())
    }
}

/// Why `source` cannot be the outer source of tunnel packets (`v4`: of IPv4 ones).
pub(super) fn bad_tunnel_source(source: IpAddr, v4: bool) -> Option<String> {
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
#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::testing::*;
    use crate::config::*;

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

    #[test]
    fn max_backends_within_bounds() {
        assert_eq!(minimal().dataplane.max_backends, lb_common::MAX_BACKENDS);
        for max in [1, 8, MAX_MAX_BACKENDS] {
            let mut config = minimal();
            config.dataplane.max_backends = max;
            config.validate().unwrap();
        }
        for max in [0, MAX_MAX_BACKENDS + 1] {
            assert_eq!(
                rejected_field(|c| c.dataplane.max_backends = max),
                "dataplane.max_backends",
                "{max}"
            );
        }
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
}
