//! Health checks: TCP connect or HTTP(S) GET against each backend's own address, with
//! HAProxy's consecutive rise/fall semantics.
//!
//! Intervals: `interval` while stable and up; `fast_interval` while a backend is changing
//! state (it has some, but not yet `rise`/`fall`, results towards the other state), so the
//! decision comes sooner; `down_interval` while down and not recovering. Every delay has
//! ±10% jitter and the first check waits a random part of `fast_interval`, so a hundred
//! backends are not probed at the same instant.
//!
//! The room of health: this module's checks of a backend's own address and the
//! rise/fall bookkeeping; `probe` (the datagram and DNS checks, a check's result); `tls`
//! (the TLS handshake of https checks);
//! `vipprobe` (checks through the VIP, sent the way the data path sends the VIP's
//! traffic); `agentcheck` (the backend's own agent, HAProxy's agent-check). It may call
//! `config`, `model`, `metrics` (check durations); it records results through the
//! `CheckHost` and `AgentHost` traits the agent's state implements, never into the
//! state directly. `outlier`: passive health, backends judged by their clients'
//! handshakes (the data path's counters), changing the model in the agent's step.

pub mod agentcheck;
pub mod outlier;
pub mod probe;
pub mod tls;
pub mod vipprobe;

use std::{
    collections::HashSet,
    net::SocketAddr,
    os::fd::AsRawFd,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use http_body_util::{BodyExt, Empty, Limited};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

use crate::{
    config::{AdminState, HealthConfig, HealthKind, HealthTarget},
    metrics::Observed,
    model::{BackendState, CheckRecord, Health, Model, VipState},
};
use vipprobe::VipPath;

/// Most of an HTTP check's body that is read (and then discarded).
const HTTP_BODY_CAP: usize = 64 * 1024;

/// Consecutive-result bookkeeping of one backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CheckState {
    pub health: Health,
    /// Consecutive results equal to `last_ok`.
    pub streak: u32,
    pub last_ok: Option<bool>,
}

impl CheckState {
    /// Records one result; returns the new health when it changed.
    pub fn observe(&mut self, ok: bool, rise: u32, fall: u32) -> Option<Health> {
        self.streak = if self.last_ok == Some(ok) {
            self.streak + 1
        } else {
            1
        };
        self.last_ok = Some(ok);
        let next = match (self.health, ok) {
            (Health::Up, false) if self.streak >= fall => Health::Down,
            (Health::Down | Health::Unknown, true) if self.streak >= rise => Health::Up,
            _ => return None,
        };
        self.health = next;
        Some(next)
    }

    /// Has some results towards the other state, but not enough yet.
    pub fn transitioning(&self) -> bool {
        matches!(
            (self.health, self.last_ok),
            (Health::Up, Some(false)) | (Health::Down, Some(true))
        )
    }

    /// Delay before the next check, before jitter.
    pub fn next_interval(&self, config: &HealthConfig) -> Duration {
        if self.transitioning() {
            config.fast_interval()
        } else if self.health == Health::Down {
            config.down_interval()
        } else {
            config.interval
        }
    }
}

/// What a backend's checks test, for status: "tcp port 80", "http port 8080 /healthz",
/// "udp port 53", "dns port 53 (NS .)"; `None` when it is not checked.
pub fn describe_check(config: &HealthConfig, port: u16) -> Option<String> {
    let mut what = match config.kind {
        HealthKind::None => return None,
        HealthKind::Tcp | HealthKind::Udp => format!("{} port {port}", config.kind),
        HealthKind::Http => format!("http port {port} {}", config.http_path()),
        HealthKind::Https => match &config.sni {
            Some(sni) => format!("https port {port} {} (sni {sni})", config.http_path()),
            None => format!("https port {port} {}", config.http_path()),
        },
        HealthKind::Dns => format!(
            "dns port {port} ({} {})",
            config.query_type.as_deref().unwrap_or("NS"),
            config.query.as_deref().unwrap_or(".")
        ),
    };
    if config.target == HealthTarget::Vip {
        what += " through the VIP";
    }
    Some(what)
}

/// `base` scaled by a factor in [0.9, 1.1].
pub fn jittered(base: Duration) -> Duration {
    base.mul_f64(0.9 + fastrand::f64() * 0.2)
}

/// Why a check failed, and whether the reason is this host's rather than the backend's.
#[derive(Debug)]
struct Failure {
    message: String,
    local: bool,
}

impl Failure {
    fn remote(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            local: false,
        }
    }
}

/// Why a check through the VIP has no way to its backend now: this host's failure, said
/// as the check's error.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum VipPathError {
    #[error("the backend is gone")]
    BackendGone,
    #[error("interface {0} is gone")]
    InterfaceGone(String),
    #[error("no route to {backend} out of {interface}")]
    NoRoute {
        backend: std::net::IpAddr,
        interface: String,
    },
    /// No outer source of the backend's family (`Config::tunnel_source_for`'s reason).
    #[error("{0}")]
    NoTunnelSource(String),
    #[error("the next hop's MAC is not known yet")]
    NextHopMacUnknown,
    #[error("the backend's MAC is not known yet")]
    BackendMacUnknown,
    #[error("{0} has no address of the VIP's family to send checks from")]
    NoSourceAddress(String),
}

/// The way of a check through the VIP to one backend, as the agent's state knows it
/// (`CheckHost::vip_route`): all of `VipPath` but its source address, which is looked up
/// on the interface (`path`) once the state's lock is let go.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VipRoute {
    pub vip: SocketAddr,
    pub mac: [u8; 6],
    /// The interface the check leaves by, and its index.
    pub interface: String,
    pub ifindex: u32,
    pub tunnel: Option<vipprobe::Tunnel>,
}

impl VipRoute {
    /// The path, with an address of the VIP's family on the interface as its source.
    pub fn path(self) -> Result<VipPath, VipPathError> {
        let source = vipprobe::interface_address(&self.interface, self.vip.is_ipv4())
            .ok_or(VipPathError::NoSourceAddress(self.interface))?;
        Ok(VipPath {
            vip: self.vip,
            mac: self.mac,
            ifindex: self.ifindex,
            source,
            tunnel: self.tunnel,
        })
    }
}

/// Runs one check of `kind` against `target`, or through the VIP along `via` (`target =
/// "vip"`; an error: why there is no path, which is this host's failure).
pub async fn check(
    config: &HealthConfig,
    target: SocketAddr,
    via: Option<Result<VipPath, VipPathError>>,
) -> CheckRecord {
    let started = Instant::now();
    // A check through the VIP keeps the timeout itself, and says what did not come ("no
    // SYN-ACK from the VIP within 1s"); this one is then only a net under it.
    let limit = match via {
        Some(_) => config.timeout + Duration::from_millis(250),
        None => config.timeout,
    };
    let outcome = tokio::time::timeout(limit, async {
        if let Some(path) = via {
            // No way to send it (no MAC yet, no address of the family here): this host
            // could not check, which says nothing of the backend.
            let path = path.map_err(|error| Failure {
                message: error.to_string(),
                local: true,
            })?;
            return crate::health::vipprobe::check_via_vip(config, path)
                .await
                .map_err(|e| Failure::remote(e.to_string()));
        }
        match config.kind {
            HealthKind::Tcp => connect(target).await.map(drop),
            HealthKind::Http | HealthKind::Https => http_check(config, target).await,
            HealthKind::Udp => probe::udp_check(config, target)
                .await
                .map_err(|e| Failure::remote(e.to_string())),
            HealthKind::Dns => probe::dns_check(config, target)
                .await
                .map_err(|e| Failure::remote(e.to_string())),
            HealthKind::None => Ok(()),
        }
    })
    .await
    .unwrap_or_else(|_| {
        Err(Failure::remote(format!(
            "timeout after {}",
            humantime::format_duration(config.timeout)
        )))
    });
    let (error, local) = match outcome {
        Ok(()) => (None, false),
        Err(failure) => (Some(failure.message), failure.local),
    };
    CheckRecord {
        ok: error.is_none(),
        latency_ms: started.elapsed().as_secs_f64() * 1000.0,
        error,
        local,
    }
}

/// `http`, and `https` after its TLS handshake.
async fn http_check(config: &HealthConfig, target: SocketAddr) -> Result<(), Failure> {
    let stream = connect(target).await?;
    if config.kind != HealthKind::Https {
        return http_exchange(config, target, stream).await;
    }
    let stream = tls::handshake(config, target, stream)
        .await
        .map_err(|error| Failure {
            local: error.is_local(),
            message: error.to_string(),
        })?;
    http_exchange(config, target, stream).await
}

/// The request and the answer of an http check, on a connected (TLS or plain) stream.
async fn http_exchange<S>(
    config: &HealthConfig,
    target: SocketAddr,
    stream: S,
) -> Result<(), Failure>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| Failure::remote(format!("http: {e}")))?;
    tokio::spawn(connection);
    // The name the certificate was checked for is the virtual host asked for.
    let host = match &config.sni {
        Some(sni) => sni.clone(),
        None => target.ip().to_string(),
    };
    let request = hyper::Request::get(config.http_path())
        .header(hyper::header::HOST, host)
        .header(hyper::header::USER_AGENT, "lb-health-check")
        .header(hyper::header::CONNECTION, "close")
        .body(Empty::<Bytes>::new())
        .map_err(|e| Failure::remote(format!("http request: {e}")))?;
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| Failure::remote(format!("http: {e}")))?;
    let status = response.status().as_u16();
    // Read (a bounded part of) the body: an application that answers headers and then
    // hangs is not healthy.
    Limited::new(response.into_body(), HTTP_BODY_CAP)
        .collect()
        .await
        .map_err(|e| Failure::remote(format!("http body: {e}")))?;
    if status != config.expect_status {
        return Err(Failure::remote(format!(
            "status {status} (expected {})",
            config.expect_status
        )));
    }
    Ok(())
}

/// Opens a TCP connection to `target`, telling this host's failures from the backend's.
///
/// A failure of socket(2), or one that connect(2) returns at once, happened before a
/// packet went out: this host could not even try (no descriptors or buffers, no source
/// address or port, no route, a local firewall). A failure that arrives later (refused,
/// reset, an ICMP error from the path, a timeout) is the backend's or its network's.
/// Some errors cannot come from the network at all and are local whenever they come.
async fn connect(target: SocketAddr) -> Result<TcpStream, Failure> {
    use nix::sys::socket::{self, AddressFamily, SockFlag, SockType, SockaddrStorage};
    let family = if target.is_ipv4() {
        AddressFamily::Inet
    } else {
        AddressFamily::Inet6
    };
    let fd = socket::socket(
        family,
        SockType::Stream,
        SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
        None,
    )
    .map_err(|errno| failure(errno.into(), true))?;
    match socket::connect(fd.as_raw_fd(), &SockaddrStorage::from(target)) {
        Ok(()) | Err(nix::errno::Errno::EINPROGRESS) => {}
        Err(errno) => return Err(failure(errno.into(), true)),
    }
    let stream =
        TcpStream::from_std(std::net::TcpStream::from(fd)).map_err(|error| failure(error, true))?;
    let outcome = match stream.writable().await {
        Ok(()) => stream.take_error(),
        Err(error) => Err(error),
    };
    match outcome {
        Ok(None) => Ok(stream),
        Ok(Some(error)) | Err(error) => Err(failure(error, false)),
    }
}

/// A failed connection attempt: local when it failed before anything was sent
/// (`immediate`) or for a reason only this host produces ([`is_local_errno`]).
fn failure(error: std::io::Error, immediate: bool) -> Failure {
    Failure {
        local: immediate || error.raw_os_error().is_some_and(is_local_errno),
        message: describe_io(error),
    }
}

/// Errors that only this host produces, whenever they are reported: out of file
/// descriptors, of buffer space or memory, of source addresses or ports.
pub fn is_local_errno(errno: i32) -> bool {
    matches!(
        errno,
        libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM | libc::EADDRNOTAVAIL
    )
}

fn describe_io(error: std::io::Error) -> String {
    match error.kind() {
        std::io::ErrorKind::ConnectionRefused => "connection refused".into(),
        std::io::ErrorKind::ConnectionReset => "connection reset".into(),
        _ => error.to_string(),
    }
}

/// The agent's state as the check tasks see it.
pub trait CheckHost: Send + 'static {
    /// The VIPs and backends to check.
    fn model(&self) -> &Model;
    /// How a check through the VIP reaches backend `id` (but its source address, looked
    /// up after: `VipRoute::path`), or why it cannot. No I/O: called under the lock.
    fn vip_route(&self, id: u32) -> Result<VipRoute, VipPathError>;
    /// Records a check result of backend `id` (see [`record`]) and, when it changed
    /// the backend's health, rewrites the tables.
    fn record_check(&mut self, id: u32, record: CheckRecord, rise: u32, fall: u32);
}

/// What starting health-check (and agent-check) tasks needs.
#[derive(Clone)]
pub struct HealthTasks {
    pub running: Arc<Mutex<HashSet<u32>>>,
    pub agents: crate::health::agentcheck::Tasks,
    pub shutdown: CancellationToken,
}

impl HealthTasks {
    pub fn new(shutdown: CancellationToken) -> Self {
        Self {
            running: Arc::new(Mutex::new(HashSet::new())),
            agents: Default::default(),
            shutdown,
        }
    }
}

/// Starts a check task for every checked backend that has none yet. Tasks end by
/// themselves when their backend leaves the model or stops being checked.
pub fn spawn_checks<H: CheckHost>(host: &Arc<Mutex<H>>, tasks: &HealthTasks) {
    // Both locks, the host first (as a finishing task takes them): a task deciding to
    // end and this deciding not to start one cannot interleave.
    let guard = host.lock().expect("agent state poisoned");
    let mut running_ids = tasks.running.lock().expect("health task set poisoned");
    for vip in &guard.model().vips {
        for backend in vip.backends.iter().filter(|b| is_checked(vip, b)) {
            if running_ids.insert(backend.id) {
                tokio::spawn(check_loop(
                    backend.id,
                    host.clone(),
                    tasks.running.clone(),
                    tasks.shutdown.clone(),
                ));
            }
        }
    }
}

/// Backends in maintenance and backends whose checks are `none` are not checked.
fn is_checked(vip: &VipState, backend: &BackendState) -> bool {
    backend.config.state != AdminState::Maint
        && vip.config.health_of(&backend.config).kind != HealthKind::None
}

async fn check_loop<H: CheckHost>(
    id: u32,
    host: Arc<Mutex<H>>,
    running: Arc<Mutex<HashSet<u32>>>,
    shutdown: CancellationToken,
) {
    let mut first = true;
    loop {
        // Read what to check under the lock, check without it.
        let Some((config, target, state)) = target_of(&host, id) else {
            // Deregister under the host's lock, unless the backend came back meanwhile
            // (then `spawn_checks` saw this task still registered and started none).
            let guard = host.lock().expect("agent state poisoned");
            if target_in(guard.model(), id).is_some() {
                continue;
            }
            running
                .lock()
                .expect("health task set poisoned")
                .remove(&id);
            return;
        };
        let delay = if first {
            config.fast_interval().mul_f64(fastrand::f64())
        } else {
            jittered(state.next_interval(&config))
        };
        first = false;
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(delay) => {}
        }
        // The interface's address is looked up once the lock is let go.
        let via = (config.target == HealthTarget::Vip).then(|| {
            let route = host.lock().expect("agent state poisoned").vip_route(id);
            route.and_then(VipRoute::path)
        });
        let record = check(&config, target, via).await;
        host.lock().expect("agent state poisoned").record_check(
            id,
            record,
            config.rise,
            config.fall,
        );
    }
}

/// Records a check result of backend `id` in the model and the metrics, and logs a
/// change of health. Returns the new health when it changed; nothing when the backend
/// is gone (it went while being checked).
pub fn record(
    model: &mut Model,
    observed: &Observed,
    id: u32,
    record: CheckRecord,
    rise: u32,
    fall: u32,
) -> Option<Health> {
    let (vip, kind, backend) = model.vips.iter_mut().find_map(|v| {
        let name = v.config.name.clone();
        let config = &v.config;
        v.backends
            .iter_mut()
            .find(|b| b.id == id)
            .map(|b| (name, config.health_of(&b.config).kind, b))
    })?;
    let address = backend.config.address;
    if record.local {
        // Not the backend's result: its health, streak and last counted check stay.
        backend.local_check_errors += 1;
        backend.local_errors_in_a_row += 1;
        if backend.local_errors_in_a_row == 1 {
            tracing::warn!(
                "local check error for backend {address} of vip {vip}: {} (this host's \
                 problem, not counted against the backend; health stays {})",
                record.error.as_deref().unwrap_or("?"),
                backend.health
            );
        }
        backend.last_local_error = Some(record);
        return None;
    }
    if backend.local_errors_in_a_row > 0 {
        tracing::info!(
            "checks of backend {address} of vip {vip} run again after {} local check \
             error(s)",
            backend.local_errors_in_a_row
        );
        backend.local_errors_in_a_row = 0;
    }
    let mut state = CheckState {
        health: backend.health,
        streak: backend.streak,
        last_ok: backend.last_check.as_ref().map(|c| c.ok),
    };
    let changed = state.observe(record.ok, rise, fall);
    backend.health = state.health;
    backend.streak = state.streak;
    let seconds = record.latency_ms / 1000.0;
    let reason = record
        .error
        .clone()
        .unwrap_or_else(|| format!("{:.1}ms", record.latency_ms));
    backend.last_check = Some(record);
    let kind = kind.to_string();
    crate::metrics::observe_check(
        observed,
        &vip,
        &kind,
        &address.to_string(),
        seconds,
        changed,
    );
    match changed {
        Some(Health::Up) => tracing::info!(
            "backend {address} of vip {vip} is UP: {reason} ({} consecutive successes)",
            state.streak
        ),
        Some(_) => tracing::warn!(
            "backend {address} of vip {vip} is DOWN: {reason} ({} consecutive failures)",
            state.streak
        ),
        None => {}
    }
    changed
}

fn target_of<H: CheckHost>(
    host: &Arc<Mutex<H>>,
    id: u32,
) -> Option<(HealthConfig, SocketAddr, CheckState)> {
    target_in(host.lock().expect("agent state poisoned").model(), id)
}

/// What to check for backend `id`, if it is checked.
fn target_in(model: &Model, id: u32) -> Option<(HealthConfig, SocketAddr, CheckState)> {
    model.vips.iter().find_map(|v| {
        let b = v.backends.iter().find(|b| b.id == id)?;
        if !is_checked(v, b) {
            return None;
        }
        Some((
            v.config.health_of(&b.config).clone(),
            SocketAddr::new(b.config.address, v.config.health_port_of(&b.config)),
            CheckState {
                health: b.health,
                streak: b.streak,
                last_ok: b.last_check.as_ref().map(|c| c.ok),
            },
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn down() -> CheckState {
        CheckState {
            health: Health::Down,
            streak: 0,
            last_ok: None,
        }
    }

    fn feed(state: &mut CheckState, results: &[bool], rise: u32, fall: u32) -> Vec<Option<Health>> {
        results
            .iter()
            .map(|&ok| state.observe(ok, rise, fall))
            .collect()
    }

    #[test]
    fn rise_consecutive_successes_bring_a_backend_up() {
        let mut s = down();
        assert_eq!(feed(&mut s, &[true, true], 3, 2), [None, None]);
        assert_eq!(s.observe(true, 3, 2), Some(Health::Up));
        assert_eq!(s.health, Health::Up);
    }

    #[test]
    fn fall_consecutive_failures_take_it_down() {
        let mut s = CheckState {
            health: Health::Up,
            streak: 5,
            last_ok: Some(true),
        };
        assert_eq!(
            feed(&mut s, &[false, false, false], 2, 3),
            [None, None, Some(Health::Down)]
        );
    }

    #[test]
    fn an_opposite_result_resets_the_count() {
        let mut s = CheckState {
            health: Health::Up,
            streak: 5,
            last_ok: Some(true),
        };
        // fail, fail, ok, fail, fail: never three in a row.
        let changes = feed(&mut s, &[false, false, true, false, false], 2, 3);
        assert!(changes.iter().all(Option::is_none), "{changes:?}");
        assert_eq!(s.health, Health::Up);
        assert_eq!(s.observe(false, 2, 3), Some(Health::Down));
    }

    #[test]
    fn flapping_faster_than_rise_and_fall_never_changes_state() {
        let mut s = down();
        let flaps: Vec<bool> = (0..100).map(|i| i % 2 == 0).collect();
        assert!(feed(&mut s, &flaps, 2, 2).iter().all(Option::is_none));
        assert_eq!(s.health, Health::Down);
    }

    #[test]
    fn interval_depends_on_state() {
        let config = HealthConfig {
            interval: Duration::from_secs(2),
            fast_interval: Some(Duration::from_millis(300)),
            down_interval: Some(Duration::from_secs(5)),
            ..HealthConfig::default()
        };
        let mut s = CheckState {
            health: Health::Up,
            streak: 3,
            last_ok: Some(true),
        };
        assert_eq!(s.next_interval(&config), Duration::from_secs(2));
        s.observe(false, 2, 3);
        assert_eq!(
            s.next_interval(&config),
            Duration::from_millis(300),
            "going down"
        );
        s.observe(false, 2, 3);
        s.observe(false, 2, 3);
        assert_eq!(s.health, Health::Down);
        assert_eq!(
            s.next_interval(&config),
            Duration::from_secs(5),
            "down and failing"
        );
        s.observe(true, 2, 3);
        assert_eq!(
            s.next_interval(&config),
            Duration::from_millis(300),
            "recovering"
        );
    }

    #[test]
    fn jitter_stays_within_ten_percent() {
        for _ in 0..1000 {
            let d = jittered(Duration::from_secs(1));
            assert!(
                d >= Duration::from_millis(900) && d <= Duration::from_millis(1100),
                "{d:?}"
            );
        }
    }

    #[test]
    fn local_errors_are_told_from_the_backends() {
        let io = |errno| std::io::Error::from_raw_os_error(errno);
        // socket(2) or connect(2) failing at once: nothing was sent, whatever the errno.
        for errno in [
            libc::EMFILE,
            libc::ENETUNREACH,
            libc::EHOSTUNREACH,
            libc::EACCES,
        ] {
            assert!(failure(io(errno), true).local, "immediate errno {errno}");
        }
        // Only this host runs out of descriptors, buffers or source ports...
        for errno in [
            libc::EMFILE,
            libc::ENFILE,
            libc::ENOBUFS,
            libc::ENOMEM,
            libc::EADDRNOTAVAIL,
        ] {
            assert!(failure(io(errno), false).local, "errno {errno}");
        }
        // ... while a refusal, a reset or an ICMP error from the path is the backend's.
        for errno in [
            libc::ECONNREFUSED,
            libc::ECONNRESET,
            libc::ETIMEDOUT,
            libc::ENETUNREACH,
            libc::EHOSTUNREACH,
        ] {
            let failure = failure(io(errno), false);
            assert!(!failure.local, "errno {errno}");
        }
        assert_eq!(
            failure(io(libc::ECONNREFUSED), false).message,
            "connection refused"
        );
    }

    fn checked_model() -> (Model, u32) {
        let config = crate::config::Config::from_toml(
            "[dataplane]\ninterface = \"eth0\"\nmaglev_table_size = 7\n\
             [[vip]]\nname = \"web\"\naddress = \"10.0.0.100\"\nport = 80\nprotocol = \"tcp\"\n\
             [[vip.backend]]\naddress = \"10.0.0.11\"\n",
        )
        .unwrap();
        let mut model = Model::new(7, 16, Duration::ZERO);
        model.update(&config).unwrap();
        let id = model.vips[0].backends[0].id;
        (model, id)
    }

    fn result(ok: bool, local: bool) -> CheckRecord {
        CheckRecord {
            ok,
            latency_ms: 1.0,
            error: (!ok).then(|| "Too many open files (os error 24)".to_string()),
            local,
        }
    }

    #[test]
    fn local_check_errors_do_not_count_toward_fall() {
        let (mut model, id) = checked_model();
        let observed = Observed::default();
        let mut feed =
            |ok: bool, local: bool| record(&mut model, &observed, id, result(ok, local), 2, 3);
        assert_eq!(feed(true, false), None);
        assert_eq!(feed(true, false), Some(Health::Up));
        // Any number of local errors, between counted failures: no change, and the
        // streak of counted failures goes on across them.
        for _ in 0..50 {
            assert_eq!(feed(false, true), None);
        }
        assert_eq!(feed(false, false), None);
        assert_eq!(feed(false, true), None);
        assert_eq!(feed(false, false), None);
        let backend = &model.vips[0].backends[0];
        assert_eq!(backend.health, Health::Up);
        assert_eq!((backend.streak, backend.local_check_errors), (2, 51));
        assert_eq!(
            backend.local_errors_in_a_row, 0,
            "a counted check ends a run"
        );
        assert!(backend.last_local_error.as_ref().is_some_and(|r| r.local));
        assert_eq!(backend.last_check.as_ref().map(|c| c.local), Some(false));
        let mut feed = |ok, local| record(&mut model, &observed, id, result(ok, local), 2, 3);
        assert_eq!(feed(false, false), Some(Health::Down), "3 counted failures");
        // Nor do they count toward rise.
        assert_eq!(feed(true, false), None);
        assert_eq!(feed(false, true), None);
        assert_eq!(feed(true, false), Some(Health::Up));
    }

    #[tokio::test]
    async fn tcp_check_against_real_sockets() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let open = listener.local_addr().unwrap();
        let config = HealthConfig {
            kind: HealthKind::Tcp,
            ..HealthConfig::default()
        };
        let record = check(&config, open, None).await;
        assert!(record.ok, "{record:?}");
        drop(listener);
        let record = check(&config, open, None).await;
        assert_eq!(record.error.as_deref(), Some("connection refused"));
    }

    /// A one-shot HTTP server on loopback answering `response` to one request.
    async fn http_server(response: &'static str) -> SocketAddr {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            let mut buf = [0u8; 1024];
            let _ = stream.read(&mut buf).await;
            let _ = stream.write_all(response.as_bytes()).await;
            // Keep the connection open a while: a "hang" response never finishes.
            tokio::time::sleep(Duration::from_secs(5)).await;
        });
        addr
    }

    #[tokio::test]
    async fn http_check_wants_the_expected_status_within_the_timeout() {
        let config = HealthConfig {
            kind: HealthKind::Http,
            path: Some("/healthz".into()),
            timeout: Duration::from_millis(500),
            ..HealthConfig::default()
        };
        let ok = http_server("HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok").await;
        assert!(check(&config, ok, None).await.ok);
        let unavailable =
            http_server("HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n").await;
        let record = check(&config, unavailable, None).await;
        assert_eq!(record.error.as_deref(), Some("status 503 (expected 200)"));
        // Headers, then a body that never comes.
        let hang = http_server("HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial").await;
        let record = check(&config, hang, None).await;
        assert_eq!(record.error.as_deref(), Some("timeout after 500ms"));
    }
}
