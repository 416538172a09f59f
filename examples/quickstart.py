"""A plain training loop with phases: stepprof.iterate, profile_step and measure.

    python examples/quickstart.py [LOG]        # then: stepprof report LOG; stepprof plot LOG
"""

import sys

import torch

import stepprof

log = sys.argv[1] if len(sys.argv) > 1 else "quickstart.jsonl"
device = "cuda" if torch.cuda.is_available() else "cpu"
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loss_fn = torch.nn.CrossEntropyLoss()
loader = [(torch.randn(32, 64), torch.randint(0, 10, (32,))) for _ in range(50)]

with stepprof.Profiler(log, warmup=5) as prof:          # closing writes the summary record
    for x, y in stepprof.iterate(loader):               # times the wait for each batch (data_ms)
        with stepprof.profile_step(batch=(x, y)):       # batch_size: the tensors' leading dimension
            with stepprof.measure("forward"):
                loss = loss_fn(model(x.to(device)), y.to(device))
            with stepprof.measure("backward"):
                loss.backward()
            with stepprof.measure("optimizer"):
                opt.step()
                opt.zero_grad()

print(prof.summary)
print(f"next: stepprof report {log}; stepprof plot {log}")
