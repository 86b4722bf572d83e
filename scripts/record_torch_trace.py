"""Record a GPUPOOL_TRACE of a small real PyTorch training loop (the shipped test data
tests/data/torch_mlp_trace.csv comes from this). Run on a GPU machine:
    GPUPOOL_TRACE=torch_mlp_trace.csv python3 scripts/record_torch_trace.py
"""
import torch
import gpupool

gpupool.torch.install()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                            torch.nn.Linear(1024, 10)).cuda()
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
for step in range(20):
    x = torch.randn(256, 512, device="cuda")
    y = torch.randint(0, 10, (256,), device="cuda")
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
torch.cuda.synchronize()
print("loss", loss.item(), gpupool.stats(0)["n_allocs"], "allocations")
