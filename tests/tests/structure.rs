//! `lb check` and `lb run` make the same checks of a configuration against the host
//! (issue 34; issue 41 items 1 and 8): an address of the balancer's own interface as a
//! backend or as a VIP, and a cluster key others may read, are refused by both, with
//! exit 2 and the field named, before anything is attached. Needs root (a namespace with
//! an interface of its own) and a built `lb`.
//! `cargo xtask test -- structure`.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use lb_tests::{find_lb_bin, netns::Netns, skip};

/// A file whose interface `veth-lb` (10.98.0.2/24) is the namespace's own (default pin
/// path: every case is refused before a pin is touched, which the test checks).
fn config(dir: &Path, vip: &str, backend: &str, extra: &str) -> std::path::PathBuf {
    let path = dir.join(format!("{vip}-{backend}-{}.toml", extra.len()));
    let text = format!(
        "[dataplane]\ninterface = \"veth-lb\"\nxdp_mode = \"generic\"\n\
         [control]\nsocket = \"{}\"\nmetrics = \"off\"\n{extra}\n\
         [[vip]]\nname = \"web\"\naddress = \"{vip}\"\nport = 8080\nprotocol = \"tcp\"\n\
         [vip.health]\nkind = \"none\"\n\
         [[vip.backend]]\naddress = \"{backend}\"\nmac = \"02:00:00:00:00:0b\"\n",
        dir.join("lb.sock").display(),
    );
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn check_and_run_refuse_the_balancers_own_address_and_an_open_cluster_key() {
    let test = "check_and_run_refuse_the_balancers_own_address_and_an_open_cluster_key";
    if !nix::unistd::geteuid().is_root() {
        return skip(test, "needs root (a network namespace)");
    }
    let bin = match find_lb_bin() {
        Ok(bin) => bin,
        Err(why) => return skip(test, &why),
    };
    let ns = Netns::new("check").unwrap();
    let ip = |args: &[&str]| {
        let mut all = vec!["-n", ns.name()];
        all.extend_from_slice(args);
        lb_tests::netns::ip(&all).unwrap();
    };
    ip(&[
        "link",
        "add",
        "veth-lb",
        "type",
        "veth",
        "peer",
        "name",
        "veth-peer",
    ]);
    ip(&["addr", "add", "10.98.0.2/24", "dev", "veth-lb"]);
    ip(&["link", "set", "veth-lb", "up"]);
    ip(&["link", "set", "veth-peer", "up"]);
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("cluster.key");
    std::fs::write(&key, "a cluster key of thirty-two bytes!").unwrap();
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
    let open_key = format!(
        "[cluster]\npeers = [\"10.98.0.3\"]\nkey_file = \"{}\"\n",
        key.display()
    );
    let cases = [
        (
            "a backend at the interface's address",
            config(dir.path(), "10.98.0.100", "10.98.0.2", ""),
            "vip[0].backend[0].address",
        ),
        (
            "a VIP at the interface's address",
            config(dir.path(), "10.98.0.2", "10.98.0.11", ""),
            "vip[0].address",
        ),
        (
            "a cluster key others may read",
            config(dir.path(), "10.98.0.100", "10.98.0.11", &open_key),
            "cluster.key_file",
        ),
    ];
    for (what, path, field) in &cases {
        for command in ["check", "run"] {
            let out = std::process::Command::new("ip")
                .args(["netns", "exec", ns.name()])
                .arg(&bin)
                .args([command, "--config"])
                .arg(path)
                .output()
                .unwrap();
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_eq!(
                out.status.code(),
                Some(2),
                "lb {command}, {what}: want exit 2; stderr:\n{stderr}"
            );
            assert!(
                stderr.contains(&format!("`{field}`")),
                "lb {command}, {what}: the field {field} is not named:\n{stderr}"
            );
        }
        let link = lb_tests::netns::ip(&["-n", ns.name(), "link", "show", "veth-lb"]).unwrap();
        assert!(!link.contains("xdp"), "{what}: lb run attached: {link}");
    }
    // And a good file passes both ways (`lb check` here; `lb run` is every other test's).
    let good = config(dir.path(), "10.98.0.100", "10.98.0.11", "");
    let out = std::process::Command::new("ip")
        .args(["netns", "exec", ns.name()])
        .arg(&bin)
        .args(["check", "--config"])
        .arg(&good)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
