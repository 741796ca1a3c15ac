//! An open-loop HTTP/1.1 keep-alive load generator, for comparing latency tails at the
//! same request rate.
//!
//! wrk is closed-loop: each connection sends its next request when the last answer
//! came, so the faster path gets more requests, and a slow answer delays (and hides) the
//! requests behind it. Here every connection sends on a fixed schedule whatever the
//! answers, and a request's latency runs from when it was due, not from when it went
//! out, so queueing behind a slow answer counts (wrk2's correction for coordinated
//! omission).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// The load: `rate` requests per second in total over `connections` keep-alive
/// connections, for `duration`.
#[derive(Clone, Copy, Debug)]
pub struct Load {
    pub rate: f64,
    pub connections: usize,
    pub duration: Duration,
}

/// What a run measured.
#[derive(Clone, Debug, Default)]
pub struct Latencies {
    /// Requests answered, per second of run.
    pub achieved_rate: f64,
    pub completed: u64,
    pub errors: u64,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

/// Runs `load` against `addr` from the calling thread's network namespace (the
/// connection threads inherit it).
pub fn run(addr: SocketAddr, load: &Load) -> Result<Latencies> {
    if load.rate <= 0.0 || load.connections == 0 {
        bail!("open loop: rate and connections must be positive");
    }
    let interval = Duration::from_secs_f64(load.connections as f64 / load.rate);
    let start = Instant::now() + Duration::from_millis(200);
    let end = start + load.duration;
    let results: Vec<Result<(Vec<u32>, u64)>> = std::thread::scope(|s| {
        let threads: Vec<_> = (0..load.connections)
            .map(|i| {
                // Phases spread over one interval, so the total rate is smooth.
                let first = start + interval.mul_f64(i as f64 / load.connections as f64);
                s.spawn(move || connection(addr, first, interval, end))
            })
            .collect();
        threads
            .into_iter()
            .map(|t| {
                t.join()
                    .unwrap_or_else(|_| bail!("a connection thread panicked"))
            })
            .collect()
    });
    let mut micros = Vec::new();
    let mut errors = 0;
    for r in results {
        let (m, e) = r?;
        micros.extend(m);
        errors += e;
    }
    micros.sort_unstable();
    let at = |q: f64| -> f64 {
        if micros.is_empty() {
            return f64::NAN;
        }
        let i = ((micros.len() as f64 * q).ceil() as usize).clamp(1, micros.len()) - 1;
        micros[i] as f64 / 1000.0
    };
    Ok(Latencies {
        achieved_rate: micros.len() as f64 / load.duration.as_secs_f64(),
        completed: micros.len() as u64,
        errors,
        p50_ms: at(0.50),
        p90_ms: at(0.90),
        p99_ms: at(0.99),
        max_ms: at(1.0),
    })
}

/// One connection's schedule: latencies in microseconds from each request's due time to
/// its whole answer, and the number of failed requests (a failure ends the connection).
fn connection(
    addr: SocketAddr,
    first: Instant,
    interval: Duration,
    end: Instant,
) -> Result<(Vec<u32>, u64)> {
    // Sleep with no timer slack (50 us by default): a late wake-up would count as
    // latency of the path under test.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1, 0, 0, 0) };
    let stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2))
        .with_context(|| format!("connecting to {addr}"))?;
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut writer = stream.try_clone()?;
    let mut reader = BufReader::new(stream);
    let request = format!("GET / HTTP/1.1\r\nHost: {addr}\r\n\r\n");
    let capacity = ((end - first).as_secs_f64() / interval.as_secs_f64()) as usize + 1;
    let mut micros = Vec::with_capacity(capacity);
    let mut due = first;
    while due < end {
        let now = Instant::now();
        if due > now {
            std::thread::sleep(due - now);
        }
        let answered = writer
            .write_all(request.as_bytes())
            .map_err(anyhow::Error::from)
            .and_then(|()| read_response(&mut reader));
        if answered.is_err() {
            let left = ((end - due).as_secs_f64() / interval.as_secs_f64()).ceil() as u64;
            return Ok((micros, left.max(1)));
        }
        micros.push(due.elapsed().as_micros().min(u32::MAX as u128) as u32);
        due += interval;
    }
    Ok((micros, 0))
}

/// Reads one HTTP/1.1 response with a Content-Length body.
fn read_response(reader: &mut BufReader<TcpStream>) -> Result<()> {
    let mut line = String::new();
    let mut length = None;
    let mut status_line = true;
    loop {
        line.clear();
        if reader.read_line(&mut line)? == 0 {
            bail!("connection closed");
        }
        let header = line.trim_end();
        if status_line {
            if !header.starts_with("HTTP/1.1 200") {
                bail!("answer {header:?}");
            }
            status_line = false;
            continue;
        }
        if header.is_empty() {
            break;
        }
        if let Some((name, value)) = header.split_once(':')
            && name.eq_ignore_ascii_case("content-length")
        {
            length = Some(value.trim().parse::<usize>()?);
        }
    }
    let mut body = vec![0; length.context("no Content-Length")?];
    reader.read_exact(&mut body)?;
    Ok(())
}
