// OOM and recovery (GPU): fill the device to a pool limit, then to the driver's real limit;
// the error text carries the numbers; free everything; reclaim; the driver's free memory
// comes back to where it started.
#include <cstdio>
#include <cstring>
#include <vector>
#include <cuda_runtime.h>
#include "../c/check.h"

int main(int argc, char **argv) {
  const char *pool = argc > 1 ? argv[1] : "split";
  CHECK_STATUS(gpupool_configure(0, pool, "device"), GPUPOOL_STATUS_OK);
  cudaFree(0);
  size_t free0 = 0, total = 0;
  cudaMemGetInfo(&free0, &total);
  const size_t GiB = (size_t)1 << 30;

  // 1. A pool limit of 8 GiB: fill to it.
  CHECK_STATUS(gpupool_set_limit(0, 8 * GiB), GPUPOOL_STATUS_OK);
  std::vector<void *> v;
  void *p = nullptr;
  gpupool_status st;
  while ((st = gpupool_malloc(&p, 512 << 20, 0, nullptr)) == GPUPOOL_STATUS_OK) v.push_back(p);
  CHECK(st == GPUPOOL_STATUS_OUT_OF_MEMORY, "limit reached gives OUT_OF_MEMORY, got %d", (int)st);
  CHECK(strstr(last_error(), "limit of 8.00 GiB") != NULL, "message names the limit: %s", last_error());
  gpupool_stats s = gpupool_stats_init();
  gpupool_get_stats(0, &s);
  CHECK(s.total_bytes <= 8 * GiB && s.total_bytes >= 7 * GiB, "reserved %llu within the 8 GiB limit", (unsigned long long)s.total_bytes);
  printf("limit fill: %zu x 512 MiB, reserved %.2f GiB\n  %s\n", v.size(), s.total_bytes / (double)GiB, last_error());
  for (void *x : v) gpupool_free(x, 0, nullptr);
  v.clear();

  // 2. No limit: fill the device itself (4 GiB requests until the driver refuses).
  CHECK_STATUS(gpupool_set_limit(0, 0), GPUPOOL_STATUS_OK);
  while ((st = gpupool_malloc(&p, 4 * GiB, 0, nullptr)) == GPUPOOL_STATUS_OK) v.push_back(p);
  CHECK(st == GPUPOOL_STATUS_OUT_OF_MEMORY, "device full gives OUT_OF_MEMORY, got %d", (int)st);
  const char *msg = last_error();
  CHECK(strstr(msg, "Device:") && strstr(msg, "free of") && strstr(msg, "reserved") && strstr(msg, "largest free block"),
        "message carries device free/total and pool numbers: %s", msg);
  size_t free_full = 0;
  cudaMemGetInfo(&free_full, &total);
  printf("device fill: %zu x 4 GiB, driver free %.2f GiB of %.2f GiB\n  %s\n", v.size(), free_full / (double)GiB, total / (double)GiB, msg);
  CHECK(v.size() * 4 * GiB > total / 2, "filled most of the device");
  for (void *x : v) gpupool_free(x, 0, nullptr);
  gpupool_get_stats(0, &s);
  CHECK(s.used_bytes == 0 && s.free_bytes == s.total_bytes, "all cached after free");

  // 3. Reclaim: the driver's free memory comes back.
  size_t released = 0;
  CHECK_STATUS(gpupool_reclaim(0, &released), GPUPOOL_STATUS_OK);
  size_t free1 = 0;
  cudaMemGetInfo(&free1, &total);
  printf("reclaim released %.2f GiB; driver free before %.2f GiB, after %.2f GiB\n", released / (double)GiB, free0 / (double)GiB,
         free1 / (double)GiB);
  CHECK(released == (size_t)s.total_bytes, "reclaim released all %llu cached bytes", (unsigned long long)s.total_bytes);
  CHECK(free1 + (64 << 20) >= free0, "driver free memory came back (%zu vs %zu)", free1, free0);
  return check_end("oom_recovery");
}
