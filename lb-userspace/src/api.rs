//! The control API's wire types other than status: what the CLI sends to the agent's
//! control socket and what it answers. Status is in `status`, explain's in `explain`.

use std::net::IpAddr;

use serde::{Deserialize, Serialize};

use crate::{config::AdminState, explain::VipTarget};

/// The answer to `POST /reload`: the changes applied. A refused reload answers 422 with
/// the reason (an [`ErrorAnswer`]), and nothing changed.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ReloadAnswer {
    pub changes: Vec<String>,
}

/// Body of `POST /backend/state`, `/backend/add` and `/backend/remove`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BackendRequest {
    pub vip: VipTarget,
    pub backend: IpAddr,
    /// `/backend/state`: "ready", "drain" or "maint".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<AdminState>,
    /// `/backend/add`: the weight (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<u32>,
}

/// The answer to a change: what was done.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ChangeAnswer {
    pub change: String,
}

/// The body of every refused request (4xx, 5xx): why, in one line.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ErrorAnswer {
    pub error: String,
}
