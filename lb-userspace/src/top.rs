//! `lb top`: a live view of the running agent, refreshed every interval: per VIP and
//! backend, packets and new flows per second, each backend's share of the VIP's traffic
//! as a bar, state and health, and the hot-spot ratio, highlighted above a threshold.

use std::{collections::HashMap, fmt::Write, io::IsTerminal, path::Path, time::Duration};

use crate::{client, status::Status};

const BAR_WIDTH: usize = 30;
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
    let mut previous: Option<(std::time::Instant, Previous)> = None;
    let mut refreshes = 0u64;
    loop {
        let status = client::status(socket).await?;
        let now = std::time::Instant::now();
        let rates = previous
            .as_ref()
            .map(|(then, before)| (now.duration_since(*then).as_secs_f64(), before));
        let screen = render(&status, rates, options.hot, tty);
        if tty {
            // Home the cursor and clear: redraw in place.
            print!("\x1b[H\x1b[2J{screen}");
        } else {
            println!("{screen}");
        }
        previous = Some((now, snapshot(&status)));
        refreshes += 1;
        if options.count.is_some_and(|count| refreshes >= count) {
            return Ok(());
        }
        tokio::select! {
            _ = tokio::time::sleep(options.interval) => {}
            _ = tokio::signal::ctrl_c() => return Ok(()),
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

/// One screen. `rates`: seconds since, and counters at, the previous refresh (none on
/// the first, which shows zeros).
pub fn render(status: &Status, rates: Option<(f64, &Previous)>, hot: f64, color: bool) -> String {
    let mut out = String::new();
    let d = &status.dataplane;
    let _ = writeln!(
        out,
        "lb top: {} ({} mode), {} of {} connection-table entries in use; drops {}",
        d.interface,
        d.xdp_mode
            .map_or("DETACHED".to_string(), |mode| mode.to_string()),
        d.conntrack_entries_in_use,
        d.conntrack_capacity,
        status
            .counters
            .iter()
            .filter(|(k, _)| k.starts_with("drop_"))
            .map(|(_, v)| v)
            .sum::<u64>()
    );
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
        let vip_pps: f64 = per_backend.iter().map(|(p, _)| p).sum();
        let vip_nfs: f64 = per_backend.iter().map(|(_, n)| n).sum();
        let ratio = format!("busiest/average {:.2}", vip.busiest_over_average);
        let ratio = if vip.busiest_over_average > hot && color {
            format!("{RED}{ratio} HOT{RESET}")
        } else if vip.busiest_over_average > hot {
            format!("{ratio} HOT")
        } else {
            ratio
        };
        let _ = writeln!(
            out,
            "\n{} {}  {:.0} pkt/s  {:.1} new flows/s  {}",
            vip.name,
            vip.target(),
            vip_pps,
            vip_nfs,
            ratio
        );
        if !vip.top_sources.is_empty() {
            let top: Vec<String> = vip
                .top_sources
                .iter()
                .take(3)
                .map(|s| format!("{} {:.1}/s", s.address, s.new_flows_per_second))
                .collect();
            let _ = writeln!(out, "  top sources by new flows: {}", top.join(", "));
        }
        if !vip.hot_sources.is_empty() {
            // The counter is the program's, over every VIP.
            let spread = status.counters.get("hot_source_spread").copied();
            let _ = writeln!(
                out,
                "  hot sources, balanced per connection: {} (hot_source_spread {})",
                crate::status::HotSource::list(&vip.hot_sources),
                spread.unwrap_or(0)
            );
        }
        let _ = writeln!(
            out,
            "  {:<39} {:<9} {:<7} {:>9} {:>10} {:>7}  share",
            "backend", "state", "health", "pkt/s", "new/s", "flows"
        );
        for (b, (pps, nfs)) in vip.backends.iter().zip(&per_backend) {
            let share = if vip_pps > 0.0 { pps / vip_pps } else { 0.0 };
            let bar = "#".repeat((share * BAR_WIDTH as f64).round() as usize);
            let _ = writeln!(
                out,
                "  {:<39} {:<9} {:<7} {:>9.0} {:>10.1} {:>7}  {:<width$} {:>5.1}%",
                b.address,
                b.state,
                b.health,
                pps,
                nfs,
                b.active_flows,
                bar,
                share * 100.0,
                width = BAR_WIDTH
            );
            if b.weight_reason != "configured" && !b.weight_reason.is_empty() {
                let _ = writeln!(
                    out,
                    "    weight {:.2} of {}: {}",
                    b.effective_weight, b.weight, b.weight_reason
                );
            }
        }
    }
    out
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
}
