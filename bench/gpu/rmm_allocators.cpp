// RMM's C++ memory resources behind a small C interface, so bench/gpu/threads_bench.c can
// put them in the same table as gpupool and cudaMallocAsync (one run measures every allocator).
// Built only when CMake is given the librmm wheel (-DGPUPOOL_RMM_ROOT=.../librmm, with
// -DGPUPOOL_RAPIDS_LOGGER_ROOT=.../rapids_logger); scripts/gpu_check.sh unpacks both from
// .whl/. RMM 26.10's resources take their upstream as a `cuda::mr::any_resource` and
// allocate with `allocate(cuda::stream_ref, bytes, alignment)`.
//
// Resources, each over `cuda_memory_resource` (cudaMalloc) unless said otherwise:
// - pool: `pool_memory_resource`, initial pool 4 GiB (RMM's own benchmarks start it large,
//   so growth does not dominate), no maximum;
// - arena: `arena_memory_resource`, global arena of RMM's default size (half the free
//   memory; its per-thread arenas serve only the per-thread default stream, so the rows
//   here use its per-stream arenas);
// - cuda_async: `cuda_async_memory_resource` (the driver's pool; release threshold at
//   its maximum, RMM's default).
// Every call catches RMM's exceptions: a failure returns NULL / -1 and is counted by the
// benchmark, never thrown through C.
#include <cuda/stream_ref>
#include <rmm/mr/arena_memory_resource.hpp>
#include <rmm/mr/cuda_async_memory_resource.hpp>
#include <rmm/mr/cuda_memory_resource.hpp>
#include <rmm/mr/pool_memory_resource.hpp>

#include <cstdio>
#include <memory>
#include <optional>
#include <variant>

#include "rmm_allocators.h"

namespace {

using resource = std::variant<rmm::mr::pool_memory_resource, rmm::mr::arena_memory_resource,
                              rmm::mr::cuda_async_memory_resource>;

constexpr std::size_t kAlign = 256;
const char *const kNames[] = {"RMM pool", "RMM arena", "RMM cuda_async"};
std::unique_ptr<resource> g_res[3];

resource *get(int kind) { return kind >= 0 && kind < 3 ? g_res[kind].get() : nullptr; }

}  // namespace

extern "C" int rmm_bench_count(void) { return 3; }

extern "C" const char *rmm_bench_name(int kind) { return kind >= 0 && kind < 3 ? kNames[kind] : "?"; }

extern "C" int rmm_bench_setup(int kind) {
  try {
    rmm::mr::cuda_memory_resource cuda;
    switch (kind) {
      case 0:
        g_res[0] = std::make_unique<resource>(std::in_place_index<0>, cuda, std::size_t{4} << 30);
        return 0;
      case 1:
        g_res[1] = std::make_unique<resource>(std::in_place_index<1>, cuda);
        return 0;
      case 2:
        g_res[2] = std::make_unique<resource>(std::in_place_index<2>);
        return 0;
      default:
        return -1;
    }
  } catch (std::exception const &e) {
    std::fprintf(stderr, "rmm_bench_setup(%s): %s\n", rmm_bench_name(kind), e.what());
    return -1;
  }
}

extern "C" void rmm_bench_teardown(int kind) {
  if (kind >= 0 && kind < 3) g_res[kind].reset();
}

extern "C" void *rmm_bench_alloc(int kind, size_t bytes, cudaStream_t stream) {
  resource *r = get(kind);
  if (!r) return nullptr;
  try {
    return std::visit([&](auto &mr) { return mr.allocate(cuda::stream_ref{stream}, bytes, kAlign); }, *r);
  } catch (...) {
    return nullptr;
  }
}

extern "C" int rmm_bench_free(int kind, void *p, size_t bytes, cudaStream_t stream) {
  resource *r = get(kind);
  if (!r) return -1;
  try {
    std::visit([&](auto &mr) { mr.deallocate(cuda::stream_ref{stream}, p, bytes, kAlign); }, *r);
    return 0;
  } catch (...) {
    return -1;
  }
}
