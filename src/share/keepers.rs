//! This process as a keeper of other processes' pausable memory, and this process's pause
//! as an exporter waiting for its keepers (Note [Keeping imports mapped]).
//!
//! A receiver keeps idle mappings of a sender's tag memory so that the next message over the
//! same allocations costs no driver call. The sender's pause must get that memory back: it
//! releases the memory (which makes every kept mapping of it stale), wakes its keepers
//! through its opens file (`protocol::opens_file::Keepers`) and waits until none keeps an
//! idle mapping. Here: the receiver's watcher, one thread per process, which sleeps on its
//! exporters' wake words and drops its stale idle mappings on every device when one moves;
//! and the sender's wait.

use crate::registry;
use crate::share::protocol::{keepers, ExportRecord};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a pause waits for its keepers to drop their idle mappings: a watcher answers in
/// the time its unmaps take, and each waits for its device to finish the work queued
/// before it, so a receiver whose device is busy for longer (or a stopped process, under a
/// debugger or SIGSTOP) reaches it. The pause then returns, warning: what such a keeper
/// keeps goes when it drops it.
pub const KEEPERS_WAIT: Duration = Duration::from_secs(2);

/// The pid whose watcher runs (0: none; a forked child starts its own).
static WATCHING: Mutex<u32> = Mutex::new(0);

/// Start this process's watcher where none runs: called after an import of pausable memory
/// by pid, by the entry points that import into the registry's pools (`descriptor.rs`), the
/// pools the watcher drops stale imports in.
pub fn watch() {
    let mut pid = WATCHING.lock().unwrap_or_else(|e| e.into_inner());
    if *pid == std::process::id() {
        return;
    }
    let spawned = std::thread::Builder::new().name("gpupool-keeper".into()).spawn(watcher);
    match spawned {
        Ok(_) => *pid = std::process::id(),
        Err(e) => crate::error::warn(&format!(
            "starting the thread that gives senders' paused memory back failed ({e}); their pauses wait {} s for this \
             process, then leave what it keeps mapped to its next import or close",
            KEEPERS_WAIT.as_secs()
        )),
    }
}

/// The watcher's loop: wait on the wake word of an exporter this process keeps mappings of
/// (the first, polling the others), and drop every device's stale idle imports when one
/// moved. The exporters' releases make the mappings stale; the drop counts them out. Ends
/// once this process keeps nothing for a while (the next import starts another).
fn watcher() {
    // A watcher that panics lets the next import start another.
    struct Ended;
    impl Drop for Ended {
        fn drop(&mut self) {
            if std::thread::panicking() {
                *WATCHING.lock().unwrap_or_else(|e| e.into_inner()) = 0;
            }
        }
    }
    let _ended = Ended;
    // (keeper's file, its wake word when last read)
    let mut seen: Vec<((u64, u64), u32)> = Vec::new();
    let mut idle_rounds = 0;
    loop {
        let now = keepers();
        if now.is_empty() {
            idle_rounds += 1;
            if idle_rounds >= 5 {
                let mut pid = WATCHING.lock().unwrap_or_else(|e| e.into_inner());
                // Checked again under the lock that `watch` takes after each import: a
                // keeper made since is seen here, or its import's `watch` starts a watcher.
                if keepers().is_empty() {
                    *pid = 0;
                    return;
                }
            }
            std::thread::sleep(Duration::from_millis(200));
            continue;
        }
        idle_rounds = 0;
        let mut moved = false;
        let mut next = Vec::with_capacity(now.len());
        for k in &now {
            let word = k.wake_word();
            // A keeper not seen before counts as moved: its exporter may have released
            // before this thread first read its word.
            if seen.iter().find(|s| s.0 == k.id()).map(|s| s.1) != Some(word) {
                moved = true;
            }
            next.push((k.id(), word));
        }
        seen = next;
        if moved {
            drop_stale_everywhere();
            continue;
        }
        // One exporter (an RL trainer): woken by its futex. Several: the first's futex,
        // the others polled.
        let wait = if now.len() == 1 { Duration::from_millis(500) } else { Duration::from_millis(20) };
        now[0].wait(seen[0].1, wait);
    }
}

/// Drop the idle imports that may not serve again, on every device.
fn drop_stale_everywhere() {
    for device in registry::existing_devices() {
        let _ = registry::with_existing(device, |p| p.importer().drop_stale());
    }
}

/// This process's release count of exported memory, before a pause.
pub fn releases() -> u64 {
    ExportRecord::own_releases().unwrap_or(0)
}

/// After a pause: where it released exported memory (the count moved from `before`), wake
/// the keepers and wait for them to let go. Returns the keepers still keeping idle mappings
/// once `KEEPERS_WAIT` has passed, as (pid, mappings), warned about (the memory they keep
/// stays alive until they drop it; they never serve it again).
pub fn let_go_since(before: u64) -> Vec<(u32, u32)> {
    if releases() == before {
        return Vec::new();
    }
    ExportRecord::wake_keepers();
    let start = Instant::now();
    let mut pause = Duration::from_micros(20);
    loop {
        let keeping = ExportRecord::keeping();
        if keeping.is_empty() {
            return keeping;
        }
        if start.elapsed() >= KEEPERS_WAIT {
            crate::error::warn(&format!(
                "pause: process(es) {} still keep mappings of the paused memory after {} s (a stopped process?); the \
                 device gets it back when they drop them",
                keeping.iter().map(|(p, n)| format!("{p} ({n})")).collect::<Vec<_>>().join(", "),
                KEEPERS_WAIT.as_secs()
            ));
            return keeping;
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(2));
    }
}
