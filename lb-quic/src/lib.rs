//! Connection IDs that carry a server ID, for QUIC servers behind `lb`.
//!
//! A UDP VIP with `quic = true` sends every QUIC short-header packet to the backend whose
//! `server_id` the packet's destination connection ID carries, in the plaintext format
//! of QUIC-LB (draft-ietf-quic-load-balancers): the CID's first octet (config rotation
//! 0, then the length of the rest), `quic_server_id_len` bytes of server ID
//! (big-endian), then random bytes. A client that changes its address or port keeps
//! its connection: its packets still name the server that holds it.
//!
//! A [quinn] server issues such IDs with [`ServerIdCids`] as its connection ID
//! generator:
//!
//! ```
//! use std::sync::Arc;
//! use lb_quic::ServerIdCids;
//!
//! // The backend's `server_id = 7`, the VIP's `quic_server_id_len = 2`.
//! let cids = ServerIdCids::new(7, 2).unwrap();
//! let mut endpoint_config = quinn_proto::EndpointConfig::default();
//! endpoint_config.cid_generator(cids.factory());
//! // quinn::Endpoint::new(endpoint_config, Some(server_config), socket, runtime) ...
//! // (tests/tests/quic.rs runs it behind lb).
//! ```
//!
//! The IDs are not encrypted: an observer can tell which server a connection is on
//! (QUIC-LB's plaintext mode says as much), and link two IDs of one connection only
//! through that. The random part keeps them otherwise unlinkable.
//!
//! [quinn]: https://docs.rs/quinn

use std::time::Duration;

use lb_common::quic::{MAX_SERVER_ID_LEN, encode_cid, server_id_of};
use quinn_proto::{ConnectionId, ConnectionIdGenerator, InvalidCid};
use rand::RngCore;

/// Bytes of randomness after the server ID (with the ID and the first octet, a CID of
/// 11 bytes for a 2-byte ID).
pub const DEFAULT_NONCE_LEN: usize = 8;

/// A connection ID generator whose IDs carry one server ID (QUIC-LB plaintext).
#[derive(Clone, Copy, Debug)]
pub struct ServerIdCids {
    server_id: u64,
    id_len: u32,
    cid_len: usize,
    lifetime: Option<Duration>,
}

/// Why a generator cannot be made.
#[derive(Debug, PartialEq, Eq)]
pub enum Error {
    /// `id_len` outside 1..=15.
    IdLength(u32),
    /// The server ID needs more than `id_len` bytes.
    IdTooLarge { server_id: u64, id_len: u32 },
    /// The CID would be longer than QUIC's 20 bytes, or leave no random bytes.
    CidLength(usize),
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::IdLength(len) => write!(f, "server ID length {len} is outside 1..=15"),
            Error::IdTooLarge { server_id, id_len } => {
                write!(f, "server ID {server_id} does not fit in {id_len} bytes")
            }
            Error::CidLength(len) => write!(
                f,
                "a connection ID of {len} bytes cannot hold the first octet, the server ID \
                 and at least 4 random bytes within QUIC's 20"
            ),
        }
    }
}

impl std::error::Error for Error {}

impl ServerIdCids {
    /// IDs carrying `server_id` in `id_len` bytes (the VIP's `quic_server_id_len`),
    /// followed by `DEFAULT_NONCE_LEN` random bytes.
    pub fn new(server_id: u64, id_len: u32) -> Result<Self, Error> {
        let cid_len = (1 + id_len as usize + DEFAULT_NONCE_LEN).min(20);
        Self::with_cid_len(server_id, id_len, cid_len)
    }

    /// IDs of `cid_len` bytes in all (at most 20; at least 4 of them random).
    pub fn with_cid_len(server_id: u64, id_len: u32, cid_len: usize) -> Result<Self, Error> {
        if !(1..=MAX_SERVER_ID_LEN).contains(&id_len) {
            return Err(Error::IdLength(id_len));
        }
        if id_len < 8 && server_id >> (8 * id_len) != 0 {
            return Err(Error::IdTooLarge { server_id, id_len });
        }
        if cid_len > 20 || cid_len < 1 + id_len as usize + 4 {
            return Err(Error::CidLength(cid_len));
        }
        Ok(Self {
            server_id,
            id_len,
            cid_len,
            lifetime: None,
        })
    }

    /// IDs are retired after `lifetime` (quinn then issues new ones, with the same
    /// server ID).
    pub fn with_lifetime(mut self, lifetime: Duration) -> Self {
        self.lifetime = Some(lifetime);
        self
    }

    /// What `quinn_proto::EndpointConfig::cid_generator` takes.
    pub fn factory(self) -> impl Fn() -> Box<dyn ConnectionIdGenerator> + Send + Sync + 'static {
        move || Box::new(self)
    }

    /// The server ID `cid` carries, if it is one of this generator's shape.
    pub fn server_id_of(&self, cid: &[u8]) -> Option<u64> {
        server_id_of(cid, self.id_len).and_then(|id| u64::try_from(id).ok())
    }
}

impl ConnectionIdGenerator for ServerIdCids {
    fn generate_cid(&mut self) -> ConnectionId {
        let mut nonce = [0u8; 20];
        rand::rng().fill_bytes(&mut nonce);
        let mut cid = [0u8; 20];
        let len = encode_cid(
            self.server_id as u128,
            self.id_len,
            &nonce,
            &mut cid[..self.cid_len],
        );
        ConnectionId::new(&cid[..len])
    }

    /// A packet whose ID names another server (lb sent it here as the table chose,
    /// its server being gone) is none of ours: quinn answers it with a stateless reset.
    fn validate(&self, cid: &ConnectionId) -> Result<(), InvalidCid> {
        match self.server_id_of(cid) {
            Some(id) if id == self.server_id && cid.len() == self.cid_len => Ok(()),
            _ => Err(InvalidCid),
        }
    }

    fn cid_len(&self) -> usize {
        self.cid_len
    }

    fn cid_lifetime(&self) -> Option<Duration> {
        self.lifetime
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lb_common::quic::{Header, ServerKey, Window, classify};

    #[test]
    fn every_id_carries_the_server_id_where_lb_reads_it() {
        let mut cids = ServerIdCids::new(0x0107, 2).unwrap();
        let (a, b) = (cids.generate_cid(), cids.generate_cid());
        assert_eq!(a.len(), 11);
        assert_ne!(a, b, "random after the ID");
        for cid in [a, b] {
            assert_eq!(cids.validate(&cid).map_err(|_| ()), Ok(()));
            // The short header lb sees.
            let mut packet = vec![0x40];
            packet.extend_from_slice(&cid);
            packet.extend_from_slice(&[0; 24]);
            let header = classify(&Window::of(&packet).unwrap(), 4, 2);
            assert_eq!(header, Header::Short(ServerKey::of_config(4, 0x0107, 2)));
        }
        let other = ServerIdCids::new(0x0108, 2).unwrap().generate_cid();
        assert!(cids.validate(&other).is_err());
    }

    #[test]
    fn lengths_that_cannot_work_are_refused() {
        assert_eq!(ServerIdCids::new(1, 0).unwrap_err(), Error::IdLength(0));
        assert_eq!(ServerIdCids::new(1, 16).unwrap_err(), Error::IdLength(16));
        assert!(matches!(
            ServerIdCids::new(256, 1),
            Err(Error::IdTooLarge { .. })
        ));
        assert_eq!(
            ServerIdCids::with_cid_len(1, 2, 6).unwrap_err(),
            Error::CidLength(6)
        );
        assert_eq!(ServerIdCids::new(1, 15).unwrap().cid_len(), 20);
    }
}
