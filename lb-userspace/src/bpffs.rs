//! Whether pins outlive the process that made them: a bpf filesystem that only this
//! process's mount namespace sees goes (and every pin on it, and so every link pinned
//! there) when the last process in that namespace exits.
//!
//! `ip netns exec` is the usual way to get there: it gives the command a mount namespace
//! of its own with a fresh /sys (the sysfs of the network namespace), so /sys/fs/bpf is
//! not mounted there, and a bpffs mounted on it is private to that one command.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// How far the filesystem of a pin directory reaches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reach {
    /// The host's init (pid 1) sees the same filesystem: pins outlive this process.
    Shared,
    /// Only this mount namespace sees it: pins go when its last process exits.
    Private,
    /// /proc/1/mountinfo is unreadable here, so it cannot be told.
    Unknown,
}

/// How far the filesystem holding `pin_dir` (its nearest existing ancestor: for an
/// unmounted /sys/fs/bpf, the /sys a bpffs would be mounted on) reaches.
pub fn reach(pin_dir: &Path) -> Reach {
    let Ok(init_mounts) = std::fs::read_to_string("/proc/1/mountinfo") else {
        return Reach::Unknown;
    };
    let existing = pin_dir
        .ancestors()
        .find(|p| p.exists())
        .unwrap_or(Path::new("/"));
    let Ok(dev) = std::fs::metadata(existing).map(|m| m.dev()) else {
        return Reach::Unknown;
    };
    reach_of(dev, &init_mounts)
}

/// `Shared` when a mount in `init_mounts` (/proc/1/mountinfo) has device `dev`: the same
/// superblock, so the same pins.
fn reach_of(dev: u64, init_mounts: &str) -> Reach {
    let wanted = format!(
        "{}:{}",
        nix::sys::stat::major(dev),
        nix::sys::stat::minor(dev)
    );
    // mountinfo: "id parent major:minor root mountpoint ...".
    let shared = init_mounts
        .lines()
        .any(|line| line.split_whitespace().nth(2) == Some(wanted.as_str()));
    if shared {
        Reach::Shared
    } else {
        Reach::Private
    }
}

/// What an operator does about a private bpffs, in one sentence.
pub const PRIVATE_FIX: &str = "mount a bpffs the host shares and point pin_path (or \
     --pin-path) at it (on the host: mkdir -p /run/lb/bpf && mount -t bpf bpf /run/lb/bpf), \
     or run under `nsenter --net=/run/netns/NAME` instead of `ip netns exec`, which keeps \
     the host's mounts";

/// Refuses a `pin_dir` whose bpffs is private to this mount namespace: a command that
/// pins a program there (`lb decap attach`, `lb peer attach`) would see it detach as
/// the command exits, while it reported success.
pub fn require_shared(pin_dir: &Path) -> anyhow::Result<()> {
    anyhow::ensure!(
        reach(pin_dir) != Reach::Private,
        "{} lies on a bpf filesystem only this command's mount namespace sees (`ip netns \
         exec` gives each command a fresh /sys): the program would detach as this command \
         exits; {PRIVATE_FIX}",
        pin_dir.display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const INIT: &str = "45 23 0:40 / /sys/fs/bpf rw,relatime - bpf bpf rw\n\
                        53 27 0:41 / /run/lb-tests/bpf rw,relatime - bpf bpf rw\n";

    #[test]
    fn a_filesystem_pid_1_mounts_too_is_shared() {
        assert_eq!(
            reach_of(nix::sys::stat::makedev(0, 41), INIT),
            Reach::Shared
        );
    }

    #[test]
    fn a_filesystem_pid_1_lacks_is_private() {
        // 0:4 is not 0:41 (nor 0:40): a prefix is no match.
        assert_eq!(
            reach_of(nix::sys::stat::makedev(0, 4), INIT),
            Reach::Private
        );
        assert_eq!(
            reach_of(nix::sys::stat::makedev(0, 77), INIT),
            Reach::Private
        );
    }
}
