/* The conformance suite through the C API, for one strategy x upstream given on the command
 * line: `test_conformance POOL UPSTREAM [DEVICE]`. It never touches the memory it gets, so
 * the same program checks the host upstream in CI and device/vmm/managed/async on a GPU.
 * Checks: alignment, no overlap, reuse after free, coalescing (split), exact stats, limits,
 * reclaim returns exactly the cached bytes, bad input changes nothing. */
#include <stdint.h>
#include <stdlib.h>
#include "check.h"

#define MIB ((size_t)1 << 20)
static int dev = 0;
static const char *pool = "split";

static gpupool_stats stats(void) {
  gpupool_stats s = gpupool_stats_init();
  CHECK_STATUS(gpupool_get_stats(dev, &s), GPUPOOL_STATUS_OK);
  return s;
}

static size_t rounded(size_t n) {
  if (!strcmp(pool, "split") || !strcmp(pool, "arena")) return (n + 511) / 512 * 512;
  if (!strcmp(pool, "binned")) {
    size_t r = 512;
    while (r < n) r <<= 1;
    return r;
  }
  return (n + 255) / 256 * 256;
}

static void *alloc(size_t n) {
  void *p = NULL;
  CHECK_STATUS(gpupool_malloc(&p, n, dev, NULL), GPUPOOL_STATUS_OK);
  return p;
}

static void release(void *p) { CHECK_STATUS(gpupool_free(p, dev, NULL), GPUPOOL_STATUS_OK); }

static int cmp_addr(const void *a, const void *b) {
  uintptr_t x = *(const uintptr_t *)a, y = *(const uintptr_t *)b;
  return x < y ? -1 : x > y;
}

static void alignment_and_overlap(void) {
  enum { N = 64 };
  uintptr_t ptrs[N];
  size_t sizes[N];
  size_t used = 0;
  gpupool_stats s0 = stats();
  for (int i = 0; i < N; i++) {
    sizes[i] = 1 + (size_t)(i * 7919) % (i % 5 == 0 ? 3 * MIB : 70000);
    ptrs[i] = (uintptr_t)alloc(sizes[i]);
    used += rounded(sizes[i]);
    CHECK(ptrs[i] % 256 == 0, "block %d at %#lx not 256-aligned", i, (unsigned long)ptrs[i]);
  }
  gpupool_stats s = stats();
  CHECK(s.used_bytes - s0.used_bytes == used, "used %llu, expected %zu", (unsigned long long)(s.used_bytes - s0.used_bytes), used);
  CHECK(s.n_live_blocks - s0.n_live_blocks == N, "live blocks");
  CHECK(s.free_bytes + s.used_bytes == s.total_bytes, "free + used == total");
  /* Overlap: sort by address, each block must end before the next starts. */
  uintptr_t pairs[N][2];
  for (int i = 0; i < N; i++) { pairs[i][0] = ptrs[i]; pairs[i][1] = rounded(sizes[i]); }
  qsort(pairs, N, sizeof pairs[0], cmp_addr);
  for (int i = 1; i < N; i++)
    CHECK(pairs[i - 1][0] + pairs[i - 1][1] <= pairs[i][0], "blocks %d and %d overlap", i - 1, i);
  for (int i = 0; i < N; i++) release((void *)ptrs[i]);
  s = stats();
  CHECK(s.used_bytes == s0.used_bytes && s.n_frees - s0.n_frees == N, "stats after frees");
}

static void reuse_after_free(void) {
  size_t sizes[] = {512, 100000, 5 * MIB};
  for (int i = 0; i < 3; i++) {
    void *a = alloc(sizes[i]);
    release(a);
    unsigned long long ups = stats().n_upstream_allocs;
    void *b = alloc(sizes[i]);
    unsigned long long ups2 = stats().n_upstream_allocs;
    if (strcmp(pool, "none")) {
      CHECK(a == b, "%s: same size after free must reuse", pool);
      CHECK(ups == ups2, "%s: reuse must not call the upstream", pool);
    } else {
      CHECK(ups2 == ups + 1, "none: every request goes upstream");
    }
    release(b);
  }
}

static void coalescing(void) {
  if (strcmp(pool, "split")) return;
  CHECK_STATUS(gpupool_reclaim(dev, NULL), GPUPOOL_STATUS_OK);
  char *a = alloc(256 * 1024), *b = alloc(256 * 1024), *g = alloc(512);
  CHECK(b == a + 256 * 1024, "consecutive blocks from one segment");
  release(a);
  release(b);
  unsigned long long ups = stats().n_upstream_allocs;
  char *c = alloc(512 * 1024);
  CHECK(c == a, "freed neighbours coalesce into one block");
  CHECK(stats().n_upstream_allocs == ups, "no upstream call");
  release(c);
  release(g);
}

static void limits_and_reclaim(void) {
  CHECK_STATUS(gpupool_reclaim(dev, NULL), GPUPOOL_STATUS_OK);
  CHECK(stats().total_bytes == 0, "nothing reserved after reclaim with nothing live");
  CHECK_STATUS(gpupool_set_limit(dev, 8 * MIB), GPUPOOL_STATUS_OK);
  void *a = alloc(3 * MIB), *b = alloc(3 * MIB), *p = NULL;
  gpupool_stats before = stats();
  CHECK(before.total_bytes <= 8 * MIB, "reserved under the limit");
  CHECK_STATUS(gpupool_malloc(&p, 3 * MIB, dev, NULL), GPUPOOL_STATUS_OUT_OF_MEMORY);
  CHECK(p == NULL, "failed malloc gives NULL");
  CHECK(strstr(last_error(), "limit") != NULL, "OOM names the limit: %s", last_error());
  gpupool_stats after = stats();
  CHECK(after.used_bytes == before.used_bytes && after.n_ooms == before.n_ooms + 1, "failed malloc changes nothing but the OOM count");
  release(a);
  release(b);
  void *c = alloc(7 * MIB); /* needs the cached 3 MiB blocks released */
  CHECK(stats().total_bytes <= 8 * MIB, "still under the limit");
  release(c);
  CHECK_STATUS(gpupool_set_limit(dev, 0), GPUPOOL_STATUS_OK);
  size_t cached = (size_t)stats().free_bytes, released = 0;
  CHECK_STATUS(gpupool_reclaim(dev, &released), GPUPOOL_STATUS_OK);
  CHECK(released == cached, "reclaim returned %zu of %zu cached bytes", released, cached);
  gpupool_stats s = stats();
  CHECK(s.total_bytes == 0 && s.n_free_blocks == 0, "empty after reclaim");
}

static void bad_inputs(void) {
  void *keep = alloc(4096), *gone = alloc(4096), *p = (void *)1;
  release(gone);
  gpupool_stats s0 = stats();
  CHECK_STATUS(gpupool_malloc(NULL, 16, dev, NULL), GPUPOOL_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(gpupool_malloc(&p, 0, dev, NULL), GPUPOOL_STATUS_OK);
  CHECK(p == NULL, "size 0 gives NULL");
  CHECK_STATUS(gpupool_free(NULL, dev, NULL), GPUPOOL_STATUS_OK);
  CHECK_STATUS(gpupool_free(gone, dev, NULL), GPUPOOL_STATUS_INVALID_POINTER);
  CHECK_STATUS(gpupool_free((char *)keep + 256, dev, NULL), GPUPOOL_STATUS_INVALID_POINTER);
  CHECK_STATUS(gpupool_malloc(&p, SIZE_MAX, dev, NULL), GPUPOOL_STATUS_OUT_OF_MEMORY);
  CHECK_STATUS(gpupool_malloc(&p, SIZE_MAX - 100, dev, NULL), GPUPOOL_STATUS_OUT_OF_MEMORY);
  CHECK_STATUS(gpupool_malloc(&p, 16, -1, NULL), GPUPOOL_STATUS_INVALID_DEVICE);
  CHECK_STATUS(gpupool_malloc(&p, 16, 4096, NULL), GPUPOOL_STATUS_INVALID_DEVICE);
  gpupool_stats s1 = stats();
  CHECK(s1.used_bytes == s0.used_bytes && s1.n_live_blocks == s0.n_live_blocks, "bad input changed the pool");
  CHECK(s1.n_invalid_frees == s0.n_invalid_frees + 2, "invalid frees counted");
  release(keep);
}

int main(int argc, char **argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: %s POOL UPSTREAM [DEVICE]\n", argv[0]);
    return 2;
  }
  pool = argv[1];
  if (argc > 3) dev = atoi(argv[3]);
  gpupool_status st = gpupool_configure(dev, pool, argv[2]);
  if (st == GPUPOOL_STATUS_NO_DRIVER) {
    printf("SKIPPED: %s upstream needs a CUDA driver: %s\n", argv[2], last_error());
    return 77; /* ctest SKIP_RETURN_CODE */
  }
  CHECK_STATUS(st, GPUPOOL_STATUS_OK);
  if (!strcmp(pool, "arena")) {
    /* The arena must really run (not its fallback) on every upstream with a VMM API. */
    char json[8192];
    gpupool_stats_json(dev, json, sizeof json);
    CHECK(strstr(json, "\"strategy\":\"arena\"") != NULL, "arena fell back: %s", json);
  }
  alignment_and_overlap();
  reuse_after_free();
  coalescing();
  limits_and_reclaim();
  bad_inputs();
  char name[64];
  snprintf(name, sizeof name, "conformance %s/%s", pool, argv[2]);
  return check_end(name);
}
