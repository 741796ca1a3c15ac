//! Issue 37, sharing the host with other XDP programs, with the real tools (xdp-tools):
//! - xdp-filter's program as `dataplane.next_program`: it drops one blocked source's
//!   traffic to the balancer host's own address while VIP traffic, from that source too,
//!   is balanced and other sources reach the host; xdp-filter loaded anew (a new program
//!   pinned at the same path) is taken up by `lb reload`; the chain holds with the agent
//!   stopped, across a restart (adopted) and in generic mode as in native;
//! - which build of lb's program can call a next program, asked of the kernel;
//! - a foreign program (xdp-filter) already on the interface: `lb doctor` and `lb run`
//!   refuse, naming it, its id and the fix, and it stays attached;
//! - a `next_program` pin that is missing, a map or not XDP: `lb check` refuses naming
//!   the field; `lb run` too, with nothing attached.
//!
//! Needs root, bpffs, the eBPF object, a built `lb` and xdp-tools (`cargo xtask
//! bootstrap` installs it); otherwise each test prints `SKIPPED`.
//! `cargo test -p lb-tests --test neighbour`.

use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use lb_tests::agent::{CliOutput, run_lb};
use lb_tests::lab::IFACE;
use lb_tests::router::{PIN_FS, PinDir};
use lb_tests::{
    Agent, Conn, Health, Lab, LabOptions, Netns, Protocol, TcpServer, XdpMode, require_e2e, skip,
    spread,
};

const TIMEOUT: Duration = Duration::from_secs(2);
/// A connection the firewall drops: given up after this long.
const DROPPED: Duration = Duration::from_millis(700);
/// The balancer host's own service, which the firewall guards.
const HOST_PORT: u16 = 7000;

/// xdp-filter keeps its state (maps, program pins) in one directory of the bpffs it
/// finds (`/run/lb-tests/bpf/xdp-filter` under `ip netns exec`): one test at a time.
static XDP_FILTER: Mutex<()> = Mutex::new(());

/// Root and the rest, and xdp-filter; `None` after saying why not.
fn require(test: &str) -> Option<PathBuf> {
    let bin = require_e2e(test)?;
    if which("xdp-filter").is_none() {
        skip(
            test,
            "xdp-filter (xdp-tools) is not installed: `cargo xtask bootstrap` installs it",
        );
        return None;
    }
    // Mounts the tests' bpffs, which the agents (under `ip netns exec`) see too.
    drop(PinDir::new("neighbour").expect("the tests' bpffs"));
    Some(bin)
}

fn which(program: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/sbin")])
        .map(|dir| dir.join(program))
        .find(|path| path.is_file())
}

/// xdp-filter (policy allow, IPv4) loaded on a veth of a namespace of its own, as a
/// host's firewall would be: its program pinned by xdp-filter itself. Unloaded (its
/// pins removed) and the namespace deleted on drop.
struct Firewall {
    ns: Netns,
    iface: String,
}

impl Firewall {
    fn load() -> Result<Firewall> {
        let ns = Netns::new("fw")?;
        let iface = format!("fw{}", std::process::id());
        ns.exec(
            "ip",
            &[
                "link", "add", &iface, "type", "veth", "peer", "name", "fwpeer",
            ],
        )?;
        ns.exec("ip", &["link", "set", &iface, "up"])?;
        let firewall = Firewall { ns, iface };
        firewall.load_filter()?;
        Ok(firewall)
    }

    /// xdp-filter in skb mode, allowing by default, filtering IPv4.
    fn load_filter(&self) -> Result<()> {
        self.xdp_filter(&[
            "load",
            "-m",
            "skb",
            "-p",
            "allow",
            "-f",
            "ipv4",
            &self.iface,
        ])
        .map(drop)
    }

    fn xdp_filter(&self, args: &[&str]) -> Result<String> {
        self.ns.exec("xdp-filter", args)
    }

    /// Where xdp-filter pinned its program.
    fn pin(&self) -> PathBuf {
        Path::new(PIN_FS)
            .join("xdp-filter/programs")
            .join(&self.iface)
            .join("xdpfilt_alw_ip")
    }

    fn block_source(&self, source: IpAddr) -> Result<()> {
        self.xdp_filter(&["ip", &source.to_string(), "-m", "src"])
            .map(drop)
    }

    /// Unloads and loads xdp-filter again: a new program, without rules, pinned at the
    /// same path.
    fn load_again(&self) -> Result<()> {
        self.xdp_filter(&["unload", &self.iface])?;
        self.load_filter()
    }

    /// The hit counter `xdp-filter status` shows for `address`.
    fn hits(&self, address: IpAddr) -> Result<u64> {
        let status = self.xdp_filter(&["status"])?;
        status
            .lines()
            .find(|l| l.split_whitespace().next() == Some(&address.to_string()))
            .and_then(|l| l.split_whitespace().last()?.parse().ok())
            .with_context(|| format!("no counter for {address}:\n{status}"))
    }
}

impl Drop for Firewall {
    fn drop(&mut self) {
        let _ = self.xdp_filter(&["unload", &self.iface]);
    }
}

/// The id of the program pinned at `path`, as bpftool shows it.
fn pinned_id(path: &Path) -> u32 {
    let out = std::process::Command::new("bpftool")
        .args(["-j", "prog", "show", "pinned"])
        .arg(path)
        .output()
        .expect("bpftool");
    let json: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("bpftool: {e}: {}", String::from_utf8_lossy(&out.stderr)));
    json["id"].as_u64().expect("an id") as u32
}

/// The lab's one-VIP configuration (TCP port 80) with `next_program = pin`, written to
/// the lab's directory.
fn write_config(lab: &Lab, mode: XdpMode, next_program: &Path) -> PathBuf {
    write_config_pinned(lab, mode, next_program, None)
}

/// `write_config`, with the pins in `pins` (on the tests' bpffs, which outlives the
/// agent: see `router::PinDir`).
fn write_config_pinned(
    lab: &Lab,
    mode: XdpMode,
    next_program: &Path,
    pins: Option<&PinDir>,
) -> PathBuf {
    let config = lab.agent_config(
        mode,
        vec![lab.vip("web", false, 80, Protocol::Tcp, Health::None)],
    );
    let text = match pins {
        Some(pins) => config.to_toml_pinned(pins.path()),
        None => config.to_toml(),
    };
    let config = text.replacen(
        "[dataplane]\n",
        &format!(
            "[dataplane]\nnext_program = \"{}\"\n",
            next_program.display()
        ),
        1,
    );
    let path = lab.dir().join("lb-next.toml");
    std::fs::write(&path, config).expect("write the config");
    path
}

fn start_agent(lab: &Lab, bin: &Path, config: &Path) -> Agent {
    Agent::start(
        bin,
        lab.lb(),
        config,
        &lab.socket_path(),
        &lab.dir().join("lb-next.log"),
    )
    .unwrap_or_else(|e| panic!("start the agent: {e:#}"))
}

/// Whether a connection from `source` to the balancer host's own service is answered.
fn reaches_host(lab: &Lab, source: IpAddr) -> bool {
    let host = SocketAddr::new(lab.lb_addr(false), HOST_PORT);
    Conn::open_from(lab.client(), source, host, DROPPED).is_ok()
}

/// xdp-filter behind lb: the host's traffic is filtered, VIP traffic is balanced, a new
/// xdp-filter program at the same pin is taken up on reload, and the chain outlives the
/// agent, holds across a restart and in both modes.
#[test]
fn xdp_filter_behind_lb_guards_the_host_and_a_new_pin_is_taken_up_on_reload() {
    let test = "xdp_filter_behind_lb_guards_the_host_and_a_new_pin_is_taken_up_on_reload";
    let _one = XDP_FILTER.lock().unwrap_or_else(|e| e.into_inner());
    let Some(bin) = require(test) else { return };
    let mut lab = Lab::new(LabOptions::default()).expect("build the lab");
    lab.serve_tcp(80, false).expect("backends serve");
    let allowed = lab.client_addr(false);
    let blocked = lab.add_client_addr(21).expect("a second client address");
    let _host = TcpServer::start(
        lab.lb(),
        SocketAddr::new(lab.lb_addr(false), HOST_PORT),
        "host",
    )
    .expect("the host's own service");
    let firewall = Firewall::load().expect("load xdp-filter");
    firewall.block_source(blocked).expect("block a source");
    let first_id = pinned_id(&firewall.pin());

    let pins = PinDir::new(&format!("lbt{}-neighbour", std::process::id())).expect("pins");
    let config = write_config_pinned(&lab, XdpMode::Auto, &firewall.pin(), Some(&pins));
    let agent = start_agent(&lab, &bin, &config);
    // xdp-filter (xdp-tools 1.3) is not multi-buffer aware: the kernel lets only the
    // build of lb's program that is not either call it.
    assert!(
        agent.log().contains(&format!(
            "xdpfilt_alw_ip (id {first_id}) ({}), tail-called by lb_xdp_1buf",
            firewall.pin().display()
        )),
        "the agent does not say what it chains to:\n{}",
        agent.log()
    );
    assert_next_program(&agent, &firewall.pin(), first_id);
    let text = agent.status().expect("lb status");
    assert!(
        text.contains(&format!(
            "next program: xdpfilt_alw_ip (id {first_id}) at {}, tail-called by lb_xdp_1buf",
            firewall.pin().display()
        )),
        "lb status does not show the next program:\n{text}"
    );
    let doctor = lb_in_lab(&lab, &bin, &["doctor"], &config);
    assert!(
        doctor.stdout.lines().any(|l| l.contains("next-program")
            && l.contains(&format!("xdpfilt_alw_ip (id {first_id})"))),
        "lb doctor does not check the next program:\n{doctor}"
    );

    // The host's own traffic goes through xdp-filter: the blocked source is dropped
    // there (its counter says so), the other reaches the host.
    assert!(reaches_host(&lab, allowed), "{}", agent.log());
    assert!(
        !reaches_host(&lab, blocked),
        "the blocked source reached the host"
    );
    let hits = firewall.hits(blocked).expect("xdp-filter status");
    assert!(hits > 0, "xdp-filter never saw the blocked source");

    // VIP traffic is lb's: balanced, from the blocked source too.
    let vip = SocketAddr::new(lab.vip4(), 80);
    for i in 0..5 {
        Conn::open_from(lab.client(), blocked, vip, TIMEOUT)
            .unwrap_or_else(|e| panic!("VIP connection {i} from {blocked}: {e}\n{}", agent.log()));
    }
    let s = spread(lab.client(), vip, 30).expect("spread");
    assert_eq!(s.failures, 0, "{:?}\n{}", s.errors, s.table());
    assert_eq!(s.counts.len(), 3, "{}", s.table());

    // xdp-filter loaded anew: a new program, without the rule, at the same pin. The
    // running chain keeps the old one until a reload.
    firewall.load_again().expect("load xdp-filter again");
    let second_id = pinned_id(&firewall.pin());
    assert_ne!(first_id, second_id);
    assert!(!reaches_host(&lab, blocked), "taken up before the reload");
    let reload = agent.ctl(&["reload"]).expect("lb reload");
    eprintln!("{test}: lb reload: {reload}");
    assert!(
        reaches_host(&lab, blocked),
        "the new program was not taken up"
    );
    assert!(reaches_host(&lab, allowed));
    let log = agent.log();
    assert!(
        log.contains(&format!(
            "dataplane.next_program: id {first_id} -> xdpfilt_alw_ip (id {second_id})"
        )),
        "the reload does not say it:\n{log}"
    );
    assert_next_program(&agent, &firewall.pin(), second_id);

    // The agent stops, its program stays: so does the chain (the program array is
    // pinned; the kernel would empty it with the agent's last handle otherwise).
    firewall
        .block_source(blocked)
        .expect("block the source again");
    assert!(!reaches_host(&lab, blocked), "the new rule does not hold");
    agent.stop().expect("stop the agent");
    assert!(
        !reaches_host(&lab, blocked),
        "the chain went with the agent"
    );
    assert!(reaches_host(&lab, allowed));
    Conn::open(lab.client(), vip, TIMEOUT).expect("VIP traffic without an agent");

    // A restarted agent adopts the running program (lb's own, by its pinned link) and
    // chains the firewall before it takes over.
    let agent = start_agent(&lab, &bin, &config);
    assert!(
        agent.log().contains("adopting the pinned data path"),
        "{}",
        agent.log()
    );
    assert!(
        !reaches_host(&lab, blocked),
        "the chain was lost at the restart"
    );
    assert!(reaches_host(&lab, allowed));
    let s = spread(lab.client(), vip, 30).expect("spread");
    assert_eq!(s.failures, 0, "{:?}\n{}", s.errors, s.table());
    let status = agent.status_json().expect("status");
    assert_eq!(status["dataplane"]["xdp_mode"], "native", "{status:#}");
    agent.stop().expect("stop the agent");

    // Generic mode: the tail call runs in lb's context whatever the mode (xdp-filter
    // itself is loaded in skb mode on another interface).
    let config = write_config_pinned(&lab, XdpMode::Generic, &firewall.pin(), Some(&pins));
    let agent = start_agent(&lab, &bin, &config);
    let status = agent.status_json().expect("status");
    assert_eq!(status["dataplane"]["xdp_mode"], "generic", "{status:#}");
    assert!(
        !reaches_host(&lab, blocked),
        "generic: the blocked source reached the host"
    );
    assert!(reaches_host(&lab, allowed));
    let s = spread(lab.client(), vip, 30).expect("spread");
    assert_eq!(s.failures, 0, "{:?}\n{}", s.errors, s.table());
    agent.stop().expect("stop the agent");
}

/// `lb status --json` names the program chained: `dataplane.next_program`, its pin, name,
/// id and the build of lb that calls it (xdp-filter's is not multi-buffer aware); the
/// metrics too (`lb_next_program_info`, which tests/observe.rs leaves to this test).
fn assert_next_program(agent: &Agent, pin: &Path, id: u32) {
    let status = agent.status_json().expect("status");
    assert_eq!(
        status["dataplane"]["next_program"],
        serde_json::json!({
            "path": pin.display().to_string(),
            "name": "xdpfilt_alw_ip",
            "id": id,
            "caller": "lb_xdp_1buf",
        }),
        "{status:#}"
    );
    let metrics = agent.metrics().expect("GET /metrics");
    let info: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("lb_next_program_info{"))
        .collect();
    assert_eq!(
        info,
        [format!(
            "lb_next_program_info{{name=\"xdpfilt_alw_ip\",id=\"{id}\",caller=\"lb_xdp_1buf\"}} 1"
        )],
        "the metrics do not name the next program"
    );
}

/// `lb ARGS... --config FILE` in the balancer's namespace.
fn lb_in_lab(lab: &Lab, bin: &Path, args: &[&str], config: &Path) -> CliOutput {
    let mut all = vec![
        "netns",
        "exec",
        lab.lb().name(),
        bin.to_str().expect("utf-8"),
    ];
    all.extend_from_slice(args);
    all.extend_from_slice(&["--config", config.to_str().expect("utf-8")]);
    run_lb(Path::new("ip"), &all).expect("run lb")
}

/// The XDP program ids on the balancer's interface.
fn attached_ids(lab: &Lab) -> Vec<String> {
    let link = lab
        .lb()
        .exec("ip", &["-d", "link", "show", IFACE])
        .expect("ip link");
    link.split_whitespace()
        .collect::<Vec<_>>()
        .windows(3)
        .filter(|w| w[0].starts_with("prog/xdp") && w[1] == "id")
        .map(|w| w[2].to_string())
        .collect()
}

/// xdp-filter already on the interface: the doctor and `lb run` refuse, naming it, its
/// id and the fixes; it stays attached, unreplaced.
#[test]
fn a_foreign_program_on_the_hook_is_named_and_left_alone() {
    let test = "a_foreign_program_on_the_hook_is_named_and_left_alone";
    let _one = XDP_FILTER.lock().unwrap_or_else(|e| e.into_inner());
    let Some(bin) = require(test) else { return };
    let lab = Lab::new(LabOptions::default()).expect("build the lab");
    lab.lb()
        .exec("xdp-filter", &["load", "-m", "skb", "-f", "ipv4", IFACE])
        .expect("xdp-filter on the balancer's interface");
    struct Unload<'a>(&'a Netns);
    impl Drop for Unload<'_> {
        fn drop(&mut self) {
            let _ = self.0.exec("xdp-filter", &["unload", IFACE]);
        }
    }
    let _unload = Unload(lab.lb());
    let before = attached_ids(&lab);
    assert_eq!(before.len(), 1, "{before:?}");
    let id = &before[0];
    let config = lab
        .agent_config(
            XdpMode::Auto,
            vec![lab.vip("web", false, 80, Protocol::Tcp, Health::None)],
        )
        .to_toml();
    let path = lab.dir().join("lb.toml");
    std::fs::write(&path, config).expect("write the config");

    let doctor = lb_in_lab(&lab, &bin, &["doctor"], &path);
    assert_eq!(doctor.status.code(), Some(1), "{doctor}");
    let line = doctor
        .stdout
        .lines()
        .find(|l| l.starts_with("fail xdp-attached:"))
        .unwrap_or_else(|| panic!("no failing xdp-attached:\n{doctor}"));
    for words in [
        &format!("xdpfilt_alw_ip (id {id}, generic)"),
        "xdp-loader unload eth0 --all",
        "xdp off",
        "dataplane.next_program",
    ] {
        assert!(line.contains(words), "does not say {words:?}: {line}");
    }
    // libxdp's dispatcher, asked of xdp-loader itself.
    let dispatcher = doctor
        .stdout
        .lines()
        .find(|l| l.contains(" libxdp-dispatcher: "))
        .unwrap_or_else(|| panic!("no libxdp-dispatcher line:\n{doctor}"));
    eprintln!("{test}: {dispatcher}");
    assert!(!dispatcher.contains("not checked"), "{dispatcher}");

    let run = lb_in_lab(&lab, &bin, &["run"], &path);
    assert_eq!(run.status.code(), Some(1), "{run}");
    assert!(
        run.stderr.contains("fail xdp-attached") && run.stderr.contains(&format!("id {id}")),
        "{run}"
    );
    assert_eq!(
        attached_ids(&lab),
        before,
        "the foreign program was replaced"
    );
}

/// bpf(2) for the test's own objects: a map and a socket filter to pin where a next
/// program is expected.
fn bpf(command: libc::c_long, attr: &mut [u64]) -> std::io::Result<OwnedFd> {
    // SAFETY: `attr` is a `union bpf_attr` prefix of the size passed; its pointers
    // outlive the call.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            command,
            attr.as_mut_ptr(),
            size_of_val(attr) as u32,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a new descriptor from the kernel.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Pins `fd` at `path` (BPF_OBJ_PIN).
fn pin(fd: &OwnedFd, path: &Path) -> Result<()> {
    let c_path = std::ffi::CString::new(path.to_str().expect("utf-8"))?;
    let mut attr = [c_path.as_ptr() as u64, fd.as_raw_fd() as u64];
    // SAFETY: as in `bpf`.
    let done = unsafe { libc::syscall(libc::SYS_bpf, 6 as libc::c_long, attr.as_mut_ptr(), 16u32) };
    if done != 0 {
        bail!(
            "pinning {}: {}",
            path.display(),
            std::io::Error::last_os_error()
        );
    }
    Ok(())
}

/// A pinned array map and a pinned socket filter (`r0 = 0; exit`).
fn pin_map_and_socket_filter(dir: &Path) -> Result<(PathBuf, PathBuf)> {
    std::fs::create_dir_all(dir)?;
    // BPF_MAP_CREATE: an array, key 4, value 4, one entry.
    let map = bpf(0, &mut [2 | (4 << 32), 4 | (1 << 32), 0, 0, 0, 0, 0, 0, 0])?;
    let insns: [u64; 2] = [0xb7, 0x95];
    let license = c"GPL";
    // BPF_PROG_LOAD: type 1 (socket filter), two instructions.
    let program = bpf(
        5,
        &mut [
            1 | (2 << 32),
            insns.as_ptr() as u64,
            license.as_ptr() as u64,
            0,
            0,
            0,
            0,
            0,
            0,
        ],
    )?;
    let (map_pin, program_pin) = (dir.join("a_map"), dir.join("a_socket_filter"));
    pin(&map, &map_pin)?;
    pin(&program, &program_pin)?;
    Ok((map_pin, program_pin))
}

/// `next_program` naming no pin, a map, or a program that is not XDP: `lb check`
/// refuses naming the field, and `lb run` attaches nothing.
#[test]
fn a_next_program_that_is_missing_or_not_xdp_is_refused_naming_the_field() {
    let test = "a_next_program_that_is_missing_or_not_xdp_is_refused_naming_the_field";
    let Some(bin) = require(test) else { return };
    let dir = Path::new(PIN_FS).join(format!("lbt{}-next", std::process::id()));
    struct Remove(PathBuf);
    impl Drop for Remove {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let _remove = Remove(dir.clone());
    let (map, socket_filter) = pin_map_and_socket_filter(&dir).expect("pin a map and a program");
    let lab = Lab::new(LabOptions::default()).expect("build the lab");
    for (pin, words) in [
        (dir.join("nothing-here"), "nothing is pinned at"),
        (map, "is a pinned BPF map, not a program"),
        (socket_filter, "not an XDP program"),
    ] {
        let config = write_config(&lab, XdpMode::Auto, &pin);
        let check = lb_in_lab(&lab, &bin, &["check"], &config);
        assert_eq!(check.status.code(), Some(2), "{check}");
        assert!(
            check.stderr.contains("dataplane.next_program")
                && check.stderr.contains(pin.to_str().unwrap())
                && check.stderr.contains(words),
            "{check}"
        );
    }
    let config = write_config(&lab, XdpMode::Auto, &dir.join("nothing-here"));
    let run = lb_in_lab(&lab, &bin, &["run"], &config);
    assert!(!run.success(), "{run}");
    assert!(run.stderr.contains("dataplane.next_program"), "{run}");
    assert!(attached_ids(&lab).is_empty(), "something was attached");
}

/// One VIP on 10.0.0.100:80 with one backend whose MAC is given: an instance of the
/// program without an interface.
const INSTANCE: &str = "[dataplane]\ninterface = \"lo\"\n[control]\nmetrics = \"off\"\n\
    [[vip]]\nname = \"web\"\naddress = \"10.0.0.100\"\nport = 80\nprotocol = \"tcp\"\n\
    [vip.health]\nkind = \"none\"\n[[vip.backend]]\naddress = \"10.0.0.11\"\n\
    mac = \"02:00:00:00:00:0b\"\n";

/// An Ethernet + IPv4 + TCP ACK frame from 10.0.0.1 to 10.0.0.2:22: for no VIP.
fn frame_for_no_vip() -> Vec<u8> {
    let mut f = vec![2, 0, 0, 0, 0, 2, 2, 0, 0, 0, 0, 1, 0x08, 0x00];
    f.extend_from_slice(&[0x45, 0, 0, 40, 0, 0, 0x40, 0, 64, 6, 0, 0]);
    f.extend_from_slice(&[10, 0, 0, 1, 10, 0, 0, 2]);
    f.extend_from_slice(&[
        0x9c, 0x40, 0, 22, 0, 0, 0, 1, 0, 0, 0, 1, 0x50, 0x10, 0xff, 0xff,
    ]);
    f.extend_from_slice(&[0, 0, 0, 0]);
    f
}

/// The kernel's rule, asked of the kernel: a next program that takes multi-buffer frames
/// (the test object's `xdp_pass`, `xdp.frags`) is called by `lb_xdp`, one that does not
/// (`xdp_mac_swap`) by `lb_xdp_1buf`; the build that can call it does (the frame comes
/// back as the next program made it), the other refuses naming both.
#[test]
fn the_build_of_lb_that_can_call_the_next_program_is_the_one_loaded() {
    use aya::programs::{TestRun, TestRunOptions};
    use lb_tests::program::{Instance, load_test_program};
    use lb_userspace::dataplane::{DataplaneError, next};
    let test = "the_build_of_lb_that_can_call_the_next_program_is_the_one_loaded";
    if require_e2e(test).is_none() {
        return;
    }
    let dir = PinDir::new(&format!("lbt{}-kinds", std::process::id())).expect("pins");
    std::fs::create_dir_all(dir.path()).expect("pin directory");
    let mut programs = Vec::new();
    for (name, caller, other, action) in [
        ("xdp_pass", next::LB_XDP, next::LB_XDP_1BUF, 2),
        ("xdp_mac_swap", next::LB_XDP_1BUF, next::LB_XDP, 3),
    ] {
        let mut ebpf = load_test_program(name, 1).expect("the test program");
        let pin = dir.path().join(name);
        let program: &mut aya::programs::Xdp = ebpf
            .program_mut(name)
            .and_then(|p| p.try_into().ok())
            .expect("an XDP program");
        program.pin(&pin).expect("pin it");
        let next = next::open(&pin).unwrap_or_else(|e| panic!("{name}: {e}"));
        std::fs::remove_file(&pin).expect("unpin");
        assert_eq!(next.caller(), caller, "{name}");

        let mut calling = Instance::load_with(INSTANCE, |o| o.program = caller).expect("load");
        calling.dataplane.chain(Some(&next)).expect("chain");
        let frame = frame_for_no_vip();
        let run = calling
            .dataplane
            .program_mut()
            .expect("program")
            .test_run(TestRunOptions {
                data_in: Some(&frame),
                ..TestRunOptions::default()
            })
            .expect("BPF_PROG_TEST_RUN");
        assert_eq!(run.return_value, action, "{caller} chained to {name}");

        let mut refusing = Instance::load_with(INSTANCE, |o| o.program = other).expect("load");
        match refusing.dataplane.chain(Some(&next)) {
            Err(error @ DataplaneError::NextProgramKind { .. }) => {
                let text = error.to_string();
                assert!(text.contains(caller) && text.contains(other), "{text}");
            }
            other => panic!("{name} chained to the other build: {other:?}"),
        }
        programs.push(ebpf);
    }
}
