//! Every `GPUPOOL_` name in the repository is a setting the library reads
//! (`config::VARIABLES`), a variable the rest of the project reads (`config::OTHER_VARIABLES`:
//! the Python package, tests, scripts, the CMake build), or no environment variable at all (C
//! constants, include guards, script constants, listed here). So the library's warning about
//! unknown `GPUPOOL_*` variables never names one the project itself uses: a new variable read
//! anywhere fails this test until it is listed.

use gpupool::config::{OTHER_VARIABLES, VARIABLES};
use std::collections::BTreeSet;
use std::path::Path;

/// Identifiers that share the prefix but are no environment variables.
const NOT_VARIABLES: &[&str] = &[
    // C API constants and include guards (include/, tests/c, tests/gpu, bench/gpu).
    "GPUPOOL_STATUS",
    "GPUPOOL_STREAM_LEGACY",
    "GPUPOOL_STREAM_PER_THREAD",
    "GPUPOOL_IPC_SHARE_GRANULES",
    "GPUPOOL_DEPRECATED",
    "GPUPOOL_H",
    "GPUPOOL_SHARE_H",
    "GPUPOOL_PLUGIN_H",
    "GPUPOOL_TEST_CHECK_H",
    "GPUPOOL_RMM_ALLOCATORS_H",
    "GPUPOOL_STATS_INIT_DEFINED",
    "GPUPOOL_ARENA",
    "GPUPOOL_WITH_RMM",
    "GPUPOOL_EXAMPLE_CUDA",
    // The PyTorch allocator class's C++ macros (the second set by its build; the last three
    // write its function table).
    "GPUPOOL_TORCH_EXPORT",
    "GPUPOOL_TORCH_OOM_REJECTION_OBSERVER",
    "GPUPOOL_LIBRARY_FUNCTIONS",
    "GPUPOOL_MEMBER",
    "GPUPOOL_NAME",
    // CMake variables set by CMakeLists.txt itself.
    "GPUPOOL_LIB",
    "GPUPOOL_TOP_LEVEL",
    "GPUPOOL_HAVE_CUDA",
    "GPUPOOL_WARNINGS",
    "GPUPOOL_PC_PREFIX",
    "GPUPOOL_PC_LIBDIR",
    "GPUPOOL_PC_INCLUDEDIR",
    // Constants of the benchmark scripts.
    "GPUPOOL_ALLOCATORS",
    "GPUPOOL_CONFIGS",
    "GPUPOOL_VARIANTS",
];

/// Misspelt settings the tests feed the library to see it warn (each must draw a warning).
const MISSPELT_EXAMPLES: &[&str] = &[
    "GPUPOOL_LIMIT",
    "GPUPOOL_POLL",
    "GPUPOOL_MEM_LIMIT",
    "GPUPOOL_EVENTBATCH",
    "GPUPOOL_THREADCACHE",
    "GPUPOOL_ARENA_LENDING",
    "GPUPOOL_upstream",
    "GPUPOOL_TORCH_ALLOCATORS",
];

fn scan(dir: &Path, names: &mut BTreeSet<String>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        let file = p.file_name().unwrap().to_string_lossy().to_string();
        if p.is_dir() {
            if !matches!(file.as_str(), "target" | "build" | ".git" | "results" | "__pycache__") {
                scan(&p, names);
            }
            continue;
        }
        let Ok(text) = std::fs::read_to_string(&p) else { continue }; // binary files
        let mut rest = text.as_str();
        while let Some(i) = rest.find("GPUPOOL_") {
            let name: String = rest[i..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
            rest = &rest[i + name.len()..];
            names.insert(name);
        }
    }
}

#[test]
fn every_gpupool_name_of_the_project_is_known() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut names = BTreeSet::new();
    for d in ["src", "python", "scripts", "tests", "examples-c", "bench", "cmake", "include"] {
        if root.join(d).is_dir() {
            scan(&root.join(d), &mut names);
        }
    }
    for f in ["README.md", "CMakeLists.txt", "pyproject.toml", "build.rs", "cbindgen.toml", "docs/arena.md"] {
        if let Ok(text) = std::fs::read_to_string(root.join(f)) {
            let mut rest = text.as_str();
            while let Some(i) = rest.find("GPUPOOL_") {
                let name: String = rest[i..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
                rest = &rest[i + name.len()..];
                names.insert(name);
            }
        }
    }
    assert!(names.contains("GPUPOOL_LIBRARY") && names.contains("GPUPOOL_POOL"), "the scan found {names:?}");
    let unknown: Vec<&String> = names
        .iter()
        .filter(|n| {
            let n = n.as_str();
            n != "GPUPOOL_" // the prefix alone, in code that looks for it
                && !VARIABLES.contains(&n)
                && !OTHER_VARIABLES.contains(&n)
                && !NOT_VARIABLES.contains(&n)
                && !MISSPELT_EXAMPLES.contains(&n)
                && (!n.starts_with("GPUPOOL_STATUS_") || n == "GPUPOOL_STATUS_SOCKET")
        })
        .collect();
    assert!(
        unknown.is_empty(),
        "GPUPOOL_ names the project uses but src/config.rs does not know (the library would warn about them): {unknown:?}"
    );
    // And the library's own warning agrees: none of the project's variables draws one, and
    // every misspelt example does (so that list hides no real variable).
    let vars = names.iter().filter(|n| VARIABLES.contains(&n.as_str()) || OTHER_VARIABLES.contains(&n.as_str())).cloned();
    assert!(gpupool::config::unknown_variables(vars).is_empty());
    let misspelt = gpupool::config::unknown_variables(MISSPELT_EXAMPLES.iter().map(|s| s.to_string()));
    assert_eq!(misspelt.len(), MISSPELT_EXAMPLES.len(), "{misspelt:?}");
}
