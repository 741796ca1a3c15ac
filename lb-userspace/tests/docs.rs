//! The documentation against the code: the configuration reference
//! (`docs/src/configuration.md`) lists exactly the keys the configuration parser accepts,
//! and every relative link and anchor in the README and the book resolves.
//!
//! The keys the parser accepts are asked of the parser itself: every table of the
//! configuration refuses unknown keys (`deny_unknown_fields`), and serde's refusal lists
//! the fields the table has. So nothing here repeats the configuration types, and a key
//! added to them without a line in the reference fails this test.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
};

use lb_userspace::config::Config;
use toml::{Table, Value};

/// A key no table has: the parser refuses it and names the fields it knows instead.
const PROBE: &str = "zz_not_a_key";

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The smallest file the parser takes, with a VIP, its health table and a backend, so
/// that the tables below them can be reached.
const MINIMAL: &str = r#"
[dataplane]
interface = "eth0"

[[vip]]
name = "web"
address = "10.0.0.100"
port = 80
protocol = "tcp"

[vip.health]
kind = "tcp"

[[vip.backend]]
address = "10.0.0.11"
"#;

/// The table at `path` in `root` (the first element of an array of tables), created
/// empty where missing.
fn table_at<'a>(root: &'a mut Table, path: &[String]) -> &'a mut Table {
    let mut table = root;
    for name in path {
        let value = table
            .entry(name.clone())
            .or_insert_with(|| Value::Table(Table::new()));
        table = match value {
            Value::Table(t) => t,
            Value::Array(items) => match items.first_mut() {
                Some(Value::Table(t)) => t,
                _ => panic!("{name}: not an array of tables"),
            },
            _ => panic!("{name}: not a table"),
        };
    }
    table
}

/// What the parser says about `root` (None: it took it).
fn parse_error(root: &Table) -> Option<String> {
    let text = toml::to_string(root).unwrap();
    toml::from_str::<Config>(&text).err().map(|e| e.to_string())
}

/// The fields serde names after refusing the probe key, if it refused it.
fn fields_named(error: &str) -> Option<Vec<String>> {
    let rest = error.split(&format!("unknown field `{PROBE}`")).nth(1)?;
    let rest = rest.lines().next().unwrap_or("");
    Some(
        rest.split('`')
            .skip(1)
            .step_by(2)
            .map(String::from)
            .collect(),
    )
}

/// Every table the parser accepts (dotted path, "" for the top) with its keys, found by
/// probing from `root`: a field that refuses the probe key when written as a table (or
/// as an array of tables) is a table itself.
fn accepted(root: &Table, path: Vec<String>, out: &mut BTreeMap<String, BTreeSet<String>>) {
    let mut probed = root.clone();
    table_at(&mut probed, &path).insert(PROBE.into(), Value::Integer(1));
    let error = parse_error(&probed).expect("the probe key is refused");
    let fields = fields_named(&error)
        .unwrap_or_else(|| panic!("`{}`: no list of fields in: {error}", path.join(".")));
    let mut leaves = BTreeSet::new();
    for field in fields {
        let mut inner = path.clone();
        inner.push(field.clone());
        // Present in the minimal file: its tables are tables, the rest values.
        match table_at(&mut root.clone(), &path).get(&field) {
            Some(Value::Table(_) | Value::Array(_)) => {
                accepted(root, inner, out);
                continue;
            }
            Some(_) => {
                leaves.insert(field);
                continue;
            }
            None => {}
        }
        let probe = Table::from_iter([(PROBE.to_string(), Value::Integer(1))]);
        let shapes = [
            Value::Table(probe.clone()),
            Value::Array(vec![Value::Table(probe)]),
        ];
        let table_shape = shapes
            .into_iter()
            .find(|shape| is_table(root, &path, &field, shape.clone()));
        match table_shape {
            Some(shape) => {
                // Recurse with an empty table (or array of one) of that shape in place.
                let mut grown = root.clone();
                let empty = match shape {
                    Value::Table(_) => Value::Table(Table::new()),
                    _ => Value::Array(vec![Value::Table(Table::new())]),
                };
                table_at(&mut grown, &path).insert(field.clone(), empty);
                accepted(&grown, inner, out);
            }
            None => {
                leaves.insert(field);
            }
        }
    }
    out.insert(path.join("."), leaves);
}

/// Whether `field` of the table at `path` is a table: written as `shape` (holding the
/// probe key), the parser refuses the probe key.
fn is_table(root: &Table, path: &[String], field: &str, shape: Value) -> bool {
    let mut probed = root.clone();
    table_at(&mut probed, path).insert(field.into(), shape);
    parse_error(&probed).is_some_and(|e| fields_named(&e).is_some())
}

/// The ```toml blocks of a Markdown text.
fn toml_blocks(markdown: &str) -> Vec<String> {
    let mut blocks = Vec::new();
    let mut current: Option<String> = None;
    for line in markdown.lines() {
        match (&mut current, line.trim_start()) {
            (None, l) if l.starts_with("```toml") => current = Some(String::new()),
            (Some(_), l) if l.starts_with("```") => blocks.push(current.take().unwrap()),
            (Some(block), _) => {
                block.push_str(line);
                block.push('\n');
            }
            _ => {}
        }
    }
    blocks
}

/// Tables and keys a reference block names, commented out or not: `[a.b]` and
/// `[[a.b]]` headers (also after `# `), `key = ...` lines under them, and a comment
/// saying a table has "the keys of [x.y]" (a table of the same type, listed before).
fn documented(blocks: &[String]) -> BTreeMap<String, BTreeSet<String>> {
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    out.entry(String::new()).or_default();
    for block in blocks {
        let mut table = String::new();
        for line in block.lines() {
            let line = line.trim_start();
            let line = line.strip_prefix('#').unwrap_or(line).trim_start();
            if let Some(same) = line.split("the keys of [").nth(1) {
                let other = &same[..same.find(']').expect("a closed table name")];
                let keys = out.get(other).cloned().unwrap_or_default();
                out.entry(table.clone()).or_default().extend(keys);
                continue;
            }
            if let Some(header) = line.strip_prefix('[') {
                let name = header.trim_start_matches('[');
                let name = &name[..name.find(']').expect("a closed header")];
                table = name.trim().to_string();
                out.entry(table.clone()).or_default();
                continue;
            }
            let Some((key, _)) = line.split_once('=') else {
                continue;
            };
            let key = key.trim();
            if !key.is_empty()
                && key
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
            {
                out.entry(table.clone())
                    .or_default()
                    .insert(key.to_string());
            }
        }
    }
    out
}

#[test]
fn the_configuration_reference_names_exactly_the_keys_the_parser_accepts() {
    let root: Table = toml::from_str(MINIMAL).unwrap();
    toml::from_str::<Config>(MINIMAL).expect("the minimal file parses");
    let mut parser = BTreeMap::new();
    accepted(&root, Vec::new(), &mut parser);
    // The top level's own entries are its tables; the reference has them as headers.
    let tables: BTreeSet<String> = parser.keys().filter(|t| !t.is_empty()).cloned().collect();
    let mut parser_keys: BTreeSet<(String, String)> = BTreeSet::new();
    for (table, keys) in &parser {
        for key in keys {
            parser_keys.insert((table.clone(), key.clone()));
        }
    }
    assert!(
        tables.contains("vip.backend.health") && tables.contains("dataplane"),
        "the probe found the nested tables: {tables:?}"
    );

    let reference = read(&workspace().join("docs/src/configuration.md"));
    let doc = documented(&toml_blocks(&reference));
    let doc_tables: BTreeSet<String> = doc.keys().filter(|t| !t.is_empty()).cloned().collect();
    let mut doc_keys: BTreeSet<(String, String)> = BTreeSet::new();
    for (table, keys) in &doc {
        for key in keys {
            doc_keys.insert((table.clone(), key.clone()));
        }
    }
    let missing: Vec<_> = parser_keys.difference(&doc_keys).collect();
    assert!(
        missing.is_empty(),
        "keys the parser accepts that docs/src/configuration.md does not list (table, key): \
         {missing:?}"
    );
    let unknown: Vec<_> = doc_keys.difference(&parser_keys).collect();
    assert!(
        unknown.is_empty(),
        "keys docs/src/configuration.md lists that the parser refuses (table, key): {unknown:?}"
    );
    assert_eq!(
        doc_tables, tables,
        "the tables of the reference vs the parser's"
    );
}

/// The reference's first block, the README's minimal configuration and the example
/// file are whole configurations that `lb check` takes.
#[test]
fn the_documented_configurations_pass_the_checks() {
    let reference = read(&workspace().join("docs/src/configuration.md"));
    let first = &toml_blocks(&reference)[0];
    Config::from_toml(first).unwrap_or_else(|e| panic!("the reference's first block: {e}"));
    let readme = read(&workspace().join("README.md"));
    let minimal = &toml_blocks(&readme)[0];
    Config::from_toml(minimal).unwrap_or_else(|e| panic!("the README's configuration: {e}"));
    let example = read(&workspace().join("scripts/lb.toml"));
    Config::from_toml(&example).unwrap_or_else(|e| panic!("scripts/lb.toml: {e}"));
}

/// The example file names every kind of health check the parser knows (asked of the
/// parser: an unknown kind is refused with the list).
#[test]
fn the_example_file_lists_every_health_check_kind() {
    let text = MINIMAL.replace(r#"kind = "tcp""#, r#"kind = "zz_no_kind""#);
    let error = toml::from_str::<Config>(&text).expect_err("an unknown kind is refused");
    let error = error.to_string();
    let kinds: Vec<&str> = error
        .split("unknown variant `zz_no_kind`, expected ")
        .nth(1)
        .and_then(|rest| rest.lines().next())
        .unwrap_or_else(|| panic!("no list of kinds in: {error}"))
        .split('`')
        .skip(1)
        .step_by(2)
        .collect();
    assert!(kinds.contains(&"dns"), "{kinds:?}");
    let example = read(&workspace().join("scripts/lb.toml"));
    for kind in kinds {
        assert!(
            example.contains(&format!("\"{kind}\"")),
            "scripts/lb.toml does not list the health check kind {kind:?}"
        );
    }
}

/// Every Markdown file of the book, and the README.
fn markdown_files() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap().flatten() {
            let path = entry.path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|e| e == "md") {
                out.push(path);
            }
        }
    }
    let mut files = vec![workspace().join("README.md")];
    walk(&workspace().join("docs/src"), &mut files);
    files.sort();
    files
}

/// The text outside code blocks and inline code, line by line.
fn prose(markdown: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut fenced = false;
    for line in markdown.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        // Drop inline code spans: a link inside one is an example, not a link.
        let kept: String = line
            .split('`')
            .enumerate()
            .filter(|(i, _)| i % 2 == 0)
            .map(|(_, s)| s)
            .collect::<Vec<_>>()
            .join("");
        out.push(kept);
    }
    out
}

/// The anchors mdBook gives a file's headings: the heading's text, lower case, spaces
/// as `-`, other punctuation dropped; repeats get `-1`, `-2`, ...
fn anchors(markdown: &str) -> BTreeSet<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut out = BTreeSet::new();
    let mut fenced = false;
    for line in markdown.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        }
        if fenced || !line.starts_with('#') {
            continue;
        }
        let text = line.trim_start_matches('#').trim();
        let text = strip_links(text);
        let id: String = text
            .chars()
            .filter_map(|c| {
                if c.is_alphanumeric() || c == '_' || c == '-' {
                    Some(c.to_ascii_lowercase())
                } else if c.is_whitespace() {
                    Some('-')
                } else {
                    None
                }
            })
            .collect();
        let n = seen.entry(id.clone()).or_insert(0);
        out.insert(if *n == 0 {
            id.clone()
        } else {
            format!("{id}-{n}")
        });
        *n += 1;
    }
    out
}

/// `[text](target)` as `text`.
fn strip_links(text: &str) -> String {
    let mut out = text.to_string();
    while let Some(open) = out.find("](") {
        let Some(close) = out[open..].find(')') else {
            break;
        };
        out.replace_range(open..open + close + 1, "");
        if let Some(bracket) = out[..open].rfind('[') {
            out.remove(bracket);
        }
    }
    out
}

/// The targets of the inline links `[text](target)` in a line.
fn link_targets(line: &str) -> Vec<String> {
    line.split("](")
        .skip(1)
        .filter_map(|rest| rest.split_once(')').map(|(target, _)| target.to_string()))
        .filter(|t| !t.contains(' '))
        .collect()
}

#[test]
fn every_relative_link_and_anchor_in_the_docs_resolves() {
    let mut broken = Vec::new();
    let mut checked = 0;
    for file in markdown_files() {
        let text = read(&file);
        for line in prose(&text) {
            for target in link_targets(&line) {
                if target.contains("://") || target.starts_with("mailto:") {
                    continue;
                }
                checked += 1;
                let (path, anchor) = target.split_once('#').unwrap_or((&target, ""));
                let linked = if path.is_empty() {
                    file.clone()
                } else {
                    file.parent().unwrap().join(path)
                };
                if !linked.exists() {
                    broken.push(format!("{}: {target}: no such file", file.display()));
                    continue;
                }
                if !anchor.is_empty() && !anchors(&read(&linked)).contains(anchor) {
                    broken.push(format!("{}: {target}: no such heading", file.display()));
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
    assert!(
        checked > 20,
        "only {checked} links found: is the parser right?"
    );
}

#[test]
fn the_summary_lists_every_chapter() {
    let src = workspace().join("docs/src");
    let summary = read(&src.join("SUMMARY.md"));
    let listed: BTreeSet<PathBuf> = prose(&summary)
        .iter()
        .flat_map(|l| link_targets(l))
        .map(|t| src.join(t))
        .collect();
    let files: BTreeSet<PathBuf> = markdown_files()
        .into_iter()
        .filter(|f| f.starts_with(&src) && !f.ends_with("SUMMARY.md"))
        .collect();
    assert_eq!(
        listed, files,
        "docs/src/SUMMARY.md vs the files in docs/src"
    );
}

#[test]
fn the_anchor_rule_is_mdbooks() {
    let ids = anchors("# Sharing flows between nodes: `[cluster]`\n## A b\n## A b\n");
    assert!(
        ids.contains("sharing-flows-between-nodes-cluster"),
        "{ids:?}"
    );
    assert!(ids.contains("a-b") && ids.contains("a-b-1"), "{ids:?}");
    assert_eq!(
        link_targets("see [x](a.md#b) and [y](c.md)"),
        ["a.md#b", "c.md"]
    );
}
