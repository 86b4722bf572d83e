//! `GPUPOOL_*` variables that nothing reads (a typo, a setting of another version): found,
//! and each warned about once with the setting most likely meant.

use super::{OTHER_VARIABLES, VARIABLES};

/// Of `names` (environment variable names), those starting `GPUPOOL_` that nothing in the
/// project reads, each once, in order, with the setting a user most likely meant.
pub fn unknown_variables(names: impl IntoIterator<Item = String>) -> Vec<(String, &'static str)> {
    let mut out: Vec<(String, &'static str)> = Vec::new();
    for n in names {
        if n.starts_with("GPUPOOL_")
            && !VARIABLES.contains(&n.as_str())
            && !OTHER_VARIABLES.contains(&n.as_str())
            && !out.iter().any(|(m, _)| *m == n)
        {
            let near = closest(&n);
            out.push((n, near));
        }
    }
    out
}

/// The setting closest to `name`: the one sharing most words (`GPUPOOL_LIMIT` ->
/// `GPUPOOL_MEMORY_LIMIT`), then the fewest edits (`GPUPOOL_POLL` -> `GPUPOOL_POOL`).
/// Settings users set only: the library's and the Python package's three.
fn closest(name: &str) -> &'static str {
    let words = |s: &str| -> Vec<String> { s.trim_start_matches("GPUPOOL_").split('_').map(str::to_ascii_uppercase).collect() };
    let mine = words(name);
    let upper = name.to_ascii_uppercase();
    VARIABLES
        .iter()
        .chain(&OTHER_VARIABLES[..3])
        .copied()
        .min_by_key(|v| {
            let shared = words(v).iter().filter(|w| mine.contains(w)).count();
            (std::cmp::Reverse(shared), edit_distance(&upper, v))
        })
        .expect("settings exist")
}

/// Levenshtein distance of two ASCII names.
pub(super) fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, &x) in a.iter().enumerate() {
        let mut diag = row[0];
        row[0] = i + 1;
        for (j, &y) in b.iter().enumerate() {
            let next = (diag + (x != y) as usize).min(row[j] + 1).min(row[j + 1] + 1);
            diag = row[j + 1];
            row[j + 1] = next;
        }
    }
    row[b.len()]
}

/// One line on stderr per `GPUPOOL_*` variable of the environment that nothing reads (a
/// typo, or a setting of another version), naming the setting meant most likely: such a
/// variable changes nothing, which the user would otherwise never learn. Once per process.
pub(super) fn warn_unknown_variables() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let names = std::env::vars_os().filter_map(|(k, _)| k.into_string().ok());
        for (name, near) in unknown_variables(names) {
            crate::error::warn(&format!(
                "gpupool: warning: {name} is not a gpupool setting and is ignored; did you mean {near}? (the settings: README, \"Configuration\")"
            ));
        }
    });
}
