//! How long an idle flow would have kept its connection-table entry, had every flow one.
//!
//! Without `stable_slots` an idle TCP flow keeps its backend across table changes until
//! the connection table evicts its entry. The table is an LRU with a list per CPU
//! (`BPF_F_NO_COMMON_LRU`): an entry goes once the CPU that made it has made as many
//! newer ones as its share of `dataplane.conntrack_entries` (the kernel splits the
//! entries evenly over the possible CPUs, and evicts on a CPU only from its own list).
//!
//! With `stable_slots` a flow in a stable slot has no entry. When a change moves its
//! slot, the slot turns *changed* and the flow's next packet goes to the slot's previous
//! backend, however long it idled. The slot may turn stable again (and such a flow be
//! balanced afresh) only once no flow idle since the change would still have an entry:
//! once every CPU made its share of entries since. `Turnover` keeps samples of each
//! CPU's count of flows that make an entry, or would make one outside a stable slot
//! (`entries_made`: `ct_promoted` less `ct_insert_skipped`), and finds the
//! latest such moment, the *horizon*. The stabilizer waits for it as well as for
//! `flow_idle_timeout`: `bound` is how long ago the later of the two was.
//!
//! A CPU whose count is still 0 at a sample made no entry before it (the counters live
//! as long as the maps), so it holds no flow back.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Samples kept at most; past it, every other one of the older half goes (a coarser
/// history finds an earlier horizon, never a later one).
const MAX_SAMPLES: usize = 1024;

#[derive(Debug)]
struct Sample {
    at: Instant,
    /// Flows that made (or would have made) an entry, per CPU, since the maps were made.
    entries: Vec<u64>,
}

/// The horizon of the connection table's turnover (see the module's text).
#[derive(Debug)]
pub struct Turnover {
    /// Entries one CPU's list holds: after that many newer ones, an idle entry is gone.
    per_cpu: u64,
    /// Oldest first.
    samples: VecDeque<Sample>,
}

impl Turnover {
    /// For a connection table of `conntrack_entries` over `cpus` possible CPUs.
    pub fn new(conntrack_entries: u32, cpus: usize) -> Self {
        Self {
            per_cpu: (conntrack_entries as u64 / cpus.max(1) as u64).max(1),
            samples: VecDeque::new(),
        }
    }

    /// Adds a reading of the per-CPU counts, taken at `at`.
    pub fn record(&mut self, at: Instant, entries: Vec<u64>) {
        // No entry made since the last sample: this one is the same moment, later.
        if self
            .samples
            .back()
            .is_some_and(|last| last.entries == entries)
        {
            self.samples.pop_back();
        }
        self.samples.push_back(Sample { at, entries });
        // Samples before the horizon are never one again: counts only grow.
        if let Some(horizon) = self.horizon_index() {
            self.samples.drain(..horizon);
        }
        if self.samples.len() > MAX_SAMPLES {
            let half = self.samples.len() / 2;
            let mut index = 0;
            self.samples.retain(|_| {
                index += 1;
                index > half || index % 2 == 1
            });
        }
    }

    /// The latest sampled moment after which every CPU made its share of entries (or
    /// before which it had made none): None while there is none.
    pub fn horizon(&self) -> Option<Instant> {
        self.horizon_index().map(|index| self.samples[index].at)
    }

    fn horizon_index(&self) -> Option<usize> {
        let newest = self.samples.back()?;
        self.samples.iter().rposition(|sample| {
            sample.entries.len() == newest.entries.len()
                && sample
                    .entries
                    .iter()
                    .zip(&newest.entries)
                    .all(|(&then, &now)| then == 0 || now.saturating_sub(then) >= self.per_cpu)
        })
    }

    /// How long a changed slot waits at `now` before it may turn stable, and how long
    /// an entry counts as live for it: `idle` (`flow_idle_timeout`), or longer, back to
    /// the horizon. None while there is no horizon: no changed slot may turn stable.
    pub fn bound(&self, now: Instant, idle: Duration) -> Option<Duration> {
        let horizon = self.horizon()?;
        Some(idle.max(now.saturating_duration_since(horizon)))
    }
}

/// One CPU's count for `Turnover::record`, from its `ct_promoted` (flows entered at
/// their second packet, or counted there in a stable slot) and `ct_insert_skipped`
/// (inserts the flood guard skipped): the flows that made an entry or would have made
/// one. 0 only where no flow was ever promoted, which `Turnover` reads as "no entry
/// made on this CPU", however many inserts were skipped.
pub fn entries_made(promoted: u64, skipped: u64) -> u64 {
    promoted.saturating_sub(skipped).max(promoted.min(1))
}

/// The horizon as the stabilizer last found it, for `lb status`: written by the
/// stabilizer's task only, read by status.
#[derive(Debug, Default)]
pub struct PublishedHorizon(Mutex<Option<Instant>>);

impl PublishedHorizon {
    pub fn set(&self, horizon: Option<Instant>) {
        *self.0.lock().expect("horizon poisoned") = horizon;
    }

    /// None while the table has not turned over since the agent started.
    pub fn get(&self) -> Option<Instant> {
        *self.0.lock().expect("horizon poisoned")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const IDLE: Duration = Duration::from_secs(30);

    #[test]
    fn no_slot_turns_stable_before_every_cpu_made_its_share_of_entries() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        // 100 entries over 2 CPUs: 50 each.
        let mut turnover = Turnover::new(100, 2);
        assert_eq!(turnover.bound(t0, IDLE), None, "nothing sampled");
        turnover.record(at(0), vec![10, 20]);
        assert_eq!(turnover.horizon(), None, "entries made, none since");
        turnover.record(at(10), vec![60, 40]);
        assert_eq!(turnover.horizon(), None, "CPU 1 made 20 of its 50");
        turnover.record(at(20), vec![70, 70]);
        assert_eq!(turnover.horizon(), Some(at(0)), "both made 50 since 0");
        // Within `idle` of the horizon, `idle` is the bound.
        assert_eq!(turnover.bound(at(20), IDLE), Some(IDLE));
        assert_eq!(
            turnover.bound(at(100), IDLE),
            Some(Duration::from_secs(100))
        );
        turnover.record(at(30), vec![200, 200]);
        assert_eq!(
            turnover.horizon(),
            Some(at(20)),
            "the latest that qualifies"
        );
    }

    #[test]
    fn a_cpu_that_made_no_entry_holds_nothing_back() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut turnover = Turnover::new(100, 2);
        turnover.record(at(0), vec![0, 0]);
        assert_eq!(
            turnover.horizon(),
            Some(at(0)),
            "no flow ever made an entry"
        );
        turnover.record(at(5), vec![3, 0]);
        assert_eq!(
            turnover.horizon(),
            Some(at(0)),
            "no entry before 0 on either"
        );
        turnover.record(at(10), vec![60, 0]);
        assert_eq!(turnover.horizon(), Some(at(5)), "CPU 0 made 57 since 5");
    }

    #[test]
    fn skipped_inserts_count_against_entries_but_never_hide_that_some_were_made() {
        assert_eq!(entries_made(0, 0), 0);
        assert_eq!(entries_made(0, 5), 0);
        assert_eq!(entries_made(10, 3), 7);
        assert_eq!(
            entries_made(3, 10),
            1,
            "promoted flows: not a CPU without entries"
        );
    }

    #[test]
    fn a_quiet_table_keeps_one_sample_and_a_busy_one_few() {
        let t0 = Instant::now();
        let mut turnover = Turnover::new(100, 2);
        for s in 0..5000 {
            turnover.record(t0 + Duration::from_secs(s), vec![7, 7]);
        }
        assert_eq!(turnover.samples.len(), 1);
        for s in 0..5000u64 {
            turnover.record(t0 + Duration::from_secs(s), vec![8 + s, 8 + s]);
        }
        assert!(turnover.samples.len() <= 51, "{}", turnover.samples.len());
        assert_eq!(turnover.horizon(), Some(t0 + Duration::from_secs(4949)));
        // Slow growth: the history is thinned, and the horizon never comes later.
        let mut slow = Turnover::new(1_000_000, 2);
        for s in 0..5000u64 {
            slow.record(t0 + Duration::from_secs(s), vec![1 + s, 1 + s]);
        }
        assert!(slow.samples.len() <= MAX_SAMPLES, "{}", slow.samples.len());
        assert_eq!(slow.horizon(), None);
    }
}
