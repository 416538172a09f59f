"""Why nvidia-smi shows more than PyTorch: stepprof.memory_report() and its residual.

    python examples/memory.py [LOG]            # on a GPU; on the CPU each figure is None, with why
"""

import sys

import torch

import stepprof

log = sys.argv[1] if len(sys.argv) > 1 else "memory.jsonl"
device = "cuda" if torch.cuda.is_available() else "cpu"
model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024)).to(device)
opt = torch.optim.AdamW(model.parameters())

with stepprof.Profiler(log, warmup=2, memory_every=10) as prof:  # memory records every 10 steps
    for _ in range(20):
        with stepprof.profile_step(batch_size=64):
            model(torch.randn(64, 1024, device=device)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    report = stepprof.memory_report()  # also written to the log as a kind: "memory" record

print(report)
print(report.explanation)
print("residual (CUDA context and other, outside PyTorch):",
      report.residual_bytes if report.residual_bytes is not None else report.unavailable.get("residual_bytes"))
print(f"next: stepprof report {log}   (the memory lines; memory records: stepprof.read(log, kind='memory'))")
