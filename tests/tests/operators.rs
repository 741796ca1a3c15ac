//! End to end (issue 41): the operators' read-only socket, runtime changes logged with
//! the asker's uid, and kept across a restart in the state file.
//!
//! - `[control] operators_group`: a real unprivileged user of that group (`setpriv`) reads
//!   status and explains a flow through the operators' socket; a change asked there is
//!   refused (403, "read-only"); the control socket itself stays root's; a user outside
//!   the group is refused.
//! - A drain asked by root is logged with "uid 0"; the agent restarts and the backend is
//!   still drained (status lists the runtime change and its state file); a reload undoes
//!   it and says so.
//!
//! - Under the shipped unit's limits (no CAP_CHOWN): an agent with the group as a
//!   supplementary group (the unit's `SupplementaryGroups=lb`) gives the socket to it,
//!   0660, and members read while others are refused; without the group it refuses to
//!   start, naming `control.operators_group`, and never opens the socket to all.
//!
//! Needs root, bpffs, the eBPF object, a built `lb`, `setpriv` and an unprivileged user;
//! otherwise it prints `SKIPPED` (or fails under `LB_REQUIRE_ALL_TESTS=1`).
//! `cargo test -p lb-tests --test operators`.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use lb_tests::{
    Agent, Health, Lab, LabOptions, Protocol, VipView, XdpMode, agent::CliOutput, host,
    require_e2e, skip,
};

const WAIT: Duration = Duration::from_secs(10);

/// `lb ARGS...` as uid `uid` with primary group `gid` and no other group.
fn lb_as(bin: &Path, uid: u32, gid: u32, args: &[&str]) -> CliOutput {
    let out = Command::new("setpriv")
        .args([
            &format!("--reuid={uid}"),
            &format!("--regid={gid}"),
            "--clear-groups",
        ])
        .arg(bin)
        .args(args)
        .output()
        .expect("run setpriv");
    CliOutput::from(&out)
}

fn start(lab: &Lab, bin: &Path, config: &Path) -> Agent {
    start_with(lab, bin, config).expect("start the agent")
}

fn start_with(lab: &Lab, bin: &Path, config: &Path) -> anyhow::Result<Agent> {
    Agent::start(
        bin,
        lab.lb(),
        config,
        &lab.socket_path(),
        &lab.dir().join("lb.log"),
    )
}

/// The lab's configuration with an operators' socket at `operators` for `group`,
/// written into the lab's directory.
fn operators_config(lab: &Lab, group: &str, operators: &Path) -> PathBuf {
    let vip = lab.vip("web", false, 80, Protocol::Tcp, Health::fast_tcp());
    let config = lab
        .agent_config(XdpMode::Native, vec![vip])
        .to_toml()
        .replacen(
            "[control]\n",
            &format!(
                "[control]\noperators_group = \"{group}\"\noperators_socket = \"{}\"\n",
                operators.display()
            ),
            1,
        );
    let config_path = lab.dir().join("lb.toml");
    std::fs::write(&config_path, &config).unwrap();
    config_path
}

/// What both tests stand on: an unprivileged user and its group, a lab with backends
/// on port 80, and a directory that user may reach (the checkout may be under a 0700
/// home) holding its copy of `lb` and the operators' socket the configuration names.
struct OperatorsLab {
    bin: PathBuf,
    user: host::User,
    group: String,
    lab: Lab,
    open: tempfile::TempDir,
    user_bin: PathBuf,
    operators: PathBuf,
    config_path: PathBuf,
}

impl OperatorsLab {
    /// `None` (after a loud skip) when `test` cannot run here.
    fn new(test: &str) -> Option<Self> {
        let bin = require_e2e(test)?;
        if !host::require_tool(test, host::SETPRIV) {
            return None;
        }
        let user = match host::unprivileged_user() {
            Ok(user) => user,
            Err(why) => {
                skip(test, &why);
                return None;
            }
        };
        let group = nix::unistd::Group::from_gid(nix::unistd::Gid::from_raw(user.gid))
            .ok()
            .flatten()
            .expect("the unprivileged user's group")
            .name;
        let mut lab = Lab::new(LabOptions::default()).expect("build the lab");
        lab.serve_tcp(80, false).expect("backend servers");
        let open = host::open_dir().expect("an open directory");
        let user_bin = host::copy_out(&bin, open.path()).expect("copy lb out");
        let operators = open.path().join("lb-operators.sock");
        let config_path = operators_config(&lab, &group, &operators);
        Some(Self {
            bin,
            user,
            group,
            lab,
            open,
            user_bin,
            operators,
            config_path,
        })
    }
}

fn backend_state(agent: &Agent, address: std::net::IpAddr) -> String {
    let view = VipView::fetch(agent, "web").expect("status");
    view.backend(address).expect("the backend").state.clone()
}

#[test]
fn operators_read_through_their_socket_and_runtime_changes_survive_a_restart() {
    let test = "operators_read_through_their_socket_and_runtime_changes_survive_a_restart";
    let Some(OperatorsLab {
        bin,
        user,
        lab,
        user_bin,
        operators,
        config_path,
        // Holds the user's copy of lb and the socket: kept to the test's end.
        open: _open,
        group: _,
    }) = OperatorsLab::new(test)
    else {
        return;
    };
    let agent = start(&lab, &bin, &config_path);
    lb_tests::wait_backends_up(&agent, "web", WAIT, &|| false).expect("backends up");

    // The operators' socket: 0660, the group's.
    let meta = std::fs::metadata(&operators).expect("the operators' socket");
    assert_eq!(meta.permissions().mode() & 0o777, 0o660);
    assert_eq!(std::os::unix::fs::MetadataExt::gid(&meta), user.gid);
    let ops = operators.to_str().unwrap();
    let as_operator = |args: &[&str]| lb_as(&user_bin, user.uid, user.gid, args);

    // A member reads status and explains a flow.
    let status = as_operator(&["status", "--socket", ops]);
    assert!(status.success(), "{}", status);
    assert!(status.stdout.contains("vip web"), "{}", status);
    let target = format!("{}:80/tcp", lab.vip4());
    let explain = as_operator(&["explain", &target, "10.99.0.1:40000", "--socket", ops]);
    assert!(explain.success(), "{}", explain);
    // ... and is refused every change, by the agent, with the reason.
    let b1 = lab.backend_addr(0, false).to_string();
    for change in [
        vec!["drain", target.as_str(), b1.as_str()],
        vec!["backend", "remove", target.as_str(), b1.as_str()],
        vec!["reload"],
    ] {
        let out = as_operator(&[change.as_slice(), &["--socket", ops]].concat());
        assert!(!out.success(), "{change:?}: {}", out);
        assert!(
            out.stderr.contains("the operators' socket is read-only"),
            "{change:?}: {}",
            out
        );
    }
    assert_eq!(backend_state(&agent, lab.backend_addr(0, false)), "ready");
    // The control socket stays root's; a user outside the group cannot open this one.
    let main = as_operator(&["status", "--socket", lab.socket_path().to_str().unwrap()]);
    assert!(!main.success(), "{}", main);
    let outsider_gid = if user.gid == 1 { 2 } else { 1 };
    let outsider = lb_as(
        &user_bin,
        user.uid,
        outsider_gid,
        &["status", "--socket", ops],
    );
    assert!(!outsider.success(), "{}", outsider);
    assert!(
        outsider.stderr.contains("permission denied"),
        "{}",
        outsider
    );

    // Root drains backend-1: logged with the uid.
    agent.ctl(&["drain", &target, &b1]).expect("lb drain");
    let log = agent.log();
    assert!(
        log.contains("runtime change by uid 0 (pid")
            && log.contains(&format!("{target} backend {b1} -> drain")),
        "{log}"
    );
    let refused = as_operator(&["ready", &target, &b1, "--socket", ops]);
    assert!(!refused.success(), "{}", refused);
    assert!(
        agent
            .log()
            .contains(&format!("refused /backend/state to uid {}", user.uid)),
        "{}",
        agent.log()
    );

    // A restart: still drained, and status says it is a runtime change.
    agent.stop().expect("stop the agent");
    let agent = start(&lab, &bin, &config_path);
    assert!(
        agent.log().contains(&format!(
            "restored runtime change: {target} backend {b1} -> drain"
        )),
        "{}",
        agent.log()
    );
    let state = backend_state(&agent, lab.backend_addr(0, false));
    assert!(state == "draining" || state == "drained", "{state}");
    let status = agent.status_json().expect("status");
    assert_eq!(
        status["agent"]["runtime_changes"],
        serde_json::json!([format!("{target} backend {b1} -> drain")]),
        "{status:#}"
    );
    let text_status = agent.status().expect("status");
    assert!(
        text_status.contains("runtime changes (kept across restarts in"),
        "{text_status}"
    );
    // A reload applies the file: it undoes the drain, says so, and nothing is kept.
    let reload = agent.ctl(&["reload"]).expect("lb reload");
    assert!(
        reload.contains(&format!(
            "undoes runtime change: {target} backend {b1} -> drain"
        )),
        "{reload}"
    );
    assert_eq!(backend_state(&agent, lab.backend_addr(0, false)), "ready");
    let state_file = status["agent"]["state_file"].as_str().unwrap().to_string();
    assert!(!Path::new(&state_file).exists(), "{state_file} is left");
    drop(agent);
    drop(lab);
}

/// An executable `lb` in `dir` that runs `bin` as root without CAP_CHOWN (bounding and
/// inheritable sets, as the shipped unit's CapabilityBoundingSet= leaves it out), with
/// `groups` as its only supplementary groups.
fn lb_without_chown(bin: &Path, dir: &Path, groups: Option<u32>) -> PathBuf {
    let setpriv = host::which(host::SETPRIV.command).expect("setpriv");
    let groups = groups.map_or("--clear-groups".to_string(), |gid| {
        format!("--groups={gid}")
    });
    let wrapper = dir.join("lb-without-chown");
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\nexec {} --bounding-set=-chown --inh-caps=-chown {groups} {} \"$@\"\n",
            setpriv.display(),
            bin.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).unwrap();
    wrapper
}

#[test]
fn without_cap_chown_the_operators_socket_goes_to_a_supplementary_group_or_not_at_all() {
    let test = "without_cap_chown_the_operators_socket_goes_to_a_supplementary_group_or_not_at_all";
    let Some(OperatorsLab {
        bin,
        user,
        group,
        lab,
        open,
        user_bin,
        operators,
        config_path,
    }) = OperatorsLab::new(test)
    else {
        return;
    };

    // Not a member of the group: the agent refuses to start, says why, and leaves no
    // socket behind (it used to open it 0666 instead).
    let outsider = lb_without_chown(&bin, open.path(), None);
    let refused = start_with(&lab, &outsider, &config_path)
        .err()
        .expect("an agent that cannot give the socket to the group does not start");
    let refused = format!("{refused:#}");
    assert!(
        refused.contains("`control.operators_group`: cannot give the operators' socket")
            && refused.contains(&group),
        "{refused}"
    );
    assert!(!operators.exists(), "the operators' socket is left behind");

    // A member (the unit's SupplementaryGroups=): the socket is root's and the group's, 0660.
    let member = lb_without_chown(&bin, open.path(), Some(user.gid));
    let agent = start_with(&lab, &member, &config_path).expect("start the agent");
    let caps = std::fs::read_to_string(format!("/proc/{}/status", agent.pid().unwrap())).unwrap();
    let effective = caps
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .map(|hex| u64::from_str_radix(hex.trim(), 16).unwrap())
        .expect("CapEff");
    // CAP_CHOWN is capability 0.
    assert_eq!(effective & 1, 0, "the agent has CAP_CHOWN");
    let meta = std::fs::metadata(&operators).expect("the operators' socket");
    assert_eq!(meta.permissions().mode() & 0o777, 0o660);
    assert_eq!(std::os::unix::fs::MetadataExt::uid(&meta), 0);
    assert_eq!(std::os::unix::fs::MetadataExt::gid(&meta), user.gid);
    let ops = operators.to_str().unwrap();
    let status = lb_as(&user_bin, user.uid, user.gid, &["status", "--socket", ops]);
    assert!(status.success(), "{}", status);
    assert!(status.stdout.contains("vip web"), "{}", status);
    let outsider_gid = if user.gid == 1 { 2 } else { 1 };
    let denied = lb_as(
        &user_bin,
        user.uid,
        outsider_gid,
        &["status", "--socket", ops],
    );
    assert!(!denied.success(), "{}", denied);
    assert!(denied.stderr.contains("permission denied"), "{}", denied);
    drop(agent);
    drop(lab);
}
