//! What every HTTP listener of the agent tolerates (the control socket and the metrics
//! endpoint): the accept loop both serve through, with bounds on time, size and numbers,
//! so that no client, and no local user on the metrics port, can hold the agent's file
//! descriptors or memory, nor keep the control socket from answering:
//! - a request's head must arrive within [`Limits::request_timeout`] (hyper's header
//!   timer, which also closes a keep-alive connection idle that long), and its body
//!   within as long again; it is answered 408 and closed otherwise;
//! - a head is at most [`Limits::max_head_bytes`] (431), a body [`Limits::max_body_bytes`]
//!   (413): bodies are read whole, within those bounds, before a handler sees them;
//! - at most [`Limits::max_connections`] connections are served at once, per listener: a
//!   connection above that is closed as soon as it is accepted;
//! - a connection lives at most [`Limits::max_connection_time`], whatever it does (a
//!   client that never reads its answer).
//!
//! Each listener counts on its own, so a flood on the metrics port leaves the control
//! socket its own connections, and health checks their descriptors.
//!
//! Every refusal is a JSON `{"error": "..."}`, also those hyper writes by itself when a
//! request head does not parse (a Content-Length that is not a number, a head too large):
//! hyper has no hook for them and sends an empty body, so [`JsonRefusals`] rewrites
//! those answers on their way out.

use std::{
    convert::Infallible,
    future::Future,
    io,
    sync::Arc,
    time::{Duration, Instant},
};

use axum::{Router, body::Body, http::StatusCode, response::IntoResponse};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use hyper::{Request, body::Incoming, service::Service as _};
use hyper_util::{
    rt::{TokioIo, TokioTimer},
    service::TowerToHyperService,
};
use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    sync::Semaphore,
    task::JoinSet,
};
use tokio_util::sync::CancellationToken;

/// The bounds a listener serves within.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Connections served at once; more are closed when accepted.
    pub max_connections: usize,
    /// For a request's head (and for an idle keep-alive connection), then for its body.
    pub request_timeout: Duration,
    /// Request line and headers (hyper's read buffer: at least 8 KiB).
    pub max_head_bytes: usize,
    /// A request's body.
    pub max_body_bytes: usize,
    /// Whatever a connection does, it is closed after this.
    pub max_connection_time: Duration,
}

/// The agent's listeners' bounds. Requests are small (a status query, a JSON command of
/// a few hundred bytes, a scrape) and clients few (a scraper or two, the CLI); the
/// slowest handler waits for the routes to follow a node drain (5 s).
pub const LIMITS: Limits = Limits {
    max_connections: 64,
    request_timeout: Duration::from_secs(5),
    max_head_bytes: 16 * 1024,
    max_body_bytes: 64 * 1024,
    max_connection_time: Duration::from_secs(60),
};

/// How long a stopping listener lets its requests finish.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);
/// After a failed accept (the process is out of descriptors, say), before the next.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);
/// At most one log line about refused connections or failed accepts this often.
const LOG_EVERY: Duration = Duration::from_secs(10);

/// A listening socket the accept loop takes connections from.
pub trait Listener: Send + 'static {
    type Io: AsyncRead + AsyncWrite + Unpin + Send + 'static;
    fn accept_one(&mut self) -> impl Future<Output = io::Result<Self::Io>> + Send;
    /// Who is at the other end, as the kernel says: every request of the connection
    /// carries it (an axum `Extension<Peer>`). None where the socket cannot tell.
    fn peer(_io: &Self::Io) -> Option<Peer> {
        None
    }
}

/// A Unix socket's peer, as it was when it connected (SO_PEERCRED, SO_PEERGROUPS).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Peer {
    pub uid: u32,
    pub gid: u32,
    pub pid: Option<i32>,
    /// Its supplementary groups.
    pub groups: Vec<u32>,
}

impl Peer {
    /// Whether it is in group `gid`, as its primary or a supplementary group.
    pub fn in_group(&self, gid: u32) -> bool {
        self.gid == gid || self.groups.contains(&gid)
    }
}

impl std::fmt::Display for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "uid {}", self.uid)?;
        match self.pid {
            Some(pid) => write!(f, " (pid {pid})"),
            None => Ok(()),
        }
    }
}

/// The supplementary groups of a Unix socket's peer (SO_PEERGROUPS, Linux 4.13).
fn peer_groups(stream: &tokio::net::UnixStream) -> Vec<u32> {
    use std::os::fd::AsRawFd;
    let mut groups = vec![0u32; 64];
    let mut len = (groups.len() * size_of::<u32>()) as libc::socklen_t;
    // SAFETY: the buffer is `len` bytes of writable memory; the kernel writes at most that
    // and says how much it wrote.
    let done = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERGROUPS,
            groups.as_mut_ptr().cast(),
            &mut len,
        )
    };
    if done != 0 {
        // ERANGE: more than 64 groups; the primary group still counts.
        return Vec::new();
    }
    groups.truncate(len as usize / size_of::<u32>());
    groups
}

impl Listener for tokio::net::TcpListener {
    type Io = tokio::net::TcpStream;
    async fn accept_one(&mut self) -> io::Result<Self::Io> {
        self.accept().await.map(|(stream, _)| stream)
    }
}

impl Listener for tokio::net::UnixListener {
    type Io = tokio::net::UnixStream;
    async fn accept_one(&mut self) -> io::Result<Self::Io> {
        self.accept().await.map(|(stream, _)| stream)
    }

    fn peer(io: &Self::Io) -> Option<Peer> {
        let cred = io.peer_cred().ok()?;
        Some(Peer {
            uid: cred.uid(),
            gid: cred.gid(),
            pid: cred.pid(),
            groups: peer_groups(io),
        })
    }
}

/// Serves `app` on `listener` within `limits` until `shutdown`, then lets the requests
/// in progress finish (up to [`SHUTDOWN_GRACE`]). `what` names the listener in logs.
pub async fn serve<L: Listener>(
    mut listener: L,
    what: &'static str,
    app: Router,
    limits: Limits,
    shutdown: CancellationToken,
) {
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    let mut connections = JoinSet::new();
    let mut refused = Throttled::default();
    let mut failed = Throttled::default();
    loop {
        let accepted = tokio::select! {
            _ = shutdown.cancelled() => break,
            // Reap finished connections as they end: their results are nothing.
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
            accepted = listener.accept_one() => accepted,
        };
        let io = match accepted {
            Ok(io) => io,
            Err(error) => {
                if let Some(more) = failed.note() {
                    tracing::warn!("{what}: accepting a connection: {error}{}", more.suffix());
                }
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = tokio::time::sleep(ACCEPT_BACKOFF) => continue,
                }
            }
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            if let Some(more) = refused.note() {
                tracing::warn!(
                    "{what}: {} connections open, the most served at once: closing new ones{}",
                    limits.max_connections,
                    more.suffix()
                );
            }
            drop(io);
            continue;
        };
        let (app, shutdown) = (app.clone(), shutdown.clone());
        let peer = L::peer(&io);
        connections.spawn(async move {
            serve_connection(io, peer, app, limits, shutdown).await;
            drop(permit);
        });
    }
    let finished = tokio::time::timeout(SHUTDOWN_GRACE, async {
        while connections.join_next().await.is_some() {}
    })
    .await;
    if finished.is_err() {
        tracing::warn!("{what}: closing connections still open after {SHUTDOWN_GRACE:?}");
    }
}

/// One connection, until it ends, outlives `max_connection_time`, or (after `shutdown`)
/// finishes the request in progress.
async fn serve_connection<Io>(
    io: Io,
    peer: Option<Peer>,
    app: Router,
    limits: Limits,
    shutdown: CancellationToken,
) where
    Io: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let service = hyper::service::service_fn(move |mut request: Request<Incoming>| {
        let app = app.clone();
        if let Some(peer) = &peer {
            request.extensions_mut().insert(peer.clone());
        }
        async move { Ok::<_, Infallible>(answer(app, request, limits).await) }
    });
    let connection = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.request_timeout)
        .max_buf_size(limits.max_head_bytes)
        .serve_connection(TokioIo::new(JsonRefusals::new(io, limits)), service);
    tokio::pin!(connection);
    let lifetime = tokio::time::sleep(limits.max_connection_time);
    tokio::pin!(lifetime);
    let mut stopping = false;
    loop {
        tokio::select! {
            // Ended: closed by the client, answered with `connection: close`, or a
            // timeout or limit hyper enforces. None of these is the agent's error.
            _ = connection.as_mut() => return,
            _ = &mut lifetime => return,
            _ = shutdown.cancelled(), if !stopping => {
                stopping = true;
                connection.as_mut().graceful_shutdown();
            }
        }
    }
}

/// Reads the whole body within the limits, then lets `app` answer.
async fn answer(
    app: Router,
    request: Request<Incoming>,
    limits: Limits,
) -> axum::response::Response {
    let (parts, body) = request.into_parts();
    let body = Limited::new(body, limits.max_body_bytes).collect();
    let bytes = match tokio::time::timeout(limits.request_timeout, body).await {
        Ok(Ok(collected)) => collected.to_bytes(),
        Ok(Err(error)) if error.downcast_ref::<LengthLimitError>().is_some() => {
            return refuse(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("request body over {} bytes", limits.max_body_bytes),
            );
        }
        Ok(Err(error)) => {
            return refuse(
                StatusCode::BAD_REQUEST,
                format!("reading the body: {error}"),
            );
        }
        Err(_) => {
            return refuse(
                StatusCode::REQUEST_TIMEOUT,
                format!(
                    "request body not complete within {:?}",
                    limits.request_timeout
                ),
            );
        }
    };
    let request = Request::from_parts(parts, Body::from(bytes));
    match TowerToHyperService::new(app).call(request).await {
        Ok(response) => response,
        Err(never) => match never {},
    }
}

/// An answer after which the connection is closed: the rest of what the client sent
/// cannot be trusted to be a request.
fn refuse(code: StatusCode, why: String) -> axum::response::Response {
    (
        code,
        [(axum::http::header::CONNECTION, "close")],
        axum::Json(serde_json::json!({ "error": why })),
    )
        .into_response()
}

/// A connection's stream, passed through but for one thing: the answer hyper writes by
/// itself to a request head that does not parse (a 4xx or 5xx head with
/// `content-length: 0` and no content type, which no handler of ours sends) is replaced
/// by the same status with a JSON `{"error": "..."}` body. Hyper closes the connection
/// after it.
struct JsonRefusals<Io> {
    io: Io,
    limits: Limits,
    /// A replacement being written, and how much of it is out.
    replacing: Option<(Vec<u8>, usize)>,
}

impl<Io> JsonRefusals<Io> {
    fn new(io: Io, limits: Limits) -> Self {
        Self {
            io,
            limits,
            replacing: None,
        }
    }
}

/// The JSON answer for hyper's own refusal `head`, if it is one.
fn json_refusal(head: &[u8], limits: Limits) -> Option<Vec<u8>> {
    let text = std::str::from_utf8(head).ok()?;
    let rest = text.strip_prefix("HTTP/1.1 ")?;
    if !text.ends_with("\r\n\r\n") || text[..text.len() - 4].contains("\r\n\r\n") {
        return None;
    }
    let code: u16 = rest.get(..3)?.parse().ok()?;
    let lower = text.to_ascii_lowercase();
    if !(400..600).contains(&code)
        || !lower.contains("\r\ncontent-length: 0\r\n")
        || lower.contains("\r\ncontent-type:")
    {
        return None;
    }
    let status = StatusCode::from_u16(code).ok()?;
    let error = match status {
        StatusCode::BAD_REQUEST => {
            "malformed request: the request line or a header does not parse (such as a \
             Content-Length that is not a number)"
                .to_string()
        }
        StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE => {
            format!("request head over {} bytes", limits.max_head_bytes)
        }
        other => format!(
            "request refused: {}",
            other.canonical_reason().unwrap_or("malformed")
        ),
    };
    let body = serde_json::to_vec(&serde_json::json!({ "error": error })).ok()?;
    let mut out = format!(
        "HTTP/1.1 {} {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
         connection: close\r\n\r\n",
        status.as_u16(),
        status.canonical_reason().unwrap_or(""),
        body.len()
    )
    .into_bytes();
    out.extend(body);
    Some(out)
}

impl<Io: AsyncRead + Unpin> AsyncRead for JsonRefusals<Io> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        std::pin::Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<Io: AsyncWrite + Unpin> AsyncWrite for JsonRefusals<Io> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<io::Result<usize>> {
        use std::task::Poll;
        let this = &mut *self;
        if this.replacing.is_none() {
            match json_refusal(buf, this.limits) {
                Some(answer) => this.replacing = Some((answer, 0)),
                None => return std::pin::Pin::new(&mut this.io).poll_write(cx, buf),
            }
        }
        // Write the replacement whole; hyper is told its own head went out.
        let (answer, sent) = this.replacing.as_mut().expect("set above");
        while *sent < answer.len() {
            match std::pin::Pin::new(&mut this.io).poll_write(cx, &answer[*sent..]) {
                Poll::Ready(Ok(0)) => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                Poll::Ready(Ok(n)) => *sent += n,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            }
        }
        this.replacing = None;
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        std::pin::Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        std::pin::Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// Counts events and says when one may be logged: the first, then one per
/// [`LOG_EVERY`] with the number left unlogged in between.
#[derive(Default)]
struct Throttled {
    last: Option<Instant>,
    unlogged: u64,
}

/// How many events went unlogged before this line.
struct Unlogged(u64);

impl Unlogged {
    fn suffix(&self) -> String {
        match self.0 {
            0 => String::new(),
            n => format!(" ({n} more since the last such line)"),
        }
    }
}

impl Throttled {
    fn note(&mut self) -> Option<Unlogged> {
        if self.last.is_some_and(|at| at.elapsed() < LOG_EVERY) {
            self.unlogged += 1;
            return None;
        }
        self.last = Some(Instant::now());
        Some(Unlogged(std::mem::take(&mut self.unlogged)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::routing::{get, post};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Limits small enough for a test to reach.
    const TEST_LIMITS: Limits = Limits {
        max_connections: 4,
        request_timeout: Duration::from_millis(300),
        max_head_bytes: 8192,
        max_body_bytes: 1024,
        max_connection_time: Duration::from_secs(3),
    };

    async fn server(limits: Limits) -> (std::net::SocketAddr, CancellationToken) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let app = Router::new()
            .route("/", get(|| async { "hello" }))
            .route("/echo", post(|body: String| async move { body }));
        let shutdown = CancellationToken::new();
        tokio::spawn(serve(listener, "test", app, limits, shutdown.clone()));
        (address, shutdown)
    }

    /// Sends `request` and reads until the server closes (or 5 s pass).
    async fn exchange(address: std::net::SocketAddr, request: &[u8]) -> (String, Duration) {
        let started = Instant::now();
        let mut stream = tokio::net::TcpStream::connect(address).await.unwrap();
        stream.write_all(request).await.unwrap();
        let mut answer = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut answer)).await;
        (
            String::from_utf8_lossy(&answer).into_owned(),
            started.elapsed(),
        )
    }

    const GET: &[u8] = b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n";

    #[tokio::test]
    async fn answers_a_complete_request() {
        let (address, _stop) = server(TEST_LIMITS).await;
        let (answer, _) = exchange(address, GET).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(answer.ends_with("hello"), "{answer}");
        let echo =
            b"POST /echo HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: 2\r\n\r\nhi";
        let (answer, _) = exchange(address, echo).await;
        assert!(answer.ends_with("\r\n\r\nhi"), "{answer}");
    }

    #[tokio::test]
    async fn a_partial_head_is_closed_after_the_timeout() {
        let (address, _stop) = server(TEST_LIMITS).await;
        let (answer, took) = exchange(address, b"GET / HTTP/1.1\r\nhost:").await;
        assert!(!answer.contains("200"), "{answer}");
        assert!(
            took >= TEST_LIMITS.request_timeout && took < Duration::from_secs(2),
            "closed after {took:?}"
        );
        // Nothing at all, likewise.
        let (_, took) = exchange(address, b"").await;
        assert!(took < Duration::from_secs(2), "closed after {took:?}");
    }

    #[tokio::test]
    async fn a_body_that_does_not_come_is_answered_408() {
        let (address, _stop) = server(TEST_LIMITS).await;
        let request = b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\npartial";
        let (answer, took) = exchange(address, request).await;
        assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
        assert!(took < Duration::from_secs(2), "closed after {took:?}");
    }

    #[tokio::test]
    async fn large_heads_and_bodies_are_refused() {
        let (address, _stop) = server(TEST_LIMITS).await;
        let body = "x".repeat(TEST_LIMITS.max_body_bytes + 1);
        let request = format!(
            "POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        let (answer, _) = exchange(address, request.as_bytes()).await;
        assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
        assert_eq!(
            json_error(&answer),
            format!("request body over {} bytes", TEST_LIMITS.max_body_bytes)
        );
        let head = format!(
            "GET / HTTP/1.1\r\nhost: x\r\nx-big: {}\r\n\r\n",
            "y".repeat(TEST_LIMITS.max_head_bytes)
        );
        let (answer, _) = exchange(address, head.as_bytes()).await;
        assert!(answer.starts_with("HTTP/1.1 431"), "{answer}");
        assert_eq!(
            json_error(&answer),
            format!("request head over {} bytes", TEST_LIMITS.max_head_bytes)
        );
    }

    /// The JSON error of an answer, which must be `application/json`.
    fn json_error(answer: &str) -> String {
        let (head, body) = answer.split_once("\r\n\r\n").expect("a head");
        assert!(
            head.to_ascii_lowercase()
                .contains("content-type: application/json"),
            "{answer}"
        );
        let json: serde_json::Value =
            serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {answer}"));
        json["error"].as_str().expect("an error string").to_string()
    }

    #[tokio::test]
    async fn heads_that_do_not_parse_are_refused_in_json() {
        let (address, _stop) = server(TEST_LIMITS).await;
        for request in [
            &b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: abc\r\n\r\nhi"[..],
            b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\nhi",
            b"GET / HTTP/1.1\r\nho st: x\r\n\r\n",
        ] {
            let (answer, _) = exchange(address, request).await;
            assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
            assert!(
                json_error(&answer).starts_with("malformed request"),
                "{answer}"
            );
        }
        // A handler's own answers pass untouched, empty ones included.
        let empty =
            b"POST /echo HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: 0\r\n\r\n";
        let (answer, _) = exchange(address, empty).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    }

    #[tokio::test]
    async fn connections_above_the_cap_are_closed_and_the_cap_frees_up() {
        let (address, _stop) = server(TEST_LIMITS).await;
        // Fill the cap with idle connections (each accepted: one byte of a head sent).
        let mut held = Vec::new();
        for _ in 0..TEST_LIMITS.max_connections {
            let mut stream = tokio::net::TcpStream::connect(address).await.unwrap();
            stream.write_all(b"G").await.unwrap();
            held.push(stream);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        let (answer, took) = exchange(address, GET).await;
        assert_eq!(answer, "", "above the cap: closed without an answer");
        assert!(took < TEST_LIMITS.request_timeout, "closed after {took:?}");
        // The held ones time out; then there is room again.
        tokio::time::sleep(TEST_LIMITS.request_timeout * 2).await;
        let (answer, _) = exchange(address, GET).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        drop(held);
    }

    #[tokio::test]
    async fn an_idle_keep_alive_connection_is_closed() {
        let (address, _stop) = server(TEST_LIMITS).await;
        let started = Instant::now();
        let mut stream = tokio::net::TcpStream::connect(address).await.unwrap();
        stream
            .write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        let mut answer = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut answer)).await;
        let answer = String::from_utf8_lossy(&answer);
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        let took = started.elapsed();
        assert!(took < Duration::from_secs(2), "closed after {took:?}");
    }

    #[test]
    fn throttled_logs_the_first_then_counts() {
        let mut throttled = Throttled::default();
        assert_eq!(throttled.note().map(|u| u.0), Some(0));
        assert!(throttled.note().is_none());
        assert!(throttled.note().is_none());
        throttled.last = Some(Instant::now() - LOG_EVERY);
        let unlogged = throttled.note().expect("a line again");
        assert_eq!(unlogged.0, 2);
        assert_eq!(unlogged.suffix(), " (2 more since the last such line)");
    }
}
