//! Backend servers that run on threads inside a namespace and stop when told to (a thread
//! stuck in `accept` would keep its namespace alive after `ip netns del`).

use std::io::{ErrorKind, IoSlice, IoSliceMut, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::{Context, Result, anyhow};
use nix::sys::socket::{
    AddressFamily, ControlMessage, ControlMessageOwned, MsgFlags, SockFlag, SockType,
    SockaddrStorage, recvmsg, sendmsg, setsockopt, sockopt,
};

use crate::Netns;

/// How often the server threads look at their stop flag.
const POLL: Duration = Duration::from_millis(50);

/// A TCP server: on each connection it writes `name\n` at once, then echoes every byte it
/// receives until EOF. Bound to a wildcard address it answers on every address of the
/// namespace (the VIP on `lo` and the backend's own); `[::]` is dual-stack here
/// (`net.ipv6.bindv6only` is 0 in new namespaces).
pub struct TcpServer {
    name: String,
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    accepted: Arc<AtomicUsize>,
    handle: Option<JoinHandle<Result<()>>>,
}

impl TcpServer {
    /// Returns once the server listens.
    pub fn start(ns: &Netns, addr: SocketAddr, name: &str) -> Result<TcpServer> {
        let stop = Arc::new(AtomicBool::new(false));
        let accepted = Arc::new(AtomicUsize::new(0));
        let (ready_tx, ready_rx) = mpsc::channel::<Result<()>>();
        let handle = {
            let (stop, accepted, name) = (stop.clone(), accepted.clone(), name.to_string());
            ns.spawn(&format!("tcp-{name}"), move || {
                let listener = match bind_tcp(addr) {
                    Ok(l) => {
                        let _ = ready_tx.send(Ok(()));
                        l
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(anyhow!("{e:#}")));
                        return Err(e);
                    }
                };
                accept_loop(listener, &name, &stop, &accepted)
            })?
        };
        let ready = ready_rx
            .recv()
            .map_err(|_| anyhow!("tcp server {name} ended before listening"));
        let server = TcpServer {
            name: name.into(),
            addr,
            stop,
            accepted,
            handle: Some(handle),
        };
        ready??;
        Ok(server)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> usize {
        self.accepted.load(Ordering::Relaxed)
    }

    /// Stops accepting, closes open connections, joins the threads.
    pub fn stop(mut self) -> Result<()> {
        self.shutdown()
    }

    fn shutdown(&mut self) -> Result<()> {
        self.stop.store(true, Ordering::Relaxed);
        match self.handle.take() {
            Some(h) => h
                .join()
                .map_err(|_| anyhow!("tcp server {} panicked", self.name))?,
            None => Ok(()),
        }
    }
}

impl Drop for TcpServer {
    fn drop(&mut self) {
        if let Err(e) = self.shutdown() {
            eprintln!("warning: tcp server {}: {e:#}", self.name);
        }
    }
}

fn bind_tcp(addr: SocketAddr) -> Result<TcpListener> {
    let listener = TcpListener::bind(addr).with_context(|| format!("bind tcp {addr}"))?;
    listener.set_nonblocking(true)?;
    Ok(listener)
}

/// Waits up to [`POLL`] for `fd` to become readable.
fn poll_readable(fd: i32) -> bool {
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd for the duration of the call.
    let n = unsafe { libc::poll(&mut pfd, 1, POLL.as_millis() as i32) };
    n > 0
}

fn accept_loop(
    listener: TcpListener,
    name: &str,
    stop: &Arc<AtomicBool>,
    accepted: &AtomicUsize,
) -> Result<()> {
    let mut conns: Vec<JoinHandle<()>> = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        if !poll_readable(listener.as_raw_fd()) {
            continue;
        }
        match listener.accept() {
            Ok((stream, _peer)) => {
                accepted.fetch_add(1, Ordering::Relaxed);
                let (stop, name) = (stop.clone(), name.to_string());
                conns.retain(|h| !h.is_finished());
                conns.push(std::thread::spawn(move || serve_conn(stream, &name, &stop)));
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {}
            // A connection reset before accept: not the server's problem.
            Err(e) if e.kind() == ErrorKind::ConnectionAborted => {}
            Err(e) => return Err(e).context("accept"),
        }
    }
    for h in conns {
        let _ = h.join();
    }
    Ok(())
}

fn serve_conn(mut stream: TcpStream, name: &str, stop: &AtomicBool) {
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_nodelay(true);
    if stream.set_read_timeout(Some(POLL)).is_err()
        || stream.write_all(format!("{name}\n").as_bytes()).is_err()
    {
        return;
    }
    let mut buf = [0u8; 4096];
    while !stop.load(Ordering::Relaxed) {
        match stream.read(&mut buf) {
            Ok(0) => return,
            Ok(n) => {
                if stream.write_all(&buf[..n]).is_err() {
                    return;
                }
            }
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted
                ) => {}
            Err(_) => return,
        }
    }
}

/// A UDP server answering each datagram with `name\n`, from the address the datagram
/// was sent to (IP_PKTINFO), as a DSR backend must: bound to 0.0.0.0 it answers a query
/// to the VIP from the VIP, not from the backend's own address. An IPv6 server is
/// IPv6-only; start one of each family when both are needed.
pub struct UdpServer {
    name: String,
    stop: Arc<AtomicBool>,
    answered: Arc<AtomicUsize>,
    handle: Option<JoinHandle<Result<()>>>,
}

impl UdpServer {
    pub fn start(ns: &Netns, addr: SocketAddr, name: &str) -> Result<UdpServer> {
        let stop = Arc::new(AtomicBool::new(false));
        let answered = Arc::new(AtomicUsize::new(0));
        let (ready_tx, ready_rx) = mpsc::channel::<Result<()>>();
        let handle = {
            let (stop, answered, name) = (stop.clone(), answered.clone(), name.to_string());
            ns.spawn(&format!("udp-{name}"), move || {
                let socket = match bind_udp(addr) {
                    Ok(s) => {
                        let _ = ready_tx.send(Ok(()));
                        s
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(anyhow!("{e:#}")));
                        return Err(e);
                    }
                };
                udp_loop(&socket, addr.is_ipv4(), &name, &stop, &answered)
            })?
        };
        let ready = ready_rx
            .recv()
            .map_err(|_| anyhow!("udp server {name} ended before binding"));
        let server = UdpServer {
            name: name.into(),
            stop,
            answered,
            handle: Some(handle),
        };
        ready??;
        Ok(server)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Datagrams answered so far.
    pub fn answered(&self) -> usize {
        self.answered.load(Ordering::Relaxed)
    }

    pub fn stop(mut self) -> Result<()> {
        self.shutdown()
    }

    fn shutdown(&mut self) -> Result<()> {
        self.stop.store(true, Ordering::Relaxed);
        match self.handle.take() {
            Some(h) => h
                .join()
                .map_err(|_| anyhow!("udp server {} panicked", self.name))?,
            None => Ok(()),
        }
    }
}

impl Drop for UdpServer {
    fn drop(&mut self) {
        if let Err(e) = self.shutdown() {
            eprintln!("warning: udp server {}: {e:#}", self.name);
        }
    }
}

fn bind_udp(addr: SocketAddr) -> Result<UdpSocket> {
    let family = if addr.is_ipv4() {
        AddressFamily::Inet
    } else {
        AddressFamily::Inet6
    };
    let fd: OwnedFd =
        nix::sys::socket::socket(family, SockType::Datagram, SockFlag::SOCK_CLOEXEC, None)
            .context("udp socket")?;
    if addr.is_ipv4() {
        setsockopt(&fd, sockopt::Ipv4PacketInfo, &true).context("IP_PKTINFO")?;
    } else {
        setsockopt(&fd, sockopt::Ipv6V6Only, &true).context("IPV6_V6ONLY")?;
        setsockopt(&fd, sockopt::Ipv6RecvPacketInfo, &true).context("IPV6_RECVPKTINFO")?;
    }
    nix::sys::socket::bind(fd.as_raw_fd(), &SockaddrStorage::from(addr))
        .with_context(|| format!("bind udp {addr}"))?;
    let socket = UdpSocket::from(fd);
    socket.set_read_timeout(Some(POLL))?;
    Ok(socket)
}

fn udp_loop(
    socket: &UdpSocket,
    v4: bool,
    name: &str,
    stop: &AtomicBool,
    answered: &AtomicUsize,
) -> Result<()> {
    let reply = format!("{name}\n");
    let mut buf = [0u8; 2048];
    while !stop.load(Ordering::Relaxed) {
        let mut cmsg = if v4 {
            nix::cmsg_space!(libc::in_pktinfo)
        } else {
            nix::cmsg_space!(libc::in6_pktinfo)
        };
        let mut iov = [IoSliceMut::new(&mut buf)];
        let (peer, local) = match recvmsg::<SockaddrStorage>(
            socket.as_raw_fd(),
            &mut iov,
            Some(&mut cmsg),
            MsgFlags::empty(),
        ) {
            Ok(msg) => {
                let mut local: Option<IpAddr> = None;
                if let Ok(cmsgs) = msg.cmsgs() {
                    for c in cmsgs {
                        match c {
                            ControlMessageOwned::Ipv4PacketInfo(pi) => {
                                local = Some(IpAddr::from(pi.ipi_addr.s_addr.to_ne_bytes()));
                            }
                            ControlMessageOwned::Ipv6PacketInfo(pi) => {
                                local = Some(IpAddr::from(pi.ipi6_addr.s6_addr));
                            }
                            _ => {}
                        }
                    }
                }
                match msg.address {
                    Some(peer) => (peer, local),
                    None => continue,
                }
            }
            Err(nix::errno::Errno::EAGAIN | nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(e).context("udp recvmsg"),
        };
        let iov = [IoSlice::new(reply.as_bytes())];
        let sent = match local {
            Some(IpAddr::V4(a)) => {
                let pi = libc::in_pktinfo {
                    ipi_ifindex: 0,
                    ipi_spec_dst: libc::in_addr {
                        s_addr: u32::from_ne_bytes(a.octets()),
                    },
                    ipi_addr: libc::in_addr { s_addr: 0 },
                };
                sendmsg(
                    socket.as_raw_fd(),
                    &iov,
                    &[ControlMessage::Ipv4PacketInfo(&pi)],
                    MsgFlags::empty(),
                    Some(&peer),
                )
            }
            Some(IpAddr::V6(a)) => {
                let pi = libc::in6_pktinfo {
                    ipi6_addr: libc::in6_addr {
                        s6_addr: a.octets(),
                    },
                    ipi6_ifindex: 0,
                };
                sendmsg(
                    socket.as_raw_fd(),
                    &iov,
                    &[ControlMessage::Ipv6PacketInfo(&pi)],
                    MsgFlags::empty(),
                    Some(&peer),
                )
            }
            None => sendmsg(
                socket.as_raw_fd(),
                &iov,
                &[],
                MsgFlags::empty(),
                Some(&peer),
            ),
        };
        if sent.is_ok() {
            answered.fetch_add(1, Ordering::Relaxed);
        }
    }
    Ok(())
}
