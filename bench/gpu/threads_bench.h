/* Shared by bench/gpu/threads_bench.c (its usage doc, the rows, the table, main) and
 * bench/gpu/threads_bench_workloads.c (what one thread of a row does: the allocators behind
 * one interface, the three workloads, the clock reference): the allocator kinds, the
 * workloads and a thread's job. */
#ifndef THREADS_BENCH_H
#define THREADS_BENCH_H
#include <pthread.h>

/* gpupool's split and arena pools, cudaMallocAsync, then RMM's resources from RMM_BASE on
 * (when built with them). */
enum alloc_kind { GPUPOOL, GPUPOOL_ARENA, ASYNC, RMM_BASE };
static inline int is_gpupool(int k) { return k == GPUPOOL || k == GPUPOOL_ARENA; }
enum workload { PAIRS, CHURN, SERVING };
#define BATCH 1000

typedef struct {
  int kind;
  enum workload wl;
  int own_stream;
  long pairs;
  double *batch_ns; /* per-batch ns per pair */
  double *batch_end; /* when each batch ended (CLOCK_MONOTONIC ns: comparable across processes) */
  long nbatches;
  int failures;
  pthread_barrier_t *start, *done; /* timing starts after `start`; `done`: all timed work over */
  double t_start, t_end;           /* this thread's timed window */
  double clock_ns;                 /* the reference loop's ns per 1,000 iterations */
  int cpu;                         /* pinned to this CPU, or -1 */
  long vcsw, ivcsw;                /* context switches over the timed window (voluntary, involuntary) */
} job;

/* In threads_bench_workloads.c. */
int n_kinds(void);
const char *kind_name(int k);
/* A row's thread: `arg` is its job. */
void *worker(void *arg);

#endif
