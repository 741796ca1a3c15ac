//! Backend MAC addresses from the kernel's neighbour table, over rtnetlink.
//!
//! The balancer forwards by rewriting the destination MAC, so every backend must be a
//! neighbour on the attached interface. A missing entry is provoked by sending one empty
//! UDP datagram to the backend's discard port (9) out of that interface, which makes the
//! kernel resolve it (ARP or neighbour discovery); the agent re-reads the table every
//! second and follows changes.

use std::{
    collections::HashMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket},
};

use futures::TryStreamExt;
use rtnetlink::{
    Handle,
    packet_route::{
        link::LinkAttribute,
        neighbour::{NeighbourAddress, NeighbourAttribute, NeighbourState},
    },
};

use crate::config::MacAddr;

#[derive(Debug, thiserror::Error)]
pub enum NeighborError {
    #[error("opening a netlink socket: {0}")]
    Connect(std::io::Error),
    #[error("netlink request failed")]
    Netlink(#[from] rtnetlink::Error),
    #[error("interface {0} not found")]
    NoInterface(String),
    #[error("interface {0} has no Ethernet address")]
    NoMac(String),
}

/// The attached interface, as the kernel knows it.
#[derive(Clone, Debug)]
pub struct Interface {
    pub name: String,
    pub index: u32,
    pub mac: MacAddr,
}

/// Reads the neighbour table of one interface.
#[derive(Clone)]
pub struct Neighbors {
    handle: Handle,
    interface: Interface,
}

impl Neighbors {
    /// Opens netlink (spawning its connection task) and looks the interface up.
    pub async fn open(interface: &str) -> Result<Self, NeighborError> {
        let (connection, handle, _) =
            rtnetlink::new_connection().map_err(NeighborError::Connect)?;
        tokio::spawn(connection);
        let mut links = handle
            .link()
            .get()
            .match_name(interface.to_string())
            .execute();
        let link = match links.try_next().await {
            Ok(Some(link)) => link,
            Ok(None) | Err(_) => return Err(NeighborError::NoInterface(interface.to_string())),
        };
        let mac = link
            .attributes
            .iter()
            .find_map(|attribute| match attribute {
                LinkAttribute::Address(bytes) if bytes.len() == 6 => Some(MacAddr([
                    bytes[0], bytes[1], bytes[2], bytes[3], bytes[4], bytes[5],
                ])),
                _ => None,
            })
            .ok_or_else(|| NeighborError::NoMac(interface.to_string()))?;
        let interface = Interface {
            name: interface.to_string(),
            index: link.header.index,
            mac,
        };
        Ok(Self { handle, interface })
    }

    pub fn interface(&self) -> &Interface {
        &self.interface
    }

    /// Usable neighbour entries on the interface: address -> MAC.
    pub async fn table(&self) -> Result<HashMap<IpAddr, MacAddr>, NeighborError> {
        let mut entries = HashMap::new();
        let mut dump = self.handle.neighbours().get().execute();
        while let Some(message) = dump.try_next().await? {
            if message.header.ifindex != self.interface.index || !usable(message.header.state) {
                continue;
            }
            let mut address = None;
            let mut mac = None;
            for attribute in &message.attributes {
                match attribute {
                    NeighbourAttribute::Destination(NeighbourAddress::Inet(a)) => {
                        address = Some(IpAddr::V4(*a))
                    }
                    NeighbourAttribute::Destination(NeighbourAddress::Inet6(a)) => {
                        address = Some(IpAddr::V6(*a))
                    }
                    NeighbourAttribute::LinkLocalAddress(bytes) if bytes.len() == 6 => {
                        mac = Some(MacAddr([
                            bytes[0], bytes[1], bytes[2], bytes[3], bytes[4], bytes[5],
                        ]))
                    }
                    _ => {}
                }
            }
            if let (Some(address), Some(mac)) = (address, mac) {
                entries.insert(address, mac);
            }
        }
        Ok(entries)
    }

    /// Makes the kernel resolve `address` on the interface (see the module doc).
    pub fn provoke(&self, address: IpAddr) -> std::io::Result<()> {
        let local: SocketAddr = match address {
            IpAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
            IpAddr::V6(_) => (Ipv6Addr::UNSPECIFIED, 0).into(),
        };
        let socket = UdpSocket::bind(local)?;
        nix::sys::socket::setsockopt(
            &socket,
            nix::sys::socket::sockopt::BindToDevice,
            &std::ffi::OsString::from(&self.interface.name),
        )
        .map_err(std::io::Error::from)?;
        socket.send_to(&[], (address, 9))?;
        Ok(())
    }
}

/// States in which the entry's MAC is the neighbour's (possibly unconfirmed lately).
fn usable(state: NeighbourState) -> bool {
    matches!(
        state,
        NeighbourState::Reachable
            | NeighbourState::Stale
            | NeighbourState::Delay
            | NeighbourState::Probe
            | NeighbourState::Permanent
            | NeighbourState::Noarp
    )
}
