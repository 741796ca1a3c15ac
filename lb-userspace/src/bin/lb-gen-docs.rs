//! `lb-gen-docs DIR`: writes the man pages, the shell completions and the peer's XDP
//! object for the Debian package (`cargo xtask dist`):
//! - `DIR/man/lb.1`, `lb-run.1`, ...: one per command, generated from the `lb` command
//!   line itself;
//! - `DIR/man/lb.8`: the administrator's page (what lb is, its files, exit codes,
//!   examples), written by hand in `scripts/man/lb.8`;
//! - `DIR/man/lb.toml.5`: the configuration file, generated from the book's configuration
//!   reference (`docs/src/configuration.md`), so the two never differ;
//! - `DIR/completions/lb.bash`, `_lb`, `lb.fish`;
//! - `DIR/lib/xdp-pass.o`: the veth peer's XDP_PASS object (`lb peer attach` embeds the
//!   same), for iproute2: `ip link set dev PEER xdpdrv obj xdp-pass.o sec xdp.frags`.

use std::path::PathBuf;

use anyhow::Context;
use clap::CommandFactory;
use clap_complete::Shell;

/// The administrator's page, as written.
const LB_8: &str = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/man/lb.8"));
/// The configuration reference, in Markdown.
const REFERENCE: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../docs/src/configuration.md"
));

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
    std::fs::write(man.join("lb.8"), LB_8).context("writing lb.8")?;
    std::fs::write(man.join("lb.toml.5"), config_page(REFERENCE)).context("writing lb.toml.5")?;
    for shell in [Shell::Bash, Shell::Zsh, Shell::Fish] {
        clap_complete::generate_to(shell, &mut command.clone(), "lb", &completions)
            .with_context(|| format!("writing {shell} completions"))?;
    }
    let lib = dir.join("lib");
    std::fs::create_dir_all(&lib).with_context(|| format!("creating {}", lib.display()))?;
    std::fs::write(
        lib.join("xdp-pass.o"),
        lb_userspace::dataplane::peer::OBJECT,
    )
    .context("writing xdp-pass.o")?;
    println!("{}", dir.display());
    Ok(())
}

/// lb.toml(5) from the configuration reference: its headings as sections, its TOML
/// blocks as they are, its prose with code in bold and links as their text.
fn config_page(markdown: &str) -> String {
    let mut out = String::from(
        ".TH LB.TOML 5 \"2026-12\" \"lb 0.1.0\" \"File Formats\"\n\
         .SH NAME\nlb.toml \\- configuration file of lb(8)\n\
         .SH SYNOPSIS\n/etc/lb/lb.toml\n",
    );
    let mut fenced = false;
    let mut after_title = false;
    for line in markdown.lines() {
        if line.starts_with("```") {
            out.push_str(if fenced {
                ".fi\n.RE\n"
            } else {
                ".PP\n.RS\n.nf\n"
            });
            fenced = !fenced;
            continue;
        }
        if fenced {
            out.push_str(&escape(line));
            out.push('\n');
            continue;
        }
        if line.starts_with("# ") {
            // The chapter's title: the page's description follows.
            out.push_str(".SH DESCRIPTION\n");
            after_title = true;
            continue;
        }
        if let Some(heading) = line.strip_prefix("## ") {
            out.push_str(&format!(".SH {}\n", inline(heading).to_uppercase()));
            continue;
        }
        if line.trim().is_empty() {
            if !after_title {
                out.push_str(".PP\n");
            }
            after_title = false;
            continue;
        }
        after_title = false;
        match line.strip_prefix("- ") {
            Some(item) => out.push_str(&format!(".IP \\(bu 2\n{}\n", inline(item))),
            None => {
                out.push_str(&inline(line));
                out.push('\n');
            }
        }
    }
    out.push_str(".SH SEE ALSO\n.BR lb (8),\n.BR lb (1),\n.BR lb\\-check (1)\n");
    out
}

/// A line as roff text: backslashes and hyphens escaped, a leading `.` or `'` guarded.
fn escape(line: &str) -> String {
    let text = line.replace('\\', "\\e").replace('-', "\\-");
    if text.starts_with('.') || text.starts_with('\'') {
        format!("\\&{text}")
    } else {
        text
    }
}

/// Markdown inline markup as roff: `code` and **strong** in bold, *emphasis* in italics,
/// `[text](target)` as its text.
fn inline(line: &str) -> String {
    let mut text = String::new();
    let mut rest = line;
    // Links first: their text stays, their target goes.
    while let Some(open) = rest.find('[') {
        match rest[open..].find("](").and_then(|mid| {
            rest[open + mid..]
                .find(')')
                .map(|close| (mid, open + mid + close))
        }) {
            Some((mid, close)) if !rest[open..open + mid].contains('`') => {
                text.push_str(&rest[..open]);
                text.push_str(&rest[open + 1..open + mid]);
                rest = &rest[close + 1..];
            }
            _ => {
                text.push_str(&rest[..=open]);
                rest = &rest[open + 1..];
            }
        }
    }
    text.push_str(rest);
    let mut out = String::new();
    let mut code = false;
    let escaped = escape(&text);
    let mut chars = escaped.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '`' => {
                out.push_str(if code { "\\fR" } else { "\\fB" });
                code = !code;
            }
            '*' if !code && chars.peek() == Some(&'*') => {
                chars.next();
                out.push_str("\\fB");
                // The closing pair ends the bold.
                let mut inner = String::new();
                while let Some(c) = chars.next() {
                    if c == '*' && chars.peek() == Some(&'*') {
                        chars.next();
                        break;
                    }
                    inner.push(c);
                }
                out.push_str(&inner);
                out.push_str("\\fR");
            }
            _ => out.push(c),
        }
    }
    out
}
