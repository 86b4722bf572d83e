// PyTorch's CUDAPluggableAllocator calls `void *alloc(size_t, int, cudaStream_t)` and uses
// whatever comes back as the tensor's storage: a NULL would become a tensor at address 0.
// PyTorch does call it through C++ frames that translate exceptions into Python errors
// (and may call it with the GIL released, so the Python C-API is not an option here).
// So the allocation entry point is this thin C++ function: it calls the Rust core (which
// never unwinds) and, on failure, throws an exception carrying gpupool's message.
// std::bad_alloc for out-of-memory, std::runtime_error for anything else. PyTorch turns both
// into a plain Python RuntimeError: only c10::OutOfMemoryError, whose constructor lives in
// libc10, becomes torch.OutOfMemoryError, and this library is built without PyTorch. So
// gpupool.torch installs by default an allocator class compiled against the installed
// PyTorch (python/gpupool/csrc/torch_allocator.cpp), which throws PyTorch's own error; this
// function serves the plug-in route that install() falls back to.
#include <cstddef>
#include <new>
#include <stdexcept>
#include <string>

// The library's declarations and status codes, as C programs see them (the header is
// generated from the Rust sources and checked fresh by tests/header.rs).
#include "gpupool.h"

namespace {

class OutOfMemory : public std::bad_alloc {
 public:
  explicit OutOfMemory(std::string msg) : msg_(std::move(msg)) {}
  const char *what() const noexcept override { return msg_.c_str(); }

 private:
  std::string msg_;
};

std::string last_error() {
  size_t n = gpupool_last_error(nullptr, 0);
  std::string s(n + 1, '\0');
  gpupool_last_error(&s[0], s.size());
  s.resize(n);
  return s;
}

// Out of memory carries PyTorch's phrase first, as the library's own text does: batch-size
// finders (accelerate, Lightning) look for it in the RuntimeError to retry smaller.
std::string oom_text(std::string s) {
  const char *phrase = "CUDA out of memory.";
  if (s.find(phrase) == std::string::npos) s = std::string(phrase) + " " + (s.empty() ? "gpupool: out of memory" : s);
  return s;
}

}  // namespace

// Called only by gpupool_torch_malloc (torch.rs), which Rust exports with the "C-unwind" ABI
// so this exception may legally pass through it on its way to PyTorch.
extern "C" void *gpupool_torch_malloc_or_throw(size_t size, int device, void *stream) {
  void *p = nullptr;
  int st = gpupool_malloc(&p, size, device, stream);
  if (st == GPUPOOL_STATUS_OK) return p;
  if (st == GPUPOOL_STATUS_OUT_OF_MEMORY) throw OutOfMemory(oom_text(last_error()));
  throw std::runtime_error(last_error());
}

// ---- CUDA graph pools -------------------------------------------------------------------
// PyTorch's beginAllocateToPool hook passes a `std::function<bool(cudaStream_t)>` by value:
// under the Itanium C++ ABI a by-value argument of a class with a non-trivial copy
// constructor travels as a pointer to a temporary the caller owns, which is how the Rust
// hook (torch.rs) receives it. These helpers keep a copy of it and call it for the pool.
#include <functional>

struct CUstream_st;                      // the CUDA runtime's own declaration of
typedef struct CUstream_st *cudaStream_t;  // cudaStream_t, so the std::function type matches

namespace {
using StreamFilter = std::function<bool(cudaStream_t)>;
}

extern "C" void *gpupool_torch_filter_adopt(const void *filter) noexcept {
  try {
    return new StreamFilter(*static_cast<const StreamFilter *>(filter));
  } catch (...) {
    return nullptr;
  }
}

// 1 when the filter takes allocations on `stream`. A filter that throws (its own driver
// query failed) takes nothing.
extern "C" int gpupool_torch_filter_call(void *ctx, void *stream) noexcept {
  try {
    const StreamFilter &f = *static_cast<StreamFilter *>(ctx);
    return f && f(static_cast<cudaStream_t>(stream)) ? 1 : 0;
  } catch (...) {
    return 0;
  }
}

extern "C" void gpupool_torch_filter_drop(void *ctx) noexcept { delete static_cast<StreamFilter *>(ctx); }
