//! The table writer: the one owner of the data path's writes. Every bpf(2) write the
//! agent makes after its start goes through `TableWrites`, whose one implementation
//! (`DataplaneWrites`) lives in the writer's thread: the Maglev tables, backends, QUIC
//! ids and tunnel settings, the hot sources (`LB_HOT_SRC`), the next program's slot and
//! the entries learnt from cluster peers. The controller (`state`) computes what the
//! tables should be (`TableInputs`) and hands them over; nothing else writes a map.
//! Reads go through their own handles, not through this side: counters through the
//! `CounterReader` (no lock the writer holds), flows through a `FlowReader` (as Cilium
//! splits its LBMaps into a read side and a write side).
//!
//! Changes (a reload, a runtime command, a health change, a MAC learnt) hand it the
//! model's `TableInputs` and go on; the thread builds the Maglev tables and writes them,
//! off the agent's lock and off the async workers. Requests that arrive while it works
//! replace each other, so a flapping backend costs one rebuild per write, not a queue of
//! them. Each request gets a ticket; `wait` resolves once a write that includes it is
//! done, for callers that answer only after the data path follows (control commands,
//! reload). Writes that cannot be coalesced (a peer's entries, the next program, turning
//! changed slots stable) are run in the same thread in the order asked (`Writer::exec`,
//! `Imports`, `Stabilizer`).
//!
//! Owns the write side of the data path; may call `tables` (build and diff) and
//! `dataplane` (the maps).

use std::{
    collections::VecDeque,
    sync::{Arc, Condvar, Mutex, MutexGuard},
    thread::JoinHandle,
    time::{Duration, Instant},
};

use lb_common::{FlowEntry, FlowKey, VipKey};
use tokio::sync::watch;

use crate::{
    dataplane::{
        CounterReader, Dataplane, DataplaneError, FlowLookups, FlowWriter, next::NextProgram,
    },
    tables::{ApplyReport, Desired, SlotWords, TableBuilder, TableInputs, TableWriter},
};

/// The data path as the agent holds it: reads that have no handle of their own (explain's
/// lookups, attaching again) take this lock briefly; the writer's thread takes it for a
/// write.
pub type SharedDataplane = Arc<Mutex<Box<dyn Dataplane + Send>>>;

/// The data path's write side. One implementation writes the maps (`DataplaneWrites`);
/// unit tests give a fake that records what the controller asked for.
pub trait TableWrites: Send {
    /// Makes the data path hold `desired`: backends, each VIP's table (switched, never
    /// half-written), the hot sources, the QUIC ids and the tunnel settings.
    fn write_tables(&mut self, desired: &Desired) -> Result<ApplyReport, DataplaneError>;
    /// Inserts a cluster peer's connection-table entries where the flow has none here;
    /// returns how many went in.
    fn import_flows(&mut self, flows: &[(FlowKey, FlowEntry)]) -> Result<u64, DataplaneError>;
    /// Puts `next` in the slot lb tail-calls (None: empties it); returns the id that was
    /// there.
    fn set_next_program(
        &mut self,
        next: Option<&NextProgram>,
    ) -> Result<Option<u32>, DataplaneError>;
    /// `stable_slots`: whether a changed slot has waited `bound` by `at`, so a scan of the
    /// connection table for `stabilize` is worth making (`TableWriter::stabilize_due`).
    fn stabilize_due(&self, at: Instant, bound: Duration) -> bool;
    /// Turns stable the changed slots that waited `bound` and that no live entry of
    /// `flows` (read from `scanned`: an instant and the data path's clock) holds; returns
    /// how many slots of which VIP (`TableWriter::stabilize`).
    fn stabilize(
        &mut self,
        flows: &[(FlowKey, FlowEntry)],
        scanned: (Instant, u64),
        bound: Duration,
    ) -> Result<Vec<(VipKey, usize)>, DataplaneError>;
}

/// The write side over a data path (the kernel's, or the in-memory one of unit tests).
pub struct DataplaneWrites {
    tables: TableWriter,
    dataplane: SharedDataplane,
    /// `[cluster]`: a handle of its own on the connection table, for the peers' entries.
    flows: Option<FlowWriter>,
}

impl TableWrites for DataplaneWrites {
    fn write_tables(&mut self, desired: &Desired) -> Result<ApplyReport, DataplaneError> {
        let mut dataplane = self.dataplane.lock().expect("data path poisoned");
        self.tables.apply(dataplane.as_mut(), desired)
    }

    fn import_flows(&mut self, flows: &[(FlowKey, FlowEntry)]) -> Result<u64, DataplaneError> {
        let Some(writer) = self.flows.as_mut() else {
            return Ok(0);
        };
        let mut inserted = 0;
        for (key, entry) in flows {
            match writer.insert_new(key, entry) {
                Ok(true) => inserted += 1,
                Ok(false) => {}
                // One entry refused (the table full of its own): the others still go in.
                Err(error) => tracing::debug!("cluster: inserting a learned entry: {error}"),
            }
        }
        Ok(inserted)
    }

    fn set_next_program(
        &mut self,
        next: Option<&NextProgram>,
    ) -> Result<Option<u32>, DataplaneError> {
        self.dataplane
            .lock()
            .expect("data path poisoned")
            .set_next_program(next)
    }

    fn stabilize_due(&self, at: Instant, bound: Duration) -> bool {
        self.tables.stabilize_due(at, bound)
    }

    fn stabilize(
        &mut self,
        flows: &[(FlowKey, FlowEntry)],
        scanned: (Instant, u64),
        bound: Duration,
    ) -> Result<Vec<(VipKey, usize)>, DataplaneError> {
        let mut dataplane = self.dataplane.lock().expect("data path poisoned");
        self.tables
            .stabilize(dataplane.as_mut(), flows, scanned, bound)
    }
}

/// Which request a write covered, and how it went.
#[derive(Clone, Debug)]
pub struct Written {
    /// The newest request this write covered (requests are numbered from 1).
    pub ticket: u64,
    /// What the data path holds since then.
    pub desired: Arc<Desired>,
    /// Why the write failed; the next request tries again.
    pub error: Option<String>,
    /// Writes done since the writer started (requests it coalesced count once).
    pub writes: u64,
}

/// A request to wait for.
pub struct Requested {
    ticket: u64,
    written: watch::Receiver<Written>,
}

impl Requested {
    /// Request `ticket`, to wait for on `written` (the writer's reports).
    pub fn of(ticket: u64, written: watch::Receiver<Written>) -> Self {
        Self { ticket, written }
    }

    /// Resolves once a write covering the request is done: Ok, or why it failed.
    pub async fn done(mut self) -> Result<(), WriteFailed> {
        let ticket = self.ticket;
        let done = self
            .written
            .wait_for(|w| w.ticket >= ticket)
            .await
            .map_err(|_| WriteFailed::Stopped)?;
        // A later request's write covers this one too (its inputs replaced ours).
        match &done.error {
            Some(error) => Err(WriteFailed::Write(error.clone())),
            None => Ok(()),
        }
    }
}

/// Why a requested table write is not done.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum WriteFailed {
    /// The writer stopped (the agent is stopping) before it wrote the request.
    #[error("the table writer stopped")]
    Stopped,
    /// The write failed (its report's error, with its causes); the next request tries
    /// again.
    #[error("{0}")]
    Write(String),
}

/// The handle the agent's state keeps.
pub struct Writer {
    inner: Arc<Inner>,
    dataplane: SharedDataplane,
    /// The counters' read side: handles of their own, no lock the writing side holds.
    counters: Arc<CounterReader>,
    /// Explain's lookups of one flow, on the read side as the counters.
    lookups: Arc<FlowLookups>,
    /// The slot words of `stable_slots` VIPs, as the write side keeps them.
    slot_words: Arc<SlotWords>,
    written: watch::Receiver<Written>,
    /// The writer's thread; None when it writes in the caller's (unit tests).
    thread: Option<JoinHandle<()>>,
}

/// The data path behind its lock, the counters' read side and explain's lookups.
type Reads = (SharedDataplane, Arc<CounterReader>, Arc<FlowLookups>);

/// A write that is run once, in order (not coalesced as table requests are).
type Op = Box<dyn FnOnce(&mut dyn TableWrites) + Send>;

struct Inner {
    pending: Mutex<Pending>,
    wake: Condvar,
    /// Unit tests: the work, run in the caller's thread (what a change wrote is there
    /// when it returns). Boxed: the work is large.
    inline: Option<Box<Mutex<Work>>>,
}

#[derive(Default)]
struct Pending {
    /// The newest inputs not yet written, and their ticket.
    next: Option<(u64, TableInputs)>,
    last_ticket: u64,
    /// Writes to run once each, in the order asked.
    ops: VecDeque<Op>,
    stop: bool,
}

/// What only the writing side touches.
struct Work {
    builder: TableBuilder,
    writes: Box<dyn TableWrites>,
    written: watch::Sender<Written>,
}

/// The writer stopped (the agent is stopping): the write was not made.
#[derive(Debug, thiserror::Error)]
#[error("the table writer stopped")]
pub struct WriterStopped;

impl Inner {
    /// Runs `op` on the write side, in the writer's thread, and waits for its result.
    fn exec<R: Send + 'static>(
        &self,
        op: impl FnOnce(&mut dyn TableWrites) -> R + Send + 'static,
    ) -> Result<R, WriterStopped> {
        if let Some(work) = &self.inline {
            let mut work = work.lock().expect("writer poisoned");
            return Ok(op(work.writes.as_mut()));
        }
        let (done, result) = std::sync::mpsc::sync_channel(1);
        {
            let mut pending = self.pending.lock().expect("writer queue poisoned");
            if pending.stop {
                return Err(WriterStopped);
            }
            pending
                .ops
                .push_back(Box::new(move |writes: &mut dyn TableWrites| {
                    let _ = done.send(op(writes));
                }));
        }
        self.wake.notify_one();
        result.recv().map_err(|_| WriterStopped)
    }
}

/// The cluster task's way to the write side: a peer's entries go into the connection
/// table through the writer, as every other data-path write.
#[derive(Clone)]
pub struct Imports(Arc<Inner>);

impl Imports {
    /// Inserts `flows` where the flow has no entry here; returns how many went in.
    /// Blocks until the writer's thread made the writes (behind a table write at most).
    pub fn import_flows(&self, flows: Vec<(FlowKey, FlowEntry)>) -> Result<u64, WriteFailed> {
        self.0
            .exec(move |writes| writes.import_flows(&flows))
            .map_err(|_| WriteFailed::Stopped)?
            .map_err(|error| WriteFailed::Write(error.to_string()))
    }
}

/// The agent's way to turn changed slots stable (`stable_slots`): asked on the writer's
/// thread, with the connection table read off it (it can be large).
#[derive(Clone)]
pub struct Stabilizer(Arc<Inner>);

impl Stabilizer {
    /// Whether a changed slot has waited `bound` by `at` (cheap: no map is read). Blocks
    /// until the writer's thread answers (behind a table write at most).
    pub fn due(&self, at: Instant, bound: Duration) -> Result<bool, WriteFailed> {
        self.0
            .exec(move |writes| writes.stabilize_due(at, bound))
            .map_err(|_| WriteFailed::Stopped)
    }

    /// Turns stable the changed slots that waited `bound` and that no live entry of
    /// `flows` (the connection table, read from `scanned` on) holds; returns how many
    /// slots of which VIP. Blocks until the writer's thread made the writes.
    pub fn stabilize(
        &self,
        flows: Vec<(FlowKey, FlowEntry)>,
        scanned: (Instant, u64),
        bound: Duration,
    ) -> Result<Vec<(VipKey, usize)>, WriteFailed> {
        self.0
            .exec(move |writes| writes.stabilize(&flows, scanned, bound))
            .map_err(|_| WriteFailed::Stopped)?
            .map_err(|error| WriteFailed::Write(format!("{:#}", anyhow::Error::from(error))))
    }
}

/// What the task that turns changed slots stable needs (`State::stabilizer`).
pub struct StabilizerParts {
    /// The writer's handle.
    pub stabilizer: Stabilizer,
    /// The least a changed slot waits: `dataplane.flow_idle_timeout`, fixed at start.
    pub idle: Duration,
    /// The connection table's size (`turnover::Turnover`).
    pub conntrack_entries: u32,
    pub counters: Arc<CounterReader>,
    /// Where the horizon found is published, for status.
    pub horizon: Arc<crate::turnover::PublishedHorizon>,
}

impl Writer {
    /// A writer thread over `dataplane`, whose tables `tables` wrote last (`desired`);
    /// `flows`: the connection table's handle for the cluster's imports.
    pub fn spawn(
        dataplane: Box<dyn Dataplane + Send>,
        tables: TableWriter,
        desired: Desired,
        flows: Option<FlowWriter>,
    ) -> std::io::Result<Self> {
        let reads = Self::reads(dataplane);
        let words = tables.slot_words();
        let writes = DataplaneWrites {
            tables,
            dataplane: reads.0.clone(),
            flows,
        };
        let (mut writer, work) = Self::parts(reads, Box::new(writes), desired, false);
        writer.slot_words = words;
        let inner = writer.inner.clone();
        let thread = std::thread::Builder::new()
            .name("lb-table-writer".into())
            .spawn(move || work.expect("a thread's work").run(&inner))?;
        writer.thread = Some(thread);
        Ok(writer)
    }

    /// A writer that writes in the caller's thread, at once (unit tests: what a change
    /// wrote is there when it returns).
    pub fn inline(dataplane: Box<dyn Dataplane + Send>, tables: TableWriter) -> Self {
        let reads = Self::reads(dataplane);
        let words = tables.slot_words();
        let writes = DataplaneWrites {
            tables,
            dataplane: reads.0.clone(),
            flows: None,
        };
        let mut writer = Self::parts(reads, Box::new(writes), Desired::default(), true).0;
        writer.slot_words = words;
        writer
    }

    /// Unit tests: a writer whose writes go to `writes` (a fake), in the caller's thread;
    /// `reads` is the data path read from.
    #[cfg(test)]
    pub fn inline_with(reads: Box<dyn Dataplane + Send>, writes: Box<dyn TableWrites>) -> Self {
        Self::parts(Self::reads(reads), writes, Desired::default(), true).0
    }

    /// Unit tests: explain's lookups from `lookups` rather than the data path's.
    #[cfg(test)]
    pub fn with_lookups(mut self, lookups: FlowLookups) -> Self {
        self.lookups = Arc::new(lookups);
        self
    }

    /// The data path behind its lock, and the read sides (counters, explain's lookups):
    /// handles of their own when the data path has them to give.
    fn reads(dataplane: Box<dyn Dataplane + Send>) -> Reads {
        let lookups = dataplane.flow_lookups();
        let own = dataplane.counter_reader();
        let dataplane: SharedDataplane = Arc::new(Mutex::new(dataplane));
        let counters = Arc::new(match own {
            Ok(Some(reader)) => reader,
            Ok(None) => CounterReader::shared(dataplane.clone()),
            Err(error) => {
                tracing::warn!("counters are read through the writer's lock: {error}");
                CounterReader::shared(dataplane.clone())
            }
        });
        let lookups = Arc::new(match lookups {
            Ok(Some(lookups)) => lookups,
            Ok(None) => FlowLookups::shared(dataplane.clone()),
            Err(error) => {
                tracing::warn!("explain reads flows through the writer's lock: {error}");
                FlowLookups::shared(dataplane.clone())
            }
        });
        (dataplane, counters, lookups)
    }

    /// The handle, and the work for a thread (None: `inline`, the work is the handle's).
    fn parts(
        (dataplane, counters, lookups): Reads,
        writes: Box<dyn TableWrites>,
        desired: Desired,
        inline: bool,
    ) -> (Self, Option<Work>) {
        let (sender, receiver) = watch::channel(Written {
            ticket: 0,
            desired: Arc::new(desired),
            error: None,
            writes: 0,
        });
        let work = Work {
            builder: TableBuilder::default(),
            writes,
            written: sender,
        };
        let (inline, work) = match inline {
            true => (Some(Box::new(Mutex::new(work))), None),
            false => (None, Some(work)),
        };
        let writer = Self {
            inner: Arc::new(Inner {
                pending: Mutex::new(Pending::default()),
                wake: Condvar::new(),
                inline,
            }),
            dataplane,
            counters,
            lookups,
            // A write side without a `TableWriter` (a fake) has no stable slots.
            slot_words: Arc::default(),
            written: receiver,
            thread: None,
        };
        (writer, work)
    }

    /// Asks for the data path to hold the tables of `inputs`; returns its ticket.
    pub fn request(&self, inputs: TableInputs) -> u64 {
        let ticket = {
            let mut pending = self.inner.pending.lock().expect("writer queue poisoned");
            pending.last_ticket += 1;
            let ticket = pending.last_ticket;
            pending.next = Some((ticket, inputs));
            ticket
        };
        match &self.inner.inline {
            None => self.inner.wake.notify_one(),
            Some(work) => work
                .lock()
                .expect("writer poisoned")
                .write_pending(&self.inner),
        }
        ticket
    }

    /// Runs `op` on the write side (in the writer's thread, after what is queued) and
    /// waits for it: for writes whose outcome the caller answers with (the next program).
    pub fn exec<R: Send + 'static>(
        &self,
        op: impl FnOnce(&mut dyn TableWrites) -> R + Send + 'static,
    ) -> Result<R, WriterStopped> {
        self.inner.exec(op)
    }

    /// The cluster task's handle for its imports.
    pub fn imports(&self) -> Imports {
        Imports(self.inner.clone())
    }

    /// The agent's handle for turning changed slots stable.
    pub fn stabilizer(&self) -> Stabilizer {
        Stabilizer(self.inner.clone())
    }

    /// The slot words of `stable_slots` VIPs, as last written (status and `lb explain`
    /// read them without waiting for the writer).
    pub fn slot_words(&self) -> Arc<SlotWords> {
        self.slot_words.clone()
    }

    /// The newest request, to wait for outside the agent's lock.
    pub fn requested(&self) -> Requested {
        Requested {
            ticket: self
                .inner
                .pending
                .lock()
                .expect("writer queue poisoned")
                .last_ticket,
            written: self.written.clone(),
        }
    }

    /// The writes' reports, for readers: what the data path holds, which request it
    /// covers (`Requested::of` waits for one).
    pub fn reports(&self) -> watch::Receiver<Written> {
        self.written.clone()
    }

    /// Whether every request has been written (or failed): nothing is pending.
    pub fn is_current(&self) -> bool {
        let last = self
            .inner
            .pending
            .lock()
            .expect("writer queue poisoned")
            .last_ticket;
        self.written.borrow().ticket >= last
    }

    /// The last write's report.
    pub fn written(&self) -> Written {
        self.written.borrow().clone()
    }

    /// The tables the data path holds, as last written.
    pub fn desired(&self) -> Arc<Desired> {
        self.written.borrow().desired.clone()
    }

    /// The data path, for reads. Held briefly: the writer waits for it.
    pub fn dataplane(&self) -> MutexGuard<'_, Box<dyn Dataplane + Send>> {
        self.dataplane.lock().expect("data path poisoned")
    }

    /// The counters' read side (status, metrics, rate samples): it does not wait for a
    /// table write.
    pub fn counters(&self) -> Arc<CounterReader> {
        self.counters.clone()
    }

    /// Explain's lookups of one flow: they do not wait for a table write.
    pub fn lookups(&self) -> Arc<FlowLookups> {
        self.lookups.clone()
    }

    /// The same lock, to share with tasks that read the data path on their own.
    pub fn shared_dataplane(&self) -> SharedDataplane {
        self.dataplane.clone()
    }
}

impl Drop for Writer {
    /// Writes what is still pending, then stops the thread.
    fn drop(&mut self) {
        self.inner
            .pending
            .lock()
            .expect("writer queue poisoned")
            .stop = true;
        self.inner.wake.notify_one();
        if let Some(thread) = self.thread.take()
            && thread.join().is_err()
        {
            tracing::error!("the table writer panicked");
        }
    }
}

impl Work {
    fn run(mut self, inner: &Inner) {
        loop {
            let ops = {
                let mut pending = inner.pending.lock().expect("writer queue poisoned");
                while pending.next.is_none() && pending.ops.is_empty() && !pending.stop {
                    pending = inner.wake.wait(pending).expect("writer queue poisoned");
                }
                if pending.next.is_none() && pending.ops.is_empty() {
                    return;
                }
                std::mem::take(&mut pending.ops)
            };
            for op in ops {
                op(self.writes.as_mut());
            }
            self.write_pending(inner);
        }
    }

    /// Builds and writes the newest pending inputs, if any.
    fn write_pending(&mut self, inner: &Inner) {
        let Some((ticket, inputs)) = inner
            .pending
            .lock()
            .expect("writer queue poisoned")
            .next
            .take()
        else {
            return;
        };
        let desired = self.builder.build(&inputs);
        let error = match self.writes.write_tables(&desired) {
            Ok(report) => {
                // A switch may write no slot: the idle generation can already hold the
                // new table (a backend that goes down again, back to the table before
                // it came up).
                if report.slots_written > 0 || report.tables_switched > 0 || report.vips_removed > 0
                {
                    tracing::info!(
                        "tables updated: {} slots written, {} tables switched, {} VIPs removed",
                        report.slots_written,
                        report.tables_switched,
                        report.vips_removed
                    );
                }
                None
            }
            Err(error) => {
                let text = format!("{:#}", anyhow::Error::from(error));
                tracing::error!("writing the tables: {text}");
                Some(text)
            }
        };
        let desired = if error.is_none() {
            Arc::new(desired)
        } else {
            self.written.borrow().desired.clone()
        };
        let writes = self.written.borrow().writes + 1;
        self.written.send_replace(Written {
            ticket,
            desired,
            error,
            writes,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dataplane::MemoryDataplane;

    fn inputs(members: &[u32]) -> TableInputs {
        let key = crate::model::vip_key("10.0.0.100".parse().unwrap(), 80, 6);
        TableInputs {
            hot_sources: Default::default(),
            table_size: 7,
            vips: vec![crate::tables::VipInputs {
                key,
                vip_id: 0,
                flags: 0,
                members: members
                    .iter()
                    .map(|&id| lb_common::maglev::MaglevBackend {
                        id,
                        address: std::net::IpAddr::from([10, 0, 0, id as u8]),
                        weight: 1,
                    })
                    .collect(),
            }],
            backends: Default::default(),
            tunnel: Default::default(),
            quic_ids: Default::default(),
        }
    }

    /// A writer thread over an empty in-memory data path, tables of 7 slots.
    fn spawned() -> Writer {
        Writer::spawn(
            Box::new(MemoryDataplane::default()),
            TableWriter::new(7),
            Desired::default(),
            None,
        )
        .unwrap()
    }

    #[tokio::test]
    async fn a_burst_of_requests_is_written_once() {
        let writer = spawned();
        {
            // While the data path is busy, a backend flaps a hundred times.
            let _busy = writer.dataplane();
            for i in 0..100 {
                writer.request(inputs(if i % 2 == 0 { &[1, 2] } else { &[1] }));
            }
        }
        writer.requested().done().await.unwrap();
        let written = writer.written();
        assert_eq!(written.ticket, 100);
        assert!(
            written.writes <= 2,
            "{} writes for one burst: at most the one that was waiting and the last",
            written.writes
        );
        let table = &written.desired.vips[0].table;
        assert!(
            table.iter().all(|&id| id == 1),
            "the last request won: {table:?}"
        );
    }

    #[tokio::test]
    async fn a_request_is_written_before_it_is_done() {
        let writer = spawned();
        writer.request(inputs(&[3]));
        writer.requested().done().await.unwrap();
        assert!(writer.is_current());
        assert!(writer.desired().vips[0].table.iter().all(|&id| id == 3));
    }

    #[tokio::test]
    async fn changed_slots_turn_stable_on_the_writers_thread() {
        let writer = spawned();
        let stable = |members: &[u32]| {
            let mut inputs = inputs(members);
            inputs.vips[0].flags = lb_common::VIP_F_STABLE;
            inputs
        };
        writer.request(stable(&[1, 2]));
        writer.requested().done().await.unwrap();
        writer.request(stable(&[1]));
        writer.requested().done().await.unwrap();
        let moved = writer.slot_words().changed(0);
        assert!(moved > 0, "backend 2's slots moved to 1");
        let bound = Duration::from_secs(10);
        let stabilizer = writer.stabilizer();
        let later = Instant::now() + bound;
        let (due, turned) = tokio::task::spawn_blocking(move || {
            let due = stabilizer.due(later, bound).unwrap();
            (due, stabilizer.stabilize(Vec::new(), (later, 0), bound))
        })
        .await
        .unwrap();
        assert!(due);
        assert_eq!(turned.unwrap()[0].1, moved);
        assert_eq!(writer.slot_words().changed(0), 0);
    }
}
