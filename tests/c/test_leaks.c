/* Leak report from C: with GPUPOOL_DEBUG=2 the report names the function that allocated.
 * `test_leaks exit` leaks one block on purpose and exits: with GPUPOOL_DEBUG=1 the at-exit
 * summary must list it (ctest checks the output). */
#include <stdlib.h>
#include "check.h"

__attribute__((noinline)) void *leaky_allocation_site(size_t n) {
  void *p = NULL;
  CHECK_STATUS(gpupool_malloc(&p, n, 0, NULL), GPUPOOL_STATUS_OK);
  return p;
}

int main(int argc, char **argv) {
  CHECK_STATUS(gpupool_configure(0, "split", "host"), GPUPOOL_STATUS_OK);
  void *a = leaky_allocation_site(3 << 20);
  void *b = leaky_allocation_site(1000);
  if (argc > 1 && !strcmp(argv[1], "exit")) {
    printf("leaving %p and %p allocated\n", a, b);
    return check_end("leaks at exit");
  }
  size_t n = gpupool_report_leaks(NULL, 0);
  char *report = malloc(n + 1);
  gpupool_report_leaks(report, n + 1);
  fputs(report, stdout);
  CHECK(strstr(report, "2 live allocation(s)") != NULL, "two leaks listed");
  CHECK(strstr(report, "leaky_allocation_site") != NULL, "report names the allocating function");
  char *big = strstr(report, "3.00 MiB"), *small = strstr(report, "1000 requested");
  CHECK(big && small && big < small, "largest first");
  gpupool_free(a, 0, NULL);
  gpupool_free(b, 0, NULL);
  gpupool_report_leaks(report, n + 1);
  CHECK(strstr(report, "0 live allocation(s)") != NULL, "nothing left: %s", report);
  free(report);
  return check_end("leak report");
}
