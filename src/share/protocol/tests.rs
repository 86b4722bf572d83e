//! Unit tests of `share::protocol`: the descriptor's bytes, and the importer's checks of
//! what a descriptor names (pid, file identity, export record).

use super::*;
use super::record::RECORD_SLOTS;

fn desc() -> GranuleDescriptor {
    GranuleDescriptor {
        kind: KIND_CUDA,
        pid: 77,
        start_time: 12345,
        record: RecordRef { fd: 5, slot: 3, token: 0xfeed },
        device: 1,
        granule: 2 << 20,
        offset: 4096,
        size: 3 << 20,
        origin: 0x7f00_0000_0000,
        handover: 0x1234_5678_9abc_def0,
        flags: FLAG_PAUSABLE,
        granules: vec![
            SharedGranule { fd: 9, offset: 0, file: FileId { dev: 3, ino: 40 } },
            SharedGranule { fd: 12, offset: 0, file: FileId { dev: 3, ino: 41 } },
        ],
    }
}

#[test]
fn a_descriptor_round_trips_and_damage_is_refused() {
    let d = desc();
    let b = d.encode();
    assert_eq!(b.len(), d.encoded_len());
    assert_eq!(GranuleDescriptor::decode(&b).unwrap(), d);
    assert!(GranuleDescriptor::decode(&b[..b.len() - 1]).is_err(), "truncated");
    let mut wrong = b.clone();
    wrong[0] ^= 1;
    assert!(GranuleDescriptor::decode(&wrong).is_err(), "magic");
    let mut big = d.clone();
    big.size = 4 << 20; // 4096 + 4 MiB > two granules
    assert!(GranuleDescriptor::decode(&big.encode()).is_err(), "block past its granules");
    let mut odd = d.clone();
    odd.granule = 3 << 20;
    assert!(GranuleDescriptor::decode(&odd.encode()).is_err(), "granule not a power of two");
    let mut kind = d;
    kind.kind = 9;
    assert!(GranuleDescriptor::decode(&kind.encode()).is_err(), "unknown kind");
    assert!(GranuleDescriptor::decode(&[]).is_err());
    // Numbers chosen to wrap: offset + size past 2^64 must not read as fitting.
    let mut wrap = desc();
    wrap.offset = 4096;
    wrap.size = u64::MAX - 100;
    assert!(GranuleDescriptor::decode(&wrap.encode()).is_err(), "offset + size wraps");
    let mut huge = desc();
    huge.granule = 1 << 63;
    huge.size = 1 << 20;
    assert!(GranuleDescriptor::decode(&huge.encode()).is_err(), "granule * count past 2^64 is refused, not wrapped");
}

/// A pipe, closed when dropped: its ends stand in for an exported allocation's descriptor.
struct Pipe([i32; 2]);

impl Pipe {
    fn new() -> Pipe {
        let mut p = [0i32; 2];
        // SAFETY: a writable two-int array.
        assert_eq!(unsafe { libc::pipe(p.as_mut_ptr()) }, 0);
        Pipe(p)
    }
}

impl std::ops::Index<usize> for Pipe {
    type Output = i32;
    fn index(&self, i: usize) -> &i32 {
        &self.0[i]
    }
}

impl Drop for Pipe {
    fn drop(&mut self) {
        // SAFETY: our own pipe's descriptors.
        unsafe {
            libc::close(self.0[0]);
            libc::close(self.0[1]);
        }
    }
}

/// A descriptor of this process sharing `g`, recorded as a live export.
fn exported(g: SharedGranule) -> GranuleDescriptor {
    let pid = std::process::id();
    let record = ExportRecord::add(&[g]).unwrap();
    GranuleDescriptor { kind: KIND_HOST, pid, start_time: start_time_of(pid), record, device: 0, granule: 4096, offset: 0, size: 1, origin: 0, handover: 0, flags: 0, granules: vec![g] }
}

#[test]
fn an_export_no_longer_recorded_is_not_fetched_from() {
    let p = Pipe::new();
    let g = SharedGranule { fd: p[1], offset: 0, file: FileId::of(p[1]).unwrap() };
    let d = exported(g);
    match FdSource::fetch_from(&d) {
        Ok(src) => {
            assert!(src.get(0, &g).is_ok(), "a live export is fetched");
            // Its granule released: the record ends the export first, so the source
            // opened before refuses the next fetch, and a new one refuses to open.
            ExportRecord::granule_released(p[1], 0);
            assert!(src.get(0, &g).unwrap_err().to_string().contains("no longer exports"));
            assert!(FdSource::fetch_from(&d).err().is_some_and(|e| e.to_string().contains("no longer exports")));
            // A forged token in a live slot is refused too.
            let live = exported(g);
            let forged = GranuleDescriptor { record: RecordRef { token: live.record.token ^ 1, ..live.record }, ..live.clone() };
            assert!(FdSource::fetch_from(&forged).err().is_some_and(|e| e.to_string().contains("no longer exports")));
            // A record descriptor that is not the exporter's record.
            let wrong = GranuleDescriptor { record: RecordRef { fd: p[0], ..live.record }, ..live };
            assert!(FdSource::fetch_from(&wrong).err().is_some_and(|e| e.to_string().contains("not process")));
        }
        Err(e) => assert!(e.to_string().contains("pidfd"), "{e}"),
    }
}

#[test]
fn stale_forged_and_reused_pid_descriptors_are_refused() {
    let mut a = [0i32; 2];
    let mut b = [0i32; 2];
    // SAFETY: writable two-int arrays.
    assert_eq!(unsafe { libc::pipe(a.as_mut_ptr()) }, 0);
    assert_eq!(unsafe { libc::pipe(b.as_mut_ptr()) }, 0);
    let exported_granule = SharedGranule { fd: a[1], offset: 0, file: FileId::of(a[1]).unwrap() };
    let d = super::tests::exported(exported_granule);
    let exported = exported_granule;
    // Stale: the number now names another file (the block was freed, the number reused).
    // SAFETY: dup2 onto our own descriptor.
    assert_eq!(unsafe { libc::dup2(b[1], a[1]) }, a[1]);
    let pid = std::process::id();
    match FdSource::fetch_from(&d) {
        Ok(src) => {
            let e = src.get(0, &exported).unwrap_err().to_string();
            assert!(e.contains("stale") && e.contains("inode"), "{e}");
        }
        Err(e) => assert!(e.to_string().contains("pidfd"), "{e}"),
    }
    // Passed in by the caller: checked the same way.
    let given = [a[1]];
    assert!(FdSource::Given((&given[..]).into()).get(0, &exported).unwrap_err().to_string().contains("stale"));
    // Forged: an identity nobody exported.
    let forged = SharedGranule { file: FileId { dev: 1, ino: 2 }, ..exported };
    assert!(FdSource::Given((&given[..]).into()).get(0, &forged).is_err());
    // A reused pid: the process with it started at another time.
    assert!(start_time_of(pid) > 0, "this process's start time is readable");
    if let Err(e) = FdSource::fetch_from(&GranuleDescriptor { start_time: d.start_time + 1, ..d.clone() }) {
        let e = e.to_string();
        assert!(e.contains("not the exporter") || e.contains("pidfd"), "{e}");
    } else {
        panic!("a process started at another time was taken for the exporter");
    }
    // SAFETY: our own pipes.
    unsafe {
        for fd in [a[0], a[1], b[0], b[1]] {
            libc::close(fd);
        }
    }
}

#[test]
fn fetching_from_this_process_gives_new_descriptors_to_the_same_file() {
    let p = Pipe::new();
    let pid = std::process::id();
    let shared = |fd: i32| SharedGranule { fd, offset: 0, file: FileId::of(fd).unwrap() };
    let d = exported(shared(p[1]));
    assert_eq!(d.pid, pid);
    match FdSource::fetch_from(&d).and_then(|src| src.get(0, &shared(p[1])).map(|got| (src, got))) {
        Ok((src, (fd, guard))) => {
            assert_ne!(fd, p[1]);
            assert_eq!(guard.as_ref().map(Fd::raw), Some(fd), "a fetched descriptor is closed by its guard");
            assert!(src.get(1, &SharedGranule { fd: -1, ..shared(p[1]) }).is_err(), "a bad descriptor number is an error");
            // SAFETY: writing one byte through the fetched copy, reading it at the other end.
            unsafe {
                assert_eq!(libc::write(fd, b"x".as_ptr().cast(), 1), 1);
                let mut c = 0u8;
                assert_eq!(libc::read(p[0], (&mut c as *mut u8).cast(), 1), 1);
                assert_eq!(c, b'x');
            }
        }
        // A kernel before 5.6 or a sandbox without pidfd: the error must say so.
        Err(e) => assert!(e.to_string().contains("pidfd"), "{e}"),
    }
    let given = [p[0], p[1]];
    let src = FdSource::Given((&given[..]).into());
    assert_eq!(src.get(1, &shared(p[1])).unwrap().0, p[1], "a given descriptor is the caller's, by position");
    assert!(src.get(1, &shared(p[1])).unwrap().1.is_none(), "and not closed by gpupool");
    assert!(src.get(2, &shared(p[1])).is_err(), "one too few");
}

#[test]
fn an_importer_may_pass_one_descriptor_per_allocation_in_the_order_the_granules_name_them() {
    let g = |fd, offset| SharedGranule { fd, offset, file: FileId { dev: 3, ino: fd as u64 } };
    let mut d = desc();
    // A granule, a chunk of three, the first granule's file again (a second view of it), a
    // granule; the exporter's numbers first named in an order that is not theirs sorted.
    d.granules = vec![g(30, 0), g(12, 0), g(12, 2 << 20), g(12, 4 << 20), g(30, 0), g(9, 0)];
    // One per granule: as given.
    let per = [101, 102, 102, 102, 101, 103];
    assert_eq!(&*d.per_granule(&per).unwrap(), &per);
    // Each exporter number once, in the order the granules first name them: spread over
    // the granules (30 -> 101, 12 -> 102, 9 -> 103).
    assert_eq!(&*d.per_granule(&[101, 102, 103]).unwrap(), &per);
    // Any other count is refused (too few, too many, or neither form).
    for bad in [&[101, 102][..], &[101, 102, 103, 104][..], &[][..]] {
        assert!(d.per_granule(bad).is_none(), "{bad:?}");
    }
}

#[test]
fn a_released_granule_ends_the_exports_that_share_it_and_no_other() {
    // GranuleDescriptor numbers no other test uses: the record is the process's.
    let g = |fd: i32, offset: u64| SharedGranule { fd, offset, file: FileId { dev: 0, ino: 0 } };
    let (a, b, c) = (g(900_001, 0), g(900_001, 2 << 20), g(900_002, 0));
    let ab = ExportRecord::add(&[a, b]).unwrap();
    let bc = ExportRecord::add(&[b, c]).unwrap();
    let c_only = ExportRecord::add(&[c]).unwrap();
    ExportRecord::granule_released(a.fd, a.offset);
    assert!(!ExportRecord::is_live(ab), "the export that shared the granule ended");
    assert!(ExportRecord::is_live(bc) && ExportRecord::is_live(c_only), "the others did not");
    // A new export (which may take the ended one's slot) of a granule the ended export did
    // not share outlives the release of one it did.
    let again = ExportRecord::add(&[c]).unwrap();
    ExportRecord::granule_released(b.fd, b.offset);
    assert!(!ExportRecord::is_live(bc));
    assert!(ExportRecord::is_live(again) && ExportRecord::is_live(c_only), "exports of other granules stay");
    ExportRecord::granule_released(c.fd, c.offset);
    assert!(!ExportRecord::is_live(again) && !ExportRecord::is_live(c_only));
}

#[test]
fn an_export_that_lists_a_granule_twice_gives_its_slot_back_once() {
    let g = |fd: i32, offset: u64| SharedGranule { fd, offset, file: FileId { dev: 0, ino: 0 } };
    let (a, b, c) = (g(900_011, 0), g(900_012, 0), g(900_013, 0));
    let twice = ExportRecord::add(&[a, b, a]).unwrap();
    ExportRecord::granule_released(a.fd, a.offset);
    assert!(!ExportRecord::is_live(twice));
    // Two later exports get slots of their own: neither overwrites the other.
    let (x, y) = (ExportRecord::add(&[b]).unwrap(), ExportRecord::add(&[c]).unwrap());
    assert_ne!(x.slot, y.slot);
    assert!(ExportRecord::is_live(x) && ExportRecord::is_live(y));
    ExportRecord::granule_released(b.fd, b.offset);
    ExportRecord::granule_released(c.fd, c.offset);
}

#[test]
fn an_open_mark_past_the_last_slot_is_refused_before_it_reaches_the_keepers() {
    let p = Pipe::new();
    let g = SharedGranule { fd: p[1], offset: 0, file: FileId::of(p[1]).unwrap() };
    let d = exported(g);
    match Exporter::open(&d) {
        Ok(e) => {
            assert!(e.mark_open(d.record).is_ok(), "a live slot is counted");
            // The keepers' wake word and entries follow the last slot: a forged slot number
            // naming them is refused.
            for slot in [RECORD_SLOTS, RECORD_SLOTS + 1, RECORD_SLOTS + 200] {
                let forged = RecordRef { slot, ..d.record };
                let err = e.mark_open(forged).err().expect("a slot past the last one is refused");
                assert!(err.to_string().contains("outside the opens file"), "{err}");
            }
        }
        Err(e) => assert!(e.to_string().contains("pidfd"), "{e}"),
    }
}
