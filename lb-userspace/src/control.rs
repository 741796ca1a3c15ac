//! The control socket: HTTP/1.1 with JSON bodies on a Unix socket that only root can
//! open (created 0600). `GET /status` returns `Status`. Request bodies are read as JSON
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
    Json, Router,
    body::Bytes,
    extract::{FromRequest, Request, State as Extract},
    http::{Method, StatusCode, Uri},
    routing::{get, post},
};
use serde::de::DeserializeOwned;
use tokio::net::{UnixListener, UnixStream};

use crate::{
    api::{BackendRequest, ChangeAnswer, ErrorAnswer, ReloadAnswer},
    explain::{ExplainError, ExplainRequest, Explanation, monotonic_ns},
    health::HealthTasks,
    listen::LIMITS,
    state::{self, ControlError, State},
    status::Status,
    writer::Requested,
};

/// Binds the socket (0600, parent created 0700 if missing) and serves until `shutdown`,
/// within the listener limits of `listen`.
/// The control socket, bound (0600) before the data path is touched, not yet served: a
/// socket in use stops the start with nothing attached.
pub struct ControlSocket {
    listener: UnixListener,
    path: PathBuf,
}

impl ControlSocket {
    pub async fn bind(path: PathBuf) -> anyhow::Result<Self> {
        let listener = bind(&path).await?;
        Ok(Self { listener, path })
    }

    /// The start failed before serving: the socket file goes with it.
    pub fn abandon(self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

pub fn serve(
    socket: ControlSocket,
    shared: Arc<Mutex<State>>,
    health_tasks: HealthTasks,
) -> tokio::task::JoinHandle<()> {
    let ControlSocket { listener, path } = socket;
    let shutdown = health_tasks.shutdown.clone();
    let app = Router::new()
        .route("/status", get(status))
        .route("/reload", post(reload))
        .route("/explain", post(explain))
        .route("/backend/state", post(backend_state))
        .route("/backend/add", post(backend_add))
        .route("/backend/remove", post(backend_remove))
        .route("/node/drain", post(node_drain))
        .route("/node/ready", post(node_ready))
        .fallback(unknown_path)
        .method_not_allowed_fallback(wrong_method)
        .with_state(Api {
            shared,
            health_tasks,
        });
    tokio::spawn(async move {
        crate::listen::serve(listener, "control socket", app, LIMITS, shutdown).await;
        let _ = std::fs::remove_file(&path);
    })
}

async fn bind(path: &Path) -> anyhow::Result<UnixListener> {
    if let Some(parent) = path.parent()
        && !parent.exists()
    {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("creating {}", parent.display()))?;
        std::fs::set_permissions(parent, std::fs::Permissions::from_mode(0o700))?;
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
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(listener)
}

/// What the handlers share.
#[derive(Clone)]
struct Api {
    shared: Arc<Mutex<State>>,
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

async fn reload(Extract(api): Extract<Api>) -> Result<Json<ReloadAnswer>, Refusal> {
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
    Body(request): Body<BackendRequest>,
) -> Result<Json<ChangeAnswer>, Refusal> {
    let state = request.state.ok_or(refusal(
        StatusCode::BAD_REQUEST,
        "missing \"state\": \"ready\", \"drain\" or \"maint\"",
    ))?;
    api.change(|shared| shared.set_admin_state(&request.vip, request.backend, state))
        .await
}

async fn backend_add(
    Extract(api): Extract<Api>,
    Body(request): Body<BackendRequest>,
) -> Result<Json<ChangeAnswer>, Refusal> {
    let weight = request.weight.unwrap_or(1);
    api.change(|shared| shared.add_backend(&request.vip, request.backend, weight))
        .await
}

async fn backend_remove(
    Extract(api): Extract<Api>,
    Body(request): Body<BackendRequest>,
) -> Result<Json<ChangeAnswer>, Refusal> {
    api.change(|shared| shared.remove_backend(&request.vip, request.backend))
        .await
}

impl Api {
    /// Applies a runtime change under the lock, starts checks for backends that became
    /// checked (added, or back from maintenance), and answers once the tables follow.
    async fn change(
        &self,
        apply: impl FnOnce(&mut State) -> Result<String, ControlError>,
    ) -> Result<Json<ChangeAnswer>, Refusal> {
        let (change, requested) = {
            let mut shared = self.shared.lock().expect("agent state poisoned");
            let change = apply(&mut shared).map_err(refused)?;
            (change, shared.requested())
        };
        state::spawn_checks(&self.shared, &self.health_tasks);
        written(requested).await?;
        Ok(Json(ChangeAnswer { change }))
    }
}

/// How long `/node/drain` and `/node/ready` wait for the routes to follow.
const NODE_CHANGE_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// `POST /node/drain`: withdraw every VIP (the data path keeps forwarding what still
/// arrives); answers once the routes are gone.
async fn node_drain(Extract(api): Extract<Api>) -> Result<Json<ChangeAnswer>, Refusal> {
    crate::announce::set_drained(&api.shared, true, NODE_CHANGE_WAIT)
        .await
        .map(|change| Json(ChangeAnswer { change }))
        .map_err(|e| refusal(StatusCode::CONFLICT, e))
}

/// `POST /node/ready`: undoes `/node/drain`.
async fn node_ready(Extract(api): Extract<Api>) -> Result<Json<ChangeAnswer>, Refusal> {
    crate::announce::set_drained(&api.shared, false, NODE_CHANGE_WAIT)
        .await
        .map(|change| Json(ChangeAnswer { change }))
        .map_err(|e| refusal(StatusCode::CONFLICT, e))
}

async fn explain(
    Extract(Api { shared, .. }): Extract<Api>,
    Body(request): Body<ExplainRequest>,
) -> Result<Json<Explanation>, Refusal> {
    let shared = shared.lock().expect("agent state poisoned");
    shared
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
async fn status(Extract(Api { shared, .. }): Extract<Api>) -> Result<Json<Status>, Refusal> {
    for _ in 0..STATUS_WAITS {
        let pending = {
            let shared = shared.lock().expect("agent state poisoned");
            if shared.tables_are_current() {
                break;
            }
            shared.requested()
        };
        // A failed write is reported where it was asked for; status shows what is.
        let _ = pending.done().await;
    }
    // Copied under the lock; the counters are read after it.
    let source = shared.lock().expect("agent state poisoned").status_source();
    source
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
        let json = serde_json::from_str(body)
            .unwrap_or_else(|e| panic!("{method} {path}: not JSON ({e}): {response}"));
        (code, json)
    }

    /// An agent's control socket over an in-memory data path, in a fresh directory.
    async fn agent(name: &str) -> (PathBuf, CancellationGuard) {
        let dir = std::env::temp_dir().join(format!("lb-control-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let socket = dir.join("lb.sock");
        let state = Arc::new(Mutex::new(shared(config("eth0", &["10.0.0.11"]))));
        let tasks = HealthTasks::new(tokio_util::sync::CancellationToken::new());
        let bound = ControlSocket::bind(socket.clone()).await.unwrap();
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
        let error = crate::client::change_backend(&socket, "/backend/state", &request)
            .await
            .unwrap_err();
        assert_eq!(
            format!("{error:#}"),
            "refused: no VIP 10.0.0.100:81/tcp is configured"
        );
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
            let (code, answer) = send(&socket, method, path, None, "").await;
            assert!(
                ![404, 405].contains(&code) || answer["error"].as_str().unwrap().contains("VIP"),
                "{request}: {code} {answer}"
            );
        }
    }
}
