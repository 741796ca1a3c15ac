//! `[cluster]`: nodes that serve the same VIPs share their connection-table entries.

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::values::{check_duration, duration};
use super::{ConfigError, invalid};

/// `[cluster]`: nodes that serve the same VIPs send each other the connection-table
/// entries they create (authenticated UDP), so a flow that the routers move to another
/// node keeps its backend whatever changed since it began. See `cluster.rs`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterConfig {
    /// The other nodes' addresses (this node's own may be listed too: it is skipped).
    pub peers: Vec<IpAddr>,
    /// The port, the same on every node: UDP for the new entries, TCP for the
    /// transfer of a table to a node that joins.
    #[serde(default = "default_cluster_port")]
    pub port: u16,
    /// The shared secret (at least 16 bytes; owned by root, mode 0600).
    pub key_file: PathBuf,
    /// The address the socket binds and sends from. Default: the first address of
    /// `dataplane.interface` in the peers' family.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<IpAddr>,
    /// A node that starts with an empty connection table learns its peers' and
    /// announces its VIPs (`[announce]`) only once every peer's table came; a peer from
    /// which nothing came for this long (silent, or stalled) is given up. A transfer
    /// that keeps delivering is never cut by it.
    #[serde(default = "default_learn_timeout", with = "duration")]
    pub learn_timeout: Duration,
    /// The most entries per second this node sends a joining peer (its table, over TCP):
    /// what a join may cost this node. Default 250,000 (100,000 entries in 0.4 s).
    #[serde(default = "default_transfer_rate")]
    pub transfer_rate: u64,
}

fn default_transfer_rate() -> u64 {
    250_000
}

fn default_cluster_port() -> u16 {
    4790
}

fn default_learn_timeout() -> Duration {
    Duration::from_secs(3)
}

impl ClusterConfig {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if self.port == 0 {
            return Err(invalid("cluster.port", "port 0 is not a fixed port"));
        }
        if !self.key_file.is_absolute() {
            return Err(invalid(
                "cluster.key_file",
                format!("{} is not an absolute path", self.key_file.display()),
            ));
        }
        check_duration("cluster.learn_timeout", self.learn_timeout)?;
        if self.transfer_rate < 1000 {
            return Err(invalid(
                "cluster.transfer_rate",
                format!(
                    "{} entries per second: at least 1000 (a join would take too long)",
                    self.transfer_rate
                ),
            ));
        }
        for (i, peer) in self.peers.iter().enumerate() {
            if peer.is_unspecified() || peer.is_loopback() || peer.is_multicast() {
                return Err(invalid(
                    format!("cluster.peers[{i}]"),
                    format!("{peer} is not a node's address"),
                ));
            }
            if self.peers[..i].contains(peer) {
                return Err(invalid(
                    format!("cluster.peers[{i}]"),
                    format!("{peer} is listed twice"),
                ));
            }
        }
        let families: std::collections::HashSet<bool> =
            self.peers.iter().map(IpAddr::is_ipv4).collect();
        if families.len() > 1 {
            return Err(invalid(
                "cluster.peers",
                "mixes IPv4 and IPv6 addresses; the nodes talk over one family",
            ));
        }
        if let (Some(address), Some(peer)) = (self.address, self.peers.first())
            && address.is_ipv4() != peer.is_ipv4()
        {
            return Err(invalid(
                "cluster.address",
                format!("{address} is not of the peers' address family"),
            ));
        }
        Ok(())
    }

    /// The settings a reload may not change: all but the peers.
    pub(super) fn fixed(&self) -> ClusterConfig {
        ClusterConfig {
            peers: Vec::new(),
            ..self.clone()
        }
    }
}
#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::config::testing::*;
    use crate::config::*;

    #[test]
    fn cluster_section_gets_defaults_and_checks_its_fields() {
        let text = format!(
            "{MINIMAL}\n[cluster]\npeers = [\"10.0.0.12\", \"10.0.0.13\"]\nkey_file = \"/etc/lb/cluster.key\"\n"
        );
        let cluster = Config::from_toml(&text).unwrap().cluster.unwrap();
        assert_eq!(cluster.port, 4790);
        assert_eq!(cluster.learn_timeout, Duration::from_secs(3));
        assert_eq!(cluster.address, None);
        assert_eq!(cluster.peers.len(), 2);
        assert_eq!(minimal().cluster, None, "nothing is shared by default");
        let with = |change: fn(&mut ClusterConfig)| {
            move |c: &mut Config| {
                let mut cluster = cluster_section();
                change(&mut cluster);
                c.cluster = Some(cluster);
            }
        };
        assert_eq!(cluster.transfer_rate, 250_000);
        assert_eq!(rejected_field(with(|c| c.port = 0)), "cluster.port");
        assert_eq!(
            rejected_field(with(|c| c.transfer_rate = 999)),
            "cluster.transfer_rate"
        );
        assert_eq!(
            rejected_field(with(|c| c.key_file = "cluster.key".into())),
            "cluster.key_file"
        );
        assert_eq!(
            rejected_field(with(|c| c.peers.push("127.0.0.1".parse().unwrap()))),
            "cluster.peers[1]"
        );
        assert_eq!(
            rejected_field(with(|c| c.peers.push("10.0.0.12".parse().unwrap()))),
            "cluster.peers[1]"
        );
        assert_eq!(
            rejected_field(with(|c| c.peers.push("fd00::12".parse().unwrap()))),
            "cluster.peers"
        );
        assert_eq!(
            rejected_field(with(|c| c.address = Some("fd00::1".parse().unwrap()))),
            "cluster.address"
        );
        // A reload may change the peers, and nothing else of the section.
        let mut old = minimal();
        with(|_| {})(&mut old);
        let mut new = old.clone();
        new.cluster
            .as_mut()
            .unwrap()
            .peers
            .push("10.0.0.13".parse().unwrap());
        assert_eq!(old.restart_only_change(&new), None);
        new.cluster.as_mut().unwrap().port = 4791;
        assert_eq!(
            old.restart_only_change(&new),
            Some("cluster (all but peers)")
        );
        assert_eq!(
            old.restart_only_change(&minimal()),
            Some("cluster (all but peers)")
        );
    }
}
