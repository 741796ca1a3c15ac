//! Effective weights: what the Maglev builder gets instead of a backend's configured
//! weight while a load rule applies (slow start, least-flows, the backend's own agent
//! check), and why. Pure: the agent feeds it elapsed time, flow counts and agent
//! answers, and writes the result into the table inputs.
//!
//! Every rule is a factor on the configured weight; the table gets
//! `configured × SCALE × factor`. With all factors 1 that is the configured weights
//! scaled alike, which builds exactly the table the configured weights build (the
//! builder follows weight ratios), so a VIP without load rules hashes as before and
//! identical inputs give identical tables on every node.
//!
//! Each rule moves in a few fixed steps, so that a ramp or a re-weighting costs a bounded
//! number of table switches (each switch moves only the slots that change owner;
//! existing flows stay on their backend through the connection table).

use std::time::Duration;

use crate::config::AdminState;

/// Effective weights are the configured weight times this, times the rules' factors.
pub const SCALE: u32 = 100;

/// Slow start ramps in this many equal steps: the first step has 1/STEPS of the weight.
pub const SLOW_START_STEPS: u32 = 10;

/// The share of its weight a backend that became usable `elapsed` ago takes under
/// `slow_start = ramp`; `None` once the ramp is over (the full weight).
pub fn slow_start_factor(elapsed: Duration, ramp: Duration) -> Option<f64> {
    if ramp.is_zero() || elapsed >= ramp {
        return None;
    }
    let step = (elapsed.as_secs_f64() / ramp.as_secs_f64() * SLOW_START_STEPS as f64) as u32 + 1;
    (step < SLOW_START_STEPS).then(|| step as f64 / SLOW_START_STEPS as f64)
}

/// When the next slow-start step is due for a backend usable since `elapsed` ago.
pub fn slow_start_next_step(elapsed: Duration, ramp: Duration) -> Option<Duration> {
    slow_start_factor(elapsed, ramp)?;
    let step = ramp / SLOW_START_STEPS;
    let done = (elapsed.as_nanos() / step.as_nanos().max(1)) as u32 + 1;
    Some((step * done).saturating_sub(elapsed))
}

/// Least-flows factors, from 0.25x to 4x of the configured weight in steps of √2.
pub const LEAST_FLOWS_LEVELS: [f64; 9] = [0.25, 0.354, 0.5, 0.707, 1.0, 1.414, 2.0, 2.828, 4.0];
const NEUTRAL_LEVEL: usize = 4;
/// How far (in levels) the goal must be for the level to move.
const HYSTERESIS_LEVELS: f64 = 0.9;

/// The least-flows level (an index into `LEAST_FLOWS_LEVELS`) of a backend holding
/// `flows` live flows where its VIP's in-table backends hold `mean` on average, moving
/// from `current`.
///
/// The goal is a factor of `(mean + 1) / (flows + 1)`: a backend with fewer flows than
/// the mean gets more of the new ones. Hysteresis: the level moves only when the goal is
/// most of a level away (within ±37% it stays), and then by one level per call, so a
/// backend near the mean keeps its weight and a re-weighting does not overshoot and
/// oscillate.
pub fn least_flows_level(current: usize, flows: u64, mean: f64) -> usize {
    let goal = ((mean + 1.0) / (flows as f64 + 1.0)).clamp(0.25, 4.0);
    let current = current.min(LEAST_FLOWS_LEVELS.len() - 1);
    // Levels are √2 apart: the distance in levels is twice the base-2 log of the ratio.
    let distance = 2.0 * (goal / LEAST_FLOWS_LEVELS[current]).log2();
    if distance >= HYSTERESIS_LEVELS {
        (current + 1).min(LEAST_FLOWS_LEVELS.len() - 1)
    } else if distance <= -HYSTERESIS_LEVELS {
        current.saturating_sub(1)
    } else {
        current
    }
}

/// The least-flows level a backend starts at (1x).
pub fn least_flows_neutral() -> usize {
    NEUTRAL_LEVEL
}

/// What a backend's agent said (HAProxy's agent-check words).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AgentReport {
    /// `NN%`: the share of the configured weight to use.
    pub weight_percent: Option<u32>,
    /// `ready`, `drain`, `maint`.
    pub admin: Option<AdminState>,
    /// `up`; `down`, `fail`, `stopped`.
    pub health: Option<AgentHealth>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AgentHealth {
    Up,
    Down,
}

/// The largest weight share an agent may ask for (HAProxy caps weights at 256).
pub const AGENT_MAX_PERCENT: u32 = 1000;

/// Why an agent's answer changes nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AgentReplyError {
    #[error("{word:?} is not a weight like \"75%\"")]
    NotAWeight { word: String },
    #[error("{word:?} is above {AGENT_MAX_PERCENT}% of the configured weight")]
    AboveMax { word: String },
    #[error("unknown word {word:?}")]
    UnknownWord { word: String },
    #[error("an empty answer")]
    Empty,
}

/// Parses one line of an agent's answer: words separated by spaces, tabs or commas, in
/// any order; everything after `#` is a description and ignored. A word lb does not know
/// makes the whole answer malformed: it then changes nothing.
pub fn parse_agent_reply(line: &str) -> Result<AgentReport, AgentReplyError> {
    let words = line.split('#').next().unwrap_or("");
    let mut report = AgentReport::default();
    let mut any = false;
    for word in words
        .split([' ', '\t', ',', '\r', '\n'])
        .filter(|w| !w.is_empty())
    {
        any = true;
        let lower = word.to_ascii_lowercase();
        if let Some(number) = lower.strip_suffix('%') {
            let percent: u32 = number
                .parse()
                .map_err(|_| AgentReplyError::NotAWeight { word: word.into() })?;
            if percent > AGENT_MAX_PERCENT {
                return Err(AgentReplyError::AboveMax { word: word.into() });
            }
            report.weight_percent = Some(percent);
            continue;
        }
        match lower.as_str() {
            "ready" => report.admin = Some(AdminState::Ready),
            "drain" => report.admin = Some(AdminState::Drain),
            "maint" => report.admin = Some(AdminState::Maint),
            "up" => report.health = Some(AgentHealth::Up),
            "down" | "fail" | "failed" | "stopped" => report.health = Some(AgentHealth::Down),
            _ => return Err(AgentReplyError::UnknownWord { word: word.into() }),
        }
    }
    if !any {
        return Err(AgentReplyError::Empty);
    }
    Ok(report)
}

/// A backend's effective weight and why.
#[derive(Clone, Debug, PartialEq)]
pub struct Effective {
    /// What the table builder gets (configured × `SCALE` × factors).
    pub weight: u32,
    pub reason: WeightReason,
}

/// Why a backend's effective weight is what it is. Status JSON carries it as its words
/// (`as_str`): "configured", or the rules that apply, "slow start 40%, agent 75%".
#[derive(Clone, Debug, Default, PartialEq)]
pub enum WeightReason {
    /// No rule applies: the weight is the configured one.
    #[default]
    Configured,
    /// The rules that apply, in the words status shows.
    Rules(String),
}

impl WeightReason {
    /// Whether no rule applies (nothing to show beside the configured weight).
    pub fn is_configured(&self) -> bool {
        *self == WeightReason::Configured
    }

    pub fn as_str(&self) -> &str {
        match self {
            WeightReason::Configured => "configured",
            WeightReason::Rules(rules) => rules,
        }
    }
}

impl std::fmt::Display for WeightReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl serde::Serialize for WeightReason {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl<'de> serde::Deserialize<'de> for WeightReason {
    /// "configured" (or empty, from an answer without the field) is no rule.
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        Ok(match text.as_str() {
            "configured" | "" => WeightReason::Configured,
            _ => WeightReason::Rules(text),
        })
    }
}

/// The rules that apply to one backend now.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Factors {
    pub slow_start: Option<f64>,
    pub agent_percent: Option<u32>,
    pub least_flows: Option<f64>,
}

/// Combines a configured weight with the rules that apply.
pub fn effective(configured: u32, factors: Factors) -> Effective {
    let mut factor = 1.0;
    let mut reasons = Vec::new();
    if let Some(share) = factors.slow_start {
        factor *= share;
        reasons.push(format!("slow start {:.0}%", share * 100.0));
    }
    if let Some(percent) = factors.agent_percent {
        factor *= percent as f64 / 100.0;
        reasons.push(format!("agent {percent}%"));
    }
    if let Some(scale) = factors.least_flows
        && scale != 1.0
    {
        factor *= scale;
        reasons.push(format!("least-flows {scale:.2}x"));
    }
    let exact = configured as f64 * SCALE as f64 * factor;
    // A rule shrinks a weight, it does not remove the backend: that is what drain,
    // maint and 0 are for (an agent's "0%" is a 0).
    let weight = if exact <= 0.0 {
        0
    } else {
        (exact.round() as u32).max(1)
    };
    Effective {
        weight,
        reason: if reasons.is_empty() {
            WeightReason::Configured
        } else {
            WeightReason::Rules(reasons.join(", "))
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn slow_start_ramps_linearly_in_bounded_steps() {
        let ramp = 30 * S;
        assert_eq!(slow_start_factor(Duration::ZERO, ramp), Some(0.1));
        assert_eq!(slow_start_factor(2 * S, ramp), Some(0.1));
        assert_eq!(slow_start_factor(3 * S, ramp), Some(0.2));
        assert_eq!(slow_start_factor(12 * S, ramp), Some(0.5));
        assert_eq!(slow_start_factor(26 * S, ramp), Some(0.9));
        assert_eq!(
            slow_start_factor(27 * S, ramp),
            None,
            "the last step is full"
        );
        assert_eq!(slow_start_factor(30 * S, ramp), None);
        assert_eq!(slow_start_factor(5 * S, Duration::ZERO), None, "no ramp");
        let steps: std::collections::BTreeSet<u64> = (0..300)
            .filter_map(|tenth| slow_start_factor(tenth * S / 10, ramp))
            .map(|f| (f * 100.0).round() as u64)
            .collect();
        assert_eq!(steps.len() as u32, SLOW_START_STEPS - 1, "{steps:?}");
        assert_eq!(slow_start_next_step(2 * S, ramp), Some(S));
        assert_eq!(slow_start_next_step(3 * S, ramp), Some(3 * S));
        assert_eq!(slow_start_next_step(28 * S, ramp), None);
    }

    #[test]
    fn least_flows_moves_towards_the_mean_within_bounds() {
        let neutral = least_flows_neutral();
        assert_eq!(LEAST_FLOWS_LEVELS[neutral], 1.0);
        // Near the mean: unchanged (hysteresis).
        assert_eq!(least_flows_level(neutral, 10, 12.0), neutral);
        assert_eq!(least_flows_level(neutral, 14, 12.0), neutral);
        // Far from it: one level per call, the right way.
        assert_eq!(least_flows_level(neutral, 40, 14.0), neutral - 1);
        assert_eq!(least_flows_level(neutral, 0, 14.0), neutral + 1);
        // Held at the bounds.
        let mut level = neutral;
        for _ in 0..20 {
            level = least_flows_level(level, 400, 10.0);
        }
        assert_eq!(LEAST_FLOWS_LEVELS[level], 0.25);
        for _ in 0..20 {
            level = least_flows_level(level, 0, 400.0);
        }
        assert_eq!(LEAST_FLOWS_LEVELS[level], 4.0);
    }

    #[test]
    fn least_flows_settles_instead_of_oscillating() {
        // Two backends; new flows split by their weights; flows drain slowly. Whatever
        // the start, the levels stop changing.
        let mut levels = [least_flows_neutral(); 2];
        let mut flows = [40.0f64, 0.0];
        let mut changes = Vec::new();
        for round in 0..60 {
            let mean = (flows[0] + flows[1]) / 2.0;
            let before = levels;
            for i in 0..2 {
                levels[i] = least_flows_level(levels[i], flows[i] as u64, mean);
            }
            if levels != before {
                changes.push(round);
            }
            let w = [LEAST_FLOWS_LEVELS[levels[0]], LEAST_FLOWS_LEVELS[levels[1]]];
            for i in 0..2 {
                flows[i] = flows[i] * 0.9 + 10.0 * w[i] / (w[0] + w[1]);
            }
        }
        assert!(
            changes.iter().all(|&round| round < 40),
            "still changing late: {changes:?}"
        );
    }

    #[test]
    fn agent_answers_in_haproxy_words() {
        let parse = |line: &str| parse_agent_reply(line).unwrap();
        assert_eq!(parse("75%\n").weight_percent, Some(75));
        assert_eq!(
            parse("75% drain"),
            AgentReport {
                weight_percent: Some(75),
                admin: Some(AdminState::Drain),
                health: None,
            }
        );
        assert_eq!(parse("DRAIN,maint").admin, Some(AdminState::Maint));
        assert_eq!(parse("ready up").admin, Some(AdminState::Ready));
        assert_eq!(parse("up\t100%").health, Some(AgentHealth::Up));
        assert_eq!(parse("stopped # deploying").health, Some(AgentHealth::Down));
        let word = |w: &str| w.to_string();
        for (bad, why) in [
            ("", AgentReplyError::Empty),
            ("   ", AgentReplyError::Empty),
            ("# only a comment", AgentReplyError::Empty),
            ("75", AgentReplyError::UnknownWord { word: word("75") }),
            ("x%", AgentReplyError::NotAWeight { word: word("x%") }),
            ("-5%", AgentReplyError::NotAWeight { word: word("-5%") }),
            (
                "2000%",
                AgentReplyError::AboveMax {
                    word: word("2000%"),
                },
            ),
            (
                "ready sideways",
                AgentReplyError::UnknownWord {
                    word: word("sideways"),
                },
            ),
        ] {
            assert_eq!(
                parse_agent_reply(bad),
                Err(why),
                "{bad:?} must be malformed"
            );
        }
        assert_eq!(
            AgentReplyError::AboveMax {
                word: word("2000%")
            }
            .to_string(),
            "\"2000%\" is above 1000% of the configured weight"
        );
    }

    /// Status JSON keeps the words it had as a string: "configured", or the rules.
    #[test]
    fn a_weight_reason_is_written_and_read_as_its_words() {
        let configured = serde_json::to_string(&WeightReason::Configured).unwrap();
        assert_eq!(configured, "\"configured\"");
        let rules = WeightReason::Rules("slow start 40%, agent 75%".into());
        let text = serde_json::to_string(&rules).unwrap();
        assert_eq!(text, "\"slow start 40%, agent 75%\"");
        assert_eq!(serde_json::from_str::<WeightReason>(&text).unwrap(), rules);
        for configured in ["\"configured\"", "\"\""] {
            let read: WeightReason = serde_json::from_str(configured).unwrap();
            assert!(read.is_configured(), "{configured}");
        }
    }

    #[test]
    fn effective_weight_multiplies_the_rules_and_says_why() {
        assert_eq!(
            effective(3, Factors::default()),
            Effective {
                weight: 300,
                reason: WeightReason::Configured
            }
        );
        let e = effective(
            2,
            Factors {
                slow_start: Some(0.4),
                agent_percent: Some(75),
                least_flows: Some(1.0),
            },
        );
        assert_eq!(e.weight, 60);
        assert_eq!(e.reason.as_str(), "slow start 40%, agent 75%");
        let e = effective(
            1,
            Factors {
                least_flows: Some(0.354),
                ..Factors::default()
            },
        );
        assert_eq!((e.weight, e.reason.as_str()), (35, "least-flows 0.35x"));
        assert_eq!(
            effective(
                1,
                Factors {
                    agent_percent: Some(0),
                    ..Factors::default()
                }
            )
            .weight,
            0
        );
        assert_eq!(effective(0, Factors::default()).weight, 0);
    }

    #[test]
    fn scaled_weights_build_the_configured_table() {
        use lb_common::maglev::{MaglevBackend, build_table};
        let backends = |scale: u32| -> Vec<MaglevBackend> {
            (1..=4u32)
                .map(|i| MaglevBackend {
                    id: i,
                    address: std::net::IpAddr::from([10, 0, 0, i as u8]),
                    weight: i * scale,
                })
                .collect()
        };
        assert_eq!(
            build_table(&backends(1), 65537),
            build_table(&backends(SCALE), 65537)
        );
    }
}
