//! What the configuration's tests share: example files and the helpers that say which
//! field a configuration is refused for.

use std::net::Ipv4Addr;

use super::{AdminState, BackendConfig, ClusterConfig, Config, ConfigError};

/// The example from product.md, verbatim.
pub(super) const EXAMPLE: &str = r#"
[dataplane]
interface = "eth0"
xdp_mode = "auto"            # "native" | "generic" | "auto" (native, else generic)
# maglev_table_size = 65537  # a prime
# conntrack_entries = 1048576

[control]
socket = "/run/lb/lb.sock"   # created 0600: the control plane is root's alone
metrics = "127.0.0.1:9650"   # Prometheus text format at /metrics

[[vip]]
name = "web"
address = "10.0.0.100"       # IPv4 or IPv6
port = 80
protocol = "tcp"             # "tcp" | "udp"
# hash = "5-tuple"           # or "src-ip" (affinity)
# drain_timeout = "30s"

[vip.health]
kind = "tcp"                 # "tcp" | "http" | "none"
interval = "2s"
timeout = "1s"
rise = 2
fall = 3
# port = 8080                # default: the VIP's port, on the backend's own address
# path = "/healthz"          # http only
# expect_status = 200        # http only

[[vip.backend]]
address = "10.0.0.11"
weight = 1
# mac = "02:00:00:00:00:0b"  # optional: otherwise resolved from the neighbour table
# state = "ready"            # "ready" | "drain" | "maint"
"#;

pub(super) const MINIMAL: &str = r#"
[dataplane]
interface = "eth0"

[[vip]]
name = "web"
address = "10.0.0.100"
port = 80
protocol = "tcp"

[[vip.backend]]
address = "10.0.0.11"
"#;

pub(super) fn minimal() -> Config {
    Config::from_toml(MINIMAL).expect("minimal config is valid")
}

pub(super) fn backend(address: &str) -> BackendConfig {
    BackendConfig {
        address: address.parse().unwrap(),
        weight: 1,
        mac: None,
        state: AdminState::Ready,
        health: None,
        server_id: None,
    }
}

pub(super) fn backends(count: usize) -> Vec<BackendConfig> {
    (0..count)
        .map(|i| backend(&Ipv4Addr::from(0x0a01_0000 + i as u32 + 1).to_string()))
        .collect()
}

pub(super) fn parse_error(text: &str) -> String {
    match Config::from_toml(text) {
        Err(ConfigError::Parse(message)) => message,
        other => panic!("expected a parse error, got {other:?}"),
    }
}

/// Applies `change` to the minimal config and returns the field validation names.
pub(super) fn rejected_field(change: impl FnOnce(&mut Config)) -> String {
    let mut config = minimal();
    change(&mut config);
    match config.validate() {
        Err(ConfigError::Invalid { field, .. }) => field,
        other => panic!("expected a validation error, got {other:?}"),
    }
}

/// The field a configuration text is refused for.
pub(super) fn refused_field(text: &str) -> String {
    match Config::from_toml(text) {
        Err(ConfigError::Invalid { field, .. }) => field,
        other => panic!("expected a validation error, got {other:?}"),
    }
}

/// A `[cluster]` section with one peer and the defaults.
pub(super) fn cluster_section() -> ClusterConfig {
    ClusterConfig {
        peers: vec!["10.0.0.12".parse().unwrap()],
        port: 4790,
        key_file: "/etc/lb/cluster.key".into(),
        address: None,
        learn_timeout: std::time::Duration::from_secs(3),
        transfer_rate: 250_000,
    }
}
