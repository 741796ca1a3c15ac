//! `[vip.health]` and `[vip.backend.health]`: the check kinds (tcp, http, https, udp,
//! dns, none), their fields, and their validation.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::values::{check_duration, duration, option_duration};
use super::{ConfigError, invalid};

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

display_as!(HealthKind { Tcp => "tcp", Http => "http", Https => "https", Udp => "udp", Dns => "dns", None => "none" });
display_as!(HealthTarget { Backend => "backend", Vip => "vip" });

/// Why a dns check's `query` or `query_type` cannot be sent.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DnsQueryError {
    #[error("{text:?} is not a DNS name: {why}")]
    Name { text: String, why: String },
    #[error("{text:?} is not a DNS record type (A, AAAA, NS, SOA, TXT ...)")]
    RecordType { text: String },
}

/// A name as `query` is written: absolute or relative, "." for the root.
pub fn parse_name(text: &str) -> Result<hickory_proto::rr::Name, DnsQueryError> {
    hickory_proto::rr::Name::from_ascii(text).map_err(|e| DnsQueryError::Name {
        text: text.into(),
        why: e.to_string(),
    })
}

/// A record type as `query_type` is written ("A", "AAAA", "NS", "SOA" ...).
pub fn parse_record_type(text: &str) -> Result<hickory_proto::rr::RecordType, DnsQueryError> {
    text.to_ascii_uppercase()
        .parse::<hickory_proto::rr::RecordType>()
        .map_err(|_| DnsQueryError::RecordType { text: text.into() })
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
            return Err(invalid(format!("{at}.query"), why.to_string()));
        }
        if let Some(kind) = &self.query_type
            && let Err(why) = parse_record_type(kind)
        {
            return Err(invalid(format!("{at}.query_type"), why.to_string()));
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

    pub(super) fn validate(&self, at: &str) -> Result<(), ConfigError> {
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
    use std::path::Path;
    use std::time::Duration;

    use super::*;
    use crate::config::testing::*;
    use crate::config::*;

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
}
