//! What lb pins and whether a restarted agent may adopt it: the maps shared across
//! restarts, `LB_META` (layout, sizes, interface and attach mode of the pinned state),
//! the pinned link, and removing pins.

use std::path::Path;

use aya::{
    maps::{Array, MapData},
    programs::{
        links::{FdLink, PinnedLink},
        xdp::XdpLink,
    },
};
use lb_common::{
    LAYOUT_VERSION, MAP_BACKEND_EGRESS, MAP_BACKEND_IDS, MAP_BACKEND_STATS, MAP_BACKENDS,
    MAP_CONNTRACK, MAP_EGRESS, MAP_EGRESS_STATS, MAP_EMBRYONIC, MAP_FLOOD, MAP_MAGLEV, MAP_META,
    MAP_NEXT, MAP_STATS, MAP_TUNNEL, MAP_TX_PORTS, MAP_VIP_SLOTS, MAP_VIP_STATS, MAP_VIPS, meta,
};

use super::{AttachedMode, DataplaneError, Found, LoadOptions, in_map};

/// The name the link is pinned under, next to the maps.
pub(super) const LINK_PIN: &str = "link";
/// Maps pinned (shared with a restarted agent); the rest are per program instance.
pub const PINNED_MAPS: [&str; 17] = [
    MAP_VIPS,
    MAP_VIP_SLOTS,
    MAP_MAGLEV,
    MAP_BACKENDS,
    MAP_STATS,
    MAP_VIP_STATS,
    MAP_BACKEND_STATS,
    MAP_CONNTRACK,
    MAP_EMBRYONIC,
    MAP_FLOOD,
    MAP_BACKEND_IDS,
    MAP_TUNNEL,
    MAP_META,
    MAP_EGRESS,
    MAP_TX_PORTS,
    MAP_BACKEND_EGRESS,
    MAP_EGRESS_STATS,
];

/// The name the link of `dataplane.interface` is pinned under, in `dataplane.interfaces`.
pub fn link_pin_name(dataplane: &crate::config::DataplaneConfig) -> String {
    let index = dataplane
        .interfaces
        .iter()
        .position(|name| name == &dataplane.interface)
        .unwrap_or(0);
    link_pin_of(index, &dataplane.interface)
}

/// The name the link of the `index`th of several interfaces is pinned under: the first
/// one's is `LINK_PIN` (as with one interface, so either adopts the other's), the others'
/// are named after their interface (bpffs refuses a dot in a name).
pub(super) fn link_pin_of(index: usize, interface: &str) -> String {
    match index {
        0 => LINK_PIN.to_string(),
        _ => format!("{LINK_PIN}-{interface}"),
    }
}

/// Records the layout, sizes and interface in force (and the attach mode, once
/// attached) in `LB_META`, for a restarted agent.
pub(super) fn write_meta(
    map: &mut Array<MapData, u64>,
    options: &LoadOptions,
    mode: Option<AttachedMode>,
) -> Result<(), DataplaneError> {
    let mut values = vec![
        (meta::LAYOUT, LAYOUT_VERSION),
        (meta::MAGLEV_SIZE, options.maglev_table_size as u64),
        (meta::VIP_CAPACITY, options.vip_capacity as u64),
        (meta::CONNTRACK_ENTRIES, options.conntrack_entries as u64),
        (meta::IFINDEX, options.ifindex as u64),
    ];
    if let Some(mode) = mode {
        values.push((meta::XDP_MODE, mode_code(mode)));
    }
    for (index, value) in values {
        map.set(index, value, 0).map_err(in_map(MAP_META))?;
    }
    Ok(())
}

pub(super) fn mode_code(mode: AttachedMode) -> u64 {
    match mode {
        AttachedMode::Native => meta::MODE_NATIVE,
        AttachedMode::Generic => meta::MODE_GENERIC,
    }
}

/// The mode `mode_code` recorded, if any.
pub(super) fn mode_from_code(code: u64) -> Option<AttachedMode> {
    match code {
        meta::MODE_NATIVE => Some(AttachedMode::Native),
        meta::MODE_GENERIC => Some(AttachedMode::Generic),
        _ => None,
    }
}

/// The values of the `LB_META` pinned in `dir`, indexed by `meta`.
fn read_meta(dir: &Path) -> Result<Vec<u64>, String> {
    let map = MapData::from_pin(dir.join(MAP_META)).map_err(|e| e.to_string())?;
    let array: Array<MapData, u64> =
        Array::try_from(aya::maps::Map::Array(map)).map_err(|e| e.to_string())?;
    (0..meta::COUNT)
        .map(|i| array.get(&i, 0).map_err(|e| e.to_string()))
        .collect()
}

/// How many backend ids the maps pinned in `dir` were sized for (`LB_BACKENDS`'s
/// entries, as the kernel holds it: `LB_META` predates the setting).
pub(super) fn pinned_backend_capacity(dir: &Path) -> Result<u32, String> {
    let map = MapData::from_pin(dir.join(MAP_BACKENDS)).map_err(|e| e.to_string())?;
    let info = map.info().map_err(|e| e.to_string())?;
    Ok(info.max_entries())
}

/// Whether pins recorded for interface index `pinned` are for the interface `options`
/// name (an unknown index, 0, on either side matches).
fn same_interface(pinned: u64, options: &LoadOptions) -> bool {
    pinned == 0 || options.ifindex == 0 || pinned == options.ifindex as u64
}

/// What is pinned in `dir`, compared with what `options` ask for.
/// A larger pinned VIP capacity than asked is adopted into `options` (the agent then
/// uses it). `interface_gone`: the pinned link's interface no longer exists, so the
/// interface the maps were recorded for is no reason to replace them.
pub(super) fn inspect_pins(dir: &Path, options: &mut LoadOptions, interface_gone: bool) -> Found {
    let meta_path = dir.join(MAP_META);
    if !meta_path.exists() {
        return Found::Nothing;
    }
    let values = match read_meta(dir) {
        Ok(values) => values,
        Err(error) => {
            return Found::Incompatible(format!("unreadable {}: {error}", meta_path.display()));
        }
    };
    let expected = [
        ("layout version", meta::LAYOUT, LAYOUT_VERSION),
        (
            "maglev_table_size",
            meta::MAGLEV_SIZE,
            options.maglev_table_size as u64,
        ),
        (
            "conntrack_entries",
            meta::CONNTRACK_ENTRIES,
            options.conntrack_entries as u64,
        ),
    ];
    for (what, index, want) in expected {
        let have = values[index as usize];
        if have != want {
            return Found::Incompatible(format!(
                "pinned {what} is {have}, this agent needs {want}"
            ));
        }
    }
    match pinned_backend_capacity(dir) {
        Ok(have) if have == options.max_backends => {}
        Ok(have) => {
            return Found::Incompatible(format!(
                "pinned backend capacity is {have}, this configuration asks for \
                 dataplane.max_backends = {}",
                options.max_backends
            ));
        }
        Err(error) => {
            let path = dir.join(MAP_BACKENDS);
            return Found::Incompatible(format!("unreadable {}: {error}", path.display()));
        }
    }
    let pinned_capacity = values[meta::VIP_CAPACITY as usize];
    if pinned_capacity < options.vip_capacity as u64 {
        return Found::Incompatible(format!(
            "pinned VIP capacity is {pinned_capacity}, this configuration needs {}",
            options.vip_capacity
        ));
    }
    let pinned_ifindex = values[meta::IFINDEX as usize];
    if !interface_gone && !same_interface(pinned_ifindex, options) {
        return Found::Incompatible(format!(
            "pinned for interface index {pinned_ifindex}, this agent attaches to {}",
            options.ifindex
        ));
    }
    options.vip_capacity = pinned_capacity as u32;
    // Maps pinned by a program that never attached are adopted too.
    Found::Compatible(
        mode_from_code(values[meta::XDP_MODE as usize]).unwrap_or(AttachedMode::Generic),
    )
}

/// The mode of the link pinned in `dir` when it is on the interface `options` names (or
/// either index is unknown) and its mode is recorded.
pub(super) fn pinned_link_mode(dir: &Path, options: &LoadOptions) -> Option<AttachedMode> {
    if !dir.join(LINK_PIN).exists() {
        return None;
    }
    let values = read_meta(dir).ok()?;
    if !same_interface(values[meta::IFINDEX as usize], options) {
        return None;
    }
    mode_from_code(values[meta::XDP_MODE as usize])
}

/// Opens the XDP link pinned at `path`, for a new program to take over.
pub(super) fn open_pinned_link(path: &Path) -> Result<XdpLink, DataplaneError> {
    let pinned = PinnedLink::from_pin(path).map_err(|source| DataplaneError::Link {
        path: path.to_path_buf(),
        source,
    })?;
    XdpLink::try_from(FdLink::from(pinned)).map_err(|source| DataplaneError::Link {
        path: path.to_path_buf(),
        source,
    })
}

/// Puts `program` (loaded, named `name` in errors) on the link pinned at `path`, in one
/// step, leaving the link pinned. False when there is no such link, or its interface is
/// gone (its pin is then removed): the caller attaches afresh.
pub(super) fn replace_pinned(
    program: &mut aya::programs::Xdp,
    name: &'static str,
    path: &Path,
) -> Result<bool, DataplaneError> {
    if !path.exists() {
        return Ok(false);
    }
    let link = open_pinned_link(path)?;
    let Ok(id) = program.attach_to_link(link) else {
        remove_pin(path)?;
        return Ok(false);
    };
    // Closing our descriptor leaves the pinned link (and the program) in place.
    let link = program
        .take_link(id)
        .map_err(|source| DataplaneError::Program {
            program: name,
            source,
        })?;
    drop(
        FdLink::try_from(link).map_err(|source| DataplaneError::Link {
            path: path.to_path_buf(),
            source,
        })?,
    );
    Ok(true)
}

/// Pins `link` at `path`, so the program stays attached after this process exits.
pub(super) fn pin_link(link: XdpLink, path: &Path) -> Result<(), DataplaneError> {
    let fd_link = FdLink::try_from(link).map_err(|source| DataplaneError::Link {
        path: path.to_path_buf(),
        source,
    })?;
    fd_link
        .pin(path)
        .map_err(|source| DataplaneError::PinLink {
            path: path.to_path_buf(),
            source,
        })?;
    Ok(())
}

/// Removes the pinned maps but not the link (the program stays attached), for a new
/// program to take over that link with maps of its own. Returns how many there were.
///
/// `LB_NEXT` stays until the new program is attached (`pin_next_program_map` then pins
/// the new one's in its place): the running program tail-calls the host's program
/// through it, and the kernel empties a program array when its last user-space
/// reference (a descriptor or a pin) goes, whatever programs still use it
/// (`map_release_uref`, `prog_array_map_clear` in kernel/bpf/arraymap.c). With the old
/// agent gone, removing the pin would let the host's own traffic past its firewall
/// until the new program took the link.
pub(super) fn remove_map_pins_for_takeover(dir: &Path) -> Result<usize, DataplaneError> {
    remove_map_pins_but(dir, &[MAP_NEXT])
}

/// Removes the pinned maps but not the link, nor the maps named in `keep`. Returns how
/// many there were.
fn remove_map_pins_but(dir: &Path, keep: &[&str]) -> Result<usize, DataplaneError> {
    // Every map lb pins is named LB_*: maps of other layouts (names since gone) too.
    let names = match std::fs::read_dir(dir) {
        Ok(entries) => entries
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|name| name.starts_with("LB_") && !keep.contains(&name.as_str()))
            .collect::<Vec<_>>(),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(source) => {
            return Err(DataplaneError::Pin {
                path: dir.to_path_buf(),
                source,
            });
        }
    };
    let mut removed = 0;
    for name in names {
        removed += usize::from(remove_pin(&dir.join(name))?);
    }
    Ok(removed)
}

/// Removes one pinned file; one already gone is no error. Returns whether it was there.
pub(super) fn remove_pin(path: &Path) -> Result<bool, DataplaneError> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(true),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(source) => Err(DataplaneError::Pin {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// Removes a pinned link, detaching its program first, so that the hook is free when
/// this returns even if another process still holds the link (`next::link_detach`). A
/// link that cannot be detached (its interface gone) is removed all the same.
pub(super) fn remove_link_pin(path: &Path) -> Result<bool, DataplaneError> {
    if let Ok(link) = super::next::obj_get(path) {
        use std::os::fd::AsFd;
        if let Err(error) = super::next::link_detach(link.as_fd()) {
            tracing::debug!("{}: detach before unpinning: {error}", path.display());
        }
    }
    remove_pin(path)
}

/// What `remove_pins` found and removed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RemovedPins {
    /// The pinned link was there: a program was attached, and is no longer.
    pub link: bool,
    /// Map pins removed.
    pub maps: usize,
}

/// Removes everything lb pinned in `dir` (the link first: that detaches the program).
pub fn remove_pins(dir: &Path) -> Result<RemovedPins, DataplaneError> {
    let mut link = remove_link_pin(&dir.join(LINK_PIN))?;
    // The links of the other interfaces (`dataplane.interfaces`).
    let prefix = format!("{LINK_PIN}-");
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            if entry.file_name().to_string_lossy().starts_with(&prefix) {
                link |= remove_link_pin(&entry.path())?;
            }
        }
    }
    let maps = remove_map_pins_but(dir, &[])?;
    let _ = std::fs::remove_dir(dir);
    Ok(RemovedPins { link, maps })
}

/// The link pinned in a pin directory, as the kernel sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PinnedLinkState {
    /// No link pinned.
    Absent,
    /// Attached to the interface of this index.
    Attached { ifindex: u32 },
    /// Pinned, but its interface is gone (removed while the agent was stopped): the
    /// kernel refuses to update it ("Link has been severed"); a new link must replace it.
    Defunct,
    /// Pinned, but not readable as an XDP link (why).
    Unreadable(i32),
}

/// What the link pinned in `dir` is attached to (bpf(2) by hand: aya 0.14's link info
/// does not show the XDP link's interface).
pub fn pinned_link_state(dir: &Path) -> PinnedLinkState {
    link_state_at(&dir.join(LINK_PIN))
}

/// What the link pinned at `path` is attached to.
pub(super) fn link_state_at(path: &Path) -> PinnedLinkState {
    use std::os::fd::AsFd;
    const BPF_LINK_TYPE_XDP: u32 = 6;
    let errno = |e: std::io::Error| e.raw_os_error().unwrap_or(0);
    let fd = match super::next::obj_get(path) {
        Ok(fd) => fd,
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return PinnedLinkState::Absent,
        Err(e) => return PinnedLinkState::Unreadable(errno(e)),
    };
    // `struct bpf_link_info`: type u32, id u32, prog_id u32, then (8-aligned) a union
    // whose `xdp` member starts with the interface index. 0 once the device is gone.
    let mut info = [0u64; 32];
    if let Err(e) = super::next::obj_info(fd.as_fd(), &mut info) {
        return PinnedLinkState::Unreadable(errno(e));
    }
    let link_type = info[0] as u32;
    let ifindex = info[2] as u32;
    match (link_type, ifindex) {
        (BPF_LINK_TYPE_XDP, 0) => PinnedLinkState::Defunct,
        (BPF_LINK_TYPE_XDP, ifindex) => PinnedLinkState::Attached { ifindex },
        _ => PinnedLinkState::Unreadable(libc::EINVAL),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A takeover of incompatible pins keeps the link and `LB_NEXT` (the running
    /// program's chain to the host's firewall, emptied by the kernel with its last pin)
    /// and removes every other map; removing everything removes both.
    #[test]
    fn a_takeover_keeps_the_link_and_the_next_program_slot() {
        let dir = std::env::temp_dir().join(format!("lb-pins-takeover-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for name in [LINK_PIN, MAP_NEXT, MAP_VIPS, MAP_META, "LB_GONE_SINCE"] {
            std::fs::write(dir.join(name), "").unwrap();
        }
        assert_eq!(remove_map_pins_for_takeover(&dir).unwrap(), 3);
        assert!(dir.join(LINK_PIN).exists());
        assert!(dir.join(MAP_NEXT).exists());
        assert!(!dir.join(MAP_VIPS).exists());
        let removed = remove_pins(&dir).unwrap();
        assert_eq!(
            removed,
            RemovedPins {
                link: true,
                maps: 1
            }
        );
        assert!(!dir.exists());
    }
}
