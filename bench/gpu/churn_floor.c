/* Benchmark anchor for the `churn` workload, not a pool: the frameworks' own cost of a
 * plug-in allocation when the allocator itself costs next to nothing.
 *
 * bench/frameworks' floor_* plug-in returns one buffer for every request, which PyTorch's
 * CUDAPluggableAllocator rejects as soon as two allocations are live (it keys its metadata
 * by pointer), so `churn` had no floor. This one hands out distinct addresses: up to 4096
 * live allocations of at most 64 MiB, each a slot of a virtual range reserved with
 * cuMemAddressReserve and never backed by memory. A slot is a free-list pop and push.
 * Valid only for workloads that never touch the memory, as churn.py (torch.empty /
 * cupy.empty of uint8 launch no kernel). Single-threaded, like churn.py.
 *
 * Build: gcc -O2 -shared -fPIC -I/usr/local/cuda/include churn_floor.c -L/usr/local/cuda/lib64 -lcuda -o churn_floor.so
 */
#include <cuda.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#define SLOTS 4096
#define SLOT_BYTES (64ull << 20)

static CUdeviceptr base;
static int free_slots[SLOTS];
static int n_free = -1; /* -1: not set up yet */

static int setup(void) {
  if (cuMemAddressReserve(&base, (size_t)SLOTS * SLOT_BYTES, 0, 0, 0) != CUDA_SUCCESS) return 0;
  for (int i = 0; i < SLOTS; i++) free_slots[i] = SLOTS - 1 - i;
  n_free = SLOTS;
  return 1;
}

void *cf_malloc(ssize_t size, int device, void *stream) {
  (void)device; (void)stream;
  if (n_free < 0 && !setup()) return NULL;
  if (size < 0 || (size_t)size > SLOT_BYTES || n_free == 0) return NULL;
  return (void *)(uintptr_t)(base + (CUdeviceptr)free_slots[--n_free] * SLOT_BYTES);
}

void cf_free(void *ptr, size_t size, int device, void *stream) {
  (void)size; (void)device; (void)stream;
  free_slots[n_free++] = (int)(((uintptr_t)ptr - base) / SLOT_BYTES);
}

intptr_t cf_cupy_malloc(intptr_t param, size_t size, int device) {
  (void)param;
  return (intptr_t)cf_malloc((ssize_t)size, device, NULL);
}

void cf_cupy_free(intptr_t param, intptr_t ptr, int device) {
  (void)param;
  cf_free((void *)ptr, 0, device, NULL);
}
