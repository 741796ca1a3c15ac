//! `hold-connections ADDR COUNT SECONDS`: what any local user can do to a TCP port the
//! agent listens on. Keeps up to COUNT connections open to ADDR for SECONDS, half of
//! them with a partial HTTP request, half silent, and opens new ones (at most
//! `REOPEN_PER_TICK` per tick) as the server closes them. Then prints one line,
//! `opened=N closed_by_server=N failed=N max_open=N longest_held_ms=N`, and exits.
//!
//! Started by the end-to-end tests as an unprivileged user (`nobody`) inside a lab's
//! namespace; every loop is bounded by SECONDS and by `MAX_OPENED`.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

/// How often open connections are looked at.
const TICK: Duration = Duration::from_millis(100);
/// New connections per tick once the first COUNT are open.
const REOPEN_PER_TICK: usize = 25;
/// Connections opened in all, at most.
const MAX_OPENED: usize = 20_000;
const PARTIAL: &[u8] = b"GET /metrics HTTP/1.1\r\nHost: lb\r\nX-Never-Ends: ";

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [addr, count, seconds] = args.as_slice() else {
        eprintln!("usage: hold-connections ADDR COUNT SECONDS");
        std::process::exit(2);
    };
    let addr: SocketAddr = addr.parse().expect("ADDR");
    let count: usize = count.parse().expect("COUNT");
    let duration = Duration::from_secs_f64(seconds.parse().expect("SECONDS"));
    raise_nofile();

    let started = Instant::now();
    let mut open: Vec<(TcpStream, Instant)> = Vec::with_capacity(count);
    let (mut opened, mut closed, mut failed, mut max_open) = (0usize, 0usize, 0usize, 0usize);
    let mut longest_held = Duration::ZERO;
    while started.elapsed() < duration {
        let tick = Instant::now();
        // The first COUNT as fast as they go, then a bounded rate of new ones.
        let mut budget = if opened < count {
            count - opened
        } else {
            REOPEN_PER_TICK
        };
        while open.len() < count && budget > 0 && opened < MAX_OPENED {
            budget -= 1;
            match TcpStream::connect_timeout(&addr, Duration::from_millis(500)) {
                Ok(mut stream) => {
                    if opened % 2 == 0 {
                        let _ = stream.write_all(PARTIAL);
                    }
                    let _ = stream.set_nonblocking(true);
                    open.push((stream, Instant::now()));
                    opened += 1;
                }
                Err(_) => failed += 1,
            }
            if tick.elapsed() > TICK * 5 {
                break;
            }
        }
        max_open = max_open.max(open.len());
        std::thread::sleep(TICK.saturating_sub(tick.elapsed()));
        let mut buf = [0u8; 512];
        open.retain_mut(|(stream, since)| {
            let gone = match stream.read(&mut buf) {
                Ok(_) => true,
                Err(e) if e.kind() == ErrorKind::WouldBlock => false,
                Err(_) => true,
            };
            if gone {
                closed += 1;
                longest_held = longest_held.max(since.elapsed());
            }
            !gone
        });
    }
    println!(
        "opened={opened} closed_by_server={closed} failed={failed} max_open={max_open} \
         longest_held_ms={}",
        longest_held.as_millis()
    );
}

/// Soft limit on open files up to the hard one, as any user may.
fn raise_nofile() {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit only read and write `limit`.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 {
            limit.rlim_cur = limit.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
        }
    }
}
