//! End to end: `kind = "https"` checks (issue 35) against real TLS servers (`openssl
//! s_server`, another TLS stack than the agent's rustls) in the backends' namespaces,
//! through the real agent. With SNI and the CA file a backend with the right certificate
//! is up; one whose certificate another CA signed, or that is for another name, is down
//! with that reason in status; `verify = false` takes them all.
//!
//! The certificates are made by `openssl` for this test, in the lab's directory.
//! Needs root, bpffs, the eBPF object, a built `lb` and `openssl`; otherwise it prints
//! `SKIPPED` (or fails under `LB_REQUIRE_ALL_TESTS=1`).
//! `cargo test -p lb-tests --test https_checks`.

use std::fs::File;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use lb_tests::{
    BackendView, Health, Lab, LabOptions, Netns, Protocol, VipView, XdpMode, host, require_e2e,
};
use serde_json::Value;

const TLS_PORT: u16 = 8443;
const NAME: &str = "backend.test";
const WAIT: Duration = Duration::from_secs(15);

/// Runs `openssl` in `dir` with `args` (split at spaces; none has a space of its own).
fn openssl(dir: &Path, args: &str) -> Result<()> {
    let out = std::process::Command::new("openssl")
        .args(args.split_whitespace())
        .current_dir(dir)
        .output()
        .context("run openssl")?;
    if !out.status.success() {
        bail!("openssl {args}: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}

/// A new P-256 key (`-newkey` and its options).
const NEW_KEY: &str = "-newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes";

/// The test's CA (`ca.pem`, `ca.key` in `dir`).
fn make_ca(dir: &Path) -> Result<PathBuf> {
    openssl(
        dir,
        &format!(
            "req -x509 {NEW_KEY} -keyout ca.key -out ca.pem -days 2 -subj /CN=lb-test-ca \
             -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign"
        ),
    )?;
    Ok(dir.join("ca.pem"))
}

/// A key and a certificate for `name` in `dir` (`STEM.key`, `STEM.pem`): signed by the
/// CA in `ca.pem`/`ca.key` there, or self-signed. Returns the certificate and the key.
fn certificate(dir: &Path, stem: &str, name: &str, by_ca: bool) -> Result<(PathBuf, PathBuf)> {
    let san = format!("subjectAltName=DNS:{name}");
    if by_ca {
        std::fs::write(
            dir.join(format!("{stem}.ext")),
            format!("{san}\nextendedKeyUsage=serverAuth\n"),
        )?;
        openssl(
            dir,
            &format!("req -new {NEW_KEY} -keyout {stem}.key -out {stem}.csr -subj /CN={name}"),
        )?;
        openssl(
            dir,
            &format!(
                "x509 -req -in {stem}.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 \
                 -extfile {stem}.ext -out {stem}.pem"
            ),
        )?;
    } else {
        // Not a CA (openssl's default for -x509 is one): refused for its issuer, as a
        // server's own self-signed certificate is.
        openssl(
            dir,
            &format!(
                "req -x509 {NEW_KEY} -keyout {stem}.key -out {stem}.pem -days 2 \
                 -subj /CN={name} -addext {san} -addext basicConstraints=critical,CA:FALSE"
            ),
        )?;
    }
    Ok((
        dir.join(format!("{stem}.pem")),
        dir.join(format!("{stem}.key")),
    ))
}

/// `openssl s_server -www` in a backend's namespace: answers every request 200 over TLS.
struct TlsServer(Child);

impl TlsServer {
    fn start(ns: &Netns, cert: &Path, key: &Path, log: &Path) -> Result<TlsServer> {
        let log = File::create(log)?;
        let mut cmd = ns.daemon_command("openssl", &log, libc::SIGKILL)?;
        cmd.args(["s_server", "-quiet", "-www", "-4", "-accept"])
            .arg(TLS_PORT.to_string())
            .arg("-cert")
            .arg(cert)
            .arg("-key")
            .arg(key);
        Ok(TlsServer(cmd.spawn().context("start openssl s_server")?))
    }
}

impl Drop for TlsServer {
    fn drop(&mut self) {
        let _ = lb_tests::netns::terminate(&mut self.0, Duration::from_secs(2), "openssl s_server");
    }
}

/// Backend `address` of VIP `vip` in a parsed status.
fn backend(status: &Value, vip: &str, address: IpAddr) -> BackendView {
    let view = VipView::parse(status, vip).expect("the VIP in status");
    view.backend(address)
        .unwrap_or_else(|| panic!("no backend {address} of {vip} in:\n{status:#}"))
        .clone()
}

fn error_of(b: &BackendView) -> String {
    b.last_error.clone().unwrap_or_default()
}

fn https_check(extra: &[String]) -> Health {
    let mut lines = vec![
        "kind = \"https\"".to_string(),
        format!("port = {TLS_PORT}"),
        "path = \"/healthz\"".into(),
        "interval = \"400ms\"".into(),
        "timeout = \"300ms\"".into(),
        "rise = 2".into(),
        "fall = 2".into(),
    ];
    lines.extend_from_slice(extra);
    Health::Lines(lines)
}

#[test]
fn https_checks_verify_the_certificate_and_name_the_reason() {
    let test = "https_checks_verify_the_certificate_and_name_the_reason";
    let Some(bin) = require_e2e(test) else {
        return;
    };
    if !host::require_tool(test, host::OPENSSL) {
        return;
    }
    let mut lab = Lab::new(LabOptions::default()).expect("build the lab");
    let dir = lab.dir().join("tls");
    std::fs::create_dir_all(&dir).unwrap();
    let ca = make_ca(&dir).expect("make the CA");
    // backend-1: the CA's certificate for the name; backend-2: a self-signed one for the
    // name; backend-3: the CA's certificate for another name.
    let certs = [
        certificate(&dir, "good", NAME, true),
        certificate(&dir, "self-signed", NAME, false),
        certificate(&dir, "other-name", "other.test", true),
    ]
    .map(|made| made.expect("make a certificate"));
    let servers: Vec<TlsServer> = certs
        .iter()
        .enumerate()
        .map(|(i, (cert, key))| {
            TlsServer::start(
                lab.backend(i),
                cert,
                key,
                &dir.join(format!("s_server-{i}.log")),
            )
            .expect("openssl s_server")
        })
        .collect();

    let mut verified = lab.vip("verified", false, 80, Protocol::Tcp, Health::None);
    verified.health = https_check(&[
        format!("sni = \"{NAME}\""),
        format!("ca_file = \"{}\"", ca.display()),
    ]);
    let mut unverified = lab.vip("unverified", false, 81, Protocol::Tcp, Health::None);
    unverified.health = https_check(&["verify = false".to_string()]);
    let config = lab.agent_config(XdpMode::Native, vec![verified, unverified]);
    lab.start_agent(&bin, &config).expect("start the agent");
    let addr = |i: usize| lab.backend_addr(i, false);

    let s = lb_tests::wait_status(
        &lab,
        WAIT,
        "backend-1 up and the others down by the verified check, all up unverified",
        |s| {
            backend(s, "verified", addr(0)).health == "up"
                && backend(s, "verified", addr(1)).health == "down"
                && backend(s, "verified", addr(2)).health == "down"
                && (0..3).all(|i| backend(s, "unverified", addr(i)).health == "up")
        },
    );
    // What status says the check tests.
    let checks: Vec<&str> = s["vips"][0]["backends"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|b| b["check"].as_str())
        .collect();
    assert_eq!(
        checks,
        vec![format!("https port {TLS_PORT} /healthz (sni {NAME})"); 3],
        "{s:#}"
    );
    assert_eq!(
        error_of(&backend(&s, "verified", addr(1))),
        "certificate: UnknownIssuer"
    );
    let wrong_name = error_of(&backend(&s, "verified", addr(2)));
    assert!(
        wrong_name.starts_with(&format!("certificate: not valid for {NAME}"))
            && wrong_name.contains("other.test"),
        "{wrong_name}"
    );
    // The text status shows the reason too.
    let text = lab.agent().expect("agent").status().expect("status");
    assert!(text.contains("certificate: UnknownIssuer"), "{text}");
    drop(servers);
}
