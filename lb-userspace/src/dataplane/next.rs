//! `dataplane.next_program`: the host's own XDP program (a host firewall), pinned by its
//! owner, that lb's program tail-calls with every frame it passes (`LB_NEXT`, slot 0).
//! Here: opening the pin, telling what it is, and which of lb's two builds can call it.
//!
//! The kernel's rule (`bpf_prog_map_compatible`): a program array admits only programs
//! of its first user's program type, expected attach type, JIT state and multi-buffer
//! flag (`BPF_F_XDP_HAS_FRAGS`); a program bound to a device is never admitted. Nothing
//! reports a program's multi-buffer flag, so it is asked of the kernel: a scratch array
//! first takes a two-instruction XDP_PASS program loaded as `lb_xdp` is (type XDP,
//! expected attach type BPF_XDP), with or without the flag, then the host's program.
//! lb loads `lb_xdp` (multi-buffer aware) or `lb_xdp_1buf` to match. Native or generic
//! attach does not matter: a tail call runs in the caller's context.
//!
//! bpf(2) by hand: aya 0.14 opens a pinned program only as a type it is told, and cannot
//! put a program it did not load into a program array.

use std::{
    ffi::CString,
    io,
    os::{
        fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd},
        unix::ffi::OsStrExt,
    },
    path::{Path, PathBuf},
};

/// The balancer, multi-buffer aware (section `xdp.frags`).
pub const LB_XDP: &str = "lb_xdp";
/// The same program without multi-buffer frames, for a next program without them.
pub const LB_XDP_1BUF: &str = "lb_xdp_1buf";

const BPF_MAP_CREATE: libc::c_long = 0;
const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;
const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
const BPF_MAP_DELETE_ELEM: libc::c_long = 3;
const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_OBJ_GET: libc::c_long = 7;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
const BPF_LINK_DETACH: libc::c_long = 34;
const BPF_MAP_TYPE_PROG_ARRAY: u64 = 3;
const BPF_PROG_TYPE_XDP: u32 = 6;
/// `expected_attach_type` of an XDP program for an interface, as aya loads `lb_xdp`.
const BPF_XDP: u64 = 37;
const BPF_F_XDP_HAS_FRAGS: u64 = 1 << 5;

/// The host's program, opened from its pin.
#[derive(Debug)]
pub struct NextProgram {
    fd: OwnedFd,
    pub path: PathBuf,
    pub id: u32,
    /// Its name as the kernel knows it (15 characters at most).
    pub name: String,
    /// Multi-buffer aware: `lb_xdp` calls it; otherwise `lb_xdp_1buf` does.
    pub frags: bool,
}

impl NextProgram {
    /// The build of lb's program that can tail-call this one.
    pub fn caller(&self) -> &'static str {
        if self.frags { LB_XDP } else { LB_XDP_1BUF }
    }

    /// `name (id N)`, as messages name it.
    pub fn label(&self) -> String {
        format!("{} (id {})", self.name, self.id)
    }
}

/// Why `dataplane.next_program` cannot be used; the message is the field's reason.
#[derive(Debug, thiserror::Error)]
pub enum NextError {
    #[error("nothing is pinned at {0} (pin the host's XDP program there first)")]
    Missing(PathBuf),
    #[error("{path}: {source}")]
    Unreadable { path: PathBuf, source: io::Error },
    #[error("{path} is a pinned {what}, not a program")]
    NotProgram { path: PathBuf, what: String },
    #[error(
        "{path} is {label}, a program of type {prog_type}, not an XDP program (type \
         {BPF_PROG_TYPE_XDP}): lb can tail-call only an XDP program"
    )]
    NotXdp {
        path: PathBuf,
        label: String,
        prog_type: u32,
    },
    #[error(
        "{path} is {label}, an XDP program the kernel will not let lb tail-call, with or \
         without multi-buffer frames: it must be a plain XDP program for an interface \
         (not bound to a device, not loaded for a devmap or cpumap)"
    )]
    Incompatible { path: PathBuf, label: String },
}

/// Opens the program pinned at `path` and finds which build of lb's program can call it.
pub fn open(path: &Path) -> Result<NextProgram, NextError> {
    let unreadable = |source: io::Error| NextError::Unreadable {
        path: path.to_path_buf(),
        source,
    };
    let fd = match obj_get(path) {
        Ok(fd) => fd,
        Err(error) if error.raw_os_error() == Some(libc::ENOENT) => {
            return Err(NextError::Missing(path.to_path_buf()));
        }
        Err(error) => return Err(unreadable(error)),
    };
    // A pin may hold a map or a link too: only the descriptor's kind tells them apart.
    let kind = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .map_err(unreadable)?
        .to_string_lossy()
        .into_owned();
    if kind != "anon_inode:bpf-prog" {
        let what = kind
            .trim_start_matches("anon_inode:")
            .replace("bpf-", "BPF ");
        return Err(NextError::NotProgram {
            path: path.to_path_buf(),
            what,
        });
    }
    let (prog_type, id, name) = program_info(fd.as_fd()).map_err(unreadable)?;
    let label = format!("{name} (id {id})");
    if prog_type != BPF_PROG_TYPE_XDP {
        return Err(NextError::NotXdp {
            path: path.to_path_buf(),
            label,
            prog_type,
        });
    }
    let frags = if callable_from(fd.as_fd(), true).map_err(unreadable)? {
        true
    } else if callable_from(fd.as_fd(), false).map_err(unreadable)? {
        false
    } else {
        return Err(NextError::Incompatible {
            path: path.to_path_buf(),
            label,
        });
    };
    Ok(NextProgram {
        fd,
        path: path.to_path_buf(),
        id,
        name,
        frags,
    })
}

/// Whether a program array first used by an XDP program with (`frags`) or without
/// multi-buffer frames admits `next`.
fn callable_from(next: BorrowedFd<'_>, frags: bool) -> io::Result<bool> {
    let array = program_array()?;
    set_slot(array.as_fd(), pass_program(frags)?.as_fd())?;
    match set_slot(array.as_fd(), next) {
        Ok(()) => Ok(true),
        Err(error) if error.raw_os_error() == Some(libc::EINVAL) => Ok(false),
        Err(error) => Err(error),
    }
}

/// Puts `program` in slot 0 of the program array `map`.
pub(super) fn set_slot(map: BorrowedFd<'_>, program: BorrowedFd<'_>) -> io::Result<()> {
    let key = 0u32;
    let value = program.as_raw_fd() as u32;
    // `union bpf_attr` for map element commands: map_fd u32 (8-aligned), key u64,
    // value u64, flags u64 (BPF_ANY).
    let mut attr = [
        map.as_raw_fd() as u32 as u64,
        &key as *const u32 as u64,
        &value as *const u32 as u64,
        0,
    ];
    bpf(BPF_MAP_UPDATE_ELEM, &mut attr).map(drop)
}

/// Empties slot 0 of the program array `map` (already empty: no error).
pub(super) fn clear_slot(map: BorrowedFd<'_>) -> io::Result<()> {
    let key = 0u32;
    let mut attr = [
        map.as_raw_fd() as u32 as u64,
        &key as *const u32 as u64,
        0,
        0,
    ];
    match bpf(BPF_MAP_DELETE_ELEM, &mut attr) {
        Err(error) if error.raw_os_error() != Some(libc::ENOENT) => Err(error),
        _ => Ok(()),
    }
}

impl NextProgram {
    /// Puts this program in slot 0 of the program array `map`.
    pub(super) fn put_in(&self, map: BorrowedFd<'_>) -> io::Result<()> {
        set_slot(map, self.fd.as_fd())
    }
}

/// The id of the program in slot 0 of the program array `map` (a lookup from user space
/// answers with the id), if any.
pub(super) fn slot_program(map: BorrowedFd<'_>) -> io::Result<Option<u32>> {
    let key = 0u32;
    let mut id = 0u32;
    let mut attr = [
        map.as_raw_fd() as u32 as u64,
        &key as *const u32 as u64,
        &mut id as *mut u32 as u64,
        0,
    ];
    match bpf(BPF_MAP_LOOKUP_ELEM, &mut attr) {
        Ok(_) => Ok(Some(id)),
        Err(error) if error.raw_os_error() == Some(libc::ENOENT) => Ok(None),
        Err(error) => Err(error),
    }
}

/// A new program array of one slot.
fn program_array() -> io::Result<OwnedFd> {
    // map_type, key_size (4); value_size (4), max_entries (1); the rest zero.
    let mut attr = [
        BPF_MAP_TYPE_PROG_ARRAY | (4 << 32),
        4 | (1 << 32),
        0,
        0,
        0,
        0,
        0,
        0,
        0,
    ];
    bpf(BPF_MAP_CREATE, &mut attr).map(owned)
}

/// `r0 = XDP_PASS; exit`, loaded as aya loads `lb_xdp` (type XDP, expected attach type
/// BPF_XDP), with or without the multi-buffer flag.
fn pass_program(frags: bool) -> io::Result<OwnedFd> {
    // mov64 r0, 2 (opcode 0xb7, imm 2); exit (0x95).
    let insns: [u64; 2] = [0xb7 | (2 << 32), 0x95];
    let license = c"GPL";
    let flags = if frags { BPF_F_XDP_HAS_FRAGS } else { 0 };
    // prog_type, insn_cnt; insns; license; log_level, log_size; log_buf; kern_version,
    // prog_flags; prog_name (16 bytes); prog_ifindex, expected_attach_type.
    let mut attr = [
        BPF_PROG_TYPE_XDP as u64 | (2 << 32),
        insns.as_ptr() as u64,
        license.as_ptr() as u64,
        0,
        0,
        flags << 32,
        0,
        0,
        BPF_XDP << 32,
    ];
    bpf(BPF_PROG_LOAD, &mut attr).map(owned)
}

/// The object pinned at `path`.
pub(super) fn obj_get(path: &Path) -> io::Result<OwnedFd> {
    let c_path = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    // pathname u64; bpf_fd u32, file_flags u32.
    let mut attr = [c_path.as_ptr() as u64, 0];
    bpf(BPF_OBJ_GET, &mut attr).map(owned)
}

/// Type, id and name of the program `fd`.
fn program_info(fd: BorrowedFd<'_>) -> io::Result<(u32, u32, String)> {
    // `struct bpf_prog_info`: type u32, id u32, ... name[16] at byte 64.
    let mut info = [0u64; 32];
    obj_info(fd, &mut info)?;
    let name: Vec<u8> = info[8..10]
        .iter()
        .flat_map(|word| word.to_le_bytes())
        .take_while(|&b| b != 0)
        .collect();
    Ok((
        info[0] as u32,
        (info[0] >> 32) as u32,
        String::from_utf8_lossy(&name).into_owned(),
    ))
}

/// Fills `info` with what the kernel tells of object `fd` (its `struct bpf_prog_info`,
/// `bpf_map_info` or `bpf_link_info`, as much as `info` holds).
pub(super) fn obj_info(fd: BorrowedFd<'_>, info: &mut [u64]) -> io::Result<()> {
    // `union bpf_attr` for BPF_OBJ_GET_INFO_BY_FD: bpf_fd u32, info_len u32, info u64.
    let mut attr = [
        fd.as_raw_fd() as u32 as u64 | ((size_of_val(info) as u64) << 32),
        info.as_mut_ptr() as u64,
    ];
    bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr).map(drop)
}

/// Detaches link `fd` from its hook now, whoever else holds it. Unlinking its pin drops
/// one reference only: while any other process holds the link (an agent still exiting, a
/// tool reading it) the program stays on the hook. Measured here: a link held by another
/// fd stayed attached 30 s after its pin was unlinked, and none of it after this call.
pub(super) fn link_detach(fd: BorrowedFd<'_>) -> io::Result<()> {
    // `union bpf_attr` for BPF_LINK_DETACH: link_fd u32.
    let mut attr = [fd.as_raw_fd() as u32 as u64];
    bpf(BPF_LINK_DETACH, &mut attr).map(drop)
}

fn bpf(command: libc::c_long, attr: &mut [u64]) -> io::Result<i64> {
    // SAFETY: `attr` is a `union bpf_attr` prefix of the size passed, and every pointer in
    // it points at memory that outlives the call.
    let done = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            command,
            attr.as_mut_ptr(),
            size_of_val(attr) as u32,
        )
    };
    if done < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(done)
}

fn owned(fd: i64) -> OwnedFd {
    // SAFETY: the kernel just gave us this descriptor.
    unsafe { OwnedFd::from_raw_fd(fd as i32) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_pin_is_named() {
        let path = Path::new("/sys/fs/bpf/lb-test-no-such-pin");
        match open(path) {
            Err(NextError::Missing(p)) => assert_eq!(p, path),
            // Without bpf(2) rights the pin cannot be looked up at all.
            Err(NextError::Unreadable { .. }) => {}
            other => panic!("{other:?}"),
        }
    }
}
