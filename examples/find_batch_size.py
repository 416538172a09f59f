"""The batch-size sweep: samples/s and peak memory per batch size, a recommendation, and its plot.

    python examples/find_batch_size.py [LOG]   # writes LOG and, with matplotlib, LOG's .png
"""

import sys

import torch

import stepprof

log = sys.argv[1] if len(sys.argv) > 1 else "find_batch_size.jsonl"
device = "cuda" if torch.cuda.is_available() else "cpu"
model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 10)).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)


def train_step(batch):
    x, y = batch
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def make_batch(n):  # n real samples (here: random ones of the right shape)
    return torch.randn(n, 512, device=device), torch.randint(0, 10, (n,), device=device)


# On the CPU there is no memory limit to find: max_batch bounds the search (and the time).
result = stepprof.sweep(train_step, make_batch, restore=(model, opt), log=log,
                        max_batch=None if device == "cuda" else 256, time_budget_s=40)
print(result)
print("use batch size", result.recommended)
try:
    print("plot:", result.plot(log.removesuffix(".jsonl") + ".png"))
except ImportError as e:  # matplotlib is the [plot] extra
    print(f"no plot: {e}")
