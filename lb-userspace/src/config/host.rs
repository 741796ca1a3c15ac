//! What a configuration means on this host: its VIPs and backends against the
//! interface's own addresses and routes, and the tunnels' source addresses.

use std::net::IpAddr;

use super::dataplane::bad_tunnel_source;
use super::{Config, ConfigError, invalid};

impl Config {
    /// The checks that need the host: no VIP and no backend may be an address of the
    /// balancer's own interface, where frames sent to it would come straight back.
    /// Run where the agent knows the addresses: at start and on every reload.
    pub fn validate_host(&self, interface_addresses: &[IpAddr]) -> Result<(), ConfigError> {
        for (i, vip) in self.vips.iter().enumerate() {
            if interface_addresses.contains(&vip.address) {
                // Its frames would be the balancer's own: its services on that port
                // would answer locally but be sent to backends for everyone else.
                return Err(invalid(
                    format!("vip[{i}].address"),
                    format!(
                        "{} is an address of dataplane.interface {} (this balancer): a VIP \
                         must be an address no host on the segment has (its packets to the \
                         balancer's own services would go to the backends)",
                        vip.address, self.dataplane.interface
                    ),
                ));
            }
            for (j, backend) in vip.backends.iter().enumerate() {
                if interface_addresses.contains(&backend.address) {
                    return Err(invalid(
                        format!("vip[{i}].backend[{j}].address"),
                        format!(
                            "{} is an address of dataplane.interface {} (this balancer): a \
                             backend must be another host on its segment",
                            backend.address, self.dataplane.interface
                        ),
                    ));
                }
                if vip.forward.is_tunnel() {
                    self.tunnel_source_for(backend.address, interface_addresses)
                        .map_err(|(field, why)| {
                            invalid(
                                field,
                                format!(
                                    "vip[{i}] ({:?}) forwards by {} to {} (vip[{i}].backend[{j}]): \
                                     {why}",
                                    vip.name, vip.forward, backend.address
                                ),
                            )
                        })?;
                }
            }
        }
        Ok(())
    }

    /// An `l2` backend must be a neighbour on `interface` (its frames go to its own MAC):
    /// unless its MAC is configured, its route must be on-link there. `on_link` says
    /// whether an address is, or else the route found (or why there is none).
    pub fn validate_routes<E: std::fmt::Display>(
        &self,
        on_link: impl Fn(IpAddr) -> Result<(), E>,
    ) -> Result<(), ConfigError> {
        let interface = self.dataplane.interfaces.join(" or ");
        for (i, vip) in self.vips.iter().enumerate() {
            if vip.forward.is_tunnel() {
                continue;
            }
            for (j, backend) in vip.backends.iter().enumerate() {
                if backend.mac.is_some() {
                    continue;
                }
                if let Err(route) = on_link(backend.address) {
                    return Err(invalid(
                        format!("vip[{i}].backend[{j}].address"),
                        format!(
                            "{} is not on-link on {interface} ({route}): forward = \"l2\" \
                             reaches only backends on the balancer's segment; a backend \
                             behind a router needs forward = \"ipip\" or \"gue\"",
                            backend.address
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    /// The outer source address of tunnel packets to `backend`: the configured
    /// `tunnel_source` (IPv4 backends) or `tunnel_source6`, else the interface's first
    /// address of that family (for IPv6 not a link-local one, which routers drop). Never
    /// made up: networks drop packets from addresses that are not the sender's. Err: the
    /// field to set, and why there is none.
    pub fn tunnel_source_for(
        &self,
        backend: IpAddr,
        interface_addresses: &[IpAddr],
    ) -> Result<IpAddr, (&'static str, String)> {
        let (field, configured) = match backend {
            IpAddr::V4(_) => ("dataplane.tunnel_source", self.dataplane.tunnel_source),
            IpAddr::V6(_) => ("dataplane.tunnel_source6", self.dataplane.tunnel_source6),
        };
        configured
            .or_else(|| {
                interface_addresses.iter().copied().find(|a| {
                    a.is_ipv4() == backend.is_ipv4()
                        && bad_tunnel_source(*a, backend.is_ipv4()).is_none()
                })
            })
            .ok_or_else(|| {
                let family = if backend.is_ipv4() { "IPv4" } else { "IPv6" };
                (
                    field,
                    format!(
                        "no {family} tunnel source: set {field}, or give {} an {family} \
                         address (it has none usable)",
                        self.dataplane.interface
                    ),
                )
            })
    }
}

#[cfg(test)]
mod tests {
    use std::net::{IpAddr, Ipv4Addr};

    use crate::config::testing::*;
    use crate::config::*;

    #[test]
    fn a_tunnel_source_is_configured_or_the_interfaces_own() {
        let mut config = minimal();
        config.vips[0].forward = Forward::Ipip;
        config.vips[0].backends.push(backend("fd00:2::12"));
        let own: Vec<IpAddr> = ["10.0.0.2", "fe80::1", "fd00::2"]
            .iter()
            .map(|a| a.parse().unwrap())
            .collect();
        config.validate_host(&own).unwrap();
        let v4 = IpAddr::V4(Ipv4Addr::new(10, 1, 0, 11));
        let v6: IpAddr = "fd00:2::12".parse().unwrap();
        assert_eq!(config.tunnel_source_for(v4, &own), Ok(own[0]));
        assert_eq!(
            config.tunnel_source_for(v6, &own),
            Ok(own[2]),
            "not the link-local one"
        );
        config.dataplane.tunnel_source6 = Some("fd00::99".parse().unwrap());
        assert_eq!(
            config.tunnel_source_for(v6, &own),
            Ok("fd00::99".parse().unwrap())
        );
        // An interface with only an IPv4 and a link-local address: no IPv6 source.
        config.dataplane.tunnel_source6 = None;
        match config.validate_host(&own[..2]) {
            Err(ConfigError::Invalid { field, reason }) => {
                assert_eq!(field, "dataplane.tunnel_source6");
                assert!(
                    reason.contains(
                        "vip[0] (\"web\") forwards by ipip to fd00:2::12 (vip[0].backend[1])"
                    ) && reason.contains("no IPv6 tunnel source: set dataplane.tunnel_source6"),
                    "{reason}"
                );
            }
            other => panic!("{other:?}"),
        }
        // An l2 VIP needs no source.
        config.vips[0].forward = Forward::L2;
        config.vips[0].backends.pop();
        config.validate_host(&[]).unwrap();
    }

    #[test]
    fn backend_must_not_be_the_balancers_own_address() {
        let config = minimal();
        let own: Vec<IpAddr> = ["10.0.0.2", "fe80::1"]
            .iter()
            .map(|a| a.parse().unwrap())
            .collect();
        config.validate_host(&own).unwrap();
        let mut mine = config.clone();
        mine.vips[0].backends.push(backend("10.0.0.2"));
        match mine.validate_host(&own) {
            Err(ConfigError::Invalid { field, reason }) => {
                assert_eq!(field, "vip[0].backend[1].address");
                assert!(reason.contains("dataplane.interface eth0"), "{reason}");
            }
            other => panic!("expected a validation error, got {other:?}"),
        }
    }
}
