//! The cluster's datagrams: what they hold, how they are authenticated, and how a replay
//! is told from a new message.
//!
//! ```text
//! header (32 bytes, integers big-endian)
//!   magic "LBC1" | kind u8 | 0 u8 | count u16 | boot u64 | seq u64 | time_ms u64
//! count x entry (64 bytes)
//!   flow key (40: lb_common::FlowKey as the map holds it, addresses and ports in
//!   network order) | backend address (16) | age_s u32 | flags u32
//! HMAC-SHA256 of all the above with the shared key (32 bytes)
//! ```
//!
//! `boot` names the sender's run (its start, in wall-clock nanoseconds: a restarted
//! sender's is larger), `seq` counts its datagrams in that run, `time_ms` is when it
//! sent this one (wall clock). A receiver accepts a datagram once: only with a valid
//! HMAC, within `MAX_SKEW` of its own clock, from the sender's latest run, and with a
//! sequence number it has not seen (a 64-wide window for reordering).

use hmac::{Hmac, KeyInit, Mac};
use lb_common::FlowKey;
use sha2::Sha256;

const MAGIC: &[u8; 4] = b"LBC1";
pub const HEADER_LEN: usize = 32;
pub const ENTRY_LEN: usize = 64;
pub const MAC_LEN: usize = 32;
/// Entries per datagram: 1344 bytes in all, within a 1500-byte MTU with IPv6 and UDP.
pub const MAX_ENTRIES: usize = 20;
/// The largest datagram sent.
pub const MAX_DATAGRAM: usize = HEADER_LEN + MAX_ENTRIES * ENTRY_LEN + MAC_LEN;
/// How far a datagram's time may be from the receiver's clock: older copies are replays.
pub const MAX_SKEW_MS: u64 = 30_000;
/// Out-of-order datagrams accepted behind the newest one.
const WINDOW: u64 = 64;

/// What a datagram asks of its receiver.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Entries to learn.
    Entries = 1,
    /// "Send me your live entries" (a node that starts with an empty table).
    DumpRequest = 2,
    /// The last of the entries answering a dump request.
    DumpDone = 3,
}

impl Kind {
    fn from_u8(byte: u8) -> Option<Kind> {
        match byte {
            1 => Some(Kind::Entries),
            2 => Some(Kind::DumpRequest),
            3 => Some(Kind::DumpDone),
            _ => None,
        }
    }
}

/// One connection-table entry as the peers see it: the backend by its address (ids
/// differ between nodes), the VIP by the flow key's destination.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    pub key: FlowKey,
    /// The backend's address as the maps hold it (IPv4: the first 4 bytes), of the flow
    /// key's family.
    pub backend: [u8; 16],
    /// Seconds since the flow's last packet, as the sender knew it.
    pub age_s: u32,
    /// `lb_common::FLOW_F_*` bits (the receiver keeps `FLOW_F_CLOSING`).
    pub flags: u32,
}

/// A datagram's content.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    pub kind: Kind,
    pub boot: u64,
    pub seq: u64,
    pub time_ms: u64,
    pub entries: Vec<Entry>,
}

/// Why a datagram was dropped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Reject {
    #[error("malformed (size, magic or kind)")]
    Malformed,
    #[error("authentication failed (another key, or altered)")]
    Auth,
    #[error("outside the time window (an old copy, or clocks apart)")]
    Stale,
    #[error("already seen or from an earlier run (a replay)")]
    Replay,
}

pub(super) type HmacSha256 = Hmac<Sha256>;

pub(super) fn mac(key: &[u8]) -> HmacSha256 {
    // HMAC takes keys of any length.
    HmacSha256::new_from_slice(key).expect("HMAC accepts any key length")
}

/// The datagram of `message`, authenticated with `key`. At most `MAX_ENTRIES` entries.
pub fn encode(message: &Message, key: &[u8]) -> Vec<u8> {
    assert!(
        message.entries.len() <= MAX_ENTRIES,
        "split into batches first"
    );
    let mut out = Vec::with_capacity(HEADER_LEN + message.entries.len() * ENTRY_LEN + MAC_LEN);
    out.extend_from_slice(MAGIC);
    out.push(message.kind as u8);
    out.push(0);
    out.extend_from_slice(&(message.entries.len() as u16).to_be_bytes());
    out.extend_from_slice(&message.boot.to_be_bytes());
    out.extend_from_slice(&message.seq.to_be_bytes());
    out.extend_from_slice(&message.time_ms.to_be_bytes());
    for entry in &message.entries {
        encode_entry(entry, &mut out);
    }
    let mut mac = mac(key);
    mac.update(&out);
    out.extend_from_slice(&mac.finalize().into_bytes());
    out
}

/// The message in `datagram`, if it is well-formed and authenticated with `key`. Says
/// nothing about replays: see [`ReplayGuard`].
pub fn decode(datagram: &[u8], key: &[u8]) -> Result<Message, Reject> {
    if datagram.len() < HEADER_LEN + MAC_LEN || datagram.len() > MAX_DATAGRAM {
        return Err(Reject::Malformed);
    }
    let (body, tag) = datagram.split_at(datagram.len() - MAC_LEN);
    // Checked before anything is read from the body: only the key's holders are heard.
    let mut mac = mac(key);
    mac.update(body);
    mac.verify_slice(tag).map_err(|_| Reject::Auth)?;
    let u64_at = |at: usize| u64::from_be_bytes(body[at..at + 8].try_into().expect("8 bytes"));
    let count = u16::from_be_bytes([body[6], body[7]]) as usize;
    let kind = Kind::from_u8(body[4]).ok_or(Reject::Malformed)?;
    if &body[..4] != MAGIC || body.len() != HEADER_LEN + count * ENTRY_LEN {
        return Err(Reject::Malformed);
    }
    let entries = body[HEADER_LEN..]
        .chunks_exact(ENTRY_LEN)
        .map(decode_entry)
        .collect();
    Ok(Message {
        kind,
        boot: u64_at(8),
        seq: u64_at(16),
        time_ms: u64_at(24),
        entries,
    })
}

/// Appends `entry`'s `ENTRY_LEN` bytes to `out`.
pub(super) fn encode_entry(entry: &Entry, out: &mut Vec<u8>) {
    out.extend_from_slice(bytemuck::bytes_of(&entry.key));
    out.extend_from_slice(&entry.backend);
    out.extend_from_slice(&entry.age_s.to_be_bytes());
    out.extend_from_slice(&entry.flags.to_be_bytes());
}

/// The entry in `bytes` (`ENTRY_LEN` of them).
pub(super) fn decode_entry(bytes: &[u8]) -> Entry {
    Entry {
        key: bytemuck::pod_read_unaligned(&bytes[..40]),
        backend: bytes[40..56].try_into().expect("16 bytes"),
        age_s: u32::from_be_bytes(bytes[56..60].try_into().expect("4 bytes")),
        flags: u32::from_be_bytes(bytes[60..64].try_into().expect("4 bytes")),
    }
}

/// What a receiver remembers of one sender, to accept each of its datagrams once.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReplayGuard {
    /// The sender's latest run seen (0: none yet).
    boot: u64,
    /// The highest sequence number seen in that run.
    top: u64,
    /// Bit i: `top - i` was seen.
    seen: u64,
}

impl ReplayGuard {
    /// Accepts `message` (authenticated) if it is fresh and new, and remembers it.
    pub fn accept(&mut self, message: &Message, now_ms: u64) -> Result<(), Reject> {
        if message.time_ms.abs_diff(now_ms) > MAX_SKEW_MS {
            return Err(Reject::Stale);
        }
        if message.boot < self.boot {
            return Err(Reject::Replay);
        }
        if message.boot > self.boot {
            // A new run of the sender: its sequence starts again.
            *self = ReplayGuard {
                boot: message.boot,
                top: message.seq,
                seen: 1,
            };
            return Ok(());
        }
        let seq = message.seq;
        if seq > self.top {
            let shift = seq - self.top;
            self.seen = if shift >= WINDOW {
                0
            } else {
                self.seen << shift
            };
            self.seen |= 1;
            self.top = seq;
            return Ok(());
        }
        let behind = self.top - seq;
        if behind >= WINDOW || self.seen & (1 << behind) != 0 {
            return Err(Reject::Replay);
        }
        self.seen |= 1 << behind;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lb_common::{ADDR_FAMILY_V4, PROTO_TCP};

    const KEY: &[u8] = b"0123456789abcdef0123456789abcdef";

    fn entry(port: u16) -> Entry {
        let mut src = [0; 16];
        src[..4].copy_from_slice(&[10, 1, 0, 2]);
        let mut dst = [0; 16];
        dst[..4].copy_from_slice(&[10, 0, 0, 100]);
        let mut backend = [0; 16];
        backend[..4].copy_from_slice(&[10, 0, 0, 11]);
        Entry {
            key: FlowKey {
                src,
                dst,
                src_port: port.to_be(),
                dst_port: 80u16.to_be(),
                proto: PROTO_TCP,
                family: ADDR_FAMILY_V4,
                _pad: [0; 2],
            },
            backend,
            age_s: 7,
            flags: lb_common::FLOW_F_CLOSING,
        }
    }

    fn message(seq: u64, entries: usize) -> Message {
        Message {
            kind: Kind::Entries,
            boot: 1_000,
            seq,
            time_ms: 50_000,
            entries: (0..entries as u16).map(|i| entry(40_000 + i)).collect(),
        }
    }

    #[test]
    fn a_message_decodes_to_what_was_encoded() {
        for entries in [0, 1, MAX_ENTRIES] {
            let sent = message(3, entries);
            let datagram = encode(&sent, KEY);
            assert_eq!(datagram.len(), HEADER_LEN + entries * ENTRY_LEN + MAC_LEN);
            assert_eq!(decode(&datagram, KEY), Ok(sent));
        }
        assert_eq!(encode(&message(1, MAX_ENTRIES), KEY).len(), MAX_DATAGRAM);
        assert_eq!(MAX_DATAGRAM, 1344);
        for kind in [Kind::DumpRequest, Kind::DumpDone] {
            let sent = Message {
                kind,
                ..message(4, 0)
            };
            assert_eq!(decode(&encode(&sent, KEY), KEY).map(|m| m.kind), Ok(kind));
        }
    }

    #[test]
    #[should_panic(expected = "split into batches")]
    fn a_batch_beyond_the_limit_is_refused() {
        encode(&message(1, MAX_ENTRIES + 1), KEY);
    }

    #[test]
    fn another_key_or_any_altered_byte_is_rejected() {
        let datagram = encode(&message(1, 2), KEY);
        assert_eq!(
            decode(&datagram, b"another key of 32 bytes, wrong!!"),
            Err(Reject::Auth)
        );
        for at in [0, 4, 9, 20, HEADER_LEN + 5, datagram.len() - 1] {
            let mut altered = datagram.clone();
            altered[at] ^= 1;
            assert_eq!(decode(&altered, KEY), Err(Reject::Auth), "byte {at}");
        }
        assert_eq!(decode(&datagram[..70], KEY), Err(Reject::Auth));
        assert_eq!(decode(&datagram[..20], KEY), Err(Reject::Malformed));
        assert_eq!(
            decode(&vec![0; MAX_DATAGRAM + 1], KEY),
            Err(Reject::Malformed)
        );
    }

    #[test]
    fn authenticated_but_malformed_is_rejected() {
        // A count that disagrees with the length, signed with the right key.
        let mut body = encode(&message(1, 2), KEY);
        body.truncate(body.len() - MAC_LEN);
        body[7] = 3;
        let mut mac = mac(KEY);
        mac.update(&body);
        body.extend_from_slice(&mac.finalize().into_bytes());
        assert_eq!(decode(&body, KEY), Err(Reject::Malformed));
    }

    #[test]
    fn each_datagram_is_accepted_once_and_only_while_fresh() {
        let now = 50_000;
        let mut guard = ReplayGuard::default();
        assert_eq!(guard.accept(&message(5, 1), now), Ok(()));
        assert_eq!(guard.accept(&message(5, 1), now), Err(Reject::Replay));
        // Reordered within the window: accepted once.
        assert_eq!(guard.accept(&message(7, 1), now), Ok(()));
        assert_eq!(guard.accept(&message(6, 1), now), Ok(()));
        assert_eq!(guard.accept(&message(6, 1), now), Err(Reject::Replay));
        // Far behind the newest: refused, as an old copy would be.
        assert_eq!(guard.accept(&message(200, 1), now), Ok(()));
        assert_eq!(guard.accept(&message(100, 1), now), Err(Reject::Replay));
        assert_eq!(guard.accept(&message(137, 1), now), Ok(()));
        // Outside the time window, whatever the sequence.
        assert_eq!(
            guard.accept(&message(201, 1), now + MAX_SKEW_MS + 1),
            Err(Reject::Stale)
        );
        // A restarted sender starts again; its earlier run is then refused.
        let restarted = Message {
            boot: 2_000,
            ..message(1, 1)
        };
        assert_eq!(guard.accept(&restarted, now), Ok(()));
        assert_eq!(guard.accept(&message(300, 1), now), Err(Reject::Replay));
    }
}
