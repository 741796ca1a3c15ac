//! "What should be" and "write only what changed".
//!
//! `Desired` is computed purely from the agent's view of VIPs and backends. `TableWriter`
//! turns it into data-path writes: backends first, then each changed VIP's new table
//! into the generation no packet is reading, then one `LB_VIPS` update that switches the
//! VIP to it. A packet sees either the whole old table or the whole new one.
//!
//! Between the two sits the Maglev build: `TableInputs` is what the model says (cheap to
//! take under the agent's lock), `TableBuilder` builds the tables from it outside the
//! lock, rebuilding only VIPs whose inputs changed.

use std::collections::{BTreeMap, HashMap, HashSet};

use lb_common::{
    BackendIdentity, BackendInfo, SourceKey, TABLE_GENERATIONS, TunnelConfig, VipInfo, VipKey,
    maglev::{MaglevBackend, build_table},
    quic::ServerKey,
};

use crate::dataplane::{Adopted, Dataplane, DataplaneError};

/// One VIP as the data path should have it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DesiredVip {
    pub key: VipKey,
    pub vip_id: u32,
    pub flags: u32,
    /// Backend id per slot (`BACKEND_NONE` where no backend is usable).
    pub table: Vec<u32>,
}

/// One backend as the data path should have it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DesiredBackend {
    pub info: BackendInfo,
    pub identity: BackendIdentity,
    /// The interface its frames leave by (`LB_BE_EGRESS`; see `BackendState::egress`).
    pub egress: u32,
}

/// The whole data path as it should be.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Desired {
    pub vips: Vec<DesiredVip>,
    pub backends: BTreeMap<u32, DesiredBackend>,
    /// Outer sources and MTU of tunnels (`LB_TUNNEL`).
    pub tunnel: TunnelConfig,
    /// Sources whose new flows are balanced per connection (`LB_HOT_SRC`).
    pub hot_sources: HashSet<SourceKey>,
    /// QUIC VIPs' server IDs -> backend id (`LB_QUIC_IDS`).
    pub quic_ids: HashMap<ServerKey, u32>,
}

/// One VIP's table as the model asks for it: the Maglev members, not yet built.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VipInputs {
    pub key: VipKey,
    pub vip_id: u32,
    pub flags: u32,
    /// The backends that take new flows, with their weights.
    pub members: Vec<MaglevBackend>,
}

/// Everything `Desired` is built from.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TableInputs {
    pub table_size: u32,
    pub vips: Vec<VipInputs>,
    pub backends: BTreeMap<u32, DesiredBackend>,
    pub tunnel: TunnelConfig,
    pub hot_sources: HashSet<SourceKey>,
    pub quic_ids: HashMap<ServerKey, u32>,
}

impl TableInputs {
    /// Builds every table (no cache).
    pub fn build(&self) -> Desired {
        TableBuilder::default().build(self)
    }
}

/// Builds `Desired` from inputs, keeping each VIP's last table: a VIP whose members did
/// not change is not rebuilt (a health change rebuilds only its own VIP's table).
#[derive(Debug, Default)]
pub struct TableBuilder {
    /// By vip id: the members and size a table was built for, and the table.
    built: HashMap<u32, (Vec<MaglevBackend>, u32, Vec<u32>)>,
}

impl TableBuilder {
    pub fn build(&mut self, inputs: &TableInputs) -> Desired {
        self.built
            .retain(|id, _| inputs.vips.iter().any(|v| v.vip_id == *id));
        let vips = inputs
            .vips
            .iter()
            .map(|vip| {
                let fresh = |(members, size, _): &(Vec<MaglevBackend>, u32, Vec<u32>)| {
                    *members == vip.members && *size == inputs.table_size
                };
                if !self.built.get(&vip.vip_id).is_some_and(fresh) {
                    let table = build_table(&vip.members, inputs.table_size);
                    self.built
                        .insert(vip.vip_id, (vip.members.clone(), inputs.table_size, table));
                }
                DesiredVip {
                    key: vip.key,
                    vip_id: vip.vip_id,
                    flags: vip.flags,
                    table: self.built[&vip.vip_id].2.clone(),
                }
            })
            .collect();
        Desired {
            vips,
            backends: inputs.backends.clone(),
            tunnel: inputs.tunnel,
            hot_sources: inputs.hot_sources.clone(),
            quic_ids: inputs.quic_ids.clone(),
        }
    }

    /// How many tables are kept (for tests of what is rebuilt).
    pub fn cached(&self) -> usize {
        self.built.len()
    }
}

/// What one `apply` wrote.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ApplyReport {
    pub slots_written: usize,
    pub tables_switched: usize,
    pub vips_removed: usize,
    pub backends_written: usize,
}

#[derive(Debug, Default)]
struct VipTables {
    /// The generation `LB_VIPS` points at, when the VIP is in the map.
    active: Option<u32>,
    /// What each generation's slots hold, as far as we wrote them.
    contents: [Option<Vec<u32>>; TABLE_GENERATIONS as usize],
    /// When a table was last switched to (the other generation may still be read).
    switched_at: Option<std::time::Instant>,
}

/// Remembers what was written, so the next `apply` writes only differences.
#[derive(Debug)]
pub struct TableWriter {
    table_size: u32,
    /// By vip id: kept after a VIP is removed, so a reused id knows its slots' contents.
    tables: HashMap<u32, VipTables>,
    vips: HashMap<VipKey, VipInfo>,
    backends: HashMap<u32, DesiredBackend>,
    /// What `LB_TUNNEL` was last written with; None: not yet by this agent.
    tunnel: Option<TunnelConfig>,
    /// What `LB_HOT_SRC` holds; None: not known (not read yet, or a write failed), so
    /// the next `apply` reads it back first.
    hot_sources: Option<HashSet<SourceKey>>,
    /// What `LB_QUIC_IDS` holds; None: not known (read back first, as `hot_sources`).
    quic_ids: Option<HashMap<ServerKey, u32>>,
}

impl TableWriter {
    pub fn new(table_size: u32) -> Self {
        Self {
            table_size,
            tables: HashMap::new(),
            vips: HashMap::new(),
            backends: HashMap::new(),
            tunnel: None,
            hot_sources: None,
            quic_ids: None,
        }
    }

    /// Starts from what a previous agent left in adopted maps, so the first `apply`
    /// writes only differences.
    pub fn adopt(&mut self, adopted: &Adopted) {
        for (key, info) in &adopted.vips {
            let generation = info.generation % TABLE_GENERATIONS;
            let tables = self.tables.entry(info.vip_id).or_default();
            tables.active = Some(generation);
            if let Some((_, table)) = adopted.tables.iter().find(|(id, _)| *id == info.vip_id) {
                tables.contents[generation as usize] = Some(table.clone());
            }
            self.vips.insert(*key, *info);
        }
        for (id, info, identity) in &adopted.backends {
            self.backends.insert(
                *id,
                DesiredBackend {
                    info: *info,
                    identity: *identity,
                    egress: adopted.egress.get(id).copied().unwrap_or(0),
                },
            );
        }
    }

    pub fn apply<D: Dataplane + ?Sized>(
        &mut self,
        dataplane: &mut D,
        desired: &Desired,
    ) -> Result<ApplyReport, DataplaneError> {
        let mut report = ApplyReport::default();

        // Written at least once by every agent (the map may be an older agent's), before
        // the backends that need it.
        if self.tunnel != Some(desired.tunnel) {
            dataplane.set_tunnel(&desired.tunnel)?;
            self.tunnel = Some(desired.tunnel);
        }
        // Backends before the tables that name them.
        self.write_backends(dataplane, desired, &mut report)?;
        self.write_vips(dataplane, desired, &mut report)?;
        self.remove_gone_vips(dataplane, desired, &mut report)?;
        self.write_hot_sources(dataplane, &desired.hot_sources)?;
        self.write_quic_ids(dataplane, &desired.quic_ids)?;
        Ok(report)
    }

    /// Writes the backends that changed, and marks gone ones as serving nothing.
    fn write_backends<D: Dataplane + ?Sized>(
        &mut self,
        dataplane: &mut D,
        desired: &Desired,
        report: &mut ApplyReport,
    ) -> Result<(), DataplaneError> {
        for (&id, backend) in &desired.backends {
            if !self.backends.contains_key(&id) {
                // A new backend on this id: it starts from zero, not from a previous
                // owner's counts.
                dataplane.reset_backend_counters(id)?;
            }
            if self.backends.get(&id) != Some(backend) {
                // The way out before the backend that takes it.
                dataplane.set_backend_egress(id, backend.egress)?;
                dataplane.set_backend(id, &backend.info, &backend.identity)?;
                self.backends.insert(id, *backend);
                report.backends_written += 1;
            }
        }
        // A backend that is gone no longer serves flows: connection-table entries that
        // still name it are re-hashed by the program.
        let gone: Vec<u32> = self
            .backends
            .keys()
            .filter(|id| !desired.backends.contains_key(id))
            .copied()
            .collect();
        for id in gone {
            let mut gone = self.backends.remove(&id).expect("listed above");
            gone.info.flags = 0;
            gone.identity.in_use = 0;
            dataplane.set_backend(id, &gone.info, &gone.identity)?;
            report.backends_written += 1;
        }

        Ok(())
    }

    /// Writes each changed VIP's table into the generation no packet reads, then
    /// switches the VIP to it.
    fn write_vips<D: Dataplane + ?Sized>(
        &mut self,
        dataplane: &mut D,
        desired: &Desired,
        report: &mut ApplyReport,
    ) -> Result<(), DataplaneError> {
        for vip in &desired.vips {
            assert_eq!(
                vip.table.len(),
                self.table_size as usize,
                "table of the wrong size"
            );
            let tables = self.tables.entry(vip.vip_id).or_default();
            let unchanged = tables
                .active
                .and_then(|g| tables.contents[g as usize].as_ref())
                .is_some_and(|active| *active == vip.table);
            let generation = match (unchanged, tables.active) {
                (true, Some(active)) => active,
                (_, active) => {
                    let target = active.map_or(0, |g| (g + 1) % TABLE_GENERATIONS);
                    let base = VipInfo::table_base_for(vip.vip_id, target, self.table_size);
                    let previous = tables.contents[target as usize].as_deref();
                    let changes: Vec<(u32, u32)> = vip
                        .table
                        .iter()
                        .enumerate()
                        .filter(|(slot, id)| previous.is_none_or(|p| p[*slot] != **id))
                        .map(|(slot, &id)| (base + slot as u32, id))
                        .collect();
                    // Unknown until the write completes: a failed write must not leave
                    // later diffs trusting slots it may not have reached.
                    tables.contents[target as usize] = None;
                    // A packet that read the VIP's entry just before the last switch may
                    // still be reading this generation: let it finish (XDP runs in
                    // microseconds) before overwriting it.
                    if let Some(switched) = tables.switched_at {
                        let grace = std::time::Duration::from_millis(1);
                        if let Some(rest) = grace.checked_sub(switched.elapsed()) {
                            std::thread::sleep(rest);
                        }
                    }
                    dataplane.write_slots(&changes)?;
                    tables.switched_at = Some(std::time::Instant::now());
                    report.slots_written += changes.len();
                    report.tables_switched += 1;
                    tables.contents[target as usize] = Some(vip.table.clone());
                    target
                }
            };
            let info = VipInfo {
                vip_id: vip.vip_id,
                generation,
                flags: vip.flags,
                _pad: 0,
            };
            if !self.vips.values().any(|v| v.vip_id == vip.vip_id) {
                dataplane.reset_vip_counters(vip.vip_id)?;
            }
            if self.vips.get(&vip.key) != Some(&info) {
                dataplane.set_vip(&vip.key, &info)?;
                self.vips.insert(vip.key, info);
            }
            tables.active = Some(generation);
        }

        Ok(())
    }

    /// Removes the VIPs `desired` no longer has.
    fn remove_gone_vips<D: Dataplane + ?Sized>(
        &mut self,
        dataplane: &mut D,
        desired: &Desired,
        report: &mut ApplyReport,
    ) -> Result<(), DataplaneError> {
        let gone: Vec<VipKey> = self
            .vips
            .keys()
            .filter(|key| !desired.vips.iter().any(|v| v.key == **key))
            .copied()
            .collect();
        for key in gone {
            dataplane.remove_vip(&key)?;
            // A VIP whose address, port or protocol changed keeps its id under the new
            // key: its tables stay live, only the old key leaves the map.
            if let Some(info) = self.vips.remove(&key)
                && !desired.vips.iter().any(|v| v.vip_id == info.vip_id)
                && let Some(tables) = self.tables.get_mut(&info.vip_id)
            {
                tables.active = None;
            }
            report.vips_removed += 1;
        }
        Ok(())
    }

    /// Makes `LB_QUIC_IDS` hold `ids` (after the backends they name): what it holds and
    /// should not is removed, what differs written. A failed write leaves it unknown.
    fn write_quic_ids<D: Dataplane + ?Sized>(
        &mut self,
        dataplane: &mut D,
        ids: &HashMap<ServerKey, u32>,
    ) -> Result<(), DataplaneError> {
        if self.quic_ids.as_ref() == Some(ids) {
            return Ok(());
        }
        let held: HashMap<ServerKey, u32> = match self.quic_ids.take() {
            Some(held) => held,
            None => dataplane.quic_ids()?.into_iter().collect(),
        };
        for key in held.keys().filter(|key| !ids.contains_key(key)) {
            dataplane.set_quic_id(key, None)?;
        }
        for (key, backend) in ids {
            if held.get(key) != Some(backend) {
                dataplane.set_quic_id(key, Some(*backend))?;
            }
        }
        self.quic_ids = Some(ids.clone());
        Ok(())
    }

    /// Makes `LB_HOT_SRC` hold `hot`: what it holds and should not is removed, what it
    /// lacks added. A failed write leaves it unknown: the next apply reads it back.
    fn write_hot_sources<D: Dataplane + ?Sized>(
        &mut self,
        dataplane: &mut D,
        hot: &HashSet<SourceKey>,
    ) -> Result<(), DataplaneError> {
        if self.hot_sources.as_ref() == Some(hot) {
            return Ok(());
        }
        let held: HashSet<SourceKey> = match self.hot_sources.take() {
            Some(held) => held,
            None => dataplane.hot_sources()?.into_iter().collect(),
        };
        for key in held.difference(hot) {
            dataplane.set_hot_source(key, false)?;
        }
        for key in hot.difference(&held) {
            dataplane.set_hot_source(key, true)?;
        }
        self.hot_sources = Some(hot.clone());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dataplane::{MemoryDataplane, Write};
    use lb_common::BACKEND_NONE;

    const SIZE: u32 = 7;

    fn key(last: u8) -> VipKey {
        crate::model::vip_key([10, 0, 0, last].into(), 80, lb_common::PROTO_TCP)
    }

    fn desired(table: [u32; 7]) -> Desired {
        let mut backends = BTreeMap::new();
        for id in table.iter().filter(|&&id| id != BACKEND_NONE) {
            let info = BackendInfo::l2(
                [2, 0, 0, 0, 0, *id as u8],
                lb_common::BACKEND_F_SERVES_FLOWS,
                3,
            );
            let identity = crate::model::identity([10, 0, 0, *id as u8].into(), 3);
            backends.insert(
                *id,
                DesiredBackend {
                    info,
                    identity,
                    egress: 0,
                },
            );
        }
        Desired {
            vips: vec![DesiredVip {
                key: key(100),
                vip_id: 3,
                flags: 0,
                table: table.to_vec(),
            }],
            backends,
            tunnel: Default::default(),
            hot_sources: Default::default(),
            quic_ids: Default::default(),
        }
    }

    /// The backend the data path would pick for `slot`, read like the kernel does.
    fn lookup(dp: &MemoryDataplane, key: &VipKey, slot: u32) -> u32 {
        let info = dp.vips[key];
        dp.maglev[&(info.table_base(SIZE) + slot)]
    }

    #[test]
    fn first_apply_writes_everything_then_nothing() {
        let mut dp = MemoryDataplane::default();
        let mut writer = TableWriter::new(SIZE);
        let want = desired([1, 2, 1, 2, 1, 2, 1]);
        let report = writer.apply(&mut dp, &want).unwrap();
        assert_eq!(report.slots_written, 7);
        assert_eq!(report.backends_written, 2);
        for slot in 0..SIZE {
            assert_eq!(
                lookup(&dp, &key(100), slot),
                want.vips[0].table[slot as usize]
            );
        }
        let again = writer.apply(&mut dp, &want).unwrap();
        assert_eq!(again, ApplyReport::default());
    }

    #[test]
    fn an_adopting_writer_writes_only_what_differs_from_the_maps() {
        // A first agent writes its tables; a restarted one adopts what the maps hold.
        let mut dp = MemoryDataplane::default();
        let want = desired([1, 2, 1, 2, 1, 2, 1]);
        TableWriter::new(SIZE).apply(&mut dp, &want).unwrap();
        let info = dp.vips[&key(100)];
        let live = (0..SIZE).map(|slot| lookup(&dp, &key(100), slot)).collect();
        let adopted = crate::dataplane::Adopted {
            vips: vec![(key(100), info)],
            backends: want
                .backends
                .iter()
                .map(|(id, b)| (*id, b.info, b.identity))
                .collect(),
            tables: vec![(3, live)],
            freed: Vec::new(),
            egress: Default::default(),
        };
        let mut writer = TableWriter::new(SIZE);
        writer.adopt(&adopted);
        dp.log.clear();
        // The same tables: nothing to write (a fresh writer would write them all) but
        // the tunnel settings, which every agent writes once.
        assert_eq!(
            writer.apply(&mut dp, &want).unwrap(),
            ApplyReport::default()
        );
        assert!(
            matches!(dp.log[..], [crate::dataplane::Write::Tunnel(_)]),
            "{:?}",
            dp.log
        );
        // A changed table goes to the idle generation and switches, as before the restart.
        let changed = desired([1, 2, 1, 2, 1, 2, 2]);
        let report = writer.apply(&mut dp, &changed).unwrap();
        assert_eq!(report.tables_switched, 1);
        assert_ne!(dp.vips[&key(100)].generation, info.generation);
        for slot in 0..SIZE {
            assert_eq!(
                lookup(&dp, &key(100), slot),
                changed.vips[0].table[slot as usize]
            );
        }
    }

    #[test]
    fn a_new_table_goes_to_the_idle_generation_then_switches() {
        let mut dp = MemoryDataplane::default();
        let mut writer = TableWriter::new(SIZE);
        writer
            .apply(&mut dp, &desired([1, 2, 1, 2, 1, 2, 1]))
            .unwrap();
        let active_base = dp.vips[&key(100)].table_base(SIZE);
        dp.log.clear();

        writer
            .apply(&mut dp, &desired([1, 3, 1, 3, 1, 3, 1]))
            .unwrap();
        let active_range = active_base..active_base + SIZE;
        // Every slot write lands outside the table packets are reading, and the switch
        // (the VIP update) comes after all of them.
        let switch_at = dp
            .log
            .iter()
            .position(|w| matches!(w, Write::Vip(..)))
            .unwrap();
        for (i, write) in dp.log.iter().enumerate() {
            if let Write::Slots(slots) = write {
                assert!(i < switch_at, "slots written after the switch");
                assert!(
                    slots.iter().all(|(s, _)| !active_range.contains(s)),
                    "{slots:?}"
                );
            }
        }
        assert_ne!(dp.vips[&key(100)].table_base(SIZE), active_base);
        assert_eq!(lookup(&dp, &key(100), 1), 3);
    }

    #[test]
    fn only_changed_slots_are_written() {
        let mut dp = MemoryDataplane::default();
        let mut writer = TableWriter::new(SIZE);
        writer
            .apply(&mut dp, &desired([1, 2, 1, 2, 1, 2, 1]))
            .unwrap();
        writer
            .apply(&mut dp, &desired([1, 2, 1, 2, 1, 2, 2]))
            .unwrap();
        // Generation 0 holds the first table; changing one slot back writes one slot.
        let report = writer
            .apply(&mut dp, &desired([1, 2, 1, 2, 1, 2, 1]))
            .unwrap();
        assert_eq!(
            report.slots_written, 0,
            "generation 0 already holds this table"
        );
        assert_eq!(report.tables_switched, 1);
        // Generation 1 holds [.., 2, 2]: only slot 5 differs from the new table.
        let report = writer
            .apply(&mut dp, &desired([1, 2, 1, 2, 1, 1, 2]))
            .unwrap();
        assert_eq!(report.slots_written, 1);
        assert_eq!(lookup(&dp, &key(100), 5), 1);
        assert_eq!(lookup(&dp, &key(100), 6), 2);
    }

    #[test]
    fn removed_backends_stop_serving_flows() {
        let mut dp = MemoryDataplane::default();
        let mut writer = TableWriter::new(SIZE);
        writer
            .apply(&mut dp, &desired([1, 2, 1, 2, 1, 2, 1]))
            .unwrap();
        writer.apply(&mut dp, &desired([1; 7])).unwrap();
        assert_eq!(
            dp.backends[&2].flags, 0,
            "entries naming backend 2 must be re-hashed"
        );
        assert_eq!(dp.backends[&1].flags, lb_common::BACKEND_F_SERVES_FLOWS);
    }

    #[test]
    fn a_vip_moved_to_another_address_never_gets_a_write_into_its_live_table() {
        let mut dp = MemoryDataplane::default();
        let mut writer = TableWriter::new(SIZE);
        writer
            .apply(&mut dp, &desired([1, 2, 1, 2, 1, 2, 1]))
            .unwrap();
        writer
            .apply(&mut dp, &desired([1, 1, 1, 2, 2, 2, 1]))
            .unwrap();
        // Same vip id, new key (the address changed on reload).
        let mut moved = desired([1, 1, 1, 2, 2, 2, 1]);
        moved.vips[0].key = key(101);
        writer.apply(&mut dp, &moved).unwrap();
        assert!(!dp.vips.contains_key(&key(100)));
        let live = dp.vips[&key(101)].table_base(SIZE);
        dp.log.clear();
        let mut changed = desired([2, 2, 2, 2, 2, 2, 1]);
        changed.vips[0].key = key(101);
        writer.apply(&mut dp, &changed).unwrap();
        for write in &dp.log {
            if let Write::Slots(slots) = write {
                assert!(
                    slots.iter().all(|(s, _)| !(live..live + SIZE).contains(s)),
                    "{slots:?}"
                );
            }
        }
        assert_eq!(lookup(&dp, &key(101), 0), 2);
    }

    #[test]
    fn new_ids_start_their_counters_from_zero() {
        let mut dp = MemoryDataplane::default();
        let mut writer = TableWriter::new(SIZE);
        writer
            .apply(&mut dp, &desired([1, 2, 1, 2, 1, 2, 1]))
            .unwrap();
        let resets: Vec<&Write> = dp
            .log
            .iter()
            .filter(|w| matches!(w, Write::ResetBackend(_) | Write::ResetVip(_)))
            .collect();
        assert_eq!(
            resets,
            [
                &Write::ResetBackend(1),
                &Write::ResetBackend(2),
                &Write::ResetVip(3)
            ]
        );
        dp.log.clear();
        writer
            .apply(&mut dp, &desired([1, 1, 1, 2, 2, 2, 1]))
            .unwrap();
        assert!(
            !dp.log
                .iter()
                .any(|w| matches!(w, Write::ResetBackend(_) | Write::ResetVip(_))),
            "known ids keep counting"
        );
    }

    #[test]
    fn removed_vips_leave_the_map() {
        let mut dp = MemoryDataplane::default();
        let mut writer = TableWriter::new(SIZE);
        writer.apply(&mut dp, &desired([1; 7])).unwrap();
        let report = writer.apply(&mut dp, &Desired::default()).unwrap();
        assert_eq!(report.vips_removed, 1);
        assert!(dp.vips.is_empty());
    }

    /// `LB_HOT_SRC` is written by the writer like every other map: it is made to hold
    /// the desired hot sources, starting from what it held (a previous agent's).
    #[test]
    fn hot_sources_follow_the_desired_set() {
        let source = |last: u8| {
            let (addr, family) = lb_common::addr::to_map([10, 0, 0, last].into());
            SourceKey::new(3, addr, family)
        };
        let mut dataplane = MemoryDataplane::default();
        dataplane.hot_sources.insert(source(9));
        let mut writer = TableWriter::new(SIZE);
        let mut wanted = desired([1; 7]);
        wanted.hot_sources = [source(1), source(2)].into();
        writer.apply(&mut dataplane, &wanted).unwrap();
        assert_eq!(dataplane.hot_sources, [source(1), source(2)].into());
        wanted.hot_sources = [source(2)].into();
        writer.apply(&mut dataplane, &wanted).unwrap();
        assert_eq!(dataplane.hot_sources, [source(2)].into());
    }

    #[test]
    fn quic_ids_follow_the_desired_map() {
        let mut dp = MemoryDataplane::default();
        let mut writer = TableWriter::new(SIZE);
        let mut want = desired([1; 7]);
        let id = |n| lb_common::quic::ServerKey::of_config(3, n, 2);
        // A stale ID left in the map (read back first) goes.
        dp.quic_ids.insert(id(99), 1);
        want.quic_ids = [(id(7), 1), (id(8), 2)].into();
        writer.apply(&mut dp, &want).unwrap();
        assert_eq!(dp.quic_ids, want.quic_ids);
        want.quic_ids = [(id(7), 2)].into();
        writer.apply(&mut dp, &want).unwrap();
        assert_eq!(dp.quic_ids, want.quic_ids);
    }
}
