//! A veth peer in another network namespace: its offloads are read there. Ours names
//! that namespace only by an id (IFLA_LINK_NETNSID), so the namespace is found among the
//! named ones (`/run/netns`, as `ip netns` keeps them) and those of running processes,
//! by asking the kernel which id ours gives each (RTM_GETNSID, which never assigns one),
//! and entered by a thread of its own, whose ethtool netlink socket then speaks to that
//! namespace. The doctor's own threads never change namespace.

use std::{
    collections::{BTreeMap, HashSet},
    fs::File,
    os::{fd::AsRawFd, unix::fs::MetadataExt},
    path::PathBuf,
};

use futures::StreamExt;
use netlink_packet_core::{NLM_F_REQUEST, NetlinkMessage, NetlinkPayload};
use rtnetlink::packet_route::{
    RouteNetlinkMessage,
    nsid::{NsidAttribute, NsidMessage},
};

use super::{facts::Feature, netlink::Ethtool};

/// Where `ip netns add` keeps named namespaces.
const NAMED: &str = "/run/netns";

/// The features (`ethtool -k`) of `interface` in the namespace ours numbers `nsid`, or why
/// they could not be read.
pub async fn features(
    handle: &rtnetlink::Handle,
    nsid: i32,
    interface: &str,
) -> Result<BTreeMap<String, Feature>, String> {
    let namespace = find(handle, nsid).await?;
    let interface = interface.to_string();
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("doctor-peer-ns".into())
        .spawn(move || {
            let _ = tx.send(features_inside(&namespace, &interface));
        })
        .map_err(|error| format!("starting a thread to enter it: {error}"))?;
    rx.await
        .map_err(|_| "the thread that entered it ended without an answer".to_string())?
}

/// In a thread that is about to end: enters `namespace` and reads the features there.
fn features_inside(namespace: &File, interface: &str) -> Result<BTreeMap<String, Feature>, String> {
    nix::sched::setns(namespace, nix::sched::CloneFlags::CLONE_NEWNET)
        .map_err(|error| format!("entering it: {error}"))?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|error| format!("a runtime to read it: {error}"))?;
    runtime.block_on(async {
        let ethtool = Ethtool::connect().map_err(|error| error.to_string())?;
        ethtool
            .features(interface)
            .await
            .ok_or_else(|| format!("ethtool netlink has no features of {interface} there"))
    })
}

/// The namespace ours numbers `nsid`, opened.
async fn find(handle: &rtnetlink::Handle, nsid: i32) -> Result<File, String> {
    let mut seen = HashSet::new();
    let mut opened = 0;
    for path in candidates() {
        // The namespace's identity: the device and inode of its nsfs file.
        let Ok(meta) = std::fs::metadata(&path) else {
            continue;
        };
        if !seen.insert((meta.dev(), meta.ino())) {
            continue;
        }
        let Ok(file) = File::open(&path) else {
            continue;
        };
        opened += 1;
        if id_of(handle, &file).await == Some(nsid) {
            return Ok(file);
        }
    }
    Err(format!(
        "none of the {opened} network namespaces this process can open (named in {NAMED}, \
         or of a running process) is the one with id {nsid}"
    ))
}

/// Named namespaces first (the usual case, and few), then every process's.
fn candidates() -> impl Iterator<Item = PathBuf> {
    let entries = |dir: &str| {
        std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .map(|entry| entry.path())
    };
    let processes = entries("/proc")
        .filter(|path| {
            path.file_name()
                .and_then(|name| name.to_str())
                .is_some_and(|name| name.bytes().all(|b| b.is_ascii_digit()))
        })
        .map(|path| path.join("ns/net"));
    entries(NAMED).chain(processes)
}

/// The id ours gives the namespace `file` is (RTM_GETNSID with NETNSA_FD); `None`: none
/// assigned, or no answer.
async fn id_of(handle: &rtnetlink::Handle, file: &File) -> Option<i32> {
    let mut message = NsidMessage::default();
    message
        .attributes
        .push(NsidAttribute::Fd(file.as_raw_fd() as u32));
    let mut request = NetlinkMessage::from(RouteNetlinkMessage::GetNsId(message));
    request.header.flags = NLM_F_REQUEST;
    let answers = handle.clone().request(request).ok()?;
    let mut answers = std::pin::pin!(answers);
    while let Some(answer) = answers.next().await {
        if let NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewNsId(nsid)) = answer.payload {
            return nsid
                .attributes
                .iter()
                .find_map(|attribute| match attribute {
                    NsidAttribute::Id(id) if *id >= 0 => Some(*id),
                    _ => None,
                });
        }
    }
    None
}
