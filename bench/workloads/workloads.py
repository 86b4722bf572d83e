"""The workloads of bench/workloads/bench_workloads.py and their model: a small transformer
(build_model), then training, tokens, serving and churn. Each takes (torch, recorder,
config, measured steps) and returns a fingerprint string of its outputs.

Separate from bench_workloads.py (command line, configuration, run and all modes) and from
workloads_measure.py (allocator probe, step recorder): what is measured, apart from how.
Imported by bench_workloads.py, whose directory is on sys.path. Does not import torch (it
is handed in), so --help works without it.
"""
import collections
import math
import os
import random


# --------------------------------------------------------------------------- model

def build_model(torch, vocab, d, layers, heads):
    nn, F = torch.nn, torch.nn.functional
    hd = d // heads

    def attend(q, k, v, mask):
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        if mask is not None:
            att = att.masked_fill(mask, float("-inf"))
        return att.softmax(-1) @ v

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.ln2, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def heads(self, x):  # [B, T, d] -> q, k, v as [B, H, T, hd]
            B, T, _ = x.shape
            return self.qkv(self.ln1(x)).view(B, T, 3, heads, hd).permute(2, 0, 3, 1, 4)

        def finish(self, x, y):  # attention output y [B, H, T, hd] -> next residual stream
            B, T, _ = x.shape
            x = x + self.proj(y.transpose(1, 2).reshape(B, T, d))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

        def forward(self, x):  # causal self-attention over the whole sequence
            q, k, v = self.heads(x)
            T = x.shape[1]
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
            return self.finish(x, attend(q, k, v, mask)), k, v

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

        def forward(self, tokens):  # [B, T] -> logits [B, T, vocab]
            x = self.emb(tokens)
            for b in self.blocks:
                x = b(x)[0]
            return self.head(self.ln_f(x))

        def prefill(self, prompt):  # [T] -> last logits [vocab], per-layer (k, v) [H, T, hd]
            x, caches = self.emb(prompt)[None], []
            for b in self.blocks:
                x, k, v = b(x)
                caches.append((k[0].contiguous(), v[0].contiguous()))
            return self.head(self.ln_f(x[0, -1])), caches

        def decode(self, tok, caches):  # tok [1] -> logits [vocab]; caches grow by one token
            x = self.emb(tok)[None]
            for i, b in enumerate(self.blocks):
                q, k, v = b.heads(x)
                kc, vc = caches[i]
                # The naive growth: a fresh, one-token-longer allocation per token and layer.
                kc, vc = torch.cat([kc, k[0]], dim=1), torch.cat([vc, v[0]], dim=1)
                caches[i] = (kc, vc)
                x = b.finish(x, attend(q[0], kc, vc, None)[None])
            return self.head(self.ln_f(x[0, -1]))

    torch.manual_seed(0)
    return Model().cuda()  # initialised on the CPU: identical weights whatever the GPU state


# --------------------------------------------------------------------------- workloads

# BENCH_SEED shifts every workload's random draws (shapes, sizes, arrivals, data): 0, the
# default, gives the sequences the recorded results were measured on; others give new
# sequences of the same kind, to test a policy on more than one draw (docs/arena.md).
SEED = int(os.environ.get("BENCH_SEED", "0"))


def training(torch, rec, c, steps):
    F = torch.nn.functional
    model = build_model(torch, c["vocab"], c["d"], c["layers"], c["heads"])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)
    rng, gen = random.Random(42 + SEED), torch.Generator().manual_seed(42 + SEED)
    losses, total = [], c["warmup"] + steps
    for i in range(total):
        if i == c["warmup"]:
            rec.mark_warm()
        # The first step runs the longest sequence, as training scripts do to fail fast on
        # memory: the peak shape is then part of the warm-up, and the measured steps show
        # what an allocator does once it has seen it.
        T = c["t_max"] if i == 0 else rng.randrange(c["t_min"], c["t_max"] + 1, c["t_step"])
        batch = torch.randint(c["vocab"], (c["batch"], T + 1), generator=gen).cuda()
        with rec.step():
            logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, c["vocab"]), batch[:, 1:].reshape(-1))
            del logits
            rec.sample()  # activations are at their peak here
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(f"{loss.item():.6g}")
        rec.progress(i, total, f"T={T} loss={losses[-1]}")
    return " ".join(losses)


def tokens(torch, rec, c, steps):
    F = torch.nn.functional
    model = build_model(torch, c["vocab"], c["d"], c["layers"], c["heads"])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)
    rng, gen = random.Random(4242 + SEED), torch.Generator().manual_seed(4242 + SEED)
    losses, total = [], c["warmup"] + steps
    for i in range(total):
        if i == c["warmup"]:
            rec.mark_warm()
        T = rng.randint(c["t_min"], c["t_max"])
        B = max(1, c["tokens"] // T)
        batch = torch.randint(c["vocab"], (B, T + 1), generator=gen).cuda()
        with rec.step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(batch[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, c["vocab"]).float(), batch[:, 1:].reshape(-1))
            del logits
            rec.sample()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(f"{loss.item():.6g}")
        rec.progress(i, total, f"T={T} B={B} loss={losses[-1]}")
    return " ".join(losses)


def serving(torch, rec, c, steps):
    model = build_model(torch, c["vocab"], c["d"], c["layers"], c["heads"]).eval()
    rng, gen = random.Random(7 + SEED), torch.Generator().manual_seed(7 + SEED)
    arrivals, t = collections.deque(), 0.0
    for _ in range(c["requests"]):  # arrival time (in iterations), prompt length, tokens to generate
        t += rng.expovariate(1.0 / c["mean_gap"])
        arrivals.append((t, rng.randint(*c["prompt"]), rng.randint(*c["gen"])))
    limit = None if steps is None else c["warmup"] + steps
    active, done_tokens, clock, it = [], 0, 0.0, 0
    with torch.inference_mode():  # everything, so done_sum stays an inference tensor throughout
        done_sum = torch.zeros((), dtype=torch.long, device="cuda")
        while (arrivals or active) and (limit is None or it < limit):
            if not active and arrivals[0][0] > clock:
                clock = arrivals[0][0]  # idle server: jump to the next arrival
            if it == c["warmup"]:
                rec.mark_warm()
            with rec.step():
                produced, fresh = 0, []
                while arrivals and arrivals[0][0] <= clock and len(active) + len(fresh) < c["max_active"]:
                    _, plen, ngen = arrivals.popleft()
                    prompt = torch.randint(c["vocab"], (plen,), generator=gen).cuda()
                    logits, caches = model.prefill(prompt)
                    tok = logits.argmax(-1, keepdim=True)
                    fresh.append({"caches": caches, "tok": tok, "out": [tok], "n": ngen})
                    produced += 1
                for r in active:  # one decode step per request, one request at a time
                    r["tok"] = model.decode(r["tok"], r["caches"]).argmax(-1, keepdim=True)
                    r["out"].append(r["tok"])
                    produced += 1
                active += fresh
                still = []
                for r in active:
                    if len(r["out"]) >= r["n"]:  # finished: its caches are freed here
                        done_sum += torch.cat(r["out"]).sum()
                        done_tokens += len(r["out"])
                    else:
                        still.append(r)
                active = still
            if rec.measuring:
                rec.tokens += produced
            rec.progress(it, limit, f"active={len(active)} queued={len(arrivals)}", every=100)
            clock += 1
            it += 1
        for r in active:  # cut short by BENCH_STEPS: count what the unfinished requests produced
            done_sum += torch.cat(r["out"]).sum()
            done_tokens += len(r["out"])
        return f"tokens={done_tokens} sum={int(done_sum.item())}"


def churn(torch, rec, c, steps):
    rng, lo, hi = random.Random(1234 + SEED), math.log(c["lo"]), math.log(c["hi"])
    allocated = 0

    def alloc():
        nonlocal allocated
        n = int(math.exp(rng.uniform(lo, hi)))
        allocated += n
        t = torch.empty(n, dtype=torch.uint8, device="cuda")
        t[0] = 1  # touch it: a real kernel writes into the block
        return t

    slots = [alloc() for _ in range(c["slots"])]
    total = c["warmup"] + steps
    for s in range(total):
        if s == c["warmup"]:
            rec.mark_warm()
        with rec.step():
            for op in range(c["ops"]):
                i = rng.randrange(c["slots"])
                slots[i] = None  # free first, as a program dropping its last reference does
                slots[i] = alloc()
                if op % 250 == 249:
                    rec.sample()
        rec.progress(s, total)
    return f"allocated_bytes={allocated}"
