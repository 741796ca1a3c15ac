//! `lb check` and `lb run` make the same checks of a configuration against the host
//! (issue 34; issue 41 items 1 and 8): an address of the balancer's own interface as a
//! backend or as a VIP, and a cluster key others may read, are refused by both, with
//! exit 2 and the field named, before anything is attached. Needs root (a namespace with
//! an interface of its own) and a built `lb`.
//! `cargo xtask test -- structure`.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use lb_tests::{find_lb_bin, netns::Netns, skip};

/// A file whose interface `veth-lb` (10.98.0.2/24) is the namespace's own (default pin
/// path: every case is refused before a pin is touched, which the test checks).
fn config(dir: &Path, vip: &str, backend: &str, extra: &str) -> std::path::PathBuf {
    let path = dir.join(format!("{vip}-{backend}-{}.toml", extra.len()));
    let text = format!(
        "[dataplane]\ninterface = \"veth-lb\"\nxdp_mode = \"generic\"\n\
         [control]\nsocket = \"{}\"\nmetrics = \"off\"\n{extra}\n\
         [[vip]]\nname = \"web\"\naddress = \"{vip}\"\nport = 8080\nprotocol = \"tcp\"\n\
         [vip.health]\nkind = \"none\"\n\
         [[vip.backend]]\naddress = \"{backend}\"\nmac = \"02:00:00:00:00:0b\"\n",
        dir.join("lb.sock").display(),
    );
    std::fs::write(&path, text).unwrap();
    path
}

/// A namespace whose interface `veth-lb` (10.98.0.2/24, up) is its own, with its peer up.
fn namespace_with_veth(role: &str) -> Netns {
    let ns = Netns::new(role).unwrap();
    for args in [
        &[
            "link",
            "add",
            "veth-lb",
            "type",
            "veth",
            "peer",
            "name",
            "veth-peer",
        ][..],
        &["addr", "add", "10.98.0.2/24", "dev", "veth-lb"],
        &["link", "set", "veth-lb", "up"],
        &["link", "set", "veth-peer", "up"],
    ] {
        let mut all = vec!["-n", ns.name()];
        all.extend_from_slice(args);
        lb_tests::netns::ip(&all).unwrap();
    }
    ns
}

#[test]
fn check_and_run_refuse_the_balancers_own_address_and_an_open_cluster_key() {
    let test = "check_and_run_refuse_the_balancers_own_address_and_an_open_cluster_key";
    if !nix::unistd::geteuid().is_root() {
        return skip(test, "needs root (a network namespace)");
    }
    let bin = match find_lb_bin() {
        Ok(bin) => bin,
        Err(why) => return skip(test, &why),
    };
    let ns = namespace_with_veth("check");
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("cluster.key");
    std::fs::write(&key, "a cluster key of thirty-two bytes!").unwrap();
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
    let open_key = format!(
        "[cluster]\npeers = [\"10.98.0.3\"]\nkey_file = \"{}\"\n",
        key.display()
    );
    let cases = [
        (
            "a backend at the interface's address",
            config(dir.path(), "10.98.0.100", "10.98.0.2", ""),
            "vip[0].backend[0].address",
        ),
        (
            "a VIP at the interface's address",
            config(dir.path(), "10.98.0.2", "10.98.0.11", ""),
            "vip[0].address",
        ),
        (
            "a cluster key others may read",
            config(dir.path(), "10.98.0.100", "10.98.0.11", &open_key),
            "cluster.key_file",
        ),
    ];
    for (what, path, field) in &cases {
        for command in ["check", "run"] {
            let out = std::process::Command::new("ip")
                .args(["netns", "exec", ns.name()])
                .arg(&bin)
                .args([command, "--config"])
                .arg(path)
                .output()
                .unwrap();
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_eq!(
                out.status.code(),
                Some(2),
                "lb {command}, {what}: want exit 2; stderr:\n{stderr}"
            );
            assert!(
                stderr.contains(&format!("`{field}`")),
                "lb {command}, {what}: the field {field} is not named:\n{stderr}"
            );
        }
        let link = lb_tests::netns::ip(&["-n", ns.name(), "link", "show", "veth-lb"]).unwrap();
        assert!(!link.contains("xdp"), "{what}: lb run attached: {link}");
    }
    // And a good file passes both ways (`lb check` here; `lb run` is every other test's).
    let good = config(dir.path(), "10.98.0.100", "10.98.0.11", "");
    let out = std::process::Command::new("ip")
        .args(["netns", "exec", ns.name()])
        .arg(&bin)
        .args(["check", "--config"])
        .arg(&good)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Issue 34, end to end: with health checks and `slow_start`, a backend back from `lb
/// maint` then `lb ready` ramps beside backends at their full weight, and status's
/// `effective_weight` and `slots` agree. Before the fix the backends of the start ramped
/// from their first passing checks too: the returning one held a far larger share than
/// its "slow start 10%" said.
#[test]
fn a_backend_back_from_maintenance_ramps_beside_full_weights() {
    use lb_tests::{Health, Lab, LabOptions, Protocol, XdpMode, require_e2e, wait_status};
    use std::time::Duration;
    let Some(bin) = require_e2e("a_backend_back_from_maintenance_ramps_beside_full_weights") else {
        return;
    };
    let mut lab = Lab::new(LabOptions::default()).expect("build the lab");
    lab.serve_tcp(80, false)
        .expect("start the backends' servers");
    let health = Health::Tcp {
        interval: Duration::from_millis(300),
        timeout: Duration::from_millis(200),
        rise: 2,
        fall: 2,
        port: None,
    };
    let mut vip = lab.vip("web", false, 80, Protocol::Tcp, health);
    vip.extra = vec!["slow_start = \"300s\"".to_string()];
    let config = lab.agent_config(XdpMode::Native, vec![vip]);
    lab.start_agent(&bin, &config).expect("start the agent");
    let backends = |s: &serde_json::Value| s["vips"][0]["backends"].as_array().cloned().unwrap();
    wait_status(&lab, Duration::from_secs(20), "every backend up", |s| {
        backends(s).iter().all(|b| b["in_table"] == true)
    });
    let target = format!("{}:80/tcp", lab.vip4());
    let returning = lab.backend_addr(0, false).to_string();
    let agent = lab.agent().expect("agent");
    for state in ["maint", "ready"] {
        let out = agent.cli(&[state, &target, &returning]).expect("run lb");
        assert!(out.success(), "lb {state}: {out}");
    }
    let status = wait_status(
        &lab,
        Duration::from_secs(20),
        "the returning backend up",
        |s| {
            backends(s)
                .iter()
                .any(|b| b["address"] == returning.as_str() && b["in_table"] == true)
        },
    );
    let backends = backends(&status);
    let size = status["dataplane"]["maglev_table_size"].as_f64().unwrap();
    let total: f64 = backends
        .iter()
        .map(|b| b["effective_weight"].as_f64().unwrap())
        .sum();
    for b in &backends {
        let reason = b["weight_reason"].as_str().unwrap();
        if b["address"] == returning.as_str() {
            assert!(reason.starts_with("slow start"), "{b:#}");
        } else {
            assert_eq!(reason, "configured", "a backend of the start ramps: {b:#}");
        }
        let expected = size * b["effective_weight"].as_f64().unwrap() / total;
        let slots = b["slots"].as_f64().unwrap();
        assert!(
            (slots - expected).abs() <= expected / 100.0 + 1.0,
            "{}: {slots} slots, its effective weight gives {expected:.0}",
            b["address"]
        );
    }
}

/// A start that cannot bind its listeners attaches nothing (issue 41 item 2): with the
/// metrics port or the control socket in use, `lb run` exits 1 naming it, and leaves no
/// program on the interface, no pins and no socket file of its own.
#[test]
fn a_start_whose_listeners_cannot_bind_attaches_nothing() {
    let test = "a_start_whose_listeners_cannot_bind_attaches_nothing";
    if !nix::unistd::geteuid().is_root() {
        return skip(test, "needs root (a network namespace)");
    }
    if !lb_tests::host::require_tool(test, lb_tests::host::NSENTER) {
        return;
    }
    let bin = match find_lb_bin() {
        Ok(bin) => bin,
        Err(why) => return skip(test, &why),
    };
    let ns = namespace_with_veth("bind");
    let dir = tempfile::tempdir().unwrap();
    let pins = std::path::PathBuf::from(format!("/sys/fs/bpf/{}-bind", ns.name()));
    // Held inside the namespace for the whole test: the metrics port and a live socket.
    let metrics = ns
        .run(|| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
        .unwrap();
    let port = metrics.local_addr().unwrap().port();
    let busy_socket = dir.path().join("busy.sock");
    let _busy = std::os::unix::net::UnixListener::bind(&busy_socket).unwrap();
    let cases = [
        (
            "the metrics port in use",
            format!("{}", dir.path().join("lb.sock").display()),
            format!("127.0.0.1:{port}"),
            format!("binding the metrics endpoint 127.0.0.1:{port}"),
        ),
        (
            "the control socket in use",
            format!("{}", busy_socket.display()),
            "off".to_string(),
            "is in use: is another agent running?".to_string(),
        ),
    ];
    for (what, socket, metrics, want) in &cases {
        let path = dir.path().join("lb.toml");
        std::fs::write(
            &path,
            format!(
                "[dataplane]\ninterface = \"veth-lb\"\nxdp_mode = \"generic\"\n\
                 pin_path = \"{}\"\n[control]\nsocket = \"{socket}\"\nmetrics = \"{metrics}\"\n\
                 [[vip]]\nname = \"web\"\naddress = \"10.98.0.100\"\nport = 8080\n\
                 protocol = \"tcp\"\n[vip.health]\nkind = \"none\"\n\
                 [[vip.backend]]\naddress = \"10.98.0.11\"\nmac = \"02:00:00:00:00:0b\"\n",
                pins.display()
            ),
        )
        .unwrap();
        // nsenter, not `ip netns exec`: the agent keeps the host's mounts, as under
        // systemd, so a pinned link would outlive it (under `ip netns exec` the private
        // bpffs it mounts goes away with it, and so would the evidence).
        let out = std::process::Command::new("nsenter")
            .arg(format!("--net={}", ns.path().display()))
            .arg(&bin)
            .args(["run", "--config"])
            .arg(&path)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        let link = lb_tests::netns::ip(&["-n", ns.name(), "link", "show", "veth-lb"]).unwrap();
        let pinned: Vec<_> = std::fs::read_dir(&pins)
            .map(|d| d.filter_map(Result::ok).map(|e| e.file_name()).collect())
            .unwrap_or_default();
        // Whatever happened, leave nothing behind for the next case or test.
        let _ = std::process::Command::new("nsenter")
            .arg(format!("--net={}", ns.path().display()))
            .arg(&bin)
            .args(["detach", "--config"])
            .arg(&path)
            .output();
        let _ = lb_tests::netns::ip(&["-n", ns.name(), "link", "set", "veth-lb", "xdp", "off"]);
        let _ = std::fs::remove_dir_all(&pins);
        assert_eq!(out.status.code(), Some(1), "{what}: want exit 1:\n{stderr}");
        assert!(
            stderr.contains(want.as_str()),
            "{what}: want {want:?}:\n{stderr}"
        );
        assert!(!link.contains("xdp"), "{what}: lb run attached: {link}");
        assert!(pinned.is_empty(), "{what}: lb run left pins: {pinned:?}");
    }
    assert!(
        !dir.path().join("lb.sock").exists(),
        "the failed start left its control socket file"
    );
    drop(metrics);
}
