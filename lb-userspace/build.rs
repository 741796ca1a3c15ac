//! Builds the eBPF crate with the nightly toolchain (aya's template way): one run gives
//! all of its objects, the balancer `lb-xdp`, the backends' decapsulation program
//! `lb-decap` and the veth peer's XDP_PASS `lb-pass`, embedded here, and the test object `lb-test-xdp`, handed to dependents
//! (the tests crate) as `links` metadata (`DEP_LB_XDP_TEST_OBJECT`), so the `lb` binary
//! carries no test programs.
//! With AYA_BUILD_SKIP=1 (clippy, `cargo check` on machines without bpf-linker) empty
//! placeholder objects are written instead, so the crates still compile.
//!
//! aya-build hands every line the nested cargo prints on stderr to cargo as a
//! `cargo:warning`, so its ~40 `Compiling ...` status lines showed on every build. The
//! nested cargo runs quiet (`CARGO_TERM_QUIET`): status lines go, while its errors (on
//! stderr) and rustc's diagnostics (JSON on stdout, which aya-build renders) still show.
use std::{env, fs, path::PathBuf};

const OBJECTS: [&str; 4] = ["lb-xdp", "lb-decap", "lb-pass", "lb-test-xdp"];

fn main() -> anyhow::Result<()> {
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR"));
    println!(
        "cargo::metadata=test_object={}",
        out_dir.join("lb-test-xdp").display()
    );
    let skip = env::var("AYA_BUILD_SKIP").is_ok_and(|v| v == "1" || v.eq_ignore_ascii_case("true"));
    if skip {
        for name in OBJECTS {
            let object = out_dir.join(name);
            if !object.exists() {
                fs::write(object, [])?;
            }
        }
        println!("cargo:rerun-if-env-changed=AYA_BUILD_SKIP");
        return Ok(());
    }
    // SAFETY: a build script is one thread until here; aya-build's children inherit it.
    unsafe { env::set_var("CARGO_TERM_QUIET", "true") };
    let package = aya_build::Package {
        name: "lb-ebpf",
        root_dir: concat!(env!("CARGO_MANIFEST_DIR"), "/../lb-ebpf"),
        ..Default::default()
    };
    aya_build::build_ebpf([package], aya_build::Toolchain::default())
}
