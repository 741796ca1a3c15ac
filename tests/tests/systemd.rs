//! The package's hardened unit under a real systemd. PID 1 here is not systemd, so the
//! test boots one: systemd as PID 1 of new PID, mount, cgroup and network namespaces,
//! on an overlay of the host's root (what it writes goes to a tmpfs), with a cgroup2
//! hierarchy of its own subtree, a /dev of its own and the kernel's variables read-only
//! (some are global), booting a target that starts nothing. The package is
//! installed there with `dpkg -i` (its maintainer scripts run against that systemd), the
//! agent started by `systemctl start lb` on a veth of the container's own namespace, and
//! the unit's bounds read from the running agent. Killing that PID 1 ends everything it
//! started: the namespace, the overlay, the veth and the program on it.

use std::io::Write as _;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use lb_tests::skip;

const SYSTEMD: &str = "/lib/systemd/systemd";
/// How long the container's systemd may take to come up.
const BOOT_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the agent may take to answer `lb status` after `systemctl start`.
const SERVE_TIMEOUT: Duration = Duration::from_secs(30);

/// Mounts the container's root and execs systemd in it: $1 root, $2 scratch, $3 the
/// package. Runs in the new namespaces (`unshare`), as their first process.
const BOOT_SCRIPT: &str = r#"set -e
R=$1; T=$2; DEB=$3
mount --make-rprivate /
mount -t tmpfs tmpfs "$T"
mkdir "$T/upper" "$T/work"
mount -t overlay overlay -o "lowerdir=/,upperdir=$T/upper,workdir=$T/work" "$R"
mount -t proc proc "$R/proc"
mount -t sysfs sysfs "$R/sys"
mount -t cgroup2 cgroup2 "$R/sys/fs/cgroup"
mount -t bpf bpf "$R/sys/fs/bpf"
# A /dev of its own (systemd makes its static nodes there, not in the host's), with the
# host's few character devices a system needs.
mount -t tmpfs -o mode=755 tmpfs "$R/dev"
for node in null zero full random urandom tty; do
    touch "$R/dev/$node"
    mount --bind "/dev/$node" "$R/dev/$node"
done
mkdir "$R/dev/pts" "$R/dev/shm"
mount -t devpts -o newinstance,ptmxmode=0666 devpts "$R/dev/pts"
ln -s pts/ptmx "$R/dev/ptmx"
mount -t tmpfs tmpfs "$R/dev/shm"
# Read-only kernel variables: some are the host's, not the namespaces' (systemd-sysctl
# then skips itself).
mount --bind "$R/proc/sys" "$R/proc/sys"
mount -o remount,bind,ro "$R/proc/sys"
mount -t tmpfs tmpfs "$R/run"
mount -t tmpfs tmpfs "$R/tmp"
cp "$DEB" "$R/var/tmp/lb.deb"
mkdir -p "$R/etc/systemd/system"
printf '[Unit]\nDescription=lb test boot\nDefaultDependencies=no\n' \
    > "$R/etc/systemd/system/lb-test.target"
exec chroot "$R" /usr/bin/env container=lb-test \
    /lib/systemd/systemd --unit=lb-test.target --log-target=null --show-status=false
"#;

/// The agent's configuration in the container: one VIP on the container's veth.
const CONFIG: &str = r#"[dataplane]
interface = "lbs0"
xdp_mode = "generic"

[control]
metrics = "127.0.0.1:9650"

[[vip]]
name = "web"
address = "10.93.0.100"
port = 80
protocol = "tcp"

[vip.health]
kind = "none"

[[vip.backend]]
address = "10.93.0.10"
mac = "02:00:00:00:00:0a"
"#;

/// A systemd booted as PID 1 of namespaces of its own. Dropping it kills that PID 1
/// (and so everything in the namespaces) and removes its cgroups.
struct Container {
    /// `unshare`, whose child is the container's systemd.
    unshare: Child,
    /// The container's PID 1, as the host numbers it.
    systemd: i32,
    cgroup: PathBuf,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Container {
    /// Boots it, or says (a loud skip) why systemd cannot run here.
    fn boot(test: &str, deb: &Path) -> Option<Container> {
        if let Err(why) = can_boot() {
            skip(test, &why);
            return None;
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let cgroup = cgroup2_mount()
            .expect("checked")
            .join(format!("lbt{}-systemd", std::process::id()));
        std::fs::create_dir_all(&cgroup).expect("create the container's cgroup");
        let (root, scratch) = (dir.path().join("root"), dir.path().join("scratch"));
        for path in [&root, &scratch] {
            std::fs::create_dir(path).unwrap();
        }
        let log = dir.path().join("boot.log");
        let procs = cgroup.join("cgroup.procs");
        let mut command = Command::new("sh");
        command
            .arg("-c")
            .arg(format!(
                "echo $$ > {} && exec unshare --mount --pid --fork --cgroup --net --kill-child \
                 sh -c \"$0\" boot \"$@\"",
                procs.display()
            ))
            .arg(BOOT_SCRIPT)
            .args([&root, &scratch])
            .arg(deb)
            .stdin(Stdio::null());
        let log_file = std::fs::File::create(&log).expect("create the boot log");
        command
            .stdout(log_file.try_clone().unwrap())
            .stderr(log_file);
        // SAFETY: prctl is async-signal-safe. The container dies with the test.
        unsafe {
            command.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let unshare = command.spawn().expect("start unshare");
        let mut container = Container {
            systemd: 0,
            unshare,
            cgroup,
            log,
            _dir: dir,
        };
        match container.wait_running() {
            Ok(()) => Some(container),
            Err(why) => {
                skip(test, &format!("systemd did not come up: {why}"));
                None
            }
        }
    }

    /// Waits for the container's systemd to say it is running (or degraded: a unit of
    /// the host's that cannot start in a container is no matter here).
    fn wait_running(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + BOOT_TIMEOUT;
        let mut last = String::new();
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.unshare.try_wait() {
                return Err(format!("it exited ({status}): {}", self.boot_log()));
            }
            if self.systemd == 0 {
                self.systemd = child_of(self.unshare.id()).unwrap_or(0);
            } else {
                let out = self.run(&["systemctl", "is-system-running"]);
                last = String::from_utf8_lossy(&out.stdout).into_owned();
                if matches!(last.trim(), "running" | "degraded") {
                    return Ok(());
                }
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Err(format!(
            "not running within {BOOT_TIMEOUT:?} (last: {last:?}): {}",
            self.boot_log()
        ))
    }

    fn boot_log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// A command in the container (its namespaces and root), to completion.
    fn run(&self, args: &[&str]) -> Output {
        Command::new("nsenter")
            .arg("--target")
            .arg(self.systemd.to_string())
            .args(["--mount", "--pid", "--net", "--root", "--wd", "--"])
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("run nsenter")
    }

    /// `run`, which must succeed; its stdout.
    fn ok(&self, args: &[&str]) -> String {
        let out = self.run(args);
        assert!(out.status.success(), "{args:?}: {}", text(&out));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Writes `contents` to `path` inside the container (through PID 1's root).
    fn write(&self, path: &str, contents: &str) {
        let host = PathBuf::from(format!("/proc/{}/root{path}", self.systemd));
        let mut file = std::fs::File::create(&host).unwrap_or_else(|e| panic!("{path}: {e}"));
        file.write_all(contents.as_bytes()).unwrap();
    }

    /// The unit's journal, for assertion messages.
    fn journal(&self) -> String {
        text(&self.run(&["journalctl", "--no-pager", "-u", "lb.service"]))
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        if self.systemd != 0 {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(self.systemd),
                nix::sys::signal::SIGKILL,
            );
        }
        let _ = self.unshare.kill();
        let _ = self.unshare.wait();
        // The cgroups empty a moment after their processes are gone.
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.cgroup.exists() && Instant::now() < deadline {
            remove_cgroups(&self.cgroup);
            std::thread::sleep(Duration::from_millis(50));
        }
        if self.cgroup.exists() {
            eprintln!("warning: could not remove {}", self.cgroup.display());
        }
    }
}

/// Why systemd cannot be booted here, if it cannot.
fn can_boot() -> Result<(), String> {
    if !nix::unistd::geteuid().is_root() {
        return Err("needs root (namespaces, mounts)".into());
    }
    if !Path::new(SYSTEMD).exists() {
        return Err(format!("no {SYSTEMD} (Debian package systemd)"));
    }
    for tool in ["unshare", "nsenter", "chroot", "dpkg"] {
        if lb_tests::host::which(tool).is_none() {
            return Err(format!("`{tool}` is not installed"));
        }
    }
    let filesystems = std::fs::read_to_string("/proc/filesystems").unwrap_or_default();
    for fs in ["overlay", "cgroup2", "bpf"] {
        if !filesystems.split_whitespace().any(|name| name == fs) {
            return Err(format!("the kernel has no {fs} file system"));
        }
    }
    cgroup2_mount()
        .map(drop)
        .ok_or_else(|| "no cgroup2 hierarchy is mounted".into())
}

/// Where the host mounts its cgroup2 hierarchy (`/sys/fs/cgroup`, or `.../unified`).
fn cgroup2_mount() -> Option<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    mounts.lines().find_map(|line| {
        let (left, right) = line.split_once(" - ")?;
        let mount_point = left.split_whitespace().nth(4)?;
        (right.split_whitespace().next() == Some("cgroup2")).then(|| PathBuf::from(mount_point))
    })
}

/// The one child of process `pid`.
fn child_of(pid: u32) -> Option<i32> {
    let children = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).ok()?;
    children.split_whitespace().next()?.parse().ok()
}

/// Removes `dir` and the cgroups below it, deepest first (what is still busy stays).
fn remove_cgroups(dir: &Path) {
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                remove_cgroups(&entry.path());
            }
        }
    }
    let _ = std::fs::remove_dir(dir);
}

fn text(out: &Output) -> String {
    format!(
        "{}\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The capabilities the unit bounds the agent to (CAP_NET_ADMIN 12, CAP_NET_RAW 13,
/// CAP_SYS_ADMIN 21, CAP_PERFMON 38, CAP_BPF 39), as /proc/PID/status shows a mask.
const UNIT_CAPABILITIES: u64 = 1 << 12 | 1 << 13 | 1 << 21 | 1 << 38 | 1 << 39;

#[test]
fn the_packaged_unit_starts_the_agent_under_a_real_systemd() {
    let test = "the_packaged_unit_starts_the_agent_under_a_real_systemd";
    let Some(deb) = std::env::var_os("LB_DEB") else {
        skip(
            test,
            "LB_DEB is not set (`cargo xtask test` builds the package)",
        );
        return;
    };
    let Some(container) = Container::boot(test, Path::new(&deb)) else {
        return;
    };

    // The package's maintainer scripts against this systemd: the group the unit needs,
    // the unit known.
    container.ok(&["dpkg", "-i", "/var/tmp/lb.deb"]);
    container.ok(&["getent", "group", "lb"]);
    let unit = container.ok(&["systemctl", "cat", "lb.service"]);
    assert!(unit.contains("CapabilityBoundingSet="), "{unit}");

    for args in [
        &["ip", "link", "set", "lo", "up"][..],
        &[
            "ip", "link", "add", "lbs0", "type", "veth", "peer", "name", "lbs1",
        ],
        &["ip", "link", "set", "lbs0", "up"],
        &["ip", "link", "set", "lbs1", "up"],
        &["ip", "addr", "add", "10.93.0.2/24", "dev", "lbs0"],
    ] {
        container.ok(args);
    }
    container.write("/etc/lb/lb.toml", CONFIG);

    // Started as an operator does (the unit's ExecStartPre, `lb check`, runs first).
    let started = container.run(&["systemctl", "start", "lb.service"]);
    assert!(
        started.status.success(),
        "systemctl start lb: {}\n{}",
        text(&started),
        container.journal()
    );
    let deadline = Instant::now() + SERVE_TIMEOUT;
    let status = loop {
        let out = container.run(&["lb", "status"]);
        if out.status.success() {
            break String::from_utf8_lossy(&out.stdout).into_owned();
        }
        assert!(
            Instant::now() < deadline,
            "lb status never answered: {}\n{}",
            text(&out),
            container.journal()
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(status.contains("lbs0"), "{status}");
    let link = container.ok(&["ip", "-d", "link", "show", "lbs0"]);
    assert!(
        link.contains("xdpgeneric"),
        "the program is not attached: {link}"
    );

    // The bounds the unit sets, on the running agent.
    let pid = container.ok(&["systemctl", "show", "--property=MainPID", "--value", "lb"]);
    let proc_status = container.ok(&["cat", &format!("/proc/{}/status", pid.trim())]);
    let field = |name: &str| {
        proc_status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map(str::trim)
            .unwrap_or_else(|| panic!("no {name} in:\n{proc_status}"))
            .to_string()
    };
    assert_eq!(
        u64::from_str_radix(&field("CapBnd:"), 16).unwrap(),
        UNIT_CAPABILITIES,
        "{proc_status}"
    );
    assert_eq!(field("NoNewPrivs:"), "1");
    // ProtectSystem=strict: the agent sees the root file system read-only (the last
    // mount on / is the one it sees).
    let mounts = container.ok(&["cat", &format!("/proc/{}/mounts", pid.trim())]);
    let root = mounts
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .rfind(|fields| fields.get(1) == Some(&"/"))
        .unwrap_or_else(|| panic!("no / in:\n{mounts}"));
    assert!(
        root[3].starts_with("ro"),
        "/ is writable for the agent:\n{mounts}"
    );

    // Reload (SIGHUP) keeps it serving; stop is clean and leaves the program attached.
    container.ok(&["systemctl", "reload", "lb.service"]);
    container.ok(&["lb", "status"]);
    container.ok(&["systemctl", "stop", "lb.service"]);
    let result = container.ok(&["systemctl", "show", "--property=Result", "--value", "lb"]);
    assert_eq!(result.trim(), "success", "{}", container.journal());
    let link = container.ok(&["ip", "-d", "link", "show", "lbs0"]);
    assert!(link.contains("xdpgeneric"), "stopping detached: {link}");
    // The unit's own mount namespace (ProtectSystem=) still pins on the host's bpffs,
    // and the agent knows it.
    let journal = container.journal();
    assert!(
        journal.contains("the program stays attached to lbs0")
            && !journal.contains("only this process's mount namespace"),
        "{journal}"
    );

    // A purge takes the data path off.
    container.ok(&["dpkg", "--purge", "lb"]);
    let link = container.ok(&["ip", "-d", "link", "show", "lbs0"]);
    assert!(
        !link.contains("xdpgeneric"),
        "still attached after purge: {link}"
    );
}
