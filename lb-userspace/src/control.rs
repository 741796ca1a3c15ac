//! The control socket: HTTP/1.1 with JSON bodies on a Unix socket that only root can
//! open (created 0600). `GET /status` returns `Status`.

use std::{
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
};

use anyhow::{Context, bail};
use axum::{
    Json, Router,
    extract::State as Extract,
    http::StatusCode,
    routing::{get, post},
};
use tokio::net::{UnixListener, UnixStream};

use crate::{
    api::{BackendRequest, ChangeAnswer, ReloadAnswer},
    explain::{ExplainRequest, Explanation, monotonic_ns},
    health::HealthTasks,
    listen::LIMITS,
    state::{self, ControlError, State},
    status::Status,
    writer::Requested,
};

/// Binds the socket (0600, parent created 0700 if missing) and serves until `shutdown`,
/// within the listener limits of `listen`.
pub async fn serve(
    path: PathBuf,
    shared: Arc<Mutex<State>>,
    health_tasks: HealthTasks,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let listener = bind(&path).await?;
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
        .with_state(Api {
            shared,
            health_tasks,
        });
    Ok(tokio::spawn(async move {
        crate::listen::serve(listener, "control socket", app, LIMITS, shutdown).await;
        let _ = std::fs::remove_file(&path);
    }))
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

/// An answer refused with a status code and the reason.
type Refusal = (StatusCode, String);

/// Waits for the table write a command asked for: the command answers once the data
/// path follows it.
async fn written(requested: Requested) -> Result<(), Refusal> {
    requested.done().await.map_err(|error| {
        (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("applied, but writing the tables failed: {error}"),
        )
    })
}

async fn reload(Extract(api): Extract<Api>) -> Result<Json<ReloadAnswer>, Refusal> {
    let (changes, requested) = state::reload(&api.shared, &api.health_tasks).map_err(|e| {
        let message = format!("{:#}", anyhow::Error::from(e));
        (StatusCode::UNPROCESSABLE_ENTITY, message)
    })?;
    written(requested).await?;
    Ok(Json(ReloadAnswer { changes }))
}

fn refused(error: ControlError) -> Refusal {
    let code = match error {
        ControlError::UnknownVip(..) | ControlError::UnknownBackend(..) => StatusCode::NOT_FOUND,
        ControlError::BackendExists(..) => StatusCode::CONFLICT,
        ControlError::Invalid(_) | ControlError::Model(_) => StatusCode::BAD_REQUEST,
    };
    (code, format!("{:#}", anyhow::Error::from(error)))
}

async fn backend_state(
    Extract(api): Extract<Api>,
    Json(request): Json<BackendRequest>,
) -> Result<Json<ChangeAnswer>, Refusal> {
    let state = request
        .state
        .ok_or((StatusCode::BAD_REQUEST, "missing \"state\"".to_string()))?;
    api.change(|shared| shared.set_admin_state(&request.vip, request.backend, state))
        .await
}

async fn backend_add(
    Extract(api): Extract<Api>,
    Json(request): Json<BackendRequest>,
) -> Result<Json<ChangeAnswer>, Refusal> {
    let weight = request.weight.unwrap_or(1);
    api.change(|shared| shared.add_backend(&request.vip, request.backend, weight))
        .await
}

async fn backend_remove(
    Extract(api): Extract<Api>,
    Json(request): Json<BackendRequest>,
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
            (change, shared.tables.requested())
        };
        crate::health::spawn_checks(&self.shared, &self.health_tasks);
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
        .map_err(|e| (StatusCode::CONFLICT, e))
}

/// `POST /node/ready`: undoes `/node/drain`.
async fn node_ready(Extract(api): Extract<Api>) -> Result<Json<ChangeAnswer>, Refusal> {
    crate::announce::set_drained(&api.shared, false, NODE_CHANGE_WAIT)
        .await
        .map(|change| Json(ChangeAnswer { change }))
        .map_err(|e| (StatusCode::CONFLICT, e))
}

async fn explain(
    Extract(Api { shared, .. }): Extract<Api>,
    Json(request): Json<ExplainRequest>,
) -> Result<Json<Explanation>, Refusal> {
    let shared = shared.lock().expect("agent state poisoned");
    shared
        .explain(&request, monotonic_ns())
        .map(Json)
        .map_err(|e| {
            (
                StatusCode::NOT_FOUND,
                format!("{:#}", anyhow::Error::from(e)),
            )
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
            if shared.tables.is_current() {
                break;
            }
            shared.tables.requested()
        };
        // A failed write is reported where it was asked for; status shows what is.
        let _ = pending.done().await;
    }
    let shared = shared.lock().expect("agent state poisoned");
    shared
        .status()
        .map(Json)
        .map_err(|e| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))
}
