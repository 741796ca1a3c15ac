//! Backend MAC addresses from the kernel's neighbour table, over rtnetlink.
//!
//! The balancer forwards by rewriting the destination MAC, so every backend must be a
//! neighbour on the attached interface. A missing entry is provoked by sending one empty
//! UDP datagram to the backend's discard port (9) out of that interface, which makes the
//! kernel resolve it (ARP or neighbour discovery); the agent re-reads the table every
//! second and follows changes.
//!
//! The interface itself is looked up here too (index, MAC, addresses), and link
//! notifications wake the agent to look again: it follows the interface when it goes,
//! comes back, or changes its MAC.

use std::{
    collections::HashMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket},
};

use futures::TryStreamExt;
use rtnetlink::{
    Handle,
    packet_route::{
        address::AddressAttribute,
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
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Interface {
    pub name: String,
    pub index: u32,
    pub mac: MacAddr,
    /// Its own addresses (no backend may be one of them).
    pub addresses: Vec<IpAddr>,
}

/// Reads the neighbour table of one interface.
#[derive(Clone)]
pub struct Neighbors {
    handle: Handle,
    interface: Interface,
}

/// Link changes (any interface's) as netlink announces them: a wake-up to look the
/// attached interface up again.
pub type LinkEvents = futures::channel::mpsc::UnboundedReceiver<(
    rtnetlink::packet_core::NetlinkMessage<rtnetlink::packet_route::RouteNetlinkMessage>,
    rtnetlink::sys::SocketAddr,
)>;

impl Neighbors {
    /// Opens netlink (spawning its connection task) and looks the interface up.
    pub async fn open(interface: &str) -> Result<Self, NeighborError> {
        let (connection, handle, _) =
            rtnetlink::new_connection().map_err(NeighborError::Connect)?;
        tokio::spawn(connection);
        let interface = lookup(&handle, interface)
            .await?
            .ok_or_else(|| NeighborError::NoInterface(interface.to_string()))?;
        Ok(Self { handle, interface })
    }

    pub fn interface(&self) -> &Interface {
        &self.interface
    }

    /// Follows the interface to what `lookup` found: entries are then read there.
    pub fn set_interface(&mut self, interface: Interface) {
        self.interface = interface;
    }

    /// The interface of this name as the kernel knows it now; None when there is none.
    pub async fn lookup(&self, name: &str) -> Result<Option<Interface>, NeighborError> {
        lookup(&self.handle, name).await
    }

    /// Subscribes to link changes (RTMGRP_LINK) on a netlink socket of their own.
    pub fn link_events() -> Result<LinkEvents, NeighborError> {
        use rtnetlink::sys::AsyncSocket as _;
        let (mut connection, _, events) =
            rtnetlink::new_connection().map_err(NeighborError::Connect)?;
        connection
            .socket_mut()
            .socket_mut()
            .bind(&rtnetlink::sys::SocketAddr::new(
                0,
                rtnetlink::constants::RTMGRP_LINK,
            ))
            .map_err(NeighborError::Connect)?;
        tokio::spawn(connection);
        Ok(events)
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

/// The interface named `name` with its MAC and addresses; None when there is none.
async fn lookup(handle: &Handle, name: &str) -> Result<Option<Interface>, NeighborError> {
    let mut links = handle.link().get().match_name(name.to_string()).execute();
    let link = match links.try_next().await {
        Ok(Some(link)) => link,
        Ok(None) => return Ok(None),
        // ENODEV: no interface of that name (any more).
        Err(rtnetlink::Error::NetlinkError(message))
            if message.code.is_some_and(|code| code.get() == -libc::ENODEV) =>
        {
            return Ok(None);
        }
        Err(error) => return Err(error.into()),
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
        .ok_or_else(|| NeighborError::NoMac(name.to_string()))?;
    let index = link.header.index;
    let mut addresses = Vec::new();
    let mut dump = handle
        .address()
        .get()
        .set_link_index_filter(index)
        .execute();
    while let Some(message) = dump.try_next().await? {
        for attribute in &message.attributes {
            if let AddressAttribute::Address(address) | AddressAttribute::Local(address) = attribute
                && !addresses.contains(address)
            {
                addresses.push(*address);
            }
        }
    }
    Ok(Some(Interface {
        name: name.to_string(),
        index,
        mac,
        addresses,
    }))
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
