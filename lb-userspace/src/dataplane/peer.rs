//! `lb peer`: an XDP program that passes every frame (the object `lb-pass`), attached in
//! native mode to a veth's peer. Native XDP_TX on a veth drops every frame unless the
//! peer has an XDP program of its own (the kernel's veth driver hands XDP_TX frames to
//! the peer's XDP receive path, which exists only with a program), so a balancer on a
//! veth runs native only with one there. The link is pinned under
//! `<pin dir>/<interface>/link`, so the program stays after the command exits; removing
//! the pin detaches it.

use std::path::Path;

use aya::EbpfLoader;

use super::{
    AttachHints, AttachedMode, DataplaneError,
    decap::{created_interface_dir, interface_dir, loaded_xdp},
    kernel::attach_xdp,
    pins,
};
use crate::config::XdpModeSetting;

/// Where `lb peer` pins without `--pin-path`.
pub const DEFAULT_PIN_DIR: &str = "/sys/fs/bpf/lb-peer";
/// The program's name in the object.
pub const PROGRAM: &str = "xdp_pass";
/// The object, built with the others by the build script.
pub static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/lb-pass"));

/// Attaches the pass program to `interface` in native mode and pins its link, or, when
/// it is pinned there already, puts the new program on that link in one step. Returns
/// the mode attached (always native: generic would not serve the peer's purpose).
pub fn attach(interface: &str, pin_dir: &Path) -> Result<AttachedMode, DataplaneError> {
    if OBJECT.is_empty() {
        return Err(DataplaneError::NoObject);
    }
    let dir = created_interface_dir(pin_dir, interface)?;
    let mut ebpf = EbpfLoader::new().load(OBJECT)?;
    let program = loaded_xdp(&mut ebpf, PROGRAM)?;
    let link_path = dir.join(pins::LINK_PIN);
    if pins::replace_pinned(program, PROGRAM, &link_path)? {
        return Ok(AttachedMode::Native);
    }
    let (attachment, id) = attach_xdp(
        program,
        interface,
        XdpModeSetting::Native,
        &AttachHints::default(),
    )?;
    pins::pin_link(program.take_link(id).map_err(program_error)?, &link_path)?;
    Ok(attachment.mode)
}

/// Detaches the program from `interface` and removes its pin. False when it was not
/// attached there.
pub fn detach(interface: &str, pin_dir: &Path) -> Result<bool, DataplaneError> {
    let dir = interface_dir(pin_dir, interface)?;
    let removed = pins::remove_pins(&dir)?.link;
    let _ = std::fs::remove_dir(&dir);
    Ok(removed)
}

fn program_error(source: aya::programs::ProgramError) -> DataplaneError {
    DataplaneError::Program {
        program: PROGRAM,
        source,
    }
}
