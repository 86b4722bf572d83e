// Do kernels read memory mapped as many 2 MiB physical allocations (the arena's granules) as
// fast as cudaMalloc memory or one large physical allocation? Reads of a 1 GiB buffer laid out
// three ways: cudaMalloc; one cuMemCreate of 1 GiB mapped once (a chunk); 512 cuMemCreate of
// 2 MiB mapped side by side (granules). Two kernels: a streaming sum, and random 4-byte reads
// (every warp's lanes at random granules: what the GPU's TLBs see worst). Median of 20 timed
// launches each after 3 untimed, in ms.
// nvcc -O2 -o vmm_reads vmm_reads.cu -lcuda && ./vmm_reads
#include <cuda.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <algorithm>
#include <vector>

#define CK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char *s; cuGetErrorString(r_, &s); printf("%s: %s\n", #x, s); exit(1); } } while (0)

static const size_t BYTES = 1ull << 30, GRAN = 2ull << 20;

__global__ void stream_sum(const float4 *p, size_t n, float *out) {
  float acc = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    float4 v = p[i];
    acc += v.x + v.y + v.z + v.w;
  }
  if (acc == 1234.5f) *out = acc;
}

__global__ void random_reads(const unsigned *p, size_t n, unsigned iters, unsigned *out) {
  unsigned long long x = 0x9E3779B97F4A7C15ull ^ (blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x);
  unsigned acc = 0;
  for (unsigned k = 0; k < iters; k++) {
    x ^= x << 13; x ^= x >> 7; x ^= x << 17;
    acc += p[x % n];
  }
  if (acc == 0xdeadbeef) *out = acc;
}

static float time_ms(void (*launch)(void *), void *arg) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  std::vector<float> t;
  for (int i = 0; i < 23; i++) {
    cudaEventRecord(a);
    launch(arg);
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float ms;
    cudaEventElapsedTime(&ms, a, b);
    if (i >= 3) t.push_back(ms);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

static void *g_ptr;
static float *g_out;
static void launch_stream(void *) { stream_sum<<<1056, 512>>>((const float4 *)g_ptr, BYTES / 16, g_out); }
static void launch_random(void *) { random_reads<<<1056, 512>>>((const unsigned *)g_ptr, BYTES / 4, 256, (unsigned *)g_out); }

static CUdeviceptr vmm(size_t piece, CUdevice dev) {
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = dev;
  CUdeviceptr base;
  CK(cuMemAddressReserve(&base, BYTES, GRAN, 0, 0));
  for (size_t off = 0; off < BYTES; off += piece) {
    CUmemGenericAllocationHandle h;
    CK(cuMemCreate(&h, piece, &prop, 0));
    CK(cuMemMap(base + off, piece, 0, h, 0));
    CK(cuMemRelease(h));
  }
  CUmemAccessDesc acc = {};
  acc.location = prop.location;
  acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CK(cuMemSetAccess(base, BYTES, &acc, 1));
  return base;
}

int main() {
  cudaFree(0);
  CUdevice dev;
  CK(cuCtxGetDevice(&dev));
  cudaMalloc(&g_out, 64);
  void *plain;
  cudaMalloc(&plain, BYTES);
  void *ptrs[3] = {plain, (void *)vmm(BYTES, dev), (void *)vmm(GRAN, dev)};
  const char *names[3] = {"cudaMalloc", "VMM, one 1 GiB allocation", "VMM, 512 allocations of 2 MiB"};
  for (int k = 0; k < 3; k++) cudaMemset(ptrs[k], 1, BYTES);
  cudaDeviceSynchronize();
  for (int round = 0; round < 3; round++) {
    for (int k = 0; k < 3; k++) {
      g_ptr = ptrs[k];
      float s = time_ms(launch_stream, nullptr), r = time_ms(launch_random, nullptr);
      printf("round %d | %-30s | stream 1 GiB %.3f ms (%.0f GB/s) | random reads %.3f ms\n", round, names[k], s, BYTES / s / 1e6, r);
    }
  }
  return 0;
}
