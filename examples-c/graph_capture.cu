// Capture a CUDA graph whose kernels use gpupool memory, and replay it.
//
// Memory allocated before the capture (the graph's input and output) is used by the
// captured kernels; a temporary is allocated and freed *during* the capture, announced with
// gpupool_begin_allocate_to_pool so it comes from a private pool the graph keeps. Meanwhile
// another thread allocates and frees eagerly on its own stream: in global capture mode any
// unsafe driver call from any thread would invalidate the capture, so this also proves the
// pool makes none.
//
// usage: graph_capture [POOL]   (POOL: split, binned or arena; default split)
// Exit 0 when every replay matches the expected values and eager code never got the
// graph's memory.
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>
#include <cuda_runtime.h>
#include "gpupool.h"

#define CHECK_CUDA(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
  fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); exit(1); } } while (0)
#define CHECK_POOL(x) do { gpupool_status s_ = (x); if (s_ != GPUPOOL_STATUS_OK) { \
  char m_[512]; gpupool_last_error(m_, sizeof m_); fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, m_); exit(1); } } while (0)

__global__ void scale(const float *in, float *out, size_t n, float a) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) out[i] = a * in[i];
}
__global__ void add_one(const float *in, float *out, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) out[i] = in[i] + 1.0f;
}
__global__ void fill(float *p, size_t n, float v) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) p[i] = v;
}

int main(int argc, char **argv) {
  const char *pool = argc > 1 ? argv[1] : "split";
  CHECK_POOL(gpupool_configure(0, pool, "device"));
  const size_t n = 1 << 22, bytes = n * sizeof(float);  // 16 MiB buffers
  cudaStream_t s;
  CHECK_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

  float *in, *out;
  CHECK_POOL(gpupool_malloc((void **)&in, bytes, 0, s));
  CHECK_POOL(gpupool_malloc((void **)&out, bytes, 0, s));

  // An eager thread keeps allocating during the capture.
  std::atomic<bool> stop{false};
  std::atomic<long> eager_errors{0}, eager_ops{0};
  std::thread eager([&] {
    cudaStream_t e;
    if (cudaStreamCreateWithFlags(&e, cudaStreamNonBlocking) != cudaSuccess) { eager_errors++; return; }
    while (!stop.load()) {
      void *p = nullptr;
      if (gpupool_malloc(&p, (1 + eager_ops % 7) << 20, 0, e) != GPUPOOL_STATUS_OK) { eager_errors++; continue; }
      fill<<<64, 256, 0, e>>>((float *)p, 1024, 3.0f);
      if (gpupool_free(p, 0, e) != GPUPOOL_STATUS_OK) eager_errors++;
      eager_ops++;
    }
    cudaStreamSynchronize(e);
    cudaStreamDestroy(e);
  });

  // Let the eager thread's sizes be cached first: it then runs on cached blocks, as a
  // steady-state program does (a first-time cudaMalloc from another thread during a
  // global-mode capture is the application's own unsafe call, whatever the allocator).
  while (eager_ops.load() < 200 && eager_errors.load() == 0) std::this_thread::yield();

  cudaGraph_t graph;
  CHECK_CUDA(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  CHECK_POOL(gpupool_begin_allocate_to_pool(0, 1, s));
  float *tmp, *tmp2;
  CHECK_POOL(gpupool_malloc((void **)&tmp, bytes, 0, s));   // from the private pool
  scale<<<256, 256, 0, s>>>(in, tmp, n, 2.0f);
  CHECK_POOL(gpupool_malloc((void **)&tmp2, bytes, 0, s));
  add_one<<<256, 256, 0, s>>>(tmp, tmp2, n);
  CHECK_POOL(gpupool_free(tmp, 0, s));                       // back to the private pool
  float *tmp3;
  CHECK_POOL(gpupool_malloc((void **)&tmp3, bytes, 0, s));  // may reuse tmp: graph order protects it
  scale<<<256, 256, 0, s>>>(tmp2, tmp3, n, 3.0f);
  add_one<<<256, 256, 0, s>>>(tmp3, out, n);
  CHECK_POOL(gpupool_free(tmp2, 0, s));
  CHECK_POOL(gpupool_free(tmp3, 0, s));
  CHECK_CUDA(cudaStreamEndCapture(s, &graph));  // fails if anything invalidated the capture
  CHECK_POOL(gpupool_end_allocate_to_pool(0, 1));
  stop = true;
  eager.join();

  cudaGraphExec_t exec;
  CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  std::vector<float> host(n);
  int bad = 0;
  for (int r = 0; r < 10; r++) {
    fill<<<256, 256, 0, s>>>(in, n, (float)r);
    CHECK_CUDA(cudaGraphLaunch(exec, s));
    // Eager allocations between replays must not land in the graph's private memory.
    void *e = nullptr;
    CHECK_POOL(gpupool_malloc(&e, bytes, 0, s));
    if ((char *)e + bytes > (char *)tmp && (char *)e < (char *)tmp + 2 * bytes) {
      fprintf(stderr, "eager block %p overlaps the graph's private memory at %p\n", e, (void *)tmp);
      bad++;
    }
    fill<<<256, 256, 0, s>>>((float *)e, n, -1.0f);
    CHECK_POOL(gpupool_free(e, 0, s));
    CHECK_CUDA(cudaMemcpyAsync(host.data(), out, bytes, cudaMemcpyDeviceToHost, s));
    CHECK_CUDA(cudaStreamSynchronize(s));
    const float want = 3.0f * (2.0f * r + 1.0f) + 1.0f;
    for (size_t i = 0; i < n; i += 4099)
      if (host[i] != want) { bad++; if (bad < 5) fprintf(stderr, "replay %d: out[%zu] = %g, want %g\n", r, i, host[i], want); }
  }
  char status[4096];
  gpupool_memory_status(0, status, sizeof status);
  printf("%s", status);

  CHECK_CUDA(cudaGraphExecDestroy(exec));
  CHECK_CUDA(cudaGraphDestroy(graph));
  gpupool_stats before = gpupool_stats_init(), after = gpupool_stats_init();
  CHECK_POOL(gpupool_get_stats(0, &before));
  CHECK_POOL(gpupool_release_pool(0, 1));
  CHECK_POOL(gpupool_get_stats(0, &after));
  CHECK_POOL(gpupool_free(in, 0, s));
  CHECK_POOL(gpupool_free(out, 0, s));
  CHECK_CUDA(cudaStreamDestroy(s));
  printf("graph_capture pool=%s replays=10 bad=%d eager_ops=%ld eager_errors=%ld private_released=%llu bytes\n", pool, bad,
         eager_ops.load(), eager_errors.load(), (unsigned long long)(before.total_bytes - after.total_bytes));
  if (before.total_bytes - after.total_bytes < 2 * bytes) {
    fprintf(stderr, "releasing the pool gave back less than the graph's temporaries\n");
    return 1;
  }
  return bad == 0 && eager_errors == 0 && eager_ops > 0 ? 0 : 1;
}
