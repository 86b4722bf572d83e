/* Limits: GPUPOOL_MEMORY_LIMIT from the environment, then the runtime setter, and the text
 * of the out-of-memory error. Runs on any upstream (pass "host" as argv[1] to force it). */
#include <stdio.h>
#include <stdlib.h>
#include "gpupool.h"

int main(int argc, char **argv) {
  if (argc > 1 && gpupool_configure(0, NULL, argv[1]) != GPUPOOL_STATUS_OK) {
    char m[512];
    gpupool_last_error(m, sizeof m);
    fprintf(stderr, "configure failed: %s\n", m);
    return 1;
  }
  size_t limit = 0;
  if (gpupool_get_limit(0, &limit) != GPUPOOL_STATUS_OK) {
    char m[512];
    gpupool_last_error(m, sizeof m);
    fprintf(stderr, "%s\n", m);
    return 1;
  }
  const char *env = getenv("GPUPOOL_MEMORY_LIMIT");
  printf("GPUPOOL_MEMORY_LIMIT=%s -> limit %zu bytes\n", env ? env : "(unset)", limit);

  gpupool_set_limit(0, (size_t)64 << 20); /* the API overrides the environment */
  gpupool_get_limit(0, &limit);
  printf("after gpupool_set_limit: %zu bytes\n", limit);

  void *a = NULL, *b = NULL;
  gpupool_malloc(&a, (size_t)48 << 20, 0, NULL);
  gpupool_status st = gpupool_malloc(&b, (size_t)32 << 20, 0, NULL);
  char msg[1024];
  gpupool_last_error(msg, sizeof msg);
  printf("second request -> %s (pointer %p)\n%s\n", gpupool_status_str(st), b, msg);
  gpupool_free(a, 0, NULL);
  st = gpupool_malloc(&b, (size_t)32 << 20, 0, NULL); /* the cached 48 MiB is released first */
  printf("after freeing the first: %s\n", gpupool_status_str(st));
  gpupool_free(b, 0, NULL);
  return st == GPUPOOL_STATUS_OK ? 0 : 1;
}
