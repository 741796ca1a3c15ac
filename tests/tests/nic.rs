//! What real NICs need, on the lab's veth: jumbo frames (MTU 9000, frames in several
//! buffers) through the balancer in native and generic mode; `lb doctor` on the lab
//! (its checks, `--json`, `--fix`), on a veth whose peer has no XDP program and on one
//! with another program attached; `lb run` refusing with the doctor's message and its
//! fix; `xdp_mode = "auto"` saying why native was refused; and an attach error from the
//! kernel said in words.
//!
//! Needs root, bpffs, the eBPF object and a built `lb`; otherwise each test prints
//! `SKIPPED`. `cargo test -p lb-tests --test nic`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::thread::sleep;
use std::time::{Duration, Instant};

use lb_tests::agent::{CliOutput, run_lb};
use lb_tests::lab::{IFACE, XdpPass};
use lb_tests::{Conn, Health, Lab, LabOptions, Protocol, XdpMode, require_e2e, spread};

const TIMEOUT: Duration = Duration::from_secs(2);

/// Writes the lab's agent configuration (one TCP VIP on port 80) for `mode`.
fn write_config(lab: &Lab, mode: XdpMode) -> PathBuf {
    let config = lab.agent_config(
        mode,
        vec![lab.vip("web", false, 80, Protocol::Tcp, Health::None)],
    );
    let path = lab.dir().join(format!("lb-{}.toml", mode.as_str()));
    std::fs::write(&path, config.to_toml()).expect("write the config");
    path
}

/// `lb ARGS... --config FILE` in the balancer's namespace, as an operator runs it there
/// (`ip netns exec`).
fn lb_in_lab(lab: &Lab, bin: &Path, args: &[&str], config: &Path) -> CliOutput {
    let mut all = vec![
        "netns",
        "exec",
        lab.lb().name(),
        bin.to_str().expect("utf-8 path"),
    ];
    all.extend_from_slice(args);
    all.extend_from_slice(&["--config", config.to_str().expect("utf-8 path")]);
    run_lb(Path::new("ip"), &all).expect("run lb")
}

fn doctor(lab: &Lab, bin: &Path, config: &Path, extra: &[&str]) -> CliOutput {
    let mut args = vec!["doctor"];
    args.extend_from_slice(extra);
    lb_in_lab(lab, bin, &args, config)
}

/// The line of check `name` in `lb doctor`'s output.
fn line<'a>(out: &'a CliOutput, name: &str) -> &'a str {
    out.stdout
        .lines()
        .find(|l| l.split_whitespace().nth(1) == Some(&format!("{name}:")))
        .unwrap_or_else(|| panic!("no check {name}:\n{out}"))
}

fn assert_line(out: &CliOutput, name: &str, level: &str, words: &[&str]) {
    let line = line(out, name);
    assert!(
        line.starts_with(&format!("{level} ")),
        "not {level}: {line}\n{out}"
    );
    for word in words {
        assert!(line.contains(word), "{name} does not say {word:?}: {line}");
    }
}

/// Each connection echoes 64 KiB in 16 KiB writes: segments of the 9000-byte MTU from
/// the client through the balancer, in several XDP buffers each.
fn jumbo_echoes(lab: &Lab, vip: SocketAddr, connections: usize) -> u64 {
    let data: Vec<u8> = (0..65536u32).map(|i| (i % 253) as u8).collect();
    for i in 0..connections {
        let mut conn = Conn::open(lab.client(), vip, TIMEOUT)
            .unwrap_or_else(|e| panic!("connection {i}: {e}\n{}", lab.agent_log()));
        for (n, chunk) in data.chunks(16384).enumerate() {
            conn.echo(chunk)
                .unwrap_or_else(|e| panic!("connection {i} to {}, write {n}: {e}", conn.backend()));
        }
        conn.close().expect("orderly close");
    }
    (connections * data.len()) as u64
}

/// The VIP's (packets, bytes) in `lb status --json`, once they count `bytes` at least
/// (the counters are read per request; asked again for up to 3 s).
fn vip_traffic(lab: &Lab, at_least: u64) -> (u64, u64, serde_json::Value) {
    let agent = lab.agent().expect("agent");
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let status = agent.status_json().expect("lb status --json");
        let vip = &status["vips"][0];
        let (packets, bytes) = (
            vip["packets"].as_u64().unwrap_or(0),
            vip["bytes"].as_u64().unwrap_or(0),
        );
        if bytes >= at_least || Instant::now() > deadline {
            return (packets, bytes, status);
        }
        sleep(Duration::from_millis(100));
    }
}

fn jumbo(mode: XdpMode, opts: LabOptions, test: &str) {
    let Some(bin) = require_e2e(test) else { return };
    let mut lab = Lab::new(LabOptions {
        mtu: Some(9000),
        ..opts
    })
    .expect("build the lab");
    lab.serve_tcp(80, false).expect("tcp servers");
    let path = write_config(&lab, mode);
    let checked = doctor(&lab, &bin, &path, &[]);
    assert!(
        checked.success(),
        "lb doctor failed at MTU 9000:\n{checked}"
    );
    let mtu_words: &[&str] = match mode {
        XdpMode::Generic => &["MTU 9000", "generic mode takes any MTU"],
        _ => &["MTU 9000", "rx-sg", "multi-buffer aware"],
    };
    assert_line(&checked, "mtu", "ok", mtu_words);

    let config = lab.agent_config(
        mode,
        vec![lab.vip("web", false, 80, Protocol::Tcp, Health::None)],
    );
    lab.start_agent(&bin, &config).expect("start the agent");
    let vip = SocketAddr::new(lab.vip4(), 80);
    let sent = jumbo_echoes(&lab, vip, 4);
    let (packets, bytes, status) = vip_traffic(&lab, sent);
    eprintln!(
        "{test}: {sent} bytes echoed; the balancer forwarded {packets} packets, {bytes} bytes \
         ({} bytes a packet)",
        bytes / packets.max(1)
    );
    assert_eq!(status["dataplane"]["xdp_mode"], mode.as_str(), "{status:#}");
    // Every byte the client sent crossed the balancer, counted whole (not only the first
    // buffer), in frames above the 1500-byte MTU.
    assert!(
        bytes >= sent,
        "counted {bytes} bytes < {sent} sent\n{status:#}"
    );
    assert!(
        bytes / packets.max(1) > 1500,
        "{packets} packets of {bytes} bytes: no jumbo frames went through\n{status:#}"
    );
    // Small requests still spread.
    let s = spread(lab.client(), vip, 30).expect("spread");
    assert_eq!(s.failures, 0, "{:?}\n{}", s.errors, s.table());
}

/// Native mode at MTU 9000: the program is multi-buffer aware, so it attaches, and
/// segments of 8948 bytes (frames in several buffers) go through it whole.
#[test]
fn native_mtu_9000_carries_jumbo_segments() {
    jumbo(
        XdpMode::Native,
        LabOptions::default(),
        "native_mtu_9000_carries_jumbo_segments",
    );
}

/// The same in generic mode (without the native-mode veth fixes).
#[test]
fn generic_mtu_9000_carries_jumbo_segments() {
    let opts = LabOptions {
        xdp_pass_on_peer: false,
        client_tx_csum_off: false,
        ..LabOptions::default()
    };
    jumbo(
        XdpMode::Generic,
        opts,
        "generic_mtu_9000_carries_jumbo_segments",
    );
}

/// On the lab's own veth: everything passes, with the veth notes; `--json` carries the
/// checks and the facts; `--fix` turns receive VLAN offload off through ethtool netlink.
#[test]
fn doctor_checks_the_lab_and_fixes_its_offloads() {
    let test = "doctor_checks_the_lab_and_fixes_its_offloads";
    let Some(bin) = require_e2e(test) else { return };
    let lab = Lab::new(LabOptions::default()).expect("build the lab");
    let path = write_config(&lab, XdpMode::Native);
    let out = doctor(&lab, &bin, &path, &[]);
    eprintln!("{test}:\n{}", out.stdout);
    assert!(out.success(), "{out}");
    for name in [
        "privileges",
        "kernel",
        "interface",
        "native-xdp",
        "xdp-attached",
    ] {
        assert_line(&out, name, "ok", &[]);
    }
    assert_line(&out, "driver", "ok", &["veth"]);
    assert_line(&out, "veth-peer", "ok", &["p-lb", "xdp_pass"]);
    // The peer is in the switch's namespace, read there: a bridge port with tx checksum
    // offload on (veth's default).
    assert_line(
        &out,
        "veth-checksum",
        "warn",
        &[
            "peer p-lb (netns id",
            "offload on",
            "`ethtool -K p-lb tx off` in its namespace",
        ],
    );
    assert_line(&out, "vlan-offload", "warn", &["rx-vlan-hw-parse", "--fix"]);

    let json = doctor(&lab, &bin, &path, &["--json"]);
    let report: serde_json::Value = serde_json::from_str(&json.stdout).expect("JSON");
    assert_eq!(report["interface"], IFACE);
    assert_eq!(
        report["facts"]["link"]["peer"]["name"], "p-lb",
        "{report:#}"
    );
    let checks = report["checks"].as_array().expect("checks");
    assert_eq!(checks.len(), out.stdout.lines().count());
    assert!(
        checks
            .iter()
            .all(|c| c["name"].is_string() && c["level"].is_string())
    );

    let fixed = doctor(&lab, &bin, &path, &["--fix"]);
    assert!(fixed.success(), "{fixed}");
    assert!(
        fixed.stdout.contains("fixed eth0: rx-vlan-hw-parse off"),
        "{fixed}"
    );
    assert_line(&fixed, "vlan-offload", "ok", &[]);
    let features = lab
        .lb()
        .exec("ethtool", &["-k", IFACE])
        .expect("ethtool -k");
    assert!(
        features.contains("rx-vlan-offload: off"),
        "ethtool still shows:\n{features}"
    );

    // Turned off there, as the warning says: the warning clears.
    lab.switch()
        .exec("ethtool", &["-K", "p-lb", "tx", "off"])
        .expect("ethtool -K p-lb tx off in the switch");
    let cleared = doctor(&lab, &bin, &path, &[]);
    assert_line(
        &cleared,
        "veth-checksum",
        "ok",
        &["peer p-lb (netns id", "the bridge port", "offload off"],
    );
}

/// `--fix` beyond VLAN offload: with a generic attach, GRO merges segments before the
/// program sees them; the doctor warns with the fix, `--fix` turns `rx-gro` off through
/// ethtool netlink, and the check passes afterwards (as `ethtool -k` confirms).
#[test]
fn doctor_fixes_gro_under_a_generic_attach() {
    let test = "doctor_fixes_gro_under_a_generic_attach";
    let Some(bin) = require_e2e(test) else { return };
    let lab = Lab::new(LabOptions::default()).expect("build the lab");
    lab.lb()
        .exec("ethtool", &["-K", IFACE, "gro", "on"])
        .expect("turn GRO on");
    let path = write_config(&lab, XdpMode::Generic);
    let out = doctor(&lab, &bin, &path, &[]);
    eprintln!("{test}:\n{}", out.stdout);
    assert!(out.success(), "{out}");
    assert_line(&out, "gro", "warn", &["generic", "rx-gro", "--fix"]);

    let fixed = doctor(&lab, &bin, &path, &["--fix"]);
    assert!(fixed.success(), "{fixed}");
    assert!(fixed.stdout.contains("fixed eth0: rx-gro off"), "{fixed}");
    assert_line(&fixed, "gro", "ok", &["GRO off"]);
    let features = lab
        .lb()
        .exec("ethtool", &["-k", IFACE])
        .expect("ethtool -k");
    assert!(
        features.contains("generic-receive-offload: off"),
        "ethtool still shows:\n{features}"
    );
}

/// A veth whose peer has no XDP program: native mode would drop every frame, so the
/// doctor fails it and `lb run` refuses with the fix, attaching nothing; `auto` attaches
/// in generic mode at once, says why in its log and in `lb status`, and serves.
#[test]
fn a_peer_without_xdp_fails_native_and_auto_says_why() {
    let test = "a_peer_without_xdp_fails_native_and_auto_says_why";
    let Some(bin) = require_e2e(test) else { return };
    let mut lab = Lab::new(LabOptions {
        xdp_pass_on_peer: false,
        ..LabOptions::default()
    })
    .expect("build the lab");
    lab.serve_tcp(80, false).expect("tcp servers");
    let native = write_config(&lab, XdpMode::Native);
    let out = doctor(&lab, &bin, &native, &[]);
    assert_eq!(out.status.code(), Some(1), "{out}");
    assert_line(
        &out,
        "veth-peer",
        "fail",
        &["p-lb", "has no XDP program", "XDP_PASS", "generic"],
    );

    let run = lb_in_lab(&lab, &bin, &["run"], &native);
    eprintln!("{test}: lb run said:\n{}", run.stderr);
    assert_eq!(run.status.code(), Some(1), "{run}");
    for words in ["refusing to attach to eth0", "fail veth-peer", "XDP_PASS"] {
        assert!(run.stderr.contains(words), "no {words:?} in:\n{run}");
    }
    let link = lab
        .lb()
        .exec("ip", &["-d", "link", "show", IFACE])
        .expect("ip link");
    assert!(
        !link.contains("prog/xdp"),
        "something was attached:\n{link}"
    );

    let config = lab.agent_config(
        XdpMode::Auto,
        vec![lab.vip("web", false, 80, Protocol::Tcp, Health::None)],
    );
    lab.start_agent(&bin, &config).expect("start the agent");
    let agent = lab.agent().expect("agent");
    let status = agent.status_json().expect("status");
    assert_eq!(status["dataplane"]["xdp_mode"], "generic", "{status:#}");
    let why = status["dataplane"]["native_refused"]
        .as_str()
        .unwrap_or_else(|| panic!("no native_refused:\n{status:#}"));
    assert!(
        why.contains("p-lb") && why.contains("no XDP program"),
        "{why}"
    );
    let text = agent.status().expect("lb status");
    assert!(text.contains("native xdp refused: "), "{text}");
    assert!(
        agent.log().contains("native refused"),
        "the log does not say it:\n{}",
        agent.log()
    );
    let s = spread(lab.client(), SocketAddr::new(lab.vip4(), 80), 30).expect("spread");
    assert_eq!(s.failures, 0, "{:?}\n{}", s.errors, s.table());
}

/// Another XDP program on the interface: the doctor names it (name, id, mode), `lb run`
/// refuses with that line, and the kernel's EBUSY from an attach is said in words.
#[test]
fn another_program_attached_is_named_and_lb_run_refuses() {
    let test = "another_program_attached_is_named_and_lb_run_refuses";
    let Some(bin) = require_e2e(test) else { return };
    let lab = Lab::new(LabOptions::default()).expect("build the lab");
    let _other = XdpPass::attach(lab.lb(), IFACE).expect("attach xdp_pass to the balancer");
    let path = write_config(&lab, XdpMode::Auto);
    let out = doctor(&lab, &bin, &path, &[]);
    assert_eq!(out.status.code(), Some(1), "{out}");
    assert_line(
        &out,
        "xdp-attached",
        "fail",
        &["another program", "xdp_pass (id ", "native)", "xdp off"],
    );
    let run = lb_in_lab(&lab, &bin, &["run"], &path);
    assert_eq!(run.status.code(), Some(1), "{run}");
    assert!(
        run.stderr.contains("fail xdp-attached") && run.stderr.contains("xdp_pass"),
        "{run}"
    );

    // Past the doctor, the kernel's refusal itself: EBUSY, said in words.
    let error = attach_beside(&lab).expect_err("attached beside another program");
    eprintln!("{test}: {error}");
    assert!(
        error.contains(
            "attaching to eth0 in native mode: another XDP program is attached to \
                        eth0: xdp_pass"
        ),
        "{error}"
    );
}

/// Loads the program with pins of its own and attaches it natively to the balancer's
/// `eth0`, as `lb run` would without its checks; the error's text.
fn attach_beside(lab: &Lab) -> Result<(), String> {
    use lb_userspace::{
        EBPF_OBJECT,
        config::{Config, XdpModeSetting},
        dataplane::{AttachHints, AyaDataplane, LoadOptions, remove_pins},
    };
    let config = Config::from_toml(
        "[dataplane]\ninterface = \"eth0\"\nconntrack_entries = 1024\nmaglev_table_size = 7\n",
    )
    .expect("config");
    let dir = PathBuf::from(format!("/sys/fs/bpf/lbt-nic-{}", std::process::id()));
    let hints = AttachHints {
        attached: Some("xdp_pass (as the doctor names it)".into()),
        ..AttachHints::default()
    };
    let result = lab
        .lb()
        .run(|| {
            let options = LoadOptions::from_config(&config, [2, 0, 0, 0, 0, 2]);
            let (mut dataplane, _) = AyaDataplane::load_pinned(EBPF_OBJECT, options, &dir)
                .map_err(|e| format!("{e:#}"))?;
            dataplane
                .attach_pinned(IFACE, XdpModeSetting::Native, &hints)
                .map(drop)
                .map_err(|e| e.to_string())
        })
        .expect("in the balancer's namespace");
    let _ = remove_pins(&dir);
    result
}
