"""``mfu_datasheet``: the FLOPs' time at the GPU's published dense peak over the step's.

The table (stepprof/_datasheet.py) is data with a source for each part; the step records, the
flops record, the summary and the report carry the figure, or null with the reason: a part not
in the table, FLOPs given without their dtypes, a dtype the datasheet gives no rate for, the CPU.
"""

from __future__ import annotations

import json

import pytest
import torch

import stepprof
from stepprof._cli import main as cli
from stepprof._datasheet import PARTS, datasheet_ms, find_part
from stepprof._recorder import flops as flops_hook

from .conftest import make


def _mlp():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def _run(log, gpu, monkeypatch, device_name, **kw):
    monkeypatch.setattr(flops_hook, "device_name", lambda index: device_name)
    gpu.index = 0
    model, _ = _mlp()
    kw.setdefault("flops", "auto")
    with make(log, gpu, warmup=1, **kw) as prof:
        for _ in range(5):
            with prof.step(batch_size=32):
                gpu.launch(2.0)
                model(torch.randn(32, 64)).square().mean().backward()
                gpu.host(1.0)
    return prof.summary


def test_the_table_is_data_with_a_source_for_every_part():
    names = [n.lower() for p in PARTS for n in p.device_names]
    assert len(names) == len(set(names)) and len(PARTS) >= 8
    for p in PARTS:
        assert p.source.startswith("https://"), p.name
        assert p.tflops and all(v > 0 for v in p.tflops.values()), p.name
        assert set(p.tflops) <= {"bf16", "fp16", "tf32", "fp32", "fp8", "fp64"}, p.name
        if "bf16" in p.tflops and "tf32" in p.tflops:  # dense tensor rates: TF32 is half of BF16 (as
            # rounded on the datasheets: B200's 1,100 against 2,250), never a sparse one beside a dense one
            assert p.tflops["tf32"] == pytest.approx(p.tflops["bf16"] / 2, rel=0.05), p.name
        assert p.tflops.get("fp16") == p.tflops.get("bf16"), p.name


def test_a_part_is_found_by_the_name_torch_gives_it():
    part, why = find_part("NVIDIA H100 80GB HBM3")
    assert why is None and part is not None and part.tflops["bf16"] == pytest.approx(989.4, rel=1e-3)
    assert find_part("  nvidia   h100 80gb hbm3 ")[0] is part  # case and spacing aside
    part, why = find_part("NVIDIA GeForce GTX 780")
    assert part is None and "NVIDIA GeForce GTX 780 is not in stepprof's datasheet table" in why
    assert "stepprof calibrate" in why


def test_the_time_the_flops_need_sums_each_dtype_at_its_peak():
    part, _ = find_part("NVIDIA H100 80GB HBM3")
    ms, why = datasheet_ms({"bf16": part.tflops["bf16"] * 1e12, "fp32": 0}, part)
    assert why is None and ms == pytest.approx(1000.0)
    ms, why = datasheet_ms({"bf16": 1e12, "int8": 1e12}, part)
    assert ms is None and "int8" in why and "gives no dense int8 rate" in why


def test_each_step_and_the_summary_carry_mfu_datasheet(log, gpu, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("STEPPROF_CACHE_DIR", str(tmp_path / "cache"))  # no calibration: mfu is null
    summary = _run(log, gpu, monkeypatch, "NVIDIA H100 80GB HBM3")
    part, _ = find_part("NVIDIA H100 80GB HBM3")
    flops = next(stepprof.read(log, kind="flops"))
    assert flops["datasheet"] == {"part": part.name, "tflops": dict(part.tflops), "source": part.source}
    by_dtype = flops["flops_by_dtype"]
    assert set(by_dtype) == {"fp32"}  # float32 matmuls at precision "highest"
    need = by_dtype["fp32"] / (part.tflops["fp32"] * 1e12) * 1e3
    assert flops["datasheet_ms"] == pytest.approx(need)
    timed = [r for r in stepprof.read(log, kind="step") if not r["warmup"] and not r.get("flops_counted")]
    assert len(timed) >= 3
    for r in timed:
        assert r["mfu_datasheet"] == pytest.approx(need / max(r["wall_ms"], r["gpu_ms"]))
        assert r["mfu"] is None and "calibration" in r["unavailable"]["mfu"]
    assert summary.mfu_datasheet_median == pytest.approx(need / max(timed[0]["wall_ms"], timed[0]["gpu_ms"]))
    assert "mfu_datasheet_median" not in summary.unavailable
    assert "of datasheet" in str(summary)
    capsys.readouterr()
    assert cli(["report", log, "--json"]) == 0
    (run,) = json.loads(capsys.readouterr().out)["logs"][0]["runs"]
    assert run["figures"]["mfu_datasheet_median"] == pytest.approx(summary.mfu_datasheet_median)


@pytest.mark.parametrize("device_name, kw, says", [
    ("NVIDIA GeForce GTX 780", {}, "NVIDIA GeForce GTX 780 is not in stepprof's datasheet table"),
    ("NVIDIA H100 80GB HBM3", {"flops": None, "flops_per_step": 1e9}, "needs the FLOPs' dtypes"),
])
def test_a_null_mfu_datasheet_says_why_in_the_steps_and_the_summary(log, gpu, monkeypatch, tmp_path,
                                                                    device_name, kw, says):
    monkeypatch.setenv("STEPPROF_CACHE_DIR", str(tmp_path / "cache"))
    summary = _run(log, gpu, monkeypatch, device_name, **kw)
    timed = [r for r in stepprof.read(log, kind="step") if not r["warmup"]]
    assert timed and all(r["mfu_datasheet"] is None and says in r["unavailable"]["mfu_datasheet"] for r in timed)
    assert summary.mfu_datasheet_median is None and says in summary.unavailable["mfu_datasheet_median"]
    flops = next(stepprof.read(log, kind="flops"))
    assert flops["datasheet_ms"] is None and says in flops["unavailable"]["datasheet_ms"]


def test_on_the_cpu_mfu_datasheet_is_null_with_the_reason(tmp_path):
    log = str(tmp_path / "cpu.jsonl")
    model, _ = _mlp()
    with stepprof.Profiler(log, device="cpu", flops="auto", warmup=1) as prof:
        for _ in range(4):
            with prof.step(batch_size=32):
                model(torch.randn(32, 64)).sum().backward()
    timed = [r for r in stepprof.read(log, kind="step") if not r["warmup"] and not r.get("flops_counted")]
    assert timed and all(r["mfu_datasheet"] is None for r in timed)
    assert "for GPUs" in timed[0]["unavailable"]["mfu_datasheet"]
    assert "for GPUs" in prof.summary.unavailable["mfu_datasheet_median"]
