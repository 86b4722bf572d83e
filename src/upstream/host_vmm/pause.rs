//! Pausing the host stand-in's memory as the CUDA address space pauses it
//! (`crate::upstream::cuda::address_space`'s `pause.rs`): contents copied out where asked,
//! every granule unmapped (homes and aliases) and its file pages punched out, the address
//! space still reserved and inaccessible; a resume maps new pages at the same addresses
//! and copies the contents back. A test that touches paused memory crashes, as a kernel
//! faults on the GPU.

use super::HostVmm;
use crate::error::{Error, Result};

/// What a pause released, for the resume.
pub struct HostPaused {
    /// Home granules, in address order.
    homes: Vec<usize>,
    /// Alias granules and the home each shows.
    aliases: Vec<(usize, usize)>,
    /// The homes' contents, in their order.
    backup: Option<Vec<u8>>,
}

impl HostVmm {
    pub fn is_paused(&self) -> bool {
        self.paused.is_some()
    }

    pub fn paused_bytes(&self) -> usize {
        self.paused.as_ref().map_or(0, |p| p.homes.iter().filter(|h| !self.mapped.contains_key(h)).count() * self.granule)
    }

    /// Pause every granule mapped here (module docs); returns the bytes released.
    pub fn pause(&mut self, backup: bool) -> Result<usize> {
        if self.paused.is_some() {
            return Err(Error::InvalidArgument("pause: this memory is paused already".into()));
        }
        let g = self.granule;
        let mut homes: Vec<usize> = self.mapped.keys().copied().collect();
        homes.sort_unstable();
        let backup = backup.then(|| {
            // The kept buffer where it is large enough (as the GPU's page-locked one).
            let kept = self.kept_backup.take().filter(|b| b.capacity() >= homes.len() * g);
            let mut b = kept.unwrap_or_else(|| {
                self.backup_allocs += u64::from(!homes.is_empty());
                Vec::new()
            });
            b.clear();
            b.reserve_exact(homes.len() * g);
            for &h in &homes {
                // SAFETY: a mapped granule of ours, readable.
                b.extend_from_slice(unsafe { std::slice::from_raw_parts(h as *const u8, g) });
            }
            b
        });
        let mut aliases: Vec<(usize, usize)> = self.aliases.iter().map(|(&a, &h)| (a, h)).collect();
        aliases.sort_unstable();
        // On record before the first unmap: a failure midway leaves a pause the resume
        // undoes whole (it maps every home and alias again).
        self.paused = Some(HostPaused { homes: homes.clone(), aliases: aliases.clone(), backup });
        for &(a, _) in &aliases {
            self.unmap_at(a)?;
        }
        for &h in &homes {
            let off = self.mapped[&h];
            self.unmap_at(h)?;
            if let Some(fd) = self.fd {
                crate::share::protocol::ExportRecord::granule_released(fd, off as u64);
            }
            self.release_offset(off);
        }
        Ok(self.paused_bytes())
    }

    /// Map new memory where `pause` released it and copy the backup back; returns the bytes.
    pub fn resume(&mut self) -> Result<usize> {
        let Some(p) = self.paused.take() else { return Ok(0) };
        if let Err(e) = self.map_paused(&p) {
            self.paused = Some(p); // a later resume maps it all again
            return Err(e);
        }
        let g = self.granule;
        if let Some(b) = &p.backup {
            for (i, &h) in p.homes.iter().enumerate() {
                // SAFETY: a granule mapped just now, writable; the backup holds it in order.
                unsafe { std::ptr::copy_nonoverlapping(b.as_ptr().add(i * g), h as *mut u8, g) };
            }
        }
        // Kept for the next pause, as the GPU keeps its page-locked buffer.
        self.kept_backup = p.backup;
        Ok(p.homes.len() * g)
    }

    /// The kept buffer made as large as what is mapped now; returns its bytes.
    pub fn prepare_backup(&mut self) -> Result<usize> {
        if self.paused.is_some() {
            return Err(Error::InvalidArgument("prepare_backup: this memory is paused; resume it first".into()));
        }
        let want = self.mapped.len() * self.granule;
        let b = self.kept_backup.get_or_insert_with(Vec::new);
        if b.capacity() < want {
            self.backup_allocs += 1;
            b.reserve_exact(want - b.len());
        }
        Ok(b.capacity())
    }

    /// Give the kept buffer back; returns its bytes.
    pub fn drop_backup(&mut self) -> usize {
        self.kept_backup.take().map_or(0, |b| b.capacity())
    }

    /// New pages under every home of `p` (over any left mapped) and the aliases again.
    fn map_paused(&mut self, p: &HostPaused) -> Result<()> {
        for &h in &p.homes {
            let off = self.new_offset()?;
            self.map_at(h, off)?;
        }
        for &(a, h) in &p.aliases {
            let off = self.mapped[&h];
            self.map_at(a, off)?;
            self.mapped.remove(&a); // `map_at` books homes; an alias is booked apart
        }
        Ok(())
    }
}
