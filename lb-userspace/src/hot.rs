//! Hot sources (`hot_source_share`): the clients of a src-ip VIP that open so many of
//! its new flows that pinning them to one backend (client affinity) overloads it. The
//! program hashes a hot source's new flows on the 5-tuple instead (`LB_HOT_SRC`); its
//! established connections follow the connection table and keep their backend.
//!
//! Pure: the agent feeds it, every sample (2 s), each source's new flows over the
//! sample; it keeps the set the controller hands the table writer (`TableInputs`), which
//! writes it into `LB_HOT_SRC` as it writes every map.
//!
//! The rule, per VIP with `hot_source_share = S`:
//! - a source's share is its new flows over the VIP's new flows (both as sampled by the
//!   program, one in `SOURCE_SAMPLE`, so they agree);
//! - it turns hot when its share is above S and it opened at least `MIN_HOT_FLOWS` new
//!   flows in the sample (a share of a handful of sampled flows is noise);
//! - it stays hot until its share has been below S / 2 for `COLD_SAMPLES` samples in a
//!   row (a sample without new flows counts as below): hysteresis, so a source near S or
//!   pausing briefly does not flip between per-connection and sticky;
//! - at most `HOT_SOURCE_ENTRIES` sources over all VIPs: sources hot already stay, new
//!   ones are taken by share, the rest skipped (and counted) until there is room.

use std::collections::HashMap;

use lb_common::{HOT_SOURCE_ENTRIES, SourceKey};

/// Estimated new flows of a source in one sample below which it does not turn hot.
pub const MIN_HOT_FLOWS: u64 = 20;
/// A hot source leaves after this many samples in a row below half the share.
pub const COLD_SAMPLES: u32 = 3;

/// A hot source's share of its VIP's new flows at the last sample, and for how many
/// samples in a row it has been below half the VIP's `hot_source_share`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Hot {
    pub share: f64,
    pub cold_samples: u32,
}

#[derive(Clone, Debug, Default)]
pub struct HotSources {
    /// Every hot source, of every VIP (the key names the VIP).
    pub hot: HashMap<SourceKey, Hot>,
    /// Sources that qualified at the last sample but found no room.
    pub skipped: usize,
}

impl HotSources {
    /// Follows one sample: `shares` maps the VIP id of every VIP with `hot_source_share`
    /// (and `hash = "src-ip"`) to that share; `deltas` gives, per VIP id, each source's
    /// new flows in the sample. Sources of other VIPs leave at once.
    pub fn update(
        &mut self,
        shares: &HashMap<u32, f64>,
        deltas: &HashMap<u32, Vec<(SourceKey, u64)>>,
    ) {
        self.hot.retain(|key, _| shares.contains_key(&key.vip_id));
        let mut candidates = Vec::new();
        for (&vip_id, &threshold) in shares {
            let sources = deltas.get(&vip_id).map(Vec::as_slice).unwrap_or_default();
            let total: u64 = sources.iter().map(|(_, n)| n).sum();
            let share_of = |n: u64| {
                if total == 0 {
                    0.0
                } else {
                    n as f64 / total as f64
                }
            };
            let now: HashMap<&SourceKey, u64> = sources.iter().map(|(k, n)| (k, *n)).collect();
            // The VIP's hot sources: stay while above half the share, else count down.
            self.hot.retain(|key, hot| {
                if key.vip_id != vip_id {
                    return true;
                }
                hot.share = share_of(now.get(key).copied().unwrap_or(0));
                hot.cold_samples = if hot.share < threshold / 2.0 {
                    hot.cold_samples + 1
                } else {
                    0
                };
                hot.cold_samples < COLD_SAMPLES
            });
            for (key, n) in sources {
                let share = share_of(*n);
                if *n >= MIN_HOT_FLOWS && share > threshold && !self.hot.contains_key(key) {
                    candidates.push((*key, share));
                }
            }
        }
        // The busiest first, then by key: the same inputs give the same set.
        candidates.sort_by(|a, b| {
            b.1.total_cmp(&a.1)
                .then(a.0.vip_id.cmp(&b.0.vip_id))
                .then(a.0.addr.cmp(&b.0.addr))
        });
        let room = (HOT_SOURCE_ENTRIES as usize).saturating_sub(self.hot.len());
        self.skipped = candidates.len().saturating_sub(room);
        for (key, share) in candidates.into_iter().take(room) {
            self.hot.insert(
                key,
                Hot {
                    share,
                    cold_samples: 0,
                },
            );
        }
    }

    /// VIP `vip_id`'s hot sources, the busiest first.
    pub fn of_vip(&self, vip_id: u32) -> Vec<(SourceKey, f64)> {
        let mut hot: Vec<(SourceKey, f64)> = self
            .hot
            .iter()
            .filter(|(key, _)| key.vip_id == vip_id)
            .map(|(key, hot)| (*key, hot.share))
            .collect();
        hot.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.addr.cmp(&b.0.addr)));
        hot
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lb_common::ADDR_FAMILY_V4;

    fn key(vip_id: u32, last: u8) -> SourceKey {
        let mut addr = [0; 16];
        addr[..4].copy_from_slice(&[10, 0, (last as u32 >> 8) as u8, last]);
        SourceKey::new(vip_id, addr, ADDR_FAMILY_V4)
    }

    fn hot_keys(hot: &HotSources) -> Vec<SourceKey> {
        let mut keys: Vec<SourceKey> = hot.hot.keys().copied().collect();
        keys.sort_by_key(|k| (k.vip_id, k.addr));
        keys
    }

    /// VIP 1 with share 0.2; VIP 2 has none.
    fn shares() -> HashMap<u32, f64> {
        [(1, 0.2)].into()
    }

    #[test]
    fn a_source_above_the_share_turns_hot_and_one_below_does_not() {
        let mut hot = HotSources::default();
        // 300 new flows: source 1 has 50% and 3 has 30% (hot), 2 has 20% (not above).
        let deltas = [(1, vec![(key(1, 1), 150), (key(1, 2), 60), (key(1, 3), 90)])].into();
        hot.update(&shares(), &deltas);
        assert_eq!(hot_keys(&hot), [key(1, 1), key(1, 3)]);
        assert_eq!(
            hot.of_vip(1),
            [(key(1, 1), 0.5), (key(1, 3), 0.3)],
            "busiest first, with its share"
        );
        assert_eq!(hot.skipped, 0);
    }

    #[test]
    fn a_few_flows_are_no_evidence() {
        let mut hot = HotSources::default();
        // The only client of a quiet VIP has all its new flows, but only a handful.
        let deltas = [(1, vec![(key(1, 1), MIN_HOT_FLOWS - 1)])].into();
        hot.update(&shares(), &deltas);
        assert!(hot.hot.is_empty());
        let deltas = [(1, vec![(key(1, 1), MIN_HOT_FLOWS)])].into();
        hot.update(&shares(), &deltas);
        assert_eq!(hot_keys(&hot), [key(1, 1)]);
    }

    #[test]
    fn only_vips_with_the_share_have_hot_sources() {
        let mut hot = HotSources::default();
        let deltas = [(1, vec![(key(1, 1), 100)]), (2, vec![(key(2, 1), 1000)])].into();
        hot.update(&shares(), &deltas);
        assert_eq!(hot_keys(&hot), [key(1, 1)]);
        // VIP 1 loses its share (a reload): its hot sources leave at once.
        hot.update(&HashMap::new(), &deltas);
        assert!(hot.hot.is_empty());
    }

    #[test]
    fn a_hot_source_stays_above_half_the_share_and_leaves_after_cold_samples() {
        let mut hot = HotSources::default();
        let sample = |hot: &mut HotSources, mine: u64, others: u64| {
            let deltas = [(1, vec![(key(1, 1), mine), (key(1, 2), others)])].into();
            hot.update(&shares(), &deltas);
            hot.hot.contains_key(&key(1, 1))
        };
        assert!(sample(&mut hot, 50, 50), "50% > 20%: hot");
        // 15% is below the share but above half of it: stays, however long.
        for _ in 0..5 {
            assert!(sample(&mut hot, 15, 85));
        }
        // Below 10%: two samples in a row are not enough ...
        assert!(sample(&mut hot, 5, 95));
        assert!(sample(&mut hot, 0, 100), "a sample without its flows");
        // ... one above half the share starts the count again ...
        assert!(sample(&mut hot, 12, 88));
        assert!(sample(&mut hot, 5, 95));
        assert!(sample(&mut hot, 5, 95));
        // ... and the third in a row below it ends it.
        assert!(!sample(&mut hot, 5, 95));
        // Turning hot again takes the full share, not half of it.
        assert!(!sample(&mut hot, 15, 85));
        assert!(sample(&mut hot, 25, 75));
        // A VIP without any new flows: every sample counts as cold.
        let idle = HashMap::new();
        for _ in 1..COLD_SAMPLES {
            hot.update(&shares(), &idle);
            assert!(hot.hot.contains_key(&key(1, 1)));
        }
        hot.update(&shares(), &idle);
        assert!(hot.hot.is_empty());
    }

    #[test]
    fn the_set_is_bounded_and_keeps_the_sources_hot_already() {
        let mut hot = HotSources::default();
        // A tiny share makes each of 1100 equal sources hot on VIP 1 (0.09% > 0.05%).
        let shares: HashMap<u32, f64> = [(1, 0.0005)].into();
        let many = |base: u32, n: u32| -> Vec<(SourceKey, u64)> {
            (base..base + n)
                .map(|i| {
                    let mut addr = [0; 16];
                    addr[..4].copy_from_slice(&(0x0a00_0000 + i).to_be_bytes());
                    (SourceKey::new(1, addr, ADDR_FAMILY_V4), 100)
                })
                .collect()
        };
        let first = many(0, 1000);
        hot.update(&shares, &[(1, first.clone())].into());
        assert_eq!(hot.hot.len(), 1000);
        // 200 more: 24 fit, and the first 1000 stay.
        let mut more = first.clone();
        more.extend(many(1000, 200));
        hot.update(&shares, &[(1, more)].into());
        assert_eq!(hot.hot.len(), HOT_SOURCE_ENTRIES as usize);
        assert_eq!(hot.skipped, 176);
        assert!(first.iter().all(|(k, _)| hot.hot.contains_key(k)));
    }
}
