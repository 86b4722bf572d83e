//! The committed header must be exactly what cbindgen generates from the sources, and
//! declare exactly the functions the shared library exports.
//! Regenerate: `GPUPOOL_BLESS=1 cargo test --test header` (or the cbindgen CLI, see cbindgen.toml).

use std::path::Path;

#[test]
fn committed_header_is_fresh() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(root.join("cbindgen.toml")).expect("cbindgen.toml parses");
    let mut generated = Vec::new();
    cbindgen::Builder::new()
        .with_crate(root)
        .with_config(config)
        .generate()
        .expect("cbindgen generates the header")
        .write(&mut generated);
    let generated = String::from_utf8(generated).unwrap();
    let path = root.join("include/gpupool.h");
    if std::env::var_os("GPUPOOL_BLESS").is_some() {
        std::fs::write(&path, &generated).unwrap();
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "include/gpupool.h is stale: regenerate it with `GPUPOOL_BLESS=1 cargo test --test header` and commit it"
    );
}

/// Exported for Python alone (their arguments are Python objects), so left out of the header.
const PYTHON_ONLY: &[&str] = &["gpupool_cupy_set_oom_error"];

#[test]
fn every_declared_function_is_exported_and_every_export_declared() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let header = std::fs::read_to_string(root.join("include/gpupool.h")).unwrap();
    // Declarations: a line's `gpupool_name(` outside comments, the header's own inline
    // helper left out.
    let mut declared: std::collections::BTreeSet<String> = header
        .lines()
        .filter(|l| !l.trim_start().starts_with("//") && !l.trim_start().starts_with('*') && !l.trim_start().starts_with("/*"))
        .filter(|l| !l.contains("static inline"))
        .flat_map(|l| {
            l.match_indices("gpupool_").filter_map(move |(i, _)| {
                let name: String = l[i..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
                l[i + name.len()..].starts_with('(').then_some(name)
            })
        })
        .collect();
    declared.remove("gpupool_stats_init");
    // The library cargo built with this test: beside its binary (target/<profile>/deps/).
    let exe = std::env::current_exe().unwrap();
    let lib = exe.parent().unwrap().join("libgpupool.so");
    assert!(lib.is_file(), "{} is missing (cargo builds it with the tests)", lib.display());
    let out = std::process::Command::new("nm").args(["-D", "--defined-only"]).arg(&lib).output().expect("nm (binutils) runs");
    assert!(out.status.success(), "nm failed: {}", String::from_utf8_lossy(&out.stderr));
    let exported: std::collections::BTreeSet<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().nth(2))
        .filter(|s| s.starts_with("gpupool_") && !PYTHON_ONLY.contains(s))
        .map(str::to_string)
        .collect();
    let missing: Vec<_> = declared.difference(&exported).collect();
    let undeclared: Vec<_> = exported.difference(&declared).collect();
    assert!(missing.is_empty(), "declared in include/gpupool.h but not exported: {missing:?}");
    assert!(undeclared.is_empty(), "exported but not declared in include/gpupool.h: {undeclared:?}");
    assert!(declared.len() > 50, "only {} declarations found: the parse is off", declared.len());
}
