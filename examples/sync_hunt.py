"""Finding stray syncs: two planted host-device syncs, caught by max_syncs and named by the report.

    python examples/sync_hunt.py [LOG]         # on a GPU; on the CPU there is nothing to wait on
"""

import sys

import torch

import stepprof

log = sys.argv[1] if len(sys.argv) > 1 else "sync_hunt.jsonl"
device = "cuda" if torch.cuda.is_available() else "cpu"
model = torch.nn.Linear(256, 256).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(128, 256, device=device)

with stepprof.Profiler(log, warmup=2, max_syncs=0) as prof:  # budget: no sync per step; "count" reports it
    for _ in range(20):
        with stepprof.profile_step(batch_size=len(x)):
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            if loss.item() > 1e9:  # planted sync 1: .item() waits for the GPU
                break
            last_norm = model.weight.detach().norm().cpu()  # planted sync 2: a copy to the host

print(prof.summary)
print(f"last weight norm {float(last_norm):.3f}")
if device == "cuda":
    # Strict mode turns a stray sync into an error at its line:
    try:
        with stepprof.Profiler(None, max_syncs=0, on_sync="raise"):
            with stepprof.profile_step():
                model(x).sum().item()
    except stepprof.SyncBudgetExceeded as e:
        print("caught:", e)
else:
    print("on the CPU the records say why syncs are n/a; run this on a GPU to see the two sites")
print(f"next: stepprof report {log}   (the top sync sites, with your lines)")
