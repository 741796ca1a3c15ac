//! `[announce]`: announcing the VIPs to routers through a routing daemon.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::dataplane::bad_interface_name;
use super::values::{check_duration, duration};
use super::{ConfigError, invalid};

/// `[announce]`: the agent keeps one route per VIP address it serves in a kernel routing
/// table of its own, through a device of its own; a routing daemon (BIRD's `protocol
/// kernel` with `learn`) imports that table and announces the routes over BGP. See
/// `announce.rs` for when a VIP is announced.
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

/// Whether two configurations keep the same routes (table, protocol and device): the
/// announcer is set up once, so a reload must not change these.
pub fn same_routes(a: &Option<AnnounceConfig>, b: &Option<AnnounceConfig>) -> bool {
    let key =
        |c: &Option<AnnounceConfig>| c.as_ref().map(|c| (c.table, c.protocol, c.device.clone()));
    key(a) == key(b)
}

impl AnnounceConfig {
    pub(super) fn validate(&self, data_interface: &str) -> Result<(), ConfigError> {
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
#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::config::testing::*;
    use crate::config::*;

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
}
