//! `lb top`: a live view of the running agent, refreshed every interval: per VIP and
//! backend, packets and new flows per second, each backend's share of the VIP's traffic
//! as a bar, state and health, and the hot-spot ratio, highlighted above a threshold.
//!
//! Rates are counter differences between two samples, so the first screen waits for a
//! second sample, one interval after the first: every screen, `--count 1` included,
//! shows real rates. A screen fits 80 columns: the address column is as wide as the
//! addresses (up to [`ADDRESS_WIDTH`]; a longer one gets a line of its own), the bar
//! takes what is left, and free text is cut at the edge.

use std::{collections::HashMap, fmt::Write, io::IsTerminal, path::Path, time::Duration};

use lb_common::stat;

use crate::{
    control::client,
    status::{Status, VipStatus},
};

/// The width every line fits in.
pub const COLUMNS: usize = 80;
/// The widest address column; longer addresses (IPv6) take a line of their own.
const ADDRESS_WIDTH: usize = 22;
/// Of a backend row, everything but the address and the bar: the other columns, the
/// spaces between them and the percentage.
const ROW_FIXED: usize = 2 + 1 + 8 + 1 + 7 + 1 + 8 + 1 + 7 + 1 + 7 + 1 + 1 + 6;
const RED: &str = "\x1b[1;31m";
const RESET: &str = "\x1b[0m";

pub struct TopOptions {
    pub interval: Duration,
    /// Stop after this many refreshes (None: until interrupted).
    pub count: Option<u64>,
    /// Busiest-over-average ratio above which a VIP is highlighted.
    pub hot: f64,
}

/// Per backend (VIP name, address): packets and new flows at the previous refresh.
type Previous = HashMap<(String, String), (u64, u64)>;

pub async fn run(socket: &Path, options: TopOptions) -> anyhow::Result<()> {
    let tty = std::io::stdout().is_terminal();
    screens(socket, &options, tty, |screen| {
        if tty {
            // Home the cursor and clear: redraw in place.
            print!("\x1b[H\x1b[2J{screen}");
            use std::io::Write as _;
            let _ = std::io::stdout().flush();
        } else {
            println!("{screen}");
        }
    })
    .await
}

/// Samples the agent, then hands `show` a screen every interval (the first one
/// interval after the first sample) until `count` screens or Ctrl-C.
async fn screens(
    socket: &Path,
    options: &TopOptions,
    tty: bool,
    mut show: impl FnMut(&str),
) -> anyhow::Result<()> {
    // The first sample only starts the rates: no screen until the second.
    let first = client::status(socket).await?;
    let mut previous = (std::time::Instant::now(), snapshot(&first));
    if tty {
        show(&format!(
            "lb top: measuring rates over {:?}...",
            options.interval
        ));
    }
    let mut refreshes = 0u64;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(options.interval) => {}
            _ = tokio::signal::ctrl_c() => return Ok(()),
        }
        let status = client::status(socket).await?;
        let now = std::time::Instant::now();
        let seconds = now.duration_since(previous.0).as_secs_f64();
        show(&render(
            &status,
            Some((seconds, &previous.1)),
            options.hot,
            tty,
        ));
        previous = (now, snapshot(&status));
        refreshes += 1;
        if options.count.is_some_and(|count| refreshes >= count) {
            return Ok(());
        }
    }
}

fn snapshot(status: &Status) -> Previous {
    let mut map = HashMap::new();
    for vip in &status.vips {
        for b in &vip.backends {
            map.insert(
                (vip.name.clone(), b.address.clone()),
                (b.packets, b.new_flows),
            );
        }
    }
    map
}

/// `line` cut to [`COLUMNS`] characters, the cut marked with `~`.
fn fit(line: &str) -> String {
    if line.chars().count() <= COLUMNS {
        return line.to_string();
    }
    let mut cut: String = line.chars().take(COLUMNS - 1).collect();
    cut.push('~');
    cut
}

/// One screen. `rates`: seconds since, and counters at, the previous sample (`None`
/// shows zeros; `run` always has one).
pub fn render(status: &Status, rates: Option<(f64, &Previous)>, hot: f64, color: bool) -> String {
    let mut out = String::new();
    let d = &status.dataplane;
    let drops: u64 = status
        .counters
        .iter()
        .filter(|(name, _)| stat::index(name).map(stat::kind) == Some(stat::Kind::Drop))
        .map(|(_, v)| v)
        .sum();
    let header = format!(
        "lb top: {} ({}), {} of {} conntrack entries in use, {} drops",
        d.interface,
        d.xdp_mode
            .map_or("DETACHED".to_string(), |mode| format!("{mode} mode")),
        d.conntrack_entries_in_use,
        d.conntrack_capacity,
        drops
    );
    let _ = writeln!(out, "{}", fit(&header));
    for vip in &status.vips {
        let per_backend: Vec<(f64, f64)> = vip
            .backends
            .iter()
            .map(|b| match rates {
                Some((seconds, before)) if seconds > 0.0 => {
                    let (p, n) = before
                        .get(&(vip.name.clone(), b.address.clone()))
                        .copied()
                        .unwrap_or((b.packets, b.new_flows));
                    (
                        b.packets.saturating_sub(p) as f64 / seconds,
                        b.new_flows.saturating_sub(n) as f64 / seconds,
                    )
                }
                _ => (0.0, 0.0),
            })
            .collect();
        vip_lines(&mut out, status, vip, &per_backend, hot, color);
        backend_rows(&mut out, vip, &per_backend);
    }
    out
}

/// A VIP's lines above its backends: its rates and hot-spot ratio, its top and hot
/// sources.
fn vip_lines(
    out: &mut String,
    status: &Status,
    vip: &VipStatus,
    per_backend: &[(f64, f64)],
    hot: f64,
    color: bool,
) {
    let vip_pps: f64 = per_backend.iter().map(|(p, _)| p).sum();
    let vip_nfs: f64 = per_backend.iter().map(|(_, n)| n).sum();
    let is_hot = vip.busiest_over_average > hot;
    let ratio = format!(
        "busiest/average {:.2}{}",
        vip.busiest_over_average,
        if is_hot { " HOT" } else { "" }
    );
    let shown_ratio = if is_hot && color {
        format!("{RED}{ratio}{RESET}")
    } else {
        ratio.clone()
    };
    // One line where it fits; else the rates (and the ratio) on lines of their own.
    let name = format!("{} {}", vip.name, vip.target());
    let rates = format!("{vip_pps:.0} pkt/s  {vip_nfs:.1} new flows/s");
    let width = |parts: &[&str]| parts.iter().map(|p| p.chars().count()).sum::<usize>();
    if width(&[&name, "  ", &rates, "  ", &ratio]) <= COLUMNS {
        let _ = writeln!(out, "\n{name}  {rates}  {shown_ratio}");
    } else if width(&[&name, "  ", &rates]) <= COLUMNS {
        let _ = writeln!(out, "\n{name}  {rates}\n  {shown_ratio}");
    } else {
        let _ = writeln!(out, "\n{}\n  {rates}  {shown_ratio}", fit(&name));
    }
    if !vip.top_sources.is_empty() {
        let top: Vec<String> = vip
            .top_sources
            .iter()
            .take(3)
            .map(|s| format!("{} {:.1}/s", s.address, s.new_flows_per_second))
            .collect();
        let line = format!("  top sources by new flows: {}", top.join(", "));
        let _ = writeln!(out, "{}", fit(&line));
    }
    if !vip.hot_sources.is_empty() {
        // The counter is the program's, over every VIP.
        let spread = status.counters.get("hot_source_spread").copied();
        let line = format!(
            "  hot sources, balanced per connection: {} (hot_source_spread {})",
            crate::status::HotSource::list(&vip.hot_sources),
            spread.unwrap_or(0)
        );
        let _ = writeln!(out, "{}", fit(&line));
    }
}

/// The backend table of a VIP: one row each, with its share of the VIP's packets as a
/// bar as wide as the row leaves.
fn backend_rows(out: &mut String, vip: &VipStatus, per_backend: &[(f64, f64)]) {
    let vip_pps: f64 = per_backend.iter().map(|(p, _)| p).sum();
    let width = vip
        .backends
        .iter()
        .map(|b| b.address.len())
        .max()
        .unwrap_or(0)
        .clamp("backend".len(), ADDRESS_WIDTH);
    let bar_width = COLUMNS - ROW_FIXED - width;
    let _ = writeln!(
        out,
        "  {:<width$} {:<8} {:<7} {:>8} {:>7} {:>7} {:<bar_width$}",
        "backend", "state", "health", "pkt/s", "new/s", "flows", "share"
    );
    for (b, (pps, nfs)) in vip.backends.iter().zip(per_backend) {
        let share = if vip_pps > 0.0 { pps / vip_pps } else { 0.0 };
        let bar = "#".repeat((share * bar_width as f64).round() as usize);
        let address = if b.address.len() > width {
            let _ = writeln!(out, "  {}", b.address);
            ""
        } else {
            b.address.as_str()
        };
        let _ = writeln!(
            out,
            "  {:<width$} {:<8} {:<7} {:>8.0} {:>7.1} {:>7} {:<bar_width$} {:>5.1}%",
            address,
            b.state,
            b.health,
            pps,
            nfs,
            b.active_flows,
            bar,
            share * 100.0,
        );
        if !b.weight_reason.is_configured() {
            let line = format!(
                "    weight {:.2} of {}: {}",
                b.effective_weight, b.weight, b.weight_reason
            );
            let _ = writeln!(out, "{}", fit(&line));
        }
        if let Some(o) = &b.outlier {
            let _ = writeln!(out, "{}", fit(&outlier_line(o)));
        }
    }
}

/// Passive health under a backend's row: its window's handshakes, an ejection's reason.
fn outlier_line(o: &crate::status::OutlierStatus) -> String {
    match (&o.ejected_until, &o.reason) {
        // The reason has the window's handshakes.
        (Some(_), Some(reason)) => format!("    EJECTED: {reason}"),
        _ => format!("    handshakes {} of {} completed", o.completed, o.started),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_and_shares_come_from_counter_deltas() {
        let mut status = crate::status::tests::sample();
        let before = snapshot(&status);
        status.vips[0].backends[0].packets += 300;
        status.vips[0].backends[1].packets += 100;
        status.vips[0].backends[0].new_flows += 20;
        status.vips[0].busiest_over_average = 1.5;
        status.vips[0].top_sources = vec![crate::status::SourceRate {
            address: "10.0.0.1".into(),
            new_flows_per_second: 9.5,
        }];
        status.vips[0].hot_sources = vec![crate::status::HotSource {
            address: "10.0.0.1".into(),
            share: 0.62,
        }];
        let screen = render(&status, Some((2.0, &before)), 1.3, false);
        assert!(screen.contains("200 pkt/s"), "{screen}");
        assert!(
            screen.contains(
                "hot sources, balanced per connection: 10.0.0.1 (62%) (hot_source_spread 0)"
            ),
            "{screen}"
        );
        assert!(screen.contains("10.0 new flows/s"), "{screen}");
        assert!(
            screen.contains("75.0%") && screen.contains("25.0%"),
            "{screen}"
        );
        assert!(screen.contains("busiest/average 1.50 HOT"), "{screen}");
        assert!(
            screen.contains("top sources by new flows: 10.0.0.1 9.5/s"),
            "{screen}"
        );
        status.vips[0].address = "fd00::100".into();
        let screen = render(&status, None, 1.3, false);
        assert!(screen.contains("\nweb [fd00::100]:80/tcp  "), "{screen}");
    }

    #[test]
    fn every_line_fits_80_columns() {
        let mut status = crate::status::tests::sample();
        let before = snapshot(&status);
        status.dataplane.conntrack_entries_in_use = 1_048_576;
        status.dataplane.conntrack_capacity = 16_777_216;
        status.vips[0].name = "a-rather-long-vip-name".into();
        status.vips[0].address = "fd00:1234:5678:9abc:def0:1234:5678:100".into();
        status.vips[0].busiest_over_average = 3.25;
        status.vips[0].backends[0].address = "fd00:1234:5678:9abc:def0:1234:5678:11".into();
        status.vips[0].backends[0].packets += 123_456_789;
        status.vips[0].backends[0].new_flows += 1_234_567;
        status.vips[0].backends[0].active_flows = 9_999_999;
        status.vips[0].backends[0].weight_reason =
            crate::model::weights::WeightReason::Rules("agent 75%: ".repeat(20));
        status.vips[0].top_sources = (0..3)
            .map(|i| crate::status::SourceRate {
                address: format!("fd00:1234:5678:9abc:def0:1234:5678:{i}"),
                new_flows_per_second: 12345.5,
            })
            .collect();
        let v4_before = snapshot(&crate::status::tests::sample());
        let mut v4 = crate::status::tests::sample();
        v4.vips[0].backends[0].packets += 300;
        for (status, before) in [(&status, &before), (&v4, &v4_before)] {
            for color in [false, true] {
                let screen = render(status, Some((1.0, before)), 1.5, color);
                for line in screen.lines() {
                    let visible = line.replace(RED, "").replace(RESET, "");
                    assert!(
                        visible.chars().count() <= COLUMNS,
                        "{} columns: {visible:?}\n{screen}",
                        visible.chars().count()
                    );
                }
            }
        }
        // An IPv4 screen keeps a bar, and the long IPv6 address is whole on its own line.
        let screen = render(&v4, Some((1.0, &v4_before)), 1.5, false);
        assert!(screen.contains("############"), "{screen}");
        let screen = render(&status, Some((1.0, &before)), 1.5, false);
        assert!(
            screen.contains("\n  fd00:1234:5678:9abc:def0:1234:5678:11\n"),
            "{screen}"
        );
    }

    /// A control socket whose status counts 1000 more packets for the first backend at
    /// every request, as an agent under load would.
    async fn busy_agent(socket: &Path) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::UnixListener::bind(socket).unwrap();
        let mut status = crate::status::tests::sample();
        tokio::spawn(async move {
            loop {
                let Ok((mut stream, _)) = listener.accept().await else {
                    return;
                };
                let mut request = vec![0u8; 4096];
                let _ = stream.read(&mut request).await;
                status.vips[0].backends[0].packets += 1000;
                let body = serde_json::to_string(&status).unwrap();
                let answer = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\
                     content-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = stream.write_all(answer.as_bytes()).await;
            }
        });
    }

    #[tokio::test]
    async fn the_first_screen_shows_real_rates() {
        let dir = std::env::temp_dir().join(format!("lb-top-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let socket = dir.join("lb.sock");
        busy_agent(&socket).await;
        let options = TopOptions {
            interval: Duration::from_millis(200),
            count: Some(1),
            hot: 1.5,
        };
        let mut shown = Vec::new();
        screens(&socket, &options, false, |screen| {
            shown.push(screen.to_string())
        })
        .await
        .unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(shown.len(), 1, "--count 1: one screen");
        // 1000 packets in one interval of about 0.2 s (more on a loaded machine).
        let rate: f64 = shown[0]
            .split_once("\nweb 10.0.0.100:80/tcp  ")
            .and_then(|(_, rest)| rest.split_once(" pkt/s"))
            .map(|(rate, _)| rate.parse().unwrap())
            .unwrap_or_else(|| panic!("{}", shown[0]));
        assert!(rate > 0.0 && rate <= 5000.0, "{rate} pkt/s:\n{}", shown[0]);
    }
}
