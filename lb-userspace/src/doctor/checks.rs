//! The checks: pure functions of [`Facts`], one [`Finding`] each, in the order printed.
//! What is fatal depends on the configured `xdp_mode`: a driver without native XDP fails
//! `native`, is a warning for `auto` (which then attaches in generic mode) and nothing
//! for `generic`.

use serde::Serialize;

use super::{
    dispatcher::Dispatcher,
    facts::{Facts, Feature, Link, NextProgramFact, Peer, XdpFeatures},
};
use crate::config::XdpModeSetting;
use crate::dataplane::{
    foreign_program_fix,
    next::{LB_XDP, LB_XDP_1BUF},
};

/// The oldest kernel the program loads on: multi-buffer XDP (`xdp.frags`,
/// `BPF_F_XDP_HAS_FRAGS`) and `bpf_xdp_load_bytes` are 5.18's; BPF links for XDP 5.9's.
pub const MIN_KERNEL: (u32, u32) = (5, 18);

pub use crate::dataplane::SINGLE_BUFFER_MTU;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Level {
    Ok,
    Warn,
    Fail,
}

impl std::fmt::Display for Level {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Level::Ok => "ok",
            Level::Warn => "warn",
            Level::Fail => "fail",
        })
    }
}

/// One check's outcome: `LEVEL NAME: detail`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Finding {
    pub name: &'static str,
    pub level: Level,
    /// What was found, and the fix in words where there is one.
    pub detail: String,
    /// Offloads (ethtool feature names) that `lb doctor --fix` turns off; empty when
    /// there is nothing it can do.
    pub fix: Vec<String>,
}

impl std::fmt::Display for Finding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}: {}", self.level, self.name, self.detail)
    }
}

/// A warning that `--fix` can act on (when `fix` names any offload).
fn fixable(name: &'static str, detail: String, fix: Vec<String>) -> Finding {
    Finding {
        name,
        level: Level::Warn,
        detail,
        fix,
    }
}

fn finding(name: &'static str, level: Level, detail: impl Into<String>) -> Finding {
    Finding {
        name,
        level,
        detail: detail.into(),
        fix: Vec::new(),
    }
}

/// Every check that applies, in order.
pub fn check(facts: &Facts) -> Vec<Finding> {
    let mut out = vec![
        privileges(facts),
        bpffs(facts),
        pins(facts),
        kernel(facts),
        btf(facts),
        jit(facts),
        interface(facts),
    ];
    out.extend(facts.dispatcher.as_ref().map(dispatcher));
    out.extend(facts.next_program.as_ref().map(next_program));
    let Some(link) = &facts.link else {
        return out;
    };
    out.extend([
        driver(link),
        native_xdp(facts, link),
        mtu(facts, link),
        vlan_offload(link),
        lro(facts, link),
        gro(facts, link),
        channels(facts, link),
        xdp_attached(facts, link),
    ]);
    if is_veth(link) {
        out.push(veth_peer(facts, link));
        if native_expected(facts) {
            out.push(veth_checksum(link));
        }
    }
    out
}

/// Why native mode would not work on this interface, when that is certain from the
/// facts alone: `auto` then attaches in generic mode at once, and `native` fails.
pub fn native_refusal(facts: &Facts) -> Option<String> {
    obstacles(facts)
        .into_iter()
        .find(|(_, certain)| *certain)
        .map(|(why, _)| why)
}

/// What stands in native mode's way: (why, whether it is certain). The uncertain ones
/// are the driver's to judge at attach time (`auto` tries native and falls back).
fn obstacles(facts: &Facts) -> Vec<(String, bool)> {
    let Some(link) = facts.link.as_ref() else {
        return Vec::new();
    };
    let driver = driver_name(link);
    let mut found = Vec::new();
    if link.kind.as_deref() == Some("vlan") {
        let why = format!(
            "{} is a VLAN device, which has no native XDP",
            facts.interface
        );
        found.push((why, true));
    }
    if let Some(features) = link.xdp_features
        && !features.has(XdpFeatures::BASIC)
    {
        found.push((format!("the {driver} driver has no native XDP"), true));
    }
    if let Some(peer) = link.peer.as_ref().filter(|p| p.name.is_some())
        && peer.attached.is_empty()
    {
        let why = format!(
            "its veth peer {} has no XDP program, so native XDP_TX would drop every frame",
            peer_name(peer)
        );
        found.push((why, true));
    }
    if link.mtu > SINGLE_BUFFER_MTU
        && let Some(features) = link.xdp_features
        && !features.has(XdpFeatures::RX_SG)
    {
        let why = format!(
            "MTU {} is above what {driver} gives an XDP program in one buffer (about \
             {SINGLE_BUFFER_MTU}) and it has no multi-buffer XDP (rx-sg)",
            link.mtu
        );
        found.push((why, false));
    }
    if driver == "virtio_net" && feature(link, "rx-gro-hw").is_some_and(|f| f.on && f.fixed) {
        let why = "virtio_net refuses native XDP while the host offloads receive GRO/checksums \
                   and the guest cannot turn that off (rx-gro-hw on [fixed])";
        found.push((why.to_string(), false));
    }
    found
}

/// Whether native mode is known to serve here: the driver declares native XDP, nothing
/// known stands in its way, and on a veth the peer is readable (so it has a program). A
/// pinned program in generic mode is then moved to native (`auto`).
pub fn native_known(facts: &Facts) -> bool {
    let Some(link) = facts.link.as_ref() else {
        return false;
    };
    let declared = link.xdp_features.is_some_and(|f| f.has(XdpFeatures::BASIC));
    let peer_seen = !is_veth(link) || link.peer.as_ref().is_some_and(|p| p.name.is_some());
    declared && peer_seen && obstacles(facts).is_empty()
}

/// Whether the program will run in native mode as far as the facts tell.
fn native_expected(facts: &Facts) -> bool {
    match facts.xdp_mode {
        XdpModeSetting::Native => true,
        XdpModeSetting::Generic => false,
        XdpModeSetting::Auto => obstacles(facts).is_empty(),
    }
}

/// A problem of native mode: fatal for `native`, a warning for `auto` (which falls back
/// to generic), nothing for `generic`.
fn native_problem(facts: &Facts, name: &'static str, problem: String, fix: &str) -> Finding {
    match facts.xdp_mode {
        XdpModeSetting::Native => finding(
            name,
            Level::Fail,
            format!("{problem}: {fix}, or set xdp_mode = \"generic\" (or \"auto\")"),
        ),
        XdpModeSetting::Auto => finding(
            name,
            Level::Warn,
            format!(
                "{problem}: xdp_mode = \"auto\" attaches in generic mode (slower: after the \
                 kernel built an skb); for native: {fix}"
            ),
        ),
        XdpModeSetting::Generic => finding(
            name,
            Level::Ok,
            format!("{problem}; xdp_mode = \"generic\" does not need it"),
        ),
    }
}

fn privileges(facts: &Facts) -> Finding {
    let p = &facts.privileges;
    if p.missing.is_empty() {
        let who = if p.euid == 0 {
            "root".to_string()
        } else {
            format!("uid {} with the capabilities needed", p.euid)
        };
        return finding("privileges", Level::Ok, who);
    }
    finding(
        "privileges",
        Level::Fail,
        format!(
            "uid {} lacks {}: run as root (or grant CAP_BPF, CAP_NET_ADMIN, CAP_PERFMON and \
             CAP_SYS_ADMIN)",
            p.euid,
            p.missing.join(", ")
        ),
    )
}

fn bpffs(facts: &Facts) -> Finding {
    use super::facts::BpffsState;
    let dir = facts.bpffs.pin_dir.display();
    match &facts.bpffs.state {
        BpffsState::Mounted => finding("bpffs", Level::Ok, format!("pins in {dir}")),
        BpffsState::Unmounted => finding(
            "bpffs",
            Level::Ok,
            format!("no bpf filesystem at /sys/fs/bpf yet: lb run mounts one (pins in {dir})"),
        ),
        BpffsState::Private { mounted } => finding(
            "bpffs",
            Level::Warn,
            format!(
                "{} bpf filesystem only this mount namespace sees (pins in {dir}; `ip netns \
                 exec` gives each command a fresh /sys): the program would go when the \
                 agent stops; {}",
                if *mounted {
                    "pins on a"
                } else {
                    "lb run would mount a"
                },
                crate::bpffs::PRIVATE_FIX
            ),
        ),
        BpffsState::NotBpffs { existing } => finding(
            "bpffs",
            Level::Fail,
            format!(
                "pin_path {dir} is not on a bpf filesystem: mount one (mount -t bpf bpf {}) \
                 or set pin_path under /sys/fs/bpf",
                existing.display()
            ),
        ),
    }
}

/// What a previous agent pinned: stale pins (a link whose interface is gone, or on
/// another interface) are no reason to refuse, since `lb run` replaces them, but they
/// are worth knowing about.
fn pins(facts: &Facts) -> Finding {
    use super::facts::PinnedLink;
    let dir = facts.bpffs.pin_dir.display();
    let name = &facts.interface;
    let index = facts.link.as_ref().map(|l| l.index);
    let stale = |what: String| {
        finding(
            "pins",
            Level::Warn,
            format!(
                "stale: {what}; lb run replaces it with a new link on {name}, keeping the \
                 pinned maps (and their flows) where their layout matches \
                 (`lb detach --config FILE` removes the pins instead)"
            ),
        )
    };
    match &facts.bpffs.link {
        PinnedLink::None => finding("pins", Level::Ok, format!("nothing pinned in {dir}")),
        PinnedLink::Attached { ifindex } if index.is_none_or(|i| i == *ifindex) => finding(
            "pins",
            Level::Ok,
            format!("the link pinned in {dir} is attached to {name}: lb run adopts it"),
        ),
        PinnedLink::Attached { ifindex } => stale(format!(
            "the link pinned in {dir} is attached to interface index {ifindex}, not {name}              (index {})",
            index.unwrap_or_default()
        )),
        PinnedLink::Defunct => stale(format!(
            "the link pinned in {dir} is defunct: its interface went away while the agent \
             was stopped"
        )),
        PinnedLink::Unreadable { errno } => finding(
            "pins",
            Level::Warn,
            format!(
                "the link pinned in {dir} is unreadable ({}); lb run replaces it",
                std::io::Error::from_raw_os_error(*errno)
            ),
        ),
    }
}

fn kernel(facts: &Facts) -> Finding {
    let release = &facts.kernel.release;
    match facts.kernel.version() {
        Some(v) if v < MIN_KERNEL => finding(
            "kernel",
            Level::Fail,
            format!(
                "Linux {release}: lb needs {}.{} or later (multi-buffer XDP, \
                 bpf_xdp_load_bytes, BPF links for XDP)",
                MIN_KERNEL.0, MIN_KERNEL.1
            ),
        ),
        Some(v) => {
            let features = if v >= (6, 3) {
                ""
            } else {
                "; drivers report their XDP features from 6.3 on, so native support is \
                 judged by the driver's name"
            };
            finding(
                "kernel",
                Level::Ok,
                format!("Linux {release}: multi-buffer XDP and BPF links for XDP{features}"),
            )
        }
        None => finding(
            "kernel",
            Level::Warn,
            format!(
                "cannot read the version of Linux {release:?}: lb needs {}.{} or later",
                MIN_KERNEL.0, MIN_KERNEL.1
            ),
        ),
    }
}

fn btf(facts: &Facts) -> Finding {
    if facts.kernel.btf {
        finding("btf", Level::Ok, "kernel BTF at /sys/kernel/btf/vmlinux")
    } else {
        finding(
            "btf",
            Level::Warn,
            "no kernel BTF (/sys/kernel/btf/vmlinux): lb_xdp needs none, but bpftool and \
             tracing tools show less about it; build the kernel with CONFIG_DEBUG_INFO_BTF=y",
        )
    }
}

fn jit(facts: &Facts) -> Finding {
    match facts.kernel.jit {
        Some(0) => finding(
            "jit",
            Level::Warn,
            "the BPF JIT is off: the program runs interpreted, several times slower: \
             sysctl -w net.core.bpf_jit_enable=1",
        ),
        Some(_) => finding("jit", Level::Ok, "BPF JIT on"),
        None => finding(
            "jit",
            Level::Ok,
            "net.core.bpf_jit_enable is not readable here (only the initial network namespace \
             has it); a kernel built with the JIT always on has it 1",
        ),
    }
}

fn interface(facts: &Facts) -> Finding {
    let name = &facts.interface;
    let Some(link) = &facts.link else {
        return finding(
            "interface",
            Level::Fail,
            format!(
                "no interface {name} in this network namespace: set dataplane.interface to \
                 the NIC that receives the VIPs' traffic (ip -br link)"
            ),
        );
    };
    let parent = link.parent.as_deref().unwrap_or("its parent");
    match link.kind.as_deref() {
        Some("vlan") => {
            return finding(
                "interface",
                Level::Fail,
                format!(
                    "{name} is a VLAN sub-interface: XDP sees its frames only in generic mode \
                     and after the tag is gone; attach to {parent} (the program forwards \
                     frames with one 802.1Q tag, keeping it)"
                ),
            );
        }
        Some(kind @ ("bond" | "team")) => {
            return finding(
                "interface",
                Level::Warn,
                format!(
                    "{name} is a {kind}: native XDP needs every port's driver to have it \
                     (bond: Linux 5.15+), and XDP_TX leaves through the port the bond's hash \
                     picks; attaching to each port is the tested way"
                ),
            );
        }
        Some(kind @ ("bridge" | "macvlan" | "ipvlan" | "vxlan" | "geneve" | "tun" | "tap")) => {
            return finding(
                "interface",
                Level::Warn,
                format!(
                    "{name} is a {kind} device: attach to the device the frames arrive on \
                     (the NIC) for native XDP"
                ),
            );
        }
        _ => {}
    }
    if !link.up {
        return finding(
            "interface",
            Level::Warn,
            format!("{name} is down: no traffic until `ip link set {name} up`"),
        );
    }
    finding(
        "interface",
        Level::Ok,
        format!("{name} (index {}) is up", link.index),
    )
}

fn driver_name(link: &Link) -> &str {
    link.driver
        .as_ref()
        .map(|d| d.name.as_str())
        .or(link.kind.as_deref())
        .unwrap_or("its")
}

/// What is worth knowing about a driver for XDP. Kept in step with the README's
/// "Running on a real NIC".
pub fn driver_note(driver: &str) -> Option<&'static str> {
    Some(match driver {
        "mlx5_core" => {
            "native XDP; multi-buffer (MTU above ~3.5 KB) on recent kernels; LRO must be off"
        }
        "i40e" => "native XDP; one buffer holds at most ~3 KB, multi-buffer from Linux 6.4",
        "ice" => "native XDP; multi-buffer from Linux 6.3",
        "ixgbe" => "native XDP in one buffer only (MTU up to ~3 KB); an XDP TX ring per CPU",
        "ixgbevf" => "native XDP in one buffer only (MTU up to ~3.5 KB)",
        "bnxt_en" => {
            "native XDP; multi-buffer from Linux 5.19; it turns hardware GRO/LRO off when a \
             program attaches"
        }
        "ena" => {
            "native XDP in one buffer only (MTU at most 3498); XDP_TX needs half the queues \
             free (ethtool -L combined at most half the maximum)"
        }
        "virtio_net" => {
            "native XDP; lock-free XDP_TX needs a spare queue pair per CPU; the host's receive \
             offloads (guest TSO/checksum) must be off or controllable; multi-buffer from \
             Linux 6.3"
        }
        "veth" => {
            "native XDP, multi-buffer; XDP_TX needs an XDP program on the peer, and loses \
             CHECKSUM_PARTIAL from senders with tx checksum offload"
        }
        "hv_netvsc" => "native XDP (passed on to the VF); LRO (RSC) must be off",
        "igb" | "igc" => "native XDP in one buffer only",
        "tun" => "native XDP (tap devices)",
        _ => return None,
    })
}

fn driver(link: &Link) -> Finding {
    let Some(d) = &link.driver else {
        return finding(
            "driver",
            Level::Warn,
            "the driver does not answer ethtool's driver query",
        );
    };
    let mut detail = d.name.clone();
    if !d.version.is_empty() {
        detail += &format!(" {}", d.version);
    }
    if !d.firmware.is_empty() {
        detail += &format!(", firmware {}", d.firmware);
    }
    if !d.bus.is_empty() {
        detail += &format!(" ({})", d.bus);
    }
    if let Some(note) = driver_note(&d.name) {
        detail += &format!(": {note}");
    }
    finding("driver", Level::Ok, detail)
}

/// Drivers with native XDP, for kernels that do not report XDP features (before 6.3).
const NATIVE_DRIVERS: [&str; 22] = [
    "mlx4_en",
    "mlx5_core",
    "i40e",
    "ice",
    "ixgbe",
    "ixgbevf",
    "igb",
    "igc",
    "bnxt_en",
    "ena",
    "virtio_net",
    "veth",
    "tun",
    "hv_netvsc",
    "nfp",
    "qede",
    "thunderx",
    "mvneta",
    "mvpp2",
    "sfc",
    "gve",
    "enetc",
];

fn native_xdp(facts: &Facts, link: &Link) -> Finding {
    let driver = driver_name(link);
    match link.xdp_features {
        Some(features) if features.has(XdpFeatures::BASIC) => finding(
            "native-xdp",
            Level::Ok,
            format!("{driver} has native XDP ({})", features.names()),
        ),
        Some(_) => native_problem(
            facts,
            "native-xdp",
            format!("the {driver} driver has no native XDP"),
            "use a NIC whose driver has it (see the manual's \"Running on a real NIC\")",
        ),
        None if NATIVE_DRIVERS.contains(&driver) => finding(
            "native-xdp",
            Level::Ok,
            format!("{driver} has native XDP (by its name: the kernel reports no XDP features)"),
        ),
        None if facts.xdp_mode == XdpModeSetting::Generic => {
            finding("native-xdp", Level::Ok, "xdp_mode = \"generic\"")
        }
        None => finding(
            "native-xdp",
            Level::Warn,
            format!(
                "cannot tell whether {driver} has native XDP (the kernel reports no XDP \
                 features): if attaching fails, set xdp_mode = \"generic\""
            ),
        ),
    }
}

fn mtu(facts: &Facts, link: &Link) -> Finding {
    let (mtu, driver) = (link.mtu, driver_name(link));
    let base = format!("MTU {mtu}");
    if facts.xdp_mode == XdpModeSetting::Generic {
        return finding(
            "mtu",
            Level::Ok,
            format!("{base}: generic mode takes any MTU (lb_xdp is multi-buffer aware)"),
        );
    }
    if mtu <= SINGLE_BUFFER_MTU {
        return finding(
            "mtu",
            Level::Ok,
            format!("{base}: a frame fits one buffer on every driver"),
        );
    }
    match link.xdp_features {
        Some(f) if f.has(XdpFeatures::RX_SG) => finding(
            "mtu",
            Level::Ok,
            format!(
                "{base}: {driver} has multi-buffer XDP (rx-sg) and lb_xdp is multi-buffer aware \
                 (it reads only the headers, in the first buffer)"
            ),
        ),
        Some(_) => native_problem(
            facts,
            "mtu",
            format!(
                "{base} is above what {driver} gives an XDP program in one buffer (about \
                 {SINGLE_BUFFER_MTU}) and it has no multi-buffer XDP (rx-sg)"
            ),
            &format!("lower the MTU to {SINGLE_BUFFER_MTU} or less"),
        ),
        None => finding(
            "mtu",
            Level::Warn,
            format!(
                "{base}: cannot tell whether {driver} has multi-buffer XDP (the kernel reports \
                 no XDP features); if attaching fails with an MTU error, lower the MTU to \
                 {SINGLE_BUFFER_MTU} or less, or set xdp_mode = \"generic\""
            ),
        ),
    }
}

fn feature<'a>(link: &'a Link, name: &str) -> Option<&'a Feature> {
    link.features.as_ref()?.get(name)
}

/// Of `names`, those on that `--fix` can turn off, and those on that the driver fixes.
fn offloads_on(link: &Link, names: &[&str]) -> (Vec<String>, Vec<String>) {
    let mut changeable = Vec::new();
    let mut fixed = Vec::new();
    for &name in names {
        match feature(link, name) {
            Some(f) if f.on && f.fixed => fixed.push(name.to_string()),
            Some(f) if f.on => changeable.push(name.to_string()),
            _ => {}
        }
    }
    (changeable, fixed)
}

fn unreadable(name: &'static str) -> Finding {
    finding(
        name,
        Level::Warn,
        "cannot read the interface's offloads (ethtool netlink)",
    )
}

/// `--fix`'s words for what it does and what an operator types instead.
fn fix_words(link_name: &str, features: &[String]) -> String {
    format!(
        "turn {} off (`lb doctor --fix`, or ethtool -K {link_name} {})",
        features.join(", "),
        features
            .iter()
            .map(|f| format!("{} off", ethtool_word(f)))
            .collect::<Vec<_>>()
            .join(" ")
    )
}

/// The short name `ethtool -K` takes for a feature, where it has one.
fn ethtool_word(feature: &str) -> &str {
    match feature {
        "rx-vlan-hw-parse" => "rxvlan",
        "tx-vlan-hw-insert" => "txvlan",
        "rx-vlan-stag-hw-parse" => "rx-vlan-stag-hw-parse",
        "rx-lro" => "lro",
        "rx-gro" => "gro",
        "rx-gro-hw" => "rx-gro-hw",
        other => other,
    }
}

fn vlan_offload(link: &Link) -> Finding {
    const NAME: &str = "vlan-offload";
    if link.features.is_none() {
        return unreadable(NAME);
    }
    let rx = ["rx-vlan-hw-parse", "rx-vlan-stag-hw-parse"];
    let (changeable, fixed) = offloads_on(link, &rx);
    if changeable.is_empty() && fixed.is_empty() {
        let tx = if feature(link, "tx-vlan-hw-insert").is_some_and(|f| f.on) {
            " (tx-vlan-hw-insert is on: it does not touch frames XDP sends)"
        } else {
            ""
        };
        return finding(
            NAME,
            Level::Ok,
            format!("receive VLAN offload off: tagged frames reach XDP with their tag{tx}"),
        );
    }
    let iface = link_name(link);
    let mut detail = format!(
        "{} on: the driver strips VLAN tags before XDP runs, so a tagged VIP frame is \
         forwarded without its tag",
        [changeable.clone(), fixed.clone()].concat().join(", ")
    );
    let mut fix = changeable.clone();
    if !fix.is_empty() {
        // Off together, as vc5 and the kernel's XDP VLAN selftest do: a tag the stack
        // inserts as metadata is as invisible to an XDP program on the receiving side.
        if feature(link, "tx-vlan-hw-insert").is_some_and(|f| f.on && !f.fixed) {
            fix.push("tx-vlan-hw-insert".into());
        }
        detail += &format!(": {}", fix_words(&iface, &fix));
    }
    if !fixed.is_empty() {
        detail += &format!(
            "; {} cannot be changed on this driver: no tagged VIP traffic here",
            fixed.join(", ")
        );
    }
    fixable(NAME, detail, fix)
}

fn lro(facts: &Facts, link: &Link) -> Finding {
    const NAME: &str = "lro";
    if link.features.is_none() {
        return unreadable(NAME);
    }
    let (changeable, fixed) = offloads_on(link, &["rx-lro", "rx-gro-hw"]);
    if changeable.is_empty() && fixed.is_empty() {
        return finding(NAME, Level::Ok, "LRO and hardware GRO off");
    }
    let iface = link_name(link);
    let on = [changeable.clone(), fixed.clone()].concat().join(", ");
    let problem = format!(
        "{on} on: the NIC merges segments before XDP runs; several drivers refuse native XDP \
         with it (mlx5, hv_netvsc, virtio_net), others forward merged frames larger than the \
         MTU"
    );
    if !changeable.is_empty() {
        let detail = format!("{problem}: {}", fix_words(&iface, &changeable));
        return fixable(NAME, detail, changeable);
    }
    if driver_name(link) == "virtio_net" {
        return native_problem(
            facts,
            NAME,
            format!("{on} (fixed): virtio_net refuses native XDP while the host offloads receive"),
            "turn the guest offloads off on the host (e.g. QEMU virtio-net-pci \
             guest_tso4=off,guest_tso6=off,guest_ecn=off,guest_ufo=off,guest_csum=off)",
        );
    }
    finding(
        NAME,
        Level::Warn,
        format!("{problem}; the driver does not let it change"),
    )
}

fn gro(facts: &Facts, link: &Link) -> Finding {
    const NAME: &str = "gro";
    let Some(gro) = feature(link, "rx-gro") else {
        return if link.features.is_none() {
            unreadable(NAME)
        } else {
            finding(NAME, Level::Ok, "no GRO on this interface")
        };
    };
    if !gro.on {
        return finding(NAME, Level::Ok, "GRO off");
    }
    if native_expected(facts) {
        return finding(
            NAME,
            Level::Ok,
            "GRO on: native XDP runs before it, so it only merges what lb passes to the stack",
        );
    }
    let mut detail = "GRO on and the program runs in generic mode, after GRO: it sees merged \
                      segments (one packet counted per merged burst, frames larger than the \
                      MTU)"
        .to_string();
    let fix = if gro.fixed {
        Vec::new()
    } else {
        vec!["rx-gro".to_string()]
    };
    if !fix.is_empty() {
        detail += &format!(
            "; for exact per-packet counters: {}",
            fix_words(&link_name(link), &fix)
        );
    }
    fixable(NAME, detail, fix)
}

fn channels(facts: &Facts, link: &Link) -> Finding {
    const NAME: &str = "channels";
    let Some(ch) = link.channels else {
        return finding(NAME, Level::Ok, "the driver does not report channels");
    };
    let (rx, cpus, iface) = (ch.rx_queues(), facts.cpus, link_name(link));
    if is_veth(link) {
        return finding(
            NAME,
            Level::Ok,
            format!("veth: {rx} receive queue(s) for {cpus} CPU(s)"),
        );
    }
    let mut problems = Vec::new();
    if rx > 0 && rx < cpus {
        let most = ch.max_pairs() + ch.max_rx.unwrap_or(0);
        let raise = if most >= cpus {
            format!("ethtool -L {iface} combined {cpus}")
        } else if most > rx {
            format!("ethtool -L {iface} combined {most} (the device's most)")
        } else {
            "the device has no more".to_string()
        };
        problems.push(format!(
            "{rx} receive queue(s) for {cpus} CPUs: RSS spreads flows over {rx} CPU(s) only, \
             and the connection table's per-CPU shares of the others stay unused; {raise}"
        ));
    }
    let driver = driver_name(link);
    if driver == "virtio_net" && ch.combined.unwrap_or(0) + cpus > ch.max_pairs() {
        problems.push(format!(
            "virtio_net has {} queue pair(s), {} in use: XDP_TX needs a spare one per CPU \
             ({cpus}), so it runs in a locked, slower mode sharing queues: give the VM at least \
             {} queue pairs",
            ch.max_pairs(),
            ch.combined.unwrap_or(0),
            ch.combined.unwrap_or(1) + cpus
        ));
    }
    if driver == "ena" && ch.combined.unwrap_or(0) * 2 > ch.max_pairs() {
        problems.push(format!(
            "ena needs half its queues free for XDP_TX: ethtool -L {iface} combined {}",
            (ch.max_pairs() / 2).max(1)
        ));
    }
    if problems.is_empty() {
        return finding(
            NAME,
            Level::Ok,
            format!("{rx} receive queue(s) for {cpus} CPU(s)"),
        );
    }
    finding(NAME, Level::Warn, problems.join("; "))
}

fn xdp_attached(facts: &Facts, link: &Link) -> Finding {
    const NAME: &str = "xdp-attached";
    let iface = &facts.interface;
    let foreign: Vec<_> = link
        .attached
        .iter()
        .filter(|p| Some(p.id) != link.pinned_program)
        .collect();
    if let Some(other) = foreign.first() {
        let lb_build = |name: &str| [LB_XDP, LB_XDP_1BUF].contains(&name);
        let whose = if other.name.as_deref().is_some_and(lb_build) {
            "another lb agent's program (not the one pinned in this pin_path)".to_string()
        } else {
            "another program".to_string()
        };
        return finding(
            NAME,
            Level::Fail,
            format!(
                "{whose} is attached to {iface}: {other}; lb replaces nothing and cannot \
                 attach beside it: {}",
                foreign_program_fix(iface)
            ),
        );
    }
    match link.attached.first() {
        Some(ours) => finding(
            NAME,
            Level::Ok,
            format!(
                "lb's pinned program is attached: {ours}; lb run adopts it ({})",
                facts.bpffs.pin_dir.display()
            ),
        ),
        None => finding(NAME, Level::Ok, format!("no XDP program on {iface}")),
    }
}

/// libxdp's dispatcher, when `lb doctor` probed it: lb does not need it, but a host
/// program loaded with libxdp shares the hook with lb only through it (or by chaining).
fn dispatcher(probe: &Dispatcher) -> Finding {
    const NAME: &str = "libxdp-dispatcher";
    match probe {
        Dispatcher::Accepted => finding(
            NAME,
            Level::Ok,
            "this kernel accepts libxdp's multi-program dispatcher (xdp-loader's check \
             passed); lb does not use it: other XDP programs run behind lb through \
             dataplane.next_program",
        ),
        Dispatcher::Refused { why } => finding(
            NAME,
            Level::Warn,
            format!(
                "this kernel refuses libxdp's multi-program dispatcher (xdp-loader: {why}): \
                 programs loaded with libxdp (xdp-filter, xdp-loader) take the whole XDP \
                 hook, so they cannot run beside lb on the interface; run them behind lb \
                 with dataplane.next_program (a tail call, which this kernel allows)"
            ),
        ),
        Dispatcher::NotChecked { why } => finding(
            NAME,
            Level::Ok,
            format!("not checked: {why}; lb does not need it"),
        ),
    }
}

/// `dataplane.next_program`, as `preflight` (`lb check`, `lb run`) judged it.
fn next_program(fact: &NextProgramFact) -> Finding {
    const NAME: &str = "next-program";
    match fact {
        NextProgramFact::Usable(next) => finding(
            NAME,
            Level::Ok,
            format!(
                "{} (id {}) pinned at {}: lb's {} tail-calls it with every frame it passes",
                next.name, next.id, next.path, next.caller
            ),
        ),
        NextProgramFact::Refused { why } => finding(NAME, Level::Fail, why.clone()),
    }
}

fn is_veth(link: &Link) -> bool {
    link.kind.as_deref() == Some("veth")
}

fn link_name(link: &Link) -> String {
    link.name.clone()
}

fn peer_name(peer: &Peer) -> String {
    let name = peer.name.as_deref().unwrap_or("(unreadable)");
    match peer.netns_id {
        Some(id) => format!("{name} (netns id {id})"),
        None => name.to_string(),
    }
}

fn veth_peer(facts: &Facts, link: &Link) -> Finding {
    const NAME: &str = "veth-peer";
    let Some(peer) = &link.peer else {
        return finding(NAME, Level::Warn, "cannot find the veth's peer");
    };
    if peer.name.is_none() {
        let level = if facts.xdp_mode == XdpModeSetting::Generic {
            Level::Ok
        } else {
            Level::Warn
        };
        return finding(
            NAME,
            level,
            format!(
                "the peer (index {}) is in another network namespace this one has no id for: \
                 native XDP_TX on a veth needs an XDP program (any XDP_PASS) on the peer",
                peer.index
            ),
        );
    }
    let name = peer_name(peer);
    if let Some(program) = peer.attached.first() {
        return finding(
            NAME,
            Level::Ok,
            format!("peer {name} has an XDP program ({program}): native XDP_TX reaches it"),
        );
    }
    native_problem(
        facts,
        NAME,
        format!("its veth peer {name} has no XDP program, so native XDP_TX would drop every frame"),
        &format!(
            "attach one to {peer} (any XDP_PASS program, native mode: `lb peer attach {peer}`, \
             in the peer's namespace)",
            peer = peer.name.as_deref().unwrap_or("the peer")
        ),
    )
}

fn veth_checksum(link: &Link) -> Finding {
    const NAME: &str = "veth-checksum";
    let note = "native XDP_TX on a veth forwards a frame without the checksum a sender with \
                tx checksum offload left to the hardware (CHECKSUM_PARTIAL): backends drop such \
                TCP segments (TcpInCsumErrors)";
    // Every frame that reaches this veth is sent by its peer, and a device without tx
    // checksum offload gets complete checksums: the kernel computes a CHECKSUM_PARTIAL
    // frame's before it transmits it (validate_xmit_skb). So the peer's offload is the
    // one that counts, also when it is a bridge port that forwards other senders' frames.
    let (peer, name) = match &link.peer {
        Some(peer) if peer.name.is_some() => (peer, peer_name(peer)),
        // Not known: saying so is all that is honest (a warning would never clear).
        Some(peer) => {
            return finding(
                NAME,
                Level::Ok,
                format!(
                    "not checked: the peer (index {}) is in a network namespace this one has \
                     no id for; {note}: senders on veths need `ethtool -K DEV tx off`",
                    peer.index
                ),
            );
        }
        None => {
            return finding(
                NAME,
                Level::Ok,
                format!("not checked: the veth's peer is unknown; {note}"),
            );
        }
    };
    let role = if peer.enslaved {
        format!("the bridge port every frame to {} leaves by", link.name)
    } else {
        "the only sender".to_string()
    };
    match (peer.tx_checksum, &peer.tx_checksum_unread) {
        (Some(false), _) if peer.enslaved => finding(
            NAME,
            Level::Ok,
            format!(
                "peer {name}, {role}, has tx checksum offload off: the kernel completes other \
                 senders' checksums before it"
            ),
        ),
        (Some(false), _) => finding(
            NAME,
            Level::Ok,
            format!("{role}, peer {name}, has tx checksum offload off"),
        ),
        (Some(true), _) => finding(
            NAME,
            Level::Warn,
            format!(
                "peer {name}, {role}, has tx checksum offload on; {note}: `ethtool -K {} tx \
                 off`{}",
                peer.name.as_deref().unwrap_or("DEV"),
                if peer.netns_id.is_some() {
                    " in its namespace"
                } else {
                    ""
                }
            ),
        ),
        (None, why) => finding(
            NAME,
            Level::Ok,
            format!(
                "not checked: the tx checksum offload of peer {name} could not be read ({}); \
                 {note}: where it is on, turn it off on the peer (`ethtool -K DEV tx off`)",
                why.as_deref().unwrap_or("no reason recorded")
            ),
        ),
    }
}
