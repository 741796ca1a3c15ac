//! Reads the host into [`Facts`]: /proc and /sys, rtnetlink (the link, its XDP programs,
//! a veth's peer), ethtool's netlink interface (offloads, channels), the netdev netlink
//! family (XDP features), the ethtool driver-info ioctl and bpf(2) (program names, the
//! pinned link). Nothing here fails: what cannot be read stays `None` and the checks say
//! so.

use std::{collections::BTreeMap, path::Path};

use futures::TryStreamExt;
use rtnetlink::packet_route::link::{
    InfoKind, LinkAttribute, LinkFlags, LinkInfo, LinkMessage, LinkXdp, XdpAttached,
};

use super::{
    facts::{
        Attached, Bpffs, BpffsState, Channels, Driver, Facts, Feature, Kernel, Link, Peer,
        PinnedLink, Privileges,
    },
    netlink::Ethtool,
    peerns,
};
use crate::config::Config;

/// /sys/fs/bpf: where `lb run` mounts a bpffs when there is none.
const BPF_FS: &str = "/sys/fs/bpf";
const BPF_FS_MAGIC: u64 = 0xcafe_4a11;

/// Reads everything the checks need about the host and `config`'s interface.
pub async fn gather(config: &Config) -> Facts {
    let dataplane = &config.dataplane;
    let pin_dir = dataplane.pin_dir();
    let mut facts = Facts {
        interface: dataplane.interface.clone(),
        xdp_mode: dataplane.xdp_mode,
        privileges: privileges(),
        bpffs: Bpffs {
            state: bpffs_state(&pin_dir),
            pin_dir: pin_dir.clone(),
            link: pinned_link(&pin_dir),
        },
        kernel: kernel(),
        cpus: aya::util::online_cpus()
            .map(|cpus| cpus.len() as u32)
            .unwrap_or(1),
        link: None,
        dispatcher: None,
        next_program: None,
    };
    let Ok((connection, handle, _)) = rtnetlink::new_connection() else {
        return facts;
    };
    tokio::spawn(connection);
    let Some(message) = get_link(&handle, LinkQuery::Name(&dataplane.interface)).await else {
        return facts;
    };
    let mut link = link_of(&message);
    link.name = dataplane.interface.clone();
    link.driver = driver_info(&link.name);
    link.attached = attached(&message);
    link.pinned_program = pinned_program(&pin_dir.join(crate::dataplane::link_pin_name(dataplane)));
    if let Some(parent) = parent_index(&message)
        && link.kind.as_deref() != Some("veth")
    {
        link.parent = get_link(&handle, LinkQuery::Index(parent, None))
            .await
            .and_then(|m| link_name(&m));
    }
    let ethtool = Ethtool::open();
    if let Some(ethtool) = &ethtool {
        link.features = ethtool.features(&link.name).await;
        link.channels = ethtool.channels(&link.name).await;
        link.xdp_features = ethtool.xdp_features(link.index).await;
    }
    if link.kind.as_deref() == Some("veth")
        && let Some(index) = parent_index(&message)
    {
        link.peer = Some(peer(&handle, ethtool.as_ref(), index, netns_id(&message)).await);
    }
    facts.link = Some(link);
    facts
}

/// The capabilities `lb run` uses: loading programs and maps (CAP_BPF), attaching to an
/// interface (CAP_NET_ADMIN), reading map and program ids (CAP_PERFMON; CAP_SYS_ADMIN
/// for listing other programs and mounting bpffs).
const NEEDED_CAPS: [(u32, &str); 4] = [
    (39, "CAP_BPF"),
    (12, "CAP_NET_ADMIN"),
    (38, "CAP_PERFMON"),
    (21, "CAP_SYS_ADMIN"),
];

fn privileges() -> Privileges {
    let euid = nix::unistd::geteuid().as_raw();
    let effective = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|l| l.strip_prefix("CapEff:"))
                .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        })
        .unwrap_or(0);
    Privileges {
        euid,
        missing: NEEDED_CAPS
            .iter()
            .filter(|(bit, _)| effective & (1 << bit) == 0)
            .map(|(_, name)| name.to_string())
            .collect(),
    }
}

fn bpffs_state(pin_dir: &Path) -> BpffsState {
    let existing = pin_dir
        .ancestors()
        .find(|p| p.exists())
        .unwrap_or(Path::new("/"));
    let on_bpffs = nix::sys::statfs::statfs(existing)
        .is_ok_and(|s| s.filesystem_type().0 as u64 == BPF_FS_MAGIC);
    let private = crate::bpffs::reach(pin_dir) == crate::bpffs::Reach::Private;
    if private && (on_bpffs || pin_dir.starts_with(BPF_FS)) {
        BpffsState::Private { mounted: on_bpffs }
    } else if on_bpffs {
        BpffsState::Mounted
    } else if pin_dir.starts_with(BPF_FS) {
        BpffsState::Unmounted
    } else {
        BpffsState::NotBpffs {
            existing: existing.to_path_buf(),
        }
    }
}

fn kernel() -> Kernel {
    Kernel {
        release: nix::sys::utsname::uname()
            .map(|u| u.release().to_string_lossy().into_owned())
            .unwrap_or_default(),
        btf: Path::new("/sys/kernel/btf/vmlinux").exists(),
        jit: std::fs::read_to_string("/proc/sys/net/core/bpf_jit_enable")
            .ok()
            .and_then(|v| v.trim().parse().ok()),
    }
}

enum LinkQuery<'a> {
    Name(&'a str),
    /// An index, in the namespace with this id (as ours numbers it) when given.
    Index(u32, Option<i32>),
}

async fn get_link(handle: &rtnetlink::Handle, query: LinkQuery<'_>) -> Option<LinkMessage> {
    let mut request = handle.link().get();
    match query {
        LinkQuery::Name(name) => request = request.match_name(name.to_string()),
        LinkQuery::Index(index, netns) => {
            request = request.match_index(index);
            if let Some(id) = netns {
                // IFLA_TARGET_NETNSID: the link of that index in the peer's namespace.
                request
                    .message_mut()
                    .attributes
                    .push(LinkAttribute::IfNetnsId(id));
            }
        }
    }
    request.execute().try_next().await.ok().flatten()
}

fn link_of(message: &LinkMessage) -> Link {
    let mut link = Link {
        index: message.header.index,
        up: message.header.flags.contains(LinkFlags::Up),
        ..Link::default()
    };
    for attribute in &message.attributes {
        match attribute {
            LinkAttribute::Mtu(mtu) => link.mtu = *mtu,
            LinkAttribute::MaxMtu(mtu) => link.max_mtu = Some(*mtu),
            LinkAttribute::LinkInfo(infos) => {
                for info in infos {
                    if let LinkInfo::Kind(kind) = info {
                        link.kind = Some(match kind {
                            InfoKind::Other(other) => other.clone(),
                            known => known.to_string(),
                        });
                    }
                }
            }
            _ => {}
        }
    }
    link
}

fn link_name(message: &LinkMessage) -> Option<String> {
    message.attributes.iter().find_map(|a| match a {
        LinkAttribute::IfName(name) => Some(name.clone()),
        _ => None,
    })
}

/// IFLA_LINK: a veth's peer, a VLAN's lower device.
fn parent_index(message: &LinkMessage) -> Option<u32> {
    message.attributes.iter().find_map(|a| match a {
        // Not compared with our own index: a peer in another namespace may share it.
        LinkAttribute::Link(index) if *index != 0 => Some(*index),
        _ => None,
    })
}

/// IFLA_LINK_NETNSID: the namespace of the peer, when it is another one.
fn netns_id(message: &LinkMessage) -> Option<i32> {
    message.attributes.iter().find_map(|a| match a {
        LinkAttribute::LinkNetNsId(id) if *id >= 0 => Some(*id),
        _ => None,
    })
}

fn enslaved(message: &LinkMessage) -> bool {
    message
        .attributes
        .iter()
        .any(|a| matches!(a, LinkAttribute::Controller(index) if *index != 0))
}

/// The XDP programs IFLA_XDP reports, with their names (bpf(2)).
fn attached(message: &LinkMessage) -> Vec<Attached> {
    let Some(xdp) = message.attributes.iter().find_map(|a| match a {
        LinkAttribute::Xdp(xdp) => Some(xdp),
        _ => None,
    }) else {
        return Vec::new();
    };
    let mut mode = "native";
    let mut ids: Vec<(u32, &str)> = Vec::new();
    for attribute in xdp {
        match attribute {
            LinkXdp::Attached(XdpAttached::SocketBuffer) => mode = "generic",
            LinkXdp::Attached(XdpAttached::Hardware) => mode = "offload",
            LinkXdp::Attached(XdpAttached::None) => return Vec::new(),
            LinkXdp::DrvProgId(id) => ids.push((*id, "native")),
            LinkXdp::SkbProgId(id) => ids.push((*id, "generic")),
            LinkXdp::HwProgId(id) => ids.push((*id, "offload")),
            _ => {}
        }
    }
    if ids.is_empty() {
        // One mode attached: the kernel sends only IFLA_XDP_PROG_ID.
        ids.extend(xdp.iter().filter_map(|a| match a {
            LinkXdp::ProgId(id) if *id != 0 => Some((*id, mode)),
            _ => None,
        }));
    }
    ids.into_iter()
        .map(|(id, mode)| Attached {
            id,
            name: program_name(id),
            mode: mode.to_string(),
        })
        .collect()
}

fn program_name(id: u32) -> Option<String> {
    aya::programs::loaded_programs()
        .filter_map(Result::ok)
        .find(|p| p.id() == id)
        .and_then(|p| p.name_as_str().map(str::to_string))
}

fn pinned_link(pin_dir: &Path) -> PinnedLink {
    use crate::dataplane::PinnedLinkState;
    match crate::dataplane::pinned_link_state(pin_dir) {
        PinnedLinkState::Absent => PinnedLink::None,
        PinnedLinkState::Attached { ifindex } => PinnedLink::Attached { ifindex },
        PinnedLinkState::Defunct => PinnedLink::Defunct,
        PinnedLinkState::Unreadable(errno) => PinnedLink::Unreadable { errno },
    }
}

fn pinned_program(link_pin: &Path) -> Option<u32> {
    let pinned = aya::programs::links::PinnedLink::from_pin(link_pin).ok()?;
    let link = aya::programs::links::FdLink::from(pinned);
    link.info().ok().map(|info| info.program_id())
}

async fn peer(
    handle: &rtnetlink::Handle,
    ethtool: Option<&Ethtool>,
    index: u32,
    netns_id: Option<i32>,
) -> Peer {
    let mut peer = Peer {
        index,
        netns_id,
        ..Peer::default()
    };
    let Some(message) = get_link(handle, LinkQuery::Index(index, netns_id)).await else {
        return peer;
    };
    peer.name = link_name(&message);
    peer.attached = attached(&message);
    peer.enslaved = enslaved(&message);
    let Some(name) = &peer.name else {
        return peer;
    };
    let features = match (netns_id, ethtool) {
        (Some(id), _) => peerns::features(handle, id, name).await,
        (None, Some(ethtool)) => ethtool
            .features(name)
            .await
            .ok_or_else(|| format!("ethtool netlink has no features of {name}")),
        (None, None) => Err("no ethtool netlink socket".into()),
    };
    match features {
        Ok(features) => peer.tx_checksum = Some(tx_checksum(&features)),
        Err(why) => peer.tx_checksum_unread = Some(why),
    }
    peer
}

fn tx_checksum(features: &BTreeMap<String, Feature>) -> bool {
    [
        "tx-checksum-ipv4",
        "tx-checksum-ip-generic",
        "tx-checksum-ipv6",
    ]
    .iter()
    .any(|name| features.get(*name).is_some_and(|f| f.on))
}

/// `ethtool -i`: the ETHTOOL_GDRVINFO ioctl (ethtool's netlink interface has no driver
/// information).
fn driver_info(interface: &str) -> Option<Driver> {
    const SIOCETHTOOL: libc::c_ulong = 0x8946;
    const ETHTOOL_GDRVINFO: u32 = 0x0000_0003;
    #[repr(C)]
    struct DrvInfo {
        cmd: u32,
        driver: [u8; 32],
        version: [u8; 32],
        fw_version: [u8; 32],
        bus_info: [u8; 32],
        erom_version: [u8; 32],
        reserved2: [u8; 12],
        n_priv_flags: u32,
        n_stats: u32,
        testinfo_len: u32,
        eedump_len: u32,
        regdump_len: u32,
    }
    #[repr(C)]
    struct IfReq {
        name: [u8; libc::IFNAMSIZ],
        data: *mut DrvInfo,
        _pad: [u8; 16],
    }
    let name = interface.as_bytes();
    if name.len() >= libc::IFNAMSIZ {
        return None;
    }
    // SAFETY: all-zero is a valid DrvInfo (plain integers and byte arrays).
    let mut info: DrvInfo = unsafe { std::mem::zeroed() };
    info.cmd = ETHTOOL_GDRVINFO;
    let mut request = IfReq {
        name: [0; libc::IFNAMSIZ],
        data: &mut info,
        _pad: [0; 16],
    };
    request.name[..name.len()].copy_from_slice(name);
    // SAFETY: a datagram socket only to carry the ioctl; closed by OwnedFd.
    let socket = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if socket < 0 {
        return None;
    }
    let socket = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(socket) };
    // SAFETY: `request` points at `info`, both live across the call, sized as the
    // kernel's `struct ifreq` and `struct ethtool_drvinfo`.
    let rc = unsafe {
        libc::ioctl(
            std::os::fd::AsRawFd::as_raw_fd(&socket),
            SIOCETHTOOL as _,
            &mut request,
        )
    };
    if rc != 0 {
        return None;
    }
    let text = |bytes: &[u8]| {
        let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
        String::from_utf8_lossy(&bytes[..end]).into_owned()
    };
    Some(Driver {
        name: text(&info.driver),
        version: text(&info.version),
        firmware: text(&info.fw_version),
        bus: text(&info.bus_info),
    })
}

/// Channels as `ethtool -l` shows them.
pub(super) fn channels_of(
    counts: impl IntoIterator<Item = (&'static str, u32)>,
) -> Option<Channels> {
    let mut channels = Channels::default();
    let mut any = false;
    for (what, value) in counts {
        any = true;
        let slot = match what {
            "rx" => &mut channels.rx,
            "tx" => &mut channels.tx,
            "combined" => &mut channels.combined,
            "max_rx" => &mut channels.max_rx,
            "max_tx" => &mut channels.max_tx,
            "max_combined" => &mut channels.max_combined,
            _ => continue,
        };
        // ethtool prints n/a for a zero maximum and for counts of kinds the device lacks.
        *slot = (value != 0).then_some(value);
    }
    any.then_some(channels)
}
