/* Pinned pool: page-locked host buffers from gpupool_pinned_malloc for asynchronous copies,
 * freed on the stream that used them (the pool will not hand them out before the copies are
 * done). */
#include <stdio.h>
#include <string.h>
#include <cuda_runtime_api.h>
#include "gpupool.h"

int main(void) {
  const size_t n = 8 << 20;
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  unsigned char *h_in = NULL, *h_out = NULL, *d = NULL;
  if (gpupool_pinned_malloc((void **)&h_in, n, s) || gpupool_pinned_malloc((void **)&h_out, n, s) ||
      gpupool_malloc((void **)&d, n, 0, s)) {
    char m[512];
    gpupool_last_error(m, sizeof m);
    printf("allocation failed: %s\n", m);
    return 1;
  }
  unsigned int flags = 0;
  int pinned = cudaHostGetFlags(&flags, h_in) == cudaSuccess;
  for (size_t i = 0; i < n; i++) h_in[i] = (unsigned char)(i * 13);
  cudaMemcpyAsync(d, h_in, n, cudaMemcpyHostToDevice, s);
  cudaMemcpyAsync(h_out, d, n, cudaMemcpyDeviceToHost, s);
  cudaStreamSynchronize(s);
  int ok = memcmp(h_in, h_out, n) == 0;
  gpupool_pinned_free(h_in, s);
  gpupool_pinned_free(h_out, s);
  gpupool_free(d, 0, s);
  void *again = NULL;
  gpupool_pinned_malloc(&again, n, s);
  gpupool_stats st = gpupool_stats_init();
  gpupool_pinned_get_stats(&st);
  printf("pinned (page-locked per CUDA: %s), async round trip %s, reuse %s, pinned reserved %llu B, upstream allocs %llu\n",
         pinned ? "yes" : "no", ok ? "OK" : "MISMATCH", (again == h_in || again == h_out) ? "yes" : "no",
         (unsigned long long)st.total_bytes, (unsigned long long)st.n_upstream_allocs);
  gpupool_pinned_free(again, s);
  size_t released = 0;
  gpupool_pinned_reclaim(&released);
  printf("pinned reclaim released %zu bytes\n", released);
  cudaStreamDestroy(s);
  return ok && pinned && released > 0 ? 0 : 1;
}
