//! The table writer: one thread that owns the data path's writes. Changes (a reload, a
//! runtime command, a health change, a MAC learnt) hand it the model's `TableInputs`
//! and go on; the thread builds the Maglev tables and writes them with bpf(2), off the
//! agent's lock and off the async workers. Requests that arrive while it works replace
//! each other, so a flapping backend costs one rebuild per write, not a queue of them.
//!
//! Each request gets a ticket; `wait` resolves once a write that includes it is done, for
//! callers that answer only after the data path follows (control commands, reload).

use std::{
    sync::{Arc, Condvar, Mutex, MutexGuard},
    thread::JoinHandle,
};

use tokio::sync::watch;

use crate::{
    dataplane::{CounterReader, Dataplane},
    tables::{Desired, TableBuilder, TableInputs, TableWriter},
};

/// The data path as the agent holds it: reads (counters, flows) take this lock briefly;
/// the writer thread takes it for a write.
pub type SharedDataplane = Arc<Mutex<Box<dyn Dataplane + Send>>>;

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
    /// Resolves once a write covering the request is done: Ok, or why it failed.
    pub async fn done(mut self) -> Result<(), String> {
        let ticket = self.ticket;
        let done = self
            .written
            .wait_for(|w| w.ticket >= ticket)
            .await
            .map_err(|_| "the table writer stopped".to_string())?;
        // A later request's write covers this one too (its inputs replaced ours).
        match &done.error {
            Some(error) => Err(error.clone()),
            None => Ok(()),
        }
    }
}

/// The handle the agent's state keeps.
pub struct Writer {
    inner: Arc<Inner>,
    dataplane: SharedDataplane,
    /// The counters' read side: handles of their own, no lock the writing side holds.
    counters: Arc<CounterReader>,
    written: watch::Receiver<Written>,
    mode: Mode,
}

enum Mode {
    Thread(Option<JoinHandle<()>>),
    /// Unit tests: `request` writes in the caller's thread. Boxed: the work is large.
    Inline(Box<Mutex<Work>>),
}

struct Inner {
    pending: Mutex<Pending>,
    wake: Condvar,
}

#[derive(Default)]
struct Pending {
    /// The newest inputs not yet written, and their ticket.
    next: Option<(u64, TableInputs)>,
    last_ticket: u64,
    stop: bool,
}

/// What only the writing side touches.
struct Work {
    builder: TableBuilder,
    tables: TableWriter,
    dataplane: SharedDataplane,
    written: watch::Sender<Written>,
}

impl Writer {
    /// A writer thread over `dataplane`, whose tables `tables` wrote last (`desired`).
    pub fn spawn(
        dataplane: Box<dyn Dataplane + Send>,
        tables: TableWriter,
        desired: Desired,
    ) -> std::io::Result<Self> {
        let (mut writer, work) = Self::parts(dataplane, tables, desired);
        let inner = writer.inner.clone();
        let thread = std::thread::Builder::new()
            .name("lb-table-writer".into())
            .spawn(move || work.run(&inner))?;
        writer.mode = Mode::Thread(Some(thread));
        Ok(writer)
    }

    /// A writer that writes in the caller's thread, at once (unit tests: what a change
    /// wrote is there when it returns).
    pub fn inline(dataplane: Box<dyn Dataplane + Send>, tables: TableWriter) -> Self {
        let (mut writer, work) = Self::parts(dataplane, tables, Desired::default());
        writer.mode = Mode::Inline(Box::new(Mutex::new(work)));
        writer
    }

    fn parts(
        dataplane: Box<dyn Dataplane + Send>,
        tables: TableWriter,
        desired: Desired,
    ) -> (Self, Work) {
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
        let (sender, receiver) = watch::channel(Written {
            ticket: 0,
            desired: Arc::new(desired),
            error: None,
            writes: 0,
        });
        let writer = Self {
            inner: Arc::new(Inner {
                pending: Mutex::new(Pending::default()),
                wake: Condvar::new(),
            }),
            dataplane: dataplane.clone(),
            counters,
            written: receiver,
            mode: Mode::Thread(None),
        };
        let work = Work {
            builder: TableBuilder::default(),
            tables,
            dataplane,
            written: sender,
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
        match &self.mode {
            Mode::Thread(_) => self.inner.wake.notify_one(),
            Mode::Inline(work) => work
                .lock()
                .expect("writer poisoned")
                .write_pending(&self.inner),
        }
        ticket
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
        if let Mode::Thread(thread) = &mut self.mode
            && let Some(thread) = thread.take()
            && thread.join().is_err()
        {
            tracing::error!("the table writer panicked");
        }
    }
}

impl Work {
    fn run(mut self, inner: &Inner) {
        loop {
            {
                let mut pending = inner.pending.lock().expect("writer queue poisoned");
                while pending.next.is_none() && !pending.stop {
                    pending = inner.wake.wait(pending).expect("writer queue poisoned");
                }
                if pending.next.is_none() {
                    return;
                }
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
        let result = {
            let mut dataplane = self.dataplane.lock().expect("data path poisoned");
            self.tables.apply(dataplane.as_mut(), &desired)
        };
        let error = match result {
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

    #[tokio::test]
    async fn a_burst_of_requests_is_written_once() {
        let writer = Writer::spawn(
            Box::new(MemoryDataplane::default()),
            TableWriter::new(7),
            Desired::default(),
        )
        .unwrap();
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
        let writer = Writer::spawn(
            Box::new(MemoryDataplane::default()),
            TableWriter::new(7),
            Desired::default(),
        )
        .unwrap();
        writer.request(inputs(&[3]));
        writer.requested().done().await.unwrap();
        assert!(writer.is_current());
        assert!(writer.desired().vips[0].table.iter().all(|&id| id == 3));
    }
}
