/* What the upstreams' driver calls cost on this GPU (no gpupool): cuMemAlloc + cuMemFree of
 * a segment, and the vmm upstream's page operations (cuMemCreate + cuMemMap per page and one
 * cuMemSetAccess to commit; cuMemUnmap + cuMemRelease per page to decommit). Two variants
 * answer whether page mapping could be cheaper: the same range as one physical allocation,
 * and per-page handles kept and mapped again (recycling). Explains the speed side of the
 * decay / vmm trade-off (docs/arena.md). µs per operation.
 * Sharing: what a send of many allocations pays per allocation, made by one thread or
 * spread over several (whether the driver runs them side by side): the sender's
 * cuMemExportToShareableHandle (POSIX descriptor) against cuIpcGetMemHandle of a
 * cuMemAlloc segment (PyTorch's route), and the receiver's cuMemImportFromShareableHandle +
 * cuMemMap + cuMemSetAccess of the same descriptors. */
#include <cuda.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

#define CK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { printf("%s failed: %d\n", #x, (int)r_); return 1; } } while (0)
#define REPS 200
#define SHARED 512

static CUmemGenericAllocationHandle shared_h[SHARED];
static int shared_fd[SHARED];
static CUcontext shared_ctx;
static CUdeviceptr shared_va;
static size_t shared_page;
static CUmemAccessDesc shared_acc;
struct share_job { int from, to, import; };

/* Export (or import and map) allocations [from, to). */
static void *share_part(void *arg) {
  const struct share_job *j = arg;
  cuCtxSetCurrent(shared_ctx);
  for (int k = j->from; k < j->to; k++) {
    if (!j->import) {
      if (cuMemExportToShareableHandle(&shared_fd[k], shared_h[k], CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0) != CUDA_SUCCESS) shared_fd[k] = -1;
    } else {
      CUmemGenericAllocationHandle h;
      CUdeviceptr at = shared_va + (size_t)k * shared_page;
      if (cuMemImportFromShareableHandle(&h, (void *)(long)shared_fd[k], CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) != CUDA_SUCCESS) continue;
      cuMemMap(at, shared_page, 0, h, 0);
      cuMemRelease(h);
      cuMemSetAccess(at, shared_page, &shared_acc, 1);
    }
  }
  return NULL;
}

/* Seconds for SHARED exports (or imports) spread over `threads` threads. */
static double share_round(int threads, int import) {
  pthread_t t[16];
  struct share_job j[16];
  double t0 = now();
  for (int i = 0; i < threads; i++) {
    j[i] = (struct share_job){SHARED * i / threads, SHARED * (i + 1) / threads, import};
    pthread_create(&t[i], NULL, share_part, &j[i]);
  }
  for (int i = 0; i < threads; i++) pthread_join(t[i], NULL);
  return now() - t0;
}

static int share_costs(CUdevice dev, const CUmemAllocationProp *base) {
  CUmemAllocationProp prop = *base;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  CK(cuMemGetAllocationGranularity(&shared_page, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  shared_acc = (CUmemAccessDesc){prop.location, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
  CK(cuCtxGetCurrent(&shared_ctx));
  for (int k = 0; k < SHARED; k++) CK(cuMemCreate(&shared_h[k], shared_page, &prop, 0));
  CK(cuMemAddressReserve(&shared_va, SHARED * shared_page, shared_page, 0, 0));
  int counts[] = {1, 4, 8, 16};
  for (int c = 0; c < 4; c++) {
    double ex = share_round(counts[c], 0);
    for (int k = 0; k < SHARED; k++) if (shared_fd[k] < 0) { printf("cuMemExportToShareableHandle failed\n"); return 1; }
    double im = share_round(counts[c], 1);
    CK(cuMemUnmap(shared_va, SHARED * shared_page));
    for (int k = 0; k < SHARED; k++) close(shared_fd[k]);
    printf("driver share %d allocations of %zu KiB, %d thread(s): export %.1f us each (%.1f ms), import + map + access %.1f us each (%.1f ms)\n",
           SHARED, shared_page >> 10, counts[c], ex / SHARED * 1e6, ex * 1e3, im / SHARED * 1e6, im * 1e3);
  }
  CK(cuMemAddressFree(shared_va, SHARED * shared_page));
  for (int k = 0; k < SHARED; k++) CK(cuMemRelease(shared_h[k]));
  double get = 0;
  for (int i = 0; i < REPS; i++) {
    CUdeviceptr p;
    CUipcMemHandle ih;
    CK(cuMemAlloc(&p, 16u << 20));
    double t = now();
    CK(cuIpcGetMemHandle(&ih, p));
    get += now() - t;
    CK(cuMemFree(p));
  }
  printf("driver cuIpcGetMemHandle of a 16 MiB segment: %.1f us\n", get / REPS * 1e6);
  (void)dev;
  return 0;
}

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
  if (share_costs(dev, &prop)) return 1;
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
