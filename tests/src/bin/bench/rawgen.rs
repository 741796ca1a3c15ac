//! The veth benchmark's traffic generator for frames the balancer wraps: the test
//! object's `xdp_bench_tx` with one step more, written as raw BPF instructions here
//! because the eBPF crate is not to change now.
//!
//! Why it is needed: BPF_PROG_TEST_RUN in live-frame mode copies the test frame into
//! each page of its page pool once, and a page comes back to the pool after the sink
//! drops the frame. On a veth no copy happens on the way, so whatever the balancer
//! wrote into the frame is still in the page when the generator sends it again. A MAC
//! rewrite leaves a valid frame; a tunnel moves the head 20-28 bytes forward
//! (`bpf_xdp_adjust_head`), and its outer headers land over the frame's own Ethernet
//! header: from the second batch on, the balancer saw no IP frame at all (every frame
//! `pass_not_ip`). So this generator writes the Ethernet header again on every run
//! (the kernel restores the data pointers itself), then does what `xdp_bench_tx` does:
//! counts the frame in `BENCH_SINK[BENCH_SENT]` and steps the source port through
//! `flows` values.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use anyhow::{Result, anyhow, bail};

const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_PROG_TEST_RUN: libc::c_long = 10;
const BPF_PROG_TYPE_XDP: u32 = 6;
const BPF_F_TEST_XDP_LIVE_FRAMES: u32 = 1 << 1;
const BPF_FUNC_MAP_LOOKUP_ELEM: i32 = 1;
const XDP_DROP: i32 = 1;
const XDP_TX: i32 = 3;
/// Where the source port sits in an untagged IPv4 frame without options.
const SRC_PORT_AT: i16 = 14 + 20;

/// One BPF instruction (`struct bpf_insn`).
#[repr(C)]
#[derive(Clone, Copy)]
struct Insn {
    code: u8,
    regs: u8,
    off: i16,
    imm: i32,
}

fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> Insn {
    Insn {
        code,
        regs: dst | (src << 4),
        off,
        imm,
    }
}

// Opcodes (linux/bpf_common.h, linux/bpf.h).
const LDX_W: u8 = 0x61; // BPF_LDX | BPF_MEM | BPF_W
const LDX_DW: u8 = 0x79;
const ST_W: u8 = 0x62; // BPF_ST | BPF_MEM | BPF_W
const ST_H: u8 = 0x6a;
const STX_H: u8 = 0x6b;
const STX_DW: u8 = 0x7b;
const MOV64_X: u8 = 0xbf;
const MOV64_K: u8 = 0xb7;
const ADD64_K: u8 = 0x07;
const MOD64_K: u8 = 0x97;
const TO_BE: u8 = 0xdc; // BPF_ALU | BPF_END | BPF_TO_BE
const JEQ_K: u8 = 0x15;
const JGT_X: u8 = 0x2d;
const CALL: u8 = 0x85;
const EXIT: u8 = 0x95;
const LD_IMM64: u8 = 0x18;
const PSEUDO_MAP_FD: u8 = 1;

/// `bytes` as the immediate of a store of their width (little-endian, as BPF runs here).
fn imm(bytes: &[u8]) -> i32 {
    let mut b = [0u8; 4];
    b[..bytes.len()].copy_from_slice(bytes);
    i32::from_le_bytes(b)
}

/// The program: see the module doc. `sink` is the test object's `BENCH_SINK` map.
fn program(sink_fd: i32, sent_index: u32, flows: u64, eth: &[u8; 14]) -> Vec<Insn> {
    let flows = flows.clamp(1, 64512) as i32;
    let mut p = vec![
        insn(MOV64_X, 6, 1, 0, 0), // r6 = ctx
        insn(ST_W, 10, 0, -4, sent_index as i32),
        insn(LD_IMM64, 1, PSEUDO_MAP_FD, 0, sink_fd),
        insn(0, 0, 0, 0, 0),
        insn(MOV64_X, 2, 10, 0, 0),
        insn(ADD64_K, 2, 0, 0, -4),
        insn(CALL, 0, 0, 0, BPF_FUNC_MAP_LOOKUP_ELEM),
    ];
    let drop_from_lookup = p.len();
    p.extend([
        insn(JEQ_K, 0, 0, 0, 0), // if !r0 goto drop (offset patched below)
        insn(LDX_DW, 1, 0, 0, 0),
        insn(ADD64_K, 1, 0, 0, 1),
        insn(STX_DW, 0, 1, 0, 0), // the per-CPU count, as `bump` does
        insn(MOD64_K, 1, 0, 0, flows),
        insn(ADD64_K, 1, 0, 0, 1024),
        insn(TO_BE, 1, 0, 0, 16),
        insn(LDX_W, 2, 6, 0, 0), // data
        insn(LDX_W, 3, 6, 4, 0), // data_end
        insn(MOV64_X, 4, 2, 0, 0),
        insn(ADD64_K, 4, 0, 0, i32::from(SRC_PORT_AT) + 2),
    ]);
    let drop_from_bounds = p.len();
    p.extend([
        insn(JGT_X, 4, 3, 0, 0), // if data + 36 > data_end goto drop
        insn(STX_H, 2, 1, SRC_PORT_AT, 0),
        insn(ST_W, 2, 0, 0, imm(&eth[0..4])),
        insn(ST_H, 2, 0, 4, imm(&eth[4..6])),
        insn(ST_W, 2, 0, 6, imm(&eth[6..10])),
        insn(ST_H, 2, 0, 10, imm(&eth[10..12])),
        insn(ST_H, 2, 0, 12, imm(&eth[12..14])),
        insn(MOV64_K, 0, 0, 0, XDP_TX),
        insn(EXIT, 0, 0, 0, 0),
    ]);
    let drop = p.len();
    p.extend([insn(MOV64_K, 0, 0, 0, XDP_DROP), insn(EXIT, 0, 0, 0, 0)]);
    for at in [drop_from_lookup, drop_from_bounds] {
        p[at].off = (drop - at - 1) as i16;
    }
    p
}

fn bpf<T>(cmd: libc::c_long, attr: &mut T) -> std::io::Result<libc::c_long> {
    // SAFETY: `attr` is the `union bpf_attr` member of `cmd`, zero-padded, and lives
    // through the call.
    let r = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr as *mut T,
            std::mem::size_of::<T>() as u32,
        )
    };
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// The generator, loaded (not attached).
pub struct Generator {
    fd: OwnedFd,
}

#[repr(C)]
struct ProgLoad {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
    kern_version: u32,
    prog_flags: u32,
    prog_name: [u8; 16],
    prog_ifindex: u32,
    expected_attach_type: u32,
}

#[repr(C)]
struct TestRun {
    prog_fd: u32,
    retval: u32,
    data_size_in: u32,
    data_size_out: u32,
    data_in: u64,
    data_out: u64,
    repeat: u32,
    duration: u32,
    ctx_size_in: u32,
    ctx_size_out: u32,
    ctx_in: u64,
    ctx_out: u64,
    flags: u32,
    cpu: u32,
    batch_size: u32,
    _pad: u32,
}

impl Generator {
    /// Loads the generator counting into `sink` (the test object's `BENCH_SINK`) at
    /// `sent_index`, writing `eth` (the frame's Ethernet header) on every run.
    pub fn load(
        sink: &impl std::os::fd::AsFd,
        sent_index: u32,
        flows: u64,
        eth: &[u8; 14],
    ) -> Result<Generator> {
        let insns = program(sink.as_fd().as_raw_fd(), sent_index, flows, eth);
        let license = c"GPL";
        let mut log = vec![0u8; 64 * 1024];
        let mut name = [0u8; 16];
        name[..11].copy_from_slice(b"bench_rawtx");
        let mut attr = ProgLoad {
            prog_type: BPF_PROG_TYPE_XDP,
            insn_cnt: insns.len() as u32,
            insns: insns.as_ptr() as u64,
            license: license.as_ptr() as u64,
            log_level: 1,
            log_size: log.len() as u32,
            log_buf: log.as_mut_ptr() as u64,
            kern_version: 0,
            prog_flags: 0,
            prog_name: name,
            prog_ifindex: 0,
            expected_attach_type: 0,
        };
        match bpf(BPF_PROG_LOAD, &mut attr) {
            // SAFETY: a new file descriptor that nothing else owns.
            Ok(fd) => Ok(Generator {
                fd: unsafe { OwnedFd::from_raw_fd(fd as i32) },
            }),
            Err(e) => {
                let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
                bail!(
                    "load the raw generator: {e}\nverifier log:\n{}",
                    String::from_utf8_lossy(&log[..end])
                )
            }
        }
    }

    /// BPF_PROG_TEST_RUN with live frames: `repeat` runs on `frame`, sent out of the
    /// interface `ctx` names, in batches of `batch`. Call it in the interface's
    /// namespace.
    pub fn send(&self, frame: &[u8], ctx: &[u8], repeat: u32, batch: u32) -> Result<()> {
        let mut attr = TestRun {
            prog_fd: self.fd.as_raw_fd() as u32,
            retval: 0,
            data_size_in: frame.len() as u32,
            data_size_out: 0,
            data_in: frame.as_ptr() as u64,
            data_out: 0,
            repeat,
            duration: 0,
            ctx_size_in: ctx.len() as u32,
            ctx_size_out: 0,
            ctx_in: ctx.as_ptr() as u64,
            ctx_out: 0,
            flags: BPF_F_TEST_XDP_LIVE_FRAMES,
            cpu: 0,
            batch_size: batch,
            _pad: 0,
        };
        bpf(BPF_PROG_TEST_RUN, &mut attr)
            .map_err(|e| anyhow!("BPF_PROG_TEST_RUN live frames: {e}"))?;
        Ok(())
    }
}
