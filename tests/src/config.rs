//! The agent's configuration as the lab writes it (the TOML of product.md).

use std::fmt::Write as _;
use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

/// `dataplane.xdp_mode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum XdpMode {
    Native,
    Generic,
    Auto,
}

impl XdpMode {
    pub fn as_str(self) -> &'static str {
        match self {
            XdpMode::Native => "native",
            XdpMode::Generic => "generic",
            XdpMode::Auto => "auto",
        }
    }
}

impl std::str::FromStr for XdpMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "native" => Ok(XdpMode::Native),
            "generic" => Ok(XdpMode::Generic),
            "auto" => Ok(XdpMode::Auto),
            _ => Err(format!("unknown xdp mode {s:?} (native, generic or auto)")),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    Tcp,
    Udp,
}

impl Protocol {
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
        }
    }
}

/// `[vip.health]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Health {
    None,
    Tcp {
        interval: Duration,
        timeout: Duration,
        rise: u32,
        fall: u32,
        port: Option<u16>,
    },
    Http {
        interval: Duration,
        timeout: Duration,
        rise: u32,
        fall: u32,
        port: Option<u16>,
        path: String,
        expect_status: u16,
    },
    /// The `[vip.health]` table's lines as written (`kind = "dns"`, ...).
    Lines(Vec<String>),
}

/// The timing of a check: `interval`, `timeout`, `rise`, `fall`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CheckTiming {
    pub interval: Duration,
    pub timeout: Duration,
    pub rise: u32,
    pub fall: u32,
}

impl CheckTiming {
    /// The agent's default `fast_interval`: a quarter of the interval.
    pub fn fast_interval(&self) -> Duration {
        self.interval / 4
    }
}

impl Health {
    /// A TCP check fast enough for tests: every 200ms, 100ms timeout, rise 2, fall 2.
    pub fn fast_tcp() -> Health {
        Health::tcp(CheckTiming {
            interval: Duration::from_millis(200),
            timeout: Duration::from_millis(100),
            rise: 2,
            fall: 2,
        })
    }

    /// The lab's TCP check: every second, 500ms timeout, rise 2, fall 2.
    pub fn lab_tcp() -> Health {
        Health::tcp(CheckTiming {
            interval: Duration::from_secs(1),
            timeout: Duration::from_millis(500),
            rise: 2,
            fall: 2,
        })
    }

    /// A TCP check of the VIP's port (on the backend's own address).
    pub fn tcp(t: CheckTiming) -> Health {
        Health::Tcp {
            interval: t.interval,
            timeout: t.timeout,
            rise: t.rise,
            fall: t.fall,
            port: None,
        }
    }

    /// An HTTP check of `GET path` on `port` (`None`: the VIP's port), wanting
    /// `expect_status`.
    pub fn http(t: CheckTiming, port: Option<u16>, path: &str, expect_status: u16) -> Health {
        Health::Http {
            interval: t.interval,
            timeout: t.timeout,
            rise: t.rise,
            fall: t.fall,
            port,
            path: path.into(),
            expect_status,
        }
    }

    /// The timing of a check (`None` for kind none, and for lines as written).
    pub fn timing(&self) -> Option<CheckTiming> {
        match *self {
            Health::None | Health::Lines(_) => None,
            Health::Tcp {
                interval,
                timeout,
                rise,
                fall,
                ..
            }
            | Health::Http {
                interval,
                timeout,
                rise,
                fall,
                ..
            } => Some(CheckTiming {
                interval,
                timeout,
                rise,
                fall,
            }),
        }
    }
}

/// One `[[vip.backend]]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BackendConfig {
    pub address: IpAddr,
    pub weight: u32,
    /// `None`: the agent resolves it from the neighbour table.
    pub mac: Option<String>,
    /// `None`: the default ("ready").
    pub state: Option<String>,
    /// With the VIP's `quic = true`: the server ID its connection IDs carry.
    pub server_id: Option<u64>,
}

impl BackendConfig {
    pub fn new(address: IpAddr) -> BackendConfig {
        BackendConfig {
            address,
            weight: 1,
            mac: None,
            state: None,
            server_id: None,
        }
    }
}

/// One `[[vip]]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VipConfig {
    pub name: String,
    pub address: IpAddr,
    pub port: u16,
    pub protocol: Protocol,
    /// `None`: the default ("5-tuple").
    pub hash: Option<String>,
    pub drain_timeout: Option<Duration>,
    pub health: Health,
    pub backends: Vec<BackendConfig>,
    /// More `key = value` lines of the `[[vip]]` table, as written (`slow_start = "4s"`,
    /// `agent = { port = 4500 }`).
    pub extra: Vec<String>,
}

/// The whole file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AgentConfig {
    pub interface: String,
    pub xdp_mode: XdpMode,
    /// `None`: the agent's default.
    pub maglev_table_size: Option<u32>,
    /// `None`: the agent's default.
    pub conntrack_entries: Option<u32>,
    /// `dataplane.flow_idle_timeout`; `None`: the agent's default.
    pub flow_idle_timeout: Option<Duration>,
    pub socket: PathBuf,
    /// A listen address, or "off".
    pub metrics: String,
    pub vips: Vec<VipConfig>,
}

fn dur(d: Duration) -> String {
    format!("{}ms", d.as_millis())
}

/// A TOML basic string (the values here never hold control characters).
fn q(s: &str) -> String {
    format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))
}

impl AgentConfig {
    /// [`AgentConfig::to_toml`] with `dataplane.pin_path = pins` (the restart tests'
    /// pins on a bpffs that outlives the agent, see `router::PinDir`).
    pub fn to_toml_pinned(&self, pins: &std::path::Path) -> String {
        self.to_toml().replacen(
            "[dataplane]\n",
            &format!("[dataplane]\npin_path = \"{}\"\n", pins.display()),
            1,
        )
    }

    pub fn to_toml(&self) -> String {
        let mut t = String::new();
        // Writing to a String cannot fail.
        let _ = writeln!(t, "[dataplane]");
        let _ = writeln!(t, "interface = {}", q(&self.interface));
        let _ = writeln!(t, "xdp_mode = {}", q(self.xdp_mode.as_str()));
        if let Some(n) = self.maglev_table_size {
            let _ = writeln!(t, "maglev_table_size = {n}");
        }
        if let Some(n) = self.conntrack_entries {
            let _ = writeln!(t, "conntrack_entries = {n}");
        }
        if let Some(d) = self.flow_idle_timeout {
            let _ = writeln!(t, "flow_idle_timeout = {}", q(&dur(d)));
        }
        let _ = writeln!(t, "\n[control]");
        let _ = writeln!(t, "socket = {}", q(&self.socket.to_string_lossy()));
        let _ = writeln!(t, "metrics = {}", q(&self.metrics));
        for vip in &self.vips {
            let _ = writeln!(t, "\n[[vip]]");
            let _ = writeln!(t, "name = {}", q(&vip.name));
            let _ = writeln!(t, "address = {}", q(&vip.address.to_string()));
            let _ = writeln!(t, "port = {}", vip.port);
            let _ = writeln!(t, "protocol = {}", q(vip.protocol.as_str()));
            if let Some(hash) = &vip.hash {
                let _ = writeln!(t, "hash = {}", q(hash));
            }
            if let Some(d) = vip.drain_timeout {
                let _ = writeln!(t, "drain_timeout = {}", q(&dur(d)));
            }
            for line in &vip.extra {
                let _ = writeln!(t, "{line}");
            }
            let _ = writeln!(t, "\n[vip.health]");
            match &vip.health {
                Health::None => {
                    let _ = writeln!(t, "kind = \"none\"");
                }
                Health::Lines(lines) => {
                    for line in lines {
                        let _ = writeln!(t, "{line}");
                    }
                }
                Health::Tcp {
                    interval,
                    timeout,
                    rise,
                    fall,
                    port,
                } => {
                    let _ = writeln!(t, "kind = \"tcp\"");
                    let _ = writeln!(t, "interval = {}", q(&dur(*interval)));
                    let _ = writeln!(t, "timeout = {}", q(&dur(*timeout)));
                    let _ = writeln!(t, "rise = {rise}\nfall = {fall}");
                    if let Some(p) = port {
                        let _ = writeln!(t, "port = {p}");
                    }
                }
                Health::Http {
                    interval,
                    timeout,
                    rise,
                    fall,
                    port,
                    path,
                    expect_status,
                } => {
                    let _ = writeln!(t, "kind = \"http\"");
                    let _ = writeln!(t, "interval = {}", q(&dur(*interval)));
                    let _ = writeln!(t, "timeout = {}", q(&dur(*timeout)));
                    let _ = writeln!(t, "rise = {rise}\nfall = {fall}");
                    if let Some(p) = port {
                        let _ = writeln!(t, "port = {p}");
                    }
                    let _ = writeln!(t, "path = {}", q(path));
                    let _ = writeln!(t, "expect_status = {expect_status}");
                }
            }
            for b in &vip.backends {
                let _ = writeln!(t, "\n[[vip.backend]]");
                let _ = writeln!(t, "address = {}", q(&b.address.to_string()));
                let _ = writeln!(t, "weight = {}", b.weight);
                if let Some(mac) = &b.mac {
                    let _ = writeln!(t, "mac = {}", q(mac));
                }
                if let Some(state) = &b.state {
                    let _ = writeln!(t, "state = {}", q(state));
                }
                if let Some(id) = b.server_id {
                    let _ = writeln!(t, "server_id = {id}");
                }
            }
        }
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_the_product_format() {
        let cfg = AgentConfig {
            interface: "eth0".into(),
            xdp_mode: XdpMode::Native,
            maglev_table_size: None,
            conntrack_entries: Some(4096),
            flow_idle_timeout: None,
            socket: "/tmp/x/lb.sock".into(),
            metrics: "off".into(),
            vips: vec![VipConfig {
                name: "web".into(),
                address: "10.99.0.100".parse().unwrap(),
                port: 80,
                protocol: Protocol::Tcp,
                hash: None,
                drain_timeout: Some(Duration::from_secs(2)),
                health: Health::fast_tcp(),
                backends: vec![BackendConfig::new("10.99.0.11".parse().unwrap())],
                extra: Vec::new(),
            }],
        };
        let text = cfg.to_toml();
        for line in [
            "[dataplane]\ninterface = \"eth0\"\nxdp_mode = \"native\"\nconntrack_entries = 4096\n",
            "[control]\nsocket = \"/tmp/x/lb.sock\"\nmetrics = \"off\"",
            "[[vip]]\nname = \"web\"\naddress = \"10.99.0.100\"\nport = 80\nprotocol = \"tcp\"",
            "drain_timeout = \"2000ms\"",
            "[vip.health]\nkind = \"tcp\"\ninterval = \"200ms\"\ntimeout = \"100ms\"\nrise = 2\nfall = 2",
            "[[vip.backend]]\naddress = \"10.99.0.11\"\nweight = 1\n",
        ] {
            assert!(text.contains(line), "missing {line:?} in:\n{text}");
        }
        assert!(!text.contains("mac"), "{text}");
        assert!(!text.contains("maglev_table_size"), "{text}");
    }
}
