//! Whether this kernel accepts libxdp's multi-program dispatcher (xdp-tools: `xdp-loader`,
//! `xdp-filter`). The dispatcher runs each program through a function replaced by it
//! (`freplace`, BPF_PROG_TYPE_EXT), which needs BPF trampolines; a kernel without them
//! refuses, and libxdp then falls back to one program that takes the whole XDP hook, so
//! it cannot share the hook with lb: chaining behind lb (`next_program`) is the way then.
//!
//! The probe is libxdp's own check, not an imitation of it: `xdp-loader` loads libxdp's
//! AF_XDP default program on a veth in a private network namespace with a private bpffs
//! (`unshare`), so nothing on the host changes, and says whether the dispatcher took it.
//! Only `lb doctor` runs it (about 0.1 s); without xdp-loader it is not checked.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// What the probe found.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", tag = "state")]
pub enum Dispatcher {
    /// libxdp loaded the program through its dispatcher.
    Accepted,
    /// libxdp fell back to a single program: its words why.
    Refused { why: String },
    /// The probe could not run (why).
    NotChecked { why: String },
}

/// The program the probe loads, as libxdp installs it.
const PROBE_OBJECT: &str = "xsk_def_xdp_prog.o";

/// Where libxdp installs its BPF objects, by distribution.
const OBJECT_DIRS: [&str; 5] = [
    "/usr/lib/x86_64-linux-gnu/bpf",
    "/usr/lib/aarch64-linux-gnu/bpf",
    "/usr/lib64/bpf",
    "/usr/lib/bpf",
    "/usr/local/lib/bpf",
];

/// Runs in the private namespaces: a bpffs for libxdp, a /run of its own (xdp-tools
/// takes a program lock file there, which another xdp-loader or xdp-filter of the host
/// may hold at the same moment: the probe then failed with "Unable to read PID from
/// lockfile"), a veth to load on, the load (verbose: libxdp says why it falls back),
/// then what is attached.
const SCRIPT: &str = r#"set -e
mount -t bpf bpf /sys/fs/bpf
mount -t tmpfs tmpfs /run
ip link add lbprobe0 type veth peer name lbprobe1
ip link set lbprobe0 up
"$XDP_LOADER" load -v -m skb lbprobe0 "$XDP_OBJECT" 2>&1
"$XDP_LOADER" status lbprobe0 2>&1
"#;

/// Asks libxdp (through `xdp-loader`) whether this kernel accepts its dispatcher.
pub fn probe() -> Dispatcher {
    let Some(loader) = find_in_path("xdp-loader") else {
        return not_checked("xdp-loader (xdp-tools) is not installed");
    };
    let Some(object) = OBJECT_DIRS
        .iter()
        .map(|dir| Path::new(dir).join(PROBE_OBJECT))
        .find(|path| path.exists())
    else {
        return not_checked(&format!("libxdp's {PROBE_OBJECT} was not found"));
    };
    let output = std::process::Command::new("unshare")
        .args(["--net", "--mount", "--propagation", "private", "--"])
        .args(["sh", "-c", SCRIPT])
        .env("XDP_LOADER", &loader)
        .env("XDP_OBJECT", &object)
        .stdin(std::process::Stdio::null())
        .output();
    match output {
        Ok(output) if output.status.success() => judge(&String::from_utf8_lossy(&output.stdout)),
        Ok(output) => {
            let stderr = String::from_utf8_lossy(&output.stderr);
            let stdout = String::from_utf8_lossy(&output.stdout);
            let last = stderr.lines().chain(stdout.lines()).last().unwrap_or("");
            not_checked(&format!("the probe failed ({}): {last}", output.status))
        }
        Err(error) => not_checked(&format!("running unshare: {error}")),
    }
}

/// The probe's verdict from xdp-loader's output (`load -v`, then `status`).
fn judge(output: &str) -> Dispatcher {
    if output.contains("xdp_dispatcher") {
        return Dispatcher::Accepted;
    }
    let why: Vec<&str> = output
        .lines()
        .map(|line| line.trim().trim_start_matches("libxdp: "))
        .filter(|line| line.contains("dispatcher"))
        .collect();
    Dispatcher::Refused {
        why: if why.is_empty() {
            "xdp-loader loaded the program without its dispatcher".into()
        } else {
            why.join("; ")
        },
    }
}

fn not_checked(why: &str) -> Dispatcher {
    Dispatcher::NotChecked { why: why.into() }
}

fn find_in_path(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .chain(["/usr/sbin".into(), "/sbin".into()])
        .map(|dir| dir.join(program))
        .find(|candidate| candidate.is_file())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// xdp-loader 1.3.1's words on this kernel (issue 37) and on one that accepts it.
    #[test]
    fn xdp_loaders_answer_is_read() {
        let refused = " libxdp: Compatibility check for dispatcher program failed: Operation \
                       not permitted\n libxdp: Falling back to loading single prog without \
                       dispatcher\nlbprobe0               xsk_def_prog      skb      7466\n";
        assert_eq!(
            judge(refused),
            Dispatcher::Refused {
                why: "Compatibility check for dispatcher program failed: Operation not \
                      permitted; Falling back to loading single prog without dispatcher"
                    .into()
            }
        );
        let accepted = "lbprobe0               xdp_dispatcher    skb      12   90f686eb86991928\n \
                        =>              50     xsk_def_prog           21   4ae5174e0d4b6b6e\n";
        assert_eq!(judge(accepted), Dispatcher::Accepted);
    }
}
