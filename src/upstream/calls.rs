//! Driver calls counted by kind. Every upstream counts the calls it makes (the CUDA ones
//! count real driver calls; the host and simulated ones count the calls they stand in
//! for), so a benchmark can check that a steady-state step makes none and the reports can
//! show where driver time went.

use std::fmt::Write;

/// Calls made so far, by kind. Plain counters: the upstream is only used under the pool's lock.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct DriverCalls {
    /// Segment allocations and frees (`cuMemAlloc`, `cuMemAllocAsync`, ... and their frees).
    pub malloc: u64,
    pub free: u64,
    /// Virtual memory management: physical allocations, mappings, access grants, address ranges.
    pub mem_create: u64,
    pub mem_release: u64,
    pub mem_map: u64,
    pub mem_unmap: u64,
    pub set_access: u64,
    pub address_reserve: u64,
    pub address_free: u64,
    /// Stream ordering.
    pub event_record: u64,
    pub event_query: u64,
    pub event_sync: u64,
    pub stream_wait: u64,
    /// `cuStreamGetId` (identity of a non-legacy stream).
    pub stream_id: u64,
    /// `cuStreamGetCaptureInfo` (is a stream capturing a CUDA graph), asked only while
    /// private pools route allocations or for CuPy's non-default streams.
    pub capture_info: u64,
    /// `cuMemExportToShareableHandle` / `cuMemImportFromShareableHandle` (IPC of arena memory).
    pub shareable: u64,
    /// `cuMemHostAlloc` of a tag's backup buffer (page-locking: the slow part of a first pause).
    pub host_alloc: u64,
    /// Peer devices granted access, summed over grants (a grant to the device and two peers
    /// counts 2; Note [Peer access on demand]). Not a call: out of `fields` and `total`.
    pub peer_grants: u64,
}

impl DriverCalls {
    /// Every counter with its JSON / report name.
    pub fn fields(&self) -> [(&'static str, u64); 17] {
        [
            ("malloc", self.malloc),
            ("free", self.free),
            ("mem_create", self.mem_create),
            ("mem_release", self.mem_release),
            ("mem_map", self.mem_map),
            ("mem_unmap", self.mem_unmap),
            ("set_access", self.set_access),
            ("address_reserve", self.address_reserve),
            ("address_free", self.address_free),
            ("event_record", self.event_record),
            ("event_query", self.event_query),
            ("event_sync", self.event_sync),
            ("stream_wait", self.stream_wait),
            ("stream_id", self.stream_id),
            ("capture_info", self.capture_info),
            ("shareable", self.shareable),
            ("host_alloc", self.host_alloc),
        ]
    }

    /// Add `o`'s counts (the shards of one device, reported as one).
    pub fn add(&mut self, o: &DriverCalls) {
        let DriverCalls {
            malloc,
            free,
            mem_create,
            mem_release,
            mem_map,
            mem_unmap,
            set_access,
            address_reserve,
            address_free,
            event_record,
            event_query,
            event_sync,
            stream_wait,
            stream_id,
            capture_info,
            shareable,
            host_alloc,
            peer_grants,
        } = *o;
        self.malloc += malloc;
        self.free += free;
        self.mem_create += mem_create;
        self.mem_release += mem_release;
        self.mem_map += mem_map;
        self.mem_unmap += mem_unmap;
        self.set_access += set_access;
        self.address_reserve += address_reserve;
        self.address_free += address_free;
        self.event_record += event_record;
        self.event_query += event_query;
        self.event_sync += event_sync;
        self.stream_wait += stream_wait;
        self.stream_id += stream_id;
        self.capture_info += capture_info;
        self.shareable += shareable;
        self.host_alloc += host_alloc;
        self.peer_grants += peer_grants;
    }

    pub fn total(&self) -> u64 {
        self.fields().iter().map(|f| f.1).sum()
    }

    /// Calls that obtain or give back memory (allocation, mapping), the ones a steady-state
    /// step must never make.
    pub fn memory_calls(&self) -> u64 {
        self.malloc + self.free + self.mem_create + self.mem_release + self.mem_map + self.mem_unmap + self.set_access
    }

    /// `{"malloc":1,...,"peer_grants":G,"total":N}` (`peer_grants` is no call: not in `total`)
    pub fn json(&self) -> String {
        let mut o = String::from("{");
        for (name, n) in self.fields() {
            let _ = write!(o, "\"{name}\":{n},");
        }
        let _ = write!(o, "\"peer_grants\":{},\"total\":{}}}", self.peer_grants, self.total());
        o
    }

    /// `malloc 1, free 0, ...` listing only the kinds that were called.
    pub fn text(&self) -> String {
        let parts: Vec<String> = self.fields().iter().filter(|f| f.1 > 0).map(|(k, n)| format!("{k} {n}")).collect();
        if parts.is_empty() {
            "none".into()
        } else {
            parts.join(", ")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn totals_and_renderings() {
        let c = DriverCalls { malloc: 2, mem_map: 3, event_record: 4, ..Default::default() };
        assert_eq!(c.total(), 9);
        assert_eq!(c.memory_calls(), 5);
        assert!(c.json().starts_with("{\"malloc\":2,") && c.json().ends_with("\"peer_grants\":0,\"total\":9}"), "{}", c.json());
        assert_eq!(c.text(), "malloc 2, mem_map 3, event_record 4");
        assert_eq!(DriverCalls::default().text(), "none");
    }
}
