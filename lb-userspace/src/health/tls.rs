//! `kind = "https"`: the TLS handshake before an http check's request, with rustls
//! (ring's cryptography: aws-lc would need cmake and a C toolchain the build hosts lack).
//!
//! What is verified: with `verify` (the default) the backend's certificate chain against
//! `ca_file`'s certificates, else the host's trust store (`/etc/ssl/certs`, as
//! rustls-native-certs finds it), and the name: `sni` when set (and sent as SNI), else
//! the backend's own address (no SNI is sent for an address). `verify = false` takes any
//! certificate, but the handshake's signatures are still checked. Every check makes a
//! full handshake (no session resumption): a resumed session would skip the certificate.
//!
//! Client configurations are built once per (`ca_file`, `verify`) and kept; a `ca_file`
//! whose modification time or size changed is read again, so a rotated CA is picked up
//! without a reload.

use std::{
    collections::HashMap,
    io::Read as _,
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::{Arc, Mutex, OnceLock},
    time::SystemTime,
};

use rustls::{
    ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
    client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier},
    crypto::CryptoProvider,
};
use rustls_pki_types::{CertificateDer, DnsName, ServerName, UnixTime, pem::PemObject};
use tokio::net::TcpStream;
use tokio_rustls::{TlsConnector, client::TlsStream};

use crate::config::HealthConfig;

/// Most of a CA file read: a bundle of every public CA is about 200 KiB, and a wrong
/// path (a device, a log) is refused instead of read to its end.
const CA_FILE_CAP: u64 = 4 << 20;

/// Why an https check's TLS part failed. The texts are what status shows.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TlsError {
    /// `ca_file` cannot be used (it went away or changed after `lb check`).
    #[error("ca_file {path}: {why}")]
    CaFile { path: PathBuf, why: CaFileError },
    /// `verify` without `ca_file`, and this host has no trust store.
    #[error("no trusted CA certificates on this host ({0}); set ca_file")]
    NoRoots(String),
    /// `sni` is not a DNS name (`lb check` refuses that; kept for completeness).
    #[error("sni {0:?} is not a DNS name")]
    Sni(String),
    /// The backend's certificate was refused: `UnknownIssuer`, a name it is not for ...
    #[error("certificate: {0}")]
    Certificate(String),
    /// Any other handshake failure: an alert from the backend, not TLS at all ...
    #[error("tls: {0}")]
    Handshake(String),
}

impl TlsError {
    /// Whether this host, not the backend, is the reason: such a failure does not count
    /// towards `fall`.
    pub fn is_local(&self) -> bool {
        matches!(
            self,
            TlsError::CaFile { .. } | TlsError::NoRoots(_) | TlsError::Sni(_)
        )
    }
}

/// The handshake of an https check on `stream` (connected to `target`).
pub async fn handshake(
    config: &HealthConfig,
    target: SocketAddr,
    stream: TcpStream,
) -> Result<TlsStream<TcpStream>, TlsError> {
    let client = client_config(config.verify(), config.ca_file.as_deref())?;
    let name = server_name(config.sni.as_deref(), target)?;
    TlsConnector::from(client)
        .connect(name, stream)
        .await
        .map_err(describe)
}

/// The name the certificate must be for: `sni`, else the backend's address.
fn server_name(sni: Option<&str>, target: SocketAddr) -> Result<ServerName<'static>, TlsError> {
    match sni {
        Some(sni) => DnsName::try_from(sni.to_owned())
            .map(ServerName::DnsName)
            .map_err(|_| TlsError::Sni(sni.to_owned())),
        None => Ok(ServerName::IpAddress(target.ip().into())),
    }
}

/// A failed handshake, told by what rustls refused.
fn describe(error: std::io::Error) -> TlsError {
    let Some(tls) = error
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
    else {
        return TlsError::Handshake(error.to_string());
    };
    match tls {
        rustls::Error::InvalidCertificate(why) => TlsError::Certificate(describe_certificate(why)),
        rustls::Error::AlertReceived(alert) => {
            TlsError::Handshake(format!("the backend sent alert {alert:?}"))
        }
        other => TlsError::Handshake(other.to_string()),
    }
}

fn describe_certificate(why: &rustls::CertificateError) -> String {
    match why {
        rustls::CertificateError::NotValidForNameContext {
            expected,
            presented,
        } => format!(
            "not valid for {} (it is for {})",
            expected.to_str(),
            if presented.is_empty() {
                "no name".to_string()
            } else {
                presented.join(", ")
            }
        ),
        // webpki's own reasons: CaUsedAsEndEntity (a self-signed CA certificate) ...
        rustls::CertificateError::Other(other) => other.to_string(),
        // The simple variants show as their names: UnknownIssuer, BadSignature ...
        other => other.to_string(),
    }
}

/// Why a `ca_file` cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CaFileError {
    /// Opening or reading it failed.
    #[error("{0}")]
    Read(String),
    #[error("larger than {} MiB: not a CA certificate file", CA_FILE_CAP >> 20)]
    TooLarge,
    #[error("not a PEM file ({0})")]
    NotPem(String),
    #[error("no PEM certificate (\"-----BEGIN CERTIFICATE-----\") in it")]
    NoCertificate,
    /// Certificate `number` (from 1) is not one rustls takes as a trust anchor.
    #[error("certificate {number} of the file: {why}")]
    Refused { number: usize, why: String },
}

/// The certificates of a PEM file, as trust anchors: `lb check` reads `ca_file` with
/// this, and so does the check.
pub fn read_ca_file(path: &Path) -> Result<RootCertStore, CaFileError> {
    let mut bytes = Vec::new();
    std::fs::File::open(path)
        .and_then(|file| file.take(CA_FILE_CAP + 1).read_to_end(&mut bytes))
        .map_err(|e| CaFileError::Read(e.to_string()))?;
    if bytes.len() as u64 > CA_FILE_CAP {
        return Err(CaFileError::TooLarge);
    }
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<_, _>>()
        .map_err(|e| CaFileError::NotPem(e.to_string()))?;
    if certs.is_empty() {
        return Err(CaFileError::NoCertificate);
    }
    let mut store = RootCertStore::empty();
    for (i, cert) in certs.into_iter().enumerate() {
        store.add(cert).map_err(|e| CaFileError::Refused {
            number: i + 1,
            why: e.to_string(),
        })?;
    }
    Ok(store)
}

/// What identifies a CA file's contents without reading it: modification time and size.
type Stamp = Option<(SystemTime, u64)>;

fn stamp(path: &Path) -> Stamp {
    let meta = std::fs::metadata(path).ok()?;
    Some((meta.modified().ok()?, meta.len()))
}

/// The client configurations built so far, by (`ca_file`, `verify`).
type Cache = HashMap<(Option<PathBuf>, bool), (Stamp, Arc<ClientConfig>)>;

fn cache() -> &'static Mutex<Cache> {
    static CACHE: OnceLock<Mutex<Cache>> = OnceLock::new();
    CACHE.get_or_init(Default::default)
}

/// The client configuration for `verify` and `ca_file`, built on first use.
fn client_config(verify: bool, ca_file: Option<&Path>) -> Result<Arc<ClientConfig>, TlsError> {
    let key = (ca_file.map(Path::to_path_buf), verify);
    let stamp = ca_file.and_then(stamp);
    if let Some((built, config)) = cache().lock().unwrap().get(&key)
        && *built == stamp
    {
        return Ok(config.clone());
    }
    // Built outside the lock: reading the trust store takes a while.
    let config = Arc::new(build(verify, ca_file)?);
    cache().lock().unwrap().insert(key, (stamp, config.clone()));
    Ok(config)
}

/// ring's cryptography. rustls 0.23.48 deprecates it for want of post-quantum key
/// exchange, which aws-lc has; aws-lc needs cmake and a C toolchain to build, and a
/// health check's handshake protects no secret worth harvesting for later.
#[allow(deprecated)]
fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn build(verify: bool, ca_file: Option<&Path>) -> Result<ClientConfig, TlsError> {
    let provider = provider();
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Handshake(e.to_string()))?;
    let mut config = match (verify, ca_file) {
        (false, _) => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(AnyCertificate(provider)))
            .with_no_client_auth(),
        (true, Some(path)) => {
            let roots = read_ca_file(path).map_err(|why| TlsError::CaFile {
                path: path.to_owned(),
                why,
            })?;
            builder.with_root_certificates(roots).with_no_client_auth()
        }
        (true, None) => builder
            .with_root_certificates(native_roots()?)
            .with_no_client_auth(),
    };
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    config.resumption = rustls::client::Resumption::disabled();
    Ok(config)
}

/// This host's trust store, read once.
fn native_roots() -> Result<Arc<RootCertStore>, TlsError> {
    static ROOTS: OnceLock<Result<Arc<RootCertStore>, String>> = OnceLock::new();
    ROOTS
        .get_or_init(|| {
            let found = rustls_native_certs::load_native_certs();
            let mut store = RootCertStore::empty();
            let (added, _ignored) = store.add_parsable_certificates(found.certs);
            if added > 0 {
                return Ok(Arc::new(store));
            }
            Err(match found.errors.first() {
                Some(error) => error.to_string(),
                None => "its trust store is empty".into(),
            })
        })
        .clone()
        .map_err(TlsError::NoRoots)
}

/// `verify = false`: any certificate, for any name. The handshake's own signatures are
/// still checked (by the provider's algorithms), so this is a TLS connection, only not an
/// authenticated one.
#[derive(Debug)]
struct AnyCertificate(Arc<CryptoProvider>);

impl ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::HealthKind;
    use rustls_pki_types::PrivateKeyDer;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::sync::mpsc;

    fn testdata(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("src/health/testdata")
            .join(name)
    }

    /// A TLS server on loopback with `backend.pem` (for backend.test and 127.0.0.1,
    /// signed by `ca.pem`) that answers every request 200; it reports the SNI each
    /// client sent.
    async fn tls_server() -> (SocketAddr, mpsc::UnboundedReceiver<Option<String>>) {
        let certs = CertificateDer::pem_file_iter(testdata("backend.pem"))
            .unwrap()
            .collect::<Result<Vec<_>, _>>()
            .unwrap();
        let key = PrivateKeyDer::from_pem_file(testdata("backend.key")).unwrap();
        let config = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let (seen, names) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let (acceptor, seen) = (acceptor.clone(), seen.clone());
                tokio::spawn(async move {
                    let Ok(mut tls) = acceptor.accept(stream).await else {
                        return;
                    };
                    let _ = seen.send(tls.get_ref().1.server_name().map(String::from));
                    let mut request = Vec::new();
                    let mut buf = [0u8; 1024];
                    while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                        match tls.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => request.extend_from_slice(&buf[..n]),
                        }
                    }
                    let answer =
                        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok";
                    let _ = tls.write_all(answer).await;
                    let _ = tls.shutdown().await;
                });
            }
        });
        (address, names)
    }

    fn https(sni: Option<&str>, verify: Option<bool>, ca: Option<&str>) -> HealthConfig {
        HealthConfig {
            kind: HealthKind::Https,
            timeout: Duration::from_secs(5),
            sni: sni.map(String::from),
            verify,
            ca_file: ca.map(testdata),
            ..HealthConfig::default()
        }
    }

    #[tokio::test]
    async fn https_checks_against_a_real_tls_server() {
        let (server, mut names) = tls_server().await;
        let check =
            |config: HealthConfig| async move { crate::health::check(&config, server, None).await };

        // With SNI and the CA file: passes, and the server saw the name.
        let record = check(https(Some("backend.test"), None, Some("ca.pem"))).await;
        assert!(record.ok, "{record:?}");
        assert_eq!(names.recv().await.unwrap().as_deref(), Some("backend.test"));
        // Without SNI: none is sent, and the certificate is checked for the address.
        let record = check(https(None, None, Some("ca.pem"))).await;
        assert!(record.ok, "{record:?}");
        assert_eq!(names.recv().await.unwrap(), None);

        // Another CA: the backend's fault, with the reason.
        let record = check(https(Some("backend.test"), None, Some("ca-other.pem"))).await;
        assert!(!record.ok && !record.local, "{record:?}");
        assert_eq!(record.error.as_deref(), Some("certificate: UnknownIssuer"));
        // A name the certificate is not for.
        let record = check(https(Some("other.test"), None, Some("ca.pem"))).await;
        assert!(!record.ok && !record.local, "{record:?}");
        let error = record.error.unwrap();
        assert!(
            error.starts_with("certificate: not valid for other.test")
                && error.contains("backend.test"),
            "{error}"
        );
        // The host's trust store does not know the test CA either.
        let record = check(https(Some("backend.test"), None, None)).await;
        assert!(!record.ok, "{record:?}");
        // verify = false takes it.
        let record = check(https(Some("other.test"), Some(false), None)).await;
        assert!(record.ok, "{record:?}");

        // A CA file gone since `lb check`: this host's failure, not the backend's.
        let mut gone = https(None, None, None);
        gone.ca_file = Some("/nonexistent/ca.pem".into());
        let record = check(gone).await;
        assert!(!record.ok && record.local, "{record:?}");
        assert!(
            record
                .error
                .unwrap()
                .starts_with("ca_file /nonexistent/ca.pem: ")
        );
    }

    #[tokio::test]
    async fn an_https_check_of_a_plain_http_server_fails_in_the_handshake() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let _ = stream
                    .write_all(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
                    .await;
            }
        });
        let record = crate::health::check(&https(None, Some(false), None), address, None).await;
        assert!(!record.ok && !record.local, "{record:?}");
        assert!(record.error.unwrap().starts_with("tls: "));
    }

    #[test]
    fn ca_files_must_hold_pem_certificates() {
        assert_eq!(read_ca_file(&testdata("ca.pem")).unwrap().len(), 1);
        // A key is PEM, but not a certificate.
        let why = read_ca_file(&testdata("backend.key")).unwrap_err();
        assert_eq!(why, CaFileError::NoCertificate);
        assert!(why.to_string().contains("no PEM certificate"), "{why}");
        let why = read_ca_file(Path::new("/dev/zero")).unwrap_err();
        assert_eq!(why, CaFileError::TooLarge);
        assert_eq!(
            why.to_string(),
            "larger than 4 MiB: not a CA certificate file"
        );
    }
}
