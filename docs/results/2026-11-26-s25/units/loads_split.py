"""share_check.py with the receiver's rebuild of each tensor timed in parts (perf_counter,
no profiler): where the unpickling time of gpupool's torch route goes. Session 25, #35.
    python3 loads_split.py --allocator arena --tensors 1000
The consumer prints one line at exit: ms per part, summed over the run."""
import atexit, os, sys, time
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../../../scripts"))
import share_check

T = {}


def _add(k, t0):
    t = time.perf_counter()
    T[k] = T.get(k, 0.0) + (t - t0)
    return t


def _instrument():
    import torch
    import gpupool.torch as gt
    from gpupool import share
    from torch.multiprocessing.reductions import StorageWeakRef

    def storage_here(info):
        t = time.perf_counter()
        sent, nbytes, device, event = info
        key = (sent.producer, sent.ptr, device)
        received = share.Received(sent)
        t = _add("received (descriptors lent)", t)
        ref = gt._opened.get(key)
        storage = None if ref is None or ref.expired() else torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
        t = _add("cache lookup", t)
        if storage is not None:
            gt._wait_event(device, event)
            received.let_go()
            _add("cached: wait + let go", t)
            return storage
        managed = received.open_dlpack(device)
        t = _add("open_dlpack (C: import, map; Python wrapper)", t)
        storage = torch.from_dlpack(share.capsule(managed)).untyped_storage()
        t = _add("from_dlpack + untyped_storage", t)
        gt._opened[key] = StorageWeakRef(storage)
        t = _add("weak reference", t)
        gt._wait_event(device, event)
        _add("event wait", t)
        return storage

    def rebuild_tensor(cls, info, dtype, offset, size, stride, requires_grad):
        t0 = time.perf_counter()
        storage = storage_here(info)
        t = time.perf_counter()
        x = torch.empty((0,), dtype=dtype, device=storage.device).set_(storage, offset, size, stride)
        x.requires_grad = requires_grad
        _add("tensor over the storage (empty + set_)", t)
        _add("rebuild, whole", t0)
        return x

    # The unpickler finds the rebuild function by module and name when it loads.
    gt._storage_here = storage_here
    gt._rebuild_tensor = rebuild_tensor

    def report():
        if T:
            print("loads split (ms): " + "; ".join(f"{k} {v * 1e3:.1f}" for k, v in T.items()), file=sys.stderr, flush=True)
    atexit.register(report)


if __name__ == "__main__":
    share_check.main()
else:
    # Spawned children import this file as __mp_main__: the consumer instruments itself.
    _instrument()
