//! Points `TEST_OBJECT` at the test eBPF object (`lb-test-xdp`) that lb-userspace's build
//! produced beside the balancer: the eBPF crate is built once, and only this crate
//! embeds the test programs.
fn main() {
    let object = std::env::var("DEP_LB_XDP_TEST_OBJECT")
        .expect("lb-userspace's build script gives the test object's path (links = \"lb_xdp\")");
    println!("cargo::rustc-env=LB_TEST_OBJECT={object}");
    println!("cargo::rerun-if-env-changed=DEP_LB_XDP_TEST_OBJECT");
    println!("cargo::rerun-if-changed=build.rs");
}
