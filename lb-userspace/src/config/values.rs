//! How values are written in the file: durations (and the bounds every duration
//! setting keeps) and Ethernet addresses.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::ConfigError;
use super::invalid;

/// Shortest duration a setting accepts: below it, timers would spin.
pub const MIN_DURATION: Duration = Duration::from_millis(10);
/// Longest duration a setting accepts: beyond it, a timer that never fires in practice
/// (a typo such as `interval = "100000000000days"`) silently stops what it paces.
pub const MAX_DURATION: Duration = Duration::from_secs(24 * 60 * 60);

/// A duration setting must lie within [`MIN_DURATION`]..=[`MAX_DURATION`].
pub(super) fn check_duration(field: &str, value: Duration) -> Result<(), ConfigError> {
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

/// An Ethernet address, written `02:00:00:00:00:0b`.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct MacAddr(pub [u8; 6]);

impl MacAddr {
    pub(super) fn is_multicast(self) -> bool {
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
pub(super) mod duration {
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
pub(super) mod option_duration {
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
#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::config::testing::*;
    use crate::config::*;

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
}
