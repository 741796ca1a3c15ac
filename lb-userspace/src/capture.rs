//! The debug capture: frames of TCP packets that missed the connection table without a
//! SYN (the "are we breaking flows" signal), sampled by the program at a bounded rate
//! into a ring buffer, written here as pcap (readable by tcpdump and Wireshark).

use std::{fs::File, path::Path, time::Duration};

use anyhow::Context;
use aya::maps::{MapData, RingBuf};
use lb_common::CaptureRecord;
use pcap_file::pcap::{PcapHeader, PcapPacket, PcapWriter};
use tokio::io::unix::AsyncFd;
use tokio_util::sync::CancellationToken;

/// Ethernet frames, cut at `CAPTURE_BYTES`.
fn header() -> PcapHeader {
    PcapHeader {
        snaplen: lb_common::CAPTURE_BYTES as u32,
        datalink: pcap_file::DataLink::ETHERNET,
        ..PcapHeader::default()
    }
}

/// A pcap file being written from capture records.
pub struct PcapSink {
    // Unbuffered: the program rate-limits captures, and a record should be on disk as
    // soon as it is read.
    writer: PcapWriter<File>,
    /// Wall-clock time minus CLOCK_MONOTONIC, for the records' timestamps.
    wall_offset: Duration,
}

impl PcapSink {
    pub fn create(path: &Path) -> anyhow::Result<Self> {
        let file = File::create(path).with_context(|| format!("creating {}", path.display()))?;
        let writer = PcapWriter::with_header(file, header())
            .with_context(|| format!("writing the pcap header of {}", path.display()))?;
        let wall = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let mono = Duration::from_nanos(crate::explain::monotonic_ns());
        Ok(Self {
            writer,
            wall_offset: wall.saturating_sub(mono),
        })
    }

    /// Writes one record; returns false for a record of the wrong size (skipped).
    pub fn write(&mut self, bytes: &[u8]) -> anyhow::Result<bool> {
        let Some(record) = bytemuck::try_from_bytes::<CaptureRecord>(bytes)
            .ok()
            .copied()
        else {
            return Ok(false);
        };
        let caplen = (record.caplen as usize).min(record.data.len());
        let timestamp = self.wall_offset + Duration::from_nanos(record.ts_ns);
        let packet = PcapPacket::new(timestamp, record.len, &record.data[..caplen]);
        self.writer
            .write_packet(&packet)
            .context("writing a pcap record")?;
        Ok(true)
    }
}

/// Writes every record now in `ring` to `sink`; returns how many.
pub fn drain(ring: &mut RingBuf<MapData>, sink: &mut PcapSink) -> anyhow::Result<usize> {
    let mut written = 0;
    while let Some(item) = ring.next() {
        if sink.write(&item)? {
            written += 1;
        }
    }
    Ok(written)
}

/// Writes captured frames to `path` as they come, until `shutdown`.
pub async fn run(
    ring: RingBuf<MapData>,
    path: &Path,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let mut sink = PcapSink::create(path)?;
    // SAFETY: the ring buffer owns its map's file descriptor for as long as it lives, and
    // `AsyncFd` owns the ring buffer.
    let mut ring = unsafe { AsyncFd::register(ring) }
        .map_err(|e| anyhow::anyhow!("polling the capture ring buffer: {e}"))?;
    tracing::info!("debug capture: non-SYN misses to {}", path.display());
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            ready = ring.readable_mut() => {
                let mut guard = ready.context("waiting for captured frames")?;
                drain(guard.get_inner_mut(), &mut sink)?;
                guard.clear_ready();
            }
        }
    }
}
