//! The configs the lab writes are ones the agent accepts (`lb check`), with every option
//! the lab can set. Needs only a built `lb`, not root. `cargo test -p lb-tests --test
//! config_check`.

use std::process::Command;
use std::time::Duration;

use lb_tests::{
    AgentConfig, BackendConfig, Health, Protocol, VipConfig, XdpMode, find_lb_bin, skip,
};

fn every_option() -> AgentConfig {
    let backends = |prefix: &str| -> Vec<BackendConfig> {
        (11..=13)
            .map(|h| BackendConfig::new(format!("{prefix}{h}").parse().unwrap()))
            .collect()
    };
    let mut drained = backends("10.99.0.");
    drained[0].state = Some("drain".into());
    drained[1].state = Some("maint".into());
    drained[2].mac = Some("02:00:00:00:00:0d".into());
    drained[2].weight = 3;
    AgentConfig {
        interface: "eth0".into(),
        xdp_mode: XdpMode::Generic,
        maglev_table_size: Some(251),
        conntrack_entries: Some(4096),
        flow_idle_timeout: None,
        socket: "/tmp/lb-tests-config-check/lb.sock".into(),
        metrics: "off".into(),
        vips: vec![
            VipConfig {
                name: "web".into(),
                address: "10.99.0.100".parse().unwrap(),
                port: 80,
                protocol: Protocol::Tcp,
                hash: Some("src-ip".into()),
                drain_timeout: Some(Duration::from_secs(2)),
                health: Health::fast_tcp(),
                backends: drained,
                extra: Vec::new(),
            },
            VipConfig {
                name: "web6".into(),
                address: "fd00:99::100".parse().unwrap(),
                port: 80,
                protocol: Protocol::Tcp,
                hash: None,
                drain_timeout: None,
                health: Health::Http {
                    interval: Duration::from_millis(500),
                    timeout: Duration::from_millis(200),
                    rise: 1,
                    fall: 1,
                    port: Some(8080),
                    path: "/healthz".into(),
                    expect_status: 200,
                },
                backends: backends("fd00:99::"),
                extra: Vec::new(),
            },
            VipConfig {
                name: "dns".into(),
                address: "10.99.0.100".parse().unwrap(),
                port: 53,
                protocol: Protocol::Udp,
                hash: None,
                drain_timeout: None,
                health: Health::None,
                backends: backends("10.99.0."),
                extra: Vec::new(),
            },
        ],
    }
}

#[test]
fn lb_check_accepts_the_lab_configs() {
    let bin = match find_lb_bin() {
        Ok(bin) => bin,
        Err(why) => return skip("lb_check_accepts_the_lab_configs", &why),
    };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("lb.toml");
    let config = every_option();
    std::fs::write(&path, config.to_toml()).unwrap();
    let out = Command::new(&bin)
        .arg("check")
        .arg("--config")
        .arg(&path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "lb check rejected the config the lab writes ({}):\n{}{}\n--- config ---\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        config.to_toml()
    );
}

/// A bad file: `lb check` (and `lb run`, before touching anything) exits 2 with the
/// field and the reason on stderr; a file that is not there is an error too.
#[test]
fn lb_check_and_run_refuse_bad_files_with_exit_2_naming_the_field() {
    let test = "lb_check_and_run_refuse_bad_files_with_exit_2_naming_the_field";
    let bin = match find_lb_bin() {
        Ok(bin) => bin,
        Err(why) => return skip(test, &why),
    };
    let dir = tempfile::tempdir().unwrap();
    // An interface that does not exist: should a case ever be accepted, `lb run` fails
    // to attach instead of serving on a real interface until killed.
    let good = AgentConfig {
        interface: "lb-none0".into(),
        ..every_option()
    }
    .to_toml();
    let cases = [
        (
            "weight",
            good.replacen("weight = 3", "weight = -3", 1),
            "weight",
        ),
        (
            "protocol",
            good.replacen("protocol = \"udp\"", "protocol = \"sctp\"", 1),
            "sctp",
        ),
        (
            "table size",
            good.replacen("maglev_table_size = 251", "maglev_table_size = 250", 1),
            "maglev_table_size",
        ),
        (
            "backend capacity",
            good.replacen(
                "maglev_table_size = 251",
                "maglev_table_size = 251\nmax_backends = 0",
                1,
            ),
            "dataplane.max_backends",
        ),
        (
            "more backends than max_backends",
            good.replacen(
                "maglev_table_size = 251",
                "maglev_table_size = 251\nmax_backends = 1",
                1,
            ),
            "raise dataplane.max_backends",
        ),
        ("syntax", format!("{good}\n[[vip]\n"), "TOML"),
        (
            "backend at the VIP",
            good.replacen("address = \"10.99.0.11\"", "address = \"10.99.0.100\"", 1),
            "vip[0].backend[0].address",
        ),
        (
            "loopback backend",
            good.replacen("address = \"10.99.0.12\"", "address = \"127.0.0.1\"", 1),
            "loopback",
        ),
        (
            "quic on a TCP VIP",
            good.replacen("protocol = \"tcp\"", "protocol = \"tcp\"\nquic = true", 1),
            "vip[0].quic",
        ),
        (
            "quic without server IDs",
            good.replacen("protocol = \"udp\"", "protocol = \"udp\"\nquic = true", 1),
            "].backend[0].server_id",
        ),
        (
            "quic server ID length",
            good.replacen(
                "protocol = \"udp\"",
                "protocol = \"udp\"\nquic = true\nquic_server_id_len = 16",
                1,
            ),
            "quic_server_id_len",
        ),
        (
            "interval of ages",
            good.replacen("interval = \"200ms\"", "interval = \"100000000000days\"", 1),
            "vip[0].health.interval",
        ),
    ];
    for (what, text, named) in cases {
        assert_ne!(text, good, "{what}: the case did not change the file");
        let path = dir.path().join(format!("{}.toml", what.replace(' ', "-")));
        std::fs::write(&path, &text).unwrap();
        for command in ["check", "run"] {
            let out = Command::new(&bin)
                .arg(command)
                .arg("--config")
                .arg(&path)
                .output()
                .unwrap();
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_eq!(
                out.status.code(),
                Some(2),
                "lb {command}, {what}: want exit 2; stderr:\n{stderr}"
            );
            assert!(
                stderr.contains(named),
                "lb {command}, {what}: stderr does not name {named:?}:\n{stderr}"
            );
        }
    }
    // Not a file to read to its end: refused at a few MiB, at once.
    let started = std::time::Instant::now();
    let zero = lb_tests::agent::run_lb(&bin, &["check", "--config", "/dev/zero"]).unwrap();
    assert_eq!(zero.status.code(), Some(2), "{zero}");
    assert!(zero.stderr.contains("/dev/zero is larger than"), "{zero}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    let missing = Command::new(&bin)
        .args(["check", "--config"])
        .arg(dir.path().join("absent.toml"))
        .output()
        .unwrap();
    assert!(!missing.status.success());
    assert!(String::from_utf8_lossy(&missing.stderr).contains("absent.toml"));
}
