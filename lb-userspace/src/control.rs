//! The control socket: HTTP/1.1 with JSON bodies on a Unix socket that only root can
//! open (created 0600). `GET /status` returns `Status`.

use std::{
    collections::BTreeMap,
    net::IpAddr,
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
};

use anyhow::{Context, bail};
use axum::{
    Json, Router,
    extract::State,
    http::StatusCode,
    routing::{get, post},
};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use serde::{Deserialize, Serialize};
use tokio::net::{UnixListener, UnixStream};

use crate::agent::{ControlError, HealthTasks, Shared};
use crate::config::AdminState;
use crate::explain::{ExplainRequest, Explanation, View, VipTarget, monotonic_ns};
use crate::model::CheckRecord;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Status {
    pub dataplane: DataplaneStatus,
    pub vips: Vec<VipStatus>,
    /// Outcome counters of the program (`lb_common::stat::NAMES`), summed over CPUs.
    pub counters: BTreeMap<String, u64>,
    /// Announcing VIPs to routers (`[announce]`) and the node's drain state.
    #[serde(default)]
    pub node: NodeStatus,
}

/// The node's part in a multi-node deployment (`[announce]`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeStatus {
    /// VIPs are announced to routers (`[announce]` is configured).
    pub announcing: bool,
    /// `lb node drain`: every VIP is withdrawn until `lb node ready`.
    pub drained: bool,
    /// The kernel routing table and device of the announced routes.
    pub table: Option<u32>,
    pub device: Option<String>,
    /// Warm-up left before anything is announced (0 once over).
    pub warmup_left_seconds: f64,
    /// Addresses announced now (their routes are in the table).
    pub announced: Vec<String>,
    /// The last failure to write the routes, while it lasts.
    pub error: Option<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DataplaneStatus {
    pub interface: String,
    pub interface_mac: String,
    /// The XDP mode actually attached: "native" or "generic".
    pub xdp_mode: String,
    pub maglev_table_size: u32,
    /// Connection-table entries at the agent's last scan.
    pub conntrack_entries: u64,
    /// How long ago that scan was (the agent scans every 2 s); None before the first.
    #[serde(default)]
    pub conntrack_scan_age_seconds: Option<f64>,
    /// How the agent found the data path at start: "fresh", "adopted" (a previous
    /// agent's pinned program and maps, flows kept) or "replaced (why)".
    pub start: String,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct VipStatus {
    pub name: String,
    /// With `[announce]`: the VIP's address is announced to the routers now.
    #[serde(default)]
    pub announced: bool,
    /// Why (not): "announced", "withdrawn: <reason>", "not announced: no [announce]
    /// section".
    #[serde(default)]
    pub announcement: String,
    pub address: String,
    pub port: u16,
    pub protocol: String,
    pub hash: String,
    pub packets: u64,
    pub bytes: u64,
    pub new_flows: u64,
    pub healthy_backends: usize,
    pub unhealthy_backends: usize,
    /// New flows of the busiest in-table backend over the average, over the last sample
    /// interval (2 s); 0 when there were none. 1.0 is perfectly even.
    pub busiest_over_average: f64,
    /// The client sources that opened the most new flows over the last sample interval
    /// (heavy hitters), busiest first, at most `TOP_SOURCES`.
    pub top_sources: Vec<SourceRate>,
    pub backends: Vec<BackendStatus>,
}

/// How many heavy hitters status reports per VIP.
pub const TOP_SOURCES: usize = 10;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SourceRate {
    pub address: String,
    pub new_flows_per_second: f64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BackendStatus {
    pub address: String,
    pub weight: u32,
    /// Admin state: "ready", "draining", "drained" or "maint".
    pub state: String,
    /// "up", "down" or "unknown" (not checked).
    pub health: String,
    pub mac: Option<String>,
    /// Takes new flows now.
    pub in_table: bool,
    /// Maglev slots held.
    pub slots: usize,
    /// Connection-table entries that saw a packet within `flow_idle_timeout`.
    pub active_flows: u64,
    pub packets: u64,
    pub bytes: u64,
    pub new_flows: u64,
    /// Consecutive check results agreeing with the last one.
    pub consecutive: u32,
    pub last_check: Option<CheckRecord>,
    /// New flows per second over the last sample interval.
    pub new_flows_per_second: f64,
}

/// Binds the socket (0600, parent created 0700 if missing) and serves until `shutdown`.
pub async fn serve(
    path: PathBuf,
    shared: Arc<Mutex<Shared>>,
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
        let served = axum::serve(listener, app)
            .with_graceful_shutdown(shutdown.cancelled_owned())
            .await;
        if let Err(error) = served {
            tracing::error!("control socket: {error}");
        }
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
    shared: Arc<Mutex<Shared>>,
    health_tasks: HealthTasks,
}

/// The answer to `POST /reload`: the changes applied. A refused reload answers 422 with
/// the reason, and nothing changed.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ReloadAnswer {
    pub changes: Vec<String>,
}

async fn reload(State(api): State<Api>) -> Result<Json<ReloadAnswer>, (StatusCode, String)> {
    crate::agent::reload(&api.shared, &api.health_tasks)
        .map(|changes| Json(ReloadAnswer { changes }))
        .map_err(|e| {
            let message = format!("{:#}", anyhow::Error::from(e));
            (StatusCode::UNPROCESSABLE_ENTITY, message)
        })
}

/// Body of `POST /backend/state`, `/backend/add` and `/backend/remove`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BackendRequest {
    pub vip: VipTarget,
    pub backend: IpAddr,
    /// `/backend/state`: "ready", "drain" or "maint".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<AdminState>,
    /// `/backend/add`: the weight (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<u32>,
}

/// The answer to a change: what was done.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ChangeAnswer {
    pub change: String,
}

fn refused(error: ControlError) -> (StatusCode, String) {
    let code = match error {
        ControlError::UnknownVip(..) | ControlError::UnknownBackend(..) => StatusCode::NOT_FOUND,
        ControlError::BackendExists(..) => StatusCode::CONFLICT,
        ControlError::Invalid(_) | ControlError::Model(_) => StatusCode::BAD_REQUEST,
        ControlError::Write(_) => StatusCode::INTERNAL_SERVER_ERROR,
    };
    (code, format!("{:#}", anyhow::Error::from(error)))
}

async fn backend_state(
    State(api): State<Api>,
    Json(request): Json<BackendRequest>,
) -> Result<Json<ChangeAnswer>, (StatusCode, String)> {
    let state = request
        .state
        .ok_or((StatusCode::BAD_REQUEST, "missing \"state\"".to_string()))?;
    api.change(|shared| shared.set_admin_state(&request.vip, request.backend, state))
}

async fn backend_add(
    State(api): State<Api>,
    Json(request): Json<BackendRequest>,
) -> Result<Json<ChangeAnswer>, (StatusCode, String)> {
    let weight = request.weight.unwrap_or(1);
    api.change(|shared| shared.add_backend(&request.vip, request.backend, weight))
}

async fn backend_remove(
    State(api): State<Api>,
    Json(request): Json<BackendRequest>,
) -> Result<Json<ChangeAnswer>, (StatusCode, String)> {
    api.change(|shared| shared.remove_backend(&request.vip, request.backend))
}

impl Api {
    /// Applies a runtime change under the lock, then starts checks for backends that
    /// became checked (added, or back from maintenance).
    fn change(
        &self,
        apply: impl FnOnce(&mut Shared) -> Result<String, ControlError>,
    ) -> Result<Json<ChangeAnswer>, (StatusCode, String)> {
        let change = {
            let mut shared = self.shared.lock().expect("agent state poisoned");
            apply(&mut shared).map_err(refused)?
        };
        crate::health::spawn_checks(&self.shared, &self.health_tasks);
        Ok(Json(ChangeAnswer { change }))
    }
}

/// How long `/node/drain` and `/node/ready` wait for the routes to follow.
const NODE_CHANGE_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// `POST /node/drain`: withdraw every VIP (the data path keeps forwarding what still
/// arrives); answers once the routes are gone.
async fn node_drain(State(api): State<Api>) -> Result<Json<ChangeAnswer>, (StatusCode, String)> {
    crate::announce::set_drained(&api.shared, true, NODE_CHANGE_WAIT)
        .await
        .map(|change| Json(ChangeAnswer { change }))
        .map_err(|e| (StatusCode::CONFLICT, e))
}

/// `POST /node/ready`: undoes `/node/drain`.
async fn node_ready(State(api): State<Api>) -> Result<Json<ChangeAnswer>, (StatusCode, String)> {
    crate::announce::set_drained(&api.shared, false, NODE_CHANGE_WAIT)
        .await
        .map(|change| Json(ChangeAnswer { change }))
        .map_err(|e| (StatusCode::CONFLICT, e))
}

async fn explain(
    State(Api { shared, .. }): State<Api>,
    Json(request): Json<ExplainRequest>,
) -> Result<Json<Explanation>, (StatusCode, String)> {
    let shared = shared.lock().expect("agent state poisoned");
    crate::explain::explain(&View::of(&shared), &request, monotonic_ns())
        .map(Json)
        .map_err(|e| {
            (
                StatusCode::NOT_FOUND,
                format!("{:#}", anyhow::Error::from(e)),
            )
        })
}

async fn status(
    State(Api { shared, .. }): State<Api>,
) -> Result<Json<Status>, (StatusCode, String)> {
    let shared = shared.lock().expect("agent state poisoned");
    shared
        .status()
        .map(Json)
        .map_err(|e| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))
}

/// Sends `method path` to the agent and returns the body of a 2xx answer; otherwise
/// the agent's message is the error.
pub async fn request(
    socket: &Path,
    method: hyper::Method,
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

/// The status as a table for people.
pub fn render(status: &Status) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let d = &status.dataplane;
    let scanned = match d.conntrack_scan_age_seconds {
        Some(age) => format!(
            "{} connection-table entries {age:.1}s ago",
            d.conntrack_entries
        ),
        None => "connection table not scanned yet".to_string(),
    };
    let _ = writeln!(
        out,
        "data path: {} ({}) xdp mode {}, maglev table {} slots, {scanned}",
        d.interface, d.interface_mac, d.xdp_mode, d.maglev_table_size
    );
    let _ = writeln!(out, "start: {}", d.start);
    let node = &status.node;
    if node.announcing {
        let _ = writeln!(
            out,
            "node: {}, announcing through table {} (device {}): {}{}{}",
            if node.drained { "DRAINED" } else { "ready" },
            node.table.unwrap_or_default(),
            node.device.as_deref().unwrap_or("?"),
            if node.announced.is_empty() {
                "nothing announced".to_string()
            } else {
                node.announced.join(", ")
            },
            if node.warmup_left_seconds > 0.0 {
                format!(" (warm-up: {:.1}s left)", node.warmup_left_seconds)
            } else {
                String::new()
            },
            node.error
                .as_deref()
                .map(|e| format!("; error: {e}"))
                .unwrap_or_default()
        );
    }
    for vip in &status.vips {
        let _ = writeln!(
            out,
            "\nvip {} {}:{}/{} hash {}: {} healthy, {} unhealthy, {} packets, {} new flows",
            vip.name,
            vip.address,
            vip.port,
            vip.protocol,
            vip.hash,
            vip.healthy_backends,
            vip.unhealthy_backends,
            vip.packets,
            vip.new_flows
        );
        if status.node.announcing {
            let _ = writeln!(out, "  announcement: {}", vip.announcement);
        }
        // New flows over the last sample interval: where a hot spot shows.
        let _ = writeln!(
            out,
            "  busiest backend / average new flows: {}; top sources: {}",
            if vip.busiest_over_average > 0.0 {
                format!("{:.2}", vip.busiest_over_average)
            } else {
                "- (no new flows in the last sample)".to_string()
            },
            if vip.top_sources.is_empty() {
                "none".to_string()
            } else {
                vip.top_sources
                    .iter()
                    .map(|s| format!("{} {:.1}/s", s.address, s.new_flows_per_second))
                    .collect::<Vec<_>>()
                    .join(", ")
            }
        );
        let _ = writeln!(
            out,
            "  {:<40} {:>6} {:<9} {:<8} {:<17} {:>6} {:>7} {:>10} {:>12} {:>9}  last check",
            "backend",
            "weight",
            "state",
            "health",
            "mac",
            "slots",
            "flows",
            "packets",
            "bytes",
            "new_flows"
        );
        for b in &vip.backends {
            let check = match &b.last_check {
                None => "-".to_string(),
                Some(c) if c.ok => format!("ok {:.1}ms", c.latency_ms),
                Some(c) => format!("failed: {}", c.error.as_deref().unwrap_or("?")),
            };
            let _ = writeln!(
                out,
                "  {:<40} {:>6} {:<9} {:<8} {:<17} {:>6} {:>7} {:>10} {:>12} {:>9}  {}",
                b.address,
                b.weight,
                b.state,
                b.health,
                b.mac.as_deref().unwrap_or("unresolved"),
                b.slots,
                b.active_flows,
                b.packets,
                b.bytes,
                b.new_flows,
                check
            );
        }
    }
    let nonzero: Vec<String> = status
        .counters
        .iter()
        .filter(|(_, v)| **v > 0)
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    let _ = writeln!(
        out,
        "\ncounters: {}",
        if nonzero.is_empty() {
            "none yet".into()
        } else {
            nonzero.join(" ")
        }
    );
    out
}

#[cfg(test)]
mod tests {
    use crate::agent::test_support::{config, shared};

    #[test]
    fn the_table_for_people_has_what_status_promises() {
        let shared = shared(config("eth0", &["10.0.0.11", "10.0.0.12"]));
        let mut status = shared.status().unwrap();
        status.vips[0].busiest_over_average = 1.25;
        status.vips[0].top_sources = vec![super::SourceRate {
            address: "10.0.0.1".into(),
            new_flows_per_second: 12.5,
        }];
        let text = super::render(&status);
        assert!(
            text.contains("connection table not scanned yet"),
            "before the first scan:\n{text}"
        );
        status.dataplane.conntrack_scan_age_seconds = Some(0.5);
        status.dataplane.conntrack_entries = 7;
        status.vips[0].busiest_over_average = 0.0;
        let quiet = super::render(&status);
        assert!(
            quiet.contains("7 connection-table entries 0.5s ago"),
            "{quiet}"
        );
        assert!(
            quiet.contains("new flows: - (no new flows in the last sample)"),
            "{quiet}"
        );
        for line in [
            "start: ",
            "vip web 10.0.0.100:80/tcp",
            "busiest backend / average new flows: 1.25; top sources: 10.0.0.1 12.5/s",
            "10.0.0.11",
            "10.0.0.12",
            "counters: ",
        ] {
            assert!(text.contains(line), "no {line:?} in:\n{text}");
        }
    }
}
