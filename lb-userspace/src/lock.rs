//! One agent per interface. Before `lb run` touches the pins or the interface it takes
//! two exclusive locks (flock), and holds them until it exits; the kernel drops them
//! when the process ends, however it ends, so a lock is never stale:
//! - the interface's, `iface-<name>-net<inode>.lock` (the interface in its network
//!   namespace): two agents would fight over its XDP hook;
//! - the pin directory's, `pins-<path, escaped>.lock`: a second agent there would
//!   adopt (or replace) the first one's maps and tables.
//!
//! A bpffs holds no regular files, so the lock files live in [`LOCK_DIR`]. Each says
//! which agent holds it (pid, control socket, config file), for the refusal.

use std::{
    fs::File,
    io::{Read as _, Seek as _, Write as _},
    os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt},
    path::{Path, PathBuf},
};

use nix::fcntl::{Flock, FlockArg};

use crate::config::Config;

/// Where the lock files are.
pub const LOCK_DIR: &str = "/run/lb";
/// How long a held lock is waited for before the agent gives up.
const EXIT_GRACE: std::time::Duration = std::time::Duration::from_secs(1);

/// The locks of a running agent; dropping it removes the lock files and releases them.
#[derive(Debug)]
pub struct AgentLock {
    dir: PathBuf,
    /// What the lock files say of this agent.
    me: String,
    locks: Vec<(PathBuf, Flock<File>)>,
}

impl Drop for AgentLock {
    fn drop(&mut self) {
        // Removed while still held: an agent that opened the file meanwhile finds its
        // lock on a file that is gone, and tries again (`take`).
        for (path, _) in &self.locks {
            let _ = std::fs::remove_file(path);
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error(
        "another agent runs on {what}: {holder}; stop it first (this agent changed \
         nothing; lock file {})",
        path.display()
    )]
    Held {
        what: String,
        holder: String,
        path: PathBuf,
    },
    #[error("lock file {}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Takes the interface's lock in [`LOCK_DIR`] (see the module doc); `lock_pins` adds
/// the pin directory's.
pub fn acquire(config: &Config, config_path: &Path) -> Result<AgentLock, LockError> {
    acquire_in(Path::new(LOCK_DIR), config, config_path)
}

/// Takes the interface's lock in `dir` (made 0700 if missing).
pub fn acquire_in(dir: &Path, config: &Config, config_path: &Path) -> Result<AgentLock, LockError> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|source| LockError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
    let mut held = AgentLock {
        dir: dir.to_path_buf(),
        me: format!(
            "pid {}, control socket {}, config {}",
            std::process::id(),
            config.control.socket.display(),
            config_path.display()
        ),
        locks: Vec::new(),
    };
    let interface = &config.dataplane.interface;
    held.take(
        format!("iface-{interface}-net{}.lock", netns_inode()),
        format!("interface {interface}"),
    )?;
    Ok(held)
}

impl AgentLock {
    /// Adds the lock of `pin_dir`, once the bpffs it lies on is mounted: the lock is for
    /// the directory on that filesystem (agents in other mount namespaces may have
    /// bpffs of their own at the same path).
    pub fn lock_pins(&mut self, pin_dir: &Path) -> Result<(), LockError> {
        let device = pin_dir
            .ancestors()
            .find_map(|p| std::fs::metadata(p).ok())
            .map_or(0, |m| m.dev());
        self.take(
            format!("pins-dev{device}-{}.lock", escape(pin_dir)),
            format!("pin directory {}", pin_dir.display()),
        )
    }

    fn take(&mut self, name: String, what: String) -> Result<(), LockError> {
        let path = self.dir.join(name);
        let lock = take(&path, &what, &self.me)?;
        self.locks.push((path, lock));
        Ok(())
    }
}

/// The inode of this process's network namespace: interface names are per namespace
/// (0 when /proc does not say).
fn netns_inode() -> u64 {
    std::fs::metadata("/proc/self/ns/net").map_or(0, |m| m.ino())
}

/// A path as one file name: `%` and `/` written as `%25` and `%2F`.
fn escape(path: &Path) -> String {
    path.to_string_lossy()
        .replace('%', "%25")
        .replace('/', "%2F")
}

/// Locks `path` (created 0600) without waiting, and writes `me` into it; or says who
/// holds it.
fn take(path: &Path, what: &str, me: &str) -> Result<Flock<File>, LockError> {
    // A lock taken on a file its holder removed as it exited is no lock: try again on
    // the file the path names now (a few times: each needs another agent exiting).
    for _ in 0..3 {
        let lock = take_soon(path, what, me)?;
        let current = std::fs::metadata(path).map(|m| m.ino());
        if let (Ok(current), Ok(ours)) = (current, lock.metadata().map(|m| m.ino()))
            && current == ours
        {
            return Ok(lock);
        }
    }
    Err(LockError::Io {
        path: path.to_path_buf(),
        source: std::io::Error::other("the lock file keeps being replaced"),
    })
}

/// `take_once`, tried again for up to [`EXIT_GRACE`] while the lock is held: an agent
/// just killed (`kill -9` and a new `lb run` at once) holds it until its exit is done.
fn take_soon(path: &Path, what: &str, me: &str) -> Result<Flock<File>, LockError> {
    let started = std::time::Instant::now();
    loop {
        match take_once(path, what, me) {
            Err(LockError::Held { .. }) if started.elapsed() < EXIT_GRACE => {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            taken => return taken,
        }
    }
}

fn take_once(path: &Path, what: &str, me: &str) -> Result<Flock<File>, LockError> {
    let io_error = |source| LockError::Io {
        path: path.to_path_buf(),
        source,
    };
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(path)
        .map_err(io_error)?;
    let mut lock = match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
        Ok(lock) => lock,
        Err((mut file, nix::errno::Errno::EWOULDBLOCK)) => {
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            let holder = match holder.trim() {
                "" => "an agent that has not said which yet".to_string(),
                text => text.to_string(),
            };
            return Err(LockError::Held {
                what: what.to_string(),
                holder,
                path: path.to_path_buf(),
            });
        }
        Err((_, errno)) => return Err(io_error(errno.into())),
    };
    lock.set_len(0).map_err(io_error)?;
    lock.rewind().map_err(io_error)?;
    writeln!(lock, "{me}").map_err(io_error)?;
    Ok(lock)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(interface: &str, socket: &str) -> Config {
        let text =
            format!("[dataplane]\ninterface = \"{interface}\"\n[control]\nsocket = \"{socket}\"\n");
        Config::from_toml(&text).unwrap()
    }

    fn held(result: Result<AgentLock, LockError>) -> (String, String) {
        match result {
            Err(LockError::Held { what, holder, .. }) => (what, holder),
            other => panic!("expected Held, got {other:?}"),
        }
    }

    #[test]
    fn a_second_agent_is_refused_with_the_first_ones_name() {
        let dir = tempfile_dir("second");
        let locks = dir.join("locks");
        let (pins_a, pins_b) = (dir.join("pins-a"), dir.join("pins-b"));
        let take = |interface: &str, pins: &Path, socket: &str, path: &str| {
            let config = config(interface, socket);
            let mut lock = acquire_in(&locks, &config, Path::new(path))?;
            lock.lock_pins(pins)?;
            Ok(lock)
        };
        let first = take("eth9", &pins_a, "/run/first.sock", "/etc/lb/first.toml").unwrap();
        // Same interface, another socket, config and pin directory.
        let (what, holder) = held(take("eth9", &pins_b, "/run/second.sock", "/tmp/2.toml"));
        assert_eq!(what, "interface eth9");
        assert_eq!(
            holder,
            format!(
                "pid {}, control socket /run/first.sock, config /etc/lb/first.toml",
                std::process::id()
            )
        );
        // Another interface, the first one's pin directory.
        let (what, _) = held(take("eth8", &pins_a, "/run/third.sock", "/tmp/3.toml"));
        assert_eq!(what, format!("pin directory {}", pins_a.display()));
        // Another interface and its own pins: fine, beside the first.
        let other = take("eth8", &pins_b, "/run/fourth.sock", "/tmp/4.toml").unwrap();
        // Once the first is gone, the second may run.
        drop(first);
        drop(other);
        let second = take("eth9", &pins_b, "/run/second.sock", "/tmp/2.toml").unwrap();
        assert_eq!(
            std::fs::read_dir(&locks).unwrap().count(),
            2,
            "the lock files of agents that ran are gone"
        );
        drop(second);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn pin_paths_escape_to_one_file_name() {
        assert_eq!(
            escape(Path::new("/sys/fs/bpf/lb/eth0%")),
            "%2Fsys%2Ffs%2Fbpf%2Flb%2Feth0%25"
        );
    }

    fn tempfile_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("lb-lock-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }
}
