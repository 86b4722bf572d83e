/* Malformed environment values: every call fails with GPUPOOL_STATUS_INVALID_CONFIG and the
 * message names the variable, its value and what is accepted. Run by ctest with one bad
 * variable set: `test_env VAR`. Without a bad value (argc 1) it checks the good path. */
#include "check.h"

int main(int argc, char **argv) {
  void *p = NULL;
  if (argc > 1) {
    CHECK_STATUS(gpupool_malloc(&p, 64, 0, NULL), GPUPOOL_STATUS_INVALID_CONFIG);
    CHECK(strstr(last_error(), argv[1]) != NULL, "message names %s: %s", argv[1], last_error());
    CHECK(strstr(last_error(), "accepted") != NULL, "message says what is accepted: %s", last_error());
    gpupool_stats s = gpupool_stats_init();
    CHECK_STATUS(gpupool_get_stats(0, &s), GPUPOOL_STATUS_INVALID_CONFIG);
    CHECK_STATUS(gpupool_set_limit(0, 0), GPUPOOL_STATUS_INVALID_CONFIG);
    /* The status report shows the error instead of "no device pool in use yet". */
    char report[4096];
    gpupool_memory_status(-1, report, sizeof report);
    CHECK(strstr(report, argv[1]) != NULL && strstr(report, "no device pool") == NULL, "report names %s: %s", argv[1],
          report);
  } else {
    /* GPUPOOL_MEMORY_LIMIT=50% of a 64 MiB host device (GPUPOOL_HOST_CAPACITY=64MiB). */
    size_t limit = 0;
    CHECK_STATUS(gpupool_get_limit(0, &limit), GPUPOOL_STATUS_OK);
    CHECK(limit == (size_t)32 << 20, "50%% of 64 MiB is 32 MiB, got %zu", limit);
    CHECK_STATUS(gpupool_malloc(&p, (size_t)40 << 20, 0, NULL), GPUPOOL_STATUS_OUT_OF_MEMORY);
    CHECK_STATUS(gpupool_malloc(&p, (size_t)20 << 20, 0, NULL), GPUPOOL_STATUS_OK);
    CHECK_STATUS(gpupool_free(p, 0, NULL), GPUPOOL_STATUS_OK);
    /* No GPUPOOL_POOL: the arena, on the host upstream too (its simulated VMM). */
    char json[4096];
    size_t n = gpupool_stats_json(0, json, sizeof json);
    CHECK(n > 0 && n < sizeof json, "stats JSON of %zu bytes", n);
    CHECK(strstr(json, "\"strategy\":\"arena\"") != NULL, "the default pool is the arena: %s", json);
    CHECK(strstr(json, "\"memory\":\"posix_fd\"") != NULL, "the report says what granules are: %s", json);
  }
  return check_end(argc > 1 ? argv[1] : "env good values");
}
