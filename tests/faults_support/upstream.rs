//! `FaultyUpstream`: the host upstream with its driver calls failing as the shared
//! `Schedule` says, at a chosen or random step inside each virtual memory and page call,
//! noting after each call what the host really maps, reserves and backs.

use super::{another_file, first_or_later, injected, lock, mapped_of_file, write_only, Schedule};
use gpupool::error::Result;
use gpupool::stream::StreamHandle;
use gpupool::upstream::host::HostUpstream;
use gpupool::upstream::host::HOST_PAGE;
use gpupool::share::protocol::{GranuleDescriptor, FdSource, SharedGranule};
use gpupool::upstream::{AliasFail, AllocError, EventHandle, UnmapFail, Events, Ipc, Memory, VirtualMemory};
use std::sync::{Arc, Mutex};

pub struct FaultyUpstream {
    pub host: HostUpstream,
    pub s: Arc<Mutex<Schedule>>,
    pub next_event: usize,
}

impl FaultyUpstream {
    fn fail(&self, kind: &'static str) -> bool {
        lock(&self.s).fail(kind)
    }

    /// Whether this call of `kind` (a VMM or page call) fails, and if so where in its `n`
    /// steps.
    fn fail_vmm(&self, kind: &'static str, n: usize) -> Option<usize> {
        let mut s = lock(&self.s);
        s.fail(kind).then(|| s.position(n))
    }

    fn hit(&self, step: &'static str) {
        *lock(&self.s).hits.entry(step).or_default() += 1;
    }

    /// Note what the host really maps in `[addr, addr + len)` after a VMM call.
    fn sync(&self, addr: usize, len: usize) {
        let mut s = lock(&self.s);
        for g in (addr..addr + len).step_by(HOST_PAGE) {
            if self.host.vmm_is_mapped(g) {
                s.real.insert(g);
            } else {
                s.real.remove(&g);
            }
        }
        s.real_home_bytes = self.host.vmm_mapped_bytes();
        s.reserved = self.host.vmm_reserved();
        s.imports = self.host.vmm_imports();
    }

    /// Note which pages of `[addr, addr + len)` the host has decommitted, and the bytes it
    /// backs, after a call that may change them.
    fn sync_pages(&self, addr: usize, len: usize) {
        let mut s = lock(&self.s);
        if !s.pages {
            return;
        }
        for p in (addr & !(HOST_PAGE - 1)..addr + len).step_by(HOST_PAGE) {
            if self.host.is_decommitted(p) {
                s.decommitted.insert(p);
            } else {
                s.decommitted.remove(&p);
            }
        }
        s.held = self.host.held_bytes();
    }

    /// The pool must never map over memory still mapped: the driver would refuse, and books
    /// that allow it are wrong.
    fn expect_unmapped(&self, addr: usize, len: usize, what: &str) {
        let mut s = lock(&self.s);
        if let Some(g) = (addr..addr + len).step_by(HOST_PAGE).find(|g| s.real.contains(g)) {
            s.violations.push(format!("{what} over {g:#x}, which is mapped"));
        }
    }

    /// Import `d` with granule `i`'s descriptor replaced by `fd` (the host's import fails
    /// there and undoes what it did).
    fn import_with(&mut self, d: &GranuleDescriptor, fds: &FdSource, i: usize, fd: i32) -> Result<usize> {
        let FdSource::Given(given) = fds else { return Err(injected("import (descriptors fetched)")) };
        let mut mine = given.to_vec();
        mine[i] = fd;
        let r = self.host.vmm_import(d, &FdSource::Given((&mine[..]).into()));
        unsafe { libc::close(fd) };
        r
    }
}

impl Memory for FaultyUpstream {
    fn name(&self) -> &'static str {
        "faulty-host"
    }
    fn allocate(&mut self, size: usize, st: StreamHandle) -> std::result::Result<usize, AllocError> {
        if self.fail("allocate") {
            // Half the failures look like out of memory (the pool escalates), half like a
            // broken driver (reported as is).
            return Err(if size % 2 == 0 { AllocError::OutOfMemory } else { AllocError::Other(injected("allocate")) });
        }
        let r = self.host.allocate(size, st);
        self.sync_pages(0, 0);
        r
    }
    fn deallocate(&mut self, a: usize, size: usize, st: StreamHandle) -> Result<()> {
        if self.fail("deallocate") {
            return Err(injected("deallocate"));
        }
        let r = self.host.deallocate(a, size, st);
        self.sync_pages(a, size);
        r
    }
    fn page_size(&self) -> usize {
        if lock(&self.s).pages {
            self.host.page_size()
        } else {
            0
        }
    }
    fn commit(&mut self, addr: usize, len: usize) -> std::result::Result<(), AllocError> {
        // The pool recommits only pages it decommitted, which the host must have decommitted.
        if let Some(p) = (addr..addr + len).step_by(HOST_PAGE).find(|p| !self.host.is_decommitted(*p)) {
            lock(&self.s).violations.push(format!("commit over {p:#x}, which is backed"));
        }
        // The commit fails as a whole (out of memory, or a broken driver): nothing is backed.
        if let Some(k) = self.fail_vmm("commit", 2) {
            self.hit("commit");
            return Err(if k == 0 { AllocError::OutOfMemory } else { AllocError::Other(injected("commit")) });
        }
        let r = self.host.commit(addr, len);
        self.sync_pages(addr, len);
        r
    }
    fn decommit(&mut self, addr: usize, len: usize) -> std::result::Result<(), UnmapFail> {
        if let Some(p) = (addr..addr + len).step_by(HOST_PAGE).find(|p| self.host.is_decommitted(*p)) {
            lock(&self.s).violations.push(format!("decommit over {p:#x}, which is decommitted"));
        }
        let n = len / HOST_PAGE;
        // Page k's unmap fails (it and the pages after it stay backed), or its unmap
        // succeeds and the release of its memory fails (it is gone, its memory leaked); the
        // pages before it are gone.
        let r = match self.fail_vmm("decommit", 2 * n) {
            None => self.host.decommit(addr, len),
            Some(k) => {
                let (page, release) = (k / 2, k % 2 == 1);
                self.hit(match (release, page) {
                    (false, 0) => "decommit: unmap (first page)",
                    (false, _) => "decommit: unmap (later page)",
                    (true, 0) => "decommit: release (first page)",
                    (true, _) => "decommit: release (later page)",
                });
                let gone = (page + release as usize) * HOST_PAGE;
                match self.host.decommit(addr, gone) {
                    Err(f) => Err(f),
                    Ok(()) if release => {
                        lock(&self.s).leaks += 1;
                        Err(UnmapFail { unmapped: gone, leaked: HOST_PAGE, error: injected("decommit release") })
                    }
                    Ok(()) => Err(UnmapFail { unmapped: gone, leaked: 0, error: injected("decommit unmap") }),
                }
            }
        };
        self.sync_pages(addr, len);
        r
    }
    fn mem_info(&mut self) -> Result<(usize, usize)> {
        self.host.mem_info()
    }
}

impl VirtualMemory for FaultyUpstream {
    fn vmm_granule(&mut self) -> usize {
        self.host.vmm_granule()
    }
    fn vmm_reserve(&mut self, len: usize) -> Result<usize> {
        let r = self.host.vmm_reserve(len);
        self.sync(0, 0);
        r
    }
    fn vmm_unreserve(&mut self, base: usize, len: usize) -> Result<()> {
        let r = self.host.vmm_unreserve(base, len);
        self.sync(0, 0);
        r
    }
    fn vmm_map_new(&mut self, addr: usize, len: usize) -> std::result::Result<(), AllocError> {
        self.expect_unmapped(addr, len, "map");
        let n = len / HOST_PAGE;
        // Granule k's creation (an even k: out of memory), its map, or the access grant
        // over all of them (k = n) fails; the upstream undoes what it mapped (all or nothing).
        if let Some(k) = self.fail_vmm("map", 2 * n + 1) {
            if k / 2 > 0 && self.host.vmm_map_new(addr, k / 2 * HOST_PAGE).is_ok() {
                let _ = self.host.vmm_unmap(addr, k / 2 * HOST_PAGE);
            }
            return Err(match k {
                k if k == 2 * n => {
                    self.hit("map: set_access");
                    AllocError::Other(injected("set access"))
                }
                k if k % 2 == 0 => {
                    self.hit(first_or_later(k / 2, "map: create (first granule)", "map: create (later granule)"));
                    AllocError::OutOfMemory
                }
                _ => {
                    self.hit(first_or_later(k / 2, "map: map (first granule)", "map: map (later granule)"));
                    AllocError::Other(injected("map"))
                }
            });
        }
        let r = self.host.vmm_map_new(addr, len);
        self.sync(addr, len);
        r
    }
    fn vmm_map_chunk(&mut self, addr: usize, len: usize) -> std::result::Result<(), AllocError> {
        self.expect_unmapped(addr, len, "map chunk");
        // One allocation: its creation (out of memory), its map, or the access grant fails,
        // and nothing stays mapped.
        if let Some(k) = self.fail_vmm("map chunk", 3) {
            self.hit(["map chunk: create", "map chunk: map", "map chunk: set_access"][k]);
            return Err(if k == 0 { AllocError::OutOfMemory } else { AllocError::Other(injected("map chunk")) });
        }
        let r = self.host.vmm_map_chunk(addr, len);
        self.sync(addr, len);
        r
    }
    fn vmm_unmap(&mut self, addr: usize, len: usize) -> std::result::Result<(), UnmapFail> {
        let n = len / HOST_PAGE;
        // Granule k's unmap fails (it stays mapped), or its unmap succeeds and the release
        // of its memory fails (its address is gone, its memory leaked); the ones before it
        // are gone.
        let r = match self.fail_vmm("unmap", 2 * n) {
            None => self.host.vmm_unmap(addr, len),
            Some(k) => {
                self.hit(if k % 2 == 0 { "unmap: unmap" } else { "unmap: release" });
                let before = k / 2 * HOST_PAGE;
                match self.host.vmm_unmap(addr, before) {
                    Err(f) => Err(f),
                    Ok(()) if k % 2 == 0 => Err(UnmapFail { unmapped: before, leaked: 0, error: injected("unmap") }),
                    Ok(()) => match self.host.vmm_unmap(addr + before, HOST_PAGE) {
                        Err(f) => Err(UnmapFail { unmapped: before + f.unmapped, ..f }),
                        Ok(()) => {
                            lock(&self.s).leaks += 1;
                            Err(UnmapFail { unmapped: before + HOST_PAGE, leaked: HOST_PAGE, error: injected("release") })
                        }
                    },
                }
            }
        };
        self.sync(addr, len);
        r
    }
    fn vmm_alias(&mut self, homes: &[usize], to: usize) -> std::result::Result<(), AliasFail> {
        self.expect_unmapped(to, homes.len() * HOST_PAGE, "alias");
        // The map of alias `made` fails, or (made = all) the access grant over them, which
        // leaves them all in place.
        let r = match self.fail_vmm("alias", homes.len() + 1) {
            None => self.host.vmm_alias(homes, to),
            Some(made) => {
                self.hit(match made {
                    m if m == homes.len() => "alias: set_access",
                    0 => "alias: map (first)",
                    _ => "alias: map (later)",
                });
                match self.host.vmm_alias(&homes[..made], to) {
                    Err(f) => Err(f),
                    Ok(()) => Err(AliasFail { made, error: injected(if made == homes.len() { "alias access" } else { "alias" }) }),
                }
            }
        };
        self.sync(to, homes.len() * HOST_PAGE);
        r
    }
    fn vmm_unalias(&mut self, addr: usize, len: usize) -> Result<()> {
        if self.fail_vmm("unalias", 1).is_some() {
            self.hit("unalias");
            return Err(injected("unalias"));
        }
        let r = self.host.vmm_unalias(addr, len);
        self.sync(addr, len);
        r
    }
}

impl Ipc for FaultyUpstream {
    fn vmm_share_kind(&self) -> u32 {
        self.host.vmm_share_kind()
    }
    fn vmm_export(&mut self, addr: usize) -> Result<SharedGranule> {
        let step = {
            let mut s = lock(&self.s);
            s.export_step += 1;
            s.export_step - 1
        };
        // The shareable handle of the block's `step`-th granule is refused.
        if self.fail_vmm("export", 1).is_some() {
            self.hit(first_or_later(step, "export (first granule)", "export (later granule)"));
            return Err(injected("export"));
        }
        self.host.vmm_export(addr)
    }
    fn vmm_import(&mut self, d: &GranuleDescriptor, fds: &FdSource) -> Result<usize> {
        let n = d.granules.len();
        let file = d.granules[0].file.ino;
        let before = mapped_of_file(file);
        // The reservation fails (k = 0), granule i's descriptor names another file
        // (k = 1 + i) or cannot be mapped (k = 1 + n + i), or the access grant over the
        // whole range fails (k = 1 + 2n). The host's import undoes what it did on the
        // first two; the grant's failure is undone here, as the driver's upstream does.
        let r = match self.fail_vmm("import", 2 * n + 2) {
            None => self.host.vmm_import(d, fds),
            Some(0) => {
                self.hit("import: reserve");
                Err(injected("import reserve"))
            }
            Some(k) if k <= n => {
                self.hit(first_or_later(k - 1, "import: descriptor (first granule)", "import: descriptor (later granule)"));
                self.import_with(d, fds, k - 1, another_file())
            }
            Some(k) if k <= 2 * n => {
                self.hit(first_or_later(k - 1 - n, "import: map (first granule)", "import: map (later granule)"));
                let FdSource::Given(given) = fds else { return Err(injected("import (descriptors fetched)")) };
                let w = write_only(given[k - 1 - n]);
                self.import_with(d, fds, k - 1 - n, w)
            }
            Some(_) => {
                self.hit("import: set_access");
                self.host.vmm_import(d, fds).and_then(|p| {
                    assert!(self.host.vmm_unimport(p).unwrap(), "the range just imported closes");
                    Err(injected("import set access"))
                })
            }
        };
        if r.is_err() {
            let after = mapped_of_file(file);
            if after != before {
                lock(&self.s).violations.push(format!("a failed import left {} bytes of the exporter's file mapped", after.abs_diff(before)));
            }
        }
        self.sync(0, 0);
        r
    }
    fn vmm_unimport(&mut self, ptr: usize) -> Result<bool> {
        // A close the driver fails leaves the range mapped and booked, for a retry.
        if self.fail_vmm("close", 1).is_some() {
            self.hit("import: close");
            return Err(injected("import close"));
        }
        let r = self.host.vmm_unimport(ptr);
        self.sync(0, 0);
        r
    }
    fn vmm_imports(&self) -> usize {
        self.host.vmm_imports()
    }
}

impl Events for FaultyUpstream {
    fn event_create(&mut self) -> Result<EventHandle> {
        if self.fail("event create") {
            return Err(injected("event create"));
        }
        self.next_event += 1;
        Ok(self.next_event)
    }
    fn event_record(&mut self, _ev: EventHandle, _s: StreamHandle) -> Result<()> {
        if self.fail("event record") {
            return Err(injected("event record"));
        }
        Ok(())
    }
    fn event_query(&mut self, _ev: EventHandle) -> Result<bool> {
        if self.fail("event query") {
            return Err(injected("event query"));
        }
        // Busy while faults are injected (cross-stream reuse must wait), idle after.
        Ok(lock(&self.s).off)
    }
    fn event_synchronize(&mut self, _ev: EventHandle) -> Result<()> {
        if self.fail("event synchronize") {
            return Err(injected("event synchronize"));
        }
        Ok(())
    }
    fn stream_wait_event(&mut self, _s: StreamHandle, _ev: EventHandle) -> Result<()> {
        if self.fail("stream wait") {
            return Err(injected("stream wait"));
        }
        Ok(())
    }
    fn synchronize_device(&mut self) -> Result<()> {
        if self.fail("device synchronize") {
            return Err(injected("device synchronize"));
        }
        Ok(())
    }
}
