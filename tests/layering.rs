//! The layers import one way (docs/internals.md): each module of `src/` may use only
//! layers of lower rank. Ranks, lowest first: leaf utilities; configuration and reports;
//! the trace; what passes between processes (`share::protocol`); the upstreams (driver
//! layer); an importer's kept mappings (`share::import_cache`); blocks; strategies and the
//! stream tracker; the device pool; process-level services; the registry; the thread caches
//! and sharing between processes; the front end; the C boundary. A module's layer is the
//! longest entry of `RANKS` it lies in. Every path a file's code names (`use` trees with
//! braced groups, `crate::` paths in expressions, `super::` chains however far they climb)
//! is resolved to the module it leads into; one into a layer of equal or higher rank fails
//! this test, and so does a module missing from the table or a `crate::` path that leads
//! into no module (a crate-root re-export would hide the layer). Within the layers, no two
//! files may depend on each other in a circle (`no_circle_between_files`: every `use` tree
//! and path, a file's own ancestors excepted, which declare it).

use std::path::Path;

const RANKS: &[(&str, u32)] = &[
    ("error", 0),
    ("decay", 0),
    ("pages", 0),
    ("owners", 0),
    ("process", 0),
    ("socket", 0),
    ("config", 10),
    ("stats", 10),
    ("debug", 10),
    ("trace", 20),
    // What passes between processes (descriptors' bytes, the export record): below the
    // driver layer, which hands out and maps what it describes.
    ("share::protocol", 25),
    // The upstreams: the interface (traits, driver-call counts, stream ids, peers) below
    // the implementations, the one place that chooses among them above both.
    ("upstream", 30),
    ("upstream::cuda", 31),
    ("upstream::sim", 31),
    ("upstream::host_vmm", 32),
    ("upstream::host", 33),
    ("upstream::make", 34),
    // The device pool's sharing books: an importer's kept mappings, an exporter's exports
    // by block.
    ("share::import_cache", 35),
    ("share::exports", 35),
    ("share::imports", 36),
    ("block", 40),
    // What a thread's fast-path cache shares with the pool it is attached to: the words and
    // their protocol, which the pool takes blocks back through.
    ("thread_cache::state", 45),
    ("strategy", 50),
    ("stream", 50),
    // The device pool's layers as types, each below those that use it: the driver
    // contention and the budget its shards share, the options a pool is built with, the
    // recorder and the limits, the core allocator; `Pool`, whose operations are where they
    // meet, above them all.
    ("pool::contention", 51),
    ("pool::budget", 52),
    ("pool::options", 53),
    ("pool::recorder", 54),
    ("pool::limits", 54),
    ("pool::core", 55),
    ("pool", 60),
    ("fork", 70),
    ("status_socket", 70),
    ("tags", 70),
    ("replay", 70),
    ("registry", 80),
    ("thread_cache", 90),
    ("share", 90),
    ("front", 100),
    ("ffi", 110),
];

/// The layer a module belongs to: the longest entry of `RANKS` it lies in
/// (`share/protocol/record.rs` -> `share::protocol`, `share/holds.rs` -> `share`).
fn layer_of(module: &[String]) -> Option<(String, u32)> {
    (1..=module.len()).rev().find_map(|n| {
        let key = module[..n].join("::");
        RANKS.iter().find(|(k, _)| *k == key).map(|&(k, r)| (k.to_string(), r))
    })
}

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

#[test]
fn the_checks_see_braced_imports_and_super_chains() {
    let here = module_path("pool/core.rs");
    assert_eq!(here, ["pool", "core"]);
    assert_eq!(module_path("registry/mod.rs"), ["registry"]);
    let modules: std::collections::BTreeSet<Vec<String>> = [
        vec!["ffi"],
        vec!["front"],
        vec!["pool"],
        vec!["pool", "core"],
        vec!["pool", "growth"],
        vec!["upstream"],
        vec!["share"],
        vec!["share", "protocol"],
        vec!["share", "protocol", "record"],
    ]
    .into_iter()
    .map(|m| m.into_iter().map(String::from).collect())
    .collect();
    let layers = |code: &str, here: &[String]| -> Vec<String> {
        named_paths(&code_only(code))
            .iter()
            .filter_map(|p| resolve(here, p, &modules))
            .filter_map(|m| layer_of(&m).map(|l| l.0))
            .fold(Vec::new(), |mut v, l| {
                if v.last() != Some(&l) {
                    v.push(l);
                }
                v
            })
    };
    assert_eq!(layers("use crate::{ffi as _x};", &here), ["ffi"]);
    assert_eq!(layers("use crate::{upstream::Kind, front};", &here), ["upstream", "front"]);
    assert_eq!(layers("fn f() { super::super::front::free(p); }", &here), ["front"]);
    assert_eq!(layers("use super::super::{front, ffi};", &here), ["front", "ffi"]);
    assert_eq!(layers("use super::growth::Grower;", &here), ["pool"], "a sibling in the same layer");
    assert_eq!(
        layers("let x = crate::share::protocol::record::RecordRef;", &here),
        ["share::protocol"]
    );
    let record = module_path("share/protocol/record.rs");
    assert_eq!(layer_of(&record).unwrap(), ("share::protocol".to_string(), 25));
    assert_eq!(
        layers("use super::super::holds::Holds;", &record),
        ["share"],
        "a climb out of a sub-layer"
    );
    assert_eq!(layers("fn f() { crate :: front :: free(p); }", &here), ["front"], "spaces around `::`");
    assert_eq!(layers("fn f() { self::super::super::front::free(p); }", &here), ["front"], "`self::super`");
    assert_eq!(layers("let s = r#\"a\"b\"#; fn f() { crate::ffi::x(); }", &here), ["ffi"], "code after a raw string");
    assert_eq!(root_aliases("use crate as c;\nuse super::super as up;\nextern crate self as me;\nuse crate::front as f;").len(), 3);
    assert_eq!(layers("fn f() { crate::registry::with_pool::<()>(0); }", &here), Vec::<String>::new(), "no such module in the probe set");
    assert_eq!(layers("fn f() { crate::front::free::<()>(p); }", &here), ["front"], "a path cut at a turbofish");
    let scopes = module_scopes(&here, &code_only("mod t { fn g() { let c = '{'; } }\nuse super::super::ffi::x;"));
    assert!(scopes[0].1.contains("super::super::ffi"), "a brace in a char literal ends no module: {scopes:?}");
    assert_eq!(root_aliases("use super::super::{self as root};").len(), 1, "a braced alias of a climb");
    assert_eq!(root_aliases("use crate::{front as f, error::Error};").len(), 0, "aliases of modules are fine");
    let budget = module_path("pool/budget.rs");
    let scopes = module_scopes(&budget, "pub(in crate::pool) fn f() {}\nmod tests {\n    use super::*;\n}\n");
    assert_eq!(scopes.len(), 2, "the file's module and its inline test module");
    assert!(named_paths(&scopes[0].1).is_empty(), "a `pub(in path)` names no dependency: {:?}", scopes[0].1);
    assert_eq!(scopes[1].0, ["pool", "budget", "tests"]);
    let budget_modules: std::collections::BTreeSet<Vec<String>> =
        [vec!["pool".to_string()], vec!["pool".to_string(), "budget".to_string()]].into_iter().collect();
    assert_eq!(resolve(&scopes[1].0, "super::*", &budget_modules), Some(budget.clone()), "`super` in an inline module is the file");
    assert_eq!(layer_of(&module_path("share/holds.rs")).unwrap().0, "share");
}

#[test]
fn modules_import_only_lower_layers() {
    use std::collections::BTreeSet;
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut all = Vec::new();
    files(&src, &mut all);
    let mut code = Vec::new();
    for f in all {
        let rel = f.strip_prefix(&src).unwrap().to_string_lossy().to_string();
        if rel == "lib.rs" || rel.starts_with("bin/") {
            continue; // the crate root declares every module; binaries sit on top
        }
        code.push((rel.clone(), module_path(&rel), code_only(&std::fs::read_to_string(&f).unwrap())));
    }
    let modules: BTreeSet<Vec<String>> = code.iter().map(|c| c.1.clone()).collect();
    let mut bad = Vec::new();
    for (rel, file_module, text) in &code {
        for (here, text) in module_scopes(file_module, text) {
            let here = &here;
            let Some((mine, my_rank)) = layer_of(here) else {
                bad.push(format!("{rel}: module `{}` has no rank in tests/layering.rs", here.join("::")));
                continue;
            };
            for alias in root_aliases(&text) {
                bad.push(format!("{rel}: `{alias}` renames a module path, which would hide the layer its uses reach"));
            }
            for path in named_paths(&text) {
                // A path cut at a turbofish or a braced group ends in `::`: what it names
                // is the same without it. The bare root (`crate::{...}`'s head) names
                // nothing: the group's items are paths of their own.
                let path = path.trim_end_matches("::").to_string();
                if path.split("::").all(|s| s == "crate" || s == "super" || s == "self") {
                    continue;
                }
                let Some(to) = resolve(here, &path, &modules) else {
                    if path.starts_with("crate::") {
                        // The crate root's re-exports would hide which layer a name is from.
                        bad.push(format!("{rel}: `{path}` names no module under the crate root"));
                    }
                    continue;
                };
                match layer_of(&to) {
                    Some((theirs, _)) if theirs == mine => {}
                    Some((_, r)) if r < my_rank => {}
                    Some((theirs, r)) => bad.push(format!(
                        "{rel}: `{mine}` (rank {my_rank}) uses `{theirs}` (rank {r}) through `{path}`"
                    )),
                    None => bad.push(format!("{rel}: `{path}` leads into `{}`, which has no rank", to.join("::"))),
                }
            }
        }
    }
    assert!(bad.is_empty(), "layering violations:\n{}", bad.join("\n"));
}

/// The C boundary marshals and goes through the front end: below it, it may name only the
/// front end, sharing's entry points (`share`, whose own layers it must not reach into),
/// the leaves every layer may use (errors, the stats struct it copies out), and the fork
/// and process guards every entry point runs. Everything it asks of the registry, a pool or
/// the driver goes through `front`, which holds the rules that span devices.
const FFI_MAY_USE: &[&str] = &["front", "share", "error", "stats", "fork", "process"];

#[test]
fn ffi_goes_through_the_front_end() {
    use std::collections::BTreeSet;
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut all = Vec::new();
    files(&src, &mut all);
    let modules: BTreeSet<Vec<String>> = all
        .iter()
        .map(|f| module_path(&f.strip_prefix(&src).unwrap().to_string_lossy()))
        .collect();
    let mut bad = Vec::new();
    for f in &all {
        let rel = f.strip_prefix(&src).unwrap().to_string_lossy().to_string();
        if !rel.starts_with("ffi/") {
            continue;
        }
        let file_module = module_path(&rel);
        let code = code_only(&std::fs::read_to_string(f).unwrap());
        for (here, text) in module_scopes(&file_module, &code) {
            for path in named_paths(&text) {
                let Some(to) = resolve(&here, &path, &modules) else { continue };
                let top = to.first().map(String::as_str).unwrap_or("");
                let layer = layer_of(&to).map(|l| l.0).unwrap_or_default();
                // `share`'s lower layers (the protocol, the pool's books) are below the front end.
                let allowed = top == "ffi" || (FFI_MAY_USE.contains(&top) && (top != "share" || layer == "share"));
                if !allowed {
                    bad.push(format!("{rel}: `{path}` reaches `{}` past the front end", to.join("::")));
                }
            }
        }
    }
    assert!(bad.is_empty(), "the C boundary skips the front end:\n{}", bad.join("\n"));
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
    assert!(
        bad.is_empty(),
        "socket writes that may raise SIGPIPE (use crate::socket::send_all):\n{}",
        bad.join("\n")
    );
}

/// The code of a file (`code_only`) by the module it is in: the file's own module, and each
/// inline module (`mod tests { ... }`) as a child of it, where `super::` means the file's
/// module. `pub(in path)` restrictions name no dependency and are dropped.
fn module_scopes(here: &[String], code: &str) -> Vec<(Vec<String>, String)> {
    let code = drop_visibility_paths(code);
    let (b, mut outer, mut inner, mut i) = (code.as_bytes(), String::new(), Vec::new(), 0);
    while i < b.len() {
        let at_word = i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_');
        if at_word && b[i..].starts_with(b"mod ") {
            let name: String = code[i + 4..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            let after = i + 4 + name.len();
            let open = after + code[after..].len() - code[after..].trim_start().len();
            if !name.is_empty() && b.get(open) == Some(&b'{') {
                let (mut depth, mut j) = (0usize, open);
                while j < b.len() {
                    match b[j] {
                        b'{' => depth += 1,
                        b'}' => {
                            depth -= 1;
                            if depth == 0 {
                                break;
                            }
                        }
                        _ => {}
                    }
                    j += 1;
                }
                let mut child = here.to_vec();
                child.push(name);
                inner.extend(module_scopes(&child, &code[open + 1..j.min(b.len())]));
                i = j + 1;
                continue;
            }
        }
        outer.push(b[i] as char);
        i += 1;
    }
    let mut out = vec![(here.to_vec(), outer)];
    out.extend(inner);
    out
}

/// `use crate as x;`, `use super::super as up;`, `use self as s;` (and `extern crate self as
/// x;`): a path through such a name would resolve to nothing here, so none is allowed.
fn root_aliases(code: &str) -> Vec<String> {
    let is_root = |path: &str| path.split("::").map(str::trim).all(|s| s == "crate" || s == "super" || s == "self");
    let mut out = Vec::new();
    for stmt in code.split(';') {
        let words: Vec<&str> = stmt.split_whitespace().collect();
        if let Some(k) = words.windows(2).position(|w| w == ["extern", "crate"]) {
            if words.get(k + 2).is_some_and(|t| is_root(t)) && words.get(k + 3) == Some(&"as") {
                out.push(stmt.trim().to_string());
            }
        }
        let Some(u) = stmt.find("use ").filter(|&u| u == 0 || !stmt[..u].ends_with(|c: char| c.is_ascii_alphanumeric() || c == '_')) else {
            continue;
        };
        let tree: String = stmt[u + 4..].split_whitespace().collect::<Vec<_>>().join(" ");
        // Every leaf of the tree with its `as` kept: `super::super::{self as root}` too.
        for leaf in expand_use_keeping_aliases(&tree) {
            if let Some((path, _)) = leaf.split_once(" as ") {
                if is_root(path.trim_end_matches("::self")) || is_root(path) {
                    out.push(stmt.trim().to_string());
                }
            }
        }
    }
    out
}

/// `expand_use`, each leaf keeping its ` as name`.
fn expand_use_keeping_aliases(tree: &str) -> Vec<String> {
    let tree = tree.trim();
    let Some(open) = tree.find('{') else { return vec![tree.to_string()] };
    let (prefix, inner) = (&tree[..open], &tree[open + 1..tree.rfind('}').unwrap_or(tree.len())]);
    let (mut items, mut depth, mut cur) = (Vec::new(), 0, String::new());
    for c in inner.chars() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            _ => {}
        }
        if c == ',' && depth == 0 {
            items.push(std::mem::take(&mut cur));
        } else {
            cur.push(c);
        }
    }
    items.push(cur);
    items.iter().filter(|i| !i.trim().is_empty()).flat_map(|i| expand_use_keeping_aliases(i)).map(|p| format!("{prefix}{p}")).collect()
}

/// `code` with every `pub(in path)` written `pub`.
fn drop_visibility_paths(code: &str) -> String {
    let mut out = String::with_capacity(code.len());
    let mut rest = code;
    while let Some(i) = rest.find("pub(in ") {
        out.push_str(&rest[..i + 3]);
        rest = &rest[i..];
        rest = &rest[rest.find(')').map_or(rest.len(), |e| e + 1)..];
    }
    out.push_str(rest);
    out
}

/// `text` without comments and string literals (paths inside them are no dependency).
fn code_only(text: &str) -> String {
    let (b, mut out, mut i) = (text.as_bytes(), String::with_capacity(text.len()), 0);
    while i < b.len() {
        if b[i..].starts_with(b"//") {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if b[i..].starts_with(b"/*") {
            i += 2;
            while i < b.len() && !b[i..].starts_with(b"*/") {
                i += 1;
            }
            i += 2;
        } else if let Some(end) = char_literal_end(b, i) {
            i = end;
            out.push_str("' '");
        } else if let Some(end) = raw_string_end(b, i) {
            i = end;
            out.push_str("\"\"");
        } else if b[i] == b'"' && (i == 0 || b[i - 1] != b'\'') {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            i += 1;
            out.push_str("\"\"");
        } else {
            out.push(b[i] as char);
            i += 1;
        }
    }
    // `crate :: a` is the path `crate::a`.
    let mut tight = String::with_capacity(out.len());
    for (k, part) in out.split("::").enumerate() {
        if k > 0 {
            tight.truncate(tight.trim_end().len());
            tight.push_str("::");
            tight.push_str(part.trim_start());
        } else {
            tight.push_str(part);
        }
    }
    tight
}

/// Where the character literal starting at `i` (`'{'`, `'"'`, `'\n'`, `'\u{7d}'`) ends, if
/// one does (a lifetime `'a` is none: no closing quote follows its name).
fn char_literal_end(b: &[u8], i: usize) -> Option<usize> {
    if b.get(i) != Some(&b'\'') {
        return None;
    }
    if b.get(i + 1) == Some(&b'\\') {
        let close = b[i + 2..].iter().take(12).position(|&c| c == b'\'')?;
        return Some(i + 2 + close + 1);
    }
    // One character, possibly several bytes of UTF-8.
    let len = match b.get(i + 1)? {
        c if *c < 0x80 => 1,
        c if *c >= 0xf0 => 4,
        c if *c >= 0xe0 => 3,
        _ => 2,
    };
    (b.get(i + 1 + len) == Some(&b'\'')).then_some(i + 2 + len)
}

/// Where the raw string literal (`r"…"`, `r#"…"#`, `br"…"`) starting at `i` ends, if one does.
fn raw_string_end(b: &[u8], i: usize) -> Option<usize> {
    let word_start = i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_');
    let mut j = i + usize::from(b.get(i) == Some(&b'b'));
    if !word_start || b.get(j) != Some(&b'r') {
        return None;
    }
    j += 1;
    let hashes = b[j..].iter().take_while(|&&c| c == b'#').count();
    j += hashes;
    if b.get(j) != Some(&b'"') {
        return None;
    }
    let close: Vec<u8> = std::iter::once(b'"').chain(std::iter::repeat(b'#').take(hashes)).collect();
    let at = b[j + 1..].windows(close.len()).position(|w| w == close.as_slice())?;
    Some(j + 1 + at + close.len())
}

/// The paths a `use` tree names (`a::{b, c::{d as e}}` -> a::b, a::c::d).
fn expand_use(tree: &str) -> Vec<String> {
    expand_use_keeping_aliases(tree).iter().map(|p| p.split(" as ").next().unwrap_or("").trim().to_string()).collect()
}

/// Every path a file's code names from the crate root or relative to its own module.
fn named_paths(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(i) = rest.find("use ") {
        let starts_word = i == 0 || !rest[..i].ends_with(|c: char| c.is_ascii_alphanumeric() || c == '_');
        let end = rest[i..].find(';').map_or(rest.len(), |e| i + e);
        if starts_word {
            let tree: String = rest[i + 4..end].split_whitespace().collect::<Vec<_>>().join(" ");
            out.extend(expand_use(&tree));
        }
        rest = &rest[(i + 4).min(end)..];
    }
    for start in ["crate::", "super::", "self::"] {
        let mut rest = code;
        while let Some(i) = rest.find(start) {
            let continues = rest[..i].ends_with(|c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':');
            let path: String = rest[i..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == ':')
                .collect();
            if !continues {
                out.push(path.clone());
            }
            rest = &rest[i + path.len().max(start.len())..];
        }
    }
    out
}

/// The module file a path from module `here` leads into (the longest module it names), if
/// it starts from the crate root, `super` or `self`.
fn resolve(here: &[String], path: &str, modules: &std::collections::BTreeSet<Vec<String>>) -> Option<Vec<String>> {
    let segs: Vec<&str> = path.split("::").map(str::trim).filter(|s| !s.is_empty()).collect();
    let mut cur: Vec<String> = here.to_vec();
    let mut rest = &segs[..];
    match rest.first() {
        Some(&"crate") => {
            cur.clear();
            rest = &rest[1..];
        }
        Some(&"super") | Some(&"self") => {
            // `self::super::…` is the `super` chain.
            if rest.first() == Some(&"self") && rest.get(1) == Some(&"super") {
                rest = &rest[1..];
            }
            while rest.first() == Some(&"super") {
                cur.pop();
                rest = &rest[1..];
            }
            if rest.first() == Some(&"self") {
                rest = &rest[1..];
            }
        }
        // A bare path names a child module declared here (`use cuda::CudaUpstream;` in
        // `upstream/mod.rs`), or something outside the crate.
        _ => return longest_module(&cur, rest, 1, modules),
    }
    longest_module(&cur, rest, 0, modules)
}

/// The longest module `from` followed by at least `min` of `segs` (as many as lead into one).
fn longest_module(from: &[String], segs: &[&str], min: usize, modules: &std::collections::BTreeSet<Vec<String>>) -> Option<Vec<String>> {
    (min..=segs.len())
        .rev()
        .map(|n| from.iter().cloned().chain(segs[..n].iter().map(|s| s.to_string())).collect::<Vec<_>>())
        .find(|m| modules.contains(m))
}

#[test]
fn no_circle_between_files() {
    use std::collections::{BTreeMap, BTreeSet};
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut all = Vec::new();
    files(&src, &mut all);
    let mut code: BTreeMap<Vec<String>, (String, String)> = BTreeMap::new();
    for f in all {
        let rel = f.strip_prefix(&src).unwrap().to_string_lossy().to_string();
        if rel == "lib.rs" || rel.starts_with("bin/") {
            continue;
        }
        code.insert(module_path(&rel), (rel.clone(), code_only(&std::fs::read_to_string(&f).unwrap())));
    }
    let modules: BTreeSet<Vec<String>> = code.keys().cloned().collect();
    // A file depends on the files its paths lead into, but not on its own module's
    // ancestors (a submodule uses its parent's types; the parent declares it).
    let mut edges: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = BTreeMap::new();
    for (file_module, (_, text)) in &code {
        for (scope, text) in module_scopes(file_module, text) {
            let m = file_module;
            for p in named_paths(&text) {
                if let Some(to) = resolve(&scope, &p, &modules) {
                    if &to != m && !m.starts_with(&to) {
                        edges.entry(m.clone()).or_default().insert(to);
                    }
                }
            }
        }
    }
    // Depth-first search for a back edge; report the circle it closes.
    fn visit(
        v: &Vec<String>,
        edges: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>,
        state: &mut BTreeMap<Vec<String>, u8>,
        stack: &mut Vec<Vec<String>>,
        found: &mut Vec<String>,
    ) {
        state.insert(v.clone(), 1);
        stack.push(v.clone());
        for w in edges.get(v).into_iter().flatten() {
            match state.get(w) {
                None => visit(w, edges, state, stack, found),
                Some(1) => {
                    let at = stack.iter().position(|x| x == w).unwrap();
                    let mut circle: Vec<String> = stack[at..].iter().map(|x| x.join("/")).collect();
                    circle.push(w.join("/"));
                    found.push(circle.join(" -> "));
                }
                _ => {}
            }
        }
        stack.pop();
        state.insert(v.clone(), 2);
    }
    let (mut state, mut found) = (BTreeMap::new(), Vec::new());
    for m in &modules {
        if !state.contains_key(m) {
            visit(m, &edges, &mut state, &mut Vec::new(), &mut found);
        }
    }
    assert!(
        found.is_empty(),
        "files that depend on each other in a circle:\n{}",
        found.join("\n")
    );
    // The reading sees what it must: a known dependency of each kind is among the edges.
    let has = |from: &str, to: &str| edges.get(&module_path(from)).is_some_and(|s| s.contains(&module_path(to)));
    assert!(has("pool/grow.rs", "pool/growth.rs"), "a braced `use super::growth::{{...}}`");
    assert!(
        has("share/protocol/exporter.rs", "share/protocol/identity.rs"),
        "a path into a sibling module"
    );
}

#[test]
fn the_circle_check_reads_use_trees_and_paths() {
    assert_eq!(
        expand_use("super::{growth::{Attempt, Grower as G}, Pool}"),
        ["super::growth::Attempt", "super::growth::Grower", "super::Pool"]
    );
    assert_eq!(code_only("let s = \"crate::ffi\"; // crate::front\nx"), "let s = \"\"; \nx");
    let p = named_paths("use crate::{a::b, c};\nfn f() { super::super::d::e(); }");
    assert!(
        p.contains(&"crate::a::b".to_string()) && p.contains(&"crate::c".to_string()),
        "{p:?}"
    );
    assert!(p.contains(&"super::super::d::e".to_string()), "{p:?}");
}
