//! The module layering, checked on the source: the daemon crate depends on
//! neither the simulator nor the gateway, `config` is the ground (it names
//! no other module of the crate, only the `names!` macro), and the modules of `io` import each other without a circle.
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
            // `names!` is a macro at the crate's root, below every module.
            if module != "config" && module != "names" {
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

/// The crates that stand on the daemon, each as its manifest and its code
/// name it: the daemon names none of them.
const ABOVE: [(&str, &[&str]); 2] = [
    ("the simulator", &["dpcoord-sim", "crates/sim", "dpcoord_sim", "crate::sim", "mod sim", "super::sim"]),
    ("the gateway", &["dpcoord-gateway", "crates/gateway", "dpcoord_gateway", "crate::gateway", "mod gateway"]),
];

/// The gRPC and tokenizer stack, which only the gateway pulls in.
const GATEWAY_STACK: [&str; 6] = ["tonic", "tonic-health", "envoy-types", "tokenizers", "minijinja", "tokio-stream"];

/// Each name of `names` that a dependency line of `manifest`, or the code
/// of one of `files` (path, code), names, as `where: name`.
fn named(manifest: &str, files: &[(String, String)], names: &[&str]) -> Vec<String> {
    let mut found = Vec::new();
    for line in manifest.lines().filter(|l| !l.trim_start().starts_with('#')) {
        let dep = line.split(['=', '.']).next().unwrap_or_default().trim();
        let listed = names.iter().filter(|n| dep == **n || (n.contains('/') && line.contains(**n)));
        found.extend(listed.map(|n| format!("Cargo.toml: {n}")));
    }
    for (path, code) in files {
        found.extend(names.iter().filter(|n| !n.contains('/') && code.contains(**n)).map(|n| format!("{path}: {n}")));
    }
    found.sort();
    found.dedup();
    found
}

/// The daemon's code, file by file.
fn daemon_code() -> Vec<(String, String)> {
    sources(&src()).iter().map(|f| (f.strip_prefix(src()).unwrap().display().to_string(), code(f))).collect()
}

/// The simulator and the gateway use the daemon, never the other way: the
/// daemon's manifest does not list them (nor the gRPC and tokenizer stack
/// the gateway brings) and no source of the daemon names them.
#[test]
fn the_daemon_depends_on_neither_the_simulator_nor_the_gateway() {
    let manifest = std::fs::read_to_string(daemon().join("Cargo.toml")).unwrap();
    let files = daemon_code();
    for (what, names) in ABOVE {
        let found = named(&manifest, &files, names);
        assert!(found.is_empty(), "the daemon names {what}:\n{}", found.join("\n"));
    }
    let stack = named(&manifest, &[], &GATEWAY_STACK);
    assert!(stack.is_empty(), "the daemon's manifest lists the gateway's stack:\n{}", stack.join("\n"));
    // The check reads the daemon's code: the coordinator is among the files.
    assert!(files.iter().any(|(f, _)| f.ends_with("routing/coordinator/mod.rs")), "{files:?}");
}

/// The check above finds each kind of dependency where there is one: a
/// manifest line, a path dependency, a use in the code.
#[test]
fn the_dependency_check_finds_what_it_is_given() {
    let gateway = ABOVE[1].1;
    let manifest = "[dependencies]\n# dpcoord-gateway, in a comment only\nzmq.workspace = true\n";
    assert_eq!(named(manifest, &[], gateway), Vec::<String>::new());
    let listed = format!("{manifest}dpcoord-gateway = {{ path = \"../gateway\" }}\n");
    assert_eq!(named(&listed, &[], gateway), ["Cargo.toml: dpcoord-gateway"]);
    let by_path = format!("{manifest}gw = {{ path = \"../../crates/gateway\" }}\n");
    assert_eq!(named(&by_path, &[], gateway), ["Cargo.toml: crates/gateway"]);
    let code = [("io/daemon.rs".to_owned(), "let b = dpcoord_gateway::Bridge::start();".to_owned())];
    assert_eq!(named(manifest, &code, gateway), ["io/daemon.rs: dpcoord_gateway"]);
    let stack = format!("{manifest}tonic.workspace = true\n");
    assert_eq!(named(&stack, &[], &GATEWAY_STACK), ["Cargo.toml: tonic"]);
}
