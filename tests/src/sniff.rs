//! A packet counter on one interface of a namespace (AF_PACKET, every EtherType), to
//! prove which frames an interface does or does not see.

use std::io;
use std::net::IpAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::{Context, Result, anyhow};

use crate::Netns;

const ETH_P_ALL: u16 = 0x0003;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
/// Only the headers matter; longer frames are truncated on read.
const SNAPLEN: usize = 256;

/// What a [`Sniffer`] counted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sniffed {
    /// Frames for which the predicate held.
    pub matched: usize,
    /// All frames.
    pub seen: usize,
}

/// Counts the frames on an interface (received and sent) for which a predicate over the
/// raw Ethernet frame holds, until stopped.
pub struct Sniffer {
    stop: Arc<AtomicBool>,
    matched: Arc<AtomicUsize>,
    seen: Arc<AtomicUsize>,
    handle: Option<JoinHandle<Result<()>>>,
}

impl Sniffer {
    /// Returns once the socket is bound: every frame after that is seen.
    pub fn start(
        ns: &Netns,
        ifname: &str,
        predicate: impl Fn(&[u8]) -> bool + Send + 'static,
    ) -> Result<Sniffer> {
        let stop = Arc::new(AtomicBool::new(false));
        let matched = Arc::new(AtomicUsize::new(0));
        let seen = Arc::new(AtomicUsize::new(0));
        let (ready_tx, ready_rx) = mpsc::channel::<Result<()>>();
        let ifname_owned = ifname.to_string();
        let handle = {
            let (stop, matched, seen) = (stop.clone(), matched.clone(), seen.clone());
            ns.spawn(&format!("sniff-{ifname}"), move || {
                let fd = match open(&ifname_owned) {
                    Ok(fd) => {
                        let _ = ready_tx.send(Ok(()));
                        fd
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(anyhow!("{e:#}")));
                        return Err(e);
                    }
                };
                capture(&fd, &predicate, &stop, &matched, &seen)
            })?
        };
        let ready = ready_rx
            .recv()
            .map_err(|_| anyhow!("sniffer on {ifname} ended before starting"));
        let sniffer = Sniffer {
            stop,
            matched,
            seen,
            handle: Some(handle),
        };
        ready??;
        Ok(sniffer)
    }

    /// Matching frames so far.
    pub fn count(&self) -> usize {
        self.matched.load(Ordering::Relaxed)
    }

    /// All frames so far.
    pub fn seen(&self) -> usize {
        self.seen.load(Ordering::Relaxed)
    }

    /// Stops after reading what is queued; returns the matching count.
    pub fn stop(self) -> Result<usize> {
        Ok(self.finish()?.matched)
    }

    /// Stops after reading what is queued; returns both counts.
    pub fn finish(mut self) -> Result<Sniffed> {
        self.shutdown()?;
        Ok(Sniffed {
            matched: self.count(),
            seen: self.seen(),
        })
    }

    fn shutdown(&mut self) -> Result<()> {
        self.stop.store(true, Ordering::Relaxed);
        match self.handle.take() {
            Some(h) => h.join().map_err(|_| anyhow!("sniffer panicked"))?,
            None => Ok(()),
        }
    }
}

impl Drop for Sniffer {
    fn drop(&mut self) {
        if let Err(e) = self.shutdown() {
            eprintln!("warning: sniffer: {e:#}");
        }
    }
}

fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// An AF_PACKET socket bound to `ifname` for frames of EtherType `protocol` (network
/// order applied here; 0: none received, for a socket that only sends whole frames).
pub fn packet_socket(ifname: &str, protocol: u16) -> Result<OwnedFd> {
    let ifindex =
        nix::net::if_::if_nametoindex(ifname).with_context(|| format!("no interface {ifname}"))?;
    // Protocol 0 at creation and ETH_P_ALL at bind: no frame of another interface slips
    // in between.
    // SAFETY: plain socket(2); the fd is owned right away.
    let fd = unsafe {
        OwnedFd::from_raw_fd(cvt(libc::socket(
            libc::AF_PACKET,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            0,
        ))?)
    };
    // SAFETY: sockaddr_ll is plain data; all-zero is a valid start.
    let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    sll.sll_family = libc::AF_PACKET as u16;
    sll.sll_protocol = protocol.to_be();
    sll.sll_ifindex = ifindex as i32;
    // SAFETY: sll lives across the call and its size is passed.
    cvt(unsafe {
        libc::bind(
            fd.as_raw_fd(),
            (&raw const sll).cast(),
            size_of::<libc::sockaddr_ll>() as libc::socklen_t,
        )
    })
    .with_context(|| format!("bind AF_PACKET to {ifname}"))?;
    Ok(fd)
}

fn open(ifname: &str) -> Result<OwnedFd> {
    let fd = packet_socket(ifname, ETH_P_ALL)?;
    let tv = libc::timeval {
        tv_sec: 0,
        tv_usec: 50_000,
    };
    // SAFETY: tv lives across the call and its size is passed.
    cvt(unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&raw const tv).cast(),
            size_of::<libc::timeval>() as libc::socklen_t,
        )
    })
    .context("SO_RCVTIMEO")?;
    Ok(fd)
}

fn capture(
    fd: &OwnedFd,
    predicate: &dyn Fn(&[u8]) -> bool,
    stop: &AtomicBool,
    matched: &AtomicUsize,
    seen: &AtomicUsize,
) -> Result<()> {
    let mut buf = [0u8; SNAPLEN];
    loop {
        // After the stop flag, drain what is queued without waiting.
        let stopping = stop.load(Ordering::Relaxed);
        let flags = if stopping { libc::MSG_DONTWAIT } else { 0 };
        // SAFETY: buf is valid for SNAPLEN bytes; a longer frame is truncated.
        let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), SNAPLEN, flags) };
        if n < 0 {
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut if stopping => return Ok(()),
                io::ErrorKind::WouldBlock
                | io::ErrorKind::TimedOut
                | io::ErrorKind::Interrupted => continue,
                _ => return Err(e).context("AF_PACKET recv"),
            }
        }
        let frame = &buf[..n as usize];
        seen.fetch_add(1, Ordering::Relaxed);
        if predicate(frame) {
            matched.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// How long to let in-flight frames arrive before stopping a sniffer.
pub const SETTLE: Duration = Duration::from_millis(200);

/// The source address of an untagged IPv4 or IPv6 frame.
fn frame_src(frame: &[u8]) -> Option<IpAddr> {
    let ethertype = u16::from_be_bytes(frame.get(12..14)?.try_into().ok()?);
    match ethertype {
        ETH_P_IP => {
            let b: [u8; 4] = frame.get(26..30)?.try_into().ok()?;
            Some(IpAddr::from(b))
        }
        ETH_P_IPV6 => {
            let b: [u8; 16] = frame.get(22..38)?.try_into().ok()?;
            Some(IpAddr::from(b))
        }
        _ => None,
    }
}

/// A predicate: IPv4/IPv6 frames whose source address is `addr`.
pub fn ip_src_is(addr: IpAddr) -> impl Fn(&[u8]) -> bool + Send + 'static {
    move |frame| frame_src(frame) == Some(addr)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn source_address_of_frames() {
        let mut v4 = vec![0u8; 34];
        v4[12..14].copy_from_slice(&ETH_P_IP.to_be_bytes());
        v4[26..30].copy_from_slice(&[10, 99, 0, 100]);
        assert_eq!(frame_src(&v4), Some("10.99.0.100".parse().unwrap()));
        assert!(ip_src_is("10.99.0.100".parse().unwrap())(&v4));
        assert!(!ip_src_is("10.99.0.1".parse().unwrap())(&v4));
        let mut v6 = vec![0u8; 54];
        v6[12..14].copy_from_slice(&ETH_P_IPV6.to_be_bytes());
        let a: std::net::Ipv6Addr = "fd00:99::100".parse().unwrap();
        v6[22..38].copy_from_slice(&a.octets());
        assert_eq!(frame_src(&v6), Some(IpAddr::V6(a)));
        assert_eq!(frame_src(&v4[..20]), None);
        v4[12] = 0x81; // VLAN: not looked into
        assert_eq!(frame_src(&v4), None);
    }
}
