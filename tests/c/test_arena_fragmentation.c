/* The arena against a fragmenting program, through the C API: each step allocates mixed
 * sizes, frees every other block, asks for one block larger than any hole, then frees
 * everything. The arena must hold at most 1.05x the peak bytes in use (split holds ~1.35x
 * on the same steps), and once every step has run twice, running them again must make no
 * driver call: the stitches that served the large blocks are reused.
 *
 * usage: test_arena_fragmentation UPSTREAM (host in CI; device on a GPU) */
#include <stdlib.h>
#include "check.h"

#define MIB ((size_t)1 << 20)
static int dev = 0;

static unsigned long long driver_calls_total(void) {
  static char json[16384];
  gpupool_stats_json(dev, json, sizeof json);
  const char *calls = strstr(json, "\"driver_calls\":{");
  const char *total = calls ? strstr(calls, "\"total\":") : NULL;
  return total ? strtoull(total + 8, NULL, 10) : ~0ull;
}

static gpupool_stats stats(void) {
  gpupool_stats s = {0};
  s.struct_size = sizeof s;
  CHECK_STATUS(gpupool_get_stats(dev, &s), GPUPOOL_STATUS_OK);
  return s;
}

static void step(int shift) {
  const size_t sizes[] = {11 * MIB + 4096, 700 * 1024, 13 * MIB, 96 * 1024, 17 * MIB + 512, 24 * MIB};
  void *live[36];
  for (int i = 0; i < 36; i++) CHECK_STATUS(gpupool_malloc(&live[i], sizes[(i + shift) % 6], dev, NULL), GPUPOOL_STATUS_OK);
  for (int i = 0; i < 36; i += 2) CHECK_STATUS(gpupool_free(live[i], dev, NULL), GPUPOOL_STATUS_OK);
  void *big = NULL;
  CHECK_STATUS(gpupool_malloc(&big, 160 * MIB, dev, NULL), GPUPOOL_STATUS_OK);
  CHECK_STATUS(gpupool_free(big, dev, NULL), GPUPOOL_STATUS_OK);
  for (int i = 1; i < 36; i += 2) CHECK_STATUS(gpupool_free(live[i], dev, NULL), GPUPOOL_STATUS_OK);
}

int main(int argc, char **argv) {
  const char *up = argc > 1 ? argv[1] : "host";
  gpupool_status st = gpupool_configure(dev, "arena", up);
  if (st == GPUPOOL_STATUS_NO_DRIVER) {
    printf("SKIPPED: %s upstream needs a CUDA driver: %s\n", up, last_error());
    return 77;
  }
  CHECK_STATUS(st, GPUPOOL_STATUS_OK);
  for (int s = 0; s < 3; s++) step(s);
  gpupool_stats a = stats();
  double ratio = (double)a.peak_total_bytes / (double)a.peak_used_bytes;
  printf("arena on %s: peak reserved %.1f MiB / peak in use %.1f MiB = %.3f\n", up,
         a.peak_total_bytes / (double)MIB, a.peak_used_bytes / (double)MIB, ratio);
  CHECK(ratio <= 1.05, "arena holds %.3fx its peak in use", ratio);
  /* Once more first: the first pass began with nothing mapped, so its small blocks took
   * scraps of the large range; this one finds the small range mapped, which moves free
   * space once (one more stitch at most). From then on the layout repeats exactly. */
  for (int s = 0; s < 3; s++) step(s);
  unsigned long long before = driver_calls_total();
  for (int s = 0; s < 3; s++) step(s);
  unsigned long long after = driver_calls_total();
  printf("driver calls over the repeated steps: %llu\n", after - before);
  CHECK(before != ~0ull && after == before, "repeated steps made %llu driver calls", after - before);
  CHECK(stats().peak_total_bytes == a.peak_total_bytes, "repeated steps reserved more");
  return check_end("arena fragmentation");
}
