/* Threads: N host threads, each with its own CUDA stream, allocating, filling and freeing
 * pool memory concurrently; each thread verifies its own data. */
#include <pthread.h>
#include <stdio.h>
#include <cuda_runtime_api.h>
#include "gpupool.h"

#define THREADS 8
#define ROUNDS 500

static int failures[THREADS];

static void *worker(void *arg) {
  int t = (int)(size_t)arg;
  cudaStream_t s;
  if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) { failures[t]++; return NULL; }
  for (int r = 0; r < ROUNDS; r++) {
    size_t n = 4096 + (size_t)((r * 7919 + t * 104729) % (1 << 20));
    unsigned char *p = NULL, check = 0;
    if (gpupool_malloc((void **)&p, n, 0, s) != GPUPOOL_STATUS_OK) { failures[t]++; break; }
    unsigned char v = (unsigned char)(t * 31 + r);
    cudaMemsetAsync(p, v, n, s);
    cudaMemcpyAsync(&check, p + n - 1, 1, cudaMemcpyDeviceToHost, s);
    cudaStreamSynchronize(s);
    if (check != v) failures[t]++;
    gpupool_free(p, 0, s);
  }
  cudaStreamSynchronize(s);
  cudaStreamDestroy(s);
  return NULL;
}

int main(void) {
  pthread_t th[THREADS];
  for (size_t i = 0; i < THREADS; i++) pthread_create(&th[i], NULL, worker, (void *)i);
  int bad = 0;
  for (int i = 0; i < THREADS; i++) { pthread_join(th[i], NULL); bad += failures[i]; }
  gpupool_stats st = gpupool_stats_init();
  gpupool_get_stats(0, &st);
  printf("%d threads x %d rounds: %d failures; allocs %llu frees %llu live %llu upstream allocs %llu\n", THREADS, ROUNDS,
         bad, (unsigned long long)st.n_allocs, (unsigned long long)st.n_frees, (unsigned long long)st.n_live_blocks,
         (unsigned long long)st.n_upstream_allocs);
  return bad == 0 && st.n_live_blocks == 0 ? 0 : 1;
}
