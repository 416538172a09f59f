"""stepprof env / calibrate / python -m stepprof on CPU, and Profiler(flops=...).

The report itself is tested in tests/test_report_*.py, plot in tests/test_plot.py.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

import stepprof
from stepprof._recorder import flops as flops_hook
from stepprof._roofline import save_calibration

from . import logfixtures as fx
from .conftest import make
from .report_helpers import cli, h200_log  # noqa: F401 - h200_log is a fixture


def test_env_prints_and_json(capsys):
    rc, out, _ = cli(capsys, "env")
    assert rc == 0
    for key in (
        "torch",
        "PYTORCH_CUDA_ALLOC_CONF",
        "expandable segments",
        "NVML status",
        "sync detection",
        "calibration cache",
    ):
        assert key in out
    rc, out, _ = cli(capsys, "env", "--json")
    env = json.loads(out)
    assert env["torch"] == torch.__version__ and env["syncs"]["default"] == "warn"


def test_env_shows_a_calibration_figure_it_lacks_as_na_never_0(monkeypatch, tmp_path, capsys):
    from stepprof import _env

    monkeypatch.setenv("STEPPROF_CACHE_DIR", str(tmp_path / "cache"))
    save_calibration({"device_name": "NVIDIA H200", "matmul_tflops": {"bf16": 700.0, "fp32": None}})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(_env, "device_facts", lambda i: {
        "name": "NVIDIA H200", "capability": "9.0", "total_memory_bytes": 140 * 2**30, "multiprocessors": 132})
    rc, out, err = cli(capsys, "env")
    assert rc == 0 and "Traceback" not in err, err
    line = next(x for x in out.splitlines() if x.strip().startswith("calibration ") and "bf16" in x)
    assert "bf16 700 TFLOP/s" in line and "fp32 n/a" in line
    assert "copy n/a" in line and "n/a µs/op" in line and " 0 GB/s" not in line


def test_env_reads_the_allocator_config(monkeypatch, capsys):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    env = json.loads(cli(capsys, "env", "--json")[1])
    assert env["allocator"]["expandable_segments"] is True


def test_calibrate_without_cuda_is_a_clear_error(capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA is present")
    rc, out, err = cli(capsys, "calibrate")
    assert rc == 2 and "CUDA is not available" in err and "Traceback" not in err


def test_module_entry_point_runs_report(h200_log):
    import subprocess

    proc = subprocess.run(
        [sys.executable, "-m", "stepprof", "report", "--json", h200_log],
        capture_output=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["logs"][0]["runs"][0]["measured_steps"] == 197


def _mlp():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    return model, torch.optim.AdamW(model.parameters())


EXPECTED = 2 * 32 * 64 * 128 * 2 + 2 * 32 * 128 * 8 * 3  # fwd+weight grads of both, input grad of the second


def test_flops_auto_counts_one_step_on_the_cpu(log):
    model, opt = _mlp()
    with stepprof.Profiler(log, warmup=2, flops="auto", device="cpu") as prof:
        for _ in range(5):
            with prof.step(batch_size=32):
                model(torch.randn(32, 64)).square().mean().backward()
                opt.step()
                opt.zero_grad()
        assert prof._flops.retired  # off the step boundaries after the count
    recs = list(stepprof.read(log))
    flops = [r for r in recs if r["kind"] == "flops"]
    assert len(flops) == 1 and flops[0]["flops_per_step"] == EXPECTED
    assert flops[0]["flops_by_dtype"] == {"fp32": EXPECTED} and flops[0]["step"] == 2 and flops[0]["ops"] > 0
    steps = [r for r in recs if r["kind"] == "step"]
    assert [r["flops"] for r in steps] == [None, None, EXPECTED, EXPECTED, EXPECTED]
    assert [r.get("flops_counted") for r in steps] == [None, None, True, None, None]
    assert all(r["mfu"] is None and "CPU" in r["unavailable"]["mfu"] for r in steps[2:])
    assert steps[3]["tflops_per_s"] == pytest.approx(EXPECTED / (steps[3]["wall_ms"] * 1e-3) / 1e12)
    assert prof.summary.tflops_per_s_median is not None and prof.summary.mfu_median is None
    assert recs.index(flops[0]) == recs.index(steps[2]) + 1


def test_no_flops_requested_leaves_records_and_boundaries_alone(log):
    with stepprof.Profiler(log) as prof:
        assert prof._flops is None
        with prof.step():
            pass
        assert prof._boundaries.hooks.begin == ()  # the compile hook's look at the first step is done
    rec = next(stepprof.read(log, kind="step"))
    assert "flops" not in rec and "mfu" not in rec
    assert "not requested" in prof.summary.unavailable["mfu_median"]


def test_flops_arguments_are_checked():
    with pytest.raises(stepprof.ConfigError, match="'flops' must be 'auto' or None"):
        stepprof.Profiler(None, flops="yes")
    with pytest.raises(stepprof.ConfigError, match="'flops_per_step' must be a positive"):
        stepprof.Profiler(None, flops_per_step=-1)
    with pytest.raises(stepprof.ConfigError, match="not both"):
        stepprof.Profiler(None, flops="auto", flops_per_step=10)


def test_mfu_uses_the_cached_calibration(log, gpu, monkeypatch, tmp_path):
    monkeypatch.setenv("STEPPROF_CACHE_DIR", str(tmp_path / "cache"))
    save_calibration({k: v for k, v in fx.CALIBRATION.items() if k != "calibration_version"})
    monkeypatch.setattr(flops_hook, "device_name", lambda index: "NVIDIA H200")
    gpu.index = 0
    model, opt = _mlp()
    with make(log, gpu, warmup=1, flops="auto") as prof:
        for _ in range(4):
            with prof.step(batch_size=32):
                gpu.launch(2.0)
                model(torch.randn(32, 64)).square().mean().backward()
                gpu.host(1.0)
    steps = list(stepprof.read(log, kind="step"))
    ideal = EXPECTED / 52e12 * 1e3  # fp32 matmuls at float32 precision "highest": the fp32 rate
    for r in steps[2:]:
        assert r["mfu"] == pytest.approx(ideal / max(r["wall_ms"], r["gpu_ms"]))
    flops = next(stepprof.read(log, kind="flops"))
    assert flops["calibration"]["matmul_tflops"]["fp32"] == 52.0 and flops["ideal_ms"] == pytest.approx(ideal)


def test_flops_given_by_the_user(log, gpu, monkeypatch, tmp_path):
    monkeypatch.setenv("STEPPROF_CACHE_DIR", str(tmp_path / "cache"))
    with make(log, gpu, flops_per_step=1e12) as prof:
        with prof.step():
            gpu.launch(5.0)
            gpu.host(1.0)
    rec = next(stepprof.read(log, kind="step"))
    assert rec["flops"] == 1e12 and rec["tflops_per_s"] == pytest.approx(1e12 / 5e-3 / 1e12, rel=0.05)
    assert rec["mfu"] is None and "calibration" in rec["unavailable"]["mfu"]


def test_a_failing_counted_step_is_counted_again(log):
    model, opt = _mlp()
    with stepprof.Profiler(log, flops="auto") as prof:
        with pytest.raises(ValueError):
            with prof.step():
                model(torch.randn(32, 64)).sum()
                raise ValueError("boom")
        with prof.step():
            model(torch.randn(32, 64)).square().mean().backward()
    flops = next(stepprof.read(log, kind="flops"))
    assert flops["step"] == 1 and flops["flops_per_step"] == EXPECTED


def test_flops_auto_keeps_torch_compile_compiled(log):
    model, _ = _mlp()
    compiles, runs = [], []

    def backend(gm, example_inputs):
        compiles.append(1)

        def run(*args):
            runs.append(1)
            return gm.forward(*args)

        return run

    compiled = torch.compile(model, backend=backend)
    x = torch.randn(32, 64)
    with stepprof.Profiler(log, warmup=1, flops="auto") as prof:
        for _ in range(4):
            with prof.step():
                compiled(x).sum()
    assert len(compiles) == 1
    assert len(runs) == 3  # warm-up, then the two steps after the eagerly counted one
    assert next(stepprof.read(log, kind="flops"))["flops_per_step"] == 2 * 32 * 64 * 128 + 2 * 32 * 128 * 8


@pytest.fixture
def fp32_precision():
    """Restores torch's TF32 flags of the API added in torch 2.9 after a test sets them."""
    if not hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        pytest.skip("this torch has no fp32_precision flags")
    flags = [torch.backends, torch.backends.cuda.matmul, torch.backends.cudnn.conv, torch.backends.cudnn.rnn]
    saved = [f.fp32_precision for f in flags]
    yield
    for f, value in zip(flags, saved, strict=True):
        f.fp32_precision = value


def test_flops_auto_reads_torchs_fp32_precision_api_and_never_breaks_the_step(log, fp32_precision):
    # torch >= 2.9's way to allow TF32; torch.get_float32_matmul_precision() and
    # torch.backends.cudnn.allow_tf32 raise RuntimeError once it is used.
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    torch.backends.cudnn.conv.fp32_precision = "ieee"
    model, _ = _mlp()
    conv = torch.nn.Conv2d(3, 4, 3)
    with stepprof.Profiler(log, warmup=0, flops="auto") as prof:
        with prof.step():
            model(torch.randn(32, 64)).square().mean().backward()
            conv(torch.randn(1, 3, 8, 8))
    flops = next(stepprof.read(log, kind="flops"))
    assert flops["flops_by_dtype"] == {"tf32": EXPECTED, "fp32": 2 * 4 * 6 * 6 * 3 * 3 * 3}
    assert next(stepprof.read(log, kind="step"))["error"] is None


def test_an_error_in_the_counter_is_a_reason_and_the_step_goes_on(log, monkeypatch):
    from stepprof import _roofline

    def broken(dtype, conv):
        raise RuntimeError("no dtype")

    monkeypatch.setattr(_roofline, "_dtype_key", broken)
    model, _ = _mlp()
    with stepprof.Profiler(log, warmup=0, flops="auto") as prof:
        with prof.step():
            model(torch.randn(32, 64)).sum()
    assert prof._flops.retired
    flops = next(stepprof.read(log, kind="flops"))
    assert flops["flops_per_step"] is None and "no dtype" in flops["unavailable"]["flops_per_step"]
    assert next(stepprof.read(log, kind="step"))["error"] is None


def test_a_step_that_ran_under_the_counter_is_flagged_although_the_count_failed(log, monkeypatch):
    from stepprof import _roofline

    stop = _roofline.FlopCount.stop

    def stop_then_fail(self):
        stop(self)
        raise RuntimeError("left uncleanly")

    monkeypatch.setattr(_roofline.FlopCount, "stop", stop_then_fail)
    model, _ = _mlp()
    with stepprof.Profiler(log, warmup=1, flops="auto") as prof:
        for _ in range(3):
            with prof.step():
                model(torch.randn(32, 64)).sum()
    steps = list(stepprof.read(log, kind="step"))
    # Step 1 ran eagerly under FlopCounterMode: its times include the counter's cost.
    assert [r.get("flops_counted") for r in steps] == [None, True, None]
    assert "left uncleanly" in steps[1]["unavailable"]["flops"]
