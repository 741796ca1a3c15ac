//! QUIC connection-ID routing, written once for the program, `lb explain` and the
//! backends' CID generator (`lb-quic`).
//!
//! A QUIC connection outlives its 5-tuple: a client that changes its address or port
//! (a NAT rebinding, Wi-Fi to LTE) keeps sending to the connection IDs the server issued.
//! Backends of a VIP with `quic = true` write their `server_id` into those IDs in the
//! plaintext format of QUIC-LB (draft-ietf-quic-load-balancers): the CID's first octet
//! (config rotation bits and length, not read here), then `quic_server_id_len` bytes of
//! server ID, then whatever the server likes (random, or its own nonce).
//!
//! Only short-header packets (first bit 0, fixed bit 1) are routed by it: their
//! destination CID is always one the server issued. Long-header packets (Initial,
//! 0-RTT, Handshake, Retry) are balanced as any UDP datagram: a client's first DCID is
//! random, and the connection table keeps the handshake on one backend. Anything that
//! does not parse (too short, fixed bit clear, a CID marked unroutable) is plain UDP too:
//! never dropped for it.

use bytemuck::{Pod, Zeroable};

/// Longest `quic_server_id_len`: the ID and the CID's first octet fit the 16-byte window
/// the program reads, and QUIC-LB's plaintext IDs are 1..=15 bytes.
pub const MAX_SERVER_ID_LEN: u32 = 15;

/// `VipInfo::flags`: the VIP routes short-header QUIC packets by server ID; the ID's
/// length is in the bits at `VIP_QUIC_ID_LEN_SHIFT` (flags, not a field of their own: the
/// VIP slot and `LB_VIPS` keep their layout).
pub const VIP_F_QUIC: u32 = 4;
/// Shift of the server ID length (4 bits) in `VipInfo::flags`.
pub const VIP_QUIC_ID_LEN_SHIFT: u32 = 8;
const VIP_QUIC_ID_LEN_MASK: u32 = 0xf;

/// Bytes of the UDP payload a decision reads: the packet's first octet, the DCID's
/// first octet, and 16 bytes from which the server ID is taken. A short-header packet
/// carrying a routable CID is always longer (its DCID, a packet number and an AEAD tag
/// follow), so a shorter payload is not one.
pub const WINDOW_LEN: usize = 18;

/// `quic_server_id_len = len` as `VipInfo::flags` bits.
pub const fn vip_flags(len: u32) -> u32 {
    VIP_F_QUIC | (len & VIP_QUIC_ID_LEN_MASK) << VIP_QUIC_ID_LEN_SHIFT
}

/// The server ID length of a VIP with `flags`; 0 when it does not route QUIC by ID.
#[inline(always)]
pub const fn id_len(flags: u32) -> u32 {
    if flags & VIP_F_QUIC == 0 {
        return 0;
    }
    (flags >> VIP_QUIC_ID_LEN_SHIFT) & VIP_QUIC_ID_LEN_MASK
}

/// Key of `LB_QUIC_IDS` (-> backend id): a VIP's server ID. The ID's bytes after its
/// length are zero.
// Aligned beyond its fields so the program copies it a word at a time.
#[repr(C, align(4))]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct ServerKey {
    pub vip_id: u32,
    pub id: [u8; 16],
}
const _: () = assert!(size_of::<ServerKey>() == 20);

impl ServerKey {
    /// The key of server ID `id` (its first `len` bytes) of VIP `vip_id`.
    #[inline(always)]
    pub fn new(vip_id: u32, id: [u8; 16], len: u32) -> Self {
        let words = bytemuck::cast::<[u8; 16], [u64; 2]>(id);
        let masked = [words[0] & mask(len), words[1] & mask(len.saturating_sub(8))];
        Self {
            vip_id,
            id: bytemuck::cast(masked),
        }
    }

    /// The key of a configured `server_id` written big-endian in `len` bytes (so
    /// `server_id = 7` with length 2 is the CID bytes `00 07`).
    pub fn of_config(vip_id: u32, server_id: u128, len: u32) -> Self {
        let mut id = [0; 16];
        let bytes = server_id.to_be_bytes();
        let len = len.min(MAX_SERVER_ID_LEN) as usize;
        id[..len].copy_from_slice(&bytes[16 - len..]);
        Self { vip_id, id }
    }
}

/// A little-endian word mask of the first `bytes` bytes (all of them from 8 on).
#[inline(always)]
const fn mask(bytes: u32) -> u64 {
    if bytes >= 8 {
        u64::MAX
    } else {
        (1u64 << (bytes * 8)) - 1
    }
}

/// Per-VIP counters of `LB_QUIC_STATS` (per CPU; the agent sums them).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct QuicCounters {
    /// Short-header packets sent to the backend their CID's server ID names.
    pub routed_by_cid: u64,
    /// Short-header packets whose server ID names no backend of the VIP, or one that
    /// is down: balanced by the connection table and the Maglev table instead.
    pub cid_unknown: u64,
}
const _: () = assert!(size_of::<QuicCounters>() == 16);

/// The start of a UDP payload as the program reads it (`WINDOW_LEN` bytes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Window {
    /// The packet's first octet: header form, fixed bit.
    pub first: u8,
    /// A short header's DCID first octet (QUIC-LB: config rotation, length).
    pub cid_first: u8,
    /// The 16 bytes after it: the server ID and more.
    pub after: [u8; 16],
}

impl Window {
    /// The window of `payload`; None when it is shorter than `WINDOW_LEN`.
    pub fn of(payload: &[u8]) -> Option<Self> {
        let head: &[u8; WINDOW_LEN] = payload.get(..WINDOW_LEN)?.try_into().ok()?;
        let mut after = [0; 16];
        after.copy_from_slice(&head[2..]);
        Some(Self {
            first: head[0],
            cid_first: head[1],
            after,
        })
    }
}

/// QUIC-LB: config rotation bits `0b111` in a CID's first octet mark it unroutable (a
/// server that has no ID to give, or a client's own choice).
const UNROUTABLE: u8 = 0b111;

/// What a QUIC VIP does with a UDP payload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Header {
    /// A short-header packet whose DCID carries this server ID: routed by it.
    Short(ServerKey),
    /// A long-header packet (Initial, 0-RTT, Handshake, Retry): balanced as UDP.
    Long,
    /// Not a QUIC packet lb can read (fixed bit clear, or an unroutable CID): plain UDP.
    Other,
}

/// `window` of a packet to VIP `vip_id` whose server IDs are `len` bytes.
#[inline(always)]
pub fn classify(window: &Window, vip_id: u32, len: u32) -> Header {
    if window.first & 0x80 != 0 {
        return Header::Long;
    }
    // RFC 9000 17.3.1: the fixed bit is 1 in every short header (RFC 9287's greasing
    // is negotiated only with peers that ask for it; a backend behind lb does not).
    if window.first & 0x40 == 0 || window.cid_first >> 5 == UNROUTABLE {
        return Header::Other;
    }
    Header::Short(ServerKey::new(vip_id, window.after, len))
}

/// A connection ID of `cid_len` bytes carrying server ID `server_id` (its `id_len`
/// bytes, big-endian) in QUIC-LB plaintext form: first octet config rotation 0 and the
/// length of the rest (self-encoded, as the draft allows), the ID, then `nonce` bytes
/// to fill. `cid_len` must be at least `1 + id_len` and at most 20; `nonce` at least
/// the rest.
pub fn encode_cid(server_id: u128, id_len: u32, nonce: &[u8], out: &mut [u8]) -> usize {
    let id_len = id_len.min(MAX_SERVER_ID_LEN) as usize;
    let cid_len = out.len().min(20);
    let id = server_id.to_be_bytes();
    out[0] = ((cid_len - 1) & 0x1f) as u8;
    out[1..1 + id_len].copy_from_slice(&id[16 - id_len..]);
    let rest = cid_len - 1 - id_len;
    out[1 + id_len..cid_len].copy_from_slice(&nonce[..rest]);
    cid_len
}

/// The server ID of connection ID `cid` in QUIC-LB plaintext form with `id_len`-byte
/// IDs, as a number (`server_id` in the config); None when it is too short or marked
/// unroutable.
pub fn server_id_of(cid: &[u8], id_len: u32) -> Option<u128> {
    let id_len = id_len as usize;
    let first = *cid.first()?;
    if first >> 5 == UNROUTABLE || !(1..=MAX_SERVER_ID_LEN as usize).contains(&id_len) {
        return None;
    }
    let id = cid.get(1..1 + id_len)?;
    Some(id.iter().fold(0u128, |n, b| n << 8 | *b as u128))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn short(cid: &[u8]) -> Window {
        let mut payload = vec![0x41];
        payload.extend_from_slice(cid);
        payload.resize(40, 0xee);
        Window::of(&payload).unwrap()
    }

    #[test]
    fn a_short_header_names_its_server_id_masked_to_the_length() {
        let mut cid = [0u8; 8];
        encode_cid(0x0107, 2, &[0xaa; 16], &mut cid);
        assert_eq!(cid, [7, 0x01, 0x07, 0xaa, 0xaa, 0xaa, 0xaa, 0xaa]);
        let key = match classify(&short(&cid), 3, 2) {
            Header::Short(key) => key,
            other => panic!("{other:?}"),
        };
        assert_eq!(key, ServerKey::of_config(3, 0x0107, 2));
        assert_eq!(server_id_of(&cid, 2), Some(0x0107));
        // Every length masks what follows the ID.
        for len in 1..=MAX_SERVER_ID_LEN {
            let mut cid = [0u8; 20];
            encode_cid(5, len, &[0xff; 20], &mut cid);
            assert_eq!(
                classify(&short(&cid), 1, len),
                Header::Short(ServerKey::of_config(1, 5, len)),
                "len {len}"
            );
        }
    }

    #[test]
    fn long_headers_and_what_does_not_parse_are_plain_udp() {
        let mut initial = [0xc3u8; 40];
        initial[1] = 0;
        assert_eq!(classify(&Window::of(&initial).unwrap(), 1, 2), Header::Long);
        let mut no_fixed_bit = short(&[1, 0, 7]);
        no_fixed_bit.first = 0x01;
        assert_eq!(classify(&no_fixed_bit, 1, 2), Header::Other);
        let unroutable = short(&[0xe0 | 7, 0, 7]);
        assert_eq!(classify(&unroutable, 1, 2), Header::Other);
        assert_eq!(Window::of(&[0x41; WINDOW_LEN - 1]), None);
        assert_eq!(server_id_of(&[0xe7, 0, 7], 2), None);
        assert_eq!(server_id_of(&[7, 0], 2), None);
    }

    #[test]
    fn the_length_rides_in_the_vip_flags() {
        assert_eq!(id_len(vip_flags(15) | 1), 15);
        assert_eq!(
            id_len(2 << VIP_QUIC_ID_LEN_SHIFT),
            0,
            "not without the flag"
        );
        assert_eq!(id_len(0), 0);
    }
}
