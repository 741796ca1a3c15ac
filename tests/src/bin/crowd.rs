//! `crowd ADDR`: holds many long-lived TCP connections to ADDR for a test, commanded by
//! lines on stdin, answering one line on stdout each. Run inside a client namespace; the
//! servers behind ADDR only need to complete handshakes and acknowledge data (a listener
//! that never accepts, with a large backlog, holds tens of thousands): a segment that
//! reaches a server without the connection is answered by a reset, which this sees.
//!
//! - `open N RATE`: opens N more connections, at most RATE per second, 256 in flight;
//!   answers `opened OK FAILED SECONDS FIRST_PORT..` (the local ports, comma-separated,
//!   of the ones opened by this command).
//! - `probe`: writes one byte on every connection and waits (up to 10 s) until each is
//!   acknowledged or reset; answers `probe ALIVE RESET UNACKED`.
//! - `quit` (or end of input): closes everything and exits.
//!
//! A process holds at most what its open-file limit allows (the tests start several);
//! every loop is bounded.

use std::io::{BufRead, Write};
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

/// Connections being opened at once.
const IN_FLIGHT: usize = 256;
/// How long a connection may take to open, and a probe to be answered.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
const PROBE_TIMEOUT: Duration = Duration::from_secs(10);
const TCP_ESTABLISHED: u8 = 1;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(addr) = args.first().and_then(|a| a.parse::<SocketAddr>().ok()) else {
        eprintln!("usage: crowd ADDR (commands on stdin: open N RATE | probe | quit)");
        std::process::exit(2);
    };
    raise_nofile();
    let mut conns: Vec<OwnedFd> = Vec::new();
    let stdin = std::io::stdin();
    let mut out = std::io::stdout();
    for line in stdin.lock().lines() {
        let Ok(line) = line else { break };
        let words: Vec<&str> = line.split_whitespace().collect();
        let answer = match words.as_slice() {
            ["open", n, rate] => {
                let (n, rate) = (n.parse().unwrap_or(0), rate.parse().unwrap_or(1000));
                open(addr, n, rate, &mut conns)
            }
            ["probe"] => probe(&conns),
            ["quit"] => break,
            _ => format!("error unknown command {line:?}"),
        };
        let _ = writeln!(out, "{answer}");
        let _ = out.flush();
    }
}

fn cvt(r: libc::c_int) -> std::io::Result<libc::c_int> {
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// A non-blocking socket whose connect to `addr` is under way.
fn start_connect(addr: SocketAddr) -> std::io::Result<OwnedFd> {
    let SocketAddr::V4(v4) = addr else {
        return Err(std::io::Error::other("IPv4 only"));
    };
    // SAFETY: plain socket(2) and connect(2) calls on a descriptor owned here.
    unsafe {
        let fd = cvt(libc::socket(
            libc::AF_INET,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        ))?;
        let fd = OwnedFd::from_raw_fd(fd);
        let sin = libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: v4.port().to_be(),
            sin_addr: libc::in_addr {
                s_addr: u32::from(*v4.ip()).to_be(),
            },
            sin_zero: [0; 8],
        };
        let r = libc::connect(
            fd.as_raw_fd(),
            (&sin as *const libc::sockaddr_in).cast(),
            std::mem::size_of::<libc::sockaddr_in>() as u32,
        );
        if r < 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EINPROGRESS) {
            return Err(std::io::Error::last_os_error());
        }
        Ok(fd)
    }
}

fn socket_error(fd: RawFd) -> i32 {
    let mut error: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `error`.
    unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_ERROR,
            (&mut error as *mut libc::c_int).cast(),
            &mut len,
        );
    }
    error
}

fn local_port(fd: RawFd) -> u16 {
    // SAFETY: getsockname writes at most `len` bytes into `sin`.
    unsafe {
        let mut sin: libc::sockaddr_in = std::mem::zeroed();
        let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        libc::getsockname(fd, (&mut sin as *mut libc::sockaddr_in).cast(), &mut len);
        u16::from_be(sin.sin_port)
    }
}

/// Opens `n` connections at most `rate` per second; the answer line.
fn open(addr: SocketAddr, n: usize, rate: u64, conns: &mut Vec<OwnedFd>) -> String {
    let started = Instant::now();
    let mut pending: Vec<(OwnedFd, Instant)> = Vec::new();
    let (mut started_count, mut failed) = (0usize, 0usize);
    let mut ports = Vec::new();
    while started_count < n || !pending.is_empty() {
        // Start new ones within the window and the rate.
        let due = (started.elapsed().as_secs_f64() * rate as f64) as usize + 1;
        while started_count < n && pending.len() < IN_FLIGHT && started_count < due {
            started_count += 1;
            match start_connect(addr) {
                Ok(fd) => pending.push((fd, Instant::now())),
                Err(_) => failed += 1,
            }
        }
        let mut polls: Vec<libc::pollfd> = pending
            .iter()
            .map(|(fd, _)| libc::pollfd {
                fd: fd.as_raw_fd(),
                events: libc::POLLOUT,
                revents: 0,
            })
            .collect();
        // SAFETY: `polls` is a valid array of its length.
        unsafe { libc::poll(polls.as_mut_ptr(), polls.len() as libc::nfds_t, 5) };
        let mut still = Vec::with_capacity(pending.len());
        for ((fd, since), poll) in pending.drain(..).zip(&polls) {
            if poll.revents != 0 {
                if socket_error(fd.as_raw_fd()) == 0 {
                    ports.push(local_port(fd.as_raw_fd()));
                    conns.push(fd);
                } else {
                    failed += 1;
                }
            } else if since.elapsed() > CONNECT_TIMEOUT {
                failed += 1;
            } else {
                still.push((fd, since));
            }
        }
        pending = still;
    }
    let ports: Vec<String> = ports.iter().map(u16::to_string).collect();
    format!(
        "opened {} {failed} {:.2} {}",
        ports.len(),
        started.elapsed().as_secs_f64(),
        ports.join(",")
    )
}

fn tcp_info(fd: RawFd) -> Option<libc::tcp_info> {
    // SAFETY: getsockopt writes at most `len` bytes into `info`.
    unsafe {
        let mut info: libc::tcp_info = std::mem::zeroed();
        let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
        let r = libc::getsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&mut info as *mut libc::tcp_info).cast(),
            &mut len,
        );
        (r == 0).then_some(info)
    }
}

/// One byte on each connection, then waits until each is acknowledged (alive) or reset.
fn probe(conns: &[OwnedFd]) -> String {
    let mut reset = vec![false; conns.len()];
    for (i, fd) in conns.iter().enumerate() {
        // SAFETY: a one-byte write from a live buffer.
        let wrote = unsafe {
            libc::send(
                fd.as_raw_fd(),
                b"p".as_ptr().cast(),
                1,
                libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
            )
        };
        if wrote != 1 {
            reset[i] = true;
        }
    }
    let started = Instant::now();
    loop {
        let (mut alive, mut resets, mut unacked) = (0, 0, 0);
        for (i, fd) in conns.iter().enumerate() {
            match tcp_info(fd.as_raw_fd()) {
                _ if reset[i] => resets += 1,
                Some(info) if info.tcpi_state != TCP_ESTABLISHED => resets += 1,
                Some(info) if info.tcpi_unacked == 0 => alive += 1,
                _ => unacked += 1,
            }
        }
        if unacked == 0 || started.elapsed() > PROBE_TIMEOUT {
            return format!("probe {alive} {resets} {unacked}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Lifts the soft limit on open files to the hard one: each connection is a file.
fn raise_nofile() {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit only read and write `limit`.
    let got = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) };
    if got == 0 && limit.rlim_cur < limit.rlim_max {
        limit.rlim_cur = limit.rlim_max;
        // SAFETY: as above.
        unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) };
    }
}
