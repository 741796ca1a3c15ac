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

/// Body of `POST /backend/state`, `/backend/add` and `/backend/remove`. Unknown fields
/// are refused (400), as the configuration file refuses unknown keys: a misspelt
/// `"wieght"` must not pass as the default.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::explain::ExplainRequest;

    /// As the configuration file refuses unknown keys, requests refuse unknown fields:
    /// a misspelt field must not pass as its default.
    #[test]
    fn unknown_fields_are_refused_naming_them() {
        let good = r#"{"vip": "10.0.0.100:80/tcp", "backend": "10.0.0.11", "weight": 2}"#;
        let request: BackendRequest = serde_json::from_str(good).unwrap();
        assert_eq!(request.weight, Some(2));
        for (body, field) in [
            (
                r#"{"vip": "10.0.0.100:80/tcp", "backend": "10.0.0.11", "wieght": 2}"#,
                "wieght",
            ),
            (
                r#"{"vip": {"address": "10.0.0.100", "port": 80, "protocol": "tcp", "proto": 6},
                    "backend": "10.0.0.11"}"#,
                "proto",
            ),
        ] {
            let error = serde_json::from_str::<BackendRequest>(body).unwrap_err();
            assert!(
                error
                    .to_string()
                    .contains(&format!("unknown field `{field}`")),
                "{body}: {error}"
            );
        }
        let explain = r#"{"vip": "10.0.0.100:80/tcp", "source": "10.0.0.1:1234", "src": 1}"#;
        let error = serde_json::from_str::<ExplainRequest>(explain).unwrap_err();
        assert!(error.to_string().contains("unknown field `src`"), "{error}");
    }
}
