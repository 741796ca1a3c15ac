//! Real QUIC for the connection-ID routing tests (`tests/tests/quic.rs`) and the lab:
//! quinn servers that issue QUIC-LB connection IDs with their server ID (`lb_quic`),
//! and quinn clients that ask them who they are, and can move (a new port, a new
//! address) mid-connection.
//!
//! A server answers every bidirectional stream with its name; it binds the VIP itself
//! (held on the backend's `lo`, as DSR has it), so its replies come from the VIP, which
//! the client's connection expects.

use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::{Context, Result, anyhow};
use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

use crate::Netns;

/// The name the test certificate is for.
pub const SERVER_NAME: &str = "lb-test";
/// ALPN of the test protocol.
const ALPN: &[u8] = b"lb-test";

/// A self-signed certificate and its key, made once per process.
fn certificate() -> &'static (CertificateDer<'static>, PrivatePkcs8KeyDer<'static>) {
    static CERT: std::sync::OnceLock<(CertificateDer<'static>, PrivatePkcs8KeyDer<'static>)> =
        std::sync::OnceLock::new();
    CERT.get_or_init(|| {
        let cert = rcgen::generate_simple_self_signed(vec![SERVER_NAME.into()])
            .expect("a self-signed certificate");
        let key = PrivatePkcs8KeyDer::from(cert.key_pair.serialize_der());
        (cert.cert.der().clone(), key)
    })
}

/// ring, not aws-lc-rs (whose C build needs cmake, which these machines lack). rustls
/// 0.23.48 deprecates ring's provider for its want of post-quantum key exchange, which
/// a test of load balancing does not need.
#[allow(deprecated)]
fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn server_config() -> Result<quinn::ServerConfig> {
    let (cert, key) = certificate();
    let mut tls = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_no_client_auth()
        .with_single_cert(vec![cert.clone()], PrivateKeyDer::Pkcs8(key.clone_key()))?;
    tls.alpn_protocols = vec![ALPN.to_vec()];
    let crypto = QuicServerConfig::try_from(tls).map_err(|e| anyhow!("{e}"))?;
    Ok(quinn::ServerConfig::with_crypto(Arc::new(crypto)))
}

/// The client's configuration: trusts the test certificate only; connections live 10 s
/// without a packet.
pub fn client_config() -> Result<quinn::ClientConfig> {
    let (cert, _) = certificate();
    let mut roots = rustls::RootCertStore::empty();
    roots.add(cert.clone())?;
    let mut tls = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_root_certificates(roots)
        .with_no_client_auth();
    tls.alpn_protocols = vec![ALPN.to_vec()];
    let crypto = QuicClientConfig::try_from(tls).map_err(|e| anyhow!("{e}"))?;
    let mut config = quinn::ClientConfig::new(Arc::new(crypto));
    let mut transport = quinn::TransportConfig::default();
    transport.max_idle_timeout(Some(Duration::from_secs(10).try_into()?));
    config.transport_config(Arc::new(transport));
    Ok(config)
}

/// A quinn server in a backend's namespace, answering each stream with `name`; its
/// connection IDs carry `server_id` in `id_len` bytes. Stops when dropped.
pub struct QuicServer {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<Result<()>>>,
}

impl QuicServer {
    /// Serves on `addr` (the VIP) in `ns`; returns once it is bound.
    pub fn start(
        ns: &Netns,
        addr: SocketAddr,
        name: &str,
        server_id: u64,
        id_len: u32,
    ) -> Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let (ready, bound) = std::sync::mpsc::channel();
        let (name, flag) = (name.to_string(), stop.clone());
        let thread = ns.spawn("quic-server", move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            runtime.block_on(serve(addr, name, (server_id, id_len), flag, ready))
        })?;
        bound
            .recv_timeout(Duration::from_secs(5))
            .context("the quic server did not start")??;
        Ok(Self {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for QuicServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

async fn serve(
    addr: SocketAddr,
    name: String,
    (server_id, id_len): (u64, u32),
    stop: Arc<AtomicBool>,
    ready: std::sync::mpsc::Sender<Result<()>>,
) -> Result<()> {
    let endpoint = (|| -> Result<quinn::Endpoint> {
        let cids = lb_quic::ServerIdCids::new(server_id, id_len)?;
        let mut endpoint_config = quinn::EndpointConfig::default();
        endpoint_config.cid_generator(cids.factory());
        let socket = UdpSocket::bind(addr).with_context(|| format!("bind {addr}"))?;
        let runtime = Arc::new(quinn::TokioRuntime);
        Ok(quinn::Endpoint::new(
            endpoint_config,
            Some(server_config()?),
            socket,
            runtime,
        )?)
    })();
    let endpoint = match endpoint {
        Ok(endpoint) => {
            let _ = ready.send(Ok(()));
            endpoint
        }
        Err(e) => {
            let _ = ready.send(Err(anyhow!("{e:#}")));
            return Err(e);
        }
    };
    let name = Arc::new(name);
    while !stop.load(Ordering::Relaxed) {
        let incoming = tokio::time::timeout(Duration::from_millis(100), endpoint.accept()).await;
        let Ok(Some(incoming)) = incoming else {
            continue;
        };
        let name = name.clone();
        tokio::spawn(async move {
            let Ok(connection) = incoming.await else {
                return;
            };
            while let Ok((mut send, mut recv)) = connection.accept_bi().await {
                let name = name.clone();
                tokio::spawn(async move {
                    let _ = recv.read_to_end(1024).await;
                    let _ = send.write_all(name.as_bytes()).await;
                    let _ = send.finish();
                });
            }
        });
    }
    endpoint.close(0u32.into(), b"stopped");
    Ok(())
}

/// One client connection on an endpoint of its own (so it can move alone).
pub struct QuicClient {
    endpoint: quinn::Endpoint,
    connection: quinn::Connection,
}

/// How long one request may take.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(3);

impl QuicClient {
    /// Connects from `local` (port 0: any) to `server`. Call inside the client's
    /// namespace and a tokio runtime.
    pub async fn connect(local: SocketAddr, server: SocketAddr) -> Result<Self> {
        let mut endpoint = quinn::Endpoint::client(local)?;
        endpoint.set_default_client_config(client_config()?);
        let connecting = endpoint.connect(server, SERVER_NAME)?;
        let connection = tokio::time::timeout(REQUEST_TIMEOUT, connecting)
            .await
            .context("handshake timed out")??;
        Ok(Self {
            endpoint,
            connection,
        })
    }

    /// Asks the server its name over a new stream.
    pub async fn ask(&self) -> Result<String> {
        let exchange = async {
            let (mut send, mut recv) = self.connection.open_bi().await?;
            send.write_all(b"who are you?").await?;
            send.finish()?;
            let answer = recv.read_to_end(1024).await?;
            anyhow::Ok(String::from_utf8(answer)?)
        };
        tokio::time::timeout(REQUEST_TIMEOUT, exchange)
            .await
            .context("request timed out")?
    }

    /// Moves the connection to a new UDP socket bound to `local` (a new port, or a new
    /// address), as a NAT rebinding or a network change does.
    pub fn rebind(&self, local: SocketAddr) -> Result<()> {
        let socket = UdpSocket::bind(local).with_context(|| format!("bind {local}"))?;
        self.endpoint.rebind(socket)?;
        Ok(())
    }

    /// The local address the connection sends from.
    pub fn local(&self) -> Result<SocketAddr> {
        Ok(self.endpoint.local_addr()?)
    }
}

/// `connections` clients from `local_ip` to `server`, each asking once, then moved by
/// `moved` (given the client and its first answer) and asking again: for each, the two answers (the second
/// an error where it failed). Runs in `ns`.
pub fn ask_move_ask(
    ns: &Netns,
    local_ip: IpAddr,
    server: SocketAddr,
    connections: usize,
    moved: impl Fn(&QuicClient, &str) -> Result<()> + Send + Sync + 'static,
) -> Result<Vec<(String, Result<String>)>> {
    let thread = ns.spawn("quic-client", move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        runtime.block_on(async move {
            let mut clients = Vec::new();
            for _ in 0..connections {
                let client = QuicClient::connect(SocketAddr::new(local_ip, 0), server).await?;
                let first = client.ask().await.context("the first request")?;
                clients.push((client, first));
            }
            let mut results = Vec::new();
            for (client, first) in &clients {
                moved(client, first)?;
            }
            let seconds = clients.iter().map(|(client, _)| client.ask());
            // Concurrently: a request that fails waits out its timeout once, not per client.
            let answers = futures::future::join_all(seconds).await;
            for ((_, first), second) in clients.iter().zip(answers) {
                results.push((first.clone(), second));
            }
            Ok(results)
        })
    })?;
    thread.join().map_err(|_| anyhow!("the client panicked"))?
}
