//! The backends' decapsulation program (`lb decap`): attached to an interface and
//! pinned under `<pin dir>/<interface>/` (its link and maps), so it stays after the CLI
//! exits; detached by removing those pins; its counters read back from them.
//!
//! The program takes an outer destination as this host's when it is in
//! `LB_DECAP_ADDRS`, which `attach` fills with every address of the network namespace
//! (any interface: a routed backend's address may sit on another one, or on `lo`).
//! Addresses added later are not seen until `attach` runs again, which on an attached
//! interface re-writes the addresses and the GUE port in place.

use std::{
    collections::BTreeMap,
    net::IpAddr,
    path::{Path, PathBuf},
};

use aya::{
    EbpfLoader,
    maps::{Array, HashMap as BpfHashMap, Map, MapData, PerCpuArray},
    programs::Xdp,
};
use lb_common::{
    ADDR_FAMILY_V4, ADDR_FAMILY_V6,
    decap::{
        CONFIG_GUE_PORT, CONFIG_MODE, DecapOutcomes, HostAddr, MAP_ADDRS, MAP_CONFIG, MAP_STATS,
        PROGRAM, stat,
    },
    meta,
};

use super::{AttachHints, AttachedMode, DataplaneError, in_map, kernel::attach_xdp, pins};
use crate::config::XdpModeSetting;

/// Where `lb decap` pins without `--pin-path`.
pub const DEFAULT_PIN_DIR: &str = "/sys/fs/bpf/lb-decap";

/// The maps the program's instances on one interface share through their pins.
const MAPS: [&str; 3] = [MAP_STATS, MAP_ADDRS, MAP_CONFIG];

/// What `lb decap status` shows of one interface.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DecapStatus {
    pub interface: String,
    /// None when not recorded (pins of another version).
    pub mode: Option<AttachedMode>,
    /// 0: GUE is not decapsulated.
    pub gue_port: u16,
    /// The outer destinations taken as this host's.
    pub addresses: Vec<IpAddr>,
    /// By `lb_common::decap::stat::NAMES`, summed over CPUs.
    pub counters: BTreeMap<String, u64>,
}

/// Attaches the decapsulation program from `object` (`crate::DECAP_OBJECT`) to
/// `interface`, GUE on `gue_port` (0: off), or, when it is attached there already,
/// replaces it on its link in one step and re-writes the settings. `mode` as
/// `dataplane.xdp_mode`: on a veth native mode passes packets up without a program on
/// the peer, so `Auto` takes it.
pub fn attach(
    object: &[u8],
    interface: &str,
    gue_port: u16,
    mode: XdpModeSetting,
    pin_dir: &Path,
) -> Result<DecapStatus, DataplaneError> {
    if object.is_empty() {
        return Err(DataplaneError::NoObject);
    }
    let dir = created_interface_dir(pin_dir, interface)?;
    let mut loader = EbpfLoader::new();
    for name in MAPS {
        loader.map_pin_path(name, dir.join(name));
    }
    let mut ebpf = loader.load(object)?;
    let program = loaded_xdp(&mut ebpf, PROGRAM)?;
    let link_path = dir.join(pins::LINK_PIN);
    let mut config = open_config(&dir)?;
    // Already attached here: the new program takes the old one's link in one step.
    let fresh = !pins::replace_pinned(program, PROGRAM, &link_path)?;
    if fresh {
        let (attachment, id) = attach_xdp(program, interface, mode, &AttachHints::default())?;
        pins::pin_link(program.take_link(id).map_err(program_error)?, &link_path)?;
        let code = match attachment.mode {
            AttachedMode::Native => meta::MODE_NATIVE,
            AttachedMode::Generic => meta::MODE_GENERIC,
        };
        config
            .set(CONFIG_MODE, code as u32, 0)
            .map_err(in_map(MAP_CONFIG))?;
    }
    config
        .set(CONFIG_GUE_PORT, gue_port as u32, 0)
        .map_err(in_map(MAP_CONFIG))?;
    write_addresses(&dir, &host_addresses())?;
    read_status(&dir, interface)
}

/// Detaches the program from `interface` and removes its pins. False when it was not
/// attached there.
pub fn detach(interface: &str, pin_dir: &Path) -> Result<bool, DataplaneError> {
    let dir = interface_dir(pin_dir, interface)?;
    Ok(pins::remove_pins(&dir)?.link)
}

/// Every interface the program is attached to (pinned in `pin_dir`), by name.
pub fn status(pin_dir: &Path) -> Result<Vec<DecapStatus>, DataplaneError> {
    let entries = match std::fs::read_dir(pin_dir) {
        Ok(entries) => entries,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(DataplaneError::Pin {
                path: pin_dir.to_path_buf(),
                source,
            });
        }
    };
    let mut found = Vec::new();
    for entry in entries.flatten() {
        let dir = entry.path();
        if dir.join(pins::LINK_PIN).exists() {
            let interface = entry.file_name().to_string_lossy().into_owned();
            found.push(read_status(&dir, &interface)?);
        }
    }
    found.sort_by(|a, b| a.interface.cmp(&b.interface));
    Ok(found)
}

/// `interface_dir`, created if missing.
pub(super) fn created_interface_dir(
    pin_dir: &Path,
    interface: &str,
) -> Result<PathBuf, DataplaneError> {
    let dir = interface_dir(pin_dir, interface)?;
    std::fs::create_dir_all(&dir).map_err(|source| DataplaneError::Pin {
        path: dir.clone(),
        source,
    })?;
    Ok(dir)
}

/// The XDP program `name` of `ebpf`, loaded into the kernel.
pub(super) fn loaded_xdp<'a>(
    ebpf: &'a mut aya::Ebpf,
    name: &'static str,
) -> Result<&'a mut Xdp, DataplaneError> {
    let error = |source| DataplaneError::Program {
        program: name,
        source,
    };
    let program: &mut Xdp = ebpf
        .program_mut(name)
        .ok_or(error(aya::programs::ProgramError::NotLoaded))?
        .try_into()
        .map_err(error)?;
    super::load_program(program).map_err(error)?;
    Ok(program)
}

/// The pin directory of `interface`: one path component, so a name cannot point
/// elsewhere.
pub(super) fn interface_dir(pin_dir: &Path, interface: &str) -> Result<PathBuf, DataplaneError> {
    if interface.is_empty() || interface.contains('/') || interface.starts_with('.') {
        return Err(DataplaneError::Pin {
            path: pin_dir.join(interface),
            source: std::io::Error::new(std::io::ErrorKind::InvalidInput, "not an interface name"),
        });
    }
    Ok(pin_dir.join(interface))
}

fn program_error(source: aya::programs::ProgramError) -> DataplaneError {
    DataplaneError::Program {
        program: PROGRAM,
        source,
    }
}

/// A map pinned in `dir`, typed.
fn pinned<T>(dir: &Path, name: &'static str, kind: fn(MapData) -> Map) -> Result<T, DataplaneError>
where
    T: TryFrom<Map, Error = aya::maps::MapError>,
{
    let data = MapData::from_pin(dir.join(name)).map_err(in_map(name))?;
    T::try_from(kind(data)).map_err(in_map(name))
}

fn open_config(dir: &Path) -> Result<Array<MapData, u32>, DataplaneError> {
    pinned(dir, MAP_CONFIG, Map::Array)
}

/// Every address of this network namespace, as `LB_DECAP_ADDRS` keys.
fn host_addresses() -> Vec<IpAddr> {
    let Ok(addresses) = nix::ifaddrs::getifaddrs() else {
        return Vec::new();
    };
    let mut found: Vec<IpAddr> = addresses
        .filter_map(|a| {
            let address = a.address?;
            match (address.as_sockaddr_in(), address.as_sockaddr_in6()) {
                (Some(v4), _) => Some(IpAddr::from(v4.ip())),
                (_, Some(v6)) => Some(IpAddr::from(v6.ip())),
                _ => None,
            }
        })
        .collect();
    found.sort();
    found.dedup();
    found
}

pub(crate) fn host_addr(address: IpAddr) -> HostAddr {
    let mut addr = [0; 16];
    let family = match address {
        IpAddr::V4(v4) => {
            addr[..4].copy_from_slice(&v4.octets());
            ADDR_FAMILY_V4
        }
        IpAddr::V6(v6) => {
            addr = v6.octets();
            ADDR_FAMILY_V6
        }
    };
    HostAddr {
        addr,
        family,
        _pad: [0; 3],
    }
}

fn ip_of(key: &HostAddr) -> IpAddr {
    if key.family == ADDR_FAMILY_V4 {
        IpAddr::from([key.addr[0], key.addr[1], key.addr[2], key.addr[3]])
    } else {
        IpAddr::from(key.addr)
    }
}

/// Makes `LB_DECAP_ADDRS` hold exactly `addresses` (new ones first, so an address that
/// stays is never missing meanwhile).
fn write_addresses(dir: &Path, addresses: &[IpAddr]) -> Result<(), DataplaneError> {
    let mut map: BpfHashMap<MapData, HostAddr, u8> = pinned(dir, MAP_ADDRS, Map::HashMap)?;
    let wanted: Vec<HostAddr> = addresses.iter().map(|a| host_addr(*a)).collect();
    for key in &wanted {
        map.insert(key, 1, 0).map_err(in_map(MAP_ADDRS))?;
    }
    let stale: Vec<HostAddr> = map
        .keys()
        .flatten()
        .filter(|key| !wanted.contains(key))
        .collect();
    for key in stale {
        map.remove(&key).map_err(in_map(MAP_ADDRS))?;
    }
    Ok(())
}

/// What the pins in `dir` say.
fn read_status(dir: &Path, interface: &str) -> Result<DecapStatus, DataplaneError> {
    let config = open_config(dir)?;
    let setting = |index| config.get(&index, 0).map_err(in_map(MAP_CONFIG));
    let mode = match setting(CONFIG_MODE)? as u64 {
        meta::MODE_NATIVE => Some(AttachedMode::Native),
        meta::MODE_GENERIC => Some(AttachedMode::Generic),
        _ => None,
    };
    let gue_port = setting(CONFIG_GUE_PORT)? as u16;
    let addrs: BpfHashMap<MapData, HostAddr, u8> = pinned(dir, MAP_ADDRS, Map::HashMap)?;
    let mut addresses: Vec<IpAddr> = addrs.keys().flatten().map(|k| ip_of(&k)).collect();
    addresses.sort();
    let stats: PerCpuArray<MapData, DecapOutcomes> = pinned(dir, MAP_STATS, Map::PerCpuArray)?;
    let per_cpu = stats.get(&0, 0).map_err(in_map(MAP_STATS))?;
    let mut counters: BTreeMap<String, u64> = stat::NAMES
        .iter()
        .map(|name| (name.to_string(), 0))
        .collect();
    for outcomes in per_cpu.iter() {
        for (name, count) in stat::NAMES.iter().zip(outcomes.counts) {
            *counters.get_mut(*name).expect("named") += count;
        }
    }
    Ok(DecapStatus {
        interface: interface.to_string(),
        mode,
        gue_port,
        addresses,
        counters,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_addresses_become_keys_and_back() {
        for text in ["10.1.2.3", "fd00::7"] {
            let ip: IpAddr = text.parse().unwrap();
            assert_eq!(ip_of(&host_addr(ip)), ip);
        }
        let v4 = host_addr("10.1.2.3".parse().unwrap());
        assert_eq!(v4.addr[..4], [10, 1, 2, 3]);
        assert_eq!(v4.addr[4..], [0; 12]);
        assert_eq!(v4.family, ADDR_FAMILY_V4);
    }

    #[test]
    fn interface_names_stay_one_path_component() {
        let root = Path::new("/sys/fs/bpf/lb-decap");
        assert_eq!(interface_dir(root, "eth0").unwrap(), root.join("eth0"));
        for bad in ["", "../x", "a/b", ".hidden"] {
            assert!(interface_dir(root, bad).is_err(), "{bad}");
        }
    }
}
