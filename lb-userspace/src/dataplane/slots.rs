//! The VIP-slot writer protocol. The program finds a VIP through `LB_VIP_SLOTS` (one
//! slot per key hash) and asks `LB_VIPS` only where a slot is marked shared (several
//! keys, or a rewrite under way); both maps are written in an order, and a slot in
//! steps, that give a packet reading them at any moment a right answer.

use std::collections::HashMap;

use aya::maps::{Array, HashMap as BpfHashMap, MapData};
use bytemuck::Zeroable;
use lb_common::{
    MAP_VIP_SLOTS, MAP_VIPS, VIP_SLOT_SHARED, VIP_SLOT_USED, VIP_SLOTS, VipInfo, VipKey, VipSlot,
};

use super::{DataplaneError, in_map};

/// `LB_VIPS` and `LB_VIP_SLOTS`, with what was written into them.
pub(super) struct Vips {
    map: BpfHashMap<MapData, VipKey, VipInfo>,
    slot_map: Array<MapData, VipSlot>,
    /// What `LB_VIPS` holds, which the slots are built from.
    infos: HashMap<VipKey, VipInfo>,
    /// What each written slot of `LB_VIP_SLOTS` holds (absent: zeroes).
    slots: HashMap<u32, VipSlot>,
}

impl Vips {
    pub(super) fn new(
        map: BpfHashMap<MapData, VipKey, VipInfo>,
        slot_map: Array<MapData, VipSlot>,
    ) -> Result<Self, DataplaneError> {
        // Adopted pins: what the slots and LB_VIPS hold already.
        let infos = map
            .iter()
            .collect::<Result<_, _>>()
            .map_err(in_map(MAP_VIPS))?;
        let mut slots = HashMap::new();
        for index in 0..VIP_SLOTS {
            let slot = slot_map.get(&index, 0).map_err(in_map(MAP_VIP_SLOTS))?;
            if slot != VipSlot::zeroed() {
                slots.insert(index, slot);
            }
        }
        Ok(Self {
            map,
            slot_map,
            infos,
            slots,
        })
    }

    /// What `LB_VIPS` holds, read from the map.
    pub(super) fn read(&self) -> Result<Vec<(VipKey, VipInfo)>, DataplaneError> {
        self.map
            .iter()
            .map(|item| item.map_err(in_map(MAP_VIPS)))
            .collect()
    }

    pub(super) fn set(&mut self, key: &VipKey, info: &VipInfo) -> Result<(), DataplaneError> {
        // LB_VIPS first: a slot being rewritten sends packets there.
        self.map.insert(key, info, 0).map_err(in_map(MAP_VIPS))?;
        self.infos.insert(*key, *info);
        self.write_slot(VipSlot::index(key))
    }

    pub(super) fn remove(&mut self, key: &VipKey) -> Result<(), DataplaneError> {
        // The slot first: once it no longer names the key, nothing asks LB_VIPS for it.
        self.infos.remove(key);
        self.write_slot(VipSlot::index(key))?;
        self.map.remove(key).map_err(in_map(MAP_VIPS))
    }

    /// Mends any slot that does not match LB_VIPS (none, when adopted pins were ours).
    /// Not for an instance that only reads a running program's maps.
    pub(super) fn mend(&mut self) -> Result<(), DataplaneError> {
        let mut indexes: Vec<u32> = self.slots.keys().copied().collect();
        indexes.extend(self.infos.keys().map(VipSlot::index));
        indexes.sort_unstable();
        indexes.dedup();
        for index in indexes {
            self.write_slot(index)?;
        }
        Ok(())
    }

    /// Brings slot `index` to what `infos` says it should hold, in steps the program
    /// can read at any point (`slot_steps`).
    fn write_slot(&mut self, index: u32) -> Result<(), DataplaneError> {
        let current = self
            .slots
            .get(&index)
            .copied()
            .unwrap_or_else(VipSlot::zeroed);
        let keys: Vec<(&VipKey, &VipInfo)> = self
            .infos
            .iter()
            .filter(|(key, _)| VipSlot::index(key) == index)
            .collect();
        let target = target_slot(&current, &keys);
        for step in slot_steps(&current, &target) {
            self.slot_map
                .set(index, step, 0)
                .map_err(in_map(MAP_VIP_SLOTS))?;
            self.slots.insert(index, step);
        }
        Ok(())
    }
}

/// What a VIP slot should hold, given what it holds and the VIP keys that hash to it:
/// nothing (the content stays, unused); one VIP; or, for several, the marker that sends
/// the program to `LB_VIPS`.
fn target_slot(current: &VipSlot, keys: &[(&VipKey, &VipInfo)]) -> VipSlot {
    match keys {
        [] => VipSlot {
            state: 0,
            ..*current
        },
        [(key, info)] => VipSlot {
            key: **key,
            vip_id: info.vip_id,
            generation: info.generation,
            flags: info.flags,
            state: VIP_SLOT_USED,
            _pad: 0,
        },
        _ => VipSlot {
            state: VIP_SLOT_USED | VIP_SLOT_SHARED,
            ..*current
        },
    }
}

/// The writes that take a slot from `current` to `target`. The program reads a slot's
/// content only while its state is `VIP_SLOT_USED` alone, so the content changes only
/// while the slot is unused or marked shared, and every write changes either the state
/// or the content: a packet sees the slot before or after each write, and both are
/// right.
fn slot_steps(current: &VipSlot, target: &VipSlot) -> Vec<VipSlot> {
    let content = |s: &VipSlot| VipSlot {
        state: 0,
        _pad: 0,
        ..*s
    };
    let mut steps = Vec::new();
    if content(current) != content(target) {
        let hidden = if current.state & VIP_SLOT_USED != 0 {
            VIP_SLOT_USED | VIP_SLOT_SHARED
        } else {
            0
        };
        if current.state != hidden {
            steps.push(VipSlot {
                state: hidden,
                ..*current
            });
        }
        steps.push(VipSlot {
            state: hidden,
            ..*target
        });
    }
    if steps.last().unwrap_or(current) != target {
        steps.push(*target);
    }
    steps
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(last: u8) -> VipKey {
        crate::model::vip_key([10, 0, 0, last].into(), 80, lb_common::PROTO_TCP)
    }

    fn info(vip_id: u32, generation: u32) -> VipInfo {
        VipInfo {
            vip_id,
            generation,
            flags: 0,
            _pad: 0,
        }
    }

    /// Writes from `current` to the slot for `keys`, checked as the program reads them:
    /// each write changes the state or the content, never both, and the content only
    /// while the program does not read it. Returns the final slot.
    fn apply(current: VipSlot, keys: &[(VipKey, VipInfo)]) -> VipSlot {
        let keys: Vec<(&VipKey, &VipInfo)> = keys.iter().map(|(k, i)| (k, i)).collect();
        let target = target_slot(&current, &keys);
        let steps = slot_steps(&current, &target);
        let content = |s: &VipSlot| (s.key, s.vip_id, s.generation, s.flags);
        let mut before = current;
        for step in &steps {
            let content_changed = content(&before) != content(step);
            assert!(
                !(content_changed && before.state != step.state),
                "one write changed state and content: {before:?} -> {step:?}"
            );
            if content_changed {
                assert_ne!(
                    before.state, VIP_SLOT_USED,
                    "content changed under a reader"
                );
                assert_ne!(step.state, VIP_SLOT_USED, "content changed under a reader");
            }
            before = *step;
        }
        assert_eq!(before, target);
        target
    }

    #[test]
    fn slot_writes_never_show_a_packet_a_mixed_slot() {
        let (a, b) = (key(1), key(2));
        let empty = VipSlot::zeroed();
        let one = apply(empty, &[(a, info(3, 0))]);
        assert_eq!((one.state, one.key, one.vip_id), (VIP_SLOT_USED, a, 3));
        // A table switch: the new generation reaches the slot.
        let switched = apply(one, &[(a, info(3, 1))]);
        assert_eq!((switched.state, switched.generation), (VIP_SLOT_USED, 1));
        // A second key on the slot: shared, LB_VIPS decides.
        let shared = apply(switched, &[(a, info(3, 1)), (b, info(4, 0))]);
        assert_eq!(shared.state, VIP_SLOT_USED | VIP_SLOT_SHARED);
        // The first key leaves: the slot is the second key's alone.
        let only_b = apply(shared, &[(b, info(4, 0))]);
        assert_eq!(
            (only_b.state, only_b.key, only_b.vip_id),
            (VIP_SLOT_USED, b, 4)
        );
        // One key replaced by another in one step (an address change keeps the id).
        let moved = apply(only_b, &[(a, info(4, 0))]);
        assert_eq!((moved.state, moved.key), (VIP_SLOT_USED, a));
        let gone = apply(moved, &[]);
        assert_eq!(gone.state, 0);
        assert_eq!(slot_steps(&gone, &gone), Vec::new());
    }
}
