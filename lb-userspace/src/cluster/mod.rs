//! Sharing connection-table entries between nodes that serve the same VIPs (`[cluster]`).
//!
//! Behind ECMP, a flow reaches one node; when that node goes (or the routers move flows
//! for another reason), its flows reach another, which never saw them and hashes them
//! with its table. Without a backend change since the flow began that gives the same
//! backend (the tables are identical); after one, some flows land elsewhere and break.
//! So each node tells its peers about the entries it creates:
//!
//! - the program writes every entry it creates to a ring buffer (`LB_EXPORT`, only when
//!   loaded with `[cluster]`; a full ring drops the record and counts it);
//! - this task drains the ring every `TICK`, names each entry's backend by its address
//!   (ids differ between nodes), and sends the entries to every peer in authenticated
//!   UDP datagrams of up to `wire::MAX_ENTRIES` (`wire` has the format);
//! - a peer maps the VIP (the flow's destination) and the backend address to its own
//!   backend id and inserts the entry unless the flow has one there, marked learned
//!   (`FLOW_F_LEARNED`): learned entries are never exported again, and do not count as
//!   that node's active flows until a packet of theirs arrives there.
//!
//! Entries that end or expire are not chased: each node's own idle rules apply.
//!
//! Learn before announce: a node that starts with an empty connection table (a first
//! start, or maps of another layout replaced) asks each peer for its live entries over
//! TCP on the same address and port (`transfer`: batched, paced, resumed where a
//! connection broke, each frame authenticated with the key) and inserts them as they
//! come. Its VIPs are announced (`[announce]`) once every peer's whole table came, or a
//! peer was silent for `learn_timeout`. What the peers create meanwhile reaches it as it
//! reaches every peer, by the datagrams: the socket is bound before the first request,
//! and a peer's copy is read after the request came, so every entry is in the copy or
//! exported after it (no gap).
//!
//! Nodes of earlier versions ask by a datagram (`DumpRequest`): they are still answered
//! by datagrams, paced, ending with `DumpDone`.

pub mod stream;
pub mod transfer;
pub mod wire;

use std::{
    collections::{BTreeMap, HashMap, VecDeque},
    net::{IpAddr, SocketAddr},
    os::unix::fs::MetadataExt,
    path::Path,
    sync::{Arc, Mutex},
    time::{Duration, Instant, SystemTime},
};

use aya::maps::{MapData, RingBuf};
use lb_common::{
    ExportRecord, FLOW_F_CLOSING, FLOW_F_LEARNED, FlowEntry, FlowKey, LAST_SEEN_GRANULARITY_NS,
    PROTO_UDP, VipKey, stat,
};
use tokio::net::{TcpListener, UdpSocket};
use tokio_util::sync::CancellationToken;

use crate::{
    config::ClusterConfig,
    dataplane::FlowReader,
    explain::monotonic_ns,
    status::{ClusterStatus, PeerStatus},
    writer::Imports,
};
use transfer::{AnswerContext, Answers, LearnStatus, Learner, PeerLearn, PeerLearnState};
use wire::{Entry, Kind, Message, Reject, ReplayGuard};

/// How often the export ring is drained and batches are sent: the most an entry waits.
pub const TICK: Duration = Duration::from_millis(50);
/// Datagrams of new entries sent per peer per tick (2000/s, 40,000 entries/s): beyond
/// that the queue grows, then drops.
const LIVE_PER_TICK: usize = 100;
/// Dump datagrams sent per tick (1000/s, 20,000 entries/s), to nodes of earlier
/// versions that ask by datagram: a dump never crowds out new entries.
const DUMP_PER_TICK: usize = 50;
/// Entries waiting to be sent, at most: beyond it new ones are dropped and counted.
const MAX_QUEUE: usize = 100_000;
/// How long a node sends nothing before it sends its peers an empty datagram, so that
/// each peer's last-seen time tells a silent peer from an idle one.
pub const KEEPALIVE: Duration = Duration::from_secs(2);
/// How often a learning node logs how far it is, all peers together.
const LEARN_LOG_EVERY: Duration = Duration::from_secs(1);
/// Shortest accepted key.
pub const MIN_KEY_BYTES: usize = 16;

#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("cluster.key_file {path}: {why}")]
    Key { path: String, why: String },
    #[error("cluster: no address of the peers' family on {interface} to bind; set cluster.address")]
    NoAddress { interface: String },
    #[error("cluster: binding {protocol} {address}")]
    Bind {
        protocol: &'static str,
        address: SocketAddr,
        source: std::io::Error,
    },
}

/// Reads the shared key: a regular file owned by root (or the agent's user) that no one
/// else may read or write, of at least `MIN_KEY_BYTES` (surrounding whitespace is not
/// part of the key).
pub fn read_key(path: &Path) -> Result<Vec<u8>, ClusterError> {
    let refuse = |why: String| ClusterError::Key {
        path: path.display().to_string(),
        why,
    };
    let meta = std::fs::metadata(path).map_err(|e| refuse(e.to_string()))?;
    if !meta.is_file() {
        return Err(refuse("not a regular file".into()));
    }
    let euid = nix::unistd::geteuid().as_raw();
    if meta.uid() != 0 && meta.uid() != euid {
        return Err(refuse(format!(
            "owned by uid {}, not root: anyone who can change it can steer flows \
             (chown root {})",
            meta.uid(),
            path.display()
        )));
    }
    if meta.mode() & 0o077 != 0 {
        return Err(refuse(format!(
            "mode {:o}: others may read the secret (chmod 600 {})",
            meta.mode() & 0o777,
            path.display()
        )));
    }
    let bytes = std::fs::read(path).map_err(|e| refuse(e.to_string()))?;
    let key = bytes.trim_ascii().to_vec();
    if key.len() < MIN_KEY_BYTES {
        return Err(refuse(format!(
            "{} bytes; at least {MIN_KEY_BYTES} are needed (head -c 32 /dev/urandom | \
             base64 > {})",
            key.len(),
            path.display()
        )));
    }
    Ok(key)
}

/// The address the socket binds: `cluster.address`, else the first of the interface's
/// addresses in the peers' family (IPv4 without peers).
pub fn bind_address(
    config: &ClusterConfig,
    interface: &str,
    addresses: &[IpAddr],
) -> Result<SocketAddr, ClusterError> {
    let v4 = config.peers.first().is_none_or(IpAddr::is_ipv4);
    let address = config
        .address
        .or_else(|| {
            addresses
                .iter()
                .copied()
                .find(|a| a.is_ipv4() == v4 && !a.is_loopback() && !is_link_local(a))
        })
        .ok_or_else(|| ClusterError::NoAddress {
            interface: interface.to_string(),
        })?;
    Ok(SocketAddr::new(address, config.port))
}

fn is_link_local(address: &IpAddr) -> bool {
    match address {
        IpAddr::V4(a) => a.is_link_local(),
        IpAddr::V6(a) => a.segments()[0] & 0xffc0 == 0xfe80,
    }
}

/// Which backend an id names here, and which id a (VIP, backend address) has here: what
/// turns this node's entries into the peers' and back.
#[derive(Clone, Debug, Default)]
pub struct Directory {
    by_id: HashMap<u32, [u8; 16]>,
    by_backend: HashMap<(VipKey, [u8; 16]), u32>,
}

impl Directory {
    /// From (VIP key, backend id, backend address as the maps hold it).
    pub fn new(backends: impl IntoIterator<Item = (VipKey, u32, [u8; 16])>) -> Self {
        let mut directory = Directory::default();
        for (vip, id, address) in backends {
            directory.by_id.insert(id, address);
            directory.by_backend.insert((vip, address), id);
        }
        directory
    }

    /// The peers' form of an entry of this node, `age_ns` after its last packet.
    pub fn export(&self, key: &FlowKey, entry: &FlowEntry, age_ns: u64) -> Option<Entry> {
        Some(Entry {
            key: *key,
            backend: *self.by_id.get(&entry.backend_id)?,
            age_s: (age_ns / 1_000_000_000).min(u32::MAX as u64) as u32,
            flags: entry.flags & FLOW_F_CLOSING,
        })
    }

    /// This node's entry for a peer's, at `now_ns` on the data path's clock, if this node
    /// has the VIP and the backend.
    pub fn learn(&self, entry: &Entry, now_ns: u64) -> Option<FlowEntry> {
        let vip = entry.key.vip_key();
        let backend_id = *self.by_backend.get(&(vip, entry.backend))?;
        // Older than the refresh granularity: the first packet here refreshes the entry,
        // which clears the learned flag (`lb_common::flow::follow`).
        let age = (entry.age_s as u64 * 1_000_000_000).max(LAST_SEEN_GRANULARITY_NS + 1);
        Some(FlowEntry {
            backend_id,
            flags: FLOW_F_LEARNED | (entry.flags & FLOW_F_CLOSING),
            last_seen_ns: now_ns.saturating_sub(age),
        })
    }
}

/// Whether an entry is worth sending in a dump: not closing, and for UDP not idle beyond
/// `udp_idle_ns` (a TCP entry holds its flow however long it is idle).
pub fn live(key: &FlowKey, entry: &FlowEntry, age_ns: u64, udp_idle_ns: u64) -> bool {
    entry.flags & FLOW_F_CLOSING == 0 && (key.proto != PROTO_UDP || age_ns <= udp_idle_ns)
}

/// Splits entries into datagrams of at most `wire::MAX_ENTRIES`.
pub fn batches(entries: &[Entry]) -> impl Iterator<Item = &[Entry]> {
    entries.chunks(wire::MAX_ENTRIES)
}

/// What the cluster task reads of the agent's state.
pub trait Host: Send + 'static {
    /// The `[cluster]` section in force (peers change by reload).
    fn cluster_config(&self) -> Option<&ClusterConfig>;
    /// This node's backends, now.
    fn directory(&self) -> Directory;
    /// The idle time after which UDP entries no longer hold their flow.
    fn udp_idle(&self) -> Duration;
    /// Learning is over (every peer's table came, or a peer was silent for the
    /// timeout): announce.
    fn learned(&mut self);
}

/// Counters of one peer.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PeerStats {
    /// Entries sent to it (new ones and dumps).
    pub sent: u64,
    /// Datagrams and bytes (UDP payload) sent to it.
    pub datagrams_sent: u64,
    pub bytes_sent: u64,
    /// Entries received from it in accepted datagrams.
    pub received: u64,
    /// Of those, inserted into the connection table (the others: the flow had an entry
    /// here, or this node lacks the VIP or backend).
    pub inserted: u64,
    /// Received entries naming a VIP or backend this node does not have.
    pub unknown: u64,
    /// Datagrams from its address dropped: failed authentication, malformed, stale or
    /// replayed.
    pub rejected: u64,
    /// Why the last one was dropped.
    pub last_reject: Option<String>,
    /// Sends that failed (its address unreachable ...).
    pub send_errors: u64,
    /// When the last accepted datagram came.
    pub last_contact: Option<Instant>,
    /// The same on the wall clock, for status and metrics as a time.
    pub last_seen: Option<SystemTime>,
}

/// Learning before announcing.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Learning {
    /// The node started with a table of its own (adopted): nothing to learn.
    #[default]
    NotNeeded,
    /// Asked the peers; their tables are coming.
    Waiting,
    /// Every peer's whole table came.
    Done,
    /// A peer was silent for `learn_timeout`: given up.
    TimedOut,
}

/// The cluster's counters, shared with status and metrics.
#[derive(Clone, Debug, Default)]
pub struct Stats {
    pub peers: BTreeMap<IpAddr, PeerStats>,
    /// Datagrams from addresses that are no peer.
    pub unknown_sender: u64,
    /// New entries dropped because the send queue was full.
    pub queue_dropped: u64,
    pub learning: Learning,
    /// Entries learned (inserted) while learning.
    pub learned_at_start: u64,
    /// The transfer from each peer while learning: its progress, when it began and
    /// when it ended.
    pub learn: BTreeMap<IpAddr, (PeerLearn, Instant, Option<Instant>)>,
    /// The bound address.
    pub address: Option<SocketAddr>,
}

pub type Shared = Arc<Mutex<Stats>>;

impl Stats {
    /// What status shows; `outcomes` are the program's counters (`lb_common::stat`).
    pub fn status(&self, outcomes: &[u64], now: Instant) -> ClusterStatus {
        let counter = |i: u32| outcomes.get(i as usize).copied().unwrap_or(0);
        let learning = serde_json::to_value(&self.learning)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default();
        ClusterStatus {
            address: self.address.map(|a| a.to_string()),
            learning,
            learned_at_start: self.learned_at_start,
            learn: (!self.learn.is_empty()).then(|| transfer::learn_status(&self.learn)),
            exported: counter(stat::CLUSTER_EXPORTED),
            export_dropped: counter(stat::CLUSTER_EXPORT_DROPPED),
            queue_dropped: self.queue_dropped,
            unknown_sender: self.unknown_sender,
            peers: self
                .peers
                .iter()
                .map(|(address, p)| PeerStatus {
                    address: address.to_string(),
                    sent: p.sent,
                    datagrams_sent: p.datagrams_sent,
                    bytes_sent: p.bytes_sent,
                    send_errors: p.send_errors,
                    received: p.received,
                    inserted: p.inserted,
                    unknown: p.unknown,
                    rejected: p.rejected,
                    last_reject: p.last_reject.clone(),
                    last_contact_seconds: p
                        .last_contact
                        .map(|at| now.saturating_duration_since(at).as_secs_f64()),
                    last_seen_unix_seconds: p.last_seen.map(unix_seconds),
                })
                .collect(),
        }
    }
}

/// The cluster's socket and key, opened at start: a key or an address that is refused
/// stops the start before the data path is touched.
pub struct Opened {
    socket: std::net::UdpSocket,
    /// Where peers that join ask for this node's table.
    listener: std::net::TcpListener,
    key: Vec<u8>,
    pub stats: Shared,
}

/// Reads the key and binds the sockets: UDP for the datagrams, TCP for the transfers.
pub fn open(
    config: &ClusterConfig,
    interface: &str,
    addresses: &[IpAddr],
) -> Result<Opened, ClusterError> {
    let key = read_key(&config.key_file)?;
    let address = bind_address(config, interface, addresses)?;
    let bind_error = |protocol| {
        move |source| ClusterError::Bind {
            protocol,
            address,
            source,
        }
    };
    let socket = std::net::UdpSocket::bind(address)
        .and_then(|s| s.set_nonblocking(true).map(|()| s))
        .map_err(bind_error("UDP"))?;
    let listener = std::net::TcpListener::bind(address)
        .and_then(|s| s.set_nonblocking(true).map(|()| s))
        .map_err(bind_error("TCP"))?;
    let stats = Shared::default();
    stats.lock().expect("cluster stats poisoned").address = Some(address);
    Ok(Opened {
        socket,
        listener,
        key,
        stats,
    })
}

/// What the data path gives the cluster task: the export ring to drain, the table
/// writer's handle for the peers' entries (it owns every data-path write), and a flow
/// reader of its own.
pub struct Maps {
    pub export: RingBuf<MapData>,
    pub imports: Imports,
    pub reader: Arc<FlowReader>,
}

/// Runs the cluster task until `shutdown`. `learn`: the node starts with an empty
/// connection table, and learns its peers' first.
pub fn start<H: Host>(
    host: Arc<Mutex<H>>,
    opened: Opened,
    maps: Maps,
    learn: bool,
    learn_timeout: Duration,
    shutdown: CancellationToken,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let socket = UdpSocket::from_std(opened.socket)?;
    let listener = TcpListener::from_std(opened.listener)?;
    let key: Arc<[u8]> = opened.key.into();
    let writer = maps.imports;
    let rate = host
        .lock()
        .expect("agent state poisoned")
        .cluster_config()
        .map_or(250_000, |c| c.transfer_rate);
    let answers = Arc::new(AnswerContext {
        key: key.clone(),
        rate,
        answers: Arc::new(Answers::default()),
        scan: scan_for_peers(host.clone(), maps.reader.clone()),
        stats: opened.stats.clone(),
    });
    let mut task = Task {
        host,
        socket,
        listener,
        key,
        stats: opened.stats,
        export: maps.export,
        writer,
        reader: maps.reader,
        answers,
        boot: wall_ns(),
        seq: 0,
        queue: VecDeque::new(),
        dumps: VecDeque::new(),
        guards: HashMap::new(),
        dumped: HashMap::new(),
        learning: None,
        last_sent: Instant::now(),
    };
    if learn {
        task.start_learning(learn_timeout, &shutdown)?;
    }
    Ok(tokio::spawn(async move { task.run(shutdown).await }))
}

/// Reads this node's live entries in the peers' form (off the async workers).
fn scan_for_peers<H: Host>(host: Arc<Mutex<H>>, reader: Arc<FlowReader>) -> transfer::Scan {
    Arc::new(move || {
        let (directory, udp_idle) = {
            let host = host.lock().expect("agent state poisoned");
            (host.directory(), host.udp_idle())
        };
        let now = monotonic_ns();
        let idle = udp_idle.as_nanos() as u64;
        let flows = reader.flows().map_err(|e| e.to_string())?;
        Ok(flows
            .iter()
            .filter_map(|(key, entry)| {
                let age = now.saturating_sub(entry.last_seen_ns);
                live(key, entry, age, idle)
                    .then(|| directory.export(key, entry, age))
                    .flatten()
            })
            .collect())
    })
}

/// Inserts a peer's entries that this node can map; returns (inserted, unknown here).
/// The table writer makes the inserts (`Imports`), as it makes every data-path write.
fn insert_learned<H: Host>(host: &Mutex<H>, writer: &Imports, entries: &[Entry]) -> (u64, u64) {
    let directory = host.lock().expect("agent state poisoned").directory();
    let now = monotonic_ns();
    let mut unknown = 0;
    let mut flows = Vec::with_capacity(entries.len());
    for entry in entries {
        match directory.learn(entry, now) {
            Some(flow) => flows.push((entry.key, flow)),
            None => unknown += 1,
        }
    }
    if flows.is_empty() {
        return (0, unknown);
    }
    let inserted = writer.import_flows(flows).unwrap_or_else(|error| {
        tracing::debug!("cluster: inserting learned entries: {error}");
        0
    });
    (inserted, unknown)
}

/// A dump being sent by datagrams to a node of an earlier version.
struct Dump {
    peer: IpAddr,
    entries: Vec<Entry>,
    at: usize,
}

/// Learning before announcing, from the peers at start.
struct LearnState {
    peers: Vec<IpAddr>,
    logged: Instant,
}

struct Task<H> {
    host: Arc<Mutex<H>>,
    socket: UdpSocket,
    listener: TcpListener,
    key: Arc<[u8]>,
    stats: Shared,
    export: RingBuf<MapData>,
    writer: Imports,
    reader: Arc<FlowReader>,
    answers: Arc<AnswerContext>,
    boot: u64,
    seq: u64,
    /// New entries waiting for the next tick.
    queue: VecDeque<Entry>,
    dumps: VecDeque<Dump>,
    guards: HashMap<IpAddr, ReplayGuard>,
    /// The run of each peer that was sent a dump.
    dumped: HashMap<IpAddr, u64>,
    learning: Option<LearnState>,
    /// When a datagram last went to every peer (new entries or a keepalive).
    last_sent: Instant,
}

/// `at` in seconds since the Unix epoch.
fn unix_seconds(at: SystemTime) -> f64 {
    at.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

fn wall_ns() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

impl<H: Host> Task<H> {
    fn stats(&self) -> std::sync::MutexGuard<'_, Stats> {
        self.stats.lock().expect("cluster stats poisoned")
    }

    /// The peers in force, without this node's own address.
    fn peers(&self) -> Vec<IpAddr> {
        let own = self.socket.local_addr().ok().map(|a| a.ip());
        let host = self.host.lock().expect("agent state poisoned");
        host.cluster_config()
            .map(|c| {
                c.peers
                    .iter()
                    .copied()
                    .filter(|p| Some(*p) != own)
                    .collect()
            })
            .unwrap_or_default()
    }

    fn port(&self) -> u16 {
        self.socket.local_addr().map_or(0, |a| a.port())
    }

    /// One transfer per peer, each inserting what it receives as it comes.
    fn start_learning(
        &mut self,
        timeout: Duration,
        shutdown: &CancellationToken,
    ) -> anyhow::Result<()> {
        let local = self.socket.local_addr()?;
        let peers = self.peers();
        for peer in &peers {
            let (host, writer, stats) =
                (self.host.clone(), self.writer.clone(), self.stats.clone());
            let insert = move |entries: &[Entry]| {
                let (inserted, unknown) = insert_learned(&host, &writer, entries);
                stats
                    .lock()
                    .expect("cluster stats poisoned")
                    .learned_at_start += inserted;
                (inserted, unknown)
            };
            let learner = Learner {
                peer: SocketAddr::new(*peer, local.port()),
                local: local.ip(),
                key: self.key.clone(),
                boot: self.boot,
                timeout,
                insert: Arc::new(insert),
                stats: self.stats.clone(),
            };
            tokio::spawn(learner.run(shutdown.clone()));
        }
        self.learning = Some(LearnState {
            peers,
            logged: Instant::now(),
        });
        self.stats().learning = Learning::Waiting;
        Ok(())
    }

    async fn run(&mut self, shutdown: CancellationToken) {
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut buffer = vec![0u8; wire::MAX_DATAGRAM + 1];
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tick.tick() => self.tick().await,
                received = self.socket.recv_from(&mut buffer) => match received {
                    Ok((len, from)) => {
                        let datagram = buffer[..len].to_vec();
                        self.receive(&datagram, from).await;
                    }
                    Err(error) => tracing::debug!("cluster: receiving: {error}"),
                },
                accepted = self.listener.accept() => match accepted {
                    Ok((conn, from)) => self.accept(conn, from.ip()),
                    Err(error) => tracing::debug!("cluster: accepting: {error}"),
                },
            }
        }
    }

    /// A connection asking for this node's table: answered if it comes from a peer.
    fn accept(&mut self, conn: tokio::net::TcpStream, peer: IpAddr) {
        if !self.peers().contains(&peer) {
            self.stats().unknown_sender += 1;
            return;
        }
        tokio::spawn(transfer::answer(conn, peer, self.answers.clone()));
    }

    /// Drains the export ring, sends what is queued, paces dumps, follows learning.
    async fn tick(&mut self) {
        let peers = self.peers();
        self.drain_export();
        let mut sent = 0;
        while !self.queue.is_empty() && sent < LIVE_PER_TICK {
            let n = self.queue.len().min(wire::MAX_ENTRIES);
            let entries: Vec<Entry> = self.queue.drain(..n).collect();
            self.send(Kind::Entries, entries, &peers).await;
            self.last_sent = Instant::now();
            sent += 1;
        }
        if self.last_sent.elapsed() >= KEEPALIVE {
            // No entries: a node of any version takes it as an empty batch.
            self.send(Kind::Entries, Vec::new(), &peers).await;
            self.last_sent = Instant::now();
        }
        self.send_dumps().await;
        self.follow_learning();
        // Peers removed by a reload leave the status.
        let mut stats = self.stats();
        stats.peers.retain(|p, _| peers.contains(p));
        for peer in &peers {
            stats.peers.entry(*peer).or_default();
        }
    }

    /// Moves the records of the export ring into the send queue, named by address.
    fn drain_export(&mut self) {
        let mut records = Vec::new();
        while let Some(item) = self.export.next() {
            if let Ok(record) = bytemuck::try_from_bytes::<ExportRecord>(&item) {
                records.push(*record);
            }
        }
        if records.is_empty() {
            return;
        }
        let directory = self.host.lock().expect("agent state poisoned").directory();
        let mut dropped = 0;
        for record in records {
            let entry = FlowEntry {
                backend_id: record.backend_id,
                flags: record.flags,
                last_seen_ns: 0,
            };
            let Some(entry) = directory.export(&record.key, &entry, 0) else {
                continue;
            };
            if self.queue.len() >= MAX_QUEUE {
                dropped += 1;
                continue;
            }
            self.queue.push_back(entry);
        }
        if dropped > 0 {
            self.stats().queue_dropped += dropped;
        }
    }

    /// Sends one datagram of `entries` to each of `peers`.
    async fn send(&mut self, kind: Kind, entries: Vec<Entry>, peers: &[IpAddr]) {
        self.seq += 1;
        let count = entries.len() as u64;
        let message = Message {
            kind,
            boot: self.boot,
            seq: self.seq,
            time_ms: wall_ns() / 1_000_000,
            entries,
        };
        let datagram = wire::encode(&message, &self.key);
        let port = self.port();
        for peer in peers {
            let result = self
                .socket
                .send_to(&datagram, SocketAddr::new(*peer, port))
                .await;
            let mut stats = self.stats();
            let peer_stats = stats.peers.entry(*peer).or_default();
            match result {
                Ok(_) => {
                    peer_stats.sent += count;
                    peer_stats.datagrams_sent += 1;
                    peer_stats.bytes_sent += datagram.len() as u64;
                }
                Err(error) => {
                    peer_stats.send_errors += 1;
                    tracing::debug!("cluster: sending to {peer}: {error}");
                }
            }
        }
    }

    /// Sends the next datagrams of the dumps in progress, then their `DumpDone`.
    async fn send_dumps(&mut self) {
        let mut budget = DUMP_PER_TICK;
        while budget > 0 {
            let Some(dump) = self.dumps.front_mut() else {
                return;
            };
            let peer = dump.peer;
            if dump.at >= dump.entries.len() {
                self.dumps.pop_front();
                self.send(Kind::DumpDone, Vec::new(), &[peer]).await;
                continue;
            }
            let end = (dump.at + wire::MAX_ENTRIES).min(dump.entries.len());
            let entries = dump.entries[dump.at..end].to_vec();
            dump.at = end;
            self.send(Kind::Entries, entries, &[peer]).await;
            budget -= 1;
        }
    }

    /// While learning: logs the progress, and ends learning once every peer's transfer
    /// ended (done, or given up after `learn_timeout` of silence).
    fn follow_learning(&mut self) {
        let Some(learning) = &mut self.learning else {
            return;
        };
        let (states, progress): (Vec<PeerLearnState>, LearnStatus) = {
            let stats = self.stats.lock().expect("cluster stats poisoned");
            let states = learning
                .peers
                .iter()
                .map(|p| stats.learn.get(p).map(|l| l.0.state).unwrap_or_default())
                .collect();
            (states, transfer::learn_status(&stats.learn))
        };
        if !states.iter().all(|s| s.is_final()) {
            if learning.logged.elapsed() >= LEARN_LOG_EVERY {
                learning.logged = Instant::now();
                tracing::info!("cluster: {progress}");
            }
            return;
        }
        self.learning = None;
        let outcome = if states.contains(&PeerLearnState::NoAnswer) {
            Learning::TimedOut
        } else {
            Learning::Done
        };
        let learned = {
            let mut stats = self.stats();
            stats.learning = outcome.clone();
            stats.learned_at_start
        };
        match outcome {
            Learning::Done => tracing::info!(
                "cluster: {progress}: learned {learned} entries from the peers; announcing may \
                 start"
            ),
            _ => tracing::warn!(
                "cluster: {progress}: a peer was silent for learn_timeout ({learned} entries \
                 learned); announcing may start"
            ),
        }
        self.host.lock().expect("agent state poisoned").learned();
    }

    /// Handles one datagram from `from`.
    async fn receive(&mut self, datagram: &[u8], from: SocketAddr) {
        let peer = from.ip();
        if !self.peers().contains(&peer) {
            self.stats().unknown_sender += 1;
            return;
        }
        let accepted = wire::decode(datagram, &self.key).and_then(|message| {
            let guard = self.guards.entry(peer).or_default();
            guard
                .accept(&message, wall_ns() / 1_000_000)
                .map(|()| message)
        });
        let message = match accepted {
            Ok(message) => message,
            Err(reject) => {
                self.rejected(peer, reject);
                return;
            }
        };
        {
            let mut stats = self.stats();
            let peer_stats = stats.peers.entry(peer).or_default();
            peer_stats.last_contact = Some(Instant::now());
            peer_stats.last_seen = Some(SystemTime::now());
            peer_stats.received += message.entries.len() as u64;
        }
        match message.kind {
            Kind::Entries => self.learn_entries(peer, &message.entries),
            Kind::DumpRequest => self.start_dump(peer, message.boot).await,
            // Learning goes by the transfers; a `DumpDone` answers nothing asked here.
            Kind::DumpDone => {}
        }
    }

    fn rejected(&self, peer: IpAddr, reject: Reject) {
        let mut stats = self.stats();
        let peer_stats = stats.peers.entry(peer).or_default();
        peer_stats.rejected += 1;
        if peer_stats.last_reject.as_deref() != Some(&reject.to_string()) {
            tracing::warn!("cluster: dropped a datagram from {peer}: {reject}");
        }
        peer_stats.last_reject = Some(reject.to_string());
    }

    /// Inserts a peer's new entries that this node can map.
    fn learn_entries(&mut self, peer: IpAddr, entries: &[Entry]) {
        if entries.is_empty() {
            return;
        }
        let (inserted, unknown) = insert_learned(&self.host, &self.writer, entries);
        let mut stats = self.stats();
        if self.learning.is_some() {
            stats.learned_at_start += inserted;
        }
        let peer_stats = stats.peers.entry(peer).or_default();
        peer_stats.inserted += inserted;
        peer_stats.unknown += unknown;
    }

    /// Reads this node's live entries for a node of an earlier version that asked by
    /// datagram, and queues them. It asks again until it has the `DumpDone`: a run of it
    /// that had its dump gets the `DumpDone` alone.
    async fn start_dump(&mut self, peer: IpAddr, boot: u64) {
        if self.dumps.iter().any(|d| d.peer == peer) {
            // Asked again while its dump is under way.
            return;
        }
        if self.dumped.get(&peer) == Some(&boot) {
            self.send(Kind::DumpDone, Vec::new(), &[peer]).await;
            return;
        }
        self.dumped.insert(peer, boot);
        let scan = scan_for_peers(self.host.clone(), self.reader.clone());
        match tokio::task::spawn_blocking(move || scan()).await {
            Ok(Ok(entries)) => {
                tracing::info!(
                    "cluster: {peer} asked for our entries by datagram: sending {}",
                    entries.len()
                );
                self.dumps.push_back(Dump {
                    peer,
                    entries,
                    at: 0,
                });
            }
            Ok(Err(error)) => tracing::warn!("cluster: reading the connection table: {error}"),
            Err(error) => tracing::warn!("cluster: reading the connection table: {error}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lb_common::{ADDR_FAMILY_V4, PROTO_TCP};
    use std::os::unix::fs::PermissionsExt;

    fn v4(octets: [u8; 4]) -> [u8; 16] {
        let mut bytes = [0; 16];
        bytes[..4].copy_from_slice(&octets);
        bytes
    }

    fn vip() -> VipKey {
        VipKey {
            addr: v4([10, 0, 0, 100]),
            port: 80u16.to_be(),
            proto: PROTO_TCP,
            family: ADDR_FAMILY_V4,
        }
    }

    fn flow(port: u16, proto: u8) -> FlowKey {
        FlowKey {
            src: v4([10, 1, 0, 2]),
            dst: v4([10, 0, 0, 100]),
            src_port: port.to_be(),
            dst_port: 80u16.to_be(),
            proto,
            family: ADDR_FAMILY_V4,
            _pad: [0; 2],
        }
    }

    #[test]
    fn entries_travel_by_backend_address_and_land_on_the_peers_own_ids() {
        let backend = v4([10, 0, 0, 11]);
        // The same backend is id 3 on the sender and id 7 on the receiver.
        let sender = Directory::new([(vip(), 3, backend)]);
        let receiver = Directory::new([(vip(), 7, backend), (vip(), 8, v4([10, 0, 0, 12]))]);
        let key = flow(40_000, PROTO_TCP);
        let mine = FlowEntry {
            backend_id: 3,
            flags: FLOW_F_CLOSING,
            last_seen_ns: 0,
        };
        let sent = sender.export(&key, &mine, 5_500_000_000).unwrap();
        assert_eq!(
            (sent.backend, sent.age_s, sent.flags),
            (backend, 5, FLOW_F_CLOSING)
        );
        let now = 100_000_000_000;
        let learned = receiver.learn(&sent, now).unwrap();
        assert_eq!(learned.backend_id, 7);
        assert_eq!(learned.flags, FLOW_F_LEARNED | FLOW_F_CLOSING);
        assert_eq!(learned.last_seen_ns, now - 5_000_000_000);
        // A fresh entry is dated past the refresh granularity, so that its first packet
        // here makes it this node's own.
        let fresh = Entry { age_s: 0, ..sent };
        assert_eq!(
            receiver.learn(&fresh, now).unwrap().last_seen_ns,
            now - LAST_SEEN_GRANULARITY_NS - 1
        );
        // An id the sender does not know, a backend or VIP the receiver lacks: nothing.
        assert_eq!(
            sender.export(
                &key,
                &FlowEntry {
                    backend_id: 9,
                    ..mine
                },
                0
            ),
            None
        );
        let elsewhere = Entry {
            backend: v4([10, 0, 0, 99]),
            ..sent
        };
        assert_eq!(receiver.learn(&elsewhere, now), None);
        let other_port = Entry {
            key: FlowKey {
                dst_port: 443u16.to_be(),
                ..key
            },
            ..sent
        };
        assert_eq!(receiver.learn(&other_port, now), None);
    }

    #[test]
    fn dumps_carry_live_entries_only() {
        let entry = |flags| FlowEntry {
            backend_id: 1,
            flags,
            last_seen_ns: 0,
        };
        let idle = 30_000_000_000;
        let tcp = flow(1, PROTO_TCP);
        let udp = flow(1, PROTO_UDP);
        assert!(
            live(&tcp, &entry(0), 10 * idle, idle),
            "TCP holds while idle"
        );
        assert!(!live(&tcp, &entry(FLOW_F_CLOSING), 0, idle));
        assert!(live(&udp, &entry(0), idle, idle));
        assert!(!live(&udp, &entry(0), idle + 1, idle));
    }

    #[test]
    fn entries_are_batched_within_a_datagram() {
        let sender = Directory::new([(vip(), 3, v4([10, 0, 0, 11]))]);
        let entry = FlowEntry {
            backend_id: 3,
            flags: 0,
            last_seen_ns: 0,
        };
        let entries: Vec<Entry> = (0..45)
            .map(|p| sender.export(&flow(p, PROTO_TCP), &entry, 0).unwrap())
            .collect();
        let sizes: Vec<usize> = batches(&entries).map(<[Entry]>::len).collect();
        assert_eq!(sizes, [20, 20, 5]);
        for batch in batches(&entries) {
            let message = Message {
                kind: Kind::Entries,
                boot: 1,
                seq: 1,
                time_ms: 1,
                entries: batch.to_vec(),
            };
            assert!(wire::encode(&message, b"k").len() <= wire::MAX_DATAGRAM);
        }
    }

    #[test]
    fn the_key_must_be_private_and_long_enough() {
        let dir = std::env::temp_dir().join(format!("lb-cluster-key-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("key");
        std::fs::write(&path, "0123456789abcdef0123\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(read_key(&path).unwrap(), b"0123456789abcdef0123");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let open = read_key(&path).unwrap_err().to_string();
        assert!(
            open.contains("mode 644") && open.contains("chmod 600"),
            "{open}"
        );
        std::fs::write(&path, "short\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        let short = read_key(&path).unwrap_err().to_string();
        assert!(short.contains("5 bytes"), "{short}");
        assert!(read_key(&dir.join("missing")).is_err());
        assert!(
            read_key(&dir)
                .unwrap_err()
                .to_string()
                .contains("regular file")
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_socket_binds_the_nodes_own_address() {
        let config = ClusterConfig {
            peers: vec!["10.0.0.12".parse().unwrap()],
            port: 4790,
            key_file: "/k".into(),
            address: None,
            learn_timeout: Duration::from_secs(3),
            transfer_rate: 250_000,
        };
        let addresses: Vec<IpAddr> = ["fe80::1", "169.254.0.1", "10.0.0.2", "10.0.0.3"]
            .iter()
            .map(|a| a.parse().unwrap())
            .collect();
        assert_eq!(
            bind_address(&config, "eth0", &addresses).unwrap(),
            "10.0.0.2:4790".parse().unwrap()
        );
        assert!(bind_address(&config, "eth0", &addresses[..1]).is_err());
        let fixed = ClusterConfig {
            address: Some("10.0.0.9".parse().unwrap()),
            ..config
        };
        assert_eq!(
            bind_address(&fixed, "eth0", &[]).unwrap(),
            "10.0.0.9:4790".parse().unwrap()
        );
    }

    #[test]
    fn status_shows_when_each_peer_was_last_seen() {
        let now = Instant::now();
        let seen = SystemTime::UNIX_EPOCH + Duration::from_millis(1_796_000_000_250);
        let mut stats = Stats::default();
        let heard: IpAddr = "10.0.0.12".parse().unwrap();
        let silent: IpAddr = "10.0.0.13".parse().unwrap();
        stats.peers.insert(
            heard,
            PeerStats {
                last_contact: Some(now - Duration::from_secs(3)),
                last_seen: Some(seen),
                ..Default::default()
            },
        );
        stats.peers.insert(silent, PeerStats::default());
        let status = stats.status(&[], now);
        let peer = |address: IpAddr| {
            let address = address.to_string();
            status.peers.iter().find(|p| p.address == address).unwrap()
        };
        assert_eq!(peer(heard).last_seen_unix_seconds, Some(1_796_000_000.25));
        assert_eq!(peer(heard).last_contact_seconds, Some(3.0));
        assert_eq!(peer(silent).last_seen_unix_seconds, None);
        let json = serde_json::to_value(&status).unwrap();
        assert!(
            json["peers"][1]["last_seen_unix_seconds"].is_null(),
            "{json}"
        );
    }
}
