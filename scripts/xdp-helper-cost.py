#!/usr/bin/env python3
"""What one XDP helper call costs on this kernel, alone (root; Python 3, no other deps).

Loads four XDP programs of 2-4 instructions each, written here in raw BPF bytecode so
that no compiler is needed: one returning XDP_PASS, and the same after a call to
bpf_xdp_get_buff_len, bpf_xdp_adjust_head(ctx, 0) and bpf_xdp_adjust_head(ctx, -20)
(the room an IPIP header takes). Each is timed with BPF_PROG_TEST_RUN on a 64-byte
frame, alternating in every round: under `repeat` (one call running the program
1,000,000 times; not for -20, whose every run would move the frame 20 bytes further
until the headroom ran out) and in a loop of single runs (a fresh frame each), and
printed net of the empty program. The tunnel path of lb calls bpf_xdp_adjust_head
once per packet; this says how much of its cost the helper itself can be.

    sudo python3 scripts/xdp-helper-cost.py [ROUNDS] [LOOP_CALLS]
"""

import ctypes
import os
import statistics
import struct
import sys

SYS_BPF = 321  # x86_64
BPF_PROG_LOAD, BPF_PROG_TEST_RUN = 5, 10
BPF_PROG_TYPE_XDP = 6
XDP_PASS = 2
HELPER_ADJUST_HEAD, HELPER_GET_BUFF_LEN = 44, 188

libc = ctypes.CDLL(None, use_errno=True)


def bpf(cmd, attr):
    """The bpf(2) syscall on `attr`: its return value, and `attr` as the kernel left it."""
    buf = ctypes.create_string_buffer(attr, 256)
    ret = libc.syscall(SYS_BPF, cmd, buf, 256)
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return ret, buf.raw


def insn(code, dst=0, src=0, off=0, imm=0):
    return struct.pack("<BBhi", code, (src << 4) | dst, off, imm)


def mov_imm(reg, imm):
    return insn(0xB7, reg, imm=imm)


def call(helper):
    return insn(0x85, imm=helper)


RETURN_PASS = mov_imm(0, XDP_PASS) + insn(0x95)
PROGRAMS = {
    "empty": RETURN_PASS,
    "get_buff_len": call(HELPER_GET_BUFF_LEN) + RETURN_PASS,
    "adjust_head(0)": mov_imm(2, 0) + call(HELPER_ADJUST_HEAD) + RETURN_PASS,
    "adjust_head(-20)": mov_imm(2, -20) + call(HELPER_ADJUST_HEAD) + RETURN_PASS,
}


def load(name, code):
    insns = ctypes.create_string_buffer(code)
    license = ctypes.create_string_buffer(b"GPL")
    log = ctypes.create_string_buffer(65536)
    attr = struct.pack(
        "<IIQQIIQII16s", BPF_PROG_TYPE_XDP, len(code) // 8, ctypes.addressof(insns),
        ctypes.addressof(license), 1, len(log), ctypes.addressof(log), 0, 0,
        name.encode()[:15].replace(b"(", b"_").replace(b")", b"_").replace(b"-", b"m"),
    )
    try:
        return bpf(BPF_PROG_LOAD, attr)[0]
    except OSError as e:
        sys.exit(f"loading {name}: {e.strerror}\n{log.value.decode(errors='replace')}")


frame_in = (ctypes.c_char * 64)()
frame_out = (ctypes.c_char * 4096)()


def test_run(fd, repeat):
    """Kernel ns per run, as BPF_PROG_TEST_RUN reports it."""
    attr = struct.pack(
        "<IIIIQQII", fd, 0, len(frame_in), len(frame_out),
        ctypes.addressof(frame_in), ctypes.addressof(frame_out), repeat, 0,
    )
    _, out = bpf(BPF_PROG_TEST_RUN, attr)
    retval, duration = struct.unpack_from("<I", out, 4)[0], struct.unpack_from("<I", out, 36)[0]
    if retval != XDP_PASS:
        sys.exit(f"unexpected verdict {retval}")
    return duration


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    calls = int(sys.argv[2]) if len(sys.argv) > 2 else 20000
    fds = {name: load(name, code) for name, code in PROGRAMS.items()}
    repeat = {name: [] for name in fds}
    loop = {name: [] for name in fds}
    for _ in range(rounds):
        for name, fd in fds.items():
            if "-" not in name:
                repeat[name].append(test_run(fd, 1_000_000))
            loop[name].append(statistics.mean(test_run(fd, 1) for _ in range(calls)))
    base_repeat = statistics.median(repeat["empty"])
    base_loop = statistics.median(loop["empty"])
    print(f"{rounds} rounds; repeat = 1,000,000; loop = {calls} single runs (mean); "
          "medians over rounds, ns per run, net of the empty program")
    print(f"{'program':18s} {'repeat':>8s} {'loop':>8s}")
    for name in fds:
        r = f"{statistics.median(repeat[name]) - base_repeat:8.1f}" if repeat[name] else "       -"
        print(f"{name:18s} {r} {statistics.median(loop[name]) - base_loop:8.1f}")
    print(f"(the empty program itself: repeat {base_repeat:.1f}, loop {base_loop:.1f})")


if __name__ == "__main__":
    main()
