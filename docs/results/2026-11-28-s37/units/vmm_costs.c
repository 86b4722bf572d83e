/* What each VMM call of a granule costs by the allocation's properties, and whether
 * several threads importing or creating at once finish sooner (session 37).
 * cc vmm_costs.c -I$CUDA/include -lcuda -lpthread -o vmm_costs && ./vmm_costs
 * Part 1: for each of {plain, POSIX fd shareable, fd + GPUDirect RDMA capable (the arena's
 * default where the device reports it)}: 64 granules (2 MiB on the H200) created, mapped
 * side by side, granted in one cuMemSetAccess, unmapped, released; microseconds a granule
 * for each call, median of 5 rounds. Part 2: 256 exported granules imported
 * (cuMemImportFromShareableHandle), and 256 granules created, by T threads at once, each a
 * share (T = 1, 2, 4): the wall time. */
#include <cuda.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define CK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char *s; cuGetErrorString(r_, &s); \
    fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, s); exit(1); } } while (0)
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e6 + t.tv_nsec / 1e3; }
static int cmp(const void *a, const void *b) { double x = *(double *)a, y = *(double *)b; return x < y ? -1 : x > y; }
#define N 64
#define R 5
#define M 256
static CUcontext ctx;
static size_t G;
static CUmemAllocationProp prop;
static int fds[M];
static CUmemGenericAllocationHandle hs[M];

struct job { int from, to, create; };
static void *work(void *arg) {
  struct job *j = arg;
  CK(cuCtxSetCurrent(ctx));
  for (int i = j->from; i < j->to; i++) {
    if (j->create) CK(cuMemCreate(&hs[i], G, &prop, 0));
    else CK(cuMemImportFromShareableHandle(&hs[i], (void *)(long)fds[i], CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
  }
  return NULL;
}

static double threaded(int T, int create) {
  pthread_t th[8]; struct job j[8];
  double t = now();
  for (int k = 0; k < T; k++) { j[k].from = M * k / T; j[k].to = M * (k + 1) / T; j[k].create = create; pthread_create(&th[k], NULL, work, &j[k]); }
  for (int k = 0; k < T; k++) pthread_join(th[k], NULL);
  t = now() - t;
  for (int i = 0; i < M; i++) CK(cuMemRelease(hs[i]));
  return t;
}

int main(void) {
  CK(cuInit(0)); CUdevice dev; CK(cuDeviceGet(&dev, 0)); CK(cuDevicePrimaryCtxRetain(&ctx, dev)); CK(cuCtxSetCurrent(ctx));
  int rdma = 0;
  cuDeviceGetAttribute(&rdma, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED, dev);
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED; prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE; prop.location.id = 0;
  CK(cuMemGetAllocationGranularity(&G, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
  CUmemAccessDesc acc = {.location = prop.location, .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
  CUdeviceptr base; CK(cuMemAddressReserve(&base, N * G, 0, 0, 0));
  printf("granule %zu KiB; device reports GPUDirect RDMA with VMM: %d\n\n", G >> 10, rdma);
  printf("| properties | create | map | grant (one call over %d) | unmap | release | us a granule, all |\n|---|---|---|---|---|---|---|\n", N);
  const char *names[] = {"plain", "POSIX fd", "POSIX fd + GPUDirect RDMA"};
  for (int kind = 0; kind < 3; kind++) {
    if (kind == 2 && !rdma) continue;
    prop.requestedHandleTypes = kind ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR : CU_MEM_HANDLE_TYPE_NONE;
    prop.allocFlags.gpuDirectRDMACapable = kind == 2;
    double t[5][R];
    CUmemGenericAllocationHandle h[N];
    for (int r = 0; r < R; r++) {
      double a = now();
      for (int i = 0; i < N; i++) CK(cuMemCreate(&h[i], G, &prop, 0));
      double b = now();
      for (int i = 0; i < N; i++) CK(cuMemMap(base + i * G, G, 0, h[i], 0));
      double c = now();
      CK(cuMemSetAccess(base, N * G, &acc, 1));
      double d = now();
      for (int i = 0; i < N; i++) CK(cuMemUnmap(base + i * G, G));
      double e = now();
      for (int i = 0; i < N; i++) CK(cuMemRelease(h[i]));
      double f = now();
      t[0][r] = (b - a) / N; t[1][r] = (c - b) / N; t[2][r] = (d - c) / N; t[3][r] = (e - d) / N; t[4][r] = (f - e) / N;
    }
    double sum = 0;
    printf("| %s |", names[kind]);
    for (int k = 0; k < 5; k++) { qsort(t[k], R, sizeof(double), cmp); printf(" %.1f |", t[k][R / 2]); sum += t[k][R / 2]; }
    printf(" %.1f |\n", sum);
  }
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  prop.allocFlags.gpuDirectRDMACapable = rdma ? 1 : 0;
  CUmemGenericAllocationHandle own[M];
  for (int i = 0; i < M; i++) {
    CK(cuMemCreate(&own[i], G, &prop, 0));
    CK(cuMemExportToShareableHandle(&fds[i], own[i], CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  }
  printf("\n| threads | import %d granules, wall us | create %d granules, wall us |\n|---|---|---|\n", M, M);
  int ts[] = {1, 2, 4};
  for (int k = 0; k < 3; k++) {
    double wi[R], wc[R];
    for (int r = 0; r < R; r++) { wi[r] = threaded(ts[k], 0); wc[r] = threaded(ts[k], 1); }
    qsort(wi, R, sizeof(double), cmp); qsort(wc, R, sizeof(double), cmp);
    printf("| %d | %.0f | %.0f |\n", ts[k], wi[R / 2], wc[R / 2]);
  }
  return 0;
}
