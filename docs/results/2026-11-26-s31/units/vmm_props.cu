// Session 31: session 30's vmm_reads.cu with what it did not test: granules created with the
// arena's exact properties (shareable as POSIX fds, and fabric handles where the device reports
// them; gpuDirectRDMACapable where it reports GPUDirect RDMA with VMM), the same granules read
// through a second mapping (a stitch's alias), and writes. A 1 GiB buffer laid out five ways:
// cudaMalloc; one cuMemCreate of 1 GiB; 512 plain granules of 2 MiB side by side; 512 granules
// with the arena's properties; those granules' alias. Three kernels: a streaming sum, random
// 4-byte reads (every warp's lanes at random granules), a streaming write. Median of 20 timed
// launches each after 3 untimed, in ms.
// nvcc -O2 -o vmm_props vmm_props.cu -lcuda && ./vmm_props
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

__global__ void stream_write(float4 *p, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    p[i] = make_float4(1.f, 2.f, 3.f, (float)i);
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
static void launch_write(void *) { stream_write<<<1056, 512>>>((float4 *)g_ptr, BYTES / 16); }

static std::vector<CUmemGenericAllocationHandle> g_kept;  // the arena-like granules, for their alias

static CUdeviceptr vmm(size_t piece, CUdevice dev, bool arena_props) {
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = dev;
  if (arena_props) {
    int fabric = 0, rdma = 0;
    cuDeviceGetAttribute(&fabric, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED, dev);
    cuDeviceGetAttribute(&rdma, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED, dev);
    prop.requestedHandleTypes = fabric ? (CUmemAllocationHandleType)(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR | CU_MEM_HANDLE_TYPE_FABRIC)
                                       : CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop.allocFlags.gpuDirectRDMACapable = rdma ? 1 : 0;
    printf("arena properties: fabric handles %d, gpuDirectRDMACapable %d\n", fabric, rdma);
  }
  CUdeviceptr base;
  CK(cuMemAddressReserve(&base, BYTES, GRAN, 0, 0));
  for (size_t off = 0; off < BYTES; off += piece) {
    CUmemGenericAllocationHandle h;
    CUresult r = cuMemCreate(&h, piece, &prop, 0);
    if (r != CUDA_SUCCESS && arena_props && (prop.requestedHandleTypes & CU_MEM_HANDLE_TYPE_FABRIC)) {
      // The arena steps down to fds where the driver refuses fabric handles.
      prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
      printf("fabric refused: POSIX fds only\n");
      r = cuMemCreate(&h, piece, &prop, 0);
    }
    CK(r);
    CK(cuMemMap(base + off, piece, 0, h, 0));
    if (arena_props) g_kept.push_back(h); else CK(cuMemRelease(h));
  }
  CUmemAccessDesc acc = {};
  acc.location = prop.location;
  acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CK(cuMemSetAccess(base, BYTES, &acc, 1));
  return base;
}

/* The kept granules mapped a second time, side by side in a range of their own (a stitch). */
static CUdeviceptr alias(CUdevice dev) {
  CUdeviceptr base;
  CK(cuMemAddressReserve(&base, BYTES, GRAN, 0, 0));
  for (size_t i = 0; i < g_kept.size(); i++) CK(cuMemMap(base + i * GRAN, GRAN, 0, g_kept[i], 0));
  CUmemAccessDesc acc = {};
  acc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  acc.location.id = dev;
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
  CUdeviceptr arena_like = vmm(GRAN, dev, true);
  void *ptrs[5] = {plain, (void *)vmm(BYTES, dev, false), (void *)vmm(GRAN, dev, false), (void *)arena_like, (void *)alias(dev)};
  const char *names[5] = {"cudaMalloc", "VMM, one 1 GiB allocation", "VMM, 512 plain 2 MiB", "VMM, 512 2 MiB, arena props", "the same, through an alias"};
  for (int k = 0; k < 4; k++) cudaMemset(ptrs[k], 1, BYTES);
  cudaDeviceSynchronize();
  for (int round = 0; round < 3; round++) {
    for (int k = 0; k < 5; k++) {
      g_ptr = ptrs[k];
      float s = time_ms(launch_stream, nullptr), r = time_ms(launch_random, nullptr), w = time_ms(launch_write, nullptr);
      printf("round %d | %-30s | stream read 1 GiB %.3f ms (%.0f GB/s) | random reads %.3f ms | stream write %.3f ms (%.0f GB/s)\n",
             round, names[k], s, BYTES / s / 1e6, r, w, BYTES / w / 1e6);
    }
  }
  return 0;
}
