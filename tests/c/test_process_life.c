/* Process life on the host upstream: allocation and free from an atexit handler, from a
 * thread-specific-data destructor at thread exit, from threads that exit holding blocks
 * in their thread cache, and across fork(): a child gets GPUPOOL_STATUS_STOPPED (CUDA state
 * does not survive fork) instead of hanging on a lock another parent thread held, even
 * while other threads hammer the pool during the fork; the parent goes on unharmed. */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>
#include "check.h"

#define DEV 3

static void at_exit_uses_pool(void) {
  /* Runs after main returned: the pool must still answer (or give a status), never crash. */
  void *p = NULL;
  gpupool_status a = gpupool_malloc(&p, 1 << 20, DEV, NULL);
  gpupool_status f = gpupool_free(p, DEV, NULL);
  if (a != GPUPOOL_STATUS_OK || f != GPUPOOL_STATUS_OK) {
    fprintf(stderr, "FAIL atexit: malloc %d free %d\n", (int)a, (int)f);
    _exit(1);
  }
  printf("atexit handler allocated and freed: ok\n");
}

static pthread_key_t key;
static atomic_int dtor_ok;
static void tsd_destructor(void *arg) {
  (void)arg;
  void *p = NULL;
  if (gpupool_malloc(&p, 4096, DEV, NULL) == GPUPOOL_STATUS_OK && gpupool_free(p, DEV, NULL) == GPUPOOL_STATUS_OK)
    atomic_fetch_add(&dtor_ok, 1);
}

static void *thread_body(void *arg) {
  (void)arg;
  pthread_setspecific(key, (void *)1);
  /* Leave blocks in this thread's cache: same-size frees on the legacy stream. */
  for (int i = 0; i < 50; i++) {
    void *p = NULL;
    if (gpupool_malloc(&p, 8192, DEV, NULL) == GPUPOOL_STATUS_OK) gpupool_free(p, DEV, NULL);
  }
  return NULL;
}

static atomic_int stop_hammer;
static void *hammer(void *arg) {
  (void)arg;
  while (!atomic_load(&stop_hammer)) {
    void *p = NULL;
    if (gpupool_malloc(&p, 1 << 16, DEV, NULL) == GPUPOOL_STATUS_OK) gpupool_free(p, DEV, NULL);
    sched_yield(); /* let the forking thread run (under valgrind threads take turns) */
  }
  return NULL;
}

int main(void) {
  CHECK_STATUS(gpupool_configure(DEV, "split", "host"), GPUPOOL_STATUS_OK);
  void *keep = NULL;
  CHECK_STATUS(gpupool_malloc(&keep, 1 << 20, DEV, NULL), GPUPOOL_STATUS_OK);

  /* Thread exit: TSD destructors use the pool; caches of exited threads are reclaimed. */
  pthread_key_create(&key, tsd_destructor);
  pthread_t t[4];
  for (int i = 0; i < 4; i++) pthread_create(&t[i], NULL, thread_body, NULL);
  for (int i = 0; i < 4; i++) pthread_join(t[i], NULL);
  CHECK(atomic_load(&dtor_ok) == 4, "%d of 4 thread destructors could allocate and free", atomic_load(&dtor_ok));
  size_t released = 0;
  CHECK_STATUS(gpupool_reclaim(DEV, &released), GPUPOOL_STATUS_OK);
  gpupool_stats s = gpupool_stats_init();
  CHECK_STATUS(gpupool_get_stats(DEV, &s), GPUPOOL_STATUS_OK);
  CHECK(s.n_live_blocks == 1, "only the kept block is live after the threads exited (%llu)", (unsigned long long)s.n_live_blocks);

  /* fork() while other threads use the pool: 20 children, none may hang. */
  pthread_t h[2];
  for (int i = 0; i < 2; i++) pthread_create(&h[i], NULL, hammer, NULL);
  int children_ok = 0;
  for (int i = 0; i < 20; i++) {
    /* The child reports through a pipe (its exit code belongs to memory checkers, which
     * count the parent's other threads as leaks in a fork child). */
    int fds[2];
    if (pipe(fds) != 0) { CHECK(0, "pipe failed"); break; }
    pid_t pid = fork();
    if (pid == 0) {
      close(fds[0]);
      alarm(20); /* a hang is killed by SIGALRM: the parent reads no answer */
      void *p = NULL, *none = NULL;
      gpupool_status a = gpupool_malloc(&p, 4096, DEV, NULL);
      gpupool_status z = gpupool_malloc(&none, 0, DEV, NULL); /* nothing: refused all the same */
      gpupool_status f = gpupool_free(keep, DEV, NULL);
      char msg[512];
      gpupool_last_error(msg, sizeof msg);
      int good = a == GPUPOOL_STATUS_STOPPED && z == GPUPOOL_STATUS_STOPPED && f == GPUPOOL_STATUS_STOPPED && p == NULL &&
                 strstr(msg, "fork") != NULL;
      if (!good) fprintf(stderr, "child: malloc %d malloc(0) %d free %d: %s\n", (int)a, (int)z, (int)f, msg);
      char answer = good ? 'Y' : 'N';
      if (write(fds[1], &answer, 1) != 1) _exit(3);
      _exit(0);
    }
    close(fds[1]);
    char answer = 0;
    ssize_t got = read(fds[0], &answer, 1);
    close(fds[0]);
    int status = 0;
    waitpid(pid, &status, 0);
    children_ok += got == 1 && answer == 'Y';
  }
  atomic_store(&stop_hammer, 1);
  for (int i = 0; i < 2; i++) pthread_join(h[i], NULL);
  CHECK(children_ok == 20, "%d of 20 fork children got GPUPOOL_STATUS_STOPPED without hanging", children_ok);

  /* The parent goes on. */
  void *p = NULL;
  CHECK_STATUS(gpupool_malloc(&p, 1 << 20, DEV, NULL), GPUPOOL_STATUS_OK);
  CHECK_STATUS(gpupool_free(p, DEV, NULL), GPUPOOL_STATUS_OK);
  CHECK_STATUS(gpupool_free(keep, DEV, NULL), GPUPOOL_STATUS_OK);

  atexit(at_exit_uses_pool);
  return check_end("process_life");
}
