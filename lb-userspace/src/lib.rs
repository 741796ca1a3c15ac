//! The `lb` agent: configuration, the data-plane loader, health checks and control.

pub mod agent;
pub mod announce;
pub mod capture;
pub mod config;
pub mod control;
pub mod dataplane;
pub mod explain;
pub mod health;
pub mod metrics;
pub mod model;
pub mod neighbor;
pub mod tables;
pub mod top;

/// The compiled XDP object (`lb-ebpf`), embedded at build time. Empty when built with
/// `AYA_BUILD_SKIP=1`.
pub static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/lb-xdp"));
