//! `lb`: the command line of the load balancer. The commands are in `lb_userspace::cli`;
//! this sets up logging and the runtime, and maps an error to its exit code.

use std::process::ExitCode;

use clap::Parser;

use lb_userspace::cli::{self, Cli};

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
    match runtime.block_on(cli::execute(cli.command)) {
        Ok(code) => code,
        Err(error) => {
            eprintln!("lb: {error:#}");
            cli::exit_code(&error)
        }
    }
}
