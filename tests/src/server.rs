//! Backend servers that run on threads inside a namespace and stop when told to (a thread
//! stuck in `accept` would keep its namespace alive after `ip netns del`).

use std::fs::File;
use std::io::{ErrorKind, IoSlice, IoSliceMut, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow};
use nix::sched::CloneFlags;
use nix::sys::socket::{
    AddressFamily, Backlog, ControlMessage, ControlMessageOwned, MsgFlags, SockFlag, SockType,
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
    accepted: Arc<AtomicUsize>,
    running: Option<Running>,
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
                let serve = {
                    let stop = stop.clone();
                    move |stream| serve_conn(stream, &name, &stop)
                };
                accept_loop(listener, &stop, &accepted, serve)
            })?
        };
        let ready = ready_rx
            .recv()
            .map_err(|_| anyhow!("tcp server {name} ended before listening"));
        let server = TcpServer {
            name: name.into(),
            addr,
            accepted,
            running: Some(Running { stop, handle }),
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
        Running::stop(&mut self.running, "tcp server", &self.name)
    }
}

impl Drop for TcpServer {
    fn drop(&mut self) {
        if let Err(e) = self.shutdown() {
            eprintln!("warning: tcp server {}: {e:#}", self.name);
        }
    }
}

/// A non-blocking listener with SO_REUSEADDR, so that a server restarted on the same
/// port binds again at once although connections of its predecessor are in TIME_WAIT.
fn bind_tcp(addr: SocketAddr) -> Result<TcpListener> {
    let family = if addr.is_ipv4() {
        AddressFamily::Inet
    } else {
        AddressFamily::Inet6
    };
    let fd: OwnedFd =
        nix::sys::socket::socket(family, SockType::Stream, SockFlag::SOCK_CLOEXEC, None)
            .context("tcp socket")?;
    setsockopt(&fd, sockopt::ReuseAddr, &true).context("SO_REUSEADDR")?;
    nix::sys::socket::bind(fd.as_raw_fd(), &SockaddrStorage::from(addr))
        .with_context(|| format!("bind tcp {addr}"))?;
    nix::sys::socket::listen(&fd, Backlog::new(128).context("listen backlog")?)
        .with_context(|| format!("listen on {addr}"))?;
    let listener = TcpListener::from(fd);
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

/// Accepts until `stop`, serving each connection on a thread of its own with `serve`;
/// joins those threads (which must watch `stop` too) before closing the listener.
fn accept_loop(
    listener: TcpListener,
    stop: &Arc<AtomicBool>,
    accepted: &AtomicUsize,
    serve: impl Fn(TcpStream) + Clone + Send + 'static,
) -> Result<()> {
    let mut conns: Vec<JoinHandle<()>> = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        if !poll_readable(listener.as_raw_fd()) {
            continue;
        }
        match listener.accept() {
            Ok((stream, _peer)) => {
                accepted.fetch_add(1, Ordering::Relaxed);
                let serve = serve.clone();
                conns.retain(|h| !h.is_finished());
                conns.push(std::thread::spawn(move || serve(stream)));
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

/// What an [`HttpServer`] does with `GET <its path>`; any other request gets a 404.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HttpBehaviour {
    /// `200 OK` with a small body.
    Ok,
    /// This status with a small body.
    Status(u16),
    /// Reads the request, sends headers announcing a 100-byte body (`Content-Length`)
    /// and a few bytes of it, then nothing more until the client leaves or the server
    /// stops: an application that answers and then hangs.
    Hang,
    /// Reads the request and sends nothing until the client leaves or the server stops.
    Silent,
    /// `503`, `200`, `503`, `200`... per request, starting with `503` after each switch
    /// to it: a checker never sees two equal results in a row, so with rise and fall of
    /// 2 or more a backend must never change state.
    Alternate,
}

/// One request to an [`HttpServer`]'s path and what it got: the status, or `None` for
/// [`HttpBehaviour::Hang`] and [`HttpBehaviour::Silent`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HttpAnswer {
    pub at: Instant,
    pub status: Option<u16>,
}

/// Most answers an [`HttpServer`] remembers.
const HTTP_HISTORY: usize = 10_000;
/// Most bytes of a request the server reads (headers only: checks send no body).
const HTTP_REQUEST_MAX: usize = 8192;
/// A client that has not sent its request headers within this is dropped.
const HTTP_REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

struct HttpState {
    behaviour: HttpBehaviour,
    /// Requests answered under [`HttpBehaviour::Alternate`] since the switch to it.
    alternate: u64,
    answers: Vec<HttpAnswer>,
}

/// A handle on an [`HttpServer`]'s behaviour and record, usable from any thread and
/// across restarts.
#[derive(Clone)]
pub struct HttpControl {
    state: Arc<Mutex<HttpState>>,
}

impl HttpControl {
    fn new(behaviour: HttpBehaviour) -> HttpControl {
        HttpControl {
            state: Arc::new(Mutex::new(HttpState {
                behaviour,
                alternate: 0,
                answers: Vec::new(),
            })),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HttpState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Switches the behaviour for the requests that come from now on.
    pub fn set(&self, behaviour: HttpBehaviour) {
        let mut state = self.lock();
        state.behaviour = behaviour;
        state.alternate = 0;
    }

    /// Requests to the path so far (every restart included).
    pub fn requests(&self) -> usize {
        self.lock().answers.len()
    }

    /// The answers given (the first [`HTTP_HISTORY`]), in order.
    pub fn answers(&self) -> Vec<HttpAnswer> {
        self.lock().answers.clone()
    }

    /// Decides (and records) what the next request to the path gets.
    fn next(&self) -> HttpBehaviour {
        let mut state = self.lock();
        let decided = match state.behaviour {
            HttpBehaviour::Alternate => {
                let n = state.alternate;
                state.alternate += 1;
                if n.is_multiple_of(2) {
                    HttpBehaviour::Status(503)
                } else {
                    HttpBehaviour::Ok
                }
            }
            b => b,
        };
        if state.answers.len() < HTTP_HISTORY {
            let status = match decided {
                HttpBehaviour::Ok => Some(200),
                HttpBehaviour::Status(s) => Some(s),
                _ => None,
            };
            state.answers.push(HttpAnswer {
                at: Instant::now(),
                status,
            });
        }
        decided
    }
}

/// An HTTP/1.1 server for health checks, on a thread inside a namespace: `GET <path>`
/// gets what its [`HttpControl`] says, anything else a 404; every response closes the
/// connection. It can be stopped (connections refused) and started again on the same
/// port, keeping its behaviour and record.
pub struct HttpServer {
    name: String,
    addr: SocketAddr,
    path: String,
    /// The namespace's `/run/netns` file and name, to start again inside it.
    ns_path: PathBuf,
    ns_name: String,
    control: HttpControl,
    accepted: Arc<AtomicUsize>,
    running: Option<Running>,
}

/// A server's thread and the flag that ends it.
struct Running {
    stop: Arc<AtomicBool>,
    handle: JoinHandle<Result<()>>,
}

impl Running {
    /// Ends the thread in `running`, if any, and joins it. Idempotent.
    fn stop(running: &mut Option<Running>, what: &str, name: &str) -> Result<()> {
        let Some(running) = running.take() else {
            return Ok(());
        };
        running.stop.store(true, Ordering::Relaxed);
        running
            .handle
            .join()
            .map_err(|_| anyhow!("{what} {name} panicked"))?
    }
}

impl HttpServer {
    /// Returns once the server listens on `addr` (`[::]:port` answers on every address
    /// of the namespace).
    pub fn start(
        ns: &Netns,
        addr: SocketAddr,
        name: &str,
        path: &str,
        behaviour: HttpBehaviour,
    ) -> Result<HttpServer> {
        let mut server = HttpServer {
            name: name.into(),
            addr,
            path: path.into(),
            ns_path: ns.path(),
            ns_name: ns.name().into(),
            control: HttpControl::new(behaviour),
            accepted: Arc::new(AtomicUsize::new(0)),
            running: None,
        };
        server.start_again()?;
        Ok(server)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// A handle to switch its behaviour and read its record from anywhere.
    pub fn control(&self) -> HttpControl {
        self.control.clone()
    }

    /// Switches the behaviour (see [`HttpControl::set`]).
    pub fn set(&self, behaviour: HttpBehaviour) {
        self.control.set(behaviour);
    }

    /// Requests to the path so far.
    pub fn requests(&self) -> usize {
        self.control.requests()
    }

    /// Connections accepted so far (every restart included).
    pub fn accepted(&self) -> usize {
        self.accepted.load(Ordering::Relaxed)
    }

    /// Starts a new server on the same address (SO_REUSEADDR), with the same behaviour;
    /// returns once it listens. Fails when it is running.
    pub fn start_again(&mut self) -> Result<()> {
        if self.running.is_some() {
            return Err(anyhow!("http server {} is running already", self.name));
        }
        let stop = Arc::new(AtomicBool::new(false));
        let (ready_tx, ready_rx) = mpsc::channel::<Result<()>>();
        let handle = {
            let (stop, accepted, addr) = (stop.clone(), self.accepted.clone(), self.addr);
            let (ns_path, ns_name) = (self.ns_path.clone(), self.ns_name.clone());
            let (control, path) = (self.control.clone(), self.path.clone());
            std::thread::Builder::new()
                .name(format!("http-{}", self.name))
                .spawn(move || -> Result<()> {
                    let entered = File::open(&ns_path)
                        .with_context(|| format!("open {}", ns_path.display()))
                        .and_then(|file| {
                            nix::sched::setns(&file, CloneFlags::CLONE_NEWNET)
                                .with_context(|| format!("setns into {ns_name}"))
                        });
                    let listener = match entered.and_then(|()| bind_tcp(addr)) {
                        Ok(l) => {
                            let _ = ready_tx.send(Ok(()));
                            l
                        }
                        Err(e) => {
                            let _ = ready_tx.send(Err(anyhow!("{e:#}")));
                            return Err(e);
                        }
                    };
                    let serve = {
                        let stop = stop.clone();
                        move |stream| serve_http(stream, &path, &control, &stop)
                    };
                    accept_loop(listener, &stop, &accepted, serve)
                })
                .context("spawn thread")?
        };
        self.running = Some(Running { stop, handle });
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => {
                let _ = self.stop();
                Err(e)
            }
            Err(_) => {
                let _ = self.stop();
                Err(anyhow!("http server {} ended before listening", self.name))
            }
        }
    }

    /// Stops listening, ends open connections (hanging ones included), joins the
    /// threads. Connections to its port are refused from when this returns. Does
    /// nothing when it is stopped already.
    pub fn stop(&mut self) -> Result<()> {
        Running::stop(&mut self.running, "http server", &self.name)
    }
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        if let Err(e) = self.stop() {
            eprintln!("warning: http server {}: {e:#}", self.name);
        }
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        404 => "Not Found",
        500 => "Internal Server Error",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        _ => "Whatever",
    }
}

/// Reads up to the end of the request headers; `None` when the client left, sent
/// too much, took too long, or the server stops.
fn read_request(stream: &mut TcpStream, stop: &AtomicBool) -> Option<String> {
    let started = Instant::now();
    let mut request = Vec::new();
    let mut buf = [0u8; 1024];
    while !request.windows(4).any(|w| w == b"\r\n\r\n") {
        if stop.load(Ordering::Relaxed)
            || request.len() > HTTP_REQUEST_MAX
            || started.elapsed() > HTTP_REQUEST_TIMEOUT
        {
            return None;
        }
        match stream.read(&mut buf) {
            Ok(0) => return None,
            Ok(n) => request.extend_from_slice(&buf[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted
                ) => {}
            Err(_) => return None,
        }
    }
    Some(String::from_utf8_lossy(&request).into_owned())
}

/// Holds the connection open, sending nothing, until the client closes it or the
/// server stops.
fn hold(stream: &mut TcpStream, stop: &AtomicBool) {
    let mut buf = [0u8; 1024];
    while !stop.load(Ordering::Relaxed) {
        match stream.read(&mut buf) {
            Ok(0) => return,
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted
                ) => {}
            Err(_) => return,
        }
    }
}

fn serve_http(mut stream: TcpStream, path: &str, control: &HttpControl, stop: &AtomicBool) {
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_nodelay(true);
    if stream.set_read_timeout(Some(POLL)).is_err() {
        return;
    }
    let Some(request) = read_request(&mut stream, stop) else {
        return;
    };
    let mut words = request.lines().next().unwrap_or("").split_whitespace();
    let (method, target) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
    let behaviour = if method == "GET" && target == path {
        control.next()
    } else {
        HttpBehaviour::Status(404)
    };
    let status = match behaviour {
        HttpBehaviour::Ok => 200,
        HttpBehaviour::Status(s) => s,
        HttpBehaviour::Hang => {
            let head = "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 100\r\n\
                        Connection: close\r\n\r\npartial";
            if stream.write_all(head.as_bytes()).is_ok() {
                hold(&mut stream, stop);
            }
            return;
        }
        HttpBehaviour::Silent => {
            hold(&mut stream, stop);
            return;
        }
        // Decided by `next` already.
        HttpBehaviour::Alternate => 500,
    };
    let body = format!("{status} {}\n", reason(status));
    let response = format!(
        "HTTP/1.1 {status} {}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        reason(status),
        body.len()
    );
    let _ = stream.write_all(response.as_bytes());
    let _ = stream.shutdown(std::net::Shutdown::Write);
}

/// A UDP server answering each datagram with `name\n`, from the address the datagram
/// was sent to (IP_PKTINFO), as a DSR backend must: bound to 0.0.0.0 it answers a query
/// to the VIP from the VIP, not from the backend's own address. An IPv6 server is
/// IPv6-only; start one of each family when both are needed.
pub struct UdpServer {
    name: String,
    answered: Arc<AtomicUsize>,
    running: Option<Running>,
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
            answered,
            running: Some(Running { stop, handle }),
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
        Running::stop(&mut self.running, "udp server", &self.name)
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
        answered.fetch_add(1, Ordering::Relaxed);
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
        // Counted before the send returns (and taken back if it failed): a client that
        // has its answer must find it counted, even when this thread is descheduled
        // between the send and the count on a loaded machine.
        if sent.is_err() {
            answered.fetch_sub(1, Ordering::Relaxed);
        }
    }
    Ok(())
}
