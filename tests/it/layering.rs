//! The module layering, checked on the source: the daemon crate does not
//! depend on the simulator, `config` is the ground (it names no other module
//! of the crate), and the modules of `io` import each other without a circle.
//! A change that breaks any fails here, naming the file and the import.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The `.rs` files under `dir`, recursively, sorted.
fn sources(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

/// The code of a file outside comments and its `#[cfg(test)]` modules
/// (which sit at the end of a file, by the house style).
fn code(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap();
    let text = text.split("#[cfg(test)]").next().unwrap_or_default();
    text.lines().filter(|l| !l.trim_start().starts_with("//")).collect::<Vec<_>>().join("\n")
}

/// Every `prefix` + identifier in `text`: the identifiers.
fn paths_after<'a>(text: &'a str, prefix: &str) -> Vec<&'a str> {
    text.match_indices(prefix)
        .map(|(i, _)| {
            let rest = &text[i + prefix.len()..];
            let end = rest.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(rest.len());
            &rest[..end]
        })
        .filter(|name| !name.is_empty())
        .collect()
}

/// The daemon crate (crates/daemon).
fn daemon() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("crates/daemon")
}

/// The daemon's sources.
fn src() -> PathBuf {
    daemon().join("src")
}

#[test]
fn config_imports_no_module_above_it() {
    let mut above = Vec::new();
    for file in sources(&src().join("config")) {
        for module in paths_after(&code(&file), "crate::") {
            if module != "config" {
                above.push(format!("{}: crate::{module}", file.strip_prefix(src()).unwrap().display()));
            }
        }
    }
    assert!(above.is_empty(), "config must stand on nothing else of the crate:\n{}", above.join("\n"));
}

/// The module of `io` a file is (`sockets` for `io/sockets.rs` and for
/// `io/sockets/*.rs`), `None` for `io/mod.rs`.
fn io_module(file: &Path) -> Option<String> {
    let rel = file.strip_prefix(src().join("io")).unwrap();
    let first = rel.components().next()?.as_os_str().to_str()?;
    let name = first.strip_suffix(".rs").unwrap_or(first);
    (name != "mod").then(|| name.to_owned())
}

#[test]
fn the_io_modules_import_each_other_without_a_circle() {
    let files = sources(&src().join("io"));
    let modules: Vec<String> = files.iter().filter_map(|f| io_module(f)).collect();
    let mut edges: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for file in &files {
        let Some(from) = io_module(file) else { continue };
        let text = code(file);
        let mut names = paths_after(&text, "crate::io::");
        // `super::x` in a file of io/ or in io/m/mod.rs names io's x; in
        // io/m/other.rs it names m's own.
        let dir = if file.ends_with("mod.rs") { file.parent().and_then(Path::parent) } else { file.parent() };
        if dir == Some(&src().join("io")) {
            names.extend(paths_after(&text, "super::"));
        }
        let to = edges.entry(from.clone()).or_default();
        for name in names {
            if name != from && modules.iter().any(|m| m == name) && !to.iter().any(|t| t == name) {
                to.push(name.to_owned());
            }
        }
    }
    // Depth-first, keeping the path: a module met again on it closes a circle.
    fn visit(
        m: &str,
        edges: &BTreeMap<String, Vec<String>>,
        path: &mut Vec<String>,
        done: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|p| p == m) {
            let mut circle = path[at..].to_vec();
            circle.push(m.to_owned());
            return Some(circle);
        }
        if done.iter().any(|d| d == m) {
            return None;
        }
        path.push(m.to_owned());
        for next in edges.get(m).into_iter().flatten() {
            if let Some(circle) = visit(next, edges, path, done) {
                return Some(circle);
            }
        }
        path.pop();
        done.push(m.to_owned());
        None
    }
    let mut done = Vec::new();
    for m in edges.keys() {
        let circle = visit(m, &edges, &mut Vec::new(), &mut done);
        assert!(circle.is_none(), "a circle of imports in io: {}", circle.unwrap_or_default().join(" -> "));
    }
    // The check sees the imports it should: the transport stands on the sockets.
    assert!(edges["transport"].iter().any(|t| t == "sockets"), "{edges:?}");
}

/// The simulator (crates/sim) uses the daemon, never the other way: the
/// daemon's manifest does not list it and no source of the daemon names it.
#[test]
fn the_daemon_crate_does_not_depend_on_the_simulator() {
    let manifest = std::fs::read_to_string(daemon().join("Cargo.toml")).unwrap();
    let deps: Vec<&str> = manifest.lines().filter(|l| l.contains("dpcoord-sim") || l.contains("crates/sim")).collect();
    assert!(deps.is_empty(), "crates/daemon/Cargo.toml names the simulator:\n{}", deps.join("\n"));
    let mut named = Vec::new();
    let files = sources(&src());
    for file in &files {
        let text = code(file);
        let sim = ["dpcoord_sim", "crate::sim", "mod sim", "super::sim"].into_iter().filter(|n| text.contains(n));
        named.extend(sim.map(|n| format!("{}: {n}", file.strip_prefix(src()).unwrap().display())));
    }
    assert!(named.is_empty(), "the daemon names the simulator:\n{}", named.join("\n"));
    // The check reads the daemon's code: the coordinator is among the files.
    assert!(files.iter().any(|f| f.ends_with("routing/coordinator/mod.rs")), "{files:?}");
}
