// Stream-safety stress (GPU). Each round: a slow kernel writes pattern A into a block on
// stream A, a check kernel on A verifies it, the block is freed on A and at once requested
// on stream B (same size: the pool's first choice is that very block), filled with pattern
// B, and verified on B after a longer delay. If the pool handed the block to B before A's
// work finished, one of the two checks sees the other's pattern.
//
// usage: stream_stress POOL UPSTREAM ROUNDS_PER_THREAD [--expect-corruption]
// 8 host threads x 8 shared non-blocking streams (STRESS_THREADS, STRESS_STREAMS: up to 16;
// STRESS_SECONDS: run for that long), plus each thread's per-thread default
// stream and the legacy default stream. Exit 0 when the outcome matches the
// expectation (no corruption, or, with the test-only GPUPOOL_UNSAFE_IGNORE_STREAMS=1,
// corruption detected).
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>
#include <vector>
#include <cuda_runtime.h>
#include "gpupool.h"

// Defaults 8 x 8; STRESS_THREADS / STRESS_STREAMS (at most 16 each) change them, and
// STRESS_SECONDS=N keeps every thread going for N seconds (ROUNDS then bounds nothing).
#define MAX_THREADS 16
#define MAX_STREAMS 16
static int THREADS = 8, STREAMS = 8;
static double stop_at = 0;  // seconds since the epoch of steady_clock; 0: rounds only
static double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

__global__ void spin(long long cycles) { long long t = clock64(); while (clock64() - t < cycles) {} }
__global__ void fill(unsigned *p, size_t n, unsigned v) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) p[i] = v;
}
__global__ void verify(const unsigned *p, size_t n, unsigned v, unsigned long long *bad) {
  unsigned long long mine = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) mine += p[i] != v;
  if (mine) atomicAdd(bad, mine);
}

static cudaStream_t streams[MAX_STREAMS];
static unsigned long long *d_bad;
static std::atomic<long> api_errors{0}, reused{0}, rounds_done{0};
// Diagnostics: what each worker is doing (a watchdog prints it when progress stalls), and
// STRESS_RAW=1 to call cudaMallocAsync / cudaFreeAsync directly instead of gpupool.
static std::atomic<int> phase[MAX_THREADS];
static bool raw_async = false, no_exit_sync = false;
static int alloc_on(void **p, size_t n, cudaStream_t s) {
  if (raw_async) return cudaMallocAsync(p, n, s) != cudaSuccess;
  return gpupool_malloc(p, n, 0, s);
}
static int free_on(void *p, cudaStream_t s) {
  if (raw_async) return cudaFreeAsync(p, s) != cudaSuccess;
  return gpupool_free(p, 0, s);
}

// The 8 user streams, plus this thread's per-thread default stream and the legacy default
// stream (non-blocking user streams do not synchronise with it).
static cudaStream_t pick(int i) {
  if (i < STREAMS) return streams[i];
  return i == STREAMS ? cudaStreamPerThread : cudaStreamLegacy;
}

// STRESS_KINDS (diagnostics): 0 = user streams only, 1 = + per-thread, 2 = + legacy, 3 = both.
static int extra_kinds = 3;

static void worker(int t, int rounds) {
  std::mt19937 rng(1234 + t);
  for (int r = 0; stop_at > 0 ? now_s() < stop_at : r < rounds; r++) {
    const int kinds = STREAMS + 2;
    auto allowed = [](int i) {
      return i < STREAMS || (i == STREAMS && (extra_kinds & 1)) || (i == STREAMS + 1 && (extra_kinds & 2));
    };
    int ia, ib;
    do {
      ia = rng() % kinds;
      ib = (ia + 1 + rng() % (kinds - 1)) % kinds;
    } while (!allowed(ia) || !allowed(ib));
    cudaStream_t sa = pick(ia), sb = pick(ib);
    // Random sizes from 1 KiB to 8 MiB, log-uniform-ish.
    size_t n = (size_t)256 << (rng() % 14);
    n += rng() % n;
    unsigned pa = 0xA0000000u | (t << 16) | (r & 0xffff), pb = 0xB0000000u | (t << 16) | (r & 0xffff);
    unsigned *p = nullptr, *q = nullptr;
    phase[t] = 1;
    if (alloc_on((void **)&p, n * 4, sa)) { api_errors++; continue; }
    phase[t] = 2;
    spin<<<1, 1, 0, sa>>>(20000 + rng() % 20000);
    fill<<<64, 256, 0, sa>>>(p, n, pa);
    verify<<<64, 256, 0, sa>>>(p, n, pa, d_bad);
    phase[t] = 3;
    if (free_on(p, sa)) api_errors++;
    phase[t] = 4;
    if (alloc_on((void **)&q, n * 4, sb)) { api_errors++; continue; }
    if (q == p) reused++;
    phase[t] = 5;
    fill<<<64, 256, 0, sb>>>(q, n, pb);
    spin<<<1, 1, 0, sb>>>(60000);
    verify<<<64, 256, 0, sb>>>(q, n, pb, d_bad);
    phase[t] = 6;
    if (free_on(q, sb)) api_errors++;
    rounds_done++;
  }
  // A well-behaved thread drains its per-thread default stream before it exits. Without
  // this, the driver can leave work of exited threads' per-thread streams unfinished when
  // stream-ordered (cudaMallocAsync) frees are pending there: cudaDeviceSynchronize never
  // returns, with or without gpupool (STRESS_NO_EXIT_SYNC=1 STRESS_RAW=1 shows it).
  phase[t] = 7;
  if (!no_exit_sync) cudaStreamSynchronize(cudaStreamPerThread);
  phase[t] = 0;
}

int main(int argc, char **argv) {
  if (argc < 4) { fprintf(stderr, "usage: %s POOL UPSTREAM ROUNDS [--expect-corruption]\n", argv[0]); return 2; }
  bool expect_corruption = argc > 4 && !strcmp(argv[4], "--expect-corruption");
  int rounds = atoi(argv[3]);
  if (getenv("STRESS_KINDS")) extra_kinds = atoi(getenv("STRESS_KINDS"));
  if (getenv("STRESS_THREADS")) THREADS = atoi(getenv("STRESS_THREADS"));
  if (getenv("STRESS_STREAMS")) STREAMS = atoi(getenv("STRESS_STREAMS"));
  if (THREADS < 1 || THREADS > MAX_THREADS || STREAMS < 2 || STREAMS > MAX_STREAMS) {
    fprintf(stderr, "STRESS_THREADS must be 1..%d and STRESS_STREAMS 2..%d\n", MAX_THREADS, MAX_STREAMS);
    return 2;
  }
  if (getenv("STRESS_SECONDS")) stop_at = now_s() + atof(getenv("STRESS_SECONDS"));
  raw_async = getenv("STRESS_RAW") && !strcmp(getenv("STRESS_RAW"), "1");
  no_exit_sync = getenv("STRESS_NO_EXIT_SYNC") && !strcmp(getenv("STRESS_NO_EXIT_SYNC"), "1");
  if (gpupool_configure(0, argv[1], argv[2]) != GPUPOOL_STATUS_OK) {
    char m[512]; gpupool_last_error(m, sizeof m); fprintf(stderr, "configure: %s\n", m); return 1;
  }
  for (int i = 0; i < STREAMS; i++) cudaStreamCreateWithFlags(&streams[i], cudaStreamNonBlocking);
  cudaMalloc(&d_bad, sizeof *d_bad);
  cudaMemset(d_bad, 0, sizeof *d_bad);
  std::vector<std::thread> th;
  for (int t = 0; t < THREADS; t++) th.emplace_back(worker, t, rounds);
  std::atomic<bool> done{false};
  // Main is about to wait in cudaDeviceSynchronize; phases all 0 then means the stall is there.
  std::thread watchdog([&] {
    long last = -1;
    for (int tick = 0; !done; tick++) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      if (tick % 100 != 99) continue;
      long now = rounds_done.load();
      if (now == last) {
        fprintf(stderr, "stream_stress: no progress for 10 s at %ld rounds; worker phases (1 alloc A, 2 launch A, 3 free A, 4 alloc B, 5 launch B, 6 free B, 7 exit sync, 0 done):", now);
        for (int i = 0; i < THREADS; i++) fprintf(stderr, " %d", phase[i].load());
        fprintf(stderr, "\n");
      }
      last = now;
    }
  });
  for (auto &x : th) x.join();
  done = true;
  watchdog.join();
  cudaError_t e = cudaDeviceSynchronize();
  unsigned long long bad = 0;
  cudaMemcpy(&bad, d_bad, sizeof bad, cudaMemcpyDeviceToHost);
  gpupool_stats st = gpupool_stats_init();
  gpupool_get_stats(0, &st);
  size_t released = 0; /* releases segments last used on every kind of stream */
  fprintf(stderr, "workers done; reclaiming\n");
  if (!getenv("STRESS_NO_RECLAIM") && gpupool_reclaim(0, &released)) api_errors++;
  fprintf(stderr, "reclaimed %zu bytes\n", released);
  for (int i = 0; i < STREAMS; i++) cudaStreamDestroy(streams[i]);
  cudaFree(d_bad);
  // Stats exact at the end: nothing live, nothing counted in use, every operation counted.
  bool exact = st.n_live_blocks == 0 && st.used_bytes == 0 && st.n_allocs == st.n_frees;
  bool pass = e == cudaSuccess && api_errors == 0 && exact && (expect_corruption ? bad > 0 : bad == 0);
  printf("stream_stress pool=%s upstream=%s threads=%d streams=%d%s stats-exact=%s rounds=%ld same-block-reuses=%ld corrupted-words=%llu cross-stream=%llu released-by-decay=%llu api-errors=%ld cuda=%s -> %s\n",
         argv[1], argv[2], THREADS, STREAMS, expect_corruption ? " (streams IGNORED, corruption expected)" : "", exact ? "yes" : "NO", rounds_done.load(), reused.load(), bad,
         (unsigned long long)st.n_cross_stream_reuses, (unsigned long long)st.reclaimed_bytes, api_errors.load(), cudaGetErrorString(e), pass ? "PASS" : "FAIL");
  return pass ? 0 : 1;
}
