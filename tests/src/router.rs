//! Several balancer nodes behind a router: ECMP over BGP, with BIRD 2 on the router and
//! on each node, in network namespaces. Used by `tests/bgp.rs`.
//!
//! ```text
//!   client 10.98.0.2 ──── eth0 [ router ] eth1 10.97.0.1 ─── p-rtr ─┐
//!        (tx csum off)  10.98.0.1    BIRD: one multipath route per   │
//!                                    VIP, L4 hash over the nodes     │
//!                                                       switch: [=== br0 ===]
//!   lb1 10.97.0.2  lb + BIRD ── p-lb1 (xdp_pass) ────────────────────┤
//!   lb2 10.97.0.3  lb + BIRD ── p-lb2 (xdp_pass) ────────────────────┤
//!   b1 .11, b2 .12, b3 .13: VIP on lo, default route via 10.97.0.1 ──┘
//! ```
//!
//! The client's packets to the VIP reach the router, which picks a node by hashing the
//! 5-tuple over the next hops BGP gave it; the node's XDP program rewrites the
//! destination MAC to a backend's and sends the frame back onto the fabric; the backend
//! answers the client directly, through the router (direct server return). The router's
//! ARP, the nodes' BGP sessions and health checks pass the XDP program untouched.
//!
//! BIRD runs from the shipped example configurations (`scripts/bird/`), with their
//! `define` lines set to this topology's addresses, so the examples are what is tested.
//! A third node (`EcmpLab::with_nodes`) is lb3 10.97.0.4, with one more `protocol bgp`
//! on the router ([`router_config`]).
//!
//! For tens of thousands of long-lived connections, the backends can hold them without
//! a thread each ([`EcmpLab::hold_tcp`]: a listener that never accepts) and the `crowd`
//! binary opens and probes them ([`Crowd`]).

use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};

use crate::lab::{XdpPass, arp_for_dsr, fabric_port, switch_namespace};
use crate::netns::{ip, run_cmd};
use crate::{Netns, TcpServer};

/// The VIP the nodes announce.
pub const VIP: Ipv4Addr = Ipv4Addr::new(10, 99, 0, 100);
/// The client, behind the router.
pub const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 98, 0, 2);
const ROUTER_CLIENT_SIDE: Ipv4Addr = Ipv4Addr::new(10, 98, 0, 1);
/// The router on the fabric (the nodes' BGP neighbour, the backends' gateway).
pub const ROUTER: Ipv4Addr = Ipv4Addr::new(10, 97, 0, 1);
/// Every host's interface inside its namespace.
pub const IFACE: &str = "eth0";
/// The router's fabric interface.
const ROUTER_FABRIC: &str = "eth1";
/// Balancer nodes in the topology (the shipped router config names two).
pub const NODES: usize = 2;
/// Nodes `EcmpLab::with_nodes` builds at most.
pub const MAX_NODES: usize = 3;

/// Node `i` (0-based): 10.97.0.2, 10.97.0.3.
pub fn node_addr(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 97, 0, 2 + i as u8)
}

/// Backend `i` (0-based): 10.97.0.11, ...
pub fn backend_addr(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 97, 0, 11 + i as u8)
}

/// `bird` is BIRD 2: `Ok(version)`, or why the tests cannot use it.
pub fn bird_version() -> std::result::Result<String, String> {
    let out = Command::new("bird")
        .arg("--version")
        .output()
        .map_err(|e| format!("`bird` is not installed ({e}); apt-get install bird2"))?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let version = text.trim().rsplit(' ').next().unwrap_or("").to_string();
    if !out.status.success()
        || version
            .split('.')
            .next()
            .and_then(|m| m.parse::<u32>().ok())
            .is_none_or(|major| major < 2)
    {
        return Err(format!(
            "`bird --version` says {:?}: BIRD 2 is needed (apt-get install bird2)",
            text.trim()
        ));
    }
    Ok(version)
}

/// A shipped example configuration, `scripts/bird/NAME`.
pub fn shipped_config(name: &str) -> Result<String> {
    let path = crate::workspace_root().join("scripts/bird").join(name);
    std::fs::read_to_string(&path).with_context(|| format!("read {}", path.display()))
}

/// The shipped router configuration for `nodes` nodes (2 or 3) and the VIP range
/// `vips4`, logging to `log`: the nodes beyond the two it names get a `protocol bgp` of
/// their own, from its `lbnode` template.
pub fn router_config(
    nodes: usize,
    vips4: &str,
    hold: u64,
    keepalive: u64,
    log: &Path,
) -> Result<String> {
    ensure!((NODES..=MAX_NODES).contains(&nodes), "2 or 3 nodes");
    let mut text = configure(
        &shipped_config("router.conf")?,
        &[
            ("ROUTER_ID", ROUTER.to_string()),
            ("LB1", node_addr(0).to_string()),
            ("LB2", node_addr(1).to_string()),
            ("VIPS4", vips4.to_string()),
            ("HOLD", hold.to_string()),
            ("KEEPALIVE", keepalive.to_string()),
        ],
        log,
    )?;
    for i in NODES..nodes {
        text += &format!(
            "protocol bgp lb{} from lbnode {{ neighbor {} as NODE_AS; }}\n",
            i + 1,
            node_addr(i)
        );
    }
    Ok(text)
}

/// `text` with each `define NAME = ...;` line of `defines` given the new value, and the
/// log sent to `log` instead of syslog. Fails when a define or the log line is missing,
/// so a changed example cannot silently escape the test.
pub fn configure(text: &str, defines: &[(&str, String)], log: &Path) -> Result<String> {
    let mut out = String::with_capacity(text.len());
    let mut found = vec![false; defines.len()];
    let mut logged = false;
    for line in text.lines() {
        let trimmed = line.trim_start();
        let define = trimmed
            .strip_prefix("define ")
            .and_then(|rest| rest.split_once('='))
            .map(|(name, _)| name.trim());
        match define.and_then(|name| defines.iter().position(|(n, _)| *n == name)) {
            Some(i) => {
                out.push_str(&format!("define {} = {};\n", defines[i].0, defines[i].1));
                found[i] = true;
            }
            None if trimmed.starts_with("log syslog") => {
                out.push_str(&format!("log \"{}\" all;\n", log.display()));
                logged = true;
            }
            None => {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    for (i, (name, _)) in defines.iter().enumerate() {
        ensure!(
            found[i],
            "no `define {name} = ...;` line in the configuration"
        );
    }
    ensure!(logged, "no `log syslog ...;` line in the configuration");
    Ok(out)
}

/// The BFD lines of a shipped configuration uncommented: the `protocol bfd` block and
/// `bfd on;` in the BGP template. Fails when they are not there as shipped.
pub fn enable_bfd(text: &str) -> Result<String> {
    const BLOCK: &str = "# protocol bfd {\n\
        #     interface \"*\" { min rx interval 100 ms; min tx interval 100 ms; multiplier 3; };\n\
        # }\n";
    ensure!(
        text.contains(BLOCK),
        "no commented `protocol bfd` block in the configuration"
    );
    ensure!(
        text.contains("# bfd on;"),
        "no `# bfd on;` line in the configuration"
    );
    let block = BLOCK.replace("# ", "").replace("#", "");
    Ok(text.replace(BLOCK, &block).replace("# bfd on;", "bfd on;"))
}

/// How long BIRD may take to open its control socket.
const BIRD_START: Duration = Duration::from_secs(10);

/// One `bird -f` in a namespace, with its own configuration, control socket, pid file
/// and log under a directory. Dropping it stops it (SIGTERM, then SIGKILL).
pub struct Bird {
    name: String,
    child: Option<Child>,
    socket: PathBuf,
    log: PathBuf,
}

impl Bird {
    /// Writes `config` to `DIR/NAME.conf`, starts BIRD in `ns` and waits until it
    /// answers on its control socket.
    pub fn start(ns: &Netns, dir: &Path, name: &str, config: &str) -> Result<Bird> {
        let conf = dir.join(format!("{name}.conf"));
        std::fs::write(&conf, config).with_context(|| format!("write {}", conf.display()))?;
        let socket = dir.join(format!("{name}.ctl"));
        let pid_file = dir.join(format!("{name}.pid"));
        let out = dir.join(format!("{name}.out"));
        let _ = std::fs::remove_file(&socket);
        let output = std::fs::File::create(&out)?;
        // SIGKILL if the test process dies without running Drop: BIRD goes too.
        let mut cmd = ns.daemon_command("bird", &output, libc::SIGKILL)?;
        cmd.args(["-f", "-c"])
            .arg(&conf)
            .arg("-s")
            .arg(&socket)
            .arg("-P")
            .arg(&pid_file);
        let child = cmd.spawn().context("spawn bird")?;
        let mut bird = Bird {
            name: name.into(),
            child: Some(child),
            socket,
            log: dir.join(format!("{name}.log")),
        };
        let start = Instant::now();
        loop {
            if bird.birdc(&["show", "status"]).is_ok() {
                return Ok(bird);
            }
            if let Some(child) = bird.child.as_mut()
                && let Some(status) = child.try_wait()?
            {
                bird.child = None;
                bail!(
                    "bird {name} exited ({status}) at start:\n{}{}",
                    std::fs::read_to_string(&out).unwrap_or_default(),
                    bird.log()
                );
            }
            ensure!(
                start.elapsed() < BIRD_START,
                "bird {name} did not open {} within {BIRD_START:?}",
                bird.socket.display()
            );
            sleep(Duration::from_millis(50));
        }
    }

    /// `birdc -s SOCKET ARGS...` (the socket is a file: no namespace needed).
    pub fn birdc(&self, args: &[&str]) -> Result<String> {
        let socket = self.socket.to_string_lossy();
        let mut all = vec!["-s", &socket];
        all.extend_from_slice(args);
        run_cmd("birdc", &all)
    }

    /// Its log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// SIGKILL: no BGP notification is sent (the kernel closes its TCP sessions).
    pub fn kill(&mut self) -> Result<()> {
        if let Some(mut child) = self.child.take() {
            child.kill().context("kill bird")?;
            child.wait()?;
        }
        Ok(())
    }

    /// SIGTERM (BIRD closes its sessions with a Cease), up to 3 s, then SIGKILL.
    pub fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let what = format!("bird {}", self.name);
        let _ = crate::netns::terminate(&mut child, Duration::from_secs(3), &what);
    }
}

impl Drop for Bird {
    fn drop(&mut self) {
        if std::thread::panicking() && self.child.is_some() {
            eprintln!("--- bird {} log ---\n{}--- end ---", self.name, self.log());
        }
        self.stop();
    }
}

/// A bpffs outside /sys (`/run/lb-tests/bpf`, mounted once and kept) and a directory on
/// it for one agent's pins, removed (detaching the program) on drop. The agent runs
/// under `ip netns exec`, which gives it a /sys of its own: pins there would vanish with
/// it, and a stopped agent would take its program along, unlike on a real host.
pub struct PinDir(PathBuf);

/// Where [`PinDir`]s live.
pub const PIN_FS: &str = "/run/lb-tests/bpf";

impl PinDir {
    pub fn new(name: &str) -> Result<PinDir> {
        static MOUNT: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let _guard = MOUNT.lock().unwrap_or_else(|e| e.into_inner());
        std::fs::create_dir_all(PIN_FS).context("create the bpffs mount point")?;
        let is_bpffs = |p: &str| {
            nix::sys::statfs::statfs(p).is_ok_and(|s| s.filesystem_type().0 as u64 == 0xcafe_4a11)
        };
        if !is_bpffs(PIN_FS) {
            run_cmd("mount", &["-t", "bpf", "bpf", PIN_FS])?;
            ensure!(is_bpffs(PIN_FS), "mounting a bpffs at {PIN_FS}");
        }
        Ok(PinDir(Path::new(PIN_FS).join(name)))
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for PinDir {
    fn drop(&mut self) {
        if let Err(error) = lb_userspace::dataplane::remove_pins(&self.0) {
            eprintln!("removing {}: {error}", self.0.display());
        }
    }
}

/// The topology of the module doc. Dropping it stops the servers, detaches `xdp_pass`
/// and deletes the namespaces (the switch last). Agents and BIRDs belong to the test:
/// drop them first.
pub struct EcmpLab {
    servers: Vec<TcpServer>,
    /// Listeners that never accept ([`EcmpLab::hold_tcp`]).
    holders: Vec<OwnedFd>,
    xdp_pass: Vec<XdpPass>,
    client: Netns,
    router: Netns,
    nodes: Vec<Netns>,
    backends: Vec<Netns>,
    switch: Netns,
    // Last: logs and configs outlive everything that writes them.
    dir: tempfile::TempDir,
}

impl EcmpLab {
    /// Two nodes and `backends` backends (1..=40).
    pub fn new(backends: usize) -> Result<EcmpLab> {
        EcmpLab::with_nodes(NODES, backends)
    }

    /// `nodes` nodes (2 or 3) and `backends` backends (1..=40).
    pub fn with_nodes(nodes: usize, backends: usize) -> Result<EcmpLab> {
        ensure!((1..=40).contains(&backends), "1 to 40 backends");
        ensure!((NODES..=MAX_NODES).contains(&nodes), "2 or 3 nodes");
        let dir = tempfile::Builder::new()
            .prefix("lbt-bgp-")
            .tempdir()
            .context("tempdir")?;
        let switch = switch_namespace()?;

        let router = Netns::new("rtr")?;
        router.sysctl("net.ipv4.ip_forward", "1")?;
        // L4 hashing: every packet of a flow takes the same node.
        router.sysctl("net.ipv4.fib_multipath_hash_policy", "1")?;
        let client = Netns::new("cl")?;
        let (r, c) = (router.name(), client.name());
        ip(&[
            "-n", r, "link", "add", IFACE, "type", "veth", "peer", "name", IFACE, "netns", c,
        ])?;
        addr_up(&router, IFACE, ROUTER_CLIENT_SIDE)?;
        addr_up(&client, IFACE, CLIENT)?;
        ip(&[
            "-n",
            c,
            "route",
            "add",
            "default",
            "via",
            &ROUTER_CLIENT_SIDE.to_string(),
        ])?;
        // Native XDP_TX on veth drops CHECKSUM_PARTIAL: the client sends full checksums.
        client.exec("ethtool", &["-K", IFACE, "tx", "off"])?;
        fabric_port(&switch, &router, "p-rtr", ROUTER_FABRIC)?;
        addr_up(&router, ROUTER_FABRIC, ROUTER)?;

        let node_count = nodes;
        let mut nodes = Vec::with_capacity(node_count);
        let mut xdp_pass = Vec::with_capacity(node_count);
        for i in 0..node_count {
            let ns = Netns::new(&format!("lb{}", i + 1))?;
            // XDP forwards the VIP's packets; the kernel must not route anything itself.
            ns.sysctl("net.ipv4.ip_forward", "0")?;
            let port = format!("p-lb{}", i + 1);
            fabric_port(&switch, &ns, &port, IFACE)?;
            addr_up(&ns, IFACE, node_addr(i))?;
            xdp_pass.push(XdpPass::attach(&switch, &port)?);
            nodes.push(ns);
        }
        let mut hosts = Vec::with_capacity(backends);
        for i in 0..backends {
            let ns = Netns::new(&format!("b{}", i + 1))?;
            fabric_port(&switch, &ns, &format!("p-b{}", i + 1), IFACE)?;
            addr_up(&ns, IFACE, backend_addr(i))?;
            let n = ns.name();
            ip(&["-n", n, "addr", "add", &format!("{VIP}/32"), "dev", "lo"])?;
            arp_for_dsr(&ns, IFACE)?;
            // Direct server return: replies go to the client through the router.
            ip(&[
                "-n",
                n,
                "route",
                "add",
                "default",
                "via",
                &ROUTER.to_string(),
            ])?;
            hosts.push(ns);
        }
        Ok(EcmpLab {
            servers: Vec::new(),
            holders: Vec::new(),
            xdp_pass,
            client,
            router,
            nodes,
            backends: hosts,
            switch,
            dir,
        })
    }

    pub fn client(&self) -> &Netns {
        &self.client
    }

    pub fn router(&self) -> &Netns {
        &self.router
    }

    pub fn switch(&self) -> &Netns {
        &self.switch
    }

    pub fn node(&self, i: usize) -> &Netns {
        &self.nodes[i]
    }

    pub fn backends(&self) -> &[Netns] {
        &self.backends
    }

    /// The bridge port of node `i` (in [`EcmpLab::switch`]).
    fn node_port(&self, i: usize) -> String {
        format!("p-lb{}", i + 1)
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// A TCP server (greets with `backend-N`, then echoes) on `0.0.0.0:port` of every
    /// backend.
    pub fn serve_tcp(&mut self, port: u16) -> Result<()> {
        for (i, ns) in self.backends.iter().enumerate() {
            let addr = (Ipv4Addr::UNSPECIFIED, port).into();
            self.servers
                .push(TcpServer::start(ns, addr, &format!("backend-{}", i + 1))?);
        }
        Ok(())
    }

    /// On every backend, a listener on `0.0.0.0:port` that never accepts, with a backlog
    /// of 65535: the kernel completes each handshake and acknowledges data, so one
    /// socket holds tens of thousands of connections (each reset by the backend's
    /// kernel if a segment of it reaches another backend). Also lets the client use
    /// every port from 1024.
    pub fn hold_tcp(&mut self, port: u16) -> Result<()> {
        use nix::sys::socket::{
            AddressFamily, Backlog, SockFlag, SockType, SockaddrIn, bind, listen, setsockopt,
            socket, sockopt,
        };
        self.client
            .sysctl("net.ipv4.ip_local_port_range", "1024 65535")?;
        for ns in &self.backends {
            ns.sysctl("net.core.somaxconn", "65535")?;
            ns.sysctl("net.ipv4.tcp_max_syn_backlog", "65535")?;
            let listener = ns.run(|| -> Result<OwnedFd> {
                let fd = socket(
                    AddressFamily::Inet,
                    SockType::Stream,
                    SockFlag::SOCK_CLOEXEC,
                    None,
                )?;
                setsockopt(&fd, sockopt::ReuseAddr, &true)?;
                bind(
                    std::os::fd::AsRawFd::as_raw_fd(&fd),
                    &SockaddrIn::new(0, 0, 0, 0, port),
                )?;
                // -1: the namespace's somaxconn, set above.
                listen(&fd, Backlog::MAXALLOWABLE)?;
                Ok(fd)
            })??;
            self.holders.push(listener);
        }
        Ok(())
    }

    /// The router's next hops for `VIP` in its kernel table (empty: no route).
    fn next_hops(&self) -> Result<Vec<IpAddr>> {
        let text = ip(&["-n", self.router.name(), "route", "show", &VIP.to_string()])?;
        let mut hops: Vec<IpAddr> = text
            .split_whitespace()
            .collect::<Vec<_>>()
            .windows(2)
            .filter(|w| w[0] == "via")
            .filter_map(|w| w[1].parse().ok())
            .collect();
        hops.sort();
        Ok(hops)
    }

    /// Polls the router's route every 10 ms until its next hops are `expected` (in any
    /// order); returns the time it took, or fails after `timeout`.
    pub fn wait_next_hops(&self, expected: &[Ipv4Addr], timeout: Duration) -> Result<Duration> {
        let mut want: Vec<IpAddr> = expected.iter().map(|a| IpAddr::V4(*a)).collect();
        want.sort();
        let start = Instant::now();
        loop {
            let hops = self.next_hops()?;
            if hops == want {
                return Ok(start.elapsed());
            }
            if start.elapsed() > timeout {
                bail!(
                    "the router's next hops for {VIP} are {hops:?}, not {want:?}, after {timeout:?}"
                );
            }
            sleep(Duration::from_millis(10));
        }
    }

    /// Stops (`false`) or restores (`true`) forwarding on node `i`'s switch port: the
    /// node silently vanishes from the fabric, links stay up, nothing tells the router.
    pub fn set_node_port_forwarding(&self, i: usize, forwarding: bool) -> Result<()> {
        // Bridge port states: 0 disabled, 3 forwarding.
        let state = if forwarding { "3" } else { "0" };
        run_cmd(
            "bridge",
            &[
                "-n",
                self.switch.name(),
                "link",
                "set",
                "dev",
                &self.node_port(i),
                "state",
                state,
            ],
        )?;
        Ok(())
    }
}

impl Drop for EcmpLab {
    fn drop(&mut self) {
        // Server threads sit inside the namespaces: end them first.
        self.servers.clear();
        self.holders.clear();
        self.xdp_pass.clear();
        // The namespaces go with the fields; the switch last.
    }
}

/// What `crowd`'s `open` did.
#[derive(Clone, Debug, Default)]
pub struct Opened {
    pub opened: usize,
    pub failed: usize,
    pub seconds: f64,
    /// The local ports of the connections it opened.
    pub ports: Vec<u16>,
}

/// What `crowd`'s `probe` found: connections that acknowledged a byte, were reset, or
/// neither within its timeout.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Probe {
    pub alive: usize,
    pub reset: usize,
    pub unacked: usize,
}

/// A `crowd` process (the binary of this crate) in a namespace, holding long-lived
/// connections to one address; see `src/bin/crowd.rs`. Dropping it closes them.
pub struct Crowd {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Crowd {
    /// Starts `bin` (`env!("CARGO_BIN_EXE_crowd")`) in `ns`, connecting to `addr`.
    pub fn start(bin: &Path, ns: &Netns, addr: SocketAddr) -> Result<Crowd> {
        let mut child = ns
            .run(|| {
                Command::new(bin)
                    .arg(addr.to_string())
                    .stdin(Stdio::piped())
                    .stdout(Stdio::piped())
                    .spawn()
            })?
            .context("start crowd")?;
        let stdin = child.stdin.take().context("crowd's stdin")?;
        let stdout = BufReader::new(child.stdout.take().context("crowd's stdout")?);
        Ok(Crowd {
            child,
            stdin,
            stdout,
        })
    }

    /// Sends a command; its answer is read by [`Crowd::answer`].
    pub fn send(&mut self, command: &str) -> Result<()> {
        writeln!(self.stdin, "{command}")?;
        self.stdin.flush()?;
        Ok(())
    }

    /// The answer to the oldest command not yet answered (blocks until it comes).
    pub fn answer(&mut self) -> Result<String> {
        let mut line = String::new();
        ensure!(self.stdout.read_line(&mut line)? > 0, "crowd exited");
        Ok(line.trim_end().to_string())
    }

    /// `open N RATE`, sent: see [`Crowd::opened`] for its answer.
    pub fn start_open(&mut self, n: usize, rate: u32) -> Result<()> {
        self.send(&format!("open {n} {rate}"))
    }

    /// The answer to `open`.
    pub fn opened(&mut self) -> Result<Opened> {
        let line = self.answer()?;
        let words: Vec<&str> = line.split(' ').collect();
        let ["opened", opened, failed, seconds, ports @ ..] = words.as_slice() else {
            bail!("crowd answered {line:?} to open");
        };
        Ok(Opened {
            opened: opened.parse()?,
            failed: failed.parse()?,
            seconds: seconds.parse()?,
            ports: ports
                .first()
                .map(|p| p.split(',').filter_map(|p| p.parse().ok()).collect())
                .unwrap_or_default(),
        })
    }

    /// Opens `n` more connections, at most `rate` per second.
    pub fn open(&mut self, n: usize, rate: u32) -> Result<Opened> {
        self.start_open(n, rate)?;
        self.opened()
    }

    /// One byte on each connection; how they answered.
    pub fn probe(&mut self) -> Result<Probe> {
        self.send("probe")?;
        let line = self.answer()?;
        let numbers: Vec<usize> = line
            .strip_prefix("probe ")
            .with_context(|| format!("crowd answered {line:?} to probe"))?
            .split(' ')
            .map(str::parse)
            .collect::<std::result::Result<_, _>>()?;
        let [alive, reset, unacked] = numbers[..] else {
            bail!("crowd answered {line:?} to probe");
        };
        Ok(Probe {
            alive,
            reset,
            unacked,
        })
    }
}

impl Drop for Crowd {
    fn drop(&mut self) {
        let _ = self.send("quit");
        let _ = crate::netns::terminate(&mut self.child, Duration::from_secs(5), "crowd");
    }
}

/// `ADDR/24` on `dev` of `ns`, and the device up.
fn addr_up(ns: &Netns, dev: &str, addr: Ipv4Addr) -> Result<()> {
    ip(&[
        "-n",
        ns.name(),
        "addr",
        "add",
        &format!("{addr}/24"),
        "dev",
        dev,
    ])?;
    ip(&["-n", ns.name(), "link", "set", dev, "up"])?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configure_sets_defines_and_the_log() {
        let text =
            "define A = 1;\n  define B = 10.0.0.1;   # note\nlog syslog all;\nrouter id B;\n";
        let out = configure(text, &[("B", "10.97.0.2".into())], Path::new("/x/b.log")).unwrap();
        assert_eq!(
            out,
            "define A = 1;\ndefine B = 10.97.0.2;\nlog \"/x/b.log\" all;\nrouter id B;\n"
        );
        assert!(configure(text, &[("C", "1".into())], Path::new("/x")).is_err());
    }

    #[test]
    fn bfd_can_be_enabled_in_the_shipped_configs() {
        for name in ["lb-node.conf", "router.conf"] {
            let text = enable_bfd(&shipped_config(name).unwrap()).unwrap();
            assert!(text.contains("\nprotocol bfd {\n"), "{name}:\n{text}");
            assert!(text.contains("    bfd on;"), "{name}:\n{text}");
        }
    }

    #[test]
    fn the_shipped_configs_have_the_defines_the_tests_set() {
        let log = Path::new("/x/bird.log");
        let node = shipped_config("lb-node.conf").unwrap();
        for name in [
            "NODE_ID",
            "NODE_AS",
            "ROUTER",
            "ROUTER_AS",
            "LB_TABLE",
            "LB_PROTO",
            "HOLD",
            "KEEPALIVE",
        ] {
            configure(&node, &[(name, "1".into())], log).unwrap();
        }
        let router = shipped_config("router.conf").unwrap();
        for name in [
            "ROUTER_ID",
            "ROUTER_AS",
            "NODE_AS",
            "LB1",
            "LB2",
            "VIPS4",
            "HOLD",
            "KEEPALIVE",
        ] {
            configure(&router, &[(name, "1".into())], log).unwrap();
        }
    }
}
