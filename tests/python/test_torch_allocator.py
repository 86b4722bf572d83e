"""gpupool's PyTorch allocator class: PyTorch's whole allocator interface through gpupool, and
real programs that call it (GPU; skipped without torch or a GPU). The plug-in route's answers
to the memory API are checked on the host upstream, without torch."""
import json

import pytest
from conftest import TORCH_ALLOCATOR, ok, run_py, run_script

POOLS = ["split", "binned", "none", "arena"]   # every strategy

INSTALL = TORCH_ALLOCATOR


def test_memory_stats_of_the_plugin_route_follow_the_pool_on_host(library):
    # Where the class cannot be built, PyTorch's memory_stats() family is answered from the
    # pool's statistics: PyTorch's nested shape, the pool's figures, peaks that reset.
    ok(run_py("""
        import ctypes, gpupool
        from gpupool.torch import memory_stats_nested
        L = gpupool.lib()
        ptrs = []
        for n in (1000, 3 << 20, 40 << 20):
            p = ctypes.c_void_p()
            assert L.gpupool_malloc(ctypes.byref(p), n, 0, None) == 0
            ptrs.append(p)
        s = gpupool.stats(0)
        nested = memory_stats_nested(s)
        want = {"allocation", "segment", "active", "inactive_split", "allocated_bytes", "reserved_bytes",
                "active_bytes", "inactive_split_bytes", "requested_bytes", "num_alloc_retries", "num_ooms",
                "oversize_allocations", "oversize_segments", "num_sync_all_streams", "num_device_alloc",
                "num_device_free", "max_split_size"}
        assert set(nested) == want, set(nested) ^ want
        for k in ("allocation", "allocated_bytes", "reserved_bytes", "requested_bytes"):
            assert set(nested[k]) == {"all", "small_pool", "large_pool"}, nested[k]
            assert set(nested[k]["all"]) == {"current", "peak", "allocated", "freed"}, nested[k]
        assert nested["allocated_bytes"]["all"]["current"] == s["used_bytes"] > 43 << 20, (nested, s)
        assert nested["reserved_bytes"]["all"]["current"] == s["total_bytes"] >= s["used_bytes"], s
        assert nested["requested_bytes"]["all"]["current"] == 1000 + (43 << 20), nested["requested_bytes"]
        assert nested["allocation"]["all"]["current"] == 3, nested["allocation"]
        for p in ptrs[1:]:
            assert L.gpupool_free(p, 0, None) == 0
        high = gpupool.stats(0)
        assert high["peak_used_bytes"] > high["used_bytes"], high
        gpupool.reset_peak_stats(0)
        low = gpupool.stats(0)
        assert low["peak_used_bytes"] == low["used_bytes"] and low["peak_total_bytes"] == low["total_bytes"], low
        assert low["peak_requested_bytes"] == low["requested_bytes"] == 1000, low
        after = memory_stats_nested(low, base=s)
        assert after["allocation"]["all"]["freed"] == 2 and after["allocation"]["all"]["allocated"] == 0, after
        print("ok")
    """, env={"GPUPOOL_UPSTREAM": "host"}))


# PyTorch's keys of memory_stats(), from a process on PyTorch's own allocator.
NATIVE_KEYS = """
import json, torch
torch.empty(1, device="cuda")
print("KEYS", json.dumps(sorted(torch.cuda.memory_stats())))
"""


def _keys(out):
    return set(json.loads([l for l in out.splitlines() if l.startswith("KEYS")][0][5:]))


@pytest.mark.parametrize("pool", POOLS)
def test_memory_api_answers_with_pytorchs_keys_and_the_pools_figures(torch_gpu, pool):
    native = _keys(ok(run_py(NATIVE_KEYS)))
    out = ok(run_py(INSTALL + """
import json, os
assert torch.cuda.memory._get_current_allocator().allocator() is not None
xs = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in (1000, 1 << 20, 5 << 20, 37 << 20)]
s = gpupool.stats(0)
st = torch.cuda.memory_stats()
print("KEYS", json.dumps(sorted(st)))
assert torch.cuda.memory_allocated() == s["used_bytes"] == st["allocated_bytes.all.current"], (st, s)
assert torch.cuda.memory_reserved() == s["total_bytes"], (torch.cuda.memory_reserved(), s)
assert st["requested_bytes.all.current"] == s["requested_bytes"] == 1000 + (43 << 20), (st, s)
assert st["allocation.all.current"] == 4 and st["allocation.small_pool.current"] == 2, st
assert st["allocation.large_pool.current"] == 2 and st["num_device_alloc"] >= 1, st
peak = torch.cuda.max_memory_allocated()
del xs[2:]
assert torch.cuda.max_memory_allocated() == peak > torch.cuda.memory_allocated(), peak
torch.cuda.reset_peak_memory_stats()
s = gpupool.stats(0)
assert torch.cuda.max_memory_allocated() == torch.cuda.memory_allocated() == s["used_bytes"], s
assert torch.cuda.max_memory_reserved() == torch.cuda.memory_reserved() == s["peak_total_bytes"] == s["total_bytes"], s
torch.cuda.reset_accumulated_memory_stats()
st = torch.cuda.memory_stats()
assert st["allocation.all.allocated"] == 0 and st["allocation.all.freed"] == 0 and st["num_device_alloc"] == 0, st
text = torch.cuda.memory_summary()
assert "PyTorch CUDA memory summary" in text and "Allocated memory" in text, text
del xs
before = torch.cuda.memory_reserved()
torch.cuda.empty_cache()
assert torch.cuda.memory_reserved() == gpupool.stats(0)["total_bytes"] <= before, (before, torch.cuda.memory_reserved())
# A caching strategy gives its cache back; "none" caches nothing, so nothing is left to give.
assert torch.cuda.memory_reserved() < before or (os.environ["GPUPOOL_POOL"] == "none" and before == 0), before
torch.cuda.set_per_process_memory_fraction(0.25)
_, total = torch.cuda.mem_get_info()
assert abs(gpupool.get_limit(0) - total // 4) <= 1, (gpupool.get_limit(0), total)
if hasattr(torch.cuda, "get_per_process_memory_fraction"):
    assert torch.cuda.get_per_process_memory_fraction() == 0.25
print("ok")
""", env={"GPUPOOL_POOL": pool}))
    assert "ok" in out
    assert _keys(out) == native, _keys(out) ^ native


# A conv net trained with cuDNN's benchmark mode (its workspace is sized by the allocator's
# cacheInfo, which PyTorch's plug-in class refuses), and its losses.
CONV = """
import torch
torch.manual_seed(0)
torch.backends.cudnn.benchmark = True
torch.backends.cudnn.deterministic = True
model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(16, 32, 3),
                            torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                            torch.nn.Linear(32, 10)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.05)
g = torch.Generator(device="cuda").manual_seed(1)
losses = []
for step in range(12):
    side = 24 + 4 * (step % 3)   # a few shapes: cuDNN benchmarks each
    x = torch.randn(16, 3, side, side, device="cuda", generator=g)
    y = torch.randint(0, 10, (16,), device="cuda", generator=g)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
    losses.append(loss.item())
print("LOSSES", losses)
"""


def _losses(out):
    return eval([l for l in out.splitlines() if l.startswith("LOSSES")][0][7:])


@pytest.mark.parametrize("pool", POOLS)
def test_cudnn_benchmark_mode_trains_as_native(torch_gpu, pool):
    native = _losses(ok(run_py(CONV)))
    pooled = _losses(ok(run_py(INSTALL + CONV, env={"GPUPOOL_POOL": pool})))
    assert len(native) == len(pooled) == 12
    for a, b in zip(native, pooled):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(a)), (native, pooled)


def test_memory_history_and_a_snapshot_that_memory_viz_renders(torch_gpu, tmp_path):
    path = tmp_path / "snap.pickle"
    ok(run_py(INSTALL + f"""
import pickle
from torch.cuda import _memory_viz
torch.cuda.memory._record_memory_history(max_entries=100000)
assert torch._C._cuda_isHistoryEnabled() if hasattr(torch._C, "_cuda_isHistoryEnabled") else True
def make():
    return torch.randn(1 << 20, device="cuda")
a = make()
b = a * 2
del a
snap = torch.cuda.memory._snapshot()
actions = [e["action"] for e in snap["device_traces"][0]]
assert "alloc" in actions and "free_requested" in actions and "free_completed" in actions, actions
allocs = [e for e in snap["device_traces"][0] if e["action"] == "alloc"]
assert any(any(f["name"] == "make" for f in e["frames"]) for e in allocs), allocs[:2]
live = [blk for seg in snap["segments"] for blk in seg["blocks"] if blk["state"] == "active_allocated"]
assert any(blk["size"] == 4 << 20 for blk in live), snap["segments"]
assert any(blk.get("frames") for blk in live), live
torch.cuda.memory._dump_snapshot({str(path)!r})
torch.cuda.memory._record_memory_history(enabled=None)
with open({str(path)!r}, "rb") as f:
    data = pickle.load(f)
html = _memory_viz.trace_plot(data)
assert "<html" in html.lower() or "<!doctype" in html.lower(), html[:200]
svg = _memory_viz.segment_plot(data)
assert len(svg) > 100
print("ok", len(actions))
"""))


def test_mempool_allocates_from_a_private_pool_that_goes_back_when_it_is_gone(torch_gpu):
    ok(run_py(INSTALL + """
import gc
x = torch.randn(1 << 18, device="cuda")          # the main pool
pool = torch.cuda.MemPool()
assert pool.use_count() == 1, pool.use_count()
with torch.cuda.use_mem_pool(pool):
    a = torch.randn(3 << 20, device="cuda")
    b = a * 3
segs = torch.cuda.memory_snapshot()
mine = [s for s in segs if tuple(s["segment_pool_id"]) == tuple(pool.id)]
assert mine and sum(s["allocated_size"] for s in mine) >= 2 * (12 << 20), segs
assert "Private pools" in gpupool.memory_status(0), gpupool.memory_status(0)
assert torch.allclose(b, a * 3)
c = torch.randn(10, device="cuda")               # outside: the main pool again
assert not any(tuple(s["segment_pool_id"]) == tuple(pool.id) and any(
    blk["address"] == c.data_ptr() for blk in s["blocks"]) for s in torch.cuda.memory_snapshot())
reserved = gpupool.stats(0)["total_bytes"]
del a, b, pool
gc.collect()
torch.cuda.synchronize()
assert "Private pools" not in gpupool.memory_status(0), gpupool.memory_status(0)
assert gpupool.stats(0)["total_bytes"] <= reserved - (24 << 20), (reserved, gpupool.stats(0))
print("ok")
"""))


def test_a_mempool_over_another_allocator_takes_its_memory_from_it(torch_gpu):
    # vLLM's sleep mode and symmetric memory build MemPools over plug-in allocators: the
    # allocations in such a pool are made and freed (here the plug-in is gpupool's own
    # functions, so its block shows in the pool's count), and PyTorch's books count them.
    ok(run_py(INSTALL + """
alloc = torch.cuda.memory.CUDAPluggableAllocator(gpupool.library_path(), "gpupool_torch_malloc", "gpupool_torch_free")
pool = torch.cuda.MemPool(alloc._allocator)
before = gpupool.stats(0)
counted = torch.cuda.memory_allocated()
with torch.cuda.use_mem_pool(pool):
    a = torch.ones(1 << 20, device="cuda")
mid = gpupool.stats(0)
assert mid["n_live_blocks"] == before["n_live_blocks"] + 1, (before, mid)
assert torch.cuda.memory_allocated() == counted + (4 << 20), (counted, torch.cuda.memory_allocated())
assert a.sum().item() == 1 << 20
del a
torch.cuda.synchronize()
assert gpupool.stats(0)["n_live_blocks"] == before["n_live_blocks"], gpupool.stats(0)
print("ok")
"""))


def test_cuda_graphs_capture_and_replay_through_the_class(torch_gpu):
    ok(run_py(INSTALL + """
x = torch.randn(1 << 16, device="cuda")
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    y = x * 2 + 1
torch.cuda.current_stream().wait_stream(s)
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    y = x * 2 + 1
    z = y.sin()
for v in (1.0, 2.0, 3.0):
    x.fill_(v)
    g.replay()
    torch.cuda.synchronize()
    assert torch.allclose(z, (x * 2 + 1).sin()), v
del g, y, z
print("ok")
"""))


SHARE = """
import sys, time
import torch, torch.multiprocessing as mp
import gpupool


def consumer(q, back):
    try:
        gpupool.torch.install(compiled=True)
        for _ in range(3):
            msg = q.get(timeout=60)
            sums = [float(t.double().sum().item()) for t in msg]
            for t in msg:
                t.add_(1)
            torch.cuda.synchronize()
            back.put(sums)
            del msg, t
        back.put(gpupool.torch.route())
    except BaseException as e:   # the producer says what went wrong here
        import traceback
        back.put("consumer failed: " + traceback.format_exc())
        raise


def reply(back):
    got = back.get(timeout=60)
    if isinstance(got, str) and got.startswith("consumer failed"):
        raise SystemExit(got)
    return got


if __name__ == "__main__":
    gpupool.torch.install(compiled=True)
    from multiprocessing.reduction import ForkingPickler
    from torch.multiprocessing import reductions as R
    assert ForkingPickler._extra_reducers[torch.Tensor] is R.reduce_tensor   # PyTorch's own reductions
    ctx = mp.get_context("spawn")
    q, back = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=consumer, args=(q, back))
    p.start()
    g = torch.Generator(device="cuda").manual_seed(3)
    for round in range(3):
        base = torch.randn(3 << 20, device="cuda", generator=g)
        ts = [base, base[1000:5000], torch.randn(100, device="cuda", generator=g),
              torch.ones(7 << 20, dtype=torch.bfloat16, device="cuda")]
        want = [float(t.double().sum().item()) for t in ts]
        before = [t.clone() for t in ts]
        q.put(ts)
        got = reply(back)
        assert all(abs(a - b) <= 1e-3 * max(1, abs(a)) for a, b in zip(want, got)), (want, got)
        torch.cuda.synchronize()
        # The consumer's writes landed in this process's memory (base's view saw it twice).
        assert torch.equal(ts[0][:1000], before[0][:1000] + 1) and torch.equal(ts[2], before[2] + 1)
        held = gpupool.stats(0)["used_bytes"]
        del ts, base, before
        for _ in range(200):       # the storages go once the consumer let go
            torch.cuda.ipc_collect()
            if gpupool.stats(0)["used_bytes"] < held - (48 << 20):
                break
            time.sleep(0.05)
        assert gpupool.stats(0)["used_bytes"] < held - (48 << 20), (held, gpupool.stats(0))
    assert reply(back) == "allocator"
    p.join(60)
    assert p.exitcode == 0, p.exitcode
    print("shared")
"""


@pytest.mark.parametrize("pool", POOLS)
def test_torch_multiprocessing_goes_through_pytorchs_own_reductions(torch_gpu, pool, tmp_path):
    script = tmp_path / "share.py"
    script.write_text(SHARE)
    assert "shared" in ok(run_script(script, [], env={"GPUPOOL_POOL": pool}, timeout=300))


LIGHTNING = """
import gpupool, torch
gpupool.torch.install(compiled=True)
import lightning.pytorch as pl
from lightning.pytorch.callbacks import DeviceStatsMonitor
from lightning.pytorch.loggers import CSVLogger


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(64, 4)

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


data = torch.utils.data.TensorDataset(torch.randn(256, 64), torch.randint(0, 4, (256,)))
trainer = pl.Trainer(accelerator="gpu", devices=1, max_epochs=1, log_every_n_steps=1, enable_progress_bar=False,
                     callbacks=[DeviceStatsMonitor()], logger=CSVLogger({dir!r}), enable_checkpointing=False)
trainer.fit(Net(), torch.utils.data.DataLoader(data, batch_size=32))
keys = [k for k in trainer.logged_metrics] + list(trainer.callback_metrics)
import glob, csv
rows = list(csv.DictReader(open(glob.glob({dir!r} + "/**/metrics.csv", recursive=True)[0])))
cols = rows[0].keys()
stats = [c for c in cols if "allocated_bytes.all.current" in c]
assert stats, list(cols)
assert any(float(r[stats[0]] or 0) > 0 for r in rows), stats
print("lightning", len(rows), stats[0])
"""


def test_lightning_device_stats_monitor_logs_memory_stats(torch_gpu, tmp_path):
    try:
        import lightning  # noqa: F401
    except ImportError:
        pytest.skip("lightning is not installed")
    assert "lightning" in ok(run_py(LIGHTNING.format(dir=str(tmp_path)), timeout=600))


HF_TRAINER = """
import gpupool, torch
gpupool.torch.install(compiled=True)
import transformers
cfg = transformers.BertConfig(vocab_size=500, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                              intermediate_size=128, num_labels=3)
model = transformers.BertForSequenceClassification(cfg)


class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return {{"input_ids": torch.randint(0, 500, (16 + i % 8,), generator=g), "labels": i % 3}}


def collate(items):
    n = max(len(x["input_ids"]) for x in items)
    ids = torch.zeros(len(items), n, dtype=torch.long)
    for i, x in enumerate(items):
        ids[i, :len(x["input_ids"])] = x["input_ids"]
    return {{"input_ids": ids, "labels": torch.tensor([x["labels"] for x in items])}}


args = transformers.TrainingArguments(output_dir={dir!r}, per_device_train_batch_size=8, num_train_epochs=1,
                                      skip_memory_metrics=False, report_to=[], save_strategy="no",
                                      logging_steps=2, disable_tqdm=True)
out = transformers.Trainer(model=model, args=args, train_dataset=Data(), data_collator=collate).train()
m = out.metrics
assert "train_mem_gpu_alloc_delta" in m and "train_mem_gpu_peaked_delta" in m, m
print("trainer", m["train_mem_gpu_alloc_delta"], m["train_mem_gpu_peaked_delta"])
"""


def test_hugging_face_trainer_reports_its_memory_metrics(torch_gpu, tmp_path):
    try:
        import transformers  # noqa: F401
    except ImportError:
        pytest.skip("transformers is not installed")
    assert "trainer" in ok(run_py(HF_TRAINER.format(dir=str(tmp_path)), timeout=600))


TIMM = """
import gpupool, torch
gpupool.torch.install(compiled=True)
import timm
torch.backends.cudnn.benchmark = True
model = timm.create_model("resnet18", pretrained=False, num_classes=10).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(4):
    x = torch.randn(8, 3, 96 + 32 * (step % 2), 96 + 32 * (step % 2), device="cuda")
    loss = model(x).logsumexp(1).mean()
    opt.zero_grad(); loss.backward(); opt.step()
torch.cuda.synchronize()
print("timm", torch.cuda.max_memory_allocated(), torch.cuda.memory_reserved())
"""


def test_timm_resnet_trains_with_cudnn_benchmark(torch_gpu):
    try:
        import timm  # noqa: F401
    except ImportError:
        pytest.skip("timm is not installed")
    assert "timm" in ok(run_py(TIMM, timeout=600))


def _class_built(env=None):
    """Build the allocator class (where needed) or skip saying why it cannot be."""
    p = run_py("import gpupool._torch_allocator as t; print('AT', t.build())", env=env, timeout=600)
    if p.returncode != 0:
        pytest.skip(f"gpupool's PyTorch allocator class cannot be built here: {p.stderr.strip().splitlines()[-1:]}")
    return p.stdout.split("AT ")[1].strip()


def test_install_of_a_built_class_loads_no_build_machinery_or_inductor(library, torch_importable):
    """A process after the first build: install() takes the built library without importing
    cpp_extension (setuptools with it), and defers inductor's configuration (seconds to
    import) to the moment the program imports it, which then captures with plain graphs."""
    _class_built()
    out = ok(run_py("""
        import sys, gpupool, torch
        gpupool.torch.install()
        assert gpupool.torch.route() == "allocator", gpupool.torch.route()
        heavy = [m for m in ("torch.utils.cpp_extension", "setuptools", "torch._inductor.config") if m in sys.modules]
        assert not heavy, heavy
        import importlib.util
        assert importlib.util.find_spec("torch._inductor.config") is not None  # a probe first
        import torch._inductor.config as ic
        assert ic.triton.cudagraph_trees is False
        assert type(ic.__loader__).__name__ == "SourceFileLoader", ic.__loader__  # the module's own loader
        print("ok")
    """))
    assert out.strip() == "ok"


def test_install_leaves_cuda_unstarted_until_the_first_cuda_work(library, torch_importable):
    """install() starts neither PyTorch's CUDA nor the driver (the class learns the devices
    when PyTorch starts CUDA, as PyTorch's own allocator does): a process that installs
    gpupool pays CUDA's start where a native one does, at its first CUDA work."""
    _class_built()
    out = ok(run_py("""
        import json, sys, torch
        def driver_loaded():
            with open("/proc/self/maps") as f:
                return "libcuda.so" in f.read()
        before = driver_loaded()
        import gpupool
        gpupool.torch.install()
        print(json.dumps({"route": gpupool.torch.route(), "before": before, "after": driver_loaded(),
                          "started": torch.cuda.is_initialized(), "gpu": torch.cuda.is_available()}))
        if torch.cuda.is_available():
            x = torch.ones(1 << 20, device="cuda")
            assert torch.cuda.memory_allocated() >= 4 << 20, torch.cuda.memory_allocated()
            assert gpupool.stats()["used_bytes"] >= 4 << 20  # the tensor is the pool's
            assert int(x.sum().item()) == 1 << 20
            print("first tensor ok")
    """))
    state = json.loads(out.splitlines()[0])
    assert state["route"] == "allocator"
    assert state["started"] is False, state
    assert state["after"] == state["before"], f"install() loaded the CUDA driver: {state}"
    if state["gpu"]:
        assert out.splitlines()[1] == "first tensor ok"


def test_first_builds_started_at_once_agree(library, torch_importable, tmp_path):
    """Processes that all find no built class (an empty extension cache) and start together:
    one build, every process installs the same library, and the next process loads it."""
    env = {"TORCH_EXTENSIONS_DIR": str(tmp_path)}
    import subprocess
    import sys

    from conftest import _env
    code = "import gpupool, torch; gpupool.torch.install(compiled=True); " \
           "import gpupool._torch_allocator as t; print('AT', t.build())"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=_env(env), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=600) for p in procs]
    if any(p.returncode for p in procs) and all("could not be installed" in e for _, e in outs):
        pytest.skip(f"gpupool's PyTorch allocator class cannot be built here: {outs[0][1].strip()[-300:]}")
    for p, (o, e) in zip(procs, outs):
        assert p.returncode == 0, e
    paths = {o.split("AT ")[1].strip() for o, _ in outs}
    assert len(paths) == 1 and next(iter(paths)).startswith(str(tmp_path)), paths
    assert _class_built(env) == next(iter(paths))


def test_pytorch_allocator_settings_are_named_with_their_gpupool_equivalents(library):
    # The message alone (no torch needed): every key gpupool replaces, once, with its
    # equivalent; PyTorch's pinned-memory keys still apply and are not named.
    out = ok(run_py("""
        import gpupool.torch as gt
        assert gt.alloc_conf_warning({}) is None
        assert gt.alloc_conf_warning({"PYTORCH_CUDA_ALLOC_CONF": "pinned_use_cuda_host_register:True"}) is None
        assert gt.alloc_conf_warning({"PYTORCH_CUDA_ALLOC_CONF": "backend:native, expandable_segments:False,"}) is None
        b = gt.alloc_conf_warning({"PYTORCH_CUDA_ALLOC_CONF": "roundup_power2_divisions:[256:1,512:2,>:8]"})
        assert b.count("no gpupool equivalent") == 1 and "'roundup_power2_divisions:[256:1,512:2,>:8]'" in b, b
        m = gt.alloc_conf_warning({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,max_split_size_mb:128",
                                   "PYTORCH_ALLOC_CONF": "per_process_memory_fraction:0.5,roundup_power2_divisions:4"})
        for part in ("'expandable_segments:True': gpupool's default strategy, GPUPOOL_POOL=arena",
                     "'max_split_size_mb:128': none needed",
                     "'per_process_memory_fraction:0.5': GPUPOOL_MEMORY_LIMIT=<percent>%",
                     "'roundup_power2_divisions:4': no gpupool equivalent", "they are ignored"):
            assert part in m, (part, m)
        print("ok")
    """))
    assert out.strip() == "ok"


def test_install_warns_once_about_pytorch_allocator_settings(library, torch_importable):
    _class_built()
    p = run_py("""
        import warnings, gpupool, torch
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            gpupool.torch.install()
        ours = [str(x.message) for x in w if "PyTorch's allocator settings" in str(x.message)]
        assert len(ours) == 1 and "garbage_collection_threshold:0.6" in ours[0], [str(x.message) for x in w]
        print("ok")
    """, env={"PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.6"})
    assert ok(p).strip() == "ok"
