//! The CLI side of the control socket: one HTTP/1.1 request per command, JSON bodies.

use std::{path::Path, time::Duration};

use anyhow::{Context, bail};
use http_body_util::{BodyExt, Full};
use hyper::{Method, body::Bytes};
use hyper_util::rt::TokioIo;
use serde::de::DeserializeOwned;
use tokio::net::UnixStream;

use crate::{
    control::api::{BackendRequest, ChangeAnswer, ErrorAnswer, ReloadAnswer},
    explain::{ExplainRequest, Explanation},
    status::Status,
};

/// How long a command waits for the agent's answer. The slowest answers (`/node/drain`
/// waits up to 5 s for the routes, a reload for its table writes) are well within it.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(15);

/// Sends `method path` to the agent and returns the body of a 2xx answer; otherwise
/// the agent's message is the error. Gives up after [`REQUEST_TIMEOUT`].
pub async fn request(
    socket: &Path,
    method: Method,
    path: &str,
    body: Option<Vec<u8>>,
) -> anyhow::Result<Vec<u8>> {
    request_within(socket, method, path, body, REQUEST_TIMEOUT).await
}

async fn request_within(
    socket: &Path,
    method: Method,
    path: &str,
    body: Option<Vec<u8>>,
    timeout: Duration,
) -> anyhow::Result<Vec<u8>> {
    match tokio::time::timeout(timeout, exchange(socket, method, path, body)).await {
        Ok(answer) => answer,
        Err(_) => bail!(
            "the agent at {} did not answer {path} within {}s: it may be stuck or overloaded \
             (its log says more, e.g. `journalctl -u lb`)",
            socket.display(),
            timeout.as_secs_f64()
        ),
    }
}

async fn exchange(
    socket: &Path,
    method: Method,
    path: &str,
    body: Option<Vec<u8>>,
) -> anyhow::Result<Vec<u8>> {
    let stream = UnixStream::connect(socket)
        .await
        .map_err(|error| unreachable(socket, error))?;
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(connection);
    let request = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header(hyper::header::HOST, "lb")
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body.unwrap_or_default())))?;
    let response = sender.send_request(request).await?;
    let code = response.status();
    let body = response.into_body().collect().await?.to_bytes().to_vec();
    if !code.is_success() {
        bail!("{}", refusal_message(&body));
    }
    Ok(body)
}

/// Why the socket could not be reached, in the words an operator needs.
fn unreachable(socket: &Path, error: std::io::Error) -> anyhow::Error {
    let hint = match error.kind() {
        std::io::ErrorKind::PermissionDenied => format!(
            "permission denied: the control socket {} is root's (mode 0600); run this as \
             root (e.g. with sudo). Status, explain and top also answer the members of \
             control.operators_group on the operators' socket (--socket PATH; by default \
             lb-operators.sock beside the control socket)",
            socket.display()
        ),
        _ => format!(
            "cannot reach the agent at {} (is `lb run` running? If its config sets another \
             control.socket, pass --config FILE or --socket PATH)",
            socket.display()
        ),
    };
    anyhow::Error::new(error).context(hint)
}

/// The message of a refused request: the `error` of the agent's JSON answer, else the
/// body as text (an older agent, or not an lb agent).
fn refusal_message(body: &[u8]) -> String {
    match serde_json::from_slice::<ErrorAnswer>(body) {
        Ok(answer) => answer.error,
        Err(_) => String::from_utf8_lossy(body).into_owned(),
    }
}

async fn json<T: DeserializeOwned>(
    socket: &Path,
    method: Method,
    path: &str,
    body: Option<Vec<u8>>,
) -> anyhow::Result<T> {
    let body = request(socket, method, path, body).await?;
    serde_json::from_slice(&body).with_context(|| format!("the agent's answer to {path}"))
}

/// `GET /status`, as sent (JSON text).
pub async fn status_json(socket: &Path) -> anyhow::Result<String> {
    let body = request(socket, Method::GET, "/status", None).await?;
    Ok(String::from_utf8_lossy(&body).into_owned())
}

/// `GET /status`.
pub async fn status(socket: &Path) -> anyhow::Result<Status> {
    json(socket, Method::GET, "/status", None).await
}

/// Whether an agent listens on `socket`: it accepts a connection (one too busy or stuck
/// to answer counts too).
pub async fn agent_listens(socket: &Path) -> bool {
    UnixStream::connect(socket).await.is_ok()
}

/// `POST /reload`: the changes the agent applied.
pub async fn reload(socket: &Path) -> anyhow::Result<ReloadAnswer> {
    json(socket, Method::POST, "/reload", None)
        .await
        .context("reload refused")
}

/// `POST /explain`, as sent (JSON text).
pub async fn explain_json(socket: &Path, request: &ExplainRequest) -> anyhow::Result<String> {
    let body = self::request(
        socket,
        Method::POST,
        "/explain",
        Some(serde_json::to_vec(request)?),
    )
    .await?;
    Ok(String::from_utf8_lossy(&body).into_owned())
}

/// `POST /explain`.
pub async fn explain(socket: &Path, request: &ExplainRequest) -> anyhow::Result<Explanation> {
    json(
        socket,
        Method::POST,
        "/explain",
        Some(serde_json::to_vec(request)?),
    )
    .await
}

/// `POST /backend/state|add|remove` (`path`): what the agent did.
pub async fn change_backend(
    socket: &Path,
    path: &str,
    body: &BackendRequest,
) -> anyhow::Result<ChangeAnswer> {
    json(socket, Method::POST, path, Some(serde_json::to_vec(body)?))
        .await
        .context("refused")
}

/// `POST /node/drain|ready` (`path`): what the agent did.
pub async fn change_node(socket: &Path, path: &str) -> anyhow::Result<ChangeAnswer> {
    json(socket, Method::POST, path, None)
        .await
        .context("refused")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_shows_the_agents_message() {
        assert_eq!(
            refusal_message(br#"{"error": "no VIP 10.0.0.1:80/tcp is configured"}"#),
            "no VIP 10.0.0.1:80/tcp is configured"
        );
        assert_eq!(refusal_message(b"plain text"), "plain text");
    }

    #[test]
    fn permission_denied_says_permission() {
        let socket = Path::new("/run/lb/lb.sock");
        let denied = format!(
            "{:#}",
            unreachable(socket, std::io::ErrorKind::PermissionDenied.into())
        );
        assert!(
            denied.contains("permission denied") && denied.contains("root"),
            "{denied}"
        );
        assert!(!denied.contains("is `lb run` running"), "{denied}");
        let missing = format!(
            "{:#}",
            unreachable(socket, std::io::ErrorKind::NotFound.into())
        );
        assert!(missing.contains("is `lb run` running"), "{missing}");
    }

    #[tokio::test]
    async fn an_agent_that_does_not_answer_times_out_with_a_message() {
        let dir = std::env::temp_dir().join(format!("lb-client-timeout-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("lb.sock");
        let _ = std::fs::remove_file(&path);
        let listener = tokio::net::UnixListener::bind(&path).unwrap();
        // Accepts and holds the connection, never answering.
        let silent = tokio::spawn(async move {
            let mut held = Vec::new();
            loop {
                let (stream, _) = listener.accept().await.unwrap();
                held.push(stream);
            }
        });
        let started = std::time::Instant::now();
        let error = request_within(
            &path,
            Method::GET,
            "/status",
            None,
            Duration::from_millis(200),
        )
        .await
        .unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(5));
        let message = format!("{error:#}");
        assert!(
            message.contains("did not answer /status within 0.2s"),
            "{message}"
        );
        silent.abort();
        let _ = std::fs::remove_dir_all(&dir);
    }
}
