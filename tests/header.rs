//! The committed header must be exactly what cbindgen generates from the sources.
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
