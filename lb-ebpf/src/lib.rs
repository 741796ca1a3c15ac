//! What every object of this crate carries once: the panic handler and the licence. The
//! programs are the binaries (`lb-xdp`, the balancer; `lb-test-xdp`, the test object),
//! each of which links this library. On the host it is empty, and it exists there so
//! that `lb-userspace` can name this crate as a build dependency: cargo then rebuilds the
//! eBPF objects whenever this crate or `lb-common` changes.
#![no_std]

// Never reached: the verifier rejects a program with a path into it.
#[cfg(target_arch = "bpf")]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

/// GPL: the kernel grants GPL-only helpers to GPL programs alone.
#[cfg(target_arch = "bpf")]
#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
