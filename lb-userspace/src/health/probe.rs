//! Datagram health checks: `kind = "udp"` (a datagram, a reply) and `kind = "dns"` (a
//! query, a well-formed NOERROR answer), for services that have no TCP port to check.
//! The DNS message is built and parsed with hickory-proto.
//!
//! Both use a connected UDP socket: the kernel then delivers only the backend's replies,
//! and an ICMP port unreachable comes back as ECONNREFUSED on the next receive, so a
//! stopped service fails at once instead of at the timeout.

use std::net::SocketAddr;

use hickory_proto::op::{Message, MessageType, OpCode, Query, ResponseCode};
use tokio::net::UdpSocket;

use crate::config::{DnsQueryError, HealthConfig, parse_name, parse_record_type};

/// Why a datagram check failed. The texts are what status shows as the check's error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProbeError {
    /// An ICMP port unreachable came back.
    #[error("port unreachable")]
    PortUnreachable,
    #[error("{0}")]
    Io(String),
    #[error("reply {reply:?} does not contain {expect:?}")]
    Unexpected { reply: String, expect: String },
    /// `query` or `query_type` is not a DNS name or type.
    #[error(transparent)]
    Query(#[from] DnsQueryError),
    #[error("DNS query: {0}")]
    Encode(String),
    #[error("DNS: a malformed answer ({0})")]
    Malformed(String),
    #[error("DNS: the answer is not a response")]
    NotAResponse,
    /// Another query's answer (a late one, on a reused port).
    #[error("DNS: the answer's id {answer} is not the query's {query}")]
    OtherQuery { answer: u16, query: u16 },
    /// The RFC mnemonic: SERVFAIL, NXDOMAIN, REFUSED ...
    #[error("DNS {0}")]
    Rcode(String),
}

/// The largest reply read (a DNS answer over UDP without EDNS is at most 512 bytes; a
/// udp check's reply is text to look into).
const REPLY_CAP: usize = 4096;

/// A UDP socket of `target`'s family, connected to it.
async fn connected(target: SocketAddr) -> Result<UdpSocket, ProbeError> {
    let local: SocketAddr = if target.is_ipv4() {
        ([0, 0, 0, 0], 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let socket = UdpSocket::bind(local).await.map_err(describe)?;
    socket.connect(target).await.map_err(describe)?;
    Ok(socket)
}

fn describe(error: std::io::Error) -> ProbeError {
    match error.kind() {
        std::io::ErrorKind::ConnectionRefused => ProbeError::PortUnreachable,
        _ => ProbeError::Io(error.to_string()),
    }
}

/// `kind = "udp"`: sends `send`, passes on a reply that contains `expect` (any reply when
/// unset). The caller bounds it with the timeout.
pub async fn udp_check(config: &HealthConfig, target: SocketAddr) -> Result<(), ProbeError> {
    let socket = connected(target).await?;
    let payload = config.send.as_deref().unwrap_or("");
    socket.send(payload.as_bytes()).await.map_err(describe)?;
    let mut reply = vec![0u8; REPLY_CAP];
    let n = socket.recv(&mut reply).await.map_err(describe)?;
    check_udp_reply(config, &reply[..n])
}

/// Whether a udp check's `reply` passes: it contains `expect`, when that is set.
pub fn check_udp_reply(config: &HealthConfig, reply: &[u8]) -> Result<(), ProbeError> {
    match &config.expect {
        Some(expect) if !contains(reply, expect.as_bytes()) => Err(ProbeError::Unexpected {
            reply: String::from_utf8_lossy(&reply[..reply.len().min(64)]).into_owned(),
            expect: expect.clone(),
        }),
        _ => Ok(()),
    }
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    needle.is_empty() || haystack.windows(needle.len()).any(|w| w == needle)
}

/// The query a dns check sends: `query` (default ".") of `query_type` (default NS), with
/// recursion not desired (the backend answers from what it serves).
pub fn dns_query(config: &HealthConfig, id: u16) -> Result<Message, ProbeError> {
    let name = parse_name(config.query.as_deref().unwrap_or("."))?;
    let kind = parse_record_type(config.query_type.as_deref().unwrap_or("NS"))?;
    let mut message = Message::new(id, MessageType::Query, OpCode::Query);
    message.add_query(Query::query(name, kind));
    Ok(message)
}

/// Whether `reply` answers `query`: a response with its id, and NOERROR.
pub fn check_dns_reply(query: &Message, reply: &[u8]) -> Result<(), ProbeError> {
    let reply = Message::from_vec(reply).map_err(|e| ProbeError::Malformed(e.to_string()))?;
    if reply.metadata.message_type != MessageType::Response {
        return Err(ProbeError::NotAResponse);
    }
    if reply.metadata.id != query.metadata.id {
        return Err(ProbeError::OtherQuery {
            answer: reply.metadata.id,
            query: query.metadata.id,
        });
    }
    match reply.metadata.response_code {
        ResponseCode::NoError => Ok(()),
        // The RFC mnemonics: SERVFAIL, NXDOMAIN, REFUSED ...
        code => Err(ProbeError::Rcode(format!("{code:?}").to_ascii_uppercase())),
    }
}

/// A dns check's query, as sent.
pub fn encode(query: &Message) -> Result<Vec<u8>, ProbeError> {
    query
        .to_vec()
        .map_err(|e| ProbeError::Encode(e.to_string()))
}

/// `kind = "dns"`: one query over UDP; a well-formed answer with the query's id and
/// RCODE NOERROR passes. The caller bounds it with the timeout.
pub async fn dns_check(config: &HealthConfig, target: SocketAddr) -> Result<(), ProbeError> {
    let query = dns_query(config, fastrand::u16(..))?;
    let bytes = encode(&query)?;
    let socket = connected(target).await?;
    socket.send(&bytes).await.map_err(describe)?;
    let mut reply = vec![0u8; REPLY_CAP];
    loop {
        let n = socket.recv(&mut reply).await.map_err(describe)?;
        match check_dns_reply(&query, &reply[..n]) {
            // Another query's late answer on a reused port: keep waiting for ours.
            Err(ProbeError::OtherQuery { .. }) => continue,
            other => return other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::HealthKind;
    use hickory_proto::rr::RecordType;
    use std::time::Duration;

    fn dns_config(query: Option<&str>, kind: Option<&str>) -> HealthConfig {
        HealthConfig {
            kind: HealthKind::Dns,
            query: query.map(String::from),
            query_type: kind.map(String::from),
            ..HealthConfig::default()
        }
    }

    #[test]
    fn the_dns_query_asks_what_the_config_names() {
        let query = dns_query(&dns_config(None, None), 7).unwrap();
        let bytes = query.to_vec().unwrap();
        let parsed = Message::from_vec(&bytes).unwrap();
        assert_eq!(parsed.metadata.id, 7);
        assert_eq!(parsed.metadata.message_type, MessageType::Query);
        assert_eq!(parsed.queries.len(), 1);
        assert_eq!(parsed.queries[0].name().to_string(), ".");
        assert_eq!(parsed.queries[0].query_type(), RecordType::NS);
        let query = dns_query(&dns_config(Some("example.com"), Some("aaaa")), 9).unwrap();
        assert_eq!(query.queries[0].query_type(), RecordType::AAAA);
        assert_eq!(
            parse_record_type("BOGUS"),
            Err(DnsQueryError::RecordType {
                text: "BOGUS".into()
            })
        );
        assert!(matches!(
            parse_name("exa mple..com"),
            Err(DnsQueryError::Name { .. })
        ));
    }

    /// An answer to `query` with `code`, as a server would send it.
    fn answer(query: &Message, id: u16, code: ResponseCode) -> Vec<u8> {
        let mut reply = Message::new(id, MessageType::Response, OpCode::Query);
        reply.metadata.response_code = code;
        for q in &query.queries {
            reply.add_query(q.clone());
        }
        reply.to_vec().unwrap()
    }

    #[test]
    fn a_dns_answer_must_be_ours_and_noerror() {
        let query = dns_query(&dns_config(None, None), 42).unwrap();
        assert_eq!(
            check_dns_reply(&query, &answer(&query, 42, ResponseCode::NoError)),
            Ok(())
        );
        assert_eq!(
            check_dns_reply(&query, &answer(&query, 42, ResponseCode::ServFail)),
            Err(ProbeError::Rcode("SERVFAIL".into()))
        );
        let other = check_dns_reply(&query, &answer(&query, 41, ResponseCode::NoError));
        assert_eq!(
            other,
            Err(ProbeError::OtherQuery {
                answer: 41,
                query: 42
            })
        );
        let garbage = check_dns_reply(&query, b"\x00\x2a\x81");
        assert!(garbage.unwrap_err().to_string().contains("malformed"));
        let echoed = check_dns_reply(&query, &query.to_vec().unwrap());
        assert_eq!(echoed, Err(ProbeError::NotAResponse));
        // What status shows.
        assert_eq!(
            ProbeError::OtherQuery {
                answer: 41,
                query: 42
            }
            .to_string(),
            "DNS: the answer's id 41 is not the query's 42"
        );
        assert_eq!(
            ProbeError::Rcode("SERVFAIL".into()).to_string(),
            "DNS SERVFAIL"
        );
    }

    /// A UDP server on loopback that answers every datagram with `answer(datagram)`.
    async fn udp_server(answer: fn(&[u8]) -> Vec<u8>) -> SocketAddr {
        let socket = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let address = socket.local_addr().unwrap();
        tokio::spawn(async move {
            let mut buf = [0u8; 2048];
            while let Ok((n, from)) = socket.recv_from(&mut buf).await {
                let _ = socket.send_to(&answer(&buf[..n]), from).await;
            }
        });
        address
    }

    #[tokio::test]
    async fn udp_checks_against_real_sockets() {
        let config = HealthConfig {
            kind: HealthKind::Udp,
            send: Some("ping".into()),
            expect: Some("pong".into()),
            ..HealthConfig::default()
        };
        let pong = udp_server(|d| {
            if d == b"ping" {
                b"pong!".to_vec()
            } else {
                Vec::new()
            }
        })
        .await;
        assert_eq!(udp_check(&config, pong).await, Ok(()));
        let wrong = udp_server(|_| b"nope".to_vec()).await;
        let error = udp_check(&config, wrong).await.unwrap_err();
        assert!(
            error.to_string().contains("does not contain \"pong\""),
            "{error}"
        );
        // Nobody listens: the ICMP port unreachable fails it at once.
        let closed = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let gone = closed.local_addr().unwrap();
        drop(closed);
        let started = std::time::Instant::now();
        let error = tokio::time::timeout(Duration::from_secs(2), udp_check(&config, gone))
            .await
            .expect("answered before the timeout");
        assert_eq!(error, Err(ProbeError::PortUnreachable));
        assert!(started.elapsed() < Duration::from_secs(1));
    }

    #[tokio::test]
    async fn dns_checks_against_a_real_socket() {
        let noerror = udp_server(|d| {
            let query = Message::from_vec(d).unwrap();
            answer(&query, query.metadata.id, ResponseCode::NoError)
        })
        .await;
        let servfail = udp_server(|d| {
            let query = Message::from_vec(d).unwrap();
            answer(&query, query.metadata.id, ResponseCode::ServFail)
        })
        .await;
        let config = dns_config(Some("example.com"), Some("A"));
        assert_eq!(dns_check(&config, noerror).await, Ok(()));
        assert_eq!(
            dns_check(&config, servfail).await,
            Err(ProbeError::Rcode("SERVFAIL".into()))
        );
    }
}
