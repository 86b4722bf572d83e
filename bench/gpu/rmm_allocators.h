/* RMM's resources for bench/gpu/threads_bench.c (implemented in rmm_allocators.cpp, built
 * only with the librmm wheel: GPUPOOL_RMM_ROOT). Kinds 0..rmm_bench_count()-1. */
#ifndef GPUPOOL_RMM_ALLOCATORS_H
#define GPUPOOL_RMM_ALLOCATORS_H
#include <stddef.h>
#include <cuda_runtime_api.h>
#ifdef __cplusplus
extern "C" {
#endif
int rmm_bench_count(void);
const char *rmm_bench_name(int kind);
/* Create the resource (0 = ok). The benchmark creates all of them before its first row and
 * tears them down after its last, so their reservations (RMM's pool, the global arena) are
 * held through every row. */
int rmm_bench_setup(int kind);
void rmm_bench_teardown(int kind);
/* NULL / -1 on failure (RMM's exceptions are caught). */
void *rmm_bench_alloc(int kind, size_t bytes, cudaStream_t stream);
int rmm_bench_free(int kind, void *p, size_t bytes, cudaStream_t stream);
#ifdef __cplusplus
}
#endif
#endif
