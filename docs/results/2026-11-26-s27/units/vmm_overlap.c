/* Can a receiver's imports run on a thread of their own while its main thread goes on
 * with CPU work and small driver calls? (session 27)
 * cc vmm_overlap.c -I$CUDA/include -lcuda -lpthread -o vmm_overlap && ./vmm_overlap
 * B (the importer): 256 granules (2 MiB, shareable as POSIX fds, this process's exports)
 * imported and mapped side by side, one cuMemSetAccess per 4 (as share_check's spans),
 * then unmapped and released. M (the main thread): 1,000 turns of 40 us spinning on the
 * CPU (a tensor's Python rebuild), one cuCtxGetDevice and, every 20th turn, a
 * cuStreamWaitEvent and a 4 KiB cuMemsetD8Async (a message's event wait, a check).
 * Rows: M alone, B alone, both at once (M's time, B's time, the wall); median of 7, us. */
#include <cuda.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define CK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char *s; cuGetErrorString(r_, &s); \
    fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, s); exit(1); } } while (0)
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e6 + t.tv_nsec / 1e3; }
static int cmp(const void *a, const void *b) { double x = *(double *)a, y = *(double *)b; return x < y ? -1 : x > y; }
#define K 256
#define TURNS 1000
#define REP 7
static CUcontext ctx;
static CUmemAccessDesc acc;
static size_t G;
static int fd[K];
static CUmemGenericAllocationHandle imp[K];
static CUdeviceptr base, scratch;
static CUstream stream;
static CUevent ev;

static void *importer(void *arg) {
    double *t_out = arg, t = now();
    CK(cuCtxSetCurrent(ctx));
    for (int i = 0; i < K; i++) {
        CK(cuMemImportFromShareableHandle(&imp[i], (void *)(long)fd[i], CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
        CK(cuMemMap(base + i * G, G, 0, imp[i], 0));
        if (i % 4 == 3) CK(cuMemSetAccess(base + (i - 3) * G, 4 * G, &acc, 1));
    }
    *t_out = now() - t;
    return NULL;
}

static void undo(void) {
    for (int i = 0; i < K; i++) { CK(cuMemUnmap(base + i * G, G)); CK(cuMemRelease(imp[i])); }
}

static void *mainwork(void *arg) {
    double *t_out = arg, t = now();
    CK(cuCtxSetCurrent(ctx));
    CUdevice d;
    for (int i = 0; i < TURNS; i++) {
        double until = now() + 40;
        while (now() < until) {}
        CK(cuCtxGetDevice(&d));
        if (i % 20 == 0) {
            CK(cuStreamWaitEvent(stream, ev, 0));
            CK(cuMemsetD8Async(scratch, (unsigned char)i, 4096, stream));
        }
    }
    CK(cuStreamSynchronize(stream));
    *t_out = now() - t;
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
    CK(cuMemAlloc(&scratch, 1 << 20));
    CK(cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));
    CK(cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING));
    CK(cuEventRecord(ev, stream));
    double m_alone[REP], b_alone[REP], m_both[REP], b_both[REP], wall[REP];
    for (int r = 0; r < REP; r++) {
        mainwork(&m_alone[r]);
        importer(&b_alone[r]);
        undo();
        pthread_t tb, tm;
        double t = now();
        pthread_create(&tb, NULL, importer, &b_both[r]);
        pthread_create(&tm, NULL, mainwork, &m_both[r]);
        pthread_join(tb, NULL);
        pthread_join(tm, NULL);
        wall[r] = now() - t;
        undo();
    }
    qsort(m_alone, REP, sizeof(double), cmp); qsort(b_alone, REP, sizeof(double), cmp);
    qsort(m_both, REP, sizeof(double), cmp); qsort(b_both, REP, sizeof(double), cmp); qsort(wall, REP, sizeof(double), cmp);
    printf("| M alone | B alone | M beside B | B beside M | wall, both |\n|---|---|---|---|---|\n");
    printf("| %.0f | %.0f | %.0f | %.0f | %.0f |\n", m_alone[REP / 2], b_alone[REP / 2], m_both[REP / 2], b_both[REP / 2], wall[REP / 2]);
    return 0;
}
