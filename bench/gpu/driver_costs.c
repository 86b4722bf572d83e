/* What the upstreams' driver calls cost on this GPU (no gpupool): cuMemAlloc + cuMemFree of
 * a segment, and the vmm upstream's page operations (cuMemCreate + cuMemMap per page and one
 * cuMemSetAccess to commit; cuMemUnmap + cuMemRelease per page to decommit). Two variants
 * answer whether page mapping could be cheaper: the same range as one physical allocation,
 * and per-page handles kept and mapped again (recycling). Explains the speed side of the
 * decay / vmm trade-off (docs/arena.md). µs per operation. */
#include <cuda.h>
#include <stdio.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

#define CK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { printf("%s failed: %d\n", #x, (int)r_); return 1; } } while (0)
#define REPS 200

int main(void) {
  CUdevice dev;
  CUcontext ctx;
  CK(cuInit(0));
  CK(cuDeviceGet(&dev, 0));
  CK(cuDevicePrimaryCtxRetain(&ctx, dev));
  CK(cuCtxSetCurrent(ctx));
  CUmemAllocationProp prop = {0};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  size_t page = 0;
  CK(cuMemGetAllocationGranularity(&page, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  CUmemAccessDesc acc = {prop.location, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
  size_t sizes[] = {2u << 20, 16u << 20, 64u << 20};
  for (int s = 0; s < 3; s++) {
    size_t size = sizes[s], pages = size / page;
    double t = now(), alloc = 0, freet = 0;
    for (int i = 0; i < REPS; i++) {
      CUdeviceptr p;
      t = now(); CK(cuMemAlloc(&p, size)); alloc += now() - t;
      t = now(); CK(cuMemFree(p)); freet += now() - t;
    }
    printf("driver cuMemAlloc %zu MiB: %.1f us, cuMemFree: %.1f us\n", size >> 20, alloc / REPS * 1e6, freet / REPS * 1e6);
    CUdeviceptr va;
    CK(cuMemAddressReserve(&va, size, page, 0, 0));
    CUmemGenericAllocationHandle h[64]; /* up to 128 MiB in 2 MiB pages */
    double create = 0, map = 0, access = 0, unmap = 0, release = 0;
    for (int i = 0; i < REPS; i++) {
      t = now();
      for (size_t k = 0; k < pages; k++) CK(cuMemCreate(&h[k], page, &prop, 0));
      create += now() - t; t = now();
      for (size_t k = 0; k < pages; k++) CK(cuMemMap(va + k * page, page, 0, h[k], 0));
      map += now() - t; t = now();
      CK(cuMemSetAccess(va, size, &acc, 1));
      access += now() - t; t = now();
      for (size_t k = 0; k < pages; k++) CK(cuMemUnmap(va + k * page, page));
      unmap += now() - t; t = now();
      for (size_t k = 0; k < pages; k++) CK(cuMemRelease(h[k]));
      release += now() - t;
    }
    printf("driver vmm %zu MiB (%zu pages of %zu KiB): cuMemCreate %.1f us, cuMemMap %.1f us, cuMemSetAccess %.1f us, cuMemUnmap %.1f us, cuMemRelease %.1f us (per %zu MiB)\n",
           size >> 20, pages, page >> 10, create / REPS * 1e6, map / REPS * 1e6, access / REPS * 1e6, unmap / REPS * 1e6,
           release / REPS * 1e6, size >> 20);
    /* One physical allocation for the whole range (one handle, one map): whether the cost
     * is per call or per byte. */
    double one_commit = 0, one_decommit = 0;
    for (int i = 0; i < REPS; i++) {
      CUmemGenericAllocationHandle one;
      t = now();
      CK(cuMemCreate(&one, size, &prop, 0));
      CK(cuMemMap(va, size, 0, one, 0));
      CK(cuMemSetAccess(va, size, &acc, 1));
      one_commit += now() - t; t = now();
      CK(cuMemUnmap(va, size));
      CK(cuMemRelease(one));
      one_decommit += now() - t;
    }
    /* Physical pages kept and mapped again (what recycling pages inside a pool would pay):
     * cuMemUnmap, then cuMemMap + cuMemSetAccess of the same handles. */
    for (size_t k = 0; k < pages; k++) CK(cuMemCreate(&h[k], page, &prop, 0));
    double remap_unmap = 0, remap_map = 0;
    for (int i = 0; i < REPS; i++) {
      t = now();
      for (size_t k = 0; k < pages; k++) CK(cuMemMap(va + k * page, page, 0, h[k], 0));
      CK(cuMemSetAccess(va, size, &acc, 1));
      remap_map += now() - t; t = now();
      for (size_t k = 0; k < pages; k++) CK(cuMemUnmap(va + k * page, page));
      remap_unmap += now() - t;
    }
    for (size_t k = 0; k < pages; k++) CK(cuMemRelease(h[k]));
    printf("driver vmm %zu MiB as one allocation: commit (create + map + access) %.1f us, decommit (unmap + release) %.1f us; "
           "per-page handles kept: map + access %.1f us, unmap %.1f us\n",
           size >> 20, one_commit / REPS * 1e6, one_decommit / REPS * 1e6, remap_map / REPS * 1e6, remap_unmap / REPS * 1e6);
    CK(cuMemAddressFree(va, size));
  }
  return 0;
}
