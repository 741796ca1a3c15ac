//! The `lb` agent: configuration, the data-plane loader, health checks and control.
//!
//! The modules, their jobs and what each may use: `docs/src/modules.md` (checked
//! against the modules here by `layout_tests`, which also refuse an import cycle between
//! them and a function over 100 lines).

pub mod agent;
pub mod announce;
pub mod bpffs;
pub mod capture;
pub mod cli;
pub mod cluster;
pub mod config;
pub mod control;
pub mod dataplane;
pub mod doctor;
pub mod explain;
pub mod health;
pub mod hot;
pub mod listen;
pub mod lock;
pub mod metrics;
pub mod model;
pub mod neighbor;
pub mod ports;
pub mod preflight;
pub mod snapshot;
pub mod state;
pub mod statefile;
pub mod status;
pub mod tables;
pub mod telemetry;
pub mod top;
pub mod turnover;
pub mod writer;

#[cfg(test)]
mod layout_tests;

/// The compiled XDP object (`lb-ebpf`), embedded at build time. Empty when built with
/// `AYA_BUILD_SKIP=1`.
pub static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/lb-xdp"));

/// The backends' decapsulation object (`lb-ebpf`'s `lb-decap`, `lb decap attach`),
/// embedded at build time. Empty when built with `AYA_BUILD_SKIP=1`.
pub static DECAP_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/lb-decap"));
