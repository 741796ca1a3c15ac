//! The DSR test bed: a switch namespace holding a Linux bridge, and a client, the
//! balancer and N backends, each in its own namespace with one interface `eth0` whose
//! veth peer is a port of that bridge.
//!
//! ```text
//!            client 10.99.0.1        lb 10.99.0.2 (XDP lb_xdp on eth0)
//!            fd00:99::1              fd00:99::2
//!                 | p-client           | p-lb (xdp_pass: native XDP_TX needs it)
//!   switch ns:  [============== br0 ==============]
//!                 | p-b1         | p-b2        | p-b3
//!            backend-1 .11   backend-2 .12   backend-3 .13   (VIP on lo)
//! ```
//!
//! The client routes the VIP via the balancer; the balancer rewrites the destination
//! MAC and sends the frame back out of the same port; the backend holds the VIP on `lo`
//! (`arp_ignore=1`, `arp_announce=2`, so it never claims it on the wire) and answers the
//! client directly. Addresses are the same in every lab: labs never share a namespace.
//!
//! `LabOptions::routed` puts the backends on another subnet behind a router instead,
//! for tunnelled VIPs (`forward = "ipip"|"gue"`):
//!
//! ```text
//!            client .1   lb .2   router eth0 10.99.0.254 / fd00:99::254
//!   switch ns:  [========== br0 ==========]   (forwarding, rp_filter 0)
//!                                     router eth1 10.98.1.1 / fd00:98:1::1
//!               [========== br1 ==========]
//!            backend-1 10.98.1.11 / fd00:98:1::11 ...  (VIP on lo, default route
//!                                                        via the router)
//! ```
//!
//! The balancer routes 10.98.1.0/24 and fd00:98:1::/64 via the router; the backends
//! answer the client through the router, never through the balancer.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::thread::JoinHandle;

use anyhow::{Context, Result, anyhow, bail, ensure};

use crate::netns::ip;
use crate::{
    Agent, AgentConfig, BackendConfig, Health, Netns, Protocol, TcpServer, UdpServer, VipConfig,
    XdpMode,
};

/// IPv4 VIP of every lab.
pub const VIP4: Ipv4Addr = Ipv4Addr::new(10, 99, 0, 100);
/// IPv6 VIP of every lab.
pub const VIP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x99, 0, 0, 0, 0, 0, 0x100);
/// The balancer's interface inside its namespace (and every host's).
pub const IFACE: &str = "eth0";
/// The bridge in the switch namespace that joins every host.
pub const BRIDGE: &str = "br0";
/// The bridge behind the router, in a routed lab.
pub const BACKEND_BRIDGE: &str = "br1";
const LB_PORT: &str = "p-lb";
const CLIENT_PORT: &str = "p-client";
/// The router of a routed lab on the client's and balancer's segment.
pub const ROUTER4: Ipv4Addr = Ipv4Addr::new(10, 99, 0, 254);
pub const ROUTER6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x99, 0, 0, 0, 0, 0, 0x254);
/// The router on the backends' segment (their default route).
const ROUTER_BACKEND4: Ipv4Addr = Ipv4Addr::new(10, 98, 1, 1);
const ROUTER_BACKEND6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x98, 1, 0, 0, 0, 0, 1);

/// A backend's address in a routed lab: 10.98.1.N, fd00:98:1::N (digits as in IPv4).
fn routed_host(host: u8, v6: bool) -> IpAddr {
    if v6 {
        let [_, _, _, _, _, _, _, last] = host_v6(host).segments();
        Ipv6Addr::new(0xfd00, 0x98, 1, 0, 0, 0, 0, last).into()
    } else {
        Ipv4Addr::new(10, 98, 1, host).into()
    }
}

fn host_v4(host: u8) -> Ipv4Addr {
    Ipv4Addr::new(10, 99, 0, host)
}

/// `fd00:99::N` where N has the same digits as the IPv4 host number (`.11` is `::11`).
fn host_v6(host: u8) -> Ipv6Addr {
    let same_digits =
        u16::from_str_radix(&host.to_string(), 16).expect("decimal digits are hex digits");
    Ipv6Addr::new(0xfd00, 0x99, 0, 0, 0, 0, 0, same_digits)
}

/// Backend `i` (0-based) is host `.11 + i`: 10.99.0.11, fd00:99::11 for the first.
fn backend_host(i: usize) -> u8 {
    11 + i as u8
}

#[derive(Clone, Debug)]
pub struct LabOptions {
    /// Number of backends (1..=80).
    pub backends: usize,
    /// Attach `xdp_pass` natively on the bridge port of the balancer: native XDP_TX on a
    /// veth drops frames unless the peer has an XDP program.
    pub xdp_pass_on_peer: bool,
    /// `ethtool -K eth0 tx off` on the client: native XDP_TX on veth loses
    /// CHECKSUM_PARTIAL, so the client must put full checksums in its frames.
    pub client_tx_csum_off: bool,
    /// The MTU of every link (both ends of each veth, and the bridge); `None`: 1500.
    pub mtu: Option<u32>,
    /// The backends on another subnet behind a router (see the module doc); `mtu` is
    /// then not supported.
    pub routed: bool,
}

impl Default for LabOptions {
    fn default() -> Self {
        LabOptions {
            backends: 3,
            xdp_pass_on_peer: true,
            client_tx_csum_off: true,
            mtu: None,
            routed: false,
        }
    }
}

/// The topology, and whatever runs in it. Dropping it stops the servers, then the agent,
/// then detaches `xdp_pass`, then deletes the namespaces.
pub struct Lab {
    tcp_servers: Vec<TcpServer>,
    udp_servers: Vec<UdpServer>,
    agent: Option<Agent>,
    xdp_pass: Option<XdpPass>,
    /// `LabOptions::xdp_pass_on_peer`, for a re-plugged interface.
    xdp_pass_wanted: bool,
    client: Netns,
    lb: Netns,
    backends: Vec<Netns>,
    /// `LabOptions::routed`: the router between the two bridges.
    router: Option<Netns>,
    routed: bool,
    switch: Netns,
    // Last: the agent's log and config outlive everything that uses them.
    dir: tempfile::TempDir,
}

impl Lab {
    pub fn new(opts: LabOptions) -> Result<Lab> {
        ensure!(
            (1..=80).contains(&opts.backends),
            "1 to 80 backends, not {}",
            opts.backends
        );
        let dir = tempfile::Builder::new()
            .prefix("lbt-lab-")
            .tempdir()
            .context("tempdir")?;
        let switch = switch_namespace()?;

        let client = host(&switch, "client", CLIENT_PORT, host_v4(1), host_v6(1))?;
        let lb = host(&switch, "lb", LB_PORT, host_v4(2), host_v6(2))?;
        ensure!(
            !(opts.routed && opts.mtu.is_some()),
            "a routed lab has the default MTU"
        );
        let router = if opts.routed {
            Some(router(&switch, &lb)?)
        } else {
            None
        };
        let mut backends = Vec::with_capacity(opts.backends);
        for i in 0..opts.backends {
            let h = backend_host(i);
            let (role, port) = (format!("b{}", i + 1), format!("p-b{}", i + 1));
            let ns = if opts.routed {
                routed_backend(&switch, &role, &port, h)?
            } else {
                host(&switch, &role, &port, host_v4(h), host_v6(h))?
            };
            ip(&[
                "-n",
                ns.name(),
                "addr",
                "add",
                &format!("{VIP4}/32"),
                "dev",
                "lo",
            ])?;
            ip(&[
                "-n",
                ns.name(),
                "addr",
                "add",
                &format!("{VIP6}/128"),
                "dev",
                "lo",
                "nodad",
            ])?;
            arp_for_dsr(&ns, IFACE)?;
            backends.push(ns);
        }

        let c = client.name();
        ip(&[
            "-n",
            c,
            "route",
            "add",
            &format!("{VIP4}/32"),
            "via",
            &host_v4(2).to_string(),
        ])?;
        ip(&[
            "-n",
            c,
            "-6",
            "route",
            "add",
            &format!("{VIP6}/128"),
            "via",
            &host_v6(2).to_string(),
        ])?;
        if opts.client_tx_csum_off {
            client.exec("ethtool", &["-K", IFACE, "tx", "off"])?;
        }
        if let Some(mtu) = opts.mtu {
            let hosts = [&client, &lb].into_iter().chain(&backends);
            let ports = [CLIENT_PORT.to_string(), LB_PORT.to_string()]
                .into_iter()
                .chain((1..=backends.len()).map(|i| format!("p-b{i}")));
            set_mtu(&switch, hosts, ports, mtu)?;
        }

        let xdp_pass = if opts.xdp_pass_on_peer {
            Some(XdpPass::attach(&switch, LB_PORT)?)
        } else {
            None
        };

        Ok(Lab {
            tcp_servers: Vec::new(),
            udp_servers: Vec::new(),
            agent: None,
            xdp_pass,
            xdp_pass_wanted: opts.xdp_pass_on_peer,
            client,
            lb,
            backends,
            router,
            routed: opts.routed,
            switch,
            dir,
        })
    }

    /// The router of a routed lab.
    pub fn router(&self) -> Option<&Netns> {
        self.router.as_ref()
    }

    pub fn client(&self) -> &Netns {
        &self.client
    }

    pub fn lb(&self) -> &Netns {
        &self.lb
    }

    pub fn switch(&self) -> &Netns {
        &self.switch
    }

    pub fn backend(&self, i: usize) -> &Netns {
        &self.backends[i]
    }

    pub fn backends(&self) -> &[Netns] {
        &self.backends
    }

    /// Adds (`present`) or removes `vip` on backend `i`'s `lo`: a backend that holds the
    /// VIP, or one that lost it (which only checks through the VIP notice).
    pub fn set_vip_on_lo(&self, i: usize, vip: IpAddr, present: bool) -> Result<()> {
        let prefix = if vip.is_ipv4() { 32 } else { 128 };
        let action = if present { "add" } else { "del" };
        let address = format!("{vip}/{prefix}");
        let mut args = vec!["-n", self.backends[i].name(), "addr", action, &address];
        args.extend(["dev", "lo"]);
        if present && vip.is_ipv6() {
            args.push("nodad");
        }
        ip(&args).map(drop).with_context(|| {
            format!(
                "ip addr {action} {address} dev lo in {}",
                self.backend_name(i)
            )
        })
    }

    /// The name the lab's servers use for backend `i` (0-based): `backend-1`...
    pub fn backend_name(&self, i: usize) -> String {
        format!("backend-{}", i + 1)
    }

    pub fn client_addr(&self, v6: bool) -> IpAddr {
        if v6 {
            host_v6(1).into()
        } else {
            host_v4(1).into()
        }
    }

    /// Gives the client the further IPv4 address `10.99.0.{host}` (a second source for
    /// the balancer; `Conn::open_from` uses it). Gone with the lab's namespaces.
    pub fn add_client_addr(&self, host: u8) -> Result<IpAddr> {
        let address = host_v4(host);
        ip(&[
            "-n",
            self.client.name(),
            "addr",
            "add",
            &format!("{address}/24"),
            "dev",
            IFACE,
        ])?;
        Ok(address.into())
    }

    pub fn lb_addr(&self, v6: bool) -> IpAddr {
        if v6 {
            host_v6(2).into()
        } else {
            host_v4(2).into()
        }
    }

    pub fn backend_addr(&self, i: usize, v6: bool) -> IpAddr {
        let h = backend_host(i);
        if self.routed {
            routed_host(h, v6)
        } else if v6 {
            host_v6(h).into()
        } else {
            host_v4(h).into()
        }
    }

    pub fn vip4(&self) -> IpAddr {
        VIP4.into()
    }

    pub fn vip6(&self) -> IpAddr {
        VIP6.into()
    }

    /// A private directory that lives as long as the lab.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The control socket path the lab's configs use.
    pub fn socket_path(&self) -> PathBuf {
        self.dir.path().join("lb.sock")
    }

    /// Starts a [`TcpServer`] on `[::]:port` (dual-stack) in every backend, named
    /// `backend-N` (or `backend-N-PORT` with `suffix_port`). The lab owns them.
    pub fn serve_tcp(&mut self, port: u16, suffix_port: bool) -> Result<()> {
        for i in 0..self.backends.len() {
            self.serve_tcp_on(i, port, suffix_port)?;
        }
        Ok(())
    }

    /// Starts (again) backend `i`'s [`TcpServer`] on `[::]:port`, named like
    /// [`Lab::serve_tcp`] names it.
    pub fn serve_tcp_on(&mut self, i: usize, port: u16, suffix_port: bool) -> Result<()> {
        let name = self.server_name(i, port, suffix_port);
        let addr = SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), port);
        let server = TcpServer::start(&self.backends[i], addr, &name)?;
        self.tcp_servers.push(server);
        Ok(())
    }

    /// Starts a [`UdpServer`] on `0.0.0.0:port` and one on `[::]:port` in every backend.
    pub fn serve_udp(&mut self, port: u16, suffix_port: bool) -> Result<()> {
        for i in 0..self.backends.len() {
            let name = self.server_name(i, port, suffix_port);
            for any in [
                IpAddr::from(Ipv4Addr::UNSPECIFIED),
                IpAddr::from(Ipv6Addr::UNSPECIFIED),
            ] {
                let server =
                    UdpServer::start(&self.backends[i], SocketAddr::new(any, port), &name)?;
                self.udp_servers.push(server);
            }
        }
        Ok(())
    }

    fn server_name(&self, i: usize, port: u16, suffix_port: bool) -> String {
        if suffix_port {
            format!("{}-{port}", self.backend_name(i))
        } else {
            self.backend_name(i)
        }
    }

    /// The lab's TCP servers, in start order.
    pub fn tcp_servers(&self) -> &[TcpServer] {
        &self.tcp_servers
    }

    /// Stops backend `i`'s servers (TCP and UDP) on every port.
    pub fn stop_servers_of(&mut self, i: usize) -> Result<()> {
        let prefix = self.backend_name(i);
        let is_of = |name: &str| {
            name == prefix
                || name
                    .strip_prefix(&prefix)
                    .is_some_and(|r| r.starts_with('-'))
        };
        let (stop, keep): (Vec<_>, Vec<_>) =
            self.tcp_servers.drain(..).partition(|s| is_of(s.name()));
        self.tcp_servers = keep;
        for s in stop {
            s.stop()?;
        }
        let (stop, keep): (Vec<_>, Vec<_>) =
            self.udp_servers.drain(..).partition(|s| is_of(s.name()));
        self.udp_servers = keep;
        for s in stop {
            s.stop()?;
        }
        Ok(())
    }

    /// A VIP on the lab's IPv4 or IPv6 VIP address with every backend (of that family)
    /// at weight 1 and no MAC (the agent resolves it).
    pub fn vip(
        &self,
        name: &str,
        v6: bool,
        port: u16,
        protocol: Protocol,
        health: Health,
    ) -> VipConfig {
        VipConfig {
            name: name.into(),
            address: if v6 { self.vip6() } else { self.vip4() },
            port,
            protocol,
            hash: None,
            drain_timeout: None,
            health,
            backends: (0..self.backends.len())
                .map(|i| BackendConfig::new(self.backend_addr(i, v6)))
                .collect(),
            extra: Vec::new(),
        }
    }

    /// A config for the lab's balancer: its interface, the lab's socket, no metrics.
    pub fn agent_config(&self, xdp_mode: XdpMode, vips: Vec<VipConfig>) -> AgentConfig {
        AgentConfig {
            interface: IFACE.into(),
            xdp_mode,
            maglev_table_size: None,
            conntrack_entries: None,
            flow_idle_timeout: None,
            socket: self.socket_path(),
            metrics: "off".into(),
            vips,
        }
    }

    /// Writes `config` to the lab's directory and starts `lb run` in the balancer's
    /// namespace; returns once it serves. The lab owns it.
    pub fn start_agent(&mut self, lb_bin: &Path, config: &AgentConfig) -> Result<&mut Agent> {
        self.start_agent_cancellable(lb_bin, config, &|| false)
    }

    /// [`Lab::start_agent`] that gives up as soon as `cancelled()`.
    pub fn start_agent_cancellable(
        &mut self,
        lb_bin: &Path,
        config: &AgentConfig,
        cancelled: &dyn Fn() -> bool,
    ) -> Result<&mut Agent> {
        if self.agent.is_some() {
            bail!("an agent already runs in this lab");
        }
        let path = self.dir.path().join("lb.toml");
        std::fs::write(&path, config.to_toml())
            .with_context(|| format!("write {}", path.display()))?;
        let log = self.dir.path().join("lb.log");
        let agent =
            Agent::start_cancellable(lb_bin, &self.lb, &path, &config.socket, &log, cancelled)?;
        Ok(self.agent.insert(agent))
    }

    pub fn agent(&self) -> Option<&Agent> {
        self.agent.as_ref()
    }

    pub fn agent_mut(&mut self) -> Option<&mut Agent> {
        self.agent.as_mut()
    }

    /// Takes the agent out of the lab (to stop it and look at its exit status).
    pub fn take_agent(&mut self) -> Option<Agent> {
        self.agent.take()
    }

    /// Deletes the balancer's interface (a driver unloaded, a device unplugged): its
    /// bridge port goes with it.
    pub fn unplug_lb(&mut self) -> Result<()> {
        ip(&["-n", self.lb.name(), "link", "del", IFACE])?;
        // Its xdp_pass went with the port.
        self.xdp_pass.take();
        Ok(())
    }

    /// Creates the balancer's interface again (a new device of the same name) with
    /// `mac`, its addresses, and (if the lab has one) `xdp_pass` on its new bridge port.
    pub fn replug_lb(&mut self, mac: &str) -> Result<()> {
        fabric_port(&self.switch, &self.lb, LB_PORT, IFACE)?;
        ip(&["-n", self.lb.name(), "link", "set", IFACE, "address", mac])?;
        host_interface(&self.lb, host_v4(2), host_v6(2))?;
        if self.xdp_pass_wanted {
            self.xdp_pass = Some(XdpPass::attach(&self.switch, LB_PORT)?);
        }
        Ok(())
    }

    /// The agent's log so far ("" when none ran).
    pub fn agent_log(&self) -> String {
        self.agent.as_ref().map(Agent::log).unwrap_or_default()
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        // Server threads sit inside the namespaces: end them first.
        self.tcp_servers.clear();
        self.udp_servers.clear();
        if let Some(agent) = self.agent.take() {
            if std::thread::panicking() {
                eprintln!(
                    "--- lb agent log ({}) ---\n{}--- end of log ---",
                    agent.log_path().display(),
                    agent.log()
                );
            }
            drop(agent);
        }
        self.xdp_pass.take();
        // The namespaces go with the fields: the switch last, so no veth end is left
        // dangling in between.
    }
}

/// A veth from bridge port `port` (in the switch) to `dev` in `ns`, made inside the
/// namespaces, never in the root one (no name clash with the host).
pub(crate) fn fabric_port(switch: &Netns, ns: &Netns, port: &str, dev: &str) -> Result<()> {
    fabric_port_on(switch, BRIDGE, ns, port, dev)
}

/// `fabric_port` on bridge `bridge`.
fn fabric_port_on(switch: &Netns, bridge: &str, ns: &Netns, port: &str, dev: &str) -> Result<()> {
    let sw = switch.name();
    ip(&[
        "-n",
        sw,
        "link",
        "add",
        port,
        "type",
        "veth",
        "peer",
        "name",
        dev,
        "netns",
        ns.name(),
    ])?;
    ip(&["-n", sw, "link", "set", port, "master", bridge, "up"])?;
    Ok(())
}

/// A routed lab's router: `eth0` on `BRIDGE`, `eth1` on `BACKEND_BRIDGE` (made here),
/// forwarding both families; the balancer `lb` routes the backends' subnet through it.
fn router(switch: &Netns, lb: &Netns) -> Result<Netns> {
    bridge(switch, BACKEND_BRIDGE)?;
    let router = host(switch, "rtr", "p-rtr", ROUTER4, ROUTER6)?;
    fabric_port_on(switch, BACKEND_BRIDGE, &router, "p-rtr1", "eth1")?;
    let r = router.name();
    ip(&[
        "-n",
        r,
        "addr",
        "add",
        &format!("{ROUTER_BACKEND4}/24"),
        "dev",
        "eth1",
    ])?;
    let a6 = format!("{ROUTER_BACKEND6}/64");
    ip(&["-n", r, "addr", "add", &a6, "dev", "eth1", "nodad"])?;
    ip(&["-n", r, "link", "set", "eth1", "up"])?;
    router.sysctl("net.ipv4.ip_forward", "1")?;
    router.sysctl("net.ipv6.conf.all.forwarding", "1")?;
    // Replies from the VIP arrive on eth1, where no route to the VIP points.
    for conf in ["all", "default", "eth0", "eth1"] {
        router.sysctl(&format!("net.ipv4.conf.{conf}.rp_filter"), "0")?;
    }
    route_via(lb, "10.98.1.0/24", ROUTER4.into())?;
    route_via(lb, "fd00:98:1::/64", ROUTER6.into())?;
    Ok(router)
}

/// A backend behind the router: on `BACKEND_BRIDGE`, its default routes via the router.
fn routed_backend(switch: &Netns, role: &str, port: &str, h: u8) -> Result<Netns> {
    let (IpAddr::V4(a4), IpAddr::V6(a6)) = (routed_host(h, false), routed_host(h, true)) else {
        unreachable!("routed_host gives the family asked for")
    };
    let ns = host_on(switch, BACKEND_BRIDGE, role, port, a4, a6)?;
    route_via(&ns, "default", ROUTER_BACKEND4.into())?;
    route_via(&ns, "default", ROUTER_BACKEND6.into())?;
    Ok(ns)
}

/// Sets `mtu` on every host's `eth0`, on the bridge ports and on the bridge: a veth
/// drops a frame longer than its receiving end's MTU, so both ends agree.
fn set_mtu<'a>(
    switch: &Netns,
    hosts: impl IntoIterator<Item = &'a Netns>,
    ports: impl IntoIterator<Item = String>,
    mtu: u32,
) -> Result<()> {
    let mtu = mtu.to_string();
    for port in ports.into_iter().chain([BRIDGE.to_string()]) {
        ip(&["-n", switch.name(), "link", "set", &port, "mtu", &mtu])?;
    }
    for host in hosts {
        ip(&["-n", host.name(), "link", "set", IFACE, "mtu", &mtu])?;
    }
    Ok(())
}

/// Creates a host namespace whose `eth0` is the peer of bridge port `port`.
fn host(switch: &Netns, role: &str, port: &str, a4: Ipv4Addr, a6: Ipv6Addr) -> Result<Netns> {
    host_on(switch, BRIDGE, role, port, a4, a6)
}

/// `host` on bridge `bridge`.
fn host_on(
    switch: &Netns,
    bridge: &str,
    role: &str,
    port: &str,
    a4: Ipv4Addr,
    a6: Ipv6Addr,
) -> Result<Netns> {
    let ns = Netns::new(role)?;
    // Addresses usable at once: no duplicate address detection (link-local included).
    ns.sysctl("net.ipv6.conf.default.accept_dad", "0")?;
    ns.sysctl("net.ipv6.conf.all.accept_dad", "0")?;
    fabric_port_on(switch, bridge, &ns, port, IFACE)?;
    host_interface(&ns, a4, a6)?;
    Ok(ns)
}

/// `ip -n NS route add PREFIX via GATEWAY` (either family).
fn route_via(ns: &Netns, prefix: &str, gateway: IpAddr) -> Result<()> {
    let family = if gateway.is_ipv4() { "-4" } else { "-6" };
    let gateway = gateway.to_string();
    ip(&[
        "-n",
        ns.name(),
        family,
        "route",
        "add",
        prefix,
        "via",
        &gateway,
    ])?;
    Ok(())
}

/// Gives the host's `eth0` its addresses and brings it up.
fn host_interface(ns: &Netns, a4: Ipv4Addr, a6: Ipv6Addr) -> Result<()> {
    let n = ns.name();
    ip(&["-n", n, "addr", "add", &format!("{a4}/24"), "dev", IFACE])?;
    ip(&[
        "-n",
        n,
        "addr",
        "add",
        &format!("{a6}/64"),
        "dev",
        IFACE,
        "nodad",
    ])?;
    ip(&["-n", n, "link", "set", IFACE, "up"])?;
    Ok(())
}

/// `xdp_pass` attached natively on an interface, held by a thread inside its namespace
/// (the `Ebpf` is dropped, and the program detached, in that namespace).
/// `xdp_pass` attached natively to an interface in a namespace, for as long as it lives
/// (native XDP_TX on a veth needs a program on the peer).
pub struct XdpPass {
    stop: Option<mpsc::Sender<()>>,
    handle: Option<JoinHandle<Result<()>>>,
}

impl XdpPass {
    pub fn attach(ns: &Netns, ifname: &str) -> Result<XdpPass> {
        let (ready_tx, ready_rx) = mpsc::channel::<Result<()>>();
        let (stop_tx, stop_rx) = mpsc::channel::<()>();
        let ifname = ifname.to_string();
        let handle = ns.spawn("xdp-pass", move || {
            let ebpf = load_xdp_pass(&ifname);
            let ok = ebpf.is_ok();
            let _ = ready_tx.send(ebpf.as_ref().map(|_| ()).map_err(|e| anyhow!("{e:#}")));
            if ok {
                // Until the sender is used or dropped.
                let _ = stop_rx.recv();
            }
            ebpf.map(drop)
        })?;
        let mut pass = XdpPass {
            stop: Some(stop_tx),
            handle: Some(handle),
        };
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(pass),
            Ok(Err(e)) => {
                pass.shutdown();
                Err(e)
            }
            Err(_) => {
                pass.shutdown();
                Err(anyhow!("xdp_pass thread ended early"))
            }
        }
    }

    fn shutdown(&mut self) {
        self.stop.take();
        if let Some(h) = self.handle.take() {
            match h.join() {
                Ok(Ok(())) | Ok(Err(_)) => {}
                Err(_) => eprintln!("warning: xdp_pass thread panicked"),
            }
        }
    }
}

impl Drop for XdpPass {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// A namespace holding the bridge `BRIDGE` (up) that joins a lab's hosts. No IPv6 on the
/// bridge and its ports (no stray router solicitations in captures); no multicast
/// snooping, so neighbour discovery floods like ARP does.
pub fn switch_namespace() -> Result<Netns> {
    let switch = Netns::new("sw")?;
    switch.sysctl("net.ipv6.conf.default.disable_ipv6", "1")?;
    switch.sysctl("net.ipv6.conf.all.disable_ipv6", "1")?;
    bridge(&switch, BRIDGE)?;
    Ok(switch)
}

/// Bridge `name` in the switch namespace, up, without multicast snooping (so IPv6
/// neighbour discovery reaches every port at once).
fn bridge(switch: &Netns, name: &str) -> Result<()> {
    let sw = switch.name();
    ip(&[
        "-n",
        sw,
        "link",
        "add",
        name,
        "type",
        "bridge",
        "mcast_snooping",
        "0",
    ])?;
    ip(&["-n", sw, "link", "set", name, "up"])?;
    Ok(())
}

/// A DSR backend's ARP settings: never answer ARP for (or announce) the VIP held on `lo`.
pub fn arp_for_dsr(ns: &Netns, iface: &str) -> Result<()> {
    for conf in ["all", iface] {
        ns.sysctl(&format!("net.ipv4.conf.{conf}.arp_ignore"), "1")?;
        ns.sysctl(&format!("net.ipv4.conf.{conf}.arp_announce"), "2")?;
    }
    Ok(())
}

fn load_xdp_pass(ifname: &str) -> Result<aya::Ebpf> {
    let mut ebpf = crate::program::load_test_program("xdp_pass", 1)?;
    let program: &mut aya::programs::Xdp = ebpf
        .program_mut("xdp_pass")
        .ok_or_else(|| anyhow!("no program xdp_pass in the test eBPF object"))?
        .try_into()
        .context("xdp_pass is not an XDP program")?;
    program
        .attach(ifname, aya::programs::XdpMode::Driver)
        .with_context(|| format!("attach xdp_pass (native) to {ifname}"))?;
    Ok(ebpf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_follow_the_plan() {
        assert_eq!(host_v4(backend_host(0)).to_string(), "10.99.0.11");
        assert_eq!(host_v6(backend_host(0)).to_string(), "fd00:99::11");
        assert_eq!(host_v6(backend_host(2)).to_string(), "fd00:99::13");
        assert_eq!(host_v6(2).to_string(), "fd00:99::2");
        assert_eq!(VIP6.to_string(), "fd00:99::100");
        assert_eq!(host_v6(backend_host(79)).to_string(), "fd00:99::90");
        assert_eq!(
            routed_host(backend_host(0), false).to_string(),
            "10.98.1.11"
        );
        assert_eq!(
            routed_host(backend_host(2), true).to_string(),
            "fd00:98:1::13"
        );
    }
}
