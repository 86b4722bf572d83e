// PyTorch's graph-pool hooks, called the way PyTorch calls them (host upstream, no GPU):
// CUDAPluggableAllocator wraps the raw addresses the Python helper hands it in
// std::function<void(int, MempoolId_t, std::function<bool(cudaStream_t)>)> and
// std::function<void(int, MempoolId_t)>, with MempoolId_t = std::pair<unsigned long long,
// unsigned long long>. This test does the same with the library's exported symbols, so a
// mismatch between our C prototypes and PyTorch's C++ ones (argument passing of the pair and
// of the std::function) fails here on the CPU instead of corrupting a GPU run.
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <utility>
#include "gpupool_plugin.h"

struct CUstream_st;
typedef struct CUstream_st *cudaStream_t;
using MempoolId_t = std::pair<unsigned long long, unsigned long long>;
using Filter = std::function<bool(cudaStream_t)>;
using BeginFn = void(int, MempoolId_t, Filter);
using EndFn = void(int, MempoolId_t);

static int failed = 0, passed = 0;
#define CHECK(c, ...) do { if (c) passed++; else { failed++; fprintf(stderr, "FAIL line %d: %s: ", __LINE__, #c); fprintf(stderr, __VA_ARGS__); fprintf(stderr, "\n"); } } while (0)

static std::string json(int dev) {
  size_t n = gpupool_stats_json(dev, nullptr, 0);
  std::string s(n + 1, '\0');
  gpupool_stats_json(dev, &s[0], s.size());
  s.resize(n);
  return s;
}

int main() {
  const int dev = 7;
  CHECK(gpupool_configure(dev, "split", "host") == GPUPOOL_STATUS_OK, "configure");
  // What PyTorch's setters do: reinterpret the addresses as these function types.
  std::function<BeginFn> begin = reinterpret_cast<BeginFn *>(&gpupool_torch_begin_allocate_to_pool);
  std::function<EndFn> end = reinterpret_cast<EndFn *>(&gpupool_torch_end_allocate_to_pool);
  std::function<EndFn> release = reinterpret_cast<EndFn *>(&gpupool_torch_release_pool);

  cudaStream_t capture = reinterpret_cast<cudaStream_t>(0x5000), other = reinterpret_cast<cudaStream_t>(0x7000);
  int calls = 0;
  Filter filter = [&](cudaStream_t s) { calls++; return s == capture; };
  MempoolId_t id{42, 0};
  begin(dev, id, filter);  // by value, as CUDAPluggableAllocator::beginAllocateToPool passes it

  void *a = nullptr, *b = nullptr;
  CHECK(gpupool_malloc(&a, 1 << 20, dev, capture) == GPUPOOL_STATUS_OK, "malloc on the routed stream");
  CHECK(gpupool_malloc(&b, 1 << 20, dev, other) == GPUPOOL_STATUS_OK, "malloc on another stream");
  CHECK(calls >= 2, "the filter was called through the copy the library keeps (%d calls)", calls);
  std::string j = json(dev);
  CHECK(j.find("\"private_pools\":{\"count\":1,") != std::string::npos, "one private pool: %s", j.c_str());
  CHECK(j.find("\"reserved_bytes\":0,") == std::string::npos, "the routed allocation is in it: %s", j.c_str());

  end(dev, id);
  CHECK(gpupool_free(a, dev, capture) == GPUPOOL_STATUS_OK, "free");
  CHECK(gpupool_free(b, dev, other) == GPUPOOL_STATUS_OK, "free");
  release(dev, MempoolId_t{42, 0});
  j = json(dev);
  CHECK(j.find("\"private_pools\":{\"count\":0,") != std::string::npos, "the pool went back: %s", j.c_str());
  // The pair's halves arrive in order: a pool id {0, 42} is another pool (never begun):
  // releasing it changes nothing and is no error.
  release(dev, MempoolId_t{0, 42});
  printf("torch_hooks_abi: %d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
