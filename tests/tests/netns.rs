//! `lb` under a real `ip netns exec` with the default pin path: each command gets a mount
//! namespace of its own with a fresh /sys, so a bpffs mounted at /sys/fs/bpf there is
//! private and goes with the command. The agent, `lb doctor` and `lb decap` must say so
//! instead of claiming pins that outlive them.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use lb_tests::netns::Netns;
use lb_tests::{agent::CliOutput, require_e2e, skip};

/// A namespace with a veth pair `lbn0`/`lbn1` up, `lbn0` addressed.
fn namespace(role: &str) -> Netns {
    Netns::with_veth(role, ["lbn0", "lbn1"], "10.91.0.2/24").expect("create a namespace")
}

/// `ip netns exec NS lb ARGS...`, to completion.
fn netns_exec(ns: &Netns, lb: &Path, args: &[&str]) -> Output {
    Command::new("ip")
        .args(["netns", "exec", ns.name()])
        .arg(lb)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run ip netns exec")
}

/// The command's exit status, stdout and stderr, for assertion messages.
fn text(out: &Output) -> String {
    CliOutput::from(out).to_string()
}

/// An agent config on `lbn0` with the default pin path, one VIP, no metrics port.
fn config(dir: &Path) -> PathBuf {
    let path = dir.join("lb.toml");
    let text = format!(
        "[dataplane]\ninterface = \"lbn0\"\nxdp_mode = \"generic\"\n\
         [control]\nsocket = \"{}\"\nmetrics = \"off\"\n\
         [[vip]]\nname = \"web\"\naddress = \"10.91.0.100\"\nport = 80\n\
         protocol = \"tcp\"\n[vip.health]\nkind = \"none\"\n\
         [[vip.backend]]\naddress = \"10.91.0.10\"\nmac = \"02:00:00:00:00:0b\"\n",
        dir.join("lb.sock").display()
    );
    std::fs::write(&path, text).expect("write the config");
    path
}

#[test]
fn lb_doctor_under_ip_netns_exec_warns_of_a_private_bpffs_and_suffixes_the_pins() {
    let test = "lb_doctor_under_ip_netns_exec_warns_of_a_private_bpffs_and_suffixes_the_pins";
    let Some(lb) = require_e2e(test) else { return };
    let ns = namespace("doc");
    let dir = tempfile::tempdir().expect("tempdir");
    let path = config(dir.path());
    let out = netns_exec(&ns, &lb, &["doctor", "--config", path.to_str().unwrap()]);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let bpffs = stdout
        .lines()
        .find(|l| l.contains(" bpffs: "))
        .unwrap_or_else(|| panic!("no bpffs check:\n{}", text(&out)));
    assert!(
        bpffs.starts_with("warn bpffs:")
            && bpffs.contains("only this mount namespace")
            && bpffs.contains("nsenter --net"),
        "{bpffs}"
    );
    // The namespace's own number in the pin path, whether or not /proc/1/ns/net is
    // readable here (when it is not, the agent may not take this for the initial one).
    let inode = std::fs::metadata(ns.path()).expect("stat the netns").ino();
    assert!(
        bpffs.contains(&format!("/sys/fs/bpf/lb/lbn0-ns{inode}")),
        "pins not suffixed with the namespace ({inode}): {bpffs}"
    );
}

#[test]
fn lb_decap_attach_under_ip_netns_exec_agrees_with_lb_decap_status() {
    let test = "lb_decap_attach_under_ip_netns_exec_agrees_with_lb_decap_status";
    let Some(lb) = require_e2e(test) else { return };
    let ns = namespace("decap");
    let attach = netns_exec(&ns, &lb, &["decap", "attach", "lbn0"]);
    let status = netns_exec(&ns, &lb, &["decap", "status"]);
    let listed = String::from_utf8_lossy(&status.stdout).contains("decap on lbn0");
    assert_eq!(
        attach.status.success(),
        listed,
        "attach and status disagree:\nattach: {}\nstatus: {}",
        text(&attach),
        text(&status)
    );
    assert!(
        String::from_utf8_lossy(&attach.stderr).contains("nsenter --net"),
        "the refusal names no fix: {}",
        text(&attach)
    );
    assert!(
        String::from_utf8_lossy(&status.stdout).contains("no bpf filesystem the host shares"),
        "{}",
        text(&status)
    );

    // The fix it names holds: a bpffs the host mounted outside /sys is seen by every
    // `ip netns exec`, so the program stays between commands.
    let pins = tempfile::tempdir().expect("tempdir");
    let mounted = Command::new("mount")
        .args(["-t", "bpf", "bpf"])
        .arg(pins.path())
        .status()
        .is_ok_and(|s| s.success());
    if !mounted {
        skip(test, "mounting a bpffs on a temporary directory failed");
        return;
    }
    let dir = pins.path().to_str().unwrap();
    let attach = netns_exec(&ns, &lb, &["decap", "attach", "lbn0", "--pin-path", dir]);
    let status = netns_exec(&ns, &lb, &["decap", "status", "--pin-path", dir]);
    let detach = netns_exec(&ns, &lb, &["decap", "detach", "lbn0", "--pin-path", dir]);
    let _ = Command::new("umount").arg(pins.path()).status();
    assert!(attach.status.success(), "{}", text(&attach));
    assert!(
        String::from_utf8_lossy(&status.stdout).contains("decap on lbn0"),
        "{}",
        text(&status)
    );
    assert!(detach.status.success(), "{}", text(&detach));
}

#[test]
fn an_agent_under_ip_netns_exec_says_its_program_goes_with_it() {
    let test = "an_agent_under_ip_netns_exec_says_its_program_goes_with_it";
    let Some(lb) = require_e2e(test) else { return };
    let ns = namespace("agent");
    let dir = tempfile::tempdir().expect("tempdir");
    let path = config(dir.path());
    let log_path = dir.path().join("agent.log");
    let log_file = std::fs::File::create(&log_path).expect("create the log");
    // `ip netns exec` execs lb: the child's pid is the agent's.
    let mut agent = Command::new("ip")
        .args(["netns", "exec", ns.name()])
        .arg(&lb)
        .args(["run", "--config", path.to_str().unwrap()])
        .stdin(Stdio::null())
        .stdout(log_file.try_clone().unwrap())
        .stderr(log_file)
        .spawn()
        .expect("start the agent");
    let log = || std::fs::read_to_string(&log_path).unwrap_or_default();
    let start = Instant::now();
    while !log().contains("serving") && start.elapsed() < Duration::from_secs(30) {
        if agent.try_wait().unwrap().is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let started = log();
    let pid = nix::unistd::Pid::from_raw(agent.id() as i32);
    let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
    let start = Instant::now();
    while agent.try_wait().unwrap().is_none() && start.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(100));
    }
    if agent.try_wait().unwrap().is_none() {
        let _ = agent.kill();
        let _ = agent.wait();
        panic!("the agent did not stop on SIGTERM:\n{}", log());
    }
    assert!(
        started.contains("serving"),
        "the agent did not start:\n{started}"
    );
    assert!(
        started.contains("only this process's mount namespace sees"),
        "no warning at start:\n{started}"
    );
    let stopped = log();
    assert!(
        stopped.contains("the program goes with the agent") && !stopped.contains("stays attached"),
        "{stopped}"
    );
    // And it did: nothing left on the interface.
    let link = lb_tests::netns::ip(&["-n", ns.name(), "link", "show", "lbn0"]).unwrap();
    assert!(
        !link.contains("xdp"),
        "still attached after the agent: {link}"
    );
}
