//! Doctor's checks against recorded answers: each file in `fixtures/` holds what
//! `ethtool -i`, `ethtool -k` and `ethtool -l` printed for one interface (as an operator
//! would paste them), after a few `key: value` lines for what ethtool does not say (MTU,
//! link kind, XDP features, attached programs, a veth's peer). `veth.txt` and
//! `virtio_net.txt` were recorded on the test machine; the others are built from those
//! drivers' documented defaults (no such NIC here) and say so in their first line.

use std::collections::BTreeMap;

use super::{
    Report,
    checks::{Finding, Level},
    facts::{
        Attached, Bpffs, BpffsState, Channels, Driver, Facts, Feature, Kernel, Link,
        NextProgramFact, Peer, PinnedLink, Privileges, XdpFeatures,
    },
};
use crate::config::XdpModeSetting;

/// The facts a fixture describes, checked under `mode`.
fn facts(text: &str, mode: XdpModeSetting) -> Facts {
    let mut link = Link {
        up: true,
        ..Link::default()
    };
    let mut facts = Facts {
        interface: String::new(),
        xdp_mode: mode,
        privileges: Privileges::default(),
        bpffs: Bpffs {
            pin_dir: "/sys/fs/bpf/lb/eth0".into(),
            state: BpffsState::Mounted,
            link: PinnedLink::None,
        },
        kernel: Kernel {
            release: "6.18.44".into(),
            btf: true,
            jit: Some(1),
        },
        cpus: 2,
        link: None,
        dispatcher: None,
        next_program: None,
    };
    let mut section = "";
    let mut driver = Driver::default();
    let mut features = BTreeMap::new();
    let mut channels = Channels::default();
    let mut maximums = true;
    for line in text.lines() {
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        if let Some(command) = line.strip_prefix("$ ethtool ") {
            section = command.split_whitespace().next().unwrap_or("");
            continue;
        }
        let Some((key, value)) = line.split_once(':') else {
            continue;
        };
        let (key, value) = (key.trim(), value.trim());
        match section {
            "" => header(&mut facts, &mut link, key, value),
            "-i" => match key {
                "driver" => driver.name = value.into(),
                "version" => driver.version = value.into(),
                "firmware-version" => driver.firmware = value.into(),
                "bus-info" => driver.bus = value.into(),
                _ => {}
            },
            "-k" if !value.is_empty() => {
                features.insert(
                    kernel_name(key).to_string(),
                    Feature {
                        on: value.starts_with("on"),
                        fixed: value.contains("[fixed]"),
                    },
                );
            }
            "-l" => {
                if key == "Current hardware settings" {
                    maximums = false;
                }
                let n = value.parse().ok();
                match (key, maximums) {
                    ("RX", true) => channels.max_rx = n,
                    ("TX", true) => channels.max_tx = n,
                    ("Combined", true) => channels.max_combined = n,
                    ("RX", false) => channels.rx = n,
                    ("TX", false) => channels.tx = n,
                    ("Combined", false) => channels.combined = n,
                    _ => {}
                }
            }
            _ => {}
        }
    }
    link.name = facts.interface.clone();
    link.driver = (!driver.name.is_empty()).then_some(driver);
    link.features = (!features.is_empty()).then_some(features);
    link.channels = Some(channels);
    facts.link = Some(link);
    facts
}

/// The fixture's own lines: `interface: eth0`, `mtu: 9000`, `kind: veth`, `cpus: 2`,
/// `xdp_features: basic, rx-sg`, `attached: ID NAME MODE`, `pinned: ID`,
/// `peer: NAME [netns ID] [attached ID NAME] [enslaved] [tx-checksum on|off]`.
fn header(facts: &mut Facts, link: &mut Link, key: &str, value: &str) {
    let words: Vec<&str> = value.split_whitespace().collect();
    match key {
        "interface" => facts.interface = value.into(),
        "mtu" => link.mtu = value.parse().expect("mtu"),
        "kind" => link.kind = Some(value.into()),
        "parent" => link.parent = Some(value.into()),
        "down" => link.up = false,
        "cpus" => facts.cpus = value.parse().expect("cpus"),
        "kernel" => facts.kernel.release = value.into(),
        "xdp_features" => link.xdp_features = Some(XdpFeatures::from_names(value)),
        "attached" => link.attached.push(program(&words)),
        "pinned" => link.pinned_program = value.parse().ok(),
        "peer" => {
            let mut peer = Peer {
                name: (words[0] != "?").then(|| words[0].to_string()),
                ..Peer::default()
            };
            let mut rest = &words[1..];
            while let [word, tail @ ..] = rest {
                rest = tail;
                match *word {
                    "netns" => {
                        peer.netns_id = rest[0].parse().ok();
                        rest = &rest[1..];
                    }
                    "attached" => {
                        peer.attached.push(program(&rest[..3]));
                        rest = &rest[3..];
                    }
                    "enslaved" => peer.enslaved = true,
                    "tx-checksum" => {
                        peer.tx_checksum = Some(rest[0] == "on");
                        rest = &rest[1..];
                    }
                    other => panic!("fixture peer: unknown word {other:?}"),
                }
            }
            link.peer = Some(peer);
        }
        other => panic!("fixture: unknown header {other:?}"),
    }
}

fn program(words: &[&str]) -> Attached {
    Attached {
        id: words[0].parse().expect("program id"),
        name: Some(words[1].into()),
        mode: words[2].into(),
    }
}

/// `ethtool -k` prints some features by their old ioctl names; the kernel's (netlink's)
/// names are what the checks use.
fn kernel_name(printed: &str) -> &str {
    match printed {
        "rx-checksumming" => "rx-checksum",
        "generic-segmentation-offload" => "tx-generic-segmentation",
        "generic-receive-offload" => "rx-gro",
        "large-receive-offload" => "rx-lro",
        "rx-vlan-offload" => "rx-vlan-hw-parse",
        "tx-vlan-offload" => "tx-vlan-hw-insert",
        "ntuple-filters" => "rx-ntuple-filter",
        "receive-hashing" => "rx-hashing",
        other => other,
    }
}

const VETH: &str = include_str!("fixtures/veth.txt");
const VIRTIO: &str = include_str!("fixtures/virtio_net.txt");
const ENA: &str = include_str!("fixtures/ena.txt");
const IXGBE: &str = include_str!("fixtures/ixgbe.txt");
const MLX5: &str = include_str!("fixtures/mlx5_core.txt");

fn checked(text: &str, mode: XdpModeSetting) -> Report {
    Report::of(facts(text, mode))
}

/// The finding named `name`; panics with the whole report when there is none.
fn named<'a>(report: &'a Report, name: &str) -> &'a Finding {
    report
        .checks
        .iter()
        .find(|f| f.name == name)
        .unwrap_or_else(|| panic!("no check {name}:\n{}", report.render()))
}

fn assert_level(report: &Report, name: &str, level: Level, words: &[&str]) {
    let finding = named(report, name);
    assert_eq!(
        finding.level,
        level,
        "{name} is not {level}:\n{}",
        report.render()
    );
    for word in words {
        assert!(
            finding.detail.contains(word),
            "{name} does not say {word:?}: {finding}"
        );
    }
}

use XdpModeSetting::{Auto, Generic, Native};

#[test]
fn every_line_reads_level_name_detail() {
    for (text, mode) in [
        (VETH, Native),
        (VIRTIO, Auto),
        (ENA, Native),
        (IXGBE, Generic),
    ] {
        let report = checked(text, mode);
        for line in report.render().lines() {
            let (level, rest) = line.split_once(' ').expect("a level");
            assert!(["ok", "warn", "fail"].contains(&level), "{line}");
            let (name, detail) = rest.split_once(": ").expect("NAME: detail");
            assert!(
                name.chars().all(|c| c.is_ascii_lowercase() || c == '-'),
                "{line}"
            );
            assert!(!detail.is_empty(), "{line}");
        }
    }
}

#[test]
fn veth_at_1500_with_a_peer_program_passes_with_the_checksum_note() {
    let report = checked(VETH, Native);
    assert!(!report.failed(), "{}", report.render());
    assert_level(&report, "driver", Level::Ok, &["veth 1.0"]);
    assert_level(&report, "native-xdp", Level::Ok, &["basic", "rx-sg"]);
    assert_level(&report, "mtu", Level::Ok, &["MTU 1500"]);
    assert_level(
        &report,
        "veth-peer",
        Level::Ok,
        &["p-lb", "xdp_pass (id 7, native)"],
    );
    // The peer is in another namespace, and the recording has no offload of it: not
    // checked, said as such (a warning would never clear).
    assert_level(
        &report,
        "veth-checksum",
        Level::Ok,
        &["not checked", "ethtool -K DEV tx off"],
    );
    // veth has receive VLAN offload on by default.
    let vlan = named(&report, "vlan-offload");
    assert_eq!(vlan.level, Level::Warn, "{vlan}");
    assert_eq!(
        vlan.fix,
        [
            "rx-vlan-hw-parse",
            "rx-vlan-stag-hw-parse",
            "tx-vlan-hw-insert"
        ]
    );
    assert!(vlan.detail.contains("ethtool -K eth0 rxvlan off"), "{vlan}");
    assert_level(&report, "lro", Level::Ok, &[]);
    assert_eq!(report.native_refusal(), None);
}

#[test]
fn veth_checksum_clears_when_the_peer_bridge_port_has_tx_checksum_off() {
    // The peer in this namespace, a bridge port, tx checksum offload off (as `ethtool -K
    // p-lb tx off` leaves it): every frame reaching eth0 leaves by it, checksummed.
    let text = VETH.replace(
        "peer: p-lb netns 0 attached 7 xdp_pass native enslaved",
        "peer: p-lb attached 7 xdp_pass native enslaved tx-checksum off",
    );
    let report = checked(&text, Native);
    assert_level(
        &report,
        "veth-checksum",
        Level::Ok,
        &["peer p-lb, the bridge port", "tx checksum offload off"],
    );
    // On, it warns with the command for the peer; in another namespace (read there),
    // the same, with where to run it.
    let on = text.replace("tx-checksum off", "tx-checksum on");
    assert_level(
        &checked(&on, Native),
        "veth-checksum",
        Level::Warn,
        &[
            "peer p-lb, the bridge port",
            "offload on",
            "`ethtool -K p-lb tx off`",
        ],
    );
    let elsewhere = on.replace("peer: p-lb", "peer: p-lb netns 0");
    assert_level(
        &checked(&elsewhere, Native),
        "veth-checksum",
        Level::Warn,
        &[
            "p-lb (netns id 0)",
            "`ethtool -K p-lb tx off` in its namespace",
        ],
    );
    let off_elsewhere = text.replace("peer: p-lb", "peer: p-lb netns 0");
    assert_level(
        &checked(&off_elsewhere, Native),
        "veth-checksum",
        Level::Ok,
        &["peer p-lb (netns id 0), the bridge port", "offload off"],
    );
    // Unreadable there: not checked, and why.
    assert_level(
        &checked(VETH, Native),
        "veth-checksum",
        Level::Ok,
        &["not checked: the tx checksum offload of peer p-lb (netns id 0) could not be read"],
    );
}

#[test]
fn veth_without_a_peer_program_fails_native_and_sends_auto_to_generic() {
    let text = VETH.replace(
        "peer: p-lb netns 0 attached 7 xdp_pass native enslaved",
        "peer: p-lb netns 0 enslaved",
    );
    let native = checked(&text, Native);
    assert!(native.failed());
    assert_level(
        &native,
        "veth-peer",
        Level::Fail,
        &["p-lb (netns id 0) has no XDP program", "XDP_PASS"],
    );
    assert!(
        native.refusal().contains("fail veth-peer"),
        "{}",
        native.refusal()
    );
    let auto = checked(&text, Auto);
    assert!(!auto.failed(), "{}", auto.render());
    assert_level(&auto, "veth-peer", Level::Warn, &["generic mode"]);
    assert!(auto.native_refusal().unwrap().contains("p-lb"));
    // Generic runs after GRO: that matters now (veth has GRO off by default: ok).
    assert_level(&auto, "gro", Level::Ok, &["GRO off"]);
    let generic = checked(&text, Generic);
    assert!(!generic.failed());
    assert!(generic.checks.iter().all(|c| c.name != "veth-checksum"));
}

#[test]
fn another_program_on_the_interface_fails_and_is_named() {
    let text = format!("attached: 42 xdp_filter native\n{VETH}");
    let report = checked(&text, Auto);
    assert_level(
        &report,
        "xdp-attached",
        Level::Fail,
        &[
            "xdp_filter (id 42, native)",
            "xdp off",
            "xdp-loader unload eth0 --all",
            "dataplane.next_program",
        ],
    );
    // lb's own pinned program is no obstacle: lb run adopts it.
    let ours = checked(
        &format!("attached: 42 lb_xdp native\npinned: 42\n{VETH}"),
        Auto,
    );
    assert_level(&ours, "xdp-attached", Level::Ok, &["adopts"]);
    // So is the build of it that calls a next program without multi-buffer frames.
    let ours_1buf = checked(
        &format!("attached: 42 lb_xdp_1buf native\npinned: 42\n{VETH}"),
        Auto,
    );
    assert_level(&ours_1buf, "xdp-attached", Level::Ok, &["adopts"]);
    // Another lb's (pinned elsewhere) is.
    let other_lb = checked(
        &format!("attached: 42 lb_xdp native\npinned: 41\n{VETH}"),
        Auto,
    );
    assert_level(
        &other_lb,
        "xdp-attached",
        Level::Fail,
        &["another lb agent's"],
    );
}

#[test]
fn veth_at_mtu_9000_is_fine_because_the_program_is_multi_buffer_aware() {
    let text = VETH.replace("mtu: 1500", "mtu: 9000");
    let report = checked(&text, Native);
    assert!(!report.failed(), "{}", report.render());
    assert_level(
        &report,
        "mtu",
        Level::Ok,
        &["MTU 9000", "rx-sg", "multi-buffer aware"],
    );
}

#[test]
fn virtio_net_on_this_vm_cannot_go_native() {
    // Recorded here: one queue pair for 2 CPUs, the host's receive offloads fixed on.
    let native = checked(VIRTIO, Native);
    assert_level(
        &native,
        "lro",
        Level::Fail,
        &["rx-gro-hw", "guest_tso4=off"],
    );
    assert_level(
        &native,
        "channels",
        Level::Warn,
        &[
            "1 receive queue(s) for 2 CPUs",
            "locked",
            "at least 3 queue pairs",
        ],
    );
    assert_level(&native, "vlan-offload", Level::Ok, &[]);
    assert_level(&native, "mtu", Level::Ok, &["MTU 1400"]);
    let auto = checked(VIRTIO, Auto);
    assert!(!auto.failed(), "{}", auto.render());
    // Not certain enough to skip native: auto tries it, and falls back on the refusal.
    assert_eq!(auto.native_refusal(), None);
    // Generic runs after GRO, which is on: counted per merged burst, fixable.
    let gro = named(&auto, "gro");
    assert_eq!(
        (gro.level, gro.fix.clone()),
        (Level::Warn, vec!["rx-gro".to_string()]),
        "{gro}"
    );
}

#[test]
fn ena_at_aws_mtu_9001_needs_a_lower_mtu_for_native() {
    let native = checked(ENA, Native);
    assert_level(
        &native,
        "mtu",
        Level::Fail,
        &["MTU 9001", "no multi-buffer XDP", "3498"],
    );
    assert_level(
        &native,
        "channels",
        Level::Warn,
        &["half its queues", "combined 4"],
    );
    assert_level(&native, "driver", Level::Ok, &["ena", "3498"]);
    let auto = checked(ENA, Auto);
    assert_level(&auto, "mtu", Level::Warn, &["generic mode"]);
    let lowered = checked(&ENA.replace("mtu: 9001", "mtu: 3498"), Native);
    assert_level(&lowered, "mtu", Level::Ok, &[]);
}

#[test]
fn ixgbe_with_lro_on_is_fixable() {
    let report = checked(IXGBE, Native);
    let lro = named(&report, "lro");
    assert_eq!(
        (lro.level, lro.fix.clone()),
        (Level::Warn, vec!["rx-lro".to_string()]),
        "{lro}"
    );
    assert!(lro.detail.contains("ethtool -K eth2 lro off"), "{lro}");
    assert_level(
        &report,
        "channels",
        Level::Ok,
        &["2 receive queue(s) for 2 CPU(s)"],
    );
}

#[test]
fn mlx5_with_fewer_queues_than_cpus() {
    let report = checked(MLX5, Native);
    assert!(!report.failed(), "{}", report.render());
    assert_level(
        &report,
        "channels",
        Level::Warn,
        &[
            "8 receive queue(s) for 32 CPUs",
            "ethtool -L eth1 combined 32",
        ],
    );
    assert_level(&report, "vlan-offload", Level::Warn, &["rx-vlan-hw-parse"]);
}

#[test]
fn a_vlan_sub_interface_fails_naming_its_parent() {
    let text = MLX5.replace(
        "interface: eth1",
        "interface: eth1.100\nkind: vlan\nparent: eth1",
    );
    let report = checked(&text, Auto);
    assert_level(
        &report,
        "interface",
        Level::Fail,
        &["VLAN sub-interface", "attach to eth1"],
    );
}

#[test]
fn host_checks() {
    let mut facts = facts(VETH, Native);
    facts.privileges = Privileges {
        euid: 1000,
        missing: vec!["CAP_BPF".into(), "CAP_NET_ADMIN".into()],
    };
    facts.kernel.release = "5.15.0-91-generic".into();
    facts.kernel.jit = Some(0);
    facts.kernel.btf = false;
    facts.bpffs.state = BpffsState::NotBpffs {
        existing: "/run".into(),
    };
    let report = Report::of(facts);
    assert_level(
        &report,
        "privileges",
        Level::Fail,
        &["CAP_BPF, CAP_NET_ADMIN", "root"],
    );
    assert_level(&report, "kernel", Level::Fail, &["5.18"]);
    assert_level(&report, "jit", Level::Warn, &["bpf_jit_enable=1"]);
    assert_level(&report, "btf", Level::Warn, &[]);
    assert_level(&report, "bpffs", Level::Fail, &["mount -t bpf bpf /run"]);
    let mut facts = self::facts(VETH, Native);
    facts.bpffs.state = BpffsState::Private { mounted: false };
    let report = Report::of(facts);
    assert_level(
        &report,
        "bpffs",
        Level::Warn,
        &[
            "only this mount namespace",
            "nsenter --net",
            "mount -t bpf bpf",
        ],
    );
    let mut facts = self::facts(VETH, Native);
    facts.link = None;
    let report = Report::of(facts);
    assert_level(&report, "interface", Level::Fail, &["no interface eth0"]);
    assert_eq!(report.checks.len(), 7, "{}", report.render());
}

#[test]
fn stale_pins_are_reported_with_what_lb_run_does() {
    let mut facts = facts(VETH, Native);
    let index = facts.link.as_ref().unwrap().index;
    assert_level(
        &Report::of(facts.clone()),
        "pins",
        Level::Ok,
        &["nothing pinned"],
    );
    facts.bpffs.link = PinnedLink::Attached { ifindex: index };
    assert_level(
        &Report::of(facts.clone()),
        "pins",
        Level::Ok,
        &["attached to eth0"],
    );
    facts.bpffs.link = PinnedLink::Defunct;
    assert_level(
        &Report::of(facts.clone()),
        "pins",
        Level::Warn,
        &[
            "stale",
            "defunct",
            "lb run replaces it",
            "maps",
            "lb detach",
        ],
    );
    facts.bpffs.link = PinnedLink::Attached { ifindex: index + 7 };
    let elsewhere = format!("index {}, not eth0", index + 7);
    assert_level(
        &Report::of(facts.clone()),
        "pins",
        Level::Warn,
        &["stale", elsewhere.as_str()],
    );
    facts.bpffs.link = PinnedLink::Unreadable { errno: 13 };
    assert_level(&Report::of(facts), "pins", Level::Warn, &["unreadable"]);
}

#[test]
fn several_interfaces_are_checked_each_and_the_host_once() {
    let mut first = checked(VETH, Native);
    first.interface = "eth0".into();
    let mut second = checked(IXGBE, Native);
    second.interface = "eth1".into();
    let merged = Report::merge(vec![first, second]);
    let count = |name: &str| merged.checks.iter().filter(|f| f.name == name).count();
    for host in ["privileges", "bpffs", "kernel", "btf", "jit"] {
        assert_eq!(count(host), 1, "{host} once:\n{}", merged.render());
    }
    for own in ["interface", "driver", "mtu", "xdp-attached"] {
        assert_eq!(count(own), 2, "{own} for each:\n{}", merged.render());
    }
    let drivers: Vec<&str> = merged
        .checks
        .iter()
        .filter(|f| f.name == "driver")
        .map(|f| f.detail.as_str())
        .collect();
    assert!(
        drivers[0].starts_with("eth0: ") && drivers[1].starts_with("eth1: "),
        "each names its interface: {drivers:?}"
    );
    assert_eq!(merged.interface, "eth0, eth1");
    // ixgbe's LRO (on eth1) is the warning, named there.
    let lro: Vec<&Finding> = merged.checks.iter().filter(|f| f.name == "lro").collect();
    assert_eq!(lro[1].level, Level::Warn, "{}", lro[1]);
    assert!(lro[1].detail.starts_with("eth1: "), "{}", lro[1]);
}

/// `lb doctor` shows `dataplane.next_program` as `preflight` judged it: the program
/// chained, or the refusal `lb run` would give, naming the field (issue 37).
#[test]
fn the_next_program_is_checked_as_lb_run_checks_it() {
    let mut chained = facts(VETH, Auto);
    chained.next_program = Some(NextProgramFact::Usable(crate::status::NextProgramStatus {
        path: "/sys/fs/bpf/host-fw".into(),
        name: "xdpfilt_alw_all".into(),
        id: 77,
        caller: "lb_xdp_1buf".into(),
    }));
    assert_level(
        &Report::of(chained),
        "next-program",
        Level::Ok,
        &[
            "xdpfilt_alw_all (id 77)",
            "/sys/fs/bpf/host-fw",
            "lb_xdp_1buf",
        ],
    );
    let missing = crate::config::Config::from_toml(
        "[dataplane]\ninterface = \"eth0\"\nnext_program = \"/sys/fs/bpf/lb-doctor-no-such\"\n\
         [[vip]]\nname = \"web\"\naddress = \"10.0.0.100\"\nport = 80\nprotocol = \"tcp\"\n\
         [[vip.backend]]\naddress = \"10.0.0.11\"\n",
    )
    .unwrap();
    let mut refused = facts(VETH, Auto);
    refused.next_program = NextProgramFact::of(&missing);
    assert_level(
        &Report::of(refused),
        "next-program",
        Level::Fail,
        &["dataplane.next_program"],
    );
    // Without one configured, no such check.
    assert!(
        checked(VETH, Auto)
            .checks
            .iter()
            .all(|c| c.name != "next-program")
    );
}
