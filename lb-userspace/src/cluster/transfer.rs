//! The bulk transfer of a connection table to a node that joins (`stream` has the
//! messages): the answering side (`answer`, one task per joiner, the table read off the
//! async workers and kept for a resumption) and the learning side (`Learner`, one task
//! per peer, inserting each frame's entries as they come and showing its progress).
//!
//! TCP, not the datagrams: a table of 100,000 entries is 6.4 MB, which UDP loses in part
//! under load (the receiver's socket buffer overflows, and nothing says what was lost),
//! while TCP delivers all of it, in order, at the pace the joiner takes it. The answer is
//! paced too (`cluster.transfer_rate` entries per second), so that a join costs the
//! serving nodes a bounded share of a CPU. A connection that breaks is resumed where it stopped: the peer keeps its copy of
//! the table for that joiner (`KEEP_SNAPSHOT`).
//!
//! `learn_timeout` bounds the silence of a peer, not the transfer: a peer is given up
//! when nothing came from it for that long (it does not answer, or it stalled), while a
//! transfer that keeps delivering runs to its end however large the table is.

use std::{
    collections::{BTreeMap, VecDeque},
    net::{IpAddr, SocketAddr},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

pub use crate::status::{LearnStatus, PeerLearn, PeerLearnState, thousands};
use tokio::{
    io::AsyncWriteExt,
    net::{TcpSocket, TcpStream},
    time::timeout_at,
};
use tokio_util::sync::CancellationToken;

use super::{
    Shared,
    stream::{self, Answer, Request},
    wall_ns,
    wire::{self, Entry, Reject},
};

/// Answers running at once, at most: a further joiner is refused and asks again.
const MAX_ANSWERS: usize = 4;
/// How long a copy of the table is kept for its joiner to resume a broken transfer.
const KEEP_SNAPSHOT: Duration = Duration::from_secs(60);
/// An answer whose joiner takes nothing for this long is abandoned.
const STALL: Duration = Duration::from_secs(10);
/// How often a learning node logs its progress.
const PROGRESS_EVERY: Duration = Duration::from_secs(1);
/// The wait before asking again after a refused or broken connection.
const RETRY: Duration = Duration::from_millis(500);
/// Request nonces remembered (against replays within `wire::MAX_SKEW_MS`), at most.
const MAX_NONCES: usize = 4096;

#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("refused: {0}")]
    Refused(#[from] Reject),
    #[error("no answer within learn_timeout")]
    Silent,
    #[error("the answer broke its order ({0})")]
    Order(String),
    #[error("reading the connection table: {0}")]
    Scan(String),
    #[error("{MAX_ANSWERS} transfers already under way")]
    Busy,
}

impl From<tokio::time::error::Elapsed> for TransferError {
    fn from(_: tokio::time::error::Elapsed) -> Self {
        TransferError::Silent
    }
}

// ---- answering ----

/// Reads this node's live entries, in the peers' form.
pub type Scan = Arc<dyn Fn() -> Result<Vec<Entry>, String> + Send + Sync>;

/// What answers share: the copies kept for resumption, the nonces seen, how many run.
#[derive(Default)]
pub struct Answers {
    inner: Mutex<AnswersInner>,
}

#[derive(Default)]
struct AnswersInner {
    kept: Vec<Kept>,
    last_id: u64,
    nonces: VecDeque<([u8; 16], Instant)>,
    running: usize,
}

/// A copy of the table made for one run of one joiner.
struct Kept {
    peer: IpAddr,
    boot: u64,
    id: u64,
    entries: Arc<Vec<Entry>>,
    at: Instant,
}

impl Answers {
    fn lock(&self) -> std::sync::MutexGuard<'_, AnswersInner> {
        self.inner.lock().expect("cluster answers poisoned")
    }

    /// Accepts a request once, and only while fresh.
    fn admit(&self, request: &Request, now_ms: u64) -> Result<(), Reject> {
        if request.time_ms.abs_diff(now_ms) > wire::MAX_SKEW_MS {
            return Err(Reject::Stale);
        }
        let mut inner = self.lock();
        let horizon = Duration::from_millis(2 * wire::MAX_SKEW_MS);
        while inner
            .nonces
            .front()
            .is_some_and(|(_, at)| at.elapsed() > horizon)
            || inner.nonces.len() >= MAX_NONCES
        {
            inner.nonces.pop_front();
        }
        if inner.nonces.iter().any(|(n, _)| *n == request.nonce) {
            return Err(Reject::Replay);
        }
        inner.nonces.push_back((request.nonce, Instant::now()));
        Ok(())
    }

    /// A slot to answer in, unless `MAX_ANSWERS` run.
    fn enter(self: &Arc<Self>) -> Option<Running> {
        let mut inner = self.lock();
        if inner.running >= MAX_ANSWERS {
            return None;
        }
        inner.running += 1;
        Some(Running(self.clone()))
    }

    /// The copy this joiner's run asks to resume, if kept.
    fn resume(&self, peer: IpAddr, request: &Request) -> Option<(u64, Arc<Vec<Entry>>)> {
        let mut inner = self.lock();
        inner.kept.retain(|k| k.at.elapsed() < KEEP_SNAPSHOT);
        inner
            .kept
            .iter()
            .find(|k| k.peer == peer && k.boot == request.boot && k.id == request.snapshot)
            .map(|k| (k.id, k.entries.clone()))
    }

    /// Keeps `entries` for this joiner's run (replacing an earlier copy for it).
    fn keep(&self, peer: IpAddr, boot: u64, entries: Arc<Vec<Entry>>) -> u64 {
        let mut inner = self.lock();
        inner.last_id += 1;
        let id = inner.last_id;
        inner.kept.retain(|k| k.peer != peer);
        inner.kept.push(Kept {
            peer,
            boot,
            id,
            entries,
            at: Instant::now(),
        });
        id
    }
}

/// One answer under way; its slot frees when dropped.
struct Running(Arc<Answers>);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.lock().running -= 1;
    }
}

/// What an answer needs.
pub struct AnswerContext {
    pub key: Arc<[u8]>,
    /// The most entries per second one answer sends (`cluster.transfer_rate`): what a
    /// join may cost this node stays bounded whatever the size of its table.
    pub rate: u64,
    pub answers: Arc<Answers>,
    pub scan: Scan,
    pub stats: Shared,
}

/// Writes answer frames, counting them.
struct Sender<'a> {
    conn: &'a mut TcpStream,
    key: &'a [u8],
    nonce: [u8; 16],
    index: u64,
    bytes: u64,
}

impl Sender<'_> {
    async fn send(&mut self, answer: &Answer) -> Result<(), TransferError> {
        let frame = stream::encode_answer(answer, self.key, &self.nonce, self.index);
        self.index += 1;
        self.bytes += frame.len() as u64;
        tokio::time::timeout(STALL, self.conn.write_all(&frame)).await??;
        Ok(())
    }
}

/// Answers one joiner's request on `conn` (from `peer`, one of the configured peers).
pub async fn answer(mut conn: TcpStream, peer: IpAddr, context: Arc<AnswerContext>) {
    let started = Instant::now();
    match serve(&mut conn, peer, &context).await {
        Ok((sent, bytes)) => {
            tracing::info!(
                "cluster: sent {} entries to {peer} in {:.2}s",
                thousands(sent),
                started.elapsed().as_secs_f64()
            );
            let mut stats = context.stats.lock().expect("cluster stats poisoned");
            let peer_stats = stats.peers.entry(peer).or_default();
            peer_stats.sent += sent;
            peer_stats.bytes_sent += bytes;
        }
        Err(TransferError::Refused(reject)) => {
            tracing::warn!("cluster: refused a transfer request from {peer}: {reject}");
            let mut stats = context.stats.lock().expect("cluster stats poisoned");
            let peer_stats = stats.peers.entry(peer).or_default();
            peer_stats.rejected += 1;
            peer_stats.last_reject = Some(reject.to_string());
        }
        Err(error) => tracing::info!("cluster: answering {peer}: {error}"),
    }
}

/// Serves one request: returns the entries and bytes sent.
async fn serve(
    conn: &mut TcpStream,
    peer: IpAddr,
    context: &AnswerContext,
) -> Result<(u64, u64), TransferError> {
    let (body, tag) = tokio::time::timeout(STALL, stream::read_frame(conn)).await??;
    let request = stream::decode_request(&body, &tag, &context.key)?;
    context.answers.admit(&request, wall_ns() / 1_000_000)?;
    let _slot = context.answers.enter().ok_or(TransferError::Busy)?;
    let mut out = Sender {
        conn,
        key: &context.key,
        nonce: request.nonce,
        index: 0,
        bytes: 0,
    };
    out.send(&Answer::Accepted).await?;
    let (snapshot, entries, from) = match context.answers.resume(peer, &request) {
        Some((id, entries)) => {
            let from = request.from.min(entries.len() as u64);
            tracing::info!(
                "cluster: {peer} resumes its transfer at {} of {}",
                thousands(from),
                thousands(entries.len() as u64)
            );
            (id, entries, from)
        }
        None => {
            let scan = context.scan.clone();
            let entries = tokio::task::spawn_blocking(move || scan())
                .await
                .map_err(|e| TransferError::Scan(e.to_string()))?
                .map_err(TransferError::Scan)?;
            let entries = Arc::new(entries);
            tracing::info!(
                "cluster: {peer} asked for our entries: sending {}",
                thousands(entries.len() as u64)
            );
            let id = context.answers.keep(peer, request.boot, entries.clone());
            (id, entries, 0)
        }
    };
    let total = entries.len() as u64;
    out.send(&Answer::Start {
        snapshot,
        total,
        from,
    })
    .await?;
    let paced = Instant::now();
    let mut sent = 0u64;
    for (i, chunk) in entries[from as usize..]
        .chunks(stream::FRAME_ENTRIES)
        .enumerate()
    {
        let first = from + (i * stream::FRAME_ENTRIES) as u64;
        out.send(&Answer::Entries {
            first,
            entries: chunk.to_vec(),
        })
        .await?;
        sent += chunk.len() as u64;
        // Ahead of the rate: wait until the entries sent are due.
        let due = Duration::from_secs_f64(sent as f64 / context.rate.max(1) as f64);
        if let Some(wait) = due.checked_sub(paced.elapsed()) {
            tokio::time::sleep(wait).await;
        }
    }
    out.send(&Answer::Done { total }).await?;
    let bytes = out.bytes;
    conn.shutdown().await?;
    Ok((sent, bytes))
}

// ---- learning ----

/// Learning from all peers, from each peer's progress and its start and end.
pub fn learn_status(
    peers: &BTreeMap<IpAddr, (PeerLearn, Instant, Option<Instant>)>,
) -> LearnStatus {
    let peers: Vec<PeerLearn> = peers
        .values()
        .map(|(learn, started, ended)| PeerLearn {
            seconds: ended
                .unwrap_or_else(Instant::now)
                .saturating_duration_since(*started)
                .as_secs_f64(),
            ..learn.clone()
        })
        .collect();
    LearnStatus {
        received: peers.iter().map(|p| p.received).sum(),
        total: peers.iter().map(|p| p.total.unwrap_or(p.received)).sum(),
        inserted: peers.iter().map(|p| p.inserted).sum(),
        peers,
    }
}

/// Inserts a peer's entries here: returns (inserted, unknown here).
pub type Insert = Arc<dyn Fn(&[Entry]) -> (u64, u64) + Send + Sync>;

/// Learns one peer's table.
pub struct Learner {
    /// The peer's cluster address and port.
    pub peer: SocketAddr,
    /// This node's cluster address: the peer accepts requests from its peers only.
    pub local: IpAddr,
    pub key: Arc<[u8]>,
    /// This run (`wire::Message::boot`).
    pub boot: u64,
    pub timeout: Duration,
    pub insert: Insert,
    pub stats: Shared,
}

/// Where an interrupted transfer resumes.
#[derive(Default)]
struct Resume {
    snapshot: u64,
    next: u64,
    total: Option<u64>,
}

impl Learner {
    fn update(&self, change: impl FnOnce(&mut PeerLearn, &mut Option<Instant>)) {
        let mut stats = self.stats.lock().expect("cluster stats poisoned");
        let (learn, _, ended) = stats.learn.entry(self.peer.ip()).or_insert_with(|| {
            let learn = PeerLearn {
                address: self.peer.ip().to_string(),
                ..PeerLearn::default()
            };
            (learn, Instant::now(), None)
        });
        change(learn, ended);
    }

    /// Asks until the peer's whole table came, or nothing came for `timeout`.
    pub async fn run(self, shutdown: CancellationToken) {
        let peer = self.peer.ip();
        self.update(|_, _| {});
        let started = Instant::now();
        let mut at = Resume::default();
        let mut last_progress = Instant::now();
        loop {
            let outcome = tokio::select! {
                _ = shutdown.cancelled() => return,
                outcome = self.attempt(&mut at, &mut last_progress) => outcome,
            };
            let error = match outcome {
                Ok(()) => {
                    let mut inserted = 0;
                    self.update(|learn, ended| {
                        learn.state = PeerLearnState::Done;
                        *ended = Some(Instant::now());
                        inserted = learn.inserted;
                    });
                    tracing::info!(
                        "cluster: learned {} of {} entries from {peer} ({} new here) in {:.2}s",
                        thousands(at.next),
                        thousands(at.total.unwrap_or(at.next)),
                        thousands(inserted),
                        started.elapsed().as_secs_f64()
                    );
                    return;
                }
                Err(error) => error,
            };
            if last_progress.elapsed() >= self.timeout {
                self.update(|learn, ended| {
                    learn.state = PeerLearnState::NoAnswer;
                    *ended = Some(Instant::now());
                });
                tracing::warn!(
                    "cluster: nothing from {peer} for learn_timeout ({:?}; {error}): giving \
                     it up with {} of {} entries",
                    self.timeout,
                    thousands(at.next),
                    at.total.map_or("?".into(), thousands)
                );
                return;
            }
            if at.next > 0 {
                self.update(|learn, _| learn.resumed += 1);
                tracing::info!(
                    "cluster: the transfer from {peer} broke at {} ({error}); resuming",
                    thousands(at.next)
                );
            } else {
                tracing::debug!("cluster: asking {peer}: {error}");
            }
            let wait = RETRY.min(self.timeout.saturating_sub(last_progress.elapsed()));
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(wait) => {}
            }
        }
    }

    /// One connection: asks (resuming at `at`), takes frames until `Done`.
    async fn attempt(
        &self,
        at: &mut Resume,
        last_progress: &mut Instant,
    ) -> Result<(), TransferError> {
        let deadline = |last: Instant| tokio::time::Instant::from_std(last + self.timeout);
        let socket = match self.peer {
            SocketAddr::V4(_) => TcpSocket::new_v4()?,
            SocketAddr::V6(_) => TcpSocket::new_v6()?,
        };
        socket.bind(SocketAddr::new(self.local, 0))?;
        let mut conn = timeout_at(deadline(*last_progress), socket.connect(self.peer)).await??;
        let nonce = nonce();
        let request = Request {
            boot: self.boot,
            time_ms: wall_ns() / 1_000_000,
            nonce,
            snapshot: at.snapshot,
            from: at.next,
        };
        conn.write_all(&stream::encode_request(&request, &self.key))
            .await?;
        let mut logged = Instant::now();
        let mut index = 0;
        loop {
            let (body, tag) =
                timeout_at(deadline(*last_progress), stream::read_frame(&mut conn)).await??;
            let answer = stream::decode_answer(&body, &tag, &self.key, &nonce, index)?;
            index += 1;
            *last_progress = Instant::now();
            match answer {
                Answer::Accepted => {}
                Answer::Start {
                    snapshot,
                    total,
                    from,
                } => {
                    // Another copy than asked for (the peer's was gone): from its start.
                    *at = Resume {
                        snapshot,
                        next: from,
                        total: Some(total),
                    };
                    self.update(|learn, _| {
                        learn.state = PeerLearnState::Receiving;
                        learn.total = Some(total);
                        learn.received = from;
                    });
                }
                Answer::Entries { first, entries } => {
                    if first != at.next {
                        return Err(TransferError::Order(format!(
                            "entries from {first}, expected {}",
                            at.next
                        )));
                    }
                    let insert = self.insert.clone();
                    let count = entries.len() as u64;
                    let (inserted, _) = tokio::task::spawn_blocking(move || insert(&entries))
                        .await
                        .map_err(|e| TransferError::Scan(e.to_string()))?;
                    at.next += count;
                    self.update(|learn, _| {
                        learn.received = at.next;
                        learn.inserted += inserted;
                    });
                    if logged.elapsed() >= PROGRESS_EVERY {
                        logged = Instant::now();
                        tracing::info!(
                            "cluster: learned {} of {} entries from {}",
                            thousands(at.next),
                            at.total.map_or("?".into(), thousands),
                            self.peer.ip()
                        );
                    }
                }
                Answer::Done { total } => {
                    if at.next != total {
                        return Err(TransferError::Order(format!(
                            "done at {} of {total}",
                            at.next
                        )));
                    }
                    return Ok(());
                }
            }
        }
    }
}

/// 16 bytes no request had before: the kernel's random numbers.
fn nonce() -> [u8; 16] {
    let mut nonce = [0u8; 16];
    // getrandom(2) does not fail for 16 bytes once the pool is ready; the wall clock
    // stands in otherwise (uniqueness is what matters).
    // SAFETY: the kernel writes at most 16 bytes into `nonce`.
    let got = unsafe { libc::getrandom(nonce.as_mut_ptr().cast(), nonce.len(), 0) };
    if got != nonce.len() as isize {
        nonce[..8].copy_from_slice(&wall_ns().to_be_bytes());
    }
    nonce
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_read_with_thousands_separated() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(61_000), "61,000");
        assert_eq!(thousands(100_140), "100,140");
        assert_eq!(thousands(1_234_567), "1,234,567");
    }

    fn request(nonce: u8, time_ms: u64) -> Request {
        Request {
            boot: 1,
            time_ms,
            nonce: [nonce; 16],
            snapshot: 0,
            from: 0,
        }
    }

    #[test]
    fn a_request_is_answered_once_and_only_while_fresh() {
        let answers = Answers::default();
        let now = 1_000_000;
        assert_eq!(answers.admit(&request(1, now), now), Ok(()));
        assert_eq!(answers.admit(&request(1, now), now), Err(Reject::Replay));
        assert_eq!(answers.admit(&request(2, now), now), Ok(()));
        assert_eq!(
            answers.admit(&request(3, now - wire::MAX_SKEW_MS - 1), now),
            Err(Reject::Stale)
        );
    }

    #[test]
    fn a_kept_copy_resumes_only_for_its_joiners_run() {
        let answers = Arc::new(Answers::default());
        let peer: IpAddr = "10.0.0.3".parse().unwrap();
        let id = answers.keep(peer, 7, Arc::new(Vec::new()));
        let asking = |boot, snapshot| Request {
            boot,
            snapshot,
            ..request(1, 0)
        };
        assert_eq!(answers.resume(peer, &asking(7, id)).map(|r| r.0), Some(id));
        assert!(
            answers.resume(peer, &asking(8, id)).is_none(),
            "another run"
        );
        assert!(answers.resume(peer, &asking(7, id + 1)).is_none());
        let other: IpAddr = "10.0.0.4".parse().unwrap();
        assert!(answers.resume(other, &asking(7, id)).is_none());
        // A new copy for the same joiner replaces the old one.
        let newer = answers.keep(peer, 8, Arc::new(Vec::new()));
        assert!(answers.resume(peer, &asking(7, id)).is_none());
        assert!(answers.resume(peer, &asking(8, newer)).is_some());
    }

    #[test]
    fn answers_beyond_the_limit_wait_their_turn() {
        let answers = Arc::new(Answers::default());
        let slots: Vec<Running> = (0..MAX_ANSWERS).map(|_| answers.enter().unwrap()).collect();
        assert!(answers.enter().is_none());
        drop(slots);
        assert!(answers.enter().is_some());
    }

    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::AsyncReadExt;
    use tokio::net::TcpListener;

    const KEY: &[u8] = b"0123456789abcdef0123456789abcdef";

    /// Entry `i` of a synthetic table.
    fn entry(i: u32) -> Entry {
        let mut src = [0u8; 16];
        src[..4].copy_from_slice(&i.to_be_bytes());
        Entry {
            key: lb_common::FlowKey {
                src,
                dst: [10, 0, 0, 100, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
                src_port: 1,
                dst_port: 80u16.to_be(),
                proto: lb_common::PROTO_TCP,
                family: lb_common::ADDR_FAMILY_V4,
                _pad: [0; 2],
            },
            backend: [10, 0, 0, 11, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            age_s: 0,
            flags: 0,
        }
    }

    /// A peer answering from a table of `n` entries at `rate` on 127.0.0.1; returns
    /// its address and how many times it read its table.
    async fn answering_peer(n: u32, rate: u64) -> (SocketAddr, Arc<AtomicUsize>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let scans = Arc::new(AtomicUsize::new(0));
        let counted = scans.clone();
        let context = Arc::new(AnswerContext {
            key: KEY.into(),
            rate,
            answers: Arc::new(Answers::default()),
            scan: Arc::new(move || {
                counted.fetch_add(1, Ordering::SeqCst);
                Ok((0..n).map(entry).collect())
            }),
            stats: Shared::default(),
        });
        tokio::spawn(async move {
            while let Ok((conn, from)) = listener.accept().await {
                tokio::spawn(answer(conn, from.ip(), context.clone()));
            }
        });
        (address, scans)
    }

    /// A learner of `peer` that collects what it inserts.
    fn learner(peer: SocketAddr, timeout: Duration) -> (Learner, Arc<Mutex<Vec<Entry>>>, Shared) {
        let got = Arc::new(Mutex::new(Vec::new()));
        let stats = Shared::default();
        let sink = got.clone();
        let learner = Learner {
            peer,
            local: "127.0.0.1".parse().unwrap(),
            key: KEY.into(),
            boot: 1,
            timeout,
            insert: Arc::new(move |entries: &[Entry]| {
                sink.lock().unwrap().extend_from_slice(entries);
                (entries.len() as u64, 0)
            }),
            stats: stats.clone(),
        };
        (learner, got, stats)
    }

    fn peer_learn(stats: &Shared, peer: SocketAddr) -> PeerLearn {
        stats.lock().unwrap().learn[&peer.ip()].0.clone()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_transfer_longer_than_learn_timeout_completes_while_it_progresses() {
        // 3,000 entries at 4,000/s: about 0.75 s, three times the timeout.
        let (peer, _) = answering_peer(3_000, 4_000).await;
        let (learner, got, stats) = learner(peer, Duration::from_millis(250));
        let started = Instant::now();
        learner.run(CancellationToken::new()).await;
        let learn = peer_learn(&stats, peer);
        assert_eq!(learn.state, PeerLearnState::Done, "{learn:?}");
        assert!(started.elapsed() > Duration::from_millis(500));
        assert_eq!((learn.received, learn.total), (3_000, Some(3_000)));
        assert_eq!(
            *got.lock().unwrap(),
            (0..3_000).map(entry).collect::<Vec<_>>()
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_silent_peer_is_given_up_after_learn_timeout() {
        // Accepts, never answers.
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let peer = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((conn, _)) = listener.accept().await {
                held.push(conn);
            }
        });
        let (learner, got, stats) = learner(peer, Duration::from_millis(300));
        let started = Instant::now();
        learner.run(CancellationToken::new()).await;
        assert_eq!(peer_learn(&stats, peer).state, PeerLearnState::NoAnswer);
        assert!(started.elapsed() >= Duration::from_millis(300));
        assert!(got.lock().unwrap().is_empty());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_broken_connection_resumes_where_it_stopped() {
        let (answerer, scans) = answering_peer(5_000, 1_000_000).await;
        // Between the two, a proxy that cuts the first connection after 100 KB of
        // answer (three frames and part of a fourth) and lets the later ones through.
        let proxy = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let peer = proxy.local_addr().unwrap();
        tokio::spawn(async move {
            let mut first = true;
            while let Ok((mut joiner, _)) = proxy.accept().await {
                let mut upstream = tokio::net::TcpStream::connect(answerer).await.unwrap();
                let cut = first.then_some(100_000usize);
                first = false;
                tokio::spawn(async move {
                    let (mut jr, mut jw) = joiner.split();
                    let (mut ur, mut uw) = upstream.split();
                    let ask = async {
                        let _ = tokio::io::copy(&mut jr, &mut uw).await;
                    };
                    let answer = async {
                        let mut passed = 0;
                        let mut buffer = vec![0u8; 8192];
                        loop {
                            let n = ur.read(&mut buffer).await.unwrap_or(0);
                            let n = cut.map_or(n, |cut| n.min(cut - passed));
                            if n == 0 || jw.write_all(&buffer[..n]).await.is_err() {
                                return;
                            }
                            passed += n;
                        }
                    };
                    tokio::select! { _ = ask => {}, _ = answer => {} }
                });
            }
        });
        let (learner, got, stats) = learner(peer, Duration::from_secs(2));
        learner.run(CancellationToken::new()).await;
        let learn = peer_learn(&stats, peer);
        assert_eq!(learn.state, PeerLearnState::Done, "{learn:?}");
        assert_eq!(learn.resumed, 1, "{learn:?}");
        // Every entry once, in order: the second connection began where the first broke.
        assert_eq!(
            *got.lock().unwrap(),
            (0..5_000).map(entry).collect::<Vec<_>>()
        );
        // The answering side read its table once: the resumption used the kept copy.
        assert_eq!(scans.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn the_learning_line_sums_the_peers() {
        let now = Instant::now();
        let mut peers = BTreeMap::new();
        let peer = |address: &str, state, received, total| PeerLearn {
            address: address.into(),
            state,
            received,
            total,
            inserted: received / 2,
            resumed: 0,
            seconds: 0.0,
        };
        peers.insert(
            "10.0.0.2".parse().unwrap(),
            (
                peer("10.0.0.2", PeerLearnState::Receiving, 31_000, Some(50_070)),
                now,
                None,
            ),
        );
        peers.insert(
            "10.0.0.3".parse().unwrap(),
            (
                peer("10.0.0.3", PeerLearnState::Receiving, 30_000, Some(50_070)),
                now,
                None,
            ),
        );
        let status = learn_status(&peers);
        assert_eq!((status.received, status.total), (61_000, 100_140));
        let line = status.to_string();
        assert!(line.starts_with("learned 61,000 of 100,140"), "{line}");
        assert!(
            line.contains("10.0.0.3 receiving 30,000 of 50,070"),
            "{line}"
        );
    }
}
