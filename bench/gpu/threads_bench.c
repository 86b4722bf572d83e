/* Allocator throughput from C across threads and streams (GPU benchmark, not a test):
 * gpupool against cudaMallocAsync with the device's default pool kept whole (release
 * threshold at its maximum), at 1, 4 and 16 threads, every thread on the legacy stream or
 * each on its own stream; workloads: 1 MiB alloc+free pairs, churn (64 live slots per
 * thread, sizes log-uniform in 512 B..4 MiB, the same seeded sequence for everyone), and a
 * serving-like mix (32 requests per thread whose KV buffer grows by 64 KiB a token, as
 * `torch.cat` does: allocate the longer buffer, free the old one; a request that reaches
 * its length, 256 KiB..8 MiB, ends and a new one starts).
 * Each thread first runs its workload untimed for as many pairs as it times (up to 20,000).
 * Prints, per row: ns per pair (p50 and p99 over 1,000-pair batches), aggregate million
 * pairs per second over the timed window (first thread's start to last thread's end of
 * timed work: stream creation, warm-up and teardown fall outside it) and, for gpupool, the
 * driver calls it made per 1,000 timed pairs (its own count, `gpupool_stats_json`).
 * "ctx sw": the row's threads' context switches over their timed work (voluntary /
 * involuntary, `getrusage(RUSAGE_THREAD)`): a thread that blocks on a contended lock (the
 * allocator's or the driver's) switches voluntarily; one the OS preempts, involuntarily.
 * "All busy": the aggregate while every thread of the row was running (`busy_rate`): each
 * thread does a fixed number of pairs, so the plain aggregate is bounded by the slowest
 * thread's CPU, while the one-thread row ran on one CPU.
 * Clock: between warm-up and timed work every thread of a row runs the same pure-ALU loop
 * at once (a dependent xorshift chain, no memory traffic), and the row prints its median
 * ns per 1,000 iterations. A host's cores run slower when all of them are busy (and a
 * shared host's clock moves with its other tenants), so a row's scaling over one thread
 * is also given at equal clock: (aggregate N / aggregate 1) x (clock N / clock 1). That
 * separates the allocator's scaling from the machine's.
 * Usage: threads_bench [PAIRS_PER_THREAD]   (default 200000)
 * Thread i of a row runs on CPU i (on machines of 16 CPUs or more; THREADS_BENCH_PIN=0
 * leaves placement to the OS), so every allocator's row of N threads runs on the same CPUs.
 * THREADS_BENCH_PER_CPU=1 adds rows with one thread pinned to each CPU in turn, then one
 * thread pinned on every CPU (own streams, each workload), and a summary line: CPUs of a
 * shared host can run the same code at different speeds (at the same clock: perhaps a
 * hyperthread sibling busy outside this machine's view), so "one thread" depends on where it ran; the summary
 * compares all CPUs at once with the median CPU's one thread and with the sum of all.
 * THREADS_BENCH_PROCS=N runs N one-thread processes at once beside one process of N threads
 * (`procs_mode` says why): the host's own ceiling for N busy CPUs.
 * gpupool's rows: "gpupool" is its split pool, "gpupool-arena" its arena, each configured on
 * device 0 before its row.
 * THREADS_BENCH_ONLY=NAME measures that allocator alone (e.g. gpupool, for an A/B run of
 * one of its settings such as GPUPOOL_STREAM_SHARDS). THREADS_BENCH_WORKLOAD=pairs|churn|serving,
 * THREADS_BENCH_STREAMS=legacy|own and THREADS_BENCH_THREADS=1|4|16 keep only the rows they
 * name (e.g. one row under a profiler).
 * Built with GPUPOOL_WITH_RMM (CMake: -DGPUPOOL_RMM_ROOT, the unpacked librmm wheel), the
 * table also has RMM's pool, arena and cuda_async resources (bench/gpu/rmm_allocators.cpp),
 * every allocator measured in the same run. */
#define _GNU_SOURCE
#include <sys/mman.h>
#include <sys/wait.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <cuda_runtime.h>
#include "gpupool.h"
#ifdef GPUPOOL_WITH_RMM
#include "rmm_allocators.h"
#endif
#include "threads_bench.h"

#define TABLE_HEAD                                                                                             \
  "| allocator | workload | streams | threads | p50 ns/pair | p99 ns/pair | M pairs/s | M pairs/s, all busy | " \
  "driver calls / 1k pairs | clock ns/1k | x 1 thread | x 1 thread, equal clock | x 1 thread, all busy | "      \
  "ctx sw vol / invol |\n"                                                                                     \
  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"

/* gpupool's JSON report on device 0, or NULL if it does not fit. */
static const char *gpupool_report(void) {
  static char buf[1 << 16];
  size_t n = gpupool_stats_json(0, buf, sizeof buf);
  return n > 0 && n < sizeof buf ? buf : NULL;
}

/* The number after "name": in `json` (its first occurrence), or -1. */
static long long json_number(const char *json, const char *name) {
  char key[64];
  snprintf(key, sizeof key, "\"%s\":", name);
  const char *at = json ? strstr(json, key) : NULL;
  return at ? atoll(at + strlen(key)) : -1;
}

/* gpupool's driver calls so far on device 0 (all shards), from its JSON report; -1 if unknown. */
static long long gpupool_driver_calls(void) {
  const char *r = gpupool_report();
  return json_number(r ? strstr(r, "\"driver_calls\"") : NULL, "total");
}

static const char *wl_name(int wl);

/* THREADS_BENCH_CALLS=1: which driver calls a gpupool row made, by kind, and how many blocks
 * moved across streams (to tell event records from growth from cross-stream traffic). */
static const char *const CALL_KINDS[] = {"malloc", "free", "mem_create", "mem_map", "mem_unmap", "set_access",
                                         "event_record", "event_query", "event_sync", "stream_wait", "stream_id",
                                         "n_cross_stream_reuses"};
#define N_CALL_KINDS (sizeof CALL_KINDS / sizeof CALL_KINDS[0])
static void gpupool_calls_by_kind(long long out[N_CALL_KINDS]) {
  const char *r = gpupool_report();
  for (size_t i = 0; i < N_CALL_KINDS; i++) out[i] = json_number(r, CALL_KINDS[i]);
}

static int cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* Set while the per-CPU rows run: their one-thread rows are not the scaling baseline. */
static int per_cpu_rows;
/* Set in THREADS_BENCH_PROCS's child processes: their rows are summed, not printed. */
static int quiet_rows;

/* Aggregate M pairs/s while every thread (or process) of a row was running: the window from
 * the last one's start to the first one's end, and the whole batches each completed inside
 * it. Each thread does a fixed number of pairs, so the plain aggregate (all pairs over first
 * start to last end) is bounded by the slowest thread: on a host whose CPUs run the same
 * code at different speeds, N threads then count as N copies of the slowest CPU while the
 * one-thread row ran on one CPU. This figure is throughput while all N work. */
static double busy_rate(int n, const double *t_start, const double *t_end, double *const *batch_end, long nb) {
  double w0 = t_start[0], w1 = t_end[0];
  for (int i = 1; i < n; i++) {
    if (t_start[i] > w0) w0 = t_start[i];
    if (t_end[i] < w1) w1 = t_end[i];
  }
  if (w1 <= w0) return 0;
  long pairs = 0;
  for (int i = 0; i < n; i++)
    for (long b = 0; b < nb; b++) {
      double from = b ? batch_end[i][b - 1] : t_start[i];
      if (from >= w0 && batch_end[i][b] <= w1) pairs += BATCH;
    }
  return (double)pairs / (w1 - w0) * 1e3;
}

/* The last one-thread row's window and batch ends (THREADS_BENCH_PROCS's children report them). */
static double last_start, last_end, last_batch_end[1024];
/* The last row's all-busy aggregate (`busy_rate`) and its threads' context switches. */
static double last_busy;
static long last_vcsw, last_ivcsw;

/* pin < 0: threads go where the OS puts them; else thread i runs on CPU pin + i. */
static double row(int k, enum workload wl, int own, int threads, long pairs, int pin) {
  pthread_t t[16];
  job jobs[16];
  pthread_barrier_t start, done;
  /* gpupool's rows run on the pool they name (device 0 is idle between rows). */
  if (is_gpupool(k) && gpupool_configure(0, k == GPUPOOL_ARENA ? "arena" : "split", "device") != GPUPOOL_STATUS_OK) {
    char m[512];
    gpupool_last_error(m, sizeof m);
    fprintf(stderr, "threads_bench: configuring %s: %s\n", kind_name(k), m);
    return 0;
  }
  pthread_barrier_init(&start, NULL, threads + 1);
  pthread_barrier_init(&done, NULL, threads + 1);
  long nb = pairs / BATCH;
  for (int i = 0; i < threads; i++) {
    jobs[i] = (job){k, wl, own, pairs, calloc(nb, sizeof(double)), calloc(nb, sizeof(double)), nb, 0, &start, &done, 0, 0, 0, pin < 0 ? -1 : pin + i, 0, 0};
    pthread_create(&t[i], NULL, worker, &jobs[i]);
  }
  /* `start` twice: once every thread has warmed up (the count read between the two
   * excludes the warm-up), then to let them go. */
  pthread_barrier_wait(&start);
  long long calls0 = is_gpupool(k) ? gpupool_driver_calls() : -1;
  const int detail = is_gpupool(k) && getenv("THREADS_BENCH_CALLS") != NULL;
  long long kinds0[N_CALL_KINDS], kinds1[N_CALL_KINDS];
  if (detail) gpupool_calls_by_kind(kinds0);
  pthread_barrier_wait(&start);
  pthread_barrier_wait(&done);
  long long calls1 = is_gpupool(k) ? gpupool_driver_calls() : -1;
  if (detail) {
    gpupool_calls_by_kind(kinds1);
    fprintf(stderr, "calls: %s %s %s %d:", wl_name(wl), own ? "own stream" : "legacy", kind_name(k), threads);
    for (size_t i = 0; i < N_CALL_KINDS; i++) fprintf(stderr, " %s %lld", CALL_KINDS[i], kinds1[i] - kinds0[i]);
    /* The process's peaks so far (one row a process: THREADS_BENCH_THREADS and _WORKLOAD). */
    fprintf(stderr, " peak_total_bytes %lld peak_used_bytes %lld\n", json_number(gpupool_report(), "peak_total_bytes"),
            json_number(gpupool_report(), "peak_used_bytes"));
  }
  for (int i = 0; i < threads; i++) pthread_join(t[i], NULL);
  double first = jobs[0].t_start, last = jobs[0].t_end;
  for (int i = 1; i < threads; i++) {
    if (jobs[i].t_start < first) first = jobs[i].t_start;
    if (jobs[i].t_end > last) last = jobs[i].t_end;
  }
  double wall = last - first;
  char calls[32] = "-";
  if (calls0 >= 0 && calls1 >= 0 && nb > 0)
    snprintf(calls, sizeof calls, "%.3f", (double)(calls1 - calls0) * 1000.0 / ((double)nb * BATCH * threads));
  double starts[16] = {0}, ends[16] = {0}, *batch_ends[16] = {0};
  for (int i = 0; i < threads; i++) {
    starts[i] = jobs[i].t_start;
    ends[i] = jobs[i].t_end;
    batch_ends[i] = jobs[i].batch_end;
  }
  double busy = busy_rate(threads, starts, ends, batch_ends, nb);
  last_busy = busy;
  last_vcsw = last_ivcsw = 0;
  for (int i = 0; i < threads; i++) {
    last_vcsw += jobs[i].vcsw;
    last_ivcsw += jobs[i].ivcsw;
  }
  if (threads == 1 && nb <= 1024) {
    last_start = jobs[0].t_start;
    last_end = jobs[0].t_end;
    memcpy(last_batch_end, jobs[0].batch_end, nb * sizeof(double));
  }
  double *all = calloc(nb * threads, sizeof(double));
  int failures = 0;
  for (int i = 0; i < threads; i++) {
    memcpy(all + i * nb, jobs[i].batch_ns, nb * sizeof(double));
    failures += jobs[i].failures;
    free(jobs[i].batch_ns);
    free(jobs[i].batch_end);
  }
  qsort(all, nb * threads, sizeof(double), cmp);
  double clocks[16];
  for (int i = 0; i < threads; i++) clocks[i] = jobs[i].clock_ns;
  qsort(clocks, threads, sizeof(double), cmp);
  double clock = clocks[threads / 2], rate = threads * (double)nb * BATCH / wall * 1e3;
  /* This allocator's one-thread row of the same workload and streams (rows run 1, 4, 16). */
  static double one_rate[16], one_clock[16], one_busy[16];
  char x[24] = "-", xc[24] = "-", xb[24] = "-";
  if (threads == 1 && !per_cpu_rows) {
    one_rate[k] = rate;
    one_clock[k] = clock;
    one_busy[k] = busy;
  } else if (threads > 1 && one_rate[k] > 0 && one_clock[k] > 0) {
    snprintf(x, sizeof x, "%.1f", rate / one_rate[k]);
    snprintf(xc, sizeof xc, "%.1f", rate / one_rate[k] * clock / one_clock[k]);
    if (one_busy[k] > 0 && busy > 0) snprintf(xb, sizeof xb, "%.1f", busy / one_busy[k]);
  }
  /* No window in which all threads ran (more threads than CPUs: they took turns). */
  char busy_s[24] = "-";
  if (busy > 0) snprintf(busy_s, sizeof busy_s, "%.2f", busy);
  if (!quiet_rows)
    printf("| %s | %s | %s | %d | %.0f | %.0f | %.2f | %s | %s | %.0f | %s | %s | %s | %ld / %ld |%s\n", kind_name(k),
           wl == PAIRS ? "1 MiB pairs" : wl == CHURN ? "churn" : "serving", own ? "own stream" : "legacy", threads, all[nb * threads / 2],
           all[nb * threads * 99 / 100], rate, busy_s, calls, clock, x, xc, xb, last_vcsw, last_ivcsw, failures ? " FAILURES" : "");
  free(all);
  pthread_barrier_destroy(&start);
  pthread_barrier_destroy(&done);
  return rate;
}

static const char *wl_name(int wl) { return wl == PAIRS ? "1 MiB pairs" : wl == CHURN ? "churn" : "serving"; }
/* Whether THREADS_BENCH_WORKLOAD (pairs|churn|serving; unset: every workload) keeps `wl`. */
static int workload_kept(const char *only, int wl) {
  return !only || strcmp(only, wl == PAIRS ? "pairs" : wl == CHURN ? "churn" : "serving") == 0;
}

/* THREADS_BENCH_PROCS=N: the machine's own ceiling for N threads. N processes, each one
 * gpupool thread on its own stream pinned to CPU i, run every workload at the same time
 * (a process-shared barrier starts each workload together); they share nothing of gpupool's,
 * so their sum is what N copies of the one-thread row make on this host when all run at
 * once. Then this process runs the same one-thread and N-thread rows. A shared host's
 * cores can run one busy thread faster than N (turbo, other tenants, shared caches): if
 * N threads in one process make about what N separate processes make, the gap to N x one
 * thread is the machine's, not a lock or cache line the threads share in the allocator.
 * Must run before this process touches CUDA (children fork from a process without a context). */
static int procs_mode(long pairs, int n) {
  struct shared {
    pthread_barrier_t go;
    /* Per workload, per process: its rate, timed window and batch ends. */
    double rate[3][16], start[3][16], end[3][16], batch_end[3][16][1024];
    long vcsw[3][16], ivcsw[3][16];
    int failed[16];
  } *sh = mmap(NULL, sizeof *sh, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (sh == MAP_FAILED) return 1;
  pthread_barrierattr_t a;
  pthread_barrierattr_init(&a);
  pthread_barrierattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
  pthread_barrier_init(&sh->go, &a, n);
  for (int i = 0; i < n; i++) {
    pid_t pid = fork();
    if (pid < 0) return 1;
    if (pid == 0) {
      quiet_rows = 1;
      int ok = gpupool_configure(0, "split", "device") == GPUPOOL_STATUS_OK;
      sh->failed[i] = !ok;
      for (int wl = PAIRS; wl <= SERVING; wl++) {
        pthread_barrier_wait(&sh->go);
        if (!ok) continue;
        sh->rate[wl][i] = row(GPUPOOL, (enum workload)wl, 1, 1, pairs, i);
        sh->start[wl][i] = last_start;
        sh->end[wl][i] = last_end;
        sh->vcsw[wl][i] = last_vcsw;
        sh->ivcsw[wl][i] = last_ivcsw;
        memcpy(sh->batch_end[wl][i], last_batch_end, sizeof last_batch_end);
      }
      _exit(0);
    }
  }
  int bad = 0;
  for (int i = 0; i < n; i++) {
    int st = 0;
    wait(&st);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) bad = 1;
  }
  for (int i = 0; i < n; i++) bad |= sh->failed[i];
  if (bad) {
    fprintf(stderr, "threads_bench: a process of THREADS_BENCH_PROCS failed\n");
    return 1;
  }
  if (gpupool_configure(0, "split", "device") != GPUPOOL_STATUS_OK) return 1;
  long nb = pairs / BATCH;
  for (int wl = PAIRS; wl <= SERVING; wl++) {
    double one = row(GPUPOOL, (enum workload)wl, 1, 1, pairs, 0), one_busy = last_busy;
    double many = row(GPUPOOL, (enum workload)wl, 1, n, pairs, 0), many_busy = last_busy;
    long pv = 0, piv = 0;
    for (int i = 0; i < n; i++) {
      pv += sh->vcsw[wl][i];
      piv += sh->ivcsw[wl][i];
    }
    /* The processes' aggregate by both of the table's measures. */
    double first = sh->start[wl][0], last = sh->end[wl][0], lo = 1e300, hi = 0, *ends[16] = {0};
    for (int i = 0; i < n; i++) {
      if (sh->start[wl][i] < first) first = sh->start[wl][i];
      if (sh->end[wl][i] > last) last = sh->end[wl][i];
      if (sh->rate[wl][i] < lo) lo = sh->rate[wl][i];
      if (sh->rate[wl][i] > hi) hi = sh->rate[wl][i];
      ends[i] = sh->batch_end[wl][i];
    }
    double procs_rate = last > first ? n * (double)nb * BATCH / (last - first) * 1e3 : 0;
    double procs_busy = busy_rate(n, sh->start[wl], sh->end[wl], ends, nb);
    printf("procs: gpupool %s, own stream: one thread alone %.2f M pairs/s (all busy %.2f); %d one-thread processes at once "
           "(each %.2f-%.2f) %.2f = %.1fx, all busy %.2f = %.1fx; %d threads in one process %.2f = %.1fx, all busy %.2f = "
           "%.1fx, %.0f%% of the processes all busy; context switches vol/invol: processes %ld/%ld, threads %ld/%ld\n",
           wl_name(wl), one, one_busy, n, lo, hi, procs_rate, procs_rate / one, procs_busy, procs_busy / one_busy, n, many,
           many / one, many_busy, many_busy / one_busy, procs_busy > 0 ? 100.0 * many_busy / procs_busy : 0, pv, piv, last_vcsw, last_ivcsw);
  }
  return 0;
}

int main(int argc, char **argv) {
  long pairs = argc > 1 ? atol(argv[1]) : 200000;
  const char *procs = getenv("THREADS_BENCH_PROCS");
  if (procs) {
    int n = atoi(procs);
    if (n < 1 || n > 16 || n > sysconf(_SC_NPROCESSORS_ONLN)) {
      fprintf(stderr, "threads_bench: THREADS_BENCH_PROCS=%s: expected 1..16, at most the CPUs online\n", procs);
      return 2;
    }
    if (pairs / BATCH > 1024) { /* the processes' batch ends are shared in fixed arrays */
      fprintf(stderr, "threads_bench: THREADS_BENCH_PROCS takes at most 1,024,000 pairs per thread\n");
      return 2;
    }
    printf(TABLE_HEAD);
    fflush(stdout); /* not again in every child */
    return procs_mode(pairs, n);
  }
  if (gpupool_configure(0, "split", "device") != GPUPOOL_STATUS_OK) {
    char m[512];
    gpupool_last_error(m, sizeof m);
    fprintf(stderr, "threads_bench: %s\n", m);
    return 77;
  }
  cudaMemPool_t mp;
  cudaDeviceGetDefaultMemPool(&mp, 0);
  uint64_t max = UINT64_MAX;
  cudaMemPoolSetAttribute(mp, cudaMemPoolAttrReleaseThreshold, &max);
  printf(TABLE_HEAD);
  int counts[3] = {1, 4, 16};
  int usable[16] = {0};
  const char *only = getenv("THREADS_BENCH_ONLY");
  /* Thread i of every row on CPU i (THREADS_BENCH_PIN=0: where the OS puts it), so each
   * allocator's one-thread row runs on the same CPU as the others': on a shared host one
   * CPU can run the same code 1.6x faster than another (THREADS_BENCH_PER_CPU shows it),
   * which decided one-thread rows by where the thread happened to land. */
  const char *pin_env = getenv("THREADS_BENCH_PIN");
  int pin_rows = (pin_env && strcmp(pin_env, "0") == 0) || sysconf(_SC_NPROCESSORS_ONLN) < 16 ? -1 : 0;
  for (int k = 0; k < n_kinds() && k < 16; k++) {
    usable[k] = !only || strcmp(only, kind_name(k)) == 0;
    if (!usable[k]) continue;
#ifdef GPUPOOL_WITH_RMM
    if (k >= RMM_BASE && rmm_bench_setup(k - RMM_BASE) != 0) usable[k] = 0; /* said on stderr */
#endif
  }
  const char *wl_only = getenv("THREADS_BENCH_WORKLOAD"), *streams_only = getenv("THREADS_BENCH_STREAMS");
  const char *threads_only = getenv("THREADS_BENCH_THREADS");
  for (int wl = PAIRS; wl <= SERVING; wl++)
    for (int own = 0; own <= 1; own++)
      for (int c = 0; c < 3; c++)
        for (int k = 0; k < n_kinds() && k < 16; k++) {
          if (!workload_kept(wl_only, wl)) continue;
          if (streams_only && strcmp(streams_only, own ? "own" : "legacy") != 0) continue;
          if (threads_only && atoi(threads_only) != counts[c]) continue;
          if (usable[k]) row(k, (enum workload)wl, own, counts[c], pairs, pin_rows);
        }
  /* THREADS_BENCH_PER_CPU=1: one thread pinned to each CPU in turn (own stream), then 16
   * threads pinned one per CPU: whether some CPUs run the same code slower than others. */
  if (getenv("THREADS_BENCH_PER_CPU")) {
    per_cpu_rows = 1;
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    if (ncpu > 16) ncpu = 16;
    for (int wl = PAIRS; wl <= SERVING; wl++)
      for (int k = 0; k < n_kinds() && k < 16; k++) {
        if (!usable[k] || !workload_kept(wl_only, wl)) continue;
        double one[16], sum = 0;
        for (int cpu = 0; cpu < ncpu; cpu++) {
          printf("cpu %d: ", cpu);
          one[cpu] = row(k, (enum workload)wl, 1, 1, pairs, cpu);
          sum += one[cpu];
        }
        printf("cpus 0-%ld: ", ncpu - 1);
        double all = row(k, (enum workload)wl, 1, (int)ncpu, pairs, 0);
        qsort(one, ncpu, sizeof(double), cmp);
        double median = (one[(ncpu - 1) / 2] + one[ncpu / 2]) / 2;
        printf("summary: %s %s: one thread per CPU %.2f-%.2f M pairs/s (median %.2f, sum %.2f); %ld threads pinned %.2f = "
               "%.1fx the median CPU's thread, %.0f%% of the sum\n",
               kind_name(k), wl == PAIRS ? "1 MiB pairs" : wl == CHURN ? "churn" : "serving", one[0], one[ncpu - 1], median, sum,
               ncpu, all, all / median, 100.0 * all / sum);
      }
  }
#ifdef GPUPOOL_WITH_RMM
  cudaDeviceSynchronize();
  for (int k = RMM_BASE; k < n_kinds() && k < 16; k++)
    if (usable[k]) rmm_bench_teardown(k - RMM_BASE);
#endif
  return 0;
}
