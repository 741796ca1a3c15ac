//! `lb-gen-docs DIR`: writes the man pages (`DIR/man/lb.1`, `lb-run.1`, ...) and the shell
//! completions (`DIR/completions/lb.bash`, `_lb`, `lb.fish`) generated from the `lb`
//! command line itself, for the Debian package (`cargo xtask dist`).

use std::path::PathBuf;

use anyhow::Context;
use clap::CommandFactory;
use clap_complete::Shell;

fn main() -> anyhow::Result<()> {
    let dir = PathBuf::from(
        std::env::args_os()
            .nth(1)
            .context("usage: lb-gen-docs DIR")?,
    );
    let man = dir.join("man");
    let completions = dir.join("completions");
    for sub in [&man, &completions] {
        std::fs::create_dir_all(sub).with_context(|| format!("creating {}", sub.display()))?;
    }
    let command = lb_userspace::cli::Cli::command();
    clap_mangen::generate_to(command.clone(), &man)
        .with_context(|| format!("writing man pages to {}", man.display()))?;
    for shell in [Shell::Bash, Shell::Zsh, Shell::Fish] {
        clap_complete::generate_to(shell, &mut command.clone(), "lb", &completions)
            .with_context(|| format!("writing {shell} completions"))?;
    }
    println!("{}", dir.display());
    Ok(())
}
