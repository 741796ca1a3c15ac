//! What a frame lb passes costs when `dataplane.next_program` is set (issue 37): the tail
//! call into the host's program, measured in the per-packet section's run. In each round,
//! alternating: `lb_xdp` on a frame for no VIP with `LB_NEXT` empty (the plain pass),
//! with the test object's `xdp_pass` in `LB_NEXT` (pass, tail call, an empty program),
//! and `xdp_pass` alone; kernel ns per run under `repeat`, medians over rounds.

use anyhow::{Context, Result, ensure};
use lb_userspace::dataplane::next;
use serde_json::{Value, json};

use crate::packet::{Options, config_text, run_repeat, xdp};
use crate::report::{Table, median, num};
use lb_tests::program::Instance;

const XDP_PASS: u32 = 2;

/// The three programs' figures for `frame` (a frame for no VIP), as a table and JSON.
pub fn run(opts: &Options, pass_ebpf: &mut aya::Ebpf, frame: &[u8]) -> Result<(Table, Value)> {
    let mut plain = Instance::load(&config_text(1))?;
    let mut chained = Instance::load(&config_text(1))?;
    // The empty program, pinned for `next::open` as a host's program would be.
    let pin = std::path::PathBuf::from(format!("/sys/fs/bpf/lb-bench-next-{}", std::process::id()));
    xdp(pass_ebpf, "xdp_pass")?
        .pin(&pin)
        .with_context(|| format!("pin xdp_pass at {}", pin.display()))?;
    let opened = next::open(&pin);
    let _ = std::fs::remove_file(&pin);
    let program = opened.context("open the pinned xdp_pass")?;
    chained.dataplane.chain(Some(&program))?;
    let (mut lb_pass, mut lb_chained, mut empty) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..opts.rounds {
        let (rv, k, _) = run_repeat(plain.dataplane.program_mut()?, frame, opts.repeat)?;
        ensure!(rv == XDP_PASS, "lb_xdp returned {rv}");
        lb_pass.push(k);
        let (rv, k, _) = run_repeat(chained.dataplane.program_mut()?, frame, opts.repeat)?;
        ensure!(rv == XDP_PASS, "lb_xdp chained to xdp_pass returned {rv}");
        lb_chained.push(k);
        let (_, k, _) = run_repeat(xdp(pass_ebpf, "xdp_pass")?, frame, opts.repeat)?;
        empty.push(k);
    }
    let (p, c, e) = (median(&lb_pass), median(&lb_chained), median(&empty));
    let mut table = Table::new(
        "A passed frame with next_program (kernel ns per run, medians)",
        &[
            "lb pass",
            "lb pass + tail call",
            "tail call (difference)",
            "chained / plain",
            "xdp_pass alone",
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
         pass_not_vip's. The tail call's program is the test object's xdp_pass (it returns \
         at once): what a host firewall adds is its own cost on top.",
        opts.rounds, opts.repeat
    ));
    let json = json!({
        "lb_pass_kernel_ns": lb_pass,
        "lb_pass_tail_call_kernel_ns": lb_chained,
        "xdp_pass_kernel_ns": empty,
        "median": { "lb_pass": p, "lb_pass_tail_call": c, "xdp_pass": e, "ratio": c / p },
    });
    Ok((table, json))
}
