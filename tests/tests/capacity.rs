//! `dataplane.max_backends`: the backend capacity the data path is loaded with, and what
//! the agent says when it runs out. A removed backend's id is held for the flow idle time
//! (an old flow's entry must not reach a new backend), so adding new backends beyond the
//! free ids is refused, naming the held ids and the key to raise; a restart with a larger
//! capacity replaces the pinned maps (they cannot grow), saying why, and takes the new
//! backends.

use std::path::Path;

use lb_tests::agent::Agent;
use lb_tests::netns::Netns;
use lb_tests::require_e2e;
use lb_tests::router::PinDir;
use serde_json::Value;

const VIP: &str = "10.92.0.100:80/tcp";

/// A namespace with a veth pair `lbc0`/`lbc1` up, `lbc0` addressed.
fn namespace() -> Netns {
    Netns::with_veth("cap", ["lbc0", "lbc1"], "10.92.0.2/24").expect("create a namespace")
}

/// Writes the agent's config: `max_backends`, pins in `pins`, one unchecked VIP with the
/// backends `10.92.0.<host>` of `hosts` (each with a MAC: no resolution needed).
fn write_config(dir: &Path, pins: &Path, max_backends: u32, hosts: &[u8]) {
    let mut text = format!(
        "[dataplane]\ninterface = \"lbc0\"\nxdp_mode = \"generic\"\n\
         max_backends = {max_backends}\nflow_idle_timeout = \"10m\"\npin_path = \"{}\"\n\
         [control]\nsocket = \"{}\"\nmetrics = \"off\"\nstate_file = \"{}\"\n\
         [[vip]]\nname = \"web\"\naddress = \"10.92.0.100\"\nport = 80\n\
         protocol = \"tcp\"\n[vip.health]\nkind = \"none\"\n",
        pins.display(),
        dir.join("lb.sock").display(),
        dir.join("state.json").display(),
    );
    for host in hosts {
        text += &format!(
            "[[vip.backend]]\naddress = \"10.92.0.{host}\"\nmac = \"02:00:00:00:00:{host:02x}\"\n"
        );
    }
    std::fs::write(dir.join("lb.toml"), text).expect("write the config");
}

/// (in use, held, capacity) of the backend ids, from `lb status --json`.
fn ids(agent: &Agent) -> (u64, u64, u64) {
    let status: Value = agent.status_json().expect("lb status --json");
    let field = |name: &str| status["dataplane"][name].as_u64().unwrap_or(u64::MAX);
    (
        field("backend_ids_in_use"),
        field("backend_ids_held"),
        field("backend_id_capacity"),
    )
}

fn start(ns: &Netns, bin: &Path, dir: &Path, run: u32) -> Agent {
    let log = dir.join(format!("lb-{run}.log"));
    Agent::start(bin, ns, &dir.join("lb.toml"), &dir.join("lb.sock"), &log)
        .expect("start the agent")
}

#[test]
fn held_ids_refuse_new_backends_by_name_and_a_larger_max_backends_takes_them() {
    let test = "held_ids_refuse_new_backends_by_name_and_a_larger_max_backends_takes_them";
    let Some(bin) = require_e2e(test) else { return };
    let ns = namespace();
    let dir = tempfile::tempdir().expect("tempdir");
    let dir = dir.path();
    let pins = PinDir::new(&format!("capacity-{}", std::process::id())).expect("pin directory");

    write_config(dir, pins.path(), 8, &[11, 12, 13, 14, 15, 16]);
    let agent = start(&ns, &bin, dir, 1);
    assert_eq!(ids(&agent), (6, 0, 8), "{}", agent.status().unwrap());

    // Four removed: their ids are held for the flow idle time.
    write_config(dir, pins.path(), 8, &[11, 12]);
    agent.ctl(&["reload"]).expect("reload removing four");
    assert_eq!(ids(&agent), (2, 4, 8));
    let text = agent.status().unwrap();
    assert!(
        text.contains("backend ids: 2 in use, 4 held (backends removed within the flow idle time), 2 free, of 8"),
        "{text}"
    );

    // Three new ones need three ids; two are free.
    write_config(dir, pins.path(), 8, &[11, 12, 21, 22, 23]);
    let refused = agent.cli(&["reload"]).expect("lb reload");
    assert!(!refused.success(), "{refused}");
    for words in [
        "4 ids of backends removed within the flow idle time (600s) are held",
        "raise dataplane.max_backends (now 8;",
    ] {
        assert!(refused.stderr.contains(words), "no {words:?}: {refused}");
    }
    assert_eq!(ids(&agent), (2, 4, 8), "a refused reload changed nothing");

    // At run time: two fit, the third is refused the same way.
    for host in [21, 22] {
        let added = agent
            .cli(&["backend", "add", VIP, &format!("10.92.0.{host}")])
            .expect("lb backend add");
        assert!(added.success(), "{added}");
    }
    let third = agent
        .cli(&["backend", "add", VIP, "10.92.0.23"])
        .expect("lb backend add");
    assert!(!third.success(), "{third}");
    let said = format!("{}{}", third.stdout, third.stderr);
    assert!(
        said.contains("ids of backends removed within the flow idle time (600s) are held")
            && said.contains("raise dataplane.max_backends (now 8;"),
        "{third}"
    );

    // The capacity is fixed while the agent runs: a reload says a restart is needed.
    write_config(dir, pins.path(), 16, &[11, 12, 21, 22, 23]);
    let resized = agent.cli(&["reload"]).expect("lb reload");
    assert!(
        !resized.success() && resized.stderr.contains("dataplane.max_backends"),
        "{resized}"
    );
    drop(agent);

    // Restarted with 16: the pinned maps (8) cannot grow, so they are replaced, with the
    // reason; the held ids stay held, and the new backend fits.
    let agent = start(&ns, &bin, dir, 2);
    let status: Value = agent.status_json().expect("lb status --json");
    let start_state = status["dataplane"]["start"].as_str().unwrap_or_default();
    assert!(
        start_state.contains(
            "pinned backend capacity is 8, this configuration asks for dataplane.max_backends = 16"
        ),
        "{start_state}"
    );
    assert_eq!(ids(&agent), (5, 4, 16), "{}", agent.status().unwrap());

    // Restarted again with the same size: adopted.
    drop(agent);
    let agent = start(&ns, &bin, dir, 3);
    let status: Value = agent.status_json().expect("lb status --json");
    let start_state = status["dataplane"]["start"].as_str().unwrap_or_default();
    assert!(start_state.starts_with("adopted"), "{start_state}");
    assert_eq!(ids(&agent).2, 16);
}
