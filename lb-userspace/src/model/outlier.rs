//! A backend's passive-health state (`[vip.outlier]`): its clients' handshakes over the
//! window, and an ejection. `health::outlier` judges and changes it; `in_table` reads it.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use lb_common::handshake::{COUNT, Judged};

/// A backend's passive-health state (in the model's `BackendState`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Outlier {
    /// Readings of its handshake counters over the window, oldest first.
    pub samples: VecDeque<(Instant, [u64; COUNT])>,
    /// Handshakes judged over the last window.
    pub window: Judged,
    /// Out of the table, until when, and why.
    pub ejected: Option<Ejection>,
    /// Ejections in a row: each lasts one `eject` longer; one is forgiven for each
    /// `eject` the backend then spends in the table.
    pub repeats: u32,
    pub forgive_at: Option<Instant>,
    /// Ejections since the agent started (the metric `lb_backend_ejections_total`).
    pub ejections_total: u64,
    /// The last ejection's reason, kept after the backend returned.
    pub last_reason: Option<String>,
    /// An ejection its numbers call for is held back by `max_ejected` (logged once).
    pub held_back: bool,
}

/// An ejection in force.
#[derive(Clone, Debug, PartialEq)]
pub struct Ejection {
    pub until: Instant,
    pub reason: String,
}

impl Outlier {
    pub fn is_ejected(&self) -> bool {
        self.ejected.is_some()
    }

    /// Takes a reading of the cumulative counters and moves the window to end at `now`.
    pub fn record(&mut self, now: Instant, reading: [u64; COUNT], window: Duration) {
        // Counters that went back (the backend's id was reused, its counters reset):
        // the window starts again.
        if let Some((_, last)) = self.samples.back()
            && reading.iter().zip(last).any(|(new, old)| new < old)
        {
            self.samples.clear();
        }
        self.samples.push_back((now, reading));
        let start = now.checked_sub(window);
        while self.samples.len() > 2 && start.is_some_and(|start| self.samples[1].0 <= start) {
            self.samples.pop_front();
        }
        let first = self.samples.front().map_or(reading, |(_, r)| *r);
        let delta: [u64; COUNT] = std::array::from_fn(|i| reading[i] - first[i]);
        self.window = Judged::of(&delta);
    }

    /// Forgets the window: judged afresh from the next reading on.
    pub fn restart_window(&mut self) {
        self.samples.clear();
        self.window = Judged::default();
    }
}
