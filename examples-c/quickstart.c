/* gpupool quickstart: allocate, copy a pattern host -> pool memory -> host, verify, print the
 * stats and the memory status report.
 *
 * Built with the CUDA toolkit (GPUPOOL_EXAMPLE_CUDA) it uses device memory and cudaMemcpy.
 * Without a GPU, or built without the toolkit, it runs on the host upstream and says so. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "gpupool.h"
#ifdef GPUPOOL_EXAMPLE_CUDA
#include <cuda_runtime_api.h>
#endif

#define N (1 << 20)

static int fail(const char *what, gpupool_status st) {
  char msg[1024];
  gpupool_last_error(msg, sizeof msg);
  fprintf(stderr, "%s failed: %s\n  %s\n", what, gpupool_status_str(st), msg);
  return 1;
}

int main(void) {
  int on_gpu = 0;
#ifdef GPUPOOL_EXAMPLE_CUDA
  int count = 0;
  gpupool_status st0 = gpupool_device_count(&count);
  if (st0 == GPUPOOL_STATUS_OK && count > 0) {
    on_gpu = 1;
  } else {
    char msg[512];
    gpupool_last_error(msg, sizeof msg);
    printf("No usable GPU (%s): running on the host upstream instead.\n", msg);
  }
#else
  printf("Built without the CUDA toolkit: running on the host upstream (host memory standing in for a GPU).\n");
#endif
  if (!on_gpu) {
    gpupool_status st = gpupool_configure(0, NULL, "host");
    if (st != GPUPOOL_STATUS_OK) return fail("gpupool_configure", st);
  }
  printf("gpupool %s, device 0, %s upstream\n", gpupool_version(), on_gpu ? "device (GPU)" : "host");

  unsigned *host_in = malloc(N * sizeof *host_in), *host_out = malloc(N * sizeof *host_out);
  if (!host_in || !host_out) return 1;
  for (unsigned i = 0; i < N; i++) host_in[i] = i * 2654435761u;

  void *buf = NULL;
  gpupool_status st = gpupool_malloc(&buf, N * sizeof(unsigned), 0, NULL);
  if (st != GPUPOOL_STATUS_OK) return fail("gpupool_malloc", st);
  printf("allocated %zu bytes at %p\n", N * sizeof(unsigned), buf);

#ifdef GPUPOOL_EXAMPLE_CUDA
  if (on_gpu) {
    if (cudaMemcpy(buf, host_in, N * sizeof(unsigned), cudaMemcpyHostToDevice) != cudaSuccess ||
        cudaMemcpy(host_out, buf, N * sizeof(unsigned), cudaMemcpyDeviceToHost) != cudaSuccess) {
      fprintf(stderr, "cudaMemcpy failed\n");
      return 1;
    }
  } else
#endif
  {
    memcpy(buf, host_in, N * sizeof(unsigned));
    memcpy(host_out, buf, N * sizeof(unsigned));
  }
  int ok = memcmp(host_in, host_out, N * sizeof(unsigned)) == 0;
  printf("pattern round trip host -> %s -> host: %s\n", on_gpu ? "device" : "pool memory", ok ? "OK" : "MISMATCH");

  /* Freed memory stays cached: the next request of that size reuses it. */
  gpupool_free(buf, 0, NULL);
  void *again = NULL;
  gpupool_malloc(&again, N * sizeof(unsigned), 0, NULL);
  printf("after free, the same request got %s block\n", again == buf ? "the cached" : "a new");

  gpupool_stats s = gpupool_stats_init();
  gpupool_get_stats(0, &s);
  printf("stats: used %llu B, cached %llu B, reserved %llu B, %llu allocs, %llu upstream allocs\n",
         (unsigned long long)s.used_bytes, (unsigned long long)s.free_bytes, (unsigned long long)s.total_bytes,
         (unsigned long long)s.n_allocs, (unsigned long long)s.n_upstream_allocs);

  /* Asking for the length first, then the text. */
  size_t need = gpupool_memory_status(0, NULL, 0);
  char *report = malloc(need + 1);
  gpupool_memory_status(0, report, need + 1);
  fputs(report, stdout);

  /* Bad input is an error, not a crash. */
  st = gpupool_free(again, 0, NULL);
  st = gpupool_free(again, 0, NULL);
  char msg[512];
  gpupool_last_error(msg, sizeof msg);
  printf("double free -> %s: %s\n", gpupool_status_str(st), msg);

  size_t released = 0;
  gpupool_reclaim(0, &released);
  printf("reclaim released %zu bytes\n", released);
  free(report);
  free(host_in);
  free(host_out);
  return ok ? 0 : 1;
}
