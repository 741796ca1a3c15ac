//! The bulk transfer's messages: a joining node asks a peer for its connection table over
//! TCP (the cluster's port, on the same address as the datagrams) and the peer answers
//! with a stream of frames. TCP carries any number of entries without loss and paces the
//! sender to what the receiver takes; a dropped connection is resumed where it broke.
//!
//! ```text
//! frame: length u32 (of the body) | body | HMAC-SHA256 (32 bytes), integers big-endian
//! request body (joiner -> peer, once):
//!   magic "LBS1" | boot u64 | time_ms u64 | nonce [16] | snapshot u64 | from u64
//!   HMAC over "request" | body
//! answer bodies (peer -> joiner), frame i of the connection (0, 1, ...):
//!   1 Accepted                                        (the request passed)
//!   2 Start    snapshot u64 | total u64 | from u64    (the entries, from index `from`)
//!   3 Entries  first u64 | count u32 | count x entry  (entries as `wire` encodes them)
//!   4 Done     total u64
//!   HMAC over "answer" | nonce | i u64 | body
//! ```
//!
//! Only key holders can ask (the request's HMAC, its time within `wire::MAX_SKEW_MS`, a
//! nonce not seen before) and answer: each answer frame is bound to the request's nonce
//! and its place in the stream, so frames of another transfer, replayed, dropped or
//! reordered ones fail. `snapshot` names the answering node's copy of its table for this
//! joiner (0: none yet) so that a reconnection resumes at `from` instead of starting over.

use hmac::Mac;

use super::wire::{self, Entry, Reject};

const MAGIC: &[u8; 4] = b"LBS1";
/// A request's body.
pub const REQUEST_LEN: usize = 4 + 8 + 8 + 16 + 8 + 8;
/// Entries in one `Entries` frame (32 KiB).
pub const FRAME_ENTRIES: usize = 512;
/// The largest body accepted.
pub const MAX_BODY: usize = 1 + 8 + 4 + FRAME_ENTRIES * wire::ENTRY_LEN;

/// What a joining node asks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    /// The joiner's run (`wire::Message::boot`).
    pub boot: u64,
    /// When it asked (wall clock).
    pub time_ms: u64,
    /// Unique per request: binds the answer to it.
    pub nonce: [u8; 16],
    /// The snapshot of an interrupted transfer to resume (0: a new one).
    pub snapshot: u64,
    /// The index to resume from.
    pub from: u64,
}

/// One frame of the answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Answer {
    Accepted,
    Start {
        snapshot: u64,
        total: u64,
        from: u64,
    },
    Entries {
        first: u64,
        entries: Vec<Entry>,
    },
    Done {
        total: u64,
    },
}

fn request_tag(key: &[u8], body: &[u8]) -> [u8; wire::MAC_LEN] {
    let mut mac = wire::mac(key);
    mac.update(b"request");
    mac.update(body);
    mac.finalize().into_bytes().into()
}

fn answer_mac(key: &[u8], nonce: &[u8; 16], index: u64, body: &[u8]) -> wire::HmacSha256 {
    let mut mac = wire::mac(key);
    mac.update(b"answer");
    mac.update(nonce);
    mac.update(&index.to_be_bytes());
    mac.update(body);
    mac
}

/// `body` framed: its length, itself, `tag`.
fn frame(body: &[u8], tag: [u8; wire::MAC_LEN]) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + body.len() + wire::MAC_LEN);
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(body);
    out.extend_from_slice(&tag);
    out
}

fn u64_at(body: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(body[at..at + 8].try_into().expect("8 bytes"))
}

/// The request's frame, authenticated with `key`.
pub fn encode_request(request: &Request, key: &[u8]) -> Vec<u8> {
    let mut body = Vec::with_capacity(REQUEST_LEN);
    body.extend_from_slice(MAGIC);
    body.extend_from_slice(&request.boot.to_be_bytes());
    body.extend_from_slice(&request.time_ms.to_be_bytes());
    body.extend_from_slice(&request.nonce);
    body.extend_from_slice(&request.snapshot.to_be_bytes());
    body.extend_from_slice(&request.from.to_be_bytes());
    frame(&body, request_tag(key, &body))
}

/// The request in a frame's `body` and `tag`, if authenticated with `key`. Freshness and
/// replays are the answering side's to check.
pub fn decode_request(body: &[u8], tag: &[u8], key: &[u8]) -> Result<Request, Reject> {
    if body.len() != REQUEST_LEN {
        return Err(Reject::Malformed);
    }
    let mut mac = wire::mac(key);
    mac.update(b"request");
    mac.update(body);
    mac.verify_slice(tag).map_err(|_| Reject::Auth)?;
    if &body[..4] != MAGIC {
        return Err(Reject::Malformed);
    }
    Ok(Request {
        boot: u64_at(body, 4),
        time_ms: u64_at(body, 12),
        nonce: body[20..36].try_into().expect("16 bytes"),
        snapshot: u64_at(body, 36),
        from: u64_at(body, 44),
    })
}

/// Answer frame `index` of the transfer asked with `nonce`.
pub fn encode_answer(answer: &Answer, key: &[u8], nonce: &[u8; 16], index: u64) -> Vec<u8> {
    let mut body = Vec::new();
    match answer {
        Answer::Accepted => body.push(1),
        Answer::Start {
            snapshot,
            total,
            from,
        } => {
            body.push(2);
            for value in [snapshot, total, from] {
                body.extend_from_slice(&value.to_be_bytes());
            }
        }
        Answer::Entries { first, entries } => {
            assert!(entries.len() <= FRAME_ENTRIES, "split into frames first");
            body.reserve(13 + entries.len() * wire::ENTRY_LEN);
            body.push(3);
            body.extend_from_slice(&first.to_be_bytes());
            body.extend_from_slice(&(entries.len() as u32).to_be_bytes());
            for entry in entries {
                wire::encode_entry(entry, &mut body);
            }
        }
        Answer::Done { total } => {
            body.push(4);
            body.extend_from_slice(&total.to_be_bytes());
        }
    }
    let tag = answer_mac(key, nonce, index, &body)
        .finalize()
        .into_bytes()
        .into();
    frame(&body, tag)
}

/// Answer frame `index` from its `body` and `tag`, if authenticated for this transfer.
pub fn decode_answer(
    body: &[u8],
    tag: &[u8],
    key: &[u8],
    nonce: &[u8; 16],
    index: u64,
) -> Result<Answer, Reject> {
    answer_mac(key, nonce, index, body)
        .verify_slice(tag)
        .map_err(|_| Reject::Auth)?;
    let malformed = Err(Reject::Malformed);
    match (body.first(), body.len()) {
        (Some(1), 1) => Ok(Answer::Accepted),
        (Some(2), 25) => Ok(Answer::Start {
            snapshot: u64_at(body, 1),
            total: u64_at(body, 9),
            from: u64_at(body, 17),
        }),
        (Some(3), len) if len >= 13 => {
            let count = u32::from_be_bytes(body[9..13].try_into().expect("4 bytes")) as usize;
            if count > FRAME_ENTRIES || len != 13 + count * wire::ENTRY_LEN {
                return malformed;
            }
            Ok(Answer::Entries {
                first: u64_at(body, 1),
                entries: body[13..]
                    .chunks_exact(wire::ENTRY_LEN)
                    .map(wire::decode_entry)
                    .collect(),
            })
        }
        (Some(4), 9) => Ok(Answer::Done {
            total: u64_at(body, 1),
        }),
        _ => malformed,
    }
}

/// Reads one frame (body and tag) from `reader`; a length beyond `MAX_BODY` is refused
/// before anything is allocated.
pub async fn read_frame(
    reader: &mut (impl tokio::io::AsyncRead + Unpin),
) -> std::io::Result<(Vec<u8>, Vec<u8>)> {
    use tokio::io::AsyncReadExt;
    let mut length = [0u8; 4];
    reader.read_exact(&mut length).await?;
    let length = u32::from_be_bytes(length) as usize;
    if length > MAX_BODY {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("a frame of {length} bytes (at most {MAX_BODY})"),
        ));
    }
    let mut body = vec![0u8; length];
    reader.read_exact(&mut body).await?;
    let mut tag = vec![0u8; wire::MAC_LEN];
    reader.read_exact(&mut tag).await?;
    Ok((body, tag))
}

#[cfg(test)]
mod tests {
    use super::*;
    use lb_common::{ADDR_FAMILY_V4, FlowKey, PROTO_TCP};

    const KEY: &[u8] = b"0123456789abcdef0123456789abcdef";
    const NONCE: [u8; 16] = [7; 16];

    fn entry(port: u16) -> Entry {
        Entry {
            key: FlowKey {
                src: [10, 1, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
                dst: [10, 0, 0, 100, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
                src_port: port.to_be(),
                dst_port: 80u16.to_be(),
                proto: PROTO_TCP,
                family: ADDR_FAMILY_V4,
                _pad: [0; 2],
            },
            backend: [10, 0, 0, 11, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            age_s: 3,
            flags: 0,
        }
    }

    fn split(frame: &[u8]) -> (Vec<u8>, Vec<u8>) {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        runtime.block_on(read_frame(&mut &frame[..])).unwrap()
    }

    #[test]
    fn a_request_decodes_to_what_was_sent_and_only_with_the_key() {
        let request = Request {
            boot: 11,
            time_ms: 22,
            nonce: NONCE,
            snapshot: 3,
            from: 1024,
        };
        let (body, tag) = split(&encode_request(&request, KEY));
        assert_eq!(decode_request(&body, &tag, KEY), Ok(request));
        assert_eq!(
            decode_request(&body, &tag, b"another key of 32 bytes, wrong!!"),
            Err(Reject::Auth)
        );
        let mut altered = body.clone();
        altered[40] ^= 1;
        assert_eq!(decode_request(&altered, &tag, KEY), Err(Reject::Auth));
        assert_eq!(
            decode_request(&body[1..], &tag, KEY),
            Err(Reject::Malformed)
        );
    }

    #[test]
    fn answers_are_bound_to_their_transfer_and_place() {
        let answers = [
            Answer::Accepted,
            Answer::Start {
                snapshot: 5,
                total: 100_140,
                from: 0,
            },
            Answer::Entries {
                first: 512,
                entries: (0..FRAME_ENTRIES as u16).map(entry).collect(),
            },
            Answer::Entries {
                first: 0,
                entries: Vec::new(),
            },
            Answer::Done { total: 100_140 },
        ];
        for (index, answer) in answers.iter().enumerate() {
            let index = index as u64;
            let (body, tag) = split(&encode_answer(answer, KEY, &NONCE, index));
            assert!(body.len() <= MAX_BODY);
            assert_eq!(
                decode_answer(&body, &tag, KEY, &NONCE, index).as_ref(),
                Ok(answer)
            );
            // Another transfer's, or another place in this one: refused.
            assert_eq!(
                decode_answer(&body, &tag, KEY, &[8; 16], index),
                Err(Reject::Auth)
            );
            assert_eq!(
                decode_answer(&body, &tag, KEY, &NONCE, index + 1),
                Err(Reject::Auth)
            );
        }
    }

    #[tokio::test]
    async fn an_oversized_frame_is_refused_before_it_is_read() {
        let mut frame = ((MAX_BODY + 1) as u32).to_be_bytes().to_vec();
        frame.extend_from_slice(&[0; 64]);
        let error = read_frame(&mut &frame[..]).await.unwrap_err();
        assert_eq!(error.kind(), std::io::ErrorKind::InvalidData);
    }
}
