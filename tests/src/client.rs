//! Client side: single requests and sequential request series that count which backend
//! answered. Everything runs on a thread inside the client's namespace.

use std::collections::BTreeMap;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream, UdpSocket};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::Result;

use crate::Netns;

/// Per-request timeout of [`spread`] and [`udp_spread`]: a lost SYN is retransmitted
/// after 1 s, and that alone must not fail a request.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
/// A series gives up after this many failed requests: the verdict is known by then, and
/// a broken balancer must not hold a test for `n` timeouts.
pub const MAX_FAILURES: usize = 5;

fn in_ns<T: Send>(ns: &Netns, f: impl FnOnce() -> io::Result<T> + Send) -> io::Result<T> {
    ns.run(f).map_err(io::Error::other)?
}

/// Connects to `addr` from `ns`, reads the first line (the backend's name), closes.
pub fn tcp_request(ns: &Netns, addr: SocketAddr, timeout: Duration) -> io::Result<String> {
    in_ns(ns, || tcp_request_here(addr, timeout))
}

/// [`tcp_request`] from the calling thread's namespace.
pub fn tcp_request_here(addr: SocketAddr, timeout: Duration) -> io::Result<String> {
    greeting(&TcpStream::connect_timeout(&addr, timeout)?, timeout)
}

/// The first line `stream` receives (the backend's name), within `timeout`.
fn greeting(stream: &TcpStream, timeout: Duration) -> io::Result<String> {
    stream.set_read_timeout(Some(timeout))?;
    let mut line = String::new();
    BufReader::new(stream).read_line(&mut line)?;
    if !line.ends_with('\n') {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!("connection closed after {line:?}"),
        ));
    }
    Ok(line.trim_end().to_string())
}

/// [`tcp_request`], also returning how many segments the client's kernel retransmitted
/// on the connection (its SYN included): a SYN the data path lost shows as one, however
/// late the machine's load made the answer.
pub fn tcp_request_retransmits(
    ns: &Netns,
    addr: SocketAddr,
    timeout: Duration,
) -> io::Result<(String, u32)> {
    in_ns(ns, || {
        let stream = TcpStream::connect_timeout(&addr, timeout)?;
        Ok((greeting(&stream, timeout)?, retransmits(&stream)?))
    })
}

/// Segments the kernel retransmitted on `stream` so far (`tcpi_total_retrans`).
pub fn retransmits(stream: &TcpStream) -> io::Result<u32> {
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: `info` is a writable tcp_info of `len` bytes, as TCP_INFO wants.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&mut info as *mut libc::tcp_info).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(info.tcpi_total_retrans)
}

/// A TCP connection to `addr` from the local address `local` (std cannot bind before
/// connecting). A blocking connect on Linux gives up after the send timeout.
fn connect_from(local: IpAddr, addr: SocketAddr, timeout: Duration) -> io::Result<TcpStream> {
    use nix::sys::socket::{
        AddressFamily, SockFlag, SockType, SockaddrStorage, bind, connect, setsockopt, socket,
        sockopt,
    };
    let family = if addr.is_ipv4() {
        AddressFamily::Inet
    } else {
        AddressFamily::Inet6
    };
    let fd = socket(family, SockType::Stream, SockFlag::SOCK_CLOEXEC, None)?;
    let send_timeout =
        nix::sys::time::TimeVal::new(timeout.as_secs() as _, timeout.subsec_micros() as _);
    setsockopt(&fd, sockopt::SendTimeout, &send_timeout)?;
    bind(
        fd.as_raw_fd(),
        &SockaddrStorage::from(SocketAddr::new(local, 0)),
    )?;
    connect(fd.as_raw_fd(), &SockaddrStorage::from(addr)).map_err(|errno| match errno {
        nix::errno::Errno::EINPROGRESS => io::Error::new(
            io::ErrorKind::TimedOut,
            format!("no connection within {timeout:?}"),
        ),
        errno => errno.into(),
    })?;
    Ok(TcpStream::from(fd))
}

/// A long-lived connection to a [`crate::TcpServer`] (which echoes), for tests that keep
/// flows open while something changes. The socket lives in the namespace it was made in;
/// it can be used from any thread.
pub struct Conn {
    stream: TcpStream,
    reader: BufReader<TcpStream>,
    backend: String,
}

impl Conn {
    /// Connects from `ns` and reads the greeting line (the backend's name).
    pub fn open(ns: &Netns, addr: SocketAddr, timeout: Duration) -> io::Result<Conn> {
        in_ns(ns, || {
            Self::greeted(TcpStream::connect_timeout(&addr, timeout)?, timeout)
        })
    }

    /// [`Conn::open`] from the local address `local` of `ns` (a second client address:
    /// another source to the balancer).
    pub fn open_from(
        ns: &Netns,
        local: IpAddr,
        addr: SocketAddr,
        timeout: Duration,
    ) -> io::Result<Conn> {
        in_ns(ns, || {
            Self::greeted(connect_from(local, addr, timeout)?, timeout)
        })
    }

    /// Reads the greeting line of a fresh connection.
    fn greeted(stream: TcpStream, timeout: Duration) -> io::Result<Conn> {
        stream.set_read_timeout(Some(timeout))?;
        stream.set_nodelay(true)?;
        let mut reader = BufReader::new(stream.try_clone()?);
        let mut line = String::new();
        reader.read_line(&mut line)?;
        if !line.ends_with('\n') {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("connection closed after {line:?}"),
            ));
        }
        Ok(Conn {
            stream,
            reader,
            backend: line.trim_end().to_string(),
        })
    }

    /// The backend that greeted this connection.
    pub fn backend(&self) -> &str {
        &self.backend
    }

    /// Sends `data` and checks that the same bytes come back.
    pub fn echo(&mut self, data: &[u8]) -> io::Result<()> {
        self.stream.write_all(data)?;
        let mut back = vec![0u8; data.len()];
        self.reader.read_exact(&mut back)?;
        if back != data {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "echo differs from what was sent",
            ));
        }
        Ok(())
    }

    /// The local address (its source port identifies the flow).
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.stream.local_addr()
    }

    /// Closes it the orderly way: sends FIN, then reads until the server's EOF (the
    /// server closes once it has echoed everything). Fails on a reset or extra bytes.
    pub fn close(mut self) -> io::Result<()> {
        self.stream.shutdown(std::net::Shutdown::Write)?;
        let mut rest = Vec::new();
        self.reader.read_to_end(&mut rest)?;
        if !rest.is_empty() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{} unexpected bytes before EOF", rest.len()),
            ));
        }
        Ok(())
    }
}

/// What one connection of a [`Chatter`] went through.
pub struct ChatReport {
    /// The connection (still open, unless it failed), to go on using or to close.
    pub conn: Conn,
    /// The backend that greeted it.
    pub backend: String,
    /// Its local address (the flow's source).
    pub local: Option<SocketAddr>,
    /// Echo exchanges that came back intact.
    pub exchanges: usize,
    /// Bytes sent (and received back intact).
    pub bytes: usize,
    /// The first failure (no exchange is tried on it after that), and when it happened
    /// (time since the start).
    pub error: Option<(Duration, String)>,
}

/// Keeps a set of long-lived [`Conn`]s busy on a thread of its own: one round every
/// `interval`, each round one echo on every connection, with a size and content that
/// differ per round and per connection (so any lost, duplicated or misplaced byte shows).
/// Runs until [`Chatter::stop`] (or dropped), or `max` at most.
pub struct Chatter {
    stop: Arc<AtomicBool>,
    rounds: Arc<AtomicUsize>,
    handle: Option<JoinHandle<Vec<ChatReport>>>,
}

impl Chatter {
    pub fn start(conns: Vec<Conn>, interval: Duration, max: Duration) -> Chatter {
        let stop = Arc::new(AtomicBool::new(false));
        let rounds = Arc::new(AtomicUsize::new(0));
        let handle = {
            let (stop, rounds) = (stop.clone(), rounds.clone());
            std::thread::spawn(move || chat(conns, interval, max, &stop, &rounds))
        };
        Chatter {
            stop,
            rounds,
            handle: Some(handle),
        }
    }

    /// Rounds completed so far (on every connection that had not failed).
    pub fn rounds(&self) -> usize {
        self.rounds.load(Ordering::Relaxed)
    }

    /// Waits until at least `n` rounds are done, up to `timeout`; returns whether they are.
    pub fn wait_rounds(&self, n: usize, timeout: Duration) -> bool {
        let start = Instant::now();
        while self.rounds() < n {
            if start.elapsed() > timeout || self.handle.as_ref().is_none_or(|h| h.is_finished()) {
                return self.rounds() >= n;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        true
    }

    /// Ends the exchanges (after the round in progress) and returns one report per
    /// connection, in the order given.
    pub fn stop(mut self) -> Vec<ChatReport> {
        self.finish()
    }

    fn finish(&mut self) -> Vec<ChatReport> {
        self.stop.store(true, Ordering::Relaxed);
        match self.handle.take().map(JoinHandle::join) {
            Some(Ok(reports)) => reports,
            Some(Err(panic)) => std::panic::resume_unwind(panic),
            None => Vec::new(),
        }
    }
}

impl Drop for Chatter {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// The bytes of round `round` on connection `conn`: 1 to ~3 KB of a pattern that
/// depends on both.
fn chat_payload(round: usize, conn: usize) -> Vec<u8> {
    let len = 1 + (round * 733 + conn * 97) % 3000;
    (0..len)
        .map(|i| ((i + round * 31 + conn * 7) % 251) as u8)
        .collect()
}

fn chat(
    conns: Vec<Conn>,
    interval: Duration,
    max: Duration,
    stop: &AtomicBool,
    rounds: &AtomicUsize,
) -> Vec<ChatReport> {
    let start = Instant::now();
    let mut reports: Vec<ChatReport> = conns
        .into_iter()
        .map(|conn| ChatReport {
            backend: conn.backend().to_string(),
            local: conn.local_addr().ok(),
            conn,
            exchanges: 0,
            bytes: 0,
            error: None,
        })
        .collect();
    let mut round = 0;
    while !stop.load(Ordering::Relaxed) && start.elapsed() < max {
        let began = Instant::now();
        for (i, r) in reports.iter_mut().enumerate() {
            if r.error.is_some() {
                continue;
            }
            let data = chat_payload(round, i);
            match r.conn.echo(&data) {
                Ok(()) => {
                    r.exchanges += 1;
                    r.bytes += data.len();
                }
                Err(e) => r.error = Some((start.elapsed(), format!("round {round}: {e}"))),
            }
        }
        round += 1;
        rounds.store(round, Ordering::Relaxed);
        std::thread::sleep(interval.saturating_sub(began.elapsed()));
    }
    reports
}

/// Sends one datagram to `addr` from a new ephemeral port and returns the answer. The
/// socket is connected, so only an answer from `addr` itself counts (a DSR backend must
/// answer from the VIP).
pub fn udp_request(ns: &Netns, addr: SocketAddr, timeout: Duration) -> io::Result<String> {
    in_ns(ns, || udp_request_here(addr, timeout))
}

/// [`udp_request`] from the calling thread's namespace.
fn udp_request_here(addr: SocketAddr, timeout: Duration) -> io::Result<String> {
    udp_request_from_port(addr, 0, timeout)
}

/// [`udp_request`] from source port `port` of `ns`.
pub fn udp_request_from(
    ns: &Netns,
    addr: SocketAddr,
    port: u16,
    timeout: Duration,
) -> io::Result<String> {
    in_ns(ns, || udp_request_from_port(addr, port, timeout))
}

/// [`udp_request_here`] from source port `port` (0: a new ephemeral port).
fn udp_request_from_port(addr: SocketAddr, port: u16, timeout: Duration) -> io::Result<String> {
    let local: SocketAddr = if addr.is_ipv4() {
        (Ipv4Addr::UNSPECIFIED, port).into()
    } else {
        (Ipv6Addr::UNSPECIFIED, port).into()
    };
    let socket = UdpSocket::bind(local)?;
    socket.connect(addr)?;
    socket.set_read_timeout(Some(timeout))?;
    socket.send(b"ping\n")?;
    let mut buf = [0u8; 512];
    let n = socket.recv(&mut buf).map_err(|e| match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => io::Error::new(
            io::ErrorKind::TimedOut,
            format!("no answer within {timeout:?}"),
        ),
        _ => e,
    })?;
    Ok(String::from_utf8_lossy(&buf[..n]).trim_end().to_string())
}

/// How a series of requests spread over the backends.
#[derive(Clone, Debug, Default)]
pub struct Spread {
    /// Answers per backend name.
    pub counts: BTreeMap<String, usize>,
    /// Requests that got no answer.
    pub failures: usize,
    /// The first few failures, for the test's message.
    pub errors: Vec<String>,
    /// Stopped after [`MAX_FAILURES`] failures, before sending all requests.
    pub gave_up: bool,
}

impl Spread {
    /// Requests answered.
    pub fn answered(&self) -> usize {
        self.counts.values().sum()
    }

    /// Requests sent.
    pub fn total(&self) -> usize {
        self.answered() + self.failures
    }

    /// Share of all requests answered by `name` (0.0 when it answered none).
    pub fn share(&self, name: &str) -> f64 {
        match self.total() {
            0 => 0.0,
            t => *self.counts.get(name).unwrap_or(&0) as f64 / t as f64,
        }
    }

    /// A small table: backend, count, share and a bar.
    pub fn table(&self) -> String {
        let mut out = format!("{:<14} {:>6} {:>7}\n", "backend", "count", "share");
        for (name, &count) in &self.counts {
            let share = self.share(name);
            let bar = "#".repeat((share * 50.0).round() as usize);
            out.push_str(&format!(
                "{name:<14} {count:>6} {:>6.1}% {bar}\n",
                share * 100.0
            ));
        }
        if self.failures > 0 {
            out.push_str(&format!("{:<14} {:>6}\n", "(failed)", self.failures));
        }
        if self.gave_up {
            out.push_str(&format!("(gave up after {} failures)\n", self.failures));
        }
        out
    }

    fn record(&mut self, i: usize, r: io::Result<String>) {
        match r {
            Ok(name) => *self.counts.entry(name).or_default() += 1,
            Err(e) => {
                self.failures += 1;
                if self.errors.len() < 10 {
                    self.errors.push(format!("request {i}: {e}"));
                }
            }
        }
    }
}

/// `n` TCP requests to `addr`, one after the other, each from a new ephemeral port.
pub fn spread(ns: &Netns, addr: SocketAddr, n: usize) -> Result<Spread> {
    spread_with(ns, n, |_| tcp_request_here(addr, REQUEST_TIMEOUT), || false)
}

/// First source port of [`udp_spread`]'s requests: below the kernel's ephemeral range
/// (32768 and up), so no other socket of the namespace holds one of them.
const UDP_SPREAD_FIRST_PORT: u16 = 20000;

/// `n` UDP requests to `addr` (at most 10000), each from a source port of its own: `n`
/// distinct flows. Ephemeral ports would not do: the kernel may hand out a port again,
/// and a datagram on an earlier request's 5-tuple is that flow again, not a new one.
pub fn udp_spread(ns: &Netns, addr: SocketAddr, n: usize) -> Result<Spread> {
    anyhow::ensure!(n <= 10000, "udp_spread: at most 10000 requests");
    spread_with(
        ns,
        n,
        |i| udp_request_from_port(addr, UDP_SPREAD_FIRST_PORT + i as u16, REQUEST_TIMEOUT),
        || false,
    )
}

/// Runs `request(i)` for `i in 0..n` inside `ns`, stopping early when `cancelled()` or
/// after [`MAX_FAILURES`] failures.
pub fn spread_with(
    ns: &Netns,
    n: usize,
    request: impl Fn(usize) -> io::Result<String> + Send,
    cancelled: impl Fn() -> bool + Send,
) -> Result<Spread> {
    ns.run(move || {
        let mut s = Spread::default();
        for i in 0..n {
            if cancelled() {
                break;
            }
            s.record(i, request(i));
            if s.failures >= MAX_FAILURES {
                s.gave_up = i + 1 < n;
                break;
            }
        }
        s
    })
}

/// One ICMP (or ICMPv6) echo from `ns` to `dst`; returns the round-trip time. Uses a raw
/// socket (root), since ping sockets are off in new namespaces.
pub fn ping(ns: &Netns, dst: IpAddr, timeout: Duration) -> io::Result<Duration> {
    in_ns(ns, || ping_here(dst, timeout))
}

/// The Internet checksum (RFC 1071) of `data`: what IPv4 headers and ICMP carry.
pub fn checksum(data: &[u8]) -> u16 {
    let mut sum: u32 = data
        .chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// Sends the ICMP (or ICMPv6) message `msg`, type first, from `ns` to `dst` over a raw
/// socket; its checksum is filled in.
pub fn send_icmp(ns: &Netns, dst: IpAddr, msg: &[u8]) -> io::Result<()> {
    in_ns(ns, || {
        send_icmp_on(&raw_icmp_socket(dst)?, dst, msg.to_vec())
    })
}

/// A raw ICMP socket for `dst`'s family (ICMPv6 for IPv6).
fn raw_icmp_socket(dst: IpAddr) -> io::Result<OwnedFd> {
    let (family, proto) = match dst {
        IpAddr::V4(_) => (libc::AF_INET, libc::IPPROTO_ICMP),
        IpAddr::V6(_) => (libc::AF_INET6, libc::IPPROTO_ICMPV6),
    };
    // SAFETY: plain socket(2); the fd is owned right away.
    Ok(unsafe {
        OwnedFd::from_raw_fd(cvt(libc::socket(
            family,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            proto,
        ))?)
    })
}

fn send_icmp_on(fd: &OwnedFd, dst: IpAddr, mut msg: Vec<u8>) -> io::Result<()> {
    if dst.is_ipv4() {
        // The kernel fills the ICMPv6 checksum itself, not the ICMP one.
        msg[2..4].fill(0);
        let c = checksum(&msg);
        msg[2..4].copy_from_slice(&c.to_be_bytes());
    }
    let target = nix::sys::socket::SockaddrStorage::from(SocketAddr::new(dst, 0));
    nix::sys::socket::sendto(
        fd.as_raw_fd(),
        &msg,
        &target,
        nix::sys::socket::MsgFlags::empty(),
    )
    .map_err(io::Error::from)?;
    Ok(())
}

fn ping_here(dst: IpAddr, timeout: Duration) -> io::Result<Duration> {
    let (request_type, reply_type) = match dst {
        IpAddr::V4(_) => (8u8, 0u8),
        IpAddr::V6(_) => (128u8, 129u8),
    };
    let fd = raw_icmp_socket(dst)?;
    let id = (std::process::id() as u16) ^ 0x4c42;
    let mut msg = vec![request_type, 0, 0, 0];
    msg.extend_from_slice(&id.to_be_bytes());
    msg.extend_from_slice(&1u16.to_be_bytes());
    msg.extend_from_slice(b"lb-tests ping");
    let start = Instant::now();
    send_icmp_on(&fd, dst, msg)?;
    let mut buf = [0u8; 1500];
    loop {
        let left = timeout.saturating_sub(start.elapsed());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("no echo reply from {dst}"),
            ));
        }
        let mut pfd = libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the duration of the call.
        if cvt(unsafe { libc::poll(&mut pfd, 1, left.as_millis().max(1) as i32) })? == 0 {
            continue;
        }
        let (n, from) = nix::sys::socket::recvfrom::<nix::sys::socket::SockaddrStorage>(
            fd.as_raw_fd(),
            &mut buf,
        )
        .map_err(io::Error::from)?;
        let from_ip = from.and_then(|a| {
            a.as_sockaddr_in()
                .map(|s| IpAddr::V4(s.ip()))
                .or_else(|| a.as_sockaddr_in6().map(|s| IpAddr::V6(s.ip())))
        });
        // An ICMP raw socket gets the IPv4 header too; an ICMPv6 one does not.
        let icmp = match dst {
            IpAddr::V4(_) => match buf.get(usize::from(buf[0] & 0x0f) * 4..n) {
                Some(icmp) => icmp,
                None => continue,
            },
            IpAddr::V6(_) => &buf[..n],
        };
        if from_ip == Some(dst)
            && icmp.len() >= 8
            && icmp[0] == reply_type
            && icmp[4..6] == id.to_be_bytes()
        {
            return Ok(start.elapsed());
        }
    }
}
