/* Hot-path cost on the GPU machine, without any framework: ns per cached malloc+free pair
 * through each entry point, and the cost of one event record on the legacy stream (the
 * fence behind the CuPy stream policy). Prints one line per measurement. */
#include <stdio.h>
#include <time.h>
#include <cuda_runtime_api.h>
#include "gpupool_plugin.h"

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

#define N 200000
#define SIZE ((size_t)1 << 20)

int main(void) {
  cudaFree(0);
  void *p;
  double t;
  for (int rep = 0; rep < 2; rep++) {
    t = now();
    for (int i = 0; i < N; i++) { gpupool_malloc(&p, SIZE, 0, NULL); gpupool_free(p, 0, NULL); }
    printf("hotpath gpupool_malloc+free (legacy stream): %.0f ns/pair\n", (now() - t) / N * 1e9);
    t = now();
    for (int i = 0; i < N; i++) { p = gpupool_torch_malloc(SIZE, 0, NULL); gpupool_torch_free(p, SIZE, 0, NULL); }
    printf("hotpath gpupool_torch_malloc+free: %.0f ns/pair\n", (now() - t) / N * 1e9);
    t = now();
    for (int i = 0; i < N; i++) { p = gpupool_cupy_malloc(NULL, SIZE, 0); gpupool_cupy_free(NULL, p, 0); }
    printf("hotpath gpupool_cupy_malloc+free (batched legacy fence): %.0f ns/pair\n", (now() - t) / N * 1e9);
  }
  cudaEvent_t ev;
  cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
  t = now();
  for (int i = 0; i < N; i++) cudaEventRecord(ev, 0);
  printf("hotpath cudaEventRecord on the legacy stream: %.0f ns\n", (now() - t) / N * 1e9);
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  t = now();
  for (int i = 0; i < N; i++) cudaEventRecord(ev, s);
  printf("hotpath cudaEventRecord on a non-blocking stream: %.0f ns\n", (now() - t) / N * 1e9);
  t = now();
  for (int i = 0; i < N; i++) { gpupool_malloc(&p, SIZE, 0, s); gpupool_free(p, 0, s); }
  printf("hotpath gpupool_malloc+free (user stream, event per free): %.0f ns/pair\n", (now() - t) / N * 1e9);
  gpupool_free(NULL, 0, NULL);
  return 0;
}
