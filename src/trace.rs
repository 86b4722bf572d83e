//! The event trace (`GPUPOOL_TRACE=path.csv`): one CSV row per pool event, written by a
//! background thread so the hot path only sends a small record down a channel.
//!
//! Columns: `time_ns,thread,device,stream,action,ptr,size`; actions: `alloc`, `free`,
//! `upstream_alloc`, `upstream_free`, `page_commit`, `page_decommit` (pages backed again /
//! given back inside a segment), `reclaim`, `oom`. `gpupool-replay` reads this format and
//! replays the user's actions in it: `alloc`, `free`, `reclaim`.

use crate::error::{Error, Result};
use std::io::Write;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::Instant;

pub const HEADER: &str = "time_ns,thread,device,stream,action,ptr,size";

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Action {
    Alloc,
    Free,
    UpstreamAlloc,
    UpstreamFree,
    PageCommit,
    PageDecommit,
    /// The arena mapped free granules' memory at a new range `ptr` (a stitch).
    Stitch,
    Reclaim,
    Oom,
}

impl Action {
    pub fn name(self) -> &'static str {
        match self {
            Action::Alloc => "alloc",
            Action::Free => "free",
            Action::UpstreamAlloc => "upstream_alloc",
            Action::UpstreamFree => "upstream_free",
            Action::PageCommit => "page_commit",
            Action::PageDecommit => "page_decommit",
            Action::Stitch => "stitch",
            Action::Reclaim => "reclaim",
            Action::Oom => "oom",
        }
    }
    pub fn parse(s: &str) -> Option<Action> {
        Some(match s {
            "alloc" => Action::Alloc,
            "free" => Action::Free,
            "upstream_alloc" => Action::UpstreamAlloc,
            "upstream_free" => Action::UpstreamFree,
            "page_commit" => Action::PageCommit,
            "page_decommit" => Action::PageDecommit,
            "stitch" => Action::Stitch,
            "reclaim" => Action::Reclaim,
            "oom" => Action::Oom,
            _ => return None,
        })
    }
}

struct Row {
    t: u64,
    thread: u64,
    device: i32,
    stream: usize,
    action: Action,
    ptr: usize,
    size: usize,
}

impl std::fmt::Debug for Tracer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Tracer")
    }
}

pub struct Tracer {
    tx: Mutex<Option<Sender<Row>>>,
    writer: Mutex<Option<JoinHandle<()>>>,
    start: Instant,
}

static NEXT_THREAD: AtomicU64 = AtomicU64::new(1);
thread_local! {
    static THREAD_ID: u64 = NEXT_THREAD.fetch_add(1, Ordering::Relaxed);
}

impl Tracer {
    /// Open `path` (truncating) and start the writer thread.
    pub fn open(path: &Path) -> Result<Tracer> {
        let file = std::fs::File::create(path).map_err(|e| Error::UnusableConfig {
            var: "GPUPOOL_TRACE",
            value: path.display().to_string(),
            why: format!("{e}; accepted: a path to a file that can be created and written"),
        })?;
        let (tx, rx) = channel::<Row>();
        let writer = std::thread::Builder::new()
            .name("gpupool-trace".into())
            .spawn(move || {
                let mut w = std::io::BufWriter::with_capacity(1 << 20, file);
                let _ = writeln!(w, "{HEADER}");
                for r in rx {
                    let _ = writeln!(
                        w,
                        "{},{},{},{:#x},{},{:#x},{}",
                        r.t,
                        r.thread,
                        r.device,
                        r.stream,
                        r.action.name(),
                        r.ptr,
                        r.size
                    );
                }
                let _ = w.flush();
            })
            .map_err(|e| Error::Internal(format!("cannot start the trace writer thread: {e}")))?;
        Ok(Tracer { tx: Mutex::new(Some(tx)), writer: Mutex::new(Some(writer)), start: Instant::now() })
    }

    pub fn record(&self, device: i32, stream: usize, action: Action, ptr: usize, size: usize) {
        let row = Row {
            t: self.start.elapsed().as_nanos() as u64,
            thread: THREAD_ID.try_with(|t| *t).unwrap_or(0),
            device,
            stream,
            action,
            ptr,
            size,
        };
        if let Some(tx) = self.tx.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            let _ = tx.send(row);
        }
    }

    /// Stop accepting rows, write everything queued and close the file.
    pub fn finish(&self) {
        drop(self.tx.lock().unwrap_or_else(|p| p.into_inner()).take());
        if let Some(h) = self.writer.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = h.join();
        }
    }
}

static GLOBAL: OnceLock<Result<Option<Tracer>>> = OnceLock::new();

/// The process tracer named by `GPUPOOL_TRACE` (None when unset); opened once.
pub fn global() -> Result<Option<&'static Tracer>> {
    let cfg = crate::config::get()?;
    GLOBAL
        .get_or_init(|| {
            let t = match &cfg.trace {
                None => None,
                Some(p) => Some(Tracer::open(p)?),
            };
            if t.is_some() {
                crate::process::on_exit(finish_global);
            }
            Ok(t)
        })
        .as_ref()
        .map(Option::as_ref)
        .map_err(Clone::clone)
}

/// Why `GPUPOOL_TRACE`'s file could not be opened, once a pool tried (`global`); None
/// before that or when it opened. Opens nothing.
pub fn open_error() -> Option<crate::error::Error> {
    match GLOBAL.get() {
        Some(Err(e)) => Some(e.clone()),
        _ => None,
    }
}

/// At exit: flush the trace file.
pub fn finish_global() {
    if let Some(Ok(Some(t))) = GLOBAL.get() {
        t.finish();
    }
}
