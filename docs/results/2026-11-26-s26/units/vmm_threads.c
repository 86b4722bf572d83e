/* Does the driver run a receiver's imports and access grants in parallel? (session 26)
 * cc vmm_threads.c -I$CUDA/include -lcuda -lpthread -o vmm_threads && ./vmm_threads
 * 256 granules (2 MiB, created shareable as POSIX fds, this process's own exports) are
 * imported (cuMemImportFromShareableHandle), mapped side by side in one reserved range and
 * granted access, split over T threads (each its share: import, map, one cuMemSetAccess
 * over its part), T = 1, 2, 4, 8; wall time of the whole, median of 7, microseconds. */
#include <cuda.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#define CK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char *s; cuGetErrorString(r_, &s); \
    fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, s); exit(1); } } while (0)
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e6 + t.tv_nsec / 1e3; }
static int cmp(const void *a, const void *b) { double x = *(double *)a, y = *(double *)b; return x < y ? -1 : x > y; }
#define K 256
#define REP 7
static CUcontext ctx;
static CUmemAccessDesc acc;
static size_t G;
static int fd[K];
static CUmemGenericAllocationHandle imp[K];
static CUdeviceptr base;
struct part { int lo, hi; double t_import, t_access; };

static void *work(void *arg) {
    struct part *p = arg;
    CK(cuCtxSetCurrent(ctx));
    double t = now();
    for (int i = p->lo; i < p->hi; i++) {
        CK(cuMemImportFromShareableHandle(&imp[i], (void *)(long)fd[i], CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
        CK(cuMemMap(base + i * G, G, 0, imp[i], 0));
    }
    p->t_import = now() - t;
    t = now();
    CK(cuMemSetAccess(base + p->lo * G, (p->hi - p->lo) * G, &acc, 1));
    p->t_access = now() - t;
    return NULL;
}

int main(void) {
    CK(cuInit(0)); CUdevice dev; CK(cuDeviceGet(&dev, 0)); CK(cuDevicePrimaryCtxRetain(&ctx, dev)); CK(cuCtxSetCurrent(ctx));
    CUmemAllocationProp prop = {0};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED; prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE; prop.location.id = 0;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    CK(cuMemGetAllocationGranularity(&G, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
    acc.location = prop.location; acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    for (int i = 0; i < K; i++) {
        CUmemGenericAllocationHandle h; CK(cuMemCreate(&h, G, &prop, 0));
        CK(cuMemExportToShareableHandle(&fd[i], h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
    }
    CK(cuMemAddressReserve(&base, K * G, 0, 0, 0));
    printf("| threads | wall, 256 imports + maps + grants | slowest thread's imports+maps | slowest thread's grant |\n|---|---|---|---|\n");
    int ts[] = {1, 2, 4, 8};
    for (unsigned ti = 0; ti < sizeof ts / sizeof *ts; ti++) {
        int T = ts[ti];
        double wall[REP], imp_t[REP], acc_t[REP];
        for (int r = 0; r < REP; r++) {
            pthread_t th[8]; struct part p[8];
            double t = now();
            for (int j = 0; j < T; j++) { p[j].lo = K * j / T; p[j].hi = K * (j + 1) / T; pthread_create(&th[j], NULL, work, &p[j]); }
            imp_t[r] = acc_t[r] = 0;
            for (int j = 0; j < T; j++) {
                pthread_join(th[j], NULL);
                if (p[j].t_import > imp_t[r]) imp_t[r] = p[j].t_import;
                if (p[j].t_access > acc_t[r]) acc_t[r] = p[j].t_access;
            }
            wall[r] = now() - t;
            for (int i = 0; i < K; i++) { CK(cuMemUnmap(base + i * G, G)); CK(cuMemRelease(imp[i])); }
        }
        qsort(wall, REP, sizeof *wall, cmp); qsort(imp_t, REP, sizeof *imp_t, cmp); qsort(acc_t, REP, sizeof *acc_t, cmp);
        printf("| %d | %.0f | %.0f | %.0f |\n", T, wall[REP / 2], imp_t[REP / 2], acc_t[REP / 2]);
    }
    return 0;
}
