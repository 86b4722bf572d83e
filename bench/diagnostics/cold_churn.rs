//! The churn workload's allocation sequence through the C API on the host upstream, with the
//! CPU caches thrashed between operations (as a PyTorch program's Python and kernel launches
//! do between two allocator calls): what each pool costs per operation when its books are
//! cold. `cargo run --release --example cold_churn -- [POOL] [THRASH_KIB]`; `PASSES=N`
//! times N passes of the sequence after the untimed first one, `OPS=N` times N operations.
use gpupool::ffi::core::{gpupool_configure, gpupool_free, gpupool_malloc, gpupool_stats_json};
use std::ptr::null_mut;
use std::time::Instant;

#[path = "../criterion/common/churn_sequence.rs"]
mod churn_sequence;

fn main() {
    let pool = std::env::args().nth(1).unwrap_or("arena".into());
    let thrash_kib: usize = std::env::args().nth(2).and_then(|s| s.parse().ok()).unwrap_or(4096);
    let cpool = std::ffi::CString::new(pool.clone()).unwrap();
    unsafe { gpupool_configure(0, cpool.as_ptr(), c"host".as_ptr()) };
    // The criterion benchmark's churn sequence: its first 256 sizes fill the slots.
    let all = churn_sequence::churn_sequence(256 + 65_536);
    let mut slots = [null_mut(); 256];
    for (s, &(_, size)) in slots.iter_mut().zip(&all[..256]) {
        unsafe { gpupool_malloc(s, size, 0, null_mut()) };
    }
    let mut junk = vec![1u8; thrash_kib << 10];
    let (mut busy, mut sum) = (std::time::Duration::ZERO, 0u64);
    // One sequence of 65,536 replacements, run twice; the second pass is timed (the first
    // made the stitches it needs, as a repeating program's warm-up does).
    let seq = &all[256..];
    let calls = || {
        let mut buf = vec![0u8; 1 << 16];
        let n = unsafe { gpupool_stats_json(0, buf.as_mut_ptr().cast(), buf.len()) };
        let t = String::from_utf8_lossy(&buf[..n.min(buf.len())]).to_string();
        let i = t.find("\"total\":").expect("driver call total");
        t[i + 8..].chars().take_while(|c| c.is_ascii_digit()).collect::<String>().parse::<u64>().unwrap()
    };
    for &(slot, sz) in seq {
        unsafe {
            gpupool_free(slots[slot], 0, null_mut());
            gpupool_malloc(&mut slots[slot], sz, 0, null_mut());
        }
    }
    let before = calls();
    let passes: usize = std::env::var("PASSES").ok().and_then(|v| v.parse().ok()).unwrap_or(1);
    let n = std::env::var("OPS").ok().and_then(|v| v.parse().ok()).unwrap_or(seq.len() * passes);
    for (i, &(slot, sz)) in seq.iter().cycle().take(n).enumerate() {
        // Thrash: touch every cache line of `junk`.
        for j in (0..junk.len()).step_by(64) {
            junk[j] = junk[j].wrapping_add(i as u8);
            sum += junk[j] as u64;
        }
        let t = Instant::now();
        unsafe {
            gpupool_free(slots[slot], 0, null_mut());
            gpupool_malloc(&mut slots[slot], sz, 0, null_mut());
        }
        busy += t.elapsed();
    }
    println!("{pool}: {:.0} ns per free+malloc pair with {thrash_kib} KiB touched between pairs; {} driver calls in the timed pass (checksum {})", busy.as_nanos() as f64 / n as f64, calls() - before, sum % 7);
}
