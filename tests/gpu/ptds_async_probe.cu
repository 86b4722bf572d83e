// Diagnostic for the open async + per-thread-stream hang (README "Known open problems"):
// the same cuMemAllocAsync / kernel / cuMemFreeAsync pattern on CU_STREAM_PER_THREAD from 8
// threads, without gpupool. Modes add what gpupool does: "raw", "raw+id" (cuStreamGetId),
// "raw+ev" (event record per free), "lock" (a global lock around the driver calls).
#include <cuda.h>
#include <cuda_runtime.h>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>
__global__ void fill(unsigned *p, size_t n) { for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) p[i] = 1; }
static std::mutex m;
static const char *mode;
static void worker(int t) {
  CUevent ev; bool useev = strstr(mode, "ev"), useid = strstr(mode, "id"), lock = strstr(mode, "lock");
  CUcontext ctx; cuDevicePrimaryCtxRetain(&ctx, 0); cuCtxSetCurrent(ctx);
  cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING);
  for (int r = 0; r < 200; r++) {
    size_t n = (size_t)1024 << (r % 10);
    CUdeviceptr p;
    unsigned long long id;
    { std::unique_lock<std::mutex> g(m, std::defer_lock); if (lock) g.lock();
      if (useid) cuStreamGetId(CU_STREAM_PER_THREAD, &id);
      if (cuMemAllocAsync(&p, n * 4, CU_STREAM_PER_THREAD)) { printf("alloc failed\n"); return; } }
    fill<<<64, 256, 0, cudaStreamPerThread>>>((unsigned *)p, n);
    { std::unique_lock<std::mutex> g(m, std::defer_lock); if (lock) g.lock();
      if (useid) cuStreamGetId(CU_STREAM_PER_THREAD, &id);
      if (useev) cuEventRecord(ev, CU_STREAM_PER_THREAD);
      cuMemFreeAsync(p, CU_STREAM_PER_THREAD); }
  }
  cudaStreamSynchronize(cudaStreamPerThread);
}
int main(int argc, char **argv) {
  mode = argc > 1 ? argv[1] : "raw";
  cuInit(0); cudaFree(0);
  std::vector<std::thread> th;
  for (int t = 0; t < 8; t++) th.emplace_back(worker, t);
  for (auto &x : th) x.join();
  printf("mode %s: done (%s)\n", mode, cudaGetErrorString(cudaDeviceSynchronize()));
}
