//! The Debian package (`cargo xtask dist`), installed into a scratch root with `dpkg -x`:
//! the binary runs from there, its example configuration passes `lb check`, and the
//! systemd unit, man pages and completions are where the unit and the docs say; its
//! control data (maintainer, scripts, changelog) is a real package's; its unit passes
//! `systemd-analyze verify` and is hardened.
//! `cargo xtask test` builds the package from the debug profile (a release build would
//! double the tests' build time) and passes its path in `LB_DEB`. No root needed.

use std::path::{Path, PathBuf};
use std::process::Command;

use lb_tests::skip;

fn run(command: &mut Command) -> String {
    let out = command.output().expect("start the command");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{command:?}: {}\n{text}", out.status);
    text
}

/// The package (`LB_DEB`) unpacked into a scratch root, or None after saying why the
/// test cannot run.
fn unpacked(test: &str) -> Option<(PathBuf, tempfile::TempDir)> {
    let Some(deb) = std::env::var_os("LB_DEB") else {
        skip(
            test,
            "LB_DEB is not set (`cargo xtask test` builds the package)",
        );
        return None;
    };
    if !lb_tests::host::require_tool(test, lb_tests::host::ZCAT) {
        return None;
    }
    let root = tempfile::tempdir().unwrap();
    run(Command::new("dpkg").arg("-x").arg(&deb).arg(root.path()));
    Some((PathBuf::from(deb), root))
}

#[test]
fn the_package_installs_and_runs_from_a_clean_root() {
    let test = "the_package_installs_and_runs_from_a_clean_root";
    let Some((deb, root)) = unpacked(test) else {
        return;
    };
    let root = root.path();

    let lb = root.join("usr/bin/lb");
    let help = run(Command::new(&lb).arg("--help"));
    for command in ["run", "check", "status", "reload", "detach", "backend"] {
        assert!(help.contains(command), "lb --help lacks {command}:\n{help}");
    }
    let config = root.join("etc/lb/lb.toml");
    let checked = run(Command::new(&lb).arg("check").arg("--config").arg(&config));
    assert!(checked.contains(": ok ("), "{checked}");

    let conffiles = run(Command::new("dpkg-deb")
        .arg("-I")
        .arg(&deb)
        .arg("conffiles"));
    assert_eq!(
        conffiles.trim(),
        "/etc/lb/lb.toml",
        "the example config is a conffile"
    );

    // The unit runs the packaged binary and points at documentation the package ships.
    let unit = std::fs::read_to_string(root.join("usr/lib/systemd/system/lb.service")).unwrap();
    assert!(
        unit.contains("ExecStart=/usr/bin/lb run --config /etc/lb/lb.toml"),
        "{unit}"
    );
    let docs = unit
        .lines()
        .find_map(|l| l.strip_prefix("Documentation="))
        .expect("a Documentation= line");
    for doc in docs.split_whitespace() {
        let shipped = match doc.strip_prefix("man:") {
            Some(page) => {
                let (name, section) = page.trim_end_matches(')').split_once('(').unwrap();
                format!("usr/share/man/man{section}/{name}.{section}.gz")
            }
            None => doc
                .strip_prefix("file:///")
                .expect("man: or file:")
                .to_string(),
        };
        assert!(
            root.join(&shipped).is_file(),
            "{doc}: no {shipped} in the package"
        );
    }
    for path in [
        "usr/share/man/man8/lb.8.gz",
        "usr/share/man/man5/lb.toml.5.gz",
        "usr/share/doc/lb/docs/SUMMARY.md",
        "usr/share/doc/lb/docs/configuration.md",
        "usr/share/doc/lb/docs/operations/health.md",
        "usr/share/man/man1/lb-run.1.gz",
        "usr/share/man/man1/lb-backend-add.1.gz",
        "usr/share/bash-completion/completions/lb",
        "usr/share/zsh/vendor-completions/_lb",
        "usr/share/fish/vendor_completions.d/lb.fish",
        "usr/share/doc/lb/grafana-dashboard.json",
    ] {
        assert!(root.join(path).is_file(), "no {path} in the package");
    }
    let page = run(Command::new("zcat").arg(root.join("usr/share/man/man1/lb.1.gz")));
    assert!(
        page.contains(".SH SUBCOMMANDS") && page.contains("lb\\-status(1)"),
        "{page}"
    );
    let bash =
        std::fs::read_to_string(Path::new(root).join("usr/share/bash-completion/completions/lb"))
            .unwrap();
    assert!(
        bash.contains("complete -F _lb"),
        "bash completions:\n{bash}"
    );
}

/// The package's control data: a maintainer who can be written to, a changelog, and
/// maintainer scripts that tell systemd, stop the service on removal and take the data
/// path off on purge.
#[test]
fn the_package_has_a_maintainer_a_changelog_and_maintainer_scripts() {
    let test = "the_package_has_a_maintainer_a_changelog_and_maintainer_scripts";
    let Some((deb, root)) = unpacked(test) else {
        return;
    };
    let field = |name: &str| {
        run(Command::new("dpkg-deb").arg("-f").arg(&deb).arg(name))
            .trim()
            .to_string()
    };
    let maintainer = field("Maintainer");
    let (name, mail) = maintainer
        .strip_suffix('>')
        .and_then(|m| m.split_once(" <"))
        .unwrap_or_else(|| panic!("Maintainer is not `Name <address>`: {maintainer}"));
    assert!(
        !name.trim().is_empty() && mail.contains('@') && !mail.ends_with("@localhost"),
        "Maintainer: {maintainer}"
    );

    let root = root.path();
    let changelog =
        run(Command::new("zcat").arg(root.join("usr/share/doc/lb/changelog.Debian.gz")));
    let version = field("Version");
    assert!(
        changelog.starts_with(&format!("lb ({version})")),
        "the changelog's first entry is this version ({version}):\n{changelog}"
    );
    assert!(
        changelog.contains(&format!(" -- {maintainer}  ")),
        "{changelog}"
    );

    let control = tempfile::tempdir().unwrap();
    run(Command::new("dpkg-deb")
        .arg("-e")
        .arg(&deb)
        .arg(control.path()));
    let script = |name: &str| {
        let path = control.path().join(name);
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("no {name} maintainer script: {e}"));
        let mode = std::os::unix::fs::PermissionsExt::mode(&path.metadata().unwrap().permissions());
        assert_eq!(mode & 0o755, 0o755, "{name} is executable");
        run(Command::new("sh").arg("-n").arg(&path));
        // What runs: the lines that are not comments.
        text.lines()
            .map(str::trim)
            .filter(|l| !l.starts_with('#'))
            .collect::<Vec<_>>()
            .join("\n")
    };
    let postinst = script("postinst");
    assert!(postinst.contains("systemctl daemon-reload"), "{postinst}");
    postinst_creates_the_group_once(&control.path().join("postinst"));
    let prerm = script("prerm");
    assert!(
        prerm.contains(r#""$1" = "remove""#) && prerm.contains("systemctl stop lb.service"),
        "{prerm}"
    );
    let postrm = script("postrm");
    assert!(postrm.contains("systemctl daemon-reload"), "{postrm}");
    let purge = postrm
        .split("purge)")
        .nth(1)
        .expect("a purge branch in postrm");
    assert!(
        purge.contains("/sys/fs/bpf/lb ") && purge.contains("rm -rf \"$pins\""),
        "purge removes the default pins:\n{postrm}"
    );
    // The group stays on purge: files (a state file, a log) may still name it.
    assert!(!postrm.contains("groupdel"), "{postrm}");
    assert!(
        field("Depends").split(", ").any(|d| d == "passwd"),
        "groupadd's package is a dependency"
    );
}

/// postinst `configure` creates the system group `lb` when the host has none and leaves
/// it alone when it has one (run twice, as an upgrade does): `getent` and `groupadd` are
/// stand-ins on PATH that record their calls.
fn postinst_creates_the_group_once(postinst: &Path) {
    let bin = tempfile::tempdir().unwrap();
    let calls = bin.path().join("calls");
    let has_group = bin.path().join("has-group");
    let stand_in = |name: &str, body: &str| {
        let path = bin.path().join(name);
        std::fs::write(
            &path,
            format!(
                "#!/bin/sh\necho \"{name} $*\" >> {}\n{body}\n",
                calls.display()
            ),
        )
        .unwrap();
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
    };
    stand_in("getent", &format!("[ -e {} ]", has_group.display()));
    stand_in("groupadd", &format!("touch {}", has_group.display()));
    // Where this host runs systemd, the script's systemctl calls reach a stand-in too.
    let systemctl = bin.path().join("systemctl");
    std::fs::write(&systemctl, "#!/bin/sh\nexit 0\n").unwrap();
    std::fs::set_permissions(
        &systemctl,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let path = format!("{}:/usr/bin:/bin", bin.path().display());
    let configure = |previous: &str| {
        run(Command::new("sh")
            .arg(postinst)
            .args(["configure", previous])
            .env("PATH", &path));
        std::fs::read_to_string(&calls).unwrap_or_default()
    };
    assert_eq!(configure(""), "getent group lb\ngroupadd --system lb\n");
    assert_eq!(
        configure("0.1.0-1"),
        "getent group lb\ngroupadd --system lb\ngetent group lb\n",
        "a second configure (an upgrade) finds the group and creates none"
    );
}

/// The man pages say more than `--help`: lb(8) has the files, exit codes and examples,
/// lb.toml(5) every section of the configuration reference; groff finds nothing wrong.
#[test]
fn the_man_pages_document_the_service_and_the_file() {
    let test = "the_man_pages_document_the_service_and_the_file";
    let Some((_, root)) = unpacked(test) else {
        return;
    };
    let root = root.path();
    let page = |path: &str| run(Command::new("zcat").arg(root.join(path)));
    let lb8 = page("usr/share/man/man8/lb.8.gz");
    for section in [
        ".SH DESCRIPTION",
        ".SH FILES",
        ".SH EXIT STATUS",
        ".SH EXAMPLES",
    ] {
        assert!(lb8.contains(section), "lb(8) lacks {section}");
    }
    let lb_toml5 = page("usr/share/man/man5/lb.toml.5.gz");
    for text in [
        ".SH DESCRIPTION",
        ".SH OPTIONAL SECTIONS",
        "maglev_table_size",
        "key_file",
        "expect_status",
    ] {
        assert!(
            lb_toml5.contains(text),
            "lb.toml(5) lacks {text}:\n{lb_toml5}"
        );
    }
    if Command::new("groff").arg("--version").output().is_err() {
        return skip(test, "groff is not installed: the pages were not rendered");
    }
    for (name, text) in [("lb.8", &lb8), ("lb.toml.5", &lb_toml5)] {
        let source = root.join(name);
        std::fs::write(&source, text).unwrap();
        let warnings = run(Command::new("groff")
            .args(["-man", "-ww", "-z"])
            .arg(&source));
        assert!(
            warnings.trim().is_empty(),
            "{name}: groff says:\n{warnings}"
        );
    }
}

/// The unit passes `systemd-analyze verify` in the package's root and is bounded: the
/// capabilities the agent uses and no others, a read-only file system but for its own
/// directories, no new privileges. (A real systemd cannot start it here: PID 1 of these
/// machines is not systemd.)
#[test]
fn the_unit_verifies_and_is_hardened() {
    let test = "the_unit_verifies_and_is_hardened";
    let Some((_, root)) = unpacked(test) else {
        return;
    };
    let unit_dir = Path::new("/usr/lib/systemd/system");
    if Command::new("systemd-analyze")
        .arg("--version")
        .output()
        .is_err()
        || !unit_dir.join("sysinit.target").exists()
    {
        return skip(
            test,
            "systemd-analyze or systemd's units are missing (the bootstrap installs systemd)",
        );
    }
    let root = root.path();
    // The root needs systemd's own units (the targets lb.service orders against) and
    // the ExecReload= command.
    for entry in std::fs::read_dir(unit_dir).unwrap().flatten() {
        let to = root.join("usr/lib/systemd/system").join(entry.file_name());
        if !to.exists() && entry.path().is_file() {
            std::fs::copy(entry.path(), to).unwrap();
        }
    }
    std::fs::create_dir_all(root.join("bin")).unwrap();
    std::fs::copy("/bin/kill", root.join("bin/kill")).unwrap();
    // Man pages are checked by the test above (the host's `man` does not see this root).
    let said = run(Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .arg(format!("--root={}", root.display()))
        .arg("lb.service"));
    assert!(
        said.trim().is_empty(),
        "systemd-analyze verify lb.service says:\n{said}"
    );

    let unit = std::fs::read_to_string(root.join("usr/lib/systemd/system/lb.service")).unwrap();
    let value = |key: &str| {
        unit.lines()
            .find_map(|l| l.strip_prefix(&format!("{key}=")))
            .unwrap_or_else(|| panic!("lb.service has no {key}="))
            .to_string()
    };
    let wanted = "CAP_BPF CAP_NET_ADMIN CAP_NET_RAW CAP_PERFMON CAP_SYS_ADMIN";
    for key in ["CapabilityBoundingSet", "AmbientCapabilities"] {
        let mut caps: Vec<String> = value(key).split_whitespace().map(String::from).collect();
        caps.sort();
        assert_eq!(caps.join(" "), wanted, "{key}");
    }
    assert_eq!(value("NoNewPrivileges"), "yes");
    // The operators' socket's group, which the agent (no CAP_CHOWN) may give its file to.
    assert_eq!(value("SupplementaryGroups"), "lb");
    assert_eq!(value("ProtectSystem"), "strict");
    assert_eq!(value("ProtectHome"), "yes");
    let writable = value("ReadWritePaths");
    for path in ["/run/lb", "/sys/fs/bpf"] {
        assert!(
            writable.split_whitespace().any(|p| p == path),
            "ReadWritePaths={writable}"
        );
    }
    // And systemd reads them so: the exposure it computes is far below a bare unit's 9.6.
    let security = run(Command::new("systemd-analyze")
        .args(["security", "--offline=yes"])
        .arg(format!("--root={}", root.display()))
        .arg("lb.service"));
    let exposure: f64 = security
        .lines()
        .find_map(|l| l.split("Overall exposure level for lb.service: ").nth(1))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no exposure level in:\n{security}"));
    println!("systemd-analyze security: exposure {exposure}");
    assert!(exposure < 5.0, "exposure {exposure}:\n{security}");
}

/// The package's XDP_PASS object loads with iproute2 (libbpf), not only with aya: in a
/// namespace of this test, on a veth, in native mode.
#[test]
fn the_peer_object_loads_with_iproute2() {
    let test = "the_peer_object_loads_with_iproute2";
    let Some((_, root)) = unpacked(test) else {
        return;
    };
    if !nix::unistd::geteuid().is_root() {
        return skip(test, "needs root (a network namespace, XDP)");
    }
    let object = root.path().join("usr/lib/lb/xdp-pass.o");
    assert!(object.is_file(), "no /usr/lib/lb/xdp-pass.o in the package");
    let ns = lb_tests::Netns::new("peer-obj").expect("a namespace");
    let ip = |args: &[&str]| {
        ns.exec("ip", args)
            .unwrap_or_else(|e| panic!("ip {args:?}: {e:#}"))
    };
    ip(&[
        "link", "add", "name", "va", "type", "veth", "peer", "name", "vb",
    ]);
    ip(&["link", "set", "va", "up"]);
    ip(&["link", "set", "vb", "up"]);
    ip(&[
        "link",
        "set",
        "dev",
        "va",
        "xdpdrv",
        "obj",
        object.to_str().unwrap(),
        "sec",
        "xdp.frags",
    ]);
    let shown = ip(&["-d", "link", "show", "va"]);
    assert!(
        shown.contains("prog/xdp") && shown.contains("name xdp_pass"),
        "not attached:\n{shown}"
    );
}
