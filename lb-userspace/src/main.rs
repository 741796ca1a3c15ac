//! `lb`: the command line of the load balancer.

use std::{path::PathBuf, process::ExitCode};

use anyhow::Context;
use clap::{Parser, Subcommand};
use lb_userspace::{agent, config::Config, control};

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
    /// Show VIPs, backends, health and counters of the running agent.
    Status {
        #[arg(long)]
        json: bool,
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
        Command::Run { config } => agent::run(config).await?,
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
            let body = control::request(&target.socket()?, hyper::Method::POST, "/reload")
                .await
                .context("reload refused")?;
            let answer: control::ReloadAnswer = serde_json::from_slice(&body)?;
            if answer.changes.is_empty() {
                println!("reloaded: no change");
            }
            for line in answer.changes {
                println!("reloaded: {line}");
            }
        }
        Command::Status { json, target } => {
            let body = control::request(&target.socket()?, hyper::Method::GET, "/status").await?;
            if json {
                println!("{}", String::from_utf8_lossy(&body));
            } else {
                let status: control::Status = serde_json::from_slice(&body)?;
                print!("{}", control::render(&status));
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
