/* What one thread of a bench/gpu/threads_bench.c row does: the allocators behind one
 * interface (gpupool, cudaMallocAsync, RMM's resources when built with them), the three
 * workloads (1 MiB pairs, churn, serving) with their warm-up, and the clock reference loop
 * every thread runs between warm-up and timed work. The benchmark's usage doc, its rows,
 * the table and main stay in threads_bench.c: what a thread does, apart from how a row is
 * run and reported. */
#define _GNU_SOURCE
#include <math.h>
#include <sched.h>
#include <sys/resource.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <cuda_runtime.h>
#include "gpupool.h"
#ifdef GPUPOOL_WITH_RMM
#include "rmm_allocators.h"
#endif
#include "threads_bench.h"

#define REQUESTS 32
#define TOKEN (64u << 10)
#define SLOTS 64

/* This thread's context switches so far (voluntary: it blocked, on a lock or in the kernel;
 * involuntary: preempted). */
static void thread_switches(long *v, long *iv) {
  struct rusage r;
  getrusage(RUSAGE_THREAD, &r);
  *v = r.ru_nvcsw;
  *iv = r.ru_nivcsw;
}

static double now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e9 + t.tv_nsec;
}

#define CLOCK_ITERS (1L << 21)
static volatile uint64_t clock_sink;

/* ns per 1,000 iterations of a dependent xorshift chain: the core's clock, nothing else. */
static double clock_ref(void) {
  uint64_t x = 0x2545F4914F6CDD1Dull;
  double t0 = now_ns();
  for (long i = 0; i < CLOCK_ITERS; i++) {
    x ^= x << 13; x ^= x >> 7; x ^= x << 17;
  }
  double t = now_ns() - t0;
  clock_sink = x;
  return t * 1000.0 / CLOCK_ITERS;
}

int n_kinds(void) {
#ifdef GPUPOOL_WITH_RMM
  return RMM_BASE + rmm_bench_count();
#else
  return RMM_BASE;
#endif
}

const char *kind_name(int k) {
  if (k == GPUPOOL) return "gpupool";
  if (k == GPUPOOL_ARENA) return "gpupool-arena";
  if (k == ASYNC) return "cudaMallocAsync";
#ifdef GPUPOOL_WITH_RMM
  return rmm_bench_name(k - RMM_BASE);
#else
  return "?";
#endif
}

static void *alloc_on(int k, size_t n, cudaStream_t s, int *fail) {
  void *p = NULL;
  if (is_gpupool(k)) {
    if (gpupool_malloc(&p, n, 0, s) != GPUPOOL_STATUS_OK) (*fail)++;
  } else if (k == ASYNC) {
    if (cudaMallocAsync(&p, n, s) != cudaSuccess) (*fail)++;
  } else {
#ifdef GPUPOOL_WITH_RMM
    p = rmm_bench_alloc(k - RMM_BASE, n, s);
#endif
    if (!p) (*fail)++;
  }
  return p;
}

/* RMM's resources need the size at deallocation: every caller knows it. */
static void free_on(int k, void *p, size_t n, cudaStream_t s, int *fail) {
  if (!p) return;
  if (is_gpupool(k)) {
    if (gpupool_free(p, 0, s) != GPUPOOL_STATUS_OK) (*fail)++;
  } else if (k == ASYNC) {
    if (cudaFreeAsync(p, s) != cudaSuccess) (*fail)++;
  } else {
#ifdef GPUPOOL_WITH_RMM
    if (rmm_bench_free(k - RMM_BASE, p, n, s) != 0) (*fail)++;
#else
    (void)n;
#endif
  }
}

void *worker(void *arg) {
  job *j = (job *)arg;
  cudaStream_t s = NULL;
  if (j->cpu >= 0) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(j->cpu, &set);
    pthread_setaffinity_np(pthread_self(), sizeof set, &set);
  }
  if (j->own_stream) cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  void *slots[SLOTS] = {0};
  size_t sizes[SLOTS] = {0}, lengths[SLOTS] = {0}; /* SERVING: a request's buffer, its end */
  uint64_t rng = 0x9E3779B97F4A7C15ull;
  /* Warm up: the sizes and slots a step uses exist once before timing. */
  for (int i = 0; i < 2 * SLOTS; i++) {
    void *p = alloc_on(j->kind, 1 << 20, s, &j->failures);
    free_on(j->kind, p, 1 << 20, s, &j->failures);
  }
  /* And the workload itself, untimed, for as many pairs as are timed (at most 20,000):
   * the timed part measures the steady state, not every allocator's first growth to the
   * workload's peak (which the driver serialises across threads). */
  long warm = j->nbatches < 20 ? j->nbatches : 20;
  long v0 = 0, iv0 = 0;
  if (j->nbatches == 0) {
    pthread_barrier_wait(j->start); /* warmed up (the main thread reads the count) */
    j->clock_ns = clock_ref();      /* every thread of the row at once */
    pthread_barrier_wait(j->start); /* go */
    thread_switches(&v0, &iv0);
    j->t_start = now_ns();
  }
  for (long b = -warm; b < j->nbatches; b++) {
    if (b == 0) {
      pthread_barrier_wait(j->start); /* warmed up (the main thread reads the count) */
      j->clock_ns = clock_ref();      /* every thread of the row at once */
      pthread_barrier_wait(j->start); /* go */
      thread_switches(&v0, &iv0);
      j->t_start = now_ns();
    }
    double t0 = now_ns();
    for (int i = 0; i < BATCH; i++) {
      if (j->wl == PAIRS) {
        void *p = alloc_on(j->kind, 1 << 20, s, &j->failures);
        free_on(j->kind, p, 1 << 20, s, &j->failures);
      } else if (j->wl == SERVING) {
        rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
        int r = (int)(rng % REQUESTS);
        size_t n = sizes[r] + TOKEN;
        if (sizes[r] == 0 || sizes[r] >= lengths[r]) { /* a new request */
          n = TOKEN;
          lengths[r] = (size_t)(256u << 10) + (size_t)((rng >> 24) % 32) * (256u << 10);
        }
        void *p = alloc_on(j->kind, n, s, &j->failures); /* the longer buffer first */
        free_on(j->kind, slots[r], sizes[r], s, &j->failures);
        slots[r] = p;
        sizes[r] = n;
      } else {
        rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
        int slot = (int)(rng % SLOTS);
        size_t n = (size_t)(512.0 * exp((double)((rng >> 20) % 100000) / 100000.0 * log(8192.0)));
        free_on(j->kind, slots[slot], sizes[slot], s, &j->failures);
        slots[slot] = alloc_on(j->kind, n, s, &j->failures);
        sizes[slot] = n;
      }
    }
    double t1 = now_ns();
    if (b >= 0) {
      j->batch_ns[b] = (t1 - t0) / BATCH;
      j->batch_end[b] = t1;
    }
  }
  j->t_end = now_ns();
  thread_switches(&j->vcsw, &j->ivcsw);
  j->vcsw -= v0;
  j->ivcsw -= iv0;
  pthread_barrier_wait(j->done); /* the main thread reads the driver-call count here */
  for (int i = 0; i < SLOTS; i++) free_on(j->kind, slots[i], sizes[i], s, &j->failures);
  if (s) {
    cudaStreamSynchronize(s);
    cudaStreamDestroy(s);
  }
  return NULL;
}
