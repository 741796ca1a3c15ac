//! What the CLI says when it cannot do its job: `lb run` without privileges, a control
//! socket the user may not open, `lb detach` with nothing attached. Needs a built `lb`;
//! the first two need root (to run `lb` as an unprivileged user with `setpriv`).
//! `cargo test -p lb-tests --test cli`.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use lb_tests::{agent::CliOutput, find_lb_bin, host, skip};

/// `bin` copied where an unprivileged user can run it (the checkout may be under a 0700
/// home), and a function running it as that user with `setpriv`.
fn as_unprivileged(bin: &Path, dir: &Path) -> (PathBuf, impl Fn(&Path, &[&str]) -> Output) {
    let user = host::unprivileged_user().expect("an unprivileged user");
    let bin = host::copy_out(bin, dir).expect("copy lb where the user can run it");
    let run = move |bin: &Path, args: &[&str]| {
        Command::new("setpriv")
            .args([
                &format!("--reuid={}", user.uid),
                &format!("--regid={}", user.gid),
                "--clear-groups",
            ])
            .arg(bin)
            .args(args)
            .output()
            .expect("run setpriv")
    };
    (bin, run)
}

/// The command's exit status, stdout and stderr, for assertion messages.
fn text(out: &Output) -> String {
    CliOutput::from(out).to_string()
}

fn config(dir: &Path, socket: &Path) -> PathBuf {
    let path = dir.join("lb.toml");
    let text = format!(
        "[dataplane]\ninterface = \"lb-none0\"\npin_path = \"{}\"\n[control]\nsocket = \"{}\"\n\
         metrics = \"off\"\n",
        dir.join("pins").display(),
        socket.display()
    );
    std::fs::write(&path, text).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    path
}

fn root_and_bin(test: &str) -> Option<PathBuf> {
    if !nix::unistd::geteuid().is_root() {
        skip(test, "needs root (to run lb as an unprivileged user)");
        return None;
    }
    if let Err(why) = host::unprivileged_user() {
        skip(test, &why);
        return None;
    }
    if !host::require_tool(test, host::SETPRIV) {
        return None;
    }
    match find_lb_bin() {
        Ok(bin) => Some(bin),
        Err(why) => {
            skip(test, &why);
            None
        }
    }
}

/// Without root or CAP_BPF/CAP_NET_ADMIN, `lb run` says so (exit 1) before it touches
/// anything; and the root-only control socket gives "permission denied", not "is lb run
/// running?".
#[test]
fn without_privileges_lb_says_what_it_needs() {
    let test = "without_privileges_lb_says_what_it_needs";
    let Some(bin) = root_and_bin(test) else {
        return;
    };
    let dir = host::open_dir().unwrap();
    let (bin, as_user) = as_unprivileged(&bin, dir.path());
    // A socket like the agent's: root's, 0600.
    let socket = dir.path().join("lb.sock");
    let _listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o600)).unwrap();
    let config = config(dir.path(), &socket);
    let config = config.to_str().unwrap();

    let run = as_user(&bin, &["run", "--config", config]);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(1), "{}", text(&run));
    assert!(
        stderr.contains("lb run needs root, or CAP_BPF and CAP_NET_ADMIN"),
        "{}",
        text(&run)
    );
    assert!(!dir.path().join("pins").exists(), "lb run touched the pins");

    let status = as_user(&bin, &["status", "--socket", socket.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&status.stderr);
    assert_eq!(status.status.code(), Some(1), "{}", text(&status));
    assert!(
        stderr.contains("permission denied") && stderr.contains("root"),
        "{}",
        text(&status)
    );
    assert!(!stderr.contains("is `lb run` running"), "{}", text(&status));
}

/// `lb detach` says whether a program was attached: exit 1 when nothing was (stale map
/// pins are removed all the same), exit 0 when it removed the pinned link.
#[test]
fn detach_says_whether_anything_was_attached() {
    let test = "detach_says_whether_anything_was_attached";
    let bin = match find_lb_bin() {
        Ok(bin) => bin,
        Err(why) => return skip(test, &why),
    };
    let dir = tempfile::tempdir().unwrap();
    let config = config(dir.path(), &dir.path().join("lb.sock"));
    let detach = || {
        Command::new(&bin)
            .arg("detach")
            .arg("--config")
            .arg(&config)
            .output()
            .unwrap()
    };
    let pins = dir.path().join("pins");

    let nothing = detach();
    assert_eq!(nothing.status.code(), Some(1), "{}", text(&nothing));
    assert!(
        String::from_utf8_lossy(&nothing.stderr).contains("nothing was attached"),
        "{}",
        text(&nothing)
    );

    std::fs::create_dir_all(&pins).unwrap();
    std::fs::write(pins.join("LB_STALE"), "").unwrap();
    let stale = detach();
    assert_eq!(stale.status.code(), Some(1), "{}", text(&stale));
    assert!(
        String::from_utf8_lossy(&stale.stderr).contains("removed 1 stale map pin(s)"),
        "{}",
        text(&stale)
    );

    // Plain files stand in for the pins (removing a pin is unlinking it).
    std::fs::create_dir_all(&pins).unwrap();
    for name in ["link", "LB_VIPS"] {
        std::fs::write(pins.join(name), "").unwrap();
    }
    let attached = detach();
    assert!(attached.status.success(), "{}", text(&attached));
    assert!(
        String::from_utf8_lossy(&attached.stdout)
            .contains("detached: removed the pinned link and 1 map pin(s)"),
        "{}",
        text(&attached)
    );
    assert!(!pins.exists());
}
