//! The CLI side of the control socket: one HTTP/1.1 request per command, JSON bodies.

use std::path::Path;

use anyhow::{Context, bail};
use http_body_util::{BodyExt, Full};
use hyper::{Method, body::Bytes};
use hyper_util::rt::TokioIo;
use serde::de::DeserializeOwned;
use tokio::net::UnixStream;

use crate::{
    api::{BackendRequest, ChangeAnswer, ReloadAnswer},
    explain::{ExplainRequest, Explanation},
    status::Status,
};

/// Sends `method path` to the agent and returns the body of a 2xx answer; otherwise
/// the agent's message is the error.
pub async fn request(
    socket: &Path,
    method: Method,
    path: &str,
    body: Option<Vec<u8>>,
) -> anyhow::Result<Vec<u8>> {
    let stream = UnixStream::connect(socket).await.with_context(|| {
        format!(
            "cannot reach the agent at {} (is `lb run` running? If its config sets another \
             control.socket, pass --config FILE or --socket PATH)",
            socket.display()
        )
    })?;
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
        bail!("{}", String::from_utf8_lossy(&body));
    }
    Ok(body)
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

/// Whether an agent answers on `socket`.
pub async fn agent_answers(socket: &Path) -> bool {
    request(socket, Method::GET, "/status", None).await.is_ok()
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
