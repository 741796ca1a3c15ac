//! A guard for one running `lb run` inside a namespace.

use std::ffi::OsStr;
use std::fs::File;
use std::io::Read as _;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};

use crate::Netns;
use crate::netns::run_cmd;

/// How long `lb run` may take to print its `serving` line.
pub const START_TIMEOUT: Duration = Duration::from_secs(30);
/// How long it may take to exit after SIGTERM before it gets SIGKILL.
pub const STOP_TIMEOUT: Duration = Duration::from_secs(5);

/// `ip netns exec NS lb run --config FILE`, stdout and stderr to a log file. Dropping it
/// sends SIGTERM, waits up to [`STOP_TIMEOUT`], then SIGKILL.
pub struct Agent {
    child: Option<Child>,
    lb_bin: PathBuf,
    config_path: PathBuf,
    socket: PathBuf,
    log_path: PathBuf,
    exit: Option<ExitStatus>,
    /// No warning on drop (the failure was reported another way).
    quiet: bool,
}

impl Agent {
    /// Starts the agent and waits (up to [`START_TIMEOUT`]) for its `serving` line; fails
    /// with the log when it exits first or takes too long.
    pub fn start(
        lb_bin: &Path,
        ns: &Netns,
        config: &Path,
        socket: &Path,
        log_path: &Path,
    ) -> Result<Agent> {
        Agent::start_cancellable(lb_bin, ns, config, socket, log_path, &|| false)
    }

    /// [`Agent::start`] that gives up (and stops the agent) as soon as `cancelled()`.
    pub fn start_cancellable(
        lb_bin: &Path,
        ns: &Netns,
        config: &Path,
        socket: &Path,
        log_path: &Path,
        cancelled: &dyn Fn() -> bool,
    ) -> Result<Agent> {
        let log =
            File::create(log_path).with_context(|| format!("create {}", log_path.display()))?;
        // SIGTERM if the test process dies without running Drop: the agent must not
        // live on (and keep the namespace).
        let mut cmd = ns.daemon_command(lb_bin, &log, libc::SIGTERM)?;
        cmd.arg("run").arg("--config").arg(config);
        let child = cmd
            .spawn()
            .with_context(|| format!("spawn {}", lb_bin.display()))?;
        let mut agent = Agent {
            child: Some(child),
            lb_bin: lb_bin.into(),
            config_path: config.into(),
            socket: socket.into(),
            log_path: log_path.into(),
            exit: None,
            quiet: false,
        };
        if let Err(e) = agent.wait_serving(START_TIMEOUT, cancelled) {
            // The error carries the log already: stop it without a second report.
            agent.quiet = true;
            return Err(e);
        }
        Ok(agent)
    }

    fn wait_serving(&mut self, timeout: Duration, cancelled: &dyn Fn() -> bool) -> Result<()> {
        let start = Instant::now();
        loop {
            if self.log().lines().any(is_serving_line) {
                return Ok(());
            }
            if let Some(status) = self.try_wait()? {
                bail!(
                    "lb run exited ({status}) before serving; its log:\n{}",
                    self.log()
                );
            }
            if cancelled() {
                bail!("cancelled while waiting for lb run to serve");
            }
            if start.elapsed() > timeout {
                bail!(
                    "lb run did not print `serving` within {timeout:?}; its log:\n{}",
                    self.log()
                );
            }
            sleep(Duration::from_millis(50));
        }
    }

    /// The agent's `serving` line.
    pub fn serving_line(&self) -> Option<String> {
        self.log()
            .lines()
            .find(|l| is_serving_line(l))
            .map(str::to_string)
    }

    /// The agent's pid (that of `ip netns exec`, which execs the agent in place).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The configuration file it runs with (and re-reads on `lb reload`).
    pub fn config_path(&self) -> &Path {
        &self.config_path
    }

    /// The `lb` binary it runs.
    pub fn lb_bin(&self) -> &Path {
        &self.lb_bin
    }

    pub fn log_path(&self) -> &Path {
        &self.log_path
    }

    /// Everything the agent wrote so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_else(|e| format!("(no log: {e})"))
    }

    /// Its exit status, if it has exited.
    pub fn try_wait(&mut self) -> Result<Option<ExitStatus>> {
        if let Some(child) = self.child.as_mut()
            && let Some(status) = child.try_wait()?
        {
            self.exit = Some(status);
            self.child = None;
        }
        Ok(self.exit)
    }

    /// `lb status --socket PATH` (from the root namespace: the socket is a file).
    pub fn status(&self) -> Result<String> {
        self.ctl(&["status"])
    }

    /// `lb status --json`, parsed.
    pub fn status_json(&self) -> Result<serde_json::Value> {
        let text = self.ctl(&["status", "--json"])?;
        serde_json::from_str(&text).with_context(|| format!("lb status --json printed:\n{text}"))
    }

    /// Any control command: `lb ARGS... --socket PATH`.
    pub fn ctl(&self, args: &[&str]) -> Result<String> {
        let socket = self.socket.to_string_lossy();
        let mut all: Vec<&str> = args.to_vec();
        all.extend(["--socket", &socket]);
        run_cmd(&self.lb_bin.to_string_lossy(), &all)
    }

    /// Any control command, `lb ARGS... --socket PATH`, whatever its outcome: the exit
    /// status, stdout and stderr (for tests of refusals and error messages).
    pub fn cli(&self, args: &[&str]) -> Result<CliOutput> {
        let mut all: Vec<&OsStr> = args.iter().map(OsStr::new).collect();
        all.extend([OsStr::new("--socket"), self.socket.as_os_str()]);
        run_lb(&self.lb_bin, &all)
    }

    /// `GET /metrics` through the control socket: the Prometheus text exposition.
    pub fn metrics(&self) -> Result<String> {
        use std::io::Write as _;
        let mut stream = std::os::unix::net::UnixStream::connect(&self.socket)
            .with_context(|| format!("connect to {}", self.socket.display()))?;
        stream.set_read_timeout(Some(CLI_TIMEOUT))?;
        stream.write_all(b"GET /metrics HTTP/1.0\r\nHost: lb\r\n\r\n")?;
        let mut response = String::new();
        stream.read_to_string(&mut response)?;
        let (head, body) = response
            .split_once("\r\n\r\n")
            .ok_or_else(|| anyhow!("GET /metrics: not an HTTP response: {response:?}"))?;
        anyhow::ensure!(
            head.starts_with("HTTP/1.0 200") || head.starts_with("HTTP/1.1 200"),
            "GET /metrics: {head}"
        );
        Ok(body.to_string())
    }

    /// SIGTERM, up to [`STOP_TIMEOUT`], then SIGKILL. Returns how it exited; the caller
    /// can check that it was cleanly.
    pub fn stop(mut self) -> Result<ExitStatus> {
        self.shutdown()
    }

    fn shutdown(&mut self) -> Result<ExitStatus> {
        if let Some(status) = self.try_wait()? {
            return Ok(status);
        }
        let child = self
            .child
            .as_mut()
            .ok_or_else(|| anyhow!("no agent process"))?;
        let status = crate::netns::terminate(child, STOP_TIMEOUT, "lb run")?;
        self.exit = Some(status);
        self.child = None;
        Ok(status)
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        match self.shutdown() {
            Ok(_) if self.quiet => {}
            Ok(status) if status.success() || status.signal() == Some(libc::SIGTERM) => {}
            Ok(status) => eprintln!(
                "warning: lb run exited with {status}; log {}",
                self.log_path.display()
            ),
            Err(e) => eprintln!("warning: stopping lb run: {e:#}"),
        }
    }
}

/// How long one control command may take before it is killed.
pub const CLI_TIMEOUT: Duration = Duration::from_secs(15);

/// What one `lb` command did.
#[derive(Clone, Debug)]
pub struct CliOutput {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl CliOutput {
    pub fn success(&self) -> bool {
        self.status.success()
    }
}

impl From<&std::process::Output> for CliOutput {
    fn from(out: &std::process::Output) -> Self {
        Self {
            status: out.status,
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }
}

impl std::fmt::Display for CliOutput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}\n--- stdout ---\n{}--- stderr ---\n{}--- end ---",
            self.status, self.stdout, self.stderr
        )
    }
}

/// Runs `lb ARGS...` (from the calling thread's namespace) to completion, or kills it
/// after [`CLI_TIMEOUT`] (then fails): an agent that never answers must not hang a test.
pub fn run_lb<S: AsRef<OsStr>>(lb_bin: &Path, args: &[S]) -> Result<CliOutput> {
    let mut child = Command::new(lb_bin)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .with_context(|| format!("spawn {}", lb_bin.display()))?;
    // Read both pipes while it runs: a full pipe must not block it.
    let mut out = child.stdout.take().expect("piped stdout");
    let mut err = child.stderr.take().expect("piped stderr");
    let out_reader = std::thread::spawn(move || {
        let mut text = Vec::new();
        let _ = out.read_to_end(&mut text);
        text
    });
    let err_reader = std::thread::spawn(move || {
        let mut text = Vec::new();
        let _ = err.read_to_end(&mut text);
        text
    });
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if start.elapsed() > CLI_TIMEOUT {
            let _ = child.kill();
            let _ = child.wait();
            let line: Vec<String> = args
                .iter()
                .map(|a| a.as_ref().to_string_lossy().into_owned())
                .collect();
            bail!(
                "`lb {}` did not finish within {CLI_TIMEOUT:?} (killed)",
                line.join(" ")
            );
        }
        sleep(Duration::from_millis(10));
    };
    let stdout = out_reader.join().unwrap_or_default();
    let stderr = err_reader.join().unwrap_or_default();
    Ok(CliOutput {
        status,
        stdout: String::from_utf8_lossy(&stdout).into_owned(),
        stderr: String::from_utf8_lossy(&stderr).into_owned(),
    })
}

/// A line with the word `serving` in it.
fn is_serving_line(line: &str) -> bool {
    line.split(|c: char| !c.is_alphanumeric())
        .any(|w| w == "serving")
}

/// When the agent wrote a log line, by the timestamp it starts with (tracing's
/// `2026-12-06T21:40:00.123456Z`, UTC): the agent's own clock for when it decided
/// something, free of the delays of a test polling `lb status` on a loaded machine.
pub fn logged_at(line: &str) -> Option<std::time::SystemTime> {
    let stamp = line.split_whitespace().next()?.strip_suffix('Z')?;
    let (date, time) = stamp.split_once('T')?;
    let mut ymd = date.splitn(3, '-').map(|p| p.parse::<i64>().ok());
    let (y, m, d) = (ymd.next()??, ymd.next()??, ymd.next()??);
    let mut hms = time.splitn(3, ':');
    let (h, min) = (
        hms.next()?.parse::<u64>().ok()?,
        hms.next()?.parse::<u64>().ok()?,
    );
    let field = hms.next()?;
    let (secs, fraction) = field.split_once('.').unwrap_or((field, "0"));
    let secs: u64 = secs.parse().ok()?;
    // The fraction's digits as nanoseconds (`.25` is 250 ms).
    let digits = fraction.get(..fraction.len().min(9))?;
    let nanos = digits.parse::<u32>().ok()? * 10u32.pow(9 - digits.len() as u32);
    // Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's days_from_civil).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * ((m + 9) % 12) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = u64::try_from(era * 146_097 + doe - 719_468).ok()?;
    let whole = days * 86_400 + h * 3600 + min * 60 + secs;
    Some(std::time::UNIX_EPOCH + Duration::new(whole, nanos))
}

#[cfg(test)]
mod log_time_tests {
    use super::*;

    #[test]
    fn a_tracing_timestamp_reads_as_the_system_time_it_names() {
        let line = "2026-12-06T21:40:05.250000Z  INFO lb_userspace::health: backend is UP";
        let at = logged_at(line).unwrap();
        let since_epoch = at.duration_since(std::time::UNIX_EPOCH).unwrap();
        // date -d 2026-12-06T21:40:05Z +%s
        assert_eq!(since_epoch.as_millis(), 1_796_593_205_250);
        assert_eq!(
            logged_at("2000-02-29T00:00:00.000001Z x")
                .unwrap()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_micros(),
            951_782_400_000_001
        );
        assert_eq!(logged_at("lb: not a timestamp"), None);
    }
}
