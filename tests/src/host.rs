//! What the root tests take from the host, looked up rather than assumed: an
//! unprivileged user, the command-line tools some tests run (each with the Debian
//! package that has it, which `cargo xtask bootstrap` installs), and copies of binaries
//! that user can run wherever the checkout lives (root's `~/lb`, mode 0700, is out of
//! its reach).

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// A tool a test runs, and the Debian package it comes in (kept in step with xtask's
/// `APT_PACKAGES`).
#[derive(Clone, Copy, Debug)]
pub struct Tool {
    pub command: &'static str,
    pub package: &'static str,
}

pub const TCPDUMP: Tool = Tool {
    command: "tcpdump",
    package: "tcpdump",
};
/// Gives `lb top` a pseudo-terminal.
pub const SCRIPT: Tool = Tool {
    command: "script",
    package: "bsdutils",
};
/// Runs `lb` as an unprivileged user.
pub const SETPRIV: Tool = Tool {
    command: "setpriv",
    package: "util-linux",
};
/// Runs `lb` in a test's network namespace with the host's mounts (bpffs shared).
pub const NSENTER: Tool = Tool {
    command: "nsenter",
    package: "util-linux",
};
/// Makes test certificates and serves TLS (`openssl s_server`): the https checks' test.
pub const OPENSSL: Tool = Tool {
    command: "openssl",
    package: "openssl",
};
/// Reads the package's man pages.
pub const ZCAT: Tool = Tool {
    command: "zcat",
    package: "gzip",
};

/// Where `command` is on `PATH`, if it is there and executable.
pub fn which(command: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(command))
        .find(|p| {
            p.metadata()
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// Whether `tool` is installed; when it is not, a loud skip of `test` (a failure under
/// `LB_REQUIRE_ALL_TESTS=1`) naming the package to install.
pub fn require_tool(test: &str, tool: Tool) -> bool {
    if which(tool.command).is_some() {
        return true;
    }
    crate::skip(
        test,
        &format!(
            "`{}` is not installed (Debian package {}; `cargo xtask bootstrap` installs it)",
            tool.command, tool.package
        ),
    );
    false
}

/// A user without privileges, as the passwd database has it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct User {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
}

/// `nobody` if the system has it, else the first account that is neither root nor can log
/// in (`nologin` or `false` as its shell); an error when there is none.
pub fn unprivileged_user() -> Result<User, String> {
    if let Ok(Some(user)) = nix::unistd::User::from_name("nobody") {
        return Ok(User {
            name: user.name,
            uid: user.uid.as_raw(),
            gid: user.gid.as_raw(),
        });
    }
    let passwd = std::fs::read_to_string("/etc/passwd")
        .map_err(|e| format!("no user `nobody`, and /etc/passwd is unreadable: {e}"))?;
    passwd
        .lines()
        .find_map(parse_unprivileged)
        .ok_or_else(|| "no unprivileged user: neither `nobody` nor a nologin account".into())
}

/// A passwd line's user when it is not root and cannot log in.
fn parse_unprivileged(line: &str) -> Option<User> {
    let fields: Vec<&str> = line.split(':').collect();
    let [name, _, uid, gid, _, _, shell] = fields[..] else {
        return None;
    };
    let (uid, gid) = (uid.parse().ok()?, gid.parse().ok()?);
    let no_login = shell.ends_with("/nologin") || shell.ends_with("/false");
    (uid != 0 && gid != 0 && no_login).then(|| User {
        name: name.into(),
        uid,
        gid,
    })
}

/// A fresh directory under /tmp that every user may enter (0755, where tempfile makes
/// 0700), removed on drop. /tmp, not `$TMPDIR`: that may sit under a 0700 home.
pub fn open_dir() -> std::io::Result<tempfile::TempDir> {
    let dir = tempfile::Builder::new().prefix("lbt-").tempdir_in("/tmp")?;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))?;
    Ok(dir)
}

/// `bin` copied into `dir` (from [`open_dir`]), executable by all: the checkout's
/// `target/` may be under a directory an unprivileged user cannot traverse.
pub fn copy_out(bin: &Path, dir: &Path) -> std::io::Result<PathBuf> {
    let name = bin.file_name().unwrap_or_else(|| "bin".as_ref());
    let copy = dir.join(name);
    std::fs::copy(bin, &copy)?;
    std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o755))?;
    Ok(copy)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_nologin_account_is_unprivileged_and_root_or_a_login_is_not() {
        assert_eq!(
            parse_unprivileged("daemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin"),
            Some(User {
                name: "daemon".into(),
                uid: 1,
                gid: 1
            })
        );
        assert_eq!(parse_unprivileged("root:x:0:0:root:/root:/bin/bash"), None);
        assert_eq!(
            parse_unprivileged("root:x:0:0:root:/root:/usr/sbin/nologin"),
            None
        );
        assert_eq!(
            parse_unprivileged("ann:x:1000:1000::/home/ann:/bin/bash"),
            None
        );
        assert_eq!(parse_unprivileged("broken line"), None);
    }

    #[test]
    fn which_finds_sh_and_not_a_made_up_name() {
        assert!(which("sh").is_some());
        assert!(which("lb-no-such-tool-here").is_none());
    }
}
