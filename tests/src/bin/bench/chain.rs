//! What a frame lb passes costs when `dataplane.next_program` is set (issue 37): the tail
//! call into the host's program, measured in the per-packet section's run. In each round,
//! alternating: lb's program on a frame for no VIP with `LB_NEXT` empty (the plain pass),
//! with the test object's `xdp_mac_swap` in `LB_NEXT` (pass, tail call, two MACs
//! swapped: its XDP_TX shows that the call happened), and `xdp_mac_swap` alone; kernel ns
//! per run under `repeat`, medians over rounds. lb's build is `lb_xdp_1buf`, the one that
//! can call a program that is not multi-buffer aware (as xdp-filter is not).

use anyhow::{Context, Result, ensure};
use lb_userspace::dataplane::{LoadOptions, next};
use serde_json::{Value, json};

use crate::packet::{Options, config_text, load_program, run_repeat, xdp};
use crate::report::{Table, median, num};
use lb_tests::program::Instance;

const XDP_PASS: u32 = 2;
const XDP_TX: u32 = 3;
/// The next program: the test object's, not multi-buffer aware.
const NEXT: &str = "xdp_mac_swap";

/// The three programs' figures for `frame` (a frame for no VIP), as a table and JSON.
pub fn run(opts: &Options, frame: &[u8]) -> Result<(Table, Value)> {
    let single_buffer = |o: &mut LoadOptions| o.program = next::LB_XDP_1BUF;
    let mut plain = Instance::load_with(&config_text(1), single_buffer)?;
    let mut chained = Instance::load_with(&config_text(1), single_buffer)?;
    let mut next_ebpf = load_program(NEXT)?;
    // Pinned for `next::open`, as a host's program would be.
    let pin = std::path::PathBuf::from(format!("/sys/fs/bpf/lb-bench-next-{}", std::process::id()));
    xdp(&mut next_ebpf, NEXT)?
        .pin(&pin)
        .with_context(|| format!("pin {NEXT} at {}", pin.display()))?;
    let opened = next::open(&pin);
    let _ = std::fs::remove_file(&pin);
    let program = opened.with_context(|| format!("open the pinned {NEXT}"))?;
    chained.dataplane.chain(Some(&program))?;
    let (mut lb_pass, mut lb_chained, mut alone) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..opts.rounds {
        let (rv, k, _) = run_repeat(plain.dataplane.program_mut()?, frame, opts.repeat)?;
        ensure!(rv == XDP_PASS, "lb_xdp_1buf returned {rv}");
        lb_pass.push(k);
        let (rv, k, _) = run_repeat(chained.dataplane.program_mut()?, frame, opts.repeat)?;
        ensure!(
            rv == XDP_TX,
            "lb_xdp_1buf chained to {NEXT} returned {rv}: no tail call"
        );
        lb_chained.push(k);
        let (_, k, _) = run_repeat(xdp(&mut next_ebpf, NEXT)?, frame, opts.repeat)?;
        alone.push(k);
    }
    let (p, c, e) = (median(&lb_pass), median(&lb_chained), median(&alone));
    let mut table = Table::new(
        "A passed frame with next_program (kernel ns per run, medians)",
        &[
            "lb pass",
            "lb pass + tail call + mac swap",
            "difference",
            "chained / plain",
            "xdp_mac_swap alone",
        ],
    );
    table.row(vec![
        num(p, 1),
        num(c, 1),
        num(c - p, 1),
        num(c / p, 2),
        num(e, 1),
    ]);
    table.note(format!(
        "{} rounds of repeat = {}, the three alternating in each round; the frame is \
         pass_not_vip's; lb's build is lb_xdp_1buf. The called program swaps two MACs and \
         returns XDP_TX (which shows the call happened); a host firewall adds its own cost \
         on top. TEST_RUN reports whole ns per run.",
        opts.rounds, opts.repeat
    ));
    let json = json!({
        "lb_pass_kernel_ns": lb_pass,
        "lb_pass_tail_call_kernel_ns": lb_chained,
        "next_alone_kernel_ns": alone,
        "next_program": NEXT,
        "median": { "lb_pass": p, "lb_pass_tail_call": c, "next_alone": e, "ratio": c / p },
    });
    Ok((table, json))
}
