//! Generic netlink for the doctor: ethtool's interface through the rust-netlink `ethtool`
//! crate (offloads, channels), and on its connection two messages the crate does not
//! have: ETHTOOL_MSG_FEATURES_SET (`--fix`; the crate's feature bitsets cannot be
//! emitted yet) and the netdev family's DEV_GET (the driver's XDP features, 6.3+).
//! Nothing is shelled out.

use std::{collections::BTreeMap, fmt::Debug, marker::PhantomData};

use ethtool::{EthtoolAttr, EthtoolChannelAttr, EthtoolFeatureAttr, EthtoolHandle, EthtoolMessage};
use futures::{StreamExt, TryStream, TryStreamExt};
use netlink_packet_core::{
    DecodeError, Emitable, NLM_F_ACK, NLM_F_REQUEST, NetlinkMessage, NetlinkPayload, NlaBuffer,
    NlasIterator, ParseableParametrized, parse_u64,
};
use netlink_packet_generic::{GenlFamily, GenlHeader, GenlMessage};

use super::facts::{Channels, Feature, XdpFeatures};

/// An ethtool netlink connection (its task runs on the tokio runtime).
pub struct Ethtool {
    handle: EthtoolHandle,
}

#[derive(Debug, thiserror::Error)]
pub enum EthtoolError {
    #[error("opening the ethtool netlink socket")]
    Connect(#[source] std::io::Error),
    #[error("ETHTOOL_MSG_FEATURES_SET for {interface}")]
    Request {
        interface: String,
        #[source]
        source: genetlink::GenetlinkError,
    },
    #[error("ETHTOOL_MSG_FEATURES_SET for {interface}: {error}")]
    Refused {
        interface: String,
        error: std::io::Error,
    },
    #[error("ETHTOOL_MSG_FEATURES_SET for {interface}: undecodable answer")]
    Decode {
        interface: String,
        #[source]
        source: DecodeError,
    },
}

impl Ethtool {
    pub fn open() -> Option<Self> {
        Self::connect().ok()
    }

    pub fn connect() -> Result<Self, EthtoolError> {
        let (connection, handle, _) = ethtool::new_connection().map_err(EthtoolError::Connect)?;
        tokio::spawn(connection);
        Ok(Self { handle })
    }

    /// `ethtool -k`: every feature with its state; `[fixed]` for those outside the
    /// changeable (hw) set.
    pub async fn features(&self, interface: &str) -> Option<BTreeMap<String, Feature>> {
        let mut handle = self.handle.clone();
        let attrs = nlas(handle.feature().get(Some(interface)).execute().await).await?;
        let (mut active, mut changeable) = (Vec::new(), Vec::new());
        let (mut all, mut never) = (Vec::new(), Vec::new());
        for attr in attrs {
            match attr {
                // A list: a bit is listed when it is set.
                EthtoolAttr::Feature(EthtoolFeatureAttr::Active(bits)) => {
                    active.extend(bits.into_iter().map(|b| b.name));
                }
                // Every feature, with a value: changeable or not (the kernel sends
                // `hw_features` against the mask of all features).
                EthtoolAttr::Feature(EthtoolFeatureAttr::Hw(bits)) => {
                    all.extend(bits.iter().map(|b| b.name.clone()));
                    changeable.extend(bits.into_iter().filter(|b| b.value).map(|b| b.name));
                }
                EthtoolAttr::Feature(EthtoolFeatureAttr::NoChange(bits)) => {
                    never.extend(bits.into_iter().map(|b| b.name));
                }
                _ => {}
            }
        }
        let mut features = BTreeMap::new();
        for name in all.iter().chain(&active) {
            features.insert(
                name.clone(),
                Feature {
                    on: active.contains(name),
                    fixed: !changeable.contains(name) || never.contains(name),
                },
            );
        }
        Some(features)
    }

    /// `ethtool -l`; `None` when the driver has no channel operations.
    pub async fn channels(&self, interface: &str) -> Option<Channels> {
        let mut handle = self.handle.clone();
        let attrs = nlas(handle.channel().get(Some(interface)).execute().await).await?;
        let counts = attrs.into_iter().filter_map(|attr| {
            let EthtoolAttr::Channel(attr) = attr else {
                return None;
            };
            Some(match attr {
                EthtoolChannelAttr::RxCount(n) => ("rx", n),
                EthtoolChannelAttr::TxCount(n) => ("tx", n),
                EthtoolChannelAttr::CombinedCount(n) => ("combined", n),
                EthtoolChannelAttr::RxMax(n) => ("max_rx", n),
                EthtoolChannelAttr::TxMax(n) => ("max_tx", n),
                EthtoolChannelAttr::CombinedMax(n) => ("max_combined", n),
                _ => return None,
            })
        });
        super::gather::channels_of(counts.collect::<Vec<_>>())
    }

    /// The driver's XDP features (`NETDEV_A_DEV_XDP_FEATURES`); `None` on kernels
    /// without the netdev family (before 6.3).
    pub async fn xdp_features(&self, ifindex: u32) -> Option<XdpFeatures> {
        let request =
            Genl::<Netdev>::new(NETDEV_CMD_DEV_GET, nla_u32(NETDEV_A_DEV_IFINDEX, ifindex));
        let answers = self.request(request).await.ok()?;
        answers.iter().find_map(|payload| {
            attributes(payload)
                .find(|(kind, _)| *kind == NETDEV_A_DEV_XDP_FEATURES)
                .and_then(|(_, value)| parse_u64(&value).ok())
                .map(XdpFeatures)
        })
    }

    /// Turns `features` off on `interface` (ETHTOOL_MSG_FEATURES_SET, as `ethtool -K`).
    /// Whether the driver did is for a second `features` to tell.
    pub async fn turn_off(&self, interface: &str, features: &[String]) -> Result<(), EthtoolError> {
        let mut header = nla_string(ETHTOOL_A_HEADER_DEV_NAME, interface);
        // No reply message, only the acknowledgement.
        header.extend(nla_u32(ETHTOOL_A_HEADER_FLAGS, ETHTOOL_FLAG_OMIT_REPLY));
        let bits: Vec<u8> = features
            .iter()
            // A bit listed without ETHTOOL_A_BITSET_BIT_VALUE: in the mask, set to 0.
            .flat_map(|name| {
                nested(
                    ETHTOOL_A_BITSET_BITS_BIT,
                    &nla_string(ETHTOOL_A_BITSET_BIT_NAME, name),
                )
            })
            .collect();
        let mut payload = nested(ETHTOOL_A_FEATURES_HEADER, &header);
        payload.extend(nested(
            ETHTOOL_A_FEATURES_WANTED,
            &nested(ETHTOOL_A_BITSET_BITS, &bits),
        ));
        self.request(Genl::<EthtoolFamily>::new(
            ETHTOOL_MSG_FEATURES_SET,
            payload,
        ))
        .await
        .map(drop)
        .map_err(|e| e.named(interface))
    }

    /// Sends one request and collects the answers' payloads, failing on an error answer.
    async fn request<F: Family>(&self, request: Genl<F>) -> Result<Vec<Vec<u8>>, Failure> {
        let mut message = NetlinkMessage::from(GenlMessage::from_payload(request));
        message.header.flags = NLM_F_REQUEST | NLM_F_ACK;
        let mut handle = self.handle.handle.clone();
        let mut answers = handle.request(message).await.map_err(Failure::Request)?;
        let mut payloads = Vec::new();
        while let Some(answer) = answers.next().await {
            let answer = answer.map_err(Failure::Decode)?;
            match answer.payload {
                NetlinkPayload::InnerMessage(genl) => payloads.push(genl.payload.payload),
                NetlinkPayload::Error(error) if error.code.is_some() => {
                    return Err(Failure::Refused(error.to_io()));
                }
                _ => {}
            }
        }
        Ok(payloads)
    }
}

/// The attributes of every answer to an `ethtool` crate request; `None` on an error
/// (the interface does not support it).
async fn nlas(
    answers: impl TryStream<Ok = GenlMessage<EthtoolMessage>, Error = ethtool::EthtoolError>,
) -> Option<Vec<EthtoolAttr>> {
    let messages: Vec<_> = answers.try_collect().await.ok()?;
    Some(messages.into_iter().flat_map(|m| m.payload.nlas).collect())
}

/// A failed request, before it is named.
enum Failure {
    Request(genetlink::GenetlinkError),
    Refused(std::io::Error),
    Decode(DecodeError),
}

impl Failure {
    fn named(self, interface: &str) -> EthtoolError {
        let interface = interface.to_string();
        match self {
            Failure::Request(source) => EthtoolError::Request { interface, source },
            Failure::Refused(error) => EthtoolError::Refused { interface, error },
            Failure::Decode(source) => EthtoolError::Decode { interface, source },
        }
    }
}

// include/uapi/linux/ethtool_netlink.h (values of the generated ethtool family).
const ETHTOOL_MSG_FEATURES_SET: u8 = 12;
const ETHTOOL_A_FEATURES_HEADER: u16 = 1;
const ETHTOOL_A_FEATURES_WANTED: u16 = 3;
const ETHTOOL_A_HEADER_DEV_NAME: u16 = 2;
const ETHTOOL_A_HEADER_FLAGS: u16 = 3;
const ETHTOOL_FLAG_OMIT_REPLY: u32 = 1 << 1;
const ETHTOOL_A_BITSET_BITS: u16 = 3;
const ETHTOOL_A_BITSET_BITS_BIT: u16 = 1;
const ETHTOOL_A_BITSET_BIT_NAME: u16 = 2;
// include/uapi/linux/netdev.h
const NETDEV_CMD_DEV_GET: u8 = 1;
const NETDEV_A_DEV_IFINDEX: u16 = 1;
const NETDEV_A_DEV_XDP_FEATURES: u16 = 3;
const NLA_F_NESTED: u16 = 1 << 15;

/// A generic netlink family by name and version.
trait Family: Debug + Clone {
    const NAME: &'static str;
    const VERSION: u8;
}

#[derive(Debug, Clone)]
struct EthtoolFamily;

impl Family for EthtoolFamily {
    const NAME: &'static str = "ethtool";
    const VERSION: u8 = 1;
}

#[derive(Debug, Clone)]
struct Netdev;

impl Family for Netdev {
    const NAME: &'static str = "netdev";
    const VERSION: u8 = 1;
}

/// A message of family `F`: a command and its attributes, already encoded.
#[derive(Debug, Clone)]
struct Genl<F> {
    cmd: u8,
    payload: Vec<u8>,
    family: PhantomData<F>,
}

impl<F> Genl<F> {
    fn new(cmd: u8, payload: Vec<u8>) -> Self {
        Self {
            cmd,
            payload,
            family: PhantomData,
        }
    }
}

impl<F: Family> GenlFamily for Genl<F> {
    fn family_name() -> &'static str {
        F::NAME
    }

    fn command(&self) -> u8 {
        self.cmd
    }

    fn version(&self) -> u8 {
        F::VERSION
    }
}

impl<F> Emitable for Genl<F> {
    fn buffer_len(&self) -> usize {
        self.payload.len()
    }

    fn emit(&self, buffer: &mut [u8]) {
        buffer[..self.payload.len()].copy_from_slice(&self.payload);
    }
}

impl<F> ParseableParametrized<[u8], GenlHeader> for Genl<F> {
    fn parse_with_param(buffer: &[u8], header: GenlHeader) -> Result<Self, DecodeError> {
        Ok(Self::new(header.cmd, buffer.to_vec()))
    }
}

/// An attribute: length, type, value, padded to 4 bytes.
fn nla(kind: u16, value: &[u8]) -> Vec<u8> {
    let len = 4 + value.len();
    let mut out = Vec::with_capacity(len.next_multiple_of(4));
    out.extend_from_slice(&(len as u16).to_ne_bytes());
    out.extend_from_slice(&kind.to_ne_bytes());
    out.extend_from_slice(value);
    out.resize(len.next_multiple_of(4), 0);
    out
}

fn nested(kind: u16, attributes: &[u8]) -> Vec<u8> {
    nla(kind | NLA_F_NESTED, attributes)
}

fn nla_u32(kind: u16, value: u32) -> Vec<u8> {
    nla(kind, &value.to_ne_bytes())
}

fn nla_string(kind: u16, value: &str) -> Vec<u8> {
    let mut bytes = value.as_bytes().to_vec();
    bytes.push(0);
    nla(kind, &bytes)
}

/// The top-level attributes of a payload: (type without its flags, value).
fn attributes(payload: &[u8]) -> impl Iterator<Item = (u16, Vec<u8>)> + '_ {
    NlasIterator::new(payload)
        .filter_map(Result::ok)
        .map(|nla: NlaBuffer<&[u8]>| (nla.kind(), nla.value().to_vec()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attributes_are_padded_and_nest() {
        let name = nla_string(ETHTOOL_A_HEADER_DEV_NAME, "eth0");
        // 4 header bytes, "eth0\0", 3 padding bytes.
        assert_eq!(name.len(), 12);
        assert_eq!(
            &name[..4],
            &[9u16.to_ne_bytes(), 2u16.to_ne_bytes()].concat()[..]
        );
        let outer = nested(ETHTOOL_A_FEATURES_HEADER, &name);
        let parsed: Vec<_> = attributes(&outer).collect();
        assert_eq!(parsed, vec![(ETHTOOL_A_FEATURES_HEADER, name.clone())]);
        let inner: Vec<_> = attributes(&parsed[0].1).collect();
        assert_eq!(inner[0].0, ETHTOOL_A_HEADER_DEV_NAME);
        assert_eq!(&inner[0].1[..5], b"eth0\0");
    }
}
