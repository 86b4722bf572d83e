/* Does this driver map part of a physical allocation: cuMemMap at a non-zero offset into
 * the handle, or a prefix of it (session 37; session 11 saw CUDA_ERROR_NOT_SUPPORTED on
 * CUDA 13 at an offset)? For each of {plain, POSIX fd, POSIX fd + GPUDirect RDMA}: an
 * allocation of 8 granules, mapped (a) whole, (b) its first 2 granules only, (c) 1
 * granule at offset 1 granule, (d) 2 granules at offset 4; each result printed.
 * cc offset_map.c -I$CUDA/include -lcuda -o offset_map && ./offset_map */
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>

#define CK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char *s; cuGetErrorString(r_, &s); \
    fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, s); exit(1); } } while (0)

static const char *name(CUresult r) { const char *s = "?"; cuGetErrorName(r, &s); return s; }

int main(void) {
  CK(cuInit(0)); CUdevice dev; CK(cuDeviceGet(&dev, 0)); CUcontext ctx;
  CK(cuDevicePrimaryCtxRetain(&ctx, dev)); CK(cuCtxSetCurrent(ctx));
  int ver = 0; cuDriverGetVersion(&ver);
  int rdma = 0; cuDeviceGetAttribute(&rdma, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED, dev);
  CUmemAllocationProp prop = {0};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED; prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE; prop.location.id = 0;
  size_t G, Gmin;
  CK(cuMemGetAllocationGranularity(&G, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
  CK(cuMemGetAllocationGranularity(&Gmin, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  printf("driver %d, granule %zu KiB (minimum %zu KiB)\n", ver, G >> 10, Gmin >> 10);
  CUdeviceptr va; CK(cuMemAddressReserve(&va, 8 * G, 0, 0, 0));
  const char *kinds[] = {"plain", "POSIX fd", "POSIX fd + GPUDirect RDMA"};
  for (int k = 0; k < 3; k++) {
    if (k == 2 && !rdma) continue;
    prop.requestedHandleTypes = k ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR : CU_MEM_HANDLE_TYPE_NONE;
    prop.allocFlags.gpuDirectRDMACapable = k == 2;
    CUmemGenericAllocationHandle h; CK(cuMemCreate(&h, 8 * G, &prop, 0));
    struct { const char *what; size_t size, off; } t[] = {
      {"whole", 8 * G, 0}, {"first 2 granules", 2 * G, 0}, {"1 granule at offset 1", G, G}, {"2 granules at offset 4", 2 * G, 4 * G}};
    printf("%s:", kinds[k]);
    for (int i = 0; i < 4; i++) {
      CUresult r = cuMemMap(va, t[i].size, t[i].off, h, 0);
      printf(" %s -> %s;", t[i].what, name(r));
      if (r == CUDA_SUCCESS) CK(cuMemUnmap(va, t[i].size));
    }
    printf("\n");
    CK(cuMemRelease(h));
  }
  return 0;
}
