// gpupool as PyTorch's CUDA allocator: a c10::cuda::CUDACachingAllocator::CUDAAllocator
// compiled against the installed PyTorch (python/gpupool/_torch_allocator.py builds it
// once per PyTorch version and source) and installed with PyTorch's own
// changeCurrentAllocator.
//
// Note [gpupool's PyTorch allocator]
//
// Rationale: PyTorch's plug-in class (CUDAPluggableAllocator) forwards only allocation,
// free and a few hooks, and raises for the rest of the allocator interface: cuDNN's
// benchmark mode (cacheInfo), torch.cuda.memory_allocated / memory_stats / snapshots /
// memory history, MemPool and the CUDA IPC route of torch.multiprocessing. Ordinary
// training scripts call these; a class of our own answers every one of them.
//
// Approach: memory comes from libgpupool.so (one pool per device, shared with CuPy and C);
// this class keeps PyTorch's books beside it, as PyTorch's own allocator does: a map of
// its live allocations (requested size, block size, stream, private pool, the stack that
// allocated it while history is recorded) and PyTorch's statistics (DeviceStats) under one
// mutex per device. Figures only the pool knows (reserved memory, segments, cached blocks,
// driver calls) are read from it when asked. Private pools (CUDA graphs, MemPool) are the
// library's; a MemPool built over another allocator takes its allocations from that one.
//
// Implementation: the functions of libgpupool.so come in as addresses (gpupool_torch_-
// allocator_install) so that this library can never reach another copy of the pool than
// the one Python loaded. Out of memory throws c10::OutOfMemoryError (torch.OutOfMemoryError)
// with the pool's report after telling PyTorch's observers. Sharing speaks PyTorch's own
// handle formats (gpupool_ipc_export_torch / gpupool_ipc_open_torch; the library's Note
// [PyTorch's handle formats]): a receiver on PyTorch's allocator opens what this class
// sends, and this class opens what PyTorch's allocator sends.
//
// Limitations: allocated_bytes counts the pool's blocks; a small block (up to 1 MiB) is
// counted as its request in 512-byte units, the split and arena pools' unit (the binned
// pool rounds small blocks further, seen in reserved_bytes). Reserved memory, segments and cached
// blocks are the pool's, shared by every framework in the process, reported under
// large_pool (the pool does not divide them by size class). The trace holds allocations and
// frees, not the pool's segment calls. Checkpointing a private pool (CUDA-graph trees'
// getCheckpointState / setCheckpointPoolState) is refused with an error; gpupool.torch's
// install() turns graph trees off. setNoSplit is accepted and changes nothing: the library's
// private pools always split.
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAMacros.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/ApproximateClock.h>
#include <c10/util/Exception.h>
#include <c10/util/flat_hash_map.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <cuda_runtime_api.h>

// The library's C API (declarations, the stats struct, status codes), as C programs see
// it: generated from its Rust sources.
#include "gpupool.h"
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_set>
#include <utility>
#include <vector>

namespace {

namespace cca = c10::cuda::CUDACachingAllocator;
using c10::MempoolId_t;
using c10::CachingAllocator::Stat;
using c10::CachingAllocator::StatArray;
using c10::CachingAllocator::StatType;
using c10::CachingDeviceAllocator::BlockInfo;
using c10::CachingDeviceAllocator::DeviceStats;
using c10::CachingDeviceAllocator::RecordContext;
using c10::CachingDeviceAllocator::SegmentInfo;
using c10::CachingDeviceAllocator::TraceEntry;

// ---- libgpupool.so, as Python loaded it -------------------------------------------------

// The library's functions this class calls, as (member, C function): Python hands their
// addresses over in this order (`gpupool_torch_allocator_function_names` says it), and
// each member has the type the library's header declares, so a changed signature stops
// the build instead of calling the wrong thing.
#define GPUPOOL_LIBRARY_FUNCTIONS(X)                                                                      \
  X(malloc, gpupool_malloc)                                                                                \
  X(free, gpupool_free)                                                                                    \
  X(last_error, gpupool_last_error)                                                                        \
  X(get_stats, gpupool_get_stats)                                                                          \
  X(reset_peak_stats, gpupool_reset_peak_stats)                                                            \
  X(reclaim, gpupool_reclaim)                                                                              \
  X(set_limit, gpupool_set_limit)                                                                          \
  X(record_stream, gpupool_record_stream)                                                                  \
  X(base_alloc, gpupool_torch_base_alloc)                                                                  \
  X(snapshot_json, gpupool_snapshot_json)                                                                  \
  X(pool_begin, gpupool_torch_pool_begin)                                                                  \
  X(pool_end, gpupool_torch_pool_end)                                                                      \
  X(pool_release, gpupool_torch_pool_release)                                                              \
  X(pool_create, gpupool_torch_pool_create)                                                                \
  X(pool_use_count, gpupool_torch_pool_use_count)                                                          \
  X(pool_empty, gpupool_torch_pool_empty)                                                                  \
  X(ipc_export_torch, gpupool_ipc_export_torch)                                                            \
  X(ipc_open_torch, gpupool_ipc_open_torch)                                                                \
  X(ipc_close, gpupool_ipc_close)                                                                          \
  X(block_size, gpupool_torch_block_size)                                                                  \
  X(enable_peer_access, gpupool_enable_peer_access)

struct Library {
#define GPUPOOL_MEMBER(member, function) decltype(&::function) member;
  GPUPOOL_LIBRARY_FUNCTIONS(GPUPOOL_MEMBER)
#undef GPUPOOL_MEMBER
};
constexpr size_t kLibraryFunctions = sizeof(Library) / sizeof(void *);

// The C names, comma-separated, in the members' order.
#define GPUPOOL_NAME(member, function) #function ","
constexpr const char kLibraryFunctionNames[] = GPUPOOL_LIBRARY_FUNCTIONS(GPUPOOL_NAME);
#undef GPUPOOL_NAME

using PoolStats = gpupool_stats;

Library lib;

constexpr int kOk = GPUPOOL_STATUS_OK;
constexpr int kOutOfMemory = GPUPOOL_STATUS_OUT_OF_MEMORY;
constexpr size_t kRound = 512;                  // the split and arena pools' block unit
constexpr size_t kSmallSize = 1 << 20;          // PyTorch's small pool: blocks up to 1 MiB

std::string last_error(int status) {
  std::string s(lib.last_error(nullptr, 0) + 1, '\0');
  s.resize(lib.last_error(&s[0], s.size()));
  if (s.empty()) s = "gpupool: call failed with status " + std::to_string(status);
  return s;
}

// Raises the library's error as a RuntimeError.
void check(int status) {
  if (status != kOk) TORCH_CHECK(false, last_error(status));
}

PoolStats pool_stats(c10::DeviceIndex device) {
  PoolStats s{};
  s.struct_size = sizeof(PoolStats);
  check(lib.get_stats(device, &s));
  return s;
}

// ---- a small reader for the library's snapshot JSON ------------------------------------

// The JSON gpupool_snapshot_json writes: objects, arrays, strings without escapes beyond
// \" and \\, non-negative integers, true and false.
struct Json {
  enum Kind { Null, Bool, Number, String, Array, Object } kind = Null;
  uint64_t number = 0;
  bool boolean = false;
  std::string text;
  std::vector<Json> items;
  std::vector<std::pair<std::string, Json>> fields;

  const Json &operator[](const char *key) const {
    static const Json none;
    for (const auto &f : fields)
      if (f.first == key) return f.second;
    return none;
  }
};

struct JsonReader {
  const std::string &s;
  size_t i = 0;

  void space() {
    while (i < s.size() && (s[i] == ' ' || s[i] == '\n' || s[i] == '\r' || s[i] == '\t')) ++i;
  }
  void expect(char c) {
    space();
    TORCH_CHECK(i < s.size() && s[i] == c, "gpupool: unreadable snapshot from the library at byte ", i);
    ++i;
  }
  std::string string() {
    expect('"');
    std::string out;
    while (i < s.size() && s[i] != '"') {
      if (s[i] == '\\' && i + 1 < s.size()) ++i;
      out.push_back(s[i++]);
    }
    expect('"');
    return out;
  }
  Json value() {
    space();
    TORCH_CHECK(i < s.size(), "gpupool: snapshot from the library ends early");
    Json v;
    char c = s[i];
    if (c == '{') {
      v.kind = Json::Object;
      ++i;
      space();
      if (s[i] == '}') return ++i, v;
      for (;;) {
        std::string key = string();
        expect(':');
        v.fields.emplace_back(std::move(key), value());
        space();
        if (s[i] == ',') { ++i; continue; }
        expect('}');
        return v;
      }
    }
    if (c == '[') {
      v.kind = Json::Array;
      ++i;
      space();
      if (s[i] == ']') return ++i, v;
      for (;;) {
        v.items.push_back(value());
        space();
        if (s[i] == ',') { ++i; continue; }
        expect(']');
        return v;
      }
    }
    if (c == '"') {
      v.kind = Json::String;
      v.text = string();
      return v;
    }
    if (s.compare(i, 4, "true") == 0) return i += 4, v.kind = Json::Bool, v.boolean = true, v;
    if (s.compare(i, 5, "false") == 0) return i += 5, v.kind = Json::Bool, v;
    if (s.compare(i, 4, "null") == 0) return i += 4, v;
    v.kind = Json::Number;
    size_t start = i;
    while (i < s.size() && ((s[i] >= '0' && s[i] <= '9') || s[i] == '.' || s[i] == '-' || s[i] == 'e')) ++i;
    TORCH_CHECK(i > start, "gpupool: unreadable snapshot from the library at byte ", start);
    v.number = std::strtoull(s.c_str() + start, nullptr, 10);
    return v;
  }
};

// ---- the allocator ----------------------------------------------------------------------

// A live allocation made through this class.
struct Live {
  size_t requested;
  size_t block;
  cudaStream_t stream;
  MempoolId_t pool;
  // Set when a MemPool over another allocator made it: freed there.
  std::shared_ptr<cca::CUDAAllocator> foreign;
  std::shared_ptr<c10::GatheredContext> context;
};

// A private-pool route as PyTorch began it, mirrored here to know which pool an allocation
// went to (the library routes by the same filter) and to serve pools over other allocators.
struct Route {
  MempoolId_t id;
  std::function<bool(cudaStream_t)> filter;
  std::shared_ptr<cca::CUDAAllocator> foreign;
};

// PyTorch's books for one device.
struct Books {
  std::mutex mu;
  ska::flat_hash_map<void *, Live> live;
  DeviceStats stats;
  std::vector<Route> routes;
  // The pool's counters when accumulated statistics were last reset, and the segment peak
  // as last read.
  uint64_t device_allocs_base = 0, device_frees_base = 0, reserved_freed_base = 0, reserved_allocated_base = 0;
  int64_t segment_peak = 0;
  double fraction = 1.0;
  bool touched = false;  // the pool of this device has been asked for something
  std::deque<TraceEntry> trace;
};

// A MemPool over another allocator.
struct ForeignPool {
  std::shared_ptr<cca::CUDAAllocator> allocator;
  int uses = 0;
};

void deleter(void *ptr);

// Every device's books, made when PyTorch starts CUDA (`init`), not when the class is
// installed. Entries are made once, under the set-up lock, and never move: readers take no
// lock and see the first `size()` of them, published after they were made.
class DeviceBooks {
 public:
  size_t size() const { return count_.load(std::memory_order_acquire); }
  std::unique_ptr<Books> &operator[](size_t d) { return books_[d]; }
  std::unique_ptr<Books> *begin() { return books_.data(); }
  std::unique_ptr<Books> *end() { return books_.data() + size(); }

  // Books for devices up to `n` (the caller holds the set-up lock).
  void grow(size_t n) {
    n = std::min(n, books_.size());
    size_t have = size();
    for (size_t d = have; d < n; ++d) books_[d] = std::make_unique<Books>();
    if (n > have) count_.store(n, std::memory_order_release);
  }

 private:
  std::array<std::unique_ptr<Books>, C10_COMPILE_TIME_MAX_GPUS> books_;
  std::atomic<size_t> count_{0};
};

class GpupoolAllocator final : public cca::CUDAAllocator {
 public:
  // No device is counted here: counting starts the CUDA driver (a third of a second), which
  // PyTorch starts only at the process's first CUDA work and then calls `init` with the
  // count. Installing the class costs no more than loading it.
  GpupoolAllocator() = default;

  // -- allocation ---------------------------------------------------------------------

  c10::DataPtr allocate(size_t size) override {
    c10::DeviceIndex device = c10::cuda::current_device();
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
    void *p = malloc(size, device, stream);
    return {p, p, &deleter, c10::Device(c10::DeviceType::CUDA, device)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &deleter; }

  void *raw_alloc(size_t nbytes) override {
    c10::DeviceIndex device = c10::cuda::current_device();
    return malloc(nbytes, device, c10::cuda::getCurrentCUDAStream(device).stream());
  }

  void *raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) override {
    return malloc(nbytes, c10::cuda::current_device(), stream);
  }

  void raw_delete(void *ptr) override { free(ptr); }

  void copy_data(void *dest, const void *src, std::size_t count) const override {
    C10_CUDA_CHECK(cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice));
  }

  void *malloc(size_t size, c10::DeviceIndex device, cudaStream_t stream) {
    if (size == 0) return nullptr;
    Books &b = books(device);
    auto context = gather(RecordContext::STATE);
    MempoolId_t pool{0, 0};
    std::shared_ptr<cca::CUDAAllocator> foreign;
    if (routes_.load(std::memory_order_acquire) > 0) {
      std::lock_guard<std::mutex> g(b.mu);
      for (auto r = b.routes.rbegin(); r != b.routes.rend(); ++r) {
        if (r->filter && r->filter(stream)) {
          pool = r->id;
          foreign = r->foreign;
          break;
        }
      }
    }
    void *p = nullptr;
    int status = kOk;
    if (foreign) {
      p = foreign->raw_alloc_with_stream(size, stream);
    } else {
      status = lib.malloc(&p, size, device, stream);
      if (status == kOutOfMemory) status = malloc_from_oom_pools(&p, size, device, stream, &pool, &foreign);
    }
    if (status != kOk) out_of_memory(b, status, size, device, stream);
    // Small blocks are the request in 512-byte units; a large one may keep a rest too small
    // to split off, which the pool counts in use: ask it.
    size_t block = (size + kRound - 1) / kRound * kRound;
    if (block > kSmallSize && !foreign) block = std::max(block, lib.block_size(p));
    {
      std::lock_guard<std::mutex> g(b.mu);
      b.touched = true;
      Live &l = b.live[p];
      l = Live{size, block, stream, pool, std::move(foreign), context};
      update(b.stats, block, size, true);
      if (history_ || !trackers_.empty())
        trace(b, TraceEntry::ALLOC, device, p, block, stream, pool, record_when_ >= RecordContext::ALLOC ? context : nullptr);
    }
    if (C10_UNLIKELY(c10::memoryProfilingEnabled())) report_to_profiler(b, p, static_cast<int64_t>(block), device);
    return p;
  }

  // The DataPtr deleter: runs in destructors, so nothing may escape it.
  void free(void *ptr) noexcept {
    if (ptr == nullptr) return;
    try {
      free_block(ptr);
    } catch (const std::exception &e) {
      std::fprintf(stderr, "gpupool: free of %p failed: %s\n", ptr, e.what());
    } catch (...) {
      std::fprintf(stderr, "gpupool: free of %p failed\n", ptr);
    }
  }

  void free_block(void *ptr) {
    c10::DeviceIndex device = -1;
    Live l;
    bool known = false;
    auto context = gather(RecordContext::ALL);
    for (size_t d = 0; d < books_.size() && !known; ++d) {
      Books &b = *books_[d];
      std::lock_guard<std::mutex> g(b.mu);
      auto it = b.live.find(ptr);
      if (it == b.live.end()) continue;
      l = std::move(it->second);
      b.live.erase(it);
      known = true;
      device = static_cast<c10::DeviceIndex>(d);
      update(b.stats, l.block, l.requested, false);
      if (history_ || !trackers_.empty()) {
        trace(b, TraceEntry::FREE_REQUESTED, device, ptr, l.block, l.stream, l.pool, context);
        trace(b, TraceEntry::FREE_COMPLETED, device, ptr, l.block, l.stream, l.pool, context);
      }
    }
    if (!known) {
      // Every allocation of this class is in its books: this is a second free, or memory
      // of another allocator. Nothing is freed.
      TORCH_WARN("gpupool: free of ", ptr, ", which gpupool's PyTorch allocator does not hold (freed twice?)");
      return;
    }
    if (C10_UNLIKELY(c10::memoryProfilingEnabled())) report_to_profiler(*books_[device], ptr, -static_cast<int64_t>(l.block), device);
    if (l.foreign) {
      l.foreign->raw_delete(ptr);
      return;
    }
    // The block's last use PyTorch knows of is its allocation stream (record_stream adds
    // others): the pool orders its reuse after that stream's work.
    int status = lib.free(ptr, device, l.stream);
    if (status != kOk) TORCH_WARN("gpupool: free of ", ptr, " failed: ", last_error(status));
  }

  // -- set-up and settings ------------------------------------------------------------

  void init(int device_count) override {
    std::lock_guard<std::mutex> g(setup_mu_);
    books_.grow(static_cast<size_t>(std::max(device_count, 0)));
    initialized_ = true;
  }

  bool initialized() override { return initialized_; }

  double getMemoryFraction(c10::DeviceIndex device) override {
    Books &b = books(device);
    std::lock_guard<std::mutex> g(b.mu);
    return b.fraction;
  }

  void setMemoryFraction(double fraction, c10::DeviceIndex device) override {
    TORCH_CHECK(fraction >= 0 && fraction <= 1, "gpupool: memory fraction ", fraction, " is not within [0, 1]");
    Books &b = books(device);
    PoolStats s = pool_stats(device);
    check(lib.set_limit(device, fraction >= 1 ? 0 : static_cast<size_t>(static_cast<double>(s.device_total_bytes) * fraction)));
    std::lock_guard<std::mutex> g(b.mu);
    b.touched = true;
    b.fraction = fraction;
  }

  std::vector<cca::StreamSegmentSize> getExpandableSegmentSizes(c10::DeviceIndex) override { return {}; }

  void enable(bool value) override { enabled_ = value; }
  bool isEnabled() const override { return enabled_; }

  std::string name() override { return "gpupool"; }

  // -- cache --------------------------------------------------------------------------

  void emptyCache(MempoolId_t mempool_id) override {
    if (mempool_id.first == 0 && mempool_id.second == 0) {
      check(lib.reclaim(-1, nullptr));
      return;
    }
    for (size_t d = 0; d < books_.size(); ++d) {
      std::shared_ptr<cca::CUDAAllocator> foreign;
      {
        std::lock_guard<std::mutex> g(foreign_mu_);
        auto it = foreign_.find({static_cast<int>(d), mempool_id});
        if (it != foreign_.end()) foreign = it->second.allocator;
      }
      if (foreign) {
        foreign->emptyCache(mempool_id);
      } else if (touched(d)) {
        check(lib.pool_empty(static_cast<int>(d), mempool_id.first, mempool_id.second, nullptr));
      }
    }
  }

  // cuDNN's benchmark mode sizes its workspace by this: the largest block a request could
  // get without the pool growing, or, as PyTorch's allocator, the device's free memory
  // when the caller passes 0 and nothing cached is larger.
  void cacheInfo(c10::DeviceIndex device, size_t *largestBlock) override {
    PoolStats s = pool_stats(device);
    if (*largestBlock == 0) *largestBlock = s.device_free_bytes;
    *largestBlock = std::max<size_t>(*largestBlock, s.largest_free_block);
  }

  void *getBaseAllocation(void *ptr, size_t *size) override {
    if (auto f = foreign_of(ptr)) return f->getBaseAllocation(ptr, size);
    void *base = lib.base_alloc(ptr, size);
    TORCH_CHECK(base != nullptr, "gpupool: ", ptr, " is not a live allocation of gpupool's");
    return base;
  }

  void recordStream(const c10::DataPtr &ptr, c10::cuda::CUDAStream stream) override {
    if (ptr.get() == nullptr || ptr.get_deleter() != &deleter) return;  // not a block of ours
    if (auto f = foreign_of(ptr.get())) {
      // The other allocator's memory: it is told, through a DataPtr that owns nothing.
      f->recordStream(c10::DataPtr(ptr.get(), ptr.device()), stream);
      return;
    }
    check(lib.record_stream(ptr.get(), stream.stream()));
  }

  // -- statistics -----------------------------------------------------------------------

  DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    Books &b = books(device);
    PoolStats s = pool_stats(device);
    std::lock_guard<std::mutex> g(b.mu);
    b.touched = true;
    DeviceStats out = b.stats;
    auto all = static_cast<size_t>(StatType::AGGREGATE), large = static_cast<size_t>(StatType::LARGE_POOL);
    int64_t segments = static_cast<int64_t>(s.n_upstream_allocs - s.n_upstream_frees);
    b.segment_peak = std::max(b.segment_peak, segments);
    for (size_t t : {all, large}) {
      Stat &r = out.reserved_bytes[t];
      r.current = static_cast<int64_t>(s.total_bytes);
      r.peak = static_cast<int64_t>(s.peak_total_bytes);
      r.freed = static_cast<int64_t>(s.reclaimed_bytes - b.reserved_freed_base);
      r.allocated = static_cast<int64_t>(s.total_bytes + s.reclaimed_bytes - b.reserved_allocated_base);
      Stat &seg = out.segment[t];
      seg.current = segments;
      seg.peak = b.segment_peak;
      seg.allocated = static_cast<int64_t>(s.n_upstream_allocs - b.device_allocs_base);
      seg.freed = static_cast<int64_t>(s.n_upstream_frees - b.device_frees_base);
      // Cached memory: free blocks the pool keeps (PyTorch's inactive split blocks).
      out.inactive_split[t].current = static_cast<int64_t>(s.n_free_blocks);
      out.inactive_split_bytes[t].current = static_cast<int64_t>(s.free_bytes);
    }
    out.num_device_alloc = static_cast<int64_t>(s.n_upstream_allocs - b.device_allocs_base);
    out.num_device_free = static_cast<int64_t>(s.n_upstream_frees - b.device_frees_base);
    out.max_split_size = -1;  // no block is too large to split
    return out;
  }

  void resetAccumulatedStats(c10::DeviceIndex device) override {
    Books &b = books(device);
    PoolStats s = pool_stats(device);
    std::lock_guard<std::mutex> g(b.mu);
    for (StatArray *a : arrays(b.stats))
      for (Stat &st : *a) st.reset_accumulated();
    b.stats.num_alloc_retries = 0;
    b.stats.num_ooms = 0;
    b.stats.num_sync_all_streams = 0;
    b.stats.oversize_allocations.reset_accumulated();
    b.stats.oversize_segments.reset_accumulated();
    b.device_allocs_base = s.n_upstream_allocs;
    b.device_frees_base = s.n_upstream_frees;
    b.reserved_freed_base = s.reclaimed_bytes;
    b.reserved_allocated_base = s.total_bytes + s.reclaimed_bytes;
  }

  void resetPeakStats(c10::DeviceIndex device) override {
    Books &b = books(device);
    check(lib.reset_peak_stats(device));
    PoolStats s = pool_stats(device);
    std::lock_guard<std::mutex> g(b.mu);
    for (StatArray *a : arrays(b.stats))
      for (Stat &st : *a) st.reset_peak();
    b.stats.oversize_allocations.reset_peak();
    b.stats.oversize_segments.reset_peak();
    b.segment_peak = static_cast<int64_t>(s.n_upstream_allocs - s.n_upstream_frees);
  }

  // -- snapshots and history ----------------------------------------------------------

  cca::SnapshotInfo snapshot(MempoolId_t mempool_id, bool include_traces) override {
    cca::SnapshotInfo info;
    bool all_pools = mempool_id.first == 0 && mempool_id.second == 0;
    for (size_t d = 0; d < books_.size(); ++d) {
      if (!touched(d)) continue;
      // The pool may change between asking the length and the copy: copy until it fits.
      std::string text;
      for (size_t n = lib.snapshot_json(static_cast<int>(d), nullptr, 0);;) {
        text.assign(n + 1, '\0');
        size_t got = lib.snapshot_json(static_cast<int>(d), &text[0], text.size());
        if (got < text.size()) {
          text.resize(got);
          break;
        }
        n = got;
      }
      TORCH_CHECK(!text.empty() && text[0] == '{', "gpupool: no snapshot of device ", d, ": ", last_error(0));
      JsonReader reader{text};
      Json doc = reader.value();
      Books &b = *books_[d];
      std::lock_guard<std::mutex> g(b.mu);
      for (const Json &seg : doc["segments"].items) {
        const Json &pid = seg["pool_id"];
        MempoolId_t owner{pid.items.size() == 2 ? pid.items[0].number : 0, pid.items.size() == 2 ? pid.items[1].number : 0};
        if (!all_pools && owner != mempool_id) continue;
        SegmentInfo si;
        si.device = static_cast<c10::DeviceIndex>(d);
        si.address = seg["address"].number;
        si.total_size = seg["total_size"].number;
        si.stream = reinterpret_cast<void *>(seg["stream"].number);
        si.is_large = si.total_size > kSmallSize;
        si.is_expandable = seg["is_expandable"].boolean;
        si.owner_private_pool_id = owner;
        for (const Json &blk : seg["blocks"].items) {
          BlockInfo bi;
          bi.size = blk["size"].number;
          bi.requested_size = blk["requested_size"].number;
          const std::string &state = blk["state"].text;
          bi.allocated = state == "active_allocated";
          bi.active = state != "inactive";
          if (bi.allocated) {
            auto it = b.live.find(reinterpret_cast<void *>(blk["address"].number));
            if (it != b.live.end()) bi.context_when_allocated = it->second.context;
            si.allocated_size += bi.size;
            si.requested_size += bi.requested_size;
          }
          if (bi.active) si.active_size += bi.size;
          si.blocks.push_back(std::move(bi));
        }
        info.segments.push_back(std::move(si));
      }
    }
    if (include_traces) {
      info.device_traces.resize(books_.size());
      for (size_t d = 0; d < books_.size(); ++d) {
        std::lock_guard<std::mutex> g(books_[d]->mu);
        info.device_traces[d].assign(books_[d]->trace.begin(), books_[d]->trace.end());
      }
    }
    auto &c = info.config_metadata;
    c.garbage_collection_threshold = 0;
    c.max_split_size = SIZE_MAX;
    c.pinned_num_register_threads = 1;
    c.expandable_segments = false;
    c.release_lock_on_malloc = false;
    c.pinned_use_host_register = false;
    c.graph_capture_record_stream_reuse = false;
    c.last_allocator_settings = "gpupool";
    return info;
  }

  void recordHistory(bool enabled, cca::CreateContextFn context_recorder, size_t alloc_trace_max_entries,
                     RecordContext when, bool clearHistory, const std::vector<std::string> &skip_actions) override {
    std::lock_guard<std::mutex> g(setup_mu_);
    std::vector<std::unique_lock<std::mutex>> locks;
    for (auto &b : books_) locks.emplace_back(b->mu);
    history_ = enabled;
    recorder_ = enabled ? context_recorder : nullptr;
    record_when_ = enabled ? when : RecordContext::NEVER;
    max_entries_ = std::max<size_t>(alloc_trace_max_entries, 1);
    skip_.clear();
    for (const auto &a : skip_actions) skip_.insert(c10::CachingDeviceAllocator::parseTraceEntryAction(a));
    for (auto &b : books_) {
      if (clearHistory || !enabled) b->trace.clear();
      while (b->trace.size() > max_entries_) b->trace.pop_front();
    }
  }

  bool isHistoryEnabled() override { return history_; }

  void attachOutOfMemoryObserver(cca::OutOfMemoryObserver observer) override {
    std::lock_guard<std::mutex> g(setup_mu_);
    oom_observers_.push_back(std::move(observer));
  }

#ifdef GPUPOOL_TORCH_OOM_REJECTION_OBSERVER
  // Called by PyTorch's allocator when its throw_on_cudamalloc_oom policy rejects a request
  // before asking the driver. gpupool has no such policy (its limit is the one refusal, and
  // that is an out-of-memory, reported to the out-of-memory observers), so these observers
  // are accepted and never called.
  void attachOomRejectionObserver(cca::OomRejectionObserver) override {}
#endif

  void attachAllocatorTraceTracker(cca::AllocatorTraceTracker tracker) override {
    std::lock_guard<std::mutex> g(setup_mu_);
    std::vector<std::unique_lock<std::mutex>> locks;
    for (auto &b : books_) locks.emplace_back(b->mu);
    trackers_.push_back(std::move(tracker));
  }

  // -- private pools: CUDA graphs and MemPool --------------------------------------------

  void createOrIncrefPool(c10::DeviceIndex device, MempoolId_t id, std::shared_ptr<cca::CUDAAllocator> allocator) override {
    touch(device);
    if (allocator && allocator.get() != this) {
      std::lock_guard<std::mutex> g(foreign_mu_);
      ForeignPool &f = foreign_[{device, id}];
      if (!f.allocator) f.allocator = std::move(allocator);
      ++f.uses;
      return;
    }
    check(lib.pool_create(device, id.first, id.second));
  }

  void beginAllocateToPool(c10::DeviceIndex device, MempoolId_t id, std::function<bool(cudaStream_t)> filter) override {
    touch(device);
    std::shared_ptr<cca::CUDAAllocator> foreign;
    {
      std::lock_guard<std::mutex> g(foreign_mu_);
      auto it = foreign_.find({device, id});
      if (it != foreign_.end()) {
        foreign = it->second.allocator;
        ++it->second.uses;
      }
    }
    if (!foreign) check(lib.pool_begin(device, id.first, id.second, &filter));
    Books &b = books(device);
    std::lock_guard<std::mutex> g(b.mu);
    b.routes.push_back(Route{id, std::move(filter), std::move(foreign)});
    routes_.fetch_add(1, std::memory_order_acq_rel);
  }

  void endAllocateToPool(c10::DeviceIndex device, MempoolId_t id) override {
    Books &b = books(device);
    bool foreign = false;
    {
      std::lock_guard<std::mutex> g(b.mu);
      auto it = std::find_if(b.routes.rbegin(), b.routes.rend(), [&](const Route &r) { return r.id == id; });
      TORCH_CHECK(it != b.routes.rend(), "gpupool: no allocation to private pool (", id.first, ", ", id.second,
                  ") is in progress on device ", device);
      foreign = static_cast<bool>(it->foreign);
      b.routes.erase(std::next(it).base());
      routes_.fetch_sub(1, std::memory_order_acq_rel);
    }
    if (!foreign) check(lib.pool_end(device, id.first, id.second));
  }

  void releasePool(c10::DeviceIndex device, MempoolId_t id) override {
    {
      std::lock_guard<std::mutex> g(foreign_mu_);
      auto it = foreign_.find({device, id});
      if (it != foreign_.end()) {
        if (--it->second.uses <= 0) foreign_.erase(it);  // its live blocks keep the allocator
        return;
      }
    }
    check(lib.pool_release(device, id.first, id.second));
  }

  int getPoolUseCount(c10::DeviceIndex device, MempoolId_t id) override {
    {
      std::lock_guard<std::mutex> g(foreign_mu_);
      auto it = foreign_.find({device, id});
      if (it != foreign_.end()) return it->second.uses;
    }
    int64_t uses = 0;
    check(lib.pool_use_count(device, id.first, id.second, &uses));
    return static_cast<int>(uses);
  }

  // A pool that serves allocations the device's memory refuses (MemPool(use_on_oom=True)).
  void setUseOnOOM(c10::DeviceIndex device, MempoolId_t id, bool use_on_oom) override {
    std::lock_guard<std::mutex> g(setup_mu_);
    auto key = std::make_pair(static_cast<int>(device), id);
    auto it = std::find(oom_pools_.begin(), oom_pools_.end(), key);
    if (use_on_oom && it == oom_pools_.end()) oom_pools_.push_back(key);
    if (!use_on_oom && it != oom_pools_.end()) oom_pools_.erase(it);
  }

  void setNoSplit(c10::DeviceIndex, MempoolId_t) override {}

  bool checkPoolLiveAllocations(c10::DeviceIndex device, MempoolId_t id,
                                const std::unordered_set<void *> &expected_live_allocations) override {
    Books &b = books(device);
    std::lock_guard<std::mutex> g(b.mu);
    size_t n = 0;
    for (const auto &kv : b.live) {
      if (kv.second.pool != id) continue;
      if (!expected_live_allocations.count(kv.first)) return false;
      ++n;
    }
    return n == expected_live_allocations.size();
  }

  std::shared_ptr<cca::AllocatorState> getCheckpointState(c10::DeviceIndex, MempoolId_t) override {
    TORCH_CHECK(false, "gpupool: private pools cannot be checkpointed (torch.compile's CUDA-graph trees ask for it); "
                "gpupool.torch.install() sets torch._inductor.config.triton.cudagraph_trees = False, which captures "
                "with torch.cuda.graph instead");
  }

  cca::CheckpointDelta setCheckpointPoolState(c10::DeviceIndex, std::shared_ptr<cca::AllocatorState>) override {
    TORCH_CHECK(false, "gpupool: private pools cannot be checkpointed (see getCheckpointState)");
  }

  // -- devices ----------------------------------------------------------------------------

  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override {
    c10::cuda::CUDAGuard guard(dev);
    cudaError_t err = cudaDeviceEnablePeerAccess(dev_to_access, 0);
    if (err == cudaErrorPeerAccessAlreadyEnabled) {
      (void)cudaGetLastError();
    } else {
      C10_CUDA_CHECK(err);
    }
    // gpupool grants a peer its arena memory only once asked (Note [Peer access on demand]).
    check(lib.enable_peer_access(dev_to_access, dev, nullptr));
  }

  cudaError_t memcpyAsync(void *dst, int dstDevice, const void *src, int srcDevice, size_t count, cudaStream_t stream,
                          bool p2p_enabled) override {
    if (p2p_enabled || dstDevice == srcDevice) return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
    return cudaMemcpyPeerAsync(dst, dstDevice, src, srcDevice, count, stream);
  }

  // -- sharing between processes --------------------------------------------------------

  // The block at `ptr` (getBaseAllocation's base) in PyTorch's own handle format, with the
  // library's descriptor behind it (src/share/torch_format.rs): a receiver on PyTorch's
  // allocator opens the first, a gpupool receiver the second.
  cca::ShareableHandle shareIpcHandle(void *ptr) override {
    if (auto f = foreign_of(ptr)) return f->shareIpcHandle(ptr);
    std::string handle(512, '\0');
    size_t n = 0, offset = 0;
    int status = lib.ipc_export_torch(ptr, &handle[0], handle.size(), &n, &offset);
    if (status != kOk && n > handle.size()) {
      handle.resize(n);
      status = lib.ipc_export_torch(ptr, &handle[0], handle.size(), &n, &offset);
    }
    check(status);
    handle.resize(n);
    return {static_cast<ptrdiff_t>(offset), handle};
  }

  // A storage's memory from another process (whichever allocator sent it), mapped once
  // while any storage here uses it.
  std::shared_ptr<void> getIpcDevPtr(std::string handle) override {
    c10::DeviceIndex device = c10::cuda::current_device();
    std::lock_guard<std::mutex> g(ipc_mu_);
    auto it = imports_.find(handle);
    if (it != imports_.end()) {
      if (auto alive = it->second.lock()) return alive;
      imports_.erase(it);
    }
    void *base = nullptr, *block = nullptr;
    check(lib.ipc_open_torch(handle.data(), handle.size(), device, &base, &block));
    std::shared_ptr<void> mapped(base, [device, block](void *) {
      int status = lib.ipc_close(block, device);
      if (status != kOk) TORCH_WARN("gpupool: closing an imported block failed: ", last_error(status));
    });
    if (imports_.size() >= sweep_at_) {
      // Forget the imports no storage uses any more (their memory went with them).
      for (auto i = imports_.begin(); i != imports_.end();) i = i->second.expired() ? imports_.erase(i) : std::next(i);
      sweep_at_ = std::max<size_t>(64, 2 * imports_.size());
    }
    imports_[handle] = mapped;
    return mapped;
  }

 private:
  Books &books(c10::DeviceIndex device) {
    if (C10_UNLIKELY(device >= 0 && static_cast<size_t>(device) >= books_.size() && !initialized_)) {
      // Asked before PyTorch started CUDA (a setting made ahead of the first tensor): count
      // the devices now, as PyTorch's own allocator would have at its start.
      std::lock_guard<std::mutex> g(setup_mu_);
      books_.grow(static_cast<size_t>(c10::cuda::device_count()));
    }
    TORCH_CHECK(device >= 0 && static_cast<size_t>(device) < books_.size(), "gpupool: device ", static_cast<int>(device),
                " is not one of the ", books_.size(), " devices PyTorch sees");
    return *books_[device];
  }

  // The allocator of a MemPool over another allocator that made `ptr`, if one did.
  std::shared_ptr<cca::CUDAAllocator> foreign_of(void *ptr) {
    for (auto &b : books_) {
      std::lock_guard<std::mutex> g(b->mu);
      auto it = b->live.find(ptr);
      if (it != b->live.end()) return it->second.foreign;
    }
    return nullptr;
  }

  bool touched(size_t d) {
    std::lock_guard<std::mutex> g(books_[d]->mu);
    return books_[d]->touched;
  }

  void touch(c10::DeviceIndex device) {
    Books &b = books(device);
    std::lock_guard<std::mutex> g(b.mu);
    b.touched = true;
  }

  static std::vector<StatArray *> arrays(DeviceStats &s) {
    return {&s.allocation, &s.segment, &s.active, &s.inactive_split, &s.allocated_bytes, &s.reserved_bytes,
            &s.active_bytes, &s.inactive_split_bytes, &s.requested_bytes};
  }

  // PyTorch's own statistics of an allocation (`add`) or a free: an allocation is active
  // while it is allocated (the pool orders frees by stream; nothing stays active after).
  static void update(DeviceStats &s, size_t block, size_t requested, bool add) {
    auto kind = static_cast<size_t>(block <= kSmallSize ? StatType::SMALL_POOL : StatType::LARGE_POOL);
    for (size_t t : {static_cast<size_t>(StatType::AGGREGATE), kind}) {
      if (add) {
        s.allocation[t].increase(1);
        s.active[t].increase(1);
        s.allocated_bytes[t].increase(block);
        s.active_bytes[t].increase(block);
        s.requested_bytes[t].increase(requested);
      } else {
        s.allocation[t].decrease(1);
        s.active[t].decrease(1);
        s.allocated_bytes[t].decrease(block);
        s.active_bytes[t].decrease(block);
        s.requested_bytes[t].decrease(requested);
      }
    }
  }

  std::shared_ptr<c10::GatheredContext> gather(RecordContext level) {
    if (record_when_ < level) return nullptr;
    cca::CreateContextFn recorder = recorder_.load(std::memory_order_acquire);
    return recorder ? recorder() : nullptr;
  }

  // Under b.mu.
  void trace(Books &b, TraceEntry::Action action, c10::DeviceIndex device, void *addr, size_t size, cudaStream_t stream,
             MempoolId_t pool, std::shared_ptr<c10::GatheredContext> context) {
    TraceEntry e(action, device, reinterpret_cast<size_t>(addr), size, stream, pool, c10::getApproximateTime(),
                 std::move(context));
    for (const auto &t : trackers_) t(e);
    if (!history_ || skip_.count(action)) return;
    b.trace.push_back(std::move(e));
    while (b.trace.size() > max_entries_) b.trace.pop_front();
  }

  void report_to_profiler(Books &b, void *p, int64_t delta, c10::DeviceIndex device) {
    size_t allocated = 0;
    {
      std::lock_guard<std::mutex> g(b.mu);
      allocated = static_cast<size_t>(b.stats.allocated_bytes[0].current);
    }
    PoolStats s{};
    s.struct_size = sizeof(PoolStats);
    (void)lib.get_stats(device, &s);
    c10::reportMemoryUsageToProfiler(p, delta, allocated, s.total_bytes, c10::Device(c10::DeviceType::CUDA, device));
  }

  // Pools that serve what the device's memory refuses: tried in order, each through a route
  // that takes this thread's allocation alone.
  int malloc_from_oom_pools(void **p, size_t size, c10::DeviceIndex device, cudaStream_t stream, MempoolId_t *pool,
                            std::shared_ptr<cca::CUDAAllocator> *foreign) {
    std::vector<MempoolId_t> pools;
    {
      std::lock_guard<std::mutex> g(setup_mu_);
      for (const auto &k : oom_pools_)
        if (k.first == device) pools.push_back(k.second);
    }
    int status = kOutOfMemory;
    for (const MempoolId_t &id : pools) {
      std::shared_ptr<cca::CUDAAllocator> other;
      {
        std::lock_guard<std::mutex> g(foreign_mu_);
        auto it = foreign_.find({device, id});
        if (it != foreign_.end()) other = it->second.allocator;
      }
      if (other) {
        try {
          *p = other->raw_alloc_with_stream(size, stream);
        } catch (const std::exception &) {
          continue;  // refused there too
        }
        *pool = id;
        *foreign = std::move(other);
        return kOk;
      }
      auto me = std::this_thread::get_id();
      std::function<bool(cudaStream_t)> mine = [me](cudaStream_t) { return std::this_thread::get_id() == me; };
      if (lib.pool_begin(device, id.first, id.second, &mine) != kOk) continue;
      status = lib.malloc(p, size, device, stream);
      (void)lib.pool_end(device, id.first, id.second);
      (void)lib.pool_release(device, id.first, id.second);
      if (status == kOk) {
        *pool = id;
        break;
      }
    }
    // The message (the thread's last error) is the last refusal's.
    return status == kOk ? kOk : (pools.empty() ? kOutOfMemory : status);
  }

  [[noreturn]] void out_of_memory(Books &b, int status, size_t size, c10::DeviceIndex device, cudaStream_t stream) {
    std::string msg = last_error(status);
    TORCH_CHECK(status == kOutOfMemory, msg);
    // PyTorch's phrase first: batch-size finders (accelerate, Lightning) look for it.
    const char *phrase = "CUDA out of memory.";
    if (msg.find(phrase) == std::string::npos) msg = std::string(phrase) + " " + msg;
    PoolStats s{};
    s.struct_size = sizeof(PoolStats);
    (void)lib.get_stats(device, &s);
    size_t allocated = 0;
    std::vector<cca::OutOfMemoryObserver> observers;
    {
      std::lock_guard<std::mutex> g(setup_mu_);
      observers = oom_observers_;
    }
    {
      std::lock_guard<std::mutex> g(b.mu);
      b.stats.num_ooms += 1;
      allocated = static_cast<size_t>(b.stats.allocated_bytes[0].current);
      if (history_ || !trackers_.empty())
        trace(b, TraceEntry::OOM, device, reinterpret_cast<void *>(s.device_free_bytes), size, stream, {0, 0}, nullptr);
    }
    for (const auto &o : observers) o(device, allocated, s.device_total_bytes, s.device_free_bytes);
    c10::reportOutOfMemoryToProfiler(static_cast<int64_t>(size), allocated, s.total_bytes,
                                     c10::Device(c10::DeviceType::CUDA, device));
    TORCH_CHECK_WITH(OutOfMemoryError, false, msg);
  }

  DeviceBooks books_;
  std::mutex setup_mu_;
  std::atomic<bool> initialized_{false};
  std::atomic<bool> enabled_{true};
  std::atomic<int> routes_{0};
  // History: written under setup_mu_ and every device's mutex, read under either.
  std::atomic<cca::CreateContextFn> recorder_{nullptr};
  std::atomic<bool> history_{false};
  // How much context to gather: none, for live blocks, also for allocations in the trace,
  // also for frees (PyTorch's RecordContext).
  std::atomic<RecordContext> record_when_{RecordContext::NEVER};
  size_t max_entries_ = 1;
  struct ActionHash {
    size_t operator()(TraceEntry::Action a) const { return static_cast<size_t>(a); }
  };
  std::unordered_set<TraceEntry::Action, ActionHash> skip_;
  std::vector<cca::AllocatorTraceTracker> trackers_;
  std::vector<cca::OutOfMemoryObserver> oom_observers_;
  std::vector<std::pair<int, MempoolId_t>> oom_pools_;
  std::mutex foreign_mu_;
  std::map<std::pair<int, MempoolId_t>, ForeignPool> foreign_;
  std::mutex ipc_mu_;
  std::map<std::string, std::weak_ptr<void>> imports_;
  size_t sweep_at_ = 64;
};

// Never destroyed, as PyTorch's own allocator is not: storages freed while the process
// exits (after static destructors ran) still find it whole.
GpupoolAllocator *instance = nullptr;

void deleter(void *ptr) { instance->free(ptr); }

}  // namespace

#define GPUPOOL_TORCH_EXPORT extern "C" __attribute__((visibility("default")))

// The library functions the install call takes, by C name, comma-separated, in order.
GPUPOOL_TORCH_EXPORT const char *gpupool_torch_allocator_function_names() noexcept { return kLibraryFunctionNames; }

// Make this class PyTorch's CUDA allocator, over the library functions `fns` (`n` of them,
// in the order `gpupool_torch_allocator_function_names` gives). 0 on success; otherwise `err` (of `err_len` bytes) says why.
GPUPOOL_TORCH_EXPORT int gpupool_torch_allocator_install(void *const *fns, int n, char *err, size_t err_len) noexcept {
  try {
    TORCH_CHECK(n == static_cast<int>(kLibraryFunctions), "gpupool: the allocator takes ", kLibraryFunctions,
                " library functions, got ", n);
    for (int i = 0; i < n; ++i) TORCH_CHECK(fns[i] != nullptr, "gpupool: library function ", i, " is missing");
    if (instance == nullptr) {
      std::memcpy(&lib, fns, sizeof lib);
      instance = new GpupoolAllocator();
    }
    if (cca::get() != instance) {
      // PyTorch keeps this shared pointer; it deletes nothing (see `instance`).
      // PyTorch refuses the swap once its CUDA is started, and starting it calls `init` on
      // the allocator installed then: this one.
      torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(
          std::shared_ptr<cca::CUDAAllocator>(instance, [](cca::CUDAAllocator *) {}));
    }
    return 0;
  } catch (const std::exception &e) {
    if (err != nullptr && err_len > 0) {
      std::strncpy(err, e.what(), err_len - 1);
      err[err_len - 1] = '\0';
    }
    return 1;
  }
}
