//! The checks of a configuration against this host that do not need the data path:
//! `lb run` makes them before it touches a pin, and `lb check` (the unit's
//! `ExecStartPre`, a reviewer's check) makes the very same ones, so the two never
//! disagree. One exception, said where it happens: `lb check` shows a failing route
//! check as a warning (the routes of the host it runs on need not be the serving
//! host's: a file checked on a build host), where `lb run` refuses. Reloads and runtime
//! changes make the interface's part again (`interface_checks`).
//!
//! Owns nothing; calls `config` (the checks themselves), `neighbor` (routes), `model`
//! (the ids the data path has room for), `cluster` (its key and address rules) and
//! `dataplane::next` (the pinned program `next_program` names).
//! `lb run` also runs `lb doctor`'s host checks (privileges, bpffs, a foreign XDP
//! program); those are `lb doctor`'s to show, not `lb check`'s.

use crate::{
    cluster,
    config::{Config, ConfigError},
    dataplane::{
        next::{self, NextProgram},
        vip_capacity,
    },
    model::Model,
    neighbor::{self, Interface, RouteLookup},
};

/// One check, in the order they run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Check {
    /// The VIPs and backends fit the ids the data path is sized for at start.
    Capacity,
    /// No VIP and no backend is an address of the data-path interface itself; every
    /// tunnelled backend has an outer source address.
    InterfaceAddresses,
    /// Every `l2` backend without a configured MAC is on-link on the interface.
    Routes,
    /// `[cluster]`: the key file is root's (or the agent user's), not readable by
    /// others, and long enough.
    ClusterKey,
    /// `[cluster]`: an address of the peers' family to bind.
    ClusterAddress,
    /// `dataplane.next_program`: a pinned XDP program that lb's program can tail-call.
    NextProgram,
    /// https checks: every `ca_file` is readable and holds PEM certificates.
    CaFiles,
    /// `control.operators_group` is a group of this host.
    OperatorsGroup,
}

impl Check {
    pub const ALL: [Check; 8] = [
        Check::Capacity,
        Check::InterfaceAddresses,
        Check::Routes,
        Check::ClusterKey,
        Check::ClusterAddress,
        Check::NextProgram,
        Check::CaFiles,
        Check::OperatorsGroup,
    ];

    /// Its name in `lb check`'s output.
    pub fn name(self) -> &'static str {
        match self {
            Check::Capacity => "capacity",
            Check::InterfaceAddresses => "interface addresses",
            Check::Routes => "routes",
            Check::ClusterKey => "cluster key",
            Check::ClusterAddress => "cluster address",
            Check::NextProgram => "next program",
            Check::CaFiles => "ca files",
            Check::OperatorsGroup => "operators group",
        }
    }

    /// Whether it needs the interface (its addresses or index).
    fn needs_interface(self) -> bool {
        matches!(
            self,
            Check::InterfaceAddresses | Check::Routes | Check::ClusterAddress
        )
    }

    /// Whether it applies to `config` at all.
    fn applies(self, config: &Config) -> bool {
        match self {
            Check::ClusterKey | Check::ClusterAddress => config.cluster.is_some(),
            Check::NextProgram => config.dataplane.next_program.is_some(),
            Check::CaFiles => !ca_files(config).is_empty(),
            Check::OperatorsGroup => config.control.operators_group.is_some(),
            _ => true,
        }
    }
}

/// Who runs the checks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// `lb run`: every failing check refuses the start.
    Start,
    /// `lb check`: a failing route check is a warning (`Outcome::Warned`).
    Check,
}

/// What became of one check.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    Passed,
    /// Failed where it does not refuse (`Mode::Check`): the error `lb run` gives here.
    Warned(String),
    /// The configuration has nothing it checks (no `[cluster]`).
    NotConfigured,
    /// It needs the data-path interface, which this host does not have.
    NoInterface,
}

/// Runs every check of `config` on this host; `interface` is the data-path interface as
/// the kernel shows it (None: there is none here, and the checks that need it are
/// skipped; `lb run` cannot start then). The first failing check's error names the field.
pub fn run(
    config: &Config,
    interface: Option<&Interface>,
    route_of: RouteLookup,
    mode: Mode,
) -> Result<Vec<(Check, Outcome)>, ConfigError> {
    let mut outcomes = Vec::new();
    for check in Check::ALL {
        let outcome = if !check.applies(config) {
            Outcome::NotConfigured
        } else {
            match (check.needs_interface(), interface) {
                (true, None) => Outcome::NoInterface,
                (_, interface) => match run_one(check, config, interface, route_of) {
                    Ok(()) => Outcome::Passed,
                    Err(error) if mode == Mode::Check && check == Check::Routes => {
                        Outcome::Warned(error.to_string())
                    }
                    Err(error) => return Err(error),
                },
            }
        };
        outcomes.push((check, outcome));
    }
    Ok(outcomes)
}

fn run_one(
    check: Check,
    config: &Config,
    interface: Option<&Interface>,
    route_of: RouteLookup,
) -> Result<(), ConfigError> {
    let invalid = |field: &str, reason: String| ConfigError::Invalid {
        field: field.into(),
        reason,
    };
    match (check, interface, &config.cluster) {
        (Check::Capacity, _, _) => Model::new(
            config.dataplane.maglev_table_size,
            vip_capacity(config.vips.len()),
            config.dataplane.flow_idle_timeout,
        )
        .with_backend_capacity(config.dataplane.max_backends)
        .update(config)
        .map_err(|error| invalid("vip", error.to_string())),
        (Check::InterfaceAddresses, Some(interface), _) => {
            config.validate_host(&interface.addresses)
        }
        (Check::Routes, Some(interface), _) => {
            let ifindexes = neighbor::interface_indexes(&config.dataplane.interfaces, interface);
            config.validate_routes(|a| neighbor::on_link_any(route_of, &ifindexes, a))
        }
        (Check::ClusterKey, _, Some(cluster)) => cluster::read_key(&cluster.key_file)
            .map(drop)
            .map_err(|error| invalid("cluster.key_file", key_reason(error))),
        (Check::ClusterAddress, Some(interface), Some(cluster)) => {
            cluster::bind_address(cluster, &interface.name, &interface.addresses)
                .map(drop)
                .map_err(|error| invalid("cluster.address", error.to_string()))
        }
        (Check::NextProgram, _, _) => next_program(config).map(drop),
        (Check::CaFiles, _, _) => {
            for (field, path) in ca_files(config) {
                crate::health::tls::read_ca_file(path)
                    .map_err(|why| invalid(&field, format!("{}: {why}", path.display())))?;
            }
            Ok(())
        }
        (Check::OperatorsGroup, _, _) => match &config.control.operators_group {
            Some(group) => group_id(group)
                .map(drop)
                .map_err(|why| invalid("control.operators_group", why.to_string())),
            None => Ok(()),
        },
        // Not applicable, or skipped by `run`.
        _ => Ok(()),
    }
}

/// `dataplane.next_program`, opened (None when not configured); a pin that is missing,
/// not a program, not XDP or not one lb can tail-call is refused naming the field. `lb
/// run` loads the build of its program that can call it; a reload re-opens it, so a
/// program pinned anew at the same path is taken up.
pub fn next_program(config: &Config) -> Result<Option<NextProgram>, ConfigError> {
    let Some(path) = &config.dataplane.next_program else {
        return Ok(None);
    };
    next::open(path)
        .map(Some)
        .map_err(|error| ConfigError::Invalid {
            field: NEXT_PROGRAM_FIELD.into(),
            reason: error.to_string(),
        })
}

/// The field `next_program` refusals name.
pub const NEXT_PROGRAM_FIELD: &str = "dataplane.next_program";
/// Why a group has no id on this host.
#[derive(Debug, thiserror::Error)]
pub enum GroupError {
    #[error("no group {name:?} on this host (create it: groupadd --system {name})")]
    Missing { name: String },
    #[error("looking up group {name:?}: {errno}")]
    Lookup {
        name: String,
        errno: nix::errno::Errno,
    },
}

/// The id of group `name` on this host.
pub fn group_id(name: &str) -> Result<u32, GroupError> {
    match nix::unistd::Group::from_name(name) {
        Ok(Some(group)) => Ok(group.gid.as_raw()),
        Ok(None) => Err(GroupError::Missing { name: name.into() }),
        Err(errno) => Err(GroupError::Lookup {
            name: name.into(),
            errno,
        }),
    }
}

/// Every `ca_file` an https check reads, with its field.
fn ca_files(config: &Config) -> Vec<(String, &std::path::Path)> {
    let mut files = Vec::new();
    for (i, vip) in config.vips.iter().enumerate() {
        files.extend(
            vip.health
                .ca_file_to_read()
                .map(|path| (format!("vip[{i}].health.ca_file"), path)),
        );
        for (j, backend) in vip.backends.iter().enumerate() {
            let own = backend.health.as_ref().and_then(|h| h.ca_file_to_read());
            files.extend(own.map(|path| (format!("vip[{i}].backend[{j}].health.ca_file"), path)));
        }
    }
    files
}

/// A key error as the field's reason: the path and why.
fn key_reason(error: cluster::ClusterError) -> String {
    match error {
        cluster::ClusterError::Key { path, why } => format!("{path}: {why}"),
        other => other.to_string(),
    }
}

/// The checks against the interface, and the CA files' contents: made again at every
/// reload and runtime change, where the interface is known.
pub fn interface_checks(
    config: &Config,
    interface: &Interface,
    route_of: RouteLookup,
) -> Result<(), ConfigError> {
    for check in [Check::InterfaceAddresses, Check::Routes, Check::CaFiles] {
        run_one(check, config, Some(interface), route_of)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        config::MacAddr,
        neighbor::{NeighborError, Route},
    };
    use std::net::IpAddr;
    use std::os::unix::fs::PermissionsExt;

    fn on_link(destination: IpAddr) -> Result<Route, NeighborError> {
        Ok(Route {
            destination,
            oif: Some(1),
            gateway: None,
            unicast: true,
        })
    }

    fn eth0() -> Interface {
        Interface {
            name: "eth0".into(),
            index: 1,
            mac: MacAddr([2, 0, 0, 0, 0, 1]),
            addresses: vec!["10.0.0.2".parse().unwrap()],
            mtu: 1500,
        }
    }

    fn config(extra: &str, vip: &str, backend: &str) -> Config {
        Config::from_toml(&format!(
            "[dataplane]\ninterface = \"eth0\"\n{extra}\n[[vip]]\nname = \"web\"\n\
             address = \"{vip}\"\nport = 80\nprotocol = \"tcp\"\n[[vip.backend]]\n\
             address = \"{backend}\"\n"
        ))
        .unwrap()
    }

    fn key_file(dir: &std::path::Path, mode: u32) -> std::path::PathBuf {
        let path = dir.join(format!("key-{mode:o}"));
        std::fs::write(&path, "a cluster key of thirty-two bytes!").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        path
    }

    fn refused_field(result: Result<Vec<(Check, Outcome)>, ConfigError>) -> String {
        match result {
            Err(ConfigError::Invalid { field, .. }) => field,
            other => panic!("not refused with a field: {other:?}"),
        }
    }

    /// The list `lb run` and `lb check` share: what each check refuses, by its field.
    #[test]
    fn the_shared_checks_and_what_each_refuses() {
        let names: Vec<&str> = Check::ALL.iter().map(|c| c.name()).collect();
        assert_eq!(
            names,
            [
                "capacity",
                "interface addresses",
                "routes",
                "cluster key",
                "cluster address",
                "next program",
                "ca files",
                "operators group"
            ]
        );
        let here = eth0();
        let good = config("", "10.0.0.100", "10.0.0.11");
        let outcomes = run(&good, Some(&here), on_link, Mode::Start).unwrap();
        assert!(
            outcomes[..3].iter().all(|(_, o)| *o == Outcome::Passed),
            "{outcomes:?}"
        );
        assert_eq!(outcomes[3].1, Outcome::NotConfigured, "no [cluster]");

        // A backend at the interface's own address (issue 34).
        let backend_here = config("", "10.0.0.100", "10.0.0.2");
        assert_eq!(
            refused_field(run(&backend_here, Some(&here), on_link, Mode::Check)),
            "vip[0].backend[0].address"
        );
        // A VIP at the interface's own address (issue 41, item 1).
        let vip_here = config("", "10.0.0.2", "10.0.0.11");
        let error = run(&vip_here, Some(&here), on_link, Mode::Check).unwrap_err();
        assert!(
            matches!(&error, ConfigError::Invalid { field, reason }
                if field == "vip[0].address" && reason.contains("this balancer")),
            "{error}"
        );
        // An l2 backend behind a router.
        let routed = |d: IpAddr| {
            Ok(Route {
                destination: d,
                oif: Some(1),
                gateway: Some("10.0.0.1".parse().unwrap()),
                unicast: true,
            })
        };
        assert_eq!(
            refused_field(run(&good, Some(&here), routed, Mode::Start)),
            "vip[0].backend[0].address"
        );
        // `lb check` says so, as a warning.
        let checked = run(&good, Some(&here), routed, Mode::Check).unwrap();
        assert!(
            matches!(&checked[2], (Check::Routes, Outcome::Warned(why))
                if why.contains("is not on-link on eth0")),
            "{checked:?}"
        );

        // A cluster key others may read (issue 41, item 8); a private one passes.
        let dir = tempfile_dir();
        let cluster = |key: &std::path::Path| {
            config(
                &format!(
                    "[cluster]\npeers = [\"10.0.0.3\"]\nkey_file = \"{}\"",
                    key.display()
                ),
                "10.0.0.100",
                "10.0.0.11",
            )
        };
        let open = cluster(&key_file(&dir, 0o644));
        let error = run(&open, Some(&here), on_link, Mode::Check).unwrap_err();
        assert!(
            matches!(&error, ConfigError::Invalid { field, reason }
                if field == "cluster.key_file" && reason.contains("others may read")),
            "{error}"
        );
        let private = cluster(&key_file(&dir, 0o600));
        let outcomes = run(&private, Some(&here), on_link, Mode::Start).unwrap();
        assert!(
            outcomes[..5].iter().all(|(_, o)| *o == Outcome::Passed),
            "{outcomes:?}"
        );
        assert_eq!(outcomes[5], (Check::NextProgram, Outcome::NotConfigured));
        assert_eq!(outcomes[6], (Check::CaFiles, Outcome::NotConfigured));
        assert_eq!(outcomes[7], (Check::OperatorsGroup, Outcome::NotConfigured));
        // An operators' group this host does not have.
        let mut no_group = good.clone();
        no_group.control.operators_group = Some("lb-no-such-group".into());
        let error = run(&no_group, Some(&here), on_link, Mode::Check).unwrap_err();
        assert!(
            matches!(&error, ConfigError::Invalid { field, reason }
                if field == "control.operators_group" && reason.contains("groupadd")),
            "{error}"
        );
        let mut root_group = good.clone();
        root_group.control.operators_group = Some("root".into());
        let outcomes = run(&root_group, Some(&here), on_link, Mode::Check).unwrap();
        assert_eq!(outcomes[7], (Check::OperatorsGroup, Outcome::Passed));
        // No address of the peers' family to bind.
        let v6_peer = private.clone();
        let mut v6_peer = v6_peer;
        v6_peer.cluster.as_mut().unwrap().peers = vec!["fd00::3".parse().unwrap()];
        assert_eq!(
            refused_field(run(&v6_peer, Some(&here), on_link, Mode::Check)),
            "cluster.address"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A `next_program` pin that is not there (issue 37) is refused naming the field,
    /// by `lb check` and `lb run` alike (the real program kinds: tests/tests/neighbour.rs).
    #[test]
    fn a_missing_next_program_is_refused_naming_the_field() {
        let missing = config(
            "next_program = \"/sys/fs/bpf/lb-preflight-no-such-program\"",
            "10.0.0.100",
            "10.0.0.11",
        );
        for mode in [Mode::Check, Mode::Start] {
            let error = run(&missing, Some(&eth0()), on_link, mode).unwrap_err();
            assert!(
                matches!(&error, ConfigError::Invalid { field, reason }
                    if field == "dataplane.next_program"
                        && reason.contains("lb-preflight-no-such-program")),
                "{error}"
            );
        }
        let good = config("", "10.0.0.100", "10.0.0.11");
        let outcomes = run(&good, Some(&eth0()), on_link, Mode::Check).unwrap();
        assert_eq!(outcomes[5], (Check::NextProgram, Outcome::NotConfigured));
    }

    /// Without the interface here, the checks that need it are skipped, said so; the
    /// others still run.
    #[test]
    fn without_the_interface_its_checks_are_skipped_and_the_others_run() {
        let dir = tempfile_dir();
        let open = config(
            &format!(
                "[cluster]\npeers = [\"10.0.0.3\"]\nkey_file = \"{}\"",
                key_file(&dir, 0o644).display()
            ),
            "10.0.0.100",
            "10.0.0.2",
        );
        assert_eq!(
            refused_field(run(&open, None, on_link, Mode::Check)),
            "cluster.key_file"
        );
        let good = config("", "10.0.0.100", "10.0.0.2");
        let outcomes = run(&good, None, on_link, Mode::Check).unwrap();
        assert_eq!(outcomes[0], (Check::Capacity, Outcome::Passed));
        assert_eq!(
            outcomes[1],
            (Check::InterfaceAddresses, Outcome::NoInterface)
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// An https check's `ca_file` (issue 35): missing, unreadable or not PEM is refused
    /// by `lb check` and `lb run` alike, and at a reload, naming the field.
    #[test]
    fn ca_files_are_read_and_refused_by_their_field() {
        let dir = tempfile_dir();
        let https = |ca_file: &std::path::Path| {
            Config::from_toml(&format!(
                "[dataplane]\ninterface = \"eth0\"\n[[vip]]\nname = \"web\"\n\
                 address = \"10.0.0.100\"\nport = 443\nprotocol = \"tcp\"\n[vip.health]\n\
                 kind = \"https\"\n[[vip.backend]]\naddress = \"10.0.0.11\"\n\
                 [[vip.backend]]\naddress = \"10.0.0.12\"\n[vip.backend.health]\n\
                 kind = \"https\"\nsni = \"backend.test\"\nca_file = \"{}\"\n",
                ca_file.display()
            ))
            .unwrap()
        };
        let good = concat!(env!("CARGO_MANIFEST_DIR"), "/src/health/testdata/ca.pem");
        let outcomes = run(&https(good.as_ref()), Some(&eth0()), on_link, Mode::Check).unwrap();
        assert_eq!(outcomes[6], (Check::CaFiles, Outcome::Passed));
        let here = eth0();
        interface_checks(&https(good.as_ref()), &here, on_link).unwrap();

        let not_pem = dir.join("not-pem");
        std::fs::write(&not_pem, "just text\n").unwrap();
        let broken = dir.join("broken-pem");
        std::fs::write(
            &broken,
            "-----BEGIN CERTIFICATE-----\nnot base64!\n-----END CERTIFICATE-----\n",
        )
        .unwrap();
        for (path, why) in [
            (dir.join("missing"), "No such file"),
            (not_pem, "no PEM certificate"),
            (broken, "not a PEM file"),
            (dir.clone(), "Is a directory"),
        ] {
            let config = https(&path);
            for error in [
                run(&config, Some(&here), on_link, Mode::Check).unwrap_err(),
                interface_checks(&config, &here, on_link).unwrap_err(),
            ] {
                assert!(
                    matches!(&error, ConfigError::Invalid { field, reason }
                        if field == "vip[0].backend[1].health.ca_file"
                            && reason.contains(why)
                            && reason.contains(&path.display().to_string())),
                    "{}: {error}",
                    path.display()
                );
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn tempfile_dir() -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "lb-preflight-{}-{}",
            std::process::id(),
            fastrand::u64(..)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }
}
