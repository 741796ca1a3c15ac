//! `cargo xtask`: orchestration for lb (bootstrap, build, test, the lab, benchmarks,
//! clippy).
//!
//! Kept to std + anyhow + clap on purpose: it runs before everything else, so it must
//! compile in seconds on a fresh machine.

use std::{
    env,
    ffi::{OsStr, OsString},
    fs,
    os::unix::process::CommandExt,
    path::{Path, PathBuf},
    process::{Command, ExitCode, Stdio},
    time::Instant,
};

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand};

/// The only bpf-linker that works here: 0.11+ wants a system LLVM 22 (`-lLLVM`), while
/// 0.10.x loads rustc's own LLVM through rustup (see environment notes in the README).
const BPF_LINKER_VERSION: &str = "0.10.4";
/// cargo-deb, which `cargo xtask dist` builds the Debian package with: the newest release,
/// whose rust-version (1.85) the installed stable toolchain meets.
const CARGO_DEB_VERSION: &str = "3.8.0";
/// mdBook, which builds the book under docs/ (`cargo xtask test` builds it): the newest
/// release, whose rust-version (1.88) the installed stable toolchain meets. Without its
/// default features (the `serve` and `watch` commands' web server and file watcher):
/// `build` is all that is used, and it installs in half the time.
const MDBOOK_VERSION: &str = "0.5.4";
/// Debian packages the tests and the lab call: ip, ethtool, tcpdump, bpftool, bird (the
/// routing daemon of the ECMP/BGP test), systemd (`systemd-analyze verify` of the unit),
/// groff (the man pages checked), setpriv (util-linux: `lb` run unprivileged), script
/// (bsdutils: `lb top` on a pseudo-terminal), zcat (gzip: the man pages) and openssl
/// (the https checks' test: certificates and a TLS server).
/// lb-tests' `host` module names the same packages when a tool is missing.
const APT_PACKAGES: &[&str] = &[
    "iproute2",
    "ethtool",
    "tcpdump",
    "bpftool",
    "bird2",
    "systemd",
    "groff-base",
    "util-linux",
    "bsdutils",
    "gzip",
    // xdp-filter and xdp-loader: a host firewall behind lb (`next_program`) and a foreign
    // program on the hook, in tests/tests/neighbour.rs; `lb doctor`'s dispatcher probe.
    "xdp-tools",
    // The passive-health tests (tests/tests/outlier.rs) drop a backend's VIP traffic.
    "nftables",
    "openssl",
];
/// Debian packages only the benchmarks use: the load generator and what lb is compared
/// with (HAProxy) and balances to (nginx).
const BENCH_APT_PACKAGES: &[&str] = &["wrk", "haproxy", "nginx"];
const BPF_FS: &str = "/sys/fs/bpf";
/// Read by lb-tests: which `lb` binary to drive, and whether a skip is a failure.
const LB_BIN_ENV: &str = "LB_BIN";
const REQUIRE_ALL_ENV: &str = "LB_REQUIRE_ALL_TESTS";
/// Read by lb-tests: the Debian package to install in a scratch root.
const LB_DEB_ENV: &str = "LB_DEB";

#[derive(Parser)]
#[command(
    name = "xtask",
    bin_name = "cargo xtask",
    about = "Build, test and run lb",
    version
)]
struct Cli {
    #[command(subcommand)]
    command: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Install what is missing (rust-src for nightly, bpf-linker, cargo-deb, mdbook, apt
    /// packages, bpffs).
    Bootstrap,
    /// Bootstrap, then build the workspace (the eBPF object included).
    Build {
        #[arg(long)]
        release: bool,
    },
    /// Bootstrap, build, then run every test tier (root tiers skip without root,
    /// unless CI is set). Arguments after `--` go to the test harness, e.g.
    /// `cargo xtask test -- --nocapture` or `cargo xtask test -- maglev`.
    Test {
        #[arg(last = true, value_name = "TEST_ARGS")]
        test_args: Vec<OsString>,
    },
    /// Without arguments after `--`: the lab in network namespaces (root).
    /// With them: run the agent, e.g. `cargo xtask run -- run --config FILE`.
    Run(RunArgs),
    /// Clippy with -D warnings: the workspace, then the eBPF crate on its own target.
    Clippy,
    /// Bootstrap, build in release, then the Debian package (cargo-deb): the `lb` binary
    /// with its eBPF object, the systemd unit, an example /etc/lb/lb.toml, man pages and
    /// shell completions. Written to target/release/dist/.
    Dist {
        /// Package the debug build instead (what the tests install; not for production).
        #[arg(long)]
        debug: bool,
    },
    /// Bootstrap, install wrk, haproxy and nginx if missing, build in release, then run
    /// every benchmark (root; a few minutes). Prints a table and writes JSON (default
    /// target/bench/results.json). Arguments after `--` go to the bench binary, e.g.
    /// `cargo xtask bench -- --quick` or `cargo xtask bench -- --only packet,veth`.
    Bench {
        #[arg(last = true, value_name = "BENCH_ARGS")]
        bench_args: Vec<OsString>,
    },
}

#[derive(Args)]
struct RunArgs {
    /// Build and run the release profile.
    #[arg(long)]
    release: bool,
    /// Lab: keep the namespaces up after the demonstration, until Ctrl-C.
    #[arg(long)]
    keep: bool,
    /// Lab: number of TCP connections to send to the VIP.
    #[arg(long, value_name = "N")]
    requests: Option<u32>,
    /// Lab: XDP attach mode of the balancer.
    #[arg(long, value_name = "MODE", value_parser = ["native", "generic"])]
    mode: Option<String>,
    /// Arguments for `lb` itself, instead of the lab.
    #[arg(last = true, value_name = "LB_ARGS", conflicts_with_all = ["keep", "requests", "mode"])]
    lb_args: Vec<OsString>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let started = Instant::now();
    let result = Ctx::new().and_then(|ctx| match cli.command {
        Task::Bootstrap => bootstrap(&ctx, Scope::All),
        Task::Build { release } => {
            bootstrap(&ctx, Scope::All)?;
            build(&ctx, release, false)
        }
        Task::Test { test_args } => test(&ctx, &test_args),
        Task::Run(args) => run(&ctx, args),
        Task::Clippy => clippy(&ctx),
        Task::Dist { debug } => {
            bootstrap(&ctx, Scope::Toolchain)?;
            cargo_deb(&ctx)?;
            build(&ctx, !debug, false)?;
            let deb = dist(&ctx, !debug)?;
            println!("xtask: package {}", deb.display());
            println!("xtask: install it with: apt-get install {}", deb.display());
            Ok(())
        }
        Task::Bench { bench_args } => bench(&ctx, &bench_args),
    });
    match result {
        Ok(()) => {
            println!("xtask: done in {:.1}s", started.elapsed().as_secs_f64());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("xtask: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// What every subcommand needs to know about the machine and the workspace.
struct Ctx {
    root: PathBuf,
    target_dir: PathBuf,
    /// PATH for children, with cargo's bin directory (bpf-linker) in it.
    path: OsString,
    is_root: bool,
}

impl Ctx {
    fn new() -> Result<Self> {
        let root = workspace_root();
        // Cargo reads a relative CARGO_TARGET_DIR against its working directory; children
        // run in the workspace root, so anchor it there as they will.
        let target_dir = match env::var_os("CARGO_TARGET_DIR") {
            Some(dir) => root.join(dir),
            None => root.join("target"),
        };
        let cargo_bin = match env::var_os("CARGO_HOME") {
            Some(home) => PathBuf::from(home).join("bin"),
            None => {
                PathBuf::from(env::var_os("HOME").context("HOME is not set")?).join(".cargo/bin")
            }
        };
        let mut dirs: Vec<PathBuf> =
            env::split_paths(&env::var_os("PATH").unwrap_or_default()).collect();
        if !dirs.contains(&cargo_bin) {
            dirs.insert(0, cargo_bin);
        }
        let path = env::join_paths(dirs).context("cannot build PATH")?;
        Ok(Self {
            root,
            target_dir,
            path,
            is_root: effective_uid()? == 0,
        })
    }

    /// A command run in the workspace root with our PATH. std looks the program up in
    /// the child's PATH when it is set explicitly, so bpf-linker is found right after
    /// `cargo install` even if the caller's PATH lacked ~/.cargo/bin.
    fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new(program);
        cmd.current_dir(&self.root).env("PATH", &self.path);
        if let Some(dir) = env::var_os("CARGO_TARGET_DIR") {
            cmd.env("CARGO_TARGET_DIR", self.root.join(dir));
        }
        cmd
    }

    fn cargo(&self) -> Command {
        // The rustup proxy, not $CARGO: `+nightly` and bpf-linker's LD_LIBRARY_PATH to
        // rustc's libLLVM both come from rustup.
        self.command("cargo")
    }

    fn profile_dir(&self, release: bool) -> PathBuf {
        self.target_dir
            .join(if release { "release" } else { "debug" })
    }
}

fn workspace_root() -> PathBuf {
    let xtask_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    xtask_dir.parent().unwrap_or(xtask_dir).to_path_buf()
}

/// Effective uid from /proc/self/status (`Uid: real effective saved fs`), else `id -u`.
fn effective_uid() -> Result<u32> {
    if let Ok(status) = fs::read_to_string("/proc/self/status")
        && let Some(uid) = status
            .lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|uid| uid.parse().ok())
    {
        return Ok(uid);
    }
    let out = probe(Command::new("id").arg("-u"))?.context("`id -u` failed")?;
    out.trim()
        .parse()
        .with_context(|| format!("`id -u` printed {out:?}"))
}

#[derive(Clone, Copy, PartialEq)]
enum Scope {
    /// The toolchain only: enough to compile (clippy).
    Toolchain,
    /// Also the system tools and bpffs the tests and the lab use.
    All,
}

fn bootstrap(ctx: &Ctx, scope: Scope) -> Result<()> {
    nightly_toolchain(ctx)?;
    rust_src(ctx)?;
    bpf_linker(ctx)?;
    if scope == Scope::All {
        cargo_deb(ctx)?;
        mdbook(ctx)?;
        apt_packages(ctx)?;
        bpffs(ctx)?;
    }
    Ok(())
}

fn step(what: &str, status: impl std::fmt::Display) {
    println!("bootstrap: {what}: {status}");
}

fn nightly_toolchain(ctx: &Ctx) -> Result<()> {
    const WHAT: &str = "nightly toolchain";
    let list = probe(ctx.command("rustup").args(["toolchain", "list"]))
        .context("cannot run `rustup toolchain list`: is rustup installed?")?
        .context("`rustup toolchain list` failed")?;
    match list
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .find(|t| t.starts_with("nightly"))
    {
        Some(name) => {
            step(WHAT, format_args!("already installed ({name})"));
            Ok(())
        }
        None => {
            step(WHAT, "MISSING");
            // Installing a toolchain needs rustup's server, which this kind of machine
            // cannot reach, and RUSTUP_AUTO_INSTALL=0 forbids doing it implicitly.
            bail!(
                "the `nightly` toolchain is not installed (rustup toolchain list: {}); the eBPF \
                 crate needs it. Bootstrap does not install toolchains: run \
                 `rustup toolchain install nightly` on a machine that can reach rustup's server",
                list.lines()
                    .filter_map(|l| l.split_whitespace().next())
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        }
    }
}

fn rust_src(ctx: &Ctx) -> Result<()> {
    const WHAT: &str = "rust-src for nightly";
    let installed = probe(ctx.command("rustup").args([
        "component",
        "list",
        "--toolchain",
        "nightly",
        "--installed",
    ]))?
    .context("`rustup component list --toolchain nightly --installed` failed")?;
    // The line is `rust-src`, without a target triple: it is target independent.
    if installed
        .lines()
        .any(|l| l.split_whitespace().next() == Some("rust-src"))
    {
        step(WHAT, "already installed");
        return Ok(());
    }
    step(WHAT, "missing, installing");
    run_cmd(ctx.command("rustup").args([
        "component",
        "add",
        "rust-src",
        "--toolchain",
        "nightly",
    ]))?;
    step(WHAT, "installed");
    Ok(())
}

fn bpf_linker(ctx: &Ctx) -> Result<()> {
    cargo_tool(
        ctx,
        "bpf-linker",
        BPF_LINKER_VERSION,
        ctx.command("bpf-linker").arg("--version"),
        "(0.11+ cannot find libLLVM here), installing (about a minute)",
        &[],
    )
}

fn cargo_deb(ctx: &Ctx) -> Result<()> {
    cargo_tool(
        ctx,
        "cargo-deb",
        CARGO_DEB_VERSION,
        ctx.cargo().args(["deb", "--version"]),
        "installing (a few minutes)",
        &[],
    )
}

fn mdbook(ctx: &Ctx) -> Result<()> {
    cargo_tool(
        ctx,
        "mdbook",
        MDBOOK_VERSION,
        ctx.command("mdbook").arg("--version"),
        "installing (a few minutes)",
        &["--no-default-features", "--features", "search"],
    )
}

/// `mdbook build docs`: the book, into docs/book/. Its links are checked by the docs
/// test (lb-userspace/tests/docs.rs).
fn book(ctx: &Ctx) -> Result<()> {
    run_cmd(ctx.command("mdbook").args(["build", "docs"]))
}

/// Installs `name@version` with `cargo install --locked` (and `install_args`) unless
/// `version_cmd` (which prints the version, bare or as `vX.Y.Z`) already says `version`.
/// `other`: what to say when another version is found.
fn cargo_tool(
    ctx: &Ctx,
    name: &str,
    version: &str,
    version_cmd: &mut Command,
    other: &str,
    install_args: &[&str],
) -> Result<()> {
    let what = format!("{name} {version}");
    let mut found = || -> Option<String> {
        // Not startable means not installed.
        probe(version_cmd)
            .ok()
            .flatten()
            .map(|v| v.trim().to_string())
    };
    let wanted = |v: &str| {
        v.split_whitespace()
            .any(|w| w.strip_prefix('v').unwrap_or(w) == version)
    };
    match found() {
        Some(v) if wanted(&v) => {
            step(&what, "already installed");
            return Ok(());
        }
        Some(v) => step(&what, format_args!("found `{v}` {other}")),
        None => step(&what, "not found, installing"),
    }
    run_cmd(
        ctx.cargo()
            .args(["install", &format!("{name}@{version}"), "--locked"])
            .args(install_args),
    )?;
    match found() {
        Some(v) if wanted(&v) => {
            step(&what, "installed");
            Ok(())
        }
        reported => bail!(
            "after `cargo install {name}@{version}`, {name} reports {reported:?}: another \
             {name} comes first on PATH ({})",
            ctx.path.to_string_lossy()
        ),
    }
}

/// The Debian package of the build in the release (or debug) profile, which must be
/// built: man pages and completions from `lb-gen-docs`, then cargo-deb. Returns the
/// package's path.
fn dist(ctx: &Ctx, release: bool) -> Result<PathBuf> {
    let profile = ctx.profile_dir(release);
    let out = profile.join("dist");
    if out.exists() {
        fs::remove_dir_all(&out).with_context(|| format!("clearing {}", out.display()))?;
    }
    run_cmd(Command::new(profile.join("lb-gen-docs")).arg(&out))?;
    // Compressed, as Debian wants man pages (cargo-deb compresses only those outside
    // the target directory).
    let pages: Vec<PathBuf> = fs::read_dir(out.join("man"))
        .context("reading the generated man pages")?
        .flatten()
        .map(|e| e.path())
        .collect();
    run_cmd(Command::new("gzip").args(["-9", "-n", "-f"]).args(&pages))?;
    let mut deb = ctx.cargo();
    deb.args([
        "deb",
        "-p",
        "lb-userspace",
        "--no-build",
        "--strip",
        "--no-dbgsym",
    ])
    .arg("--output")
    .arg(&out);
    if !release {
        // Cargo-deb's `target/release/` then means target/debug/; a fast compression,
        // as this package is only installed by the tests. (cargo-deb warns that it may
        // refuse the dev profile some day: the pinned version takes it, and a profile
        // of its own would cost the tests a second full build.)
        deb.args(["--profile", "dev", "--fast"]);
    }
    run_cmd(&mut deb)?;
    let mut debs: Vec<PathBuf> = fs::read_dir(&out)
        .with_context(|| format!("reading {}", out.display()))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "deb"))
        .collect();
    match (debs.pop(), debs.is_empty()) {
        (Some(deb), true) => Ok(deb),
        (None, _) => bail!("cargo deb wrote no .deb into {}", out.display()),
        (Some(_), false) => bail!("more than one .deb in {}", out.display()),
    }
}

fn apt_packages(ctx: &Ctx) -> Result<()> {
    let needed_for = "the lab and the root test tiers need them";
    install_missing(ctx, APT_PACKAGES, "", needed_for).map(drop)
}

/// Installs with apt-get those of `packages` that are missing (one `apt-get update` first),
/// one line per package saying what it found; as non-root it only says what to run.
/// Returns whether it installed anything.
fn install_missing(ctx: &Ctx, packages: &[&str], label: &str, needed_for: &str) -> Result<bool> {
    let mut missing = Vec::new();
    for &pkg in packages {
        let what = format!("apt package {pkg}{label}");
        let status = match probe(Command::new("dpkg-query").args(["-W", "-f=${Status}", pkg])) {
            Ok(status) => status.unwrap_or_default(),
            Err(_) => {
                warn_loud(&[
                    "dpkg-query not found: not a Debian system?".into(),
                    format!("install these yourself: {}", packages.join(" ")),
                ]);
                return Ok(false);
            }
        };
        if status.trim() == "install ok installed" {
            step(&what, "already installed");
        } else {
            step(&what, "missing");
            missing.push(pkg);
        }
    }
    if missing.is_empty() {
        return Ok(false);
    }
    if !ctx.is_root {
        warn_loud(&[
            format!(
                "not root: NOT installing apt packages {}",
                missing.join(" ")
            ),
            format!("{needed_for}; as root run:"),
            format!(
                "  apt-get install -y --no-install-recommends {}",
                missing.join(" ")
            ),
        ]);
        return Ok(false);
    }
    let apt = |args: &[&str]| {
        let mut cmd = ctx.command("apt-get");
        cmd.args(args)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .stdin(Stdio::null());
        cmd
    };
    run_cmd(&mut apt(&["update"]))?;
    let mut install = vec!["install", "-y", "--no-install-recommends"];
    install.extend(&missing);
    run_cmd(&mut apt(&install))?;
    step(&format!("apt packages {}", missing.join(" ")), "installed");
    Ok(true)
}

fn bpffs_mounted() -> Result<bool> {
    let mounts = fs::read_to_string("/proc/mounts").context("reading /proc/mounts")?;
    Ok(mounts.lines().any(|l| {
        let f: Vec<_> = l.split_whitespace().collect();
        f.get(1) == Some(&BPF_FS) && f.get(2) == Some(&"bpf")
    }))
}

fn bpffs(ctx: &Ctx) -> Result<()> {
    let what = format!("bpf filesystem at {BPF_FS}");
    if bpffs_mounted()? {
        step(&what, "already mounted");
        return Ok(());
    }
    if !ctx.is_root {
        step(&what, "not mounted");
        warn_loud(&[
            format!("not root: NOT mounting bpffs at {BPF_FS} (the agent pins its maps there)"),
            format!("as root run: mount -t bpf bpf {BPF_FS}"),
        ]);
        return Ok(());
    }
    step(&what, "not mounted, mounting");
    run_cmd(ctx.command("mount").args(["-t", "bpf", "bpf", BPF_FS]))?;
    if !bpffs_mounted()? {
        bail!(
            "`mount -t bpf bpf {BPF_FS}` succeeded but /proc/mounts shows no bpf filesystem there"
        );
    }
    step(&what, "mounted");
    Ok(())
}

fn build(ctx: &Ctx, release: bool, all_targets: bool) -> Result<()> {
    let mut cmd = ctx.cargo();
    cmd.args(["build", "--workspace"]);
    if all_targets {
        cmd.arg("--all-targets");
    }
    if release {
        cmd.arg("--release");
    }
    run_cmd(&mut cmd)
}

/// CI=true (or any value but empty/false/0).
fn in_ci() -> bool {
    env::var("CI")
        .is_ok_and(|v| !matches!(v.trim().to_ascii_lowercase().as_str(), "" | "false" | "0"))
}

fn test(ctx: &Ctx, test_args: &[OsString]) -> Result<()> {
    bootstrap(ctx, Scope::All)?;
    build(ctx, false, true)?;
    let ci = in_ci();
    println!("xtask: test tiers:");
    println!("xtask:   1. unit tests (no root): run");
    let root_tier = if ctx.is_root {
        "run"
    } else if ci {
        "FAIL (not root, and CI requires every tier)"
    } else {
        "SKIPPED (not root)"
    };
    println!("xtask:   2. BPF_PROG_TEST_RUN fixtures (root): {root_tier}");
    println!("xtask:   3. namespace end-to-end tests (root): {root_tier}");
    if !ctx.is_root {
        warn_loud(&[
            "not root: the BPF_PROG_TEST_RUN fixtures and the namespace end-to-end tests".into(),
            if ci {
                format!("will FAIL ({REQUIRE_ALL_ENV}=1 because CI is set); run as root")
            } else {
                "will be SKIPPED; only the unit tests prove anything in this run".into()
            },
        ]);
    }

    // The package of this build, for the test that installs it in a scratch root; the
    // book, which must build.
    let deb = dist(ctx, false)?;
    book(ctx)?;
    let mut cmd = ctx.cargo();
    // --no-fail-fast: one failing unit test must not hide what the root tiers found.
    cmd.args(["test", "--workspace", "--no-fail-fast"])
        .env(LB_BIN_ENV, ctx.profile_dir(false).join("lb"))
        .env(LB_DEB_ENV, &deb);
    if ci {
        cmd.env(REQUIRE_ALL_ENV, "1");
    }
    if !test_args.is_empty() {
        cmd.arg("--").args(test_args);
    }
    run_tests(&mut cmd)
}

/// Runs `cargo test`, passing its output through, and ends with one line that totals
/// every test binary's `test result:` line (cargo's own last line is often the 0-test
/// summary of a doc-test run). A test that could not run returns early and the harness
/// counts it as passed; lb-tests' `skip` says so on stderr (`*** SKIPPED: name: why ***`),
/// so those are counted here as skipped, not passed.
fn run_tests(cmd: &mut Command) -> Result<()> {
    use std::io::{BufRead, BufReader};
    let shown = show(cmd);
    println!("xtask: $ {shown}");
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot start `{shown}`"))?;
    let stderr = BufReader::new(child.stderr.take().expect("piped"));
    // Passed through as it comes (compiler messages, skips, panics), names of skipped
    // tests kept.
    let skips = std::thread::spawn(move || {
        let mut skipped = std::collections::BTreeSet::new();
        for line in stderr.lines().map_while(Result::ok) {
            eprintln!("{line}");
            if let Some(name) = skipped_test(&line) {
                skipped.insert(name.to_string());
            }
        }
        skipped
    });
    let mut totals = Totals::default();
    for line in BufReader::new(child.stdout.take().expect("piped")).lines() {
        let line = line.context("reading cargo test's output")?;
        println!("{line}");
        totals.add(&line);
    }
    let status = child
        .wait()
        .with_context(|| format!("waiting for `{shown}`"))?;
    let skipped = skips.join().unwrap_or_default();
    println!("{}", totals.summary(&skipped));
    if !status.success() {
        bail!("`{shown}` failed ({status})");
    }
    Ok(())
}

/// The name of the test a line of lb-tests' `skip` names.
fn skipped_test(line: &str) -> Option<&str> {
    let rest = line.trim().strip_prefix("*** SKIPPED: ")?;
    rest.split_once(": ").map(|(name, _)| name)
}

/// The sums of the harness's `test result:` lines.
#[derive(Debug, Default, PartialEq)]
struct Totals {
    passed: u64,
    failed: u64,
    ignored: u64,
}

impl Totals {
    /// Adds a `test result: ok. 11 passed; 0 failed; 0 ignored; ...` line (others are
    /// left alone).
    fn add(&mut self, line: &str) {
        let Some(summary) = line.strip_prefix("test result: ") else {
            return;
        };
        for part in summary.split(['.', ';']) {
            let mut words = part.split_whitespace();
            if let (Some(n), Some(what)) = (words.next(), words.next()) {
                let n: u64 = n.parse().unwrap_or(0);
                match what {
                    "passed" => self.passed += n,
                    "failed" => self.failed += n,
                    "ignored" => self.ignored += n,
                    _ => {}
                }
            }
        }
    }

    /// The closing line: tests that returned early after a skip count as skipped.
    fn summary(&self, skipped: &std::collections::BTreeSet<String>) -> String {
        let early = skipped.len() as u64;
        let mut line = format!(
            "tests: {} passed, {} failed, {} skipped (could not run here), {} ignored",
            self.passed.saturating_sub(early),
            self.failed,
            early,
            self.ignored
        );
        if !skipped.is_empty() {
            let names: Vec<&str> = skipped.iter().map(String::as_str).collect();
            line.push_str(&format!("\ntests skipped: {}", names.join(", ")));
        }
        line
    }
}

fn run(ctx: &Ctx, args: RunArgs) -> Result<()> {
    bootstrap(ctx, Scope::All)?;
    build(ctx, args.release, false)?;
    let bin = ctx.profile_dir(args.release);
    let mut cmd;
    if args.lb_args.is_empty() {
        if !ctx.is_root {
            warn_loud(&[
                "not root: the lab creates network namespaces and attaches XDP; expect it to fail"
                    .into(),
            ]);
        }
        cmd = Command::new(bin.join("lab"));
        cmd.arg("--lb-bin").arg(bin.join("lb"));
        if args.keep {
            cmd.arg("--keep");
        }
        if let Some(n) = args.requests {
            cmd.arg("--requests").arg(n.to_string());
        }
        if let Some(mode) = &args.mode {
            cmd.args(["--mode", mode]);
        }
    } else {
        cmd = Command::new(bin.join("lb"));
        cmd.args(&args.lb_args);
    }
    cmd.current_dir(&ctx.root).env("PATH", &ctx.path);
    println!("xtask: $ {}", show(&cmd));
    // exec: the child gets Ctrl-C alone (the lab tears its namespaces down, the agent
    // detaches), and its exit code is ours.
    let err = cmd.exec();
    Err(err).with_context(|| format!("cannot execute `{}`", show(&cmd)))
}

fn bench(ctx: &Ctx, bench_args: &[OsString]) -> Result<()> {
    bootstrap(ctx, Scope::All)?;
    bench_packages(ctx)?;
    build(ctx, true, false)?;
    if !ctx.is_root {
        warn_loud(&[
            "not root: the benchmarks need BPF_PROG_TEST_RUN, namespaces and XDP; expect them to fail"
                .into(),
        ]);
    }
    let bin = ctx.profile_dir(true);
    let mut cmd = Command::new(bin.join("bench"));
    cmd.arg("--lb-bin")
        .arg(bin.join("lb"))
        .args(bench_args)
        .current_dir(&ctx.root)
        .env("PATH", &ctx.path);
    println!("xtask: $ {}", show(&cmd));
    // exec: Ctrl-C reaches the benchmark alone, which then tears its namespaces down.
    let err = cmd.exec();
    Err(err).with_context(|| format!("cannot execute `{}`", show(&cmd)))
}

/// wrk, haproxy and nginx through apt-get, only those missing, saying what it does.
fn bench_packages(ctx: &Ctx) -> Result<()> {
    let installed = install_missing(
        ctx,
        BENCH_APT_PACKAGES,
        " (benchmarks)",
        "the benchmarks need them",
    )?;
    if installed {
        println!(
            "xtask: note: where an init system runs, Debian starts the nginx and haproxy \
             services on install; the benchmarks do not use them (they start their own inside \
             namespaces)"
        );
    }
    Ok(())
}

fn clippy(ctx: &Ctx) -> Result<()> {
    // The workspace build script compiles the eBPF object, so the toolchain is needed;
    // apt packages and bpffs are not.
    bootstrap(ctx, Scope::Toolchain)?;
    run_cmd(ctx.cargo().args([
        "clippy",
        "--workspace",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ]))?;
    run_cmd(ctx.cargo().current_dir(ctx.root.join("lb-ebpf")).args([
        "+nightly",
        "clippy",
        "--target",
        "bpfel-unknown-none",
        "-Z",
        "build-std=core",
        "--release",
        "--",
        "-D",
        "warnings",
    ]))
}

/// Prints the command, runs it with inherited stdio, and fails naming it unless it
/// exits 0.
fn run_cmd(cmd: &mut Command) -> Result<()> {
    let shown = show(cmd);
    println!("xtask: $ {shown}");
    let status = cmd
        .status()
        .with_context(|| format!("cannot start `{shown}`"))?;
    if !status.success() {
        bail!("`{shown}` failed ({status})");
    }
    Ok(())
}

/// Runs a check quietly: Ok(Some(stdout)) on success, Ok(None) when it ran and failed,
/// Err when it could not be started (not installed).
fn probe(cmd: &mut Command) -> Result<Option<String>> {
    let out = cmd
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .with_context(|| format!("cannot run `{}`", show(cmd)))?;
    Ok(out
        .status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned()))
}

/// `A=1 cargo test --workspace` as a shell would take it; PATH is left out (always set).
fn show(cmd: &Command) -> String {
    let mut words: Vec<String> = cmd
        .get_envs()
        .filter(|(k, _)| *k != "PATH")
        .filter_map(|(k, v)| Some(format!("{}={}", k.to_string_lossy(), quote(v?))))
        .collect();
    words.push(quote(cmd.get_program()));
    words.extend(cmd.get_args().map(quote));
    let line = words.join(" ");
    match cmd.get_current_dir() {
        Some(dir) if dir != workspace_root() => {
            format!("(cd {} && {line})", quote(dir.as_os_str()))
        }
        _ => line,
    }
}

fn quote(word: &OsStr) -> String {
    let s = word.to_string_lossy();
    let plain = !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./=:@+,%".contains(c));
    if plain {
        s.into_owned()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

fn warn_loud(lines: &[String]) {
    let bar = "!".repeat(72);
    eprintln!("xtask: {bar}");
    for line in lines {
        eprintln!("xtask: WARNING: {line}");
    }
    eprintln!("xtask: {bar}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn early_returning_skips_count_as_skipped_not_passed() {
        let mut totals = Totals::default();
        totals.add("test result: ok. 11 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out; finished in 0.01s");
        totals.add("test result: FAILED. 3 passed; 2 failed; 0 ignored; 0 measured");
        totals.add("running 3 tests");
        assert_eq!(
            totals,
            Totals {
                passed: 14,
                failed: 2,
                ignored: 1
            }
        );
        let lines = [
            "",
            "*** SKIPPED: nic_doctor_fix: needs root (network namespaces, XDP) ***",
            "*** SKIPPED: restart_adopts: no bpffs at /sys/fs/bpf and mounting one failed ***",
            "*** SKIPPED: nic_doctor_fix: needs root (network namespaces, XDP) ***",
            "warning: unused variable",
        ];
        let skipped: std::collections::BTreeSet<String> = lines
            .iter()
            .filter_map(|l| skipped_test(l))
            .map(String::from)
            .collect();
        assert_eq!(
            totals.summary(&skipped),
            "tests: 12 passed, 2 failed, 2 skipped (could not run here), 1 ignored\n\
             tests skipped: nic_doctor_fix, restart_adopts"
        );
    }
}
