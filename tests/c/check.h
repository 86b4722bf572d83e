/* Tiny test harness for the C tests: CHECK records a failure and goes on; END prints the
 * "N passed, N failed" line ctest logs show and returns the exit code. */
#ifndef GPUPOOL_TEST_CHECK_H
#define GPUPOOL_TEST_CHECK_H
#include <stdio.h>
#include <string.h>
#include "gpupool.h"

static int check_passed = 0, check_failed = 0;

#define CHECK(cond, ...)                                                        \
  do {                                                                          \
    if (cond) {                                                                 \
      check_passed++;                                                           \
    } else {                                                                    \
      check_failed++;                                                           \
      fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);           \
      fprintf(stderr, __VA_ARGS__);                                             \
      fprintf(stderr, "\n");                                                    \
    }                                                                           \
  } while (0)

/* The calling thread's last gpupool error message. */
static const char *last_error(void) {
  static char buf[2048];
  gpupool_last_error(buf, sizeof buf);
  return buf;
}

#define CHECK_STATUS(call, expected)                                            \
  do {                                                                          \
    gpupool_status st_ = (call);                                                \
    CHECK(st_ == (expected), "%s returned %d (%s), expected %d; last error: %s", \
          #call, (int)st_, gpupool_status_str(st_), (int)(expected), last_error()); \
  } while (0)

static int check_end(const char *name) {
  printf("%s: %d passed, %d failed\n", name, check_passed, check_failed);
  return check_failed ? 1 : 0;
}
#endif
