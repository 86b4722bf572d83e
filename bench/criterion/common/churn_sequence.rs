//! The churn workload shared by `bench/criterion/malloc_free.rs` (`c_api/churn_step`, `churn/*`) and
//! `bench/diagnostics/instr_per_step.rs` (`churn`, `cupychurn`), so the criterion timings and the
//! callgrind instruction counts measure the same sequence. Included by `#[path]`: cargo
//! does not build files in a bench's subfolders as benches of their own.

/// (slot, size) pairs: a slot of 256 to free and refill, and a log-uniform size in
/// [512 B, 32 MiB]. A fixed splitmix64 stream, so every run (and every strategy) sees the
/// same sequence.
pub fn churn_sequence(n: usize) -> Vec<(usize, usize)> {
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    let (lo, hi) = ((512f64).ln(), ((32u64 << 20) as f64).ln());
    (0..n)
        .map(|_| {
            let slot = (next() % 256) as usize;
            let u = (next() >> 11) as f64 / (1u64 << 53) as f64;
            (slot, (lo + u * (hi - lo)).exp() as usize)
        })
        .collect()
}
