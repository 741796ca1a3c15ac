//! What an attach error from the kernel means for this interface: the errno alone
//! (`bpf_link_create` failed: Numerical result out of range) tells an operator nothing
//! about the MTU limit, the program already there or the driver. The caller passes what
//! it knows of the interface (`lb run` takes it from the doctor's facts).

use aya::programs::{ProgramError, xdp::XdpError};

/// About the largest MTU a driver can give an XDP program that is not multi-buffer aware
/// in one buffer: a 4 KiB page less XDP headroom (256), `skb_shared_info` (320) and the
/// Ethernet, FCS and VLAN headers; ena's limit exactly, veth's is 3506, i40e's about
/// 3 KB. Above it native XDP needs a driver with multi-buffer receive (`rx-sg`).
pub const SINGLE_BUFFER_MTU: u32 = 3498;

/// What the caller knows about the interface it attaches to.
#[derive(Clone, Debug, Default)]
pub struct AttachHints {
    pub driver: Option<String>,
    pub mtu: Option<u32>,
    /// A veth's peer: its MTU limits XDP on the veth.
    pub veth_peer: Option<String>,
    /// The XDP program already attached, as `lb doctor` names it.
    pub attached: Option<String>,
    /// `auto`: why native mode cannot serve here, known before trying (a veth peer
    /// without a program, a driver without native XDP); generic is attached at once.
    pub native_refused: Option<String>,
    /// `auto`: native mode is known to serve here (`doctor::native_known`): a pinned
    /// link in generic mode is moved to native rather than adopted as it is.
    pub native_known: bool,
}

/// The errno behind an attach error, wherever aya put it.
pub fn errno(error: &ProgramError) -> Option<i32> {
    match error {
        ProgramError::SyscallError(e) => e.io_error.raw_os_error(),
        ProgramError::XdpError(XdpError::NetlinkError(e)) => e.raw_os_error(),
        ProgramError::UnknownInterface { .. } => Some(libc::ENODEV),
        _ => None,
    }
}

/// The error's meaning, in words, with what to do.
pub fn meaning(errno: Option<i32>, mode: &str, interface: &str, hints: &AttachHints) -> String {
    let driver = hints.driver.as_deref().unwrap_or("this");
    let mtu = hints
        .mtu
        .map(|m| format!("MTU {m}"))
        .unwrap_or_else(|| "the MTU".into());
    match errno {
        Some(libc::ERANGE) => {
            let whose = match &hints.veth_peer {
                Some(peer) => format!("{mtu} (on a veth, its peer {peer}'s MTU counts)"),
                None => mtu,
            };
            format!(
                "{whose} is too large for XDP on the {driver} driver: without multi-buffer \
                 support a frame must fit one buffer (about {} bytes); lower the MTU, or set \
                 xdp_mode = \"generic\"",
                SINGLE_BUFFER_MTU
            )
        }
        Some(libc::EBUSY | libc::EEXIST) => {
            let whose = hints
                .attached
                .as_deref()
                .map(|p| format!(": {p}"))
                .unwrap_or_default();
            format!(
                "another XDP program is attached to {interface}{whose}; lb replaces nothing: \
                 {}",
                foreign_program_fix(interface)
            )
        }
        Some(libc::EOPNOTSUPP) if mode == "native" => {
            let extra = if driver == "virtio_net" {
                " (virtio_net also refuses while the host offloads receive GRO/checksums: \
                 `lb doctor` tells)"
            } else {
                ""
            };
            format!(
                "the {driver} driver has no native XDP{extra}; set xdp_mode = \"generic\" (or \
                 \"auto\", which falls back to it)"
            )
        }
        Some(libc::EINVAL) => format!(
            "the {driver} driver refused the program: most often {mtu} above its XDP limit \
             (about {} bytes in one buffer), LRO on, or too few queues for XDP_TX; `lb \
             doctor` checks each",
            SINGLE_BUFFER_MTU
        ),
        Some(libc::ENOMEM | libc::ENOSPC) => format!(
            "the {driver} driver could not set up its XDP queues: free channels for XDP_TX \
             (ethtool -L {interface} combined N with fewer queues)"
        ),
        Some(libc::EPERM | libc::EACCES) => {
            "not permitted: run as root (CAP_NET_ADMIN and CAP_BPF)".into()
        }
        Some(libc::ENODEV | libc::ENXIO) => {
            format!("no interface {interface} in this network namespace")
        }
        Some(other) => format!(
            "the kernel refused ({}); `lb doctor` checks what it can",
            std::io::Error::from_raw_os_error(other)
        ),
        None => "the kernel refused; `lb doctor` checks what it can".into(),
    }
}

/// What to do about another program on `interface`'s XDP hook, as `lb run` and `lb
/// doctor` say it: detach it, or chain it behind lb.
pub fn foreign_program_fix(interface: &str) -> String {
    format!(
        "detach it first (its owner; `xdp-loader unload {interface} --all` for one loaded \
         with libxdp, as xdp-filter does; `ip link set dev {interface} xdp off` for one \
         attached through netlink), or run it behind lb: pin it and name the pin in \
         dataplane.next_program (lb passes it every frame that is not for a VIP)"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hints() -> AttachHints {
        AttachHints {
            driver: Some("veth".into()),
            mtu: Some(9000),
            veth_peer: Some("p-lb".into()),
            attached: Some("xdp_filter (id 42, native)".into()),
            native_refused: None,
            native_known: false,
        }
    }

    #[test]
    fn errnos_become_what_they_mean_here() {
        let h = hints();
        let m = meaning(Some(libc::ERANGE), "native", "eth0", &h);
        assert!(
            m.contains("MTU 9000") && m.contains("p-lb") && m.contains("too large"),
            "{m}"
        );
        for errno in [libc::EBUSY, libc::EEXIST] {
            let m = meaning(Some(errno), "native", "eth0", &h);
            assert!(
                m.contains("another XDP program")
                    && m.contains("xdp_filter (id 42")
                    && m.contains("dataplane.next_program"),
                "{m}"
            );
        }
        let m = meaning(Some(libc::EOPNOTSUPP), "native", "eth0", &h);
        assert!(m.contains("veth driver has no native XDP"), "{m}");
        let m = meaning(Some(libc::EINVAL), "native", "eth0", &h);
        assert!(m.contains("MTU 9000") && m.contains("LRO"), "{m}");
        let m = meaning(Some(libc::EPERM), "native", "eth0", &h);
        assert!(m.contains("root"), "{m}");
        let m = meaning(Some(libc::E2BIG), "native", "eth0", &AttachHints::default());
        assert!(m.contains("Argument list too long"), "{m}");
        let virtio = AttachHints {
            driver: Some("virtio_net".into()),
            ..AttachHints::default()
        };
        let m = meaning(Some(libc::EOPNOTSUPP), "native", "eth0", &virtio);
        assert!(m.contains("host offloads"), "{m}");
    }

    #[test]
    fn the_errno_is_found_in_what_aya_returns() {
        let error = ProgramError::SyscallError(aya::sys::SyscallError {
            call: "bpf_link_create",
            io_error: std::io::Error::from_raw_os_error(libc::ERANGE),
        });
        assert_eq!(errno(&error), Some(libc::ERANGE));
        let error = ProgramError::UnknownInterface { name: "x".into() };
        assert_eq!(errno(&error), Some(libc::ENODEV));
        assert_eq!(errno(&ProgramError::NotLoaded), None);
    }
}
