"""share_check.py's producer layout under gpupool (GPU): each tensor's storage exported as the
torch route exports it (granules shared), and what a consumer maps for it: allocations per
descriptor, imports and allocations imported under the consumer's span rule (a block whose
allocations lie in a span already mapped reuses it; every block is held), the unique
allocations among them, and the address space. Session 25, issue #35.
    python3 spans.py [--tensors 1000]"""
import argparse, collections, math, random, struct, sys, os
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "../../../../scripts"))
import gpupool.torch
gpupool.torch.install()
import torch
from gpupool import share
import share_check

ap = argparse.ArgumentParser()
ap.add_argument("--tensors", type=int, default=1000)
a = ap.parse_args()
dev = torch.device("cuda", 0)
spec = share_check.items(a.tensors, 1, 64 << 20)
tensors = [share_check.pattern(i, e, dt, dev) for i, (dt, e, _) in enumerate(spec)]
torch.cuda.synchronize()


def decode(b):
    g, off, size, count = struct.unpack_from("<QQQQ", b, 24)
    origin = struct.unpack_from("<Q", b, 80)[0]
    ents = [struct.unpack_from("<QQQQ", b, 88 + 32 * k) for k in range(count)]
    allocs = []  # (producer address, granules): runs of one descriptor from offset 0
    for k, (fd, o, dev_, ino) in enumerate(ents):
        if allocs and o != 0 and allocs[-1][2] == fd:
            allocs[-1][1] += 1
        else:
            allocs.append([origin + k * g, 1, fd])
    return g, origin, count, [(p, n) for p, n, _ in allocs]


descs = [decode(share._export_bytes(t.untyped_storage().data_ptr())) for t in tensors]
g = descs[0][0]
spans, imports, allocs, va = [], 0, 0, 0
for _, origin, count, al in descs:
    end = origin + count * g
    if any(o <= origin and end <= e for o, e in spans):
        continue
    spans.append((origin, end)); imports += 1; allocs += len(al); va += count * g
uniq = {x for d in descs for x in d[3]}
sizes = collections.Counter(n for _, n in uniq)
print(f"{a.tensors} tensors: {len(uniq)} unique allocations ({sum(n * g for _, n in uniq) / 1e9:.2f} GB; granules per allocation: "
      f"{sorted(sizes.items())}); the span rule: {imports} imports, {allocs} allocations imported, {va / 1e9:.2f} GB of address space")
s = gpupool.stats_json(0)
print({k: s["arena"][k] for k in ("granules_mapped", "mapped_bytes")}, s["driver_calls"]["mem_create"], "cuMemCreate")
