//! What the host is, as `gather` read it: plain data, so the checks are pure functions of
//! it and tests can build it from recorded answers (`fixtures`). Serialized in
//! `lb doctor --json` (under `facts`), so an operator's report is itself a fixture.

use std::{collections::BTreeMap, path::PathBuf};

use serde::{Deserialize, Serialize};

use crate::config::XdpModeSetting;

/// Everything the checks look at.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Facts {
    /// `dataplane.interface`.
    pub interface: String,
    /// `dataplane.xdp_mode`.
    pub xdp_mode: XdpModeSetting,
    pub privileges: Privileges,
    pub bpffs: Bpffs,
    pub kernel: Kernel,
    /// Online CPUs (each runs the program for the receive queues it serves).
    pub cpus: u32,
    /// The interface; `None` when there is none of that name in this network namespace.
    pub link: Option<Link>,
    /// Whether libxdp's dispatcher loads here (`lb doctor` only: `dispatcher::probe`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dispatcher: Option<super::dispatcher::Dispatcher>,
    /// `dataplane.next_program` as `preflight` opens it (`lb doctor` only: `lb run`
    /// refuses through `preflight` itself); None when not configured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_program: Option<NextProgramFact>,
}

/// What `preflight`'s check made of `dataplane.next_program`.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NextProgramFact {
    /// lb can tail-call it.
    Usable(crate::status::NextProgramStatus),
    /// Refused: the field and why, as `lb check` and `lb run` say it.
    Refused { why: String },
}

impl NextProgramFact {
    /// `preflight`'s check of `config`'s `dataplane.next_program` (None: not configured).
    pub fn of(config: &crate::config::Config) -> Option<Self> {
        match crate::preflight::next_program(config) {
            Ok(next) => next.as_ref().map(|n| Self::Usable(n.into())),
            Err(error) => Some(Self::Refused {
                why: error.to_string(),
            }),
        }
    }
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Privileges {
    pub euid: u32,
    /// Capabilities the agent needs that the process lacks (`CAP_BPF`, ...).
    pub missing: Vec<String>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Bpffs {
    /// `dataplane.pin_path` (or its default).
    pub pin_dir: PathBuf,
    pub state: BpffsState,
    /// The link pinned there (`pin_dir/link`).
    #[serde(default)]
    pub link: PinnedLink,
}

/// The link a previous agent pinned, as the kernel sees it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PinnedLink {
    /// Nothing pinned.
    #[default]
    None,
    /// Attached to the interface of this index.
    Attached { ifindex: u32 },
    /// Its interface went away (while the agent was stopped).
    Defunct,
    /// Pinned but unreadable as an XDP link (bpf(2) said this errno).
    Unreadable { errno: i32 },
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum BpffsState {
    /// The pin directory lies on a bpf filesystem (or will: /sys/fs/bpf is mounted).
    #[default]
    Mounted,
    /// Under /sys/fs/bpf, which is not mounted: `lb run` mounts it.
    Unmounted,
    /// Elsewhere, and not on a bpf filesystem: `lb run` refuses it.
    NotBpffs { existing: PathBuf },
    /// On (or, unmounted, to be mounted on) a bpf filesystem that only this mount
    /// namespace sees (`ip netns exec`): pins go with the agent.
    Private { mounted: bool },
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Kernel {
    /// `uname -r`.
    pub release: String,
    /// /sys/kernel/btf/vmlinux exists.
    pub btf: bool,
    /// /proc/sys/net/core/bpf_jit_enable; `None` when unreadable.
    pub jit: Option<u32>,
}

impl Kernel {
    /// (major, minor) of the release, when it parses.
    pub fn version(&self) -> Option<(u32, u32)> {
        let mut parts = self.release.split(|c: char| !c.is_ascii_digit());
        let major = parts.next()?.parse().ok()?;
        let minor = parts.next()?.parse().ok()?;
        Some((major, minor))
    }
}

/// The interface and what its driver reports.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Link {
    pub name: String,
    pub index: u32,
    /// Administratively up (IFF_UP).
    pub up: bool,
    pub mtu: u32,
    pub max_mtu: Option<u32>,
    /// The rtnetlink link kind (`veth`, `vlan`, `bond`, `bridge` ...); `None` for a
    /// device without one (a physical NIC, virtio).
    pub kind: Option<String>,
    /// A VLAN's (or macvlan's) lower device.
    pub parent: Option<String>,
    /// `ethtool -i`; `None` when the driver does not answer.
    pub driver: Option<Driver>,
    /// The XDP features the driver declares (netdev netlink family, Linux 6.3+); `None`
    /// when the kernel does not report them.
    pub xdp_features: Option<XdpFeatures>,
    /// `ethtool -k`: feature name -> state; `None` when unreadable.
    pub features: Option<BTreeMap<String, Feature>>,
    /// `ethtool -l`; `None` when the driver does not report channels.
    pub channels: Option<Channels>,
    /// XDP programs attached to the interface now.
    pub attached: Vec<Attached>,
    /// The program on the link lb pinned for this interface (`pin_dir/link`), if any.
    pub pinned_program: Option<u32>,
    /// The other end, for a veth.
    pub peer: Option<Peer>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Driver {
    pub name: String,
    pub version: String,
    pub firmware: String,
    pub bus: String,
}

/// `NETDEV_XDP_ACT_*` (include/uapi/linux/netdev.h).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct XdpFeatures(pub u64);

impl XdpFeatures {
    /// XDP_PASS/DROP/TX/ABORTED in the driver: native XDP.
    pub const BASIC: u64 = 1 << 0;
    pub const REDIRECT: u64 = 1 << 1;
    pub const NDO_XMIT: u64 = 1 << 2;
    pub const XSK_ZEROCOPY: u64 = 1 << 3;
    pub const HW_OFFLOAD: u64 = 1 << 4;
    /// Multi-buffer frames on receive: native XDP above a page-sized MTU.
    pub const RX_SG: u64 = 1 << 5;
    pub const NDO_XMIT_SG: u64 = 1 << 6;
    const NAMES: [(u64, &str); 7] = [
        (Self::BASIC, "basic"),
        (Self::REDIRECT, "redirect"),
        (Self::NDO_XMIT, "ndo-xmit"),
        (Self::XSK_ZEROCOPY, "xsk-zerocopy"),
        (Self::HW_OFFLOAD, "hw-offload"),
        (Self::RX_SG, "rx-sg"),
        (Self::NDO_XMIT_SG, "ndo-xmit-sg"),
    ];

    pub fn has(self, bit: u64) -> bool {
        self.0 & bit != 0
    }

    /// The names the kernel's netdev spec gives the bits set, e.g. `basic, rx-sg`.
    pub fn names(self) -> String {
        let names: Vec<&str> = Self::NAMES
            .iter()
            .filter(|(bit, _)| self.has(*bit))
            .map(|(_, name)| *name)
            .collect();
        if names.is_empty() {
            "none".into()
        } else {
            names.join(", ")
        }
    }

    /// From the names `names` prints (fixtures).
    pub fn from_names(text: &str) -> XdpFeatures {
        XdpFeatures(
            text.split([',', ' '])
                .filter_map(|word| Self::NAMES.iter().find(|(_, n)| *n == word.trim()))
                .fold(0, |bits, (bit, _)| bits | bit),
        )
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Feature {
    pub on: bool,
    /// The driver does not let it change (`[fixed]` in `ethtool -k`).
    pub fixed: bool,
}

/// `ethtool -l`: current and maximum counts; `None` where the driver says n/a.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Channels {
    pub rx: Option<u32>,
    pub tx: Option<u32>,
    pub combined: Option<u32>,
    pub max_rx: Option<u32>,
    pub max_tx: Option<u32>,
    pub max_combined: Option<u32>,
}

impl Channels {
    /// Queues that receive: combined ones and receive-only ones.
    pub fn rx_queues(&self) -> u32 {
        self.combined.unwrap_or(0) + self.rx.unwrap_or(0)
    }

    /// The most combined (queue-pair) channels the device can have.
    pub fn max_pairs(&self) -> u32 {
        self.max_combined.unwrap_or(0)
    }
}

/// An XDP program attached to an interface.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Attached {
    pub id: u32,
    /// Its name as the kernel knows it (truncated to 15 characters); `None` when it
    /// could not be read.
    pub name: Option<String>,
    /// `native`, `generic` or `offload`.
    pub mode: String,
}

impl std::fmt::Display for Attached {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = self.name.as_deref().unwrap_or("(name unreadable)");
        write!(f, "{name} (id {}, {})", self.id, self.mode)
    }
}

/// A veth's other end.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Peer {
    pub index: u32,
    /// The peer's namespace as this one numbers it; `None`: the same namespace.
    pub netns_id: Option<i32>,
    /// `None` when the peer could not be read (another namespace without an id).
    pub name: Option<String>,
    pub attached: Vec<Attached>,
    /// It is a port of a bridge (or bond): frames reach it from other senders.
    pub enslaved: bool,
    /// Its tx checksum offload, when readable (in another namespace: read there).
    pub tx_checksum: Option<bool>,
    /// Why `tx_checksum` could not be read, when it could not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tx_checksum_unread: Option<String>,
}
