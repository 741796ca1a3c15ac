//! Empty on purpose: the program is the `lb-xdp` binary. This library target lets
//! `lb-userspace` name this crate as a build dependency, so cargo rebuilds the eBPF
//! object whenever this crate or `lb-common` changes.
#![no_std]
