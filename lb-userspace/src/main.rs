//! `lb`: the command line of the load balancer.

use std::{path::PathBuf, process::ExitCode};

use clap::{Parser, Subcommand};
use std::net::{IpAddr, SocketAddr};

use lb_userspace::{
    agent,
    api::BackendRequest,
    client,
    config::{AdminState, Config},
    explain::{ExplainRequest, VipTarget},
    status,
};

#[derive(Parser)]
#[command(
    name = "lb",
    version,
    about = "XDP layer-4 load balancer with direct server return"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Attach to the configured interface and serve until SIGINT/SIGTERM.
    Run {
        #[arg(long)]
        config: PathBuf,
        /// Detach the program when the agent stops (default: it stays attached with its
        /// last tables, and a restarted agent adopts it).
        #[arg(long)]
        detach_on_exit: bool,
    },
    /// Detach the program a stopped agent left attached, and remove its pins.
    Detach {
        #[arg(long)]
        config: PathBuf,
    },
    /// Check the host for the configured interface: one line per check, `ok|warn|fail
    /// NAME: detail`; exit 0 when nothing fails, else 1.
    Doctor {
        /// The configuration whose `[dataplane]` is checked (default /etc/lb/lb.toml).
        #[arg(long, default_value = "/etc/lb/lb.toml")]
        config: PathBuf,
        #[arg(long)]
        json: bool,
        /// Apply the safe fixes (offloads off, through ethtool netlink), then check again.
        #[arg(long)]
        fix: bool,
    },
    /// Validate a configuration file: exit 0, or exit 2 naming the field and why.
    Check {
        #[arg(long)]
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
        /// SRC_IP:SRC_PORT of the client
        source: SocketAddr,
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
        #[arg(long, default_value_t = 1.0)]
        interval: f64,
        /// Stop after this many refreshes.
        #[arg(long)]
        count: Option<u64>,
        /// Highlight a VIP whose busiest backend gets more than this times the average.
        #[arg(long, default_value_t = 1.5)]
        hot: f64,
        #[command(flatten)]
        target: Target,
    },
    /// Show VIPs, backends, health and counters of the running agent.
    Status {
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        target: Target,
    },
}

#[derive(clap::Args)]
struct BackendArgs {
    /// VIP:PORT/PROTO, e.g. 10.0.0.100:80/tcp
    vip: VipTarget,
    /// The backend's address
    backend: IpAddr,
    #[command(flatten)]
    target: Target,
}

#[derive(Subcommand)]
enum BackendCommand {
    /// Add a backend (it takes traffic once resolved and, when checked, healthy).
    Add {
        #[command(flatten)]
        backend: BackendArgs,
        #[arg(long, default_value_t = 1)]
        weight: u32,
    },
    /// Drain a backend, then delete it once drained.
    Remove(BackendArgs),
}

#[derive(Subcommand)]
enum NodeCommand {
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

/// Where the running agent's control socket is.
#[derive(clap::Args)]
struct Target {
    /// Control socket path (default: the config's `control.socket`, else /run/lb/lb.sock).
    #[arg(long)]
    socket: Option<PathBuf>,
    /// Read the socket path from this configuration file.
    #[arg(long)]
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

/// Exit code for an invalid configuration (`lb check`, and `lb run` refusing to start).
const EXIT_INVALID_CONFIG: u8 = 2;

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("LB_LOG").unwrap_or_else(|_| {
                tracing_subscriber::EnvFilter::new("info,netlink_packet_route=error")
            }),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    match runtime.block_on(execute(cli.command)) {
        Ok(code) => code,
        Err(error) => {
            eprintln!("lb: {error:#}");
            if error
                .downcast_ref::<lb_userspace::config::ConfigError>()
                .is_some()
            {
                ExitCode::from(EXIT_INVALID_CONFIG)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}

async fn execute(command: Command) -> anyhow::Result<ExitCode> {
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
        Command::Detach { config } => detach(&config).await?,
        Command::Doctor { config, json, fix } => return doctor(&config, json, fix).await,
        Command::Check { config } => {
            let parsed = Config::load(&config)?;
            let backends: usize = parsed.vips.iter().map(|v| v.backends.len()).sum();
            println!(
                "{}: ok ({} VIP(s), {backends} backend(s))",
                config.display(),
                parsed.vips.len()
            );
        }
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
            json,
            target,
        } => {
            let request = ExplainRequest { vip, source };
            if json {
                println!(
                    "{}",
                    client::explain_json(&target.socket()?, &request).await?
                );
            } else {
                let e = client::explain(&target.socket()?, &request).await?;
                print_explanation(&request, e);
            }
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
            let options = lb_userspace::top::TopOptions {
                interval: std::time::Duration::from_secs_f64(interval),
                count,
                hot,
            };
            lb_userspace::top::run(&target.socket()?, options).await?
        }
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

/// `lb doctor`: exit 0 when no check fails, else 1.
async fn doctor(config: &std::path::Path, json: bool, fix: bool) -> anyhow::Result<ExitCode> {
    let config = Config::load(config)?;
    let mut report = lb_userspace::doctor::Report::run(&config).await;
    if fix {
        report = lb_userspace::doctor::fix(&config, report).await?;
    }
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

/// `lb detach`: removes the pins a stopped agent left, which detaches its program.
async fn detach(config: &std::path::Path) -> anyhow::Result<()> {
    let config = Config::load(config)?;
    let dir = config.dataplane.pin_dir();
    if client::agent_answers(&config.control.socket).await {
        anyhow::bail!(
            "an agent is running on {}: stop it first (or run it with --detach-on-exit)",
            config.control.socket.display()
        );
    }
    lb_userspace::dataplane::remove_pins(&dir)?;
    println!("detached: removed the pins in {}", dir.display());
    Ok(())
}

fn print_explanation(request: &ExplainRequest, e: lb_userspace::explain::Explanation) {
    let none = || "no backend".to_string();
    println!(
        "flow {} -> {} (vip {}): hash {:#010x}, slot {}",
        request.source, request.vip, e.vip, e.hash, e.slot
    );
    println!(
        "  maglev table:     {}",
        e.table_backend.unwrap_or_else(none)
    );
    match (e.conntrack_backend, e.conntrack_idle_seconds) {
        (Some(b), Some(idle)) => {
            println!("  connection table: {b} (last packet {idle:.1}s ago)")
        }
        _ => println!("  connection table: no entry"),
    }
    println!(
        "  next packet goes to: {}",
        e.next_packet_backend.unwrap_or_else(none)
    );
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
