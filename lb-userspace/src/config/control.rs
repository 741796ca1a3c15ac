//! `[control]`: the control socket, the operators' socket, the state file and the
//! metrics endpoint.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::{ConfigError, invalid};

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

    pub(super) fn validate(&self) -> Result<(), ConfigError> {
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
#[cfg(test)]
mod tests {
    use std::net::SocketAddr;
    use std::path::PathBuf;

    use crate::config::testing::*;
    use crate::config::*;

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
