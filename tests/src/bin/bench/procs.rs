//! Guards for the third-party servers of the request benchmark (nginx, HAProxy), each
//! running in a namespace through `ip netns exec`, with its files in a private directory.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use lb_tests::Netns;

/// A process started with `ip netns exec NS PROGRAM ARGS...`, its output in `log`.
/// Dropping it sends SIGTERM, then SIGKILL after 5 s.
pub struct Daemon {
    name: String,
    child: Option<Child>,
    log: PathBuf,
}

impl Daemon {
    pub fn start(
        name: &str,
        ns: &Netns,
        program: &str,
        args: &[&str],
        log: &Path,
    ) -> Result<Daemon> {
        let out = File::create(log).with_context(|| format!("create {}", log.display()))?;
        // SIGTERM: the server dies with the benchmark even if it is killed before its
        // guards run.
        let mut cmd = ns.daemon_command(program, &out, libc::SIGTERM)?;
        cmd.args(args);
        let child = cmd
            .spawn()
            .with_context(|| format!("start {program} in {}", ns.name()))?;
        Ok(Daemon {
            name: name.into(),
            child: Some(child),
            log: log.into(),
        })
    }

    /// The pid of the program (`ip netns exec` execs it in place).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Fails with its log when it has exited.
    pub fn check_running(&mut self) -> Result<()> {
        if let Some(child) = self.child.as_mut()
            && let Some(status) = child.try_wait()?
        {
            self.child = None;
            bail!("{} exited ({status}); its log:\n{}", self.name, self.log());
        }
        Ok(())
    }

    fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let _ = lb_tests::netns::terminate(&mut child, Duration::from_secs(5), &self.name);
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.stop();
    }
}

/// nginx with one worker, answering every request with a small body, on port 80.
pub fn nginx(ns: &Netns, dir: &Path, body: &str) -> Result<Daemon> {
    std::fs::create_dir_all(dir)?;
    let d = dir.display();
    let conf = format!(
        "daemon off;\nmaster_process on;\nworker_processes 1;\npid {d}/nginx.pid;\n\
         error_log {d}/error.log warn;\n\
         events {{ worker_connections 4096; }}\n\
         http {{\n  access_log off;\n  keepalive_requests 10000000;\n  keepalive_timeout 75s;\n\
           client_body_temp_path {d}/body;\n  proxy_temp_path {d}/proxy;\n\
           fastcgi_temp_path {d}/fastcgi;\n  uwsgi_temp_path {d}/uwsgi;\n\
           scgi_temp_path {d}/scgi;\n\
           server {{\n    listen 80 backlog=4096;\n    listen [::]:80 backlog=4096;\n\
             location / {{ default_type text/plain; return 200 \"{body}\\n\"; }}\n  }}\n}}\n"
    );
    let path = dir.join("nginx.conf");
    std::fs::write(&path, conf)?;
    let path = path.to_string_lossy().into_owned();
    let prefix = format!("{d}/");
    let error_log = format!("{d}/error.log");
    let log = dir.join("stdout.log");
    // Runs as root: it only ever listens inside its namespace, and `user` would need an
    // account and group name that differ between distributions.
    Daemon::start(
        "nginx",
        ns,
        "nginx",
        &[
            "-p",
            &prefix,
            "-c",
            &path,
            "-e",
            &error_log,
            "-g",
            "user root;",
        ],
        &log,
    )
}

/// HAProxy in TCP mode on `listen`, round robin over `servers`.
pub fn haproxy(ns: &Netns, dir: &Path, listen: &str, servers: &[String]) -> Result<Daemon> {
    std::fs::create_dir_all(dir)?;
    let mut conf = String::from(
        "global\n  maxconn 8000\n\
         defaults\n  mode tcp\n  timeout connect 5s\n  timeout client 60s\n  timeout server 60s\n\
         frontend fe\n",
    );
    conf += &format!("  bind {listen}\n  default_backend be\nbackend be\n  balance roundrobin\n");
    for (i, s) in servers.iter().enumerate() {
        conf += &format!("  server b{} {s}\n", i + 1);
    }
    let path = dir.join("haproxy.cfg");
    std::fs::write(&path, conf)?;
    let path = path.to_string_lossy().into_owned();
    // -db: stay in the foreground, so the guard owns the process.
    Daemon::start(
        "haproxy",
        ns,
        "haproxy",
        &["-db", "-f", &path],
        &dir.join("haproxy.log"),
    )
}
