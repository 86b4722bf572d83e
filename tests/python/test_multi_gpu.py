"""Two GPUs through gpupool (skipped with fewer than two): peer copies and a torchrun DDP job
with NCCL, on the split pool and on the arena. The arena's mappings grant a peer access once
it is enabled (Note [Peer access on demand]: PyTorch's copies enable it through the
allocator class's hook); without that grant a copy kernel or an NCCL kernel on the other
device faults on arena memory, which these tests would catch."""
import os
import subprocess
import sys

import pytest

from conftest import ROOT, _lib, INSTALLED, need, ok, run_py

POOLS = ["split", "arena"]


def _gpu_count():
    p = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                       capture_output=True, text=True, timeout=120)
    return int(p.stdout.strip() or 0) if p.returncode == 0 else 0


@pytest.fixture
def two_gpus():
    need("torch")
    n = _gpu_count()
    if n < 2:
        pytest.skip(f"needs two GPUs, this machine has {n}")


@pytest.mark.parametrize("pool", POOLS)
def test_peer_copies_both_ways_keep_the_data(two_gpus, pool):
    code = """
    import torch, gpupool
    gpupool.torch.install()
    torch.manual_seed(0)
    for n in (1, 1000, 3 << 20, 40 << 20):   # small blocks, large ones, several granules
        a = torch.randn(n, device="cuda:0")
        b = a.to("cuda:1")                      # device 1 reads device 0's pool memory
        c = (b * 2).to("cuda:0")                # and back
        torch.cuda.synchronize(0); torch.cuda.synchronize(1)
        assert torch.equal(c, a * 2), n
        # A kernel on device 1 writing into device 0's memory (peer access where the link allows).
        d = torch.empty(n, device="cuda:0")
        with torch.cuda.device(1):
            d.copy_(b)
        torch.cuda.synchronize(0); torch.cuda.synchronize(1)
        assert torch.equal(d, a), n
    for dev in (0, 1):
        s = gpupool.stats_json(dev)
        s = s[0] if isinstance(s, list) else s
        print("POOL", dev, s["strategy"], s["n_allocs"], s["driver_calls"]["peer_grants"])
    """
    out = ok(run_py(code, env={"GPUPOOL_POOL": pool}))
    pools = [l.split() for l in out.splitlines() if l.startswith("POOL")]
    assert len(pools) == 2, out
    for _, dev, strategy, n_allocs, peer_grants in pools:
        assert strategy == pool, out          # the arena did not fall back to split
        assert int(n_allocs) > 0, out          # gpupool served both devices
        if pool == "arena":
            assert int(peer_grants) > 0, out  # the copies enabled the peer, which was granted


DDP = """
import os, torch, torch.distributed as dist
if os.environ.get("USE_GPUPOOL") == "1":
    import gpupool
    gpupool.torch.install()
rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl")
torch.manual_seed(0)
torch.use_deterministic_algorithms(True)
model = torch.nn.Sequential(torch.nn.Linear(256, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048),
                            torch.nn.ReLU(), torch.nn.Linear(2048, 256)).cuda()
ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank], bucket_cap_mb=4)
opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)
g = torch.Generator(device="cuda").manual_seed(100 + rank)
losses = []
for step in range(25):
    x = torch.randn(16 * (1 + step % 4), 256, device="cuda", generator=g)   # varying batch
    loss = ddp(x).pow(2).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    losses.append(loss.item())
flat = torch.cat([p.detach().flatten() for p in model.parameters()])
both = [torch.empty_like(flat) for _ in range(2)]
dist.all_gather(both, flat)
assert torch.equal(both[0], both[1]), "ranks disagree after all-reduce"
line = "RANK %d LOSSES %r SUM %r" % (rank, losses, flat.double().sum().item())
if os.environ.get("USE_GPUPOOL") == "1":
    s = gpupool.stats_json(rank)
    s = s[0] if isinstance(s, list) else s
    line += " POOL %s %d" % (s["strategy"], s["n_allocs"])
print(line, flush=True)
dist.barrier()
dist.destroy_process_group()
"""


def _two_ranks(tmp_path, name, text, env):
    """Run the script `text` as two ranks under torchrun; returns their output."""
    script = tmp_path / name
    script.write_text(text)
    e = dict(os.environ)
    if not INSTALLED:
        e["PYTHONPATH"] = str(ROOT / "python") + os.pathsep + e.get("PYTHONPATH", "")
        e["GPUPOOL_LIBRARY"] = _lib()
    e.update({"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "PYTHONUNBUFFERED": "1"}, **env)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        str(script)], env=e, capture_output=True, text=True, timeout=600)
    return ok(p)


def _torchrun(tmp_path, env):
    out = _two_ranks(tmp_path, "ddp.py", DDP, env)
    ranks = sorted(l[l.index("RANK"):] for l in out.splitlines() if "RANK" in l and "LOSSES" in l)
    assert len(ranks) == 2, out
    return ranks


@pytest.mark.parametrize("pool", POOLS)
def test_ddp_over_nccl_on_two_gpus_matches_the_native_allocator(two_gpus, tmp_path, pool):
    native = _torchrun(tmp_path, {"USE_GPUPOOL": "0"})
    pooled = _torchrun(tmp_path, {"USE_GPUPOOL": "1", "GPUPOOL_POOL": pool})
    for n, p in zip(native, pooled):
        head, pool_part = p.split(" POOL ")
        assert head == n                       # same losses and parameters, rank by rank
        strategy, n_allocs = pool_part.split()
        assert strategy == pool and int(n_allocs) > 0, p


PAUSE_NCCL = """
import os, torch, torch.distributed as dist
import gpupool
gpupool.torch.install()
rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl")
with gpupool.tag("weights"):
    w = torch.full((16 << 20,), float(rank + 1), device="cuda")
dist.all_reduce(w)                                  # the communicator is made and used
torch.cuda.synchronize()
before = w.clone()
for _ in range(3):
    assert gpupool.pause("weights") > 0
    gpupool.resume("weights")
    assert torch.equal(w, before), "weights changed across the pause"
    dist.all_reduce(w)                              # the same communicator, the same buffer
    torch.cuda.synchronize()
    before = before * 2
    assert torch.equal(w, before), "all-reduce after resume"
print("RANK %d PAUSED OK" % rank, flush=True)
dist.barrier()
dist.destroy_process_group()
"""


def test_nccl_communicators_work_after_a_tag_pauses_and_resumes(two_gpus, tmp_path):
    out = _two_ranks(tmp_path, "pause_nccl.py", PAUSE_NCCL, {})
    assert sum("PAUSED OK" in l for l in out.splitlines()) == 2, out
