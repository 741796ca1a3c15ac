//! A guard owning one named network namespace, and ways to run code inside it.

use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus};
use std::sync::Once;
use std::sync::atomic::{AtomicU32, Ordering};
use std::thread;

use anyhow::{Context, Result, bail};
use nix::sched::CloneFlags;

/// Prefix of every namespace this crate creates: `lbt<pid>-<counter>-<role>`.
pub const PREFIX: &str = "lbt";

static COUNTER: AtomicU32 = AtomicU32::new(0);
static SWEEP: Once = Once::new();

/// One network namespace, created by `ip netns add` and deleted on drop.
///
/// Names are `lbt<pid>-<counter>-<role>`: unique across the tests of one binary (the
/// counter) and across concurrent binaries (the pid).
#[derive(Debug)]
pub struct Netns {
    name: String,
}

impl Netns {
    /// Creates a namespace for `role` (a short word: "client", "lb", "b1"...) with `lo` up.
    pub fn new(role: &str) -> Result<Netns> {
        SWEEP.call_once(sweep_stale);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let name = format!("{PREFIX}{}-{n}-{role}", std::process::id());
        ip(&["netns", "add", &name])?;
        let ns = Netns { name };
        ip(&["-n", &ns.name, "link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// A namespace with a veth pair `ends` up and `address` (with its prefix) on the
    /// first: a data-path interface for tests that need no peers behind it.
    pub fn with_veth(role: &str, ends: [&str; 2], address: &str) -> Result<Netns> {
        let ns = Netns::new(role)?;
        let [first, second] = ends;
        for args in [
            &["link", "add", first, "type", "veth", "peer", "name", second][..],
            &["link", "set", first, "up"],
            &["link", "set", second, "up"],
            &["addr", "add", address, "dev", first],
        ] {
            let mut full = vec!["-n", ns.name()];
            full.extend_from_slice(args);
            ip(&full)?;
        }
        Ok(ns)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The bind mount that `ip netns` keeps for it.
    pub fn path(&self) -> PathBuf {
        PathBuf::from("/run/netns").join(&self.name)
    }

    /// Moves the calling thread into this namespace. Only for threads made for that
    /// purpose: the thread stays there (and keeps the namespace alive) until it ends.
    pub fn enter(&self) -> Result<()> {
        let file =
            File::open(self.path()).with_context(|| format!("open {}", self.path().display()))?;
        nix::sched::setns(&file, CloneFlags::CLONE_NEWNET)
            .with_context(|| format!("setns into {}", self.name))
    }

    /// Runs `f` on a new thread inside the namespace and returns its result. A panic in
    /// `f` is propagated to the caller (so assertions inside work as usual).
    pub fn run<T: Send, F: FnOnce() -> T + Send>(&self, f: F) -> Result<T> {
        thread::scope(|s| {
            let handle = s.spawn(|| -> Result<T> {
                self.enter()?;
                Ok(f())
            });
            match handle.join() {
                Ok(r) => r,
                Err(panic) => std::panic::resume_unwind(panic),
            }
        })
    }

    /// Spawns a long-lived thread inside the namespace. Whoever holds the handle must make
    /// the thread end before the namespace is dropped.
    pub fn spawn<T, F>(&self, thread_name: &str, f: F) -> Result<thread::JoinHandle<Result<T>>>
    where
        T: Send + 'static,
        F: FnOnce() -> Result<T> + Send + 'static,
    {
        let path = self.path();
        let ns_name = self.name.clone();
        thread::Builder::new()
            .name(thread_name.into())
            .spawn(move || {
                let file = File::open(&path).with_context(|| format!("open {}", path.display()))?;
                nix::sched::setns(&file, CloneFlags::CLONE_NEWNET)
                    .with_context(|| format!("setns into {ns_name}"))?;
                f()
            })
            .context("spawn thread")
    }

    /// `ip netns exec NAME program` for a long-running process: no stdin, stdout and
    /// stderr to `log`, its own process group (a Ctrl-C reaches the test, which stops it
    /// in order), and `on_parent_death` if the test process dies without running its
    /// guards (`ip netns exec` execs the program in place, so the setting reaches it).
    pub fn daemon_command(
        &self,
        program: impl AsRef<std::ffi::OsStr>,
        log: &File,
        on_parent_death: libc::c_int,
    ) -> Result<Command> {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", self.name()])
            .arg(program)
            .stdin(std::process::Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log.try_clone()?)
            .process_group(0);
        // SAFETY: prctl is async-signal-safe.
        unsafe {
            cmd.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, on_parent_death) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        Ok(cmd)
    }

    /// Runs `ip netns exec NAME cmd args...`; returns stdout, or fails with stderr.
    pub fn exec(&self, cmd: &str, args: &[&str]) -> Result<String> {
        let mut all = vec!["netns", "exec", &self.name, cmd];
        all.extend_from_slice(args);
        run_cmd("ip", &all)
    }

    /// Sets a sysctl of this namespace (`net.ipv4.ip_forward`-style key): /proc/sys/net
    /// shows the namespace of the thread that opens it.
    pub fn sysctl(&self, key: &str, value: &str) -> Result<()> {
        let path = PathBuf::from("/proc/sys").join(key.replace('.', "/"));
        self.run(|| std::fs::write(&path, value))?
            .with_context(|| format!("sysctl {key}={value} in {}", self.name))
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        if let Err(e) = ip(&["netns", "del", &self.name]) {
            eprintln!("warning: could not delete namespace {}: {e:#}", self.name);
        }
    }
}

/// Runs `ip ARGS...` in the current (normally the root) namespace; `ip -n NS ...` reaches
/// into a namespace without entering it.
pub fn ip(args: &[&str]) -> Result<String> {
    run_cmd("ip", args)
}

/// Runs a command to completion; stdout on success, else an error with its stderr.
pub fn run_cmd(cmd: &str, args: &[&str]) -> Result<String> {
    let out = Command::new(cmd)
        .args(args)
        // Its own process group: a Ctrl-C meant for the lab must not kill an `ip netns
        // del` halfway through the teardown.
        .process_group(0)
        .output()
        .with_context(|| format!("run {cmd}"))?;
    if !out.status.success() {
        bail!(
            "`{cmd} {}` failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Deletes namespaces left by processes of this crate that died without cleaning up
/// (a test binary killed by SIGKILL): `lbt<pid>-...` whose pid no longer runs.
fn sweep_stale() {
    let Ok(entries) = std::fs::read_dir("/run/netns") else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix(PREFIX)
            .and_then(|rest| rest.split_once('-'))
            .and_then(|(pid, _)| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if pid != std::process::id() && !PathBuf::from(format!("/proc/{pid}")).exists() {
            match ip(&["netns", "del", &name]) {
                Ok(_) => eprintln!("removed stale namespace {name} (its process {pid} is gone)"),
                Err(e) => eprintln!("warning: stale namespace {name}: {e:#}"),
            }
        }
    }
}

/// Stops a daemon this test bed started: SIGTERM, up to `grace` for it to exit, then
/// SIGKILL (with a warning naming `what`). Returns how it ended.
pub fn terminate(
    child: &mut Child,
    grace: std::time::Duration,
    what: &str,
) -> std::io::Result<ExitStatus> {
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
    let start = std::time::Instant::now();
    while start.elapsed() < grace {
        if let Some(status) = child.try_wait()? {
            return Ok(status);
        }
        thread::sleep(std::time::Duration::from_millis(20));
    }
    eprintln!("warning: {what} did not exit within {grace:?} of SIGTERM: SIGKILL");
    let _ = child.kill();
    child.wait()
}
