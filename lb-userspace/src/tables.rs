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
//!
//! A VIP with `stable_slots` (`VIP_F_STABLE`) gets slot words (`lb_common::slot`), not
//! plain ids: the writer remembers which slots a table change moved (`StableSlots`) and
//! writes each as changed, naming the backend it had, until `stabilize` finds that no
//! live flow needs it to be and turns it stable in place.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lb_common::{
    BACKEND_NONE, BackendIdentity, BackendInfo, FlowEntry, FlowKey, SourceKey, TABLE_GENERATIONS,
    TunnelConfig, VIP_F_STABLE, VipInfo, VipKey, flow,
    maglev::{MaglevBackend, build_table},
    quic::ServerKey,
    slot::{self, Slot},
    table_place,
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

/// A slot a table change moved, until `stabilize` turns it stable again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Mark {
    /// The backend of the slot's last stable era: where its flows without an entry go.
    previous: u32,
    /// When a change last moved the slot: it may turn stable a bound after.
    since: Instant,
}

/// A `stable_slots` VIP's slots as this writer wrote them last: the table (backend ids)
/// and which slots a change moved.
#[derive(Clone, Debug)]
struct StableSlots {
    plain: Vec<u32>,
    marks: Vec<Option<Mark>>,
}

impl StableSlots {
    /// A VIP with no live table: no flow of it has an entry, every slot is stable.
    fn fresh(table: &[u32]) -> Self {
        Self {
            plain: table.to_vec(),
            marks: vec![None; table.len()],
        }
    }

    /// A VIP that turns stable over a live table (adopted from an older agent, or written
    /// without the flag): every flow in it may hold an entry that the stable path would
    /// not read, so every slot starts changed, naming its backend (or the previous
    /// backend an adopted word names already). A slot with no backend has none to name.
    fn over_live(live: &[Slot], now: Instant) -> Self {
        Self {
            plain: live.iter().map(|slot| slot.backend_id).collect(),
            marks: live
                .iter()
                .map(|slot| {
                    let previous = slot.previous.unwrap_or(slot.backend_id);
                    (previous != BACKEND_NONE).then_some(Mark {
                        previous,
                        since: now,
                    })
                })
                .collect(),
        }
    }

    /// Follows a new table: a moved stable slot turns changed, naming the backend it had
    /// (one that had none stays stable: no flow of it has a backend to keep); a moved
    /// changed slot keeps the backend it names and waits its bound again.
    fn follow(&mut self, table: &[u32], now: Instant) {
        for (slot, &id) in table.iter().enumerate() {
            let old = self.plain[slot];
            if id == old {
                continue;
            }
            match &mut self.marks[slot] {
                Some(mark) => mark.since = now,
                None if old != BACKEND_NONE => {
                    self.marks[slot] = Some(Mark {
                        previous: old,
                        since: now,
                    })
                }
                None => {}
            }
            self.plain[slot] = id;
        }
    }

    /// What slot `slot` holds in `LB_MAGLEV`.
    fn word(&self, slot: usize) -> u32 {
        slot::word(Slot {
            backend_id: self.plain[slot],
            previous: self.marks[slot].map(|mark| mark.previous),
        })
    }

    fn words(&self) -> Vec<u32> {
        (0..self.plain.len()).map(|slot| self.word(slot)).collect()
    }

    /// The changed slots no table change moved for `bound` before `at`.
    fn due(&self, at: Instant, bound: Duration) -> impl Iterator<Item = usize> + '_ {
        self.marks
            .iter()
            .enumerate()
            .filter_map(move |(slot, mark)| mark.filter(|m| m.since + bound <= at).map(|_| slot))
    }
}

/// The slot words of each `stable_slots` VIP (by vip id) as the table writer last wrote
/// them: status counts their changed slots and `lb explain` reads a flow's, neither
/// waiting for the writer.
#[derive(Debug, Default)]
pub struct SlotWords(Mutex<HashMap<u32, Arc<Vec<u32>>>>);

impl SlotWords {
    /// The words of VIP `vip_id`'s live table; None for a VIP without `stable_slots`.
    pub fn of(&self, vip_id: u32) -> Option<Arc<Vec<u32>>> {
        let words = self.0.lock().expect("slot words poisoned");
        words.get(&vip_id).cloned()
    }

    /// How many slots of VIP `vip_id` are changed (0 for a VIP without `stable_slots`).
    pub fn changed(&self, vip_id: u32) -> usize {
        self.of(vip_id).map_or(0, |words| {
            let changed = |word: &&u32| slot::read(**word, VIP_F_STABLE).previous.is_some();
            words.iter().filter(changed).count()
        })
    }

    fn set(&self, words: HashMap<u32, Arc<Vec<u32>>>) {
        *self.0.lock().expect("slot words poisoned") = words;
    }
}

/// Remembers what was written, so the next `apply` writes only differences.
#[derive(Debug)]
pub struct TableWriter {
    table_size: u32,
    /// By vip id: kept after a VIP is removed, so a reused id knows its slots' contents.
    tables: HashMap<u32, VipTables>,
    /// By vip id: the slots of the VIPs with `VIP_F_STABLE`.
    stable: HashMap<u32, StableSlots>,
    /// Their words, for status and `lb explain`.
    words: Arc<SlotWords>,
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
            stable: HashMap::new(),
            words: Arc::default(),
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

    /// The words of each `stable_slots` VIP, kept up to date by every `apply` and
    /// `stabilize`.
    pub fn slot_words(&self) -> Arc<SlotWords> {
        self.words.clone()
    }

    /// Makes the data path hold `desired`, now.
    pub fn apply<D: Dataplane + ?Sized>(
        &mut self,
        dataplane: &mut D,
        desired: &Desired,
    ) -> Result<ApplyReport, DataplaneError> {
        self.apply_at(dataplane, desired, Instant::now())
    }

    /// `apply`, with `now` the time a slot moved by this table is marked with.
    pub fn apply_at<D: Dataplane + ?Sized>(
        &mut self,
        dataplane: &mut D,
        desired: &Desired,
        now: Instant,
    ) -> Result<ApplyReport, DataplaneError> {
        let applied = self.write_all(dataplane, desired, now);
        // Marks change before the writes that may fail: status follows them either way.
        self.publish_words();
        applied
    }

    fn write_all<D: Dataplane + ?Sized>(
        &mut self,
        dataplane: &mut D,
        desired: &Desired,
        now: Instant,
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
        self.write_vips(dataplane, desired, now, &mut report)?;
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
        now: Instant,
        report: &mut ApplyReport,
    ) -> Result<(), DataplaneError> {
        for vip in &desired.vips {
            assert_eq!(
                vip.table.len(),
                self.table_size as usize,
                "table of the wrong size"
            );
            let words = self.words_of(vip, now);
            let tables = self.tables.entry(vip.vip_id).or_default();
            let generation = write_table(
                dataplane,
                tables,
                (vip.vip_id, self.table_size),
                words,
                report,
            )?;
            let info = VipInfo {
                vip_id: vip.vip_id,
                generation,
                flags: vip.flags,
                _pad: 0,
            };
            if !self.vips.values().any(|v| v.vip_id == vip.vip_id) {
                dataplane.reset_vip_counters(vip.vip_id)?;
            }
            // After the words of the new generation: a packet reads the new flags only
            // with the words written for them.
            if self.vips.get(&vip.key) != Some(&info) {
                dataplane.set_vip(&vip.key, &info)?;
                self.vips.insert(vip.key, info);
            }
            tables.active = Some(generation);
        }

        Ok(())
    }

    /// What `vip`'s slots should hold: its table's backend ids, or for a VIP with
    /// `VIP_F_STABLE` its slot words, following the moves since the last table.
    fn words_of(&mut self, vip: &DesiredVip, now: Instant) -> Vec<u32> {
        if vip.flags & VIP_F_STABLE == 0 {
            self.stable.remove(&vip.vip_id);
            return vip.table.clone();
        }
        if !self.stable.contains_key(&vip.vip_id) {
            let start = match self.live_slots(vip.vip_id, &vip.table) {
                Some(live) => StableSlots::over_live(&live, now),
                None => StableSlots::fresh(&vip.table),
            };
            self.stable.insert(vip.vip_id, start);
        }
        let slots = self.stable.get_mut(&vip.vip_id).expect("inserted above");
        slots.follow(&vip.table, now);
        slots.words()
    }

    /// What the slots of the table VIP `vip_id` points at say, read with the flags it was
    /// written for; None for a VIP without a live table. Where its contents are not known
    /// (a write that failed), each slot is taken as holding `table`'s backend.
    fn live_slots(&self, vip_id: u32, table: &[u32]) -> Option<Vec<Slot>> {
        let active = self.tables.get(&vip_id)?.active?;
        let flags = self
            .vips
            .values()
            .find(|info| info.vip_id == vip_id)
            .map_or(0, |info| info.flags);
        let words = self.tables[&vip_id].contents[active as usize].as_ref();
        Some(match words {
            Some(words) => words.iter().map(|&word| slot::read(word, flags)).collect(),
            None => table.iter().map(|&id| Slot::stable(id)).collect(),
        })
    }

    /// Whether a changed slot has waited `bound` by `at`: a scan of the connection table
    /// for `stabilize` would be worth making.
    pub fn stabilize_due(&self, at: Instant, bound: Duration) -> bool {
        self.stable
            .values()
            .any(|slots| slots.due(at, bound).next().is_some())
    }

    /// Turns stable each changed slot that no table change moved for `bound` before
    /// `scanned` and where no live entry of `flows` names another backend than the
    /// slot's: one word written in place in the live table. `flows` is the connection
    /// table as read from `scanned` on (`scanned_ns` on the data path's clock); an entry
    /// is live if seen within `bound` of that. Returns how many slots of which VIP turned
    /// stable.
    ///
    /// An entry the scan cannot have seen was made after `scanned`, in a slot no change
    /// had moved for `bound` by then: by a new flow (it names the table's backend), or by
    /// one that came back to the previous backend after idling across the move, the
    /// flows `stable_slots` may move.
    pub fn stabilize<D: Dataplane + ?Sized>(
        &mut self,
        dataplane: &mut D,
        flows: &[(FlowKey, FlowEntry)],
        scanned: (Instant, u64),
        bound: Duration,
    ) -> Result<Vec<(VipKey, usize)>, DataplaneError> {
        let turned = self.stabilize_slots(dataplane, flows, scanned, bound);
        self.publish_words();
        turned
    }

    fn stabilize_slots<D: Dataplane + ?Sized>(
        &mut self,
        dataplane: &mut D,
        flows: &[(FlowKey, FlowEntry)],
        (scanned, scanned_ns): (Instant, u64),
        bound: Duration,
    ) -> Result<Vec<(VipKey, usize)>, DataplaneError> {
        let mut due: HashMap<VipKey, (u32, HashSet<usize>)> = self
            .stable
            .iter()
            .filter_map(|(&vip_id, slots)| {
                let key = self.live_stable_key(vip_id)?;
                let due: HashSet<usize> = slots.due(scanned, bound).collect();
                (!due.is_empty()).then_some((key, (vip_id, due)))
            })
            .collect();
        let bound_ns = bound.as_nanos() as u64;
        for (key, entry) in flows {
            let vip = key.vip_key();
            let Some((vip_id, slots)) = due.get_mut(&vip) else {
                continue;
            };
            if flow::age(entry, scanned_ns) >= bound_ns {
                continue;
            }
            // The slot the program hashes the flow to (no hot sources: `stable_slots`
            // refuses them).
            let flags = self.vips[&vip].flags;
            let (_, slot, _) = table_place(&key.tuple(), flags, self.table_size, || false);
            if entry.backend_id != self.stable[vip_id].plain[slot as usize] {
                slots.remove(&(slot as usize));
            }
        }
        let mut turned = Vec::new();
        for (key, (vip_id, slots)) in due {
            if !slots.is_empty() {
                self.turn_stable(dataplane, vip_id, &slots)?;
                turned.push((key, slots.len()));
            }
        }
        Ok(turned)
    }

    /// The key of stable VIP `vip_id` if the table it points at holds the words its marks
    /// describe (not so after a failed write: the next `apply` writes them first).
    fn live_stable_key(&self, vip_id: u32) -> Option<VipKey> {
        let active = self.tables.get(&vip_id)?.active?;
        let (key, info) = self.vips.iter().find(|(_, v)| v.vip_id == vip_id)?;
        let words = self.tables[&vip_id].contents[active as usize].as_ref()?;
        let holds = info.generation == active
            && info.flags & VIP_F_STABLE != 0
            && *words == self.stable.get(&vip_id)?.words();
        holds.then_some(*key)
    }

    /// Turns `slots` of stable VIP `vip_id` stable: their words in the live table, in
    /// place (a packet reads the old word or the new one), and the record of it.
    fn turn_stable<D: Dataplane + ?Sized>(
        &mut self,
        dataplane: &mut D,
        vip_id: u32,
        slots: &HashSet<usize>,
    ) -> Result<(), DataplaneError> {
        let tables = self.tables.get_mut(&vip_id).expect("a live stable VIP");
        let active = tables.active.expect("a live stable VIP");
        let base = VipInfo::table_base_for(vip_id, active, self.table_size);
        let stable = self.stable.get_mut(&vip_id).expect("a stable VIP");
        let changes: Vec<(u32, u32)> = slots
            .iter()
            .map(|&slot| {
                stable.marks[slot] = None;
                (base + slot as u32, stable.word(slot))
            })
            .collect();
        // Unknown until written (`live_stable_key` then skips the VIP until an apply).
        let mut words = tables.contents[active as usize].take();
        dataplane.write_slots(&changes)?;
        if let Some(words) = &mut words {
            for &(at, word) in &changes {
                words[(at - base) as usize] = word;
            }
        }
        tables.contents[active as usize] = words;
        Ok(())
    }

    /// Publishes the words of every stable VIP, for status and `lb explain`.
    fn publish_words(&self) {
        let words = self
            .stable
            .iter()
            .map(|(&vip_id, slots)| (vip_id, Arc::new(slots.words())))
            .collect();
        self.words.set(words);
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
                // Its flows went with it: a VIP that takes the id later starts stable.
                self.stable.remove(&info.vip_id);
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

/// Writes `words` into the VIP's generation no packet reads (only the slots that differ
/// from what it holds), unless the live one holds them already; returns the generation
/// the VIP is to point at.
fn write_table<D: Dataplane + ?Sized>(
    dataplane: &mut D,
    tables: &mut VipTables,
    (vip_id, table_size): (u32, u32),
    words: Vec<u32>,
    report: &mut ApplyReport,
) -> Result<u32, DataplaneError> {
    let live = tables
        .active
        .filter(|&g| tables.contents[g as usize].as_ref() == Some(&words));
    if let Some(live) = live {
        return Ok(live);
    }
    let target = tables.active.map_or(0, |g| (g + 1) % TABLE_GENERATIONS);
    let base = VipInfo::table_base_for(vip_id, target, table_size);
    let previous = tables.contents[target as usize].as_deref();
    let changes: Vec<(u32, u32)> = words
        .iter()
        .enumerate()
        .filter(|(slot, word)| previous.is_none_or(|p| p[*slot] != **word))
        .map(|(slot, &word)| (base + slot as u32, word))
        .collect();
    // Unknown until the write completes: a failed write must not leave later diffs
    // trusting slots it may not have reached.
    tables.contents[target as usize] = None;
    // A packet that read the VIP's entry just before the last switch may still be reading
    // this generation: let it finish (XDP runs in microseconds) before overwriting it.
    if let Some(switched) = tables.switched_at {
        let grace = Duration::from_millis(1);
        if let Some(rest) = grace.checked_sub(switched.elapsed()) {
            std::thread::sleep(rest);
        }
    }
    dataplane.write_slots(&changes)?;
    tables.switched_at = Some(Instant::now());
    report.slots_written += changes.len();
    report.tables_switched += 1;
    tables.contents[target as usize] = Some(words);
    Ok(target)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dataplane::{MemoryDataplane, Write};

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

    /// What a restarted agent adopts of `dp`, which a first agent wrote `want` into: the
    /// VIP, the backends and the live table (VIP id 3).
    fn adopted_from(dp: &MemoryDataplane, want: &Desired) -> crate::dataplane::Adopted {
        let live = (0..SIZE).map(|slot| lookup(dp, &key(100), slot)).collect();
        crate::dataplane::Adopted {
            vips: vec![(key(100), dp.vips[&key(100)])],
            backends: want
                .backends
                .iter()
                .map(|(id, b)| (*id, b.info, b.identity))
                .collect(),
            tables: vec![(3, live)],
            ..Default::default()
        }
    }

    #[test]
    fn an_adopting_writer_writes_only_what_differs_from_the_maps() {
        // A first agent writes its tables; a restarted one adopts what the maps hold.
        let mut dp = MemoryDataplane::default();
        let want = desired([1, 2, 1, 2, 1, 2, 1]);
        TableWriter::new(SIZE).apply(&mut dp, &want).unwrap();
        let adopted = adopted_from(&dp, &want);
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
        assert_ne!(dp.vips[&key(100)].generation, adopted.vips[0].1.generation);
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

    /// `desired`, the VIP with `stable_slots`.
    fn stable(table: [u32; 7]) -> Desired {
        let mut want = desired(table);
        want.vips[0].flags = VIP_F_STABLE;
        want
    }

    /// What `slot` of the live table says, read as the program reads it.
    fn slot_of(dp: &MemoryDataplane, slot: u32) -> Slot {
        slot::read(lookup(dp, &key(100), slot), dp.vips[&key(100)].flags)
    }

    fn changed(previous: u32, backend_id: u32) -> Slot {
        Slot {
            backend_id,
            previous: Some(previous),
        }
    }

    const BOUND: Duration = Duration::from_secs(10);
    /// The data path's clock when the tests' scans begin.
    const SCAN_NS: u64 = 1_000_000_000_000;

    /// A connection-table entry of a flow to the VIP that hashes to `slot`, naming
    /// `backend_id`, last seen `idle` before `SCAN_NS`.
    fn flow_in(slot: u32, backend_id: u32, idle: Duration) -> (FlowKey, FlowEntry) {
        let vip = std::net::SocketAddr::from(([10, 0, 0, 100], 80));
        let key = (1024..)
            .map(|port| {
                let client = std::net::SocketAddr::from(([192, 0, 2, 1], port));
                FlowKey::between(client, vip, lb_common::PROTO_TCP)
            })
            .find(|key| table_place(&key.tuple(), VIP_F_STABLE, SIZE, || false).1 == slot)
            .unwrap();
        let entry = FlowEntry {
            backend_id,
            flags: 0,
            last_seen_ns: SCAN_NS - idle.as_nanos() as u64,
        };
        (key, entry)
    }

    /// A writer that wrote the stable VIP with every slot on backend 1, at the instant
    /// returned: every slot stable.
    fn all_on_one() -> (MemoryDataplane, TableWriter, Instant) {
        let mut dp = MemoryDataplane::default();
        let mut writer = TableWriter::new(SIZE);
        let t0 = Instant::now();
        writer.apply_at(&mut dp, &stable([1; 7]), t0).unwrap();
        (dp, writer, t0)
    }

    #[test]
    fn a_fresh_stable_vip_writes_plain_ids_with_every_slot_stable() {
        let mut dp = MemoryDataplane::default();
        let mut writer = TableWriter::new(SIZE);
        let want = stable([1, 2, 1, 2, BACKEND_NONE, 2, 1]);
        writer.apply(&mut dp, &want).unwrap();
        assert_ne!(dp.vips[&key(100)].flags & VIP_F_STABLE, 0);
        for slot in 0..SIZE {
            let id = want.vips[0].table[slot as usize];
            assert_eq!(slot_of(&dp, slot), Slot::stable(id));
        }
        assert_eq!(
            lookup(&dp, &key(100), 0),
            1,
            "a stable slot's word is the id"
        );
        assert_eq!(writer.slot_words().changed(3), 0);
        assert!(!writer.stabilize_due(Instant::now() + BOUND * 2, BOUND));
    }

    #[test]
    fn a_moved_slot_turns_changed_naming_its_stable_backend() {
        let mut dp = MemoryDataplane::default();
        let mut writer = TableWriter::new(SIZE);
        let t0 = Instant::now();
        writer
            .apply_at(&mut dp, &stable([1, 2, 1, 2, BACKEND_NONE, 2, 1]), t0)
            .unwrap();
        let first = dp.vips[&key(100)].generation;
        writer
            .apply_at(&mut dp, &stable([1, 2, 1, 2, 3, 3, 3]), t0)
            .unwrap();
        assert_ne!(dp.vips[&key(100)].generation, first, "a new generation");
        for slot in 0..4 {
            assert_eq!(
                slot_of(&dp, slot),
                Slot::stable([1, 2, 1, 2][slot as usize])
            );
        }
        // A slot that had no backend has no flow to keep: it stays stable.
        assert_eq!(slot_of(&dp, 4), Slot::stable(3));
        assert_eq!(slot_of(&dp, 5), changed(2, 3));
        assert_eq!(slot_of(&dp, 6), changed(1, 3));
        assert_eq!(writer.slot_words().changed(3), 2);
    }

    #[test]
    fn a_changed_slot_moved_again_keeps_naming_its_stable_backend() {
        let (mut dp, mut writer, t0) = all_on_one();
        writer
            .apply_at(&mut dp, &stable([1, 1, 1, 1, 1, 1, 2]), t0)
            .unwrap();
        // Moved again, and back: flows without an entry still go to backend 1.
        writer
            .apply_at(&mut dp, &stable([1, 1, 1, 1, 1, 1, 3]), t0 + BOUND)
            .unwrap();
        assert_eq!(slot_of(&dp, 6), changed(1, 3));
        writer
            .apply_at(&mut dp, &stable([1; 7]), t0 + BOUND)
            .unwrap();
        assert_eq!(slot_of(&dp, 6), changed(1, 1));
        // The last move restarted its wait.
        assert!(!writer.stabilize_due(t0 + BOUND * 2 - Duration::from_millis(1), BOUND));
        assert!(writer.stabilize_due(t0 + BOUND * 2, BOUND));
    }

    #[test]
    fn a_changed_slot_stays_changed_until_it_waited_the_bound() {
        let (mut dp, mut writer, t0) = all_on_one();
        writer
            .apply_at(&mut dp, &stable([1, 1, 1, 1, 1, 2, 2]), t0)
            .unwrap();
        let early = t0 + BOUND - Duration::from_millis(1);
        assert!(!writer.stabilize_due(early, BOUND));
        dp.log.clear();
        let turned = writer
            .stabilize(&mut dp, &[], (early, SCAN_NS), BOUND)
            .unwrap();
        assert_eq!(turned, []);
        assert!(dp.log.is_empty(), "{:?}", dp.log);
        assert_eq!(slot_of(&dp, 5), changed(1, 2));
        assert_eq!(writer.slot_words().changed(3), 2);
    }

    #[test]
    fn a_scan_after_the_bound_turns_stable_the_slots_no_live_entry_holds() {
        let (mut dp, mut writer, t0) = all_on_one();
        let want = stable([1, 1, 1, 1, 2, 2, 2]);
        writer.apply_at(&mut dp, &want, t0).unwrap();
        let live = dp.vips[&key(100)];
        let flows = [
            // A live flow on the previous backend holds slot 4.
            flow_in(4, 1, Duration::from_secs(1)),
            // One idle past the bound does not hold slot 5.
            flow_in(5, 1, BOUND + Duration::from_secs(1)),
            // Nor does a live one on the table's own backend hold slot 6.
            flow_in(6, 2, Duration::ZERO),
        ];
        let scanned = t0 + BOUND;
        assert!(writer.stabilize_due(scanned, BOUND));
        dp.log.clear();
        let turned = writer
            .stabilize(&mut dp, &flows, (scanned, SCAN_NS), BOUND)
            .unwrap();
        assert_eq!(turned, [(key(100), 2)]);
        // In place, in the live table, with no switch.
        let base = live.table_base(SIZE);
        let [Write::Slots(written)] = &dp.log[..] else {
            panic!("one write of slots: {:?}", dp.log);
        };
        let mut written = written.clone();
        written.sort();
        assert_eq!(written, [(base + 5, 2), (base + 6, 2)]);
        assert_eq!(dp.vips[&key(100)], live);
        assert_eq!(slot_of(&dp, 4), changed(1, 2));
        assert_eq!(slot_of(&dp, 5), Slot::stable(2));
        assert_eq!(slot_of(&dp, 6), Slot::stable(2));
        assert_eq!(writer.slot_words().changed(3), 1);
        // The writer's record follows: the same table again writes nothing.
        assert_eq!(
            writer.apply_at(&mut dp, &want, scanned).unwrap(),
            ApplyReport::default()
        );
        // Once the flow holding slot 4 idles past the bound, it turns stable too.
        let later = (scanned + BOUND, SCAN_NS + BOUND.as_nanos() as u64);
        let turned = writer.stabilize(&mut dp, &flows, later, BOUND).unwrap();
        assert_eq!(turned, [(key(100), 1)]);
        assert_eq!(slot_of(&dp, 4), Slot::stable(2));
        assert!(!writer.stabilize_due(later.0 + BOUND, BOUND));
    }

    #[test]
    fn an_adopted_table_of_a_stable_vip_starts_with_every_slot_changed() {
        // A first agent writes a stable VIP whose slot 6 a change moved.
        let mut dp = MemoryDataplane::default();
        let t0 = Instant::now();
        let mut first = TableWriter::new(SIZE);
        first
            .apply_at(&mut dp, &stable([1, 2, 1, 2, 1, 2, 1]), t0)
            .unwrap();
        let want = stable([1, 2, 1, 2, 1, 2, 2]);
        first.apply_at(&mut dp, &want, t0).unwrap();
        let adopted = adopted_from(&dp, &want);
        // A restarted agent cannot know since when: every slot waits a whole bound.
        let mut writer = TableWriter::new(SIZE);
        writer.adopt(&adopted);
        let restarted = t0 + BOUND;
        writer.apply_at(&mut dp, &want, restarted).unwrap();
        for slot in 0..6 {
            let id = want.vips[0].table[slot as usize];
            assert_eq!(slot_of(&dp, slot), changed(id, id));
        }
        assert_eq!(slot_of(&dp, 6), changed(1, 2), "its previous backend kept");
        assert_eq!(writer.slot_words().changed(3), 7);
        assert!(!writer.stabilize_due(restarted + BOUND / 2, BOUND));
        assert!(writer.stabilize_due(restarted + BOUND, BOUND));
    }

    #[test]
    fn a_vip_that_turns_stable_over_its_live_table_starts_with_every_slot_changed() {
        // Without the flag every flow has an entry, which the stable path would not read.
        let mut dp = MemoryDataplane::default();
        let mut writer = TableWriter::new(SIZE);
        writer
            .apply(&mut dp, &desired([1, 2, 1, 2, BACKEND_NONE, 2, 1]))
            .unwrap();
        dp.log.clear();
        let want = stable([1, 2, 1, 2, BACKEND_NONE, 2, 2]);
        writer.apply(&mut dp, &want).unwrap();
        for slot in [0, 1, 2, 3, 5] {
            let id = want.vips[0].table[slot as usize];
            assert_eq!(slot_of(&dp, slot), changed(id, id));
        }
        assert_eq!(slot_of(&dp, 4), Slot::stable(BACKEND_NONE));
        assert_eq!(slot_of(&dp, 6), changed(1, 2));
        assert_eq!(writer.slot_words().changed(3), 6);
        // The words first, then the flag that says how to read them.
        assert!(
            matches!(dp.log[..], [Write::Slots(_), Write::Vip(..)]),
            "{:?}",
            dp.log
        );
    }

    #[test]
    fn removing_stable_slots_writes_plain_ids_again() {
        let mut dp = MemoryDataplane::default();
        let mut writer = TableWriter::new(SIZE);
        writer
            .apply(&mut dp, &stable([1, 2, 1, 2, BACKEND_NONE, 2, 1]))
            .unwrap();
        writer
            .apply(&mut dp, &stable([1, 2, 1, 2, BACKEND_NONE, 2, 2]))
            .unwrap();
        dp.log.clear();
        let plain = desired([1, 2, 1, 2, BACKEND_NONE, 2, 2]);
        let report = writer.apply(&mut dp, &plain).unwrap();
        assert_eq!(report.tables_switched, 1);
        assert_eq!(dp.vips[&key(100)].flags & VIP_F_STABLE, 0);
        for slot in 0..SIZE {
            assert_eq!(
                lookup(&dp, &key(100), slot),
                plain.vips[0].table[slot as usize]
            );
        }
        assert!(
            matches!(dp.log[..], [Write::Slots(_), Write::Vip(..)]),
            "{:?}",
            dp.log
        );
        assert_eq!(writer.slot_words().changed(3), 0);
        assert!(!writer.stabilize_due(Instant::now() + BOUND * 2, BOUND));
    }
}
