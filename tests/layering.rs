//! The layers import one way (docs/internals.md): each module of `src/` may use only
//! modules of lower rank. Ranks, lowest first: leaf utilities; configuration and reports;
//! the trace; the upstreams (driver layer); blocks; strategies and the stream tracker; the
//! device pool; process-level services; the registry; the thread caches and sharing between
//! processes; the front end; the C boundary. A `use crate::X` (or a `crate::X::` path outside
//! comments, braced groups `crate::{X, Y}` included, or a `super::` chain that climbs to the
//! crate root and goes down into X) against the order fails this test, and so does a module
//! missing from the table.

use std::collections::BTreeMap;
use std::path::Path;

const RANKS: &[(&str, u32)] = &[
    ("error", 0),
    ("decay", 0),
    ("pages", 0),
    ("owners", 0),
    ("process", 0),
    ("socket", 0),
    ("config", 1),
    ("stats", 1),
    ("debug", 1),
    ("trace", 2),
    ("upstream", 3),
    ("block", 4),
    ("strategy", 5),
    ("stream", 5),
    ("pool", 6),
    ("fork", 7),
    ("status_socket", 7),
    ("tags", 7),
    ("replay", 7),
    ("registry", 8),
    ("thread_cache", 9),
    ("share", 9),
    ("front", 10),
    ("ffi", 11),
];

fn files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The module path of a file under `src/` (`pool/arena/figures.rs` -> pool, arena, figures;
/// a `mod.rs` is its folder's module).
fn module_path(rel: &str) -> Vec<String> {
    let mut parts: Vec<String> = rel.trim_end_matches(".rs").split('/').map(String::from).collect();
    if parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    parts
}

fn ident(s: &str) -> String {
    s.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect()
}

/// The top-level modules a line of code names through `crate::` paths (braced groups
/// included: `crate::{a, b::c as d}`) and through `super::` chains that climb to the crate
/// root from `here` (`super::super::front::free` in `pool/core.rs` names `front`).
fn top_modules_named(code: &str, here: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(i) = rest.find("crate::") {
        out.extend(names_at(&rest[i + 7..]));
        rest = &rest[i + 7..];
    }
    let mut rest = code;
    while let Some(i) = rest.find("super::") {
        // A whole chain only: the text before it must not continue a path.
        let before = rest[..i].chars().last();
        let chain_start = !before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':');
        let mut tail = &rest[i..];
        let mut ups = 0;
        while let Some(t) = tail.strip_prefix("super::") {
            ups += 1;
            tail = t;
        }
        if chain_start && ups >= here.len() {
            // Climbs to the crate root: what follows is a top-level module.
            out.extend(names_at(tail));
        }
        rest = &rest[i + 7 * ups..];
    }
    out
}

/// The first segments a path continues with: one name, or each item of a braced group.
fn names_at(after: &str) -> Vec<String> {
    let after = after.trim_start();
    let names: Vec<String> = match after.strip_prefix('{') {
        Some(group) => group[..group.find('}').unwrap_or(group.len())].split(',').map(|item| ident(item.trim())).collect(),
        None => vec![ident(after)],
    };
    names.into_iter().filter(|n| !n.is_empty() && n != "self").collect()
}

#[test]
fn the_checks_see_braced_imports_and_super_chains_to_the_root() {
    let here = module_path("pool/core.rs");
    assert_eq!(here, ["pool", "core"]);
    assert_eq!(module_path("registry/mod.rs"), ["registry"]);
    assert_eq!(top_modules_named("use crate::{ffi as _x};", &here), ["ffi"]);
    assert_eq!(top_modules_named("use crate::{error::Error, front};", &here), ["error", "front"]);
    assert_eq!(top_modules_named("    super::super::front::free(p);", &here), ["front"]);
    assert_eq!(top_modules_named("use super::super::{front, ffi};", &here), ["front", "ffi"]);
    assert!(top_modules_named("use super::Pool;", &here).is_empty(), "a sibling in the same module");
    assert_eq!(top_modules_named("let x = crate::upstream::Kind;", &here), ["upstream"]);
}

#[test]
fn modules_import_only_lower_layers() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let rank: BTreeMap<&str, u32> = RANKS.iter().copied().collect();
    let mut all = Vec::new();
    files(&src, &mut all);
    let mut bad = Vec::new();
    for f in all {
        let rel = f.strip_prefix(&src).unwrap().to_string_lossy().to_string();
        if rel == "lib.rs" || rel.starts_with("bin/") {
            continue; // the crate root declares every module; binaries sit on top
        }
        let module = rel.split(['/', '.']).next().unwrap().to_string();
        let Some(&mine) = rank.get(module.as_str()) else {
            bad.push(format!("{rel}: module `{module}` has no rank in tests/layering.rs"));
            continue;
        };
        let text = std::fs::read_to_string(&f).unwrap();
        let here = module_path(&rel);
        for (n, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap();
            for name in top_modules_named(code, &here) {
                if name == module {
                    continue;
                }
                match rank.get(name.as_str()) {
                    Some(&r) if r < mine => {}
                    Some(&r) => bad.push(format!("{rel}:{}: `{module}` (rank {mine}) uses `{name}` (rank {r})", n + 1)),
                    None => bad.push(format!("{rel}:{}: uses `{name}`, which has no rank", n + 1)),
                }
            }
        }
    }
    assert!(bad.is_empty(), "layering violations:\n{}", bad.join("\n"));
}

/// Socket writes go through `socket::send_all` (`MSG_NOSIGNAL`): std's `Write` for
/// `UnixStream` adds that flag only from Rust 1.90 on and the crate builds with 1.80, where
/// a write to a peer that hung up raises SIGPIPE, which ends a C host whose SIGPIPE is the
/// default. A library file that uses Unix sockets and writes with `write`/`write_all`
/// fails this test (the handover's unit tests, which play misbehaving peers, excepted).
#[test]
fn socket_writes_raise_no_sigpipe() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut all = Vec::new();
    files(&src, &mut all);
    let mut bad = Vec::new();
    for f in all {
        let rel = f.strip_prefix(&src).unwrap().to_string_lossy().to_string();
        if rel == "socket.rs" || rel.ends_with("/tests.rs") {
            continue;
        }
        let text = std::fs::read_to_string(&f).unwrap();
        if !text.contains("UnixStream") && !text.contains("UnixListener") {
            continue;
        }
        for (n, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap();
            if code.contains(".write_all(") || code.contains(".write(") {
                bad.push(format!("{rel}:{}: {}", n + 1, line.trim()));
            }
        }
    }
    assert!(bad.is_empty(), "socket writes that may raise SIGPIPE (use crate::socket::send_all):\n{}", bad.join("\n"));
}
