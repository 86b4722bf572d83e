/* Sharing arena memory between processes through the C API. The parent allocates on an
 * arena pool, fills two blocks (one of several granules, one small block inside a shared
 * granule), exports them and starts a second process (fork + exec, so it may use CUDA),
 * which gets the descriptors and the file descriptors over a Unix socket (SCM_RIGHTS),
 * opens both on a `split` pool, checks every byte, writes its own marks through them
 * and closes them. The parent then sees the child's marks in its own blocks. The same
 * process also opens its own export (the descriptors fetched with pidfd_getfd), and bad
 * input gets a clear status.
 *
 * usage: test_ipc UPSTREAM (host in CI: memfd-backed granules; device on a GPU: real
 * cuMemExportToShareableHandle / cuMemImportFromShareableHandle). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#include "check.h"
#include "gpupool_share.h"

#define MIB ((size_t)1 << 20)
#define BIG (5 * MIB + 12345)
#define SMALL ((size_t)100000)
#define MAX_FDS 64
static const int dev = 0;
static int on_gpu = 0;

/* Device memory is read and written through the driver (no CUDA headers needed). */
typedef int (*cu_fn)();
static cu_fn cu_htod, cu_dtoh;

static void driver_setup(void) {
  void *cuda = dlopen("libcuda.so.1", RTLD_NOW);
  if (!cuda) {
    printf("SKIPPED: no libcuda: %s\n", dlerror());
    exit(77);
  }
  int (*init)(unsigned) = (int (*)(unsigned))dlsym(cuda, "cuInit");
  int (*get)(int *, int) = (int (*)(int *, int))dlsym(cuda, "cuDeviceGet");
  int (*retain)(void **, int) = (int (*)(void **, int))dlsym(cuda, "cuDevicePrimaryCtxRetain");
  int (*set)(void *) = (int (*)(void *))dlsym(cuda, "cuCtxSetCurrent");
  cu_htod = (cu_fn)dlsym(cuda, "cuMemcpyHtoD_v2");
  cu_dtoh = (cu_fn)dlsym(cuda, "cuMemcpyDtoH_v2");
  int d = 0;
  void *ctx = NULL;
  if (!init || !get || !retain || !set || !cu_htod || !cu_dtoh || init(0) || get(&d, dev) || retain(&ctx, d) || set(ctx)) {
    fprintf(stderr, "FAIL: CUDA driver setup\n");
    exit(1);
  }
}

static void put(void *dst, const unsigned char *src, size_t n) {
  if (!on_gpu) {
    memcpy(dst, src, n);
    return;
  }
  int r = ((int (*)(unsigned long long, const void *, size_t))cu_htod)((unsigned long long)(uintptr_t)dst, src, n);
  CHECK(r == 0, "cuMemcpyHtoD: %d", r);
}

static void get(unsigned char *dst, const void *src, size_t n) {
  if (!on_gpu) {
    memcpy(dst, src, n);
    return;
  }
  int r = ((int (*)(void *, unsigned long long, size_t))cu_dtoh)(dst, (unsigned long long)(uintptr_t)src, n);
  CHECK(r == 0, "cuMemcpyDtoH: %d", r);
}

static unsigned char pattern(size_t i, int which) { return (unsigned char)(i * 7 + 1 + which * 31); }

static void fill(void *p, size_t n, int which) {
  unsigned char *h = malloc(n);
  for (size_t i = 0; i < n; i++) h[i] = pattern(i, which);
  put(p, h, n);
  free(h);
}

/* Whether `p` holds the pattern, with `marks` bytes of 0xAB at its start and end. */
static int holds(const void *p, size_t n, int which, size_t marks) {
  unsigned char *h = malloc(n);
  get(h, p, n);
  size_t bad = 0;
  for (size_t i = 0; i < n; i++) {
    int marked = i < marks || i >= n - marks;
    if (h[i] != (marked ? 0xAB : pattern(i, which))) bad++;
  }
  free(h);
  if (bad) fprintf(stderr, "  %zu of %zu bytes differ\n", bad, n);
  return bad == 0;
}

static void mark(void *p, size_t n, size_t marks) {
  unsigned char m[64];
  memset(m, 0xAB, sizeof m);
  put(p, m, marks);
  put((char *)p + n - marks, m, marks);
}

/* Control-message space for MAX_FDS descriptors, aligned as a cmsghdr must be. */
typedef union {
  char buf[CMSG_SPACE(MAX_FDS * sizeof(int))];
  struct cmsghdr align;
} control_buf;

/* One message: the descriptor's bytes, with its file descriptors as SCM_RIGHTS (at most
 * MAX_FDS here; the kernel's own limit is 253 per message). */
static int send_desc(int sock, const unsigned char *desc, size_t len) {
  int fds[MAX_FDS];
  size_t n = 0;
  CHECK_STATUS(gpupool_ipc_descriptor_fds(desc, len, NULL, 0, &n), GPUPOOL_STATUS_OK);
  if (n == 0 || n > MAX_FDS) return -1;
  CHECK_STATUS(gpupool_ipc_descriptor_fds(desc, len, fds, MAX_FDS, &n), GPUPOOL_STATUS_OK);
  control_buf control;
  memset(&control, 0, sizeof control);
  struct iovec iov = {(void *)desc, len};
  struct msghdr msg = {0};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control.buf;
  msg.msg_controllen = CMSG_SPACE(n * sizeof(int));
  struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(n * sizeof(int));
  memcpy(CMSG_DATA(c), fds, n * sizeof(int));
  return sendmsg(sock, &msg, 0) == (ssize_t)len ? 0 : -1;
}

static size_t recv_desc(int sock, unsigned char *desc, size_t cap, int *fds, size_t *n_fds) {
  control_buf control;
  struct iovec iov = {desc, cap};
  struct msghdr msg = {0};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control.buf;
  msg.msg_controllen = sizeof control.buf;
  ssize_t got = recvmsg(sock, &msg, 0);
  *n_fds = 0;
  CHECK(got > 0 && !(msg.msg_flags & (MSG_CTRUNC | MSG_TRUNC)), "a whole message: %zd bytes, flags %#x", got, msg.msg_flags);
  for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
      *n_fds = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      memcpy(fds, CMSG_DATA(c), *n_fds * sizeof(int));
    }
  }
  return got > 0 ? (size_t)got : 0;
}

/* The second process: open what the parent sent, check it, mark it, close it. */
static int child(int sock) {
  /* A different strategy here: opening needs no arena, only the device. */
  CHECK_STATUS(gpupool_configure(dev, "split", on_gpu ? "device" : "host"), GPUPOOL_STATUS_OK);
  const size_t sizes[2] = {BIG, SMALL};
  for (int which = 0; which < 2; which++) {
    unsigned char desc[4096];
    int fds[MAX_FDS];
    size_t n_fds = 0;
    size_t len = recv_desc(sock, desc, sizeof desc, fds, &n_fds);
    CHECK(len > 0 && n_fds > 0, "received %zu bytes and %zu descriptors", len, n_fds);
    void *p = NULL;
    CHECK_STATUS(gpupool_ipc_open(desc, len, dev, fds, n_fds, &p), GPUPOOL_STATUS_OK);
    CHECK(p != NULL && holds(p, sizes[which], which, 0), "the child reads block %d as the parent wrote it", which);
    mark(p, sizes[which], 64);
    /* The exporter's descriptors fetched by pid: allowed where this process may ptrace
     * the parent (same user, no stricter ptrace policy); else the error must say why. */
    void *q = NULL;
    gpupool_status st = gpupool_ipc_open(desc, len, dev, NULL, 0, &q);
    if (st == GPUPOOL_STATUS_OK) {
      CHECK(q != p && holds(q, sizes[which], which, 64), "a second mapping by pid shows the same bytes");
      CHECK_STATUS(gpupool_ipc_close(q, dev), GPUPOOL_STATUS_OK);
    } else {
      CHECK(strstr(last_error(), "pidfd") != NULL, "open by pid failed without saying why: %s", last_error());
      printf("child: opening by pid is not allowed here: %s\n", last_error());
    }
    /* Only the address open returned closes it; while it is open the (otherwise idle)
     * pool cannot be replaced, since that would forget the mapping. */
    CHECK_STATUS(gpupool_ipc_close((char *)p + 1, dev), GPUPOOL_STATUS_INVALID_POINTER);
    CHECK_STATUS(gpupool_configure(dev, "split", on_gpu ? "device" : "host"), GPUPOOL_STATUS_BUSY);
    CHECK_STATUS(gpupool_ipc_close(p, dev), GPUPOOL_STATUS_OK);
    CHECK_STATUS(gpupool_configure(dev, "split", on_gpu ? "device" : "host"), GPUPOOL_STATUS_OK);
    for (size_t i = 0; i < n_fds; i++) close(fds[i]);
  }
  char done = 'd';
  CHECK(write(sock, &done, 1) == 1, "reporting back");
  return check_end("ipc child");
}

int main(int argc, char **argv) {
  const char *up = argc > 1 ? argv[1] : "host";
  on_gpu = strcmp(up, "host") != 0;
  if (argc > 3 && strcmp(argv[2], "child") == 0) {
    if (on_gpu) driver_setup();
    return child(atoi(argv[3]));
  }
  gpupool_status st = gpupool_configure(dev, "arena", up);
  if (st == GPUPOOL_STATUS_NO_DRIVER) {
    printf("SKIPPED: %s upstream needs a CUDA driver: %s\n", up, last_error());
    return 77;
  }
  CHECK_STATUS(st, GPUPOOL_STATUS_OK);
  if (on_gpu) driver_setup();

  void *blocks[2] = {NULL, NULL}, *before = NULL;
  const size_t sizes[2] = {BIG, SMALL};
  /* A small block first, so the small block to export starts inside its granule. */
  CHECK_STATUS(gpupool_malloc(&before, 3000, dev, NULL), GPUPOOL_STATUS_OK);
  for (int w = 0; w < 2; w++) {
    CHECK_STATUS(gpupool_malloc(&blocks[w], sizes[w], dev, NULL), GPUPOOL_STATUS_OK);
    fill(blocks[w], sizes[w], w);
  }

  /* Bad input. */
  size_t len = 0;
  unsigned char desc[2][4096];
  size_t desc_len[2];
  CHECK_STATUS(gpupool_ipc_export(NULL, desc[0], sizeof desc[0], &len), GPUPOOL_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(gpupool_ipc_export((char *)blocks[0] + 256, desc[0], sizeof desc[0], &len), GPUPOOL_STATUS_INVALID_POINTER);
  CHECK_STATUS(gpupool_ipc_export(blocks[0], NULL, 0, &len), GPUPOOL_STATUS_OK);
  CHECK(len > 0 && len < sizeof desc[0], "descriptor length %zu", len);
  CHECK_STATUS(gpupool_ipc_export(blocks[0], desc[0], len - 1, &len), GPUPOOL_STATUS_INVALID_ARGUMENT);
  void *p = NULL;
  unsigned char junk[200] = {1, 2, 3};
  CHECK_STATUS(gpupool_ipc_open(junk, sizeof junk, dev, NULL, 0, &p), GPUPOOL_STATUS_INVALID_ARGUMENT);
  CHECK(p == NULL, "a failed open leaves *out_ptr NULL");
  CHECK_STATUS(gpupool_ipc_close(blocks[0], dev), GPUPOOL_STATUS_INVALID_POINTER);
  int on_stack = 0;
  CHECK_STATUS(gpupool_ipc_export(&on_stack, desc[0], sizeof desc[0], &len), GPUPOOL_STATUS_INVALID_POINTER);
  CHECK(strstr(last_error(), "IPC export") != NULL, "the error names the call: %s", last_error());
  /* A block freed into this thread's cache is refused (freed, not live), and stays the
   * cache's: the next allocation of its size gets it back. */
  void *cached = NULL, *again = NULL;
  CHECK_STATUS(gpupool_malloc(&cached, 4096, dev, NULL), GPUPOOL_STATUS_OK);
  CHECK_STATUS(gpupool_free(cached, dev, NULL), GPUPOOL_STATUS_OK);
  CHECK_STATUS(gpupool_ipc_export(cached, desc[0], sizeof desc[0], &len), GPUPOOL_STATUS_INVALID_POINTER);
  CHECK_STATUS(gpupool_malloc(&again, 4096, dev, NULL), GPUPOOL_STATUS_OK);
  CHECK(again == cached, "the refused block is reused: %p, then %p", cached, again);
  CHECK_STATUS(gpupool_free(again, dev, NULL), GPUPOOL_STATUS_OK);
  /* A length no descriptor has is refused before its bytes are read. */
  CHECK_STATUS(gpupool_ipc_open(junk, SIZE_MAX, dev, NULL, 0, &p), GPUPOOL_STATUS_INVALID_ARGUMENT);
  CHECK_STATUS(gpupool_ipc_descriptor_fds(junk, SIZE_MAX, NULL, 0, &len), GPUPOOL_STATUS_INVALID_ARGUMENT);

  /* The small block shares its granule with `before`: the importer would map that block
   * too, so the export is refused, saying why; with `before` freed it goes through, and
   * nothing allocated later lands in the exported block's granule. */
  CHECK_STATUS(gpupool_ipc_export(blocks[1], desc[1], sizeof desc[1], &len), GPUPOOL_STATUS_INVALID_POINTER);
  CHECK(strstr(last_error(), "shares its") != NULL && strstr(last_error(), "granule") != NULL,
        "the refusal names the shared granule: %s", last_error());
  CHECK_STATUS(gpupool_free(before, dev, NULL), GPUPOOL_STATUS_OK);
  before = NULL;
  for (int w = 0; w < 2; w++) {
    CHECK_STATUS(gpupool_ipc_export(blocks[w], desc[w], sizeof desc[w], &desc_len[w]), GPUPOOL_STATUS_OK);
  }
  {
    const uintptr_t g = (uintptr_t)2 * MIB, lo = (uintptr_t)blocks[1] & ~(g - 1);
    const uintptr_t hi = ((uintptr_t)blocks[1] + SMALL + g - 1) & ~(g - 1);
    void *after[8];
    for (int i = 0; i < 8; i++) {
      CHECK_STATUS(gpupool_malloc(&after[i], 3000, dev, NULL), GPUPOOL_STATUS_OK);
      CHECK((uintptr_t)after[i] + 3000 <= lo || (uintptr_t)after[i] >= hi,
            "a later block (%p) lands in the exported block's granule [%#lx, %#lx)", after[i], (unsigned long)lo, (unsigned long)hi);
    }
    for (int i = 0; i < 8; i++) CHECK_STATUS(gpupool_free(after[i], dev, NULL), GPUPOOL_STATUS_OK);
  }
  int fds[MAX_FDS];
  size_t n_fds = 0;
  CHECK_STATUS(gpupool_ipc_descriptor_fds(desc[0], desc_len[0], NULL, 0, &n_fds), GPUPOOL_STATUS_OK);
  CHECK(n_fds >= 3, "a block of 5 MiB spans %zu granules", n_fds);
  CHECK_STATUS(gpupool_ipc_descriptor_fds(desc[0], desc_len[0], fds, 1, &n_fds), GPUPOOL_STATUS_INVALID_ARGUMENT);
  CHECK_STATUS(gpupool_ipc_descriptor_fds(desc[0], desc_len[0], fds, MAX_FDS, &n_fds), GPUPOOL_STATUS_OK);
  /* This process's own numbers name the exported files here too. The list with each
   * number once, in the order of its first appearance, opens as the per-granule list
   * does; a list of neither length is refused. */
  int uniq[MAX_FDS];
  size_t n_uniq = 0;
  for (size_t i = 0; i < n_fds; i++) {
    int seen = 0;
    for (size_t j = 0; j < n_uniq; j++) seen |= uniq[j] == fds[i];
    if (!seen) uniq[n_uniq++] = fds[i];
  }
  for (int compact = 0; compact < 2; compact++) {
    CHECK_STATUS(gpupool_ipc_open(desc[0], desc_len[0], dev, compact ? uniq : fds, compact ? n_uniq : n_fds, &p), GPUPOOL_STATUS_OK);
    CHECK(p != blocks[0] && holds(p, BIG, 0, 0), "the block opened through %s list", compact ? "the compact" : "the per-granule");
    CHECK_STATUS(gpupool_ipc_close(p, dev), GPUPOOL_STATUS_OK);
  }
  CHECK_STATUS(gpupool_ipc_open(desc[0], desc_len[0], dev, fds, n_fds + 1, &p), GPUPOOL_STATUS_INVALID_ARGUMENT);
  if (n_uniq + 1 < n_fds) CHECK_STATUS(gpupool_ipc_open(desc[0], desc_len[0], dev, fds, n_uniq + 1, &p), GPUPOOL_STATUS_INVALID_ARGUMENT);
  else CHECK_STATUS(gpupool_ipc_open(desc[0], desc_len[0], dev, fds, n_fds - 1, &p), GPUPOOL_STATUS_INVALID_ARGUMENT);
  /* A damaged descriptor whose offset + size wraps past 2^64 is refused, not mapped. */
  unsigned char wrapped[4096];
  memcpy(wrapped, desc[0], desc_len[0]);
  uint64_t huge = UINT64_MAX - 100;
  memcpy(wrapped + 40, &huge, sizeof huge); /* the size field */
  CHECK_STATUS(gpupool_ipc_open(wrapped, desc_len[0], dev, NULL, 0, &p), GPUPOOL_STATUS_INVALID_ARGUMENT);
  /* A forged descriptor (granule 0's file device changed: bytes 112..120) names a file
   * nobody exported as that granule: refused, fetched (its granules no longer match the
   * digest the exporter recorded under its token) or passed in (the file is not it). */
  unsigned char forged[4096];
  memcpy(forged, desc[0], desc_len[0]);
  forged[112] ^= 0x5a;
  CHECK_STATUS(gpupool_ipc_open(forged, desc_len[0], dev, NULL, 0, &p), GPUPOOL_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(last_error(), "forged or altered") != NULL || strstr(last_error(), "pidfd") != NULL, "forged: %s", last_error());
  CHECK(p == NULL, "a refused open leaves *out_ptr NULL");
  /* A descriptor naming an exporter that started at another time (a reused pid). */
  memcpy(forged, desc[0], desc_len[0]);
  forged[56] ^= 0x01;
  CHECK_STATUS(gpupool_ipc_open(forged, desc_len[0], dev, NULL, 0, &p), GPUPOOL_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(last_error(), "not the exporter") != NULL || strstr(last_error(), "pidfd") != NULL, "reused pid: %s", last_error());
  /* A token the exporter never recorded (bytes 72..80). */
  memcpy(forged, desc[0], desc_len[0]);
  forged[72] ^= 0x01;
  CHECK_STATUS(gpupool_ipc_open(forged, desc_len[0], dev, NULL, 0, &p), GPUPOOL_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(last_error(), "no longer exports") != NULL || strstr(last_error(), "pidfd") != NULL, "forged token: %s", last_error());

  /* A block of more granules than one SCM_RIGHTS message carries (253), opened by pid:
   * its descriptors are fetched one at a time. */
  void *large = NULL;
  const size_t large_size = 600 * MIB;
  CHECK_STATUS(gpupool_malloc(&large, large_size, dev, NULL), GPUPOOL_STATUS_OK);
  put((char *)large + large_size - 3, (const unsigned char *)"end", 3);
  size_t large_len = 0;
  CHECK_STATUS(gpupool_ipc_export(large, NULL, 0, &large_len), GPUPOOL_STATUS_OK);
  unsigned char *large_desc = malloc(large_len);
  CHECK_STATUS(gpupool_ipc_export(large, large_desc, large_len, &large_len), GPUPOOL_STATUS_OK);
  size_t large_fds = 0;
  CHECK_STATUS(gpupool_ipc_descriptor_fds(large_desc, large_len, NULL, 0, &large_fds), GPUPOOL_STATUS_OK);
  CHECK(large_fds > 253, "600 MiB spans %zu granules", large_fds);
  st = gpupool_ipc_open(large_desc, large_len, dev, NULL, 0, &p);
  CHECK(st == GPUPOOL_STATUS_OK || strstr(last_error(), "pidfd"), "open of the large block by pid: %s", last_error());
  if (st == GPUPOOL_STATUS_OK) {
    unsigned char end[3] = {0};
    get(end, (char *)p + large_size - 3, 3);
    CHECK(memcmp(end, "end", 3) == 0, "the large block's last bytes through the second mapping");
    CHECK_STATUS(gpupool_ipc_close(p, dev), GPUPOOL_STATUS_OK);
  }
  free(large_desc);
  CHECK_STATUS(gpupool_free(large, dev, NULL), GPUPOOL_STATUS_OK);

  /* This process opens its own export: a second address, the same bytes. */
  st = gpupool_ipc_open(desc[1], desc_len[1], dev, NULL, 0, &p);
  CHECK(st == GPUPOOL_STATUS_OK || strstr(last_error(), "pidfd"), "open by own pid: %s", last_error());
  if (st == GPUPOOL_STATUS_OK) {
    CHECK(p != blocks[1] && holds(p, SMALL, 1, 0), "the second mapping shows the block");
    CHECK_STATUS(gpupool_ipc_close(p, dev), GPUPOOL_STATUS_OK);
    CHECK_STATUS(gpupool_ipc_close(p, dev), GPUPOOL_STATUS_INVALID_POINTER);
  }

  /* Another process. */
  int sv[2];
  CHECK(socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sv) == 0, "socketpair");
  pid_t pid = fork();
  if (pid == 0) {
    close(sv[0]);
    char fd_arg[16];
    snprintf(fd_arg, sizeof fd_arg, "%d", sv[1]);
    /* argv[0], not /proc/self/exe: under valgrind the latter is valgrind's own tool. */
    char *args[] = {argv[0], (char *)up, "child", fd_arg, NULL};
    execvp(argv[0], args);
    _exit(127);
  }
  close(sv[1]);
  for (int w = 0; w < 2; w++) CHECK(send_desc(sv[0], desc[w], desc_len[w]) == 0, "sending descriptor %d", w);
  char done = 0;
  CHECK(read(sv[0], &done, 1) == 1 && done == 'd', "the child finished its checks");
  int status = 0;
  waitpid(pid, &status, 0);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "child exit status %d", status);
  for (int w = 0; w < 2; w++) CHECK(holds(blocks[w], sizes[w], w, 64), "the parent sees the child's marks in block %d", w);

  /* Still an ordinary pool: free, and an export of a freed block is refused. A descriptor
   * of a freed block is stale: its export ended with the block, so it is not fetched from
   * (its memory may serve another block now). */
  for (int w = 0; w < 2; w++) CHECK_STATUS(gpupool_free(blocks[w], dev, NULL), GPUPOOL_STATUS_OK);
  st = gpupool_ipc_open(desc[1], desc_len[1], dev, NULL, 0, &p);
  CHECK(st == GPUPOOL_STATUS_INVALID_ARGUMENT && (strstr(last_error(), "no longer exports") || strstr(last_error(), "pidfd")),
        "a freed block's descriptor: status %d, %s", (int)st, last_error());
  CHECK_STATUS(gpupool_ipc_export(blocks[0], desc[0], sizeof desc[0], &len), GPUPOOL_STATUS_INVALID_POINTER);
  CHECK(strstr(last_error(), "double free") == NULL, "an export is not a free: %s", last_error());
  printf("ipc on %s: %zu granules per 5 MiB block, child checked both blocks\n", up, n_fds);
  return check_end("ipc");
}
