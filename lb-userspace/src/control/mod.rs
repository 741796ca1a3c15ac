//! The control plane's socket, both sides of it: `server` (the agent's control socket and
//! the operators' read-only one, each change logged with the asker's uid), `api` (the
//! request and answer types on the wire, but status's and explain's, which are theirs),
//! and `client` (the CLI's requests). The server may call `state` (runtime commands,
//! reloads, the published status), `announce` (the node's drain), `explain`, `health`,
//! `metrics` (the scrape over the socket), `listen` (what every HTTP listener
//! tolerates), `preflight` and `writer`; the client only `api`, `explain` and `status`.

pub mod api;
pub mod client;
mod server;

pub use server::{ControlSocket, serve};
