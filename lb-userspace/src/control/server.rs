//! The control socket: HTTP/1.1 with JSON bodies on a Unix socket that only root can
//! open (created 0600). `GET /status` returns `Status`. With `control.operators_group`, a
//! second socket (the operators' socket, 0660 for that group) answers the read-only
//! requests (status, explain, metrics: what `lb status`, `lb explain`, `lb top` and a
//! Prometheus scrape over the socket ask) and
//! refuses every change with a 403. Every change asked for is logged with the asker's
//! uid and pid (SO_PEERCRED). Request bodies are read as JSON
//! whatever their Content-Type (`curl -d` sends a form type); every refusal is a JSON
//! `{"error": "..."}` with its status code: 400 a malformed or invalid request, 404 an
//! unknown VIP, backend or path, 405 a wrong method, 409 a conflict, 422 a refused
//! reload, 500 a failed table write.

use std::{
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
};

use anyhow::{Context, bail};
use axum::{
    Extension, Json, Router,
    body::Bytes,
    extract::{FromRequest, Request, State as Extract},
    http::{Method, StatusCode, Uri},
    middleware::Next,
    response::{IntoResponse, Response},
    routing::{MethodRouter, get, post},
};
use serde::de::DeserializeOwned;
use tokio::net::{UnixListener, UnixStream};

use crate::{
    config::ControlConfig,
    control::api::{BackendRequest, ChangeAnswer, ErrorAnswer, ReloadAnswer},
    explain::{ExplainError, ExplainRequest, Explanation, monotonic_ns},
    health::HealthTasks,
    listen::{LIMITS, Peer},
    snapshot::Published,
    state::{self, ControlError, State},
    status::Status,
    writer::Requested,
};

/// The control socket (and the operators' socket, when configured), bound (0600) before
/// the data path is touched, not yet served: a socket in use stops the start with
/// nothing attached.
pub struct ControlSocket {
    listener: UnixListener,
    path: PathBuf,
    operators: Option<OperatorsSocket>,
}

/// The read-only socket of `control.operators_group`.
struct OperatorsSocket {
    listener: UnixListener,
    path: PathBuf,
    group: String,
    gid: u32,
}

impl ControlSocket {
    pub async fn bind(config: &ControlConfig) -> anyhow::Result<Self> {
        // The operators' first: a parent directory it creates must let them in (0755),
        // where the control socket alone would create it 0700.
        let operators = match (config.operators_socket(), &config.operators_group) {
            (Some(path), Some(group)) => Some(OperatorsSocket::bind(path, group).await?),
            _ => None,
        };
        let listener = match bind(&config.socket, 0o700, 0o600).await {
            Ok(listener) => listener,
            Err(error) => {
                if let Some(operators) = operators {
                    let _ = std::fs::remove_file(&operators.path);
                }
                return Err(error);
            }
        };
        Ok(Self {
            listener,
            path: config.socket.clone(),
            operators,
        })
    }

    /// The start failed before serving: the socket files go with it.
    pub fn abandon(self) {
        let _ = std::fs::remove_file(&self.path);
        if let Some(operators) = self.operators {
            let _ = std::fs::remove_file(&operators.path);
        }
    }
}

impl OperatorsSocket {
    async fn bind(path: PathBuf, group: &str) -> anyhow::Result<Self> {
        let gid = crate::preflight::group_id(group)
            .map_err(|why| anyhow::anyhow!("`control.operators_group`: {why}"))?;
        let listener = bind(&path, 0o755, 0o600).await?;
        // Group-owned and 0660, never wider. Without CAP_CHOWN (the shipped unit bounds it
        // away) the agent, as the file's owner, may still give it to a group it is a
        // member of: the unit's `SupplementaryGroups=lb`.
        if let Err(why) = give_to_group(&path, group, gid) {
            let _ = std::fs::remove_file(&path);
            return Err(why);
        }
        if let Some(parent) = path.parent()
            && let Ok(meta) = std::fs::metadata(parent)
            && meta.permissions().mode() & 0o011 == 0
        {
            tracing::warn!(
                "operators' socket {}: its directory {} is mode {:o}: group {group} cannot \
                 reach it (chmod 0755 {})",
                path.display(),
                parent.display(),
                meta.permissions().mode() & 0o7777,
                parent.display()
            );
        }
        Ok(Self {
            listener,
            path,
            group: group.to_owned(),
            gid,
        })
    }
}

/// Gives the socket at `path` to group `gid` and makes it 0660, or says why it cannot
/// (the socket is then not served: a mode open to all is not a fallback).
fn give_to_group(path: &Path, group: &str, gid: u32) -> anyhow::Result<()> {
    if let Err(errno) = nix::unistd::chown(path, None, Some(nix::unistd::Gid::from_raw(gid))) {
        bail!(
            "`control.operators_group`: cannot give the operators' socket {} to group \
             {group} ({errno}): the agent needs CAP_CHOWN or to be a member of {group} \
             (the shipped unit has SupplementaryGroups=lb; for another group, add it in a \
             drop-in: systemctl edit lb)",
            path.display()
        );
    }
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))
        .with_context(|| format!("operators' socket {}: chmod 0660", path.display()))
}

/// The requests that change something, and what answers them on the control socket.
fn changes() -> [(&'static str, MethodRouter<Api>); 6] {
    [
        ("/reload", post(reload)),
        ("/backend/state", post(backend_state)),
        ("/backend/add", post(backend_add)),
        ("/backend/remove", post(backend_remove)),
        ("/node/drain", post(node_drain)),
        ("/node/ready", post(node_ready)),
    ]
}

/// The read-only requests, which both sockets answer.
fn reads() -> Router<Api> {
    Router::new()
        .route("/status", get(status))
        .route("/explain", post(explain))
        .route("/metrics", get(metrics))
        .fallback(unknown_path)
        .method_not_allowed_fallback(wrong_method)
}

pub fn serve(
    socket: ControlSocket,
    shared: Arc<Mutex<State>>,
    health_tasks: HealthTasks,
) -> tokio::task::JoinHandle<()> {
    let ControlSocket {
        listener,
        path,
        operators,
    } = socket;
    let shutdown = health_tasks.shutdown.clone();
    let published = shared.lock().expect("agent state poisoned").published();
    let api = Api {
        shared,
        published,
        health_tasks,
    };
    let app = changes()
        .into_iter()
        .fold(reads(), |app, (route, handler)| app.route(route, handler))
        .with_state(api.clone());
    if let Some(operators) = operators {
        let OperatorsSocket {
            listener,
            path,
            group,
            gid,
        } = operators;
        let app = changes()
            .into_iter()
            .fold(reads(), |app, (route, _)| app.route(route, post(read_only)))
            .layer(axum::middleware::from_fn_with_state(
                (gid, group),
                operators_only,
            ))
            .with_state(api);
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            crate::listen::serve(listener, "operators' socket", app, LIMITS, shutdown).await;
            let _ = std::fs::remove_file(&path);
        });
    }
    tokio::spawn(async move {
        crate::listen::serve(listener, "control socket", app, LIMITS, shutdown).await;
        let _ = std::fs::remove_file(&path);
    })
}

/// The operators' socket lets in root and the members of its group (by the peer's
/// credentials, whatever the file's mode).
async fn operators_only(
    Extract((gid, group)): Extract<(u32, String)>,
    peer: Option<Extension<Peer>>,
    request: Request,
    next: Next,
) -> Response {
    match peer {
        Some(Extension(peer)) if peer.uid == 0 || peer.in_group(gid) => next.run(request).await,
        Some(Extension(peer)) => refusal(
            StatusCode::FORBIDDEN,
            format!(
                "{peer} is not in group {group} (control.operators_group): the operators' \
                 socket answers its members only"
            ),
        )
        .into_response(),
        None => {
            refusal(StatusCode::FORBIDDEN, "the peer's credentials are unknown").into_response()
        }
    }
}

/// A change asked of the operators' socket.
async fn read_only(uri: Uri, peer: Option<Extension<Peer>>) -> Refusal {
    let who = peer.map(|Extension(p)| p.to_string()).unwrap_or_default();
    tracing::info!("operators' socket: refused {uri} to {who}: read-only");
    refusal(
        StatusCode::FORBIDDEN,
        format!(
            "POST {uri}: the operators' socket is read-only (status, explain, top, metrics); changes \
             go through the control socket, as root"
        ),
    )
}

/// Binds a Unix socket at `path` with `mode` (its parent created with `parent_mode` if
/// missing). A stale socket file is replaced; one in use is an error.
async fn bind(path: &Path, parent_mode: u32, mode: u32) -> anyhow::Result<UnixListener> {
    if let Some(parent) = path.parent()
        && !parent.exists()
    {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("creating {}", parent.display()))?;
        std::fs::set_permissions(parent, std::fs::Permissions::from_mode(parent_mode))?;
    }
    if path.exists() {
        if UnixStream::connect(path).await.is_ok() {
            bail!("{} is in use: is another agent running?", path.display());
        }
        std::fs::remove_file(path).with_context(|| format!("removing stale {}", path.display()))?;
    }
    // No window in which the socket is reachable by others: umask before bind, chmod after.
    let old_mask = nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o177));
    let bound = UnixListener::bind(path);
    nix::sys::stat::umask(old_mask);
    let listener = bound.with_context(|| format!("binding {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))?;
    Ok(listener)
}

/// What the handlers share: the agent's state, which changes take the lock of, and its
/// published snapshot, which reads load without it.
#[derive(Clone)]
struct Api {
    shared: Arc<Mutex<State>>,
    published: Published,
    health_tasks: HealthTasks,
}

/// An answer refused with a status code and the reason, as `{"error": "..."}`.
type Refusal = (StatusCode, Json<ErrorAnswer>);

fn refusal(code: StatusCode, error: impl Into<String>) -> Refusal {
    (
        code,
        Json(ErrorAnswer {
            error: error.into(),
        }),
    )
}

/// A JSON request body, read whatever the Content-Type header says (or without one). A
/// body that is not JSON, or not of the request's type, is a 400.
struct Body<T>(T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for Body<T> {
    type Rejection = Refusal;

    async fn from_request(request: Request, state: &S) -> Result<Self, Refusal> {
        let bytes = Bytes::from_request(request, state)
            .await
            .map_err(|e| refusal(StatusCode::BAD_REQUEST, e.body_text()))?;
        serde_json::from_slice(&bytes).map(Body).map_err(|e| {
            refusal(
                StatusCode::BAD_REQUEST,
                format!("invalid request body: {e}"),
            )
        })
    }
}

async fn unknown_path(method: Method, uri: Uri) -> Refusal {
    refusal(
        StatusCode::NOT_FOUND,
        format!(
            "no such request: {method} {uri} (see the control socket table in docs/src/commands.md)"
        ),
    )
}

async fn wrong_method(method: Method, uri: Uri) -> Refusal {
    refusal(
        StatusCode::METHOD_NOT_ALLOWED,
        format!("{uri} does not take {method} (GET /status; the rest are POST)"),
    )
}

/// Waits for the table write a command asked for: the command answers once the data
/// path follows it.
async fn written(requested: Requested) -> Result<(), Refusal> {
    requested.done().await.map_err(|error| {
        refusal(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("applied, but writing the tables failed: {error}"),
        )
    })
}

/// Who asked, for the log: "uid 0 (pid 4242)".
fn asker(peer: &Option<Extension<Peer>>) -> String {
    match peer {
        Some(Extension(peer)) => peer.to_string(),
        None => "an unknown peer".into(),
    }
}

async fn reload(
    Extract(api): Extract<Api>,
    peer: Option<Extension<Peer>>,
) -> Result<Json<ReloadAnswer>, Refusal> {
    tracing::info!("reload asked by {}", asker(&peer));
    let (changes, requested) = state::reload(&api.shared, &api.health_tasks).map_err(|e| {
        let message = format!("{:#}", anyhow::Error::from(e));
        refusal(StatusCode::UNPROCESSABLE_ENTITY, message)
    })?;
    written(requested).await?;
    Ok(Json(ReloadAnswer { changes }))
}

fn refused(error: ControlError) -> Refusal {
    let code = match error {
        ControlError::UnknownVip(..) | ControlError::UnknownBackend(..) => StatusCode::NOT_FOUND,
        ControlError::BackendExists(..) => StatusCode::CONFLICT,
        ControlError::Invalid(_) | ControlError::BadWeight(_) | ControlError::Model(_) => {
            StatusCode::BAD_REQUEST
        }
    };
    refusal(code, format!("{:#}", anyhow::Error::from(error)))
}

async fn backend_state(
    Extract(api): Extract<Api>,
    peer: Option<Extension<Peer>>,
    Body(request): Body<BackendRequest>,
) -> Result<Json<ChangeAnswer>, Refusal> {
    let state = request.state.ok_or(refusal(
        StatusCode::BAD_REQUEST,
        "missing \"state\": \"ready\", \"drain\" or \"maint\"",
    ))?;
    api.change(&peer, |shared| {
        shared.set_admin_state(&request.vip, request.backend, state)
    })
    .await
}

async fn backend_add(
    Extract(api): Extract<Api>,
    peer: Option<Extension<Peer>>,
    Body(request): Body<BackendRequest>,
) -> Result<Json<ChangeAnswer>, Refusal> {
    let weight = request.weight.unwrap_or(1);
    api.change(&peer, |shared| {
        shared.add_backend(&request.vip, request.backend, weight)
    })
    .await
}

async fn backend_remove(
    Extract(api): Extract<Api>,
    peer: Option<Extension<Peer>>,
    Body(request): Body<BackendRequest>,
) -> Result<Json<ChangeAnswer>, Refusal> {
    api.change(&peer, |shared| {
        shared.remove_backend(&request.vip, request.backend)
    })
    .await
}

impl Api {
    /// Applies a runtime change under the lock, starts checks for backends that became
    /// checked (added, or back from maintenance), and answers once the tables follow.
    /// The change, or its refusal, is logged with who asked.
    async fn change(
        &self,
        peer: &Option<Extension<Peer>>,
        apply: impl FnOnce(&mut State) -> Result<String, ControlError>,
    ) -> Result<Json<ChangeAnswer>, Refusal> {
        let (change, requested, save) = {
            let mut shared = self.shared.lock().expect("agent state poisoned");
            let change = apply(&mut shared).map_err(|error| {
                tracing::info!("runtime change refused to {}: {error}", asker(peer));
                refused(error)
            })?;
            tracing::info!("runtime change by {}: {change}", asker(peer));
            (change, shared.requested(), shared.state_file_write())
        };
        // The state file is written once the lock is let go, and before the answer.
        if let Some(save) = save {
            save.write();
        }
        state::spawn_checks(&self.shared, &self.health_tasks);
        written(requested).await?;
        Ok(Json(ChangeAnswer { change }))
    }
}

/// How long `/node/drain` and `/node/ready` wait for the routes to follow.
const NODE_CHANGE_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// `POST /node/drain`: withdraw every VIP (the data path keeps forwarding what still
/// arrives); answers once the routes are gone.
async fn node_drain(
    Extract(api): Extract<Api>,
    peer: Option<Extension<Peer>>,
) -> Result<Json<ChangeAnswer>, Refusal> {
    tracing::info!("node drain asked by {}", asker(&peer));
    crate::announce::set_drained(&api.shared, true, NODE_CHANGE_WAIT)
        .await
        .map(|change| Json(ChangeAnswer { change }))
        .map_err(|e| refusal(StatusCode::CONFLICT, e.to_string()))
}

/// `POST /node/ready`: undoes `/node/drain`.
async fn node_ready(
    Extract(api): Extract<Api>,
    peer: Option<Extension<Peer>>,
) -> Result<Json<ChangeAnswer>, Refusal> {
    tracing::info!("node ready asked by {}", asker(&peer));
    crate::announce::set_drained(&api.shared, false, NODE_CHANGE_WAIT)
        .await
        .map(|change| Json(ChangeAnswer { change }))
        .map_err(|e| refusal(StatusCode::CONFLICT, e.to_string()))
}

async fn explain(
    Extract(Api { published, .. }): Extract<Api>,
    Body(request): Body<ExplainRequest>,
) -> Result<Json<Explanation>, Refusal> {
    published
        .load()
        .explain(&request, monotonic_ns())
        .map(Json)
        .map_err(|e| {
            let code = match e {
                ExplainError::UnknownVip(_) => StatusCode::NOT_FOUND,
                ExplainError::FamilyMismatch { .. } | ExplainError::BadCid(_) => {
                    StatusCode::BAD_REQUEST
                }
                ExplainError::Dataplane(_) => StatusCode::INTERNAL_SERVER_ERROR,
            };
            refusal(code, format!("{:#}", anyhow::Error::from(e)))
        })
}

/// How many pending table writes `/status` waits for before answering anyway.
const STATUS_WAITS: usize = 10;

/// `GET /status`, once the tables the model asks for are written: a backend shown down
/// holds no slots any more (the writer takes milliseconds after a health change).
/// `GET /metrics`, as the metrics endpoint answers it: for the operators' group where
/// `control.metrics` is off or its port is out of their reach.
async fn metrics(
    Extract(Api { published, .. }): Extract<Api>,
    headers: axum::http::HeaderMap,
) -> Response {
    crate::metrics::metrics(Extract(crate::snapshot::scraper(published)), headers)
        .await
        .into_response()
}

async fn status(Extract(Api { published, .. }): Extract<Api>) -> Result<Json<Status>, Refusal> {
    for _ in 0..STATUS_WAITS {
        let snapshot = published.load();
        if snapshot.tables_are_current() {
            break;
        }
        // A failed write is reported where it was asked for; status shows what is.
        let _ = snapshot.tables_written().done().await;
    }
    // The published snapshot, loaded without the agent's lock; the counters are read
    // through the writer's read side.
    published
        .load()
        .status()
        .map(Json)
        .map_err(|e| refusal(StatusCode::INTERNAL_SERVER_ERROR, format!("{e:#}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::test_support::{config, shared};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// One request over the socket, as curl would send it: `content_type` as given (or
    /// none). Returns the status code and the body, parsed as JSON.
    async fn send(
        socket: &Path,
        method: &str,
        path: &str,
        content_type: Option<&str>,
        body: &str,
    ) -> (u16, serde_json::Value) {
        let (code, body) = send_raw(socket, method, path, content_type, body).await;
        let json = serde_json::from_str(&body)
            .unwrap_or_else(|e| panic!("{method} {path}: not JSON ({e}): {code} {body}"));
        (code, json)
    }

    /// The status code and the body of the answer.
    async fn send_raw(
        socket: &Path,
        method: &str,
        path: &str,
        content_type: Option<&str>,
        body: &str,
    ) -> (u16, String) {
        let mut stream = UnixStream::connect(socket).await.unwrap();
        let content_type = content_type
            .map(|t| format!("Content-Type: {t}\r\n"))
            .unwrap_or_default();
        let request = format!(
            "{method} {path} HTTP/1.1\r\nHost: lb\r\n{content_type}Content-Length: {}\r\n\
             Connection: close\r\n\r\n{body}",
            body.len()
        );
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).await.unwrap();
        let (head, body) = response.split_once("\r\n\r\n").unwrap();
        let code = head.split(' ').nth(1).unwrap().parse().unwrap();
        (code, body.to_string())
    }

    /// An agent's control socket over an in-memory data path, in a fresh directory.
    async fn agent(name: &str) -> (PathBuf, CancellationGuard) {
        agent_with(name, None).await
    }

    /// [`agent`], with an operators' socket (`lb-operators.sock` beside the control
    /// socket) for `operators_group`.
    async fn agent_with(name: &str, operators_group: Option<&str>) -> (PathBuf, CancellationGuard) {
        let dir = std::env::temp_dir().join(format!("lb-control-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let socket = dir.join("lb.sock");
        let state = Arc::new(Mutex::new(shared(config("eth0", &["10.0.0.11"]))));
        let tasks = HealthTasks::new(tokio_util::sync::CancellationToken::new());
        let bound = ControlSocket::bind(&ControlConfig {
            socket: socket.clone(),
            operators_group: operators_group.map(String::from),
            ..ControlConfig::default()
        })
        .await
        .unwrap();
        serve(bound, state, tasks.clone());
        (socket, CancellationGuard(tasks.shutdown, dir))
    }

    /// Stops the server and removes its directory.
    struct CancellationGuard(tokio_util::sync::CancellationToken, PathBuf);

    impl Drop for CancellationGuard {
        fn drop(&mut self) {
            self.0.cancel();
            let _ = std::fs::remove_dir_all(&self.1);
        }
    }

    const DRAIN: &str = r#"{"vip": "10.0.0.100:80/tcp", "backend": "10.0.0.11", "state": "drain"}"#;

    /// Issue 34: the reads (status, explain, metrics) load the published snapshot, so
    /// they answer while a writer holds the agent's lock (a reload, a health result).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn reads_answer_while_the_agents_lock_is_held() {
        let dir = std::env::temp_dir().join(format!("lb-control-held-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let socket = dir.join("lb.sock");
        let state = Arc::new(Mutex::new(shared(config("eth0", &["10.0.0.11"]))));
        let tasks = HealthTasks::new(tokio_util::sync::CancellationToken::new());
        let config = ControlConfig {
            socket: socket.clone(),
            ..ControlConfig::default()
        };
        serve(
            ControlSocket::bind(&config).await.unwrap(),
            state.clone(),
            tasks.clone(),
        );
        let _agent = CancellationGuard(tasks.shutdown, dir);
        let held = state.lock().unwrap();
        let explain = r#"{"vip": "10.0.0.100:80/tcp", "source": "10.0.0.1:1234"}"#;
        // The client on a thread of its own: the server's workers stay free to answer.
        let (answer, answered) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let client = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            let _ = answer.send(client.block_on(async {
                let status = send(&socket, "GET", "/status", None, "").await;
                let explained = send(&socket, "POST", "/explain", None, explain).await;
                let metrics = send_raw(&socket, "GET", "/metrics", None, "").await;
                (status, explained, metrics)
            }));
        });
        // Not a timing assertion: a read that waited for the lock would not answer at
        // all while it is held; the bound only keeps a failure from hanging.
        let answered = answered.recv_timeout(std::time::Duration::from_secs(60));
        drop(held);
        let ((code, status), (explained, why), (scraped, text)) =
            answered.expect("a read waited for the agent's lock");
        assert_eq!(code, 200, "{status}");
        assert_eq!(status["vips"][0]["backends"][0]["address"], "10.0.0.11");
        assert_eq!(explained, 200, "{why}");
        assert_eq!(scraped, 200, "{text}");
        assert!(text.contains("lb_build_info"), "{text}");
    }

    #[tokio::test]
    async fn json_bodies_need_no_content_type_and_errors_are_json() {
        let (socket, _agent) = agent("json").await;
        // `curl -d` sends a form type; a script may send none.
        for content_type in [Some("application/x-www-form-urlencoded"), None] {
            let (code, answer) = send(&socket, "POST", "/backend/state", content_type, DRAIN).await;
            assert_eq!(code, 200, "{content_type:?}: {answer}");
            assert_eq!(
                answer["change"], "10.0.0.100:80/tcp backend 10.0.0.11 -> drain",
                "{answer}"
            );
        }
        let refused = [
            // Of the wrong type: a 400, as the README says (axum's Json says 422).
            (
                r#"{"vip": "10.0.0.100:80/tcp", "backend": "10.0.0.11", "state": "sideways"}"#,
                400,
                "unknown variant `sideways`",
            ),
            (
                r#"{"vip": "10.0.0.100:80/tcp", "#,
                400,
                "invalid request body",
            ),
            (
                r#"{"vip": "10.0.0.100:80/tcp", "backend": "10.0.0.11"}"#,
                400,
                "missing \"state\"",
            ),
            (
                r#"{"vip": "10.0.0.100:81/tcp", "backend": "10.0.0.11", "state": "drain"}"#,
                404,
                "no VIP 10.0.0.100:81/tcp is configured",
            ),
        ];
        for (body, want, says) in refused {
            let (code, answer) = send(&socket, "POST", "/backend/state", None, body).await;
            assert_eq!(code, want, "{body}: {answer}");
            let error = answer["error"].as_str().expect("an error string");
            assert!(error.contains(says), "{body}: {error}");
        }
        let (code, answer) = send(
            &socket,
            "POST",
            "/backend/add",
            None,
            r#"{"vip": "10.0.0.100:80/tcp", "backend": "10.0.0.11", "weight": 2}"#,
        )
        .await;
        assert_eq!((code, answer["error"].is_string()), (409, true), "{answer}");
        let (code, answer) = send(&socket, "GET", "/nothing", None, "").await;
        assert_eq!(code, 404, "{answer}");
        assert!(answer["error"].as_str().unwrap().contains("GET /nothing"));
        let (code, answer) = send(&socket, "GET", "/reload", None, "").await;
        assert_eq!(code, 405, "{answer}");
        assert!(answer["error"].is_string());

        // The CLI prints the agent's message, not the JSON around it.
        let request: BackendRequest = serde_json::from_str(
            r#"{"vip": "10.0.0.100:81/tcp", "backend": "10.0.0.11", "state": "drain"}"#,
        )
        .unwrap();
        let error = crate::control::client::change_backend(&socket, "/backend/state", &request)
            .await
            .unwrap_err();
        assert_eq!(
            format!("{error:#}"),
            "refused: no VIP 10.0.0.100:81/tcp is configured"
        );
    }

    /// The operators' socket answers the reads and refuses every change with a 403 (the
    /// test runs as root, whom it admits; other users are the root test's).
    #[tokio::test]
    async fn the_operators_socket_reads_and_refuses_changes() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("SKIPPED: the operators' socket is given to group root: needs root");
            return;
        }
        let (socket, _agent) = agent_with("operators", Some("root")).await;
        let operators = socket.with_file_name("lb-operators.sock");
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(&operators).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o660);
        let (code, answer) = send(&operators, "GET", "/status", None, "").await;
        assert_eq!(code, 200, "{answer}");
        assert!(answer["vips"].is_array(), "{answer}");
        let explain = r#"{"vip": "10.0.0.100:80/tcp", "source": "10.9.0.1:4000"}"#;
        let (code, answer) = send(&operators, "POST", "/explain", None, explain).await;
        assert_eq!(code, 200, "{answer}");
        let (code, metrics) = send_raw(&operators, "GET", "/metrics", None, "").await;
        assert_eq!(code, 200, "{metrics}");
        assert!(metrics.contains("\nlb_build_info{"), "{metrics}");
        for path in [
            "/reload",
            "/backend/state",
            "/backend/add",
            "/backend/remove",
            "/node/drain",
            "/node/ready",
        ] {
            let (code, answer) = send(&operators, "POST", path, None, DRAIN).await;
            assert_eq!(code, 403, "{path}: {answer}");
            let error = answer["error"].as_str().unwrap();
            assert!(
                error.contains("the operators' socket is read-only"),
                "{error}"
            );
        }
        let (code, _) = send(&operators, "GET", "/nothing", None, "").await;
        assert_eq!(code, 404);
        // The control socket still takes the change.
        let (code, answer) = send(&socket, "POST", "/backend/state", None, DRAIN).await;
        assert_eq!(code, 200, "{answer}");
    }

    #[test]
    fn peers_are_admitted_by_uid_0_or_their_groups() {
        let peer = Peer {
            uid: 1000,
            gid: 1000,
            pid: Some(7),
            groups: vec![27, 999],
        };
        assert!(peer.in_group(1000) && peer.in_group(999) && !peer.in_group(0));
        assert_eq!(peer.to_string(), "uid 1000 (pid 7)");
    }

    /// The requests the README's control socket table lists are the ones served.
    #[tokio::test]
    async fn the_readme_lists_every_request_served() {
        let readme = include_str!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../docs/src/commands.md"
        ));
        let section = readme
            .split("\n## Control socket")
            .nth(1)
            .and_then(|rest| rest.split("\n## ").next())
            .expect("a Control socket section");
        let listed: std::collections::BTreeSet<&str> = section
            .lines()
            .filter(|l| l.starts_with("| `"))
            .flat_map(|l| l.split('`').skip(1).step_by(2))
            .filter(|span| span.starts_with("GET /") || span.starts_with("POST /"))
            .collect();
        // What `serve` routes.
        let served: std::collections::BTreeSet<&str> = [
            "GET /status",
            "GET /metrics",
            "POST /reload",
            "POST /explain",
            "POST /backend/state",
            "POST /backend/add",
            "POST /backend/remove",
            "POST /node/drain",
            "POST /node/ready",
        ]
        .into();
        assert_eq!(listed, served, "the README's control socket table");
        let (socket, _agent) = agent("readme").await;
        for request in served {
            let (method, path) = request.split_once(' ').unwrap();
            let (code, answer) = send_raw(&socket, method, path, None, "").await;
            assert!(
                ![404, 405].contains(&code) || answer.contains("VIP"),
                "{request}: {code} {answer}"
            );
        }
    }
}
