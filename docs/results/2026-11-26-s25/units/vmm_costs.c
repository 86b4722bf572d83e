/* What the consumer's import calls cost as a function of size and count (session 25).
 * cc vmm_costs.c -I$CUDA/include -lcuda -o vmm_costs && ./vmm_costs
 * For k = 1..256 granules (2 MiB): cuMemSetAccess over k separate allocations mapped side
 * by side (one call), over one allocation of k granules (one call), and k calls of one
 * granule each; cuMemImportFromShareableHandle of granule fds (this process's own exports),
 * cuMemMap, cuMemAddressReserve. Medians of 7 repetitions, microseconds. */
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
#include <sys/wait.h>

#define CK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char *s; cuGetErrorString(r_, &s); \
    fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, s); exit(1); } } while (0)
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e6 + t.tv_nsec / 1e3; }
static int cmp(const void *a, const void *b) { double x = *(double *)a, y = *(double *)b; return x < y ? -1 : x > y; }
static double med(double *v, int n) { qsort(v, n, sizeof *v, cmp); return v[n / 2]; }
#define REP 7
#define MAXK 256
static CUmemAllocationProp prop;
static CUmemAccessDesc acc;
static size_t G;

static CUmemGenericAllocationHandle mk(size_t len) {
    CUmemGenericAllocationHandle h; CK(cuMemCreate(&h, len, &prop, 0)); return h;
}

static int child(int argc, char **argv);
int main(int argc, char **argv) {
    if (argc > 1) return child(argc, argv);
    CK(cuInit(0)); CUdevice dev; CK(cuDeviceGet(&dev, 0)); CUcontext ctx; CK(cuDevicePrimaryCtxRetain(&ctx, dev)); CK(cuCtxSetCurrent(ctx));
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED; prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE; prop.location.id = 0;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    CK(cuMemGetAllocationGranularity(&G, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
    acc.location = prop.location; acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    printf("granule %zu\n", G);
    static CUmemGenericAllocationHandle h[MAXK]; static int fd[MAXK];
    for (int i = 0; i < MAXK; i++) { h[i] = mk(G); CK(cuMemExportToShareableHandle(&fd[i], h[i], CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)); }
    printf("| k granules | reserve | map k (total) | access: one call over k allocations | access: one allocation of k | access: k calls | import k fds (total) | import same fd again |\n|---|---|---|---|---|---|---|---|\n");
    int ks[] = {1, 4, 16, 64, 256};
    for (unsigned ki = 0; ki < sizeof ks / sizeof *ks; ki++) {
        int k = ks[ki];
        double tr[REP], tm[REP], ta[REP], tb[REP], tc[REP], ti[REP], tj[REP];
        for (int r = 0; r < REP; r++) {
            CUdeviceptr p; double t = now();
            CK(cuMemAddressReserve(&p, k * G, 0, 0, 0)); tr[r] = now() - t;
            t = now(); for (int i = 0; i < k; i++) CK(cuMemMap(p + i * G, G, 0, h[i], 0)); tm[r] = now() - t;
            t = now(); CK(cuMemSetAccess(p, k * G, &acc, 1)); ta[r] = now() - t;
            CK(cuCtxSynchronize());
            for (int i = 0; i < k; i++) CK(cuMemUnmap(p + i * G, G));
            /* one allocation of k granules */
            CUmemGenericAllocationHandle big = mk(k * G);
            CK(cuMemMap(p, k * G, 0, big, 0));
            t = now(); CK(cuMemSetAccess(p, k * G, &acc, 1)); tb[r] = now() - t;
            CK(cuMemUnmap(p, k * G)); CK(cuMemRelease(big));
            /* k calls */
            for (int i = 0; i < k; i++) CK(cuMemMap(p + i * G, G, 0, h[i], 0));
            t = now(); for (int i = 0; i < k; i++) CK(cuMemSetAccess(p + i * G, G, &acc, 1)); tc[r] = now() - t;
            for (int i = 0; i < k; i++) CK(cuMemUnmap(p + i * G, G));
            /* imports */
            static CUmemGenericAllocationHandle im[MAXK];
            t = now(); for (int i = 0; i < k; i++) CK(cuMemImportFromShareableHandle(&im[i], (void *)(long)fd[i], CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)); ti[r] = now() - t;
            CUmemGenericAllocationHandle again;
            t = now(); CK(cuMemImportFromShareableHandle(&again, (void *)(long)fd[0], CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)); tj[r] = now() - t;
            CK(cuMemRelease(again));
            for (int i = 0; i < k; i++) CK(cuMemRelease(im[i]));
            CK(cuMemAddressFree(p, k * G));
        }
        printf("| %d | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f |\n", k, med(tr, REP), med(tm, REP), med(ta, REP), med(tb, REP), med(tc, REP), med(ti, REP), med(tj, REP));
    }
    /* The same from another process: fds inherited (numbers on the command line). */
    char *args[MAXK + 3]; char buf[MAXK][16]; args[0] = argv[0];
    for (int i = 0; i < MAXK; i++) { snprintf(buf[i], 16, "%d", fd[i]); args[i + 1] = buf[i]; }
    args[MAXK + 1] = NULL; fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) { execv("/proc/self/exe", args); _exit(127); }
    int st; waitpid(pid, &st, 0);
    return 0;
}

static int child(int argc, char **argv) {
    int n = argc - 1; int fds[MAXK]; for (int i = 0; i < n; i++) fds[i] = atoi(argv[i + 1]);
    CK(cuInit(0)); CUdevice dev; CK(cuDeviceGet(&dev, 0)); CUcontext ctx; CK(cuDevicePrimaryCtxRetain(&ctx, dev)); CK(cuCtxSetCurrent(ctx));
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE; prop.location.id = 0;
    acc.location = prop.location; acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CK(cuMemGetAllocationGranularity(&G, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
    printf("\nanother process, imported granules\n| k | import k (total) | map k | access: one call over k | access: k calls |\n|---|---|---|---|---|\n");
    int ks[] = {1, 4, 16, 64, 256};
    for (unsigned ki = 0; ki < sizeof ks / sizeof *ks; ki++) {
        int k = ks[ki]; if (k > n) break;
        double ti[REP], tm[REP], ta[REP], tc[REP];
        for (int r = 0; r < REP; r++) {
            static CUmemGenericAllocationHandle im[MAXK]; CUdeviceptr p;
            double t = now(); for (int i = 0; i < k; i++) CK(cuMemImportFromShareableHandle(&im[i], (void *)(long)fds[i], CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)); ti[r] = now() - t;
            CK(cuMemAddressReserve(&p, k * G, 0, 0, 0));
            t = now(); for (int i = 0; i < k; i++) CK(cuMemMap(p + i * G, G, 0, im[i], 0)); tm[r] = now() - t;
            t = now(); CK(cuMemSetAccess(p, k * G, &acc, 1)); ta[r] = now() - t;
            for (int i = 0; i < k; i++) CK(cuMemUnmap(p + i * G, G));
            for (int i = 0; i < k; i++) CK(cuMemMap(p + i * G, G, 0, im[i], 0));
            t = now(); for (int i = 0; i < k; i++) CK(cuMemSetAccess(p + i * G, G, &acc, 1)); tc[r] = now() - t;
            for (int i = 0; i < k; i++) CK(cuMemUnmap(p + i * G, G));
            for (int i = 0; i < k; i++) CK(cuMemRelease(im[i]));
            CK(cuMemAddressFree(p, k * G));
        }
        printf("| %d | %.1f | %.1f | %.1f | %.1f |\n", k, med(ti, REP), med(tm, REP), med(ta, REP), med(tc, REP));
    }
    return 0;
}
