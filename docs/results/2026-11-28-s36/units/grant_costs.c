/* What an access grant (cuMemSetAccess) costs, by what it covers, and whether parts of one
 * range granted by several threads at once finish sooner (session 36).
 * cc grant_costs.c -I$CUDA/include -lcuda -lpthread -o grant_costs && ./grant_costs
 * Allocations are created as the arena creates them (POSIX fd shareable, GPUDirect RDMA
 * capable where the device says so). For 16, 64 and 256 MiB: the range as 2 MiB
 * allocations of this process, as one allocation (a chunk), and as 2 MiB allocations
 * imported from their own descriptors (what a receiver maps); one grant over it, median of
 * 7, microseconds, with the whole range mapped afresh each time. Then 256 MiB of imported
 * granules granted in T parts by T threads at once (T = 1, 2, 4, 8). */
#include <cuda.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define CK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char *s; cuGetErrorString(r_, &s); \
    fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, s); exit(1); } } while (0)
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e6 + t.tv_nsec / 1e3; }
static int cmp(const void *a, const void *b) { double x = *(double *)a, y = *(double *)b; return x < y ? -1 : x > y; }
#define REP 7
#define MAXN 128
static CUcontext ctx;
static CUmemAccessDesc acc;
static size_t G;
static CUmemAllocationProp prop;
static CUdeviceptr base;

enum kind { OWN, CHUNK, IMPORTED };
static CUmemGenericAllocationHandle own[MAXN], chunk, imp[MAXN];
static int fds[MAXN];

static void map_range(enum kind k, int n) {
  if (k == CHUNK) { CK(cuMemMap(base, n * G, 0, chunk, 0)); return; }
  for (int i = 0; i < n; i++) {
    if (k == IMPORTED) CK(cuMemImportFromShareableHandle(&imp[i], (void *)(long)fds[i], CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
    CK(cuMemMap(base + i * G, G, 0, k == OWN ? own[i] : imp[i], 0));
  }
}
static void unmap_range(enum kind k, int n) {
  if (k == CHUNK) { CK(cuMemUnmap(base, n * G)); return; }
  for (int i = 0; i < n; i++) { CK(cuMemUnmap(base + i * G, G)); if (k == IMPORTED) CK(cuMemRelease(imp[i])); }
}

struct part { CUdeviceptr at; size_t len; double t; };
static void *grant_part(void *arg) {
  struct part *p = arg;
  CK(cuCtxSetCurrent(ctx));
  double t = now();
  CK(cuMemSetAccess(p->at, p->len, &acc, 1));
  p->t = now() - t;
  return NULL;
}

int main(void) {
  CK(cuInit(0)); CUdevice dev; CK(cuDeviceGet(&dev, 0)); CK(cuDevicePrimaryCtxRetain(&ctx, dev)); CK(cuCtxSetCurrent(ctx));
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED; prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE; prop.location.id = 0;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  int rdma = 0;
  cuDeviceGetAttribute(&rdma, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED, dev);
  prop.allocFlags.gpuDirectRDMACapable = rdma ? 1 : 0;
  CK(cuMemGetAllocationGranularity(&G, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
  acc.location = prop.location; acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  printf("granule %zu KiB, gpuDirectRDMACapable %d\n", G >> 10, rdma);
  for (int i = 0; i < MAXN; i++) {
    CK(cuMemCreate(&own[i], G, &prop, 0));
    CK(cuMemExportToShareableHandle(&fds[i], own[i], CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  }
  CK(cuMemCreate(&chunk, MAXN * G, &prop, 0));
  CK(cuMemAddressReserve(&base, MAXN * G, 0, 0, 0));
  printf("| MiB | 2 MiB allocations, own | one allocation | 2 MiB allocations, imported |\n|---|---|---|---|\n");
  int sizes[] = {8, 32, 128};
  for (int s = 0; s < 3; s++) {
    int n = sizes[s];
    double med[3];
    for (int k = 0; k < 3; k++) {
      double t[REP];
      for (int r = 0; r < REP; r++) {
        /* a chunk of n granules: a fresh allocation each size */
        if (k == CHUNK && r == 0) { CK(cuMemRelease(chunk)); CK(cuMemCreate(&chunk, n * G, &prop, 0)); }
        map_range(k, n);
        double t0 = now();
        CK(cuMemSetAccess(base, n * G, &acc, 1));
        t[r] = now() - t0;
        unmap_range(k, n);
      }
      qsort(t, REP, sizeof *t, cmp);
      med[k] = t[REP / 2];
    }
    printf("| %zu | %.0f | %.0f | %.0f |\n", n * G >> 20, med[0], med[1], med[2]);
  }
  printf("\n| threads | wall, 256 MiB of imported 2 MiB allocations granted in parts | slowest part |\n|---|---|---|\n");
  int ts[] = {1, 2, 4, 8};
  for (int ti = 0; ti < 4; ti++) {
    int T = ts[ti];
    double wall[REP], slow[REP];
    for (int r = 0; r < REP; r++) {
      map_range(IMPORTED, MAXN);
      pthread_t th[8]; struct part p[8];
      double t = now();
      for (int j = 0; j < T; j++) {
        p[j].at = base + (size_t)(MAXN * j / T) * G; p[j].len = (size_t)(MAXN * (j + 1) / T - MAXN * j / T) * G;
        pthread_create(&th[j], NULL, grant_part, &p[j]);
      }
      slow[r] = 0;
      for (int j = 0; j < T; j++) { pthread_join(th[j], NULL); if (p[j].t > slow[r]) slow[r] = p[j].t; }
      wall[r] = now() - t;
      unmap_range(IMPORTED, MAXN);
    }
    qsort(wall, REP, sizeof *wall, cmp); qsort(slow, REP, sizeof *slow, cmp);
    printf("| %d | %.0f | %.0f |\n", T, wall[REP / 2], slow[REP / 2]);
  }
  return 0;
}
