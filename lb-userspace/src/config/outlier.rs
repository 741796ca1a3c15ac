//! `[vip.outlier]`: passive health, backends judged by their clients' TCP handshakes.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::values::{MAX_DURATION, check_duration, duration};
use super::{ConfigError, Protocol, VipConfig, invalid};

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

impl VipConfig {
    /// `[vip.outlier]`: settings that can work, on a TCP VIP.
    pub(super) fn validate_outlier(&self, at: &str) -> Result<(), ConfigError> {
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
