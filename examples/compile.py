"""torch.compile under stepprof: steps that compile are left out of the figures, and a recompile is named.

    python examples/compile.py [LOG]           # on the CPU, inductor needs a C++ compiler
"""

import sys

import torch

import stepprof

log = sys.argv[1] if len(sys.argv) > 1 else "compile.jsonl"
device = "cuda" if torch.cuda.is_available() else "cpu"
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).to(device)
try:
    step_fn = torch.compile(model)
    step_fn(torch.randn(4, 32, device=device))  # compile once here, to know whether it can
except Exception as e:  # noqa: BLE001 - inductor may be unable to run here (no compiler)
    print(f"torch.compile cannot run here ({type(e).__name__}: {str(e)[:200]}); running eagerly")
    torch._dynamo.reset()
    step_fn = model

with stepprof.Profiler(log, warmup=0) as prof:
    for i in range(30):
        n = 16 if i < 15 else 24  # a new batch size at step 15: a recompile (or dynamic shapes)
        with stepprof.profile_step(batch_size=n):
            step_fn(torch.randn(n, 32, device=device)).sum().backward()

print(prof.summary)
print(f"next: stepprof report {log}   (compiled steps, compile time, the recompile's reason)")
