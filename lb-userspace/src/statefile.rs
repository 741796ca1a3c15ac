//! The state file: the runtime changes (`lb drain`, `lb ready`, `lb maint`, `lb backend
//! add|remove`) kept on disk, so that a restarted agent makes them again before its
//! first tables are written (a backend drained at runtime is not handed new flows for a
//! moment after a restart). A reload still applies the file as written, and says which
//! runtime changes it undoes; the state file then follows (it holds what remains).
//!
//! What is kept is the net difference between the running configuration and the file
//! (`State::runtime_differences`), rewritten whenever it changes (a temporary file
//! renamed over the old one, 0600) and removed when there is none. The controller does
//! not write it: it says what to write (`StateFileWrite`), and the caller writes it once
//! the controller's lock is let go, before it answers. Owns nothing that lives on; calls
//! `config`.

use std::{
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
};

use serde::{Deserialize, Serialize};

use crate::config::{BackendConfig, Config};

/// The file's format version; a file of another version is set aside, not applied.
const VERSION: u32 = 1;
/// A state file is a few KiB; anything much larger is not one.
const MAX_BYTES: u64 = 16 << 20;

/// What the file holds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Saved {
    pub version: u32,
    /// The configuration file the changes were made over: a state file left by another
    /// (a test bed's, an agent moved to another file) is not applied.
    pub config: PathBuf,
    pub changes: Vec<SavedChange>,
}

/// One runtime change, as the difference it makes to the file's configuration.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SavedChange {
    /// The VIP's name.
    pub vip: String,
    pub kind: ChangeKind,
    /// The backend as it runs (as the file had it, for one removed at runtime).
    pub backend: BackendConfig,
    /// As the command said it: "10.0.0.100:80/tcp backend 10.0.0.11 -> drain".
    pub what: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ChangeKind {
    /// Added at runtime.
    Added,
    /// Removed at runtime.
    Removed,
    /// Its admin state changed at runtime.
    State,
    /// Another of its settings differs.
    Settings,
}

#[derive(Debug, thiserror::Error)]
pub enum StateFileError {
    #[error("state file {path}: {why}")]
    Read { path: PathBuf, why: String },
    #[error("writing state file {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// A write of the state file the controller asked for, to make after its lock is let go
/// (`write`). Writes are made in the order they were asked: one that comes late, after
/// the write of a newer state, is skipped.
#[must_use = "the state file is written only by `write`"]
pub struct StateFileWrite {
    path: PathBuf,
    config: PathBuf,
    changes: Vec<SavedChange>,
    /// Its place among the writes one controller asks for (from 1).
    order: u64,
    /// The place of the last write made; held while a write is made.
    written: Arc<Mutex<u64>>,
}

/// Numbers the writes a controller asks for, and keeps the last one made.
#[derive(Default)]
pub struct StateFileWrites {
    asked: u64,
    written: Arc<Mutex<u64>>,
}

impl StateFileWrites {
    /// A write of `changes` to `path`, after every write asked before it.
    pub fn ask(&mut self, path: &Path, config: &Path, changes: Vec<SavedChange>) -> StateFileWrite {
        self.asked += 1;
        StateFileWrite {
            path: path.to_owned(),
            config: config.to_owned(),
            changes,
            order: self.asked,
            written: self.written.clone(),
        }
    }
}

impl StateFileWrite {
    /// Writes the file (a failure is logged: the agent serves on, only a restart would
    /// lose the changes).
    pub fn write(self) {
        let mut written = self.written.lock().expect("state file writes poisoned");
        if *written >= self.order {
            return;
        }
        if let Err(error) = save(&self.path, &self.config, &self.changes) {
            tracing::warn!("{error}: a restart would not keep the runtime changes");
        }
        *written = self.order;
    }
}

/// The changes in the file at `path`, made over configuration file `config`; none when
/// there is no file.
pub fn load(path: &Path, config: &Path) -> Result<Vec<SavedChange>, StateFileError> {
    use std::io::Read as _;
    let read_error = |why: String| StateFileError::Read {
        path: path.to_owned(),
        why,
    };
    let mut text = String::new();
    match std::fs::File::open(path) {
        Ok(file) => file
            .take(MAX_BYTES)
            .read_to_string(&mut text)
            .map_err(|e| read_error(e.to_string()))?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(read_error(e.to_string())),
    };
    let saved: Saved = serde_json::from_str(&text).map_err(|e| read_error(e.to_string()))?;
    if saved.version != VERSION {
        return Err(read_error(format!(
            "version {}, this agent reads {VERSION}",
            saved.version
        )));
    }
    if saved.config != identity(config) {
        return Err(read_error(format!(
            "written for configuration file {}, not {}",
            saved.config.display(),
            config.display()
        )));
    }
    Ok(saved.changes)
}

/// Writes `changes` (made over configuration file `config`) to `path` (its directory
/// made if missing), or removes the file when there are none. Atomic: a crash leaves the
/// old file or the new one.
pub fn save(path: &Path, config: &Path, changes: &[SavedChange]) -> Result<(), StateFileError> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let write_error = |source| StateFileError::Write {
        path: path.to_owned(),
        source,
    };
    if changes.is_empty() {
        return match std::fs::remove_file(path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(write_error(e)),
            _ => Ok(()),
        };
    }
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(write_error)?;
    }
    let text = serde_json::to_string_pretty(&Saved {
        version: VERSION,
        config: identity(config),
        changes: changes.to_vec(),
    })
    .expect("a state file serializes");
    let temporary = path.with_extension("json.tmp");
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&temporary)
        .map_err(write_error)?;
    file.write_all(text.as_bytes())
        .and_then(|()| file.sync_all())
        .map_err(write_error)?;
    std::fs::rename(&temporary, path).map_err(write_error)
}

/// The configuration file as the state file names it: its absolute path (the agent may
/// be started from another directory next time).
fn identity(config: &Path) -> PathBuf {
    std::fs::canonicalize(config).unwrap_or_else(|_| config.to_owned())
}

/// `file` with `changes` made again, and one line per change: restored, or why not (the
/// file changed since: the VIP or backend is gone, or it now says the same). A result
/// the configuration's rules refuse (the file changed under the saved changes) restores
/// nothing, and says so.
pub fn restore(file: &Config, changes: &[SavedChange]) -> (Config, Vec<String>) {
    let mut config = file.clone();
    let mut lines = Vec::new();
    for change in changes {
        let line = match apply(&mut config, change) {
            Ok(()) => format!("restored runtime change: {}", change.what),
            Err(why) => format!("runtime change not restored ({why}): {}", change.what),
        };
        lines.push(line);
    }
    if let Err(error) = config.validate() {
        return (
            file.clone(),
            vec![format!(
                "runtime changes not restored: together with the file they are refused \
                 ({error})"
            )],
        );
    }
    (config, lines)
}

fn apply(config: &mut Config, change: &SavedChange) -> Result<(), &'static str> {
    let vip = config
        .vips
        .iter_mut()
        .find(|v| v.name == change.vip)
        .ok_or("the file has no such VIP now")?;
    let address = change.backend.address;
    let position = vip.backends.iter().position(|b| b.address == address);
    match (change.kind, position) {
        (ChangeKind::Added, None) => vip.backends.push(change.backend.clone()),
        (ChangeKind::Added, Some(_)) => return Err("the file has the backend now"),
        (ChangeKind::Removed, Some(i)) => {
            vip.backends.remove(i);
        }
        (ChangeKind::State, Some(i)) => vip.backends[i].state = change.backend.state,
        (ChangeKind::Settings, Some(i)) => {
            let state = vip.backends[i].state;
            vip.backends[i] = BackendConfig {
                state,
                ..change.backend.clone()
            };
        }
        (_, None) => return Err("the file has no such backend now"),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::AdminState;

    fn config(backends: &[&str]) -> Config {
        let mut text = "[dataplane]\ninterface = \"eth0\"\n[[vip]]\nname = \"web\"\n\
                        address = \"10.0.0.100\"\nport = 80\nprotocol = \"tcp\"\n"
            .to_string();
        for b in backends {
            text += &format!("[[vip.backend]]\naddress = \"{b}\"\n");
        }
        Config::from_toml(&text).unwrap()
    }

    fn change(kind: ChangeKind, address: &str, state: AdminState) -> SavedChange {
        SavedChange {
            vip: "web".into(),
            kind,
            backend: BackendConfig {
                address: address.parse().unwrap(),
                weight: 2,
                mac: None,
                state,
                health: None,
                server_id: None,
            },
            what: format!("{address} {kind:?}"),
        }
    }

    #[test]
    fn saved_changes_are_made_again_where_the_file_still_allows() {
        let file = config(&["10.0.0.11", "10.0.0.12", "10.0.0.13"]);
        let changes = [
            change(ChangeKind::State, "10.0.0.11", AdminState::Drain),
            change(ChangeKind::Removed, "10.0.0.12", AdminState::Ready),
            change(ChangeKind::Added, "10.0.0.14", AdminState::Ready),
            // The file changed since: these no longer apply.
            change(ChangeKind::State, "10.0.0.99", AdminState::Maint),
            change(ChangeKind::Added, "10.0.0.13", AdminState::Ready),
        ];
        let (running, lines) = restore(&file, &changes);
        let backends = &running.vips[0].backends;
        let addresses: Vec<String> = backends.iter().map(|b| b.address.to_string()).collect();
        assert_eq!(addresses, ["10.0.0.11", "10.0.0.13", "10.0.0.14"]);
        assert_eq!(backends[0].state, AdminState::Drain);
        assert_eq!(backends[2].weight, 2);
        assert_eq!(
            lines,
            [
                "restored runtime change: 10.0.0.11 State",
                "restored runtime change: 10.0.0.12 Removed",
                "restored runtime change: 10.0.0.14 Added",
                "runtime change not restored (the file has no such backend now): 10.0.0.99 State",
                "runtime change not restored (the file has the backend now): 10.0.0.13 Added",
            ]
        );
        let mut gone = changes[0].clone();
        gone.vip = "api".into();
        let (_, lines) = restore(&file, &[gone]);
        assert!(lines[0].contains("no such VIP"), "{lines:?}");
        // A result the rules refuse restores nothing.
        let mut bad = change(ChangeKind::Added, "10.0.0.15", AdminState::Ready);
        bad.backend.weight = 0;
        let (running, lines) = restore(&file, &[changes[0].clone(), bad]);
        assert_eq!(running, file);
        assert!(
            lines[0].starts_with("runtime changes not restored"),
            "{lines:?}"
        );
    }

    #[test]
    fn the_file_round_trips_and_goes_when_nothing_is_left() {
        let dir = std::env::temp_dir().join(format!("lb-statefile-{}", std::process::id()));
        let path = dir.join("sub").join("state.json");
        let lb_toml = Path::new("/etc/lb/lb.toml");
        assert_eq!(
            load(&path, lb_toml).unwrap(),
            Vec::new(),
            "no file: nothing"
        );
        let changes = vec![change(ChangeKind::State, "10.0.0.11", AdminState::Drain)];
        save(&path, lb_toml, &changes).unwrap();
        assert_eq!(load(&path, lb_toml).unwrap(), changes);
        let other = load(&path, Path::new("/tmp/lb.toml"))
            .unwrap_err()
            .to_string();
        assert!(
            other.contains("written for configuration file /etc/lb/lb.toml, not /tmp/lb.toml"),
            "{other}"
        );
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        save(&path, lb_toml, &[]).unwrap();
        assert!(!path.exists());
        save(&path, lb_toml, &[]).unwrap();
        std::fs::write(
            &path,
            "{\"version\": 9, \"config\": \"/x\", \"changes\": []}",
        )
        .unwrap();
        let error = load(&path, lb_toml).unwrap_err().to_string();
        assert!(error.contains("version 9"), "{error}");
        std::fs::write(&path, "not json").unwrap();
        assert!(
            load(&path, lb_toml)
                .unwrap_err()
                .to_string()
                .starts_with("state file ")
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
