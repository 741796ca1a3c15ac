//! The namespace test bed for `lb`: a DSR topology in network namespaces (a client, the
//! balancer, N backends, all on one bridge), backend servers, client helpers, a guard
//! for the `lb` agent, a packet sniffer, and a reader of `lb status --json` for health
//! states. Used by the end-to-end tests (`tests/e2e.rs`, `tests/health.rs`...) and by
//! the `lab` binary behind `cargo xtask run`.
//!
//! Everything here needs root, `ip` and `ethtool`; tests call [`require_e2e`] (or
//! [`require_root_tools`]) first, which skips loudly when the machine cannot run them,
//! unless `LB_REQUIRE_ALL_TESTS=1` (CI) turns the skip into a failure.
//!
//! Traffic only ever goes to addresses inside namespaces created here, and every
//! namespace is removed by a guard's `Drop`, also when a test fails.

pub mod agent;
pub mod client;
pub mod config;
pub mod flood;
pub mod host;
pub mod lab;
pub mod netns;
pub mod program;
pub mod quic;
pub mod router;
pub mod server;
pub mod sniff;

/// What `lb status --json` says of a VIP's backends and their health, and a wait for
/// them to come up.
pub mod status {
    use std::net::IpAddr;
    use std::time::{Duration, Instant};

    use anyhow::{Context, Result, anyhow};
    use serde_json::Value;

    use crate::Agent;

    /// One backend of `lb status --json` (the fields health checks change).
    #[derive(Clone, Debug, PartialEq)]
    pub struct BackendView {
        pub address: IpAddr,
        /// Admin state: ready, draining, drained, maint.
        pub state: String,
        /// up, down or unknown.
        pub health: String,
        pub in_table: bool,
        pub slots: u64,
        /// Consecutive check results agreeing with the last one.
        pub consecutive: u64,
        /// The last check's outcome (`None`: no check yet).
        pub last_ok: Option<bool>,
        pub last_error: Option<String>,
        pub last_latency_ms: Option<f64>,
        pub new_flows: u64,
    }

    impl BackendView {
        /// Health up and in the table.
        pub fn is_up(&self) -> bool {
            self.health == "up" && self.in_table
        }

        /// Health down, out of the table, no slot.
        pub fn is_out(&self) -> bool {
            self.health == "down" && !self.in_table && self.slots == 0
        }

        /// `10.99.0.11 up in_table 21845 slots (2 consecutive, last ok 0.3ms)`.
        pub fn summary(&self) -> String {
            let last = match (self.last_ok, &self.last_error) {
                (None, _) => "no check yet".to_string(),
                (Some(true), _) => format!("last ok {:.1}ms", self.last_latency_ms.unwrap_or(0.0)),
                (Some(false), e) => format!("last failed: {}", e.as_deref().unwrap_or("?")),
            };
            format!(
                "{} {}{} {} slots ({} consecutive, {last})",
                self.address,
                self.health,
                if self.in_table { " in_table" } else { "" },
                self.slots,
                self.consecutive
            )
        }
    }

    /// One VIP of `lb status --json`.
    #[derive(Clone, Debug, PartialEq)]
    pub struct VipView {
        pub name: String,
        pub healthy_backends: u64,
        pub unhealthy_backends: u64,
        pub backends: Vec<BackendView>,
    }

    impl VipView {
        /// The VIP named `vip` in a parsed `lb status --json`.
        pub fn parse(status: &Value, vip: &str) -> Result<VipView> {
            let v = status["vips"]
                .as_array()
                .and_then(|vips| vips.iter().find(|v| v["name"] == vip))
                .ok_or_else(|| anyhow!("no VIP {vip:?} in lb status --json:\n{status:#}"))?;
            let backends = v["backends"]
                .as_array()
                .ok_or_else(|| anyhow!("VIP {vip:?} has no backends array:\n{v:#}"))?
                .iter()
                .map(parse_backend)
                .collect::<Result<Vec<_>>>()
                .with_context(|| format!("VIP {vip:?} in lb status --json"))?;
            let count = |field: &str| {
                v[field]
                    .as_u64()
                    .ok_or_else(|| anyhow!("VIP {vip:?} has no {field}:\n{v:#}"))
            };
            Ok(VipView {
                name: vip.into(),
                healthy_backends: count("healthy_backends")?,
                unhealthy_backends: count("unhealthy_backends")?,
                backends,
            })
        }

        /// `lb status --json` of `agent`, VIP `vip`.
        pub fn fetch(agent: &Agent, vip: &str) -> Result<VipView> {
            VipView::parse(&agent.status_json()?, vip)
        }

        pub fn backend(&self, address: IpAddr) -> Option<&BackendView> {
            self.backends.iter().find(|b| b.address == address)
        }

        /// Backends up and in the table.
        pub fn up(&self) -> usize {
            self.backends.iter().filter(|b| b.is_up()).count()
        }

        /// One line per backend.
        pub fn summary(&self) -> String {
            let mut out = format!(
                "vip {}: {} healthy, {} unhealthy\n",
                self.name, self.healthy_backends, self.unhealthy_backends
            );
            for b in &self.backends {
                out.push_str(&format!("  {}\n", b.summary()));
            }
            out
        }
    }

    fn parse_backend(b: &Value) -> Result<BackendView> {
        let text = |field: &str| {
            b[field]
                .as_str()
                .map(str::to_string)
                .ok_or_else(|| anyhow!("backend without {field}: {b}"))
        };
        let number = |field: &str| {
            b[field]
                .as_u64()
                .ok_or_else(|| anyhow!("backend without {field}: {b}"))
        };
        let last = &b["last_check"];
        Ok(BackendView {
            address: text("address")?
                .parse()
                .with_context(|| format!("backend address in {b}"))?,
            state: text("state")?,
            health: text("health")?,
            in_table: b["in_table"]
                .as_bool()
                .ok_or_else(|| anyhow!("backend without in_table: {b}"))?,
            slots: number("slots")?,
            consecutive: number("consecutive")?,
            last_ok: last["ok"].as_bool(),
            last_error: last["error"].as_str().map(str::to_string),
            last_latency_ms: last["latency_ms"].as_f64(),
            new_flows: number("new_flows")?,
        })
    }

    /// Asks `lab`'s agent for `lb status --json` every 100 ms until `until` holds of it
    /// (returned, the time taken printed), at most `timeout`; then panics naming `what`,
    /// with the last status and the agent's log.
    pub fn wait_status(
        lab: &crate::Lab,
        timeout: Duration,
        what: &str,
        until: impl Fn(&Value) -> bool,
    ) -> Value {
        let start = Instant::now();
        loop {
            let status = lab
                .agent()
                .expect("agent")
                .status_json()
                .unwrap_or_else(|e| panic!("lb status --json: {e:#}"));
            if until(&status) {
                eprintln!("{what}: {:?}", start.elapsed());
                return status;
            }
            assert!(
                start.elapsed() < timeout,
                "not within {timeout:?}: {what}\nlast status:\n{status:#}\nagent log:\n{}",
                lab.agent_log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Asks `lb status --json` every 50 ms until every backend of `vip` is up and in
    /// the table, or `timeout` passes, or `cancelled()`. Returns the last view and the
    /// time waited; the caller compares [`VipView::up`] with the number of backends.
    pub fn wait_backends_up(
        agent: &Agent,
        vip: &str,
        timeout: Duration,
        cancelled: &dyn Fn() -> bool,
    ) -> Result<(VipView, Duration)> {
        let start = Instant::now();
        loop {
            let view = VipView::fetch(agent, vip)?;
            if view.up() == view.backends.len() || start.elapsed() >= timeout || cancelled() {
                return Ok((view, start.elapsed()));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

pub use agent::Agent;
pub use client::{
    Conn, Spread, ping, send_icmp, spread, tcp_request, udp_request, udp_request_from, udp_spread,
};
pub use config::{AgentConfig, BackendConfig, CheckTiming, Health, Protocol, VipConfig, XdpMode};
pub use lab::{Lab, LabOptions};
pub use netns::Netns;
pub use server::{HttpAnswer, HttpBehaviour, HttpControl, HttpServer, TcpServer, UdpServer};
pub use sniff::{Sniffer, ip_src_is};
pub use status::{BackendView, VipView, wait_backends_up, wait_status};

/// Env var that turns every skip into a failure (CI sets it).
pub const REQUIRE_ALL_ENV: &str = "LB_REQUIRE_ALL_TESTS";
/// Env var naming the `lb` binary to test.
pub const LB_BIN_ENV: &str = "LB_BIN";

/// The CPUs this process may run on (its affinity), in order: where a test pins a
/// thread to make the program run on each CPU in turn (a veth runs its peer's XDP on the
/// sender's CPU; the connection table keeps a list per CPU).
pub fn allowed_cpus() -> Vec<usize> {
    let me = nix::unistd::Pid::from_raw(0);
    let allowed = nix::sched::sched_getaffinity(me).expect("sched_getaffinity");
    (0..nix::sched::CpuSet::count())
        .filter(|&cpu| allowed.is_set(cpu).unwrap_or(false))
        .collect()
}

/// The workspace root (the parent of this crate).
pub fn workspace_root() -> PathBuf {
    let root = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));
    root.canonicalize().unwrap_or_else(|_| root.to_path_buf())
}

/// Reports that a test cannot run here: a loud `SKIPPED` line on stderr, or a panic when
/// [`REQUIRE_ALL_ENV`] is `1`.
pub fn skip(test: &str, why: &str) {
    if std::env::var(REQUIRE_ALL_ENV).is_ok_and(|v| v == "1") {
        panic!("{test}: cannot run ({why}) and {REQUIRE_ALL_ENV}=1");
    }
    // Straight to fd 2: the test harness captures `eprintln!` of passing tests, and a
    // skip must be seen.
    // One write, so parallel tests do not interleave within the line.
    let line = format!("\n*** SKIPPED: {test}: {why} ***\n");
    let _ = std::io::stderr().write_all(line.as_bytes());
}

/// Root, `ip` and `ethtool`: enough to build the topology and run plain-kernel traffic.
/// Returns `false` (after [`skip`]) when something is missing.
pub fn require_root_tools(test: &str) -> bool {
    match check_root_tools() {
        Ok(()) => true,
        Err(why) => {
            skip(test, &why);
            false
        }
    }
}

/// Everything an end-to-end test needs: root and tools, bpffs, a non-empty eBPF object
/// and the `lb` binary. Returns the binary's path, or `None` after [`skip`].
pub fn require_e2e(test: &str) -> Option<PathBuf> {
    let checks = check_root_tools()
        .and_then(|()| ensure_bpffs())
        .and_then(|()| check_ebpf_object())
        .and_then(|()| find_lb_bin());
    match checks {
        Ok(bin) => {
            static ANNOUNCE: std::sync::Once = std::sync::Once::new();
            ANNOUNCE.call_once(|| announce_lb_bin(&bin));
            Some(bin)
        }
        Err(why) => {
            skip(test, &why);
            None
        }
    }
}

fn check_root_tools() -> Result<(), String> {
    if !nix::unistd::geteuid().is_root() {
        return Err("needs root (network namespaces, XDP)".into());
    }
    for (tool, arg) in [("ip", "-V"), ("ethtool", "--version")] {
        let ok = Command::new(tool)
            .arg(arg)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            return Err(format!("`{tool}` is not installed"));
        }
    }
    Ok(())
}

const BPF_FS: &str = "/sys/fs/bpf";

fn is_bpffs(path: &str) -> bool {
    // The statfs type field's width differs across targets: compare in u64.
    nix::sys::statfs::statfs(path).is_ok_and(|s| s.filesystem_type().0 as u64 == 0xcafe_4a11)
}

/// bpffs at /sys/fs/bpf; mounted here when missing (a fresh machine has none, and the
/// agent may pin there). Serialized: parallel tests must not stack several mounts.
pub fn ensure_bpffs() -> Result<(), String> {
    static MOUNT: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = MOUNT.lock().unwrap_or_else(|e| e.into_inner());
    if is_bpffs(BPF_FS) {
        return Ok(());
    }
    let _ = Command::new("mount")
        .args(["-t", "bpf", "bpf", BPF_FS])
        .stderr(Stdio::null())
        .status();
    if is_bpffs(BPF_FS) {
        Ok(())
    } else {
        Err(format!("no bpffs at {BPF_FS} and mounting one failed"))
    }
}

fn check_ebpf_object() -> Result<(), String> {
    if lb_userspace::EBPF_OBJECT.is_empty() || program::TEST_OBJECT.is_empty() {
        Err("the eBPF objects are empty (built with AYA_BUILD_SKIP=1?)".into())
    } else {
        Ok(())
    }
}

/// The `lb` binary: `$LB_BIN`, else the newest of `target/{release,debug}/lb` (under
/// `$CARGO_TARGET_DIR` when set, and under the workspace's `target/`).
pub fn find_lb_bin() -> Result<PathBuf, String> {
    if let Some(bin) = std::env::var_os(LB_BIN_ENV) {
        let bin = PathBuf::from(bin);
        return if bin.is_file() {
            Ok(bin)
        } else {
            Err(format!("{LB_BIN_ENV}={} is not a file", bin.display()))
        };
    }
    let mut dirs = Vec::new();
    if let Some(dir) = std::env::var_os("CARGO_TARGET_DIR") {
        dirs.push(PathBuf::from(dir));
    }
    dirs.push(workspace_root().join("target"));
    dirs.iter()
        .flat_map(|d| [d.join("release/lb"), d.join("debug/lb")])
        .filter_map(|p| Some((p.metadata().ok()?.modified().ok()?, p)))
        .max()
        .map(|(_, p)| p)
        .ok_or_else(|| {
            format!("no `lb` binary: build it (`cargo build -p lb-userspace`) or set {LB_BIN_ENV}")
        })
}

/// Says once which `lb` the tests run, and warns loudly when the agent's sources are
/// newer than it (a forgotten `cargo build -p lb-userspace` would test old code).
fn announce_lb_bin(bin: &Path) {
    let built = bin.metadata().and_then(|m| m.modified()).ok();
    let root = workspace_root();
    let newest_source = ["lb-userspace", "lb-ebpf", "lb-common"]
        .iter()
        .filter_map(|krate| newest_mtime(&root.join(krate).join("src")))
        .max();
    let mut line = format!("e2e: testing {}\n", bin.display());
    if let (Some(built), Some(source)) = (built, newest_source)
        && source > built
    {
        line.push_str(&format!(
            "*** WARNING: {} is older than the sources of lb-userspace/lb-ebpf/lb-common: \
             rebuild it (cargo build -p lb-userspace) or these tests run old code ***\n",
            bin.display()
        ));
    }
    let _ = std::io::stderr().write_all(line.as_bytes());
}

fn newest_mtime(dir: &Path) -> Option<std::time::SystemTime> {
    std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .filter_map(|e| {
            let meta = e.metadata().ok()?;
            if meta.is_dir() {
                newest_mtime(&e.path())
            } else {
                meta.modified().ok()
            }
        })
        .max()
}
