/* What the arena's stitch calls cost when many threads make them at once (session 31).
 * Each of T threads (1, 4, 16) has its own stream and 4 granules of 2 MiB of its own, and
 * runs ITERS turns; a turn records an event on its stream (what split and the arena both
 * do), and every STITCH_EVERY-th turn also makes a stitch as the arena does: the thread's 4
 * granules mapped a further time, side by side at fresh addresses of its own reserved range
 * (4 cuMemMap), and one cuMemSetAccess over them. Aliases are never unmapped (the arena's
 * cached stitches keep theirs). Every call is timed; printed per thread count: the mean and
 * p99 of each kind in microseconds, and the wall time, beside the same run without stitches.
 * gcc -O2 -o vmm_contention vmm_contention.c -I/usr/local/cuda/include -L/usr/local/cuda/lib64 -lcuda -lcudart -lpthread -lm
 */
#include <cuda.h>
#include <cuda_runtime.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define CK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char *s; cuGetErrorString(r_, &s); printf("%s: %s\n", #x, s); exit(1); } } while (0)
#define ITERS 20000
#define STITCH_EVERY 25 /* threads_bench's realloc rows: about 0.4 grants per 1,000 pairs is 1 per 2,500; denser here to see it */
#define GRAN (2ull << 20)
#define PIECES 4

static CUcontext ctx;
static CUdevice dev;
static int stitches_on;

typedef struct { double *rec, *map, *grant; int nrec, nmap, ngrant; double wall; } Times;

static double now_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static void *worker(void *arg) {
  Times *tm = arg;
  CK(cuCtxSetCurrent(ctx));
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  cudaEvent_t ev;
  cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
  CUmemAllocationProp prop = {0};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = dev;
  CUmemGenericAllocationHandle h[PIECES];
  for (int i = 0; i < PIECES; i++) CK(cuMemCreate(&h[i], GRAN, &prop, 0));
  size_t n_stitches = ITERS / STITCH_EVERY + 1;
  CUdeviceptr base;
  CK(cuMemAddressReserve(&base, n_stitches * PIECES * GRAN, GRAN, 0, 0));
  CUmemAccessDesc acc = {0};
  acc.location = prop.location;
  acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  tm->rec = malloc(sizeof(double) * ITERS);
  tm->map = malloc(sizeof(double) * n_stitches * PIECES);
  tm->grant = malloc(sizeof(double) * n_stitches);
  tm->nrec = tm->nmap = tm->ngrant = 0;
  size_t at = 0;
  double t0 = now_us();
  for (int i = 0; i < ITERS; i++) {
    double a = now_us();
    cudaEventRecord(ev, s);
    tm->rec[tm->nrec++] = now_us() - a;
    if (stitches_on && i % STITCH_EVERY == 0) {
      CUdeviceptr here = base + at * PIECES * GRAN;
      for (int p = 0; p < PIECES; p++) {
        a = now_us();
        CK(cuMemMap(here + p * GRAN, GRAN, 0, h[p], 0));
        tm->map[tm->nmap++] = now_us() - a;
      }
      a = now_us();
      CK(cuMemSetAccess(here, PIECES * GRAN, &acc, 1));
      tm->grant[tm->ngrant++] = now_us() - a;
      at++;
    }
  }
  tm->wall = now_us() - t0;
  cudaStreamSynchronize(s);
  for (size_t k = 0; k < at; k++)
    for (int p = 0; p < PIECES; p++) CK(cuMemUnmap(base + (k * PIECES + p) * GRAN, GRAN));
  CK(cuMemAddressFree(base, n_stitches * PIECES * GRAN));
  for (int i = 0; i < PIECES; i++) CK(cuMemRelease(h[i]));
  cudaEventDestroy(ev);
  cudaStreamDestroy(s);
  return NULL;
}

static int cmpd(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static void summary(const char *what, Times *tm, int T, int which) {
  size_t n = 0;
  for (int t = 0; t < T; t++) n += which == 0 ? tm[t].nrec : which == 1 ? tm[t].nmap : tm[t].ngrant;
  if (n == 0) return;
  double *all = malloc(sizeof(double) * n), sum = 0;
  size_t k = 0;
  for (int t = 0; t < T; t++) {
    int m = which == 0 ? tm[t].nrec : which == 1 ? tm[t].nmap : tm[t].ngrant;
    double *v = which == 0 ? tm[t].rec : which == 1 ? tm[t].map : tm[t].grant;
    for (int i = 0; i < m; i++) { all[k++] = v[i]; sum += v[i]; }
  }
  qsort(all, n, sizeof(double), cmpd);
  printf(" | %s mean %.2f p99 %.1f us (%zu)", what, sum / n, all[(size_t)(n * 0.99)], n);
  free(all);
}

int main(void) {
  cudaFree(0);
  CK(cuCtxGetCurrent(&ctx));
  CK(cuCtxGetDevice(&dev));
  int counts[3] = {1, 4, 16};
  for (int round = 0; round < 2; round++) {
    for (int c = 0; c < 3; c++) {
      for (stitches_on = 0; stitches_on <= 1; stitches_on++) {
        int T = counts[c];
        pthread_t th[16];
        Times tm[16];
        memset(tm, 0, sizeof tm);
        for (int t = 0; t < T; t++) pthread_create(&th[t], NULL, worker, &tm[t]);
        for (int t = 0; t < T; t++) pthread_join(th[t], NULL);
        double wall = 0;
        for (int t = 0; t < T; t++) wall = tm[t].wall > wall ? tm[t].wall : wall;
        printf("round %d | %2d threads | stitches %s | wall %.1f ms", round, T, stitches_on ? "on " : "off", wall / 1e3);
        summary("event record", tm, T, 0);
        summary("cuMemMap", tm, T, 1);
        summary("cuMemSetAccess (4 granules)", tm, T, 2);
        printf("\n");
        for (int t = 0; t < T; t++) { free(tm[t].rec); free(tm[t].map); free(tm[t].grant); }
      }
    }
  }
  return 0;
}
