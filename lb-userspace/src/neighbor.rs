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
//!
//! Routes too (`route_to`, `ip route get`): a tunnelled backend (`forward = "ipip"` or
//! `"gue"`) is reached through its route's next hop, the gateway or (on-link) the
//! backend itself, whose MAC the frame then carries; an `l2` backend must be on-link.
//! Route and neighbour notifications wake the agent as link ones do.

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
    #[error("no route to {0}")]
    NoRoute(IpAddr, #[source] std::io::Error),
    #[error("reading the route to {0}: {1}")]
    RouteReply(IpAddr, String),
}

/// The route the kernel takes to one address, as `ip route get` shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Route {
    pub destination: IpAddr,
    /// The output interface's index (none for unreachable, blackhole, ... routes).
    pub oif: Option<u32>,
    /// Through this router; None: on-link.
    pub gateway: Option<IpAddr>,
    /// A unicast route (not local, unreachable, blackhole, prohibit, ...).
    pub unicast: bool,
}

impl Route {
    /// The neighbour frames to `destination` go to when they leave interface `ifindex`:
    /// the gateway, or the destination itself on-link; None when the route does not
    /// leave there.
    pub fn next_hop(&self, ifindex: u32) -> Option<IpAddr> {
        (self.unicast && self.oif == Some(ifindex))
            .then(|| self.gateway.unwrap_or(self.destination))
    }

    /// On-link out of `ifindex`: the destination is a neighbour there.
    pub fn on_link(&self, ifindex: u32) -> bool {
        self.next_hop(ifindex) == Some(self.destination)
    }
}

impl std::fmt::Display for Route {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if !self.unicast {
            write!(f, "not unicast ")?;
        }
        write!(f, "{}", self.destination)?;
        if let Some(gateway) = self.gateway {
            write!(f, " via {gateway}")?;
        }
        if let Some(oif) = self.oif {
            write!(f, " dev {}", interface_name(oif))?;
        }
        Ok(())
    }
}

/// How a route is looked up: `route_to`, or a fake in unit tests.
pub type RouteLookup = fn(IpAddr) -> Result<Route, NeighborError>;

/// Why an address is not a neighbour out of the data-path interfaces.
#[derive(Debug, thiserror::Error)]
pub enum NotOnLink {
    /// The route leaves by another interface, or through a gateway.
    #[error("the route found is `{0}`")]
    Elsewhere(Route),
    #[error(transparent)]
    Lookup(#[from] NeighborError),
}

/// Whether `address` is a neighbour out of one of the interfaces `ifindexes`.
pub fn on_link_any(
    route_of: RouteLookup,
    ifindexes: &[u32],
    address: IpAddr,
) -> Result<(), NotOnLink> {
    let route = route_of(address)?;
    match ifindexes.iter().any(|&i| route.on_link(i)) {
        true => Ok(()),
        false => Err(NotOnLink::Elsewhere(route)),
    }
}

/// The position in `ifindexes` (`dataplane.interfaces`, in order) of the interface
/// `route` leaves by, with the neighbour there (gateway, or the destination on-link).
pub fn egress_of(route: &Route, ifindexes: &[u32]) -> Option<(u32, IpAddr)> {
    ifindexes
        .iter()
        .enumerate()
        .find_map(|(i, &ifindex)| route.next_hop(ifindex).map(|hop| (i as u32, hop)))
}

/// The indexes of the interfaces named `names` (`dataplane.interfaces`), `primary`'s
/// as it was looked up; 0 for one that does not exist (now).
pub fn interface_indexes(names: &[String], primary: &Interface) -> Vec<u32> {
    names
        .iter()
        .map(|name| match name == &primary.name {
            true => primary.index,
            false => nix::net::if_::if_nametoindex(name.as_str()).unwrap_or(0),
        })
        .collect()
}

/// The name of interface `index`, or `#index` when it has none (any more).
fn interface_name(index: u32) -> String {
    nix::net::if_::if_indextoname(index)
        .ok()
        .and_then(|name| name.into_string().ok())
        .unwrap_or_else(|| format!("#{index}"))
}

/// The route the kernel takes to `address` now (RTM_GETROUTE for the host prefix, as
/// `ip route get` asks). Synchronous: one request, one answer, microseconds; so
/// validation can use it under the agent's lock, at start, reload and `backend add`.
pub fn route_to(address: IpAddr) -> Result<Route, NeighborError> {
    use rtnetlink::{
        packet_core::{NLM_F_REQUEST, NetlinkMessage, NetlinkPayload},
        packet_route::RouteNetlinkMessage,
        sys::{Socket, SocketAddr, protocols::NETLINK_ROUTE},
    };
    let prefix = if address.is_ipv4() { 32 } else { 128 };
    let message = rtnetlink::RouteMessageBuilder::<IpAddr>::new()
        .destination_prefix(address, prefix)
        .expect("a host prefix of the address's own family")
        .build();
    let mut request = NetlinkMessage::from(RouteNetlinkMessage::GetRoute(message));
    request.header.flags = NLM_F_REQUEST;
    request.finalize();
    let mut bytes = vec![0; request.buffer_len()];
    request.serialize(&mut bytes);
    let mut socket = Socket::new(NETLINK_ROUTE).map_err(NeighborError::Connect)?;
    socket.bind_auto().map_err(NeighborError::Connect)?;
    socket
        .connect(&SocketAddr::new(0, 0))
        .map_err(NeighborError::Connect)?;
    socket.send(&bytes, 0).map_err(NeighborError::Connect)?;
    let (reply, _) = socket.recv_from_full().map_err(NeighborError::Connect)?;
    let reply = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&reply)
        .map_err(|e| NeighborError::RouteReply(address, e.to_string()))?;
    match reply.payload {
        NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewRoute(route)) => {
            Ok(route_of(address, &route))
        }
        NetlinkPayload::Error(error) => Err(NeighborError::NoRoute(address, error.to_io())),
        other => Err(NeighborError::RouteReply(
            address,
            format!("unexpected answer {other:?}"),
        )),
    }
}

/// What a route message says of the way to `destination`.
fn route_of(destination: IpAddr, message: &rtnetlink::packet_route::route::RouteMessage) -> Route {
    use rtnetlink::packet_route::route::{RouteAddress, RouteAttribute, RouteType, RouteVia};
    let mut route = Route {
        destination,
        oif: None,
        gateway: None,
        unicast: message.header.kind == RouteType::Unicast,
    };
    for attribute in &message.attributes {
        match attribute {
            RouteAttribute::Oif(index) => route.oif = Some(*index),
            RouteAttribute::Gateway(RouteAddress::Inet(a)) => route.gateway = Some(IpAddr::V4(*a)),
            RouteAttribute::Gateway(RouteAddress::Inet6(a)) => route.gateway = Some(IpAddr::V6(*a)),
            // An IPv4 route through an IPv6 router (RFC 5549): its neighbour is IPv6.
            RouteAttribute::Via(RouteVia::Inet6(a)) => route.gateway = Some(IpAddr::V6(*a)),
            RouteAttribute::Via(RouteVia::Inet(a)) => route.gateway = Some(IpAddr::V4(*a)),
            _ => {}
        }
    }
    route
}

/// The attached interface, as the kernel knows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Interface {
    pub name: String,
    pub index: u32,
    pub mac: MacAddr,
    /// Its own addresses (no backend may be one of them).
    pub addresses: Vec<IpAddr>,
    /// Its MTU: the largest IP packet it sends (tunnelled packets included).
    pub mtu: u32,
}

/// Reads the neighbour table of one interface.
#[derive(Clone)]
pub struct Neighbors {
    handle: Handle,
    interface: Interface,
    /// With several interfaces (`dataplane.interfaces`): their indexes, `interface`'s
    /// among them; entries are read on each, and the kernel's route picks the one a
    /// resolution is provoked on. Empty: `interface` alone.
    all: Vec<u32>,
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
        Ok(Self {
            handle,
            interface,
            all: Vec::new(),
        })
    }

    pub fn interface(&self) -> &Interface {
        &self.interface
    }

    /// Follows the interface to what `lookup` found: entries are then read there.
    pub fn set_interface(&mut self, interface: Interface) {
        self.interface = interface;
    }

    /// Reads entries on every one of `ifindexes` (several interfaces), not only on
    /// `interface`.
    pub fn set_all(&mut self, ifindexes: Vec<u32>) {
        self.all = ifindexes;
    }

    /// Whether an entry on interface `ifindex` is one of ours.
    fn ours(&self, ifindex: u32) -> bool {
        ifindex == self.interface.index || self.all.contains(&ifindex)
    }

    /// The interface of this name as the kernel knows it now; None when there is none.
    pub async fn lookup(&self, name: &str) -> Result<Option<Interface>, NeighborError> {
        lookup(&self.handle, name).await
    }

    /// Subscribes to link, route and neighbour changes (RTMGRP_LINK, the IPv4 and IPv6
    /// route groups, RTMGRP_NEIGH) on a netlink socket of their own.
    pub fn link_events() -> Result<LinkEvents, NeighborError> {
        use rtnetlink::constants::{
            RTMGRP_IPV4_ROUTE, RTMGRP_IPV6_ROUTE, RTMGRP_LINK, RTMGRP_NEIGH,
        };
        use rtnetlink::sys::AsyncSocket as _;
        let (mut connection, _, events) =
            rtnetlink::new_connection().map_err(NeighborError::Connect)?;
        connection
            .socket_mut()
            .socket_mut()
            .bind(&rtnetlink::sys::SocketAddr::new(
                0,
                RTMGRP_LINK | RTMGRP_IPV4_ROUTE | RTMGRP_IPV6_ROUTE | RTMGRP_NEIGH,
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
            if !self.ours(message.header.ifindex) || !usable(message.header.state) {
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
        // Several interfaces: the route picks the one the backend is behind.
        if !self.all.is_empty() {
            socket.send_to(&[], (address, 9))?;
            return Ok(());
        }
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
    let mtu = link
        .attributes
        .iter()
        .find_map(|attribute| match attribute {
            LinkAttribute::Mtu(mtu) => Some(*mtu),
            _ => None,
        })
        .unwrap_or(0);
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
        mtu,
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
