//! `[debug]`: debugging aids, off by default.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::{ConfigError, invalid};

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
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
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
#[cfg(test)]
mod tests {
    use crate::config::testing::*;
    use crate::config::*;

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
}
