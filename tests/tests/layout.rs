//! Tier 1 (no root): the layout of what lb pins, tied to `lb_common::LAYOUT_VERSION`.
//!
//! A restarted agent adopts the pinned maps when `LB_META` records its own
//! `LAYOUT_VERSION` (and sizes): a map whose key, value or meaning changed without a bump
//! would be read with the wrong layout, silently. This test writes down the layout as the
//! production object and lb-common define it:
//! - every map a restarted agent adopts (`PINNED_MAPS`), as the production object defines
//!   it: name, type, key and value sizes, max entries, flags (parsed by aya-obj, as
//!   `objects.rs` does);
//! - the field types, in order, of every `#[repr(C)]` type in lb-common (map memory);
//! - the counter names in `stat` order and the `meta` indices (what an index means);
//!
//! and compares it with `golden/layout-<LAYOUT_VERSION>.txt`. A change without a bump
//! fails here; after a bump, `LB_BLESS_LAYOUT=1` records the new version's file, and
//! never overwrites the file of an existing version.

use std::fmt::Write as _;
use std::path::PathBuf;

use lb_common::{LAYOUT_VERSION, meta, stat};
use lb_userspace::dataplane::PINNED_MAPS;

const LIB_SOURCE: &str = include_str!("../../lb-common/src/lib.rs");

fn golden_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(format!("layout-{LAYOUT_VERSION}.txt"))
}

/// One line per pinned map of `object`, sorted by name.
fn maps(object: &[u8]) -> String {
    let parsed = aya_obj::Object::parse(object).expect("parse the production object");
    let mut maps: Vec<_> = parsed
        .maps
        .iter()
        .filter(|(name, _)| PINNED_MAPS.contains(&name.as_str()))
        .collect();
    assert_eq!(
        maps.len(),
        PINNED_MAPS.len(),
        "a pinned map is not in the production object"
    );
    maps.sort_by(|a, b| a.0.cmp(b.0));
    let mut out = String::new();
    for (name, map) in maps {
        let _ = writeln!(
            out,
            "map {name} type {} key {} value {} max_entries {} flags {:#x}",
            map.map_type(),
            map.key_size(),
            map.value_size(),
            map.max_entries(),
            map.map_flags()
        );
    }
    out
}

/// `source` without `//` comments (doc comments included), lines trimmed.
fn code_lines(source: &str) -> Vec<&str> {
    source
        .lines()
        .map(|line| line.split("//").next().unwrap_or("").trim())
        .filter(|line| !line.is_empty())
        .collect()
}

/// `struct Name: type, type, ...` for every `#[repr(C...)]` struct of `source`: the
/// field types in order (names left out: a rename changes no byte).
fn repr_c_structs(source: &str) -> String {
    let lines = code_lines(source);
    let mut out = String::new();
    let mut i = 0;
    while i < lines.len() {
        if !lines[i].starts_with("#[repr(C") {
            i += 1;
            continue;
        }
        // Past the attributes to `pub struct Name {`.
        while i < lines.len() && !lines[i].contains("struct ") {
            i += 1;
        }
        let Some(header) = lines.get(i) else { break };
        let name = header
            .split("struct ")
            .nth(1)
            .and_then(|rest| rest.split([' ', '{']).next())
            .unwrap_or("?");
        let mut types = Vec::new();
        i += 1;
        while i < lines.len() && !lines[i].starts_with('}') {
            if let Some((_, ty)) = lines[i].split_once(':') {
                types.push(ty.trim().trim_end_matches(',').to_string());
            }
            i += 1;
        }
        let _ = writeln!(out, "struct {name}: {}", types.join(", "));
    }
    out
}

/// What each counter index and `LB_META` index means.
fn indices() -> String {
    let mut out = String::new();
    for (i, name) in stat::NAMES.iter().enumerate() {
        let _ = writeln!(out, "stat {i} {name}");
    }
    let meta = [
        ("LAYOUT", meta::LAYOUT as u64),
        ("MAGLEV_SIZE", meta::MAGLEV_SIZE as u64),
        ("VIP_CAPACITY", meta::VIP_CAPACITY as u64),
        ("CONNTRACK_ENTRIES", meta::CONNTRACK_ENTRIES as u64),
        ("XDP_MODE", meta::XDP_MODE as u64),
        ("IFINDEX", meta::IFINDEX as u64),
        ("COUNT", meta::COUNT as u64),
        ("MODE_NATIVE", meta::MODE_NATIVE),
        ("MODE_GENERIC", meta::MODE_GENERIC),
    ];
    for (name, value) in meta {
        let _ = writeln!(out, "meta {name} {value}");
    }
    out
}

fn layout() -> String {
    format!(
        "{}{}{}",
        maps(lb_userspace::EBPF_OBJECT),
        repr_c_structs(LIB_SOURCE),
        indices()
    )
}

#[test]
fn a_layout_change_comes_with_a_layout_version_bump() {
    let test = "a_layout_change_comes_with_a_layout_version_bump";
    if lb_userspace::EBPF_OBJECT.is_empty() {
        return lb_tests::skip(
            test,
            "the eBPF objects are empty (built with AYA_BUILD_SKIP=1)",
        );
    }
    let now = layout();
    let path = golden_path();
    let golden = match std::fs::read_to_string(&path) {
        Ok(golden) => golden,
        Err(_) if std::env::var("LB_BLESS_LAYOUT").is_ok_and(|v| v == "1") => {
            std::fs::write(&path, &now).expect("record the layout");
            eprintln!("recorded {}", path.display());
            return;
        }
        Err(e) => panic!(
            "no recorded layout for LAYOUT_VERSION {LAYOUT_VERSION} ({}: {e}): a new version \
             is recorded with LB_BLESS_LAYOUT=1 cargo test -p lb-tests --test layout",
            path.display()
        ),
    };
    let changed: Vec<String> = diff(&golden, &now);
    assert!(
        changed.is_empty(),
        "the pinned layout differs from the one recorded for LAYOUT_VERSION \
         {LAYOUT_VERSION} ({}):\n{}\nA restarted agent would adopt the old maps with the new \
         meaning. Bump lb_common::LAYOUT_VERSION, then record the new version's layout \
         with LB_BLESS_LAYOUT=1 (the file of an existing version is never rewritten).",
        path.display(),
        changed.join("\n")
    );
}

/// Lines only in `old` (`-`) and only in `new` (`+`).
fn diff(old: &str, new: &str) -> Vec<String> {
    let (old, new): (Vec<&str>, Vec<&str>) = (old.lines().collect(), new.lines().collect());
    let gone = old
        .iter()
        .filter(|l| !new.contains(l))
        .map(|l| format!("- {l}"));
    let came = new
        .iter()
        .filter(|l| !old.contains(l))
        .map(|l| format!("+ {l}"));
    let mut out: Vec<String> = gone.chain(came).collect();
    if out.is_empty() && old != new {
        out.push("(the same lines in another order)".into());
    }
    out
}

#[test]
fn the_layout_reader_sees_fields_in_order_and_ignores_comments() {
    let source = "/// Doc.\n#[repr(C, align(4))]\n#[derive(Clone)]\npub struct A {\n    \
                  /// The address.\n    pub addr: [u8; 16], // network order\n    pub port: u16,\n}\n\
                  pub struct NotMapMemory {\n    pub x: u64,\n}\n";
    assert_eq!(repr_c_structs(source), "struct A: [u8; 16], u16\n");
    let swapped = source.replace(
        "pub addr: [u8; 16], // network order\n    pub port: u16,",
        "pub port: u16,\n    pub addr: [u8; 16],",
    );
    assert_ne!(repr_c_structs(&swapped), repr_c_structs(source));
}
