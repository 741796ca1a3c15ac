//! The Debian package (`cargo xtask dist`), installed into a scratch root with `dpkg -x`:
//! the binary runs from there, its example configuration passes `lb check`, and the
//! systemd unit, man pages and completions are where the unit and the README say.
//! `cargo xtask test` builds the package from the debug profile (a release build would
//! double the tests' build time) and passes its path in `LB_DEB`. No root needed.

use std::path::Path;
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

#[test]
fn the_package_installs_and_runs_from_a_clean_root() {
    let test = "the_package_installs_and_runs_from_a_clean_root";
    let Some(deb) = std::env::var_os("LB_DEB") else {
        return skip(
            test,
            "LB_DEB is not set (`cargo xtask test` builds the package)",
        );
    };
    if !lb_tests::host::require_tool(test, lb_tests::host::ZCAT) {
        return;
    }
    let root = tempfile::tempdir().unwrap();
    let root = root.path();
    run(Command::new("dpkg").arg("-x").arg(&deb).arg(root));

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
