//! Peer access on demand (Note [Peer access on demand] in `src/upstream/peers.rs`) on
//! simulated devices of the host upstream, through the C API: arena memory is granted to
//! its own device alone until a peer is enabled; enabling one grants it what is mapped then
//! in one pass, and every later grant (growth, a tag's pool made later, a resume) includes
//! it; a device with no peer enabled never grants one. `peer_grants` counts the peers
//! granted, grant by grant, as on a GPU.

use gpupool::ffi::core::gpupool_enable_peer_access;
use gpupool::ffi::tags::{gpupool_tag_begin, gpupool_tag_end, gpupool_tag_pause, gpupool_tag_resume};
use gpupool::Status;
use std::ptr::null_mut;

mod common;
use common::{last_error as last, MIB};

fn host(d: i32) {
    common::host_device_256mib(d, c"arena");
}

use common::{free_on as free, malloc_on as malloc};

/// `device`'s figure `key` under `driver_calls` (every pool of the device added up).
fn calls(d: i32, key: &str) -> u64 {
    let j = common::device_json(d);
    let from = j.find("\"driver_calls\":").expect("driver calls in the report");
    let at = j[from..].find(&format!("\"{key}\":")).unwrap_or_else(|| panic!("{key} in {j}")) + from + key.len() + 3;
    j[at..].split(|c: char| !c.is_ascii_digit()).next().unwrap().parse().unwrap()
}

fn enable(d: i32, peer: i32) -> Result<usize, (Status, String)> {
    let mut n = usize::MAX;
    match unsafe { gpupool_enable_peer_access(d, peer, &mut n) } {
        Status::Ok => Ok(n),
        st => Err((st, last())),
    }
}

fn pause_resume(d: i32, tag: &std::ffi::CStr) {
    let mut n = 0;
    assert_eq!(unsafe { gpupool_tag_pause(d, tag.as_ptr(), null_mut(), 1, &mut n) }, Status::Ok, "{}", last());
    assert_eq!(unsafe { gpupool_tag_resume(d, tag.as_ptr(), &mut n) }, Status::Ok, "{}", last());
}

#[test]
fn a_peer_is_granted_only_once_enabled_and_then_everything_at_once() {
    let (d, peer) = (50, 51);
    host(d);
    let a = malloc(8 * MIB, d);
    let b = malloc(300 * 1024, d);
    let grants = calls(d, "set_access");
    assert!(grants > 0, "growth granted the device");
    assert_eq!(calls(d, "peer_grants"), 0, "no peer is granted before one is enabled");

    let made = enable(d, peer).unwrap();
    assert!(made >= 1, "what is mapped now is granted to the peer");
    assert_eq!(calls(d, "peer_grants"), made as u64, "one pass over the mapped runs: {made}");
    assert_eq!(enable(d, peer).unwrap(), 0, "a peer enabled already costs nothing");

    let before = calls(d, "peer_grants");
    let c = malloc(64 * MIB, d);
    let growth = calls(d, "set_access") - grants;
    assert!(growth >= 1);
    assert!(calls(d, "peer_grants") > before, "a growth after the enable grants the peer with the device");

    // A tag's pool made after the enable grants the peer from its first mapping on.
    let tag = c"peer-tag";
    assert_eq!(unsafe { gpupool_tag_begin(tag.as_ptr()) }, Status::Ok, "{}", last());
    let t = malloc(4 * MIB, d);
    assert_eq!(gpupool_tag_end(), Status::Ok);
    let before = calls(d, "peer_grants");
    pause_resume(d, tag);
    assert!(calls(d, "peer_grants") > before, "a resume grants the peer its memory again");
    for p in [a, b, c, t] {
        free(p, d);
    }
}

#[test]
fn a_device_with_no_peer_enabled_never_grants_one() {
    let d = 52;
    host(d);
    let tag = c"lonely-tag";
    assert_eq!(unsafe { gpupool_tag_begin(tag.as_ptr()) }, Status::Ok, "{}", last());
    let t = malloc(40 * MIB, d);
    assert_eq!(gpupool_tag_end(), Status::Ok);
    let p = malloc(100 * MIB, d);
    for _ in 0..3 {
        pause_resume(d, tag);
    }
    assert!(calls(d, "set_access") >= 4);
    assert_eq!(calls(d, "peer_grants"), 0, "growth and resumes grant the device alone");
    free(t, d);
    free(p, d);
}

#[test]
fn bad_devices_are_refused_naming_them_and_change_nothing() {
    let d = 53;
    host(d);
    let p = malloc(MIB, d);
    for (dev, peer, names) in [(d, 64, "64"), (d, -2, "-2"), (-2, 1, "-2"), (64, 1, "64")] {
        let (st, e) = enable(dev, peer).unwrap_err();
        assert_eq!(st, Status::InvalidDevice, "{e}");
        assert!(e.contains(names), "{e}");
    }
    assert_eq!(enable(d, d).unwrap(), 0, "a device is its own peer already");
    assert_eq!(calls(d, "peer_grants"), 0);
    free(p, d);
}

#[test]
fn a_peer_enabled_while_a_tag_sleeps_is_granted_the_tags_memory_at_the_resume() {
    let (d, peer) = (54, 55);
    host(d);
    let tag = c"asleep";
    assert_eq!(unsafe { gpupool_tag_begin(tag.as_ptr()) }, Status::Ok, "{}", last());
    let t = malloc(4 * MIB, d);
    assert_eq!(gpupool_tag_end(), Status::Ok);
    let mut n = 0;
    assert_eq!(unsafe { gpupool_tag_pause(d, tag.as_ptr(), null_mut(), 1, &mut n) }, Status::Ok, "{}", last());
    enable(d, peer).unwrap();
    let before = calls(d, "peer_grants");
    assert_eq!(unsafe { gpupool_tag_resume(d, tag.as_ptr(), &mut n) }, Status::Ok, "{}", last());
    assert!(calls(d, "peer_grants") > before, "the resume granted the peer enabled during the sleep");
    free(t, d);
}
