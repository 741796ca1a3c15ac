//! End to end: what operators see. Metrics that match the traffic sent, exactly; the
//! status JSON's fields; `lb top` under a pseudo-terminal; and source-IP affinity against
//! per-connection hashing. `cargo test -p lb-tests --test observe`.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::time::Duration;

use lb_tests::{Lab, LabOptions, Protocol, XdpMode, require_e2e, spread, udp_spread};

const METRICS: &str = "127.0.0.1:9650";

/// A lab serving TCP 80 and UDP 53 on every backend, agent with metrics on loopback
/// (inside the balancer's namespace) and the VIPs `vips` makes.
fn lab_with(bin: &Path, vips: impl FnOnce(&Lab) -> Vec<lb_tests::VipConfig>) -> Lab {
    let mut lab = Lab::new(LabOptions::default()).expect("build the lab");
    lab.serve_tcp(80, false).expect("tcp servers");
    lab.serve_tcp(81, false).expect("tcp servers on 81");
    lab.serve_udp(53, false).expect("udp servers");
    let mut config = lab.agent_config(XdpMode::Native, vips(&lab));
    config.metrics = METRICS.into();
    lab.start_agent(bin, &config).expect("start the agent");
    lab
}

/// `GET /metrics` from inside the balancer's namespace, with `accept` as the Accept
/// header if given: the response's head and body, after checking it is a 200.
fn fetch(lab: &Lab, accept: Option<&str>) -> (String, String) {
    let accept = accept
        .map(|a| format!("Accept: {a}\r\n"))
        .unwrap_or_default();
    let request = format!("GET /metrics HTTP/1.0\r\nHost: lb\r\n{accept}\r\n");
    let text = lab
        .lb()
        .run(|| -> std::io::Result<String> {
            let mut stream = TcpStream::connect(METRICS)?;
            stream.set_read_timeout(Some(Duration::from_secs(5)))?;
            stream.write_all(request.as_bytes())?;
            let mut response = String::new();
            stream.read_to_string(&mut response)?;
            Ok(response)
        })
        .expect("enter the namespace")
        .expect("scrape /metrics");
    let (head, body) = text.split_once("\r\n\r\n").expect("an HTTP response");
    assert!(
        head.starts_with("HTTP/1.0 200") || head.starts_with("HTTP/1.1 200"),
        "{head}"
    );
    (head.to_lowercase(), body.to_string())
}

/// `GET /metrics` as a plain client (no Accept): the classic Prometheus text, parsed.
fn scrape(lab: &Lab) -> prometheus_parse::Scrape {
    let (head, body) = fetch(lab, None);
    assert!(
        head.contains("content-type: text/plain; version=0.0.4"),
        "{head}"
    );
    prometheus_parse::Scrape::parse(body.lines().map(|l| Ok(l.to_string())))
        .expect("parse the exposition")
}

/// A scrape taken once the forwarded packets' counters stopped moving (two scrapes half a
/// second apart agree): a connection's last packets may still be on their way when the
/// client returns, and the program counts a packet in two maps that a scrape does not
/// read at one instant (a run once saw 189 transmitted against 190 VIP packets).
fn settled_scrape(lab: &Lab) -> prometheus_parse::Scrape {
    let moving = |s: &prometheus_parse::Scrape| {
        let tx = value(s, "lb_xdp_actions_total", &[("action", "tx")]);
        let web = value(s, "lb_vip_packets_total", &[("vip", "web")]);
        (tx, web)
    };
    let mut last = scrape(lab);
    for _ in 0..20 {
        std::thread::sleep(Duration::from_millis(500));
        let next = scrape(lab);
        if moving(&next) == moving(&last) {
            return next;
        }
        last = next;
    }
    panic!("the counters kept moving for 10 s: {:?}", moving(&last));
}

fn value(scrape: &prometheus_parse::Scrape, metric: &str, labels: &[(&str, &str)]) -> f64 {
    let sample = scrape
        .samples
        .iter()
        .find(|s| s.metric == metric && labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
        .unwrap_or_else(|| panic!("no {metric}{labels:?}"));
    match sample.value {
        prometheus_parse::Value::Counter(v)
        | prometheus_parse::Value::Gauge(v)
        | prometheus_parse::Value::Untyped(v) => v,
        ref other => panic!("{metric}: unexpected {other:?}"),
    }
}

#[test]
fn metrics_count_exactly_the_packets_sent() {
    let Some(bin) = require_e2e("metrics_count_exactly_the_packets_sent") else {
        return;
    };
    let lab = lab_with(&bin, |lab| {
        vec![
            lab.vip("web", false, 80, Protocol::Tcp, lb_tests::Health::None),
            lab.vip("dns", false, 53, Protocol::Udp, lb_tests::Health::None),
        ]
    });
    // 40 UDP requests, each from a port of its own: exactly 40 packets, 40 new flows, to
    // the VIP.
    let n = 40;
    let udp = udp_spread(lab.client(), SocketAddr::new(lab.vip4(), 53), n).expect("udp requests");
    assert_eq!(udp.failures, 0, "{}", udp.table());
    let tcp = spread(lab.client(), SocketAddr::new(lab.vip4(), 80), 30).expect("tcp requests");
    assert_eq!(tcp.failures, 0, "{}", tcp.table());

    let scrape = settled_scrape(&lab);
    // A scraper that asks for OpenMetrics (Prometheus does) gets it.
    let (head, body) = fetch(&lab, Some("application/openmetrics-text; version=1.0.0"));
    assert!(
        head.contains("content-type: application/openmetrics-text"),
        "{head}"
    );
    assert!(body.ends_with("# EOF\n"), "{body}");
    assert!(body.contains("# TYPE lb_vip_packets counter"), "{body}");
    let dns = [("vip", "dns")];
    // Everything the data path counted, for the message if a count is off.
    let counted: Vec<String> = scrape
        .samples
        .iter()
        .filter(|s| s.metric.starts_with("lb_") && s.metric.ends_with("_total"))
        .map(|s| format!("{}{:?} = {:?}", s.metric, s.labels, s.value))
        .collect();
    assert_eq!(
        value(&scrape, "lb_vip_packets_total", &dns),
        n as f64,
        "{}",
        counted.join("\n")
    );
    assert_eq!(
        value(&scrape, "lb_vip_new_flows_total", &dns),
        n as f64,
        "{}",
        counted.join("\n")
    );
    let per_backend: f64 = (0..3)
        .map(|i| {
            let backend = lab.backend_addr(i, false).to_string();
            value(
                &scrape,
                "lb_backend_packets_total",
                &[("vip", "dns"), ("backend", &backend)],
            )
        })
        .sum();
    assert_eq!(
        per_backend, n as f64,
        "backends' packets add up to the VIP's"
    );
    for i in 0..3 {
        let backend = lab.backend_addr(i, false).to_string();
        let answered = udp.counts.get(&lab.backend_name(i)).copied().unwrap_or(0) as f64;
        let counted = value(
            &scrape,
            "lb_backend_packets_total",
            &[("vip", "dns"), ("backend", &backend)],
        );
        assert_eq!(
            counted, answered,
            "{backend}: metrics vs what the client saw"
        );
    }
    // 30 TCP connections: 30 SYNs, so 30 new flows; no non-SYN misses.
    assert_eq!(
        value(&scrape, "lb_vip_new_flows_total", &[("vip", "web")]),
        30.0
    );
    assert_eq!(
        value(&scrape, "lb_conntrack_misses_total", &[("kind", "non_syn")]),
        0.0
    );
    assert_eq!(
        value(&scrape, "lb_conntrack_misses_total", &[("kind", "syn")]),
        30.0
    );
    assert_eq!(
        value(&scrape, "lb_vip_healthy_backends", &[("vip", "web")]),
        3.0
    );
    let tx = value(&scrape, "lb_xdp_actions_total", &[("action", "tx")]);
    let vip_packets = value(&scrape, "lb_vip_packets_total", &[("vip", "web")]) + n as f64;
    assert_eq!(tx, vip_packets, "every forwarded packet belongs to a VIP");
}

#[test]
fn status_json_has_every_documented_field() {
    let Some(bin) = require_e2e("status_json_has_every_documented_field") else {
        return;
    };
    let vips = |lab: &Lab| {
        vec![
            lab.vip(
                "web",
                false,
                80,
                Protocol::Tcp,
                lb_tests::Health::fast_tcp(),
            ),
            lab.vip("web6", true, 80, Protocol::Tcp, lb_tests::Health::None),
        ]
    };
    let mut lab = lab_with(&bin, vips);
    lb_tests::wait_backends_up(
        lab.agent().unwrap(),
        "web",
        Duration::from_secs(10),
        &|| false,
    )
    .expect("backends up");
    let status = lab.agent().unwrap().status_json().expect("status --json");
    let dataplane = &status["dataplane"];
    assert_eq!(dataplane["interface"], "eth0");
    assert_eq!(dataplane["xdp_mode"], "native");
    assert!(
        dataplane["conntrack_entries"].is_u64() && dataplane["start"].is_string(),
        "{dataplane}"
    );
    // The clear names: entries in use (as `conntrack_entries`), and the capacity.
    assert_eq!(
        dataplane["conntrack_entries_in_use"], dataplane["conntrack_entries"],
        "{dataplane}"
    );
    assert!(
        dataplane["conntrack_capacity"].as_u64() > Some(0),
        "{dataplane}"
    );
    let vip = &status["vips"][0];
    for field in [
        "healthy_backends",
        "unhealthy_backends",
        "packets",
        "bytes",
        "new_flows",
    ] {
        assert!(vip[field].is_u64(), "vip.{field}: {vip}");
    }
    assert!(
        vip["busiest_over_average"].is_f64() && vip["top_sources"].is_array(),
        "{vip}"
    );
    for backend in vip["backends"].as_array().expect("backends") {
        for field in ["address", "state", "health", "mac"] {
            assert!(backend[field].is_string(), "backend.{field}: {backend}");
        }
        for field in [
            "weight",
            "active_flows",
            "packets",
            "bytes",
            "new_flows",
            "slots",
            "consecutive",
        ] {
            assert!(backend[field].is_u64(), "backend.{field}: {backend}");
        }
        let check = &backend["last_check"];
        assert!(
            check["ok"].is_boolean() && check["latency_ms"].is_f64(),
            "last_check: {check}"
        );
        assert!(
            check.get("error").is_some(),
            "last_check.error (null when ok): {check}"
        );
        assert_eq!(backend["health"], "up");
        assert_eq!(backend["state"], "ready");
    }
    assert!(status["counters"]["xdp_tx"].is_u64());

    // An IPv6 VIP is printed as the CLI takes it.
    let text = lab.agent().unwrap().status().expect("lb status");
    let web6 = format!("vip web6 [{}]:80/tcp", lab.vip6());
    assert!(text.contains(&web6), "no {web6:?} in:\n{text}");

    // The documented lists, both ways, against this real status and exposition.
    let (_, body) = fetch(&lab, None);
    documented_status_fields_match(&status);
    documented_metrics_match(&body);

    // Every metric the Grafana dashboard queries is in a real exposition (health checks
    // ran, so the histogram and the transitions have series).
    let exposed = series_names(&body);
    let dashboard: serde_json::Value =
        serde_json::from_str(include_str!("../../scripts/grafana-dashboard.json"))
            .expect("the dashboard is JSON");
    let queried = dashboard_metrics(&dashboard);
    assert!(queried.len() >= 15, "{queried:?}");
    for metric in &queried {
        assert!(
            exposed.contains(metric.as_str()),
            "the dashboard queries {metric}, which /metrics does not have:\n{body}"
        );
    }

    // A backend removed from the file (`lb reload`): its series leave /metrics.
    let gone = lab.backend_addr(2, false).to_string();
    assert!(body.contains(&format!("backend=\"{gone}\"")), "{body}");
    assert!(
        body.contains("lb_health_transitions_total{") && body.contains(&gone),
        "{body}"
    );
    let mut config = lab.agent_config(XdpMode::Native, vips(&lab));
    config.metrics = METRICS.into();
    config.vips[0].backends.truncate(2);
    let agent = lab.agent_mut().unwrap();
    std::fs::write(agent.config_path(), config.to_toml()).expect("rewrite the config");
    let out = agent.ctl(&["reload"]).expect("lb reload");
    assert!(
        out.contains(&format!("vip web: backend {gone} removed")),
        "{out}"
    );
    let (_, body) = fetch(&lab, None);
    let web_lines: Vec<&str> = body.lines().filter(|l| l.contains("vip=\"web\"")).collect();
    assert!(
        !web_lines.iter().any(|l| l.contains(&gone)),
        "/metrics still names the removed backend {gone}:\n{}",
        web_lines.join("\n")
    );
}

/// The names of the series in an exposition (`lb_x_bucket`, `lb_x_count` ...).
fn series_names(exposition: &str) -> std::collections::BTreeSet<&str> {
    exposition
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .collect()
}

/// The book's chapters that list the status JSON's fields (the list after the paragraph
/// that starts with `` `lb status --json` ``, one `- `path`: what` item per field) and the
/// metrics (the list under "Metric list"), from the workspace root.
const STATUS_FIELDS_DOC: &str = "docs/src/operations/seeing-what-happens.md";
const METRICS_DOC: &str = "docs/src/operations/metrics.md";

/// Names the list has that the status of this lab cannot show (the test checks they
/// are still named, and that nothing else is missing from the JSON).
const STATUS_ONLY_SOMETIMES: &[&str] = &[
    // Settings the list mentions, not fields.
    "hot_source_share",
    "rise",
    "fall",
    // Only for `forward = "gue"` VIPs.
    "gue_port",
    // A field of `hot_sources` entries: this lab has no hot source.
    "share",
    // Only with `[vip.agent]`, `[cluster]`, and `xdp_mode = "auto"` refused native.
    "agent_error",
    "cluster",
    "native_refused",
    // Only while a backend's agent check holds it drained, in maintenance or down.
    "state_reason",
    // Only with `dataplane.next_program` (tests/tests/neighbour.rs shows them).
    "path",
    "id",
    "caller",
];
/// Fields the agent has that the list does not name yet: the text for them is in the
/// Docs section of issue 39's report. Once listed, the test says to remove them here.
const NOT_YET_LISTED: &[&str] = &[];
/// Subtrees whose keys the list does not enumerate: the counters are the data path's
/// counter names, `node` and `cluster` have sections of their own.
const STATUS_SUBTREES_ELSEWHERE: &[&str] = &["counters", "node", "cluster"];

/// The `` `name` `` words (JSON-key or metric shaped) of `text`.
fn backticked_names(text: &str) -> std::collections::BTreeSet<String> {
    text.split('`')
        .skip(1)
        .step_by(2)
        .filter(|word| {
            !word.is_empty()
                && word
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '*')
        })
        .map(str::to_string)
        .collect()
}

/// The status list's items (`` - `vips[].backends[].address`: what ``): every key of
/// each item's path, the fields the list promises; and with them the key-shaped words
/// its descriptions quote (sub-fields such as `latency_ms`, and values), which count as
/// named but are not required to be in the JSON.
fn status_list_names(
    section: &str,
) -> (
    std::collections::BTreeSet<String>,
    std::collections::BTreeSet<String>,
) {
    let mut paths = std::collections::BTreeSet::new();
    for line in section.lines() {
        let Some(path) = line
            .strip_prefix("- `")
            .and_then(|rest| rest.split('`').next())
        else {
            continue;
        };
        for key in path.split('.') {
            paths.insert(key.trim_end_matches("[]").to_string());
        }
    }
    let mut named = backticked_names(section);
    named.extend(paths.iter().cloned());
    (paths, named)
}

/// The lines of `doc` (under the workspace root) from the first that `starts` to the
/// next heading.
fn doc_section(doc: &str, starts: impl Fn(&str) -> bool) -> String {
    let path = lb_tests::workspace_root().join(doc);
    let text =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    let section: Vec<&str> = text
        .lines()
        .skip_while(|l| !starts(l))
        .take_while({
            let mut first = true;
            move |l| std::mem::take(&mut first) || !l.starts_with('#')
        })
        .collect();
    assert!(
        !section.is_empty(),
        "{}: the section the test reads is gone",
        path.display()
    );
    section.join("\n")
}

/// Every key of `value`'s objects, at any depth, but inside `STATUS_SUBTREES_ELSEWHERE`.
fn json_keys(value: &serde_json::Value, out: &mut std::collections::BTreeSet<String>) {
    match value {
        serde_json::Value::Object(map) => {
            for (key, v) in map {
                out.insert(key.clone());
                if !STATUS_SUBTREES_ELSEWHERE.contains(&key.as_str()) {
                    json_keys(v, out);
                }
            }
        }
        serde_json::Value::Array(items) => items.iter().for_each(|v| json_keys(v, out)),
        _ => {}
    }
}

/// The status fields the documentation lists are in `status`, and every field of
/// `status` is listed.
fn documented_status_fields_match(status: &serde_json::Value) {
    let section = doc_section(STATUS_FIELDS_DOC, |l| l.starts_with("`lb status --json`"));
    let (listed, named) = status_list_names(&section);
    let mut present = std::collections::BTreeSet::new();
    json_keys(status, &mut present);
    let unlisted: Vec<&String> = present
        .difference(&named)
        .filter(|name| !NOT_YET_LISTED.contains(&name.as_str()))
        .collect();
    let absent: Vec<&String> = listed
        .difference(&present)
        .filter(|name| !STATUS_ONLY_SOMETIMES.contains(&name.as_str()))
        .collect();
    assert!(
        unlisted.is_empty() && absent.is_empty(),
        "{STATUS_FIELDS_DOC}'s list of status fields and lb status --json differ:\n  in the \
         JSON, not listed: {unlisted:?}\n  listed, not in the JSON: {absent:?}\nstatus:\n\
         {status:#}"
    );
    for name in STATUS_ONLY_SOMETIMES {
        assert!(
            named.contains(*name),
            "{name} is no longer listed: drop it from STATUS_ONLY_SOMETIMES"
        );
    }
    for name in NOT_YET_LISTED {
        assert!(
            !named.contains(*name),
            "{name} is listed now: drop it from NOT_YET_LISTED"
        );
    }
}

/// Metrics the agent exposes that the table does not list yet (the Docs section of
/// issue 39's report has their row). Once listed, the test says to remove them here.
const METRICS_NOT_YET_LISTED: &[&str] = &[];

/// The metrics the documentation's table lists are in the exposition `body`, and every
/// `lb_` metric of it is listed (`lb_cluster_*` stands for the cluster's, which need a
/// `[cluster]`).
fn documented_metrics_match(body: &str) {
    let section = doc_section(METRICS_DOC, |l| l == "## Metric list");
    let listed = backticked_names(&section);
    let listed: std::collections::BTreeSet<&str> = listed
        .iter()
        .map(String::as_str)
        .filter(|name| name.starts_with("lb_"))
        .collect();
    let prefixes: Vec<&str> = listed.iter().filter_map(|n| n.strip_suffix('*')).collect();
    // A histogram's series carry suffixes; the family is what is listed.
    let family = |series: &str| {
        ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|suffix| series.strip_suffix(suffix))
            .filter(|base| listed.contains(base))
            .unwrap_or(series)
            .to_string()
    };
    let exposed: std::collections::BTreeSet<String> = series_names(body)
        .into_iter()
        .filter(|n| n.starts_with("lb_"))
        .map(family)
        .collect();
    let unlisted: Vec<&String> = exposed
        .iter()
        .filter(|n| !listed.contains(n.as_str()) && !prefixes.iter().any(|p| n.starts_with(p)))
        .filter(|n| !METRICS_NOT_YET_LISTED.contains(&n.as_str()))
        .collect();
    let absent: Vec<&&str> = listed
        .iter()
        // The cluster's metrics need a `[cluster]`, which this lab has not; the next
        // program's, a `next_program` (tests/tests/neighbour.rs and metrics.rs's tests).
        .filter(|n| !n.ends_with('*') && !n.starts_with("lb_cluster_") && !exposed.contains(**n))
        .filter(|n| **n != "lb_next_program_info")
        .collect();
    assert!(
        unlisted.is_empty() && absent.is_empty(),
        "{METRICS_DOC}'s metrics table and /metrics differ:\n  exposed, not listed: \
         {unlisted:?}\n  listed, not exposed: {absent:?}"
    );
    for name in METRICS_NOT_YET_LISTED {
        assert!(
            !listed.contains(*name),
            "{name} is listed now: drop it from METRICS_NOT_YET_LISTED"
        );
    }
}

/// Every `lb_...` name in the dashboard's queries (panel targets and variables).
fn dashboard_metrics(dashboard: &serde_json::Value) -> std::collections::BTreeSet<String> {
    fn walk(value: &serde_json::Value, out: &mut std::collections::BTreeSet<String>) {
        match value {
            serde_json::Value::Object(map) => {
                for (key, v) in map {
                    if let (true, Some(text)) = (
                        ["expr", "definition", "query"].contains(&key.as_str()),
                        v.as_str(),
                    ) {
                        let mut rest = text;
                        while let Some(at) = rest.find("lb_") {
                            let name: String = rest[at..]
                                .chars()
                                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                                .collect();
                            rest = &rest[at + name.len()..];
                            out.insert(name);
                        }
                    }
                    walk(v, out);
                }
            }
            serde_json::Value::Array(items) => items.iter().for_each(|v| walk(v, out)),
            _ => {}
        }
    }
    let mut out = std::collections::BTreeSet::new();
    walk(dashboard, &mut out);
    out
}

#[test]
fn top_redraws_under_a_pseudo_terminal() {
    let test = "top_redraws_under_a_pseudo_terminal";
    let Some(bin) = require_e2e(test) else {
        return;
    };
    if !lb_tests::host::require_tool(test, lb_tests::host::SCRIPT) {
        return;
    }
    let lab = lab_with(&bin, |lab| {
        vec![lab.vip("web", false, 80, Protocol::Tcp, lb_tests::Health::None)]
    });
    let tcp = spread(lab.client(), SocketAddr::new(lab.vip4(), 80), 20).expect("tcp requests");
    assert_eq!(tcp.failures, 0);
    // `script` gives `lb top` a pseudo-terminal, so it redraws in place.
    let command = format!(
        "{} top --socket {} --count 2 --interval 0.3",
        bin.display(),
        lab.socket_path().display()
    );
    let out = std::process::Command::new("script")
        .args(["-qec", &command, "/dev/null"])
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run script");
    let screen = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "lb top failed: {screen}");
    // A first screen that says it is measuring (the first rates need two samples),
    // then the two redraws asked for.
    assert!(
        screen.contains("lb top: measuring rates over 300ms"),
        "{screen:?}"
    );
    assert_eq!(
        screen.matches("\x1b[H\x1b[2J").count(),
        3,
        "the measuring screen and two redraws: {screen:?}"
    );
    assert_eq!(
        screen.matches("web 10.99.0.100:80/tcp").count(),
        2,
        "{screen}"
    );
    for i in 0..3 {
        assert!(
            screen.contains(&lab.backend_addr(i, false).to_string()),
            "{screen}"
        );
    }
}

#[test]
fn src_ip_affinity_pins_a_client_and_5_tuple_spreads_it() {
    let Some(bin) = require_e2e("src_ip_affinity_pins_a_client_and_5_tuple_spreads_it") else {
        return;
    };
    let lab = lab_with(&bin, |lab| {
        let mut sticky = lab.vip("sticky", false, 81, Protocol::Tcp, lb_tests::Health::None);
        sticky.hash = Some("src-ip".into());
        vec![
            lab.vip("web", false, 80, Protocol::Tcp, lb_tests::Health::None),
            sticky,
        ]
    });
    let per_connection = spread(lab.client(), SocketAddr::new(lab.vip4(), 80), 60).unwrap();
    let sticky = spread(lab.client(), SocketAddr::new(lab.vip4(), 81), 60).unwrap();
    assert_eq!(per_connection.failures + sticky.failures, 0);
    assert_eq!(
        per_connection.counts.len(),
        3,
        "5-tuple spreads one client: {}",
        per_connection.table()
    );
    assert_eq!(
        sticky.counts.len(),
        1,
        "src-ip keeps one client on one backend: {}",
        sticky.table()
    );
}
