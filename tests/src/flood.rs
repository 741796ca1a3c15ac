//! A spoofed flood: frames to a VIP from random sources and ports (TCP SYNs, TCP ACKs,
//! UDP datagrams), sent from a namespace's interface with an AF_PACKET socket at a
//! bounded rate, one thread per CPU (the connection table's LRU lists are per CPU, and
//! a veth runs the receiving XDP program on the sending CPU).
//!
//! The TCP and UDP checksums are left zero: the balancer forwards the frames, and the
//! backend's kernel drops them, so it answers no spoofed source.

use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow};

use crate::Netns;
use crate::client::checksum;
use crate::sniff::packet_socket;

/// What a flood sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Spoofed {
    Syn,
    Ack,
    Udp,
}

/// Where a flood goes and how fast.
#[derive(Clone, Debug)]
pub struct FloodSpec {
    /// The interface (in the namespace) the frames leave by.
    pub ifname: String,
    /// The balancer's MAC: the frames' destination.
    pub dst_mac: [u8; 6],
    pub vip: Ipv4Addr,
    pub port: u16,
    /// Cycled frame by frame.
    pub kinds: Vec<Spoofed>,
    /// Frames per second per thread.
    pub rate: u64,
    /// Each thread stops after this long at most.
    pub duration: Duration,
}

/// One flooding thread per CPU, until stopped or `duration` passed.
pub struct Flood {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<Result<u64>>>,
}

impl Flood {
    /// Starts one thread pinned to each of `cpus`, inside `ns`.
    pub fn start(ns: &Netns, spec: &FloodSpec, cpus: &[usize]) -> Result<Flood> {
        let stop = Arc::new(AtomicBool::new(false));
        let mut threads = Vec::new();
        for &cpu in cpus {
            let (spec, stop) = (spec.clone(), stop.clone());
            threads.push(ns.spawn(&format!("flood-{cpu}"), move || flood(&spec, cpu, &stop))?);
        }
        Ok(Flood { stop, threads })
    }

    /// Stops every thread and returns the frames each sent.
    pub fn stop(self) -> Result<Vec<u64>> {
        self.stop.store(true, Ordering::Relaxed);
        self.threads
            .into_iter()
            .map(|t| t.join().map_err(|_| anyhow!("a flood thread panicked"))?)
            .collect()
    }
}

fn flood(spec: &FloodSpec, cpu: usize, stop: &AtomicBool) -> Result<u64> {
    let mut set = nix::sched::CpuSet::new();
    set.set(cpu).context("cpu set")?;
    nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set)
        .with_context(|| format!("pin the flood thread to CPU {cpu}"))?;
    let fd = packet_socket(&spec.ifname, 0)?;
    let mut rng = 0x9e37_79b9_7f4a_7c15u64 ^ (cpu as u64 + 1).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    let start = Instant::now();
    let burst = 256u64;
    let mut sent = 0u64;
    while !stop.load(Ordering::Relaxed) && start.elapsed() < spec.duration {
        for _ in 0..burst {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let kind = spec.kinds[(sent % spec.kinds.len() as u64) as usize];
            let frame = spoofed_frame(spec, kind, rng);
            let n = unsafe { libc::send(fd.as_raw_fd(), frame.as_ptr().cast(), frame.len(), 0) };
            if n < 0 {
                let error = std::io::Error::last_os_error();
                // A full transmit queue: wait for it, as a real flooder's NIC would.
                if error.raw_os_error() == Some(libc::ENOBUFS) {
                    std::thread::sleep(Duration::from_micros(50));
                    continue;
                }
                return Err(error).context("send a flood frame");
            }
            sent += 1;
        }
        // Keep to the rate: sleep until the schedule of the frames sent so far.
        let due = Duration::from_secs_f64(sent as f64 / spec.rate as f64);
        if let Some(ahead) = due.checked_sub(start.elapsed()) {
            std::thread::sleep(ahead);
        }
    }
    Ok(sent)
}

/// An Ethernet + IPv4 frame to the VIP from a source in 172.16.0.0/12 and a port, both
/// from `random`.
fn spoofed_frame(spec: &FloodSpec, kind: Spoofed, random: u64) -> Vec<u8> {
    let src = Ipv4Addr::from(0xac10_0000 | (random as u32 & 0x000f_ffff));
    let sport = (random >> 32) as u16 | 1024;
    let l4: Vec<u8> = match kind {
        Spoofed::Syn | Spoofed::Ack => {
            let flags = if kind == Spoofed::Syn { 0x02 } else { 0x10 };
            let mut tcp = vec![0u8; 20];
            tcp[0..2].copy_from_slice(&sport.to_be_bytes());
            tcp[2..4].copy_from_slice(&spec.port.to_be_bytes());
            tcp[4..8].copy_from_slice(&((random >> 16) as u32).to_be_bytes());
            tcp[12] = 5 << 4;
            tcp[13] = flags;
            tcp[14..16].copy_from_slice(&64240u16.to_be_bytes());
            tcp
        }
        Spoofed::Udp => {
            let mut udp = vec![0u8; 8 + 16];
            udp[0..2].copy_from_slice(&sport.to_be_bytes());
            udp[2..4].copy_from_slice(&spec.port.to_be_bytes());
            let len = udp.len() as u16;
            udp[4..6].copy_from_slice(&len.to_be_bytes());
            udp
        }
    };
    let proto = if kind == Spoofed::Udp { 17 } else { 6 };
    let mut ip = vec![0u8; 20];
    ip[0] = 0x45;
    ip[2..4].copy_from_slice(&((20 + l4.len()) as u16).to_be_bytes());
    ip[8] = 64;
    ip[9] = proto;
    ip[12..16].copy_from_slice(&src.octets());
    ip[16..20].copy_from_slice(&spec.vip.octets());
    let sum = checksum(&ip);
    ip[10..12].copy_from_slice(&sum.to_be_bytes());
    let mut frame = Vec::with_capacity(14 + ip.len() + l4.len());
    frame.extend_from_slice(&spec.dst_mac);
    // A locally administered source MAC no host of the lab has.
    frame.extend_from_slice(&[0x02, 0xf1, 0x00, 0x00, 0x00, 0x01]);
    frame.extend_from_slice(&0x0800u16.to_be_bytes());
    frame.extend_from_slice(&ip);
    frame.extend_from_slice(&l4);
    frame
}
