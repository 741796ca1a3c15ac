//! `lb doctor`: is this host ready for the data path on the configured interface? One
//! line per check, `ok|warn|fail NAME: detail`, the fix in words where there is one.
//! `lb run` runs the same checks before it touches any pin: a failing one refuses the
//! start, warnings are logged once.
//!
//! - `facts.rs`: what the host is, as plain data;
//! - `checks.rs`: the checks, pure functions of the facts (unit-tested against recorded
//!   `ethtool` answers in `fixtures/`);
//! - `gather.rs`: reads the host into facts;
//! - `netlink.rs`: ethtool's and the netdev family's netlink messages (`--fix` too);
//! - `peerns.rs`: a veth peer's offloads, read in the peer's own network namespace;
//! - `dispatcher.rs`: whether the kernel accepts libxdp's dispatcher (`lb doctor` only:
//!   `lb run` does not need to know).

mod checks;
pub mod dispatcher;
mod facts;
#[cfg(test)]
mod fixtures;
mod gather;
mod netlink;
mod peerns;

use serde::Serialize;

pub use checks::{
    Finding, Level, MIN_KERNEL, SINGLE_BUFFER_MTU, check, driver_note, native_known, native_refusal,
};
pub use facts::{Facts, NextProgramFact};
pub use gather::gather;
pub use netlink::EthtoolError;

use crate::config::Config;

/// The checks' outcome for one host and configuration.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub interface: String,
    pub checks: Vec<Finding>,
    /// What `--fix` changed, one line each.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub fixed: Vec<String>,
    pub facts: Facts,
}

impl Report {
    pub fn of(facts: Facts) -> Report {
        Report {
            interface: facts.interface.clone(),
            checks: check(&facts),
            fixed: Vec::new(),
            facts,
        }
    }

    /// Gathers and checks `config`'s host.
    pub async fn run(config: &Config) -> Report {
        Report::of(gather(config).await)
    }

    /// `lb doctor`'s report: `run`'s, whether libxdp's dispatcher loads here, and
    /// whether lb can chain `dataplane.next_program`.
    pub async fn run_with_dispatcher(config: &Config) -> Report {
        let mut facts = gather(config).await;
        facts.dispatcher = Some(tokio::task::block_in_place(dispatcher::probe));
        facts.next_program = NextProgramFact::of(config);
        Report::of(facts)
    }

    /// One report per interface of `config` (`dataplane.interfaces`, in order).
    pub async fn run_each(config: &Config) -> Vec<Report> {
        let mut reports = Vec::new();
        for index in 0..config.dataplane.interfaces.len() {
            let one = config_for(config, index);
            // libxdp's dispatcher is the host's question: asked once, with the first.
            reports.push(if index == 0 {
                Report::run_with_dispatcher(&one).await
            } else {
                Report::run(&one).await
            });
        }
        reports
    }

    /// Several interfaces' reports as one: the host's checks once, every interface's own
    /// with its name before the detail. One report is itself.
    pub fn merge(mut reports: Vec<Report>) -> Report {
        if reports.len() <= 1 {
            return reports.pop().expect("a report per interface");
        }
        let names: Vec<String> = reports.iter().map(|r| r.interface.clone()).collect();
        let mut merged = reports[0].clone();
        merged.checks.retain(|c| HOST_CHECKS.contains(&c.name));
        merged.fixed.clear();
        for report in reports {
            merged.fixed.extend(report.fixed);
            merged.checks.extend(
                report
                    .checks
                    .into_iter()
                    .filter(|c| !HOST_CHECKS.contains(&c.name))
                    .map(|c| Finding {
                        detail: format!("{}: {}", report.interface, c.detail),
                        ..c
                    }),
            );
        }
        merged.interface = names.join(", ");
        merged
    }

    pub fn failed(&self) -> bool {
        self.checks.iter().any(|c| c.level == Level::Fail)
    }

    pub fn at(&self, level: Level) -> impl Iterator<Item = &Finding> {
        self.checks.iter().filter(move |c| c.level == level)
    }

    /// One line per check (and per fix applied), as `lb doctor` prints them.
    pub fn render(&self) -> String {
        let mut out = String::new();
        for line in &self.fixed {
            out += &format!("fixed {line}\n");
        }
        for finding in &self.checks {
            out += &format!("{finding}\n");
        }
        out
    }

    /// Why native mode cannot serve, when the facts make that certain.
    pub fn native_refusal(&self) -> Option<String> {
        native_refusal(&self.facts)
    }

    /// The message `lb run` refuses to start with: every failing check, with its fix.
    pub fn refusal(&self) -> String {
        let lines: Vec<String> = self.at(Level::Fail).map(|f| f.to_string()).collect();
        format!(
            "refusing to attach to {}:\n  {}\n(`lb doctor --config FILE` runs every check)",
            self.interface,
            lines.join("\n  ")
        )
    }
}

/// The checks of the host itself, made once however many interfaces there are; every
/// other check looks at one interface.
const HOST_CHECKS: [&str; 8] = [
    "privileges",
    "bpffs",
    "pins",
    "kernel",
    "btf",
    "jit",
    "libxdp-dispatcher",
    "next-program",
];

/// `config` as the checks of its `index`th interface see it: that interface as
/// `dataplane.interface`, the pins where the configuration has them.
pub fn config_for(config: &Config, index: usize) -> Config {
    let mut one = config.clone();
    one.dataplane.pin_path = Some(config.dataplane.pin_dir());
    one.dataplane.interface = config.dataplane.interfaces[index].clone();
    one
}

/// `lb doctor --fix`: turns off the offloads the checks name (the only fixes applied
/// without asking: nothing else on the host depends on them being on), then checks
/// again. Returns the new report, with what was changed in `fixed`.
pub async fn fix(config: &Config, report: Report) -> Result<Report, EthtoolError> {
    let wanted: Vec<String> = report
        .checks
        .iter()
        .flat_map(|c| c.fix.iter().cloned())
        .collect();
    if wanted.is_empty() {
        return Ok(report);
    }
    let ethtool = netlink::Ethtool::connect()?;
    ethtool.turn_off(&report.interface, &wanted).await?;
    let mut after = Report::run(config).await;
    after.facts.dispatcher = report.facts.dispatcher.clone();
    after.facts.next_program = report.facts.next_program.clone();
    after.checks = check(&after.facts);
    let features = after.facts.link.as_ref().and_then(|l| l.features.as_ref());
    for name in &wanted {
        let now_off = features.and_then(|f| f.get(name)).is_some_and(|f| !f.on);
        after.fixed.push(if now_off {
            format!("{}: {name} off", report.interface)
        } else {
            format!(
                "{}: {name} is still on (the driver refused)",
                report.interface
            )
        });
    }
    Ok(after)
}
