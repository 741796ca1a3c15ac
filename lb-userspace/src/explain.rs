//! `lb explain`: which backend a flow goes to, computed with the kernel's own hash
//! (`lb-common`) over the agent's current table, and what the connection table holds.

use std::{
    net::{IpAddr, SocketAddr},
    time::Duration,
};

use lb_common::{
    BACKEND_NONE, FlowKey, FlowTuple, SourceKey, VIP_F_HOT_SOURCES, VipInfo,
    decide::{Packet, Source, memory::MemoryTables},
    flow, table_place,
};
use serde::{Deserialize, Serialize};

use crate::{
    config::{Forward, Protocol},
    dataplane::Lookups,
    model::{Model, VipState},
    tables::{Desired, SlotWords},
};

/// `VIP:PORT/PROTO`, as `lb explain` and `lb drain` take it. In the control API's JSON
/// `{"address", "port", "protocol"}`; the string form is accepted too.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "VipTargetWire")]
pub struct VipTarget {
    pub address: IpAddr,
    pub port: u16,
    pub protocol: Protocol,
}

impl VipTarget {
    /// The (address, port, protocol) of a configured VIP.
    pub fn of(vip: &crate::config::VipConfig) -> Self {
        Self {
            address: vip.address,
            port: vip.port,
            protocol: vip.protocol,
        }
    }
}

/// The object form of a VIP in JSON.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct VipTargetObject {
    address: IpAddr,
    port: u16,
    protocol: Protocol,
}

/// A VIP in a request: the object, or `"10.0.0.100:80/tcp"`; each with the error of its
/// own form (an untagged enum would say only that neither matched).
struct VipTargetWire(VipTarget);

impl<'de> Deserialize<'de> for VipTargetWire {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = VipTargetWire;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(
                    "a VIP: {\"address\", \"port\", \"protocol\"} or \"ADDRESS:PORT/PROTO\"",
                )
            }

            fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<VipTargetWire, E> {
                text.parse().map(VipTargetWire).map_err(E::custom)
            }

            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                map: A,
            ) -> Result<VipTargetWire, A::Error> {
                let o = VipTargetObject::deserialize(
                    serde::de::value::MapAccessDeserializer::new(map),
                )?;
                Ok(VipTargetWire(VipTarget {
                    address: o.address,
                    port: o.port,
                    protocol: o.protocol,
                }))
            }
        }
        deserializer.deserialize_any(Visitor)
    }
}

impl From<VipTargetWire> for VipTarget {
    fn from(wire: VipTargetWire) -> Self {
        wire.0
    }
}

/// Why a text is not a VIP (`ADDRESS:PORT/PROTO`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VipTargetError {
    #[error("{text:?}: expected VIP:PORT/PROTO, e.g. 10.0.0.100:80/tcp")]
    Shape { text: String },
    #[error("{text:?}: protocol {protocol:?} is neither tcp nor udp")]
    Protocol { text: String, protocol: String },
    #[error("{text:?}: {socket:?} is not ADDRESS:PORT (IPv6: [ADDRESS]:PORT)")]
    Socket { text: String, socket: String },
}

impl std::str::FromStr for VipTarget {
    type Err = VipTargetError;

    fn from_str(text: &str) -> Result<Self, VipTargetError> {
        let (socket, protocol) = text
            .rsplit_once('/')
            .ok_or_else(|| VipTargetError::Shape { text: text.into() })?;
        let protocol = match protocol {
            "tcp" => Protocol::Tcp,
            "udp" => Protocol::Udp,
            other => {
                return Err(VipTargetError::Protocol {
                    text: text.into(),
                    protocol: other.into(),
                });
            }
        };
        let socket: SocketAddr = socket.parse().map_err(|_| VipTargetError::Socket {
            text: text.into(),
            socket: socket.into(),
        })?;
        Ok(Self {
            address: socket.ip(),
            port: socket.port(),
            protocol,
        })
    }
}

impl std::fmt::Display for VipTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}/{}",
            SocketAddr::new(self.address, self.port),
            self.protocol
        )
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExplainRequest {
    pub vip: VipTarget,
    pub source: SocketAddr,
    /// A QUIC short header's destination connection ID, in hex (`--quic-cid`): the
    /// next packet is explained as one carrying it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quic_cid: Option<String>,
}

impl ExplainRequest {
    /// The flow from `source` to `vip`, no connection ID.
    pub fn flow(vip: VipTarget, source: SocketAddr) -> Self {
        Self {
            vip,
            source,
            quic_cid: None,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Explanation {
    pub vip: String,
    pub hash: u32,
    pub slot: u32,
    /// The backend the Maglev table gives the flow (what a SYN gets); None: no backend.
    pub table_backend: Option<String>,
    /// The backend the connection table holds for the flow, if it has an entry.
    pub conntrack_backend: Option<String>,
    /// Seconds since the entry last saw a packet.
    pub conntrack_idle_seconds: Option<f64>,
    /// Without an entry: the backend the embryonic table remembers for the flow's first
    /// packet, where its second packet goes (and enters the connection table).
    #[serde(default)]
    pub embryonic_backend: Option<String>,
    /// Where the flow's next non-SYN packet goes.
    pub next_packet_backend: Option<String>,
    /// The source is a hot source of the VIP (`hot_source_share`): its new flows are
    /// hashed on the 5-tuple, not the source.
    #[serde(default)]
    pub hot_source: bool,
    /// How it gets there: "l2", "ipip" or "gue" (the VIP's `forward`).
    #[serde(default)]
    pub forward: Forward,
    /// The next packet's backend's next hop: itself on-link, else its route's gateway
    /// (with the MAC used); None without a backend or a route.
    #[serde(default)]
    pub next_hop: Option<NextHop>,
    /// With several interfaces (`dataplane.interfaces`): the one the next packet's
    /// backend is reached by, as the agent found its route. None with one, or without a
    /// next hop.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interface: Option<String>,
    /// With `quic_cid`: the server ID it carries and what the program does with it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quic: Option<QuicExplanation>,
}

/// What a QUIC VIP does with a short header carrying a connection ID.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct QuicExplanation {
    /// The server ID in the connection ID (QUIC-LB plaintext); None when it carries
    /// none lb reads (too short, marked unroutable, or the VIP has no `quic`).
    pub server_id: Option<u64>,
    /// The backend whose `server_id` that is, if any.
    pub server: Option<String>,
    /// Routed by the ID (else balanced as any UDP datagram).
    pub routed_by_cid: bool,
    /// Why, in a sentence.
    pub why: String,
}

/// A backend's next hop (in `lb status` and `lb explain`): the neighbour its frames go
/// to, and the MAC used.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NextHop {
    pub address: String,
    /// None until the neighbour is resolved.
    pub mac: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum ExplainError {
    #[error("no VIP {0} is configured")]
    UnknownVip(VipTarget),
    #[error("the client {client} and the VIP {vip} are of different address families")]
    FamilyMismatch { client: SocketAddr, vip: VipTarget },
    #[error("--quic-cid {0:?}: expected 1 to 20 bytes in hex, e.g. 0700070a1b2c3d4e")]
    BadCid(String),
    #[error("reading the connection table")]
    Dataplane(#[from] crate::dataplane::DataplaneError),
}

/// The 5-tuple of a flow from `source` to the VIP, as the program hashes it.
pub fn flow_tuple(vip: &VipTarget, source: SocketAddr) -> FlowTuple {
    flow_key(vip, source).tuple()
}

/// The connection-table key of a flow from `source` to the VIP.
pub fn flow_key(vip: &VipTarget, source: SocketAddr) -> FlowKey {
    let vip_socket = SocketAddr::new(vip.address, vip.port);
    FlowKey::between(source, vip_socket, vip.protocol.number())
}

/// Where the table puts a flow from `source`: (hash, slot, backend id, whether it was
/// spread as a hot source's). `is_hot` says whether the source is in `LB_HOT_SRC`; it is
/// asked only where the program would look (`lb_common::table_hash`).
pub fn table_choice(
    vip: &VipState,
    table: &[u32],
    source: SocketAddr,
    is_hot: impl FnOnce() -> bool,
) -> (u32, u32, u32, bool) {
    let tuple = flow_tuple(&VipTarget::of(&vip.config), source);
    let (hash, slot, spread) = table_place(&tuple, vip.flags(), table.len() as u32, is_hot);
    (hash, slot, table[slot as usize], spread)
}

/// The state `explain` reads: the agent's model and tables, and the data path's
/// connection, embryonic and hot-source tables (the agent's read side, `FlowLookups`).
pub struct View<'a> {
    pub model: &'a Model,
    pub desired: &'a Desired,
    pub flows: &'a dyn Lookups,
    /// The live words of `stable_slots` VIPs' tables (`desired` holds backend ids): which
    /// slots a change moved, and the backend each names.
    pub slot_words: &'a SlotWords,
    pub flow_idle: Duration,
    /// `dataplane.interfaces`, in order: a backend's `egress` is a position in it.
    pub interfaces: &'a [String],
}

impl View<'_> {
    /// `decision_tables`, with VIP `vip_id`'s live slot words where it has
    /// `stable_slots`.
    fn tables(&self, vip_id: u32, now_ns: u64) -> MemoryTables {
        let mut tables = decision_tables(self.desired, self.flow_idle, now_ns);
        if let Some(words) = self.slot_words.of(vip_id) {
            tables.maglev.insert(vip_id, words.to_vec());
        }
        tables
    }
}

/// What the program's decisions read, as the agent writes it (`LB_VIPS`,
/// `LB_BACKENDS`, `LB_MAGLEV`: the desired tables; the UDP idle time: the configured
/// flow idle time), for `lb_common::decide`; the connection, embryonic and hot-source
/// tables are the caller's to fill from what it reads of the data path.
pub fn decision_tables(desired: &Desired, flow_idle: Duration, now_ns: u64) -> MemoryTables {
    let mut tables = MemoryTables::default();
    for vip in &desired.vips {
        let info = VipInfo {
            vip_id: vip.vip_id,
            generation: 0,
            flags: vip.flags,
            _pad: 0,
        };
        tables.vips.insert(vip.key, info);
        tables.maglev.insert(vip.vip_id, vip.table.clone());
        tables.maglev_size = vip.table.len() as u32;
    }
    tables.backends = desired
        .backends
        .iter()
        .map(|(id, b)| (*id, b.info))
        .collect();
    tables.quic_ids = desired.quic_ids.clone();
    // As the loader sets `GLOBAL_UDP_IDLE_NS`.
    tables.udp_idle_ns = flow_idle.as_nanos().min(u64::MAX as u128) as u64;
    tables.now_ns = now_ns;
    tables
}

pub fn explain(
    view: &View<'_>,
    request: &ExplainRequest,
    now_ns: u64,
) -> Result<Explanation, ExplainError> {
    let target = request.vip;
    let vip = view
        .model
        .vips
        .iter()
        .find(|v| VipTarget::of(&v.config) == target)
        .ok_or(ExplainError::UnknownVip(target))?;
    if request.source.is_ipv4() != target.address.is_ipv4() {
        return Err(ExplainError::FamilyMismatch {
            client: request.source,
            vip: target,
        });
    }
    let table = view
        .desired
        .vips
        .iter()
        .find(|d| d.vip_id == vip.id)
        .map(|d| d.table.as_slice())
        .unwrap_or_default();
    let name = |id: u32| {
        vip.backends
            .iter()
            .find(|b| b.id == id)
            .map(|b| b.config.address.to_string())
    };
    // The program's hot-source set, read only for a VIP whose program looks at it.
    let hot_source = if vip.flags() & VIP_F_HOT_SOURCES != 0 {
        let (addr, family) = lb_common::addr::to_map(request.source.ip());
        view.flows
            .is_hot_source(&SourceKey::new(vip.id, addr, family))?
    } else {
        false
    };
    let (hash, slot, table_id, _) = if table.is_empty() {
        (0, 0, BACKEND_NONE, hot_source)
    } else {
        table_choice(vip, table, request.source, || hot_source)
    };
    let key = flow_key(&target, request.source);
    let entry = view.flows.flow(&key)?;
    let idle_ns = entry.map(|e| flow::age(&e, now_ns));
    // What the program does with the flow's next packet that is not a SYN (neither FIN
    // nor RST), decided by the program's own code over the tables as they are. On a
    // copy: explain writes nothing.
    let mut tables = view.tables(vip.id, now_ns);
    tables.set_flow(&key, entry);
    let (index, _) = flow::embryo_place(&key);
    tables.set_embryo(index, view.flows.embryo(index)?);
    let packet = Packet::of_flow(
        (key.src, key.dst),
        (key.family, key.proto),
        (key.src_port, key.dst_port),
    );
    if hot_source {
        let source = SourceKey::new(vip.id, packet.src_addr, packet.family);
        tables.hot_sources.insert(source);
    }
    let cid = match &request.quic_cid {
        Some(hex) => Some(parse_cid(hex).ok_or_else(|| ExplainError::BadCid(hex.clone()))?),
        None => None,
    };
    let next = match &cid {
        Some(cid) => tables.decide_payload(&packet, &short_header(cid)).ok(),
        None => tables.decide(&packet).ok(),
    };
    let quic = cid.map(|cid| quic_explanation(vip, &cid, next.map(|c| c.by)));
    let next_id = next.map_or(BACKEND_NONE, |choice| choice.backend_id);
    // The backend the flow's first packet took, where the next packet goes for it.
    let remembered = next
        .filter(|choice| choice.by == Source::Embryo)
        .map(|choice| choice.backend_id);
    let (next_hop, interface) = match vip.backends.iter().find(|b| b.id == next_id) {
        Some(backend) => route_of(backend, view.interfaces),
        None => (None, None),
    };
    Ok(Explanation {
        vip: vip.config.name.clone(),
        hash,
        slot,
        table_backend: name(table_id),
        conntrack_backend: entry.and_then(|e| {
            name(e.backend_id).or(Some(format!("backend id {} (gone)", e.backend_id)))
        }),
        conntrack_idle_seconds: idle_ns.map(|ns| ns as f64 / 1e9),
        embryonic_backend: remembered.and_then(name),
        next_packet_backend: name(next_id),
        hot_source,
        forward: vip.config.forward,
        next_hop,
        interface,
        quic,
    })
}

/// `backend`'s next hop, and with several `interfaces` the one it is reached by (none
/// without a next hop: its recorded egress means nothing then).
fn route_of(
    backend: &crate::model::BackendState,
    interfaces: &[String],
) -> (Option<NextHop>, Option<String>) {
    let Some(address) = backend.next_hop else {
        return (None, None);
    };
    let next_hop = NextHop {
        address: address.to_string(),
        mac: backend.mac.map(|m| m.to_string()),
    };
    let interface = (interfaces.len() > 1)
        .then(|| interfaces.get(backend.egress as usize).cloned())
        .flatten();
    (Some(next_hop), interface)
}

/// A connection ID in hex (1 to 20 bytes; `:` and spaces allowed between bytes).
fn parse_cid(hex: &str) -> Option<Vec<u8>> {
    let digits: Vec<u8> = hex.bytes().filter(|b| !matches!(b, b':' | b' ')).collect();
    if digits.is_empty() || !digits.len().is_multiple_of(2) || digits.len() > 40 {
        return None;
    }
    digits
        .chunks(2)
        .map(|pair| u8::from_str_radix(std::str::from_utf8(pair).ok()?, 16).ok())
        .collect()
}

/// A short-header packet's payload carrying `cid`, long enough for the program's window
/// (a packet number and an AEAD tag would follow).
fn short_header(cid: &[u8]) -> Vec<u8> {
    let mut payload = vec![0x40];
    payload.extend_from_slice(cid);
    payload.resize(payload.len().max(lb_common::quic::WINDOW_LEN + 4), 0);
    payload
}

/// What the program did with `cid` (`by`: what decided the backend), in words.
fn quic_explanation(vip: &VipState, cid: &[u8], by: Option<Source>) -> QuicExplanation {
    let routed_by_cid = by == Some(Source::ConnectionId);
    if !vip.config.quic {
        return QuicExplanation {
            server_id: None,
            server: None,
            routed_by_cid,
            why: "the VIP does not route by connection ID (quic is off): balanced as UDP".into(),
        };
    }
    let len = vip.config.quic_server_id_len();
    // Past 8 bytes an ID is no configured `server_id` (a u64).
    let server_id = lb_common::quic::server_id_of(cid, len).and_then(|id| u64::try_from(id).ok());
    let backend =
        server_id.and_then(|id| vip.backends.iter().find(|b| b.config.server_id == Some(id)));
    let server = backend.map(|b| b.config.address.to_string());
    let why = match (server_id, backend) {
        (None, _) => format!(
            "the connection ID carries no server ID of {len} bytes (too short, or marked \
             unroutable): balanced as UDP"
        ),
        (Some(id), None) => {
            format!("no backend has server_id {id}: balanced as UDP (counted as quic_cid_unknown)")
        }
        (Some(id), Some(b)) if routed_by_cid => format!(
            "server_id {id} is backend {}: its short headers go there from any address \
             and port",
            b.config.address
        ),
        (Some(id), Some(b)) => format!(
            "server_id {id} is backend {}, which serves no flows now (down, or without a \
             MAC): balanced as UDP (counted as quic_cid_unknown)",
            b.config.address
        ),
    };
    QuicExplanation {
        server_id,
        server,
        routed_by_cid,
        why,
    }
}

/// CLOCK_MONOTONIC in nanoseconds: the clock the data path stamps entries with
/// (`bpf_ktime_get_coarse_ns`, read once per jiffy: up to a tick behind this one).
pub fn monotonic_ns() -> u64 {
    let now =
        nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).expect("CLOCK_MONOTONIC");
    now.tv_sec() as u64 * 1_000_000_000 + now.tv_nsec() as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{dataplane::MemoryDataplane, model::Health};
    use lb_common::FlowEntry;

    #[test]
    fn vip_targets_parse_and_print() {
        let v4: VipTarget = "10.0.0.100:80/tcp".parse().unwrap();
        assert_eq!(v4.to_string(), "10.0.0.100:80/tcp");
        let v6: VipTarget = "[fd00::100]:53/udp".parse().unwrap();
        assert_eq!((v6.port, v6.protocol), (53, Protocol::Udp));
        assert!(matches!(
            "10.0.0.100:80".parse::<VipTarget>(),
            Err(VipTargetError::Shape { .. })
        ));
        assert!(matches!(
            "10.0.0.100:80/sctp".parse::<VipTarget>(),
            Err(VipTargetError::Protocol { protocol, .. }) if protocol == "sctp"
        ));
        for bad in ["10.0.0.100/tcp", "fd00::1:80/tcp"] {
            let error = bad.parse::<VipTarget>().unwrap_err();
            assert!(matches!(error, VipTargetError::Socket { .. }), "{bad}");
            assert!(error.to_string().contains("is not ADDRESS:PORT"), "{error}");
        }
        // JSON: the object (as sent), or the string form.
        let object = serde_json::to_value(v6).unwrap();
        assert_eq!(
            object,
            serde_json::json!({"address": "fd00::100", "port": 53, "protocol": "udp"})
        );
        assert_eq!(serde_json::from_value::<VipTarget>(object).unwrap(), v6);
        let text = serde_json::json!("[fd00::100]:53/udp");
        assert_eq!(serde_json::from_value::<VipTarget>(text).unwrap(), v6);
        let error = serde_json::from_str::<VipTarget>(r#""fd00::100:53/udp""#).unwrap_err();
        assert!(error.to_string().contains("[ADDRESS]:PORT"), "{error}");
        let error = serde_json::from_str::<VipTarget>(r#"{"address": "10.0.0.1", "port": 80}"#)
            .unwrap_err();
        assert!(
            error.to_string().contains("missing field `protocol`"),
            "{error}"
        );
    }

    /// A model of `text`'s VIPs (table size 7) and the tables it gives.
    fn model_of(text: &str) -> (Model, Desired) {
        let config = crate::config::Config::from_toml(text).unwrap();
        let mut model = Model::new(7, 16, Duration::ZERO);
        model.update(&config).unwrap();
        let desired = model.desired();
        (model, desired)
    }

    /// One VIP on 10.0.0.100:`port`/`protocol`, two unchecked backends with MACs.
    fn two_backends(protocol: &str, port: u16) -> String {
        format!(
            "[dataplane]\ninterface = \"eth0\"\n\
             [[vip]]\nname = \"v\"\naddress = \"10.0.0.100\"\nport = {port}\n\
             protocol = \"{protocol}\"\n[vip.health]\nkind = \"none\"\n\
             [[vip.backend]]\naddress = \"10.0.0.11\"\nmac = \"02:00:00:00:00:0b\"\n\
             [[vip.backend]]\naddress = \"10.0.0.12\"\nmac = \"02:00:00:00:00:0c\"\n"
        )
    }

    const CLIENT: &str = "10.0.0.1:40000";
    const SECOND: u64 = 1_000_000_000;

    /// Explains CLIENT's flow to `vip` with `entry` in the connection table (none: no
    /// entry), at `now_ns`, with a 30 s flow idle time.
    fn explain_with(
        model: &Model,
        desired: &Desired,
        vip: &str,
        entry: Option<FlowEntry>,
        now_ns: u64,
    ) -> Explanation {
        let request = ExplainRequest {
            vip: vip.parse().unwrap(),
            source: CLIENT.parse().unwrap(),
            quic_cid: None,
        };
        let mut dataplane = MemoryDataplane::default();
        if let Some(entry) = entry {
            dataplane
                .flows
                .insert(flow_key(&request.vip, request.source), entry);
        }
        explain_in(model, desired, &dataplane, &request, now_ns)
    }

    fn explain_in(
        model: &Model,
        desired: &Desired,
        dataplane: &MemoryDataplane,
        request: &ExplainRequest,
        now_ns: u64,
    ) -> Explanation {
        let view = View {
            model,
            desired,
            flows: dataplane,
            slot_words: &SlotWords::default(),
            flow_idle: Duration::from_secs(30),
            interfaces: &[],
        };
        explain(&view, request, now_ns).unwrap()
    }

    /// The id and address of the backend the table does not give CLIENT's flow.
    fn other_backend(model: &Model, table_choice: &str) -> (u32, String) {
        let other = model.vips[0]
            .backends
            .iter()
            .find(|b| b.config.address.to_string() != table_choice)
            .unwrap();
        (other.id, other.config.address.to_string())
    }

    /// Backend `id` of the first VIP fails its checks: the tables that gives.
    fn fail(model: &mut Model, id: u32) -> Desired {
        let failed = model.vips[0]
            .backends
            .iter_mut()
            .find(|b| b.id == id)
            .unwrap();
        failed.health = Health::Down;
        model.desired()
    }

    fn entry(backend_id: u32, last_seen_ns: u64) -> FlowEntry {
        FlowEntry {
            backend_id,
            flags: 0,
            last_seen_ns,
        }
    }

    /// With several interfaces, the explanation names the one the next packet's backend
    /// is reached by (its recorded egress); with one, or without a next hop, none.
    #[test]
    fn the_interface_a_backend_is_reached_by_is_named_with_several() {
        let (mut model, desired) = model_of(&two_backends("tcp", 80));
        let request = ExplainRequest {
            vip: "10.0.0.100:80/tcp".parse().unwrap(),
            source: CLIENT.parse().unwrap(),
            quic_cid: None,
        };
        let dataplane = MemoryDataplane::default();
        let interfaces = ["eth0".to_string(), "eth1".to_string()];
        let explained = |model: &Model, interfaces: &[String]| {
            let view = View {
                model,
                desired: &desired,
                flows: &dataplane,
                slot_words: &SlotWords::default(),
                flow_idle: Duration::from_secs(30),
                interfaces,
            };
            explain(&view, &request, 0).unwrap().interface
        };
        for backend in &mut model.vips[0].backends {
            backend.next_hop = None;
            backend.egress = 1;
        }
        assert_eq!(explained(&model, &interfaces), None, "no next hop");
        for backend in &mut model.vips[0].backends {
            backend.next_hop = Some(backend.config.address);
            backend.egress = 1;
        }
        assert_eq!(explained(&model, &interfaces).as_deref(), Some("eth1"));
        assert_eq!(explained(&model, &interfaces[..1]), None);
    }

    /// `stable_slots`: explain reads the live slot words, so a flow with no entry in a
    /// slot a change moved goes, as the program sends it, to the slot's previous backend.
    #[test]
    fn a_flow_in_a_moved_stable_slot_is_explained_to_its_previous_backend() {
        let text = two_backends("tcp", 80).replace(
            "protocol = \"tcp\"",
            "protocol = \"tcp\"\nstable_slots = true",
        );
        let (mut model, desired) = model_of(&text);
        let mut dataplane = MemoryDataplane::default();
        let mut writer = crate::tables::TableWriter::new(7);
        writer.apply(&mut dataplane, &desired).unwrap();
        let request = ExplainRequest {
            vip: "10.0.0.100:80/tcp".parse().unwrap(),
            source: CLIENT.parse().unwrap(),
            quic_cid: None,
        };
        let explained = |(model, dataplane): (&Model, &MemoryDataplane), words: &SlotWords| {
            let view = View {
                model,
                desired: &model.desired(),
                flows: dataplane,
                slot_words: words,
                flow_idle: Duration::from_secs(30),
                interfaces: &[],
            };
            explain(&view, &request, SECOND).unwrap()
        };
        let before = explained((&model, &dataplane), &writer.slot_words());
        let home = before.table_backend.clone().unwrap();
        assert_eq!(before.next_packet_backend.as_deref(), Some(home.as_str()));
        // The flow's backend drains: its slots move, naming it.
        for backend in &mut model.vips[0].backends {
            if backend.config.address.to_string() == home {
                backend.config.state = crate::config::AdminState::Drain;
            }
        }
        let moved = model.desired();
        writer.apply(&mut dataplane, &moved).unwrap();
        let after = explained((&model, &dataplane), &writer.slot_words());
        assert_ne!(after.table_backend.as_deref(), Some(home.as_str()));
        assert_eq!(after.next_packet_backend.as_deref(), Some(home.as_str()));
        // Read as plain ids, the table would send it elsewhere.
        let plain = explained((&model, &dataplane), &SlotWords::default());
        assert_eq!(plain.next_packet_backend, after.table_backend);
    }

    #[test]
    fn the_next_packet_follows_a_live_entry_else_the_table() {
        let (mut model, desired) = model_of(&two_backends("tcp", 80));
        let vip = "10.0.0.100:80/tcp";
        let now = 100 * SECOND;

        let fresh = explain_with(&model, &desired, vip, None, now);
        let table = fresh.table_backend.clone().unwrap();
        assert_eq!(fresh.next_packet_backend.as_deref(), Some(table.as_str()));
        assert_eq!(fresh.conntrack_backend, None);
        assert_eq!(fresh.conntrack_idle_seconds, None);

        // An entry on the other backend (the flow began before the table changed): the
        // next packet stays there, whatever the table says.
        let (other_id, other) = other_backend(&model, &table);
        let held = explain_with(
            &model,
            &desired,
            vip,
            Some(entry(other_id, now - SECOND)),
            now,
        );
        assert_eq!(held.table_backend.as_deref(), Some(table.as_str()));
        assert_eq!(held.conntrack_backend.as_deref(), Some(other.as_str()));
        assert_eq!(held.next_packet_backend.as_deref(), Some(other.as_str()));
        assert_eq!(held.conntrack_idle_seconds, Some(1.0));

        // A TCP entry does not expire with idleness (the program follows it still).
        let idle = explain_with(&model, &desired, vip, Some(entry(other_id, 0)), now);
        assert_eq!(idle.next_packet_backend.as_deref(), Some(other.as_str()));

        // Its backend failed: it no longer serves flows, and the table decides.
        let desired = fail(&mut model, other_id);
        let moved = explain_with(&model, &desired, vip, Some(entry(other_id, now)), now);
        assert_eq!(moved.conntrack_backend.as_deref(), Some(other.as_str()));
        assert_eq!(moved.next_packet_backend.as_deref(), Some(table.as_str()));
    }

    #[test]
    fn without_an_entry_the_next_packet_goes_where_the_first_one_went() {
        let (mut model, desired) = model_of(&two_backends("tcp", 80));
        let request = ExplainRequest {
            vip: "10.0.0.100:80/tcp".parse().unwrap(),
            source: CLIENT.parse().unwrap(),
            quic_cid: None,
        };
        let now = 100 * SECOND;
        let mut dataplane = MemoryDataplane::default();
        let table = explain_in(&model, &desired, &dataplane, &request, now)
            .table_backend
            .unwrap();
        let (other_id, other) = other_backend(&model, &table);
        // The SYN went to the other backend (the table changed since): its ACK follows.
        let key = flow_key(&request.vip, request.source);
        let (index, tag) = flow::embryo_place(&key);
        let remembered = flow::embryo_for(tag, other_id, true);
        dataplane.embryos.insert(index, remembered);
        let e = explain_in(&model, &desired, &dataplane, &request, now);
        assert_eq!(e.embryonic_backend.as_deref(), Some(other.as_str()));
        assert_eq!(e.next_packet_backend.as_deref(), Some(other.as_str()));
        assert_eq!(e.conntrack_backend, None);

        // Another flow's first packet on the same slot: the table decides.
        let stranger = lb_common::Embryo {
            tag: tag ^ 2,
            ..remembered
        };
        dataplane.embryos.insert(index, stranger);
        let e = explain_in(&model, &desired, &dataplane, &request, now);
        assert_eq!(e.embryonic_backend, None);
        assert_eq!(e.next_packet_backend.as_deref(), Some(table.as_str()));

        // An entry decides over what the embryonic table remembers.
        dataplane.embryos.insert(index, remembered);
        let table_id = model.vips[0]
            .backends
            .iter()
            .find(|b| b.config.address.to_string() == table)
            .unwrap()
            .id;
        dataplane.flows.insert(key, entry(table_id, now));
        let e = explain_in(&model, &desired, &dataplane, &request, now);
        assert_eq!(e.embryonic_backend, None);
        assert_eq!(e.next_packet_backend.as_deref(), Some(table.as_str()));

        // An entry idle for two seconds that a SYN came after (an earlier connection
        // on the reused tuple): the new connection goes where its SYN went.
        dataplane
            .flows
            .insert(key, entry(table_id, now - 2 * SECOND));
        let e = explain_in(&model, &desired, &dataplane, &request, now);
        assert_eq!(e.conntrack_backend.as_deref(), Some(table.as_str()));
        assert_eq!(e.embryonic_backend.as_deref(), Some(other.as_str()));
        assert_eq!(e.next_packet_backend.as_deref(), Some(other.as_str()));
        // Without the SYN mark (its ACK entered the entry since), the entry holds.
        let promoted = flow::embryo_for(tag, other_id, false);
        dataplane.embryos.insert(index, promoted);
        let e = explain_in(&model, &desired, &dataplane, &request, now);
        assert_eq!(e.next_packet_backend.as_deref(), Some(table.as_str()));
        dataplane.embryos.insert(index, remembered);

        // The remembered backend failed meanwhile: the table decides.
        dataplane.flows.clear();
        let desired = fail(&mut model, other_id);
        let e = explain_in(&model, &desired, &dataplane, &request, now);
        assert_eq!(e.embryonic_backend, None);
        assert_eq!(e.next_packet_backend.as_deref(), Some(table.as_str()));
    }

    #[test]
    fn an_idle_udp_entry_and_a_gone_backend_give_way_to_the_table() {
        let (model, desired) = model_of(&two_backends("udp", 53));
        let vip = "10.0.0.100:53/udp";
        let now = 100 * SECOND;
        let table = explain_with(&model, &desired, vip, None, now)
            .table_backend
            .unwrap();
        let (other_id, other) = other_backend(&model, &table);

        let recent = explain_with(
            &model,
            &desired,
            vip,
            Some(entry(other_id, now - 29 * SECOND)),
            now,
        );
        assert_eq!(recent.next_packet_backend.as_deref(), Some(other.as_str()));
        let expired = explain_with(
            &model,
            &desired,
            vip,
            Some(entry(other_id, now - 31 * SECOND)),
            now,
        );
        assert_eq!(expired.conntrack_backend.as_deref(), Some(other.as_str()));
        assert_eq!(expired.next_packet_backend.as_deref(), Some(table.as_str()));

        let gone = explain_with(&model, &desired, vip, Some(entry(999, now)), now);
        assert_eq!(
            gone.conntrack_backend.as_deref(),
            Some("backend id 999 (gone)")
        );
        assert_eq!(gone.next_packet_backend.as_deref(), Some(table.as_str()));
    }

    #[test]
    fn a_hot_source_is_explained_as_balanced_per_connection() {
        let text = two_backends("tcp", 80).replace(
            "protocol = \"tcp\"",
            "protocol = \"tcp\"\nhash = \"src-ip\"\nhot_source_share = 0.2",
        );
        let (model, desired) = model_of(&text);
        let vip: VipTarget = "10.0.0.100:80/tcp".parse().unwrap();
        let mut dataplane = MemoryDataplane::default();
        let ask = |dataplane: &MemoryDataplane, port: u16| {
            let view = View {
                model: &model,
                desired: &desired,
                flows: dataplane,
                slot_words: &SlotWords::default(),
                flow_idle: Duration::from_secs(30),
                interfaces: &[],
            };
            let source = SocketAddr::from(([10, 0, 0, 1], port));
            explain(&view, &ExplainRequest::flow(vip, source), SECOND).unwrap()
        };
        let tuple = |port| flow_tuple(&vip, SocketAddr::from(([10, 0, 0, 1], port)));
        // Cold: by source, every port alike.
        let cold = ask(&dataplane, 40000);
        assert!(!cold.hot_source);
        assert_eq!(cold.hash, lb_common::flow_hash(&tuple(40000), true));
        assert_eq!(ask(&dataplane, 40001).hash, cold.hash);
        // Hot: by 5-tuple, as the program hashes it.
        let (addr, family) = lb_common::addr::to_map("10.0.0.1".parse().unwrap());
        dataplane
            .hot_sources
            .insert(SourceKey::new(model.vips[0].id, addr, family));
        let hot = ask(&dataplane, 40000);
        assert!(hot.hot_source);
        assert_eq!(hot.hash, lb_common::flow_hash(&tuple(40000), false));
        assert_eq!(
            ask(&dataplane, 40001).hash,
            lb_common::flow_hash(&tuple(40001), false)
        );
        // A source hot for this VIP says nothing of another VIP (without the option).
        let (plain, plain_desired) = model_of(&two_backends("tcp", 80).replace(
            "protocol = \"tcp\"",
            "protocol = \"tcp\"\nhash = \"src-ip\"",
        ));
        let view = View {
            model: &plain,
            desired: &plain_desired,
            flows: &dataplane,
            slot_words: &SlotWords::default(),
            flow_idle: Duration::from_secs(30),
            interfaces: &[],
        };
        let source = SocketAddr::from(([10, 0, 0, 1], 40000));
        let e = explain(&view, &ExplainRequest::flow(vip, source), SECOND).unwrap();
        assert!(!e.hot_source);
        assert_eq!(e.hash, cold.hash);
    }

    #[test]
    fn flow_key_is_in_network_order() {
        let vip: VipTarget = "10.0.0.100:80/tcp".parse().unwrap();
        let key = flow_key(&vip, "10.0.0.1:40000".parse().unwrap());
        assert_eq!(&key.src[..4], &[10, 0, 0, 1]);
        assert_eq!(key.dst_port.to_ne_bytes(), 80u16.to_be_bytes());
        assert_eq!(key.src_port.to_ne_bytes(), 40000u16.to_be_bytes());
    }

    #[test]
    fn a_quic_connection_id_is_explained_by_its_server_id() {
        let text = two_backends("udp", 443)
            .replace("protocol = \"udp\"\n", "protocol = \"udp\"\nquic = true\n")
            .replace(
                "02:00:00:00:00:0b\"\n",
                "02:00:00:00:00:0b\"\nserver_id = 7\n",
            )
            .replace(
                "02:00:00:00:00:0c\"\n",
                "02:00:00:00:00:0c\"\nserver_id = 8\n",
            );
        let (model, desired) = model_of(&text);
        let ask = |cid: &str| {
            let request = ExplainRequest {
                quic_cid: Some(cid.into()),
                ..ExplainRequest::flow(
                    "10.0.0.100:443/udp".parse().unwrap(),
                    CLIENT.parse().unwrap(),
                )
            };
            let view = View {
                model: &model,
                desired: &desired,
                flows: &MemoryDataplane::default(),
                slot_words: &SlotWords::default(),
                flow_idle: Duration::from_secs(30),
                interfaces: &[],
            };
            explain(&view, &request, SECOND)
        };
        for (id, backend) in [("07", "10.0.0.11"), ("08", "10.0.0.12")] {
            let e = ask(&format!("0700{id}0a1b2c3d4e")).unwrap();
            let quic = e.quic.unwrap();
            assert!(quic.routed_by_cid, "{}", quic.why);
            assert_eq!(quic.server.as_deref(), Some(backend));
            assert_eq!(e.next_packet_backend.as_deref(), Some(backend));
        }
        let unknown = ask("07:00:09:0a:1b:2c:3d:4e").unwrap().quic.unwrap();
        assert!(!unknown.routed_by_cid);
        assert_eq!(unknown.server_id, Some(9));
        assert!(unknown.why.contains("quic_cid_unknown"), "{}", unknown.why);
        let unroutable = ask("e7000800").unwrap().quic.unwrap();
        assert_eq!(unroutable.server_id, None);
        assert!(matches!(ask("0x07"), Err(ExplainError::BadCid(_))));
        assert!(matches!(ask("070"), Err(ExplainError::BadCid(_))));
    }
}
