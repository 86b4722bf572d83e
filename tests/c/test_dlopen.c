/* dlopen, use, dlclose and dlopen the library again (host upstream): the second load must
 * work as the first did. usage: test_dlopen /path/to/libgpupool.so */
#include <dlfcn.h>
#include <stdio.h>

typedef int (*configure_fn)(int, const char *, const char *);
typedef int (*malloc_fn)(void **, size_t, int, void *);
typedef int (*free_fn)(void *, int, void *);

static int use(const char *path, int round) {
  void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!h) { fprintf(stderr, "dlopen %s: %s\n", path, dlerror()); return 1; }
  configure_fn cfg = (configure_fn)dlsym(h, "gpupool_configure");
  malloc_fn m = (malloc_fn)dlsym(h, "gpupool_malloc");
  free_fn f = (free_fn)dlsym(h, "gpupool_free");
  if (!cfg || !m || !f) { fprintf(stderr, "dlsym failed\n"); return 1; }
  int bad = cfg(0, "split", "host") != 0;
  for (int i = 0; i < 100 && !bad; i++) {
    void *p = NULL;
    bad |= m(&p, (size_t)(i + 1) << 12, 0, NULL) != 0 || p == NULL;
    bad |= f(p, 0, NULL) != 0;
  }
  if (dlclose(h) != 0) { fprintf(stderr, "dlclose: %s\n", dlerror()); bad = 1; }
  printf("load %d: %s\n", round, bad ? "FAILED" : "ok");
  return bad;
}

int main(int argc, char **argv) {
  if (argc < 2) { fprintf(stderr, "usage: test_dlopen LIB\n"); return 2; }
  int bad = use(argv[1], 1) | use(argv[1], 2);
  printf("dlopen: %d passed, %d failed\n", bad ? 0 : 2, bad ? 1 : 0);
  return bad;
}
