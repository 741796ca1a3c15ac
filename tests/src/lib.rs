//! The namespace test bed for `lb`: a DSR topology in network namespaces (a client, the
//! balancer, N backends, all on one bridge), backend servers, client helpers, a guard
//! for the `lb` agent and a packet sniffer. Used by the end-to-end tests
//! (`tests/e2e.rs`) and by the `lab` binary behind `cargo xtask run`.
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
pub mod lab;
pub mod netns;
pub mod server;
pub mod sniff;

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

pub use agent::Agent;
pub use client::{Conn, Spread, ping, spread, tcp_request, udp_request, udp_spread};
pub use config::{AgentConfig, BackendConfig, Health, Protocol, VipConfig, XdpMode};
pub use lab::{Lab, LabOptions};
pub use netns::Netns;
pub use server::{TcpServer, UdpServer};
pub use sniff::{Sniffer, ip_src_is};

/// Env var that turns every skip into a failure (CI sets it).
pub const REQUIRE_ALL_ENV: &str = "LB_REQUIRE_ALL_TESTS";
/// Env var naming the `lb` binary to test.
pub const LB_BIN_ENV: &str = "LB_BIN";

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
    if lb_userspace::EBPF_OBJECT.is_empty() {
        Err("lb_userspace::EBPF_OBJECT is empty (built with AYA_BUILD_SKIP=1?)".into())
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
