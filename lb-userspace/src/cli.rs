//! The `lb` command line: its definition (clap), which the man page and the shell
//! completions are generated from (`src/bin/lb-gen-docs.rs`), and what each command does.
//! `main.rs` only sets up logging and the runtime and maps errors to exit codes.

use std::{
    net::{IpAddr, SocketAddr},
    path::{Path, PathBuf},
    process::ExitCode,
};

use anyhow::Context as _;
use clap::{Parser, Subcommand};

use crate::{
    agent,
    config::{AdminState, Config},
    control::{api::BackendRequest, client},
    explain::{ExplainRequest, VipTarget},
    preflight, status,
};

/// Exit code for invalid input: a bad argument (clap's own) or configuration file.
pub const EXIT_INVALID_INPUT: u8 = 2;
/// Exit code when something refused or did not answer: the agent (unknown VIP or
/// backend, an invalid runtime change, no agent), the system (permissions), or `lb
/// detach` finding nothing attached.
pub const EXIT_REFUSED: u8 = 1;

const EXIT_STATUS_HELP: &str = "\
Exit status: 0 done; 2 invalid input (arguments, configuration file); 1 refused or \
unreachable (the agent refused the command or did not answer, permission denied, nothing \
to detach).";

#[derive(Parser)]
#[command(
    name = "lb",
    version,
    about = "XDP layer-4 load balancer with direct server return",
    after_help = EXIT_STATUS_HELP
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand)]
pub enum Command {
    /// Attach to the configured interface and serve until SIGINT/SIGTERM; SIGHUP reloads.
    Run {
        /// The configuration file (TOML).
        #[arg(long, value_name = "FILE")]
        config: PathBuf,
        /// Detach the program when the agent stops (default: it stays attached with its
        /// last tables, and a restarted agent adopts it).
        #[arg(long)]
        detach_on_exit: bool,
    },
    /// Detach the program a stopped agent left attached, and remove its pins. Exit 1
    /// when nothing was attached.
    Detach {
        /// The configuration file of the stopped agent (its interface and pin path).
        #[arg(long, value_name = "FILE")]
        config: PathBuf,
    },
    /// Check the host for the configured interface: one line per check, `ok|warn|fail
    /// NAME: detail`; exit 0 when nothing fails, else 1.
    Doctor {
        /// The configuration whose `[dataplane]` is checked.
        #[arg(long, value_name = "FILE", default_value = "/etc/lb/lb.toml")]
        config: PathBuf,
        /// Print the checks as JSON.
        #[arg(long)]
        json: bool,
        /// Apply the safe fixes (offloads off, through ethtool netlink), then check again.
        #[arg(long)]
        fix: bool,
    },
    /// Validate a configuration file: exit 0, or exit 2 naming the field and why.
    Check {
        /// The configuration file (TOML).
        #[arg(long, value_name = "FILE")]
        config: PathBuf,
    },
    /// Make the running agent re-read its configuration file (as SIGHUP does).
    Reload {
        #[command(flatten)]
        target: Target,
    },
    /// Which backend a flow goes to: the table's choice and the connection table's entry.
    Explain {
        /// VIP:PORT/PROTO, e.g. 10.0.0.100:80/tcp or [fd00::100]:80/tcp
        vip: VipTarget,
        /// SRC_IP:SRC_PORT of the client (IPv6: [ADDRESS]:PORT)
        source: SocketAddr,
        /// A QUIC short header's destination connection ID in hex: where a packet
        /// carrying it goes (a `quic` VIP routes it by the server ID in it)
        #[arg(long, value_name = "HEX")]
        quic_cid: Option<String>,
        /// Print the agent's answer as JSON (the control API's `POST /explain`).
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        target: Target,
    },
    /// Drain a backend: no new flows; existing flows continue until they end, go idle
    /// or the VIP's drain_timeout passes.
    Drain(BackendArgs),
    /// Return a backend to service.
    Ready(BackendArgs),
    /// Take a backend out at once: no traffic, no checks; its flows move.
    Maint(BackendArgs),
    /// Add or remove backends at runtime (a reload of the file undoes it).
    #[command(subcommand)]
    Backend(BackendCommand),
    /// This node's part in a multi-node deployment (`[announce]`).
    #[command(subcommand)]
    Node(NodeCommand),
    /// A live view: packets and new flows per second per backend, shares, health, hot
    /// spots. Refreshes every second until Ctrl-C.
    Top {
        /// Seconds between refreshes.
        #[arg(long, default_value_t = 1.0, value_name = "S")]
        interval: f64,
        /// Stop after this many refreshes.
        #[arg(long, value_name = "N")]
        count: Option<u64>,
        /// Highlight a VIP whose busiest backend gets more than this times the average.
        #[arg(long, default_value_t = 1.5, value_name = "R")]
        hot: f64,
        #[command(flatten)]
        target: Target,
    },
    /// On a backend: strip the IPIP/GUE headers of tunnelled packets (forward = "ipip" or
    /// "gue") in XDP and pass the inner packet to the stack, where the VIP on lo takes it.
    #[command(subcommand)]
    Decap(DecapCommand),
    /// On the peer of a veth the balancer runs on: an XDP program that passes every frame,
    /// which native XDP_TX on a veth needs on the other end.
    #[command(subcommand)]
    Peer(PeerCommand),
    /// Show VIPs, backends, health and counters of the running agent.
    Status {
        /// Print the status as JSON (the control API's `GET /status`; its fields are
        /// listed in the manual's "Seeing what happens").
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        target: Target,
    },
}

#[derive(clap::Args)]
pub struct BackendArgs {
    /// VIP:PORT/PROTO, e.g. 10.0.0.100:80/tcp or [fd00::100]:80/tcp
    vip: VipTarget,
    /// The backend's address
    backend: IpAddr,
    #[command(flatten)]
    target: Target,
}

#[derive(Subcommand)]
pub enum BackendCommand {
    /// Add a backend (it takes traffic once resolved and, when checked, healthy).
    Add {
        #[command(flatten)]
        backend: BackendArgs,
        /// Its relative share of the VIP's table, 1..=1000.
        #[arg(long, default_value_t = 1, value_name = "N")]
        weight: u32,
    },
    /// Drain a backend, then delete it once drained.
    Remove(BackendArgs),
}

#[derive(Subcommand)]
pub enum NodeCommand {
    /// Withdraw every VIP from the routers; this node keeps forwarding what still
    /// arrives. Returns once the routes are withdrawn. Lasts until `lb node ready` (or
    /// the agent restarts).
    Drain {
        #[command(flatten)]
        target: Target,
    },
    /// Announce again (each VIP once it qualifies: warm-up, min_healthy).
    Ready {
        #[command(flatten)]
        target: Target,
    },
}

#[derive(Subcommand)]
pub enum DecapCommand {
    /// Attach the decapsulation program to IFACE (pinned: it stays after this command);
    /// on an interface that has it, re-write the GUE port and the host's addresses.
    Attach {
        /// The interface tunnelled packets arrive on.
        iface: String,
        /// The UDP port GUE packets arrive on (the VIP's gue_port); 0: IPIP only.
        #[arg(long, value_name = "N", default_value_t = crate::config::DEFAULT_GUE_PORT)]
        gue_port: u16,
        #[command(flatten)]
        pins: DecapPins,
    },
    /// Detach the program from IFACE and remove its pins. Exit 1 when it was not attached.
    Detach {
        /// The interface it is attached to.
        iface: String,
        #[command(flatten)]
        pins: DecapPins,
    },
    /// Every interface the program is attached to: its GUE port, the addresses taken as
    /// this host's, and its counters.
    Status {
        /// Print it as JSON.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        pins: DecapPins,
    },
}

#[derive(Subcommand)]
pub enum PeerCommand {
    /// Attach the XDP_PASS program to IFACE in native mode (pinned: it stays after this
    /// command); then the balancer on IFACE's peer can run native.
    Attach {
        /// The veth the balancer's interface is paired with.
        iface: String,
        #[command(flatten)]
        pins: PeerPins,
    },
    /// Detach it from IFACE. Exit 1 when it was not attached.
    Detach {
        /// The interface it is attached to.
        iface: String,
        #[command(flatten)]
        pins: PeerPins,
    },
}

#[derive(clap::Args)]
pub struct PeerPins {
    /// Where the program's link is pinned (on a bpffs).
    #[arg(long, value_name = "DIR", default_value = crate::dataplane::peer::DEFAULT_PIN_DIR)]
    pin_path: PathBuf,
}

#[derive(clap::Args)]
pub struct DecapPins {
    /// Where the program's link and maps are pinned (on a bpffs).
    #[arg(long, value_name = "DIR", default_value = crate::dataplane::decap::DEFAULT_PIN_DIR)]
    pin_path: PathBuf,
}

/// Where the running agent's control socket is.
#[derive(clap::Args)]
pub struct Target {
    /// Control socket path (default: the config's `control.socket`, else /run/lb/lb.sock).
    #[arg(long, value_name = "PATH")]
    socket: Option<PathBuf>,
    /// Read the socket path from this configuration file.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
}

impl Target {
    fn socket(&self) -> anyhow::Result<PathBuf> {
        if let Some(socket) = &self.socket {
            return Ok(socket.clone());
        }
        if let Some(config) = &self.config {
            return Ok(Config::load(config)?.control.socket);
        }
        Ok(PathBuf::from("/run/lb/lb.sock"))
    }
}

/// The exit code for an error `execute` returned: invalid input (a configuration file
/// refused) or anything else.
pub fn exit_code(error: &anyhow::Error) -> ExitCode {
    if error.downcast_ref::<crate::config::ConfigError>().is_some() {
        ExitCode::from(EXIT_INVALID_INPUT)
    } else {
        ExitCode::from(EXIT_REFUSED)
    }
}

/// `lb check`: the file, then the checks `lb run` makes of it on this host before it
/// touches the data path (`preflight`); those that need an interface this host lacks are
/// said to be skipped.
async fn check(path: &Path) -> anyhow::Result<()> {
    let parsed = Config::load(path)?;
    let interface = match crate::neighbor::Neighbors::open(&parsed.dataplane.interface).await {
        Ok(neighbors) => Some(neighbors.interface().clone()),
        Err(crate::neighbor::NeighborError::NoInterface(_)) => None,
        Err(error) => {
            return Err(error).context("reading the data-path interface");
        }
    };
    let outcomes = preflight::run(
        &parsed,
        interface.as_ref(),
        crate::neighbor::route_to,
        preflight::Mode::Check,
    )?;
    for (check, outcome) in outcomes {
        match outcome {
            preflight::Outcome::NoInterface => eprintln!(
                "lb check: {} not checked: no interface {} on this host (lb run needs it)",
                check.name(),
                parsed.dataplane.interface
            ),
            preflight::Outcome::Warned(why) => eprintln!(
                "lb check: warning: {}: lb run on this host would refuse: {why}",
                check.name()
            ),
            preflight::Outcome::Passed | preflight::Outcome::NotConfigured => {}
        }
    }
    let backends: usize = parsed.vips.iter().map(|v| v.backends.len()).sum();
    println!(
        "{}: ok ({} VIP(s), {backends} backend(s))",
        path.display(),
        parsed.vips.len()
    );
    Ok(())
}

/// Runs one command.
pub async fn execute(command: Command) -> anyhow::Result<ExitCode> {
    match command {
        Command::Run {
            config,
            detach_on_exit,
        } => {
            let on_exit = if detach_on_exit {
                agent::OnExit::Detach
            } else {
                agent::OnExit::StayAttached
            };
            agent::run(config, on_exit).await?
        }
        Command::Detach { config } => return detach(&config).await,
        Command::Doctor { config, json, fix } => return doctor(&config, json, fix).await,
        Command::Check { config } => check(&config).await?,
        Command::Reload { target } => {
            let answer = client::reload(&target.socket()?).await?;
            if answer.changes.is_empty() {
                println!("reloaded: no change");
            }
            for line in answer.changes {
                println!("reloaded: {line}");
            }
        }
        Command::Explain {
            vip,
            source,
            quic_cid,
            json,
            target,
        } => {
            let request = ExplainRequest {
                quic_cid,
                ..ExplainRequest::flow(vip, source)
            };
            explain(&target, &request, json).await?;
        }
        Command::Drain(args) => change_state(args, AdminState::Drain).await?,
        Command::Ready(args) => change_state(args, AdminState::Ready).await?,
        Command::Maint(args) => change_state(args, AdminState::Maint).await?,
        Command::Backend(BackendCommand::Add { backend, weight }) => {
            let body = BackendRequest {
                vip: backend.vip,
                backend: backend.backend,
                state: None,
                weight: Some(weight),
            };
            send_change(&backend.target, "/backend/add", &body).await?
        }
        Command::Backend(BackendCommand::Remove(args)) => {
            let body = BackendRequest {
                vip: args.vip,
                backend: args.backend,
                state: None,
                weight: None,
            };
            send_change(&args.target, "/backend/remove", &body).await?
        }
        Command::Node(command) => {
            let (path, target) = match &command {
                NodeCommand::Drain { target } => ("/node/drain", target),
                NodeCommand::Ready { target } => ("/node/ready", target),
            };
            let answer = client::change_node(&target.socket()?, path).await?;
            println!("{}", answer.change);
        }
        Command::Top {
            interval,
            count,
            hot,
            target,
        } => {
            anyhow::ensure!(interval > 0.0, "--interval must be positive");
            let options = crate::top::TopOptions {
                interval: std::time::Duration::from_secs_f64(interval),
                count,
                hot,
            };
            crate::top::run(&target.socket()?, options).await?
        }
        Command::Decap(command) => return decap(command),
        Command::Peer(command) => return peer(command),
        Command::Status { json, target } => {
            let socket = target.socket()?;
            if json {
                println!("{}", client::status_json(&socket).await?);
            } else {
                print!("{}", status::render(&client::status(&socket).await?));
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `lb decap attach|detach|status`.
fn decap(command: DecapCommand) -> anyhow::Result<ExitCode> {
    use crate::dataplane::decap;
    match command {
        DecapCommand::Attach {
            iface,
            gue_port,
            pins,
        } => {
            agent::ensure_bpffs(&pins.pin_path)?;
            crate::bpffs::require_shared(&pins.pin_path)?;
            let status = decap::attach(
                crate::DECAP_OBJECT,
                &iface,
                gue_port,
                crate::config::XdpModeSetting::Auto,
                &pins.pin_path,
            )
            .with_context(|| format!("attaching the decapsulation program to {iface}"))?;
            println!("{}", decap_line(&status));
        }
        DecapCommand::Detach { iface, pins } => {
            if !decap::detach(&iface, &pins.pin_path)? {
                eprintln!(
                    "lb decap: nothing attached to {iface} (no pins in {})",
                    pins.pin_path.display()
                );
                return Ok(ExitCode::from(EXIT_REFUSED));
            }
            println!("detached from {iface}");
        }
        DecapCommand::Status { json, pins } => {
            let found = decap::status(&pins.pin_path)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&found)?);
            } else if found.is_empty() {
                println!(
                    "not attached anywhere (pins in {})",
                    pins.pin_path.display()
                );
                if crate::bpffs::reach(&pins.pin_path) == crate::bpffs::Reach::Private {
                    println!(
                        "note: {} is on no bpf filesystem the host shares: pins made in \
                         another `ip netns exec` went with it; {}",
                        pins.pin_path.display(),
                        crate::bpffs::PRIVATE_FIX
                    );
                }
            }
            for status in found.iter().filter(|_| !json) {
                println!("{}", decap_line(status));
                let nonzero: Vec<String> = (status.counters.iter())
                    .filter(|(_, v)| **v > 0)
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect();
                println!(
                    "  counters: {}",
                    if nonzero.is_empty() {
                        "none yet".to_string()
                    } else {
                        nonzero.join(" ")
                    }
                );
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `lb peer attach|detach`.
fn peer(command: PeerCommand) -> anyhow::Result<ExitCode> {
    use crate::dataplane::peer;
    match command {
        PeerCommand::Attach { iface, pins } => {
            agent::ensure_bpffs(&pins.pin_path)?;
            crate::bpffs::require_shared(&pins.pin_path)?;
            let mode = peer::attach(&iface, &pins.pin_path)
                .with_context(|| format!("attaching the XDP_PASS program to {iface}"))?;
            println!("xdp_pass on {iface} (xdp mode {mode})");
        }
        PeerCommand::Detach { iface, pins } => {
            if !peer::detach(&iface, &pins.pin_path)? {
                eprintln!(
                    "lb peer: nothing attached to {iface} (no pin in {})",
                    pins.pin_path.display()
                );
                return Ok(ExitCode::from(EXIT_REFUSED));
            }
            println!("detached from {iface}");
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// One attached interface as `lb decap` prints it.
fn decap_line(status: &crate::dataplane::decap::DecapStatus) -> String {
    let mode = status
        .mode
        .map_or("unknown mode".to_string(), |m| format!("xdp mode {m}"));
    let gue = match status.gue_port {
        0 => "ipip only (no gue)".to_string(),
        port => format!("ipip and gue port {port}"),
    };
    let addresses: Vec<String> = status.addresses.iter().map(|a| a.to_string()).collect();
    format!(
        "decap on {} ({mode}): {gue}; for {}",
        status.interface,
        addresses.join(", ")
    )
}

/// `lb doctor`: exit 0 when no check fails, else 1.
async fn doctor(config: &Path, json: bool, fix: bool) -> anyhow::Result<ExitCode> {
    let config = Config::load(config)?;
    let mut reports = crate::doctor::Report::run_each(&config).await;
    if fix {
        for (index, report) in reports.iter_mut().enumerate() {
            let one = crate::doctor::config_for(&config, index);
            *report = crate::doctor::fix(&one, report.clone()).await?;
        }
    }
    let report = crate::doctor::Report::merge(reports);
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report.render());
    }
    Ok(if report.failed() {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

/// `lb detach`: removes the pins a stopped agent left, which detaches its program. Exit
/// 1 when no program was attached (stale map pins are removed all the same).
async fn detach(config: &Path) -> anyhow::Result<ExitCode> {
    let config = Config::load(config)?;
    let dir = config.dataplane.pin_dir();
    if client::agent_listens(&config.control.socket).await {
        anyhow::bail!(
            "an agent is running on {}: stop it first (or run it with --detach-on-exit)",
            config.control.socket.display()
        );
    }
    let removed = crate::dataplane::remove_pins(&dir)?;
    let maps = match removed.maps {
        0 => String::new(),
        n => format!(" and {n} map pin(s)"),
    };
    if removed.link {
        println!(
            "detached: removed the pinned link{maps} in {}",
            dir.display()
        );
        Ok(ExitCode::SUCCESS)
    } else {
        let cleaned = match removed.maps {
            0 => String::new(),
            n => format!("; removed {n} stale map pin(s)"),
        };
        eprintln!(
            "lb: nothing was attached: no pinned link in {}{cleaned}",
            dir.display()
        );
        Ok(ExitCode::from(EXIT_REFUSED))
    }
}

/// `lb explain`: the agent's answer, as JSON or for people.
async fn explain(target: &Target, request: &ExplainRequest, json: bool) -> anyhow::Result<()> {
    if json {
        println!(
            "{}",
            client::explain_json(&target.socket()?, request).await?
        );
    } else {
        let e = client::explain(&target.socket()?, request).await?;
        print_explanation(request, e);
    }
    Ok(())
}

fn print_explanation(request: &ExplainRequest, e: crate::explain::Explanation) {
    let none = || "no backend".to_string();
    println!(
        "flow {} -> {} (vip {}): hash {:#010x}, slot {}",
        request.source, request.vip, e.vip, e.hash, e.slot
    );
    println!(
        "  maglev table:     {}",
        e.table_backend.unwrap_or_else(none)
    );
    if e.hot_source {
        println!("  hot source: balanced per connection");
    }
    match (e.conntrack_backend, e.conntrack_idle_seconds) {
        (Some(b), Some(idle)) => {
            println!("  connection table: {b} (last packet {idle:.1}s ago)")
        }
        _ => println!("  connection table: no entry"),
    }
    if let Some(b) = e.embryonic_backend {
        println!("  embryonic table:  {b} (its first packet; the next one enters it)");
    }
    println!(
        "  next packet goes to: {}",
        e.next_packet_backend.unwrap_or_else(none)
    );
    let via = match &e.next_hop {
        Some(hop) => format!(
            "next hop {} ({})",
            hop.address,
            hop.mac.as_deref().unwrap_or("unresolved")
        ),
        None => "no next hop".into(),
    };
    let out = e
        .interface
        .map(|name| format!(" out of {name}"))
        .unwrap_or_default();
    println!("  forwarded by:     {}, {via}{out}", e.forward);
    if let Some(quic) = e.quic {
        println!("  quic connection id: {}", quic.why);
    }
}

async fn change_state(args: BackendArgs, state: AdminState) -> anyhow::Result<()> {
    let body = BackendRequest {
        vip: args.vip,
        backend: args.backend,
        state: Some(state),
        weight: None,
    };
    send_change(&args.target, "/backend/state", &body).await
}

async fn send_change(target: &Target, path: &str, body: &BackendRequest) -> anyhow::Result<()> {
    let answer = client::change_backend(&target.socket()?, path, body).await?;
    println!("{}", answer.change);
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};

    use clap::CommandFactory;

    use super::*;

    /// Every command `lb --help` (and `lb backend --help` ...) lists, with its long
    /// options, except the `--socket`/`--config` pair every agent command takes (the
    /// README says so once, under its table).
    fn commands(command: &clap::Command, path: &str, out: &mut BTreeMap<String, BTreeSet<String>>) {
        for sub in command.get_subcommands().filter(|s| s.get_name() != "help") {
            let path = format!("{path} {}", sub.get_name()).trim().to_string();
            if sub.has_subcommands() {
                commands(sub, &path, out);
                continue;
            }
            let longs: BTreeSet<String> = sub
                .get_arguments()
                .filter_map(|a| a.get_long())
                .map(String::from)
                .collect();
            let targeted = longs.contains("socket");
            let options = longs
                .into_iter()
                .filter(|l| !(targeted && (l == "socket" || l == "config")))
                .filter(|l| l != "help")
                .collect();
            out.insert(path, options);
        }
    }

    /// The README's command table: per command (`backend add`), the options its row
    /// names.
    fn readme_commands() -> BTreeMap<String, BTreeSet<String>> {
        let readme = include_str!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../docs/src/commands.md"
        ));
        let section = readme
            .split("\n## Command line")
            .nth(1)
            .and_then(|rest| rest.split("\n## ").next())
            .expect("a Command line section");
        let mut out = BTreeMap::new();
        for row in section.lines().filter(|l| l.starts_with("| `lb ")) {
            let first = row.split(" | ").next().unwrap();
            for span in first.split('`').skip(1).step_by(2) {
                let words: Vec<&str> = span.split_whitespace().skip(1).collect();
                let path: Vec<&str> = words
                    .iter()
                    .take_while(|w| w.chars().all(|c| c.is_ascii_lowercase() || c == '-'))
                    .filter(|w| !w.starts_with('-'))
                    .copied()
                    .collect();
                let options = words
                    .iter()
                    .filter_map(|w| w.trim_matches(['[', ']']).strip_prefix("--"))
                    .map(String::from)
                    .collect();
                out.insert(path.join(" "), options);
            }
        }
        out
    }

    #[test]
    fn the_readme_command_table_matches_the_binary() {
        let mut binary = BTreeMap::new();
        commands(&Cli::command(), "", &mut binary);
        let readme = readme_commands();
        let names =
            |m: &BTreeMap<String, BTreeSet<String>>| -> Vec<String> { m.keys().cloned().collect() };
        assert_eq!(
            names(&readme),
            names(&binary),
            "commands: README vs lb --help"
        );
        for (command, options) in &binary {
            let documented = &readme[command];
            // `lb ready ...` stands for the options of `lb drain`.
            if documented.is_empty() && options.is_empty() {
                continue;
            }
            assert_eq!(
                documented, options,
                "options of `lb {command}`: README vs binary"
            );
        }
    }

    #[test]
    fn every_option_has_help() {
        fn walk(command: &clap::Command, path: &str) {
            for arg in command.get_arguments() {
                let id = arg.get_id().as_str();
                if ["help", "version"].contains(&id) {
                    continue;
                }
                assert!(
                    arg.get_help().is_some(),
                    "`lb {path}`: {id} has no help text"
                );
            }
            for sub in command.get_subcommands() {
                walk(sub, &format!("{path} {}", sub.get_name()));
            }
        }
        walk(&Cli::command(), "");
        Cli::command().debug_assert();
    }
}
