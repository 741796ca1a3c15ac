//! Passive health (`[vip.outlier]`): backends judged by the TCP handshakes of real
//! clients, which the data path counts per backend (`lb_common::handshake`). Every
//! `SAMPLE` the agent reads the counters of the VIPs' backends; over `window`, a backend
//! with at least `min_handshakes` handshakes judged and more than `max_failure` of them
//! not completed, while its healthy peers (those within `max_failure`) completed at least
//! `PEER_GAP` more of theirs (so a failure common to every backend, on the client side or
//! in the network, ejects no one: it leaves no healthy peer), and by more than chance
//! (their Wilson intervals at 99.7% apart), leaves the Maglev table (its established flows stay) for `eject`,
//! one `eject` longer on each repeat. Never more than `max_ejected` of a VIP's backends
//! are out at once: the worst go first. A backend returns when its time is up and only
//! while its active checks pass; slow start applies as for any backend entering the
//! table (`LoadState::ramps_on_entry`).
//!
//! Judged are handshakes seen twice (`handshake::Judged`): completed, or retried by the
//! client (a real client whose SYN goes unanswered sends it again; a spoofed SYN is never
//! seen again). So a SYN flood of random sources judges no one; a flood that repeats each
//! SYN hits every backend alike and meets the peer rule; `max_ejected` bounds the rest.
//!
//! Pure: the counters come in as readings, the model's backends are changed in place,
//! and what happened comes back as `Event`s; `sample` is the agent's step around it.

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::{Duration, Instant};

use lb_common::handshake::{self, COUNT, Judged};

use crate::config::OutlierConfig;
use crate::dataplane::{CounterReader, DataplaneError};
use crate::model::{
    BackendState, Model,
    outlier::{Ejection, Outlier},
};
use crate::status::{Handshakes, OutlierStatus};

/// How often the agent reads the handshake counters; a window holds at least two.
pub use crate::config::OUTLIER_SAMPLE as SAMPLE;
/// A backend is ejected only while its healthy peers (those within `max_failure`, pooled)
/// completed at least this share more of their handshakes than it did: a problem every
/// backend shares leaves no healthy peer, and noise between similar backends is smaller.
pub const PEER_GAP: f64 = 0.5;
/// An ejection lasts `eject` times the repeats in a row, at most this many times.
pub const MAX_EJECT_FACTOR: u32 = 10;

/// What a sample did to a backend.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    Ejected {
        backend: IpAddr,
        reason: String,
        lasts: Duration,
    },
    Returned {
        backend: IpAddr,
    },
    /// Its numbers call for an ejection, but `max_ejected` backends are out already.
    HeldBack {
        backend: IpAddr,
        reason: String,
    },
}

/// The share of `judged` handshakes that completed (1 with none judged).
fn success(judged: Judged) -> f64 {
    if judged.started == 0 {
        return 1.0;
    }
    judged.completed as f64 / judged.started as f64
}

/// `z` of the confidence intervals that must part a backend from its peers (99.7%,
/// two-sided). A backend is judged every `SAMPLE`, against peers chosen because they look
/// healthy; in a simulation of the client-loss test (four backends, 2.5-5 judged per
/// backend per sample, 12 samples, a shared 65-75% completion) z = 1.96 still ejected
/// someone in 8-19% of runs, 2.58 in about 1%, 3 in 0.1%, and a backend that dropped every
/// handshake was ejected as early at each.
const Z: f64 = 3.0;

/// The Wilson score interval of the share of `judged` handshakes that completed: where
/// the backend's true share lies, at confidence `Z`, given how few handshakes it had.
fn success_interval(judged: Judged) -> (f64, f64) {
    if judged.started == 0 {
        return (0.0, 1.0);
    }
    let (n, p) = (judged.started as f64, success(judged));
    let z2 = Z * Z;
    let center = (p + z2 / (2.0 * n)) / (1.0 + z2 / n);
    let half = Z * (p * (1.0 - p) / n + z2 / (4.0 * n * n)).sqrt() / (1.0 + z2 / n);
    (center - half, center + half)
}

/// One sample of a VIP's backends: takes `readings` (cumulative handshake counters by
/// backend id), returns to the table the ejected backends whose time is up, and ejects
/// the outliers `settings` allow. Returns what happened.
pub fn judge(
    settings: &OutlierConfig,
    backends: &mut [BackendState],
    readings: &HashMap<u32, [u64; COUNT]>,
    now: Instant,
) -> Vec<Event> {
    let mut events = Vec::new();
    for b in backends.iter_mut() {
        if let Some(reading) = readings.get(&b.id) {
            b.outlier.record(now, *reading, settings.window);
        }
        give_back(settings, b, now, &mut events);
    }
    let candidates = outliers(settings, backends);
    let allowed = (settings.max_ejected * backends.len() as f64 + 1e-9).floor() as usize;
    let mut out = backends.iter().filter(|b| b.outlier.is_ejected()).count();
    let held: Vec<usize> = candidates.iter().map(|(i, _)| *i).collect();
    for b in backends
        .iter_mut()
        .enumerate()
        .filter(|(i, _)| !held.contains(i))
    {
        b.1.outlier.held_back = false;
    }
    for (i, reason) in candidates {
        let b = &mut backends[i];
        if out >= allowed {
            if !b.outlier.held_back {
                b.outlier.held_back = true;
                events.push(Event::HeldBack {
                    backend: b.config.address,
                    reason,
                });
            }
            continue;
        }
        out += 1;
        let o = &mut b.outlier;
        o.held_back = false;
        o.repeats += 1;
        let lasts = settings.eject * o.repeats.min(MAX_EJECT_FACTOR);
        o.ejected = Some(Ejection {
            until: now + lasts,
            reason: reason.clone(),
        });
        o.ejections_total += 1;
        o.last_reason = Some(reason.clone());
        o.forgive_at = None;
        events.push(Event::Ejected {
            backend: b.config.address,
            reason,
            lasts,
        });
    }
    events
}

/// An ejected backend whose time is up returns while its checks pass; one in the table
/// is forgiven a repeat for each `eject` it stays.
fn give_back(
    settings: &OutlierConfig,
    b: &mut BackendState,
    now: Instant,
    events: &mut Vec<Event>,
) {
    let pass = b.alive();
    let o = &mut b.outlier;
    match &o.ejected {
        Some(ejection) if ejection.until <= now && pass => {
            o.ejected = None;
            o.restart_window();
            o.forgive_at = Some(now + settings.eject);
            events.push(Event::Returned {
                backend: b.config.address,
            });
        }
        Some(_) => {}
        None => {
            if let Some(at) = o.forgive_at
                && at <= now
            {
                o.repeats = o.repeats.saturating_sub(1);
                o.forgive_at = (o.repeats > 0).then(|| now + settings.eject);
            }
        }
    }
}

/// The backends in the table that fail their clients beyond `max_failure` and beyond
/// their peers, worst first, each with the reason.
fn outliers(settings: &OutlierConfig, backends: &[BackendState]) -> Vec<(usize, String)> {
    let mut found: Vec<(usize, f64, String)> = Vec::new();
    for (i, b) in backends.iter().enumerate() {
        let judged = b.outlier.window;
        if !b.in_table() || judged.started < settings.min_handshakes {
            continue;
        }
        let own = success(judged);
        if 1.0 - own <= settings.max_failure {
            continue;
        }
        let healthy = |p: &BackendState| 1.0 - success(p.outlier.window) <= settings.max_failure;
        let peers = backends
            .iter()
            .enumerate()
            .filter(|(j, p)| *j != i && p.in_table() && healthy(p))
            .fold(Judged::default(), |sum, (_, p)| Judged {
                started: sum.started + p.outlier.window.started,
                completed: sum.completed + p.outlier.window.completed,
            });
        // Without enough handshakes at healthy peers, nothing says the failure is the
        // backend's rather than the clients' or the network's.
        if peers.started < settings.min_handshakes {
            continue;
        }
        let peers_share = success(peers);
        if peers_share - own < PEER_GAP {
            continue;
        }
        // And beyond chance: in a small window a backend trails peers by 50 points at
        // random when every backend loses handshakes alike (2 of 6 against 10 of 12), the
        // more so as the peers pooled are those that happen to look healthy. Its share
        // must be below theirs with both intervals (`Z`) apart.
        if success_interval(judged).1 >= success_interval(peers).0 {
            continue;
        }
        let reason = format!(
            "{} of {} handshakes completed in {}; peers {:.0}%",
            judged.completed,
            judged.started,
            humantime::format_duration(settings.window),
            peers_share * 100.0
        );
        found.push((i, own, reason));
    }
    found.sort_by(|a, b| a.1.total_cmp(&b.1));
    found
        .into_iter()
        .map(|(i, _, reason)| (i, reason))
        .collect()
}

/// Ends every ejection of a VIP that has no `[vip.outlier]` (any more). Returns whether
/// one ended.
fn release_all(backends: &mut [BackendState]) -> bool {
    let mut changed = false;
    for b in backends {
        if b.outlier.ejected.take().is_some() {
            b.outlier.restart_window();
            changed = true;
        }
    }
    changed
}

/// Cumulative handshake counters by backend id, as one sample read them.
pub type Readings = HashMap<u32, [u64; COUNT]>;

/// The backends whose handshakes a sample reads: those of VIPs with `[vip.outlier]`.
pub fn backends_to_read(model: &Model) -> Vec<u32> {
    model
        .vips
        .iter()
        .filter(|v| v.config.outlier.is_some())
        .flat_map(|v| v.backends.iter().map(|b| b.id))
        .collect()
}

/// Reads the handshake counters of backends `ids` through `reader` (no lock: the agent's
/// is not held while it reads, nor is the writer's).
pub fn read(reader: &CounterReader, ids: &[u32]) -> Result<Readings, DataplaneError> {
    if ids.is_empty() {
        return Ok(Readings::new());
    }
    let counters = reader.counters(&[], ids)?;
    Ok(counters
        .backends
        .iter()
        .map(|(id, c)| (*id, c.handshakes))
        .collect())
}

/// The agent's step, every `SAMPLE`: judges the backends of VIPs with `[vip.outlier]` by
/// `readings` (read before, `read`), logs what happened. Returns whether the table
/// membership changed (the caller asks for new tables). A backend added since the read
/// has no reading: it is judged at the next sample.
pub fn sample(model: &mut Model, readings: &Readings, now: Instant) -> bool {
    let mut changed = false;
    for vip in &mut model.vips {
        let Some(settings) = &vip.config.outlier else {
            if release_all(&mut vip.backends) {
                tracing::info!(
                    "vip {}: no [vip.outlier] any more: its ejected backends return",
                    vip.config.name
                );
                changed = true;
            }
            continue;
        };
        for event in judge(settings, &mut vip.backends, readings, now) {
            changed |= !matches!(event, Event::HeldBack { .. });
            log(&vip.config.name, &event);
        }
    }
    changed
}

/// A backend's handshake counters as status shows them.
pub fn totals(traffic: &lb_common::TrafficCounters) -> Handshakes {
    let count = |event: u32| traffic.handshakes[event as usize];
    Handshakes {
        started: count(handshake::STARTED),
        retried: count(handshake::RETRIED),
        completed: count(handshake::COMPLETED),
    }
}

/// A backend's passive health as status shows it.
pub fn status(o: &Outlier, now: Instant) -> OutlierStatus {
    OutlierStatus {
        started: o.window.started,
        completed: o.window.completed,
        ejected_until: o.ejected.as_ref().map(|e| {
            crate::status::unix_now() + e.until.saturating_duration_since(now).as_secs_f64()
        }),
        reason: o.last_reason.clone(),
        ejections: o.ejections_total,
    }
}

fn log(vip: &str, event: &Event) {
    match event {
        Event::Ejected {
            backend,
            reason,
            lasts,
        } => tracing::warn!(
            "backend {backend} of vip {vip} ejected for {}: {reason}",
            humantime::format_duration(*lasts)
        ),
        Event::Returned { backend } => {
            tracing::info!("backend {backend} of vip {vip} returns from ejection (its checks pass)")
        }
        Event::HeldBack { backend, reason } => tracing::warn!(
            "backend {backend} of vip {vip} is not ejected: max_ejected of the vip's \
             backends are out already ({reason})"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Config, ConfigError, MacAddr};
    use crate::model::Health;
    use lb_common::handshake::{COMPLETED, RETRIED, STARTED};

    const VIP: &str = "[dataplane]\ninterface = \"eth0\"\nmaglev_table_size = 7\n\
        [[vip]]\nname = \"web\"\naddress = \"10.0.0.100\"\nport = 80\nprotocol = \"tcp\"\n";

    fn config(n: usize, outlier: &str) -> Config {
        let mut text = format!("{VIP}[vip.outlier]\n{outlier}\n");
        for i in 0..n {
            text += &format!("[[vip.backend]]\naddress = \"10.0.0.{}\"\n", 11 + i);
        }
        Config::from_toml(&text).unwrap()
    }

    /// A model of `n` backends, all up, in the table.
    fn model(n: usize, outlier: &str) -> (Model, OutlierConfig) {
        let config = config(n, outlier);
        let mut model = Model::new(7, 16, Duration::ZERO);
        model.update(&config).unwrap();
        for b in model.backends_mut() {
            b.mac = Some(MacAddr([2, 0, 0, 0, 0, b.id as u8]));
            b.health = Health::Up;
        }
        (model, config.vips[0].outlier.clone().unwrap())
    }

    /// Fake data path: each backend's cumulative counters.
    struct Clients {
        counters: HashMap<u32, [u64; COUNT]>,
    }

    impl Clients {
        /// `per_sample` handshakes per backend per sample; the share `fail[i]` of
        /// backend i's are retried and never complete.
        fn traffic(&mut self, model: &Model, per_sample: u64, fail: &[f64]) {
            for (i, b) in model.vips[0].backends.iter().enumerate() {
                if b.outlier.is_ejected() {
                    continue;
                }
                let c = self.counters.entry(b.id).or_default();
                let failed = (per_sample as f64 * fail[i]).round() as u64;
                c[STARTED as usize] += per_sample;
                c[RETRIED as usize] += failed;
                c[COMPLETED as usize] += per_sample - failed;
            }
        }
    }

    /// Runs `samples` samples of traffic from `at`; returns the events and the time after.
    fn run(
        model: &mut Model,
        settings: &OutlierConfig,
        clients: &mut Clients,
        (at, samples): (Instant, u32),
        fail: &[f64],
    ) -> (Vec<Event>, Instant) {
        let mut events = Vec::new();
        let mut now = at;
        for _ in 0..samples {
            now += SAMPLE;
            clients.traffic(model, 10, fail);
            let backends = &mut model.vips[0].backends;
            events.extend(judge(settings, backends, &clients.counters, now));
        }
        (events, now)
    }

    /// Four backends failing `fail` of their handshakes, after `samples` samples.
    fn after(samples: u32, fail: &[f64]) -> (Model, Vec<Event>) {
        let (mut model, settings) = model(fail.len(), SETTINGS);
        let at = (Instant::now(), samples);
        let (events, _) = run(&mut model, &settings, &mut clients(), at, fail);
        (model, events)
    }

    fn clients() -> Clients {
        Clients {
            counters: HashMap::new(),
        }
    }

    fn ejected(model: &Model) -> Vec<bool> {
        model.vips[0]
            .backends
            .iter()
            .map(|b| b.outlier.is_ejected())
            .collect()
    }

    const SETTINGS: &str =
        "window = \"2s\"\nmin_handshakes = 10\neject = \"5s\"\nmax_ejected = 0.5";

    #[test]
    fn a_backend_failing_its_clients_leaves_the_table_with_the_reason() {
        let (model, events) = after(6, &[1.0, 0.0, 0.0, 0.0]);
        assert_eq!(ejected(&model), [true, false, false, false]);
        let b = &model.vips[0].backends[0];
        assert!(!b.in_table(), "ejected: out of the table");
        assert!(b.serves_flows(), "its established flows stay");
        let Event::Ejected { reason, lasts, .. } = &events[0] else {
            panic!("{events:?}")
        };
        assert_eq!(*lasts, Duration::from_secs(5));
        assert!(
            reason.starts_with("0 of ")
                && reason.ends_with("handshakes completed in 2s; peers 100%"),
            "{reason}"
        );
        let table = &model.desired().vips[0].table;
        assert!(!table.contains(&b.id), "{table:?}");
    }

    #[test]
    fn a_failure_every_backend_shares_ejects_no_one() {
        let (model, events) = after(20, &[0.8, 0.7, 0.8, 0.9]);
        assert_eq!(events, []);
        assert_eq!(ejected(&model), [false; 4]);
    }

    /// Backends with these (started, completed) in their windows, all in the table.
    fn windows(counts: &[(u64, u64)]) -> Vec<BackendState> {
        let (mut model, _) = model(counts.len(), SETTINGS);
        let backends = &mut model.vips[0].backends;
        for (b, &(started, completed)) in backends.iter_mut().zip(counts) {
            b.outlier.window = Judged { started, completed };
        }
        backends.clone()
    }

    #[test]
    fn a_small_window_that_trails_its_peers_by_chance_is_not_ejected() {
        // Seen in CI: 60% of every backend's SYN-ACKs lost on the client side; one
        // backend's 2 s window at 2 of 6, the one peer that looked healthy at 10 of 12.
        let settings = model(4, "min_handshakes = 5\nmax_failure = 0.2").1;
        let chance = windows(&[(6, 2), (12, 10), (9, 5), (8, 4)]);
        assert_eq!(outliers(&settings, &chance), []);
        // Peers seen longer, and a backend that completes none of ten: its own failure.
        let failing = windows(&[(10, 0), (36, 30), (9, 5), (8, 4)]);
        assert_eq!(outliers(&settings, &failing).len(), 1);
        // A backend that drops everything is told apart from five handshakes on.
        let dropping = windows(&[(5, 0), (15, 15), (14, 14), (16, 16)]);
        assert_eq!(outliers(&settings, &dropping).len(), 1);
    }

    #[test]
    fn only_a_vip_with_outlier_asks_the_program_to_tell_retries() {
        let (judged, _) = model(1, SETTINGS);
        assert_ne!(judged.vips[0].flags() & lb_common::VIP_F_OUTLIER, 0);
        let plain = Config::from_toml(&format!("{VIP}[[vip.backend]]\naddress = \"10.0.0.11\"\n"));
        let mut model = Model::new(7, 16, Duration::ZERO);
        model.update(&plain.unwrap()).unwrap();
        assert_eq!(model.vips[0].flags() & lb_common::VIP_F_OUTLIER, 0);
    }

    #[test]
    fn success_intervals_narrow_as_handshakes_come() {
        let (low, high) = success_interval(Judged {
            started: 6,
            completed: 2,
        });
        assert!((0.05..0.06).contains(&low) && (0.81..0.82).contains(&high));
        let (low, high) = success_interval(Judged {
            started: 600,
            completed: 200,
        });
        assert!((0.27..0.28).contains(&low) && (0.39..0.40).contains(&high));
        assert_eq!(success_interval(Judged::default()), (0.0, 1.0));
    }

    #[test]
    fn never_more_than_max_ejected_leave_and_the_worst_go_first() {
        let (model, events) = after(8, &[0.9, 1.0, 0.95, 0.0]);
        assert_eq!(ejected(&model), [false, true, true, false]);
        let held = events
            .iter()
            .filter(|e| matches!(e, Event::HeldBack { .. }))
            .count();
        assert_eq!(held, 1, "logged once: {events:?}");
    }

    #[test]
    fn too_few_handshakes_are_not_judged() {
        let (mut model, settings) =
            model(2, "window = \"2s\"\nmin_handshakes = 1000\nmax_ejected = 1");
        run(
            &mut model,
            &settings,
            &mut clients(),
            (Instant::now(), 10),
            &[1.0, 0.0],
        );
        assert_eq!(ejected(&model), [false, false]);
    }

    #[test]
    fn an_ejected_backend_returns_after_eject_only_while_its_checks_pass_and_longer_each_time() {
        let (mut model, settings) = model(3, SETTINGS.replace("0.5", "0.34").as_str());
        let mut clients = clients();
        let start = Instant::now();
        let (_, now) = run(
            &mut model,
            &settings,
            &mut clients,
            (start, 6),
            &[1.0, 0.0, 0.0],
        );
        assert_eq!(ejected(&model), [true, false, false]);
        let until = model.vips[0].backends[0]
            .outlier
            .ejected
            .clone()
            .unwrap()
            .until;
        // Its checks fail meanwhile: it stays out past its time.
        model.vips[0].backends[0].health = Health::Down;
        let (events, now) = run(
            &mut model,
            &settings,
            &mut clients,
            (now, 12),
            &[1.0, 0.0, 0.0],
        );
        assert!(now > until && events.is_empty(), "{events:?}");
        model.vips[0].backends[0].health = Health::Up;
        let (events, now) = run(&mut model, &settings, &mut clients, (now, 1), &[0.0; 3]);
        assert!(matches!(events[..], [Event::Returned { .. }]), "{events:?}");
        assert!(model.vips[0].backends[0].in_table());
        // It fails again: out for two `eject`s.
        let (events, _) = run(
            &mut model,
            &settings,
            &mut clients,
            (now, 6),
            &[1.0, 0.0, 0.0],
        );
        let lasts: Vec<Duration> = events
            .iter()
            .filter_map(|e| match e {
                Event::Ejected { lasts, .. } => Some(*lasts),
                _ => None,
            })
            .collect();
        assert_eq!(lasts, [Duration::from_secs(10)]);
        assert_eq!(model.vips[0].backends[0].outlier.ejections_total, 2);
    }

    #[test]
    fn a_returning_backend_ramps_with_slow_start() {
        let (mut model, settings) = model(3, SETTINGS.replace("0.5", "0.34").as_str());
        model.vips[0].config.slow_start = Some(Duration::from_secs(10));
        let mut clients = clients();
        let start = Instant::now();
        let (_, now) = run(
            &mut model,
            &settings,
            &mut clients,
            (start, 6),
            &[1.0, 0.0, 0.0],
        );
        model.note_usable(now);
        let (_, now) = run(&mut model, &settings, &mut clients, (now, 12), &[0.0; 3]);
        assert!(model.vips[0].backends[0].in_table());
        model.note_usable(now);
        let b = &model.vips[0].backends[0];
        assert_eq!(b.load.ramp_started, Some(now), "slow start on return");
    }

    #[test]
    fn a_spoofed_syn_flood_is_not_judged() {
        let (mut model, settings) = model(2, SETTINGS.replace("0.5", "1").as_str());
        let mut counters = HashMap::new();
        let mut now = Instant::now();
        for round in 1..=10u64 {
            now += SAMPLE;
            // Backend 0 gets a flood of SYNs never seen again; both complete their
            // real clients' handshakes.
            counters.insert(0, [round * 10_000, 0, round * 10, 0]);
            counters.insert(1, [round * 10, 0, round * 10, 0]);
            let events = judge(&settings, &mut model.vips[0].backends, &counters, now);
            assert_eq!(events, []);
        }
        let judged = model.vips[0].backends[0].outlier.window;
        assert_eq!(judged.started, judged.completed);
    }

    #[test]
    fn status_and_top_show_the_windows_handshakes_and_the_reason() {
        let mut status = crate::status::tests::sample();
        let reason = "12 of 40 handshakes completed in 10s; peers 100%";
        status.vips[0].backends[0].outlier = Some(OutlierStatus {
            started: 40,
            completed: 12,
            ejected_until: Some(crate::status::unix_now() + 10.0),
            reason: Some(reason.into()),
            ejections: 1,
        });
        let text = crate::status::render(&status);
        let line = "handshakes: 12 of 40 completed in the window; EJECTED for ";
        assert!(text.contains(line) && text.contains(reason), "{text}");
        let top = crate::top::render(&status, None, 0.0, false);
        assert!(top.contains(&format!("EJECTED: {reason}")), "{top}");
    }

    fn refused(outlier: &str, protocol: &str) -> String {
        let text = format!(
            "{}[vip.outlier]\n{outlier}\n[[vip.backend]]\naddress = \"10.0.0.11\"\n",
            VIP.replace("\"tcp\"", protocol)
        );
        match Config::from_toml(&text) {
            Err(ConfigError::Invalid { field, .. }) => field,
            other => panic!("{outlier}: {other:?}"),
        }
    }

    #[test]
    fn settings_that_cannot_work_are_refused_naming_the_field() {
        let tcp = "\"tcp\"";
        assert_eq!(refused("window = \"900ms\"", tcp), "vip[0].outlier.window");
        assert_eq!(
            refused("max_failure = 0", tcp),
            "vip[0].outlier.max_failure"
        );
        assert_eq!(
            refused("max_failure = 1.5", tcp),
            "vip[0].outlier.max_failure"
        );
        assert_eq!(
            refused("max_ejected = -0.1", tcp),
            "vip[0].outlier.max_ejected"
        );
        assert_eq!(
            refused("max_ejected = 1.1", tcp),
            "vip[0].outlier.max_ejected"
        );
        assert_eq!(
            refused("min_handshakes = 0", tcp),
            "vip[0].outlier.min_handshakes"
        );
        assert_eq!(refused("", "\"udp\""), "vip[0].outlier");
        let defaults = config(1, "").vips[0].outlier.clone().unwrap();
        assert_eq!(defaults, OutlierConfig::default());
        assert_eq!(defaults.window, Duration::from_secs(10));
    }
}
