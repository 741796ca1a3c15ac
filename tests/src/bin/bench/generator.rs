//! The veth benchmark's traffic generators, and the choice between them.
//!
//! Live frames (BPF_PROG_TEST_RUN with BPF_F_TEST_XDP_LIVE_FRAMES running
//! `xdp_bench_tx`) are the cheapest generator, but some kernels refuse them with EPERM,
//! even to root. Where they do, an AF_PACKET socket on the same interface sends
//! pre-built frames with `sendmmsg` past the qdisc (PACKET_QDISC_BYPASS): dearer per
//! frame for the sender, so its Mpps are lower; lb and the MAC-swap baseline get the
//! same frames from the same generator in the same rounds, so their ratio compares like
//! with like, though not with a ratio that live frames made (the sender's share of each
//! frame's cost differs).

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::time::Instant;

use anyhow::{Context, Result, bail};

/// Which generator made a set of figures.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Generator {
    /// BPF_PROG_TEST_RUN live frames of `xdp_bench_tx` (XDP_TX out of gen's veth).
    #[value(name = "live")]
    LiveFrames,
    /// AF_PACKET `sendmmsg` with PACKET_QDISC_BYPASS (skbs into gen's veth).
    #[value(name = "af-packet")]
    AfPacket,
}

impl Generator {
    pub fn name(self) -> &'static str {
        match self {
            Generator::LiveFrames => "live frames",
            Generator::AfPacket => "AF_PACKET sendmmsg",
        }
    }
}

/// Whether `err` is the kernel's EPERM (what these kernels answer to live frames).
pub fn is_eperm(err: &anyhow::Error) -> bool {
    err.chain().any(|cause| {
        cause
            .downcast_ref::<io::Error>()
            .is_some_and(|e| e.raw_os_error() == Some(libc::EPERM))
    })
}

/// Pins the calling thread to the CPU it runs on, so the generator and the veth NAPI
/// work it raises (both ends run in the softirqs of the sending CPU) share one core:
/// the Mpps are then per core. Returns that CPU.
pub fn pin_to_this_cpu() -> Result<usize> {
    let cpu = nix::sched::sched_getcpu().context("sched_getcpu")?;
    let mut set = nix::sched::CpuSet::new();
    set.set(cpu).context("CpuSet::set")?;
    nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set)
        .context("sched_setaffinity")?;
    Ok(cpu)
}

/// Frames per `sendmmsg` call.
const BATCH: usize = 256;

/// What one [`PacketGen::send`] did.
pub struct Sent {
    /// Frames the kernel took (the veth's transmit accepted them).
    pub accepted: u64,
    /// Frames the kernel refused with ENOBUFS (the peer's ring was full): offered, not
    /// sent, not retried.
    pub refused: u64,
    pub seconds: f64,
}

/// An AF_PACKET sender of whole Ethernet frames on one interface, past the qdisc.
pub struct PacketGen {
    fd: OwnedFd,
}

impl PacketGen {
    /// Opens it on `ifname` of the calling thread's namespace.
    pub fn open(ifname: &str) -> Result<PacketGen> {
        // Protocol 0: the socket receives nothing, it only sends.
        let fd = lb_tests::sniff::packet_socket(ifname, 0)?;
        let one: libc::c_int = 1;
        // SAFETY: `one` lives across the call and its size is passed.
        let r = unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_PACKET,
                libc::PACKET_QDISC_BYPASS,
                (&raw const one).cast(),
                size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if r < 0 {
            return Err(io::Error::last_os_error()).context("PACKET_QDISC_BYPASS");
        }
        Ok(PacketGen { fd })
    }

    /// Offers `count` frames, cycling through `frames` in order (frame i, then i + 1: one
    /// flow after another), in batches of [`BATCH`]. Bounded: every call to the kernel
    /// moves on by at least one frame.
    pub fn send(&self, frames: &[Vec<u8>], count: u64) -> Result<Sent> {
        if frames.is_empty() {
            bail!("no frames to send");
        }
        // SAFETY: iovec and mmsghdr are plain data; all-zero is a valid start.
        let mut iov: Vec<libc::iovec> = vec![unsafe { std::mem::zeroed() }; BATCH];
        let mut msgs: Vec<libc::mmsghdr> = vec![unsafe { std::mem::zeroed() }; BATCH];
        let (mut offered, mut accepted, mut refused) = (0u64, 0u64, 0u64);
        let start = Instant::now();
        while offered < count {
            let n = (count - offered).min(BATCH as u64) as usize;
            for j in 0..n {
                let frame = &frames[((offered + j as u64) % frames.len() as u64) as usize];
                // The kernel only reads through iov_base on send.
                iov[j].iov_base = frame.as_ptr().cast_mut().cast();
                iov[j].iov_len = frame.len();
                msgs[j].msg_hdr.msg_iov = &raw mut iov[j];
                msgs[j].msg_hdr.msg_iovlen = 1;
            }
            // SAFETY: msgs[..n] point at iov[..n], which point into `frames`; all live
            // across the call. The socket is bound, so no address is needed.
            let r = unsafe { libc::sendmmsg(self.fd.as_raw_fd(), msgs.as_mut_ptr(), n as _, 0) };
            if r > 0 {
                offered += r as u64;
                accepted += r as u64;
                continue;
            }
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                // The veth's ring is full: that frame is lost, the next one may pass.
                Some(libc::ENOBUFS) | Some(libc::EAGAIN) => {
                    offered += 1;
                    refused += 1;
                }
                Some(libc::EINTR) => {}
                _ => return Err(e).context("sendmmsg on AF_PACKET"),
            }
        }
        Ok(Sent {
            accepted,
            refused,
            seconds: start.elapsed().as_secs_f64(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eperm_is_found_under_context() {
        let eperm = anyhow::Error::new(io::Error::from_raw_os_error(libc::EPERM))
            .context("bpf_prog_test_run")
            .context("BPF_PROG_TEST_RUN live frames");
        assert!(is_eperm(&eperm));
        let enoent = anyhow::Error::new(io::Error::from_raw_os_error(libc::ENOENT)).context("x");
        assert!(!is_eperm(&enoent));
        assert!(!is_eperm(&anyhow::anyhow!("Operation not permitted")));
    }
}
